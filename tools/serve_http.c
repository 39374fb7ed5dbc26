/*
 * serve_http.c -- the HTTP front of `kiln serve` (serve_http.h, docs/SERVING.md).
 *
 * Threading: libmicrohttpd runs one thread per connection (MHD_USE_THREAD_PER_CONNECTION).
 * A connection's thread parses the request, submits it to the engine and then sleeps in
 * poll() on two descriptors: an eventfd the engine's callback signals, and the client's
 * socket (POLLRDHUP). The engine does the compute on its own worker; the connection threads
 * only copy text out and write it. Why not the internal thread pool with suspend/resume: a
 * suspended connection neither notices that its client went away nor times out (MHD's own
 * documentation), so a client that disconnects while its request waits in the queue or
 * prefills would hold its engine request to the end; here the poll on the socket sees the
 * hang-up at once and cancels it. The cost, a thread per open connection, is bounded by
 * --max-connections (and each thread's stack by MHD_OPTION_THREAD_STACK_SIZE).
 *
 * Lifetime of a generation (struct job): shared by the connection's thread, the response
 * object MHD holds while streaming, and the engine's callback, one reference each (one per
 * engine request: n > 1 submits n). Each holder drops its reference when done: the request
 * when MHD says it completed (or the client went away), the response when MHD frees it, an
 * engine request at its KILN_EVENT_DONE. The last one frees the job, so the callback never
 * touches freed memory and nothing outlives its last user. A client that disconnects makes
 * the connection side cancel the job's engine requests (kiln_engine_cancel), whose DONE
 * events then release the rest. Lock order: the engine's locks before job->mu (the callback
 * runs under the engine); kiln_engine_cancel is never called with job->mu held.
 */
#define _GNU_SOURCE /* POLLRDHUP */
#include "serve_http.h"

#if KILN_HAVE_MHD /* else `kiln serve` says it has no HTTP server (cmd_serve.c) */

#include "base/base.h"
#include "formats/json_text.h"
#include "serve/openai.h"
#include "receipt.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <microhttpd.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

uint64_t cli_random_seed(void); /* cli_util.c */

/* ---- the server --------------------------------------------------------------------------- */

/* HTTP status codes the metrics count (anything else counts as "other"). */
static const int COUNTED_CODES[] = {200, 400, 401, 404, 405, 413, 429, 500, 503};
#define N_COUNTED (sizeof COUNTED_CODES / sizeof COUNTED_CODES[0])

struct serve_server {
    serve_config cfg;
    struct MHD_Daemon *daemon;
    int port;
    atomic_int active;            /* requests being answered */
    atomic_int draining;
    atomic_uint_fast64_t next_id; /* response ids */
    uint64_t id_salt;
    atomic_uint_fast64_t responses[N_COUNTED + 1];
    atomic_uint_fast64_t client_disconnects;
    /* the model's and tokenizer's fingerprints, made at the first request for a receipt (not
     * at start-up: hashing a large model's weights takes seconds) */
    pthread_mutex_t fp_mu;
    int fp_ready;
    uint8_t model_fp[32], tok_fp[32];
};

/* s's fingerprints, made once (any connection thread). */
static kiln_status server_fingerprints(serve_server *s) {
    pthread_mutex_lock(&s->fp_mu);
    kiln_status st = KILN_OK;
    if (!s->fp_ready) {
        st = kiln_model_fingerprint(kiln_engine_model(s->cfg.engine), s->model_fp);
        if (st == KILN_OK) st = kiln_tokenizer_fingerprint(s->cfg.tok, s->tok_fp);
        s->fp_ready = st == KILN_OK;
    }
    pthread_mutex_unlock(&s->fp_mu);
    return st;
}

static void count_response(serve_server *s, int code) {
    size_t i = 0;
    while (i < N_COUNTED && COUNTED_CODES[i] != code) i++;
    atomic_fetch_add(&s->responses[i], 1);
}

/* ---- responses ---------------------------------------------------------------------------- */

/* Queue body (copied) with status and content type; extra header pairs name, value, ...,
 * NULL. */
static enum MHD_Result reply(serve_server *s, struct MHD_Connection *c, int status,
                             const char *type, const char *body, size_t len, ...) {
    struct MHD_Response *r =
        MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    va_list ap;
    va_start(ap, len);
    for (const char *name; (name = va_arg(ap, const char *));) {
        const char *value = va_arg(ap, const char *);
        MHD_add_response_header(r, name, value);
    }
    va_end(ap);
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    count_response(s, status);
    return ret;
}

/* Queue json (taken: freed here) with status. */
static enum MHD_Result reply_json(serve_server *s, struct MHD_Connection *c, int status,
                                  char *json) {
    if (!json) return MHD_NO; /* out of memory: MHD closes the connection */
    enum MHD_Result r = reply(s, c, status, "application/json", json, strlen(json), NULL);
    kiln_oai_free(json);
    return r;
}

/* An OpenAI-style error: {"error": {"message", "type", "param", "code"}}. */
static enum MHD_Result reply_error(serve_server *s, struct MHD_Connection *c, int status,
                                   const char *type, const char *param, const char *code,
                                   const char *fmt, ...) KILN_PRINTF(7, 8);
static enum MHD_Result reply_error(serve_server *s, struct MHD_Connection *c, int status,
                                   const char *type, const char *param, const char *code,
                                   const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    char *json = kiln_oai_error_json(msg, type, param, code);
    if (!json) return MHD_NO;
    enum MHD_Result r;
    if (status == 429)
        r = reply(s, c, status, "application/json", json, strlen(json), "Retry-After", "1", NULL);
    else if (status == 401)
        r = reply(s, c, status, "application/json", json, strlen(json), "WWW-Authenticate",
                  "Bearer", NULL);
    else r = reply(s, c, status, "application/json", json, strlen(json), NULL);
    kiln_oai_free(json);
    return r;
}

/* The HTTP status and error type for a failed kiln call. */
static int status_http(kiln_status st, const char **type) {
    switch (st) {
    case KILN_ERR_INVALID_ARG:
    case KILN_ERR_RANGE:
    case KILN_ERR_FORMAT:
    case KILN_ERR_UNSUPPORTED: *type = "invalid_request_error"; return 400;
    case KILN_ERR_BUSY: *type = "rate_limit_error"; return 429;
    case KILN_ERR_STATE: *type = "server_error"; return 503;
    default: *type = "server_error"; return 500;
    }
}

/* ---- a generation ------------------------------------------------------------------------- */

typedef struct job job;

/* One engine request: choice `index` of the answer. Written by the engine's callback under
 * job->mu; the cursors are the streaming reader's. */
