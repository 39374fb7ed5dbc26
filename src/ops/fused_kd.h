/*
 * fused_kd.h -- a fused distillation loss without materialised student logits: a backend
 * operation (ops.h, fused_kd), called through kiln_fused_kd below. The CPU backend's body
 * (src/ops/cpu/cpu_fused_kd.c) is the reference; the CUDA backend's
 * (src/ops/cuda/cuda_fused_kd_op.c) gives its bits in auditable mode and the exact formats.
 *
 * For the student's hidden states h(N,H), its LM head W(V,H), the teacher's logits Z(N,V)
 * (already computed, the caller's), targets(N), a mask(N), a temperature tau > 0 and weights
 * kd_weight, ce_weight >= 0 (not both 0), with s = h W^T the student's logits:
 *
 *   p_n = softmax(Z_n / tau),  q_n = softmax(s_n / tau)
 *   kl_n   = sum_v p_nv (log p_nv - log q_nv)                KL(teacher || student) at tau
 *   ce_n   = logsumexp_v(s_nv) - s_{n,t_n}                   the hard CE at temperature 1
 *   loss_n = kd_weight * tau^2 * kl_n + ce_weight * ce_n     for every supervised position n
 *   loss   = scale * sum_n loss_n / S   (MEAN)   or   scale * sum_n loss_n   (SUM)
 *
 * with S the number of supervised positions (mask[n] != 0 and targets[n] >= 0, as
 * kiln_fused_ce's), and the gradients of `loss` with respect to h (dh, N x H) and W (dW,
 * V x H), from
 *
 *   d loss / d s_nv = gs * (kd_weight * tau * (q_nv - p_nv)
 *                          + ce_weight * (softmax(s_n)_v - [v == t_n]))
 *
 * (gs = scale / S for MEAN, scale for SUM; the tau^2 factor keeps the soft gradient's size
 * independent of tau, Hinton et al. 2015, "Distilling the Knowledge in a Neural Network").
 * The reduced parts kl and ce (the same reduction and scale, without the weights) come back
 * beside the loss, for logging.
 *
 * Like kiln_fused_ce, only the S supervised rows are computed and the vocabulary is walked in
 * chunks of `chunk` columns, twice: pass 1 keeps, per row and online over the chunks, the
 * student's max and sum of exponentials at temperature 1 and at tau, its target logit, the
 * teacher's max and sum of exponentials at tau, and the teacher-weighted sum of the scaled
 * logit differences that the KL needs; pass 2 recomputes each chunk's student logits, turns
 * them into the gradient above and multiplies it into dh and dW with kiln_fused_ce's products.
 * The student logits never exist beyond one chunk (S x chunk); the scratch is bounded by
 * kiln_fused_kd_scratch_bytes -- kiln_fused_ce's for the same sizes plus a few floats per row,
 * never N x V. The teacher's rows are read where they lie.
 *
 * The arithmetic order is defined in docs/ARITHMETIC.md ("Fused distillation loss"): the
 * results are bit-identical for every thread count and SIMD path, and defined for a given
 * chunk size. With kd_weight 0 and ce_weight 1 they are kiln_fused_ce's bits (loss, dh, dW).
 *
 * All buffers are the caller's, in the backend's memory (device memory on CUDA; targets and
 * mask stay host memory). On any error nothing the caller passed is written: validation, the
 * scratch allocation and pass 1 (which finds non-finite teacher logits and row losses) come
 * before the first write to dh, dW, row_kl or row_ce.
 */
#ifndef KILN_FUSED_KD_H
#define KILN_FUSED_KD_H

#include "fused_ce.h"
#include "ops.h"

