/*
 * test_ops.c -- the CPU backend's ops against
 *   (a) this file's own straightforward implementation of docs/ARITHMETIC.md: bit-exact;
 *   (b) a float64 reference: within a stated tolerance;
 * for every SIMD path the CPU has (portable, AVX2, AVX-512) and for 1, 2 and 3 threads,
 * with outputs poisoned with NaN before every run. Also: kiln_expf's accuracy and special
 * values, the thread pool, and quantized matmul == f32 matmul on the dequantized weights.
 */
#include "base/cpu_features.h"
#include "base/kmath.h"
#include "base/tensor.h"
#include "base/threadpool.h"
#include "ops/cpu/cpu_kernels.h"
#include "ops/ops.h"
#include "test_util.h"

#include <math.h>
#include <stdatomic.h>
#include <time.h>

/* ---- helpers ------------------------------------------------------------------------- */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd_u64(void) {
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return g_rng * 2685821657736338717ull;
}
static float rnd_f(float lo, float hi) {
    return lo + (hi - lo) * (float)((rnd_u64() >> 40) / 16777216.0);
}
static float *rnd_vec(size_t n, float lo, float hi) {
    float *v = malloc((n ? n : 1) * sizeof *v);
    for (size_t i = 0; i < n; i++) v[i] = rnd_f(lo, hi);
    return v;
}

/* The backends under test: every supported path x {1, 2, 3} threads. */
#define MAX_BE 9
static kiln_backend *g_be[MAX_BE];
static char g_be_name[MAX_BE][32];
static int g_n_be;

static void make_backends(void) {
    const kiln_cpu_path paths[] = {KILN_CPU_PATH_PORTABLE, KILN_CPU_PATH_AVX2,
                                   KILN_CPU_PATH_AVX512};
    for (int p = 0; p < 3; p++) {
        if (!kiln_cpu_path_supported(paths[p])) {
            printf("path %s: not supported by this CPU, skipped\n", kiln_cpu_path_name(paths[p]));
            continue;
        }
        setenv("KILN_CPU_PATH", kiln_cpu_path_name(paths[p]), 1);
        for (int nt = 1; nt <= 3; nt++) {
            kiln_backend *be = NULL;
            CHECK(kiln_backend_cpu_create(nt, &be) == KILN_OK);
            if (!be) continue;
            CHECK(kiln_backend_cpu_path(be) == paths[p]);
            CHECK(be->n_threads == nt);
            snprintf(g_be_name[g_n_be], sizeof g_be_name[0], "%s/%dt",
                     kiln_cpu_path_name(paths[p]), nt);
            g_be[g_n_be++] = be;
        }
    }
    unsetenv("KILN_CPU_PATH");
}

/* ---- this file's own implementation of the defined arithmetic ------------------------- */

static float def_dot(const float *a, const float *b, int64_t n) {
    float lane[16];
    for (int j = 0; j < 16; j++) {
        lane[j] = 0.0f;
        for (int64_t i = j; i < n; i += 16) lane[j] = fmaf(a[i], b[i], lane[j]);
    }
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) lane[j] = lane[j] + lane[j + w];
    return lane[0];
}

/* ---- tests ------------------------------------------------------------------------------ */

static void test_expf(void) {
    CHECK(kiln_expf(0.0f) == 1.0f);
    CHECK(kiln_expf(-0.0f) == 1.0f);
    CHECK(isnan(kiln_expf(NAN)));
    CHECK(kiln_expf(INFINITY) == INFINITY);
    CHECK(kiln_expf(-INFINITY) == 0.0f && !signbit(kiln_expf(-INFINITY)));
    CHECK(kiln_expf(89.0f) == INFINITY);
    CHECK(kiln_expf(-104.0f) == 0.0f);
    CHECK(kiln_expf(1.0f) == 2.71828174591064453125f || fabsf(kiln_expf(1.0f) - 2.7182817f) < 3e-7f);
    /* accuracy over the whole finite range of normal results: <= 2 ulp */
    double max_ulp = 0;
    float worst = 0;
    for (int i = 0; i < 2000000; i++) {
        float x = -87.0f + 175.5f * (float)i / 2000000.0f;
        if (x > 88.7f) break;
        double ref = exp((double)x);
        float got = kiln_expf(x);
        double ulp = ldexp(1.0, ilogb(ref) - 23);
        double e = fabs((double)got - ref) / ulp;
        if (e > max_ulp) max_ulp = e, worst = x;
    }
    printf("kiln_expf: max error %.3f ulp (at x = %.9g) over [-87, 88.7]\n", max_ulp, worst);
    CHECK_MSG(max_ulp <= 2.0, "max ulp %g", max_ulp);
    /* subnormal results: within one subnormal ulp-ish */
    for (float x = -103.5f; x < -87.5f; x += 0.37f) {
        double ref = exp((double)x);
        CHECK_MSG(fabs(kiln_expf(x) - ref) <= ldexp(1.0, -149) + ref * 1e-6, "x=%g", x);
    }
    /* kmath's dot equals this file's definition */
    for (int n = 0; n < 70; n++) {
        float *a = rnd_vec((size_t)n, -1, 1), *b = rnd_vec((size_t)n, -1, 1);
        CHECK(bits(kiln_dot_ref(a, b, n)) == bits(def_dot(a, b, n)));
        free(a), free(b);
    }
}

