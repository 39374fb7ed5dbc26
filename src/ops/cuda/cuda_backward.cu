/*
 * cuda_backward.cu -- the backward (training) kernels of the CUDA backend in auditable
 * arithmetic, and their launchers (contracts: cuda_backward.h and ops.h).
 *
 * Each kernel transcribes docs/ARITHMETIC.md, "Backward ops", as the CPU reference
 * (src/ops/cpu/backward_portable.c) computes it: the same binary32 operations in the same
 * order per output element, an FMA only where the reference has fmaf (written __fmaf_rn),
 * kiln_expf / kiln_rms_scale / kiln_lane16_reduce from kmath.h (the same source on both
 * sides), compiled with --fmad=false, IEEE division and square root, no flush-to-zero.
 * Parallelism only splits ACROSS output elements or across the 16 lanes of a defined dot;
 * where many terms meet in one gradient element (dW, dbias, dw, dk/dv, an embedding row) one
 * thread (or one half-warp's lanes, then the fixed tree) owns the element and adds the terms
 * in the defined order. No float atomics, no per-block partial sums: the bits cannot depend
 * on the launch shape.
 */
#include "cuda_backward.h"
#include "cuda_common.cuh"

#include "../../base/kmath.h"

#include <limits.h>

bool kiln_cuda_backward_dtype_supported(kiln_dtype dt) {
    return dt == KILN_DTYPE_F32 || dt == KILN_DTYPE_BF16 || dt == KILN_DTYPE_F16;
}

static unsigned grid_for(int64_t total, int threads) {
    int64_t g = (total + threads - 1) / threads;
    return (unsigned)(g > (1 << 20) ? (1 << 20) : g);
}

/* ---- the lane-16 GEMM: out(M,NCOL) (+)= A(M,K) @ B(K,NCOL) ------------------------------- */

/* Each output element is the defined dot over k: lane k % 16 does fmaf(A(i,k), B(k,c), acc)
 * in increasing k, then the fixed tree; then out = v, or out = out + v (accumulate). This is
 * the CPU's bwd_gemm: dx = dy @ W (k = r) and dW += dy^T @ x (k = token).
 *
 * A block computes a BM x BN tile of outputs. Its 256 threads are 16 groups (the 16
 * half-warps) of 16 lanes: thread lane j of a group owns lane j of the dots of the group's
 * TM x TN micro-tile (64 accumulators). K is walked in chunks of KC = 32 staged in shared
 * memory (coalesced loads, B widened to f32 there); in a chunk starting at k0 (a multiple of
 * 16) lane j does k0 + j, then k0 + 16 + j, so each lane's chain runs in increasing k with
 * k % 16 == j exactly as defined, whatever the tile. k >= K is skipped (never an fmaf with
 * padding: fmaf(0, 0, -0) would turn an accumulator of -0 into +0). At the end the 16 lanes of
 * a group are one half-warp: lane16_tree gives every lane the tree's bits.
 *
 * Micro-tile placement avoids shared-memory bank conflicts: rows of As/Bs are 33 floats, so
 * the 16 lanes of a half-warp (16 different k) hit 16 different banks; the two half-warps of
 * a warp share their rows (broadcast) and take column groups 16 apart (complementary banks). */
#define BG_THREADS 256
#define BG_BM 32
#define BG_BN 32
#define BG_KC 32
#define BG_TM 8
#define BG_TN 8
static_assert((BG_BM / BG_TM) * (BG_BN / BG_TN) * 16 == BG_THREADS, "16 lanes per micro-tile");
static_assert(BG_BM / BG_TM == 4 && BG_BN / BG_TN == 4, "group placement assumes 4 x 4");
static_assert(BG_KC % 16 == 0, "chunks keep every k's lane");
static_assert((BG_TM * BG_TN) % 16 == 0, "outputs spread evenly over the 16 lanes");

