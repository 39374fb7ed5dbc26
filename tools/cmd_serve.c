/* cmd_serve.c -- `kiln serve`: an OpenAI-compatible HTTP server over the serving engine
 * (docs/SERVING.md). This file parses the command line, loads the model, starts the engine
 * and the HTTP front (serve_http.c), and drains both on SIGINT / SIGTERM. */
#include "cli.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const char *serve_help =
    "usage: kiln serve -m MODEL [options]\n\n"
    "An OpenAI-compatible HTTP server: POST /v1/chat/completions, POST /v1/completions,\n"
    "GET /v1/models, POST /tokenize, POST /detokenize, GET /health, GET /metrics, and a chat\n"
    "page at GET /. Requests are batched continuously by the serving engine (docs/SERVING.md).\n"
    "SIGINT or SIGTERM stops accepting connections, finishes every request, and exits 0.\n\n"
    "  -m, --model MODEL        .gguf file or Hugging Face folder (or the first bare argument)\n"
    "      --model-name NAME    the id /v1/models lists and requests name (default: the file's\n"
    "                           name without .gguf)\n"
    "      --device D           cpu (default), cuda or cuda:N\n"
    "      --fast               the device's fast arithmetic (docs/CUDA.md); default: auditable\n"
    "      --batch-invariant    with --fast: a request's tokens independent of the batch (the\n"
    "                           CPU's --fast is that already; on CUDA, batch-size-free kernels)\n"
    "      --format F           f32 (default) | mx16 | mx8: the products in an exact block format\n"
    "                           (the same bits on cpu and cuda; docs/ARITHMETIC.md), then\n"
    "                           per-weight rules: mx8,output=mx16,attn_v=mx16\n"
    "  -t, --threads N          CPU threads (default: all cores)\n"
    "      --host ADDR          address to listen on (default 127.0.0.1)\n"
    "      --port N             port (default 8080; 0: any free port, printed)\n"
    "      --ctx N              positions per request, prompt + answer (default: the model's,\n"
    "                           at most 8192)\n"
    "      --max-batch-tokens N tokens per forward step (default 512)\n"
    "      --max-seqs N         requests running at once (default 32)\n"
    "      --kv-blocks N        KV cache pool in blocks of 64 positions\n"
    "      --kv-memory SIZE     KV cache pool in bytes, e.g. 512M, 4G (instead of --kv-blocks;\n"
    "                           default: room for every running request at --ctx)\n"
    "      --max-queue N        requests waiting beyond which new ones get 429 (default 256)\n"
    "      --no-prefix-cache    do not share KV blocks between common prompt prefixes\n"
    "      --itl-bound X        while requests decode, cut prefill chunks so a step takes at most\n"
    "                           X times the step of all running requests decoding (default 2;\n"
    "                           0: only --max-batch-tokens)\n"
    "      --api-key KEY        require 'Authorization: Bearer KEY' (all routes but /health, /)\n"
    "      --api-key-file FILE  the key is FILE's first line\n"
    "      --max-connections N  open connections at once (default 512: above --max-seqs plus\n"
    "                           --max-queue, so that the queue's 429 is what a client meets)\n"
    "      --timeout S          close a connection idle (or a client not reading) for S seconds\n"
    "                           (default 600)\n"
    "      --max-body SIZE      largest request body (default 8M; larger: 413)\n";

/* "512M", "4G", "1000000": bytes; 0 on success, else a usage error's exit code. */
static int parse_size(const char *opt, const char *v, size_t *out) {
    char *end;
    errno = 0;
    unsigned long long n = strtoull(v, &end, 10);
    unsigned shift = 0;
    if (end != v && *end) {
        switch (*end) {
        case 'k': case 'K': shift = 10; break;
        case 'm': case 'M': shift = 20; break;
        case 'g': case 'G': shift = 30; break;
        case 't': case 'T': shift = 40; break;
        default: shift = 64;
        }
        end++;
        if (*end == 'i') end++;
        if (*end == 'B' || *end == 'b') end++;
    }
    if (errno || end == v || *end || *v == '-' || shift == 64 || n > (SIZE_MAX >> shift) || n == 0)
        return cli_usage_error("serve", "%s expects a size such as 512M or 4G, got '%s'", opt, v);
    *out = (size_t)(n << shift);
    return 0;
}

