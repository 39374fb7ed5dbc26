/*
 * cuda_norm.cu -- RMSNorm on the GPU, every mode and both directions, with the column sums
 * of its weight gradient, and their launchers (contracts: cuda_norm.h). In order:
 *   - the auditable forward: a half-warp per row, the lane-16 dot, f32 or bf16 outputs;
 *   - the auditable column sums (col_lanes: rmsnorm's dw, and the matmul backward's dbias);
 *   - the auditable backward: a half-warp per row, then dw by the column lanes;
 *   - the fast column sums: row chunks summed in double in a fixed order (rmsnorm's dw and
 *     the fast matmul backward's dbias);
 *   - the fast rows: the backward's dx and rstd (and dw in the same pass) in an f32 order of
 *     their own, and the forward with bf16 output whose r has the backward's bits.
 *
 * Auditable arithmetic: each kernel transcribes docs/ARITHMETIC.md (the backward ops: its
 * "Backward ops", as src/ops/cpu/backward_portable.c computes them): the same binary32
 * operations, in the same order, per output element, as the CPU reference. Parallelism only ever
 * splits work ACROSS output elements or across the 16 lanes of the defined dot product, never
 * along a sequential chain, so the bits cannot depend on the launch shape. Compiled with
 * --fmad=false (no a*b+c contraction: every FMA is a written __fmaf_rn / fmaf), IEEE division
 * and square root (nvcc's defaults without --use_fast_math) and no flush-to-zero.
 */
#include "cuda_norm.h"

#include "cuda_common.cuh"
#include "cuda_mma.cuh" /* cp.async */

#include "../../base/kmath.h"

#include <limits.h>
#include <string.h>

/* =================================================================================================
 * Auditable forward.
 * ============================================================================================== */

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

/* =================================================================================================
 * Auditable column sums.
 * ============================================================================================== */

/* ---- column lanes: out(W) += lane-16 over rows n of fmaf(a[n,c], bv, .) ------------------- */

/* For c < W: lane n % 16 does acc = fmaf(a[n*ld + c], bv, acc) for n ascending, with
 * bv = 1 (b NULL: a plain sum, dbias), b[n*ld + c] (s NULL) or b[n*ld + c] * s[n] (one
 * rounding: rmsnorm's x * r); then out[c] = out[c] + tree. The CPU's col_lanes.
 *
 * A block is CL_COLS = 8 columns x 16 lanes (128 threads): threadIdx.x the column,
 * threadIdx.y the lane, so a warp reads 4 lanes' rows of 8 consecutive columns (whole
 * 32-byte sectors). The chain of a (column, lane) is sequential over n by definition and is
 * never split; parallelism comes from many blocks (narrow blocks: C = 576 makes 72 blocks
 * where 32-column blocks made 18, each SM's load bandwidth was the limit) and from loading
 * CL_AHEAD of the lane's rows (n, n + 16, ...) into registers before their FMAs. The 16 lanes
 * meet in shared memory and one thread per column applies kiln_lane16_reduce. */
#define CL_AHEAD 16

/* MODE 0: bv = 1; 1: bv = b; 2: bv = b * s[n]. */
template <int MODE>
static __global__ void __launch_bounds__(CL_COLS * 16)
col_lanes_kernel(float *out, const float *__restrict__ a, const float *__restrict__ b,
                 const float *__restrict__ s, int64_t ld, int N, int64_t W) {
    __shared__ float part[16][CL_COLS + 1];
    const int tx = threadIdx.x, lane = threadIdx.y;
    const int64_t c = (int64_t)blockIdx.x * CL_COLS + tx;
    float acc = 0.0f;
    if (c < W) {
        for (int64_t n0 = lane; n0 < N; n0 += 16 * CL_AHEAD) {
            float av[CL_AHEAD], bv[CL_AHEAD];
#pragma unroll
            for (int u = 0; u < CL_AHEAD; u++) {
                const int64_t n = n0 + 16 * u;
                av[u] = 0.0f;
                bv[u] = 1.0f;
                if (n < N) {
                    av[u] = a[n * ld + c];
                    if (MODE == 1) bv[u] = b[n * ld + c];
                    if (MODE == 2) bv[u] = b[n * ld + c] * s[n];
                }
            }
#pragma unroll
            for (int u = 0; u < CL_AHEAD; u++)
                if (n0 + 16 * u < N) acc = __fmaf_rn(av[u], bv[u], acc);
        }
    }
    part[lane][tx] = acc;
    __syncthreads();
    if (lane == 0 && c < W) {
        float l[KILN_DOT_LANES];
#pragma unroll
        for (int q = 0; q < KILN_DOT_LANES; q++) l[q] = part[q][tx];
        out[c] = out[c] + kiln_lane16_reduce(l);
    }
}

/* Callers check (W + CL_COLS - 1) / CL_COLS <= INT_MAX. */
void kiln_cuda_col_lanes_launch(cudaStream_t s, float *out, const float *a, const float *b,
                                const float *sc, int64_t ld, int N, int64_t W) {
    const unsigned grid = (unsigned)((W + CL_COLS - 1) / CL_COLS);
    const dim3 block(CL_COLS, 16);
    if (!b) col_lanes_kernel<0><<<grid, block, 0, s>>>(out, a, b, sc, ld, N, W);
    else if (!sc) col_lanes_kernel<1><<<grid, block, 0, s>>>(out, a, b, sc, ld, N, W);
    else col_lanes_kernel<2><<<grid, block, 0, s>>>(out, a, b, sc, ld, N, W);
}

cudaError_t kiln_cuda_col_sum_exact(cudaStream_t s, float *out, const float *a, const float *b,
                                    const float *sc, int64_t ld, int N, int64_t W) {
    if (N <= 0 || W <= 0) return cudaSuccess;
    if (!out || !a || (sc && !b) || ld < W) return cudaErrorInvalidValue;
    if ((W + CL_COLS - 1) / CL_COLS > INT_MAX) return cudaErrorInvalidConfiguration;
    kiln_cuda_col_lanes_launch(s, out, a, b, sc, ld, N, W);
    return cudaGetLastError();
}

/* =================================================================================================
 * Auditable backward (the rows use the forward's RMS_ROWS_PER_BLOCK, RMS_THREADS and
 * RMS_CHUNK).
 * ============================================================================================== */

/* ---- rmsnorm backward: one half-warp per row, then dw by column lanes ---------------------- */

/* Row n: r = kiln_rms_scale(dot(x, x)) (the forward's r, written to rstd[n]); g = dy * w (or
 * dy); d = dot(g, x); u = ((d / C) * r) * r; dx = (g - x * u) * r, or dx + that.
 *
 * One half-warp per row, thread j = lane j of both dots: it owns elements i = j + 16k in
 * increasing k, exactly the defined lane order. The chains of fmaf are sequential by
 * definition, so speed comes from memory parallelism: the cached kernel (C <= 16 * E, E a
 * compile-time bound chosen at launch) loads the lane's x[i] and dy[i], w[i] (g = dy * w is
 * the reference's own rounding, formed once and kept) into registers before the first FMA,
 * and reuses them in all three passes; the chunked kernel (larger C) does each pass in
 * chunks of E elements per lane, loading a chunk before its FMAs. Elements past C are never
 * used by an fmaf (fmaf(0, 0, -0) would turn an accumulator of -0 into +0).
 *
 * Aliasing (cuda_norm.h): dx may be dy, so neither is __restrict__; x, w and rstd never
 * alias an output. Each element of dx is read (accumulate) and written by the thread that
 * read the same element of dy, after that read; the trees (which need every lane) order all
 * of a row's reads for the dots before any write. */

template <int E>
static __global__ void __launch_bounds__(RMS_THREADS)
rmsnorm_bwd_rows_cached_kernel(float *dx, const float *dy, const float *__restrict__ x,
                               const float *__restrict__ w, int N, int C, float eps,
                               float *__restrict__ rstd, bool accumulate) {
    const int lane = threadIdx.x & 15;
    const int64_t n = (int64_t)blockIdx.x * RMS_ROWS_PER_BLOCK + (threadIdx.x >> 4);
    if (n >= N) return; /* whole half-warps leave together */
    const unsigned mask = half_warp_mask();
    const float *xr = x + n * C, *dyr = dy + n * C;
    float *dxr = dx + n * C;
    float xv[E], gv[E];
#pragma unroll
    for (int k = 0; k < E; k++) {
        const int i = lane + 16 * k;
        xv[k] = i < C ? xr[i] : 0.0f;
        gv[k] = i < C ? dyr[i] : 0.0f;
    }
    if (w) {
#pragma unroll
        for (int k = 0; k < E; k++) {
            const int i = lane + 16 * k;
            if (i < C) gv[k] = gv[k] * w[i];
        }
    }
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < E; k++)
        if (lane + 16 * k < C) acc = __fmaf_rn(xv[k], xv[k], acc);
    const float r = kiln_rms_scale(lane16_tree(acc, mask), C, eps);
    if (lane == 0) rstd[n] = r;
    acc = 0.0f;
