/* openai.c -- OpenAI request bodies in, OpenAI answers out (openai.h). */
#include "openai.h"

#include "../base/base.h"
#include "../formats/json_text.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* ---- errors ------------------------------------------------------------------------------- */

/* Fill err (status 400, the param, the message) and set the thread's error: returns
 * KILN_ERR_INVALID_ARG. */
static kiln_status refuse(kiln_oai_error *err, const char *param, const char *fmt, ...)
    KILN_PRINTF(3, 4);
static kiln_status refuse(kiln_oai_error *err, const char *param, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
    snprintf(err->param, sizeof err->param, "%s", param ? param : "");
    err->http_status = 400;
    err->type = "invalid_request_error";
    return kiln_error(KILN_ERR_INVALID_ARG, "%s", err->message);
}

static kiln_status no_memory(kiln_oai_error *err) {
    snprintf(err->message, sizeof err->message, "out of memory while reading the request");
    err->param[0] = '\0';
    err->http_status = 500;
    err->type = "server_error";
    return kiln_error(KILN_ERR_NOMEM, "%s", err->message);
}

/* ---- typed fields ------------------------------------------------------------------------- */

/* The field name of the body, or NULL when absent or null (null means "the default"). */
static const cJSON *field(const cJSON *root, const char *name) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, name);
    return (v && !cJSON_IsNull(v)) ? v : NULL;
}

/* A number in [lo, hi] (lo excluded when lo_open); absent keeps *out. */
static kiln_status get_number(const cJSON *root, const char *name, double lo, double hi,
                              int lo_open, float *out, kiln_oai_error *err) {
    const cJSON *v = field(root, name);
    if (!v) return KILN_OK;
    if (!cJSON_IsNumber(v)) return refuse(err, name, "'%s' must be a number", name);
    double d = v->valuedouble;
    if (!isfinite(d) || d > hi || (lo_open ? d <= lo : d < lo))
        return refuse(err, name, "'%s' must be a number in %c%g, %g], got %g", name,
                      lo_open ? '(' : '[', lo, hi, d);
    *out = (float)d;
    return KILN_OK;
}

/* An integer in [lo, hi]; absent keeps *out and leaves *present alone. */
static kiln_status get_int64(const cJSON *root, const char *name, double lo, double hi,
                             int64_t *out, int *present, kiln_oai_error *err) {
    const cJSON *v = field(root, name);
    if (!v) return KILN_OK;
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || !isfinite(v->valuedouble))
        return refuse(err, name, "'%s' must be an integer", name);
    double d = v->valuedouble;
    if (d < lo || d > hi)
        return refuse(err, name, "'%s' must be an integer in [%.0f, %.0f], got %.0f", name, lo, hi,
                      d);
    *out = (int64_t)d;
    if (present) *present = 1;
    return KILN_OK;
}

static kiln_status get_int(const cJSON *root, const char *name, int lo, int hi, int *out,
                           int *present, kiln_oai_error *err) {
    int64_t v = *out;
    KILN_TRY(get_int64(root, name, lo, hi, &v, present, err));
    *out = (int)v;
    return KILN_OK;
}

static kiln_status get_bool(const cJSON *root, const char *name, int *out, kiln_oai_error *err) {
    const cJSON *v = field(root, name);
    if (!v) return KILN_OK;
    if (!cJSON_IsBool(v)) return refuse(err, name, "'%s' must be a boolean", name);
    *out = cJSON_IsTrue(v) ? 1 : 0;
    return KILN_OK;
}

/* ---- the parts of a request --------------------------------------------------------------- */

