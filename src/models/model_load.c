/*
 * model_load.c -- open a model (GGUF file or Hugging Face folder), fill its description and
 * bind every weight by role, checking each tensor's presence, dtype and shape.
 */
#include "model.h"

#include "../formats/hf_config.h"
#include "../tokenizer/tokenizer.h"

#include <stddef.h>
#include <stdint.h>
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

/* ---- binding one role ---------------------------------------------------------------------- */

kiln_status kiln_model_refs_alloc(kiln_model *m) {
    const kiln_arch_desc *a = m->arch;
    m->refs = kiln_calloc((size_t)a->n_roles, sizeof *m->refs);
    m->layer_refs = kiln_calloc((size_t)m->cfg.n_layer * (size_t)a->n_layer_roles + 1, sizeof *m->layer_refs);
    if (!m->refs || !m->layer_refs) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory for the weight table", m->path);
    return KILN_OK;
}

static bool dtype_is_matrix_ok(kiln_dtype t) {
    return t != KILN_DTYPE_I32 && t != KILN_DTYPE_I64 && t < KILN_DTYPE_COUNT;
}

/* A tensor by name. A Hugging Face folder of a multimodal model (Qwen3.5's released ones)
 * holds the text model's "model.X" as "model.language_model.X": tried second. */
const kiln_tensor *kiln_model_file_tensor(const kiln_model *m, const char *name) {
    if (m->gguf) return kiln_gguf_find_tensor(m->gguf, name);
    if (!m->st) return NULL; /* a model made by kiln_model_create */
    const kiln_tensor *t = kiln_safetensors_find(m->st, name);
    if (!t && !strncmp(name, "model.", 6)) {
        char alt[192];
        if (snprintf(alt, sizeof alt, "model.language_model.%s", name + 6) < (int)sizeof alt)
            t = kiln_safetensors_find(m->st, alt);
    }
    return t;
}

/* Bind a matrix of shape (rows, cols); required unless optional. */
static kiln_status bind_matrix(kiln_model *m, const char *name, int64_t rows, int64_t cols, int optional,
                               const kiln_tensor **out) {
    const kiln_tensor *t = kiln_model_file_tensor(m, name);
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

/* Bind a vector of n elements, widened to f32 (optional ones may be absent -> NULL); taps > 0:
 * a convolution's (n / taps, 1, taps) taps. */
static kiln_status bind_vector(kiln_model *m, const char *name, int64_t n, int64_t taps, int optional, int plus_one,
                               const float **out) {
    const kiln_tensor *t = kiln_model_file_tensor(m, name);
    if (!t) {
        if (optional) {
            *out = NULL;
            return KILN_OK;
        }
        return kiln_error(KILN_ERR_FORMAT, "%s: missing tensor '%s'", m->path, name);
    }
    if (taps > 0 && (t->n_dims != 3 || t->shape[0] != n / taps || t->shape[1] != 1 || t->shape[2] != taps))
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s' has %lld elements [%d dims], expected (%lld, 1, %lld)",
                          m->path, name, (long long)kiln_tensor_nelements(t), t->n_dims, (long long)(n / taps),
                          (long long)taps);
    if (taps <= 0 && (t->n_dims != 1 || t->shape[0] != n))
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s' has %lld elements [%d dims], expected (%lld)",
                          m->path, name, (long long)kiln_tensor_nelements(t), t->n_dims,
                          (long long)n);
    if (t->dtype != KILN_DTYPE_F32 && t->dtype != KILN_DTYPE_F16 && t->dtype != KILN_DTYPE_BF16)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: vector '%s' has type %s (f32/f16/bf16 expected)",
                          m->path, name, kiln_dtype_name(t->dtype));
    if (t->dtype == KILN_DTYPE_F32 && ((uintptr_t)t->data % sizeof(float)) == 0 && !plus_one) {
        *out = t->data;
        return KILN_OK;
    }
    float *v = model_alloc(m, (size_t)n * sizeof(float));
    if (!v) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory converting '%s'", m->path, name);
    kiln_dequantize(t->dtype, t->data, v, n);
    /* the multiplier 1 + w, rounded once in f32 as transformers' (1.0 + w.float()) */
    if (plus_one)
        for (int64_t i = 0; i < n; i++) v[i] = 1.0f + v[i];
    *out = v;
    return KILN_OK;
}

