/*
 * cuda_norm.h -- RMSNorm on the GPU, every mode and both directions, and the column sums of
 * its weight gradient, which the matmul backward's dbias takes too (cuda_norm.cu). Included from
 * .cu files only (C++ linkage).
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
#ifndef KILN_CUDA_NORM_H
#define KILN_CUDA_NORM_H

#include "cuda_internal.h"

/* =================================================================================================
 * Auditable.
 * ============================================================================================== */

/* ops.h's rmsnorm over the rows of x(N,C), weight w(C) (NULL: none); out may alias x. */
cudaError_t kiln_cuda_rmsnorm(cudaStream_t s, float *out, const float *x, const float *w, int N,
                              int C, float eps);
/* The same rows with each output rounded to bf16 (kiln_fp32_to_bf16 of the f32 result). */
cudaError_t kiln_cuda_rmsnorm_bf16(cudaStream_t s, uint16_t *out, const float *x, const float *w,
                                   int N, int C, float eps);

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

/* The column lanes' launcher (kiln_cuda_col_sum_exact's kernel without its checks) and their
 * block width, for the matmul backward's dbias (cuda_matmul.cu), which checks its arguments
 * before anything is enqueued. Callers check (W + CL_COLS - 1) / CL_COLS <= INT_MAX. */
#define CL_COLS 8
void kiln_cuda_col_lanes_launch(cudaStream_t s, float *out, const float *a, const float *b,
                                const float *sc, int64_t ld, int N, int64_t W);

/* =================================================================================================
 * Fast column sums.
 *
 * Column sums (kiln_cuda_col_sum_fast; fast mode's dbias and RMSNorm dw). The auditable
 * col_lanes kernel (cuda_norm.cu) must follow the CPU's 16 sequential chains per column,
 * which caps its parallelism at 16 threads per column (an H200 at N = 8192 rows: W = 896 in
 * about 95-180 us, a few hundred GB/s). This order cuts the rows into chunks instead; it is
 * fixed by (N, W) alone, so the bits do not depend on the GPU, the launch, the alignment of
 * the data or the timing. With the term of row n
 *     t(n, c) = a[n,c] * bv,  bv = 1, b[n,c], or f32(b[n,c] * s[n])  (the one f32 rounding of
 *     the auditable path; the product a * bv of two floats is exact in double):
 *   1. rows are cut into K = ceil(N / RC) chunks of RC rows (RC a multiple of 64, K <= 256, a
 *      function of N and W only: col_sum_rows_per_chunk in cuda_norm.cu);
 *   2. in chunk k, row lane j (0..7) sums its rows n = k*RC + j + 8i, i ascending, into a
 *      double with fma(a, bv, acc) (one rounding per term, acc starts at +0);
 *   3. the 8 lane sums of a chunk meet in the fixed tree (j, j+4), (j, j+2), (j, j+1) in
 *      double: the chunk's partial P[k][c];
 *   4. group g (0..7) adds P[k][c] for k = g, g+8, ... ascending in double (from +0), and the
 *      8 group sums meet in the same tree: the total T[c];
 *   5. out[c] = f32(out[c] + T[c]), the addition in double, one rounding to f32.
 * Error: |out - exact| <= 2^-24 |exact| + (N/8 + 48) 2^-53 (|out_old| + sum_n |t|) (f32
 * underflow aside): half an f32 ulp of the result plus a double-precision rounding term.
 * No float atomics; the partials go to a caller-provided scratch (a second kernel combines
 * them).
 * ============================================================================================== */

/* Doubles of scratch kiln_cuda_col_sum_fast needs for N rows of W columns: K * W (K the
 * number of row chunks, at most 256); 0 when N <= 0 or W <= 0. A function of (N, W) only. */
size_t kiln_cuda_col_sum_fast_scratch_len(int N, int64_t W);

/* For columns c < W, in the order above:
 *   out[c] = out[c] + sum over rows n < N of a[n*ld + c] * bv,
 *   bv = 1 (b NULL: a plain sum, dbias), b[n*ld + c] (sc NULL), or b[n*ld + c] * sc[n]
 *   rounded to f32 once (rmsnorm's dw: a = dy, b = x, sc = rstd).
 * out(W) is written at columns < W only; a and b are rows ld >= W floats apart; sc(N).
 * scratch: scratch_len >= kiln_cuda_col_sum_fast_scratch_len(N, W) doubles of device memory,
 * used by the kernels this call enqueues on s (free for reuse by work enqueued on s after
 * it). out must not alias a, b, sc or scratch. Only enqueues work on s. N <= 0 or W <= 0:
 * nothing to do. Returns cudaSuccess, cudaErrorInvalidValue (ld < W, a needed pointer NULL,
 * sc without b, scratch too small) or the launch's error. */
cudaError_t kiln_cuda_col_sum_fast(cudaStream_t s, float *out, const float *a, const float *b,
                                   const float *sc, int64_t ld, int N, int64_t W,
                                   double *scratch, size_t scratch_len);

/* Plain column sums (b NULL) of n (1..KILN_CUDA_COL_SUM_MULTI_MAX) matrices in one launch of
 * each of the two kernels: out[i][c] += sum over rows of a[i][n*ld[i] + c] for c < W[i], each
 * with the bits of kiln_cuda_col_sum_fast(out[i], a[i], NULL, NULL, ld[i], N, W[i]) (its row
 * chunks, order and combine; the loads' width may differ, the additions do not). scratch:
 * kiln_cuda_col_sum_fast_multi_scratch_len doubles (the n single lengths added). For q, k
 * and v's bias sums: three launches a layer fewer. cudaErrorInvalidValue as the single call
 * for any job, or n out of range. */