static kiln_status parse_stop(const cJSON *root, kiln_oai_request *r, kiln_oai_error *err) {
    const cJSON *v = field(root, "stop");
    if (!v) return KILN_OK;
    const cJSON *items[KILN_OAI_MAX_STOP];
    int n = 0;
    if (cJSON_IsString(v)) {
        items[n++] = v;
    } else if (cJSON_IsArray(v)) {
        const cJSON *it;
        cJSON_ArrayForEach(it, v) {
            if (n == KILN_OAI_MAX_STOP)
                return refuse(err, "stop", "'stop' holds at most %d strings", KILN_OAI_MAX_STOP);
            if (!cJSON_IsString(it)) return refuse(err, "stop", "'stop[%d]' must be a string", n);
            items[n++] = it;
        }
    } else {
        return refuse(err, "stop", "'stop' must be a string or an array of strings");
    }
    for (int i = 0; i < n; i++) {
        if (!items[i]->valuestring[0])
            return refuse(err, "stop", "'stop' strings must not be empty");
        if (!(r->stop[i] = kiln_strdup(items[i]->valuestring))) return no_memory(err);
        r->n_stop = i + 1;
    }
    return KILN_OK;
}

/* Append s to the growing buffer *buf (length *len); with sep before it when *len > 0. */
static int append_text(char **buf, size_t *len, const char *s, const char *sep) {
    size_t sl = strlen(s), pl = (*len && sep) ? strlen(sep) : 0, need;
    if (kiln_add_overflow(*len, sl + pl + 1, &need)) return 0;
    char *nb = kiln_realloc(*buf, need);
    if (!nb) return 0;
    memcpy(nb + *len, sep, pl);
    memcpy(nb + *len + pl, s, sl + 1);
    *buf = nb;
    *len += pl + sl;
    return 1;
}

static kiln_status parse_message(const cJSON *m, size_t i, kiln_oai_message *out,
                                 kiln_oai_error *err) {
    char param[48];
    snprintf(param, sizeof param, "messages[%zu]", i);
    if (!cJSON_IsObject(m))
        return refuse(err, param, "'%s' must be an object with 'role' and 'content'", param);
    const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
    if (!cJSON_IsString(role)) return refuse(err, param, "'%s.role' must be a string", param);
    const char *rs = role->valuestring;
    if (!strcmp(rs, "developer")) rs = "system";
    if (strcmp(rs, "system") && strcmp(rs, "user") && strcmp(rs, "assistant"))
        return refuse(err, param,
                      "'%s.role' must be 'system', 'developer', 'user' or 'assistant', got '%.40s'",
                      param, role->valuestring);
    if (!(out->role = kiln_strdup(rs))) return no_memory(err);
    const cJSON *content = cJSON_GetObjectItemCaseSensitive(m, "content");
    size_t len = 0;
    if (cJSON_IsString(content)) {
        out->content = kiln_strdup(content->valuestring);
    } else if (cJSON_IsArray(content)) {
        /* parts [{"type": "text", "text": ...}], joined with newlines */
        out->content = kiln_strdup("");
        size_t j = 0;
        const cJSON *part;
        cJSON_ArrayForEach(part, content) {
            const cJSON *type =
                cJSON_IsObject(part) ? cJSON_GetObjectItemCaseSensitive(part, "type") : NULL;
            const cJSON *text =
                cJSON_IsObject(part) ? cJSON_GetObjectItemCaseSensitive(part, "text") : NULL;
            if (!cJSON_IsString(type) || strcmp(type->valuestring, "text"))
                return refuse(err, param,
                              "'%s.content[%zu]' must be {\"type\": \"text\", \"text\": ...}: only "
                              "text parts are supported",
                              param, j);
            if (!cJSON_IsString(text))
                return refuse(err, param, "'%s.content[%zu].text' must be a string", param, j);
            if (out->content && !append_text(&out->content, &len, text->valuestring, "\n"))
                return no_memory(err);
            j++;
        }
    } else if ((!content || cJSON_IsNull(content)) && !strcmp(rs, "assistant")) {
        out->content = kiln_strdup(""); /* an assistant turn without text */
    } else {
        return refuse(err, param, "'%s.content' must be a string or an array of text parts", param);
    }
    return out->content ? KILN_OK : no_memory(err);
}

