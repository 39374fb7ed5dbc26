/*
 * test_cuda_kq.cu -- kiln_cuda_kq_multi_norm (src/ops/cuda/cuda_matmul.h), fast mode's decode
 * product of Q4_K / Q5_K / Q6_K / Q5_0 weights on 8-bit activations, against two host
 * references:
 *   - its definition (cuda_matmul.cu, "decode products of K-quant weights"): the activations
 *     quantized by the CPU's kernels_q8act (portable), each unit's exact integer dots, the
 *     lane's fmaf chain and the 32-lane xor tree, written out here: bit for bit;
 *   - the exact dot of the CPU's dequantized weights (kiln_dequantize) with the same quantized
 *     activations, in double: within 1e-4 of the sum of |products| (so that a layout mistake
 *     shared by the kernel and the reference above cannot pass);
 * for N = 1..11 (token tiles 1, 2, 4, 8 and a second tile: every token's outputs are the bits
 * it has alone), decode shapes, C of an odd number of superblocks (Q6_K and Q5_0 rows at both
 * 2-byte parities), rows past Q8A_MANY_ROWS, bias; several products in one launch with a residual;
 * a SwiGLU pair with biases and a residual; the RMSNorm prologue (== kiln_cuda_rmsnorm then
 * the product); a NaN activation (its token NaN, the others unchanged); misaligned weights
 * refused with cudaErrorNotSupported and nothing written; bad arguments refused.
 * Outputs are poisoned with NaN before each run, so an unwritten element fails.
 * Exit: 0 all OK, 1 a failure, 77 no GPU.
 */
#include "ops/cuda/cuda_matmul.h"
#include "ops/cuda/cuda_norm.h"

extern "C" {
#include "base/base.h"
#include "base/kmath.h"
#include "base/tensor.h"
#include "ops/cpu/kernels_q8act.h"
}

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_test_cuda_check.h"
#define GPU_TEST_SEED 0x6b71746573743031ull
#include "gpu_test_check.h" /* g_fail, the seeded stream rnd64 / rndu */

static int g_cases;
#include "gpu_test_buffers.h" /* dev_copy, dev_nan, host_of, expect_bits */

static int64_t qk(kiln_dtype dt) { return kiln_dtype_get_traits(dt)->block_size; }
static size_t row_bytes(kiln_dtype dt, int64_t C) {
    return (size_t)(C / qk(dt)) * (size_t)kiln_dtype_get_traits(dt)->type_size;
}

/* R rows of random superblocks, rows rb apart, at offset off; d (and dmin) moderate f16. */
static uint8_t *rnd_weights(kiln_dtype dt, int64_t R, int64_t C, size_t rb, size_t off) {
    const size_t ts = (size_t)kiln_dtype_get_traits(dt)->type_size, nb = (size_t)(C / qk(dt));
    const size_t n = off + rb * (size_t)R + 16;
    uint8_t *w = (uint8_t *)kiln_malloc(n);
    for (size_t i = 0; i < n; i++) w[i] = (uint8_t)rnd64();
    for (int64_t r = 0; r < R; r++)
        for (size_t b = 0; b < nb; b++) {
            uint8_t *p = w + off + (size_t)r * rb + b * ts;
            const uint16_t d = kiln_fp32_to_fp16(rndu() * 0.01f);
            const uint16_t m = kiln_fp32_to_fp16(rndu() * 0.02f);
            if (dt == KILN_DTYPE_Q6_K) {
                memcpy(p + 208, &d, 2);
            } else if (dt == KILN_DTYPE_Q5_0) {
                memcpy(p, &d, 2);
            } else {
                memcpy(p, &d, 2);
                memcpy(p + 2, &m, 2);
            }
        }
    return w;
}

/* N tokens of C activations, special blocks in token 0: a zero block, one below 2^-96, an
 * outlier. */
static float *rnd_x(int N, int64_t C) {
    float *x = (float *)kiln_malloc((size_t)N * (size_t)C * 4 + 4);
    for (size_t i = 0; i < (size_t)N * (size_t)C; i++) x[i] = rndu() * 2.0f;
    for (int i = 0; i < 32; i++) x[i] = 0.0f;
    for (int i = 0; i < 32; i++) x[32 + i] = rndu() * 1e-30f;
    x[64 + 5] = 300.0f;
    return x;
}

