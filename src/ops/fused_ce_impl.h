/*
 * fused_ce_impl.h -- what the backends' bodies of the fused linear cross-entropy share
 * (src/ops/fused_ce.c): the scratch layout, the views of weight chunks and scratch for the
 * backend's matmul, the per-row loss and its reductions. For the op's implementations only
 * (src/ops/cpu/cpu_fused_ce.c, src/ops/cuda/cuda_fused_ce_op.c); callers use fused_ce.h.
 */
#ifndef KILN_OPS_FUSED_CE_IMPL_H
#define KILN_OPS_FUSED_CE_IMPL_H

#include "fused_ce.h"

/* ---- scratch ------------------------------------------------------------------------------ */

typedef struct kiln_ce_scratch {
    int64_t *idx;    /* (S) positions of the supervised rows, ascending */
    float *m, *l;    /* (S) running max and sum of exponentials */
    float *zt;       /* (S) the target's logit */
    float *loss;     /* (S) loss_i */
    float *ones;     /* (max(cn, S)) 1.0f: sums as dots with ones */
    float *hs;       /* (S, H) gathered hidden rows */
    float *z;        /* (S, cn) logits of one chunk, then g in place */
    float *hT;       /* (H, S) hs transposed (dW only) */
    float *gT;       /* (cn, S) g transposed (dW only) */
    float *wpart;    /* (cn, H) this chunk's dW (dW only) */
    float *dh_acc;   /* (S, H) dh of the supervised rows (dh only) */
    float *dpart;    /* (S, H) this chunk's dh (dh only) */
    float *wT;       /* (H, cn) W chunk transposed, as f32 (dh only) */
    uint16_t *hsb;   /* (Sp, ld(H)) hs in bf16 (KILN_CE_BF16) */
    uint16_t *gb;    /* (Sp, ld(cn)) g in bf16, ld(n) per chunk (KILN_CE_BF16, dh or dW) */
    uint16_t *wb;    /* (cn, ld(H)) W chunk in bf16 (KILN_CE_BF16, dh, W not read in place) */
} kiln_ce_scratch;

/* Which regions a call takes:
 *   KILN_CE_FULL: the CPU and the auditable CUDA path (every f32 region, Sp == S);
 *   KILN_CE_LEAN: fast mode's composition of the backend's matmul and matmul_backward
 *                 (cuda_fused_ce_op.c, ce_pass2_fast): hs, z and dh_acc with Sp rows, none of
 *                 hT, gT, wpart, dpart, wT;
 *   KILN_CE_BF16: fast mode on bf16 operands (ce_pass2_bf16): z (S rows, f32: pass 1's
 *                 statistics and g are computed from f32 logits), hsb, gb, wb and dh_acc; no
 *                 f32 hs;
 *   KILN_CE_ROWS: fast mode's row-block walk (ce_rows_bf16): hsb, dh_acc and z with rb rows of
 *                 cn = ld(V) floats (a block's whole f32 logits, then its g in place) or
 *                 ld(V) / 2 (its bf16 logits: kiln_ce_rows_zcols); no gb, wb. */
typedef enum kiln_ce_kind { KILN_CE_FULL, KILN_CE_LEAN, KILN_CE_BF16, KILN_CE_ROWS } kiln_ce_kind;

/* Leading dimension of a bf16 operand: cols rounded up to 8 elements (16 bytes), as the GEMM
 * module and kiln_cuda_matmul_backward_fast pad their own copies (padded_ld): a product's
 * algorithm, hence its bits, depends on the leading dimensions. */
static inline int64_t kiln_ce_bf16_ld(int64_t cols) { return (cols + 7) & ~(int64_t)7; }

/* Carve the scratch regions from one block (fused_ce.c says how); returns the total bytes (0
 * on overflow), with base NULL only sizes. */
size_t kiln_ce_layout(int64_t S, int64_t Sp, int64_t H, int64_t cn, int with_dh, int with_dw,
                      kiln_ce_kind kind, int w_copy, int64_t rb, uint8_t *base,
                      kiln_ce_scratch *sc);

/* The row-block walk's rows per block: row_block (> 0) rounded up to 8, at most Sp (a multiple
 * of 8). */
static inline int64_t kiln_ce_rows_of(int64_t row_block, int64_t Sp) {
    return row_block > Sp ? Sp : (row_block + 7) & ~(int64_t)7;
}

/* Whether the row-block walk keeps its logits in bf16: unless the caller asks for f32
 * (params.row_logits_f32) or V is past the bf16 row kernel's bound. */
static inline int kiln_ce_rows_z16(int64_t V, int logits_f32) {
    return !logits_f32 && V <= KILN_FUSED_CE_ROWS16_MAX_V;
}

/* The row-block walk's z columns, in floats (kiln_ce_layout's unit): ld(V) f32 logits, or
 * ld(V) bf16 ones in half as many floats (ld(V) is even). */
static inline int64_t kiln_ce_rows_zcols(int64_t V, int z16) {
    return z16 ? kiln_ce_bf16_ld(V) / 2 : kiln_ce_bf16_ld(V);
}

/* Vocabulary columns per chunk of a call: params.chunk (0: KILN_FUSED_CE_DEFAULT_CHUNK), at
 * most V. */
static inline int64_t kiln_ce_chunk(const kiln_fused_ce_params *p) {
    int64_t cn = p->chunk == 0 ? KILN_FUSED_CE_DEFAULT_CHUNK : p->chunk;
    return cn > p->V ? p->V : cn;
}

/* ---- views for the backend's matmul ------------------------------------------------------- */

/* The (n, H) tensor view of the weight rows [c0, c0+n). */
kiln_tensor kiln_ce_weight_chunk(const kiln_fused_ce_params *p, int64_t c0, int64_t n,
                                 size_t row_bytes);
/* z(S, n) = hs(S, H) @ W[c0 : c0+n]^T with the backend's matmul. */
void kiln_ce_chunk_logits(kiln_backend *be, const kiln_fused_ce_params *p, const float *hs,
                          int64_t S, int64_t c0, int64_t n, size_t row_bytes, float *z);
/* A (R, C) f32 tensor view of caller scratch, for the backend's matmul. */
kiln_tensor kiln_ce_f32_view(const char *name, const float *data, int64_t R, int64_t C);

/* ---- the loss ----------------------------------------------------------------------------- */

/* loss_i = (m - zt) + log(l) for the S rows; a non-finite one is an error naming its
 * position (idx: the rows' positions). */
kiln_status kiln_ce_row_losses(const int64_t *idx, const float *m, const float *l,
                               const float *zt, float *loss, int64_t S);
/* The reduced loss, the gradient factor and the float64 loss from the row losses and their
 * lane-16 sum (row_loss NULL: the factor gs alone, which depends on S and the reduction only). */
void kiln_ce_reduce(const kiln_fused_ce_params *p, const float *row_loss, float sum, int64_t S,
                    float *loss, float *gs, double *loss64);
/* The lane-16 sum of v[0..n) on the host: the CPU backend's bits on any SIMD path. */
float kiln_ce_host_sum16(const float *v, int64_t n);

#endif /* KILN_OPS_FUSED_CE_IMPL_H */
