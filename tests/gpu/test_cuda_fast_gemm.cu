/*
 * test_cuda_fast_gemm.cu -- the fast mode's bf16 tensor-core GEMMs (src/ops/cuda/
 * cuda_matmul.h) against the CPU backend and a double-precision host reference.
 *
 * Checks:
 *   1. conversions, bit for bit: kiln_cuda_f32_to_bf16 against tensor.c's kiln_fp32_to_bf16
 *      (random bit patterns plus NaNs, infinities, zeros, subnormals, ties, overflow), and
 *      kiln_cuda_weights_to_bf16 for all 11 weight dtypes against kiln_dequantize +
 *      kiln_fp32_to_bf16 (padding of the destination left untouched);
 *   2. kiln_cuda_gemm_linear for f32, bf16, f16, q8_0, q4_1, q4_k, q6_k weights, odd shapes,
 *      bias / no bias, accumulate 0/1, packed and padded weight rows, a 4-byte-aligned bias,
 *      the forced bias kernel: against the CPU backend's matmul on the same host bytes with
 *      the bound below; outputs poisoned with NaN first (accumulate 0); every case run twice
 *      and compared bit for bit (determinism); kiln_cuda_gemm_linear_bf16 on x converted by
 *      kiln_cuda_f32_to_bf16 must give the same bits as kiln_cuda_gemm_linear;
 *   3. kiln_cuda_gemm_f32 in all four transpose combinations, padded leading dimensions,
 *      accumulate 0/1, against a double host reference; run twice (same bits); and
 *      kiln_cuda_gemm_bf16 on the converted operands gives the same bits;
 *   4. a CUDA graph capturing a linear of a shape seen before replays to the same bits, and
 *      a call that would need more scratch while capturing is refused with a message;
 *   5. argument errors return cudaErrorInvalidValue with a message.
 *
 * The bound. Each operand is rounded to bf16 (relative error <= 2^-8 each), so each product
 * is off by <= (2^-7 + 2^-16)|x_i w_i|; both sides sum C terms in f32 (error <= about
 * C * 2^-24 * sum |x_i w_i| each, first order). Per element, with S = sum_i |x_i||w_i|
 * (computed on the host, by the CPU backend's matmul of |x| and |W|):
 *   |gpu - cpu| <= (2^-7 + 2 * C * 2^-24) * S + 2^-22 * (|bias| + |old|) + 1e-6
 * (|old|: the accumulated-into value; the last terms cover the f32 additions of bias/old).
 * This is a worst case; random data lands far below (the printed max err/S shows by how
 * much). Without a GPU: checks what it can (create refuses, NULL handling) and exits 77.
 *
 * Usage: test_cuda_fast_gemm [seed]. Prints one line per case, "ALL OK" or "FAILED n".
 */
#include "ops/cuda/cuda_matmul.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <vector>

#include "gpu_test_cuda_check.h"

static int g_failed;
static kiln_cuda_gemm *g_gemm;
static cudaStream_t g_s;
static kiln_backend *g_cpu;

/* A GEMM call that must succeed: on failure count it and print the handle's message. */
static bool gemm_ok(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return true;
    fprintf(stderr, "FAIL %s: %s: %s\n", what, cudaGetErrorString(e), kiln_cuda_gemm_error(g_gemm));
    g_failed++;
    return false;
}

/* ---- random numbers (splitmix64) ----------------------------------------------------------- */

