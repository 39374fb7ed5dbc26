/*
 * train_common.c -- what the architectures' training code shares: the backward of several
 * products of one input, and the multipliers 1 + w of a zero-centred norm (arch.h plus_one).
 *
 * The trainer's parameter of such a norm is transformers' w; the forward multiplies by 1 + w.
 * Each training forward computes f32(1 + w), transformers' rounding, into one block and binds
 * it in copies of the io's kiln_wrefs (the gradients stay the parameters': d/dw = d/d(1 + w)).
 */
#include "model.h"

#include <string.h>

/* The floats of role r's multiplier in layer `layer` (its vector's length for a plus_one role
 * that io binds), else 0. */
static size_t mult_floats(const kiln_train_io *io, const kiln_param_role *r, const kiln_wref *src) {
    if (!r->plus_one || !src->vec) return 0;
    return (size_t)kiln_role_floats(r, &io->model->cfg);
}

static const kiln_wref *io_ref(const kiln_train_io *io, const kiln_param_role *r, int layer) {
    return kiln_wref_of(io->model->arch, (kiln_wref *)io->refs, (kiln_wref *)io->layer_refs, r, layer);
}

size_t kiln_norm_mult_floats(const kiln_train_io *io) {
    const kiln_arch_desc *a = io->model->arch;
    size_t n = 0;
    for (int r = 0; r < a->n_roles; r++) {
        const kiln_param_role *role = &a->roles[r];
        if (!role->per_layer) n += mult_floats(io, role, io_ref(io, role, -1));
        else
            for (int l = 0; l < io->model->cfg.n_layer; l++) n += mult_floats(io, role, io_ref(io, role, l));
    }
    return n;
}

kiln_status kiln_norm_mult_bind(kiln_norm_mult *nm, const kiln_train_io *io, float *mult, float *ones) {
    const kiln_arch_desc *a = io->model->arch;
    const int L = io->model->cfg.n_layer;
    memset(nm, 0, sizeof *nm);
    nm->n = kiln_norm_mult_floats(io);
    nm->mult = mult;
    nm->ones = ones;
    nm->refs = kiln_calloc((size_t)a->n_roles, sizeof *nm->refs);
    nm->layer_refs = kiln_calloc((size_t)L * (size_t)a->n_layer_roles + 1, sizeof *nm->layer_refs);
    if (!nm->refs || !nm->layer_refs) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
    memcpy(nm->refs, io->refs, (size_t)a->n_roles * sizeof *nm->refs);
    memcpy(nm->layer_refs, io->layer_refs, (size_t)L * (size_t)a->n_layer_roles * sizeof *nm->layer_refs);
    size_t off = 0;
    for (int r = 0; r < a->n_roles; r++) {
        const kiln_param_role *role = &a->roles[r];
        for (int l = role->per_layer ? 0 : -1; l < (role->per_layer ? L : 0); l++) {
            kiln_wref *dst = kiln_wref_of(a, nm->refs, nm->layer_refs, role, l);
            const size_t n = mult_floats(io, role, dst);
            if (!n) continue;
            dst->vec = mult + off;
            off += n;
        }
    }
    float *one = kiln_malloc((nm->n ? nm->n : 1) * sizeof(float));
    if (!one) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
    for (size_t i = 0; i < nm->n; i++) one[i] = 1.0f;
    kiln_status st = kiln_backend_upload(io->be, ones, one, nm->n * sizeof(float));
    kiln_free(one);
    return st;
}

/* mult = f32(1 + w) for every norm: 0, + 1, + w (IEEE addition commutes: the bits of 1 + w). */
void kiln_norm_mult_update(kiln_norm_mult *nm, const kiln_train_io *io) {
    kiln_backend *be = io->be;
    const kiln_backend_i *op = be->i;
    const kiln_arch_desc *a = io->model->arch;
    const int L = io->model->cfg.n_layer;
    op->zero(be, nm->mult, nm->n);
    op->add(be, nm->mult, nm->ones, nm->n);
    for (int r = 0; r < a->n_roles; r++) {
        const kiln_param_role *role = &a->roles[r];
        for (int l = role->per_layer ? 0 : -1; l < (role->per_layer ? L : 0); l++) {
            const kiln_wref *src = io_ref(io, role, l);
            const size_t n = mult_floats(io, role, src);
            if (n) op->add(be, (float *)kiln_wref_of(a, nm->refs, nm->layer_refs, role, l)->vec, src->vec, n);
        }
    }
}

void kiln_norm_mult_free(kiln_norm_mult *nm) {
    kiln_free(nm->refs);
    kiln_free(nm->layer_refs);
    memset(nm, 0, sizeof *nm);
}

void kiln_products_backward(kiln_backend *be, int n, float *dx, float *const *dy, const float *x,
                            const kiln_wref *const *W, int T) {
    const kiln_backend_i *op = be->i;
    if (op->matmul_backward_multi) {
        const kiln_tensor *wv[KILN_MATMUL_MULTI_MAX];
        float *dw[KILN_MATMUL_MULTI_MAX], *db[KILN_MATMUL_MULTI_MAX] = {NULL};
        const float *dys[KILN_MATMUL_MULTI_MAX];
        for (int i = 0; i < n; i++) wv[i] = W[i]->mat, dw[i] = W[i]->grad, dys[i] = dy[i];
        op->matmul_backward_multi(be, n, dx, dw, db, dys, x, wv, T, false);
        return;
    }
    for (int i = 0; i < n; i++) op->matmul_backward(be, dx, W[i]->grad, NULL, dy[i], x, W[i]->mat, T, i > 0);
}
