/*
 * kernels_avx2.c -- the AVX2 + FMA + F16C path. Same bits as kernels_portable.c.
 *
 * The 16 lane accumulators of the defined dot live in two ymm registers: lo = lanes 0-7,
 * hi = lanes 8-15. Element i goes to lane i % 16, so for a chunk of 16 starting at a
 * multiple of 16, elements 0-7 go to lo and 8-15 to hi, each with one vfmadd (= fmaf).
 * A dot's tail (n % 16 elements) loads under a mask and blends the FMA's result into the
 * accumulators under the same mask (fma_tail), so the lanes past n keep their values as the
 * definition says: a plain fma(0, 0, acc) would turn an accumulator of -0 (tiny negative
 * products round to it) into +0. Full steps are plain FMAs.
 * Compiled for the target by function attributes; chosen at run time (cpu_features.c).
 */
#include "cpu_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define TGT_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

/* The tree of kiln_lane16_reduce on (lo, hi). */
TGT_INLINE float reduce16(__m256 lo, __m256 hi) {
    __m256 s8 = _mm256_add_ps(lo, hi);                                             /* j, j+8 */
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1)); /* j+4 */
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                             /* j+2 */
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));                         /* 0, 1 */
    return _mm_cvtss_f32(s1);
}

/* Mask for the first n (0..8) of 8 lanes. */
TGT_INLINE __m256i mask8(int64_t n) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), iota);
}

/* fmaf(a, b, c) in the lanes of m (a mask8), c in the others: a dot's tail step. */
TGT_INLINE __m256 fma_tail(__m256 a, __m256 b, __m256 c, __m256i m) {
    return _mm256_blendv_ps(c, _mm256_fmadd_ps(a, b, c), _mm256_castsi256_ps(m));
}

/* out[t][r] of a matmul from its 16 lanes (lo: 0-7, hi: 8-15): the tree, then the bias. */
TGT_INLINE void put_out(const kiln_mm_args *a, int64_t r, int t, __m256 lo, __m256 hi) {
    float s = reduce16(lo, hi);
    if (a->bias) s = s + a->bias[r];
    a->out[(int64_t)t * a->ldo + r] = s;
}

TGT static void a_dot_accum(float acc[KILN_DOT_LANES], const float *a, const float *b,
                            int64_t n) {
    __m256 lo = _mm256_loadu_ps(acc), hi = _mm256_loadu_ps(acc + 8);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), hi);
    }
    if (i < n) {
        __m256i m0 = mask8(n - i), m1 = mask8(n - i - 8);
        lo = fma_tail(_mm256_maskload_ps(a + i, m0), _mm256_maskload_ps(b + i, m0), lo, m0);
        hi = fma_tail(_mm256_maskload_ps(a + i + 8, m1), _mm256_maskload_ps(b + i + 8, m1), hi,
                      m1);
    }
    _mm256_storeu_ps(acc, lo);
    _mm256_storeu_ps(acc + 8, hi);
}

/* Four dots at once (independent FMA chains hide the latency). */
TGT static void a_dots(float *s, const float *q, const float *k, int64_t k_stride, int nk,
                       int HS) {
    int j = 0;
    for (; j + 4 <= nk; j += 4) {
        __m256 lo[4], hi[4];
        for (int u = 0; u < 4; u++) lo[u] = hi[u] = _mm256_setzero_ps();
        int i = 0;
        for (; i + 16 <= HS; i += 16) {
            __m256 q0 = _mm256_loadu_ps(q + i), q1 = _mm256_loadu_ps(q + i + 8);
            for (int u = 0; u < 4; u++) {
                const float *kp = k + (j + u) * k_stride + i;
                lo[u] = _mm256_fmadd_ps(q0, _mm256_loadu_ps(kp), lo[u]);
                hi[u] = _mm256_fmadd_ps(q1, _mm256_loadu_ps(kp + 8), hi[u]);
            }
        }
        if (i < HS) {
            __m256i m0 = mask8(HS - i), m1 = mask8(HS - i - 8);
            __m256 q0 = _mm256_maskload_ps(q + i, m0), q1 = _mm256_maskload_ps(q + i + 8, m1);
            for (int u = 0; u < 4; u++) {
                const float *kp = k + (j + u) * k_stride + i;
                lo[u] = fma_tail(q0, _mm256_maskload_ps(kp, m0), lo[u], m0);
                hi[u] = fma_tail(q1, _mm256_maskload_ps(kp + 8, m1), hi[u], m1);
            }
        }
        for (int u = 0; u < 4; u++) s[j + u] = reduce16(lo[u], hi[u]);
    }
    for (; j < nk; j++) {
        float acc[KILN_DOT_LANES] = {0};
        a_dot_accum(acc, q, k + j * k_stride, HS);
        s[j] = kiln_lane16_reduce(acc);
    }
}

