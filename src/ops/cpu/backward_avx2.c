/*
 * backward_avx2.c -- the AVX2 + FMA + F16C inner loops of the backward ops. Same bits as
 * backward_portable.c's table (the same fmaf per element, in the same order).
 *
 * The lane-16 GEMM tile keeps a 6 x 16 block of outputs in 12 ymm registers for one lane
 * j at a time: for k = k0 + j, k0 + j + 16, ... each output does one vfmadd231ps, which is
 * exactly lane j's fmaf of the defined dot; the 16 lanes are stored to P and the fixed tree
 * is applied by the caller. Tiles narrower than 16 columns use the generic body compiled
 * for this target. The AVX-512 path uses this table too (an AVX-512 CPU has AVX2): same
 * bits, and no AVX-512 machine is at hand to test a separate version.
 */
#include "backward.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define TGT_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

/* Columns c0..c0+15 of B's row k as two f32 vectors (exact widening). */
TGT_INLINE void load_b16(const uint8_t *row, kiln_dtype dt, __m256 *b0, __m256 *b1) {
    if (dt == KILN_DTYPE_F32) {
        *b0 = _mm256_loadu_ps((const float *)row);
        *b1 = _mm256_loadu_ps((const float *)row + 8);
    } else if (dt == KILN_DTYPE_BF16) {
        __m128i h0 = _mm_loadu_si128((const __m128i *)row);
        __m128i h1 = _mm_loadu_si128((const __m128i *)(row + 16));
        *b0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h0), 16));
        *b1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h1), 16));
    } else {
        *b0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)row));
        *b1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 16)));
    }
}

#define MR KILN_BWD_MR
#define NC KILN_BWD_NC

TGT_INLINE void tile16(float *P, const float *A, int64_t asi, int64_t ask, const kiln_bwd_b *B,
                       int64_t c0, int64_t k0, int64_t k1, int mi, kiln_dtype dt, int first) {
    /* rows past mi repeat row mi-1: computed, never reported */
    const float *a[MR];
    for (int i = 0; i < MR; i++) a[i] = A + (i < mi ? i : mi - 1) * asi;
    const size_t esize = dt == KILN_DTYPE_F32 ? 4 : 2;
    const uint8_t *bcol = B->b + (size_t)c0 * esize;
    for (int j = 0; j < 16; j++) {
        float *p = P + (int64_t)j * MR * NC;
        __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
        if (first) {
            c00 = c01 = c10 = c11 = c20 = c21 = _mm256_setzero_ps();
            c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_ps();
        } else {
            c00 = _mm256_loadu_ps(p + 0 * NC), c01 = _mm256_loadu_ps(p + 0 * NC + 8);
            c10 = _mm256_loadu_ps(p + 1 * NC), c11 = _mm256_loadu_ps(p + 1 * NC + 8);
            c20 = _mm256_loadu_ps(p + 2 * NC), c21 = _mm256_loadu_ps(p + 2 * NC + 8);
            c30 = _mm256_loadu_ps(p + 3 * NC), c31 = _mm256_loadu_ps(p + 3 * NC + 8);
            c40 = _mm256_loadu_ps(p + 4 * NC), c41 = _mm256_loadu_ps(p + 4 * NC + 8);
            c50 = _mm256_loadu_ps(p + 5 * NC), c51 = _mm256_loadu_ps(p + 5 * NC + 8);
        }
        for (int64_t k = k0 + j; k < k1; k += 16) {
            __m256 b0, b1, av;
            load_b16(bcol + (size_t)k * B->row_bytes, dt, &b0, &b1);
            const int64_t ko = k * ask;
            av = _mm256_broadcast_ss(a[0] + ko);
            c00 = _mm256_fmadd_ps(av, b0, c00), c01 = _mm256_fmadd_ps(av, b1, c01);
            av = _mm256_broadcast_ss(a[1] + ko);
            c10 = _mm256_fmadd_ps(av, b0, c10), c11 = _mm256_fmadd_ps(av, b1, c11);
            av = _mm256_broadcast_ss(a[2] + ko);
            c20 = _mm256_fmadd_ps(av, b0, c20), c21 = _mm256_fmadd_ps(av, b1, c21);
            av = _mm256_broadcast_ss(a[3] + ko);
            c30 = _mm256_fmadd_ps(av, b0, c30), c31 = _mm256_fmadd_ps(av, b1, c31);
            av = _mm256_broadcast_ss(a[4] + ko);
            c40 = _mm256_fmadd_ps(av, b0, c40), c41 = _mm256_fmadd_ps(av, b1, c41);
            av = _mm256_broadcast_ss(a[5] + ko);
            c50 = _mm256_fmadd_ps(av, b0, c50), c51 = _mm256_fmadd_ps(av, b1, c51);
        }
        _mm256_storeu_ps(p + 0 * NC, c00), _mm256_storeu_ps(p + 0 * NC + 8, c01);
        _mm256_storeu_ps(p + 1 * NC, c10), _mm256_storeu_ps(p + 1 * NC + 8, c11);
        _mm256_storeu_ps(p + 2 * NC, c20), _mm256_storeu_ps(p + 2 * NC + 8, c21);
        _mm256_storeu_ps(p + 3 * NC, c30), _mm256_storeu_ps(p + 3 * NC + 8, c31);
        _mm256_storeu_ps(p + 4 * NC, c40), _mm256_storeu_ps(p + 4 * NC + 8, c41);
        _mm256_storeu_ps(p + 5 * NC, c50), _mm256_storeu_ps(p + 5 * NC + 8, c51);
    }
}