template <int DT>
static __global__ void __launch_bounds__(BG_THREADS, 2)
bwd_gemm_kernel(float *__restrict__ out, int64_t ldo, bool accumulate,
                const float *__restrict__ A, int64_t asi, int64_t ask,
                const uint8_t *__restrict__ B, size_t ldb, int64_t M, int64_t NCOL, int64_t K) {
    __shared__ float As[BG_KC][BG_BM + 1]; /* As[kk][ii] = A(bi + ii, k0 + kk) */
    __shared__ float Bs[BG_KC][BG_BN + 1]; /* Bs[kk][cc] = B(k0 + kk, bc + cc) */
    const int t = threadIdx.x, j = t & 15, half = (t >> 4) & 1, wp = t >> 5;
    const int ti = (wp >> 1) * BG_TM;             /* this group's first row in the tile */
    const int tc = ((wp & 1) + 2 * half) * BG_TN; /* and first column */
    const int64_t bi = (int64_t)blockIdx.y * BG_BM, bc = (int64_t)blockIdx.x * BG_BN;
    const bool a_kmajor = ask == 1; /* A contiguous along k (dx) or along i (dW) */
    float acc[BG_TM][BG_TN];
#pragma unroll
    for (int ii = 0; ii < BG_TM; ii++)
#pragma unroll
        for (int cc = 0; cc < BG_TN; cc++) acc[ii][cc] = 0.0f;

    for (int64_t k0 = 0; k0 < K; k0 += BG_KC) {
        /* stage A's and B's chunk; out-of-range entries are 0 and never used by an fmaf
         * (rows/columns past M/NCOL are never written; k past K is skipped below) */
        for (int e = t; e < BG_BM * BG_KC; e += BG_THREADS) {
            int kk, ii;
            if (a_kmajor) {
                kk = e % BG_KC;
                ii = e / BG_KC;
            } else {
                ii = e % BG_BM;
                kk = e / BG_BM;
            }
            const int64_t i = bi + ii, k = k0 + kk;
            As[kk][ii] = (i < M && k < K) ? A[i * asi + k * ask] : 0.0f;
        }
        for (int e = t; e < BG_BN * BG_KC; e += BG_THREADS) {
            const int cc = e % BG_BN, kk = e / BG_BN;
            const int64_t c = bc + cc, k = k0 + kk;
            Bs[kk][cc] = (c < NCOL && k < K) ? deq<DT>(B + (size_t)k * ldb, c) : 0.0f;
        }
        __syncthreads();
        const bool full = k0 + BG_KC <= K;
#pragma unroll
        for (int hk = 0; hk < BG_KC / 16; hk++) {
            const int kk = j + 16 * hk;
            if (full || k0 + kk < K) {
                float a[BG_TM], b[BG_TN];
#pragma unroll
                for (int ii = 0; ii < BG_TM; ii++) a[ii] = As[kk][ti + ii];
#pragma unroll
                for (int cc = 0; cc < BG_TN; cc++) b[cc] = Bs[kk][tc + cc];
#pragma unroll
                for (int ii = 0; ii < BG_TM; ii++)
#pragma unroll
                    for (int cc = 0; cc < BG_TN; cc++)
                        acc[ii][cc] = __fmaf_rn(a[ii], b[cc], acc[ii][cc]);
            }
        }
        __syncthreads(); /* As/Bs are rewritten by the next chunk */
    }

    /* The tree of every output (all 32 threads of the warp take part in every shuffle); lane
     * j keeps outputs o = j, j + 16, ... of its micro-tile (o = ii * TN + cc) and writes
     * them. */
    constexpr int PER_LANE = BG_TM * BG_TN / 16;
    float mine[PER_LANE];
#pragma unroll
    for (int q = 0; q < PER_LANE; q++) mine[q] = 0.0f;
#pragma unroll
    for (int ii = 0; ii < BG_TM; ii++)
#pragma unroll
        for (int cc = 0; cc < BG_TN; cc++) {
            const float v = lane16_tree(acc[ii][cc], 0xffffffffu);
            const int o = ii * BG_TN + cc;
            if ((o & 15) == j) mine[o >> 4] = v;
        }
#pragma unroll
    for (int q = 0; q < PER_LANE; q++) {
        const int o = j + 16 * q;
        const int64_t i = bi + ti + o / BG_TN, c = bc + tc + o % BG_TN;
        if (i < M && c < NCOL) {
            float *p = out + i * ldo + c;
            *p = accumulate ? *p + mine[q] : mine[q];
        }
    }
}

/* Launch checks: the grid's y dimension holds the row tiles. */
static bool bwd_gemm_fits(int64_t M, int64_t NCOL) {
    return (M + BG_BM - 1) / BG_BM <= 65535 && (NCOL + BG_BN - 1) / BG_BN <= INT_MAX;
}

template <int DT>
static void bwd_gemm_launch(cudaStream_t s, float *out, int64_t ldo, bool accumulate,
                            const float *A, int64_t asi, int64_t ask, const uint8_t *B,
                            size_t ldb, int64_t M, int64_t NCOL, int64_t K) {
    const dim3 grid((unsigned)((NCOL + BG_BN - 1) / BG_BN), (unsigned)((M + BG_BM - 1) / BG_BM));
    bwd_gemm_kernel<DT><<<grid, BG_THREADS, 0, s>>>(out, ldo, accumulate, A, asi, ask, B, ldb, M,
                                                    NCOL, K);
}

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
#define CL_COLS 8
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
static void col_lanes_launch(cudaStream_t s, float *out, const float *a, const float *b,
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
    col_lanes_launch(s, out, a, b, sc, ld, N, W);
    return cudaGetLastError();
}

/* ---- matmul backward ------------------------------------------------------------------------ */

