/*
 * cpu_train.h -- the CPU backend's training operations that are larger than one kernel: the
 * bodies its table (cpu_backend.c) points at, in files of their own. The reference
 * implementations of the ops that fused_ce.h and adamw_op.h define.
 */
#ifndef KILN_CPU_TRAIN_H
#define KILN_CPU_TRAIN_H

#include "../adamw_op.h"
#include "../fused_ce.h"

/* ---- fused linear cross-entropy (cpu_fused_ce.c) ------------------------------------------ */

/* The table's fused_ce_workspace and fused_ce (ops.h) on the CPU backend be: host memory, the
 * backend's pool and matmul. */
size_t kiln_cpu_fused_ce_workspace(kiln_backend *be, const kiln_fused_ce_params *p, int64_t S);
kiln_status kiln_cpu_fused_ce(kiln_backend *be, const kiln_fused_ce_params *p, int64_t S,
                              kiln_fused_ce_result *out);

/* ---- AdamW (cpu_adamw.c) ------------------------------------------------------------------- */

/* adamw_op.h's ops on host memory, run on pool (NULL: the calling thread): the CPU backend's
 * table entries with its pool, and kiln_adamw_op_* without a backend. */
size_t kiln_cpu_adamw_workspace(const kiln_adamw_table *tab);
kiln_status kiln_cpu_adamw_prepare(kiln_pool *pool, const kiln_adamw_table *tab, void *ws,
                                   int init);
kiln_status kiln_cpu_adamw_step(kiln_pool *pool, const kiln_adamw_table *tab, void *ws,
                                const kiln_adamw_scalars *s);
kiln_status kiln_cpu_adamw_nonfinite(kiln_pool *pool, const kiln_adamw_table *tab, void *ws,
                                     int64_t *bad);
kiln_status kiln_cpu_adamw_grad_norm(kiln_pool *pool, const kiln_adamw_table *tab, void *ws,
                                     float *norms, float *sq_norm, float *total);
kiln_status kiln_cpu_adamw_clip(kiln_pool *pool, const kiln_adamw_table *tab, void *ws,
                                float max_norm_f, float *total_norm, float *coef);

#endif /* KILN_CPU_TRAIN_H */
