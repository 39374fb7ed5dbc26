/*
 * hf_export.c -- writing a Hugging Face model folder: config.json and generation_config.json
 * (transformers 5.24's layout, read back by hf_config.c to the same kiln_model_config), and the
 * folder itself from a source of named tensors (model.safetensors, f32 or bf16 rounded to
 * nearest even) and the caller's other files. It knows nothing of where the tensors come from:
 * kiln_train_export_hf (src/train/export_hf.c) hands it a trainer's parameters and the model's
 * tokenizer files.
 *
 * Weights come one tensor at a time from the source, so the export holds at most one tensor
 * (plus its bf16 copy) in memory.
 *
 * Atomicity: everything is written into <dir>.tmp-<pid> (each file fsync'd, then the folder),
 * which is renamed to <dir>; with overwrite, an existing <dir> is swapped out with
 * renameat2(RENAME_EXCHANGE) (two renames where the file system lacks it) and then removed,
 * and the parent folder is fsync'd. A failure at any step removes the temporary folder.
 */
#define _GNU_SOURCE /* renameat2 */
#include "hf_export.h"

#include "safetensors_write.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- config.json --------------------------------------------------------------------------- */

/* The shortest decimal that reads back as f (so 1e-5f is written 1e-05, as a person would). */
static double hx_float(float f) {
    char buf[32];
    for (int prec = 6; prec <= 9; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, (double)f);
        if (strtof(buf, NULL) == f) return strtod(buf, NULL);
    }
    return (double)f;
}

typedef struct hx_arch {
    kiln_arch arch;
    const char *model_type, *architecture;
} hx_arch;

static const hx_arch hx_archs[] = {
    {KILN_ARCH_LLAMA, "llama", "LlamaForCausalLM"},
    {KILN_ARCH_MISTRAL, "mistral", "MistralForCausalLM"},
    {KILN_ARCH_QWEN2, "qwen2", "Qwen2ForCausalLM"},
    {KILN_ARCH_QWEN3, "qwen3", "Qwen3ForCausalLM"},
    {KILN_ARCH_GEMMA3, "gemma3_text", "Gemma3ForCausalLM"},
    {KILN_ARCH_QWEN35, "qwen3_5_text", "Qwen3_5ForCausalLM"},
};

/* Which bias / norm layouts each model_type can say (see hf_config.c's file comment). */
static kiln_status hx_check_layout(const kiln_model_config *c, const char *type) {
    int ok;
    switch (c->arch) {
    case KILN_ARCH_LLAMA: ok = c->attn_bias == c->attn_out_bias && !c->qk_norm; break;
    case KILN_ARCH_QWEN3: ok = c->attn_bias == c->attn_out_bias && !c->mlp_bias && c->qk_norm; break;
    case KILN_ARCH_QWEN2: ok = c->attn_bias && !c->attn_out_bias && !c->mlp_bias && !c->qk_norm; break;
    case KILN_ARCH_GEMMA3:
    case KILN_ARCH_QWEN35: ok = !c->attn_bias && !c->attn_out_bias && !c->mlp_bias && c->qk_norm; break;
    default: ok = !c->attn_bias && !c->attn_out_bias && !c->mlp_bias && !c->qk_norm; break;
    }
    if (!ok)
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "config.json: model_type %s cannot express q/k/v bias %d, o bias %d, mlp "
                          "bias %d, q/k norm %d", type, c->attn_bias, c->attn_out_bias, c->mlp_bias,
                          c->qk_norm);
    if (c->arch == KILN_ARCH_GEMMA3 && c->rope_scaling != KILN_ROPE_SCALING_NONE &&
        c->rope_scaling != KILN_ROPE_SCALING_LINEAR)
        return kiln_error(KILN_ERR_UNSUPPORTED, "config.json: gemma3_text's RoPE is default or linear, not llama3");
    return KILN_OK;
}

/* An id or null. */
static cJSON *hx_id(int32_t id) { return id >= 0 ? cJSON_CreateNumber(id) : cJSON_CreateNull(); }

/* The eos ids: null, an int, or a list. */
static cJSON *hx_eos(const kiln_model_config *c) {
    if (c->n_eos_ids == 0) return hx_id(c->eos_id);
    if (c->n_eos_ids == 1) return cJSON_CreateNumber(c->eos_ids[0]);
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; a && i < c->n_eos_ids; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(c->eos_ids[i]));
    return a;
}

static kiln_status hx_print(cJSON *root, int ok, const char *what, char **out) {
    char *s = ok && root ? cJSON_Print(root) : NULL;
    cJSON_Delete(root);
    if (!s) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", what);
    *out = kiln_strdup(s);
    free(s);
    if (!*out) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", what);
    return KILN_OK;
}

