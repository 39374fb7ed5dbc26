/*
 * cuda_kernels.cu -- the auditable-mode kernels of the CUDA backend and their launchers.
 *
 * Each kernel is a transcription of docs/ARITHMETIC.md: the same binary32 operations, in the
 * same order, per output element, as the CPU reference. Parallelism only ever splits work
 * ACROSS output elements or across the 16 lanes of the defined dot product, never along a
 * sequential chain, so the bits cannot depend on the launch shape. Compiled with
 * --fmad=false (no a*b+c contraction: every FMA is a written __fmaf_rn / fmaf), IEEE division
 * and square root (nvcc's defaults without --use_fast_math) and no flush-to-zero.
 */
#include "cuda_common.cuh"

#include "../../base/kmath.h"

#include <limits.h>

bool kiln_cuda_dtype_supported(kiln_dtype dt) {
    switch (dt) {
    case KILN_DTYPE_F32: case KILN_DTYPE_F16: case KILN_DTYPE_BF16: case KILN_DTYPE_Q8_0:
    case KILN_DTYPE_Q4_0: case KILN_DTYPE_Q4_1: case KILN_DTYPE_Q5_0: case KILN_DTYPE_Q5_1:
    case KILN_DTYPE_Q4_K: case KILN_DTYPE_Q5_K: case KILN_DTYPE_Q6_K:
        return true;
    default:
        return false;
    }
}

/* ---- matmul: out(N,R) = x(N,C) @ W(R,C)^T (+ bias) ---------------------------------------- */

/* One half-warp per row r and tile of NT tokens: thread j is lane j of each of the NT dots,
 * walking elements j, j+16, ... in increasing order with fmaf, the weight dequantized once
 * per element and shared by the NT tokens; then the fixed tree. 16 rows per 256-thread
 * block. Each output is (one half-warp's) exactly the defined dot: bit-identical to the CPU.
 *
 * The walk goes by "walk blocks" of VB elements (the quantization block; 16 elements for
 * plain types), in which lane j owns the EPL = VB/16 elements j + 16m. A step loads UB walk
 * blocks (about 32 of the lane's weights, so that many loads are in flight before the first
 * FMA: the chain of a lane is sequential by definition, so memory parallelism has to come
 * from loading ahead), then runs the FMAs in element order. */
#define MM_THREADS 256
#define MM_ROWS_PER_BLOCK (MM_THREADS / 16)

template <int DT, int NT, int PER_STEP>
static __global__ void __launch_bounds__(MM_THREADS)
matmul_kernel(float *__restrict__ out, const float *__restrict__ x,
              const uint8_t *__restrict__ w, size_t row_bytes, const float *__restrict__ bias,
              int64_t R, int64_t C, int N) {
    constexpr bool plain = blk<DT>::BS == 1;
    constexpr int VB = plain ? 16 : blk<DT>::BS;            /* elements per walk block */
    constexpr int VTS = plain ? 16 * blk<DT>::TS : blk<DT>::TS; /* its bytes */
    constexpr int EPL = VB / 16;                             /* the lane's elements in it */
    constexpr int UB = PER_STEP / EPL > 0 ? PER_STEP / EPL : 1;
    const int lane = threadIdx.x & 15;
    const int64_t r = (int64_t)blockIdx.x * MM_ROWS_PER_BLOCK + (threadIdx.x >> 4);
    const int n0 = blockIdx.y * NT;
    if (r >= R) return; /* whole half-warps leave together */
    const unsigned mask = half_warp_mask();
    const int nt = N - n0 < NT ? N - n0 : NT;
    const uint8_t *row = w + r * row_bytes;
    const float *xt = x + (int64_t)n0 * C + lane;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    const int64_t nb = C / VB;
    int64_t b = 0;
    for (; b + UB <= nb; b += UB) {
        float wv[UB * EPL];
#pragma unroll
        for (int u = 0; u < UB; u++)
#pragma unroll
            for (int m = 0; m < EPL; m++)
                wv[u * EPL + m] = deq_blk<DT>(row + (b + u) * VTS, lane + 16 * m);
        const float *xb = xt + b * VB;
#pragma unroll
        for (int k = 0; k < UB * EPL; k++)
#pragma unroll
            for (int t = 0; t < NT; t++)
                if (t < nt) acc[t] = __fmaf_rn(xb[(int64_t)t * C + 16 * k], wv[k], acc[t]);
    }
    for (; b < nb; b++) {
        float wv[EPL];
#pragma unroll
        for (int m = 0; m < EPL; m++) wv[m] = deq_blk<DT>(row + b * VTS, lane + 16 * m);
        const float *xb = xt + b * VB;
#pragma unroll
        for (int k = 0; k < EPL; k++)
#pragma unroll
            for (int t = 0; t < NT; t++)
                if (t < nt) acc[t] = __fmaf_rn(xb[(int64_t)t * C + 16 * k], wv[k], acc[t]);
    }
    if (plain && nb * VB + lane < C) { /* the last, partial run of 16 */
        const float wl = deq<DT>(row, nb * VB + lane);
#pragma unroll
        for (int t = 0; t < NT; t++)
            if (t < nt) acc[t] = __fmaf_rn(xt[(int64_t)t * C + nb * VB], wl, acc[t]);
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float s = lane16_tree(acc[t], mask);
        if (bias) s = s + bias[r];
        if (lane == t % 16 && t < nt) out[(int64_t)(n0 + t) * R + r] = s;
    }
}

