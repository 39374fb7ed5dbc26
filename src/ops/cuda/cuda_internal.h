/*
 * cuda_internal.h -- what the CUDA backend's two translation units share: the launchers of
 * cuda_kernels.cu (each takes a stream and device pointers and only enqueues work) and the
 * backend's error reporting. Included from .cu files only (C++ under nvcc).
 *
 * Arithmetic: every kernel performs, per output element, exactly the IEEE binary32 operations
 * of docs/ARITHMETIC.md in the same order as the CPU reference (src/ops/cpu/kernels_portable.c
 * and src/base/tensor.c's dequantizers), compiled with --fmad=false, IEEE division and square
 * root, and no flush-to-zero, so the results are the CPU backend's bits (docs/CUDA.md).
 */
#ifndef KILN_CUDA_INTERNAL_H
#define KILN_CUDA_INTERNAL_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

extern "C" {
#include "../ops.h"
}

/* Maximum head size the attention kernel takes (shared memory holds q and the accumulator). */
#define KILN_CUDA_MAX_HS 1024

/* Launchers. Shapes as in ops.h; all pointers are device pointers; w is the first row of a
 * weight matrix of dtype dt whose rows are row_bytes apart. Each returns the launch's error
 * (cudaGetLastError), cudaSuccess when there was nothing to do. */
cudaError_t kiln_cuda_matmul(cudaStream_t s, float *out, const float *x, const uint8_t *w,
                             size_t row_bytes, kiln_dtype dt, int64_t R, int64_t C,
                             const float *bias, int N);
cudaError_t kiln_cuda_embed(cudaStream_t s, float *out, const uint8_t *table, size_t row_bytes,
                            kiln_dtype dt, int64_t C, const int32_t *ids, int N);
cudaError_t kiln_cuda_rmsnorm(cudaStream_t s, float *out, const float *x, const float *w, int N,
                              int C, float eps);
/* The same rows with each output rounded to bf16 (kiln_fp32_to_bf16 of the f32 result). */
cudaError_t kiln_cuda_rmsnorm_bf16(cudaStream_t s, uint16_t *out, const float *x, const float *w,
                                   int N, int C, float eps);
cudaError_t kiln_cuda_rope(cudaStream_t s, float *x, const int32_t *pos, int N, int H, int HS,
                           const float *cos_tab, const float *sin_tab);
/* ops.h's attention in the auditable arithmetic (window: a sliding window, 0 none). */
cudaError_t kiln_cuda_attention(cudaStream_t s, float *out, const float *q, const float *k,
                                const float *v, int N, int n_past, int NH, int KVH, int HS,
                                float scale, int window);
/* ops.h's attention_paged in the auditable arithmetic: token n (q, out rows (N, NH, HS))
 * attends to positions 0..d_pos[n] of sequence d_seq[n] of the paged pool (block_table
 * (n_seq, max_blocks), block_size a positive multiple of KILN_ATTN_BLOCK; all device memory),
 * with the bits of kiln_cuda_attention(N = 1, n_past = d_pos[n]) over those keys stored
 * densely. window > 0: only positions d_pos[n] - window < p <= d_pos[n], in the CPU's block
 * walk (docs/ARITHMETIC.md, "Sliding window": the aligned key blocks from the one holding the
 * window's first key, that block cut to start there): the CPU's bits; neither the pool rows
 * below the window nor the table entries of blocks wholly below it are read. A token whose
 * position is negative or past the table gets NaN. No allocation, no host synchronisation
 * (graph capture). cudaErrorInvalidValue for window < 0. */
cudaError_t kiln_cuda_attention_paged(cudaStream_t s, float *out, const float *q,
                                      const float *k_pool, const float *v_pool,
                                      const int32_t *block_table, int block_size, int max_blocks,
                                      const int32_t *d_seq, const int32_t *d_pos, int N, int NH,
                                      int KVH, int HS, float scale, int window);
/* Pool row d_slots[n] (device) of k_pool/v_pool = row n of k_rows/v_rows (row_floats each). */
cudaError_t kiln_cuda_kv_store_rows(cudaStream_t s, float *k_pool, float *v_pool,
                                    const float *k_rows, const float *v_rows,
                                    const int32_t *d_slots, int N, size_t row_floats);
/* out row i (C floats) = x row d_idx[i] (device), i < n. */
cudaError_t kiln_cuda_get_rows(cudaStream_t s, float *out, const float *x, const int32_t *d_idx,
                               int n, int C);
/* One paged sequence's first T rows made dense: k_out/v_out row p = pool row
 * d_table_row[p / block_size] * block_size + p % block_size (d_table_row: the sequence's row
 * of the block table, device memory). */
cudaError_t kiln_cuda_gather_pages(cudaStream_t s, float *k_out, float *v_out,
                                   const float *k_pool, const float *v_pool,
                                   const int32_t *d_table_row, int block_size, int T,
                                   size_t row_floats);
/* x[i] = x[i] * sc. */
cudaError_t kiln_cuda_scale(cudaStream_t s, float *x, float sc, size_t n);
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
cudaError_t kiln_cuda_add(cudaStream_t s, float *x, const float *y, size_t n);

/* Whether the matmul/embed kernels handle dtype dt. */
bool kiln_cuda_dtype_supported(kiln_dtype dt);

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