/* Every path's kernels directly: dot_accum (also in pieces), dots, exp_sub, attn_pv. */
static void test_kernels(void) {
    const kiln_cpu_kernels *ks[3] = {&kiln_cpu_kernels_portable, NULL, NULL};
#if defined(KILN_CPU_HAVE_X86)
    if (kiln_cpu_path_supported(KILN_CPU_PATH_AVX2)) ks[1] = &kiln_cpu_kernels_avx2;
    if (kiln_cpu_path_supported(KILN_CPU_PATH_AVX512)) ks[2] = &kiln_cpu_kernels_avx512;
#endif
    for (int p = 0; p < 3; p++) {
        const kiln_cpu_kernels *k = ks[p];
        if (!k) continue;
        for (int n = 0; n <= 300; n += (n < 40 ? 1 : 37)) {
            float *a = rnd_vec((size_t)n, -2, 2), *b = rnd_vec((size_t)n, -2, 2);
            float acc[16] = {0};
            int cut = (n / 2) / 16 * 16;
            k->dot_accum(acc, a, b, cut);
            k->dot_accum(acc, a + cut, b + cut, n - cut);
            CHECK_MSG(bits(kiln_lane16_reduce(acc)) == bits(def_dot(a, b, n)), "path %d n %d", p, n);
            free(a), free(b);
        }
        const int HSs[] = {1, 8, 15, 16, 33, 64, 80};
        for (int h = 0; h < 7; h++) {
            int HS = HSs[h], nk = 11, stride = HS + 3;
            float *q = rnd_vec((size_t)HS, -1, 1), *kk = rnd_vec((size_t)nk * stride, -1, 1);
            float s[11], p2[11];
            k->dots(s, q, kk, stride, nk, HS);
            for (int j = 0; j < nk; j++)
                CHECK_MSG(bits(s[j]) == bits(def_dot(q, kk + j * stride, HS)), "dots p%d HS %d", p, HS);
            k->exp_sub(p2, s, 0.25f, nk);
            for (int j = 0; j < nk; j++) CHECK(bits(p2[j]) == bits(kiln_expf(s[j] - 0.25f)));
            float *acc = rnd_vec((size_t)HS, -1, 1), *acc2 = malloc((size_t)HS * 4);
            memcpy(acc2, acc, (size_t)HS * 4);
            k->attn_pv(acc, 0.75f, p2, kk, stride, nk, HS);
            for (int d = 0; d < HS; d++) {
                acc2[d] = acc2[d] * 0.75f;
                for (int j = 0; j < nk; j++) acc2[d] = fmaf(p2[j], kk[j * stride + d], acc2[d]);
            }
            CHECK_MSG(same_bits(acc, acc2, (size_t)HS, "attn_pv"), "p%d HS %d", p, HS);
            free(q), free(kk), free(acc), free(acc2);
        }
        /* vector exp on special and extreme values */
        float xs[40], e[40];
        const float sp[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 88.72f, 88.73f, -103.9f,
                            -104.0f, -87.4f, -1e-30f, 1e-30f, 50.5f, -50.5f, 1e10f, -1e10f};
        for (int i = 0; i < 40; i++) xs[i] = i < 16 ? sp[i] : rnd_f(-110, 95);
        k->exp_sub(e, xs, 0.0f, 40);
        for (int i = 0; i < 40; i++)
            CHECK_MSG(bits(e[i]) == bits(kiln_expf(xs[i] - 0.0f)) || (isnan(e[i]) && isnan(xs[i])),
                      "path %d exp(%g) = %g vs %g", p, xs[i], e[i], kiln_expf(xs[i]));
    }
}

/* Dots whose exact result is -0: every product is negative and under half the smallest
 * subnormal (2^-126 * -2^-24 = -2^-150, a tie that rounds to even: -0), so each lane that
 * takes an element becomes -0 and stays -0, and with n >= 16 every lane does. The lanes
 * past n keep their accumulators: a SIMD tail that runs fmaf(0, 0, acc) on zero-padded
 * loads there turns -0 into +0 (docs/ARITHMETIC.md, dot). Compares bits (-0 == +0 as
 * floats): the kernels of every path (dot_accum from +0 and from accumulators of -0 carried
 * in, dots in groups of 4 and alone), then every backend's matmul on f32, f16 and bf16
 * weights (the tiles of 1 to 3 tokens and of 4 or more; C = 1000 has its tail in the AVX2
 * tile's second step block of 768). */
