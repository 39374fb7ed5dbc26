/*
 * mx_avx2.c -- the exact block formats' product with AVX2: the bits of mx_cpu.c's reference
 * (docs/ARITHMETIC.md, "Exact block formats (mx8, mx16)"), checked by tests/c/test_mx.c.
 *
 * Per output (n, r), 8 blocks at a time:
 *   - P_k: mx8 by vpmaddubsw(|w|, sign(x, w)) (pairs <= 2 * 127^2 fit int16: no saturation)
 *     and vpmaddwd by 1; mx16 by vpmaddwd on the int16 mantissas hi*128 + lo (the entry
 *     widens x once per call, this file one row of W per output column), which is the same
 *     integer as the four piece products (every partial sum < 32 * 8191^2 < 2^31);
 *   - the 8 blocks' int32 vectors reduced to one vector of 8 P_k (integer adds: exact);
 *   - T_k = P_k >> (base - e_k) by vpsravd (a count >= 32 fills with the sign: floor), then
 *     << (e_k - base) in int64 by vpsllvq (at most SH), summed in 4 int64 lanes.
 * Blocks past the row, and zero blocks, have P_k = 0 (their mantissas are 0), so they add
 * nothing whatever their (very negative) shift. emax comes first, 16 blocks at a time, from
 * exponent rows padded to a multiple of 16 with KILN_MX_EXP_ZERO (the entry pads x's once per
 * call, this file a row of W's): vpaddsw saturates a sum with the sentinel at -32768, below
 * every real sum (>= -298), so the max skips the blocks that do not contribute.
 */
#include "mx_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <string.h>

#define TGT __attribute__((target("avx2")))
#define TGT_INLINE __attribute__((target("avx2"), always_inline)) static inline

/* Vector of the 8 blocks' sums: lane k = sum of v[k]'s 8 lanes. */
TGT_INLINE __m256i reduce8x8(const __m256i v[8]) {
    __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                            _mm256_permute2x128_si256(a, b, 0x31));
}

TGT_INLINE int64_t hsum4_64(__m256i v) {
    __m128i s = _mm_add_epi64(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return _mm_cvtsi128_si64(s) + _mm_extract_epi64(s, 1);
}

#include "mx_simd.h"

/* d = e_k - base = Ex_k + Ew_k - (smax - SH) for 8 blocks, in int32 (sentinels: very
 * negative, harmless: their P is 0). */
TGT_INLINE __m256i shifts8(const int16_t *ex, const int16_t *ew, int smsh) {
    __m256i a = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)ex));
    __m256i b = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)ew));
    return _mm256_sub_epi32(_mm256_add_epi32(a, b), _mm256_set1_epi32(smsh));
}

/* acc + the 8 blocks' T_k: P their products, d = e_k - base (<= SH; any negative value for
 * blocks whose P is 0). */
TGT_INLINE __m256i combine8(__m256i acc, __m256i P, __m256i d) {
    const __m256i z = _mm256_setzero_si256();
    __m256i rc = _mm256_max_epi32(_mm256_sub_epi32(z, d), z); /* base - e_k when positive */
    __m256i lc = _mm256_max_epi32(d, z);                      /* e_k - base when positive */
    __m256i Pr = _mm256_srav_epi32(P, rc); /* floor(P / 2^rc); counts >= 32 give 0 or -1 */
    __m256i t0 = _mm256_sllv_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(Pr)),
                                   _mm256_cvtepi32_epi64(_mm256_castsi256_si128(lc)));
    __m256i t1 = _mm256_sllv_epi64(_mm256_cvtepi32_epi64(_mm256_extracti128_si256(Pr, 1)),
                                   _mm256_cvtepi32_epi64(_mm256_extracti128_si256(lc, 1)));
    return _mm256_add_epi64(acc, _mm256_add_epi64(t0, t1));
}

/* S of one output of mx8: mantissa rows xq, wq (nb blocks), padded exponent rows ex, ew;
 * smsh = smax - SH. */
