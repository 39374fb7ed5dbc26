/* receipt.c -- a generation receipt to and from JSON (docs/REPRODUCIBILITY.md, "Receipts"). */
#include "receipt.h"
#include "base/sha256.h"
#include "cli.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void receipt_free(receipt *r) {
    if (!r) return;
    free(r->kiln_version);
    free(r->model_path);
    free(r->model_name);
    free(r->architecture);
    free(r->prompt_text);
    free(r->system);
    free(r->prompt_ids);
    for (int i = 0; i < r->n_stops; i++)
        free(r->stops[i]);
    free(r->ids);
    free(r->text);
    free(r->stop_reason);
    free(r->format_rules);
    free(r->chain);
    memset(r, 0, sizeof *r);
}

const char *receipt_device_name(int device, char *buf, size_t cap) {
    if (device < 0)
        snprintf(buf, cap, "cpu");
    else
        snprintf(buf, cap, "cuda:%d", device);
    return buf;
}

/* ---- writing ------------------------------------------------------------------------------- */

/* Whether s is valid UTF-8 (JSON text must be). */
static int utf8_valid(const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        unsigned c = *p;
        int n = c < 0x80 ? 0 : (c >> 5) == 6 ? 1 : (c >> 4) == 14 ? 2 : (c >> 3) == 30 ? 3 : -1;
        if (n < 0 || (n == 1 && c < 0xc2) || (n == 3 && c > 0xf4)) return 0;
        unsigned cp = n ? c & (0x3f >> n) : c;
        for (int k = 1; k <= n; k++) {
            if ((p[k] & 0xc0) != 0x80) return 0;
            cp = cp << 6 | (p[k] & 0x3f);
        }
        if ((n == 2 && cp < 0x800) || (n == 3 && (cp < 0x10000 || cp > 0x10ffff)) ||
            (cp >= 0xd800 && cp <= 0xdfff))
            return 0;
        p += n + 1;
    }
    return 1;
}

static void add_hex(cJSON *o, const char *key, const uint8_t d[32]) {
    char hex[65];
    kiln_sha256_hex(d, hex);
    cJSON_AddStringToObject(o, key, hex);
}

/* f as the shortest decimal that reads back (through a double, as cJSON reads numbers) as
 * the same float. */
static void add_float(cJSON *o, const char *key, float f) {
    char buf[64];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, (double)f);
        if ((float)strtod(buf, NULL) == f) break;
    }
    cJSON_AddRawToObject(o, key, buf);
}

static void add_ids(cJSON *o, const char *key, const int32_t *ids, size_t n) {
    cJSON *a = cJSON_AddArrayToObject(o, key);
    for (size_t i = 0; i < n; i++)
        cJSON_AddItemToArray(a, cJSON_CreateNumber(ids[i]));
}

/* A text field: the string when it is UTF-8, else null and key_omitted saying why. */
static void add_text(cJSON *o, const char *key, const char *s) {
    if (!s) {
        cJSON_AddNullToObject(o, key);
    } else if (utf8_valid(s)) {
        cJSON_AddStringToObject(o, key, s);
    } else {
        char k[64];
        cJSON_AddNullToObject(o, key);
        snprintf(k, sizeof k, "%s_omitted", key);
        cJSON_AddStringToObject(o, k, "not valid UTF-8");
    }
}