typedef struct choice {
    job *owner;
    int index;
    uint64_t req_id;
    int submitted, done;
    char *text; /* everything released so far (kiln_malloc'd) */
    size_t len, cap;
    kiln_oai_token *toks; /* logprobs, when asked */
    size_t n_toks, cap_toks;
    char finish[16];
    kiln_status status; /* of a request that failed */
    char message[256];
    int n_prompt, n_cached, n_generated;
    int oom; /* an append failed: the choice is reported as an error */
    size_t sent_text, sent_toks; /* streamed so far */
    int sent_first, sent_finish;
    /* "receipt": true: the chain and ids the engine fills, the choice's sampler settings, and
     * at its end the receipt's JSON */
    uint8_t *chain;
    int32_t *rids;
    int max_tokens;
    kiln_sampler_params sampler;
    char *receipt;
} choice;

struct job {
    pthread_mutex_t mu;
    int refs;
    int efd;  /* eventfd: the callback's signal to the connection's thread */
    int sock; /* the client's socket, polled for a hang-up */
    serve_server *srv;
    kiln_oai_request req;
    kiln_oai_meta meta;
    char id[48];
    int n;
    int n_done;
    choice ch[KILN_OAI_MAX_N];
    /* streaming: SSE bytes made and not yet handed to MHD */
    char *out;
    size_t out_len, out_off, out_cap;
    int stream_over; /* [DONE] queued */
    int32_t *prompt; /* "receipt": true: the prompt's ids */
    size_t n_prompt;
    int cancelled;
};

static void job_free(job *j) {
    for (int i = 0; i < KILN_OAI_MAX_N; i++) {
        kiln_free(j->ch[i].text);
        kiln_free(j->ch[i].toks);
        kiln_free(j->ch[i].chain);
        kiln_free(j->ch[i].rids);
        free(j->ch[i].receipt);
    }
    kiln_free(j->prompt);
    kiln_oai_request_free(&j->req);
    kiln_free(j->out);
    if (j->efd >= 0) close(j->efd);
    pthread_mutex_destroy(&j->mu);
    kiln_free(j);
}

/* Drop one reference; the last frees. */
static void job_release(job *j) {
    pthread_mutex_lock(&j->mu);
    int last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (last) job_free(j);
}

/* Cancel every engine request of j that has not finished (the caller holds a reference);
 * client_left: count it as a client that went away. */
static void job_cancel(job *j, int client_left) {
    uint64_t ids[KILN_OAI_MAX_N];
    int n = 0;
    pthread_mutex_lock(&j->mu);
    if (!j->cancelled && j->n_done < j->n) {
        for (int i = 0; i < j->n; i++)
            if (j->ch[i].submitted && !j->ch[i].done) ids[n++] = j->ch[i].req_id;
        if (client_left) atomic_fetch_add(&j->srv->client_disconnects, 1);
    }
    j->cancelled = 1;
    pthread_mutex_unlock(&j->mu);
    for (int i = 0; i < n; i++) kiln_engine_cancel(j->srv->cfg.engine, ids[i]);
}

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 1;
    size_t nc = *cap ? *cap : 64, bytes;
    while (nc < need) {
        if (kiln_mul_overflow(nc, 2, &nc)) return 0;
    }
    if (kiln_mul_overflow(nc, elem, &bytes)) return 0;
    void *np = kiln_realloc(*p, bytes);
    if (!np) return 0;
    *p = np;
    *cap = nc;
    return 1;
}

static int append_bytes(choice *c, const char *s, size_t n) {
    if (!n) return 1;
    size_t need;
    if (kiln_add_overflow(c->len, n + 1, &need) || !grow((void **)&c->text, &c->cap, need, 1))
        return 0;
    memcpy(c->text + c->len, s, n);
    c->len += n;
    c->text[c->len] = '\0';
    return 1;
}

static void make_receipt(job *j, choice *c, const char *stop_reason);

/* The engine's callback (its worker thread): copy, signal, return. */
static void on_event(const kiln_request_event *ev, void *user) {
    choice *c = user;
    job *j = c->owner;
    pthread_mutex_lock(&j->mu);
    if (ev->kind == KILN_EVENT_TOKEN) {
        if (!append_bytes(c, ev->text, ev->len)) c->oom = 1;
        if (j->req.logprobs >= 0 && !c->oom) {
            if (grow((void **)&c->toks, &c->cap_toks, c->n_toks + 1, sizeof *c->toks)) {
                kiln_oai_token *t = &c->toks[c->n_toks++];
                memset(t, 0, sizeof *t);
                t->id = ev->id;
                t->logprob = ev->logprob;
                t->n_top = ev->n_top < 0                       ? 0
                           : ev->n_top > KILN_MAX_TOP_LOGPROBS ? KILN_MAX_TOP_LOGPROBS
                                                               : ev->n_top;
                memcpy(t->top_ids, ev->top_ids, (size_t)t->n_top * sizeof t->top_ids[0]);
                memcpy(t->top_logprobs, ev->top_logprobs,
                       (size_t)t->n_top * sizeof t->top_logprobs[0]);
            } else {
                c->oom = 1;
            }
        }
    } else {
        if (ev->tail && !append_bytes(c, ev->tail, ev->tail_len)) c->oom = 1;
        snprintf(c->finish, sizeof c->finish, "%s", ev->finish_reason ? ev->finish_reason : "stop");
        c->status = ev->status;
        snprintf(c->message, sizeof c->message, "%s", ev->message ? ev->message : "");
        if (c->oom) {
            snprintf(c->finish, sizeof c->finish, "error");
            c->status = KILN_ERR_NOMEM;
            snprintf(c->message, sizeof c->message, "out of memory while collecting the answer");
        }
        c->n_prompt = ev->n_prompt;
        c->n_cached = ev->n_prompt_cached;
        c->n_generated = ev->n_generated;
        if (c->chain && c->status == KILN_OK && strcmp(c->finish, "error") && strcmp(c->finish, "cancelled"))
            make_receipt(j, c, ev->stop_reason);
        c->done = 1;
        j->n_done++;
    }
    uint64_t one = 1;
    ssize_t w = write(j->efd, &one, sizeof one); /* under the lock: j is alive here */
    (void)w;
    int last = 0;
    if (ev->kind == KILN_EVENT_DONE) last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (last) job_free(j);
}

/* Wait up to ms for an event of j or a hang-up of its client. 1: the client is gone. */
static int job_wait(job *j, int ms) {
    struct pollfd p[2] = {{.fd = j->efd, .events = POLLIN}, {.fd = j->sock, .events = POLLRDHUP}};
    int np = j->sock >= 0 ? 2 : 1;
    int r = poll(p, (nfds_t)np, ms);
    if (r > 0 && (p[0].revents & POLLIN)) {
        uint64_t v;
        ssize_t rd = read(j->efd, &v, sizeof v);
        (void)rd;
    }
    if (r > 0 && np == 2 && (p[1].revents & (POLLRDHUP | POLLHUP | POLLERR))) return 1;
    return 0;
}

