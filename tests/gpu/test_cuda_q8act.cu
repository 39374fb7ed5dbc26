/*
 * test_cuda_q8act.cu -- kiln_cuda_q8act_multi_norm (src/ops/cuda/cuda_matmul.h), the fast
 * mode's int8-activation product for Q8_0 / Q4_0 / Q4_1 weights, against the CPU's definition
 * (src/ops/cpu/kernels_q8act.c, the portable reference), bit for bit:
 *   - one product: every output == kernels_q8act's quantize then rows on the same host bytes,
 *     with and without bias, N = 1..11 (token tiles 1, 2, 4, 8 and a second tile), odd C / 32
 *     (blocks not a multiple of the 8 lanes), decode shapes; activations with a zero block, a
 *     block below 2^-96, an outlier, values that round to +-127 and to halves;
 *   - a non-finite activation: that token's outputs NaN, every other token's unchanged;
 *   - several products in one launch with a residual (== each alone, then + res); a SwiGLU
 *     pair with biases and a residual (== the two products, then kiln_swiglu, then + res);
 *   - launches of few rows (a row shared by 8 warps) and of many (a warp takes several rows),
 *     row counts that do not divide into the warps' groups;
 *   - the RMSNorm prologue == kiln_cuda_rmsnorm, then the products;
 *   - the byte-load path (w at an odd address, row_bytes padded by 3) gives the same bits; a
 *     misaligned pair is refused with cudaErrorNotSupported and writes nothing;
 *   - bad arguments refused.
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
#define GPU_TEST_SEED 0x7138616374303031ull
#include "gpu_test_check.h" /* g_fail, the seeded stream rnd64 / rndu */

static int g_cases;
#include "gpu_test_buffers.h" /* dev_copy, dev_nan, host_of, expect_bits */

static int type_size(kiln_dtype dt) { return kiln_dtype_get_traits(dt)->type_size; }

/* R rows of C / 32 random blocks, rows rb apart (rb >= the row's bytes), at offset off in
 * the returned buffer; f16 scales (and Q4_1's m) moderate and of both signs. */
static uint8_t *rnd_weights(kiln_dtype dt, int64_t R, int64_t C, size_t rb, size_t off) {
    const size_t ts = (size_t)type_size(dt), nb = (size_t)C / 32;
    uint8_t *w = (uint8_t *)kiln_malloc(off + rb * (size_t)R + 8);
    for (size_t i = 0; i < off + rb * (size_t)R + 8; i++) w[i] = (uint8_t)rnd64();
    for (int64_t r = 0; r < R; r++)
        for (size_t b = 0; b < nb; b++) {
            uint8_t *p = w + off + (size_t)r * rb + b * ts;
            const uint16_t d = kiln_fp32_to_fp16(rndu() * 0.05f);
            memcpy(p, &d, 2);
            if (dt == KILN_DTYPE_Q4_1) {
                const uint16_t m = kiln_fp32_to_fp16(rndu() * 0.2f);
                memcpy(p + 2, &m, 2);
            }
        }
    return w;
}

/* N tokens of C activations: mostly uniform, with special blocks in token 0 (when C allows):
 * block 0 zero, block 1 below 2^-96, block 2 one outlier, block 3 values on the rounding
 * grid (x * 127 / amax lands on halves and on +-127). */
static float *rnd_x(int N, int64_t C) {
    float *x = (float *)kiln_malloc((size_t)N * (size_t)C * 4 + 4);
    for (size_t i = 0; i < (size_t)N * (size_t)C; i++) x[i] = rndu() * 2.0f;
    const int64_t nb = C / 32;
    if (nb > 0)
        for (int i = 0; i < 32; i++) x[i] = 0.0f;
    if (nb > 1)
        for (int i = 0; i < 32; i++) x[32 + i] = rndu() * 1e-30f;
    if (nb > 2) x[64 + 5] = 300.0f;
    if (nb > 3)
        for (int i = 0; i < 32; i++) x[96 + i] = (float)((i % 9) - 4) * 0.5f * (127.0f / 4.0f) / 127.0f * 8.0f;
    return x;
}