static cJSON *receipt_json(const receipt *r) {
    char dev[32];
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "format", RECEIPT_FORMAT);
    cJSON_AddNumberToObject(root, "version", RECEIPT_VERSION);
    cJSON_AddStringToObject(root, "kiln_version",
                            r->kiln_version ? r->kiln_version : kiln_version());

    cJSON *m = cJSON_AddObjectToObject(root, "model");
    add_hex(m, "fingerprint", r->model_fp);
    add_hex(m, "tokenizer_fingerprint", r->tokenizer_fp);
    cJSON_AddNumberToObject(m, "n_vocab", r->n_vocab);
    add_text(m, "architecture", r->architecture);
    add_text(m, "name", r->model_name);
    add_text(m, "path", r->model_path);

    cJSON *p = cJSON_AddObjectToObject(root, "prompt");
    add_text(p, "text", r->prompt_text);
    cJSON_AddBoolToObject(p, "chat", r->chat);
    add_text(p, "system", r->system);
    add_ids(p, "ids", r->prompt_ids, r->n_prompt);

    cJSON *s = cJSON_AddObjectToObject(root, "settings");
    cJSON_AddNumberToObject(s, "max_tokens", r->max_tokens);
    add_float(s, "temperature", r->sampler.temperature);
    cJSON_AddNumberToObject(s, "top_k", r->sampler.top_k);
    add_float(s, "top_p", r->sampler.top_p);
    add_float(s, "min_p", r->sampler.min_p);
    add_float(s, "repeat_penalty", r->sampler.repeat_penalty);
    cJSON_AddNumberToObject(s, "repeat_last_n", r->sampler.repeat_last_n);
    char seed[32];
    snprintf(seed, sizeof seed, "%llu",
             (unsigned long long)r->sampler.seed); /* a string: 64 bits */
    cJSON_AddStringToObject(s, "seed", seed);
    cJSON *stops = cJSON_AddArrayToObject(s, "stop");
    for (int i = 0; i < r->n_stops; i++)
        cJSON_AddItemToArray(stops, cJSON_CreateString(r->stops[i]));
    cJSON_AddBoolToObject(s, "ignore_eos", r->ignore_eos);
    cJSON_AddNumberToObject(s, "n_ctx", r->n_ctx);
    cJSON_AddNumberToObject(s, "n_batch", r->n_batch);
    cJSON_AddBoolToObject(s, "weights_f32", r->weights_f32);

    cJSON *a = cJSON_AddObjectToObject(root, "arithmetic");
    cJSON_AddStringToObject(a, "mode", r->fast ? "fast" : "auditable");
    cJSON_AddBoolToObject(a, "batch_invariant", r->batch_invariant);
    const size_t spec_cap = (r->format_rules ? strlen(r->format_rules) : 0) + 8; /* "mx16," + rules + NUL */
    char *spec = malloc(spec_cap);
    if (spec) cli_format_spec(r->format, r->format_rules, spec, spec_cap);
    cJSON_AddStringToObject(a, "format", spec ? spec : "?");
    free(spec);
    cJSON_AddStringToObject(a, "device", receipt_device_name(r->device, dev, sizeof dev));
    cJSON_AddNumberToObject(a, "threads", r->threads);
    cJSON_AddBoolToObject(a, "verifies_across_devices", !r->fast);
    cJSON_AddStringToObject(
        a, "note",
        r->fast ? "fast arithmetic: deterministic on the device that made it, but not "
                  "expected to verify on another device or kind of device"
                : "auditable arithmetic: the same bits on the CPU and the GPU, for "
                  "any thread count");

    cJSON *o = cJSON_AddObjectToObject(root, "output");
    add_ids(o, "ids", r->ids, r->n_ids);
    add_text(o, "text", r->text);
    cJSON_AddStringToObject(o, "stop_reason", r->stop_reason ? r->stop_reason : "");

    cJSON *chain = cJSON_AddArrayToObject(root, "logits_chain");
    for (size_t i = 0; i <= r->n_ids; i++) {
        char hex[65];
        kiln_sha256_hex(r->chain[i], hex);
        cJSON_AddItemToArray(chain, cJSON_CreateString(hex));
    }
    return root;
}

char *receipt_json_text(const receipt *r) {
    cJSON *root = receipt_json(r);
    char *text = root ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    return text;
}

int receipt_write(const char *cmd, const char *path, const receipt *r) {
    cJSON *root = receipt_json(r);
    char *text = root ? cJSON_Print(root) : NULL;
    cJSON_Delete(root);
    if (!text) {
        fprintf(stderr, "kiln %s: out of memory writing the receipt\n", cmd);
        return 1;
    }
    size_t n = strlen(text);
    size_t tl = strlen(path) + 32;
    char *tmp = malloc(tl);
    if (!tmp) {
        free(text);
        fprintf(stderr, "kiln %s: out of memory writing the receipt\n", cmd);
        return 1;
    }
    snprintf(tmp, tl, "%s.tmp-%ld", path, (long)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int ok = fd >= 0;
    const char *what = "create";
    for (size_t done = 0; ok && done < n;) {
        ssize_t w = write(fd, text + done, n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0)
            ok = 0, what = "write";
        else
            done += (size_t)w;
    }
    if (ok && (write(fd, "\n", 1) != 1 || fsync(fd) != 0)) ok = 0, what = "write";
    if (fd >= 0 && close(fd) != 0 && ok) ok = 0, what = "close";
    if (ok && rename(tmp, path) != 0) ok = 0, what = "rename";
    int e = errno;
    free(text);
    if (!ok) {
        unlink(tmp);
        fprintf(stderr, "kiln %s: cannot %s the receipt '%s': %s\n", cmd, what, path, strerror(e));
    }
    free(tmp);
    return ok ? 0 : 1;
}

/* ---- reading ------------------------------------------------------------------------------- */

typedef struct rd {
    const char *cmd, *path;
} rd;

static int bad(const rd *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int bad(const rd *c, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "kiln %s: %s: ", c->cmd, c->path);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return 2;
}

static int get_obj(const rd *c, const cJSON *o, const char *key, const cJSON **out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsObject(v)) return bad(c, "\"%s\" must be an object", key);
    *out = v;
    return 0;
}

