/*
 * kernels_avx512.c -- the AVX-512 (F, BW, VL) + FMA + F16C path. Same bits as
 * kernels_portable.c.
 *
 * The 16 lane accumulators of the defined dot are exactly one zmm register: element i goes
 * to lane i % 16 with one vfmadd231ps per 16 elements. A dot's tail (n % 16 elements) loads
 * under a mask and FMAs under the same mask (_mm512_mask3_fmadd_ps), so the lanes past n keep
 * their accumulators as the definition says: an unmasked fma(0, 0, acc) would turn an
 * accumulator of -0 (tiny negative products round to it) into +0. Full steps are unmasked.
 * Q4_1 blocks dequantize through a 16-entry table T[q] = (d*q)+m held in one register and
 * vpermps: the table entries are computed with the same two roundings as kiln_dequantize.
 */
#include "cpu_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
#define TGT_INLINE                                                                             \
    __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c"), always_inline)) static inline

/* kiln_lane16_reduce on one zmm. */
TGT_INLINE float reduce16(__m512 acc) {
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}

TGT_INLINE __mmask16 mask16(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* A dot's step of 16 lanes: c + a*b with one rounding, in every lane (fma_all, a full step)
 * or in the lanes of m only, the others keeping c (fma_tail, the tail). */
TGT_INLINE __m512 fma_all(__m512 a, __m512 b, __m512 c, __mmask16 m) {
    (void)m;
    return _mm512_fmadd_ps(a, b, c);
}
TGT_INLINE __m512 fma_tail(__m512 a, __m512 b, __m512 c, __mmask16 m) {
    return _mm512_mask3_fmadd_ps(a, b, c, m);
}

TGT static void z_dot_accum(float acc[KILN_DOT_LANES], const float *a, const float *b,
                            int64_t n) {
    __m512 c = _mm512_loadu_ps(acc);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        c = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), c);
    if (i < n) {
        __mmask16 m = mask16(n - i);
        c = fma_tail(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), c, m);
    }
    _mm512_storeu_ps(acc, c);
}

/* reduce16 of 16 accumulators at once: lane u of the result is reduce16(c[u]), each sum
 * taken with the same operands in the same order (s8 = acc[j] + acc[j+8], s4, s2, then
 * s2[0] + s2[1]), 16 outputs in 15 adds where reduce16 spends 4 apiece. */
TGT_INLINE __m512 reduce16x16(const __m512 c[16]) {
    __m512 t[8], u[4], v[2];
    for (int a = 0; a < 8; a++) /* lanes 0-7: c[2a]'s s8, 8-15: c[2a+1]'s */
        t[a] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * a], c[2 * a + 1], 0x44),
                             _mm512_shuffle_f32x4(c[2 * a], c[2 * a + 1], 0xee));
    for (int a = 0; a < 4; a++) /* 128-bit lane r: the s4 of c[4a + r] */
        u[a] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * a], t[2 * a + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * a], t[2 * a + 1], 0xdd));
    for (int a = 0; a < 2; a++) /* lane r: s2 of c[8a + r] (elements 0-1), c[8a + 4 + r] (2-3) */
        v[a] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * a], u[2 * a + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * a], u[2 * a + 1], 0xee));
    /* element 4r + e of the sum: c[r + 4e]'s dot; put c[k]'s at element k */
    const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xdd));
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(idx, d);
}

