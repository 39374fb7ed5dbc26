/*
 * cuda_matvec_i8.cu -- fast mode's decode products on 8-bit activations (contracts:
 * cuda_matmul.h): the tokens quantized to int8 blocks of 32 in shared memory, each block's dot
 * with the weights an exact integer (dp4a), the f32 combination in a fixed order:
 *   - Q8_0 / Q4_0 / Q4_1: the CPU fast mode's definition, bit for bit;
 *   - Q4_K / Q5_K / Q6_K / Q5_0: the K-quant product, fast decode's default for those types.
 * A token's outputs never depend on N or on the other tokens (the batch-invariant fast mode
 * takes both). Shared job and load helpers: cuda_products.cuh.
 */
#include "cuda_products.cuh"

#include <cuda_fp16.h>
#include <float.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* =================================================================================================
 * Fast: the int8-activation decode product for Q8_0 / Q4_0 / Q4_1 weights -- the CPU fast
 * mode's definition (docs/ARITHMETIC.md, "Fast mode: 8-bit activations"; the reference is
 * src/ops/cpu/kernels_q8act.c), bit for bit.
 *
 * A block quantizes its tile of NT tokens (rmsnorm first when the launch has a norm) into
 * shared memory exactly as the CPU's quantize does (8 threads per block of 32: the max, two
 * correctly rounded divisions, round half to even, the integer sum), then each warp walks
 * rows (one, or a few side by side), grid-stride over all the jobs' rows: lane 4j + p takes
 * part p (8 of the 32 values) of the blocks b = j, j + 8, j + 16, ... -- lane accumulator j's
 * blocks, in order. A block's integer sum is exact however it is split (dp4a on the parts,
 * two xor shuffles), so each lane accumulator's FMA chain and the final 8-lane tree (xor 16,
 * 8, 4) are the CPU's operations in the CPU's order. Nothing depends on N, the tile, the grid
 * or the device: a token's outputs are its bits alone, on the CPU and the GPU.
 *
 * Speed: the grid is as many blocks as the SMs hold at once (each quantizes its tile once,
 * while its warps' first weight loads fly), and a step loads UNR blocks of each of a warp's
 * rows per lane: up to 80 bytes in flight a lane. It is slower than the f32 kernel above
 * on long rows (bench/RESULTS.md, 2026-12-06: ncu finds it at a third of DRAM bandwidth,
 * warps waiting on their 2-byte loads), so fast decode takes it only when asked
 * (KILN_CUDA_Q8ACT=1, cuda_backend.cu).
 * ============================================================================================== */

#define Q8A_THREADS 256
#define Q8A_WARPS (Q8A_THREADS / 32)
/* blocks an SM holds at once (at most 64 registers a thread): half the SM's warps */
#define Q8A_MIN_BLOCKS 4
#define Q8A_TINY 0x1p-96f /* kernels_q8act.c's Q8ACT_TINY */
/* Shared memory of one quantized block of 32 activations (q, d, and s or sum), and what a
 * block of threads may take for its tile of tokens. */
#define Q8A_BLOCK_SMEM 40
#define Q8A_MAX_SMEM (96 * 1024)

template <int DT> struct q8a {
    static constexpr int TS = blk<DT>::TS;
    /* alignment of every block on the fast path (w, w_up and row_bytes multiples of it) */
    static constexpr int ALIGN = pow2_align(TS);
    /* 32-bit words of quants a lane loads per block (its part: Q8_0 8 values, Q4 8 nibbles) */
    static constexpr int NW = DT == KILN_DTYPE_Q8_0 ? 2 : 1;
    /* xe holds the two half sums (the K-quant product's tokens) */
    static constexpr bool HALVES = DT == KILN_DTYPE_Q4_K || DT == KILN_DTYPE_Q5_K ||
                                   DT == KILN_DTYPE_Q6_K || DT == KILN_DTYPE_Q5_0;
};

/* Tokens n0 .. n0 + nt - 1 of x (rmsnorm(x) * norm_w first when norm_w is set: sr the scales)
 * as kiln_q8act blocks in shared memory: xq (nt, nb * 32) int8, xd (nt, nb) the scales d, xe
 * (nt, nb) s = d * sum (Q4_1), the sums of the block's two halves of 16 as int16s (low: values
 * 0..15; the K-quant product below, q8a<DT>::HALVES), or sum's bits (Q4_0, Q8_0). 8 threads per block of 32, 4 elements
 * each: kernels_q8act.c's quantize_block_ref, value for value (the max and the integer sum
 * are exact in any order; each q is its own element's rounding). */
template <int DT>
static __device__ __forceinline__ void q8a_quantize(int8_t *xq, float *xd, float *xe,
                                                    const float *__restrict__ x, int64_t C,
                                                    int n0, int nt, const float *sr,
                                                    const float *__restrict__ norm_w) {
    const int lane = threadIdx.x & 31, sub = lane & 7;
    const int nb = (int)(C / 32), total = nt * nb;
    constexpr int BATCH = 4; /* warp iterations whose loads are issued together */
    /* every lane runs the same trip count (the shuffles take the whole warp) */
    for (int k00 = (threadIdx.x >> 5) * 4; k00 < total; k00 += BATCH * Q8A_WARPS * 4) {
        float vb[BATCH][4];
#pragma unroll
        for (int h = 0; h < BATCH; h++) {
            const int k = k00 + h * Q8A_WARPS * 4 + (lane >> 3);
            const int t = k < total ? k / nb : 0, col = (k - t * nb) * 32 + sub * 4;
#pragma unroll
            for (int e = 0; e < 4; e++)
                vb[h][e] = k < total ? x[(int64_t)(n0 + t) * C + col + e] : 0.0f;
        }
#pragma unroll
        for (int h = 0; h < BATCH; h++) {
            if (k00 + h * Q8A_WARPS * 4 >= total) break; /* the same for the whole warp */
            const int k = k00 + h * Q8A_WARPS * 4 + (lane >> 3);
            const bool valid = k < total;
            const int t = valid ? k / nb : 0, b = valid ? k - t * nb : 0;
            const int col = b * 32 + sub * 4;
            float v[4];
            bool fin = true;
            float amax = 0.0f;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                v[e] = vb[h][e];
                if (norm_w && valid) v[e] = normed(v[e], sr[t], norm_w[col + e]);
                const float a = fabsf(v[e]);
                if (!(a <= FLT_MAX)) fin = false;
                else amax = fmaxf(amax, a);
            }
            int fi = fin ? 1 : 0;
#pragma unroll
            for (int o = 4; o > 0; o >>= 1) {
                amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
                fi &= __shfl_xor_sync(0xffffffffu, fi, o);
            }
            int q[4] = {0, 0, 0, 0}, sum = 0;
            float d = 0.0f, sc = 0.0f;
            const bool scaled = fi && !(amax < Q8A_TINY);
            if (!fi) {
                d = sc = __int_as_float(0x7fc00000); /* a non-finite activation: NaN scales, q = 0 */
            } else if (scaled) {
                d = __fdiv_rn(amax, 127.0f);
                const float inv = __fdiv_rn(127.0f, amax);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    q[e] = (int)fminf(fmaxf(rintf(__fmul_rn(v[e], inv)), -127.0f), 127.0f);
                    sum += q[e];
                }
            }
            /* the 16 values of this half, then the other half's (exact integers, any order) */
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const int other = __shfl_xor_sync(0xffffffffu, sum, 4);
            const int halves = sub < 4 ? (sum & 0xffff) | (other << 16) : (other & 0xffff) | (sum << 16);
            sum += other;
            if (scaled) sc = __fmul_rn(d, (float)sum);
            if (valid) {
                const uint32_t packed = (uint32_t)(q[0] & 0xff) | (uint32_t)(q[1] & 0xff) << 8 |
                                        (uint32_t)(q[2] & 0xff) << 16 | (uint32_t)(q[3] & 0xff) << 24;
                *(uint32_t *)(xq + (size_t)k * 32 + sub * 4) = packed;
                if (sub == 0) {
                    xd[k] = d;
                    xe[k] = DT == KILN_DTYPE_Q4_1 ? sc
                            : q8a<DT>::HALVES ? __int_as_float(halves) : __int_as_float(sum);
                }
            }
        }
    }
}

