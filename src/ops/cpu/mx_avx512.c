/*
 * mx_avx512.c -- the exact block formats' product with AVX-512 VNNI: the bits of mx_cpu.c's
 * reference (docs/ARITHMETIC.md, "Exact block formats (mx8, mx16)"), checked by
 * tests/c/test_mx.c. Used on the AVX512 path when the CPU has AVX512_VNNI and AVX512_DQ.
 *
 * The lanes of a vector are 16 rows of W (a tile), so that every output of the tile builds up
 * in its own lane and nothing is padded along K (a row of any number of blocks costs its
 * blocks). The tile is regrouped once per call (a 16 x 16 transpose of 4-byte units): unit s
 * of block b of tile row j goes to wt[((b * U + s) * 16 + j) * 4], U = 8 units a block for
 * mx8, 16 for mx16 (as int16). A row
 * of x is read in place, each 4-byte unit broadcast to the 16 lanes:
 *   - mx8: 8 vpdpbusd a block on (q_x + 128) as uint8 x q_w as int8, then
 *     P_k = that - 128 * sum_i q_w,i (the tile rows' block sums). Every intermediate is
 *     exact: |.| <= 32 * 255 * 127 < 2^21.
 *   - mx16: 16 vpdpwssd a block on the int16 mantissas hi*128 + lo (each lane's running
 *     sum < 32 * 8191^2 < 2^31).
 * Then, as mx_avx2.c, T_k by vpsravd (floor) and vpsllvq (<= SH) in int64 lanes. emax comes
 * first, lane by lane, from the exponents alone. Each pass keeps KILN_MX_TILE_XROWS rows of x's
 * running sums in scratch and walks K in chunks of CHUNK blocks, so that the chunk of the tile
 * (32 KB for mx16) stays in L1 while 4 rows of x at a time stream past it.
 */
#include "mx_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <string.h>

#define TGT __attribute__((target("avx2,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define TGT_INLINE                                                                                 \
    __attribute__((target("avx2,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"),                   \
                   always_inline)) static inline

#include "mx_simd.h"

#define LANES KILN_MX_TILE_ROWS /* rows of W a tile */
#define XR 4                    /* rows of x a vector pass */
#define CHUNK 32                /* blocks of K a pass */

/* A tile's arrays in the thread's scratch (64-byte aligned). */
typedef struct tile {
    uint8_t *wt;    /* (nb, U, 16 lanes, 4 bytes) the mantissas, regrouped */
    int32_t *ew;    /* (nb, 16) exponents; a lane past the tile's rows KILN_MX_EXP_ZERO */
    int32_t *wsum;  /* (nb, 16) mx8: 128 * the block's sum of q_w */
    int32_t *smsh;  /* (KILN_MX_TILE_XROWS, 16) emax - SH of each output */
    int64_t *acc;   /* (KILN_MX_TILE_XROWS, 16) the running sums S */
} tile;

static uint8_t *align64(uint8_t *p) {
    return (uint8_t *)(((uintptr_t)p + 63) & ~(uintptr_t)63);
}

/* r[0..15] (16 dwords each) transposed: dst + k * 64 gets dword k of every r[j], lane j, for
 * k < nk. */
TGT_INLINE void transpose16(__m512i r[16], uint8_t *dst, int nk) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* u[4i + c], 128-bit lane L: dword 4L + c of rows 4i .. 4i + 3 */
    for (int i = 0; i < 4; i++) {
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
        const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88),
                      w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
        const __m512i o[4] = {_mm512_shuffle_i32x4(v0, w0, 0x88), _mm512_shuffle_i32x4(v1, w1, 0x88),
                              _mm512_shuffle_i32x4(v0, w0, 0xdd), _mm512_shuffle_i32x4(v1, w1, 0xdd)};
        for (int L = 0; L < 4; L++)
            if (4 * L + c < nk) _mm512_store_si512(dst + (4 * L + c) * 64, o[L]);
    }
}

/* Rows [rt, rt + nw) of W into the tile (lanes nw..15: zero blocks). The mantissas go 64
 * bytes a row at a time through a 16 x 16 dword transpose: one block a step for mx16 (as
 * int16), two for mx8. */