static float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return kiln_fp16_to_fp32(h);
}

/* ggml's 6-bit scale and min of group g of a Q4_K / Q5_K block's 12 scale bytes. */
static void scale_min(const uint8_t *q, int g, int *sc, int *m) {
    if (g < 4) {
        *sc = q[g] & 63;
        *m = q[g + 4] & 63;
    } else {
        *sc = (q[g + 4] & 0x0f) | ((q[g - 4] >> 6) << 4);
        *m = (q[g + 4] >> 4) | ((q[g] >> 6) << 4);
    }
}

/* The definition: token t's dot with the row at w (C / 32 units, lanes u % 32, the tree). */
static float kq_dot(kiln_dtype dt, const uint8_t *w, const kiln_q8act *qa, int t) {
    float lane[32] = {0};
    const int8_t *xq = qa->q + (size_t)t * qa->nbp * 32;
    const float *xd = qa->d + (size_t)t * qa->nbp;
    for (int64_t u = 0; u < qa->nb; u++) {
        const int64_t b = u / 8;
        const int s = (int)(u % 8);
        float a = lane[u % 32];
        if (dt == KILN_DTYPE_Q5_0) { /* d | qh[4] | qs[16]: (q - 16) of block u */
            const uint8_t *p = w + u * 22;
            uint32_t qh;
            memcpy(&qh, p + 2, 4);
            int dot = 0;
            for (int l = 0; l < 16; l++) {
                const int q0 = ((p[6 + l] & 15) | ((qh >> l) & 1) << 4) - 16;
                const int q1 = ((p[6 + l] >> 4) | ((qh >> (l + 16)) & 1) << 4) - 16;
                dot += q0 * xq[u * 32 + l] + q1 * xq[u * 32 + 16 + l];
            }
            a = fmaf(f16(p) * xd[u], (float)dot, a);
        } else if (dt == KILN_DTYPE_Q4_K || dt == KILN_DTYPE_Q5_K) {
            const bool five = dt == KILN_DTYPE_Q5_K;
            const uint8_t *p = w + b * (five ? 176 : 144);
            const uint8_t *qs = p + (five ? 48 : 16), *qh = p + 16;
            const float d = f16(p), dmin = f16(p + 2);
            const int c = s / 2, h = s % 2;
            for (int side = 0; side < 2; side++) { /* group 2c + side, activation block A + side */
                const int g = 2 * c + side;
                const int64_t A = 8 * b + g;
                int sc, m, dot = 0, sum = 0;
                scale_min(p + 4, g, &sc, &m);
                for (int i = 0; i < 16; i++) {
                    const int l = 16 * h + i;
                    int q = side ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 15;
                    if (five) q |= ((qh[l] >> g) & 1) << 4;
                    const int xv = xq[A * 32 + l];
                    dot += q * xv;
                    sum += xv;
                }
                a = fmaf(d * xd[A], (float)(sc * dot), a);
                a = fmaf(-(dmin * xd[A]), (float)(m * sum), a);
            }
        } else { /* Q6_K */
            const uint8_t *p = w + b * 210, *ql = p, *qh = p + 128;
            const int8_t *scales = (const int8_t *)(p + 192);
            const float d = f16(p + 208);
            const int H = s / 4, j = s % 4;
            for (int k = 0; k < 4; k++) {
                const int64_t A = 8 * b + 4 * H + k;
                int dot = 0;
                for (int i = 0; i < 8; i++) {
                    const int l = 8 * j + i;
                    const int lb = ql[64 * H + (k & 1) * 32 + l];
                    const int q = ((k < 2 ? lb & 15 : lb >> 4) | (((qh[32 * H + l] >> (2 * k)) & 3) << 4)) - 32;
                    dot += q * xq[A * 32 + l];
                }
                a = fmaf(d * xd[A], (float)(scales[8 * H + 2 * k + j / 2] * dot), a);
            }
        }
        lane[u % 32] = a;
    }
    for (int o = 16; o > 0; o >>= 1) {
        float nx[32];
        for (int l = 0; l < 32; l++) nx[l] = lane[l] + lane[l ^ o];
        memcpy(lane, nx, sizeof lane);
    }
    return lane[0];
}

