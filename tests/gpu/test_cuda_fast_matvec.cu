/*
 * test_cuda_fast_matvec.cu -- kiln_cuda_matvec_fast (src/ops/cuda/cuda_matmul.h) against
 * the CPU backend's matmul, for all 11 weight dtypes, odd and decode-sized shapes, N = 1..8,
 * with and without bias, accumulate 0 / 1.
 *
 * Checks per case:
 *  - accuracy vs the CPU reference (cpu->matmul on the same host bytes, plus the old output
 *    when accumulating). The kernel sums in another order than the CPU's lane-16 dot, so the
 *    bits differ by rounding. Bound, per element (t, r), with M = sum_i |x[t][i] w[r][i]| +
 *    |bias[r]| + |old[t][r]| and u = 2^-24: |gpu - cpu| <= (3C/32 + 64) u M. Justification:
 *    the weights are the same f32 values on both sides (exact dequantization), every product
 *    is fused, so each result is an f32 sum whose first-order error is at most (chain length
 *    + tree depth) u M: the GPU's per-thread chain is at most C/32 + 16 elements plus a 5-level
 *    warp tree and at most 7 combine additions, the CPU's lane chain C/16 + 1 plus a 4-level
 *    tree, plus the bias and accumulate additions; the sum of both bounds is below the one
 *    used. This cannot fail for a correct kernel, whatever the data's cancellation; a wrong
 *    or missing product (error ~ |x w| ~ M / C) exceeds it. In addition the normalised error
 *    max_r |gpu - cpu| / max_r M over each token's output row must be <= 1e-5 (the brief's
 *    budget; statistically the error is ~sqrt(C) u M, about 1e-7 here). Also printed: the
 *    error relative to max |cpu| over the row ("rel"), for information only -- it is not a
 *    criterion because a single-row output (R = 1) may cancel to almost zero.
 *  - outputs poisoned with NaN before each run (accumulate: preloaded with random values),
 *    so an unwritten element fails;
 *  - determinism: the aligned layout run twice, and a misaligned layout (w at an odd address,
 *    row_bytes padded by 3, x at a 4-byte but not 16-byte boundary: the kernel's byte-load
 *    path), must all give the same bits -- the order depends only on (dt, R, C, N).
 *  - argument validation (checked first, also without a GPU).
 * Exit: 0 all OK, 1 a failure, 77 no GPU (after the validation checks).
 * Usage: test_cuda_fast_matvec [seed]
 */
#include "ops/cuda/cuda_matmul.h"

extern "C" {
#include "base/base.h"
#include "base/tensor.h"
}

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_test_cuda_check.h"

static int g_failed, g_cases;

/* ---- random numbers (splitmix64) ---------------------------------------------------------- */

