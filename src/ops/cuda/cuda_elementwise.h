/*
 * cuda_elementwise.h -- the element-wise ops on the GPU (cuda_elementwise.cu): SwiGLU and
 * GeGLU forward and backward (f32 and bf16, auditable and fast), the residual add and the scale.
 * Included from .cu files only (C++ linkage).
 *
 * The auditable launchers: every output element is the IEEE binary32 operations of
 * docs/ARITHMETIC.md in the CPU reference's order (src/ops/cpu/kernels_portable.c,
 * backward_portable.c and tensor.c's dequantizers), so the results are the CPU backend's bits
 * (docs/CUDA.md). Shapes as in ops.h. Each only enqueues work on stream s and returns the launch's
 * error (cudaGetLastError), cudaSuccess when there is nothing to do, or cudaErrorInvalidValue /
 * cudaErrorInvalidConfiguration for arguments it cannot run (checked before anything is
 * enqueued). All pointers are device pointers, ids and pos included. No launcher allocates; the
 * scratch buffers are the caller's, as on the CPU.
 */
#ifndef KILN_CUDA_ELEMENTWISE_H
#define KILN_CUDA_ELEMENTWISE_H

#include "cuda_internal.h"

/* =================================================================================================
 * Forward.
 * ============================================================================================== */

/* x[i] = x[i] * sc. */
cudaError_t kiln_cuda_scale(cudaStream_t s, float *x, float sc, size_t n);

/* out[i] = kiln_swiglu(gate[i], up[i]) (kmath.h), the CPU's bits. */
cudaError_t kiln_cuda_swiglu(cudaStream_t s, float *out, const float *gate, const float *up,
                             size_t n);
/* out[i] = kiln_geglu(gate[i], up[i]) (kmath.h), the CPU's bits; out may alias gate. */
cudaError_t kiln_cuda_geglu(cudaStream_t s, float *out, const float *gate, const float *up,
                            size_t n);
/* bf16 gate, up (widened) -> bf16 out: kiln_fp32_to_bf16 of swiglu's f32 result on the
 * widened values; with fast, of kiln_fast_swiglu's (cuda_common.cuh: one rounding flip from
 * those bits in a small fraction of elements). */
cudaError_t kiln_cuda_swiglu_bf16(cudaStream_t s, uint16_t *out, const uint16_t *gate,
                                  const uint16_t *up, size_t n, bool fast);

/* x[i] = x[i] + y[i]. */
cudaError_t kiln_cuda_add(cudaStream_t s, float *x, const float *y, size_t n);

/* to_words: words[i] = (uint32_t)h[i] << 16; else h[i] = (uint16_t)(words[i] >> 16). */
cudaError_t kiln_cuda_bf16_words(cudaStream_t s, uint32_t *words, uint16_t *h, size_t n, bool to_words);

/* =================================================================================================
 * Backward.
 * ============================================================================================== */

/* Element-wise over n: dgate, dup from dout, gate, up; dgate/dup may alias gate, up or dout
 * at the same index (not each other). */
cudaError_t kiln_cuda_swiglu_backward(cudaStream_t s, float *dgate, float *dup,
                                      const float *dout, const float *gate, const float *up,
                                      size_t n);
/* ops.h geglu_backward: kiln_geglu_backward per element (the CPU's bits); the same aliasing. */
cudaError_t kiln_cuda_geglu_backward(cudaStream_t s, float *dgate, float *dup,
                                     const float *dout, const float *gate, const float *up,
                                     size_t n);
/* The same on bf16 gate, up (widened) with dgate and dup rounded to bf16 (a fast mode's
 * saved gate/up products and the inputs of their backward); they alias nothing. fast: with
 * the fast sigmoid (cuda_common.cuh kiln_fast_swiglu_bwd: one rounding flip from the exact
 * formula's bits in a small fraction of elements). */
cudaError_t kiln_cuda_swiglu_backward_bf16(cudaStream_t s, uint16_t *dgate, uint16_t *dup,
                                           const float *dout, const uint16_t *gate,
                                           const uint16_t *up, size_t n, bool fast);

/* The same with dout in bf16 too (widened exactly): the bits of
 * kiln_cuda_swiglu_backward_bf16 on the widened dout (with the same fast). dout, gate, up: rows x cols packed;
 * dgate, dup: rows of cols values ld >= cols apart (both may be column blocks of one matrix:
 * the stacked gate/up products' dy). */
cudaError_t kiln_cuda_swiglu_backward_bf16_d16(cudaStream_t s, uint16_t *dgate, uint16_t *dup,
                                               int64_t ld, const uint16_t *dout,
                                               const uint16_t *gate, const uint16_t *up,
                                               int64_t rows, int64_t cols, bool fast);

#endif /* KILN_CUDA_ELEMENTWISE_H */
