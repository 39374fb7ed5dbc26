/*
 * forward_state.c -- the scratch, KV cache and rope tables a forward runs in, on a backend,
 * for any architecture (the weight vectors it uploads are those its roles table binds).
 */
#include "model.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

/* A device backend: copy the model's layer table and put every f32 vector its roles bind
 * (norms, biases, q/k norms; kiln_arch's vector roles) into one backend block. */
typedef struct vec_upload {
    kiln_forward_state *fs;
    const kiln_model *m;
    kiln_backend *be;
    size_t off; /* floats into wblock */
    int pass;   /* 0: size the block, 1: upload */
} vec_upload;

static kiln_status upload_vector_role(void *ctx, const kiln_param_role *r, int layer) {
    vec_upload *u = ctx;
    if (!kiln_role_is_vector(r) || !r->per_layer) return KILN_OK; /* per-model: the final norm, below */
    const float **slot = &kiln_wref_of(u->m->arch, NULL, u->fs->layer_refs_owned, r, layer)->vec;
    if (!*slot) return KILN_OK;
    size_t len = (size_t)kiln_role_floats(r, &u->m->cfg), rounded = (len + 15) & ~(size_t)15;
    if (u->pass == 1) {
        float *dst = (float *)u->fs->wblock + u->off;
        KILN_TRY(kiln_backend_upload(u->be, dst, *slot, len * sizeof(float)));
        *slot = dst;
    }
    u->off += rounded;
    return KILN_OK;
}

/* The per-layer vectors go after the final norm, which every architecture has (the only
 * per-model vector role). */
static kiln_status upload_weight_vectors(kiln_forward_state *fs, const kiln_model *m, kiln_backend *be) {
    size_t n = (size_t)m->cfg.n_layer * (size_t)m->arch->n_layer_roles, C = (size_t)m->cfg.n_embd;
    fs->layer_refs_owned = kiln_calloc(n ? n : 1, sizeof *fs->layer_refs_owned);
    if (!fs->layer_refs_owned) return kiln_error(KILN_ERR_NOMEM, "forward state: out of memory for the layer table");
    memcpy(fs->layer_refs_owned, m->layer_refs, n * sizeof *fs->layer_refs_owned);
    const size_t head = (C + 15) & ~(size_t)15;
    vec_upload u = {fs, m, be, head, 0};
    KILN_TRY(kiln_arch_walk(m->arch, m->cfg.n_layer, upload_vector_role, &u));
    fs->wblock = kiln_backend_alloc(be, u.off * sizeof(float));
    if (!fs->wblock)
        return kiln_error(KILN_ERR_NOMEM, "forward state: cannot allocate %zu bytes of backend memory for norms and biases",
                          u.off * sizeof(float));
    KILN_TRY(kiln_backend_upload(be, fs->wblock, m->final_norm, C * sizeof(float)));
    fs->final_norm = (const float *)fs->wblock;
    u.off = head;
    u.pass = 1;
    KILN_TRY(kiln_arch_walk(m->arch, m->cfg.n_layer, upload_vector_role, &u));
    fs->layer_refs = fs->layer_refs_owned;
    return KILN_OK;
}

