/*
 * llama_forward.c -- the Llama-family decoder forward pass, written with backend ops.
 *
 *   x = embed(ids)
 *   for each layer:
 *       h = rmsnorm(x) ; q, k, v = h Wq^T + bq, h Wk^T + bk, h Wv^T + bv
 *       (Qwen3) q, k = rmsnorm_per_head(q), rmsnorm_per_head(k)
 *       q, k = rope(q), rope(k) ; append k, v to the cache
 *       x = x + attention(q, K, V) Wo^T
 *       h = rmsnorm(x) ; x = x + (silu(h Wg^T) * (h Wu^T)) Wd^T
 *   logits = rmsnorm(x) Wlm^T
 */
#include "model.h"

#include <math.h>
#include <string.h>

/* Zero nbytes (a multiple of 4) of backend memory at p: the backend's zero op, or uploads of a
 * zeroed host chunk where it has none. */
static kiln_status backend_zero(kiln_backend *be, void *p, size_t nbytes) {
    if (be->i->zero) {
        be->i->zero(be, (float *)p, nbytes / sizeof(float));
        return kiln_backend_status(be);
    }
    size_t chunk = nbytes < ((size_t)4 << 20) ? nbytes : ((size_t)4 << 20);
    if (!chunk) return KILN_OK;
    void *zeros = kiln_calloc(1, chunk);
    if (!zeros) return kiln_error(KILN_ERR_NOMEM, "forward state: out of memory (%zu bytes)", chunk);
    kiln_status st = KILN_OK;
    for (size_t off = 0; off < nbytes && st == KILN_OK; off += chunk) {
        size_t n = nbytes - off < chunk ? nbytes - off : chunk;
        st = kiln_backend_upload(be, (char *)p + off, zeros, n);
    }
    kiln_free(zeros);
    return st;
}

/* A device backend: copy the model's layer table and put every f32 vector it points to
 * (norms, biases, q/k norms, the final norm) into one backend block. */
static kiln_status upload_weight_vectors(kiln_forward_state *fs, const kiln_model *m, kiln_backend *be) {
    const kiln_model_config *c = &m->cfg;
    size_t C = (size_t)c->n_embd, HS = (size_t)c->head_dim, FF = (size_t)c->n_ff;
    size_t QD = (size_t)c->n_head * HS, KD = (size_t)c->n_head_kv * HS, L = (size_t)c->n_layer;
    fs->layers_owned = kiln_calloc(L ? L : 1, sizeof *fs->layers_owned);
    if (!fs->layers_owned) return kiln_error(KILN_ERR_NOMEM, "forward state: out of memory for the layer table");
    memcpy(fs->layers_owned, m->layers, L * sizeof *fs->layers_owned);
    size_t total = (C + 15) & ~(size_t)15; /* final norm first */
    for (int pass = 0; pass < 2; pass++) {
        size_t off = 0;
        if (pass == 1) {
            fs->wblock = kiln_backend_alloc(be, total * sizeof(float));
            if (!fs->wblock) return kiln_error(KILN_ERR_NOMEM, "forward state: cannot allocate %zu bytes of backend memory for norms and biases", total * sizeof(float));
            kiln_status st = kiln_backend_upload(be, fs->wblock, m->final_norm, C * sizeof(float));
            if (st != KILN_OK) return st;
            fs->final_norm = (const float *)fs->wblock;
            off = (C + 15) & ~(size_t)15;
        }
        for (size_t l = 0; l < L; l++) {
            kiln_layer_weights *w = &fs->layers_owned[l];
            /* each vector's slot in the copy and its length in floats */
            const float **slot[11] = {&w->attn_norm, &w->bq, &w->bk, &w->bv, &w->bo, &w->q_norm,
                                      &w->k_norm, &w->mlp_norm, &w->b_gate, &w->b_up, &w->b_down};
            const size_t len[11] = {C, QD, KD, KD, C, HS, HS, C, FF, FF, C};
            for (int i = 0; i < 11; i++) {
                if (!*slot[i]) continue;
                size_t r = (len[i] + 15) & ~(size_t)15;
                if (pass == 0) {
                    total += r;
                } else {
                    float *dst = (float *)fs->wblock + off;
                    kiln_status st = kiln_backend_upload(be, dst, *slot[i], len[i] * sizeof(float));
                    if (st != KILN_OK) return st;
                    *slot[i] = dst;
                    off += r;
                }
            }
        }
    }
    fs->layers = fs->layers_owned;
    return KILN_OK;
}

