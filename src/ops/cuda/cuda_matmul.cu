/*
 * cuda_matmul.cu -- the matrix products of the CUDA backend, every mode and both directions,
 * and their launchers (contracts: cuda_matmul.h). In order:
 *   - the dtypes the dequantizing kernels take;
 *   - the auditable forward: out = x W^T, a half-warp's lane-16 dot per output on the weight
 *     bytes of any GGUF type, the CPU backend's bits;
 *   - the auditable backward: dx = dy W and dW += dy^T x by the lane-16 GEMM (dbias: the
 *     column lanes of cuda_norm.cu), the CPU backend's bits;
 *   - the fast mode's GEMM module: cuBLASLt on bf16 tensor cores, with the operand
 *     conversions to bf16;
 *   - the fast mode's decode matrix-vector product on the weight bytes (N <= 8);
 *   - the fast mode's int8-activation product for Q8_0 / Q4_0 / Q4_1 (the CPU fast mode's
 *     definition and bits);
 *   - the fast matmul backward: two GEMMs of the module (dbias: cuda_norm.cu's fixed-order
 *     column sums);
 *   - the self-check that gates the wgmma kernels (cuda_wgmma.cuh) per device.
 *
 * Auditable arithmetic: each kernel transcribes docs/ARITHMETIC.md (the backward ops: its
 * "Backward ops", as src/ops/cpu/backward_portable.c computes them): the same binary32
 * operations, in the same order, per output element, as the CPU reference. Parallelism only ever
 * splits work ACROSS output elements or across the 16 lanes of the defined dot product, never
 * along a sequential chain, so the bits cannot depend on the launch shape. Compiled with
 * --fmad=false (no a*b+c contraction: every FMA is a written __fmaf_rn / fmaf), IEEE division
 * and square root (nvcc's defaults without --use_fast_math) and no flush-to-zero.
 */
#include "cuda_matmul.h"

#include "cuda_common.cuh"
#include "cuda_norm.h" /* dbias: the column sums */
#include "cuda_wgmma.cuh"

#include "../../base/kmath.h"

#include <cublasLt.h>
#include <cuda_fp16.h>
#include <float.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* =================================================================================================
 * The dtypes the dequantizing kernels take (cuda_common.cuh's deq: every GGUF type).
 * ============================================================================================== */

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

/* =================================================================================================
 * Auditable forward.
 * ============================================================================================== */

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

/* One product of a launch of either product kernel (kiln_cuda_product_job), with its first
 * block in the grid and (the fast kernel) its split S, and the launch's jobs. */
struct prod_job {
    float *out;
    const float *res;
    const uint8_t *w, *w_up;
    const float *bias, *bias_up;
    size_t row_bytes;
    int64_t R;
    int S;
    unsigned blk0;
};
struct prod_jobs {
    prod_job job[KILN_CUDA_PRODUCT_MAX_JOBS];
    int n;
    const float *norm_w; /* NORM: x is rmsnorm(x) * norm_w (kiln_cuda_rmsnorm's bits) */
    float eps;
};

/* The launch's jobs from the caller's (checked by product_jobs_ok), norm as given. */
static prod_jobs prod_jobs_of(int n, const kiln_cuda_product_job *in, const float *norm_w, float eps) {
    prod_jobs a;
    memset(&a, 0, sizeof a);
    a.n = n;
    a.norm_w = norm_w;
    a.eps = eps;
    for (int j = 0; j < n; j++)
        a.job[j] = prod_job{in[j].out, in[j].res, in[j].w, in[j].w_up, in[j].bias, in[j].bias_up,
                            in[j].row_bytes, in[j].R, 0, 0};
    return a;
}

/* The RMSNorm prologue of the product kernels (NORM): the scale r of token rows n0 .. n0 +
 * nt - 1 of x(., C) into sr[0 .. nt), half-warp t taking row n0 + t exactly as
 * kiln_cuda_rmsnorm does (lane j's fmaf chain over elements j + 16k, the lane-16 tree,
 * kiln_rms_scale), so x's normed element i is (x[i] * r) * w[i] with rmsnorm's bits. Every
 * thread of the block calls it (it ends with a barrier). */
static __device__ __forceinline__ void norm_prologue(float *sr, const float *__restrict__ x,
                                                     int64_t C, int n0, int nt, float eps) {
    const int hw = threadIdx.x >> 4, lane = threadIdx.x & 15;
    if (hw < nt) {
        const float *xr = x + (int64_t)(n0 + hw) * C;
        float acc = 0.0f;
        for (int64_t i = lane; i < C; i += 16) acc = __fmaf_rn(xr[i], xr[i], acc);
        const float sum = lane16_tree(acc, half_warp_mask());
        if (lane == 0) sr[hw] = kiln_rms_scale(sum, (int)C, eps);
    }
    __syncthreads();
}
/* x's normed element: rmsnorm's (x * r) * w, two roundings. */
static __device__ __forceinline__ float normed(float x, float r, float w) {
    return __fmul_rn(__fmul_rn(x, r), w);
}

/* Grid: x = the jobs' row blocks one after another (job j from job[j].blk0), y = token
 * tiles of NT. PAIR: a block takes 8 rows, the two half-warps of a warp the same row r of the
 * gate (lanes 0-15) and of the up weights (lanes 16-31); the gate's half-warp gets the up's
 * dot by a shuffle and writes swiglu(gate, up). Each row's dot is the one it is alone. */
template <int DT, int NT, int PER_STEP, bool PAIR, bool NORM>
static __global__ void __launch_bounds__(MM_THREADS)
matmul_kernel(const __grid_constant__ prod_jobs jobs, const float *__restrict__ x, int64_t C,
              int N) {
    constexpr bool plain = blk<DT>::BS == 1;
    constexpr int VB = plain ? 16 : blk<DT>::BS;            /* elements per walk block */
    constexpr int VTS = plain ? 16 * blk<DT>::TS : blk<DT>::TS; /* its bytes */
    constexpr int EPL = VB / 16;                             /* the lane's elements in it */
    constexpr int UB = PER_STEP / EPL > 0 ? PER_STEP / EPL : 1;
    constexpr int RPB = PAIR ? MM_ROWS_PER_BLOCK / 2 : MM_ROWS_PER_BLOCK;
    int jb = 0;
    while (jb + 1 < jobs.n && blockIdx.x >= jobs.job[jb + 1].blk0) jb++;
    const prod_job &J = jobs.job[jb];
    const int64_t R = J.R;
    const int lane = threadIdx.x & 15, hw = threadIdx.x >> 4;
    const int side = PAIR ? (hw & 1) : 0; /* PAIR: 0 the gate's half-warp, 1 the up's */
    const int64_t r = (int64_t)(blockIdx.x - J.blk0) * RPB + (PAIR ? hw >> 1 : hw);
    const int n0 = blockIdx.y * NT;
    const int nt = N - n0 < NT ? N - n0 : NT;
    __shared__ float sr[NORM ? NT : 1];
    if constexpr (NORM) norm_prologue(sr, x, C, n0, nt, jobs.eps);
    if (r >= R) return; /* whole half-warps leave together (PAIR: both halves of a warp) */
    const unsigned mask = half_warp_mask();
    const float *nw = jobs.norm_w + lane; /* NORM: the lane's norm weights, as xt */
    const uint8_t *row = (side ? J.w_up : J.w) + r * J.row_bytes;
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
                if (t < nt) {
                    float xv = xb[(int64_t)t * C + 16 * k];
                    if constexpr (NORM) xv = normed(xv, sr[t], nw[b * VB + 16 * k]);
                    acc[t] = __fmaf_rn(xv, wv[k], acc[t]);
                }
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
                if (t < nt) {
                    float xv = xb[(int64_t)t * C + 16 * k];
                    if constexpr (NORM) xv = normed(xv, sr[t], nw[b * VB + 16 * k]);
                    acc[t] = __fmaf_rn(xv, wv[k], acc[t]);
                }
    }
    if (plain && nb * VB + lane < C) { /* the last, partial run of 16 */
        const float wl = deq<DT>(row, nb * VB + lane);
#pragma unroll
        for (int t = 0; t < NT; t++)
            if (t < nt) {
                float xv = xt[(int64_t)t * C + nb * VB];
                if constexpr (NORM) xv = normed(xv, sr[t], nw[nb * VB]);
                acc[t] = __fmaf_rn(xv, wl, acc[t]);
            }
    }
    const float *bias = side ? J.bias_up : J.bias;
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t >= nt) break; /* uniform across the warp (PAIR: both halves share n0) */
        float s = lane16_tree(acc[t], mask);
        if (bias) s = s + bias[r];
        if constexpr (PAIR) {
            const float u = __shfl_down_sync(0xffffffffu, s, 16); /* the up's, to the gate's lanes */
            s = kiln_swiglu(s, u);
        }
        if (side == 0 && lane == t % 16) {
            const int64_t at = (int64_t)(n0 + t) * R + r;
            J.out[at] = J.res ? s + J.res[at] : s; /* the add op's bits (out may be res) */
        }
    }
}

/* The lane's weights loaded ahead per step at N = 1: 32 or 64, or 0 (the default) for the
 * faster on an H200 (64 for f16/bf16, 32 for the rest: docs/CUDA.md). tests/gpu runs both and
 * bench_cuda_matmul times both. Any value gives the same bits: it only changes when loads are
 * issued, never the order of the FMAs. */
extern "C" int kiln_cuda_matmul_step;
int kiln_cuda_matmul_step = 0;

template <int NT, int PER_STEP, int DT, bool PAIR, bool NORM>
static void matmul_launch_nt(cudaStream_t s, prod_jobs a, const float *x, int64_t C, int N,
                             unsigned gy) {
    constexpr int rpb = PAIR ? MM_ROWS_PER_BLOCK / 2 : MM_ROWS_PER_BLOCK;
    int64_t total = 0;
    for (int j = 0; j < a.n; j++) {
        a.job[j].blk0 = (unsigned)total;
        total += (a.job[j].R + rpb - 1) / rpb;
    }
    matmul_kernel<DT, NT, PER_STEP, PAIR, NORM><<<dim3((unsigned)total, gy), MM_THREADS, 0, s>>>(a, x, C, N);
}

template <int DT, bool PAIR, bool NORM>
static void matmul_launch_pair(cudaStream_t s, const prod_jobs &a, const float *x, int64_t C,
                               int N) {
    const int step = kiln_cuda_matmul_step ? kiln_cuda_matmul_step
                     : (DT == KILN_DTYPE_F16 || DT == KILN_DTYPE_BF16) ? 64 : 32;
    if (N == 1 && step == 32) matmul_launch_nt<1, 32, DT, PAIR, NORM>(s, a, x, C, N, 1);
    else if (N == 1) matmul_launch_nt<1, 64, DT, PAIR, NORM>(s, a, x, C, N, 1);
    else if (N <= 4) matmul_launch_nt<4, 16, DT, PAIR, NORM>(s, a, x, C, N, 1);
    else matmul_launch_nt<8, 16, DT, PAIR, NORM>(s, a, x, C, N, (unsigned)((N + 7) / 8));
}

template <int DT>
static void matmul_launch(cudaStream_t s, const prod_jobs *a, bool pair, const float *x, int64_t C,
                          int N) {
    const bool norm = a->norm_w != NULL;
    if (pair && norm) matmul_launch_pair<DT, true, true>(s, *a, x, C, N);
    else if (pair) matmul_launch_pair<DT, true, false>(s, *a, x, C, N);
    else if (norm) matmul_launch_pair<DT, false, true>(s, *a, x, C, N);
    else matmul_launch_pair<DT, false, false>(s, *a, x, C, N);
}

/* Whether [a, a + an) and [b, b + bn) share a byte. */
static bool ranges_overlap(const void *a, size_t an, const void *b, size_t bn) {
    const uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return a && b && an && bn && x < y + bn && y < x + an;
}

/* The checks kiln_cuda_matmul_multi and kiln_cuda_matvec_fast_multi share (cuda_matmul.h):
 * n, the pair rule, NULLs, R, float alignment, and the outputs apart from x and from each
 * other's outputs and residuals. */
static bool product_jobs_ok(int n, const kiln_cuda_product_job *jobs, const float *x, int64_t C,
                            int N, bool *pair) {
    if (n < 1 || n > KILN_CUDA_PRODUCT_MAX_JOBS || !jobs || !x || C < 1 || N < 1 ||
        (uintptr_t)x % 4 || (uint64_t)C > ((uint64_t)1 << 40))
        return false;
    *pair = jobs[0].w_up != NULL;
    for (int j = 0; j < n; j++) {
        const kiln_cuda_product_job &in = jobs[j];
        /* R <= 2^40 keeps every index product far from overflow */
        if (!in.out || !in.w || in.R < 1 || (uint64_t)in.R > ((uint64_t)1 << 40) ||
            (in.w_up != NULL) != *pair || (!*pair && in.bias_up) || (uintptr_t)in.out % 4 ||
            (uintptr_t)in.res % 4 || (uintptr_t)in.bias % 4 || (uintptr_t)in.bias_up % 4)
            return false;
        const size_t ob = (size_t)N * (size_t)in.R * sizeof(float);
        if (ranges_overlap(in.out, ob, x, (size_t)N * (size_t)C * sizeof(float)) ||
            (in.res && in.res != in.out && ranges_overlap(in.out, ob, in.res, ob)))
            return false;
        for (int i = 0; i < j; i++) {
            const size_t pb = (size_t)N * (size_t)jobs[i].R * sizeof(float);
            if (ranges_overlap(in.out, ob, jobs[i].out, pb) ||
                ranges_overlap(in.out, ob, jobs[i].res, pb) ||
                ranges_overlap(jobs[i].out, pb, in.res, ob))
                return false;
        }
    }
    return true;
}

cudaError_t kiln_cuda_matmul_multi_norm(cudaStream_t s, int n, const kiln_cuda_product_job *jobs,
                                        kiln_dtype dt, const float *x, const float *norm_w,
                                        float eps, int64_t C, int N) {
    bool pair = false;
    if (!kiln_cuda_dtype_supported(dt) || !product_jobs_ok(n, jobs, x, C, N, &pair) ||
        (uintptr_t)norm_w % 4 || C > INT_MAX)
        return cudaErrorInvalidValue;
    /* plain types are loaded a whole element at a time (deq_blk), the block types byte by byte:
     * rows of f32 / f16 / bf16 at an address or a stride that is not a multiple of the element
     * are not supported (a pair: cudaErrorNotSupported, nothing enqueued, the caller splits it;
     * a file's tensors are aligned) */
    const size_t es = dt == KILN_DTYPE_F32 ? 4 : dt == KILN_DTYPE_F16 || dt == KILN_DTYPE_BF16 ? 2 : 1;
    for (int j = 0; j < n; j++)
        if ((uintptr_t)jobs[j].w % es || (uintptr_t)jobs[j].w_up % es || jobs[j].row_bytes % es)
            return pair ? cudaErrorNotSupported : cudaErrorInvalidValue;
    const prod_jobs a = prod_jobs_of(n, jobs, norm_w, eps);
    const int rpb = pair ? MM_ROWS_PER_BLOCK / 2 : MM_ROWS_PER_BLOCK;
    int64_t total = 0;
    for (int j = 0; j < n; j++) total += (jobs[j].R + rpb - 1) / rpb;
    if (total > 0x7fffffff || (N + 7) / 8 > 65535) return cudaErrorInvalidConfiguration;
    KILN_CUDA_DTYPE_SWITCH(dt, matmul_launch, s, &a, pair, x, C, N);
    return cudaGetLastError();
}

cudaError_t kiln_cuda_matmul_multi(cudaStream_t s, int n, const kiln_cuda_product_job *jobs,
                                   kiln_dtype dt, const float *x, int64_t C, int N) {
    return kiln_cuda_matmul_multi_norm(s, n, jobs, dt, x, NULL, 0.0f, C, N);
}

cudaError_t kiln_cuda_matmul_res(cudaStream_t s, float *out, const float *x, const uint8_t *w,
                                 size_t row_bytes, kiln_dtype dt, int64_t R, int64_t C,
                                 const float *bias, const float *res, int N) {
    if (R <= 0 || N <= 0) return cudaSuccess;
    const kiln_cuda_product_job job = {out, res, w, NULL, bias, NULL, row_bytes, R};
    return kiln_cuda_matmul_multi(s, 1, &job, dt, x, C, N);
}

cudaError_t kiln_cuda_matmul(cudaStream_t s, float *out, const float *x, const uint8_t *w,
                             size_t row_bytes, kiln_dtype dt, int64_t R, int64_t C,
                             const float *bias, int N) {
    return kiln_cuda_matmul_res(s, out, x, w, row_bytes, dt, R, C, bias, NULL, N);
}

/* =================================================================================================
 * Auditable backward.
 * ============================================================================================== */

bool kiln_cuda_backward_dtype_supported(kiln_dtype dt) {
    return dt == KILN_DTYPE_F32 || dt == KILN_DTYPE_BF16 || dt == KILN_DTYPE_F16;
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
        kiln_cuda_col_lanes_launch(s, dbias, dy, NULL, NULL, R, N, R);
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
    return cudaSuccess;
}

/* =================================================================================================
 * Fast: the GEMM module, bf16 operands on the tensor cores through cuBLASLt (contract,
 * arithmetic and what determinism rests on: cuda_matmul.h).
 *
 * ============================================================================================== */