TGT static void prepare_tile(const kiln_mx_matrix *w, int64_t rt, int nw, const tile *t) {
    const int64_t nb = w->nb, L = nb * KILN_MX_BLOCK;
    const int mx16 = w->kind == KILN_MX16;
    for (int j = 0; j < LANES; j++)
        for (int64_t b = 0; b < nb; b++)
            t->ew[b * LANES + j] = j < nw ? w->e[(rt + j) * nb + b] : KILN_MX_EXP_ZERO;
    __m512i r[16];
    if (mx16) {
        for (int64_t b = 0; b < nb; b++) {
            for (int j = 0; j < LANES; j++) {
                if (j >= nw) {
                    r[j] = _mm512_setzero_si512();
                    continue;
                }
                const int64_t o = (rt + j) * L + b * KILN_MX_BLOCK;
                __m512i h = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w->q + o)));
                __m512i l = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w->lo + o)));
                r[j] = _mm512_add_epi16(_mm512_slli_epi16(h, 7), l);
            }
            transpose16(r, t->wt + b * 16 * 64, 16);
        }
        return;
    }
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t b = 0; b < nb; b += 2) {
        const int two = b + 1 < nb;
        for (int j = 0; j < LANES; j++) {
            const int8_t *q = w->q + (rt + j) * L + b * KILN_MX_BLOCK;
            r[j] = j >= nw ? _mm512_setzero_si512()
                   : two   ? _mm512_loadu_si512(q)
                           : _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)q));
            if (!two && j < nw) r[j] = _mm512_inserti64x4(r[j], _mm256_setzero_si256(), 1);
        }
        uint8_t *dst = t->wt + b * 8 * 64;
        transpose16(r, dst, two ? 16 : 8);
        /* each lane's block sums, 128 x: vpdpbusd of 1s (as uint8) and the units */
        for (int k = 0; k <= two; k++) {
            __m512i s = _mm512_setzero_si512();
            for (int u = 0; u < 8; u++)
                s = _mm512_dpbusd_epi32(s, ones, _mm512_load_si512(dst + (k * 8 + u) * 64));
            _mm512_store_si512(t->wsum + (b + k) * LANES, _mm512_slli_epi32(s, 7));
        }
    }
}

/* Blocks [b0, b1) of NX (1..XR, a constant) rows of x, xr[i] row i's mantissas and xe[i] its
 * exponents, into the running sums acc[i] (shifts smsh[i]) of the tile's 16 outputs. */
TGT_INLINE void pass(const tile *t, const uint8_t *const xr[XR], const int16_t *const xe[XR],
                     int32_t *smsh, int64_t *acc, int64_t b0, int64_t b1, const int MX16,
                     const int NX) {
    const int U = MX16 ? 16 : 8;
    const __m512i z = _mm512_setzero_si512();
    __m512i alo[XR], ahi[XR], sm[XR];
    for (int i = 0; i < NX; i++) {
        alo[i] = _mm512_loadu_si512(acc + i * LANES);
        ahi[i] = _mm512_loadu_si512(acc + i * LANES + 8);
        sm[i] = _mm512_loadu_si512(smsh + i * LANES);
    }
    for (int64_t b = b0; b < b1; b++) {
        __m512i P[XR];
        for (int i = 0; i < NX; i++)
            P[i] = z;
        const uint8_t *wb = t->wt + b * U * 64;
        for (int s = 0; s < U; s++) {
            const __m512i wv = _mm512_load_si512(wb + s * 64);
            for (int i = 0; i < NX; i++) {
                int32_t xv;
                memcpy(&xv, xr[i] + (b * U + s) * 4, 4);
                P[i] = MX16 ? _mm512_dpwssd_epi32(P[i], _mm512_set1_epi32(xv), wv)
                            : _mm512_dpbusd_epi32(P[i], _mm512_set1_epi32(xv), wv);
            }
        }
        const __m512i ew = _mm512_load_si512(t->ew + b * LANES);
        const __m512i ws = MX16 ? z : _mm512_load_si512(t->wsum + b * LANES);
        for (int i = 0; i < NX; i++) {
            if (!MX16) P[i] = _mm512_sub_epi32(P[i], ws); /* (q_x + 128) q_w less 128 sum q_w */
            __m512i d = _mm512_sub_epi32(_mm512_add_epi32(_mm512_set1_epi32(xe[i][b]), ew), sm[i]);
            __m512i rc = _mm512_max_epi32(_mm512_sub_epi32(z, d), z); /* base - e_k if > 0 */
            __m512i lc = _mm512_max_epi32(d, z);                      /* e_k - base if > 0 */
            __m512i Pr = _mm512_srav_epi32(P[i], rc); /* floor(P / 2^rc); counts >= 32: 0 or -1 */
            alo[i] = _mm512_add_epi64(alo[i], _mm512_sllv_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(Pr)),
                                                                _mm512_cvtepi32_epi64(_mm512_castsi512_si256(lc))));
            ahi[i] = _mm512_add_epi64(ahi[i], _mm512_sllv_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(Pr, 1)),
                                                                _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(lc, 1))));
        }
    }
    for (int i = 0; i < NX; i++) {
        _mm512_storeu_si512(acc + i * LANES, alo[i]);
        _mm512_storeu_si512(acc + i * LANES + 8, ahi[i]);
    }
}

