/*
 * cuda_linear_attn.cu -- Qwen3.5's ops on the GPU and their launchers (contracts:
 * cuda_linear_attn.h): the causal depthwise convolution, the Gated DeltaNet recurrence and their
 * backwards, the gates, the output gate, halves of rows, the partial rotary embedding.
 *
 * The CPU reference is src/ops/cpu/cpu_linear_attn.c (docs/ARITHMETIC.md, "Gated DeltaNet"):
 * every kernel here performs its IEEE binary32 operations in its order, in both modes of the
 * backend. Parallelism splits work across output elements, across the 16 lanes of the defined
 * dot product (each lane's fmaf chain runs in one thread in increasing index, then
 * kiln_lane16_reduce's tree: cuda_common.cuh lane16_tree), or across the (sequence, value head,
 * value column) chains of the recurrence, never along a sequential chain, so the bits cannot
 * depend on the launch shape. No atomics. Compiled with --fmad=false (every FMA is a written
 * fmaf), IEEE division and square root, no flush-to-zero.
 *
 * A state S is row-major as on the CPU (dk rows i, dv columns j: S[i * dv + j]). The recurrence
 * is independent per column j (S[:, j] needs only column j and the token's k, q), which is what
 * the forward kernel parallelises over; its backward walks groups of KILN_GDN_COLS columns (the
 * CPU's order: the sums over columns per group, then over groups), a block per (sequence, value
 * head, group) keeping the group's S, previous S and dS in shared memory (gdn_bwd_kernel).
 */
#include "cuda_linear_attn.h"

#include "cuda_common.cuh"

#include "../../base/kmath.h"

#include <cuda_pipeline.h>

/* =================================================================================================
 * The batch's runs, passed to the kernels by value.
 * ============================================================================================== */

/* Runs a launch takes (the run table travels as a kernel parameter: 1.3 KB, under the 4 KB a
 * parameter list may always hold). */
#define LA_RUNS_PER_LAUNCH 64

/* Runs [r0, r0 + n) of the caller's table; tile0[r]: the first block of run r when each run is
 * cut into tiles of a fixed token count (conv1d_silu), tile0[n] their total. */
struct la_runs {
    int n;
    int first[LA_RUNS_PER_LAUNCH], len[LA_RUNS_PER_LAUNCH], seq[LA_RUNS_PER_LAUNCH],
        pos0[LA_RUNS_PER_LAUNCH];
    int tile0[LA_RUNS_PER_LAUNCH + 1];
};

struct la_run {
    int first, n, seq, pos0;
};

/* Run r of the launch: the table's (given), else token r on its own at pos[r] of seq[r]
 * (ops.h: runs NULL inside a recorded decode graph). */
static __device__ __forceinline__ la_run la_run_at(const la_runs &R, const int32_t *seq,
                                                   const int32_t *pos, int given, int r) {
    la_run u;
    if (given) {
        u.first = R.first[r];
        u.n = R.len[r];
        u.seq = R.seq[r];
        u.pos0 = R.pos0[r];
    } else {
        u.first = r;
        u.n = 1;
        u.seq = seq[r];
        u.pos0 = pos[r];
    }
    return u;
}

/* Whether every run lies inside the batch's N tokens (what the kernels index with). */
static bool la_runs_valid(const kiln_batch_run *runs, int n_runs, int N) {
    if (n_runs < 0) return false;
    for (int r = 0; r < n_runs; r++)
        if (runs[r].first < 0 || runs[r].n < 0 || runs[r].first > N - runs[r].n) return false;
    return true;
}

/* R = runs [r0, r0 + n) (n <= LA_RUNS_PER_LAUNCH); tile > 0: tile0 counts tiles of `tile`
 * tokens. */
static void la_runs_fill(la_runs *R, const kiln_batch_run *runs, int r0, int n, int tile) {
    memset(R, 0, sizeof *R);
    R->n = n;
    int t = 0;
    for (int r = 0; r < n; r++) {
        const kiln_batch_run *u = &runs[r0 + r];
        R->first[r] = u->first;
        R->len[r] = u->n;
        R->seq[r] = u->seq;
        R->pos0[r] = u->pos0;
        R->tile0[r] = t;
        if (tile > 0) t += (u->n + tile - 1) / tile;
    }
    R->tile0[n] = t;
}

/* =================================================================================================
 * conv1d_silu.
 * ============================================================================================== */

#define CONV_THREADS 128 /* channels a block */
#define CONV_TILE 8      /* tokens a block (runs given) */

/* A thread per (channel, token): out = silu(acc), acc = fmaf(w[c,i], in_i, acc) for i
 * ascending over the window of the K inputs at positions p - K + 1 .. p (the run's own tokens,
 * before them the sequence's state when it has one and the run does not start at position 0,
 * else zeros), as conv_task. Every output reads the state as it was before the call (the state
 * is rewritten by conv_state_kernel, launched after). Block: a tile of CONV_TILE tokens of one
 * run (runs given) or one token (runs NULL) x CONV_THREADS channels (blockIdx.y). */
static __global__ void __launch_bounds__(CONV_THREADS)
    conv_fwd_kernel(float *__restrict__ out, const float *__restrict__ x,
                    const float *__restrict__ w, const float *__restrict__ state,
                    const int32_t *__restrict__ seq, const int32_t *__restrict__ pos,
                    const __grid_constant__ la_runs R, int given, int CH, int K) {
    int r, t_lo, t_hi;
    if (given) {
        r = 0;
        while (r + 1 < R.n && R.tile0[r + 1] <= (int)blockIdx.x)
            r++;
        t_lo = ((int)blockIdx.x - R.tile0[r]) * CONV_TILE;
        t_hi = min(t_lo + CONV_TILE, R.len[r]);
    } else {
        r = (int)blockIdx.x;
        t_lo = 0;
        t_hi = 1;
    }
    const int64_t c = (int64_t)blockIdx.y * CONV_THREADS + threadIdx.x;
    if (c >= CH) return;
    const la_run run = la_run_at(R, seq, pos, given, r);
    const float *st = state && run.seq >= 0 && run.pos0 > 0
                          ? state + (size_t)run.seq * (size_t)(K - 1) * (size_t)CH
                          : nullptr;
    const float *wc = w + c * K;
    for (int t = t_lo; t < t_hi; t++) {
        float acc = 0.0f;
        for (int i = 0; i < K; i++) {
            const int q = t - K + 1 + i; /* the input's offset from the run's first token */
            const float v = q >= 0 ? x[(size_t)(run.first + q) * (size_t)CH + c]
                            : st   ? st[(size_t)(K - 1 + q) * (size_t)CH + c]
                                   : 0.0f;
            acc = fmaf(wc[i], v, acc);
        }
        out[(size_t)(run.first + t) * (size_t)CH + c] = kiln_silu(acc);
    }
}

/* A thread per (run, channel) of a sequence with a state: row r of the state becomes the
 * input at offset n - K + 1 + r from the run's first token (the run's, or the old state's row
 * r + n, or zero at a run from position 0): what conv_task's window holds after the run. Rows
 * in increasing r read the old row r + n > r before it is rewritten. */
static __global__ void __launch_bounds__(CONV_THREADS)
    conv_state_kernel(float *__restrict__ state, const float *__restrict__ x,
                      const int32_t *__restrict__ seq, const int32_t *__restrict__ pos,
                      const __grid_constant__ la_runs R, int given, int CH, int K) {
    const int64_t c = (int64_t)blockIdx.y * CONV_THREADS + threadIdx.x;
    if (c >= CH) return;
    const la_run run = la_run_at(R, seq, pos, given, (int)blockIdx.x);
    if (run.seq < 0) return;
    float *st = state + (size_t)run.seq * (size_t)(K - 1) * (size_t)CH;
    for (int r = 0; r < K - 1; r++) {
        const int q = run.n - K + 1 + r;
        st[(size_t)r * CH + c] = q >= 0         ? x[(size_t)(run.first + q) * (size_t)CH + c]
                                 : run.pos0 > 0 ? st[(size_t)(r + run.n) * CH + c]
                                                : 0.0f;
    }
}