/*
 * Layout. kiln's matrices are row-major; cuBLASLt's are column-major. A row-major (r x c)
 * matrix with leading dimension ld is, read column-major, its transpose (c x r) with the same
 * ld. So the row-major product D(M,N) = A'(M,K) B'(K,N) is the column-major product
 * D^T(N,M) = B'^T(N,K) A'^T(K,M): cuBLASLt's first operand is kiln's B, its second kiln's A,
 * with m = N, n = M, k = K, and each transpose flag carries over to its own operand:
 *   kiln's B stored (K,N)  (B' = B)     = column-major (N x K) = B'^T    -> op N
 *   kiln's B stored (N,K)  (B' = B^T)   = column-major (K x N) = B'      -> op T
 *   kiln's A stored (M,K)  (A' = A)     = column-major (K x M) = A'^T    -> op N
 *   kiln's A stored (K,M)  (A' = A^T)   = column-major (M x K) = A'      -> op T
 * The forward linear out(N,R) = x(N,C) W(R,C)^T is the case A = x, B = W stored (R,C), i.e.
 * cuBLASLt's "TN" product (both operands contiguous along k), D = W x^T of (R x N).
 */

#define GEMM_WORKSPACE_BYTES ((size_t)32 << 20)
#define CONV_THREADS 256
#define GRID_Y_MAX 65535

/* ---- device side: conversions and the bias kernel ----------------------------------------- */


/* The conversions are elementwise (so vectorising cannot change a bit). Thread t of block
 * (bx, by) converts the run of VEC columns starting at c0 = (bx * CONV_THREADS + t) * VEC in
 * rows by, by + gridDim.y, ...: one vector load and store when the run is whole and aligned,
 * else element by element up to the last column. */
#define F32_VEC 4 /* float4 in, 4 bf16 (8 bytes) out */
#define W_VEC 8   /* 8 bf16 (16 bytes) out; divides every block size (32, 256) */

static __device__ __forceinline__ uint32_t pack2(uint16_t lo, uint16_t hi) {
    return (uint32_t)lo | ((uint32_t)hi << 16); /* little-endian: lo at the lower address */
}

/* f32 -> bf16: unlike the grid of the other conversions (a block row per matrix row, idle
 * threads past a narrow row's end), one thread per run of F32_VEC columns of the whole
 * matrix, numbered row-major (i -> row i / runs, run i % runs), so every thread has work
 * whatever the width. */
static __global__ void f32_to_bf16_kernel(uint16_t *__restrict__ dst, int64_t ld_dst,
                                          const float *__restrict__ src, int64_t ld_src,
                                          int64_t rows, int64_t cols) {
    const int64_t runs = (cols + F32_VEC - 1) / F32_VEC;
    const int64_t i = (int64_t)blockIdx.x * CONV_THREADS + threadIdx.x;
    if (i >= rows * runs) return;
    const int64_t r = i / runs, c0 = (i - r * runs) * F32_VEC;
    const float *sp = src + r * ld_src + c0;
    uint16_t *dp = dst + r * ld_dst + c0;
    if (c0 + F32_VEC <= cols && ((uintptr_t)sp & 15u) == 0 && ((uintptr_t)dp & 7u) == 0) {
        const float4 v = *(const float4 *)sp;
        uint2 o;
        o.x = pack2(kiln_bf16_rne(v.x), kiln_bf16_rne(v.y));
        o.y = pack2(kiln_bf16_rne(v.z), kiln_bf16_rne(v.w));
        *(uint2 *)dp = o;
    } else {
        for (int j = 0; j < F32_VEC && c0 + j < cols; j++) dp[j] = kiln_bf16_rne(sp[j]);
    }
}

template <int DT>
static __global__ void weights_to_bf16_kernel(uint16_t *__restrict__ dst, int64_t ld_dst,
                                              const uint8_t *__restrict__ w, size_t row_bytes,
                                              int64_t R, int64_t C) {
    static_assert(blk<DT>::BS == 1 || blk<DT>::BS % W_VEC == 0, "a run must lie in one block");
    const int64_t c0 = ((int64_t)blockIdx.x * CONV_THREADS + threadIdx.x) * W_VEC;
    if (c0 >= C) return;
    for (int64_t r = blockIdx.y; r < R; r += gridDim.y) {
        const uint8_t *row = w + (size_t)r * row_bytes;
        uint16_t *dp = dst + r * ld_dst + c0;
        if (c0 + W_VEC <= C) {
            /* quantized: the run lies in one block (c0 % 8 == 0, BS % 8 == 0), so its header
             * is loaded once for the 8 elements */
            const uint8_t *b = row + (c0 / blk<DT>::BS) * blk<DT>::TS;
            const int e0 = (int)(c0 % blk<DT>::BS);
            uint16_t v[W_VEC];
#pragma unroll
            for (int j = 0; j < W_VEC; j++)
                v[j] = kiln_bf16_rne(deq_blk<DT>(b, e0 + j)); /* plain: b = row + c0*TS, e0 = 0 */
            if (((uintptr_t)dp & 15u) == 0) {
                uint4 o;
                o.x = pack2(v[0], v[1]);
                o.y = pack2(v[2], v[3]);
                o.z = pack2(v[4], v[5]);
                o.w = pack2(v[6], v[7]);
                *(uint4 *)dp = o;
            } else {
#pragma unroll
                for (int j = 0; j < W_VEC; j++) dp[j] = v[j];
            }
        } else { /* the tail of a plain-type row */
            for (int j = 0; j < W_VEC && c0 + j < C; j++)
                dp[j] = kiln_bf16_rne(deq<DT>(row, c0 + j));
        }
    }
}

/* out(rows, cols; ldd) += bias(cols), row by row: the bias path when cuBLASLt's epilogue has
 * no algorithm for a problem (or the tests force it). */
static __global__ void add_bias_kernel(float *__restrict__ out, int64_t ldd,
                                       const float *__restrict__ bias, int64_t rows,
                                       int64_t cols) {
    const int64_t c = (int64_t)blockIdx.x * CONV_THREADS + threadIdx.x;
    if (c >= cols) return;
    const float b = bias[c];
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) out[r * ldd + c] = out[r * ldd + c] + b;
}

/* The grid of the kernels above for a (rows x cols) matrix, vec columns per thread: column
 * runs over x, rows over y (strided past 65535). */
static bool conv_grid(int64_t rows, int64_t cols, int vec, dim3 *grid) {
    const int64_t per_block = (int64_t)CONV_THREADS * vec;
    const int64_t gx = (cols + per_block - 1) / per_block;
    if (rows <= 0 || cols <= 0 || gx > 0x7fffffff) return false;
    *grid = dim3((unsigned)gx, (unsigned)(rows < GRID_Y_MAX ? rows : GRID_Y_MAX), 1);
    return true;
}

cudaError_t kiln_cuda_f32_to_bf16(cudaStream_t s, uint16_t *dst, int64_t ld_dst, const float *src,
                                  int64_t ld_src, int64_t rows, int64_t cols) {
    if (rows <= 0 || cols <= 0) return cudaSuccess;
    if (!dst || !src || ld_dst < cols || ld_src < cols) return cudaErrorInvalidValue;
    const int64_t runs = (cols + F32_VEC - 1) / F32_VEC;
    if (rows > INT64_MAX / runs) return cudaErrorInvalidValue;
    const int64_t blocks = (rows * runs + CONV_THREADS - 1) / CONV_THREADS;
    if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
    f32_to_bf16_kernel<<<(unsigned)blocks, CONV_THREADS, 0, s>>>(dst, ld_dst, src, ld_src, rows,
                                                                 cols);
    return cudaGetLastError();
}

template <int DT>
static void weights_launch(cudaStream_t s, dim3 grid, uint16_t *dst, int64_t ld_dst,
                           const uint8_t *w, size_t row_bytes, int64_t R, int64_t C) {
    weights_to_bf16_kernel<DT><<<grid, CONV_THREADS, 0, s>>>(dst, ld_dst, w, row_bytes, R, C);
}

cudaError_t kiln_cuda_weights_to_bf16(cudaStream_t s, uint16_t *dst, int64_t ld_dst,
                                      const uint8_t *w, size_t row_bytes, kiln_dtype dt,
                                      int64_t R, int64_t C) {
    if (R <= 0 || C <= 0) return cudaSuccess;
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(dt);
    dim3 grid;
    if (!dst || !w || !tr || !kiln_cuda_dtype_supported(dt) || ld_dst < C ||
        C % tr->block_size != 0 ||
        row_bytes < (size_t)(C / tr->block_size) * (size_t)tr->type_size ||
        !conv_grid(R, C, W_VEC, &grid))
        return cudaErrorInvalidValue;
    KILN_CUDA_DTYPE_SWITCH(dt, weights_launch, s, grid, dst, ld_dst, w, row_bytes, R, C);
    return cudaGetLastError();
}

/* ---- the handle ------------------------------------------------------------------------------ */

/* One problem as cuBLASLt sees it (column-major): what the cached algorithm was chosen for. */
typedef struct gemm_key {
    int64_t op_a, op_b;        /* cublasOperation_t of cuBLASLt's A and B */
    int64_t m, n, k;           /* D (m x n) = op(A) (m x k) op(B) (k x n) */
    int64_t lda, ldb, ldd;     /* elements */
    int64_t align_a, align_b, align_d; /* alignment class of the pointers (bytes, <= 16) */
    int64_t align_bias;        /* the bias pointer's class; 0: no bias */
    int64_t bias_kernel;       /* the handle's forced bias-kernel mode (tests) */
    int64_t d_bf16;            /* D (and C) bf16 rather than f32 */
    int64_t align_c;           /* C's class when C is not D (a residual added); 0: C is D */
} gemm_key;

typedef struct gemm_plan {
    gemm_key key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld; /* C and D share ld (C is D, or a residual of D's shape) */
    cublasLtMatmulAlgo_t algo;
    bool epilogue_bias; /* bias added by cuBLASLt's epilogue; false with a bias: by add_bias */
} gemm_plan;

struct kiln_cuda_gemm {
    int device;
    cublasLtHandle_t lt;
    void *workspace;            /* GEMM_WORKSPACE_BYTES, device */
    uint8_t *scratch;           /* bf16 operand copies, device; 256-byte aligned (cudaMalloc) */
    size_t scratch_bytes;
    void **old_scratch;         /* (n_old) outgrown scratch buffers, freed with the handle */
    int n_old, cap_old;
    size_t old_bytes;           /* their bytes */
    gemm_plan **plans;          /* (n_plans) the algorithm cache */
    int n_plans, cap_plans;
    int force_bias_kernel;
    char err[512];
};

static void set_err(kiln_cuda_gemm *g, const char *fmt, ...) KILN_PRINTF(2, 3);
static void set_err(kiln_cuda_gemm *g, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g->err, sizeof g->err, fmt, ap);
    va_end(ap);
}

/* A CUDA result: true on success, else the message "what: <cuda message>". */
static bool cuda_ok(kiln_cuda_gemm *g, cudaError_t e, const char *what) {
    if (e == cudaSuccess) return true;
    set_err(g, "%s: %s", what, cudaGetErrorString(e));
    return false;
}

/* A cuBLASLt status: true on success, else the message "what: CUBLAS_STATUS_...". */
static bool lt_ok(kiln_cuda_gemm *g, cublasStatus_t st, const char *what) {
    if (st == CUBLAS_STATUS_SUCCESS) return true;
    set_err(g, "cuBLASLt %s: %s (%d)", what, cublasLtGetStatusName(st), (int)st);
    return false;
}

cudaError_t kiln_cuda_gemm_create(int device, kiln_cuda_gemm **out) {
    if (!out) return cudaErrorInvalidValue;
    *out = NULL;
    int prev = 0;
    cudaError_t e = cudaGetDevice(&prev);
    if (e == cudaSuccess) e = cudaSetDevice(device);
    if (e != cudaSuccess) {
        kiln_error(KILN_ERR_UNSUPPORTED, "kiln_cuda_gemm_create: device %d: %s", device,
                   cudaGetErrorString(e));
        return e;
    }
    kiln_cuda_gemm *g = (kiln_cuda_gemm *)kiln_calloc(1, sizeof *g);
    if (!g) {
        cudaSetDevice(prev);
        kiln_error(KILN_ERR_NOMEM, "kiln_cuda_gemm_create: out of host memory");
        return cudaErrorMemoryAllocation;
    }
    g->device = device;
    cublasStatus_t st = cublasLtCreate(&g->lt);
    if (st != CUBLAS_STATUS_SUCCESS) {
        kiln_error(KILN_ERR_UNSUPPORTED, "kiln_cuda_gemm_create: cublasLtCreate: %s",
                   cublasLtGetStatusName(st));
        kiln_free(g);
        cudaSetDevice(prev);
        return cudaErrorUnknown;
    }
    e = cudaMalloc(&g->workspace, GEMM_WORKSPACE_BYTES);
    if (e != cudaSuccess) {
        kiln_error(KILN_ERR_NOMEM, "kiln_cuda_gemm_create: workspace of %zu bytes: %s",
                   GEMM_WORKSPACE_BYTES, cudaGetErrorString(e));
        g->workspace = NULL;
        kiln_cuda_gemm_free(g);
        cudaSetDevice(prev);
        return e;
    }
    cudaSetDevice(prev);
    *out = g;
    return cudaSuccess;
}

static void plan_destroy(gemm_plan *p) {
    if (!p) return;
    if (p->la) cublasLtMatrixLayoutDestroy(p->la);
    if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
    if (p->ld) cublasLtMatrixLayoutDestroy(p->ld);
    if (p->desc) cublasLtMatmulDescDestroy(p->desc);
    kiln_free(p);
}

size_t kiln_cuda_gemm_device_bytes(const kiln_cuda_gemm *g) {
    return g ? (g->workspace ? GEMM_WORKSPACE_BYTES : 0) + g->scratch_bytes + g->old_bytes : 0;
}

void kiln_cuda_gemm_free(kiln_cuda_gemm *g) {
    if (!g) return;
    int prev = 0;
    const bool have_prev = cudaGetDevice(&prev) == cudaSuccess;
    cudaSetDevice(g->device);
    /* Nothing enqueued may still read the workspace or scratch. An error here (a sticky fault
     * of earlier work) cannot be reported from a free; the memory is released regardless. */
    cudaDeviceSynchronize();
    for (int i = 0; i < g->n_plans; i++) plan_destroy(g->plans[i]);
    kiln_free(g->plans);
    if (g->lt) cublasLtDestroy(g->lt);
    if (g->workspace) cudaFree(g->workspace);
    if (g->scratch) cudaFree(g->scratch);
    for (int i = 0; i < g->n_old; i++) cudaFree(g->old_scratch[i]);
    kiln_free(g->old_scratch);
    kiln_free(g);
    if (have_prev) cudaSetDevice(prev);
}

const char *kiln_cuda_gemm_error(const kiln_cuda_gemm *g) { return g ? g->err : ""; }

void kiln_cuda_gemm_set_bias_kernel(kiln_cuda_gemm *g, int on) {
    if (g) g->force_bias_kernel = on != 0;
}

int kiln_cuda_gemm_cached(const kiln_cuda_gemm *g) { return g ? g->n_plans : 0; }

/* The handle's device must be current (the scratch and workspace live there). */
static bool device_ok(kiln_cuda_gemm *g) {
    int d = -1;
    if (!cuda_ok(g, cudaGetDevice(&d), "cudaGetDevice")) return false;
    if (d != g->device) {
        set_err(g, "kiln_cuda_gemm: the current device is %d, the handle's is %d", d, g->device);
        return false;
    }
    return true;
}

/* At least nbytes of scratch. Growth (x2 at least) allocates, which a capturing stream would
 * turn into an error or an invalid graph, so it is refused then; the outgrown buffer is kept
 * until kiln_cuda_gemm_free since enqueued work (or a captured graph) may still read it. */
static cudaError_t scratch_reserve(kiln_cuda_gemm *g, cudaStream_t s, size_t nbytes) {
    if (nbytes <= g->scratch_bytes) return cudaSuccess;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    cudaError_t e = cudaStreamIsCapturing(s, &cs);
    if (!cuda_ok(g, e, "scratch: cudaStreamIsCapturing")) return e;
    if (cs != cudaStreamCaptureStatusNone) {
        set_err(g, "scratch: %zu bytes needed (have %zu) while the stream is capturing: run "
                   "this shape once before capturing", nbytes, g->scratch_bytes);
        return cudaErrorStreamCaptureUnsupported;
    }
    size_t want = g->scratch_bytes * 2 > nbytes ? g->scratch_bytes * 2 : nbytes;
    want = (want + ((size_t)1 << 20) - 1) & ~(((size_t)1 << 20) - 1); /* whole MiB */
    if (g->scratch && g->n_old == g->cap_old) {
        int cap = g->cap_old ? 2 * g->cap_old : 8;
        void **p = (void **)kiln_realloc(g->old_scratch, (size_t)cap * sizeof *p);
        if (!p) {
            set_err(g, "scratch: out of host memory");
            return cudaErrorMemoryAllocation;
        }
        g->old_scratch = p;
        g->cap_old = cap;
    }
    void *p = NULL;
    e = cudaMalloc(&p, want);
    if (e != cudaSuccess) {
        set_err(g, "scratch: cudaMalloc of %zu bytes: %s", want, cudaGetErrorString(e));
        return e;
    }
    if (g->scratch) {
        g->old_scratch[g->n_old++] = g->scratch;
        g->old_bytes += g->scratch_bytes;
    }
    g->scratch = (uint8_t *)p;
    g->scratch_bytes = want;
    return cudaSuccess;
}