/* ---- fused matmul ------------------------------------------------------------------------ */

/* A dequantized block of 32 in 4 registers: elements 0-7, 8-15, 16-23, 24-31. */
typedef struct blk32 {
    __m256 v[4];
} blk32;

TGT_INLINE float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The blocks' dequantization with the scale d (and Q4_1's m) given as f32 broadcasts (the
 * tiles convert the scales of 16 blocks at once: block_scales). */

/* Q8_0: d (f16), qs[32] int8; value = float(q) * d. */
TGT_INLINE blk32 deq_q8_0_s(const uint8_t *b, __m256 d, __m256 m) {
    (void)m;
    blk32 w;
    for (int k = 0; k < 4; k++) {
        __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * k));
        w.v[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
    return w;
}

/* Q4_1: d, m (f16), qs[16]; element j < 16 is qs[j] & 15, element 16 + j is qs[j] >> 4;
 * value = (d * q) + m as gguf-py rounds it. d * q is EXACT in binary32 (d has 11
 * significant bits as an f16, q < 16 has 4, and f16's range sits inside f32's normal
 * range; inf/NaN d propagate alike), so fmaf(d, q, m) rounds once to the same bits. */
TGT_INLINE blk32 deq_q4_1_s(const uint8_t *b, __m256 d, __m256 m) {
    const __m256i low4 = _mm256_set1_epi32(15);
    __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 4)));
    __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 12)));
    __m256i q[4] = {_mm256_and_si256(b0, low4), _mm256_and_si256(b1, low4),
                    _mm256_srli_epi32(b0, 4), _mm256_srli_epi32(b1, 4)};
    blk32 w;
    for (int k = 0; k < 4; k++)
        w.v[k] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[k]), m);
    return w;
}

/* Q4_0: d (f16), qs[16]; q = nibble - 8; value = d * float(q). */
TGT_INLINE blk32 deq_q4_0_s(const uint8_t *b, __m256 d, __m256 m) {
    (void)m;
    const __m256i low4 = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2)));
    __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 10)));
    __m256i q[4] = {_mm256_and_si256(b0, low4), _mm256_and_si256(b1, low4),
                    _mm256_srli_epi32(b0, 4), _mm256_srli_epi32(b1, 4)};
    blk32 w;
    for (int k = 0; k < 4; k++)
        w.v[k] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[k], eight)));
    return w;
}

/* One block, its scales converted alone (the prefill's dequantization into f32 rows). */
TGT_INLINE blk32 deq_q8_0(const uint8_t *b) {
    return deq_q8_0_s(b, _mm256_set1_ps(h2f(b)), _mm256_setzero_ps());
}
TGT_INLINE blk32 deq_q4_1(const uint8_t *b) {
    return deq_q4_1_s(b, _mm256_set1_ps(h2f(b)), _mm256_set1_ps(h2f(b + 2)));
}
TGT_INLINE blk32 deq_q4_0(const uint8_t *b) {
    return deq_q4_0_s(b, _mm256_set1_ps(h2f(b)), _mm256_setzero_ps());
}

/* The f32 scales of n <= 16 consecutive blocks of BB bytes from p: d from offset 0 of each, m
 * from offset MO (MO 0: no m). */
