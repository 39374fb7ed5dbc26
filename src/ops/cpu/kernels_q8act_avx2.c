/*
 * kernels_q8act_avx2.c -- the fast mode's int8-activation matmul with AVX2: the same bits as
 * kernels_q8act.c (docs/ARITHMETIC.md, "Fast mode: 8-bit activations").
 *
 * Per (row, token), 8 blocks of 32 at a time: each block's products are summed exactly in
 * integers (vpmaddubsw: unsigned weight bytes x signed activation bytes -> int16 pairs, which
 * cannot saturate here; vpmaddwd by 1 -> int32), the 8 blocks' int32 vectors are reduced to
 * one vector of 8 block sums (integer adds: any order is exact), and then lane k (block
 * b = g + k, so lane b % 8) does the float steps of the definition with one vfmadd each.
 * Padding lanes past the last block get weight scale 0 and activation scale 0, so
 * fmaf(0, 0, acc) leaves acc unchanged (acc starts at +0 and never becomes -0).
 */
#include "cpu_kernels.h"
#include "kernels_q8act.h"

#if defined(__x86_64__)
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <string.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define TGT_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

#define Q8ACT_TINY 0x1p-96f

/* ---- quantization ------------------------------------------------------------------------- */

TGT_INLINE float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

TGT_INLINE int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}

TGT static void quantize_block(const float *x, int8_t *q, float *d, float *s, int32_t *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f), fmax = _mm256_set1_ps(FLT_MAX);
    __m256 v[4], a[4];
    int fin = 0xff;
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_loadu_ps(x + 8 * k);
        a[k] = _mm256_andnot_ps(sign, v[k]);
        fin &= _mm256_movemask_ps(_mm256_cmp_ps(a[k], fmax, _CMP_LE_OQ));
    }
    /* no NaN among a[] when fin == 0xff, so max is order-free */
    float amax = hmax8(_mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3])));
    if (fin != 0xff || amax < Q8ACT_TINY) {
        memset(q, 0, 32);
        *sum = 0;
        *d = *s = fin != 0xff ? NAN : 0.0f;
        return;
    }
    float dx = amax / 127.0f, inv = 127.0f / amax;
    const __m256 iv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    __m256i qi[4];
    for (int k = 0; k < 4; k++) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(v[k], iv),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        qi[k] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(r, hi), lo));
    }
    int32_t acc = hsum8i(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                          _mm256_add_epi32(qi[2], qi[3])));
    /* packs work per 128-bit lane: the bytes come out as dwords 0,4,1,5,2,6,3,7 */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                   _mm256_packs_epi32(qi[2], qi[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
    *d = dx;
    *sum = acc;
    *s = dx * (float)acc;
}

TGT static void a_quantize(kiln_q8act *qa, const float *x, int64_t ldx) {
    for (int t = 0; t < qa->N; t++) {
        size_t o = (size_t)t * (size_t)qa->nbp;
        for (int64_t b = 0; b < qa->nb; b++)
            quantize_block(x + t * ldx + b * 32, qa->q + (o + b) * 32, qa->d + o + b,
                           qa->s + o + b, qa->sum + o + b);
        for (int64_t b = qa->nb; b < qa->nbp; b++) {
            memset(qa->q + (o + b) * 32, 0, 32);
            qa->d[o + b] = qa->s[o + b] = 0.0f;
            qa->sum[o + b] = 0;
        }
    }
}

/* ---- integer block sums ------------------------------------------------------------------- */

/* 8 int32 partial sums of one block's 32 products (u8 weights x s8 activations). */
TGT_INLINE __m256i block_u8s8(__m256i w, const int8_t *xq) {
    __m256i p16 = _mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)xq));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

/* The 32 nibbles of a Q4 block's 16 bytes in element order: bytes 0-15 the low nibbles,
 * 16-31 the high nibbles. */
TGT_INLINE __m256i nibbles32(const uint8_t *qs) {
    __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    b = _mm256_srlv_epi64(b, _mm256_setr_epi64x(0, 0, 4, 4));
    return _mm256_and_si256(b, _mm256_set1_epi8(15));
}

/* Vector of the 8 blocks' sums: lane k = sum of v[k]'s 8 lanes. */
TGT_INLINE __m256i reduce8x8(const __m256i v[8]) {
    __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                            _mm256_permute2x128_si256(a, b, 0x31));
}

TGT_INLINE int32_t ld32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The f16 at byte 0 (and 2) of 8 blocks BB bytes apart; lanes >= nv give 0. (Plain loads:
 * vpgatherdd is microcoded and slow on AMD Zen.) */