/* out(N, R) by the definition (+ bias), and maxerr: the largest |out - exact| / sum|terms| of
 * the rows' exact dots with the dequantized weights (NaN tokens skipped). */
static void kq_ref(float *out, double *maxerr, const float *x, int N, int64_t C, const uint8_t *w,
                   size_t rb, kiln_dtype dt, int64_t R, const float *bias) {
    const size_t bytes = kiln_q8act_bytes(N, C);
    void *buf = kiln_malloc(bytes + 64);
    kiln_q8act qa;
    kiln_q8act_init(&qa, buf, N, C);
    kiln_q8act_kernels_portable.quantize(&qa, x, C);
    float *wf = (float *)kiln_malloc((size_t)C * 4);
    *maxerr = 0.0;
    for (int64_t r = 0; r < R; r++) {
        kiln_dequantize(dt, w + (size_t)r * rb, wf, C);
        for (int t = 0; t < N; t++) {
            float s = kq_dot(dt, w + (size_t)r * rb, &qa, t);
            if (bias) s = s + bias[r];
            out[(size_t)t * R + r] = s;
            double exact = bias ? bias[r] : 0.0, mag = bias ? fabs(bias[r]) : 0.0;
            bool finite = true;
            for (int64_t i = 0; i < C; i++) {
                const double xv = (double)qa.d[t * qa.nbp + i / 32] * qa.q[t * qa.nbp * 32 + i];
                finite = finite && isfinite(xv);
                exact += (double)wf[i] * xv;
                mag += fabs((double)wf[i] * xv);
            }
            if (finite && mag > 0) {
                const double e = fabs((double)s - exact) / mag;
                if (e > *maxerr) *maxerr = e;
            }
        }
    }
    kiln_free(wf);
    kiln_free(buf);
}

/* One product of R x C at byte offset off (0, or 2 for Q6_K's other parity). */
static void one_product(kiln_dtype dt, int64_t R, int64_t C, int N, bool with_bias, bool nan_tok,
                        size_t off) {
    const char *dn = kiln_dtype_name(dt);
    const size_t rb = row_bytes(dt, C);
    uint8_t *w = rnd_weights(dt, R, C, rb, off);
    float *x = rnd_x(N, C);
    if (nan_tok) x[(size_t)(N - 1) * (size_t)C + 7] = NAN;
    float *bias = NULL;
    if (with_bias) {
        bias = (float *)kiln_malloc((size_t)R * 4);
        for (int64_t r = 0; r < R; r++) bias[r] = rndu();
    }
    float *ref = (float *)kiln_malloc((size_t)N * (size_t)R * 4 + 4);
    double err = 0.0;
    kq_ref(ref, &err, x, N, C, w + off, rb, dt, R, bias);
    uint8_t *dw = dev_copy<uint8_t>(w, off + rb * (size_t)R + 16);
    float *dx = dev_copy<float>(x, (size_t)N * (size_t)C * 4);
    float *db = bias ? dev_copy<float>(bias, (size_t)R * 4) : NULL;
    float *out = dev_nan((size_t)N * (size_t)R);
    kiln_cuda_product_job job = {out, NULL, dw + off, NULL, db, NULL, rb, R};
    CUDA_OK(kiln_cuda_kq_multi_norm(0, 1, &job, dt, dx, NULL, 0.0f, C, N));
    CUDA_OK(cudaDeviceSynchronize());
    char what[160];
    snprintf(what, sizeof what, "%s R %lld C %lld N %d bias %d off %zu%s", dn, (long long)R,
             (long long)C, N, with_bias, off, nan_tok ? " (a NaN token)" : "");
    expect_bits(what, out, ref, (size_t)N * (size_t)R);
    g_cases++;
    EXPECT(err <= 1e-4, "%s: the definition is %.3g of sum|terms| from the exact dot", what, err);
    if (nan_tok) {
        float *h = host_of(out, (size_t)N * (size_t)R);
        bool nan_row = true;
        for (int64_t r = 0; r < R; r++) nan_row = nan_row && isnan(h[(size_t)(N - 1) * R + r]);
        g_cases++;
        EXPECT(nan_row, "%s: the NaN token's outputs are NaN", what);
        kiln_free(h);
    }
    CUDA_OK(cudaFree(dw));
    CUDA_OK(cudaFree(dx));
    CUDA_OK(cudaFree(out));
    if (db) CUDA_OK(cudaFree(db));
    kiln_free(w);
    kiln_free(x);
    kiln_free(bias);
    kiln_free(ref);
}

