/*
 * cuda_internal.h -- what every translation unit of the CUDA backend shares: ops.h's types
 * (in C linkage) and the backend's state and error reporting, defined in cuda_backend.cu, for
 * the code outside it that runs work on a CUDA backend (the fused cross-entropy, AdamW,
 * sampling). The kernels' launchers are declared by their family's header (cuda_attention.h,
 * cuda_matmul.h, cuda_norm.h, cuda_rope.h, cuda_elementwise.h, cuda_rows.h), each of which
 * includes this one. Included from .cu files only (C++ under nvcc).
 */
#ifndef KILN_CUDA_INTERNAL_H
#define KILN_CUDA_INTERNAL_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

extern "C" {
#include "../ops.h"
}

/* ---- the backend's state, for code outside cuda_backend.cu that runs work on a CUDA backend
 * (the fused cross-entropy, AdamW, sampling). be must come from kiln_backend_cuda_create*. */

/* The backend's stream: enqueue on it so the work is ordered with the ops. */
cudaStream_t kiln_cuda_stream(kiln_backend *be);
/* Start of a piece of work: false (nothing may be enqueued) when the backend is poisoned;
 * makes the backend's device current. */
bool kiln_cuda_begin(kiln_backend *be);
/* Poison the backend with st and a message (the first one is kept and reported by every later
 * status/upload/download); also sets this thread's kiln error. Returns the kept status. */
kiln_status kiln_cuda_fail(kiln_backend *be, kiln_status st, const char *fmt, ...) KILN_PRINTF(3, 4);
/* Check a CUDA call's result: true on success, else poison with "what: <cuda message>". */
bool kiln_cuda_check(kiln_backend *be, cudaError_t e, const char *what);
/* Device address of weight W's bytes (W->data itself when it is device memory, else the
 * cached upload, made now on first use) and its row stride in bytes (row_bytes may be NULL).
 * NULL when poisoned. */
const uint8_t *kiln_cuda_weight(kiln_backend *be, const kiln_tensor *W, size_t *row_bytes);
/* Whether the backend runs the fast arithmetic (bf16 tensor cores, docs/CUDA.md) rather than
 * the auditable one. */
bool kiln_cuda_is_fast(const kiln_backend *be);

#endif /* KILN_CUDA_INTERNAL_H */
