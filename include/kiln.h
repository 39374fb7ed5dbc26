/*
 * kiln.h -- the one public header of libkiln, and its specification.
 *
 * kiln is a C11 engine for the whole life of a transformer language model: load (GGUF,
 * Hugging Face folders), generate, and later train, distill, quantize and serve.
 *
 * Conventions (see docs/API.md):
 *   - Every call that can fail returns a kiln_status. On failure, kiln_last_error() returns a
 *     thread-local message naming the file, field, byte offset or parameter that was wrong.
 *     The library never calls exit() or abort() on any input.
 *   - Handles are opaque. Freeing NULL is a no-op. A handle is used from the thread that made
 *     it unless a function says otherwise.
 *   - Handles are checked (docs/API.md, "Safe handles"): every call looks the handle up in
 *     kiln's table of live handles before it reads through it. A pointer that is not a live
 *     handle of the expected type (freed already, never made by kiln, of another type) is
 *     refused with KILN_ERR_BAD_HANDLE, the message naming the function and the type; a free
 *     of such a pointer does nothing but set kiln_last_error (frees return no status). Calls
 *     that return no status (kiln_context_n_past, kiln_token_piece, ...) return 0 or NULL for
 *     a bad handle and set the message the same way. Limit: handles are addresses, so a stale
 *     pointer whose address the allocator has since given to a NEW handle of the same type
 *     reaches that new handle; that one case cannot be told apart.
 *   - A handle that others use is not freed under them: kiln_model_close refuses while the
 *     model's contexts, trainers or detok streams on its tokenizer are open, and
 *     kiln_tokenizer_close while detok streams on it are (the handle stays valid; close it
 *     after them).
 *   - Contexts, trainers and losses on the same device (the CPU with the same thread count,
 *     or one GPU) in the same arithmetic share one backend: its weight cache, stream and
 *     workspaces (a teacher and a student on one GPU hold one copy of each weight). Such
 *     handles are used from one thread at a time, one call after another.
 *   - Every allocation goes through the allocator set with kiln_set_allocator().
 *   - Output parameters are written only on success.
 */
#ifndef KILN_H
#define KILN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define KILN_API __declspec(dllexport)
#else
#define KILN_API __attribute__((visibility("default")))
#endif

#define KILN_VERSION_MAJOR 0
#define KILN_VERSION_MINOR 1
#define KILN_VERSION_PATCH 0

/* ---------------------------------------------------------------------------------------- */
/* Status and errors                                                                         */
/* ---------------------------------------------------------------------------------------- */

typedef enum kiln_status {
    KILN_OK = 0,
    KILN_ERR_INVALID_ARG = 1, /* a parameter is NULL, out of range or inconsistent */
    KILN_ERR_IO = 2,          /* open/read/write/mmap failed (errno text in the message) */
    KILN_ERR_FORMAT = 3,      /* a file or document is malformed */
    KILN_ERR_UNSUPPORTED = 4, /* well-formed but not supported (architecture, type, template) */
    KILN_ERR_NOMEM = 5,       /* an allocation failed */
    KILN_ERR_RANGE = 6,       /* a token id, length or position is out of range */
    KILN_ERR_STATE = 7,       /* the call is not allowed in the handle's current state */
    KILN_ERR_INTERNAL = 8,    /* a bug in kiln: please report */
    KILN_ERR_BUFFER_TOO_SMALL = 9, /* the caller's buffer is too small; *needed says how big */
    KILN_ERR_BAD_HANDLE = 10, /* not a live handle of the expected type (freed, foreign) */
    KILN_ERR_POISONED = 11,   /* the handle's device backend failed earlier (a GPU fault) and
                               * refuses all work: free the handle (and make a new one) */
    KILN_ERR_PANIC = 12,      /* an invariant broken inside kiln, caught at the API boundary
                               * (a handle's memory overwritten, a user count gone wrong):
                               * stop using the handle, please report */
    KILN_ERR_BUSY = 13,       /* full: a queue is at its bound; try again later */
} kiln_status;

/* A static English name for a status ("ok", "invalid argument", ...). Never NULL. */
KILN_API const char *kiln_status_string(kiln_status st);

/* The message of the last failed call on this thread ("" if none). Valid until the next
 * kiln call on this thread. */
KILN_API const char *kiln_last_error(void);

/* Library version as "MAJOR.MINOR.PATCH". */
KILN_API const char *kiln_version(void);

/* The number of device backends (one per device and arithmetic, shared by the contexts,
 * trainers and losses on it) that a device failure has poisoned and that handles still hold;
 * 0 when none. A poisoned backend refuses every later call of the handles on it with
 * KILN_ERR_POISONED; new handles get a fresh backend. kiln_context_status,
 * kiln_trainer_status and kiln_linear_ce_status say which handles are affected. */
KILN_API int kiln_backend_poisoned(void);

/* ---------------------------------------------------------------------------------------- */
/* Memory                                                                                    */
/* ---------------------------------------------------------------------------------------- */

/* The allocator hook. alloc returns NULL on failure; free(NULL) must be accepted. kiln asks
 * for no particular alignment from the hook (it aligns to 64 bytes itself). */
typedef struct kiln_allocator {
    void *(*alloc)(size_t size, void *user);
    void (*free)(void *ptr, void *user);
    void *user;
} kiln_allocator;

/* Replace the allocator (NULL restores malloc/free). Must be called while no kiln object is
 * alive: memory is returned to the allocator that gave it. Not thread-safe. */
KILN_API kiln_status kiln_set_allocator(const kiln_allocator *a);

/* kiln's own accounting of the memory it holds through the hook (not mmap'd files). */
typedef struct kiln_mem_stats {
    size_t live_bytes;  /* bytes currently allocated */
    size_t peak_bytes;  /* high-water mark since the last kiln_mem_reset_peak() */
    size_t live_blocks; /* number of live allocations */
    uint64_t n_allocs;  /* allocations made since start */
} kiln_mem_stats;

KILN_API void kiln_mem_get_stats(kiln_mem_stats *out);
KILN_API void kiln_mem_reset_peak(void);

/* Memory of a device: -1 the host (available and installed physical memory), N >= 0 CUDA
 * device N (free and total, as the driver reports them). KILN_ERR_UNSUPPORTED for a CUDA
 * device in a build without CUDA or on a machine without that GPU. */
KILN_API kiln_status kiln_device_memory(int device, uint64_t *free_bytes, uint64_t *total_bytes);

/* ---------------------------------------------------------------------------------------- */
/* Numbers                                                                                   */
/* ---------------------------------------------------------------------------------------- */

typedef enum kiln_dtype {
    KILN_DTYPE_F32 = 0,
    KILN_DTYPE_F16,
    KILN_DTYPE_BF16,
    KILN_DTYPE_Q8_0,
    KILN_DTYPE_Q4_0,
    KILN_DTYPE_Q4_1,
    KILN_DTYPE_Q5_0,
    KILN_DTYPE_Q5_1,
    KILN_DTYPE_Q4_K,
    KILN_DTYPE_Q5_K,
    KILN_DTYPE_Q6_K,
    KILN_DTYPE_I32,
    KILN_DTYPE_I64,
    KILN_DTYPE_COUNT
} kiln_dtype;

/* "f32", "bf16", "q4_1", ... Never NULL ("?" for an unknown value). */
KILN_API const char *kiln_dtype_name(kiln_dtype t);

/* ---------------------------------------------------------------------------------------- */
/* Models                                                                                    */
/* ---------------------------------------------------------------------------------------- */

typedef struct kiln_model kiln_model;
typedef struct kiln_tokenizer kiln_tokenizer;

typedef enum kiln_weight_mode {
    KILN_WEIGHTS_AUTO = 0, /* keep GGUF quantized blocks and f32; bf16/f16 tensors kept as is */
    KILN_WEIGHTS_F32 = 1,  /* dequantize / widen every matrix to f32 at load */
} kiln_weight_mode;

typedef struct kiln_model_params {
    int n_threads;                /* CPU threads for load-time work and defaults (0 = all) */
    kiln_weight_mode weight_mode; /* see above */
    int use_mmap;                 /* map the file instead of reading it (default 1) */
} kiln_model_params;

KILN_API kiln_model_params kiln_model_default_params(void);

