/*
 * trainer_dp.c -- a trainer as one rank of a data-parallel run (docs/DISTRIBUTED.md, "Data-
 * parallel training"): ZeRO stages 2 and 3 over the communicator of src/dist/comm.h (stage 3,
 * the weights sharded too: the section "stage 3" below; a step as described here is stage 2's).
 *
 * The flat vector: the trainable parameters in the trainer's order (transformers'
 * named_parameters()), each one's elements in order, back to back: `total` elements. With N
 * ranks and S = ceil(total / N), rank r owns the elements [r S, min((r + 1) S, total)) -- a
 * range may start or end inside a tensor, and the last ranges may be short or empty. The
 * tensors stay where the trainer put them; the flat vector is what the collectives move, a
 * chunk at a time: chunk k is elements [r S + k C, r S + k C + C) of every rank r's range, C =
 * `chunk` elements (the staging buffers hold N C words, not the whole vector).
 *
 * A step (the CLI's, tools/cmd_train.c):
 *   1. each rank forwards and backwards its micro-batch into the full-size gradients (as one
 *      process does);
 *   2. kiln_train_dp_reduce_grads: the gradients, packed in flat order, are reduce-scattered
 *      (kiln_comm_reduce_scatter_f32: rank order from +0), so this rank's range of the
 *      gradient buffers holds the sum over ranks; the rest of the buffers is stale;
 *   3. clip_grads / grad_sq_norm: the per-tensor norms with torch's 8-lane sums, each tensor
 *      fed in flat order across the ranks that hold a piece of it (the lane state passed on
 *      from rank to rank: kiln_sumsq8_feed), so the norm has one process's bits;
 *   4. the optimizer step: opt_mat / opt_vec are AdamW over this rank's pieces only (their
 *      moments, master copy and compensation are 1/N of one process's), elementwise the same
 *      update; then the updated weights are all-gathered (bf16 weights as their bits) so every
 *      rank has the whole model for the next forward.
 * Checkpoints are sets of shards (checkpoint.h): each rank writes its range of the flat vector
 * (the weights and the optimizer's arrays, as words) into its own file, rank 0 commits the set
 * with its manifest; a set of any rank count loads on any other (each rank copies its range out
 * of the shards that meet it), and one process's state.kiln still loads on N ranks.
 */
#define _DEFAULT_SOURCE /* madvise (Linux, the BSDs) */
#include "trainer.h"
#include "trainer_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

struct kiln_train_dp {
    kiln_comm *c;      /* the caller's; outlives the trainer */
    int rank, size;
    int64_t total;     /* elements of the flat vector */
    int64_t S;         /* elements per rank's range: ceil(total / size) */
    int64_t lo, hi;    /* this rank's range [lo, hi) (lo == hi: empty) */
    int64_t chunk;     /* C: elements of a rank's range a collective moves at once (<= S) */
    int64_t *first;    /* (n_params + 1) each parameter's first flat element; first[n] = total */
    int *slot;         /* (n_params) parameter i's slot in this rank's optimizer of its kind, or -1 */
    int *whole;        /* (n_params) its slot in one process's optimizer of its kind */
    uint32_t *stage;   /* (size, chunk) words: a chunk of every rank's range */
    uint32_t *own;     /* (chunk) words: this rank's part of a chunk (reduce-scatter's result) */
    /* GPU ranks: dev is the device trainer's backend (NULL: a CPU rank); with the nccl
     * communicator (dev_stage) stage and own are its device memory, with MPI (a GPU rank among
     * CPU ranks: heterogeneous, auditable) host memory that the rank's pieces are downloaded
     * to and uploaded from; hwords is a host chunk (checkpoints, the norms of tensors cut by a
     * range's end), h16 its bf16 half; the optimizer state of one slot downloaded for the
     * chunks of a checkpoint (cache_o, cache_j: which) */
    kiln_backend *dev;
    int dev_stage;
    uint32_t *hwords;
    uint16_t *h16;
    const kiln_adamw *cache_o; /* NULL: nothing cached (set at each save's start) */
    int cache_j;
    float *cache_m, *cache_v;
    int64_t cache_n;
    const kiln_adamw *cache_xo; /* the slot whose master copy or compensation cache_x is */
    int cache_xj, cache_xkind;
    const void *cache_x;        /* the optimizer's host mirror (valid until its next call) */
    /* a GPU trainer loading a set: the slot being written, uploaded when the writes move on to
     * another slot or end (dev_state_flush): its moments in cache_m / cache_v (moments_dirty),
     * its master copy or compensation in wx (wx_o, wx_j, wx_kind; wx_dirty) */
    int moments_dirty;
    void *wx;
    int64_t wx_n;
    const kiln_adamw *wx_o;
    int wx_j, wx_kind, wx_dirty;

    /* ZeRO-3 (sharded): the weights are sharded too. Unit l < L: layer l's matrices; unit L
     * ("the rest"): the per-model parameters, the extras and every vector (small, kept whole
     * for the whole step). A unit is gathered before its work and released after it. */
    int sharded;
    int n_units;            /* L + 1 */
    int *unit;              /* (n_params) each parameter's unit */
    int *gathered;          /* (n_units) the unit's weights are whole here, and current */
    int rest_grads;         /* the rest's gradients are being written (a step's backward) */
    kiln_status err;        /* the first failure of a layer event's collectives, or KILN_OK */
    kiln_layer_hook hook;   /* the layer events (models/arch.h), bound into t->io */
    size_t page;            /* the system's page size; 0: no page is given back (an allocator hook) */
    /* kiln's count of the bytes of weights and gradients this rank holds: its range and every
     * vector always, a unit's other bytes while it is gathered (its gradients while its
     * backward writes them); the peaks since attach */
    uint64_t *out_w, *out_g; /* (n_units) bytes of a unit's matrices outside this rank's range */
    uint64_t held_w, held_g, peak_w, peak_g;
};

static void dp_free(kiln_train_dp *d) {
    if (!d) return;
    if (d->dev_stage) {
        /* the communicator outlives the trainer, the backend's stream does not: back to its own */
        if (d->c) (void)kiln_comm_set_stream(d->c, NULL);
        kiln_backend_free_buf(d->dev, d->stage);
        kiln_backend_free_buf(d->dev, d->own);
        d->stage = d->own = NULL;
    }
    kiln_free(d->hwords);
    kiln_free(d->h16);
    kiln_free(d->cache_m);
    kiln_free(d->cache_v);
    kiln_free(d->wx);
    kiln_free(d->unit);
    kiln_free(d->gathered);
    kiln_free(d->out_w);
    kiln_free(d->out_g);
    kiln_free(d->first);
    kiln_free(d->slot);
    kiln_free(d->whole);
    kiln_free(d->stage);
    kiln_free(d->own);
    kiln_free(d);
}

/* ---- the flat vector, read and written where its elements live ---------------------------- */

/* What a flat element is, as a 4-byte word: the gradient (f32), the weight (f32, or bf16 widened:
 * its bits in the high half, exact both ways) or a state array of the optimizer (0 m, 1 v,
 * 2 master, 3 the compensation, bf16 widened) -- of this rank's shards (own range only), or of
 * one process's optimizers wm / wv. */
enum { FLAT_GRAD = -2, FLAT_WEIGHT = -1 };

typedef struct flat_io {
    kiln_trainer *t;
    int what;               /* FLAT_GRAD, FLAT_WEIGHT, or a state kind 0..3 */
    kiln_adamw *wm, *wv;    /* state kinds: one process's optimizers, or NULL: this rank's shards */
    int dev_words;          /* a GPU rank over nccl: the words are the backend's memory (stage, own), else host */
} flat_io;

static kiln_status slot_words(kiln_adamw *o, int j, int kind, int64_t off, int64_t n, uint32_t *words, int to_words);
static kiln_status shard_weights(kiln_trainer *t);

static kiln_status dev_state_words(kiln_train_dp *d, kiln_adamw *o, int j, int64_t sn, int kind, int64_t off,
                                   int64_t n, uint32_t *words);
static kiln_status dev_state_write(kiln_train_dp *d, kiln_adamw *o, int j, int64_t sn, int kind, int64_t off,
                                   int64_t n, const uint32_t *words);

/* A GPU rank's segment: n elements of tensor memory at p (4-byte f32, or bf16 when half) to or
 * from words, which are device memory (f->dev_words) or host memory. */
static kiln_status dev_segment(const flat_io *f, void *p, int half, uint32_t *x, int64_t n, int to_words) {
    kiln_train_dp *d = f->t->dp;
    kiln_backend *be = d->dev;
    if (f->dev_words) {
        if (!half)
            return to_words ? be->i->copy(be, x, p, (size_t)n * 4) : be->i->copy(be, p, x, (size_t)n * 4);
        be->i->bf16_words(be, x, p, (size_t)n, to_words);
        return KILN_OK;
    }
    /* host words, a chunk at most: through h16 for bf16 */
    if (!half)
        return to_words ? kiln_backend_download(be, x, p, (size_t)n * 4) : kiln_backend_upload(be, p, x, (size_t)n * 4);
    if (to_words) {
        KILN_TRY(kiln_backend_download(be, d->h16, p, (size_t)n * 2));
        for (int64_t k = 0; k < n; k++) x[k] = (uint32_t)d->h16[k] << 16;
        return KILN_OK;
    }
    for (int64_t k = 0; k < n; k++) d->h16[k] = (uint16_t)(x[k] >> 16);
    return kiln_backend_upload(be, p, d->h16, (size_t)n * 2);
}

/* Elements [e0, e0 + n) of parameter i to words x (to_words) or from them: a GPU rank's. Its
 * optimizer state goes to host words only (a checkpoint's shard). */
