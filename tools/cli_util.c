/* cli_util.c -- argument parsing and error printing shared by the subcommands. */
#include "cli.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

int cli_fail(const char *cmd, const char *what, kiln_status st) {
    fprintf(stderr, "kiln %s: %s: %s (%s)\n", cmd, what, kiln_last_error(), kiln_status_string(st));
    return 1;
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

char *cli_read_file(const char *path, size_t *len) {
    FILE *f = strcmp(path, "-") ? fopen(path, "rb") : stdin;
    if (!f) return NULL;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
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
        size_t r = fread(buf + n, 1, cap - n - 1, f);
        n += r;
        if (r == 0) break;
    }
    int bad = ferror(f);
    if (f != stdin) fclose(f);
    if (!buf || bad) {
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
