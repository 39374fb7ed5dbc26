/*
 * backward.h -- the CPU backend's backward ops (training), internal to src/ops/cpu.
 *
 * The op drivers live in backward_portable.c (thread pool jobs, called by cpu_backend.c's
 * table entries); the hot inner loops come in one small table per SIMD path, like
 * cpu_kernels.h. Every path gives the SAME bits: the orders are defined in
 * docs/ARITHMETIC.md ("Backward ops"), each output element is computed by one task alone,
 * and no result depends on how outputs are grouped into tasks or tiles.
 */
#ifndef KILN_CPU_BACKWARD_H
#define KILN_CPU_BACKWARD_H

#include "../../base/threadpool.h"
#include "cpu_kernels.h"

#include <stdbool.h>

/* The lane-16 GEMM tile: rows per tile and columns per tile. */
#define KILN_BWD_MR 6
#define KILN_BWD_NC 16

/* Operand B of the lane-16 GEMM: row k (k < K) starts at b + k*row_bytes, dtype F32, BF16
 * or F16 (widened exactly to f32). */
typedef struct kiln_bwd_b {
    const uint8_t *b;
    size_t row_bytes;
    kiln_dtype dtype;
} kiln_bwd_b;

typedef struct kiln_bwd_kernels {
    /* The lane partial sums of a tile of mi <= MR rows by nc <= NC columns over k in
     * [k0, k1), k0 a multiple of 16: for every j < 16, i < mi, c < nc, in increasing k with
     * k % 16 == j:  P[(j*MR + i)*NC + c] = fmaf(A[i*asi + k*ask], B(k, c), P[...]).
     * P holds the partials so far; first: the partials start at +0 instead (P's contents
     * are not read). Elements of P outside i < mi, c < nc are unspecified afterwards. */
    void (*tile)(float *P, const float *A, int64_t asi, int64_t ask, const kiln_bwd_b *B,
                 int64_t c0, int64_t k0, int64_t k1, int mi, int nc, int first);
    /* tile's arithmetic (nc = 16) on a packed panel instead of B: pk holds B(k, 0..15) as f32
     * for k in [k0, k1), lane by lane: row k at pk + ((k - k0) % 16 * mstride + (k - k0) / 16)
     * * 16, so each lane's rows are consecutive. NULL in a table without it. */
    void (*tile_packed)(float *P, const float *A, int64_t asi, int64_t ask, const float *pk,
                        int64_t mstride, int64_t k0, int64_t k1, int mi, int first);
    /* tile_packed on two panels at once (columns c0 .. c0 + 31): P0 and P1 as tile_packed's P
     * for the panels at pk0 and pk1 (the same layout and mstride). NULL in a table without
     * it. */
    void (*tile_packed2)(float *P0, float *P1, const float *A, int64_t asi, int64_t ask,
                         const float *pk0, const float *pk1, int64_t mstride, int64_t k0,
                         int64_t k1, int mi, int first);
    /* Column lanes over rows n in [n0, n1), n0 a multiple of 16, for c < w:
     * acc[(n % 16)*w + c] = fmaf(a[n*ld + c], bv, acc[...]) with bv = b[n*ld + c] * s[n]
     * (s NULL: bv = b[n*ld + c]; b NULL: bv = 1, i.e. a plain sum of a). */
    void (*col_lanes)(float *acc, const float *a, const float *b, const float *s, int64_t ld,
                      int64_t n0, int64_t n1, int w);
} kiln_bwd_kernels;

extern const kiln_bwd_kernels kiln_bwd_kernels_portable;
#if defined(__x86_64__)
extern const kiln_bwd_kernels kiln_bwd_kernels_avx2;
extern const kiln_bwd_kernels kiln_bwd_kernels_avx512;
#endif

/* B(k, c) as f32 (exact widening). */
static inline float kiln_bwd_b_at(const kiln_bwd_b *B, int64_t k, int64_t c) {
    const uint8_t *row = B->b + (size_t)k * B->row_bytes;
    uint16_t h;
    switch (B->dtype) {
    case KILN_DTYPE_BF16:
        memcpy(&h, row + 2 * c, 2);
        return kiln_bf16_to_fp32(h);
    case KILN_DTYPE_F16:
        memcpy(&h, row + 2 * c, 2);
        return kiln_fp16_to_fp32(h);
    default: {
        float f;
        memcpy(&f, row + 4 * c, 4);
        return f;
    }
    }
}