/* pass() with NX = nx, MX16 = mx16 as constants. */
TGT static void pass_n(const tile *t, const uint8_t *const xr[XR], const int16_t *const xe[XR],
                       int32_t *smsh, int64_t *acc, int64_t b0, int64_t b1, int mx16, int nx) {
#define PASS(M, N)                                                                                 \
    case (M) * 8 + (N): pass(t, xr, xe, smsh, acc, b0, b1, M, N); break;
    switch (mx16 * 8 + nx) {
        PASS(0, 1) PASS(0, 2) PASS(0, 3) PASS(0, 4) PASS(1, 1) PASS(1, 2) PASS(1, 3) PASS(1, 4)
    default: break;
    }
#undef PASS
}

/* The outputs of row n of x and the tile's nw rows from S (acc, 16 int64) and smsh: one
 * rounding each (kiln_mx_round), NaN for a non-finite row, +0 where no block contributes. */
TGT static void finish(const kiln_mx_product *p, int64_t n, int64_t rt, int nw, const int64_t *acc,
                       const int32_t *smsh, __mmask16 w_nonfinite) {
    const int mx8 = p->x->kind == KILN_MX8;
    const int F = mx8 ? KILN_MX8_F : KILN_MX16_F, SH = mx8 ? KILN_MX8_SH : KILN_MX16_SH;
    float *out = p->out + n * p->ldo + rt;
    const __mmask16 valid = (__mmask16)((1u << nw) - 1);
    /* p = emax - 2F - SH = smsh - 2F; the inline rounding holds for S != 0, -126 <= p <= 63 */
    const __m512i sv = _mm512_loadu_si512(smsh);
    const __m512i pv = _mm512_sub_epi32(sv, _mm512_set1_epi32(2 * F));
    const __m512i lo = _mm512_loadu_si512(acc), hi = _mm512_loadu_si512(acc + 8);
    __mmask16 slow = _mm512_cmplt_epi32_mask(pv, _mm512_set1_epi32(-126)) |
                     _mm512_cmpgt_epi32_mask(pv, _mm512_set1_epi32(63)) |
                     _mm512_cmplt_epi32_mask(sv, _mm512_set1_epi32(MX_SUM_NONE - SH));
    if (p->x->row_nonfinite[n]) slow = 0xffff;
    slow |= w_nonfinite;
    const __m512 f = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtepi64_ps(lo)), _mm512_cvtepi64_ps(hi), 1);
    const __m512 two_p = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(pv, _mm512_set1_epi32(127)), 23));
    /* S == 0 gives 0 * 2^p = +0, as kiln_mx_round does */
    const __mmask16 fast = valid & (__mmask16)~slow;
    __m512 prod = _mm512_mul_ps(f, two_p);
    if (p->accumulate) prod = _mm512_add_ps(_mm512_maskz_loadu_ps(fast, out), prod);
    _mm512_mask_storeu_ps(out, fast, prod);
    for (unsigned m = slow & valid; m; m &= m - 1) {
        const int j = __builtin_ctz(m);
        float v;
        if (p->x->row_nonfinite[n] || ((w_nonfinite >> j) & 1))
            v = kiln_mx_nan();
        else if (smsh[j] + SH < MX_SUM_NONE)
            v = 0.0f; /* no contributing block */
        else
            v = kiln_mx_round(acc[j], smsh[j] - 2 * F);
        kiln_mx_store(p, n, rt + j, v);
    }
}