/* The lane's weights loaded ahead per step at N = 1: 32 or 64, or 0 (the default) for the
 * faster on an H200 (64 for f16/bf16, 32 for the rest: docs/CUDA.md). tests/gpu runs both and
 * bench_cuda_matmul times both. Any value gives the same bits: it only changes when loads are
 * issued, never the order of the FMAs. */
extern "C" int kiln_cuda_matmul_step;
int kiln_cuda_matmul_step = 0;

template <int DT>
static void matmul_launch(cudaStream_t s, float *out, const float *x, const uint8_t *w,
                          size_t row_bytes, const float *bias, int64_t R, int64_t C, int N) {
    const unsigned gx = (unsigned)((R + MM_ROWS_PER_BLOCK - 1) / MM_ROWS_PER_BLOCK);
    const int step = kiln_cuda_matmul_step ? kiln_cuda_matmul_step
                     : (DT == KILN_DTYPE_F16 || DT == KILN_DTYPE_BF16) ? 64 : 32;
    if (N == 1 && step == 32) {
        matmul_kernel<DT, 1, 32><<<dim3(gx, 1), MM_THREADS, 0, s>>>(out, x, w, row_bytes, bias,
                                                                    R, C, N);
    } else if (N == 1) {
        matmul_kernel<DT, 1, 64><<<dim3(gx, 1), MM_THREADS, 0, s>>>(out, x, w, row_bytes, bias,
                                                                    R, C, N);
    } else if (N <= 4) {
        matmul_kernel<DT, 4, 16><<<dim3(gx, 1), MM_THREADS, 0, s>>>(out, x, w, row_bytes, bias,
                                                                    R, C, N);
    } else {
        const unsigned gy = (unsigned)((N + 7) / 8);
        matmul_kernel<DT, 8, 16><<<dim3(gx, gy), MM_THREADS, 0, s>>>(out, x, w, row_bytes, bias,
                                                                     R, C, N);
    }
}

cudaError_t kiln_cuda_matmul(cudaStream_t s, float *out, const float *x, const uint8_t *w,
                             size_t row_bytes, kiln_dtype dt, int64_t R, int64_t C,
                             const float *bias, int N) {
    if (R <= 0 || N <= 0) return cudaSuccess;
    if ((R + MM_ROWS_PER_BLOCK - 1) / MM_ROWS_PER_BLOCK > 0x7fffffff || (N + 7) / 8 > 65535)
        return cudaErrorInvalidConfiguration;
    KILN_CUDA_DTYPE_SWITCH(dt, matmul_launch, s, out, x, w, row_bytes, bias, R, C, N);
    return cudaGetLastError();
}