/* The key from FILE's first line (trailing newline and spaces dropped), malloc'd. */
static char *read_key_file(const char *path) {
    size_t len = 0;
    char *text = cli_read_file("serve", path, 1 << 16, &len);
    if (!text) return NULL;
    text[strcspn(text, "\r\n")] = '\0';
    size_t n = strlen(text);
    while (n && (text[n - 1] == ' ' || text[n - 1] == '\t')) text[--n] = '\0';
    if (!n) {
        fprintf(stderr, "kiln serve: --api-key-file %s: the first line is empty\n", path);
        free(text);
        return NULL;
    }
    return text;
}

#if KILN_HAVE_MHD
#include "base/base.h"
#include "receipt.h"
#include "serve_http.h"

static int signal_pipe[2] = {-1, -1};

static void on_signal(int sig) {
    unsigned char b = (unsigned char)sig;
    ssize_t w = write(signal_pipe[1], &b, 1);
    (void)w;
}

/* The default --model-name: the path's last component without ".gguf" (malloc'd). */
static char *default_model_name(const char *path) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    size_t start = n;
    while (start && path[start - 1] != '/') start--;
    size_t len = n - start;
    if (len > 5 && !strncmp(path + n - 5, ".gguf", 5)) len -= 5;
    char *s = malloc(len + 1);
    if (s) {
        memcpy(s, path + start, len);
        s[len] = '\0';
    }
    return s;
}