/* The lane's parts of blocks b = bf + u * bs (u < UNR; b < nb only) of the RW rows: quants
 * and headers. */
template <int DT, int UNR, int RW, int A>
static __device__ __forceinline__ void q8a_load(uint32_t (&qw)[UNR][RW][q8a<DT>::NW],
                                                uint32_t (&hd)[UNR][RW],
                                                const uint8_t *const (&rowp)[RW], int bf, int bs,
                                                int nb, int p) {
    using Q = q8a<DT>;
    const size_t at = (size_t)bf * Q::TS;
#pragma unroll
    for (int u = 0; u < UNR; u++) {
        if (bf + u * bs >= nb) continue;
#pragma unroll
        for (int i = 0; i < RW; i++) {
            const uint8_t *blk = rowp[i] + at + (size_t)u * bs * Q::TS;
            if constexpr (DT == KILN_DTYPE_Q8_0) { /* d | qs[32]: part p = qs[8p, 8p + 8) */
                ldw<cmin(A, 2), 2>(blk + 2 + 8 * p, qw[u][i]);
                hd[u][i] = ld16<A>(blk);
            } else if constexpr (DT == KILN_DTYPE_Q4_0) { /* d | qs[16]: qs[4p, 4p + 4) */
                ldw<cmin(A, 2), 1>(blk + 2 + 4 * p, qw[u][i]);
                hd[u][i] = ld16<A>(blk);
            } else { /* Q4_1: d m | qs[16] */
                ldw<cmin(A, 4), 1>(blk + 4 + 4 * p, qw[u][i]);
                ldw<cmin(A, 4), 1>(blk, &hd[u][i]);
            }
        }
    }
}

/* An f16 scale's f32 value: the hardware conversion, exact (a NaN's payload aside: the
 * product is NaN either way). */
static __device__ __forceinline__ float q8a_h2f(uint32_t h) {
    return __half2float(__ushort_as_half((unsigned short)(h & 0xffffu)));
}

/* Row group g's ROWS rows (global rows g * ROWS + i: the jobs' rows one after another, job
 * j's first is job[j].blk0; rows past the last read the last row and are not written): each
 * row's job and index in it, and the weight rows' addresses (P = 2: the gate's and the up's). */
template <int ROWS, int P>
static __device__ __forceinline__ void q8a_group(const prod_jobs &jobs, int64_t g, int64_t rows,
                                                 const uint8_t *(&rowp)[ROWS * P],
                                                 int (&jb)[ROWS], int64_t (&r)[ROWS]) {
#pragma unroll
    for (int i = 0; i < ROWS; i++) {
        int64_t gr = g * ROWS + i;
        gr = gr < rows ? gr : rows - 1;
        int j = 0;
        while (j + 1 < jobs.n && gr >= (int64_t)jobs.job[j + 1].blk0) j++;
        const prod_job &J = jobs.job[j];
        jb[i] = j;
        r[i] = gr - (int64_t)J.blk0;
        rowp[i * P] = J.w + (size_t)r[i] * J.row_bytes;
        if constexpr (P == 2) rowp[i * P + 1] = J.w_up + (size_t)r[i] * J.row_bytes;
    }
}

/* Row group g's outputs from its warp's sums acc (every lane holds them: a row's sum, or a
 * pair's gate and up sums side by side): + bias, swiglu(gate, up) for a pair, + res; lane
 * (i * NT + t) % 32 writes row i's token t. */
