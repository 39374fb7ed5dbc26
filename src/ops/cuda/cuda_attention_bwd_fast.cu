/*
 * cuda_attention_bwd_fast.cu -- fast-mode attention backward on bf16 tensor cores (contract
 * and the kernels: cuda_attention_bwd_fast.h).
 *
 * The inputs are first packed to bf16 per head in the workspace (kiln_cuda_attn_pack_heads:
 * q, dout [NH][Npad][HS], k, v [KVH][Tpad][HS], padding rows zero; D = rowsum(dout * out)
 * comes out of dout's packing, with out f32 or bf16; with keep, q, k, v come packed by the
 * forward and only dout is packed), so every tile is whole: blocks copy tiles with cp.async,
 * double-buffered under the products of the previous tile, and take fragments with ldmatrix
 * (cuda_mma.cuh: ldsm_a for A operands, ldsm_b where B's n runs along a tile's rows, ldsm_bt
 * where B's k does -- no transposed copies). Tiles: 4 warps of 16 rows. The dq blocks' rows
 * are 64 queries and they walk the keys in tiles of BW_TILE(HS) (64 for HS 64, 32 for HS 128,
 * which keeps a thread under 255 registers); the dk/dv blocks' rows are 64 keys and they walk
 * the queries in tiles of BW_TILE(HS). D and L live in the workspace as [NH][Npad].
 *
 * Compiled with the CUDA backend's flags (--fmad=false): the products are mma.sync, the
 * few other FMAs are written (fmaf).
 */
#include "cuda_attention_bwd_fast.h"

#include "cuda_attention_fast.h"
#include "cuda_wgmma.cuh"
#include "cuda_wgmma.h"

#include "../ops.h"

#include <limits.h>
#include <math.h>

typedef __nv_bfloat16 bf16;

#define BW_THREADS 128 /* 4 warps */
#define BW_ROWS 64     /* rows of a block: queries (dq, stats), keys (dk/dv) */
#define BW_PAD 8       /* bf16 of padding per shared row (ldmatrix without bank conflicts) */
#define BW_TILE(HS) ((HS) == 64 ? 64 : 32)
static_assert(BW_ROWS == 16 * (BW_THREADS / 32), "one m16 tile of rows per warp");
static_assert(KILN_ATTN_PACK_ROWS % BW_ROWS == 0, "tiles never read past the packed rows");

/* acc(16 x HS) += P(16 x NT, C fragments p, rounded to bf16 here) x B, where B[k][n] is the
 * shared tile sB's row k (NT rows), column n (< HS). */
template <int HS, int NT>
static __device__ __forceinline__ void tile_times_rows(float acc[HS / 8][4],
                                                       const float p[NT / 8][4],
                                                       const bf16 *sB, int LD, int lane) {
#pragma unroll
    for (int j = 0; j < NT / 16; j++) {
        const uint32_t a[4] = {pack_bf16(p[2 * j][0], p[2 * j][1]),
                               pack_bf16(p[2 * j][2], p[2 * j][3]),
                               pack_bf16(p[2 * j + 1][0], p[2 * j + 1][1]),
                               pack_bf16(p[2 * j + 1][2], p[2 * j + 1][3])};
        frag_times_rows<HS>(acc, a, sB, LD, j * 16, lane);
    }
}

/* The packed inputs of one call (device pointers into the workspace). */
struct bw_args {
    const bf16 *qb, *ob, *kb, *vb; /* q, dout [B][NH][Npad][HS]; k, v [B][KVH][Tpad][HS] */
    const float *wsD, *wsL;        /* D, L [B][NH][Npad] (L: the forward's lse, or L_out) */
    float *L_out;                  /* where the statistics kernel writes L */
    float *dq, *dk, *dv;           /* dq (B*N, NH, HS); dk, dv or the GQA partials (B*T rows) */
    int N, n_past, NH, KVH, Npad, Tpad;
    float scale;
    /* the fused epilogue (kiln_cuda_attention_backward_fast_seqs16; dq16 NULL: none): the
     * stores write dq, and without GQA dk, dv, rotated back (RoPE's backward, the bits of
     * kiln_cuda_rope_backward_bf16) and rounded into dq16, dk16, dv16 (token rows ld16
     * apart), the f32 values too only with keep_f32; with GQA the reduction does it for dk,
     * dv. pos: the B*N tokens' positions (device). */
    uint16_t *dq16, *dk16, *dv16;
    int64_t ld16;
    int keep_f32;
    const int32_t *pos;
    const float *cos_tab, *sin_tab;
};

/* RoPE's backward on the pairs (a[j], b[j]), j < 2 (elements i + j and i + j + HS/2 of one
 * token's head, i even), at position p: kiln_cuda_rope_backward_bf16's f32 operations (no
 * contraction: the file is compiled with --fmad=false). */
template <int HS>
static __device__ __forceinline__ void rope_bwd_pairs(float (&a)[2], float (&b)[2],
                                                      const bw_args &A, int p, int i) {
    const size_t t = (size_t)p * (HS / 2) + i;
    const float2 c = *reinterpret_cast<const float2 *>(A.cos_tab + t);
    const float2 sn = *reinterpret_cast<const float2 *>(A.sin_tab + t);
    const float ra0 = a[0] * c.x + b[0] * sn.x, rb0 = b[0] * c.x - a[0] * sn.x;
    const float ra1 = a[1] * c.y + b[1] * sn.y, rb1 = b[1] * c.y - a[1] * sn.y;
    a[0] = ra0;
    a[1] = ra1;
    b[0] = rb0;
    b[1] = rb1;
}

static __device__ __forceinline__ uint32_t bf16_pair(float lo, float hi) {
    return (uint32_t)kiln_bf16_rne(lo) | ((uint32_t)kiln_bf16_rne(hi) << 16);
}

/* One token's values of one head in the fused epilogue: v(dt, j) gives element 8 dt + 2t + j
 * (dt < HS/8, j < 2), rotated back when rope (pairs dt and dt + HS/16), stored to d16 (bf16)
 * and, with keep_f32, f (f32); both point at the head's element 0 of the row. A pair at a
 * time, so the caller's accumulators are read in place (no copy to hold in registers). */
template <int HS, typename V>
static __device__ __forceinline__ void store_row16(const bw_args &A, V v, bool rope, int p, int t,
                                                   uint16_t *d16, float *f) {
#pragma unroll
    for (int dt = 0; dt < HS / 16; dt++) {
        float a[2] = {v(dt, 0), v(dt, 1)}, b[2] = {v(dt + HS / 16, 0), v(dt + HS / 16, 1)};
        if (rope) rope_bwd_pairs<HS>(a, b, A, p, 8 * dt + 2 * t);
        const int ca = 8 * dt + 2 * t, cb = ca + HS / 2;
        *reinterpret_cast<uint32_t *>(d16 + ca) = bf16_pair(a[0], a[1]);
        *reinterpret_cast<uint32_t *>(d16 + cb) = bf16_pair(b[0], b[1]);
        if (A.keep_f32) {
            *reinterpret_cast<float2 *>(f + ca) = make_float2(a[0], a[1]);
            *reinterpret_cast<float2 *>(f + cb) = make_float2(b[0], b[1]);
        }
    }
}

template <int HS>
static constexpr size_t stats_smem() {
    return sizeof(bf16) * (size_t)(HS + BW_PAD) * (BW_ROWS + 2 * BW_TILE(HS));
}

template <int HS>
static constexpr size_t dq_smem() {
    return sizeof(bf16) * (size_t)(HS + BW_PAD) * (2 * BW_ROWS + 4 * BW_TILE(HS));
}

template <int HS>
static constexpr size_t dkv_smem() {
    return sizeof(bf16) * (size_t)(HS + BW_PAD) * (2 * BW_ROWS + 4 * BW_TILE(HS)) +
           sizeof(float) * 4 * BW_TILE(HS);
}

/* Kernel 1: L, the log-sum-exp of the scaled scores, for a block per (64-query tile, head)
 * (the longest rows first): online over the key tiles like the forward, f32. Rows past N
 * get 0. */