static kiln_status parse_messages(const cJSON *root, kiln_oai_request *r, kiln_oai_error *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "messages");
    if (!cJSON_IsArray(v))
        return refuse(err, "messages", "'messages' is required: an array of {role, content}");
    int n = cJSON_GetArraySize(v);
    if (n < 1) return refuse(err, "messages", "'messages' must hold at least one message");
    if (n > KILN_OAI_MAX_MESSAGES)
        return refuse(err, "messages", "'messages' holds at most %d messages",
                      KILN_OAI_MAX_MESSAGES);
    r->messages = kiln_calloc((size_t)n, sizeof *r->messages);
    if (!r->messages) return no_memory(err);
    r->n_messages = (size_t)n;
    size_t i = 0;
    const cJSON *m;
    cJSON_ArrayForEach(m, v) {
        KILN_TRY(parse_message(m, i, &r->messages[i], err));
        i++;
    }
    return KILN_OK;
}

/* A prompt of token ids: a non-empty array of integers in [0, 2^31). */
static kiln_status parse_prompt_ids(const cJSON *arr, const char *param, kiln_oai_request *r,
                                    kiln_oai_error *err) {
    int n = cJSON_GetArraySize(arr);
    if (n < 1) return refuse(err, "prompt", "'%s' must not be empty", param);
    r->prompt_ids = kiln_malloc((size_t)n * sizeof(int32_t));
    if (!r->prompt_ids) return no_memory(err);
    size_t i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, arr) {
        double d = cJSON_IsNumber(it) ? it->valuedouble : -1;
        if (!cJSON_IsNumber(it) || d != floor(d) || d < 0 || d > INT32_MAX)
            return refuse(err, "prompt", "'%s[%zu]' must be a token id (an integer >= 0)", param,
                          i);
        r->prompt_ids[i++] = (int32_t)d;
    }
    r->n_prompt_ids = i;
    return KILN_OK;
}

static kiln_status parse_prompt(const cJSON *root, kiln_oai_request *r, kiln_oai_error *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    if (!v || cJSON_IsNull(v))
        return refuse(err, "prompt", "'prompt' is required: a string or an array of token ids");
    if (cJSON_IsArray(v) && cJSON_GetArraySize(v) == 1 &&
        (cJSON_IsString(v->child) || cJSON_IsArray(v->child)))
        v = v->child; /* a batch of one prompt */
    if (cJSON_IsString(v)) {
        r->prompt_len = strlen(v->valuestring);
        if (!(r->prompt = kiln_strndup(v->valuestring, r->prompt_len))) return no_memory(err);
        return KILN_OK;
    }
    if (!cJSON_IsArray(v))
        return refuse(err, "prompt", "'prompt' must be a string or an array of token ids");
    if (v->child && (cJSON_IsString(v->child) || cJSON_IsArray(v->child)))
        return refuse(
            err, "prompt",
            "'prompt': one prompt per request (a string or an array of token ids), not a batch");
    return parse_prompt_ids(v, "prompt", r, err);
}

/* OpenAI fields kiln does not do, refused rather than ignored where ignoring them would give
 * an answer the client did not ask for. */
static kiln_status refuse_unsupported(const cJSON *root, kiln_oai_kind kind, kiln_oai_error *err) {
    const cJSON *v;
    if ((v = field(root, "echo")) && !cJSON_IsFalse(v))
        return refuse(err, "echo", "'echo' is not supported");
    if ((v = field(root, "suffix")) && !(cJSON_IsString(v) && !v->valuestring[0]))
        return refuse(err, "suffix", "'suffix' is not supported");
    if ((v = field(root, "best_of")) && !(cJSON_IsNumber(v) && v->valuedouble == 1))
        return refuse(err, "best_of", "'best_of' other than 1 is not supported");
    if (kind == KILN_OAI_CHAT) {
        if ((v = field(root, "tools")) && !(cJSON_IsArray(v) && cJSON_GetArraySize(v) == 0))
            return refuse(err, "tools", "'tools' is not supported");
        v = field(root, "response_format");
        if (v) {
            const cJSON *t = cJSON_IsObject(v) ? cJSON_GetObjectItemCaseSensitive(v, "type") : NULL;
            if (!cJSON_IsString(t) || strcmp(t->valuestring, "text"))
                return refuse(err, "response_format",
                              "'response_format' other than {\"type\": \"text\"} is not supported");
        }
    }
    return KILN_OK;
}