/* Choice c's receipt (its JSON in c->receipt; none when out of memory), at its end (j->mu
 * held): the server's part (cfg.receipt_base), the prompt ids, the request's settings with
 * the choice's seed, the output and the chain. */
static void make_receipt(job *j, choice *c, const char *stop_reason) {
    receipt r = *j->srv->cfg.receipt_base; /* shallow: nothing here is freed */
    memcpy(r.model_fp, j->srv->model_fp, 32); /* ready: the request's chain began with them */
    memcpy(r.tokenizer_fp, j->srv->tok_fp, 32);
    r.prompt_text = NULL; /* the ids are the prompt (a chat's messages went through the template) */
    r.system = NULL;
    r.chat = 0;
    r.prompt_ids = j->prompt;
    r.n_prompt = j->n_prompt;
    r.max_tokens = c->max_tokens;
    r.sampler = c->sampler;
    r.n_stops = j->req.n_stop < RECEIPT_MAX_STOPS ? j->req.n_stop : RECEIPT_MAX_STOPS;
    for (int i = 0; i <= RECEIPT_MAX_STOPS; i++) r.stops[i] = i < r.n_stops ? j->req.stop[i] : NULL;
    r.ignore_eos = j->req.ignore_eos;
    r.ids = c->rids;
    r.n_ids = (size_t)c->n_generated;
    r.text = c->text ? c->text : "";
    r.stop_reason = (char *)(stop_reason ? stop_reason : c->finish);
    r.chain = (uint8_t(*)[32])c->chain;
    c->receipt = receipt_json_text(&r);
}

static void usage_of(const job *j, kiln_oai_usage *u) {
    memset(u, 0, sizeof *u);
    u->prompt_tokens = j->ch[0].n_prompt; /* the same prompt for every choice */
    u->cached_tokens = j->ch[0].n_cached;
    for (int i = 0; i < j->n; i++) u->completion_tokens += j->ch[i].n_generated;
}

/* The first failed choice, or NULL. */
static const choice *failed_choice(const job *j) {
    for (int i = 0; i < j->n; i++)
        if (j->ch[i].done && !strcmp(j->ch[i].finish, "error")) return &j->ch[i];
    return NULL;
}

/* ---- streaming (SSE) ---------------------------------------------------------------------- */

static int out_add(job *j, const char *s, size_t n) {
    size_t need;
    if (kiln_add_overflow(j->out_len, n, &need) || !grow((void **)&j->out, &j->out_cap, need, 1))
        return 0;
    memcpy(j->out + j->out_len, s, n);
    j->out_len += n;
    return 1;
}

/* "data: <json>\n\n" (json taken). */
static int out_event(job *j, char *json) {
    if (!json) return 0;
    int ok = out_add(j, "data: ", 6) && out_add(j, json, strlen(json)) && out_add(j, "\n\n", 2);
    kiln_oai_free(json);
    return ok;
}

/* Turn what the engine produced since the last call into SSE events (j->mu held). */
static int stream_collect(job *j) {
    const kiln_oai_meta *m = &j->meta;
    int usage_null = j->req.include_usage;
    for (int i = 0; i < j->n; i++) {
        choice *c = &j->ch[i];
        if (c->sent_finish) continue;
        size_t nt = c->len - c->sent_text, nk = c->n_toks - c->sent_toks;
        int first = !c->sent_first && m->kind == KILN_OAI_CHAT;
        if (nt || nk || first) {
            kiln_oai_choice oc = {.index = i,
                                  .text = c->text ? c->text + c->sent_text : "",
                                  .len = nt,
                                  .tokens = m->logprobs >= 0 ? c->toks + c->sent_toks : NULL,
                                  .n_tokens = nk,
                                  .text_offset = c->sent_text,
                                  .first = first};
            if (!out_event(j, kiln_oai_chunk_json(m, &oc, 1, NULL, usage_null))) return 0;
            c->sent_text = c->len;
            c->sent_toks = c->n_toks;
            c->sent_first = 1;
        }
        if (c->done) {
            c->sent_finish = 1;
            if (!strcmp(c->finish, "error")) {
                const char *type;
                status_http(c->status, &type);
                if (!out_event(j,
                               kiln_oai_error_json(c->message[0] ? c->message : "generation failed",
                                                   type, NULL, NULL)))
                    return 0;
                continue;
            }
            kiln_oai_choice oc = {.index = i, .text = "", .len = 0, .finish_reason = c->finish,
                                  .receipt_json = c->receipt};
            if (!out_event(j, kiln_oai_chunk_json(m, &oc, 1, NULL, usage_null))) return 0;
        }
    }
    if (j->n_done == j->n && !j->stream_over) {
        if (j->req.include_usage) {
            kiln_oai_usage u;
            usage_of(j, &u);
            if (!out_event(j, kiln_oai_chunk_json(m, NULL, 0, &u, 1))) return 0;
        }
        if (!out_add(j, "data: [DONE]\n\n", 14)) return 0;
        j->stream_over = 1;
    }
    return 1;
}

/* MHD's content reader for a streaming answer: blocks (this connection's own thread) until
 * there is something to send, the stream is over, or the client has gone. */
static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    job *j = cls;
    for (;;) {
        if (j->out_off < j->out_len) {
            size_t n = j->out_len - j->out_off;
            if (n > max) n = max;
            memcpy(buf, j->out + j->out_off, n);
            j->out_off += n;
            if (j->out_off == j->out_len) j->out_off = j->out_len = 0;
            return (ssize_t)n;
        }
        pthread_mutex_lock(&j->mu);
        int over = j->stream_over;
        int ok = over ? 1 : stream_collect(j);
        pthread_mutex_unlock(&j->mu);
        if (!ok) {
            job_cancel(j, 0);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (over) return MHD_CONTENT_READER_END_OF_STREAM;
        if (j->out_len) continue;
        if (job_wait(j, 1000)) { /* the client hung up */
            job_cancel(j, 1);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
    }
}

/* MHD frees the streaming response: its reference goes. */
static void stream_free(void *cls) {
    job *j = cls;
    job_cancel(j, 1); /* a no-op when every choice finished */
    job_release(j);
}

/* ---- per-request state -------------------------------------------------------------------- */

typedef struct conn_req {
    char *body;
    size_t len, cap;
    size_t seen;     /* body bytes received (all of them, kept or not) */
    int too_large;
    int counted;     /* in srv->active */
    job *job;        /* a generation this request started (one reference) */
} conn_req;

/* MHD says a request is over (answered, failed, timed out or the client left). */
static void request_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                              enum MHD_RequestTerminationCode toe) {
    (void)c;
    (void)toe;
    serve_server *s = cls;
    conn_req *r = *con_cls;
    if (!r) return;
    if (r->job) {
        job_cancel(r->job, 1);
        job_release(r->job);
    }
    if (r->counted) atomic_fetch_sub(&s->active, 1);
    kiln_free(r->body);
    kiln_free(r);
    *con_cls = NULL;
}

