/*
 * model_load.c -- open a model (GGUF file or Hugging Face folder), fill its description and
 * bind every weight by role, checking each tensor's presence, dtype and shape.
 */
#include "model.h"

#include "../formats/hf_config.h"
#include "../tokenizer/tokenizer.h"

#include <stdio.h>
#include <string.h>

/* ---- the model's own storage: a list of chunks freed together ----------------------------- */

typedef struct kiln_model_chunk {
    struct kiln_model_chunk *next;
    /* data follows, 64-byte aligned by kiln_malloc + header padding */
} kiln_model_chunk;

#define CHUNK_HEADER 64

static void *model_alloc(kiln_model *m, size_t size) {
    size_t total;
    if (kiln_add_overflow(size, CHUNK_HEADER, &total)) return NULL;
    kiln_model_chunk *c = kiln_malloc(total);
    if (!c) return NULL;
    c->next = m->chunks;
    m->chunks = c;
    return (uint8_t *)c + CHUNK_HEADER;
}

static kiln_tensor *model_new_tensor(kiln_model *m) {
    if (m->n_owned_tensors == m->cap_owned_tensors) return NULL; /* sized up front */
    return &m->owned_tensors[m->n_owned_tensors++];
}

/* ---- tensor lookup across the two formats --------------------------------------------------- */

typedef enum weight_role {
    ROLE_TOK_EMBD,
    ROLE_OUTPUT_NORM,
    ROLE_OUTPUT,
    ROLE_ATTN_NORM,
    ROLE_WQ,
    ROLE_WK,
    ROLE_WV,
    ROLE_WO,
    ROLE_BQ,
    ROLE_BK,
    ROLE_BV,
    ROLE_BO,
    ROLE_Q_NORM,
    ROLE_K_NORM,
    ROLE_MLP_NORM,
    ROLE_GATE,
    ROLE_UP,
    ROLE_DOWN,
    ROLE_B_GATE,
    ROLE_B_UP,
    ROLE_B_DOWN,
} weight_role;

/* GGUF and Hugging Face names of each role; %d is the layer. */
static const char *const gguf_names[] = {
    [ROLE_TOK_EMBD] = "token_embd.weight",     [ROLE_OUTPUT_NORM] = "output_norm.weight",
    [ROLE_OUTPUT] = "output.weight",           [ROLE_ATTN_NORM] = "blk.%d.attn_norm.weight",
    [ROLE_WQ] = "blk.%d.attn_q.weight",        [ROLE_WK] = "blk.%d.attn_k.weight",
    [ROLE_WV] = "blk.%d.attn_v.weight",        [ROLE_WO] = "blk.%d.attn_output.weight",
    [ROLE_BQ] = "blk.%d.attn_q.bias",          [ROLE_BK] = "blk.%d.attn_k.bias",
    [ROLE_BV] = "blk.%d.attn_v.bias",          [ROLE_BO] = "blk.%d.attn_output.bias",
    [ROLE_Q_NORM] = "blk.%d.attn_q_norm.weight", [ROLE_K_NORM] = "blk.%d.attn_k_norm.weight",
    [ROLE_MLP_NORM] = "blk.%d.ffn_norm.weight", [ROLE_GATE] = "blk.%d.ffn_gate.weight",
    [ROLE_UP] = "blk.%d.ffn_up.weight",        [ROLE_DOWN] = "blk.%d.ffn_down.weight",
    [ROLE_B_GATE] = "blk.%d.ffn_gate.bias",    [ROLE_B_UP] = "blk.%d.ffn_up.bias",
    [ROLE_B_DOWN] = "blk.%d.ffn_down.bias",
};
static const char *const hf_names[] = {
    [ROLE_TOK_EMBD] = "model.embed_tokens.weight",
    [ROLE_OUTPUT_NORM] = "model.norm.weight",
    [ROLE_OUTPUT] = "lm_head.weight",
    [ROLE_ATTN_NORM] = "model.layers.%d.input_layernorm.weight",
    [ROLE_WQ] = "model.layers.%d.self_attn.q_proj.weight",
    [ROLE_WK] = "model.layers.%d.self_attn.k_proj.weight",
    [ROLE_WV] = "model.layers.%d.self_attn.v_proj.weight",
    [ROLE_WO] = "model.layers.%d.self_attn.o_proj.weight",
    [ROLE_BQ] = "model.layers.%d.self_attn.q_proj.bias",
    [ROLE_BK] = "model.layers.%d.self_attn.k_proj.bias",
    [ROLE_BV] = "model.layers.%d.self_attn.v_proj.bias",
    [ROLE_BO] = "model.layers.%d.self_attn.o_proj.bias",
    [ROLE_Q_NORM] = "model.layers.%d.self_attn.q_norm.weight",
    [ROLE_K_NORM] = "model.layers.%d.self_attn.k_norm.weight",
    [ROLE_MLP_NORM] = "model.layers.%d.post_attention_layernorm.weight",
    [ROLE_GATE] = "model.layers.%d.mlp.gate_proj.weight",
    [ROLE_UP] = "model.layers.%d.mlp.up_proj.weight",
    [ROLE_DOWN] = "model.layers.%d.mlp.down_proj.weight",
    [ROLE_B_GATE] = "model.layers.%d.mlp.gate_proj.bias",
    [ROLE_B_UP] = "model.layers.%d.mlp.up_proj.bias",
    [ROLE_B_DOWN] = "model.layers.%d.mlp.down_proj.bias",
};