static uint64_t g_rng = 0x666d7636347a6b31ull;
static uint64_t rnd_u64(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rnd_unit(void) { return (float)((double)(rnd_u64() >> 11) * 0x1p-53 * 2.0 - 1.0); }

static uint16_t rnd_scale_f16(float lo, float hi) {
    float v = lo + (hi - lo) * (rnd_unit() * 0.5f + 0.5f);
    return kiln_fp32_to_fp16(rnd_u64() & 1 ? v : -v);
}
static void put_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

/* R rows of C elements of dtype dt, rows tight (kiln has no quantizer: quantized blocks are
 * random quant bytes with finite, moderate random f16 scales and mins; f16 covers every
 * finite value including subnormals; bf16 and f32 random in [-4, 4] / [-1, 1]). */
static uint8_t *rnd_weights(kiln_dtype dt, int64_t R, int64_t C, size_t *rb_out) {
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(dt);
    size_t rb = (size_t)(C / tr->block_size) * (size_t)tr->type_size, nb = rb * (size_t)R;
    uint8_t *w = (uint8_t *)kiln_malloc(nb + 1);
    for (size_t i = 0; i < nb; i += 8) {
        uint64_t v = rnd_u64();
        memcpy(w + i, &v, nb - i < 8 ? nb - i : 8);
    }
    size_t nblk = nb / (size_t)tr->type_size;
    for (size_t b = 0; b < nblk; b++) {
        uint8_t *p = w + b * (size_t)tr->type_size;
        switch (dt) {
        case KILN_DTYPE_F32: {
            float f = rnd_unit();
            memcpy(p, &f, 4);
            break;
        }
        case KILN_DTYPE_F16: {
            uint16_t h = (uint16_t)rnd_u64();
            if ((h & 0x7c00u) == 0x7c00u) h = (uint16_t)(h & ~0x4000u);
            put_u16(p, h);
            break;
        }
        case KILN_DTYPE_BF16: put_u16(p, kiln_fp32_to_bf16(rnd_unit() * 4.0f)); break;
        case KILN_DTYPE_Q8_0: case KILN_DTYPE_Q4_0: case KILN_DTYPE_Q5_0:
            put_u16(p, rnd_scale_f16(0.001f, 0.1f));
            break;
        case KILN_DTYPE_Q4_1: case KILN_DTYPE_Q5_1: case KILN_DTYPE_Q4_K: case KILN_DTYPE_Q5_K:
            put_u16(p, rnd_scale_f16(0.0005f, 0.05f));
            put_u16(p + 2, rnd_scale_f16(0.0005f, 0.05f));
            break;
        case KILN_DTYPE_Q6_K: put_u16(p + 208, rnd_scale_f16(0.0005f, 0.05f)); break;
        default: break;
        }
    }
    *rb_out = rb;
    return w;
}

static float *host_floats(size_t n, float scale) {
    float *h = (float *)kiln_malloc(n * 4 + 4);
    for (size_t i = 0; i < n; i++) h[i] = rnd_unit() * scale;
    return h;
}

/* ---- one case ----------------------------------------------------------------------------- */

static kiln_backend *g_cpu;

/* Run the kernel with w uploaded at byte offset w_off of a fresh buffer with row stride rb
 * (>= the tight row size rb0), x at float offset x_off; out preloaded with init (NaN or the
 * old values). Returns the downloaded output (kiln_malloc'd). */
static float *run_gpu(kiln_dtype dt, const uint8_t *w, size_t rb0, size_t rb, size_t w_off,
                      const float *x, size_t x_off, const float *bias, const float *init,
                      int64_t R, int64_t C, int N, int acc) {
    uint8_t *dw;
    float *dx, *db = NULL, *dout;
    CUDA_OK(cudaMalloc(&dw, rb * (size_t)R + w_off + 16));
    CUDA_OK(cudaMemset(dw, 0xA5, rb * (size_t)R + w_off + 16)); /* padding: garbage bytes */
    if (rb == rb0) {
        CUDA_OK(cudaMemcpy(dw + w_off, w, rb0 * (size_t)R, cudaMemcpyHostToDevice));
    } else {
        CUDA_OK(cudaMemcpy2D(dw + w_off, rb, w, rb0, rb0, (size_t)R, cudaMemcpyHostToDevice));
    }
    CUDA_OK(cudaMalloc(&dx, ((size_t)N * C + x_off) * 4));
    CUDA_OK(cudaMemcpy(dx + x_off, x, (size_t)N * C * 4, cudaMemcpyHostToDevice));
    if (bias) {
        CUDA_OK(cudaMalloc(&db, (size_t)R * 4));
        CUDA_OK(cudaMemcpy(db, bias, (size_t)R * 4, cudaMemcpyHostToDevice));
    }
    CUDA_OK(cudaMalloc(&dout, (size_t)N * R * 4));
    CUDA_OK(cudaMemcpy(dout, init, (size_t)N * R * 4, cudaMemcpyHostToDevice));
    cudaError_t e = kiln_cuda_matvec_fast(0, dout, dx + x_off, dw + w_off, rb, dt, R, C, db, N, acc);
    if (e != cudaSuccess) {
        fprintf(stderr, "FAIL launch %s R=%lld C=%lld N=%d: %s\n", kiln_dtype_name(dt),
                (long long)R, (long long)C, N, cudaGetErrorString(e));
        exit(1);
    }
    CUDA_OK(cudaDeviceSynchronize());
    float *h = (float *)kiln_malloc((size_t)N * R * 4 + 4);
    CUDA_OK(cudaMemcpy(h, dout, (size_t)N * R * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaFree(dw));
    CUDA_OK(cudaFree(dx));
    if (db) CUDA_OK(cudaFree(db));
    CUDA_OK(cudaFree(dout));
    return h;
}

/* Index of the first element whose bits differ, or -1. */
static long first_diff(const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], 4) != 0) return (long)i;
    return -1;
}

