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
 * the forward kernel parallelises over; its backward needs dot products over rows as well and
 * keeps one head's S, previous S and dS in shared memory (gdn_bwd_kernel).
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

/* Row index of half-warp task hw (16 lanes of one row or column of a state) such that the two
 * half-warps of a warp take rows hw' and hw' + 16: with shared-memory rows P == 1 (mod 32)
 * floats apart their 16-float segments never share a bank. */
static __device__ __forceinline__ int gdn_pair_index(int hw) {
    return (hw >> 5) * 32 + ((hw >> 1) & 15) + 16 * (hw & 1);
}

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
 * Three kernels, as kiln_cpu_gated_delta_backward's two tasks:
 *   1. gdn_bwd_norm_kernel: every (token, value head)'s normalised q and k into the ws regions
 *      that end up holding their gradients (dqn, dkn: (N, nv, dk) each), a half-warp a vector.
 *   2. gdn_bwd_kernel: one block per (sequence, value head), gdn_bwd_task's walk (below).
 *   3. gdn_bwd_qk_kernel: per (token, key head, q or k) the group's gradients summed in head
 *      order and taken through the scale and the l2 norm (gdn_bwd_qk_task), a half-warp each.
 * ============================================================================================== */

#define GDN_BWD_THREADS 512

struct gdn_dims {
    int nk, nv, dk, dv;
    int P; /* floats between rows of a state in shared memory (== 1 mod 32) */
    float scale;
    size_t W;   /* qkv's row */
    size_t per; /* ws floats of one (sequence, value head): the CPU's layout */
};

/* A token's vectors (one of two buffers): qn, kn (dk), dO, u, d, v (dv), g, beta. */
static __host__ __device__ inline int gdn_vec_floats(int dk, int dv) {
    return 2 * dk + 4 * dv + 2;
}

/* Shared memory of gdn_bwd_kernel in floats: the state, the previous state and dS (dk rows of
 * P), two token-vector buffers, then dqn, dkn (dk) and dd, du, w (dv) of the token. */