#pragma unroll
    for (int k = 0; k < E; k++)
        if (lane + 16 * k < C) acc = __fmaf_rn(gv[k], xv[k], acc);
    const float d = lane16_tree(acc, mask);
    const float u = ((d / (float)C) * r) * r;
    if (accumulate) {
        float ov[E];
#pragma unroll
        for (int k = 0; k < E; k++) {
            const int i = lane + 16 * k;
            ov[k] = i < C ? dxr[i] : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < E; k++) {
            const int i = lane + 16 * k;
            if (i < C) dxr[i] = ov[k] + (gv[k] - xv[k] * u) * r;
        }
    } else {
#pragma unroll
        for (int k = 0; k < E; k++) {
            const int i = lane + 16 * k;
            if (i < C) dxr[i] = (gv[k] - xv[k] * u) * r;
        }
    }
}

/* Any C: each pass in chunks of RMS_CHUNK elements per lane (16 * RMS_CHUNK per row; chunk
 * starts are multiples of 16, so every element keeps its lane). */
static __global__ void __launch_bounds__(RMS_THREADS)
rmsnorm_bwd_rows_chunked_kernel(float *dx, const float *dy, const float *__restrict__ x,
                                const float *__restrict__ w, int N, int C, float eps,
                                float *__restrict__ rstd, bool accumulate) {
    const int lane = threadIdx.x & 15;
    const int64_t n = (int64_t)blockIdx.x * RMS_ROWS_PER_BLOCK + (threadIdx.x >> 4);
    if (n >= N) return; /* whole half-warps leave together */
    const unsigned mask = half_warp_mask();
    const float *xr = x + n * C, *dyr = dy + n * C;
    float *dxr = dx + n * C;
    float xv[RMS_CHUNK], gv[RMS_CHUNK];
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
    if (lane == 0) rstd[n] = r;
    acc = 0.0f;
    for (int c0 = 0; c0 < C; c0 += 16 * RMS_CHUNK) {
#pragma unroll
        for (int k = 0; k < RMS_CHUNK; k++) {
            const int i = c0 + lane + 16 * k;
            xv[k] = i < C ? xr[i] : 0.0f;
            gv[k] = i < C ? dyr[i] : 0.0f;
            if (w && i < C) gv[k] = gv[k] * w[i];
        }
#pragma unroll
        for (int k = 0; k < RMS_CHUNK; k++)
            if (c0 + lane + 16 * k < C) acc = __fmaf_rn(gv[k], xv[k], acc);
    }
    const float d = lane16_tree(acc, mask);
    const float u = ((d / (float)C) * r) * r;
    for (int c0 = 0; c0 < C; c0 += 16 * RMS_CHUNK) {
        float ov[RMS_CHUNK];
#pragma unroll
        for (int k = 0; k < RMS_CHUNK; k++) {
            const int i = c0 + lane + 16 * k;
            xv[k] = i < C ? xr[i] : 0.0f;
            gv[k] = i < C ? dyr[i] : 0.0f;
            if (w && i < C) gv[k] = gv[k] * w[i];
            ov[k] = accumulate && i < C ? dxr[i] : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < RMS_CHUNK; k++) {
            const int i = c0 + lane + 16 * k;
            if (i < C) {
                const float v = (gv[k] - xv[k] * u) * r;
                dxr[i] = accumulate ? ov[k] + v : v;
            }
        }
    }
}

template <int E>
static void rmsnorm_bwd_rows_cached_launch(cudaStream_t s, unsigned grid, float *dx,
                                           const float *dy, const float *x, const float *w,
                                           int N, int C, float eps, float *rstd,
                                           bool accumulate) {
    rmsnorm_bwd_rows_cached_kernel<E><<<grid, RMS_THREADS, 0, s>>>(dx, dy, x, w, N, C, eps, rstd,
                                                                   accumulate);
}

cudaError_t kiln_cuda_rmsnorm_backward(cudaStream_t s, float *dx, float *dw, const float *dy,
                                       const float *x, const float *w, int N, int C, float eps,
                                       float *rstd, bool accumulate_dx) {
    if (N <= 0 || C <= 0) return cudaSuccess;
    const unsigned grid = (unsigned)((N + RMS_ROWS_PER_BLOCK - 1) / RMS_ROWS_PER_BLOCK);
    const int per_lane = (C + 15) / 16; /* the lane's elements: at most ceil(C / 16) */
    if (per_lane <= 4)
        rmsnorm_bwd_rows_cached_launch<4>(s, grid, dx, dy, x, w, N, C, eps, rstd, accumulate_dx);
    else if (per_lane <= 8)
        rmsnorm_bwd_rows_cached_launch<8>(s, grid, dx, dy, x, w, N, C, eps, rstd, accumulate_dx);
    else if (per_lane <= 16)
        rmsnorm_bwd_rows_cached_launch<16>(s, grid, dx, dy, x, w, N, C, eps, rstd,
                                           accumulate_dx);
    else if (per_lane <= 32)
        rmsnorm_bwd_rows_cached_launch<32>(s, grid, dx, dy, x, w, N, C, eps, rstd,
                                           accumulate_dx);
    else if (per_lane <= 48)
        rmsnorm_bwd_rows_cached_launch<48>(s, grid, dx, dy, x, w, N, C, eps, rstd,
                                           accumulate_dx);
    else if (per_lane <= 64)
        rmsnorm_bwd_rows_cached_launch<64>(s, grid, dx, dy, x, w, N, C, eps, rstd,
                                           accumulate_dx);
    else
        rmsnorm_bwd_rows_chunked_kernel<<<grid, RMS_THREADS, 0, s>>>(dx, dy, x, w, N, C, eps,
                                                                     rstd, accumulate_dx);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    if (dw && w) { /* dw[c] += lane-16 over n of fmaf(dy[n,c], x[n,c] * rstd[n], .) */
        kiln_cuda_col_lanes_launch(s, dw, dy, x, rstd, C, N, C);
        e = cudaGetLastError();
    }
    return e;
}

/* =================================================================================================
 * Fast column sums (the order and its error bound: cuda_norm.h).
 * ============================================================================================== */

/* ---- column sums: row chunks of RC rows, partials in double, then a fixed combine ---------- */

/* Kernel 1 (col_sum_partial_kernel): block (strip, chunk) = 32 x CS_LANES threads (256); the
 * 32 threads of a warp read consecutive columns of one row (CPT = 1: 32 floats, 128 bytes;
 * CPT = 4: a float4 each, 512 bytes, when the rows allow 16-byte loads), threadIdx.y is the
 * row lane j, which walks rows chunk_start + j + 8i in increasing i, loading AHEAD of its rows
 * (and their b, s) before their FMAs. The lanes meet in shared memory in the fixed tree, and
 * the chunk's partial goes to scratch[chunk * W + c]. Kernel 2 (col_sum_combine_kernel): the
 * same block shape over (32 columns, 8 groups of chunks), group g adding the partials of
 * chunks g, g + 8, ... in order, then the same tree, then out once.
 *
 * The order per column (cuda_norm.h) depends on (N, W) only: the vector width, the
 * grid and the scheduling change which thread does what, never which additions happen in
 * which order. The combine is spread over 8 groups per column because one thread walking all
 * K partials cost more than the partial sums themselves. H200, N = 8192, both kernels
 * (tests/gpu/test_cuda_colsum_fast.cu times them against col_lanes): W = 896 plain 11 us
 * (col_lanes 92), W = 576 with b and s 13 us (52), W = 4864 plain 45 us (3.5 TB/s); float4
 * loads gain 15-30% over scalar ones from W = 576 up and lose on 64-column sums (half the
 * strip idle), hence CS_VEC_MIN_W. Capping registers for more blocks per SM was slower. */
#define CS_TX 32
#define CS_LANES 8
#define CS_ROW_QUANTUM 64       /* RC is a multiple of this */
#define CS_TARGET_BLOCKS 1024   /* a few waves of 256-thread blocks on a 132-SM GPU */
#define CS_TARGET_STRIP 128     /* columns per strip assumed when choosing RC (the float4 width) */
#define CS_MAX_CHUNKS 256       /* bounds the scratch and the combine's chains */
#define CS_VEC_MIN_W 256        /* narrower sums keep 32-column strips (more blocks) */
static_assert(CS_TX * CS_LANES == 256, "the kernels' blocks are 256 threads");
static_assert(CS_LANES == 8, "the trees below are written for 8 lanes");