cudaError_t kiln_cuda_matmul_backward(cudaStream_t s, float *dx, float *dW, float *dbias,
                                      const float *dy, const float *x, const uint8_t *w,
                                      size_t row_bytes, kiln_dtype dt, int64_t R, int64_t C,
                                      int N, bool accumulate_dx) {
    if (N <= 0 || R <= 0 || C <= 0) return cudaSuccess;
    if (!kiln_cuda_backward_dtype_supported(dt)) return cudaErrorInvalidValue;
    if ((dx && !bwd_gemm_fits(N, C)) || (dW && !bwd_gemm_fits(R, C)) ||
        (R + CL_COLS - 1) / CL_COLS > INT_MAX)
        return cudaErrorInvalidConfiguration;
    cudaError_t e;
    if (dx) { /* dx(N,C) = dy(N,R) @ W(R,C): A(n, r) = dy[n*R + r], B = W */
        switch (dt) {
        case KILN_DTYPE_F32:
            bwd_gemm_launch<KILN_DTYPE_F32>(s, dx, C, accumulate_dx, dy, R, 1, w, row_bytes, N,
                                            C, R);
            break;
        case KILN_DTYPE_BF16:
            bwd_gemm_launch<KILN_DTYPE_BF16>(s, dx, C, accumulate_dx, dy, R, 1, w, row_bytes, N,
                                             C, R);
            break;
        default:
            bwd_gemm_launch<KILN_DTYPE_F16>(s, dx, C, accumulate_dx, dy, R, 1, w, row_bytes, N,
                                            C, R);
            break;
        }
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
    if (dW) { /* dW(R,C) += dy^T @ x: A(r, n) = dy[n*R + r], B = x(N,C) */
        bwd_gemm_launch<KILN_DTYPE_F32>(s, dW, C, true, dy, 1, R, (const uint8_t *)x,
                                        (size_t)C * sizeof(float), R, C, N);
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
    if (dbias) { /* dbias(R) += lane-16 over n of fmaf(dy[n,r], 1, .) */
        col_lanes_launch(s, dbias, dy, NULL, NULL, R, N, R);
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
    return cudaSuccess;
}

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
 * Aliasing (cuda_backward.h): dx may be dy, so neither is __restrict__; x, w and rstd never
 * alias an output. Each element of dx is read (accumulate) and written by the thread that
 * read the same element of dy, after that read; the trees (which need every lane) order all
 * of a row's reads for the dots before any write. */
#define RMS_ROWS_PER_BLOCK 4 /* 64 threads: N = 2048 rows make 512 blocks for 132 SMs */
#define RMS_THREADS (RMS_ROWS_PER_BLOCK * 16)
static_assert(RMS_THREADS % 32 == 0, "a half-warp never straddles two blocks' rows");

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
#define RMS_CHUNK 16
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
        col_lanes_launch(s, dw, dy, x, rstd, C, N, C);
        e = cudaGetLastError();
    }
    return e;
}

/* ---- rope backward: one thread per rotated pair --------------------------------------------- */

static __global__ void rope_bwd_kernel(float *d, const int32_t *__restrict__ pos, int H, int HS,
                                       const float *__restrict__ cos_tab,
                                       const float *__restrict__ sin_tab, int64_t total) {
    const int half = HS / 2;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (int64_t)gridDim.x * blockDim.x) {
        const int64_t nh = u / half; /* token * H + head */
        const int i = (int)(u - nh * half);
        const int64_t n = nh / H;
        float *v = d + nh * HS;
        const float c = cos_tab[(int64_t)pos[n] * half + i];
        const float sn = sin_tab[(int64_t)pos[n] * half + i];
        const float a = v[i], b = v[i + half];
        v[i] = a * c + b * sn;
        v[i + half] = b * c - a * sn;
    }
}

/* The same pairs, each result also (or only) stored as its bf16 rounding into d16 (token n's
 * row at d16 + n * ld16). */
static __global__ void rope_bwd_bf16_kernel(float *d, uint16_t *__restrict__ d16, int64_t ld16,
                                            int keep_f32, const int32_t *__restrict__ pos, int H,
                                            int HS, const float *__restrict__ cos_tab,
                                            const float *__restrict__ sin_tab, int64_t total) {
    const int half = HS / 2;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (int64_t)gridDim.x * blockDim.x) {
        const int64_t nh = u / half;
        const int i = (int)(u - nh * half);
        const int64_t n = nh / H;
        float *v = d + nh * HS;
        uint16_t *v16 = d16 + n * ld16 + (nh - n * H) * HS;
        const float c = cos_tab[(int64_t)pos[n] * half + i];
        const float sn = sin_tab[(int64_t)pos[n] * half + i];
        const float a = v[i], b = v[i + half];
        const float ra = a * c + b * sn, rb = b * c - a * sn;
        v16[i] = kiln_bf16_rne(ra);
        v16[i + half] = kiln_bf16_rne(rb);
        if (keep_f32) {
            v[i] = ra;
            v[i + half] = rb;
        }
    }
}

/* The same for half = HALF (head sizes 64 and 128), a thread per two neighbouring pairs
 * (i, i + 1 and i + HALF, i + HALF + 1: 8-byte loads, a 4-byte bf16 store each), 32-bit
 * indices, the division by the pairs a row a shift: the same operations on each element. */
template <int HALF>
static __global__ void rope_bwd_bf16_vec_kernel(float *d, uint16_t *__restrict__ d16,
                                                size_t ld16, int keep_f32,
                                                const int32_t *__restrict__ pos, unsigned H,
                                                const float *__restrict__ cos_tab,
                                                const float *__restrict__ sin_tab, unsigned total) {
    constexpr unsigned Q = HALF / 2; /* items a (token, head) row */
    for (unsigned u = blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += gridDim.x * blockDim.x) {
        const unsigned nh = u / Q, i = 2 * (u - nh * Q), n = nh / H;
        float *v = d + (size_t)nh * (2 * HALF);
        const size_t t = (size_t)pos[n] * HALF + i;
        const float2 c = *(const float2 *)(cos_tab + t), sn = *(const float2 *)(sin_tab + t);
        const float2 a = *(const float2 *)(v + i), b = *(const float2 *)(v + i + HALF);
        const float ra0 = a.x * c.x + b.x * sn.x, rb0 = b.x * c.x - a.x * sn.x;
        const float ra1 = a.y * c.y + b.y * sn.y, rb1 = b.y * c.y - a.y * sn.y;
        uint16_t *v16 = d16 + (size_t)n * ld16 + (size_t)(nh - n * H) * (2 * HALF);
        *(uint32_t *)(v16 + i) = (uint32_t)kiln_bf16_rne(ra0) | ((uint32_t)kiln_bf16_rne(ra1) << 16);
        *(uint32_t *)(v16 + i + HALF) =
            (uint32_t)kiln_bf16_rne(rb0) | ((uint32_t)kiln_bf16_rne(rb1) << 16);
        if (keep_f32) {
            *(float2 *)(v + i) = make_float2(ra0, ra1);
            *(float2 *)(v + i + HALF) = make_float2(rb0, rb1);
        }
    }
}