kiln_status kiln_hf_config_write(const kiln_model_config *c, const char *dtype, char **out) {
    if (!c || !dtype || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_hf_config_write: NULL argument");
    const hx_arch *a = NULL;
    for (size_t i = 0; i < sizeof hx_archs / sizeof hx_archs[0]; i++)
        if (hx_archs[i].arch == c->arch) a = &hx_archs[i];
    if (!a) return kiln_error(KILN_ERR_UNSUPPORTED, "config.json: architecture %d has no model_type", (int)c->arch);
    KILN_TRY(hx_check_layout(c, a->model_type));
    if (c->n_eos_ids > 0 && c->eos_id != c->eos_ids[0])
        return kiln_error(KILN_ERR_UNSUPPORTED, "config.json: eos_token_id %d is not the first of the "
                          "end-of-generation ids (%d)", c->eos_id, c->eos_ids[0]);

    cJSON *r = cJSON_CreateObject();
    int ok = r != NULL;
#define ADD(key, item) (ok = ok && cJSON_AddItemToObject(r, key, item))
    cJSON *archs = cJSON_CreateArray();
    if (archs) cJSON_AddItemToArray(archs, cJSON_CreateString(a->architecture));
    ADD("architectures", archs);
    ADD("model_type", cJSON_CreateString(a->model_type));
    ADD("hidden_size", cJSON_CreateNumber(c->n_embd));
    ADD("intermediate_size", cJSON_CreateNumber(c->n_ff));
    ADD("num_hidden_layers", cJSON_CreateNumber(c->n_layer));
    ADD("num_attention_heads", cJSON_CreateNumber(c->n_head));
    ADD("num_key_value_heads", cJSON_CreateNumber(c->n_head_kv));
    ADD("head_dim", cJSON_CreateNumber(c->head_dim));
    ADD("vocab_size", cJSON_CreateNumber(c->n_vocab));
    ADD("max_position_embeddings", cJSON_CreateNumber(c->n_ctx_train));
    ADD("rms_norm_eps", cJSON_CreateNumber(hx_float(c->rms_eps)));
    if (c->arch == KILN_ARCH_GEMMA3)
        ADD("hidden_activation", cJSON_CreateString("gelu_pytorch_tanh"));
    else
        ADD("hidden_act", cJSON_CreateString("silu"));
    ADD("tie_word_embeddings", cJSON_CreateBool(c->tie_embeddings));
    if (c->arch == KILN_ARCH_LLAMA || c->arch == KILN_ARCH_QWEN3 || c->arch == KILN_ARCH_GEMMA3 ||
        c->arch == KILN_ARCH_QWEN35)
        ADD("attention_bias", cJSON_CreateBool(c->attn_bias));
    if (c->arch == KILN_ARCH_LLAMA) ADD("mlp_bias", cJSON_CreateBool(c->mlp_bias));
    ADD("attention_dropout", cJSON_CreateNumber(0.0));
    ADD("initializer_range", cJSON_CreateNumber(0.02));
    ADD("bos_token_id", hx_id(c->bos_id));
    ADD("eos_token_id", hx_eos(c));
    ADD("pad_token_id", cJSON_CreateNull());

    /* RoPE: transformers 5's rope_parameters (Gemma 3: one per layer kind) */
    cJSON *rp = cJSON_CreateObject();
    if (rp && c->arch == KILN_ARCH_GEMMA3) {
        cJSON *full = cJSON_AddObjectToObject(rp, "full_attention");
        cJSON *slid = cJSON_AddObjectToObject(rp, "sliding_attention");
        if (full) {
            cJSON_AddStringToObject(full, "rope_type", c->rope_scaling == KILN_ROPE_SCALING_LINEAR ? "linear" : "default");
            cJSON_AddNumberToObject(full, "rope_theta", hx_float(c->rope_theta));
            if (c->rope_scaling == KILN_ROPE_SCALING_LINEAR) cJSON_AddNumberToObject(full, "factor", hx_float(c->rope_factor));
        }
        if (slid) {
            cJSON_AddStringToObject(slid, "rope_type", "default");
            cJSON_AddNumberToObject(slid, "rope_theta", hx_float(c->rope_theta_local));
        }
    } else if (rp) {
        cJSON_AddNumberToObject(rp, "rope_theta", hx_float(c->rope_theta));
        const char *type = c->rope_scaling == KILN_ROPE_SCALING_LINEAR   ? "linear"
                           : c->rope_scaling == KILN_ROPE_SCALING_LLAMA3 ? "llama3"
                                                                         : "default";
        cJSON_AddStringToObject(rp, "rope_type", type);
        if (c->arch == KILN_ARCH_QWEN35) /* an exact binary fraction of head_dim */
            cJSON_AddNumberToObject(rp, "partial_rotary_factor", (double)kiln_rotary_dim(c) / (double)c->head_dim);
        if (c->rope_scaling != KILN_ROPE_SCALING_NONE)
            cJSON_AddNumberToObject(rp, "factor", hx_float(c->rope_factor));
        if (c->rope_scaling == KILN_ROPE_SCALING_LLAMA3) {
            cJSON_AddNumberToObject(rp, "low_freq_factor", hx_float(c->rope_low_freq_factor));
            cJSON_AddNumberToObject(rp, "high_freq_factor", hx_float(c->rope_high_freq_factor));
            cJSON_AddNumberToObject(rp, "original_max_position_embeddings", c->rope_original_max_pos);
        }
    }
    ADD("rope_parameters", rp);

    /* sliding window: Mistral's applies to every layer; Qwen's only with use_sliding_window
     * and then per layer_types, which kiln has all-or-none */
    int sw = c->sliding_window;
    if (c->arch == KILN_ARCH_MISTRAL) {
        ADD("sliding_window", sw > 0 ? cJSON_CreateNumber(sw) : cJSON_CreateNull());
    } else if (c->arch == KILN_ARCH_QWEN2 || c->arch == KILN_ARCH_QWEN3) {
        ADD("use_sliding_window", cJSON_CreateBool(sw > 0));
        ADD("sliding_window", sw > 0 ? cJSON_CreateNumber(sw) : cJSON_CreateNull());
        ADD("max_window_layers", cJSON_CreateNumber(sw > 0 ? 0 : c->n_layer));
        cJSON *lt = cJSON_CreateArray();
        for (int l = 0; lt && l < c->n_layer; l++)
            cJSON_AddItemToArray(lt, cJSON_CreateString(sw > 0 ? "sliding_attention" : "full_attention"));
        ADD("layer_types", lt);
    } else if (c->arch == KILN_ARCH_GEMMA3) {
        /* the window and which layers take it; Gemma's query scale; no soft-caps */
        ADD("sliding_window", cJSON_CreateNumber(sw));
        cJSON *lt = cJSON_CreateArray();
        for (int l = 0; lt && l < c->n_layer; l++)
            cJSON_AddItemToArray(lt, cJSON_CreateString(kiln_layer_slides(c, l) ? "sliding_attention" : "full_attention"));
        ADD("layer_types", lt);
        ADD("query_pre_attn_scalar", cJSON_CreateNumber(hx_float(c->query_pre_attn_scalar)));
        ADD("final_logit_softcapping", cJSON_CreateNull());
        ADD("attn_logit_softcapping", cJSON_CreateNull());
        ADD("use_bidirectional_attention", cJSON_CreateBool(0));
    } else if (c->arch == KILN_ARCH_QWEN35) {
        /* the layer kinds and the linear layers' widths */
        cJSON *lt = cJSON_CreateArray();
        for (int l = 0; lt && l < c->n_layer; l++)
            cJSON_AddItemToArray(lt, cJSON_CreateString(kiln_layer_linear(c, l) ? "linear_attention" : "full_attention"));
        ADD("layer_types", lt);
        ADD("linear_num_key_heads", cJSON_CreateNumber(c->lin_nk));
        ADD("linear_num_value_heads", cJSON_CreateNumber(c->lin_nv));
        ADD("linear_key_head_dim", cJSON_CreateNumber(c->lin_dk));
        ADD("linear_value_head_dim", cJSON_CreateNumber(c->lin_dv));
        ADD("linear_conv_kernel_dim", cJSON_CreateNumber(c->lin_conv));
        ADD("attn_output_gate", cJSON_CreateBool(1));
    } else if (sw > 0) {
        cJSON_Delete(r);
        return kiln_error(KILN_ERR_UNSUPPORTED, "config.json: llama has no sliding window (%d)", sw);
    }
    ADD("dtype", cJSON_CreateString(dtype));
    ADD("use_cache", cJSON_CreateBool(1));
#undef ADD
    return hx_print(r, ok, "config.json", out);
}

kiln_status kiln_hf_generation_config_write(const kiln_model_config *c, char **out) {
    if (!c || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_hf_generation_config_write: NULL argument");
    cJSON *r = cJSON_CreateObject();
    int ok = r != NULL;
    ok = ok && cJSON_AddItemToObject(r, "bos_token_id", hx_id(c->bos_id));
    ok = ok && cJSON_AddItemToObject(r, "eos_token_id", hx_eos(c));
    return hx_print(r, ok, "generation_config.json", out);
}

/* ---- the folder ---------------------------------------------------------------------------- */

typedef struct hx_ctx {
    const kiln_hf_tensor_source *src;
    kiln_st_write_tensor *tensors;
    int64_t *n_elems;
    int bf16;
    float *f32; /* (max n) staging for bf16 rounding */
} hx_ctx;

static kiln_status hx_fill(void *user, int i, void *buf, size_t nbytes) {
    hx_ctx *x = user;
    int64_t n = x->n_elems[i];
    if (!x->bf16) return x->src->get(x->src->user, i, buf, n);
    KILN_TRY(x->src->get(x->src->user, i, x->f32, n));
    uint16_t *o = buf;
    for (int64_t k = 0; k < n; k++) o[k] = kiln_fp32_to_bf16(x->f32[k]);
    (void)nbytes;
    return KILN_OK;
}

static kiln_status hx_write_weights(const kiln_hf_tensor_source *src, const char *path, int bf16) {
    int n = src->n;
    if (n <= 0) return kiln_error(KILN_ERR_STATE, "%s: no tensors to write", path);
    hx_ctx x = {.src = src, .bf16 = bf16};
    x.tensors = kiln_calloc((size_t)n, sizeof *x.tensors);
    x.n_elems = kiln_calloc((size_t)n, sizeof *x.n_elems);
    kiln_status st = KILN_OK;
    if (!x.tensors || !x.n_elems) st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory", path);
    int64_t max_n = 0;
    for (int i = 0; st == KILN_OK && i < n; i++) {
        const char *name;
        int n_dims;
        int64_t ne, shape[3] = {1, 1, 1};
        st = src->info(src->user, i, &name, &ne, &n_dims, shape);
        if (st != KILN_OK) break;
        kiln_st_write_tensor *w = &x.tensors[i];
        w->name = name;
        w->dtype = bf16 ? KILN_DTYPE_BF16 : KILN_DTYPE_F32;
        w->n_dims = n_dims < 1 ? 1 : n_dims > 3 ? 3 : n_dims;
        int64_t held = 1;
        for (int k = 0; k < 3; k++) {
            w->shape[k] = k < w->n_dims ? shape[k] : 1;
            held *= w->shape[k];
        }
        if (held != ne)
            st = kiln_error(KILN_ERR_INTERNAL, "%s: parameter '%s': shape (%lld, %lld, %lld) does not hold %lld "
                            "elements", path, name, (long long)w->shape[0], (long long)w->shape[1],
                            (long long)w->shape[2], (long long)ne);
        x.n_elems[i] = ne;
        if (ne > max_n) max_n = ne;
    }
    if (st == KILN_OK && bf16)
        st = kiln_alloc_or_fail((void **)&x.f32, (size_t)max_n * sizeof(float), "export staging buffer");
    static const char *const meta[] = {"format", "pt", NULL};
    if (st == KILN_OK) st = kiln_safetensors_write(path, x.tensors, n, meta, hx_fill, &x);
    kiln_free(x.f32);
    kiln_free(x.tensors);
    kiln_free(x.n_elems);
    return st;
}

static char *hx_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = kiln_malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

kiln_status kiln_hf_folder_write_text(const char *dir, const char *name, const char *text) {
    char *p = hx_join(dir, name);
    if (!p) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", dir);
    kiln_status st = kiln_write_file_durable(p, text, strlen(text));
    kiln_free(p);
    return st;
}

kiln_status kiln_hf_folder_copy_file(const char *src_dir, const char *dir, const char *name,
                                     int *copied) {
    *copied = 0;
    char *src = hx_join(src_dir, name), *dst = hx_join(dir, name);
    kiln_status st = (!src || !dst) ? kiln_error(KILN_ERR_NOMEM, "%s: out of memory", dir) : KILN_OK;
    int present = 0;
    if (st == KILN_OK) st = kiln_path_optional_file(src, &present);
    if (st == KILN_OK && present) {
        kiln_file_map m;
        st = kiln_file_map_open(src, 0, &m);
        if (st == KILN_OK) {
            st = kiln_write_file_durable(dst, m.data, m.size);
            kiln_file_map_close(&m);
            *copied = st == KILN_OK;
        }
    }
    kiln_free(src);
    kiln_free(dst);
    return st;
}

/* Everything into the (new, empty) folder tmp. */
static kiln_status hx_write_all(const kiln_hf_folder *f, const char *tmp) {
    char *text = NULL;
    KILN_TRY(kiln_hf_config_write(f->cfg, f->bf16 ? "bfloat16" : "float32", &text));
    kiln_status st = kiln_hf_folder_write_text(tmp, "config.json", text);
    kiln_free(text);
    KILN_TRY(st);
    KILN_TRY(kiln_hf_generation_config_write(f->cfg, &text));
    st = kiln_hf_folder_write_text(tmp, "generation_config.json", text);
    kiln_free(text);
    KILN_TRY(st);
    if (f->write_files) KILN_TRY(f->write_files(f->files_user, tmp));
    char *p = hx_join(tmp, "model.safetensors");
    if (!p) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", tmp);
    st = hx_write_weights(&f->tensors, p, f->bf16);
    kiln_free(p);
    KILN_TRY(st);
    return kiln_fsync_path(tmp);
}

/* Put tmp in place of dir (which exists only when overwriting). */
static kiln_status hx_publish(const char *tmp, const char *dir, int exists) {
    if (!exists) {
        if (rename(tmp, dir) != 0)
            return kiln_error(KILN_ERR_IO, "%s: cannot rename to %s: %s", tmp, dir, strerror(errno));
        return KILN_OK;
    }
    if (renameat2(AT_FDCWD, tmp, AT_FDCWD, dir, RENAME_EXCHANGE) == 0)
        return kiln_remove_tree(tmp); /* tmp now names the old folder */
    if (errno != EINVAL && errno != ENOSYS)
        return kiln_error(KILN_ERR_IO, "%s: cannot exchange with %s: %s", tmp, dir, strerror(errno));
    /* no atomic exchange here: move the old folder aside, then the new one in */
    size_t n = strlen(dir) + 32;
    char *old = kiln_malloc(n);
    if (!old) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", dir);
    snprintf(old, n, "%s.old-%ld", dir, (long)getpid());
    kiln_status st = KILN_OK;
    if (rename(dir, old) != 0) {
        st = kiln_error(KILN_ERR_IO, "%s: cannot move aside to %s: %s", dir, old, strerror(errno));
    } else if (rename(tmp, dir) != 0) {
        st = kiln_error(KILN_ERR_IO, "%s: cannot rename to %s: %s", tmp, dir, strerror(errno));
        rename(old, dir); /* put the old one back */
    } else {
        st = kiln_remove_tree(old);
    }
    kiln_free(old);
    return st;
}

kiln_status kiln_hf_folder_write(const char *dir, int overwrite, const kiln_hf_folder *f) {
    if (!f || !f->cfg || !f->tensors.info || !f->tensors.get || !dir || !dir[0])
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_hf_folder_write: NULL argument");
    /* "out/" and "out" are the same folder; the temporary one must be its sibling */
    size_t len = strlen(dir);
    while (len > 1 && dir[len - 1] == '/') len--;
    char *target = kiln_strndup(dir, len);
    char *tmp = kiln_malloc(len + 32);
    char *parent = kiln_malloc(len + 2);
    kiln_status st = KILN_OK;
    if (!target || !tmp || !parent) st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory", dir);
    struct stat sb;
    int exists = 0;
    if (st == KILN_OK) {
        snprintf(tmp, len + 32, "%s.tmp-%ld", target, (long)getpid());
        const char *slash = strrchr(target, '/');
        if (!slash) snprintf(parent, len + 2, ".");
        else if (slash == target) snprintf(parent, len + 2, "/");
        else snprintf(parent, len + 2, "%.*s", (int)(slash - target), target);
        exists = lstat(target, &sb) == 0;
        if (exists && !overwrite)
            st = kiln_error(KILN_ERR_INVALID_ARG, "%s: already exists (export refuses to replace it "
                            "unless overwrite is set)", target);
        else if (exists && !S_ISDIR(sb.st_mode))
            st = kiln_error(KILN_ERR_INVALID_ARG, "%s: exists and is not a folder", target);
    }
    if (st == KILN_OK) st = kiln_remove_tree(tmp); /* a stale one of a dead writer */
    if (st == KILN_OK && mkdir(tmp, 0755) != 0)
        st = kiln_error(KILN_ERR_IO, "%s: cannot create folder: %s", tmp, strerror(errno));
    if (st == KILN_OK) {
        st = hx_write_all(f, tmp);
        if (st == KILN_OK) st = hx_publish(tmp, target, exists);
        if (st == KILN_OK) st = kiln_fsync_path(parent);
        else kiln_remove_tree(tmp); /* best effort; the first error is the one reported */
    }
    kiln_free(target);
    kiln_free(tmp);
    kiln_free(parent);
    return st;
}

