/*
 * cuda_backward_fast.cu -- the fast mode's matmul backward (contract and arithmetic:
 * cuda_backward_fast.h): dy, x and W rounded to bf16 once each into a stream-ordered buffer,
 * then dx = dy @ W and dW += dy^T @ x as two bf16 tensor-core products of the GEMM module;
 * dbias and RMSNorm's dw by the chunked fixed-order column sum (kiln_cuda_col_sum_fast).
 */
#include "cuda_backward_fast.h"

#include "cuda_backward.h"

#include <limits.h>

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
 * The order per column (cuda_backward_fast.h) depends on (N, W) only: the vector width, the
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
 * Grid (strips of 32 * CPT columns, K chunks); rows [n_lo, n_hi) of chunk blockIdx.y. */
template <int MODE, int CPT, int AHEAD>
static __global__ void __launch_bounds__(CS_TX *CS_LANES)
col_sum_partial_kernel(double *__restrict__ part, const float *__restrict__ a,
                       const float *__restrict__ b, const float *__restrict__ s, int64_t ld,
                       int N, int64_t W, int64_t rc) {
    constexpr int COLS = CS_TX * CPT;
    __shared__ double lanes[CS_LANES][COLS];
    const int tx = threadIdx.x, j = threadIdx.y;
    const int64_t c0 = (int64_t)blockIdx.x * COLS + tx * CPT; /* this thread's first column */
    const int64_t n_lo = (int64_t)blockIdx.y * rc;
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
        const int64_t c = (int64_t)blockIdx.x * COLS + e;
        if (c < W) part[(int64_t)blockIdx.y * W + c] = lanes[0][e];
    }
}

/* Column c = blockIdx.x * 32 + threadIdx.x; group g = threadIdx.y adds P[k][c] for k = g,
 * g + 8, ... ascending (from +0), the groups meet in the tree, and
 * out[c] = f32(out[c] + total) (the addition in double, one rounding). */
static __global__ void __launch_bounds__(CS_TX *CS_LANES)
col_sum_combine_kernel(float *__restrict__ out, const double *__restrict__ part, int64_t W,
                       int K) {
    __shared__ double groups[CS_LANES][CS_TX];
    const int tx = threadIdx.x, g = threadIdx.y;
    const int64_t c = (int64_t)blockIdx.x * CS_TX + tx;
    double t = 0.0;
    if (c < W)
        for (int k = g; k < K; k += CS_LANES) t = t + part[(int64_t)k * W + c];
    groups[g][tx] = t;
    __syncthreads();
    lane8_tree<CS_TX>(groups);
    if (g == 0 && c < W) out[c] = (float)((double)out[c] + groups[0][tx]);
}

