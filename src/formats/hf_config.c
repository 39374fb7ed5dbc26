/*
 * hf_config.c -- config.json and generation_config.json of a Hugging Face model folder.
 *
 * Defaults are transformers 5.24's for each model_type (its configuration_<type>.py), so a
 * folder means here what it means to transformers:
 *
 *   field (when absent)        llama      mistral    qwen2       qwen3
 *   num_key_value_heads        NH         8          32          32
 *   head_dim                   C / NH     C / NH     C / NH      128
 *   max_position_embeddings    2048       131072     32768       32768
 *   bos_token_id, eos_token_id 1, 2       1, 2       none        none
 *   sliding_window             -          4096       only with use_sliding_window
 *   tie_word_embeddings        false      false      false       false
 *   rms_norm_eps 1e-6, rope_theta 10000 for all. head_dim: null means C / NH.
 *
 * Biases: llama's attention_bias puts biases on q, k, v and o, mlp_bias on gate/up/down;
 * qwen2 always has q/k/v biases and never o; qwen3's attention_bias covers q, k, v, o and it
 * always has q/k RMSNorm; mistral has no biases.
 *
 * RoPE comes in two layouts: transformers >= 5 writes "rope_parameters": {"rope_theta",
 * "rope_type", "factor", ...}; older files have a top-level "rope_theta" and "rope_scaling":
 * {"type" or "rope_type", "factor", ...}. As transformers does, rope_scaling wins over
 * rope_parameters, a theta inside the dict wins over the top-level one, and llama3's
 * original_max_position_embeddings defaults to max_position_embeddings.
 *
 * Gemma 3 text (model_type gemma3_text, Gemma3TextConfig of transformers 5.24): defaults NH/KVH
 * 8/4, head_dim 256, max_position_embeddings 131072, bos 2, eos 1, tied head, GELU (tanh),
 * query_pre_attn_scalar 256, sliding_window 4096 on the layers layer_types marks (absent: every
 * layer but each sliding_window_pattern-th, default 6). RoPE per layer kind: rope_parameters
 * {"full_attention": {...}, "sliding_attention": {...}}, or the older rope_theta (full, default
 * 1e6), rope_local_base_freq (sliding, default 1e4) and rope_scaling (full layers only). A
 * final logit soft-cap, bidirectional attention and attention biases are refused.
 *
 * Qwen3.5 text (model_type qwen3_5_text, Qwen3_5TextConfig of transformers 5.24; or qwen3_5,
 * the released multimodal folders, whose text model is described by text_config): defaults
 * NH/KVH 16/4, head_dim 256, max_position_embeddings 32768, no bos/eos, untied; rotary on
 * head_dim * partial_rotary_factor dims (0.25); q/k norms; linear-attention layers as
 * layer_types says (or all but each full_attention_interval-th, default 4) with
 * linear_num_key_heads 16, linear_num_value_heads 32, linear_key_head_dim and
 * linear_value_head_dim 128, linear_conv_kernel_dim 4.
 *
 * Duplicate keys are refused: Python's json keeps the last one and cJSON finds the first, so a
 * file with duplicates would mean different things to kiln and to transformers.
 */
#include "hf_config.h"
#include "json_text.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define HF_CONFIG_CAP (16u * 1024u * 1024u)
#define HF_MAX_EOS ((int)(sizeof(((kiln_model_config *)0)->eos_ids) / sizeof(int32_t)))

static const char *hf_type_name(const cJSON *v) {
    if (!v) return "nothing";
    if (cJSON_IsNull(v)) return "null";
    if (cJSON_IsBool(v)) return "a boolean";
    if (cJSON_IsNumber(v)) return "a number";
    if (cJSON_IsString(v)) return "a string";
    if (cJSON_IsArray(v)) return "an array";
    if (cJSON_IsObject(v)) return "an object";
    return "an invalid value";
}

