/*
 * cuda_adamw_op.c -- AdamW's ops (src/ops/adamw_op.h) on the CUDA backend: the host side of
 * cuda_adamw.cu, with the CPU's bits (the per-element arithmetic is adamw_math.h) but for fast
 * mode's norms.
 *
 * The workspace is one device block: the gradient table {grad, n}, the finite check's result
 * per tensor, the per-tensor norms and the totals (sq, total, clip coefficient), fast mode's
 * norm plan and the multi-tensor step's tensor table and chunks (cuda_train.h), all uploaded
 * by prepare, so that a step, a norm or a clip uploads nothing. A step is one launch over every
 * tensor (kiln_cuda_adamw_step_multi).
 */
#include "../adamw_op.h"

#ifdef KILN_HAVE_CUDA
#include "cuda_train.h"

#include <string.h>

/* The workspace's regions and the plans over them (host structs, device pointers). */
typedef struct dev_ws {
    kiln_cuda_grad_entry *table;        /* (P) {grad, n} */
    uint64_t *bad;                      /* (P) lowest non-finite element */
    float *norms;                       /* (P) per-tensor norms */
    float *out;                         /* (4) sq, total, coef */
    kiln_cuda_norm_plan norm_plan;      /* fast mode's chunked norm: chunk, first, partial */
    kiln_cuda_norm_chunk *norm_chunk;   /* norm_plan.chunk, writable */
    kiln_cuda_adamw_plan step_plan;     /* the multi-tensor step: table and chunks */
    kiln_cuda_adamw_param *step_table;  /* step_plan.table, writable */
    kiln_cuda_adamw_chunk *step_chunk;  /* step_plan.chunk, writable */
    int64_t n_step_chunks, max_n;
} dev_ws;

/* The regions of ws for tab (ws NULL: sizes only); returns the bytes. Table, bad, norms, out,
 * then the norm plan's partial, chunk and first, then the step plan's table and chunks, each
 * 64-aligned (the norm plan: 16 bytes per KILN_CUDA_NORM_CHUNK elements, 4 per tensor; the step
 * plan: 8 bytes per KILN_CUDA_ADAMW_CHUNK elements, one kiln_cuda_adamw_param per tensor). */
static size_t dev_layout(const kiln_adamw_table *tab, void *ws, dev_ws *w) {
    const int P = tab->P;
    int64_t n_chunks = 0, n_step_chunks = 0, max_n = 0;
    for (int i = 0; i < P; i++) {
        n_chunks += (tab->t[i].n + KILN_CUDA_NORM_CHUNK - 1) / KILN_CUDA_NORM_CHUNK;
        n_step_chunks += (tab->t[i].n + KILN_CUDA_ADAMW_CHUNK - 1) / KILN_CUDA_ADAMW_CHUNK;
        if (tab->t[i].n > max_n) max_n = tab->t[i].n;
    }
    size_t tb = ((size_t)P * sizeof(kiln_cuda_grad_entry) + 63) & ~(size_t)63;
    size_t bb = ((size_t)P * sizeof(uint64_t) + 63) & ~(size_t)63;
    size_t nb = ((size_t)P * sizeof(float) + 63) & ~(size_t)63;
    size_t pb = ((size_t)n_chunks * sizeof(double) + 63) & ~(size_t)63;
    size_t cb = ((size_t)n_chunks * sizeof(kiln_cuda_norm_chunk) + 63) & ~(size_t)63;
    size_t fb = ((size_t)(P + 1) * sizeof(int32_t) + 63) & ~(size_t)63;
    size_t sb = ((size_t)P * sizeof(kiln_cuda_adamw_param) + 63) & ~(size_t)63;
    size_t kb = ((size_t)n_step_chunks * sizeof(kiln_cuda_adamw_chunk) + 63) & ~(size_t)63;
    if (w) {
        uint8_t *base = ws;
        memset(w, 0, sizeof *w);
        w->table = (kiln_cuda_grad_entry *)(void *)base;
        w->bad = (uint64_t *)(void *)(base + tb);
        w->norms = (float *)(void *)(base + tb + bb);
        w->out = (float *)(void *)(base + tb + bb + nb);
        uint8_t *plan = base + tb + bb + nb + 64;
        w->norm_plan.partial = (double *)(void *)plan;
        w->norm_chunk = (kiln_cuda_norm_chunk *)(void *)(plan + pb);
        w->norm_plan.chunk = w->norm_chunk;
        w->norm_plan.first = (const int32_t *)(void *)(plan + pb + cb);
        w->norm_plan.n_chunks = n_chunks;
        uint8_t *step = plan + pb + cb + fb;
        w->step_table = (kiln_cuda_adamw_param *)(void *)step;
        w->step_chunk = (kiln_cuda_adamw_chunk *)(void *)(step + sb);
        w->step_plan.table = w->step_table;
        w->step_plan.chunk = w->step_chunk;
        w->step_plan.n_chunks = n_step_chunks;
        w->step_plan.weights_kind = (int)tab->weights;
        w->step_plan.q8 = tab->moments == KILN_ADAMW_MOMENTS_Q8;
        w->n_step_chunks = n_step_chunks;
        w->max_n = max_n;
    }
    return tb + bb + nb + 64 + pb + cb + fb + sb + kb;
}

