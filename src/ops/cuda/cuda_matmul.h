/*
 * cuda_matmul.h -- the matrix products of the CUDA backend, every mode and both directions
 * (cuda_matmul.cu): the auditable matmul and matmul backward, whose outputs have the CPU
 * backend's bits; the fast mode's GEMM module (cuBLASLt on bf16 tensor cores, with its operand
 * conversions to bf16), decode matrix-vector product and matmul backward; and the gate of the
 * wgmma kernels. Included from .cu files only (C++ linkage).
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
#ifndef KILN_CUDA_MATMUL_H
#define KILN_CUDA_MATMUL_H

#include "cuda_internal.h"

/* =================================================================================================
 * Auditable. w is the first row of a weight matrix of dtype dt whose rows are row_bytes
 * apart.
 * ============================================================================================== */

/* Whether the matmul/embed kernels handle dtype dt. */
bool kiln_cuda_dtype_supported(kiln_dtype dt);

/* One product of a multi-product launch (kiln_cuda_matmul_multi, kiln_cuda_matvec_fast_multi):
 * out(N,R) = x(N,C) @ W(R,C)^T (+ bias) (+ res), or with w_up (a SwiGLU pair) out =
 * swiglu(x @ W^T (+ bias), x @ Wup^T (+ bias_up)) (+ res): kmath.h's kiln_swiglu per
 * element. Rows of W (and Wup) row_bytes apart. */
#define KILN_CUDA_PRODUCT_MAX_JOBS 4
typedef struct kiln_cuda_product_job {
    float *out;              /* (N, R) */
    const float *res;        /* NULL or (N, R) */
    const uint8_t *w, *w_up; /* R rows each; w_up NULL unless a SwiGLU pair */
    const float *bias, *bias_up;
    size_t row_bytes;
    int64_t R;
} kiln_cuda_product_job;

/* The auditable products of one input x in one launch: each job's outputs have the bits of
 * kiln_cuda_matmul on it alone, then kiln_cuda_swiglu of the pair's two products, then
 * kiln_cuda_add of res (one half-warp per row's dot, the CPU's; a pair's two rows in the two
 * halves of a warp). n in 1..KILN_CUDA_PRODUCT_MAX_JOBS; every job a pair or none; res may
 * equal out, otherwise no output may overlap x or another job's output or residual
 * (cudaErrorInvalidValue), nor a weight or bias (not checked). f32 / f16 / bf16 rows must start
 * at a multiple of the element size (w, w_up and row_bytes): otherwise cudaErrorNotSupported
 * for a pair (nothing enqueued: the caller splits it), cudaErrorInvalidValue for the rest. */
cudaError_t kiln_cuda_matmul_multi(cudaStream_t s, int n, const kiln_cuda_product_job *jobs,
                                   kiln_dtype dt, const float *x, int64_t C, int N);
/* The same on rmsnorm(x) * norm_w (eps): each block first computes the scale of its tokens'
 * rows exactly as kiln_cuda_rmsnorm does, and the products read x's elements normed with
 * kiln_cuda_rmsnorm's bits, so the outputs are those of kiln_cuda_rmsnorm then
 * kiln_cuda_matmul_multi. norm_w NULL: no norm. */
cudaError_t kiln_cuda_matmul_multi_norm(cudaStream_t s, int n, const kiln_cuda_product_job *jobs,
                                        kiln_dtype dt, const float *x, const float *norm_w,
                                        float eps, int64_t C, int N);

/* ops.h's matmul: out(N,R) = x(N,C) @ W(R,C)^T (+ bias(R), NULL: none). */
cudaError_t kiln_cuda_matmul(cudaStream_t s, float *out, const float *x, const uint8_t *w,
                             size_t row_bytes, kiln_dtype dt, int64_t R, int64_t C,
                             const float *bias, int N);

/* The same with a residual: out = (x @ W^T (+ bias)) + res, res (N,R) NULL: none -- the bits
 * of kiln_cuda_matmul followed by kiln_cuda_add(out, res). res may be out; out must not
 * overlap x, w or bias. */