/* ---- prompts ------------------------------------------------------------------------------ */

/* Token ids of the request's prompt into *ids (kiln_malloc'd). KILN_OK, or a status with
 * kiln_last_error() saying why. */
static kiln_status encode_request(const serve_server *s, const kiln_oai_request *q, int32_t **ids,
                                  size_t *n) {
    *ids = NULL;
    *n = 0;
    if (q->prompt_ids) {
        *ids = kiln_malloc(q->n_prompt_ids * sizeof(int32_t));
        if (!*ids) return kiln_error(KILN_ERR_NOMEM, "out of memory for the prompt");
        memcpy(*ids, q->prompt_ids, q->n_prompt_ids * sizeof(int32_t));
        *n = q->n_prompt_ids;
        return KILN_OK;
    }
    const char *text = q->prompt;
    size_t len = q->prompt_len;
    char *rendered = NULL;
    if (q->kind == KILN_OAI_CHAT) {
        kiln_chat_message *msgs = kiln_calloc(q->n_messages, sizeof *msgs);
        if (!msgs) return kiln_error(KILN_ERR_NOMEM, "out of memory for the messages");
        for (size_t i = 0; i < q->n_messages; i++)
            msgs[i] = (kiln_chat_message){q->messages[i].role, q->messages[i].content};
        size_t need = 0;
        kiln_status st = kiln_chat_apply(s->cfg.tok, msgs, q->n_messages, 1, NULL, 0, &need);
        if (st == KILN_OK || st == KILN_ERR_BUFFER_TOO_SMALL) {
            rendered = kiln_malloc(need + 1);
            st = rendered
                     ? kiln_chat_apply(s->cfg.tok, msgs, q->n_messages, 1, rendered, need + 1, &len)
                     : kiln_error(KILN_ERR_NOMEM, "out of memory for the chat template");
        }
        kiln_free(msgs);
        if (st != KILN_OK) {
            kiln_free(rendered);
            return kiln_error_prefix(st, "messages: the model's chat template");
        }
        text = rendered;
    }
    /* as `kiln generate`: a chat template holds its own special tokens (BOS included), plain
     * text gets the tokenizer's; special-token text becomes those tokens in both */
    int add_special = q->kind != KILN_OAI_CHAT;
    size_t need = 0;
    kiln_status st = kiln_tokenize(s->cfg.tok, text, len, add_special, 1, NULL, 0, &need);
    if (st == KILN_OK || st == KILN_ERR_BUFFER_TOO_SMALL) {
        *ids = kiln_malloc((need ? need : 1) * sizeof(int32_t));
        st = *ids ? kiln_tokenize(s->cfg.tok, text, len, add_special, 1, *ids, need, n)
                  : kiln_error(KILN_ERR_NOMEM, "out of memory for the prompt's tokens");
        if (st != KILN_OK) {
            kiln_free(*ids);
            *ids = NULL;
        }
    }
    kiln_free(rendered);
    if (st == KILN_OK && *n == 0) {
        kiln_free(*ids);
        *ids = NULL;
        return kiln_error(KILN_ERR_INVALID_ARG, "the prompt is empty (no tokens)");
    }
    return st;
}

/* ---- /v1/chat/completions and /v1/completions --------------------------------------------- */

static job *job_new(serve_server *s, kiln_oai_request *q, struct MHD_Connection *c) {
    job *j = kiln_calloc(1, sizeof *j);
    if (!j) return NULL;
    j->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (j->efd < 0 || pthread_mutex_init(&j->mu, NULL) != 0) {
        if (j->efd >= 0) close(j->efd);
        kiln_free(j);
        return NULL;
    }
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    j->sock = ci ? ci->connect_fd : -1;
    j->srv = s;
    j->req = *q; /* taken */
    memset(q, 0, sizeof *q);
    j->n = j->req.n;
    j->refs = 1; /* the request's */
    uint64_t k = atomic_fetch_add(&s->next_id, 1);
    snprintf(j->id, sizeof j->id, "%s-%016llx%08llx",
             j->req.kind == KILN_OAI_CHAT ? "chatcmpl" : "cmpl", (unsigned long long)s->id_salt,
             (unsigned long long)(k & 0xffffffffu));
    j->meta = (kiln_oai_meta){j->req.kind,         j->id,           s->cfg.model_name,
                              (int64_t)time(NULL), j->req.logprobs, s->cfg.tok};
    for (int i = 0; i < KILN_OAI_MAX_N; i++) {
        j->ch[i].owner = j;
        j->ch[i].index = i;
    }
    return j;
}

/* Submit the job's n requests. KILN_OK, or the first failure's status (the ones submitted
 * before it are cancelled; their DONE events release their references). */
