/*
 * adamw_op.c -- the entries of AdamW's ops (adamw_op.h): the backend's table, or without a
 * backend the CPU reference on the caller's pool.
 */
#include "adamw_op.h"

#include "cpu/cpu_train.h"

size_t kiln_adamw_op_workspace(kiln_backend *be, const kiln_adamw_table *tab) {
    return be ? be->i->adamw_workspace(be, tab) : kiln_cpu_adamw_workspace(tab);
}

kiln_status kiln_adamw_op_prepare(kiln_backend *be, kiln_pool *pool, const kiln_adamw_table *tab,
                                  void *ws, int init) {
    return be ? be->i->adamw_prepare(be, tab, ws, init)
              : kiln_cpu_adamw_prepare(pool, tab, ws, init);
}

kiln_status kiln_adamw_op_step(kiln_backend *be, kiln_pool *pool, const kiln_adamw_table *tab,
                               void *ws, const kiln_adamw_scalars *s) {
    return be ? be->i->adamw_step(be, tab, ws, s) : kiln_cpu_adamw_step(pool, tab, ws, s);
}

kiln_status kiln_adamw_op_nonfinite(kiln_backend *be, kiln_pool *pool, const kiln_adamw_table *tab,
                                    void *ws, int64_t *bad) {
    return be ? be->i->adamw_nonfinite(be, tab, ws, bad)
              : kiln_cpu_adamw_nonfinite(pool, tab, ws, bad);
}

kiln_status kiln_adamw_op_grad_norm(kiln_backend *be, kiln_pool *pool, const kiln_adamw_table *tab,
                                    void *ws, float *norms, float *sq, float *total) {
    return be ? be->i->adamw_grad_norm(be, tab, ws, norms, sq, total)
              : kiln_cpu_adamw_grad_norm(pool, tab, ws, norms, sq, total);
}

kiln_status kiln_adamw_op_clip(kiln_backend *be, kiln_pool *pool, const kiln_adamw_table *tab,
                               void *ws, float max_norm_f, float *total, float *coef) {
    return be ? be->i->adamw_clip(be, tab, ws, max_norm_f, total, coef)
              : kiln_cpu_adamw_clip(pool, tab, ws, max_norm_f, total, coef);
}
