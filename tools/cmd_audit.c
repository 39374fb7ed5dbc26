/* cmd_audit.c -- `kiln fingerprint` (a model's and its tokenizer's fingerprints) and `kiln
 * verify` (re-run a receipt's generation and compare it step by step): docs/REPRODUCIBILITY.md. */
#include "base/sha256.h"
#include "cli.h"
#include "models/model.h" /* the per-tensor hashes of --json */
#include "receipt.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

/* ---- kiln fingerprint ---------------------------------------------------------------------- */

static const char *fingerprint_help =
    "usage: kiln fingerprint [-m] MODEL [--json] [-t N]\n\n"
    "The model's fingerprint: SHA-256 over its weights as stored (every tensor's name, dtype,\n"
    "shape and bytes, sorted by name; docs/REPRODUCIBILITY.md). The same weights give the same\n"
    "fingerprint however they are opened; a quantized file and its dequantized export differ.\n\n"
    "  -m, --model MODEL      .gguf file or Hugging Face folder (or the first bare argument)\n"
    "      --json             one JSON object: the fingerprint, the tokenizer's, and every\n"
    "                         tensor's name, dtype, shape, bytes and SHA-256\n"
    "  -t, --threads N        threads hashing the tensors (default: all cores)\n";

static void json_hex(cJSON *o, const char *key, const uint8_t d[32]) {
    char hex[65];
    kiln_sha256_hex(d, hex);
    cJSON_AddStringToObject(o, key, hex);
}

static int fingerprint_json(const char *path, const kiln_model *m) {
    uint8_t fp[32], tfp[32];
    kiln_fingerprint_entry *e = NULL;
    int n = 0;
    kiln_status st = kiln_model_fingerprint_tensors(m, fp, &e, &n);
    if (st == KILN_OK) st = kiln_tokenizer_fingerprint(kiln_model_get_tokenizer(m), tfp);
    if (st != KILN_OK) {
        kiln_free(e);
        return cli_fail("fingerprint", path, st);
    }
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "definition", "kiln-fingerprint-v1");
    json_hex(root, "fingerprint", fp);
    json_hex(root, "tokenizer_fingerprint", tfp);
    cJSON_AddStringToObject(root, "model", path);
    cJSON *arr = cJSON_AddArrayToObject(root, "tensors");
    for (int i = 0; i < n; i++) {
        cJSON *t = cJSON_CreateObject();
        cJSON_AddStringToObject(t, "name", e[i].name);
        cJSON_AddStringToObject(t, "dtype", kiln_dtype_name(e[i].dtype));
        cJSON *shape = cJSON_AddArrayToObject(t, "shape");
        for (int k = 0; k < e[i].n_dims; k++)
            cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)e[i].shape[k]));
        cJSON_AddNumberToObject(t, "bytes", (double)e[i].nbytes);
        json_hex(t, "sha256", e[i].sha256);
        cJSON_AddItemToArray(arr, t);
    }
    kiln_free(e);
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!s) {
        fprintf(stderr, "kiln fingerprint: out of memory\n");
        return 1;
    }
    puts(s);
    free(s);
    return 0;
}

int cmd_fingerprint(int argc, char **argv) {
    const char *model = NULL;
    int json = 0;
    long threads = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = NULL;
        int err = 0;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(fingerprint_help, stdout);
            return 0;
        } else if (cli_opt(argc, argv, &i, "-m", &v, &err, "fingerprint") ||
                   cli_opt(argc, argv, &i, "--model", &v, &err, "fingerprint")) {
            model = v;
        } else if (cli_opt(argc, argv, &i, "-t", &v, &err, "fingerprint") ||
                   cli_opt(argc, argv, &i, "--threads", &v, &err, "fingerprint")) {
            if (!err) err = cli_parse_int("fingerprint", a, v, 1, 256, &threads);
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (a[0] != '-' && !model) {
            model = a;
        } else if (a[0] != '-') {
            return cli_usage_error("fingerprint", "unexpected argument '%s' (the model is '%s')", a,
                                   model);
        } else {
            return cli_usage_error("fingerprint", "unknown option '%s'", a);
        }
        if (err) return 2;
    }
    if (!model)
        return cli_usage_error("fingerprint", "a model is required (kiln fingerprint MODEL)");
    kiln_model_params mp = kiln_model_default_params();
    mp.n_threads = (int)threads;
    kiln_model *m = NULL;
    kiln_status st = kiln_model_open(model, &mp, &m);
    if (st != KILN_OK) return cli_fail("fingerprint", model, st);
    int rc = 0;
    if (json) {
        rc = fingerprint_json(model, m);
    } else {
        uint8_t fp[32];
        char hex[65];
        st = kiln_model_fingerprint(m, fp);
        if (st != KILN_OK) {
            rc = cli_fail("fingerprint", model, st);
        } else {
            kiln_sha256_hex(fp, hex);
            puts(hex);
        }
    }
    kiln_model_close(m);
    return rc;
}