cudaError_t kiln_cuda_rope_backward_bf16(cudaStream_t s, float *d, uint16_t *d16, int64_t ld16,
                                         int keep_f32, const int32_t *pos, int N, int H, int HS,
                                         const float *cos_tab, const float *sin_tab) {
    const int64_t total = (int64_t)N * H * (HS / 2);
    if (N <= 0 || H <= 0 || total <= 0) return cudaSuccess;
    if (ld16 < (int64_t)H * HS) return cudaErrorInvalidValue;
    const bool vec = (HS == 64 || HS == 128) && total / 2 < (int64_t)1 << 31 &&
                     ((uintptr_t)d & 7u) == 0 && ((uintptr_t)d16 & 3u) == 0 && ld16 % 2 == 0 &&
                     ((uintptr_t)cos_tab & 7u) == 0 && ((uintptr_t)sin_tab & 7u) == 0;
    if (vec) {
        const unsigned items = (unsigned)(total / 2);
        if (HS == 64)
            rope_bwd_bf16_vec_kernel<32><<<grid_for(items, 256), 256, 0, s>>>(
                d, d16, (size_t)ld16, keep_f32, pos, (unsigned)H, cos_tab, sin_tab, items);
        else
            rope_bwd_bf16_vec_kernel<64><<<grid_for(items, 256), 256, 0, s>>>(
                d, d16, (size_t)ld16, keep_f32, pos, (unsigned)H, cos_tab, sin_tab, items);
        return cudaGetLastError();
    }
    rope_bwd_bf16_kernel<<<grid_for(total, 256), 256, 0, s>>>(d, d16, ld16, keep_f32, pos, H, HS,
                                                              cos_tab, sin_tab, total);
    return cudaGetLastError();
}

cudaError_t kiln_cuda_rope_backward(cudaStream_t s, float *d, const int32_t *pos, int N, int H,
                                    int HS, const float *cos_tab, const float *sin_tab) {
    const int64_t total = (int64_t)N * H * (HS / 2);
    if (N <= 0 || H <= 0 || total <= 0) return cudaSuccess;
    rope_bwd_kernel<<<grid_for(total, 256), 256, 0, s>>>(d, pos, H, HS, cos_tab, sin_tab, total);
    return cudaGetLastError();
}

/* ---- attention backward: statistics, dq, then dk/dv ----------------------------------------- */

/* Three passes, as the CPU (one block of 128 threads per work unit):
 *   stats (token i, head h): m and l with exactly the forward's online softmax (key blocks of
 *     64, alpha rescaling; the block max and the sum taken by one thread in key order, since
 *     the max's choice between -0 and +0 depends on order), and D = dot(dout_ih, out_ih);
 *     ws[(i*NH + h)*3 + {0,1,2}] = m, l, D.
 *   dq (i, h): for keys j ascending, s = dot(q, k_j) * scale, p = kiln_expf(s - m),
 *     ds = (p / l) * (dot(dout, v_j) - D); dq[d] = fmaf(ds, k_j[d], dq[d]); then dq * scale.
 *   dk/dv (key position jp, kv head g): for query heads h of the group ascending, then tokens
 *     i >= jp - n_past ascending, p = kiln_expf(dot(k_j, q_ih) * scale - m) / l,
 *     ds = p * (dot(v_j, dout_ih) - D); dv[d] = fmaf(p, dout_ih[d], .), dk[d] = fmaf(ds,
 *     q_ih[d], .); then dk * scale.
 * The dots of a block of 64 keys (queries) are split over the 8 half-warps, each one
 * half-warp's lane-16 dot; the axpy over keys (queries) is split over d, each d walking them
 * in order. */
#define AB_THREADS 128
#define AB_HW (AB_THREADS / 16)

/* The first key a query with T keys (0..T-1, causal) reads under a sliding window (0: none):
 * its key blocks stay aligned at multiples of 64, the first cut to start at it (the CPU's). */
static __device__ __forceinline__ int attn_lo(int T, int window) {
    return window > 0 && T > window ? T - window : 0;
}

static __device__ __forceinline__ float hw_dot(const float *a, const float *__restrict__ b,
                                               int HS, int lane, unsigned mask) {
    float acc = 0.0f;
    for (int d = lane; d < HS; d += 16) acc = __fmaf_rn(a[d], b[d], acc);
    return lane16_tree(acc, mask);
}