template <int HS>
static __global__ void __launch_bounds__(BW_THREADS) bwd_stats_kernel(bw_args A) {
    constexpr int KT = BW_TILE(HS), LD = HS + BW_PAD;
    extern __shared__ __align__(16) unsigned char bw_sm[];
    bf16 *sQ = reinterpret_cast<bf16 *>(bw_sm); /* (BW_ROWS, LD) */
    bf16 *sK = sQ + BW_ROWS * LD;               /* 2 x (KT, LD) */
    const int qt = (int)(gridDim.x - 1 - blockIdx.x), b = (int)blockIdx.z;
    const int h = b * A.NH + (int)blockIdx.y; /* packed heads: [B][NH] as [B*NH] */
    const int kvh = b * A.KVH + (int)blockIdx.y / (A.NH / A.KVH);
    const int q0 = qt * BW_ROWS, N = A.N, n_past = A.n_past;
    const int rows = N - q0 < BW_ROWS ? N - q0 : BW_ROWS;
    const int kend = n_past + q0 + rows, nkt = (kend + KT - 1) / KT;
    const bf16 *kh = A.kb + (int64_t)kvh * A.Tpad * HS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
    const int lim0 = n_past + r0, lim1 = n_past + r1, wfirst = n_past + q0 + warp * 16;

    cp_tile<HS, BW_ROWS, BW_THREADS>(sQ, LD, A.qb + ((int64_t)h * A.Npad + q0) * HS);
    cp_tile<HS, KT, BW_THREADS>(sK, LD, kh);
    cp_async_commit();
    uint32_t qf[HS / 16][4];
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    for (int j = 0; j < nkt; j++) {
        const int k0 = j * KT, buf = j & 1;
        if (j + 1 < nkt) {
            cp_tile<HS, KT, BW_THREADS>(sK + (buf ^ 1) * KT * LD, LD, kh + (int64_t)(k0 + KT) * HS);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (j == 0) {
#pragma unroll
            for (int kk = 0; kk < HS / 16; kk++) ldsm_a(qf[kk], sQ, LD, warp * 16, kk * 16, lane);
        }
        float sc[KT / 8][4];
        rows_times_tile<HS, KT>(sc, qf, sK + buf * KT * LD, LD, lane);
        const bool mask = k0 + KT - 1 > wfirst;
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++) {
            const int key = k0 + nt * 8 + 2 * t;
            sc[nt][0] = !mask || key <= lim0 ? sc[nt][0] * A.scale : -INFINITY;
            sc[nt][1] = !mask || key + 1 <= lim0 ? sc[nt][1] * A.scale : -INFINITY;
            sc[nt][2] = !mask || key <= lim1 ? sc[nt][2] * A.scale : -INFINITY;
            sc[nt][3] = !mask || key + 1 <= lim1 ? sc[nt][3] * A.scale : -INFINITY;
            mx0 = fmaxf(mx0, fmaxf(sc[nt][0], sc[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(sc[nt][2], sc[nt][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float b0 = mn0 == -INFINITY ? 0.0f : mn0, b1 = mn1 == -INFINITY ? 0.0f : mn1;
        float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++) {
            ps0 = ps0 + (__expf(sc[nt][0] - b0) + __expf(sc[nt][1] - b0));
            ps1 = ps1 + (__expf(sc[nt][2] - b1) + __expf(sc[nt][3] - b1));
        }
        l0 = l0 * __expf(m0 - b0) + ps0;
        l1 = l1 * __expf(m1 - b1) + ps1;
        m0 = mn0;
        m1 = mn1;
        __syncthreads();
    }
    l0 = l0 + __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 = l0 + __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 = l1 + __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 = l1 + __shfl_xor_sync(0xffffffffu, l1, 2);
    if (t == 0) {
        float *L = A.L_out + (int64_t)h * A.Npad;
        L[r0] = r0 < N ? m0 + logf(l0) : 0.0f;
        L[r1] = r1 < N ? m1 + logf(l1) : 0.0f;
    }
}

/* A dq block's results (rows q0 + 16 warp + g and + 8, the thread's entries as in
 * dq_block; rows >= N write nothing): dq = scale * acc, at (row, head hl) of sequence b. */
template <int HS>
static __device__ __forceinline__ void dq_store(const bw_args &A, const float (&acc)[HS / 8][4],
                                                int q0, int hl, int b) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int64_t qs = (int64_t)A.NH * HS;
    if (HS == 64 && A.dq16) { /* HS 128 (mma.sync, 242 registers) would spill */
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int r = q0 + warp * 16 + g + 8 * half;
            if (r >= A.N) continue;
            const int64_t tok = (int64_t)b * A.N + r;
            auto v = [&](int dt, int j) { return acc[dt][2 * half + j] * A.scale; };
            store_row16<HS>(A, v, true, A.pos[tok], t, A.dq16 + tok * A.ld16 + (int64_t)hl * HS,
                            A.dq + tok * qs + (int64_t)hl * HS);
        }
        return;
    }
    float *dq = A.dq + (int64_t)b * A.N * qs + (int64_t)hl * HS + 2 * t;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int r = q0 + warp * 16 + g + 8 * half;
        if (r >= A.N) continue;
        float *p = dq + (int64_t)r * qs;
#pragma unroll
        for (int dt = 0; dt < HS / 8; dt++)
            *reinterpret_cast<float2 *>(p + dt * 8) =
                make_float2(acc[dt][2 * half] * A.scale, acc[dt][2 * half + 1] * A.scale);
    }
}

/* A dq block's weights for the thread's entries of one key tile (keys k0 + 8 nt + 2 t and
 * + 1; rows g: [nt][0..1], g + 8: [nt][2..3]), in two steps (the wgmma kernel runs a product
 * between them): dq_probs: sc <- P = exp(s scale - L) = 2^(s c - L log2 e), nL = -L log2 e;
 * with mask, a key past the row's last (lim0, lim1) is 0. dq_dsoft: sc <- dS = P (dP - D). */
template <int KT, bool MASK>
static __device__ __forceinline__ void dq_probs_t(float (&sc)[KT / 8][4], int k0, int t, int lim0,
                                                  int lim1, float c, float nL0, float nL1) {
#pragma unroll
    for (int nt = 0; nt < KT / 8; nt++) {
        const int key = k0 + nt * 8 + 2 * t;
        sc[nt][0] = !MASK || key <= lim0 ? ex2_approx(fmaf(sc[nt][0], c, nL0)) : 0.0f;
        sc[nt][1] = !MASK || key + 1 <= lim0 ? ex2_approx(fmaf(sc[nt][1], c, nL0)) : 0.0f;
        sc[nt][2] = !MASK || key <= lim1 ? ex2_approx(fmaf(sc[nt][2], c, nL1)) : 0.0f;
        sc[nt][3] = !MASK || key + 1 <= lim1 ? ex2_approx(fmaf(sc[nt][3], c, nL1)) : 0.0f;
    }
}

/* mask is uniform over a warp (its rows against the tile's keys): the unmasked form, most
 * tiles, has no comparisons or predicated exponentials (the same values either way) */
template <int KT>
static __device__ __forceinline__ void dq_probs(float (&sc)[KT / 8][4], bool mask, int k0, int t,
                                                int lim0, int lim1, float c, float nL0,
                                                float nL1) {
    if (mask)
        dq_probs_t<KT, true>(sc, k0, t, lim0, lim1, c, nL0, nL1);
    else
        dq_probs_t<KT, false>(sc, k0, t, lim0, lim1, c, nL0, nL1);
}

template <int KT>
static __device__ __forceinline__ void dq_dsoft(float (&sc)[KT / 8][4],
                                                const float (&dp)[KT / 8][4], float D0, float D1) {
#pragma unroll
    for (int nt = 0; nt < KT / 8; nt++) {
        sc[nt][0] = sc[nt][0] * (dp[nt][0] - D0);
        sc[nt][1] = sc[nt][1] * (dp[nt][1] - D0);
        sc[nt][2] = sc[nt][2] * (dp[nt][2] - D1);
        sc[nt][3] = sc[nt][3] * (dp[nt][3] - D1);
    }
}

/* A dq block: query tile qt of head hl of sequence b. Rows r0 = q0 + 16 warp + g and r1 =
 * r0 + 8 (padding rows compute on zeros and write nothing). dq = scale * sum over keys of
 * dS k. */
template <int HS>
static __device__ __forceinline__ void dq_block(const bw_args &A, int qt, int hl, int b) {
    constexpr int KT = BW_TILE(HS), LD = HS + BW_PAD;
    extern __shared__ __align__(16) unsigned char bw_sm[];
    bf16 *sQ = reinterpret_cast<bf16 *>(bw_sm); /* (BW_ROWS, LD) */
    bf16 *sO = sQ + BW_ROWS * LD;               /* (BW_ROWS, LD): dout */
    bf16 *sK = sO + BW_ROWS * LD;               /* 2 x (KT, LD) */
    bf16 *sV = sK + 2 * KT * LD;                /* 2 x (KT, LD) */
    const int h = b * A.NH + hl, kvh = b * A.KVH + hl / (A.NH / A.KVH); /* packed heads */
    const int q0 = qt * BW_ROWS, N = A.N, n_past = A.n_past;
    const int rows = N - q0 < BW_ROWS ? N - q0 : BW_ROWS;
    const int kend = n_past + q0 + rows, nkt = (kend + KT - 1) / KT;
    const bf16 *kh = A.kb + (int64_t)kvh * A.Tpad * HS, *vh = A.vb + (int64_t)kvh * A.Tpad * HS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
    const int lim0 = n_past + r0, lim1 = n_past + r1, wfirst = n_past + q0 + warp * 16;
    const int64_t hrow = (int64_t)h * A.Npad;

    cp_tile<HS, BW_ROWS, BW_THREADS>(sQ, LD, A.qb + (hrow + q0) * HS);
    cp_tile<HS, BW_ROWS, BW_THREADS>(sO, LD, A.ob + (hrow + q0) * HS);
    cp_tile<HS, KT, BW_THREADS>(sK, LD, kh);
    cp_tile<HS, KT, BW_THREADS>(sV, LD, vh);
    cp_async_commit();
    const float D0 = A.wsD[hrow + r0], D1 = A.wsD[hrow + r1];
    const float nL0 = -A.wsL[hrow + r0] * KILN_LOG2E, nL1 = -A.wsL[hrow + r1] * KILN_LOG2E;
    const float c = A.scale * KILN_LOG2E;
    uint32_t qf[HS / 16][4], of[HS / 16][4];
    float acc[HS / 8][4];
#pragma unroll
    for (int dt = 0; dt < HS / 8; dt++) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.0f;
    for (int j = 0; j < nkt; j++) {
        const int k0 = j * KT, buf = j & 1;
        if (j + 1 < nkt) {
            cp_tile<HS, KT, BW_THREADS>(sK + (buf ^ 1) * KT * LD, LD, kh + (int64_t)(k0 + KT) * HS);
            cp_tile<HS, KT, BW_THREADS>(sV + (buf ^ 1) * KT * LD, LD, vh + (int64_t)(k0 + KT) * HS);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (j == 0) {
#pragma unroll
            for (int kk = 0; kk < HS / 16; kk++) {
                ldsm_a(qf[kk], sQ, LD, warp * 16, kk * 16, lane);
                ldsm_a(of[kk], sO, LD, warp * 16, kk * 16, lane);
            }
        }
        const bf16 *cK = sK + buf * KT * LD, *cV = sV + buf * KT * LD;
        float sc[KT / 8][4], dp[KT / 8][4];
        rows_times_tile<HS, KT>(sc, qf, cK, LD, lane);
        rows_times_tile<HS, KT>(dp, of, cV, LD, lane);
        dq_probs<KT>(sc, k0 + KT - 1 > wfirst, k0, t, lim0, lim1, c, nL0, nL1);
        dq_dsoft<KT>(sc, dp, D0, D1);
        tile_times_rows<HS, KT>(acc, sc, cK, LD, lane); /* dq += dS k */
        __syncthreads();
    }
    dq_store<HS>(A, acc, q0, hl, b);
}

/* A dk/dv block's results for its keys key0, key1 (thread entries as in dkv_block): G = 1:
 * this head's are the kv head's gradients; else partials at (key, hl); sequence b's keys are
 * rows b*T.. . dk gets the scale here. Keys >= T (padding) write nothing. */
template <int HS>
static __device__ __forceinline__ void dkv_store(const bw_args &A, const float (&ak)[HS / 8][4],
                                                 const float (&av)[HS / 8][4], int hl, int b,
                                                 int G, int T, int key0, int key1, int t) {
    const int64_t ks = G == 1 ? (int64_t)A.KVH * HS : (int64_t)A.NH * HS;
    const int64_t hoff = (int64_t)b * T * ks + (int64_t)(G == 1 ? hl / G : hl) * HS;
    if (HS == 64 && G == 1 && A.dq16) { /* the final dk, dv: rotated (dk) and rounded here */
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int key = half ? key1 : key0;
            if (key >= T) continue;
            const int64_t tok = (int64_t)b * T + key, o16 = tok * A.ld16 + (int64_t)hl * HS;
            auto vk = [&](int dt, int j) { return ak[dt][2 * half + j] * A.scale; };
            auto vv = [&](int dt, int j) { return av[dt][2 * half + j]; };
            store_row16<HS>(A, vk, true, A.pos[tok], t, A.dk16 + o16, A.dk + tok * ks + hl * HS);
            store_row16<HS>(A, vv, false, 0, t, A.dv16 + o16, A.dv + tok * ks + hl * HS);
        }
        return;
    }
    if (key0 < T) {
        float *pk = A.dk + (int64_t)key0 * ks + hoff + 2 * t;
        float *pv = A.dv + (int64_t)key0 * ks + hoff + 2 * t;
#pragma unroll
        for (int dt = 0; dt < HS / 8; dt++) {
            *reinterpret_cast<float2 *>(pk + dt * 8) =
                make_float2(ak[dt][0] * A.scale, ak[dt][1] * A.scale);
            *reinterpret_cast<float2 *>(pv + dt * 8) = make_float2(av[dt][0], av[dt][1]);
        }
    }
    if (key1 < T) {
        float *pk = A.dk + (int64_t)key1 * ks + hoff + 2 * t;
        float *pv = A.dv + (int64_t)key1 * ks + hoff + 2 * t;
#pragma unroll
        for (int dt = 0; dt < HS / 8; dt++) {
            *reinterpret_cast<float2 *>(pk + dt * 8) =
                make_float2(ak[dt][2] * A.scale, ak[dt][3] * A.scale);
            *reinterpret_cast<float2 *>(pv + dt * 8) = make_float2(av[dt][2], av[dt][3]);
        }
    }
}

/* The weights of one dk/dv tile, in place, for the thread's entries c[0] (key0, qi), c[1]
 * (key0, qi + 1), c[2] (key1, qi), c[3] (key1, qi + 1), qi = 8 nt + 2 t, in two steps (the
 * wgmma kernel runs a product between them): dkv_probs: st <- P^T = exp(s scale - L) =
 * 2^(s c - L log2 e), cL the tile's L; MASK: an entry whose query (position qpos0 + qi) comes
 * before its key, or is a padding row (q0 + qi >= N), is 0; without MASK no entry is (the
 * caller's test is uniform per tile). dkv_dsoft: dpt <- dS^T = P^T (dP^T - D), cD the
 * tile's D. dkv_weights: both. */
template <int QT, bool MASK>
static __device__ __forceinline__ void dkv_probs(float (&st)[QT / 8][4], const float *cL, float c,
                                                 int t, int q0, int qpos0, int N, int key0,
                                                 int key1) {
#pragma unroll
    for (int nt = 0; nt < QT / 8; nt++) {
        const int qi = nt * 8 + 2 * t;
        const float2 L = *reinterpret_cast<const float2 *>(cL + qi); /* qi even: 8-byte aligned */
        const float nL0 = -L.x * KILN_LOG2E, nL1 = -L.y * KILN_LOG2E;
        float p00 = ex2_approx(fmaf(st[nt][0], c, nL0)), p01 = ex2_approx(fmaf(st[nt][1], c, nL1));
        float p10 = ex2_approx(fmaf(st[nt][2], c, nL0)), p11 = ex2_approx(fmaf(st[nt][3], c, nL1));
        if (MASK) {
            const int qa = qpos0 + qi;
            const bool in0 = q0 + qi < N, in1 = q0 + qi + 1 < N;
            p00 = in0 && qa >= key0 ? p00 : 0.0f;
            p01 = in1 && qa + 1 >= key0 ? p01 : 0.0f;
            p10 = in0 && qa >= key1 ? p10 : 0.0f;
            p11 = in1 && qa + 1 >= key1 ? p11 : 0.0f;
        }
        st[nt][0] = p00;
        st[nt][1] = p01;
        st[nt][2] = p10;
        st[nt][3] = p11;
    }
}

template <int QT>
static __device__ __forceinline__ void dkv_dsoft(float (&dpt)[QT / 8][4],
                                                 const float (&st)[QT / 8][4], const float *cD,
                                                 int t) {
#pragma unroll
    for (int nt = 0; nt < QT / 8; nt++) {
        const int qi = nt * 8 + 2 * t;
        const float2 D = *reinterpret_cast<const float2 *>(cD + qi);
        const float D0 = D.x, D1 = D.y;
        dpt[nt][0] = st[nt][0] * (dpt[nt][0] - D0);
        dpt[nt][1] = st[nt][1] * (dpt[nt][1] - D1);
        dpt[nt][2] = st[nt][2] * (dpt[nt][2] - D0);
        dpt[nt][3] = st[nt][3] * (dpt[nt][3] - D1);
    }
}

template <int QT, bool MASK>
static __device__ __forceinline__ void dkv_weights(float (&st)[QT / 8][4], float (&dpt)[QT / 8][4],
                                                   const float *cL, const float *cD, float c,
                                                   int t, int q0, int qpos0, int N, int key0,
                                                   int key1) {
    dkv_probs<QT, MASK>(st, cL, c, t, q0, qpos0, N, key0, key1);
    dkv_dsoft<QT>(dpt, st, cD, t);
}

/* A dk/dv block: key tile kt for query head hl of sequence b. Keys key0 = k0 + 16 warp + g
 * and key1 = key0 + 8 (padding keys >= T are zeros, masked, and write nothing). Writes dk,
 * dv of kv head hl / G directly when G = 1, else this head's partials (T, NH, HS). */
template <int HS, bool KV_REGS>
static __device__ __forceinline__ void dkv_block(const bw_args &A, int kt, int hl, int b) {
    constexpr int QT = BW_TILE(HS), LD = HS + BW_PAD; /* KV_REGS: k, v fragments kept in
                                                         registers, else reloaded per tile */
    extern __shared__ __align__(16) unsigned char bw_sm[];
    bf16 *sK = reinterpret_cast<bf16 *>(bw_sm); /* (BW_ROWS, LD) */
    bf16 *sV = sK + BW_ROWS * LD;               /* (BW_ROWS, LD) */
    bf16 *sQ = sV + BW_ROWS * LD;               /* 2 x (QT, LD) */
    bf16 *sO = sQ + 2 * QT * LD;                /* 2 x (QT, LD): dout */
    float *sL = reinterpret_cast<float *>(sO + 2 * QT * LD); /* 2 x QT */
    float *sD = sL + 2 * QT;                                 /* 2 x QT */
    const int G = A.NH / A.KVH, N = A.N, n_past = A.n_past;
    const int h = b * A.NH + hl, kvh = b * A.KVH + hl / G; /* packed heads */
    const int k0 = kt * BW_ROWS, T = n_past + N;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int key0 = k0 + warp * 16 + g, key1 = key0 + 8, wlast = k0 + warp * 16 + 15;
    const float c = A.scale * KILN_LOG2E;
    const int64_t hrow = (int64_t)h * A.Npad;
    const bf16 *qh = A.qb + hrow * HS, *oh = A.ob + hrow * HS;
    const int first = k0 - n_past > 0 ? k0 - n_past : 0; /* the first query that sees key k0 */
    const int qbeg = first / QT * QT, nqt = (N - qbeg + QT - 1) / QT;

    /* one tile of queries: q, dout rows and their L, D (QT floats each: QT / 4 chunks) */
    auto copy_queries = [&](int q0, int buf) {
        cp_tile<HS, QT, BW_THREADS>(sQ + buf * QT * LD, LD, qh + (int64_t)q0 * HS);
        cp_tile<HS, QT, BW_THREADS>(sO + buf * QT * LD, LD, oh + (int64_t)q0 * HS);
        const int c = (int)threadIdx.x;
        if (c < QT / 4)
            cp_async16(sL + buf * QT + 4 * c, A.wsL + hrow + q0 + 4 * c);
        else if (c < QT / 2)
            cp_async16(sD + buf * QT + 4 * (c - QT / 4), A.wsD + hrow + q0 + 4 * (c - QT / 4));
    };
    cp_tile<HS, BW_ROWS, BW_THREADS>(sK, LD, A.kb + ((int64_t)kvh * A.Tpad + k0) * HS);
    cp_tile<HS, BW_ROWS, BW_THREADS>(sV, LD, A.vb + ((int64_t)kvh * A.Tpad + k0) * HS);
    if (nqt > 0) copy_queries(qbeg, 0);
    cp_async_commit();

    uint32_t kf[KV_REGS ? HS / 16 : 1][4], vf[KV_REGS ? HS / 16 : 1][4];
    float ak[HS / 8][4], av[HS / 8][4];
#pragma unroll
    for (int dt = 0; dt < HS / 8; dt++) {
        ak[dt][0] = ak[dt][1] = ak[dt][2] = ak[dt][3] = 0.0f;
        av[dt][0] = av[dt][1] = av[dt][2] = av[dt][3] = 0.0f;
    }
    for (int it = 0; it < nqt; it++) {
        const int q0 = qbeg + it * QT, buf = it & 1;
        if (it + 1 < nqt) {
            copy_queries(q0 + QT, buf ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (KV_REGS && it == 0) {
#pragma unroll
            for (int kk = 0; kk < (KV_REGS ? HS / 16 : 1); kk++) {
                ldsm_a(kf[kk], sK, LD, warp * 16, kk * 16, lane);
                ldsm_a(vf[kk], sV, LD, warp * 16, kk * 16, lane);
            }
        }
        const bf16 *cQ = sQ + buf * QT * LD, *cO = sO + buf * QT * LD;
        const float *cL = sL + buf * QT, *cD = sD + buf * QT;

        /* S^T = k q^T and dP^T = v dout^T for the warp's 16 keys x QT queries */
        float st[QT / 8][4], dpt[QT / 8][4];
#pragma unroll
        for (int nt = 0; nt < QT / 8; nt++) {
            st[nt][0] = st[nt][1] = st[nt][2] = st[nt][3] = 0.0f;
            dpt[nt][0] = dpt[nt][1] = dpt[nt][2] = dpt[nt][3] = 0.0f;
        }
#pragma unroll
        for (int kk = 0; kk < HS / 16; kk++) {
            uint32_t a_k[4], a_v[4];
            if (KV_REGS) {
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    a_k[r] = kf[KV_REGS ? kk : 0][r];
                    a_v[r] = vf[KV_REGS ? kk : 0][r];
                }
            } else {
                ldsm_a(a_k, sK, LD, warp * 16, kk * 16, lane);
                ldsm_a(a_v, sV, LD, warp * 16, kk * 16, lane);
            }
#pragma unroll
            for (int np = 0; np < QT / 16; np++) {
                uint32_t bq[4], bo[4];
                ldsm_b(bq, cQ, LD, np * 16, kk * 16, lane);
                ldsm_b(bo, cO, LD, np * 16, kk * 16, lane);
                mma_bf16_16816(st[2 * np], a_k, bq);
                mma_bf16_16816(st[2 * np + 1], a_k, bq + 2);
                mma_bf16_16816(dpt[2 * np], a_v, bo);
                mma_bf16_16816(dpt[2 * np + 1], a_v, bo + 2);
            }
        }
        /* P^T and dS^T (a tile with a query before one of the warp's keys, or padding
         * queries, is masked); dS^T rounded to bf16 once, for the dk product */
        if (n_past + q0 < wlast || q0 + QT > N)
            dkv_weights<QT, true>(st, dpt, cL, cD, c, t, q0, n_past + q0, N, key0, key1);
        else
            dkv_weights<QT, false>(st, dpt, cL, cD, c, t, q0, n_past + q0, N, key0, key1);
        tile_times_rows<HS, QT>(av, st, cO, LD, lane); /* dv += P^T dout */
        uint32_t dsp[QT / 8][2];                       /* dS^T pairs: [nt][0] key0, [1] key1 */
#pragma unroll
        for (int nt = 0; nt < QT / 8; nt++) {
            dsp[nt][0] = pack_bf16(dpt[nt][0], dpt[nt][1]);
            dsp[nt][1] = pack_bf16(dpt[nt][2], dpt[nt][3]);
        }
#pragma unroll
        for (int j = 0; j < QT / 16; j++) { /* dk += dS^T q (tile_times_rows on dsp) */
            const uint32_t a[4] = {dsp[2 * j][0], dsp[2 * j][1], dsp[2 * j + 1][0],
                                   dsp[2 * j + 1][1]};
            frag_times_rows<HS>(ak, a, cQ, LD, j * 16, lane);
        }
        __syncthreads();
    }

    dkv_store<HS>(A, ak, av, hl, b, G, T, key0, key1, t);
}

/* Kernel 2: the dk/dv blocks (x < nkt: key tile x, the ones that see the most queries first)
 * and the dq blocks (x >= nkt: query tiles, the longest first) in one launch, so that the GPU
 * holds twice the blocks of either alone; they are independent given D and L. */
/* HS 64 keeps the dk/dv blocks' k, v fragments in registers (249 registers, 2 blocks per SM
 * with the shared memory; a 168-register build for 3 blocks per SM, fragments reloaded from
 * shared memory per tile, measured the same on the H200); HS 128 reloads them. */
template <int HS>
static __global__ void __launch_bounds__(BW_THREADS) bwd_main_kernel(bw_args A, int nkt) {
    const int x = (int)blockIdx.x, h = (int)blockIdx.y, b = (int)blockIdx.z;
    if (x < nkt)
        dkv_block<HS, HS == 64>(A, x, h, b);
    else
        dq_block<HS>(A, (int)gridDim.x - 1 - x, h, b);
}

/* ==== the one launch on Hopper's warpgroup products (sm_90a; cuda_wgmma.cuh) ================
 * The same blocks, grid, tiles, arithmetic and outputs as bwd_main_kernel<64>, with the
 * products on wgmma m64n64k16 instead of mma.sync: the block's four warps are one warpgroup,
 * its 64 rows the product's M, and each warp's accumulator entries are the m16n8 C fragments
 * the mma.sync kernels hold (cuda_wgmma.cuh), so the weights (dkv_probs, dq_probs, ...) and
 * the dk, dv, dq stores are shared. Tiles are SW128 (64 bf16 a row, 128-byte swizzle) and
 * every B operand is read by the product straight from shared memory (no ldmatrix): k, v, q
 * and dout tiles are each K-major for one product and MN-major for another. Only the f32 sums
 * inside a product may group differently from mma.sync, so the results are within the fast
 * bound, not the mma.sync kernels' bits (deterministic all the same). */
#define WG_TILE 4096 /* bf16 of a 64 x 64 SW128 tile (8 KiB) */

static constexpr size_t dkv_wg_smem() {
    return sizeof(bf16) * 6 * WG_TILE + sizeof(float) * 4 * 64 + KILN_SW128_ALIGN;
}
static_assert(dkv_wg_smem() >= sizeof(bf16) * 6 * WG_TILE + KILN_SW128_ALIGN,
              "the one-launch kernel's dq blocks (6 tiles) fit the dk/dv blocks' shared memory");

/* A dk/dv block (dkv_block<64, true>'s work): per query tile, S^T = k q^T and dP^T = v dout^T
 * (A = the k, v tiles, B = the q, dout tiles, all K-major), then dv += P^T dout and dk +=
 * dS^T q (A = P^T, dS^T from registers as bf16, B = the dout, q tiles read MN-major). */
#if KILN_WGMMA_DEVICE
static __device__ __forceinline__ void dkv_wgmma_block(const bw_args &A, int kt, int hl, int b) {
    constexpr int HS = 64, QT = 64;
    extern __shared__ __align__(16) unsigned char bw_sm[];
    bf16 *sK = sw128_tiles(bw_sm), *sV = sK + WG_TILE;
    bf16 *sQ = sV + WG_TILE, *sO = sQ + 2 * WG_TILE; /* 2 tiles each */
    float *sL = reinterpret_cast<float *>(sO + 2 * WG_TILE), *sD = sL + 2 * QT;
    const int G = A.NH / A.KVH, N = A.N, n_past = A.n_past;
    const int h = b * A.NH + hl, kvh = b * A.KVH + hl / G; /* packed heads */
    const int k0 = kt * BW_ROWS, T = n_past + N;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int key0 = k0 + warp * 16 + g, key1 = key0 + 8, wlast = k0 + warp * 16 + 15;
    const float c = A.scale * KILN_LOG2E;
    const int64_t hrow = (int64_t)h * A.Npad;
    const bf16 *qh = A.qb + hrow * HS, *oh = A.ob + hrow * HS;
    const int first = k0 - n_past > 0 ? k0 - n_past : 0; /* the first query that sees key k0 */
    const int qbeg = first / QT * QT, nqt = (N - qbeg + QT - 1) / QT;

    auto copy_queries = [&](int q0, int buf) {
        cp_tile_sw128<QT, BW_THREADS>(sQ + buf * WG_TILE, qh + (int64_t)q0 * HS, HS);
        cp_tile_sw128<QT, BW_THREADS>(sO + buf * WG_TILE, oh + (int64_t)q0 * HS, HS);
        const int ci = (int)threadIdx.x;
        if (ci < QT / 4)
            cp_async16(sL + buf * QT + 4 * ci, A.wsL + hrow + q0 + 4 * ci);
        else if (ci < QT / 2)
            cp_async16(sD + buf * QT + 4 * (ci - QT / 4), A.wsD + hrow + q0 + 4 * (ci - QT / 4));
    };
    cp_tile_sw128<BW_ROWS, BW_THREADS>(sK, A.kb + ((int64_t)kvh * A.Tpad + k0) * HS, HS);
    cp_tile_sw128<BW_ROWS, BW_THREADS>(sV, A.vb + ((int64_t)kvh * A.Tpad + k0) * HS, HS);
    if (nqt > 0) copy_queries(qbeg, 0);
    cp_async_commit();

    float ak[HS / 8][4], av[HS / 8][4], st[QT / 8][4], dpt[QT / 8][4];
#pragma unroll
    for (int i = 0; i < HS / 8; i++)
#pragma unroll
        for (int r = 0; r < 4; r++) ak[i][r] = av[i][r] = st[i][r] = dpt[i][r] = 0.0f;
    const uint64_t dK = sw128_desc(sK), dV = sw128_desc(sV);
    for (int it = 0; it < nqt; it++) {
        const int q0 = qbeg + it * QT, buf = it & 1;
        tile_walk_step(it, nqt, [&](int i, int b2) { copy_queries(qbeg + i * QT, b2); });
        const uint64_t dQ = sw128_desc(sQ + buf * WG_TILE), dO = sw128_desc(sO + buf * WG_TILE);
        const float *cL = sL + buf * QT, *cD = sD + buf * QT;

        /* S^T = k q^T, then dP^T = v dout^T (64 keys x 64 queries; accumulate 0 overwrites),
         * two groups: P^T is computed while dP^T's product runs, dS^T while dv's does */
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HS / 16; kk++)
            wgmma_ss<0, 0>(&st[0][0], dK + SW128_KSTEP_K * kk, dQ + SW128_KSTEP_K * kk, kk > 0);
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < HS / 16; kk++)
            wgmma_ss<0, 0>(&dpt[0][0], dV + SW128_KSTEP_K * kk, dO + SW128_KSTEP_K * kk, kk > 0);
        wgmma_commit();
        wgmma_wait<1>(); /* S^T */
        wgmma_fence_operands(&st[0][0]);
        const bool mask = n_past + q0 < wlast || q0 + QT > N;
        if (mask)
            dkv_probs<QT, true>(st, cL, c, t, q0, n_past + q0, N, key0, key1);
        else
            dkv_probs<QT, false>(st, cL, c, t, q0, n_past + q0, N, key0, key1);
        uint32_t pp[QT / 8][2], dsp[QT / 8][2]; /* P^T, dS^T pairs: [nt][0] key0, [1] key1 */
#pragma unroll
        for (int nt = 0; nt < QT / 8; nt++) {
            pp[nt][0] = pack_bf16(st[nt][0], st[nt][1]);
            pp[nt][1] = pack_bf16(st[nt][2], st[nt][3]);
        }
        wgmma_fence(); /* dv += P^T dout: k-steps of 16 queries */
#pragma unroll
        for (int j = 0; j < QT / 16; j++) {
            const uint32_t a[4] = {pp[2 * j][0], pp[2 * j][1], pp[2 * j + 1][0], pp[2 * j + 1][1]};
            wgmma_rs<1>(&av[0][0], a, dO + SW128_KSTEP_MN * j, 1);
        }
        wgmma_commit();
        wgmma_wait<1>(); /* dP^T */
        wgmma_fence_operands(&dpt[0][0]);
        dkv_dsoft<QT>(dpt, st, cD, t);
#pragma unroll
        for (int nt = 0; nt < QT / 8; nt++) {
            dsp[nt][0] = pack_bf16(dpt[nt][0], dpt[nt][1]);
            dsp[nt][1] = pack_bf16(dpt[nt][2], dpt[nt][3]);
        }
        wgmma_fence(); /* dk += dS^T q */
#pragma unroll
        for (int j = 0; j < QT / 16; j++) {
            const uint32_t a[4] = {dsp[2 * j][0], dsp[2 * j][1], dsp[2 * j + 1][0],
                                   dsp[2 * j + 1][1]};
            wgmma_rs<1>(&ak[0][0], a, dQ + SW128_KSTEP_MN * j, 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(&av[0][0]);
        wgmma_fence_operands(&ak[0][0]);
        __syncthreads();
    }
    dkv_store<HS>(A, ak, av, hl, b, G, T, key0, key1, t);
}

/* A dq block recomputing S and dP (dq_block's work): per key tile, S = q k^T and dP =
 * dout v^T (A = the q, dout tiles, B = the k, v tiles, all K-major), P computed while dP's
 * product runs, then dq += dS k (A = dS from registers, B = the k tile read MN-major). The
 * walk is pipelined: the next key tile's S and dP are issued before waiting for this tile's
 * dq product, so they run under its tail and the barrier. */
static __device__ __forceinline__ void dq_wgmma_block(const bw_args &A, int qt, int hl, int b) {
    constexpr int HS = 64, KT = 64;
    extern __shared__ __align__(16) unsigned char bw_sm[];
    bf16 *sQ = sw128_tiles(bw_sm), *sO = sQ + WG_TILE;
    bf16 *sK = sO + WG_TILE, *sV = sK + 2 * WG_TILE; /* 2 tiles each */
    const int h = b * A.NH + hl, kvh = b * A.KVH + hl / (A.NH / A.KVH); /* packed heads */
    const int q0 = qt * BW_ROWS, N = A.N, n_past = A.n_past;
    const int rows = N - q0 < BW_ROWS ? N - q0 : BW_ROWS;
    const int kend = n_past + q0 + rows, nkt = (kend + KT - 1) / KT;
    const bf16 *kh = A.kb + (int64_t)kvh * A.Tpad * HS, *vh = A.vb + (int64_t)kvh * A.Tpad * HS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
    const int lim0 = n_past + r0, lim1 = n_past + r1, wfirst = n_past + q0 + warp * 16;
    const int64_t hrow = (int64_t)h * A.Npad;

    auto copy_keys = [&](int j, int buf) {
        cp_tile_sw128<KT, BW_THREADS>(sK + buf * WG_TILE, kh + (int64_t)j * KT * HS, HS);
        cp_tile_sw128<KT, BW_THREADS>(sV + buf * WG_TILE, vh + (int64_t)j * KT * HS, HS);
    };
    cp_tile_sw128<BW_ROWS, BW_THREADS>(sQ, A.qb + (hrow + q0) * HS, HS);
    cp_tile_sw128<BW_ROWS, BW_THREADS>(sO, A.ob + (hrow + q0) * HS, HS);
    copy_keys(0, 0);
    cp_async_commit();
    if (nkt > 1) copy_keys(1, 1); /* two key tiles in flight from the start */
    cp_async_commit();
    const float D0 = A.wsD[hrow + r0], D1 = A.wsD[hrow + r1];
    const float nL0 = -A.wsL[hrow + r0] * KILN_LOG2E, nL1 = -A.wsL[hrow + r1] * KILN_LOG2E;
    const float c = A.scale * KILN_LOG2E;
    float acc[HS / 8][4], sc[KT / 8][4], dp[KT / 8][4];
#pragma unroll
    for (int i = 0; i < KT / 8; i++)
#pragma unroll
        for (int r = 0; r < 4; r++) acc[i][r] = sc[i][r] = dp[i][r] = 0.0f;
    const uint64_t dQ = sw128_desc(sQ), dO = sw128_desc(sO);

    /* S = q k^T, then dP = dout v^T for the key tile in buf: two groups */
    auto issue_scores = [&](int buf) {
        const uint64_t dK = sw128_desc(sK + buf * WG_TILE), dV = sw128_desc(sV + buf * WG_TILE);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HS / 16; kk++)
            wgmma_ss<0, 0>(&sc[0][0], dQ + SW128_KSTEP_K * kk, dK + SW128_KSTEP_K * kk, kk > 0);
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < HS / 16; kk++)
            wgmma_ss<0, 0>(&dp[0][0], dO + SW128_KSTEP_K * kk, dV + SW128_KSTEP_K * kk, kk > 0);
        wgmma_commit();
    };
    /* With key tile j's S and dP the two groups in flight: P while dP's product runs, dS, then
     * dq += dS k (left in flight: the caller waits for it). */
    auto finish_tile = [&](int j, int buf) {
        const int k0 = j * KT;
        const uint64_t dK = sw128_desc(sK + buf * WG_TILE);
        wgmma_wait<1>(); /* S */
        wgmma_fence_operands(&sc[0][0]);
        dq_probs<KT>(sc, k0 + KT - 1 > wfirst, k0, t, lim0, lim1, c, nL0, nL1);
        wgmma_wait<0>(); /* dP */
        wgmma_fence_operands(&dp[0][0]);
        dq_dsoft<KT>(sc, dp, D0, D1);
        uint32_t da[KT / 16][4]; /* dS's A fragments, all made before the products */
#pragma unroll
        for (int jj = 0; jj < KT / 16; jj++) {
            da[jj][0] = pack_bf16(sc[2 * jj][0], sc[2 * jj][1]);
            da[jj][1] = pack_bf16(sc[2 * jj][2], sc[2 * jj][3]);
            da[jj][2] = pack_bf16(sc[2 * jj + 1][0], sc[2 * jj + 1][1]);
            da[jj][3] = pack_bf16(sc[2 * jj + 1][2], sc[2 * jj + 1][3]);
        }
        wgmma_fence(); /* dq += dS k: k-steps of 16 keys */
#pragma unroll
        for (int jj = 0; jj < KT / 16; jj++)
            wgmma_rs<1>(&acc[0][0], da[jj], dK + SW128_KSTEP_MN * jj, 1);
        wgmma_commit();
    };

    if (nkt > 0) {
        cp_async_wait<1>(); /* q, dout and key tile 0 */
        wgmma_proxy_fence();
        __syncthreads();
        issue_scores(0);
    }
    for (int j = 0; j < nkt; j++) {
        const int buf = j & 1;
        finish_tile(j, buf);
        if (j + 1 < nkt) { /* the next tile's S and dP under this tile's dq product */
            cp_async_wait<0>(); /* key tile j + 1 */
            wgmma_proxy_fence();
            __syncthreads();
            issue_scores(buf ^ 1);
            wgmma_wait<2>(); /* dq's product of tile j */
        } else {
            wgmma_wait<0>();
            /* only here: an operand fence while products are in flight makes ptxas
             * serialize every wgmma of the kernel (C7515) */
            wgmma_fence_operands(&acc[0][0]);
        }
        __syncthreads(); /* every warp is done with buf: key tile j + 2 may land there */
        if (j + 2 < nkt) {
            copy_keys(j + 2, buf);
            cp_async_commit();
        }
    }
    dq_store<HS>(A, acc, q0, hl, b);
}
#endif /* KILN_WGMMA_DEVICE */

/* The backward on wgmma (bwd_main_kernel's split: x < nkt dk/dv blocks, the rest dq blocks
 * recomputing S and dP, longest first). The dq blocks' pipelined walk has a plain walk's bits
 * (the same products of the same values in the same order) and took the backward 0.344 ->
 * 0.331 ms for the 0.5B shape's B 4 x 2048, 0.430 -> 0.412 for the 135M shape's B 8 on the
 * H200 (bench/RESULTS.md, 2026-12-02, d571da7). The dk/dv blocks keep the plain walk:
 * pipelined too (the next S^T under the dk product; dP^T could not be issued early, nor the
 * two kinds inlined into one kernel, without ptxas serializing every wgmma: C7515), as
 * noinline functions, the backward was slower (0.343 -> 0.410 ms: 210 registers, the
 * arguments copied to the stack). */
static __global__ void __launch_bounds__(BW_THREADS) bwd_main_wgmma_kernel(bw_args A, int nkt) {
#if KILN_WGMMA_DEVICE
    const int x = (int)blockIdx.x, h = (int)blockIdx.y, b = (int)blockIdx.z;
    if (x < nkt)
        dkv_wgmma_block(A, x, h, b);
    else
        dq_wgmma_block(A, (int)gridDim.x - 1 - x, h, b);
#else
    (void)A;
    (void)nkt;
    __trap();
#endif
}

/* Kernel 3 (G > 1): dk[key][j][d] = pk[key][jG][d] + pk[key][jG+1][d] + ... in head order,
 * one element (T float, HSv = HS) or four (T float4: HS % 4 == 0, pointers 16-byte aligned,
 * HSv = HS / 4, total in float4s) a thread: the same additions in the same order. */
static __device__ __forceinline__ float red_add(float a, float b) { return a + b; }
static __device__ __forceinline__ float4 red_add(float4 a, float4 b) {
    return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

template <typename T>
static __global__ void bwd_reduce_kernel(T *__restrict__ dk, T *__restrict__ dv,
                                         const T *__restrict__ pk, const T *__restrict__ pv,
                                         int64_t total, int NH, int KVH, int HSv) {
    const int G = NH / KVH;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (int64_t)gridDim.x * blockDim.x) {
        const int64_t key = u / ((int64_t)KVH * HSv);
        const int rem = (int)(u - key * KVH * HSv), j = rem / HSv, d = rem - j * HSv;
        const int64_t base = (key * NH + (int64_t)j * G) * HSv + d;
        T sk = pk[base], sv = pv[base];
        for (int gi = 1; gi < G; gi++) {
            sk = red_add(sk, pk[base + (int64_t)gi * HSv]);
            sv = red_add(sv, pv[base + (int64_t)gi * HSv]);
        }
        dk[u] = sk;
        dv[u] = sv;
    }
}

/* The GQA reduction's epilogue for the W elements i.. (W 2 or 4, i a multiple of W) and their
 * partners i + HS/2.. of (token tok, kv head j), row = tok * KVH + j: dk's sums k0 (low), k1
 * (high) rotated back (RoPE's backward, a pair at a time), then dk and dv's sums v0, v1 rounded
 * into dk16, dv16 and, with keep_f32, stored in f32 to dk, dv (B*T, KVH, HS). Each element's
 * arithmetic is the same whatever W; W only sets the stores' width (W 4: 8-byte bf16 stores,
 * so dk16, dv16 8-byte aligned and ld16 a multiple of 4). */
template <int HS, int W>
static __device__ __forceinline__ void reduce16_store(const bw_args &A, float *__restrict__ dk,
                                                      float *__restrict__ dv, int64_t row,
                                                      int64_t tok, int j, int i, const float *k0,
                                                      const float *k1, const float *v0,
                                                      const float *v1) {
    static_assert(W == 2 || W == 4, "pairs or quads");
    constexpr int H2 = HS / 2;
    float a[W], b[W];
    const int p = A.pos[tok];
#pragma unroll
    for (int e = 0; e < W; e += 2) {
        float pa[2] = {k0[e], k0[e + 1]}, pb[2] = {k1[e], k1[e + 1]};
        rope_bwd_pairs<HS>(pa, pb, A, p, i + e);
        a[e] = pa[0], a[e + 1] = pa[1], b[e] = pb[0], b[e + 1] = pb[1];
    }
    const int64_t o16 = tok * A.ld16 + (int64_t)j * HS + i, o = row * HS + i;
    if constexpr (W == 2) {
        *reinterpret_cast<uint32_t *>(A.dk16 + o16) = bf16_pair(a[0], a[1]);
        *reinterpret_cast<uint32_t *>(A.dk16 + o16 + H2) = bf16_pair(b[0], b[1]);
        *reinterpret_cast<uint32_t *>(A.dv16 + o16) = bf16_pair(v0[0], v0[1]);
        *reinterpret_cast<uint32_t *>(A.dv16 + o16 + H2) = bf16_pair(v1[0], v1[1]);
        if (A.keep_f32) { /* (token, kv head) rows of HS */
            *reinterpret_cast<float2 *>(dk + o) = make_float2(a[0], a[1]);
            *reinterpret_cast<float2 *>(dk + o + H2) = make_float2(b[0], b[1]);
            *reinterpret_cast<float2 *>(dv + o) = make_float2(v0[0], v0[1]);
            *reinterpret_cast<float2 *>(dv + o + H2) = make_float2(v1[0], v1[1]);
        }
    } else {
        *reinterpret_cast<uint2 *>(A.dk16 + o16) =
            make_uint2(bf16_pair(a[0], a[1]), bf16_pair(a[2], a[3]));
        *reinterpret_cast<uint2 *>(A.dk16 + o16 + H2) =
            make_uint2(bf16_pair(b[0], b[1]), bf16_pair(b[2], b[3]));
        *reinterpret_cast<uint2 *>(A.dv16 + o16) =
            make_uint2(bf16_pair(v0[0], v0[1]), bf16_pair(v0[2], v0[3]));
        *reinterpret_cast<uint2 *>(A.dv16 + o16 + H2) =
            make_uint2(bf16_pair(v1[0], v1[1]), bf16_pair(v1[2], v1[3]));
        if (A.keep_f32) {
            *reinterpret_cast<float4 *>(dk + o) = make_float4(a[0], a[1], a[2], a[3]);
            *reinterpret_cast<float4 *>(dk + o + H2) = make_float4(b[0], b[1], b[2], b[3]);
            *reinterpret_cast<float4 *>(dv + o) = make_float4(v0[0], v0[1], v0[2], v0[3]);
            *reinterpret_cast<float4 *>(dv + o + H2) = make_float4(v1[0], v1[1], v1[2], v1[3]);
        }
    }
}

/* Kernel 3 with the fused epilogue (A.dq16): a thread per (key token, kv head, i = 2u for
 * u < HS/4) sums elements i, i + 1, i + HS/2 and i + HS/2 + 1 of the G partials as
 * bwd_reduce_kernel does (each element the same additions in the same order), then dk's
 * pairs are rotated back and both are stored as store_row16 does: dk16, dv16 (bf16) and,
 * with keep_f32, dk, dv (B*T, KVH, HS). */
template <int HS>
static __global__ void bwd_reduce16_kernel(bw_args A, float *__restrict__ dk,
                                           float *__restrict__ dv, const float *__restrict__ pk,
                                           const float *__restrict__ pv, int64_t total) {
    constexpr int Q = HS / 4, H2 = HS / 2;
    const int G = A.NH / A.KVH;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = u / Q, tok = row / A.KVH; /* row: token * KVH + kv head */
        const int i = 2 * (int)(u - row * Q), j = (int)(row - tok * A.KVH);
        const float *ck = pk + (tok * A.NH + (int64_t)j * G) * HS + i;
        const float *cv = pv + (tok * A.NH + (int64_t)j * G) * HS + i;
        float2 k0 = *reinterpret_cast<const float2 *>(ck), k1 = *reinterpret_cast<const float2 *>(ck + H2);
        float2 v0 = *reinterpret_cast<const float2 *>(cv), v1 = *reinterpret_cast<const float2 *>(cv + H2);
        for (int gi = 1; gi < G; gi++) {
            const float2 a0 = *reinterpret_cast<const float2 *>(ck + (int64_t)gi * HS);
            const float2 a1 = *reinterpret_cast<const float2 *>(ck + (int64_t)gi * HS + H2);
            const float2 b0 = *reinterpret_cast<const float2 *>(cv + (int64_t)gi * HS);
            const float2 b1 = *reinterpret_cast<const float2 *>(cv + (int64_t)gi * HS + H2);
            k0 = make_float2(k0.x + a0.x, k0.y + a0.y);
            k1 = make_float2(k1.x + a1.x, k1.y + a1.y);
            v0 = make_float2(v0.x + b0.x, v0.y + b0.y);
            v1 = make_float2(v1.x + b1.x, v1.y + b1.y);
        }
        const float ka[2] = {k0.x, k0.y}, kb[2] = {k1.x, k1.y};
        const float va[2] = {v0.x, v0.y}, vb[2] = {v1.x, v1.y};
        reduce16_store<HS, 2>(A, dk, dv, row, tok, j, i, ka, kb, va, vb);
    }
}

