/*
 * test_mx.c -- the exact block formats (src/ops/mx.h, docs/ARITHMETIC.md "Exact block formats
 * (mx8, mx16)"): the quantization rules on hand-made blocks (saturation, ties to even, zero
 * blocks, subnormals, NaN/Inf, K tails, the mx16 pieces), kiln_mx_round's edges, the
 * product's special cases, every SIMD path against the portable reference bit for bit over
 * many shapes and seeds, the same bits for 1, 2, 3 and 5 threads, and the argument checks.
 * tests/python/test_mx.py checks the reference itself against an exact oracle.
 */
#include "base/threadpool.h"
#include "ops/cpu/mx_kernels.h"
#include "ops/mx.h"
#include "ops/ops.h"
#include "test_util.h"

#include <float.h>
#include <math.h>

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}
static float rndu(void) {
    return (float)((rnd() >> 40) / 16777216.0) * 2.0f - 1.0f;
}

/* Quantize one row of K elements; the caller frees m. */
static kiln_mx_matrix quant_row(kiln_mx_kind kind, const float *a, int64_t K) {
    kiln_mx_matrix m;
    CHECK(kiln_mx_matrix_alloc(&m, kind, 1, K) == KILN_OK);
    CHECK(kiln_mx_quantize(&m, a, K, NULL) == KILN_OK);
    return m;
}

static int32_t mant(const kiln_mx_matrix *m, int64_t b, int i) {
    int32_t q;
    int e;
    kiln_mx_element(m, 0, b, i, &q, &e);
    return q;
}

static void test_quantize_rules(void) {
    float a[40] = {0};
    /* E = 0 (largest 1.5); quantum 2^-6: ties (k + 1/2) 2^-6 go to even k */
    a[0] = 1.5f;
    a[1] = 0.5f * 0x1p-6f;   /* 0.5 -> 0 */
    a[2] = 1.5f * 0x1p-6f;   /* 1.5 -> 2 */
    a[3] = 2.5f * 0x1p-6f;   /* 2.5 -> 2 */
    a[4] = -2.5f * 0x1p-6f;  /* -2.5 -> -2 */
    a[5] = -3.5f * 0x1p-6f;  /* -3.5 -> -4 */
    a[6] = 127.5f * 0x1p-6f; /* saturates to 127 */
    a[7] = -0x1.fffffep0f;   /* just below 2^(E+1): 127.99.. -> -127 */
    a[8] = 0x1p-149f;        /* far below the quantum: 0 */
    kiln_mx_matrix m = quant_row(KILN_MX8, a, 32);
    CHECK(m.e[0] == 0 && !m.row_nonfinite[0]);
    CHECK(mant(&m, 0, 0) == 96);
    CHECK(mant(&m, 0, 1) == 0 && mant(&m, 0, 2) == 2 && mant(&m, 0, 3) == 2);
    CHECK(mant(&m, 0, 4) == -2 && mant(&m, 0, 5) == -4);
    CHECK(mant(&m, 0, 6) == 127 && mant(&m, 0, 7) == -127 && mant(&m, 0, 8) == 0);
    kiln_mx_matrix_free(&m);
    /* mx16: quantum 2^-12, qmax 8191; the pieces */
    a[1] = 0.5f * 0x1p-12f;     /* 0 */
    a[2] = 1.5f * 0x1p-12f;     /* 2 */
    a[3] = 8191.5f * 0x1p-12f;  /* saturates to 8191 = 64*128 - 1 */
    a[4] = -8191.0f * 0x1p-12f; /* -8191 = -64*128 + 1 */
    a[5] = 64.0f * 0x1p-12f;    /* 64 = 1*128 - 64 */
    a[6] = 63.0f * 0x1p-12f;    /* 63 = 0*128 + 63 */
    a[7] = -65.0f * 0x1p-12f;   /* -65 = -1*128 + 63 */
    m = quant_row(KILN_MX16, a, 32);
    CHECK(m.e[0] == 0);
    CHECK(mant(&m, 0, 1) == 0 && mant(&m, 0, 2) == 2 && mant(&m, 0, 3) == 8191);
    CHECK(m.q[3] == 64 && m.lo[3] == -1 && m.q[4] == -64 && m.lo[4] == 1);
    CHECK(m.q[5] == 1 && m.lo[5] == -64 && m.q[6] == 0 && m.lo[6] == 63);
    CHECK(m.q[7] == -1 && m.lo[7] == 63);
    for (int i = 0; i < 32; i++)
        CHECK(m.lo[i] >= -64 && m.lo[i] <= 63 && m.q[i] >= -64 && m.q[i] <= 64);
    kiln_mx_matrix_free(&m);
    /* subnormals by their true exponent; a zero block; a K tail */
    memset(a, 0, sizeof a);
    a[0] = 0x1p-149f;
    a[1] = 0x1.8p-148f; /* 3 * 2^-149: E = -148 */
    a[33] = -0x1p-140f; /* block 1 (K = 34): E = -140, q = -64 */
    a[34] = 1e30f;      /* past K: never read */
    m = quant_row(KILN_MX8, a, 34);
    CHECK(m.nb == 2 && m.e[0] == -148 && m.e[1] == -140);
    CHECK(mant(&m, 0, 0) == 32 && mant(&m, 0, 1) == 96 && mant(&m, 1, 1) == -64);
    for (int i = 2; i < 32; i++)
        CHECK(mant(&m, 1, i) == 0); /* the padding */
    kiln_mx_matrix_free(&m);
    a[0] = a[1] = 0.0f;
    a[2] = -0.0f;
    m = quant_row(KILN_MX8, a, 34);
    CHECK(m.e[0] == KILN_MX_EXP_ZERO && m.e[1] == -140);
    kiln_mx_matrix_free(&m);
    /* NaN / Inf: the block is marked, the row too */
    a[40 - 8] = 1.0f;
    a[5] = INFINITY;
    m = quant_row(KILN_MX16, a, 34);
    CHECK(m.e[0] == KILN_MX_EXP_NONFINITE && m.row_nonfinite[0] == 1);
    kiln_mx_matrix_free(&m);
    a[5] = NAN;
    m = quant_row(KILN_MX8, a, 34);
    CHECK(m.e[0] == KILN_MX_EXP_NONFINITE && m.row_nonfinite[0] == 1);
    kiln_mx_matrix_free(&m);
    /* the largest f32 (E = 127) */
    a[5] = -FLT_MAX;
    m = quant_row(KILN_MX8, a, 34);
    CHECK(m.e[0] == 127 && mant(&m, 0, 5) == -127); /* 127.99.. saturates */
    kiln_mx_matrix_free(&m);
}

