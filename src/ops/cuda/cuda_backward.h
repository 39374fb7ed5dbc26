/*
 * cuda_backward.h -- the backward (training) ops of the CUDA backend in auditable arithmetic:
 * launchers with exactly ops.h's semantics on device pointers, whose every output has the CPU
 * backend's bits (src/ops/cpu/backward_portable.c; the orders are docs/ARITHMETIC.md,
 * "Backward ops"). Included from .cu files only (C++ under nvcc).
 *
 * Every launcher only enqueues work on stream s and returns the launch's error
 * (cudaGetLastError), cudaSuccess when there is nothing to do, or cudaErrorInvalidValue /
 * cudaErrorInvalidConfiguration for arguments it cannot run (checked before anything is
 * enqueued). All pointers are device pointers, ids and pos included. No launcher allocates;
 * the scratch buffers are the caller's, as on the CPU.
 */
#ifndef KILN_CUDA_BACKWARD_H
#define KILN_CUDA_BACKWARD_H

#include "cuda_internal.h"

/* The W dtypes of matmul_backward: F32, BF16, F16 (widened exactly). */
bool kiln_cuda_backward_dtype_supported(kiln_dtype dt);

/* For x(N,C), W(R,C) (rows row_bytes apart, dtype dt), dy(N,R):
 *   dx(N,C)   = dy @ W     (accumulate_dx: dx += dy @ W); dx NULL: skipped
 *   dW(R,C)  += dy^T @ x   f32 whatever dt; NULL: skipped
 *   dbias(R) += sum over tokens of dy; NULL: skipped
 * Outputs must not alias inputs. */
cudaError_t kiln_cuda_matmul_backward(cudaStream_t s, float *dx, float *dW, float *dbias,
                                      const float *dy, const float *x, const uint8_t *w,
                                      size_t row_bytes, kiln_dtype dt, int64_t R, int64_t C,
                                      int N, bool accumulate_dx);

/* The auditable column sum on its own (dbias's and rmsnorm dw's kernel, exported for tests
 * and timing): for c < W, out[c] = out[c] + lane-16 over rows n < N of fmaf(a[n*ld + c], bv,
 * .), bv = 1 (b NULL), b[n*ld + c] (sc NULL) or b[n*ld + c] * sc[n]; the CPU's col_lanes
 * bits. cudaErrorInvalidValue for ld < W, a or out NULL, or sc without b. */
cudaError_t kiln_cuda_col_sum_exact(cudaStream_t s, float *out, const float *a, const float *b,
                                    const float *sc, int64_t ld, int N, int64_t W);

/* Over rows x(N,C), weight w(C) (NULL: none), dy(N,C): dx (accumulate_dx: +=), dw(C) +=
 * (skipped when dw or w is NULL), rstd(N) overwritten with each row's r. dx may be dy (the
 * same index is read before it is written). */
cudaError_t kiln_cuda_rmsnorm_backward(cudaStream_t s, float *dx, float *dw, const float *dy,
                                       const float *x, const float *w, int N, int C, float eps,
                                       float *rstd, bool accumulate_dx);

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

/* Causal GQA attention backward: dq(N,NH,HS) overwritten; dk, dv rows 0..n_past+N-1 of
 * (T,KVH,HS) overwritten, later rows untouched; ws: 3*N*NH floats of scratch. HS at most
 * KILN_CUDA_MAX_HS, NH a multiple of KVH. window > 0: the forward's sliding window (ops.h
 * attention), the CPU's bits. */
cudaError_t kiln_cuda_attention_backward(cudaStream_t s, float *dq, float *dk, float *dv,
                                         const float *dout, const float *q, const float *k,
                                         const float *v, const float *out, float *ws, int N,
                                         int n_past, int NH, int KVH, int HS, float scale,
                                         int window);

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

/* dtable(V,C) += dy rows: row v gets the rows of the tokens with ids[n] == v in increasing
 * n. ids(N) device memory, in [0, V) (an id outside is skipped, never written through). */
cudaError_t kiln_cuda_embed_backward(cudaStream_t s, float *dtable, const float *dy,
                                     const int32_t *ids, int N, int V, int C);

/* The same from host ids, in O(N) work instead of O(N^2) and with the same bits: the host
 * groups the tokens by id (kiln_embed_plan), the device sums each group's rows in token
 * order, one block of columns a group.
 *
 * kiln_embed_plan writes plan[0 .. 2G+1+N) for ids[0..N) and returns G, the number of
 * distinct ids in [0, V) (ids outside are left out, as above):
 *   plan[g]              the id of group g (groups in order of first occurrence),
 *   plan[G + g]          where group g's positions start in the position list, and
 *   plan[G + G]          their end (the number of tokens kept),
 *   plan[2G + 1 + i]     the position list: each group's token positions, increasing.
 * plan must hold 3N + 1 ints. counts: V ints of host scratch (any contents; overwritten). */
int kiln_embed_plan(const int32_t *ids, int N, int V, int32_t *plan, int32_t *counts);
/* dtable += the rows of dy grouped by a plan (device memory) of G groups, C columns. */
cudaError_t kiln_cuda_embed_backward_plan(cudaStream_t s, float *dtable, const float *dy,
                                          const int32_t *plan, int G, int C);

#endif /* KILN_CUDA_BACKWARD_H */