static const kiln_tensor *find_role(const kiln_model *m, weight_role role, int layer,
                                    char *name_out, size_t cap) {
    const char *fmt = m->gguf ? gguf_names[role] : hf_names[role];
    snprintf(name_out, cap, fmt, layer);
    return m->gguf ? kiln_gguf_find_tensor(m->gguf, name_out) : kiln_safetensors_find(m->st, name_out);
}

static bool dtype_is_matrix_ok(kiln_dtype t) {
    return t != KILN_DTYPE_I32 && t != KILN_DTYPE_I64 && t < KILN_DTYPE_COUNT;
}

/* Bind a matrix of shape (rows, cols); required unless optional. */
static kiln_status bind_matrix(kiln_model *m, weight_role role, int layer, int64_t rows,
                               int64_t cols, int optional, const kiln_tensor **out) {
    char name[128];
    const kiln_tensor *t = find_role(m, role, layer, name, sizeof name);
    if (!t) {
        if (optional) {
            *out = NULL;
            return KILN_OK;
        }
        return kiln_error(KILN_ERR_FORMAT, "%s: missing tensor '%s'", m->path, name);
    }
    if (t->n_dims != 2 || t->shape[0] != rows || t->shape[1] != cols)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: tensor '%s' has shape (%lld, %lld) [%d dims], expected (%lld, %lld)",
                          m->path, name, (long long)t->shape[0],
                          (long long)(t->n_dims > 1 ? t->shape[1] : 0), t->n_dims,
                          (long long)rows, (long long)cols);
    if (!dtype_is_matrix_ok(t->dtype))
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: tensor '%s' has type %s, not a weight type",
                          m->path, name, kiln_dtype_name(t->dtype));
    *out = t;
    return KILN_OK;
}