/* The SIMD block quantizer (cpu/mx_kernels.h) against the portable one, block by block: random
 * bit patterns (every exponent, subnormals, NaN, Inf), values spread over 2^-160 .. 2^130 with
 * zeros and negative zeros, exact ties at every fraction-bit position, and all-subnormal
 * blocks, for mx8 and mx16. */
static void test_quantize_simd(void) {
    kiln_mx_quantize_block_fn simd = kiln_mx_quantize_block_simd();
    if (!simd) {
        printf("test_mx: no SIMD block quantizer on this CPU (portable path): comparison skipped\n");
        return;
    }
    float a[KILN_MX_BLOCK];
    int32_t ref[KILN_MX_BLOCK], got[KILN_MX_BLOCK];
    int bad = 0;
    for (int it = 0; it < 200000 && bad < 5; it++) {
        const int kind = it % 5;
        for (int i = 0; i < KILN_MX_BLOCK; i++) {
            uint32_t u = (uint32_t)rnd();
            float v;
            if (kind == 0) { /* any bit pattern */
                memcpy(&v, &u, 4);
            } else if (kind == 1) { /* spread exponents, some zeros */
                v = u % 7 == 0 ? (u & 8 ? -0.0f : 0.0f) : ldexpf(rndu(), (int)(rnd() % 291) - 160);
            } else if (kind == 2) { /* one exponent region: ties and near-ties at the rounding point */
                const int F = it & 1 ? KILN_MX16_F : KILN_MX8_F, E = (int)(it % 250) - 140;
                int64_t q = (int64_t)(rnd() % (uint64_t)(1 << (F + 1)));
                int frac = (int)(rnd() % 4); /* 0: exact, 1: tie, 2/3: just off a tie */
                double x = ((double)q + (frac == 0 ? 0.0 : 0.5)) * ldexp(1.0, E - F);
                v = (float)x;
                if (frac >= 2) {
                    uint32_t b;
                    memcpy(&b, &v, 4);
                    b += frac == 2 ? 1 : (b & 0x7fffffu ? (uint32_t)-1 : 0);
                    memcpy(&v, &b, 4);
                }
                if (u & 1) v = -v;
                if (i == 0) v = (float)ldexp(u & 2 ? 1.5 : 1.0, E); /* the block's maximum sets E */
            } else if (kind == 3) { /* subnormals and the smallest normals */
                uint32_t b = (u & 0x80ffffffu) & (u & 4 ? 0x807fffffu : 0x80ffffffu);
                memcpy(&v, &b, 4);
            } else { /* ordinary activations */
                v = rndu() * 4.0f;
            }
            a[i] = v;
        }
        for (int f = 0; f < 2; f++) {
            const int F = f ? KILN_MX16_F : KILN_MX8_F;
            int16_t er = kiln_mx_quantize_block_ref(a, KILN_MX_BLOCK, F, ref);
            int16_t eg = simd(a, F, got);
            if (er != eg || memcmp(ref, got, sizeof ref)) {
                bad++;
                int i = 0;
                while (i < KILN_MX_BLOCK && ref[i] == got[i]) i++;
                printf("  block %d (kind %d, F %d): e %d / %d, first differing mantissa %d: %d / %d (a %a)\n", it, kind,
                       F, er, eg, i, i < KILN_MX_BLOCK ? ref[i] : 0, i < KILN_MX_BLOCK ? got[i] : 0,
                       i < KILN_MX_BLOCK ? (double)a[i] : 0.0);
            }
        }
    }
    CHECK(bad == 0);
}

