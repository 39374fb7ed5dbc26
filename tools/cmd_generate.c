/* cmd_generate.c -- `kiln generate` and `kiln chat`. */
#include "cli.h"
#include "receipt.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_STOPS 16

typedef struct gen_opts {
    const char *model, *prompt, *prompt_file, *system, *receipt;
    long n_predict, threads, n_ctx, n_batch;
    kiln_sampler_params sampler;
    int chat, json, ignore_eos, f32, no_mmap, show_prompt_stats, fast, batch_invariant;
    int seed_given; /* --seed: else a random seed, printed */
    int device; /* -1 = CPU, N >= 0 = CUDA device N */
    int format; /* kiln_format */
    const char *format_rules; /* --format's per-weight rules (NULL: none) */
    const char *stops[MAX_STOPS + 1];
    int n_stops;
} gen_opts;

static const char *generate_help =
    "usage: kiln generate [-m] MODEL (-p PROMPT | -f FILE) [options]\n\n"
    "  -m, --model MODEL      .gguf file or Hugging Face folder (or the first bare argument)\n"
    "  -p, --prompt TEXT      prompt text\n"
    "  -f, --file FILE        read the prompt from FILE ('-' = stdin)\n"
    "  -n, --n-predict N      tokens to generate (default 128)\n"
    "      --chat             wrap the prompt as a user message in the model's chat template\n"
    "      --system TEXT      system message (needs --chat)\n"
    "      --temp T           temperature; 0 = greedy (default 0.8)\n"
    "      --top-k K          keep the K most likely tokens; 0 = off (default 40)\n"
    "      --top-p P          nucleus sampling; 1 = off (default 0.95)\n"
    "      --min-p P          drop tokens below P x the top probability; 0 = off (default 0.05)\n"
    "      --repeat-penalty R penalise recent tokens; 1 = off (default 1)\n"
    "      --repeat-last-n N  window of the penalty (default 64, -1 = all)\n"
    "      --seed S           random seed (default: a new one each run, printed on stderr)\n"
    "      --stop TEXT        stop when TEXT is generated (repeatable, up to 16)\n"
    "      --ignore-eos       keep generating past end-of-generation tokens\n"
    "  -t, --threads N        CPU threads (default: all cores)\n"
    "      --ctx N            context length (default: model's, at most 4096, or as much of the model's\n"
    "                         as the prompt and -n need)\n"
    "      --batch N          prefill chunk (default 512)\n"
    "      --f32              dequantize all weights to f32 at load\n"
    "      --no-mmap          read the model instead of mapping it\n"
    "      --fast             approximate fast arithmetic: on the CPU 8-bit activations for\n"
    "                         quantized weights; on CUDA bf16 tensor cores (docs/CUDA.md)\n"
    "      --batch-invariant  a token's bits independent of the batch: the CPU's --fast is\n"
    "                         that already (accepted, no change); on CUDA, the kernels\n"
    "                         kiln serve --fast --batch-invariant runs (docs/CUDA.md)\n"
    "      --format F         f32 (default) | mx16 | mx8: the matrix products in an exact block\n"
    "                         format (integer products, one rounding; the same bits on\n"
    "                         cpu and cuda; docs/ARITHMETIC.md, \"Exact block formats\"),\n"
    "                         then per-weight rules, the last match winning:\n"
    "                         mx8,output=mx16,attn_v=mx16,blk.0-3.ffn_down=f32\n"
    "      --device D         cpu (default), cuda or cuda:N: run on CUDA GPU N (same bits as cpu)\n"
    "      --json             print one JSON object: prompt_ids, ids, text, timings\n"
    "      --receipt FILE     write a receipt (JSON: fingerprints, prompt, settings, ids and a hash\n"
    "                         chain of every step's logits) that 'kiln verify FILE -m MODEL'\n"
    "                         checks on any device (docs/REPRODUCIBILITY.md)\n";

#define CHAT_COMMANDS                                                                        \
    "  /help             this list\n"                                                       \
    "  /reset            clear the conversation (the system message stays)\n"               \
    "  /bye, /exit       quit (so does Ctrl-D)\n"