/* bwd_reduce16_kernel's sums and stores, 4 elements a thread (i = 4u for u < HS/8: elements
 * i..i+3 and i+HS/2..i+HS/2+3) with G = GC known at compile time (2..8). The kernel is its
 * loads' round trips: bwd_reduce16_kernel's SASS keeps about four 8-byte loads of a thread in
 * flight (ptxas interleaves the additions with the loads, whatever the source's order), so
 * each thread here first copies its 2 GC float4 of dk's partials into shared memory by
 * cp.async (its own slots: no barrier), all in flight at once, adds them in order from there,
 * then the same for dv. Each element: the same additions in the same order, the same rotation
 * and rounding (reduce16_store), so bwd_reduce16_kernel's bits; that kernel is kept for G > 8
 * and partials off 16-byte alignment. WIDE: dk16, dv16 stored 8 bytes at a time (where they
 * and ld16 allow; 23.0 -> 19.9 us a 0.5B layer with them, 24.2 with 4-byte stores:
 * bench/RESULTS.md, 2026-12-02, 75eedd8 and 456d69a). */
#define RED_X4_THREADS 128
template <int HS, int GC, bool WIDE>
static __global__ void __launch_bounds__(RED_X4_THREADS)
bwd_reduce16x4_kernel(bw_args A, float *__restrict__ dk, float *__restrict__ dv,
                      const float *__restrict__ pk, const float *__restrict__ pv, int64_t total) {
    constexpr int Q = HS / 8, H2 = HS / 2;
    __shared__ float4 stage[GC][2][RED_X4_THREADS]; /* [partial][low, high half][thread] */
    const int tid = threadIdx.x;
    /* the sums of elements i.. (lo) and i + HS/2.. (hi) of the GC partials at p */
    auto sum = [&](const float *p, float4 &lo, float4 &hi) {
#pragma unroll
        for (int gi = 0; gi < GC; gi++) {
            cp_async16(&stage[gi][0][tid], p + gi * HS);
            cp_async16(&stage[gi][1][tid], p + gi * HS + H2);
        }
        cp_async_commit();
        cp_async_wait<0>();
        lo = stage[0][0][tid];
        hi = stage[0][1][tid];
#pragma unroll
        for (int gi = 1; gi < GC; gi++) {
            const float4 a = stage[gi][0][tid], b = stage[gi][1][tid];
            lo = make_float4(lo.x + a.x, lo.y + a.y, lo.z + a.z, lo.w + a.w);
            hi = make_float4(hi.x + b.x, hi.y + b.y, hi.z + b.z, hi.w + b.w);
        }
    };
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + tid; u < total;
         u += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = u / Q, tok = row / A.KVH; /* row: token * KVH + kv head */
        const int i = 4 * (int)(u - row * Q), j = (int)(row - tok * A.KVH);
        const int64_t p0 = (tok * A.NH + (int64_t)j * GC) * HS + i;
        float4 k0, k1, v0, v1;
        sum(pk + p0, k0, k1);
        sum(pv + p0, v0, v1);
        const float ka[4] = {k0.x, k0.y, k0.z, k0.w}, kb[4] = {k1.x, k1.y, k1.z, k1.w};
        const float va[4] = {v0.x, v0.y, v0.z, v0.w}, vb[4] = {v1.x, v1.y, v1.z, v1.w};
        if (WIDE) { /* 8-byte bf16 stores (the caller checked their alignment) */
            reduce16_store<HS, 4>(A, dk, dv, row, tok, j, i, ka, kb, va, vb);
        } else {
            reduce16_store<HS, 2>(A, dk, dv, row, tok, j, i, ka, kb, va, vb);
            reduce16_store<HS, 2>(A, dk, dv, row, tok, j, i + 2, ka + 2, kb + 2, va + 2, vb + 2);
        }
    }
}