static __global__ void __launch_bounds__(AB_THREADS)
attn_bwd_stats_kernel(float *__restrict__ ws, const float *__restrict__ q,
                      const float *__restrict__ kc, const float *__restrict__ dout,
                      const float *__restrict__ out, int n_past, int NH, int KVH, int HS,
                      float scale, int window) {
    extern __shared__ float sm[];
    float *qs = sm; /* (HS) */
    __shared__ float s[KILN_ATTN_BLOCK], p[KILN_ATTN_BLOCK];
    __shared__ float sh_m_new, sh_alpha;
    const int i = blockIdx.x / NH, h = blockIdx.x % NH;
    const int kvh = h / (NH / KVH);
    const int64_t stride = (int64_t)KVH * HS, u = (int64_t)i * NH + h;
    const int tid = threadIdx.x, lane = tid & 15, hw = tid >> 4;
    const unsigned mask = half_warp_mask();
    const float *kbase = kc + (int64_t)kvh * HS;
    for (int d = tid; d < HS; d += AB_THREADS) qs[d] = q[u * HS + d];
    const int T = n_past + i + 1, lo = attn_lo(T, window);
    float m = -INFINITY, l = 0.0f; /* meaningful in thread 0 */
    __syncthreads();
    for (int kb0 = lo / KILN_ATTN_BLOCK * KILN_ATTN_BLOCK; kb0 < T; kb0 += KILN_ATTN_BLOCK) {
        const int kb = kb0 > lo ? kb0 : lo; /* the block's first key */
        const int nk = T - kb0 < KILN_ATTN_BLOCK ? T - kb : kb0 + KILN_ATTN_BLOCK - kb;
        for (int j = hw; j < nk; j += AB_HW) {
            const float a = hw_dot(qs, kbase + (int64_t)(kb + j) * stride, HS, lane, mask);
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
        const float m_new = sh_m_new;
        for (int t = tid; t < nk; t += AB_THREADS) p[t] = kiln_expf(s[t] - m_new);
        __syncthreads();
        if (tid == 0) {
            l = l * sh_alpha;
            for (int t = 0; t < nk; t++) l = l + p[t];
        }
        m = m_new;
        __syncthreads(); /* s, p and the shared scalars are rewritten by the next block */
    }
    if (hw == 0) {
        const float D = hw_dot(dout + u * HS, out + u * HS, HS, lane, mask);
        if (lane == 0) {
            ws[u * 3 + 0] = m;
            ws[u * 3 + 1] = l;
            ws[u * 3 + 2] = D;
        }
    }
}

static __global__ void __launch_bounds__(AB_THREADS)
attn_bwd_dq_kernel(float *__restrict__ dq, const float *__restrict__ ws,
                   const float *__restrict__ q, const float *__restrict__ kc,
                   const float *__restrict__ vc, const float *__restrict__ dout, int n_past,
                   int NH, int KVH, int HS, float scale, int window) {
    extern __shared__ float sm[];
    float *qs = sm, *dos = sm + HS, *acc = sm + 2 * HS; /* (HS) each */
    __shared__ float ds[KILN_ATTN_BLOCK];
    const int i = blockIdx.x / NH, h = blockIdx.x % NH;
    const int kvh = h / (NH / KVH);
    const int64_t stride = (int64_t)KVH * HS, u = (int64_t)i * NH + h;
    const int tid = threadIdx.x, lane = tid & 15, hw = tid >> 4;
    const unsigned mask = half_warp_mask();
    const float *kbase = kc + (int64_t)kvh * HS, *vbase = vc + (int64_t)kvh * HS;
    for (int d = tid; d < HS; d += AB_THREADS) {
        qs[d] = q[u * HS + d];
        dos[d] = dout[u * HS + d];
        acc[d] = 0.0f;
    }
    const float m = ws[u * 3 + 0], l = ws[u * 3 + 1], D = ws[u * 3 + 2];
    const int T = n_past + i + 1, lo = attn_lo(T, window);
    __syncthreads();
    for (int kb0 = lo / KILN_ATTN_BLOCK * KILN_ATTN_BLOCK; kb0 < T; kb0 += KILN_ATTN_BLOCK) {
        const int kb = kb0 > lo ? kb0 : lo;
        const int nk = T - kb0 < KILN_ATTN_BLOCK ? T - kb : kb0 + KILN_ATTN_BLOCK - kb;
        for (int j = hw; j < nk; j += AB_HW) {
            const int64_t off = (int64_t)(kb + j) * stride;
            const float sd = hw_dot(qs, kbase + off, HS, lane, mask);
            const float dp = hw_dot(dos, vbase + off, HS, lane, mask);
            if (lane == 0) {
                const float pj = kiln_expf(sd * scale - m);
                ds[j] = (pj / l) * (dp - D);
            }
        }
        __syncthreads();
        for (int d = tid; d < HS; d += AB_THREADS) { /* each d owned by one thread throughout */
            float a = acc[d];
            const float *kd = kbase + (int64_t)kb * stride + d;
            for (int t = 0; t < nk; t++) a = __fmaf_rn(ds[t], kd[(int64_t)t * stride], a);
            acc[d] = a;
        }
        __syncthreads(); /* ds is rewritten by the next block */
    }
    for (int d = tid; d < HS; d += AB_THREADS) dq[u * HS + d] = acc[d] * scale;
}

static __global__ void __launch_bounds__(AB_THREADS)
attn_bwd_dkv_kernel(float *__restrict__ dk, float *__restrict__ dv,
                    const float *__restrict__ ws, const float *__restrict__ q,
                    const float *__restrict__ kc, const float *__restrict__ vc,
                    const float *__restrict__ dout, int N, int n_past, int NH, int KVH, int HS,
                    float scale, int window) {
    extern __shared__ float sm[];
    float *ks = sm, *vs = sm + HS, *dka = sm + 2 * HS, *dva = sm + 3 * HS; /* (HS) each */
    __shared__ float ps[KILN_ATTN_BLOCK], dss[KILN_ATTN_BLOCK];
    const int jp = blockIdx.x / KVH, g = blockIdx.x % KVH;
    const int G = NH / KVH;
    const int64_t kvrow = ((int64_t)jp * KVH + g) * HS, qstride = (int64_t)NH * HS;
    const int tid = threadIdx.x, lane = tid & 15, hw = tid >> 4;
    const unsigned mask = half_warp_mask();
    for (int d = tid; d < HS; d += AB_THREADS) {
        ks[d] = kc[kvrow + d];
        vs[d] = vc[kvrow + d];
        dka[d] = 0.0f;
        dva[d] = 0.0f;
    }
    const int i_lo = jp - n_past > 0 ? jp - n_past : 0; /* causal: n_past + i >= jp */
    int i_hi = N; /* the window: n_past + i < jp + window */
    if (window > 0 && (int64_t)jp - n_past + window < i_hi) i_hi = jp - n_past + window;
    __syncthreads();
    for (int h = g * G; h < (g + 1) * G; h++) {
        for (int ib = i_lo; ib < i_hi; ib += KILN_ATTN_BLOCK) {
            const int nb = i_hi - ib < KILN_ATTN_BLOCK ? i_hi - ib : KILN_ATTN_BLOCK;
            for (int t = hw; t < nb; t += AB_HW) {
                const int64_t uq = (int64_t)(ib + t) * NH + h;
                const float sd = hw_dot(ks, q + uq * HS, HS, lane, mask);
                const float dp = hw_dot(vs, dout + uq * HS, HS, lane, mask);
                if (lane == 0) {
                    const float *st = ws + uq * 3;
                    const float pt = kiln_expf(sd * scale - st[0]) / st[1];
                    ps[t] = pt;
                    dss[t] = pt * (dp - st[2]);
                }
            }
            __syncthreads();
            const float *qb = q + ((int64_t)ib * NH + h) * HS;
            const float *db = dout + ((int64_t)ib * NH + h) * HS;
            for (int d = tid; d < HS; d += AB_THREADS) { /* each d owned by one thread */
                float av = dva[d], bk = dka[d];
                for (int t = 0; t < nb; t++) {
                    av = __fmaf_rn(ps[t], db[(int64_t)t * qstride + d], av);
                    bk = __fmaf_rn(dss[t], qb[(int64_t)t * qstride + d], bk);
                }
                dva[d] = av;
                dka[d] = bk;
            }
            __syncthreads(); /* ps, dss are rewritten by the next block */
        }
    }
    for (int d = tid; d < HS; d += AB_THREADS) {
        dk[kvrow + d] = dka[d] * scale;
        dv[kvrow + d] = dva[d];
    }
}

cudaError_t kiln_cuda_attention_backward(cudaStream_t s, float *dq, float *dk, float *dv,
                                         const float *dout, const float *q, const float *k,
                                         const float *v, const float *out, float *ws, int N,
                                         int n_past, int NH, int KVH, int HS, float scale,
                                         int window) {
    if (N <= 0 || NH <= 0 || HS <= 0) return cudaSuccess;
    if (HS > KILN_CUDA_MAX_HS || KVH <= 0 || NH % KVH != 0 || n_past < 0 || window < 0)
        return cudaErrorInvalidValue;
    const int64_t n_q = (int64_t)N * NH, n_kv = ((int64_t)n_past + N) * KVH;
    if (n_q > INT_MAX || n_kv > INT_MAX || (int64_t)n_past + N > INT_MAX)
        return cudaErrorInvalidConfiguration;
    const size_t f = sizeof(float);
    attn_bwd_stats_kernel<<<(unsigned)n_q, AB_THREADS, (size_t)HS * f, s>>>(
        ws, q, k, dout, out, n_past, NH, KVH, HS, scale, window);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    attn_bwd_dq_kernel<<<(unsigned)n_q, AB_THREADS, (size_t)3 * HS * f, s>>>(
        dq, ws, q, k, v, dout, n_past, NH, KVH, HS, scale, window);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    attn_bwd_dkv_kernel<<<(unsigned)n_kv, AB_THREADS, (size_t)4 * HS * f, s>>>(
        dk, dv, ws, q, k, v, dout, N, n_past, NH, KVH, HS, scale, window);
    return cudaGetLastError();
}

/* ---- swiglu backward: one thread per element ------------------------------------------------ */

/* e = kiln_expf(-g); den = 1 + e; s = 1 / den; silu = g / den (the forward's silu);
 * dup = dout * silu; dgate = (dout * u) * (s * (1 + g * (1 - s))). All three inputs are read
 * before either output is written, so the outputs may alias inputs at the same index. */
static __device__ __forceinline__ void swiglu_bwd_elem(float g, float uv, float dov,
                                                       float *r_gate, float *r_up) {
    const float e = kiln_expf(-g);
    const float den = 1.0f + e;
    const float sg = 1.0f / den;
    const float silu = g / den;
    *r_up = dov * silu;
    *r_gate = (dov * uv) * (sg * (1.0f + g * (1.0f - sg)));
}

template <typename O, typename I>
static __global__ void swiglu_bwd_kernel(O *dgate, O *dup, const float *dout, const I *gate,
                                         const I *up, size_t n) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (size_t)gridDim.x * blockDim.x) {
        float r_gate, r_up;
        swiglu_bwd_elem(load_in(gate + u), load_in(up + u), dout[u], &r_gate, &r_up);
        store_out(dup + u, r_up);
        store_out(dgate + u, r_gate);
    }
}