/* Three products (job 0 accumulating into its output), then a SwiGLU pair with biases and a
 * residual, each with and without the RMSNorm prologue, against the host's composition. */
static void fused(kiln_dtype dt, int64_t C, int N, int64_t R0) {
    const char *dn = kiln_dtype_name(dt);
    const size_t rb = row_bytes(dt, C);
    const int64_t Rs[3] = {R0, 32, 40};
    uint8_t *w[3], *dw[3];
    for (int j = 0; j < 3; j++) {
        w[j] = rnd_weights(dt, Rs[j], C, rb, 0);
        dw[j] = dev_copy<uint8_t>(w[j], rb * (size_t)Rs[j]);
    }
    float *x = rnd_x(N, C);
    float *dx = dev_copy<float>(x, (size_t)N * (size_t)C * 4);
    float *nw_h = (float *)kiln_malloc((size_t)C * 4);
    for (int64_t i = 0; i < C; i++) nw_h[i] = 1.0f + 0.5f * rndu();
    float *nw = dev_copy<float>(nw_h, (size_t)C * 4);
    const float eps = 1e-6f;
    float *xn_d = dev_nan((size_t)N * (size_t)C);
    CUDA_OK(kiln_cuda_rmsnorm(0, xn_d, dx, nw, N, (int)C, eps));
    CUDA_OK(cudaDeviceSynchronize());
    float *xn = host_of(xn_d, (size_t)N * (size_t)C);
    double err = 0.0;
    for (int norm = 0; norm < 2; norm++) {
        const float *xin = norm ? xn : x;
        char what[160];
        float *res_h = (float *)kiln_malloc((size_t)N * Rs[0] * 4);
        for (int64_t i = 0; i < N * Rs[0]; i++) res_h[i] = rndu();
        float *outs[3];
        kiln_cuda_product_job jobs[3];
        for (int j = 0; j < 3; j++) {
            outs[j] = j == 0 ? dev_copy<float>(res_h, (size_t)N * Rs[0] * 4) : dev_nan((size_t)N * Rs[j]);
            jobs[j] = kiln_cuda_product_job{outs[j], j == 0 ? outs[0] : NULL, dw[j], NULL, NULL, NULL, rb, Rs[j]};
        }
        CUDA_OK(kiln_cuda_kq_multi_norm(0, 3, jobs, dt, dx, norm ? nw : NULL, eps, C, N));
        CUDA_OK(cudaDeviceSynchronize());
        for (int j = 0; j < 3; j++) {
            float *ref = (float *)kiln_malloc((size_t)N * Rs[j] * 4);
            kq_ref(ref, &err, xin, N, C, w[j], rb, dt, Rs[j], NULL);
            if (j == 0)
                for (int64_t i = 0; i < N * Rs[0]; i++) ref[i] = ref[i] + res_h[i];
            snprintf(what, sizeof what, "%s C %lld N %d norm %d: job %d of 3%s", dn, (long long)C,
                     N, norm, j, j == 0 ? " + res" : "");
            expect_bits(what, outs[j], ref, (size_t)N * Rs[j]);
            kiln_free(ref);
            CUDA_OK(cudaFree(outs[j]));
        }
        uint8_t *wu = rnd_weights(dt, R0, C, rb, 0);
        uint8_t *dwu = dev_copy<uint8_t>(wu, rb * (size_t)R0);
        float *bg_h = (float *)kiln_malloc((size_t)R0 * 4), *bu_h = (float *)kiln_malloc((size_t)R0 * 4);
        for (int64_t i = 0; i < R0; i++) bg_h[i] = rndu(), bu_h[i] = rndu();
        float *bg = dev_copy<float>(bg_h, (size_t)R0 * 4), *bu = dev_copy<float>(bu_h, (size_t)R0 * 4);
        float *res_d = dev_copy<float>(res_h, (size_t)N * R0 * 4);
        float *po = dev_nan((size_t)N * R0);
        kiln_cuda_product_job pj = {po, res_d, dw[0], dwu, bg, bu, rb, R0};
        CUDA_OK(kiln_cuda_kq_multi_norm(0, 1, &pj, dt, dx, norm ? nw : NULL, eps, C, N));
        CUDA_OK(cudaDeviceSynchronize());
        float *g = (float *)kiln_malloc((size_t)N * R0 * 4), *u = (float *)kiln_malloc((size_t)N * R0 * 4);
        kq_ref(g, &err, xin, N, C, w[0], rb, dt, R0, bg_h);
        kq_ref(u, &err, xin, N, C, wu, rb, dt, R0, bu_h);
        for (int64_t i = 0; i < N * R0; i++) g[i] = kiln_swiglu(g[i], u[i]) + res_h[i];
        snprintf(what, sizeof what, "%s C %lld N %d norm %d: swiglu pair + biases + res", dn,
                 (long long)C, N, norm);
        expect_bits(what, po, g, (size_t)N * R0);
        kiln_free(g);
        kiln_free(u);
        kiln_free(wu);
        kiln_free(bg_h);
        kiln_free(bu_h);
        kiln_free(res_h);
        CUDA_OK(cudaFree(dwu));
        CUDA_OK(cudaFree(bg));
        CUDA_OK(cudaFree(bu));
        CUDA_OK(cudaFree(res_d));
        CUDA_OK(cudaFree(po));
    }
    for (int j = 0; j < 3; j++) {
        kiln_free(w[j]);
        CUDA_OK(cudaFree(dw[j]));
    }
    kiln_free(x);
    kiln_free(xn);
    kiln_free(nw_h);
    CUDA_OK(cudaFree(dx));
    CUDA_OK(cudaFree(nw));
    CUDA_OK(cudaFree(xn_d));
}