/* Open a model: a .gguf file, or a Hugging Face folder (config.json, *.safetensors,
 * tokenizer.json, tokenizer_config.json, generation_config.json). On success *out owns
 * everything; close it with kiln_model_close(). */
KILN_API kiln_status kiln_model_open(const char *path, const kiln_model_params *params,
                                     kiln_model **out);
/* Free the model. Refused while contexts or trainers made on it, or detok streams on its
 * tokenizer, are open: the model then stays open and usable, kiln_last_error names the
 * number of users, and the caller closes it again after them. A pointer that is not a live
 * model: nothing is freed, kiln_last_error says so (KILN_ERR_BAD_HANDLE's text). */
KILN_API void kiln_model_close(kiln_model *m);

/* A new Llama-architecture model with random weights, to train from scratch: config is a
 * named configuration ("tiny": 2 x 64, "small": 6 x 192, "base": 12 x 384; tied embeddings)
 * or a path to a Hugging Face config.json; tokenizer_path is anything kiln_tokenizer_open
 * takes, and gives the vocabulary. Weights as transformers initializes Llama (normal(0, 0.02),
 * norms 1), drawn from seed. */
KILN_API kiln_status kiln_model_create(const char *config, const char *tokenizer_path,
                                       uint64_t seed, kiln_model **out);

/* What a model is; all strings are owned by the model. */
typedef struct kiln_model_info {
    const char *architecture; /* "llama", "qwen2", "qwen3", "mistral" */
    const char *name;         /* general.name or the folder name */
    int n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_ctx_train;
    float rms_norm_eps, rope_theta;
    int tied_embeddings, attn_bias, qk_norm;
    uint64_t n_params;       /* number of parameters */
    uint64_t weight_bytes;   /* bytes of weights as held in memory or mapped */
    int n_tensors;
} kiln_model_info;

KILN_API kiln_status kiln_model_get_info(const kiln_model *m, kiln_model_info *out);

typedef struct kiln_tensor_info {
    const char *name; /* the model file's own name for the tensor */
    kiln_dtype dtype;
    int n_dims;
    int64_t shape[4]; /* outermost first, as torch prints it: (rows, cols) for a matrix */
} kiln_tensor_info;

/* The i-th tensor of the model file, 0 <= i < info.n_tensors. */
KILN_API kiln_status kiln_model_get_tensor_info(const kiln_model *m, int i, kiln_tensor_info *out);

/* The model's tokenizer, owned by the model. */
KILN_API const kiln_tokenizer *kiln_model_get_tokenizer(const kiln_model *m);

/* ---------------------------------------------------------------------------------------- */
/* Tokenizer                                                                                 */
/* ---------------------------------------------------------------------------------------- */

typedef struct kiln_tokenizer_info {
    const char *type;    /* "bpe" (byte-level BPE) or "spm" (SentencePiece-style BPE) */
    const char *pre;     /* pre-tokenizer name: "gpt2", "llama3", "qwen2", "smollm", ... */
    int n_vocab;
    int32_t bos_id, eos_id, eot_id, pad_id, unk_id; /* -1 when absent */
    int add_bos, add_eos;
    const char *chat_template_name; /* "chatml", "llama3", "gemma", or NULL if none/unknown */
    const char *chat_template;      /* the raw template text, or NULL */
} kiln_tokenizer_info;

/* Open a tokenizer alone: a .gguf file (its tokenizer.ggml.* metadata), a Hugging Face
 * folder (tokenizer.json + tokenizer_config.json) or a tokenizer.json path. */
KILN_API kiln_status kiln_tokenizer_open(const char *path, kiln_tokenizer **out);
/* Free a tokenizer from kiln_tokenizer_open. Refused (nothing freed, kiln_last_error set) for
 * a model's own tokenizer (it goes with the model) and while detok streams on it are open. */
KILN_API void kiln_tokenizer_close(kiln_tokenizer *t);

KILN_API kiln_status kiln_tokenizer_get_info(const kiln_tokenizer *t, kiln_tokenizer_info *out);

/* Encode text (UTF-8, len bytes) into ids. add_special adds BOS/EOS as the model's
 * tokenizer does; parse_special makes special-token strings in the text become their ids.
 * Invalid UTF-8 bytes are encoded as if they were U+FFFD.
 * If cap is too small, returns KILN_ERR_BUFFER_TOO_SMALL with *n_out = the count needed. */
KILN_API kiln_status kiln_tokenize(const kiln_tokenizer *t, const char *text, size_t len,
                                   int add_special, int parse_special, int32_t *ids,
                                   size_t cap, size_t *n_out);

/* The raw bytes a single token stands for (after byte-level / ▁ decoding), written to buf.
 * Special tokens give their text only when render_special is set, else nothing. */
KILN_API kiln_status kiln_token_to_bytes(const kiln_tokenizer *t, int32_t id,
                                         int render_special, char *buf, size_t cap,
                                         size_t *n_out);

/* The token's vocabulary string as stored (e.g. "Ġhello", "▁hello"). Owned by t. */
KILN_API const char *kiln_token_piece(const kiln_tokenizer *t, int32_t id);

/* Decode ids to text (as the HF tokenizer's decode with skip_special_tokens = !render_special). */
KILN_API kiln_status kiln_detokenize(const kiln_tokenizer *t, const int32_t *ids, size_t n,
                                     int render_special, char *buf, size_t cap, size_t *n_out);

/* Streaming decode: push one token, get the bytes that are now complete UTF-8 text. A token
 * that ends inside a UTF-8 character is held until the character completes. */
typedef struct kiln_detok_stream kiln_detok_stream;
KILN_API kiln_status kiln_detok_stream_create(const kiln_tokenizer *t, int render_special,
                                              kiln_detok_stream **out);
KILN_API void kiln_detok_stream_free(kiln_detok_stream *s);
/* Writes up to cap bytes; *n_out the number written. The text is valid UTF-8. */
KILN_API kiln_status kiln_detok_stream_push(kiln_detok_stream *s, int32_t id, char *buf,
                                            size_t cap, size_t *n_out);
/* Flush held bytes at the end of the stream (incomplete sequences become U+FFFD). */
KILN_API kiln_status kiln_detok_stream_flush(kiln_detok_stream *s, char *buf, size_t cap,
                                             size_t *n_out);

/* Chat templates: chatml, llama3 and gemma are built in and chosen from the model's
 * template text; an unknown template is an error (KILN_ERR_UNSUPPORTED), never replaced. */
typedef struct kiln_chat_message {
    const char *role; /* "system", "user", "assistant" */
    const char *content;
} kiln_chat_message;

KILN_API kiln_status kiln_chat_apply(const kiln_tokenizer *t, const kiln_chat_message *msgs,
                                     size_t n_msgs, int add_generation_prompt, char *buf,
                                     size_t cap, size_t *n_out);

/* ---------------------------------------------------------------------------------------- */
/* Inference contexts                                                                         */
/* ---------------------------------------------------------------------------------------- */

typedef struct kiln_context kiln_context;

/* The longest context n_ctx = 0 chooses (contexts and engines): the model's training context,
 * at most this many positions. */
#define KILN_DEFAULT_MAX_CTX 4096