static int hf_key_cmp(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Refuse duplicate keys in obj (named where for the message). */
static kiln_status hf_check_unique_keys(const cJSON *obj, const char *label, const char *where) {
    int n = cJSON_GetArraySize(obj);
    if (n < 2) return KILN_OK;
    const char **keys = kiln_calloc((size_t)n, sizeof *keys);
    if (!keys) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", label);
    int i = 0;
    for (const cJSON *e = obj->child; e; e = e->next) keys[i++] = e->string;
    qsort(keys, (size_t)n, sizeof *keys, hf_key_cmp);
    kiln_status st = KILN_OK;
    for (i = 1; i < n; i++) {
        if (strcmp(keys[i - 1], keys[i]) == 0) {
            st = kiln_error(KILN_ERR_FORMAT, "%s: %skey '%.100s' appears twice", label, where,
                            keys[i]);
            break;
        }
    }
    kiln_free(keys);
    return st;
}

/* A JSON number that is an exact integer in [lo, hi]. */
static kiln_status hf_int_value(const cJSON *v, const char *label, const char *field, long long lo,
                                long long hi, long long *out) {
    if (!cJSON_IsNumber(v))
        return kiln_error(KILN_ERR_FORMAT, "%s: %s: expected an integer, got %s", label, field,
                          hf_type_name(v));
    double d = v->valuedouble;
    if (!(d >= -9007199254740992.0 && d <= 9007199254740992.0) || d != floor(d))
        return kiln_error(KILN_ERR_FORMAT, "%s: %s = %g is not an exact integer", label, field, d);
    long long x = (long long)d;
    if (x < lo || x > hi)
        return kiln_error(KILN_ERR_FORMAT, "%s: %s = %lld is out of range [%lld, %lld]", label,
                          field, x, lo, hi);
    *out = x;
    return KILN_OK;
}

/* obj[key] as an int in [lo, INT32_MAX]; absent or null gives def, or an error if required. */
static kiln_status hf_get_int(const cJSON *obj, const char *key, const char *label, long long lo,
                              int required, int def, int *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v || cJSON_IsNull(v)) {
        if (required)
            return kiln_error(KILN_ERR_FORMAT, "%s: %s: missing (required)", label, key);
        *out = def;
        return KILN_OK;
    }
    long long x;
    KILN_TRY(hf_int_value(v, label, key, lo, INT32_MAX, &x));
    *out = (int)x;
    return KILN_OK;
}

/* obj[key] as a finite float > 0; absent or null gives def (required: error). */
static kiln_status hf_get_pos_float(const cJSON *obj, const char *key, const char *label,
                                    const char *where, int required, float def, float *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v || cJSON_IsNull(v)) {
        if (required)
            return kiln_error(KILN_ERR_FORMAT, "%s: %s%s: missing (required)", label, where, key);
        *out = def;
        return KILN_OK;
    }
    if (!cJSON_IsNumber(v))
        return kiln_error(KILN_ERR_FORMAT, "%s: %s%s: expected a number, got %s", label, where, key,
                          hf_type_name(v));
    double d = v->valuedouble;
    if (!isfinite(d) || !(d > 0.0) || d > 3.0e38)
        return kiln_error(KILN_ERR_FORMAT, "%s: %s%s = %g must be positive and finite", label, where,
                          key, d);
    *out = (float)d;
    return KILN_OK;
}

/* obj[key] as a boolean; absent or null gives def. */
static kiln_status hf_get_bool(const cJSON *obj, const char *key, const char *label, int def,
                               int *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v || cJSON_IsNull(v)) {
        *out = def;
        return KILN_OK;
    }
    if (!cJSON_IsBool(v))
        return kiln_error(KILN_ERR_FORMAT, "%s: %s: expected true or false, got %s", label, key,
                          hf_type_name(v));
    *out = cJSON_IsTrue(v) ? 1 : 0;
    return KILN_OK;
}

/* Append id to ids[0..*n) unless present; the list holds at most HF_MAX_EOS. */
static kiln_status hf_add_eos(int32_t *ids, int *n, int32_t id, const char *label) {
    for (int i = 0; i < *n; i++)
        if (ids[i] == id) return KILN_OK;
    if (*n >= HF_MAX_EOS)
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "%s: eos_token_id: more than %d distinct end-of-generation ids", label,
                          HF_MAX_EOS);
    ids[(*n)++] = id;
    return KILN_OK;
}

/* eos_token_id: absent, null, an int or a list of ints. Appends to ids; *first gets the first
 * id of the field (-1 if it gave none). */
static kiln_status hf_get_eos(const cJSON *obj, const char *label, int32_t *ids, int *n,
                              int32_t *first) {
    *first = -1;
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, "eos_token_id");
    if (!v || cJSON_IsNull(v)) return KILN_OK;
    if (cJSON_IsNumber(v)) {
        long long x;
        KILN_TRY(hf_int_value(v, label, "eos_token_id", 0, INT32_MAX, &x));
        *first = (int32_t)x;
        return hf_add_eos(ids, n, (int32_t)x, label);
    }
    if (!cJSON_IsArray(v))
        return kiln_error(KILN_ERR_FORMAT, "%s: eos_token_id: expected an integer or a list, got %s",
                          label, hf_type_name(v));
    int i = 0;
    for (const cJSON *e = v->child; e; e = e->next, i++) {
        char field[48];
        snprintf(field, sizeof field, "eos_token_id[%d]", i);
        long long x;
        KILN_TRY(hf_int_value(e, label, field, 0, INT32_MAX, &x));
        if (*first < 0) *first = (int32_t)x;
        KILN_TRY(hf_add_eos(ids, n, (int32_t)x, label));
    }
    return KILN_OK;
}

typedef struct hf_arch_defaults {
    const char *model_type;
    const char *architecture; /* the class name in "architectures" */
    kiln_arch arch;
    int n_head_kv;    /* -1: = num_attention_heads */
    int head_dim;     /* -1: = hidden_size / num_attention_heads */
    int n_ctx_train;
    int bos_id, eos_id;
    int tied;         /* tie_word_embeddings when absent */
} hf_arch_defaults;