static uint64_t g_rng = 0x6661737447454d4dull;
static uint64_t rnd_u64(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rnd_unit(void) { return (float)((double)(rnd_u64() >> 11) * 0x1p-53 * 2.0 - 1.0); }
static void rnd_floats(std::vector<float> &v) {
    for (float &f : v) f = rnd_unit();
}

static uint16_t rnd_scale_f16(float lo, float hi) {
    float v = lo + (hi - lo) * (rnd_unit() * 0.5f + 0.5f);
    return kiln_fp32_to_fp16(rnd_u64() & 1 ? v : -v);
}
static void put_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

/* R rows of C elements of dtype dt, packed: plain types random finite values (f16: any finite
 * bit pattern, subnormals included), quantized blocks random bytes with moderate scales. */
static std::vector<uint8_t> rnd_weights(kiln_dtype dt, int64_t R, int64_t C, size_t *row_bytes) {
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(dt);
    const size_t rb = (size_t)(C / tr->block_size) * (size_t)tr->type_size, nb = rb * (size_t)R;
    std::vector<uint8_t> w(nb);
    for (size_t i = 0; i < nb; i++) w[i] = (uint8_t)rnd_u64();
    for (size_t b = 0; b < nb / (size_t)tr->type_size; b++) {
        uint8_t *p = w.data() + b * (size_t)tr->type_size;
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
    *row_bytes = rb;
    return w;
}

/* Host dequantization of packed rows (kiln_dequantize, row by row). */
static std::vector<float> host_dequant(kiln_dtype dt, const std::vector<uint8_t> &w, size_t rb,
                                       int64_t R, int64_t C) {
    std::vector<float> f((size_t)(R * C));
    for (int64_t r = 0; r < R; r++) kiln_dequantize(dt, w.data() + (size_t)r * rb, &f[(size_t)(r * C)], C);
    return f;
}

/* ---- device buffers --------------------------------------------------------------------- */

template <typename T> static T *dev_alloc(size_t n) {
    void *p = NULL;
    CUDA_OK(cudaMalloc(&p, n * sizeof(T) + 16));
    return (T *)p;
}
/* All copies and fills go on g_s (a non-blocking stream, not ordered with the legacy one)
 * and are waited for, so they are complete before any later work on g_s. */
static void up(void *d, const void *h, size_t nbytes) {
    CUDA_OK(cudaMemcpyAsync(d, h, nbytes, cudaMemcpyHostToDevice, g_s));
    CUDA_OK(cudaStreamSynchronize(g_s));
}
static void dev_fill(void *d, int byte, size_t nbytes) {
    CUDA_OK(cudaMemsetAsync(d, byte, nbytes, g_s));
    CUDA_OK(cudaStreamSynchronize(g_s));
}
static void dev_poison(void *d, size_t nbytes) { dev_fill(d, 0xff, nbytes); } /* NaN bits */
template <typename T> static T *dev_copy(const std::vector<T> &h) {
    T *d = dev_alloc<T>(h.size());
    up(d, h.data(), h.size() * sizeof(T));
    return d;
}
template <typename T> static std::vector<T> dev_read(const T *d, size_t n) {
    std::vector<T> h(n);
    CUDA_OK(cudaStreamSynchronize(g_s));
    CUDA_OK(cudaMemcpyAsync(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost, g_s));
    CUDA_OK(cudaStreamSynchronize(g_s));
    return h;
}

static int same_bits(const void *a, const void *b, size_t nbytes) { return memcmp(a, b, nbytes) == 0; }

/* ---- 1. conversions, bit for bit ------------------------------------------------------------ */

static void test_f32_to_bf16(void) {
    const int64_t rows = 37, cols = 1001, ld_src = 1003, ld_dst = 1008;
    std::vector<uint32_t> bits((size_t)(rows * ld_src));
    for (uint32_t &u : bits) u = (uint32_t)rnd_u64();
    static const uint32_t special[] = {
        0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, /* zeros, infinities */
        0x7fc00000u, 0xffc00001u, 0x7f800001u, 0xff812345u, /* quiet / signalling NaNs */
        0x00000001u, 0x807fffffu, 0x00008000u, 0x00018000u, /* subnormals, subnormal ties */
        0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f807fffu, /* ties to even, either side */
        0x7f7fffffu, 0xff7f8000u, 0x7f7f7fffu, 0x3f800000u, /* overflow to inf, max */
    };
    for (size_t i = 0; i < sizeof special / sizeof special[0]; i++) bits[i * 7] = special[i];
    std::vector<float> src(bits.size());
    memcpy(src.data(), bits.data(), bits.size() * 4);
    float *d_src = dev_copy(src);
    uint16_t *d_dst = dev_alloc<uint16_t>((size_t)(rows * ld_dst));
    dev_fill(d_dst, 0xab, (size_t)(rows * ld_dst) * 2);
    if (!gemm_ok(kiln_cuda_f32_to_bf16(g_s, d_dst, ld_dst, d_src, ld_src, rows, cols), "f32_to_bf16"))
        return;
    std::vector<uint16_t> got = dev_read(d_dst, (size_t)(rows * ld_dst));
    long bad = 0, first = -1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < ld_dst; c++) {
            const uint16_t want = c < cols ? kiln_fp32_to_bf16(src[(size_t)(r * ld_src + c)]) : 0xababu;
            if (got[(size_t)(r * ld_dst + c)] != want) {
                if (first < 0) first = (long)(r * ld_dst + c);
                bad++;
            }
        }
    printf("f32_to_bf16 %lldx%lld (specials, random bits): %ld differing%s\n", (long long)rows,
           (long long)cols, bad, bad ? "  FAIL" : " OK");
    if (bad) {
        fprintf(stderr, "  first at dst[%ld]: got 0x%04x\n", first, got[(size_t)first]);
        g_failed++;
    }
    cudaFree(d_src);
    cudaFree(d_dst);
}

static const kiln_dtype g_all_dtypes[] = {KILN_DTYPE_F32,  KILN_DTYPE_F16,  KILN_DTYPE_BF16,
                                          KILN_DTYPE_Q8_0, KILN_DTYPE_Q4_0, KILN_DTYPE_Q4_1,
                                          KILN_DTYPE_Q5_0, KILN_DTYPE_Q5_1, KILN_DTYPE_Q4_K,
                                          KILN_DTYPE_Q5_K, KILN_DTYPE_Q6_K};

static void test_weights_to_bf16(kiln_dtype dt) {
    const int bs = kiln_dtype_get_traits(dt)->block_size;
    const int64_t R = 29, C = bs == 1 ? 77 : bs == 32 ? 32 * 9 : 256 * 3, ld = C + 5;
    size_t rb;
    std::vector<uint8_t> w = rnd_weights(dt, R, C, &rb);
    std::vector<float> f = host_dequant(dt, w, rb, R, C);
    uint8_t *d_w = dev_copy(w);
    uint16_t *d_dst = dev_alloc<uint16_t>((size_t)(R * ld));
    dev_fill(d_dst, 0xab, (size_t)(R * ld) * 2);
    if (!gemm_ok(kiln_cuda_weights_to_bf16(g_s, d_dst, ld, d_w, rb, dt, R, C), "weights_to_bf16"))
        return;
    std::vector<uint16_t> got = dev_read(d_dst, (size_t)(R * ld));
    long bad = 0, first = -1;
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < ld; c++) {
            const uint16_t want = c < C ? kiln_fp32_to_bf16(f[(size_t)(r * C + c)]) : 0xababu;
            if (got[(size_t)(r * ld + c)] != want) {
                if (first < 0) first = (long)(r * ld + c);
                bad++;
            }
        }
    const char *name = kiln_dtype_get_traits(dt)->name;
    printf("weights_to_bf16 %s R=%lld C=%lld: %ld differing%s\n", name, (long long)R,
           (long long)C, bad, bad ? "  FAIL" : " OK");
    if (bad) {
        const long r = first / ld, c = first % ld;
        fprintf(stderr, "  first [%ld,%ld]: got 0x%04x want 0x%04x (f32 %.9g)\n", r, c,
                got[(size_t)first], c < C ? kiln_fp32_to_bf16(f[(size_t)(r * C + c)]) : 0xabab,
                c < C ? f[(size_t)(r * C + c)] : 0.0f);
        g_failed++;
    }
    cudaFree(d_w);
    cudaFree(d_dst);
}