template <int ROWS, int NT, bool PAIR>
static __device__ __forceinline__ void q8a_store(const prod_jobs &jobs, const int (&jb)[ROWS],
                                                 const int64_t (&r)[ROWS],
                                                 const float (&acc)[ROWS * (PAIR ? 2 : 1)][NT],
                                                 int64_t g, int64_t rows, int n0, int nt, int lane) {
    constexpr int P = PAIR ? 2 : 1;
#pragma unroll
    for (int i = 0; i < ROWS; i++) {
        const prod_job &J = jobs.job[jb[i]];
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt && lane == (i * NT + t) % 32 && g * ROWS + i < rows) {
                float s = acc[i * P][t];
                if (J.bias) s = s + J.bias[r[i]];
                if constexpr (PAIR) {
                    float u = acc[i * P + 1][t];
                    if (J.bias_up) u = u + J.bias_up[r[i]];
                    s = kiln_swiglu(s, u);
                }
                const int64_t at = (int64_t)(n0 + t) * J.R + r[i];
                if (J.res) s = s + J.res[at];
                J.out[at] = s;
            }
        }
    }
}

/* Grid: x = blocks of Q8A_WARPS warps, each warp grid-stride over groups of ROWS rows of the
 * jobs (PAIR: a row is the gate row and the up row, walked side by side); y = tiles of NT
 * tokens. A: the blocks' alignment (q8a<DT>::ALIGN, or 1: byte loads). UNR blocks per lane
 * per step, for each of the group's rows. */
template <int DT, int NT, int ROWS, int UNR, bool PAIR, int A>
static __global__ void __launch_bounds__(Q8A_THREADS, Q8A_MIN_BLOCKS)
q8act_kernel(const __grid_constant__ prod_jobs jobs, const float *__restrict__ x, int64_t C,
             int N, int64_t rows) {
    using Q = q8a<DT>;
    constexpr int P = PAIR ? 2 : 1, RW = ROWS * P; /* weight rows a warp walks side by side */
    extern __shared__ __align__(16) uint8_t q8a_smem[];
    __shared__ float sr[NT];
    const int nb = (int)(C / 32);
    const int n0 = blockIdx.y * NT, nt = min(NT, N - n0);
    int8_t *xq = (int8_t *)q8a_smem;
    float *xd = (float *)(q8a_smem + (size_t)NT * nb * 32);
    float *xe = xd + NT * nb;
    const int lane = threadIdx.x & 31, j = lane >> 2, p = lane & 3;
    const int64_t groups = (rows + ROWS - 1) / ROWS, gstride = (int64_t)gridDim.x * Q8A_WARPS;
    int64_t g = (int64_t)blockIdx.x * Q8A_WARPS + (threadIdx.x >> 5);
    const uint8_t *rowp[RW];
    int jb[ROWS];
    int64_t r[ROWS];
    if (g < groups) q8a_group<ROWS, P>(jobs, g, rows, rowp, jb, r);

    pdl_wait(); /* launched by launch_pdl: x (and, in training, the weights) the kernels before's */
    pdl_launch_dependents();
    /* the warp's first loads fly while the block quantizes its tokens */
    uint32_t qw[UNR][RW][Q::NW], hd[UNR][RW];
    if (g < groups) q8a_load<DT, UNR, RW, A>(qw, hd, rowp, j, 8, nb, p);
    if (jobs.norm_w) norm_prologue(sr, x, C, n0, nt, jobs.eps);
    q8a_quantize<DT>(xq, xd, xe, x, C, n0, nt, sr, jobs.norm_w);
    __syncthreads();

    for (bool first = true; g < groups; first = false) {
        float acc[RW][NT];
#pragma unroll
        for (int i = 0; i < RW; i++)
#pragma unroll
            for (int t = 0; t < NT; t++) acc[i][t] = 0.0f;
        for (int b0 = 0; b0 < nb; b0 += 8 * UNR) {
            if (!(first && b0 == 0)) q8a_load<DT, UNR, RW, A>(qw, hd, rowp, b0 + j, 8, nb, p);
#pragma unroll
            for (int u = 0; u < UNR; u++) {
                if (b0 + 8 * u >= nb) break; /* the same for the whole warp */
                const int b = b0 + 8 * u + j;
                const bool live = b < nb;
                const int bb = live ? b : 0;
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    if (t >= nt) break;
                    const int8_t *xb = xq + ((size_t)t * nb + bb) * 32;
                    int x0, x1; /* the token's int8 values matching the lane's weight words */
                    if constexpr (DT == KILN_DTYPE_Q8_0) {
                        const int2 v = *(const int2 *)(xb + 8 * p);
                        x0 = v.x, x1 = v.y;
                    } else { /* low nibbles: values 4p..4p+3; high nibbles: 16 + 4p.. */
                        x0 = *(const int *)(xb + 4 * p);
                        x1 = *(const int *)(xb + 16 + 4 * p);
                    }
                    const float dx = xd[t * nb + bb];
                    const float ex = xe[t * nb + bb];
#pragma unroll
                    for (int i = 0; i < RW; i++) {
                        int isum = 0;
                        if (live) {
                            if constexpr (DT == KILN_DTYPE_Q8_0) {
                                isum = __dp4a((int)qw[u][i][0], x0, 0);
                                isum = __dp4a((int)qw[u][i][1], x1, isum);
                            } else {
                                isum = __dp4a((int)(qw[u][i][0] & 0x0f0f0f0fu), x0, 0);
                                isum = __dp4a((int)((qw[u][i][0] >> 4) & 0x0f0f0f0fu), x1, isum);
                            }
                        }
                        isum += __shfl_xor_sync(0xffffffffu, isum, 1); /* the block's exact sum */
                        isum += __shfl_xor_sync(0xffffffffu, isum, 2);
                        if (live) {
                            const float dw = q8a_h2f(hd[u][i]);
                            if constexpr (DT == KILN_DTYPE_Q4_0) isum -= 8 * __float_as_int(ex);
                            acc[i][t] = __fmaf_rn(__fmul_rn(dw, dx), (float)isum, acc[i][t]);
                            if constexpr (DT == KILN_DTYPE_Q4_1)
                                acc[i][t] = __fmaf_rn(q8a_h2f(hd[u][i] >> 16), ex, acc[i][t]);
                        }
                    }
                }
            }
        }

        /* the fixed tree s4[j] = acc[j] + acc[j + 4], s2[j] = s4[j] + s4[j + 2], s2[0] + s2[1]:
         * lane 4j + p's partners j ^ 4, j ^ 2, j ^ 1 are lanes ^ 16, ^ 8, ^ 4 */
#pragma unroll
        for (int i = 0; i < RW; i++)
#pragma unroll
            for (int t = 0; t < NT; t++) {
                float v = acc[i][t];
                v = v + __shfl_xor_sync(0xffffffffu, v, 16);
                v = v + __shfl_xor_sync(0xffffffffu, v, 8);
                v = v + __shfl_xor_sync(0xffffffffu, v, 4);
                acc[i][t] = v;
            }
        q8a_store<ROWS, NT, PAIR>(jobs, jb, r, acc, g, rows, n0, nt, lane);
        g += gstride;
        if (g < groups) q8a_group<ROWS, P>(jobs, g, rows, rowp, jb, r);
    }
}