cudaError_t kiln_cuda_conv1d_silu(cudaStream_t s, float *out, const float *x, const float *w,
                                  float *state, const int32_t *seq, const int32_t *pos,
                                  const kiln_batch_run *runs, int n_runs, int N, int CH, int K) {
    if (N <= 0 || CH <= 0) return cudaSuccess;
    if (K < 1 || K > KILN_CUDA_CONV_MAX_K || (!runs && (!seq || !pos)) ||
        (runs && !la_runs_valid(runs, n_runs, N)))
        return cudaErrorInvalidValue;
    const unsigned cy = (unsigned)((CH + CONV_THREADS - 1) / CONV_THREADS);
    if (cy > 65535u) return cudaErrorInvalidConfiguration;
    la_runs R;
    if (!runs) {
        memset(&R, 0, sizeof R);
        conv_fwd_kernel<<<dim3((unsigned)N, cy), CONV_THREADS, 0, s>>>(out, x, w, state, seq, pos,
                                                                       R, 0, CH, K);
        if (state && K > 1)
            conv_state_kernel<<<dim3((unsigned)N, cy), CONV_THREADS, 0, s>>>(state, x, seq, pos, R,
                                                                             0, CH, K);
        return cudaGetLastError();
    }
    for (int r0 = 0; r0 < n_runs; r0 += LA_RUNS_PER_LAUNCH) {
        const int n = n_runs - r0 < LA_RUNS_PER_LAUNCH ? n_runs - r0 : LA_RUNS_PER_LAUNCH;
        la_runs_fill(&R, runs, r0, n, CONV_TILE);
        if (R.tile0[n] > 0)
            conv_fwd_kernel<<<dim3((unsigned)R.tile0[n], cy), CONV_THREADS, 0, s>>>(
                out, x, w, state, seq, pos, R, 1, CH, K);
        if (state && K > 1)
            conv_state_kernel<<<dim3((unsigned)n, cy), CONV_THREADS, 0, s>>>(state, x, seq, pos, R,
                                                                             1, CH, K);
        const cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

/* =================================================================================================
 * The Gated DeltaNet recurrence (forward).
 * ============================================================================================== */

#define GDN_COLS 16     /* value columns a block of the forward owns */
#define GDN_TILE 8      /* tokens whose q, k norms, gates and v a block stages at once */
#define GDN_THREADS 256 /* GDN_COLS columns x 16 lanes */

/* q or k (which) of token row `row` for key head kh, normalised into dst[0..dk) by one
 * half-warp, lane l taking i = l, l + 16, ...: r = 1 / sqrtf(dot(x, x) + 1e-6f) with the
 * lane-16 dot (its lanes are exactly the half-warp's), then q: (x r) scale, k: x r (gdn_qk). */
static __device__ __forceinline__ void gdn_norm_half(float *dst, const float *__restrict__ xv,
                                                     int dk, int which, float scale, int l,
                                                     unsigned mask) {
    float acc = 0.0f;
    for (int i = l; i < dk; i += 16)
        acc = fmaf(xv[i], xv[i], acc);
    const float r = 1.0f / sqrtf(lane16_tree(acc, mask) + 1e-6f);
    for (int i = l; i < dk; i += 16)
        dst[i] = which ? xv[i] * r : (xv[i] * r) * scale;
}

/* One block per (run, value head blockIdx.y, group of GDN_COLS columns blockIdx.z); thread
 * (column j, lane l) keeps S[i][j] for i = l + 16 m (R >= dk / 16 rows) in registers. Per token,
 * as gdn_step: S = a S and u_j = lane-16 over i of S[i][j] kn[i] (lane l's chain is this
 * thread's rows in increasing i; the half-warp's tree is kiln_lane16_reduce's), d = b (v - u),
 * S[i][j] = fmaf(kn[i], d, S[i][j]), o_j = the same dot with qn. The q, k norms, exp(g), beta
 * and v of GDN_TILE tokens are staged in shared memory first (a half-warp per norm), so the
 * token loop reads only registers and shared memory. */
template <int R>
static __global__ void __launch_bounds__(GDN_THREADS, 1)
    gdn_fwd_kernel(float *__restrict__ out, const float *__restrict__ qkv,
                   const float *__restrict__ g, const float *__restrict__ beta, float *state,
                   const int32_t *__restrict__ seq, const int32_t *__restrict__ pos,
                   const __grid_constant__ la_runs RU, int given, int nk, int nv, int dk, int dv,
                   float scale) {
    extern __shared__ float sm[];
    float *sq = sm;                       /* [GDN_TILE][dk] qn */
    float *sk = sq + GDN_TILE * dk;       /* [GDN_TILE][dk] kn */
    float *sv = sk + GDN_TILE * dk;       /* [GDN_TILE][GDN_COLS] v */
    float *sa = sv + GDN_TILE * GDN_COLS; /* [GDN_TILE] exp(g) */
    float *sb = sa + GDN_TILE;            /* [GDN_TILE] beta */
    const int h = (int)blockIdx.y, kh = h / (nv / nk);
    const int l = threadIdx.x & 15, hw = threadIdx.x >> 4;
    const int j = (int)blockIdx.z * GDN_COLS + hw;
    const unsigned mask = half_warp_mask();
    const la_run run = la_run_at(RU, seq, pos, given, (int)blockIdx.x);
    const size_t W = 2 * (size_t)nk * dk + (size_t)nv * dv, SN = (size_t)dk * dv;
    float *st = state && run.seq >= 0 ? state + ((size_t)run.seq * nv + h) * SN : nullptr;
    const bool from_state = st && run.pos0 != 0;
    float S[R];
#pragma unroll
    for (int m = 0; m < R; m++) {
        const int i = l + 16 * m;
        S[m] = from_state && j < dv && i < dk ? st[(size_t)i * dv + j] : 0.0f;
    }
    for (int t0 = 0; t0 < run.n; t0 += GDN_TILE) {
        __syncthreads(); /* the previous tile's staging has been read */
        {
            const int tt = hw >> 1, which = hw & 1;
            if (t0 + tt < run.n) { /* uniform in the half-warp */
                const size_t row = (size_t)run.first + t0 + tt;
                gdn_norm_half((which ? sk : sq) + tt * dk,
                              qkv + row * W + (size_t)which * nk * dk + (size_t)kh * dk, dk, which,
                              scale, l, mask);
            }
        }
        if (threadIdx.x < GDN_TILE * GDN_COLS) {
            const int tt = threadIdx.x / GDN_COLS,
                      jc = (int)blockIdx.z * GDN_COLS + threadIdx.x % GDN_COLS;
            const size_t row = (size_t)run.first + t0 + tt;
            sv[threadIdx.x] = t0 + tt < run.n && jc < dv
                                  ? qkv[row * W + 2 * (size_t)nk * dk + (size_t)h * dv + jc]
                                  : 0.0f;
        } else if (threadIdx.x < GDN_TILE * GDN_COLS + GDN_TILE) {
            const int tt = threadIdx.x - GDN_TILE * GDN_COLS;
            if (t0 + tt < run.n) {
                const size_t gi = ((size_t)run.first + t0 + tt) * nv + h;
                sa[tt] = kiln_expf(g[gi]);
                sb[tt] = beta[gi];
            }
        }
        __syncthreads();
        const int tn = min(GDN_TILE, run.n - t0);
        for (int tt = 0; tt < tn; tt++) {
            const float a = sa[tt], b = sb[tt];
            const float *kn = sk + tt * dk, *qn = sq + tt * dk;
            float acc = 0.0f;
#pragma unroll
            for (int m = 0; m < R; m++) {
                const int i = l + 16 * m;
                if (i < dk) {
                    S[m] = S[m] * a;
                    acc = fmaf(S[m], kn[i], acc);
                }
            }
            const float u = lane16_tree(acc, mask);
            const float d = b * (sv[tt * GDN_COLS + hw] - u);
            acc = 0.0f;
#pragma unroll
            for (int m = 0; m < R; m++) {
                const int i = l + 16 * m;
                if (i < dk) {
                    S[m] = fmaf(kn[i], d, S[m]);
                    acc = fmaf(S[m], qn[i], acc);
                }
            }
            const float o = lane16_tree(acc, mask);
            if (l == 0 && j < dv)
                out[((size_t)run.first + t0 + tt) * nv * dv + (size_t)h * dv + j] = o;
        }
    }
    if (st && j < dv) {
#pragma unroll
        for (int m = 0; m < R; m++) {
            const int i = l + 16 * m;
            if (i < dk) st[(size_t)i * dv + j] = S[m];
        }
    }
}

template <int R>
static void gdn_fwd_launch(cudaStream_t s, dim3 grid, float *out, const float *qkv, const float *g,
                           const float *beta, float *state, const int32_t *seq, const int32_t *pos,
                           const la_runs &RU, int given, int nk, int nv, int dk, int dv,
                           float scale) {
    const size_t smem =
        ((size_t)2 * GDN_TILE * dk + GDN_TILE * GDN_COLS + 2 * GDN_TILE) * sizeof(float);
    gdn_fwd_kernel<R><<<grid, GDN_THREADS, smem, s>>>(out, qkv, g, beta, state, seq, pos, RU, given,
                                                      nk, nv, dk, dv, scale);
}

/* Shapes the Gated DeltaNet launchers take (ops.h's and the CPU reference's limits). */
static bool gdn_shape_ok(int nk, int nv, int dk, int dv) {
    return nk > 0 && nv > 0 && nv % nk == 0 && dk > 0 && dv > 0 && dk <= KILN_CUDA_GDN_MAX_HEAD &&
           dv <= KILN_CUDA_GDN_MAX_HEAD;
}

cudaError_t kiln_cuda_gated_delta(cudaStream_t s, float *out, const float *qkv, const float *g,
                                  const float *beta, float *state, const int32_t *seq,
                                  const int32_t *pos, const kiln_batch_run *runs, int n_runs, int N,
                                  int nk, int nv, int dk, int dv, float scale) {
    if (N <= 0) return cudaSuccess;
    if (!gdn_shape_ok(nk, nv, dk, dv) || (!runs && (!seq || !pos)) ||
        (runs && !la_runs_valid(runs, n_runs, N)))
        return cudaErrorInvalidValue;
    if (nv > 65535) return cudaErrorInvalidConfiguration;
    const unsigned cz = (unsigned)((dv + GDN_COLS - 1) / GDN_COLS);
    const int rows = (dk + 15) / 16;
    la_runs R;
    for (int r0 = 0; r0 < (runs ? n_runs : 1); r0 += LA_RUNS_PER_LAUNCH) {
        int nb;
        if (runs) {
            nb = n_runs - r0 < LA_RUNS_PER_LAUNCH ? n_runs - r0 : LA_RUNS_PER_LAUNCH;
            la_runs_fill(&R, runs, r0, nb, 0);
        } else {
            memset(&R, 0, sizeof R);
            nb = N;
        }
        const dim3 grid((unsigned)nb, (unsigned)nv, cz);
        const int given = runs ? 1 : 0;
        if (rows <= 1)
            gdn_fwd_launch<1>(s, grid, out, qkv, g, beta, state, seq, pos, R, given, nk, nv, dk, dv,
                              scale);
        else if (rows <= 2)
            gdn_fwd_launch<2>(s, grid, out, qkv, g, beta, state, seq, pos, R, given, nk, nv, dk, dv,
                              scale);
        else if (rows <= 4)
            gdn_fwd_launch<4>(s, grid, out, qkv, g, beta, state, seq, pos, R, given, nk, nv, dk, dv,
                              scale);
        else if (rows <= 8)
            gdn_fwd_launch<8>(s, grid, out, qkv, g, beta, state, seq, pos, R, given, nk, nv, dk, dv,
                              scale);
        else if (rows <= 16)
            gdn_fwd_launch<16>(s, grid, out, qkv, g, beta, state, seq, pos, R, given, nk, nv, dk,
                               dv, scale);
        else
            gdn_fwd_launch<32>(s, grid, out, qkv, g, beta, state, seq, pos, R, given, nk, nv, dk,
                               dv, scale);
        const cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

/* =================================================================================================
 * Gates, output gate, halves, partial RoPE (element-wise).
 * ============================================================================================== */

static __global__ void gdn_gates_kernel(float *g, float *beta, const float *a, const float *b,
                                        const float *__restrict__ A_log,
                                        const float *__restrict__ dt_bias, int nv, size_t n) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (size_t)gridDim.x * blockDim.x) {
        const int h = (int)(u % (size_t)nv);
        float gv, bv;
        kiln_gdn_gates(a[u], b[u], A_log[h], dt_bias[h], &gv, &bv);
        g[u] = gv;
        beta[u] = bv;
    }
}

cudaError_t kiln_cuda_gdn_gates(cudaStream_t s, float *g, float *beta, const float *a,
                                const float *b, const float *A_log, const float *dt_bias, int N,
                                int nv) {
    if (N <= 0 || nv <= 0) return cudaSuccess;
    const size_t n = (size_t)N * (size_t)nv;
    gdn_gates_kernel<<<grid_for((int64_t)n, 256), 256, 0, s>>>(g, beta, a, b, A_log, dt_bias, nv,
                                                               n);
    return cudaGetLastError();
}

static __global__ void sigmoid_mul_kernel(float *out, const float *x, const float *gate, size_t n) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (size_t)gridDim.x * blockDim.x)
        out[u] = x[u] * kiln_sigmoid(gate[u]);
}

