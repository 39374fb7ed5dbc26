/*
 * gemma3.c -- Gemma 3 text models (Gemma3ForCausalLM; GGUF general.architecture "gemma3"): the
 * parameter roles and the forward, as transformers computes it (docs/models/gemma3-notes.md).
 *
 *   x = embed(ids) * sqrt(C)                                 (the scale rounded to f32)
 *   for each layer (sliding: attends to the last sliding_window positions, RoPE base
 *   rope_theta_local; full: every earlier position, rope_theta):
 *       h = rmsnorm(x) (1 + w_in)
 *       q, k, v = h Wq^T, h Wk^T, h Wv^T ; q, k = rmsnorm_per_head (1 + w_q), (1 + w_k)
 *       q, k = rope(q), rope(k) ; a = attention(q, K, V) * query_pre_attn_scalar^-1/2 scores
 *       x = x + rmsnorm(a Wo^T) (1 + w_post_attn)
 *       h = rmsnorm(x) (1 + w_pre_ff)
 *       x = x + rmsnorm((gelu_tanh(h Wg^T) * (h Wu^T)) Wd^T) (1 + w_post_ff)
 *   logits = rmsnorm(x) (1 + w_final) E^T                     (the head is the embedding)
 *
 * Every norm multiplies by 1 + w: the model binds that multiplier (arch.h plus_one), so the
 * forward runs the plain rmsnorm op. Training Gemma 3 is not implemented yet (no train hooks:
 * the trainer refuses it).
 */
#include "../formats/gguf.h"
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

enum gemma3_role {
    G3_EMBED, /* per model */
    G3_WQ, G3_WK, G3_WV, G3_WO, G3_QNORM, G3_KNORM, G3_GATE, G3_UP, G3_DOWN, /* per layer */
    G3_IN_NORM, G3_POST_ATTN_NORM, G3_PRE_FF_NORM, G3_POST_FF_NORM,
    G3_NORM, G3_HEAD, /* per model */
    G3_N
};
#define G3_N_LAYER (G3_POST_FF_NORM - G3_WQ + 1)

#define HF_L "model.layers.%d."
#define GG_L "blk.%d."
#define MAT(rows, cols) rows, cols, KILN_COND_ALWAYS, KILN_INIT_NORMAL, true, true, KILN_DIM_ONE, false
/* the multiplier 1 + w starts at 1 (transformers initialises w to 0) */
#define NORM(rows) rows, KILN_DIM_ONE, KILN_COND_ALWAYS, KILN_INIT_ONES, true, true, KILN_DIM_ONE, true
static const kiln_param_role gemma3_roles[G3_N] = {
    /* hf name, gguf name, rows, cols, condition, init, per layer, trainable, gguf rope heads,
     * plus_one */
    [G3_EMBED] = {"model.embed_tokens.weight", "token_embd.weight", KILN_DIM_V, KILN_DIM_C, KILN_COND_ALWAYS,
                  KILN_INIT_NORMAL, false, true, KILN_DIM_ONE, false},
    [G3_WQ] = {HF_L "self_attn.q_proj.weight", GG_L "attn_q.weight", MAT(KILN_DIM_QD, KILN_DIM_C)},
    [G3_WK] = {HF_L "self_attn.k_proj.weight", GG_L "attn_k.weight", MAT(KILN_DIM_KD, KILN_DIM_C)},
    [G3_WV] = {HF_L "self_attn.v_proj.weight", GG_L "attn_v.weight", MAT(KILN_DIM_KD, KILN_DIM_C)},
    [G3_WO] = {HF_L "self_attn.o_proj.weight", GG_L "attn_output.weight", MAT(KILN_DIM_C, KILN_DIM_QD)},
    [G3_QNORM] = {HF_L "self_attn.q_norm.weight", GG_L "attn_q_norm.weight", NORM(KILN_DIM_HS)},
    [G3_KNORM] = {HF_L "self_attn.k_norm.weight", GG_L "attn_k_norm.weight", NORM(KILN_DIM_HS)},
    [G3_GATE] = {HF_L "mlp.gate_proj.weight", GG_L "ffn_gate.weight", MAT(KILN_DIM_FF, KILN_DIM_C)},
    [G3_UP] = {HF_L "mlp.up_proj.weight", GG_L "ffn_up.weight", MAT(KILN_DIM_FF, KILN_DIM_C)},
    [G3_DOWN] = {HF_L "mlp.down_proj.weight", GG_L "ffn_down.weight", MAT(KILN_DIM_C, KILN_DIM_FF)},
    [G3_IN_NORM] = {HF_L "input_layernorm.weight", GG_L "attn_norm.weight", NORM(KILN_DIM_C)},
    [G3_POST_ATTN_NORM] = {HF_L "post_attention_layernorm.weight", GG_L "post_attention_norm.weight",
                           NORM(KILN_DIM_C)},
    [G3_PRE_FF_NORM] = {HF_L "pre_feedforward_layernorm.weight", GG_L "ffn_norm.weight", NORM(KILN_DIM_C)},
    [G3_POST_FF_NORM] = {HF_L "post_feedforward_layernorm.weight", GG_L "post_ffw_norm.weight", NORM(KILN_DIM_C)},
    [G3_NORM] = {"model.norm.weight", "output_norm.weight", KILN_DIM_C, KILN_DIM_ONE, KILN_COND_ALWAYS,
                 KILN_INIT_ONES, false, true, KILN_DIM_ONE, true},
    [G3_HEAD] = {"lm_head.weight", "output.weight", KILN_DIM_V, KILN_DIM_C, KILN_COND_UNTIED, KILN_INIT_NORMAL,
                 false, true, KILN_DIM_ONE, false},
};
#undef HF_L
#undef GG_L
#undef MAT
#undef NORM