/* ---- 2. linear against the CPU backend ---------------------------------------------------- */

enum { V_PLAIN = 0, V_PAD_ROWS = 1, V_BIAS_UNALIGNED = 2, V_BIAS_KERNEL = 4, V_BF16_X = 8 };

static double g_worst_ratio; /* max over all cases of err / S */

static void test_linear(kiln_dtype dt, int N, int64_t R, int64_t C, int with_bias, int accumulate,
                        int variant) {
    const char *name = kiln_dtype_get_traits(dt)->name;
    size_t rb;
    std::vector<uint8_t> w = rnd_weights(dt, R, C, &rb);
    std::vector<float> x((size_t)N * C), bias(with_bias ? (size_t)R : 0), old((size_t)N * R);
    rnd_floats(x), rnd_floats(bias), rnd_floats(old);

    /* CPU: the product, and S = |x| @ |W|^T for the bound */
    std::vector<float> cpu((size_t)N * R), S((size_t)N * R);
    kiln_tensor W = {"w", dt, 2, {R, C, 1, 1}, w.data(), w.size()};
    g_cpu->i->matmul(g_cpu, cpu.data(), x.data(), &W, with_bias ? bias.data() : NULL, N);
    std::vector<float> wabs = host_dequant(dt, w, rb, R, C), xabs(x);
    for (float &v : wabs) v = fabsf(v);
    for (float &v : xabs) v = fabsf(v);
    kiln_tensor Wabs = {"wabs", KILN_DTYPE_F32, 2, {R, C, 1, 1}, wabs.data(), wabs.size() * 4};
    g_cpu->i->matmul(g_cpu, S.data(), xabs.data(), &Wabs, NULL, N);

    /* device: weights (rows padded by 16 bytes for V_PAD_ROWS), x, bias, out */
    const size_t drb = (variant & V_PAD_ROWS) ? rb + 16 : rb;
    uint8_t *d_w = dev_alloc<uint8_t>(drb * (size_t)R);
    dev_fill(d_w, 0xff, drb * (size_t)R); /* padding: NaN bits, never read */
    CUDA_OK(cudaMemcpy2DAsync(d_w, drb, w.data(), rb, rb, (size_t)R, cudaMemcpyHostToDevice, g_s));
    CUDA_OK(cudaStreamSynchronize(g_s));
    float *d_x = dev_copy(x);
    float *d_bias_buf = with_bias ? dev_alloc<float>((size_t)R + 1) : NULL;
    float *d_bias = d_bias_buf && (variant & V_BIAS_UNALIGNED) ? d_bias_buf + 1 : d_bias_buf;
    if (d_bias) up(d_bias, bias.data(), (size_t)R * 4);
    float *d_out[2] = {dev_alloc<float>((size_t)N * R), dev_alloc<float>((size_t)N * R)};
    for (int k = 0; k < 2; k++) {
        if (accumulate)
            up(d_out[k], old.data(), old.size() * 4);
        else
            dev_poison(d_out[k], old.size() * 4);
    }
    kiln_cuda_gemm_set_bias_kernel(g_gemm, (variant & V_BIAS_KERNEL) != 0);
    char ctx[160];
    snprintf(ctx, sizeof ctx, "linear %s N=%d R=%lld C=%lld bias=%d acc=%d%s%s%s%s", name, N,
             (long long)R, (long long)C, with_bias, accumulate,
             (variant & V_PAD_ROWS) ? " padded-rows" : "",
             (variant & V_BIAS_UNALIGNED) ? " bias+4B" : "",
             (variant & V_BIAS_KERNEL) ? " bias-kernel" : "", (variant & V_BF16_X) ? " bf16-x" : "");
    bool ok = true;
    for (int k = 0; k < 2 && ok; k++)
        ok = gemm_ok(kiln_cuda_gemm_linear(g_gemm, g_s, d_out[k], d_x, d_w, drb, dt, R, C, d_bias,
                                           N, accumulate),
                     ctx);
    uint16_t *d_xb = NULL;
    float *d_out3 = NULL;
    if (ok && (variant & V_BF16_X)) { /* same problem from x already in bf16: same bits */
        const int64_t ldx = (C + 7) & ~(int64_t)7;
        d_xb = dev_alloc<uint16_t>((size_t)(N * ldx));
        d_out3 = dev_alloc<float>((size_t)N * R);
        if (accumulate)
            up(d_out3, old.data(), old.size() * 4);
        else
            dev_poison(d_out3, old.size() * 4);
        ok = gemm_ok(kiln_cuda_f32_to_bf16(g_s, d_xb, ldx, d_x, C, N, C), ctx) &&
             gemm_ok(kiln_cuda_gemm_linear_bf16(g_gemm, g_s, d_out3, d_xb, ldx, d_w, drb, dt, R, C,
                                                d_bias, N, accumulate),
                     ctx);
    }
    kiln_cuda_gemm_set_bias_kernel(g_gemm, 0);
    if (ok) {
        std::vector<float> got = dev_read(d_out[0], (size_t)N * R);
        std::vector<float> again = dev_read(d_out[1], (size_t)N * R);
        double worst = 0.0;
        long bad = 0, first = -1;
        for (size_t i = 0; i < got.size(); i++) {
            const size_t r = i % (size_t)R;
            const double b = with_bias ? fabs((double)bias[r]) : 0.0;
            const double o = accumulate ? (double)old[i] : 0.0;
            const double want = (double)cpu[i] + o;
            const double err = fabs((double)got[i] - want);
            const double tol = (0x1p-7 + 2.0 * (double)C * 0x1p-24) * (double)S[i] +
                               0x1p-22 * (b + fabs(o)) + 1e-6;
            if (!(err <= tol)) { /* NaN fails too */
                if (first < 0) first = (long)i;
                bad++;
            }
            if (S[i] > 0 && err / (double)S[i] > worst) worst = err / (double)S[i];
        }
        const bool det = same_bits(got.data(), again.data(), got.size() * 4);
        bool same_bf16 = true;
        if (d_out3) {
            std::vector<float> third = dev_read(d_out3, (size_t)N * R);
            same_bf16 = same_bits(got.data(), third.data(), got.size() * 4);
        }
        if (worst > g_worst_ratio) g_worst_ratio = worst;
        const bool pass = bad == 0 && det && same_bf16;
        printf("%s: max err/S %.2e (bound %.2e)%s%s%s\n", ctx, worst,
               0x1p-7 + 2.0 * (double)C * 0x1p-24, det ? "" : " NOT-DETERMINISTIC",
               same_bf16 ? "" : " BF16-X-DIFFERS", pass ? " OK" : "  FAIL");
        if (bad) {
            const size_t i = (size_t)first;
            fprintf(stderr, "  %ld of %zu out of bound; first [n=%zu, r=%zu]: gpu %.9g cpu %.9g old %.9g S %.9g\n",
                    bad, got.size(), i / (size_t)R, i % (size_t)R, got[i], cpu[i],
                    accumulate ? old[i] : 0.0f, S[i]);
        }
        if (!pass) g_failed++;
    }
    cudaFree(d_w), cudaFree(d_x), cudaFree(d_bias_buf), cudaFree(d_out[0]), cudaFree(d_out[1]);
    cudaFree(d_xb), cudaFree(d_out3);
}