TGT_INLINE void scales8(const uint8_t *blk0, int BB, int nv, __m256 *d, __m256 *m) {
    /* explicit inserts: a vector built through the stack stalls on store forwarding. Lanes
     * >= nv re-read the last valid block (in bounds) and are zeroed after. */
    int o[8];
    for (int k = 0; k < 8; k++) o[k] = (k < nv ? k : nv - 1) * BB;
    __m128i a = _mm_cvtsi32_si128(ld32(blk0 + o[0])), b = _mm_cvtsi32_si128(ld32(blk0 + o[4]));
    a = _mm_insert_epi32(a, ld32(blk0 + o[1]), 1);
    b = _mm_insert_epi32(b, ld32(blk0 + o[5]), 1);
    a = _mm_insert_epi32(a, ld32(blk0 + o[2]), 2);
    b = _mm_insert_epi32(b, ld32(blk0 + o[6]), 2);
    a = _mm_insert_epi32(a, ld32(blk0 + o[3]), 3);
    b = _mm_insert_epi32(b, ld32(blk0 + o[7]), 3);
    __m256i g = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
    if (nv < 8)
        g = _mm256_and_si256(g, _mm256_cmpgt_epi32(_mm256_set1_epi32(nv),
                                                   _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    /* per 128-bit lane: low halves to bytes 0-7, high halves to 8-15; then gather lanes */
    const __m256i shuf = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                          0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    g = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(g, shuf), 0xd8);
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(g));
    if (m) *m = _mm256_cvtph_ps(_mm256_extracti128_si256(g, 1));
}

/* Tokens whose accumulators a row's pass keeps (in memory: L1) while each group of 8 weight
 * blocks is decoded once for all of them. */
#define Q8A_TILE 16

/* One row r for tokens t0 .. t0+nt-1 (nt <= Q8A_TILE), the definition per (row, token): 8
 * blocks at a time, each block's products summed exactly in integers, the 8 blocks' sums in one
 * vector (integer adds: any order is exact), then lane k (block g + k, so lane b % 8) does the
 * definition's float steps with one vfmadd each, and at the end the fixed tree over the lanes.
 * Each group's weight bytes and scales are decoded once per row and tile, not once per token.
 * Blocks past nb (k >= nv) have zero weights and zero scales here and zero activations in qa
 * (its padding), so every lane of the last group runs with no branch: their integer sums are 0
 * and fmaf(0, 0, acc) leaves acc as it is (acc starts at +0 and never becomes -0). DOT(w, x): the 8 int32 sums of 4 consecutive products of
 * unsigned w and signed x bytes (vpmaddubsw + vpmaddwd, whose int16 pairs cannot saturate
 * here, or VNNI's vpdpbusd): exact integers either way, so the same bits. */