static kiln_status move_dev(const flat_io *f, int i, int64_t e0, int64_t n, uint32_t *x, int to_words) {
    kiln_trainer *t = f->t;
    kiln_train_dp *d = t->dp;
    train_param *p = &t->params[i];
    if (f->what == FLAT_GRAD) return dev_segment(f, p->g + e0, 0, x, n, to_words);
    if (f->what == FLAT_WEIGHT) {
        const int half = p->dtype != KILN_DTYPE_F32;
        return dev_segment(f, (uint8_t *)p->w + (size_t)e0 * (half ? 2 : 4), half, x, n, to_words);
    }
    if (f->dev_words || f->wm)
        return kiln_error(KILN_ERR_UNSUPPORTED, "trainer: a GPU rank's optimizer state moves through host words only "
                                                "(a checkpoint's shard)");
    const int is_mat = p->n_dims == 2;
    if (!is_mat && f->what >= 2) { /* vectors have no master copy or compensation */
        memset(x, 0, (size_t)n * 4);
        return KILN_OK;
    }
    const int64_t off = is_mat ? t->mat_off[d->slot[i]] : t->vec_off[d->slot[i]];
    const int64_t pa = d->lo > d->first[i] ? d->lo : d->first[i], pb = d->hi < d->first[i + 1] ? d->hi : d->first[i + 1];
    kiln_adamw *o = is_mat ? t->opt_mat : t->opt_vec;
    return to_words ? dev_state_words(d, o, d->slot[i], pb - pa, f->what, e0 - off, n, x)
                    : dev_state_write(d, o, d->slot[i], pb - pa, f->what, e0 - off, n, x);
}

/* The same for a CPU rank (host memory everywhere). */
static kiln_status move_host(const flat_io *f, int i, int64_t e0, int64_t n, uint32_t *x, int to_words) {
    kiln_trainer *t = f->t;
    const kiln_train_dp *d = t->dp;
    train_param *p = &t->params[i];
    if (f->what == FLAT_GRAD) {
        if (to_words)
            memcpy(x, p->g + e0, (size_t)n * 4);
        else
            memcpy(p->g + e0, x, (size_t)n * 4);
    } else if (f->what == FLAT_WEIGHT) {
        if (p->dtype == KILN_DTYPE_F32) {
            if (to_words)
                memcpy(x, (const float *)p->w + e0, (size_t)n * 4);
            else
                memcpy((float *)p->w + e0, x, (size_t)n * 4);
        } else {
            uint16_t *h = (uint16_t *)p->w + e0;
            for (int64_t k = 0; k < n; k++) {
                if (to_words)
                    x[k] = (uint32_t)h[k] << 16;
                else
                    h[k] = (uint16_t)(x[k] >> 16);
            }
        }
    } else {
        const int is_mat = p->n_dims == 2;
        if (!is_mat && f->what >= 2) { /* vectors have no master copy or compensation */
            if (to_words) memset(x, 0, (size_t)n * 4);
            return KILN_OK;
        }
        if (f->wm) return slot_words(is_mat ? f->wm : f->wv, d->whole[i], f->what, e0, n, x, to_words);
        const int64_t off = is_mat ? t->mat_off[d->slot[i]] : t->vec_off[d->slot[i]];
        return slot_words(is_mat ? t->opt_mat : t->opt_vec, d->slot[i], f->what, e0 - off, n, x, to_words);
    }
    return KILN_OK;
}

/* Elements [a, b) of the flat vector to words (to_words; past total: 0) or from them. */
static kiln_status flat_move(const flat_io *f, int64_t a, int64_t b, uint32_t *w, int to_words) {
    kiln_trainer *t = f->t;
    const kiln_train_dp *d = t->dp;
    int i = 0;
    while (i < t->n_params && d->first[i + 1] <= a) i++;
    for (; i < t->n_params && d->first[i] < b; i++) {
        const int64_t s = a > d->first[i] ? a : d->first[i], e = b < d->first[i + 1] ? b : d->first[i + 1];
        uint32_t *x = w + (s - a);
        KILN_TRY((d->dev ? move_dev : move_host)(f, i, s - d->first[i], e - s, x, to_words));
    }
    if (to_words && b > d->total) {
        const int64_t z = a > d->total ? a : d->total;
        if (f->dev_words)
            d->dev->i->zero(d->dev, (float *)(void *)(w + (z - a)), (size_t)(b - z));
        else
            memset(w + (z - a), 0, (size_t)(b - z) * 4);
    }
    return KILN_OK;
}

/* The chunks of the ranges: chunk k is [k C, min((k + 1) C, S)) of every range. */
static int64_t chunk_len(const kiln_train_dp *d, int64_t c0) { return d->S - c0 < d->chunk ? d->S - c0 : d->chunk; }

/* Every rank's elements [r S + c0, r S + c0 + len) of f to every rank (an all-gather of this
 * rank's part), written where they live when write (else left in stage). */
static kiln_status gather_chunk(const flat_io *f, int64_t c0, int64_t len, int write) {
    kiln_train_dp *d = f->t->dp; /* f->dev_words: stage is the backend's on a GPU rank */
    uint32_t *mine = d->stage + (size_t)d->rank * (size_t)len;
    KILN_TRY(flat_move(f, d->lo + c0, d->lo + c0 + len, mine, 1));
    KILN_TRY(kiln_comm_allgather(d->c, d->stage, mine, (size_t)len * 4));
    for (int r = 0; write && r < d->size; r++) {
        const int64_t a = (int64_t)r * d->S + c0, b = a + len < d->total ? a + len : d->total;
        if (a < b) KILN_TRY(flat_move(f, a, b, d->stage + (size_t)r * (size_t)len, 0));
    }
    return KILN_OK;
}

void kiln_trainer_dp_free(kiln_trainer *t) {
    dp_free(t->dp);
    t->dp = NULL;
}

void kiln_trainer_dp_range(const kiln_trainer *t, int64_t *lo, int64_t *hi, int64_t *total, int64_t *staging) {
    const kiln_train_dp *d = t->dp;
    *lo = d->lo;
    *hi = d->hi;
    *total = d->total;
    *staging = (d->chunk * d->size + d->chunk) * 4;
}

int kiln_train_dp_size(const kiln_trainer *t) { return t && t->dp ? t->dp->size : 1; }
int kiln_train_dp_stage(const kiln_trainer *t) { return t && t->dp ? (t->dp->sharded ? 3 : 2) : 0; }
int kiln_train_dp_rank(const kiln_trainer *t) { return t && t->dp ? t->dp->rank : 0; }

/* KILN_DP_DEVICE_PATH=1: a CPU trainer takes a GPU trainer's path through host words (its
 * backend's downloads and uploads are copies), so that the CPU's tests run that code. */
static int device_path_forced(void) {
    const char *v = getenv("KILN_DP_DEVICE_PATH");
    return v && !strcmp(v, "1");
}

kiln_status kiln_train_dp_attach(kiln_trainer *t, kiln_comm *c, int zero_stage) {
    KILN_TRY(kiln_trainer_enter(t, "kiln_train_dp_attach"));
    if (!c) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_dp_attach: the communicator is NULL");
    if (zero_stage != 2 && zero_stage != 3)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_dp_attach: ZeRO stage %d: use 2 (gradients and optimizer "
                          "state sharded) or 3 (the weights too)", zero_stage);
    if (t->dp) return kiln_error(KILN_ERR_STATE, "kiln_train_dp_attach: the trainer is a rank already");
    /* one process: the trainer as it is; a device communicator of one rank (nccl) runs the
     * ranks' path, so that one GPU tests what N do */
    if (kiln_comm_size(c) == 1 && kiln_comm_host_memory(c)) return KILN_OK;
    /* a GPU rank over host memory (MPI): the heterogeneous ranks of the auditable arithmetic
     * (docs/DISTRIBUTED.md, "CPU and GPU ranks together"); KILN_DP_DEVICE_PATH=1 gives a CPU
     * trainer that path (its backend's download and upload are copies), for the CPU's tests */
    const int host_comm = kiln_comm_host_memory(c);
    const int device_path = !t->host || (host_comm && device_path_forced());
    if (t->host && !host_comm)
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "kiln_train_dp_attach: a CPU trainer with the %s communicator: CPU ranks talk over MPI "
                          "(mpirun), GPU ranks over NCCL (kiln_comm_open_nccl) or MPI", kiln_comm_name(c));
    if (!t->host && host_comm && t->p.fast)
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "kiln_train_dp_attach: a GPU rank over %s takes the auditable arithmetic (the CPU's bits, "
                          "which every rank shares); fast GPU ranks talk over NCCL", kiln_comm_name(c));
    if (!t->host) {
        const kiln_backend_i *bi = t->be->i;
        if (!bi->copy || !bi->bf16_words || !bi->native_stream || !bi->zero)
            return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_train_dp_attach: the %s backend cannot move a rank's "
                              "flat vector (no copy, bf16_words or native_stream)", bi->name);
        if (!host_comm && kiln_comm_device(c) != t->p.device)
            return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_dp_attach: the communicator is on CUDA device %d, "
                              "the trainer on device %d", kiln_comm_device(c), t->p.device);
    }
    if (device_path) {
        if (zero_stage == 3)
            return kiln_error(KILN_ERR_UNSUPPORTED,
                              "kiln_train_dp_attach: ZeRO-3 on GPU ranks is not written yet (a GPU gives no memory "
                              "back page by page; it needs CUDA's virtual memory mapping): use ZeRO-2 (--zero 2: "
                              "gradients and optimizer state sharded, the weights whole on every rank)");
    }
    if (t->p.weight_storage == KILN_STORAGE_BF16_SR || t->p.moment_storage == KILN_MOMENTS_Q8)
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "kiln_train_dp_attach: %s with %d ranks is not supported yet (its arithmetic depends on "
                          "an element's index in its tensor, which a rank's piece does not keep): use f32, "
                          "bf16 + master or bf16 + Kahan weights with f32 moments",
                          t->p.weight_storage == KILN_STORAGE_BF16_SR ? "stochastic rounding" : "8-bit moments",
                          kiln_comm_size(c));
    if (kiln_adamw_get_step(t->opt_mat) > 0)
        return kiln_error(KILN_ERR_STATE, "kiln_train_dp_attach: attach before the first optimizer step");
    kiln_train_dp *d = kiln_calloc(1, sizeof *d);
    if (!d) return kiln_error(KILN_ERR_NOMEM, "kiln_train_dp_attach: out of memory");
    d->c = c;
    d->rank = kiln_comm_rank(c);
    d->size = kiln_comm_size(c);
    d->first = kiln_calloc((size_t)t->n_params + 1, sizeof *d->first);
    kiln_status st = d->first ? KILN_OK : kiln_error(KILN_ERR_NOMEM, "kiln_train_dp_attach: out of memory");
    for (int i = 0; st == KILN_OK && i < t->n_params; i++) d->first[i + 1] = d->first[i] + t->params[i].n;
    if (st == KILN_OK) {
        d->total = d->first[t->n_params];
        d->S = (d->total + d->size - 1) / d->size;
        d->lo = d->rank * d->S < d->total ? d->rank * d->S : d->total;
        d->hi = d->lo + d->S < d->total ? d->lo + d->S : d->total;
        /* about 64 MiB of staging in all (KILN_DP_CHUNK: elements a rank, for tests that cross
         * chunk boundaries with a small model) */
        d->chunk = ((int64_t)1 << 24) / d->size;
        const char *env = getenv("KILN_DP_CHUNK");
        if (env && atoll(env) > 0) d->chunk = atoll(env);
        if (d->chunk > d->S) d->chunk = d->S;
        if (d->chunk < 1) d->chunk = 1;
        /* not zeroed: every word is written before it is read (a collective packs what it
         * sends), so a ZeRO-3 rank touches only the pages its pieces use */
        size_t words = 0, bytes = 0;
        if (!kiln_mul_overflow((size_t)d->chunk, (size_t)d->size, &words) && !kiln_mul_overflow(words, 4, &bytes)) {
            if (device_path) { /* a GPU rank: a host chunk (and its bf16 half) beside */
                d->dev = t->be;
                d->dev_stage = !host_comm;
                d->hwords = kiln_malloc((size_t)d->chunk * 4);
                d->h16 = kiln_malloc((size_t)d->chunk * 2);
                d->cache_j = -1;
            }
            if (!d->dev_stage) {
                d->stage = kiln_malloc(bytes);
                d->own = kiln_malloc((size_t)d->chunk * 4);
            } else { /* over nccl: the collectives' buffers on the device */
                d->stage = kiln_backend_alloc(t->be, bytes);
                d->own = kiln_backend_alloc(t->be, (size_t)d->chunk * 4);
                if (d->stage && d->own && d->hwords && d->h16) {
                    kiln_status sst = kiln_comm_set_stream(c, t->be->i->native_stream(t->be));
                    if (sst != KILN_OK) {
                        dp_free(d);
                        return kiln_error_prefix(sst, "kiln_train_dp_attach");
                    }
                }
            }
        }
        d->slot = kiln_calloc((size_t)t->n_params + 1, sizeof(int));
        d->whole = kiln_calloc((size_t)t->n_params + 1, sizeof(int));
        if (!d->stage || !d->own || !d->slot || !d->whole || (d->dev && (!d->hwords || !d->h16)))
            st = kiln_error(KILN_ERR_NOMEM, "kiln_train_dp_attach: out of memory for the staging (%lld words)",
                            (long long)(d->chunk * d->size));
        int n_mat = 0, n_vec = 0;
        for (int i = 0; st == KILN_OK && i < t->n_params; i++)
            d->whole[i] = t->params[i].n_dims == 2 ? n_mat++ : n_vec++;
    }
    /* the optimizers remade over this rank's range only */
    kiln_adamw *m = NULL, *v = NULL;
    if (st == KILN_OK) st = kiln_trainer_make_optimizers(t, d->lo, d->hi, &m, &v, 1);
    if (st != KILN_OK) {
        dp_free(d);
        /* the slot tables may be the range's: the whole optimizers' again */
        kiln_adamw *wm = NULL, *wv = NULL;
        int64_t total = 0;
        for (int i = 0; i < t->n_params; i++) total += t->params[i].n;
        if (kiln_trainer_make_optimizers(t, 0, total, &wm, &wv, 1) == KILN_OK) {
            kiln_adamw_free(t->opt_mat);
            kiln_adamw_free(t->opt_vec);
            t->opt_mat = wm;
            t->opt_vec = wv;
        }
        return st;
    }
    kiln_adamw_free(t->opt_mat);
    kiln_adamw_free(t->opt_vec);
    t->opt_mat = m;
    t->opt_vec = v;
    for (int i = 0; i < t->n_params; i++) d->slot[i] = -1;
    for (int j = 0; j < t->n_mat; j++) d->slot[t->mat_index[j]] = j;
    for (int j = 0; j < t->n_vec; j++) d->slot[t->vec_index[j]] = j;
    t->dp = d;
    if (zero_stage == 3) {
        kiln_status sst = shard_weights(t);
        if (sst != KILN_OK) { /* the tables failed before anything was released */
            t->io.hook = NULL;
            d->sharded = 0;
            return sst;
        }
    }
    return KILN_OK;
}

