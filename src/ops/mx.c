/*
 * mx.c -- the exact block formats' storage, quantization and final rounding (mx.h;
 * docs/ARITHMETIC.md, "Exact block formats (mx8, mx16)").
 *
 * Quantization is integer arithmetic on the f32 bit patterns: an element is m * 2^x with m an
 * integer below 2^24, and q = round_half_even(m * 2^(x + F - E)) is a shift with a remainder,
 * so no floating-point rounding mode, flush-to-zero setting or range of 2^(F - E) (which
 * can exceed f32's: F - E reaches 161) is involved. Full blocks rounded to nearest even take
 * the CPU's SIMD form of the same integer steps (cpu/mx_kernels.h, the bits of this file's,
 * checked by tests/c/test_mx.c); tails and stochastic rounding take this file's.
 */
#include "mx.h"
#include "cpu/mx_kernels.h"

#include <math.h>
#include <string.h>

static int64_t mx_nb(int64_t K) {
    return (K + KILN_MX_BLOCK - 1) / KILN_MX_BLOCK;
}

kiln_status kiln_mx_matrix_alloc(kiln_mx_matrix *m, kiln_mx_kind kind, int64_t rows, int64_t K) {
    memset(m, 0, sizeof *m);
    if (kind != KILN_MX8 && kind != KILN_MX16)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_mx_matrix_alloc: kind %d is not mx8 or mx16",
                          (int)kind);
    if (rows < 0 || K < 0 || K > KILN_MX_MAX_K)
        return kiln_error(KILN_ERR_INVALID_ARG,
                          "kiln_mx_matrix_alloc: rows %lld, K %lld (need rows >= 0, 0 <= K <= %d)",
                          (long long)rows, (long long)K, KILN_MX_MAX_K);
    int64_t nb = mx_nb(K);
    /* planes first (multiples of 32 bytes per row keep every array aligned), then e, flags */
    size_t plane = 0, n_planes = kind == KILN_MX16 ? 2 : 1, eb = 0, total = 0, t = 0;
    if (kiln_mul_overflow((size_t)rows, (size_t)nb * sizeof(int16_t), &eb) ||
        kiln_mul_overflow((size_t)rows, (size_t)nb * KILN_MX_BLOCK, &plane) ||
        kiln_mul_overflow(plane, n_planes, &t) || kiln_add_overflow(t, eb, &total) ||
        kiln_add_overflow(total, (size_t)rows + 1, &total))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_mx_matrix_alloc: %lld x %lld overflows",
                          (long long)rows, (long long)K);
    uint8_t *mem = kiln_calloc(1, total);
    if (!mem)
        return kiln_error(KILN_ERR_NOMEM, "kiln_mx_matrix_alloc: %zu bytes for %lld x %lld", total,
                          (long long)rows, (long long)K);
    m->kind = kind;
    m->rows = rows;
    m->K = K;
    m->nb = nb;
    m->mem = mem;
    m->q = (int8_t *)mem;
    m->lo = kind == KILN_MX16 ? (int8_t *)(mem + plane) : NULL;
    m->e = (int16_t *)(mem + plane * n_planes);
    m->row_nonfinite = mem + plane * n_planes + eb;
    return KILN_OK;
}

void kiln_mx_matrix_free(kiln_mx_matrix *m) {
    if (!m) return;
    kiln_free(m->mem);
    memset(m, 0, sizeof *m);
}

/* ---- one block ---------------------------------------------------------------------------- */

/* The f32 a as sign, m and x with |a| = m 2^x, m < 2^24 an integer (m = 0 for +-0). */
static void f32_split(float a, int *neg, uint32_t *m, int *x) {
    uint32_t u;
    memcpy(&u, &a, 4);
    uint32_t ef = (u >> 23) & 0xff, fr = u & 0x7fffff;
    *neg = (int)(u >> 31);
    *m = ef ? (fr | 0x800000u) : fr;
    *x = ef ? (int)ef - 150 : -149;
}