/* The token tile for N tokens of nb blocks: the largest of 1, 2, 4, 8 at most N's tile whose
 * quantized tokens fit Q8A_MAX_SMEM; 0 when one token does not. */
static int q8a_tile(int N, int64_t nb) {
    int nt = N == 1 ? 1 : N == 2 ? 2 : N <= 4 ? 4 : 8;
    while (nt > 1 && (int64_t)nt * nb * Q8A_BLOCK_SMEM > Q8A_MAX_SMEM) nt /= 2;
    return nb * Q8A_BLOCK_SMEM <= Q8A_MAX_SMEM ? nt : 0;
}

/* The blocks of k that run at once on the current device with smem bytes of dynamic shared
 * memory (SMs x blocks an SM holds; a launch-shape choice only: no bit depends on it), worked
 * out once per (kernel, smem, device) and kept: fast decode launches these products dozens of
 * times a step, and the occupancy query costs host time on each. Where smem passes the
 * default 48 KiB, k's limit is raised to Q8A_MAX_SMEM (q8a_tile keeps every tile within it)
 * the first time. */
#define Q8A_SHAPES 256
struct q8a_shape {
    const void *fn;
    size_t smem;
    int dev, blocks;
};
static pthread_mutex_t q8a_shapes_mu = PTHREAD_MUTEX_INITIALIZER;
static q8a_shape q8a_shapes[Q8A_SHAPES];
static int q8a_n_shapes;

template <class K> static cudaError_t q8a_blocks(K k, size_t smem, int64_t *blocks) {
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    pthread_mutex_lock(&q8a_shapes_mu);
    for (int i = 0; i < q8a_n_shapes; i++) {
        const q8a_shape &sh = q8a_shapes[i];
        if (sh.fn == (const void *)k && sh.smem == smem && sh.dev == dev) {
            *blocks = sh.blocks;
            pthread_mutex_unlock(&q8a_shapes_mu);
            return cudaSuccess;
        }
    }
    if (smem > 48 * 1024) e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, Q8A_MAX_SMEM);
    int per_sm = 0, sms = 0;
    if (e == cudaSuccess) {
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, Q8A_THREADS, smem) != cudaSuccess ||
            per_sm < 1)
            per_sm = 1;
        if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms < 1)
            sms = 1;
        *blocks = (int64_t)per_sm * sms;
        if (q8a_n_shapes < Q8A_SHAPES) q8a_shapes[q8a_n_shapes++] = q8a_shape{(const void *)k, smem, dev, per_sm * sms};
    }
    pthread_mutex_unlock(&q8a_shapes_mu);
    return e;
}

/* Launches k (q8act_kernel or kq_kernel: Q8A_THREADS threads, token tiles of NT, groups of
 * ROWS rows a warp) over the jobs' rows, its tiles' quantized tokens in dynamic shared memory. */
template <class K>
static cudaError_t q8a_persist(K k, int NT, int ROWS, cudaStream_t s, const prod_jobs &a,
                               int64_t rows, const float *x, int64_t C, int N) {
    const size_t smem = (size_t)NT * (size_t)(C / 32) * Q8A_BLOCK_SMEM;
    /* grid-stride: no more blocks than run at once (a block that waits for a slot would start
     * its rows late) */
    int64_t cap = 0;
    const cudaError_t e = q8a_blocks(k, smem, &cap);
    if (e != cudaSuccess) return e;
    const int64_t need = ((rows + ROWS - 1) / ROWS + Q8A_WARPS - 1) / Q8A_WARPS;
    const unsigned gx = (unsigned)(need < cap ? need : cap);
    return launch_pdl(k, dim3(gx, (unsigned)((N + NT - 1) / NT)), dim3(Q8A_THREADS), smem, s, a, x,
                      C, N, rows);
}

template <int DT, int NT, int ROWS, int UNR, bool PAIR, int A>
static cudaError_t q8a_launch_k(cudaStream_t s, const prod_jobs &a, int64_t rows, const float *x,
                                int64_t C, int N) {
    return q8a_persist(q8act_kernel<DT, NT, ROWS, UNR, PAIR, A>, NT, ROWS, s, a, rows, x, C, N);
}

/* Rows of a launch past which a warp takes several rows at once (ROWS = 4, a pair 2): enough
 * warps to fill the GPU either way; below it one row a warp with more blocks ahead. */
#define Q8A_MANY_ROWS 4096