/* Rows per chunk, RC: enough chunks that (W / 128 strips) x chunks is about
 * CS_TARGET_BLOCKS, at most CS_MAX_CHUNKS chunks, RC a multiple of CS_ROW_QUANTUM and at most
 * N rounded up to one. Depends on (N, W) only: it fixes the summation order. N, W >= 1. */
static int64_t col_sum_rows_per_chunk(int N, int64_t W) {
    const int64_t q = CS_ROW_QUANTUM;
    const int64_t strips = (W + CS_TARGET_STRIP - 1) / CS_TARGET_STRIP;
    const int64_t n_up = ((int64_t)N + q - 1) / q * q;
    if (strips >= CS_TARGET_BLOCKS) return n_up; /* enough blocks from the columns alone */
    const int64_t want_chunks = (CS_TARGET_BLOCKS + strips - 1) / strips;
    int64_t rc = ((int64_t)N + want_chunks - 1) / want_chunks;
    const int64_t rc_min = ((int64_t)N + CS_MAX_CHUNKS - 1) / CS_MAX_CHUNKS;
    if (rc < rc_min) rc = rc_min;
    rc = (rc + q - 1) / q * q;
    return rc < n_up ? rc : n_up;
}

size_t kiln_cuda_col_sum_fast_scratch_len(int N, int64_t W) {
    if (N <= 0 || W <= 0) return 0;
    const int64_t rc = col_sum_rows_per_chunk(N, W);
    const int64_t K = ((int64_t)N + rc - 1) / rc;
    return (size_t)K * (size_t)W;
}

/* The fixed tree over the 8 lanes of v[8][COLS] (v[j][e] += v[j + h][e] for h = 4, 2, 1),
 * all 256 threads sharing the work; v[0] holds the sums after it. Called by every thread. */
template <int COLS>
static __device__ __forceinline__ void lane8_tree(double (*v)[COLS]) {
    const int t = threadIdx.y * CS_TX + threadIdx.x;
#pragma unroll
    for (int h = CS_LANES / 2; h >= 1; h /= 2) {
        for (int e = t; e < h * COLS; e += CS_TX * CS_LANES) {
            const int j = e / COLS, cc = e % COLS;
            v[j][cc] = v[j][cc] + v[j + h][cc];
        }
        __syncthreads();
    }
}

/* MODE 0: bv = 1; 1: bv = b; 2: bv = f32(b * s[n]). CPT columns per thread (1, or 4 with
 * float4 loads: W, ld multiples of 4 and a, b 16-byte aligned, checked by the launcher).
 * Block (bx, by) of the partial kernel's grid: strip bx, chunk by. */
