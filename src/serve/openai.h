/*
 * openai.h -- OpenAI's HTTP API as data: request bodies of POST /v1/chat/completions and
 * POST /v1/completions parsed and checked into a C struct, and the JSON of the answers
 * (chat.completion, text_completion, their streaming chunks, errors, the model list).
 *
 * Library-internal and free of HTTP: `kiln serve` (tools/serve_http.c) speaks HTTP and calls
 * these; the C tests and a libFuzzer target call them directly. docs/SERVING.md, "HTTP
 * front", lists the fields and what each means to kiln.
 *
 * Errors: a refused body gives KILN_ERR_INVALID_ARG with a kiln_oai_error that says what
 * OpenAI's API says for it: an HTTP status (400), a message naming the field, the field as
 * `param`, and the type "invalid_request_error". Unknown fields are ignored (as vLLM's
 * server does; OpenAI's own refuses them), so clients that send extensions still work.
 *
 * Strings the builders return are NUL-terminated JSON text; free them with kiln_oai_free.
 * Text handed to the builders need not be valid UTF-8: invalid bytes (and NUL bytes, which a
 * C string cannot carry into cJSON) become U+FFFD, so the JSON is always valid.
 */
#ifndef KILN_SERVE_OPENAI_H
#define KILN_SERVE_OPENAI_H

#include "kiln.h"

#include <stddef.h>
#include <stdint.h>

#define KILN_OAI_MAX_STOP 4
#define KILN_OAI_MAX_N 16
#define KILN_OAI_MAX_MESSAGES 4096

typedef enum kiln_oai_kind {
    KILN_OAI_CHAT = 0,       /* POST /v1/chat/completions */
    KILN_OAI_COMPLETION = 1, /* POST /v1/completions */
} kiln_oai_kind;

typedef struct kiln_oai_error {
    int http_status;        /* 400 for a refused body */
    char message[512];      /* names the field: "'temperature' must be a number in [0, 2]" */
    char param[64];         /* the field ("" when the body as a whole is wrong) */
    const char *type;       /* "invalid_request_error" */
} kiln_oai_error;

typedef struct kiln_oai_message {
    char *role;    /* "system", "user", "assistant" ("developer" is read as "system") */
    char *content; /* the text; an array of {type: "text", text} parts joined with "\n" */
} kiln_oai_message;

/* A parsed request. Every pointer is owned by the struct: kiln_oai_request_free. Fields the
 * body did not set hold the defaults said on each. */
typedef struct kiln_oai_request {
    kiln_oai_kind kind;
    char *model;                  /* NULL when absent */
    kiln_oai_message *messages;   /* chat: at least one */
    size_t n_messages;
    char *prompt;                 /* completions: the prompt as text (NULL when given as ids) */
    size_t prompt_len;
    int32_t *prompt_ids;          /* completions: the prompt as token ids (NULL when text) */
    size_t n_prompt_ids;
    int max_tokens;               /* max_tokens or max_completion_tokens; -1 when absent */
    float temperature;            /* [0, 2], default 1 (0: greedy) */
    float top_p;                  /* (0, 1], default 1 */
    int top_k;                    /* -1 or 0: off (default); else >= 1 */
    float min_p;                  /* [0, 1], default 0 */
    int has_seed;
    int64_t seed;                 /* when has_seed */
    char *stop[KILN_OAI_MAX_STOP + 1]; /* NULL-terminated, non-empty strings */
    int n_stop;
    int n;                        /* 1..16, default 1 */
    int stream;                   /* default 0 */
    int include_usage;            /* stream_options.include_usage, default 0 */
    int logprobs;                 /* -1: none (default); else alternatives per token, 0..20 */
    float presence_penalty;       /* [-2, 2], default 0 */
    float frequency_penalty;      /* [-2, 2], default 0 */
    float repetition_penalty;     /* (0, 100], default 1 (off) */
    int ignore_eos;               /* default 0 */
    int receipt;                  /* kiln's "receipt": true: each choice gets a generation
                                   * receipt (docs/REPRODUCIBILITY.md), default 0 */
} kiln_oai_request;