static void test_linear_dtype(kiln_dtype dt) {
    const int bs = kiln_dtype_get_traits(dt)->block_size;
    /* widths: small, small-odd, model width, the MLP's 4864 */
    const int64_t Cs[4] = {bs == 1 ? 33 : bs, bs == 1 ? 77 : bs == 32 ? 96 : 512,
                           bs == 256 ? 768 : 896, 4864};
    test_linear(dt, 9, 3, Cs[0], 1, 0, V_PLAIN);
    test_linear(dt, 17, 96, Cs[1], 0, 1, V_PAD_ROWS);
    test_linear(dt, 100, 896, Cs[2], 1, 1, V_BF16_X);
    test_linear(dt, 512, 4864, Cs[2], 1, 0, V_PLAIN);
    test_linear(dt, 17, 896, Cs[3], 0, 0, V_BF16_X);
    test_linear(dt, 1, 96, Cs[2], 1, 0, V_BIAS_UNALIGNED);
    test_linear(dt, 9, 4864, Cs[3], 1, 1, V_BIAS_KERNEL);
    test_linear(dt, 100, 96, Cs[1], 1, 0, V_BIAS_UNALIGNED | V_PAD_ROWS);
}

/* ---- 3. the general product against a double reference ----------------------------------- */

static void test_gemm_f32(int ta, int tb, int64_t M, int64_t N, int64_t K, int accumulate) {
    const int64_t a_rows = ta ? K : M, a_cols = ta ? M : K, b_rows = tb ? N : K, b_cols = tb ? K : N;
    const int64_t lda = a_cols + (int64_t)(rnd_u64() % 4), ldb = b_cols + (int64_t)(rnd_u64() % 4);
    const int64_t ldd = N + (int64_t)(rnd_u64() % 4);
    std::vector<float> A((size_t)(a_rows * lda)), B((size_t)(b_rows * ldb)), old((size_t)(M * ldd));
    rnd_floats(A), rnd_floats(B), rnd_floats(old);
    float *d_A = dev_copy(A), *d_B = dev_copy(B);
    float *d_D[3];
    for (int k = 0; k < 3; k++) {
        d_D[k] = dev_alloc<float>(old.size());
        if (accumulate)
            up(d_D[k], old.data(), old.size() * 4);
        else
            dev_poison(d_D[k], old.size() * 4);
    }
    char ctx[128];
    snprintf(ctx, sizeof ctx, "gemm_f32 ta=%d tb=%d M=%lld N=%lld K=%lld lda=%lld ldb=%lld ldd=%lld acc=%d",
             ta, tb, (long long)M, (long long)N, (long long)K, (long long)lda, (long long)ldb,
             (long long)ldd, accumulate);
    bool ok = true;
    for (int k = 0; k < 2 && ok; k++)
        ok = gemm_ok(kiln_cuda_gemm_f32(g_gemm, g_s, ta, tb, M, N, K, d_A, lda, d_B, ldb, d_D[k],
                                        ldd, accumulate),
                     ctx);
    /* the bf16 entry on operands converted as kiln_cuda_gemm_f32 does (ld rounded up to 8) */
    const int64_t lda2 = (a_cols + 7) & ~(int64_t)7, ldb2 = (b_cols + 7) & ~(int64_t)7;
    uint16_t *d_Ab = dev_alloc<uint16_t>((size_t)(a_rows * lda2));
    uint16_t *d_Bb = dev_alloc<uint16_t>((size_t)(b_rows * ldb2));
    if (ok)
        ok = gemm_ok(kiln_cuda_f32_to_bf16(g_s, d_Ab, lda2, d_A, lda, a_rows, a_cols), ctx) &&
             gemm_ok(kiln_cuda_f32_to_bf16(g_s, d_Bb, ldb2, d_B, ldb, b_rows, b_cols), ctx) &&
             gemm_ok(kiln_cuda_gemm_bf16(g_gemm, g_s, ta, tb, M, N, K, d_Ab, lda2, d_Bb, ldb2,
                                         d_D[2], ldd, accumulate),
                     ctx);
    if (ok) {
        std::vector<float> got = dev_read(d_D[0], old.size()), again = dev_read(d_D[1], old.size());
        std::vector<float> viab = dev_read(d_D[2], old.size());
        long bad = 0, first = -1, pad_bad = 0;
        double worst = 0.0, first_ref = 0.0;
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < ldd; n++) {
                const size_t i = (size_t)(m * ldd + n);
                if (n >= N) { /* outside D(M,N): untouched */
                    uint32_t a, b;
                    memcpy(&a, &got[i], 4);
                    memcpy(&b, &old[i], 4);
                    if (accumulate ? a != b : a != 0xffffffffu) pad_bad++;
                    continue;
                }
                double ref = accumulate ? (double)old[i] : 0.0, S = 0.0;
                for (int64_t k = 0; k < K; k++) {
                    const double a = ta ? A[(size_t)(k * lda + m)] : A[(size_t)(m * lda + k)];
                    const double b = tb ? B[(size_t)(n * ldb + k)] : B[(size_t)(k * ldb + n)];
                    ref += a * b;
                    S += fabs(a * b);
                }
                const double err = fabs((double)got[i] - ref);
                const double tol = (0x1p-7 + (double)K * 0x1p-24) * S +
                                   0x1p-22 * (accumulate ? fabs((double)old[i]) : 0.0) + 1e-6;
                if (!(err <= tol)) {
                    if (first < 0) first = (long)i, first_ref = ref;
                    bad++;
                }
                if (S > 0 && err / S > worst) worst = err / S;
            }
        const bool det = same_bits(got.data(), again.data(), got.size() * 4);
        const bool same_bf16 = same_bits(got.data(), viab.data(), got.size() * 4);
        if (worst > g_worst_ratio) g_worst_ratio = worst;
        const bool pass = bad == 0 && pad_bad == 0 && det && same_bf16;
        printf("%s: max err/S %.2e%s%s%s%s\n", ctx, worst, det ? "" : " NOT-DETERMINISTIC",
               same_bf16 ? "" : " BF16-ENTRY-DIFFERS", pad_bad ? " PADDING-WRITTEN" : "",
               pass ? " OK" : "  FAIL");
        if (bad)
            fprintf(stderr, "  %ld out of bound; first [m=%lld, n=%lld]: gpu %.9g ref %.12g\n", bad,
                    (long long)(first / ldd), (long long)(first % ldd), got[(size_t)first], first_ref);
        if (!pass) g_failed++;
    }
    cudaFree(d_A), cudaFree(d_B), cudaFree(d_Ab), cudaFree(d_Bb);
    for (int k = 0; k < 3; k++) cudaFree(d_D[k]);
}

