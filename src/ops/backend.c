/*
 * backend.c -- what every backend shares: freeing through the table, zeroed buffers, the
 * fused ops' compositions.
 */
#include "ops.h"

#include <stdio.h>

kiln_status kiln_backend_alloc_carved(kiln_backend *be, int n, float **const *slots, const size_t *floats,
                                      void **block, size_t *bytes, const char *owner, const char *what) {
    size_t total = 0, nb = 0;
    for (int i = 0; i < n; i++)
        if (floats[i] > SIZE_MAX - 63 || kiln_add_overflow(total, (floats[i] + 63) & ~(size_t)63, &total))
            return kiln_error(KILN_ERR_RANGE, "%s: %s too large", owner, what);
    if (kiln_mul_overflow(total, sizeof(float), &nb)) return kiln_error(KILN_ERR_RANGE, "%s: %s too large", owner, what);
    float *blk = kiln_backend_alloc_zeroed(be, nb, owner, what);
    if (!blk) return KILN_ERR_NOMEM;
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        *slots[i] = blk + off;
        off += (floats[i] + 63) & ~(size_t)63;
    }
    *block = blk;
    *bytes = nb;
    return KILN_OK;
}

void *kiln_backend_alloc_zeroed(kiln_backend *be, size_t nbytes, const char *owner, const char *what) {
    const size_t b = ((nbytes ? nbytes : 64) + 3) & ~(size_t)3;
    if (be->i->host_memory) {
        void *p = kiln_calloc(1, b);
        if (!p) kiln_error(KILN_ERR_NOMEM, "%s: out of memory allocating %zu bytes for %s", owner, b, what);
        return p;
    }
    void *p = kiln_backend_alloc(be, b);
    if (!p) {
        char why[256];
        snprintf(why, sizeof why, "%s", kiln_last_error());
        kiln_error(KILN_ERR_NOMEM, "%s: out of %s memory allocating %zu bytes for %s: %s", owner, be->i->name, b,
                   what, why);
        return NULL;
    }
    if (be->i->zero) {
        be->i->zero(be, p, b / sizeof(float));
        return p;
    }
    /* no zero op: uploads of a zeroed host chunk */
    const size_t chunk = b < ((size_t)4 << 20) ? b : ((size_t)4 << 20);
    void *zeros = kiln_calloc(1, chunk);
    kiln_status st = zeros ? KILN_OK : kiln_error(KILN_ERR_NOMEM, "%s: out of memory (%zu bytes)", owner, chunk);
    for (size_t off = 0; off < b && st == KILN_OK; off += chunk)
        st = kiln_backend_upload(be, (char *)p + off, zeros, b - off < chunk ? b - off : chunk);
    kiln_free(zeros);
    if (st != KILN_OK) {
        kiln_backend_free_buf(be, p);
        return NULL;
    }
    return p;
}

void kiln_backend_free(kiln_backend *be) {
    if (!be) return;
    be->i->free(be);
}

kiln_status kiln_backend_enter(kiln_backend *be, const char *fn) {
    if (!be || kiln_backend_poll(be) == KILN_OK) return KILN_OK;
    return kiln_error_prefix(KILN_ERR_POISONED, "%s: refused: the %s backend was poisoned by an earlier failure", fn,
                             be->i->name);
}

kiln_status kiln_backend_leave(kiln_backend *be, kiln_status st, const char *fn) {
    if (st == KILN_OK || st == KILN_ERR_POISONED || !be) return st;
    char why[1024];
    snprintf(why, sizeof why, "%s", kiln_last_error()[0] ? kiln_last_error() : fn);
    if (kiln_backend_poll(be) == KILN_OK) {
        kiln_error(st, "%s", why); /* not poisoned: the call's own error, message restored */
        return st;
    }
    return kiln_error(KILN_ERR_POISONED, "%s (the %s backend is poisoned now: free this handle)", why, be->i->name);
}

/* ---- the fused ops, or the compositions that define them -------------------------------------- */

void kiln_op_products(kiln_backend *be, const float *x, const kiln_products *p, int N) {
    const kiln_backend_i *op = be->i;
    if (op->products) {
        op->products(be, x, p, N);
        return;
    }
    const int64_t C = p->W[0]->shape[p->W[0]->n_dims - 1];
    if (N <= 0 || C <= 0) return;
    const float *xn = x;
    if (p->norm_w) {
        op->rmsnorm(be, p->scratch_x, x, p->norm_w, N, (int)C, p->eps);
        xn = p->scratch_x;
    }
    if (p->up) {
        float *gu[2] = {p->scratch_gate, p->scratch_up};
        const kiln_tensor *w[2] = {p->W[0], p->up};
        const float *b[2] = {p->bias ? p->bias[0] : NULL, p->bias ? p->bias[1] : NULL};
        if (op->matmul_multi) {
            op->matmul_multi(be, 2, gu, xn, w, b, N);
        } else {
            op->matmul(be, gu[0], xn, w[0], b[0], N);
            op->matmul(be, gu[1], xn, w[1], b[1], N);
        }
        op->swiglu(be, p->out[0], gu[0], gu[1], (size_t)N * (size_t)(kiln_tensor_nelements(p->W[0]) / C));
    } else if (op->matmul_multi) {
        op->matmul_multi(be, p->n, p->out, xn, p->W, p->bias, N);
    } else {
        for (int i = 0; i < p->n; i++) op->matmul(be, p->out[i], xn, p->W[i], p->bias ? p->bias[i] : NULL, N);
    }
    for (int i = 0; p->res && i < p->n; i++)
        if (p->res[i]) op->add(be, p->out[i], p->res[i], (size_t)N * (size_t)(kiln_tensor_nelements(p->W[i]) / C));
}

void kiln_op_rope_kv_store(kiln_backend *be, float *q, float *k, const float *v, const int32_t *pos, int N, int NH,
                           int KVH, int HS, const float *cos_tab, const float *sin_tab, float *k_pool, float *v_pool,
                           const int32_t *slots) {
    const kiln_backend_i *op = be->i;
    if (op->rope_kv_store) {
        op->rope_kv_store(be, q, k, v, pos, N, NH, KVH, HS, cos_tab, sin_tab, k_pool, v_pool, slots);
        return;
    }
    op->rope(be, q, pos, N, NH, HS, cos_tab, sin_tab);
    op->rope(be, k, pos, N, KVH, HS, cos_tab, sin_tab);
    op->kv_store_rows(be, k_pool, v_pool, k, v, slots, N, (size_t)KVH * HS);
}
