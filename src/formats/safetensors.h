/*
 * safetensors.h -- reader for .safetensors files and sharded sets with
 * model.safetensors.index.json (https://huggingface.co/docs/safetensors).
 *
 * Validation before any use: header length (8-byte LE) within the file and below a cap,
 * header is a JSON object, each tensor has a known dtype, a shape of <= 4 non-negative dims
 * whose element count and byte count do not overflow, data_offsets [begin, end) inside the
 * data section with end - begin equal to the byte count, no two tensors overlapping, no holes
 * (the data section is covered exactly, as the format requires), duplicate names refused,
 * "__metadata__" a string-to-string map. Errors name the file, the tensor and the field.
 */
#ifndef KILN_SAFETENSORS_H
#define KILN_SAFETENSORS_H

#include "../base/tensor.h"

typedef struct kiln_safetensors kiln_safetensors;

/* Open one file. */
kiln_status kiln_safetensors_open(const char *path, int use_mmap, kiln_safetensors **out);
/* Over a caller-owned buffer (fuzzing, tests); it must outlive the handle. */
kiln_status kiln_safetensors_open_memory(const uint8_t *data, size_t size, const char *label,
                                         kiln_safetensors **out);
/* Open a model folder's weights: model.safetensors, or the shards listed in
 * model.safetensors.index.json (each shard validated; every name in the index's weight_map
 * must be found in the shard it names, and names must be unique across shards). */
kiln_status kiln_safetensors_open_dir(const char *dir, int use_mmap, kiln_safetensors **out);
void kiln_safetensors_close(kiln_safetensors *st);

int64_t kiln_safetensors_n_tensors(const kiln_safetensors *st);
const kiln_tensor *kiln_safetensors_tensor_at(const kiln_safetensors *st, int64_t i);
const kiln_tensor *kiln_safetensors_find(const kiln_safetensors *st, const char *name);

#endif /* KILN_SAFETENSORS_H */