/* tile16 on the lane-grouped panel (kiln_bwd_kernels.tile_packed): the same FMAs in the same
 * order, the B rows of one lane read consecutively. */
TGT static void a_tile_packed(float *P, const float *A, int64_t asi, int64_t ask,
                              const float *pk, int64_t mstride, int64_t k0, int64_t k1, int mi,
                              int first) {
    const float *a[MR];
    for (int i = 0; i < MR; i++) a[i] = A + (i < mi ? i : mi - 1) * asi;
    for (int j = 0; j < 16; j++) {
        float *p = P + (int64_t)j * MR * NC;
        const float *bj = pk + (int64_t)j * mstride * 16;
        __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
        if (first) {
            c00 = c01 = c10 = c11 = c20 = c21 = _mm256_setzero_ps();
            c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_ps();
        } else {
            c00 = _mm256_loadu_ps(p + 0 * NC), c01 = _mm256_loadu_ps(p + 0 * NC + 8);
            c10 = _mm256_loadu_ps(p + 1 * NC), c11 = _mm256_loadu_ps(p + 1 * NC + 8);
            c20 = _mm256_loadu_ps(p + 2 * NC), c21 = _mm256_loadu_ps(p + 2 * NC + 8);
            c30 = _mm256_loadu_ps(p + 3 * NC), c31 = _mm256_loadu_ps(p + 3 * NC + 8);
            c40 = _mm256_loadu_ps(p + 4 * NC), c41 = _mm256_loadu_ps(p + 4 * NC + 8);
            c50 = _mm256_loadu_ps(p + 5 * NC), c51 = _mm256_loadu_ps(p + 5 * NC + 8);
        }
        for (int64_t k = k0 + j; k < k1; k += 16, bj += 16) {
            const __m256 b0 = _mm256_loadu_ps(bj), b1 = _mm256_loadu_ps(bj + 8);
            const int64_t ko = k * ask;
            __m256 av = _mm256_broadcast_ss(a[0] + ko);
            c00 = _mm256_fmadd_ps(av, b0, c00), c01 = _mm256_fmadd_ps(av, b1, c01);
            av = _mm256_broadcast_ss(a[1] + ko);
            c10 = _mm256_fmadd_ps(av, b0, c10), c11 = _mm256_fmadd_ps(av, b1, c11);
            av = _mm256_broadcast_ss(a[2] + ko);
            c20 = _mm256_fmadd_ps(av, b0, c20), c21 = _mm256_fmadd_ps(av, b1, c21);
            av = _mm256_broadcast_ss(a[3] + ko);
            c30 = _mm256_fmadd_ps(av, b0, c30), c31 = _mm256_fmadd_ps(av, b1, c31);
            av = _mm256_broadcast_ss(a[4] + ko);
            c40 = _mm256_fmadd_ps(av, b0, c40), c41 = _mm256_fmadd_ps(av, b1, c41);
            av = _mm256_broadcast_ss(a[5] + ko);
            c50 = _mm256_fmadd_ps(av, b0, c50), c51 = _mm256_fmadd_ps(av, b1, c51);
        }
        _mm256_storeu_ps(p + 0 * NC, c00), _mm256_storeu_ps(p + 0 * NC + 8, c01);
        _mm256_storeu_ps(p + 1 * NC, c10), _mm256_storeu_ps(p + 1 * NC + 8, c11);
        _mm256_storeu_ps(p + 2 * NC, c20), _mm256_storeu_ps(p + 2 * NC + 8, c21);
        _mm256_storeu_ps(p + 3 * NC, c30), _mm256_storeu_ps(p + 3 * NC + 8, c31);
        _mm256_storeu_ps(p + 4 * NC, c40), _mm256_storeu_ps(p + 4 * NC + 8, c41);
        _mm256_storeu_ps(p + 5 * NC, c50), _mm256_storeu_ps(p + 5 * NC + 8, c51);
    }
}

TGT static void a_tile(float *P, const float *A, int64_t asi, int64_t ask, const kiln_bwd_b *B,
                       int64_t c0, int64_t k0, int64_t k1, int mi, int nc, int first) {
    if (nc != NC || mi < 1) {
        kiln_bwd_tile_generic(P, A, asi, ask, B, c0, k0, k1, mi, nc, first);
        return;
    }
    /* one specialisation per dtype, so the loop has no branch */
    switch (B->dtype) {
    case KILN_DTYPE_F32: tile16(P, A, asi, ask, B, c0, k0, k1, mi, KILN_DTYPE_F32, first); break;
    case KILN_DTYPE_BF16: tile16(P, A, asi, ask, B, c0, k0, k1, mi, KILN_DTYPE_BF16, first); break;
    case KILN_DTYPE_F16: tile16(P, A, asi, ask, B, c0, k0, k1, mi, KILN_DTYPE_F16, first); break;
    default: kiln_bwd_tile_generic(P, A, asi, ask, B, c0, k0, k1, mi, nc, first); break;
    }
}

/* The generic body, compiled for AVX2 + FMA: the compiler vectorizes over c with
 * vfmadd, the same fmaf per element. */
TGT static void a_col_lanes(float *acc, const float *a, const float *b, const float *s,
                            int64_t ld, int64_t n0, int64_t n1, int w) {
    kiln_bwd_col_lanes_generic(acc, a, b, s, ld, n0, n1, w);
}

const kiln_bwd_kernels kiln_bwd_kernels_avx2 = {.tile = a_tile, .tile_packed = a_tile_packed,
                                                .col_lanes = a_col_lanes};

#endif /* __x86_64__ */