typedef struct kiln_context_params {
    int n_ctx;     /* KV cache length in tokens (0 = the model's training context, at most KILN_DEFAULT_MAX_CTX) */
    int n_batch;   /* max tokens per kiln_decode call (prefill chunk), default 512 */
    int n_threads; /* 0 = all cores */
    /* approximate: activations quantized to 8 bits for quantized weights during decode;
     * error vs the exact path in bench/RESULTS.md. 0 (default) = exact. */
    int fast_q8_activations;
    /* -1 = CPU (default), N >= 0 = CUDA device N; results are bit-identical to the CPU
     * (auditable mode). KILN_ERR_UNSUPPORTED when kiln has no CUDA or no such GPU. */
    int device;
    /* 0 (default) = exact: the auditable arithmetic (on a GPU, the CPU's bits). Non-zero = the
     * backend's fast arithmetic: on the CPU, fast_q8_activations; on CUDA, bf16 tensor cores
     * for prefill, fixed-order f32 kernels for decode, split-K decode attention (docs/CUDA.md,
     * "Fast mode"): not the CPU's bits, but deterministic run to run on one GPU model, with its
     * error against the auditable path measured in bench/RESULTS.md. */
    int fast;
    /* Independent sequences in the KV cache (default 1): sequence 0 is the one kiln_decode
     * and kiln_generate use; kiln_decode_seq fills any of them and kiln_decode_batch runs
     * one token of each of the first B together (batched decode). */
    int n_seq;
    /* A token's logits must not depend on how many tokens share a forward. The auditable
     * arithmetic and the CPU's fast mode (8-bit activations at every batch size) are so
     * without it: on the CPU it changes nothing. On CUDA, with fast, every call runs on
     * kernels whose outputs for a token depend on that token alone (docs/CUDA.md, "The
     * batch-invariant fast mode"); inference only. Default 0. */
    int batch_invariant;
    /* The matrix products' number format (kiln_format; default KILN_FORMAT_F32, the auditable
     * f32 products). KILN_FORMAT_MX16 / MX8: the exact block formats (docs/ARITHMETIC.md,
     * "Exact block formats"): every product's operands quantized along the reduction to blocks
     * of 32 integer mantissas (14 or 7 bits) with a power-of-two scale, the block products
     * exact integers, one rounding per output -- the same bits on every device and thread
     * count, the weights' quantization an approximation (its error in docs/ARITHMETIC.md).
     * On the CPU and CUDA (the same bits); not with fast (KILN_ERR_INVALID_ARG). */
    int format;
    /* Formats per weight (NULL or "": none): comma-separated SELECTOR=FORMAT rules over
     * `format`, read left to right, the last match winning. FORMAT: f32, mx16, mx8. SELECTOR
     * names weight matrices by their GGUF role whatever the file: attn_v (every layer's),
     * output (the head), blk.3 (a layer's), blk.0-3.ffn_down (a range's role). Example:
     * format MX8 with "output=mx16,attn_v=mx16". A rule that selects no matrix is refused
     * (KILN_ERR_INVALID_ARG, naming the model's roles). The CPU's only for now (CUDA:
     * KILN_ERR_UNSUPPORTED); not with fast. docs/ARITHMETIC.md, "Formats per weight". */
    const char *format_rules;
} kiln_context_params;

/* kiln_context_params.format, kiln_engine_params.format. */
typedef enum kiln_format { KILN_FORMAT_F32 = 0, KILN_FORMAT_MX16 = 1, KILN_FORMAT_MX8 = 2 } kiln_format;

KILN_API kiln_context_params kiln_context_default_params(void);
/* A context on m: m counts it as a user until kiln_context_free (kiln_model_close refuses
 * meanwhile). */
KILN_API kiln_status kiln_context_create(kiln_model *m, const kiln_context_params *p,
                                         kiln_context **out);
KILN_API void kiln_context_free(kiln_context *c);
/* KILN_OK while the context can work; KILN_ERR_POISONED (the message giving the device
 * failure) once its backend is poisoned: every call of it that returns a status then fails
 * the same way (the one during which the failure happened included), and only
 * kiln_context_free is left to do. KILN_ERR_BAD_HANDLE for a pointer that is not a live
 * context. Does not wait for work in flight. */
KILN_API kiln_status kiln_context_status(const kiln_context *c);

/* Number of tokens currently in the KV cache (sequence 0). */
KILN_API int kiln_context_n_past(const kiln_context *c);
KILN_API int kiln_context_n_ctx(const kiln_context *c);
/* Drop cached positions >= n_past (0 resets the context). */
KILN_API kiln_status kiln_context_truncate(kiln_context *c, int n_past);

/* Run ids[0..n) at positions n_past..n_past+n, appending to the KV cache.
 * logits: NULL, or room for n_vocab floats (logits of the last token), or when all_logits
 * is set, n*n_vocab floats (row i = logits after ids[i]). Errors: an id out of range,
 * n_past + n > n_ctx (KILN_ERR_RANGE); the cache is unchanged on error. */
KILN_API kiln_status kiln_decode(kiln_context *c, const int32_t *ids, int n, int all_logits,
                                 float *logits);

/* Batched decode (kiln_context_params.n_seq > 1). kiln_decode_seq: kiln_decode on sequence
 * seq in [0, n_seq) (seq 0 is kiln_decode). kiln_decode_batch: one token for each of
 * sequences 0..B-1 (B <= n_seq and <= n_batch), ids[b] at that sequence's next position, in
 * one forward; logits NULL or room for B x n_vocab floats (row b = sequence b). In the
 * auditable arithmetic every row has the bits the sequence would get alone (tested): a
 * request's tokens do not depend on the rest of the batch. Errors: an id out of range, a
 * full sequence (KILN_ERR_RANGE); no sequence advances on error. */
KILN_API kiln_status kiln_decode_seq(kiln_context *c, int seq, const int32_t *ids, int n,
                                     int all_logits, float *logits);
KILN_API kiln_status kiln_decode_batch(kiln_context *c, const int32_t *ids, int B, float *logits);
/* Tokens in sequence seq's cache; drop its positions >= n_past. */
KILN_API int kiln_context_seq_n_past(const kiln_context *c, int seq);
KILN_API kiln_status kiln_context_seq_truncate(kiln_context *c, int seq, int n_past);

/* ---------------------------------------------------------------------------------------- */
/* Sampling and generation                                                                   */
/* ---------------------------------------------------------------------------------------- */

typedef struct kiln_sampler_params {
    float temperature;     /* <= 0: greedy (argmax, lowest id on ties) */
    int top_k;             /* <= 0: off */
    float top_p;           /* >= 1: off */
    float min_p;           /* <= 0: off */
    float repeat_penalty;  /* 1: off (CTRL-style: logit/p if > 0 else logit*p) */
    int repeat_last_n;     /* window for the penalty; -1 = whole history */
    uint64_t seed;
} kiln_sampler_params;

KILN_API kiln_sampler_params kiln_sampler_default_params(void);

typedef struct kiln_sampler kiln_sampler;
KILN_API kiln_status kiln_sampler_create(const kiln_sampler_params *p, kiln_sampler **out);
KILN_API void kiln_sampler_free(kiln_sampler *s);
/* Pick the next token from logits[n_vocab] given the history (for the penalty). */
KILN_API kiln_status kiln_sampler_sample(kiln_sampler *s, const float *logits, int n_vocab,
                                         const int32_t *history, size_t n_history,
                                         int32_t *out_id);

/* Called with each generated token and the text it completes (may be empty: text that could
 * still become a stop string is held back). A last call with id -1 flushes held text.
 * Return nonzero to stop. */
typedef int (*kiln_token_callback)(int32_t id, const char *text, size_t len, void *user);

typedef struct kiln_generate_params {
    int max_tokens;               /* tokens to generate at most */
    kiln_sampler_params sampler;
    const char *const *stop_strings; /* NULL-terminated list, or NULL */
    int ignore_eos;               /* keep going past end-of-generation tokens */
    kiln_token_callback on_token; /* optional */
    void *user;
    /* Added after user (callers that start from the defaults get NULL): */
    uint8_t *logits_chain;        /* NULL (the default), or room for 32 * (max_tokens + 1)
                                   * bytes: the receipt's hash chain of this generation
                                   * (docs/REPRODUCIBILITY.md), c_0 first, then c_{i+1} after
                                   * generated token i, n_ids + 1 digests in all (the rest
                                   * untouched). On a GPU each row of logits is then downloaded
                                   * to be hashed; without it nothing is. */
} kiln_generate_params;

KILN_API kiln_generate_params kiln_generate_default_params(void);

typedef struct kiln_generate_result {
    int32_t *ids;     /* generated ids (owned by kiln: kiln_generate_result_free) */
    size_t n_ids;
    char *text;       /* generated text, NUL-terminated, stop string removed */
    size_t text_len;
    const char *stop_reason; /* "length", "eos", "stop_string", "callback", "context" */
    double prefill_seconds, decode_seconds;
    int n_prompt;
    int n_prompt_cached; /* prompt tokens reused from the context's cache (not recomputed) */
} kiln_generate_result;

/* Prefill the prompt and generate. The KV cache is reused for the longest prefix the prompt
 * shares with what the context holds (so a chat re-sends its whole history cheaply); the
 * result is the same as from an empty context. */