static kiln_status parse_logprobs(const cJSON *root, kiln_oai_request *r, kiln_oai_error *err) {
    if (r->kind == KILN_OAI_COMPLETION) { /* an integer: how many alternatives */
        int present = 0, n = -1;
        KILN_TRY(get_int(root, "logprobs", 0, KILN_MAX_TOP_LOGPROBS, &n, &present, err));
        r->logprobs = present ? n : -1;
        return KILN_OK;
    }
    int want = 0, top = 0, top_present = 0;
    KILN_TRY(get_bool(root, "logprobs", &want, err));
    KILN_TRY(get_int(root, "top_logprobs", 0, KILN_MAX_TOP_LOGPROBS, &top, &top_present, err));
    if (top_present && !want)
        return refuse(err, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
    r->logprobs = want ? top : -1;
    return KILN_OK;
}

static kiln_status parse_fields(const cJSON *root, kiln_oai_request *r, kiln_oai_error *err) {
    const cJSON *v;
    if ((v = field(root, "model"))) {
        if (!cJSON_IsString(v)) return refuse(err, "model", "'model' must be a string");
        if (!(r->model = kiln_strdup(v->valuestring))) return no_memory(err);
    }
    KILN_TRY(refuse_unsupported(root, r->kind, err));
    if (r->kind == KILN_OAI_CHAT) KILN_TRY(parse_messages(root, r, err));
    else KILN_TRY(parse_prompt(root, r, err));
    int present = 0;
    KILN_TRY(get_int(root, "max_tokens", 0, 1 << 30, &r->max_tokens, &present, err));
    KILN_TRY(get_int(root, "max_completion_tokens", 0, 1 << 30, &r->max_tokens, &present, err));
    KILN_TRY(get_number(root, "temperature", 0, 2, 0, &r->temperature, err));
    KILN_TRY(get_number(root, "top_p", 0, 1, 1, &r->top_p, err));
    KILN_TRY(get_int(root, "top_k", -1, 1 << 24, &r->top_k, NULL, err));
    KILN_TRY(get_number(root, "min_p", 0, 1, 0, &r->min_p, err));
    /* integers that a double holds exactly */
    KILN_TRY(get_int64(root, "seed", -9007199254740992.0, 9007199254740992.0, &r->seed,
                       &r->has_seed, err));
    KILN_TRY(parse_stop(root, r, err));
    KILN_TRY(get_int(root, "n", 1, KILN_OAI_MAX_N, &r->n, NULL, err));
    KILN_TRY(get_bool(root, "stream", &r->stream, err));
    if ((v = field(root, "stream_options"))) {
        if (!cJSON_IsObject(v))
            return refuse(err, "stream_options", "'stream_options' must be an object");
        const cJSON *iu = field(v, "include_usage");
        if (iu && !cJSON_IsBool(iu))
            return refuse(err, "stream_options",
                          "'stream_options.include_usage' must be a boolean");
        r->include_usage = cJSON_IsTrue(iu) ? 1 : 0;
    }
    KILN_TRY(parse_logprobs(root, r, err));
    KILN_TRY(get_number(root, "presence_penalty", -2, 2, 0, &r->presence_penalty, err));
    KILN_TRY(get_number(root, "frequency_penalty", -2, 2, 0, &r->frequency_penalty, err));
    KILN_TRY(get_number(root, "repetition_penalty", 0, 100, 1, &r->repetition_penalty, err));
    KILN_TRY(get_bool(root, "ignore_eos", &r->ignore_eos, err));
    KILN_TRY(get_bool(root, "receipt", &r->receipt, err));
    return KILN_OK;
}

kiln_status kiln_oai_parse_request(const char *body, size_t len, kiln_oai_kind kind,
                                   kiln_oai_request *out, kiln_oai_error *err) {
    kiln_oai_error scratch;
    if (!err) err = &scratch;
    memset(err, 0, sizeof *err);
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_oai_parse_request: NULL out");
    memset(out, 0, sizeof *out);
    if (!body && len) return refuse(err, NULL, "the request body is missing");
    if (!len) return refuse(err, NULL, "the request body is empty: expected a JSON object");
    /* cJSON would cut a string at an escaped NUL: refuse it, naming where */
    if (kiln_json_check_no_nul(body, len, "request body") != KILN_OK)
        return refuse(err, NULL, "%s", kiln_last_error());
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(body, len, &end, 0);
    if (!root) {
        size_t at = (end && end >= body && end <= body + len) ? (size_t)(end - body) : 0;
        return refuse(err, NULL, "the request body is not valid JSON (near byte %zu)", at);
    }
    for (const char *p = end; p && p < body + len; p++)
        if (*p != ' ' && *p != '\t' && *p != '\r' && *p != '\n') {
            cJSON_Delete(root);
            return refuse(err, NULL, "the request body holds more than one JSON value (byte %zu)",
                          (size_t)(p - body));
        }
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return refuse(err, NULL, "the request body must be a JSON object");
    }
    kiln_oai_request r;
    memset(&r, 0, sizeof r);
    r.kind = kind;
    r.max_tokens = -1;
    r.temperature = 1.0f;
    r.top_p = 1.0f;
    r.top_k = 0;
    r.min_p = 0.0f;
    r.n = 1;
    r.logprobs = -1;
    r.repetition_penalty = 1.0f;
    kiln_status st = parse_fields(root, &r, err);
    cJSON_Delete(root);
    if (st != KILN_OK) {
        kiln_oai_request_free(&r);
        return st;
    }
    *out = r;
    return KILN_OK;
}