/* Parse and check body[0..len) (not necessarily NUL-terminated) as a request of that kind.
 * KILN_OK with *out filled (free with kiln_oai_request_free), or KILN_ERR_INVALID_ARG with
 * *err filled and *out zeroed (freeing it is a no-op), or KILN_ERR_NOMEM. */
kiln_status kiln_oai_parse_request(const char *body, size_t len, kiln_oai_kind kind,
                                   kiln_oai_request *out, kiln_oai_error *err);
void kiln_oai_request_free(kiln_oai_request *r);

/* ---- answers ------------------------------------------------------------------------------ */

/* One generated token, for logprobs. */
typedef struct kiln_oai_token {
    int32_t id;
    float logprob;
    int n_top;
    int32_t top_ids[KILN_MAX_TOP_LOGPROBS];
    float top_logprobs[KILN_MAX_TOP_LOGPROBS];
} kiln_oai_token;

/* One choice of an answer or of a chunk. */
typedef struct kiln_oai_choice {
    int index;
    const char *text;           /* the choice's text (of a chunk: the new text) */
    size_t len;
    const char *finish_reason;  /* "stop", "length", ...; NULL: none yet (a chunk's null) */
    const kiln_oai_token *tokens; /* logprobs of the tokens, or NULL when not asked for */
    size_t n_tokens;
    size_t text_offset;         /* completions' logprobs.text_offset of tokens[0] */
    int first;                  /* chat chunk: the first of this choice (delta gets the role) */
    const char *receipt_json;   /* the choice's receipt as JSON text (its "kiln_receipt"), or NULL */
} kiln_oai_choice;

typedef struct kiln_oai_usage {
    int prompt_tokens, completion_tokens, cached_tokens;
} kiln_oai_usage;

/* What every object of one answer shares. */
typedef struct kiln_oai_meta {
    kiln_oai_kind kind;
    const char *id;             /* "chatcmpl-..." or "cmpl-..." */
    const char *model;
    int64_t created;            /* Unix seconds */
    int logprobs;               /* as the request's: -1 none */
    const kiln_tokenizer *tok;  /* spells tokens for logprobs (may be NULL when logprobs < 0) */
} kiln_oai_meta;

/* A whole answer: chat.completion or text_completion with choices[0..n) and usage. NULL when
 * out of memory. */
char *kiln_oai_response_json(const kiln_oai_meta *m, const kiln_oai_choice *choices, size_t n,
                             const kiln_oai_usage *u);
/* One streaming chunk: chat.completion.chunk or text_completion. choices[0..n) (n may be 0);
 * usage: NULL gives no usage field unless with_usage_null (then "usage": null, as OpenAI sends
 * on every chunk when stream_options.include_usage is set); non-NULL gives the usage chunk. */
char *kiln_oai_chunk_json(const kiln_oai_meta *m, const kiln_oai_choice *choices, size_t n,
                          const kiln_oai_usage *usage, int with_usage_null);
/* {"error": {"message", "type", "param", "code"}}; param and code may be NULL (null). */
char *kiln_oai_error_json(const char *message, const char *type, const char *param,
                          const char *code);
/* GET /v1/models: {"object": "list", "data": [{"id", "object": "model", "created",
 * "owned_by": "kiln", "max_model_len"}]}. */
char *kiln_oai_models_json(const char *model, int64_t created, int max_model_len);
void kiln_oai_free(char *json);

/* Copy of s[0..len) with every invalid UTF-8 byte and every NUL replaced by U+FFFD,
 * NUL-terminated; *out_len its length. NULL when out of memory. kiln_free it. */
char *kiln_oai_utf8_clean(const char *s, size_t len, size_t *out_len);

#endif /* KILN_SERVE_OPENAI_H */