/* ---- embed: out(N,C) = dequantized rows ids[n] -------------------------------------------- */

template <int DT>
static __global__ void embed_kernel(float *__restrict__ out, const uint8_t *__restrict__ table,
                                    size_t row_bytes, int64_t C, const int32_t *__restrict__ ids,
                                    int64_t total) {
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (int64_t)gridDim.x * blockDim.x) {
        int64_t n = u / C, c = u - n * C;
        out[u] = deq<DT>(table + (size_t)ids[n] * row_bytes, c);
    }
}

static unsigned grid_for(int64_t total, int threads) {
    int64_t g = (total + threads - 1) / threads;
    return (unsigned)(g > (1 << 20) ? (1 << 20) : g);
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

/* ---- rmsnorm: one half-warp per row -------------------------------------------------------- */

/* Thread j = lane j of the row's dot: it owns elements i = j + 16k in increasing k (the
 * defined lane order). The chain of fmaf is sequential by definition, so speed comes from
 * loading all of the lane's x[i] into registers before the first FMA (the cached kernel, for
 * C <= 16 * E with E a compile-time bound picked at launch) and writing out from those
 * registers; larger C takes the chunked kernel (chunks of RMS_CHUNK elements per lane,
 * loaded before their FMAs). Elements past C are never used by an fmaf.
 *
 * out may alias x (ops.h), so neither is __restrict__: each thread reads its elements for
 * the dot, the tree (which needs every lane's accumulator) orders all of a row's reads
 * before any write, and each element is written by the thread that read it. */
#define RMS_ROWS_PER_BLOCK 4 /* 64 threads: N = 2048 rows make 512 blocks for 132 SMs */
#define RMS_THREADS (RMS_ROWS_PER_BLOCK * 16)
#define RMS_CHUNK 16
static_assert(RMS_THREADS % 32 == 0, "a half-warp never straddles two blocks' rows");

template <typename O, int E>
static __global__ void __launch_bounds__(RMS_THREADS)
rmsnorm_cached_kernel(O *out, const float *x, const float *__restrict__ w, int N, int C,
                      float eps) {
    const int lane = threadIdx.x & 15;
    const int64_t n = (int64_t)blockIdx.x * RMS_ROWS_PER_BLOCK + (threadIdx.x >> 4);
    if (n >= N) return; /* whole half-warps leave together */
    const unsigned mask = half_warp_mask();
    const float *xr = x + n * C;
    float xv[E];
#pragma unroll
    for (int k = 0; k < E; k++) {
        const int i = lane + 16 * k;
        xv[k] = i < C ? xr[i] : 0.0f;
    }
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < E; k++)
        if (lane + 16 * k < C) acc = __fmaf_rn(xv[k], xv[k], acc);
    const float r = kiln_rms_scale(lane16_tree(acc, mask), C, eps);
    O *o = out + n * C;
    if (w) {
#pragma unroll
        for (int k = 0; k < E; k++) {
            const int i = lane + 16 * k;
            if (i < C) store_out(o + i, (xv[k] * r) * w[i]);
        }
    } else {
#pragma unroll
        for (int k = 0; k < E; k++) {
            const int i = lane + 16 * k;
            if (i < C) store_out(o + i, xv[k] * r);
        }
    }
}

/* Any C: the dot in chunks of RMS_CHUNK elements per lane (chunk starts are multiples of 16,
 * so every element keeps its lane), then the output loop. */
