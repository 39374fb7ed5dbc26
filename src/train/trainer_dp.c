/*
 * trainer_dp.c -- a trainer as one rank of a data-parallel run (docs/DISTRIBUTED.md, "Data-
 * parallel training"): ZeRO stage 2 over the communicator of src/dist/comm.h.
 *
 * The flat vector: the trainable parameters in the trainer's order (transformers'
 * named_parameters()), each one's elements in order, back to back: `total` elements. With N
 * ranks and S = ceil(total / N), rank r owns the elements [r S, min((r + 1) S, total)) -- a
 * range may start or end inside a tensor, and the last ranges may be short or empty. The
 * tensors stay where the trainer put them; the flat vector exists only as the staging buffer
 * of the collectives (`flat`, N S floats, where the element at flat position k is k).
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
 * Checkpoints hold the whole state (rank 0 gathers the optimizer's shards into one process's
 * optimizers and writes the one-process file), so any rank count resumes them.
 */
#include "trainer.h"
#include "trainer_impl.h"

#include <math.h>
#include <string.h>

struct kiln_train_dp {
    kiln_comm *c;      /* the caller's; outlives the trainer */
    int rank, size;
    int64_t total;     /* elements of the flat vector */
    int64_t S;         /* elements per rank's range: ceil(total / size) */
    int64_t lo, hi;    /* this rank's range [lo, hi) (lo == hi: empty) */
    int64_t *first;    /* (n_params + 1) each parameter's first flat element; first[n] = total */
    float *flat;       /* (size * S) the collectives' staging: the flat vector */
    float *recv;       /* (S) the reduce-scatter's result: this rank's summed gradients */
};

