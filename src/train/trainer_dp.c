/*
 * trainer_dp.c -- a trainer as one rank of a data-parallel run (docs/DISTRIBUTED.md, "Data-
 * parallel training"): ZeRO stage 2 over the communicator of src/dist/comm.h.
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
#include "trainer.h"
#include "trainer_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
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
};

static void dp_free(kiln_train_dp *d) {
    if (!d) return;
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
} flat_io;

static kiln_status slot_words(kiln_adamw *o, int j, int kind, int64_t off, int64_t n, uint32_t *words, int to_words);

/* Elements [a, b) of the flat vector to words (to_words; past total: 0) or from them. */
static kiln_status flat_move(const flat_io *f, int64_t a, int64_t b, uint32_t *w, int to_words) {
    kiln_trainer *t = f->t;
    const kiln_train_dp *d = t->dp;
    int i = 0;
    while (i < t->n_params && d->first[i + 1] <= a) i++;
    for (; i < t->n_params && d->first[i] < b; i++) {
        train_param *p = &t->params[i];
        const int64_t s = a > d->first[i] ? a : d->first[i], e = b < d->first[i + 1] ? b : d->first[i + 1];
        const int64_t e0 = s - d->first[i], n = e - s;
        uint32_t *x = w + (s - a);
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
                continue;
            }
            if (f->wm) {
                KILN_TRY(slot_words(is_mat ? f->wm : f->wv, d->whole[i], f->what, e0, n, x, to_words));
            } else {
                const int64_t off = is_mat ? t->mat_off[d->slot[i]] : t->vec_off[d->slot[i]];
                KILN_TRY(slot_words(is_mat ? t->opt_mat : t->opt_vec, d->slot[i], f->what, e0 - off, n, x, to_words));
            }
        }
    }
    if (to_words && b > d->total) {
        const int64_t z = a > d->total ? a : d->total;
        memset(w + (z - a), 0, (size_t)(b - z) * 4);
    }
    return KILN_OK;
}

/* The chunks of the ranges: chunk k is [k C, min((k + 1) C, S)) of every range. */
static int64_t chunk_len(const kiln_train_dp *d, int64_t c0) { return d->S - c0 < d->chunk ? d->S - c0 : d->chunk; }

/* Every rank's elements [r S + c0, r S + c0 + len) of f to every rank (an all-gather of this
 * rank's part), written where they live when write (else left in stage). */
static kiln_status gather_chunk(const flat_io *f, int64_t c0, int64_t len, int write) {
    kiln_train_dp *d = f->t->dp;
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
int kiln_train_dp_rank(const kiln_trainer *t) { return t && t->dp ? t->dp->rank : 0; }

kiln_status kiln_train_dp_attach(kiln_trainer *t, kiln_comm *c) {
    KILN_TRY(kiln_trainer_enter(t, "kiln_train_dp_attach"));
    if (!c) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_dp_attach: the communicator is NULL");
    if (t->dp) return kiln_error(KILN_ERR_STATE, "kiln_train_dp_attach: the trainer is a rank already");
    if (kiln_comm_size(c) == 1) return KILN_OK; /* one process: the trainer as it is */
    if (!t->host || !kiln_comm_host_memory(c))
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "kiln_train_dp_attach: data-parallel ranks on a GPU need the NCCL communicator, which is "
                          "not written yet: %d %s ranks train on the CPU only", kiln_comm_size(c),
                          kiln_comm_name(c));
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
        d->stage = kiln_calloc((size_t)d->chunk * (size_t)d->size, 4);
        d->own = kiln_calloc((size_t)d->chunk, 4);
        d->slot = kiln_calloc((size_t)t->n_params + 1, sizeof(int));
        d->whole = kiln_calloc((size_t)t->n_params + 1, sizeof(int));
        if (!d->stage || !d->own || !d->slot || !d->whole)
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
    return KILN_OK;
}

/* ---- gradients ----------------------------------------------------------------------------- */

