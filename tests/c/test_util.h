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

/* A tokenizer to make small test models with: the shared test data's Llama SentencePiece
 * vocabulary ($KILN_SHARED_DIR/testdata/tokenizer-vectors, or the source tree's
 * ../shared/...; 32000 tokens), else the default model's GGUF ($KILN_SMOLLM2_GGUF, which
 * scripts/test.sh fetches; 49152 tokens). 1 with its path and size, 0 when neither exists. */
static inline int test_tokenizer_path(char *path, size_t cap, int *n_vocab) {
    const char *env = getenv("KILN_SHARED_DIR");
    if (env) snprintf(path, cap, "%s/testdata/tokenizer-vectors/ggml-vocab-llama-spm.gguf", env);
    else snprintf(path, cap, "%s", KILN_SOURCE_DIR "/../shared/testdata/tokenizer-vectors/ggml-vocab-llama-spm.gguf");
    FILE *f = fopen(path, "rb");
    if (f) {
        fclose(f);
        *n_vocab = 32000;
        return 1;
    }
    const char *gguf = getenv("KILN_SMOLLM2_GGUF");
    if (gguf && (f = fopen(gguf, "rb")) != NULL) {
        fclose(f);
        snprintf(path, cap, "%s", gguf);
        *n_vocab = 49152;
        return 1;
    }
    return 0;
}

static inline int test_finish(const char *name) {
    printf("%s: %d checks, %d failed\n", name, t_checks, t_failures);
    return t_failures ? 1 : 0;
}

#endif
