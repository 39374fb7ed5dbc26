/*
 * hf_export.h -- writing a Hugging Face model folder (config.json, generation_config.json,
 * model.safetensors and the caller's other files), from a config and a source of named
 * tensors; the public kiln_train_export_hf (kiln.h, src/train/export_hf.c) is one caller.
 */
#ifndef KILN_HF_EXPORT_H
#define KILN_HF_EXPORT_H

#include "model_config.h"

/* config.json text (kiln_malloc'd, NUL-terminated) for c, in transformers 5.24's layout
 * (rope_parameters, dtype), such that kiln_hf_config_parse gives c back field for field.
 * dtype: "float32" or "bfloat16". Absent token ids (-1, no eos_ids) are written as null.
 * KILN_ERR_UNSUPPORTED for a configuration that transformers cannot express (e.g. Llama
 * with biases on q/k/v but not o). */
kiln_status kiln_hf_config_write(const kiln_model_config *c, const char *dtype, char **out);

/* generation_config.json text: bos_token_id and eos_token_id (every id of c->eos_ids). */
kiln_status kiln_hf_generation_config_write(const kiln_model_config *c, char **out);

/* The tensors of model.safetensors, in file order, from the caller. */
typedef struct kiln_hf_tensor_source {
    int n; /* tensors, >= 1 */
    /* Tensor i's name (the source's, valid until the write returns), element count and shape:
     * n_dims 1 to 3 (shape[0] x ... x shape[n_dims - 1], row-major). */
    kiln_status (*info)(void *user, int i, const char **name, int64_t *n_elems, int *n_dims,
                        int64_t shape[3]);
    /* Tensor i's n_elems values, as f32, into dst. */
    kiln_status (*get)(void *user, int i, float *dst, int64_t n_elems);
    void *user;
} kiln_hf_tensor_source;

/* A folder to write. */
typedef struct kiln_hf_folder {
    const kiln_model_config *cfg;    /* config.json and generation_config.json */
    int bf16;                        /* the weights in bf16 (rounded to nearest even) and
                                      * config.json's dtype "bfloat16"; else f32, "float32" */
    kiln_hf_tensor_source tensors;   /* model.safetensors */
    /* Optional: write the folder's other files (a tokenizer's) into dir, the folder being
     * written (kiln_hf_folder_write_text and kiln_hf_folder_copy_file help). */
    kiln_status (*write_files)(void *user, const char *dir);
    void *files_user;
} kiln_hf_folder;

/* Write f as the folder dir, atomically: into a temporary sibling (each file and the folder
 * fsync'd), renamed into place; an existing dir is refused unless overwrite, then replaced
 * (exchanged where the file system can, and removed); the parent is fsync'd. On any error the
 * temporary folder is removed and dir is as it was. Order: config.json,
 * generation_config.json, write_files, model.safetensors (one tensor in memory at a time). */
kiln_status kiln_hf_folder_write(const char *dir, int overwrite, const kiln_hf_folder *f);

/* dir/name = text, durably (fsync'd). */
kiln_status kiln_hf_folder_write_text(const char *dir, const char *name, const char *text);

/* Copy src_dir/name to dir/name, durably, when it exists; *copied says whether it did. */
kiln_status kiln_hf_folder_copy_file(const char *src_dir, const char *dir, const char *name,
                                     int *copied);

#endif /* KILN_HF_EXPORT_H */
