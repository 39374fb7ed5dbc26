/*
 * linear_ce.c -- the public fused linear cross-entropy (include/kiln.h, kiln_linear_ce_*):
 * a backend of its own (the CPU, or a CUDA device in auditable or fast mode) and the call
 * translated into fused_ce.h's kiln_fused_ce, which does the work.
 *
 * Two forms of call:
 *   - the vocabulary walk (the default, and everywhere the row walk does not apply): one
 *     kiln_fused_ce call, which allocates its scratch and returns once the outputs are
 *     complete;
 *   - the row walk (CUDA fast mode, row_block > 0, a bf16 weight read in place, dhidden or
 *     dweight, no row_loss): fused_ce.h takes it only in the training step's one-call form,
 *     which enqueues its work and leaves the loss pending. This file supplies what that form
 *     needs (row statistics on the device and the scratch, both kept and grown by the handle),
 *     waits for the backend, downloads the statistics and makes the loss from them
 *     (kiln_fused_ce_loss_from_stats: the bits the call would have returned), as the trainer
 *     does at the end of a step.
 */
#include "../base/base.h"
#include "../base/handle.h"
#include "../ops/ops.h"
#include "../ops/fused_ce.h"

#include <string.h>

struct kiln_linear_ce {
    kiln_handle_head head; /* first: the registry's magic (base/handle.h) */
    kiln_backend *be;
    int device, fast;
    void *stats;         /* the row walk's (N, 3) f32 statistics, device memory, stats_cap bytes */
    size_t stats_cap;
    void *scratch;       /* the row walk's scratch, device memory, scratch_cap bytes */
    size_t scratch_cap;
};

kiln_linear_ce_params kiln_linear_ce_default_params(void) {
    kiln_linear_ce_params p;
    memset(&p, 0, sizeof p);
    p.reduction = KILN_LOSS_MEAN;
    p.scale = 1.0f;
    return p;
}

kiln_status kiln_linear_ce_create(int device, int fast, kiln_linear_ce **out) {
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_linear_ce_create: out is NULL");
    *out = NULL;
    if (device < -1)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_linear_ce_create: device %d (-1 = CPU, N >= 0 = CUDA device N)", device);
    if (device < 0 && fast)
        return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_linear_ce_create: fast mode needs a CUDA device (the CPU computes the loss one way)");
    kiln_linear_ce *c = kiln_calloc(1, sizeof *c);
    if (!c) return kiln_error(KILN_ERR_NOMEM, "kiln_linear_ce_create: out of memory");
    c->device = device;
    c->fast = fast ? 1 : 0;
    kiln_status st = kiln_backend_acquire(device, c->fast, 0, &c->be);
    if (st != KILN_OK) {
        kiln_free(c);
        return st; /* the backend named why */
    }
    st = kiln_handle_register(&c->head, KILN_HANDLE_LINEAR_CE, "kiln_linear_ce_create");
    if (st != KILN_OK) {
        kiln_backend_release(c->be);
        kiln_free(c);
        return st;
    }
    *out = c;
    return KILN_OK;
}

void kiln_linear_ce_free(kiln_linear_ce *c) {
    if (!c || kiln_handle_unregister(&c->head, KILN_HANDLE_LINEAR_CE, "kiln_linear_ce_free") != KILN_OK) return;
    if (c->stats) kiln_backend_free_buf(c->be, c->stats);
    if (c->scratch) kiln_backend_free_buf(c->be, c->scratch);
    kiln_backend_release(c->be);
    kiln_free(c);
}

/* *buf holds at least need bytes of backend memory (grown by a new allocation, the old one
 * freed first; contents not kept). */
static kiln_status grow(kiln_linear_ce *c, void **buf, size_t *cap, size_t need, const char *what) {
    if (*cap >= need && *buf) return KILN_OK;
    if (*buf) kiln_backend_free_buf(c->be, *buf);
    *cap = 0;
    *buf = kiln_backend_alloc(c->be, need);
    if (!*buf)
        return kiln_error(KILN_ERR_NOMEM, "kiln_linear_ce_compute: %s: cannot allocate %zu bytes of device memory", what, need);
    *cap = need;
    return KILN_OK;
}

/* The row walk's call (the header's conditions hold; S supervised rows): the one-call form
 * with the handle's statistics and scratch, waited for, the loss made from the statistics. */
static kiln_status row_walk(kiln_linear_ce *c, kiln_fused_ce_params *fp, int64_t S,
                            kiln_fused_ce_result *r) {
    const size_t need = kiln_fused_ce_row_block_bytes(S, fp->H, fp->V, fp->row_block,
                                                      fp->dhidden != NULL, fp->dweight != NULL, 0);
    if (need == 0)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_linear_ce_compute: row_block %lld: no row walk for %lld rows, H %lld, V %lld",
                          (long long)fp->row_block, (long long)S, (long long)fp->H, (long long)fp->V);
    const size_t stats_bytes = (size_t)fp->N * 3 * sizeof(float);
    KILN_TRY(grow(c, &c->stats, &c->stats_cap, stats_bytes, "row statistics"));
    KILN_TRY(grow(c, &c->scratch, &c->scratch_cap, need, "row-walk scratch"));
    fp->row_stats_out = (float *)c->stats;
    fp->no_wait = 1;
    fp->scratch = c->scratch;
    fp->scratch_cap = c->scratch_cap;
    KILN_TRY(kiln_fused_ce(c->be, fp, r));
    KILN_TRY(kiln_backend_status(c->be)); /* the end of the work the call enqueued */
    if (!r->loss_pending) return KILN_OK;  /* the call waited and returned the loss itself */
    float *host = kiln_malloc(stats_bytes);
    if (!host) return kiln_error(KILN_ERR_NOMEM, "kiln_linear_ce_compute: out of host memory for %lld rows' statistics", (long long)fp->N);
    kiln_status st = kiln_backend_download(c->be, host, c->stats, stats_bytes);
    kiln_fused_ce_result lr;
    if (st == KILN_OK) st = kiln_fused_ce_loss_from_stats(fp, host, &lr);
    kiln_free(host);
    if (st != KILN_OK) return st;
    r->loss = lr.loss;
    r->loss_f64 = lr.loss_f64;
    r->n_supervised = lr.n_supervised;
    r->loss_pending = 0;
    return KILN_OK;
}

