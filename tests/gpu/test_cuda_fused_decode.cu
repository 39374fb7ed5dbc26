/*
 * test_cuda_fused_decode.cu -- the decode step's fused kernels against the unfused calls they
 * replace, bit for bit (their contracts say "the bits of"):
 *   - kiln_cuda_matvec_fast_multi (cuda_matmul.h): several products in one launch, each
 *     output == kiln_cuda_matvec_fast on its job alone; a residual == that, then
 *     kiln_cuda_add; a SwiGLU pair == two kiln_cuda_matvec_fast calls, then kiln_cuda_swiglu
 *     (with and without biases); a pair off the aligned path returns cudaErrorNotSupported
 *     and writes nothing; bad arguments refused;
 *   - the _norm launchers (an RMSNorm prologue) == kiln_cuda_rmsnorm, then the products;
 *   - kiln_cuda_matmul_multi (auditable): the same checks against kiln_cuda_matmul (a
 *     misaligned pair runs, on the byte-load path, with the same bits);
 *   - kiln_cuda_matmul_res (auditable) == kiln_cuda_matmul, then kiln_cuda_add;
 *   - kiln_cuda_rope_kv_store == kiln_cuda_rope on q and k, then kiln_cuda_kv_store_rows.
 * Over 8 weight dtypes, N = 1..8 (and 11 for the auditable kernel), decode shapes and odd
 * ones. Outputs are poisoned with NaN before each run, so an unwritten element fails.
 * Exit: 0 all OK, 1 a failure, 77 no GPU.
 */
#include "ops/cuda/cuda_elementwise.h"
#include "ops/cuda/cuda_matmul.h"
#include "ops/cuda/cuda_norm.h"
#include "ops/cuda/cuda_rope.h"
#include "ops/cuda/cuda_rows.h"

extern "C" {
#include "base/base.h"
#include "base/tensor.h"
}

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_test_cuda_check.h"

static int g_fail, g_cases;