TGT static void z_dots(float *s, const float *q, const float *k, int64_t k_stride, int nk,
                       int HS) {
    int j = 0;
    for (; j + 16 <= nk; j += 16) { /* 16 keys, their sums reduced together */
        __m512 c[16];
        for (int u = 0; u < 16; u++) c[u] = _mm512_setzero_ps();
        int i = 0;
        for (; i + 16 <= HS; i += 16) {
            const __m512 qv = _mm512_loadu_ps(q + i);
            for (int u = 0; u < 16; u++)
                c[u] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + (j + u) * k_stride + i), c[u]);
        }
        if (i < HS) {
            const __mmask16 m = mask16(HS - i);
            const __m512 qv = _mm512_maskz_loadu_ps(m, q + i);
            for (int u = 0; u < 16; u++)
                c[u] = fma_tail(qv, _mm512_maskz_loadu_ps(m, k + (j + u) * k_stride + i), c[u], m);
        }
        _mm512_storeu_ps(s + j, reduce16x16(c));
    }
    for (; j + 4 <= nk; j += 4) {
        __m512 c[4];
        for (int u = 0; u < 4; u++) c[u] = _mm512_setzero_ps();
        int i = 0;
        for (; i + 16 <= HS; i += 16) {
            __m512 qv = _mm512_loadu_ps(q + i);
            for (int u = 0; u < 4; u++)
                c[u] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + (j + u) * k_stride + i), c[u]);
        }
        if (i < HS) {
            __mmask16 m = mask16(HS - i);
            __m512 qv = _mm512_maskz_loadu_ps(m, q + i);
            for (int u = 0; u < 4; u++)
                c[u] = fma_tail(qv, _mm512_maskz_loadu_ps(m, k + (j + u) * k_stride + i), c[u], m);
        }
        for (int u = 0; u < 4; u++) s[j + u] = reduce16(c[u]);
    }
    for (; j < nk; j++) {
        float acc[KILN_DOT_LANES] = {0};
        z_dot_accum(acc, q, k + j * k_stride, HS);
        s[j] = kiln_lane16_reduce(acc);
    }
}

/* ---- fused matmul ------------------------------------------------------------------------ */

typedef struct zblk32 {
    __m512 v[2]; /* elements 0-15, 16-31 */
} zblk32;

TGT_INLINE float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The blocks' dequantization with the scale d (and Q4_1's m) given as f32 broadcasts: the
 * tiles convert the f16 scales of 16 blocks in one vcvtph2ps (block_scales) instead of one
 * scalar conversion and broadcast per block; the values are the same. */
TGT_INLINE zblk32 zdeq_q8_0_s(const uint8_t *b, __m512 d, __m512 m) {
    (void)m;
    zblk32 w;
    for (int k = 0; k < 2; k++) {
        __m128i q = _mm_loadu_si128((const __m128i *)(b + 2 + 16 * k));
        w.v[k] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
    }
    return w;
}

TGT_INLINE zblk32 zdeq_q4_1_s(const uint8_t *b, __m512 d, __m512 m) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    /* (d*q)+m: d*q is exact (see kernels_avx2.c deq_q4_1), so one fma gives its bits */
    __m512 table = _mm512_fmadd_ps(d, iota, m);
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 4)));
    zblk32 w;
    w.v[0] = _mm512_permutexvar_ps(q, table); /* uses bits 0-3: the low nibble */
    w.v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
    return w;
}

TGT_INLINE zblk32 zdeq_q4_0_s(const uint8_t *b, __m512 d, __m512 m) {
    (void)m;
    const __m512 iota = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512 table = _mm512_mul_ps(d, iota);
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)));
    zblk32 w;
    w.v[0] = _mm512_permutexvar_ps(q, table);
    w.v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
    return w;
}

/* One block, its scales converted alone (the prefill's dequantization into f32 rows). */
TGT_INLINE zblk32 zdeq_q8_0(const uint8_t *b) {
    return zdeq_q8_0_s(b, _mm512_set1_ps(h2f(b)), _mm512_setzero_ps());
}
TGT_INLINE zblk32 zdeq_q4_1(const uint8_t *b) {
    return zdeq_q4_1_s(b, _mm512_set1_ps(h2f(b)), _mm512_set1_ps(h2f(b + 2)));
}
TGT_INLINE zblk32 zdeq_q4_0(const uint8_t *b) {
    return zdeq_q4_0_s(b, _mm512_set1_ps(h2f(b)), _mm512_setzero_ps());
}

/* The f32 scales of n <= 16 consecutive blocks of BB bytes from p: d from offset 0 of each, m
 * from offset MO (MO 0: no m). */
TGT_INLINE void block_scales(const uint8_t *p, int n, const int BB, const int MO, float d[16], float m[16]) {
    uint16_t hd[16] = {0}, hm[16] = {0};
    for (int k = 0; k < n; k++) {
        memcpy(&hd[k], p + (size_t)k * BB, 2);
        if (MO) memcpy(&hm[k], p + (size_t)k * BB + MO, 2);
    }
    _mm512_store_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)hd)));
    if (MO) _mm512_store_ps(m, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)hm)));
}