void kiln_oai_request_free(kiln_oai_request *r) {
    if (!r) return;
    kiln_free(r->model);
    for (size_t i = 0; i < r->n_messages; i++) {
        kiln_free(r->messages[i].role);
        kiln_free(r->messages[i].content);
    }
    kiln_free(r->messages);
    kiln_free(r->prompt);
    kiln_free(r->prompt_ids);
    for (int i = 0; i < r->n_stop; i++) kiln_free(r->stop[i]);
    memset(r, 0, sizeof *r);
}

/* ---- text --------------------------------------------------------------------------------- */

/* Length of the valid UTF-8 sequence at s[0..n) (1..4), or 0 when it is not one. Overlong
 * forms, surrogates and code points past U+10FFFF are invalid (RFC 3629). */
static size_t utf8_seq(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    if (c < 0x80) return 1;
    size_t k;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) k = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        k = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        k = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else return 0;
    if (n < k) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < k; i++)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return k;
}

char *kiln_oai_utf8_clean(const char *s, size_t len, size_t *out_len) {
    size_t cap;
    /* each byte becomes at most 3 (U+FFFD) */
    if (kiln_mul_overflow(len, 3, &cap) || kiln_add_overflow(cap, 1, &cap)) return NULL;
    char *o = kiln_malloc(cap);
    if (!o) return NULL;
    const unsigned char *u = (const unsigned char *)s;
    size_t j = 0;
    for (size_t i = 0; i < len;) {
        size_t k = utf8_seq(u + i, len - i);
        if (k && u[i] != 0) {
            memcpy(o + j, u + i, k);
            j += k, i += k;
        } else { /* an invalid byte, or a NUL (a C string cannot carry it to cJSON) */
            memcpy(o + j, "\xEF\xBF\xBD", 3);
            j += 3, i++;
        }
    }
    o[j] = '\0';
    if (out_len) *out_len = j;
    return o;
}