#define DEFINE_ROWS_TILE(NAME, ATTR, DOT)                                                       \
    ATTR static inline void NAME(const kiln_q8act_mm *m, int64_t r, int t0, int nt, const kiln_dtype DT) { \
        const kiln_q8act *qa = m->xa;                                                           \
        const int BB = DT == KILN_DTYPE_Q8_0 ? 34 : DT == KILN_DTYPE_Q4_0 ? 18 : 20;            \
        const uint8_t *row = m->w + (size_t)r * m->row_bytes;                                   \
        __m256 acc[Q8A_TILE];                                                                   \
        for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();                              \
        for (int64_t g = 0; g < qa->nb; g += 8) {                                               \
            const int nv = qa->nb - g < 8 ? (int)(qa->nb - g) : 8;                              \
            const uint8_t *blk = row + (size_t)g * BB;                                          \
            KILN_PREFETCH_SPAN(blk, 8 * BB); /* the rows stream: ask ahead (cpu_kernels.h) */   \
            __m256i w[8];                                                                       \
            for (int k = 0; k < 8; k++) {                                                       \
                if (k >= nv)                                                                    \
                    w[k] = _mm256_setzero_si256();                                              \
                else if (DT == KILN_DTYPE_Q8_0)                                                 \
                    w[k] = _mm256_loadu_si256((const __m256i *)(blk + k * BB + 2));             \
                else                                                                            \
                    w[k] = nibbles32(blk + k * BB + (DT == KILN_DTYPE_Q4_1 ? 4 : 2));           \
            }                                                                                   \
            __m256 dw, mw = _mm256_setzero_ps();                                                \
            scales8(blk, BB, nv, &dw, DT == KILN_DTYPE_Q4_1 ? &mw : NULL);                      \
            for (int t = 0; t < nt; t++) {                                                      \
                const size_t o = (size_t)(t0 + t) * (size_t)qa->nbp + (size_t)g;               \
                const int8_t *xq = qa->q + o * 32;                                              \
                __m256i v[8];                                                                   \
                for (int k = 0; k < 8; k++) {                                                   \
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * k));      \
                    if (DT == KILN_DTYPE_Q8_0) /* |w| x (x with w's sign) */                    \
                        v[k] = DOT(_mm256_abs_epi8(w[k]), _mm256_sign_epi8(xv, w[k]));          \
                    else                                                                        \
                        v[k] = DOT(w[k], xv);                                                   \
                }                                                                               \
                __m256i isum = reduce8x8(v);                                                    \
                if (DT == KILN_DTYPE_Q4_0)                                                      \
                    isum = _mm256_sub_epi32(                                                    \
                        isum, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(qa->sum + o)), 3)); \
                __m256 prod = _mm256_mul_ps(dw, _mm256_loadu_ps(qa->d + o));                    \
                acc[t] = _mm256_fmadd_ps(prod, _mm256_cvtepi32_ps(isum), acc[t]);               \
                if (DT == KILN_DTYPE_Q4_1) acc[t] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(qa->s + o), acc[t]); \
            }                                                                                   \
        }                                                                                       \
        for (int t = 0; t < nt; t++) {                                                          \
            __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps(acc[t], 1)); \
            __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                  \
            float s = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));                 \
            if (m->bias) s = s + m->bias[r];                                                    \
            m->out[(t0 + t) * m->ldo + r] = s;                                                  \
        }                                                                                       \
    }

#define DOT_AVX2(w, x) _mm256_madd_epi16(_mm256_maddubs_epi16((w), (x)), _mm256_set1_epi16(1))
DEFINE_ROWS_TILE(rows_tile, __attribute__((target("avx2,fma,f16c"), always_inline)), DOT_AVX2)

/* The rows of one kernel (PREFIX_rows): for each row, the tokens a tile at a time, through TILE
 * (a DEFINE_ROWS_TILE function), inlined once per weight type so that the type is a constant. */
#define DEFINE_ROWS(PREFIX, ATTR, TILE)                                                         \
    ATTR __attribute__((always_inline)) static inline void PREFIX##_dt(const kiln_q8act_mm *m, int64_t r0, \
                                                                      int64_t r1, const kiln_dtype DT) { \
        const int N = m->xa->N;                                                                 \
        for (int64_t r = r0; r < r1; r++)                                                       \
            for (int t0 = 0; t0 < N; t0 += Q8A_TILE)                                            \
                TILE(m, r, t0, N - t0 < Q8A_TILE ? N - t0 : Q8A_TILE, DT);                      \
    }                                                                                           \
    ATTR static void PREFIX##_rows(const kiln_q8act_mm *m, int64_t r0, int64_t r1) {            \
        switch (m->dtype) {                                                                     \
        case KILN_DTYPE_Q8_0: PREFIX##_dt(m, r0, r1, KILN_DTYPE_Q8_0); break;                   \
        case KILN_DTYPE_Q4_0: PREFIX##_dt(m, r0, r1, KILN_DTYPE_Q4_0); break;                   \
        case KILN_DTYPE_Q4_1: PREFIX##_dt(m, r0, r1, KILN_DTYPE_Q4_1); break;                   \
        default: kiln_q8act_kernels_portable.rows(m, r0, r1); break;                            \
        }                                                                                       \
    }

DEFINE_ROWS(q8a, TGT, rows_tile)

/* ---- AVX-512 VNNI (vpdpbusd on 256-bit registers, AVX512_VNNI + AVX512VL) ----------------- */

#define DOT_VNNI(w, x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (w), (x))
DEFINE_ROWS_TILE(rows_tile_vnni, __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni"), always_inline)),
                 DOT_VNNI)
DEFINE_ROWS(vnni, __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni"))), rows_tile_vnni)

const kiln_q8act_kernels kiln_q8act_kernels_vnni = {
    .name = "avx512-vnni",
    .quantize = a_quantize,
    .rows = vnni_rows,
};

const kiln_q8act_kernels kiln_q8act_kernels_avx2 = {
    .name = "avx2",
    .quantize = a_quantize,
    .rows = q8a_rows,
};

#endif /* __x86_64__ */