/* What a gemma3 GGUF leaves to Gemma3TextConfig's defaults (the notes, "The 270M GGUF"): the
 * sliding layers' RoPE base, every sixth layer full, query_pre_attn_scalar; the window is in the
 * file. */
static kiln_status gemma3_gguf_config(const kiln_gguf *g, const char *path, kiln_model_config *c) {
    uint32_t w = 0;
    int found = 0;
    KILN_TRY(kiln_gguf_get_u32(g, "gemma3.attention.sliding_window", &w, &found));
    if (!found) return kiln_error(KILN_ERR_FORMAT, "%s: missing metadata key 'gemma3.attention.sliding_window'", path);
    if (w > (1u << 30)) return kiln_error(KILN_ERR_FORMAT, "%s: gemma3.attention.sliding_window %u is out of range", path, w);
    if (c->n_layer > KILN_MAX_LAYER_KINDS)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: %d layers: at most %d with sliding windows", path, c->n_layer,
                          KILN_MAX_LAYER_KINDS);
    c->sliding_window = (int)w;
    memset(c->sliding_layers, 0, sizeof c->sliding_layers);
    for (int l = 0; l < c->n_layer; l++)
        if ((l + 1) % 6 != 0) c->sliding_layers[l / 8] |= (uint8_t)(1u << (l % 8));
    c->rope_theta_local = 10000.0f;
    c->query_pre_attn_scalar = 256.0f;
    c->bos_id = 2;
    c->eos_id = 1;
    return KILN_OK;
}

/* arch.h's forward: N tokens staged in fs->d_batch through the layers in the forward state's
 * scratch (x the residual stream; xb the normed input; q, k_new, v_new; att; tmp a branch's
 * output; hb, hb2 the MLP), then the final norm and the head on the wanted rows. */