/* Bind a vector of n elements, widened to f32 (optional ones may be absent -> NULL). */
static kiln_status bind_vector(kiln_model *m, weight_role role, int layer, int64_t n,
                               int optional, const float **out) {
    char name[128];
    const kiln_tensor *t = find_role(m, role, layer, name, sizeof name);
    if (!t) {
        if (optional) {
            *out = NULL;
            return KILN_OK;
        }
        return kiln_error(KILN_ERR_FORMAT, "%s: missing tensor '%s'", m->path, name);
    }
    if (t->n_dims != 1 || t->shape[0] != n)
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s' has %lld elements [%d dims], expected (%lld)",
                          m->path, name, (long long)kiln_tensor_nelements(t), t->n_dims,
                          (long long)n);
    if (t->dtype != KILN_DTYPE_F32 && t->dtype != KILN_DTYPE_F16 && t->dtype != KILN_DTYPE_BF16)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: vector '%s' has type %s (f32/f16/bf16 expected)",
                          m->path, name, kiln_dtype_name(t->dtype));
    if (t->dtype == KILN_DTYPE_F32 && ((uintptr_t)t->data % sizeof(float)) == 0) {
        *out = t->data;
        return KILN_OK;
    }
    float *v = model_alloc(m, (size_t)n * sizeof(float));
    if (!v) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory converting '%s'", m->path, name);
    kiln_dequantize(t->dtype, t->data, v, n);
    *out = v;
    return KILN_OK;
}

/* GGUF files of architecture "llama" store Q and K rows permuted for llama.cpp's interleaved
 * RoPE (convert_hf_to_gguf's permute): within each head, HF row h*(HS/2)+i (half h, index i)
 * sits at GGUF row 2i+h. Undo it, row by row (whole quantized rows move, so any dtype works). */
static kiln_status unpermute_rows(kiln_model *m, const kiln_tensor **pt, int n_heads) {
    const kiln_tensor *t = *pt;
    int64_t rows = t->shape[0];
    int64_t hs = rows / n_heads;
    if (hs * n_heads != rows || hs % 2)
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': %lld rows do not split into %d heads of even size",
                          m->path, t->name, (long long)rows, n_heads);
    size_t row_bytes = t->nbytes / (size_t)rows;
    kiln_tensor *nt = model_new_tensor(m);
    if (!nt) return kiln_error(KILN_ERR_INTERNAL, "%s: owned tensor table full", m->path);
    uint8_t *data = model_alloc(m, t->nbytes);
    if (!data) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory re-laying '%s'", m->path, t->name);
    *nt = *t;
    const uint8_t *src = t->data;
    for (int h = 0; h < n_heads; h++)
        for (int64_t half = 0; half < 2; half++)
            for (int64_t i = 0; i < hs / 2; i++) {
                int64_t dst_row = h * hs + half * (hs / 2) + i;
                int64_t src_row = h * hs + 2 * i + half;
                memcpy(data + dst_row * row_bytes, src + src_row * row_bytes, row_bytes);
            }
    nt->data = data;
    *pt = nt;
    return KILN_OK;
}

static kiln_status unpermute_vector(kiln_model *m, const float **pv, int64_t n, int n_heads) {
    int64_t hs = n / n_heads;
    float *v = model_alloc(m, (size_t)n * sizeof(float));
    if (!v) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", m->path);
    for (int h = 0; h < n_heads; h++)
        for (int64_t half = 0; half < 2; half++)
            for (int64_t i = 0; i < hs / 2; i++) v[h * hs + half * (hs / 2) + i] = (*pv)[h * hs + 2 * i + half];
    *pv = v;
    return KILN_OK;
}

/* With KILN_WEIGHTS_F32, replace a matrix by its f32 dequantization. */
static kiln_status widen_matrix(kiln_model *m, const kiln_tensor **pt) {
    const kiln_tensor *t = *pt;
    if (t->dtype == KILN_DTYPE_F32) return KILN_OK;
    int64_t n = kiln_tensor_nelements(t);
    kiln_tensor *nt = model_new_tensor(m);
    if (!nt) return kiln_error(KILN_ERR_INTERNAL, "%s: owned tensor table full", m->path);
    float *data = model_alloc(m, (size_t)n * sizeof(float));
    if (!data) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory dequantizing '%s'", m->path, t->name);
    kiln_dequantize(t->dtype, t->data, data, n);
    *nt = *t;
    nt->dtype = KILN_DTYPE_F32;
    nt->data = data;
    nt->nbytes = (size_t)n * sizeof(float);
    *pt = nt;
    return KILN_OK;
}

