/*
 * model_config.c -- consistency checks for a filled kiln_model_config, whatever file it came
 * from.
 *
 * The limits are far above any published model and far below what would overflow the int64
 * size arithmetic of the loader (V * C, L * C * FF, NH * HS ...), so a config that passes can
 * be used to size tensors with plain int64 products.
 */
#include "model_config.h"

#include <math.h>

#define CFG_MAX_LAYER (1 << 16)
#define CFG_MAX_EMBD (1 << 20)
#define CFG_MAX_HEAD (1 << 14)
#define CFG_MAX_HEAD_DIM (1 << 14)
#define CFG_MAX_FF (1 << 22)
#define CFG_MAX_VOCAB (1 << 24)
#define CFG_MAX_CTX (1 << 30)

/* name: kiln's field, then the Hugging Face / GGUF spellings, so either reader's user finds it */
static kiln_status cfg_range(const char *label, const char *name, long long v, long long lo,
                             long long hi) {
    if (v < lo || v > hi)
        return kiln_error(KILN_ERR_FORMAT, "%s: %s = %lld is out of range [%lld, %lld]", label, name,
                          v, lo, hi);
    return KILN_OK;
}

static kiln_status cfg_float(const char *label, const char *name, float v, float lo, float hi) {
    if (!isfinite(v) || !(v > lo) || !(v < hi))
        return kiln_error(KILN_ERR_FORMAT, "%s: %s = %g must be finite and in (%g, %g)", label, name,
                          (double)v, (double)lo, (double)hi);
    return KILN_OK;
}

static kiln_status cfg_token(const char *label, const char *name, int32_t id, int n_vocab,
                             int allow_absent) {
    if (allow_absent && id == -1) return KILN_OK;
    if (id < 0 || id >= n_vocab)
        return kiln_error(KILN_ERR_FORMAT, "%s: %s = %d is not a token id (vocabulary size %d)",
                          label, name, (int)id, n_vocab);
    return KILN_OK;
}

