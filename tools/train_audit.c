/* train_audit.c -- the training audit log (train_audit.h): writing, verifying, replaying. */
#include "train_audit.h"

#include "base/sha256.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define HASH_KEY ",\"hash\":\""

typedef struct audit_rec {
    long step;
    uint8_t batch[32], params[32];
    uint64_t loss, lr;
    uint32_t grad_norm;
} audit_rec;

struct train_audit {
    int replay;
    FILE *f;              /* write mode: the log, appended to */
    char hash[65];        /* the last line's hash (hex) */
    audit_rec *recs;      /* replay mode: the step records, in order */
    long n_recs;
    int argc;             /* replay mode: the header's command line */
    char **argv;
    char *cwd;
};

static uint64_t double_bits(double x) {
    uint64_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static uint32_t float_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

/* Appends `prefix,"hash":"H"}\n` to f, H = SHA-256(prefix); hash_hex gets H. 0 or 1. */
static int write_line(FILE *f, const char *prefix, char hash_hex[65]) {
    uint8_t h[32];
    if (kiln_sha256(prefix, strlen(prefix), h) != 0) return 1;
    kiln_sha256_hex(h, hash_hex);
    if (fprintf(f, "%s" HASH_KEY "%s\"}\n", prefix, hash_hex) < 0 || fflush(f) != 0) return 1;
    return 0;
}

/* The log's most bytes (a million steps of about 400 bytes each, with room). */
#define AUDIT_MAX_BYTES ((size_t)1 << 30)

static int hex_field(const cJSON *o, const char *key, uint8_t out[32]) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) && kiln_sha256_from_hex(v->valuestring, out);
}

static int bits_field(const cJSON *o, const char *key, int digits, uint64_t *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsString(v) || strncmp(v->valuestring, "0x", 2) || (int)strlen(v->valuestring) != 2 + digits) return 0;
    char *end;
    *out = strtoull(v->valuestring + 2, &end, 16);
    return *end == 0;
}

/* Verifies the chain of the log in buf (len bytes): every line's hash and link. On success the
 * header's command line and the step records go into a (either may be NULL), *keep gets the
 * byte length of the lines up to and including the record of step keep_step (or the header
 * when keep_step is 0; -1 when there is no such record), and *last_hash that line's hash.
 * Prints the first broken line (naming path) and returns 1 otherwise. */