static int get_int(const rd *c, const cJSON *o, const char *obj, const char *key, double lo,
                   double hi, int *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < lo ||
        v->valuedouble > hi)
        return bad(c, "%s.%s must be an integer in [%.0f, %.0f]", obj, key, lo, hi);
    *out = (int)v->valuedouble;
    return 0;
}

static int get_float(const rd *c, const cJSON *o, const char *obj, const char *key, double lo,
                     double hi, float *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= lo && v->valuedouble <= hi))
        return bad(c, "%s.%s must be a number in [%g, %g]", obj, key, lo, hi);
    *out = (float)v->valuedouble;
    return 0;
}

static int get_bool(const rd *c, const cJSON *o, const char *obj, const char *key, int *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsBool(v)) return bad(c, "%s.%s must be true or false", obj, key);
    *out = cJSON_IsTrue(v);
    return 0;
}

/* A string (copied to *out), or with nullable also null (*out NULL). */
static int get_str(const rd *c, const cJSON *o, const char *obj, const char *key, int nullable,
                   char **out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    *out = NULL;
    if (nullable && (!v || cJSON_IsNull(v))) return 0;
    if (!cJSON_IsString(v))
        return bad(c, "%s.%s must be a string%s", obj, key, nullable ? " or null" : "");
    *out = strdup(v->valuestring);
    if (!*out) return bad(c, "out of memory");
    return 0;
}

static int get_hex(const rd *c, const cJSON *o, const char *obj, const char *key, uint8_t out[32]) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsString(v) || !kiln_sha256_from_hex(v->valuestring, out))
        return bad(c, "%s.%s must be a SHA-256 digest in hex (64 characters)", obj, key);
    return 0;
}

/* An array of token ids in [0, 2^31) (n_vocab bounds them later, against the model). */
static int get_ids(const rd *c, const cJSON *o, const char *obj, const char *key, int32_t **ids,
                   size_t *n) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsArray(v)) return bad(c, "%s.%s must be an array of token ids", obj, key);
    size_t cnt = (size_t)cJSON_GetArraySize(v);
    *ids = malloc((cnt ? cnt : 1) * sizeof(int32_t));
    if (!*ids) return bad(c, "out of memory");
    size_t i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
        if (!cJSON_IsNumber(e) || e->valuedouble != floor(e->valuedouble) || e->valuedouble < 0 ||
            e->valuedouble > 2147483647.0)
            return bad(c, "%s.%s[%zu] is not a token id", obj, key, i);
        (*ids)[i++] = (int32_t)e->valuedouble;
    }
    *n = cnt;
    return 0;
}

static int parse_device(const rd *c, const char *s, int *device) {
    if (!strcmp(s, "cpu")) {
        *device = -1;
        return 0;
    }
    char *end = NULL;
    long n = !strncmp(s, "cuda:", 5) && s[5] >= '0' && s[5] <= '9' ? strtol(s + 5, &end, 10) : -1;
    if (n < 0 || n >= 1024 || !end || *end)
        return bad(c, "arithmetic.device '%s' is neither cpu nor cuda:N", s);
    *device = (int)n;
    return 0;
}

