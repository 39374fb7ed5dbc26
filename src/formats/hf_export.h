/*
 * hf_export.h -- writing a Hugging Face model folder (the public entry is
 * kiln_train_export_hf in kiln.h; these are its parts, for tests and other writers).
 */
#ifndef KILN_HF_EXPORT_H
#define KILN_HF_EXPORT_H

#include "../models/config.h"

/* config.json text (kiln_malloc'd, NUL-terminated) for c, in transformers 5.24's layout
 * (rope_parameters, dtype), such that kiln_hf_config_parse gives c back field for field.
 * dtype: "float32" or "bfloat16". Absent token ids (-1, no eos_ids) are written as null.
 * KILN_ERR_UNSUPPORTED for a configuration that transformers cannot express (e.g. Llama
 * with biases on q/k/v but not o). */
kiln_status kiln_hf_config_write(const kiln_model_config *c, const char *dtype, char **out);

/* generation_config.json text: bos_token_id and eos_token_id (every id of c->eos_ids). */
kiln_status kiln_hf_generation_config_write(const kiln_model_config *c, char **out);

#endif /* KILN_HF_EXPORT_H */
