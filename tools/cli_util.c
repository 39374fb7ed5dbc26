/* cli_util.c -- argument parsing and error printing shared by the subcommands. */
#include "cli.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int cli_fail(const char *cmd, const char *what, kiln_status st) {
    const char *err = kiln_last_error();
    /* the library's messages usually begin with the path already: name it once */
    if (what && *what && !strstr(err, what)) fprintf(stderr, "kiln %s: %s: %s (%s)\n", cmd, what, err, kiln_status_string(st));
    else fprintf(stderr, "kiln %s: %s (%s)\n", cmd, err, kiln_status_string(st));
    return 1;
}

uint64_t cli_random_seed(void) {
    uint64_t s = 0;
    FILE *f = fopen("/dev/urandom", "rb");
    if (f) {
        size_t n = fread(&s, sizeof s, 1, f);
        fclose(f);
        if (n == 1) return s;
    }
    return (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32) ^ (uint64_t)clock();
}

int cli_usage_error(const char *cmd, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "kiln %s: ", cmd);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, " (see 'kiln %s --help')\n", cmd);
    return 2;
}

int cli_parse_int(const char *cmd, const char *opt, const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        cli_usage_error(cmd, "%s expects an integer in [%ld, %ld], got '%s'", opt, lo, hi, s);
        return 1;
    }
    *out = v;
    return 0;
}

int cli_parse_u64(const char *cmd, const char *opt, const char *s, unsigned long long *out) {
    char *end;
    errno = 0;
    if (*s == '-') {
        cli_usage_error(cmd, "%s expects a non-negative integer, got '%s'", opt, s);
        return 1;
    }
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end) {
        cli_usage_error(cmd, "%s expects a non-negative integer, got '%s'", opt, s);
        return 1;
    }
    *out = v;
    return 0;
}

int cli_parse_float(const char *cmd, const char *opt, const char *s, double lo, double hi,
                    double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi)) {
        cli_usage_error(cmd, "%s expects a number in [%g, %g], got '%s'", opt, lo, hi, s);
        return 1;
    }
    *out = v;
    return 0;
}

char *cli_read_file(const char *cmd, const char *path, size_t max_bytes, size_t *len) {
    int is_stdin = !strcmp(path, "-");
    FILE *f = is_stdin ? stdin : fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "kiln %s: cannot read '%s': %s\n", cmd, path, strerror(errno));
        return NULL;
    }
    /* Read at most max_bytes + 1 bytes: one byte past the limit proves the input too long
     * without reading the rest of it (/dev/zero, an endless pipe). */
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    int too_long = 0;
    while (buf) {
        if (n + 1 >= cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
        size_t want = cap - n - 1;
        if (want > max_bytes + 1 - n) want = max_bytes + 1 - n;
        size_t r = fread(buf + n, 1, want, f);
        n += r;
        if (n > max_bytes) {
            too_long = 1;
            break;
        }
        if (r == 0) break;
    }
    int bad = ferror(f);
    int e = errno;
    if (!is_stdin) fclose(f);
    if (!buf || bad || too_long) {
        if (!buf) fprintf(stderr, "kiln %s: '%s': out of memory reading it\n", cmd, path);
        else if (too_long)
            fprintf(stderr, "kiln %s: '%s' is longer than the %zu bytes allowed here\n", cmd, path, max_bytes);
        else fprintf(stderr, "kiln %s: cannot read '%s': %s\n", cmd, path, strerror(e));
        free(buf);
        return NULL;
    }
    buf[n] = '\0';
    if (len) *len = n;
    return buf;
}

int cli_opt(int argc, char **argv, int *i, const char *name, const char **val, int *err,
            const char *cmd) {
    if (strcmp(argv[*i], name) != 0) return 0;
    if (*i + 1 >= argc) {
        cli_usage_error(cmd, "option %s needs a value", name);
        *err = 1;
        return 1;
    }
    *val = argv[++*i];
    return 1;
}

/* --device: cpu -> -1, cuda -> 0, cuda:N -> N (N < 1024); else a usage error (exit code). */
int cli_parse_device(const char *cmd, const char *v, int *device) {
    if (!strcmp(v, "cpu")) {
        *device = -1;
        return 0;
    }
    if (!strcmp(v, "cuda")) {
        *device = 0;
        return 0;
    }
    if (!strncmp(v, "cuda:", 5) && v[5] >= '0' && v[5] <= '9') {
        char *end = NULL;
        long n = strtol(v + 5, &end, 10);
        if (*end == '\0' && n >= 0 && n < 1024) {
            *device = (int)n;
            return 0;
        }
    }
    return cli_usage_error(cmd, "--device '%s': expected cpu, cuda or cuda:N", v);
}

int cli_format_spec_split(const char *spec, int *format, const char **rules, const char **why) {
    const char *comma = strchr(spec, ',');
    const size_t n = comma ? (size_t)(comma - spec) : strlen(spec);
    *format = KILN_FORMAT_F32;
    *rules = NULL;
    if (memchr(spec, '=', n)) { /* rules only: the default is f32 */
        *rules = spec;
        return 0;
    }
    for (int f = KILN_FORMAT_F32; f <= KILN_FORMAT_MX8; f++)
        if (strlen(cli_format_name(f)) == n && !strncmp(spec, cli_format_name(f), n)) {
            *format = f;
            if (comma && !comma[1]) break;
            *rules = comma ? comma + 1 : NULL;
            return 0;
        }
    *why = "expected f32, mx16 or mx8, then optional SELECTOR=FORMAT rules (mx8,output=mx16,blk.0-3.ffn_down=f32)";
    return -1;
}

int cli_parse_format(const char *cmd, const char *v, int *format, const char **rules) {
    const char *why = NULL;
    if (strlen(v) >= CLI_FORMAT_SPEC_MAX)
        return cli_usage_error(cmd, "--format: a spec of %zu characters (at most %d: group layers as blk.A-B)", strlen(v),
                               CLI_FORMAT_SPEC_MAX - 1);
    if (cli_format_spec_split(v, format, rules, &why)) return cli_usage_error(cmd, "--format '%s': %s", v, why);
    return 0;
}

void cli_format_spec(int format, const char *rules, char *buf, size_t cap) {
    snprintf(buf, cap, "%s%s%s", cli_format_name(format), rules ? "," : "", rules ? rules : "");
}

const char *cli_format_name(int format) {
    return format == KILN_FORMAT_MX16 ? "mx16" : format == KILN_FORMAT_MX8 ? "mx8" : "f32";
}

int cli_run_value(const char *json, const char *key, char *buf, size_t cap) {
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = json ? strstr(json, pat) : NULL;
    if (!p || !cap) return 0;
    p += strlen(pat);
    size_t n = 0;
    if (*p == '"') {
        p++;
        while (p[n] && p[n] != '"') n++;
    } else {
        while (p[n] && p[n] != ',' && p[n] != '}' && p[n] != ']') n++;
    }
    if (n >= cap) n = cap - 1;
    memcpy(buf, p, n);
    buf[n] = 0;
    return 1;
}