static int parse_log(const char *path, const char *buf, size_t len, train_audit *a, long keep_step, long *keep,
                     char last_hash[65]) {
    char prev[65];
    memset(prev, '0', 64);
    prev[64] = 0;
    long line_no = 0, last_step = 0;
    if (keep) *keep = -1;
    size_t pos = 0;
    while (pos < len) {
        const char *line = buf + pos, *nl = memchr(line, '\n', len - pos);
        if (!nl) {
            fprintf(stderr, "%s: line %ld: cut short (no newline): the log was damaged\n", path, line_no + 1);
            return 1;
        }
        size_t n = (size_t)(nl - line);
        line_no++;
        /* the hash: SHA-256 of the bytes before ,"hash":" */
        const char *hk = NULL;
        for (const char *p = line; p + sizeof HASH_KEY - 1 <= nl; p++)
            if (!memcmp(p, HASH_KEY, sizeof HASH_KEY - 1)) hk = p;
        if (!hk || nl - hk != (long)(sizeof HASH_KEY - 1) + 64 + 2 || memcmp(nl - 2, "\"}", 2)) {
            fprintf(stderr, "%s: line %ld: not an audit record (no hash at its end)\n", path, line_no);
            return 1;
        }
        uint8_t h[32];
        char hex[65];
        if (kiln_sha256(line, (size_t)(hk - line), h) != 0) return 1;
        kiln_sha256_hex(h, hex);
        if (memcmp(hex, hk + sizeof HASH_KEY - 1, 64)) {
            fprintf(stderr, "%s: line %ld: its hash does not match its contents: the record was changed\n", path,
                    line_no);
            return 1;
        }
        char *text = malloc(n + 1);
        if (!text) return 1;
        memcpy(text, line, n);
        text[n] = 0;
        cJSON *o = cJSON_Parse(text);
        free(text);
        const cJSON *pv = o ? cJSON_GetObjectItemCaseSensitive(o, "prev") : NULL;
        int bad = 0;
        if (!o || !cJSON_IsString(pv) || strcmp(pv->valuestring, prev)) {
            fprintf(stderr, "%s: line %ld: %s\n", path, line_no,
                    !o ? "not JSON" : "its prev is not the hash of the line before: records were removed, added or reordered");
            bad = 1;
        } else if (line_no == 1) {
            const cJSON *kind = cJSON_GetObjectItemCaseSensitive(o, "kind"), *ver = cJSON_GetObjectItemCaseSensitive(o, "version");
            const cJSON *av = cJSON_GetObjectItemCaseSensitive(o, "argv"), *cwd = cJSON_GetObjectItemCaseSensitive(o, "cwd");
            const cJSON *start = cJSON_GetObjectItemCaseSensitive(o, "start");
            if (!cJSON_IsString(kind) || strcmp(kind->valuestring, "kiln-train-audit") || !cJSON_IsNumber(ver) ||
                ver->valuedouble != 1 || !cJSON_IsArray(av) || !cJSON_IsString(cwd) || !cJSON_IsNumber(start)) {
                fprintf(stderr, "%s: line 1: not a kiln training audit header (version 1)\n", path);
                bad = 1;
            } else {
                last_step = (long)start->valuedouble;
                if (a) {
                    a->argc = cJSON_GetArraySize(av);
                    a->argv = calloc((size_t)a->argc + 1, sizeof *a->argv);
                    a->cwd = strdup(cwd->valuestring);
                    bad = !a->argv || !a->cwd;
                    for (int i = 0; !bad && i < a->argc; i++) {
                        const cJSON *s = cJSON_GetArrayItem(av, i);
                        bad = !cJSON_IsString(s) || !(a->argv[i] = strdup(s->valuestring));
                    }
                    if (bad) fprintf(stderr, "%s: line 1: a bad command line\n", path);
                }
            }
        } else {
            audit_rec r;
            uint64_t g = 0;
            const cJSON *st = cJSON_GetObjectItemCaseSensitive(o, "step");
            if (!cJSON_IsNumber(st) || !hex_field(o, "batch", r.batch) || !hex_field(o, "params", r.params) ||
                !bits_field(o, "loss", 16, &r.loss) || !bits_field(o, "lr", 16, &r.lr) ||
                !bits_field(o, "grad_norm", 8, &g)) {
                fprintf(stderr, "%s: line %ld: not a step record\n", path, line_no);
                bad = 1;
            } else if ((r.step = (long)st->valuedouble) != last_step + 1) {
                fprintf(stderr, "%s: line %ld: step %ld follows step %ld\n", path, line_no, r.step, last_step);
                bad = 1;
            } else {
                r.grad_norm = (uint32_t)g;
                last_step = r.step;
                if (a) {
                    audit_rec *nr = realloc(a->recs, (size_t)(a->n_recs + 1) * sizeof *nr);
                    if (!nr) bad = 1;
                    else (a->recs = nr)[a->n_recs++] = r;
                }
            }
        }
        cJSON_Delete(o);
        if (bad) return 1;
        memcpy(prev, hex, 65);
        pos += n + 1;
        if (keep && last_step == keep_step && *keep < 0) {
            *keep = (long)pos;
            memcpy(last_hash, hex, 65);
        }
    }
    if (line_no == 0) {
        fprintf(stderr, "%s: empty: no audit header\n", path);
        return 1;
    }
    if (!keep && last_hash) memcpy(last_hash, prev, 65);
    return 0;
}

int audit_open_write(const char *path, long start, int argc, char **argv, const uint8_t params0[32],
                     train_audit **out) {
    train_audit *a = calloc(1, sizeof *a);
    if (!a) return 1;
    if (start == 0) { /* a new run: a new log, the header first */
        a->f = fopen(path, "wb");
        if (!a->f) {
            fprintf(stderr, "kiln train: %s: %s\n", path, strerror(errno));
            free(a);
            return 1;
        }
        cJSON *h = cJSON_CreateObject(), *av = cJSON_CreateArray();
        char cwd[4096], p0[65], zeros[65];
        kiln_sha256_hex(params0, p0);
        memset(zeros, '0', 64);
        zeros[64] = 0;
        int ok = h && av && getcwd(cwd, sizeof cwd);
        for (int i = 0; ok && i < argc; i++) ok = cJSON_AddItemToArray(av, cJSON_CreateString(argv[i]));
        ok = ok && cJSON_AddStringToObject(h, "kind", "kiln-train-audit") && cJSON_AddNumberToObject(h, "version", 1) &&
             cJSON_AddStringToObject(h, "cwd", cwd) && cJSON_AddItemToObject(h, "argv", av);
        if (!ok) cJSON_Delete(av);
        ok = ok && cJSON_AddNumberToObject(h, "start", 0) && cJSON_AddStringToObject(h, "params", p0) &&
             cJSON_AddStringToObject(h, "prev", zeros);
        char *text = ok ? cJSON_PrintUnformatted(h) : NULL;
        cJSON_Delete(h);
        if (text) text[strlen(text) - 1] = 0; /* the closing brace: the hash goes before it */
        int bad = !text || write_line(a->f, text, a->hash);
        free(text);
        if (bad) {
            fprintf(stderr, "kiln train: %s: cannot write the audit header\n", path);
            audit_close(a);
            return 1;
        }
        *out = a;
        return 0;
    }
    /* resuming at step start: the log verified and cut after that step's record */
    size_t len = 0;
    char *buf = NULL;
    if (kiln_read_text_file(path, AUDIT_MAX_BYTES, &buf, &len) != KILN_OK) {
        fprintf(stderr, "kiln train: --audit: %s (the run to resume kept no audit log)\n", kiln_last_error());
        free(a);
        return 1;
    }
    long keep = -1;
    int bad = parse_log(path, buf, len, NULL, start, &keep, a->hash);
    if (!bad && keep < 0) {
        fprintf(stderr, "kiln train: --audit: %s has no record of step %ld, where the run resumes\n", path, start);
        bad = 1;
    }
    if (!bad) { /* rewrite the kept lines atomically, then append */
        char tmp[4200];
        snprintf(tmp, sizeof tmp, "%s.tmp", path);
        FILE *f = fopen(tmp, "wb");
        bad = !f || fwrite(buf, 1, (size_t)keep, f) != (size_t)keep || fflush(f) || fsync(fileno(f));
        if (f && fclose(f)) bad = 1;
        if (!bad && rename(tmp, path)) bad = 1;
        if (bad) fprintf(stderr, "kiln train: --audit: cannot rewrite %s: %s\n", path, strerror(errno));
        if (!bad && !(a->f = fopen(path, "ab"))) bad = 1;
    }
    kiln_free(buf);
    if (bad) {
        audit_close(a);
        return 1;
    }
    *out = a;
    return 0;
}