static kiln_status job_submit(job *j, const int32_t *ids, size_t n_ids) {
    const kiln_oai_request *q = &j->req;
    uint64_t seed = q->has_seed ? (uint64_t)q->seed : cli_random_seed();
    kiln_request_params rp = kiln_request_default_params();
    rp.prompt = ids;
    rp.n_prompt = n_ids;
    rp.max_tokens =
        q->max_tokens >= 0 ? q->max_tokens : (1 << 30); /* the engine stops at the context */
    rp.sampler = kiln_sampler_default_params();
    rp.sampler.temperature = q->temperature;
    rp.sampler.top_k = q->top_k > 0 ? q->top_k : 0;
    rp.sampler.top_p = q->top_p;
    rp.sampler.min_p = q->min_p;
    rp.sampler.repeat_penalty = q->repetition_penalty;
    rp.sampler.repeat_last_n = -1;
    rp.stop_strings = q->n_stop ? (const char *const *)q->stop : NULL;
    rp.ignore_eos = q->ignore_eos;
    rp.presence_penalty = q->presence_penalty;
    rp.frequency_penalty = q->frequency_penalty;
    rp.logprobs = q->logprobs;
    rp.on_event = on_event;
    /* a receipt: room for the most tokens the request can produce, and c_0 */
    const receipt *base = j->srv->cfg.receipt_base;
    long room = (long)j->srv->cfg.n_ctx - (long)n_ids + 1;
    size_t G = room < 1 ? 1 : (size_t)room;
    if (q->max_tokens >= 0 && (size_t)q->max_tokens < G) G = (size_t)q->max_tokens;
    if (q->receipt) { /* everything made before the first request goes in */
        if (!base) return kiln_error(KILN_ERR_UNSUPPORTED, "this server makes no receipts");
        KILN_TRY(server_fingerprints(j->srv));
        j->prompt = kiln_malloc(n_ids * sizeof *ids);
        if (!j->prompt) return kiln_error(KILN_ERR_NOMEM, "out of memory");
        memcpy(j->prompt, ids, n_ids * sizeof *ids);
        j->n_prompt = n_ids;
        for (int i = 0; i < j->n; i++) {
            choice *c = &j->ch[i];
            c->chain = kiln_malloc(32 * (G + 1));
            c->rids = kiln_malloc((G ? G : 1) * sizeof *c->rids);
            if (!c->chain || !c->rids) return kiln_error(KILN_ERR_NOMEM, "out of memory");
            KILN_TRY(kiln_receipt_chain_start(j->srv->model_fp, j->srv->tok_fp, ids, n_ids, c->chain));
            c->max_tokens = (int)G;
            c->sampler = rp.sampler;
            c->sampler.seed = seed + (uint64_t)i;
        }
    }
    for (int i = 0; i < j->n; i++) {
        rp.sampler.seed = seed + (uint64_t)i;
        rp.user = &j->ch[i];
        rp.logits_chain = j->ch[i].chain;
        rp.receipt_ids = j->ch[i].rids;
        pthread_mutex_lock(&j->mu);
        j->refs++; /* the engine request's, taken before it can call back */
        pthread_mutex_unlock(&j->mu);
        uint64_t id = 0;
        kiln_status st = kiln_engine_submit(j->srv->cfg.engine, &rp, &id);
        pthread_mutex_lock(&j->mu);
        if (st == KILN_OK) {
            j->ch[i].req_id = id;
            j->ch[i].submitted = 1;
        } else {
            j->refs--; /* no callback will come */
            j->n = i;  /* the choices that exist */
        }
        pthread_mutex_unlock(&j->mu);
        if (st != KILN_OK) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", kiln_last_error());
            job_cancel(j, 0);
            kiln_error(st, "%s", msg);
            return st;
        }
    }
    return KILN_OK;
}

static enum MHD_Result answer_whole(serve_server *s, struct MHD_Connection *c, job *j) {
    for (;;) {
        pthread_mutex_lock(&j->mu);
        int all = j->n_done == j->n;
        pthread_mutex_unlock(&j->mu);
        if (all) break;
        if (job_wait(j, 1000)) {
            job_cancel(j, 1);
            return MHD_NO; /* the client is gone: close */
        }
    }
    /* every choice is done: the callback writes nothing more */
    const choice *bad = failed_choice(j);
    if (bad) {
        const char *type;
        int code = status_http(bad->status, &type);
        if (code < 500) code = 500;
        return reply_error(s, c, code, "server_error", NULL, NULL, "generation failed: %s",
                           bad->message[0] ? bad->message : "unknown error");
    }
    kiln_oai_choice oc[KILN_OAI_MAX_N];
    for (int i = 0; i < j->n; i++) {
        const choice *ch = &j->ch[i];
        oc[i] = (kiln_oai_choice){.index = i,
                                  .text = ch->text ? ch->text : "",
                                  .len = ch->len,
                                  .finish_reason = ch->finish,
                                  .tokens = j->req.logprobs >= 0 ? ch->toks : NULL,
                                  .n_tokens = ch->n_toks,
                                  .receipt_json = ch->receipt};
    }
    kiln_oai_usage u;
    usage_of(j, &u);
    /* the wait may have outlasted the idle timeout: the answer is activity */
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, (unsigned)s->cfg.timeout_s);
    return reply_json(s, c, 200, kiln_oai_response_json(&j->meta, oc, (size_t)j->n, &u));
}

static enum MHD_Result route_generate(serve_server *s, struct MHD_Connection *c, conn_req *r,
                                      kiln_oai_kind kind) {
    kiln_oai_request q;
    kiln_oai_error e;
    kiln_status st = kiln_oai_parse_request(r->body, r->len, kind, &q, &e);
    if (st != KILN_OK)
        return reply_error(s, c, e.http_status ? e.http_status : 500,
                           e.type ? e.type : "server_error", e.param, NULL, "%s", e.message);
    if (q.model && strcmp(q.model, s->cfg.model_name)) {
        enum MHD_Result ret =
            reply_error(s, c, 404, "invalid_request_error", "model", "model_not_found",
                        "The model '%.200s' does not exist: this server serves '%s'", q.model,
                        s->cfg.model_name);
        kiln_oai_request_free(&q);
        return ret;
    }
    int32_t *ids = NULL;
    size_t n_ids = 0;
    st = encode_request(s, &q, &ids, &n_ids);
    if (st != KILN_OK) {
        const char *type;
        int code = status_http(st, &type);
        kiln_oai_request_free(&q);
        return reply_error(s, c, code, type, kind == KILN_OAI_CHAT ? "messages" : "prompt", NULL,
                           "%s", kiln_last_error());
    }
    job *j = job_new(s, &q, c);
    if (!j) {
        kiln_free(ids);
        kiln_oai_request_free(&q);
        return reply_error(s, c, 500, "server_error", NULL, NULL, "out of memory");
    }
    r->job = j;
    st = job_submit(j, ids, n_ids);
    kiln_free(ids);
    if (st != KILN_OK) {
        const char *type;
        int code = status_http(st, &type);
        const char *param =
            st == KILN_ERR_RANGE ? (kind == KILN_OAI_CHAT ? "messages" : "prompt") : NULL;
        if (st == KILN_ERR_BUSY)
            return reply_error(s, c, 429, type, NULL, "rate_limit_exceeded",
                               "the server's queue is full; retry shortly (%s)", kiln_last_error());
        if (st == KILN_ERR_STATE)
            return reply_error(s, c, 503, type, NULL, NULL, "the server is shutting down (%s)",
                               kiln_last_error());
        return reply_error(s, c, code, type, param, NULL, "%s", kiln_last_error());
    }
    if (!j->req.stream) return answer_whole(s, c, j);
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_read, j, stream_free);
    if (!resp) {
        job_cancel(j, 0);
        return MHD_NO;
    }
    pthread_mutex_lock(&j->mu);
    j->refs++; /* the response's */
    pthread_mutex_unlock(&j->mu);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp); /* MHD keeps it while it streams; stream_free releases j */
    count_response(s, 200);
    return ret;
}

/* ---- /tokenize and /detokenize ------------------------------------------------------------ */

