/*
 * gpu_test_cuda_check.h -- the CUDA error checks and the expectation macro of the GPU tests and
 * benchmarks (tests/gpu), one copy for all of them:
 *
 *   CUDA_OK(call)     a CUDA runtime call that must succeed, else nothing sensible can follow:
 *                     prints "file:line: call: <CUDA error string>" to stderr and exit(1).
 *   CUDA_FATAL(call)  the same, and before exiting also prints the test's summary line
 *                     "FAILED (CUDA error; n failures before it)" to stdout (n = the counter).
 *   EXPECT(cond, fmt, ...)  counts a failure (counter++) when cond is false and prints
 *                     "file:line: FAILED cond: " and the printf-style message to stderr.
 *
 * The counter is the test's own int, named by GPU_TEST_FAILS; it is g_fail unless the test
 * defines GPU_TEST_FAILS (e.g. as g_failed) before the include. The macros name it only where
 * they are used, so it may be declared after the include.
 *
 * Why not gpu_test_check.h: that header defines a test's statics (g_fail, a seeded random
 * stream rnd64 / rndu), is C++ only and needs base/base.h. Most tests that use these macros
 * keep their own counter (g_fail or g_failed) and their own random stream (g_rng), which would
 * clash with or sit beside unused copies of those. This header defines no objects, only macros,
 * and compiles as C11 and as C++ (nvcc); a test may include both.
 */
#ifndef KILN_GPU_TEST_CUDA_CHECK_H
#define KILN_GPU_TEST_CUDA_CHECK_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#ifndef GPU_TEST_FAILS
#define GPU_TEST_FAILS g_fail
#endif

#define CUDA_OK(call)                                                                          \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                      \
                    cudaGetErrorString(e_));                                                   \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

#define CUDA_FATAL(call)                                                                       \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                      \
                    cudaGetErrorString(e_));                                                   \
            printf("FAILED (CUDA error; %d failures before it)\n", GPU_TEST_FAILS);            \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

#define EXPECT(cond, ...)                                                                      \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            GPU_TEST_FAILS++;                                                                  \
            fprintf(stderr, "%s:%d: FAILED %s: ", __FILE__, __LINE__, #cond);                  \
            fprintf(stderr, __VA_ARGS__);                                                      \
            fputc('\n', stderr);                                                               \
        }                                                                                      \
    } while (0)

#endif /* KILN_GPU_TEST_CUDA_CHECK_H */
