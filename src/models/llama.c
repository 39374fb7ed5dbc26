/*
 * llama.c -- the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3): its parameter
 * roles and its decoder forward pass, written with backend ops.
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
#include <stddef.h>
#include <string.h>

/* ---- parameter roles (arch.h), in transformers' named_parameters() order ---------------- */

#define LAYER(field) offsetof(kiln_layer_weights, field)
#define MODEL(field) offsetof(struct kiln_model, field)
#define HF_L "model.layers.%d."
#define GG_L "blk.%d."
static const kiln_param_role llama_roles[] = {
    /* hf, gguf, rows, cols, cond, init, per_layer, trainable, rope_heads, offset */
    {"model.embed_tokens.weight", "token_embd.weight", KILN_DIM_V, KILN_DIM_C, KILN_COND_ALWAYS,
     KILN_INIT_NORMAL, false, true, KILN_DIM_ONE, MODEL(tok_embd)},
    {HF_L "self_attn.q_proj.weight", GG_L "attn_q.weight", KILN_DIM_QD, KILN_DIM_C, KILN_COND_ALWAYS,
     KILN_INIT_NORMAL, true, true, KILN_DIM_NH, LAYER(wq)},
    {HF_L "self_attn.q_proj.bias", GG_L "attn_q.bias", KILN_DIM_QD, KILN_DIM_ONE, KILN_COND_ATTN_BIAS,
     KILN_INIT_ZEROS, true, true, KILN_DIM_NH, LAYER(bq)},
    {HF_L "self_attn.k_proj.weight", GG_L "attn_k.weight", KILN_DIM_KD, KILN_DIM_C, KILN_COND_ALWAYS,
     KILN_INIT_NORMAL, true, true, KILN_DIM_KVH, LAYER(wk)},
    {HF_L "self_attn.k_proj.bias", GG_L "attn_k.bias", KILN_DIM_KD, KILN_DIM_ONE, KILN_COND_ATTN_BIAS,
     KILN_INIT_ZEROS, true, true, KILN_DIM_KVH, LAYER(bk)},
    {HF_L "self_attn.v_proj.weight", GG_L "attn_v.weight", KILN_DIM_KD, KILN_DIM_C, KILN_COND_ALWAYS,
     KILN_INIT_NORMAL, true, true, KILN_DIM_ONE, LAYER(wv)},
    {HF_L "self_attn.v_proj.bias", GG_L "attn_v.bias", KILN_DIM_KD, KILN_DIM_ONE, KILN_COND_ATTN_BIAS,
     KILN_INIT_ZEROS, true, true, KILN_DIM_ONE, LAYER(bv)},
    {HF_L "self_attn.o_proj.weight", GG_L "attn_output.weight", KILN_DIM_C, KILN_DIM_QD, KILN_COND_ALWAYS,
     KILN_INIT_NORMAL, true, true, KILN_DIM_ONE, LAYER(wo)},
    {HF_L "self_attn.o_proj.bias", GG_L "attn_output.bias", KILN_DIM_C, KILN_DIM_ONE, KILN_COND_OUT_BIAS,
     KILN_INIT_ZEROS, true, true, KILN_DIM_ONE, LAYER(bo)},
    {HF_L "self_attn.q_norm.weight", GG_L "attn_q_norm.weight", KILN_DIM_HS, KILN_DIM_ONE, KILN_COND_QK_NORM,
     KILN_INIT_ONES, true, true, KILN_DIM_ONE, LAYER(q_norm)},
    {HF_L "self_attn.k_norm.weight", GG_L "attn_k_norm.weight", KILN_DIM_HS, KILN_DIM_ONE, KILN_COND_QK_NORM,
     KILN_INIT_ONES, true, true, KILN_DIM_ONE, LAYER(k_norm)},
    {HF_L "mlp.gate_proj.weight", GG_L "ffn_gate.weight", KILN_DIM_FF, KILN_DIM_C, KILN_COND_ALWAYS,
     KILN_INIT_NORMAL, true, true, KILN_DIM_ONE, LAYER(w_gate)},
    {HF_L "mlp.gate_proj.bias", GG_L "ffn_gate.bias", KILN_DIM_FF, KILN_DIM_ONE, KILN_COND_MLP_BIAS,
     KILN_INIT_ZEROS, true, true, KILN_DIM_ONE, LAYER(b_gate)},
    {HF_L "mlp.up_proj.weight", GG_L "ffn_up.weight", KILN_DIM_FF, KILN_DIM_C, KILN_COND_ALWAYS,
     KILN_INIT_NORMAL, true, true, KILN_DIM_ONE, LAYER(w_up)},
    {HF_L "mlp.up_proj.bias", GG_L "ffn_up.bias", KILN_DIM_FF, KILN_DIM_ONE, KILN_COND_MLP_BIAS,
     KILN_INIT_ZEROS, true, true, KILN_DIM_ONE, LAYER(b_up)},
    {HF_L "mlp.down_proj.weight", GG_L "ffn_down.weight", KILN_DIM_C, KILN_DIM_FF, KILN_COND_ALWAYS,
     KILN_INIT_NORMAL, true, true, KILN_DIM_ONE, LAYER(w_down)},
    {HF_L "mlp.down_proj.bias", GG_L "ffn_down.bias", KILN_DIM_C, KILN_DIM_ONE, KILN_COND_MLP_BIAS,
     KILN_INIT_ZEROS, true, true, KILN_DIM_ONE, LAYER(b_down)},
    {HF_L "input_layernorm.weight", GG_L "attn_norm.weight", KILN_DIM_C, KILN_DIM_ONE, KILN_COND_ALWAYS,
     KILN_INIT_ONES, true, true, KILN_DIM_ONE, LAYER(attn_norm)},
    {HF_L "post_attention_layernorm.weight", GG_L "ffn_norm.weight", KILN_DIM_C, KILN_DIM_ONE,
     KILN_COND_ALWAYS, KILN_INIT_ONES, true, true, KILN_DIM_ONE, LAYER(mlp_norm)},
    {"model.norm.weight", "output_norm.weight", KILN_DIM_C, KILN_DIM_ONE, KILN_COND_ALWAYS,
     KILN_INIT_ONES, false, true, KILN_DIM_ONE, MODEL(final_norm)},
    {"lm_head.weight", "output.weight", KILN_DIM_V, KILN_DIM_C, KILN_COND_UNTIED,
     KILN_INIT_NORMAL, false, true, KILN_DIM_ONE, MODEL(lm_head)},
};
#undef LAYER
#undef MODEL
#undef HF_L
#undef GG_L