cudaError_t kiln_cuda_matmul_res(cudaStream_t s, float *out, const float *x, const uint8_t *w,
                                 size_t row_bytes, kiln_dtype dt, int64_t R, int64_t C,
                                 const float *bias, const float *res, int N);

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

/* =================================================================================================
 * Fast: the GEMM module (docs/CUDA.md, "Fast mode"): bf16 operands on the tensor cores
 * through cuBLASLt, f32 accumulation, f32 output. Not the CPU's bits (each operand is
 * rounded to bf16, and cuBLASLt sums in its own order), but deterministic from run to run.
 *
 * Arithmetic, per output element d = sum_k a_k * b_k:
 *   - every f32 operand is rounded to bf16 with round-to-nearest-even (tensor.c's
 *     kiln_fp32_to_bf16, operation for operation: NaN stays NaN); a quantized or f16 weight
 *     is first dequantized to f32 with tensor.c's formulas (cuda_common.cuh's deq_blk, the
 *     same bits as kiln_dequantize), then rounded the same way; a bf16 weight is used as is;
 *   - the products of bf16 values are exact in f32, and cuBLASLt (CUBLAS_COMPUTE_32F) sums
 *     them in f32 in an order of its own; |error| <= about 2^-7 * sum_k |a_k b_k| against the
 *     exact product of the unrounded operands (2^-8 per operand rounding), plus the f32
 *     summation error;
 *   - bias (when given) and, with accumulate, the old output are added in f32 (in cuBLASLt's
 *     epilogue: D = A*B + 1*D + bias).
 *
 * Determinism (run to run, on one GPU model with the same SM count and the same cuBLASLt):
 * what this relies on, from the cuBLAS documentation ("Results reproducibility": the routines
 * of one toolkit version give the same bits on every run on GPUs of the same architecture and
 * SM count; the exception, multiple streams sharing the library's internal workspace, does not
 * arise with cublasLtMatmul and a user-owned workspace):
 *   - one algorithm per problem: the algorithm is chosen once per (transposes, m, n, k,
 *     leading dimensions, pointer alignments, bias mode) with cublasLtMatmulAlgoGetHeuristic
 *     and cached in the handle, so every later call of that problem runs the same kernel with
 *     the same configuration (the heuristic itself is never asked again);
 *   - a fixed workspace: one 32 MiB buffer owned by the handle, always passed whole;
 *   - split-K only with an ordered reduction: the preference's reduction-scheme mask allows
 *     NONE, COMPUTE_TYPE and OUTPUT_TYPE (partial sums in the workspace, summed in a separate
 *     fixed step) and excludes INPLACE (partials summed through the output buffer guarded by
 *     counters), so no result depends on which thread block finishes first and C == D
 *     (accumulate) never meets a reduction through D (only if the heuristic offers nothing
 *     under that mask is INPLACE allowed: still ordered, "counters guarantee the
 *     sequentiality", cublasLt.h). No atomics are enabled (the atomic-sync attributes of the
 *     matmul descriptor stay at their default, off);
 *   - our own conversion kernels are elementwise (one thread per element, no reduction).
 * Different pointer alignments may select a different algorithm, hence different bits: buffers
 * at the same alignment (e.g. backend allocations, 64+ bytes) always give the same bits.
 *
 * Threading and streams: a handle is not thread-safe, and its workspace and scratch are shared
 * by all its calls, so calls on one handle must be ordered (one stream, or streams the caller
 * orders). Every call enqueues work on the given stream and returns; host pointers are never
 * accepted. The handle's device must be the current device at each call.
 *
 * Scratch: the bf16 copies of the operands live in a scratch buffer of the handle that grows
 * (x2) when a call needs more. Growth calls cudaMalloc, so it is refused (cudaErrorStreamCaptureUnsupported)
 * while the stream is capturing: run each shape once before capturing. The old buffer is not
 * freed until kiln_cuda_gemm_free (work in flight, or a graph captured earlier, may still read
 * it); the kept buffers total less than the final one.
 * ============================================================================================== */