kiln_status kiln_model_config_validate(const kiln_model_config *c, const char *label) {
    if (!label) label = "model config";
    if (!c) return kiln_error(KILN_ERR_INVALID_ARG, "%s: NULL config", label);
    if ((int)c->arch < KILN_ARCH_LLAMA || (int)c->arch > KILN_ARCH_QWEN35)
        return kiln_error(KILN_ERR_FORMAT, "%s: arch = %d is not a known architecture", label,
                          (int)c->arch);
    KILN_TRY(cfg_range(label, "n_layer (num_hidden_layers, block_count)", c->n_layer, 1, CFG_MAX_LAYER));
    KILN_TRY(cfg_range(label, "n_embd (hidden_size, embedding_length)", c->n_embd, 1, CFG_MAX_EMBD));
    KILN_TRY(cfg_range(label, "n_head (num_attention_heads, attention.head_count)", c->n_head, 1,
                       CFG_MAX_HEAD));
    KILN_TRY(cfg_range(label, "n_head_kv (num_key_value_heads, attention.head_count_kv)",
                       c->n_head_kv, 1, c->n_head));
    if (c->n_head % c->n_head_kv != 0)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: n_head_kv (num_key_value_heads) = %d does not divide n_head "
                          "(num_attention_heads) = %d", label, c->n_head_kv, c->n_head);
    KILN_TRY(cfg_range(label, "head_dim (head_dim, attention.key_length)", c->head_dim, 2,
                       CFG_MAX_HEAD_DIM));
    if (c->head_dim % 2 != 0)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: head_dim = %d is odd (RoPE rotates pairs of dimensions)", label,
                          c->head_dim);
    if ((long long)c->n_head * c->head_dim > CFG_MAX_EMBD * 4LL)
        return kiln_error(KILN_ERR_FORMAT, "%s: n_head * head_dim = %lld is too large", label,
                          (long long)c->n_head * c->head_dim);
    KILN_TRY(cfg_range(label, "n_ff (intermediate_size, feed_forward_length)", c->n_ff, 1, CFG_MAX_FF));
    KILN_TRY(cfg_range(label, "n_vocab (vocab_size)", c->n_vocab, 1, CFG_MAX_VOCAB));
    KILN_TRY(cfg_range(label, "n_ctx_train (max_position_embeddings, context_length)",
                       c->n_ctx_train, 1, CFG_MAX_CTX));
    KILN_TRY(cfg_float(label, "rms_eps (rms_norm_eps)", c->rms_eps, 0.0f, 1.0f));
    KILN_TRY(cfg_float(label, "rope_theta", c->rope_theta, 0.0f, INFINITY));
    if (c->rope_theta_local != 0.0f)
        KILN_TRY(cfg_float(label, "rope_theta_local (rope_local_base_freq)", c->rope_theta_local, 0.0f, INFINITY));
    if (c->query_pre_attn_scalar != 0.0f)
        KILN_TRY(cfg_float(label, "query_pre_attn_scalar", c->query_pre_attn_scalar, 0.0f, INFINITY));

    switch (c->rope_scaling) {
    case KILN_ROPE_SCALING_NONE: break;
    case KILN_ROPE_SCALING_LINEAR:
        KILN_TRY(cfg_float(label, "rope_factor (rope_scaling.factor)", c->rope_factor, 0.0f, INFINITY));
        break;
    case KILN_ROPE_SCALING_LLAMA3:
        KILN_TRY(cfg_float(label, "rope_factor (rope_scaling.factor)", c->rope_factor, 0.0f, INFINITY));
        KILN_TRY(cfg_float(label, "rope_low_freq_factor (rope_scaling.low_freq_factor)",
                           c->rope_low_freq_factor, 0.0f, INFINITY));
        KILN_TRY(cfg_float(label, "rope_high_freq_factor (rope_scaling.high_freq_factor)",
                           c->rope_high_freq_factor, 0.0f, INFINITY));
        /* the smoothing factor divides by (high - low) */
        if (!(c->rope_high_freq_factor > c->rope_low_freq_factor))
            return kiln_error(KILN_ERR_FORMAT,
                              "%s: rope_high_freq_factor = %g must be larger than "
                              "rope_low_freq_factor = %g", label, (double)c->rope_high_freq_factor,
                              (double)c->rope_low_freq_factor);
        KILN_TRY(cfg_range(label,
                           "rope_original_max_pos (rope_scaling.original_max_position_embeddings)",
                           c->rope_original_max_pos, 1, CFG_MAX_CTX));
        break;
    default:
        return kiln_error(KILN_ERR_FORMAT, "%s: rope_scaling = %d is not a known kind", label,
                          (int)c->rope_scaling);
    }

    const struct { const char *name; int v; } flags[] = {
        {"tie_embeddings (tie_word_embeddings)", c->tie_embeddings},
        {"attn_bias", c->attn_bias}, {"attn_out_bias", c->attn_out_bias},
        {"mlp_bias", c->mlp_bias}, {"qk_norm", c->qk_norm},
    };
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
        KILN_TRY(cfg_range(label, flags[i].name, flags[i].v, 0, 1));
    KILN_TRY(cfg_range(label, "sliding_window", c->sliding_window, 0, CFG_MAX_CTX));
    if (c->rotary_dim != 0) {
        KILN_TRY(cfg_range(label, "rotary_dim (head_dim * partial_rotary_factor)", c->rotary_dim, 2, c->head_dim));
        if (c->rotary_dim % 2)
            return kiln_error(KILN_ERR_FORMAT, "%s: rotary_dim = %d is odd (RoPE rotates pairs of dimensions)", label,
                              c->rotary_dim);
    }
    if (c->arch == KILN_ARCH_QWEN35) {
        KILN_TRY(cfg_range(label, "lin_nk (linear_num_key_heads)", c->lin_nk, 1, CFG_MAX_HEAD));
        KILN_TRY(cfg_range(label, "lin_nv (linear_num_value_heads)", c->lin_nv, 1, CFG_MAX_HEAD));
        if (c->lin_nv % c->lin_nk)
            return kiln_error(KILN_ERR_FORMAT,
                              "%s: linear_num_key_heads = %d does not divide linear_num_value_heads = %d", label,
                              c->lin_nk, c->lin_nv);
        /* the kernels keep a head's columns and a token's q, k in fixed arrays */
        KILN_TRY(cfg_range(label, "lin_dk (linear_key_head_dim)", c->lin_dk, 1, 512));
        KILN_TRY(cfg_range(label, "lin_dv (linear_value_head_dim)", c->lin_dv, 1, 512));
        KILN_TRY(cfg_range(label, "lin_conv (linear_conv_kernel_dim)", c->lin_conv, 1, 64));
        if (c->n_layer > KILN_MAX_LAYER_KINDS)
            return kiln_error(KILN_ERR_UNSUPPORTED, "%s: %d layers: at most %d with linear-attention layers", label,
                              c->n_layer, KILN_MAX_LAYER_KINDS);
    }

    KILN_TRY(cfg_token(label, "bos_id (bos_token_id)", c->bos_id, c->n_vocab, 1));
    KILN_TRY(cfg_token(label, "eos_id (eos_token_id)", c->eos_id, c->n_vocab, 1));
    KILN_TRY(cfg_range(label, "n_eos_ids", c->n_eos_ids, 0,
                       (long long)(sizeof c->eos_ids / sizeof c->eos_ids[0])));
    for (int i = 0; i < c->n_eos_ids; i++)
        KILN_TRY(cfg_token(label, "eos_ids[] (eos_token_id)", c->eos_ids[i], c->n_vocab, 0));
    return KILN_OK;
}