cudaError_t kiln_cuda_sigmoid_mul(cudaStream_t s, float *out, const float *x, const float *gate,
                                  size_t n) {
    if (n == 0) return cudaSuccess;
    sigmoid_mul_kernel<<<grid_for((int64_t)n, 256), 256, 0, s>>>(out, x, gate, n);
    return cudaGetLastError();
}

/* s = sigmoid(gate): dx = dout s; dgate = (dout x) (s (1 - s)) (kiln_cpu_sigmoid_mul_backward);
 * every input read before either output is written (they may alias dout). */
static __global__ void sigmoid_mul_bwd_kernel(float *dx, float *dgate, const float *dout,
                                              const float *x, const float *gate, size_t n) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (size_t)gridDim.x * blockDim.x) {
        const float sg = kiln_sigmoid(gate[u]), d = dout[u], xv = x[u];
        dx[u] = d * sg;
        dgate[u] = (d * xv) * (sg * (1.0f - sg));
    }
}

cudaError_t kiln_cuda_sigmoid_mul_backward(cudaStream_t s, float *dx, float *dgate,
                                           const float *dout, const float *x, const float *gate,
                                           size_t n) {
    if (n == 0) return cudaSuccess;
    sigmoid_mul_bwd_kernel<<<grid_for((int64_t)n, 256), 256, 0, s>>>(dx, dgate, dout, x, gate, n);
    return cudaGetLastError();
}

/* A thread per element of x(rows, 2n): to a or b (split), from them (join). */
static __global__ void halves_kernel(float *__restrict__ x, float *__restrict__ a,
                                     float *__restrict__ b, int64_t n, int64_t total, int join) {
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = u / (2 * n), k = u - r * 2 * n;
        float *h = k < n ? a + r * n + k : b + r * n + (k - n);
        if (join)
            x[u] = *h;
        else
            *h = x[u];
    }
}

cudaError_t kiln_cuda_split_halves(cudaStream_t s, float *a, float *b, const float *x, int64_t rows,
                                   int n) {
    const int64_t total = rows * 2 * (int64_t)n;
    if (rows <= 0 || n <= 0) return cudaSuccess;
    halves_kernel<<<grid_for(total, 256), 256, 0, s>>>(const_cast<float *>(x), a, b, n, total, 0);
    return cudaGetLastError();
}

cudaError_t kiln_cuda_join_halves(cudaStream_t s, float *x, const float *a, const float *b,
                                  int64_t rows, int n) {
    const int64_t total = rows * 2 * (int64_t)n;
    if (rows <= 0 || n <= 0) return cudaSuccess;
    halves_kernel<<<grid_for(total, 256), 256, 0, s>>>(x, const_cast<float *>(a),
                                                       const_cast<float *>(b), n, total, 1);
    return cudaGetLastError();
}

/* A thread per rotated pair (i, i + rot/2), i < rot/2, of each head: rope_kernel's pair
 * (kiln_rope_pair) or rope_bwd_kernel's transpose, tables (positions, rot/2). */
static __global__ void rope_partial_kernel(float *x, const int32_t *__restrict__ pos, int H, int HS,
                                           int half, const float *__restrict__ cos_tab,
                                           const float *__restrict__ sin_tab, int64_t total,
                                           int transpose) {
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (int64_t)gridDim.x * blockDim.x) {
        const int64_t nh = u / half; /* token * H + head */
        const int i = (int)(u - nh * half);
        const int64_t n = nh / H;
        float *v = x + nh * HS;
        const float c = cos_tab[(int64_t)pos[n] * half + i];
        const float sn = sin_tab[(int64_t)pos[n] * half + i];
        const float a = v[i], b = v[i + half];
        if (transpose) {
            v[i] = a * c + b * sn;
            v[i + half] = b * c - a * sn;
        } else {
            const float2 r = kiln_rope_pair(a, b, c, sn);
            v[i] = r.x;
            v[i + half] = r.y;
        }
    }
}