kiln_status kiln_forward_state_init(kiln_forward_state *fs, const kiln_model *m, kiln_backend *be,
                                    int n_ctx, int n_batch, int n_seq, int pool_blocks) {
    const kiln_model_config *c = &m->cfg;
    memset(fs, 0, sizeof *fs);
    fs->be = be;
    if (!be->i->kv_store_rows || !be->i->attention_paged || !be->i->get_rows || !be->i->scale)
        return kiln_error(KILN_ERR_UNSUPPORTED, "forward state: the %s backend lacks the batch ops "
                          "(kv_store_rows, attention_paged, get_rows, scale)", be->i->name);
    if (m->arch->uses_geglu && !be->i->geglu)
        return kiln_error(KILN_ERR_UNSUPPORTED, "forward state: %s needs GeGLU, which the %s backend lacks",
                          m->arch->name, be->i->name);
    if (m->arch->state_floats && (!be->i->conv1d_silu || !be->i->gated_delta || !be->i->gdn_gates ||
                                  !be->i->sigmoid_mul || !be->i->split_halves || !be->i->rope_partial))
        return kiln_error(KILN_ERR_UNSUPPORTED, "forward state: %s needs the linear-attention ops, which the %s backend lacks",
                          m->arch->name, be->i->name);
    if (n_ctx < 1 || n_batch < 1 || n_seq < 1 || pool_blocks < 0)
        return kiln_error(KILN_ERR_INVALID_ARG, "forward state: n_ctx %d, n_batch %d, n_seq %d must be >= 1 "
                          "(and the pool's blocks %d >= 0)", n_ctx, n_batch, n_seq, pool_blocks);
    /* the cpu backend's memory is host memory: keep the model's pointers, write logits to
     * the caller's array */
    fs->host_memory = be->i->host_memory;
    size_t C = (size_t)c->n_embd, HS = (size_t)c->head_dim, L = 0;
    for (int l = 0; l < c->n_layer; l++) L += !kiln_layer_linear(c, l);
    size_t QD = (size_t)c->n_head * HS, KD = (size_t)c->n_head_kv * HS, FF = (size_t)c->n_ff;
    size_t NB = (size_t)n_batch, T = (size_t)n_ctx, S = (size_t)n_seq;
    size_t max_blocks = (T + KILN_KV_BLOCK - 1) / KILN_KV_BLOCK;
    size_t n_blocks = pool_blocks ? (size_t)pool_blocks : S * max_blocks;
    if (n_blocks > INT32_MAX / KILN_KV_BLOCK || S * max_blocks > INT32_MAX)
        return kiln_error(KILN_ERR_RANGE, "context of %d sequences of %d tokens is too large", n_seq, n_ctx);
    size_t pool = 0; /* floats of one of k_cache, v_cache */
    if (kiln_mul_overflow(L * n_blocks * KILN_KV_BLOCK, KD, &pool))
        return kiln_error(KILN_ERR_RANGE, "context of %d sequences of %d tokens is too large", n_seq, n_ctx);
    /* sizes in floats, each rounded up to 16 floats (64 bytes); the batch's ints and the block
     * table are int32, as many as floats */
    float *d_batch = NULL, *table = NULL;
    const size_t local = c->rope_theta_local > 0.0f ? T * HS / 2 : 0; /* the sliding layers' tables */
    const size_t scratch = m->arch->scratch_floats ? NB * m->arch->scratch_floats(c) : 0;
    fs->state_floats = m->arch->state_floats ? m->arch->state_floats(c) : 0;
    size_t sizes[] = {pool,    pool,    T * HS / 2, T * HS / 2, NB * C,  NB * C,  NB * QD,
                      NB * QD, NB * FF, NB * FF,    NB * C,     NB * KD, NB * KD, 4 * NB, S * max_blocks,
                      local,   local,   scratch,    S * fs->state_floats};
    float **slots[] = {&fs->k_cache, &fs->v_cache, &fs->rope_cos, &fs->rope_sin, &fs->x,
                       &fs->xb,      &fs->q,       &fs->att,      &fs->hb,       &fs->hb2,
                       &fs->tmp,     &fs->k_new,   &fs->v_new,    &d_batch,      &table,
                       &fs->rope_cos_local, &fs->rope_sin_local, &fs->arch_scratch, &fs->seq_state};
    size_t total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t s = (sizes[i] + 15) & ~(size_t)15;
        if (kiln_add_overflow(total, s, &total))
            return kiln_error(KILN_ERR_RANGE, "context of %d tokens is too large", n_ctx);
    }
    size_t bytes;
    if (kiln_mul_overflow(total, sizeof(float), &bytes))
        return kiln_error(KILN_ERR_RANGE, "context of %d tokens is too large", n_ctx);
    fs->host_table = kiln_malloc(S * max_blocks * sizeof(int32_t));
    fs->h_batch = fs->host_memory ? NULL : kiln_malloc(4 * NB * sizeof(int32_t));
    fs->runs = kiln_malloc(NB * sizeof *fs->runs);
    fs->state_pos = kiln_calloc(S, sizeof *fs->state_pos);
    fs->kv_layer = kiln_malloc((size_t)c->n_layer * sizeof *fs->kv_layer);
    if (!fs->host_table || !fs->runs || !fs->state_pos || !fs->kv_layer || (!fs->host_memory && !fs->h_batch)) {
        kiln_forward_state_free(fs);
        return kiln_error(KILN_ERR_NOMEM, "out of memory for a %d-token batch", n_batch);
    }
    /* zeroed, so no stale bits are ever read (host memory: calloc, zeroed lazily by the OS) */
    char what[64];
    snprintf(what, sizeof what, "a %d-token context", n_ctx);
    float *block = kiln_backend_alloc_zeroed(be, bytes, "forward state", what);
    if (!block) {
        kiln_forward_state_free(fs);
        return KILN_ERR_NOMEM; /* the message names the backend and its reason */
    }
    fs->block = block;
    fs->bytes = bytes;
    fs->n_ctx = n_ctx;
    fs->n_batch = n_batch;
    size_t off = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        *slots[i] = sizes[i] ? block + off : NULL;
        off += (sizes[i] + 15) & ~(size_t)15;
    }
    fs->n_kv_layers = (int)L;
    for (int l = 0, i = 0; l < c->n_layer; l++) fs->kv_layer[l] = kiln_layer_linear(c, l) ? -1 : i++;
    fs->d_batch = (int32_t *)(void *)d_batch;
    if (fs->host_memory) fs->h_batch = fs->d_batch;
    fs->n_seq = (int)S;
    fs->max_blocks = (int)max_blocks;
    fs->n_blocks = (int)n_blocks;
    /* dense: sequence s owns blocks s*max_blocks..; a pool: the caller assigns blocks
     * (kiln_forward_state_set_blocks), block 0 until then */
    for (size_t i = 0; i < S * max_blocks; i++) fs->host_table[i] = pool_blocks ? 0 : (int32_t)i;
    fs->pages.block_size = KILN_KV_BLOCK;
    fs->pages.max_blocks = (int)max_blocks;
    fs->pages.block_table = (const int32_t *)(void *)table;
    fs->pages.host_table = fs->host_table;
    kiln_status st = KILN_OK;
    if (fs->host_memory) {
        memcpy(table, fs->host_table, S * max_blocks * sizeof(int32_t));
        kiln_rope_tables_fill(m, n_ctx, fs->rope_cos, fs->rope_sin);
        if (local) kiln_rope_tables_fill_kind(m, n_ctx, 1, fs->rope_cos_local, fs->rope_sin_local);
        fs->layer_refs = m->layer_refs;
        fs->final_norm = m->final_norm;
        return KILN_OK;
    }
    st = kiln_backend_upload(be, table, fs->host_table, S * max_blocks * sizeof(int32_t));
    if (st == KILN_OK) {
        size_t tab = T * HS / 2;
        float *host = kiln_malloc((tab ? tab : 1) * 2 * sizeof(float));
        if (!host) {
            st = kiln_error(KILN_ERR_NOMEM, "out of memory for the rope tables of a %d-token context", n_ctx);
        } else {
            kiln_rope_tables_fill(m, n_ctx, host, host + tab);
            st = kiln_backend_upload(be, fs->rope_cos, host, tab * sizeof(float));
            if (st == KILN_OK) st = kiln_backend_upload(be, fs->rope_sin, host + tab, tab * sizeof(float));
            if (st == KILN_OK && local) {
                kiln_rope_tables_fill_kind(m, n_ctx, 1, host, host + tab);
                st = kiln_backend_upload(be, fs->rope_cos_local, host, tab * sizeof(float));
                if (st == KILN_OK) st = kiln_backend_upload(be, fs->rope_sin_local, host + tab, tab * sizeof(float));
            }
            kiln_free(host);
        }
    }
    if (st == KILN_OK) st = upload_weight_vectors(fs, m, be);
    if (st != KILN_OK) kiln_forward_state_free(fs);
    return st;
}