static const hf_arch_defaults hf_archs[] = {
    {"llama", "LlamaForCausalLM", KILN_ARCH_LLAMA, -1, -1, 2048, 1, 2, 0},
    {"mistral", "MistralForCausalLM", KILN_ARCH_MISTRAL, 8, -1, 4096 * 32, 1, 2, 0},
    {"qwen2", "Qwen2ForCausalLM", KILN_ARCH_QWEN2, 32, -1, 32768, -1, -1, 0},
    {"qwen3", "Qwen3ForCausalLM", KILN_ARCH_QWEN3, 32, 128, 32768, -1, -1, 0},
    {"gemma3_text", "Gemma3ForCausalLM", KILN_ARCH_GEMMA3, 4, 256, 131072, 2, 1, 1},
    {"qwen3_5_text", "Qwen3_5ForCausalLM", KILN_ARCH_QWEN35, 4, 256, 32768, -1, -1, 0},
    /* the released (multimodal) checkpoints: the text model's config in text_config */
    {"qwen3_5", "Qwen3_5ForConditionalGeneration", KILN_ARCH_QWEN35, 4, 256, 32768, -1, -1, 0},
};

static kiln_status hf_find_arch(const cJSON *root, const char *label, const hf_arch_defaults **out) {
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (mt && !cJSON_IsNull(mt)) {
        if (!cJSON_IsString(mt))
            return kiln_error(KILN_ERR_FORMAT, "%s: model_type: expected a string, got %s", label,
                              hf_type_name(mt));
        for (size_t i = 0; i < sizeof hf_archs / sizeof hf_archs[0]; i++)
            if (strcmp(mt->valuestring, hf_archs[i].model_type) == 0) {
                *out = &hf_archs[i];
                return KILN_OK;
            }
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "%s: model_type '%.100s' is not supported (kiln reads llama, mistral, "
                          "qwen2, qwen3, gemma3_text, qwen3_5_text, qwen3_5)", label, mt->valuestring);
    }
    /* No model_type: fall back on the class name, as old folders sometimes need. */
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(root, "architectures");
    if (cJSON_IsArray(arr) && cJSON_IsString(arr->child)) {
        for (size_t i = 0; i < sizeof hf_archs / sizeof hf_archs[0]; i++)
            if (strcmp(arr->child->valuestring, hf_archs[i].architecture) == 0) {
                *out = &hf_archs[i];
                return KILN_OK;
            }
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "%s: architectures[0] '%.100s' is not supported and model_type is missing",
                          label, arr->child->valuestring);
    }
    return kiln_error(KILN_ERR_FORMAT, "%s: model_type: missing (and no architectures list)", label);
}

