/*
 * mx_avx512.c -- the exact block formats' product with AVX-512 VNNI: the bits of mx_cpu.c's
 * reference (docs/ARITHMETIC.md, "Exact block formats (mx8, mx16)"), checked by
 * tests/c/test_mx.c. Used on the AVX512 path when the CPU has AVX512_VNNI.
 *
 * Both operands' mantissas are regrouped 16 blocks at a time (kiln_mx_interleave16: x once
 * per call by the entry, a row of W per output column here), so that lane b of a zmm always
 * belongs to block g*16 + b and each block's P_k builds up in its own int32 lane with no
 * horizontal reduction:
 *   - mx8: 8 vpdpbusd per 16 blocks on (q_x + 128) as uint8 x q_w as int8, then
 *     P_k = that - 128 * sum_i q_w,i (the row's block sums, once per row of W). Every
 *     intermediate is exact: |.| <= 32 * 255 * 127 < 2^21.
 *   - mx16: 16 vpdpwssd per 16 blocks on the int16 mantissas hi*128 + lo (each lane's running
 *     sum < 32 * 8191^2 < 2^31).
 * Then, as mx_avx2.c, T_k by vpsravd (floor) and vpsllvq (<= SH) in int64 lanes, and emax
 * first over exponent rows padded to a multiple of 16 with KILN_MX_EXP_ZERO.
 */
#include "mx_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <string.h>

#define TGT __attribute__((target("avx2,avx512f,avx512bw,avx512vl,avx512vnni")))
#define TGT_INLINE                                                                                 \
    __attribute__((target("avx2,avx512f,avx512bw,avx512vl,avx512vnni"),                            \
                   always_inline)) static inline

#include "mx_simd.h"

/* S of TILE outputs (one row of x, TILE rows of W): xi and wi[j] the rows interleaved (U units
 * of 4 bytes a block: 8 for mx8, 16 for mx16), wsum[j] the W rows' block sums (mx8), ex and
 * ew[j] the padded exponents, smsh[j] = smax - SH of each output. Each x load serves TILE
 * rows of W. MX16 and TILE are constants. */
#define TILE 4
TGT_INLINE void sum_tile(const uint8_t *xi, uint8_t *const wi[TILE], int32_t *const wsum[TILE],
                         const int16_t *ex, int16_t *const ew[TILE], int64_t nbp,
                         const int smsh[TILE], const int MX16, int64_t S[TILE]) {
    const int U = MX16 ? 16 : 8;
    const __m512i z = _mm512_setzero_si512();
    __m512i acc[TILE];
    for (int j = 0; j < TILE; j++)
        acc[j] = _mm512_setzero_si512();
    for (int64_t g = 0; g < nbp / 16; g++) {
        const uint8_t *xa = xi + g * U * 64;
        __m512i P[TILE];
        for (int j = 0; j < TILE; j++)
            P[j] = _mm512_setzero_si512();
        for (int s = 0; s < U; s++) {
            __m512i xv = _mm512_loadu_si512(xa + s * 64);
            for (int j = 0; j < TILE; j++) {
                __m512i wv = _mm512_loadu_si512(wi[j] + (g * U + s) * 64);
                P[j] = MX16 ? _mm512_dpwssd_epi32(P[j], xv, wv) : _mm512_dpbusd_epi32(P[j], xv, wv);
            }
        }
        __m512i exv = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(ex + g * 16)));
        for (int j = 0; j < TILE; j++) {
            if (!MX16) /* (q_x + 128) q_w summed, less 128 sum q_w */
                P[j] = _mm512_sub_epi32(P[j],
                                        _mm512_slli_epi32(_mm512_loadu_si512(wsum[j] + g * 16), 7));
            __m512i d =
                _mm512_sub_epi32(_mm512_add_epi32(exv, _mm512_cvtepi16_epi32(_mm256_loadu_si256(
                                                           (const __m256i *)(ew[j] + g * 16)))),
                                 _mm512_set1_epi32(smsh[j]));
            __m512i rc = _mm512_max_epi32(_mm512_sub_epi32(z, d), z); /* base - e_k if > 0 */
            __m512i lc = _mm512_max_epi32(d, z);                      /* e_k - base if > 0 */
            __m512i Pr = _mm512_srav_epi32(P[j], rc); /* floor(P / 2^rc); counts >= 32: 0 or -1 */
            __m512i t0 = _mm512_sllv_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(Pr)),
                                           _mm512_cvtepi32_epi64(_mm512_castsi512_si256(lc)));
            __m512i t1 = _mm512_sllv_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(Pr, 1)),
                                           _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(lc, 1)));
            acc[j] = _mm512_add_epi64(acc[j], _mm512_add_epi64(t0, t1));
        }
    }
    for (int j = 0; j < TILE; j++)
        S[j] = _mm512_reduce_add_epi64(acc[j]);
}