/* cJSON string of text[0..len), cleaned to UTF-8 (NULL when out of memory). */
static cJSON *json_text(const char *text, size_t len) {
    char *c = kiln_oai_utf8_clean(text ? text : "", text ? len : 0, NULL);
    if (!c) return NULL;
    cJSON *s = cJSON_CreateString(c);
    kiln_free(c);
    return s;
}

/* cJSON's numbers cannot be infinite: OpenAI's -9999 stands for a log-probability of -inf. */
static double finite_logprob(float lp) { return isfinite(lp) ? (double)lp : -9999.0; }

/* ---- logprobs ----------------------------------------------------------------------------- */

/* The bytes of token id (special tokens spelled out), into buf (cap 256) or a kiln_malloc'd
 * buffer returned in *heap. */
static const char *token_bytes(const kiln_tokenizer *tok, int32_t id, char *buf, size_t cap,
                               char **heap, size_t *n) {
    *heap = NULL;
    *n = 0;
    if (!tok) return "";
    kiln_status st = kiln_token_to_bytes(tok, id, 1, buf, cap, n);
    if (st == KILN_OK) return buf;
    if (st != KILN_ERR_BUFFER_TOO_SMALL || !(*heap = kiln_malloc(*n + 1))) {
        *n = 0;
        return "";
    }
    size_t need = *n;
    if (kiln_token_to_bytes(tok, id, 1, *heap, need + 1, n) != KILN_OK) *n = 0;
    return *heap;
}

/* {"token", "logprob", "bytes"} of chat's logprobs.content[] and its top_logprobs[]. */
static cJSON *chat_logprob_item(const kiln_tokenizer *tok, int32_t id, float lp, size_t *spelled) {
    char buf[256], *heap;
    size_t n;
    const char *b = token_bytes(tok, id, buf, sizeof buf, &heap, &n);
    cJSON *o = cJSON_CreateObject();
    cJSON *bytes = cJSON_CreateArray();
    cJSON *t = json_text(b, n);
    if (o && t) cJSON_AddItemToObject(o, "token", t);
    else cJSON_Delete(t);
    cJSON_AddNumberToObject(o, "logprob", finite_logprob(lp));
    for (size_t i = 0; bytes && i < n; i++)
        cJSON_AddItemToArray(bytes, cJSON_CreateNumber((unsigned char)b[i]));
    if (o && bytes) cJSON_AddItemToObject(o, "bytes", bytes);
    else cJSON_Delete(bytes);
    if (spelled) *spelled = n;
    kiln_free(heap);
    return o;
}

/* chat: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]} */
static cJSON *chat_logprobs(const kiln_oai_meta *m, const kiln_oai_choice *c) {
    cJSON *lp = cJSON_CreateObject();
    cJSON *content = cJSON_AddArrayToObject(lp, "content");
    for (size_t i = 0; content && i < c->n_tokens; i++) {
        const kiln_oai_token *t = &c->tokens[i];
        cJSON *item = chat_logprob_item(m->tok, t->id, t->logprob, NULL);
        cJSON *top = cJSON_AddArrayToObject(item, "top_logprobs");
        for (int k = 0; top && k < t->n_top && k < KILN_MAX_TOP_LOGPROBS; k++)
            cJSON_AddItemToArray(
                top, chat_logprob_item(m->tok, t->top_ids[k], t->top_logprobs[k], NULL));
        cJSON_AddItemToArray(content, item);
    }
    cJSON_AddNullToObject(lp, "refusal");
    return lp;
}

/* completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"} */
static cJSON *completion_logprobs(const kiln_oai_meta *m, const kiln_oai_choice *c) {
    cJSON *lp = cJSON_CreateObject();
    cJSON *tokens = cJSON_AddArrayToObject(lp, "tokens");
    cJSON *lps = cJSON_AddArrayToObject(lp, "token_logprobs");
    cJSON *tops = cJSON_AddArrayToObject(lp, "top_logprobs");
    cJSON *offs = cJSON_AddArrayToObject(lp, "text_offset");
    if (!tokens || !lps || !tops || !offs) return lp;
    size_t off = c->text_offset;
    for (size_t i = 0; i < c->n_tokens; i++) {
        const kiln_oai_token *t = &c->tokens[i];
        char buf[256], *heap;
        size_t n;
        const char *b = token_bytes(m->tok, t->id, buf, sizeof buf, &heap, &n);
        cJSON_AddItemToArray(tokens, json_text(b, n));
        kiln_free(heap);
        cJSON_AddItemToArray(lps, cJSON_CreateNumber(finite_logprob(t->logprob)));
        cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)off));
        off += n;
        cJSON *top = cJSON_CreateObject();
        for (int k = 0; top && k < t->n_top && k < KILN_MAX_TOP_LOGPROBS; k++) {
            char tb[256], *th;
            size_t tn, cl;
            const char *s = token_bytes(m->tok, t->top_ids[k], tb, sizeof tb, &th, &tn);
            char *key = kiln_oai_utf8_clean(s, tn, &cl);
            kiln_free(th);
            if (key) cJSON_AddNumberToObject(top, key, finite_logprob(t->top_logprobs[k]));
            kiln_free(key);
        }
        cJSON_AddItemToArray(tops, top);
    }
    return lp;
}

/* ---- answers ------------------------------------------------------------------------------ */

static void add_usage(cJSON *o, const kiln_oai_usage *u) {
    cJSON *us = cJSON_AddObjectToObject(o, "usage");
    cJSON_AddNumberToObject(us, "prompt_tokens", u->prompt_tokens);
    cJSON_AddNumberToObject(us, "completion_tokens", u->completion_tokens);
    cJSON_AddNumberToObject(us, "total_tokens",
                            (double)u->prompt_tokens + (double)u->completion_tokens);
    cJSON *d = cJSON_AddObjectToObject(us, "prompt_tokens_details");
    cJSON_AddNumberToObject(d, "cached_tokens", u->cached_tokens);
}

static cJSON *envelope(const kiln_oai_meta *m, const char *object) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", m->id ? m->id : "");
    cJSON_AddStringToObject(o, "object", object);
    cJSON_AddNumberToObject(o, "created", (double)m->created);
    cJSON_AddStringToObject(o, "model", m->model ? m->model : "");
    return o;
}

static void add_finish(cJSON *o, const char *finish_reason) {
    if (finish_reason) cJSON_AddStringToObject(o, "finish_reason", finish_reason);
    else cJSON_AddNullToObject(o, "finish_reason");
}

/* o[key] = choice c's text (nothing when o or the string could not be made) */
static void add_text(cJSON *o, const char *key, const kiln_oai_choice *c) {
    cJSON *t = json_text(c->text, c->len);
    if (o && t) cJSON_AddItemToObject(o, key, t);
    else cJSON_Delete(t);
}

/* o["kiln_receipt"] = choice c's receipt, when it has one */
static void add_receipt(cJSON *o, const kiln_oai_choice *c) {
    cJSON *r = c->receipt_json ? cJSON_Parse(c->receipt_json) : NULL;
    if (o && r) cJSON_AddItemToObject(o, "kiln_receipt", r);
    else cJSON_Delete(r);
}

static void add_logprobs(cJSON *o, const kiln_oai_meta *m, const kiln_oai_choice *c) {
    if (m->logprobs >= 0 && c->tokens)
        cJSON_AddItemToObject(o, "logprobs",
                              m->kind == KILN_OAI_CHAT ? chat_logprobs(m, c)
                                                       : completion_logprobs(m, c));
    else cJSON_AddNullToObject(o, "logprobs");
}

/* Print and delete o; NULL when anything along the way ran out of memory (cJSON's Add
 * functions tolerate NULL parents, so a failure shows as a missing member or a NULL print). */
static char *finish_json(cJSON *o) {
    char *s = o ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    return s;
}