KILN_API kiln_status kiln_generate(kiln_context *c, const int32_t *prompt, size_t n_prompt,
                                   const kiln_generate_params *p, kiln_generate_result *out);
KILN_API void kiln_generate_result_free(kiln_generate_result *r);

/* ---------------------------------------------------------------------------------------- */
/* Receipts: fingerprints and the logits' hash chain (docs/REPRODUCIBILITY.md)               */
/* ---------------------------------------------------------------------------------------- */

/* The model's fingerprint: SHA-256 over its weights as stored (the file's dtype and bytes,
 * quantized blocks included), tensor by tensor under transformers' names and shapes, in
 * Hugging Face's row order, sorted by name (the definition: docs/REPRODUCIBILITY.md,
 * "Fingerprints"). It names the weights, not the way they were opened (mmap, KILN_WEIGHTS_F32
 * give the same value): the same file opened twice agrees, and so do the same weights in a
 * GGUF file and a safetensors folder of the same dtype; a quantized file and its dequantized
 * export differ. The model's hyper-parameters (config.json, GGUF metadata) are not part of it.
 * The first call hashes every weight (on the model's n_threads threads); the value is kept. */
KILN_API kiln_status kiln_model_fingerprint(const kiln_model *m, uint8_t out[32]);

/* The tokenizer's fingerprint: SHA-256 over every token's piece (ids 0..n_vocab-1, each
 * kiln_token_piece's bytes and a NUL). It tells vocabularies apart; two tokenizers with the
 * same pieces but other merges or pre-tokenizer rules share it. Token shards carry it. */
KILN_API kiln_status kiln_tokenizer_fingerprint(const kiln_tokenizer *t, uint8_t out[32]);

/* A receipt's chain, step by step (kiln_generate_params.logits_chain computes it in one go):
 *   start: c_0 = SHA-256("kiln-receipt-v1\n" || model_fp || tokenizer_fp || n_prompt as a
 *          little-endian u64 || the prompt ids as little-endian i32)
 *   step:  c_{i+1} = SHA-256(c_i || logits[0..n_vocab) as little-endian IEEE binary32), the
 *          row from which generated token i was drawn.
 * out may be prev. */
KILN_API kiln_status kiln_receipt_chain_start(const uint8_t model_fp[32], const uint8_t tokenizer_fp[32],
                                              const int32_t *prompt, size_t n_prompt, uint8_t out[32]);
KILN_API kiln_status kiln_receipt_chain_step(const uint8_t prev[32], const float *logits, size_t n_vocab,
                                             uint8_t out[32]);


/* ---------------------------------------------------------------------------------------- */
/* Training (CPU, or a CUDA GPU: kiln_train_params.device)                                  */
/* ---------------------------------------------------------------------------------------- */

typedef struct kiln_trainer kiln_trainer;

typedef enum kiln_weight_storage {
    KILN_STORAGE_F32 = 0,         /* f32 weights and updates (the exact reference) */
    KILN_STORAGE_BF16_MASTER = 1, /* bf16 compute weights, f32 master copy */
    KILN_STORAGE_BF16_KAHAN = 2,  /* bf16 weights with a bf16 Kahan compensation */
    KILN_STORAGE_BF16_SR = 3,     /* bf16 weights, seeded stochastic rounding */
} kiln_weight_storage;

typedef enum kiln_moment_storage {
    KILN_MOMENTS_F32 = 0,
    KILN_MOMENTS_Q8 = 1, /* 8-bit blocks of 256 with a per-block scale */
} kiln_moment_storage;

typedef enum kiln_loss_reduction {
    KILN_LOSS_MEAN = 0, /* mean over supervised positions, times scale */
    KILN_LOSS_SUM = 1,  /* sum over supervised positions, times scale */
} kiln_loss_reduction;

typedef struct kiln_train_params {
    int max_seq;      /* longest sequence one forward takes (activations are sized for it) */
    int n_threads;    /* 0 = all cores */
    int ce_chunk;     /* vocabulary columns per chunk of the fused loss (0 = 4096) */
    double lr, beta1, beta2, eps, weight_decay; /* AdamW, torch's meaning */
    kiln_weight_storage weight_storage;
    kiln_moment_storage moment_storage;
    uint64_t seed;    /* stochastic rounding */
    int device;       /* -1 = CPU (the default); N >= 0 = CUDA device N: parameters, gradients,
                       * activations and optimizer state in GPU memory, auditable arithmetic
                       * (the CPU's bits); checkpoints are the same files on either */
    int fast;         /* 0 (the default): the device's auditable arithmetic; non-zero with
                       * device >= 0: the CUDA backend's fast arithmetic (matrix products
                       * forward and backward on bf16 tensor cores, bf16 flash attention
                       * forward; not the CPU's bits, deterministic run to run:
                       * docs/TRAINING.md, "Fast mode"). With device -1: KILN_ERR_UNSUPPORTED
                       * (the CPU has no fast training) */
    int max_batch;    /* most sequences one forward takes (kiln_train_forward_batch; default
                       * 1, 0 = 1): activations are sized for max_batch x max_seq tokens */
    int ce_keep_mib;  /* CPU: MiB the fused loss may use to keep its forward's logits for the
                       * backward (the vocabulary chunks that fit, from the first; each kept
                       * chunk saves the backward one of its three products, same bits);
                       * default 64, 0: none. A GPU trainer keeps none. */
    int ce_row_block; /* GPU fast mode, kiln_train_step_batch: the fused loss walks the rows in
                       * blocks of this many, each block's whole logits (rows x vocabulary,
                       * bf16 unless ce_logits_f32) made once and turned into its gradient in
                       * place: three products
                       * instead of the vocabulary walk's four (docs/TRAINING.md, "Fast
                       * mode"). Default 2048; 0: the vocabulary walk (the bits of
                       * forward_batch + backward); < 0: KILN_ERR_INVALID_ARG */
    int ce_logits_f32; /* GPU fast mode, the row walk above: 0 (the default) keeps each block's
                        * logits in bf16, as PyTorch's autocast makes the head's output (half
                        * the loss's scratch and traffic; the statistics and gradient in f32
                        * from them); non-zero keeps them in f32 (docs/TRAINING.md) */
    int n_extra;      /* extra trainable matrices the model's forward does not use, trained
                       * with it (distillation's hidden-state projections: kiln_teacher_params);
                       * after the model's parameters in the trainer's list, in checkpoints,
                       * not in exports or fingerprints. Default 0 */
    const struct kiln_train_extra *extra; /* (n_extra) */
    int format;       /* the matrix products' number format, forward and backward (kiln_format):
                       * KILN_FORMAT_F32 (the default: auditable f32), or the exact block formats
                       * MX16 / MX8 (docs/ARITHMETIC.md, "Exact block formats": each product's
                       * operands quantized along its reduction axis, exact integer block sums,
                       * one rounding; the same bits on any thread count, on the CPU and
                       * CUDA); not with fast */
    int format_rounding; /* with an exact format: how the backward's gradient operands (dy, dy^T)
                          * are quantized: KILN_ROUND_NEAREST (0, the default: to nearest even,
                          * as every other operand) or KILN_ROUND_STOCHASTIC (seeded by seed,
                          * the step and the micro-batch: the same bits on any thread or rank
                          * count; docs/ARITHMETIC.md, "Training in a format"). Ignored in f32 */
    const char *format_rules; /* formats per weight over `format`, forward and backward, as
                               * kiln_context_params.format_rules (the CPU's only for now) */
} kiln_train_params;

typedef enum kiln_format_rounding { KILN_ROUND_NEAREST = 0, KILN_ROUND_STOCHASTIC = 1 } kiln_format_rounding;

/* An extra matrix (kiln_train_params.extra): its name (1..95 bytes of [A-Za-z0-9_.-], unlike
 * any of the model's), rows x cols >= 1, initialised normal(0, 1 / cols) from the trainer's
 * seed and its index among the extras. */
typedef struct kiln_train_extra {
    const char *name;
    int64_t rows, cols;
} kiln_train_extra;

KILN_API kiln_train_params kiln_train_default_params(void);

/* A trainer over a copy of the model's parameters (dequantized to f32, or bf16 per the
 * storage). The model must outlive the trainer. Parameters are named as in transformers.
 * p->device >= 0 trains on that CUDA GPU; KILN_ERR_UNSUPPORTED naming why when it cannot be
 * used (kiln built without CUDA, no such GPU). Every other call is the same on either. */