/* Full unrolling of the tile's 4-iteration loops, so that its accumulators live in registers
 * (without it GCC kept the 4 x 4 array in memory, one store per FMA). */
#define KILN_UNROLL4 _Pragma("GCC unroll 4")

/* The block types' tile, RB <= 4 rows x TB <= 4 tokens: every 16 blocks the rows' scales are
 * converted at once (block_scales), then each block is dequantized into registers (DEQ) and
 * used for the TB tokens. MO: the offset of Q4_1's m (0: none). */
#define DEFINE_Q32_TILE(NAME, DEQ, BLOCK_BYTES, MO)                                            \
    TGT_INLINE void NAME(const kiln_mm_args *a, int64_t r, int t, const int RB, const int TB) { \
        __m512 c[4][4];                                                                        \
        KILN_UNROLL4                                                                           \
        for (int rr = 0; rr < RB; rr++)                                                        \
            KILN_UNROLL4                                                                       \
            for (int tt = 0; tt < TB; tt++) c[rr][tt] = _mm512_setzero_ps();                   \
        const uint8_t *wr[4];                                                                  \
        const float *xr[4];                                                                    \
        KILN_UNROLL4                                                                           \
        for (int rr = 0; rr < RB; rr++) wr[rr] = a->w + (size_t)(r + rr) * a->row_bytes;       \
        KILN_UNROLL4                                                                           \
        for (int tt = 0; tt < TB; tt++) xr[tt] = a->x + (int64_t)(t + tt) * a->ldx;            \
        const int64_t nb = a->C / 32;                                                          \
        for (int64_t b0 = 0; b0 < nb; b0 += 16) {                                              \
            const int ng = nb - b0 < 16 ? (int)(nb - b0) : 16;                                 \
            _Alignas(64) float ds[4][16], ms[4][16];                                           \
            KILN_UNROLL4                                                                       \
            for (int rr = 0; rr < RB; rr++) {                                                  \
                KILN_PREFETCH_SPAN(wr[rr] + (size_t)b0 * BLOCK_BYTES, ng * BLOCK_BYTES);        \
                block_scales(wr[rr] + (size_t)b0 * BLOCK_BYTES, ng, BLOCK_BYTES, MO, ds[rr], ms[rr]); \
            }                                                                                  \
            for (int k = 0; k < ng; k++) {                                                     \
                const int64_t b = b0 + k;                                                      \
                KILN_UNROLL4                                                                   \
                for (int rr = 0; rr < RB; rr++) {                                              \
                    zblk32 w = DEQ(wr[rr] + (size_t)b * BLOCK_BYTES, _mm512_set1_ps(ds[rr][k]), \
                                   MO ? _mm512_set1_ps(ms[rr][k]) : _mm512_setzero_ps());      \
                    KILN_UNROLL4                                                               \
                    for (int tt = 0; tt < TB; tt++) {                                          \
                        const float *xp = xr[tt] + b * 32;                                     \
                        c[rr][tt] = _mm512_fmadd_ps(w.v[0], _mm512_loadu_ps(xp), c[rr][tt]);   \
                        c[rr][tt] = _mm512_fmadd_ps(w.v[1], _mm512_loadu_ps(xp + 16), c[rr][tt]); \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        KILN_UNROLL4                                                                           \
        for (int rr = 0; rr < RB; rr++)                                                        \
            KILN_UNROLL4                                                                       \
            for (int tt = 0; tt < TB; tt++) {                                                  \
                float s = reduce16(c[rr][tt]);                                                 \
                if (a->bias) s = s + a->bias[r + rr];                                          \
                a->out[(int64_t)(t + tt) * a->ldo + r + rr] = s;                               \
            }                                                                                  \
    }

DEFINE_Q32_TILE(tile_q8_0, zdeq_q8_0_s, 34, 0)
DEFINE_Q32_TILE(tile_q4_1, zdeq_q4_1_s, 20, 2)
DEFINE_Q32_TILE(tile_q4_0, zdeq_q4_0_s, 18, 0)

TGT_INLINE __m512 zld_f32(const uint8_t *row, int64_t i, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, (const float *)row + i);
}
TGT_INLINE __m512 zld_f16(const uint8_t *row, int64_t i, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)row + i));
}
TGT_INLINE __m512 zld_bf16(const uint8_t *row, int64_t i, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)row + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* One step of 16 elements from i of a plain tile (inside DEFINE_PLAIN_TILE's function: its
 * c, wr, xr, RB, TB), loads under the mask m, FMA = fma_all (full step, m all ones) or
 * fma_tail (the last, partial step: the lanes past C keep their sums). */