/* ---- configuration from GGUF metadata ------------------------------------------------------ */

static kiln_status gguf_key(char *buf, size_t cap, const char *arch, const char *suffix) {
    snprintf(buf, cap, "%s.%s", arch, suffix);
    return KILN_OK;
}

static kiln_status gguf_req_u32(const kiln_gguf *g, const char *path, const char *arch,
                                const char *suffix, int *out) {
    char key[128];
    gguf_key(key, sizeof key, arch, suffix);
    uint32_t v;
    int found = 0;
    KILN_TRY(kiln_gguf_get_u32(g, key, &v, &found));
    if (!found) return kiln_error(KILN_ERR_FORMAT, "%s: missing metadata key '%s'", path, key);
    if (v > (1u << 30)) return kiln_error(KILN_ERR_FORMAT, "%s: metadata '%s' = %u is out of range", path, key, v);
    *out = (int)v;
    return KILN_OK;
}

static kiln_status config_from_gguf(kiln_model *m) {
    const kiln_gguf *g = m->gguf;
    kiln_model_config *c = &m->cfg;
    memset(c, 0, sizeof *c);
    kiln_gguf_str s;
    int found = 0;
    KILN_TRY(kiln_gguf_get_str(g, "general.architecture", &s, &found));
    if (!found) return kiln_error(KILN_ERR_FORMAT, "%s: missing metadata key 'general.architecture'", m->path);
    m->arch_name = kiln_strndup(s.ptr, (size_t)s.len);
    if (!m->arch_name) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", m->path);
    const char *arch = m->arch_name;
    if (!strcmp(arch, "llama")) c->arch = KILN_ARCH_LLAMA;
    else if (!strcmp(arch, "mistral")) c->arch = KILN_ARCH_MISTRAL;
    else if (!strcmp(arch, "qwen2")) c->arch = KILN_ARCH_QWEN2;
    else if (!strcmp(arch, "qwen3")) c->arch = KILN_ARCH_QWEN3;
    else
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "%s: architecture '%s' is not supported (llama, mistral, qwen2, qwen3)",
                          m->path, arch);
    KILN_TRY(kiln_gguf_get_str(g, "general.name", &s, &found));
    if (found) m->name = kiln_strndup(s.ptr, (size_t)s.len);

    KILN_TRY(gguf_req_u32(g, m->path, arch, "block_count", &c->n_layer));
    KILN_TRY(gguf_req_u32(g, m->path, arch, "embedding_length", &c->n_embd));
    KILN_TRY(gguf_req_u32(g, m->path, arch, "feed_forward_length", &c->n_ff));
    KILN_TRY(gguf_req_u32(g, m->path, arch, "attention.head_count", &c->n_head));
    c->n_head_kv = c->n_head;
    char key[128];
    uint32_t u;
    gguf_key(key, sizeof key, arch, "attention.head_count_kv");
    KILN_TRY(kiln_gguf_get_u32(g, key, &u, &found));
    if (found) c->n_head_kv = (int)u;
    c->head_dim = c->n_head > 0 ? c->n_embd / c->n_head : 0;
    gguf_key(key, sizeof key, arch, "attention.key_length");
    KILN_TRY(kiln_gguf_get_u32(g, key, &u, &found));
    if (found) c->head_dim = (int)u;
    c->n_ctx_train = 4096;
    gguf_key(key, sizeof key, arch, "context_length");
    KILN_TRY(kiln_gguf_get_u32(g, key, &u, &found));
    if (found) c->n_ctx_train = (int)u;
    c->rms_eps = 1e-6f;
    gguf_key(key, sizeof key, arch, "attention.layer_norm_rms_epsilon");
    KILN_TRY(kiln_gguf_get_f32(g, key, &c->rms_eps, &found));
    c->rope_theta = 10000.0f;
    gguf_key(key, sizeof key, arch, "rope.freq_base");
    KILN_TRY(kiln_gguf_get_f32(g, key, &c->rope_theta, &found));
    gguf_key(key, sizeof key, arch, "rope.scaling.type");
    KILN_TRY(kiln_gguf_get_str(g, key, &s, &found));
    if (found && !(s.len == 4 && !memcmp(s.ptr, "none", 4))) {
        if (s.len == 6 && !memcmp(s.ptr, "linear", 6)) {
            c->rope_scaling = KILN_ROPE_SCALING_LINEAR;
            gguf_key(key, sizeof key, arch, "rope.scaling.factor");
            KILN_TRY(kiln_gguf_get_f32(g, key, &c->rope_factor, &found));
            if (!found || !(c->rope_factor > 0))
                return kiln_error(KILN_ERR_FORMAT, "%s: linear rope scaling without a positive '%s'", m->path, key);
        } else {
            return kiln_error(KILN_ERR_UNSUPPORTED, "%s: rope scaling type '%.*s' is not supported",
                              m->path, (int)(s.len > 64 ? 64 : s.len), s.ptr);
        }
    }
    c->bos_id = c->eos_id = -1;
    return KILN_OK;
}

