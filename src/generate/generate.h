/* generate.h -- internal definition of the inference context. */
#ifndef KILN_GENERATE_H
#define KILN_GENERATE_H

#include "../models/model.h"

struct kiln_context {
    kiln_handle_head head; /* first: the registry's magic (base/handle.h) */
    kiln_model *model;     /* a user of the model from create to free */
    kiln_context_params params;
    kiln_backend *be;
    kiln_forward_state fs;
    int n_past;      /* tokens in the KV cache */
    int32_t *tokens; /* (n_ctx) the ids in the cache, for prefix reuse */
    /* Decode graph (a backend with graphs, docs/CUDA.md): the step of graph_B tokens (one per
     * sequence) recorded once and replayed; graph_logits is the logits buffer it writes
     * (re-recorded if that buffer is regrown or B changes). graphs: whether to use them (env
     * KILN_CUDA_GRAPHS=0 turns them off); warm: a forward has completed, so every weight is
     * on the device. */
    void *graph;
    float *graph_logits;
    int graph_B;
    int graphs, warm;
    int host_sampling; /* env KILN_DEVICE_SAMPLING=0: sample on the host even on a device */
    int *seq_past;     /* (n_seq) tokens cached per sequence; seq_past[0] is unused (n_past) */
    int32_t *b_pos, *b_seq; /* (n_batch) each: the positions and sequences of a batch */
};

/* An observer of the logits each token is drawn from (a receipt's chain): fn gets the row
 * (n_vocab floats, host memory) before the sampler reads it; an error stops the generation. */
typedef struct kiln_logits_hook {
    kiln_status (*fn)(void *user, const float *logits, int n_vocab);
    void *user;
} kiln_logits_hook;

/* Decode ids[0..n) and sample the next token from the last one's logits with smp and the
 * history hist[0..n_hist) (what kiln_decode then kiln_sampler_sample give): on a backend
 * with a device sampler the logits stay on the device and only the id is read back; else
 * they go through logits (n_vocab floats of host scratch). Same ids either way. hook (NULL:
 * none) sees the row first, in logits: on a device that costs the row's download, so only a
 * caller that asks for it pays. */
kiln_status kiln_decode_and_sample(kiln_context *c, const int32_t *ids, int n, kiln_sampler *smp,
                                   const int32_t *hist, size_t n_hist, float *logits,
                                   const kiln_logits_hook *hook, int32_t *id);

/* A generation's receipt chain (receipt_chain.c, docs/REPRODUCIBILITY.md): begin writes c_0
 * (from m's fingerprints and the prompt) to chain[0..32); hook, passed to
 * kiln_decode_and_sample, appends c_{steps+1} for each row it sees. chain must hold
 * 32 * (rows + 1) bytes. */
typedef struct kiln_receipt_chain {
    uint8_t *chain;
    size_t steps;
    kiln_logits_hook hook;
} kiln_receipt_chain;
kiln_status kiln_receipt_chain_begin(kiln_receipt_chain *rc, const kiln_model *m, const int32_t *prompt,
                                     size_t n_prompt, uint8_t *chain);
kiln_status kiln_receipt_chain_hook(void *user, const float *logits, int n_vocab);

/* The text side of one generation, kiln_generate's and the serving engine's: the detokenizer
 * stream, the output text, and its stop-string hold-back. Streaming contract: text is released
 * only once it can no longer become part of a stop string, so a caller never sees text that
 * is later taken back. stops (NULL-terminated, or NULL) must outlive g. */
typedef struct kiln_gen_text {
    const kiln_model *m;
    kiln_detok_stream *ds;
    const char *const *stops;
    int ignore_eos, stopped;
    char *data;          /* the text so far (NUL-terminated), the stop string cut off */
    size_t len, cap;
    size_t emitted;      /* released to the caller: data[0..emitted) */
} kiln_gen_text;

kiln_status kiln_gen_text_init(kiln_gen_text *g, const kiln_model *m, const char *const *stops, int ignore_eos);
void kiln_gen_text_free(kiln_gen_text *g);
/* Add generated token id. *reason: NULL, "eos" (an end-of-generation token, unless
 * ignore_eos: no text added) or "stop_string" (the text is cut where it starts); *out, *n_out:
 * the text this token releases (valid until the next call). */
kiln_status kiln_gen_text_push(kiln_gen_text *g, int32_t id, const char **reason, const char **out, size_t *n_out);
/* At the end: the held-back text (bytes of an unfinished character, a partial stop string),
 * nothing after a stop string. */
kiln_status kiln_gen_text_flush(kiln_gen_text *g, const char **out, size_t *n_out);

/* The API boundary of a context call: c a live context (base/handle.h) whose backend is not
 * poisoned (KILN_ERR_POISONED otherwise). */
kiln_status kiln_context_enter(const kiln_context *c, const char *fn);
/* A context call's status on the way out: KILN_ERR_POISONED when it failed and left the
 * backend poisoned (ops.h kiln_backend_leave). */
kiln_status kiln_context_leave(const kiln_context *c, kiln_status st, const char *fn);

/* Fault injection for tests: poison a CPU context's backend (shared with every handle on it)
 * as a GPU fault would (ops.h kiln_backend_cpu_poison). KILN_ERR_UNSUPPORTED for a context
 * on a GPU. Exported (not in kiln.h) so that the Python tests can reach it. */
KILN_API kiln_status kiln_debug_poison_context(kiln_context *c);

#endif