/* ---- plans: one cached algorithm per problem ------------------------------------------------ */

/* Alignment class of a pointer: its largest power-of-two divisor, capped at 16 bytes (what
 * the tensor-core kernels' vector and TMA loads need). Capping makes every buffer aligned to
 * 16 or more the same class, so the same problem at different (well-aligned) addresses runs
 * the same algorithm and gives the same bits. */
static int64_t align_class(const void *p) {
    const uintptr_t u = (uintptr_t)p;
    if (!p) return 0;
    const uintptr_t low = u & (~u + 1);
    return low >= 16 ? 16 : (int64_t)low;
}

static bool key_equal(const gemm_key *a, const gemm_key *b) {
    return a->op_a == b->op_a && a->op_b == b->op_b && a->m == b->m && a->n == b->n &&
           a->k == b->k && a->lda == b->lda && a->ldb == b->ldb && a->ldd == b->ldd &&
           a->align_a == b->align_a && a->align_b == b->align_b && a->align_d == b->align_d &&
           a->align_bias == b->align_bias && a->bias_kernel == b->bias_kernel &&
           a->d_bf16 == b->d_bf16 && a->align_c == b->align_c;
}

/* KILN_GEMM_LOG=1 (a diagnostic): a line a plan on stderr, each result's workspace and the
 * pick. Session 17 found with it that every candidate of the products cuBLASLt precedes with a
 * memset asks for a 4-byte workspace (presumably the counter it zeroes): no pick avoids them. */
static bool heur_log(void) {
    const char *e = getenv("KILN_GEMM_LOG");
    return e && e[0] == '1' && e[1] == '\0';
}

/* Ask the heuristic (best first) for problem p under preference pref; take the first result
 * that succeeded and fits the workspace (the heuristic's second for every product made the
 * 0.5B training step's profile 125.3 -> 127.4 ms: more memsets and a slower split-K head
 * product; bench/RESULTS.md, 2026-12-02, 9bb4328). false (no message) when there is none; a
 * failing call other than "not supported" sets the message and *failed. */
static bool heuristic_pick(kiln_cuda_gemm *g, gemm_plan *p, cublasLtMatmulPreference_t pref,
                           bool *failed) {
    cublasLtMatmulHeuristicResult_t res[8];
    int n = 0;
    memset(res, 0, sizeof res);
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(g->lt, p->desc, p->la, p->lb, p->ld,
                                                       p->ld, pref, 8, res, &n);
    if (st == CUBLAS_STATUS_NOT_SUPPORTED) return false;
    if (!lt_ok(g, st, "cublasLtMatmulAlgoGetHeuristic")) {
        *failed = true;
        return false;
    }
    int pick = -1;
    for (int i = 0; i < n && i < 8; i++)
        if (res[i].state == CUBLAS_STATUS_SUCCESS && res[i].workspaceSize <= GEMM_WORKSPACE_BYTES) {
            pick = i;
            break;
        }
    if (heur_log()) {
        const gemm_key *k = &p->key;
        fprintf(stderr, "kiln gemm plan: m %lld n %lld k %lld ops %lld/%lld out %s bias %lld; "
                        "workspace of each result (* the pick):",
                (long long)k->m, (long long)k->n, (long long)k->k, (long long)k->op_a,
                (long long)k->op_b, k->d_bf16 ? "bf16" : "f32", (long long)k->align_bias);
        for (int i = 0; i < n && i < 8; i++)
            fprintf(stderr, " %zu%s%s", res[i].workspaceSize, i == pick ? "*" : "",
                    res[i].state == CUBLAS_STATUS_SUCCESS ? "" : "(failed)");
        fprintf(stderr, "\n");
    }
    if (pick < 0) return false;
    p->algo = res[pick].algo;
    return true;
}

#define LT_TRY(call, what)                                                                    \
    do {                                                                                      \
        if (!lt_ok(g, (call), (what))) goto fail;                                             \
    } while (0)

/* Make the plan of key k: descriptors, layouts, and the heuristic's algorithm. Without an
 * algorithm for the bias epilogue it falls back to the plain product + add_bias. */
static cudaError_t plan_create(kiln_cuda_gemm *g, const gemm_key *k, gemm_plan **out) {
    gemm_plan *p = (gemm_plan *)kiln_calloc(1, sizeof *p);
    cublasLtMatmulPreference_t pref = NULL;
    bool failed = false, found = false;
    if (!p) {
        set_err(g, "plan: out of host memory");
        return cudaErrorMemoryAllocation;
    }
    p->key = *k;
    {
        const int32_t op_a = (int32_t)k->op_a, op_b = (int32_t)k->op_b;
        /* layouts describe the operands as stored: op N: (rows x cols) = (m x k) / (k x n);
         * op T: the transposes (k x m) / (n x k). */
        const uint64_t ra = (uint64_t)(op_a == CUBLAS_OP_N ? k->m : k->k);
        const uint64_t ca = (uint64_t)(op_a == CUBLAS_OP_N ? k->k : k->m);
        const uint64_t rb = (uint64_t)(op_b == CUBLAS_OP_N ? k->k : k->n);
        const uint64_t cb = (uint64_t)(op_b == CUBLAS_OP_N ? k->n : k->k);
        LT_TRY(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
               "cublasLtMatmulDescCreate");
        LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a,
                                              sizeof op_a),
               "set TRANSA");
        LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b,
                                              sizeof op_b),
               "set TRANSB");
        LT_TRY(cublasLtMatrixLayoutCreate(&p->la, CUDA_R_16BF, ra, ca, k->lda),
               "cublasLtMatrixLayoutCreate(A)");
        LT_TRY(cublasLtMatrixLayoutCreate(&p->lb, CUDA_R_16BF, rb, cb, k->ldb),
               "cublasLtMatrixLayoutCreate(B)");
        LT_TRY(cublasLtMatrixLayoutCreate(&p->ld, k->d_bf16 ? CUDA_R_16BF : CUDA_R_32F,
                                          (uint64_t)k->m, (uint64_t)k->n, k->ldd),
               "cublasLtMatrixLayoutCreate(D)");

        const uint64_t ws = GEMM_WORKSPACE_BYTES;
        /* Split-K only with a separate, ordered reduction (cuda_matmul.h, "Determinism"). */
        const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE |
                                 CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
        const uint32_t al_a = (uint32_t)k->align_a, al_b = (uint32_t)k->align_b,
                       al_d = (uint32_t)k->align_d,
                       al_c = (uint32_t)(k->align_c ? k->align_c : k->align_d);
        LT_TRY(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
        LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &ws, sizeof ws),
               "set MAX_WORKSPACE_BYTES");
        LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                    &schemes, sizeof schemes),
               "set REDUCTION_SCHEME_MASK");
        LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                    &al_a, sizeof al_a),
               "set MIN_ALIGNMENT_A_BYTES");
        LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                    &al_b, sizeof al_b),
               "set MIN_ALIGNMENT_B_BYTES");
        LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                    &al_c, sizeof al_c),
               "set MIN_ALIGNMENT_C_BYTES");
        LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                    &al_d, sizeof al_d),
               "set MIN_ALIGNMENT_D_BYTES");

        if (k->align_bias && !k->bias_kernel) {
            /* The heuristic reads the bias pointer's value for its alignment (it does not
             * dereference it). Show it a pointer of exactly the key's class, inside our
             * 256-aligned workspace, so the algorithm suits every bias of that class; the
             * real pointer is set at each call. */
            const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
            const void *probe = (const uint8_t *)g->workspace + k->align_bias;
            LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi,
                                                  sizeof epi),
                   "set EPILOGUE");
            LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                  &probe, sizeof probe),
                   "set BIAS_POINTER");
            found = heuristic_pick(g, p, pref, &failed);
            if (failed) goto fail;
            p->epilogue_bias = found;
            if (!found) { /* back to the plain product; add_bias does the bias */
                const cublasLtEpilogue_t plain = CUBLASLT_EPILOGUE_DEFAULT;
                const void *none = NULL;
                LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                      &plain, sizeof plain),
                       "set EPILOGUE");
                LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                      &none, sizeof none),
                       "set BIAS_POINTER");
            }
        }
        if (!found) {
            found = heuristic_pick(g, p, pref, &failed);
            if (failed) goto fail;
        }
        if (!found) {
            /* Should not happen for bf16 x bf16 -> f32; last resort: allow every reduction
             * scheme (still ordered: INPLACE reduces through counters, cuBLASLt.h). */
            const uint32_t all = CUBLASLT_REDUCTION_SCHEME_MASK;
            LT_TRY(cublasLtMatmulPreferenceSetAttribute(
                       pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &all, sizeof all),
                   "set REDUCTION_SCHEME_MASK");
            found = heuristic_pick(g, p, pref, &failed);
            if (failed) goto fail;
        }
        if (!found) {
            set_err(g, "cuBLASLt: no algorithm for bf16 x bf16 -> %s m=%lld n=%lld k=%lld "
                       "ops %d/%d ld %lld/%lld/%lld alignments %lld/%lld/%lld",
                    k->d_bf16 ? "bf16" : "f32", (long long)k->m, (long long)k->n,
                    (long long)k->k, op_a, op_b,
                    (long long)k->lda, (long long)k->ldb, (long long)k->ldd,
                    (long long)k->align_a, (long long)k->align_b, (long long)k->align_d);
            goto fail;
        }
    }
    cublasLtMatmulPreferenceDestroy(pref);
    *out = p;
    return cudaSuccess;
fail:
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    plan_destroy(p);
    return cudaErrorUnknown;
}

/* The cached plan of key k, made now on first use. */
static cudaError_t plan_get(kiln_cuda_gemm *g, const gemm_key *k, gemm_plan **out) {
    for (int i = 0; i < g->n_plans; i++)
        if (key_equal(&g->plans[i]->key, k)) {
            *out = g->plans[i];
            return cudaSuccess;
        }
    if (g->n_plans == g->cap_plans) {
        int cap = g->cap_plans ? 2 * g->cap_plans : 32;
        gemm_plan **pp = (gemm_plan **)kiln_realloc(g->plans, (size_t)cap * sizeof *pp);
        if (!pp) {
            set_err(g, "plan cache: out of host memory");
            return cudaErrorMemoryAllocation;
        }
        g->plans = pp;
        g->cap_plans = cap;
    }
    gemm_plan *p = NULL;
    cudaError_t e = plan_create(g, k, &p);
    if (e != cudaSuccess) return e;
    g->plans[g->n_plans++] = p;
    *out = p;
    return cudaSuccess;
}

/* ---- the product ------------------------------------------------------------------------------ */

/* Where a product's result goes: D (f32, or bf16 when d_bf16: the RNE rounding of the f32
 * result, cuBLASLt's epilogue conversion), and what is added to it in the epilogue: with
 * accumulate, D's old value; else add (NULL: nothing), an f32 matrix of D's shape and leading
 * dimension (D = add + A'B', one f32 rounding of the sum; add may be D). bf16 D takes
 * neither. */
typedef struct gemm_out {
    void *D;
    bool d_bf16;
    const float *add;
    int accumulate;
} gemm_out;

static gemm_out out_f32(float *D, int accumulate) {
    gemm_out o = {D, false, NULL, accumulate};
    return o;
}

/* Row-major D(M,N) (+)= A'(M,K) B'(K,N) (+ bias(N) per row of D) on bf16 operands (layout
 * mapping: the section comment), D and the added matrix as o says. Arguments already checked; M, N,
 * K >= 1. */
static cudaError_t gemm_rowmajor(kiln_cuda_gemm *g, cudaStream_t s, int trans_a, int trans_b,
                                 int64_t M, int64_t N, int64_t K, const uint16_t *A,
                                 int64_t lda, const uint16_t *B, int64_t ldb, gemm_out o,
                                 int64_t ldd, const float *bias) {
    void *D = o.D;
    const void *Cm = o.add && !o.accumulate ? (const void *)o.add : (const void *)D;
    gemm_key k;
    memset(&k, 0, sizeof k);
    k.op_a = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N; /* cuBLASLt's A is kiln's B */
    k.op_b = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N; /* cuBLASLt's B is kiln's A */
    k.m = N;
    k.n = M;
    k.k = K;
    k.lda = ldb;
    k.ldb = lda;
    k.ldd = ldd;
    k.align_a = align_class(B);
    k.align_b = align_class(A);
    k.align_d = align_class(D);
    k.align_bias = align_class(bias);
    k.bias_kernel = bias ? g->force_bias_kernel : 0;
    k.d_bf16 = o.d_bf16;
    k.align_c = Cm != D ? align_class(Cm) : 0;
    gemm_plan *p = NULL;
    cudaError_t e = plan_get(g, &k, &p);
    if (e != cudaSuccess) return e;
    if (p->epilogue_bias &&
        !lt_ok(g, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                 &bias, sizeof bias),
               "set BIAS_POINTER"))
        return cudaErrorUnknown;
    const float alpha = 1.0f, beta = o.accumulate || o.add ? 1.0f : 0.0f;
    /* C: D itself when accumulating (in place), the residual o.add, or (beta = 0, not read)
     * D; C and D share a layout. */
    if (!lt_ok(g, cublasLtMatmul(g->lt, p->desc, &alpha, B, p->la, A, p->lb, &beta, Cm, p->ld, D,
                                 p->ld, &p->algo, g->workspace, GEMM_WORKSPACE_BYTES, s),
               "cublasLtMatmul"))
        return cudaErrorUnknown;
    if (bias && !p->epilogue_bias) { /* f32 D only (a bf16 D takes no bias) */
        float *Df = (float *)D;
        dim3 grid;
        if (!conv_grid(M, N, 1, &grid)) {
            set_err(g, "bias: bad shape %lld x %lld", (long long)M, (long long)N);
            return cudaErrorInvalidValue;
        }
        add_bias_kernel<<<grid, CONV_THREADS, 0, s>>>(Df, ldd, bias, M, N);
        e = cudaGetLastError();
        if (!cuda_ok(g, e, "add_bias launch")) return e;
    }
    return cudaSuccess;
}

/* Bytes of a (rows x ld) bf16 matrix rounded up to 256 (the next region's alignment); false
 * past 2^48 bytes (a caller's bug, not a size anyone allocates). */
static bool region_bytes(int64_t rows, int64_t ld, size_t *out) {
    const int64_t limit = (int64_t)1 << 47; /* elements: 2^48 bytes */
    if (rows < 0 || ld < 0 || (rows > 0 && ld > limit / rows)) return false;
    *out = ((size_t)(rows * ld) * 2u + 255u) & ~(size_t)255u;
    return true;
}

/* Leading dimension of a bf16 copy in scratch: cols rounded up to 8 elements (16 bytes), so
 * every row starts 16-byte aligned (the padding is never read: k stops at cols). */
static int64_t padded_ld(int64_t cols) { return (cols + 7) & ~(int64_t)7; }

/* The checks shared by the two linear entries (x: f32 or bf16, only tested for NULL). */
static cudaError_t linear_check(kiln_cuda_gemm *g, const void *out, const void *x, const uint8_t *w,
                                size_t row_bytes, kiln_dtype dt, int64_t C, int N) {
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(dt);
    if (!out || !x || !w) {
        set_err(g, "linear: NULL %s", !out ? "out" : !x ? "x" : "w");
        return cudaErrorInvalidValue;
    }
    if (C < 1 || N < 1) {
        set_err(g, "linear: C = %lld, N = %d", (long long)C, N);
        return cudaErrorInvalidValue;
    }
    if (!tr || !kiln_cuda_dtype_supported(dt)) {
        set_err(g, "linear: dtype %d not supported", (int)dt);
        return cudaErrorInvalidValue;
    }
    if (C % tr->block_size != 0 ||
        row_bytes < (size_t)(C / tr->block_size) * (size_t)tr->type_size) {
        set_err(g, "linear: %s weight rows of C = %lld in %zu bytes", tr->name, (long long)C,
                row_bytes);
        return cudaErrorInvalidValue;
    }
    if (dt == KILN_DTYPE_BF16 && (row_bytes % 2 != 0 || ((uintptr_t)w & 1u) != 0)) {
        set_err(g, "linear: bf16 weight not 2-byte aligned (row_bytes %zu)", row_bytes);
        return cudaErrorInvalidValue;
    }
    return cudaSuccess;
}

/* Whether a bf16 weight is used in place: rows start 16-byte aligned (the tensor-core
 * kernels' vector loads; contiguous GGUF rows with C % 8 == 0 always are). Otherwise it is
 * copied (exactly: bf16 -> f32 -> bf16 is the identity) into scratch with padded rows, rather
 * than leaving cuBLASLt a layout it may have no fast (or no) algorithm for. */
static bool bf16_in_place(kiln_dtype dt, const uint8_t *w, size_t row_bytes) {
    return dt == KILN_DTYPE_BF16 && ((uintptr_t)w & 15u) == 0 && row_bytes % 16 == 0;
}

/* The linear after x is bf16 at xb (ldx), into out (gemm_out): W converted into scratch at
 * w_off unless it is bf16 used in place. */