/* ==== entry points ============================================================================ */

size_t kiln_cuda_attention_backward_fast_ws(int N, int n_past, int NH, int KVH, int HS) {
    return kiln_attention_backward_fast_ws_floats(N, n_past, NH, KVH, HS);
}

bool kiln_cuda_attention_backward_fast_ok(const float *dq, const float *dk, const float *dv,
                                          const float *dout, const float *q, const float *k,
                                          const float *v, const void *out, int N, int n_past,
                                          int NH, int KVH, int HS) {
    if (HS != 64 && HS != 128) return false;
    if (N <= 0 || n_past < 0 || NH <= 0 || KVH <= 0 || NH % KVH != 0 || NH > 65535) return false;
    if ((int64_t)n_past + N > INT_MAX - KILN_ATTN_PACK_ROWS) return false;
    const uintptr_t a = (uintptr_t)dq | (uintptr_t)dk | (uintptr_t)dv | (uintptr_t)dout |
                        (uintptr_t)q | (uintptr_t)k | (uintptr_t)v | (uintptr_t)out;
    return (a & 15) == 0;
}

template <int HS>
static cudaError_t bwd_launch(cudaStream_t s, const bw_args &A, int B, bool stats, float *dk,
                              float *dv, float *pk, float *pv) {
    constexpr size_t smem = dq_smem<HS>() > dkv_smem<HS>() ? dq_smem<HS>() : dkv_smem<HS>();
    /* HS 64 on an sm_90a device: the wgmma kernel */
    const bool wg = HS == 64 && kiln_cuda_wgmma_usable(s);
    /* dynamic shared memory above 48 KiB (per device, so on every call: a host-side µs) */
    cudaError_t e = cudaFuncSetAttribute(bwd_stats_kernel<HS>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)stats_smem<HS>());
    if (e == cudaSuccess && wg) /* dkv_wg_smem: the larger of its two kinds of blocks */
        e = cudaFuncSetAttribute(bwd_main_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)dkv_wg_smem());
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(bwd_main_kernel<HS>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    /* the whole unified L1 as shared memory (ncu on the H200: the registers and the default
     * carveout each allowed 2 blocks per SM; with both raised the time was the same) */
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(bwd_main_kernel<HS>,
                                 cudaFuncAttributePreferredSharedMemoryCarveout,
                                 (int)cudaSharedmemCarveoutMaxShared);
    if (e != cudaSuccess) return e;
    const int T = A.n_past + A.N;
    const int nqt = (A.N + BW_ROWS - 1) / BW_ROWS, nkt = (T + BW_ROWS - 1) / BW_ROWS;
    if (stats) {
        bwd_stats_kernel<HS><<<dim3((unsigned)nqt, (unsigned)A.NH, (unsigned)B), BW_THREADS,
                               stats_smem<HS>(), s>>>(A);
        e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
    if (wg) {
        const dim3 grid((unsigned)(nqt + nkt), (unsigned)A.NH, (unsigned)B);
        bwd_main_wgmma_kernel<<<grid, BW_THREADS, dkv_wg_smem(), s>>>(A, nkt);
    } else {
        bwd_main_kernel<HS><<<dim3((unsigned)(nqt + nkt), (unsigned)A.NH, (unsigned)B), BW_THREADS,
                              smem, s>>>(A, nkt);
    }
    if ((e = cudaGetLastError()) != cudaSuccess || A.NH == A.KVH) return e;
    /* the partials of all B sequences are (B*T, NH, HS): one reduction over B*T keys */
    const int64_t total = (int64_t)B * T * A.KVH * HS;
    if (HS == 64 && A.dq16) {
        int64_t blocks = (total / 4 + 255) / 256;
        if (blocks > 65535) blocks = 65535;
        const int G = A.NH / A.KVH;
        const bool x4 = G >= 2 && G <= 8 &&
                        (((uintptr_t)pk | (uintptr_t)pv) % 16 == 0); /* float4 cp.async */
        if (!x4) {
            bwd_reduce16_kernel<64><<<(unsigned)blocks, 256, 0, s>>>(A, dk, dv, pk, pv, total / 4);
            return cudaGetLastError();
        }
        blocks = (total / 8 + RED_X4_THREADS - 1) / RED_X4_THREADS;
        if (blocks > 65535) blocks = 65535;
        const dim3 g((unsigned)blocks), t(RED_X4_THREADS);
        const bool wide = ((uintptr_t)A.dk16 | (uintptr_t)A.dv16) % 8 == 0 && A.ld16 % 4 == 0;
        switch (G) {
#define RED16X4(GC)                                                                            \
    case GC:                                                                                   \
        if (wide)                                                                              \
            bwd_reduce16x4_kernel<64, GC, true><<<g, t, 0, s>>>(A, dk, dv, pk, pv, total / 8);  \
        else                                                                                   \
            bwd_reduce16x4_kernel<64, GC, false><<<g, t, 0, s>>>(A, dk, dv, pk, pv, total / 8); \
        break;
            RED16X4(2) RED16X4(3) RED16X4(4) RED16X4(5) RED16X4(6) RED16X4(7) RED16X4(8)
#undef RED16X4
        }
        return cudaGetLastError();
    }
    if (((uintptr_t)dk | (uintptr_t)dv | (uintptr_t)pk | (uintptr_t)pv) % 16 == 0) {
        int64_t blocks = (total / 4 + 255) / 256;
        if (blocks > 65535) blocks = 65535;
        bwd_reduce_kernel<float4><<<(unsigned)blocks, 256, 0, s>>>(
            reinterpret_cast<float4 *>(dk), reinterpret_cast<float4 *>(dv),
            reinterpret_cast<const float4 *>(pk), reinterpret_cast<const float4 *>(pv), total / 4,
            A.NH, A.KVH, HS / 4);
        return cudaGetLastError();
    }
    int64_t blocks = (total + 255) / 256;
    if (blocks > 65535) blocks = 65535;
    bwd_reduce_kernel<float><<<(unsigned)blocks, 256, 0, s>>>(dk, dv, pk, pv, total, A.NH, A.KVH,
                                                           HS);
    return cudaGetLastError();
}

/* B sequences of N queries over n_past + N keys each (B > 1 only with n_past 0); the forward's
 * output in out (f32) or out16 (bf16 bits), the other NULL; lse NULL or the forward's
 * [B][NH][Npad] log-sum-exp; keep NULL or the forward's packed q, k, v (n_past 0; then q, k,
 * v are not read). Arguments checked by the callers. The workspace (B x
 * kiln_attention_backward_fast_ws_floats for one sequence): D, L [B][NH][Npad]; the GQA
 * partials pk, pv (B*T, NH, HS); then the bf16 q, dout [B][NH][Npad][HS], k, v
 * [B][KVH][Tpad][HS] (q, k, v unused with keep). */
static cudaError_t bwd_run(cudaStream_t s, float *dq, float *dk, float *dv, const float *dout,
                           const float *q, const float *k, const float *v, const float *out,
                           const uint16_t *out16, const float *lse, const void *keep, float *ws,
                           int B, int N, int n_past, int NH, int KVH, int HS, float scale,
                           const kiln_attn_grad16 *g16) {
    const int T = n_past + N;
    const int Npad = kiln_cuda_attn_pack_rows(N), Tpad = kiln_cuda_attn_pack_rows(T);
    const size_t nq = (size_t)B * NH * Npad; /* rows of [B][NH][Npad] */
    bw_args A;
    A.N = N;
    A.n_past = n_past;
    A.NH = NH;
    A.KVH = KVH;
    A.Npad = Npad;
    A.Tpad = Tpad;
    A.scale = scale;
    A.dq16 = g16 ? g16->dq16 : NULL;
    A.dk16 = g16 ? g16->dk16 : NULL;
    A.dv16 = g16 ? g16->dv16 : NULL;
    A.ld16 = g16 ? g16->ld16 : 0;
    A.keep_f32 = g16 ? (int)g16->keep_f32 : 1;
    A.pos = g16 ? g16->pos : NULL;
    A.cos_tab = g16 ? g16->cos_tab : NULL;
    A.sin_tab = g16 ? g16->sin_tab : NULL;
    float *wsD = ws, *wsL = ws + nq;
    A.wsD = wsD;
    A.wsL = lse ? lse : wsL;
    A.L_out = wsL;
    float *after = wsL + nq, *pk = dk, *pv = dv;
    if (NH != KVH) {
        pk = after;
        pv = pk + (size_t)B * T * NH * HS;
        after = pv + (size_t)B * T * NH * HS;
    }
    bf16 *qb = reinterpret_cast<bf16 *>(after), *ob = qb + nq * HS;
    bf16 *kb = ob + nq * HS, *vb = kb + (size_t)B * KVH * Tpad * HS;
    A.ob = ob;
    A.dq = dq;
    A.dk = pk;
    A.dv = pv;
    const kiln_cuda_attn_rope none = {NULL, NULL, NULL};
    const kiln_cuda_attn_pack_job dout_job = {ob, dout, out, out16, wsD, N, Npad, NH, B, none};
    cudaError_t e;
    if (keep) { /* the forward's packing, laid out as kiln_cuda_attn_keep_bytes counts it */
        const size_t qr = kiln_cuda_attn_keep_region(nq * HS * sizeof(bf16));
        const size_t kr = kiln_cuda_attn_keep_region((size_t)B * KVH * Tpad * HS * sizeof(bf16));
        A.qb = static_cast<const bf16 *>(keep);
        A.kb = reinterpret_cast<const bf16 *>(static_cast<const char *>(keep) + qr);
        A.vb = reinterpret_cast<const bf16 *>(static_cast<const char *>(keep) + qr + kr);
        e = kiln_cuda_attn_pack_heads(s, &dout_job, 1, HS);
    } else {
        A.qb = qb;
        A.kb = kb;
        A.vb = vb;
        const kiln_cuda_attn_pack_job jobs[4] = {{qb, q, NULL, NULL, NULL, N, Npad, NH, B, none},
                                                 dout_job,
                                                 {kb, k, NULL, NULL, NULL, T, Tpad, KVH, B, none},
                                                 {vb, v, NULL, NULL, NULL, T, Tpad, KVH, B, none}};
        e = kiln_cuda_attn_pack_heads(s, jobs, 4, HS);
    }
    if (e != cudaSuccess) return e;
    if (HS == 64) return bwd_launch<64>(s, A, B, lse == NULL, dk, dv, pk, pv);
    return bwd_launch<128>(s, A, B, lse == NULL, dk, dv, pk, pv);
}

cudaError_t kiln_cuda_attention_backward_fast(cudaStream_t s, float *dq, float *dk, float *dv,
                                              const float *dout, const float *q,
                                              const float *k, const float *v, const float *out,
                                              float *ws, size_t ws_floats, int N, int n_past,
                                              int NH, int KVH, int HS, float scale) {
    if (!kiln_cuda_attention_backward_fast_ok(dq, dk, dv, dout, q, k, v, out, N, n_past, NH, KVH,
                                              HS) ||
        !ws || ws_floats < kiln_cuda_attention_backward_fast_ws(N, n_past, NH, KVH, HS) ||
        ((uintptr_t)ws & 15) != 0)
        return cudaErrorInvalidValue;
    return bwd_run(s, dq, dk, dv, dout, q, k, v, out, NULL, NULL, NULL, ws, 1, N, n_past, NH, KVH,
                   HS, scale, NULL);
}

bool kiln_cuda_attention_grad16_ok(const kiln_attn_grad16 *g, int NH, int KVH, int HS) {
    if (!g || !g->dq16 || !g->dk16 || !g->dv16 || !g->pos || !g->cos_tab || !g->sin_tab)
        return false;
    if (HS != 64) return false; /* the stores' epilogue is compiled for HS 64 only */
    const uintptr_t a16 = (uintptr_t)g->dq16 | (uintptr_t)g->dk16 | (uintptr_t)g->dv16;
    const uintptr_t a32 = (uintptr_t)g->cos_tab | (uintptr_t)g->sin_tab;
    return (a16 & 3) == 0 && (a32 & 7) == 0 && g->ld16 % 2 == 0 &&
           g->ld16 >= (int64_t)NH * HS && g->ld16 >= (int64_t)KVH * HS;
}

cudaError_t kiln_cuda_attention_backward_fast_seqs(cudaStream_t s, float *dq, float *dk,
                                                   float *dv, const float *dout, const float *q,
                                                   const float *k, const float *v,
                                                   const float *out, const uint16_t *out16,
                                                   const float *lse, const void *keep, float *ws,
                                                   size_t ws_floats, int B, int N, int NH,
                                                   int KVH, int HS, float scale) {
    return kiln_cuda_attention_backward_fast_seqs16(s, dq, dk, dv, NULL, dout, q, k, v, out,
                                                    out16, lse, keep, ws, ws_floats, B, N, NH,
                                                    KVH, HS, scale);
}

cudaError_t kiln_cuda_attention_backward_fast_seqs16(cudaStream_t s, float *dq, float *dk,
                                                     float *dv, const kiln_attn_grad16 *g16,
                                                     const float *dout, const float *q,
                                                     const float *k, const float *v,
                                                     const float *out, const uint16_t *out16,
                                                     const float *lse, const void *keep,
                                                     float *ws, size_t ws_floats, int B, int N,
                                                     int NH, int KVH, int HS, float scale) {
    if (g16 && !kiln_cuda_attention_grad16_ok(g16, NH, KVH, HS)) return cudaErrorInvalidValue;
    /* the forward's output: whichever of out, out16 is given (exactly one) */
    const void *o = out16 ? (const void *)out16 : (const void *)out;
    if ((out == NULL) == (out16 == NULL) || B <= 0 || B > 65535 || (int64_t)B * N > INT_MAX ||
        !kiln_cuda_attention_backward_fast_ok(dq, dk, dv, dout, q, k, v, o, N, 0, NH, KVH, HS) ||
        !ws || ws_floats < (size_t)B * kiln_cuda_attention_backward_fast_ws(N, 0, NH, KVH, HS) ||
        ((uintptr_t)ws & 15) != 0 || ((uintptr_t)lse & 15) != 0)
        return cudaErrorInvalidValue;
    if (keep) { /* only the flash forward fills keep: it ran, so its lse (if given) is used */
        if (((uintptr_t)keep & (KILN_ATTN_KEEP_ALIGN - 1)) != 0 ||
            !kiln_cuda_attn_fast_is_mma(N, HS) || kiln_cuda_attn_keep_bytes(B, N, NH, KVH, HS) == 0)
            return cudaErrorInvalidValue;
    } else if (!q || !k || !v) {
        return cudaErrorInvalidValue;
    } else if (!kiln_cuda_attn_saves_lse(o, q, k, v, N, HS)) {
        lse = NULL; /* a saved lse only where the forward's flash kernel wrote it */
    }
    return bwd_run(s, dq, dk, dv, dout, q, k, v, out, out16, lse, keep, ws, B, N, 0, NH, KVH, HS,
                   scale, g16);
}