template <typename O>
static __global__ void __launch_bounds__(RMS_THREADS)
rmsnorm_chunked_kernel(O *out, const float *x, const float *__restrict__ w, int N, int C,
                       float eps) {
    const int lane = threadIdx.x & 15;
    const int64_t n = (int64_t)blockIdx.x * RMS_ROWS_PER_BLOCK + (threadIdx.x >> 4);
    if (n >= N) return; /* whole half-warps leave together */
    const unsigned mask = half_warp_mask();
    const float *xr = x + n * C;
    float xv[RMS_CHUNK];
    float acc = 0.0f;
    for (int c0 = 0; c0 < C; c0 += 16 * RMS_CHUNK) {
#pragma unroll
        for (int k = 0; k < RMS_CHUNK; k++) {
            const int i = c0 + lane + 16 * k;
            xv[k] = i < C ? xr[i] : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < RMS_CHUNK; k++)
            if (c0 + lane + 16 * k < C) acc = __fmaf_rn(xv[k], xv[k], acc);
    }
    const float r = kiln_rms_scale(lane16_tree(acc, mask), C, eps);
    O *o = out + n * C;
    for (int c0 = 0; c0 < C; c0 += 16 * RMS_CHUNK) {
#pragma unroll
        for (int k = 0; k < RMS_CHUNK; k++) {
            const int i = c0 + lane + 16 * k;
            xv[k] = i < C ? xr[i] : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < RMS_CHUNK; k++) {
            const int i = c0 + lane + 16 * k;
            if (i < C) store_out(o + i, w ? (xv[k] * r) * w[i] : xv[k] * r);
        }
    }
}

template <typename O, int E>
static void rmsnorm_cached_launch(cudaStream_t s, unsigned grid, O *out, const float *x,
                                  const float *w, int N, int C, float eps) {
    rmsnorm_cached_kernel<O, E><<<grid, RMS_THREADS, 0, s>>>(out, x, w, N, C, eps);
}

template <typename O>
static cudaError_t rmsnorm_launch(cudaStream_t s, O *out, const float *x, const float *w, int N,
                                  int C, float eps) {
    if (N <= 0 || C <= 0) return cudaSuccess;
    const unsigned grid = (unsigned)((N + RMS_ROWS_PER_BLOCK - 1) / RMS_ROWS_PER_BLOCK);
    const int per_lane = (C + 15) / 16; /* the lane's elements: at most ceil(C / 16) */
    if (per_lane <= 4) rmsnorm_cached_launch<O, 4>(s, grid, out, x, w, N, C, eps);
    else if (per_lane <= 8) rmsnorm_cached_launch<O, 8>(s, grid, out, x, w, N, C, eps);
    else if (per_lane <= 16) rmsnorm_cached_launch<O, 16>(s, grid, out, x, w, N, C, eps);
    else if (per_lane <= 32) rmsnorm_cached_launch<O, 32>(s, grid, out, x, w, N, C, eps);
    else if (per_lane <= 48) rmsnorm_cached_launch<O, 48>(s, grid, out, x, w, N, C, eps);
    else if (per_lane <= 64) rmsnorm_cached_launch<O, 64>(s, grid, out, x, w, N, C, eps);
    else if (per_lane <= 128) rmsnorm_cached_launch<O, 128>(s, grid, out, x, w, N, C, eps);
    else rmsnorm_chunked_kernel<O><<<grid, RMS_THREADS, 0, s>>>(out, x, w, N, C, eps);
    return cudaGetLastError();
}

cudaError_t kiln_cuda_rmsnorm(cudaStream_t s, float *out, const float *x, const float *w, int N,
                              int C, float eps) {
    return rmsnorm_launch(s, out, x, w, N, C, eps);
}

cudaError_t kiln_cuda_rmsnorm_bf16(cudaStream_t s, uint16_t *out, const float *x, const float *w,
                                   int N, int C, float eps) {
    return rmsnorm_launch(s, out, x, w, N, C, eps);
}

/* ---- rope: one thread per rotated pair ------------------------------------------------------ */

static __global__ void rope_kernel(float *x, const int32_t *__restrict__ pos, int N, int H,
                                   int HS, const float *__restrict__ cos_tab,
                                   const float *__restrict__ sin_tab, int64_t total) {
    const int half = HS / 2;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (int64_t)gridDim.x * blockDim.x) {
        int64_t nh = u / half; /* token * H + head */
        int i = (int)(u - nh * half);
        int64_t n = nh / H;
        float *v = x + nh * HS;
        const float c = cos_tab[(int64_t)pos[n] * half + i];
        const float sn = sin_tab[(int64_t)pos[n] * half + i];
        const float2 r = kiln_rope_pair(v[i], v[i + half], c, sn);
        v[i] = r.x;
        v[i + half] = r.y;
    }
}