template <int MODE>
static void col_sum_partial_launch(cudaStream_t s, bool vec, int64_t K, double *part,
                                   const float *a, const float *b, const float *sc, int64_t ld,
                                   int N, int64_t W, int64_t rc) {
    const dim3 block(CS_TX, CS_LANES);
    if (vec) {
        const dim3 grid((unsigned)((W + 4 * CS_TX - 1) / (4 * CS_TX)), (unsigned)K);
        col_sum_partial_kernel<MODE, 4, 2><<<grid, block, 0, s>>>(part, a, b, sc, ld, N, W, rc);
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

cudaError_t kiln_cuda_rmsnorm_backward_fast(cudaStream_t s, float *dx, float *dw,
                                            const float *dy, const float *x, const float *w,
                                            int N, int C, float eps, float *rstd,
                                            bool accumulate_dx, double *scratch,
                                            size_t scratch_len) {
    if (N <= 0 || C <= 0) return cudaSuccess;
    const bool want_dw = dw && w;
    if (want_dw && (!scratch || scratch_len < kiln_cuda_col_sum_fast_scratch_len(N, C)))
        return cudaErrorInvalidValue; /* refused before anything is enqueued */
    cudaError_t e = kiln_cuda_rmsnorm_backward(s, dx, NULL, dy, x, w, N, C, eps, rstd,
                                               accumulate_dx);
    if (e != cudaSuccess || !want_dw) return e;
    /* dw[c] += sum over n of dy[n,c] * f32(x[n,c] * rstd[n]) */
    return kiln_cuda_col_sum_fast(s, dw, dy, x, rstd, C, N, C, scratch, scratch_len);
}

/* Leading dimension of a bf16 copy: cols rounded up to 8 elements (16 bytes), so every row
 * starts 16-byte aligned (what the tensor-core kernels' vector loads want; the padding is
 * never read: k stops at cols). The GEMM module pads its own copies the same way. */
static int64_t padded_ld(int64_t cols) { return (cols + 7) & ~(int64_t)7; }

/* Bytes of a (rows x ld) bf16 matrix rounded up to 256 (the next region's alignment); false
 * past 2^46 elements (no buffer anyone allocates; keeps every later sum far from overflow). */
static bool region_bytes(int64_t rows, int64_t ld, size_t *out) {
    const int64_t limit = (int64_t)1 << 46;
    if (rows < 0 || ld < 0 || (rows > 0 && ld > limit / rows)) return false;
    *out = ((size_t)(rows * ld) * 2u + 255u) & ~(size_t)255u;
    return true;
}

/* Whether a bf16 W is read in place: its rows start 16-byte aligned (the GEMM module's rule
 * for the forward, bf16_in_place in cuda_gemm_fast.cu). Otherwise it is copied, exactly
 * (bf16 -> f32 -> bf16 is the identity), into the buffer with padded rows. */
static bool bf16_in_place(kiln_dtype dt, const uint8_t *w, size_t row_bytes) {
    return dt == KILN_DTYPE_BF16 && ((uintptr_t)w & 15u) == 0 && row_bytes % 16 == 0;
}

/* The bf16 operands in buf (256-byte aligned): dyb(N, ldR) at 0, xb(N, ldC) at x_off (when dW),
 * W's copy (R, ldC) at w_off (when dx and W is not read in place); then the two products.
 * Arguments already checked; N, R, C >= 1. */
static cudaError_t run_products(kiln_cuda_gemm *g, cudaStream_t s, uint8_t *buf, size_t x_off,
                                size_t w_off, float *dx, float *dW, const float *dy,
                                const float *x, const uint8_t *w, size_t row_bytes, kiln_dtype dt,
                                int64_t R, int64_t C, int N, bool accumulate_dx) {
    const int64_t ldR = padded_ld(R), ldC = padded_ld(C);
    uint16_t *dyb = (uint16_t *)buf;
    cudaError_t e = kiln_cuda_f32_to_bf16(s, dyb, ldR, dy, R, N, R);
    if (e != cudaSuccess) return e;
    if (dx) { /* dx(N,C) (+)= dy(N,R) @ W(R,C): M = N, N = C, K = R */
        const uint16_t *wb;
        int64_t ldw;
        if (bf16_in_place(dt, w, row_bytes)) {
            wb = (const uint16_t *)w;
            ldw = (int64_t)(row_bytes / 2);
        } else {
            uint16_t *dst = (uint16_t *)(buf + w_off);
            e = kiln_cuda_weights_to_bf16(s, dst, ldC, w, row_bytes, dt, R, C);
            if (e != cudaSuccess) return e;
            wb = dst;
            ldw = ldC;
        }
        e = kiln_cuda_gemm_bf16(g, s, 0, 0, N, C, R, dyb, ldR, wb, ldw, dx, C,
                                accumulate_dx ? 1 : 0);
        if (e != cudaSuccess) return e;
    }
    if (dW) { /* dW(R,C) += dy^T(R,N) @ x(N,C): A = dy stored (N,R), trans_a; K = N */
        uint16_t *xb = (uint16_t *)(buf + x_off);
        e = kiln_cuda_f32_to_bf16(s, xb, ldC, x, C, N, C);
        if (e != cudaSuccess) return e;
        e = kiln_cuda_gemm_bf16(g, s, 1, 0, R, C, N, dyb, ldR, xb, ldC, dW, C, 1);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

cudaError_t kiln_cuda_matmul_backward_fast(kiln_cuda_gemm *g, cudaStream_t s, float *dx,
                                           float *dW, float *dbias, const float *dy,
                                           const float *x, const uint8_t *w, size_t row_bytes,
                                           kiln_dtype dt, int64_t R, int64_t C, int N,
                                           bool accumulate_dx) {
    if (!g) return cudaErrorInvalidValue;
    if (N <= 0 || R <= 0 || C <= 0) return cudaSuccess;
    if (!kiln_cuda_backward_dtype_supported(dt)) return cudaErrorInvalidValue;
    if (!dx && !dW && !dbias) return cudaSuccess;
    if (!dy || (dx && !w) || (dW && !x)) return cudaErrorInvalidValue;
    const size_t es = dt == KILN_DTYPE_F32 ? 4u : 2u;
    if (dx && (row_bytes % es != 0 || row_bytes / es < (size_t)C || ((uintptr_t)w % es) != 0))
        return cudaErrorInvalidValue;

    /* the buffer: dyb, then xb (dW), then W's copy (dx, unless read in place), then the
     * column sum's partials (dbias) */
    const bool products = dx || dW;
    size_t dy_bytes = 0, x_bytes = 0, w_bytes = 0, part_bytes = 0, part_len = 0;
    if (products &&
        (!region_bytes(N, padded_ld(R), &dy_bytes) ||
         (dW && !region_bytes(N, padded_ld(C), &x_bytes)) ||
         (dx && !bf16_in_place(dt, w, row_bytes) && !region_bytes(R, padded_ld(C), &w_bytes))))
        return cudaErrorInvalidValue;
    if (dbias) {
        part_len = kiln_cuda_col_sum_fast_scratch_len(N, R);
        part_bytes = (part_len * sizeof(double) + 255u) & ~(size_t)255u;
    }
    const size_t total = dy_bytes + x_bytes + w_bytes + part_bytes + 256; /* + room to align */
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
    if (dbias) { /* dbias(R) += column sums of dy(N,R), kiln_cuda_col_sum_fast's order */
        double *part = (double *)(buf + dy_bytes + x_bytes + w_bytes);
        e = kiln_cuda_col_sum_fast(s, dbias, dy, NULL, NULL, R, N, R, part, part_len);
    }
    if (e == cudaSuccess && products)
        e = run_products(g, s, buf, dy_bytes, dy_bytes + x_bytes, dx, dW, dy, x, w, row_bytes,
                         dt, R, C, N, accumulate_dx);
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
