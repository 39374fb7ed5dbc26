/*
 * cuda_rope.h -- RoPE on the GPU (cuda_rope.cu): the rotation and its backward, in the
 * auditable arithmetic. Included from .cu files only (C++ linkage).
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
#ifndef KILN_CUDA_ROPE_H
#define KILN_CUDA_ROPE_H

#include "cuda_internal.h"

/* In place on x(N,H,HS): ops.h's rope, the pair (x[i], x[i + HS/2]) of each head rotated
 * (cuda_common.cuh's kiln_rope_pair) by the angle at [pos[n] * HS/2 + i] of cos_tab,
 * sin_tab; pos(N) device memory. */
cudaError_t kiln_cuda_rope(cudaStream_t s, float *x, const int32_t *pos, int N, int H, int HS,
                           const float *cos_tab, const float *sin_tab);

/* ops.h's rope_kv_store in one launch: q(N,NH,HS) and k(N,KVH,HS) rotated in place as
 * kiln_cuda_rope rotates them, then the rotated k and v(N,KVH,HS) copied to pool rows
 * slots[n] of k_pool and v_pool (kiln_cuda_kv_store_rows' copies). pos, slots (N) device
 * memory. The bits of kiln_cuda_rope twice and kiln_cuda_kv_store_rows. */
cudaError_t kiln_cuda_rope_kv_store(cudaStream_t s, float *q, float *k, const float *v,
                                    const int32_t *pos, int N, int NH, int KVH, int HS,
                                    const float *cos_tab, const float *sin_tab, float *k_pool,
                                    float *v_pool, const int32_t *slots);

/* In place on d(N,H,HS): the transpose of rope's rotation; pos(N) device memory. */
cudaError_t kiln_cuda_rope_backward(cudaStream_t s, float *d, const int32_t *pos, int N, int H,
                                    int HS, const float *cos_tab, const float *sin_tab);
/* The same rotation, the results rounded to bf16 (kiln_fp32_to_bf16) into d16: token n's H x HS
 * values at d16 + n * ld16 (ld16 >= H * HS: H * HS packed, more for a column block of a wider
 * matrix); d gets the f32 results too when keep_f32, else is left as it was. Same bits as
 * kiln_cuda_rope_backward followed by kiln_cuda_f32_to_bf16. */
cudaError_t kiln_cuda_rope_backward_bf16(cudaStream_t s, float *d, uint16_t *d16, int64_t ld16,
                                         int keep_f32, const int32_t *pos, int N, int H, int HS,
                                         const float *cos_tab, const float *sin_tab);

#endif /* KILN_CUDA_ROPE_H */