/* round_half_even(m 2^-t) for t >= 1 (m < 2^24). */
static uint32_t rne_shift(uint32_t m, int t) {
    if (t >= 26) return 0; /* m 2^-t < 2^-2 */
    uint32_t q = m >> t, rem = m & ((1u << t) - 1), half = 1u << (t - 1);
    if (rem > half || (rem == half && (q & 1))) q++;
    return q;
}

/* ---- the stochastic rounding's random numbers ------------------------------------------- */

/* splitmix64's finalizer (Steele, Lea, Flood 2014): a bijection of 64-bit words. */
static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

uint32_t kiln_mx_random24(uint64_t seed, uint64_t tensor_id, uint64_t index) {
    uint64_t h = mix64(seed + UINT64_C(0x9e3779b97f4a7c15));
    h = mix64(h ^ tensor_id);
    h = mix64(h ^ index);
    return (uint32_t)(h >> 40);
}

uint64_t kiln_mx_backward_key(uint64_t seed, uint64_t step, uint64_t micro) {
    return mix64(mix64(mix64(seed + UINT64_C(0x6a09e667f3bcc908)) ^ step) ^ micro);
}

/* How a block's mantissas are rounded: to nearest even, or stochastically with the random
 * numbers of (seed, tensor_id, index0 + i) for element i. */
typedef struct mx_rounding {
    int stochastic;
    uint64_t seed, tensor_id, index0;
} mx_rounding;

/* Quantize one block of n <= 32 elements (the rest are +0) with F fraction bits into the
 * mantissas mant[0..31] (|mant| <= 2^(F+1) - 1); returns the block's e field. */
static int16_t quantize_block(const float *a, int n, int F, const mx_rounding *rd,
                              int32_t mant[KILN_MX_BLOCK]) {
    uint32_t amax_bits = 0;
    for (int i = 0; i < KILN_MX_BLOCK; i++)
        mant[i] = 0;
    for (int i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &a[i], 4);
        u &= 0x7fffffffu;
        if (u >= 0x7f800000u) return KILN_MX_EXP_NONFINITE;
        if (u > amax_bits) amax_bits = u; /* finite magnitudes order as their bit patterns */
    }
    if (amax_bits == 0) return KILN_MX_EXP_ZERO;
    /* E = ilogb of the largest magnitude, subnormals by their true exponent */
    int E;
    if (amax_bits >= 0x800000u)
        E = (int)(amax_bits >> 23) - 127;
    else
        E = (31 - __builtin_clz(amax_bits)) - 149;
    const int32_t qmax = (1 << (F + 1)) - 1;
    for (int i = 0; i < n; i++) {
        int neg, x;
        uint32_t m;
        f32_split(a[i], &neg, &m, &x);
        if (!m) continue;
        int sh = x + F - E; /* q = m 2^sh before rounding; m 2^sh < 2^(F+1) */
        if (rd->stochastic) {
            /* q = floor(v + u 2^-24) = floor((floor(v 2^24) + u) / 2^24), v = +-m 2^sh, exact */
            int64_t sv = neg ? -(int64_t)m : (int64_t)m;
            int64_t V =
                sh + 24 >= 0 ? sv * ((int64_t)1 << (sh + 24)) : kiln_mx_floor_shift(sv, -(sh + 24));
            uint32_t u = kiln_mx_random24(rd->seed, rd->tensor_id, rd->index0 + (uint64_t)i);
            int64_t q = kiln_mx_floor_shift(V + (int64_t)u, 24);
            mant[i] = (int32_t)(q > qmax ? qmax : q < -qmax ? -qmax : q);
            continue;
        }
        uint32_t q = sh >= 0 ? m << sh : rne_shift(m, -sh);
        if (q > (uint32_t)qmax) q = (uint32_t)qmax; /* [qmax + 1/2, qmax + 1) saturates */
        mant[i] = neg ? -(int32_t)q : (int32_t)q;
    }
    return (int16_t)E;
}