KILN_API kiln_status kiln_trainer_create(kiln_model *m, const kiln_train_params *p,
                                         kiln_trainer **out);
KILN_API void kiln_trainer_free(kiln_trainer *t);
/* As kiln_context_status, for a trainer's backend. */
KILN_API kiln_status kiln_trainer_status(const kiln_trainer *t);

/* Forward one sequence ids[0..n) (n <= max_seq) and keep what backward needs (a pending
 * step). targets: n ids, -1 where a position is not supervised; the loss is the fused
 * cross-entropy of the model's head, reduced and scaled. Errors: an id or target out of
 * range, n > max_seq, no supervised position, a non-finite loss (nothing is pending then). */
KILN_API kiln_status kiln_train_forward(kiln_trainer *t, const int32_t *ids, int n,
                                        const int32_t *targets, kiln_loss_reduction red,
                                        float scale, float *loss);
/* Forward n_seq sequences of seq tokens each at once (ids and targets: n_seq x seq, back to
 * back; n_seq <= max_batch, seq <= max_seq), positions restarting at 0 in each, attention
 * within each sequence. The loss reduces over the supervised positions of all of them (MEAN:
 * their mean -- for equal target counts, the mean of the sequences' means), and backward
 * gives the gradient of that loss: PyTorch's batch of n_seq x seq in one step. Each
 * sequence's activations are those it has alone; the gradient sums run over all rows, so
 * they are not the bits of n_seq accumulated single-sequence steps (within rounding of
 * them). kiln_train_forward is this with n_seq = 1. Same errors, per sequence. */
KILN_API kiln_status kiln_train_forward_batch(kiln_trainer *t, const int32_t *ids, int n_seq, int seq,
                                              const int32_t *targets, kiln_loss_reduction red,
                                              float scale, float *loss);
/* forward_batch + backward(NULL, accumulate) in one call, with the same results (loss and
 * gradients: the same bits). On a GPU in fast mode the host does not wait between the two
 * halves: the loss's gradient is enqueued behind its first pass and the layers' backward
 * behind that, and the call waits only for the loss's statistics: it returns while the
 * backward still runs, so the host queues the next work behind it and the device stays busy
 * (docs/TRAINING.md, "One-call steps"). A device fault in that work is reported by the next
 * call that waits for it (clip_grads, a download, the next step's loss). Errors as
 * forward_batch's, before anything changes; except a non-finite loss, which on that path is
 * known only after the gradient work was enqueued, and any failure after that work began: the
 * error says so, and the gradients are then unusable (clip and optimizer_step refuse them with
 * KILN_ERR_STATE) until a step that does not accumulate. */
KILN_API kiln_status kiln_train_step_batch(kiln_trainer *t, const int32_t *ids, int n_seq, int seq,
                                           const int32_t *targets, kiln_loss_reduction red, float scale,
                                           int accumulate, float *loss);
/* Forward one sequence and write the final-norm hidden states at positions[0..n_pos) to
 * hidden (n_pos x n_embd), for a head of the caller's own; backward then takes their
 * gradient. */
KILN_API kiln_status kiln_train_forward_hidden(kiln_trainer *t, const int32_t *ids, int n,
                                               const int32_t *positions, int n_pos,
                                               float *hidden);
/* Backward of the pending step. dhidden: NULL after kiln_train_forward, else n_pos x n_embd
 * gradients of the hidden states handed out. accumulate: add into the gradients (else they
 * are overwritten). */
KILN_API kiln_status kiln_train_backward(kiln_trainer *t, const float *dhidden, int accumulate);
/* Drop the pending step without a backward. */
KILN_API kiln_status kiln_train_discard(kiln_trainer *t);
/* Forward + causal-LM loss (mean over the n-1 next-token targets) + backward, gradients
 * overwritten. */
KILN_API kiln_status kiln_train_step(kiln_trainer *t, const int32_t *ids, int n, float *loss);

/* Sum of squares of all gradients (torch's clip_grad_norm_ total norm, squared). */
KILN_API kiln_status kiln_train_grad_sq_norm(kiln_trainer *t, double *out);
/* torch.nn.utils.clip_grad_norm_(max_norm): scales every gradient by the clamped
 * coefficient, with torch's bits; returns the total norm and the coefficient. */
KILN_API kiln_status kiln_train_clip_grads(kiln_trainer *t, double max_norm, float *total_norm,
                                           float *coef);
/* One AdamW update with learning rate lr. A non-finite gradient is refused before any
 * weight changes. On a device it returns once the update is enqueued (the next step queues
 * behind it; anything that reads the weights waits for it). */
KILN_API kiln_status kiln_train_optimizer_step(kiln_trainer *t, double lr);
/* clip_grad_norm_'s total norm and coefficient for max_norm (finite, > 0) without applying
 * it: coef = min((1 / (total + 1e-6f)) * max_norm, 1) in float32, the bits of torch's
 * `clip_coef = max_norm / (total_norm + 1e-6)` (a Python float over a float32 tensor is
 * its reciprocal times the float) clamped to 1. The gradients are left as they are (a clip
 * coefficient kiln_train_clip_grads left pending is applied to them first, as any read does);
 * pass coef as kiln_train_adamw_step's grad_scale to clip. */
KILN_API kiln_status kiln_train_clip_coef(kiln_trainer *t, double max_norm, float *total_norm,
                                          float *coef);
/* One AdamW update with learning rate lr, as torch.optim.AdamW.step() with per-parameter
 * weight decay:
 *   weight_decay: NULL, or n_params values in kiln_train_param_info's order, each that
 *     parameter's param group weight_decay (finite; a negative entry: the parameter's own,
 *     as NULL gives every parameter: kiln_train_params.weight_decay where transformers'
 *     get_decay_parameter_names would decay it, 0 for biases and norms). With f32 weights,
 *     and with bf16 + f32 master, any values, with the bits of torch's update (the decay
 *     param.mul_(1 - lr * wd) is then a pass of its own before the update). With bf16 Kahan or
 *     stochastic-rounding storage the decay is part of the update's rounding: a value other
 *     than the parameter's own is KILN_ERR_UNSUPPORTED.
 *   grad_scale: finite, >= 0. Every gradient is first multiplied by it, one float32 product
 *     with float(grad_scale), as p.grad.mul_(grad_scale) before opt.step() (after a pending
 *     clip coefficient: the gradients read afterwards are the scaled ones). 1: nothing.
 * Every argument is checked before anything changes; a non-finite gradient (after the
 * scaling) is refused with no weight changed. kiln_train_optimizer_step(t, lr) is
 * kiln_train_adamw_step(t, lr, NULL, 1). */
KILN_API kiln_status kiln_train_adamw_step(kiln_trainer *t, double lr, const double *weight_decay,
                                           double grad_scale);

/* Parameters by transformers' names. */
KILN_API int kiln_train_n_params(const kiln_trainer *t);
/* Name and element count of parameter i. */
KILN_API kiln_status kiln_train_param_info(const kiln_trainer *t, int i, const char **name,
                                           int64_t *n_elements, int64_t shape[2]);
/* Read (as f32) or write one parameter's weights, or read its gradient; n must match. */
KILN_API kiln_status kiln_train_get_param(const kiln_trainer *t, const char *name, float *out,
                                          int64_t n);
KILN_API kiln_status kiln_train_set_param(kiln_trainer *t, const char *name, const float *in,
                                          int64_t n);
KILN_API kiln_status kiln_train_get_grad(const kiln_trainer *t, const char *name, float *out,
                                         int64_t n);
/* Import many parameters at once: names[i] gets data[i] (n[i] floats). Every name, size and
 * value is checked before any parameter is written: on error nothing has changed. */
KILN_API kiln_status kiln_train_set_params(kiln_trainer *t, int count, const char *const *names,
                                           const float *const *data, const int64_t *n);
/* Parameter i's shape as transformers (and a Hugging Face file) holds it: n_dims 1 (a
 * vector, shape[0]), 2 (a matrix, (rows, cols)) or 3 (a convolution's taps, (channels, 1,
 * taps)); unused entries 1. */
