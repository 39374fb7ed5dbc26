/*
 * hf_config.h -- Hugging Face model folder metadata: config.json and generation_config.json.
 * (tokenizer.json and tokenizer_config.json are read by the tokenizer layer.)
 */
#ifndef KILN_HF_CONFIG_H
#define KILN_HF_CONFIG_H

#include "model_config.h"

/* Parse config.json text into *out (arch from "model_type"/"architectures": llama, mistral,
 * qwen2, qwen3, and smollm2 which is "llama"). Missing optional fields take transformers'
 * defaults for that model_type; a missing required field, a wrong JSON type, a value out of
 * range, or an unsupported model_type / rope_scaling type is an error naming the field. */
kiln_status kiln_hf_config_parse(const char *json, size_t len, const char *label,
                                 kiln_model_config *out);

/* Read <dir>/config.json, and <dir>/generation_config.json if present (its eos_token_id,
 * int or list, extends out->eos_ids). */
kiln_status kiln_hf_config_load_dir(const char *dir, kiln_model_config *out);

#endif /* KILN_HF_CONFIG_H */