/* ---- kiln verify --------------------------------------------------------------------------- */

static const char *verify_help =
    "usage: kiln verify RECEIPT -m MODEL [--device D] [-t N]\n\n"
    "Check a receipt of 'kiln generate --receipt': the model's and the tokenizer's fingerprints\n"
    "against the receipt's, then the generation again with the receipt's prompt and settings,\n"
    "every step's logits (their hash chain) and token compared (docs/REPRODUCIBILITY.md).\n"
    "Exit 0: identical; 1: a difference (the first one is named) or a failure; 2: a usage\n"
    "error or a malformed receipt.\n\n"
    "  -m, --model MODEL      .gguf file or Hugging Face folder holding the receipt's weights\n"
    "      --device D         cpu (default), cuda or cuda:N: where to run it again\n"
    "  -t, --threads N        CPU threads (default: all cores)\n";

typedef struct verify_opts {
    const char *receipt, *model;
    int device;
    long threads;
} verify_opts;

static int verify_parse(int argc, char **argv, verify_opts *o, int *code) {
    memset(o, 0, sizeof *o);
    o->device = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = NULL;
        int err = 0;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(verify_help, stdout);
            *code = 0;
            return 1;
        } else if (cli_opt(argc, argv, &i, "-m", &v, &err, "verify") ||
                   cli_opt(argc, argv, &i, "--model", &v, &err, "verify")) {
            o->model = v;
        } else if (cli_opt(argc, argv, &i, "--device", &v, &err, "verify")) {
            if (!err) err = cli_parse_device("verify", v, &o->device);
        } else if (cli_opt(argc, argv, &i, "-t", &v, &err, "verify") ||
                   cli_opt(argc, argv, &i, "--threads", &v, &err, "verify")) {
            if (!err) err = cli_parse_int("verify", a, v, 1, 256, &o->threads);
        } else if (a[0] != '-' && !o->receipt) {
            o->receipt = a;
        } else if (a[0] != '-') {
            err = cli_usage_error(
                "verify", "unexpected argument '%s' (the receipt is '%s'; the model goes after -m)",
                a, o->receipt);
        } else {
            err = cli_usage_error("verify", "unknown option '%s'", a);
        }
        if (err) {
            *code = 2;
            return 1;
        }
    }
    if (!o->receipt || !o->model) {
        *code = cli_usage_error(
            "verify", "a receipt and a model are required (kiln verify RECEIPT -m MODEL)");
        return 1;
    }
    return 0;
}

/* A fingerprint of the model against the receipt's: 0, or 1 with both printed. */
static int compare_fp(const char *what, const uint8_t got[32], const uint8_t want[32],
                      const char *model) {
    if (!memcmp(got, want, 32)) return 0;
    char a[65], b[65];
    kiln_sha256_hex(want, a);
    kiln_sha256_hex(got, b);
    printf("fingerprint mismatch: the receipt's %s is %s, that of %s is %s: not the %s the receipt "
           "was made with\n",
           what, a, model, b, strcmp(what, "model") ? "tokenizer" : "weights");
    return 1;
}

