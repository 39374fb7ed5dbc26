/*
 * cuda_rows.cu -- the ops that move whole rows by index, and their launchers (contracts:
 * cuda_rows.h): embed (a dequantized row per token) and its backward (a row's tokens summed
 * into it, in token order), get_rows, and the paged cache's kv_store_rows and gather_pages.
 * Plain copies, or the CPU's additions in the CPU's order, so every output has the CPU
 * backend's bits. A family of their own rather than part of cuda_elementwise.cu: each moves
 * a row at a time by an index (an id, a slot, a page table), none is an element-wise op, and
 * the paged-cache copies share a grid (rows_grid).
 *
 * Auditable arithmetic: each kernel transcribes docs/ARITHMETIC.md (the backward ops: its
 * "Backward ops", as src/ops/cpu/backward_portable.c computes them): the same binary32
 * operations, in the same order, per output element, as the CPU reference. Parallelism only ever
 * splits work ACROSS output elements or across the 16 lanes of the defined dot product, never
 * along a sequential chain, so the bits cannot depend on the launch shape. Compiled with
 * --fmad=false (no a*b+c contraction: every FMA is a written __fmaf_rn / fmaf), IEEE division
 * and square root (nvcc's defaults without --use_fast_math) and no flush-to-zero.
 */
#include "cuda_rows.h"

#include "cuda_common.cuh"

/* =================================================================================================
 * Forward.
 * ============================================================================================== */

/* ---- embed: out(N,C) = dequantized rows ids[n] -------------------------------------------- */

template <int DT>
static __global__ void embed_kernel(float *__restrict__ out, const uint8_t *__restrict__ table,
                                    size_t row_bytes, int64_t C, const int32_t *__restrict__ ids,
                                    int64_t total) {
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (int64_t)gridDim.x * blockDim.x) {
        int64_t n = u / C, c = u - n * C;
        out[u] = deq<DT>(table + (size_t)(ids ? ids[n] : n) * row_bytes, c);
    }
}

template <int DT>
static void embed_launch(cudaStream_t s, float *out, const uint8_t *table, size_t row_bytes,
                         int64_t C, const int32_t *ids, int64_t total) {
    embed_kernel<DT><<<grid_for(total, 256), 256, 0, s>>>(out, table, row_bytes, C, ids, total);
}

cudaError_t kiln_cuda_embed(cudaStream_t s, float *out, const uint8_t *table, size_t row_bytes,
                            kiln_dtype dt, int64_t C, const int32_t *ids, int N) {
    int64_t total = (int64_t)N * C;
    if (total <= 0) return cudaSuccess;
    KILN_CUDA_DTYPE_SWITCH(dt, embed_launch, s, out, table, row_bytes, C, ids, total);
    return cudaGetLastError();
}

/* Paged caches (ops.h's kv_store_rows): token t (blockIdx.y, then every gridDim.y-th) goes to
 * pool row slots[t]: plain copies. */
static __global__ void kv_store_rows_kernel(float *__restrict__ kp, float *__restrict__ vp,
                                            const float *__restrict__ kr,
                                            const float *__restrict__ vr,
                                            const int32_t *__restrict__ slots, int N, size_t n) {
    for (int t = (int)blockIdx.y; t < N; t += (int)gridDim.y) {
        const size_t off = (size_t)slots[t] * n, src = (size_t)t * n;
        for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
             u += (size_t)gridDim.x * blockDim.x) {
            kp[off + u] = kr[src + u];
            vp[off + u] = vr[src + u];
        }
    }
}

/* Grid for copying `rows` rows of n floats, 256 threads a block: x covers a row (at most 1024
 * blocks, the rest by striding), y the rows (at most 65535, the rest by striding). */
static dim3 rows_grid(int64_t rows, size_t n) {
    const size_t gx = (n + 255) / 256;
    return dim3((unsigned)(gx < 1024 ? gx : 1024), (unsigned)(rows < 65535 ? rows : 65535));
}

cudaError_t kiln_cuda_kv_store_rows(cudaStream_t s, float *k_pool, float *v_pool,
                                    const float *k_rows, const float *v_rows,
                                    const int32_t *d_slots, int N, size_t row_floats) {
    if (row_floats == 0 || N <= 0) return cudaSuccess;
    if (!d_slots) return cudaErrorInvalidValue;
    kv_store_rows_kernel<<<rows_grid(N, row_floats), 256, 0, s>>>(k_pool, v_pool, k_rows, v_rows,
                                                                  d_slots, N, row_floats);
    return cudaGetLastError();
}