/* ---- gradients ----------------------------------------------------------------------------- */

kiln_status kiln_train_dp_zero_grads(kiln_trainer *t) {
    KILN_TRY(kiln_trainer_enter(t, "kiln_train_dp_zero_grads"));
    if (t->dp && t->dp->sharded)
        kiln_trainer_dp_zero_own_grads(t);
    else if (!t->host)
        t->be->i->zero(t->be, t->grad_block, t->n_grad);
    else
        for (int i = 0; i < t->n_params; i++) memset(t->params[i].g, 0, (size_t)t->params[i].n * sizeof(float));
    t->grad_coef = 1.0f;
    t->grads_finite = 0;
    t->grads_unusable = 0;
    return KILN_OK;
}

kiln_status kiln_train_dp_reduce_grads(kiln_trainer *t) {
    KILN_TRY(kiln_trainer_enter(t, "kiln_train_dp_reduce_grads"));
    kiln_train_dp *d = t->dp;
    if (!d || d->sharded) return KILN_OK; /* stage 3: reduced layer by layer in the step */
    if (t->grads_unusable || t->grad_coef != 1.0f)
        return kiln_error(KILN_ERR_STATE, "kiln_train_dp_reduce_grads: the gradients are %s", t->grads_unusable ?
                          "unusable (a step failed after its gradient work began)" : "clipped already");
    /* chunk by chunk: every rank's part of the chunk packed in rank order, reduce-scattered,
     * this rank's part of the sum written over its gradients (positions no later chunk reads) */
    const flat_io f = {t, FLAT_GRAD, NULL, NULL, d->dev_stage};
    for (int64_t c0 = 0; c0 < d->S; c0 += d->chunk) {
        const int64_t len = chunk_len(d, c0);
        for (int r = 0; r < d->size; r++) {
            const int64_t a = (int64_t)r * d->S + c0;
            KILN_TRY(flat_move(&f, a, a + len, d->stage + (size_t)r * (size_t)len, 1));
        }
        KILN_TRY(kiln_comm_reduce_scatter_f32(d->c, (float *)(void *)d->own, (const float *)(const void *)d->stage,
                                              (size_t)len));
        const int64_t a = d->lo + c0, b = a + len < d->hi ? a + len : d->hi;
        if (a < b) KILN_TRY(flat_move(&f, a, b, d->own, 0));
    }
    t->grads_finite = 0;
    return KILN_OK;
}

/* norms[i] (n_params floats, on every rank) = torch's 2-norm of parameter i's summed gradient,
 * one process's bits: each tensor's sum of squares is fed in flat order, the pieces of a tensor
 * cut between ranks one rank after another (the lane state handed on by N - 1 small
 * all-gathers: round k passes rank k's state to rank k + 1), then the ranks' finished norms
 * are all-gathered and each taken from the rank holding its tensor's last element. */
/* Elements [e0, e0 + len) of parameter i's gradient fed to s: in place on the CPU; on a GPU
 * rank downloaded a host chunk at a time (the state carries across chunks, so the sum is the
 * one of a single feed). */
static kiln_status feed_grad(kiln_trainer *t, kiln_sumsq8_state *s, int i, int64_t e0, int64_t len) {
    kiln_train_dp *d = t->dp;
    const train_param *p = &t->params[i];
    if (!d->dev) {
        kiln_sumsq8_feed(s, p->g + e0, e0, len, p->n);
        return KILN_OK;
    }
    for (int64_t k = 0; k < len; k += d->chunk) {
        const int64_t n = len - k < d->chunk ? len - k : d->chunk;
        KILN_TRY(kiln_backend_download(d->dev, d->hwords, p->g + e0 + k, (size_t)n * 4));
        kiln_sumsq8_feed(s, (const float *)(const void *)d->hwords, e0 + k, n, p->n);
    }
    return KILN_OK;
}

/* A GPU rank: the norms of the optimizers' slots (the backend's per-tensor norms, which have the
 * CPU's bits), by parameter; a slot that is a whole parameter gives that parameter's norm. */
static kiln_status slot_norms(kiln_trainer *t, float *by_param) {
    float *part = kiln_malloc((size_t)(t->n_mat + t->n_vec + 1) * sizeof(float));
    if (!part) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory for the gradient norms");
    kiln_status st = t->n_mat ? kiln_adamw_grad_norm(t->opt_mat, NULL, part, NULL, NULL) : KILN_OK;
    for (int j = 0; st == KILN_OK && j < t->n_mat; j++) by_param[t->mat_index[j]] = part[j];
    if (st == KILN_OK && t->n_vec) st = kiln_adamw_grad_norm(t->opt_vec, NULL, part, NULL, NULL);
    for (int j = 0; st == KILN_OK && j < t->n_vec; j++) by_param[t->vec_index[j]] = part[j];
    kiln_free(part);
    return st;
}