cudaError_t kiln_cuda_rope(cudaStream_t s, float *x, const int32_t *pos, int N, int H, int HS,
                           const float *cos_tab, const float *sin_tab) {
    int64_t total = (int64_t)N * H * (HS / 2);
    if (total <= 0) return cudaSuccess;
    rope_kernel<<<grid_for(total, 256), 256, 0, s>>>(x, pos, N, H, HS, cos_tab, sin_tab, total);
    return cudaGetLastError();
}

/* ---- attention: one block per (token, head), keys in order -------------------------------- */

/* The online softmax of docs/ARITHMETIC.md for one (token i, head h). The 64 dots of a key
 * block are split over the block's half-warps (each dot is one half-warp's lane-16 dot); the
 * block max and the sum l are taken by one thread in key order, exactly as the CPU does (the
 * max's tie between -0 and +0 and its NaN handling are order-dependent, so it is not a tree);
 * the accumulator is split over d, each d walking the keys in order. */
#define ATTN_THREADS 128

/* Where a block's keys are, beyond the dense layout (k, v rows 0.. of one cache; the query of
 * block row i at n_past + i). pos: a paged cache
 * (ops.h's kiln_kv_pages), block row n is a token of sequence seq[n] at position pos[n], the
 * 64 keys from position kb at pool row table[seq[n] * max_blocks + kb / block_size] *
 * block_size + kb % block_size. All device memory; NULL when unused. window > 0: a sliding
 * window (docs/ARITHMETIC.md, "Sliding window"), the query at position p sees keys
 * p - window < j <= p only; 0: every earlier key. */
struct attn_where {
    const int32_t *seq, *pos, *table;
    int block_size, max_blocks, window;
};

/* WINDOW false: wh.window is 0 and the walk is the plain causal one, compiled without the
 * window's arithmetic (the decode step's kernel). */