/* The reference tile (plain C). The SIMD files compile this same body under their target
 * (for tails), so fmaf becomes one instruction there. */
static inline void kiln_bwd_tile_generic(float *P, const float *A, int64_t asi, int64_t ask,
                                         const kiln_bwd_b *B, int64_t c0, int64_t k0,
                                         int64_t k1, int mi, int nc, int first) {
    if (first) memset(P, 0, sizeof(float) * KILN_DOT_LANES * KILN_BWD_MR * KILN_BWD_NC);
    float brow[KILN_BWD_NC];
    for (int64_t k = k0; k < k1; k++) {
        int j = (int)(k % 16);
        for (int c = 0; c < nc; c++) brow[c] = kiln_bwd_b_at(B, k, c0 + c);
        for (int i = 0; i < mi; i++) {
            float a = A[i * asi + k * ask];
            float *p = P + ((int64_t)j * KILN_BWD_MR + i) * KILN_BWD_NC;
            for (int c = 0; c < nc; c++) p[c] = fmaf(a, brow[c], p[c]);
        }
    }
}

static inline void kiln_bwd_col_lanes_generic(float *acc, const float *a, const float *b,
                                              const float *s, int64_t ld, int64_t n0,
                                              int64_t n1, int w) {
    for (int64_t n = n0; n < n1; n++) {
        float *l = acc + (n % 16) * w;
        const float *ar = a + n * ld;
        if (!b) {
            for (int c = 0; c < w; c++) l[c] = fmaf(ar[c], 1.0f, l[c]);
        } else if (!s) {
            const float *br = b + n * ld;
            for (int c = 0; c < w; c++) l[c] = fmaf(ar[c], br[c], l[c]);
        } else {
            const float *br = b + n * ld;
            float sn = s[n];
            for (int c = 0; c < w; c++) l[c] = fmaf(ar[c], br[c] * sn, l[c]);
        }
    }
}

/* The bwd kernel table for a path (AVX-512 uses the AVX2 table: same bits). */
const kiln_bwd_kernels *kiln_bwd_kernels_for(kiln_cpu_path p);

/* ---- the op drivers (contracts: ops.h) ------------------------------------------------- */

void kiln_cpu_matmul_backward(kiln_pool *pool, const kiln_cpu_kernels *k, float *dx, float *dW,
                              float *dbias, const float *dy, const float *x,
                              const kiln_tensor *W, int N, bool accumulate_dx);
void kiln_cpu_rmsnorm_backward(kiln_pool *pool, const kiln_cpu_kernels *k, float *dx, float *dw,
                               const float *dy, const float *x, const float *w, int N, int C,
                               float eps, float *rstd, bool accumulate_dx);
void kiln_cpu_rope_backward(kiln_pool *pool, float *d, const int32_t *pos, int N, int H, int HS,
                            const float *cos_tab, const float *sin_tab);
void kiln_cpu_attention_backward(kiln_pool *pool, const kiln_cpu_kernels *k, float *dq,
                                 float *dk, float *dv, const float *dout, const float *q,
                                 const float *kc, const float *vc, const float *out, float *ws,
                                 int N, int n_past, int NH, int KVH, int HS, float scale,
                                 int window);
void kiln_cpu_swiglu_backward(kiln_pool *pool, const kiln_cpu_kernels *k, float *dgate,
                              float *dup, const float *dout, const float *gate, const float *up,
                              size_t n);
void kiln_cpu_geglu_backward(kiln_pool *pool, float *dgate, float *dup, const float *dout, const float *gate,
                             const float *up, size_t n);
void kiln_cpu_embed_backward(kiln_pool *pool, float *dtable, const float *dy, const int32_t *ids,
                             int N, int V, int C);

#endif /* KILN_CPU_BACKWARD_H */