/* cuBLASLt handle, 32 MiB workspace, bf16 scratch, algorithm cache, last error message. */
typedef struct kiln_cuda_gemm kiln_cuda_gemm;

/* Create a handle on GPU `device` (made current; the previous current device is restored).
 * *out = NULL on failure; cudaErrorUnknown for a cuBLASLt failure (no message is kept, since
 * there is no handle: the status name goes to kiln's thread error via kiln_error). */
cudaError_t kiln_cuda_gemm_create(int device, kiln_cuda_gemm **out);

/* Free the handle: waits until the device is idle, then frees everything (scratch buffers
 * kept from earlier growth included). NULL is a no-op. */
void kiln_cuda_gemm_free(kiln_cuda_gemm *g);

/* Device bytes the handle holds: its workspace, its scratch and the outgrown scratch buffers
 * it keeps (0 for NULL). */
size_t kiln_cuda_gemm_device_bytes(const kiln_cuda_gemm *g);

/* The last failure's message (which call, cuBLASLt status names included), "" when none (and
 * for g == NULL). Valid until the next call on g. */
const char *kiln_cuda_gemm_error(const kiln_cuda_gemm *g);

/* Forward linear: out(N,R) = x(N,C) @ W(R,C)^T (+ bias(R)); accumulate != 0: out += that.
 * x f32 (row-major, contiguous) is rounded to bf16 into scratch; W (R rows of dtype dt,
 * row_bytes apart, any dtype kiln_cuda_dtype_supported accepts): BF16 is used in place when
 * W and row_bytes are multiples of 16 bytes (else copied into scratch; row_bytes must be even
 * and at least 2*C), the others are dequantized and rounded to bf16 into scratch (C a
 * multiple of the block size). bias may be NULL. out must not alias x or W.
 * Any N >= 1 (N <= 0 or R <= 0: nothing to do). Returns cudaSuccess; cudaErrorInvalidValue
 * for bad arguments, cudaErrorUnknown for a cuBLASLt failure, the CUDA error of a failed
 * allocation or launch; kiln_cuda_gemm_error says which. */
cudaError_t kiln_cuda_gemm_linear(kiln_cuda_gemm *g, cudaStream_t s, float *out, const float *x,
                                  const uint8_t *w, size_t row_bytes, kiln_dtype dt, int64_t R,
                                  int64_t C, const float *bias, int N, int accumulate);

/* The same with x already in bf16 (N rows of C values, ldx >= C elements apart): no rounding
 * of x. With xb = kiln_cuda_f32_to_bf16(x) (ld_dst = ldx) the result has the same bits as
 * kiln_cuda_gemm_linear on x at the same alignments. */
cudaError_t kiln_cuda_gemm_linear_bf16(kiln_cuda_gemm *g, cudaStream_t s, float *out,
                                       const uint16_t *xb, int64_t ldx, const uint8_t *w,
                                       size_t row_bytes, kiln_dtype dt, int64_t R, int64_t C,
                                       const float *bias, int N, int accumulate);

/* n (1..KILN_GEMM_MULTI_MAX) linears of one x: out[i](N,R[i]) = x(N,C) @ W_i(R[i],C)^T
 * (+ bias[i], which may be NULL), W_i at w[i] with row_bytes[i] and dtype dt[i] as in
 * kiln_cuda_gemm_linear. x is rounded to bf16 once, into the same place of the scratch as
 * kiln_cuda_gemm_linear puts it (so the problems, hence the bits, are those of n separate
 * kiln_cuda_gemm_linear calls); each W_i is converted in turn (or used in place). out[i] must
 * not alias x or any W. Errors as kiln_cuda_gemm_linear (nothing enqueued on a bad argument
 * of any i). */
#define KILN_GEMM_MULTI_MAX 4
cudaError_t kiln_cuda_gemm_linear_multi(kiln_cuda_gemm *g, cudaStream_t s, int n,
                                        float *const *out, const float *x,
                                        const uint8_t *const *w, const size_t *row_bytes,
                                        const kiln_dtype *dt, const int64_t *R, int64_t C,
                                        const float *const *bias, int N);