static const char *chat_help =
    "usage: kiln chat [-m] MODEL [options]\n\n"
    "Interactive chat using the model's chat template. Type a message and press Enter\n"
    "(an empty line is ignored). Commands, never sent to the model:\n"
    CHAT_COMMANDS
    "Ctrl-C while a reply is generated stops it (the partial reply stays in the conversation);\n"
    "Ctrl-C at the prompt clears the line, a second one quits.\n\n"
    "  -m, --model MODEL      .gguf file or Hugging Face folder (or the first bare argument)\n"
    "      --system TEXT      system message\n"
    "  -n, --n-predict N      max tokens per reply (default 512)\n"
    "      --temp, --top-k, --top-p, --min-p, --repeat-penalty, --seed, -t, --ctx, --device as in generate\n";

/* --device: "cpu" -> -1, "cuda" -> 0, "cuda:N" -> N. Returns 0 or the usage error's code. */
/* Parse options shared by generate and chat. Returns 0, or the exit code on error / help. */
static int parse_opts(const char *cmd, int argc, char **argv, gen_opts *o, int *exit_code) {
    memset(o, 0, sizeof *o);
    o->n_predict = strcmp(cmd, "chat") ? 128 : 512;
    o->n_batch = 512;
    o->device = -1;
    o->sampler = kiln_sampler_default_params();
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = NULL;
        int err = 0;
        double d;
        long n;
        unsigned long long u;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(strcmp(cmd, "chat") ? generate_help : chat_help, stdout);
            *exit_code = 0;
            return 1;
        } else if (cli_opt(argc, argv, &i, "-m", &v, &err, cmd) || cli_opt(argc, argv, &i, "--model", &v, &err, cmd)) {
            o->model = v;
        } else if (cli_opt(argc, argv, &i, "-p", &v, &err, cmd) || cli_opt(argc, argv, &i, "--prompt", &v, &err, cmd)) {
            o->prompt = v;
        } else if (cli_opt(argc, argv, &i, "-f", &v, &err, cmd) || cli_opt(argc, argv, &i, "--file", &v, &err, cmd)) {
            o->prompt_file = v;
        } else if (cli_opt(argc, argv, &i, "--system", &v, &err, cmd)) {
            o->system = v;
        } else if (cli_opt(argc, argv, &i, "-n", &v, &err, cmd) || cli_opt(argc, argv, &i, "--n-predict", &v, &err, cmd)) {
            if (!err) err = cli_parse_int(cmd, a, v, 0, 1 << 20, &o->n_predict);
        } else if (cli_opt(argc, argv, &i, "-t", &v, &err, cmd) || cli_opt(argc, argv, &i, "--threads", &v, &err, cmd)) {
            if (!err) err = cli_parse_int(cmd, a, v, 1, 256, &o->threads);
        } else if (cli_opt(argc, argv, &i, "--ctx", &v, &err, cmd)) {
            if (!err) err = cli_parse_int(cmd, a, v, 1, 1 << 20, &o->n_ctx);
        } else if (cli_opt(argc, argv, &i, "--batch", &v, &err, cmd)) {
            if (!err) err = cli_parse_int(cmd, a, v, 1, 1 << 16, &o->n_batch);
        } else if (cli_opt(argc, argv, &i, "--temp", &v, &err, cmd)) {
            if (!err && !(err = cli_parse_float(cmd, a, v, 0, 100, &d))) o->sampler.temperature = (float)d;
        } else if (cli_opt(argc, argv, &i, "--top-k", &v, &err, cmd)) {
            if (!err && !(err = cli_parse_int(cmd, a, v, 0, 1 << 24, &n))) o->sampler.top_k = (int)n;
        } else if (cli_opt(argc, argv, &i, "--top-p", &v, &err, cmd)) {
            if (!err && !(err = cli_parse_float(cmd, a, v, 1e-9, 1, &d))) o->sampler.top_p = (float)d;
        } else if (cli_opt(argc, argv, &i, "--min-p", &v, &err, cmd)) {
            if (!err && !(err = cli_parse_float(cmd, a, v, 0, 1, &d))) o->sampler.min_p = (float)d;
        } else if (cli_opt(argc, argv, &i, "--repeat-penalty", &v, &err, cmd)) {
            if (!err && !(err = cli_parse_float(cmd, a, v, 1e-3, 100, &d))) o->sampler.repeat_penalty = (float)d;
        } else if (cli_opt(argc, argv, &i, "--repeat-last-n", &v, &err, cmd)) {
            if (!err && !(err = cli_parse_int(cmd, a, v, -1, 1 << 24, &n))) o->sampler.repeat_last_n = (int)n;
        } else if (cli_opt(argc, argv, &i, "--seed", &v, &err, cmd)) {
            if (!err && !(err = cli_parse_u64(cmd, a, v, &u))) o->sampler.seed = u;
            o->seed_given = 1;
        } else if (cli_opt(argc, argv, &i, "--receipt", &v, &err, cmd)) {
            if (!err && !strcmp(cmd, "chat")) err = cli_usage_error(cmd, "--receipt is for kiln generate");
            else if (!err && !*v) err = cli_usage_error(cmd, "--receipt needs a file name");
            else if (!err) o->receipt = v;
        } else if (cli_opt(argc, argv, &i, "--stop", &v, &err, cmd)) {
            if (!err && o->n_stops == MAX_STOPS) err = cli_usage_error(cmd, "at most %d --stop strings", MAX_STOPS);
            else if (!err && !*v) err = cli_usage_error(cmd, "--stop needs a non-empty string");
            else if (!err) o->stops[o->n_stops++] = v;
        } else if (!strcmp(a, "--chat")) {
            o->chat = 1;
        } else if (!strcmp(a, "--json")) {
            o->json = 1;
        } else if (!strcmp(a, "--ignore-eos")) {
            o->ignore_eos = 1;
        } else if (!strcmp(a, "--f32")) {
            o->f32 = 1;
        } else if (!strcmp(a, "--fast")) {
            o->fast = 1;
        } else if (!strcmp(a, "--batch-invariant")) {
            o->batch_invariant = 1;
        } else if (cli_opt(argc, argv, &i, "--device", &v, &err, cmd)) {
            if (!err) err = cli_parse_device(cmd, v, &o->device);
        } else if (cli_opt(argc, argv, &i, "--format", &v, &err, cmd)) {
            if (!err) err = cli_parse_format(cmd, v, &o->format, &o->format_rules);
        } else if (!strcmp(a, "--no-mmap")) {
            o->no_mmap = 1;
        } else if (a[0] != '-' && !o->model) {
            o->model = a; /* the model as the bare argument: kiln generate MODEL -p ... */
        } else if (a[0] != '-') {
            err = cli_usage_error(cmd, "unexpected argument '%s' (the model is '%s'; quote a prompt: -p \"...\")", a,
                                  o->model);
        } else {
            err = cli_usage_error(cmd, "unknown option '%s'", a);
        }
        if (err) {
            *exit_code = 2;
            return 1;
        }
    }
    if (!o->model) {
        *exit_code = cli_usage_error(cmd, "a model is required (kiln %s MODEL or -m MODEL)", cmd);
        return 1;
    }
    if (!o->seed_given) o->sampler.seed = cli_random_seed();
    return 0;
}