template <int MODE, int CPT, int AHEAD>
static __device__ __forceinline__ void col_sum_partial_block(double *__restrict__ part,
                                                             const float *__restrict__ a,
                                                             const float *__restrict__ b,
                                                             const float *__restrict__ s,
                                                             int64_t ld, int N, int64_t W,
                                                             int64_t rc, int64_t bx, int64_t by) {
    constexpr int COLS = CS_TX * CPT;
    __shared__ double lanes[CS_LANES][COLS];
    const int tx = threadIdx.x, j = threadIdx.y;
    const int64_t c0 = bx * COLS + tx * CPT; /* this thread's first column */
    const int64_t n_lo = by * rc;
    const int64_t n_hi = n_lo + rc < N ? n_lo + rc : N;
    double acc[CPT];
#pragma unroll
    for (int q = 0; q < CPT; q++) acc[q] = 0.0;
    if (c0 < W) { /* CPT = 4: W % 4 == 0, so all four columns are < W */
        for (int64_t n0 = n_lo + j; n0 < n_hi; n0 += CS_LANES * AHEAD) {
            float av[AHEAD][CPT], bv[AHEAD][CPT];
#pragma unroll
            for (int u = 0; u < AHEAD; u++) {
                const int64_t n = n0 + CS_LANES * u;
#pragma unroll
                for (int q = 0; q < CPT; q++) {
                    av[u][q] = 0.0f;
                    bv[u][q] = 1.0f;
                }
                if (n < n_hi) {
                    const int64_t o = n * ld + c0;
                    if (CPT == 4) {
                        const float4 x4 = *(const float4 *)(a + o);
                        av[u][0] = x4.x, av[u][1] = x4.y, av[u][2] = x4.z, av[u][3] = x4.w;
                        if (MODE >= 1) {
                            const float4 y4 = *(const float4 *)(b + o);
                            bv[u][0] = y4.x, bv[u][1] = y4.y, bv[u][2] = y4.z, bv[u][3] = y4.w;
                        }
                    } else {
                        av[u][0] = a[o];
                        if (MODE >= 1) bv[u][0] = b[o];
                    }
                    if (MODE == 2) {
                        const float sn = s[n];
#pragma unroll
                        for (int q = 0; q < CPT; q++) bv[u][q] = bv[u][q] * sn;
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < AHEAD; u++)
                if (n0 + CS_LANES * u < n_hi)
#pragma unroll
                    for (int q = 0; q < CPT; q++)
                        acc[q] = fma((double)av[u][q], (double)bv[u][q], acc[q]);
        }
    }
#pragma unroll
    for (int q = 0; q < CPT; q++) lanes[j][tx * CPT + q] = acc[q];
    __syncthreads();
    lane8_tree<COLS>(lanes);
    for (int e = j * CS_TX + tx; e < COLS; e += CS_TX * CS_LANES) {
        const int64_t c = bx * COLS + e;
        if (c < W) part[by * W + c] = lanes[0][e];
    }
}

/* Grid (strips of 32 * CPT columns, K chunks); rows [n_lo, n_hi) of chunk blockIdx.y. */
template <int MODE, int CPT, int AHEAD>
static __global__ void __launch_bounds__(CS_TX *CS_LANES)
col_sum_partial_kernel(double *__restrict__ part, const float *__restrict__ a,
                       const float *__restrict__ b, const float *__restrict__ s, int64_t ld,
                       int N, int64_t W, int64_t rc) {
    col_sum_partial_block<MODE, CPT, AHEAD>(part, a, b, s, ld, N, W, rc, blockIdx.x, blockIdx.y);
}

/* Column c = blockIdx.x * 32 + threadIdx.x; group g = threadIdx.y adds P[k][c] for k = g,
 * g + 8, ... ascending (from +0), the groups meet in the tree, and
 * out[c] = f32(out[c] + total) (the addition in double, one rounding). The kernel is a few
 * blocks (W / 32) whose time is the partials' round trips: compiled as plain loads, ptxas kept
 * about 7 of a thread's in flight (SASS), so each thread first copies the partials it will add
 * (its own: no barrier) into shared memory by cp.async, CS_COMBINE_ROUND rows a round, all in
 * flight at once, then adds them in order from there. */
#define CS_COMBINE_ROUND 128 /* rows of 32 partials staged a round: 32 KiB */
static_assert(CS_COMBINE_ROUND % CS_LANES == 0, "a group's rows stay its own across rounds");
static __device__ __forceinline__ void col_sum_combine_block(float *__restrict__ out,
                                                             const double *__restrict__ part,
                                                             int64_t W, int K, int64_t bx) {
    __shared__ double groups[CS_LANES][CS_TX];
    __shared__ double stage[CS_COMBINE_ROUND][CS_TX];
    const int tx = threadIdx.x, g = threadIdx.y;
    const int64_t c = bx * CS_TX + tx;
    double t = 0.0;
    if (c < W)
        for (int k0 = 0; k0 < K; k0 += CS_COMBINE_ROUND) {
            const int n = K - k0 < CS_COMBINE_ROUND ? K - k0 : CS_COMBINE_ROUND;
            for (int i = g; i < n; i += CS_LANES)
                cp_async8(&stage[i][tx], part + (int64_t)(k0 + i) * W + c);
            cp_async_commit();
            cp_async_wait<0>();
            for (int i = g; i < n; i += CS_LANES) t = t + stage[i][tx];
        }
    groups[g][tx] = t;
    __syncthreads();
    lane8_tree<CS_TX>(groups);
    if (g == 0 && c < W) out[c] = (float)((double)out[c] + groups[0][tx]);
}

static __global__ void __launch_bounds__(CS_TX *CS_LANES)
col_sum_combine_kernel(float *__restrict__ out, const double *__restrict__ part, int64_t W,
                       int K) {
    col_sum_combine_block(out, part, W, K, blockIdx.x);
}

/* Plain column sums of up to KILN_CUDA_COL_SUM_MULTI_MAX matrices in one launch of each
 * kernel (kiln_cuda_col_sum_fast_multi): grid z is the job, x and y cover the largest job,
 * and a block past its own job's strips or chunks leaves at once (the whole block). Job z's
 * partials lie at part + off[z]; each job's chunks, order and combine are its single call's. */
struct cs_jobs {
    float *out[KILN_CUDA_COL_SUM_MULTI_MAX];
    const float *a[KILN_CUDA_COL_SUM_MULTI_MAX];
    int64_t ld[KILN_CUDA_COL_SUM_MULTI_MAX], W[KILN_CUDA_COL_SUM_MULTI_MAX];
    int64_t rc[KILN_CUDA_COL_SUM_MULTI_MAX], off[KILN_CUDA_COL_SUM_MULTI_MAX];
    int K[KILN_CUDA_COL_SUM_MULTI_MAX];
};

template <int CPT, int AHEAD>
static __global__ void __launch_bounds__(CS_TX *CS_LANES)
col_sum_partial_multi_kernel(double *__restrict__ part, const cs_jobs J, int N) {
    const int z = (int)blockIdx.z;
    if ((int64_t)blockIdx.x * (CS_TX * CPT) >= J.W[z] || (int)blockIdx.y >= J.K[z]) return;
    col_sum_partial_block<0, CPT, AHEAD>(part + J.off[z], J.a[z], NULL, NULL, J.ld[z], N, J.W[z],
                                         J.rc[z], blockIdx.x, blockIdx.y);
}

static __global__ void __launch_bounds__(CS_TX *CS_LANES)
col_sum_combine_multi_kernel(const double *__restrict__ part, const cs_jobs J) {
    const int z = (int)blockIdx.z;
    if ((int64_t)blockIdx.x * CS_TX >= J.W[z]) return;
    col_sum_combine_block(J.out[z], part + J.off[z], J.W[z], J.K[z], blockIdx.x);
}

template <int MODE>
static void col_sum_partial_launch(cudaStream_t s, bool vec, int64_t K, double *part,
                                   const float *a, const float *b, const float *sc, int64_t ld,
                                   int N, int64_t W, int64_t rc) {
    const dim3 block(CS_TX, CS_LANES);
    if (vec) {
        const dim3 grid((unsigned)((W + 4 * CS_TX - 1) / (4 * CS_TX)), (unsigned)K);
        /* 4 rows ahead (session 12; 2 before): more loads in flight, the same order */
        col_sum_partial_kernel<MODE, 4, 4><<<grid, block, 0, s>>>(part, a, b, sc, ld, N, W, rc);
    } else {
        const dim3 grid((unsigned)((W + CS_TX - 1) / CS_TX), (unsigned)K);
        col_sum_partial_kernel<MODE, 1, 8><<<grid, block, 0, s>>>(part, a, b, sc, ld, N, W, rc);
    }
}

cudaError_t kiln_cuda_col_sum_fast(cudaStream_t s, float *out, const float *a, const float *b,
                                   const float *sc, int64_t ld, int N, int64_t W,
                                   double *scratch, size_t scratch_len) {
    if (N <= 0 || W <= 0) return cudaSuccess;
    if (!out || !a || !scratch || (sc && !b) || ld < W) return cudaErrorInvalidValue;
    const int64_t rc = col_sum_rows_per_chunk(N, W);
    const int64_t K = ((int64_t)N + rc - 1) / rc;
    if (scratch_len < (size_t)K * (size_t)W) return cudaErrorInvalidValue;
    if ((W + CS_TX - 1) / CS_TX > INT_MAX || K > CS_MAX_CHUNKS)
        return cudaErrorInvalidConfiguration;
    /* float4 loads where every row start is 16-byte aligned (the same order either way) */
    const bool vec = W >= CS_VEC_MIN_W && W % 4 == 0 && ld % 4 == 0 &&
                     (uintptr_t)a % 16 == 0 && (!b || (uintptr_t)b % 16 == 0);
    const int mode = !b ? 0 : !sc ? 1 : 2;
    if (mode == 0) col_sum_partial_launch<0>(s, vec, K, scratch, a, b, sc, ld, N, W, rc);
    else if (mode == 1) col_sum_partial_launch<1>(s, vec, K, scratch, a, b, sc, ld, N, W, rc);
    else col_sum_partial_launch<2>(s, vec, K, scratch, a, b, sc, ld, N, W, rc);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    const dim3 grid((unsigned)((W + CS_TX - 1) / CS_TX)), block(CS_TX, CS_LANES);
    col_sum_combine_kernel<<<grid, block, 0, s>>>(out, scratch, W, (int)K);
    return cudaGetLastError();
}

size_t kiln_cuda_col_sum_fast_multi_scratch_len(int n, const int64_t *W, int N) {
    size_t len = 0;
    for (int i = 0; i < n && W; i++) len += kiln_cuda_col_sum_fast_scratch_len(N, W[i]);
    return len;
}

cudaError_t kiln_cuda_col_sum_fast_multi(cudaStream_t s, int n, float *const *out,
                                         const float *const *a, const int64_t *ld,
                                         const int64_t *W, int N, double *scratch,
                                         size_t scratch_len) {
    if (n < 1 || n > KILN_CUDA_COL_SUM_MULTI_MAX || !out || !a || !ld || !W)
        return cudaErrorInvalidValue;
    if (N <= 0) return cudaSuccess;
    cs_jobs J;
    memset(&J, 0, sizeof J);
    int64_t max_w = 0, max_k = 0, off = 0;
    bool vec = true;
    for (int i = 0; i < n; i++) {
        if (W[i] <= 0 || !out[i] || !a[i] || ld[i] < W[i] || !scratch)
            return cudaErrorInvalidValue;
        const int64_t rc = col_sum_rows_per_chunk(N, W[i]), K = ((int64_t)N + rc - 1) / rc;
        if ((W[i] + CS_TX - 1) / CS_TX > INT_MAX || K > CS_MAX_CHUNKS)
            return cudaErrorInvalidConfiguration;
        J.out[i] = out[i];
        J.a[i] = a[i];
        J.ld[i] = ld[i];
        J.W[i] = W[i];
        J.rc[i] = rc;
        J.K[i] = (int)K;
        J.off[i] = off;
        off += K * W[i];
        if (W[i] > max_w) max_w = W[i];
        if (K > max_k) max_k = K;
        /* float4 loads only when every job allows them (the order is the same either way) */
        vec = vec && W[i] % 4 == 0 && ld[i] % 4 == 0 && (uintptr_t)a[i] % 16 == 0;
    }
    if (scratch_len < (size_t)off) return cudaErrorInvalidValue;
    const dim3 block(CS_TX, CS_LANES);
    if (vec)
        col_sum_partial_multi_kernel<4, 4>
            <<<dim3((unsigned)((max_w + 4 * CS_TX - 1) / (4 * CS_TX)), (unsigned)max_k, (unsigned)n),
               block, 0, s>>>(scratch, J, N);
    else
        col_sum_partial_multi_kernel<1, 8>
            <<<dim3((unsigned)((max_w + CS_TX - 1) / CS_TX), (unsigned)max_k, (unsigned)n), block,
               0, s>>>(scratch, J, N);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    col_sum_combine_multi_kernel<<<dim3((unsigned)((max_w + CS_TX - 1) / CS_TX), 1, (unsigned)n),
                                   block, 0, s>>>(scratch, J);
    return cudaGetLastError();
}

/* =================================================================================================
 * Fast rows: the backward (the order and its error bound: cuda_norm.h) and the forward
 * with bf16 output.
 * ============================================================================================== */

/* ---- rmsnorm backward rows: lanes of a warp per row up to C = 1024, a block per row past -- */

/* Row n of x(N,C), dy(N,C), w(C) (the order and the error bound: cuda_norm.h). The
 * row is cut into C4 = ceil(C / 4) slots of 4 consecutive elements (slot j: 4j .. 4j + 3;
 * elements >= C read as 0 and are never written). T threads own a row: LPR = 8, 16 or 32 lanes
 * of a warp for C4 <= 256 (several rows per warp, 8 warps per 256-thread block), the whole
 * 256-thread block past that; thread t owns slots t + T*k, k ascending, and keeps 8 chains,
 * ss[q] = fmaf(x, x, ss[q]) and dd[q] = fmaf(g, x, dd[q]) over the q-th element of its slots.
 * Both sums are one pass (d does not need r), so a row is read once when it is cached in
 * registers (C <= 8192: x and g = dy * w stay in registers, dx is written from them; past
 * that, a second pass reads x, dy, w again).
 *
 * The float4 path (VEC: C % 4 == 0 and x, dy, dx, w 16-byte aligned) and the scalar path load
 * the same elements into the same slots, so the bits never depend on the alignment; the
 * variant (LPR and slots per thread V, or block K) is a function of C alone.
 *
 * Aliasing: dx may be dy (not __restrict__); each slot of dx is read (accumulate) and written
 * by the thread that read the same slot of dy, after that read. */
#define RB_THREADS 256
#define RB_WARPS (RB_THREADS / 32)
#define RB_WARP_MAX_C4 256 /* C <= 1024: LPR lanes per row, the row in registers */
#define RB_BLOCK_MAX_K 8   /* C <= 8192: a block per row, the row in registers */
#define RB_STREAM_AHEAD 4  /* past that: slots loaded ahead per thread in the second pass */
static_assert(RB_WARPS == 8, "the block tree below is written for 8 warps");

template <bool VEC>
static __device__ __forceinline__ float4 rb_load(const float *row, int j, int C) {
    const int64_t i = 4 * (int64_t)j;
    if (VEC) return *(const float4 *)(row + i);
    float4 v;
    v.x = i < C ? row[i] : 0.0f;
    v.y = i + 1 < C ? row[i + 1] : 0.0f;
    v.z = i + 2 < C ? row[i + 2] : 0.0f;
    v.w = i + 3 < C ? row[i + 3] : 0.0f;
    return v;
}

template <bool VEC>
static __device__ __forceinline__ void rb_store(float *row, int j, int C, float4 v) {
    const int64_t i = 4 * (int64_t)j;
    if (VEC) {
        *(float4 *)(row + i) = v;
        return;
    }
    if (i < C) row[i] = v.x;
    if (i + 1 < C) row[i + 1] = v.y;
    if (i + 2 < C) row[i + 2] = v.z;
    if (i + 3 < C) row[i + 3] = v.w;
}

/* The bf16 copy of a stored slot (dx16: rmsnorm_backward_bf16), rounded as kiln_bf16_rne. */
template <bool VEC>
static __device__ __forceinline__ void rb_store16(uint16_t *row, int j, int C, float4 v) {
    const int64_t i = 4 * (int64_t)j;
    if (VEC) {
        *(uint2 *)(row + i) =
            make_uint2((uint32_t)kiln_bf16_rne(v.x) | ((uint32_t)kiln_bf16_rne(v.y) << 16),
                       (uint32_t)kiln_bf16_rne(v.z) | ((uint32_t)kiln_bf16_rne(v.w) << 16));
        return;
    }
    if (i < C) row[i] = kiln_bf16_rne(v.x);
    if (i + 1 < C) row[i + 1] = kiln_bf16_rne(v.y);
    if (i + 2 < C) row[i + 2] = kiln_bf16_rne(v.z);
    if (i + 3 < C) row[i + 3] = kiln_bf16_rne(v.w);
}

/* rb_store, and the bf16 copy when dx16r is set */
template <bool VEC>
static __device__ __forceinline__ void rb_store2(float *row, uint16_t *dx16r, int j, int C,
                                                 float4 v) {
    rb_store<VEC>(row, j, C, v);
    if (dx16r) rb_store16<VEC>(dx16r, j, C, v);
}

/* x and g = dy * w (w NULL: g = dy, no product) of slot j */
template <bool VEC>
static __device__ __forceinline__ void rb_load_slot(const float *xr, const float *dyr,
                                                    const float *w, int j, int C, float4 &xv,
                                                    float4 &gv) {
    xv = rb_load<VEC>(xr, j, C);
    gv = rb_load<VEC>(dyr, j, C);
    if (w) {
        const float4 wv = rb_load<VEC>(w, j, C);
        gv.x = gv.x * wv.x, gv.y = gv.y * wv.y, gv.z = gv.z * wv.z, gv.w = gv.w * wv.w;
    }
}

/* one slot into the 8 chains */
static __device__ __forceinline__ void rb_chain(float4 xv, float4 gv, float ss[4], float dd[4]) {
    ss[0] = fmaf(xv.x, xv.x, ss[0]), dd[0] = fmaf(gv.x, xv.x, dd[0]);
    ss[1] = fmaf(xv.y, xv.y, ss[1]), dd[1] = fmaf(gv.y, xv.y, dd[1]);
    ss[2] = fmaf(xv.z, xv.z, ss[2]), dd[2] = fmaf(gv.z, xv.z, dd[2]);
    ss[3] = fmaf(xv.w, xv.w, ss[3]), dd[3] = fmaf(gv.w, xv.w, dd[3]);
}

static __device__ __forceinline__ float rb_quad(const float a[4]) {
    return (a[0] + a[1]) + (a[2] + a[3]);
}

/* dx of one slot: (g - x u) r, the difference one fmaf; accumulate: old + that */
static __device__ __forceinline__ float4 rb_dx(float4 xv, float4 gv, float u, float r) {
    float4 v;
    v.x = fmaf(-xv.x, u, gv.x) * r;
    v.y = fmaf(-xv.y, u, gv.y) * r;
    v.z = fmaf(-xv.z, u, gv.z) * r;
    v.w = fmaf(-xv.w, u, gv.w) * r;
    return v;
}
static __device__ __forceinline__ float4 rb_add(float4 o, float4 v) {
    return make_float4(o.x + v.x, o.y + v.y, o.z + v.z, o.w + v.w);
}

/* LPR lanes per row (32 / LPR rows per warp), V slots per lane: C4 <= LPR * V. */
template <int LPR, int V, bool VEC>
static __global__ void __launch_bounds__(RB_THREADS)
rmsnorm_bwd_fast_warp_kernel(float *dx, uint16_t *__restrict__ dx16, const float *dy,
                             const float *__restrict__ x, const float *__restrict__ w, int N,
                             int C, float eps, float *__restrict__ rstd, bool accumulate) {
    constexpr int RPW = 32 / LPR;
    const int lane = threadIdx.x & 31, t = lane % LPR;
    const int64_t n =
        ((int64_t)blockIdx.x * RB_WARPS + (threadIdx.x >> 5)) * RPW + lane / LPR;
    const bool live = n < N; /* lanes past the last row still take part in the shuffles */
    const int C4 = (C + 3) / 4;
    const int64_t off = live ? n * C : 0;
    float4 xv[V], gv[V];
    float ss[4] = {0.0f, 0.0f, 0.0f, 0.0f}, dd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < V; k++) {
        const int j = t + LPR * k;
        xv[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        gv[k] = xv[k];
        if (live && j < C4) rb_load_slot<VEC>(x + off, dy + off, w, j, C, xv[k], gv[k]);
    }
#pragma unroll
    for (int k = 0; k < V; k++) rb_chain(xv[k], gv[k], ss, dd);
    float s = rb_quad(ss), d = rb_quad(dd);
#pragma unroll
    for (int h = LPR / 2; h >= 1; h /= 2) { /* xor partners: every lane gets the same bits */
        s = s + __shfl_xor_sync(0xffffffffu, s, h, LPR);
        d = d + __shfl_xor_sync(0xffffffffu, d, h, LPR);
    }
    if (!live) return;
    const float r = kiln_rms_scale(s, C, eps);
    if (t == 0) rstd[n] = r;
    const float u = ((d / (float)C) * r) * r;
    float *dxr = dx + off;
    uint16_t *d16 = dx16 ? dx16 + off : NULL;
    if (accumulate) {
        float4 ov[V];
#pragma unroll
        for (int k = 0; k < V; k++)
            if (t + LPR * k < C4) ov[k] = rb_load<VEC>(dxr, t + LPR * k, C);
#pragma unroll
        for (int k = 0; k < V; k++)
            if (t + LPR * k < C4)
                rb_store2<VEC>(dxr, d16, t + LPR * k, C, rb_add(ov[k], rb_dx(xv[k], gv[k], u, r)));
    } else {
#pragma unroll
        for (int k = 0; k < V; k++)
            if (t + LPR * k < C4)
                rb_store2<VEC>(dxr, d16, t + LPR * k, C, rb_dx(xv[k], gv[k], u, r));
    }
}

/* The rows with dw in one pass (C4 in (16, 256]: a warp a row, V slots a lane): the warp
 * kernel above for dx and rstd, and, while the row is in registers, the column sums of dw in
 * chunks of their own: block k takes rows [k rc, (k+1) rc) (rc = rb_dw_rows_per_chunk(N,
 * rb_dw_rows(N)): 16 or 32, more only past RB_DW_MAX_CHUNKS chunks), its warp j the rows
 * k rc + j + 8i, i ascending, with acc = fma((double)dy, (double)f32(x * r), acc) per column
 * (the column sums' MODE 2 product: b = x, s = rstd). Each lane's sums live in shared memory,
 * its own 4 x V doubles per warp (registers would cap the kernel at one block an SM); the 8
 * warps then meet in lane8_tree's order (v[j] + v[j+4], v[j] + v[j+2], v[j] + v[j+1]) and
 * block k writes part[k * C + c]; the combine is col_sum_combine_kernel's. The order depends
 * on (N, C) only.
 * It is not kiln_cuda_col_sum_fast's order (whose chunks are 4-8 times longer and whose
 * grid, a block per chunk, would leave most SMs idle here): the products are exact in double
 * and the sums round only past 2^53, so dw rarely differs from the two kernels' in its last
 * bit (test_cuda_colsum_fast counts it). dx, dx16 and rstd are the two kernels' bits. dy is
 * kept apart from g = dy * w (g recomputed from both where needed: the same product). */
#define RB_DW_ROWS 16          /* rows a chunk at least: 2 a warp (more: rb_dw_rows) */
#define RB_DW_MAX_CHUNKS 1024  /* bounds the scratch and the combine's chains */

/* rows: the chunk's rows before the RB_DW_MAX_CHUNKS bound (rb_dw_rows(N); RB_DW_ROWS for the
 * scratch's bound) */
static int64_t rb_dw_rows_per_chunk(int N, int rows) {
    const int64_t need = ((int64_t)N + RB_DW_MAX_CHUNKS - 1) / RB_DW_MAX_CHUNKS;
    if (need <= rows) return rows;
    return (need + RB_WARPS - 1) / RB_WARPS * RB_WARPS;
}

/* The one-pass kernel's rows a chunk for N rows: 32 where that still makes at least 256
 * chunks, else RB_DW_ROWS (so the order depends on (N, C) only). At N 8192 the 256 chunks are
 * about one wave of two blocks an SM of an H200 where 512 were 1.94: test_cuda_colsum_fast,
 * 56.4 -> 50.6 us at N 8192 x C 896 (the 0.5B shape), 71.4 -> 70.6 us at N 16384 x C 576
 * (135M); the kernel capped for three blocks an SM and 24 rows a chunk were slower at the
 * 0.5B shape (bench/RESULTS.md, 2026-12-02, 9bb4328). Never more chunks, so never more
 * scratch, than kiln_cuda_rmsnorm_backward_fast_scratch_len's RB_DW_ROWS. */
static int rb_dw_rows(int N) { return N / 32 >= 256 ? 32 : RB_DW_ROWS; }

/* g = dy * w of slot sj (rb_load_slot's product; w NULL or sj past the row: dy itself) */
template <bool VEC>
static __device__ __forceinline__ float4 rb_g(float4 yv, const float *w, int sj, int C4, int C) {
    if (!w || sj >= C4) return yv;
    const float4 wv = rb_load<VEC>(w, sj, C);
    yv.x = yv.x * wv.x, yv.y = yv.y * wv.y, yv.z = yv.z * wv.z, yv.w = yv.w * wv.w;
    return yv;
}

template <int V, bool VEC>
static __global__ void __launch_bounds__(RB_THREADS)
rmsnorm_bwd_dw_fast_kernel(float *dx, uint16_t *__restrict__ dx16, const float *dy,
                           const float *__restrict__ x, const float *__restrict__ w, int N, int C,
                           float eps, float *__restrict__ rstd, bool accumulate,
                           double *__restrict__ part, int64_t rc) {
    /* (RB_WARPS, V, 4, 32) doubles: warp j's sum of column 4 (t + 32 k) + q at
     * [j][k][q][t], so the 32 lanes of a warp touch 32 consecutive doubles */
    extern __shared__ double sums[];
    const int t = threadIdx.x & 31, j = threadIdx.x >> 5;
    const int C4 = (C + 3) / 4;
    const int64_t n_lo = (int64_t)blockIdx.x * rc;
    const int64_t n_hi = n_lo + rc < N ? n_lo + rc : N;
    double *mine = sums + (int64_t)j * V * 128;
#pragma unroll
    for (int e = 0; e < 4 * V; e++) mine[e * 32 + t] = 0.0;
    for (int64_t n = n_lo + j; n < n_hi; n += RB_WARPS) { /* uniform per warp */
        const int64_t off = n * C;
        float4 xv[V], yv[V];
        float ss[4] = {0.0f, 0.0f, 0.0f, 0.0f}, dd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int k = 0; k < V; k++) {
            const int sj = t + 32 * k;
            xv[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            yv[k] = xv[k];
            if (sj < C4) rb_load_slot<VEC>(x + off, dy + off, NULL, sj, C, xv[k], yv[k]);
        }
#pragma unroll
        for (int k = 0; k < V; k++) rb_chain(xv[k], rb_g<VEC>(yv[k], w, t + 32 * k, C4, C), ss, dd);
        float s = rb_quad(ss), d = rb_quad(dd);
#pragma unroll
        for (int h = 16; h >= 1; h /= 2) {
            s = s + __shfl_xor_sync(0xffffffffu, s, h, 32);
            d = d + __shfl_xor_sync(0xffffffffu, d, h, 32);
        }
        const float r = kiln_rms_scale(s, C, eps);
        if (t == 0) rstd[n] = r;
        const float u = ((d / (float)C) * r) * r;
        float *dxr = dx + off;
        uint16_t *d16 = dx16 ? dx16 + off : NULL;
#pragma unroll
        for (int k = 0; k < V; k++) {
            const int sj = t + 32 * k;
            if (sj >= C4) continue;
            float4 v = rb_dx(xv[k], rb_g<VEC>(yv[k], w, sj, C4, C), u, r);
            if (accumulate) v = rb_add(rb_load<VEC>(dxr, sj, C), v);
            rb_store2<VEC>(dxr, d16, sj, C, v);
        }
        /* dw: elements past C are 0 in x and dy, fma(0, 0, acc) = acc, never written */
#pragma unroll
        for (int k = 0; k < V; k++) {
            double *m = mine + k * 128 + t;
            m[0] = fma((double)yv[k].x, (double)(xv[k].x * r), m[0]);
            m[32] = fma((double)yv[k].y, (double)(xv[k].y * r), m[32]);
            m[64] = fma((double)yv[k].z, (double)(xv[k].z * r), m[64]);
            m[96] = fma((double)yv[k].w, (double)(xv[k].w * r), m[96]);
        }
    }
    /* lane8_tree over the warps: h = 4, 2, 1; warp j < h adds warp j + h's sums to its own */
#pragma unroll
    for (int h = RB_WARPS / 2; h >= 1; h /= 2) {
        __syncthreads();
        if (j < h) {
            const double *theirs = sums + (int64_t)(j + h) * V * 128;
#pragma unroll
            for (int e = 0; e < 4 * V; e++) mine[e * 32 + t] = mine[e * 32 + t] + theirs[e * 32 + t];
        }
    }
    if (j == 0)
#pragma unroll
        for (int k = 0; k < V; k++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int64_t c = 4 * (int64_t)(t + 32 * k) + q;
                if (c < C) part[(int64_t)blockIdx.x * C + c] = mine[(k * 4 + q) * 32 + t];
            }
}

/* The fast forward (kiln_cuda_rmsnorm_fast_bf16): the same rows, lanes, slots and chains as
 * the backward above for the sum of squares (so its r has the backward's bits for the same
 * x), then out = bf16((x r) w), rmsnorm's formula. */
template <int LPR, int V, bool VEC>
static __global__ void __launch_bounds__(RB_THREADS)
rmsnorm_fwd_fast_warp_kernel(uint16_t *__restrict__ out, const float *__restrict__ x,
                             const float *__restrict__ w, int N, int C, float eps) {
    constexpr int RPW = 32 / LPR;
    const int lane = threadIdx.x & 31, t = lane % LPR;
    const int64_t n =
        ((int64_t)blockIdx.x * RB_WARPS + (threadIdx.x >> 5)) * RPW + lane / LPR;
    const bool live = n < N;
    const int C4 = (C + 3) / 4;
    const int64_t off = live ? n * C : 0;
    float4 xv[V];
    float ss[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < V; k++) {
        const int j = t + LPR * k;
        xv[k] = live && j < C4 ? rb_load<VEC>(x + off, j, C) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int k = 0; k < V; k++) { /* rb_chain's ss half */
        ss[0] = fmaf(xv[k].x, xv[k].x, ss[0]);
        ss[1] = fmaf(xv[k].y, xv[k].y, ss[1]);
        ss[2] = fmaf(xv[k].z, xv[k].z, ss[2]);
        ss[3] = fmaf(xv[k].w, xv[k].w, ss[3]);
    }
    float s = rb_quad(ss);
#pragma unroll
    for (int h = LPR / 2; h >= 1; h /= 2) s = s + __shfl_xor_sync(0xffffffffu, s, h, LPR);
    if (!live) return;
    const float r = kiln_rms_scale(s, C, eps);
#pragma unroll
    for (int k = 0; k < V; k++) {
        const int j = t + LPR * k;
        if (j >= C4) continue;
        const float4 wv = w ? rb_load<VEC>(w, j, C) : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
        float4 v = make_float4(xv[k].x * r, xv[k].y * r, xv[k].z * r, xv[k].w * r);
        if (w) v = make_float4(v.x * wv.x, v.y * wv.y, v.z * wv.z, v.w * wv.w);
        rb_store16<VEC>(out + off, j, C, v);
    }
}

/* The 8 warps' sums in the fixed tree ((0+1)+(2+3))+((4+5)+(6+7)). */
static __device__ __forceinline__ float rb_tree8(const float *p) {
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

/* A block per row. K > 0: thread t's K slots t + 256k cached (C4 <= 256 K; slots past the row
 * add zeros); K = 0: any C, the chains over the thread's slots in the same order, then a
 * second pass that reads x, dy, w again, RB_STREAM_AHEAD slots loaded before their stores. */
template <int K, bool VEC>
static __global__ void __launch_bounds__(RB_THREADS)
rmsnorm_bwd_fast_block_kernel(float *dx, uint16_t *__restrict__ dx16, const float *dy,
                              const float *__restrict__ x, const float *__restrict__ w, int C,
                              float eps, float *__restrict__ rstd, bool accumulate) {
    __shared__ float part[2][RB_WARPS];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int64_t n = blockIdx.x;
    const int C4 = (C + 3) / 4;
    const int64_t off = n * C;
    const float *xr = x + off, *dyr = dy + off;
    float *dxr = dx + off;
    uint16_t *d16 = dx16 ? dx16 + off : NULL;
    constexpr int KC = K > 0 ? K : 1;
    float4 xv[KC], gv[KC];
    float ss[4] = {0.0f, 0.0f, 0.0f, 0.0f}, dd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if constexpr (K > 0) {
#pragma unroll
        for (int k = 0; k < KC; k++) {
            const int j = t + RB_THREADS * k;
            xv[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            gv[k] = xv[k];
            if (j < C4) rb_load_slot<VEC>(xr, dyr, w, j, C, xv[k], gv[k]);
        }
#pragma unroll
        for (int k = 0; k < KC; k++) rb_chain(xv[k], gv[k], ss, dd);
    } else {
#pragma unroll 4
        for (int j = t; j < C4; j += RB_THREADS) {
            float4 a, b;
            rb_load_slot<VEC>(xr, dyr, w, j, C, a, b);
            rb_chain(a, b, ss, dd);
        }
    }
    float s = rb_quad(ss), d = rb_quad(dd);
#pragma unroll
    for (int h = 16; h >= 1; h /= 2) {
        s = s + __shfl_xor_sync(0xffffffffu, s, h);
        d = d + __shfl_xor_sync(0xffffffffu, d, h);
    }
    if (lane == 0) {
        part[0][warp] = s;
        part[1][warp] = d;
    }
    __syncthreads();
    s = rb_tree8(part[0]);
    d = rb_tree8(part[1]);
    const float r = kiln_rms_scale(s, C, eps);
    if (t == 0) rstd[n] = r;
    const float u = ((d / (float)C) * r) * r;
    if constexpr (K > 0) {
        float4 ov[KC];
        if (accumulate) {
#pragma unroll
            for (int k = 0; k < KC; k++)
                if (t + RB_THREADS * k < C4) ov[k] = rb_load<VEC>(dxr, t + RB_THREADS * k, C);
        }
#pragma unroll
        for (int k = 0; k < KC; k++) {
            const int j = t + RB_THREADS * k;
            if (j >= C4) continue;
            const float4 v = rb_dx(xv[k], gv[k], u, r);
            rb_store2<VEC>(dxr, d16, j, C, accumulate ? rb_add(ov[k], v) : v);
        }
    } else {
        for (int j0 = t; j0 < C4; j0 += RB_THREADS * RB_STREAM_AHEAD) {
            float4 a[RB_STREAM_AHEAD], b[RB_STREAM_AHEAD], o[RB_STREAM_AHEAD];
#pragma unroll
            for (int k = 0; k < RB_STREAM_AHEAD; k++) {
                const int j = j0 + RB_THREADS * k;
                if (j >= C4) continue;
                rb_load_slot<VEC>(xr, dyr, w, j, C, a[k], b[k]);
                if (accumulate) o[k] = rb_load<VEC>(dxr, j, C);
            }
#pragma unroll
            for (int k = 0; k < RB_STREAM_AHEAD; k++) {
                const int j = j0 + RB_THREADS * k;
                if (j >= C4) continue;
                const float4 v = rb_dx(a[k], b[k], u, r);
                rb_store2<VEC>(dxr, d16, j, C, accumulate ? rb_add(o[k], v) : v);
            }
        }
    }
}

template <int LPR, int V>
static void rb_warp_launch(cudaStream_t s, bool vec, float *dx, uint16_t *dx16, const float *dy,
                           const float *x, const float *w, int N, int C, float eps, float *rstd,
                           bool acc) {
    constexpr int rows_per_block = RB_WARPS * (32 / LPR);
    const unsigned grid = (unsigned)(((int64_t)N + rows_per_block - 1) / rows_per_block);
    if (vec)
        rmsnorm_bwd_fast_warp_kernel<LPR, V, true>
            <<<grid, RB_THREADS, 0, s>>>(dx, dx16, dy, x, w, N, C, eps, rstd, acc);
    else
        rmsnorm_bwd_fast_warp_kernel<LPR, V, false>
            <<<grid, RB_THREADS, 0, s>>>(dx, dx16, dy, x, w, N, C, eps, rstd, acc);
}

template <int K>
static void rb_block_launch(cudaStream_t s, bool vec, float *dx, uint16_t *dx16, const float *dy,
                            const float *x, const float *w, int N, int C, float eps, float *rstd,
                            bool acc) {
    if (vec)
        rmsnorm_bwd_fast_block_kernel<K, true>
            <<<(unsigned)N, RB_THREADS, 0, s>>>(dx, dx16, dy, x, w, C, eps, rstd, acc);
    else
        rmsnorm_bwd_fast_block_kernel<K, false>
            <<<(unsigned)N, RB_THREADS, 0, s>>>(dx, dx16, dy, x, w, C, eps, rstd, acc);
}

/* The warp variant (LPR lanes a row, V slots a lane) for C4 = ceil(C / 4) <= RB_WARP_MAX_C4,
 * a function of C alone (it fixes the order): f.template run<LPR, V>(). */
template <typename F>
static void rb_warp_variant(int C4, const F &f) {
    if (C4 <= 8) {
        f.template run<8, 1>();
    } else if (C4 <= 16) {
        f.template run<16, 1>();
    } else {
        switch ((C4 + 31) / 32) {
        case 1: f.template run<32, 1>(); break;
        case 2: f.template run<32, 2>(); break;
        case 3: f.template run<32, 3>(); break;
        case 4: f.template run<32, 4>(); break;
        case 5: f.template run<32, 5>(); break;
        case 6: f.template run<32, 6>(); break;
        case 7: f.template run<32, 7>(); break;
        default: f.template run<32, 8>(); break;
        }
    }
}

struct rb_bwd_launch {
    cudaStream_t s;
    bool vec;
    float *dx;
    uint16_t *dx16;
    const float *dy, *x, *w;
    int N, C;
    float eps;
    float *rstd;
    bool acc;
    template <int LPR, int V>
    void run() const {
        rb_warp_launch<LPR, V>(s, vec, dx, dx16, dy, x, w, N, C, eps, rstd, acc);
    }
};

struct rb_fwd_launch {
    cudaStream_t s;
    bool vec;
    uint16_t *out;
    const float *x, *w;
    int N, C;
    float eps;
    template <int LPR, int V>
    void run() const {
        constexpr int rows_per_block = RB_WARPS * (32 / LPR);
        const unsigned grid = (unsigned)(((int64_t)N + rows_per_block - 1) / rows_per_block);
        if (vec)
            rmsnorm_fwd_fast_warp_kernel<LPR, V, true>
                <<<grid, RB_THREADS, 0, s>>>(out, x, w, N, C, eps);
        else
            rmsnorm_fwd_fast_warp_kernel<LPR, V, false>
                <<<grid, RB_THREADS, 0, s>>>(out, x, w, N, C, eps);
    }
};

/* dx and rstd of the fast rmsnorm backward (cuda_norm.h); N, C >= 1, pointers set.
 * The variant is chosen from C alone (it fixes the order); vec only picks the loads. */
static cudaError_t rmsnorm_bwd_rows_fast(cudaStream_t s, float *dx, uint16_t *dx16,
                                         const float *dy, const float *x, const float *w, int N,
                                         int C, float eps, float *rstd, bool acc) {
    const int C4 = (int)(((int64_t)C + 3) / 4);
    const bool vec = C % 4 == 0 && (uintptr_t)x % 16 == 0 && (uintptr_t)dy % 16 == 0 &&
                     (uintptr_t)dx % 16 == 0 && (!w || (uintptr_t)w % 16 == 0) &&
                     (uintptr_t)dx16 % 8 == 0;
#define RB_BLOCK(K) rb_block_launch<K>(s, vec, dx, dx16, dy, x, w, N, C, eps, rstd, acc)
    if (C4 <= RB_WARP_MAX_C4) {
        rb_warp_variant(C4, rb_bwd_launch{s, vec, dx, dx16, dy, x, w, N, C, eps, rstd, acc});
    } else if (C4 <= RB_THREADS * RB_BLOCK_MAX_K) {
        const int k = (C4 + RB_THREADS - 1) / RB_THREADS; /* 2 .. 8, padded to even */
        if (k <= 2) RB_BLOCK(2);
        else if (k <= 4) RB_BLOCK(4);
        else if (k <= 6) RB_BLOCK(6);
        else RB_BLOCK(8);
    } else {
        RB_BLOCK(0);
    }
#undef RB_BLOCK
    return cudaGetLastError();
}

/* Whether the rows with dw run as one pass (rmsnorm_bwd_dw_fast_kernel): a warp a row
 * (16 < C4 <= 256); else the rows kernel and kiln_cuda_col_sum_fast (the same dx, dx16 and
 * rstd, dw in the column sums' order). The one pass was 62.7 -> 56.6 us at C 896 and 79.7 ->
 * 72.0 us at C 576 against the two kernels (bench/RESULTS.md, 2026-12-01, 4f795ca). */
static bool rb_dw_fused(int C) {
    const int C4 = (int)(((int64_t)C + 3) / 4);
    return C4 > 16 && C4 <= RB_WARP_MAX_C4;
}

/* The larger of either path's scratch. */
size_t kiln_cuda_rmsnorm_backward_fast_scratch_len(int N, int C) {
    const size_t two = kiln_cuda_col_sum_fast_scratch_len(N, C);
    if (N <= 0 || C <= 0 || !rb_dw_fused(C)) return two;
    const int64_t rc = rb_dw_rows_per_chunk(N, RB_DW_ROWS), K = ((int64_t)N + rc - 1) / rc;
    const size_t one = (size_t)K * (size_t)C;
    return one > two ? one : two;
}

template <int V>
static void rb_dw_launch(cudaStream_t s, bool vec, unsigned K, float *dx, uint16_t *dx16,
                         const float *dy, const float *x, const float *w, int N, int C, float eps,
                         float *rstd, bool acc, double *part, int64_t rc) {
    const size_t smem = (size_t)RB_WARPS * V * 128 * sizeof(double); /* 8 KiB x V */
    auto kt = rmsnorm_bwd_dw_fast_kernel<V, true>, kf = rmsnorm_bwd_dw_fast_kernel<V, false>;
    if (smem > 48 * 1024) {
        (void)cudaFuncSetAttribute(kt, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        (void)cudaFuncSetAttribute(kf, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    }
    (vec ? kt : kf)<<<K, RB_THREADS, smem, s>>>(dx, dx16, dy, x, w, N, C, eps, rstd, acc, part, rc);
}

/* dx, rstd and dw in one pass over the rows plus the combine (rb_dw_fused(C); scratch checked
 * by the caller against kiln_cuda_rmsnorm_backward_fast_scratch_len). */
static cudaError_t rmsnorm_bwd_dw_fused(cudaStream_t s, float *dx, uint16_t *dx16, float *dw,
                                        const float *dy, const float *x, const float *w, int N,
                                        int C, float eps, float *rstd, bool acc,
                                        double *scratch) {
    const int64_t rc = rb_dw_rows_per_chunk(N, rb_dw_rows(N));
    const int64_t K = ((int64_t)N + rc - 1) / rc;
    if (K > RB_DW_MAX_CHUNKS) return cudaErrorInvalidConfiguration;
    const bool vec = C % 4 == 0 && (uintptr_t)x % 16 == 0 && (uintptr_t)dy % 16 == 0 &&
                     (uintptr_t)dx % 16 == 0 && (!w || (uintptr_t)w % 16 == 0) &&
                     (uintptr_t)dx16 % 8 == 0;
    const int C4 = (int)(((int64_t)C + 3) / 4);
    const unsigned k = (unsigned)K;
#define RB_DW(V) \
    rb_dw_launch<V>(s, vec, k, dx, dx16, dy, x, w, N, C, eps, rstd, acc, scratch, rc)
    switch ((C4 + 31) / 32) {
    case 1: RB_DW(1); break;
    case 2: RB_DW(2); break;
    case 3: RB_DW(3); break;
    case 4: RB_DW(4); break;
    case 5: RB_DW(5); break;
    case 6: RB_DW(6); break;
    case 7: RB_DW(7); break;
    default: RB_DW(8); break;
    }
#undef RB_DW
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    const dim3 grid((unsigned)((C + CS_TX - 1) / CS_TX)), block(CS_TX, CS_LANES);
    col_sum_combine_kernel<<<grid, block, 0, s>>>(dw, scratch, C, (int)K);
    return cudaGetLastError();
}

cudaError_t kiln_cuda_rmsnorm_backward_fast(cudaStream_t s, float *dx, uint16_t *dx16, float *dw,
                                            const float *dy, const float *x, const float *w,
                                            int N, int C, float eps, float *rstd,
                                            bool accumulate_dx, double *scratch,
                                            size_t scratch_len) {
    if (N <= 0 || C <= 0) return cudaSuccess;
    const bool want_dw = dw && w;
    if (want_dw && (!scratch || scratch_len < kiln_cuda_rmsnorm_backward_fast_scratch_len(N, C)))
        return cudaErrorInvalidValue; /* refused before anything is enqueued */
    if (!dx || !dy || !x || !rstd) return cudaErrorInvalidValue;
    if (want_dw && rb_dw_fused(C))
        return rmsnorm_bwd_dw_fused(s, dx, dx16, dw, dy, x, w, N, C, eps, rstd, accumulate_dx,
                                    scratch);
    cudaError_t e = rmsnorm_bwd_rows_fast(s, dx, dx16, dy, x, w, N, C, eps, rstd, accumulate_dx);
    if (e != cudaSuccess || !want_dw) return e;
    /* dw[c] += sum over n of dy[n,c] * f32(x[n,c] * rstd[n]) */
    return kiln_cuda_col_sum_fast(s, dw, dy, x, rstd, C, N, C, scratch, scratch_len);
}

cudaError_t kiln_cuda_rmsnorm_fast_bf16(cudaStream_t s, uint16_t *out, const float *x,
                                        const float *w, int N, int C, float eps) {
    if (N <= 0 || C <= 0) return cudaSuccess;
    if (!out || !x) return cudaErrorInvalidValue;
    const int C4 = (int)(((int64_t)C + 3) / 4);
    if (C4 > RB_WARP_MAX_C4) return kiln_cuda_rmsnorm_bf16(s, out, x, w, N, C, eps);
    const bool vec = C % 4 == 0 && (uintptr_t)x % 16 == 0 && (!w || (uintptr_t)w % 16 == 0) &&
                     (uintptr_t)out % 8 == 0;
    rb_warp_variant(C4, rb_fwd_launch{s, vec, out, x, w, N, C, eps});
    return cudaGetLastError();
}
