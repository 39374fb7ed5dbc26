/*
 * safetensors_write.h -- writing .safetensors files, and the small durable-file helpers the
 * Hugging Face folder export shares (write a file through a temporary name, fsync, rename).
 *
 * File layout written (https://huggingface.co/docs/safetensors), as the reference library
 * writes it:
 *   u64 LE  N          header length; N is a multiple of 8 (the JSON is padded with spaces)
 *   N bytes JSON       {"__metadata__": {...}, name: {"dtype", "shape", "data_offsets"}, ...}
 *   data               tensors back to back, in header order, no gaps
 * Tensors are laid out in the order the reference Python library uses: by element size
 * (largest first, so every tensor is aligned to its element size inside the 8-aligned data
 * section), then by name. The header lists them in that same order.
 */
#ifndef KILN_SAFETENSORS_WRITE_H
#define KILN_SAFETENSORS_WRITE_H

#include "../base/tensor.h"

/* Fills buf (nbytes, the tensor's exact size) with tensor i's data (the index into the
 * caller's array). Return KILN_OK, or an error (with its message set) to abort the write. */
typedef kiln_status (*kiln_st_fill_fn)(void *user, int i, void *buf, size_t nbytes);

typedef struct kiln_st_write_tensor {
    const char *name;             /* unique, non-empty, not "__metadata__" */
    kiln_dtype dtype;             /* F32, F16, BF16, I32 or I64 */
    int n_dims;                   /* 0..KILN_MAX_DIMS (0: a scalar) */
    int64_t shape[KILN_MAX_DIMS]; /* outermost first */
    const void *data;             /* the bytes, or NULL to ask fill for them */
} kiln_st_write_tensor;

/* Write tensors[0..n) to path. metadata: NULL or a NULL-terminated list of key, value
 * strings for "__metadata__" (e.g. {"format", "pt", NULL}). Tensors with data == NULL are
 * fetched one at a time through fill into one buffer of the largest such tensor, so memory
 * stays at one tensor. The file is written as <path>.tmp-<pid>, fsync'd, renamed to path,
 * and the folder fsync'd; on any failure (bad argument, fill error, a full disk) the
 * temporary file is removed and path is left as it was. */
kiln_status kiln_safetensors_write(const char *path, const kiln_st_write_tensor *tensors, int n,
                                   const char *const *metadata, kiln_st_fill_fn fill, void *user);

/* Write len bytes to path the same durable way (temporary name, fsync, rename, folder
 * fsync); nothing is left behind on failure. */
kiln_status kiln_write_file_durable(const char *path, const void *data, size_t len);


/* Remove path: a file, or a folder and everything in it (symbolic links are removed, never
 * followed). Returns KILN_ERR_IO naming the first entry that could not be removed. */
kiln_status kiln_remove_tree(const char *path);

#endif /* KILN_SAFETENSORS_WRITE_H */