kiln_status kiln_trainer_dp_norms(kiln_trainer *t, float *norms) {
    kiln_train_dp *d = t->dp;
    const int P = t->n_params;
    float *loc = kiln_calloc((size_t)P, sizeof(float)); /* this rank's finished norms, else 0 */
    if (!loc) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory for the gradient norms");
    kiln_status st = KILN_OK;
    if (d->dev) { /* the tensors whole in this range: the device's norms */
        st = slot_norms(t, loc);
        for (int i = 0; i < P; i++)
            if (!(d->first[i] >= d->lo && d->first[i + 1] <= d->hi && d->first[i + 1] > d->first[i])) loc[i] = 0.0f;
    }
    /* the tensors meeting [lo, hi): i0 .. i1 - 1 */
    int i0 = 0, i1 = 0;
    while (i0 < P && d->first[i0 + 1] <= d->lo) i0++;
    i1 = i0;
    while (i1 < P && d->first[i1] < d->hi) i1++;
    const int needs_in = d->lo < d->hi && d->first[i0] < d->lo; /* i0 began on an earlier rank */
    kiln_sumsq8_state out;
    kiln_sumsq8_begin(&out);
    int last_open = 0; /* the last tensor goes on past hi: its state is handed on */
    for (int i = i0 + needs_in; st == KILN_OK && i < i1; i++) {
        const int64_t a = d->first[i], b = d->hi < d->first[i + 1] ? d->hi : d->first[i + 1];
        if (d->dev && b == d->first[i + 1]) continue; /* whole here: slot_norms gave it */
        kiln_sumsq8_state s;
        kiln_sumsq8_begin(&s);
        st = feed_grad(t, &s, i, 0, b - a);
        if (b == d->first[i + 1]) {
            loc[i] = sqrtf(s.sum);
        } else {
            out = s;
            last_open = 1;
        }
    }
    kiln_sumsq8_state *ring = st == KILN_OK ? kiln_calloc((size_t)d->size, sizeof *ring) : NULL;
    if (st == KILN_OK && !ring) st = kiln_error(KILN_ERR_NOMEM, "trainer: out of memory for the gradient norms");
    for (int k = 0; st == KILN_OK && k + 1 < d->size; k++) {
        /* this rank's state for the next one is final from round rank on */
        kiln_sumsq8_state mine = out;
        if (!last_open) kiln_sumsq8_begin(&mine);
        st = kiln_comm_allgather(d->c, ring, &mine, sizeof mine);
        if (st != KILN_OK || k + 1 != d->rank || !needs_in) continue;
        /* tensor i0 from the previous rank's state on */
        kiln_sumsq8_state s = ring[k];
        const int64_t a = d->lo, b = d->hi < d->first[i0 + 1] ? d->hi : d->first[i0 + 1];
        st = feed_grad(t, &s, i0, a - d->first[i0], b - a);
        if (b == d->first[i0 + 1]) {
            loc[i0] = sqrtf(s.sum);
        } else { /* i0 covers the whole range and goes on */
            out = s;
            last_open = 1;
        }
    }
    kiln_free(ring);
    if (st == KILN_OK) {
        /* every rank's norms side by side; norm i from the rank of its last element */
        float *gath = kiln_calloc((size_t)P * (size_t)d->size, sizeof(float));
        if (!gath) st = kiln_error(KILN_ERR_NOMEM, "trainer: out of memory for the gradient norms");
        if (st == KILN_OK) st = kiln_comm_allgather(d->c, gath, loc, (size_t)P * sizeof(float));
        for (int i = 0; st == KILN_OK && i < P; i++) norms[i] = gath[(size_t)((d->first[i + 1] - 1) / d->S) * P + i];
        kiln_free(gath);
    }
    kiln_free(loc);
    return st;
}

/* ---- weights ------------------------------------------------------------------------------- */

static void release_all(kiln_trainer *t);

/* After the optimizer step (or a load): stage 2, this rank's range of the weights to every
 * rank, each element as 4 bytes (f32 as it is, bf16 widened: its bits in the high half, exact
 * both ways); stage 3, every unit stale, released (gathered again when read). */
kiln_status kiln_trainer_dp_after_update(kiln_trainer *t) {
    kiln_train_dp *d = t->dp;
    if (d->sharded) {
        release_all(t);
        return KILN_OK;
    }
    const flat_io f = {t, FLAT_WEIGHT, NULL, NULL, d->dev_stage};
    for (int64_t c0 = 0; c0 < d->S; c0 += d->chunk) KILN_TRY(gather_chunk(&f, c0, chunk_len(d, c0), 1));
    return KILN_OK;
}

/* ---- stage 3: the weights sharded too (ZeRO-3) ------------------------------------------------
 *
 * Every parameter keeps its place in the trainer's blocks (so views, stacked products and the
 * optimizer's slots are as they were); what a rank does not own is given back to the system
 * while it is not needed (madvise(MADV_DONTNEED) on the whole pages outside the rank's range:
 * anonymous memory, which reads as zero afterwards) and filled again before it is read:
 *   - a layer's matrices (unit l), gathered before the layer's forward and released after it,
 *     gathered again before its backward; once its backward is done their gradients are summed
 *     to the ranks that own them (kiln_comm_reduce_f32, rank order from +0: the bits of the
 *     reduce-scatter of stage 2) and released, reading as zero for the next step;
 *   - the rest (unit L: the embedding, the final norm, an untied head, the extras and every
 *     vector), gathered before a forward and kept until the end of the step's backward, whose
 *     gradients are then summed to their owners; its matrices are released, its vectors (a
 *     tiny part) stay in memory, current only while the unit is gathered.
 * A piece is moved as the rank that owns it broadcasts it (bf16 weights as their bits in 4-byte
 * words, as the other collectives move them), a staging buffer at a time. An optimizer step
 * changes each rank's range only: every unit is stale after it. */

/* Parameter i's elements inside this rank's range: [*a, *b) of its own (*a == *b: none). */
static void own_part(const kiln_trainer *t, int i, int64_t *a, int64_t *b) {
    kiln_param_part(&t->params[i], t->dp->lo, t->dp->hi, a, b);
}

/* The whole pages inside [p, p + n) given back to the system (kiln_pages_give_back: they read
 * as zero afterwards); zero: the bytes it did not give back zeroed too (the ends, or all of it
 * under an allocator hook, page 0, or when madvise failed), so that all of [p, p + n) reads as
 * zero. */
static void release_bytes(void *p, size_t n, int zero, size_t page) {
    if (!n) return;
    uintptr_t lo, hi;
    kiln_pages_give_back(p, n, page, &lo, &hi);
    if (!zero) return;
    const uintptr_t s = (uintptr_t)p, e = s + n;
    memset(p, 0, lo - s);
    memset((void *)hi, 0, e - hi);
}

/* Parameter i's bytes outside this rank's range released: its weights (grads 0) or its
 * gradients (grads 1, which then read as zero). A vector is never released: its gradient's
 * outside part is zeroed. */
static void release_param(kiln_trainer *t, int i, int grads) {
    const kiln_train_dp *d = t->dp;
    const train_param *p = &t->params[i];
    int64_t a, b;
    own_part(t, i, &a, &b);
    if (p->n_dims != 2) {
        if (grads) {
            memset(p->g, 0, (size_t)a * sizeof(float));
            memset(p->g + b, 0, (size_t)(p->n - b) * sizeof(float));
        }
        return;
    }
    const size_t es = grads ? 4 : (p->dtype == KILN_DTYPE_F32 ? 4 : 2);
    uint8_t *base = grads ? (uint8_t *)p->g : (uint8_t *)p->w;
    release_bytes(base, (size_t)a * es, grads, d->page);
    release_bytes(base + (size_t)b * es, (size_t)(p->n - b) * es, grads, d->page);
}

static void held(kiln_train_dp *d, int64_t dw, int64_t dg) {
    d->held_w = (uint64_t)((int64_t)d->held_w + dw);
    d->held_g = (uint64_t)((int64_t)d->held_g + dg);
    if (d->held_w > d->peak_w) d->peak_w = d->held_w;
    if (d->held_g > d->peak_g) d->peak_g = d->held_g;
}

/* The memory of unit u's weights outside this rank's range released (their quantized copies,
 * an exact format's, forgotten with them). */
static void release_unit_memory(kiln_trainer *t, int u) {
    const kiln_train_dp *d = t->dp;
    for (int i = 0; i < t->n_params; i++) {
        if (d->unit[i] != u || t->params[i].n_dims != 2) continue;
        release_param(t, i, 0);
        if (t->mx && t->be->i->forget) t->be->i->forget(t->be, t->params[i].w, t->params[i].view.nbytes);
    }
}

/* A gathered unit's weights released. */
static void unit_release(kiln_trainer *t, int u) {
    kiln_train_dp *d = t->dp;
    if (!d->gathered[u]) return;
    release_unit_memory(t, u);
    d->gathered[u] = 0;
    held(d, -(int64_t)d->out_w[u], 0);
}

/* The runs of unit u's parameters in flat order: parameters i0 .. i1 - 1 of the unit, back to
 * back in the flat vector. *i is where the search starts and ends up past the run. */
static int next_run(const kiln_trainer *t, int u, int *i, int64_t *fa, int64_t *fb) {
    const kiln_train_dp *d = t->dp;
    while (*i < t->n_params && d->unit[*i] != u) (*i)++;
    if (*i >= t->n_params) return 0;
    *fa = d->first[*i];
    while (*i < t->n_params && d->unit[*i] == u) (*i)++;
    *fb = d->first[*i];
    return 1;
}

/* The pieces of unit u: each run of its parameters (next_run) cut at the ranks' ranges and in
 * pieces of at most cap elements; move(t, r, a, b) for each, r the rank that owns [a, b). */
static kiln_status unit_pieces(kiln_trainer *t, int u, int64_t cap,
                               kiln_status (*move)(kiln_trainer *t, int r, int64_t a, int64_t b)) {
    const kiln_train_dp *d = t->dp;
    int i = 0;
    int64_t fa, fb;
    while (next_run(t, u, &i, &fa, &fb))
        for (int r = 0; r < d->size; r++) {
            const int64_t rlo = (int64_t)r * d->S, rhi = rlo + d->S < d->total ? rlo + d->S : d->total;
            const int64_t x = fa > rlo ? fa : rlo, y = fb < rhi ? fb : rhi;
            for (int64_t a = x; a < y; a += cap) KILN_TRY(move(t, r, a, a + cap < y ? a + cap : y));
        }
    return KILN_OK;
}

/* A piece of weights from its owner r to every rank. */
static kiln_status gather_piece(kiln_trainer *t, int r, int64_t a, int64_t b) {
    kiln_train_dp *d = t->dp;
    const flat_io f = {t, FLAT_WEIGHT, NULL, NULL, 0};
    if (r == d->rank) KILN_TRY(flat_move(&f, a, b, d->stage, 1));
    KILN_TRY(kiln_comm_broadcast(d->c, d->stage, (size_t)(b - a) * 4, r));
    return r != d->rank ? flat_move(&f, a, b, d->stage, 0) : KILN_OK;
}

/* A piece of gradients summed over the ranks into its owner r (rank order from +0). */
static kiln_status reduce_piece(kiln_trainer *t, int r, int64_t a, int64_t b) {
    kiln_train_dp *d = t->dp;
    const flat_io f = {t, FLAT_GRAD, NULL, NULL, 0};
    KILN_TRY(flat_move(&f, a, b, d->stage, 1));
    KILN_TRY(kiln_comm_reduce_f32(d->c, (float *)(void *)d->own, (const float *)(const void *)d->stage,
                                  (size_t)(b - a), r));
    return r == d->rank ? flat_move(&f, a, b, d->own, 0) : KILN_OK;
}

/* Unit u's weights whole on every rank: each piece broadcast by the rank that owns it. */
static kiln_status unit_gather(kiln_trainer *t, int u) {
    kiln_train_dp *d = t->dp;
    if (d->gathered[u]) return KILN_OK;
    KILN_TRY(unit_pieces(t, u, d->chunk * d->size, gather_piece)); /* the staging's words */
    d->gathered[u] = 1;
    held(d, (int64_t)d->out_w[u], 0);
    return KILN_OK;
}