template <int DT>
static cudaError_t q8a_launch(cudaStream_t s, prod_jobs *a, bool pair, const float *x, int64_t C,
                              int N) {
    constexpr int AL = q8a<DT>::ALIGN;
    bool aligned = true;
    int64_t rows = 0;
    for (int j = 0; j < a->n; j++) {
        const prod_job &J = a->job[j];
        if (J.row_bytes < (size_t)(C / 32) * q8a<DT>::TS) return cudaErrorInvalidValue;
        aligned = aligned && (uintptr_t)J.w % AL == 0 && (uintptr_t)J.w_up % AL == 0 && J.row_bytes % AL == 0;
    }
    /* nothing enqueued: the caller runs them otherwise (a pair separately; C past the tile) */
    if ((pair && !aligned) || q8a_tile(N, C / 32) == 0) return cudaErrorNotSupported;
    for (int j = 0; j < a->n; j++) { /* blk0: the job's first global row */
        if (rows > 0xffffffffll) return cudaErrorInvalidConfiguration;
        a->job[j].blk0 = (unsigned)rows;
        rows += a->job[j].R;
    }
    if (!aligned) /* rare (a file's tensors are aligned): one tile, byte loads, same bits */
        return q8a_launch_k<DT, 1, 1, 4, false, 1>(s, *a, rows, x, C, N);
    const bool many = rows >= Q8A_MANY_ROWS;
    /* 20 (Q8_0 at 8 tokens) to 80 bytes of weights in flight per lane */
    switch (q8a_tile(N, C / 32)) {
    case 1:
        if (pair) return many ? q8a_launch_k<DT, 1, 2, 2, true, AL>(s, *a, rows, x, C, N)
                              : q8a_launch_k<DT, 1, 1, 4, true, AL>(s, *a, rows, x, C, N);
        return many ? q8a_launch_k<DT, 1, 4, 2, false, AL>(s, *a, rows, x, C, N)
                    : q8a_launch_k<DT, 1, 1, 8, false, AL>(s, *a, rows, x, C, N);
    case 2:
        if (pair) return many ? q8a_launch_k<DT, 2, 2, 2, true, AL>(s, *a, rows, x, C, N)
                              : q8a_launch_k<DT, 2, 1, 4, true, AL>(s, *a, rows, x, C, N);
        return many ? q8a_launch_k<DT, 2, 4, 2, false, AL>(s, *a, rows, x, C, N)
                    : q8a_launch_k<DT, 2, 1, 8, false, AL>(s, *a, rows, x, C, N);
    case 4: return pair ? q8a_launch_k<DT, 4, 1, 2, true, AL>(s, *a, rows, x, C, N)
                        : q8a_launch_k<DT, 4, 1, 4, false, AL>(s, *a, rows, x, C, N);
    default: return pair ? q8a_launch_k<DT, 8, 1, 1, true, AL>(s, *a, rows, x, C, N)
                         : q8a_launch_k<DT, 8, 1, 2, false, AL>(s, *a, rows, x, C, N);
    }
}

bool kiln_cuda_q8act_supported(kiln_dtype dt) {
    return dt == KILN_DTYPE_Q8_0 || dt == KILN_DTYPE_Q4_0 || dt == KILN_DTYPE_Q4_1;
}

cudaError_t kiln_cuda_q8act_multi_norm(cudaStream_t s, int n, const kiln_cuda_product_job *jobs,
                                       kiln_dtype dt, const float *x, const float *norm_w,
                                       float eps, int64_t C, int N) {
    bool pair = false;
    if (!kiln_cuda_q8act_supported(dt) || !product_jobs_ok(n, jobs, x, C, N, &pair) ||
        (uintptr_t)norm_w % 4 || C % 32 || C > INT_MAX || (N + 7) / 8 > 65535)
        return cudaErrorInvalidValue;
    prod_jobs a = prod_jobs_of(n, jobs, norm_w, eps);
    switch (dt) {
    case KILN_DTYPE_Q8_0: return q8a_launch<KILN_DTYPE_Q8_0>(s, &a, pair, x, C, N);
    case KILN_DTYPE_Q4_0: return q8a_launch<KILN_DTYPE_Q4_0>(s, &a, pair, x, C, N);
    default: return q8a_launch<KILN_DTYPE_Q4_1>(s, &a, pair, x, C, N);
    }
}

/* =================================================================================================
 * Fast: decode products of K-quant and Q5_0 weights (Q4_K, Q5_K, Q6_K, Q5_0: the types of a
 * Q4_K_M file) on 8-bit activations -- the
 * arithmetic llama.cpp's CUDA decode uses (its q8_1 activations), in a fixed order, so that a
 * token's outputs are the same bits whatever N and the other tokens are.
 *
 * The tokens are quantized as the int8-activation product above quantizes them (q8a_quantize:
 * blocks of 32, d = amax / 127, q = round-half-even(v * (127 / amax)), the integer sums of the
 * block's two halves of 16). A row's C / 32 "units" of 32 weights (unit u: superblock u / 8,
 * part u % 8; Q5_0 block u) go to lanes u % 32 of its warp, each lane walking its units in increasing order;
 * a unit's dot with each activation block it meets is an exact integer sum (dp4a), and the
 * lane accumulates, in f32 with one rounding each (fmaf):
 *   Q4_K / Q5_K, part s = 2c + h: the weights of groups g = 2c (low nibbles) and 2c + 1 (high)
 *     at l = 16h .. 16h + 15 meet activation blocks A = 8b + 2c and A + 1 at the same 16;
 *     for each (A: scale sc, min m of group 2c; then A + 1): acc = fmaf(d * dA, sc * dot,
 *     acc), acc = fmaf(-(dmin * dA), m * sumA, acc), dot the integer dot of the 16 quants with
 *     the 16 int8 values and sumA the sum of those 16 values;
 *   Q6_K, part s = 4H + j: l = 8j .. 8j + 7 of half H, its 4 groups k = 0..3 (elements
 *     128H + 32k + l) meet activation blocks 8b + 4H + k at l: acc = fmaf(d * dk, sc * dot,
 *     acc) in k order, dot the integer dot of (q - 32) with the 8 int8 values, sc the int8
 *     scale of the group's 16;
 *   Q5_0, block u: acc = fmaf(d * du, dot, acc), dot the integer dot of (q - 16) with
 *     activation block u.
 * Then the xor tree over the 32 lanes (16, 8, 4, 2, 1), then bias, swiglu (a pair), residual
 * as the other products. The order depends on C and the dtype only. tests/gpu/test_cuda_kq.cu
 * holds a host reference of this definition and checks the kernel against it bit for bit.
 *
 * Speed: one launch streams each weight byte once with 16-byte loads (Q4_K, Q5_K; Q6_K's
 * 210-byte superblocks and Q5_0's 22-byte blocks are read as aligned words and
 * funnel-shifted), four integer dot
 * instructions for 16 weights in place of the f32 kernel's dequantization per weight (which
 * bounds it at a fifth to a third of DRAM bandwidth: bench/RESULTS.md, 2026-12-06).
 * ============================================================================================== */