/* The same with x already in bf16 (N rows of C values, ldx >= C elements apart, 16-byte
 * aligned), used in place: with xb = kiln_cuda_f32_to_bf16(x) and ldx = C rounded up to a
 * multiple of 8, the bits of kiln_cuda_gemm_linear_multi on x. Per product i, where the
 * result goes:
 *   - out16 non-NULL and out16[i] non-NULL: bf16 (16-byte aligned, rows of R[i] values), the
 *     round-to-nearest-even of the f32 result (cuBLASLt's epilogue); no bias[i], no add[i];
 *   - else out[i] (f32), and with add non-NULL and add[i] non-NULL, add[i] (N, R[i]) f32 is
 *     added in cuBLASLt's epilogue: out[i] = add[i] + x W_i^T (+ bias[i]) in f32 (add[i]
 *     may be out[i]). The problem, hence possibly the algorithm, differs from the product
 *     alone, so the bits of the product followed by an add are not promised; deterministic
 *     like every product here.
 * out may be NULL when every product has a bf16 output. */
cudaError_t kiln_cuda_gemm_linear_multi_bf16(kiln_cuda_gemm *g, cudaStream_t s, int n,
                                             float *const *out, uint16_t *const *out16,
                                             const float *const *add, const uint16_t *xb,
                                             int64_t ldx,
                                             const uint8_t *const *w, const size_t *row_bytes,
                                             const kiln_dtype *dt, const int64_t *R, int64_t C,
                                             const float *const *bias, int N);

/* General row-major f32 product on bf16 tensor cores, for the backward (issue 5):
 * D(M,N) = A'(M,K) @ B'(K,N) (+ D when accumulate), where A' = A (stored (M,K), lda >= K) or,
 * when trans_a, A^T (A stored (K,M), lda >= M); B' = B (stored (K,N), ldb >= N) or, when
 * trans_b, B^T (B stored (N,K), ldb >= K). A and B are rounded to bf16 into scratch; D f32
 * with leading dimension ldd >= N. M or N zero: nothing to do; K must be >= 1. D must not
 * alias A or B. */
cudaError_t kiln_cuda_gemm_f32(kiln_cuda_gemm *g, cudaStream_t s, int trans_a, int trans_b,
                               int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                               const float *B, int64_t ldb, float *D, int64_t ldd, int accumulate);

/* The same product with A and B already bf16 (bit patterns, uint16_t), used in place. */
cudaError_t kiln_cuda_gemm_bf16(kiln_cuda_gemm *g, cudaStream_t s, int trans_a, int trans_b,
                                int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda,
                                const uint16_t *B, int64_t ldb, float *D, int64_t ldd,
                                int accumulate);

/* The same product with D in bf16: the RNE rounding of the f32 result, in cuBLASLt's
 * epilogue (the problem differs from the f32 one, so its f32 sums may be grouped otherwise;
 * deterministic like every product here). No accumulate. */
cudaError_t kiln_cuda_gemm_bf16_out16(kiln_cuda_gemm *g, cudaStream_t s, int trans_a,
                                      int trans_b, int64_t M, int64_t N, int64_t K,
                                      const uint16_t *A, int64_t lda, const uint16_t *B,
                                      int64_t ldb, uint16_t *D, int64_t ldd);

/* ---- the conversions (launchers; exposed for the tests, which check them bit for bit) ---- */

/* dst(rows, cols; ld_dst) = RNE bf16 of src(rows, cols; ld_src), tensor.c's kiln_fp32_to_bf16
 * bits (NaN stays NaN). */
cudaError_t kiln_cuda_f32_to_bf16(cudaStream_t s, uint16_t *dst, int64_t ld_dst, const float *src,
                                  int64_t ld_src, int64_t rows, int64_t cols);

/* dst(R, C; ld_dst) = RNE bf16 of W's elements dequantized with tensor.c's formulas (the bits
 * kiln_dequantize gives, then kiln_fp32_to_bf16). W: R rows of dtype dt, row_bytes apart; C a
 * multiple of the block size. cudaErrorInvalidValue for an unsupported dtype. */