static void test_round(void) {
    CHECK(bits(kiln_mx_round(0, 50)) == 0);
    CHECK(kiln_mx_round(1, 0) == 1.0f && kiln_mx_round(-3, -2) == -0.75f);
    CHECK(kiln_mx_round((1 << 24) + 1, 0) == 16777216.0f); /* tie to even */
    CHECK(kiln_mx_round((1 << 24) + 3, 0) == 16777220.0f);
    CHECK(kiln_mx_round(3, -150) == 0x1p-148f);             /* 1.5 2^-149: tie, to even (2) */
    CHECK(kiln_mx_round(5, -151) == 0x1p-149f);             /* 1.25 2^-149 */
    CHECK(bits(kiln_mx_round(1, -150)) == 0);               /* 0.5 2^-149: tie, to even (0) */
    CHECK(bits(kiln_mx_round(-1, -150)) == 0x80000000u);    /* -0 */
    CHECK(kiln_mx_round((1 << 24) - 1, -150) == 0x1p-126f); /* rounds up to the normal range */
    CHECK(kiln_mx_round((1 << 24) - 1, 104) == FLT_MAX);
    CHECK(isinf(kiln_mx_round((1 << 25) - 1, 103))); /* rounds up to 2^128 */
    CHECK(kiln_mx_round(-1, 128) == -INFINITY);
    CHECK(kiln_mx_round(INT64_MAX, -190) == 0x1p-127f);
}

/* Random (N, K) data of mixed kinds: normal rows at scales 2^-40..2^40, outlier elements,
 * zero blocks, subnormal blocks, exact zeros; optionally a NaN or Inf row. */
static void fill(float *a, int64_t rows, int64_t K, int specials) {
    for (int64_t j = 0; j < rows; j++) {
        float scale = ldexpf(1.0f, (int)(rnd() % 81) - 40);
        for (int64_t i = 0; i < K; i++) {
            float v = rndu() * scale;
            uint64_t c = rnd() % 100;
            if (c < 2)
                v *= 1000.0f;
            else if (c < 4)
                v = 0.0f;
            a[j * K + i] = v;
        }
        if (K >= 64 && rnd() % 4 == 0) memset(a + j * K + 32, 0, 32 * sizeof(float));
        if (K > 64 && rnd() % 5 == 0)
            for (int i = 0; i < 32; i++)
                a[j * K + i] = rndu() * 0x1p-135f;
        if (specials && rnd() % 7 == 0) a[j * K + rnd() % K] = rnd() % 2 ? NAN : -INFINITY;
    }
}

static void test_paths_and_threads(void) {
    kiln_pool *pools[4] = {NULL};
    const int threads[4] = {1, 2, 3, 5};
    for (int t = 0; t < 4; t++)
        CHECK(kiln_pool_create(threads[t], &pools[t]) == KILN_OK);
    const kiln_cpu_path paths[3] = {KILN_CPU_PATH_PORTABLE, KILN_CPU_PATH_AVX2,
                                    KILN_CPU_PATH_AVX512};
    /* the last three cross the AVX-512 kernel's passes: 128 rows of x, 32 blocks of K, tiles
     * of 16 rows of W with tails */
    int64_t shapes[][3] = {{1, 1, 1},    {1, 7, 31},    {2, 9, 32},   {3, 17, 33},
                           {4, 40, 64},  {5, 33, 100},  {8, 19, 257}, {1, 65, 512},
                           {7, 24, 896}, {3, 11, 1000}, {131, 37, 200}, {18, 33, 2080},
                           {257, 16, 1056}};
    for (int s = 0; s < 13; s++)
        for (int kind = 8; kind <= 16; kind += 8)
            for (int seed = 0; seed < 3; seed++) {
                int64_t N = shapes[s][0], R = shapes[s][1], K = shapes[s][2];
                float *x = malloc(sizeof(float) * (size_t)(N * K));
                float *w = malloc(sizeof(float) * (size_t)(R * K));
                float *ref = malloc(sizeof(float) * (size_t)(N * R));
                float *out = malloc(sizeof(float) * (size_t)(N * R));
                fill(x, N, K, seed == 2);
                fill(w, R, K, seed == 2);
                kiln_mx_matrix qx, qw;
                CHECK(kiln_mx_matrix_alloc(&qx, (kiln_mx_kind)kind, N, K) == KILN_OK);
                CHECK(kiln_mx_matrix_alloc(&qw, (kiln_mx_kind)kind, R, K) == KILN_OK);
                CHECK(kiln_mx_quantize(&qx, x, K, pools[2]) == KILN_OK);
                CHECK(kiln_mx_quantize(&qw, w, K, pools[1]) == KILN_OK);
                poison(ref, (size_t)(N * R));
                CHECK(kiln_mx_matmul_cpu(&qx, &qw, ref, R, NULL, KILN_CPU_PATH_PORTABLE) ==
                      KILN_OK);
                for (int64_t i = 0; i < N * R; i++) {
                    /* NaN exactly where a row holds a NaN or Inf, and then the canonical NaN */
                    int bad = qx.row_nonfinite[i / R] || qw.row_nonfinite[i % R];
                    CHECK(bad ? bits(ref[i]) == 0x7fc00000u : !isnan(ref[i]));
                }
                for (int p = 0; p < 3; p++)
                    for (int t = 0; t < 4; t++) {
                        poison(out, (size_t)(N * R));
                        CHECK(kiln_mx_matmul_cpu(&qx, &qw, out, R, pools[t], paths[p]) == KILN_OK);
                        char what[96];
                        snprintf(what, sizeof what, "mx%d %s %d threads N=%lld R=%lld K=%lld", kind,
                                 kiln_mx_kernel_name(paths[p]), threads[t], (long long)N,
                                 (long long)R, (long long)K);
                        CHECK_MSG(same_bits(out, ref, (size_t)(N * R), what), "%s", what);
                        /* out += the product: one f32 add to what out held */
                        float *want = malloc(sizeof(float) * (size_t)(N * R));
                        for (int64_t i = 0; i < N * R; i++) {
                            out[i] = (float)(i % 7) - 2.5f;
                            want[i] = out[i] + ref[i];
                        }
                        CHECK(kiln_mx_matmul_add_cpu(&qx, &qw, out, R, pools[t], paths[p]) == KILN_OK);
                        CHECK_MSG(same_bits(out, want, (size_t)(N * R), what), "add: %s", what);
                        free(want);
                    }
                /* the quantization too is independent of the thread count */
                kiln_mx_matrix q1;
                CHECK(kiln_mx_matrix_alloc(&q1, (kiln_mx_kind)kind, N, K) == KILN_OK);
                CHECK(kiln_mx_quantize(&q1, x, K, NULL) == KILN_OK);
                size_t plane = (size_t)(N * qx.nb * KILN_MX_BLOCK);
                CHECK(!memcmp(q1.q, qx.q, plane) && !memcmp(q1.e, qx.e, (size_t)(N * qx.nb) * 2));
                CHECK(kind == 8 || !memcmp(q1.lo, qx.lo, plane));
                kiln_mx_matrix_free(&q1);
                kiln_mx_matrix_free(&qx);
                kiln_mx_matrix_free(&qw);
                free(x), free(w), free(ref), free(out);
            }
    for (int t = 0; t < 4; t++)
        kiln_pool_free(pools[t]);
}