static void test_case(kiln_dtype dt, int64_t R, int64_t C, int N, int with_bias, int acc) {
    size_t rb0;
    uint8_t *w = rnd_weights(dt, R, C, &rb0);
    float *x = host_floats((size_t)N * C, 1.0f);
    float *bias = with_bias ? host_floats((size_t)R, 1.0f) : NULL;
    float *old = host_floats((size_t)N * R, 2.0f);
    float *init = (float *)kiln_malloc((size_t)N * R * 4 + 4);
    for (size_t i = 0; i < (size_t)N * R; i++) init[i] = acc ? old[i] : NAN;

    /* CPU reference: the backend's matmul (+ the old output when accumulating) */
    kiln_tensor W = {"w", dt, 2, {R, C, 1, 1}, w, rb0 * (size_t)R};
    float *ref = (float *)kiln_malloc((size_t)N * R * 4 + 4);
    for (size_t i = 0; i < (size_t)N * R; i++) ref[i] = NAN;
    g_cpu->i->matmul(g_cpu, ref, x, &W, bias, N);
    if (acc)
        for (size_t i = 0; i < (size_t)N * R; i++) ref[i] = old[i] + ref[i];

    /* magnitudes M[t][r] from the dequantized weights */
    double *M = (double *)kiln_malloc((size_t)N * R * sizeof(double) + 8);
    float *wr = (float *)kiln_malloc((size_t)C * 4 + 4);
    for (int64_t r = 0; r < R; r++) {
        kiln_dequantize(dt, w + (size_t)r * rb0, wr, C);
        for (int t = 0; t < N; t++) {
            double m = 0;
            const float *xt = x + (size_t)t * C;
            for (int64_t i = 0; i < C; i++) m += fabs((double)xt[i] * (double)wr[i]);
            if (bias) m += fabs((double)bias[r]);
            if (acc) m += fabs((double)old[(size_t)t * R + r]);
            M[(size_t)t * R + r] = m;
        }
    }

    /* GPU: aligned layout (tight rows, or a 16-multiple padded stride) twice, then the
     * misaligned layout */
    const size_t rbA = (g_cases & 1) ? (rb0 + 16) / 16 * 16 + 16 : rb0;
    float *g1 = run_gpu(dt, w, rb0, rbA, 0, x, 0, bias, init, R, C, N, acc);
    float *g2 = run_gpu(dt, w, rb0, rbA, 0, x, 0, bias, init, R, C, N, acc);
    float *g3 = run_gpu(dt, w, rb0, rb0 + 3, 1, x, 1, bias, init, R, C, N, acc);

    char ctx[160];
    snprintf(ctx, sizeof ctx, "matvec %-4s R=%lld C=%lld N=%d bias=%d acc=%d S=%d",
             kiln_dtype_name(dt), (long long)R, (long long)C, N, with_bias, acc,
             kiln_cuda_matvec_fast_split(dt, R, C, N));
    int bad = 0;
    long bad_elems = 0;
    double max_norm = 0, max_rel = 0;
    const double u = 0x1p-24, kbound = (3.0 * (double)C / 32.0 + 64.0) * u;
    for (int t = 0; t < N; t++) {
        double dmax = 0, mmax = 0, cmax = 0;
        for (int64_t r = 0; r < R; r++) {
            size_t i = (size_t)t * R + r;
            double d = fabs((double)g1[i] - (double)ref[i]);
            if (!(d <= kbound * M[i] + 1e-30)) { /* NaN fails too */
                if (!bad_elems)
                    fprintf(stderr, "FAIL %s: first bad [t=%d r=%lld] cpu %.9g gpu %.9g |d| %.3g > bound %.3g\n",
                            ctx, t, (long long)r, ref[i], g1[i], d, kbound * M[i]);
                bad_elems++;
            }
            if (!(d <= dmax)) dmax = d;
            if (M[i] > mmax) mmax = M[i];
            if (fabs((double)ref[i]) > cmax) cmax = fabs((double)ref[i]);
        }
        double nerr = mmax > 0 ? dmax / mmax : dmax;
        double rel = cmax > 0 ? dmax / cmax : dmax;
        if (!(nerr <= max_norm)) max_norm = nerr;
        if (!(rel <= max_rel)) max_rel = rel;
    }
    if (bad_elems) bad = 1;
    if (!(max_norm <= 1e-5)) {
        fprintf(stderr, "FAIL %s: normalised error %.3g > 1e-5\n", ctx, max_norm);
        bad = 1;
    }
    long d12 = first_diff(g1, g2, (size_t)N * R), d13 = first_diff(g1, g3, (size_t)N * R);
    if (d12 >= 0) {
        fprintf(stderr, "FAIL %s: two runs differ at [%ld]: %.9g vs %.9g\n", ctx, d12, g1[d12],
                g2[d12]);
        bad = 1;
    }
    if (d13 >= 0) {
        fprintf(stderr, "FAIL %s: misaligned layout differs at [%ld]: %.9g vs %.9g\n", ctx, d13,
                g1[d13], g3[d13]);
        bad = 1;
    }
    printf("%s: max_norm_err %.2e rel %.2e%s %s\n", ctx, max_norm, max_rel,
           bad_elems ? " (elements over bound)" : "", bad ? "FAIL" : "OK");
    g_failed += bad;
    g_cases++;
    kiln_free(w), kiln_free(x), kiln_free(bias), kiln_free(old), kiln_free(init);
    kiln_free(ref), kiln_free(M), kiln_free(wr), kiln_free(g1), kiln_free(g2), kiln_free(g3);
}