kiln_status kiln_model_vector_param(kiln_model *m, const kiln_param_role *r, int layer, float *dst, int64_t n) {
    const kiln_wref *ref = kiln_model_ref(m, r, layer);
    if (!ref->vec) return kiln_error(KILN_ERR_STATE, "kiln_model_vector_param: role '%s' is not a bound vector", r->hf);
    if (!r->plus_one) {
        memcpy(dst, ref->vec, (size_t)n * sizeof(float));
        return KILN_OK;
    }
    if (m->st) { /* a Hugging Face folder: its w (bind_vector checked the tensor) */
        char name[128];
        kiln_role_name(r, false, layer, name, sizeof name);
        const kiln_tensor *t = kiln_model_file_tensor(m, name);
        if (t && kiln_tensor_nelements(t) == n) {
            kiln_dequantize(t->dtype, t->data, dst, n);
            return KILN_OK;
        }
    }
    for (int64_t i = 0; i < n; i++) dst[i] = ref->vec[i] - 1.0f;
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
    m->arch = kiln_arch_by_name(s.ptr, (size_t)s.len);
    if (!m->arch)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: architecture '%s' is not supported (%s)", m->path, arch,
                          kiln_arch_names());
    c->arch = m->arch->id;
    c->attn_bias = m->arch->always_qkv_bias;
    c->qk_norm = m->arch->always_qk_norm;
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
    if (m->arch->gguf_config) KILN_TRY(m->arch->gguf_config(g, m->path, c));
    return KILN_OK;
}

/* ---- binding -------------------------------------------------------------------------------- */

/* Bind one role (arch.h) of layer `layer`. A role the config calls for is required (the
 * output head: see bind_weights); any other is bound when the file holds it. GGUF q/k rows of
 * a permuting architecture are re-laid; KILN_WEIGHTS_F32 widens every matrix. */
static kiln_status bind_role(void *ctx, const kiln_param_role *r, int layer) {
    kiln_model *m = ctx;
    const kiln_model_config *c = &m->cfg;
    char name[128];
    kiln_role_name(r, m->gguf != NULL, layer, name, sizeof name);
    const bool wanted = kiln_role_wanted(r, c, layer);
    if (!wanted && (r->cond == KILN_COND_LINEAR || r->cond == KILN_COND_FULL))
        return KILN_OK; /* the other kind of layer's: not bound, whatever the file holds */
    int optional = !wanted || r->cond == KILN_COND_UNTIED;
    int64_t rows = kiln_dim_value(c, r->rows);
    kiln_wref *ref = kiln_model_ref(m, r, layer);
    int permute = m->gguf && m->arch->gguf_qk_permuted && r->rope_heads != KILN_DIM_ONE;
    int heads = (int)kiln_dim_value(c, r->rope_heads);
    if (kiln_role_is_vector(r)) {
        const float **v = &ref->vec;
        /* a GGUF stores Gemma's norm multipliers as 1 + w already */
        KILN_TRY(bind_vector(m, name, kiln_role_floats(r, c), r->conv_taps ? kiln_dim_value(c, r->cols) : 0,
                             optional, r->plus_one && !m->gguf, v));
        if (*v && permute) KILN_TRY(unpermute_vector(m, v, rows, heads));
        return KILN_OK;
    }
    const kiln_tensor **t = &ref->mat;
    KILN_TRY(bind_matrix(m, name, rows, kiln_dim_value(c, r->cols), optional, t));
    if (*t && permute) KILN_TRY(unpermute_rows(m, t, heads));
    if (*t && m->params.weight_mode == KILN_WEIGHTS_F32) KILN_TRY(widen_matrix(m, t));
    return KILN_OK;
}

/* Whether any layer binds a role of condition cond: 1 or 0; -1 when the architecture has no
 * such conditional role (the flag is then the architecture's own). */
static int any_layer_has(const kiln_model *m, kiln_role_cond cond) {
    const kiln_arch_desc *a = m->arch;
    int has_role = 0;
    for (int i = a->first_layer_role; i < a->first_layer_role + a->n_layer_roles; i++) {
        if (a->roles[i].cond != cond) continue;
        has_role = 1;
        for (int l = 0; l < m->cfg.n_layer; l++) {
            const kiln_wref *w = kiln_model_ref((kiln_model *)m, &a->roles[i], l);
            if (w->mat || w->vec) return 1;
        }
    }
    return has_role ? 0 : -1;
}

