/*
 * export_hf.c -- kiln_train_export_hf: a trainer's weights as a Hugging Face folder, written by
 * formats/hf_export.c from what this file hands it: the model's config (with the token ids a
 * GGUF keeps in its tokenizer), the trainer's parameters through its public API
 * (kiln_train_param_info, kiln_train_get_param: one tensor at a time), and the tokenizer
 * files. The tokenizer files of a model that came from a Hugging Face folder are copied byte
 * for byte (they are the exact description, which kiln's compiled form does not fully keep: a
 * custom regex split); a GGUF's tokenizer is written by tok_export.c. kiln_train_fingerprint
 * hashes the tensors such an export would hold in f32 (docs/REPRODUCIBILITY.md).
 */
#include "../base/sha256.h"
#include "../formats/hf_export.h"
#include "../models/model.h"
#include "../tokenizer/tokenizer.h"
#include "trainer.h"

#include <stdio.h>
#include <string.h>

/* ---- the tensors: the trainer's parameters ------------------------------------------------- */

/* 1-D parameters: norms and biases (transformers' shapes); everything else is a matrix. */
static kiln_status tx_info(void *user, int i, const char **name, int64_t *n_elems, int *n_dims,
                           int64_t shape[3]) {
    const kiln_trainer *t = user;
    KILN_TRY(kiln_train_param_info(t, i, name, n_elems, NULL));
    return kiln_train_param_file_shape(t, i, n_dims, shape);
}

static kiln_status tx_get(void *user, int i, float *dst, int64_t n) {
    const kiln_trainer *t = user;
    const char *name;
    int64_t ne, shape[2];
    KILN_TRY(kiln_train_param_info(t, i, &name, &ne, shape));
    return kiln_train_get_param(t, name, dst, n);
}

/* ---- the tokenizer files ------------------------------------------------------------------- */

static kiln_status hx_write_tokenizer(void *user, const char *dir) {
    const kiln_model *m = user;
    const kiln_tokenizer *tok = m->tok;
    if (!tok) return kiln_error(KILN_ERR_STATE, "kiln_train_export_hf: the model has no tokenizer");
    int from_hf = m->st && m->path && kiln_path_is_dir(m->path);
    int have_json = 0, have_cfg = 0, copied;
    if (from_hf) {
        KILN_TRY(kiln_hf_folder_copy_file(m->path, dir, "tokenizer.json", &have_json));
        if (have_json) {
            KILN_TRY(kiln_hf_folder_copy_file(m->path, dir, "tokenizer_config.json", &have_cfg));
            KILN_TRY(kiln_hf_folder_copy_file(m->path, dir, "special_tokens_map.json", &copied));
            KILN_TRY(kiln_hf_folder_copy_file(m->path, dir, "chat_template.jinja", &copied));
        }
    }
    char *text = NULL;
    if (!have_json) {
        KILN_TRY(kiln_tokenizer_write_hf_json(tok, &text, NULL));
        kiln_status st = kiln_hf_folder_write_text(dir, "tokenizer.json", text);
        kiln_free(text);
        KILN_TRY(st);
    }
    if (!have_cfg) {
        KILN_TRY(kiln_tokenizer_write_hf_config(tok, m->cfg.n_ctx_train, &text, NULL));
        kiln_status st = kiln_hf_folder_write_text(dir, "tokenizer_config.json", text);
        kiln_free(text);
        KILN_TRY(st);
    }
    return KILN_OK;
}