typedef struct kiln_fused_kd_params {
    int64_t N, H, V;               /* positions, hidden size, vocabulary size */
    const float *hidden;           /* (N, H) f32: the student's final hidden states, row n at
                                    * hidden + n * hidden_ld */
    int64_t hidden_ld;             /* elements from one row of hidden to the next: 0 = H, else
                                    * >= H (a strided view) */
    const void *weight;            /* (V, H), weight_dtype: F32 or BF16: the student's head */
    kiln_dtype weight_dtype;
    const float *teacher_logits;   /* (N, V) f32: the teacher's logits, row n at
                                    * teacher_logits + n * teacher_ld; every element of a
                                    * supervised row must be finite */
    int64_t teacher_ld;            /* elements from one teacher row to the next: 0 = V, else
                                    * >= V */
    const int32_t *targets;        /* (N); a target < 0 (e.g. -100) marks a position
                                    * unsupervised */
    const uint8_t *mask;           /* (N) or NULL (= all ones); 0 marks a position unsupervised */
    float tau;                     /* temperature of the KL term: finite, > 0 */
    float kd_weight, ce_weight;    /* the terms' weights: finite, >= 0, not both 0 */
    kiln_ce_reduction reduction;
    float scale;                   /* multiplies the loss, its parts and every gradient */
    int64_t chunk;                 /* vocabulary columns per chunk; 0 =
                                    * KILN_FUSED_CE_DEFAULT_CHUNK */
    /* Outputs, each optional (NULL: not computed). With both dhidden and dweight NULL, only
     * pass 1 runs (the loss alone). */
    float *dhidden;                /* (N, H): overwritten (unsupervised rows set to 0), or, with
                                    * dhidden_accumulate, dhidden += d loss / d h (unsupervised
                                    * rows untouched) */
    int dhidden_accumulate;
    float *dweight;                /* (V, H) f32: dweight += d loss / d W, always accumulated */
    float *row_kl;                 /* (N): kl_n (unweighted, unscaled); 0 at unsupervised rows */
    float *row_ce;                 /* (N): ce_n (unweighted, unscaled); 0 at unsupervised rows */
} kiln_fused_kd_params;

typedef struct kiln_fused_kd_result {
    float loss;            /* the reduced, scaled, weighted loss (f32, defined order) */
    float kl;              /* the reduced, scaled kl_n, without the weight and tau^2 */
    float ce;              /* the reduced, scaled ce_n, without the weight */
    double loss_f64;       /* loss from the f32 row losses summed in float64 */
    int64_t n_supervised;  /* S */
    size_t scratch_bytes;  /* bytes of scratch this call allocated (freed on return) */
} kiln_fused_kd_result;

/* Defaults: everything zero/NULL, weight F32, tau 1, kd_weight 1, ce_weight 0, MEAN, scale 1,
 * chunk 0 (= 4096). */
kiln_fused_kd_params kiln_fused_kd_default_params(void);

/* The loss and gradients described above, on backend be: the op's entry, which checks p,
 * counts the supervised rows and runs the backend's fused_kd. out may be NULL.
 * Errors: a backend without the op -> KILN_ERR_UNSUPPORTED "fused_kd: not on this backend";
 * NULL/inconsistent parameters, a weight dtype other than F32/BF16, or sizes that overflow ->
 * KILN_ERR_INVALID_ARG / KILN_ERR_UNSUPPORTED (as kiln_fused_ce's); tau not finite or <= 0,
 * a weight not finite or < 0, both weights 0, teacher_ld < V -> KILN_ERR_INVALID_ARG; no
 * supervised position -> KILN_ERR_INVALID_ARG "no supervised positions"; a supervised target
 * >= V -> KILN_ERR_RANGE naming the position; a non-finite teacher logit in a supervised row
 * -> KILN_ERR_RANGE naming the position and column; a non-finite kl_n, ce_n or loss_n ->
 * KILN_ERR_RANGE naming the position; scratch allocation failure -> KILN_ERR_NOMEM. */
kiln_status kiln_fused_kd(kiln_backend *be, const kiln_fused_kd_params *p,
                          kiln_fused_kd_result *out);

/* The scratch bytes kiln_fused_kd allocates for S supervised rows (the whole bound: the
 * products themselves allocate nothing). with_dh / with_dw: whether dhidden / dweight are
 * requested. 0 when the size overflows. */
size_t kiln_fused_kd_scratch_bytes(int64_t S, int64_t H, int64_t V, int64_t chunk, int with_dh,
                                   int with_dw);

#endif /* KILN_FUSED_KD_H */