/* ---- 4. stream capture ---------------------------------------------------------------------- */

static void test_capture(void) {
    const int N = 64;
    const int64_t R = 896, C = 896;
    const kiln_dtype dt = KILN_DTYPE_Q8_0;
    size_t rb;
    std::vector<uint8_t> w = rnd_weights(dt, R, C, &rb);
    std::vector<float> x((size_t)N * C), bias((size_t)R);
    rnd_floats(x), rnd_floats(bias);
    uint8_t *d_w = dev_copy(w);
    float *d_x = dev_copy(x), *d_b = dev_copy(bias);
    float *d_o1 = dev_alloc<float>((size_t)N * R), *d_o2 = dev_alloc<float>((size_t)N * R);
    dev_poison(d_o1, (size_t)N * R * 4);
    dev_poison(d_o2, (size_t)N * R * 4);
    bool ok = gemm_ok(kiln_cuda_gemm_linear(g_gemm, g_s, d_o1, d_x, d_w, rb, dt, R, C, d_b, N, 0),
                      "capture: direct");
    CUDA_OK(cudaStreamSynchronize(g_s));
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    if (ok) {
        CUDA_OK(cudaStreamBeginCapture(g_s, cudaStreamCaptureModeThreadLocal));
        cudaError_t e = kiln_cuda_gemm_linear(g_gemm, g_s, d_o2, d_x, d_w, rb, dt, R, C, d_b, N, 0);
        /* a shape needing far more scratch: refused while capturing, nothing enqueued */
        cudaError_t e2 = kiln_cuda_gemm_f32(g_gemm, g_s, 0, 0, 1 << 14, 1 << 14, 1 << 12, d_x, 1 << 12,
                                            d_x, 1 << 14, d_o2, 1 << 14, 0);
        std::string msg = kiln_cuda_gemm_error(g_gemm);
        CUDA_OK(cudaStreamEndCapture(g_s, &graph));
        ok = gemm_ok(e, "capture: captured linear");
        if (e2 != cudaErrorStreamCaptureUnsupported || msg.find("capturing") == std::string::npos) {
            /* (if it was enqueued, the graph holds an out-of-bounds product: not launched) */
            fprintf(stderr, "FAIL capture: growth while capturing returned %s, message \"%s\"\n",
                    cudaGetErrorString(e2), msg.c_str());
            g_failed++;
            ok = false;
        } else {
            printf("capture: growth while capturing refused: \"%s\" OK\n", msg.c_str());
        }
    }
    if (ok) {
        CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
        CUDA_OK(cudaGraphLaunch(exec, g_s));
        std::vector<float> a = dev_read(d_o1, (size_t)N * R), b = dev_read(d_o2, (size_t)N * R);
        const bool same = same_bits(a.data(), b.data(), a.size() * 4);
        printf("capture: graph replay of linear q8_0 N=%d R=%lld C=%lld: %s\n", N, (long long)R,
               (long long)C, same ? "same bits OK" : "DIFFERENT BITS  FAIL");
        if (!same) g_failed++;
    }
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    cudaFree(d_w), cudaFree(d_x), cudaFree(d_b), cudaFree(d_o1), cudaFree(d_o2);
}