/* Unit u's gradients summed over the ranks into the ranks that own them, then released: outside
 * this rank's range they read as zero. */
static kiln_status unit_reduce(kiln_trainer *t, int u) {
    kiln_train_dp *d = t->dp;
    KILN_TRY(unit_pieces(t, u, d->chunk, reduce_piece)); /* own: a chunk */
    for (int k = 0; k < t->n_params; k++)
        if (d->unit[k] == u) release_param(t, k, 1);
    return KILN_OK;
}

/* The layer events of the architectures' loops (models/arch.h): a failure is kept in d->err
 * (the step returns it) and the later events of the step do nothing. */
static void layer_event(void *ctx, int l, kiln_layer_event ev) {
    kiln_trainer *t = ctx;
    kiln_train_dp *d = t->dp;
    if (d->err != KILN_OK) return;
    kiln_status st = KILN_OK;
    switch (ev) {
    case KILN_LAYER_FORWARD_BEGIN:
        st = unit_gather(t, l);
        break;
    case KILN_LAYER_FORWARD_END:
        unit_release(t, l);
        break;
    case KILN_LAYER_BACKWARD_BEGIN:
        st = unit_gather(t, l);
        held(d, 0, (int64_t)d->out_g[l]);
        break;
    case KILN_LAYER_BACKWARD_END:
        st = unit_reduce(t, l);
        held(d, 0, -(int64_t)d->out_g[l]);
        unit_release(t, l);
        break;
    }
    if (st != KILN_OK) d->err = kiln_error_prefix(st, "ZeRO-3 layer %d", l);
}

int kiln_trainer_dp_sharded(const kiln_trainer *t) { return t->dp && t->dp->sharded; }

kiln_status kiln_trainer_dp_forward_begin(kiln_trainer *t) {
    kiln_train_dp *d = t->dp;
    if (!d || !d->sharded) return KILN_OK;
    d->err = KILN_OK;
    return unit_gather(t, d->n_units - 1);
}

kiln_status kiln_trainer_dp_layers_status(const kiln_trainer *t) {
    return t->dp && t->dp->sharded ? t->dp->err : KILN_OK;
}

void kiln_trainer_dp_grads_begin(kiln_trainer *t) {
    kiln_train_dp *d = t->dp;
    if (!d || !d->sharded || d->rest_grads) return;
    d->rest_grads = 1;
    held(d, 0, (int64_t)d->out_g[d->n_units - 1]);
}

kiln_status kiln_trainer_dp_backward_end(kiln_trainer *t) {
    kiln_train_dp *d = t->dp;
    if (!d || !d->sharded) return KILN_OK;
    KILN_TRY(d->err);
    const int u = d->n_units - 1;
    KILN_TRY(unit_reduce(t, u));
    if (d->rest_grads) held(d, 0, -(int64_t)d->out_g[u]);
    d->rest_grads = 0;
    unit_release(t, u);
    return KILN_OK;
}

void kiln_trainer_dp_zero_own_grads(kiln_trainer *t) {
    for (int i = 0; i < t->n_params; i++) {
        int64_t a, b;
        own_part(t, i, &a, &b);
        memset(t->params[i].g + a, 0, (size_t)(b - a) * sizeof(float));
        release_param(t, i, 1); /* nothing left from a step that failed half-way */
    }
}

void kiln_trainer_dp_scale_own_grads(kiln_trainer *t, float coef) {
    for (int i = 0; i < t->n_params; i++) {
        int64_t a, b;
        own_part(t, i, &a, &b);
        float *g = t->params[i].g;
        for (int64_t j = a; j < b; j++) g[j] = g[j] * coef;
    }
}

/* Every unit stale (after an optimizer step or a load changed the ranges): released. */
static void release_all(kiln_trainer *t) {
    kiln_train_dp *d = t->dp;
    for (int u = 0; u < d->n_units; u++) {
        if (d->gathered[u])
            unit_release(t, u);
        else
            release_unit_memory(t, u); /* what a whole load wrote there */
    }
}

void kiln_trainer_dp_weights_changed(kiln_trainer *t) {
    if (t->dp && t->dp->sharded) release_all(t);
}

/* A rank without a micro-batch in a step of ZeRO-3 ranks: the collectives of the others' step
 * (kiln_train_step_batch, kiln_train_custom_step) in the same order with nothing to compute,
 * its gradients zero: the agreement at the start (carrying st, this rank's failure before the
 * step, to every rank), the rest's gathering, each layer's forward gather, the agreement after
 * the loss, each layer's backward gather and reduce from the last, the rest's reduce. */
kiln_status kiln_train_dp_idle_step(kiln_trainer *t, kiln_status st) {
    kiln_status est = kiln_trainer_enter(t, "kiln_train_dp_idle_step");
    kiln_train_dp *d = t->dp;
    if (est != KILN_OK || !d) return st != KILN_OK ? st : est;
    if (!d->sharded) return st != KILN_OK ? st : kiln_train_dp_zero_grads(t);
    const int L = d->n_units - 1;
    kiln_trainer_dp_zero_own_grads(t);
    t->grad_coef = 1.0f;
    t->grads_finite = 0;
    t->grads_unusable = 0;
    st = kiln_trainer_dp_agree(t, st, "the step (before its forward)");
    if (st == KILN_OK) {
        st = kiln_trainer_dp_forward_begin(t);
        for (int l = 0; l < L && st == KILN_OK; l++) {
            layer_event(t, l, KILN_LAYER_FORWARD_BEGIN);
            layer_event(t, l, KILN_LAYER_FORWARD_END);
            st = d->err;
        }
    }
    st = kiln_trainer_dp_agree(t, st, "the step (after its loss)");
    if (st != KILN_OK) return st;
    kiln_trainer_dp_grads_begin(t);
    for (int l = L - 1; l >= 0 && d->err == KILN_OK; l--) {
        layer_event(t, l, KILN_LAYER_BACKWARD_BEGIN);
        layer_event(t, l, KILN_LAYER_BACKWARD_END);
    }
    return kiln_trainer_dp_backward_end(t);
}

kiln_status kiln_train_dp_gather_params(kiln_trainer *t) {
    KILN_TRY(kiln_trainer_enter(t, "kiln_train_dp_gather_params"));
    kiln_train_dp *d = t->dp;
    if (!d || !d->sharded) return KILN_OK;
    for (int u = 0; u < d->n_units; u++) KILN_TRY(unit_gather(t, u));
    return KILN_OK;
}

kiln_status kiln_train_dp_release_params(kiln_trainer *t) {
    KILN_TRY(kiln_trainer_enter(t, "kiln_train_dp_release_params"));
    kiln_train_dp *d = t->dp;
    if (!d || !d->sharded) return KILN_OK;
    for (int u = 0; u < d->n_units; u++) unit_release(t, u);
    return KILN_OK;
}

int kiln_trainer_dp_param_whole(const kiln_trainer *t, int i) {
    const kiln_train_dp *d = t->dp;
    return !d || !d->sharded || d->gathered[d->unit[i]];
}

kiln_status kiln_train_dp_describe(const kiln_trainer *t, char *buf, size_t cap) {
    KILN_TRY(kiln_trainer_enter(t, "kiln_train_dp_describe"));
    const kiln_train_dp *d = t->dp;
    if (!buf || !cap) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_dp_describe: no buffer");
    buf[0] = 0;
    if (!d) return KILN_OK;
    uint64_t ww = 0, wg = 0, own_w = 0, window = 0;
    for (int i = 0; i < t->n_params; i++) {
        const train_param *p = &t->params[i];
        const uint64_t es = p->dtype == KILN_DTYPE_F32 ? 4 : 2;
        ww += (uint64_t)p->n * es;
        wg += (uint64_t)p->n * 4;
        int64_t a, b;
        own_part(t, i, &a, &b);
        own_w += (uint64_t)(b - a) * es;
    }
    if (!d->sharded) {
        snprintf(buf, cap, "rank %d of %d (ZeRO-2): the whole weights (%llu bytes) and gradients (%llu bytes); "
                 "the optimizer state of elements [%lld, %lld) of %lld%s", d->rank, d->size, (unsigned long long)ww,
                 (unsigned long long)wg, (long long)d->lo, (long long)d->hi, (long long)d->total,
                 d->dev && !d->dev_stage ? "; its pieces staged through host memory" : "");
        return KILN_OK;
    }
    for (int u = 0; u + 1 < d->n_units; u++)
        if (d->out_w[u] > window) window = d->out_w[u];
    window += d->out_w[d->n_units - 1];
    snprintf(buf, cap, "rank %d of %d (ZeRO-3): weights held at most %llu of %llu bytes (its range %llu, a step's "
             "window up to %llu), gradients at most %llu of %llu bytes", d->rank, d->size,
             (unsigned long long)d->peak_w, (unsigned long long)ww, (unsigned long long)own_w,
             (unsigned long long)window, (unsigned long long)d->peak_g, (unsigned long long)wg);
    return KILN_OK;
}

void kiln_trainer_dp_held(const kiln_trainer *t, uint64_t *w, uint64_t *g, uint64_t *peak_w, uint64_t *peak_g) {
    const kiln_train_dp *d = t->dp;
    *w = d->held_w;
    *g = d->held_g;
    *peak_w = d->peak_w;
    *peak_g = d->peak_g;
}

/* Stage 3's tables, and every byte this rank does not own released (the trainer was made
 * whole). */