/* Words a lane keeps for one unit: Q4_K header (4) + quants (4); Q5_K + the 16 bytes of
 * fifth bits; Q6_K two 8-byte runs of low bits, 8 bytes of high bits, the half's 8 scales, d;
 * Q5_0 qh, qs[16], d. */
template <int DT> struct kqu {
    static constexpr int NW = DT == KILN_DTYPE_Q4_K ? 8 : DT == KILN_DTYPE_Q5_K ? 12
                              : DT == KILN_DTYPE_Q6_K ? 9 : 6;
    static constexpr int ALIGN = DT == KILN_DTYPE_Q4_K || DT == KILN_DTYPE_Q5_K ? 16 : 2;
    /* weights of a block */
    static constexpr int QK = DT == KILN_DTYPE_Q5_0 ? 32 : 256;
};

/* NW words from p, which is 2-byte aligned: aligned 32-bit loads and a funnel shift. Nothing
 * past p + 4 NW is read (the last load is 16 bits when p is not 4-byte aligned, and re-reads
 * the word before it when it is); the 2 bytes before p are (p is inside a row: a tensor's
 * start is aligned). */
template <int NW>
static __device__ __forceinline__ void ldw_a2(const uint8_t *__restrict__ p, uint32_t *o) {
    const uintptr_t a = (uintptr_t)p;
    const uint32_t *q = (const uint32_t *)(a & ~(uintptr_t)3);
    const unsigned sh = (unsigned)(a & 2u) * 8u;
    uint32_t v[NW + 1];
#pragma unroll
    for (int i = 0; i < NW; i++) v[i] = __ldcs(q + i);
    v[NW] = sh ? (uint32_t)__ldcs((const unsigned short *)(q + NW)) : __ldcs(q + NW - 1);
#pragma unroll
    for (int i = 0; i < NW; i++) o[i] = __funnelshift_r(v[i], v[i + 1], sh);
}

/* Unit u of the row at row into w. */
template <int DT>
static __device__ __forceinline__ void kq_load(uint32_t *w, const uint8_t *__restrict__ row, int u) {
    const int b = u >> 3, s = u & 7;
    if constexpr (DT == KILN_DTYPE_Q4_K) { /* d dmin scales[12] | qs[128] */
        const uint8_t *p = row + (size_t)b * 144;
        ldw<16, 4>(p, w);
        ldw<16, 4>(p + 16 + 16 * s, w + 4);
    } else if constexpr (DT == KILN_DTYPE_Q5_K) { /* d dmin scales[12] | qh[32] | qs[128] */
        const uint8_t *p = row + (size_t)b * 176;
        ldw<16, 4>(p, w);
        ldw<16, 4>(p + 16 + 16 * (s & 1), w + 4);
        ldw<16, 4>(p + 48 + 16 * s, w + 8);
    } else if constexpr (DT == KILN_DTYPE_Q5_0) { /* d | qh[4] | qs[16] */
        const uint8_t *p = row + (size_t)u * 22;
        ldw_a2<5>(p + 2, w);
        w[5] = ld16<2>(p);
    } else { /* Q6_K: ql[128] | qh[64] | scales[16] | d */
        const uint8_t *p = row + (size_t)b * 210;
        const int H = s >> 2, j = s & 3;
        ldw_a2<2>(p + 64 * H + 8 * j, w);
        ldw_a2<2>(p + 64 * H + 32 + 8 * j, w + 2);
        ldw_a2<2>(p + 128 + 32 * H + 8 * j, w + 4);
        ldw_a2<2>(p + 192 + 8 * H, w + 6);
        w[8] = ld16<2>(p + 208);
    }
}

/* Half h (0: values 0..15) of an activation block's packed sums. */
static __device__ __forceinline__ int kq_half(float packed, int h) {
    const int v = __float_as_int(packed);
    return h ? v >> 16 : (int)(short)(v & 0xffff);
}

/* Unit u (words w) against the nt tokens of the tile: acc[t] per the definition above. xq,
 * xd, xe: the tile's quantized tokens (nb blocks each). */