/* The CPU's fast product: out(N, R) = the q8act dot of x's tokens with w's rows (+ bias). */
static void cpu_ref(float *out, const float *x, int N, int64_t C, const uint8_t *w, size_t rb,
                    kiln_dtype dt, int64_t R, const float *bias) {
    const size_t bytes = kiln_q8act_bytes(N, C);
    void *buf = kiln_malloc(bytes + 64);
    kiln_q8act qa;
    kiln_q8act_init(&qa, buf, N, C);
    kiln_q8act_kernels_portable.quantize(&qa, x, C);
    kiln_q8act_mm m = {&qa, w, rb, dt, bias, out, R};
    kiln_q8act_kernels_portable.rows(&m, 0, R);
    kiln_free(buf);
}

/* One product of R x C against the CPU: aligned, and (off != 0) on the byte-load path. */
static void one_product(kiln_dtype dt, int64_t R, int64_t C, int N, bool with_bias, bool nan_tok) {
    const char *dn = kiln_dtype_name(dt);
    const size_t rb = (size_t)(C / 32) * (size_t)type_size(dt);
    uint8_t *w = rnd_weights(dt, R, C, rb, 0);
    float *x = rnd_x(N, C);
    if (nan_tok) x[(size_t)(N - 1) * (size_t)C + 7] = NAN;
    float *bias = NULL;
    if (with_bias) {
        bias = (float *)kiln_malloc((size_t)R * 4);
        for (int64_t r = 0; r < R; r++) bias[r] = rndu();
    }
    float *ref = (float *)kiln_malloc((size_t)N * (size_t)R * 4 + 4);
    cpu_ref(ref, x, N, C, w, rb, dt, R, bias);
    if (nan_tok) { /* the NaN token alone is NaN; the others keep their bits (checked below) */
        for (int64_t r = 0; r < R; r++) EXPECT(isnan(ref[(size_t)(N - 1) * R + r]), "CPU NaN row");
    }

    uint8_t *dw = dev_copy<uint8_t>(w, rb * (size_t)R);
    float *dx = dev_copy<float>(x, (size_t)N * (size_t)C * 4);
    float *db = bias ? dev_copy<float>(bias, (size_t)R * 4) : NULL;
    float *out = dev_nan((size_t)N * (size_t)R);
    kiln_cuda_product_job job = {out, NULL, dw, NULL, db, NULL, rb, R};
    CUDA_OK(kiln_cuda_q8act_multi_norm(0, 1, &job, dt, dx, NULL, 0.0f, C, N));
    CUDA_OK(cudaDeviceSynchronize());
    char what[160];
    snprintf(what, sizeof what, "%s R %lld C %lld N %d bias %d%s", dn, (long long)R, (long long)C,
             N, with_bias, nan_tok ? " (a NaN token)" : "");
    expect_bits(what, out, ref, (size_t)N * (size_t)R);

    /* the byte-load path: w at an odd address, rows 3 bytes apart more */
    const size_t rb3 = rb + 3;
    uint8_t *w3 = (uint8_t *)kiln_malloc(rb3 * (size_t)R + 8);
    for (int64_t r = 0; r < R; r++) memcpy(w3 + 1 + (size_t)r * rb3, w + (size_t)r * rb, rb);
    uint8_t *dw3 = dev_copy<uint8_t>(w3, rb3 * (size_t)R + 8);
    float *out3 = dev_nan((size_t)N * (size_t)R);
    kiln_cuda_product_job job3 = {out3, NULL, dw3 + 1, NULL, db, NULL, rb3, R};
    CUDA_OK(kiln_cuda_q8act_multi_norm(0, 1, &job3, dt, dx, NULL, 0.0f, C, N));
    CUDA_OK(cudaDeviceSynchronize());
    snprintf(what, sizeof what, "%s R %lld C %lld N %d: byte-load path", dn, (long long)R,
             (long long)C, N);
    expect_bits(what, out3, ref, (size_t)N * (size_t)R);

    CUDA_OK(cudaFree(dw));
    CUDA_OK(cudaFree(dw3));
    CUDA_OK(cudaFree(dx));
    CUDA_OK(cudaFree(out));
    CUDA_OK(cudaFree(out3));
    if (db) CUDA_OK(cudaFree(db));
    kiln_free(w);
    kiln_free(w3);
    kiln_free(x);
    kiln_free(bias);
    kiln_free(ref);
}