/* ---- binding -------------------------------------------------------------------------------- */

static kiln_status bind_weights(kiln_model *m) {
    const kiln_model_config *c = &m->cfg;
    int64_t C = c->n_embd, V = c->n_vocab, FF = c->n_ff, HS = c->head_dim;
    int64_t QD = (int64_t)c->n_head * HS, KD = (int64_t)c->n_head_kv * HS;
    int permuted = m->gguf && (c->arch == KILN_ARCH_LLAMA || c->arch == KILN_ARCH_MISTRAL);
    int widen = m->params.weight_mode == KILN_WEIGHTS_F32;

    KILN_TRY(bind_matrix(m, ROLE_TOK_EMBD, 0, V, C, 0, &m->tok_embd));
    KILN_TRY(bind_vector(m, ROLE_OUTPUT_NORM, 0, C, 0, &m->final_norm));
    KILN_TRY(bind_matrix(m, ROLE_OUTPUT, 0, V, C, 1, &m->lm_head));
    if (!m->lm_head && m->st && !c->tie_embeddings)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: config.json has tie_word_embeddings false (or absent, which means false) but the "
                          "weights have no lm_head.weight: the output layer is missing (set "
                          "tie_word_embeddings to true if the model shares it with embed_tokens)",
                          m->path);
    if (!m->lm_head) {
        m->lm_head = m->tok_embd;
        m->cfg.tie_embeddings = 1;
    } else if (m->st) {
        m->cfg.tie_embeddings = 0;
    }
    if (widen) {
        KILN_TRY(widen_matrix(m, &m->tok_embd));
        if (m->cfg.tie_embeddings) m->lm_head = m->tok_embd;
        else KILN_TRY(widen_matrix(m, &m->lm_head));
    }
    m->layers = kiln_calloc((size_t)c->n_layer, sizeof *m->layers);
    if (!m->layers) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", m->path);
    int need_bias = c->arch == KILN_ARCH_QWEN2 || c->attn_bias;
    for (int l = 0; l < c->n_layer; l++) {
        kiln_layer_weights *w = &m->layers[l];
        KILN_TRY(bind_vector(m, ROLE_ATTN_NORM, l, C, 0, &w->attn_norm));
        KILN_TRY(bind_matrix(m, ROLE_WQ, l, QD, C, 0, &w->wq));
        KILN_TRY(bind_matrix(m, ROLE_WK, l, KD, C, 0, &w->wk));
        KILN_TRY(bind_matrix(m, ROLE_WV, l, KD, C, 0, &w->wv));
        KILN_TRY(bind_matrix(m, ROLE_WO, l, C, QD, 0, &w->wo));
        /* Biases: required where the config says so (HF); GGUF has no flag, so optional. */
        int bias_optional = m->gguf ? 1 : !need_bias;
        KILN_TRY(bind_vector(m, ROLE_BQ, l, QD, bias_optional, &w->bq));
        KILN_TRY(bind_vector(m, ROLE_BK, l, KD, bias_optional, &w->bk));
        KILN_TRY(bind_vector(m, ROLE_BV, l, KD, bias_optional, &w->bv));
        KILN_TRY(bind_vector(m, ROLE_BO, l, C, m->gguf ? 1 : !c->attn_out_bias, &w->bo));
        int qk_optional = m->gguf ? 1 : !c->qk_norm;
        KILN_TRY(bind_vector(m, ROLE_Q_NORM, l, HS, qk_optional, &w->q_norm));
        KILN_TRY(bind_vector(m, ROLE_K_NORM, l, HS, qk_optional, &w->k_norm));
        if (c->arch == KILN_ARCH_QWEN3 && (!w->q_norm || !w->k_norm))
            return kiln_error(KILN_ERR_FORMAT, "%s: qwen3 layer %d lacks q/k norm weights", m->path, l);
        KILN_TRY(bind_vector(m, ROLE_MLP_NORM, l, C, 0, &w->mlp_norm));
        KILN_TRY(bind_matrix(m, ROLE_GATE, l, FF, C, 0, &w->w_gate));
        KILN_TRY(bind_matrix(m, ROLE_UP, l, FF, C, 0, &w->w_up));
        KILN_TRY(bind_matrix(m, ROLE_DOWN, l, C, FF, 0, &w->w_down));
        int mlp_optional = m->gguf ? 1 : !c->mlp_bias;
        KILN_TRY(bind_vector(m, ROLE_B_GATE, l, FF, mlp_optional, &w->b_gate));
        KILN_TRY(bind_vector(m, ROLE_B_UP, l, FF, mlp_optional, &w->b_up));
        KILN_TRY(bind_vector(m, ROLE_B_DOWN, l, C, mlp_optional, &w->b_down));
        if (permuted) {
            KILN_TRY(unpermute_rows(m, &w->wq, c->n_head));
            KILN_TRY(unpermute_rows(m, &w->wk, c->n_head_kv));
            if (w->bq) KILN_TRY(unpermute_vector(m, &w->bq, QD, c->n_head));
            if (w->bk) KILN_TRY(unpermute_vector(m, &w->bk, KD, c->n_head_kv));
        }
        if (widen) {
            KILN_TRY(widen_matrix(m, &w->wq));
            KILN_TRY(widen_matrix(m, &w->wk));
            KILN_TRY(widen_matrix(m, &w->wv));
            KILN_TRY(widen_matrix(m, &w->wo));
            KILN_TRY(widen_matrix(m, &w->w_gate));
            KILN_TRY(widen_matrix(m, &w->w_up));
            KILN_TRY(widen_matrix(m, &w->w_down));
        }
    }
    /* Llama 3.1-style GGUFs carry the frequency factors as a tensor. */
    if (m->gguf) {
        const kiln_tensor *rf = kiln_gguf_find_tensor(m->gguf, "rope_freqs.weight");
        if (rf) {
            if (rf->n_dims != 1 || rf->shape[0] != HS / 2 || rf->dtype != KILN_DTYPE_F32)
                return kiln_error(KILN_ERR_FORMAT, "%s: tensor 'rope_freqs.weight' must be f32 (%lld)",
                                  m->path, (long long)(HS / 2));
            m->rope_freq_factors = rf->data;
        }
    }
    return KILN_OK;
}

