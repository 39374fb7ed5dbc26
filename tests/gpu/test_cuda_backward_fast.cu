/*
 * test_cuda_backward_fast.cu -- the fast mode's matmul backward (src/ops/cuda/
 * cuda_matmul.h) against the CPU backend's matmul_backward.
 *
 * Cases: W in f32, bf16 and f16; odd shapes (N 1..130, R and C from 3 to 4864, C not a
 * multiple of 8); accumulate_dx 0/1; every combination of the three outputs present or NULL;
 * W rows packed, padded (row_bytes past C), and a bf16 W at an address 2 bytes past alignment
 * (copied rather than read in place). Per case:
 *   - dx (overwritten: poisoned with NaN bits first; accumulated: random old values) and dW
 *     (random old values) within the bound below, element by element;
 *   - dbias (kiln_cuda_col_sum_fast: chunked, summed in double) within
 *     2^-24 |ref| + (N + 300) 2^-52 S of the host double sum ref = old + sum over tokens of
 *     dy, S = |old| + sum |dy| (tests/gpu/test_cuda_colsum_fast.cu tests the sum itself);
 *   - an output passed as NULL is left untouched (its device copy is compared bit for bit
 *     with the values uploaded);
 *   - the case run twice from the same inputs gives the same bits (determinism).
 *
 * The bound. dy, x and W are each rounded to bf16 (relative error <= 2^-8 each; an f16 W as
 * well, a bf16 W not at all), so each product is off by <= (2^-7 + 2^-16)|a_k b_k|; both
 * sides sum K terms in f32 (K = R for dx, N for dW; error <= about K * 2^-24 * S each, first
 * order). With S = sum_k |a_k||b_k| (the CPU backend's matmul_backward on |dy|, |x|, |W|):
 *   |gpu - cpu| <= (2^-7 + 2^-16 + 2 K 2^-24) * S + 2^-22 * |old| + 1e-6
 * (|old|: the accumulated-into value; the last terms cover the f32 additions). A worst case:
 * random data lands far below (the printed max err/S shows by how much).
 *
 * Also: argument errors return cudaErrorInvalidValue (g NULL is checked without a GPU), and a
 * training-sized shape is timed against the auditable kiln_cuda_matmul_backward
 * (informative). Without a GPU: the host-side checks, then exit 77.
 *
 * Usage: test_cuda_backward_fast [seed]. One line per case, then "ALL OK" or "FAILED n".
 */
#include "ops/cuda/cuda_elementwise.h"
#include "ops/cuda/cuda_matmul.h"
#include "ops/cuda/cuda_norm.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#define GPU_TEST_FAILS g_failed /* CUDA_FATAL's count */
#include "gpu_test_cuda_check.h"

static int g_failed;
static kiln_cuda_gemm *g_gemm;
static cudaStream_t g_s;
static kiln_backend *g_cpu;
static double g_worst_dx, g_worst_dw; /* max over the cases of err / S */

/* ---- random numbers (splitmix64) ---------------------------------------------------------- */