KILN_API kiln_status kiln_train_param_file_shape(const kiln_trainer *t, int i, int *n_dims,
                                                 int64_t shape[3]);
/* The fingerprint of the trainer's current parameters: kiln_model_fingerprint's definition
 * over every parameter's f32 values (kiln_train_get_param) with its transformers shape, so it
 * equals the fingerprint of the model kiln_train_export_hf writes in f32 (and, before any
 * step with f32 storage, the fingerprint of an f32 model the trainer was made from). */
KILN_API kiln_status kiln_train_fingerprint(const kiln_trainer *t, uint8_t out[32]);

/* AdamW's state of one parameter as torch.optim.AdamW keeps it (state[p]: exp_avg,
 * exp_avg_sq, step), n = its element count.
 * get: exp_avg and exp_avg_sq (n floats each, either may be NULL) and *step (may be NULL; the
 * updates done, the same for every parameter). With f32 moments (KILN_MOMENTS_F32) the stored
 * values exactly; with 8-bit moments (KILN_MOMENTS_Q8) their dequantized values, what the
 * next update reads.
 * set: both moments (finite, exp_avg_sq >= 0; checked before anything is written). f32
 * moments: stored exactly, so get -> set -> the next updates have the bits of the run the
 * state came from. 8-bit moments: quantized per block of 256 as an update stores them, which
 * is lossy (a resume through get/set is then close to, not bit-identical with, the original;
 * kiln_train_save / kiln_train_load keep the blocks exactly).
 * The bf16 storages' master copy and compensation are not part of torch's state: a resume
 * through these calls and kiln_train_get/set_param is bit-identical only with f32 weights. */
KILN_API kiln_status kiln_train_get_moments(const kiln_trainer *t, const char *name,
                                            float *exp_avg, float *exp_avg_sq, int64_t n,
                                            int64_t *step);
KILN_API kiln_status kiln_train_set_moments(kiln_trainer *t, const char *name,
                                            const float *exp_avg, const float *exp_avg_sq,
                                            int64_t n);
/* Set the optimizer's step count (torch's state["step"], one value for every parameter),
 * 0 <= step <= 2^24: the next update's bias corrections use step + 1. */
KILN_API kiln_status kiln_train_set_optimizer_step_count(kiln_trainer *t, int64_t step);

/* Memory by kiln's own accounting, in bytes. */
typedef struct kiln_train_memory {
    uint64_t params, grads, optimizer, activations;
    uint64_t scratch;   /* the fused loss's scratch at max_seq x max_batch rows; on a GPU plus
                         * what the backend holds for its own work (GEMM workspace and operand
                         * copies, column-sum partials, staging) */
    uint64_t peak_step; /* peak of live bytes during the last step (forward + backward); on a
                         * GPU the peak of the device memory kiln accounts for: the trainer's
                         * buffers (allocated at create), the fused loss's scratch of the step,
                         * what the backend holds, and the most its short-lived stream-ordered
                         * and graph allocations have held at once */
    int device;         /* where the figures live: -1 host (CPU), N: CUDA device N */
} kiln_train_memory;
/* A one-line description of the storage and the figures. buf may be NULL. */
KILN_API kiln_status kiln_train_describe(const kiln_trainer *t, char *buf, size_t cap,
                                         kiln_train_memory *mem);

/* Write the trainer's current weights as a Hugging Face folder: model.safetensors (f32, or
 * bf16 when dtype_bf16), config.json, generation_config.json, tokenizer.json and
 * tokenizer_config.json (chat template, special tokens). The folder is written atomically
 * (a temporary sibling folder, fsync'd, renamed into place); an existing folder is refused
 * unless overwrite is set. */
KILN_API kiln_status kiln_train_export_hf(const kiln_trainer *t, const char *dir, int dtype_bf16, int overwrite);

/* Save a checkpoint of the training state into dir/step-<step>/ (atomically: a crash at any
 * moment leaves the previous checkpoint loadable): parameters, optimizer state, step, and
 * run_json (the caller's own run configuration and data position, may be NULL). keep_last > 0
 * keeps only the newest keep_last checkpoints. */
KILN_API kiln_status kiln_train_save(kiln_trainer *t, const char *dir, uint64_t step,
                                     const char *run_json, int keep_last);
/* Restore the newest complete checkpoint of dir. A checkpoint of another architecture, shape,
 * parameter list or storage configuration is refused with nothing changed. *step gets its
 * step; *run_json (may be NULL) a copy of the run configuration (free with kiln_string_free).
 * A newer checkpoint that is marked complete but fails verification is set aside once an
 * older one has loaded: renamed to step-<k>.rejected-<UTC time> with a REASON file inside,
 * never deleted (docs/TRAINING.md, "Resuming a run"), so the run can save step k again. */
KILN_API kiln_status kiln_train_load(kiln_trainer *t, const char *dir, uint64_t *step,
                                     char **run_json);

/* ---- Distillation (`kiln distill`; docs/TRAINING.md, "Distillation") ---------------------- */

/* A teacher: model m's inference forward (no activations kept) on the backend of the trainer
 * `student`, whose steps it serves. Teacher and student must share the tokenizer (same
 * vocabulary, same tokens and rules), refused with KILN_ERR_INVALID_ARG otherwise. It counts as
 * a user of m and of the trainer (each refuses to be freed first). Its memory: a forward
 * state for the trainer's max_batch x max_seq tokens (KV cache, scratch) and the logits of
 * one block of rows (at most 64 MiB). */
typedef struct kiln_teacher kiln_teacher;
KILN_API kiln_status kiln_teacher_create(kiln_model *m, kiln_trainer *student, kiln_teacher **out);
KILN_API void kiln_teacher_free(kiln_teacher *t);

/* Hidden-state matching: the student's layer s matched to the teacher's layer t, each the
 * residual stream after that layer, counted from 1 (transformers' hidden_states[s]; for the
 * last layer, before the final norm). */
typedef struct kiln_hidden_pair {
    int student_layer, teacher_layer;
} kiln_hidden_pair;
typedef enum kiln_hidden_loss {
    KILN_HIDDEN_MSE = 0,    /* per row: ||P hs - ht||^2 / (teacher width) */
    KILN_HIDDEN_COSINE = 1, /* per row: 1 - cos(P hs, ht) (the norms' product floored at 1e-8) */
} kiln_hidden_loss;
/* Pair k's projection P, when the widths differ: the trainer's extra matrix (kiln_train_params
 * .extra) of this name with k, (teacher width) x (student width), trained with the student.
 * Equal widths: no projection (P = I). */
#define KILN_HIDDEN_PROJ_NAME "distill.hidden.%d.proj"
typedef struct kiln_teacher_params {
    int n_hidden;                   /* pairs (0: none, the default) */
    const kiln_hidden_pair *hidden; /* (n_hidden): each student layer and each teacher layer once */
    kiln_hidden_loss hidden_loss;
} kiln_teacher_params;
KILN_API kiln_teacher_params kiln_teacher_default_params(void);
/* kiln_teacher_create with hidden-state matching (p may be NULL: none). Errors
 * (KILN_ERR_INVALID_ARG): a layer out of [1, n_layer], a layer twice, a projection the trainer
 * lacks or of another shape (the message names it and its shape), a GPU trainer. */
KILN_API kiln_status kiln_teacher_create_ex(kiln_model *m, kiln_trainer *student, const kiln_teacher_params *p,
                                            kiln_teacher **out);

typedef struct kiln_distill_params {
    float temperature; /* tau > 0 (default 1): both distributions softened by it */
    float kd_weight;   /* weight of tau^2 KL(teacher || student) at tau (default 0.5) */
    float ce_weight;   /* weight of the hard cross-entropy on the targets (default 0.5) */
    float hidden_weight; /* weight of the hidden-state loss, summed over the teacher's pairs
                          * (default 1; unused without pairs) */
} kiln_distill_params;
KILN_API kiln_distill_params kiln_distill_default_params(void);

typedef struct kiln_distill_loss {
    float loss;           /* kd_weight tau^2 kl + ce_weight ce + hidden_weight hidden, reduced and scaled */
    float kl, ce;         /* the parts, reduced and scaled alike, unweighted */
    int64_t n_supervised; /* S: rows with a target >= 0 */
    float hidden;         /* the hidden-state part (0 without pairs), reduced and scaled alike */
} kiln_distill_loss;

