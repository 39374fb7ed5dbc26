/*
 * mx_simd.h -- what the x86 kernels of the exact formats' product (mx_avx2.c, mx_avx512.c)
 * share. Included by those files only, after <immintrin.h> and after each defines TGT_INLINE
 * (its own target attribute), so every helper is compiled for the including file's target.
 */
#ifndef KILN_MX_SIMD_H
#define KILN_MX_SIMD_H

/* A real exponent sum is >= 2 * -149; a sum with the zero sentinel saturates at -32768. */
#define MX_SUM_NONE (-1000)

/* max over the nbp (a multiple of 16) padded blocks of Ex_k + Ew_k, saturated. */
TGT_INLINE int exp_sum_max(const int16_t *ex, const int16_t *ew, int64_t nbp) {
    __m256i m = _mm256_set1_epi16(INT16_MIN);
    for (int64_t k = 0; k < nbp; k += 16)
        m = _mm256_max_epi16(m, _mm256_adds_epi16(_mm256_loadu_si256((const __m256i *)(ex + k)),
                                                  _mm256_loadu_si256((const __m256i *)(ew + k))));
    __m128i h = _mm_max_epi16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    h = _mm_max_epi16(h, _mm_srli_si128(h, 8));
    h = _mm_max_epi16(h, _mm_srli_si128(h, 4));
    h = _mm_max_epi16(h, _mm_srli_si128(h, 2));
    return (int16_t)_mm_extract_epi16(h, 0);
}

#endif /* KILN_MX_SIMD_H */
