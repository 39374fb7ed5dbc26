/*
 * backward_avx2.c -- the AVX2 + FMA + F16C inner loops of the backward ops. Same bits as
 * backward_portable.c's table (the same fmaf per element, in the same order).
 *
 * The lane-16 GEMM tile keeps a 6 x 16 block of outputs in 12 ymm registers for one lane
 * j at a time: for k = k0 + j, k0 + j + 16, ... each output does one vfmadd231ps, which is
 * exactly lane j's fmaf of the defined dot; the 16 lanes are stored to P and the fixed tree
 * is applied by the caller. B's 16 columns come packed lane by lane as f32 (the caller's
 * bwd_pack_panel), so a lane's rows are consecutive. Tiles narrower than 16 columns use the
 * generic body compiled for this target. The AVX-512 path has its own table
 * (backward_avx512.c), with the same bits.
 */
#include "backward.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define TGT_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

#define MR KILN_BWD_MR
#define NC KILN_BWD_NC

/* One lane's pass of the 6 x 16 tile: for k = kj, kj + 16, ... < k1, with B's 16 columns of
 * the m-th step at b + 16 m (f32), p(6 x 16) += A(:, k) B(k, :) by one vfmadd231ps per output
 * (starting from +0 when first, else from p). */
TGT_INLINE void lane_pass(float *p, const float *const a[MR], int64_t ask, int64_t kj, int64_t k1,
                          const float *b, int first) {
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
    for (int64_t k = kj; k < k1; k += 16, b += 16) {
        const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
        __m256 av;
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

/* The 6 x 16 tile on the lane-grouped panel (kiln_bwd_kernels.tile_packed), lane by lane:
 * exactly the FMAs of kiln_bwd_tile_generic, in its order per output, with 12 accumulators
 * in registers and each lane's B rows read consecutively. */
TGT static void a_tile_packed(float *P, const float *A, int64_t asi, int64_t ask,
                              const float *pk, int64_t mstride, int64_t k0, int64_t k1, int mi,
                              int first) {
    const float *a[MR]; /* rows past mi repeat row mi-1: computed, never reported */
    for (int i = 0; i < MR; i++) a[i] = A + (i < mi ? i : mi - 1) * asi;
    for (int j = 0; j < 16; j++)
        lane_pass(P + (int64_t)j * MR * NC, a, ask, k0 + j, k1, pk + (int64_t)j * mstride * 16,
                  first);
}

/* Partial panels (fewer than 16 columns; whole ones go through a_tile_packed): the generic
 * body compiled for AVX2 + FMA, the same fmaf per element. */
TGT static void a_tile(float *P, const float *A, int64_t asi, int64_t ask, const kiln_bwd_b *B,
                       int64_t c0, int64_t k0, int64_t k1, int mi, int nc, int first) {
    kiln_bwd_tile_generic(P, A, asi, ask, B, c0, k0, k1, mi, nc, first);
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