/* Tensor i as the multi-tensor step's table holds it (decay: its own flag). */
static kiln_cuda_adamw_param dev_param(const kiln_adamw_table *tab, int i) {
    const kiln_adamw_tensor *s = &tab->t[i];
    kiln_cuda_adamw_param q;
    memset(&q, 0, sizeof q);
    q.n = s->n;
    q.param_index = i;
    q.weights_kind = (int)tab->weights;
    q.q8 = tab->moments == KILN_ADAMW_MOMENTS_Q8;
    q.decay = s->decay;
    q.weights = s->weights;
    q.grad = s->grad;
    q.w16 = s->w16;
    q.m = s->m;
    q.v = s->v;
    q.mq = s->mq;
    q.vq = s->vq;
    q.ms = s->ms;
    q.vs = s->vs;
    q.master = s->master;
    q.comp = s->comp;
    return q;
}

/* Upload fast mode's norm plan (cuda_train.h): chunk (n_chunks entries) followed, at byte
 * first_off of the same device block, by first (P + 1 entries). */
static kiln_status dev_upload_norm_plan(kiln_backend *be, const kiln_adamw_table *tab,
                                        uint8_t *dev, size_t first_off, size_t bytes) {
    const int P = tab->P;
    uint8_t *h = kiln_calloc(1, bytes);
    if (!h) return kiln_error(KILN_ERR_NOMEM, "adamw: out of memory");
    kiln_cuda_norm_chunk *chunk = (kiln_cuda_norm_chunk *)(void *)h;
    int32_t *first = (int32_t *)(void *)(h + first_off);
    int32_t c = 0;
    for (int i = 0; i < P; i++) {
        first[i] = c;
        const int64_t k = (tab->t[i].n + KILN_CUDA_NORM_CHUNK - 1) / KILN_CUDA_NORM_CHUNK;
        for (int64_t j = 0; j < k; j++, c++) {
            chunk[c].param = i;
            chunk[c].index = (int32_t)j;
        }
    }
    first[P] = c;
    kiln_status st = kiln_backend_upload(be, dev, h, bytes);
    kiln_free(h);
    return st;
}

/* Upload the multi-tensor step's table (step_plan.table: every tensor with its own decay flag,
 * which the kernel ands with use_wd) and its chunks. */
static kiln_status dev_upload_step_plan(kiln_backend *be, const kiln_adamw_table *tab,
                                        const dev_ws *w) {
    const int P = tab->P;
    kiln_cuda_adamw_param *t = kiln_calloc((size_t)P, sizeof *t);
    if (!t) return kiln_error(KILN_ERR_NOMEM, "adamw: out of memory");
    for (int i = 0; i < P; i++) t[i] = dev_param(tab, i);
    kiln_status st = kiln_backend_upload(be, w->step_table, t, (size_t)P * sizeof *t);
    if (st == KILN_OK) {
        const size_t cb = (size_t)w->n_step_chunks * sizeof(kiln_cuda_adamw_chunk);
        kiln_cuda_adamw_chunk *c = kiln_malloc(cb ? cb : 1);
        if (!c) {
            st = kiln_error(KILN_ERR_NOMEM, "adamw: out of memory");
        } else {
            kiln_cuda_adamw_chunks(t, P, c);
            st = kiln_backend_upload(be, w->step_chunk, c, cb);
        }
        kiln_free(c);
    }
    kiln_free(t);
    return st;
}

/* A new optimizer's state of every tensor: moments and compensation zero, master widened. */
static kiln_status dev_init_state(kiln_backend *be, const kiln_adamw_table *tab) {
    for (int i = 0; i < tab->P; i++) {
        const kiln_adamw_tensor *t = &tab->t[i];
        const size_t n = (size_t)t->n, nb = (n + KILN_ADAMW_Q8_BLOCK - 1) / KILN_ADAMW_Q8_BLOCK;
        if (tab->moments == KILN_ADAMW_MOMENTS_Q8) {
            KILN_TRY(kiln_cuda_train_memset(be, t->mq, 0, n));
            KILN_TRY(kiln_cuda_train_memset(be, t->vq, 0, n));
            KILN_TRY(kiln_cuda_train_memset(be, t->ms, 0, nb * sizeof(float)));
            KILN_TRY(kiln_cuda_train_memset(be, t->vs, 0, nb * sizeof(float)));
        } else {
            KILN_TRY(kiln_cuda_train_memset(be, t->m, 0, n * sizeof(float)));
            KILN_TRY(kiln_cuda_train_memset(be, t->v, 0, n * sizeof(float)));
        }
        if (tab->weights == KILN_ADAMW_BF16_MASTER)
            KILN_TRY(kiln_cuda_adamw_widen_bf16(be, t->master, t->weights, t->n));
        else if (tab->weights == KILN_ADAMW_BF16_KAHAN)
            KILN_TRY(kiln_cuda_train_memset(be, t->comp, 0, n * sizeof(uint16_t)));
    }
    return KILN_OK;
}