template <int DT, int NT>
static __device__ __forceinline__ void kq_unit(const uint32_t *w, int u, const int8_t *xq,
                                               const float *xd, const float *xe, int nb, int nt,
                                               float (&acc)[NT]) {
    const int b = u >> 3, s = u & 7;
    if constexpr (DT == KILN_DTYPE_Q4_K || DT == KILN_DTYPE_Q5_K) {
        const int c = s >> 1, h = s & 1;
        const float d = fp16_f32(w[0] & 0xffffu), dmin = fp16_f32(w[0] >> 16);
        uint32_t sc0, mn0, sc1, mn1;
        k_scale_min_w(w[1], w[2], w[3], 2 * c, &sc0, &mn0);
        k_scale_min_w(w[1], w[2], w[3], 2 * c + 1, &sc1, &mn1);
        constexpr int Q = DT == KILN_DTYPE_Q4_K ? 4 : 8;
        int lo[4], hi[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            uint32_t l4 = w[Q + k] & 0x0f0f0f0fu, h4 = (w[Q + k] >> 4) & 0x0f0f0f0fu;
            if constexpr (DT == KILN_DTYPE_Q5_K) { /* fifth bits: bit 2c (low), 2c + 1 of qh[l] */
                l4 |= ((w[4 + k] >> (2 * c)) & 0x01010101u) << 4;
                h4 |= ((w[4 + k] >> (2 * c + 1)) & 0x01010101u) << 4;
            }
            lo[k] = (int)l4, hi[k] = (int)h4;
        }
        const int A = 8 * b + 2 * c;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t >= nt) break;
            const int8_t *xt = xq + (size_t)t * nb * 32;
            const int4 xa = *(const int4 *)(xt + (size_t)A * 32 + 16 * h);
            const int4 xb = *(const int4 *)(xt + (size_t)(A + 1) * 32 + 16 * h);
            int da = __dp4a(lo[0], xa.x, 0), db = __dp4a(hi[0], xb.x, 0);
            da = __dp4a(lo[1], xa.y, da), db = __dp4a(hi[1], xb.y, db);
            da = __dp4a(lo[2], xa.z, da), db = __dp4a(hi[2], xb.z, db);
            da = __dp4a(lo[3], xa.w, da), db = __dp4a(hi[3], xb.w, db);
            const float dA = xd[t * nb + A], dB = xd[t * nb + A + 1];
            const int sA = kq_half(xe[t * nb + A], h), sB = kq_half(xe[t * nb + A + 1], h);
            float a = acc[t];
            a = __fmaf_rn(__fmul_rn(d, dA), (float)((int)sc0 * da), a);
            a = __fmaf_rn(-__fmul_rn(dmin, dA), (float)((int)mn0 * sA), a);
            a = __fmaf_rn(__fmul_rn(d, dB), (float)((int)sc1 * db), a);
            a = __fmaf_rn(-__fmul_rn(dmin, dB), (float)((int)mn1 * sB), a);
            acc[t] = a;
        }
    } else if constexpr (DT == KILN_DTYPE_Q5_0) { /* q - 16: low nibbles values 0..15 */
        const float d = fp16_f32(w[5]);
        int lo[4], hi[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            lo[k] = (int)((w[1 + k] & 0x0f0f0f0fu) | hb4(w[0] >> (4 * k)));
            hi[k] = (int)(((w[1 + k] >> 4) & 0x0f0f0f0fu) | hb4(w[0] >> (16 + 4 * k)));
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t >= nt) break;
            const int8_t *xb = xq + ((size_t)t * nb + u) * 32;
            const int4 xa = *(const int4 *)xb, xc = *(const int4 *)(xb + 16);
            int dot = __dp4a(lo[0], xa.x, 0);
            dot = __dp4a(lo[1], xa.y, dot), dot = __dp4a(lo[2], xa.z, dot);
            dot = __dp4a(lo[3], xa.w, dot), dot = __dp4a(hi[0], xc.x, dot);
            dot = __dp4a(hi[1], xc.y, dot), dot = __dp4a(hi[2], xc.z, dot);
            dot = __dp4a(hi[3], xc.w, dot);
            const float e = xe[t * nb + u];
            dot -= 16 * (kq_half(e, 0) + kq_half(e, 1));
            acc[t] = __fmaf_rn(__fmul_rn(d, xd[t * nb + u]), (float)dot, acc[t]);
        }
    } else { /* Q6_K */
        const int H = s >> 2, j = s & 3;
        const float d = fp16_f32(w[8]);
        int q[4][2], sc[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int e = 2 * k + (j >> 1); /* the group's scale among the half's 8 */
            sc[k] = (int)(int8_t)((w[6 + (e >> 2)] >> (8 * (e & 3))) & 0xffu);
#pragma unroll
            for (int m = 0; m < 2; m++) {
                const uint32_t ql = w[(k & 1) * 2 + m];
                const uint32_t l4 = k < 2 ? ql & 0x0f0f0f0fu : (ql >> 4) & 0x0f0f0f0fu;
                q[k][m] = (int)(l4 | (((w[4 + m] >> (2 * k)) & 0x03030303u) << 4));
            }
        }
        const int A = 8 * b + 4 * H;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t >= nt) break;
            const int8_t *xt = xq + (size_t)t * nb * 32 + 8 * j;
            float a = acc[t];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int2 xv = *(const int2 *)(xt + (size_t)(A + k) * 32);
                const int dot = __dp4a(q[k][0], xv.x, __dp4a(q[k][1], xv.y, 0)) -
                                __dp4a(0x20202020, xv.x, __dp4a(0x20202020, xv.y, 0));
                a = __fmaf_rn(__fmul_rn(d, xd[t * nb + A + k]), (float)(sc[k] * dot), a);
            }
            acc[t] = a;
        }
    }
}

/* Units base + 32 u (u < UNR; those < nb) of the RW rows. */
template <int DT, int UNR, int RW>
static __device__ __forceinline__ void kq_load_step(uint32_t (&w)[UNR][RW][kqu<DT>::NW],
                                                    const uint8_t *const (&rowp)[RW], int base,
                                                    int nb) {
#pragma unroll
    for (int u = 0; u < UNR; u++) {
        if (base + 32 * u >= nb) continue;
#pragma unroll
        for (int i = 0; i < RW; i++) kq_load<DT>(w[u][i], rowp[i], base + 32 * u);
    }
}

/* blocks an SM holds at once (Q5_K, whose units are 12 words, 2) */
#define KQ_MIN_BLOCKS 3

/* Grid as q8act_kernel's: x = blocks of Q8A_WARPS warps grid-stride over groups of ROWS rows
 * (PAIR: a row's gate and up side by side), y = tiles of NT tokens; UNR steps of 32 units a
 * lane loaded ahead. */