/* A context of n_ctx positions (0: the library's default) for o's settings. */
static kiln_status make_context(const gen_opts *o, kiln_model *m, int n_ctx, kiln_context **ctx) {
    kiln_context_params cp = kiln_context_default_params();
    cp.n_ctx = n_ctx;
    cp.n_batch = (int)o->n_batch;
    cp.n_threads = (int)o->threads;
    cp.fast = o->fast; /* CPU: 8-bit activations; CUDA: the fast arithmetic */
    cp.batch_invariant = o->batch_invariant;
    cp.format = o->format;
    cp.format_rules = o->format_rules;
    cp.device = o->device;
    return kiln_context_create(m, &cp, ctx);
}

static kiln_status load_model(const gen_opts *o, kiln_model **m) {
    kiln_model_params mp = kiln_model_default_params();
    mp.n_threads = (int)o->threads;
    mp.weight_mode = o->f32 ? KILN_WEIGHTS_F32 : KILN_WEIGHTS_AUTO;
    mp.use_mmap = !o->no_mmap;
    return kiln_model_open(o->model, &mp, m);
}

static kiln_status open_model(const gen_opts *o, kiln_model **m, kiln_context **ctx) {
    kiln_status st = load_model(o, m);
    if (st != KILN_OK) return st;
    st = make_context(o, *m, (int)o->n_ctx, ctx);
    if (st != KILN_OK) {
        kiln_model_close(*m);
        *m = NULL;
    }
    return st;
}