/* Three products with a residual on one, a SwiGLU pair with biases and a residual, and both
 * with the RMSNorm prologue: against single products on the host's composition. */
static void fused(kiln_dtype dt, int64_t C, int N, int64_t R0) {
    const char *dn = kiln_dtype_name(dt);
    const size_t rb = (size_t)(C / 32) * (size_t)type_size(dt);
    const int64_t Rs[3] = {R0, 32, 40};
    uint8_t *w[3];
    uint8_t *dw[3];
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

    for (int norm = 0; norm < 2; norm++) {
        const float *xin = norm ? xn : x;
        char what[160];
        /* three products, job 0 accumulating into its output (res == out) */
        float *res_h = (float *)kiln_malloc((size_t)N * Rs[0] * 4);
        for (int64_t i = 0; i < N * Rs[0]; i++) res_h[i] = rndu();
        float *outs[3];
        kiln_cuda_product_job jobs[3];
        for (int j = 0; j < 3; j++) {
            outs[j] = j == 0 ? dev_copy<float>(res_h, (size_t)N * Rs[0] * 4) : dev_nan((size_t)N * Rs[j]);
            jobs[j] = kiln_cuda_product_job{outs[j], j == 0 ? outs[0] : NULL, dw[j], NULL, NULL, NULL, rb, Rs[j]};
        }
        CUDA_OK(kiln_cuda_q8act_multi_norm(0, 3, jobs, dt, dx, norm ? nw : NULL, eps, C, N));
        CUDA_OK(cudaDeviceSynchronize());
        for (int j = 0; j < 3; j++) {
            float *ref = (float *)kiln_malloc((size_t)N * Rs[j] * 4);
            cpu_ref(ref, xin, N, C, w[j], rb, dt, Rs[j], NULL);
            if (j == 0)
                for (int64_t i = 0; i < N * Rs[0]; i++) ref[i] = ref[i] + res_h[i];
            snprintf(what, sizeof what, "%s C %lld N %d norm %d: job %d of 3%s", dn, (long long)C, N,
                     norm, j, j == 0 ? " + res" : "");
            expect_bits(what, outs[j], ref, (size_t)N * Rs[j]);
            kiln_free(ref);
            CUDA_OK(cudaFree(outs[j]));
        }

        /* a SwiGLU pair (w[0] gate, a second 96-row matrix up) with biases and a residual */
        uint8_t *wu = rnd_weights(dt, Rs[0], C, rb, 0);
        uint8_t *dwu = dev_copy<uint8_t>(wu, rb * (size_t)Rs[0]);
        float *bg_h = (float *)kiln_malloc((size_t)R0 * 4), *bu_h = (float *)kiln_malloc((size_t)R0 * 4);
        for (int64_t i = 0; i < R0; i++) bg_h[i] = rndu(), bu_h[i] = rndu();
        float *bg = dev_copy<float>(bg_h, (size_t)R0 * 4), *bu = dev_copy<float>(bu_h, (size_t)R0 * 4);
        float *res_d = dev_copy<float>(res_h, (size_t)N * Rs[0] * 4);
        float *po = dev_nan((size_t)N * Rs[0]);
        kiln_cuda_product_job pj = {po, res_d, dw[0], dwu, bg, bu, rb, Rs[0]};
        CUDA_OK(kiln_cuda_q8act_multi_norm(0, 1, &pj, dt, dx, norm ? nw : NULL, eps, C, N));
        CUDA_OK(cudaDeviceSynchronize());
        float *g = (float *)kiln_malloc((size_t)N * Rs[0] * 4), *u = (float *)kiln_malloc((size_t)N * Rs[0] * 4);
        cpu_ref(g, xin, N, C, w[0], rb, dt, Rs[0], bg_h);
        cpu_ref(u, xin, N, C, wu, rb, dt, Rs[0], bu_h);
        for (int64_t i = 0; i < N * Rs[0]; i++) g[i] = kiln_swiglu(g[i], u[i]) + res_h[i];
        snprintf(what, sizeof what, "%s C %lld N %d norm %d: swiglu pair + biases + res", dn,
                 (long long)C, N, norm);
        expect_bits(what, po, g, (size_t)N * Rs[0]);

        /* the same pair off the aligned path: refused, nothing written */
        if (N == 1 && norm == 0) {
            float *po2 = dev_nan((size_t)N * Rs[0]);
            kiln_cuda_product_job pj2 = {po2, NULL, dw[0] + 1, dwu + 1, NULL, NULL, rb, Rs[0]};
            const cudaError_t e = kiln_cuda_q8act_multi_norm(0, 1, &pj2, dt, dx, NULL, 0.0f, C, N);
            g_cases++;
            EXPECT(e == cudaErrorNotSupported, "%s misaligned pair: %s", dn, cudaGetErrorName(e));
            float *h = host_of(po2, (size_t)N * Rs[0]);
            bool untouched = true;
            for (int64_t i = 0; i < N * Rs[0]; i++) untouched = untouched && isnan(h[i]);
            EXPECT(untouched, "%s misaligned pair wrote its output", dn);
            kiln_free(h);
            CUDA_OK(cudaFree(po2));
        }
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

static void refusals(void) {
    float *x = NULL, *o = NULL;
    uint8_t *w = NULL;
    CUDA_OK(cudaMalloc(&x, 4096));
    CUDA_OK(cudaMalloc(&o, 4096));
    CUDA_OK(cudaMalloc(&w, 4096));
    kiln_cuda_product_job j = {o, NULL, w, NULL, NULL, NULL, 34, 4};
    struct {
        const char *what;
        cudaError_t e;
    } cases[] = {
        {"bf16 dtype", kiln_cuda_q8act_multi_norm(0, 1, &j, KILN_DTYPE_BF16, x, NULL, 0.0f, 32, 1)},
        {"Q4_K dtype", kiln_cuda_q8act_multi_norm(0, 1, &j, KILN_DTYPE_Q4_K, x, NULL, 0.0f, 256, 1)},
        {"C % 32", kiln_cuda_q8act_multi_norm(0, 1, &j, KILN_DTYPE_Q8_0, x, NULL, 0.0f, 48, 1)},
        {"N 0", kiln_cuda_q8act_multi_norm(0, 1, &j, KILN_DTYPE_Q8_0, x, NULL, 0.0f, 32, 0)},
        {"row_bytes short", kiln_cuda_q8act_multi_norm(0, 1, &j, KILN_DTYPE_Q8_0, x, NULL, 0.0f, 64, 1)},
        {"out over x", kiln_cuda_q8act_multi_norm(0, 1, &j, KILN_DTYPE_Q8_0, o, NULL, 0.0f, 32, 1)},
        {"no jobs", kiln_cuda_q8act_multi_norm(0, 0, &j, KILN_DTYPE_Q8_0, x, NULL, 0.0f, 32, 1)},
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
    const kiln_dtype dts[] = {KILN_DTYPE_Q8_0, KILN_DTYPE_Q4_0, KILN_DTYPE_Q4_1};
    const int64_t shapes[][2] = {{1, 32}, {7, 96}, {33, 288}, {9, 2080}, {896, 896}, {130, 4864}};
    const int Ns[] = {1, 2, 3, 5, 8, 11};
    for (kiln_dtype dt : dts) {
        for (auto &sh : shapes)
            for (int N : Ns) one_product(dt, sh[0], sh[1], N, (N + sh[0]) % 2 == 0, false);
        one_product(dt, 40, 256, 3, true, true);
        for (int N : {1, 2, 4, 8}) fused(dt, 896, N, 96);
        fused(dt, 160, 5, 96);
        /* past Q8A_MANY_ROWS rows (a warp takes several rows; a pair two): row counts not
         * multiples of them */
        for (int N : {1, 2}) fused(dt, 96, N, 4099);
        for (int N : {1, 2, 8}) one_product(dt, 4101, 64, N, N == 2, false);
    }
    printf("%s: %d cases, %d failures\n", g_fail ? "FAILED" : "ALL OK", g_cases, g_fail);
    return g_fail ? 1 : 0;
}