/* ---- argument validation (no device needed: every call here is refused before a launch) -- */

static void check_refused(const char *what, cudaError_t e) {
    if (e != cudaErrorInvalidValue) {
        fprintf(stderr, "FAIL validation %s: got %s, want cudaErrorInvalidValue\n", what,
                cudaGetErrorString(e));
        g_failed++;
    }
}

static void test_validation(void) {
    float *o = (float *)(uintptr_t)0x10000, *xp = (float *)(uintptr_t)0x20000;
    const uint8_t *wp = (const uint8_t *)(uintptr_t)0x30000;
    const kiln_dtype q = KILN_DTYPE_Q4_0;
    check_refused("N=0", kiln_cuda_matvec_fast(0, o, xp, wp, 18, q, 4, 32, NULL, 0, 0));
    check_refused("N=9", kiln_cuda_matvec_fast(0, o, xp, wp, 18, q, 4, 32, NULL, 9, 0));
    check_refused("R=0", kiln_cuda_matvec_fast(0, o, xp, wp, 18, q, 0, 32, NULL, 1, 0));
    check_refused("C=0", kiln_cuda_matvec_fast(0, o, xp, wp, 18, q, 4, 0, NULL, 1, 0));
    check_refused("C%32", kiln_cuda_matvec_fast(0, o, xp, wp, 18, q, 4, 48, NULL, 1, 0));
    check_refused("C%256", kiln_cuda_matvec_fast(0, o, xp, wp, 1000, KILN_DTYPE_Q4_K, 4, 288,
                                                 NULL, 1, 0));
    check_refused("row_bytes", kiln_cuda_matvec_fast(0, o, xp, wp, 17, q, 4, 32, NULL, 1, 0));
    check_refused("dtype", kiln_cuda_matvec_fast(0, o, xp, wp, 128, (kiln_dtype)1000, 4, 32,
                                                 NULL, 1, 0));
    check_refused("out NULL", kiln_cuda_matvec_fast(0, NULL, xp, wp, 18, q, 4, 32, NULL, 1, 0));
    check_refused("x NULL", kiln_cuda_matvec_fast(0, o, NULL, wp, 18, q, 4, 32, NULL, 1, 0));
    check_refused("w NULL", kiln_cuda_matvec_fast(0, o, xp, NULL, 18, q, 4, 32, NULL, 1, 0));
    check_refused("out misaligned",
                  kiln_cuda_matvec_fast(0, (float *)(uintptr_t)0x10002, xp, wp, 18, q, 4, 32,
                                        NULL, 1, 0));
    check_refused("bias misaligned",
                  kiln_cuda_matvec_fast(0, o, xp, wp, 18, q, 4, 32,
                                        (const float *)(uintptr_t)0x40001, 1, 0));
    /* the split: a power of two in [1, 8], 0 for refused arguments */
    const kiln_dtype dts[] = {KILN_DTYPE_BF16, KILN_DTYPE_Q4_0, KILN_DTYPE_Q6_K};
    const int64_t Rs[] = {1, 17, 896, 4864, 151936}, Cs[] = {256, 896, 4864, 5120, 8960};
    for (kiln_dtype dt : dts)
        for (int64_t R : Rs)
            for (int64_t C : Cs)
                for (int N = 1; N <= 8; N++) {
                    int S = kiln_cuda_matvec_fast_split(dt, R, C, N);
                    int bs = kiln_dtype_get_traits(dt)->block_size;
                    bool ok = C % bs ? S == 0 : (S == 1 || S == 2 || S == 4 || S == 8);
                    if (!ok) {
                        fprintf(stderr, "FAIL split %s R=%lld C=%lld N=%d: %d\n",
                                kiln_dtype_name(dt), (long long)R, (long long)C, N, S);
                        g_failed++;
                    }
                }
    if (kiln_cuda_matvec_fast_split(KILN_DTYPE_Q4_0, 4, 32, 0) != 0 ||
        kiln_cuda_matvec_fast_split((kiln_dtype)1000, 4, 32, 1) != 0) {
        fprintf(stderr, "FAIL split of refused arguments is not 0\n");
        g_failed++;
    }
    printf("validation: %s\n", g_failed ? "FAIL" : "OK");
}

