/* receipt.h -- generation receipts (JSON) as `kiln generate --receipt` writes them and `kiln
 * verify` reads them: the format is docs/REPRODUCIBILITY.md, "Receipts". */
#ifndef KILN_CLI_RECEIPT_H
#define KILN_CLI_RECEIPT_H

#include "kiln.h"

#include <stddef.h>
#include <stdint.h>

#define RECEIPT_FORMAT "kiln-receipt"
#define RECEIPT_VERSION 1
#define RECEIPT_MAX_STOPS 16

/* Everything a receipt holds. Strings and arrays are malloc'd (receipt_free). */
typedef struct receipt {
    int version;
    char *kiln_version;
    /* the model */
    uint8_t model_fp[32], tokenizer_fp[32];
    char *model_path, *model_name, *architecture; /* informational; may be NULL */
    int n_vocab;                                  /* the logits row length */
    /* the prompt */
    char *prompt_text; /* as given (before a chat template); NULL when not recorded */
    char *system;      /* the system message of a chat prompt, or NULL */
    int chat;          /* the prompt went through the model's chat template */
    int32_t *prompt_ids;
    size_t n_prompt;
    /* the settings that decide the tokens */
    int max_tokens;
    kiln_sampler_params sampler;
    char *stops[RECEIPT_MAX_STOPS + 1]; /* NULL-terminated */
    int n_stops;
    int ignore_eos;
    int n_ctx, n_batch;
    int weights_f32;
    /* the arithmetic */
    int fast, batch_invariant;
    int format; /* kiln_format of the products */
    char *format_rules; /* its per-weight rules (NULL: none); written as one spec, "mx8,output=mx16" */
    int device; /* -1 cpu, N cuda:N */
    int threads;
    /* the output */
    int32_t *ids;
    size_t n_ids;
    char *text; /* NULL when not recorded */
    char *stop_reason;
    uint8_t (*chain)[32]; /* n_ids + 1 digests: c_0 .. c_n */
} receipt;

void receipt_free(receipt *r);

/* r as compact JSON text (malloc'd; free), or NULL when out of memory: kiln serve's
 * "kiln_receipt" of a choice, which `kiln verify` reads once saved to a file. */
char *receipt_json_text(const receipt *r);

/* Write r as JSON to path atomically (path.tmp-<pid>, fsync'd, renamed). 0, or prints
 * "kiln <cmd>: ..." and returns 1. */
int receipt_write(const char *cmd, const char *path, const receipt *r);

/* Parse and check a receipt (every field's type and range, the ids against the chain, c_0
 * against the fingerprints and the prompt). 0, or prints "kiln <cmd>: PATH: ..." and returns 2
 * (a malformed or inconsistent receipt is a usage error). */
int receipt_read(const char *cmd, const char *path, receipt *r);

/* "cpu" or "cuda:N" into buf. */
const char *receipt_device_name(int device, char *buf, size_t cap);

#endif