static void test_signed_zero_tails(void) {
    const float tiny = ldexpf(1.0f, -126), neg = -ldexpf(1.0f, -24);
    const uint32_t neg0 = 0x80000000u;
    const kiln_cpu_kernels *ks[3] = {&kiln_cpu_kernels_portable, NULL, NULL};
#if defined(KILN_CPU_HAVE_X86)
    if (kiln_cpu_path_supported(KILN_CPU_PATH_AVX2)) ks[1] = &kiln_cpu_kernels_avx2;
    if (kiln_cpu_path_supported(KILN_CPU_PATH_AVX512)) ks[2] = &kiln_cpu_kernels_avx512;
#endif
    const int ns[] = {5, 16, 17, 23, 31, 40, 47, 100};
    float a[100], b[100];
    for (int i = 0; i < 100; i++) a[i] = tiny, b[i] = neg;
    for (int p = 0; p < 3; p++) {
        const kiln_cpu_kernels *k = ks[p];
        if (!k) continue;
        for (int ni = 0; ni < 8; ni++) {
            const int n = ns[ni];
            for (int carried = 0; carried < 2; carried++) {
                float acc[16], want[16];
                for (int j = 0; j < 16; j++) acc[j] = want[j] = carried ? -0.0f : 0.0f;
                for (int i = 0; i < n; i++) want[i % 16] = fmaf(a[i], b[i], want[i % 16]);
                k->dot_accum(acc, a, b, n);
                CHECK_MSG(same_bits(acc, want, 16, "dot_accum lanes"), "path %d n %d carried %d", p,
                          n, carried);
                if (n >= 16 || carried) CHECK(bits(kiln_lane16_reduce(want)) == neg0);
            }
        }
        for (int hi = 3; hi < 8; hi++) {
            const int HS = ns[hi], nk = 6, stride = 100;
            float kk[6 * 100], s[6];
            for (int i = 0; i < nk * stride; i++) kk[i] = neg;
            k->dots(s, a, kk, stride, nk, HS);
            for (int j = 0; j < nk; j++)
                CHECK_MSG(bits(s[j]) == neg0 && bits(def_dot(a, kk + j * stride, HS)) == neg0,
                          "dots path %d HS %d: %g (0x%08x)", p, HS, s[j], bits(s[j]));
        }
    }
    const kiln_dtype dts[] = {KILN_DTYPE_F32, KILN_DTYPE_F16, KILN_DTYPE_BF16};
    const int64_t Cs[] = {17, 23, 40, 1000};
    const int Ns[] = {1, 3, 4, 9};
    const int64_t R = 7;
    for (int d = 0; d < 3; d++)
        for (int ci = 0; ci < 4; ci++)
            for (int ni = 0; ni < 4; ni++) {
                const int64_t C = Cs[ci];
                const int N = Ns[ni];
                const int es = d == 0 ? 4 : 2;
                uint8_t *w = malloc((size_t)(R * C) * (size_t)es);
                float *wf = malloc((size_t)(R * C) * 4), *x = malloc((size_t)(N * C) * 4);
                float *out = malloc((size_t)(N * R) * 4), *ref = malloc((size_t)(N * R) * 4);
                const uint16_t h = d == 1 ? kiln_fp32_to_fp16(neg) : kiln_fp32_to_bf16(neg);
                for (int64_t i = 0; i < R * C; i++) {
                    if (d == 0) memcpy(w + i * 4, &neg, 4);
                    else memcpy(w + i * 2, &h, 2);
                }
                kiln_dequantize(dts[d], w, wf, R * C);
                for (int64_t i = 0; i < N * C; i++) x[i] = tiny;
                for (int t = 0; t < N; t++)
                    for (int64_t r = 0; r < R; r++)
                        ref[t * R + r] = def_dot(x + t * C, wf + r * C, C);
                CHECK(bits(ref[0]) == neg0 && bits(ref[N * R - 1]) == neg0);
                kiln_tensor W = {"w", dts[d], 2, {R, C, 1, 1}, w, (size_t)(R * C) * (size_t)es};
                for (int be = 0; be < g_n_be; be++) {
                    poison(out, (size_t)(N * R));
                    g_be[be]->i->matmul(g_be[be], out, x, &W, NULL, N);
                    CHECK_MSG(same_bits(out, ref, (size_t)(N * R), "matmul -0"),
                              "%s: %s N=%d C=%lld", g_be_name[be], kiln_dtype_name(dts[d]), N,
                              (long long)C);
                }
                free(w), free(wf), free(x), free(out), free(ref);
            }
}