static uint64_t g_rng = 0x66757365645f6463ull;
static uint64_t rnd_u64(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rnd_unit(void) { return (float)((double)(rnd_u64() >> 11) * 0x1p-53 * 2.0 - 1.0); }

/* Random weight bytes of R rows of dtype dt, with finite moderate f16 scales where the format
 * has them (a NaN scale would make "equal bits" vacuous). */
static uint8_t *rnd_weights(kiln_dtype dt, int64_t R, int64_t C, size_t *rb_out) {
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(dt);
    const size_t rb = (size_t)(C / tr->block_size) * (size_t)tr->type_size, nb = rb * (size_t)R;
    uint8_t *w = (uint8_t *)kiln_malloc(nb + 8);
    for (size_t i = 0; i < nb; i++) w[i] = (uint8_t)rnd_u64();
    const size_t ts = (size_t)tr->type_size;
    for (size_t b = 0; b < nb / ts; b++) {
        uint8_t *p = w + b * ts;
        uint16_t h = kiln_fp32_to_fp16(0.01f + 0.04f * (rnd_unit() * 0.5f + 0.5f));
        switch (dt) {
        case KILN_DTYPE_F32: {
            const float f = rnd_unit();
            memcpy(p, &f, 4);
            break;
        }
        case KILN_DTYPE_F16: {
            const uint16_t v = kiln_fp32_to_fp16(rnd_unit());
            memcpy(p, &v, 2);
            break;
        }
        case KILN_DTYPE_BF16: {
            const uint16_t v = kiln_fp32_to_bf16(rnd_unit());
            memcpy(p, &v, 2);
            break;
        }
        case KILN_DTYPE_Q8_0: case KILN_DTYPE_Q4_0: case KILN_DTYPE_Q5_0: memcpy(p, &h, 2); break;
        case KILN_DTYPE_Q4_K: case KILN_DTYPE_Q5_K:
            memcpy(p, &h, 2);
            memcpy(p + 2, &h, 2);
            break;
        case KILN_DTYPE_Q6_K: memcpy(p + 208, &h, 2); break;
        default: break;
        }
    }
    *rb_out = rb;
    return w;
}

template <class T> static T *dev_copy(const void *h, size_t bytes) {
    T *d = NULL;
    CUDA_OK(cudaMalloc(&d, bytes ? bytes : 4));
    if (bytes) CUDA_OK(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
    return d;
}
static float *dev_rand(size_t n, float scale) {
    float *h = (float *)kiln_malloc(n * 4 + 4);
    for (size_t i = 0; i < n; i++) h[i] = rnd_unit() * scale;
    float *d = dev_copy<float>(h, n * 4);
    kiln_free(h);
    return d;
}
static float *dev_nan(size_t n) {
    float *d = NULL;
    CUDA_OK(cudaMalloc(&d, n * 4 + 4));
    CUDA_OK(cudaMemset(d, 0xff, n * 4 + 4)); /* all-ones bits: a NaN */
    return d;
}
/* Whether a and b (device, n floats) hold the same bits; prints the first difference. */
static bool same_bits(const char *what, const float *a, const float *b, size_t n) {
    uint32_t *ha = (uint32_t *)kiln_malloc(n * 4 + 4), *hb = (uint32_t *)kiln_malloc(n * 4 + 4);
    CUDA_OK(cudaMemcpy(ha, a, n * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(hb, b, n * 4, cudaMemcpyDeviceToHost));
    bool ok = true;
    for (size_t i = 0; i < n && ok; i++)
        if (ha[i] != hb[i] || (ha[i] & 0x7fffffffu) > 0x7f800000u) {
            fprintf(stderr, "  %s: element %zu: %08x vs %08x\n", what, i, ha[i], hb[i]);
            ok = false;
        }
    kiln_free(ha);
    kiln_free(hb);
    g_cases++;
    EXPECT(ok, "%s", what);
    return ok;
}

/* ---- several products in one launch: multi, residual, pair -------------------------------- */

/* The unfused product (kiln_cuda_matvec_fast, or kiln_cuda_matmul when auditable) and the
 * fused launch (kiln_cuda_matvec_fast_multi / kiln_cuda_matmul_multi). */
static bool g_fast = true;
static cudaError_t product(float *out, const float *x, const uint8_t *w, size_t rb, kiln_dtype dt,
                           int64_t R, int64_t C, const float *bias, int N) {
    return g_fast ? kiln_cuda_matvec_fast(0, out, x, w, rb, dt, R, C, bias, N, 0)
                  : kiln_cuda_matmul(0, out, x, w, rb, dt, R, C, bias, N);
}
static cudaError_t products(int n, const kiln_cuda_product_job *jobs, kiln_dtype dt, const float *x,
                            int64_t C, int N) {
    return g_fast ? kiln_cuda_matvec_fast_multi(0, n, jobs, dt, x, C, N)
                  : kiln_cuda_matmul_multi(0, n, jobs, dt, x, C, N);
}
static cudaError_t products_norm(int n, const kiln_cuda_product_job *jobs, kiln_dtype dt,
                                 const float *x, const float *nw, float eps, int64_t C, int N) {
    return g_fast ? kiln_cuda_matvec_fast_multi_norm(0, n, jobs, dt, x, nw, eps, C, N)
                  : kiln_cuda_matmul_multi_norm(0, n, jobs, dt, x, nw, eps, C, N);
}

static void check_fast(kiln_dtype dt, int64_t C, int N, const int64_t *Rs, int n) {
    char what[160];
    char dn[64];
    snprintf(dn, sizeof dn, "%s %s", g_fast ? "fast" : "auditable", kiln_dtype_name(dt));
    float *x = dev_rand((size_t)N * C, 1.0f);
    uint8_t *w[KILN_CUDA_PRODUCT_MAX_JOBS];
    float *bias[KILN_CUDA_PRODUCT_MAX_JOBS], *res[KILN_CUDA_PRODUCT_MAX_JOBS];
    float *ref[KILN_CUDA_PRODUCT_MAX_JOBS], *got[KILN_CUDA_PRODUCT_MAX_JOBS];
    size_t rb = 0;
    kiln_cuda_product_job jobs[KILN_CUDA_PRODUCT_MAX_JOBS];
    for (int j = 0; j < n; j++) {
        uint8_t *h = rnd_weights(dt, Rs[j], C, &rb);
        w[j] = dev_copy<uint8_t>(h, rb * (size_t)Rs[j]);
        kiln_free(h);
        bias[j] = j % 2 ? NULL : dev_rand((size_t)Rs[j], 0.5f);
        res[j] = dev_rand((size_t)N * Rs[j], 2.0f);
        ref[j] = dev_nan((size_t)N * Rs[j]);
        got[j] = dev_nan((size_t)N * Rs[j]);
    }
    /* 1. n products in one launch, no residual */
    for (int j = 0; j < n; j++) {
        CUDA_OK(product(ref[j], x, w[j], rb, dt, Rs[j], C, bias[j], N));
        jobs[j] = {got[j], NULL, w[j], NULL, bias[j], NULL, rb, Rs[j]};
    }
    CUDA_OK(products(n, jobs, dt, x, C, N));
    for (int j = 0; j < n; j++) {
        snprintf(what, sizeof what, "%s multi C %lld N %d: job %d of %d (R %lld)", dn, (long long)C, N, j,
                 n, (long long)Rs[j]);
        same_bits(what, got[j], ref[j], (size_t)N * Rs[j]);
    }
    /* 2. with residuals: a separate buffer for job 0, out == res (accumulate) for the rest */
    for (int j = 0; j < n; j++) {
        CUDA_OK(product(ref[j], x, w[j], rb, dt, Rs[j], C, bias[j], N));
        CUDA_OK(kiln_cuda_add(0, ref[j], res[j], (size_t)N * Rs[j]));
        if (j == 0) {
            CUDA_OK(cudaMemset(got[j], 0xff, (size_t)N * Rs[j] * 4));
            jobs[j].res = res[j];
        } else {
            CUDA_OK(cudaMemcpy(got[j], res[j], (size_t)N * Rs[j] * 4, cudaMemcpyDeviceToDevice));
            jobs[j].res = got[j];
        }
    }
    CUDA_OK(products(n, jobs, dt, x, C, N));
    for (int j = 0; j < n; j++) {
        snprintf(what, sizeof what, "%s residual C %lld N %d: job %d (%s)", dn, (long long)C, N, j,
                 j ? "out == res" : "res apart");
        same_bits(what, got[j], ref[j], (size_t)N * Rs[j]);
    }
    /* 3. a SwiGLU pair (jobs 0 and 1 as gate and up when they have the same rows), with and
     * without a residual */
    if (n >= 2 && Rs[0] == Rs[1]) {
        const size_t no = (size_t)N * Rs[0];
        float *g = dev_nan(no), *u = dev_nan(no);
        for (int with_res = 0; with_res < 2; with_res++) {
            CUDA_OK(product(g, x, w[0], rb, dt, Rs[0], C, bias[0], N));
            CUDA_OK(product(u, x, w[1], rb, dt, Rs[0], C, bias[1], N));
            CUDA_OK(kiln_cuda_swiglu(0, ref[0], g, u, no));
            if (with_res) CUDA_OK(kiln_cuda_add(0, ref[0], res[0], no));
            CUDA_OK(cudaMemset(got[0], 0xff, no * 4));
            const kiln_cuda_product_job pj = {got[0], with_res ? res[0] : NULL, w[0], w[1], bias[0], bias[1], rb,
                                             Rs[0]};
            CUDA_OK(products(1, &pj, dt, x, C, N));
            snprintf(what, sizeof what, "%s swiglu pair C %lld N %d R %lld%s", dn, (long long)C, N,
                     (long long)Rs[0], with_res ? " + res" : "");
            same_bits(what, got[0], ref[0], no);
        }
        /* the same pair with the up rows at an odd address: fast, and auditable with a plain
         * type (whole-element loads), not supported and nothing written (the caller splits it);
         * auditable with a block type (byte loads), the same bits */
        const bool refused = g_fast || dt == KILN_DTYPE_F32 || dt == KILN_DTYPE_F16 || dt == KILN_DTYPE_BF16;
        uint8_t *wodd = NULL;
        CUDA_OK(cudaMalloc(&wodd, rb * (size_t)Rs[0] + 8));
        CUDA_OK(cudaMemcpy(wodd + 1, w[1], rb * (size_t)Rs[0], cudaMemcpyDeviceToDevice));
        CUDA_OK(cudaMemset(got[0], 0xff, no * 4));
        const kiln_cuda_product_job bad = {got[0], NULL, w[0], wodd + 1, bias[0], bias[1], rb, Rs[0]};
        cudaError_t e = products(1, &bad, dt, x, C, N);
        g_cases++;
        if (refused) {
            EXPECT(e == cudaErrorNotSupported, "%s misaligned pair: %s", dn, cudaGetErrorName(e));
            uint32_t first = 0;
            CUDA_OK(cudaMemcpy(&first, got[0], 4, cudaMemcpyDeviceToHost));
            EXPECT(first == 0xffffffffu, "%s misaligned pair wrote its output", dn);
        } else {
            EXPECT(e == cudaSuccess, "%s misaligned pair: %s", dn, cudaGetErrorName(e));
            CUDA_OK(product(g, x, w[0], rb, dt, Rs[0], C, bias[0], N));
            CUDA_OK(product(u, x, w[1], rb, dt, Rs[0], C, bias[1], N));
            CUDA_OK(kiln_cuda_swiglu(0, ref[0], g, u, no));
            snprintf(what, sizeof what, "%s swiglu pair, up rows at an odd address", dn);
            same_bits(what, got[0], ref[0], no);
        }
        CUDA_OK(cudaFree(wodd));
        CUDA_OK(cudaFree(g));
        CUDA_OK(cudaFree(u));
    }
    /* 4. the RMSNorm prologue: == kiln_cuda_rmsnorm, then the products (plain jobs, then a
     * pair with a residual) */
    {
        float *nw = dev_rand((size_t)C, 1.5f), *xn = dev_nan((size_t)N * C);
        const float eps = 1e-6f;
        CUDA_OK(kiln_cuda_rmsnorm(0, xn, x, nw, N, (int)C, eps));
        for (int j = 0; j < n; j++) {
            CUDA_OK(product(ref[j], xn, w[j], rb, dt, Rs[j], C, bias[j], N));
            CUDA_OK(cudaMemset(got[j], 0xff, (size_t)N * Rs[j] * 4));
            jobs[j] = {got[j], NULL, w[j], NULL, bias[j], NULL, rb, Rs[j]};
        }
        CUDA_OK(products_norm(n, jobs, dt, x, nw, eps, C, N));
        for (int j = 0; j < n; j++) {
            snprintf(what, sizeof what, "%s rmsnorm prologue C %lld N %d: job %d (R %lld)", dn, (long long)C, N,
                     j, (long long)Rs[j]);
            same_bits(what, got[j], ref[j], (size_t)N * Rs[j]);
        }
        if (n >= 2 && Rs[0] == Rs[1]) {
            const size_t no = (size_t)N * Rs[0];
            float *g = dev_nan(no), *u = dev_nan(no);
            CUDA_OK(product(g, xn, w[0], rb, dt, Rs[0], C, bias[0], N));
            CUDA_OK(product(u, xn, w[1], rb, dt, Rs[0], C, bias[1], N));
            CUDA_OK(kiln_cuda_swiglu(0, ref[0], g, u, no));
            CUDA_OK(kiln_cuda_add(0, ref[0], res[0], no));
            CUDA_OK(cudaMemset(got[0], 0xff, no * 4));
            const kiln_cuda_product_job pj = {got[0], res[0], w[0], w[1], bias[0], bias[1], rb, Rs[0]};
            CUDA_OK(products_norm(1, &pj, dt, x, nw, eps, C, N));
            snprintf(what, sizeof what, "%s rmsnorm prologue, swiglu pair + res C %lld N %d", dn, (long long)C, N);
            same_bits(what, got[0], ref[0], no);
            CUDA_OK(cudaFree(g));
            CUDA_OK(cudaFree(u));
        }
        CUDA_OK(cudaFree(nw));
        CUDA_OK(cudaFree(xn));
    }
    for (int j = 0; j < n; j++) {
        CUDA_OK(cudaFree(w[j]));
        if (bias[j]) CUDA_OK(cudaFree(bias[j]));
        CUDA_OK(cudaFree(res[j]));
        CUDA_OK(cudaFree(ref[j]));
        CUDA_OK(cudaFree(got[j]));
    }
    CUDA_OK(cudaFree(x));
}

static void check_refusals(void) {
    float *x = dev_nan(1024), *o = dev_nan(1024);
    uint8_t *w = NULL;
    CUDA_OK(cudaMalloc(&w, 1024 * 64));
    const kiln_cuda_product_job ok = {o, NULL, w, NULL, NULL, NULL, 64, 8};
    kiln_cuda_product_job jobs[5] = {ok, ok, ok, ok, ok};
    const kiln_dtype bf = KILN_DTYPE_BF16;
    struct {
        const char *name;
        cudaError_t e;
    } cases[8];
    int k = 0;
    cases[k++] = {"n 0", kiln_cuda_matvec_fast_multi(0, 0, jobs, bf, x, 32, 1)};
    cases[k++] = {"n 5", kiln_cuda_matvec_fast_multi(0, 5, jobs, bf, x, 32, 1)};
    cases[k++] = {"two jobs, one output", kiln_cuda_matvec_fast_multi(0, 2, jobs, bf, x, 32, 1)};
    jobs[0].out = x;
    cases[k++] = {"out overlaps x", kiln_cuda_matvec_fast_multi(0, 1, jobs, bf, x, 32, 1)};
    jobs[0] = ok;
    jobs[1] = ok;
    jobs[1].out = o + 64;
    jobs[1].w_up = w;
    cases[k++] = {"pair and plain mixed", kiln_cuda_matvec_fast_multi(0, 2, jobs, bf, x, 32, 1)};
    jobs[1] = ok;
    jobs[0].res = o + 4;
    cases[k++] = {"res overlaps out", kiln_cuda_matvec_fast_multi(0, 1, jobs, bf, x, 32, 1)};
    jobs[0] = ok;
    cases[k++] = {"N 9", kiln_cuda_matvec_fast_multi(0, 1, jobs, bf, x, 32, 9)};
    cases[k++] = {"x NULL", kiln_cuda_matvec_fast_multi(0, 1, jobs, bf, NULL, 32, 1)};
    for (int i = 0; i < k; i++) {
        g_cases++;
        EXPECT(cases[i].e == cudaErrorInvalidValue, "refusal '%s': %s", cases[i].name,
               cudaGetErrorName(cases[i].e));
    }
    (void)cudaGetLastError();
    CUDA_OK(cudaFree(x));
    CUDA_OK(cudaFree(o));
    CUDA_OK(cudaFree(w));
}

/* ---- the auditable matmul with a residual ------------------------------------------------- */

static void check_matmul_res(kiln_dtype dt, int64_t R, int64_t C, int N) {
    size_t rb = 0;
    uint8_t *h = rnd_weights(dt, R, C, &rb);
    uint8_t *w = dev_copy<uint8_t>(h, rb * (size_t)R);
    kiln_free(h);
    float *x = dev_rand((size_t)N * C, 1.0f), *bias = dev_rand((size_t)R, 0.5f);
    float *res = dev_rand((size_t)N * R, 2.0f), *ref = dev_nan((size_t)N * R), *got = dev_nan((size_t)N * R);
    CUDA_OK(kiln_cuda_matmul(0, ref, x, w, rb, dt, R, C, bias, N));
    CUDA_OK(kiln_cuda_add(0, ref, res, (size_t)N * R));
    CUDA_OK(kiln_cuda_matmul_res(0, got, x, w, rb, dt, R, C, bias, res, N));
    char what[128];
    snprintf(what, sizeof what, "%s auditable matmul_res R %lld C %lld N %d", kiln_dtype_name(dt),
             (long long)R, (long long)C, N);
    same_bits(what, got, ref, (size_t)N * R);
    /* out == res */
    CUDA_OK(cudaMemcpy(got, res, (size_t)N * R * 4, cudaMemcpyDeviceToDevice));
    CUDA_OK(kiln_cuda_matmul_res(0, got, x, w, rb, dt, R, C, bias, got, N));
    snprintf(what, sizeof what, "%s auditable matmul_res in place R %lld N %d", kiln_dtype_name(dt),
             (long long)R, N);
    same_bits(what, got, ref, (size_t)N * R);
    CUDA_OK(cudaFree(w));
    CUDA_OK(cudaFree(x));
    CUDA_OK(cudaFree(bias));
    CUDA_OK(cudaFree(res));
    CUDA_OK(cudaFree(ref));
    CUDA_OK(cudaFree(got));
}

/* ---- rope and the cache store ----------------------------------------------------------- */

static void check_rope_store(int N, int NH, int KVH, int HS) {
    const int max_pos = 4096, half = HS / 2, rows = 64;
    const size_t qn = (size_t)N * NH * HS, kn = (size_t)N * KVH * HS, KD = (size_t)KVH * HS;
    float *ct = dev_rand((size_t)max_pos * half, 1.0f), *st = dev_rand((size_t)max_pos * half, 1.0f);
    int32_t hpos[64], hslot[64];
    for (int n = 0; n < N; n++) {
        hpos[n] = (int32_t)(rnd_u64() % max_pos);
        hslot[n] = (int32_t)((n * 7 + 3) % rows); /* distinct rows, scattered */
    }
    int32_t *pos = dev_copy<int32_t>(hpos, (size_t)N * 4), *slots = dev_copy<int32_t>(hslot, (size_t)N * 4);
    float *q0 = dev_rand(qn, 1.0f), *k0 = dev_rand(kn, 1.0f), *v = dev_rand(kn, 1.0f);
    float *q1 = dev_nan(qn), *k1 = dev_nan(kn), *q2 = dev_nan(qn), *k2 = dev_nan(kn);
    float *kp1 = dev_rand((size_t)rows * KD, 1.0f), *vp1 = dev_nan((size_t)rows * KD);
    float *kp2 = dev_nan((size_t)rows * KD), *vp2 = dev_nan((size_t)rows * KD);
    CUDA_OK(cudaMemcpy(vp1, kp1, (size_t)rows * KD * 4, cudaMemcpyDeviceToDevice));
    CUDA_OK(cudaMemcpy(kp2, kp1, (size_t)rows * KD * 4, cudaMemcpyDeviceToDevice));
    CUDA_OK(cudaMemcpy(vp2, kp1, (size_t)rows * KD * 4, cudaMemcpyDeviceToDevice));
    CUDA_OK(cudaMemcpy(q1, q0, qn * 4, cudaMemcpyDeviceToDevice));
    CUDA_OK(cudaMemcpy(q2, q0, qn * 4, cudaMemcpyDeviceToDevice));
    CUDA_OK(cudaMemcpy(k1, k0, kn * 4, cudaMemcpyDeviceToDevice));
    CUDA_OK(cudaMemcpy(k2, k0, kn * 4, cudaMemcpyDeviceToDevice));
    CUDA_OK(kiln_cuda_rope(0, q1, pos, N, NH, HS, ct, st));
    CUDA_OK(kiln_cuda_rope(0, k1, pos, N, KVH, HS, ct, st));
    CUDA_OK(kiln_cuda_kv_store_rows(0, kp1, vp1, k1, v, slots, N, KD));
    CUDA_OK(kiln_cuda_rope_kv_store(0, q2, k2, v, pos, N, NH, KVH, HS, ct, st, kp2, vp2, slots));
    char what[128];
    snprintf(what, sizeof what, "rope_kv_store N %d NH %d KVH %d HS %d: q", N, NH, KVH, HS);
    same_bits(what, q2, q1, qn);
    snprintf(what, sizeof what, "rope_kv_store N %d NH %d KVH %d HS %d: k", N, NH, KVH, HS);
    same_bits(what, k2, k1, kn);
    snprintf(what, sizeof what, "rope_kv_store N %d NH %d KVH %d HS %d: k pool", N, NH, KVH, HS);
    same_bits(what, kp2, kp1, (size_t)rows * KD);
    snprintf(what, sizeof what, "rope_kv_store N %d NH %d KVH %d HS %d: v pool", N, NH, KVH, HS);
    same_bits(what, vp2, vp1, (size_t)rows * KD);
    float *bufs[] = {ct, st, q0, k0, v, q1, k1, q2, k2, kp1, vp1, kp2, vp2};
    for (float *b : bufs) CUDA_OK(cudaFree(b));
    CUDA_OK(cudaFree(pos));
    CUDA_OK(cudaFree(slots));
}

int main(void) {
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        printf("test_cuda_fused_decode: no CUDA device, skipped\n");
        return 77;
    }
    check_refusals();
    const kiln_dtype dts[] = {KILN_DTYPE_BF16, KILN_DTYPE_F32, KILN_DTYPE_F16, KILN_DTYPE_Q8_0,
                              KILN_DTYPE_Q4_0, KILN_DTYPE_Q5_0, KILN_DTYPE_Q4_K, KILN_DTYPE_Q6_K};
    const int Ns[] = {1, 2, 3, 5, 8};
    for (kiln_dtype dt : dts) {
        const bool k_quant = dt == KILN_DTYPE_Q4_K || dt == KILN_DTYPE_Q6_K;
        const int64_t C = k_quant ? 1024 : 896; /* the 0.5B shape's width where the blocks allow */
        const int64_t qkv[3] = {C, 128, 128}, gu[2] = {2 * C + 64, 2 * C + 64}, odd[3] = {7, 7, 33};
        for (int fast = 1; fast >= 0; fast--) {
            g_fast = fast != 0;
            for (int N : Ns) {
                check_fast(dt, C, N, qkv, 3);
                check_fast(dt, C, N, gu, 2);
                check_fast(dt, k_quant ? 256 : 64, N, odd, 3);
            }
            if (!fast) check_fast(dt, C, 11, qkv, 3); /* auditable past 8 tokens: two tiles */
        }
        check_matmul_res(dt, 200, k_quant ? 512 : 160, 1);
        check_matmul_res(dt, 200, k_quant ? 512 : 160, 4);
        check_matmul_res(dt, 33, k_quant ? 256 : 96, 11);
    }
    check_rope_store(1, 14, 2, 64);
    check_rope_store(3, 14, 2, 64);
    check_rope_store(8, 24, 8, 128);
    check_rope_store(5, 4, 4, 6);
    CUDA_OK(cudaDeviceSynchronize());
    printf("test_cuda_fused_decode: %d checks, %d failed: %s\n", g_cases, g_fail,
           g_fail ? "FAILED" : "ALL OK");
    return g_fail ? 1 : 0;
}