static kiln_status shard_weights(kiln_trainer *t) {
    kiln_train_dp *d = t->dp;
    const int L = t->cfg.n_layer;
    d->n_units = L + 1;
    d->unit = kiln_calloc((size_t)t->n_params + 1, sizeof(int));
    d->gathered = kiln_calloc((size_t)d->n_units, sizeof(int));
    d->out_w = kiln_calloc((size_t)d->n_units, sizeof(uint64_t));
    d->out_g = kiln_calloc((size_t)d->n_units, sizeof(uint64_t));
    if (!d->unit || !d->gathered || !d->out_w || !d->out_g)
        return kiln_error(KILN_ERR_NOMEM, "kiln_train_dp_attach: out of memory");
    /* pages go back to the system only from the C library's own (anonymous) memory: with an
     * allocator hook a release zeroes the gradients and keeps everything (page 0) */
    d->page = kiln_alloc_page_size();
    d->held_w = d->held_g = 0;
    for (int i = 0; i < t->n_params; i++) {
        const train_param *p = &t->params[i];
        const int u = p->n_dims == 2 && p->layer >= 0 && p->layer < L ? p->layer : L;
        d->unit[i] = u;
        int64_t a, b;
        own_part(t, i, &a, &b);
        const uint64_t es = p->dtype == KILN_DTYPE_F32 ? 4 : 2;
        const uint64_t in = (uint64_t)(b - a), out = (uint64_t)p->n - in;
        if (p->n_dims == 2) {
            d->out_w[u] += out * es;
            d->out_g[u] += out * 4;
            d->held_w += in * es;
            d->held_g += in * 4;
        } else {
            d->held_w += (uint64_t)p->n * 4;
            d->held_g += (uint64_t)p->n * 4;
        }
    }
    d->peak_w = d->held_w;
    d->peak_g = d->held_g;
    /* no transparent huge pages where a layer comes and goes (a collapsed huge page would hold
     * what was released again) */
    void *blocks[2] = {t->param_block, t->grad_block};
    size_t sizes[2] = {t->param_bytes, t->n_grad * sizeof(float)};
#ifdef MADV_NOHUGEPAGE
    for (int k = 0; k < 2; k++) {
        uintptr_t s, e;
        kiln_pages_inside(blocks[k], sizes[k], d->page, &s, &e);
        if (s < e) (void)madvise((void *)s, e - s, MADV_NOHUGEPAGE);
    }
#else
    (void)blocks;
    (void)sizes;
#endif
    d->sharded = 1;
    d->hook.fn = layer_event;
    d->hook.ctx = t;
    t->io.hook = &d->hook;
    release_all(t);
    for (int i = 0; i < t->n_params; i++) release_param(t, i, 1);
    return KILN_OK;
}

/* ---- optimizer state: shards <-> one process's optimizers ----------------------------------- */

/* The arrays of the state, as 4-byte words: 0 m, 1 v, 2 the master copy, 3 the compensation
 * (bf16, widened). Matrices have all that their storage has, vectors m and v (always f32). */
enum { STATE_KINDS = 4 };

static int kind_exists(const kiln_trainer *t, int kind) {
    if (kind < 2) return 1;
    if (kind == 2) return t->p.weight_storage == KILN_STORAGE_BF16_MASTER;
    return t->p.weight_storage == KILN_STORAGE_BF16_KAHAN;
}

/* n words of slot j's array `kind` of o, copied out (to_words) or in. */
static kiln_status slot_words(kiln_adamw *o, int j, int kind, int64_t off, int64_t n, uint32_t *words, int to_words) {
    if (kind < 3) {
        float *a = kiln_adamw_state_f32(o, j, kind);
        if (!a) return kiln_error(KILN_ERR_INTERNAL, "trainer: optimizer slot %d has no state array %d", j, kind);
        if (to_words)
            memcpy(words, a + off, (size_t)n * 4);
        else
            memcpy(a + off, words, (size_t)n * 4);
        return KILN_OK;
    }
    uint16_t *c = kiln_adamw_state_comp(o, j);
    if (!c) return kiln_error(KILN_ERR_INTERNAL, "trainer: optimizer slot %d has no compensation", j);
    for (int64_t k = 0; k < n; k++) {
        if (to_words)
            words[k] = (uint32_t)c[off + k] << 16;
        else
            c[off + k] = (uint16_t)(words[k] >> 16);
    }
    return KILN_OK;
}

/* A GPU rank's optimizer slot j of o, array `kind`, words [off, off + n) into host words: the
 * slot's arrays downloaded once (kiln_adamw_get_moments, _master, _compensation) and kept for
 * the chunks of the same save that follow, which read the same slot in order (write_shard
 * forgets them: the next save is of another step). */
static kiln_status dev_state_words(kiln_train_dp *d, kiln_adamw *o, int j, int64_t sn, int kind, int64_t off,
                                   int64_t n, uint32_t *words) {
    if (off < 0 || off + n > sn)
        return kiln_error(KILN_ERR_INTERNAL, "trainer: optimizer slot %d holds %lld elements, not [%lld, %lld)", j,
                          (long long)sn, (long long)off, (long long)(off + n));
    if (kind < 2) {
        if (d->cache_o != o || d->cache_j != j) {
            if (sn > d->cache_n) {
                kiln_free(d->cache_m);
                kiln_free(d->cache_v);
                d->cache_m = kiln_malloc((size_t)sn * sizeof(float));
                d->cache_v = kiln_malloc((size_t)sn * sizeof(float));
                d->cache_n = d->cache_m && d->cache_v ? sn : 0;
                if (!d->cache_n) {
                    d->cache_o = NULL;
                    return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory for a checkpoint's optimizer state");
                }
            }
            d->cache_o = NULL;
            KILN_TRY(kiln_adamw_get_moments(o, j, d->cache_m, d->cache_v));
            d->cache_o = o;
            d->cache_j = j;
        }
        memcpy(words, (kind == 0 ? d->cache_m : d->cache_v) + off, (size_t)n * 4);
        return KILN_OK;
    }
    if (d->cache_xo != o || d->cache_xj != j || d->cache_xkind != kind) { /* downloaded once a slot */
        d->cache_xo = NULL;
        d->cache_x = kind == 2 ? (const void *)kiln_adamw_master(o, j) : (const void *)kiln_adamw_compensation(o, j);
        if (!d->cache_x)
            return kiln_error_prefix(KILN_ERR_IO, "trainer: optimizer slot %d's %s", j,
                                     kind == 2 ? "master copy" : "compensation");
        d->cache_xo = o;
        d->cache_xj = j;
        d->cache_xkind = kind;
    }
    if (kind == 2) {
        memcpy(words, (const float *)d->cache_x + off, (size_t)n * 4);
        return KILN_OK;
    }
    const uint16_t *c = d->cache_x;
    for (int64_t k = 0; k < n; k++) words[k] = (uint32_t)c[off + k] << 16;
    return KILN_OK;
}

/* Upload the slot dev_state_write has been filling, if any. */
static kiln_status dev_state_flush(kiln_train_dp *d) {
    kiln_status st = KILN_OK;
    if (d->moments_dirty) {
        st = kiln_adamw_set_moments((kiln_adamw *)d->cache_o, d->cache_j, d->cache_m, d->cache_v);
        d->moments_dirty = 0;
        if (st != KILN_OK) d->cache_o = NULL;
    }
    if (st == KILN_OK && d->wx_dirty) {
        kiln_adamw *o = (kiln_adamw *)d->wx_o;
        st = d->wx_kind == 2 ? kiln_adamw_set_master(o, d->wx_j, d->wx) : kiln_adamw_set_compensation(o, d->wx_j, d->wx);
        d->wx_dirty = 0;
    }
    return st;
}

/* The writing counterpart of dev_state_words (a GPU trainer loading a set): n state words of
 * kind into slot j (sn elements) from element off, in a host copy of the slot that is read
 * once (the parts no shard writes keep their values) and uploaded when the writes move on. */
static kiln_status dev_state_write(kiln_train_dp *d, kiln_adamw *o, int j, int64_t sn, int kind, int64_t off,
                                   int64_t n, const uint32_t *words) {
    if (off < 0 || off + n > sn)
        return kiln_error(KILN_ERR_INTERNAL, "trainer: optimizer slot %d holds %lld elements, not [%lld, %lld)", j,
                          (long long)sn, (long long)off, (long long)(off + n));
    if (kind < 2) {
        if (d->cache_o != o || d->cache_j != j) {
            KILN_TRY(dev_state_flush(d));
            uint32_t probe;
            KILN_TRY(dev_state_words(d, o, j, sn, kind, 0, 0, &probe)); /* the slot's moments into the cache */
        }
        memcpy((kind == 0 ? d->cache_m : d->cache_v) + off, words, (size_t)n * 4);
        d->moments_dirty = 1;
        return KILN_OK;
    }
    const size_t es = kind == 2 ? 4 : 2;
    if (d->wx_o != o || d->wx_j != j || d->wx_kind != kind) {
        KILN_TRY(dev_state_flush(d));
        if (sn > d->wx_n) {
            kiln_free(d->wx);
            d->wx = kiln_malloc((size_t)sn * 4);
            d->wx_n = d->wx ? sn : 0;
        }
        d->wx_o = NULL;
        if (!d->wx) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory for a checkpoint's optimizer state");
        const void *now = kind == 2 ? (const void *)kiln_adamw_master(o, j) : (const void *)kiln_adamw_compensation(o, j);
        if (!now)
            return kiln_error_prefix(KILN_ERR_IO, "trainer: optimizer slot %d's %s", j,
                                     kind == 2 ? "master copy" : "compensation");
        memcpy(d->wx, now, (size_t)sn * es);
        d->cache_xo = NULL; /* the mirror that dev_state_words reads is stale from here */
        d->wx_o = o;
        d->wx_j = j;
        d->wx_kind = kind;
    }
    if (kind == 2) {
        memcpy((float *)d->wx + off, words, (size_t)n * 4);
    } else {
        uint16_t *c = d->wx;
        for (int64_t k = 0; k < n; k++) c[off + k] = (uint16_t)(words[k] >> 16);
    }
    d->wx_dirty = 1;
    return KILN_OK;
}

/* wm / wv (one process's optimizers, the same on every rank) into this rank's shards. */
static kiln_status scatter_state(kiln_trainer *t, kiln_adamw *wm, kiln_adamw *wv) {
    kiln_train_dp *d = t->dp;
    for (int kind = 0; kind < STATE_KINDS; kind++) {
        if (!kind_exists(t, kind)) continue;
        const flat_io mine = {t, kind, NULL, NULL, 0}, whole = {t, kind, wm, wv, 0};
        for (int64_t a = d->lo; a < d->hi; a += d->chunk) {
            const int64_t b = a + d->chunk < d->hi ? a + d->chunk : d->hi;
            KILN_TRY(flat_move(&whole, a, b, d->own, 1));
            KILN_TRY(flat_move(&mine, a, b, d->own, 0));
        }
    }
    KILN_TRY(kiln_adamw_set_step(t->opt_mat, kiln_adamw_get_step(wm)));
    KILN_TRY(kiln_adamw_set_step(t->opt_vec, kiln_adamw_get_step(wv)));
    kiln_adamw_set_lr(t->opt_mat, kiln_adamw_get_lr(wm));
    kiln_adamw_set_lr(t->opt_vec, kiln_adamw_get_lr(wv));
    return KILN_OK;
}

