/*
 * test_cuda_matvec_mma.cu -- kiln_cuda_matvec_mma_multi_norm (src/ops/cuda/cuda_matmul.h): the
 * fast mode's bf16 decode products of 2..8 tokens on the tensor cores, and the batch-invariant
 * fast mode's products of any number of tokens (groups of 8, 4 groups a block past 8).
 *
 * Checks:
 *  - accuracy against a float64 sum of the same operands (x rounded to bf16 on the host, the
 *    bf16 weights exact): per element (t, r), with M = sum_k |xb[t][k] w[r][k]|,
 *    |gpu - ref| <= (C / 16 + 16) 2^-22 M. The products are exact; each mma adds 16 of them
 *    to an f32 accumulator (one rounding, or a few truncations, per step: 4u is room for
 *    either), C / 64 chunks of 4 steps, then at most 7 split additions. A product lost or
 *    doubled (|x w| ~ M / C) exceeds that bound up to C = 4864 (2.7x there), not at C = 8192;
 *    the row check catches it at every size here: the row's largest error over its largest M
 *    must stay under 2e-5 (M / C is 1.2e-4 of M at C = 8192);
 *  - the epilogues bit for bit: a bias, a residual and a SwiGLU pair give exactly the f32
 *    operations on the plain product's outputs (kmath.h's kiln_swiglu, on the host);
 *  - the fused RMSNorm gives exactly the bits of kiln_cuda_rmsnorm followed by the plain
 *    product;
 *  - a token's outputs do not depend on the other tokens or on N (1 and 2 tokens vs the same
 *    among N, N tokens vs the same among 8 and among 77: one group, a partial block of 4
 *    groups, several blocks), nor on the run (twice, same bits); outputs poisoned with NaN
 *    first;
 *  - several jobs in one launch give each job's bits alone;
 *  - what it refuses (cudaErrorInvalidValue) and what it leaves to the f32 kernel
 *    (cudaErrorNotSupported: another dtype, C % 64, misalignment).
 * Exit: 0 all OK, 1 a failure, 77 no GPU.
 * Usage: test_cuda_matvec_mma [seed]
 */
#include "ops/cuda/cuda_matmul.h"
#include "ops/cuda/cuda_norm.h"

extern "C" {
#include "base/base.h"
#include "base/kmath.h"
#include "base/tensor.h"
}

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_test_check.h"
#include "gpu_test_cuda_check.h"

static int g_cases;

/* ---- device buffers ------------------------------------------------------------------------ */

template <typename T> static T *dev_copy(const T *h, size_t n) {
    T *d = NULL;
    CUDA_OK(cudaMalloc(&d, n * sizeof(T) + 16));
    if (h) CUDA_OK(cudaMemcpy(d, h, n * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}
static float *dev_nan(size_t n) {
    float *d = dev_copy<float>(NULL, n);
    CUDA_OK(cudaMemset(d, 0xff, n * sizeof(float))); /* all-ones bits: a NaN */
    return d;
}
static float *host_of(const float *d, size_t n) {
    float *h = (float *)malloc(n * sizeof(float) + 4);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(h, d, n * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
}

static uint16_t *rnd_bf16(size_t n, float scale) {
    uint16_t *w = (uint16_t *)malloc(n * 2 + 2);
    for (size_t i = 0; i < n; i++) w[i] = kiln_fp32_to_bf16(rndu() * scale);
    return w;
}
static float *rnd_f32(size_t n, float scale) {
    float *x = (float *)malloc(n * 4 + 4);
    for (size_t i = 0; i < n; i++) x[i] = rndu() * scale;
    return x;
}

/* One launch; the error it returns (outputs to be read by the caller). */
static cudaError_t launch(const kiln_cuda_product_job *jobs, int n, const float *x,
                          const float *norm_w, int64_t C, int N) {
    return kiln_cuda_matvec_mma_multi_norm(0, n, jobs, KILN_DTYPE_BF16, x, norm_w, 1e-5f, C, N);
}

/* The plain product of (host) w and x on the device, out (N, R) downloaded. */
static float *plain(const uint16_t *dw, const float *dx, int64_t R, int64_t C, int N) {
    float *dout = dev_nan((size_t)N * R);
    const kiln_cuda_product_job j = {dout, NULL, (const uint8_t *)dw, NULL, NULL, NULL, (size_t)C * 2, R};
    cudaError_t e = launch(&j, 1, dx, NULL, C, N);
    EXPECT(e == cudaSuccess, "plain R=%lld C=%lld N=%d: %s", (long long)R, (long long)C, N,
           cudaGetErrorName(e));
    float *h = host_of(dout, (size_t)N * R);
    CUDA_OK(cudaFree(dout));
    return h;
}

static bool same_bits(const float *a, const float *b, size_t n, const char *what) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], 4) != 0) {
            EXPECT(false, "%s: element %zu: %.9g vs %.9g", what, i, a[i], b[i]);
            return false;
        }
    return true;
}