TGT_INLINE void block_scales(const uint8_t *p, int n, const int BB, const int MO, float d[16], float m[16]) {
    uint16_t hd[16] = {0}, hm[16] = {0};
    for (int k = 0; k < n; k++) {
        memcpy(&hd[k], p + (size_t)k * BB, 2);
        if (MO) memcpy(&hm[k], p + (size_t)k * BB + MO, 2);
    }
    for (int h = 0; h < 2; h++) {
        _mm256_store_ps(d + 8 * h, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hd + 8 * h))));
        if (MO) _mm256_store_ps(m + 8 * h, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hm + 8 * h))));
    }
}

/* One tile: RB rows from r, TB tokens from t, over all blocks of 32. RB*TB <= 4 keeps the
 * 2*RB*TB accumulators in registers. Every 16 blocks the rows' scales are converted at once
 * (block_scales); MO: the offset of Q4_1's m (0: none). */
#define DEFINE_Q32_TILE(NAME, DEQ, BLOCK_BYTES, MO)                                            \
    TGT_INLINE void NAME(const kiln_mm_args *a, int64_t r, int t, const int RB, const int TB) { \
        __m256 lo[4][4], hi[4][4];                                                             \
        for (int rr = 0; rr < RB; rr++)                                                        \
            for (int tt = 0; tt < TB; tt++) lo[rr][tt] = hi[rr][tt] = _mm256_setzero_ps();     \
        const int64_t nb = a->C / 32;                                                          \
        for (int64_t b0 = 0; b0 < nb; b0 += 16) {                                              \
            const int ng = nb - b0 < 16 ? (int)(nb - b0) : 16;                                 \
            _Alignas(32) float ds[4][16], ms[4][16];                                           \
            for (int rr = 0; rr < RB; rr++) {                                                  \
                KILN_PREFETCH_SPAN(a->w + (size_t)(r + rr) * a->row_bytes + (size_t)b0 * BLOCK_BYTES, \
                                   ng * BLOCK_BYTES);                                          \
                block_scales(a->w + (size_t)(r + rr) * a->row_bytes + (size_t)b0 * BLOCK_BYTES, ng, \
                             BLOCK_BYTES, MO, ds[rr], ms[rr]);                                 \
            }                                                                                  \
            for (int k = 0; k < ng; k++) {                                                     \
                const int64_t b = b0 + k;                                                      \
                for (int rr = 0; rr < RB; rr++) {                                              \
                    blk32 w = DEQ(a->w + (size_t)(r + rr) * a->row_bytes + (size_t)b * BLOCK_BYTES, \
                                  _mm256_set1_ps(ds[rr][k]),                                   \
                                  MO ? _mm256_set1_ps(ms[rr][k]) : _mm256_setzero_ps());       \
                    for (int tt = 0; tt < TB; tt++) {                                          \
                        const float *xp = a->x + (int64_t)(t + tt) * a->ldx + b * 32;          \
                        lo[rr][tt] = _mm256_fmadd_ps(w.v[0], _mm256_loadu_ps(xp), lo[rr][tt]); \
                        hi[rr][tt] = _mm256_fmadd_ps(w.v[1], _mm256_loadu_ps(xp + 8), hi[rr][tt]); \
                        lo[rr][tt] = _mm256_fmadd_ps(w.v[2], _mm256_loadu_ps(xp + 16), lo[rr][tt]); \
                        hi[rr][tt] = _mm256_fmadd_ps(w.v[3], _mm256_loadu_ps(xp + 24), hi[rr][tt]); \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int rr = 0; rr < RB; rr++)                                                        \
            for (int tt = 0; tt < TB; tt++)                                                    \
                put_out(a, r + rr, t + tt, lo[rr][tt], hi[rr][tt]);                            \
    }

DEFINE_Q32_TILE(tile_q8_0, deq_q8_0_s, 34, 0)
DEFINE_Q32_TILE(tile_q4_1, deq_q4_1_s, 20, 2)
DEFINE_Q32_TILE(tile_q4_0, deq_q4_0_s, 18, 0)

/* Plain-type rows: 16 elements per step, a masked tail for C % 16. LOAD16 gives lanes
 * (0-7, 8-15) of 16 elements from row pointer + element offset, masked to n valid. */
TGT_INLINE void ld_f32(const uint8_t *row, int64_t i, int64_t n, __m256 *v0, __m256 *v1) {
    const float *p = (const float *)row + i;
    if (n >= 16) {
        *v0 = _mm256_loadu_ps(p);
        *v1 = _mm256_loadu_ps(p + 8);
    } else {
        *v0 = _mm256_maskload_ps(p, mask8(n));
        *v1 = _mm256_maskload_ps(p + 8, mask8(n - 8));
    }
}

TGT_INLINE __m128i ld16_tail(const uint16_t *p, int64_t n) {
    uint16_t tmp[8] = {0};
    for (int64_t k = 0; k < n && k < 8; k++) tmp[k] = p[k];
    return _mm_loadu_si128((const __m128i *)tmp);
}

TGT_INLINE void ld_f16(const uint8_t *row, int64_t i, int64_t n, __m256 *v0, __m256 *v1) {
    const uint16_t *p = (const uint16_t *)row + i;
    if (n >= 16) {
        *v0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        *v1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    } else {
        *v0 = _mm256_cvtph_ps(ld16_tail(p, n));
        *v1 = _mm256_cvtph_ps(n > 8 ? ld16_tail(p + 8, n - 8) : _mm_setzero_si128());
    }
}

TGT_INLINE void ld_bf16(const uint8_t *row, int64_t i, int64_t n, __m256 *v0, __m256 *v1) {
    const uint16_t *p = (const uint16_t *)row + i;
    __m128i h0, h1;
    if (n >= 16) {
        h0 = _mm_loadu_si128((const __m128i *)p);
        h1 = _mm_loadu_si128((const __m128i *)(p + 8));
    } else {
        h0 = ld16_tail(p, n);
        h1 = n > 8 ? ld16_tail(p + 8, n - 8) : _mm_setzero_si128();
    }
    *v0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h0), 16));
    *v1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h1), 16));
}