static void dp_free(kiln_train_dp *d) {
    if (!d) return;
    kiln_free(d->first);
    kiln_free(d->flat);
    kiln_free(d->recv);
    kiln_free(d);
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
    *staging = (d->S * d->size + (d->S ? d->S : 1)) * (int64_t)sizeof(float);
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
        d->flat = kiln_calloc((size_t)d->S * (size_t)d->size, sizeof(float));
        d->recv = kiln_calloc((size_t)(d->S ? d->S : 1), sizeof(float));
        if (!d->flat || !d->recv) st = kiln_error(KILN_ERR_NOMEM, "kiln_train_dp_attach: out of memory for the "
                                                  "flat staging (%lld floats)", (long long)(d->S * d->size));
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
    for (int i = 0; i < t->n_params; i++)
        memcpy(d->flat + d->first[i], t->params[i].g, (size_t)t->params[i].n * sizeof(float));
    memset(d->flat + d->total, 0, (size_t)(d->S * d->size - d->total) * sizeof(float));
    KILN_TRY(kiln_comm_reduce_scatter_f32(d->c, d->recv, d->flat, (size_t)d->S));
    /* this rank's range of the gradient buffers: the sum over ranks */
    for (int i = 0; i < t->n_params; i++) {
        const int64_t a = d->lo > d->first[i] ? d->lo : d->first[i];
        const int64_t b = d->hi < d->first[i + 1] ? d->hi : d->first[i + 1];
        if (a < b) memcpy(t->params[i].g + (a - d->first[i]), d->recv + (a - d->lo), (size_t)(b - a) * sizeof(float));
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
    for (int i = 0; i < t->n_params; i++) {
        const int64_t a = d->lo > d->first[i] ? d->lo : d->first[i];
        const int64_t b = d->hi < d->first[i + 1] ? d->hi : d->first[i + 1];
        if (a >= b) continue;
        const train_param *p = &t->params[i];
        const int64_t e0 = a - d->first[i];
        if (p->dtype == KILN_DTYPE_F32) {
            memcpy(d->flat + a, (const float *)p->w + e0, (size_t)(b - a) * sizeof(float));
        } else {
            const uint16_t *w = (const uint16_t *)p->w + e0;
            uint32_t *f = (uint32_t *)(void *)(d->flat + a);
            for (int64_t k = 0; k < b - a; k++) f[k] = (uint32_t)w[k] << 16;
        }
    }
    KILN_TRY(kiln_comm_allgather(d->c, d->flat, d->flat + d->lo, (size_t)d->S * sizeof(float)));
    for (int i = 0; i < t->n_params; i++) {
        train_param *p = &t->params[i];
        if (p->dtype == KILN_DTYPE_F32) {
            memcpy(p->w, d->flat + d->first[i], (size_t)p->n * sizeof(float));
        } else {
            uint16_t *w = p->w;
            const uint32_t *f = (const uint32_t *)(const void *)(d->flat + d->first[i]);
            for (int64_t k = 0; k < p->n; k++) w[k] = (uint16_t)(f[k] >> 16);
        }
    }
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

/* Slot of parameter i in one process's optimizers (its kind's parameters counted in order). */
static void whole_slot(const kiln_trainer *t, int i, int *is_mat, int *slot) {
    int k = 0;
    for (int j = 0; j < i; j++) k += (t->params[j].n_dims == 2) == (t->params[i].n_dims == 2);
    *is_mat = t->params[i].n_dims == 2;
    *slot = k;
}

/* The shards into wm / wv (one process's optimizers; on root only, or every rank with root -1),
 * through the flat staging: each kind packed by every rank into its block and all-gathered. */
static kiln_status gather_state(kiln_trainer *t, kiln_adamw *wm, kiln_adamw *wv, int root) {
    kiln_train_dp *d = t->dp;
    uint32_t *flat = (uint32_t *)(void *)d->flat;
    for (int kind = 0; kind < STATE_KINDS; kind++) {
        if (!kind_exists(t, kind)) continue;
        memset(flat + d->lo, 0, (size_t)d->S * 4);
        for (int j = 0; j < t->n_mat + t->n_vec; j++) {
            const int is_mat = j < t->n_mat, s = is_mat ? j : j - t->n_mat;
            if (!is_mat && kind >= 2) continue;
            const int i = is_mat ? t->mat_index[s] : t->vec_index[s];
            const int64_t off = is_mat ? t->mat_off[s] : t->vec_off[s];
            const int64_t a = d->first[i] + off;
            const int64_t b = d->hi < d->first[i + 1] ? d->hi : d->first[i + 1];
            KILN_TRY(slot_words(is_mat ? t->opt_mat : t->opt_vec, s, kind, 0, b - a, flat + a, 1));
        }
        KILN_TRY(kiln_comm_allgather(d->c, flat, flat + d->lo, (size_t)d->S * 4));
        if (root >= 0 && d->rank != root) continue;
        for (int i = 0; i < t->n_params; i++) {
            int is_mat, s;
            whole_slot(t, i, &is_mat, &s);
            if (!is_mat && kind >= 2) continue;
            KILN_TRY(slot_words(is_mat ? wm : wv, s, kind, 0, t->params[i].n, flat + d->first[i], 0));
        }
    }
    return KILN_OK;
}

/* wm / wv (one process's optimizers, the same on every rank) into this rank's shards. */
static kiln_status scatter_state(kiln_trainer *t, kiln_adamw *wm, kiln_adamw *wv) {
    kiln_train_dp *d = t->dp;
    for (int kind = 0; kind < STATE_KINDS; kind++) {
        if (!kind_exists(t, kind)) continue;
        for (int j = 0; j < t->n_mat + t->n_vec; j++) {
            const int is_mat = j < t->n_mat, s = is_mat ? j : j - t->n_mat;
            if (!is_mat && kind >= 2) continue;
            const int i = is_mat ? t->mat_index[s] : t->vec_index[s];
            const int64_t off = is_mat ? t->mat_off[s] : t->vec_off[s];
            const int64_t b = d->hi < d->first[i + 1] ? d->hi : d->first[i + 1];
            const int64_t n = b - (d->first[i] + off);
            int wmat, ws;
            whole_slot(t, i, &wmat, &ws);
            uint32_t *stage = (uint32_t *)(void *)d->recv; /* S words: a piece is at most S */
            KILN_TRY(slot_words(wmat ? wm : wv, ws, kind, off, n, stage, 1));
            KILN_TRY(slot_words(is_mat ? t->opt_mat : t->opt_vec, s, kind, 0, n, stage, 0));
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
 * (tools/cmd_train.c ranks_agree: an all-reduce of two doubles), so a rank that stopped before
 * it meets the others here. */
static kiln_status agree(kiln_train_dp *d, kiln_status st, const char *what) {
    double x[2] = {st != KILN_OK, 0.0};
    kiln_status cst = kiln_comm_allreduce_f64(d->c, x, 2);
    if (st != KILN_OK) return st;
    if (cst != KILN_OK) return cst;
    if (x[0] != 0.0) return kiln_error(KILN_ERR_STATE, "%s failed on %g other rank(s) (their messages say why)", what, x[0]);
    return KILN_OK;
}

kiln_status kiln_trainer_dp_save(kiln_trainer *t, const char *dir, uint64_t step, const char *run_json,
                                 int keep_last) {
    kiln_train_dp *d = t->dp;
    kiln_adamw *wm = NULL, *wv = NULL;
    kiln_status st = KILN_OK;
    if (d->rank == 0) st = kiln_trainer_make_optimizers(t, 0, d->total, &wm, &wv, 0);
    /* every rank takes part in the gathers, whatever rank 0's allocation said */
    st = agree(d, st, "kiln_train_save: making the whole optimizer state");
    if (st == KILN_OK) st = gather_state(t, wm, wv, 0);
    if (st == KILN_OK && d->rank == 0) {
        kiln_adamw_set_step(wm, kiln_adamw_get_step(t->opt_mat));
        kiln_adamw_set_step(wv, kiln_adamw_get_step(t->opt_vec));
        kiln_adamw_set_lr(wm, kiln_adamw_get_lr(t->opt_mat));
        kiln_adamw_set_lr(wv, kiln_adamw_get_lr(t->opt_vec));
        kiln_adamw *sm = t->opt_mat, *sv = t->opt_vec;
        t->opt_mat = wm;
        t->opt_vec = wv;
        st = kiln_trainer_save_local(t, dir, step, run_json, keep_last);
        t->opt_mat = sm;
        t->opt_vec = sv;
    }
    kiln_adamw_free(wm);
    kiln_adamw_free(wv);
    return agree(d, st, "kiln_train_save (rank 0 writes the checkpoint)");
}

kiln_status kiln_trainer_dp_load(kiln_trainer *t, const char *dir, int64_t at, uint64_t *step, char **run_json,
                                 char **notes) {
    kiln_train_dp *d = t->dp;
    kiln_adamw *wm = NULL, *wv = NULL;
    kiln_status st = kiln_trainer_make_optimizers(t, 0, d->total, &wm, &wv, 0);
    kiln_adamw *sm = t->opt_mat, *sv = t->opt_vec;
    /* rank 0 first: a resume sets a damaged newer checkpoint aside, which the others then do
     * not see; then the others read the same checkpoint */
    for (int pass = 0; pass < 2; pass++) {
        if ((pass == 0) == (d->rank == 0) && st == KILN_OK) {
            t->opt_mat = wm;
            t->opt_vec = wv;
            st = kiln_trainer_load_local(t, dir, at, step, run_json, notes);
            t->opt_mat = sm;
            t->opt_vec = sv;
        }
        st = agree(d, st, "kiln_train_load");
    }
    if (st == KILN_OK) st = scatter_state(t, wm, wv);
    kiln_adamw_free(wm);
    kiln_adamw_free(wv);
    if (st != KILN_OK && run_json && *run_json) {
        kiln_free(*run_json);
        *run_json = NULL;
    }
    return st;
}