/* RoPE: theta and scaling from either layout (see the file comment). */
static kiln_status hf_parse_rope(const cJSON *root, const char *label, kiln_model_config *c) {
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(root, "rope_scaling");
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(root, "rope_parameters");
    if (rs && !cJSON_IsNull(rs) && !cJSON_IsObject(rs))
        return kiln_error(KILN_ERR_FORMAT, "%s: rope_scaling: expected an object or null, got %s",
                          label, hf_type_name(rs));
    if (rp && !cJSON_IsNull(rp) && !cJSON_IsObject(rp))
        return kiln_error(KILN_ERR_FORMAT, "%s: rope_parameters: expected an object or null, got %s",
                          label, hf_type_name(rp));
    /* Python's `rope_scaling or rope_parameters`: an empty dict counts as absent. */
    const cJSON *r = NULL;
    const char *where = "";
    if (cJSON_IsObject(rs) && rs->child) { r = rs; where = "rope_scaling."; }
    else if (cJSON_IsObject(rp) && rp->child) { r = rp; where = "rope_parameters."; }

    float top_theta;
    KILN_TRY(hf_get_pos_float(root, "rope_theta", label, "", 0, 10000.0f, &top_theta));
    c->rope_theta = top_theta;
    c->rope_scaling = KILN_ROPE_SCALING_NONE;
    c->rope_factor = 1.0f;
    c->rope_low_freq_factor = 0.0f;
    c->rope_high_freq_factor = 0.0f;
    c->rope_original_max_pos = 0;
    if (!r) return KILN_OK;

    KILN_TRY(hf_check_unique_keys(r, label, where));
    for (const cJSON *e = r->child; e; e = e->next)
        if (cJSON_IsObject(e))
            return kiln_error(KILN_ERR_UNSUPPORTED,
                              "%s: %s%s: per-layer-type RoPE parameters are not supported", label,
                              where, e->string);
    KILN_TRY(hf_get_pos_float(r, "rope_theta", label, where, 0, top_theta, &c->rope_theta));

    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(r, "rope_type");
    if (!ty || cJSON_IsNull(ty)) ty = cJSON_GetObjectItemCaseSensitive(r, "type");
    const char *type = "default";
    if (ty && !cJSON_IsNull(ty)) {
        if (!cJSON_IsString(ty))
            return kiln_error(KILN_ERR_FORMAT, "%s: %srope_type: expected a string, got %s", label,
                              where, hf_type_name(ty));
        type = ty->valuestring;
    }
    const cJSON *prf = cJSON_GetObjectItemCaseSensitive(r, "partial_rotary_factor");
    if (c->arch == KILN_ARCH_QWEN35) {
        /* Qwen3.5: rotary on int(head_dim * factor) dims (0.25 when absent); its mrope
         * sections change nothing for text, whose three position axes are equal */
        double f = 0.25;
        if (prf && !cJSON_IsNull(prf)) {
            if (!cJSON_IsNumber(prf) || !(prf->valuedouble > 0.0) || prf->valuedouble > 1.0)
                return kiln_error(KILN_ERR_FORMAT, "%s: %spartial_rotary_factor: expected a number in (0, 1]", label,
                                  where);
            f = prf->valuedouble;
        }
        c->rotary_dim = (int)((double)c->head_dim * f);
    } else if (prf && !cJSON_IsNull(prf) && !(cJSON_IsNumber(prf) && prf->valuedouble == 1.0))
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "%s: %spartial_rotary_factor: partial rotary embeddings are not supported",
                          label, where);

    if (strcmp(type, "default") == 0) return KILN_OK;
    if (strcmp(type, "linear") == 0) {
        c->rope_scaling = KILN_ROPE_SCALING_LINEAR;
        return hf_get_pos_float(r, "factor", label, where, 1, 1.0f, &c->rope_factor);
    }
    if (strcmp(type, "llama3") == 0) {
        c->rope_scaling = KILN_ROPE_SCALING_LLAMA3;
        KILN_TRY(hf_get_pos_float(r, "factor", label, where, 1, 1.0f, &c->rope_factor));
        KILN_TRY(hf_get_pos_float(r, "low_freq_factor", label, where, 1, 1.0f,
                                  &c->rope_low_freq_factor));
        KILN_TRY(hf_get_pos_float(r, "high_freq_factor", label, where, 1, 1.0f,
                                  &c->rope_high_freq_factor));
        char field[64];
        snprintf(field, sizeof field, "%soriginal_max_position_embeddings", where);
        const cJSON *om = cJSON_GetObjectItemCaseSensitive(r, "original_max_position_embeddings");
        if (!om || cJSON_IsNull(om)) {
            c->rope_original_max_pos = c->n_ctx_train;
        } else {
            long long x;
            KILN_TRY(hf_int_value(om, label, field, 1, INT32_MAX, &x));
            c->rope_original_max_pos = (int)x;
        }
        return KILN_OK;
    }
    return kiln_error(KILN_ERR_UNSUPPORTED,
                      "%s: %srope_type '%.60s' is not supported (kiln reads default, linear, llama3)",
                      label, where, type);
}

/* One Gemma 3 layer kind's RoPE dict (rope_parameters["full_attention"] or
 * ["sliding_attention"]; NULL: absent): its theta (default def) and, for the full layers, a
 * linear scaling; other kinds refused. */
static kiln_status hf_gemma3_rope_kind(const cJSON *r, const char *label, const char *where, float def,
                                       int full, float *theta, kiln_model_config *c) {
    *theta = def;
    if (!r || cJSON_IsNull(r)) return KILN_OK;
    if (!cJSON_IsObject(r))
        return kiln_error(KILN_ERR_FORMAT, "%s: %s: expected an object, got %s", label, where, hf_type_name(r));
    KILN_TRY(hf_check_unique_keys(r, label, where));
    char w[96];
    snprintf(w, sizeof w, "%s.", where);
    KILN_TRY(hf_get_pos_float(r, "rope_theta", label, w, 0, def, theta));
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(r, "rope_type");
    if (!ty || cJSON_IsNull(ty)) ty = cJSON_GetObjectItemCaseSensitive(r, "type");
    const char *type = ty && cJSON_IsString(ty) ? ty->valuestring : "default";
    if (ty && !cJSON_IsNull(ty) && !cJSON_IsString(ty))
        return kiln_error(KILN_ERR_FORMAT, "%s: %s.rope_type: expected a string, got %s", label, where, hf_type_name(ty));
    if (!strcmp(type, "default")) return KILN_OK;
    if (full && !strcmp(type, "linear")) {
        c->rope_scaling = KILN_ROPE_SCALING_LINEAR;
        return hf_get_pos_float(r, "factor", label, w, 1, 1.0f, &c->rope_factor);
    }
    return kiln_error(KILN_ERR_UNSUPPORTED, "%s: %s.rope_type '%.60s' is not supported (default%s)", label, where,
                      type, full ? ", linear" : "");
}

/* layer_types, when present: bit i of bits set where entry i is `kind` (the other allowed entry
 * is "full_attention"); *present 0 when the key is absent or null (bits untouched). */