static cJSON *parse_object(const conn_req *r) {
    if (!r->len || kiln_json_check_no_nul(r->body, r->len, "request body") != KILN_OK) return NULL;
    cJSON *root = cJSON_ParseWithLength(r->body, r->len);
    if (root && !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return NULL;
    }
    return root;
}

static enum MHD_Result route_tokenize(serve_server *s, struct MHD_Connection *c,
                                      const conn_req *r) {
    cJSON *root = parse_object(r);
    if (!root)
        return reply_error(s, c, 400, "invalid_request_error", NULL, NULL,
                           "the body must be a JSON object");
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    const char *param = "prompt";
    if (!text) text = cJSON_GetObjectItemCaseSensitive(root, "text"), param = "text";
    const cJSON *add = cJSON_GetObjectItemCaseSensitive(root, "add_special");
    enum MHD_Result ret;
    if (!cJSON_IsString(text)) {
        ret = reply_error(s, c, 400, "invalid_request_error", "prompt", NULL,
                          "'prompt' (or 'text') must be a string");
    } else if (add && !cJSON_IsBool(add) && !cJSON_IsNull(add)) {
        ret = reply_error(s, c, 400, "invalid_request_error", "add_special", NULL,
                          "'add_special' must be a boolean");
    } else {
        int add_special = add && cJSON_IsFalse(add) ? 0 : 1;
        size_t len = strlen(text->valuestring), need = 0, n = 0;
        kiln_status st =
            kiln_tokenize(s->cfg.tok, text->valuestring, len, add_special, 1, NULL, 0, &need);
        int32_t *ids = NULL;
        if (st == KILN_OK || st == KILN_ERR_BUFFER_TOO_SMALL) {
            ids = kiln_malloc((need ? need : 1) * sizeof(int32_t));
            st = ids ? kiln_tokenize(s->cfg.tok, text->valuestring, len, add_special, 1, ids, need,
                                     &n)
                     : KILN_ERR_NOMEM;
        }
        if (st != KILN_OK) {
            const char *type;
            int code = status_http(st, &type);
            ret = reply_error(s, c, code, type, param, NULL, "%s", kiln_last_error());
        } else {
            cJSON *o = cJSON_CreateObject();
            cJSON *arr = cJSON_AddArrayToObject(o, "tokens");
            for (size_t i = 0; arr && i < n; i++)
                cJSON_AddItemToArray(arr, cJSON_CreateNumber(ids[i]));
            cJSON_AddNumberToObject(o, "count", (double)n);
            cJSON_AddNumberToObject(o, "max_model_len", s->cfg.n_ctx);
            char *json = cJSON_PrintUnformatted(o);
            cJSON_Delete(o);
            ret = reply_json(s, c, 200, json);
        }
        kiln_free(ids);
    }
    cJSON_Delete(root);
    return ret;
}

static enum MHD_Result route_detokenize(serve_server *s, struct MHD_Connection *c,
                                        const conn_req *r) {
    cJSON *root = parse_object(r);
    if (!root)
        return reply_error(s, c, 400, "invalid_request_error", NULL, NULL,
                           "the body must be a JSON object");
    const cJSON *toks = cJSON_GetObjectItemCaseSensitive(root, "tokens");
    enum MHD_Result ret;
    int n = cJSON_IsArray(toks) ? cJSON_GetArraySize(toks) : -1;
    int32_t *ids = n >= 0 ? kiln_malloc((size_t)(n ? n : 1) * sizeof(int32_t)) : NULL;
    int bad = -1;
    if (ids) {
        int i = 0;
        const cJSON *it;
        cJSON_ArrayForEach(it, toks) {
            double d = cJSON_IsNumber(it) ? it->valuedouble : -1;
            if (!cJSON_IsNumber(it) || d != floor(d) || d < 0 || d > INT32_MAX) {
                bad = i;
                break;
            }
            ids[i++] = (int32_t)d;
        }
    }
    if (n < 0) {
        ret = reply_error(s, c, 400, "invalid_request_error", "tokens", NULL,
                          "'tokens' must be an array of token ids");
    } else if (!ids) {
        ret = reply_error(s, c, 500, "server_error", NULL, NULL, "out of memory");
    } else if (bad >= 0) {
        ret = reply_error(s, c, 400, "invalid_request_error", "tokens", NULL,
                          "'tokens[%d]' must be a token id", bad);
    } else {
        size_t need = 0, len = 0;
        kiln_status st = kiln_detokenize(s->cfg.tok, ids, (size_t)n, 0, NULL, 0, &need);
        char *text = NULL;
        if (st == KILN_OK || st == KILN_ERR_BUFFER_TOO_SMALL) {
            text = kiln_malloc(need + 1);
            st = text ? kiln_detokenize(s->cfg.tok, ids, (size_t)n, 0, text, need + 1, &len)
                      : KILN_ERR_NOMEM;
        }
        if (st != KILN_OK) {
            const char *type;
            int code = status_http(st, &type);
            ret = reply_error(s, c, code, type, "tokens", NULL, "%s", kiln_last_error());
        } else {
            size_t cl;
            char *clean = kiln_oai_utf8_clean(text, len, &cl);
            cJSON *o = cJSON_CreateObject();
            if (clean) cJSON_AddStringToObject(o, "prompt", clean);
            char *json = clean ? cJSON_PrintUnformatted(o) : NULL;
            cJSON_Delete(o);
            kiln_free(clean);
            ret = reply_json(s, c, 200, json);
        }
        kiln_free(text);
    }
    kiln_free(ids);
    cJSON_Delete(root);
    return ret;
}

/* ---- /metrics ----------------------------------------------------------------------------- */

typedef struct textbuf {
    char *p;
    size_t len, cap;
    int failed;
} textbuf;

static void tb_printf(textbuf *b, const char *fmt, ...) KILN_PRINTF(2, 3);
static void tb_printf(textbuf *b, const char *fmt, ...) {
    if (b->failed) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->failed = 1;
            return;
        }
        if (b->p && b->len + (size_t)n < b->cap) {
            b->len += (size_t)n;
            return;
        }
        if (!grow((void **)&b->p, &b->cap, b->len + (size_t)n + 1, 1)) {
            b->failed = 1;
            return;
        }
    }
}