#define KILN_CUDA_COL_SUM_MULTI_MAX 4
size_t kiln_cuda_col_sum_fast_multi_scratch_len(int n, const int64_t *W, int N);
cudaError_t kiln_cuda_col_sum_fast_multi(cudaStream_t s, int n, float *const *out,
                                         const float *const *a, const int64_t *ld,
                                         const int64_t *W, int N, double *scratch,
                                         size_t scratch_len);

/* =================================================================================================
 * Fast rows.
 * ============================================================================================== */

/* ops.h's rmsnorm_backward in fast mode. Per row n of x(N,C), dy(N,C), w(C) (w NULL: g = dy,
 * no product):
 *   r = 1 / sqrtf(ss / C + eps), ss = sum x^2     (written to rstd[n])
 *   g = dy * w;  d = sum g x;  u = ((d / C) * r) * r
 *   dx = fmaf(-x, u, g) * r                        (accumulate_dx: dx = dx + that)
 * the same formula as the auditable kernel (docs/ARITHMETIC.md, "rmsnorm backward") with the
 * difference g - x u as one fmaf, and both sums in f32 in an order of this function, not the
 * CPU's lane-16 dot (so not the CPU's bits):
 *   - the row is cut into slots of 4 consecutive elements (slot j: 4j .. 4j + 3, elements
 *     >= C are 0); T threads own a row, thread t the slots t, t + T, t + 2T, ...: T = 8 for
 *     C <= 32, 16 for C <= 64, 32 (a warp) for C <= 1024, 256 (a block) past that;
 *   - thread t keeps, for each of the 4 positions q in a slot, one chain per sum:
 *     ss_q = fmaf(x, x, ss_q), d_q = fmaf(g, x, d_q) over its slots in increasing order, from
 *     +0 (slots past the row, where a variant pads, add zeros); then (q0 + q1) + (q2 + q3);
 *   - the T threads meet in the butterfly tree (XOR partners T/2, ..., 2, 1; a block: each
 *     warp's butterfly, then ((w0 + w1) + (w2 + w3)) + ((w4 + w5) + (w6 + w7)) over its 8
 *     warps); every thread of the row gets the same bits.
 * The order depends on C alone: not on N, the grid, the timing, or the alignment (float4 and
 * scalar loads fill the same slots). No atomics: two runs give the same bits.
 * Error (first order, u = 2^-24, h the longest path of a term through the sums:
 * h = ceil(C4 / T) + 2 + log2(T), C4 = ceil(C / 4): at most 15 for C <= 1024, and
 * ceil(C / 1024) + 10 past that), against r, g = dy w and u* = r^2 d / C computed exactly
 * from the same f32 inputs:
 *   |rstd - r| <= (h/2 + 3) u r;
 *   |dx - r (g - x u*)| <= (5h/2 + 15) u r (|g| + |x| U),  U = r^2 sum |g x| / C >= |u*|,
 *   plus u |result| for the accumulate's addition (f32 underflow aside).
 * Then, when dw and w are both given, dw(C) += sum over rows of dy * f32(x * rstd), each
 * product in double and exact, summed in double in a fixed order that depends on (N, C) only,
 * rounded to f32 once when added to dw. For 64 < C <= 1024 that happens in the same pass over
 * the rows (chunks of 16 or 32 rows, their partials made while the row is in registers, then
 * kiln_cuda_col_sum_fast's combine; dy and x read once); otherwise by kiln_cuda_col_sum_fast
 * with this function's rstd. The two orders give the same dw but in rare last bits (the
 * double sums round only past 2^53 of range).
 * scratch: scratch_len >= kiln_cuda_rmsnorm_backward_fast_scratch_len(N, C) doubles of
 * device memory. dx may be dy only when dw is skipped (dw reads dy after dx is written, as on
 * the CPU). dx16: NULL, or also the bf16 rounding (kiln_bf16_rne) of every dx value written
 * (after the accumulate; (N, C) back to back, no alias of another argument). Returns
 * cudaErrorInvalidValue for dx, dy, x or rstd NULL or a short scratch (before anything is
 * enqueued), else as kiln_cuda_col_sum_fast. */
size_t kiln_cuda_rmsnorm_backward_fast_scratch_len(int N, int C);
cudaError_t kiln_cuda_rmsnorm_backward_fast(cudaStream_t s, float *dx, uint16_t *dx16, float *dw,
                                            const float *dy, const float *x, const float *w,
                                            int N, int C, float eps, float *rstd,
                                            bool accumulate_dx, double *scratch,
                                            size_t scratch_len);

/* The fast mode's RMSNorm forward with bf16 output (ops.h rmsnorm_bf16 on a fast backend):
 * out(N,C) = bf16 round to nearest even of (x * r) * w (w NULL: x * r), r =
 * kiln_rms_scale(sum of x^2, C, eps) with the sum of squares in the order of
 * kiln_cuda_rmsnorm_backward_fast's rows above (so r has the bits the backward recomputes),
 * for C <= 1024; past that, kiln_cuda_rmsnorm_bf16 (the auditable order). |r - exact| <= (h/2
 * + 3) 2^-24 r as above, so the output differs from the auditable rmsnorm's rounded to bf16 at
 * most by a rounding flip (one bf16 ulp). cudaErrorInvalidValue for out or x NULL. */
cudaError_t kiln_cuda_rmsnorm_fast_bf16(cudaStream_t s, uint16_t *out, const float *x,
                                        const float *w, int N, int C, float eps);

#endif /* KILN_CUDA_NORM_H */
