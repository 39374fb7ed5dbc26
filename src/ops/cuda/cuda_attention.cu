/*
 * cuda_attention.cu -- causal grouped-query attention on the GPU, every mode and both
 * directions, and their launchers (contracts: cuda_attention.h). In order:
 *   - shared helpers;
 *   - the auditable forward: one block per (token, head) over a dense or a paged cache
 *     (attn_where), keys in order, the CPU backend's bits;
 *   - the auditable backward: statistics, dq, then dk/dv, the CPU backend's bits;
 *   - the same three and the forward on a tiled schedule for many tokens (a block of keys or
 *     queries staged once for 4-16 rows), the same bits;
 *   - the fast forward: the head packing (kiln_cuda_attn_pack_heads, shared with the fast
 *     backward), the split decode (dense, device positions and paged), the plain f32 kernel,
 *     and flash attention on bf16 tensor cores (mma.sync, and wgmma on sm_90a);
 *   - the fast backward: FlashAttention-2's backward made deterministic (mma.sync, and wgmma on
 *     sm_90a), with the fused bf16 / RoPE-backward epilogue.
 *
 * Auditable arithmetic: each kernel transcribes docs/ARITHMETIC.md (the backward ops: its
 * "Backward ops", as src/ops/cpu/backward_portable.c computes them): the same binary32
 * operations, in the same order, per output element, as the CPU reference. Parallelism only ever
 * splits work ACROSS output elements or across the 16 lanes of the defined dot product, never
 * along a sequential chain, so the bits cannot depend on the launch shape. Compiled with
 * --fmad=false (no a*b+c contraction: every FMA is a written __fmaf_rn / fmaf), IEEE division
 * and square root (nvcc's defaults without --use_fast_math) and no flush-to-zero.
 *
 * The fast kernels: the same flags, so every FMA below is written (fmaf / mma.sync / wgmma).
 */
#include "cuda_attention.h"

#include "cuda_common.cuh"
#include "cuda_matmul.h" /* kiln_cuda_wgmma_usable */
#include "cuda_wgmma.cuh"

#include "../../base/kmath.h"