/* Weights off the kernel's alignment: cudaErrorNotSupported, nothing written. */
static void misaligned(kiln_dtype dt) {
    const int64_t C = 256, R = 8;
    const size_t rb = row_bytes(dt, C);
    uint8_t *w = rnd_weights(dt, R, C, rb, 0);
    uint8_t *dw = dev_copy<uint8_t>(w, rb * (size_t)R + 16);
    float *x = rnd_x(1, C);
    float *dx = dev_copy<float>(x, (size_t)C * 4);
    float *out = dev_nan((size_t)R);
    const size_t off = dt == KILN_DTYPE_Q6_K || dt == KILN_DTYPE_Q5_0 ? 1 : 8;
    kiln_cuda_product_job job = {out, NULL, dw + off, NULL, NULL, NULL, rb, R};
    const cudaError_t e = kiln_cuda_kq_multi_norm(0, 1, &job, dt, dx, NULL, 0.0f, C, 1);
    (void)cudaGetLastError();
    g_cases++;
    EXPECT(e == cudaErrorNotSupported, "%s at +%zu: %s", kiln_dtype_name(dt), off, cudaGetErrorName(e));
    float *h = host_of(out, (size_t)R);
    bool untouched = true;
    for (int64_t i = 0; i < R; i++) untouched = untouched && isnan(h[i]);
    EXPECT(untouched, "%s misaligned: output written", kiln_dtype_name(dt));
    kiln_free(h);
    kiln_free(w);
    kiln_free(x);
    CUDA_OK(cudaFree(dw));
    CUDA_OK(cudaFree(dx));
    CUDA_OK(cudaFree(out));
}

