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

kiln_status kiln_forward_state_init(kiln_forward_state *fs, const kiln_model *m, int n_ctx,
                                    int n_batch) {
    const kiln_model_config *c = &m->cfg;
    memset(fs, 0, sizeof *fs);
    size_t C = (size_t)c->n_embd, HS = (size_t)c->head_dim, L = (size_t)c->n_layer;
    size_t QD = (size_t)c->n_head * HS, KD = (size_t)c->n_head_kv * HS, FF = (size_t)c->n_ff;
    size_t NB = (size_t)n_batch, T = (size_t)n_ctx;
    size_t tmp_w = C > KD ? C : KD;
    /* sizes in floats, each rounded up to 16 floats (64 bytes) */
    size_t sizes[] = {L * T * KD, L * T * KD, T * HS / 2, T * HS / 2, NB * C, NB * C,
                      NB * QD,    NB * QD,    NB * FF,    NB * FF,    NB * tmp_w, NB};
    float **slots[] = {&fs->k_cache, &fs->v_cache, &fs->rope_cos, &fs->rope_sin, &fs->x, &fs->xb,
                       &fs->q,       &fs->att,     &fs->hb,       &fs->hb2,      &fs->tmp, NULL};
    size_t total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t s = (sizes[i] + 15) & ~(size_t)15;
        if (kiln_add_overflow(total, s, &total))
            return kiln_error(KILN_ERR_RANGE, "context of %d tokens is too large", n_ctx);
    }
    size_t bytes;
    if (kiln_mul_overflow(total, sizeof(float), &bytes))
        return kiln_error(KILN_ERR_RANGE, "context of %d tokens is too large", n_ctx);
    float *block = kiln_calloc(1, bytes);
    if (!block)
        return kiln_error(KILN_ERR_NOMEM, "out of memory allocating %zu bytes for a %d-token context",
                          bytes, n_ctx);
    size_t off = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        if (slots[i]) *slots[i] = block + off;
        else fs->pos = (int32_t *)(block + off);
        off += (sizes[i] + 15) & ~(size_t)15;
    }
    fs->block = block;
    fs->bytes = bytes;
    fs->n_ctx = n_ctx;
    fs->n_batch = n_batch;
    kiln_rope_tables_fill(m, n_ctx, fs->rope_cos, fs->rope_sin);
    return KILN_OK;
}

void kiln_forward_state_free(kiln_forward_state *fs) {
    if (!fs) return;
    kiln_free(fs->block);
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

void kiln_model_forward(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs,
                        const int32_t *ids, int N, int n_past, int all_logits, float *logits) {
    const kiln_model_config *c = &m->cfg;
    const kiln_backend_i *op = be->i;
    int C = c->n_embd, HS = c->head_dim, NH = c->n_head, KVH = c->n_head_kv, FF = c->n_ff;
    size_t QD = (size_t)NH * HS, KD = (size_t)KVH * HS;
    float eps = c->rms_eps;
    float scale = (float)(1.0 / sqrt((double)HS));
    for (int n = 0; n < N; n++) fs->pos[n] = n_past + n;

    op->embed(be, fs->x, m->tok_embd, ids, N);
    for (int l = 0; l < c->n_layer; l++) {
        const kiln_layer_weights *w = &m->layers[l];
        float *k_layer = fs->k_cache + (size_t)l * fs->n_ctx * KD; /* (n_ctx, KVH, HS) */
        float *v_layer = fs->v_cache + (size_t)l * fs->n_ctx * KD;
        float *k_new = k_layer + (size_t)n_past * KD; /* (N, KVH, HS) rows of this batch */
        float *v_new = v_layer + (size_t)n_past * KD;

        /* attention block */
        op->rmsnorm(be, fs->xb, fs->x, w->attn_norm, N, C, eps);
        op->matmul(be, fs->q, fs->xb, w->wq, w->bq, N);
        op->matmul(be, k_new, fs->xb, w->wk, w->bk, N);
        op->matmul(be, v_new, fs->xb, w->wv, w->bv, N);
        if (w->q_norm) op->rmsnorm(be, fs->q, fs->q, w->q_norm, N * NH, HS, eps);
        if (w->k_norm) op->rmsnorm(be, k_new, k_new, w->k_norm, N * KVH, HS, eps);
        op->rope(be, fs->q, fs->pos, N, NH, HS, fs->rope_cos, fs->rope_sin);
        op->rope(be, k_new, fs->pos, N, KVH, HS, fs->rope_cos, fs->rope_sin);
        op->attention(be, fs->att, fs->q, k_layer, v_layer, N, n_past, NH, KVH, HS, scale);
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
        op->rmsnorm(be, fs->xb, fs->x, m->final_norm, N, C, eps);
        op->matmul(be, logits, fs->xb, m->lm_head, NULL, N);
    } else {
        op->rmsnorm(be, fs->xb, fs->x + (size_t)(N - 1) * C, m->final_norm, 1, C, eps);
        op->matmul(be, logits, fs->xb, m->lm_head, NULL, 1);
    }
}
