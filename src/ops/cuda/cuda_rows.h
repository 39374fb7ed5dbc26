/*
 * cuda_rows.h -- the ops that move whole rows by index on the GPU (cuda_rows.cu): embed and
 * its backward, get_rows, and the paged cache's kv_store_rows and gather_pages. Included from .cu
 * files only (C++ linkage).
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
#ifndef KILN_CUDA_ROWS_H
#define KILN_CUDA_ROWS_H

#include "cuda_internal.h"

/* =================================================================================================
 * Forward.
 * ============================================================================================== */

/* out(N,C) = rows ids[n] of table (dtype dt, one of kiln_cuda_dtype_supported's; rows
 * row_bytes apart) dequantized with tensor.c's formulas. ids NULL: rows 0..N-1 (the first
 * N rows of a matrix, dequantized). */
cudaError_t kiln_cuda_embed(cudaStream_t s, float *out, const uint8_t *table, size_t row_bytes,
                            kiln_dtype dt, int64_t C, const int32_t *ids, int N);

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

/* =================================================================================================
 * Backward.
 * ============================================================================================== */

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

#endif /* KILN_CUDA_ROWS_H */
