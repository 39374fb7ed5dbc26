/*
 * backward_avx512.c -- the AVX-512 (F, BW, VL) + FMA + F16C inner loops of the backward ops.
 * Same bits as backward_portable.c's table (the same fmaf per element, in the same order).
 *
 * The lane-16 GEMM tile of backward_avx2.c with B's 16 columns in one zmm register: for lane
 * j, k = k0 + j, k0 + j + 16, ..., each output does one vfmadd231ps, exactly lane j's fmaf
 * of the defined dot. One panel (6 x 16 outputs) is 6 accumulators and 7 loads (B's row and
 * 6 broadcasts of A) per 6 FMAs, bound by the loads; two panels side by side
 * (tile_packed2: 6 x 32 outputs, 12 accumulators) share the 6 broadcasts: 8 loads per 12
 * FMAs of 16 lanes, where the AVX2 tile does 8 loads per 12 FMAs of 8.
 */
#include "backward.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
#define TGT_INLINE                                                                             \
    __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c"), always_inline)) static inline

#define MR KILN_BWD_MR
#define NC KILN_BWD_NC

/* One lane's pass of a 6 x 16 tile: for k = kj, kj + 16, ... < k1, with B's 16 columns of
 * the m-th step at b + 16 m, p(6 x 16) += A(:, k) B(k, :) (from +0 when first). */
TGT_INLINE void z_lane_pass(float *p, const float *const a[MR], int64_t ask, int64_t kj,
                            int64_t k1, const float *b, int first) {
    __m512 c0, c1, c2, c3, c4, c5;
    if (first) {
        c0 = c1 = c2 = c3 = c4 = c5 = _mm512_setzero_ps();
    } else {
        c0 = _mm512_loadu_ps(p + 0 * NC), c1 = _mm512_loadu_ps(p + 1 * NC);
        c2 = _mm512_loadu_ps(p + 2 * NC), c3 = _mm512_loadu_ps(p + 3 * NC);
        c4 = _mm512_loadu_ps(p + 4 * NC), c5 = _mm512_loadu_ps(p + 5 * NC);
    }
    for (int64_t k = kj; k < k1; k += 16, b += 16) {
        const __m512 bv = _mm512_loadu_ps(b);
        const int64_t ko = k * ask;
        c0 = _mm512_fmadd_ps(_mm512_set1_ps(a[0][ko]), bv, c0);
        c1 = _mm512_fmadd_ps(_mm512_set1_ps(a[1][ko]), bv, c1);
        c2 = _mm512_fmadd_ps(_mm512_set1_ps(a[2][ko]), bv, c2);
        c3 = _mm512_fmadd_ps(_mm512_set1_ps(a[3][ko]), bv, c3);
        c4 = _mm512_fmadd_ps(_mm512_set1_ps(a[4][ko]), bv, c4);
        c5 = _mm512_fmadd_ps(_mm512_set1_ps(a[5][ko]), bv, c5);
    }
    _mm512_storeu_ps(p + 0 * NC, c0), _mm512_storeu_ps(p + 1 * NC, c1);
    _mm512_storeu_ps(p + 2 * NC, c2), _mm512_storeu_ps(p + 3 * NC, c3);
    _mm512_storeu_ps(p + 4 * NC, c4), _mm512_storeu_ps(p + 5 * NC, c5);
}