/* out row i = x row idx[i] (get_rows), or, with table (the gather of a paged sequence), out
 * row i = x row table[i / block_size] * block_size + i % block_size, for two tensors at once
 * when x2 is given (k and v). */
static __global__ void gather_rows_kernel(float *__restrict__ out, const float *__restrict__ x,
                                          float *__restrict__ out2, const float *__restrict__ x2,
                                          const int32_t *__restrict__ idx,
                                          const int32_t *__restrict__ table, int block_size,
                                          int rows, size_t n) {
    for (int i = (int)blockIdx.y; i < rows; i += (int)gridDim.y) {
        const int64_t r = table ? (int64_t)table[i / block_size] * block_size + i % block_size
                                : (int64_t)idx[i];
        const size_t src = (size_t)r * n, dst = (size_t)i * n;
        for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
             u += (size_t)gridDim.x * blockDim.x) {
            out[dst + u] = x[src + u];
            if (x2) out2[dst + u] = x2[src + u];
        }
    }
}

cudaError_t kiln_cuda_get_rows(cudaStream_t s, float *out, const float *x, const int32_t *d_idx,
                               int n, int C) {
    if (n <= 0 || C <= 0) return cudaSuccess;
    if (!d_idx) return cudaErrorInvalidValue;
    gather_rows_kernel<<<rows_grid(n, (size_t)C), 256, 0, s>>>(out, x, NULL, NULL, d_idx, NULL,
                                                               1, n, (size_t)C);
    return cudaGetLastError();
}

cudaError_t kiln_cuda_gather_pages(cudaStream_t s, float *k_out, float *v_out,
                                   const float *k_pool, const float *v_pool,
                                   const int32_t *d_table_row, int block_size, int T,
                                   size_t row_floats) {
    if (T <= 0 || row_floats == 0) return cudaSuccess;
    if (!d_table_row || block_size <= 0) return cudaErrorInvalidValue;
    gather_rows_kernel<<<rows_grid(T, row_floats), 256, 0, s>>>(
        k_out, k_pool, v_out, v_pool, NULL, d_table_row, block_size, T, row_floats);
    return cudaGetLastError();
}

/* =================================================================================================
 * Backward.
 * ============================================================================================== */

/* ---- embed backward: the first token of each id owns its row -------------------------------- */

/* Block (n, column block): if an earlier token has ids[n], that token's block owns the row and
 * this one leaves. Otherwise, each thread holds one element of row v = ids[n] and adds dy[m,c]
 * for every token m >= n with ids[m] == v, in increasing m: the ids are scanned 256 at a
 * time, each warp's matches gathered with a ballot, and every thread walks the chunk's
 * matches in order (warps ascending, bits ascending). One addition per element per token, as
 * the CPU. */
#define EB_THREADS 256

static __global__ void __launch_bounds__(EB_THREADS)
embed_bwd_kernel(float *dtable, const float *__restrict__ dy, const int32_t *__restrict__ ids,
                 int N, int V, int C) {
    __shared__ unsigned hits[EB_THREADS / 32];
    const int n = blockIdx.x;
    const int t = threadIdx.x, wl = t & 31, wi = t >> 5;
    const int v = ids[n];
    if (v < 0 || v >= V) return; /* the caller's contract; never write outside dtable */
    int earlier = 0;
    for (int m = t; m < n; m += EB_THREADS) earlier |= ids[m] == v;
    if (__syncthreads_or(earlier)) return; /* uniform over the block */
    const int64_t c = (int64_t)blockIdx.y * EB_THREADS + t;
    float *row = dtable + (int64_t)v * C;
    float val = c < C ? row[c] : 0.0f;
    for (int m0 = n; m0 < N; m0 += EB_THREADS) {
        const int m = m0 + t;
        const unsigned bal = __ballot_sync(0xffffffffu, m < N && ids[m] == v);
        if (wl == 0) hits[wi] = bal;
        __syncthreads();
        for (int q = 0; q < EB_THREADS / 32; q++) {
            unsigned b = hits[q];
            while (b) {
                const int bit = __ffs((int)b) - 1;
                b &= b - 1;
                if (c < C) val = val + dy[(int64_t)(m0 + q * 32 + bit) * C + c];
            }
        }
        __syncthreads(); /* hits is rewritten by the next chunk */
    }
    if (c < C) row[c] = val;
}