kiln_status kiln_forward_state_init(kiln_forward_state *fs, const kiln_model *m, kiln_backend *be,
                                    int n_ctx, int n_batch) {
    return kiln_forward_state_init_seq(fs, m, be, n_ctx, n_batch, 1);
}

kiln_status kiln_forward_state_init_seq(kiln_forward_state *fs, const kiln_model *m, kiln_backend *be,
                                        int n_ctx, int n_batch, int n_seq) {
    const kiln_model_config *c = &m->cfg;
    memset(fs, 0, sizeof *fs);
    fs->be = be;
    /* a backend whose memory is host memory (the cpu's): keep the model's pointers, write
     * logits to the caller's array */
    fs->host_memory = be->i->host_memory;
    size_t C = (size_t)c->n_embd, HS = (size_t)c->head_dim, L = (size_t)c->n_layer;
    size_t QD = (size_t)c->n_head * HS, KD = (size_t)c->n_head_kv * HS, FF = (size_t)c->n_ff;
    size_t NB = (size_t)n_batch, T = (size_t)n_ctx;
    size_t tmp_w = C > KD ? C : KD;
    /* sizes in floats, each rounded up to 16 floats (64 bytes) */
    /* a backend with decode graphs also gets the step's id/position (2 int32 in a 16-float
     * slot) and one row of k and v */
    int steps = be->i->kv_store && be->i->attention_at;
    size_t S = (size_t)(n_seq > 0 ? n_seq : 1);
    size_t gk = steps ? S * KD : 0, gs = steps ? 2 * S : 0;
    float *step_slot = NULL;
    size_t sizes[] = {S * L * T * KD, S * L * T * KD, T * HS / 2, T * HS / 2, NB * C, NB * C,
                      NB * QD,    NB * QD,    NB * FF,    NB * FF,    NB * tmp_w, gk, gk, gs};
    float **slots[] = {&fs->k_cache, &fs->v_cache, &fs->rope_cos, &fs->rope_sin, &fs->x, &fs->xb,
                       &fs->q,       &fs->att,     &fs->hb,       &fs->hb2,      &fs->tmp,
                       &fs->k_row,   &fs->v_row,   &step_slot};
    size_t total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t s = (sizes[i] + 15) & ~(size_t)15;
        if (kiln_add_overflow(total, s, &total))
            return kiln_error(KILN_ERR_RANGE, "context of %d tokens is too large", n_ctx);
    }
    size_t bytes;
    if (kiln_mul_overflow(total, sizeof(float), &bytes))
        return kiln_error(KILN_ERR_RANGE, "context of %d tokens is too large", n_ctx);
    fs->pos = kiln_calloc(NB ? NB : 1, sizeof(int32_t));
    if (!fs->pos) return kiln_error(KILN_ERR_NOMEM, "out of memory for a %d-token batch", n_batch);
    /* cpu: kiln_calloc (what kiln_backend_alloc is there, zeroed lazily by the OS); device:
     * backend memory, zeroed explicitly so no stale bits are ever read */
    float *block = fs->host_memory ? kiln_calloc(1, bytes) : kiln_backend_alloc(be, bytes);
    if (!block) {
        kiln_forward_state_free(fs);
        return kiln_error(KILN_ERR_NOMEM, "out of %s memory allocating %zu bytes for a %d-token context",
                          be->i->name, bytes, n_ctx);
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
    fs->d_step = (int32_t *)(void *)step_slot;
    fs->n_seq = (int)S;
    fs->seq_stride = L * T * KD;
    kiln_status st = KILN_OK;
    if (fs->host_memory) {
        kiln_rope_tables_fill(m, n_ctx, fs->rope_cos, fs->rope_sin);
        fs->layers = m->layers;
        fs->final_norm = m->final_norm;
        return KILN_OK;
    }
    st = backend_zero(be, block, bytes);
    if (st == KILN_OK) {
        size_t tab = T * HS / 2;
        float *host = kiln_malloc((tab ? tab : 1) * 2 * sizeof(float));
        if (!host) {
            st = kiln_error(KILN_ERR_NOMEM, "out of memory for the rope tables of a %d-token context", n_ctx);
        } else {
            kiln_rope_tables_fill(m, n_ctx, host, host + tab);
            st = kiln_backend_upload(be, fs->rope_cos, host, tab * sizeof(float));
            if (st == KILN_OK) st = kiln_backend_upload(be, fs->rope_sin, host + tab, tab * sizeof(float));
            kiln_free(host);
        }
    }
    if (st == KILN_OK) st = upload_weight_vectors(fs, m, be);
    if (st != KILN_OK) kiln_forward_state_free(fs);
    return st;
}