/* Columns [r0, r1) (r0 a multiple of 16 but for a last short tile) in tiles of 16 rows of W. */
TGT static void v_rows(const kiln_mx_product *p, int64_t r0, int64_t r1, int thread) {
    const kiln_mx_matrix *x = p->x, *w = p->w;
    const int64_t N = x->rows, nb = x->nb;
    const int mx16 = x->kind == KILN_MX16;
    const int SH = mx16 ? KILN_MX16_SH : KILN_MX8_SH;
    uint8_t *sc = p->scratch + (size_t)thread * p->scratch_stride;
    tile t;
    t.wt = align64(sc);
    t.ew = (int32_t *)align64(t.wt + (size_t)nb * 1024);
    t.wsum = (int32_t *)align64((uint8_t *)(t.ew + nb * LANES));
    t.smsh = (int32_t *)align64((uint8_t *)(t.wsum + nb * LANES));
    t.acc = (int64_t *)align64((uint8_t *)(t.smsh + KILN_MX_TILE_XROWS * LANES));
    for (int64_t rt = r0; rt < r1; rt += LANES) {
        const int nw = r1 - rt < LANES ? (int)(r1 - rt) : LANES;
        prepare_tile(w, rt, nw, &t);
        __mmask16 w_nonfinite = 0;
        for (int j = 0; j < nw; j++)
            w_nonfinite |= (__mmask16)((w->row_nonfinite[rt + j] != 0) << j);
        for (int64_t n0 = 0; n0 < N; n0 += KILN_MX_TILE_XROWS) {
            const int64_t nn = N - n0 < KILN_MX_TILE_XROWS ? N - n0 : KILN_MX_TILE_XROWS;
            /* the outputs an adding product reads back, fetched while the block computes */
            if (p->accumulate)
                for (int64_t i = 0; i < nn; i++)
                    _mm_prefetch((const char *)(p->out + (n0 + i) * p->ldo + rt), _MM_HINT_T0);
            /* emax of each output, saturated as exp_sum_max (a zero block's sum far below) */
            for (int64_t i = 0; i < nn; i++) {
                const int16_t *ex = p->xe + (n0 + i) * p->nbp;
                __m512i m = _mm512_set1_epi32(INT16_MIN);
                for (int64_t b = 0; b < nb; b++) {
                    __m512i s = _mm512_add_epi32(_mm512_set1_epi32(ex[b]), _mm512_load_si512(t.ew + b * LANES));
                    m = _mm512_max_epi32(m, _mm512_max_epi32(s, _mm512_set1_epi32(INT16_MIN)));
                }
                _mm512_storeu_si512(t.smsh + i * LANES, _mm512_sub_epi32(m, _mm512_set1_epi32(SH)));
                _mm512_storeu_si512(t.acc + i * LANES, _mm512_setzero_si512());
                _mm512_storeu_si512(t.acc + i * LANES + 8, _mm512_setzero_si512());
            }
            for (int64_t b0 = 0; b0 < nb; b0 += CHUNK) {
                const int64_t b1 = nb - b0 < CHUNK ? nb : b0 + CHUNK;
                for (int64_t i = 0; i < nn; i += XR) {
                    const int nx = nn - i < XR ? (int)(nn - i) : XR;
                    const uint8_t *xr[XR];
                    const int16_t *xe[XR];
                    for (int k = 0; k < XR; k++) {
                        const int64_t n = n0 + i + (k < nx ? k : nx - 1);
                        xr[k] = p->xm + (size_t)n * p->xm_stride;
                        xe[k] = p->xe + n * p->nbp;
                    }
                    pass_n(&t, xr, xe, t.smsh + i * LANES, t.acc + i * LANES, b0, b1, mx16, nx);
                }
            }
            for (int64_t i = 0; i < nn; i++)
                finish(p, n0 + i, rt, nw, t.acc + i * LANES, t.smsh + i * LANES, w_nonfinite);
        }
    }
}

const kiln_mx_kernels kiln_mx_kernels_avx512vnni = {
    .name = "avx512vnni",
    .layout = KILN_MX_LAYOUT_ROWS,
    .w_rows = LANES,
    .rows = v_rows,
};

#endif /* __x86_64__ */