/* One step of 16 elements from i of a plain tile, n of them valid (inside
 * DEFINE_PLAIN_TILE's function: its a, r, t, RB, TB, lo, hi). n is the constant 16 in the
 * full steps (plain loads and FMAs once the branches fold); the last, partial step (n < 16)
 * loads under masks and keeps the lanes past C (fma_tail). */
#define PLAIN_STEP(LOAD, i, n)                                                                 \
    do {                                                                                       \
        const int64_t si = (i), sn = (n);                                                      \
        const __m256i m0 = mask8(sn), m1 = mask8(sn - 8);                                      \
        for (int rr = 0; rr < RB; rr++) {                                                      \
            __m256 w0, w1;                                                                     \
            LOAD(a->w + (size_t)(r + rr) * a->row_bytes, si, sn, &w0, &w1);                    \
            for (int tt = 0; tt < TB; tt++) {                                                  \
                const float *xp = a->x + (int64_t)(t + tt) * a->ldx + si;                      \
                if (sn >= 16) {                                                                \
                    lo[rr][tt] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp), lo[rr][tt]);         \
                    hi[rr][tt] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp + 8), hi[rr][tt]);     \
                } else {                                                                       \
                    lo[rr][tt] = fma_tail(w0, _mm256_maskload_ps(xp, m0), lo[rr][tt], m0);     \
                    hi[rr][tt] = fma_tail(w1, _mm256_maskload_ps(xp + 8, m1), hi[rr][tt], m1); \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    } while (0)

#define DEFINE_PLAIN_TILE(NAME, LOAD)                                                          \
    TGT_INLINE void NAME(const kiln_mm_args *a, int64_t r, int t, const int RB, const int TB) { \
        __m256 lo[4][4], hi[4][4];                                                             \
        for (int rr = 0; rr < RB; rr++)                                                        \
            for (int tt = 0; tt < TB; tt++) lo[rr][tt] = hi[rr][tt] = _mm256_setzero_ps();     \
        int64_t i = 0;                                                                         \
        for (; i + 16 <= a->C; i += 16) PLAIN_STEP(LOAD, i, 16);                               \
        if (i < a->C) PLAIN_STEP(LOAD, i, a->C - i);                                           \
        for (int rr = 0; rr < RB; rr++)                                                        \
            for (int tt = 0; tt < TB; tt++)                                                    \
                put_out(a, r + rr, t + tt, lo[rr][tt], hi[rr][tt]);                            \
    }

