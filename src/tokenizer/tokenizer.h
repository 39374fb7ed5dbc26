/*
 * tokenizer.h -- internal constructors of kiln_tokenizer (the public calls are in kiln.h).
 */
#ifndef KILN_TOKENIZER_H
#define KILN_TOKENIZER_H

#include "../base/base.h"
#include "../base/handle.h"
#include "../formats/gguf.h"

/* From GGUF metadata (tokenizer.ggml.*: model, pre, tokens, scores, token_type, merges,
 * bos/eos/eot/unk/pad ids, add_bos_token, add_eos_token, tokenizer.chat_template). */
kiln_status kiln_tokenizer_from_gguf(const kiln_gguf *g, kiln_tokenizer **out);

/* From a Hugging Face folder: tokenizer.json (+ tokenizer_config.json for the chat template,
 * add_bos/add_eos and special tokens). */
kiln_status kiln_tokenizer_from_hf_dir(const char *dir, kiln_tokenizer **out);

/* From tokenizer.json / tokenizer_config.json text (config may be NULL). */
kiln_status kiln_tokenizer_from_hf_json(const char *tokenizer_json, size_t len,
                                        const char *config_json, size_t config_len,
                                        const char *label, kiln_tokenizer **out);

/* Unregister (refused, nothing freed, for a pointer that is not a live tokenizer or one with
 * users) and free. */
void kiln_tokenizer_free(kiln_tokenizer *t);
/* Mark t as owned by a model (kiln_tokenizer_close then refuses it). t may be NULL. */
void kiln_tokenizer_set_owner(kiln_tokenizer *t, const void *model);
/* The model t belongs to, or NULL. t must be a live tokenizer. */
const void *kiln_tokenizer_owner(const kiln_tokenizer *t);

/* Whether id ends generation (eos, eot, and any token the vocabulary marks as such, e.g.
 * <|im_end|>, <|eot_id|>, <end_of_turn>). */
bool kiln_tokenizer_is_eog(const kiln_tokenizer *t, int32_t id);

int kiln_tokenizer_n_vocab(const kiln_tokenizer *t);

/* Write t as Hugging Face tokenizer.json text (tok_export.c): kiln_malloc'd, NUL-terminated,
 * *len its length (len may be NULL). KILN_ERR_UNSUPPORTED when a part cannot be expressed
 * (a regex split kiln knows only compiled, from a tokenizer.json of its own). */
kiln_status kiln_tokenizer_write_hf_json(const kiln_tokenizer *t, char **out, size_t *len);

/* tokenizer_config.json text for t: add_bos_token / add_eos_token, the bos / eos / unk / pad
 * token strings, the chat template, model_max_length when > 0. */
kiln_status kiln_tokenizer_write_hf_config(const kiln_tokenizer *t, int model_max_length, char **out,
                                          size_t *len);

#endif /* KILN_TOKENIZER_H */