static void test_product_cases(void) {
    /* a zero row, and rows whose nonzero blocks never meet: +0 */
    float x[2 * 64] = {0}, w[2 * 64] = {0}, out[4];
    for (int i = 0; i < 32; i++)
        x[64 + i] = 1.0f, w[32 + i] = 2.0f, w[64 + i] = -1.0f;
    for (int kind = 8; kind <= 16; kind += 8) {
        kiln_mx_matrix qx, qw;
        CHECK(kiln_mx_matrix_alloc(&qx, (kiln_mx_kind)kind, 2, 64) == KILN_OK);
        CHECK(kiln_mx_matrix_alloc(&qw, (kiln_mx_kind)kind, 2, 64) == KILN_OK);
        CHECK(kiln_mx_quantize(&qx, x, 64, NULL) == KILN_OK);
        CHECK(kiln_mx_quantize(&qw, w, 64, NULL) == KILN_OK);
        for (int p = 0; p < 2; p++) {
            poison(out, 4);
            CHECK(kiln_mx_matmul_cpu(&qx, &qw, out, 2, NULL,
                                     p ? KILN_CPU_PATH_AVX2 : KILN_CPU_PATH_PORTABLE) == KILN_OK);
            CHECK(bits(out[0]) == 0 && bits(out[1]) == 0); /* x row 0 is zero */
            CHECK(bits(out[2]) == 0);                      /* disjoint blocks */
            CHECK(out[3] == -32.0f);                       /* exact: 32 * 1 * -1 */
        }
        kiln_mx_matrix_free(&qx);
        kiln_mx_matrix_free(&qw);
    }
}

/* Stochastic rounding: the hash's values (from tests/python/test_mx.py's independent
 * transcription), each q the floor or the ceiling of v, the same bits for any thread count,
 * a different seed or tensor id a different draw. */