/* The prompt text, where the receipt keeps it, must give its ids with this tokenizer. */
static int check_prompt(const receipt *r, const kiln_tokenizer *tok) {
    if (!r->prompt_text) return 0;
    kiln_chat_message msgs[2];
    size_t n_msgs = 0;
    if (r->system) msgs[n_msgs++] = (kiln_chat_message){"system", r->system};
    msgs[n_msgs++] = (kiln_chat_message){"user", r->prompt_text};
    int32_t *ids = NULL;
    size_t n = 0;
    kiln_status st = cli_encode_prompt(tok, r->prompt_text, r->chat, msgs, n_msgs, &ids, &n);
    if (st != KILN_OK) return cli_fail("verify", "the receipt's prompt text", st);
    size_t at = 0;
    while (at < n && at < r->n_prompt && ids[at] == r->prompt_ids[at])
        at++;
    free(ids);
    if (at == n && n == r->n_prompt) return 0;
    printf("prompt mismatch: the receipt's prompt text does not give its prompt ids with this "
           "model's tokenizer%s (%zu tokens against %zu, the first difference at index %zu)\n",
           r->chat ? " and chat template" : "", n, r->n_prompt, at);
    return 1;
}

/* Token id's text, quoted with C escapes for control bytes, into buf. */
static const char *token_text(const kiln_tokenizer *tok, int32_t id, char *buf, size_t cap) {
    char raw[64];
    size_t n = 0;
    if (kiln_token_to_bytes(tok, id, 1, raw, sizeof raw, &n) != KILN_OK) n = 0;
    size_t o = 0;
    buf[o++] = '"';
    for (size_t i = 0; i < n && o + 6 < cap; i++) {
        unsigned char ch = (unsigned char)raw[i];
        if (ch == '\n')
            o += (size_t)snprintf(buf + o, cap - o, "\\n");
        else if (ch == '"' || ch == '\\')
            o += (size_t)snprintf(buf + o, cap - o, "\\%c", ch);
        else if (ch < 0x20 || ch == 0x7f)
            o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", ch);
        else
            buf[o++] = (char)ch;
    }
    snprintf(buf + o, cap - o, "\"");
    return buf;
}

/* The re-run against the receipt: 0 identical, else 1 with the first difference printed. */
static int compare_run(const receipt *r, const kiln_generate_result *g, uint8_t (*chain)[32],
                       const kiln_tokenizer *tok, const char *where) {
    size_t n = g->n_ids < r->n_ids ? g->n_ids : r->n_ids;
    char a[160], b[160];
    for (size_t k = 0; k < n; k++) {
        int logits_same = !memcmp(chain[k + 1], r->chain[k + 1], 32);
        int token_same = g->ids[k] == r->ids[k];
        if (logits_same && token_same) continue;
        printf("differs at step %zu of %zu (steps before it identical): ", k, r->n_ids);
        if (!logits_same)
            printf("the logits differ (logits_chain[%zu]); token: receipt %d %s, this run %d %s\n",
                   k + 1, r->ids[k], token_text(tok, r->ids[k], a, sizeof a), g->ids[k],
                   token_text(tok, g->ids[k], b, sizeof b));
        else
            printf("the token differs with the same logits: receipt %d %s, this run %d %s (the "
                   "receipt's token is not the one its settings draw from these logits)\n",
                   r->ids[k], token_text(tok, r->ids[k], a, sizeof a), g->ids[k],
                   token_text(tok, g->ids[k], b, sizeof b));
        return 1;
    }
    if (g->n_ids != r->n_ids) {
        printf("differs after step %zu: the receipt has %zu tokens (stop: %s), "
               "this run %zu (stop: %s)\n",
               n ? n - 1 : 0, r->n_ids, r->stop_reason, g->n_ids, g->stop_reason);
        return 1;
    }
    if (strcmp(g->stop_reason, r->stop_reason) != 0) {
        printf("differs at the end: every token and logits row matches, but the receipt "
               "stopped on '%s' and this run on '%s'\n",
               r->stop_reason, g->stop_reason);
        return 1;
    }
    printf("identical: %zu steps (every step's logits and token as in the receipt; %s)\n", r->n_ids,
           where);
    return 0;
}