static void metric(textbuf *b, const char *name, const char *type, const char *help, double v) {
    tb_printf(b, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
}

/* A Prometheus histogram from the engine's cumulative bucket counts (bounds in seconds, the
 * last +inf). */
static void histogram(textbuf *b, const char *name, const char *help, const kiln_engine_stats *st,
                      const uint64_t *counts, double sum, uint64_t count) {
    tb_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    for (int i = 0; i < KILN_ENGINE_HIST_BUCKETS; i++) {
        double le = st->hist_bounds[i];
        if (i == KILN_ENGINE_HIST_BUCKETS - 1 || isinf(le)) {
            tb_printf(b, "%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)count);
            break;
        }
        tb_printf(b, "%s_bucket{le=\"%g\"} %llu\n", name, le, (unsigned long long)counts[i]);
    }
    tb_printf(b, "%s_sum %.17g\n%s_count %llu\n", name, sum, name, (unsigned long long)count);
}

static enum MHD_Result route_metrics(serve_server *s, struct MHD_Connection *c) {
    kiln_engine_stats st;
    memset(&st, 0, sizeof st);
    kiln_engine_get_stats(s->cfg.engine, &st);
    textbuf b = {0};
    metric(&b, "kiln_requests_submitted_total", "counter", "Engine requests submitted.",
           (double)st.requests_submitted);
    metric(&b, "kiln_requests_finished_total", "counter", "Engine requests finished.",
           (double)st.requests_finished);
    metric(&b, "kiln_requests_cancelled_total", "counter", "Engine requests cancelled.",
           (double)st.requests_cancelled);
    metric(&b, "kiln_requests_rejected_total", "counter", "Submits refused (queue full).",
           (double)st.requests_rejected);
    metric(&b, "kiln_requests_failed_total", "counter", "Engine requests that ended in an error.",
           (double)st.requests_failed);
    metric(&b, "kiln_preemptions_total", "counter", "Requests preempted for KV blocks.",
           (double)st.preemptions);
    metric(&b, "kiln_prompt_tokens_total", "counter", "Prompt tokens submitted.",
           (double)st.prompt_tokens);
    metric(&b, "kiln_prompt_tokens_cached_total", "counter",
           "Prompt tokens found in the prefix cache.", (double)st.prompt_tokens_cached);
    metric(&b, "kiln_generated_tokens_total", "counter", "Tokens generated.",
           (double)st.generated_tokens);
    metric(&b, "kiln_engine_steps_total", "counter", "Forward steps the engine ran.",
           (double)st.steps);
    metric(&b, "kiln_queue_depth", "gauge", "Requests waiting to run.", st.queued);
    metric(&b, "kiln_running_requests", "gauge", "Requests running.", st.running);
    metric(&b, "kiln_kv_blocks_total", "gauge", "KV cache blocks in the pool.", st.kv_blocks_total);
    metric(&b, "kiln_kv_blocks_used", "gauge", "KV cache blocks in use.", st.kv_blocks_used);
    metric(&b, "kiln_kv_blocks_free", "gauge", "KV cache blocks free (cached ones included).",
           (double)st.kv_blocks_total - st.kv_blocks_used);
    metric(&b, "kiln_kv_blocks_cached", "gauge", "Free KV blocks still findable by prefix.",
           st.kv_blocks_cached);
    metric(&b, "kiln_prefix_cache_hit_rate", "gauge",
           "Prompt tokens found in the prefix cache / prompt tokens.",
           st.prompt_tokens ? (double)st.prompt_tokens_cached / (double)st.prompt_tokens : 0.0);
    histogram(&b, "kiln_time_to_first_token_seconds", "Submit to first token.", &st, st.ttft_hist,
              st.ttft_sum, st.ttft_count);
    histogram(&b, "kiln_inter_token_latency_seconds", "Time between a request's tokens.", &st,
              st.itl_hist, st.itl_sum, st.itl_count);
    tb_printf(&b, "# HELP kiln_http_responses_total HTTP responses by status code.\n"
                  "# TYPE kiln_http_responses_total counter\n");
    for (size_t i = 0; i <= N_COUNTED; i++) {
        char code[16];
        if (i < N_COUNTED) snprintf(code, sizeof code, "%d", COUNTED_CODES[i]);
        else snprintf(code, sizeof code, "other");
        tb_printf(&b, "kiln_http_responses_total{code=\"%s\"} %llu\n", code,
                  (unsigned long long)atomic_load(&s->responses[i]));
    }
    metric(&b, "kiln_http_client_disconnects_total", "counter",
           "Generations cancelled because the client left.",
           (double)atomic_load(&s->client_disconnects));
    metric(&b, "kiln_http_active_requests", "gauge", "HTTP requests being answered.",
           atomic_load(&s->active));
    enum MHD_Result ret;
    if (b.failed) ret = reply_error(s, c, 500, "server_error", NULL, NULL, "out of memory");
    else
        ret = reply(s, c, 200, "text/plain; version=0.0.4; charset=utf-8", b.p ? b.p : "", b.len,
                    NULL);
    kiln_free(b.p);
    return ret;
}

/* ---- routing ------------------------------------------------------------------------------ */

/* Constant-time comparison of the Authorization header with "Bearer <key>". */
static int authorized(const serve_server *s, struct MHD_Connection *c) {
    if (!s->cfg.api_key) return 1;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!h || strncmp(h, "Bearer ", 7)) return 0;
    h += 7;
    size_t a = strlen(h), b = strlen(s->cfg.api_key);
    unsigned diff = (unsigned)(a ^ b);
    for (size_t i = 0; i < a; i++)
        diff |= (unsigned char)h[i] ^ (unsigned char)s->cfg.api_key[i % (b ? b : 1)];
    return diff == 0;
}

enum {
    ROUTE_NONE,
    ROUTE_PAGE,
    ROUTE_HEALTH,
    ROUTE_MODELS,
    ROUTE_METRICS,
    ROUTE_CHAT,
    ROUTE_COMPLETIONS,
    ROUTE_TOKENIZE,
    ROUTE_DETOKENIZE
};

static int route_of(const char *url, const char **method_wanted) {
    static const struct {
        const char *url, *method;
        int route;
    } routes[] = {
        {"/", "GET", ROUTE_PAGE},
        {"/health", "GET", ROUTE_HEALTH},
        {"/v1/models", "GET", ROUTE_MODELS},
        {"/metrics", "GET", ROUTE_METRICS},
        {"/v1/chat/completions", "POST", ROUTE_CHAT},
        {"/v1/completions", "POST", ROUTE_COMPLETIONS},
        {"/tokenize", "POST", ROUTE_TOKENIZE},
        {"/detokenize", "POST", ROUTE_DETOKENIZE},
    };
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (!strcmp(url, routes[i].url)) {
            *method_wanted = routes[i].method;
            return routes[i].route;
        }
    return ROUTE_NONE;
}

static enum MHD_Result dispatch(serve_server *s, struct MHD_Connection *c, const char *url,
                                const char *method, conn_req *r) {
    const char *want = NULL;
    int route = route_of(url, &want);
    if (route == ROUTE_NONE)
        return reply_error(s, c, 404, "invalid_request_error", NULL, "not_found",
                           "Invalid URL (%s %.200s)", method, url);
    if (strcmp(method, want) &&
        !(route != ROUTE_CHAT && !strcmp(want, "GET") && !strcmp(method, "HEAD")))
        return reply_error(s, c, 405, "invalid_request_error", NULL, "method_not_allowed",
                           "%s %s: use %s", method, url, want);
    if (route == ROUTE_PAGE)
        return reply(s, c, 200, "text/html; charset=utf-8", serve_page_html,
                     strlen(serve_page_html), NULL);
    if (route == ROUTE_HEALTH) {
        int draining = atomic_load(&s->draining);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "status", draining ? "draining" : "ok");
        cJSON_AddStringToObject(o, "model", s->cfg.model_name);
        cJSON_AddStringToObject(o, "device", s->cfg.device_name);
        char *json = cJSON_PrintUnformatted(o);
        cJSON_Delete(o);
        return reply_json(s, c, draining ? 503 : 200, json);
    }
    if (!authorized(s, c))
        return reply_error(s, c, 401, "invalid_request_error", NULL, "invalid_api_key",
                           "Incorrect or missing API key: send 'Authorization: Bearer <key>'");
    if (r->too_large)
        return reply_error(s, c, 413, "invalid_request_error", NULL, "request_too_large",
                           "the request body is %zu bytes; the limit is %zu", r->seen,
                           s->cfg.max_body);
    switch (route) {
    case ROUTE_MODELS:
        return reply_json(
            s, c, 200, kiln_oai_models_json(s->cfg.model_name, (int64_t)time(NULL), s->cfg.n_ctx));
    case ROUTE_METRICS: return route_metrics(s, c);
    case ROUTE_CHAT: return route_generate(s, c, r, KILN_OAI_CHAT);
    case ROUTE_COMPLETIONS: return route_generate(s, c, r, KILN_OAI_COMPLETION);
    case ROUTE_TOKENIZE: return route_tokenize(s, c, r);
    case ROUTE_DETOKENIZE: return route_detokenize(s, c, r);
    default: return MHD_NO;
    }
}