/* Tensors a model file holds, for the listing and the parameter count. */
static kiln_status list_file_tensors(kiln_model *m) {
    int64_t n = m->gguf ? kiln_gguf_n_tensors(m->gguf) : kiln_safetensors_n_tensors(m->st);
    if (n > (1 << 24)) return kiln_error(KILN_ERR_FORMAT, "%s: too many tensors", m->path);
    m->file_tensors = kiln_calloc((size_t)(n ? n : 1), sizeof *m->file_tensors);
    if (!m->file_tensors) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", m->path);
    m->n_file_tensors = (int)n;
    for (int64_t i = 0; i < n; i++) {
        const kiln_tensor *t = m->gguf ? kiln_gguf_tensor_at(m->gguf, i) : kiln_safetensors_tensor_at(m->st, i);
        m->file_tensors[i] = t;
        if (strcmp(t->name, "rope_freqs.weight") != 0) m->n_params += (uint64_t)kiln_tensor_nelements(t);
        m->weight_bytes += t->nbytes;
    }
    return KILN_OK;
}

static const char *arch_name_of(kiln_arch a) {
    switch (a) {
    case KILN_ARCH_LLAMA: return "llama";
    case KILN_ARCH_MISTRAL: return "mistral";
    case KILN_ARCH_QWEN2: return "qwen2";
    case KILN_ARCH_QWEN3: return "qwen3";
    }
    return "?";
}

