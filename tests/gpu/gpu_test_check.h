/*
 * gpu_test_check.h -- the failure counter, checks and seeded random stream shared by the GPU
 * training-op tests (test_cuda_train_ops, test_cuda_norm_fast, test_cuda_fused_ce_fast).
 * One test = one translation unit, so the statics here are that test's own. A test picks its
 * stream's start by defining GPU_TEST_SEED before the include (default 1).
 * Needs base/base.h (kiln_status, kiln_last_error) included before, in extern "C".
 */
#ifndef KILN_GPU_TEST_CHECK_H
#define KILN_GPU_TEST_CHECK_H

#include <cstdint>
#include <cstdio>

#ifndef GPU_TEST_SEED
#define GPU_TEST_SEED 1ull
#endif

static int g_fail = 0;
static uint64_t g_rng = GPU_TEST_SEED;

/* splitmix64 */
static uint64_t rnd64() {
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
/* uniform in [-1, 1), 24-bit grid */
static float rndu() { return (float)((rnd64() >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f; }

#define FAIL(...)                                                                              \
    do {                                                                                       \
        g_fail++;                                                                              \
        fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                                   \
        fprintf(stderr, __VA_ARGS__);                                                          \
        fputc('\n', stderr);                                                                   \
    } while (0)

#define OK_OR_FAIL(expr)                                                                       \
    do {                                                                                       \
        kiln_status s_ = (expr);                                                               \
        if (s_ != KILN_OK) FAIL("%s: %s: %s", #expr, kiln_status_string(s_), kiln_last_error()); \
    } while (0)

#endif /* KILN_GPU_TEST_CHECK_H */