/* Past this many bytes of an over-long body, stop reading it and answer 413 at once (the
 * connection is closed then). Up to it, the body is read and dropped, so that a client that
 * sends everything before it reads gets the 413 and not a reset. */
#define DISCARD_MAX ((size_t)64 << 20)

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **con_cls) {
    (void)version;
    serve_server *s = cls;
    conn_req *r = *con_cls;
    if (!r) { /* the headers are in; the body (if any) follows in later calls */
        r = kiln_calloc(1, sizeof *r);
        if (!r) return MHD_NO;
        *con_cls = r;
        atomic_fetch_add(&s->active, 1);
        r->counted = 1;
        const char *cl =
            MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl) {
            char *end;
            unsigned long long v = strtoull(cl, &end, 10);
            if (*end == '\0' && v > s->cfg.max_body) r->too_large = 1;
            if (*end == '\0' && v > DISCARD_MAX) {
                r->seen = (size_t)(v > SIZE_MAX ? SIZE_MAX : v);
                return reply_error(s, c, 413, "invalid_request_error", NULL, "request_too_large",
                                   "the request body is %llu bytes; the limit is %zu", v,
                                   s->cfg.max_body);
            }
        }
        return MHD_YES;
    }
    if (*upload_data_size) {
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        if (kiln_add_overflow(r->seen, n, &r->seen)) r->seen = SIZE_MAX;
        if (r->seen > s->cfg.max_body) {
            r->too_large = 1;
            kiln_free(r->body);
            r->body = NULL;
            r->len = r->cap = 0;
            if (r->seen > DISCARD_MAX)
                return reply_error(s, c, 413, "invalid_request_error", NULL, "request_too_large",
                                   "the request body is over %zu bytes; the limit is %zu",
                                   DISCARD_MAX, s->cfg.max_body);
            return MHD_YES;
        }
        if (!grow((void **)&r->body, &r->cap, r->len + n + 1, 1)) return MHD_NO;
        memcpy(r->body + r->len, upload_data, n);
        r->len += n;
        r->body[r->len] = '\0';
        return MHD_YES;
    }
    return dispatch(s, c, url, method, r);
}

/* ---- the daemon --------------------------------------------------------------------------- */

int serve_start(const serve_config *cfg, serve_server **out, char *err, size_t errcap) {
    serve_server *s = kiln_calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, errcap, "out of memory");
        return -1;
    }
    s->cfg = *cfg;
    s->id_salt = cli_random_seed();
    if (pthread_mutex_init(&s->fp_mu, NULL) != 0) {
        snprintf(err, errcap, "cannot make a mutex");
        kiln_free(s);
        return -1;
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE},
                    *ai = NULL;
    char port[16];
    snprintf(port, sizeof port, "%d", cfg->port);
    int gai = getaddrinfo(cfg->host, port, &hints, &ai);
    if (gai != 0 || !ai) {
        snprintf(err, errcap, "--host %s: %s", cfg->host, gai ? gai_strerror(gai) : "no address");
        pthread_mutex_destroy(&s->fp_mu);
        kiln_free(s);
        return -1;
    }
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ITC |
                     MHD_USE_ERROR_LOG | (ai->ai_family == AF_INET6 ? MHD_USE_IPv6 : 0);
    s->daemon = MHD_start_daemon(flags, 0, NULL, NULL, on_request, s,
                                 MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                                 MHD_OPTION_CONNECTION_LIMIT, (unsigned)cfg->max_connections,
                                 MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)cfg->timeout_s,
                                 MHD_OPTION_NOTIFY_COMPLETED, request_completed, s,
                                 MHD_OPTION_THREAD_STACK_SIZE, (size_t)(1 << 20),
                                 MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!s->daemon) {
        snprintf(err, errcap, "cannot listen on %s:%d (%s)", cfg->host, cfg->port,
                 errno ? strerror(errno) : "libmicrohttpd refused the options");
        pthread_mutex_destroy(&s->fp_mu);
        kiln_free(s);
        return -1;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->daemon, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : cfg->port;
    *out = s;
    return 0;
}

int serve_port(const serve_server *s) { return s->port; }

void serve_quiesce(serve_server *s) {
    atomic_store(&s->draining, 1);
    MHD_socket fd = MHD_quiesce_daemon(s->daemon);
    if (fd != MHD_INVALID_SOCKET) close(fd);
}

int serve_active(serve_server *s) { return atomic_load(&s->active); }

void serve_stop(serve_server *s) {
    if (!s) return;
    MHD_stop_daemon(s->daemon);
    pthread_mutex_destroy(&s->fp_mu);
    kiln_free(s);
}

#endif /* KILN_HAVE_MHD */