#define PLAIN_STEP(LOAD, FMA, i, m)                                                            \
    do {                                                                                       \
        const __mmask16 sm = (m);                                                              \
        __m512 w[4];                                                                           \
        KILN_UNROLL4                                                                           \
        for (int rr = 0; rr < RB; rr++) w[rr] = LOAD(wr[rr], (i), sm);                         \
        KILN_UNROLL4                                                                           \
        for (int tt = 0; tt < TB; tt++) {                                                      \
            const __m512 xv = _mm512_maskz_loadu_ps(sm, xr[tt] + (i));                        \
            KILN_UNROLL4                                                                       \
            for (int rr = 0; rr < RB; rr++) c[rr][tt] = FMA(w[rr], xv, c[rr][tt], sm);         \
        }                                                                                      \
    } while (0)

/* Plain-type tiles: RB <= 4 rows x TB <= 4 tokens. Per 16 elements the RB weight vectors are
 * loaded once, then each token's x vector once for all RB rows: 4 x 4 is 8 loads per 16 FMAs
 * (21 of the 32 registers), where loading x per row and token was 10 loads per 8 FMAs. Each
 * accumulator still takes its elements in order, so the bits do not depend on the tile. */
#define DEFINE_PLAIN_TILE(NAME, LOAD)                                                          \
    TGT_INLINE void NAME(const kiln_mm_args *a, int64_t r, int t, const int RB, const int TB) { \
        __m512 c[4][4];                                                                        \
        KILN_UNROLL4                                                                           \
        for (int rr = 0; rr < RB; rr++)                                                        \
            KILN_UNROLL4                                                                       \
            for (int tt = 0; tt < TB; tt++) c[rr][tt] = _mm512_setzero_ps();                   \
        const uint8_t *wr[4];                                                                  \
        const float *xr[4];                                                                    \
        for (int rr = 0; rr < RB; rr++) wr[rr] = a->w + (size_t)(r + rr) * a->row_bytes;       \
        for (int tt = 0; tt < TB; tt++) xr[tt] = a->x + (int64_t)(t + tt) * a->ldx;            \
        const int64_t C = a->C;                                                                \
        int64_t i = 0;                                                                         \
        for (; i + 16 <= C; i += 16) PLAIN_STEP(LOAD, fma_all, i, (__mmask16)0xffff);          \
        if (i < C) PLAIN_STEP(LOAD, fma_tail, i, mask16(C - i));                               \
        KILN_UNROLL4                                                                           \
        for (int rr = 0; rr < RB; rr++)                                                        \
            KILN_UNROLL4                                                                       \
            for (int tt = 0; tt < TB; tt++) {                                                  \
                float s = reduce16(c[rr][tt]);                                                 \
                if (a->bias) s = s + a->bias[r + rr];                                          \
                a->out[(int64_t)(t + tt) * a->ldo + r + rr] = s;                               \
            }                                                                                  \
    }

DEFINE_PLAIN_TILE(tile_f32, zld_f32)
DEFINE_PLAIN_TILE(tile_f16, zld_f16)
DEFINE_PLAIN_TILE(tile_bf16, zld_bf16)

#define TOKEN_TILE 64
/* With 32 registers: 4 rows x 4 tokens (16 accumulators) for batches, then 2-row and 1-row
 * tails; 4 rows x 1 token for N < 4. */