/* bf16 gate, up in and dgate, dup out, 4 elements a thread (float4 dout, 8-byte bf16 loads
 * and stores), each element as above. */
static __global__ void swiglu_bwd_bf16x4_kernel(uint2 *dgate, uint2 *dup, const float4 *dout,
                                                const uint2 *gate, const uint2 *up, size_t n4) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n4;
         u += (size_t)gridDim.x * blockDim.x) {
        const float4 g = bf16x4_f32(gate[u]), v = bf16x4_f32(up[u]), d = dout[u];
        float a0, a1, a2, a3, b0, b1, b2, b3; /* dgate, dup */
        swiglu_bwd_elem(g.x, v.x, d.x, &a0, &b0);
        swiglu_bwd_elem(g.y, v.y, d.y, &a1, &b1);
        swiglu_bwd_elem(g.z, v.z, d.z, &a2, &b2);
        swiglu_bwd_elem(g.w, v.w, d.w, &a3, &b3);
        dgate[u] = f32x4_bf16(a0, a1, a2, a3);
        dup[u] = f32x4_bf16(b0, b1, b2, b3);
    }
}

cudaError_t kiln_cuda_swiglu_backward(cudaStream_t s, float *dgate, float *dup,
                                      const float *dout, const float *gate, const float *up,
                                      size_t n) {
    if (n == 0) return cudaSuccess;
    swiglu_bwd_kernel<float, float><<<grid_for((int64_t)n, 256), 256, 0, s>>>(dgate, dup, dout,
                                                                               gate, up, n);
    return cudaGetLastError();
}