#define LLAMA_FAMILY(id_, name_, type_, cls_, permuted_, qkv_bias_, qk_norm_)                    \
    {id_, name_, type_, cls_, permuted_, qkv_bias_, qk_norm_, llama_roles,                         \
     (int)(sizeof llama_roles / sizeof llama_roles[0]), sizeof(kiln_layer_weights)}
/* GGUF "llama" and "mistral" files store q/k rows permuted for llama.cpp's interleaved RoPE
 * (convert_hf_to_gguf's permute); "qwen2" and "qwen3" keep Hugging Face's rotate-half rows. */
const kiln_arch_desc kiln_arch_llama =
    LLAMA_FAMILY(KILN_ARCH_LLAMA, "llama", "llama", "LlamaForCausalLM", true, false, false);
const kiln_arch_desc kiln_arch_mistral =
    LLAMA_FAMILY(KILN_ARCH_MISTRAL, "mistral", "mistral", "MistralForCausalLM", true, false, false);
const kiln_arch_desc kiln_arch_qwen2 =
    LLAMA_FAMILY(KILN_ARCH_QWEN2, "qwen2", "qwen2", "Qwen2ForCausalLM", false, true, false);
const kiln_arch_desc kiln_arch_qwen3 =
    LLAMA_FAMILY(KILN_ARCH_QWEN3, "qwen3", "qwen3", "Qwen3ForCausalLM", false, false, true);