static void test_stochastic(void) {
    CHECK(kiln_mx_random24(0, 0, 0) == 3407499u);
    CHECK(kiln_mx_random24(12345, 1, 77) == 14067452u);
    CHECK(kiln_mx_random24(UINT64_MAX, UINT64_C(1) << 63, (UINT64_C(1) << 40) + 5) == 1130339u);
    const int64_t rows = 7, K = 300;
    float *a = malloc(sizeof(float) * (size_t)(rows * K));
    fill(a, rows, K, 0);
    kiln_pool *pool = NULL;
    CHECK(kiln_pool_create(3, &pool) == KILN_OK);
    for (int kind = 8; kind <= 16; kind += 8) {
        kiln_mx_matrix m1, m3, mn, mo;
        CHECK(kiln_mx_matrix_alloc(&m1, (kiln_mx_kind)kind, rows, K) == KILN_OK);
        CHECK(kiln_mx_matrix_alloc(&m3, (kiln_mx_kind)kind, rows, K) == KILN_OK);
        CHECK(kiln_mx_matrix_alloc(&mn, (kiln_mx_kind)kind, rows, K) == KILN_OK);
        CHECK(kiln_mx_matrix_alloc(&mo, (kiln_mx_kind)kind, rows, K) == KILN_OK);
        CHECK(kiln_mx_quantize_stochastic(&m1, a, K, 99, 5, NULL) == KILN_OK);
        CHECK(kiln_mx_quantize_stochastic(&m3, a, K, 99, 5, pool) == KILN_OK);
        CHECK(kiln_mx_quantize_stochastic(&mo, a, K, 99, 6, pool) == KILN_OK);
        CHECK(kiln_mx_quantize(&mn, a, K, pool) == KILN_OK);
        size_t plane = (size_t)(rows * m1.nb * KILN_MX_BLOCK);
        CHECK(!memcmp(m1.q, m3.q, plane) && (kind == 8 || !memcmp(m1.lo, m3.lo, plane)));
        CHECK(!memcmp(m1.e, mn.e, (size_t)(rows * m1.nb) * 2)); /* the same exponents */
        int differ = 0;
        for (int64_t j = 0; j < rows; j++)
            for (int64_t b = 0; b < m1.nb; b++)
                for (int i = 0; i < KILN_MX_BLOCK; i++) {
                    int32_t qs, qn, qo;
                    int e;
                    kiln_mx_element(&m1, j, b, i, &qs, &e);
                    kiln_mx_element(&mn, j, b, i, &qn, &e);
                    kiln_mx_element(&mo, j, b, i, &qo, &e);
                    CHECK(qs - qn >= -1 &&
                          qs - qn <= 1); /* floor or ceil of v; RNE is one of them */
                    differ += qs != qo;
                }
        CHECK(differ > 100);
        kiln_mx_matrix_free(&m1);
        kiln_mx_matrix_free(&m3);
        kiln_mx_matrix_free(&mn);
        kiln_mx_matrix_free(&mo);
    }
    kiln_pool_free(pool);
    free(a);
}

/* Every allocation failing in turn: a clean KILN_ERR_NOMEM, the output untouched, nothing
 * leaked (the matrix's one block, the product's scratch on each path). */
static int g_fail_at, g_calls;
static void *failing_alloc(size_t size, void *user) {
    (void)user;
    if (++g_calls == g_fail_at) return NULL;
    return malloc(size);
}
static void plain_free(void *p, void *user) {
    (void)user;
    free(p);
}

static void test_alloc_failures(void) {
    kiln_allocator a = {failing_alloc, plain_free, NULL};
    CHECK(kiln_set_allocator(&a) == KILN_OK);
    float x[3 * 40], w[5 * 40], out[15];
    fill(x, 3, 40, 0);
    fill(w, 5, 40, 0);
    for (int kind = 8; kind <= 16; kind += 8)
        for (int p = 0; p < 3; p++) {
            kiln_mem_stats before, after;
            kiln_mem_get_stats(&before);
            int bad = 0;
            for (int n = 1; n <= 4; n++) {
                g_fail_at = n, g_calls = 0;
                kiln_mx_matrix qx, qw;
                memset(&qw, 0, sizeof qw);
                kiln_status st = kiln_mx_matrix_alloc(&qx, (kiln_mx_kind)kind, 3, 40);
                if (st == KILN_OK) st = kiln_mx_matrix_alloc(&qw, (kiln_mx_kind)kind, 5, 40);
                if (st == KILN_OK) st = kiln_mx_quantize(&qx, x, 40, NULL);
                if (st == KILN_OK) st = kiln_mx_quantize(&qw, w, 40, NULL);
                poison(out, 15);
                if (st == KILN_OK)
                    st = kiln_mx_matmul_cpu(&qx, &qw, out, 5, NULL, (kiln_cpu_path)p);
                /* the two matrices, then the SIMD kernels' scratch */
                int simd = strcmp(kiln_mx_kernel_name((kiln_cpu_path)p), "portable") != 0;
                int want_ok = n > 2 + simd;
                if (want_ok ? st != KILN_OK : st != KILN_ERR_NOMEM) bad++;
                if (!want_ok && n == 3 && !isnan(out[0])) bad++; /* out untouched */
                kiln_mx_matrix_free(&qx);
                kiln_mx_matrix_free(&qw);
                kiln_mem_get_stats(&after);
                if (after.live_blocks != before.live_blocks) bad++;
            }
            CHECK_MSG(bad == 0, "mx%d path %d: %d allocation failures mishandled", kind, p, bad);
        }
    g_fail_at = 0;
    kiln_set_allocator(NULL);
}

/* Properties of the definition: the blocks' order does not matter (the same permutation of
 * the K blocks of x and W gives the same bits), and scaling x by 2^a and W by 2^b scales every
 * output by exactly 2^(a+b) (away from the ends of the exponent range). */