#define DEFINE_ROWS(NAME, TILE)                                                                \
    TGT static void NAME(const kiln_mm_args *a, int64_t r0, int64_t r1) {                      \
        if (a->N < 4) {                                                                        \
            KILN_FEW_TOKEN_ROWS(TILE);                                                         \
            return;                                                                            \
        }                                                                                      \
        for (int t0 = 0; t0 < a->N; t0 += TOKEN_TILE) {                                        \
            int t1 = a->N - t0 < TOKEN_TILE ? a->N : t0 + TOKEN_TILE;                          \
            int64_t r = r0;                                                                    \
            for (; r + 4 <= r1; r += 4) {                                                      \
                int t = t0;                                                                    \
                for (; t + 4 <= t1; t += 4) TILE(a, r, t, 4, 4);                               \
                for (; t < t1; t++) TILE(a, r, t, 4, 1);                                       \
            }                                                                                  \
            for (; r + 2 <= r1; r += 2) {                                                      \
                int t = t0;                                                                    \
                for (; t + 4 <= t1; t += 4) TILE(a, r, t, 2, 4);                               \
                for (; t < t1; t++) TILE(a, r, t, 2, 1);                                       \
            }                                                                                  \
            for (; r < r1; r++) {                                                              \
                int t = t0;                                                                    \
                for (; t + 4 <= t1; t += 4) TILE(a, r, t, 1, 4);                               \
                for (; t < t1; t++) TILE(a, r, t, 1, 1);                                       \
            }                                                                                  \
        }                                                                                      \
    }

DEFINE_ROWS(rows_f32, tile_f32)
DEFINE_ROWS(rows_f16, tile_f16)
DEFINE_ROWS(rows_bf16, tile_bf16)

DEFINE_ROWS(block_rows_q8_0, tile_q8_0)
DEFINE_ROWS(block_rows_q4_1, tile_q4_1)
DEFINE_ROWS(block_rows_q4_0, tile_q4_0)

/* The block formats' rows with 4 tokens or more: KILN_DEFINE_DEQ_ROWS, 4 rows a group (the f32
 * tile's 4 x 4 outputs load 8 vectors per 16 FMAs). */
#define DEFINE_DEQ_STORE(NAME, DEQ)                                                            \
    TGT_INLINE void NAME(float *dst, const uint8_t *block) {                                   \
        zblk32 d = DEQ(block);                                                                 \
        _mm512_store_ps(dst, d.v[0]);                                                          \
        _mm512_store_ps(dst + 16, d.v[1]);                                                     \
    }
DEFINE_DEQ_STORE(store_q8_0, zdeq_q8_0)
DEFINE_DEQ_STORE(store_q4_1, zdeq_q4_1)
DEFINE_DEQ_STORE(store_q4_0, zdeq_q4_0)
KILN_DEFINE_DEQ_ROWS_ALL(4, TOKEN_TILE)

static int z_matmul_rows(const kiln_mm_args *a, int64_t r0, int64_t r1) {
    switch (a->dtype) {
    case KILN_DTYPE_F32: rows_f32(a, r0, r1); return 1;
    case KILN_DTYPE_F16: rows_f16(a, r0, r1); return 1;
    case KILN_DTYPE_BF16: rows_bf16(a, r0, r1); return 1;
    case KILN_DTYPE_Q8_0: rows_q8_0(a, r0, r1); return 1;
    case KILN_DTYPE_Q4_1: rows_q4_1(a, r0, r1); return 1;
    case KILN_DTYPE_Q4_0: rows_q4_0(a, r0, r1); return 1;
    default: return 0;
    }
}

/* ---- attention, elementwise ------------------------------------------------------------- */