char *kiln_oai_response_json(const kiln_oai_meta *m, const kiln_oai_choice *choices, size_t n,
                             const kiln_oai_usage *u) {
    int chat = m->kind == KILN_OAI_CHAT;
    cJSON *o = envelope(m, chat ? "chat.completion" : "text_completion");
    cJSON *arr = cJSON_AddArrayToObject(o, "choices");
    for (size_t i = 0; arr && i < n; i++) {
        const kiln_oai_choice *c = &choices[i];
        cJSON *ch = cJSON_CreateObject();
        cJSON_AddNumberToObject(ch, "index", c->index);
        if (chat) {
            cJSON *msg = cJSON_AddObjectToObject(ch, "message");
            cJSON_AddStringToObject(msg, "role", "assistant");
            add_text(msg, "content", c);
            cJSON_AddNullToObject(msg, "refusal");
        } else {
            add_text(ch, "text", c);
        }
        add_logprobs(ch, m, c);
        add_finish(ch, c->finish_reason);
        add_receipt(ch, c);
        cJSON_AddItemToArray(arr, ch);
    }
    if (u) add_usage(o, u);
    return finish_json(o);
}

char *kiln_oai_chunk_json(const kiln_oai_meta *m, const kiln_oai_choice *choices, size_t n,
                          const kiln_oai_usage *usage, int with_usage_null) {
    int chat = m->kind == KILN_OAI_CHAT;
    cJSON *o = envelope(m, chat ? "chat.completion.chunk" : "text_completion");
    cJSON *arr = cJSON_AddArrayToObject(o, "choices");
    for (size_t i = 0; arr && i < n; i++) {
        const kiln_oai_choice *c = &choices[i];
        cJSON *ch = cJSON_CreateObject();
        cJSON_AddNumberToObject(ch, "index", c->index);
        if (chat) {
            cJSON *delta = cJSON_AddObjectToObject(ch, "delta");
            if (c->first) cJSON_AddStringToObject(delta, "role", "assistant");
            if (c->len || c->first) add_text(delta, "content", c);
        } else {
            add_text(ch, "text", c);
        }
        add_logprobs(ch, m, c);
        add_finish(ch, c->finish_reason);
        add_receipt(ch, c);
        cJSON_AddItemToArray(arr, ch);
    }
    if (usage) add_usage(o, usage);
    else if (with_usage_null) cJSON_AddNullToObject(o, "usage");
    return finish_json(o);
}

char *kiln_oai_error_json(const char *message, const char *type, const char *param,
                          const char *code) {
    cJSON *o = cJSON_CreateObject();
    cJSON *e = cJSON_AddObjectToObject(o, "error");
    size_t ml = message ? strlen(message) : 0;
    cJSON *msg = json_text(message ? message : "", ml);
    if (e && msg) cJSON_AddItemToObject(e, "message", msg);
    else cJSON_Delete(msg);
    cJSON_AddStringToObject(e, "type", type ? type : "invalid_request_error");
    if (param && *param) cJSON_AddStringToObject(e, "param", param);
    else cJSON_AddNullToObject(e, "param");
    if (code && *code) cJSON_AddStringToObject(e, "code", code);
    else cJSON_AddNullToObject(e, "code");
    return finish_json(o);
}

char *kiln_oai_models_json(const char *model, int64_t created, int max_model_len) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(o, "data");
    cJSON *mo = cJSON_CreateObject();
    cJSON_AddStringToObject(mo, "id", model ? model : "");
    cJSON_AddStringToObject(mo, "object", "model");
    cJSON_AddNumberToObject(mo, "created", (double)created);
    cJSON_AddStringToObject(mo, "owned_by", "kiln");
    if (max_model_len > 0) cJSON_AddNumberToObject(mo, "max_model_len", max_model_len);
    if (data && mo) cJSON_AddItemToArray(data, mo);
    else cJSON_Delete(mo);
    return finish_json(o);
}

void kiln_oai_free(char *json) { cJSON_free(json); }
