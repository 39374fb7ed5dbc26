/*
 * test_cuda_mx.cu -- the exact block formats on the GPU (src/ops/cuda/cuda_mx.h) against the
 * CPU's (src/ops/mx.h), bit for bit:
 *  - quantization (mx8, mx16; to nearest and stochastic; a row-major source and a transposed
 *    one): mantissas, pieces and exponents byte for byte against kiln_mx_quantize(_stochastic)
 *    of the same matrix, with zero blocks, NaN and Inf, subnormals and blocks scaled from
 *    2^-140 to 2^120 in the data;
 *  - the product (both kinds): out against kiln_mx_matmul_cpu on the CPU's quantized operands
 *    uploaded as they are, for shapes with tails (K % 32), decode shapes (N = 1..8, split over
 *    the blocks), and shapes of many rows (mx_gemm_kernel's tiles, with tails, split over the
 *    blocks or not), with a bias, accumulating into an
 *    old output, and with rows that are zero, non-finite, far below the others (the floor of
 *    far-below blocks), or scaled to give subnormal and infinite results; and the CPU's SIMD
 *    kernels on this machine's CPU against its reference;
 *  - matmul through the backends in the modes KILN_MODE_MX16 / MX8: the CPU backend's and the
 *    CUDA backend's (the weight cache, the scratch, the bias), f32 and bf16 weights.
 * Outputs are poisoned with NaN first (an unwritten element fails). A table last.
 * Exit: 0 all equal, 1 a difference, 77 no GPU. `test_cuda_mx --bench`: the product's time on
 * training shapes instead (no checks).
 */
#include "ops/cuda/cuda_mx.h"

extern "C" {
#include "base/base.h"
#include "base/tensor.h"
#include "ops/fused_ce_impl.h" /* kiln_ce_f32_view */
#include "ops/ops.h"
}

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_fail;
#include "gpu_test_cuda_check.h"