/* ---- geglu backward: one thread per element (kmath.h kiln_geglu_backward, the CPU's bits) -- */

static __global__ void geglu_bwd_kernel(float *dgate, float *dup, const float *dout,
                                        const float *gate, const float *up, size_t n) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (size_t)gridDim.x * blockDim.x) {
        float dg, du;
        kiln_geglu_backward(gate[u], up[u], dout[u], &dg, &du);
        dup[u] = du;
        dgate[u] = dg;
    }
}

cudaError_t kiln_cuda_geglu_backward(cudaStream_t s, float *dgate, float *dup, const float *dout,
                                     const float *gate, const float *up, size_t n) {
    if (n == 0) return cudaSuccess;
    geglu_bwd_kernel<<<grid_for((int64_t)n, 256), 256, 0, s>>>(dgate, dup, dout, gate, up, n);
    return cudaGetLastError();
}

/* Fast mode (kiln_fast_swiglu_bwd), one element a thread: any alignment, any tail. dout in
 * f32 (DI float) or bf16 (DI uint16_t); dgate, dup rows of cols values ld apart. */
template <typename DI>
static __global__ void swiglu_bwd_fast_kernel(uint16_t *dgate, uint16_t *dup, int64_t ld,
                                              const DI *dout, const uint16_t *gate,
                                              const uint16_t *up, int64_t cols, int64_t n) {
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (int64_t)gridDim.x * blockDim.x) {
        float r_gate, r_up;
        kiln_fast_swiglu_bwd(load_in(gate + u), load_in(up + u), load_in(dout + u), &r_gate,
                             &r_up);
        const int64_t r = u / cols, o = r * ld + (u - r * cols);
        dup[o] = kiln_bf16_rne(r_up);
        dgate[o] = kiln_bf16_rne(r_gate);
    }
}

/* 8 values of dout at item u: 16 bytes of bf16, or 32 bytes of f32 */
static __device__ __forceinline__ void load8(const uint16_t *d, size_t u, float *f) {
    bf16x8_f32(reinterpret_cast<const uint4 *>(d)[u], f);
}
static __device__ __forceinline__ void load8(const float *d, size_t u, float *f) {
    const float4 a = reinterpret_cast<const float4 *>(d)[2 * u];
    const float4 b = reinterpret_cast<const float4 *>(d)[2 * u + 1];
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

/* Fast mode, 8 elements an item (16-byte loads and stores), two items a thread with their
 * loads first; q_row items a row (cols / 8), rows ld apart in dgate, dup; nq items. */
template <typename DI>
static __global__ void swiglu_bwd_fast_x8_kernel(uint16_t *dgate, uint16_t *dup, size_t ld,
                                                 const DI *dout, const uint4 *gate,
                                                 const uint4 *up, size_t q_row, size_t nq) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < nq; u += 2 * stride) {
        size_t it[2] = {u, u + stride};
        const int m = it[1] < nq ? 2 : 1;
        float g[2][8], v[2][8], d[2][8];
#pragma unroll
        for (int k = 0; k < 2; k++)
            if (k < m) {
                bf16x8_f32(gate[it[k]], g[k]);
                bf16x8_f32(up[it[k]], v[k]);
                load8(dout, it[k], d[k]);
            }
#pragma unroll
        for (int k = 0; k < 2; k++)
            if (k < m) {
                float a[8], b[8]; /* dgate, dup */
#pragma unroll
                for (int i = 0; i < 8; i++)
                    kiln_fast_swiglu_bwd(g[k][i], v[k][i], d[k][i], &a[i], &b[i]);
                const size_t r = it[k] / q_row, o = r * ld + (it[k] - r * q_row) * 8;
                *reinterpret_cast<uint4 *>(dgate + o) = f32x8_bf16(a);
                *reinterpret_cast<uint4 *>(dup + o) = f32x8_bf16(b);
            }
    }
}

/* The fast kernels for rows x cols: 8-wide where cols, ld and every pointer allow it. */
template <typename DI>
static cudaError_t swiglu_bwd_fast_launch(cudaStream_t s, uint16_t *dgate, uint16_t *dup,
                                          int64_t ld, const DI *dout, const uint16_t *gate,
                                          const uint16_t *up, int64_t rows, int64_t cols) {
    const int64_t n = rows * cols;
    if (cols % 8 == 0 && ld % 8 == 0 &&
        (((uintptr_t)dout | (uintptr_t)dgate | (uintptr_t)dup | (uintptr_t)gate |
          (uintptr_t)up) & 15) == 0) {
        const size_t nq = (size_t)(n / 8);
        swiglu_bwd_fast_x8_kernel<DI><<<grid_for((int64_t)((nq + 1) / 2), 256), 256, 0, s>>>(
            dgate, dup, (size_t)ld, dout, reinterpret_cast<const uint4 *>(gate),
            reinterpret_cast<const uint4 *>(up), (size_t)(cols / 8), nq);
    } else {
        swiglu_bwd_fast_kernel<DI><<<grid_for(n, 256), 256, 0, s>>>(dgate, dup, ld, dout, gate,
                                                                    up, cols, n);
    }
    return cudaGetLastError();
}