/* ---- one shape ------------------------------------------------------------------------------ */

#define NMAX 77 /* the most tokens a case multiplies: 9 full groups and a partial one */

static void one_shape(int64_t R, int64_t C, int N) {
    g_cases++;
    char ctx[96];
    snprintf(ctx, sizeof ctx, "R=%lld C=%lld N=%d S=%d", (long long)R, (long long)C, N,
             kiln_cuda_matvec_mma_split(R, C));
    const int fails0 = g_fail;
    uint16_t *w = rnd_bf16((size_t)R * C, 4.0f), *wu = rnd_bf16((size_t)R * C, 4.0f);
    float *x = rnd_f32((size_t)NMAX * C, 1.0f), *bias = rnd_f32((size_t)R, 1.0f);
    float *bias_u = rnd_f32((size_t)R, 1.0f), *res = rnd_f32((size_t)N * R, 2.0f);
    float *nw = rnd_f32((size_t)C, 1.5f);
    uint16_t *dw = dev_copy(w, (size_t)R * C), *dwu = dev_copy(wu, (size_t)R * C);
    float *dx = dev_copy(x, (size_t)NMAX * C), *dbias = dev_copy(bias, (size_t)R);
    float *dbias_u = dev_copy(bias_u, (size_t)R), *dres = dev_copy(res, (size_t)N * R);
    float *dnw = dev_copy(nw, (size_t)C);

    /* accuracy of the plain product against float64 on bf16-rounded x */
    float *p = plain(dw, dx, R, C, N), *gp = plain(dwu, dx, R, C, N);
    double worst = 0;
    long over = 0;
    for (int t = 0; t < N; t++) {
        double emax = 0, mmax = 0;
        for (int64_t r = 0; r < R; r++) {
            double s = 0, m = 0;
            for (int64_t k = 0; k < C; k++) {
                const double a = (double)kiln_bf16_to_fp32(kiln_fp32_to_bf16(x[t * C + k]));
                const double b = (double)kiln_bf16_to_fp32(w[r * C + k]);
                s += a * b, m += fabs(a * b);
            }
            const double d = fabs((double)p[t * R + r] - s);
            const double bound = ((double)C / 16.0 + 16.0) * 0x1p-22 * m;
            if (!(d <= bound) && !over++) /* NaN fails too; the first one printed */
                EXPECT(false, "%s: [t=%d r=%lld] gpu %.9g ref %.9g |d| %.3g > %.3g", ctx, t,
                       (long long)r, p[t * R + r], s, d, bound);
            if (!(d <= emax)) emax = d;
            if (m > mmax) mmax = m;
        }
        const double e = mmax > 0 ? emax / mmax : emax;
        if (!(e <= worst)) worst = e;
    }
    EXPECT(worst <= 2e-5, "%s: normalised error %.3g", ctx, worst);

    /* bias and residual: the f32 adds on the plain outputs */
    {
        float *dout = dev_nan((size_t)N * R);
        const kiln_cuda_product_job j = {dout, dres, (const uint8_t *)dw, NULL, dbias, NULL, (size_t)C * 2, R};
        EXPECT(launch(&j, 1, dx, NULL, C, N) == cudaSuccess, "%s: bias+res launch", ctx);
        float *h = host_of(dout, (size_t)N * R);
        for (int t = 0; t < N; t++)
            for (int64_t r = 0; r < R; r++) {
                const float want = (p[t * R + r] + bias[r]) + res[t * R + r];
                if (memcmp(&want, &h[t * R + r], 4)) {
                    EXPECT(false, "%s: bias+res [t=%d r=%lld] %.9g want %.9g", ctx, t, (long long)r,
                           h[t * R + r], want);
                    t = N;
                    break;
                }
            }
        free(h);
        CUDA_OK(cudaFree(dout));
    }

    /* a SwiGLU pair with biases: kiln_swiglu of the two plain products plus their biases */
    {
        float *dout = dev_nan((size_t)N * R);
        const kiln_cuda_product_job j = {dout, NULL, (const uint8_t *)dw, (const uint8_t *)dwu, dbias,
                                         dbias_u, (size_t)C * 2, R};
        EXPECT(launch(&j, 1, dx, NULL, C, N) == cudaSuccess, "%s: pair launch", ctx);
        float *h = host_of(dout, (size_t)N * R);
        for (int t = 0; t < N; t++)
            for (int64_t r = 0; r < R; r++) {
                const float want = kiln_swiglu(p[t * R + r] + bias[r], gp[t * R + r] + bias_u[r]);
                if (memcmp(&want, &h[t * R + r], 4)) {
                    EXPECT(false, "%s: pair [t=%d r=%lld] %.9g want %.9g", ctx, t, (long long)r,
                           h[t * R + r], want);
                    t = N;
                    break;
                }
            }
        free(h);
        CUDA_OK(cudaFree(dout));
    }

    /* the fused norm: kiln_cuda_rmsnorm, then the plain product */
    {
        float *dxn = dev_nan((size_t)N * C), *dout = dev_nan((size_t)N * R);
        CUDA_OK(kiln_cuda_rmsnorm(0, dxn, dx, dnw, N, (int)C, 1e-5f));
        float *want = plain(dw, dxn, R, C, N);
        const kiln_cuda_product_job j = {dout, NULL, (const uint8_t *)dw, NULL, NULL, NULL, (size_t)C * 2, R};
        EXPECT(launch(&j, 1, dx, dnw, C, N) == cudaSuccess, "%s: norm launch", ctx);
        float *h = host_of(dout, (size_t)N * R);
        char what[128];
        snprintf(what, sizeof what, "%s: fused norm vs rmsnorm + product", ctx);
        same_bits(h, want, (size_t)N * R, what);
        free(h), free(want);
        CUDA_OK(cudaFree(dxn));
        CUDA_OK(cudaFree(dout));
    }

    /* a token's bits alone: these N among 8 and among NMAX, the first 1 and 2 alone, and a
     * second run */
    {
        float *p8 = plain(dw, dx, R, C, 8), *pm = plain(dw, dx, R, C, NMAX);
        float *p1 = plain(dw, dx, R, C, 1), *p2 = plain(dw, dx, R, C, 2), *again = plain(dw, dx, R, C, N);
        char what[128];
        snprintf(what, sizeof what, "%s: run twice", ctx);
        same_bits(p, again, (size_t)N * R, what);
        snprintf(what, sizeof what, "%s: N tokens vs the same among 8", ctx);
        same_bits(N <= 8 ? p : p8, N <= 8 ? p8 : p, (size_t)(N < 8 ? N : 8) * R, what);
        snprintf(what, sizeof what, "%s: N tokens vs the same among %d", ctx, NMAX);
        same_bits(p, pm, (size_t)N * R, what);
        snprintf(what, sizeof what, "%s: 1 token vs the same among N", ctx);
        same_bits(p1, p, (size_t)R, what);
        if (N >= 2) {
            snprintf(what, sizeof what, "%s: 2 tokens vs the same among N", ctx);
            same_bits(p2, p, (size_t)2 * R, what);
        }
        free(p8), free(pm), free(p1), free(p2), free(again);
    }

    printf("mma %s: max_norm_err %.2e %s\n", ctx, worst, g_fail == fails0 ? "OK" : "FAIL");
    free(w), free(wu), free(x), free(bias), free(bias_u), free(res), free(nw), free(p), free(gp);
    CUDA_OK(cudaFree(dw));
    CUDA_OK(cudaFree(dwu));
    CUDA_OK(cudaFree(dx));
    CUDA_OK(cudaFree(dbias));
    CUDA_OK(cudaFree(dbias_u));
    CUDA_OK(cudaFree(dres));
    CUDA_OK(cudaFree(dnw));
}