/* Row r of W prepared in the thread's scratch: ew (nbp int16, padded), wsum (nbp int32, mx8),
 * wi (the interleaved mantissas) and, for mx16, stage (the row widened to int16 first). */
TGT static void prepare_w_row(const kiln_mx_matrix *w, int64_t r, int64_t nbp, int16_t *ew,
                              int32_t *wsum, uint8_t *wi, int16_t *stage) {
    const int64_t nb = w->nb, L = nb * KILN_MX_BLOCK;
    const int8_t *q = w->q + r * L;
    for (int64_t b = 0; b < nbp; b++)
        ew[b] = b < nb ? w->e[r * nb + b] : KILN_MX_EXP_ZERO;
    if (w->kind == KILN_MX8) {
        for (int64_t b = 0; b < nbp; b++) {
            int32_t s = 0;
            if (b < nb)
                for (int i = 0; i < KILN_MX_BLOCK; i++)
                    s += q[b * KILN_MX_BLOCK + i];
            wsum[b] = s;
        }
        kiln_mx_interleave16(wi, (const uint8_t *)q, nb, nbp, 8);
        return;
    }
    const int8_t *lo = w->lo + r * L;
    for (int64_t i = 0; i < L; i += 32) {
        __m512i h = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + i)));
        __m512i l = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(lo + i)));
        _mm512_storeu_si512(stage + i, _mm512_add_epi16(_mm512_slli_epi16(h, 7), l));
    }
    kiln_mx_interleave16(wi, (const uint8_t *)stage, nb, nbp, 16);
}

/* Columns [r0, r1) in tiles of TILE rows of W (a short last tile repeats its last row and
 * drops the copies' outputs): every output is still the definition's, alone. */
TGT static void v_rows(const kiln_mx_product *p, int64_t r0, int64_t r1, int thread) {
    const kiln_mx_matrix *x = p->x, *w = p->w;
    const int64_t nbp = p->nbp, N = x->rows;
    const int mx8 = x->kind == KILN_MX8;
    const int F = mx8 ? KILN_MX8_F : KILN_MX16_F, SH = mx8 ? KILN_MX8_SH : KILN_MX16_SH;
    uint8_t *sc = p->scratch + (size_t)thread * p->scratch_stride;
    int16_t *ew[TILE];
    int32_t *wsum[TILE];
    uint8_t *wi[TILE];
    int16_t *stage = NULL;
    for (int j = 0; j < TILE; j++) {
        uint8_t *rs = sc + (size_t)j * KILN_MX_ROW_SCRATCH(nbp);
        ew[j] = (int16_t *)rs;
        wsum[j] = (int32_t *)(rs + nbp * 2);
        wi[j] = rs + nbp * 6;
        stage = (int16_t *)(rs + nbp * (6 + 2 * KILN_MX_BLOCK)); /* any row's: used in turn */
    }
    for (int64_t rt = r0; rt < r1; rt += TILE) {
        int nw = r1 - rt < TILE ? (int)(r1 - rt) : TILE;
        for (int j = 0; j < TILE; j++)
            prepare_w_row(w, rt + (j < nw ? j : nw - 1), nbp, ew[j], wsum[j], wi[j], stage);
        for (int64_t n = 0; n < N; n++) {
            const int16_t *ex = p->xe + n * nbp;
            const uint8_t *xi = p->xm + (size_t)n * p->xm_stride;
            int smax[TILE], smsh[TILE];
            for (int j = 0; j < TILE; j++) {
                smax[j] = exp_sum_max(ex, ew[j], nbp);
                smsh[j] = smax[j] - SH;
            }
            int64_t S[TILE];
            if (mx8)
                sum_tile(xi, wi, wsum, ex, ew, nbp, smsh, 0, S);
            else
                sum_tile(xi, wi, wsum, ex, ew, nbp, smsh, 1, S);
            for (int j = 0; j < nw; j++) {
                float v;
                if (x->row_nonfinite[n] || w->row_nonfinite[rt + j])
                    v = kiln_mx_nan();
                else if (smax[j] < MX_SUM_NONE)
                    v = 0.0f; /* no contributing block */
                else
                    v = kiln_mx_round(S[j], smax[j] - 2 * F - SH);
                p->out[n * p->ldo + rt + j] = v;
            }
        }
    }
}

const kiln_mx_kernels kiln_mx_kernels_avx512vnni = {
    .name = "avx512vnni",
    .layout = KILN_MX_LAYOUT_INTERLEAVED,
    .w_rows = TILE,
    .rows = v_rows,
};

#endif /* __x86_64__ */