/* kiln_train_step_batch with the distillation loss instead of the cross-entropy: per
 * supervised row n (targets[n] >= 0; the teacher's and student's logits zt, zs of the row)
 *   loss_n = kd_weight tau^2 KL(softmax(zt / tau) || softmax(zs / tau))
 *          + ce_weight (logsumexp(zs) - zs[targets[n]])
 *          + hidden_weight sum over the teacher's pairs of the hidden loss of row n
 * reduced over the rows as red says (MEAN: / S), times scale; the student's gradients
 * accumulated or overwritten as accumulate says. Neither model's n x V logits are held: the
 * student's are walked in vocabulary chunks, the teacher's made a block of rows at a time
 * (src/train/distill.c). Errors: kiln_train_step_batch's for ids and targets, a teacher made
 * for another trainer, n_seq x seq beyond the trainer's limits, a temperature or weights out
 * of range (KILN_ERR_INVALID_ARG), a non-finite loss; a failure after the gradient work began
 * leaves the gradients unusable until a step that does not accumulate. */
KILN_API kiln_status kiln_train_distill_step(kiln_trainer *t, kiln_teacher *teacher, const int32_t *ids,
                                             int n_seq, int seq, const int32_t *targets,
                                             const kiln_distill_params *dp, kiln_loss_reduction red,
                                             float scale, int accumulate, kiln_distill_loss *out);
/* ---------------------------------------------------------------------------------------- */
/* The fused linear cross-entropy on the caller's buffers (CPU, or a CUDA GPU)               */
/* ---------------------------------------------------------------------------------------- */

/* For hidden states h (N, H), an LM head W (V, H) and targets (N):
 *   loss_n = logsumexp_v(h_n . W_v) - h_n . W_{t_n}     at every supervised position n
 *   loss   = scale * sum_n loss_n / S  (KILN_LOSS_MEAN)  or  scale * sum_n loss_n  (SUM)
 * with S the supervised positions (targets[n] >= 0 and mask[n] != 0), and the gradients
 * dh = d loss / d h and dW = d loss / d W, without ever holding the N x V logits: the
 * vocabulary is walked in chunks (docs/TRAINING.md, "Fused linear cross-entropy"). It is the
 * trainer's own loss, offered on its own.
 *
 * A kiln_linear_ce holds a compute device. device -1: the CPU, every buffer in host memory.
 * device N >= 0: CUDA device N, with hidden, weight, dhidden, dweight and row_loss in DEVICE
 * memory the caller owns (a framework's CUDA tensors, say; host pointers are refused), while
 * targets and mask stay in HOST memory (the supervised rows are chosen and checked on the
 * host). On CUDA the work runs on kiln's own stream: the caller must have finished writing
 * the inputs (e.g. torch.cuda.synchronize()) before the call; the call returns once its
 * outputs are complete. A handle serves one thread at a time.
 *
 * Arithmetic: fast = 0 gives the CPU's bits on either device, run to run and for any thread
 * count (docs/ARITHMETIC.md); the results are defined for a given chunk. fast != 0 (CUDA
 * only) runs the products on bf16 tensor cores with f32 sums: not the CPU's bits, the same
 * bits run to run on one GPU model (docs/TRAINING.md, "Fast mode"). */
typedef struct kiln_linear_ce kiln_linear_ce;

typedef struct kiln_linear_ce_params {
    int64_t N, H, V;         /* positions, hidden size, vocabulary size */
    const void *hidden;      /* (N, H): f32, or bf16 bit patterns with hidden_bf16; row n at
                              * hidden + n * hidden_stride elements */
    const void *weight;      /* (V, H): f32, or bf16 bit patterns with weight_bf16 */
    int weight_bf16;
    const int32_t *targets;  /* (N), HOST memory; < 0 (e.g. -100): not supervised */
    const uint8_t *mask;     /* (N), HOST memory, or NULL (all ones); 0: not supervised */
    kiln_loss_reduction reduction; /* default KILN_LOSS_MEAN */
    float scale;             /* multiplies the loss and every gradient (default 1) */
    float *dhidden;          /* (N, H) f32 or NULL: overwritten (unsupervised rows 0), or with
                              * dhidden_accumulate added to (unsupervised rows untouched) */
    int dhidden_accumulate;
    float *dweight;          /* (V, H) f32 or NULL: d loss / d W is ADDED to it */
    float *row_loss;         /* (N) f32 or NULL: each position's loss, unscaled; 0 where not
                              * supervised */
    int64_t chunk;           /* vocabulary columns per chunk; 0 = 4096 */
    int64_t row_block;       /* CUDA fast mode, with a bf16 weight whose rows are 16-byte
                              * aligned, dhidden or dweight, and no row_loss: > 0 walks the
                              * supervised rows in blocks of row_block (rounded up to 8)
                              * instead of the vocabulary, each block's logits (bf16, about
                              * 2 x row_block x V bytes of scratch) made once: three products
                              * instead of four, as the trainer's steps do (docs/TRAINING.md).
                              * Its results differ from the vocabulary walk's in the last bits
                              * (defined for a given row_block). Then a non-finite loss leaves
                              * dhidden and dweight UNSPECIFIED. 0 (the default): the
                              * vocabulary walk. Ignored where it does not apply. */
    /* Added after row_block (callers that zero the struct or start from the defaults get
     * the earlier behaviour): */
    int64_t hidden_stride;   /* elements from one row of hidden to the next: 0 (the default) =
                              * H, rows back to back; else >= H, e.g. a strided view along
                              * the leading dimensions (a framework tensor's stride(-2)), read
                              * in place. CPU only: on CUDA anything but 0 or H is
                              * KILN_ERR_UNSUPPORTED */
    int hidden_bf16;         /* hidden holds bf16 bit patterns, widened exactly to f32 as
                              * the rows are read (the loss and gradients are those of the
                              * widened values; dhidden stays f32). CPU only: on CUDA
                              * KILN_ERR_UNSUPPORTED */
} kiln_linear_ce_params;

typedef struct kiln_linear_ce_result {
    float loss;             /* the reduced, scaled loss */
    double loss_f64;        /* the same from the f32 row losses summed in float64 */
    int64_t n_supervised;   /* S */
    size_t scratch_bytes;   /* the scratch the call used (device memory on CUDA) */
} kiln_linear_ce_result;

/* Defaults: sizes and pointers 0 / NULL, f32 hidden and weight, KILN_LOSS_MEAN, scale 1,
 * chunk 0, row_block 0, hidden_stride 0 (rows back to back). */
KILN_API kiln_linear_ce_params kiln_linear_ce_default_params(void);
/* device and fast as above. KILN_ERR_UNSUPPORTED naming why when the device cannot be used
 * (kiln built without CUDA, no such GPU, fast on the CPU). */
KILN_API kiln_status kiln_linear_ce_create(int device, int fast, kiln_linear_ce **out);
KILN_API void kiln_linear_ce_free(kiln_linear_ce *c);
/* As kiln_context_status, for the loss's backend. */
KILN_API kiln_status kiln_linear_ce_status(const kiln_linear_ce *c);
/* The loss of p into *out (may be NULL) and the gradients p asks for. Errors, each with
 * nothing the caller passed written (but the row walk's non-finite loss above): NULL or
 * inconsistent parameters, host pointers on CUDA -> KILN_ERR_INVALID_ARG; no supervised
 * position -> KILN_ERR_INVALID_ARG; a supervised target >= V, or a non-finite row loss ->
 * KILN_ERR_RANGE naming the position; out of memory -> KILN_ERR_NOMEM. */
KILN_API kiln_status kiln_linear_ce_compute(kiln_linear_ce *c, const kiln_linear_ce_params *p,
                                            kiln_linear_ce_result *out);

/* Free a string kiln returned. */
KILN_API void kiln_string_free(char *s);

/* ---------------------------------------------------------------------------------------- */
/* Serving engine: many requests, continuous batching over a paged KV cache (docs/SERVING.md) */
/* ---------------------------------------------------------------------------------------- */