/* The context generate makes for a prompt of n_ids tokens: --ctx's; without it the default
 * (0: the model's, at most KILN_DEFAULT_MAX_CTX positions), or, where the prompt and -n need
 * more, as much of the model's trained context as they need: a long prompt needs no --ctx. */
static int generate_n_ctx(const gen_opts *o, const kiln_model *m, size_t n_ids) {
    if (o->n_ctx) return (int)o->n_ctx;
    kiln_model_info mi;
    kiln_model_get_info(m, &mi);
    const long long want = (long long)n_ids + o->n_predict;
    if (want <= mi.n_ctx_train && want <= KILN_DEFAULT_MAX_CTX) return 0;
    return want < mi.n_ctx_train ? (int)want : mi.n_ctx_train;
}

/* The longest text that could still fit a context of n_ctx tokens: no token's piece is
 * shorter than the text it stands for (byte-level pieces spell a byte in 1-2 bytes,
 * SentencePiece's U+2581 spells a space in 3, byte fallback <0xNN> one byte in 6), and a
 * normalizer shrinks text by at most a few times; a prompt file past this bound is refused
 * before it is read to its end. */
static size_t prompt_max_bytes(const kiln_tokenizer *tok, int n_ctx) {
    size_t longest = 1;
    kiln_tokenizer_info ti;
    if (kiln_tokenizer_get_info(tok, &ti) != KILN_OK) ti.n_vocab = 0;
    for (int i = 0; i < ti.n_vocab; i++) {
        const char *p = kiln_token_piece(tok, i);
        size_t l = p ? strlen(p) : 0;
        if (l > longest) longest = l;
    }
    return (size_t)(n_ctx > 0 ? n_ctx : 1) * longest * 4 + 65536;
}

kiln_status cli_encode_prompt(const kiln_tokenizer *tok, const char *text, int chat,
                              const kiln_chat_message *msgs, size_t n_msgs, int32_t **ids,
                              size_t *n_ids) {
    char *rendered = NULL;
    size_t len = strlen(text ? text : "");
    kiln_status st = KILN_OK;
    if (chat) {
        size_t need = 0;
        st = kiln_chat_apply(tok, msgs, n_msgs, 1, NULL, 0, &need);
        if (st != KILN_OK && st != KILN_ERR_BUFFER_TOO_SMALL) return st;
        rendered = malloc(need + 1);
        if (!rendered) return KILN_ERR_NOMEM;
        st = kiln_chat_apply(tok, msgs, n_msgs, 1, rendered, need + 1, &len);
        if (st != KILN_OK) {
            free(rendered);
            return st;
        }
        text = rendered;
    }
    /* A chat template already holds its special tokens (BOS included where the model uses
     * one): tokenize it like Hugging Face's apply_chat_template, without adding more. */
    size_t need = 0;
    st = kiln_tokenize(tok, text, len, !chat, 1, NULL, 0, &need);
    if (st == KILN_OK || st == KILN_ERR_BUFFER_TOO_SMALL) {
        *ids = malloc((need ? need : 1) * sizeof(int32_t));
        st = *ids ? kiln_tokenize(tok, text, len, !chat, 1, *ids, need, n_ids) : KILN_ERR_NOMEM;
        if (st != KILN_OK) {
            free(*ids);
            *ids = NULL;
        }
    }
    free(rendered);
    return st;
}

static int stream_to_stdout(int32_t id, const char *text, size_t len, void *user) {
    (void)id;
    (void)user;
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    return 0;
}

/* The seed on stderr, so that a sampled run can be repeated. */
static void print_seed(const gen_opts *o) {
    unsigned long long s = (unsigned long long)o->sampler.seed;
    fprintf(stderr, "[kiln] seed %llu (repeat with --seed %llu)\n", s, s);
}