int audit_open_replay(const char *path, train_audit **out) {
    train_audit *a = calloc(1, sizeof *a);
    if (!a) return 1;
    a->replay = 1;
    size_t len = 0;
    char *buf = NULL;
    if (kiln_read_text_file(path, AUDIT_MAX_BYTES, &buf, &len) != KILN_OK) {
        fprintf(stderr, "kiln audit: %s\n", kiln_last_error());
        free(a);
        return 1;
    }
    int bad = parse_log(path, buf, len, a, 0, NULL, a->hash);
    kiln_free(buf);
    if (bad) {
        audit_close(a);
        return 1;
    }
    *out = a;
    return 0;
}

void audit_command(const train_audit *a, int *argc, char ***argv, const char **cwd) {
    *argc = a->argc;
    *argv = a->argv;
    *cwd = a->cwd;
}

void audit_steps(const train_audit *a, long *first, long *last) {
    *first = a->n_recs ? a->recs[0].step : 0;
    *last = a->n_recs ? a->recs[a->n_recs - 1].step : 0;
}

int audit_record(train_audit *a, const audit_step *s) {
    if (!a->replay) {
        char b[65], p[65], prefix[512];
        kiln_sha256_hex(s->batch, b);
        kiln_sha256_hex(s->params, p);
        snprintf(prefix, sizeof prefix,
                 "{\"step\":%ld,\"batch\":\"%s\",\"loss\":\"0x%016llx\",\"grad_norm\":\"0x%08x\",\"lr\":\"0x%016llx\","
                 "\"params\":\"%s\",\"prev\":\"%s\"",
                 s->step, b, (unsigned long long)double_bits(s->loss), (unsigned)float_bits(s->grad_norm),
                 (unsigned long long)double_bits(s->lr), p, a->hash);
        if (write_line(a->f, prefix, a->hash)) {
            fprintf(stderr, "kiln train: cannot append to the audit log: %s\n", strerror(errno));
            return 1;
        }
        return 0;
    }
    /* the records are consecutive steps (parse_log checks it) */
    long i = a->n_recs ? s->step - a->recs[0].step : -1;
    const audit_rec *r = i >= 0 && i < a->n_recs ? &a->recs[i] : NULL;
    if (!r) {
        fprintf(stderr, "kiln audit: the log has no record of step %ld\n", s->step);
        return 1;
    }
    int diff = 0;
    if (memcmp(r->batch, s->batch, 32)) fprintf(stderr, "  batch: the step's token ids differ\n"), diff = 1;
    if (r->loss != double_bits(s->loss))
        fprintf(stderr, "  loss: logged 0x%016llx, replayed 0x%016llx (%.9g)\n", (unsigned long long)r->loss,
                (unsigned long long)double_bits(s->loss), s->loss),
            diff = 1;
    if (r->grad_norm != float_bits(s->grad_norm))
        fprintf(stderr, "  grad_norm: logged 0x%08x, replayed 0x%08x (%.9g)\n", (unsigned)r->grad_norm,
                (unsigned)float_bits(s->grad_norm), (double)s->grad_norm),
            diff = 1;
    if (r->lr != double_bits(s->lr)) fprintf(stderr, "  lr: the learning rate differs\n"), diff = 1;
    if (memcmp(r->params, s->params, 32)) fprintf(stderr, "  params: the weights after the step differ\n"), diff = 1;
    return diff;
}

void audit_close(train_audit *a) {
    if (!a) return;
    if (a->f) {
        fsync(fileno(a->f));
        fclose(a->f);
    }
    for (int i = 0; a->argv && i < a->argc; i++) free(a->argv[i]);
    free(a->argv);
    free(a->cwd);
    free(a->recs);
    free(a);
}