typedef struct pool_ctx {
    _Atomic int *hits;
    int n_threads;
    _Atomic int bad;
} pool_ctx;

/* every task exactly once, on a valid thread index */
static void pool_fn(void *c, int task, int thread) {
    pool_ctx *ctx = c;
    atomic_fetch_add(&ctx->hits[task], 1);
    if (thread < 0 || thread >= ctx->n_threads) atomic_store(&ctx->bad, 1);
}

static void test_threadpool(void) {
    for (int nt = 1; nt <= 4; nt++) {
        kiln_pool *pool = NULL;
        CHECK(kiln_pool_create(nt, &pool) == KILN_OK);
        CHECK(kiln_pool_n_threads(pool) == nt);
        static _Atomic int hits[64];
        int ok = 1;
        for (int rep = 0; rep < 3000; rep++) {
            int n_tasks = 1 + rep % 37;
            for (int i = 0; i < 64; i++) atomic_store(&hits[i], 0);
            pool_ctx ctx = {hits, nt, 0};
            kiln_pool_run(pool, n_tasks, pool_fn, &ctx);
            for (int i = 0; i < 64; i++)
                if (atomic_load(&hits[i]) != (i < n_tasks)) ok = 0;
            if (atomic_load(&ctx.bad)) ok = 0;
            if (rep % 500 == 0) { /* let the workers fall asleep sometimes */
                struct timespec ts = {0, 3000000};
                nanosleep(&ts, NULL);
            }
        }
        CHECK_MSG(ok, "pool with %d threads: some task not run exactly once", nt);
        kiln_pool_free(pool);
    }
    kiln_pool_free(NULL);
}

/* Random but valid blocks of type dt: n_rows rows of C elements. */
static void *rnd_weights(kiln_dtype dt, int64_t R, int64_t C, size_t *nbytes) {
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(dt);
    size_t nb = (size_t)(R * C / tr->block_size) * (size_t)tr->type_size;
    uint8_t *w = malloc(nb ? nb : 1);
    *nbytes = nb;
    for (size_t i = 0; i < nb; i++) w[i] = (uint8_t)rnd_u64();
    size_t n_blocks = nb / (size_t)tr->type_size;
    for (size_t b = 0; b < n_blocks; b++) {
        uint8_t *p = w + b * (size_t)tr->type_size;
        uint16_t h[2] = {kiln_fp32_to_fp16(rnd_f(-0.05f, 0.05f)),
                         kiln_fp32_to_fp16(rnd_f(-0.05f, 0.05f))};
        switch (dt) {
        case KILN_DTYPE_F32: { float f = rnd_f(-1, 1); memcpy(p, &f, 4); break; }
        case KILN_DTYPE_F16: h[0] = kiln_fp32_to_fp16(rnd_f(-1, 1)); memcpy(p, h, 2); break;
        case KILN_DTYPE_BF16: h[0] = kiln_fp32_to_bf16(rnd_f(-1, 1)); memcpy(p, h, 2); break;
        case KILN_DTYPE_Q8_0: case KILN_DTYPE_Q4_0: case KILN_DTYPE_Q5_0: memcpy(p, h, 2); break;
        case KILN_DTYPE_Q4_1: case KILN_DTYPE_Q5_1: case KILN_DTYPE_Q4_K: case KILN_DTYPE_Q5_K:
            memcpy(p, h, 4);
            break;
        case KILN_DTYPE_Q6_K: memcpy(p + 208, h, 2); break;
        default: break;
        }
    }
    return w;
}

static const kiln_dtype k_wtypes[] = {KILN_DTYPE_F32,  KILN_DTYPE_F16,  KILN_DTYPE_BF16,
                                      KILN_DTYPE_Q8_0, KILN_DTYPE_Q4_0, KILN_DTYPE_Q4_1,
                                      KILN_DTYPE_Q5_0, KILN_DTYPE_Q5_1, KILN_DTYPE_Q4_K,
                                      KILN_DTYPE_Q5_K, KILN_DTYPE_Q6_K};
#define N_WTYPES ((int)(sizeof k_wtypes / sizeof k_wtypes[0]))