static kiln_status hf_layer_types(const cJSON *root, const char *label, int n_layer, const char *kind, uint8_t *bits,
                                  int *present) {
    *present = 0;
    const cJSON *lt = cJSON_GetObjectItemCaseSensitive(root, "layer_types");
    if (!lt || cJSON_IsNull(lt)) return KILN_OK;
    if (!cJSON_IsArray(lt))
        return kiln_error(KILN_ERR_FORMAT, "%s: layer_types: expected a list, got %s", label, hf_type_name(lt));
    if (cJSON_GetArraySize(lt) != n_layer)
        return kiln_error(KILN_ERR_FORMAT, "%s: layer_types: %d entries for num_hidden_layers = %d", label,
                          cJSON_GetArraySize(lt), n_layer);
    int i = 0;
    for (const cJSON *e = lt->child; e; e = e->next, i++) {
        if (cJSON_IsString(e) && strcmp(e->valuestring, "full_attention") == 0) continue;
        if (cJSON_IsString(e) && strcmp(e->valuestring, kind) == 0) {
            bits[i / 8] |= (uint8_t)(1u << (i % 8));
            continue;
        }
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: layer_types[%d]: expected \"full_attention\" or \"%s\"", label,
                          i, kind);
    }
    *present = 1;
    return KILN_OK;
}

/* Gemma 3's RoPE, sliding layers and the rest of its config (the file comment). */
static kiln_status hf_parse_gemma3(const cJSON *root, const char *label, kiln_model_config *c) {
    const cJSON *act = cJSON_GetObjectItemCaseSensitive(root, "hidden_activation");
    if (act && !cJSON_IsNull(act) && !(cJSON_IsString(act) && strcmp(act->valuestring, "gelu_pytorch_tanh") == 0))
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: hidden_activation: only \"gelu_pytorch_tanh\" is supported", label);
    const cJSON *cap = cJSON_GetObjectItemCaseSensitive(root, "final_logit_softcapping");
    if (cap && !cJSON_IsNull(cap))
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: final_logit_softcapping: a logit soft-cap is not supported", label);
    int bidir = 0, bias = 0;
    KILN_TRY(hf_get_bool(root, "use_bidirectional_attention", label, 0, &bidir));
    if (bidir) return kiln_error(KILN_ERR_UNSUPPORTED, "%s: use_bidirectional_attention: only causal attention is supported", label);
    KILN_TRY(hf_get_bool(root, "attention_bias", label, 0, &bias));
    if (bias) return kiln_error(KILN_ERR_UNSUPPORTED, "%s: attention_bias: Gemma 3 with attention biases is not supported", label);
    KILN_TRY(hf_get_pos_float(root, "query_pre_attn_scalar", label, "", 0, 256.0f, &c->query_pre_attn_scalar));
    c->qk_norm = 1;

    /* RoPE per layer kind */
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(root, "rope_parameters");
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(root, "rope_scaling");
    if (rp && !cJSON_IsNull(rp) && !cJSON_IsObject(rp))
        return kiln_error(KILN_ERR_FORMAT, "%s: rope_parameters: expected an object or null, got %s", label, hf_type_name(rp));
    float top_full, top_local;
    KILN_TRY(hf_get_pos_float(root, "rope_theta", label, "", 0, 1000000.0f, &top_full));
    KILN_TRY(hf_get_pos_float(root, "rope_local_base_freq", label, "", 0, 10000.0f, &top_local));
    c->rope_scaling = KILN_ROPE_SCALING_NONE;
    c->rope_factor = 1.0f;
    const cJSON *full = cJSON_IsObject(rp) ? cJSON_GetObjectItemCaseSensitive(rp, "full_attention") : NULL;
    const cJSON *slid = cJSON_IsObject(rp) ? cJSON_GetObjectItemCaseSensitive(rp, "sliding_attention") : NULL;
    if (cJSON_IsObject(rp)) KILN_TRY(hf_check_unique_keys(rp, label, "rope_parameters."));
    if (rs && !cJSON_IsNull(rs)) full = rs; /* the older layout: rope_scaling is the full layers' */
    KILN_TRY(hf_gemma3_rope_kind(full, label, rs && !cJSON_IsNull(rs) ? "rope_scaling" : "rope_parameters.full_attention",
                                 top_full, 1, &c->rope_theta, c));
    KILN_TRY(hf_gemma3_rope_kind(slid, label, "rope_parameters.sliding_attention", top_local, 0, &c->rope_theta_local, c));

    /* which layers slide */
    int window;
    KILN_TRY(hf_get_int(root, "sliding_window", label, 1, 0, 4096, &window));
    const cJSON *swn = cJSON_GetObjectItemCaseSensitive(root, "sliding_window");
    if (swn && cJSON_IsNull(swn)) window = 0;
    memset(c->sliding_layers, 0, sizeof c->sliding_layers);
    c->sliding_window = window;
    if (c->n_layer > KILN_MAX_LAYER_KINDS)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: num_hidden_layers %d: at most %d layers with sliding windows",
                          label, c->n_layer, KILN_MAX_LAYER_KINDS);
    int listed;
    KILN_TRY(hf_layer_types(root, label, c->n_layer, "sliding_attention", c->sliding_layers, &listed));
    if (!listed) {
        int pattern;
        const char *pk = cJSON_GetObjectItemCaseSensitive(root, "sliding_window_pattern") ? "sliding_window_pattern"
                                                                                          : "_sliding_window_pattern";
        KILN_TRY(hf_get_int(root, pk, label, 1, 0, 6, &pattern));
        for (int i = 0; i < c->n_layer; i++)
            if ((i + 1) % pattern != 0) c->sliding_layers[i / 8] |= (uint8_t)(1u << (i % 8));
    }
    return KILN_OK;
}