cudaError_t kiln_cuda_weights_to_bf16(cudaStream_t s, uint16_t *dst, int64_t ld_dst,
                                      const uint8_t *w, size_t row_bytes, kiln_dtype dt,
                                      int64_t R, int64_t C);

/* For the tests: bias != 0 makes the handle add a bias with its own kernel after the product
 * (D += bias per row) instead of cuBLASLt's bias epilogue, the path taken anyway when the
 * heuristic finds no algorithm with the epilogue for a problem. */
void kiln_cuda_gemm_set_bias_kernel(kiln_cuda_gemm *g, int on);

/* Number of cached algorithms (distinct problems seen), for the tests. */
int kiln_cuda_gemm_cached(const kiln_cuda_gemm *g);

/* =================================================================================================
 * Fast: the matrix-vector products for decode (N <= 8 tokens), computed directly on the
 * weight bytes (GGUF blocks or f32/f16/bf16 rows).
 *
 * Arithmetic (fast mode, docs/CUDA.md): every weight is dequantized to exactly the CPU's f32
 * value (tensor.c's formulas, rounding for rounding); the dot is an f32 FMA chain per thread
 * plus a fixed reduction tree, in an order that depends only on (dt, R, C, N) -- no atomics,
 * nothing timing-dependent -- so the results are identical from run to run on one GPU model.
 * It is NOT the auditable lane-16 order, so the bits differ from the CPU's by rounding.
 * ============================================================================================== */

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

/* Several decode products of one input x in one launch (kiln_cuda_product_job: the fused
 * epilogues the decode step wants, a residual and a SwiGLU pair). Every output has exactly the bits
 * of the unfused calls: kiln_cuda_matvec_fast on the job alone (its split from (dt, R_j, C,
 * N)), then kiln_cuda_swiglu of the two products, then kiln_cuda_add of res_j. Jobs share x,
 * C, N and the dtype dt; rows of W_j (and Wup_j) row_bytes_j apart. Either every job is a
 * pair or none. res_j may equal out_j (the accumulate of kiln_cuda_matvec_fast); otherwise no
 * output may overlap x or another job's output or residual (cudaErrorInvalidValue), nor any
 * weight or bias (not checked). Pairs take the 16-byte path only: when its conditions fail
 * (w, w_up or row_bytes not multiples of the dtype's alignment, x not 16-byte aligned, C % 4)
 * the call returns cudaErrorNotSupported having enqueued nothing, and the caller runs the
 * products separately. Other errors as kiln_cuda_matvec_fast's. */
cudaError_t kiln_cuda_matvec_fast_multi(cudaStream_t s, int n, const kiln_cuda_product_job *jobs,
                                        kiln_dtype dt, const float *x, int64_t C, int N);
/* The same on rmsnorm(x) * norm_w (eps), as kiln_cuda_matmul_multi_norm: the bits of
 * kiln_cuda_rmsnorm then kiln_cuda_matvec_fast_multi (the 16-byte path also needs norm_w
 * 16-byte aligned). norm_w NULL: no norm. */
cudaError_t kiln_cuda_matvec_fast_multi_norm(cudaStream_t s, int n,
                                             const kiln_cuda_product_job *jobs, kiln_dtype dt,
                                             const float *x, const float *norm_w, float eps,
                                             int64_t C, int N);

/* The number of warps that share one row's dot (1, 2, 4 or 8) for these arguments: the
 * split of C that fixes the summation order. A function of (dt, R, C, N) only; exposed so
 * tests and benchmarks can print it. 0 for arguments kiln_cuda_matvec_fast refuses. */
int kiln_cuda_matvec_fast_split(kiln_dtype dt, int64_t R, int64_t C, int N);

/* =================================================================================================
 * Fast: bf16 decode products of 2..8 tokens on the tensor cores.
 *
 * Arithmetic (fast mode, docs/CUDA.md): x (normed first when norm_w is set, with rmsnorm's
 * bits) is rounded to bf16, as the fast GEMMs round it; each output is an f32 sum of exact
 * bf16 products, mma.sync m16n8k16 over chunks of 64 k, the S warps of a 16-row tile added in
 * a fixed order (S from (R, C) alone: kiln_cuda_matvec_mma_split). Deterministic run to run
 * on one GPU model; a token's bits do not depend on the other tokens or on N. Not the f32
 * kernel's bits (that one keeps x in f32).
 * ============================================================================================== */