/* The receipt of a finished generation (receipt.h); 0, or 1 with the reason printed. */
static int write_receipt(const gen_opts *o, const kiln_model *m, const kiln_context *ctx, const int32_t *ids,
                         size_t n_ids, const kiln_generate_result *res, uint8_t *chain) {
    receipt r;
    memset(&r, 0, sizeof r);
    kiln_model_info mi;
    kiln_status st = kiln_model_get_info(m, &mi);
    if (st == KILN_OK) st = kiln_model_fingerprint(m, r.model_fp); /* kept from the generation's chain */
    if (st == KILN_OK) st = kiln_tokenizer_fingerprint(kiln_model_get_tokenizer(m), r.tokenizer_fp);
    if (st != KILN_OK) return cli_fail("generate", "receipt", st);
    /* the receipt borrows the strings and arrays: nothing here is freed through it */
    r.kiln_version = (char *)kiln_version();
    r.model_path = (char *)o->model;
    r.model_name = (char *)mi.name;
    r.architecture = (char *)mi.architecture;
    r.n_vocab = mi.n_vocab;
    r.prompt_text = (char *)o->prompt;
    r.system = (char *)o->system;
    r.chat = o->chat;
    r.prompt_ids = (int32_t *)ids;
    r.n_prompt = n_ids;
    r.max_tokens = (int)o->n_predict;
    r.sampler = o->sampler;
    for (int i = 0; i < o->n_stops; i++) r.stops[i] = (char *)o->stops[i];
    r.n_stops = o->n_stops;
    r.ignore_eos = o->ignore_eos;
    r.n_ctx = kiln_context_n_ctx(ctx);
    r.n_batch = (int)o->n_batch;
    r.weights_f32 = o->f32;
    r.fast = o->fast;
    r.batch_invariant = o->batch_invariant;
    r.format = o->format;
    r.format_rules = (char *)o->format_rules;
    r.device = o->device;
    r.threads = (int)o->threads;
    r.ids = res->ids;
    r.n_ids = res->n_ids;
    r.text = res->text;
    r.stop_reason = (char *)res->stop_reason;
    r.chain = (uint8_t(*)[32])chain;
    if (receipt_write("generate", o->receipt, &r)) return 1;
    fprintf(stderr, "[kiln] receipt written to %s (check it with: kiln verify %s -m MODEL)\n", o->receipt, o->receipt);
    return 0;
}

static void json_add_ids(cJSON *obj, const char *key, const int32_t *ids, size_t n) {
    cJSON *arr = cJSON_AddArrayToObject(obj, key);
    for (size_t i = 0; i < n; i++) cJSON_AddItemToArray(arr, cJSON_CreateNumber(ids[i]));
}