size_t kiln_cuda_adamw_op_workspace(kiln_backend *be, const kiln_adamw_table *tab) {
    (void)be;
    return dev_layout(tab, NULL, NULL);
}

kiln_status kiln_cuda_adamw_op_prepare(kiln_backend *be, const kiln_adamw_table *tab, void *ws,
                                       int init) {
    const int P = tab->P;
    if (P > 65535)
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "adamw: %d parameters on the CUDA backend (at most 65535)", P);
    dev_ws w;
    dev_layout(tab, ws, &w);
    if (w.norm_plan.n_chunks > INT32_MAX || w.n_step_chunks > INT32_MAX)
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "adamw: %lld norm chunks, %lld step chunks on the device",
                          (long long)w.norm_plan.n_chunks, (long long)w.n_step_chunks);
    /* chunk and first (dev_layout's cb, fb) */
    const size_t cb = ((size_t)w.norm_plan.n_chunks * sizeof(kiln_cuda_norm_chunk) + 63) &
                      ~(size_t)63;
    const size_t fb = ((size_t)(P + 1) * sizeof(int32_t) + 63) & ~(size_t)63;
    KILN_TRY(dev_upload_norm_plan(be, tab, (uint8_t *)w.norm_chunk, cb, cb + fb));
    KILN_TRY(dev_upload_step_plan(be, tab, &w));
    kiln_cuda_grad_entry *t = kiln_calloc((size_t)P, sizeof *t);
    if (!t) return kiln_error(KILN_ERR_NOMEM, "adamw: out of memory");
    for (int i = 0; i < P; i++) {
        t[i].grad = tab->t[i].grad;
        t[i].n = tab->t[i].n;
    }
    kiln_status st = kiln_backend_upload(be, w.table, t, (size_t)P * sizeof *t);
    kiln_free(t);
    KILN_TRY(st);
    if (init) KILN_TRY(dev_init_state(be, tab));
    return kiln_backend_status(be);
}

kiln_status kiln_cuda_adamw_op_step(kiln_backend *be, const kiln_adamw_table *tab, void *ws,
                                    const kiln_adamw_scalars *s) {
    dev_ws w;
    dev_layout(tab, ws, &w);
    return kiln_cuda_adamw_step_multi(be, &w.step_plan, s);
}

kiln_status kiln_cuda_adamw_op_nonfinite(kiln_backend *be, const kiln_adamw_table *tab,
                                         void *ws, int64_t *bad) {
    dev_ws w;
    dev_layout(tab, ws, &w);
    KILN_TRY(kiln_cuda_adamw_nonfinite(be, w.table, tab->P, w.max_n, w.bad));
    /* UINT64_MAX (none) reads back as -1 */
    return kiln_backend_download(be, bad, w.bad, (size_t)tab->P * sizeof(uint64_t));
}

kiln_status kiln_cuda_adamw_op_grad_norm(kiln_backend *be, const kiln_adamw_table *tab,
                                         void *ws, float *norms, float *sq_norm, float *total) {
    dev_ws w;
    dev_layout(tab, ws, &w);
    float h[2];
    KILN_TRY(kiln_cuda_adamw_norms(be, w.table, tab->P, &w.norm_plan, w.norms, w.out, 0, 0.0f));
    if (norms)
        KILN_TRY(kiln_backend_download(be, norms, w.norms, (size_t)tab->P * sizeof(float)));
    if (sq_norm || total || !norms) { /* one download (a wait) fewer when unasked */
        KILN_TRY(kiln_backend_download(be, h, w.out, sizeof h));
        if (sq_norm) *sq_norm = h[0];
        if (total) *total = h[1];
    }
    return KILN_OK;
}

kiln_status kiln_cuda_adamw_op_clip(kiln_backend *be, const kiln_adamw_table *tab, void *ws,
                                    float max_norm_f, float *total_norm, float *coef) {
    dev_ws w;
    dev_layout(tab, ws, &w);
    /* the coefficient stays on the device between the norm and the scaling */
    KILN_TRY(kiln_cuda_adamw_norms(be, w.table, tab->P, &w.norm_plan, w.norms, w.out, 1,
                                   max_norm_f));
    KILN_TRY(kiln_cuda_adamw_scale(be, w.table, tab->P, w.max_n, w.out + 2));
    if (total_norm || coef) {
        float h[3];
        KILN_TRY(kiln_backend_download(be, h, w.out, sizeof h));
        if (total_norm) *total_norm = h[1];
        if (coef) *coef = h[2];
    }
    return KILN_OK;
}
#else
typedef int kiln_cuda_adamw_op_unused; /* ISO C wants a non-empty translation unit */
#endif /* KILN_HAVE_CUDA */