DEFINE_PLAIN_TILE(tile_f32, ld_f32)
DEFINE_PLAIN_TILE(tile_f16, ld_f16)
DEFINE_PLAIN_TILE(tile_bf16, ld_bf16)

/* Eight lanes of a plain-type row from element i, n elements left from i (n <= 0: zeros),
 * the values of the low or high half of the LOAD16 functions above. */
TGT_INLINE __m256 ld8_f32(const uint8_t *row, int64_t i, int64_t n) {
    const float *p = (const float *)row + i;
    return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mask8(n));
}

TGT_INLINE __m256 ld8_f16(const uint8_t *row, int64_t i, int64_t n) {
    const uint16_t *p = (const uint16_t *)row + i;
    return _mm256_cvtph_ps(n >= 8 ? _mm_loadu_si128((const __m128i *)p) : ld16_tail(p, n));
}

TGT_INLINE __m256 ld8_bf16(const uint8_t *row, int64_t i, int64_t n) {
    const uint16_t *p = (const uint16_t *)row + i;
    __m128i h = n >= 8 ? _mm_loadu_si128((const __m128i *)p) : ld16_tail(p, n);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* One step of the half tile: the 8 lanes of elements i .. i+7, n of them valid (inside
 * DEFINE_HALF_TILE's function: its RB, TB, wr, xr, acc). n is the constant 8 in the full
 * steps; in the last step of a row with C % 16 != 0 (n < 8, maybe <= 0 for the high lanes)
 * the loads are masked and the lanes past C keep their sums (fma_tail). k1 <= C, so a step
 * with i0 + 16 <= k1 is full in both halves. */
#define HALF_STEP(LOAD8, i, n)                                                                 \
    do {                                                                                       \
        const int64_t si = (i), sn = (n);                                                      \
        const __m256i m = mask8(sn);                                                           \
        __m256 w[3];                                                                           \
        for (int rr = 0; rr < RB; rr++) w[rr] = LOAD8(wr[rr], si, sn);                         \
        for (int tt = 0; tt < TB; tt++) {                                                      \
            if (sn >= 8) {                                                                     \
                const __m256 x = _mm256_loadu_ps(xr[tt] + si);                                 \
                for (int rr = 0; rr < RB; rr++)                                                \
                    acc[rr][tt] = _mm256_fmadd_ps(w[rr], x, acc[rr][tt]);                      \
            } else {                                                                           \
                const __m256 x = _mm256_maskload_ps(xr[tt] + si, m);                           \
                for (int rr = 0; rr < RB; rr++)                                                \
                    acc[rr][tt] = fma_tail(w[rr], x, acc[rr][tt], m);                          \
            }                                                                                  \
        }                                                                                      \
    } while (0)

/* The plain tile of many tokens, RB <= 3 rows by TB <= 3 tokens, in two half passes: the
 * 16 lanes of an output's dot are two independent groups of 8 (lanes 0-7 take the elements
 * i0 .. i0+7 of each 16-element step i0, lanes 8-15 the elements i0+8 .. i0+15), so the low
 * group's sum runs first and the high group's after it, each lane with the same vfmadd231ps
 * sequence (same steps, the same tail) as DEFINE_PLAIN_TILE: the same bits.
 * Half the accumulators are live at a time, so 3 x 3 outputs (9 sums, 3 weight vectors, one
 * x vector, row pointers hoisted) fit the 16 ymm registers with room to spare: 6 loads for
 * 9 FMAs, where the 1 x 4 tile above needs 10 loads for 8. (3 x 4 spilled two sums to the
 * stack under gcc 12; 2 x 4 and 4 x 2 measured slower than 3 x 3.)
 * The steps i0 in [k0, k1) (k0 a multiple of 16; the caller walks the blocks in order) run
 * here: a first block starts the sums at zero, a later one continues them from P, and a last
 * one reduces them into out; the others leave them in P. Slot (h, rr) of token t + tt is
 * P + (tt * 6 + h * 3 + rr) * 8. Blocking the steps keeps the rows' and tokens' pieces in L1
 * for long rows; each lane still sees its FMAs in increasing k. */
#define DEFINE_HALF_TILE(NAME, LOAD8)                                                          \
    TGT_INLINE void NAME(const kiln_mm_args *a, int64_t r, int t, const int RB, const int TB, \
                         int64_t k0, int64_t k1, float *P, int first, int last) {              \
        __m256 half[2][3][3];                                                                  \
        for (int h = 0; h < 2; h++) {                                                          \
            __m256 acc[3][3];                                                                  \
            for (int rr = 0; rr < RB; rr++)                                                    \
                for (int tt = 0; tt < TB; tt++)                                                \
                    acc[rr][tt] = first ? _mm256_setzero_ps()                                  \
                                        : _mm256_loadu_ps(P + (tt * 6 + h * 3 + rr) * 8);      \
            const uint8_t *wr[3];                                                              \
            const float *xr[3];                                                                \
            for (int rr = 0; rr < RB; rr++) wr[rr] = a->w + (size_t)(r + rr) * a->row_bytes;   \
            for (int tt = 0; tt < TB; tt++) xr[tt] = a->x + (int64_t)(t + tt) * a->ldx;        \
            int64_t i0 = k0;                                                                   \
            for (; i0 + 16 <= k1; i0 += 16) HALF_STEP(LOAD8, i0 + 8 * h, 8);                   \
            if (i0 < k1) HALF_STEP(LOAD8, i0 + 8 * h, a->C - i0 - 8 * h);                      \
            for (int rr = 0; rr < RB; rr++)                                                    \
                for (int tt = 0; tt < TB; tt++) {                                              \
                    if (last)                                                                  \
                        half[h][rr][tt] = acc[rr][tt];                                         \
                    else                                                                       \
                        _mm256_storeu_ps(P + (tt * 6 + h * 3 + rr) * 8, acc[rr][tt]);          \
                }                                                                              \
        }                                                                                      \
        if (!last) return;                                                                     \
        for (int rr = 0; rr < RB; rr++)                                                        \
            for (int tt = 0; tt < TB; tt++)                                                    \
                put_out(a, r + rr, t + tt, half[0][rr][tt], half[1][rr][tt]);                  \
    }

DEFINE_HALF_TILE(half_f32, ld8_f32)
DEFINE_HALF_TILE(half_f16, ld8_f16)
DEFINE_HALF_TILE(half_bf16, ld8_bf16)

/* Token tiles of 64 keep x in L2 while each row's blocks are reused from L1 by 4 tokens at a
 * time; with fewer than 4 tokens, 4 rows at a time give the independent FMA chains. */
#define TOKEN_TILE 64
#define DEFINE_ROWS(NAME, TILE)                                                                \
    TGT static void NAME(const kiln_mm_args *a, int64_t r0, int64_t r1) {                      \
        if (a->N < 4) {                                                                        \
            KILN_FEW_TOKEN_ROWS(TILE);                                                         \
            return;                                                                            \
        }                                                                                      \
        for (int t0 = 0; t0 < a->N; t0 += TOKEN_TILE) {                                        \
            int t1 = a->N - t0 < TOKEN_TILE ? a->N : t0 + TOKEN_TILE;                          \
            for (int64_t r = r0; r < r1; r++) {                                                \
                int t = t0;                                                                    \
                for (; t + 4 <= t1; t += 4) TILE(a, r, t, 1, 4);                               \
                for (; t < t1; t++) TILE(a, r, t, 1, 1);                                       \
            }                                                                                  \
        }                                                                                      \
    }

DEFINE_ROWS(block_rows_q8_0, tile_q8_0)
DEFINE_ROWS(block_rows_q4_1, tile_q4_1)
DEFINE_ROWS(block_rows_q4_0, tile_q4_0)

/* Plain types with 4 tokens or more: DEFINE_HALF_TILE's 3 x 3 tiles over the token tile
 * (the last rows and tokens in smaller ones of the same kind), the steps in blocks of
 * HALF_KBLOCK elements: 3 rows' and 3 tokens' blocks (18 KiB of f32) stay in L1 while the
 * token tile's groups pass, the partial sums wait in parts between blocks. 1.5x the 1 x 4
 * tiles at SmolLM2-135M's prefill and training shapes on one Zen 3 core (bench/RESULTS.md). */
#define HALF_KBLOCK 768
#define DEFINE_PLAIN_ROWS(NAME, TILE, HALF)                                                    \
    TGT static void NAME(const kiln_mm_args *a, int64_t r0, int64_t r1) {                      \
        if (a->N < 4) {                                                                        \
            KILN_FEW_TOKEN_ROWS(TILE);                                                         \
            return;                                                                            \
        }                                                                                      \
        float parts[TOKEN_TILE * 6 * 8];                                                       \
        for (int t0 = 0; t0 < a->N; t0 += TOKEN_TILE) {                                        \
            int t1 = a->N - t0 < TOKEN_TILE ? a->N : t0 + TOKEN_TILE;                          \
            for (int64_t r = r0; r < r1;) {                                                    \
                const int rb = r1 - r >= 3 ? 3 : 1;                                            \
                for (int64_t k0 = 0; k0 < a->C; k0 += HALF_KBLOCK) {                           \
                    const int64_t k1 = a->C - k0 < HALF_KBLOCK ? a->C : k0 + HALF_KBLOCK;      \
                    const int first = k0 == 0, last = k1 == a->C;                              \
                    int t = t0;                                                                \
                    for (; t + 3 <= t1; t += 3) {                                              \
                        float *P = parts + (t - t0) * 6 * 8;                                   \
                        if (rb == 3)                                                           \
                            HALF(a, r, t, 3, 3, k0, k1, P, first, last);                       \
                        else                                                                   \
                            HALF(a, r, t, 1, 3, k0, k1, P, first, last);                       \
                    }                                                                          \
                    for (; t < t1; t++) {                                                      \
                        float *P = parts + (t - t0) * 6 * 8;                                   \
                        if (rb == 3)                                                           \
                            HALF(a, r, t, 3, 1, k0, k1, P, first, last);                       \
                        else                                                                   \
                            HALF(a, r, t, 1, 1, k0, k1, P, first, last);                       \
                    }                                                                          \
                }                                                                              \
                r += rb;                                                                       \
            }                                                                                  \
        }                                                                                      \
    }

DEFINE_PLAIN_ROWS(rows_f32, tile_f32, half_f32)
DEFINE_PLAIN_ROWS(rows_f16, tile_f16, half_f16)
DEFINE_PLAIN_ROWS(rows_bf16, tile_bf16, half_bf16)

/* The block formats' rows with 4 tokens or more: KILN_DEFINE_DEQ_ROWS, 3 rows a group (for
 * rows_f32's 3 x 3 half tiles). */
#define DEFINE_DEQ_STORE(NAME, DEQ)                                                            \
    TGT_INLINE void NAME(float *dst, const uint8_t *block) {                                   \
        blk32 d = DEQ(block);                                                                  \
        for (int k = 0; k < 4; k++) _mm256_store_ps(dst + 8 * k, d.v[k]);                      \
    }
DEFINE_DEQ_STORE(store_q8_0, deq_q8_0)
DEFINE_DEQ_STORE(store_q4_1, deq_q4_1)
DEFINE_DEQ_STORE(store_q4_0, deq_q4_0)
KILN_DEFINE_DEQ_ROWS_ALL(3, TOKEN_TILE)

static int a_matmul_rows(const kiln_mm_args *a, int64_t r0, int64_t r1) {
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
TGT static void a_attn_pv(float *acc, float alpha, const float *p, const float *v,
                          int64_t v_stride, int nk, int HS) {
    __m256 al = _mm256_set1_ps(alpha);
    int d = 0;
    for (; d + 32 <= HS; d += 32) {
        __m256 c[4];
        for (int u = 0; u < 4; u++) c[u] = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 8 * u), al);
        for (int j = 0; j < nk; j++) {
            __m256 pj = _mm256_set1_ps(p[j]);
            const float *vj = v + j * v_stride + d;
            for (int u = 0; u < 4; u++)
                c[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * u), c[u]);
        }
        for (int u = 0; u < 4; u++) _mm256_storeu_ps(acc + d + 8 * u, c[u]);
    }
    for (; d < HS; d += 8) {
        __m256i m = mask8(HS - d);
        __m256 c = _mm256_mul_ps(_mm256_maskload_ps(acc + d, m), al);
        for (int j = 0; j < nk; j++)
            c = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_maskload_ps(v + j * v_stride + d, m), c);
        _mm256_maskstore_ps(acc + d, m, c);
    }
}