/* Qwen3.5's linear-attention widths and layer kinds (Qwen3_5TextConfig's defaults: 16 key and
 * 32 value heads of 128, kernel 4; layer_types, or every full_attention_interval-th layer full,
 * default 4). Its q/k norms are always there; the rest of RoPE is hf_parse_rope's. */
static kiln_status hf_parse_qwen35(const cJSON *root, const char *label, kiln_model_config *c) {
    c->qk_norm = 1;
    KILN_TRY(hf_get_int(root, "linear_num_key_heads", label, 1, 0, 16, &c->lin_nk));
    KILN_TRY(hf_get_int(root, "linear_num_value_heads", label, 1, 0, 32, &c->lin_nv));
    KILN_TRY(hf_get_int(root, "linear_key_head_dim", label, 1, 0, 128, &c->lin_dk));
    KILN_TRY(hf_get_int(root, "linear_value_head_dim", label, 1, 0, 128, &c->lin_dv));
    KILN_TRY(hf_get_int(root, "linear_conv_kernel_dim", label, 1, 0, 4, &c->lin_conv));
    int gate = 1;
    KILN_TRY(hf_get_bool(root, "attn_output_gate", label, 1, &gate));
    if (!gate) return kiln_error(KILN_ERR_UNSUPPORTED, "%s: attn_output_gate: false is not supported", label);
    if (c->n_layer > KILN_MAX_LAYER_KINDS)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: num_hidden_layers %d: at most %d layers", label, c->n_layer,
                          KILN_MAX_LAYER_KINDS);
    memset(c->linear_layers, 0, sizeof c->linear_layers);
    int listed;
    KILN_TRY(hf_layer_types(root, label, c->n_layer, "linear_attention", c->linear_layers, &listed));
    if (!listed) {
        int interval;
        KILN_TRY(hf_get_int(root, "full_attention_interval", label, 1, 0, 4, &interval));
        for (int i = 0; i < c->n_layer; i++)
            if ((i + 1) % interval != 0) c->linear_layers[i / 8] |= (uint8_t)(1u << (i % 8));
    }
    return KILN_OK;
}

/* Qwen2/Qwen3 use a sliding window only with use_sliding_window, and then only on the layers
 * that layer_types (or, when absent, i >= max_window_layers) marks; kiln has one window for
 * all layers, so a mix is refused. Mistral's sliding_window applies to every layer. */
static kiln_status hf_parse_sliding(const cJSON *root, const char *label, kiln_model_config *c) {
    c->sliding_window = 0;
    if (c->arch == KILN_ARCH_LLAMA) return KILN_OK;
    int window;
    const cJSON *sw = cJSON_GetObjectItemCaseSensitive(root, "sliding_window");
    int sw_null = sw && cJSON_IsNull(sw);
    KILN_TRY(hf_get_int(root, "sliding_window", label, 1, 0, 4096, &window));
    if (sw_null) window = 0;
    if (c->arch == KILN_ARCH_MISTRAL) {
        c->sliding_window = window;
        return KILN_OK;
    }
    int use = 0;
    KILN_TRY(hf_get_bool(root, "use_sliding_window", label, 0, &use));
    if (!use) window = 0;

    int n_sliding = 0;
    const cJSON *lt = cJSON_GetObjectItemCaseSensitive(root, "layer_types");
    if (lt && !cJSON_IsNull(lt)) {
        if (!cJSON_IsArray(lt))
            return kiln_error(KILN_ERR_FORMAT, "%s: layer_types: expected a list, got %s", label,
                              hf_type_name(lt));
        if (cJSON_GetArraySize(lt) != c->n_layer)
            return kiln_error(KILN_ERR_FORMAT,
                              "%s: layer_types: %d entries for num_hidden_layers = %d", label,
                              cJSON_GetArraySize(lt), c->n_layer);
        int i = 0;
        for (const cJSON *e = lt->child; e; e = e->next, i++) {
            if (cJSON_IsString(e) && strcmp(e->valuestring, "full_attention") == 0) continue;
            if (cJSON_IsString(e) && strcmp(e->valuestring, "sliding_attention") == 0) {
                n_sliding++;
                continue;
            }
            return kiln_error(KILN_ERR_UNSUPPORTED,
                              "%s: layer_types[%d]: expected \"full_attention\" or "
                              "\"sliding_attention\"", label, i);
        }
    } else if (window > 0) {
        int mwl;
        KILN_TRY(hf_get_int(root, "max_window_layers", label, 0, 0, 28, &mwl));
        n_sliding = mwl < c->n_layer ? c->n_layer - mwl : 0;
    }
    if (window == 0 || n_sliding == 0) return KILN_OK; /* no layer slides */
    if (n_sliding != c->n_layer)
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "%s: sliding_window: %d of %d layers use a sliding window; kiln supports "
                          "all or none", label, n_sliding, c->n_layer);
    c->sliding_window = window;
    return KILN_OK;
}