/* Every rank's status made one: KILN_OK on every rank, or an error on every rank (this rank's
 * own, or one saying that another rank failed). The same collective as the CLI's agreements
 * (tools/cmd_train.c ranks_agree: an all-reduce of three doubles), so a rank that stopped before
 * it meets the others here. */
static kiln_status agree(kiln_train_dp *d, kiln_status st, const char *what) {
    double x[3] = {st != KILN_OK, 0.0, 0.0};
    kiln_status cst = kiln_comm_allreduce_f64(d->c, x, 3);
    if (st != KILN_OK) return st;
    if (cst != KILN_OK) return cst;
    if (x[0] != 0.0) return kiln_error(KILN_ERR_STATE, "%s failed on %g other rank(s) (their messages say why)", what, x[0]);
    return KILN_OK;
}

kiln_status kiln_trainer_dp_agree(kiln_trainer *t, kiln_status st, const char *what) {
    return t->dp ? agree(t->dp, st, what) : st;
}

kiln_status kiln_train_dp_agree(kiln_trainer *t, kiln_status st, const char *what) {
    kiln_status est = kiln_trainer_enter(t, "kiln_train_dp_agree");
    if (est != KILN_OK) return st != KILN_OK ? st : est;
    return kiln_trainer_dp_agree(t, st, what);
}

/* ---- checkpoints: a set of shards, one a rank (docs/DISTRIBUTED.md, "Checkpoints") ---------- */

/* The flat arrays a shard holds, each its rank's range as 4-byte words (flat_io's): the
 * weights, then the optimizer's state arrays that the storage has. */
static const char *const flat_section[] = {"flat/m", "flat/v", "flat/master", "flat/compensation"};

/* Elements [lo, hi) of f into the shard being written, a chunk (d->own) at a time. */
static kiln_status write_flat(kiln_ckpt_writer *w, const char *name, const flat_io *f) {
    kiln_train_dp *d = f->t->dp;
    uint32_t *words = d->dev ? d->hwords : d->own; /* host words (f->dev_words 0) */
    KILN_TRY(kiln_ckpt_section_begin(w, name, KILN_CKPT_RAW));
    for (int64_t a = d->lo; a < d->hi; a += d->chunk) {
        const int64_t b = a + d->chunk < d->hi ? a + d->chunk : d->hi;
        KILN_TRY(flat_move(f, a, b, words, 1));
        KILN_TRY(kiln_ckpt_section_write(w, words, (size_t)(b - a) * 4));
    }
    return kiln_ckpt_section_end(w);
}

/* This rank's shard, written and fsynced into the set's tmp directory; sha: its header hash. */
static kiln_status write_shard(kiln_trainer *t, const char *dir, uint64_t step, long tag, const char *run_json,
                               uint8_t sha[32]) {
    kiln_train_dp *d = t->dp;
    d->cache_o = d->cache_xo = NULL; /* a GPU rank's downloaded state is of an earlier step */
    char *cfg = kiln_trainer_config_json(t);
    if (!cfg) return kiln_error(KILN_ERR_NOMEM, "kiln_train_save: out of memory");
    kiln_ckpt_writer *w = NULL;
    kiln_status st = kiln_ckpt_begin_shard(dir, step, tag, d->rank, d->size, &w);
    if (st == KILN_OK) st = kiln_ckpt_add_json(w, "config", cfg);
    if (st == KILN_OK && run_json) st = kiln_ckpt_add_json(w, "run", run_json);
    if (st == KILN_OK) st = kiln_ckpt_add_u64(w, "step", step);
    if (st == KILN_OK) st = kiln_ckpt_add_u64(w, "seed", t->p.seed);
    if (st == KILN_OK) st = kiln_ckpt_add_u64(w, "shard/rank", (uint64_t)d->rank);
    if (st == KILN_OK) st = kiln_ckpt_add_u64(w, "shard/ranks", (uint64_t)d->size);
    if (st == KILN_OK) st = kiln_ckpt_add_u64(w, "shard/lo", (uint64_t)d->lo);
    if (st == KILN_OK) st = kiln_ckpt_add_u64(w, "shard/hi", (uint64_t)d->hi);
    if (st == KILN_OK) st = kiln_ckpt_add_u64(w, "shard/total", (uint64_t)d->total);
    if (st == KILN_OK) st = kiln_ckpt_add_u64(w, "optimizer/step", (uint64_t)kiln_adamw_get_step(t->opt_mat));
    if (st == KILN_OK) {
        const double lr[2] = {kiln_adamw_get_lr(t->opt_mat), kiln_adamw_get_lr(t->opt_vec)};
        st = kiln_ckpt_add_section(w, "optimizer/lr", KILN_CKPT_RAW, lr, sizeof lr);
    }
    const flat_io weights = {t, FLAT_WEIGHT, NULL, NULL, 0};
    if (st == KILN_OK) st = write_flat(w, "flat/weight", &weights);
    for (int kind = 0; st == KILN_OK && kind < STATE_KINDS; kind++) {
        const flat_io f = {t, kind, NULL, NULL, 0};
        if (kind_exists(t, kind)) st = write_flat(w, flat_section[kind], &f);
    }
    kiln_free(cfg);
    if (st != KILN_OK) {
        kiln_ckpt_abort(w);
        return kiln_error_prefix(st, "kiln_train_save: rank %d's shard", d->rank);
    }
    return kiln_ckpt_finish_shard(w, sha);
}

kiln_status kiln_trainer_dp_save(kiln_trainer *t, const char *dir, uint64_t step, const char *run_json,
                                 int keep_last) {
    kiln_train_dp *d = t->dp;
    /* the set's tmp directory is named by rank 0's process, so housekeeping knows its owner */
    int64_t tag = d->rank == 0 ? (int64_t)getpid() : 0;
    kiln_status st = kiln_comm_broadcast(d->c, &tag, sizeof tag, 0);
    if (st != KILN_OK) return st;
    if (d->rank == 0) st = kiln_ckpt_set_prepare(dir, step, (long)tag);
    st = agree(d, st, "kiln_train_save (rank 0 prepares the checkpoint's directory)");
    if (st != KILN_OK) return st;
    uint8_t sha[32] = {0};
    uint8_t *shas = kiln_calloc((size_t)d->size, 32);
    st = shas ? write_shard(t, dir, step, (long)tag, run_json, sha)
              : kiln_error(KILN_ERR_NOMEM, "kiln_train_save: out of memory");
    st = agree(d, st, "kiln_train_save (every rank writes its shard)");
    if (st == KILN_OK) st = kiln_comm_allgather(d->c, shas, sha, 32);
    if (st == KILN_OK && d->rank == 0) {
        char *warning = NULL;
        st = kiln_ckpt_set_commit(dir, step, (long)tag, d->size, shas, keep_last, &warning);
        kiln_free(warning);
    } else if (d->rank == 0) {
        kiln_ckpt_set_abort(dir, step, (long)tag);
    }
    kiln_free(shas);
    return agree(d, st, "kiln_train_save (rank 0 commits the set)");
}

/* The section `name` of every shard of the set c whose range [lo[k], hi[k]) meets [want_lo,
 * want_hi), checked (the checksum, when opened lazily; (hi - lo) x 4 bytes); NULL for the
 * others. */
static kiln_status find_flat(const kiln_ckpt *c, const char *name, const int64_t *lo, const int64_t *hi,
                             int64_t want_lo, int64_t want_hi, const kiln_ckpt_section **out) {
    for (int k = 0; k < kiln_ckpt_shard_count(c); k++) {
        const kiln_ckpt *sh = kiln_ckpt_shard(c, k);
        out[k] = NULL;
        if (hi[k] <= want_lo || want_hi <= lo[k]) continue; /* a shard this reader does not read */
        KILN_TRY(kiln_ckpt_find(sh, name, KILN_CKPT_RAW, &out[k]));
        if (out[k]->size != (uint64_t)(hi[k] - lo[k]) * 4)
            return kiln_error(KILN_ERR_FORMAT, "%s: section '%s' has %llu bytes, not the %lld elements of the shard's "
                              "range", kiln_ckpt_path(sh), name, (unsigned long long)out[k]->size,
                              (long long)(hi[k] - lo[k]));
    }
    return KILN_OK;
}

/* Elements [lo, hi) of the layout d's ranks (this rank's range) from the set's sections sec
 * (shard k holding [slo[k], shi[k])) into f: chunk by chunk, each chunk from the shards it meets. */
static kiln_status read_flat(const flat_io *f, int n, const int64_t *slo, const int64_t *shi,
                             const kiln_ckpt_section *const *sec) {
    const kiln_train_dp *d = f->t->dp;
    uint32_t *words = d->dev ? d->hwords : d->own; /* host words (f->dev_words 0) */
    for (int64_t a = d->lo; a < d->hi; a += d->chunk) {
        const int64_t b = a + d->chunk < d->hi ? a + d->chunk : d->hi;
        for (int k = 0; k < n; k++) {
            const int64_t x = a > slo[k] ? a : slo[k], y = b < shi[k] ? b : shi[k];
            if (x < y)
                memcpy(words + (x - a), (const uint8_t *)sec[k]->data + (size_t)(x - slo[k]) * 4, (size_t)(y - x) * 4);
        }
        KILN_TRY(flat_move(f, a, b, words, 0));
    }
    return d->dev ? dev_state_flush(f->t->dp) : KILN_OK;
}

/* A one-process layout for a trainer that is not a rank: the whole vector is "its range". */
static kiln_status layout_whole(kiln_trainer *t, kiln_train_dp **out) {
    kiln_train_dp *d = kiln_calloc(1, sizeof *d);
    if (!d) return kiln_error(KILN_ERR_NOMEM, "kiln_train_load: out of memory");
    d->size = 1;
    d->first = kiln_calloc((size_t)t->n_params + 1, sizeof *d->first);
    d->slot = kiln_calloc((size_t)t->n_params + 1, sizeof(int));
    if (d->first && d->slot) {
        for (int i = 0; i < t->n_params; i++) d->first[i + 1] = d->first[i] + t->params[i].n;
        d->total = d->S = d->hi = d->first[t->n_params];
        d->chunk = d->total < ((int64_t)1 << 22) ? d->total : ((int64_t)1 << 22);
        if (d->chunk < 1) d->chunk = 1;
        d->own = kiln_calloc((size_t)d->chunk, 4);
        if (!t->host || device_path_forced()) { /* a GPU trainer: through host words */
            d->dev = t->be;
            d->cache_j = -1;
            d->hwords = kiln_malloc((size_t)d->chunk * 4);
            d->h16 = kiln_malloc((size_t)d->chunk * 2);
        }
        for (int j = 0; j < t->n_mat; j++) d->slot[t->mat_index[j]] = j;
        for (int j = 0; j < t->n_vec; j++) d->slot[t->vec_index[j]] = j;
    }
    if (!d->first || !d->slot || !d->own || (d->dev && (!d->hwords || !d->h16))) {
        dp_free(d);
        return kiln_error(KILN_ERR_NOMEM, "kiln_train_load: out of memory");
    }
    *out = d;
    return KILN_OK;
}