/* kiln_cuda_matvec_fast_multi_norm's products (the same jobs, epilogues and checks) on the
 * tensor cores, for bf16 weights and any N >= 1: x rounded to bf16 (after the norm), each
 * (row, token) dot a fixed chain of mma steps split over S warps, S a function of (R, C)
 * alone, so that a token's outputs are the same bits whatever N and the other tokens are
 * (fast mode takes it for N in 2..8; the batch-invariant fast mode for every N).
 * cudaErrorNotSupported, nothing enqueued, when it does not take them: another dtype, C not a
 * multiple of 64, a weight, row stride, x or norm_w not 16-byte aligned (the caller takes
 * another kernel). */
cudaError_t kiln_cuda_matvec_mma_multi_norm(cudaStream_t s, int n,
                                            const kiln_cuda_product_job *jobs, kiln_dtype dt,
                                            const float *x, const float *norm_w, float eps,
                                            int64_t C, int N);

/* The warps that share one 16-row tile's dot (1, 2, 4 or 8), a function of (R, C) only; 0
 * where C is not a positive multiple of 64. For tests and benchmarks. */
int kiln_cuda_matvec_mma_split(int64_t R, int64_t C);

/* =================================================================================================
 * Fast: the int8-activation product for Q8_0, Q4_0 and Q4_1 weights -- the CPU fast mode's
 * definition (docs/ARITHMETIC.md, "Fast mode: 8-bit activations"; the reference is
 * src/ops/cpu/kernels_q8act.c), bit for bit: each token's activations are quantized to int8
 * blocks of 32, each block's dot with the weight block is an exact integer sum (dp4a), and
 * the 8 lane accumulators and their tree are the CPU's f32 operations in the CPU's order. A
 * token's outputs do not depend on N or on the other tokens (batch-invariant). It is NOT
 * the exact product: x is rounded to 8 bits.
 * ============================================================================================== */

/* Whether dt has the int8-activation product: Q8_0, Q4_0, Q4_1. */
bool kiln_cuda_q8act_supported(kiln_dtype dt);

/* The products of kiln_cuda_product_job on x (N, C), any N >= 1: out_j = the fast dot of
 * each token with each row (+ bias_j), a pair's outputs swiglu(gate, up), then + res_j; on
 * rmsnorm(x) * norm_w (eps; kiln_cuda_rmsnorm's bits) when norm_w is set. The bits of the
 * CPU backend in fast mode: kernels_q8act's quantize and rows, then the CPU's swiglu and
 * add. Job rules as kiln_cuda_matvec_fast_multi's; C a multiple of 32, rows row_bytes apart
 * (at least C / 32 blocks). Returns cudaErrorInvalidValue on bad arguments (an unsupported
 * dtype among them); cudaErrorNotSupported, having enqueued nothing, for a pair whose rows
 * are not at multiples of 2 bytes (Q4_1: 4), or C / 32 blocks of one token past the
 * kernel's shared memory (about 78,000 columns): the caller runs them otherwise. Only
 * enqueues work on s. */
cudaError_t kiln_cuda_q8act_multi_norm(cudaStream_t s, int n, const kiln_cuda_product_job *jobs,
                                       kiln_dtype dt, const float *x, const float *norm_w,
                                       float eps, int64_t C, int N);

/* =================================================================================================
 * Fast: the decode product of K-quant and Q5_0 weights (Q4_K, Q5_K, Q6_K, Q5_0: the types of
 * a Q4_K_M file) on 8-bit activations (the arithmetic of llama.cpp's CUDA decode): each
 * token's activations quantized to int8 blocks of 32 as kiln_cuda_q8act_multi_norm quantizes
 * them, each 16 (Q6_K 8, Q5_0 32) weights' dot with them an
 * exact integer sum, those combined in f32 in a fixed order that depends on C and the dtype
 * only (cuda_matmul.cu gives the definition; tests/gpu/test_cuda_kq.cu a host reference). A
 * token's outputs do not depend on N or on the other tokens (batch-invariant). NOT the exact
 * product: x is rounded to 8 bits, the superblock scales are applied to integer sums.
 * ============================================================================================== */