template <bool WINDOW>
static __global__ void __launch_bounds__(ATTN_THREADS)
attention_kernel(float *__restrict__ out, const float *__restrict__ q,
                 const float *__restrict__ kc, const float *__restrict__ vc, int n_past,
                 attn_where wh, int NH, int KVH, int HS, float scale) {
    const int32_t *btab = NULL; /* paged: the token's row of the block table */
    if (wh.pos) {
        const int n = (int)(blockIdx.x / (unsigned)NH);
        n_past = wh.pos[n];
        btab = wh.table + (int64_t)wh.seq[n] * wh.max_blocks;
        if (n_past < 0 || n_past / wh.block_size >= wh.max_blocks) { /* off the table */
            float *o = out + ((int64_t)n * NH + blockIdx.x % (unsigned)NH) * HS;
            for (int d = threadIdx.x; d < HS; d += ATTN_THREADS) o[d] = NAN;
            return; /* block-uniform, before any barrier */
        }
    }
    extern __shared__ float sm[];
    float *qs = sm;             /* (HS) */
    float *acc = sm + HS;       /* (HS) */
    __shared__ float s[KILN_ATTN_BLOCK], p[KILN_ATTN_BLOCK];
    __shared__ float sh_m_new, sh_alpha, sh_l;
    const int i = btab ? 0 : blockIdx.x / NH, h = blockIdx.x % NH;
    const int row = blockIdx.x / NH; /* q/out row: token i */
    const int kvh = h / (NH / KVH);
    const int64_t stride = (int64_t)KVH * HS;
    const int tid = threadIdx.x, lane = tid & 15, hw = tid >> 4;
    const unsigned mask = half_warp_mask();
    const float *qrow = q + ((int64_t)row * NH + h) * HS;
    const float *kbase = kc + (int64_t)kvh * HS;
    const float *vbase = vc + (int64_t)kvh * HS;
    for (int d = tid; d < HS; d += ATTN_THREADS) {
        qs[d] = qrow[d];
        acc[d] = 0.0f;
    }
    const int T = n_past + i + 1;
    /* the window's first key; the key blocks stay aligned at multiples of 64 from the one
     * holding it, whose keys below lo are skipped (the CPU's attn_one, key for key) */
    const int lo = WINDOW && T > wh.window ? T - wh.window : 0;
    float m = -INFINITY, l = 0.0f;
    __syncthreads();
    for (int kb0 = WINDOW ? lo / KILN_ATTN_BLOCK * KILN_ATTN_BLOCK : 0; kb0 < T; kb0 += KILN_ATTN_BLOCK) {
        const int kb = WINDOW && kb0 < lo ? lo : kb0; /* the block's first key */
        const int nk = WINDOW ? (T - kb0 < KILN_ATTN_BLOCK ? T : kb0 + KILN_ATTN_BLOCK) - kb
                              : (T - kb0 < KILN_ATTN_BLOCK ? T - kb0 : KILN_ATTN_BLOCK);
        /* the cache row of key kb: the block never straddles a page (block_size % 64 == 0),
         * so kb's row is its aligned start's plus kb - kb0 */
        const int64_t kr = btab ? (int64_t)btab[kb0 / wh.block_size] * wh.block_size +
                                      kb0 % wh.block_size + (kb - kb0)
                                : kb;
        for (int j = hw; j < nk; j += ATTN_THREADS / 16) {
            const float *kj = kbase + (kr + j) * stride;
            float a = 0.0f;
            for (int d = lane; d < HS; d += 16) a = __fmaf_rn(qs[d], kj[d], a);
            a = lane16_tree(a, mask);
            if (lane == 0) s[j] = a * scale;
        }
        __syncthreads();
        if (tid == 0) {
            float bm = -INFINITY;
            for (int t = 0; t < nk; t++) bm = s[t] > bm ? s[t] : bm;
            const float m_new = bm > m ? bm : m;
            sh_m_new = m_new;
            sh_alpha = kiln_expf(m - m_new);
        }
        __syncthreads();
        const float m_new = sh_m_new, alpha = sh_alpha;
        for (int t = tid; t < nk; t += ATTN_THREADS) p[t] = kiln_expf(s[t] - m_new);
        __syncthreads();
        if (tid == 0) {
            l = l * alpha;
            for (int t = 0; t < nk; t++) l = l + p[t];
        }
        for (int d = tid; d < HS; d += ATTN_THREADS) {
            float a = acc[d] * alpha;
            const float *vd = vbase + kr * stride + d;
            for (int t = 0; t < nk; t++) a = __fmaf_rn(p[t], vd[(int64_t)t * stride], a);
            acc[d] = a;
        }
        m = m_new;
        __syncthreads(); /* s and p are rewritten by the next block */
    }
    if (tid == 0) sh_l = l;
    __syncthreads();
    float *o = out + ((int64_t)row * NH + h) * HS;
    for (int d = tid; d < HS; d += ATTN_THREADS) o[d] = acc[d] / sh_l;
}

cudaError_t kiln_cuda_attention(cudaStream_t s, float *out, const float *q, const float *k,
                                const float *v, int N, int n_past, int NH, int KVH, int HS,
                                float scale, int window) {
    if (N <= 0 || NH <= 0 || HS <= 0) return cudaSuccess;
    if (HS > KILN_CUDA_MAX_HS || KVH <= 0 || NH % KVH != 0 || window < 0)
        return cudaErrorInvalidValue;
    size_t smem = (size_t)2 * HS * sizeof(float);
    const attn_where dense = {NULL, NULL, NULL, 0, 0, window};
    if (window > 0)
        attention_kernel<true><<<(unsigned)((int64_t)N * NH), ATTN_THREADS, smem, s>>>(
            out, q, k, v, n_past, dense, NH, KVH, HS, scale);
    else
        attention_kernel<false><<<(unsigned)((int64_t)N * NH), ATTN_THREADS, smem, s>>>(
            out, q, k, v, n_past, dense, NH, KVH, HS, scale);
    return cudaGetLastError();
}