static void derive_flag(int *flag, int has) {
    if (has >= 0) *flag = has;
}

/* The per-model roles every architecture has, as the model's convenience pointers. */
static void bind_model_roles(kiln_model *m) {
    const kiln_arch_desc *a = m->arch;
    m->tok_embd = m->refs[a->role_embed].mat;
    m->final_norm = m->refs[a->role_final_norm].vec;
    m->lm_head = m->refs[a->role_head].mat;
}

static kiln_status bind_weights(kiln_model *m) {
    kiln_model_config *c = &m->cfg;
    KILN_TRY(kiln_model_refs_alloc(m));
    KILN_TRY(kiln_arch_walk(m->arch, c->n_layer, bind_role, m));
    bind_model_roles(m);
    /* The output head: a Hugging Face folder says whether it is tied; a GGUF file holds
     * output.weight or shares token_embd.weight. */
    if (!m->lm_head && m->st && !c->tie_embeddings)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: config.json has tie_word_embeddings false (or absent, which means false) but the "
                          "weights have no lm_head.weight: the output layer is missing (set "
                          "tie_word_embeddings to true if the model shares it with embed_tokens)",
                          m->path);
    c->tie_embeddings = m->lm_head == NULL;
    if (!m->lm_head) m->lm_head = m->tok_embd;
    /* The flags say what the weights hold (a GGUF file has no flags of its own). */
    derive_flag(&c->attn_bias, any_layer_has(m, KILN_COND_ATTN_BIAS));
    derive_flag(&c->attn_out_bias, any_layer_has(m, KILN_COND_OUT_BIAS));
    derive_flag(&c->mlp_bias, any_layer_has(m, KILN_COND_MLP_BIAS));
    derive_flag(&c->qk_norm, any_layer_has(m, KILN_COND_QK_NORM));
    /* Llama 3.1-style GGUFs carry the frequency factors as a tensor. */
    if (m->gguf) {
        const kiln_tensor *rf = kiln_gguf_find_tensor(m->gguf, "rope_freqs.weight");
        int64_t HS = c->head_dim;
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
    m->arch = kiln_arch_get(m->cfg.arch);
    if (!m->arch) return kiln_error(KILN_ERR_INTERNAL, "%s: architecture %d has no description", m->path, (int)m->cfg.arch);
    m->arch_name = kiln_strdup(m->arch->name);
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
        /* each matrix role may be re-laid (GGUF q/k) and widened (KILN_WEIGHTS_F32) */
        int per_model = 0, per_layer = 0;
        for (int r = 0; r < m->arch->n_roles; r++)
            if (!kiln_role_is_vector(&m->arch->roles[r])) *(m->arch->roles[r].per_layer ? &per_layer : &per_model) += 1;
        m->cap_owned_tensors = 2 * (per_model + per_layer * m->cfg.n_layer);
        m->owned_tensors = kiln_calloc((size_t)m->cap_owned_tensors, sizeof *m->owned_tensors);
        if (!m->owned_tensors) st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory", path);
    }
    if (st == KILN_OK) st = bind_weights(m);
    if (st == KILN_OK) st = list_file_tensors(m);
    if (st != KILN_OK) {
        kiln_model_destroy(m);
        return st;
    }
    KILN_TRY(kiln_model_publish(m, "kiln_model_open"));
    *out = m;
    return KILN_OK;
}

kiln_status kiln_model_publish(kiln_model *m, const char *fn) {
    kiln_status st = kiln_handle_register(&m->head, KILN_HANDLE_MODEL, fn);
    if (st != KILN_OK) {
        kiln_model_destroy(m);
        return st;
    }
    kiln_tokenizer_set_owner(m->tok, m);
    return KILN_OK;
}

/* A device backend may hold a copy of a matrix (its weight cache): drop it before the host
 * memory goes. */
static kiln_status forget_role(void *ctx, const kiln_param_role *r, int layer) {
    kiln_model *m = ctx;
    const kiln_tensor *t = kiln_model_ref(m, r, layer)->mat;
    if (t) kiln_backends_forget(t->data, t->nbytes);
    return KILN_OK;
}