void kiln_forward_state_free(kiln_forward_state *fs) {
    if (!fs) return;
    if (fs->host_memory) {
        kiln_free(fs->block);
    } else if (fs->be) {
        kiln_backend_free_buf(fs->be, fs->block);
        kiln_backend_free_buf(fs->be, fs->wblock);
        kiln_backend_free_buf(fs->be, fs->logits);
    }
    kiln_free(fs->layers_owned);
    kiln_free(fs->pos);
    memset(fs, 0, sizeof *fs);
}

/* Inverse frequencies as transformers computes them in float32:
 *   inv_freq[i] = 1 / theta^((2i)/HS), then the rope_type's adjustment. */
static float rope_inv_freq(const kiln_model *m, int i) {
    const kiln_model_config *c = &m->cfg;
    float e = (float)(2 * i) / (float)c->head_dim;
    float p = (float)pow((double)c->rope_theta, (double)e);
    float inv = 1.0f / p;
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
    int half = m->cfg.head_dim / 2;
    for (int i = 0; i < half; i++) {
        float inv = rope_inv_freq(m, i);
        for (int p = 0; p < n_ctx; p++) {
            float f = (float)p * inv; /* one float32 product, as torch's matmul of (HS/2,1)x(1,T) */
            cos_tab[(size_t)p * half + i] = (float)cos((double)f);
            sin_tab[(size_t)p * half + i] = (float)sin((double)f);
        }
    }
}

/* The forward of N tokens at positions n_past.. (step == 0), or of the one token whose id and
 * position are in backend memory (step != 0: ids and n_past unused; k and v go through
 * fs->k_row / v_row into the cache with kv_store, attention reads the position with
 * attention_at), which gives the same bits. */