cudaError_t kiln_cuda_rope_partial(cudaStream_t s, float *x, const int32_t *pos, int N, int H,
                                   int HS, int rot, const float *cos_tab, const float *sin_tab,
                                   int transpose) {
    if (N <= 0 || H <= 0 || rot == 0) return cudaSuccess;
    if (rot < 0 || rot % 2 || rot > HS) return cudaErrorInvalidValue;
    const int half = rot / 2;
    const int64_t total = (int64_t)N * H * half;
    rope_partial_kernel<<<grid_for(total, 256), 256, 0, s>>>(x, pos, H, HS, half, cos_tab, sin_tab,
                                                             total, transpose);
    return cudaGetLastError();
}

/* =================================================================================================
 * conv1d_silu backward.
 * ============================================================================================== */

#define CONV_SEG 16   /* tokens of dx a thread writes */
#define CONV_DW_CH 32 /* channels a block of the dw kernel (x 16 lanes) */

/* dpre of token t of the sequence at rows `base`: pre recomputed as the forward does (fmaf over
 * the window, zeros before the sequence), silu'(pre) = s (1 + pre (1 - s)), s = 1 / (1 +
 * kiln_expf(-pre)), times dout (conv_bwd_task). */
static __device__ __forceinline__ float conv_dpre(const float *__restrict__ dout,
                                                  const float *__restrict__ x,
                                                  const float *__restrict__ wc, size_t base, int t,
                                                  int64_t c, int CH, int K) {
    float pre = 0.0f;
    for (int i = 0; i < K; i++) {
        const int q = t - K + 1 + i;
        pre = fmaf(wc[i], q < 0 ? 0.0f : x[(base + (size_t)q) * (size_t)CH + c], pre);
    }
    const float e = kiln_expf(-pre), den = 1.0f + e, s = 1.0f / den;
    return dout[(base + (size_t)t) * (size_t)CH + c] * (s * (1.0f + pre * (1.0f - s)));
}

/* A thread per (channel, CONV_SEG tokens of one sequence): the dpre of its tokens and the K - 1
 * after them (within the sequence) into its own column of shared memory, then dx[tx] = the
 * fmaf chain over the outputs tx .. tx + K - 1 that read it (i descending: w[c,i] meets output
 * tx + K - 1 - i), those past the sequence skipped, as conv_bwd_task. blockIdx.x: (sequence,
 * segment); blockIdx.y: channels. */
static __global__ void __launch_bounds__(CONV_THREADS)
    conv_bwd_dx_kernel(float *__restrict__ dx, const float *__restrict__ dout,
                       const float *__restrict__ x, const float *__restrict__ w, int T, int CH,
                       int K, int nseg) {
    extern __shared__ float dpb[]; /* [CONV_SEG + K - 1][CONV_THREADS] */
    const int64_t c = (int64_t)blockIdx.y * CONV_THREADS + threadIdx.x;
    if (c >= CH) return;
    const int b = (int)blockIdx.x / nseg, ts = ((int)blockIdx.x % nseg) * CONV_SEG;
    const int te = min(ts + CONV_SEG, T), tend = min(te + K - 1, T);
    const float *wc = w + c * K;
    const size_t base = (size_t)b * T;
    for (int t = ts; t < tend; t++)
        dpb[(t - ts) * CONV_THREADS + threadIdx.x] = conv_dpre(dout, x, wc, base, t, c, CH, K);
    for (int tx = ts; tx < te; tx++) {
        float s = 0.0f;
        for (int i = K - 1; i >= 0; i--) {
            const int to = tx + K - 1 - i;
            if (to < T) s = fmaf(dpb[(to - ts) * CONV_THREADS + threadIdx.x], wc[i], s);
        }
        dx[(base + (size_t)tx) * (size_t)CH + c] = s;
    }
}

/* dw[c,i] += lane-16 over all n_seq T tokens (sequence by sequence, t ascending) of dpre(t)
 * in(t - K + 1 + i): thread (channel, lane) runs lane `lane`'s chains (tokens n = lane, lane +
 * 16, ...) for every i, dpre recomputed; then the 16 lanes of each (c, i) meet in shared memory
 * for kiln_lane16_reduce and the add. KMAX >= K (the arrays stay in registers). */