void kiln_forward_state_free(kiln_forward_state *fs) {
    if (!fs) return;
    if (fs->be && fs->block) kiln_backend_free_buf(fs->be, fs->block);
    if (!fs->host_memory && fs->be) {
        kiln_backend_free_buf(fs->be, fs->wblock);
        kiln_backend_free_buf(fs->be, fs->logits);
        kiln_free(fs->h_batch);
    }
    kiln_free(fs->layer_refs_owned);
    kiln_free(fs->state_pos);
    kiln_free(fs->kv_layer);
    kiln_free(fs->host_table);
    kiln_free(fs->runs);
    memset(fs, 0, sizeof *fs);
}

kiln_status kiln_forward_state_set_blocks(kiln_forward_state *fs, int seq, int first, const int32_t *blocks, int n) {
    if (seq < 0 || seq >= fs->n_seq || first < 0 || n < 0 || first > fs->max_blocks - n)
        return kiln_error(KILN_ERR_RANGE, "forward state: blocks %d..%d of sequence %d out of range (%d sequences of %d blocks)",
                          first, first + n, seq, fs->n_seq, fs->max_blocks);
    for (int i = 0; i < n; i++)
        if (blocks[i] < 0 || blocks[i] >= fs->n_blocks)
            return kiln_error(KILN_ERR_RANGE, "forward state: block %d not in the pool [0, %d)", blocks[i], fs->n_blocks);
    size_t at = (size_t)seq * (size_t)fs->max_blocks + (size_t)first;
    memcpy(fs->host_table + at, blocks, (size_t)n * sizeof(int32_t));
    int32_t *table = (int32_t *)(uintptr_t)fs->pages.block_table;
    if (fs->host_memory) {
        memcpy(table + at, blocks, (size_t)n * sizeof(int32_t));
        return KILN_OK;
    }
    return n ? kiln_backend_upload(fs->be, table + at, blocks, (size_t)n * sizeof(int32_t)) : KILN_OK;
}

