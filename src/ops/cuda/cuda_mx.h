/*
 * cuda_mx.h -- the exact block formats mx8 and mx16 on the GPU (cuda_mx.cu): quantization
 * and the product, with the bits of the CPU's (src/ops/mx.h; the definition is
 * docs/ARITHMETIC.md, "Exact block formats (mx8, mx16)"). Included from .cu files only.
 *
 * A block's product P_k is one int8 tensor-core product, m16n8k32 s8 x s8 -> s32 (mx16: hh,
 * hl + lh and ll as three, recombined in 32-bit integers: |P_k| < 2^31), each output's blocks
 * are combined in a 64-bit integer by the definition's shifts (floor for the far-below ones)
 * and rounded once (kiln_mx_round's rules). Integer sums do not depend on their order, so a
 * split of the blocks over thread blocks (split-K, summed with 64-bit atomics) gives the same
 * bits as any other split, and as the CPU.
 */
#ifndef KILN_CUDA_MX_H
#define KILN_CUDA_MX_H

#include "cuda_internal.h"

extern "C" {
#include "../mx.h"
}

/* A (rows, K) matrix quantized along K, in device memory, laid out as kiln_mx_matrix (mx.h):
 * element i of block b of row j at [(j * nb + b) * 32 + i] of q (and lo), e[j * nb + b].
 * There is no row flag: a row is non-finite when one of its blocks has e ==
 * KILN_MX_EXP_NONFINITE, which the product reads from the exponents it walks anyway. The
 * arrays are carved from one allocation (mem) for cap_rows rows; rows may be set to fewer
 * (a prefix: the layout is row-major by block). */
typedef struct kiln_cuda_mx {
    int kind; /* KILN_MX8 / KILN_MX16 */
    int64_t rows, K, nb, cap_rows;
    int8_t *q;  /* (cap_rows, nb*32) mx8: the mantissas; mx16: the high pieces */
    int8_t *lo; /* mx16: the low pieces; NULL for mx8 */
    int16_t *e; /* (cap_rows, nb) */
    void *mem;
} kiln_cuda_mx;

/* Bytes of one block holding rows x K of kind (the planes, then the exponents). */
size_t kiln_cuda_mx_bytes(int kind, int64_t rows, int64_t K);
/* m as a view of mem (kiln_cuda_mx_bytes(kind, rows, K) bytes or more; m->mem stays NULL:
 * kiln_cuda_mx_free leaves mem alone). */
void kiln_cuda_mx_view(kiln_cuda_mx *m, void *mem, int kind, int64_t rows, int64_t K);

/* cudaMalloc one block for rows x K of kind (K <= KILN_MX_MAX_K: else cudaErrorInvalidValue).
 * The caller keeps it out of a strict stream capture (cudaMalloc is not a stream operation). */
cudaError_t kiln_cuda_mx_alloc(kiln_cuda_mx *m, int kind, int64_t rows, int64_t K);
void kiln_cuda_mx_free(kiln_cuda_mx *m);

/* Quantize the (m->rows, m->K) f32 matrix whose element (j, k) is a[j * s_row + k * s_col]
 * (device memory) into m: kiln_mx_quantize's bits (stochastic = 0), or
 * kiln_mx_quantize_stochastic's with (seed, tensor_id) and the element index j * K + k.
 * One warp per block. */
cudaError_t kiln_cuda_mx_quantize(cudaStream_t s, kiln_cuda_mx *m, const float *a, int64_t s_row,
                                  int64_t s_col, int stochastic, uint64_t seed, uint64_t tensor_id);

/* Scratch (bytes) of kiln_cuda_mx_matmul for N rows of x, R rows of W and nb blocks: the
 * split-K sums (int64) and each output's largest exponent sum (int32), N * R of each, and a
 * count per output tile (the last of a tile's CTAs rounds it); 0 when the product runs
 * unsplit. A function of (N, R, nb) only. */
size_t kiln_cuda_mx_matmul_ws_bytes(int64_t N, int64_t R, int64_t nb);

/* x = rmsnorm(x) * norm_w (eps; x (m->rows, m->K) contiguous) quantized to nearest: the bits of
 * kiln_cuda_rmsnorm followed by kiln_cuda_mx_quantize, without the normed copy. */
cudaError_t kiln_cuda_mx_quantize_norm(cudaStream_t s, kiln_cuda_mx *m, const float *x, const float *norm_w,
                                       float eps);

/* out[n * ldo + r] = mx(x W^T)[n, r] (kiln_mx_matmul_cpu's bits), then, as f32 adds:
 * accumulate != 0: out = out + that (the old value first); else bias (NULL: none): that +
 * bias[r], then res (NULL: none): + res[n * ldo + r] (res may be out only through accumulate). x (N, K) and w (R, K) of one kind and K. ws: kiln_cuda_mx_matmul_ws_bytes bytes,
 * ZEROED before its first use; the product leaves every byte it used zeroed again, so one
 * buffer serves products of any size in stream order. out must not overlap
 * the operands. cudaErrorInvalidValue on a kind or K mismatch or a missing ws. */
cudaError_t kiln_cuda_mx_matmul(cudaStream_t s, const kiln_cuda_mx *x, const kiln_cuda_mx *w,
                                float *out, int64_t ldo, const float *bias, const float *res,
                                int accumulate, void *ws);

#endif /* KILN_CUDA_MX_H */