/* Whether dt has the K-quant int8-activation product: Q4_K, Q5_K, Q6_K, Q5_0. */
bool kiln_cuda_kq_supported(kiln_dtype dt);

/* kiln_cuda_q8act_multi_norm's contract (jobs, norm, epilogues, any N >= 1) for Q4_K / Q5_K /
 * Q6_K / Q5_0 weights, C a multiple of the block (256; Q5_0 32). cudaErrorNotSupported,
 * having enqueued nothing, when a weight or row stride is not 16-byte aligned (Q6_K, Q5_0:
 * 2-byte), or one token's C / 32 blocks
 * pass the kernel's shared memory: the caller runs them otherwise. */
cudaError_t kiln_cuda_kq_multi_norm(cudaStream_t s, int n, const kiln_cuda_product_job *jobs,
                                    kiln_dtype dt, const float *x, const float *norm_w, float eps,
                                    int64_t C, int N);

/* =================================================================================================
 * Fast: the matmul backward (issue 5, "matrix products in bf16 (fast)"): ops.h's
 * matmul_backward with its two products on the bf16 tensor cores through the GEMM module
 * above, dbias by cuda_norm.h's kiln_cuda_col_sum_fast.
 *
 * Arithmetic (not the CPU's bits; docs/TRAINING.md, "Fast mode"):
 *   - dy, x and W are each rounded to bf16 (round to nearest even, tensor.c's
 *     kiln_fp32_to_bf16; an f16 W is widened exactly, then rounded; a bf16 W is used as is);
 *     the products of bf16 values are exact in f32 and cuBLASLt sums them in f32 in an order
 *     of its own. Per element, against the exact product of the unrounded operands:
 *       |error| <= (2^-7 + K * 2^-24) * sum_k |a_k b_k|   (first order),
 *     K = R for dx, N for dW; then dx (accumulate) and dW add the old value in f32;
 *   - dbias is kiln_cuda_col_sum_fast (f32 dy, summed in double in a fixed chunked
 *     order, rounded once): within about half an ulp of the exact sum, not the CPU's bits.
 *
 * Determinism: run to run on one GPU model the results have the same bits. The GEMM module
 * fixes one algorithm per problem (shape, leading dimensions, pointer alignment classes) and
 * never uses an order-dependent reduction; the conversions are elementwise; the dbias sum has
 * a fixed order. The bf16 copies of dy, x and W and the column sum's partials live in a
 * buffer taken from the stream-ordered allocator (cudaMallocAsync on s, released with
 * cudaFreeAsync on s after the kernels that read it), placed 256-byte aligned with row
 * strides padded to 8 elements, so the problems the GEMM module sees never depend on where
 * the allocator put the buffer.
 * ============================================================================================== */

/* For x(N,C) f32, W(R,C) (rows row_bytes apart, dtype dt: F32, BF16 or F16), dy(N,R) f32:
 *   dx(N,C)   = dy @ W     (accumulate_dx: dx += dy @ W); dx NULL: skipped
 *   dW(R,C)  += dy^T @ x   f32 whatever dt; NULL: skipped (x may then be NULL)
 *   dbias(R) += sum over tokens of dy, kiln_cuda_col_sum_fast's order; NULL: skipped
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

/* One product of kiln_cuda_matmul_backward_fast_multi: dy(N,R), W (R rows of dtype dt,
 * row_bytes apart) and its outputs dW(R,C), dbias(R) (NULL: skipped). R <= 0: skipped.
 * dy16: NULL, or dy already in bf16 (N rows of R values back to back, 16-byte aligned), used
 * in place of rounding dy (which may then be NULL unless dbias is wanted); with R a multiple
 * of 8 the bits are those of passing the f32 dy it rounds. */