static cudaError_t linear_run(kiln_cuda_gemm *g, cudaStream_t s, gemm_out out, const uint16_t *xb,
                              int64_t ldx, const uint8_t *w, size_t row_bytes, kiln_dtype dt,
                              int64_t R, int64_t C, const float *bias, int N, size_t w_off) {
    const uint16_t *wb;
    int64_t ldw;
    if (bf16_in_place(dt, w, row_bytes)) {
        wb = (const uint16_t *)w;
        ldw = (int64_t)(row_bytes / 2);
    } else {
        uint16_t *dst = (uint16_t *)(g->scratch + w_off);
        ldw = padded_ld(C);
        cudaError_t e = kiln_cuda_weights_to_bf16(s, dst, ldw, w, row_bytes, dt, R, C);
        if (!cuda_ok(g, e, "linear: weights_to_bf16")) return e;
        wb = dst;
    }
    return gemm_rowmajor(g, s, 0, 1, N, R, C, xb, ldx, wb, ldw, out, R, bias);
}

cudaError_t kiln_cuda_gemm_linear(kiln_cuda_gemm *g, cudaStream_t s, float *out, const float *x,
                                  const uint8_t *w, size_t row_bytes, kiln_dtype dt, int64_t R,
                                  int64_t C, const float *bias, int N, int accumulate) {
    if (!g) return cudaErrorInvalidValue;
    if (N <= 0 || R <= 0) return cudaSuccess;
    cudaError_t e = linear_check(g, out, x, w, row_bytes, dt, C, N);
    if (e != cudaSuccess) return e;
    if (!device_ok(g)) return cudaErrorInvalidDevice;
    const int64_t ldx = padded_ld(C);
    size_t x_bytes = 0, w_bytes = 0;
    if (!region_bytes(N, ldx, &x_bytes) ||
        (!bf16_in_place(dt, w, row_bytes) && !region_bytes(R, padded_ld(C), &w_bytes))) {
        set_err(g, "linear: shape too large (N %d, R %lld, C %lld)", N, (long long)R,
                (long long)C);
        return cudaErrorInvalidValue;
    }
    e = scratch_reserve(g, s, x_bytes + w_bytes);
    if (e != cudaSuccess) return e;
    uint16_t *xb = (uint16_t *)g->scratch;
    e = kiln_cuda_f32_to_bf16(s, xb, ldx, x, C, N, C);
    if (!cuda_ok(g, e, "linear: f32_to_bf16(x)")) return e;
    return linear_run(g, s, out_f32(out, accumulate), xb, ldx, w, row_bytes, dt, R, C, bias, N,
                      x_bytes);
}

cudaError_t kiln_cuda_gemm_linear_bf16(kiln_cuda_gemm *g, cudaStream_t s, float *out,
                                       const uint16_t *xb, int64_t ldx, const uint8_t *w,
                                       size_t row_bytes, kiln_dtype dt, int64_t R, int64_t C,
                                       const float *bias, int N, int accumulate) {
    if (!g) return cudaErrorInvalidValue;
    if (N <= 0 || R <= 0) return cudaSuccess;
    cudaError_t e = linear_check(g, out, xb, w, row_bytes, dt, C, N);
    if (e != cudaSuccess) return e;
    if (ldx < C) {
        set_err(g, "linear_bf16: ldx %lld < C %lld", (long long)ldx, (long long)C);
        return cudaErrorInvalidValue;
    }
    if (!device_ok(g)) return cudaErrorInvalidDevice;
    size_t w_bytes = 0;
    if (!bf16_in_place(dt, w, row_bytes)) {
        if (!region_bytes(R, padded_ld(C), &w_bytes)) {
            set_err(g, "linear_bf16: shape too large (R %lld, C %lld)", (long long)R,
                    (long long)C);
            return cudaErrorInvalidValue;
        }
        e = scratch_reserve(g, s, w_bytes);
        if (e != cudaSuccess) return e;
    }
    return linear_run(g, s, out_f32(out, accumulate), xb, ldx, w, row_bytes, dt, R, C, bias, N, 0);
}

/* kiln_cuda_gemm_linear_multi (x f32, rounded into the scratch's start) or, with x NULL,
 * kiln_cuda_gemm_linear_multi_bf16 (xb16 bf16 at ldx16, used in place; the W copies start
 * the scratch; out16 / add as it says, NULL for the f32 entry). */
static cudaError_t linear_multi(kiln_cuda_gemm *g, cudaStream_t s, int n, float *const *out,
                                uint16_t *const *out16, const float *const *add,
                                const float *x, const uint16_t *xb16, int64_t ldx16,
                                const uint8_t *const *w, const size_t *row_bytes,
                                const kiln_dtype *dt, const int64_t *R, int64_t C,
                                const float *const *bias, int N) {
    if (!g) return cudaErrorInvalidValue;
    if (n < 1 || n > KILN_GEMM_MULTI_MAX || (!out && !out16) || !w || !row_bytes || !dt || !R) {
        set_err(g, "linear_multi: n = %d or a NULL array", n);
        return cudaErrorInvalidValue;
    }
    gemm_out o[KILN_GEMM_MULTI_MAX];
    for (int i = 0; i < n; i++) {
        uint16_t *o16 = out16 ? out16[i] : NULL;
        const float *ad = add ? add[i] : NULL;
        if (o16 && (ad || (bias && bias[i]))) {
            set_err(g, "linear_multi_bf16: product %d: a bf16 output takes no %s", i,
                    ad ? "residual" : "bias");
            return cudaErrorInvalidValue;
        }
        o[i].D = o16 ? (void *)o16 : (void *)(out ? out[i] : NULL);
        o[i].d_bf16 = o16 != NULL;
        o[i].add = ad;
        o[i].accumulate = 0;
        if (o16 && ((uintptr_t)o16 & 15u) != 0) {
            set_err(g, "linear_multi_bf16: product %d: bf16 output not 16-byte aligned", i);
            return cudaErrorInvalidValue;
        }
    }
    if (N <= 0) return cudaSuccess;
    if (!x && ldx16 < C) {
        set_err(g, "linear_multi_bf16: ldx %lld < C %lld", (long long)ldx16, (long long)C);
        return cudaErrorInvalidValue;
    }
    const int64_t ldx = x ? padded_ld(C) : ldx16;
    size_t x_bytes = 0, w_max = 0;
    for (int i = 0; i < n; i++) { /* every argument checked before anything is enqueued */
        if (R[i] <= 0) continue;
        cudaError_t e = linear_check(g, o[i].D, x ? (const void *)x : (const void *)xb16, w[i],
                                     row_bytes[i], dt[i], C, N);
        if (e != cudaSuccess) return e;
        size_t wb = 0;
        if (!bf16_in_place(dt[i], w[i], row_bytes[i]) && !region_bytes(R[i], padded_ld(C), &wb)) {
            set_err(g, "linear_multi: shape too large (R %lld, C %lld)", (long long)R[i],
                    (long long)C);
            return cudaErrorInvalidValue;
        }
        if (wb > w_max) w_max = wb;
    }
    if (x && !region_bytes(N, ldx, &x_bytes)) {
        set_err(g, "linear_multi: shape too large (N %d, C %lld)", N, (long long)C);
        return cudaErrorInvalidValue;
    }
    if (!device_ok(g)) return cudaErrorInvalidDevice;
    cudaError_t e = x_bytes + w_max ? scratch_reserve(g, s, x_bytes + w_max) : cudaSuccess;
    if (e != cudaSuccess) return e;
    const uint16_t *xb = xb16;
    if (x) {
        uint16_t *dst = (uint16_t *)g->scratch; /* where kiln_cuda_gemm_linear puts it */
        e = kiln_cuda_f32_to_bf16(s, dst, ldx, x, C, N, C);
        if (!cuda_ok(g, e, "linear_multi: f32_to_bf16(x)")) return e;
        xb = dst;
    }
    for (int i = 0; i < n && e == cudaSuccess; i++)
        if (R[i] > 0)
            e = linear_run(g, s, o[i], xb, ldx, w[i], row_bytes[i], dt[i], R[i], C,
                           bias ? bias[i] : NULL, N, x_bytes);
    return e;
}

cudaError_t kiln_cuda_gemm_linear_multi(kiln_cuda_gemm *g, cudaStream_t s, int n,
                                        float *const *out, const float *x,
                                        const uint8_t *const *w, const size_t *row_bytes,
                                        const kiln_dtype *dt, const int64_t *R, int64_t C,
                                        const float *const *bias, int N) {
    if (g && !x && N > 0) {
        set_err(g, "linear_multi: NULL x");
        return cudaErrorInvalidValue;
    }
    return linear_multi(g, s, n, out, NULL, NULL, x, NULL, 0, w, row_bytes, dt, R, C, bias, N);
}

cudaError_t kiln_cuda_gemm_linear_multi_bf16(kiln_cuda_gemm *g, cudaStream_t s, int n,
                                             float *const *out, uint16_t *const *out16,
                                             const float *const *add, const uint16_t *xb,
                                             int64_t ldx,
                                             const uint8_t *const *w, const size_t *row_bytes,
                                             const kiln_dtype *dt, const int64_t *R, int64_t C,
                                             const float *const *bias, int N) {
    if (g && !xb && N > 0) {
        set_err(g, "linear_multi_bf16: NULL x");
        return cudaErrorInvalidValue;
    }
    return linear_multi(g, s, n, out, out16, add, NULL, xb, ldx, w, row_bytes, dt, R, C, bias,
                        N);
}

/* The checks shared by the two general products. */
static cudaError_t gemm_check(kiln_cuda_gemm *g, int trans_a, int trans_b, int64_t M, int64_t N,
                              int64_t K, const void *A, int64_t lda, const void *B, int64_t ldb,
                              const void *D, int64_t ldd) {
    if (!A || !B || !D) {
        set_err(g, "gemm: NULL %s", !A ? "A" : !B ? "B" : "D");
        return cudaErrorInvalidValue;
    }
    if (K < 1) {
        set_err(g, "gemm: K = %lld (must be >= 1)", (long long)K);
        return cudaErrorInvalidValue;
    }
    const int64_t min_lda = trans_a ? M : K, min_ldb = trans_b ? K : N;
    if (lda < min_lda || ldb < min_ldb || ldd < N) {
        set_err(g, "gemm: leading dimensions lda %lld (>= %lld), ldb %lld (>= %lld), ldd %lld "
                   "(>= %lld)",
                (long long)lda, (long long)min_lda, (long long)ldb, (long long)min_ldb,
                (long long)ldd, (long long)N);
        return cudaErrorInvalidValue;
    }
    return cudaSuccess;
}

cudaError_t kiln_cuda_gemm_bf16(kiln_cuda_gemm *g, cudaStream_t s, int trans_a, int trans_b,
                                int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda,
                                const uint16_t *B, int64_t ldb, float *D, int64_t ldd,
                                int accumulate) {
    if (!g) return cudaErrorInvalidValue;
    if (M <= 0 || N <= 0) return cudaSuccess;
    cudaError_t e = gemm_check(g, trans_a, trans_b, M, N, K, A, lda, B, ldb, D, ldd);
    if (e != cudaSuccess) return e;
    if (!device_ok(g)) return cudaErrorInvalidDevice;
    return gemm_rowmajor(g, s, trans_a != 0, trans_b != 0, M, N, K, A, lda, B, ldb,
                         out_f32(D, accumulate), ldd, NULL);
}

cudaError_t kiln_cuda_gemm_bf16_out16(kiln_cuda_gemm *g, cudaStream_t s, int trans_a,
                                      int trans_b, int64_t M, int64_t N, int64_t K,
                                      const uint16_t *A, int64_t lda, const uint16_t *B,
                                      int64_t ldb, uint16_t *D, int64_t ldd) {
    if (!g) return cudaErrorInvalidValue;
    if (M <= 0 || N <= 0) return cudaSuccess;
    cudaError_t e = gemm_check(g, trans_a, trans_b, M, N, K, A, lda, B, ldb, D, ldd);
    if (e != cudaSuccess) return e;
    if (!device_ok(g)) return cudaErrorInvalidDevice;
    gemm_out o = {D, true, NULL, 0};
    return gemm_rowmajor(g, s, trans_a != 0, trans_b != 0, M, N, K, A, lda, B, ldb, o, ldd, NULL);
}

cudaError_t kiln_cuda_gemm_f32(kiln_cuda_gemm *g, cudaStream_t s, int trans_a, int trans_b,
                               int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                               const float *B, int64_t ldb, float *D, int64_t ldd, int accumulate) {
    if (!g) return cudaErrorInvalidValue;
    if (M <= 0 || N <= 0) return cudaSuccess;
    cudaError_t e = gemm_check(g, trans_a, trans_b, M, N, K, A, lda, B, ldb, D, ldd);
    if (e != cudaSuccess) return e;
    if (!device_ok(g)) return cudaErrorInvalidDevice;
    /* The operands as stored: A (a_rows x a_cols), B (b_rows x b_cols). */
    const int64_t a_rows = trans_a ? K : M, a_cols = trans_a ? M : K;
    const int64_t b_rows = trans_b ? N : K, b_cols = trans_b ? K : N;
    const int64_t lda2 = padded_ld(a_cols), ldb2 = padded_ld(b_cols);
    size_t a_bytes = 0, b_bytes = 0;
    if (!region_bytes(a_rows, lda2, &a_bytes) || !region_bytes(b_rows, ldb2, &b_bytes)) {
        set_err(g, "gemm_f32: shape too large (M %lld, N %lld, K %lld)", (long long)M,
                (long long)N, (long long)K);
        return cudaErrorInvalidValue;
    }
    e = scratch_reserve(g, s, a_bytes + b_bytes);
    if (e != cudaSuccess) return e;
    uint16_t *ab = (uint16_t *)g->scratch, *bb = (uint16_t *)(g->scratch + a_bytes);
    e = kiln_cuda_f32_to_bf16(s, ab, lda2, A, lda, a_rows, a_cols);
    if (!cuda_ok(g, e, "gemm_f32: f32_to_bf16(A)")) return e;
    e = kiln_cuda_f32_to_bf16(s, bb, ldb2, B, ldb, b_rows, b_cols);
    if (!cuda_ok(g, e, "gemm_f32: f32_to_bf16(B)")) return e;
    return gemm_rowmajor(g, s, trans_a != 0, trans_b != 0, M, N, K, ab, lda2, bb, ldb2,
                         out_f32(D, accumulate), ldd, NULL);
}

/* =================================================================================================
 * Fast: the decode matrix-vector kernels: out(N,R) = x(N,C) @ W(R,C)^T on the raw weight
 * bytes, N <= 8.
 * ============================================================================================== */

/*
 * Layout of the work. A row is cut into "chunks": 16 bytes of an f32/f16/bf16 row (4 or 8
 * elements), or a fixed piece of a quantized block with 16 of its elements (2 chunks per
 * 32-element block, 16 per 256-element K-quant block). A thread owns whole chunks, so each
 * of its loads is a few aligned words of one block, and dequantizes them in registers.
 * S warps (S = 1, 2, 4 or 8, chosen from (dt, R, C, N) only) share a "row group" of ROWS
 * rows: thread u = k*32 + lane of the group walks chunks u, u + 32S, u + 64S, ... of every
 * row in the group (the same chunk of ROWS rows at once, so one read of x serves ROWS rows
 * and all tokens), loading UNR chunks ahead before using them. Then a fixed xor-shuffle tree
 * per warp (16, 8, 4, 2, 1), and one thread per output adds the S warp sums in warp order
 * through shared memory, then the bias, then (accumulate) the old output.
 *
 * Determinism: a thread's FMA chain runs over its chunks in increasing order and over a
 * chunk's elements in a fixed order; the trees and the combine are fixed; S depends only on
 * (dt, R, C, N). ROWS, UNR, the token tile and the load path (16-byte vector loads or the
 * byte-load path for misaligned data) never change which products a thread sums or in which
 * order, so every path gives the same bits.
 *
 * Dequantization: the CPU's values exactly (tensor.c / cuda_common.cuh deq_blk), computed
 * per chunk from its block's header: an integer quant q becomes the exact f32 (q - off) by
 * the exponent trick (0x4B000000 | q is the float 2^23 + q, minus 2^23 + off is exact), then
 * the same roundings as the CPU with __fmul_rn / __fadd_rn / __fsub_rn (never contracted).
 * f16 uses the hardware conversion, exact for every non-NaN f16 (a NaN weight makes the
 * output NaN either way; only its payload could differ from the CPU's widening).
 */

#define FMV_THREADS 256
#define FMV_WARPS (FMV_THREADS / 32)
/* A split of C over more warps than this per row is never chosen. */
#define FMV_MAX_SPLIT 8
/* The split grows (doubling) while the grid has fewer warps than this and each lane of the
 * wider split still gets a chunk: enough warps in flight to cover DRAM latency on an H100 /
 * H200 class GPU. A constant, not the device's SM count, so the order is device-independent. */
#define FMV_TARGET_WARPS 4096

/* ---- per-dtype chunk geometry ------------------------------------------------------------- */

