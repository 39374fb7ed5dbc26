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
 * finds. A role's weight is bound in a kiln_wref (a matrix's tensor or a vector's values, and a
 * trainer's gradient): the model, a forward state's device copy and a trainer each hold one
 * array of them, per-model roles by their index in the table and per-layer roles by layer and
 * index (kiln_wref_of). A role that is absent has a kiln_wref of NULLs.
 *
 * Order: the table lists roles in transformers' named_parameters() order (per-model roles
 * before the layers, then each layer's roles, then the rest), which kiln_arch_walk expands
 * layer by layer. The trainer's parameters, checkpoints and exports follow that order.
 *
 * docs/ADDING_A_MODEL.md says how an architecture lands.
 */
#ifndef KILN_MODELS_ARCH_H
#define KILN_MODELS_ARCH_H

#include "../ops/ops.h"
#include "../formats/model_config.h"

/* A dimension of a parameter, from the config (formats/model_config.h's names). */
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
    KILN_DIM_QD2,     /* 2 * n_head * head_dim: a query and an output gate per head (Qwen3.5) */
    KILN_DIM_LCONV,   /* 2 * lin_nk * lin_dk + lin_nv * lin_dv: a linear layer's q | k | v */
    KILN_DIM_LVD,     /* lin_nv * lin_dv */
    KILN_DIM_LNV,     /* lin_nv */
    KILN_DIM_LDV,     /* lin_dv */
    KILN_DIM_LCK,     /* lin_conv: the convolution's kernel */
} kiln_dim;

/* When a role is part of the model (a config flag). */
typedef enum kiln_role_cond {
    KILN_COND_ALWAYS = 0,
    KILN_COND_ATTN_BIAS, /* cfg.attn_bias: q, k, v biases */
    KILN_COND_OUT_BIAS,  /* cfg.attn_out_bias: the attention output's bias */
    KILN_COND_MLP_BIAS,  /* cfg.mlp_bias */
    KILN_COND_QK_NORM,   /* cfg.qk_norm */
    KILN_COND_UNTIED,    /* !cfg.tie_embeddings: an output head of its own */
    KILN_COND_LINEAR,    /* a linear-attention layer's (kiln_layer_linear) */
    KILN_COND_FULL,      /* a full-attention layer's in a model that has both kinds */
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
    /* A norm weight w that the forward uses as 1 + w (Gemma): the model binds the
     * multiplier, f32(1 + w) from a Hugging Face file; a GGUF file stores 1 + w already. */
    bool plus_one;
    /* A depthwise convolution's taps (rows channels, cols taps): kept in f32 and bound as a
     * vector of rows * cols values, stored (rows, 1, cols) in Hugging Face files. */
    bool conv_taps;
} kiln_param_role;

/* Whether a role is bound as f32 values (kiln_wref.vec) rather than a matrix. */
static inline bool kiln_role_is_vector(const kiln_param_role *r) {
    return r->cols == KILN_DIM_ONE || r->conv_taps;
}

/* One parameter as a forward and a backward read it. */
typedef struct kiln_wref {
    const kiln_tensor *mat; /* a matrix role: the weights the products take; NULL: absent */
    const float *vec;       /* a vector role: f32 values in the backend's memory; NULL: absent */
    float *grad;            /* training: its gradient (backend memory, f32, added to by the
                             * backward); NULL: none (inference, or a frozen weight) */
} kiln_wref;

/* Hidden-state taps (distillation's hidden-state matching, src/train/distill.c): per layer l
 * (0-based) of a forward, the residual stream after the layer (T x C floats in backend memory;
 * the last layer's before the final norm). A NULL array or entry: no tap there. */
typedef struct kiln_taps {
    float *const *out;        /* (n_layer): after layer l's forward its output is copied to out[l] */
    const float *const *grad; /* (n_layer), training: before layer l's backward grad[l] is added to
                               * d loss / d (layer l's output). Not with the bf16 activations of
                               * the GPU's fast mode (which keep a bf16 copy of that gradient) */
} kiln_taps;

/* An architecture's layer loop calls these (no-ops without a tap at l). */
static inline void kiln_tap_out(kiln_backend *be, const kiln_taps *tp, int l, const float *x, size_t n) {
    if (!tp || !tp->out || !tp->out[l]) return;
    be->i->zero(be, tp->out[l], n);
    be->i->add(be, tp->out[l], x, n); /* +0 + x: x's bits (a -0 becomes +0) */
}
static inline void kiln_tap_grad(kiln_backend *be, const kiln_taps *tp, int l, float *dx, size_t n) {
    if (tp && tp->grad && tp->grad[l]) be->i->add(be, dx, tp->grad[l], n);
}

/* A training forward's and backward's layer events (kiln_train_io.hook). The data-parallel
 * trainer's parameter sharding (ZeRO-3, src/train/trainer_dp.c) gathers a layer's matrices
 * before its work and frees them after it, and hands a layer's gradients to the ranks that own
 * them once its backward is done. An architecture's layer loops call kiln_layer_event at each
 * point below; a layer's work reads only its own matrices between its BEGIN and END (the
 * per-model weights and every vector are the caller's to keep in place for the whole step). */
typedef enum kiln_layer_event {
    KILN_LAYER_FORWARD_BEGIN,  /* before layer l's forward work */
    KILN_LAYER_FORWARD_END,    /* after it (its tap written) */
    KILN_LAYER_BACKWARD_BEGIN, /* before layer l's backward work */
    KILN_LAYER_BACKWARD_END,   /* after it: layer l's matrices' gradients are final */
} kiln_layer_event;