static void test_properties(void) {
    const int64_t N = 3, R = 6, K = 320, nb = K / 32;
    float *x = malloc(sizeof(float) * (size_t)(N * K)),
          *w = malloc(sizeof(float) * (size_t)(R * K));
    float *xp = malloc(sizeof(float) * (size_t)(N * K)),
          *wp = malloc(sizeof(float) * (size_t)(R * K));
    float o1[18], o2[18];
    for (int kind = 8; kind <= 16; kind += 8)
        for (int trial = 0; trial < 4; trial++) {
            fill(x, N, K, 0);
            fill(w, R, K, 0);
            if (trial < 2) /* no subnormal inputs, so that the scaling check below applies */
                for (int64_t i = 0; i < (N > R ? N : R) * K; i++) {
                    if (i < N * K && x[i] != 0 && fabsf(x[i]) < 0x1p-100f) x[i] = 1.0f;
                    if (i < R * K && w[i] != 0 && fabsf(w[i]) < 0x1p-100f) w[i] = -1.0f;
                }
            int perm[10];
            for (int b = 0; b < nb; b++)
                perm[b] = b;
            for (int b = nb - 1; b > 0; b--) { /* Fisher-Yates */
                int c = (int)(rnd() % (uint64_t)(b + 1)), t = perm[b];
                perm[b] = perm[c], perm[c] = t;
            }
            for (int64_t j = 0; j < N; j++)
                for (int b = 0; b < nb; b++)
                    memcpy(xp + j * K + b * 32, x + j * K + perm[b] * 32, 32 * sizeof(float));
            for (int64_t j = 0; j < R; j++)
                for (int b = 0; b < nb; b++)
                    memcpy(wp + j * K + b * 32, w + j * K + perm[b] * 32, 32 * sizeof(float));
            kiln_mx_matrix qx, qw, qxp, qwp;
            CHECK(kiln_mx_matrix_alloc(&qx, (kiln_mx_kind)kind, N, K) == KILN_OK);
            CHECK(kiln_mx_matrix_alloc(&qw, (kiln_mx_kind)kind, R, K) == KILN_OK);
            CHECK(kiln_mx_matrix_alloc(&qxp, (kiln_mx_kind)kind, N, K) == KILN_OK);
            CHECK(kiln_mx_matrix_alloc(&qwp, (kiln_mx_kind)kind, R, K) == KILN_OK);
            CHECK(kiln_mx_quantize(&qx, x, K, NULL) == KILN_OK);
            CHECK(kiln_mx_quantize(&qw, w, K, NULL) == KILN_OK);
            CHECK(kiln_mx_quantize(&qxp, xp, K, NULL) == KILN_OK);
            CHECK(kiln_mx_quantize(&qwp, wp, K, NULL) == KILN_OK);
            CHECK(kiln_mx_matmul_cpu(&qx, &qw, o1, R, NULL, kiln_cpu_best_path()) == KILN_OK);
            CHECK(kiln_mx_matmul_cpu(&qxp, &qwp, o2, R, NULL, kiln_cpu_best_path()) == KILN_OK);
            CHECK(same_bits(o1, o2, 18, "permuted blocks"));
            /* 2^a x, 2^b W: rescale from the originals (scales within 2^+-40 of fill's) */
            int sa = (int)(rnd() % 41) - 20, sb = (int)(rnd() % 41) - 20;
            for (int64_t i = 0; i < N * K; i++)
                xp[i] = ldexpf(x[i], sa);
            for (int64_t i = 0; i < R * K; i++)
                wp[i] = ldexpf(w[i], sb);
            /* keep away from subnormal inputs, whose exponents do not shift with the scale */
            int normal = 1;
            for (int64_t i = 0; i < N * K; i++)
                normal &= x[i] == 0 || fabsf(x[i]) >= 0x1p-100f;
            for (int64_t i = 0; i < R * K; i++)
                normal &= w[i] == 0 || fabsf(w[i]) >= 0x1p-100f;
            CHECK(kiln_mx_quantize(&qxp, xp, K, NULL) == KILN_OK);
            CHECK(kiln_mx_quantize(&qwp, wp, K, NULL) == KILN_OK);
            CHECK(kiln_mx_matmul_cpu(&qxp, &qwp, o2, R, NULL, kiln_cpu_best_path()) == KILN_OK);
            CHECK(trial >= 2 || normal);
            for (int i = 0; i < 18 && normal; i++) {
                float want = ldexpf(o1[i], sa + sb);
                int exact =
                    fabsf(o1[i]) >= 0x1p-80f && fabsf(o1[i]) <= 0x1p80f; /* normal both ways */
                CHECK_MSG(!exact || bits(o2[i]) == bits(want), "scaled: %g vs %g", o2[i], want);
            }
            kiln_mx_matrix_free(&qx);
            kiln_mx_matrix_free(&qw);
            kiln_mx_matrix_free(&qxp);
            kiln_mx_matrix_free(&qwp);
        }
    /* the path advice: AVX2 for few rows of x, else the selected path */
    CHECK(kiln_mx_select_path(KILN_MX_VNNI_MIN_N) == kiln_cpu_select_path());
    CHECK(kiln_mx_select_path(1) != KILN_CPU_PATH_AVX512);
    /* K = 0: every output +0 */
    kiln_mx_matrix a, b;
    CHECK(kiln_mx_matrix_alloc(&a, KILN_MX16, 2, 0) == KILN_OK);
    CHECK(kiln_mx_matrix_alloc(&b, KILN_MX16, 3, 0) == KILN_OK);
    CHECK(kiln_mx_quantize(&a, NULL, 0, NULL) == KILN_OK);
    CHECK(kiln_mx_quantize(&b, NULL, 0, NULL) == KILN_OK);
    for (int p = 0; p < 3; p++) {
        poison(o1, 6);
        CHECK(kiln_mx_matmul_cpu(&a, &b, o1, 3, NULL, (kiln_cpu_path)p) == KILN_OK);
        for (int i = 0; i < 6; i++)
            CHECK(bits(o1[i]) == 0);
    }
    kiln_mx_matrix_free(&a);
    kiln_mx_matrix_free(&b);
    free(x), free(w), free(xp), free(wp);
}