/* Three jobs of one x in one launch (q, k, v of the 0.5B shape): each job's bits alone. */
static void multi_jobs(int N) {
    g_cases++;
    const int64_t C = 896, Rs[3] = {896, 128, 128};
    float *x = rnd_f32((size_t)N * C, 1.0f);
    float *dx = dev_copy(x, (size_t)N * C);
    uint16_t *dw[3];
    float *dout[3];
    kiln_cuda_product_job j[3];
    for (int i = 0; i < 3; i++) {
        uint16_t *w = rnd_bf16((size_t)Rs[i] * C, 1.0f);
        dw[i] = dev_copy(w, (size_t)Rs[i] * C);
        free(w);
        dout[i] = dev_nan((size_t)N * Rs[i]);
        j[i] = {dout[i], NULL, (const uint8_t *)dw[i], NULL, NULL, NULL, (size_t)C * 2, Rs[i]};
    }
    EXPECT(launch(j, 3, dx, NULL, C, N) == cudaSuccess, "multi N=%d launch", N);
    for (int i = 0; i < 3; i++) {
        float *h = host_of(dout[i], (size_t)N * Rs[i]), *alone = plain(dw[i], dx, Rs[i], C, N);
        char what[64];
        snprintf(what, sizeof what, "multi N=%d job %d vs alone", N, i);
        same_bits(h, alone, (size_t)N * Rs[i], what);
        free(h), free(alone);
        CUDA_OK(cudaFree(dw[i]));
        CUDA_OK(cudaFree(dout[i]));
    }
    printf("mma multi-job N=%d: done\n", N);
    free(x);
    CUDA_OK(cudaFree(dx));
}