/* A kiln_engine owns a model's forward state for many sequences and a worker thread. Each
 * step it runs one forward over a batch that mixes decode tokens of running requests and
 * prefill chunks of new ones, up to max_batch_tokens tokens. The KV cache is a pool of blocks
 * of 64 positions with reference counts; full blocks are found again by the hash of the token
 * prefix they end (prefix sharing), and shared read-only. When the pool runs out, the request
 * admitted last is preempted: its blocks are freed and it is recomputed later from its prompt
 * and the tokens it had produced, so it resumes to the same tokens.
 *
 * Same tokens whatever the batch: in the auditable arithmetic (fast = 0), a request's logits
 * have the bits it gets alone, and with the same prompt, settings and seed it produces the
 * tokens kiln_generate produces (tested). Every function here may be called from any thread. */
typedef struct kiln_engine kiln_engine;

typedef struct kiln_engine_params {
    int device;           /* -1 = CPU (default), N = CUDA device N */
    int fast;             /* 0 (default) = auditable arithmetic; as kiln_context_params.fast */
    int batch_invariant;  /* with fast: as kiln_context_params.batch_invariant */
    int format;           /* as kiln_context_params.format (kiln_format) */
    const char *format_rules; /* as kiln_context_params.format_rules (NULL: none) */
    int n_threads;        /* CPU threads, 0 = all cores */
    int n_ctx;            /* positions per request (prompt + output); 0 = the model's, at most KILN_DEFAULT_MAX_CTX */
    int max_batch_tokens; /* tokens per forward step (default 512) */
    int max_seqs;         /* requests running at once (default 32) */
    int kv_blocks;        /* KV pool in blocks of 64 positions; 0 = from kv_memory */
    size_t kv_memory;     /* KV pool bytes when kv_blocks is 0; 0 = room for every running request at n_ctx */
    int max_queue;        /* requests waiting to run beyond which submit says KILN_ERR_BUSY (default 256) */
    int prefix_cache;     /* share full blocks of common prompt prefixes (default 1; off for
                           * recurrent-state architectures, whose state has no per-token cache) */
    /* While requests are decoding, a step's prefill chunks are cut so that the step takes at
     * most this many times the step of all running requests decoding (from measured step
     * times; docs/SERVING.md, "A step"): it bounds the inter-token latency that new prompts
     * add. Default 2; 0 = no bound but max_batch_tokens.
     * Which step runs which chunk never changes a request's tokens (the batch invariance). */
    float itl_bound;
} kiln_engine_params;

KILN_API kiln_engine_params kiln_engine_default_params(void);
/* Start an engine on model m (which must outlive it). */
KILN_API kiln_status kiln_engine_create(kiln_model *m, const kiln_engine_params *p, kiln_engine **out);
/* Stop taking requests, finish the running and queued ones (drain = 1) or cancel them
 * (drain = 0), then stop the worker. Callbacks have all returned when it returns. */
KILN_API void kiln_engine_shutdown(kiln_engine *e, int drain);
/* kiln_engine_shutdown(e, 0) if still running, then free. */
KILN_API void kiln_engine_free(kiln_engine *e);

typedef enum kiln_request_event_kind {
    KILN_EVENT_TOKEN = 0, /* one generated token and the text it completes (may be empty) */
    KILN_EVENT_DONE = 1,  /* the last event of a request: finish_reason, counts, or an error */
} kiln_request_event_kind;

#define KILN_MAX_TOP_LOGPROBS 20

typedef struct kiln_request_event {
    kiln_request_event_kind kind;
    uint64_t request;     /* the id submit gave */
    /* KILN_EVENT_TOKEN */
    int32_t id;
    const char *text;     /* text released by this token (stop-string hold-back as kiln_generate) */
    size_t len;
    float logprob;        /* log-softmax of the model's logits at id (when logprobs >= 0) */
    int n_top;            /* top_logprobs alternatives below, by logprob descending, id ascending */
    int32_t top_ids[KILN_MAX_TOP_LOGPROBS];
    float top_logprobs[KILN_MAX_TOP_LOGPROBS];
    /* KILN_EVENT_DONE: finish_reason "stop" (end token or stop string), "length" (max_tokens
     * or the context), "cancelled", or "error" (status and message set) */
    const char *finish_reason;
    const char *stop_reason; /* kiln_generate's: "eos", "stop_string", "length", "context", ... */
    const char *tail;     /* held-back text released at the end (flushed bytes), and its length */
    size_t tail_len;
    kiln_status status;
    const char *message;
    int n_prompt, n_prompt_cached, n_generated;
    double queue_seconds, prefill_seconds; /* submit to first forward; first forward to first token */
} kiln_request_event;

/* Called on the engine's worker thread, in order, for each event of a request; the pointers
 * in ev are valid during the call only. It must return quickly (copy and signal): it holds up
 * every request's next step. After KILN_EVENT_DONE the engine never calls it for that request
 * again, so user may be freed then. */
typedef void (*kiln_request_callback)(const kiln_request_event *ev, void *user);

typedef struct kiln_request_params {
    const int32_t *prompt; /* copied by submit */
    size_t n_prompt;
    int max_tokens;        /* at most n_ctx - n_prompt are produced */
    kiln_sampler_params sampler;
    const char *const *stop_strings; /* NULL-terminated, copied; NULL: none */
    int ignore_eos;
    float presence_penalty;  /* OpenAI's: logit -= presence * (count > 0) + frequency * count, */
    float frequency_penalty; /* count = times the token was generated (the prompt not counted) */
    int logprobs;            /* -1: none; else n_top (0..KILN_MAX_TOP_LOGPROBS) alternatives too */
    /* A generation receipt's record (docs/REPRODUCIBILITY.md): NULL, or logits_chain with room
     * for 32 x (G + 1) bytes and receipt_ids for G ids, G = the most tokens the request can
     * produce (min(max_tokens, n_ctx - n_prompt + 1)); the caller sets the chain's first 32 bytes
     * to c_0 (kiln_receipt_chain_start), the engine writes c_{i+1} from the f32 logits row
     * token i was drawn from and token i to receipt_ids[i] (the end token too). Such a request
     * samples on the host (its rows are downloaded on a device) and takes no presence or
     * frequency penalty (refused: kiln verify cannot replay them). */
    uint8_t *logits_chain;
    int32_t *receipt_ids;
    kiln_request_callback on_event;
    void *user;
} kiln_request_params;

KILN_API kiln_request_params kiln_request_default_params(void);
/* Queue a request; *id names it to kiln_engine_cancel. KILN_ERR_BUSY when max_queue requests
 * are waiting already (nothing queued, on_event never called); KILN_ERR_RANGE for a token id
 * out of range or a prompt that leaves no room to generate; KILN_ERR_STATE after shutdown.
 * On KILN_OK the callback gets exactly one KILN_EVENT_DONE, eventually. */
KILN_API kiln_status kiln_engine_submit(kiln_engine *e, const kiln_request_params *p, uint64_t *id);
/* Stop request id at the next step: its blocks are freed and it ends with finish_reason
 * "cancelled". Unknown or finished ids are ignored. */
KILN_API void kiln_engine_cancel(kiln_engine *e, uint64_t id);

#define KILN_ENGINE_HIST_BUCKETS 16
typedef struct kiln_engine_stats {
    uint64_t requests_submitted, requests_finished, requests_cancelled, requests_rejected,
             requests_failed, preemptions;
    uint64_t prompt_tokens, prompt_tokens_cached, generated_tokens, steps;
    int queued, running;
    int kv_blocks_total, kv_blocks_used, kv_blocks_cached; /* cached: free but findable by prefix */
    /* histograms: counts of observations <= hist_bounds[i] seconds (last bound +inf) */
    double hist_bounds[KILN_ENGINE_HIST_BUCKETS];
    uint64_t ttft_hist[KILN_ENGINE_HIST_BUCKETS], itl_hist[KILN_ENGINE_HIST_BUCKETS];
    double ttft_sum, itl_sum;
    uint64_t ttft_count, itl_count;
} kiln_engine_stats;

KILN_API void kiln_engine_get_stats(kiln_engine *e, kiln_engine_stats *out);
/* The model the engine serves. */
KILN_API kiln_model *kiln_engine_model(kiln_engine *e);
/* Positions per request (the n_ctx it was made with, or the default it chose); 0 for a bad
 * handle. */
KILN_API int kiln_engine_n_ctx(kiln_engine *e);

#ifdef __cplusplus
}
#endif
#endif /* KILN_H */