kiln_status kiln_forward_stage(kiln_forward_state *fs, const kiln_batch *b) {
    const int n = b->n;
    int32_t *h = fs->h_batch;
    for (int i = 0; i < n; i++) {
        h[i] = b->ids[i];
        h[n + i] = b->pos[i];
        h[2 * n + i] = b->seq[i];
        h[3 * n + i] = kiln_forward_slot(fs, b->seq[i], b->pos[i]);
    }
    if (fs->host_memory) return KILN_OK;
    return kiln_backend_upload(fs->be, fs->d_batch, h, 4 * (size_t)n * sizeof(int32_t));
}

/* ---- the forward through the model's architecture ---------------------------------------- */

/* Layer `layer`'s k and v pools. */
static void layer_pools(const kiln_fwd_batch *g, int layer, size_t KD, float **k_pool, float **v_pool) {
    const kiln_forward_state *fs = g->fs;
    const size_t pool = (size_t)fs->n_blocks * KILN_KV_BLOCK * KD, kv = (size_t)fs->kv_layer[layer];
    *k_pool = fs->k_cache + kv * pool;
    *v_pool = fs->v_cache + kv * pool;
}

void kiln_forward_attend_rope(const kiln_fwd_batch *g, kiln_backend *be, int layer, float *out, float *q, float *k,
                              const float *v, int NH, int KVH, int HS, float scale, int window, const float *cos_tab,
                              const float *sin_tab) {
    const kiln_forward_state *fs = g->fs;
    float *k_pool, *v_pool;
    layer_pools(g, layer, (size_t)KVH * HS, &k_pool, &v_pool);
    kiln_op_rope_kv_store(be, q, k, v, g->pos, g->N, NH, KVH, HS, cos_tab, sin_tab, k_pool, v_pool, g->slots);
    be->i->attention_paged(be, out, q, k_pool, v_pool, &fs->pages, g->seq, g->pos, g->runs, g->n_runs, g->N,
                           g->max_T, NH, KVH, HS, scale, window);
}