TGT_INLINE int64_t sum_mx8(const int8_t *xq, const int8_t *wq, const int16_t *ex, const int16_t *ew,
                           int64_t nb, int smsh) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc = _mm256_setzero_si256();
    for (int64_t g = 0; g < nb; g += 8) {
        int64_t nv = nb - g < 8 ? nb - g : 8;
        __m256i v[8];
        for (int k = 0; k < 8; k++) {
            if (k >= nv) {
                v[k] = _mm256_setzero_si256();
                continue;
            }
            __m256i w = _mm256_loadu_si256((const __m256i *)(wq + (g + k) * KILN_MX_BLOCK));
            __m256i x = _mm256_loadu_si256((const __m256i *)(xq + (g + k) * KILN_MX_BLOCK));
            __m256i p16 = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
            v[k] = _mm256_madd_epi16(p16, ones);
        }
        acc = combine8(acc, reduce8x8(v), shifts8(ex + g, ew + g, smsh));
    }
    return hsum4_64(acc);
}

/* S of one output of mx16 from the int16 mantissas x16, w16. */
TGT_INLINE int64_t sum_mx16(const int16_t *x16, const int16_t *w16, const int16_t *ex,
                            const int16_t *ew, int64_t nb, int smsh) {
    __m256i acc = _mm256_setzero_si256();
    for (int64_t g = 0; g < nb; g += 8) {
        int64_t nv = nb - g < 8 ? nb - g : 8;
        __m256i v[8];
        for (int k = 0; k < 8; k++) {
            if (k >= nv) {
                v[k] = _mm256_setzero_si256();
                continue;
            }
            const int16_t *xb = x16 + (g + k) * KILN_MX_BLOCK, *wb = w16 + (g + k) * KILN_MX_BLOCK;
            __m256i a = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb),
                                          _mm256_loadu_si256((const __m256i *)wb));
            __m256i b = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xb + 16)),
                                          _mm256_loadu_si256((const __m256i *)(wb + 16)));
            v[k] = _mm256_add_epi32(a, b);
        }
        acc = combine8(acc, reduce8x8(v), shifts8(ex + g, ew + g, smsh));
    }
    return hsum4_64(acc);
}

/* hi * 128 + lo for n elements (n a multiple of 32). */
TGT static void widen16(int16_t *dst, const int8_t *hi, const int8_t *lo, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(hi + i)));
        __m256i l = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(lo + i)));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_add_epi16(_mm256_slli_epi16(h, 7), l));
    }
}

TGT static void a_rows(const kiln_mx_product *p, int64_t r0, int64_t r1, int thread) {
    const kiln_mx_matrix *x = p->x, *w = p->w;
    const int64_t nb = x->nb, nbp = p->nbp, N = x->rows, L = nb * KILN_MX_BLOCK;
    const int mx8 = x->kind == KILN_MX8;
    const int F = mx8 ? KILN_MX8_F : KILN_MX16_F, SH = mx8 ? KILN_MX8_SH : KILN_MX16_SH;
    uint8_t *sc = p->scratch + (size_t)thread * p->scratch_stride;
    int16_t *ew = (int16_t *)sc;              /* (nbp) the row's exponents, padded */
    int16_t *w16 = (int16_t *)(sc + nbp * 6); /* mx16: (nb*32) the row's int16 mantissas */
    for (int64_t r = r0; r < r1; r++) {
        if (w->row_nonfinite[r]) {
            for (int64_t n = 0; n < N; n++)
                kiln_mx_store(p, n, r, kiln_mx_nan());
            continue;
        }
        for (int64_t b = 0; b < nbp; b++)
            ew[b] = b < nb ? w->e[r * nb + b] : KILN_MX_EXP_ZERO;
        if (!mx8) widen16(w16, w->q + r * L, w->lo + r * L, L);
        for (int64_t n = 0; n < N; n++) {
            const int16_t *ex = p->xe + n * nbp;
            int smax = exp_sum_max(ex, ew, nbp);
            float v;
            if (x->row_nonfinite[n])
                v = kiln_mx_nan();
            else if (smax < MX_SUM_NONE)
                v = 0.0f; /* no contributing block */
            else {
                int64_t S = mx8 ? sum_mx8(x->q + n * L, w->q + r * L, ex, ew, nb, smax - SH)
                                : sum_mx16((const int16_t *)(p->xm + (size_t)n * p->xm_stride), w16,
                                           ex, ew, nb, smax - SH);
                v = kiln_mx_round(S, smax - 2 * F - SH);
            }
            kiln_mx_store(p, n, r, v);
        }
    }
}