static void test_matmul_case(kiln_dtype dt, int N, int64_t R, int64_t C, int with_bias) {
    size_t nbytes;
    void *wq = rnd_weights(dt, R, C, &nbytes);
    kiln_tensor W = {"w", dt, 2, {R, C, 1, 1}, wq, nbytes};
    float *wf = malloc((size_t)(R * C) * 4);
    kiln_dequantize(dt, wq, wf, R * C);
    kiln_tensor Wf = {"wf", KILN_DTYPE_F32, 2, {R, C, 1, 1}, wf, (size_t)(R * C) * 4};
    float *x = rnd_vec((size_t)(N * C), -1, 1);
    float *bias = with_bias ? rnd_vec((size_t)R, -1, 1) : NULL;
    size_t no = (size_t)N * (size_t)R;
    float *ref = malloc(no * 4), *out = malloc(no * 4);
    double max_err = 0;
    int tol_ok = 1;
    for (int n = 0; n < N; n++)
        for (int64_t r = 0; r < R; r++) {
            float s = def_dot(x + n * C, wf + r * C, C);
            if (bias) s = s + bias[r];
            ref[(size_t)n * R + r] = s;
            double d = bias ? bias[r] : 0, mag = bias ? fabs(bias[r]) : 0;
            for (int64_t c = 0; c < C; c++) {
                d += (double)x[n * C + c] * wf[r * C + c];
                mag += fabs((double)x[n * C + c] * wf[r * C + c]);
            }
            /* each lane sums about C/16 terms with one rounding each, then 4 tree levels */
            double tol = (double)(C / 16 + 6) * 6e-8 * mag + 1e-30;
            double e = fabs(d - s);
            if (e > tol) tol_ok = 0;
            if (mag > 0 && e / mag > max_err) max_err = e / mag;
        }
    CHECK_MSG(tol_ok, "%s N=%d R=%lld C=%lld: defined result off the float64 one (rel %g)",
              kiln_dtype_name(dt), N, (long long)R, (long long)C, max_err);
    for (int b = 0; b < g_n_be; b++) {
        poison(out, no);
        g_be[b]->i->matmul(g_be[b], out, x, &W, bias, N);
        CHECK_MSG(same_bits(out, ref, no, "matmul"), "%s: %s N=%d R=%lld C=%lld bias=%d",
                  g_be_name[b], kiln_dtype_name(dt), N, (long long)R, (long long)C, with_bias);
        poison(out, no);
        g_be[b]->i->matmul(g_be[b], out, x, &Wf, bias, N);
        CHECK_MSG(same_bits(out, ref, no, "matmul f32-of-dequantized"), "%s: %s N=%d R=%lld C=%lld",
                  g_be_name[b], kiln_dtype_name(dt), N, (long long)R, (long long)C);
    }
    free(wq), free(wf), free(x), free(bias), free(ref), free(out);
}

static void test_matmul(void) {
    for (int i = 0; i < N_WTYPES; i++) {
        kiln_dtype dt = k_wtypes[i];
        CHECK(g_be[0]->i->supports_op(g_be[0], KILN_OP_MATMUL, dt));
        int bs = kiln_dtype_get_traits(dt)->block_size;
        int64_t Cs_plain[] = {1, 7, 16, 33, 100, 576};
        int64_t Cs_32[] = {32, 96, 576, 1056}; /* 1056: 33 blocks, past two groups of 16 scales */
        int64_t Cs_256[] = {256, 512};
        const int64_t *Cs = bs == 1 ? Cs_plain : bs == 32 ? Cs_32 : Cs_256;
        int nC = bs == 1 ? 6 : bs == 32 ? 4 : 2;
        const int Ns[] = {1, 3, 4, 9, 70};
        const int64_t Rs[] = {1, 5, 13};
        for (int c = 0; c < nC; c++)
            for (int n = 0; n < 5; n++)
                for (int r = 0; r < 3; r++) {
                    if (Cs[c] >= 512 && Ns[n] == 70 && Rs[r] == 13 && bs != 1) continue;
                    test_matmul_case(dt, Ns[n], Rs[r], Cs[c], (c + n + r) % 2);
                }
    }
    CHECK(!g_be[0]->i->supports_op(g_be[0], KILN_OP_MATMUL, KILN_DTYPE_I32));
    /* rows longer than the AVX2 tile's step block (HALF_KBLOCK, 768): the sums wait between
     * blocks; a tail in the last block, several token tiles and row remainders */
    test_matmul_case(KILN_DTYPE_F32, 70, 7, 1000, 1);
    test_matmul_case(KILN_DTYPE_BF16, 9, 5, 1537, 0);
    test_matmul_case(KILN_DTYPE_F16, 4, 4, 2048, 1);
    /* one bigger case across the thread split (several 4-row chunks per thread) */
    test_matmul_case(KILN_DTYPE_Q4_1, 2, 203, 576, 0);
    test_matmul_case(KILN_DTYPE_Q8_0, 5, 97, 192, 1);
    /* block rows longer than the AVX-512 path's dequantized rows (8192): the block tile */
    test_matmul_case(KILN_DTYPE_Q4_0, 5, 6, 8224, 1);
}