/* The same pass over two panels at once: p and q (6 x 16 each) with B's columns at b and d. */
TGT_INLINE void z_lane_pass2(float *p, float *q, const float *const a[MR], int64_t ask,
                             int64_t kj, int64_t k1, const float *b, const float *d, int first) {
    __m512 c0, c1, c2, c3, c4, c5, e0, e1, e2, e3, e4, e5;
    if (first) {
        c0 = c1 = c2 = c3 = c4 = c5 = _mm512_setzero_ps();
        e0 = e1 = e2 = e3 = e4 = e5 = _mm512_setzero_ps();
    } else {
        c0 = _mm512_loadu_ps(p + 0 * NC), c1 = _mm512_loadu_ps(p + 1 * NC);
        c2 = _mm512_loadu_ps(p + 2 * NC), c3 = _mm512_loadu_ps(p + 3 * NC);
        c4 = _mm512_loadu_ps(p + 4 * NC), c5 = _mm512_loadu_ps(p + 5 * NC);
        e0 = _mm512_loadu_ps(q + 0 * NC), e1 = _mm512_loadu_ps(q + 1 * NC);
        e2 = _mm512_loadu_ps(q + 2 * NC), e3 = _mm512_loadu_ps(q + 3 * NC);
        e4 = _mm512_loadu_ps(q + 4 * NC), e5 = _mm512_loadu_ps(q + 5 * NC);
    }
    for (int64_t k = kj; k < k1; k += 16, b += 16, d += 16) {
        const __m512 bv = _mm512_loadu_ps(b), dv = _mm512_loadu_ps(d);
        const int64_t ko = k * ask;
        __m512 av;
        av = _mm512_set1_ps(a[0][ko]);
        c0 = _mm512_fmadd_ps(av, bv, c0), e0 = _mm512_fmadd_ps(av, dv, e0);
        av = _mm512_set1_ps(a[1][ko]);
        c1 = _mm512_fmadd_ps(av, bv, c1), e1 = _mm512_fmadd_ps(av, dv, e1);
        av = _mm512_set1_ps(a[2][ko]);
        c2 = _mm512_fmadd_ps(av, bv, c2), e2 = _mm512_fmadd_ps(av, dv, e2);
        av = _mm512_set1_ps(a[3][ko]);
        c3 = _mm512_fmadd_ps(av, bv, c3), e3 = _mm512_fmadd_ps(av, dv, e3);
        av = _mm512_set1_ps(a[4][ko]);
        c4 = _mm512_fmadd_ps(av, bv, c4), e4 = _mm512_fmadd_ps(av, dv, e4);
        av = _mm512_set1_ps(a[5][ko]);
        c5 = _mm512_fmadd_ps(av, bv, c5), e5 = _mm512_fmadd_ps(av, dv, e5);
    }
    _mm512_storeu_ps(p + 0 * NC, c0), _mm512_storeu_ps(p + 1 * NC, c1);
    _mm512_storeu_ps(p + 2 * NC, c2), _mm512_storeu_ps(p + 3 * NC, c3);
    _mm512_storeu_ps(p + 4 * NC, c4), _mm512_storeu_ps(p + 5 * NC, c5);
    _mm512_storeu_ps(q + 0 * NC, e0), _mm512_storeu_ps(q + 1 * NC, e1);
    _mm512_storeu_ps(q + 2 * NC, e2), _mm512_storeu_ps(q + 3 * NC, e3);
    _mm512_storeu_ps(q + 4 * NC, e4), _mm512_storeu_ps(q + 5 * NC, e5);
}

/* The rows of the tile (rows past mi repeat row mi-1: computed, never reported). */
TGT_INLINE void z_rows(const float *a[MR], const float *A, int64_t asi, int mi) {
    for (int i = 0; i < MR; i++) a[i] = A + (i < mi ? i : mi - 1) * asi;
}

/* kiln_bwd_kernels.tile_packed: lane by lane, 6 accumulators. */
TGT static void z_tile_packed(float *P, const float *A, int64_t asi, int64_t ask,
                              const float *pk, int64_t mstride, int64_t k0, int64_t k1, int mi,
                              int first) {
    const float *a[MR];
    z_rows(a, A, asi, mi);
    for (int j = 0; j < 16; j++)
        z_lane_pass(P + (int64_t)j * MR * NC, a, ask, k0 + j, k1, pk + (int64_t)j * mstride * 16,
                    first);
}

/* kiln_bwd_kernels.tile_packed2: two panels, lane by lane, 12 accumulators. */
TGT static void z_tile_packed2(float *P0, float *P1, const float *A, int64_t asi, int64_t ask,
                               const float *pk0, const float *pk1, int64_t mstride, int64_t k0,
                               int64_t k1, int mi, int first) {
    const float *a[MR];
    z_rows(a, A, asi, mi);
    for (int j = 0; j < 16; j++)
        z_lane_pass2(P0 + (int64_t)j * MR * NC, P1 + (int64_t)j * MR * NC, a, ask, k0 + j, k1,
                     pk0 + (int64_t)j * mstride * 16, pk1 + (int64_t)j * mstride * 16, first);
}

/* Partial panels and the column lanes: the generic bodies compiled for this target (the
 * compiler vectorizes over c with vfmadd, the same fmaf per element). */
TGT static void z_tile(float *P, const float *A, int64_t asi, int64_t ask, const kiln_bwd_b *B,
                       int64_t c0, int64_t k0, int64_t k1, int mi, int nc, int first) {
    kiln_bwd_tile_generic(P, A, asi, ask, B, c0, k0, k1, mi, nc, first);
}

TGT static void z_col_lanes(float *acc, const float *a, const float *b, const float *s,
                            int64_t ld, int64_t n0, int64_t n1, int w) {
    kiln_bwd_col_lanes_generic(acc, a, b, s, ld, n0, n1, w);
}

const kiln_bwd_kernels kiln_bwd_kernels_avx512 = {.tile = z_tile,
                                                  .tile_packed = z_tile_packed,
                                                  .tile_packed2 = z_tile_packed2,
                                                  .col_lanes = z_col_lanes};

#endif /* __x86_64__ */
