/*
 * cuda_matvec_fast.h -- fast-mode matrix-vector products for decode (N <= 8 tokens) that
 * compute directly on the weight bytes (GGUF blocks or f32/f16/bf16 rows). Included from .cu
 * files only (C++ under nvcc), like cuda_internal.h.
 *
 * Arithmetic (fast mode, docs/CUDA.md): every weight is dequantized to exactly the CPU's f32
 * value (tensor.c's formulas, rounding for rounding); the dot is an f32 FMA chain per thread
 * plus a fixed reduction tree, in an order that depends only on (dt, R, C, N) -- no atomics,
 * nothing timing-dependent -- so the results are identical from run to run on one GPU model.
 * It is NOT the auditable lane-16 order, so the bits differ from the CPU's by rounding.
 */
#ifndef KILN_CUDA_MATVEC_FAST_H
#define KILN_CUDA_MATVEC_FAST_H

#include "cuda_internal.h"

/* out(N,R) = x(N,C) @ W(R,C)^T (+ bias(R) when bias != NULL); accumulate != 0: out += that
 * (the residual add fused: out[n][r] = out[n][r] + (dot + bias[r])). N in [1, 8]. W: first
 * row at w, rows row_bytes apart (row_bytes >= the row's size), dtype dt, any of
 * kiln_cuda_dtype_supported's 11 (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
 * Q6_K); C a multiple of the block size. x, out and bias are 4-byte aligned device floats,
 * x (N,C) and out (N,R) row-major; out must not overlap x, w or bias. f32 accumulation in a
 * FIXED order that depends only on (dt, R, C, N) -- never on timing: no atomics -- so results
 * are identical run to run; not the auditable order. Any alignment of w / row_bytes / x is
 * accepted (a slower byte-load path runs when the 16-byte fast path's conditions fail).
 * Returns cudaSuccess or the launch error; cudaErrorInvalidValue on bad args (NULL out/x/w,
 * R < 1, C < 1, N outside [1, 8], an unsupported dtype, C not a multiple of the block size,
 * row_bytes too small, misaligned floats, a grid too large). Only enqueues work on s. */
cudaError_t kiln_cuda_matvec_fast(cudaStream_t s, float *out, const float *x, const uint8_t *w,
                                  size_t row_bytes, kiln_dtype dt, int64_t R, int64_t C,
                                  const float *bias, int N, int accumulate);

/* The number of warps that share one row's dot (1, 2, 4 or 8) for these arguments: the
 * split of C that fixes the summation order. A function of (dt, R, C, N) only; exposed so
 * tests and benchmarks can print it. 0 for arguments kiln_cuda_matvec_fast refuses. */
int kiln_cuda_matvec_fast_split(kiln_dtype dt, int64_t R, int64_t C, int N);

#endif /* KILN_CUDA_MATVEC_FAST_H */