static void test_errors(void) {
    kiln_mx_matrix a, b;
    CHECK_ERR(kiln_mx_matrix_alloc(&a, KILN_MX8, 1, KILN_MX_MAX_K + 1), KILN_ERR_INVALID_ARG, "K");
    CHECK(a.mem == NULL);
    CHECK_ERR(kiln_mx_matrix_alloc(&a, (kiln_mx_kind)4, 1, 32), KILN_ERR_INVALID_ARG, "kind");
    CHECK(kiln_mx_matrix_alloc(&a, KILN_MX8, 2, 64) == KILN_OK);
    CHECK(kiln_mx_matrix_alloc(&b, KILN_MX16, 3, 64) == KILN_OK);
    float out[6];
    CHECK_ERR(kiln_mx_matmul_cpu(&a, &b, out, 3, NULL, KILN_CPU_PATH_PORTABLE),
              KILN_ERR_INVALID_ARG, "mx8");
    float x[128] = {0};
    CHECK_ERR(kiln_mx_quantize(&a, x, 32, NULL), KILN_ERR_INVALID_ARG, "lda");
    kiln_mx_matrix_free(&b);
    CHECK(kiln_mx_matrix_alloc(&b, KILN_MX8, 3, 64) == KILN_OK);
    CHECK_ERR(kiln_mx_matmul_cpu(&a, &b, out, 2, NULL, KILN_CPU_PATH_PORTABLE),
              KILN_ERR_INVALID_ARG, "ldo");
    kiln_mx_matrix_free(&a);
    kiln_mx_matrix_free(&a); /* freeing twice (zeroed) is a no-op */
    kiln_mx_matrix_free(&b);
    kiln_mx_matrix_free(NULL);
    /* the largest K: allowed */
    CHECK(kiln_mx_matrix_alloc(&a, KILN_MX16, 1, KILN_MX_MAX_K) == KILN_OK);
    kiln_mx_matrix_free(&a);
}

/* The CPU backend in an exact format's mode: matmul_backward (the trainer's products) equals its
 * definition -- dx = mx(dy, W^T) along R, dW += mx(dy^T, x^T) along N, each one mx product
 * (kiln_mx_matmul_cpu on operands quantized here) then f32 adds -- bit for bit, with
 * accumulation, for f32 and bf16 weights, 1 and 2 threads; and stays close to the exact f32
 * backward (mx16: 1e-3 relative, mx8: 5e-2). */
static void transpose(float *t, const float *a, int64_t rows, int64_t cols) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) t[j * rows + i] = a[i * cols + j];
}