static void test_embed(void) {
    for (int i = 0; i < N_WTYPES; i++) {
        kiln_dtype dt = k_wtypes[i];
        int bs = kiln_dtype_get_traits(dt)->block_size;
        int64_t V = 37, C = bs == 256 ? 512 : bs == 32 ? 96 : 13;
        size_t nbytes;
        void *wq = rnd_weights(dt, V, C, &nbytes);
        kiln_tensor T = {"emb", dt, 2, {V, C, 1, 1}, wq, nbytes};
        float *all = malloc((size_t)(V * C) * 4);
        kiln_dequantize(dt, wq, all, V * C);
        int N = 21;
        int32_t ids[21];
        for (int n = 0; n < N; n++) ids[n] = (int32_t)(rnd_u64() % (uint64_t)V);
        ids[0] = 0, ids[1] = (int32_t)V - 1;
        float *ref = malloc((size_t)(N * C) * 4), *out = malloc((size_t)(N * C) * 4);
        for (int n = 0; n < N; n++) memcpy(ref + n * C, all + ids[n] * C, (size_t)C * 4);
        for (int b = 0; b < g_n_be; b++) {
            poison(out, (size_t)(N * C));
            g_be[b]->i->embed(g_be[b], out, &T, ids, N);
            CHECK_MSG(same_bits(out, ref, (size_t)(N * C), "embed"), "%s %s", g_be_name[b],
                      kiln_dtype_name(dt));
        }
        free(wq), free(all), free(ref), free(out);
    }
}

static void test_rmsnorm(void) {
    const int Cs[] = {1, 7, 16, 576, 1000};
    const int Ns[] = {1, 5, 33};
    for (int ci = 0; ci < 5; ci++)
        for (int ni = 0; ni < 3; ni++)
            for (int wi = 0; wi < 2; wi++) {
                int C = Cs[ci], N = Ns[ni];
                size_t n = (size_t)N * C;
                float *x = rnd_vec(n, -3, 3), *w = wi ? rnd_vec((size_t)C, 0.5f, 1.5f) : NULL;
                float *ref = malloc(n * 4), *out = malloc(n * 4), *inpl = malloc(n * 4);
                float eps = 1e-5f;
                int tol_ok = 1;
                for (int t = 0; t < N; t++) {
                    const float *xr = x + t * C;
                    float r = 1.0f / sqrtf(def_dot(xr, xr, C) / (float)C + eps);
                    double ss = 0;
                    for (int c = 0; c < C; c++) ss += (double)xr[c] * xr[c];
                    double rd = 1.0 / sqrt(ss / C + eps);
                    for (int c = 0; c < C; c++) {
                        float v = xr[c] * r;
                        ref[t * C + c] = w ? v * w[c] : v;
                        double d = xr[c] * rd * (w ? w[c] : 1.0);
                        if (fabs(d - ref[t * C + c]) > 1e-6 * (fabs(d) + 1e-3)) tol_ok = 0;
                    }
                }
                CHECK_MSG(tol_ok, "rmsnorm C=%d N=%d: off the float64 result", C, N);
                for (int b = 0; b < g_n_be; b++) {
                    poison(out, n);
                    g_be[b]->i->rmsnorm(g_be[b], out, x, w, N, C, eps);
                    CHECK_MSG(same_bits(out, ref, n, "rmsnorm"), "%s C=%d N=%d w=%d", g_be_name[b], C, N, wi);
                    memcpy(inpl, x, n * 4);
                    g_be[b]->i->rmsnorm(g_be[b], inpl, inpl, w, N, C, eps);
                    CHECK_MSG(same_bits(inpl, ref, n, "rmsnorm in place"), "%s", g_be_name[b]);
                }
                free(x), free(w), free(ref), free(out), free(inpl);
            }
}