cudaError_t kiln_cuda_swiglu_backward_bf16(cudaStream_t s, uint16_t *dgate, uint16_t *dup,
                                           const float *dout, const uint16_t *gate,
                                           const uint16_t *up, size_t n, bool fast) {
    if (n == 0) return cudaSuccess;
    if (fast)
        return swiglu_bwd_fast_launch<float>(s, dgate, dup, (int64_t)n, dout, gate, up, 1, (int64_t)n);
    size_t done = 0;
    if (((uintptr_t)dout & 15) == 0 &&
        (((uintptr_t)dgate | (uintptr_t)dup | (uintptr_t)gate | (uintptr_t)up) & 7) == 0 &&
        n >= 4) {
        const size_t n4 = n / 4;
        swiglu_bwd_bf16x4_kernel<<<grid_for((int64_t)n4, 256), 256, 0, s>>>(
            reinterpret_cast<uint2 *>(dgate), reinterpret_cast<uint2 *>(dup),
            reinterpret_cast<const float4 *>(dout), reinterpret_cast<const uint2 *>(gate),
            reinterpret_cast<const uint2 *>(up), n4);
        done = 4 * n4;
    }
    if (done < n)
        swiglu_bwd_kernel<uint16_t, uint16_t><<<grid_for((int64_t)(n - done), 256), 256, 0, s>>>(
            dgate + done, dup + done, dout + done, gate + done, up + done, n - done);
    return cudaGetLastError();
}

/* bf16 dout too, dgate and dup written as rows of cols values ld apart (column blocks of a
 * wider matrix): a thread per 4 elements of a row (cols % 4 == 0), or one per element. */
static __global__ void swiglu_bwd_d16_x4_kernel(uint16_t *dgate, uint16_t *dup, size_t ld,
                                                const uint2 *dout, const uint2 *gate,
                                                const uint2 *up, unsigned q_row, unsigned nq) {
    for (unsigned u = blockIdx.x * blockDim.x + threadIdx.x; u < nq;
         u += gridDim.x * blockDim.x) {
        const float4 g = bf16x4_f32(gate[u]), v = bf16x4_f32(up[u]), d = bf16x4_f32(dout[u]);
        float a0, a1, a2, a3, b0, b1, b2, b3; /* dgate, dup */
        swiglu_bwd_elem(g.x, v.x, d.x, &a0, &b0);
        swiglu_bwd_elem(g.y, v.y, d.y, &a1, &b1);
        swiglu_bwd_elem(g.z, v.z, d.z, &a2, &b2);
        swiglu_bwd_elem(g.w, v.w, d.w, &a3, &b3);
        const unsigned r = u / q_row;
        const size_t o = (size_t)r * ld + (size_t)(u - r * q_row) * 4;
        *reinterpret_cast<uint2 *>(dgate + o) = f32x4_bf16(a0, a1, a2, a3);
        *reinterpret_cast<uint2 *>(dup + o) = f32x4_bf16(b0, b1, b2, b3);
    }
}

static __global__ void swiglu_bwd_d16_kernel(uint16_t *dgate, uint16_t *dup, int64_t ld,
                                             const uint16_t *dout, const uint16_t *gate,
                                             const uint16_t *up, int64_t cols, int64_t n) {
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (int64_t)gridDim.x * blockDim.x) {
        float r_gate, r_up;
        swiglu_bwd_elem(load_in(gate + u), load_in(up + u), load_in(dout + u), &r_gate, &r_up);
        const int64_t r = u / cols, o = r * ld + (u - r * cols);
        store_out(dup + o, r_up);
        store_out(dgate + o, r_gate);
    }
}

cudaError_t kiln_cuda_swiglu_backward_bf16_d16(cudaStream_t s, uint16_t *dgate, uint16_t *dup,
                                               int64_t ld, const uint16_t *dout,
                                               const uint16_t *gate, const uint16_t *up,
                                               int64_t rows, int64_t cols, bool fast) {
    if (rows <= 0 || cols <= 0) return cudaSuccess;
    if (ld < cols) return cudaErrorInvalidValue;
    if (fast) return swiglu_bwd_fast_launch<uint16_t>(s, dgate, dup, ld, dout, gate, up, rows, cols);
    const int64_t n = rows * cols;
    if (cols % 4 == 0 && ld % 4 == 0 && n / 4 < ((int64_t)1 << 32) &&
        (((uintptr_t)dout | (uintptr_t)dgate | (uintptr_t)dup | (uintptr_t)gate |
          (uintptr_t)up) & 7) == 0) {
        const unsigned nq = (unsigned)(n / 4);
        swiglu_bwd_d16_x4_kernel<<<grid_for((int64_t)nq, 256), 256, 0, s>>>(
            dgate, dup, (size_t)ld, reinterpret_cast<const uint2 *>(dout),
            reinterpret_cast<const uint2 *>(gate), reinterpret_cast<const uint2 *>(up),
            (unsigned)(cols / 4), nq);
    } else {
        swiglu_bwd_d16_kernel<<<grid_for(n, 256), 256, 0, s>>>(dgate, dup, ld, dout, gate, up,
                                                               cols, n);
    }
    return cudaGetLastError();
}

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