int16_t kiln_mx_quantize_block_ref(const float *a, int n, int F, int32_t mant[KILN_MX_BLOCK]) {
    const mx_rounding rd = {0, 0, 0, 0};
    return quantize_block(a, n, F, &rd, mant);
}

typedef struct quant_job {
    kiln_mx_matrix *m;
    const float *a;
    int64_t lda, rows_per_task;
    mx_rounding rd; /* index0 unused: set per block */
    kiln_mx_quantize_block_fn simd; /* full blocks to nearest even (NULL: the portable code) */
} quant_job;

static void quant_task(void *ctx, int task, int thread) {
    (void)thread;
    const quant_job *j = ctx;
    kiln_mx_matrix *m = j->m;
    const int F = m->kind == KILN_MX8 ? KILN_MX8_F : KILN_MX16_F;
    int64_t r0 = (int64_t)task * j->rows_per_task, r1 = r0 + j->rows_per_task;
    if (r1 > m->rows) r1 = m->rows;
    int32_t mant[KILN_MX_BLOCK];
    for (int64_t r = r0; r < r1; r++) {
        uint8_t bad = 0;
        for (int64_t b = 0; b < m->nb; b++) {
            int64_t k0 = b * KILN_MX_BLOCK;
            int n = m->K - k0 < KILN_MX_BLOCK ? (int)(m->K - k0) : KILN_MX_BLOCK;
            int16_t e;
            if (j->simd && n == KILN_MX_BLOCK) {
                e = j->simd(j->a + r * j->lda + k0, F, mant);
            } else {
                mx_rounding rd = j->rd;
                rd.index0 = (uint64_t)r * (uint64_t)m->K + (uint64_t)k0; /* the element's index */
                e = quantize_block(j->a + r * j->lda + k0, n, F, &rd, mant);
            }
            size_t o = (size_t)(r * m->nb + b);
            m->e[o] = e;
            bad |= e == KILN_MX_EXP_NONFINITE;
            int8_t *q = m->q + o * KILN_MX_BLOCK;
            if (m->kind == KILN_MX8) {
                for (int i = 0; i < KILN_MX_BLOCK; i++)
                    q[i] = (int8_t)mant[i];
            } else {
                /* q = hi 128 + lo, lo in [-64, 63]: hi = floor((q + 64) / 128), written with a
                 * nonnegative dividend (q + 64 + 8192 > 0) so no signed shift is involved */
                int8_t *lo = m->lo + o * KILN_MX_BLOCK;
                for (int i = 0; i < KILN_MX_BLOCK; i++) {
                    int32_t hi = (mant[i] + 64 + 8192) / 128 - 64;
                    q[i] = (int8_t)hi;
                    lo[i] = (int8_t)(mant[i] - hi * 128);
                }
            }
        }
        m->row_nonfinite[r] = bad;
    }
}

static kiln_status quantize(kiln_mx_matrix *m, const float *a, int64_t lda, const mx_rounding *rd,
                            kiln_pool *pool) {
    if (!m || (m->kind != KILN_MX8 && m->kind != KILN_MX16) || (!m->mem && m->rows > 0))
        return kiln_error(KILN_ERR_INVALID_ARG,
                          "kiln_mx_quantize: m is not an allocated mx matrix");
    if (m->rows == 0 || m->K == 0) {
        for (int64_t r = 0; r < m->rows; r++)
            m->row_nonfinite[r] = 0;
        for (int64_t i = 0; i < m->rows * m->nb; i++)
            m->e[i] = KILN_MX_EXP_ZERO;
        return KILN_OK;
    }
    if (!a) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_mx_quantize: a is NULL");
    if (lda < m->K)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_mx_quantize: lda %lld < K %lld",
                          (long long)lda, (long long)m->K);
    int n_tasks = 4 * kiln_pool_n_threads(pool);
    if (n_tasks > m->rows) n_tasks = (int)m->rows;
    quant_job j = {m, a, lda, (m->rows + n_tasks - 1) / n_tasks, *rd, rd->stochastic ? NULL : kiln_mx_quantize_block_simd()};
    n_tasks = (int)((m->rows + j.rows_per_task - 1) / j.rows_per_task);
    kiln_pool_run(pool, n_tasks, quant_task, &j);
    return KILN_OK;
}