static uint64_t g_rng = 0x6b696c6e46425744ull;
static uint64_t rnd_u64(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rnd_unit(void) { return (float)((double)(rnd_u64() >> 11) * 0x1p-53 * 2.0 - 1.0); }
/* Values in [-scale, scale], one in 16 an exact zero. */
static void fill_rand(std::vector<float> &v, float scale) {
    for (float &f : v) f = (rnd_u64() & 15) == 0 ? 0.0f : rnd_unit() * scale;
}

/* A quiet NaN with a payload no arithmetic produces. */
static const uint32_t POISON_BITS = 0x7fedcba9u;
static void poison(std::vector<float> &v) {
    for (float &f : v) memcpy(&f, &POISON_BITS, 4);
}

/* ---- device buffers (freed at the end of each case) ---------------------------------------- */

static std::vector<void *> g_dev;

static void *dev_alloc(size_t nbytes) {
    void *p = NULL;
    CUDA_FATAL(cudaMalloc(&p, nbytes ? nbytes : 4));
    g_dev.push_back(p);
    return p;
}
static void up(void *d, const void *h, size_t nbytes) {
    CUDA_FATAL(cudaMemcpyAsync(d, h, nbytes, cudaMemcpyHostToDevice, g_s));
    CUDA_FATAL(cudaStreamSynchronize(g_s));
}
static float *dev_copy(const std::vector<float> &h) {
    float *d = (float *)dev_alloc(h.size() * sizeof(float));
    up(d, h.data(), h.size() * sizeof(float));
    return d;
}
static std::vector<float> to_host(const float *d, size_t n) {
    std::vector<float> h(n);
    CUDA_FATAL(cudaStreamSynchronize(g_s));
    CUDA_FATAL(cudaMemcpyAsync(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost, g_s));
    CUDA_FATAL(cudaStreamSynchronize(g_s));
    return h;
}
static void dev_free_all(void) {
    for (void *p : g_dev) CUDA_FATAL(cudaFree(p));
    g_dev.clear();
}

/* ---- comparisons --------------------------------------------------------------------------- */

static int same_bits(const char *ctx, const char *what, const std::vector<float> &want,
                     const std::vector<float> &got) {
    for (size_t i = 0; i < want.size(); i++)
        if (memcmp(&want[i], &got[i], 4) != 0) {
            uint32_t a, b;
            memcpy(&a, &want[i], 4);
            memcpy(&b, &got[i], 4);
            fprintf(stderr, "FAIL %s: %s: first difference at [%zu]: want %.9g (0x%08x) got %.9g "
                            "(0x%08x)\n",
                    ctx, what, i, want[i], a, got[i], b);
            return 1;
        }
    return 0;
}

/* |got - (cpu)| within the bound per element; cpu already includes old (the CPU accumulates);
 * S: sum |a||b| per element; old: the value accumulated into (NULL: none). Returns 1 on a
 * violation; *worst = max err / S over the elements with S > 0. */
static int within_bound(const char *ctx, const char *what, const std::vector<float> &cpu,
                        const std::vector<float> &got, const std::vector<float> &S,
                        const std::vector<float> *old, double K, double *worst) {
    long bad = 0;
    size_t first = 0;
    double w = 0.0;
    for (size_t i = 0; i < cpu.size(); i++) {
        const double o = old ? fabs((double)(*old)[i]) : 0.0;
        const double err = fabs((double)got[i] - (double)cpu[i]);
        const double tol = (0x1p-7 + 0x1p-16 + 2.0 * K * 0x1p-24) * (double)S[i] + 0x1p-22 * o +
                           1e-6;
        if (!(err <= tol)) { /* NaN fails too */
            if (!bad) first = i;
            bad++;
        }
        if (S[i] > 0.0f && err / (double)S[i] > w) w = err / (double)S[i];
    }
    if (w > *worst) *worst = w;
    if (bad)
        fprintf(stderr, "FAIL %s: %s: %ld of %zu outside the bound; first [%zu] cpu %.9g gpu "
                        "%.9g S %.6g\n",
                ctx, what, bad, cpu.size(), first, cpu[first], got[first], S[first]);
    printf("    %s: max err/S %.3g\n", what, w);
    return bad ? 1 : 0;
}

/* dbias against the host double sum: ref = old + sum over n of dy[n,r], S = |old| + sum |dy|;
 * the bound of cuda_norm.h's column sum plus the host's own rounding. */
static int dbias_within(const char *ctx, const std::vector<float> &db0,
                        const std::vector<float> &dy, int N, int64_t R,
                        const std::vector<float> &got) {
    long bad = 0;
    size_t first = 0;
    double first_ref = 0.0;
    for (int64_t r = 0; r < R; r++) {
        double ref = db0[(size_t)r], S = fabs((double)db0[(size_t)r]);
        for (int n = 0; n < N; n++) {
            ref += dy[(size_t)n * (size_t)R + (size_t)r];
            S += fabs((double)dy[(size_t)n * (size_t)R + (size_t)r]);
        }
        const double err = fabs((double)got[(size_t)r] - ref);
        if (!(err <= 0x1p-24 * fabs(ref) + (double)(N + 300) * 0x1p-52 * S + 1e-37)) {
            if (!bad) {
                first = (size_t)r;
                first_ref = ref;
            }
            bad++;
        }
    }
    if (bad)
        fprintf(stderr, "FAIL %s: dbias: %ld of %lld outside the bound; first [%zu] want %.17g "
                        "gpu %.9g\n",
                ctx, bad, (long long)R, first, first_ref, got[first]);
    return bad ? 1 : 0;
}

/* ---- one case ------------------------------------------------------------------------------ */

enum { V_PACKED = 0, V_PAD_ROWS = 1, V_MISALIGNED = 2 };

static const char *dt_name(kiln_dtype dt) {
    return dt == KILN_DTYPE_F32 ? "f32" : dt == KILN_DTYPE_BF16 ? "bf16" : "f16";
}

/* Host bytes of W (R rows of C, packed) from values wf; sign_clear: |W| (the sign bit
 * cleared, exact in every dtype). */
static std::vector<uint8_t> encode_w(kiln_dtype dt, const std::vector<float> &wf, bool abs_val) {
    const size_t es = dt == KILN_DTYPE_F32 ? 4 : 2;
    std::vector<uint8_t> b(wf.size() * es);
    for (size_t i = 0; i < wf.size(); i++) {
        if (dt == KILN_DTYPE_F32) {
            uint32_t u;
            memcpy(&u, &wf[i], 4);
            if (abs_val) u &= 0x7fffffffu;
            memcpy(&b[4 * i], &u, 4);
        } else {
            uint16_t h = dt == KILN_DTYPE_BF16 ? kiln_fp32_to_bf16(wf[i]) : kiln_fp32_to_fp16(wf[i]);
            if (abs_val) h = (uint16_t)(h & 0x7fffu);
            memcpy(&b[2 * i], &h, 2);
        }
    }
    return b;
}

static kiln_tensor make_tensor(kiln_dtype dt, int64_t R, int64_t C, std::vector<uint8_t> &bytes) {
    kiln_tensor W;
    memset(&W, 0, sizeof W);
    W.name = "W";
    W.dtype = dt;
    W.n_dims = 2;
    for (int d = 0; d < KILN_MAX_DIMS; d++) W.shape[d] = 1;
    W.shape[0] = R;
    W.shape[1] = C;
    W.data = bytes.data();
    W.nbytes = bytes.size();
    return W;
}

static void case_matmul(kiln_dtype dt, int N, int64_t R, int64_t C, bool acc, bool want_dx,
                        bool want_dW, bool want_db, int variant) {
    char ctx[200];
    snprintf(ctx, sizeof ctx, "backward_fast %s N=%d R=%lld C=%lld acc=%d%s%s%s%s%s", dt_name(dt),
             N, (long long)R, (long long)C, (int)acc, want_dx ? " dx" : "", want_dW ? " dW" : "",
             want_db ? " dbias" : "", (variant & V_PAD_ROWS) ? " padded-rows" : "",
             (variant & V_MISALIGNED) ? " W+2B" : "");
    const size_t nx = (size_t)N * C, ny = (size_t)N * R, nw = (size_t)R * C;
    const size_t es = dt == KILN_DTYPE_F32 ? 4 : 2;
    std::vector<float> x(nx), dy(ny), wf(nw), dx0(nx), dW0(nw), db0((size_t)R);
    fill_rand(x, 1.0f);
    fill_rand(dy, 1.0f);
    fill_rand(wf, 1.0f);
    if (acc) fill_rand(dx0, 2.0f);
    else poison(dx0);
    fill_rand(dW0, 2.0f);
    fill_rand(db0, 2.0f);
    std::vector<uint8_t> wb = encode_w(dt, wf, false), wabs = encode_w(dt, wf, true);

    /* CPU reference, and S = the same products of absolute values (dx: |dy| @ |W|, dW: |dy|^T
     * @ |x|, accumulated into zeros) */
    std::vector<float> cdx(dx0), cdW(dW0);
    kiln_tensor W = make_tensor(dt, R, C, wb), Wabs = make_tensor(dt, R, C, wabs);
    g_cpu->i->matmul_backward(g_cpu, want_dx ? cdx.data() : NULL, want_dW ? cdW.data() : NULL,
                              NULL, dy.data(), x.data(), &W, N, acc);
    std::vector<float> ady(dy), ax(x), Sdx(nx, 0.0f), SdW(nw, 0.0f);
    for (float &f : ady) f = fabsf(f);
    for (float &f : ax) f = fabsf(f);
    g_cpu->i->matmul_backward(g_cpu, Sdx.data(), SdW.data(), NULL, ady.data(), ax.data(), &Wabs,
                              N, false);

    /* device: W with rows drb apart, at an offset of 2 bytes for V_MISALIGNED (bf16/f16 only) */
    const size_t rb = (size_t)C * es, drb = (variant & V_PAD_ROWS) ? rb + 3 * es : rb;
    const size_t woff = (variant & V_MISALIGNED) ? 2 : 0;
    uint8_t *d_wbuf = (uint8_t *)dev_alloc(drb * (size_t)R + 16);
    CUDA_FATAL(cudaMemsetAsync(d_wbuf, 0xff, drb * (size_t)R + 16, g_s)); /* padding: NaN bits */
    CUDA_FATAL(cudaMemcpy2DAsync(d_wbuf + woff, drb, wb.data(), rb, rb, (size_t)R,
                                 cudaMemcpyHostToDevice, g_s));
    CUDA_FATAL(cudaStreamSynchronize(g_s));
    const uint8_t *d_w = d_wbuf + woff;
    float *d_x = dev_copy(x), *d_dy = dev_copy(dy);

    std::vector<float> got_dx[2], got_dW[2], got_db[2];
    bool ran = true;
    for (int k = 0; k < 2 && ran; k++) {
        float *d_dx = dev_copy(dx0), *d_dW = dev_copy(dW0), *d_db = dev_copy(db0);
        cudaError_t e = kiln_cuda_matmul_backward_fast(
            g_gemm, g_s, want_dx ? d_dx : NULL, want_dW ? d_dW : NULL, want_db ? d_db : NULL,
            d_dy, d_x, d_w, drb, dt, R, C, N, acc);
        if (e == cudaSuccess) e = cudaStreamSynchronize(g_s);
        if (e != cudaSuccess) {
            fprintf(stderr, "FAIL %s: %s (gemm: %s)\n", ctx, cudaGetErrorString(e),
                    kiln_cuda_gemm_error(g_gemm));
            ran = false;
            break;
        }
        got_dx[k] = to_host(d_dx, nx);
        got_dW[k] = to_host(d_dW, nw);
        got_db[k] = to_host(d_db, (size_t)R);
    }
    int bad = ran ? 0 : 1;
    if (ran) {
        printf("%s\n", ctx);
        /* asked-for outputs within their bounds, the others untouched */
        if (want_dx) bad |= within_bound(ctx, "dx", cdx, got_dx[0], Sdx, acc ? &dx0 : NULL,
                                         (double)R, &g_worst_dx);
        else bad |= same_bits(ctx, "dx (NULL: untouched)", dx0, got_dx[0]);
        if (want_dW) bad |= within_bound(ctx, "dW", cdW, got_dW[0], SdW, &dW0, (double)N,
                                         &g_worst_dw);
        else bad |= same_bits(ctx, "dW (NULL: untouched)", dW0, got_dW[0]);
        if (want_db) bad |= dbias_within(ctx, db0, dy, N, R, got_db[0]);
        else bad |= same_bits(ctx, "dbias (NULL: untouched)", db0, got_db[0]);
        /* determinism: the second run, bit for bit */
        bad |= same_bits(ctx, "dx run 2", got_dx[0], got_dx[1]);
        bad |= same_bits(ctx, "dW run 2", got_dW[0], got_dW[1]);
        bad |= same_bits(ctx, "dbias run 2", got_db[0], got_db[1]);
    }
    printf("  -> %s\n", bad ? "FAILED" : "OK");
    if (bad) g_failed++;
    dev_free_all();
}

/* ---- dx in bf16 (the MLP's down projection) and swiglu's backward on a bf16 dout ------------- */

static std::vector<uint16_t> to_bf16(std::vector<float> &v) { /* rounds v in place too */
    std::vector<uint16_t> b(v.size());
    for (size_t i = 0; i < v.size(); i++) {
        b[i] = kiln_fp32_to_bf16(v[i]);
        v[i] = kiln_bf16_to_fp32(b[i]);
    }
    return b;
}

static void case_dx16(kiln_dtype dt, int N, int64_t R, int64_t C) {
    char ctx[200];
    snprintf(ctx, sizeof ctx, "backward_fast dx16 %s N=%d R=%lld C=%lld", dt_name(dt), N,
             (long long)R, (long long)C);
    const size_t nx = (size_t)N * C, ny = (size_t)N * R, nw = (size_t)R * C;
    std::vector<float> x(nx), dy(ny), wf(nw), dW0(nw), cdx(nx, 0.0f);
    fill_rand(x, 1.0f);
    fill_rand(dy, 1.0f);
    fill_rand(wf, 1.0f);
    fill_rand(dW0, 2.0f);
    const std::vector<uint16_t> x16 = to_bf16(x), dy16 = to_bf16(dy); /* exact inputs */
    std::vector<uint8_t> wb = encode_w(dt, wf, false), wabs = encode_w(dt, wf, true);
    kiln_tensor W = make_tensor(dt, R, C, wb), Wabs = make_tensor(dt, R, C, wabs);
    g_cpu->i->matmul_backward(g_cpu, cdx.data(), NULL, NULL, dy.data(), x.data(), &W, N, false);
    std::vector<float> ady(dy), ax(x), Sdx(nx, 0.0f);
    for (float &f : ady) f = fabsf(f);
    for (float &f : ax) f = fabsf(f);
    g_cpu->i->matmul_backward(g_cpu, Sdx.data(), NULL, NULL, ady.data(), ax.data(), &Wabs, N,
                              false);
    const size_t rb = (size_t)C * (dt == KILN_DTYPE_F32 ? 4 : 2);
    uint8_t *d_w = (uint8_t *)dev_alloc(rb * (size_t)R);
    up(d_w, wb.data(), rb * (size_t)R);
    uint16_t *d_x16 = (uint16_t *)dev_alloc(nx * 2), *d_dy16 = (uint16_t *)dev_alloc(ny * 2);
    up(d_x16, x16.data(), nx * 2);
    up(d_dy16, dy16.data(), ny * 2);
    std::vector<float> got[2], gotW[2], refW;
    int bad = 0;
    for (int k = 0; k < 3 && !bad; k++) {
        float *d_dW = dev_copy(dW0);
        kiln_cuda_mb_item it;
        memset(&it, 0, sizeof it);
        it.dW = d_dW;
        it.dy16 = d_dy16;
        it.w = d_w;
        it.row_bytes = rb;
        it.dt = dt;
        it.R = R;
        cudaError_t e;
        uint16_t *d_dx16 = (uint16_t *)dev_alloc(nx * 2);
        if (k < 2) {
            e = kiln_cuda_matmul_backward_fast_dx16(g_gemm, g_s, &it, d_dx16, d_x16, C, C, N);
        } else { /* the f32-dx form: dW must have the same bits */
            float *d_dx = (float *)dev_alloc(nx * 4);
            e = kiln_cuda_matmul_backward_fast_multi_bf16(g_gemm, g_s, 1, &it, d_dx, d_x16, C, C,
                                                          N, false);
        }
        if (e == cudaSuccess) e = cudaStreamSynchronize(g_s);
        if (e != cudaSuccess) {
            fprintf(stderr, "FAIL %s: %s (gemm: %s)\n", ctx, cudaGetErrorString(e),
                    kiln_cuda_gemm_error(g_gemm));
            bad = 1;
            break;
        }
        if (k < 2) {
            std::vector<uint16_t> h(nx);
            CUDA_FATAL(cudaMemcpy(h.data(), d_dx16, nx * 2, cudaMemcpyDeviceToHost));
            got[k].resize(nx);
            for (size_t i = 0; i < nx; i++) got[k][i] = kiln_bf16_to_fp32(h[i]);
            gotW[k] = to_host(d_dW, nw);
        } else {
            refW = to_host(d_dW, nw);
        }
    }
    if (!bad) {
        printf("%s\n", ctx);
        /* the product's f32 bound plus the bf16 rounding of the result (<= 2^-9 |dx| <= 2^-9 S) */
        std::vector<float> S2(Sdx);
        for (float &f : S2) f = f * (1.0f + 0x1p-2f);
        bad |= within_bound(ctx, "dx16", cdx, got[0], S2, NULL, (double)R, &g_worst_dx);
        bad |= same_bits(ctx, "dx16 run 2", got[0], got[1]);
        bad |= same_bits(ctx, "dW (dx16 form vs f32 dx form)", refW, gotW[0]);
        bad |= same_bits(ctx, "dW run 2", gotW[0], gotW[1]);
    }
    printf("  -> %s\n", bad ? "FAILED" : "OK");
    if (bad) g_failed++;
    dev_free_all();
}

/* kiln_cuda_swiglu_backward_bf16_d16 against kiln_cuda_swiglu_backward_bf16 on the widened
 * dout: the same bits (exact: the 4-wide kernel and the tail; fast: the 8-wide kernel and the
 * one-element kernel). */
static void case_swiglu_d16(size_t n, size_t off, bool fast) {
    char ctx[120];
    snprintf(ctx, sizeof ctx, "swiglu_backward_bf16_d16%s n=%zu offset=%zu", fast ? " (fast)" : "",
             n, off);
    std::vector<float> g(n + off), u(n + off), d(n + off);
    fill_rand(g, 4.0f);
    fill_rand(u, 2.0f);
    fill_rand(d, 1.0f);
    const std::vector<uint16_t> g16 = to_bf16(g), u16 = to_bf16(u), d16 = to_bf16(d);
    uint16_t *dg = (uint16_t *)dev_alloc((n + off) * 2), *du = (uint16_t *)dev_alloc((n + off) * 2);
    uint16_t *dd = (uint16_t *)dev_alloc((n + off) * 2);
    up(dg, g16.data(), (n + off) * 2);
    up(du, u16.data(), (n + off) * 2);
    up(dd, d16.data(), (n + off) * 2);
    float *df = dev_copy(d); /* the widened dout, f32 */
    uint16_t *o[4];
    for (int i = 0; i < 4; i++) o[i] = (uint16_t *)dev_alloc((n + off) * 2);
    CUDA_FATAL(kiln_cuda_swiglu_backward_bf16_d16(g_s, o[0] + off, o[1] + off, (int64_t)n,
                                                  dd + off, dg + off, du + off, 1, (int64_t)n,
                                                  fast));
    CUDA_FATAL(kiln_cuda_swiglu_backward_bf16(g_s, o[2] + off, o[3] + off, df + off, dg + off,
                                              du + off, n, fast));
    CUDA_FATAL(cudaStreamSynchronize(g_s));
    std::vector<uint16_t> h[4];
    for (int i = 0; i < 4; i++) {
        h[i].resize(n);
        CUDA_FATAL(cudaMemcpy(h[i].data(), o[i] + off, n * 2, cudaMemcpyDeviceToHost));
    }
    const int bad = h[0] != h[2] || h[1] != h[3];
    printf("%s -> %s\n", ctx, bad ? "FAILED" : "OK");
    if (bad) g_failed++;
    dev_free_all();
}

/* The 2-D form: rows of cols written ld apart (dgate and dup as column blocks of one matrix,
 * as the stacked gate/up product takes them), against the flat form row by row. */
static void case_swiglu_d16_2d(int64_t rows, int64_t cols, int64_t ld, bool fast) {
    char ctx[120];
    snprintf(ctx, sizeof ctx, "swiglu_backward_bf16_d16%s rows=%lld cols=%lld ld=%lld",
             fast ? " (fast)" : "", (long long)rows, (long long)cols, (long long)ld);
    const size_t n = (size_t)(rows * cols), nm = (size_t)(rows * ld);
    std::vector<float> g(n), u(n), d(n);
    fill_rand(g, 4.0f);
    fill_rand(u, 2.0f);
    fill_rand(d, 1.0f);
    const std::vector<uint16_t> g16 = to_bf16(g), u16 = to_bf16(u), d16 = to_bf16(d);
    uint16_t *dg = (uint16_t *)dev_alloc(n * 2), *du = (uint16_t *)dev_alloc(n * 2);
    uint16_t *dd = (uint16_t *)dev_alloc(n * 2), *m = (uint16_t *)dev_alloc(nm * 2);
    uint16_t *fg = (uint16_t *)dev_alloc(n * 2), *fu = (uint16_t *)dev_alloc(n * 2);
    up(dg, g16.data(), n * 2);
    up(du, u16.data(), n * 2);
    up(dd, d16.data(), n * 2);
    CUDA_FATAL(cudaMemset(m, 0xff, nm * 2));
    const int64_t half = ld / 2; /* dgate at column 0, dup at column ld / 2 */
    CUDA_FATAL(kiln_cuda_swiglu_backward_bf16_d16(g_s, m, m + half, ld, dd, dg, du, rows, cols,
                                                  fast));
    CUDA_FATAL(kiln_cuda_swiglu_backward_bf16_d16(g_s, fg, fu, cols, dd, dg, du, rows, cols,
                                                  fast));
    CUDA_FATAL(cudaStreamSynchronize(g_s));
    std::vector<uint16_t> hm(nm), hg(n), hu(n);
    CUDA_FATAL(cudaMemcpy(hm.data(), m, nm * 2, cudaMemcpyDeviceToHost));
    CUDA_FATAL(cudaMemcpy(hg.data(), fg, n * 2, cudaMemcpyDeviceToHost));
    CUDA_FATAL(cudaMemcpy(hu.data(), fu, n * 2, cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < ld; c++) {
            const uint16_t got = hm[(size_t)(r * ld + c)];
            uint16_t want = 0xffff; /* untouched */
            if (c < cols) want = hg[(size_t)(r * cols + c)];
            else if (c >= half && c < half + cols) want = hu[(size_t)(r * cols + c - half)];
            bad |= got != want;
        }
    printf("%s -> %s\n", ctx, bad ? "FAILED" : "OK");
    if (bad) g_failed++;
    dev_free_all();
}

/* Fast mode's SwiGLU kernels (kiln_fast_swiglu, kiln_fast_swiglu_bwd: the MUFU's 2^x and
 * reciprocal) against the exact formula in double on the same bf16 inputs: every output must
 * be within one bf16 ulp of the exact value (the rounding of a few f32 ulps of error can land
 * on the other neighbour, never further), and the exact kernels' bits (kiln_fp32_to_bf16 of
 * kiln_swiglu's f32 result) must differ in at most 1% of the elements (the count is printed).
 * g spans [-12, 12] so the sigmoid's tails and the 1 - sigmoid cancellation are covered; n
 * (not a multiple of 8) runs the 8-wide kernels and the one-element tail. */
static double bf16_ulp(double y) {
    const double a = fabs(y);
    if (a < 0x1p-126) return 0x1p-133; /* bf16's subnormal step */
    return ldexp(1.0, ilogb(a) - 7);
}
static void case_swiglu_fast_error(size_t n) {
    char ctx[120];
    snprintf(ctx, sizeof ctx, "swiglu fast vs exact n=%zu", n);
    std::vector<float> g(n), u(n), d(n);
    fill_rand(g, 12.0f);
    fill_rand(u, 2.0f);
    fill_rand(d, 1.0f);
    const std::vector<uint16_t> g16 = to_bf16(g), u16 = to_bf16(u), d16 = to_bf16(d);
    uint16_t *dg = (uint16_t *)dev_alloc(n * 2), *du = (uint16_t *)dev_alloc(n * 2);
    uint16_t *dd = (uint16_t *)dev_alloc(n * 2);
    up(dg, g16.data(), n * 2);
    up(du, u16.data(), n * 2);
    up(dd, d16.data(), n * 2);
    float *df = dev_copy(d);
    uint16_t *o[10];
    for (int i = 0; i < 10; i++) o[i] = (uint16_t *)dev_alloc(n * 2);
    /* [0] fwd fast, [1] fwd exact; [2,3] bwd d16 fast (dgate, dup), [4,5] bwd f32-dout fast,
     * [6,7] bwd d16 exact */
    CUDA_FATAL(kiln_cuda_swiglu_bf16(g_s, o[0], dg, du, n, true));
    CUDA_FATAL(kiln_cuda_swiglu_bf16(g_s, o[1], dg, du, n, false));
    CUDA_FATAL(kiln_cuda_swiglu_backward_bf16_d16(g_s, o[2], o[3], (int64_t)n, dd, dg, du, 1,
                                                  (int64_t)n, true));
    CUDA_FATAL(kiln_cuda_swiglu_backward_bf16(g_s, o[4], o[5], df, dg, du, n, true));
    CUDA_FATAL(kiln_cuda_swiglu_backward_bf16_d16(g_s, o[6], o[7], (int64_t)n, dd, dg, du, 1,
                                                  (int64_t)n, false));
    CUDA_FATAL(cudaStreamSynchronize(g_s));
    std::vector<uint16_t> h[8];
    for (int i = 0; i < 8; i++) {
        h[i].resize(n);
        CUDA_FATAL(cudaMemcpy(h[i].data(), o[i], n * 2, cudaMemcpyDeviceToHost));
    }
    auto val = [](uint16_t b) { return (double)kiln_bf16_to_fp32(b); };
    size_t far = 0, flips[3] = {0, 0, 0}, first_far = n;
    for (size_t i = 0; i < n; i++) {
        const double G = g[i], U = u[i], D = d[i]; /* the bf16 values (to_bf16 rounded them) */
        const double sg = 1.0 / (1.0 + exp(-G)), silu = G * sg;
        const double y = silu * U, yup = D * silu, ygate = (D * U) * (sg * (1.0 + G * (1.0 - sg)));
        const double want[3] = {y, ygate, yup};
        const uint16_t got[3] = {h[0][i], h[2][i], h[3][i]}, exact[3] = {h[1][i], h[6][i], h[7][i]};
        for (int k = 0; k < 3; k++) {
            if (!(fabs(val(got[k]) - want[k]) <= bf16_ulp(want[k]))) {
                if (far++ == 0) first_far = i;
            }
            if (got[k] != exact[k]) flips[k]++;
        }
        if (h[4][i] != h[2][i] || h[5][i] != h[3][i]) { /* the f32-dout form: the same bits */
            if (far++ == 0) first_far = i;
        }
    }
    const int bad = far > 0 || flips[0] > n / 100 || flips[1] > n / 100 || flips[2] > n / 100;
    if (far)
        printf("  first off by more than one bf16 ulp (or f32-dout form differing) at [%zu]: g %.6g u "
               "%.6g d %.6g\n", first_far, (double)g[first_far], (double)u[first_far],
               (double)d[first_far]);
    printf("%s: beyond one ulp %zu; differing from the exact kernels' bits: swiglu %zu, dgate %zu, "
           "dup %zu of %zu -> %s\n", ctx, far, flips[0], flips[1], flips[2], n, bad ? "FAILED" : "OK");
    if (bad) g_failed++;
    dev_free_all();
}

/* The SwiGLU kernels' time, exact and fast, at a training shape (informative). */
static void timing_swiglu(int64_t rows, int64_t cols) {
    const size_t n = (size_t)(rows * cols);
    uint16_t *b[6];
    for (int i = 0; i < 6; i++) {
        b[i] = (uint16_t *)dev_alloc(n * 2);
        CUDA_FATAL(cudaMemsetAsync(b[i], 0x3c, n * 2, g_s));
    }
    cudaEvent_t a, e;
    CUDA_FATAL(cudaEventCreate(&a));
    CUDA_FATAL(cudaEventCreate(&e));
    float ms[4];
    for (int mode = 0; mode < 4; mode++) {
        const bool fast = mode & 1;
        for (int it = 0; it < 6; it++) { /* 1 warm-up, then 5 timed */
            if (it == 1) CUDA_FATAL(cudaEventRecord(a, g_s));
            if (mode < 2)
                CUDA_FATAL(kiln_cuda_swiglu_bf16(g_s, b[0], b[1], b[2], n, fast));
            else
                CUDA_FATAL(kiln_cuda_swiglu_backward_bf16_d16(g_s, b[3], b[4], cols, b[0], b[1],
                                                              b[2], rows, cols, fast));
        }
        CUDA_FATAL(cudaEventRecord(e, g_s));
        CUDA_FATAL(cudaEventSynchronize(e));
        CUDA_FATAL(cudaEventElapsedTime(&ms[mode], a, e));
        ms[mode] /= 5.0f;
    }
    printf("time swiglu %lldx%lld: forward exact %.1f us, fast %.1f us (%.2f TB/s); backward (bf16 "
           "dout) exact %.1f us, fast %.1f us (%.2f TB/s)\n",
           (long long)rows, (long long)cols, ms[0] * 1e3, ms[1] * 1e3, 6.0 * n / (ms[1] * 1e9),
           ms[2] * 1e3, ms[3] * 1e3, 10.0 * n / (ms[3] * 1e9));
    CUDA_FATAL(cudaEventDestroy(a));
    CUDA_FATAL(cudaEventDestroy(e));
    dev_free_all();
}

/* ---- argument errors -------------------------------------------------------------------------- */

static int host_checks(void) {
    int bad = 0;
    float *bogus = (float *)(uintptr_t)0x1000;
    /* g NULL: refused before anything is touched */
    if (kiln_cuda_matmul_backward_fast(NULL, 0, bogus, bogus, bogus, bogus, bogus,
                                       (const uint8_t *)bogus, 32, KILN_DTYPE_F32, 4, 8, 2,
                                       false) != cudaErrorInvalidValue) {
        fprintf(stderr, "FAIL host check: g NULL not refused\n");
        bad++;
    }
    return bad;
}

static void argument_checks(void) {
    float *p = (float *)dev_alloc(1 << 16);
    const uint8_t *w = (const uint8_t *)p;
    struct {
        const char *what;
        cudaError_t got, want;
    } c[] = {
        {"dtype q8_0", kiln_cuda_matmul_backward_fast(g_gemm, g_s, p, p + 1024, NULL, p + 2048,
                                                      p + 3072, w, 34, KILN_DTYPE_Q8_0, 4, 32,
                                                      2, false),
         cudaErrorInvalidValue},
        {"row_bytes < C", kiln_cuda_matmul_backward_fast(g_gemm, g_s, p, NULL, NULL, p + 2048,
                                                         p + 3072, w, 28, KILN_DTYPE_F32, 4, 8,
                                                         2, false),
         cudaErrorInvalidValue},
        {"row_bytes odd (bf16)", kiln_cuda_matmul_backward_fast(g_gemm, g_s, p, NULL, NULL,
                                                                p + 2048, p + 3072, w, 17,
                                                                KILN_DTYPE_BF16, 4, 8, 2, false),
         cudaErrorInvalidValue},
        {"f32 W misaligned", kiln_cuda_matmul_backward_fast(g_gemm, g_s, p, NULL, NULL, p + 2048,
                                                            p + 3072, w + 2, 32, KILN_DTYPE_F32,
                                                            4, 8, 2, false),
         cudaErrorInvalidValue},
        {"dW without x", kiln_cuda_matmul_backward_fast(g_gemm, g_s, NULL, p, NULL, p + 2048, NULL,
                                                        w, 32, KILN_DTYPE_F32, 4, 8, 2, false),
         cudaErrorInvalidValue},
        {"dy NULL", kiln_cuda_matmul_backward_fast(g_gemm, g_s, p, NULL, NULL, NULL, p + 3072, w,
                                                   32, KILN_DTYPE_F32, 4, 8, 2, false),
         cudaErrorInvalidValue},
        {"N = 0: nothing", kiln_cuda_matmul_backward_fast(g_gemm, g_s, p, p, p, p, p, w, 32,
                                                          KILN_DTYPE_F32, 4, 8, 0, false),
         cudaSuccess},
        {"no outputs: nothing", kiln_cuda_matmul_backward_fast(g_gemm, g_s, NULL, NULL, NULL, NULL,
                                                               NULL, NULL, 0, KILN_DTYPE_F32, 4,
                                                               8, 2, false),
         cudaSuccess},
    };
    int bad = 0;
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++)
        if (c[i].got != c[i].want) {
            fprintf(stderr, "FAIL argument check '%s': got %s, want %s\n", c[i].what,
                    cudaGetErrorName(c[i].got), cudaGetErrorName(c[i].want));
            bad++;
        }
    CUDA_FATAL(cudaStreamSynchronize(g_s));
    printf("argument checks: %s\n", bad ? "FAILED" : "OK");
    g_failed += bad;
    dev_free_all();
}

/* ---- timing (informative) -------------------------------------------------------------------- */

static void timing(int N, int64_t R, int64_t C, kiln_dtype dt) {
    const size_t es = dt == KILN_DTYPE_F32 ? 4 : 2;
    std::vector<float> h((size_t)N * (size_t)(R > C ? R : C));
    fill_rand(h, 1.0f);
    float *dy = (float *)dev_alloc((size_t)N * R * 4), *x = (float *)dev_alloc((size_t)N * C * 4);
    float *dx = (float *)dev_alloc((size_t)N * C * 4), *dW = (float *)dev_alloc((size_t)R * C * 4);
    uint8_t *w = (uint8_t *)dev_alloc((size_t)R * C * es);
    up(dy, h.data(), (size_t)N * R * 4);
    up(x, h.data(), (size_t)N * C * 4);
    CUDA_FATAL(cudaMemsetAsync(w, 0x3c, (size_t)R * C * es, g_s)); /* small finite values */
    CUDA_FATAL(cudaMemsetAsync(dW, 0, (size_t)R * C * 4, g_s));
    cudaEvent_t a, b;
    CUDA_FATAL(cudaEventCreate(&a));
    CUDA_FATAL(cudaEventCreate(&b));
    float ms[2] = {0, 0};
    for (int mode = 0; mode < 2; mode++) {
        for (int it = 0; it < 4; it++) { /* 1 warm-up, then 3 timed */
            if (it == 1) CUDA_FATAL(cudaEventRecord(a, g_s));
            cudaError_t e = mode ? kiln_cuda_matmul_backward_fast(g_gemm, g_s, dx, dW, NULL, dy, x,
                                                                  w, (size_t)C * es, dt, R, C, N,
                                                                  false)
                                 : kiln_cuda_matmul_backward(g_s, dx, dW, NULL, dy, x, w,
                                                             (size_t)C * es, dt, R, C, N, false);
            CUDA_FATAL(e);
        }
        CUDA_FATAL(cudaEventRecord(b, g_s));
        CUDA_FATAL(cudaEventSynchronize(b));
        CUDA_FATAL(cudaEventElapsedTime(&ms[mode], a, b));
        ms[mode] /= 3.0f;
    }
    const double flop = 4.0 * N * (double)R * (double)C;
    printf("time matmul_backward %s N=%d R=%lld C=%lld: auditable %.3f ms (%.1f TFLOP/s), fast "
           "%.3f ms (%.1f TFLOP/s)\n",
           dt_name(dt), N, (long long)R, (long long)C, ms[0], flop / ms[0] * 1e-9, ms[1],
           flop / ms[1] * 1e-9);
    CUDA_FATAL(cudaEventDestroy(a));
    CUDA_FATAL(cudaEventDestroy(b));
    dev_free_all();
}

int main(int argc, char **argv) {
    if (argc > 1) g_rng = strtoull(argv[1], NULL, 0);
    printf("test_cuda_backward_fast: seed %llu\n", (unsigned long long)g_rng);
    int hbad = host_checks();
    printf("host-side checks: %s\n", hbad ? "FAILED" : "OK");
    int n_dev = 0;
    cudaError_t e = cudaGetDeviceCount(&n_dev);
    if (e != cudaSuccess || n_dev == 0) {
        printf("no usable CUDA device (%s): skipped\n",
               e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return hbad ? 1 : 77;
    }
    g_failed = hbad;
    if (kiln_backend_cpu_create(0, &g_cpu) != KILN_OK) {
        fprintf(stderr, "cpu backend: %s\n", kiln_last_error());
        return 1;
    }
    CUDA_FATAL(cudaSetDevice(0));
    CUDA_FATAL(cudaStreamCreateWithFlags(&g_s, cudaStreamNonBlocking));
    CUDA_FATAL(kiln_cuda_gemm_create(0, &g_gemm));

    argument_checks();
    static const kiln_dtype dts[3] = {KILN_DTYPE_F32, KILN_DTYPE_BF16, KILN_DTYPE_F16};
    static const int Ns[4] = {1, 3, 17, 70};
    static const int64_t Rs[2] = {3, 97}, Cs[3] = {5, 64, 100};
    int k = 0;
    for (int d = 0; d < 3; d++)
        for (int a = 0; a < 4; a++)
            for (int r = 0; r < 2; r++)
                for (int c = 0; c < 3; c++, k++)
                    case_matmul(dts[d], Ns[a], Rs[r], Cs[c], (k & 1) != 0, k % 5 != 3, k % 4 != 2,
                                k % 3 != 1, k % 7 == 5 ? V_PAD_ROWS : V_PACKED);
    /* the layouts: bf16 copied (misaligned, padded rows) vs read in place; f16 misaligned */
    case_matmul(KILN_DTYPE_BF16, 33, 96, 128, false, true, true, true, V_PACKED);
    case_matmul(KILN_DTYPE_BF16, 33, 96, 128, true, true, true, true, V_MISALIGNED);
    case_matmul(KILN_DTYPE_BF16, 33, 96, 128, true, true, true, false, V_PAD_ROWS);
    case_matmul(KILN_DTYPE_F16, 33, 96, 100, false, true, true, true, V_MISALIGNED | V_PAD_ROWS);
    case_matmul(KILN_DTYPE_F32, 33, 96, 100, true, true, true, true, V_PAD_ROWS);
    /* training-sized: Qwen2.5-0.5B's MLP (R = FF 4864, C = 896) and a long K for dW */
    case_matmul(KILN_DTYPE_BF16, 64, 4864, 896, true, true, true, true, V_PACKED);
    case_matmul(KILN_DTYPE_F32, 130, 896, 4864, false, true, true, false, V_PACKED);
    case_matmul(KILN_DTYPE_F32, 1024, 136, 72, false, true, true, true, V_PACKED);
    /* dx in bf16: the down projection's shapes (R = C_model, C = FF) and odd ones */
    case_dx16(KILN_DTYPE_BF16, 64, 896, 4864);
    case_dx16(KILN_DTYPE_F32, 130, 576, 1536);
    case_dx16(KILN_DTYPE_BF16, 17, 96, 100);
    case_dx16(KILN_DTYPE_F16, 3, 8, 64);
    for (size_t n : {(size_t)1, (size_t)7, (size_t)1000, (size_t)100003})
        for (size_t off : {(size_t)0, (size_t)1})
            for (bool fast : {false, true}) case_swiglu_d16(n, off, fast);
    for (bool fast : {false, true}) {
        case_swiglu_d16_2d(3, 8, 20, fast);       /* 4-wide exact kernel; fast: one a thread */
        case_swiglu_d16_2d(5, 7, 18, fast);       /* one element a thread */
        case_swiglu_d16_2d(3, 16, 40, fast);      /* fast: 8-wide, 2 items a row */
        case_swiglu_d16_2d(64, 1536, 3072, fast); /* the 135M shape's stacked gate/up */
    }
    case_swiglu_fast_error(1000003);
    case_swiglu_fast_error(8);
    timing_swiglu(8192, 4864); /* the 0.5B shape's MLP at 4 x 2048 tokens */

    printf("worst err/S: dx %.3g, dW %.3g (bound's leading term 2^-7 = %.3g)\n", g_worst_dx,
           g_worst_dw, 0x1p-7);
    timing(2048, 4864, 896, KILN_DTYPE_BF16);
    timing(2048, 896, 896, KILN_DTYPE_F32);

    kiln_cuda_gemm_free(g_gemm);
    CUDA_FATAL(cudaStreamDestroy(g_s));
    kiln_backend_free(g_cpu);
    if (g_failed) printf("FAILED %d\n", g_failed);
    else printf("ALL OK\n");
    return g_failed ? 1 : 0;
}