kiln_status kiln_trainer_load_set(kiln_trainer *t, kiln_ckpt *c, uint64_t *step, char **run_json, char **notes) {
    const int n = kiln_ckpt_shard_count(c);
    const char *path = kiln_ckpt_path(c);
    kiln_train_dp *whole = NULL;
    char *cfg = kiln_trainer_config_json(t), *run = NULL;
    int64_t *lo = kiln_calloc((size_t)n, sizeof *lo), *hi = kiln_calloc((size_t)n, sizeof *hi);
    const kiln_ckpt_section **sec = kiln_calloc((size_t)n * (1 + STATE_KINDS), sizeof *sec);
    kiln_status st = cfg && lo && hi && sec ? KILN_OK : kiln_error(KILN_ERR_NOMEM, "kiln_train_load: out of memory");
    if (st == KILN_OK && !t->dp) st = layout_whole(t, &whole);
    kiln_train_dp *d = t->dp ? t->dp : whole;
    /* every check before anything changes: each shard's configuration, rank and range */
    uint64_t k0 = 0, opt_step = 0;
    for (int k = 0; st == KILN_OK && k < n; k++) {
        const kiln_ckpt *sh = kiln_ckpt_shard(c, k);
        const kiln_ckpt_section *s = NULL;
        uint64_t r, ranks, a, b, total, ks, os;
        st = kiln_ckpt_find(sh, "config", KILN_CKPT_JSON, &s);
        if (st == KILN_OK && (s->size != strlen(cfg) || memcmp(s->data, cfg, s->size) != 0))
            st = kiln_error(KILN_ERR_STATE, "%s was saved under another configuration (architecture, shapes, "
                            "parameters or storage variant differ): refused", kiln_ckpt_path(sh));
        if (st == KILN_OK) st = kiln_ckpt_get_u64(sh, "shard/rank", &r);
        if (st == KILN_OK) st = kiln_ckpt_get_u64(sh, "shard/ranks", &ranks);
        if (st == KILN_OK) st = kiln_ckpt_get_u64(sh, "shard/lo", &a);
        if (st == KILN_OK) st = kiln_ckpt_get_u64(sh, "shard/hi", &b);
        if (st == KILN_OK) st = kiln_ckpt_get_u64(sh, "shard/total", &total);
        if (st == KILN_OK) st = kiln_ckpt_get_u64(sh, "step", &ks);
        if (st == KILN_OK) st = kiln_ckpt_get_u64(sh, "optimizer/step", &os);
        if (st != KILN_OK) break;
        if (r != (uint64_t)k || ranks != (uint64_t)n || total != (uint64_t)d->total || a > b || b > total ||
            a != (k ? (uint64_t)hi[k - 1] : 0) || (k == n - 1 && b != total))
            st = kiln_error(KILN_ERR_FORMAT, "%s: shard %llu of %llu, elements [%llu, %llu) of %llu: not shard %d of "
                            "the %d that cover the %lld elements of this model in order", kiln_ckpt_path(sh),
                            (unsigned long long)r, (unsigned long long)ranks, (unsigned long long)a,
                            (unsigned long long)b, (unsigned long long)total, k, n, (long long)d->total);
        else if (ks != kiln_ckpt_step(sh) || (k && (ks != k0 || os != opt_step)))
            st = kiln_error(KILN_ERR_FORMAT, "%s: step %llu, optimizer step %llu: the set's shards disagree",
                            kiln_ckpt_path(sh), (unsigned long long)ks, (unsigned long long)os);
        lo[k] = (int64_t)a;
        hi[k] = (int64_t)b;
        k0 = ks;
        opt_step = os;
    }
    const kiln_ckpt_section *lr = NULL;
    if (st == KILN_OK) st = kiln_ckpt_find(c, "optimizer/lr", KILN_CKPT_RAW, &lr);
    if (st == KILN_OK && lr->size != 2 * sizeof(double))
        st = kiln_error(KILN_ERR_FORMAT, "%s: section 'optimizer/lr' has %llu bytes, not 16", path,
                        (unsigned long long)lr->size);
    if (st == KILN_OK && opt_step > ((uint64_t)1 << 24))
        st = kiln_error(KILN_ERR_FORMAT, "%s: optimizer step %llu out of range", path, (unsigned long long)opt_step);
    if (st == KILN_OK) st = find_flat(c, "flat/weight", lo, hi, d->lo, d->hi, sec);
    for (int kind = 0; st == KILN_OK && kind < STATE_KINDS; kind++)
        if (kind_exists(t, kind))
            st = find_flat(c, flat_section[kind], lo, hi, d->lo, d->hi, sec + (size_t)n * (1 + kind));
    const kiln_ckpt_section *rs = NULL;
    if (st == KILN_OK && run_json && kiln_ckpt_find(c, "run", KILN_CKPT_JSON, &rs) == KILN_OK) {
        run = kiln_strndup(rs->data, (size_t)rs->size);
        if (!run) st = kiln_error(KILN_ERR_NOMEM, "kiln_train_load: out of memory");
    }
    /* then this rank's range of every array (a process alone: all of it) */
    kiln_train_dp *keep = t->dp;
    t->dp = d;
    d->cache_o = d->cache_xo = d->wx_o = NULL; /* a GPU trainer's slots: read from the device again */
    const flat_io weights = {t, FLAT_WEIGHT, NULL, NULL, 0};
    if (st == KILN_OK) st = read_flat(&weights, n, lo, hi, sec);
    for (int kind = 0; st == KILN_OK && kind < STATE_KINDS; kind++) {
        const flat_io f = {t, kind, NULL, NULL, 0};
        if (kind_exists(t, kind)) st = read_flat(&f, n, lo, hi, sec + (size_t)n * (1 + kind));
    }
    t->dp = keep;
    if (st == KILN_OK) {
        double l[2];
        memcpy(l, lr->data, sizeof l);
        st = kiln_adamw_set_step(t->opt_mat, (int64_t)opt_step);
        if (st == KILN_OK) st = kiln_adamw_set_step(t->opt_vec, (int64_t)opt_step);
        kiln_adamw_set_lr(t->opt_mat, l[0]);
        kiln_adamw_set_lr(t->opt_vec, l[1]);
        t->shadow_stale = 1;
        t->mx_stale = 1;
    }
    if (st == KILN_OK) {
        *step = k0;
        if (run_json) {
            *run_json = run;
            run = NULL;
        }
        if (notes && kiln_ckpt_rejected(c)[0]) *notes = kiln_strdup(kiln_ckpt_rejected(c));
    } else {
        kiln_error_prefix(st, "kiln_train_load: %s", path);
    }
    dp_free(whole);
    kiln_free(cfg);
    kiln_free(run);
    kiln_free(lo);
    kiln_free(hi);
    kiln_free(sec);
    kiln_ckpt_close(c);
    return st;
}

kiln_status kiln_trainer_dp_load(kiln_trainer *t, const char *dir, int64_t at, uint64_t *step, char **run_json,
                                 char **notes) {
    kiln_train_dp *d = t->dp;
    kiln_ckpt *c = NULL;
    kiln_status st = KILN_OK;
    /* rank 0 opens it, verifying every byte (a resume sets a damaged newer checkpoint aside);
     * then the others open the step it chose, each section's checksum checked as they read it
     * (so a rank hashes the shards it reads, not the whole set) */
    if (d->rank == 0) st = at < 0 ? kiln_ckpt_open_for_resume(dir, &c) : kiln_ckpt_open_step(dir, (uint64_t)at, &c);
    st = agree(d, st, "kiln_train_load (rank 0 opening the checkpoint)");
    uint64_t chosen = c ? kiln_ckpt_step(c) : 0;
    if (st == KILN_OK) st = kiln_comm_broadcast(d->c, &chosen, sizeof chosen, 0);
    if (st == KILN_OK) { /* every rank here, or none (the agreement above) */
        if (d->rank != 0) st = kiln_ckpt_open_step_lazy(dir, chosen, &c);
        st = agree(d, st, "kiln_train_load (opening the checkpoint)");
    }
    if (st != KILN_OK) {
        kiln_ckpt_close(c);
        return st;
    }
    if (kiln_ckpt_shard_count(c) > 0) {
        /* a set: each rank reads its range from the shards it meets, then the weights are
         * all-gathered (nothing whole is ever made) */
        st = agree(d, kiln_trainer_load_set(t, c, step, run_json, notes), "kiln_train_load (reading the shards)");
        if (st == KILN_OK) st = agree(d, kiln_trainer_dp_after_update(t), "kiln_train_load (gathering the weights)");
    } else {
        /* one process's state.kiln: read whole (optimizers for the whole vector, made for the
         * load), each rank keeping its range */
        kiln_adamw *wm = NULL, *wv = NULL;
        st = kiln_trainer_make_optimizers(t, 0, d->total, &wm, &wv, 0);
        kiln_adamw *sm = t->opt_mat, *sv = t->opt_vec;
        if (st == KILN_OK) {
            t->opt_mat = wm;
            t->opt_vec = wv;
            st = kiln_trainer_load_opened(t, c, step, run_json, notes);
            t->opt_mat = sm;
            t->opt_vec = sv;
        } else {
            kiln_ckpt_close(c);
        }
        st = agree(d, st, "kiln_train_load");
        if (st == KILN_OK) st = scatter_state(t, wm, wv);
        if (st == KILN_OK && d->sharded) release_all(t); /* the whole file was read in */
        kiln_adamw_free(wm);
        kiln_adamw_free(wv);
    }
    if (st != KILN_OK && run_json && *run_json) {
        kiln_free(*run_json);
        *run_json = NULL;
    }
    return st;
}