static void test_rope(void) {
    const int HSs[] = {2, 8, 64};
    for (int hi = 0; hi < 3; hi++) {
        int HS = HSs[hi], H = 3, N = 5, P = 40, half = HS / 2;
        float *ct = malloc((size_t)(P * half) * 4), *st = malloc((size_t)(P * half) * 4);
        for (int p = 0; p < P; p++)
            for (int i = 0; i < half; i++) {
                double th = p * pow(10000.0, -2.0 * i / HS);
                ct[p * half + i] = (float)cos(th);
                st[p * half + i] = (float)sin(th);
            }
        int32_t pos[5] = {0, 1, 7, 39, 20};
        size_t n = (size_t)N * H * HS;
        float *x = rnd_vec(n, -2, 2), *ref = malloc(n * 4), *out = malloc(n * 4);
        int tol_ok = 1;
        for (int t = 0; t < N; t++)
            for (int h = 0; h < H; h++)
                for (int i = 0; i < half; i++) {
                    size_t o = ((size_t)t * H + h) * HS;
                    float a = x[o + i], b = x[o + i + half];
                    float c = ct[pos[t] * half + i], s = st[pos[t] * half + i];
                    float pa = a * c, pb = b * s, qa = b * c, qb = a * s;
                    ref[o + i] = pa - pb;
                    ref[o + i + half] = qa + qb;
                    double da = (double)a * c - (double)b * s;
                    if (fabs(da - ref[o + i]) > 1e-6 * (fabs(a) + fabs(b))) tol_ok = 0;
                }
        CHECK(tol_ok);
        for (int b = 0; b < g_n_be; b++) {
            memcpy(out, x, n * 4);
            g_be[b]->i->rope(g_be[b], out, pos, N, H, HS, ct, st);
            CHECK_MSG(same_bits(out, ref, n, "rope"), "%s HS=%d", g_be_name[b], HS);
        }
        free(ct), free(st), free(x), free(ref), free(out);
    }
}

/* The online softmax exactly as docs/ARITHMETIC.md writes it, one (token, head) at a time. */
static void def_attention(float *out, const float *q, const float *k, const float *v, int N,
                          int n_past, int NH, int KVH, int HS, float scale, int window) {
    for (int i = 0; i < N; i++)
        for (int h = 0; h < NH; h++) {
            int kvh = h / (NH / KVH), T = n_past + i + 1;
            /* a sliding window: keys from lo on, the blocks still aligned at multiples of 64 */
            int lo = window > 0 && T > window ? T - window : 0;
            const float *qh = q + ((size_t)i * NH + h) * HS;
            float *acc = out + ((size_t)i * NH + h) * HS;
            float m = -INFINITY, l = 0;
            for (int d = 0; d < HS; d++) acc[d] = 0;
            for (int kb0 = lo / 64 * 64; kb0 < T; kb0 += 64) {
                int kb = kb0 > lo ? kb0 : lo, nk = (kb0 + 64 < T ? kb0 + 64 : T) - kb;
                float s[64];
                float bm = -INFINITY;
                for (int j = 0; j < nk; j++) {
                    s[j] = def_dot(qh, k + ((size_t)(kb + j) * KVH + kvh) * HS, HS) * scale;
                    if (s[j] > bm) bm = s[j];
                }
                float mn = bm > m ? bm : m;
                float alpha = kiln_expf(m - mn);
                l = l * alpha;
                for (int d = 0; d < HS; d++) acc[d] = acc[d] * alpha;
                for (int j = 0; j < nk; j++) {
                    float p = kiln_expf(s[j] - mn);
                    l = l + p;
                    const float *vj = v + ((size_t)(kb + j) * KVH + kvh) * HS;
                    for (int d = 0; d < HS; d++) acc[d] = fmaf(p, vj[d], acc[d]);
                }
                m = mn;
            }
            for (int d = 0; d < HS; d++) acc[d] = acc[d] / l;
        }
}