static kiln_status linear_ce_compute(kiln_linear_ce *c, const kiln_linear_ce_params *p,
                                     kiln_linear_ce_result *out);

/* The API boundary: a live handle whose backend is not poisoned (kiln.h KILN_ERR_POISONED). */
static kiln_status linear_ce_enter(const kiln_linear_ce *c, const char *fn) {
    KILN_TRY(kiln_handle_check(c, KILN_HANDLE_LINEAR_CE, fn));
    return kiln_backend_enter(c->be, fn);
}

kiln_status kiln_linear_ce_status(const kiln_linear_ce *c) { return linear_ce_enter(c, "kiln_linear_ce_status"); }

kiln_status kiln_linear_ce_compute(kiln_linear_ce *c, const kiln_linear_ce_params *p,
                                   kiln_linear_ce_result *out) {
    if (out) memset(out, 0, sizeof *out);
    KILN_TRY(linear_ce_enter(c, "kiln_linear_ce_compute"));
    return kiln_backend_leave(c->be, linear_ce_compute(c, p, out), "kiln_linear_ce_compute");
}

static kiln_status linear_ce_compute(kiln_linear_ce *c, const kiln_linear_ce_params *p,
                                     kiln_linear_ce_result *out) {
    if (!p) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_linear_ce_compute: NULL parameters");
    if (p->reduction != KILN_LOSS_MEAN && p->reduction != KILN_LOSS_SUM)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_linear_ce_compute: reduction %d (KILN_LOSS_MEAN or KILN_LOSS_SUM)", (int)p->reduction);
    if (p->row_block < 0)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_linear_ce_compute: row_block %lld < 0", (long long)p->row_block);
    kiln_fused_ce_params fp = kiln_fused_ce_default_params();
    fp.N = p->N;
    fp.H = p->H;
    fp.V = p->V;
    if (p->hidden_stride < 0)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_linear_ce_compute: hidden_stride %lld < 0", (long long)p->hidden_stride);
    if (p->hidden_stride != 0 && p->hidden_stride < p->H)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_linear_ce_compute: hidden_stride %lld < H %lld (0 = H)",
                          (long long)p->hidden_stride, (long long)p->H);
    if (c->device >= 0 && (p->hidden_bf16 || (p->hidden_stride != 0 && p->hidden_stride != p->H)))
        return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_linear_ce_compute: %s on CUDA: the device reads f32 hidden "
                          "states with rows back to back (hidden_stride 0 or H)",
                          p->hidden_bf16 ? "hidden_bf16" : "hidden_stride");
    if (p->hidden_bf16)
        fp.hidden16 = (const uint16_t *)p->hidden;
    else
        fp.hidden = (const float *)p->hidden;
    fp.hidden_ld = p->hidden_stride;
    fp.weight = p->weight;
    fp.weight_dtype = p->weight_bf16 ? KILN_DTYPE_BF16 : KILN_DTYPE_F32;
    fp.targets = p->targets;
    fp.mask = p->mask;
    fp.reduction = p->reduction == KILN_LOSS_SUM ? KILN_CE_REDUCTION_SUM : KILN_CE_REDUCTION_MEAN;
    fp.scale = p->scale;
    fp.chunk = p->chunk;
    fp.dhidden = p->dhidden;
    fp.dhidden_accumulate = p->dhidden_accumulate;
    fp.dweight = p->dweight;
    fp.row_loss = p->row_loss;

    kiln_fused_ce_result r;
    memset(&r, 0, sizeof r);
    const int rows = c->device >= 0 && c->fast && p->row_block > 0 && p->weight_bf16 &&
                     (p->dhidden || p->dweight) && !p->row_loss;
    if (rows) {
        if (!p->targets || p->N < 1 || p->H < 1 || p->V < 1)
            return kiln_error(KILN_ERR_INVALID_ARG, "kiln_linear_ce_compute: no targets, or N, H, V < 1");
        int64_t S = 0;
        KILN_TRY(kiln_fused_ce_supervised(&fp, &S));
        fp.row_block = p->row_block;
        KILN_TRY(row_walk(c, &fp, S, &r));
    } else {
        KILN_TRY(kiln_fused_ce(c->be, &fp, &r));
    }
    if (out) {
        out->loss = r.loss;
        out->loss_f64 = r.loss_f64;
        out->n_supervised = r.n_supervised;
        out->scratch_bytes = r.scratch_bytes;
    }
    return KILN_OK;
}
