/*
 * gpu_test_buffers.h -- device buffers and bit-for-bit output checks of the GPU product tests
 * (test_cuda_q8act, test_cuda_kq), one copy for both:
 *
 *   dev_copy<T>(h, bytes)   a device copy of bytes host bytes (at least 4 allocated);
 *   dev_nan(n)              n floats (and one more) of NaN bits, so an unwritten output fails;
 *   host_of(d, n)           a kiln_malloc'd host copy of n device floats;
 *   expect_bits(what, dev, ref, n)  one case (g_cases++): the n device floats equal ref's bits
 *                           (two NaNs count as equal: only a NaN's payload may differ), else
 *                           the first difference is printed and a failure counted (EXPECT).
 *
 * C++ (nvcc) only. Include after gpu_test_cuda_check.h, gpu_test_check.h and base/base.h, with
 * the test's `static int g_cases;` declared before.
 */
#ifndef KILN_GPU_TEST_BUFFERS_H
#define KILN_GPU_TEST_BUFFERS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

template <class T> static T *dev_copy(const void *h, size_t bytes) {
    T *d = NULL;
    CUDA_OK(cudaMalloc(&d, bytes ? bytes : 4));
    if (bytes) CUDA_OK(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
    return d;
}
static float *dev_nan(size_t n) {
    float *d = NULL;
    CUDA_OK(cudaMalloc(&d, n * 4 + 4));
    CUDA_OK(cudaMemset(d, 0xff, n * 4 + 4));
    return d;
}
static float *host_of(const float *d, size_t n) {
    float *h = (float *)kiln_malloc(n * 4 + 4);
    CUDA_OK(cudaMemcpy(h, d, n * 4, cudaMemcpyDeviceToHost));
    return h;
}

static void expect_bits(const char *what, const float *dev, const float *ref, size_t n) {
    float *h = host_of(dev, n);
    bool ok = true;
    for (size_t i = 0; i < n && ok; i++) {
        uint32_t a, b;
        memcpy(&a, &h[i], 4);
        memcpy(&b, &ref[i], 4);
        if (a != b && !(isnan(h[i]) && isnan(ref[i]))) {
            fprintf(stderr, "  %s: element %zu: %08x (%g) vs reference %08x (%g)\n", what, i, a,
                    h[i], b, ref[i]);
            ok = false;
        }
    }
    kiln_free(h);
    g_cases++;
    EXPECT(ok, "%s", what);
}

#endif /* KILN_GPU_TEST_BUFFERS_H */
