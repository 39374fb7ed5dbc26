/*
 * adamw_op.h -- AdamW's arithmetic as backend operations (ops.h, adamw_*): one update of a
 * table of tensors, the check for non-finite gradients, the gradient norms and clipping, on
 * arrays in the backend's memory. The optimizer (src/train/adamw.h: names, decay rules, the
 * state's layout, save and load) composes them. The per-element arithmetic is adamw_math.h,
 * and docs/ARITHMETIC.md ("AdamW and clipping") defines every result: the CPU backend's
 * implementation (src/ops/cpu/cpu_adamw.c) is the reference, the CUDA backend's
 * (src/ops/cuda/cuda_adamw_op.c, kernels in cuda_adamw.cu) has its bits, but for the norms in
 * fast mode (docs/TRAINING.md, "Fast mode").
 *
 * Every call takes a table (kiln_adamw_table: host structs that point at the tensors' arrays,
 * and the storage kinds) and a workspace ws: kiln_adamw_op_workspace bytes of the backend's
 * memory (host memory without a backend), which kiln_adamw_op_prepare filled for that table
 * (chunk lists; a device backend's copy of the table and its scratch). Prepare it again after
 * changing an entry (a restored decay flag); the other calls take the same table.
 *
 * be NULL: the arrays and ws are host memory and the CPU reference runs on pool (NULL: the
 * calling thread). With a backend its own threads or stream run the work and pool is ignored;
 * its work is enqueued in order and a failure poisons it (ops.h, status). Every element is
 * updated alone and every reduction has a fixed order, so no result depends on the thread
 * count.
 */
#ifndef KILN_OPS_ADAMW_OP_H
#define KILN_OPS_ADAMW_OP_H

#include "../base/threadpool.h"
#include "adamw_math.h"
#include "ops.h"

/* One tensor: n elements, its weights (updated in place), gradient and optimizer state. */
typedef struct kiln_adamw_tensor {
    int64_t n;       /* elements, >= 1 */
    void *weights;   /* (n) f32 (KILN_ADAMW_F32) or bf16 (the others) */
    float *grad;     /* (n) read by the step, scaled by clip */
    uint16_t *w16;   /* (n) or NULL: the step also writes the updated f32 weights rounded to
                      * bf16 (to nearest even) here; device backends with F32 weights only */
    int decay;       /* weight decay applies (and-ed with the step's use_wd) */
    float *m, *v;    /* (n) f32 moments (KILN_ADAMW_MOMENTS_F32) */
    int8_t *mq;      /* (n) 8-bit first moment: sign * code (KILN_ADAMW_MOMENTS_Q8) */
    uint8_t *vq;     /* (n) 8-bit second moment */
    float *ms, *vs;  /* (ceil(n / KILN_ADAMW_Q8_BLOCK)) each block's absmax */
    float *master;   /* (n) f32 master copy (KILN_ADAMW_BF16_MASTER) */
    uint16_t *comp;  /* (n) bf16 compensation (KILN_ADAMW_BF16_KAHAN) */
} kiln_adamw_tensor;

/* The tensors of one optimizer: every one stored the same way. */
typedef struct kiln_adamw_table {
    const kiln_adamw_tensor *t; /* (P) host array */
    int P;                      /* >= 1 */
    kiln_adamw_weights weights;
    kiln_adamw_moments moments;
} kiln_adamw_table;

/* Whether be runs the ops (NULL, the host, always does). */
static inline bool kiln_adamw_op_supported(const kiln_backend *be) {
    return !be || (be->i->adamw_workspace && be->i->adamw_prepare && be->i->adamw_step &&
                   be->i->adamw_nonfinite && be->i->adamw_grad_norm && be->i->adamw_clip);
}

/* Bytes of the workspace the calls on tab take; 0 when the size overflows. */
size_t kiln_adamw_op_workspace(kiln_backend *be, const kiln_adamw_table *tab);

/* Fill ws for tab (then wait for the backend). init != 0 also gives every tensor a new
 * optimizer's state: moments and compensation zero, master = the bf16 weights widened.
 * KILN_ERR_UNSUPPORTED for a table the backend cannot take (the CUDA backend: more than 65535
 * tensors). */
kiln_status kiln_adamw_op_prepare(kiln_backend *be, kiln_pool *pool, const kiln_adamw_table *tab,
                                  void *ws, int init);

/* One AdamW update of every tensor (adamw_math.h's kiln_adamw_update on every element with
 * s's scalars; 8-bit moments dequantized, updated and requantized per block of
 * KILN_ADAMW_Q8_BLOCK; stochastic rounding keyed by kiln_adamw_mix64(s->sr_key + p) for tensor
 * p). Nothing is checked: the caller has checked the gradients (nonfinite) first. */
kiln_status kiln_adamw_op_step(kiln_backend *be, kiln_pool *pool, const kiln_adamw_table *tab,
                               void *ws, const kiln_adamw_scalars *s);

/* bad[p] (host memory, P entries) = the lowest index of a non-finite element of tensor p's
 * gradient, or -1. Waits for the result. */
kiln_status kiln_adamw_op_nonfinite(kiln_backend *be, kiln_pool *pool, const kiln_adamw_table *tab,
                                    void *ws, int64_t *bad);

/* torch's gradient norms (clip_grad_norm_, norm type 2): norms[p] = the f32 2-norm of tensor
 * p's gradient (8 lanes, kiln_adamw_sumsq8), *sq = their sum of squares in the same order and
 * *total = sqrtf(*sq). Outputs are host memory and each may be NULL; waits for what it
 * returns (with none asked for, for the work). */
kiln_status kiln_adamw_op_grad_norm(kiln_backend *be, kiln_pool *pool, const kiln_adamw_table *tab,
                                    void *ws, float *norms, float *sq, float *total);

/* clip_grad_norm_: the total norm as grad_norm's, coef = kiln_adamw_clip_coef(total,
 * max_norm_f), then every gradient element g = g * coef (always, as torch does). A device
 * backend keeps the coefficient on the device between the two; total and coef (host, each
 * may be NULL) are downloaded only when asked for. */
kiln_status kiln_adamw_op_clip(kiln_backend *be, kiln_pool *pool, const kiln_adamw_table *tab,
                               void *ws, float max_norm_f, float *total, float *coef);

#endif /* KILN_OPS_ADAMW_OP_H */
