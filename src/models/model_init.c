/*
 * model_init.c -- a new model with random weights, for training from scratch: a named
 * configuration (or a config.json) plus an existing tokenizer.
 *
 * Initialization as transformers' LlamaPreTrainedModel: every matrix (embeddings included)
 * normal(0, 0.02), RMSNorm weights 1. The normal draws are Box-Muller over splitmix64(seed),
 * so a seed gives the same model everywhere.
 */
#include "../formats/hf_config.h"
#include "../tokenizer/tokenizer.h"
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

typedef struct named_config {
    const char *name, *what;
    int n_layer, n_embd, n_head, n_head_kv, n_ff, n_ctx;
} named_config;

/* Head size is n_embd / n_head. The vocabulary is the tokenizer's. */
static const named_config g_configs[] = {
    {"tiny", "2 layers x 64 wide (tests)", 2, 64, 4, 2, 176, 1024},
    {"small", "6 layers x 192 wide, ~12M parameters with a 49k vocabulary", 6, 192, 6, 2, 512, 2048},
    {"base", "12 layers x 384 wide, ~40M parameters with a 49k vocabulary", 12, 384, 6, 2, 1024, 2048},
};

static uint64_t splitmix64_next(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* n normal(0, std) floats. */
static void fill_normal(float *dst, int64_t n, float std, uint64_t *rng) {
    for (int64_t i = 0; i < n; i += 2) {
        double u1 = ((double)(splitmix64_next(rng) >> 11) + 1.0) * (1.0 / 9007199254740993.0);
        double u2 = (double)(splitmix64_next(rng) >> 11) * (1.0 / 9007199254740992.0);
        double r = sqrt(-2.0 * log(u1));
        dst[i] = (float)(r * cos(6.283185307179586 * u2) * std);
        if (i + 1 < n) dst[i + 1] = (float)(r * sin(6.283185307179586 * u2) * std);
    }
}

typedef struct init_ctx {
    kiln_model *m;
    uint64_t rng;
    float *block;
    size_t off, cap;   /* floats */
    kiln_tensor *tensors;
    int n_tensors, cap_tensors;
} init_ctx;

static float *take(init_ctx *c, int64_t n) {
    size_t k = ((size_t)n + 15) & ~(size_t)15;
    if (c->off + k > c->cap) return NULL;
    float *p = c->block + c->off;
    c->off += k;
    return p;
}

static const kiln_tensor *new_matrix(init_ctx *c, const char *name, int64_t rows, int64_t cols) {
    kiln_tensor *t = &c->tensors[c->n_tensors++];
    float *data = take(c, rows * cols);
    fill_normal(data, rows * cols, 0.02f, &c->rng);
    char *nm = (char *)take(c, 32); /* names live in the block too: 128 bytes */
    snprintf(nm, 128, "%s", name);
    t->name = nm;
    t->dtype = KILN_DTYPE_F32;
    t->n_dims = 2;
    t->shape[0] = rows;
    t->shape[1] = cols;
    t->shape[2] = t->shape[3] = 1;
    t->data = data;
    t->nbytes = (size_t)(rows * cols) * sizeof(float);
    return t;
}

static const float *new_ones(init_ctx *c, const char *name, int64_t n) {
    kiln_tensor *t = &c->tensors[c->n_tensors++];
    float *data = take(c, n);
    for (int64_t i = 0; i < n; i++) data[i] = 1.0f;
    char *nm = (char *)take(c, 32);
    snprintf(nm, 128, "%s", name);
    t->name = nm;
    t->dtype = KILN_DTYPE_F32;
    t->n_dims = 1;
    t->shape[0] = n;
    t->shape[1] = t->shape[2] = t->shape[3] = 1;
    t->data = data;
    t->nbytes = (size_t)n * sizeof(float);
    return data;
}

static kiln_status config_by_name(const char *name, kiln_model_config *c) {
    for (size_t i = 0; i < sizeof g_configs / sizeof g_configs[0]; i++) {
        const named_config *g = &g_configs[i];
        if (strcmp(name, g->name) != 0) continue;
        memset(c, 0, sizeof *c);
        c->arch = KILN_ARCH_LLAMA;
        c->n_layer = g->n_layer;
        c->n_embd = g->n_embd;
        c->n_head = g->n_head;
        c->n_head_kv = g->n_head_kv;
        c->head_dim = g->n_embd / g->n_head;
        c->n_ff = g->n_ff;
        c->n_ctx_train = g->n_ctx;
        c->rms_eps = 1e-5f;
        c->rope_theta = 10000.0f;
        c->tie_embeddings = 1;
        c->bos_id = c->eos_id = -1;
        return KILN_OK;
    }
    char known[256] = "";
    for (size_t i = 0; i < sizeof g_configs / sizeof g_configs[0]; i++) {
        strncat(known, i ? ", " : "", sizeof known - strlen(known) - 1);
        strncat(known, g_configs[i].name, sizeof known - strlen(known) - 1);
    }
    return kiln_error(KILN_ERR_INVALID_ARG, "unknown model configuration '%s' (known: %s, or a config.json path)",
                      name, known);
}

kiln_status kiln_model_create(const char *config, const char *tokenizer_path, uint64_t seed, kiln_model **out) {
    if (!config || !tokenizer_path || !out)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_model_create: config, tokenizer_path and out must be set");
    kiln_model *m = kiln_calloc(1, sizeof *m);
    if (!m) return kiln_error(KILN_ERR_NOMEM, "kiln_model_create: out of memory");
    m->params = kiln_model_default_params();
    kiln_status st = KILN_OK;
    size_t len = strlen(config);
    if (len > 5 && !strcmp(config + len - 5, ".json")) {
        char *text = NULL;
        size_t n = 0;
        st = kiln_read_text_file(config, 1 << 20, &text, &n);
        if (st == KILN_OK) st = kiln_hf_config_parse(text, n, config, &m->cfg);
        kiln_free(text);
    } else {
        st = config_by_name(config, &m->cfg);
    }
    if (st == KILN_OK) st = kiln_tokenizer_open(tokenizer_path, &m->tok);
    if (st == KILN_OK) {
        int tv = kiln_tokenizer_n_vocab(m->tok);
        if (m->cfg.n_vocab == 0) m->cfg.n_vocab = tv;
        if (tv > m->cfg.n_vocab)
            st = kiln_error(KILN_ERR_INVALID_ARG, "kiln_model_create: tokenizer has %d tokens, more than vocab_size %d",
                            tv, m->cfg.n_vocab);
    }
    if (st == KILN_OK) st = kiln_model_config_validate(&m->cfg, config);
    if (st == KILN_OK && (m->cfg.attn_out_bias || m->cfg.mlp_bias || m->cfg.sliding_window))
        st = kiln_error(KILN_ERR_UNSUPPORTED, "kiln_model_create: o_proj/MLP biases and sliding windows are not supported here");
    m->path = kiln_strdup(config);
    m->name = kiln_strdup(config);
    static const char *const arch_names[] = {"llama", "mistral", "qwen2", "qwen3"};
    m->arch_name = kiln_strdup(arch_names[m->cfg.arch]);
    if (st == KILN_OK && (!m->path || !m->name || !m->arch_name)) st = kiln_error(KILN_ERR_NOMEM, "kiln_model_create: out of memory");
    init_ctx c = {0};
    c.m = m;
    c.rng = seed;
    if (st == KILN_OK) {
        const kiln_model_config *k = &m->cfg;
        int64_t C = k->n_embd, V = k->n_vocab, FF = k->n_ff, HS = k->head_dim;
        int64_t QD = (int64_t)k->n_head * HS, KD = (int64_t)k->n_head_kv * HS;
        int qkb = k->arch == KILN_ARCH_QWEN2 || k->attn_bias, qkn = k->arch == KILN_ARCH_QWEN3 || k->qk_norm;
        /* floats: matrices, vectors, and 32 floats of name per tensor, each rounded to 16 */
        size_t per_layer = (size_t)(2 * QD * C + 2 * KD * C + 3 * FF * C + 2 * C + 2 * HS + QD + 2 * KD) + 16 * 16 + 15 * 32;
        c.cap = (size_t)(V * C * 2 + C) + (size_t)k->n_layer * per_layer + 64 * 16 + 3 * 48;
        c.cap_tensors = 15 * k->n_layer + 4;
        c.block = kiln_calloc(c.cap, sizeof(float));
        c.tensors = kiln_calloc((size_t)c.cap_tensors, sizeof *c.tensors);
        m->layers = kiln_calloc((size_t)k->n_layer, sizeof *m->layers);
        if (!c.block || !c.tensors || !m->layers) st = kiln_error(KILN_ERR_NOMEM, "kiln_model_create: out of memory for weights");
        if (st == KILN_OK) {
            char nm[128];
            m->tok_embd = new_matrix(&c, "model.embed_tokens.weight", V, C);
            for (int l = 0; l < k->n_layer; l++) {
                kiln_layer_weights *w = &m->layers[l];
#define NM(s) (snprintf(nm, sizeof nm, "model.layers.%d.%s", l, s), nm)
                w->wq = new_matrix(&c, NM("self_attn.q_proj.weight"), QD, C);
                w->wk = new_matrix(&c, NM("self_attn.k_proj.weight"), KD, C);
                w->wv = new_matrix(&c, NM("self_attn.v_proj.weight"), KD, C);
                w->wo = new_matrix(&c, NM("self_attn.o_proj.weight"), C, QD);
                if (qkb) { /* biases start at 0 (transformers zeroes Linear biases) */
                    float *b = take(&c, QD + 2 * KD);
                    w->bq = b;
                    w->bk = b + QD;
                    w->bv = b + QD + KD;
                }
                if (qkn) {
                    w->q_norm = new_ones(&c, NM("self_attn.q_norm.weight"), HS);
                    w->k_norm = new_ones(&c, NM("self_attn.k_norm.weight"), HS);
                }
                w->w_gate = new_matrix(&c, NM("mlp.gate_proj.weight"), FF, C);
                w->w_up = new_matrix(&c, NM("mlp.up_proj.weight"), FF, C);
                w->w_down = new_matrix(&c, NM("mlp.down_proj.weight"), C, FF);
                w->attn_norm = new_ones(&c, NM("input_layernorm.weight"), C);
                w->mlp_norm = new_ones(&c, NM("post_attention_layernorm.weight"), C);
#undef NM
            }
            m->final_norm = new_ones(&c, "model.norm.weight", C);
            m->lm_head = k->tie_embeddings ? m->tok_embd : new_matrix(&c, "lm_head.weight", V, C);
        }
    }
    if (st == KILN_OK) {
        /* the block and the tensor table are the model's own storage */
        m->chunks = NULL;
        m->owned_tensors = c.tensors;
        m->n_owned_tensors = m->cap_owned_tensors = c.n_tensors;
        c.tensors = NULL;
        m->file_tensors = kiln_calloc((size_t)m->n_owned_tensors, sizeof *m->file_tensors);
        if (!m->file_tensors) st = kiln_error(KILN_ERR_NOMEM, "kiln_model_create: out of memory");
        for (int i = 0; st == KILN_OK && i < m->n_owned_tensors; i++) {
            m->file_tensors[i] = &m->owned_tensors[i];
            m->n_params += (uint64_t)kiln_tensor_nelements(&m->owned_tensors[i]);
            m->weight_bytes += m->owned_tensors[i].nbytes;
        }
        m->n_file_tensors = m->n_owned_tensors;
        m->init_block = c.block;
        c.block = NULL;
    }
    kiln_free(c.block);
    kiln_free(c.tensors);
    if (st != KILN_OK) {
        kiln_model_close(m);
        return st;
    }
    *out = m;
    return KILN_OK;
}