cudaError_t kiln_cuda_attention_paged(cudaStream_t s, float *out, const float *q,
                                      const float *k_pool, const float *v_pool,
                                      const int32_t *block_table, int block_size, int max_blocks,
                                      const int32_t *d_seq, const int32_t *d_pos, int N, int NH,
                                      int KVH, int HS, float scale, int window) {
    if (N <= 0 || NH <= 0 || HS <= 0) return cudaSuccess;
    if (HS > KILN_CUDA_MAX_HS || KVH <= 0 || NH % KVH != 0 || !block_table || !d_seq ||
        !d_pos || block_size <= 0 || block_size % KILN_ATTN_BLOCK != 0 || max_blocks <= 0 ||
        (int64_t)N * NH > INT_MAX || window < 0)
        return cudaErrorInvalidValue;
    size_t smem = (size_t)2 * HS * sizeof(float);
    const attn_where pg = {d_seq, d_pos, block_table, block_size, max_blocks, window};
    if (window > 0)
        attention_kernel<true><<<(unsigned)((int64_t)N * NH), ATTN_THREADS, smem, s>>>(
            out, q, k_pool, v_pool, 0, pg, NH, KVH, HS, scale);
    else
        attention_kernel<false><<<(unsigned)((int64_t)N * NH), ATTN_THREADS, smem, s>>>(
            out, q, k_pool, v_pool, 0, pg, NH, KVH, HS, scale);
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

/* ---- elementwise ----------------------------------------------------------------------------- */

template <typename O, typename I>
static __global__ void swiglu_kernel(O *out, const I *gate, const I *up, size_t n) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (size_t)gridDim.x * blockDim.x)
        store_out(out + u, kiln_swiglu(load_in(gate + u), load_in(up + u)));
}

/* out[i] = kiln_geglu(gate[i], up[i]) (kmath.h: GELU's tanh form, kiln_tanhf), the CPU's
 * bits; out may alias gate (each element is read before it is written, by its own thread). */
static __global__ void geglu_kernel(float *out, const float *gate, const float *up, size_t n) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (size_t)gridDim.x * blockDim.x)
        out[u] = kiln_geglu(gate[u], up[u]);
}

static __global__ void scale_kernel(float *x, float sc, size_t n) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (size_t)gridDim.x * blockDim.x)
        x[u] = x[u] * sc;
}

cudaError_t kiln_cuda_scale(cudaStream_t s, float *x, float sc, size_t n) {
    if (n == 0) return cudaSuccess;
    scale_kernel<<<grid_for((int64_t)n, 256), 256, 0, s>>>(x, sc, n);
    return cudaGetLastError();
}

static __global__ void add_kernel(float *x, const float *y, size_t n) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (size_t)gridDim.x * blockDim.x)
        x[u] = x[u] + y[u];
}

cudaError_t kiln_cuda_swiglu(cudaStream_t s, float *out, const float *gate, const float *up,
                             size_t n) {
    if (n == 0) return cudaSuccess;
    swiglu_kernel<float, float><<<grid_for((int64_t)n, 256), 256, 0, s>>>(out, gate, up, n);
    return cudaGetLastError();
}

cudaError_t kiln_cuda_geglu(cudaStream_t s, float *out, const float *gate, const float *up,
                            size_t n) {
    if (n == 0) return cudaSuccess;
    geglu_kernel<<<grid_for((int64_t)n, 256), 256, 0, s>>>(out, gate, up, n);
    return cudaGetLastError();
}

/* bf16 in and out, 4 elements a thread (8-byte loads and store; each element as swiglu_kernel
 * computes it, so the same bits): n4 groups of 4. */