static kiln_status hf_parse_root(const cJSON *top, const char *label, kiln_model_config *c) {
    if (!cJSON_IsObject(top)) return kiln_error(KILN_ERR_FORMAT, "%s: not a JSON object", label);
    KILN_TRY(hf_check_unique_keys(top, label, ""));
    const hf_arch_defaults *ad = NULL;
    KILN_TRY(hf_find_arch(top, label, &ad));
    memset(c, 0, sizeof *c);
    c->arch = ad->arch;
    /* A multimodal Qwen3.5 folder: the text model's fields are in text_config (its vision
     * tower and MTP head are not read); tie_word_embeddings and the token ids may sit on top. */
    const cJSON *root = top;
    if (strcmp(ad->model_type, "qwen3_5") == 0) {
        root = cJSON_GetObjectItemCaseSensitive(top, "text_config");
        if (!cJSON_IsObject(root))
            return kiln_error(KILN_ERR_FORMAT, "%s: text_config: expected an object, got %s", label,
                              hf_type_name(root));
        KILN_TRY(hf_check_unique_keys(root, label, "text_config."));
    }

    const cJSON *q = cJSON_GetObjectItemCaseSensitive(root, "quantization_config");
    if (q && !cJSON_IsNull(q))
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "%s: quantization_config: pre-quantized checkpoints are not supported",
                          label);
    const cJSON *act = cJSON_GetObjectItemCaseSensitive(root, "hidden_act");
    if (c->arch != KILN_ARCH_GEMMA3 && act && !cJSON_IsNull(act) &&
        !(cJSON_IsString(act) && strcmp(act->valuestring, "silu") == 0))
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: hidden_act: only \"silu\" is supported", label);

    KILN_TRY(hf_get_int(root, "hidden_size", label, 1, 1, 0, &c->n_embd));
    KILN_TRY(hf_get_int(root, "intermediate_size", label, 1, 1, 0, &c->n_ff));
    KILN_TRY(hf_get_int(root, "num_hidden_layers", label, 1, 1, 0, &c->n_layer));
    KILN_TRY(hf_get_int(root, "num_attention_heads", label, 1, 1, 0, &c->n_head));
    KILN_TRY(hf_get_int(root, "vocab_size", label, 1, 1, 0, &c->n_vocab));
    KILN_TRY(hf_get_int(root, "num_key_value_heads", label, 1, 0,
                        ad->n_head_kv < 0 ? c->n_head : ad->n_head_kv, &c->n_head_kv));
    /* A present null means "derive it" for every type (qwen3 would crash on it in transformers). */
    const cJSON *hd = cJSON_GetObjectItemCaseSensitive(root, "head_dim");
    int hd_default = (ad->head_dim < 0 || (hd && cJSON_IsNull(hd))) ? c->n_embd / c->n_head
                                                                    : ad->head_dim;
    KILN_TRY(hf_get_int(root, "head_dim", label, 1, 0, hd_default, &c->head_dim));
    KILN_TRY(hf_get_int(root, "max_position_embeddings", label, 1, 0, ad->n_ctx_train,
                        &c->n_ctx_train));
    KILN_TRY(hf_get_pos_float(root, "rms_norm_eps", label, "", 0, 1e-6f, &c->rms_eps));
    if (c->arch != KILN_ARCH_GEMMA3) KILN_TRY(hf_parse_rope(root, label, c));
    KILN_TRY(hf_get_bool(root, "tie_word_embeddings", label, ad->tied, &c->tie_embeddings));
    if (root != top) KILN_TRY(hf_get_bool(top, "tie_word_embeddings", label, c->tie_embeddings, &c->tie_embeddings));

    int attention_bias = 0, mlp_bias = 0;
    KILN_TRY(hf_get_bool(root, "attention_bias", label, 0, &attention_bias));
    KILN_TRY(hf_get_bool(root, "mlp_bias", label, 0, &mlp_bias));
    switch (c->arch) {
    case KILN_ARCH_LLAMA:
        c->attn_bias = c->attn_out_bias = attention_bias;
        c->mlp_bias = mlp_bias;
        break;
    case KILN_ARCH_QWEN3:
        c->attn_bias = c->attn_out_bias = attention_bias;
        c->qk_norm = 1;
        break;
    case KILN_ARCH_QWEN2:
        c->attn_bias = 1;
        break;
    case KILN_ARCH_MISTRAL:
        break;
    case KILN_ARCH_GEMMA3:
        KILN_TRY(hf_parse_gemma3(root, label, c));
        break;
    case KILN_ARCH_QWEN35:
        if (attention_bias)
            return kiln_error(KILN_ERR_UNSUPPORTED, "%s: attention_bias: Qwen3.5 with attention biases is not supported",
                              label);
        KILN_TRY(hf_parse_qwen35(root, label, c));
        break;
    }
    if (c->arch != KILN_ARCH_GEMMA3 && c->arch != KILN_ARCH_QWEN35) KILN_TRY(hf_parse_sliding(root, label, c));

    /* Token ids: absent takes the type's default; null means none. */
    if (root != top && !cJSON_GetObjectItemCaseSensitive(root, "eos_token_id")) root = top;
    const cJSON *bos = cJSON_GetObjectItemCaseSensitive(root, "bos_token_id");
    c->bos_id = ad->bos_id;
    if (bos) {
        int b;
        KILN_TRY(hf_get_int(root, "bos_token_id", label, 0, 0, -1, &b));
        c->bos_id = b;
    }
    if (cJSON_GetObjectItemCaseSensitive(root, "eos_token_id")) {
        KILN_TRY(hf_get_eos(root, label, c->eos_ids, &c->n_eos_ids, &c->eos_id));
    } else if (ad->eos_id >= 0) {
        c->eos_id = ad->eos_id;
        c->eos_ids[0] = ad->eos_id;
        c->n_eos_ids = 1;
    } else {
        c->eos_id = -1;
    }
    return KILN_OK;
}