/* ---- 5. argument errors ---------------------------------------------------------------------- */

static void expect_invalid(cudaError_t e, const char *what) {
    const char *msg = kiln_cuda_gemm_error(g_gemm);
    if (e != cudaErrorInvalidValue || !msg[0]) {
        fprintf(stderr, "FAIL errors: %s returned %s, message \"%s\"\n", what, cudaGetErrorString(e), msg);
        g_failed++;
    } else {
        printf("errors: %s -> \"%s\" OK\n", what, msg);
    }
}

static void test_errors(void) {
    float *d = dev_alloc<float>(4096);
    const uint8_t *w = (const uint8_t *)d;
    expect_invalid(kiln_cuda_gemm_linear(g_gemm, g_s, d, d, w, 64, (kiln_dtype)999, 2, 16, NULL, 1, 0),
                   "unknown dtype");
    expect_invalid(kiln_cuda_gemm_linear(g_gemm, g_s, d, d, w, 68, KILN_DTYPE_Q8_0, 2, 48, NULL, 1, 0),
                   "q8_0 with C % 32 != 0");
    expect_invalid(kiln_cuda_gemm_linear(g_gemm, g_s, d, d, w, 30, KILN_DTYPE_BF16, 2, 16, NULL, 1, 0),
                   "row_bytes < 2*C");
    expect_invalid(kiln_cuda_gemm_f32(g_gemm, g_s, 0, 0, 4, 4, 0, d, 4, d, 4, d, 4, 0), "K = 0");
    expect_invalid(kiln_cuda_gemm_f32(g_gemm, g_s, 1, 0, 8, 4, 4, d, 4, d, 4, d, 4, 0),
                   "lda < M with trans_a");
    expect_invalid(kiln_cuda_gemm_f32(g_gemm, g_s, 0, 0, 4, 8, 4, d, 4, d, 8, d, 4, 0), "ldd < N");
    /* nothing to do is success */
    if (kiln_cuda_gemm_linear(g_gemm, g_s, d, d, w, 64, KILN_DTYPE_F32, 2, 16, NULL, 0, 0) != cudaSuccess ||
        kiln_cuda_gemm_f32(g_gemm, g_s, 0, 0, 0, 4, 4, d, 4, d, 4, d, 4, 0) != cudaSuccess) {
        fprintf(stderr, "FAIL errors: an empty product did not return cudaSuccess\n");
        g_failed++;
    }
    cudaFree(d);
}