kiln_status kiln_mx_quantize(kiln_mx_matrix *m, const float *a, int64_t lda, kiln_pool *pool) {
    mx_rounding rd = {0, 0, 0, 0};
    return quantize(m, a, lda, &rd, pool);
}

kiln_status kiln_mx_quantize_stochastic(kiln_mx_matrix *m, const float *a, int64_t lda,
                                        uint64_t seed, uint64_t tensor_id, kiln_pool *pool) {
    mx_rounding rd = {1, seed, tensor_id, 0};
    return quantize(m, a, lda, &rd, pool);
}

void kiln_mx_element(const kiln_mx_matrix *m, int64_t j, int64_t b, int i, int32_t *mant,
                     int *exp2) {
    size_t o = (size_t)(j * m->nb + b);
    int16_t e = m->e[o];
    const int F = m->kind == KILN_MX8 ? KILN_MX8_F : KILN_MX16_F;
    if (e == KILN_MX_EXP_ZERO || e == KILN_MX_EXP_NONFINITE) {
        *mant = 0;
        *exp2 = 0;
        return;
    }
    int32_t q = m->q[o * KILN_MX_BLOCK + (size_t)i];
    if (m->kind == KILN_MX16) q = q * 128 + m->lo[o * KILN_MX_BLOCK + (size_t)i];
    *mant = q;
    *exp2 = e - F;
}

/* ---- the one rounding ------------------------------------------------------------------- */

/* round_half_even(v 2^-t) for 1 <= t (v < 2^63). */
static uint64_t rne_shift64(uint64_t v, int t) {
    if (t >= 64) return 0; /* v 2^-t < 1/2 */
    uint64_t q = v >> t, rem = v & ((UINT64_C(1) << t) - 1), half = UINT64_C(1) << (t - 1);
    if (rem > half || (rem == half && (q & 1))) q++;
    return q;
}

/* kiln_mx_round (mx.h) for every S and p; the inline entry takes the common case itself. */
float kiln_mx_round_general(int64_t S, int p) {
    if (S == 0) return 0.0f;
    if (p >= -126 && p <= 63) {
        /* (float)S (one RNE rounding) is in [1, 2^63], so (float)S 2^p is normal and finite:
         * the multiply is exact. The same bits as the general path below, sooner. */
        union {
            uint32_t u;
            float f;
        } two_p = {(uint32_t)(p + 127) << 23};
        return (float)S * two_p.f;
    }
    int neg = S < 0;
    uint64_t mag = neg ? (uint64_t)0 - (uint64_t)S : (uint64_t)S;
    int msb = 63 - __builtin_clzll(mag);
    float r;
    if (msb + p >= -126) {
        /* normal (or overflowing) result: 24 significant bits, then an exact scaling */
        uint64_t m = mag;
        int t = 0;
        if (msb > 23) {
            t = msb - 23;
            m = rne_shift64(mag, t); /* may carry to 2^24: still exact in f32 */
        }
        int top = 63 - __builtin_clzll(m);
        if (top + t + p >= 128)
            r = INFINITY;
        else
            r = ldexpf((float)m, t + p); /* exact: m < 2^25, result normal */
    } else {
        /* subnormal result: a multiple of 2^-149, rounded once at that precision */
        int sh = p + 149;
        uint64_t m = sh >= 0 ? mag << sh : rne_shift64(mag, -sh); /* m <= 2^23 */
        r = ldexpf((float)m, -149);                               /* exact */
    }
    return neg ? -r : r;
}