typedef struct kiln_cuda_mb_item {
    float *dW, *dbias;
    const float *dy;
    const uint8_t *w;
    size_t row_bytes;
    kiln_dtype dt;
    int64_t R;
    const uint16_t *dy16;
} kiln_cuda_mb_item;
#define KILN_CUDA_MB_MAX 4
/* n (1..KILN_CUDA_MB_MAX) products of one x(N,C): for each item i, dW_i += dy_i^T @ x, dbias_i
 * += column sums of dy_i, and dx (NULL: skipped) = sum over i of dy_i @ W_i in increasing i
 * (accumulate_dx: added to the old dx), each as kiln_cuda_matmul_backward_fast computes it:
 * x is rounded to bf16 once, each dy_i once, and the operands sit at the same alignment
 * classes, so the bits are those of n kiln_cuda_matmul_backward_fast calls (the first with
 * accumulate_dx, the others accumulating). One stream-ordered allocation for all. Errors as
 * kiln_cuda_matmul_backward_fast (every item checked before anything is enqueued). */
cudaError_t kiln_cuda_matmul_backward_fast_multi(kiln_cuda_gemm *g, cudaStream_t s, int n,
                                                 const kiln_cuda_mb_item *items, float *dx,
                                                 const float *x, int64_t C, int N,
                                                 bool accumulate_dx);
/* The same with x already in bf16 (N rows of C values, ldx >= C elements apart, 16-byte
 * aligned), used in place: with xb = kiln_cuda_f32_to_bf16(x) and ldx = C rounded up to a
 * multiple of 8, the bits of kiln_cuda_matmul_backward_fast_multi on x. */
cudaError_t kiln_cuda_matmul_backward_fast_multi_bf16(kiln_cuda_gemm *g, cudaStream_t s, int n,
                                                      const kiln_cuda_mb_item *items, float *dx,
                                                      const uint16_t *xb, int64_t ldx,
                                                      int64_t C, int N, bool accumulate_dx);

/* One item with dx in bf16: dx16(N,C) = the RNE rounding of dy @ W, cuBLASLt's epilogue (not
 * the f32 result's bits rounded: a problem of its own), and dW += dy^T @ x with the bits of
 * kiln_cuda_matmul_backward_fast_multi_bf16; xb as there. */
cudaError_t kiln_cuda_matmul_backward_fast_dx16(kiln_cuda_gemm *g, cudaStream_t s,
                                                const kiln_cuda_mb_item *item, uint16_t *dx16,
                                                const uint16_t *xb, int64_t ldx, int64_t C,
                                                int N);

/* =================================================================================================
 * Whether the fast-mode kernels may take Hopper's warpgroup products (cuda_wgmma.cuh) on
 * the current device (cuda_matmul.cu's self-check).
 *
 * The wgmma kernels exist in the sm_90a machine code only. kiln_cuda_wgmma_usable is true
 * when the binary the runtime loaded for this device is that code and its products passed
 * kiln_cuda_wgmma_selfcheck (every operand form the kernels use, against exact integer
 * products) on this device; the answer is cached per device after the first call, which
 * must not be made while a stream is capturing a graph (the backend calls it at create).
 * KILN_WGMMA=0 in the environment turns the wgmma kernels off (read on every call: the tests
 * switch it), so every caller keeps its mma.sync path.
 * ============================================================================================== */

/* 1: the four operand forms (A from registers or a tile, each of K-major and MN-major tiles)
 * gave the exact products; 0: this binary has no sm_90a code for the device (or the device
 * is not compute capability 9.0): the wgmma kernels are not there; -1: a mismatch or a CUDA
 * error, described in msg (cap bytes). Synchronous: runs one small kernel on stream 0. */
int kiln_cuda_wgmma_selfcheck(char *msg, size_t cap);

/* Whether the fast kernels take their wgmma variants on the current device (see above). The
 * first call on a device runs the self-check, unless stream s is capturing a graph: then it
 * answers false and leaves the question open. */
bool kiln_cuda_wgmma_usable(cudaStream_t s);

#endif /* KILN_CUDA_MATMUL_H */