template <int DT, int NT, int ROWS, int UNR, bool PAIR>
static __global__ void __launch_bounds__(Q8A_THREADS, DT == KILN_DTYPE_Q5_K ? 2 : KQ_MIN_BLOCKS)
kq_kernel(const __grid_constant__ prod_jobs jobs, const float *__restrict__ x, int64_t C, int N,
          int64_t rows) {
    constexpr int P = PAIR ? 2 : 1, RW = ROWS * P;
    extern __shared__ __align__(16) uint8_t kq_smem[];
    __shared__ float sr[NT];
    const int nb = (int)(C / 32);
    const int n0 = blockIdx.y * NT, nt = min(NT, N - n0);
    int8_t *xq = (int8_t *)kq_smem;
    float *xd = (float *)(kq_smem + (size_t)NT * nb * 32);
    float *xe = xd + NT * nb;
    const int lane = threadIdx.x & 31;
    const int64_t groups = (rows + ROWS - 1) / ROWS, gstride = (int64_t)gridDim.x * Q8A_WARPS;
    int64_t g = (int64_t)blockIdx.x * Q8A_WARPS + (threadIdx.x >> 5);
    const uint8_t *rowp[RW];
    int jb[ROWS];
    int64_t r[ROWS];
    if (g < groups) q8a_group<ROWS, P>(jobs, g, rows, rowp, jb, r);

    pdl_wait();
    pdl_launch_dependents();
    uint32_t w[UNR][RW][kqu<DT>::NW];
    if (g < groups) kq_load_step<DT, UNR, RW>(w, rowp, lane, nb);
    if (jobs.norm_w) norm_prologue(sr, x, C, n0, nt, jobs.eps);
    q8a_quantize<DT>(xq, xd, xe, x, C, n0, nt, sr, jobs.norm_w);
    __syncthreads();

    for (bool first = true; g < groups; first = false) {
        float acc[RW][NT];
#pragma unroll
        for (int i = 0; i < RW; i++)
#pragma unroll
            for (int t = 0; t < NT; t++) acc[i][t] = 0.0f;
        for (int u0 = 0; u0 < nb; u0 += 32 * UNR) {
            if (!(first && u0 == 0)) kq_load_step<DT, UNR, RW>(w, rowp, u0 + lane, nb);
#pragma unroll
            for (int u = 0; u < UNR; u++) {
                if (u0 + 32 * u >= nb) break; /* the same for the whole warp */
                const int unit = u0 + 32 * u + lane;
                if (unit < nb) {
#pragma unroll
                    for (int i = 0; i < RW; i++) kq_unit<DT, NT>(w[u][i], unit, xq, xd, xe, nb, nt, acc[i]);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < RW; i++)
#pragma unroll
            for (int t = 0; t < NT; t++) {
                float v = acc[i][t];
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) v = v + __shfl_xor_sync(0xffffffffu, v, o);
                acc[i][t] = v;
            }
        q8a_store<ROWS, NT, PAIR>(jobs, jb, r, acc, g, rows, n0, nt, lane);
        g += gstride;
        if (g < groups) q8a_group<ROWS, P>(jobs, g, rows, rowp, jb, r);
    }
}

template <int DT, int NT, int ROWS, int UNR, bool PAIR>
static cudaError_t kq_launch_k(cudaStream_t s, const prod_jobs &a, int64_t rows, const float *x,
                               int64_t C, int N) {
    return q8a_persist(kq_kernel<DT, NT, ROWS, UNR, PAIR>, NT, ROWS, s, a, rows, x, C, N);
}

template <int DT>
static cudaError_t kq_launch(cudaStream_t s, prod_jobs *a, bool pair, const float *x, int64_t C,
                             int N) {
    constexpr int AL = kqu<DT>::ALIGN;
    int64_t rows = 0;
    for (int j = 0; j < a->n; j++) {
        const prod_job &J = a->job[j];
        if (J.row_bytes < (size_t)(C / kqu<DT>::QK) * blk<DT>::TS) return cudaErrorInvalidValue;
        if ((uintptr_t)J.w % AL || (uintptr_t)J.w_up % AL || J.row_bytes % AL)
            return cudaErrorNotSupported; /* nothing enqueued: another kernel takes them */
    }
    const int nt = q8a_tile(N, C / 32);
    if (nt == 0) return cudaErrorNotSupported;
    for (int j = 0; j < a->n; j++) {
        if (rows > 0xffffffffll) return cudaErrorInvalidConfiguration;
        a->job[j].blk0 = (unsigned)rows;
        rows += a->job[j].R;
    }
    const bool many = rows >= Q8A_MANY_ROWS;
    switch (nt) {
    case 1:
        if (pair) return kq_launch_k<DT, 1, 1, 2, true>(s, *a, rows, x, C, N);
        return many ? kq_launch_k<DT, 1, 2, 2, false>(s, *a, rows, x, C, N)
                    : kq_launch_k<DT, 1, 1, 4, false>(s, *a, rows, x, C, N);
    case 2:
        if (pair) return kq_launch_k<DT, 2, 1, 2, true>(s, *a, rows, x, C, N);
        return many ? kq_launch_k<DT, 2, 2, 2, false>(s, *a, rows, x, C, N)
                    : kq_launch_k<DT, 2, 1, 4, false>(s, *a, rows, x, C, N);
    case 4: return pair ? kq_launch_k<DT, 4, 1, 1, true>(s, *a, rows, x, C, N)
                        : kq_launch_k<DT, 4, 1, 2, false>(s, *a, rows, x, C, N);
    default: return pair ? kq_launch_k<DT, 8, 1, 1, true>(s, *a, rows, x, C, N)
                         : kq_launch_k<DT, 8, 1, 2, false>(s, *a, rows, x, C, N);
    }
}

bool kiln_cuda_kq_supported(kiln_dtype dt) {
    return dt == KILN_DTYPE_Q4_K || dt == KILN_DTYPE_Q5_K || dt == KILN_DTYPE_Q6_K ||
           dt == KILN_DTYPE_Q5_0;
}

cudaError_t kiln_cuda_kq_multi_norm(cudaStream_t s, int n, const kiln_cuda_product_job *jobs,
                                    kiln_dtype dt, const float *x, const float *norm_w, float eps,
                                    int64_t C, int N) {
    bool pair = false;
    if (!kiln_cuda_kq_supported(dt) || !product_jobs_ok(n, jobs, x, C, N, &pair) ||
        (uintptr_t)norm_w % 4 || C % (dt == KILN_DTYPE_Q5_0 ? 32 : 256) || C > INT_MAX ||
        (N + 7) / 8 > 65535)
        return cudaErrorInvalidValue;
    prod_jobs a = prod_jobs_of(n, jobs, norm_w, eps);
    switch (dt) {
    case KILN_DTYPE_Q5_0: return kq_launch<KILN_DTYPE_Q5_0>(s, &a, pair, x, C, N);
    case KILN_DTYPE_Q4_K: return kq_launch<KILN_DTYPE_Q4_K>(s, &a, pair, x, C, N);
    case KILN_DTYPE_Q5_K: return kq_launch<KILN_DTYPE_Q5_K>(s, &a, pair, x, C, N);
    default: return kq_launch<KILN_DTYPE_Q6_K>(s, &a, pair, x, C, N);
    }
}