static kiln_status model_open_gguf(kiln_model *m) {
    KILN_TRY(kiln_gguf_open(m->path, m->params.use_mmap, &m->gguf));
    KILN_TRY(config_from_gguf(m));
    KILN_TRY(kiln_tokenizer_from_gguf(m->gguf, &m->tok));
    const kiln_tensor *emb = kiln_gguf_find_tensor(m->gguf, "token_embd.weight");
    if (!emb || emb->n_dims != 2)
        return kiln_error(KILN_ERR_FORMAT, "%s: missing 2-d tensor 'token_embd.weight'", m->path);
    m->cfg.n_vocab = (int)emb->shape[0];
    char key[128];
    uint32_t u;
    int found = 0;
    gguf_key(key, sizeof key, m->arch_name, "vocab_size");
    KILN_TRY(kiln_gguf_get_u32(m->gguf, key, &u, &found));
    if (found && (int64_t)u != emb->shape[0])
        return kiln_error(KILN_ERR_FORMAT, "%s: '%s' = %u but token_embd.weight has %lld rows", m->path,
                          key, u, (long long)emb->shape[0]);
    return KILN_OK;
}

/* The last component of a path, without trailing slashes. */
static char *basename_dup(const char *path) {
    size_t end = strlen(path);
    while (end > 1 && path[end - 1] == '/') end--;
    size_t start = end;
    while (start > 0 && path[start - 1] != '/') start--;
    return kiln_strndup(path + start, end - start);
}

static kiln_status model_open_hf(kiln_model *m) {
    KILN_TRY(kiln_hf_config_load_dir(m->path, &m->cfg));
    m->arch_name = kiln_strdup(arch_name_of(m->cfg.arch));
    m->name = basename_dup(m->path);
    if (!m->arch_name || !m->name) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", m->path);
    KILN_TRY(kiln_safetensors_open_dir(m->path, m->params.use_mmap, &m->st));
    KILN_TRY(kiln_tokenizer_from_hf_dir(m->path, &m->tok));
    return KILN_OK;
}

kiln_model_params kiln_model_default_params(void) {
    kiln_model_params p = {0};
    p.n_threads = 0;
    p.weight_mode = KILN_WEIGHTS_AUTO;
    p.use_mmap = 1;
    return p;
}