/* ---- the forward ------------------------------------------------------------------------ */

/* The forward of N tokens whose ids, positions, sequences and cache rows are in backend memory
 * (fs->d_batch, N each). runs / n_runs: the batch's runs (host memory), or NULL (each token
 * on its own, as in a recorded graph); max_T bounds every position + 1. Logits of the tokens
 * out[0..n_out) (host token indices), or of all N when out is NULL. */
static void forward(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs, int N,
                    const kiln_batch_run *runs, int n_runs, int max_T, const int32_t *out,
                    int n_out, float *logits) {
    const kiln_model_config *c = &m->cfg;
    const kiln_backend_i *op = be->i;
    int C = c->n_embd, HS = c->head_dim, NH = c->n_head, KVH = c->n_head_kv, FF = c->n_ff;
    size_t KD = (size_t)KVH * HS, pool = (size_t)fs->n_blocks * KILN_KV_BLOCK * KD;
    float eps = c->rms_eps;
    float scale = (float)(1.0 / sqrt((double)HS));
    const int32_t *ids = fs->d_batch, *pos = ids + N, *seq = ids + 2 * N, *slots = ids + 3 * N;

    op->embed(be, fs->x, m->tok_embd, ids, N);
    for (int l = 0; l < c->n_layer; l++) {
        const kiln_layer_weights *w = &fs->layers[l];
        float *k_pool = fs->k_cache + (size_t)l * pool, *v_pool = fs->v_cache + (size_t)l * pool;

        /* attention block */
        op->rmsnorm(be, fs->xb, fs->x, w->attn_norm, N, C, eps);
        op->matmul(be, fs->q, fs->xb, w->wq, w->bq, N);
        op->matmul(be, fs->k_new, fs->xb, w->wk, w->bk, N);
        op->matmul(be, fs->v_new, fs->xb, w->wv, w->bv, N);
        if (w->q_norm) op->rmsnorm(be, fs->q, fs->q, w->q_norm, N * NH, HS, eps);
        if (w->k_norm) op->rmsnorm(be, fs->k_new, fs->k_new, w->k_norm, N * KVH, HS, eps);
        op->rope(be, fs->q, pos, N, NH, HS, fs->rope_cos, fs->rope_sin);
        op->rope(be, fs->k_new, pos, N, KVH, HS, fs->rope_cos, fs->rope_sin);
        op->kv_store_rows(be, k_pool, v_pool, fs->k_new, fs->v_new, slots, N, KD);
        op->attention_paged(be, fs->att, fs->q, k_pool, v_pool, &fs->pages, seq, pos, runs, n_runs, N,
                            max_T, NH, KVH, HS, scale);
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
    op->rmsnorm(be, fs->xb, h, fs->final_norm, rows, C, eps);
    op->matmul(be, logits, fs->xb, m->lm_head, NULL, rows);
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

kiln_status kiln_model_forward(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs,
                               const kiln_batch *b, float *logits) {
    if (b->n < 1 || b->n > fs->n_batch)
        return kiln_error(KILN_ERR_RANGE, "forward: %d tokens not in [1, %d]", b->n, fs->n_batch);
    KILN_TRY(kiln_forward_stage(fs, b));
    int n_runs = batch_runs(b, fs->runs), max_T = 0;
    for (int r = 0; r < n_runs; r++)
        if (fs->runs[r].pos0 + fs->runs[r].n > max_T) max_T = fs->runs[r].pos0 + fs->runs[r].n;
    forward(m, be, fs, b->n, fs->runs, n_runs, max_T, b->out, b->out ? b->n_out : b->n, logits);
    return KILN_OK;
}

void kiln_model_forward_dev(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs, int B,
                            float *logits) {
    forward(m, be, fs, B, NULL, 0, fs->n_ctx, NULL, B, logits);
}