int cmd_serve(int argc, char **argv) {
    const char *cmd = "serve", *model = NULL, *model_name = NULL, *host = "127.0.0.1",
               *api_key = NULL, *key_file = NULL, *format_rules = NULL;
    long port = 8080, threads = 0, n_ctx = 0, max_batch = 0, max_seqs = 0, kv_blocks = 0,
         max_queue = 0, max_conns = 512, timeout = 600;
    size_t kv_memory = 0, max_body = (size_t)8 << 20;
    int device = -1, fast = 0, batch_invariant = 0, no_prefix = 0, format = KILN_FORMAT_F32;
    double itl_bound = -1; /* -1: the engine's default */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = NULL;
        int err = 0;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(serve_help, stdout);
            return 0;
        } else if (cli_opt(argc, argv, &i, "-m", &v, &err, cmd) ||
                   cli_opt(argc, argv, &i, "--model", &v, &err, cmd)) {
            model = v;
        } else if (cli_opt(argc, argv, &i, "--model-name", &v, &err, cmd)) {
            if (!err && !*v) err = cli_usage_error(cmd, "--model-name needs a non-empty name");
            model_name = v;
        } else if (cli_opt(argc, argv, &i, "--device", &v, &err, cmd)) {
            if (!err) err = cli_parse_device(cmd, v, &device);
        } else if (!strcmp(a, "--fast")) {
            fast = 1;
        } else if (!strcmp(a, "--batch-invariant")) {
            batch_invariant = 1;
        } else if (cli_opt(argc, argv, &i, "--format", &v, &err, cmd)) {
            if (!err) err = cli_parse_format(cmd, v, &format, &format_rules);
        } else if (cli_opt(argc, argv, &i, "-t", &v, &err, cmd) ||
                   cli_opt(argc, argv, &i, "--threads", &v, &err, cmd)) {
            if (!err) err = cli_parse_int(cmd, a, v, 1, 256, &threads);
        } else if (cli_opt(argc, argv, &i, "--host", &v, &err, cmd)) {
            host = v;
        } else if (cli_opt(argc, argv, &i, "--port", &v, &err, cmd)) {
            if (!err) err = cli_parse_int(cmd, a, v, 0, 65535, &port);
        } else if (cli_opt(argc, argv, &i, "--ctx", &v, &err, cmd)) {
            if (!err) err = cli_parse_int(cmd, a, v, 1, 1 << 20, &n_ctx);
        } else if (cli_opt(argc, argv, &i, "--max-batch-tokens", &v, &err, cmd)) {
            if (!err) err = cli_parse_int(cmd, a, v, 1, 1 << 20, &max_batch);
        } else if (cli_opt(argc, argv, &i, "--max-seqs", &v, &err, cmd)) {
            if (!err) err = cli_parse_int(cmd, a, v, 1, 1 << 16, &max_seqs);
        } else if (cli_opt(argc, argv, &i, "--kv-blocks", &v, &err, cmd)) {
            if (!err) err = cli_parse_int(cmd, a, v, 1, 1 << 28, &kv_blocks);
        } else if (cli_opt(argc, argv, &i, "--kv-memory", &v, &err, cmd)) {
            if (!err) err = parse_size(a, v, &kv_memory);
        } else if (cli_opt(argc, argv, &i, "--max-queue", &v, &err, cmd)) {
            if (!err) err = cli_parse_int(cmd, a, v, 1, 1 << 24, &max_queue);
        } else if (!strcmp(a, "--no-prefix-cache")) {
            no_prefix = 1;
        } else if (cli_opt(argc, argv, &i, "--itl-bound", &v, &err, cmd)) {
            if (!err) err = cli_parse_float(cmd, a, v, 0.0, 1e6, &itl_bound);
            if (!err && itl_bound > 0 && itl_bound <= 1)
                err = cli_usage_error(cmd, "--itl-bound %g: use 0 (off) or a bound above 1", itl_bound);
        } else if (cli_opt(argc, argv, &i, "--api-key", &v, &err, cmd)) {
            if (!err && !*v) err = cli_usage_error(cmd, "--api-key needs a non-empty key");
            api_key = v;
        } else if (cli_opt(argc, argv, &i, "--api-key-file", &v, &err, cmd)) {
            key_file = v;
        } else if (cli_opt(argc, argv, &i, "--max-connections", &v, &err, cmd)) {
            if (!err) err = cli_parse_int(cmd, a, v, 1, 4096, &max_conns);
        } else if (cli_opt(argc, argv, &i, "--timeout", &v, &err, cmd)) {
            if (!err) err = cli_parse_int(cmd, a, v, 1, 86400, &timeout);
        } else if (cli_opt(argc, argv, &i, "--max-body", &v, &err, cmd)) {
            if (!err) err = parse_size(a, v, &max_body);
        } else if (a[0] != '-' && !model) {
            model = a;
        } else if (a[0] != '-') {
            err = cli_usage_error(cmd, "unexpected argument '%s'", a);
        } else {
            err = cli_usage_error(cmd, "unknown option '%s'", a);
        }
        if (err) return 2;
    }
    if (!model) return cli_usage_error(cmd, "a model is required (kiln serve MODEL or -m MODEL)");
    if (kv_blocks && kv_memory)
        return cli_usage_error(cmd, "give --kv-blocks or --kv-memory, not both");
    if (api_key && key_file)
        return cli_usage_error(cmd, "give --api-key or --api-key-file, not both");
    if (batch_invariant && !fast) return cli_usage_error(cmd, "--batch-invariant goes with --fast");
    char *key_owned = NULL;
    if (key_file && !(api_key = key_owned = read_key_file(key_file))) return 1;

    kiln_model_params mp = kiln_model_default_params();
    mp.n_threads = (int)threads;
    kiln_model *m = NULL;
    kiln_status st = kiln_model_open(model, &mp, &m);
    if (st != KILN_OK) {
        free(key_owned);
        return cli_fail(cmd, model, st);
    }
    kiln_engine_params ep = kiln_engine_default_params();
    ep.device = device;
    ep.fast = fast;
    ep.batch_invariant = batch_invariant;
    ep.format = format;
    ep.format_rules = format_rules;
    ep.n_threads = (int)threads;
    if (n_ctx) ep.n_ctx = (int)n_ctx;
    if (max_batch) ep.max_batch_tokens = (int)max_batch;
    if (max_seqs) ep.max_seqs = (int)max_seqs;
    if (kv_blocks) ep.kv_blocks = (int)kv_blocks;
    if (kv_memory) ep.kv_memory = kv_memory;
    if (max_queue) ep.max_queue = (int)max_queue;
    if (no_prefix) ep.prefix_cache = 0;
    if (itl_bound >= 0) ep.itl_bound = (float)itl_bound;
    kiln_engine *e = NULL;
    st = kiln_engine_create(m, &ep, &e);
    if (st != KILN_OK) {
        kiln_model_close(m);
        free(key_owned);
        return cli_fail(cmd, "starting the engine", st);
    }
    char *name_owned = model_name ? NULL : default_model_name(model);
    int ctx_len = kiln_engine_n_ctx(e);
    /* what every receipt says of the model and the arithmetic ("receipt": true) */
    kiln_model_info info;
    receipt rb;
    memset(&rb, 0, sizeof rb);
    rb.version = RECEIPT_VERSION;
    st = kiln_model_get_info(m, &info);
    if (st != KILN_OK) {
        kiln_engine_free(e);
        kiln_model_close(m);
        free(key_owned);
        free(name_owned);
        return cli_fail(cmd, "the model", st);
    }
    rb.n_vocab = info.n_vocab;
    rb.architecture = (char *)info.architecture;
    rb.model_name = (char *)info.name;
    rb.model_path = (char *)model;
    rb.n_ctx = ctx_len;
    rb.n_batch = max_batch ? (int)max_batch : 512;
    rb.fast = fast;
    rb.batch_invariant = batch_invariant;
    rb.format = format;
    rb.format_rules = (char *)format_rules;
    rb.device = device;
    rb.threads = (int)threads;
    char device_name[32];
    if (device < 0) snprintf(device_name, sizeof device_name, "cpu");
    else snprintf(device_name, sizeof device_name, "cuda:%d", device);

    serve_config cfg = {.engine = e,
                        .tok = kiln_model_get_tokenizer(m),
                        .model_name = model_name   ? model_name
                                      : name_owned ? name_owned
                                                   : "kiln",
                        .api_key = api_key,
                        .device_name = device_name,
                        .n_ctx = ctx_len,
                        .host = host,
                        .port = (int)port,
                        .max_connections = (int)max_conns,
                        .timeout_s = (int)timeout,
                        .max_body = max_body,
                        .receipt_base = &rb};
    int rc = 1;
    serve_server *srv = NULL;
    char err[256];
    struct sigaction sa, old_int, old_term;
    memset(&sa, 0, sizeof sa);
    if (pipe(signal_pipe) != 0) {
        fprintf(stderr, "kiln serve: pipe: %s\n", strerror(errno));
        goto done;
    }
    /* the first signal drains; SA_RESETHAND makes a second one end the process at once */
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    signal(SIGPIPE, SIG_IGN);
    if (serve_start(&cfg, &srv, err, sizeof err) != 0) {
        fprintf(stderr, "kiln serve: %s\n", err);
        goto done;
    }
    const char *h = strchr(host, ':') ? "[" : "";
    printf("kiln serve: listening on http://%s%s%s:%d/ (model %s, device %s%s%s%s%s%s%s)\n", h, host,
           *h ? "]" : "", serve_port(srv), cfg.model_name, device_name,
           fast ? (batch_invariant ? ", fast, batch-invariant" : ", fast") : "",
           format != KILN_FORMAT_F32 || format_rules ? ", format " : "",
           format != KILN_FORMAT_F32 || format_rules ? cli_format_name(format) : "", format_rules ? "," : "",
           format_rules ? format_rules : "",
           api_key ? ", API key required" : "");
    fflush(stdout);

    unsigned char sig = 0;
    while (read(signal_pipe[0], &sig, 1) < 0 && errno == EINTR) {
    }
    fprintf(stderr,
            "kiln serve: signal %d: draining (no new connections; finishing %d request(s))\n", sig,
            serve_active(srv));
    serve_quiesce(srv);
    kiln_engine_shutdown(e, 1); /* every queued and running request finishes */
    /* the connections write their last bytes; a client that stopped reading has --timeout */
    struct timespec ts = {0, 20 * 1000 * 1000};
    for (long waited = 0; serve_active(srv) > 0 && waited < (timeout + 5) * 1000L; waited += 20)
        nanosleep(&ts, NULL);
    serve_stop(srv);
    srv = NULL;
    rc = 0;
done:
    serve_stop(srv);
    kiln_engine_free(e);
    kiln_model_close(m);
    free(name_owned);
    free(key_owned);
    if (signal_pipe[0] >= 0) {
        close(signal_pipe[0]);
        close(signal_pipe[1]);
    }
    if (rc == 0) {
        kiln_mem_stats ms;
        kiln_mem_get_stats(&ms);
        fprintf(stderr, "kiln serve: stopped; kiln memory still held: %zu bytes in %zu blocks\n",
                ms.live_bytes, ms.live_blocks);
    }
    return rc;
}

#else /* built without libmicrohttpd */

int cmd_serve(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            fputs(serve_help, stdout);
            return 0;
        }
    (void)parse_size;
    (void)read_key_file;
    fprintf(stderr,
            "kiln serve: this kiln was built without libmicrohttpd (Debian: libmicrohttpd-dev; "
            "scripts/setup-deps.sh installs it), so it has no HTTP server\n");
    return 1;
}

#endif