int cmd_generate(int argc, char **argv) {
    gen_opts o;
    int code = 0;
    if (parse_opts("generate", argc, argv, &o, &code)) return code;
    if (!!o.prompt == !!o.prompt_file)
        return cli_usage_error("generate", "give exactly one of -p PROMPT or -f FILE");
    if (o.system && !o.chat)
        return cli_usage_error("generate", "--system is a chat message: add --chat (the model's chat template)");
    char *file_text = NULL;
    kiln_model *m = NULL;
    kiln_context *ctx = NULL;
    kiln_status st = load_model(&o, &m);
    if (st != KILN_OK) return cli_fail("generate", o.model, st);
    const kiln_tokenizer *tok = kiln_model_get_tokenizer(m);
    if (o.prompt_file) {
        kiln_model_info mi;
        kiln_model_get_info(m, &mi);
        /* the context is made for the prompt's length, at most the model's */
        const int bound = o.n_ctx ? (int)o.n_ctx : mi.n_ctx_train;
        file_text = cli_read_file("generate", o.prompt_file, prompt_max_bytes(tok, bound), NULL);
        if (!file_text) {
            kiln_model_close(m);
            return 1;
        }
        o.prompt = file_text;
    }
    kiln_chat_message msgs[2];
    size_t n_msgs = 0;
    if (o.system) msgs[n_msgs++] = (kiln_chat_message){"system", o.system};
    msgs[n_msgs++] = (kiln_chat_message){"user", o.prompt};
    int32_t *ids = NULL;
    size_t n_ids = 0;
    uint8_t *chain = NULL;
    int rc = 0;
    st = cli_encode_prompt(tok, o.prompt, o.chat, msgs, n_msgs, &ids, &n_ids);
    if (st != KILN_OK) {
        rc = cli_fail("generate", "prompt", st);
        goto out;
    }
    if (n_ids == 0) {
        rc = cli_usage_error("generate", "the prompt gives no tokens");
        goto out;
    }
    st = make_context(&o, m, generate_n_ctx(&o, m, n_ids), &ctx);
    if (st != KILN_OK) {
        rc = cli_fail("generate", o.model, st);
        goto out;
    }
    if ((long)n_ids > kiln_context_n_ctx(ctx)) {
        kiln_model_info mi;
        kiln_model_get_info(m, &mi);
        if (kiln_context_n_ctx(ctx) < mi.n_ctx_train)
            fprintf(stderr, "kiln generate: the prompt is %zu tokens and the context holds %d: pass a larger --ctx "
                            "(the model was trained on %d) or a shorter prompt\n",
                    n_ids, kiln_context_n_ctx(ctx), mi.n_ctx_train);
        else
            fprintf(stderr, "kiln generate: the prompt is %zu tokens and the model's context is %d: shorten the "
                            "prompt\n", n_ids, mi.n_ctx_train);
        rc = 1;
        goto out;
    }
    print_seed(&o);
    kiln_generate_params gp = kiln_generate_default_params();
    gp.max_tokens = (int)o.n_predict;
    gp.sampler = o.sampler;
    gp.ignore_eos = o.ignore_eos;
    gp.stop_strings = o.n_stops ? o.stops : NULL;
    if (!o.json) gp.on_token = stream_to_stdout;
    if (o.receipt) {
        chain = malloc(32 * ((size_t)o.n_predict + 1));
        if (!chain) {
            fprintf(stderr, "kiln generate: out of memory for the receipt's chain\n");
            rc = 1;
            goto out;
        }
        gp.logits_chain = chain;
    }
    kiln_generate_result res;
    st = kiln_generate(ctx, ids, n_ids, &gp, &res);
    if (st != KILN_OK) {
        rc = cli_fail("generate", "generation", st);
        goto out;
    }
    if (o.receipt) rc = write_receipt(&o, m, ctx, ids, n_ids, &res, chain);
    double prefill_tps = res.prefill_seconds > 0 ? (double)(res.n_prompt - res.n_prompt_cached) / res.prefill_seconds : 0;
    double decode_tps = (res.n_ids > 1 && res.decode_seconds > 0) ? (double)(res.n_ids - 1) / res.decode_seconds : 0;
    if (o.json) {
        cJSON *obj = cJSON_CreateObject();
        json_add_ids(obj, "prompt_ids", ids, n_ids);
        json_add_ids(obj, "ids", res.ids, res.n_ids);
        cJSON_AddStringToObject(obj, "text", res.text);
        cJSON_AddNumberToObject(obj, "n_prompt", (double)n_ids);
        cJSON_AddNumberToObject(obj, "n_generated", (double)res.n_ids);
        cJSON_AddStringToObject(obj, "stop_reason", res.stop_reason);
        cJSON_AddNumberToObject(obj, "prefill_seconds", res.prefill_seconds);
        cJSON_AddNumberToObject(obj, "decode_seconds", res.decode_seconds);
        cJSON_AddNumberToObject(obj, "prefill_tokens_per_s", prefill_tps);
        cJSON_AddNumberToObject(obj, "decode_tokens_per_s", decode_tps);
        char *s = cJSON_PrintUnformatted(obj);
        if (s) puts(s);
        free(s);
        cJSON_Delete(obj);
    } else {
        fputc('\n', stdout);
        fprintf(stderr, "[kiln] prompt %d tokens, %.1f tok/s | generated %zu tokens, %.1f tok/s | stop: %s\n",
                res.n_prompt, prefill_tps, res.n_ids, decode_tps, res.stop_reason);
    }
    kiln_generate_result_free(&res);
out:
    free(chain);
    free(ids);
    free(file_text);
    kiln_context_free(ctx);
    kiln_model_close(m);
    return rc;
}

/* ---- chat ------------------------------------------------------------------------------ */

typedef struct chat_history {
    kiln_chat_message *msgs;
    char **owned; /* strings we allocated */
    size_t n, cap;
} chat_history;

static int history_push(chat_history *h, const char *role, char *content) {
    if (h->n == h->cap) {
        size_t cap = h->cap ? 2 * h->cap : 16;
        kiln_chat_message *m = realloc(h->msgs, cap * sizeof *m);
        if (!m) return 1;
        h->msgs = m;
        char **o = realloc(h->owned, cap * sizeof *o);
        if (!o) return 1;
        h->owned = o;
        h->cap = cap;
    }
    h->msgs[h->n] = (kiln_chat_message){role, content};
    h->owned[h->n] = content;
    h->n++;
    return 0;
}