void kiln_forward_attend(const kiln_fwd_batch *g, kiln_backend *be, int layer, float *out, const float *q,
                         const float *k, const float *v, int NH, int KVH, int HS, float scale, int window) {
    const kiln_forward_state *fs = g->fs;
    const size_t KD = (size_t)KVH * HS;
    float *k_pool, *v_pool;
    layer_pools(g, layer, KD, &k_pool, &v_pool);
    be->i->kv_store_rows(be, k_pool, v_pool, k, v, g->slots, g->N, KD);
    be->i->attention_paged(be, out, q, k_pool, v_pool, &fs->pages, g->seq, g->pos, g->runs, g->n_runs, g->N,
                           g->max_T, NH, KVH, HS, scale, window);
}

void kiln_forward_logits(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs, int N,
                         const int32_t *out, int n_out, float *logits) {
    const kiln_backend_i *op = be->i;
    const int C = m->cfg.n_embd;
    if (!logits) return;
    /* the rows whose logits are wanted: all, one contiguous range, or gathered */
    const float *h = fs->x;
    int rows = N;
    if (out) {
        rows = n_out;
        if (n_out > 0 && out[n_out - 1] - out[0] == n_out - 1) {
            h = fs->x + (size_t)out[0] * C;
        } else {
            op->get_rows(be, fs->tmp, fs->x, out, n_out, C);
            h = fs->tmp;
        }
    }
    if (rows <= 0) return;
    /* the final norm and the head: one products call (the bits of rmsnorm, then matmul) */
    float *out_l[1] = {logits};
    const kiln_tensor *w[1] = {m->lm_head};
    const kiln_products p = {.n = 1, .out = out_l, .W = w, .norm_w = fs->final_norm, .eps = m->cfg.rms_eps,
                             .scratch_x = fs->xb};
    kiln_op_products(be, h, &p, rows);
}

/* The runs of batch b (consecutive tokens of one sequence at consecutive positions) into
 * runs[0..), at most b->n; their count. */
static int batch_runs(const kiln_batch *b, kiln_batch_run *runs) {
    int n_runs = 0;
    for (int i = 0; i < b->n; i++) {
        kiln_batch_run *r = n_runs ? &runs[n_runs - 1] : NULL;
        if (r && b->seq[i] == r->seq && b->pos[i] == r->pos0 + r->n) {
            r->n++;
            continue;
        }
        runs[n_runs++] = (kiln_batch_run){i, 1, b->seq[i], b->pos[i]};
    }
    return n_runs;
}

/* A recurrent state (fs->seq_state) only moves forward: each run must restart its sequence at
 * position 0 or continue where its state stands, and a sequence may have one run per batch
 * (ops.h, Qwen3.5's ops). Checked for the whole batch before any state moves; then each
 * sequence's state_pos is its run's end. */
static kiln_status state_advance(kiln_forward_state *fs, const kiln_batch_run *runs, int n_runs) {
    for (int r = 0; r < n_runs; r++) {
        const kiln_batch_run *u = &runs[r];
        if (u->pos0 != 0 && u->pos0 != fs->state_pos[u->seq])
            return kiln_error(KILN_ERR_UNSUPPORTED,
                              "forward: sequence %d continues at position %d but its recurrent state is at %d "
                              "(a linear-attention state cannot go back: start the sequence again at 0)",
                              u->seq, u->pos0, fs->state_pos[u->seq]);
        for (int q = 0; q < r; q++)
            if (runs[q].seq == u->seq)
                return kiln_error(KILN_ERR_UNSUPPORTED,
                                  "forward: sequence %d has two runs in one batch (a recurrent state takes one)",
                                  u->seq);
    }
    for (int r = 0; r < n_runs; r++) fs->state_pos[runs[r].seq] = runs[r].pos0 + runs[r].n;
    return KILN_OK;
}