kiln_status kiln_model_open(const char *path, const kiln_model_params *params, kiln_model **out) {
    if (!path || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_model_open: path and out must be set");
    kiln_model_params p = params ? *params : kiln_model_default_params();
    if (p.weight_mode != KILN_WEIGHTS_AUTO && p.weight_mode != KILN_WEIGHTS_F32)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_model_open: weight_mode %d is not valid", (int)p.weight_mode);
    kiln_model *m = kiln_calloc(1, sizeof *m);
    if (!m) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", path);
    m->params = p;
    m->path = kiln_strdup(path);
    kiln_status st = m->path ? KILN_OK : kiln_error(KILN_ERR_NOMEM, "%s: out of memory", path);
    if (st == KILN_OK) {
        if (kiln_path_is_dir(path)) st = model_open_hf(m);
        else if ((st = kiln_path_check_file(path)) == KILN_OK) st = model_open_gguf(m);
    }
    if (st == KILN_OK) st = kiln_model_config_validate(&m->cfg, path);
    if (st == KILN_OK && kiln_tokenizer_n_vocab(m->tok) > m->cfg.n_vocab)
        st = kiln_error(KILN_ERR_FORMAT, "%s: tokenizer has %d tokens but the embedding only %d rows",
                        path, kiln_tokenizer_n_vocab(m->tok), m->cfg.n_vocab);
    if (st == KILN_OK) {
        /* per layer: 2 re-laid (Q, K) and 7 widened matrices; plus the two embeddings */
        m->cap_owned_tensors = 9 * m->cfg.n_layer + 2;
        m->owned_tensors = kiln_calloc((size_t)m->cap_owned_tensors, sizeof *m->owned_tensors);
        if (!m->owned_tensors) st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory", path);
    }
    if (st == KILN_OK) st = bind_weights(m);
    if (st == KILN_OK) st = list_file_tensors(m);
    if (st != KILN_OK) {
        kiln_model_close(m);
        return st;
    }
    *out = m;
    return KILN_OK;
}

void kiln_model_close(kiln_model *m) {
    if (!m) return;
    kiln_tokenizer_free(m->tok);
    kiln_gguf_close(m->gguf);
    kiln_safetensors_close(m->st);
    for (kiln_model_chunk *c = m->chunks; c;) {
        kiln_model_chunk *next = c->next;
        kiln_free(c);
        c = next;
    }
    kiln_free(m->owned_tensors);
    kiln_free(m->init_block);
    kiln_free(m->layers);
    kiln_free(m->file_tensors);
    kiln_free(m->arch_name);
    kiln_free(m->name);
    kiln_free(m->path);
    kiln_free(m);
}

kiln_status kiln_model_get_info(const kiln_model *m, kiln_model_info *out) {
    if (!m || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_model_get_info: NULL argument");
    const kiln_model_config *c = &m->cfg;
    kiln_model_info i = {0};
    i.architecture = m->arch_name;
    i.name = m->name ? m->name : "";
    i.n_layer = c->n_layer;
    i.n_embd = c->n_embd;
    i.n_head = c->n_head;
    i.n_head_kv = c->n_head_kv;
    i.head_dim = c->head_dim;
    i.n_ff = c->n_ff;
    i.n_vocab = c->n_vocab;
    i.n_ctx_train = c->n_ctx_train;
    i.rms_norm_eps = c->rms_eps;
    i.rope_theta = c->rope_theta;
    i.tied_embeddings = c->tie_embeddings;
    i.attn_bias = m->layers && m->layers[0].bq != NULL;
    i.qk_norm = m->layers && m->layers[0].q_norm != NULL;
    i.n_params = m->n_params;
    i.weight_bytes = m->weight_bytes;
    i.n_tensors = m->n_file_tensors;
    *out = i;
    return KILN_OK;
}

kiln_status kiln_model_get_tensor_info(const kiln_model *m, int i, kiln_tensor_info *out) {
    if (!m || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_model_get_tensor_info: NULL argument");
    if (i < 0 || i >= m->n_file_tensors)
        return kiln_error(KILN_ERR_RANGE, "kiln_model_get_tensor_info: index %d not in [0, %d)", i,
                          m->n_file_tensors);
    const kiln_tensor *t = m->file_tensors[i];
    out->name = t->name;
    out->dtype = t->dtype;
    out->n_dims = t->n_dims;
    for (int d = 0; d < 4; d++) out->shape[d] = d < t->n_dims ? t->shape[d] : 1;
    return KILN_OK;
}

const kiln_tokenizer *kiln_model_get_tokenizer(const kiln_model *m) { return m ? m->tok : NULL; }
