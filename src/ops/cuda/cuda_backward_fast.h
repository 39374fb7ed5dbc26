/*
 * cuda_backward_fast.h -- the fast mode's matmul backward (issue 5, "matrix products in bf16
 * (fast)"): ops.h's matmul_backward with its two products on the bf16 tensor cores through
 * the fast GEMM module (cuda_gemm_fast.h). Included from .cu files only (C++ linkage).
 *
 * Arithmetic (not the CPU's bits; docs/TRAINING.md, "Fast mode"):
 *   - dy, x and W are each rounded to bf16 (round to nearest even, tensor.c's
 *     kiln_fp32_to_bf16; an f16 W is widened exactly, then rounded; a bf16 W is used as is);
 *     the products of bf16 values are exact in f32 and cuBLASLt sums them in f32 in an order
 *     of its own. Per element, against the exact product of the unrounded operands:
 *       |error| <= (2^-7 + K * 2^-24) * sum_k |a_k b_k|   (first order),
 *     K = R for dx, N for dW; then dx (accumulate) and dW add the old value in f32;
 *   - dbias is the auditable column sum (cuda_backward.h's kiln_cuda_matmul_backward with only
 *     dbias): each element one lane-16 dot over the tokens in f32, the CPU's bits.
 *
 * Determinism: run to run on one GPU model the results have the same bits. The GEMM module
 * fixes one algorithm per problem (shape, leading dimensions, pointer alignment classes) and
 * never uses an order-dependent reduction; the conversions are elementwise; the dbias sum has
 * a fixed order. The bf16 copies of dy, x and W live in a buffer taken from the stream-ordered
 * allocator (cudaMallocAsync on s, released with cudaFreeAsync on s after the products that
 * read it), placed 256-byte aligned with row strides padded to 8 elements, so the problems
 * the GEMM module sees never depend on where the allocator put the buffer.
 */
#ifndef KILN_CUDA_BACKWARD_FAST_H
#define KILN_CUDA_BACKWARD_FAST_H

#include "cuda_gemm_fast.h"

/* For x(N,C) f32, W(R,C) (rows row_bytes apart, dtype dt: F32, BF16 or F16), dy(N,R) f32:
 *   dx(N,C)   = dy @ W     (accumulate_dx: dx += dy @ W); dx NULL: skipped
 *   dW(R,C)  += dy^T @ x   f32 whatever dt; NULL: skipped (x may then be NULL)
 *   dbias(R) += sum over tokens of dy, the auditable fixed-order sum; NULL: skipped
 * All pointers are device pointers on g's device, which must be current; outputs must not
 * alias inputs or each other. Only enqueues work on s (calls on one handle must be ordered:
 * one stream). N, R or C <= 0: nothing to do. Returns cudaSuccess; cudaErrorInvalidValue for
 * bad arguments (g NULL, unsupported dtype, row_bytes too small or not a multiple of the
 * element size, a misaligned W, a needed input NULL, a shape too large); cudaErrorUnknown for
 * a cuBLASLt failure, or the CUDA error of a failed allocation or launch. For a failure in a
 * product, kiln_cuda_gemm_error(g) says which call failed and why. On failure some outputs
 * may have been written (as with any op that poisons the backend). */
cudaError_t kiln_cuda_matmul_backward_fast(kiln_cuda_gemm *g, cudaStream_t s, float *dx,
                                           float *dW, float *dbias, const float *dy,
                                           const float *x, const uint8_t *w, size_t row_bytes,
                                           kiln_dtype dt, int64_t R, int64_t C, int N,
                                           bool accumulate_dx);

#endif /* KILN_CUDA_BACKWARD_FAST_H */