static void history_clear(chat_history *h, size_t keep) {
    while (h->n > keep) free(h->owned[--h->n]);
}

/* Ctrl-C in chat: set by the handler, read between generated tokens (the reply stops) and
 * at the prompt (the line is cleared; a second one quits). The handler also writes a byte to
 * a pipe that the prompt polls beside stdin: a Ctrl-C that lands just before the read, or is
 * handled by a worker thread, still wakes the prompt (the self-pipe trick). */
static volatile sig_atomic_t chat_interrupted;
static int chat_wake_fd[2] = {-1, -1};

static void chat_on_sigint(int sig) {
    (void)sig;
    chat_interrupted = 1;
    if (chat_wake_fd[1] >= 0) {
        int e = errno;
        ssize_t w = write(chat_wake_fd[1], "c", 1);
        (void)w;
        errno = e;
    }
}

static int stream_until_interrupt(int32_t id, const char *text, size_t len, void *user) {
    if (chat_interrupted) return 1; /* stop: stop_reason "callback" */
    return stream_to_stdout(id, text, len, user);
}

static void chat_drain_wake(void) {
    char b[64];
    while (chat_wake_fd[0] >= 0 && read(chat_wake_fd[0], b, sizeof b) > 0) {
    }
}

/* One line of input: 1, 0 at end of input, -1 when Ctrl-C interrupted the read. poll_first:
 * wait for stdin or a Ctrl-C before reading (a terminal, with nothing left in stdin's buffer:
 * the last line was read whole). */
static int chat_read_line(char *line, size_t cap, int poll_first) {
    while (poll_first && !chat_interrupted) {
        struct pollfd fds[2] = {{.fd = 0, .events = POLLIN}, {.fd = chat_wake_fd[0], .events = POLLIN}};
        int r = poll(fds, 2, -1);
        if (r > 0 && (fds[0].revents & (POLLIN | POLLHUP | POLLERR))) break;
        if (r < 0 && errno != EINTR) break;
    }
    if (chat_interrupted) return -1;
    errno = 0;
    if (fgets(line, (int)cap, stdin)) return 1;
    if (chat_interrupted || errno == EINTR) {
        clearerr(stdin);
        return -1;
    }
    return 0;
}

static void chat_banner(const kiln_model *m, const kiln_context *ctx, const gen_opts *o) {
    kiln_model_info mi;
    kiln_model_get_info(m, &mi);
    fprintf(stderr, "kiln chat: %s (%s, %.1fM parameters), context %d tokens\n", mi.name, mi.architecture,
            (double)mi.n_params / 1e6, kiln_context_n_ctx(ctx));
    print_seed(o);
    fprintf(stderr, "Type a message and press Enter. /bye or Ctrl-D to quit; /help for commands.\n");
}

