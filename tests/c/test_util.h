/* test_util.h -- a tiny assertion harness for kiln's C tests (ctest runs each binary). */
#ifndef KILN_TEST_UTIL_H
#define KILN_TEST_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int t_failures = 0, t_checks = 0;

#define CHECK(cond)                                                                            \
    do {                                                                                       \
        t_checks++;                                                                            \
        if (!(cond)) {                                                                         \
            t_failures++;                                                                      \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);           \
        }                                                                                      \
    } while (0)

#define CHECK_MSG(cond, ...)                                                                   \
    do {                                                                                       \
        t_checks++;                                                                            \
        if (!(cond)) {                                                                         \
            t_failures++;                                                                      \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);           \
            fprintf(stderr, __VA_ARGS__);                                                      \
            fputc('\n', stderr);                                                               \
        }                                                                                      \
    } while (0)

/* Status must be st and the error message must contain needle. */
#define CHECK_ERR(expr, st, needle)                                                            \
    do {                                                                                       \
        kiln_status s_ = (expr);                                                               \
        t_checks++;                                                                            \
        if (s_ != (st) || !strstr(kiln_last_error(), (needle))) {                              \
            t_failures++;                                                                      \
            fprintf(stderr, "%s:%d: %s: got status %d (%s) msg '%s', want %d containing '%s'\n", \
                    __FILE__, __LINE__, #expr, (int)s_, kiln_status_string(s_),                \
                    kiln_last_error(), (int)(st), (needle));                                   \
        }                                                                                      \
    } while (0)

/* ---- float helpers shared by the op tests ----------------------------------------------- */
#include <math.h>
#include <stdint.h>

/* Fill outputs with NaN before a run, so an element an op never writes shows up. */
static inline void poison(float *v, size_t n) {
    for (size_t i = 0; i < n; i++) v[i] = NAN;
}
static inline uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
/* Bit-exact comparison; reports the first mismatch. */
static inline int same_bits(const float *a, const float *b, size_t n, const char *what) {
    for (size_t i = 0; i < n; i++)
        if (bits(a[i]) != bits(b[i])) {
            fprintf(stderr, "  %s: element %zu: %.9g (0x%08x) vs %.9g (0x%08x)\n", what, i, a[i],
                    bits(a[i]), b[i], bits(b[i]));
            return 0;
        }
    return 1;
}

static inline int test_finish(const char *name) {
    printf("%s: %d checks, %d failed\n", name, t_checks, t_failures);
    return t_failures ? 1 : 0;
}

#endif