template <int DT> struct fmv {
    static constexpr bool plain = blk<DT>::BS == 1;
    /* elements per chunk, and per run (a run: consecutive elements of x) */
    static constexpr int EPC = DT == KILN_DTYPE_F32 ? 4 : plain ? 8 : 16;
    static constexpr int RL = plain || DT == KILN_DTYPE_Q8_0 ? EPC : 8;
    /* the walk's block: plain types one chunk (16 bytes), quantized types the GGUF block */
    static constexpr int BSZ = plain ? EPC : blk<DT>::BS;
    static constexpr int TSZ = plain ? 16 : blk<DT>::TS;
    static constexpr int CPB = BSZ / EPC;
    /* 32-bit words of raw bytes a chunk keeps in registers */
    static constexpr int RAW = plain ? 4
                               : DT == KILN_DTYPE_Q8_0 ? 5
                               : DT == KILN_DTYPE_Q4_0 || DT == KILN_DTYPE_Q4_1 ? 3
                               : DT == KILN_DTYPE_Q5_0 || DT == KILN_DTYPE_Q5_1 ? 4
                               : DT == KILN_DTYPE_Q4_K ? 6
                               : DT == KILN_DTYPE_Q5_K ? 8
                                                       : 6;
    /* alignment of every walk block on the fast path (w and row_bytes multiples of it): the
     * largest power of two, at most 16, dividing TSZ */
    static constexpr int ALIGN = TSZ % 16 == 0 ? 16 : TSZ % 8 == 0 ? 8 : TSZ % 4 == 0 ? 4 : 2;
    static_assert(EPC % RL == 0 && RL % 4 == 0 && BSZ % EPC == 0, "chunk geometry");
    static_assert(CPB == 1 || CPB == 2 || CPB == 16, "chunks per block divide a warp");
};

/* Rows per row group and chunks loaded ahead, per dtype class and token tile NT. More rows
 * per group read x (from L1) fewer times per weight byte; more chunks ahead keep more bytes
 * in flight per thread (a SwiGLU pair walks twice the rows, so half the chunks ahead). Neither
 * changes the summation order. */
static __host__ __device__ constexpr int fmv_rows(bool plain, int NT) { return plain && NT == 1 ? 2 : 4; }
static __host__ __device__ constexpr int fmv_unroll(bool plain, int NT, bool pair) {
    return pair ? (NT == 1 && plain ? 2 : 1) : NT == 1 ? (plain ? 4 : 2) : NT == 2 ? 2 : 1;
}
/* The token tile of the fast path for N tokens. */
static int fmv_tile(int N) { return N == 1 ? 1 : N == 2 ? 2 : N <= 4 ? 4 : 8; }

/* ---- loads ------------------------------------------------------------------------------ */

static __host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }

/* NW little-endian 32-bit words from p, which is A-byte aligned (A = 1: any address). The
 * weights stream through once per call: evict-first loads (.cs) keep x in the caches. */
template <int A, int NW>
static __device__ __forceinline__ void ldw(const uint8_t *__restrict__ p, uint32_t *o) {
    if constexpr (A >= 16 && NW % 4 == 0) {
#pragma unroll
        for (int i = 0; i < NW / 4; i++) {
            uint4 v = __ldcs((const uint4 *)p + i);
            o[4 * i] = v.x, o[4 * i + 1] = v.y, o[4 * i + 2] = v.z, o[4 * i + 3] = v.w;
        }
    } else if constexpr (A >= 8 && NW % 2 == 0) {
#pragma unroll
        for (int i = 0; i < NW / 2; i++) {
            uint2 v = __ldcs((const uint2 *)p + i);
            o[2 * i] = v.x, o[2 * i + 1] = v.y;
        }
    } else if constexpr (A >= 4) {
#pragma unroll
        for (int i = 0; i < NW; i++) o[i] = __ldcs((const unsigned int *)p + i);
    } else if constexpr (A >= 2) {
#pragma unroll
        for (int i = 0; i < NW; i++)
            o[i] = (uint32_t)__ldcs((const unsigned short *)p + 2 * i) |
                   ((uint32_t)__ldcs((const unsigned short *)p + 2 * i + 1) << 16);
    } else {
#pragma unroll
        for (int i = 0; i < NW; i++)
            o[i] = (uint32_t)__ldcs(p + 4 * i) | ((uint32_t)__ldcs(p + 4 * i + 1) << 8) |
                   ((uint32_t)__ldcs(p + 4 * i + 2) << 16) |
                   ((uint32_t)__ldcs(p + 4 * i + 3) << 24);
    }
}

/* A little-endian 16-bit value at p (A-byte aligned). */
template <int A> static __device__ __forceinline__ uint32_t ld16(const uint8_t *__restrict__ p) {
    if constexpr (A >= 2) return (uint32_t)__ldcs((const unsigned short *)p);
    else return (uint32_t)__ldcs(p) | ((uint32_t)__ldcs(p + 1) << 8);
}

/* Chunk ci of the walk block at b into raw (A: the block's alignment, 1 on the slow path). */
template <int DT, int A>
static __device__ __forceinline__ void fmv_load(uint32_t *raw, const uint8_t *__restrict__ b,
                                                int ci) {
    if constexpr (fmv<DT>::plain) {
        ldw<A, 4>(b, raw);
    } else if constexpr (DT == KILN_DTYPE_Q8_0) { /* d | qs[32] */
        ldw<cmin(A, 2), 4>(b + 2 + 16 * ci, raw);
        raw[4] = ld16<A>(b);
    } else if constexpr (DT == KILN_DTYPE_Q4_0) { /* d | qs[16] */
        ldw<cmin(A, 2), 2>(b + 2 + 8 * ci, raw);
        raw[2] = ld16<A>(b);
    } else if constexpr (DT == KILN_DTYPE_Q4_1) { /* d m | qs[16] */
        ldw<cmin(A, 4), 2>(b + 4 + 8 * ci, raw);
        ldw<cmin(A, 4), 1>(b, raw + 2);
    } else if constexpr (DT == KILN_DTYPE_Q5_0) { /* d | qh[4] | qs[16] */
        ldw<cmin(A, 2), 2>(b + 6 + 8 * ci, raw);
        ldw<cmin(A, 2), 1>(b + 2, raw + 2);
        raw[3] = ld16<A>(b);
    } else if constexpr (DT == KILN_DTYPE_Q5_1) { /* d m | qh[4] | qs[16] */
        ldw<cmin(A, 8), 2>(b + 8 + 8 * ci, raw);
        ldw<cmin(A, 4), 1>(b + 4, raw + 2);
        ldw<cmin(A, 4), 1>(b, raw + 3);
    } else if constexpr (DT == KILN_DTYPE_Q4_K) { /* d dmin scales[12] | qs[128] */
        ldw<cmin(A, 16), 4>(b, raw);
        ldw<cmin(A, 8), 2>(b + 16 + (ci >> 2) * 32 + (ci & 3) * 8, raw + 4);
    } else if constexpr (DT == KILN_DTYPE_Q5_K) { /* d dmin scales[12] | qh[32] | qs[128] */
        ldw<cmin(A, 16), 4>(b, raw);
        ldw<cmin(A, 8), 2>(b + 16 + (ci & 3) * 8, raw + 4);
        ldw<cmin(A, 8), 2>(b + 48 + (ci >> 2) * 32 + (ci & 3) * 8, raw + 6);
    } else { /* Q6_K: ql[128] | qh[64] | scales[16] (int8) | d */
        const int h = ci >> 3, gp = (ci >> 2) & 1, l0 = (ci & 3) * 8;
        ldw<cmin(A, 8), 2>(b + h * 64 + gp * 32 + l0, raw);
        ldw<cmin(A, 8), 2>(b + 128 + h * 32 + l0, raw + 2);
        raw[4] = ld16<cmin(A, 2)>(b + 208);
        const uint8_t *sc = b + 192 + h * 8 + gp * 2 + (l0 >= 16);
        raw[5] = (uint32_t)__ldcs(sc) | ((uint32_t)__ldcs(sc + 4) << 8);
    }
}

/* ---- dequantization of a chunk ----------------------------------------------------------- */

/* Byte k of v (a value 0..255) as the float 2^23 + v. */
static __device__ __forceinline__ float mag(uint32_t v, int k) {
    return __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7440u + (unsigned)k));
}
#define MAG0 8388608.0f /* 2^23 */

/* Bits 0..3 of b to bit 4 of bytes 0..3 (the fifth bit of four q5 quants): the multiply
 * copies b to bit offsets 0, 7, 14, 21, which do not overlap, so bit k lands on bit 8k. */
static __device__ __forceinline__ uint32_t hb4(uint32_t b) {
    return (((b & 0xfu) * 0x00204081u) & 0x01010101u) << 4;
}

/* The 6-bit scale and min of group g (0..7) of a q4_k / q5_k block whose 12 scale bytes are
 * the words s1, s2, s3 (k_scale_min of cuda_common.cuh, on registers). */
static __device__ __forceinline__ void k_scale_min_w(uint32_t s1, uint32_t s2, uint32_t s3,
                                                     int g, uint32_t *sc, uint32_t *mn) {
    const int sh = 8 * (g & 3);
    const uint32_t b1 = (s1 >> sh) & 0xffu, b2 = (s2 >> sh) & 0xffu, b3 = (s3 >> sh) & 0xffu;
    if (g < 4) {
        *sc = b1 & 0x3fu;
        *mn = b2 & 0x3fu;
    } else {
        *sc = (b3 & 0x0fu) | ((b1 >> 2) & 0x30u);
        *mn = (b3 >> 4) | ((b2 >> 2) & 0x30u);
    }
}

/* The EPC weights of chunk ci from raw, run after run (fmv_run_off gives a run's columns). */
template <int DT>
static __device__ __forceinline__ void fmv_deq(const uint32_t *raw, int ci, float *wv) {
    if constexpr (DT == KILN_DTYPE_F32) {
#pragma unroll
        for (int i = 0; i < 4; i++) wv[i] = __uint_as_float(raw[i]);
    } else if constexpr (DT == KILN_DTYPE_BF16) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            wv[2 * i] = __uint_as_float(raw[i] << 16);
            wv[2 * i + 1] = __uint_as_float(raw[i] & 0xffff0000u);
        }
    } else if constexpr (DT == KILN_DTYPE_F16) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            wv[2 * i] = __half2float(__ushort_as_half((unsigned short)(raw[i] & 0xffffu)));
            wv[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(raw[i] >> 16)));
        }
    } else if constexpr (DT == KILN_DTYPE_Q8_0) { /* (float)q * d */
        const float d = fp16_f32(raw[4]);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t u = raw[i] ^ 0x80808080u; /* int8 q -> q + 128 */
#pragma unroll
            for (int k = 0; k < 4; k++)
                wv[4 * i + k] = __fmul_rn(__fsub_rn(mag(u, k), MAG0 + 128.0f), d);
        }
    } else if constexpr (DT == KILN_DTYPE_Q4_0 || DT == KILN_DTYPE_Q4_1 ||
                         DT == KILN_DTYPE_Q5_0 || DT == KILN_DTYPE_Q5_1) {
        constexpr bool has_m = DT == KILN_DTYPE_Q4_1 || DT == KILN_DTYPE_Q5_1;
        constexpr bool five = DT == KILN_DTYPE_Q5_0 || DT == KILN_DTYPE_Q5_1;
        /* the offset subtracted from q: q4_0 8, q5_0 16, with a min 0 */
        constexpr float off = MAG0 + (has_m ? 0.0f : five ? 16.0f : 8.0f);
        const uint32_t hdr = five ? raw[3] : raw[2];
        const float d = fp16_f32(hdr & 0xffffu);
        const float m = has_m ? fp16_f32(hdr >> 16) : 0.0f;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            uint32_t lo = raw[i] & 0x0f0f0f0fu, hi = (raw[i] >> 4) & 0x0f0f0f0fu;
            if (five) { /* element e's fifth bit is bit e of qh */
                const int e0 = 8 * ci + 4 * i;
                lo |= hb4(raw[2] >> e0);
                hi |= hb4(raw[2] >> (e0 + 16));
            }
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float a = __fsub_rn(mag(lo, k), off), c = __fsub_rn(mag(hi, k), off);
                if (has_m) { /* d * q + m */
                    wv[4 * i + k] = __fadd_rn(__fmul_rn(d, a), m);
                    wv[8 + 4 * i + k] = __fadd_rn(__fmul_rn(d, c), m);
                } else { /* d * (q - off) */
                    wv[4 * i + k] = __fmul_rn(d, a);
                    wv[8 + 4 * i + k] = __fmul_rn(d, c);
                }
            }
        }
    } else if constexpr (DT == KILN_DTYPE_Q4_K || DT == KILN_DTYPE_Q5_K) {
        /* groups g0 = 2p (low nibbles) and g1 = 2p + 1 (high nibbles): dg * q - mg */
        const float d = fp16_f32(raw[0] & 0xffffu), dmin = fp16_f32(raw[0] >> 16);
        const int g0 = 2 * (ci >> 2);
        uint32_t sc0, mn0, sc1, mn1;
        k_scale_min_w(raw[1], raw[2], raw[3], g0, &sc0, &mn0);
        k_scale_min_w(raw[1], raw[2], raw[3], g0 + 1, &sc1, &mn1);
        const float dg0 = __fmul_rn(d, (float)sc0), mg0 = __fmul_rn(dmin, (float)mn0);
        const float dg1 = __fmul_rn(d, (float)sc1), mg1 = __fmul_rn(dmin, (float)mn1);
        constexpr int Q = DT == KILN_DTYPE_Q4_K ? 4 : 6;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            uint32_t lo = raw[Q + i] & 0x0f0f0f0fu, hi = (raw[Q + i] >> 4) & 0x0f0f0f0fu;
            if (DT == KILN_DTYPE_Q5_K) { /* fifth bit: bit g of qh[l] */
                lo |= ((raw[4 + i] >> g0) & 0x01010101u) << 4;
                hi |= ((raw[4 + i] >> (g0 + 1)) & 0x01010101u) << 4;
            }
#pragma unroll
            for (int k = 0; k < 4; k++) {
                wv[4 * i + k] = __fsub_rn(__fmul_rn(dg0, __fsub_rn(mag(lo, k), MAG0)), mg0);
                wv[8 + 4 * i + k] = __fsub_rn(__fmul_rn(dg1, __fsub_rn(mag(hi, k), MAG0)), mg1);
            }
        }
    } else { /* Q6_K: groups g0 = gp (low nibbles), g1 = gp + 2 (high): (d * sc) * (q - 32) */
        const int gp = (ci >> 2) & 1;
        const float d = fp16_f32(raw[4]);
        const float dd0 = __fmul_rn(d, (float)(int8_t)(raw[5] & 0xffu));
        const float dd1 = __fmul_rn(d, (float)(int8_t)((raw[5] >> 8) & 0xffu));
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const uint32_t lo = (raw[i] & 0x0f0f0f0fu) | (((raw[2 + i] >> (2 * gp)) & 0x03030303u) << 4);
            const uint32_t hi =
                ((raw[i] >> 4) & 0x0f0f0f0fu) | (((raw[2 + i] >> (2 * gp + 4)) & 0x03030303u) << 4);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                wv[4 * i + k] = __fmul_rn(dd0, __fsub_rn(mag(lo, k), MAG0 + 32.0f));
                wv[8 + 4 * i + k] = __fmul_rn(dd1, __fsub_rn(mag(hi, k), MAG0 + 32.0f));
            }
        }
    }
}

/* The first column (within the walk block) of run j of chunk ci. */
template <int DT> static __device__ __forceinline__ int fmv_run_off(int ci, int j) {
    if constexpr (fmv<DT>::plain) return 0;
    else if constexpr (DT == KILN_DTYPE_Q8_0) return 16 * ci;
    else if constexpr (fmv<DT>::CPB == 2) return 8 * ci + 16 * j;
    else if constexpr (DT == KILN_DTYPE_Q6_K)
        return (ci >> 3) * 128 + ((ci >> 2) & 1) * 32 + (ci & 3) * 8 + 64 * j;
    else return (ci >> 2) * 64 + (ci & 3) * 8 + 32 * j; /* Q4_K, Q5_K */
}

/* Element e of a plain-type row (the tail after the last whole chunk). */
template <int DT, bool FAST>
static __device__ __forceinline__ float fmv_plain_elem(const uint8_t *__restrict__ row,
                                                       int64_t e) {
    if constexpr (DT == KILN_DTYPE_F32) {
        uint32_t v;
        ldw<FAST ? 4 : 1, 1>(row + 4 * e, &v);
        return __uint_as_float(v);
    } else {
        const uint32_t h = ld16<FAST ? 2 : 1>(row + 2 * e);
        return DT == KILN_DTYPE_BF16 ? __uint_as_float(h << 16)
                                     : __half2float(__ushort_as_half((unsigned short)h));
    }
}

/* Four x values from p (16-byte aligned on the fast path). */
template <bool FAST>
static __device__ __forceinline__ void ldx4(const float *__restrict__ p, float *v) {
    if constexpr (FAST) {
        const float4 f = __ldg((const float4 *)p);
        v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
#pragma unroll
        for (int i = 0; i < 4; i++) v[i] = __ldg(p + i);
    }
}

/* ---- the kernel ---------------------------------------------------------------------------- */


/* Grid: x = the jobs' row blocks one after another (job j from job[j].blk0), each block
 * (FMV_WARPS / S) row groups of ROWS rows. NT: token tile (N <= NT; tokens t >= N are
 * skipped). FAST: every w, row_bytes a multiple of fmv<DT>::ALIGN, x 16-byte aligned and
 * C % 4 == 0 (vector loads); else byte loads and scalar x loads, same order. PAIR (FAST
 * only): a group walks its ROWS gate rows and the same ROWS up rows (w_up) side by side, and
 * its outputs are swiglu(gate, up); each row's own sum is what it is alone. */