int cmd_chat(int argc, char **argv) {
    gen_opts o;
    int code = 0;
    if (parse_opts("chat", argc, argv, &o, &code)) return code;
    kiln_model *m = NULL;
    kiln_context *ctx = NULL;
    kiln_status st = open_model(&o, &m, &ctx);
    if (st != KILN_OK) return cli_fail("chat", o.model, st);
    const kiln_tokenizer *tok = kiln_model_get_tokenizer(m);
    /* Fail early, before the first prompt, if the template is unknown. */
    size_t need = 0;
    kiln_chat_message probe = {"user", "hi"};
    st = kiln_chat_apply(tok, &probe, 1, 1, NULL, 0, &need);
    if (st != KILN_OK && st != KILN_ERR_BUFFER_TOO_SMALL) {
        kiln_context_free(ctx);
        kiln_model_close(m);
        return cli_fail("chat", "chat template", st);
    }
    chat_history h = {0};
    size_t base = 0;
    if (o.system) {
        char *s = strdup(o.system);
        if (!s || history_push(&h, "system", s)) {
            fprintf(stderr, "kiln chat: out of memory\n");
            return 1;
        }
        base = 1;
    }
    /* no SA_RESTART: Ctrl-C must interrupt a prompt's read() */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = chat_on_sigint;
    sigemptyset(&sa.sa_mask);
    int interactive = isatty(0);
    if (interactive && pipe(chat_wake_fd) == 0) {
        fcntl(chat_wake_fd[0], F_SETFL, O_NONBLOCK);
        fcntl(chat_wake_fd[1], F_SETFL, O_NONBLOCK);
    }
    sigaction(SIGINT, &sa, NULL);
    chat_banner(m, ctx, &o);
    int whole_line = 1; /* the last read ended with its newline: stdin's buffer is empty */
    char line[16384];
    int rc = 0, ctrl_c_at_prompt = 0;
    for (;;) {
        chat_interrupted = 0; /* before the prompt shows: a Ctrl-C typed at it must not be lost */
        chat_drain_wake();
        if (interactive) {
            fputs("\n> ", stdout);
            fflush(stdout);
        }
        int got = chat_read_line(line, sizeof line, interactive && whole_line && chat_wake_fd[0] >= 0);
        if (got < 0) { /* Ctrl-C at the prompt: the terminal dropped the line; twice quits */
            if (ctrl_c_at_prompt) {
                fputc('\n', stdout);
                break;
            }
            ctrl_c_at_prompt = 1;
            fputs("\n(line cleared: Ctrl-C again, Ctrl-D or /bye quits)", stdout);
            continue;
        }
        if (got == 0) {
            if (interactive) fputc('\n', stdout);
            break;
        }
        ctrl_c_at_prompt = 0;
        size_t len = strlen(line);
        whole_line = len && line[len - 1] == '\n';
        while (len && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = '\0';
        size_t lead = strspn(line, " \t");
        if (lead == len) continue; /* an empty line is ignored */
        if (line[lead] == '/') {
            const char *c = line + lead;
            if (!strcmp(c, "/bye") || !strcmp(c, "/exit")) break;
            if (!strcmp(c, "/help") || !strcmp(c, "/?")) {
                fputs("commands:\n" CHAT_COMMANDS
                      "Ctrl-C stops a reply (what was generated stays in the conversation);\n"
                      "at the prompt it clears the line, and a second Ctrl-C quits.\n",
                      stdout);
            } else if (!strcmp(c, "/reset") || !strcmp(c, "/clear")) {
                history_clear(&h, base);
                fputs(base ? "[conversation cleared; the system message stays]\n" : "[conversation cleared]\n", stdout);
            } else {
                fprintf(stdout, "unknown command '%s': /help lists them (nothing was sent to the model)\n", c);
            }
            fflush(stdout);
            continue;
        }
        char *msg = strdup(line);
        if (!msg || history_push(&h, "user", msg)) {
            rc = 1;
            break;
        }
        int32_t *ids = NULL;
        size_t n_ids = 0;
        st = cli_encode_prompt(tok, NULL, 1, h.msgs, h.n, &ids, &n_ids);
        if (st != KILN_OK) {
            rc = cli_fail("chat", "prompt", st);
            break;
        }
        if ((long)n_ids + o.n_predict > kiln_context_n_ctx(ctx)) {
            free(ids);
            fprintf(stderr, "kiln chat: the conversation (%zu tokens) no longer fits the context of %d: /reset, "
                            "or restart with a larger --ctx or a smaller -n\n",
                    n_ids, kiln_context_n_ctx(ctx));
            history_clear(&h, h.n - 1);
            continue;
        }
        kiln_generate_params gp = kiln_generate_default_params();
        gp.max_tokens = (int)o.n_predict;
        gp.sampler = o.sampler;
        gp.on_token = stream_until_interrupt;
        kiln_generate_result res;
        chat_interrupted = 0;
        st = kiln_generate(ctx, ids, n_ids, &gp, &res);
        free(ids);
        if (st != KILN_OK) {
            rc = cli_fail("chat", "generation", st);
            break;
        }
        if (chat_interrupted) fputs(" [interrupted]", stdout);
        fputc('\n', stdout);
        fflush(stdout);
        char *reply = strdup(res.text ? res.text : "");
        kiln_generate_result_free(&res);
        if (!reply || history_push(&h, "assistant", reply)) {
            rc = 1;
            break;
        }
    }
    signal(SIGINT, SIG_DFL);
    for (int i = 0; i < 2; i++)
        if (chat_wake_fd[i] >= 0) {
            close(chat_wake_fd[i]);
            chat_wake_fd[i] = -1;
        }
    history_clear(&h, 0);
    free(h.msgs);
    free(h.owned);
    kiln_context_free(ctx);
    kiln_model_close(m);
    return rc;
}