static void forward(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs,
                    const int32_t *ids, int N, int n_past, int all_logits, float *logits,
                    int step) {
    /* step: N = B sequences, one token each (sequence b's cache at b * seq_stride) */
    const size_t seq_off = step ? 0 : (size_t)fs->seq * fs->seq_stride;
    const kiln_model_config *c = &m->cfg;
    const kiln_backend_i *op = be->i;
    int C = c->n_embd, HS = c->head_dim, NH = c->n_head, KVH = c->n_head_kv, FF = c->n_ff;
    size_t QD = (size_t)NH * HS, KD = (size_t)KVH * HS;
    float eps = c->rms_eps;
    float scale = (float)(1.0 / sqrt((double)HS));
    const int32_t *pos = fs->pos;
    if (step) {
        ids = fs->d_step;
        pos = fs->d_step + N;
        all_logits = 1;
    } else {
        for (int n = 0; n < N; n++) fs->pos[n] = n_past + n;
    }

    op->embed(be, fs->x, m->tok_embd, ids, N);
    for (int l = 0; l < c->n_layer; l++) {
        const kiln_layer_weights *w = &fs->layers[l];
        float *k_layer = fs->k_cache + seq_off + (size_t)l * fs->n_ctx * KD; /* (n_ctx, KVH, HS) */
        float *v_layer = fs->v_cache + seq_off + (size_t)l * fs->n_ctx * KD;
        /* (N, KVH, HS) rows of this batch: in the cache, or the step's rows stored below */
        float *k_new = step ? fs->k_row : k_layer + (size_t)n_past * KD;
        float *v_new = step ? fs->v_row : v_layer + (size_t)n_past * KD;

        /* attention block */
        op->rmsnorm(be, fs->xb, fs->x, w->attn_norm, N, C, eps);
        op->matmul(be, fs->q, fs->xb, w->wq, w->bq, N);
        op->matmul(be, k_new, fs->xb, w->wk, w->bk, N);
        op->matmul(be, v_new, fs->xb, w->wv, w->bv, N);
        if (w->q_norm) op->rmsnorm(be, fs->q, fs->q, w->q_norm, N * NH, HS, eps);
        if (w->k_norm) op->rmsnorm(be, k_new, k_new, w->k_norm, N * KVH, HS, eps);
        op->rope(be, fs->q, pos, N, NH, HS, fs->rope_cos, fs->rope_sin);
        op->rope(be, k_new, pos, N, KVH, HS, fs->rope_cos, fs->rope_sin);
        if (step) {
            op->kv_store(be, k_layer, v_layer, k_new, v_new, pos, N, fs->seq_stride, KD);
            op->attention_at(be, fs->att, fs->q, k_layer, v_layer, pos, N, fs->seq_stride,
                             fs->n_ctx, NH, KVH, HS, scale);
        } else {
            op->attention(be, fs->att, fs->q, k_layer, v_layer, N, n_past, NH, KVH, HS, scale);
        }
        op->matmul(be, fs->tmp, fs->att, w->wo, w->bo, N);
        op->add(be, fs->x, fs->tmp, (size_t)N * C);

        /* MLP block */
        op->rmsnorm(be, fs->xb, fs->x, w->mlp_norm, N, C, eps);
        op->matmul(be, fs->hb, fs->xb, w->w_gate, w->b_gate, N);
        op->matmul(be, fs->hb2, fs->xb, w->w_up, w->b_up, N);
        op->swiglu(be, fs->hb, fs->hb, fs->hb2, (size_t)N * FF);
        op->matmul(be, fs->tmp, fs->hb, w->w_down, w->b_down, N);
        op->add(be, fs->x, fs->tmp, (size_t)N * C);
    }
    (void)QD;
    if (!logits) return;
    if (all_logits) {
        op->rmsnorm(be, fs->xb, fs->x, fs->final_norm, N, C, eps);
        op->matmul(be, logits, fs->xb, m->lm_head, NULL, N);
    } else {
        op->rmsnorm(be, fs->xb, fs->x + (size_t)(N - 1) * C, fs->final_norm, 1, C, eps);
        op->matmul(be, logits, fs->xb, m->lm_head, NULL, 1);
    }
}

void kiln_model_forward(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs,
                        const int32_t *ids, int N, int n_past, int all_logits, float *logits) {
    forward(m, be, fs, ids, N, n_past, all_logits, logits, 0);
}

void kiln_model_forward_step(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs,
                             float *logits) {
    forward(m, be, fs, NULL, 1, 0, 0, logits, 1);
}

void kiln_model_forward_batch(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs,
                              int B, float *logits) {
    forward(m, be, fs, NULL, B, 0, 1, logits, 1);
}
