/*
 * cuda_stub.c -- kiln_backend_cuda_create in a build without CUDA: it exists in every build
 * (so callers need no #ifdef) and says why it cannot work. With CUDA the real one is in
 * cuda_backend.cu.
 */
#include "../ops.h"

#ifndef KILN_HAVE_CUDA
kiln_status kiln_backend_cuda_create(int device, kiln_backend **out) {
    (void)device;
    if (out) *out = NULL;
    return kiln_error(KILN_ERR_UNSUPPORTED,
                      "kiln_backend_cuda_create: this kiln was built without CUDA "
                      "(configure with -DKILN_CUDA=ON where nvcc is installed)");
}

kiln_status kiln_backend_cuda_create_mode(int device, int mode, kiln_backend **out) {
    (void)mode;
    return kiln_backend_cuda_create(device, out);
}

kiln_status kiln_backend_cuda_create_formats(int device, int mode, const kiln_weight_formats *t, kiln_backend **out) {
    (void)mode;
    (void)t;
    return kiln_backend_cuda_create(device, out);
}

kiln_status kiln_cuda_device_memory(int device, uint64_t *free_bytes, uint64_t *total_bytes) {
    (void)device;
    (void)free_bytes;
    (void)total_bytes;
    return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_device_memory: this kiln was built without CUDA");
}
#else
typedef int kiln_cuda_stub_unused; /* ISO C wants a non-empty translation unit */
#endif