/* ---- refusals and hand-backs ---------------------------------------------------------------- */

static void refusals() {
    float *x = dev_copy<float>(NULL, 8 * 256 + 8), *o = dev_copy<float>(NULL, 8 * 64);
    uint16_t *w = dev_copy<uint16_t>(NULL, 64 * 256 + 64);
    const kiln_cuda_product_job j = {o, NULL, (const uint8_t *)w, NULL, NULL, NULL, 256 * 2, 64};
    kiln_cuda_product_job short_rows = j, odd_stride = j, odd_w = j;
    short_rows.row_bytes = 200;
    odd_stride.row_bytes = 192 * 2 + 8;
    odd_w.w = (const uint8_t *)(w + 4);
    struct {
        const char *what;
        cudaError_t got, want;
    } cases[] = {
        {"N 0", launch(&j, 1, x, NULL, 256, 0), cudaErrorInvalidValue},
        {"no jobs", launch(&j, 0, x, NULL, 256, 2), cudaErrorInvalidValue},
        {"row_bytes short", launch(&short_rows, 1, x, NULL, 256, 2), cudaErrorInvalidValue},
        {"out over x", launch(&j, 1, o, NULL, 256, 2), cudaErrorInvalidValue},
        {"f16", kiln_cuda_matvec_mma_multi_norm(0, 1, &j, KILN_DTYPE_F16, x, NULL, 0.0f, 256, 2),
         cudaErrorNotSupported},
        {"C % 64", launch(&j, 1, x, NULL, 224, 2), cudaErrorNotSupported},
        {"x misaligned", launch(&j, 1, x + 1, NULL, 256, 2), cudaErrorNotSupported},
        {"norm_w misaligned", launch(&j, 1, x, x + 8 * 256 + 1, 256, 2), cudaErrorNotSupported},
        {"row stride % 16", launch(&odd_stride, 1, x, NULL, 192, 2), cudaErrorNotSupported},
        {"w misaligned", launch(&odd_w, 1, x, NULL, 192, 2), cudaErrorNotSupported},
    };
    for (auto &c : cases) {
        g_cases++;
        EXPECT(c.got == c.want, "%s: %s, want %s", c.what, cudaGetErrorName(c.got),
               cudaGetErrorName(c.want));
    }
    EXPECT(kiln_cuda_matvec_mma_split(64, 224) == 0 && kiln_cuda_matvec_mma_split(0, 256) == 0,
           "split of refused shapes is not 0");
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
    /* odd row counts (tiles past R), one chunk, splits 1..8, and the decode shapes of the
     * 0.5B (q, k/v, gate/up, down) and the 3B's widths */
    const int64_t shapes[][2] = {{1, 64},    {17, 128},   {33, 192},  {100, 640},
                                 {896, 896}, {128, 896},  {4864, 896}, {896, 4864},
                                 {40, 3072}, {200, 8192}};
    const int Ns[] = {1, 2, 3, 5, 8, 9, 40, NMAX};
    for (auto &sh : shapes)
        for (int N : Ns) one_shape(sh[0], sh[1], N);
    for (int N : {2, 8, 33}) multi_jobs(N);
    if (g_fail) {
        printf("FAILED %d of %d cases\n", g_fail, g_cases);
        return 1;
    }
    printf("ALL OK (%d cases)\n", g_cases);
    return 0;
}