kiln_status kiln_train_dp_zero_grads(kiln_trainer *t) {
    KILN_TRY(kiln_trainer_enter(t, "kiln_train_dp_zero_grads"));
    for (int i = 0; i < t->n_params; i++) memset(t->params[i].g, 0, (size_t)t->params[i].n * sizeof(float));
    t->grad_coef = 1.0f;
    t->grads_finite = 0;
    t->grads_unusable = 0;
    return KILN_OK;
}

kiln_status kiln_train_dp_reduce_grads(kiln_trainer *t) {
    KILN_TRY(kiln_trainer_enter(t, "kiln_train_dp_reduce_grads"));
    kiln_train_dp *d = t->dp;
    if (!d) return KILN_OK;
    if (t->grads_unusable || t->grad_coef != 1.0f)
        return kiln_error(KILN_ERR_STATE, "kiln_train_dp_reduce_grads: the gradients are %s", t->grads_unusable ?
                          "unusable (a step failed after its gradient work began)" : "clipped already");
    /* chunk by chunk: every rank's part of the chunk packed in rank order, reduce-scattered,
     * this rank's part of the sum written over its gradients (positions no later chunk reads) */
    const flat_io f = {t, FLAT_GRAD, NULL, NULL};
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
kiln_status kiln_trainer_dp_norms(kiln_trainer *t, float *norms) {
    kiln_train_dp *d = t->dp;
    const int P = t->n_params;
    float *loc = kiln_calloc((size_t)P, sizeof(float)); /* this rank's finished norms, else 0 */
    if (!loc) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory for the gradient norms");
    /* the tensors meeting [lo, hi): i0 .. i1 - 1 */
    int i0 = 0, i1 = 0;
    while (i0 < P && d->first[i0 + 1] <= d->lo) i0++;
    i1 = i0;
    while (i1 < P && d->first[i1] < d->hi) i1++;
    const int needs_in = d->lo < d->hi && d->first[i0] < d->lo; /* i0 began on an earlier rank */
    kiln_sumsq8_state out;
    kiln_sumsq8_begin(&out);
    int last_open = 0; /* the last tensor goes on past hi: its state is handed on */
    for (int i = i0 + needs_in; i < i1; i++) {
        const int64_t a = d->first[i], b = d->hi < d->first[i + 1] ? d->hi : d->first[i + 1];
        kiln_sumsq8_state s;
        kiln_sumsq8_begin(&s);
        kiln_sumsq8_feed(&s, t->params[i].g, 0, b - a, t->params[i].n);
        if (b == d->first[i + 1]) {
            loc[i] = sqrtf(s.sum);
        } else {
            out = s;
            last_open = 1;
        }
    }
    kiln_status st = KILN_OK;
    kiln_sumsq8_state *ring = kiln_calloc((size_t)d->size, sizeof *ring);
    if (!ring) st = kiln_error(KILN_ERR_NOMEM, "trainer: out of memory for the gradient norms");
    for (int k = 0; st == KILN_OK && k + 1 < d->size; k++) {
        /* this rank's state for the next one is final from round rank on */
        kiln_sumsq8_state mine = out;
        if (!last_open) kiln_sumsq8_begin(&mine);
        st = kiln_comm_allgather(d->c, ring, &mine, sizeof mine);
        if (st != KILN_OK || k + 1 != d->rank || !needs_in) continue;
        /* tensor i0 from the previous rank's state on */
        kiln_sumsq8_state s = ring[k];
        const int64_t a = d->lo, b = d->hi < d->first[i0 + 1] ? d->hi : d->first[i0 + 1];
        kiln_sumsq8_feed(&s, t->params[i0].g + (a - d->first[i0]), a - d->first[i0], b - a, t->params[i0].n);
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

/* After the optimizer step: this rank's range of the weights to every rank. Each element
 * travels as 4 bytes: f32 as it is, bf16 widened (its bits in the high half, exact both ways). */
kiln_status kiln_trainer_dp_gather_params(kiln_trainer *t) {
    kiln_train_dp *d = t->dp;
    const flat_io f = {t, FLAT_WEIGHT, NULL, NULL};
    for (int64_t c0 = 0; c0 < d->S; c0 += d->chunk) KILN_TRY(gather_chunk(&f, c0, chunk_len(d, c0), 1));
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

/* wm / wv (one process's optimizers, the same on every rank) into this rank's shards. */
static kiln_status scatter_state(kiln_trainer *t, kiln_adamw *wm, kiln_adamw *wv) {
    kiln_train_dp *d = t->dp;
    for (int kind = 0; kind < STATE_KINDS; kind++) {
        if (!kind_exists(t, kind)) continue;
        const flat_io mine = {t, kind, NULL, NULL}, whole = {t, kind, wm, wv};
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

/* ---- checkpoints: a set of shards, one a rank (docs/DISTRIBUTED.md, "Checkpoints") ---------- */

/* The flat arrays a shard holds, each its rank's range as 4-byte words (flat_io's): the
 * weights, then the optimizer's state arrays that the storage has. */
static const char *const flat_section[] = {"flat/m", "flat/v", "flat/master", "flat/compensation"};

/* Elements [lo, hi) of f into the shard being written, a chunk (d->own) at a time. */
static kiln_status write_flat(kiln_ckpt_writer *w, const char *name, const flat_io *f) {
    kiln_train_dp *d = f->t->dp;
    KILN_TRY(kiln_ckpt_section_begin(w, name, KILN_CKPT_RAW));
    for (int64_t a = d->lo; a < d->hi; a += d->chunk) {
        const int64_t b = a + d->chunk < d->hi ? a + d->chunk : d->hi;
        KILN_TRY(flat_move(f, a, b, d->own, 1));
        KILN_TRY(kiln_ckpt_section_write(w, d->own, (size_t)(b - a) * 4));
    }
    return kiln_ckpt_section_end(w);
}

/* This rank's shard, written and fsynced into the set's tmp directory; sha: its header hash. */
static kiln_status write_shard(kiln_trainer *t, const char *dir, uint64_t step, long tag, const char *run_json,
                               uint8_t sha[32]) {
    kiln_train_dp *d = t->dp;
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
    const flat_io weights = {t, FLAT_WEIGHT, NULL, NULL};
    if (st == KILN_OK) st = write_flat(w, "flat/weight", &weights);
    for (int kind = 0; st == KILN_OK && kind < STATE_KINDS; kind++) {
        const flat_io f = {t, kind, NULL, NULL};
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
    for (int64_t a = d->lo; a < d->hi; a += d->chunk) {
        const int64_t b = a + d->chunk < d->hi ? a + d->chunk : d->hi;
        for (int k = 0; k < n; k++) {
            const int64_t x = a > slo[k] ? a : slo[k], y = b < shi[k] ? b : shi[k];
            if (x < y)
                memcpy(d->own + (x - a), (const uint8_t *)sec[k]->data + (size_t)(x - slo[k]) * 4, (size_t)(y - x) * 4);
        }
        KILN_TRY(flat_move(f, a, b, d->own, 0));
    }
    return KILN_OK;
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
        for (int j = 0; j < t->n_mat; j++) d->slot[t->mat_index[j]] = j;
        for (int j = 0; j < t->n_vec; j++) d->slot[t->vec_index[j]] = j;
    }
    if (!d->first || !d->slot || !d->own) {
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
    if (st == KILN_OK && !t->host)
        st = kiln_error(KILN_ERR_UNSUPPORTED, "a set of %d shards loads into a CPU trainer only (a GPU trainer reads "
                        "one state.kiln): resume it on the CPU", n);
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
    const flat_io weights = {t, FLAT_WEIGHT, NULL, NULL};
    if (st == KILN_OK) st = read_flat(&weights, n, lo, hi, sec);
    for (int kind = 0; st == KILN_OK && kind < STATE_KINDS; kind++) {
        const flat_io f = {t, kind, NULL, NULL};
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
        if (st == KILN_OK) st = agree(d, kiln_trainer_dp_gather_params(t), "kiln_train_load (gathering the weights)");
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
        kiln_adamw_free(wm);
        kiln_adamw_free(wv);
    }
    if (st != KILN_OK && run_json && *run_json) {
        kiln_free(*run_json);
        *run_json = NULL;
    }
    return st;
}