void kiln_model_release_weights(kiln_model *m) {
    if (!m || (m->weights_released && !m->init_block && !m->chunks)) return; /* given back already */
    if (m->arch && m->refs && m->layer_refs) (void)kiln_arch_walk(m->arch, m->cfg.n_layer, forget_role, m);
    for (kiln_model_chunk *c = m->chunks; c;) {
        kiln_model_chunk *next = c->next;
        kiln_free(c);
        c = next;
    }
    m->chunks = NULL;
    if (m->init_block) { /* a created model's tensor names live in the block: copied out first */
        m->names = kiln_malloc((size_t)(m->n_owned_tensors ? m->n_owned_tensors : 1) * KILN_INIT_NAME_BYTES);
        for (int i = 0; m->names && i < m->n_owned_tensors; i++) {
            char *dst = m->names + (size_t)i * KILN_INIT_NAME_BYTES;
            snprintf(dst, KILN_INIT_NAME_BYTES, "%s", m->owned_tensors[i].name);
            m->owned_tensors[i].name = dst;
        }
        if (!m->names) { /* out of memory: the block stays (released in name only) */
            m->weights_released = 1;
            return;
        }
    }
    kiln_free(m->init_block);
    m->init_block = NULL;
    m->weights_released = 1;
}

void kiln_model_give_back_tensor(kiln_model *m, const kiln_tensor *t) {
    if (!m || !t || !m->init_block) return;
    const uintptr_t b = (uintptr_t)m->init_block, s = (uintptr_t)t->data, e = s + t->nbytes;
    if (s < b || e > b + m->init_bytes) return;
    m->weights_released = 1; /* partly zero from here */
    uintptr_t lo, hi;
    /* the block's own (writable) bytes where t's data lies */
    kiln_pages_give_back((uint8_t *)m->init_block + (s - b), t->nbytes, kiln_alloc_page_size(), &lo, &hi);
}

kiln_status kiln_model_weights_check(const kiln_model *m, const char *call) {
    if (m->weights_released)
        return kiln_error(KILN_ERR_STATE, "%s: the model's weights were given back after a trainer copied them "
                                          "(kiln_model_release_weights); open the model again", call);
    return KILN_OK;
}

void kiln_model_close(kiln_model *m) {
    if (!m) return;
    /* refused (m untouched, the error recorded) for a bad handle or while users remain */
    if (kiln_handle_unregister(&m->head, KILN_HANDLE_MODEL, "kiln_model_close") != KILN_OK) return;
    kiln_model_destroy(m);
}

void kiln_model_destroy(kiln_model *m) {
    if (!m) return;
    if (m->arch && m->refs && m->layer_refs) (void)kiln_arch_walk(m->arch, m->cfg.n_layer, forget_role, m);
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
    kiln_free(m->names);
    kiln_free(m->refs);
    kiln_free(m->layer_refs);
    kiln_free(m->file_tensors);
    kiln_free(m->arch_name);
    kiln_free(m->name);
    kiln_free(m->path);
    kiln_free(m);
}

kiln_status kiln_model_get_info(const kiln_model *m, kiln_model_info *out) {
    KILN_TRY(kiln_handle_check(m, KILN_HANDLE_MODEL, "kiln_model_get_info"));
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_model_get_info: out is NULL");
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
    i.attn_bias = c->attn_bias;
    i.qk_norm = c->qk_norm;
    i.n_params = m->n_params;
    i.weight_bytes = m->weight_bytes;
    i.n_tensors = m->n_file_tensors;
    *out = i;
    return KILN_OK;
}

kiln_status kiln_model_get_tensor_info(const kiln_model *m, int i, kiln_tensor_info *out) {
    KILN_TRY(kiln_handle_check(m, KILN_HANDLE_MODEL, "kiln_model_get_tensor_info"));
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_model_get_tensor_info: out is NULL");
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

const kiln_tokenizer *kiln_model_get_tokenizer(const kiln_model *m) {
    if (kiln_handle_check(m, KILN_HANDLE_MODEL, "kiln_model_get_tokenizer") != KILN_OK) return NULL;
    return m->tok;
}