static uint64_t g_rng = 0x6b696c6e2d6d7831ull;
static uint64_t rnd_u64(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static int rnd_int(int lo, int hi) { return lo + (int)(rnd_u64() % (uint64_t)(hi - lo + 1)); }
static float rnd_normal(void) { /* rough N(0,1): sum of 4 uniforms */
    double s = 0;
    for (int i = 0; i < 4; i++) s += (double)(rnd_u64() >> 11) * 0x1p-53 - 0.5;
    return (float)(s * 1.7320508);
}

/* Data with the formats' corner cases, (rows, K) row-major. special: zero blocks and rows,
 * NaN/Inf, subnormals and wide per-block scales. */
static void fill(float *a, int64_t rows, int64_t K, int special, int row_scale_lo, int row_scale_hi) {
    for (int64_t j = 0; j < rows; j++) {
        const float rs = ldexpf(1.0f, rnd_int(row_scale_lo, row_scale_hi));
        for (int64_t k = 0; k < K; k++) a[j * K + k] = rnd_normal() * rs;
        if (!special) continue;
        for (int64_t b = 0; b * 32 < K; b++) {
            const int u = rnd_int(0, 19);
            const int64_t k0 = b * 32, k1 = k0 + 32 < K ? k0 + 32 : K;
            if (u == 0)
                for (int64_t k = k0; k < k1; k++) a[j * K + k] = (k & 1) ? -0.0f : 0.0f;
            else if (u == 1)
                for (int64_t k = k0; k < k1; k++) a[j * K + k] *= 0x1p-130f; /* subnormals */
            else if (u == 2)
                for (int64_t k = k0; k < k1; k++) a[j * K + k] = ldexpf(a[j * K + k], rnd_int(-40, 40));
            else if (u == 3) /* one element dominating its block: others round to 0 */
                a[j * K + k0] *= 0x1p20f;
        }
        const int r = rnd_int(0, 29);
        if (r == 0) a[j * K + rnd_int(0, (int)K - 1)] = NAN;
        else if (r == 1) a[j * K + rnd_int(0, (int)K - 1)] = -INFINITY;
        else if (r == 2)
            for (int64_t k = 0; k < K; k++) a[j * K + k] = 0.0f;
    }
}

static long g_q_cases, g_q_bytes, g_q_bad, g_p_cases, g_p_elems, g_p_bad, g_simd_bad;
static long g_b_cases, g_b_elems, g_b_bad;

static void *dev_copy(const void *h, size_t n) {
    void *d = NULL;
    CUDA_OK(cudaMalloc(&d, n ? n : 1));
    if (n) CUDA_OK(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
    return d;
}

/* The GPU's quantization of a (rows, K) (transposed: the source is (K, rows) and row j of
 * the matrix is its column j) against the CPU's. */
static void check_quantize(int kind, int64_t rows, int64_t K, int transposed, int stochastic) {
    const size_t n = (size_t)rows * (size_t)K;
    float *a = (float *)malloc(n * sizeof(float) + 4), *src = (float *)malloc(n * sizeof(float) + 4);
    fill(a, rows, K, 1, -20, 20);
    if (transposed)
        for (int64_t j = 0; j < rows; j++)
            for (int64_t k = 0; k < K; k++) src[k * rows + j] = a[j * K + k];
    else
        memcpy(src, a, n * sizeof(float));
    const uint64_t seed = rnd_u64(), tid = rnd_u64() % 1000;
    kiln_mx_matrix c;
    if (kiln_mx_matrix_alloc(&c, (kiln_mx_kind)kind, rows, K) != KILN_OK) exit(1);
    kiln_status st = stochastic ? kiln_mx_quantize_stochastic(&c, a, K, seed, tid, NULL) : kiln_mx_quantize(&c, a, K, NULL);
    if (st != KILN_OK) exit(1);
    kiln_cuda_mx g;
    CUDA_OK(kiln_cuda_mx_alloc(&g, kind, rows, K));
    float *d_src = (float *)dev_copy(src, n * sizeof(float));
    CUDA_OK(kiln_cuda_mx_quantize(0, &g, d_src, transposed ? 1 : K, transposed ? rows : 1, stochastic, seed, tid));
    CUDA_OK(cudaDeviceSynchronize());
    const size_t plane = (size_t)rows * (size_t)c.nb * 32, ne = (size_t)rows * (size_t)c.nb;
    int8_t *q = (int8_t *)malloc(plane + 1), *lo = (int8_t *)malloc(plane + 1);
    int16_t *e = (int16_t *)malloc(ne * 2 + 2);
    CUDA_OK(cudaMemcpy(q, g.q, plane, cudaMemcpyDeviceToHost));
    if (kind == KILN_MX16) CUDA_OK(cudaMemcpy(lo, g.lo, plane, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(e, g.e, ne * 2, cudaMemcpyDeviceToHost));
    long bad = 0;
    for (size_t i = 0; i < plane; i++) bad += q[i] != c.q[i] || (kind == KILN_MX16 && lo[i] != c.lo[i]);
    for (size_t i = 0; i < ne; i++) bad += e[i] != c.e[i];
    for (int64_t j = 0; j < rows; j++) { /* the row flag the GPU derives from the exponents */
        int any = 0;
        for (int64_t b = 0; b < c.nb; b++) any |= e[j * c.nb + b] == KILN_MX_EXP_NONFINITE;
        bad += any != c.row_nonfinite[j];
    }
    g_q_cases++;
    g_q_bytes += (long)(plane * (kind == KILN_MX16 ? 2 : 1) + ne * 2);
    g_q_bad += bad;
    EXPECT(bad == 0, "quantize mx%d %lld x %lld%s%s: %ld bytes differ", kind, (long long)rows, (long long)K,
           transposed ? " transposed" : "", stochastic ? " stochastic" : "", bad);
    kiln_mx_matrix_free(&c);
    kiln_cuda_mx_free(&g);
    cudaFree(d_src);
    free(a);
    free(src);
    free(q);
    free(lo);
    free(e);
}

/* The CPU's quantized matrix, uploaded as it is. */
static void upload_mx(kiln_cuda_mx *g, const kiln_mx_matrix *c) {
    CUDA_OK(kiln_cuda_mx_alloc(g, (int)c->kind, c->rows, c->K));
    const size_t plane = (size_t)c->rows * (size_t)c->nb * 32;
    CUDA_OK(cudaMemcpy(g->q, c->q, plane, cudaMemcpyHostToDevice));
    if (c->kind == KILN_MX16) CUDA_OK(cudaMemcpy(g->lo, c->lo, plane, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(g->e, c->e, (size_t)c->rows * (size_t)c->nb * 2, cudaMemcpyHostToDevice));
}

static void check_product(int kind, int64_t N, int64_t R, int64_t K, int special, int mode) {
    /* mode 0: plain; 1: bias; 2: accumulate. Row scales: mode-dependent ranges give normal,
     * subnormal (2^-75 each side) and infinite (2^70 each side) results. */
    const int sc = rnd_int(0, 9);
    const int lo_s = sc == 0 ? -80 : sc == 1 ? 60 : -30, hi_s = sc == 0 ? -70 : sc == 1 ? 70 : 30;
    float *x = (float *)malloc((size_t)N * K * sizeof(float) + 4), *w = (float *)malloc((size_t)R * K * sizeof(float) + 4);
    fill(x, N, K, special, lo_s, hi_s);
    fill(w, R, K, special, lo_s, hi_s);
    float *bias = (float *)malloc((size_t)R * sizeof(float)), *old = (float *)malloc((size_t)N * R * sizeof(float));
    for (int64_t r = 0; r < R; r++) bias[r] = rnd_normal();
    for (int64_t i = 0; i < N * R; i++) old[i] = rnd_normal();
    kiln_mx_matrix cx, cw;
    if (kiln_mx_matrix_alloc(&cx, (kiln_mx_kind)kind, N, K) || kiln_mx_matrix_alloc(&cw, (kiln_mx_kind)kind, R, K) ||
        kiln_mx_quantize(&cx, x, K, NULL) || kiln_mx_quantize(&cw, w, K, NULL))
        exit(1);
    float *want = (float *)malloc((size_t)N * R * sizeof(float)), *got = (float *)malloc((size_t)N * R * sizeof(float));
    if (kiln_mx_matmul_cpu(&cx, &cw, want, R, NULL, KILN_CPU_PATH_PORTABLE) != KILN_OK) exit(1);
    /* the CPU's SIMD paths on this machine's CPU give the reference's bits too */
    for (int path = KILN_CPU_PATH_AVX2; path <= KILN_CPU_PATH_AVX512; path++) {
        if (!kiln_cpu_path_supported((kiln_cpu_path)path)) continue;
        if (kiln_mx_matmul_cpu(&cx, &cw, got, R, NULL, (kiln_cpu_path)path) != KILN_OK) exit(1);
        long d = 0;
        for (int64_t i = 0; i < N * R; i++) d += memcmp(&want[i], &got[i], 4) != 0;
        g_simd_bad += d;
        EXPECT(d == 0, "the CPU's %s kernel: %ld of %lld outputs differ from the reference (N %lld R %lld K %lld)",
               kiln_mx_kernel_name((kiln_cpu_path)path), d, (long long)(N * R), (long long)N, (long long)R,
               (long long)K);
    }
    for (int64_t i = 0; i < N * R; i++) {
        if (mode == 1) want[i] = want[i] + bias[i % R];
        else if (mode == 2) want[i] = old[i] + want[i];
    }
    kiln_cuda_mx gx, gw;
    upload_mx(&gx, &cx);
    upload_mx(&gw, &cw);
    /* one scratch for every product, zeroed once: each must leave it zeroed for the next */
    const size_t wsb = kiln_cuda_mx_matmul_ws_bytes(N, R, cx.nb);
    static void *ws = NULL;
    static const size_t ws_cap = (size_t)64 << 20;
    if (!ws) {
        CUDA_OK(cudaMalloc(&ws, ws_cap));
        CUDA_OK(cudaMemset(ws, 0, ws_cap));
    }
    if (wsb > ws_cap) {
        fprintf(stderr, "scratch of %zu bytes: more than the test's\n", wsb);
        exit(1);
    }
    float *d_out = NULL, *d_bias = (float *)dev_copy(bias, (size_t)R * sizeof(float));
    if (mode == 2) {
        d_out = (float *)dev_copy(old, (size_t)N * R * sizeof(float));
    } else {
        for (int64_t i = 0; i < N * R; i++) got[i] = NAN;
        d_out = (float *)dev_copy(got, (size_t)N * R * sizeof(float));
    }
    for (int rep = 0; rep < 2; rep++) { /* twice: the scratch is left zeroed for the next use */
        if (rep == 1) CUDA_OK(cudaMemcpy(d_out, mode == 2 ? old : got, (size_t)N * R * sizeof(float), cudaMemcpyHostToDevice));
        CUDA_OK(kiln_cuda_mx_matmul(0, &gx, &gw, d_out, R, mode == 1 ? d_bias : NULL, NULL, mode == 2, ws));
        CUDA_OK(cudaDeviceSynchronize());
        float *res = (float *)malloc((size_t)N * R * sizeof(float));
        CUDA_OK(cudaMemcpy(res, d_out, (size_t)N * R * sizeof(float), cudaMemcpyDeviceToHost));
        long bad = 0;
        int64_t first = -1;
        for (int64_t i = 0; i < N * R; i++)
            /* after an f32 add (bias, accumulate) only "NaN here" is defined: x86 keeps an
             * operand NaN's payload, the GPU gives its canonical NaN (docs/ARITHMETIC.md) */
            if (mode != 0 && isnan(want[i]) && isnan(res[i])) continue;
            else if (memcmp(&want[i], &res[i], 4) != 0) {
                if (first < 0) first = i;
                bad++;
            }
        g_p_cases++;
        g_p_elems += N * R;
        g_p_bad += bad;
        EXPECT(bad == 0, "product mx%d N %lld R %lld K %lld mode %d scales [%d, %d] split %s rep %d: %ld differ, "
               "first [%lld, %lld] want %a got %a", kind, (long long)N, (long long)R, (long long)K, mode, lo_s, hi_s,
               wsb ? "yes" : "no", rep, bad, first < 0 ? 0ll : (long long)(first / R), first < 0 ? 0ll : (long long)(first % R),
               first < 0 ? 0.0 : (double)want[first], first < 0 ? 0.0 : (double)res[first]);
        free(res);
        if (mode != 2) /* poison again */
            for (int64_t i = 0; i < N * R; i++) got[i] = NAN;
    }
    kiln_cuda_mx_free(&gx);
    kiln_cuda_mx_free(&gw);
    kiln_mx_matrix_free(&cx);
    kiln_mx_matrix_free(&cw);
    cudaFree(d_out);
    cudaFree(d_bias);
    free(x);
    free(w);
    free(bias);
    free(old);
    free(want);
    free(got);
}

/* matmul through the backends (ops.h) in an exact format's mode: the CPU backend's and the
 * CUDA backend's outputs for a weight in host memory (f32 or bf16), with and without a bias. */
static void check_backends(int mode, kiln_backend *cpu, kiln_backend *gpu, int N, int64_t R, int64_t C, int bf16,
                           int with_bias) {
    float *x = (float *)malloc((size_t)N * C * sizeof(float)), *wf = (float *)malloc((size_t)R * C * sizeof(float));
    float *bias = (float *)malloc((size_t)R * sizeof(float));
    fill(x, N, C, 0, -2, 2);
    fill(wf, R, C, 0, -8, -4);
    for (int64_t r = 0; r < R; r++) bias[r] = rnd_normal();
    uint16_t *wb = (uint16_t *)malloc((size_t)R * C * 2);
    for (int64_t i = 0; i < R * C; i++) {
        uint32_t u;
        memcpy(&u, &wf[i], 4);
        wb[i] = (uint16_t)(u >> 16); /* truncated: any bf16 values do */
    }
    kiln_tensor W;
    memset(&W, 0, sizeof W);
    W.name = "w";
    W.dtype = bf16 ? KILN_DTYPE_BF16 : KILN_DTYPE_F32;
    W.n_dims = 2;
    W.shape[0] = R;
    W.shape[1] = C;
    W.data = bf16 ? (const void *)wb : (const void *)wf;
    W.nbytes = (size_t)R * C * (bf16 ? 2 : 4);
    float *want = (float *)malloc((size_t)N * R * sizeof(float)), *got = (float *)malloc((size_t)N * R * sizeof(float));
    cpu->i->matmul(cpu, want, x, &W, with_bias ? bias : NULL, N);
    float *dx = (float *)kiln_backend_alloc(gpu, (size_t)N * C * sizeof(float));
    float *dout = (float *)kiln_backend_alloc(gpu, (size_t)N * R * sizeof(float));
    float *db = (float *)kiln_backend_alloc(gpu, (size_t)R * sizeof(float));
    for (int64_t i = 0; i < N * R; i++) got[i] = NAN;
    if (kiln_backend_upload(gpu, dx, x, (size_t)N * C * sizeof(float)) || kiln_backend_upload(gpu, db, bias, (size_t)R * 4) ||
        kiln_backend_upload(gpu, dout, got, (size_t)N * R * sizeof(float)))
        exit(1);
    gpu->i->matmul(gpu, dout, dx, &W, with_bias ? db : NULL, N);
    kiln_status st = kiln_backend_download(gpu, got, dout, (size_t)N * R * sizeof(float));
    EXPECT(st == KILN_OK, "backend matmul: %s", kiln_last_error());
    long bad = 0;
    for (int64_t i = 0; i < N * R; i++) bad += memcmp(&want[i], &got[i], 4) != 0;
    g_b_cases++;
    g_b_elems += N * R;
    g_b_bad += bad;
    EXPECT(bad == 0, "backend matmul mode %d N %d R %lld C %lld %s%s: %ld of %lld differ", mode, N, (long long)R,
           (long long)C, bf16 ? "bf16" : "f32", with_bias ? " bias" : "", bad, (long long)(N * R));
    kiln_backend_free_buf(gpu, dx);
    kiln_backend_free_buf(gpu, dout);
    kiln_backend_free_buf(gpu, db);
    kiln_backends_forget(W.data, W.nbytes); /* its memory goes: the backends' copies with it */
    free(x);
    free(wf);
    free(wb);
    free(bias);
    free(want);
    free(got);
}

/* A model's pattern: several weights alive at once, products of random ones on 1..20 rows in
 * a random order, each output compared (the caches and scratch reused across shapes). */
static void check_sequence(int mode, kiln_backend *cpu, kiln_backend *gpu) {
    enum { NW = 6, MAXN = 20 };
    static const int64_t shapes[NW][2] = {{192, 128}, {96, 128}, {128, 192}, {256, 128}, {128, 256}, {3000, 128}};
    float *wf[NW];
    kiln_tensor W[NW];
    for (int i = 0; i < NW; i++) {
        const int64_t R = shapes[i][0], C = shapes[i][1];
        wf[i] = (float *)malloc((size_t)R * C * sizeof(float));
        fill(wf[i], R, C, 0, -8, -4);
        W[i] = kiln_ce_f32_view("seq", wf[i], R, C);
    }
    float *x = (float *)malloc((size_t)MAXN * 256 * 4), *want = (float *)malloc((size_t)MAXN * 3000 * 4),
          *got = (float *)malloc((size_t)MAXN * 3000 * 4);
    float *dx = (float *)kiln_backend_alloc(gpu, (size_t)MAXN * 256 * 4), *dout = (float *)kiln_backend_alloc(gpu, (size_t)MAXN * 3000 * 4);
    for (int step = 0; step < 60; step++) {
        const int i = rnd_int(0, NW - 1), N = step % 3 == 0 ? 1 : rnd_int(1, MAXN);
        const int64_t R = shapes[i][0], C = shapes[i][1];
        fill(x, N, C, 0, -2, 2);
        cpu->i->matmul(cpu, want, x, &W[i], NULL, N);
        if (kiln_backend_upload(gpu, dx, x, (size_t)N * C * 4)) exit(1);
        gpu->i->matmul(gpu, dout, dx, &W[i], NULL, N);
        EXPECT(kiln_backend_download(gpu, got, dout, (size_t)N * R * 4) == KILN_OK, "sequence: %s", kiln_last_error());
        long bad = 0;
        for (int64_t k = 0; k < N * R; k++) bad += memcmp(&want[k], &got[k], 4) != 0;
        g_b_cases++;
        g_b_elems += N * R;
        g_b_bad += bad;
        EXPECT(bad == 0, "sequence mode %d step %d: weight %d (%lld x %lld), N %d: %ld differ", mode, step, i,
               (long long)R, (long long)C, N, bad);
    }
    kiln_backend_free_buf(gpu, dx);
    kiln_backend_free_buf(gpu, dout);
    for (int i = 0; i < NW; i++) {
        kiln_backends_forget(W[i].data, W[i].nbytes);
        free(wf[i]);
    }
    free(x);
    free(want);
    free(got);
}

/* ops.h's products through both backends (the CPU composes them; CUDA quantizes the normed
 * input once for all of a call's products, bias and residual in the epilogue): three products
 * with biases on a normed input, a SwiGLU pair with a residual, one product with a residual. */
static void check_products(int mode, kiln_backend *cpu, kiln_backend *gpu, int N) {
    enum { C = 128, R0 = 96, R1 = 256 };
    static float wdat[4][R1 * C];
    kiln_tensor W[4];
    for (int i = 0; i < 4; i++) {
        const int64_t R = i < 2 ? R0 : R1;
        fill(wdat[i], R, C, 0, -8, -4);
        W[i] = kiln_ce_f32_view("prod", wdat[i], R, C);
    }
    const size_t nx = (size_t)N * C, nr = (size_t)N * R1;
    /* want and got: 2 nr each (v 0's three outputs are 3 N R0 = 288 N floats) */
    float *h = (float *)malloc((nx + C + 3 * R1 + 5 * nr) * sizeof(float));
    float *x = h, *nw = x + nx, *b = nw + C, *res = b + 3 * R1, *want = res + nr, *got = want + 2 * nr;
    fill(x, N, C, 0, -3, 3);
    for (int i = 0; i < C; i++) nw[i] = 1.0f + 0.1f * rnd_normal();
    for (int i = 0; i < 3 * R1; i++) b[i] = rnd_normal();
    for (size_t i = 0; i < nr; i++) res[i] = rnd_normal();
    /* device copies: x, norm, biases, residual, outputs, scratch */
    float *d = (float *)kiln_backend_alloc(gpu, (nx + C + 3 * R1 + nr + 2 * nr + 3 * nr) * sizeof(float));
    float *dx = d, *dnw = dx + nx, *db = dnw + C, *dres = db + 3 * R1, *dout = dres + nr, *dsc = dout + 2 * nr;
    if (kiln_backend_upload(gpu, d, h, (nx + C + 3 * R1 + nr) * sizeof(float))) exit(1);
    float *hs = (float *)malloc(3 * nr * sizeof(float));
    for (int v = 0; v < 3; v++) {
        /* v 0: W0, W1, W0 with biases on normed x; 1: the pair (W2, W3) with a residual; 2: W2 + res */
        const int n = v == 0 ? 3 : 1;
        for (int side = 0; side < 2; side++) {
            kiln_backend *be = side ? gpu : cpu;
            float *o = side ? dout : want, *sc = side ? dsc : hs;
            const float *bb = side ? db : b, *rr = side ? dres : res;
            float *outs[3] = {o, o + (size_t)N * R0, o + 2 * (size_t)N * R0};
            const kiln_tensor *ws[3] = {&W[0], &W[1], &W[0]};
            const float *bias3[3] = {bb, bb + R1, bb + 2 * R1}, *res1[1] = {rr};
            kiln_products p;
            memset(&p, 0, sizeof p);
            p.n = n;
            p.out = outs;
            p.eps = 1e-6f;
            p.scratch_x = sc;
            p.scratch_gate = sc + nr;
            p.scratch_up = sc + 2 * nr;
            if (v == 0) {
                p.W = ws;
                p.bias = bias3;
                p.norm_w = side ? dnw : nw;
            } else {
                const kiln_tensor *w2[1] = {&W[2]};
                p.W = w2;
                p.res = res1;
                if (v == 1) {
                    p.up = &W[3];
                    p.norm_w = side ? dnw : nw;
                }
                kiln_op_products(be, side ? dx : x, &p, N);
                continue;
            }
            kiln_op_products(be, side ? dx : x, &p, N);
        }
        const size_t len = v == 0 ? 3 * (size_t)N * R0 : (size_t)N * R1;
        EXPECT(kiln_backend_download(gpu, got, dout, len * sizeof(float)) == KILN_OK, "products: %s", kiln_last_error());
        long bad = 0;
        for (size_t i = 0; i < len; i++) bad += memcmp(&want[i], &got[i], 4) != 0;
        g_b_cases++;
        g_b_elems += (long)len;
        g_b_bad += bad;
        EXPECT(bad == 0, "products mode %d variant %d N %d: %ld of %zu differ", mode, v, N, bad, len);
    }
    kiln_backend_free_buf(gpu, d);
    for (int i = 0; i < 4; i++) kiln_backends_forget(W[i].data, W[i].nbytes);
    free(h);
    free(hs);
}

/* --bench: the product's time on a training step's shapes (Qwen2.5-0.5B widths, 4096 tokens),
 * random N(0,1) operands quantized on the GPU, the median of 15 timed runs after 3 warm ones. */
static void bench(void) {
    static const struct {
        const char *what;
        int64_t N, R, K;
    } sh[] = {{"q/o forward, dx", 4096, 896, 896},    {"gate/up forward", 4096, 4864, 896},
              {"down forward, gate/up dx", 4096, 896, 4864}, {"gate/up dW (K = tokens)", 4864, 896, 4096},
              {"q/o dW (K = tokens)", 896, 896, 4096}};
    void *ws = NULL;
    const size_t ws_cap = (size_t)256 << 20;
    CUDA_OK(cudaMalloc(&ws, ws_cap));
    CUDA_OK(cudaMemset(ws, 0, ws_cap));
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    printf("kind | shape (N x R x K) | what | us | TMAC/s\n");
    for (int kind = 8; kind <= 16; kind += 8)
        for (size_t i = 0; i < sizeof sh / sizeof sh[0]; i++) {
            const int64_t N = sh[i].N, R = sh[i].R, K = sh[i].K;
            float *h = (float *)malloc((size_t)(N > R ? N : R) * (size_t)K * sizeof(float));
            float *d_a = NULL, *d_out = NULL;
            CUDA_OK(cudaMalloc((void **)&d_a, (size_t)(N > R ? N : R) * (size_t)K * sizeof(float)));
            CUDA_OK(cudaMalloc((void **)&d_out, (size_t)N * (size_t)R * sizeof(float)));
            kiln_cuda_mx gx, gw;
            CUDA_OK(kiln_cuda_mx_alloc(&gx, kind, N, K));
            CUDA_OK(kiln_cuda_mx_alloc(&gw, kind, R, K));
            for (int w = 0; w < 2; w++) {
                const int64_t rows = w ? R : N;
                for (int64_t j = 0; j < rows * K; j++) h[j] = rnd_normal();
                CUDA_OK(cudaMemcpy(d_a, h, (size_t)rows * (size_t)K * sizeof(float), cudaMemcpyHostToDevice));
                CUDA_OK(kiln_cuda_mx_quantize(0, w ? &gw : &gx, d_a, K, 1, 0, 0, 0));
            }
            if (kiln_cuda_mx_matmul_ws_bytes(N, R, gx.nb) > ws_cap) {
                fprintf(stderr, "bench: scratch too small\n");
                g_fail++;
            } else {
                float t[15];
                for (int r = 0; r < 18; r++) {
                    CUDA_OK(cudaEventRecord(e0, 0));
                    CUDA_OK(kiln_cuda_mx_matmul(0, &gx, &gw, d_out, R, NULL, NULL, 0, ws));
                    CUDA_OK(cudaEventRecord(e1, 0));
                    CUDA_OK(cudaEventSynchronize(e1));
                    if (r >= 3) CUDA_OK(cudaEventElapsedTime(&t[r - 3], e0, e1));
                }
                for (int a = 0; a < 15; a++) /* sort: the median */
                    for (int b = a + 1; b < 15; b++)
                        if (t[b] < t[a]) {
                            const float x = t[a];
                            t[a] = t[b];
                            t[b] = x;
                        }
                const double us = 1e3 * t[7];
                printf("mx%d | %lld x %lld x %lld | %s | %.1f | %.2f\n", kind, (long long)N, (long long)R, (long long)K,
                       sh[i].what, us, (double)N * (double)R * (double)K / (us * 1e-6) / 1e12);
            }
            kiln_cuda_mx_free(&gx);
            kiln_cuda_mx_free(&gw);
            cudaFree(d_a);
            cudaFree(d_out);
            free(h);
        }
    cudaFree(ws);
}

int main(int argc, char **argv) {
    const bool do_bench = argc > 1 && !strcmp(argv[1], "--bench");
    if (argc > 1 && !do_bench) g_rng = strtoull(argv[1], NULL, 0);
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        fprintf(stderr, "no CUDA device: skipped\n");
        return 77;
    }
    if (do_bench) {
        bench();
        return g_fail ? 1 : 0;
    }
    /* argument checks */
    kiln_cuda_mx m;
    EXPECT(kiln_cuda_mx_alloc(&m, 7, 4, 64) == cudaErrorInvalidValue, "kind 7 accepted");
    EXPECT(kiln_cuda_mx_alloc(&m, KILN_MX8, 4, KILN_MX_MAX_K + 1) == cudaErrorInvalidValue, "K over the limit accepted");

    for (int kind = 8; kind <= 16; kind += 8)
        for (int c = 0; c < 12; c++) {
            const int64_t rows = rnd_int(1, 70), K = c < 2 ? rnd_int(1, 31) : rnd_int(1, 700);
            check_quantize(kind, rows, K, c % 3 == 1, c % 2);
        }
    /* decode shapes (split over the blocks), prefill shapes (unsplit), tails */
    static const int64_t shapes[][3] = {{1, 896, 896},  {1, 128, 4864}, {3, 200, 96},  {8, 64, 1000},
                                        {5, 17, 33},    {9, 100, 160},  {33, 70, 7},   {100, 130, 450},
                                        {300, 64, 256}, {2, 1, 2048},   {1, 4864, 896}, {64, 96, 64},
                                        /* mx_gemm_kernel: tiles with tails, splits of the blocks */
                                        {130, 300, 2000}, {200, 896, 896}, {70, 1000, 100}, {256, 130, 33},
                                        {40, 64, 4864}};
    for (int kind = 8; kind <= 16; kind += 8)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (int mode = 0; mode < 3; mode++)
                check_product(kind, shapes[s][0], shapes[s][1], shapes[s][2], (int)((s + mode) % 2), mode);

    /* through the backends: the weight cache, the scratch, the bias */
    for (int mode = KILN_MODE_MX16; mode <= KILN_MODE_MX8; mode++) {
        kiln_backend *cpu = NULL, *gpu = NULL;
        if (kiln_backend_acquire(-1, mode, 2, &cpu) != KILN_OK || kiln_backend_acquire(0, mode, 0, &gpu) != KILN_OK) {
            fprintf(stderr, "backends in mode %d: %s\n", mode, kiln_last_error());
            g_fail++;
            break;
        }
        static const int64_t bs[][3] = {{20, 64, 64}, {1, 64, 64}, {20, 160, 64}, {20, 64, 160}, {1, 64, 160},
                                        {5, 64, 160}, {20, 32000, 64}, {1, 32000, 64}, {7, 896, 4864}, {1, 4864, 896},
                                        {96, 300, 1000}};
        for (size_t i = 0; i < sizeof bs / sizeof bs[0]; i++)
            for (int v = 0; v < 4; v++) check_backends(mode, cpu, gpu, (int)bs[i][0], bs[i][1], bs[i][2], v & 1, v >> 1);
        check_sequence(mode, cpu, gpu);
        static const int ns[] = {1, 10, 19, 40};
        for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) check_products(mode, cpu, gpu, ns[i]);
        kiln_backend_release(cpu);
        kiln_backend_release(gpu);
    }

    printf("what | cases | compared | differing\n");
    printf("quantize (bytes) | %ld | %ld | %ld\n", g_q_cases, g_q_bytes, g_q_bad);
    printf("product (outputs) | %ld | %ld | %ld\n", g_p_cases, g_p_elems, g_p_bad);
    printf("the CPU's SIMD products against its reference | | | %ld\n", g_simd_bad);
    printf("matmul through the backends (outputs) | %ld | %ld | %ld\n", g_b_cases, g_b_elems, g_b_bad);
    printf("%s\n", g_fail ? "FAILED" : "ALL BIT-IDENTICAL");
    return g_fail ? 1 : 0;
}