static size_t gdn_bwd_smem_floats(int dk, int dv, int P) {
    return 3 * (size_t)dk * P + 2 * (size_t)gdn_vec_floats(dk, dv) + 2 * (size_t)dk +
           3 * (size_t)dv;
}
static int gdn_bwd_pitch(int dv) {
    return (dv + 31) / 32 * 32 + 1;
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

/* 3: dx of q (which 0) or k (which 1) of (row, key head kh): dy[i] = the group's G value heads'
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

/* dst (dk rows P floats apart, shared) = src (rows dv apart, global) by 4-byte cp.async; the
 * caller commits and waits. */
static __device__ __forceinline__ void gdn_state_load_async(float *dst, const float *src,
                                                            const gdn_dims &D) {
    const int dv = D.dv, bs = GDN_BWD_THREADS, tid = threadIdx.x;
    if (dv <= bs) {
        const int per = bs / dv, r = tid / dv, j = tid - r * dv;
        if (r < per)
            for (int i = r; i < D.dk; i += per)
                __pipeline_memcpy_async(dst + (size_t)i * D.P + j, src + (size_t)i * dv + j, 4);
    } else {
        for (int i = 0; i < D.dk; i++)
            for (int j = tid; j < dv; j += bs)
                __pipeline_memcpy_async(dst + (size_t)i * D.P + j, src + (size_t)i * dv + j, 4);
    }
}

/* dst (global, rows dv apart) = src (shared, rows P apart). */
static __device__ __forceinline__ void gdn_state_store(float *dst, const float *src,
                                                       const gdn_dims &D) {
    const int dv = D.dv, bs = GDN_BWD_THREADS, tid = threadIdx.x;
    if (dv <= bs) {
        const int per = bs / dv, r = tid / dv, j = tid - r * dv;
        if (r < per)
            for (int i = r; i < D.dk; i += per)
                dst[(size_t)i * dv + j] = src[(size_t)i * D.P + j];
    } else {
        for (int i = 0; i < D.dk; i++)
            for (int j = tid; j < dv; j += bs)
                dst[(size_t)i * dv + j] = src[(size_t)i * D.P + j];
    }
}

/* Token `row`'s vectors into vb by cp.async: kn, v, g, beta (walk false: the forward passes);
 * also qn, dO and u, d (from u, d: the chunk's saved ones) for the walk. */
static __device__ __forceinline__ void
gdn_vec_load_async(float *vb, size_t row, int h, const float *qn_g, const float *kn_g,
                   const float *dout, const float *qkv, const float *g, const float *beta,
                   const float *u, const float *d, bool walk, const gdn_dims &D) {
    const int dk = D.dk, dv = D.dv, n = gdn_vec_floats(dk, dv);
    const size_t rh = row * D.nv + h;
    for (int e = threadIdx.x; e < n; e += GDN_BWD_THREADS) {
        const float *src;
        if (e < dk) {
            if (!walk) continue;
            src = qn_g + rh * dk + e;
        } else if (e < 2 * dk) {
            src = kn_g + rh * dk + (e - dk);
        } else if (e < 2 * dk + dv) {
            if (!walk) continue;
            src = dout + rh * dv + (e - 2 * dk);
        } else if (e < 2 * dk + 2 * dv) {
            if (!walk) continue;
            src = u + (e - 2 * dk - dv);
        } else if (e < 2 * dk + 3 * dv) {
            if (!walk) continue;
            src = d + (e - 2 * dk - 2 * dv);
        } else if (e < 2 * dk + 4 * dv) {
            src = qkv + row * D.W + 2 * (size_t)D.nk * dk + (size_t)h * dv + (e - 2 * dk - 3 * dv);
        } else if (e == 2 * dk + 4 * dv) {
            src = g + rh;
        } else {
            src = beta + rh;
        }
        __pipeline_memcpy_async(vb + e, src, 4);
    }
}

/* One token of the forward on X (shared), column tasks (column j, lane l: rows i = l + 16 m),
 * as gdn_step without its output: S = a S; u = S^T kn; d = b (v - u); S += kn d^T. u, d of
 * column j to cu[j], cd[j] when cu is not NULL. */
static __device__ __forceinline__ void gdn_fwd_cols(float *X, const float *vb, float *cu, float *cd,
                                                    const gdn_dims &D) {
    const int dk = D.dk, dv = D.dv, P = D.P;
    const float *kn = vb + dk, *v = vb + 2 * dk + 3 * dv;
    const float a = kiln_expf(vb[2 * dk + 4 * dv]), b = vb[2 * dk + 4 * dv + 1];
    const unsigned mask = half_warp_mask();
    const int ntask = ((dv + 31) & ~31) * 16;
    for (int k = threadIdx.x; k < ntask; k += GDN_BWD_THREADS) {
        const int j = gdn_pair_index(k >> 4), l = k & 15;
        if (j >= dv) continue; /* uniform in the half-warp */
        float acc = 0.0f;
        for (int i = l; i < dk; i += 16) {
            float *p = X + (size_t)i * P + j;
            const float s = *p * a;
            *p = s;
            acc = fmaf(s, kn[i], acc);
        }
        const float uj = lane16_tree(acc, mask), dj = b * (v[j] - uj);
        for (int i = l; i < dk; i += 16) {
            float *p = X + (size_t)i * P + j;
            *p = fmaf(kn[i], dj, *p);
        }
        if (cu && l == 0) {
            cu[j] = uj;
            cd[j] = dj;
        }
    }
}

/* The lane-16 dot of the flattened dS and Sp (da = kiln_dot_ref(dS, Sp, dk dv)) by the 16
 * threads of half-warp 0, lane L's chain the elements e = L, L + 16, ... in increasing e (rows
 * of the shared buffers P apart); NJ = dv / 16 when 16 divides dv (a row's elements of one lane
 * in registers, the next row's loaded while the current one's FMAs run), else 0 (general). */
template <int NJ>
static __device__ __forceinline__ float gdn_flat_dot(const float *dS, const float *Sp,
                                                     const gdn_dims &D) {
    const int L = threadIdx.x, dk = D.dk, dv = D.dv, P = D.P;
    float acc = 0.0f;
    if (NJ > 0) {
        const float *pa = dS + L, *pb = Sp + L;
        float a0[NJ > 0 ? NJ : 1], b0[NJ > 0 ? NJ : 1];
#pragma unroll
        for (int q = 0; q < NJ; q++) {
            a0[q] = pa[16 * q];
            b0[q] = pb[16 * q];
        }
        for (int i = 0; i < dk; i++) {
            float a1[NJ > 0 ? NJ : 1], b1[NJ > 0 ? NJ : 1];
            const bool more = i + 1 < dk;
            pa += P;
            pb += P;
#pragma unroll
            for (int q = 0; q < NJ; q++) {
                a1[q] = more ? pa[16 * q] : 0.0f;
                b1[q] = more ? pb[16 * q] : 0.0f;
            }
#pragma unroll
            for (int q = 0; q < NJ; q++)
                acc = fmaf(a0[q], b0[q], acc);
#pragma unroll
            for (int q = 0; q < NJ; q++) {
                a0[q] = a1[q];
                b0[q] = b1[q];
            }
        }
    } else {
        int i = L / dv, j = L % dv;
        const size_t SN = (size_t)dk * dv;
        for (size_t e = L; e < SN; e += 16) {
            acc = fmaf(dS[(size_t)i * P + j], Sp[(size_t)i * P + j], acc);
            j += 16;
            while (j >= dv) {
                j -= dv;
                i++;
            }
        }
    }
    return lane16_tree(acc, 0x0000ffffu);
}

/* 2: one block per (sequence b, value head h) = blockIdx.x, gdn_bwd_task's order:
 *   the forward from zero, the state copied to ck[c] at each chunk start (column tasks on X in
 *   shared memory); then chunks last to first: X = ck[c], the chunk's forward again with S after
 *   each token (but the last) to cs and u, d to cu, cd; then its tokens last to first, each
 *   in phases separated by __syncthreads:
 *     P1 row tasks (row i, lane l: columns j = l + 16 m): dS = a' dS (the previous token's
 *        decay, deferred from its end), dS += qn dO^T; dqn_i = St[i,:] . dO; dkn_i = dS[i,:] . d
 *     P2 column tasks: dd_j = dS[:,j] . kn; dv = b dd (to dqkv), du = -dv, w = v - u
 *     P3 row tasks: dS += kn du^T; dkn_i += (a Sp[i,:]) . du (dqn, dkn to the ws);
 *        half-warp 0: dbeta = dd . w
 *     P4 half-warp 0: da = the flattened dS . Sp (one chain of dk dv / 16 FMAs a lane: the
 *        walk's longest step); dg = da a
 *   St (S after the token) and Sp (before it) are two shared buffers that swap roles: Sp of
 *   token t is St of token t - 1, and Sp of t - 1 streams in by cp.async from P2 of token t on,
 *   with the next token's vectors. Every dot is a lane-16 dot whose lanes are a half-warp. */
static __global__ void __launch_bounds__(GDN_BWD_THREADS, 1)
    gdn_bwd_kernel(float *__restrict__ dqkv, float *__restrict__ dg, float *__restrict__ dbeta,
                   const float *__restrict__ dout, const float *__restrict__ qkv,
                   const float *__restrict__ g, const float *__restrict__ beta, float *ws,
                   int n_seq, int T, gdn_dims D) {
    extern __shared__ float sm[];
    const int dk = D.dk, dv = D.dv, P = D.P, nv = D.nv, tid = threadIdx.x;
    const int C = KILN_GDN_CHUNK, n_chunks = (T + C - 1) / C;
    const int task = (int)blockIdx.x, b = task / nv, h = task - b * nv;
    const size_t SN = (size_t)dk * dv, N = (size_t)n_seq * T, row0 = (size_t)b * T;
    float *ck = ws + (size_t)task * D.per;                      /* (n_chunks, SN) */
    float *cs = ck + (size_t)n_chunks * SN;                     /* (C, SN) */
    float *cu = cs + (size_t)C * SN, *cd = cu + (size_t)C * dv; /* (C, dv) each */
    float *qn_g = ws + (size_t)n_seq * nv * D.per, *kn_g = qn_g + N * nv * dk;
    float *bufA = sm, *bufB = bufA + (size_t)dk * P, *dS = bufB + (size_t)dk * P;
    const int VB = gdn_vec_floats(dk, dv);
    float *vb0 = dS + (size_t)dk * P, *vb1 = vb0 + VB;
    float *dqn_s = vb1 + VB, *dkn_s = dqn_s + dk, *dd_s = dkn_s + dk, *du_s = dd_s + dv,
          *w_s = du_s + dv;
    const unsigned mask = half_warp_mask();
    const int row_tasks = ((dk + 31) & ~31) * 16, col_tasks = ((dv + 31) & ~31) * 16;

    for (size_t e = tid; e < (size_t)dk * P; e += GDN_BWD_THREADS) {
        bufA[e] = 0.0f;
        dS[e] = 0.0f;
    }
    /* the forward, saving each chunk's starting state */
    gdn_vec_load_async(vb0, row0, h, qn_g, kn_g, dout, qkv, g, beta, nullptr, nullptr, false, D);
    __pipeline_commit();
    for (int t = 0; t < T; t++) {
        const float *vb = (t & 1) ? vb1 : vb0;
        __pipeline_wait_prior(0);
        __syncthreads();
        if (t + 1 < T)
            gdn_vec_load_async((t & 1) ? vb0 : vb1, row0 + t + 1, h, qn_g, kn_g, dout, qkv, g, beta,
                               nullptr, nullptr, false, D);
        __pipeline_commit();
        if (t % C == 0) {
            gdn_state_store(ck + (size_t)(t / C) * SN, bufA, D);
            __syncthreads();
        }
        gdn_fwd_cols(bufA, vb, nullptr, nullptr, D);
    }

    bool pend = false; /* dS still owes the previous token's decay a_pend */
    float a_pend = 1.0f;
    for (int c = n_chunks - 1; c >= 0; c--) {
        const int t0 = c * C, t1 = min(t0 + C, T);
        __syncthreads(); /* the previous phase is done with the buffers */
        gdn_state_load_async(bufA, ck + (size_t)c * SN, D);
        gdn_vec_load_async(vb0, row0 + t0, h, qn_g, kn_g, dout, qkv, g, beta, nullptr, nullptr,
                           false, D);
        __pipeline_commit();
        for (int t = t0; t < t1; t++) {
            const int tc = t - t0;
            const float *vb = (tc & 1) ? vb1 : vb0;
            __pipeline_wait_prior(0);
            __syncthreads();
            if (t + 1 < t1)
                gdn_vec_load_async((tc & 1) ? vb0 : vb1, row0 + t + 1, h, qn_g, kn_g, dout, qkv, g,
                                   beta, nullptr, nullptr, false, D);
            __pipeline_commit();
            gdn_fwd_cols(bufA, vb, cu + (size_t)tc * dv, cd + (size_t)tc * dv, D);
            if (t + 1 < t1) { /* the chunk's last state stays in bufA: the walk's first St */
                __syncthreads();
                gdn_state_store(cs + (size_t)tc * SN, bufA, D);
            }
        }
        __syncthreads(); /* bufA final; cu, cd written */
        float *St = bufA, *Sp = bufB;
        gdn_state_load_async(
            Sp, t1 - 1 > t0 ? cs + (size_t)(t1 - 2 - t0) * SN : ck + (size_t)c * SN, D);
        gdn_vec_load_async(vb0, row0 + t1 - 1, h, qn_g, kn_g, dout, qkv, g, beta,
                           cu + (size_t)(t1 - 1 - t0) * dv, cd + (size_t)(t1 - 1 - t0) * dv, true,
                           D);
        __pipeline_commit();
        for (int t = t1 - 1; t >= t0; t--) {
            const size_t row = row0 + t;
            const int par = (t1 - 1 - t) & 1;
            const float *vb = par ? vb1 : vb0;
            const float *qn = vb, *kn = vb + dk, *dO = vb + 2 * dk, *uv = vb + 2 * dk + dv,
                        *dvec = vb + 2 * dk + 2 * dv, *vv = vb + 2 * dk + 3 * dv;
            __pipeline_wait_prior(0);
            __syncthreads(); /* Sp, the vectors, and the previous token's P4 */
            const float bt = vb[2 * dk + 4 * dv + 1];
            /* P1 */
            for (int k = tid; k < row_tasks; k += GDN_BWD_THREADS) {
                const int i = gdn_pair_index(k >> 4), l = k & 15;
                if (i >= dk) continue; /* uniform in the half-warp */
                float *ds = dS + (size_t)i * P;
                const float *s = St + (size_t)i * P;
                const float qi = qn[i];
                float aq = 0.0f, ak = 0.0f;
                for (int j = l; j < dv; j += 16) {
                    float x = ds[j];
                    if (pend) x = x * a_pend;
                    x = fmaf(qi, dO[j], x);
                    ds[j] = x;
                    aq = fmaf(s[j], dO[j], aq);
                    ak = fmaf(x, dvec[j], ak);
                }
                const float rq = lane16_tree(aq, mask), rk = lane16_tree(ak, mask);
                if (l == 0) {
                    dqn_s[i] = rq;
                    dkn_s[i] = rk;
                }
            }
            __syncthreads();
            /* St is free: the next token's Sp and vectors stream in from here */
            if (t > t0) {
                gdn_state_load_async(
                    St, t - 1 > t0 ? cs + (size_t)(t - 2 - t0) * SN : ck + (size_t)c * SN, D);
                gdn_vec_load_async(par ? vb0 : vb1, row - 1, h, qn_g, kn_g, dout, qkv, g, beta,
                                   cu + (size_t)(t - 1 - t0) * dv, cd + (size_t)(t - 1 - t0) * dv,
                                   true, D);
            }
            __pipeline_commit();
            /* P2 */
            for (int k = tid; k < col_tasks; k += GDN_BWD_THREADS) {
                const int j = gdn_pair_index(k >> 4), l = k & 15;
                if (j >= dv) continue;
                float acc = 0.0f;
                for (int i = l; i < dk; i += 16)
                    acc = fmaf(dS[(size_t)i * P + j], kn[i], acc);
                const float dd = lane16_tree(acc, mask);
                if (l == 0) {
                    const float dvo = bt * dd;
                    dqkv[row * D.W + 2 * (size_t)D.nk * dk + (size_t)h * dv + j] = dvo;
                    du_s[j] = -dvo;
                    w_s[j] = vv[j] - uv[j];
                    dd_s[j] = dd;
                }
            }
            __syncthreads();
            /* P3 */
            const float a = kiln_expf(vb[2 * dk + 4 * dv]);
            for (int k = tid; k < row_tasks; k += GDN_BWD_THREADS) {
                const int i = gdn_pair_index(k >> 4), l = k & 15;
                if (i >= dk) continue;
                float *ds = dS + (size_t)i * P;
                const float *sp = Sp + (size_t)i * P;
                const float ki = kn[i];
                float acc = 0.0f;
                for (int j = l; j < dv; j += 16) {
                    ds[j] = fmaf(ki, du_s[j], ds[j]);
                    const float sd = sp[j] * a;
                    acc = fmaf(sd, du_s[j], acc);
                }
                const float r = lane16_tree(acc, mask);
                if (l == 0) {
                    qn_g[(row * nv + h) * dk + i] = dqn_s[i];
                    kn_g[(row * nv + h) * dk + i] = dkn_s[i] + r;
                }
            }
            if (tid < 16) {
                float acc = 0.0f;
                for (int j = tid; j < dv; j += 16)
                    acc = fmaf(dd_s[j], w_s[j], acc);
                const float r = lane16_tree(acc, 0x0000ffffu);
                if (tid == 0) dbeta[row * nv + h] = r;
            }
            __syncthreads();
            /* P4 */
            if (tid < 16) {
                float da;
                switch (dv % 16 ? 0 : dv / 16) {
                case 1:
                    da = gdn_flat_dot<1>(dS, Sp, D);
                    break;
                case 2:
                    da = gdn_flat_dot<2>(dS, Sp, D);
                    break;
                case 4:
                    da = gdn_flat_dot<4>(dS, Sp, D);
                    break;
                case 8:
                    da = gdn_flat_dot<8>(dS, Sp, D);
                    break;
                case 16:
                    da = gdn_flat_dot<16>(dS, Sp, D);
                    break;
                default:
                    da = gdn_flat_dot<0>(dS, Sp, D);
                    break;
                }
                if (tid == 0) dg[row * nv + h] = da * a;
            }
            pend = true;
            a_pend = a;
            float *tmp = St;
            St = Sp;
            Sp = tmp;
        }
    }
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
    return gdn_bwd_smem_floats(dk, dv, gdn_bwd_pitch(dv)) * sizeof(float) <= (size_t)maxsm;
}

cudaError_t kiln_cuda_gated_delta_backward(cudaStream_t s, float *dqkv, float *dg, float *dbeta,
                                           const float *dout, const float *qkv, const float *g,
                                           const float *beta, float *ws, int n_seq, int T, int nk,
                                           int nv, int dk, int dv, float scale) {
    if (n_seq <= 0 || T <= 0) return cudaSuccess;
    if (!gdn_shape_ok(nk, nv, dk, dv)) return cudaErrorInvalidValue;
    if ((int64_t)n_seq * nv > 0x7fffffff) return cudaErrorInvalidConfiguration;
    if (!kiln_cuda_gated_delta_backward_fits(dk, dv)) return cudaErrorInvalidConfiguration;
    const size_t SN = (size_t)dk * dv, C = KILN_GDN_CHUNK;
    const size_t n_chunks = ((size_t)T + C - 1) / C;
    gdn_dims D;
    D.nk = nk;
    D.nv = nv;
    D.dk = dk;
    D.dv = dv;
    D.P = gdn_bwd_pitch(dv);
    D.scale = scale;
    D.W = 2 * (size_t)nk * dk + (size_t)nv * dv;
    /* kiln_cpu_gated_delta_backward's per-task block (its tail, scratch there, unused here) */
    D.per = n_chunks * SN + C * (SN + 2 * (size_t)dv) + 16 * (size_t)dv + 4 * (size_t)dk + 2 * SN;
    const size_t N = (size_t)n_seq * T, tasks = (size_t)n_seq * nv;
    float *qn_g = ws + tasks * D.per, *kn_g = qn_g + N * nv * dk;

    const int64_t n_norm = (int64_t)N * nv * 2, n_qk = (int64_t)N * nk * 2;
    gdn_bwd_norm_kernel<<<(unsigned)((n_norm + 15) / 16), 256, 0, s>>>(qn_g, kn_g, qkv, n_norm, D);
    const size_t smem = gdn_bwd_smem_floats(dk, dv, D.P) * sizeof(float);
    cudaError_t e = cudaFuncSetAttribute(gdn_bwd_kernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    gdn_bwd_kernel<<<(unsigned)tasks, GDN_BWD_THREADS, smem, s>>>(dqkv, dg, dbeta, dout, qkv, g,
                                                                  beta, ws, n_seq, T, D);
    gdn_bwd_qk_kernel<<<(unsigned)((n_qk + 15) / 16), 256, 0, s>>>(dqkv, qn_g, kn_g, qkv, n_qk, D);
    return cudaGetLastError();
}