template <int DT, int NT, bool FAST, bool PAIR, bool NORM>
static __global__ void __launch_bounds__(FMV_THREADS)
matvec_fast_kernel(const __grid_constant__ prod_jobs jobs, const float *__restrict__ x, int64_t C,
                   int N) {
    using T = fmv<DT>;
    constexpr int ROWS = fmv_rows(T::plain, NT), UNR = fmv_unroll(T::plain, NT, PAIR);
    constexpr int RW = PAIR ? 2 * ROWS : ROWS; /* weight rows a group walks */
    constexpr int A = FAST ? T::ALIGN : 1;
    static_assert(RW * NT <= 64, "one warp's sums fit a row of red");
    __shared__ float red[FMV_WARPS][RW * NT];
    __shared__ float sr[NORM ? NT : 1];
    pdl_wait(); /* launched by launch_pdl (cuda_common.cuh): x is the kernel before's */
    pdl_launch_dependents();
    /* block types: the first step's weight loads go out before the norm prologue, so that
     * their trip to memory overlaps the prologue's (Q8_0 / Q4_K decode of the 0.5B shape
     * +4-5%, H100). The plain types lost 5% with it and take the prologue first. */
    constexpr bool EARLY = !T::plain;
    if constexpr (NORM && !EARLY) norm_prologue(sr, x, C, 0, N, jobs.eps);

    int jb = 0;
    while (jb + 1 < jobs.n && blockIdx.x >= jobs.job[jb + 1].blk0) jb++;
    const prod_job &J = jobs.job[jb];
    const int64_t R = J.R;
    const int S = J.S;
    const unsigned bx = blockIdx.x - J.blk0;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int G = FMV_WARPS / S; /* row groups per block */
    const int grp = warp / S, k = warp - grp * S;
    const int64_t r0 = ((int64_t)bx * G + grp) * ROWS;
    const uint8_t *rowp[RW];
#pragma unroll
    for (int i = 0; i < ROWS; i++) { /* rows past R reload row R - 1; their sums are dropped */
        const size_t off = (size_t)(r0 + i < R ? r0 + i : R - 1) * J.row_bytes;
        rowp[i] = J.w + off;
        if constexpr (PAIR) rowp[ROWS + i] = J.w_up + off;
    }

    float acc[RW][NT];
#pragma unroll
    for (int i = 0; i < RW; i++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[i][t] = 0.0f;

    const int64_t nblk = C / T::BSZ, nch = nblk * T::CPB;
    const int stride = S * 32;
    /* a step: its UNR chunks of every row, loaded, then their products */
    auto load_step = [&](uint32_t (&raw)[UNR][RW][T::RAW], int64_t c0) {
#pragma unroll
        for (int u = 0; u < UNR; u++) {
            const int64_t c = c0 + (int64_t)u * stride;
            if (c < nch) {
#pragma unroll
                for (int i = 0; i < RW; i++)
                    fmv_load<DT, A>(raw[u][i], rowp[i] + (size_t)(c / T::CPB) * T::TSZ,
                                    (int)(c % T::CPB));
            }
        }
    };
    auto use_step = [&](uint32_t (&raw)[UNR][RW][T::RAW], int64_t c0) {
#pragma unroll
        for (int u = 0; u < UNR; u++) {
            const int64_t c = c0 + (int64_t)u * stride;
            if (c >= nch) break; /* chunks only grow with u */
            const int ci = (int)(c % T::CPB);
            const int64_t col0 = (c / T::CPB) * T::BSZ;
            float wv[RW][T::EPC];
#pragma unroll
            for (int i = 0; i < RW; i++) fmv_deq<DT>(raw[u][i], ci, wv[i]);
#pragma unroll
            for (int j = 0; j < T::EPC / T::RL; j++) {
                const int64_t col = col0 + fmv_run_off<DT>(ci, j);
#pragma unroll
                for (int q = 0; q < T::RL / 4; q++) {
#pragma unroll
                    for (int t = 0; t < NT; t++) {
                        if (t < N) {
                            float xv[4];
                            ldx4<FAST>(x + (int64_t)t * C + col + 4 * q, xv);
                            if constexpr (NORM) {
                                float nv[4];
                                ldx4<FAST>(jobs.norm_w + col + 4 * q, nv);
#pragma unroll
                                for (int e = 0; e < 4; e++) xv[e] = normed(xv[e], sr[t], nv[e]);
                            }
#pragma unroll
                            for (int i = 0; i < RW; i++)
#pragma unroll
                                for (int e = 0; e < 4; e++)
                                    acc[i][t] = __fmaf_rn(xv[e], wv[i][j * T::RL + 4 * q + e],
                                                          acc[i][t]);
                        }
                    }
                }
            }
        }
    };
    const int64_t c_first = k * 32 + lane;
    if constexpr (EARLY) {
        uint32_t raw[UNR][RW][T::RAW];
        load_step(raw, c_first);
        if constexpr (NORM) norm_prologue(sr, x, C, 0, N, jobs.eps);
        for (int64_t c0 = c_first; c0 < nch; c0 += (int64_t)UNR * stride) {
            if (c0 != c_first) load_step(raw, c0);
            use_step(raw, c0);
        }
    } else {
        for (int64_t c0 = c_first; c0 < nch; c0 += (int64_t)UNR * stride) {
            uint32_t raw[UNR][RW][T::RAW];
            load_step(raw, c0);
            use_step(raw, c0);
        }
    }
    if constexpr (T::plain) { /* the C % EPC elements after the last whole chunk */
        const int64_t e = nch * T::EPC + k * 32 + lane;
        if (e < C) {
#pragma unroll
            for (int i = 0; i < RW; i++) {
                const float wl = fmv_plain_elem<DT, FAST>(rowp[i], e);
#pragma unroll
                for (int t = 0; t < NT; t++)
                    if (t < N) {
                        float xv = __ldg(x + (int64_t)t * C + e);
                        if constexpr (NORM) xv = normed(xv, sr[t], __ldg(jobs.norm_w + e));
                        acc[i][t] = __fmaf_rn(xv, wl, acc[i][t]);
                    }
            }
        }
    }

    /* fixed tree per warp: xor partners give every lane the same bits */
#pragma unroll
    for (int i = 0; i < RW; i++)
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float v = acc[i][t];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v = v + __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) red[warp][i * NT + t] = v;
        }
    __syncthreads();
    /* one thread per (group, row, token): the S warp sums in warp order, then the bias, then
     * (PAIR) swiglu of the gate's and the up's sums, then the residual */
    const int o = threadIdx.x;
    if (o < G * ROWS * NT) {
        const int g = o / (ROWS * NT), j = o - g * (ROWS * NT), i = j / NT, t = j - i * NT;
        const int64_t r = ((int64_t)bx * G + g) * ROWS + i;
        if (r < R && t < N) {
            float s = red[g * S][j];
            for (int kk = 1; kk < S; kk++) s = s + red[g * S + kk][j];
            if (J.bias) s = s + J.bias[r];
            if constexpr (PAIR) {
                float u = red[g * S][ROWS * NT + j];
                for (int kk = 1; kk < S; kk++) u = u + red[g * S + kk][ROWS * NT + j];
                if (J.bias_up) u = u + J.bias_up[r];
                s = kiln_swiglu(s, u);
            }
            const int64_t at = (int64_t)t * R + r;
            if (J.res) s = s + J.res[at];
            J.out[at] = s;
        }
    }
}

/* ---- launcher ------------------------------------------------------------------------------ */

/* The split S for dtype DT (see FMV_TARGET_WARPS): a function of (DT, R, C, N) only. */
template <int DT> static int fmv_split(int64_t R, int64_t C, int N) {
    using T = fmv<DT>;
    const int64_t nch = C / T::BSZ * T::CPB;
    const int64_t rows = fmv_rows(T::plain, fmv_tile(N));
    const int64_t groups = (R + rows - 1) / rows;
    int S = 1;
    while (S < FMV_MAX_SPLIT && groups * S < FMV_TARGET_WARPS && (int64_t)64 * S <= nch) S *= 2;
    return S;
}

/* Each job's split and first block for token tile NT, and the grid; false past 2^31 - 1
 * blocks. */
template <int DT, int NT> static bool fmv_plan(prod_jobs *a, unsigned *grid, int64_t C, int N) {
    constexpr int rows = fmv_rows(fmv<DT>::plain, NT);
    int64_t total = 0;
    for (int j = 0; j < a->n; j++) {
        prod_job &J = a->job[j];
        J.S = fmv_split<DT>(J.R, C, N);
        const int64_t per_block = (int64_t)(FMV_WARPS / J.S) * rows;
        J.blk0 = (unsigned)total;
        total += (J.R + per_block - 1) / per_block;
        if (total > 0x7fffffff) return false;
    }
    *grid = (unsigned)total;
    return true;
}

template <int NT, int DT, bool FAST, bool PAIR>
static cudaError_t fmv_launch_nt(cudaStream_t s, prod_jobs a, const float *x, int64_t C, int N) {
    unsigned grid = 0;
    if (!fmv_plan<DT, NT>(&a, &grid, C, N)) return cudaErrorInvalidValue;
    return launch_pdl(a.norm_w ? matvec_fast_kernel<DT, NT, FAST, PAIR, true>
                               : matvec_fast_kernel<DT, NT, FAST, PAIR, false>,
                      grid, FMV_THREADS, 0, s, a, x, C, N);
}

template <int DT>
static void fmv_launch(cudaError_t *err, cudaStream_t s, const prod_jobs *a, bool pair,
                       const float *x, int64_t C, int N) {
    using T = fmv<DT>;
    if (C % blk<DT>::BS != 0) {
        *err = cudaErrorInvalidValue;
        return;
    }
    bool fast = (uintptr_t)x % 16 == 0 && (uintptr_t)a->norm_w % 16 == 0 && C % 4 == 0;
    for (int j = 0; j < a->n; j++) {
        const prod_job &J = a->job[j];
        if (J.row_bytes < (size_t)(C / blk<DT>::BS) * blk<DT>::TS) {
            *err = cudaErrorInvalidValue;
            return;
        }
        fast = fast && (uintptr_t)J.w % T::ALIGN == 0 && (uintptr_t)J.w_up % T::ALIGN == 0 &&
               J.row_bytes % T::ALIGN == 0;
    }
    if (pair) {
        if (!fast) *err = cudaErrorNotSupported; /* nothing enqueued: the caller splits it */
        else if (N == 1) *err = fmv_launch_nt<1, DT, true, true>(s, *a, x, C, N);
        else if (N == 2) *err = fmv_launch_nt<2, DT, true, true>(s, *a, x, C, N);
        else if (N <= 4) *err = fmv_launch_nt<4, DT, true, true>(s, *a, x, C, N);
        else *err = fmv_launch_nt<8, DT, true, true>(s, *a, x, C, N);
    } else if (!fast) { /* rare (misaligned data): two tiles only, same order */
        *err = N == 1 ? fmv_launch_nt<1, DT, false, false>(s, *a, x, C, N)
                      : fmv_launch_nt<8, DT, false, false>(s, *a, x, C, N);
    } else if (N == 1) {
        *err = fmv_launch_nt<1, DT, true, false>(s, *a, x, C, N);
    } else if (N == 2) {
        *err = fmv_launch_nt<2, DT, true, false>(s, *a, x, C, N);
    } else if (N <= 4) {
        *err = fmv_launch_nt<4, DT, true, false>(s, *a, x, C, N);
    } else {
        *err = fmv_launch_nt<8, DT, true, false>(s, *a, x, C, N);
    }
}

template <int DT> static void fmv_split_of(int *S, int64_t R, int64_t C, int N) {
    *S = C % blk<DT>::BS == 0 ? fmv_split<DT>(R, C, N) : 0;
}

int kiln_cuda_matvec_fast_split(kiln_dtype dt, int64_t R, int64_t C, int N) {
    if (R < 1 || C < 1 || N < 1 || N > 8) return 0;
    int S = 0;
    switch (dt) { /* KILN_CUDA_DTYPE_SWITCH returns a cudaError_t on an unknown dtype */
    case KILN_DTYPE_F32: fmv_split_of<KILN_DTYPE_F32>(&S, R, C, N); break;
    case KILN_DTYPE_F16: fmv_split_of<KILN_DTYPE_F16>(&S, R, C, N); break;
    case KILN_DTYPE_BF16: fmv_split_of<KILN_DTYPE_BF16>(&S, R, C, N); break;
    case KILN_DTYPE_Q8_0: fmv_split_of<KILN_DTYPE_Q8_0>(&S, R, C, N); break;
    case KILN_DTYPE_Q4_0: fmv_split_of<KILN_DTYPE_Q4_0>(&S, R, C, N); break;
    case KILN_DTYPE_Q4_1: fmv_split_of<KILN_DTYPE_Q4_1>(&S, R, C, N); break;
    case KILN_DTYPE_Q5_0: fmv_split_of<KILN_DTYPE_Q5_0>(&S, R, C, N); break;
    case KILN_DTYPE_Q5_1: fmv_split_of<KILN_DTYPE_Q5_1>(&S, R, C, N); break;
    case KILN_DTYPE_Q4_K: fmv_split_of<KILN_DTYPE_Q4_K>(&S, R, C, N); break;
    case KILN_DTYPE_Q5_K: fmv_split_of<KILN_DTYPE_Q5_K>(&S, R, C, N); break;
    case KILN_DTYPE_Q6_K: fmv_split_of<KILN_DTYPE_Q6_K>(&S, R, C, N); break;
    default: return 0;
    }
    return S;
}

/* The checks of the fast decode products' entries (N <= 8): the jobs, x and norm_w. */
static bool fast_jobs_ok(int n, const kiln_cuda_product_job *jobs, kiln_dtype dt, const float *x,
                         const float *norm_w, int64_t C, int N, bool *pair) {
    return N <= 8 && kiln_cuda_dtype_supported(dt) && product_jobs_ok(n, jobs, x, C, N, pair) &&
           (uintptr_t)norm_w % 4 == 0 && C <= INT_MAX;
}

cudaError_t kiln_cuda_matvec_fast_multi_norm(cudaStream_t s, int n,
                                             const kiln_cuda_product_job *jobs, kiln_dtype dt,
                                             const float *x, const float *norm_w, float eps,
                                             int64_t C, int N) {
    bool pair = false;
    if (!fast_jobs_ok(n, jobs, dt, x, norm_w, C, N, &pair)) return cudaErrorInvalidValue;
    const prod_jobs a = prod_jobs_of(n, jobs, norm_w, eps);
    cudaError_t err = cudaSuccess;
    KILN_CUDA_DTYPE_SWITCH(dt, fmv_launch, &err, s, &a, pair, x, C, N);
    return err;
}

cudaError_t kiln_cuda_matvec_fast_multi(cudaStream_t s, int n, const kiln_cuda_product_job *jobs,
                                        kiln_dtype dt, const float *x, int64_t C, int N) {
    return kiln_cuda_matvec_fast_multi_norm(s, n, jobs, dt, x, NULL, 0.0f, C, N);
}

cudaError_t kiln_cuda_matvec_fast(cudaStream_t s, float *out, const float *x, const uint8_t *w,
                                  size_t row_bytes, kiln_dtype dt, int64_t R, int64_t C,
                                  const float *bias, int N, int accumulate) {
    if (!out || (uintptr_t)out % 4) return cudaErrorInvalidValue;
    const kiln_cuda_product_job job = {out, accumulate ? out : NULL, w, NULL, bias, NULL, row_bytes, R};
    return kiln_cuda_matvec_fast_multi(s, 1, &job, dt, x, C, N);
}

/* =================================================================================================
 * Fast: bf16 decode products of 2..8 tokens on the tensor cores (mma.sync m16n8k16).
 *
 * The f32 kernel above does one FMA per weight and token: at 8 tokens a 3B step is bound by
 * the FMA rate, not by the weights' bytes. Here a warp multiplies a 16-row tile of W by the
 * tokens' x (rounded to bf16 as the fast GEMMs round it: one rounding of the f32, or of the
 * normed f32 value) on the tensor cores, f32 accumulation, the 8 tokens as the mma's n.
 *
 * A lane (g = lane / 4, t = lane % 4) loads 16 consecutive k of rows g and g + 8 of its tile
 * for each chunk of 64 k (two 16-byte loads a row: a warp reads 128 whole bytes of each of 16
 * rows), and x of token g at the same 16 k. Its words w0..w7 (pairs k, k + 1 from 16t) feed
 * four mma steps s = 0..3: step s puts w(2s) at fragment columns 2t, 2t + 1 and w(2s + 1) at
 * 2t + 8, 2t + 9 (cuda_mma.cuh's table), for A and B alike. The k order inside an mma is thus
 * a fixed permutation of the natural one; a dot is the same sum. A warp takes the chunks k,
 * k + S, k + 2S, ... of its tile's rows (S warps a tile, S from (R, C) alone), and one thread
 * per (row, token) adds the S partial sums in warp order, then the bias, the SwiGLU (PAIR:
 * the warp walks the gate's and the up's tiles side by side) and the residual, as the f32
 * kernel's epilogue does. Deterministic: nothing depends on timing, N or the grid.
 *
 * Past 8 tokens (the batch-invariant fast mode runs every product here, whatever N) a block
 * takes NT groups of 8 tokens and multiplies each weight load by all of them; a token's
 * chain of mma steps and its S partial sums are those it gets alone, so its outputs are the
 * same bits for any N and any grouping. Blocks are ordered token block fastest, so that the
 * blocks reading one weight tile run together and the tile comes from L2 after the first.
 * ============================================================================================== */