int main(int argc, char **argv) {
    if (argc > 1) g_rng = strtoull(argv[1], NULL, 0);
    setvbuf(stdout, NULL, _IOLBF, 0);

    /* what can be checked without a GPU */
    if (kiln_cuda_gemm_error(NULL)[0] != '\0') {
        fprintf(stderr, "FAIL kiln_cuda_gemm_error(NULL) is not \"\"\n");
        return 1;
    }
    kiln_cuda_gemm_free(NULL);
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        kiln_cuda_gemm *g = (kiln_cuda_gemm *)1;
        cudaError_t e = kiln_cuda_gemm_create(0, &g);
        if (e == cudaSuccess || g != NULL) {
            fprintf(stderr, "FAIL kiln_cuda_gemm_create without a GPU: %s, handle %p\n",
                    cudaGetErrorString(e), (void *)g);
            return 1;
        }
        printf("no GPU: kiln_cuda_gemm_create refuses (%s); skipped\n", kiln_last_error());
        return 77;
    }

    if (kiln_backend_cpu_create(0, &g_cpu) != KILN_OK) {
        fprintf(stderr, "cpu backend: %s\n", kiln_last_error());
        return 1;
    }
    CUDA_OK(cudaSetDevice(0));
    if (kiln_cuda_gemm_create(0, &g_gemm) != cudaSuccess) {
        fprintf(stderr, "FAIL kiln_cuda_gemm_create: %s\n", kiln_last_error());
        return 1;
    }
    CUDA_OK(cudaStreamCreateWithFlags(&g_s, cudaStreamNonBlocking));

    test_f32_to_bf16();
    for (kiln_dtype dt : g_all_dtypes) test_weights_to_bf16(dt);

    static const kiln_dtype linear_dtypes[] = {KILN_DTYPE_F32,  KILN_DTYPE_BF16, KILN_DTYPE_F16,
                                               KILN_DTYPE_Q8_0, KILN_DTYPE_Q4_1, KILN_DTYPE_Q4_K,
                                               KILN_DTYPE_Q6_K};
    for (kiln_dtype dt : linear_dtypes) test_linear_dtype(dt);

    static const int64_t shapes[][3] = {{1, 1, 1}, {7, 13, 33}, {64, 96, 128}, {257, 130, 511},
                                        {33, 1000, 17}, {512, 9, 300}};
    for (const auto &sh : shapes)
        for (int t = 0; t < 4; t++)
            for (int acc = 0; acc < 2; acc++) test_gemm_f32(t & 1, t >> 1, sh[0], sh[1], sh[2], acc);

    test_capture();
    test_errors();

    printf("cached algorithms: %d; worst err/S over all cases: %.2e (2^-7 = %.2e)\n",
           kiln_cuda_gemm_cached(g_gemm), g_worst_ratio, 0x1p-7);
    CUDA_OK(cudaStreamDestroy(g_s));
    kiln_cuda_gemm_free(g_gemm);
    kiln_backend_free(g_cpu);
    if (g_failed) {
        printf("FAILED %d\n", g_failed);
        return 1;
    }
    printf("ALL OK\n");
    return 0;
}
