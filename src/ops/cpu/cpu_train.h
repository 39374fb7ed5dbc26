/*
 * cpu_train.h -- the CPU backend's training operations that are larger than one kernel: the
 * bodies its table (cpu_backend.c) points at, in files of their own. The reference
 * implementations of the ops that fused_ce.h, fused_kd.h and adamw_op.h define.
 */
#ifndef KILN_CPU_TRAIN_H
#define KILN_CPU_TRAIN_H

#include "../adamw_op.h"
#include "../fused_ce.h"
#include "../fused_kd.h"
#include "../../base/threadpool.h"

/* ---- fused linear cross-entropy (cpu_fused_ce.c) ------------------------------------------ */

/* The table's fused_ce_workspace and fused_ce (ops.h) on the CPU backend be: host memory, the
 * backend's pool and matmul. */
size_t kiln_cpu_fused_ce_workspace(kiln_backend *be, const kiln_fused_ce_params *p, int64_t S);
kiln_status kiln_cpu_fused_ce(kiln_backend *be, const kiln_fused_ce_params *p, int64_t S,
                              kiln_fused_ce_result *out);

/* ---- fused distillation loss (cpu_fused_kd.c) ---------------------------------------------- */

/* The table's fused_kd (ops.h) on the CPU backend be: host memory, the backend's pool and
 * matmul. */
kiln_status kiln_cpu_fused_kd(kiln_backend *be, const kiln_fused_kd_params *p, int64_t S,
                              kiln_fused_kd_result *out);

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

/* ---- Qwen3.5's ops (cpu_linear_attn.c): ops.h's entries, on pool where they are parallel -- */

void kiln_cpu_conv1d_silu(kiln_pool *pool, float *out, const float *x, const float *w, float *state,
                          const int32_t *seq, const int32_t *pos, const kiln_batch_run *runs, int n_runs, int N,
                          int CH, int K);
void kiln_cpu_conv1d_silu_backward(kiln_pool *pool, float *dx, float *dw, const float *dout, const float *x,
                                   const float *w, int n_seq, int T, int CH, int K);
void kiln_cpu_gated_delta(kiln_pool *pool, float *out, const float *qkv, const float *g, const float *beta,
                          float *state, const int32_t *seq, const int32_t *pos, const kiln_batch_run *runs,
                          int n_runs, int N, int nk, int nv, int dk, int dv, float scale);
void kiln_cpu_gated_delta_backward(kiln_pool *pool, float *dqkv, float *dg, float *dbeta, const float *dout,
                                   const float *qkv, const float *g, const float *beta, float *ws, int n_seq, int T,
                                   int nk, int nv, int dk, int dv, float scale);
void kiln_cpu_gdn_gates(float *g, float *beta, const float *a, const float *b, const float *A_log,
                        const float *dt_bias, int N, int nv);
void kiln_cpu_gdn_gates_backward(float *da, float *db, float *dA_log, float *ddt_bias, const float *dg,
                                 const float *dbeta, const float *a, const float *b, const float *A_log,
                                 const float *dt_bias, int N, int nv);
void kiln_cpu_sigmoid_mul(float *out, const float *x, const float *gate, size_t n);
void kiln_cpu_sigmoid_mul_backward(float *dx, float *dgate, const float *dout, const float *x, const float *gate,
                                   size_t n);
void kiln_cpu_split_halves(float *a, float *b, const float *x, int64_t rows, int n);
void kiln_cpu_join_halves(float *x, const float *a, const float *b, int64_t rows, int n);
/* transpose 0: rope_partial; 1: rope_partial_backward. */
void kiln_cpu_rope_partial(float *x, const int32_t *pos, int N, int H, int HS, int rot, const float *cos_tab,
                           const float *sin_tab, int transpose);

#endif /* KILN_CPU_TRAIN_H */
