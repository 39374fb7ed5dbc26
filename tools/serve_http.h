/* serve_http.h -- the HTTP front of `kiln serve`: libmicrohttpd in front of a kiln_engine,
 * speaking OpenAI's API (docs/SERVING.md, "HTTP front"). cmd_serve.c parses the command line,
 * loads the model and starts the engine; this file owns the daemon and every route. */
#ifndef KILN_SERVE_HTTP_H
#define KILN_SERVE_HTTP_H

#include "kiln.h"

#include <stddef.h>
#include <stdint.h>

typedef struct serve_config {
    kiln_engine *engine;        /* borrowed; outlives the server */
    const kiln_tokenizer *tok;  /* the model's */
    const char *model_name;     /* what /v1/models lists and requests may name */
    const char *api_key;        /* NULL: no key needed */
    const char *device_name;    /* "cpu", "cuda:0" (for /health) */
    int n_ctx;                  /* positions per request, for /v1/models' max_model_len */
    const char *host;           /* numeric address or a name to resolve */
    int port;                   /* 0: any free port (serve_port says which) */
    int max_connections;        /* open connections at once (each holds a thread) */
    int timeout_s;              /* idle / slow-client timeout of a connection */
    size_t max_body;            /* request bodies past this are refused with 413 */
    /* what every receipt of this server says of the model and the arithmetic (n_vocab, n_ctx,
     * n_batch, mode, device, threads; the fingerprints are the server's, made at the first
     * receipt); the rest is each choice's */
    const struct receipt *receipt_base;
} serve_config;

typedef struct serve_server serve_server;

/* Bind and start answering. 0, or -1 with a message in err. cfg's strings must outlive the
 * server. */
int serve_start(const serve_config *cfg, serve_server **out, char *err, size_t errcap);
/* The port it listens on. */
int serve_port(const serve_server *s);
/* Stop accepting connections (already open ones are still answered) and make /health say
 * "draining". */
void serve_quiesce(serve_server *s);
/* Requests being answered now (a generation still streaming counts until its last byte). */
int serve_active(serve_server *s);
/* Close every connection, join the daemon's threads, free. NULL is a no-op. */
void serve_stop(serve_server *s);

/* The chat page served at GET / (serve_page.c). */
extern const char serve_page_html[];

#endif /* KILN_SERVE_HTTP_H */