const kiln_mx_kernels kiln_mx_kernels_avx2 = {
    .name = "avx2",
    .layout = KILN_MX_LAYOUT_INT16,
    .w_rows = 1,
    .rows = a_rows,
};

/* ---- quantization of a full block (nearest even) ----------------------------------------- */

/* mx.c's quantize_block for n = 32 without stochastic rounding, 8 lanes at a time: an element
 * is m 2^x (m < 2^24 from its bits), q = m << sh for sh = x + F - E >= 0, else
 * round_half_even(m 2^-t) with t = min(-sh, 26) (past 26 the value is below 2^-2: q 0 either
 * way), saturated at 2^(F+1) - 1, the sign put back. */
TGT int16_t kiln_mx_quantize_block_avx2(const float *a, int F, int32_t mant[KILN_MX_BLOCK]) {
    const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
    __m256i u[4], mx = _mm256_setzero_si256();
    for (int v = 0; v < 4; v++) {
        u[v] = _mm256_loadu_si256((const __m256i *)(a + 8 * v));
        mx = _mm256_max_epu32(mx, _mm256_and_si256(u[v], absmask));
    }
    __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0x4e));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0xb1));
    const uint32_t amax_bits = (uint32_t)_mm_cvtsi128_si32(m4);
    if (amax_bits >= 0x7f800000u || amax_bits == 0) {
        memset(mant, 0, KILN_MX_BLOCK * sizeof(int32_t));
        return amax_bits ? KILN_MX_EXP_NONFINITE : KILN_MX_EXP_ZERO;
    }
    const int E = amax_bits >= 0x800000u ? (int)(amax_bits >> 23) - 127 : (31 - __builtin_clz(amax_bits)) - 149;
    const __m256i one = _mm256_set1_epi32(1), zero = _mm256_setzero_si256();
    const __m256i qmax = _mm256_set1_epi32((1 << (F + 1)) - 1), implicit = _mm256_set1_epi32(0x800000);
    const __m256i frmask = _mm256_set1_epi32(0x7fffff), bias = _mm256_set1_epi32(150 - F + E);
    const __m256i t_cap = _mm256_set1_epi32(26);
    for (int v = 0; v < 4; v++) {
        const __m256i au = _mm256_and_si256(u[v], absmask);
        const __m256i ef = _mm256_srli_epi32(au, 23);
        const __m256i normal = _mm256_cmpgt_epi32(ef, zero);
        const __m256i m = _mm256_or_si256(_mm256_and_si256(au, frmask), _mm256_and_si256(normal, implicit));
        /* sh = x + F - E with x = max(ef, 1) - 150 */
        const __m256i sh = _mm256_sub_epi32(_mm256_max_epi32(ef, one), bias);
        const __m256i up = _mm256_sllv_epi32(m, _mm256_max_epi32(sh, zero)); /* sh >= 0 */
        const __m256i t = _mm256_min_epi32(_mm256_sub_epi32(zero, sh), t_cap);  /* sh < 0: t >= 1 */
        const __m256i tq = _mm256_max_epi32(t, one);
        __m256i q = _mm256_srlv_epi32(m, tq);
        const __m256i rem = _mm256_and_si256(m, _mm256_sub_epi32(_mm256_sllv_epi32(one, tq), one));
        const __m256i half = _mm256_sllv_epi32(one, _mm256_sub_epi32(tq, one));
        /* rem, half < 2^26: signed compares are exact */
        const __m256i inc = _mm256_or_si256(
            _mm256_cmpgt_epi32(rem, half),
            _mm256_and_si256(_mm256_cmpeq_epi32(rem, half), _mm256_cmpeq_epi32(_mm256_and_si256(q, one), one)));
        q = _mm256_sub_epi32(q, inc); /* inc is -1 where it applies */
        q = _mm256_blendv_epi8(q, up, _mm256_cmpgt_epi32(sh, _mm256_set1_epi32(-1)));
        q = _mm256_min_epi32(q, qmax);
        const __m256i neg = _mm256_srai_epi32(u[v], 31);
        _mm256_storeu_si256((__m256i *)(mant + 8 * v), _mm256_sub_epi32(_mm256_xor_si256(q, neg), neg));
    }
    return (int16_t)E;
}

#endif /* __x86_64__ */