static void gemma3_forward(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs, int N,
                           const kiln_batch_run *runs, int n_runs, int max_T, const int32_t *out, int n_out,
                           float *logits) {
    const kiln_model_config *c = &m->cfg;
    const kiln_backend_i *op = be->i;
    const int C = c->n_embd, HS = c->head_dim, NH = c->n_head, KVH = c->n_head_kv, FF = c->n_ff;
    const size_t KD = (size_t)KVH * HS, pool = (size_t)fs->n_blocks * KILN_KV_BLOCK * KD;
    const float eps = c->rms_eps;
    const double qpas = c->query_pre_attn_scalar > 0.0f ? (double)c->query_pre_attn_scalar : (double)HS;
    const float scale = (float)(1.0 / sqrt(qpas));
    const int32_t *ids = fs->d_batch, *pos = ids + N, *seq = ids + 2 * N, *slots = ids + 3 * N;

    op->embed(be, fs->x, m->tok_embd, ids, N);
    op->scale(be, fs->x, (float)sqrt((double)C), (size_t)N * C); /* hidden_size**0.5 in the weights' f32 */
    for (int l = 0; l < c->n_layer; l++) {
        const kiln_wref *lw = fs->layer_refs + (size_t)l * G3_N_LAYER;
#define W(role) (&lw[(role) - G3_WQ])
        const int slides = kiln_layer_slides(c, l);
        const float *cs = slides && fs->rope_cos_local ? fs->rope_cos_local : fs->rope_cos;
        const float *sn = slides && fs->rope_sin_local ? fs->rope_sin_local : fs->rope_sin;
        float *k_pool = fs->k_cache + (size_t)l * pool, *v_pool = fs->v_cache + (size_t)l * pool;

        /* attention block: x = x + norm(o) */
        op->rmsnorm(be, fs->xb, fs->x, W(G3_IN_NORM)->vec, N, C, eps);
        op->matmul(be, fs->q, fs->xb, W(G3_WQ)->mat, NULL, N);
        op->matmul(be, fs->k_new, fs->xb, W(G3_WK)->mat, NULL, N);
        op->matmul(be, fs->v_new, fs->xb, W(G3_WV)->mat, NULL, N);
        op->rmsnorm(be, fs->q, fs->q, W(G3_QNORM)->vec, N * NH, HS, eps);
        op->rmsnorm(be, fs->k_new, fs->k_new, W(G3_KNORM)->vec, N * KVH, HS, eps);
        op->rope(be, fs->q, pos, N, NH, HS, cs, sn);
        op->rope(be, fs->k_new, pos, N, KVH, HS, cs, sn);
        op->kv_store_rows(be, k_pool, v_pool, fs->k_new, fs->v_new, slots, N, KD);
        op->attention_paged(be, fs->att, fs->q, k_pool, v_pool, &fs->pages, seq, pos, runs, n_runs, N, max_T, NH,
                            KVH, HS, scale, slides ? c->sliding_window : 0);
        op->matmul(be, fs->tmp, fs->att, W(G3_WO)->mat, NULL, N);
        op->rmsnorm(be, fs->tmp, fs->tmp, W(G3_POST_ATTN_NORM)->vec, N, C, eps);
        op->add(be, fs->x, fs->tmp, (size_t)N * C);

        /* MLP block: x = x + norm(down(gelu_tanh(gate) * up)) */
        op->rmsnorm(be, fs->xb, fs->x, W(G3_PRE_FF_NORM)->vec, N, C, eps);
        op->matmul(be, fs->hb, fs->xb, W(G3_GATE)->mat, NULL, N);
        op->matmul(be, fs->hb2, fs->xb, W(G3_UP)->mat, NULL, N);
        op->geglu(be, fs->hb, fs->hb, fs->hb2, (size_t)N * FF);
        op->matmul(be, fs->tmp, fs->hb, W(G3_DOWN)->mat, NULL, N);
        op->rmsnorm(be, fs->tmp, fs->tmp, W(G3_POST_FF_NORM)->vec, N, C, eps);
        op->add(be, fs->x, fs->tmp, (size_t)N * C);
#undef W
    }
    kiln_forward_logits(m, be, fs, N, out, n_out, logits);
}

const kiln_arch_desc kiln_arch_gemma3 = {
    .id = KILN_ARCH_GEMMA3,
    .name = "gemma3",
    .hf_model_type = "gemma3_text",
    .hf_class = "Gemma3ForCausalLM",
    .always_qk_norm = true,
    .roles = gemma3_roles,
    .n_roles = G3_N,
    .first_layer_role = G3_WQ,
    .n_layer_roles = G3_N_LAYER,
    .role_embed = G3_EMBED,
    .role_final_norm = G3_NORM,
    .role_head = G3_HEAD,
    .forward = gemma3_forward,
    .gguf_config = gemma3_gguf_config,
    .uses_geglu = true,
    .sliding_windows = true,
};