#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* =================================================================================================
 * Shared helpers. The modes share little: the fast forward and backward meet in
 * kiln_cuda_attn_pack_heads (the fast forward's, declared in cuda_attention.h) and in the
 * tensor-core building blocks of cuda_mma.cuh / cuda_wgmma.cuh.
 * ============================================================================================== */

/* A bf16 element (the fast kernels' staged tiles). */
typedef __nv_bfloat16 bf16;

/* =================================================================================================
 * Auditable forward.
 * ============================================================================================== */

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
    const int lo = WINDOW ? kiln_attn_window_lo(T, wh.window) : 0;
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
        /* the half-warp's keys j0, j0 + 8, j0 + 16, j0 + 24 at once, so that their loads are
         * in flight together (a key at a time, each step waited for its loads); each dot is
         * still its own chain over d = lane + 16k in order, then the tree */
        constexpr int HWS = ATTN_THREADS / 16; /* half-warps */
        for (int j0 = hw; j0 < nk; j0 += 4 * HWS) {
            const float *kj = kbase + (kr + j0) * stride;
            float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
            for (int d = lane; d < HS; d += 16) {
                float kv[4];
#pragma unroll
                for (int u = 0; u < 4; u++)
                    kv[u] = j0 + u * HWS < nk ? kj[(int64_t)u * HWS * stride + d] : 0.0f;
#pragma unroll
                for (int u = 0; u < 4; u++) a[u] = __fmaf_rn(qs[d], kv[u], a[u]);
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const float t = lane16_tree(a[u], mask);
                if (lane == 0 && j0 + u * HWS < nk) s[j0 + u * HWS] = t * scale;
            }
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
            /* 16 keys' values loaded at once, then their fmafs in key order */
            for (int t0 = 0; t0 < nk; t0 += 16) {
                float vv[16];
#pragma unroll
                for (int u = 0; u < 16; u++)
                    vv[u] = t0 + u < nk ? vd[(int64_t)(t0 + u) * stride] : 0.0f;
#pragma unroll
                for (int u = 0; u < 16; u++)
                    if (t0 + u < nk) a = __fmaf_rn(p[t0 + u], vv[u], a);
            }
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

/* ---- the tiled schedule: many rows over one staged block ----------------------------------- */

/* The same definitions (docs/ARITHMETIC.md, "attention" and "attention backward"), scheduled for
 * many tokens (prefill, training): a CTA of AT_WARPS warps takes AT_WARPS * RW rows of one kv
 * head -- query rows (token, head) for the forward, the statistics and dq; key rows (position)
 * for dk/dv -- and walks the other side (keys, or queries) in blocks of 64, each block staged
 * once in shared memory for all the CTA's rows. A warp owns RW rows (rows warp, warp +
 * AT_WARPS, ...); lane L takes the block's items L and L + 32: their dots, each the defined
 * lane-16 dot computed by the one lane (16 accumulators, elements in order, then the fixed
 * tree; two rows at a time, so that each staged element read serves both), and the elements
 * d = L + 32c (c < C) of each row's accumulators, each walking the block's items in order. The
 * block max is a warp tree that keeps the larger value and, of equal ones, the earlier key: the
 * CPU's in-order `s > bm ? s : bm` from -inf exactly (a NaN never taken, of +0 and -0 the
 * first met). The softmax sum is one chain that every lane carries alike. So every output
 * gets the definition's operations in the definition's order; only where they run differs.
 * Taken for HS a multiple of 4 up to AT_MAX_HS with 16-byte aligned q, k, v (and dout): float4
 * staging. KILN_CUDA_ATTN_TILED=0 keeps the per-(token, head) kernels above (a comparison
 * switch, read once). */
#define AT_WARPS 4
#define AT_THREADS (AT_WARPS * 32)
#define AT_MAX_HS 128

/* A staged row's floats: HS + 4, so that the float4 reads of 8 lanes, each of its own row,
 * fall in distinct banks (HS is a multiple of 4). */
static __host__ __device__ __forceinline__ int at_ld(int HS) { return HS + 4; }

enum at_kind { AT_FORWARD, AT_STATS, AT_DQ, AT_DKV };

/* Shared floats of a kernel of kind K with RW rows per warp at head size HS: two staged blocks
 * (one for the statistics), per warp RW rows of each of its own vectors (q; q and dout; k and
 * v) and RW x 64 of each per-item value (p; ds; p and ds), and dk/dv's 3 x 64 statistics. */
static __host__ __device__ __forceinline__ int at_smem_floats(int K, int RW, int HS) {
    const int tiles = (K == AT_STATS ? 1 : 2) * KILN_ATTN_BLOCK * at_ld(HS);
    const int own = K == AT_FORWARD || K == AT_STATS ? 1 : 2, per = K == AT_DKV ? 2 : 1;
    return tiles + (K == AT_DKV ? 3 * KILN_ATTN_BLOCK : 0) + AT_WARPS * RW * (own * HS + per * KILN_ATTN_BLOCK);
}

/* n rows of HS floats, row t at src + t * stride, into tile rows of at_ld(HS) (all threads). */
static __device__ __forceinline__ void at_stage(float *tile, const float *__restrict__ src, int64_t stride,
                                                int n, int HS) {
    const int h4 = HS >> 2, ld = at_ld(HS);
    for (int e = threadIdx.x; e < n * h4; e += AT_THREADS) {
        const int t = e / h4, d = (e - t * h4) << 2;
        *(float4 *)(tile + t * ld + d) = __ldg((const float4 *)(src + t * stride + d));
    }
}

/* One row of HS floats into dst (a warp's lanes). */
static __device__ __forceinline__ void at_stage_row(float *dst, const float *__restrict__ src, int HS, int L) {
    for (int d = L << 2; d < HS; d += 128) *(float4 *)(dst + d) = __ldg((const float4 *)(src + d));
}

/* The fixed tree of the defined dot over its 16 lane accumulators. */
static __device__ __forceinline__ float at_tree(const float (&a)[16]) {
    float s8[8], s4[4];
#pragma unroll
    for (int j = 0; j < 8; j++) s8[j] = a[j] + a[j + 8];
#pragma unroll
    for (int j = 0; j < 4; j++) s4[j] = s8[j] + s8[j + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* acc[u..u+3] = fmaf(a, b, acc[...]) lane by lane: elements u..u+3 of a 16-element step. */
static __device__ __forceinline__ void at_fma4(float (&acc)[16], int u, float4 a, float4 b) {
    acc[u] = __fmaf_rn(a.x, b.x, acc[u]);
    acc[u + 1] = __fmaf_rn(a.y, b.y, acc[u + 1]);
    acc[u + 2] = __fmaf_rn(a.z, b.z, acc[u + 2]);
    acc[u + 3] = __fmaf_rn(a.w, b.w, acc[u + 3]);
}

/* s[k][j] = dot(a_k, b_j) for the R (1 or 2) rows a_k = a + k * HS and the two rows b_0, b_1:
 * the defined dot (element d on accumulator d % 16, in order; the tree) by one thread, over
 * shared rows (16-byte aligned, HS a multiple of 4). */
template <int R>
static __device__ __forceinline__ void at_dots(const float *a, const float *b0, const float *b1, int HS,
                                               float (&s)[R][2]) {
    float x[R][2][16];
#pragma unroll
    for (int k = 0; k < R; k++)
#pragma unroll
        for (int u = 0; u < 16; u++) x[k][0][u] = x[k][1][u] = 0.0f;
    for (int d0 = 0; d0 < HS; d0 += 16) {
#pragma unroll
        for (int u = 0; u < 16; u += 4) {
            if (d0 + u < HS) {
                const float4 p = *(const float4 *)(b0 + d0 + u), r = *(const float4 *)(b1 + d0 + u);
#pragma unroll
                for (int k = 0; k < R; k++) {
                    const float4 av = *(const float4 *)(a + k * HS + d0 + u);
                    at_fma4(x[k][0], u, av, p);
                    at_fma4(x[k][1], u, av, r);
                }
            }
        }
    }
#pragma unroll
    for (int k = 0; k < R; k++) {
        s[k][0] = at_tree(x[k][0]);
        s[k][1] = at_tree(x[k][1]);
    }
}

/* The dots of a warp's RW rows (a: RW rows of HS) with items L and L + 32 of a staged block:
 * s[k][0], s[k][1], two rows at a time. */
template <int RW>
static __device__ __forceinline__ void at_row_dots(const float *a, const float *tile, int HS, int L,
                                                   float (&s)[RW][2]) {
    const int ld = at_ld(HS);
    if constexpr (RW == 1) {
        at_dots<1>(a, tile + L * ld, tile + (L + 32) * ld, HS, s);
    } else {
#pragma unroll
        for (int k = 0; k + 1 < RW; k += 2) {
            float t[2][2];
            at_dots<2>(a + k * HS, tile + L * ld, tile + (L + 32) * ld, HS, t);
            s[k][0] = t[0][0];
            s[k][1] = t[0][1];
            s[k + 1][0] = t[1][0];
            s[k + 1][1] = t[1][1];
        }
    }
}

/* dot(a, b) of two global rows by one thread (the statistics' D). */
static __device__ __forceinline__ float at_dot_global(const float *__restrict__ a, const float *__restrict__ b,
                                                      int HS) {
    float x[16];
#pragma unroll
    for (int u = 0; u < 16; u++) x[u] = 0.0f;
    for (int d0 = 0; d0 < HS; d0 += 16) {
#pragma unroll
        for (int u = 0; u < 16; u++)
            if (d0 + u < HS) x[u] = __fmaf_rn(a[d0 + u], b[d0 + u], x[u]);
    }
    return at_tree(x);
}

/* The block max of a warp's 64 scores (lane L: items L and L + 32; v0, v1 -inf for a NaN or
 * an item outside the row): of the largest value, the earliest item's. */
static __device__ __forceinline__ float at_block_max(float v0, float v1, int L) {
    float v = v0;
    int t = L;
    if (v1 > v) {
        v = v1;
        t = L + 32;
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int ot = __shfl_xor_sync(0xffffffffu, t, o);
        if (ov > v || (ov == v && ot < t)) {
            v = ov;
            t = ot;
        }
    }
    return v;
}

/* Element u (0..3) of v. */
static __device__ __forceinline__ float at_el(float4 v, int u) { return u == 0 ? v.x : u == 1 ? v.y : u == 2 ? v.z : v.w; }

/* The query side's kernels (forward, statistics, dq): grid (tiles of AT_WARPS * RW query rows
 * of a kv head, KVH); query row r of kv head g is token r / G, head g * G + r % G; tiles of the
 * latest tokens (the most keys) first. C: accumulator elements per lane and row (HS <= 32 C).
 *   AT_FORWARD: out = the attention (docs/ARITHMETIC.md, "attention").
 *   AT_STATS:   ws[u * 3 + {0, 1, 2}] = m, l (the forward's online softmax) and D = dot(dout_u,
 *               o_u) (the backward's statistics pass).
 *   AT_DQ:      dq_u = scale * sum over keys j in order of ds_j k_j (fmaf chains per d), with
 *               ds_j = (p_j / l) (dot(dout_u, v_j) - D), p_j = kiln_expf(dot(q_u, k_j) * scale - m). */
template <int K, int RW, int C>
static __global__ void __launch_bounds__(AT_THREADS)
attn_tiled_q_kernel(float *__restrict__ out, float *__restrict__ ws, const float *__restrict__ q,
                    const float *__restrict__ kc, const float *__restrict__ vc, const float *__restrict__ dout,
                    const float *__restrict__ o, int N, int n_past, int NH, int KVH, int HS, float scale,
                    int window) {
    extern __shared__ float4 at_sm4[];
    float *const sm = (float *)at_sm4;
    const int ld = at_ld(HS), G = NH / KVH, g = blockIdx.y, rows = N * G;
    const int warp = threadIdx.x >> 5, L = threadIdx.x & 31;
    float *const ks = sm, *const vs = sm + KILN_ATTN_BLOCK * ld; /* vs: not with AT_STATS */
    constexpr int own = K == AT_DQ ? 2 : 1;
    float *const wsm = sm + (K == AT_STATS ? 1 : 2) * KILN_ATTN_BLOCK * ld +
                       warp * RW * (own * HS + KILN_ATTN_BLOCK);
    float *const qw = wsm;                 /* (RW, HS): the rows' q */
    float *const dw = wsm + RW * HS;       /* (RW, HS): the rows' dout (AT_DQ) */
    float *const pw = wsm + own * RW * HS; /* (RW, 64): p (ds for AT_DQ) of the block */
    const int r0 = (int)(gridDim.x - 1 - blockIdx.x) * AT_WARPS * RW;

    bool rv[RW];
    int rT[RW], rlo[RW];
    int64_t ru[RW];
    float m[RW], l[RW], D[RW], acc[RW][C];
#pragma unroll
    for (int k = 0; k < RW; k++) {
        const int r = r0 + warp + AT_WARPS * k;
        rv[k] = r < rows;
        const int i = rv[k] ? r / G : 0;
        ru[k] = (int64_t)i * NH + g * G + (rv[k] ? r % G : 0);
        rT[k] = n_past + i + 1;
        rlo[k] = kiln_attn_window_lo(rT[k], window);
        m[k] = -INFINITY;
        l[k] = 0.0f;
        D[k] = 0.0f;
#pragma unroll
        for (int c = 0; c < C; c++) acc[k][c] = 0.0f;
        if (rv[k]) {
            at_stage_row(qw + k * HS, q + ru[k] * HS, HS, L);
            if (K == AT_DQ) {
                at_stage_row(dw + k * HS, dout + ru[k] * HS, HS, L);
                m[k] = ws[ru[k] * 3 + 0];
                l[k] = ws[ru[k] * 3 + 1];
                D[k] = ws[ru[k] * 3 + 2];
            }
        }
    }
    /* the CTA's keys: from its first row's window start (the lowest) to its last row's end */
    const int r_last = (r0 + AT_WARPS * RW < rows ? r0 + AT_WARPS * RW : rows) - 1;
    const int T_hi = n_past + r_last / G + 1;
    const int lo_min = kiln_attn_window_lo(n_past + r0 / G + 1, window);
    const int64_t kstride = (int64_t)KVH * HS;
    for (int kb0 = lo_min / KILN_ATTN_BLOCK * KILN_ATTN_BLOCK; kb0 < T_hi; kb0 += KILN_ATTN_BLOCK) {
        const int nload = T_hi - kb0 < KILN_ATTN_BLOCK ? T_hi - kb0 : KILN_ATTN_BLOCK;
        __syncthreads(); /* every warp is done with the previous block (and its own rows are staged) */
        at_stage(ks, kc + ((int64_t)kb0 * KVH + g) * HS, kstride, nload, HS);
        if (K != AT_STATS) at_stage(vs, vc + ((int64_t)kb0 * KVH + g) * HS, kstride, nload, HS);
        __syncthreads();
        /* every row's dots with items L and L + 32 (a row outside this block: computed, unused) */
        float sc[RW][2], dp[RW][2];
        at_row_dots<RW>(qw, ks, HS, L, sc);
        if (K == AT_DQ) at_row_dots<RW>(dw, vs, HS, L, dp);
        int tb[RW], te[RW];
        float al[RW];
        int t_lo = KILN_ATTN_BLOCK, t_hi = 0;
#pragma unroll
        for (int k = 0; k < RW; k++) {
            tb[k] = KILN_ATTN_BLOCK;
            te[k] = 0;
            al[k] = 1.0f;
            if (!rv[k] || kb0 >= rT[k] || kb0 + KILN_ATTN_BLOCK <= rlo[k]) continue; /* warp-uniform */
            tb[k] = rlo[k] - kb0 > 0 ? rlo[k] - kb0 : 0;
            te[k] = rT[k] - kb0 < KILN_ATTN_BLOCK ? rT[k] - kb0 : KILN_ATTN_BLOCK;
            t_lo = tb[k] < t_lo ? tb[k] : t_lo;
            t_hi = te[k] > t_hi ? te[k] : t_hi;
            const bool in0 = L >= tb[k] && L < te[k], in1 = L + 32 >= tb[k] && L + 32 < te[k];
            float *const p = pw + k * KILN_ATTN_BLOCK;
            if (K == AT_DQ) {
                if (in0) p[L] = (kiln_expf(sc[k][0] * scale - m[k]) / l[k]) * (dp[k][0] - D[k]);
                if (in1) p[L + 32] = (kiln_expf(sc[k][1] * scale - m[k]) / l[k]) * (dp[k][1] - D[k]);
                continue;
            }
            const float s0 = sc[k][0] * scale, s1 = sc[k][1] * scale;
            const float bm = at_block_max(in0 && s0 == s0 ? s0 : -INFINITY, in1 && s1 == s1 ? s1 : -INFINITY, L);
            const float m_new = bm > m[k] ? bm : m[k];
            al[k] = kiln_expf(m[k] - m_new);
            if (in0) p[L] = kiln_expf(s0 - m_new);
            if (in1) p[L + 32] = kiln_expf(s1 - m_new);
            m[k] = m_new;
        }
        __syncwarp();
        if (K != AT_DQ) {
#pragma unroll
            for (int k = 0; k < RW; k++) {
                if (tb[k] >= te[k]) continue;
                l[k] = l[k] * al[k];
                if (K == AT_FORWARD) {
#pragma unroll
                    for (int c = 0; c < C; c++) acc[k][c] = acc[k][c] * al[k];
                }
            }
        }
        /* the block's items in order: l += p_t, acc[d] = fmaf(p_t, v_t[d], acc[d]) (forward);
         * dq[d] = fmaf(ds_t, k_t[d], dq[d]); four items' p read at once */
        const float *const src = K == AT_DQ ? ks : vs;
        for (int t4 = t_lo & ~3; t4 < t_hi; t4 += 4) {
            float4 pk[RW];
#pragma unroll
            for (int k = 0; k < RW; k++) pk[k] = *(const float4 *)(pw + k * KILN_ATTN_BLOCK + t4);
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int t = t4 + u;
                float e[C];
#pragma unroll
                for (int c = 0; c < C; c++)
                    e[c] = K != AT_STATS && L + 32 * c < HS ? src[t * ld + L + 32 * c] : 0.0f;
#pragma unroll
                for (int k = 0; k < RW; k++) {
                    if (t < tb[k] || t >= te[k]) continue;
                    const float pt = at_el(pk[k], u);
                    if (K != AT_DQ) l[k] = l[k] + pt;
                    if (K != AT_STATS) {
#pragma unroll
                        for (int c = 0; c < C; c++) acc[k][c] = __fmaf_rn(pt, e[c], acc[k][c]);
                    }
                }
            }
        }
        __syncwarp(); /* pw is rewritten by the next block */
    }
#pragma unroll
    for (int k = 0; k < RW; k++) {
        if (!rv[k]) continue;
        if (K == AT_STATS) {
            if (L == 0) {
                ws[ru[k] * 3 + 0] = m[k];
                ws[ru[k] * 3 + 1] = l[k];
                ws[ru[k] * 3 + 2] = at_dot_global(dout + ru[k] * HS, o + ru[k] * HS, HS);
            }
        } else {
#pragma unroll
            for (int c = 0; c < C; c++) {
                const int d = L + 32 * c;
                if (d < HS) out[ru[k] * HS + d] = K == AT_FORWARD ? acc[k][c] / l[k] : acc[k][c] * scale;
            }
        }
    }
}

/* dk/dv (docs/ARITHMETIC.md, "attention backward"): grid (tiles of AT_WARPS * RW key positions
 * of a kv head, KVH), the earliest keys (the most queries) first. Key row jp of kv head g:
 * over the group's heads h in order, then its queries i (n_past + i >= jp, within the window)
 * in order, p = kiln_expf(dot(k_j, q_ih) * scale - m_ih) / l_ih, ds = p (dot(v_j, dout_ih) -
 * D_ih), dv[d] = fmaf(p, dout_ih[d], dv[d]), dk[d] = fmaf(ds, q_ih[d], dk[d]); then dk * scale. */
template <int RW, int C>
static __global__ void __launch_bounds__(AT_THREADS)
attn_tiled_dkv_kernel(float *__restrict__ dk, float *__restrict__ dv, const float *__restrict__ ws,
                      const float *__restrict__ q, const float *__restrict__ kc, const float *__restrict__ vc,
                      const float *__restrict__ dout, int N, int n_past, int NH, int KVH, int HS, float scale,
                      int window) {
    extern __shared__ float4 at_sm4[];
    float *const sm = (float *)at_sm4;
    const int ld = at_ld(HS), G = NH / KVH, g = blockIdx.y, rows = n_past + N;
    const int warp = threadIdx.x >> 5, L = threadIdx.x & 31;
    float *const qs = sm, *const ds = sm + KILN_ATTN_BLOCK * ld; /* staged q and dout of 64 queries */
    float *const st = sm + 2 * KILN_ATTN_BLOCK * ld;              /* (3, 64): their m, l, D */
    float *const wsm = st + 3 * KILN_ATTN_BLOCK + warp * RW * (2 * HS + 2 * KILN_ATTN_BLOCK);
    float *const kw = wsm, *const vw = wsm + RW * HS;              /* (RW, HS) each: the rows' k, v */
    float *const pw = wsm + 2 * RW * HS, *const sw = pw + RW * KILN_ATTN_BLOCK; /* (RW, 64) each: p, ds */
    const int r0 = (int)blockIdx.x * AT_WARPS * RW;
    const int64_t qstride = (int64_t)NH * HS;

    bool rv[RW];
    int ilo[RW], ihi[RW];
    float ak[RW][C], av[RW][C];
#pragma unroll
    for (int k = 0; k < RW; k++) {
        const int jp = r0 + warp + AT_WARPS * k;
        rv[k] = jp < rows;
        ilo[k] = jp - n_past > 0 ? jp - n_past : 0;
        ihi[k] = N;
        if (window > 0 && (int64_t)jp - n_past + window < ihi[k]) ihi[k] = jp - n_past + window;
#pragma unroll
        for (int c = 0; c < C; c++) ak[k][c] = av[k][c] = 0.0f;
        if (rv[k]) {
            at_stage_row(kw + k * HS, kc + ((int64_t)jp * KVH + g) * HS, HS, L);
            at_stage_row(vw + k * HS, vc + ((int64_t)jp * KVH + g) * HS, HS, L);
        }
    }
    /* the CTA's queries: from its first key's first query to its last key's window end */
    const int j_last = (r0 + AT_WARPS * RW < rows ? r0 + AT_WARPS * RW : rows) - 1;
    const int i_lo = r0 - n_past > 0 ? r0 - n_past : 0;
    int i_hi = N;
    if (window > 0 && (int64_t)j_last - n_past + window < i_hi) i_hi = j_last - n_past + window;
    for (int h = g * G; h < (g + 1) * G; h++) {
        for (int ib = i_lo; ib < i_hi; ib += KILN_ATTN_BLOCK) {
            const int nq = i_hi - ib < KILN_ATTN_BLOCK ? i_hi - ib : KILN_ATTN_BLOCK;
            __syncthreads(); /* every warp is done with the previous block (and its rows are staged) */
            at_stage(qs, q + ((int64_t)ib * NH + h) * HS, qstride, nq, HS);
            at_stage(ds, dout + ((int64_t)ib * NH + h) * HS, qstride, nq, HS);
            for (int t = threadIdx.x; t < 3 * nq; t += AT_THREADS) {
                const int tt = t / 3, w = t - 3 * tt;
                st[w * KILN_ATTN_BLOCK + tt] = ws[((int64_t)(ib + tt) * NH + h) * 3 + w];
            }
            __syncthreads();
            float sc[RW][2], dp[RW][2];
            at_row_dots<RW>(kw, qs, HS, L, sc);
            at_row_dots<RW>(vw, ds, HS, L, dp);
            int tb[RW], te[RW];
            int t_lo = KILN_ATTN_BLOCK, t_hi = 0;
#pragma unroll
            for (int k = 0; k < RW; k++) {
                tb[k] = KILN_ATTN_BLOCK;
                te[k] = 0;
                if (!rv[k] || ib >= ihi[k] || ib + nq <= ilo[k]) continue; /* warp-uniform */
                tb[k] = ilo[k] - ib > 0 ? ilo[k] - ib : 0;
                te[k] = ihi[k] - ib < nq ? ihi[k] - ib : nq;
                t_lo = tb[k] < t_lo ? tb[k] : t_lo;
                t_hi = te[k] > t_hi ? te[k] : t_hi;
                float *const p = pw + k * KILN_ATTN_BLOCK, *const s = sw + k * KILN_ATTN_BLOCK;
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    const int t = L + 32 * hf;
                    if (t < tb[k] || t >= te[k]) continue;
                    const float pt = kiln_expf(sc[k][hf] * scale - st[t]) / st[KILN_ATTN_BLOCK + t];
                    p[t] = pt;
                    s[t] = pt * (dp[k][hf] - st[2 * KILN_ATTN_BLOCK + t]);
                }
            }
            __syncwarp();
            for (int t4 = t_lo & ~3; t4 < t_hi; t4 += 4) {
                float4 pk[RW], sk[RW];
#pragma unroll
                for (int k = 0; k < RW; k++) {
                    pk[k] = *(const float4 *)(pw + k * KILN_ATTN_BLOCK + t4);
                    sk[k] = *(const float4 *)(sw + k * KILN_ATTN_BLOCK + t4);
                }
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    const int t = t4 + u;
                    float eq[C], ed[C];
#pragma unroll
                    for (int c = 0; c < C; c++) {
                        const bool in = L + 32 * c < HS;
                        eq[c] = in ? qs[t * ld + L + 32 * c] : 0.0f;
                        ed[c] = in ? ds[t * ld + L + 32 * c] : 0.0f;
                    }
#pragma unroll
                    for (int k = 0; k < RW; k++) {
                        if (t < tb[k] || t >= te[k]) continue;
                        const float pt = at_el(pk[k], u), dst = at_el(sk[k], u);
#pragma unroll
                        for (int c = 0; c < C; c++) {
                            av[k][c] = __fmaf_rn(pt, ed[c], av[k][c]);
                            ak[k][c] = __fmaf_rn(dst, eq[c], ak[k][c]);
                        }
                    }
                }
            }
            __syncwarp(); /* pw, sw are rewritten by the next block */
        }
    }
#pragma unroll
    for (int k = 0; k < RW; k++) {
        if (!rv[k]) continue;
        const int64_t row = ((int64_t)(r0 + warp + AT_WARPS * k) * KVH + g) * HS;
#pragma unroll
        for (int c = 0; c < C; c++) {
            const int d = L + 32 * c;
            if (d < HS) {
                dk[row + d] = ak[k][c] * scale;
                dv[row + d] = av[k][c];
            }
        }
    }
}

/* Dynamic shared memory of the tiled kernels above the default 48 KiB, set once per device
 * (kiln_cuda_attention_setup: at the backend's creation, outside any graph capture). */
template <int RW, int C>
static cudaError_t at_attributes_rc() {
    const int hs = 32 * C;
    const int a = (int)sizeof(float) * at_smem_floats(AT_FORWARD, RW, hs);
    const int b = (int)sizeof(float) * at_smem_floats(AT_STATS, RW, hs);
    const int c = (int)sizeof(float) * at_smem_floats(AT_DQ, RW, hs);
    const int d = (int)sizeof(float) * at_smem_floats(AT_DKV, RW, hs);
    const cudaFuncAttribute A = cudaFuncAttributeMaxDynamicSharedMemorySize;
    cudaError_t e = cudaFuncSetAttribute(attn_tiled_q_kernel<AT_FORWARD, RW, C>, A, a);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(attn_tiled_q_kernel<AT_STATS, RW, C>, A, b);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(attn_tiled_q_kernel<AT_DQ, RW, C>, A, c);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(attn_tiled_dkv_kernel<RW, C>, A, d);
    return e;
}

cudaError_t kiln_cuda_attention_setup(void) {
    static unsigned char ready[256];
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    if (dev < 0 || dev >= (int)sizeof ready) return cudaErrorInvalidDevice;
    if (__atomic_load_n(&ready[dev], __ATOMIC_ACQUIRE)) return cudaSuccess;
    e = at_attributes_rc<1, 2>();
    if (e == cudaSuccess) e = at_attributes_rc<4, 2>();
    if (e == cudaSuccess) e = at_attributes_rc<1, 4>();
    if (e == cudaSuccess) e = at_attributes_rc<4, 4>();
    if (e == cudaSuccess) __atomic_store_n(&ready[dev], (unsigned char)1, __ATOMIC_RELEASE);
    return e;
}

/* Whether the tiled kernels take a call: HS a multiple of 4 up to AT_MAX_HS, the staged
 * operands 16-byte aligned, not switched off. */
static bool at_takes(int HS, const void *a, const void *b, const void *c, const void *d) {
    static const bool on = !kiln_env_off("KILN_CUDA_ATTN_TILED");
    const uintptr_t al = (uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)d;
    return on && HS % 4 == 0 && HS <= AT_MAX_HS && (al & 15) == 0;
}

/* Rows per warp for n_rows rows over KVH kv heads: 4 (a staged block serves 16 rows) where
 * that still makes two CTAs for each of 132 SMs, else 1 (more CTAs). */
static int at_rw(int64_t n_rows, int KVH) {
    return (n_rows + 4 * AT_WARPS - 1) / (4 * AT_WARPS) * KVH >= 2 * 132 ? 4 : 1;
}

template <int K, int RW, int C>
static void at_q(dim3 grid, size_t smem, cudaStream_t s, float *out, float *ws, const float *q, const float *k,
                 const float *v, const float *dout, const float *o, int N, int n_past, int NH, int KVH, int HS,
                 float scale, int window) {
    attn_tiled_q_kernel<K, RW, C><<<grid, AT_THREADS, smem, s>>>(out, ws, q, k, v, dout, o, N, n_past, NH, KVH, HS,
                                                                  scale, window);
}

template <int K>
static cudaError_t at_launch_q(cudaStream_t s, float *out, float *ws, const float *q, const float *k,
                               const float *v, const float *dout, const float *o, int N, int n_past, int NH,
                               int KVH, int HS, float scale, int window) {
    cudaError_t e = kiln_cuda_attention_setup();
    if (e != cudaSuccess) return e;
    const int64_t rows = (int64_t)N * (NH / KVH);
    const int RW = at_rw(rows, KVH);
    const dim3 grid((unsigned)((rows + AT_WARPS * RW - 1) / (AT_WARPS * RW)), (unsigned)KVH);
    const size_t smem = sizeof(float) * (size_t)at_smem_floats(K, RW, HS);
    if (RW == 4 && HS <= 64) at_q<K, 4, 2>(grid, smem, s, out, ws, q, k, v, dout, o, N, n_past, NH, KVH, HS, scale, window);
    else if (RW == 4) at_q<K, 4, 4>(grid, smem, s, out, ws, q, k, v, dout, o, N, n_past, NH, KVH, HS, scale, window);
    else if (HS <= 64) at_q<K, 1, 2>(grid, smem, s, out, ws, q, k, v, dout, o, N, n_past, NH, KVH, HS, scale, window);
    else at_q<K, 1, 4>(grid, smem, s, out, ws, q, k, v, dout, o, N, n_past, NH, KVH, HS, scale, window);
    return cudaGetLastError();
}

static cudaError_t at_launch_dkv(cudaStream_t s, float *dk, float *dv, const float *ws, const float *q,
                                 const float *k, const float *v, const float *dout, int N, int n_past, int NH,
                                 int KVH, int HS, float scale, int window) {
    const int64_t rows = (int64_t)n_past + N;
    const int RW = at_rw(rows, KVH);
    const dim3 grid((unsigned)((rows + AT_WARPS * RW - 1) / (AT_WARPS * RW)), (unsigned)KVH);
    const size_t smem = sizeof(float) * (size_t)at_smem_floats(AT_DKV, RW, HS);
#define AT_DKV_LAUNCH(RW_, C_)                                                                                    \
    attn_tiled_dkv_kernel<RW_, C_><<<grid, AT_THREADS, smem, s>>>(dk, dv, ws, q, k, v, dout, N, n_past, NH, KVH, \
                                                                   HS, scale, window)
    if (RW == 4 && HS <= 64) AT_DKV_LAUNCH(4, 2);
    else if (RW == 4) AT_DKV_LAUNCH(4, 4);
    else if (HS <= 64) AT_DKV_LAUNCH(1, 2);
    else AT_DKV_LAUNCH(1, 4);
#undef AT_DKV_LAUNCH
    return cudaGetLastError();
}

cudaError_t kiln_cuda_attention(cudaStream_t s, float *out, const float *q, const float *k,
                                const float *v, int N, int n_past, int NH, int KVH, int HS,
                                float scale, int window) {
    if (N <= 0 || NH <= 0 || HS <= 0) return cudaSuccess;
    if (HS > KILN_CUDA_MAX_HS || KVH <= 0 || NH % KVH != 0 || window < 0)
        return cudaErrorInvalidValue;
    if (N >= 4 && at_takes(HS, q, k, v, NULL))
        return at_launch_q<AT_FORWARD>(s, out, NULL, q, k, v, NULL, NULL, N, n_past, NH, KVH, HS, scale, window);
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

/* =================================================================================================
 * Auditable backward.
 * ============================================================================================== */

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
    const int T = n_past + i + 1, lo = kiln_attn_window_lo(T, window);
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
    const int T = n_past + i + 1, lo = kiln_attn_window_lo(T, window);
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
    if (at_takes(HS, q, k, v, dout)) {
        cudaError_t e = at_launch_q<AT_STATS>(s, NULL, ws, q, k, v, dout, out, N, n_past, NH, KVH, HS, scale, window);
        if (e == cudaSuccess)
            e = at_launch_q<AT_DQ>(s, dq, ws, q, k, v, dout, NULL, N, n_past, NH, KVH, HS, scale, window);
        if (e == cudaSuccess) e = at_launch_dkv(s, dk, dv, ws, q, k, v, dout, N, n_past, NH, KVH, HS, scale, window);
        return e;
    }
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

/* =================================================================================================
 * Fast forward (issue 4, item 3): flash attention on bf16 tensor cores for prefill,
 * split-along-the-keys f32 attention for decode, and the plain f32 kernel for head sizes
 * the tensor-core kernel does not take. The switch between the kernels: cuda_attention.h.
 *
 * exp: kiln_expf in the f32 kernels (about 1 ulp; they are bandwidth-bound, so its few
 * extra FMAs cost nothing), __expf (ex2.approx) in the tensor-core kernel, whose bf16
 * rounding dominates its error anyway.
 * ============================================================================================== */

struct kiln_cuda_attn {
    float *buf;      /* device: partial acc (P, HS) then partial (m, l) (P, 2) */
    size_t cap;      /* bytes buf holds */
    unsigned *cnt;   /* device: arrival counters of the fused combine, all 0 between calls */
    size_t cnt_cap;  /* bytes cnt holds */
    void *pack;      /* device: the flash kernel's bf16 copies of q, k, v (packed heads) */
    size_t pack_cap; /* bytes pack holds */
    uint64_t gen;    /* bumped whenever a buffer above is reallocated (graphs recorded before
                      * then read freed memory: kiln_cuda_attn_generation) */
};

/* Floats of the workspace for B sequences x N tokens x NH heads x HS over max_T keys:
 * P = B * nsplit * N * NH partials of HS + 2 floats. 0 on overflow. */
static size_t ws_floats(int B, int N, int NH, int HS, int max_T) {
    const uint64_t nsplit = ((uint64_t)max_T + KILN_ATTN_SPLIT - 1) / KILN_ATTN_SPLIT;
    const uint64_t P = (uint64_t)B * nsplit * (uint64_t)N * (uint64_t)NH;
    const uint64_t f = P * ((uint64_t)HS + 2);
    if (P != 0 && f / P != (uint64_t)HS + 2) return 0;
    if (f > (uint64_t)SIZE_MAX / sizeof(float)) return 0;
    return (size_t)f;
}

static __device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

/* Butterfly sum: lane j adds lane j^o's value at each step, so every lane holds the same
 * bits at the end (IEEE addition is commutative). */
static __device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x = x + __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* Index of the partial of (sequence b, split s, token n, head h). */
static __device__ __forceinline__ int64_t partial_index(int b, int s, int n, int h, int N,
                                                        int NH, int nsplit_max) {
    return (((int64_t)b * nsplit_max + s) * N + n) * NH + h;
}

/* ==== the plain f32 kernel (N > 8 without the tensor cores): a block per 16 query rows ===== */

#define F32_THREADS 128
#define F32_WARPS (F32_THREADS / 32)
#define F32_ROWS 16 /* query rows (token, head of the kv group) per block */
#define F32_KT 32   /* keys per shared-memory sub-tile: one per lane */
#define F32_ACC (F32_ROWS * KILN_ATTN_FAST_MAX_HS / F32_THREADS) /* acc per thread */
static_assert(F32_KT == 32, "a sub-tile's scores are one warp's lanes");
static_assert(F32_ROWS % F32_WARPS == 0, "rows are dealt to warps round-robin");
static_assert((F32_ROWS * KILN_ATTN_FAST_MAX_HS) % F32_THREADS == 0, "acc tiling");

/* Shared memory of f32_kernel for head size HS (floats: q rows, K sub-tile with an odd row
 * stride so the 32 lanes' key rows fall in different banks, V sub-tile, p, alpha, l). */
static size_t f32_smem(int HS) {
    const size_t ks = (size_t)(HS | 1);
    return sizeof(float) * ((size_t)F32_ROWS * HS + F32_KT * ks + (size_t)F32_KT * HS +
                            F32_ROWS * F32_KT + 2 * F32_ROWS);
}

/* The first key a query at position p sees under a sliding window of `window` keys (0: no
 * window, key 0). */
static __host__ __device__ __forceinline__ int window_lo(int p, int window) {
    return kiln_attn_window_lo(p + 1, window);
}

/* The plain f32 attention for N > 8 when the tensor-core kernel does not apply (head sizes
 * other than 64/128, unaligned pointers). Rows of kv head kvh's group are (token n, head of
 * the group g), row = n * G + g, query head h = kvh * G + g. Block (blockIdx.x = chunk * KVH +
 * kvh) takes rows r0 .. r0 + nr - 1 of the chunk (chunks with the most keys first) and keys
 * 0 .. n_past + last row's n; writes out = acc / l. window > 0: row n sees keys
 * window_lo(n_past + n) .. n_past + n only; the sub-tiles start at the 32-aligned one holding
 * the chunk's first row's first key, and keys below that one are staged as zeros (never
 * read).
 * Per row, keys go by sub-tiles of 32 in increasing order: the owning warp (row % 4) takes
 * one key per lane (score = fmaf dot over d in order, * scale; masked -> -inf), the sub-tile
 * max by warp shuffles, m_new = max(m, max), alpha = exp(m - m_new), p = exp(s - m_new),
 * l = l * alpha + (butterfly sum of p); then acc(d) = acc(d) * alpha + sum_j p_j v_j(d) with
 * fmaf in key order. Nothing depends on the grid. q, out: (N, NH, HS); k, v: (T, KVH, HS). */
static __global__ void __launch_bounds__(F32_THREADS)
f32_kernel(float *__restrict__ out, const float *__restrict__ q, const float *__restrict__ k,
           const float *__restrict__ v, int N, int n_past, int NH, int KVH, int HS,
           float scale, int window) {
    extern __shared__ float f32_sm[];
    const int G = NH / KVH;
    const int R = G * N;
    const int nchunks = (R + F32_ROWS - 1) / F32_ROWS;
    const int kvh = (int)(blockIdx.x % (unsigned)KVH);
    const int cidx = (int)(blockIdx.x / (unsigned)KVH);
    const int chunk = nchunks - 1 - cidx; /* longest rows first */
    const int r0 = chunk * F32_ROWS;
    const int nr = R - r0 < F32_ROWS ? R - r0 : F32_ROWS;
    const int n_last = (r0 + nr - 1) / G;
    /* keys any row of the chunk sees: from the first row's first key to the last row's last */
    const int k_lo = window_lo(n_past + r0 / G, window);
    const int k_begin = k_lo / F32_KT * F32_KT, k_end = n_past + n_last + 1;

    const int ks = HS | 1;
    float *sq = f32_sm;                       /* (nr, HS) */
    float *sk = sq + F32_ROWS * HS;           /* (KT, ks) */
    float *sv = sk + F32_KT * ks;             /* (KT, HS) */
    float *sp = sv + F32_KT * HS;             /* (ROWS, KT) */
    float *salpha = sp + F32_ROWS * F32_KT; /* (ROWS) */
    float *sl = salpha + F32_ROWS;            /* (ROWS) */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t kvstride = (int64_t)KVH * HS;
    const float *kbase = k + (int64_t)kvh * HS;
    const float *vbase = v + (int64_t)kvh * HS;

    for (int e = tid; e < nr * HS; e += F32_THREADS) {
        const int r = e / HS, d = e - r * HS;
        const int rr = r0 + r, n = rr / G, h = kvh * G + rr % G;
        sq[e] = q[((int64_t)n * NH + h) * HS + d];
    }
    float m_r[F32_ROWS / F32_WARPS], l_r[F32_ROWS / F32_WARPS];
#pragma unroll
    for (int i = 0; i < F32_ROWS / F32_WARPS; i++) {
        m_r[i] = -INFINITY;
        l_r[i] = 0.0f;
    }
    float acc[F32_ACC];
#pragma unroll
    for (int i = 0; i < F32_ACC; i++) acc[i] = 0.0f;

    for (int kt = k_begin; kt < k_end; kt += F32_KT) {
        const int nk = k_end - kt < F32_KT ? k_end - kt : F32_KT;
        __syncthreads(); /* the previous sub-tile's sk, sv, sp are no longer read */
        for (int e = tid; e < F32_KT * HS; e += F32_THREADS) {
            const int j = e / HS, d = e - j * HS;
            float kx = 0.0f, vx = 0.0f; /* keys outside the range: zeros (p = 0 meets no NaN) */
            if (j < nk && kt + j >= k_lo) {
                const int64_t off = (int64_t)(kt + j) * kvstride + d;
                kx = kbase[off];
                vx = vbase[off];
            }
            sk[j * ks + d] = kx;
            sv[j * HS + d] = vx;
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < F32_ROWS / F32_WARPS; i++) {
            const int r = warp + F32_WARPS * i;
            if (r < nr) { /* warp-uniform */
                const int n = (r0 + r) / G;
                const int key = kt + lane;
                const float *qr = sq + r * HS, *kr = sk + lane * ks;
                float dot = 0.0f;
                for (int d = 0; d < HS; d++) dot = fmaf(qr[d], kr[d], dot);
                const bool ok = lane < nk && key <= n_past + n &&
                                key >= window_lo(n_past + n, window);
                const float s = ok ? dot * scale : -INFINITY;
                const float mn = fmaxf(m_r[i], warp_max(s));
                float alpha = 1.0f, p = 0.0f;
                if (mn != -INFINITY) { /* else nothing seen yet: acc stays 0 */
                    alpha = kiln_expf(m_r[i] - mn);
                    p = ok ? kiln_expf(s - mn) : 0.0f;
                }
                l_r[i] = l_r[i] * alpha + warp_sum(p);
                m_r[i] = mn;
                sp[r * F32_KT + lane] = p;
                if (lane == 0) salpha[r] = alpha;
            }
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < F32_ACC; i++) {
            const int e = tid + i * F32_THREADS;
            if (e < nr * HS) {
                const int r = e / HS, d = e - r * HS;
                const float *pr = sp + r * F32_KT;
                float a = acc[i] * salpha[r];
                for (int j = 0; j < nk; j++) a = fmaf(pr[j], sv[j * HS + d], a);
                acc[i] = a;
            }
        }
    }

#pragma unroll
    for (int i = 0; i < F32_ROWS / F32_WARPS; i++) {
        const int r = warp + F32_WARPS * i;
        if (r < nr && lane == 0) sl[r] = l_r[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < F32_ACC; i++) {
        const int e = tid + i * F32_THREADS;
        if (e < nr * HS) {
            const int r = e / HS, d = e - r * HS;
            const int rr = r0 + r, n = rr / G, h = kvh * G + rr % G;
            out[((int64_t)n * NH + h) * HS + d] = acc[i] / sl[r];
        }
    }
}

/* ==== the split decode kernel: a block per (64-key split, kv head, 16 rows, sequence) ======= */

#define DEC_THREADS 256
#define DEC_WARPS (DEC_THREADS / 32)
#define DEC_ROWS 16     /* query rows (token, head of the kv group) per chunk */
#define DEC_RPB 4       /* of a chunk's rows, per block: a short-context decode of 7 heads a
                         * kv head took 7.0 us a call with 4 against 7.7 with 16 (H100, the
                         * Qwen2.5-0.5B shape, 512 keys; 12.1 against 13.4 at 4096 keys); 2
                         * was 17.6 at 4096 keys */
#define DEC_RG 4        /* row groups of the score phase: thread (key j, group g) takes rows
                         * g, g + 4, g + 8, g + 12 */
#define DEC_FUSE_MAX 64 /* most splits a grid may have for its last block to do the combine
                         * (two per lane in the combine's row phase) */
#define DEC_ACC (DEC_ROWS * KILN_ATTN_FAST_MAX_HS / DEC_THREADS) /* (row, d) per thread */
static_assert(KILN_ATTN_SPLIT == 64, "a split is two keys per lane of a warp");
static_assert(DEC_THREADS == KILN_ATTN_SPLIT * DEC_RG, "score phase: one (key, row group) per "
                                                       "thread");
static_assert(DEC_ROWS == DEC_RG * 4, "score phase: four rows per thread");
static_assert(DEC_FUSE_MAX == 64, "fused combine: two splits per lane");
static_assert((DEC_ROWS * KILN_ATTN_FAST_MAX_HS) % DEC_THREADS == 0, "acc tiling");

/* Blocks per chunk of DEC_ROWS rows (of a kv group's R), each taking DEC_RPB rows: the
 * chunk's keys and splits are the chunk's whoever computes its rows, so DEC_RPB never changes
 * a bit; fewer rows a block spread a short-context decode over more SMs. */
static __host__ __device__ __forceinline__ int dec_subs(int R) {
    const int m = R < DEC_ROWS ? R : DEC_ROWS;
    return (m + DEC_RPB - 1) / DEC_RPB;
}

/* HS rounded up to a multiple of 4 (rows of sQ, sK are whole float4s). */
static __host__ __device__ __forceinline__ int dec_hs4(int HS) { return (HS + 3) & ~3; }

/* Shared memory of decode_kernel for head size HS, floats: sQ (ROWS, HS4), sK (SPLIT, HS4 +
 * 4: 16-byte rows whose stride is 4 words mod 32 when HS % 32 == 0, so the 8 lanes of a
 * quarter warp reading float4s of 8 different keys hit 8 different bank quads), sV (SPLIT,
 * HS), sP (ROWS, SPLIT), sW and sLs (ROWS, FUSE_MAX), sM, sL, sLt (ROWS), sNs and sLast
 * (ROWS ints), sOut and sPart (ROWS int64s; every region before them is a multiple of 16
 * floats, so they are 8-byte aligned). */
static size_t dec_smem(int HS) {
    const size_t hs4 = (size_t)dec_hs4(HS);
    return sizeof(float) * (DEC_ROWS * hs4 + KILN_ATTN_SPLIT * (hs4 + 4) +
                            (size_t)KILN_ATTN_SPLIT * HS + DEC_ROWS * KILN_ATTN_SPLIT +
                            2 * DEC_ROWS * DEC_FUSE_MAX + 9 * DEC_ROWS);
}

/* Query head and token of row rr (= n * G + g) of kv head kvh's group. */
static __device__ __forceinline__ void dec_row(int rr, int G, int kvh, int *n, int *h) {
    *n = rr / G;
    *h = kvh * G + rr % G;
}

/* The keys the rows of a chunk see (chunks of DEC_ROWS of a kv group's R rows, G heads a
 * token; the chunk holds row rr): from its first row's first, *lo, to one past its last row's
 * last, *end (<= max_T). They fix the chunk's splits and each split's nk. */
static __device__ __forceinline__ void dec_chunk_keys(int rr, int R, int G, int n_past,
                                                      int window, int *lo, int *end) {
    const int c0 = rr / DEC_ROWS * DEC_ROWS;
    const int cnr = R - c0 < DEC_ROWS ? R - c0 : DEC_ROWS;
    *lo = window_lo(n_past + c0 / G, window);
    *end = n_past + (c0 + cnr - 1) / G + 1;
}

/* Whether keys lo .. end - 1 lie in one split: a chunk whose keys do has its output written by
 * its decode_kernel blocks, and combine_kernel leaves those rows alone. */
static __device__ __forceinline__ bool dec_one_split(int lo, int end) {
    return (end + KILN_ATTN_SPLIT - 1) / KILN_ATTN_SPLIT - lo / KILN_ATTN_SPLIT == 1;
}

/* The combine of one row's splits -- THE definition of a decode row's bits, shared with
 * combine_kernel (which must do the same operations): over the row's splits s = 0 .. ns - 1
 * with partials (m_s, l_s, acc_s),
 *   M = max m_s (exact);  w_s = kiln_expf(m_s - M);  L = fmaf(w_s, l_s, L) in increasing s
 *   from +0;  a(d) = fmaf(w_s, acc_s(d), a) in increasing s from +0;  out(d) = a(d) / L.
 * A row whose keys lie in one split (ns = 1) is written by its split block with the same
 * operations (w = kiln_expf(m - m) = 1, L = fmaf(w, l, +0), out = fmaf(w, acc, +0) / L), so
 * the bits never depend on which block or kernel does the combine. */

/* decode_kernel: rows of kv head kvh's group are (token n, head of the group g), row = n * G
 * + g, query head h = kvh * G + g; the rows go in chunks of 16 (DEC_ROWS). Block (blockIdx.x =
 * (chunk * nsub + sub) * KVH + kvh, blockIdx.y = split s, blockIdx.z = sequence b) takes rows
 * r0 .. r0 + nr - 1, the sub-th DEC_RPB of the chunk (nsub = dec_subs), and keys kb =
 * s * SPLIT .. kb + nk - 1, the split's keys that some row of the chunk sees (none: the block
 * returns at once). Per block:
 *   1. q rows, K and V of the split go to shared memory by cp.async (q and K first, their
 *      own group, so the scores start while V is still arriving; 16-byte copies when VEC,
 *      else 4-byte ones), keys past nk and below the chunk's first row's window as zeros.
 *      Each row's output offset and partial index go to shared memory once.
 *   2. Scores: thread (key j = tid % 64, row group tid / 64) takes rows of its group; per row
 *      four fmaf chains over d = 4c + i (c increasing; chain i takes component i), dot =
 *      (c0 + c1) + (c2 + c3), score = dot * scale, -inf when key > n_past + n.
 *   3. Per row (a warp each), over the split's 64 keys: m = max, p = kiln_expf(s - m) (0 for
 *      -inf scores), l = butterfly sum of (p_lane + p_lane+32).
 *   4. acc(r, d) = fmaf(p_j, v_j(d), acc) for j = 0 .. nk - 1 in order.
 *   5. Output. If every row of the chunk sees only this split, this block writes its rows'
 *      out directly (with fuse == 0 too: combine_kernel leaves those rows alone, so a decode
 *      at a short context costs no partials and no combine however large max_T is).
 *      Otherwise the partial (m, l, acc) of its rows goes to the workspace; fuse == 0:
 *      combine_kernel follows; fuse == 1: of the blocks with the same blockIdx.x (the same
 *      rows, one per split), the one that arrives last at their counter (atomicAdd, for
 *      signalling only) resets the counter and does the combine of those rows in split
 *      order.
 * window > 0 (a sliding window): row n sees keys lo_n = window_lo(n_past + n) .. n_past + n
 * only. Its splits are those holding some of them, s_lo = lo_n / SPLIT .. its last; a split
 * below the chunk's first row's s_lo returns at once (reading neither keys nor the table),
 * keys below the chunk's first row's lo are staged as zeros, and a key outside a row's range
 * scores -inf; the combine runs over the row's splits only. window 0: lo_n = 0.
 * A row's operations depend on its q, its keys, SPLIT and the chunk's nk (a row of an earlier
 * token takes the later tokens' keys with p = 0: fmaf(0, v, acc), which leaves acc as it is
 * for a finite v, but for the sign of a zero acc; a NaN or infinite v there makes it NaN) --
 * not on the grid, the block order or which block combines -- so the result is deterministic
 * and decode_dev (any B, max_T) has the bits of attention_fast with N = 1.
 * A sequence whose keys pass max_T (or a negative n_past) reads nothing; its rows get NaN
 * (from split 0 when fuse, else from the combine). q, out: (B, N, NH, HS); k, v: sequence b
 * at b * kv_seq_stride, (T, KVH, HS); paged (pg.table; N = 1): b is a decode token of a
 * batch and its split's rows are found through the block table (kiln_cuda_attn_pages),
 * nothing else changes; ws_cnt: B * gridDim.x counters, all 0 on entry and on exit.
 * HST: the head size as a constant (64, 128), so that the loops over d unroll and the index
 * arithmetic folds; 0 takes HS from the argument (any head size). VEC: HS % 4 == 0 and every
 * row start of q, k and v 16-byte aligned. Neither changes an operation. */
template <bool VEC, int HST>
static __global__ void __launch_bounds__(DEC_THREADS, 2)
decode_kernel(float *__restrict__ out, float *ws_acc, float *ws_ml, unsigned *ws_cnt,
              const float *__restrict__ q, const float *__restrict__ k,
              const float *__restrict__ v, int N, int n_past_host,
              const int32_t *__restrict__ d_n_past, size_t kv_seq_stride,
              kiln_cuda_attn_pages pg, int NH, int KVH, int HS_arg, float scale, int nsplit_max,
              int max_T, int fuse, int window) {
    static_assert(HST == 0 || (VEC && HST % 32 == 0 && HST <= KILN_ATTN_FAST_MAX_HS),
                  "a constant head size is a multiple of 32 with 16-byte copies");
    pdl_wait(); /* launched by launch_pdl: nothing read before the kernel before ends */
    pdl_launch_dependents();
    constexpr int S = KILN_ATTN_SPLIT;
    /* (row, d) elements per thread at most: 16 rows of HS */
    constexpr int NACC = HST ? (DEC_ROWS * HST + DEC_THREADS - 1) / DEC_THREADS : DEC_ACC;
    static_assert(NACC % 2 == 0, "elements go in pairs");
    const int HS = HST ? HST : HS_arg;
    extern __shared__ __align__(16) float dec_sm[];
    __shared__ int s_last;
    const int G = NH / KVH;
    const int R = G * N;
    const int kvh = (int)(blockIdx.x % (unsigned)KVH);
    const int cs = (int)(blockIdx.x / (unsigned)KVH); /* chunk * nsub + sub */
    const int nsub = dec_subs(R);
    const int chunk = cs / nsub, sub = cs - chunk * nsub;
    const int c0 = chunk * DEC_ROWS;                       /* the chunk's rows c0 .. */
    const int cnr = R - c0 < DEC_ROWS ? R - c0 : DEC_ROWS; /* .. c0 + cnr - 1 */
    const int r0 = c0 + sub * DEC_RPB;                     /* the block's rows r0 .. */
    const int nr = cnr - sub * DEC_RPB < DEC_RPB ? cnr - sub * DEC_RPB : DEC_RPB; /* .. + nr - 1 */
    if (nr <= 0) return; /* block-uniform */
    const int split = (int)blockIdx.y, b = (int)blockIdx.z;
    /* paged: b is a decode token (N = 1), batch token pg.tok[b] (b without tok) */
    const int tok = pg.table ? (pg.tok ? pg.tok[b] : b) : 0;
    const int n_past = pg.table ? pg.pos[tok] : d_n_past ? d_n_past[b] : n_past_host;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    /* token index base of sequence b in q, out */
    const int64_t out_b = pg.table ? (int64_t)tok : (int64_t)b * N;

    /* keys past max_T or past the block table: nothing to read */
    if (n_past < 0 || (int64_t)n_past + N > max_T ||
        (pg.table && n_past / pg.block_size >= pg.max_blocks)) {
        if (fuse && split == 0)
            for (int e = tid; e < nr * HS; e += DEC_THREADS) {
                const int r = e / HS, d = e - r * HS;
                int n, h;
                dec_row(r0 + r, G, kvh, &n, &h);
                out[((out_b + n) * NH + h) * HS + d] = NAN;
            }
        return;
    }
    int all_lo, all_end; /* the keys of the chunk's rows */
    dec_chunk_keys(c0, R, G, n_past, window, &all_lo, &all_end);
    /* block-uniform, before any barrier (and before the table is read) */
    if ((int64_t)split * S >= all_end || (int64_t)(split + 1) * S <= all_lo) return;
    const int kb = split * S;
    const int nk = all_end - kb < S ? all_end - kb : S;
    const int s_first = all_lo / S;        /* the group's first split with keys */
    const int nsg = (all_end + S - 1) / S; /* one past its last */

    const int hs4 = dec_hs4(HS), kst = hs4 + 4;
    float *sQ = dec_sm;                        /* (ROWS, hs4) */
    float *sK = sQ + DEC_ROWS * hs4;           /* (S, kst) */
    float *sV = sK + S * kst;                  /* (S, HS) */
    float *sP = sV + S * HS;                   /* (ROWS, S): scores, then p */
    float *sW = sP + DEC_ROWS * S;             /* (ROWS, FUSE_MAX): combine weights */
    float *sLs = sW + DEC_ROWS * DEC_FUSE_MAX; /* (ROWS, FUSE_MAX): the splits' l */
    float *sM = sLs + DEC_ROWS * DEC_FUSE_MAX; /* (ROWS) */
    float *sL = sM + DEC_ROWS;                 /* (ROWS) */
    float *sLt = sL + DEC_ROWS;                /* (ROWS): combined L */
    int *sNs = reinterpret_cast<int *>(sLt + DEC_ROWS);  /* (ROWS): splits of the row */
    int *sLast = sNs + DEC_ROWS;                         /* (ROWS): the row's last key */
    int64_t *sOut = reinterpret_cast<int64_t *>(sLast + DEC_ROWS); /* (ROWS): out row offset */
    int64_t *sPart = sOut + DEC_ROWS; /* (ROWS): partial index of (b, split 0, n, h) */

    /* the rows' offsets, once (read after the staging barrier) */
    if (tid < nr) {
        int n, h;
        dec_row(r0 + tid, G, kvh, &n, &h);
        sLast[tid] = n_past + n;
        sOut[tid] = ((out_b + n) * NH + h) * HS;
        sPart[tid] = partial_index(b, 0, n, h, N, NH, nsplit_max);
    }

    /* 1. staging */
    const int64_t kvstride = (int64_t)KVH * HS;
    /* the split's first cache row: paged, its block's pool row (a split of 64 keys never
     * straddles a block: block_size % 64 == 0) */
    const int64_t krow =
        pg.table ? (int64_t)pg.table[(int64_t)pg.seq[tok] * pg.max_blocks + kb / pg.block_size] *
                           pg.block_size + kb % pg.block_size
                 : kb;
    const int64_t kv0 = (pg.table ? 0 : (int64_t)b * (int64_t)kv_seq_stride) +
                        (int64_t)kvh * HS + krow * kvstride;
    const float *kbase = k + kv0, *vbase = v + kv0;
    /* every copy in flight at once (plain loads in a loop left each thread a serial chain of
     * global round trips); rows past nr and columns HS .. hs4 - 1 are zeros */
    if (VEC) { /* HS % 4 == 0 (so hs4 == HS), every row start 16-byte aligned */
        const int c4 = HS / 4;
        for (int e = tid; e < DEC_ROWS * c4; e += DEC_THREADS) {
            const int r = e / c4, c = (e - r * c4) * 4;
            float *dst = sQ + r * HS + c;
            if (r < nr) {
                int n, h;
                dec_row(r0 + r, G, kvh, &n, &h);
                __pipeline_memcpy_async(dst, q + ((out_b + n) * NH + h) * HS + c, 16);
            } else {
                *reinterpret_cast<float4 *>(dst) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
        }
        for (int e = tid; e < S * c4; e += DEC_THREADS) {
            const int j = e / c4, c = (e - j * c4) * 4;
            float *dst = sK + j * kst + c;
            if (j < nk && kb + j >= all_lo)
                __pipeline_memcpy_async(dst, kbase + j * kvstride + c, 16);
            else
                *reinterpret_cast<float4 *>(dst) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        __pipeline_commit();
        for (int e = tid; e < S * c4; e += DEC_THREADS) {
            const int j = e / c4, c = (e - j * c4) * 4;
            float *dst = sV + j * HS + c;
            if (j < nk && kb + j >= all_lo)
                __pipeline_memcpy_async(dst, vbase + j * kvstride + c, 16);
            else
                *reinterpret_cast<float4 *>(dst) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        __pipeline_commit();
    } else { /* any alignment, any HS: K's columns HS .. hs4 - 1 are zeros */
        for (int e = tid; e < DEC_ROWS * hs4; e += DEC_THREADS) {
            const int r = e / hs4, d = e - r * hs4;
            if (r < nr && d < HS) {
                int n, h;
                dec_row(r0 + r, G, kvh, &n, &h);
                __pipeline_memcpy_async(sQ + e, q + ((out_b + n) * NH + h) * HS + d, 4);
            } else {
                sQ[e] = 0.0f;
            }
        }
        for (int e = tid; e < S * hs4; e += DEC_THREADS) {
            const int j = e / hs4, d = e - j * hs4;
            float *dst = sK + j * kst + d;
            if (j < nk && kb + j >= all_lo && d < HS)
                __pipeline_memcpy_async(dst, kbase + j * kvstride + d, 4);
            else
                *dst = 0.0f;
        }
        __pipeline_commit();
        for (int e = tid; e < S * HS; e += DEC_THREADS) {
            const int j = e / HS, d = e - j * HS;
            float *dst = sV + j * HS + d;
            if (j < nk && kb + j >= all_lo)
                __pipeline_memcpy_async(dst, vbase + j * kvstride + d, 4);
            else
                *dst = 0.0f;
        }
        __pipeline_commit();
    }
    __pipeline_wait_prior(1); /* this thread's q and K copies have landed (V may not have) */
    __syncthreads();          /* everyone's q and K copies, the zeros and the row offsets */

    /* 2. scores: with HST the loop over d unrolls, so the K and q loads of a thread are
     * issued together ahead of its fmafs */
    {
        const int j = tid % S, rg = tid / S; /* rg is warp-uniform (S = 2 warps) */
        float a[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = a[i][2] = a[i][3] = 0.0f;
        const float *kr = sK + j * kst;
#pragma unroll(HST ? HST / 4 : 1)
        for (int c = 0; c < hs4; c += 4) {
            const float4 kx = *reinterpret_cast<const float4 *>(kr + c);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int r = rg + DEC_RG * i;
                if (r < nr) {
                    const float4 qx = *reinterpret_cast<const float4 *>(sQ + r * hs4 + c);
                    a[i][0] = fmaf(qx.x, kx.x, a[i][0]);
                    a[i][1] = fmaf(qx.y, kx.y, a[i][1]);
                    a[i][2] = fmaf(qx.z, kx.z, a[i][2]);
                    a[i][3] = fmaf(qx.w, kx.w, a[i][3]);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = rg + DEC_RG * i;
            if (r < nr) {
                const int last = sLast[r];
                const float dot = (a[i][0] + a[i][1]) + (a[i][2] + a[i][3]);
                const bool ok = j < nk && kb + j <= last && kb + j >= window_lo(last, window);
                sP[r * S + j] = ok ? dot * scale : -INFINITY;
            }
        }
    }
    __syncthreads();

    /* 3. the split's softmax statistics per row */
    for (int r = warp; r < nr; r += DEC_WARPS) { /* warp-uniform */
        const float s0 = sP[r * S + lane], s1 = sP[r * S + lane + 32];
        const float m = warp_max(fmaxf(s0, s1));
        const float p0 = s0 == -INFINITY ? 0.0f : kiln_expf(s0 - m);
        const float p1 = s1 == -INFINITY ? 0.0f : kiln_expf(s1 - m);
        const float l = warp_sum(p0 + p1);
        sP[r * S + lane] = p0;
        sP[r * S + lane + 32] = p1;
        if (lane == 0) {
            sM[r] = m; /* -inf, l = 0 and acc = 0 for a row that sees none of the keys */
            sL[r] = l;
        }
    }
    __pipeline_wait_prior(0); /* this thread's V copies have landed */
    __syncthreads();          /* everyone's V copies, p, m, l */

    /* 4. acc = sum_j p_j v_j over the split's keys in order. Element e = tid + i *
     * THREADS of the chunk's (nr, HS) rows; a thread runs its elements two at a time, each
     * pair's two chains side by side, four keys a step (p of the four by one 16-byte load,
     * all loads of a step issued before its fmafs). An element past ne runs on row 0 and is
     * not written. */
    const int ne = nr * HS;
    const int na = (ne + DEC_THREADS - 1) / DEC_THREADS; /* block-uniform */
    const int nk4 = nk & ~3;
    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; i++) acc[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < NACC; i += 2) {
        if (i >= na) break;
        const int e0 = tid + i * DEC_THREADS, e1 = e0 + DEC_THREADS;
        const int ra = e0 < ne ? e0 / HS : 0, rb = e1 < ne ? e1 / HS : 0;
        const int da = e0 < ne ? e0 - ra * HS : 0, db = e1 < ne ? e1 - rb * HS : 0;
        const float *pa = sP + ra * S, *pb = sP + rb * S;
        float x = 0.0f, y = 0.0f;
#pragma unroll 2
        for (int j = 0; j < nk4; j += 4) {
            const float4 qa = *reinterpret_cast<const float4 *>(pa + j);
            const float4 qb = *reinterpret_cast<const float4 *>(pb + j);
            const float *vj = sV + j * HS;
            const float va0 = vj[da], va1 = vj[HS + da], va2 = vj[2 * HS + da],
                        va3 = vj[3 * HS + da];
            const float vb0 = vj[db], vb1 = vj[HS + db], vb2 = vj[2 * HS + db],
                        vb3 = vj[3 * HS + db];
            x = fmaf(qa.x, va0, x);
            y = fmaf(qb.x, vb0, y);
            x = fmaf(qa.y, va1, x);
            y = fmaf(qb.y, vb1, y);
            x = fmaf(qa.z, va2, x);
            y = fmaf(qb.z, vb2, y);
            x = fmaf(qa.w, va3, x);
            y = fmaf(qb.w, vb3, y);
        }
        for (int j = nk4; j < nk; j++) {
            x = fmaf(pa[j], sV[j * HS + da], x);
            y = fmaf(pb[j], sV[j * HS + db], y);
        }
        acc[i] = x;
        acc[i + 1] = y; /* NACC is even */
    }

    /* 5. output */
    if (dec_one_split(all_lo, all_end)) { /* the chunk's rows see only this split: ns = 1 */
#pragma unroll
        for (int i = 0; i < NACC; i++) {
            if (i >= na) break;
            const int e = tid + i * DEC_THREADS;
            if (e < ne) {
                const int r = e / HS, d = e - r * HS;
                const float w = kiln_expf(sM[r] - sM[r]);
                const float L = fmaf(w, sL[r], 0.0f);
                out[sOut[r] + d] = fmaf(w, acc[i], 0.0f) / L;
            }
        }
        return;
    }
    const int64_t pstep = (int64_t)N * NH; /* partial index from split s to s + 1 */
#pragma unroll
    for (int i = 0; i < NACC; i++) {
        if (i >= na) break;
        const int e = tid + i * DEC_THREADS;
        if (e < ne) {
            const int r = e / HS, d = e - r * HS;
            ws_acc[(sPart[r] + split * pstep) * HS + d] = acc[i];
        }
    }
    if (tid < nr) {
        const int64_t pi = sPart[tid] + split * pstep;
        ws_ml[2 * pi] = sM[tid];
        ws_ml[2 * pi + 1] = sL[tid];
    }
    if (!fuse) return;

    /* the last of the group's nsg blocks to arrive combines (the arrival pattern of
     * cooperative groups' grid barrier): the barrier orders every thread's partial writes
     * before thread 0's fence (cumulative, device scope), which orders them before its
     * arrival; the last arriver's thread 0 fences after seeing the count, and the barrier
     * orders that before every thread's reads. One fence per block instead of one per
     * thread (256 fences, each waiting for its warp's stores to be acknowledged). */
    __syncthreads();
    unsigned *cnt = ws_cnt + (int64_t)b * gridDim.x + blockIdx.x;
    if (tid == 0) {
        __threadfence();
        const unsigned old = atomicAdd(cnt, 1u);
        const int last = old == (unsigned)(nsg - s_first - 1); /* the blocks that got here */
        if (last) {
            __threadfence(); /* the other blocks' partials, seen through the count, read after */
            atomicExch(cnt, 0u); /* all nsg blocks have counted: ready for the next call */
        }
        s_last = last;
    }
    __syncthreads();
    if (!s_last) return; /* block-uniform */

    /* the combine (definition above), partials read through L2 (__ldcg: written by other
     * SMs during this kernel) */
    const int64_t mstep = 2 * pstep;             /* ws_ml floats from split s to s + 1 */
    const int64_t astep = pstep * HS;            /* ws_acc floats from split s to s + 1 */
    for (int r = warp; r < nr; r += DEC_WARPS) { /* warp-uniform */
        /* the row's splits s_lo .. s_lo + ns - 1 (ns <= nsg <= nsplit_max <= FUSE_MAX), taken
         * from 0 below */
        const int last = sLast[r];
        const int s_lo = window_lo(last, window) / S;
        const int ns = last / S + 1 - s_lo;
        const float *ml = ws_ml + 2 * (sPart[r] + s_lo * pstep);
        /* lane takes splits lane and lane + 32 (ns <= 64): all four loads in flight at once */
        const bool h0 = lane < ns, h1 = lane + 32 < ns;
        const float m0 = h0 ? __ldcg(ml + lane * mstep) : -INFINITY;
        const float l0 = h0 ? __ldcg(ml + lane * mstep + 1) : 0.0f;
        const float m1 = h1 ? __ldcg(ml + (lane + 32) * mstep) : -INFINITY;
        const float l1 = h1 ? __ldcg(ml + (lane + 32) * mstep + 1) : 0.0f;
        const float M = warp_max(fmaxf(m0, m1));
        if (h0) {
            sW[r * DEC_FUSE_MAX + lane] = kiln_expf(m0 - M);
            sLs[r * DEC_FUSE_MAX + lane] = l0;
        }
        if (h1) {
            sW[r * DEC_FUSE_MAX + lane + 32] = kiln_expf(m1 - M);
            sLs[r * DEC_FUSE_MAX + lane + 32] = l1;
        }
        __syncwarp();
        if (lane == 0) {
            float L = 0.0f;
            for (int s = 0; s < ns; s++)
                L = fmaf(sW[r * DEC_FUSE_MAX + s], sLs[r * DEC_FUSE_MAX + s], L);
            sLt[r] = L;
            sNs[r] = ns;
        }
    }
    __syncthreads();
    for (int e = tid; e < ne; e += DEC_THREADS) { /* one (row, d) at a time */
        const int r = e / HS, d = e - r * HS;
        const int ns = sNs[r];
        const int s_lo = window_lo(sLast[r], window) / S;
        const float *ap = ws_acc + (sPart[r] + s_lo * pstep) * HS + d;
        const float *wr = sW + r * DEC_FUSE_MAX;
        float a = 0.0f;
        for (int s0 = 0; s0 < ns; s0 += 16) { /* 16 loads in flight, then their fmafs in order */
            float x[16];
#pragma unroll
            for (int u = 0; u < 16; u++)
                x[u] = s0 + u < ns ? __ldcg(ap + (s0 + u) * astep) : 0.0f;
#pragma unroll
            for (int u = 0; u < 16; u++)
                if (s0 + u < ns) a = fmaf(wr[s0 + u], x[u], a);
        }
        out[sOut[r] + d] = a / sLt[r];
    }
}

/* The combine as its own kernel, for grids of more than DEC_FUSE_MAX splits (decode_kernel's
 * fuse == 0): the merge of the splits of row (b, n, h), blockIdx.x = n * NH + h, blockIdx.y =
 * b. The row saw keys 0 .. n_past + n, which lie in splits 0 .. ns - 1, ns = (n_past + n) /
 * SPLIT + 1, each with at least one key, so every m_s read is finite. The operations are the
 * combine defined above decode_kernel, one for one (decode_kernel's fused combine and its
 * single-split output do the same), in increasing s:
 *   M = max m_s;  w_s = kiln_expf(m_s - M);  L = fmaf(w_s, l_s, L);  a(d) = fmaf(w_s,
 *   acc_s(d), a);  out(d) = a(d) / L.
 * A sequence whose keys pass max_T (n_past + N > max_T, or n_past < 0: a d_n_past beyond
 * decode_dev's max_T) gets NaN, as decode_kernel computed nothing for it. Paged (pg.table):
 * b is a decode token as in decode_kernel (its position pg.pos[tok], its q/out row tok).
 * window > 0: the row's splits start at s_lo = window_lo(n_past + n) / SPLIT (the ones below
 * hold none of its keys), as in decode_kernel's combine. A row whose chunk sees one split only
 * (dec_one_split) was written by decode_kernel, and its block returns at once. */
#define COMBINE_THREADS 128
#define COMBINE_CHUNK 256 /* split weights staged in shared memory at a time */

static __global__ void __launch_bounds__(COMBINE_THREADS, 4)
combine_kernel(float *__restrict__ out, const float *__restrict__ ws_acc,
               const float *__restrict__ ws_ml, int N, int n_past_host,
               const int32_t *__restrict__ d_n_past, kiln_cuda_attn_pages pg, int NH,
               int KVH, int HS, int nsplit_max, int max_T, int window) {
    pdl_wait(); /* launched by launch_pdl: nothing read before the kernel before ends */
    pdl_launch_dependents();
    __shared__ float sw[COMBINE_CHUNK], sl[COMBINE_CHUNK], sred[COMBINE_THREADS / 32];
    const int n = (int)(blockIdx.x / (unsigned)NH), h = (int)(blockIdx.x % (unsigned)NH);
    const int b = (int)blockIdx.y;
    const int tok = pg.table ? (pg.tok ? pg.tok[b] : b) : 0;
    const int n_past = pg.table ? pg.pos[tok] : d_n_past ? d_n_past[b] : n_past_host;
    float *o = out + (((pg.table ? (int64_t)tok : (int64_t)b * N) + n) * NH + h) * HS;
    const int64_t last = (int64_t)n_past + n;
    if (n_past < 0 || (int64_t)n_past + N > max_T ||
        (pg.table && n_past / pg.block_size >= pg.max_blocks)) {
        for (int d = threadIdx.x; d < HS; d += COMBINE_THREADS) o[d] = NAN;
        return;
    }
    const int G = NH / KVH;
    int c_lo, c_end; /* the keys of the chunk holding the row */
    dec_chunk_keys(n * G + h % G, G * N, G, n_past, window, &c_lo, &c_end);
    if (dec_one_split(c_lo, c_end)) return; /* decode_kernel wrote the row */
    const int s_lo = window_lo((int)last, window) / KILN_ATTN_SPLIT;
    const int ns = (int)(last / KILN_ATTN_SPLIT) + 1 - s_lo; /* splits s_lo .. s_lo + ns - 1 */
    const int64_t p0 = partial_index(b, s_lo, n, h, N, NH, nsplit_max);
    const int64_t pstep = (int64_t)N * NH; /* partial index step from split s to s + 1 */
    /* M: the exact max, so any order gives it; threads take strided splits, then warps */
    float mx = -INFINITY;
    for (int s = threadIdx.x; s < ns; s += COMBINE_THREADS)
        mx = fmaxf(mx, ws_ml[2 * (p0 + s * pstep)]);
    mx = warp_max(mx);
    if ((threadIdx.x & 31) == 0) sred[threadIdx.x >> 5] = mx;
    __syncthreads();
    float M = sred[0];
    for (int w = 1; w < COMBINE_THREADS / 32; w++) M = fmaxf(M, sred[w]);
    float L = 0.0f;
    float a[KILN_ATTN_FAST_MAX_HS / COMBINE_THREADS];
#pragma unroll
    for (int i = 0; i < KILN_ATTN_FAST_MAX_HS / COMBINE_THREADS; i++) a[i] = 0.0f;
    for (int s0 = 0; s0 < ns; s0 += COMBINE_CHUNK) {
        const int cn = ns - s0 < COMBINE_CHUNK ? ns - s0 : COMBINE_CHUNK;
        __syncthreads(); /* the previous chunk's weights are no longer read */
        for (int s = threadIdx.x; s < cn; s += COMBINE_THREADS) {
            sw[s] = kiln_expf(ws_ml[2 * (p0 + (s0 + s) * pstep)] - M);
            sl[s] = ws_ml[2 * (p0 + (s0 + s) * pstep) + 1];
        }
        __syncthreads();
        for (int s = 0; s < cn; s++) L = fmaf(sw[s], sl[s], L);
#pragma unroll
        for (int i = 0; i < KILN_ATTN_FAST_MAX_HS / COMBINE_THREADS; i++) {
            const int d = threadIdx.x + i * COMBINE_THREADS;
            if (d < HS) {
                float x = a[i];
                for (int s = 0; s < cn; s++)
                    x = fmaf(sw[s], ws_acc[(p0 + (s0 + s) * pstep) * HS + d], x);
                a[i] = x;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < KILN_ATTN_FAST_MAX_HS / COMBINE_THREADS; i++) {
        const int d = threadIdx.x + i * COMBINE_THREADS;
        if (d < HS) o[d] = a[i] / L;
    }
}

/* ==== flash attention on bf16 tensor cores (HS 64, 128) ====================================== */

/* Packing (kiln_cuda_attn_pack_heads): job blockIdx.y; a warp per (row, head) of its dst,
 * HS / 32 elements per lane. With rope: lanes 0..15 hold the pairs' first elements (i <
 * HS/2), lanes 16..31 their partners (i + HS/2); each lane gets the other half of its pairs
 * by a shuffle and keeps its own half of kiln_rope_pair (the same f32 operations on the same
 * values as kiln_cuda_rope's kernel). With D (the backward's dout): also d[h * Rpad + r] =
 * sum over i of src * out in the lane order then a butterfly (f32; 0 for the padding rows),
 * out read from the job's f32 out or widened (exactly) from its bf16 out16: the same
 * operations on the same values either way. */
struct pack_jobs {
    kiln_cuda_attn_pack_job j[KILN_ATTN_PACK_MAX_JOBS];
};

template <int HS>
static __global__ void pack_heads_kernel(pack_jobs jobs) {
    constexpr int E = HS / 32; /* 2 or 4 */
    const kiln_cuda_attn_pack_job &J = jobs.j[blockIdx.y];
    const int64_t wid = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31, b = (int)blockIdx.z;
    if (wid >= (int64_t)J.Rpad * J.H || b >= J.B) return;
    const int hl = (int)(wid / J.Rpad), r = (int)(wid - (int64_t)hl * J.Rpad);
    const int64_t h = (int64_t)b * J.H + hl;     /* the packed head: [B][H] as [B*H] */
    const int64_t srow = (int64_t)b * J.R + r;   /* the source row: sequence b's row r */
    float x[E], o[E];
#pragma unroll
    for (int i = 0; i < E; i++) x[i] = o[i] = 0.0f;
    if (r < J.R) {
        const float *p = J.src + (srow * J.H + hl) * HS + lane * E;
        if (E == 2) {
            const float2 v = *reinterpret_cast<const float2 *>(p);
            x[0] = v.x;
            x[1] = v.y;
        } else {
            const float4 v = *reinterpret_cast<const float4 *>(p);
            x[0] = v.x;
            x[1] = v.y;
            x[2] = v.z;
            x[3] = v.w;
        }
        if (J.rope.pos) { /* uniform over the block; the warp's row and head, so whole warps */
            constexpr int half = HS / 2; /* elements of the first halves: lanes 0..15 */
            const int64_t t = (int64_t)J.rope.pos[srow] * half + (lane & 15) * E;
            const bool first = lane < 16;
#pragma unroll
            for (int i = 0; i < E; i++) {
                const float y = __shfl_xor_sync(0xffffffffu, x[i], 16); /* the pair's other */
                const float c = J.rope.cos_tab[t + i], sn = J.rope.sin_tab[t + i];
                const float2 rr = first ? kiln_rope_pair(x[i], y, c, sn)
                                        : kiln_rope_pair(y, x[i], c, sn);
                x[i] = first ? rr.x : rr.y;
            }
        }
        if (J.out16) { /* uniform over the block; E bf16 in one 4- or 8-byte load */
            const uint16_t *po = J.out16 + (srow * J.H + hl) * HS + lane * E;
            if (E == 2) {
                const uint32_t u = *reinterpret_cast<const uint32_t *>(po);
                o[0] = bf16_lo(u);
                o[1] = bf16_hi(u);
            } else {
                const uint2 u = *reinterpret_cast<const uint2 *>(po);
                o[0] = bf16_lo(u.x);
                o[1] = bf16_hi(u.x);
                o[2] = bf16_lo(u.y);
                o[3] = bf16_hi(u.y);
            }
        } else if (J.d) {
            const float *po = J.out + (srow * J.H + hl) * HS + lane * E;
#pragma unroll
            for (int i = 0; i < E; i++) o[i] = po[i];
        }
    }
    __nv_bfloat16 *q = J.dst + (h * J.Rpad + r) * HS + lane * E;
    if (E == 2) {
        *reinterpret_cast<uint32_t *>(q) = pack_bf16(x[0], x[1]);
    } else {
        uint2 u;
        u.x = pack_bf16(x[0], x[1]);
        u.y = pack_bf16(x[2], x[3]);
        *reinterpret_cast<uint2 *>(q) = u;
    }
    if (J.d) { /* uniform over the block: every lane of the warp takes this branch */
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < E; i++) sum = fmaf(x[i], o[i], sum);
#pragma unroll
        for (int m = 16; m >= 1; m >>= 1) sum = sum + __shfl_xor_sync(0xffffffffu, sum, m);
        if (lane == 0) J.d[h * J.Rpad + r] = sum;
    }
}

/* HS 64 with 16-byte loads, where every job's pointers are 16-byte aligned (else
 * pack_heads_kernel<64>): a half-warp per (row, head), 4 consecutive elements a lane (a float4
 * of src, of out, of each rope table), two items a half-warp with every load issued before the
 * arithmetic; 59.1 -> 39.7 us for the 135M shape's forward packing at 8 x 2048 rows on the
 * H200 (bench/RESULTS.md, 2026-12-01, 027e066). The same bits as pack_heads_kernel<64>:
 *   - RoPE: lane l < 8 holds elements 4l..4l+3 (< HS/2) and lane l + 8 their partners, fetched
 *     by one shuffle; each element takes kiln_rope_pair as there;
 *   - D: pack_heads_kernel<64>'s lane L sums its two elements (2L, 2L+1) by fmaf from 0, then
 *     a butterfly over 32 lanes (xor 16, 8, 4, 2, 1, own value first). Here lane l holds old
 *     lanes 2l (a) and 2l+1 (b): old xor 16, 8, 4, 2 pair old lanes 2l and 2(l ^ 8, 4, 2, 1),
 *     so a and b each take xor 8, 4, 2, 1 within the half-warp, and old xor 1 is a + b: the
 *     same additions of the same values in the same order. */
#define PACK64_ITEMS 2
static __global__ void __launch_bounds__(256) pack_heads64_vec_kernel(pack_jobs jobs) {
    constexpr int HS = 64;
    const kiln_cuda_attn_pack_job &J = jobs.j[blockIdx.y];
    const int64_t hw = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 4; /* half-warp */
    const int lane = threadIdx.x & 15, b = (int)blockIdx.z;
    const unsigned mask = (threadIdx.x & 16) ? 0xffff0000u : 0x0000ffffu;
    const int64_t total = (int64_t)J.Rpad * J.H, it0 = hw * PACK64_ITEMS;
    if (it0 >= total || b >= J.B) return; /* uniform over the half-warp */
    float x[PACK64_ITEMS][4], o[PACK64_ITEMS][4], c[PACK64_ITEMS][4], sn[PACK64_ITEMS][4];
    int64_t h[PACK64_ITEMS];
    int r[PACK64_ITEMS];
#pragma unroll
    for (int k = 0; k < PACK64_ITEMS; k++) {
        const int64_t it = it0 + k;
        const int hl = (int)(it / J.Rpad);
        r[k] = (int)(it - (int64_t)hl * J.Rpad);
        h[k] = (int64_t)b * J.H + hl;
        const int64_t srow = (int64_t)b * J.R + r[k];
#pragma unroll
        for (int i = 0; i < 4; i++) x[k][i] = o[k][i] = 0.0f, c[k][i] = 1.0f, sn[k][i] = 0.0f;
        if (it >= total || r[k] >= J.R) continue;
        const int64_t e = (srow * J.H + hl) * HS + lane * 4;
        const float4 v = *reinterpret_cast<const float4 *>(J.src + e);
        x[k][0] = v.x, x[k][1] = v.y, x[k][2] = v.z, x[k][3] = v.w;
        if (J.rope.pos) {
            const int64_t t = (int64_t)J.rope.pos[srow] * (HS / 2) + (lane & 7) * 4;
            const float4 cv = *reinterpret_cast<const float4 *>(J.rope.cos_tab + t);
            const float4 sv = *reinterpret_cast<const float4 *>(J.rope.sin_tab + t);
            c[k][0] = cv.x, c[k][1] = cv.y, c[k][2] = cv.z, c[k][3] = cv.w;
            sn[k][0] = sv.x, sn[k][1] = sv.y, sn[k][2] = sv.z, sn[k][3] = sv.w;
        }
        if (J.out16) {
            const uint2 u = *reinterpret_cast<const uint2 *>(J.out16 + e);
            o[k][0] = bf16_lo(u.x), o[k][1] = bf16_hi(u.x), o[k][2] = bf16_lo(u.y), o[k][3] = bf16_hi(u.y);
        } else if (J.d) {
            const float4 u = *reinterpret_cast<const float4 *>(J.out + e);
            o[k][0] = u.x, o[k][1] = u.y, o[k][2] = u.z, o[k][3] = u.w;
        }
    }
#pragma unroll
    for (int k = 0; k < PACK64_ITEMS; k++) {
        if (it0 + k >= total) break; /* uniform over the half-warp */
        if (J.rope.pos) { /* uniform over the block; whole half-warps */
            const bool first = lane < 8;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float y = __shfl_xor_sync(mask, x[k][i], 8, 16); /* the pair's other */
                const float2 rr = first ? kiln_rope_pair(x[k][i], y, c[k][i], sn[k][i])
                                        : kiln_rope_pair(y, x[k][i], c[k][i], sn[k][i]);
                x[k][i] = first ? rr.x : rr.y;
            }
        }
        uint2 u;
        u.x = pack_bf16(x[k][0], x[k][1]);
        u.y = pack_bf16(x[k][2], x[k][3]);
        *reinterpret_cast<uint2 *>(J.dst + (h[k] * J.Rpad + r[k]) * HS + lane * 4) = u;
        if (J.d) { /* uniform over the block */
            float a = fmaf(x[k][1], o[k][1], fmaf(x[k][0], o[k][0], 0.0f));
            float bb = fmaf(x[k][3], o[k][3], fmaf(x[k][2], o[k][2], 0.0f));
#pragma unroll
            for (int m = 8; m >= 1; m >>= 1) {
                a = a + __shfl_xor_sync(mask, a, m, 16);
                bb = bb + __shfl_xor_sync(mask, bb, m, 16);
            }
            if (lane == 0) J.d[h[k] * J.Rpad + r[k]] = a + bb;
        }
    }
}

/* Whether every job allows pack_heads64_vec_kernel's 16-byte loads. */
static bool pack64_vec_ok(const pack_jobs &pj, int n) {
    for (int i = 0; i < n; i++) {
        const kiln_cuda_attn_pack_job &J = pj.j[i];
        uintptr_t a = (uintptr_t)J.src | (uintptr_t)J.out;
        if (J.rope.pos) a |= (uintptr_t)J.rope.cos_tab | (uintptr_t)J.rope.sin_tab;
        if ((a & 15) != 0) return false;
    }
    return true;
}

cudaError_t kiln_cuda_attn_pack_heads(cudaStream_t s, const kiln_cuda_attn_pack_job *jobs,
                                      int n, int HS) {
    if (!jobs || n <= 0 || n > KILN_ATTN_PACK_MAX_JOBS || (HS != 64 && HS != 128))
        return cudaErrorInvalidValue;
    pack_jobs pj;
    int64_t warps = 0;
    int B = 0;
    for (int i = 0; i < n; i++) {
        const kiln_cuda_attn_pack_job &J = jobs[i];
        if (!J.dst || !J.src || J.R < 0 || J.Rpad < J.R || J.Rpad % KILN_ATTN_PACK_ROWS != 0 ||
            J.H <= 0 || J.B <= 0 || J.B > 65535 || (J.out && J.out16) ||
            (J.out != NULL || J.out16 != NULL) != (J.d != NULL) || ((uintptr_t)J.out16 & 7) != 0 ||
            (J.rope.pos && (!J.rope.cos_tab || !J.rope.sin_tab || J.d)))
            return cudaErrorInvalidValue;
        pj.j[i] = J;
        const int64_t w = (int64_t)J.Rpad * J.H;
        if (w > warps) warps = w;
        if (J.B > B) B = J.B;
    }
    if (warps == 0) return cudaSuccess;
    if (HS == 64 && pack64_vec_ok(pj, n)) {
        const int64_t halves = (warps + PACK64_ITEMS - 1) / PACK64_ITEMS; /* warps = items */
        const int64_t vblocks = (halves * 16 + 255) / 256;
        if (vblocks > INT_MAX) return cudaErrorInvalidConfiguration;
        pack_heads64_vec_kernel<<<dim3((unsigned)vblocks, (unsigned)n, (unsigned)B), 256, 0, s>>>(pj);
        return cudaGetLastError();
    }
    const int64_t blocks = (warps * 32 + 255) / 256;
    if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
    const dim3 grid((unsigned)blocks, (unsigned)n, (unsigned)B);
    if (HS == 64)
        pack_heads_kernel<64><<<grid, 256, 0, s>>>(pj);
    else
        pack_heads_kernel<128><<<grid, 256, 0, s>>>(pj);
    return cudaGetLastError();
}

#define FL_THREADS 128 /* 4 warps, 16 query rows each */
#define FL_BM 64       /* query rows per block */
#define FL_BN 64       /* keys per tile */
#define FL_PAD 8       /* bf16 of padding per shared row: ldmatrix rows in distinct bank groups */
static_assert(FL_BM == 16 * (FL_THREADS / 32), "one m16 tile of rows per warp");
static_assert(FL_BM % KILN_ATTN_PACK_ROWS == 0 && FL_BN % KILN_ATTN_PACK_ROWS == 0,
              "tiles never read past the packed rows");

template <int HS>
static constexpr size_t flash_smem() {
    return sizeof(__nv_bfloat16) * (size_t)(HS + FL_PAD) * (FL_BM + 4 * FL_BN);
}

/* The flash kernel's output of two adjacent elements p[0], p[1] (p 8-byte aligned for f32,
 * 4-byte for bf16): a float2, or the two bf16 roundings as one 32-bit word (p[0] in the low
 * half: little-endian, as the elements lie in memory). */
static __device__ __forceinline__ void flash_store_pair(float *p, float x, float y) {
    *reinterpret_cast<float2 *>(p) = make_float2(x, y);
}
static __device__ __forceinline__ void flash_store_pair(uint16_t *p, float x, float y) {
    *reinterpret_cast<uint32_t *>(p) = (uint32_t)kiln_bf16_rne(x) |
                                       (uint32_t)kiln_bf16_rne(y) << 16;
}

/* One key tile (keys k0.., scores sc of the warp's rows g: sc[nt][0..1], g + 8: sc[nt][2..3])
 * of the flash forward's online softmax, for the thread's share of rows g and g + 8: masks
 * (mask: the tile reaches past a row's last key, lim0 / lim1, or, under a sliding window
 * of `window` keys, below a row's first, window_lo(lim)), updates the raw maxima m0, m1
 * and the partial sums l0, l1, rescales the accumulator o, and leaves the weights in pp as
 * bf16 pairs ([nt][0] row g, [nt][1] row g + 8: the A fragments of P V). */
template <int HS>
static __device__ __forceinline__ void flash_softmax_tile(float (&sc)[FL_BN / 8][4],
                                                          uint32_t (&pp)[FL_BN / 8][2],
                                                          float (&o)[HS / 8][4], float &m0,
                                                          float &m1, float &l0, float &l1,
                                                          float c, bool mask, int k0, int t,
                                                          int lim0, int lim1, int window) {
    /* causal mask (tiles that reach past a row's last key), online softmax in units of the
     * raw scores: m is the raw max, and a weight is exp(scale (s - m)) = 2^(s c - m c),
     * c = scale log2 e (rows g: c[0..1], g + 8: c[2..3]) */
    if (mask) {
        const int lo0 = window_lo(lim0, window), lo1 = window_lo(lim1, window);
#pragma unroll
        for (int nt = 0; nt < FL_BN / 8; nt++) {
            const int key = k0 + nt * 8 + 2 * t;
            if (key > lim0 || key < lo0) sc[nt][0] = -INFINITY;
            if (key + 1 > lim0 || key + 1 < lo0) sc[nt][1] = -INFINITY;
            if (key > lim1 || key < lo1) sc[nt][2] = -INFINITY;
            if (key + 1 > lim1 || key + 1 < lo1) sc[nt][3] = -INFINITY;
        }
    }
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < FL_BN / 8; nt++) {
        mx0 = fmaxf(mx0, fmaxf(sc[nt][0], sc[nt][1]));
        mx1 = fmaxf(mx1, fmaxf(sc[nt][2], sc[nt][3]));
    }
    /* a row's 64 scores are spread over the 4 threads of its quad (lanes 4g..4g+3) */
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    /* no key yet (the max -inf): every weight 2^-inf = 0 */
    const float nb0 = mn0 == -INFINITY ? 0.0f : -mn0 * c;
    const float nb1 = mn1 == -INFINITY ? 0.0f : -mn1 * c;
    const float al0 = ex2_approx(fmaf(m0, c, nb0)), al1 = ex2_approx(fmaf(m1, c, nb1));
    m0 = mn0;
    m1 = mn1;
    float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
    for (int nt = 0; nt < FL_BN / 8; nt++) {
        const float p0 = ex2_approx(fmaf(sc[nt][0], c, nb0));
        const float p1 = ex2_approx(fmaf(sc[nt][1], c, nb0));
        const float p2 = ex2_approx(fmaf(sc[nt][2], c, nb1));
        const float p3 = ex2_approx(fmaf(sc[nt][3], c, nb1));
        pp[nt][0] = pack_bf16(p0, p1);
        pp[nt][1] = pack_bf16(p2, p3);
        /* l sums the f32 weights (the p.v product takes them rounded to bf16) */
        ps0 = ps0 + (p0 + p1);
        ps1 = ps1 + (p2 + p3);
    }
    l0 = l0 * al0 + ps0;
    l1 = l1 * al1 + ps1;
#pragma unroll
    for (int dt = 0; dt < HS / 8; dt++) {
        o[dt][0] *= al0;
        o[dt][1] *= al0;
        o[dt][2] *= al1;
        o[dt][3] *= al1;
    }
}

/* Whether key tile k0.. needs flash_softmax_tile's mask for a warp whose first row sees keys
 * up to wfirst (its rows: wfirst .. wfirst + 15, clamped to T - 1): it reaches past the first
 * row's last key, or, under a sliding window, below the last row's first key. */
static __device__ __forceinline__ bool flash_tile_masked(int k0, int wfirst, int T, int window) {
    const int wlast = wfirst + 15 < T - 1 ? wfirst + 15 : T - 1;
    return k0 + FL_BN - 1 > wfirst || (window > 0 && k0 < window_lo(wlast, window));
}

/* The flash forward's end for the thread's rows qr0 = row g, qr1 = g + 8 of packed query head
 * hq (head h of sequence b): the quads' sums l, the log-sum-exp (lse, when given) and the
 * output rows o / l (flash_store_pair); rows >= N store nothing but an lse of 0. */
template <int HS, typename Out>
static __device__ __forceinline__ void flash_finish(Out *__restrict__ out, float *__restrict__ lse,
                                                    const float (&o)[HS / 8][4], float m0,
                                                    float m1, float l0, float l1, float scale,
                                                    int64_t hq, int Npad, int b, int h, int N,
                                                    int NH, int qr0, int qr1, int t) {
    /* the quad's partial sums (every lane ends with the same bits) */
    l0 = l0 + __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 = l0 + __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 = l1 + __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 = l1 + __shfl_xor_sync(0xffffffffu, l1, 2);
    if (lse && t == 0) { /* log-sum-exp of the scaled scores, for the backward */
        lse[hq * Npad + qr0] = qr0 < N ? m0 * scale + logf(l0) : 0.0f;
        lse[hq * Npad + qr1] = qr1 < N ? m1 * scale + logf(l1) : 0.0f;
    }
    out += (int64_t)b * N * NH * HS; /* sequence b's rows */
    if (qr0 < N) {
        Out *op = out + ((int64_t)qr0 * NH + h) * HS + 2 * t;
#pragma unroll
        for (int dt = 0; dt < HS / 8; dt++)
            flash_store_pair(op + dt * 8, o[dt][0] / l0, o[dt][1] / l0);
    }
    if (qr1 < N) {
        Out *op = out + ((int64_t)qr1 * NH + h) * HS + 2 * t;
#pragma unroll
        for (int dt = 0; dt < HS / 8; dt++)
            flash_store_pair(op + dt * 8, o[dt][2] / l1, o[dt][3] / l1);
    }
}

/* FlashAttention-2 forward (Dao 2023, Algorithm 1) for one (64-row query tile, head,
 * sequence): block (gridDim.x - 1 - blockIdx.x, blockIdx.y = h, blockIdx.z = b); the last
 * query tiles, which see the most keys, are scheduled first. Inputs packed to bf16 per head
 * (kiln_cuda_attn_pack_heads): qb [B][NH][Npad][HS], kb, vb [B][KVH][Tpad][HS], padding rows
 * zero; sequence b's q and out rows are b*N.., its keys b*T.. . Key tiles of 64 go in increasing
 * order up to the last key the tile's last row sees, double-buffered: the copy of tile j + 1
 * (cp.async) runs under the products of tile j. Each warp keeps its 16 rows' running max m,
 * per-thread partial sums l (of the f32 weights) and the O accumulator (16 x HS f32) in
 * registers; the max is of the raw scores and a weight is 2^(s c - m c), c = scale log2 e (one
 * FMA and the MUFU); fragments come
 * from shared memory by ldmatrix (cuda_mma.cuh). Masked scores (key > n_past + row, which
 * covers the padding keys) are -inf, so p = 0; tiles wholly below the diagonal skip the mask.
 * window > 0 (a sliding window): row r also masks keys below window_lo(n_past + r), the walk
 * starts at the tile holding the block's first row's first key, and a tile reaching below
 * the warp's last row's first key is masked too.
 * out: (B*N, NH, HS) of Out, float (8-byte aligned) or uint16_t (bf16 bits, each the
 * kiln_bf16_rne of the float the f32 instantiation stores; 4-byte aligned): flash_store_pair.
 * The instantiations differ in the stores only. */
template <int HS, typename Out>
static __global__ void __launch_bounds__(FL_THREADS, HS == 64 ? 4 : 1)
flash_bf16_kernel(Out *__restrict__ out, float *__restrict__ lse,
                  const __nv_bfloat16 *__restrict__ qb, const __nv_bfloat16 *__restrict__ kb,
                  const __nv_bfloat16 *__restrict__ vb, int N, int n_past, int NH, int KVH,
                  int Npad, int Tpad, float scale, int window) {
    static_assert(HS % 16 == 0, "HS is a whole number of mma k-steps");
    constexpr int LD = HS + FL_PAD; /* bf16 per shared row */
    extern __shared__ __align__(16) unsigned char flash_sm[];
    __nv_bfloat16 *sQ = reinterpret_cast<__nv_bfloat16 *>(flash_sm); /* (BM, LD) */
    __nv_bfloat16 *sK = sQ + FL_BM * LD;                              /* 2 x (BN, LD) */
    __nv_bfloat16 *sV = sK + 2 * FL_BN * LD;                          /* 2 x (BN, LD) */

    const int qt = (int)(gridDim.x - 1 - blockIdx.x), b = (int)blockIdx.z;
    const int h = (int)blockIdx.y, kvh = b * KVH + h / (NH / KVH); /* kvh: packed head */
    const int64_t hq = (int64_t)b * NH + h;                         /* packed query head */
    const int q0 = qt * FL_BM;
    const int T = n_past + N;                                /* keys 0..T-1 exist */
    const int rows = N - q0 < FL_BM ? N - q0 : FL_BM;
    const int kend = n_past + q0 + rows;                     /* keys the last row sees */
    /* the first tile any row sees (0 without a window): the walk starts there */
    const int kfirst = window_lo(n_past + q0, window) / FL_BN * FL_BN;
    const __nv_bfloat16 *kh = kb + ((int64_t)kvh * Tpad + kfirst) * HS;
    const __nv_bfloat16 *vh = vb + ((int64_t)kvh * Tpad + kfirst) * HS;
    const int nkt = (kend - kfirst + FL_BN - 1) / FL_BN;     /* tiles from kfirst on */
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;

    cp_tile<HS, FL_BM, FL_THREADS>(sQ, LD, qb + (hq * Npad + q0) * HS);
    cp_tile<HS, FL_BN, FL_THREADS>(sK, LD, kh);
    cp_tile<HS, FL_BN, FL_THREADS>(sV, LD, vh);
    cp_async_commit();

    float o[HS / 8][4];
#pragma unroll
    for (int dt = 0; dt < HS / 8; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY; /* rows g and g + 8 of the warp's 16 */
    float l0 = 0.0f, l1 = 0.0f;           /* this thread's share of their sums */
    const int qr0 = q0 + warp * 16 + g, qr1 = qr0 + 8;
    /* last key each row sees; padding rows (>= N) are clamped to real keys */
    const int lim0 = n_past + qr0 < T - 1 ? n_past + qr0 : T - 1;
    const int lim1 = n_past + qr1 < T - 1 ? n_past + qr1 : T - 1;
    /* the first key a mask can hide from one of the warp's rows; under a window, the tiles
     * below the first key of the warp's last row are masked too */
    const int wfirst = n_past + q0 + warp * 16;
    uint32_t qf[HS / 16][4];
    const float c = scale * KILN_LOG2E;

    for (int j = 0; j < nkt; j++) {
        const int k0 = kfirst + j * FL_BN, buf = j & 1;
        const bool mask = flash_tile_masked(k0, wfirst, T, window);
        if (j + 1 < nkt) { /* the next tile into the other buffer (read two tiles ago) */
            cp_tile<HS, FL_BN, FL_THREADS>(sK + (buf ^ 1) * FL_BN * LD, LD,
                                           kh + (int64_t)(j + 1) * FL_BN * HS);
            cp_tile<HS, FL_BN, FL_THREADS>(sV + (buf ^ 1) * FL_BN * LD, LD,
                                           vh + (int64_t)(j + 1) * FL_BN * HS);
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
        const __nv_bfloat16 *cK = sK + buf * FL_BN * LD, *cV = sV + buf * FL_BN * LD;

        /* S = Q K^T for the warp's 16 rows and the tile's 64 keys (8 n-tiles of 8 keys). */
        float sc[FL_BN / 8][4];
        rows_times_tile<HS, FL_BN>(sc, qf, cK, LD, lane);

        uint32_t pp[FL_BN / 8][2]; /* p as bf16 pairs: [nt][0] row g, [nt][1] row g + 8 */
        flash_softmax_tile<HS>(sc, pp, o, m0, m1, l0, l1, c, mask, k0, t, lim0, lim1, window);

        /* O += P V: k-steps of 16 keys; P's A fragment is S's C fragments (cuda_mma.cuh) */
#pragma unroll
        for (int jj = 0; jj < FL_BN / 16; jj++) {
            const uint32_t a[4] = {pp[2 * jj][0], pp[2 * jj][1], pp[2 * jj + 1][0],
                                   pp[2 * jj + 1][1]};
            frag_times_rows<HS>(o, a, cV, LD, jj * 16, lane);
        }
        __syncthreads(); /* every warp is done with this buffer before it is refilled */
    }

    flash_finish<HS>(out, lse, o, m0, m1, l0, l1, scale, hq, Npad, b, h, N, NH, qr0, qr1, t);
}

/* The flash forward on Hopper's warpgroup products (HS 64, sm_90a; cuda_wgmma.cuh): the same
 * blocks, tiles, online softmax (flash_softmax_tile) and end (flash_finish) as
 * flash_bf16_kernel, with S = Q K^T read by the product from the q and k tiles (both
 * K-major) and O += P V from P's registers and the v tile (MN-major); tiles are SW128, no
 * ldmatrix. The block's 4 warps are one warpgroup whose accumulator entries are the mma.sync
 * kernel's C fragments, so only the grouping of the f32 sums inside a product may differ.
 * A sliding window (window > 0) as in flash_bf16_kernel. The walk is pipelined: two key tiles
 * in flight from the start, and the next tile's S issued under this tile's P V product; the
 * same products of the same values in the same order as a plain walk (issue S, wait, P V,
 * wait), so the same bits, 0.125 -> 0.119 ms at the 0.5B shape's B 4 x 2048 on the H200
 * (bench/RESULTS.md, 2026-12-02, d571da7). */
#define FL_WG_TILE 4096 /* bf16 of a 64 x 64 SW128 tile */
static constexpr size_t flash_wgmma_smem() {
    return sizeof(__nv_bfloat16) * 5 * FL_WG_TILE + KILN_SW128_ALIGN;
}

template <typename Out>
static __global__ void __launch_bounds__(FL_THREADS)
flash_wgmma_kernel(Out *__restrict__ out, float *__restrict__ lse,
                   const __nv_bfloat16 *__restrict__ qb, const __nv_bfloat16 *__restrict__ kb,
                   const __nv_bfloat16 *__restrict__ vb, int N, int n_past, int NH, int KVH,
                   int Npad, int Tpad, float scale, int window) {
#if KILN_WGMMA_DEVICE
    constexpr int HS = 64;
    static_assert(FL_BM == 64 && FL_BN == 64, "one m64n64 product per tile");
    extern __shared__ __align__(16) unsigned char flash_sm[];
    __nv_bfloat16 *sQ = sw128_tiles(flash_sm);
    __nv_bfloat16 *sK = sQ + FL_WG_TILE, *sV = sK + 2 * FL_WG_TILE; /* 2 tiles each */

    const int qt = (int)(gridDim.x - 1 - blockIdx.x), b = (int)blockIdx.z;
    const int h = (int)blockIdx.y, kvh = b * KVH + h / (NH / KVH);
    const int64_t hq = (int64_t)b * NH + h;
    const int q0 = qt * FL_BM;
    const int T = n_past + N;
    const int rows = N - q0 < FL_BM ? N - q0 : FL_BM;
    const int kend = n_past + q0 + rows;
    /* the first tile any row sees (0 without a window): the walk starts there */
    const int kfirst = window_lo(n_past + q0, window) / FL_BN * FL_BN;
    const __nv_bfloat16 *kh = kb + ((int64_t)kvh * Tpad + kfirst) * HS;
    const __nv_bfloat16 *vh = vb + ((int64_t)kvh * Tpad + kfirst) * HS;
    const int nkt = (kend - kfirst + FL_BN - 1) / FL_BN; /* tiles from kfirst on */
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;

    auto copy_keys = [&](int j, int buf) {
        cp_tile_sw128<FL_BN, FL_THREADS>(sK + buf * FL_WG_TILE, kh + (int64_t)j * FL_BN * HS, HS);
        cp_tile_sw128<FL_BN, FL_THREADS>(sV + buf * FL_WG_TILE, vh + (int64_t)j * FL_BN * HS, HS);
    };
    cp_tile_sw128<FL_BM, FL_THREADS>(sQ, qb + (hq * Npad + q0) * HS, HS);
    copy_keys(0, 0);
    cp_async_commit();
    if (nkt > 1) copy_keys(1, 1); /* two key tiles in flight from the start */
    cp_async_commit();

    float o[HS / 8][4], sc[FL_BN / 8][4];
#pragma unroll
    for (int dt = 0; dt < HS / 8; dt++)
        o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = sc[dt][0] = sc[dt][1] = sc[dt][2] =
            sc[dt][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY;
    float l0 = 0.0f, l1 = 0.0f;
    const int qr0 = q0 + warp * 16 + g, qr1 = qr0 + 8;
    const int lim0 = n_past + qr0 < T - 1 ? n_past + qr0 : T - 1;
    const int lim1 = n_past + qr1 < T - 1 ? n_past + qr1 : T - 1;
    const int wfirst = n_past + q0 + warp * 16;
    const float c = scale * KILN_LOG2E;
    const uint64_t dQ = sw128_desc(sQ);

    /* S = Q K^T for the key tile in buf (accumulate 0 overwrites sc) */
    auto issue_s = [&](int buf) {
        const uint64_t dK = sw128_desc(sK + buf * FL_WG_TILE);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HS / 16; kk++)
            wgmma_ss<0, 0>(&sc[0][0], dQ + SW128_KSTEP_K * kk, dK + SW128_KSTEP_K * kk, kk > 0);
        wgmma_commit();
    };
    if (nkt > 0) {
        cp_async_wait<1>(); /* q and key tile 0 (tile 1 may still be in flight) */
        wgmma_proxy_fence();
        __syncthreads();
        issue_s(0);
    }
    for (int j = 0; j < nkt; j++) {
        const int k0 = kfirst + j * FL_BN, buf = j & 1;
        const bool mask = flash_tile_masked(k0, wfirst, T, window);
        const uint64_t dV = sw128_desc(sV + buf * FL_WG_TILE);
        wgmma_wait<0>(); /* S (issued a tile ago, under the previous P V) */
        wgmma_fence_operands(&sc[0][0]);

        uint32_t pp[FL_BN / 8][2];
        flash_softmax_tile<HS>(sc, pp, o, m0, m1, l0, l1, c, mask, k0, t, lim0, lim1, window);

        wgmma_fence(); /* O += P V: k-steps of 16 keys */
#pragma unroll
        for (int jj = 0; jj < FL_BN / 16; jj++) {
            const uint32_t a[4] = {pp[2 * jj][0], pp[2 * jj][1], pp[2 * jj + 1][0],
                                   pp[2 * jj + 1][1]};
            wgmma_rs<1>(&o[0][0], a, dV + SW128_KSTEP_MN * jj, 1);
        }
        wgmma_commit();
        if (j + 1 < nkt) { /* the next tile's S under this P V (no operand fence here: one
                            * between the waits made ptxas serialize, C7515) */
            cp_async_wait<0>(); /* key tile j + 1, copied into buf ^ 1 a tile ago */
            wgmma_proxy_fence();
            __syncthreads();
            issue_s(buf ^ 1);
            wgmma_wait<1>(); /* P V: the next softmax rescales o */
        } else {
            wgmma_wait<0>();
            wgmma_fence_operands(&o[0][0]);
        }
        __syncthreads(); /* every warp is done with this buffer before it is refilled */
        if (j + 2 < nkt) {
            copy_keys(j + 2, buf);
            cp_async_commit();
        }
    }

    flash_finish<HS>(out, lse, o, m0, m1, l0, l1, scale, hq, Npad, b, h, N, NH, qr0, qr1, t);
#else
    (void)out;
    (void)lse;
    (void)qb;
    (void)kb;
    (void)vb;
    (void)N;
    (void)n_past;
    (void)NH;
    (void)KVH;
    (void)Npad;
    (void)Tpad;
    (void)scale;
    (void)window;
    __trap(); /* launched only where kiln_cuda_wgmma_usable: the sm_90a code */
#endif
}

/* The flash kernels' attributes for output type Out (kiln_cuda_attn_create). */
template <typename Out>
static cudaError_t flash_attributes() {
    cudaError_t e = cudaFuncSetAttribute(flash_bf16_kernel<64, Out>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)flash_smem<64>());
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(flash_wgmma_kernel<Out>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)flash_wgmma_smem());
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(flash_bf16_kernel<128, Out>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)flash_smem<128>());
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(flash_bf16_kernel<64, Out>,
                                 cudaFuncAttributePreferredSharedMemoryCarveout,
                                 (int)cudaSharedmemCarveoutMaxShared);
    return e;
}

/* decode_kernel<VEC, HST>'s dynamic shared memory above the default 48 KiB. */
template <bool VEC, int HST>
static cudaError_t dec_attributes() {
    return cudaFuncSetAttribute(decode_kernel<VEC, HST>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)dec_smem(HST ? HST : KILN_ATTN_FAST_MAX_HS));
}

cudaError_t kiln_cuda_attn_create(kiln_cuda_attn **out) {
    if (!out) return cudaErrorInvalidValue;
    *out = NULL;
    /* dynamic shared memory above the default 48 KiB, set once here (outside any capture); the
     * whole unified L1 as shared memory for HS 64, so that the registers' four blocks per SM
     * fit. The same for the f32 and the bf16 output. */
    cudaError_t e = flash_attributes<float>();
    if (e == cudaSuccess) e = flash_attributes<uint16_t>();
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(f32_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)f32_smem(KILN_ATTN_FAST_MAX_HS));
    if (e == cudaSuccess) e = dec_attributes<true, 64>();
    if (e == cudaSuccess) e = dec_attributes<true, 128>();
    if (e == cudaSuccess) e = dec_attributes<true, 0>();
    if (e == cudaSuccess) e = dec_attributes<false, 0>();
    if (e != cudaSuccess) return e;
    kiln_cuda_attn *a = (kiln_cuda_attn *)kiln_calloc(1, sizeof *a);
    if (!a) return cudaErrorMemoryAllocation;
    *out = a;
    return cudaSuccess;
}

size_t kiln_cuda_attn_device_bytes(const kiln_cuda_attn *a) {
    return a ? a->cap + a->cnt_cap + a->pack_cap : 0;
}

void kiln_cuda_attn_free(kiln_cuda_attn *a) {
    if (!a) return;
    if (a->buf) (void)cudaFree(a->buf);
    if (a->cnt) (void)cudaFree(a->cnt);
    if (a->pack) (void)cudaFree(a->pack);
    kiln_free(a);
}

/* Make *p (one of a's buffers) hold at least need bytes (*cap bytes now): freed and
 * reallocated when smaller (cudaFree waits for the work still using it, so never inside a
 * graph capture), which bumps a->gen; the contents are not kept. On failure *p is NULL and
 * *cap 0. */
static cudaError_t grow_dev(kiln_cuda_attn *a, void **p, size_t *cap, size_t need) {
    if (need <= *cap) return cudaSuccess;
    a->gen++;
    if (*p) {
        cudaError_t e = cudaFree(*p);
        *p = NULL;
        *cap = 0;
        if (e != cudaSuccess) return e;
    }
    cudaError_t e = cudaMalloc(p, need);
    if (e != cudaSuccess) {
        *p = NULL;
        return e;
    }
    *cap = need;
    return cudaSuccess;
}

uint64_t kiln_cuda_attn_generation(const kiln_cuda_attn *a) { return a ? a->gen : 0; }

cudaError_t kiln_cuda_attn_reserve(kiln_cuda_attn *a, int B, int N, int NH, int HS, int max_T) {
    if (!a || B <= 0 || N <= 0 || NH <= 0 || HS <= 0 || max_T <= 0) return cudaErrorInvalidValue;
    const size_t need = ws_floats(B, N, NH, HS, max_T);
    if (need == 0) return cudaErrorInvalidValue;
    /* counters: one per (sequence, kv head, chunk of rows) <= B * N * NH */
    const uint64_t ncnt = (uint64_t)B * (uint64_t)N * (uint64_t)NH;
    if (ncnt > (uint64_t)SIZE_MAX / sizeof(unsigned)) return cudaErrorInvalidValue;
    if (need > a->cap / sizeof(float)) {
        cudaError_t e = grow_dev(a, (void **)&a->buf, &a->cap, need * sizeof(float));
        if (e != cudaSuccess) return e;
    }
    if (ncnt > a->cnt_cap / sizeof(unsigned)) {
        cudaError_t e = grow_dev(a, (void **)&a->cnt, &a->cnt_cap, (size_t)ncnt * sizeof(unsigned));
        if (e != cudaSuccess) return e;
        /* zero before any kernel can use them: cudaMemset runs on the legacy stream, which
         * the caller's (possibly non-blocking) stream does not wait for, so wait here */
        e = cudaMemset(a->cnt, 0, (size_t)ncnt * sizeof(unsigned));
        if (e == cudaSuccess) e = cudaDeviceSynchronize();
        if (e != cudaSuccess) {
            (void)cudaFree(a->cnt);
            a->cnt = NULL;
            a->cnt_cap = 0;
            return e;
        }
    }
    return cudaSuccess;
}

/* Shape checks shared by the entry points. */
static bool shape_ok(int NH, int KVH, int HS) {
    return NH > 0 && KVH > 0 && NH % KVH == 0 && HS > 0 && HS <= KILN_ATTN_FAST_MAX_HS;
}

/* Grid x of the row-chunk kernels: KVH * chunks of 16 rows of the (G * N)-row kv groups.
 * 0: too big. */
static unsigned split_grid_x(int N, int NH, int KVH) {
    static_assert(DEC_ROWS == F32_ROWS, "one chunking for both kernels");
    const int64_t R = (int64_t)(NH / KVH) * N;
    const int64_t x = (R + DEC_ROWS - 1) / DEC_ROWS * KVH;
    return R > INT_MAX || x > INT_MAX ? 0u : (unsigned)x;
}

cudaError_t kiln_cuda_attn_decode_launch_info(int B, int N, int NH, int KVH, int HS, int max_T,
                                              kiln_cuda_attn_launch *info) {
    if (!info) return cudaErrorInvalidValue;
    memset(info, 0, sizeof *info);
    if (B <= 0 || N <= 0 || max_T <= 0 || !shape_ok(NH, KVH, HS)) return cudaErrorInvalidValue;
    const int64_t nsplit = ((int64_t)max_T + KILN_ATTN_SPLIT - 1) / KILN_ATTN_SPLIT;
    /* the chunks' grid times the blocks per chunk (at most KVH * R = N * NH blocks, each with
     * rows, so the counters kiln_cuda_attn_reserve makes cover them) */
    const uint64_t gx = (uint64_t)split_grid_x(N, NH, KVH) *
                        (uint64_t)dec_subs((NH / KVH) * N);
    if (gx == 0 || gx > INT_MAX || nsplit > 65535 || B > 65535 || (int64_t)N * NH > INT_MAX)
        return cudaErrorInvalidConfiguration;
    info->grid[0] = (unsigned)gx;
    info->grid[1] = (unsigned)nsplit;
    info->grid[2] = (unsigned)B;
    info->block = DEC_THREADS;
    info->smem = dec_smem(HS);
    info->combine = nsplit > DEC_FUSE_MAX ? 1 : 0;
    return cudaSuccess;
}

/* The split decode of B sequences x N tokens: decode_kernel, then combine_kernel when the
 * grid has more than DEC_FUSE_MAX splits (else decode_kernel combines: one launch). Which
 * way it goes depends on max_T, never the bits (see the combine's definition). window: a
 * sliding window (0: none), decode_kernel's. */
static cudaError_t split_decode_launch(kiln_cuda_attn *a, cudaStream_t s, float *out,
                                       const float *q, const float *k, const float *v, int B,
                                       int N, int n_past_host, const int32_t *d_n_past,
                                       size_t kv_seq_stride, const kiln_cuda_attn_pages *pages,
                                       int max_T, int NH, int KVH, int HS, float scale,
                                       int window) {
    kiln_cuda_attn_launch li;
    cudaError_t le = kiln_cuda_attn_decode_launch_info(B, N, NH, KVH, HS, max_T, &li);
    if (le != cudaSuccess) return le;
    const int64_t nsplit = li.grid[1];
    const unsigned gx = li.grid[0];
    const size_t need = ws_floats(B, N, NH, HS, max_T);
    if (need == 0 || need > a->cap / sizeof(float) || !a->cnt ||
        (uint64_t)B * gx > (uint64_t)(a->cnt_cap / sizeof(unsigned)))
        return cudaErrorInvalidValue;
    const int64_t P = (int64_t)B * nsplit * N * NH;
    float *ws_acc = a->buf, *ws_ml = a->buf + P * HS;
    /* 16-byte copies when every row start of q, k and v is 16-byte aligned, and the head
     * size as a constant for 64 and 128 (the bits depend on neither: they change how the
     * tiles are copied and how the loops are unrolled) */
    const bool vec = HS % 4 == 0 && (((uintptr_t)q | (uintptr_t)k | (uintptr_t)v) & 15) == 0 &&
                     (B == 1 || pages || kv_seq_stride % 4 == 0);
    const kiln_cuda_attn_pages none = {NULL, NULL, NULL, NULL, 0, 0};
    const kiln_cuda_attn_pages pg = pages ? *pages : none;
    const int fuse = li.combine ? 0 : 1;
    const dim3 grid(li.grid[0], li.grid[1], li.grid[2]);
    decltype(&decode_kernel<false, 0>) kern =
        !vec ? decode_kernel<false, 0>
        : HS == 64 ? decode_kernel<true, 64>
        : HS == 128 ? decode_kernel<true, 128>
        : decode_kernel<true, 0>;
    const cudaError_t e = launch_pdl(kern, grid,
                                     DEC_THREADS, li.smem, s, out, ws_acc, ws_ml, a->cnt, q, k, v,
                                     N, n_past_host, d_n_past, kv_seq_stride, pg, NH, KVH, HS,
                                     scale, (int)nsplit, max_T, fuse, window);
    if (e != cudaSuccess || fuse) return e;
    return launch_pdl(combine_kernel, dim3((unsigned)(N * NH), (unsigned)B), COMBINE_THREADS, 0,
                      s, out, ws_acc, ws_ml, N, n_past_host, d_n_past, pg, NH, KVH, HS, (int)nsplit,
                      max_T, window);
}

/* The flash path for B sequences of N queries over n_past + N keys each (kiln_cuda_attn_saves_lse
 * holds; B > 1 only with n_past 0): q, k, v packed to bf16 per head (rotated first when rope
 * is given, NULL otherwise) into keep when given (n_past 0; kiln_cuda_attn_keep_bytes), else
 * into the workspace's pack buffer (grown on demand, synchronising: never inside a graph
 * capture), then one flash launch with grid z = B, writing out (f32) or, when out16 is given,
 * out16 (bf16 bits; out then NULL). lse: NULL or [B][NH][Npad]. window: a sliding window
 * (0: none; only with B = 1 and no lse, which the backward would not match). */
static cudaError_t flash_launch(kiln_cuda_attn *a, cudaStream_t s, float *out, uint16_t *out16,
                                float *lse, void *keep, const kiln_cuda_attn_rope *rope,
                                const float *q, const float *k, const float *v, int B, int N,
                                int n_past, int NH, int KVH, int HS, float scale, int window) {
    if (NH > 65535 || B > 65535) return cudaErrorInvalidConfiguration;
    const int T = n_past + N;
    const int Npad = kiln_cuda_attn_pack_rows(N), Tpad = kiln_cuda_attn_pack_rows(T);
    if (Npad < 0 || Tpad < 0) return cudaErrorInvalidValue;
    const uint64_t qn = (uint64_t)B * (uint64_t)NH * (uint64_t)Npad * (uint64_t)HS;
    const uint64_t kn = (uint64_t)B * (uint64_t)KVH * (uint64_t)Tpad * (uint64_t)HS;
    __nv_bfloat16 *qb, *kb, *vb;
    if (keep) { /* regions as kiln_cuda_attn_keep_bytes counts them (Tpad = Npad) */
        if (kiln_cuda_attn_keep_bytes(B, N, NH, KVH, HS) == 0) return cudaErrorInvalidValue;
        const size_t kr = kiln_cuda_attn_keep_region((size_t)kn * sizeof(__nv_bfloat16));
        qb = (__nv_bfloat16 *)keep;
        kb = (__nv_bfloat16 *)((char *)keep +
                               kiln_cuda_attn_keep_region((size_t)qn * sizeof(__nv_bfloat16)));
        vb = (__nv_bfloat16 *)((char *)kb + kr);
    } else {
        const uint64_t need = (qn + 2 * kn) * sizeof(__nv_bfloat16);
        if (need > (uint64_t)SIZE_MAX / 2) return cudaErrorInvalidValue;
        cudaError_t e = grow_dev(a, &a->pack, &a->pack_cap, (size_t)need);
        if (e != cudaSuccess) return e;
        qb = (__nv_bfloat16 *)a->pack;
        kb = qb + qn;
        vb = kb + kn;
    }
    const kiln_cuda_attn_rope none = {NULL, NULL, NULL}, rp = rope ? *rope : none;
    const kiln_cuda_attn_pack_job jobs[3] = {{qb, q, NULL, NULL, NULL, N, Npad, NH, B, rp},
                                             {kb, k, NULL, NULL, NULL, T, Tpad, KVH, B, rp},
                                             {vb, v, NULL, NULL, NULL, T, Tpad, KVH, B, none}};
    cudaError_t e = kiln_cuda_attn_pack_heads(s, jobs, 3, HS);
    if (e != cudaSuccess) return e;
    const dim3 grid((unsigned)((N + FL_BM - 1) / FL_BM), (unsigned)NH, (unsigned)B);
    if (HS == 64 && kiln_cuda_wgmma_usable(s)) { /* sm_90a */
        if (out16)
            flash_wgmma_kernel<uint16_t><<<grid, FL_THREADS, flash_wgmma_smem(), s>>>(
                out16, lse, qb, kb, vb, N, n_past, NH, KVH, Npad, Tpad, scale, window);
        else
            flash_wgmma_kernel<float><<<grid, FL_THREADS, flash_wgmma_smem(), s>>>(
                out, lse, qb, kb, vb, N, n_past, NH, KVH, Npad, Tpad, scale, window);
    } else if (HS == 64 && out16)
        flash_bf16_kernel<64, uint16_t><<<grid, FL_THREADS, flash_smem<64>(), s>>>(
            out16, lse, qb, kb, vb, N, n_past, NH, KVH, Npad, Tpad, scale, window);
    else if (HS == 64)
        flash_bf16_kernel<64, float><<<grid, FL_THREADS, flash_smem<64>(), s>>>(
            out, lse, qb, kb, vb, N, n_past, NH, KVH, Npad, Tpad, scale, window);
    else if (out16)
        flash_bf16_kernel<128, uint16_t><<<grid, FL_THREADS, flash_smem<128>(), s>>>(
            out16, lse, qb, kb, vb, N, n_past, NH, KVH, Npad, Tpad, scale, window);
    else
        flash_bf16_kernel<128, float><<<grid, FL_THREADS, flash_smem<128>(), s>>>(
            out, lse, qb, kb, vb, N, n_past, NH, KVH, Npad, Tpad, scale, window);
    return cudaGetLastError();
}

cudaError_t kiln_cuda_attention_fast(kiln_cuda_attn *a, cudaStream_t s, float *out,
                                     const float *q, const float *k, const float *v, int N,
                                     int n_past, int NH, int KVH, int HS, float scale) {
    return kiln_cuda_attention_fast_window(a, s, out, q, k, v, N, n_past, NH, KVH, HS, scale, 0);
}

cudaError_t kiln_cuda_attention_fast_window(kiln_cuda_attn *a, cudaStream_t s, float *out,
                                            const float *q, const float *k, const float *v,
                                            int N, int n_past, int NH, int KVH, int HS,
                                            float scale, int window) {
    if (N < 0 || n_past < 0 || NH < 0 || HS < 0 || window < 0) return cudaErrorInvalidValue;
    if (N == 0 || NH == 0 || HS == 0) return cudaSuccess;
    if (!a || !shape_ok(NH, KVH, HS) || (int64_t)n_past + N > INT_MAX)
        return cudaErrorInvalidValue;
    /* the keys below the first query's window are no query's: drop them, so that no kernel
     * reads them (the window is relative to each query, so n_past moves with the keys) */
    const int lo = window_lo(n_past, window);
    if (lo > 0) {
        k += (int64_t)lo * KVH * HS;
        v += (int64_t)lo * KVH * HS;
        n_past -= lo;
    }
    const int T = n_past + N;
    if (N <= KILN_ATTN_DECODE_MAX_N) {
        cudaError_t e = kiln_cuda_attn_reserve(a, 1, N, NH, HS, T);
        if (e != cudaSuccess) return e;
        return split_decode_launch(a, s, out, q, k, v, 1, N, n_past, NULL, 0, NULL, T, NH, KVH,
                                   HS, scale, window);
    }
    if (kiln_cuda_attn_saves_lse(out, q, k, v, N, HS))
        return flash_launch(a, s, out, NULL, NULL, NULL, NULL, q, k, v, 1, N, n_past, NH, KVH,
                            HS, scale, window);
    const unsigned gx = split_grid_x(N, NH, KVH);
    if (gx == 0) return cudaErrorInvalidConfiguration;
    f32_kernel<<<dim3(gx, 1, 1), F32_THREADS, f32_smem(HS), s>>>(out, q, k, v, N, n_past, NH,
                                                                 KVH, HS, scale, window);
    return cudaGetLastError();
}

cudaError_t kiln_cuda_attention_decode_dev(kiln_cuda_attn *a, cudaStream_t s, float *out,
                                           const float *q, const float *k, const float *v,
                                           int B, size_t kv_seq_stride, const int32_t *d_n_past,
                                           int max_T, int NH, int KVH, int HS, float scale) {
    if (B < 0 || NH < 0 || HS < 0) return cudaErrorInvalidValue;
    if (B == 0 || NH == 0 || HS == 0) return cudaSuccess;
    if (!a || !d_n_past || max_T <= 0 || !shape_ok(NH, KVH, HS)) return cudaErrorInvalidValue;
    return split_decode_launch(a, s, out, q, k, v, B, 1, 0, d_n_past, kv_seq_stride, NULL,
                               max_T, NH, KVH, HS, scale, 0);
}

cudaError_t kiln_cuda_attention_decode_paged(kiln_cuda_attn *a, cudaStream_t s, float *out,
                                             const float *q, const float *k_pool,
                                             const float *v_pool, const kiln_cuda_attn_pages *pg,
                                             int B, int max_T, int NH, int KVH, int HS,
                                             float scale, int window) {
    if (B < 0 || NH < 0 || HS < 0 || window < 0) return cudaErrorInvalidValue;
    if (B == 0 || NH == 0 || HS == 0) return cudaSuccess;
    if (!a || !pg || !pg->seq || !pg->pos || !pg->table || pg->block_size <= 0 ||
        pg->block_size % KILN_ATTN_SPLIT != 0 || pg->max_blocks <= 0 || max_T <= 0 ||
        !shape_ok(NH, KVH, HS))
        return cudaErrorInvalidValue;
    return split_decode_launch(a, s, out, q, k_pool, v_pool, B, 1, 0, NULL, 0, pg, max_T, NH, KVH,
                               HS, scale, window);
}

cudaError_t kiln_cuda_attention_fast_seqs(kiln_cuda_attn *a, cudaStream_t s, float *out,
                                          uint16_t *out16, float *lse, void *keep,
                                          const kiln_cuda_attn_rope *rope, const float *q,
                                          const float *k, const float *v, int B, int N, int NH,
                                          int KVH, int HS, float scale) {
    if ((out == NULL) == (out16 == NULL) || B < 0 || N < 0 || NH < 0 || HS < 0 ||
        (rope && (!keep || !rope->pos || !rope->cos_tab || !rope->sin_tab)) ||
        ((uintptr_t)keep & (KILN_ATTN_KEEP_ALIGN - 1)) != 0)
        return cudaErrorInvalidValue;
    if (B == 0 || N == 0 || NH == 0 || HS == 0) return cudaSuccess;
    if (!a || !shape_ok(NH, KVH, HS) || (int64_t)B * N > INT_MAX) return cudaErrorInvalidValue;
    if (kiln_cuda_attn_saves_lse(out16 ? (const void *)out16 : (const void *)out, q, k, v, N, HS))
        return flash_launch(a, s, out, out16, lse, keep, rope, q, k, v, B, N, 0, NH, KVH, HS,
                            scale, 0);
    /* only the flash kernel stores bf16, and only it packs (keep, hence rope) */
    if (out16 || keep) return cudaErrorNotSupported;
    const size_t qs = (size_t)N * NH * HS, ks = (size_t)N * KVH * HS;
    for (int b = 0; b < B; b++) {
        cudaError_t e = kiln_cuda_attention_fast(a, s, out + b * qs, q + b * qs, k + b * ks,
                                                 v + b * ks, N, 0, NH, KVH, HS, scale);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

/* =================================================================================================
 * Fast backward (issue 5, item 1) on bf16 tensor cores (the kernels: cuda_attention.h).
 * ============================================================================================== */

/*
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