int kiln_embed_plan(const int32_t *ids, int N, int V, int32_t *plan, int32_t *counts) {
    /* counts[v]: the number of tokens with id v; then -(g + 1) once v is group g; then the
     * next free slot of group g's positions. While the groups are found, group g's count is
     * parked at plan[N + 1 + g] (G <= N, so plan[G + g], written next, never reaches a
     * parked count not yet read). */
    for (int n = 0; n < N; n++)
        if (ids[n] >= 0 && ids[n] < V) counts[ids[n]] = 0;
    for (int n = 0; n < N; n++)
        if (ids[n] >= 0 && ids[n] < V) counts[ids[n]]++;
    int G = 0;
    for (int n = 0; n < N; n++) {
        const int v = ids[n];
        if (v < 0 || v >= V || counts[v] < 0) continue;
        plan[G] = v;
        plan[N + 1 + G] = counts[v];
        counts[v] = -(G + 1);
        G++;
    }
    int32_t *start = plan + G, *pos = plan + 2 * G + 1;
    int32_t acc = 0;
    for (int g = 0; g < G; g++) {
        const int32_t cnt = plan[N + 1 + g];
        start[g] = acc;
        acc += cnt;
    }
    start[G] = acc;
    for (int g = 0; g < G; g++) counts[plan[g]] = start[g];
    for (int n = 0; n < N; n++)
        if (ids[n] >= 0 && ids[n] < V) pos[counts[ids[n]]++] = n;
    return G;
}

#define EBP_THREADS 128
#define EBP_UNROLL 8

/* Block (g, y): columns [y*128, y*128 + 128) of group g's row. The adds are the old kernel's
 * (row, then each token's row in increasing n, one float add at a time); the loads of 8
 * tokens are issued before their adds. */
static __global__ void __launch_bounds__(EBP_THREADS)
embed_bwd_plan_kernel(float *dtable, const float *__restrict__ dy,
                      const int32_t *__restrict__ plan, int G, int C) {
    const int g = blockIdx.x;
    const int64_t c = (int64_t)blockIdx.y * EBP_THREADS + threadIdx.x;
    if (c >= C) return;
    const int v = plan[g];
    const int32_t *pos = plan + 2 * G + 1;
    const int b = plan[G + g], e = plan[G + g + 1];
    float *row = dtable + (int64_t)v * C;
    float val = row[c];
    int i = b;
    for (; i + EBP_UNROLL <= e; i += EBP_UNROLL) {
        float t[EBP_UNROLL];
#pragma unroll
        for (int u = 0; u < EBP_UNROLL; u++) t[u] = dy[(int64_t)pos[i + u] * C + c];
#pragma unroll
        for (int u = 0; u < EBP_UNROLL; u++) val = val + t[u];
    }
    for (; i < e; i++) val = val + dy[(int64_t)pos[i] * C + c];
    row[c] = val;
}

cudaError_t kiln_cuda_embed_backward_plan(cudaStream_t s, float *dtable, const float *dy,
                                          const int32_t *plan, int G, int C) {
    if (G <= 0 || C <= 0) return cudaSuccess;
    const int64_t gy = ((int64_t)C + EBP_THREADS - 1) / EBP_THREADS;
    if (gy > 65535) return cudaErrorInvalidConfiguration;
    embed_bwd_plan_kernel<<<dim3((unsigned)G, (unsigned)gy), EBP_THREADS, 0, s>>>(dtable, dy,
                                                                                 plan, G, C);
    return cudaGetLastError();
}

cudaError_t kiln_cuda_embed_backward(cudaStream_t s, float *dtable, const float *dy,
                                     const int32_t *ids, int N, int V, int C) {
    if (N <= 0 || V <= 0 || C <= 0) return cudaSuccess;
    const int64_t gy = ((int64_t)C + EB_THREADS - 1) / EB_THREADS;
    if (gy > 65535) return cudaErrorInvalidConfiguration;
    embed_bwd_kernel<<<dim3((unsigned)N, (unsigned)gy), EB_THREADS, 0, s>>>(dtable, dy, ids, N, V,
                                                                           C);
    return cudaGetLastError();
}