kiln_status kiln_hf_config_parse(const char *json, size_t len, const char *label,
                                 kiln_model_config *out) {
    if (!label) label = "config.json";
    if ((!json && len) || !out)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_hf_config_parse: NULL argument");
    KILN_TRY(kiln_json_check_no_nul(json, len, label));
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(json ? json : "", len, &end, 0);
    if (!root) {
        size_t at = end && json && end >= json && end <= json + len ? (size_t)(end - json) : 0;
        return kiln_error(KILN_ERR_FORMAT, "%s: not valid JSON (at byte %zu)", label, at);
    }
    for (const char *p = end; p < json + len; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            cJSON_Delete(root);
            return kiln_error(KILN_ERR_FORMAT, "%s: trailing bytes after the JSON value (at byte %zu)",
                              label, (size_t)(p - json));
        }
    }
    kiln_model_config c;
    kiln_status st = hf_parse_root(root, label, &c);
    cJSON_Delete(root);
    if (st == KILN_OK) st = kiln_model_config_validate(&c, label);
    if (st == KILN_OK) *out = c;
    return st;
}

/* <dir>/<name> into a kiln_malloc'd string. */
static char *hf_path_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = kiln_malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

/* generation_config.json: its eos_token_id extends c's list (the file may hold nothing else). */
static kiln_status hf_merge_generation_config(const char *path, kiln_model_config *c) {
    char *text = NULL;
    size_t len = 0;
    KILN_TRY(kiln_read_text_file(path, HF_CONFIG_CAP, &text, &len));
    kiln_status st0 = kiln_json_check_no_nul(text, len, path);
    if (st0 != KILN_OK) {
        kiln_free(text);
        return st0;
    }
    cJSON *root = cJSON_ParseWithLengthOpts(text, len + 1, NULL, 1); /* text ends in NUL */
    kiln_free(text);
    if (!root) return kiln_error(KILN_ERR_FORMAT, "%s: not valid JSON", path);
    kiln_status st = KILN_OK;
    if (!cJSON_IsObject(root)) st = kiln_error(KILN_ERR_FORMAT, "%s: not a JSON object", path);
    if (st == KILN_OK) st = hf_check_unique_keys(root, path, "");
    int32_t first;
    if (st == KILN_OK) st = hf_get_eos(root, path, c->eos_ids, &c->n_eos_ids, &first);
    if (st == KILN_OK && c->eos_id < 0 && c->n_eos_ids > 0) c->eos_id = c->eos_ids[0];
    cJSON_Delete(root);
    return st;
}

kiln_status kiln_hf_config_load_dir(const char *dir, kiln_model_config *out) {
    if (!dir || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_hf_config_load_dir: NULL argument");
    char *path = hf_path_join(dir, "config.json");
    if (!path) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", dir);
    char *text = NULL;
    size_t len = 0;
    kiln_model_config c;
    kiln_status st = kiln_read_text_file(path, HF_CONFIG_CAP, &text, &len);
    if (st == KILN_OK) st = kiln_hf_config_parse(text, len, path, &c);
    kiln_free(text);
    kiln_free(path);
    if (st != KILN_OK) return st;

    path = hf_path_join(dir, "generation_config.json");
    if (!path) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", dir);
    int present = 0;
    st = kiln_path_optional_file(path, &present);
    if (st == KILN_OK && present) {
        st = hf_merge_generation_config(path, &c);
        if (st == KILN_OK) st = kiln_model_config_validate(&c, path);
    }
    kiln_free(path);
    if (st == KILN_OK) *out = c;
    return st;
}
