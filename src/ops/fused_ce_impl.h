/*
 * fused_ce_impl.h -- what the backends' bodies of the fused linear cross-entropy share
 * (src/ops/fused_ce.c): the scratch layout, the views of weight chunks and scratch for the
 * backend's matmul, the per-row loss and its reductions; and what the distillation loss takes
 * from them (src/ops/fused_kd.c: its view of itself as a cross-entropy call, its scratch and
 * row losses). For the ops' implementations only (src/ops/cpu/cpu_fused_ce.c,
 * src/ops/cpu/cpu_fused_kd.c, src/ops/cuda/cuda_fused_ce_op.c); callers use fused_ce.h and
 * fused_kd.h.
 */
#ifndef KILN_OPS_FUSED_CE_IMPL_H
#define KILN_OPS_FUSED_CE_IMPL_H

#include "fused_ce.h"
#include "fused_kd.h"

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

/* ---- the call's checks -------------------------------------------------------------------- */

/* kiln_fused_ce's checks of p's sizes, pointers and scalars on backend be (not whether be has
 * the op, nor the rows), with op naming the call in the messages. */
kiln_status kiln_ce_check_call(const char *op, const kiln_backend *be,
                               const kiln_fused_ce_params *p);
/* kiln_fused_ce_supervised with op naming the call in the messages. */
kiln_status kiln_ce_count_supervised(const char *op, const kiln_fused_ce_params *p,
                                     int64_t *S);

/* ---- the loss ----------------------------------------------------------------------------- */

/* One row's cross-entropy from its max logit m, sum of exponentials l (at m) and target logit
 * zt: (m - zt) + log(l), both terms >= 0. */
static inline float kiln_ce_row_loss(float m, float l, float zt) {
    return (m - zt) + kiln_fused_ce_logf(l);
}

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

/* ---- the distillation loss (fused_kd.c) ------------------------------------------------------ */

/* A distillation call's row state beyond the cross-entropy's scratch, whose m, l, zt are the
 * student at temperature 1 and whose loss holds loss_n. Each (S), supervised order. */
typedef struct kiln_kd_rows {
    float *ms, *ls;  /* the student at tau: running max of s/tau, sum of exp(s/tau - ms) */
    float *mt, *lt;  /* the teacher at tau: the same for Z/tau */
    float *a;        /* sum_v exp(Z_v/tau - mt) * (Z_v/tau - s_v/tau), rescaled as mt moves */
    float *kl, *ce;  /* kl_n and ce_n (unweighted) */
    int64_t *bad;    /* the row's first non-finite teacher column, or -1 */
} kiln_kd_rows;

/* The cross-entropy call a distillation call shares its student side with: N, H, V, hidden,
 * hidden_ld, weight, weight_dtype, targets, mask, reduction, scale, chunk, dhidden,
 * dhidden_accumulate and dweight; the rest kiln_fused_ce_default_params'. */
kiln_fused_ce_params kiln_kd_ce_view(const kiln_fused_kd_params *p);

/* Carve a distillation call's scratch from one block: kiln_ce_layout's KILN_CE_FULL regions
 * for (S, H, cn, with_dh, with_dw) into sc, then rows' regions into rows (64-byte aligned).
 * Returns the total bytes (0 on overflow); with base NULL only sizes. */
size_t kiln_kd_layout(int64_t S, int64_t H, int64_t cn, int with_dh, int with_dw, uint8_t *base,
                      kiln_ce_scratch *sc, kiln_kd_rows *rows);

/* After pass 1: each row's kl_n, ce_n (rows->kl, rows->ce) and loss_n (sc->loss) from its
 * statistics (docs/ARITHMETIC.md, "Fused distillation loss"). A supervised row with a
 * non-finite teacher logit, or a non-finite kl_n, ce_n or loss_n, is an error naming its
 * position (the first such row, in position order). */
kiln_status kiln_kd_row_losses(const kiln_fused_kd_params *p, kiln_ce_scratch *sc,
                               kiln_kd_rows *rows, int64_t S);

#endif /* KILN_OPS_FUSED_CE_IMPL_H */