typedef struct kiln_layer_hook {
    void (*fn)(void *ctx, int layer, kiln_layer_event ev);
    void *ctx;
} kiln_layer_hook;

static inline void kiln_layer_event_at(const kiln_layer_hook *h, int l, kiln_layer_event ev) {
    if (h && h->fn) h->fn(h->ctx, l, ev);
}

/* What a training forward and backward work in (kiln_arch_desc's train_* hooks). The caller
 * (the trainer) sets the fields above the line and calls train_init, which allocates the
 * activations for max_batch sequences of max_seq tokens in backend memory and fills the rest;
 * before each forward the caller writes the rows' token ids and positions into ids and pos. */
typedef struct kiln_train_io {
    kiln_backend *be;
    const struct kiln_model *model; /* the config, rope tables */
    const kiln_wref *refs;          /* per-model roles, by role index */
    const kiln_wref *layer_refs;    /* (L, n_layer_roles) */
    int max_seq, max_batch;
    int fast;                       /* the backend's fast arithmetic (bf16 activations where
                                     * the backend has the ops) */
    const kiln_taps *taps;          /* hidden-state taps of the next forward and backward, or NULL */
    const kiln_layer_hook *hook;    /* layer events of every forward and backward, or NULL */
    /* ---- filled by train_init ---- */
    int32_t *ids, *pos;             /* (T) backend memory: the rows' token ids and positions */
    float *xn;                      /* (T, C) the forward's output: the final norm's */
    float *dxn;                     /* (T, C) the backward's input: d loss / d xn */
    float *dx;                      /* (T, C) the backward's output: d loss / d embedding rows */
    size_t bytes;                   /* backend memory held */
    void *priv;                     /* the architecture's own state */
} kiln_train_io;

struct kiln_model;
struct kiln_forward_state;
struct kiln_gguf;
struct kiln_batch;

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
    int first_layer_role, n_layer_roles; /* the per-layer roles: [first, first + n) */
    int role_embed, role_final_norm, role_head; /* the per-model roles every architecture has */
    /* Generation: the forward of N tokens staged in fs->d_batch (ids, positions, sequences,
     * cache rows); runs (host, or NULL in a recorded graph) and max_T as ops.h's
     * attention_paged takes them; logits of the tokens out[0..n_out) (host indices), or of
     * all N when out is NULL, to logits (backend memory; NULL: none). */
    void (*forward)(const struct kiln_model *m, kiln_backend *be, struct kiln_forward_state *fs, int N,
                    const kiln_batch_run *runs, int n_runs, int max_T, const int32_t *out, int n_out,
                    float *logits);
    /* The architecture's own GGUF metadata beyond the family's common keys (NULL: none). */
    kiln_status (*gguf_config)(const struct kiln_gguf *g, const char *path, kiln_model_config *c);
    /* Generation's extra scratch, in floats per batch token, and its state per sequence beside
     * the KV cache (a recurrent layer's state), in floats; NULL: none. kiln_forward_state
     * allocates them (arch_scratch, seq_state), zeroed. */
    size_t (*scratch_floats)(const kiln_model_config *c);
    size_t (*state_floats)(const kiln_model_config *c);
    bool uses_geglu;      /* its MLP needs the backend's geglu op */
    bool sliding_windows; /* its forward honours cfg.sliding_window (per layer) */
    /* Training (NULL: the architecture is not trainable yet): allocate io's activations, run the forward of n_seq sequences of seq tokens
     * (io->ids, io->pos filled; output io->xn), its backward (input io->dxn; gradients added
     * to the refs' grad; output io->dx, the embedding's gradient left to the caller), free. */
    kiln_status (*train_init)(kiln_train_io *io);
    void (*train_forward)(kiln_train_io *io, int n_seq, int seq);
    void (*train_backward)(kiln_train_io *io, int n_seq, int seq);
    void (*train_free)(kiln_train_io *io);
} kiln_arch_desc;

/* The kiln_wref of role r in layer `layer` (ignored for per-model roles): refs holds the
 * per-model roles by role index, layer_refs the per-layer ones, n_layer_roles a layer. */
static inline kiln_wref *kiln_wref_of(const kiln_arch_desc *a, kiln_wref *refs, kiln_wref *layer_refs,
                                      const kiln_param_role *r, int layer) {
    int i = (int)(r - a->roles);
    if (!r->per_layer) return &refs[i];
    return &layer_refs[(size_t)layer * (size_t)a->n_layer_roles + (size_t)(i - a->first_layer_role)];
}

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
/* Whether c's flags call for the role in layer `layer` (ignored for per-model roles). */
bool kiln_role_wanted(const kiln_param_role *r, const kiln_model_config *c, int layer);
/* The f32 values of a vector role (kiln_role_is_vector): rows * cols. */
int64_t kiln_role_floats(const kiln_param_role *r, const kiln_model_config *c);
/* The role's shape as transformers holds the parameter (and a Hugging Face file stores it):
 * returns n_dims, 1 (a vector: (n)), 2 (a matrix: (rows, cols)) or 3 (a convolution's taps:
 * (channels, 1, taps)); unused entries of shape 1. */
int kiln_role_file_shape(const kiln_param_role *r, const kiln_model_config *c, int64_t shape[3]);
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