/* kiln_expf, 8 at a time: the same operations; the special cases are blended in after the
 * main path ran on x clamped to [EXP_LO, EXP_HI] (which leaves in-range x unchanged). */
TGT_INLINE __m256 exp8(__m256 x) {
    __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(KILN_EXP_LO)),
                              _mm256_set1_ps(KILN_EXP_HI));
    __m256 sh = _mm256_set1_ps(KILN_EXP_SHIFTER);
    __m256 t = _mm256_mul_ps(xc, _mm256_set1_ps(KILN_EXP_LOG2E));
    __m256 kf = _mm256_sub_ps(_mm256_add_ps(t, sh), sh);
    __m256 r = _mm256_fnmadd_ps(kf, _mm256_set1_ps(KILN_EXP_LN2_HI), xc);
    r = _mm256_fnmadd_ps(kf, _mm256_set1_ps(KILN_EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(KILN_EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KILN_EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KILN_EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KILN_EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KILN_EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KILN_EXP_P5));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i k = _mm256_cvttps_epi32(kf);
    __m256i k1 = _mm256_srai_epi32(k, 1);
    __m256i k2 = _mm256_sub_epi32(k, k1);
    __m256i bias = _mm256_set1_epi32(127);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
    __m256 res = _mm256_mul_ps(_mm256_mul_ps(y, s1), s2);
    res = _mm256_blendv_ps(res, _mm256_setzero_ps(),
                           _mm256_cmp_ps(x, _mm256_set1_ps(KILN_EXP_LO), _CMP_LT_OQ));
    res = _mm256_blendv_ps(res, _mm256_set1_ps(INFINITY),
                           _mm256_cmp_ps(x, _mm256_set1_ps(KILN_EXP_HI), _CMP_GT_OQ));
    res = _mm256_blendv_ps(res, _mm256_add_ps(x, x), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return res;
}

TGT static void a_exp_sub(float *p, const float *s, float m, int n) {
    __m256 mv = _mm256_set1_ps(m);
    int j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(p + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv)));
    for (; j < n; j++) p[j] = kiln_expf(s[j] - m);
}

TGT static void a_scale_mul(float *out, const float *x, float r, const float *w, int64_t n) {
    __m256 rv = _mm256_set1_ps(r);
    int64_t i = 0;
    if (w) {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv),
                                                    _mm256_loadu_ps(w + i)));
        for (; i < n; i++) out[i] = (x[i] * r) * w[i];
    } else {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), rv));
        for (; i < n; i++) out[i] = x[i] * r;
    }
}

TGT static void a_swiglu(float *out, const float *g, const float *u, size_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 e = exp8(_mm256_xor_ps(gv, neg)); /* -g: flips the sign bit only */
        __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) out[i] = kiln_swiglu(g[i], u[i]);
}

TGT static void a_add(float *x, const float *y, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) x[i] += y[i];
}

const kiln_cpu_kernels kiln_cpu_kernels_avx2 = {
    .path = KILN_CPU_PATH_AVX2,
    .dot_accum = a_dot_accum,
    .dots = a_dots,
    .matmul_rows = a_matmul_rows,
    .attn_pv = a_attn_pv,
    .exp_sub = a_exp_sub,
    .scale_mul = a_scale_mul,
    .swiglu = a_swiglu,
    .add = a_add,
};

#endif /* __x86_64__ */