template <int KMAX>
static __global__ void __launch_bounds__(CONV_DW_CH * 16)
    conv_bwd_dw_kernel(float *__restrict__ dw, const float *__restrict__ dout,
                       const float *__restrict__ x, const float *__restrict__ w, int n_seq, int T,
                       int CH, int K) {
    __shared__ float red[16][CONV_DW_CH];
    const int cl = threadIdx.x % CONV_DW_CH, lane = threadIdx.x / CONV_DW_CH;
    const int64_t c = (int64_t)blockIdx.x * CONV_DW_CH + cl;
    const bool ok = c < CH;
    float acc[KMAX], wc[KMAX];
#pragma unroll
    for (int i = 0; i < KMAX; i++) {
        acc[i] = 0.0f;
        wc[i] = ok && i < K ? w[c * K + i] : 0.0f;
    }
    if (ok) {
        const int64_t N = (int64_t)n_seq * T;
        int b = lane / T, t = lane % T;
        for (int64_t n = lane; n < N; n += 16) {
            const size_t base = (size_t)b * T;
            float in[KMAX], pre = 0.0f;
#pragma unroll
            for (int i = 0; i < KMAX; i++) {
                if (i < K) {
                    const int q = t - K + 1 + i;
                    in[i] = q < 0 ? 0.0f : x[(base + (size_t)q) * (size_t)CH + c];
                    pre = fmaf(wc[i], in[i], pre);
                }
            }
            const float e = kiln_expf(-pre), den = 1.0f + e, s = 1.0f / den;
            const float dp = dout[(size_t)n * (size_t)CH + c] * (s * (1.0f + pre * (1.0f - s)));
#pragma unroll
            for (int i = 0; i < KMAX; i++)
                if (i < K) acc[i] = fmaf(dp, in[i], acc[i]);
            t += 16;
            while (t >= T) {
                t -= T;
                b++;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < KMAX; i++) {
        if (i < K) {
            red[lane][cl] = acc[i];
            __syncthreads();
            if (lane == 0 && ok) {
                float l16[KILN_DOT_LANES];
                for (int q = 0; q < KILN_DOT_LANES; q++)
                    l16[q] = red[q][cl];
                dw[c * K + i] = dw[c * K + i] + kiln_lane16_reduce(l16);
            }
            __syncthreads();
        }
    }
}

cudaError_t kiln_cuda_conv1d_silu_backward(cudaStream_t s, float *dx, float *dw, const float *dout,
                                           const float *x, const float *w, int n_seq, int T, int CH,
                                           int K) {
    if (n_seq <= 0 || T <= 0 || CH <= 0) return cudaSuccess;
    if (K < 1 || K > KILN_CUDA_CONV_MAX_K) return cudaErrorInvalidValue;
    const int nseg = (T + CONV_SEG - 1) / CONV_SEG;
    const unsigned cy = (unsigned)((CH + CONV_THREADS - 1) / CONV_THREADS);
    if ((int64_t)n_seq * nseg > 0x7fffffff || cy > 65535u) return cudaErrorInvalidConfiguration;
    const size_t smem = (size_t)(CONV_SEG + K - 1) * CONV_THREADS * sizeof(float);
    conv_bwd_dx_kernel<<<dim3((unsigned)(n_seq * nseg), cy), CONV_THREADS, smem, s>>>(
        dx, dout, x, w, T, CH, K, nseg);
    if (dw) {
        const unsigned gx = (unsigned)((CH + CONV_DW_CH - 1) / CONV_DW_CH);
        const int thr = CONV_DW_CH * 16;
        if (K <= 4)
            conv_bwd_dw_kernel<4><<<gx, thr, 0, s>>>(dw, dout, x, w, n_seq, T, CH, K);
        else if (K <= 8)
            conv_bwd_dw_kernel<8><<<gx, thr, 0, s>>>(dw, dout, x, w, n_seq, T, CH, K);
        else if (K <= 16)
            conv_bwd_dw_kernel<16><<<gx, thr, 0, s>>>(dw, dout, x, w, n_seq, T, CH, K);
        else if (K <= 32)
            conv_bwd_dw_kernel<32><<<gx, thr, 0, s>>>(dw, dout, x, w, n_seq, T, CH, K);
        else
            conv_bwd_dw_kernel<64><<<gx, thr, 0, s>>>(dw, dout, x, w, n_seq, T, CH, K);
    }
    return cudaGetLastError();
}

/* =================================================================================================
 * gdn_gates backward.
 * ============================================================================================== */

#define GATES_BWD_THREADS 256

/* One block per value head h: da, db (and dA_log's term) of GATES_BWD_THREADS tokens at a time,
 * a thread each (kiln_gdn_gates_backward), the terms through shared memory; then threads 0..15
 * (dA_log's lanes) and 16..31 (dt_bias's, whose terms are da) add them in token order, lane
 * n % 16 each, as the CPU's sequential loop; the half-warps' trees finish the sums. */
static __global__ void __launch_bounds__(GATES_BWD_THREADS)
    gdn_gates_bwd_kernel(float *da, float *db, float *dA_log, float *ddt_bias, const float *dg,
                         const float *dbeta, const float *a, const float *b,
                         const float *__restrict__ A_log, const float *__restrict__ dt_bias, int N,
                         int nv) {
    __shared__ float sA[GATES_BWD_THREADS], sT[GATES_BWD_THREADS];
    const int h = (int)blockIdx.x, tid = threadIdx.x;
    const float Al = A_log[h], dtb = dt_bias[h];
    float acc = 0.0f;
    for (int base = 0; base < N; base += GATES_BWD_THREADS) {
        const int n = base + tid;
        if (n < N) {
            const size_t i = (size_t)n * nv + h;
            float dav, dbv, dA;
            kiln_gdn_gates_backward(a[i], b[i], Al, dtb, dg[i], dbeta[i], &dav, &dbv, &dA);
            da[i] = dav;
            db[i] = dbv;
            sA[tid] = dA;
            sT[tid] = dav;
        }
        __syncthreads();
        if (tid < 32) {
            const float *src = tid < 16 ? sA : sT;
            const int cnt = min(GATES_BWD_THREADS, N - base);
            for (int k = tid & 15; k < cnt; k += 16)
                acc = acc + src[k];
        }
        __syncthreads();
    }
    if (tid < 32) {
        const float r = lane16_tree(acc, half_warp_mask());
        if (tid == 0 && dA_log) dA_log[h] = dA_log[h] + r;
        if (tid == 16 && ddt_bias) ddt_bias[h] = ddt_bias[h] + r;
    }
}

cudaError_t kiln_cuda_gdn_gates_backward(cudaStream_t s, float *da, float *db, float *dA_log,
                                         float *ddt_bias, const float *dg, const float *dbeta,
                                         const float *a, const float *b, const float *A_log,
                                         const float *dt_bias, int N, int nv) {
    if (N <= 0 || nv <= 0) return cudaSuccess;
    gdn_gates_bwd_kernel<<<nv, GATES_BWD_THREADS, 0, s>>>(da, db, dA_log, ddt_bias, dg, dbeta, a, b,
                                                          A_log, dt_bias, N, nv);
    return cudaGetLastError();
}

/* =================================================================================================
 * The Gated DeltaNet recurrence backward.
 *
 * Four kernels, as kiln_cpu_gated_delta_backward's tasks:
 *   1. gdn_bwd_norm_kernel: every (token, value head)'s normalised q and k into the ws regions
 *      that end up holding their gradients (dqn, dkn: (N, nv, dk) each), a half-warp a vector.
 *   2. gdn_bwd_kernel: one block per (sequence, value head, group of KILN_GDN_COLS value
 *      columns), gdn_bwd_task's walk of the group's columns (below); the group's partial sums
 *      per token to the ws (pq, pk, pbeta, pa: (N, nv, G, 2 dk + 2), the CPU's layout).
 *   3. gdn_bwd_sum_kernel: per (token, value head) the groups' partials added in group order
 *      (gdn_bwd_sum_task): dqn, dkn over the normalised q, k (read by 2 only), dbeta, dg.
 *   4. gdn_bwd_qk_kernel: per (token, key head, q or k) the group's gradients summed in head
 *      order and taken through the scale and the l2 norm (gdn_bwd_qk_task), a half-warp each.
 * ============================================================================================== */

#define GDN_BWD_THREADS 256 /* 32 columns x 8 threads; 128 rows x 2 threads */
#define GDN_BWD_P 33        /* floats between rows of a state in shared memory */

struct gdn_dims {
    int nk, nv, dk, dv;
    int G, Wm; /* column groups, their width (the last may be narrower) */
    float scale;
    size_t W;   /* qkv's row */
    size_t per; /* ws floats of one (sequence, value head, group): the CPU's size */
};

/* A token's vectors of the walk (one of two buffers): qn, kn (dk), dO, u, d, v (Wm), g, beta. */
static __host__ __device__ inline int gdn_vec_floats(int dk, int wm) {
    return 2 * dk + 4 * wm + 2;
}

/* Shared memory of gdn_bwd_kernel in floats: the state, the previous state and dS (dk rows of
 * GDN_BWD_P), two token-vector buffers, the forward's staging of GDN_TILE tokens (kn, v, exp(g),
 * beta), then pq, pk, the row dots r (dk) and dd, du, w (Wm) of the token. */
static size_t gdn_bwd_smem_floats(int dk, int wm) {
    return 3 * (size_t)dk * GDN_BWD_P + 2 * (size_t)gdn_vec_floats(dk, wm) +
           (size_t)GDN_TILE * ((size_t)dk + wm + 2) + 3 * (size_t)dk + 3 * (size_t)wm;
}

/* 1: qn (which 0) or kn (which 1) of (row, value head h) into dst + (row nv + h) dk. */
static __global__ void gdn_bwd_norm_kernel(float *__restrict__ qn, float *__restrict__ kn,
                                           const float *__restrict__ qkv, int64_t n_half,
                                           gdn_dims D) {
    const int64_t hwg = (int64_t)blockIdx.x * (blockDim.x / 16) + threadIdx.x / 16;
    if (hwg >= n_half) return; /* uniform in the half-warp */
    const int which = (int)(hwg & 1);
    const int64_t rh = hwg >> 1, row = rh / D.nv;
    const int h = (int)(rh - row * D.nv), kh = h / (D.nv / D.nk);
    gdn_norm_half((which ? kn : qn) + rh * D.dk,
                  qkv + (size_t)row * D.W + (size_t)which * D.nk * D.dk + (size_t)kh * D.dk, D.dk,
                  which, D.scale, threadIdx.x & 15, half_warp_mask());
}

/* 3: a thread per (token, value head, element e of the partials): acc = p_0; acc = acc + p_g
 * for g = 1..G-1; e < dk: dqn, e < 2 dk: dkn, then dbeta, then dg = acc exp(g). */
static __global__ void gdn_bwd_sum_kernel(float *__restrict__ dqn, float *__restrict__ dkn,
                                          float *__restrict__ dg, float *__restrict__ dbeta,
                                          const float *__restrict__ part,
                                          const float *__restrict__ g, int64_t n, gdn_dims D) {
    const int PP = 2 * D.dk + 2;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (int64_t)gridDim.x * blockDim.x) {
        const int64_t rh = u / PP;
        const int e = (int)(u - rh * PP);
        const float *p0 = part + (size_t)rh * D.G * PP + e;
        float a = p0[0];
        for (int gg = 1; gg < D.G; gg++)
            a = a + p0[(size_t)gg * PP];
        if (e < D.dk)
            dqn[(size_t)rh * D.dk + e] = a;
        else if (e < 2 * D.dk)
            dkn[(size_t)rh * D.dk + (e - D.dk)] = a;
        else if (e == 2 * D.dk)
            dbeta[rh] = a;
        else
            dg[rh] = a * kiln_expf(g[rh]);
    }
}

/* 4: dx of q (which 0) or k (which 1) of (row, key head kh): dy[i] = the group's G value heads'
 * src[i] summed in head order (times scale for q); r = 1 / sqrtf(dot(x, x) + 1e-6f), y = x r,
 * c = dot(y, dy), dx = r (dy - y c); the dots lane-16 over the half-warp, y and dy recomputed
 * in each pass (the same bits). */
static __global__ void gdn_bwd_qk_kernel(float *__restrict__ dqkv, const float *__restrict__ dqn,
                                         const float *__restrict__ dkn,
                                         const float *__restrict__ qkv, int64_t n_half,
                                         gdn_dims D) {
    const int64_t hwg = (int64_t)blockIdx.x * (blockDim.x / 16) + threadIdx.x / 16;
    if (hwg >= n_half) return; /* uniform in the half-warp */
    const int which = (int)(hwg & 1), l = threadIdx.x & 15, dk = D.dk, G = D.nv / D.nk;
    const unsigned mask = half_warp_mask();
    const int64_t rk = hwg >> 1, row = rk / D.nk;
    const int kh = (int)(rk - row * D.nk);
    const size_t off = (size_t)row * D.W + (size_t)which * D.nk * dk + (size_t)kh * dk;
    const float *x = qkv + off;
    float *dx = dqkv + off;
    const float *src = (which ? dkn : dqn) + ((size_t)row * D.nv + (size_t)kh * G) * dk;
    float acc = 0.0f;
    for (int i = l; i < dk; i += 16)
        acc = fmaf(x[i], x[i], acc);
    const float r = 1.0f / sqrtf(lane16_tree(acc, mask) + 1e-6f);
    acc = 0.0f;
    for (int i = l; i < dk; i += 16) {
        float a = src[i];
        for (int gg = 1; gg < G; gg++)
            a = a + src[(size_t)gg * dk + i];
        const float dy = which ? a : a * D.scale, y = x[i] * r;
        acc = fmaf(y, dy, acc);
    }
    const float c = lane16_tree(acc, mask);
    for (int i = l; i < dk; i += 16) {
        float a = src[i];
        for (int gg = 1; gg < G; gg++)
            a = a + src[(size_t)gg * dk + i];
        const float dy = which ? a : a * D.scale, y = x[i] * r;
        dx[i] = r * (dy - y * c);
    }
}

/* ---- pieces of gdn_bwd_kernel ---------------------------------------------------------------- */

/* dst (dk rows GDN_BWD_P floats apart, shared) = src (dk rows of W floats, global) by 4-byte
 * cp.async; the caller commits and waits. */
static __device__ __forceinline__ void gdn_state_load_async(float *dst, const float *src, int dk,
                                                            int W) {
    const int per = GDN_BWD_THREADS / W, r = threadIdx.x / W, j = threadIdx.x - r * W;
    if (r < per)
        for (int i = r; i < dk; i += per)
            __pipeline_memcpy_async(dst + i * GDN_BWD_P + j, src + i * W + j, 4);
}

/* Token `row`'s vectors of the walk into vb by cp.async: qn, kn, the group's columns of dO,
 * v, and u, d (the chunk's saved ones), g, beta. */
static __device__ __forceinline__ void
gdn_vec_load_async(float *vb, size_t row, int h, int c0, int W, const float *qn_g,
                   const float *kn_g, const float *dout, const float *qkv, const float *g,
                   const float *beta, const float *u, const float *d, const gdn_dims &D) {
    const int dk = D.dk, Wm = D.Wm, n = gdn_vec_floats(dk, Wm);
    const size_t rh = row * D.nv + h;
    for (int e = threadIdx.x; e < n; e += GDN_BWD_THREADS) {
        const float *src;
        if (e < dk) {
            src = qn_g + rh * dk + e;
        } else if (e < 2 * dk) {
            src = kn_g + rh * dk + (e - dk);
        } else if (e < 2 * dk + 4 * Wm) {
            const int q = (e - 2 * dk) / Wm, j = (e - 2 * dk) - q * Wm;
            if (j >= W) continue;
            src = q == 0   ? dout + rh * D.dv + c0 + j
                  : q == 1 ? u + j
                  : q == 2 ? d + j
                           : qkv + row * D.W + 2 * (size_t)D.nk * dk + (size_t)h * D.dv + c0 + j;
        } else if (e == 2 * dk + 4 * Wm) {
            src = g + rh;
        } else {
            src = beta + rh;
        }
        __pipeline_memcpy_async(vb + e, src, 4);
    }
}

/* The end of a lane-16 dot whose 16 lanes are held p + 2 s (s < 8) by the two threads p = 0, 1
 * of a row task: kiln_lane16_reduce's first three levels in the thread (lanes j, j + 8, ... have
 * p's parity), its last add across the pair (a + b == b + a: both threads hold the sum). */
static __device__ __forceinline__ float gdn_pair_tree(const float (&a)[8], unsigned mask) {
    const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
    const float t0 = s0 + s2, t1 = s1 + s3;
    const float u = t0 + t1;
    return u + __shfl_xor_sync(mask, u, 1);
}

/* The forward of rows [t_lo, t_hi) of the sequence on the column slice S (registers: thread
 * (column j, part p) holds S[p + 8 m][j]), the kn, v, exp(g), beta of GDN_TILE tokens staged in
 * shared memory at a time: S = a S; u = lane-16 over i of S[i][j] kn[i] (lane p: the even m,
 * lane p + 8: the odd m, in increasing i; kiln_lane16_reduce's first level in the thread, the
 * rest across the 8 threads of the column); d = b (v - u); S += kn d^T (gdn_step). ck: S to
 * ck + (t / C) SS before every token t with t % C == 0; cs: S after token t to cs + (t - t_lo)
 * SS for t < t_hi - 1, u and d to cu, cd + (t - t_lo) Wm. Begins with a barrier; the stage is
 * free when it returns. */
template <int M>
static __device__ __forceinline__ void
gdn_bwd_fwd(float (&S)[M], int t_lo, int t_hi, size_t row0, int h, int c0, int W, int j, int p,
            unsigned mask, float *stage, const float *kn_g, const float *qkv, const float *g,
            const float *beta, float *ck, float *cs, float *cu, float *cd, size_t SS,
            const gdn_dims &D) {
    const int dk = D.dk, Wm = D.Wm, C = KILN_GDN_CHUNK;
    float *tk = stage, *tv = tk + GDN_TILE * dk, *ta = tv + GDN_TILE * Wm, *tb = ta + GDN_TILE;
    const bool col = j < W;
    for (int t0 = t_lo; t0 < t_hi; t0 += GDN_TILE) {
        const int tn = min(GDN_TILE, t_hi - t0);
        __syncthreads(); /* the previous tile has been read */
        for (int e = threadIdx.x; e < tn * (dk + Wm + 2); e += GDN_BWD_THREADS) {
            const int tt = e / (dk + Wm + 2), k = e - tt * (dk + Wm + 2);
            const size_t row = row0 + t0 + tt, rh = row * D.nv + h;
            if (k < dk)
                tk[tt * dk + k] = kn_g[rh * dk + k];
            else if (k < dk + Wm) {
                if (k - dk < W)
                    tv[tt * Wm + (k - dk)] =
                        qkv[row * D.W + 2 * (size_t)D.nk * dk + (size_t)h * D.dv + c0 + (k - dk)];
            } else if (k == dk + Wm)
                ta[tt] = kiln_expf(g[rh]);
            else
                tb[tt] = beta[rh];
        }
        __syncthreads();
        for (int tt = 0; tt < tn; tt++) {
            const int t = t0 + tt;
            if (ck && t % C == 0 && col) {
                float *dst = ck + (size_t)(t / C) * SS + j;
#pragma unroll
                for (int m = 0; m < M; m++)
                    if (p + 8 * m < dk) dst[(size_t)(p + 8 * m) * W] = S[m];
            }
            const float a = ta[tt], b = tb[tt], *kn = tk + tt * dk;
            float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
            for (int m = 0; m < M; m++) {
                const int i = p + 8 * m;
                if (i < dk) {
                    S[m] = S[m] * a;
                    if (m & 1)
                        a1 = fmaf(S[m], kn[i], a1);
                    else
                        a0 = fmaf(S[m], kn[i], a0);
                }
            }
            float u = a0 + a1;
            u = u + __shfl_xor_sync(mask, u, 4);
            u = u + __shfl_xor_sync(mask, u, 2);
            u = u + __shfl_xor_sync(mask, u, 1);
            const float d = b * ((col ? tv[tt * Wm + j] : 0.0f) - u);
#pragma unroll
            for (int m = 0; m < M; m++) {
                const int i = p + 8 * m;
                if (i < dk) S[m] = fmaf(kn[i], d, S[m]);
            }
            if (cs && col) {
                if (p == 0) {
                    cu[(size_t)(t - t_lo) * Wm + j] = u;
                    cd[(size_t)(t - t_lo) * Wm + j] = d;
                }
                if (t + 1 < t_hi) {
                    float *dst = cs + (size_t)(t - t_lo) * SS + j;
#pragma unroll
                    for (int m = 0; m < M; m++)
                        if (p + 8 * m < dk) dst[(size_t)(p + 8 * m) * W] = S[m];
                }
            }
        }
    }
}

/* The end of a walked token, by warp 0 (deferred into the next token's first phase: r, dd, w
 * are rewritten only after its second barrier): threads 0..15 pa = the lane-16 over rows of the
 * row dots r_i (lane L: 0 + r_L + r_(L+16) + ..., plain adds in increasing i, then the tree),
 * threads 16..31 pbeta = dd . w (the lane-16 dot over the group's W <= 32 columns); to pt. */
static __device__ __forceinline__ void
gdn_bwd_token_end(float *pt, const float *r_s, const float *dd_s, const float *w_s, int dk, int W) {
    const int l = threadIdx.x & 15;
    float acc = 0.0f;
    if (threadIdx.x < 16) {
        for (int i = l; i < dk; i += 16)
            acc = acc + r_s[i];
    } else {
        for (int j = l; j < W; j += 16)
            acc = fmaf(dd_s[j], w_s[j], acc);
    }
    const float r = lane16_tree(acc, half_warp_mask());
    if (l == 0) pt[threadIdx.x < 16 ? 2 * dk + 1 : 2 * dk] = r;
}

/* 2: one block per (sequence b, value head h, column group gi) = blockIdx.x, gdn_bwd_task's
 * order on the group's W columns c0 .. c0 + W - 1:
 *   the forward from zero, the state (in registers, column tasks: gdn_bwd_fwd) to ck[c] at each
 *   chunk start; then chunks last to first: the state = ck[c], the chunk's forward again with S
 *   after each token (but the last) to cs and u, d to cu, cd, the last into shared memory; then
 *   its tokens last to first, each in phases separated by __syncthreads:
 *     R1 row tasks (row i, two threads p = 0, 1 holding lanes p + 2 s, columns j = lane and
 *        lane + 16): dS = a' dS (the previous token's decay, deferred from its end),
 *        dS += qn dO^T; pq_i = St[i,J] . dO; pk_i = dS[i,J] . d. Warp 0 first finishes the
 *        previous token: its pa and pbeta (gdn_bwd_token_end).
 *     C  column tasks (column j, 8 threads: gdn_bwd_fwd's lanes): dd_j = dS[:,j] . kn;
 *        dv = b dd (to dqkv), du = -dv, w = v - u
 *     R2 row tasks: dS += kn du^T; pk_i += (Sp[i,J] a) . du; r_i = dS[i,J] . Sp[i,J] (to r);
 *        pq, pk to the ws
 *   St (S after the token) and Sp (before it) are two shared buffers that swap roles: Sp of
 *   token t is St of token t - 1, and Sp of t - 1 streams in by cp.async from C of token t on,
 *   with the next token's vectors. Rows are GDN_BWD_P == 1 (mod 32) floats apart: a warp's row
 *   tasks (rows 2 k + o, both p) and column tasks (columns w + 8 q, all p) touch 32 banks. */
template <int M>
static __global__ void __launch_bounds__(GDN_BWD_THREADS, 2)
    gdn_bwd_kernel(float *__restrict__ dqkv, const float *__restrict__ dout,
                   const float *__restrict__ qkv, const float *__restrict__ g,
                   const float *__restrict__ beta, float *ws, int n_seq, int T, gdn_dims D) {
    extern __shared__ float sm[];
    const int dk = D.dk, Wm = D.Wm, nv = D.nv, G = D.G, tid = threadIdx.x, PP = 2 * dk + 2;
    const int C = KILN_GDN_CHUNK, n_chunks = (T + C - 1) / C;
    const int task = (int)blockIdx.x, gi = task % G, h = (task / G) % nv, b = task / G / nv;
    const int c0 = gi * Wm, W = min(Wm, D.dv - c0);
    const size_t SS = (size_t)dk * Wm, N = (size_t)n_seq * T, row0 = (size_t)b * T;
    float *ck = ws + (size_t)task * D.per;                      /* (n_chunks, dk, W) */
    float *cs = ck + (size_t)n_chunks * SS;                     /* (C, dk, W) */
    float *cu = cs + (size_t)C * SS, *cd = cu + (size_t)C * Wm; /* (C, W) each */
    float *part = ws + (size_t)n_seq * nv * G * D.per;          /* (N, nv, G, PP) */
    float *qn_g = part + N * nv * G * PP, *kn_g = qn_g + N * nv * dk;
    float *bufA = sm, *bufB = bufA + dk * GDN_BWD_P, *dS = bufB + dk * GDN_BWD_P;
    const int VB = gdn_vec_floats(dk, Wm);
    float *vb0 = dS + dk * GDN_BWD_P, *vb1 = vb0 + VB, *stage = vb1 + VB;
    float *pq_s = stage + GDN_TILE * (dk + Wm + 2), *pk_s = pq_s + dk, *r_s = pk_s + dk;
    float *dd_s = r_s + dk, *du_s = dd_s + Wm, *w_s = du_s + Wm;
    /* column tasks */
    const int cp = tid & 7, cj = (tid >> 5) + 8 * ((tid >> 3) & 3);
    const unsigned cmask = 0xffu << (tid & 24);
    /* row tasks: rows i0 + 128 k */
    const int rp = tid & 1, i0 = (tid >> 6) * 32 + ((tid >> 5) & 1) + 2 * ((tid >> 1) & 15);
    const unsigned rmask = 3u << (tid & 30);

    for (int e = tid; e < dk * GDN_BWD_P; e += GDN_BWD_THREADS)
        dS[e] = 0.0f;
    float S[M];
#pragma unroll
    for (int m = 0; m < M; m++)
        S[m] = 0.0f;
    /* the forward, saving each chunk's starting state */
    gdn_bwd_fwd<M>(S, 0, T, row0, h, c0, W, cj, cp, cmask, stage, kn_g, qkv, g, beta, ck, nullptr,
                   nullptr, nullptr, SS, D);

    bool pend = false; /* dS still owes the previous token's decay a_pend */
    float a_pend = 1.0f;
    size_t z_row = 0; /* the token whose pa threads 0..15 still owe */
    bool z_pend = false;
    for (int c = n_chunks - 1; c >= 0; c--) {
        const int t0 = c * C, t1 = min(t0 + C, T);
        const float *ckc = ck + (size_t)c * SS;
#pragma unroll
        for (int m = 0; m < M; m++) /* written by this thread */
            S[m] = cj < W && cp + 8 * m < dk ? ckc[(size_t)(cp + 8 * m) * W + cj] : 0.0f;
        gdn_bwd_fwd<M>(S, t0, t1, row0, h, c0, W, cj, cp, cmask, stage, kn_g, qkv, g, beta, nullptr,
                       cs, cu, cd, SS, D);
        float *St = bufA, *Sp = bufB;
        if (cj < W) {
#pragma unroll
            for (int m = 0; m < M; m++)
                if (cp + 8 * m < dk) St[(cp + 8 * m) * GDN_BWD_P + cj] = S[m];
        }
        __syncthreads(); /* cs, cu, cd written */
        gdn_state_load_async(Sp, t1 - 1 > t0 ? cs + (size_t)(t1 - 2 - t0) * SS : ckc, dk, W);
        gdn_vec_load_async(vb0, row0 + t1 - 1, h, c0, W, qn_g, kn_g, dout, qkv, g, beta,
                           cu + (size_t)(t1 - 1 - t0) * Wm, cd + (size_t)(t1 - 1 - t0) * Wm, D);
        __pipeline_commit();
        for (int t = t1 - 1; t >= t0; t--) {
            const size_t row = row0 + t, rh = row * nv + h;
            const int par = (t1 - 1 - t) & 1;
            const float *vb = par ? vb1 : vb0;
            const float *qn = vb, *kn = vb + dk, *dO = vb + 2 * dk, *uv = dO + Wm, *dvec = uv + Wm,
                        *vv = dvec + Wm;
            __pipeline_wait_prior(0);
            __syncthreads(); /* Sp, the vectors, and the previous token's R2 */
            const float bt = vb[2 * dk + 4 * Wm + 1];
            /* R1 */
            if (z_pend && tid < 32)
                gdn_bwd_token_end(part + (z_row * G + gi) * PP, r_s, dd_s, w_s, dk, W);
            for (int i = i0; i < dk; i += 128) { /* uniform in the pair */
                float *ds = dS + i * GDN_BWD_P;
                const float *s = St + i * GDN_BWD_P;
                const float qi = qn[i];
                float aq[8], ak[8];
#pragma unroll
                for (int q = 0; q < 8; q++)
                    aq[q] = ak[q] = 0.0f;
#pragma unroll
                for (int hh = 0; hh < 2; hh++)
#pragma unroll
                    for (int q = 0; q < 8; q++) {
                        const int j = rp + 2 * q + 16 * hh;
                        if (j < W) {
                            float x = ds[j];
                            if (pend) x = x * a_pend;
                            x = fmaf(qi, dO[j], x);
                            ds[j] = x;
                            aq[q] = fmaf(s[j], dO[j], aq[q]);
                            ak[q] = fmaf(x, dvec[j], ak[q]);
                        }
                    }
                const float rq = gdn_pair_tree(aq, rmask), rk = gdn_pair_tree(ak, rmask);
                if (rp == 0) {
                    pq_s[i] = rq;
                    pk_s[i] = rk;
                }
            }
            __syncthreads();
            /* St is free: the next token's Sp and vectors stream in from here */
            if (t > t0) {
                gdn_state_load_async(St, t - 1 > t0 ? cs + (size_t)(t - 2 - t0) * SS : ckc, dk, W);
                gdn_vec_load_async(par ? vb0 : vb1, row - 1, h, c0, W, qn_g, kn_g, dout, qkv, g,
                                   beta, cu + (size_t)(t - 1 - t0) * Wm,
                                   cd + (size_t)(t - 1 - t0) * Wm, D);
            }
            __pipeline_commit();
            /* C */
            if (cj < W) { /* uniform in the column's 8 threads */
                float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
                for (int m = 0; m < M; m++) {
                    const int i = cp + 8 * m;
                    if (i < dk) {
                        if (m & 1)
                            a1 = fmaf(dS[i * GDN_BWD_P + cj], kn[i], a1);
                        else
                            a0 = fmaf(dS[i * GDN_BWD_P + cj], kn[i], a0);
                    }
                }
                float dd = a0 + a1;
                dd = dd + __shfl_xor_sync(cmask, dd, 4);
                dd = dd + __shfl_xor_sync(cmask, dd, 2);
                dd = dd + __shfl_xor_sync(cmask, dd, 1);
                if (cp == 0) {
                    const float dvo = bt * dd;
                    dqkv[row * D.W + 2 * (size_t)D.nk * dk + (size_t)h * D.dv + c0 + cj] = dvo;
                    du_s[cj] = -dvo;
                    w_s[cj] = vv[cj] - uv[cj];
                    dd_s[cj] = dd;
                }
            }
            __syncthreads();
            /* R2 */
            const float a = kiln_expf(vb[2 * dk + 4 * Wm]);
            float *pt = part + (rh * G + gi) * PP;
            for (int i = i0; i < dk; i += 128) {
                float *ds = dS + i * GDN_BWD_P;
                const float *sp = Sp + i * GDN_BWD_P;
                const float ki = kn[i];
                float ak[8], ar[8];
#pragma unroll
                for (int q = 0; q < 8; q++)
                    ak[q] = ar[q] = 0.0f;
#pragma unroll
                for (int hh = 0; hh < 2; hh++)
#pragma unroll
                    for (int q = 0; q < 8; q++) {
                        const int j = rp + 2 * q + 16 * hh;
                        if (j < W) {
                            const float x = fmaf(ki, du_s[j], ds[j]), y = sp[j];
                            ds[j] = x;
                            ak[q] = fmaf(y * a, du_s[j], ak[q]);
                            ar[q] = fmaf(x, y, ar[q]);
                        }
                    }
                const float rk = gdn_pair_tree(ak, rmask), rr = gdn_pair_tree(ar, rmask);
                if (rp == 0) {
                    pt[i] = pq_s[i];
                    pt[dk + i] = pk_s[i] + rk;
                    r_s[i] = rr;
                }
            }
            pend = true;
            a_pend = a;
            z_pend = true;
            z_row = rh;
            float *tmp = St;
            St = Sp;
            Sp = tmp;
        }
        __syncthreads(); /* the walk is done with the buffers and the stage */
    }
    if (z_pend && tid < 32) gdn_bwd_token_end(part + (z_row * G + gi) * PP, r_s, dd_s, w_s, dk, W);
}

static int gdn_bwd_cols(int dv) {
    return dv < KILN_GDN_COLS ? dv : KILN_GDN_COLS;
}

bool kiln_cuda_gated_delta_backward_fits(int dk, int dv) {
    if (dk <= 0 || dv <= 0 || dk > KILN_CUDA_GDN_MAX_HEAD || dv > KILN_CUDA_GDN_MAX_HEAD)
        return false;
    int dev = 0, maxsm = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&maxsm, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
            cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return gdn_bwd_smem_floats(dk, gdn_bwd_cols(dv)) * sizeof(float) <= (size_t)maxsm;
}

template <int M>
static cudaError_t gdn_bwd_launch(cudaStream_t s, unsigned blocks, size_t smem, float *dqkv,
                                  const float *dout, const float *qkv, const float *g,
                                  const float *beta, float *ws, int n_seq, int T,
                                  const gdn_dims &D) {
    const cudaError_t e = cudaFuncSetAttribute(
        gdn_bwd_kernel<M>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    gdn_bwd_kernel<M>
        <<<blocks, GDN_BWD_THREADS, smem, s>>>(dqkv, dout, qkv, g, beta, ws, n_seq, T, D);
    return cudaGetLastError();
}

cudaError_t kiln_cuda_gated_delta_backward(cudaStream_t s, float *dqkv, float *dg, float *dbeta,
                                           const float *dout, const float *qkv, const float *g,
                                           const float *beta, float *ws, int n_seq, int T, int nk,
                                           int nv, int dk, int dv, float scale) {
    if (n_seq <= 0 || T <= 0) return cudaSuccess;
    if (!gdn_shape_ok(nk, nv, dk, dv)) return cudaErrorInvalidValue;
    if (!kiln_cuda_gated_delta_backward_fits(dk, dv)) return cudaErrorInvalidConfiguration;
    const size_t C = KILN_GDN_CHUNK;
    const size_t n_chunks = ((size_t)T + C - 1) / C;
    gdn_dims D;
    D.nk = nk;
    D.nv = nv;
    D.dk = dk;
    D.dv = dv;
    D.Wm = gdn_bwd_cols(dv);
    D.G = (dv + D.Wm - 1) / D.Wm;
    D.scale = scale;
    D.W = 2 * (size_t)nk * dk + (size_t)nv * dv;
    const size_t SS = (size_t)dk * D.Wm, Wm = (size_t)D.Wm;
    /* kiln_cpu_gated_delta_backward's per-task block (its tail, scratch there, unused here) */
    D.per = n_chunks * SS + C * (SS + 2 * Wm) + 16 * Wm + 2 * (size_t)dk + 2 * SS;
    const size_t N = (size_t)n_seq * T, tasks = (size_t)n_seq * nv * D.G;
    if (tasks > 0x7fffffff) return cudaErrorInvalidConfiguration;
    const size_t PP = 2 * (size_t)dk + 2;
    float *part = ws + tasks * D.per;
    float *qn_g = part + N * nv * D.G * PP, *kn_g = qn_g + N * nv * dk;

    const int64_t n_norm = (int64_t)N * nv * 2, n_qk = (int64_t)N * nk * 2;
    gdn_bwd_norm_kernel<<<(unsigned)((n_norm + 15) / 16), 256, 0, s>>>(qn_g, kn_g, qkv, n_norm, D);
    const size_t smem = gdn_bwd_smem_floats(dk, D.Wm) * sizeof(float);
    const int rows = (dk + 7) / 8; /* a column thread's rows */
    cudaError_t e;
    if (rows <= 2)
        e = gdn_bwd_launch<2>(s, (unsigned)tasks, smem, dqkv, dout, qkv, g, beta, ws, n_seq, T, D);
    else if (rows <= 4)
        e = gdn_bwd_launch<4>(s, (unsigned)tasks, smem, dqkv, dout, qkv, g, beta, ws, n_seq, T, D);
    else if (rows <= 8)
        e = gdn_bwd_launch<8>(s, (unsigned)tasks, smem, dqkv, dout, qkv, g, beta, ws, n_seq, T, D);
    else if (rows <= 16)
        e = gdn_bwd_launch<16>(s, (unsigned)tasks, smem, dqkv, dout, qkv, g, beta, ws, n_seq, T, D);
    else if (rows <= 32)
        e = gdn_bwd_launch<32>(s, (unsigned)tasks, smem, dqkv, dout, qkv, g, beta, ws, n_seq, T, D);
    else
        e = gdn_bwd_launch<64>(s, (unsigned)tasks, smem, dqkv, dout, qkv, g, beta, ws, n_seq, T, D);
    if (e != cudaSuccess) return e;
    const int64_t n_sum = (int64_t)N * nv * (int64_t)PP;
    gdn_bwd_sum_kernel<<<grid_for(n_sum, 256), 256, 0, s>>>(qn_g, kn_g, dg, dbeta, part, g, n_sum,
                                                            D);
    gdn_bwd_qk_kernel<<<(unsigned)((n_qk + 15) / 16), 256, 0, s>>>(dqkv, qn_g, kn_g, qkv, n_qk, D);
    return cudaGetLastError();
}