/* The model's config with the token ids a GGUF keeps in its tokenizer instead. */
static kiln_model_config hx_export_config(const kiln_model *m) {
    kiln_model_config c = m->cfg;
    kiln_tokenizer_info ti;
    if (kiln_tokenizer_get_info(m->tok, &ti) != KILN_OK) return c;
    if (c.bos_id < 0 && ti.bos_id >= 0 && ti.bos_id < c.n_vocab) c.bos_id = ti.bos_id;
    if (c.n_eos_ids == 0 && c.eos_id < 0) {
        int32_t cand[2] = {ti.eos_id, ti.eot_id};
        for (int i = 0; i < 2; i++) {
            if (cand[i] < 0 || cand[i] >= c.n_vocab) continue;
            if (c.n_eos_ids == 1 && c.eos_ids[0] == cand[i]) continue;
            c.eos_ids[c.n_eos_ids++] = cand[i];
        }
        if (c.n_eos_ids > 0) c.eos_id = c.eos_ids[0];
    }
    return c;
}

KILN_API kiln_status kiln_train_export_hf(const kiln_trainer *t, const char *dir, int dtype_bf16,
                                          int overwrite) {
    KILN_TRY(kiln_trainer_enter(t, "kiln_train_export_hf"));
    if (!dir || !dir[0]) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_export_hf: NULL argument");
    const kiln_model *m = kiln_trainer_model(t);
    if (!m) return kiln_error(KILN_ERR_INTERNAL, "kiln_train_export_hf: trainer without a model");
    if (m->rope_freq_factors)
        return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_train_export_hf: the model's RoPE frequency "
                          "factors (GGUF rope_freqs) have no config.json equivalent kiln writes");
    int n = kiln_train_n_model_params(t); /* not the extras */
    if (n <= 0) return kiln_error(KILN_ERR_STATE, "kiln_train_export_hf: the trainer has no parameters");
    const kiln_model_config c = hx_export_config(m);
    kiln_hf_folder f;
    memset(&f, 0, sizeof f);
    f.cfg = &c;
    f.bf16 = dtype_bf16 != 0;
    f.tensors.n = n;
    f.tensors.info = tx_info;
    f.tensors.get = tx_get;
    f.tensors.user = (void *)t;
    f.write_files = hx_write_tokenizer;
    f.files_user = (void *)m;
    return kiln_hf_folder_write(dir, overwrite, &f);
}

/* ---- the fingerprint of what an f32 export would hold -------------------------------------- */

KILN_API kiln_status kiln_train_fingerprint(const kiln_trainer *t, uint8_t out[32]) {
    KILN_TRY(kiln_trainer_enter(t, "kiln_train_fingerprint"));
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_fingerprint: out is NULL");
    int n = kiln_train_n_model_params(t); /* not the extras */
    if (n <= 0) return kiln_error(KILN_ERR_STATE, "kiln_train_fingerprint: the trainer has no parameters");
    kiln_fingerprint_entry *e = kiln_calloc((size_t)n, sizeof *e);
    if (!e) return kiln_error(KILN_ERR_NOMEM, "kiln_train_fingerprint: out of memory");
    float *buf = NULL;
    size_t cap = 0;
    kiln_status st = KILN_OK;
    for (int i = 0; i < n && st == KILN_OK; i++) {
        const char *name;
        int64_t ne, shape[2];
        st = kiln_train_param_info(t, i, &name, &ne, shape);
        if (st == KILN_OK) st = kiln_train_param_file_shape(t, i, &e[i].n_dims, e[i].shape);
        if (st != KILN_OK) break;
        snprintf(e[i].name, sizeof e[i].name, "%s", name);
        e[i].dtype = KILN_DTYPE_F32;
        e[i].nbytes = (uint64_t)ne * sizeof(float);
        if ((size_t)ne > cap) {
            kiln_free(buf);
            cap = (size_t)ne;
            buf = kiln_malloc(cap * sizeof(float));
            if (!buf) st = kiln_error(KILN_ERR_NOMEM, "kiln_train_fingerprint: out of memory for '%s'", name);
        }
        if (st == KILN_OK) st = kiln_train_get_param(t, name, buf, ne);
        if (st == KILN_OK) st = kiln_sha256(buf, (size_t)ne * sizeof(float), e[i].sha256);
    }
    if (st == KILN_OK) st = kiln_fingerprint_combine(e, n, out);
    kiln_free(buf);
    kiln_free(e);
    return st;
}