#define MMV_THREADS 256
#define MMV_WARPS (MMV_THREADS / 32)
#define MMV_KC 64            /* k of a chunk */
#define MMV_TARGET_WARPS 2048 /* warps the split aims at: 4 KB in flight each, ~15 an SM */

/* Word i (0..7) of the two 16-byte loads v[0], v[1] (i a constant once unrolled). */
static __device__ __forceinline__ uint32_t mmv_word(const uint4 *v, int i) {
    const uint4 &q = v[i >> 2];
    return (i & 3) == 0 ? q.x : (i & 3) == 1 ? q.y : (i & 3) == 2 ? q.z : q.w;
}

template <bool PAIR, bool NORM, int NT>
static __global__ void __launch_bounds__(MMV_THREADS)
matvec_mma_kernel(const __grid_constant__ prod_jobs jobs, const float *__restrict__ x, int64_t C,
                  int N, int n_tb) {
    constexpr int RW = PAIR ? 2 : 1;     /* weight tiles a warp walks: the gate's, the up's */
    constexpr int UNR = PAIR ? 2 : 4;    /* chunks a step loads before it multiplies */
    __shared__ float red[MMV_WARPS][RW][NT][16 * 8];
    __shared__ float sr[8 * NT];
    pdl_wait(); /* launched by launch_pdl (cuda_common.cuh): x is the kernel before's */
    pdl_launch_dependents();
    /* block = (row block, token block of 8 NT tokens), the token block fastest */
    const unsigned rbk = blockIdx.x / (unsigned)n_tb;
    const int n0 = (int)(blockIdx.x - rbk * (unsigned)n_tb) * 8 * NT;
    const int nt = N - n0 < 8 * NT ? N - n0 : 8 * NT; /* this block's tokens */
    if constexpr (NORM)
        for (int q = 0; q < nt; q += 16) norm_prologue(sr + q, x, C, n0 + q, nt - q < 16 ? nt - q : 16, jobs.eps);

    int jb = 0;
    while (jb + 1 < jobs.n && rbk >= jobs.job[jb + 1].blk0) jb++;
    const prod_job &J = jobs.job[jb];
    const int64_t R = J.R;
    const int S = J.S, G = MMV_WARPS / S; /* G row tiles a block, S warps a tile */
    const unsigned bx = rbk - J.blk0;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int grp = warp / S, k = warp - grp * S;
    const int g = lane >> 2, t = lane & 3;
    const int64_t r0 = ((int64_t)bx * G + grp) * 16;
    /* rows past R read row R - 1; their sums are dropped */
    const int64_t ra = r0 + g < R ? r0 + g : R - 1, rb = r0 + g + 8 < R ? r0 + g + 8 : R - 1;
    const uint8_t *rowp[RW][2];
#pragma unroll
    for (int i = 0; i < RW; i++) {
        const uint8_t *w = i ? J.w_up : J.w;
        rowp[i][0] = w + (size_t)ra * J.row_bytes + 32 * t;
        rowp[i][1] = w + (size_t)rb * J.row_bytes + 32 * t;
    }
    const float *nw = NORM ? jobs.norm_w + 16 * t : nullptr;

    float acc[NT][RW][4];
#pragma unroll
    for (int m = 0; m < NT; m++)
#pragma unroll
        for (int i = 0; i < RW; i++) acc[m][i][0] = acc[m][i][1] = acc[m][i][2] = acc[m][i][3] = 0.0f;

    const int64_t nch = C / MMV_KC;
    for (int64_t c0 = k; c0 < nch; c0 += (int64_t)UNR * S) {
        uint4 raw[UNR][RW][2][2];
#pragma unroll
        for (int u = 0; u < UNR; u++) {
            const int64_t c = c0 + (int64_t)u * S;
            if (c < nch) {
#pragma unroll
                for (int i = 0; i < RW; i++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const uint4 *p = (const uint4 *)(rowp[i][h] + (size_t)c * (2 * MMV_KC));
                        raw[u][i][h][0] = __ldg(p);
                        raw[u][i][h][1] = __ldg(p + 1);
                    }
            }
        }
#pragma unroll
        for (int u = 0; u < UNR; u++) {
            const int64_t c = c0 + (int64_t)u * S;
            if (c >= nch) break; /* chunks only grow with u */
#pragma unroll
            for (int m = 0; m < NT; m++) {
                const int tg = 8 * m + g; /* the lane's token in the block */
                if (NT > 1 && 8 * m >= nt) break; /* groups past the block's tokens */
                uint32_t xb[8];      /* token tg's x at the lane's 16 k, bf16 pairs */
                if (tg < nt) {
                    const float *xr = x + (int64_t)(n0 + tg) * C + 16 * t;
                    const float r_g = NORM ? sr[tg] : 0.0f;
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        const float4 f = __ldg((const float4 *)(xr + c * MMV_KC) + q);
                        float v[4] = {f.x, f.y, f.z, f.w};
                        if constexpr (NORM) {
                            const float4 w4 = __ldg((const float4 *)(nw + c * MMV_KC) + q);
                            const float wv[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
                            for (int e = 0; e < 4; e++) v[e] = normed(v[e], r_g, wv[e]);
                        }
                        xb[2 * q] = pack_bf16(v[0], v[1]);
                        xb[2 * q + 1] = pack_bf16(v[2], v[3]);
                    }
                } else {
#pragma unroll
                    for (int q = 0; q < 8; q++) xb[q] = 0u;
                }
#pragma unroll
                for (int i = 0; i < RW; i++) {
                    const uint4 *wa = raw[u][i][0], *wb = raw[u][i][1]; /* rows g, g + 8 */
#pragma unroll
                    for (int st = 0; st < 4; st++) {
                        const uint32_t a[4] = {mmv_word(wa, 2 * st), mmv_word(wb, 2 * st),
                                               mmv_word(wa, 2 * st + 1), mmv_word(wb, 2 * st + 1)};
                        const uint32_t b[2] = {xb[2 * st], xb[2 * st + 1]};
                        mma_bf16_16816(acc[m][i], a, b);
                    }
                }
            }
        }
    }

    /* c[0] = (row g, token 2t), c[1] = (g, 2t + 1), c[2] = (g + 8, 2t), c[3] = (g + 8, 2t + 1) */
#pragma unroll
    for (int m = 0; m < NT; m++)
#pragma unroll
        for (int i = 0; i < RW; i++) {
            red[warp][i][m][g * 8 + 2 * t] = acc[m][i][0];
            red[warp][i][m][g * 8 + 2 * t + 1] = acc[m][i][1];
            red[warp][i][m][(g + 8) * 8 + 2 * t] = acc[m][i][2];
            red[warp][i][m][(g + 8) * 8 + 2 * t + 1] = acc[m][i][3];
        }
    __syncthreads();
    /* one thread per (tile, row, token): the S warps' sums in warp order, the bias, (PAIR)
     * swiglu of the gate's and the up's, the residual */
    for (int o = threadIdx.x; o < G * 16 * 8 * NT; o += MMV_THREADS) {
        const int m = o / (G * 128), oo = o - m * (G * 128);
        const int gt = oo >> 7, j = oo & 127, tok = 8 * m + (j & 7);
        const int64_t r = ((int64_t)bx * G + gt) * 16 + (j >> 3);
        if (r >= R || tok >= nt) continue;
        float sum = red[gt * S][0][m][j];
        for (int kk = 1; kk < S; kk++) sum = sum + red[gt * S + kk][0][m][j];
        if (J.bias) sum = sum + J.bias[r];
        if constexpr (PAIR) {
            float up = red[gt * S][1][m][j];
            for (int kk = 1; kk < S; kk++) up = up + red[gt * S + kk][1][m][j];
            if (J.bias_up) up = up + J.bias_up[r];
            sum = kiln_swiglu(sum, up);
        }
        const int64_t at = (int64_t)(n0 + tok) * R + r;
        if (J.res) sum = sum + J.res[at];
        J.out[at] = sum;
    }
}

/* S for R rows of width C: the warps a 16-row tile's chunks are split over (1, 2, 4 or 8),
 * a function of (R, C) alone. */
static int mmv_split(int64_t R, int64_t C) {
    const int64_t tiles = (R + 15) / 16, nch = C / MMV_KC;
    int S = 1;
    while (S < MMV_WARPS && tiles * S < MMV_TARGET_WARPS && nch >= 2 * S) S *= 2;
    return S;
}

/* Whether kiln_cuda_matvec_mma_multi_norm takes these products: bf16, 2..8 tokens, C a
 * multiple of 64, the 16-byte alignment of every weight row, x and norm_w. */
static bool mmv_ok(int n, const kiln_cuda_product_job *jobs, kiln_dtype dt, const float *x,
                   const float *norm_w, int64_t C, int N) {
    if (dt != KILN_DTYPE_BF16 || N < 1 || C % MMV_KC || (uintptr_t)x % 16 ||
        (uintptr_t)norm_w % 16)
        return false;
    for (int j = 0; j < n; j++)
        if ((uintptr_t)jobs[j].w % 16 || (uintptr_t)jobs[j].w_up % 16 || jobs[j].row_bytes % 16)
            return false;
    return true;
}

cudaError_t kiln_cuda_matvec_mma_multi_norm(cudaStream_t s, int n,
                                            const kiln_cuda_product_job *jobs, kiln_dtype dt,
                                            const float *x, const float *norm_w, float eps,
                                            int64_t C, int N) {
    bool pair = false;
    if (N < 1 || !kiln_cuda_dtype_supported(dt) || !product_jobs_ok(n, jobs, x, C, N, &pair) ||
        (uintptr_t)norm_w % 4 || C > INT_MAX)
        return cudaErrorInvalidValue;
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(dt);
    if (C % tr->block_size) return cudaErrorInvalidValue;
    for (int j = 0; j < n; j++)
        if (jobs[j].row_bytes < (size_t)(C / tr->block_size) * tr->type_size)
            return cudaErrorInvalidValue;
    if (!mmv_ok(n, jobs, dt, x, norm_w, C, N)) return cudaErrorNotSupported;
    prod_jobs a = prod_jobs_of(n, jobs, norm_w, eps);
    const int NT = N <= 8 ? 1 : 4, n_tb = (N + 8 * NT - 1) / (8 * NT);
    int64_t total = 0;
    for (int j = 0; j < n; j++) {
        prod_job &J = a.job[j];
        J.S = mmv_split(J.R, C);
        const int64_t per_block = (int64_t)(MMV_WARPS / J.S) * 16;
        J.blk0 = (unsigned)total;
        total += (J.R + per_block - 1) / per_block;
        if (total * n_tb > 0x7fffffff) return cudaErrorInvalidValue;
    }
    const dim3 grid((unsigned)(total * n_tb));
    if (NT == 1) {
        auto k = pair ? (norm_w ? matvec_mma_kernel<true, true, 1> : matvec_mma_kernel<true, false, 1>)
                      : (norm_w ? matvec_mma_kernel<false, true, 1> : matvec_mma_kernel<false, false, 1>);
        return launch_pdl(k, grid, MMV_THREADS, 0, s, a, x, C, N, n_tb);
    }
    auto k = pair ? (norm_w ? matvec_mma_kernel<true, true, 4> : matvec_mma_kernel<true, false, 4>)
                  : (norm_w ? matvec_mma_kernel<false, true, 4> : matvec_mma_kernel<false, false, 4>);
    return launch_pdl(k, grid, MMV_THREADS, 0, s, a, x, C, N, n_tb);
}

int kiln_cuda_matvec_mma_split(int64_t R, int64_t C) {
    return R < 1 || C < MMV_KC || C % MMV_KC ? 0 : mmv_split(R, C);
}

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
    static constexpr int ALIGN = fmv<DT>::ALIGN;
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

/* The current device's SM count (a launch-shape choice only: no bit depends on it). */
static int q8a_sms() {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n < 1)
        n = 1;
    return n;
}

/* Launches k (q8act_kernel or kq_kernel: Q8A_THREADS threads, token tiles of NT, groups of
 * ROWS rows a warp) over the jobs' rows, its tiles' quantized tokens in dynamic shared memory. */
template <class K>
static cudaError_t q8a_persist(K k, int NT, int ROWS, cudaStream_t s, const prod_jobs &a,
                               int64_t rows, const float *x, int64_t C, int N) {
    const size_t smem = (size_t)NT * (size_t)(C / 32) * Q8A_BLOCK_SMEM;
    if (smem > 48 * 1024) {
        const cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
    }
    /* grid-stride: no more blocks than run at once (a block that waits for a slot would start
     * its rows late) */
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, Q8A_THREADS, smem) != cudaSuccess ||
        per_sm < 1)
        per_sm = 1;
    const int64_t need = ((rows + ROWS - 1) / ROWS + Q8A_WARPS - 1) / Q8A_WARPS;
    const int64_t cap = (int64_t)q8a_sms() * per_sm;
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

/* =================================================================================================
 * Fast: the matmul backward (contract and arithmetic: cuda_matmul.h): dy, x and W rounded
 * to bf16 once each into a stream-ordered buffer, then dx = dy @ W and dW += dy^T @ x as
 * two bf16 tensor-core products of the GEMM module; dbias by cuda_norm.cu's chunked
 * fixed-order column sum (kiln_cuda_col_sum_fast).
 * ============================================================================================== */

/* The bf16 copies are laid out by the GEMM module's rules above: padded_ld (rows padded to 8
 * elements, so every row starts 16-byte aligned) and bf16_in_place (a bf16 W whose rows start
 * 16-byte aligned is read in place; otherwise it is copied, exactly: bf16 -> f32 -> bf16 is
 * the identity, into the buffer with padded rows). */

/* Bytes of a (rows x ld) bf16 matrix rounded up to 256 (the next region's alignment); false
 * past 2^46 elements (no buffer anyone allocates; keeps every later sum far from overflow). */
static bool mb_region_bytes(int64_t rows, int64_t ld, size_t *out) {
    const int64_t limit = (int64_t)1 << 46;
    if (rows < 0 || ld < 0 || (rows > 0 && ld > limit / rows)) return false;
    *out = ((size_t)(rows * ld) * 2u + 255u) & ~(size_t)255u;
    return true;
}

/* The products of one item: dyb(N, ldR) already bf16; W converted into wcopy unless read in
 * place; xb (N, ldC) converted by the caller when dW. dx16 (then dx is NULL): dx in bf16,
 * not accumulated. Arguments already checked. */
static cudaError_t item_products(kiln_cuda_gemm *g, cudaStream_t s, const kiln_cuda_mb_item &it,
                                 const uint16_t *dyb, int64_t ldR, const uint16_t *xb,
                                 int64_t ldx, uint16_t *wcopy, float *dx, uint16_t *dx16,
                                 int64_t C, int N, bool accumulate_dx) {
    const int64_t ldC = padded_ld(C);
    cudaError_t e = cudaSuccess;
    if (dx || dx16) { /* dx(N,C) (+)= dy(N,R) @ W(R,C): M = N, N = C, K = R */
        const uint16_t *wb;
        int64_t ldw;
        if (bf16_in_place(it.dt, it.w, it.row_bytes)) {
            wb = (const uint16_t *)it.w;
            ldw = (int64_t)(it.row_bytes / 2);
        } else {
            e = kiln_cuda_weights_to_bf16(s, wcopy, ldC, it.w, it.row_bytes, it.dt, it.R, C);
            if (e != cudaSuccess) return e;
            wb = wcopy;
            ldw = ldC;
        }
        e = dx16 ? kiln_cuda_gemm_bf16_out16(g, s, 0, 0, N, C, it.R, dyb, ldR, wb, ldw, dx16, C)
                 : kiln_cuda_gemm_bf16(g, s, 0, 0, N, C, it.R, dyb, ldR, wb, ldw, dx, C,
                                       accumulate_dx ? 1 : 0);
        if (e != cudaSuccess) return e;
    }
    if (it.dW) /* dW(R,C) += dy^T(R,N) @ x(N,C): A = dy stored (N,R), trans_a; K = N */
        e = kiln_cuda_gemm_bf16(g, s, 1, 0, it.R, C, N, dyb, ldR, xb, ldx, it.dW, C, 1);
    return e;
}

/* kiln_cuda_matmul_backward_fast_multi (x f32, rounded into the buffer) or, with x NULL,
 * its _bf16 twin (xb16 at ldx16 used in place; no x region in the buffer). */