static void refusals(void) {
    float *x = NULL, *o = NULL;
    uint8_t *w = NULL;
    CUDA_OK(cudaMalloc(&x, 4096));
    CUDA_OK(cudaMalloc(&o, 4096));
    CUDA_OK(cudaMalloc(&w, 4096));
    kiln_cuda_product_job j = {o, NULL, w, NULL, NULL, NULL, 144, 4};
    struct {
        const char *what;
        cudaError_t e;
    } cases[] = {
        {"Q8_0 dtype", kiln_cuda_kq_multi_norm(0, 1, &j, KILN_DTYPE_Q8_0, x, NULL, 0.0f, 256, 1)},
        {"Q5_0 C % 32", kiln_cuda_kq_multi_norm(0, 1, &j, KILN_DTYPE_Q5_0, x, NULL, 0.0f, 48, 1)},
        {"C % 256", kiln_cuda_kq_multi_norm(0, 1, &j, KILN_DTYPE_Q4_K, x, NULL, 0.0f, 128, 1)},
        {"N 0", kiln_cuda_kq_multi_norm(0, 1, &j, KILN_DTYPE_Q4_K, x, NULL, 0.0f, 256, 0)},
        {"row_bytes short", kiln_cuda_kq_multi_norm(0, 1, &j, KILN_DTYPE_Q4_K, x, NULL, 0.0f, 512, 1)},
        {"out over x", kiln_cuda_kq_multi_norm(0, 1, &j, KILN_DTYPE_Q4_K, o, NULL, 0.0f, 256, 1)},
        {"no jobs", kiln_cuda_kq_multi_norm(0, 0, &j, KILN_DTYPE_Q4_K, x, NULL, 0.0f, 256, 1)},
    };
    for (auto &c : cases) {
        g_cases++;
        EXPECT(c.e == cudaErrorInvalidValue, "refusal %s: %s", c.what, cudaGetErrorName(c.e));
    }
    (void)cudaGetLastError();
    CUDA_OK(cudaFree(x));
    CUDA_OK(cudaFree(o));
    CUDA_OK(cudaFree(w));
}

int main(int argc, char **argv) {
    if (argc > 1) g_rng = strtoull(argv[1], NULL, 0);
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    refusals();
    const kiln_dtype dts[] = {KILN_DTYPE_Q4_K, KILN_DTYPE_Q5_K, KILN_DTYPE_Q6_K, KILN_DTYPE_Q5_0};
    /* C: 1 superblock (a warp's lanes mostly idle), 3 (Q6_K rows at alternating parities),
     * 3,072 (the 3B shape: 3 steps of 32 units), 8,960 (1.5B's down: 35 superblocks); Q5_0
     * also 96 (3 blocks: rows at alternating parities), 896 and 4,864 (the 0.5B shape) */
    const int64_t shapes[][2] = {{1, 256}, {7, 768}, {33, 3072}, {9, 8960}, {5, 96}, {17, 896}, {6, 4864}};
    const int Ns[] = {1, 2, 3, 5, 8, 11};
    for (kiln_dtype dt : dts) {
        misaligned(dt);
        for (auto &sh : shapes)
            if (sh[1] % qk(dt) == 0)
                for (int N : Ns) one_product(dt, sh[0], sh[1], N, (N + sh[0]) % 2 == 0, false, 0);
        if (dt == KILN_DTYPE_Q6_K || dt == KILN_DTYPE_Q5_0)
            for (int N : {1, 3}) one_product(dt, 5, 768, N, true, false, 2);
        one_product(dt, 40, 512, 3, true, true, 0);
        for (int N : {1, 2, 4, 8}) fused(dt, 1536, N, 96);
        fused(dt, 256, 11, 96);
        /* past Q8A_MANY_ROWS rows (a warp takes two rows) */
        for (int N : {1, 2}) fused(dt, 256, N, 4099);
        for (int N : {1, 2, 8}) one_product(dt, 4101, 256, N, N == 2, false, 0);
    }
    printf("%s: %d cases, %d failures\n", g_fail ? "FAILED" : "ALL OK", g_cases, g_fail);
    return g_fail ? 1 : 0;
}
