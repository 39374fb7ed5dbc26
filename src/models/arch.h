/*
 * arch.h -- what an architecture is to kiln: a name, the names it answers to in config.json
 * and GGUF, one table of parameter roles, and its forward.
 *
 * The roles table is the only list of parameter names in kiln. Loading (GGUF and Hugging
 * Face), model creation from a config, the trainer's parameter registry and the Hugging Face
 * export all walk it (kiln_arch_walk); nothing else spells "q_proj" or "attn_q".
 *
 * A role is one tensor of the model: a per-model one (the embedding, the final norm, the
 * output head) or one per layer (its names hold a %d for the layer index). Its shape comes
 * from the config (kiln_dim); cols == KILN_DIM_ONE makes it a vector, which kiln keeps in f32
 * (norm weights, biases). A role may be conditional on a config flag (biases, q/k norms, an
 * untied head): a Hugging Face folder must then hold it exactly when the flag is set; a GGUF
 * file, which has no flags, may hold it or not, and the loader derives the flag from what it
 * finds. Where the role's weight is bound: `offset` bytes into the architecture's layer struct
 * (per-layer roles) or into struct kiln_model (per-model roles), a `const kiln_tensor *` for a
 * matrix and a `const float *` for a vector. A role that is absent is bound to NULL.
 *
 * Order: the table lists roles in transformers' named_parameters() order (per-model roles
 * before the layers, then each layer's roles, then the rest), which kiln_arch_walk expands
 * layer by layer. The trainer's parameters, checkpoints and exports follow that order.
 *
 * docs/ADDING_A_MODEL.md says how an architecture lands.
 */
#ifndef KILN_MODELS_ARCH_H
#define KILN_MODELS_ARCH_H

#include "config.h"

/* A dimension of a parameter, from the config (models/config.h's names). */
typedef enum kiln_dim {
    KILN_DIM_ONE = 0, /* 1 */
    KILN_DIM_C,       /* n_embd */
    KILN_DIM_V,       /* n_vocab */
    KILN_DIM_FF,      /* n_ff */
    KILN_DIM_HS,      /* head_dim */
    KILN_DIM_QD,      /* n_head * head_dim */
    KILN_DIM_KD,      /* n_head_kv * head_dim */
    KILN_DIM_NH,      /* n_head */
    KILN_DIM_KVH,     /* n_head_kv */
} kiln_dim;

/* When a role is part of the model (a config flag). */
typedef enum kiln_role_cond {
    KILN_COND_ALWAYS = 0,
    KILN_COND_ATTN_BIAS, /* cfg.attn_bias: q, k, v biases */
    KILN_COND_OUT_BIAS,  /* cfg.attn_out_bias: the attention output's bias */
    KILN_COND_MLP_BIAS,  /* cfg.mlp_bias */
    KILN_COND_QK_NORM,   /* cfg.qk_norm */
    KILN_COND_UNTIED,    /* !cfg.tie_embeddings: an output head of its own */
} kiln_role_cond;

/* How kiln_model_create initialises a role (transformers' _init_weights for the family). */
typedef enum kiln_role_init {
    KILN_INIT_NORMAL = 0, /* normal(0, 0.02) */
    KILN_INIT_ONES,       /* norm weights */
    KILN_INIT_ZEROS,      /* biases */
} kiln_role_init;

typedef struct kiln_param_role {
    const char *hf;        /* transformers' name ("%d": the layer) */
    const char *gguf;      /* llama.cpp's name */
    kiln_dim rows, cols;   /* cols KILN_DIM_ONE: a vector of `rows` elements */
    kiln_role_cond cond;
    kiln_role_init init;
    bool per_layer;
    bool trainable;        /* the trainer makes it a parameter (false: a buffer it only reads) */
    /* GGUF files of an architecture with gguf_qk_permuted store this role's rows permuted
     * within each of rope_heads heads (KILN_DIM_NH or KILN_DIM_KVH) for llama.cpp's
     * interleaved RoPE; the loader undoes it. KILN_DIM_ONE: not permuted. */
    kiln_dim rope_heads;
    size_t offset;         /* where the bound pointer lives (see the file comment) */
} kiln_param_role;

typedef struct kiln_arch_desc {
    kiln_arch id;
    const char *name;          /* kiln's name, GGUF's general.architecture */
    const char *hf_model_type; /* config.json "model_type" */
    const char *hf_class;      /* config.json "architectures"[0] */
    bool gguf_qk_permuted;     /* see kiln_param_role.rope_heads */
    bool always_qkv_bias;      /* every model of the architecture has q, k, v biases (Qwen2) */
    bool always_qk_norm;       /* ... q/k RMSNorms (Qwen3) */
    const kiln_param_role *roles;
    int n_roles;
    size_t layer_size;         /* bytes of one layer's weights struct (model.h) */
} kiln_arch_desc;

/* The architecture of an id, or NULL. */
const kiln_arch_desc *kiln_arch_get(kiln_arch id);
/* The architecture GGUF's general.architecture (len bytes), config.json's model_type or
 * config.json's architectures[0] names; NULL when kiln has none. */
const kiln_arch_desc *kiln_arch_by_name(const char *name, size_t len);
const kiln_arch_desc *kiln_arch_by_hf_type(const char *model_type);
const kiln_arch_desc *kiln_arch_by_hf_class(const char *cls);
/* "llama, mistral, qwen2, qwen3": for error messages. */
const char *kiln_arch_names(void);

/* The value of a dimension in config c. */
int64_t kiln_dim_value(const kiln_model_config *c, kiln_dim d);
/* Whether c's flags call for the role. */
bool kiln_role_wanted(const kiln_param_role *r, const kiln_model_config *c);
/* The role's name in layer `layer` (ignored for per-model roles): GGUF's when gguf, else
 * transformers'. */
void kiln_role_name(const kiln_param_role *r, bool gguf, int layer, char *buf, size_t cap);

/* Call fn(ctx, role, layer) for every role of a in transformers' named_parameters() order:
 * the per-model roles that come before the first per-layer one, then layer 0's roles, layer
 * 1's, ..., then the remaining per-model roles (layer -1 for per-model roles). Stops at and
 * returns fn's first error. */
typedef kiln_status (*kiln_role_fn)(void *ctx, const kiln_param_role *r, int layer);
kiln_status kiln_arch_walk(const kiln_arch_desc *a, int n_layer, kiln_role_fn fn, void *ctx);

#endif /* KILN_MODELS_ARCH_H */