static int verify_run(const verify_opts *o, const receipt *r, kiln_model *m) {
    kiln_model_info mi;
    uint8_t mfp[32], tfp[32];
    const kiln_tokenizer *tok = kiln_model_get_tokenizer(m);
    kiln_status st = kiln_model_get_info(m, &mi);
    if (st == KILN_OK) st = kiln_model_fingerprint(m, mfp);
    if (st == KILN_OK) st = kiln_tokenizer_fingerprint(tok, tfp);
    if (st != KILN_OK) return cli_fail("verify", o->model, st);
    if (compare_fp("model", mfp, r->model_fp, o->model) ||
        compare_fp("tokenizer", tfp, r->tokenizer_fp, o->model))
        return 1;
    if (mi.n_vocab != r->n_vocab) {
        printf("model mismatch: %s has %d logits a row, the receipt %d\n", o->model, mi.n_vocab,
               r->n_vocab);
        return 1;
    }
    if (check_prompt(r, tok)) return 1;
    char dev[32], rdev[32], where[96];
    receipt_device_name(o->device, dev, sizeof dev);
    receipt_device_name(r->device, rdev, sizeof rdev);
    const char *mode = r->fast ? "fast" : "auditable";
    if (o->device >= 0)
        snprintf(where, sizeof where, "%s, %s arithmetic", dev, mode);
    else if (o->threads)
        snprintf(where, sizeof where, "cpu, %ld thread%s, %s arithmetic", o->threads,
                 o->threads == 1 ? "" : "s", mode);
    else
        snprintf(where, sizeof where, "cpu, all cores, %s arithmetic", mode);
    if (r->fast && (o->device < 0) != (r->device < 0))
        fprintf(stderr,
                "kiln verify: warning: the receipt was made in fast arithmetic on %s; fast "
                "arithmetic is not expected to give the same bits on %s\n",
                rdev, dev);
    kiln_context_params cp = kiln_context_default_params();
    cp.n_ctx = r->n_ctx;
    cp.n_batch = r->n_batch;
    cp.n_threads = (int)o->threads;
    cp.device = o->device;
    cp.fast = r->fast;
    cp.batch_invariant = r->batch_invariant;
    cp.format = r->format;
    cp.format_rules = r->format_rules;
    kiln_context *ctx = NULL;
    st = kiln_context_create(m, &cp, &ctx);
    if (st != KILN_OK) return cli_fail("verify", "context", st);
    uint8_t(*chain)[32] = malloc(32 * ((size_t)r->max_tokens + 1));
    if (!chain) {
        kiln_context_free(ctx);
        fprintf(stderr, "kiln verify: out of memory\n");
        return 1;
    }
    kiln_generate_params gp = kiln_generate_default_params();
    gp.max_tokens = r->max_tokens;
    gp.sampler = r->sampler;
    gp.stop_strings = r->n_stops ? (const char *const *)r->stops : NULL;
    gp.ignore_eos = r->ignore_eos;
    gp.logits_chain = &chain[0][0];
    kiln_generate_result g;
    st = kiln_generate(ctx, r->prompt_ids, r->n_prompt, &gp, &g);
    int rc;
    if (st != KILN_OK) {
        rc = cli_fail("verify", "generation", st);
    } else {
        rc = compare_run(r, &g, chain, tok, where);
        kiln_generate_result_free(&g);
    }
    free(chain);
    kiln_context_free(ctx);
    return rc;
}

int cmd_verify(int argc, char **argv) {
    verify_opts o;
    int code = 0;
    if (verify_parse(argc, argv, &o, &code)) return code;
    receipt r;
    if (receipt_read("verify", o.receipt, &r)) return 2;
    kiln_model_params mp = kiln_model_default_params();
    mp.n_threads = (int)o.threads;
    mp.weight_mode = r.weights_f32 ? KILN_WEIGHTS_F32 : KILN_WEIGHTS_AUTO;
    kiln_model *m = NULL;
    kiln_status st = kiln_model_open(o.model, &mp, &m);
    int rc = st == KILN_OK ? verify_run(&o, &r, m) : cli_fail("verify", o.model, st);
    kiln_model_close(m);
    receipt_free(&r);
    return rc;
}
