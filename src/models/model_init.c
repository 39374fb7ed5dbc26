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

void kiln_fill_normal(float *dst, int64_t n, float std, uint64_t *rng) {
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

/* A tensor for role r of layer `layer`, named as transformers names it, initialised per the
 * role, its pointer stored where the role binds it. Matrices draw from the stream in the walk's
 * order (vectors draw nothing), so a seed gives the same weights whatever vector roles come
 * between. */
static kiln_status new_role(void *ctx, const kiln_param_role *r, int layer) {
    init_ctx *c = ctx;
    const kiln_model_config *k = &c->m->cfg;
    if (!kiln_role_wanted(r, k, layer)) return KILN_OK;
    int64_t rows = kiln_dim_value(k, r->rows), cols = kiln_dim_value(k, r->cols), n = rows * cols;
    kiln_tensor *t = &c->tensors[c->n_tensors++];
    float *data = take(c, n);
    char *nm = (char *)take(c, KILN_INIT_NAME_BYTES / sizeof(float)); /* names live in the block too */
    if (!data || !nm) return kiln_error(KILN_ERR_INTERNAL, "kiln_model_create: weight block sized too small");
    if (r->init == KILN_INIT_NORMAL) kiln_fill_normal(data, n, 0.02f, &c->rng);
    else if (r->init == KILN_INIT_ONES)
        for (int64_t i = 0; i < n; i++) data[i] = 1.0f;
    /* KILN_INIT_ZEROS: the block is calloc'd (transformers zeroes Linear biases) */
    kiln_role_name(r, false, layer, nm, KILN_INIT_NAME_BYTES);
    t->name = nm;
    t->dtype = KILN_DTYPE_F32;
    t->n_dims = r->conv_taps ? 3 : r->cols == KILN_DIM_ONE ? 1 : 2;
    t->shape[0] = rows;
    t->shape[1] = r->cols == KILN_DIM_ONE || r->conv_taps ? 1 : cols;
    t->shape[2] = r->conv_taps ? cols : 1;
    t->shape[3] = 1;
    t->data = data;
    t->nbytes = (size_t)n * sizeof(float);
    kiln_wref *ref = kiln_model_ref(c->m, r, layer);
    if (kiln_role_is_vector(r)) ref->vec = data;
    else ref->mat = t;
    return KILN_OK;
}

/* Floats and tensors the walk will take: every wanted role, its name (KILN_INIT_NAME_BYTES), each
 * rounded up to 16 floats. */
static kiln_status size_role(void *ctx, const kiln_param_role *r, int layer) {
    init_ctx *c = ctx;
    (void)layer;
    if (!kiln_role_wanted(r, &c->m->cfg, layer)) return KILN_OK;
    int64_t n = kiln_dim_value(&c->m->cfg, r->rows) * kiln_dim_value(&c->m->cfg, r->cols);
    c->cap += (((size_t)n + 15) & ~(size_t)15) + KILN_INIT_NAME_BYTES / sizeof(float);
    c->cap_tensors++;
    return KILN_OK;
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
    m->arch = kiln_arch_get(m->cfg.arch);
    if (st == KILN_OK && !m->arch) st = kiln_error(KILN_ERR_INTERNAL, "kiln_model_create: architecture %d has no description", (int)m->cfg.arch);
    if (st == KILN_OK && (m->cfg.mlp_bias || (m->cfg.sliding_window && !m->arch->sliding_windows)))
        st = kiln_error(KILN_ERR_UNSUPPORTED, "kiln_model_create: MLP biases, and sliding windows outside Gemma 3, "
                                              "are not supported here");
    m->path = kiln_strdup(config);
    m->name = kiln_strdup(config);
    m->arch_name = kiln_strdup(m->arch ? m->arch->name : "?");
    if (st == KILN_OK && (!m->path || !m->name || !m->arch_name)) st = kiln_error(KILN_ERR_NOMEM, "kiln_model_create: out of memory");
    init_ctx c = {0};
    c.m = m;
    c.rng = seed;
    if (st == KILN_OK) st = kiln_arch_walk(m->arch, m->cfg.n_layer, size_role, &c);
    if (st == KILN_OK) {
        c.block = kiln_calloc(c.cap ? c.cap : 1, sizeof(float));
        c.tensors = kiln_calloc((size_t)(c.cap_tensors ? c.cap_tensors : 1), sizeof *c.tensors);
        if (!c.block || !c.tensors) st = kiln_error(KILN_ERR_NOMEM, "kiln_model_create: out of memory for weights");
    }
    if (st == KILN_OK) st = kiln_model_refs_alloc(m);
    if (st == KILN_OK) st = kiln_arch_walk(m->arch, m->cfg.n_layer, new_role, &c);
    if (st == KILN_OK) {
        m->tok_embd = m->refs[m->arch->role_embed].mat;
        m->final_norm = m->refs[m->arch->role_final_norm].vec;
        m->lm_head = m->cfg.tie_embeddings ? m->tok_embd : m->refs[m->arch->role_head].mat;
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
        m->init_bytes = (c.cap ? c.cap : 1) * sizeof(float);
        c.block = NULL;
    }
    kiln_free(c.block);
    kiln_free(c.tensors);
    if (st != KILN_OK) {
        kiln_model_destroy(m);
        return st;
    }
    KILN_TRY(kiln_model_publish(m, "kiln_model_create"));
    *out = m;
    return KILN_OK;
}