kiln_status kiln_model_forward(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs,
                               const kiln_batch *b, float *logits) {
    if (b->n < 1 || b->n > fs->n_batch)
        return kiln_error(KILN_ERR_RANGE, "forward: %d tokens not in [1, %d]", b->n, fs->n_batch);
    int n_runs = batch_runs(b, fs->runs), max_T = 0;
    if (fs->state_floats) KILN_TRY(state_advance(fs, fs->runs, n_runs));
    KILN_TRY(kiln_forward_stage(fs, b));
    for (int r = 0; r < n_runs; r++)
        if (fs->runs[r].pos0 + fs->runs[r].n > max_T) max_T = fs->runs[r].pos0 + fs->runs[r].n;
    m->arch->forward(m, be, fs, b->n, fs->runs, n_runs, max_T, b->out, b->out ? b->n_out : b->n, logits);
    return KILN_OK;
}

kiln_status kiln_forward_state_advance_steps(kiln_forward_state *fs, const int32_t *seq, const int32_t *pos, int B) {
    if (!fs->state_floats) return KILN_OK;
    if (B < 1 || B > fs->n_batch) return kiln_error(KILN_ERR_RANGE, "forward: %d tokens not in [1, %d]", B, fs->n_batch);
    for (int b = 0; b < B; b++) fs->runs[b] = (kiln_batch_run){b, 1, seq[b], pos[b]};
    return state_advance(fs, fs->runs, B);
}

void kiln_model_forward_dev(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs, int B,
                            float *logits) {
    m->arch->forward(m, be, fs, B, NULL, 0, fs->n_ctx, NULL, B, logits);
}
/* Inverse frequencies as transformers computes them in float32:
 *   inv_freq[i] = 1 / theta^((2i)/HS), then the rope_type's adjustment. */
static float rope_inv_freq(const kiln_model *m, int i, int local) {
    const kiln_model_config *c = &m->cfg;
    float e = (float)(2 * i) / (float)kiln_rotary_dim(c);
    float p = (float)pow((double)(local ? c->rope_theta_local : c->rope_theta), (double)e);
    float inv = 1.0f / p;
    if (local) return inv; /* the sliding layers' base: no scaling (Gemma 3) */
    if (m->rope_freq_factors) inv = inv / m->rope_freq_factors[i];
    if (c->rope_scaling == KILN_ROPE_SCALING_LINEAR) {
        inv = inv / c->rope_factor;
    } else if (c->rope_scaling == KILN_ROPE_SCALING_LLAMA3) {
        /* transformers' _compute_llama3_parameters, in float32 where it computes in float32 */
        double factor = c->rope_factor, lo = c->rope_low_freq_factor, hi = c->rope_high_freq_factor;
        double old_ctx = c->rope_original_max_pos;
        double low_wavelen = old_ctx / lo, high_wavelen = old_ctx / hi;
        float wavelen = (float)(2.0 * 3.14159265358979323846) / inv;
        float inv_l = (double)wavelen > low_wavelen ? inv / (float)factor : inv;
        float smooth = ((float)old_ctx / wavelen - (float)lo) / (float)(hi - lo);
        float smoothed = (1.0f - smooth) * inv_l / (float)factor + smooth * inv_l;
        int medium = !((double)wavelen < high_wavelen) && !((double)wavelen > low_wavelen);
        inv = medium ? smoothed : inv_l;
    }
    return inv;
}

void kiln_rope_tables_fill(const kiln_model *m, int n_ctx, float *cos_tab, float *sin_tab) {
    kiln_rope_tables_fill_kind(m, n_ctx, 0, cos_tab, sin_tab);
}

void kiln_rope_tables_fill_kind(const kiln_model *m, int n_ctx, int local, float *cos_tab, float *sin_tab) {
    int half = kiln_rotary_dim(&m->cfg) / 2;
    for (int i = 0; i < half; i++) {
        float inv = rope_inv_freq(m, i, local);
        for (int p = 0; p < n_ctx; p++) {
            float f = (float)p * inv; /* one float32 product, as torch's matmul of (HS/2,1)x(1,T) */
            cos_tab[(size_t)p * half + i] = (float)cos((double)f);
            sin_tab[(size_t)p * half + i] = (float)sin((double)f);
        }
    }
}