static void test_attention(void) {
    const int cfg[][6] = {/* N, n_past, NH, KVH, HS, sliding window */
                          {1, 0, 1, 1, 1, 0},    {1, 100, 9, 3, 64, 0}, {5, 60, 4, 2, 16, 0},
                          {70, 0, 2, 1, 33, 0},  {3, 130, 6, 6, 8, 0},  {17, 200, 8, 2, 64, 0},
                          {2, 63, 4, 4, 80, 0},  {1, 64, 3, 1, 15, 0},  {70, 0, 2, 1, 33, 5},
                          {17, 200, 8, 2, 64, 64}, {3, 130, 6, 6, 8, 100}, {9, 0, 2, 1, 8, 1},
                          /* more query heads a kv head than the CPU's group of 8 */
                          {3, 70, 20, 2, 16, 0},  {2, 90, 12, 1, 64, 0}, {40, 10, 10, 1, 24, 17}};
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        int N = cfg[c][0], n_past = cfg[c][1], NH = cfg[c][2], KVH = cfg[c][3], HS = cfg[c][4];
        int window = cfg[c][5];
        int T = n_past + N + 2; /* cache longer than needed: the extra keys must be ignored */
        float scale = 1.0f / sqrtf((float)HS);
        size_t nq = (size_t)N * NH * HS, nkv = (size_t)T * KVH * HS;
        float *q = rnd_vec(nq, -2, 2), *k = rnd_vec(nkv, -2, 2), *v = rnd_vec(nkv, -1, 1);
        float *ref = malloc(nq * 4), *out = malloc(nq * 4);
        def_attention(ref, q, k, v, N, n_past, NH, KVH, HS, scale, window);
        /* float64 oracle */
        int tol_ok = 1;
        double *sc = malloc(sizeof(double) * (size_t)T);
        for (int i = 0; i < N; i++)
            for (int h = 0; h < NH; h++) {
                int kvh = h / (NH / KVH), TT = n_past + i + 1;
                int lo = window > 0 && TT > window ? TT - window : 0;
                double mx = -1e300, sum = 0;
                for (int j = lo; j < TT; j++) {
                    double d = 0;
                    for (int e = 0; e < HS; e++)
                        d += (double)q[((size_t)i * NH + h) * HS + e] * k[((size_t)j * KVH + kvh) * HS + e];
                    sc[j] = d * scale;
                    if (sc[j] > mx) mx = sc[j];
                }
                for (int j = lo; j < TT; j++) sum += (sc[j] = exp(sc[j] - mx));
                for (int e = 0; e < HS; e++) {
                    double o = 0;
                    for (int j = lo; j < TT; j++) o += sc[j] / sum * v[((size_t)j * KVH + kvh) * HS + e];
                    if (fabs(o - ref[((size_t)i * NH + h) * HS + e]) > 2e-5) tol_ok = 0;
                }
            }
        free(sc);
        CHECK_MSG(tol_ok, "attention cfg %zu: off the float64 result", c);
        for (int b = 0; b < g_n_be; b++) {
            poison(out, nq);
            g_be[b]->i->attention(g_be[b], out, q, k, v, N, n_past, NH, KVH, HS, scale, window);
            CHECK_MSG(same_bits(out, ref, nq, "attention"), "%s cfg %zu", g_be_name[b], c);
        }
        free(q), free(k), free(v), free(ref), free(out);
    }
}

static void test_swiglu_add(void) {
    const size_t ns[] = {1, 7, 16, 1000, 70001};
    for (int i = 0; i < 5; i++) {
        size_t n = ns[i];
        float *g = rnd_vec(n, -20, 20), *u = rnd_vec(n, -2, 2);
        if (n > 10) g[3] = 120.0f, g[4] = -120.0f, g[5] = 0.0f, g[6] = -0.0f, g[7] = 88.9f;
        float *ref = malloc(n * 4), *out = malloc(n * 4), *ref_add = malloc(n * 4);
        int tol_ok = 1;
        for (size_t j = 0; j < n; j++) {
            ref[j] = (g[j] / (1.0f + kiln_expf(-g[j]))) * u[j];
            double d = (double)g[j] / (1.0 + exp(-(double)g[j])) * u[j];
            if (fabs(d - ref[j]) > 1e-6 * fabs(d) + 1e-37) tol_ok = 0;
            ref_add[j] = g[j] + u[j];
        }
        CHECK_MSG(tol_ok, "swiglu n=%zu: off the float64 result", n);
        for (int b = 0; b < g_n_be; b++) {
            poison(out, n);
            g_be[b]->i->swiglu(g_be[b], out, g, u, n);
            CHECK_MSG(same_bits(out, ref, n, "swiglu"), "%s n=%zu", g_be_name[b], n);
            memcpy(out, g, n * 4);
            g_be[b]->i->swiglu(g_be[b], out, out, u, n); /* out aliases gate */
            CHECK_MSG(same_bits(out, ref, n, "swiglu aliased"), "%s n=%zu", g_be_name[b], n);
            memcpy(out, g, n * 4);
            g_be[b]->i->add(g_be[b], out, u, n);
            CHECK_MSG(same_bits(out, ref_add, n, "add"), "%s n=%zu", g_be_name[b], n);
        }
        free(g), free(u), free(ref), free(out), free(ref_add);
    }
}

int main(void) {
    const kiln_cpu_features *f = kiln_cpu_get_features();
    printf("cpu: avx2 %d fma %d f16c %d avx512f %d bw %d vl %d; best path %s\n", f->avx2, f->fma,
           f->f16c, f->avx512f, f->avx512bw, f->avx512vl, kiln_cpu_path_name(kiln_cpu_best_path()));
    kiln_backend *bad = NULL;
    CHECK_ERR(kiln_backend_cpu_create(-1, &bad), KILN_ERR_INVALID_ARG, "n_threads");
    kiln_backend_free(NULL);
    make_backends();
    test_expf();
    test_kernels();
    test_threadpool();
    if (g_n_be > 0) {
        test_matmul();
        test_signed_zero_tails();
        test_embed();
        test_rmsnorm();
        test_rope();
        test_attention();
        test_swiglu_add();
    }
    for (int b = 0; b < g_n_be; b++) kiln_backend_free(g_be[b]);
    return test_finish("test_ops");
}
