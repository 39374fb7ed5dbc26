/*
 * model_config.h -- the architecture description of a Llama-family decoder, filled either from
 * a Hugging Face config.json (formats/hf_config.c) or from GGUF metadata (models/model_load.c).
 * It lives with the formats that describe it; models/ turns it into tensors and a forward.
 *
 * Dimension names used across kiln: B batch, T sequence, C = n_embd, NH = n_head,
 * KVH = n_head_kv, HS = head_dim, FF = n_ff, V = n_vocab, L = n_layer.
 */
#ifndef KILN_MODEL_CONFIG_H
#define KILN_MODEL_CONFIG_H

#include "../base/base.h"

typedef enum kiln_arch {
    KILN_ARCH_LLAMA = 0, /* Llama 2/3, SmolLM2, Mistral (same graph) */
    KILN_ARCH_MISTRAL,
    KILN_ARCH_QWEN2,     /* + q/k/v biases */
    KILN_ARCH_QWEN3,     /* + per-head RMSNorm on q and k */
    KILN_ARCH_GEMMA3,    /* Gemma 3 text: GeGLU, pre- and post-norms of (1 + w), sliding layers */
    KILN_ARCH_QWEN35,    /* Qwen3.5 text: Gated DeltaNet linear-attention layers, gated full attention */
} kiln_arch;

/* The most layers whose attention kind (sliding or full) a config can tell apart. */
#define KILN_MAX_LAYER_KINDS 1024

typedef enum kiln_rope_scaling {
    KILN_ROPE_SCALING_NONE = 0,
    KILN_ROPE_SCALING_LINEAR,  /* positions / factor */
    KILN_ROPE_SCALING_LLAMA3,  /* Llama 3.1 frequency-dependent scaling */
} kiln_rope_scaling;

typedef struct kiln_model_config {
    kiln_arch arch;
    int n_layer;     /* L */
    int n_embd;      /* C */
    int n_head;      /* NH */
    int n_head_kv;   /* KVH (divides NH) */
    int head_dim;    /* HS (Qwen3 may have NH*HS != C) */
    int n_ff;        /* FF */
    int n_vocab;     /* V */
    int n_ctx_train; /* max_position_embeddings */
    float rms_eps;
    float rope_theta;
    kiln_rope_scaling rope_scaling;
    float rope_factor;            /* linear / llama3 */
    float rope_low_freq_factor;   /* llama3 */
    float rope_high_freq_factor;  /* llama3 */
    int rope_original_max_pos;    /* llama3 original_max_position_embeddings */
    int tie_embeddings;  /* lm_head shares embed_tokens */
    int attn_bias;       /* q/k/v projections have biases (Qwen2) */
    int attn_out_bias;   /* o_proj has a bias (rare; attention_bias=true in Llama configs) */
    int mlp_bias;        /* gate/up/down have biases */
    int qk_norm;         /* Qwen3: RMSNorm over HS on q and k before RoPE */
    int sliding_window;  /* 0 = none (Mistral's window is refused if < context used) */
    /* Gemma 3: layer l attends within sliding_window when bit l is set (else to every earlier
     * key), with rope_theta_local as its RoPE base (0: rope_theta); attention scores are
     * scaled by query_pre_attn_scalar^-1/2 (0: head_dim^-1/2). */
    uint8_t sliding_layers[KILN_MAX_LAYER_KINDS / 8];
    float rope_theta_local;
    float query_pre_attn_scalar;
    /* Qwen3.5: layer l is linear attention (Gated DeltaNet) when bit l of linear_layers is set
     * (else gated full attention); its lin_nk key and lin_nv value heads of lin_dk and lin_dv,
     * its convolution's kernel lin_conv. rotary_dim: the dims of each attention head that
     * rotate (0: all head_dim). */
    uint8_t linear_layers[KILN_MAX_LAYER_KINDS / 8];
    int lin_nk, lin_nv, lin_dk, lin_dv, lin_conv;
    int rotary_dim;
    int32_t bos_id, eos_id; /* from config (-1 absent); generation_config may add more EOS */
    int32_t eos_ids[8];     /* all end-of-generation ids */
    int n_eos_ids;
} kiln_model_config;

/* Whether layer l attends within a sliding window (c->sliding_window keys). */
static inline int kiln_layer_slides(const kiln_model_config *c, int l) {
    return c->sliding_window > 0 && l >= 0 && l < KILN_MAX_LAYER_KINDS &&
           ((c->sliding_layers[l / 8] >> (l % 8)) & 1);
}

/* Whether layer l is a linear-attention (Gated DeltaNet) layer. */
static inline int kiln_layer_linear(const kiln_model_config *c, int l) {
    return l >= 0 && l < KILN_MAX_LAYER_KINDS && ((c->linear_layers[l / 8] >> (l % 8)) & 1);
}
/* The rotated dims of each attention head. */
static inline int kiln_rotary_dim(const kiln_model_config *c) {
    return c->rotary_dim > 0 ? c->rotary_dim : c->head_dim;
}

/* Check a filled config for consistency (positive dims, NH % KVH == 0, HS even, ...).
 * Errors name the field and the source label. */
kiln_status kiln_model_config_validate(const kiln_model_config *c, const char *label);

#endif /* KILN_MODEL_CONFIG_H */