static double rel_err(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

static void test_backend_backward(void) {
    const int N = 37, R = 45, C = 70;
    float *dy = malloc(sizeof(float) * N * R), *x = malloc(sizeof(float) * N * C), *w = malloc(sizeof(float) * R * C);
    float *t1 = malloc(sizeof(float) * R * C * 4), *t2 = malloc(sizeof(float) * R * C * 4);
    float *dx = malloc(sizeof(float) * N * C), *dW = malloc(sizeof(float) * R * C);
    float *ex_dx = malloc(sizeof(float) * N * C), *ex_dW = malloc(sizeof(float) * R * C);
    float *f_dx = malloc(sizeof(float) * N * C), *f_dW = malloc(sizeof(float) * R * C);
    uint16_t *w16 = malloc(2 * (size_t)R * C);
    for (int i = 0; i < N * R; i++) dy[i] = rndu() * 0.01f;
    for (int i = 0; i < N * C; i++) x[i] = rndu() * 3.0f;
    for (int i = 0; i < R * C; i++) w[i] = rndu() * 0.2f;
    for (int i = 0; i < R * C; i++) {
        uint32_t u;
        memcpy(&u, &w[i], 4);
        w16[i] = (uint16_t)(u >> 16);
    }
    kiln_backend *exact = NULL;
    CHECK(kiln_backend_cpu_create_mode(2, 0, &exact) == KILN_OK);
    for (int kind = 0; kind < 2; kind++)
        for (int bf = 0; bf < 2; bf++)
            for (int threads = 1; threads <= 2; threads++) {
                const kiln_mx_kind k = kind ? KILN_MX8 : KILN_MX16;
                kiln_backend *be = NULL;
                CHECK(kiln_backend_cpu_create_mode(threads, kind ? KILN_MODE_MX8 : KILN_MODE_MX16, &be) == KILN_OK);
                if (!be) continue;
                kiln_tensor W = {0};
                W.n_dims = 2;
                W.shape[0] = R;
                W.shape[1] = C;
                W.shape[2] = W.shape[3] = 1;
                W.dtype = bf ? KILN_DTYPE_BF16 : KILN_DTYPE_F32;
                W.data = bf ? (void *)w16 : (void *)w;
                W.nbytes = (size_t)R * C * (bf ? 2 : 4);
                W.name = "w";
                /* the weights as the format sees them (bf16: widened) */
                float *wv = malloc(sizeof(float) * R * C);
                for (int i = 0; i < R * C; i++) {
                    uint32_t u = (uint32_t)w16[i] << 16;
                    float f;
                    memcpy(&f, &u, 4);
                    wv[i] = bf ? f : w[i];
                }
                for (int i = 0; i < N * C; i++) dx[i] = ex_dx[i] = 0.5f;
                for (int i = 0; i < R * C; i++) dW[i] = ex_dW[i] = -0.25f;
                be->i->matmul_backward(be, dx, dW, NULL, dy, x, &W, N, true);
                CHECK(be->i->status(be) == KILN_OK);
                /* the definition */
                kiln_mx_matrix a, b;
                transpose(t1, wv, R, C); /* W^T (C, R) */
                CHECK(kiln_mx_matrix_alloc(&a, k, N, R) == KILN_OK && kiln_mx_quantize(&a, dy, R, NULL) == KILN_OK);
                CHECK(kiln_mx_matrix_alloc(&b, k, C, R) == KILN_OK && kiln_mx_quantize(&b, t1, R, NULL) == KILN_OK);
                CHECK(kiln_mx_matmul_cpu(&a, &b, t2, C, NULL, KILN_CPU_PATH_PORTABLE) == KILN_OK);
                for (int i = 0; i < N * C; i++) ex_dx[i] = ex_dx[i] + t2[i];
                kiln_mx_matrix_free(&a);
                kiln_mx_matrix_free(&b);
                transpose(t1, dy, N, R);
                transpose(t1 + R * N, x, N, C);
                CHECK(kiln_mx_matrix_alloc(&a, k, R, N) == KILN_OK && kiln_mx_quantize(&a, t1, N, NULL) == KILN_OK);
                CHECK(kiln_mx_matrix_alloc(&b, k, C, N) == KILN_OK && kiln_mx_quantize(&b, t1 + R * N, N, NULL) == KILN_OK);
                CHECK(kiln_mx_matmul_cpu(&a, &b, t2, C, NULL, KILN_CPU_PATH_PORTABLE) == KILN_OK);
                for (int i = 0; i < R * C; i++) ex_dW[i] = ex_dW[i] + t2[i];
                kiln_mx_matrix_free(&a);
                kiln_mx_matrix_free(&b);
                CHECK_MSG(memcmp(dx, ex_dx, sizeof(float) * N * C) == 0, "mx%d bf16 %d threads %d: dx", k, bf, threads);
                CHECK_MSG(memcmp(dW, ex_dW, sizeof(float) * R * C) == 0, "mx%d bf16 %d threads %d: dW", k, bf, threads);
                /* near the exact f32 backward */
                for (int i = 0; i < N * C; i++) f_dx[i] = 0.5f;
                for (int i = 0; i < R * C; i++) f_dW[i] = -0.25f;
                exact->i->matmul_backward(exact, f_dx, f_dW, NULL, dy, x, &W, N, true);
                for (int i = 0; i < N * C; i++) f_dx[i] -= 0.5f, dx[i] -= 0.5f;
                for (int i = 0; i < R * C; i++) f_dW[i] += 0.25f, dW[i] += 0.25f;
                const double bound = kind ? 5e-2 : 1e-3, ex = rel_err(dx, f_dx, N * C), ew = rel_err(dW, f_dW, R * C);
                CHECK_MSG(ex < bound && ew < bound, "mx%d bf16 %d: relative errors dx %.2e dW %.2e", k, bf, ex, ew);
                if (threads == 1 && !bf) printf("backward mx%d: relative error dx %.2e, dW %.2e\n", k, ex, ew);
                free(wv);
                kiln_backend_free(be);
            }
    kiln_backend_free(exact);
    free(dy), free(x), free(w), free(t1), free(t2), free(dx), free(dW), free(ex_dx), free(ex_dW), free(f_dx);
    free(f_dW), free(w16);
}

int main(void) {
    test_backend_backward();
    test_quantize_rules();
    test_quantize_simd();
    test_round();
    test_product_cases();
    test_paths_and_threads();
    test_stochastic();
    test_properties();
    test_errors();
    test_alloc_failures();
    printf("test_mx: %d checks, %d failures (kernels: %s)\n", t_checks, t_failures,
           kiln_mx_kernel_name(kiln_cpu_best_path()));
    return t_failures ? 1 : 0;
}