static int parse_receipt(const rd *c, const cJSON *root, receipt *r) {
    if (!cJSON_IsObject(root)) return bad(c, "not a JSON object");
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(root, "format");
    if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, RECEIPT_FORMAT) != 0)
        return bad(c, "not a kiln receipt (its \"format\" is not \"%s\")", RECEIPT_FORMAT);
    const cJSON *ver = cJSON_GetObjectItemCaseSensitive(root, "version");
    if (!cJSON_IsNumber(ver)) return bad(c, "\"version\" must be a number");
    if (ver->valuedouble != RECEIPT_VERSION)
        return bad(c, "receipt version %g is unknown (this kiln reads version %d)",
                   ver->valuedouble, RECEIPT_VERSION);
    r->version = RECEIPT_VERSION;
    int e = 0;
    const cJSON *m = NULL, *p = NULL, *s = NULL, *a = NULL, *o = NULL;
    if ((e = get_str(c, root, "receipt", "kiln_version", 0, &r->kiln_version))) return e;
    if ((e = get_obj(c, root, "model", &m)) || (e = get_obj(c, root, "prompt", &p)) ||
        (e = get_obj(c, root, "settings", &s)) || (e = get_obj(c, root, "arithmetic", &a)) ||
        (e = get_obj(c, root, "output", &o)))
        return e;
    /* model */
    if ((e = get_hex(c, m, "model", "fingerprint", r->model_fp)) ||
        (e = get_hex(c, m, "model", "tokenizer_fingerprint", r->tokenizer_fp)) ||
        (e = get_int(c, m, "model", "n_vocab", 1, 2147483647.0, &r->n_vocab)) ||
        (e = get_str(c, m, "model", "architecture", 1, &r->architecture)) ||
        (e = get_str(c, m, "model", "name", 1, &r->model_name)) ||
        (e = get_str(c, m, "model", "path", 1, &r->model_path)))
        return e;
    /* prompt */
    if ((e = get_str(c, p, "prompt", "text", 1, &r->prompt_text)) ||
        (e = get_bool(c, p, "prompt", "chat", &r->chat)) ||
        (e = get_str(c, p, "prompt", "system", 1, &r->system)) ||
        (e = get_ids(c, p, "prompt", "ids", &r->prompt_ids, &r->n_prompt)))
        return e;
    if (!r->n_prompt) return bad(c, "prompt.ids is empty");
    if (r->system && !r->chat) return bad(c, "prompt.system is set but prompt.chat is false");
    /* settings */
    r->sampler = kiln_sampler_default_params();
    if ((e = get_int(c, s, "settings", "max_tokens", 0, 1 << 20, &r->max_tokens)) ||
        (e = get_float(c, s, "settings", "temperature", 0, 100, &r->sampler.temperature)) ||
        (e = get_int(c, s, "settings", "top_k", 0, 1 << 24, &r->sampler.top_k)) ||
        (e = get_float(c, s, "settings", "top_p", 1e-9, 1, &r->sampler.top_p)) ||
        (e = get_float(c, s, "settings", "min_p", 0, 1, &r->sampler.min_p)) ||
        (e = get_float(c, s, "settings", "repeat_penalty", 1e-3, 100,
                       &r->sampler.repeat_penalty)) ||
        (e = get_int(c, s, "settings", "repeat_last_n", -1, 1 << 24, &r->sampler.repeat_last_n)) ||
        (e = get_bool(c, s, "settings", "ignore_eos", &r->ignore_eos)) ||
        (e = get_int(c, s, "settings", "n_ctx", 1, 1 << 20, &r->n_ctx)) ||
        (e = get_int(c, s, "settings", "n_batch", 1, 1 << 16, &r->n_batch)) ||
        (e = get_bool(c, s, "settings", "weights_f32", &r->weights_f32)))
        return e;
    const cJSON *seed = cJSON_GetObjectItemCaseSensitive(s, "seed");
    char *end = NULL;
    errno = 0;
    if (!cJSON_IsString(seed) || seed->valuestring[0] < '0' || seed->valuestring[0] > '9' ||
        (r->sampler.seed = strtoull(seed->valuestring, &end, 10), errno) || *end)
        return bad(c, "settings.seed must be a string of decimal digits (a 64-bit integer)");
    const cJSON *stops = cJSON_GetObjectItemCaseSensitive(s, "stop"), *st;
    if (!cJSON_IsArray(stops) || cJSON_GetArraySize(stops) > RECEIPT_MAX_STOPS)
        return bad(c, "settings.stop must be an array of at most %d strings", RECEIPT_MAX_STOPS);
    cJSON_ArrayForEach(st, stops) {
        if (!cJSON_IsString(st) || !st->valuestring[0])
            return bad(c, "settings.stop holds something other than a non-empty string");
        if (!(r->stops[r->n_stops++] = strdup(st->valuestring))) return bad(c, "out of memory");
    }
    /* arithmetic */
    char *mode = NULL, *dev = NULL;
    if ((e = get_str(c, a, "arithmetic", "mode", 0, &mode))) return e;
    r->fast = !strcmp(mode, "fast");
    int known = r->fast || !strcmp(mode, "auditable");
    free(mode);
    if (!known) return bad(c, "arithmetic.mode must be \"auditable\" or \"fast\"");
    if ((e = get_bool(c, a, "arithmetic", "batch_invariant", &r->batch_invariant)) ||
        (e = get_int(c, a, "arithmetic", "threads", 0, 256, &r->threads)) ||
        (e = get_str(c, a, "arithmetic", "device", 0, &dev)))
        return e;
    e = parse_device(c, dev, &r->device);
    free(dev);
    if (e) return e;
    /* the products' format (absent in receipts made before formats existed: f32) */
    const cJSON *fmtj = cJSON_GetObjectItemCaseSensitive(a, "format");
    r->format = KILN_FORMAT_F32;
    if (fmtj) {
        const char *why = "not a string", *rules = NULL;
        if (!cJSON_IsString(fmtj) || cli_format_spec_split(fmtj->valuestring, &r->format, &rules, &why))
            return bad(c, "arithmetic.format: %s", why);
        if (rules && !(r->format_rules = strdup(rules))) return bad(c, "out of memory");
    }
    /* output */
    if ((e = get_ids(c, o, "output", "ids", &r->ids, &r->n_ids)) ||
        (e = get_str(c, o, "output", "text", 1, &r->text)) ||
        (e = get_str(c, o, "output", "stop_reason", 0, &r->stop_reason)))
        return e;
    if (r->n_ids > (size_t)r->max_tokens)
        return bad(c, "output.ids holds %zu tokens, more than settings.max_tokens %d", r->n_ids,
                   r->max_tokens);
    for (size_t i = 0; i < r->n_prompt; i++)
        if (r->prompt_ids[i] >= r->n_vocab)
            return bad(c, "prompt.ids[%zu] = %d is not below model.n_vocab %d", i, r->prompt_ids[i],
                       r->n_vocab);
    for (size_t i = 0; i < r->n_ids; i++)
        if (r->ids[i] >= r->n_vocab)
            return bad(c, "output.ids[%zu] = %d is not below model.n_vocab %d", i, r->ids[i],
                       r->n_vocab);
    /* the chain: one digest before the first token and one after each */
    const cJSON *chain = cJSON_GetObjectItemCaseSensitive(root, "logits_chain"), *h;
    if (!cJSON_IsArray(chain))
        return bad(c, "\"logits_chain\" must be an array of SHA-256 digests");
    size_t n_chain = (size_t)cJSON_GetArraySize(chain);
    if (n_chain != r->n_ids + 1)
        return bad(c,
                   "logits_chain holds %zu digests for %zu generated tokens: a receipt has one "
                   "more digest than tokens (c_0, then one per step)",
                   n_chain, r->n_ids);
    r->chain = malloc(n_chain * 32);
    if (!r->chain) return bad(c, "out of memory");
    size_t i = 0;
    cJSON_ArrayForEach(h, chain) {
        if (!cJSON_IsString(h) || !kiln_sha256_from_hex(h->valuestring, r->chain[i]))
            return bad(c, "logits_chain[%zu] is not a SHA-256 digest in hex", i);
        i++;
    }
    uint8_t c0[32];
    if (kiln_receipt_chain_start(r->model_fp, r->tokenizer_fp, r->prompt_ids, r->n_prompt, c0) !=
        KILN_OK)
        return bad(c, "%s", kiln_last_error());
    if (memcmp(c0, r->chain[0], 32) != 0)
        return bad(c, "logits_chain[0] is not the chain's start for this receipt's fingerprints "
                      "and prompt ids: the receipt is inconsistent (edited?)");
    return 0;
}

int receipt_read(const char *cmd, const char *path, receipt *r) {
    rd c = {cmd, path};
    memset(r, 0, sizeof *r);
    size_t len = 0;
    char *text = cli_read_file(cmd, path, CLI_READ_MAX, &len);
    if (!text) return 2;
    if (strlen(text) != len) {
        free(text);
        return bad(&c, "holds a NUL byte: not a JSON receipt");
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithOpts(text, &end, 1);
    int e;
    if (!root) {
        size_t at = end ? (size_t)(end - text) : 0;
        e = bad(&c, "malformed JSON (near byte %zu)", at);
    } else {
        e = parse_receipt(&c, root, r);
    }
    cJSON_Delete(root);
    free(text);
    if (e) receipt_free(r);
    return e;
}