/* ---- main --------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
    if (argc > 1) g_rng = strtoull(argv[1], NULL, 0);
    test_validation();
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        printf("no CUDA device (%s): skipped\n", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return g_failed ? 1 : 77;
    }
    if (kiln_backend_cpu_create(0, &g_cpu) != KILN_OK) {
        fprintf(stderr, "FAIL cpu backend: %s\n", kiln_last_error());
        return 1;
    }
    printf("seed 0x%llx\n", (unsigned long long)g_rng);
    const kiln_dtype dts[] = {KILN_DTYPE_F32,  KILN_DTYPE_F16,  KILN_DTYPE_BF16, KILN_DTYPE_Q8_0,
                              KILN_DTYPE_Q4_0, KILN_DTYPE_Q4_1, KILN_DTYPE_Q5_0, KILN_DTYPE_Q5_1,
                              KILN_DTYPE_Q4_K, KILN_DTYPE_Q5_K, KILN_DTYPE_Q6_K};
    for (kiln_dtype dt : dts) {
        const int bs = kiln_dtype_get_traits(dt)->block_size;
        /* widths: one block, two blocks, an odd middle size, the decode sizes */
        int64_t Cs[5];
        if (bs == 1) {
            const int64_t c[5] = {1, 2, 13, 896, 4864};
            memcpy(Cs, c, sizeof c);
        } else if (bs == 32) {
            const int64_t c[5] = {32, 64, 96, 896, 4864};
            memcpy(Cs, c, sizeof c);
        } else {
            const int64_t c[5] = {256, 512, 768, 1536, 5120};
            memcpy(Cs, c, sizeof c);
        }
        int idx = 0;
        /* small rows, every width */
        const int64_t Rs[] = {1, 3, 17};
        for (int64_t R : Rs)
            for (int64_t C : Cs) {
                test_case(dt, R, C, idx % 8 + 1, idx & 1, (idx >> 1) & 1);
                idx++;
            }
        /* every N, bias and accumulate on one small shape */
        for (int N = 1; N <= 8; N++)
            for (int b = 0; b < 2; b++)
                for (int a = 0; a < 2; a++) test_case(dt, 17, Cs[2], N, b, a);
        /* decode shapes: q/o, gate/up, down (the split of C), plus tiles of several tokens */
        test_case(dt, 896, Cs[3], 1, 1, 0);
        test_case(dt, 896, Cs[4], 1, 0, 1);
        test_case(dt, 4864, Cs[3], 1, 0, 0);
        test_case(dt, 896, Cs[4], 8, 1, 1);
        test_case(dt, 4864, Cs[3], 3, 0, 1);
        test_case(dt, 1, Cs[4], 2, 1, 0);
        test_case(dt, 33, Cs[4], 5, 0, 0);
        if (dt == KILN_DTYPE_BF16) test_case(dt, 151936, 896, 1, 0, 0); /* lm_head rows */
        if (bs == 1) { /* fast path with a tail (f16/bf16: C % 8 == 4), and a short row */
            test_case(dt, 17, 1004, 4, 1, 1);
            test_case(dt, 5, 12, 1, 0, 0);
        }
    }
    kiln_backend_free(g_cpu);
    if (g_failed) printf("FAILED %d\n", g_failed);
    else printf("ALL OK (%d cases)\n", g_cases);
    return g_failed ? 1 : 0;
}