/* The tail's lanes past HS compute on zeros and are never stored. */
TGT static void z_attn_pv(float *acc, float alpha, const float *p, const float *v,
                          int64_t v_stride, int nk, int HS) {
    __m512 al = _mm512_set1_ps(alpha);
    int d = 0;
    for (; d + 64 <= HS; d += 64) {
        __m512 c[4];
        for (int u = 0; u < 4; u++) c[u] = _mm512_mul_ps(_mm512_loadu_ps(acc + d + 16 * u), al);
        for (int j = 0; j < nk; j++) {
            __m512 pj = _mm512_set1_ps(p[j]);
            const float *vj = v + j * v_stride + d;
            for (int u = 0; u < 4; u++)
                c[u] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj + 16 * u), c[u]);
        }
        for (int u = 0; u < 4; u++) _mm512_storeu_ps(acc + d + 16 * u, c[u]);
    }
    for (; d < HS; d += 16) {
        __mmask16 m = mask16(HS - d);
        __m512 c = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, acc + d), al);
        for (int j = 0; j < nk; j++)
            c = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_maskz_loadu_ps(m, v + j * v_stride + d),
                                c);
        _mm512_mask_storeu_ps(acc + d, m, c);
    }
}

/* kiln_expf, 16 at a time (see kernels_avx2.c exp8). */
TGT_INLINE __m512 exp16(__m512 x) {
    __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(KILN_EXP_LO)),
                              _mm512_set1_ps(KILN_EXP_HI));
    __m512 sh = _mm512_set1_ps(KILN_EXP_SHIFTER);
    __m512 t = _mm512_mul_ps(xc, _mm512_set1_ps(KILN_EXP_LOG2E));
    __m512 kf = _mm512_sub_ps(_mm512_add_ps(t, sh), sh);
    __m512 r = _mm512_fnmadd_ps(kf, _mm512_set1_ps(KILN_EXP_LN2_HI), xc);
    r = _mm512_fnmadd_ps(kf, _mm512_set1_ps(KILN_EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(KILN_EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KILN_EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KILN_EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KILN_EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KILN_EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KILN_EXP_P5));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    __m512i k = _mm512_cvttps_epi32(kf);
    __m512i k1 = _mm512_srai_epi32(k, 1);
    __m512i k2 = _mm512_sub_epi32(k, k1);
    __m512i bias = _mm512_set1_epi32(127);
    __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k1, bias), 23));
    __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k2, bias), 23));
    __m512 res = _mm512_mul_ps(_mm512_mul_ps(y, s1), s2);
    res = _mm512_mask_mov_ps(res, _mm512_cmp_ps_mask(x, _mm512_set1_ps(KILN_EXP_LO), _CMP_LT_OQ),
                             _mm512_setzero_ps());
    res = _mm512_mask_mov_ps(res, _mm512_cmp_ps_mask(x, _mm512_set1_ps(KILN_EXP_HI), _CMP_GT_OQ),
                             _mm512_set1_ps(INFINITY));
    res = _mm512_mask_mov_ps(res, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_add_ps(x, x));
    return res;
}

TGT static void z_exp_sub(float *p, const float *s, float m, int n) {
    __m512 mv = _mm512_set1_ps(m);
    for (int j = 0; j < n; j += 16) {
        __mmask16 k = mask16(n - j);
        _mm512_mask_storeu_ps(p + j, k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mv)));
    }
}

TGT static void z_scale_mul(float *out, const float *x, float r, const float *w, int64_t n) {
    __m512 rv = _mm512_set1_ps(r);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = mask16(n - i);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), rv);
        if (w) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i));
        _mm512_mask_storeu_ps(out + i, m, v);
    }
}

TGT static void z_swiglu(float *out, const float *g, const float *u, size_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (size_t i = 0; i < n; i += 16) {
        __mmask16 m = mask16((int64_t)(n - i));
        __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
        __m512 ng = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), sign));
        __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp16(ng)));
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
    }
}

TGT static void z_add(float *x, const float *y, size_t n) {
    for (size_t i = 0; i < n; i += 16) {
        __mmask16 m = mask16((int64_t)(n - i));
        _mm512_mask_storeu_ps(x + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, x + i),
                                                      _mm512_maskz_loadu_ps(m, y + i)));
    }
}

const kiln_cpu_kernels kiln_cpu_kernels_avx512 = {
    .path = KILN_CPU_PATH_AVX512,
    .dot_accum = z_dot_accum,
    .dots = z_dots,
    .matmul_rows = z_matmul_rows,
    .attn_pv = z_attn_pv,
    .exp_sub = z_exp_sub,
    .scale_mul = z_scale_mul,
    .swiglu = z_swiglu,
    .add = z_add,
};

#endif /* __x86_64__ */