static __global__ void swiglu_bf16x4_kernel(uint2 *out, const uint2 *gate, const uint2 *up,
                                            size_t n4) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n4;
         u += (size_t)gridDim.x * blockDim.x) {
        const float4 g = bf16x4_f32(gate[u]), v = bf16x4_f32(up[u]);
        out[u] = f32x4_bf16(kiln_swiglu(g.x, v.x), kiln_swiglu(g.y, v.y), kiln_swiglu(g.z, v.z),
                            kiln_swiglu(g.w, v.w));
    }
}

/* Fast mode (kiln_fast_swiglu): 8 elements an item (16-byte loads and store), two items a
 * thread with both loads issued first; n8 groups of 8. */
static __global__ void swiglu_fast_bf16x8_kernel(uint4 *out, const uint4 *gate, const uint4 *up,
                                                 size_t n8) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n8; u += 2 * stride) {
        const size_t u1 = u + stride;
        const bool two = u1 < n8;
        const uint4 g0 = gate[u], v0 = up[u];
        uint4 g1 = g0, v1 = v0;
        if (two) {
            g1 = gate[u1];
            v1 = up[u1];
        }
        float g[8], v[8], o[8];
        bf16x8_f32(g0, g);
        bf16x8_f32(v0, v);
#pragma unroll
        for (int i = 0; i < 8; i++) o[i] = kiln_fast_swiglu(g[i], v[i]);
        out[u] = f32x8_bf16(o);
        if (two) {
            bf16x8_f32(g1, g);
            bf16x8_f32(v1, v);
#pragma unroll
            for (int i = 0; i < 8; i++) o[i] = kiln_fast_swiglu(g[i], v[i]);
            out[u1] = f32x8_bf16(o);
        }
    }
}

static __global__ void swiglu_fast_bf16_kernel(uint16_t *out, const uint16_t *gate,
                                               const uint16_t *up, size_t n) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (size_t)gridDim.x * blockDim.x)
        out[u] = kiln_bf16_rne(kiln_fast_swiglu(load_in(gate + u), load_in(up + u)));
}

cudaError_t kiln_cuda_swiglu_bf16(cudaStream_t s, uint16_t *out, const uint16_t *gate,
                                  const uint16_t *up, size_t n, bool fast) {
    if (n == 0) return cudaSuccess;
    size_t done = 0;
    if (fast) {
        if ((((uintptr_t)gate | (uintptr_t)up | (uintptr_t)out) & 15) == 0 && n >= 8) {
            const size_t n8 = n / 8;
            swiglu_fast_bf16x8_kernel<<<grid_for((int64_t)((n8 + 1) / 2), 256), 256, 0, s>>>(
                reinterpret_cast<uint4 *>(out), reinterpret_cast<const uint4 *>(gate),
                reinterpret_cast<const uint4 *>(up), n8);
            done = 8 * n8;
        }
        if (done < n)
            swiglu_fast_bf16_kernel<<<grid_for((int64_t)(n - done), 256), 256, 0, s>>>(
                out + done, gate + done, up + done, n - done);
        return cudaGetLastError();
    }
    if ((((uintptr_t)gate | (uintptr_t)up | (uintptr_t)out) & 7) == 0 && n >= 4) {
        const size_t n4 = n / 4;
        swiglu_bf16x4_kernel<<<grid_for((int64_t)n4, 256), 256, 0, s>>>(
            reinterpret_cast<uint2 *>(out), reinterpret_cast<const uint2 *>(gate),
            reinterpret_cast<const uint2 *>(up), n4);
        done = 4 * n4;
    }
    if (done < n)
        swiglu_kernel<uint16_t, uint16_t><<<grid_for((int64_t)(n - done), 256), 256, 0, s>>>(
            out + done, gate + done, up + done, n - done);
    return cudaGetLastError();
}

cudaError_t kiln_cuda_add(cudaStream_t s, float *x, const float *y, size_t n) {
    if (n == 0) return cudaSuccess;
    add_kernel<<<grid_for((int64_t)n, 256), 256, 0, s>>>(x, y, n);
    return cudaGetLastError();
}
