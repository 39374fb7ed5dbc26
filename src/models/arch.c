/*
 * arch.c -- the registry of architectures and the walk over their roles tables.
 */
#include "arch.h"

#include <stdio.h>
#include <string.h>

/* Each architecture's file defines its descriptors (llama.c: the Llama family). */
extern const kiln_arch_desc kiln_arch_llama, kiln_arch_mistral, kiln_arch_qwen2, kiln_arch_qwen3;
extern const kiln_arch_desc kiln_arch_gemma3; /* gemma3.c */
extern const kiln_arch_desc kiln_arch_qwen35; /* qwen35.c */

static const kiln_arch_desc *const g_archs[] = {
    &kiln_arch_llama,
    &kiln_arch_mistral,
    &kiln_arch_qwen2,
    &kiln_arch_qwen3,
    &kiln_arch_gemma3,
    &kiln_arch_qwen35,
};
#define N_ARCHS (sizeof g_archs / sizeof g_archs[0])

const kiln_arch_desc *kiln_arch_get(kiln_arch id) {
    for (size_t i = 0; i < N_ARCHS; i++)
        if (g_archs[i]->id == id) return g_archs[i];
    return NULL;
}

const kiln_arch_desc *kiln_arch_by_name(const char *name, size_t len) {
    for (size_t i = 0; name && i < N_ARCHS; i++)
        if (strlen(g_archs[i]->name) == len && memcmp(g_archs[i]->name, name, len) == 0) return g_archs[i];
    return NULL;
}

const kiln_arch_desc *kiln_arch_by_hf_type(const char *model_type) {
    for (size_t i = 0; model_type && i < N_ARCHS; i++)
        if (strcmp(g_archs[i]->hf_model_type, model_type) == 0) return g_archs[i];
    return NULL;
}

const kiln_arch_desc *kiln_arch_by_hf_class(const char *cls) {
    for (size_t i = 0; cls && i < N_ARCHS; i++)
        if (strcmp(g_archs[i]->hf_class, cls) == 0) return g_archs[i];
    return NULL;
}

const char *kiln_arch_names(void) {
    static char names[256];
    if (!names[0]) {
        size_t off = 0;
        for (size_t i = 0; i < N_ARCHS && off < sizeof names; i++)
            off += (size_t)snprintf(names + off, sizeof names - off, "%s%s", i ? ", " : "", g_archs[i]->name);
    }
    return names;
}

int64_t kiln_dim_value(const kiln_model_config *c, kiln_dim d) {
    switch (d) {
    case KILN_DIM_ONE: return 1;
    case KILN_DIM_C: return c->n_embd;
    case KILN_DIM_V: return c->n_vocab;
    case KILN_DIM_FF: return c->n_ff;
    case KILN_DIM_HS: return c->head_dim;
    case KILN_DIM_QD: return (int64_t)c->n_head * c->head_dim;
    case KILN_DIM_KD: return (int64_t)c->n_head_kv * c->head_dim;
    case KILN_DIM_NH: return c->n_head;
    case KILN_DIM_KVH: return c->n_head_kv;
    case KILN_DIM_QD2: return 2 * (int64_t)c->n_head * c->head_dim;
    case KILN_DIM_LCONV: return 2 * (int64_t)c->lin_nk * c->lin_dk + (int64_t)c->lin_nv * c->lin_dv;
    case KILN_DIM_LVD: return (int64_t)c->lin_nv * c->lin_dv;
    case KILN_DIM_LNV: return c->lin_nv;
    case KILN_DIM_LDV: return c->lin_dv;
    case KILN_DIM_LCK: return c->lin_conv;
    }
    return 0;
}

int64_t kiln_role_floats(const kiln_param_role *r, const kiln_model_config *c) {
    return kiln_dim_value(c, r->rows) * kiln_dim_value(c, r->cols);
}

int kiln_role_file_shape(const kiln_param_role *r, const kiln_model_config *c, int64_t shape[3]) {
    const bool matrix = !kiln_role_is_vector(r);
    shape[0] = matrix || r->conv_taps ? kiln_dim_value(c, r->rows) : kiln_role_floats(r, c);
    shape[1] = matrix ? kiln_dim_value(c, r->cols) : 1;
    shape[2] = r->conv_taps ? kiln_dim_value(c, r->cols) : 1;
    return r->conv_taps ? 3 : matrix ? 2 : 1;
}

bool kiln_role_wanted(const kiln_param_role *r, const kiln_model_config *c, int layer) {
    switch (r->cond) {
    case KILN_COND_LINEAR: return kiln_layer_linear(c, layer) != 0;
    case KILN_COND_FULL: return !kiln_layer_linear(c, layer);
    case KILN_COND_ALWAYS: return true;
    case KILN_COND_ATTN_BIAS: return c->attn_bias != 0;
    case KILN_COND_OUT_BIAS: return c->attn_out_bias != 0;
    case KILN_COND_MLP_BIAS: return c->mlp_bias != 0;
    case KILN_COND_QK_NORM: return c->qk_norm != 0;
    case KILN_COND_UNTIED: return !c->tie_embeddings;
    }
    return false;
}

void kiln_role_name(const kiln_param_role *r, bool gguf, int layer, char *buf, size_t cap) {
    const char *fmt = gguf ? r->gguf : r->hf;
    if (r->per_layer) snprintf(buf, cap, fmt, layer);
    else snprintf(buf, cap, "%s", fmt);
}

kiln_status kiln_arch_walk(const kiln_arch_desc *a, int n_layer, kiln_role_fn fn, void *ctx) {
    int first = 0, end = 0; /* the per-layer roles are [first, end) */
    while (first < a->n_roles && !a->roles[first].per_layer) first++;
    end = first;
    while (end < a->n_roles && a->roles[end].per_layer) end++;
    for (int i = 0; i < first; i++) KILN_TRY(fn(ctx, &a->roles[i], -1));
    for (int l = 0; l < n_layer; l++)
        for (int i = first; i < end; i++) KILN_TRY(fn(ctx, &a->roles[i], l));
    for (int i = end; i < a->n_roles; i++) {
        if (a->roles[i].per_layer)
            return kiln_error(KILN_ERR_INTERNAL, "architecture %s: its per-layer roles are not contiguous", a->name);
        KILN_TRY(fn(ctx, &a->roles[i], -1));
    }
    return KILN_OK;
}