static cudaError_t mb_multi(kiln_cuda_gemm *g, cudaStream_t s, int n,
                            const kiln_cuda_mb_item *items, float *dx, uint16_t *dx16,
                            const float *x, const uint16_t *xb16, int64_t ldx16, int64_t C,
                            int N, bool accumulate_dx) {
    if (!g || n < 1 || n > KILN_CUDA_MB_MAX || !items) return cudaErrorInvalidValue;
    if (dx16 && (n != 1 || dx || accumulate_dx)) return cudaErrorInvalidValue;
    if (N <= 0 || C <= 0) return cudaSuccess;
    if (!x && xb16 && ldx16 < C) return cudaErrorInvalidValue;
    /* every item checked before anything is enqueued; the buffer: each dyb_i, then xb (any
     * dW), then one W copy region (the largest needed), then the column sums' partials (the
     * largest) -- every region 256-byte aligned, as in a single call, so the GEMM problems
     * (shapes, leading dimensions, alignment classes) are those of n single calls */
    size_t dy_off[KILN_CUDA_MB_MAX], off = 0, x_bytes = 0, w_bytes = 0, part_len = 0;
    size_t part_sum = 0; /* the biases' sums in one launch when two or more ask for them */
    int n_bias = 0;
    bool any = false, any_dW = false;
    for (int i = 0; i < n; i++) {
        const kiln_cuda_mb_item &it = items[i];
        dy_off[i] = off;
        if (it.R <= 0) continue;
        if (!kiln_cuda_backward_dtype_supported(it.dt)) return cudaErrorInvalidValue;
        const bool products = dx || dx16 || it.dW;
        if (!products && !it.dbias) continue;
        if ((!it.dy && !it.dy16) || (it.dbias && !it.dy) || ((dx || dx16) && !it.w) ||
            (it.dW && !x && !xb16))
            return cudaErrorInvalidValue;
        const size_t es = it.dt == KILN_DTYPE_F32 ? 4u : 2u;
        if ((dx || dx16) && (it.row_bytes % es != 0 || it.row_bytes / es < (size_t)C ||
                   ((uintptr_t)it.w % es) != 0))
            return cudaErrorInvalidValue;
        any = true;
        size_t b = 0;
        if (products && !it.dy16) {
            if (!mb_region_bytes(N, padded_ld(it.R), &b)) return cudaErrorInvalidValue;
            off += b;
        }
        if ((dx || dx16) && !bf16_in_place(it.dt, it.w, it.row_bytes)) {
            if (!mb_region_bytes(it.R, padded_ld(C), &b)) return cudaErrorInvalidValue;
            if (b > w_bytes) w_bytes = b;
        }
        if (it.dW) any_dW = true;
        if (it.dbias) {
            const size_t pl = kiln_cuda_col_sum_fast_scratch_len(N, it.R);
            if (pl > part_len) part_len = pl;
            part_sum += pl;
            n_bias++;
        }
    }
    if (!any) return cudaSuccess;
    static_assert(KILN_CUDA_MB_MAX <= KILN_CUDA_COL_SUM_MULTI_MAX, "every item's bias in one call");
    const bool bias_multi = n_bias >= 2;
    if (bias_multi) part_len = part_sum;
    if (any_dW && x && !mb_region_bytes(N, padded_ld(C), &x_bytes))
        return cudaErrorInvalidValue;
    const size_t x_off = off, w_off = x_off + x_bytes, part_off = w_off + w_bytes;
    const size_t part_bytes = (part_len * sizeof(double) + 255u) & ~(size_t)255u;
    const size_t total = part_off + part_bytes + 256; /* + room to align */
    void *base = NULL;
    bool pooled = true;
    cudaError_t e = cudaMallocAsync(&base, total, s);
    if (e == cudaErrorNotSupported) { /* no memory pools on this device: a plain allocation */
        (void)cudaGetLastError();
        pooled = false;
        e = cudaMalloc(&base, total);
    }
    if (e != cudaSuccess) return e;
    uint8_t *buf = (uint8_t *)(((uintptr_t)base + 255u) & ~(uintptr_t)255u);
    uint16_t *wcopy = (uint16_t *)(buf + w_off);
    const uint16_t *xb = xb16;
    const int64_t ldx = x ? padded_ld(C) : ldx16;
    double *part = (double *)(buf + part_off);
    if (any_dW && x) {
        uint16_t *dst = (uint16_t *)(buf + x_off);
        e = kiln_cuda_f32_to_bf16(s, dst, ldx, x, C, N, C);
        xb = dst;
    }
    if (bias_multi && e == cudaSuccess) { /* every bias's sums first, one launch each kernel */
        float *bo[KILN_CUDA_COL_SUM_MULTI_MAX];
        const float *ba[KILN_CUDA_COL_SUM_MULTI_MAX];
        int64_t bld[KILN_CUDA_COL_SUM_MULTI_MAX], bw[KILN_CUDA_COL_SUM_MULTI_MAX];
        int nb = 0;
        for (int i = 0; i < n; i++)
            if (items[i].R > 0 && items[i].dbias) {
                bo[nb] = items[i].dbias;
                ba[nb] = items[i].dy;
                bld[nb] = bw[nb] = items[i].R;
                nb++;
            }
        e = kiln_cuda_col_sum_fast_multi(s, nb, bo, ba, bld, bw, N, part, part_len);
    }
    bool dx_started = false; /* dx: the first product with accumulate_dx, the rest add */
    for (int i = 0; i < n && e == cudaSuccess; i++) {
        const kiln_cuda_mb_item &it = items[i];
        if (it.R <= 0) continue;
        /* dbias(R) += column sums of dy(N,R), kiln_cuda_col_sum_fast's order */
        if (it.dbias && !bias_multi)
            e = kiln_cuda_col_sum_fast(s, it.dbias, it.dy, NULL, NULL, it.R, N, it.R, part,
                                       kiln_cuda_col_sum_fast_scratch_len(N, it.R));
        if (e != cudaSuccess || (!dx && !dx16 && !it.dW)) continue;
        const uint16_t *dyb = it.dy16;
        const int64_t ldy = it.dy16 ? it.R : padded_ld(it.R);
        if (!it.dy16) {
            uint16_t *dst = (uint16_t *)(buf + dy_off[i]);
            e = kiln_cuda_f32_to_bf16(s, dst, ldy, it.dy, it.R, N, it.R);
            dyb = dst;
        }
        if (e == cudaSuccess)
            e = item_products(g, s, it, dyb, ldy, xb, ldx, wcopy, dx, dx16, C, N,
                              dx_started || accumulate_dx);
        dx_started = dx_started || dx != NULL;
    }
    /* released after everything enqueued above has read it (stream order; the plain
     * allocation waits for the stream first) */
    cudaError_t ef;
    if (pooled) {
        ef = cudaFreeAsync(base, s);
    } else {
        ef = cudaStreamSynchronize(s);
        cudaError_t e2 = cudaFree(base);
        if (ef == cudaSuccess) ef = e2;
    }
    return e != cudaSuccess ? e : ef;
}

cudaError_t kiln_cuda_matmul_backward_fast_multi(kiln_cuda_gemm *g, cudaStream_t s, int n,
                                                 const kiln_cuda_mb_item *items, float *dx,
                                                 const float *x, int64_t C, int N,
                                                 bool accumulate_dx) {
    return mb_multi(g, s, n, items, dx, NULL, x, NULL, 0, C, N, accumulate_dx);
}

cudaError_t kiln_cuda_matmul_backward_fast_multi_bf16(kiln_cuda_gemm *g, cudaStream_t s, int n,
                                                      const kiln_cuda_mb_item *items, float *dx,
                                                      const uint16_t *xb, int64_t ldx,
                                                      int64_t C, int N, bool accumulate_dx) {
    if (!xb) return cudaErrorInvalidValue;
    return mb_multi(g, s, n, items, dx, NULL, NULL, xb, ldx, C, N, accumulate_dx);
}

cudaError_t kiln_cuda_matmul_backward_fast_dx16(kiln_cuda_gemm *g, cudaStream_t s,
                                                const kiln_cuda_mb_item *item, uint16_t *dx16,
                                                const uint16_t *xb, int64_t ldx, int64_t C,
                                                int N) {
    if (!xb || !dx16) return cudaErrorInvalidValue;
    return mb_multi(g, s, 1, item, NULL, dx16, NULL, xb, ldx, C, N, false);
}

cudaError_t kiln_cuda_matmul_backward_fast(kiln_cuda_gemm *g, cudaStream_t s, float *dx,
                                           float *dW, float *dbias, const float *dy,
                                           const float *x, const uint8_t *w, size_t row_bytes,
                                           kiln_dtype dt, int64_t R, int64_t C, int N,
                                           bool accumulate_dx) {
    if (!g) return cudaErrorInvalidValue;
    if (N <= 0 || R <= 0 || C <= 0) return cudaSuccess;
    const kiln_cuda_mb_item it = {dW, dbias, dy, w, row_bytes, dt, R};
    return kiln_cuda_matmul_backward_fast_multi(g, s, 1, &it, dx, x, C, N, accumulate_dx);
}

/* =================================================================================================
 * The wgmma self-check and the per-device answer of kiln_cuda_wgmma_usable (contract:
 * cuda_matmul.h).
 *
 * ============================================================================================== */

/*
 * The check multiplies A(64 x 64) by B(64 x 64), bf16 holding small integers (so every f32
 * sum is exact and any order gives the same bits), four ways, in one block of one warpgroup:
 *   r0: A from registers,  B^T as a K-major tile       (wgmma_rs<0>)
 *   r1: A from registers,  B as an MN-major tile       (wgmma_rs<1>)
 *   r2: A as a K-major tile, B^T as a K-major tile     (wgmma_ss<0, 0>)
 *   r3: A^T as an MN-major tile, B as an MN-major tile (wgmma_ss<1, 1>)
 * each over the four k-steps of 16 with the descriptor steps of cuda_wgmma.cuh, and compares
 * every element with the host's product.
 */

typedef __nv_bfloat16 bf16;

#define WG_CHECK_SMEM (4 * 8192 + KILN_SW128_ALIGN)

/* a, at, b, bt: A, A^T, B, B^T row-major 64 x 64 bf16; r: 4 x 64 x 64 f32; *present: 1 in
 * the sm_90a code, 0 elsewhere. */
static __global__ void __launch_bounds__(128)
wgmma_check_kernel(float *r, int *present, const bf16 *a, const bf16 *at, const bf16 *b,
                   const bf16 *bt) {
#if KILN_WGMMA_DEVICE
    extern __shared__ unsigned char wg_sm[];
    bf16 *tA = sw128_tiles(wg_sm), *tAt = tA + 4096;
    bf16 *tB = tAt + 4096, *tBt = tB + 4096;
    cp_tile_sw128<64, 128>(tA, a, 64);
    cp_tile_sw128<64, 128>(tAt, at, 64);
    cp_tile_sw128<64, 128>(tB, b, 64);
    cp_tile_sw128<64, 128>(tBt, bt, 64);
    cp_async_commit();
    cp_async_wait<0>();
    wgmma_proxy_fence();
    __syncthreads();
    if (threadIdx.x == 0) *present = 1;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    uint32_t af[4][4]; /* A's fragments for the 4 k-steps (this warp's 16 rows) */
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        const bf16 *p0 = a + (16 * warp + g) * 64 + 16 * kk + 2 * t, *p1 = p0 + 8 * 64;
        af[kk][0] = ld_pair(p0);
        af[kk][1] = ld_pair(p1);
        af[kk][2] = ld_pair(p0 + 8);
        af[kk][3] = ld_pair(p1 + 8);
    }
    float d[4][32];
#pragma unroll
    for (int f = 0; f < 4; f++)
#pragma unroll
        for (int i = 0; i < 32; i++) d[f][i] = 0.0f;
    const uint64_t dA = sw128_desc(tA), dAt = sw128_desc(tAt);
    const uint64_t dB = sw128_desc(tB), dBt = sw128_desc(tBt);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        wgmma_rs<0>(d[0], af[kk], dBt + SW128_KSTEP_K * kk, kk > 0);
        wgmma_rs<1>(d[1], af[kk], dB + SW128_KSTEP_MN * kk, kk > 0);
        wgmma_ss<0, 0>(d[2], dA + SW128_KSTEP_K * kk, dBt + SW128_KSTEP_K * kk, kk > 0);
        wgmma_ss<1, 1>(d[3], dAt + SW128_KSTEP_MN * kk, dB + SW128_KSTEP_MN * kk, kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int f = 0; f < 4; f++) {
        wgmma_fence_operands(d[f]);
        float *o = r + f * 4096;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int row = 16 * warp + g, col = 8 * j + 2 * t;
            o[row * 64 + col] = d[f][4 * j];
            o[row * 64 + col + 1] = d[f][4 * j + 1];
            o[(row + 8) * 64 + col] = d[f][4 * j + 2];
            o[(row + 8) * 64 + col + 1] = d[f][4 * j + 3];
        }
    }
#else
    (void)r;
    (void)a;
    (void)at;
    (void)b;
    (void)bt;
    if (threadIdx.x == 0) *present = 0;
#endif
}

int kiln_cuda_wgmma_selfcheck(char *msg, size_t cap) {
    if (msg && cap) msg[0] = '\0';
    int dev = 0;
    cudaDeviceProp prop;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
        if (msg) snprintf(msg, cap, "wgmma self-check: no CUDA device");
        return -1;
    }
    if (prop.major != 9 || prop.minor != 0) return 0;
    enum { E = 4096 };
    uint16_t *h = (uint16_t *)malloc(4 * E * sizeof(uint16_t));
    float *hr = (float *)malloc(4 * E * sizeof(float));
    int *ai = (int *)malloc(2 * E * sizeof(int));
    void *dmem = NULL;
    int result = -1, present = 0;
    cudaError_t e = cudaErrorMemoryAllocation;
    if (!h || !hr || !ai) goto out;
    {
        int *A = ai, *Bm = ai + E; /* A[m][k], B[k][n]: integers in [-8, 8], exact in bf16 */
        uint32_t s = 12345u;
        for (int i = 0; i < 2 * E; i++) {
            s = s * 1664525u + 1013904223u;
            ai[i] = (int)((s >> 24) % 17u) - 8;
        }
        uint16_t *ha = h, *hat = h + E, *hb = h + 2 * E, *hbt = h + 3 * E;
        for (int i = 0; i < 64; i++)
            for (int j = 0; j < 64; j++) {
                ha[i * 64 + j] = kiln_fp32_to_bf16((float)A[i * 64 + j]);
                hat[j * 64 + i] = kiln_fp32_to_bf16((float)A[i * 64 + j]);
                hb[i * 64 + j] = kiln_fp32_to_bf16((float)Bm[i * 64 + j]);
                hbt[j * 64 + i] = kiln_fp32_to_bf16((float)Bm[i * 64 + j]);
            }
        const size_t in_bytes = 4 * E * sizeof(uint16_t), out_bytes = 4 * E * sizeof(float);
        if ((e = cudaMalloc(&dmem, in_bytes + out_bytes + 16)) != cudaSuccess) goto out;
        bf16 *din = (bf16 *)dmem;
        float *dr = (float *)((char *)dmem + in_bytes);
        int *dp = (int *)((char *)dr + out_bytes);
        if ((e = cudaMemcpy(din, h, in_bytes, cudaMemcpyHostToDevice)) != cudaSuccess ||
            (e = cudaMemset(dr, 0xff, out_bytes + 16)) != cudaSuccess)
            goto out;
        wgmma_check_kernel<<<1, 128, WG_CHECK_SMEM>>>(dr, dp, din, din + E, din + 2 * E,
                                                       din + 3 * E);
        if ((e = cudaGetLastError()) != cudaSuccess || (e = cudaDeviceSynchronize()) != cudaSuccess ||
            (e = cudaMemcpy(&present, dp, sizeof(int), cudaMemcpyDeviceToHost)) != cudaSuccess ||
            (e = cudaMemcpy(hr, dr, out_bytes, cudaMemcpyDeviceToHost)) != cudaSuccess)
            goto out;
        if (present != 1) {
            result = 0;
            goto out;
        }
        static const char *form[4] = {"A registers x K-major B^T", "A registers x MN-major B",
                                      "K-major A x K-major B^T", "MN-major A^T x MN-major B"};
        for (int f = 0; f < 4; f++)
            for (int i = 0; i < 64; i++)
                for (int j = 0; j < 64; j++) {
                    int want = 0;
                    for (int k = 0; k < 64; k++) want += A[i * 64 + k] * Bm[k * 64 + j];
                    const float got = hr[f * E + i * 64 + j];
                    if (got != (float)want) {
                        if (msg)
                            snprintf(msg, cap, "wgmma self-check: %s: element (%d, %d) is %g, "
                                     "not %d", form[f], i, j, (double)got, want);
                        result = -1;
                        e = cudaSuccess;
                        goto out;
                    }
                }
        result = 1;
        e = cudaSuccess;
    }
out:
    if (e != cudaSuccess && msg) snprintf(msg, cap, "wgmma self-check: %s", cudaGetErrorString(e));
    if (e != cudaSuccess) result = -1;
    if (dmem) cudaFree(dmem);
    free(h);
    free(hr);
    free(ai);
    return result;
}

#define WG_MAX_DEVICES 64
static int wg_state[WG_MAX_DEVICES]; /* 0 unknown, 1 usable, 2 not usable */

bool kiln_cuda_wgmma_usable(cudaStream_t s) {
    if (kiln_env_off("KILN_WGMMA")) return false;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= WG_MAX_DEVICES) return false;
    int st = __atomic_load_n(&wg_state[dev], __ATOMIC_ACQUIRE);
    if (st == 0) {
        cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        if (cudaStreamIsCapturing(s, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone)
            return false; /* no synchronous check inside a capture */
        /* the library prints nothing: a failed check is test_cuda_wgmma's to report */
        const int r = kiln_cuda_wgmma_selfcheck(NULL, 0);
        st = r == 1 ? 1 : 2;
        __atomic_store_n(&wg_state[dev], st, __ATOMIC_RELEASE);
    }
    return st == 1;
}
