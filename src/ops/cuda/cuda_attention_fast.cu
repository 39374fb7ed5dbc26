/*
 * cuda_attention_fast.cu -- fast-mode attention (issue 4, item 3): flash attention on bf16
 * tensor cores for prefill, split-along-the-keys f32 attention for decode, and the plain f32
 * kernel for head sizes the tensor-core kernel does not take. Contract and the switch between
 * the kernels: cuda_attention_fast.h.
 *
 * This file is compiled with the CUDA backend's flags (--fmad=false, IEEE division, no
 * flush-to-zero), so every FMA below is written (fmaf / mma.sync). exp: kiln_expf in the f32
 * kernels (about 1 ulp; they are bandwidth-bound, so its few extra FMAs cost nothing), __expf
 * (ex2.approx) in the tensor-core kernel, whose bf16 rounding dominates its error anyway.
 */
#include "cuda_attention_fast.h"

#include "cuda_common.cuh"
#include "cuda_internal.h"
#include "cuda_wgmma.cuh"
#include "cuda_wgmma.h"

#include "../../base/kmath.h"

#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

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
    return window > 0 && p + 1 > window ? p + 1 - window : 0;
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
#define DEC_ROWS 16     /* query rows (token, head of the kv group) per block */
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

/* HS rounded up to a multiple of 4 (rows of sQ, sK are whole float4s). */
static __host__ __device__ __forceinline__ int dec_hs4(int HS) { return (HS + 3) & ~3; }

/* Shared memory of decode_kernel for head size HS, floats: sQ (ROWS, HS4), sK (SPLIT, HS4 +
 * 4: 16-byte rows whose stride is 4 words mod 32 when HS % 32 == 0, so the 8 lanes of a
 * quarter warp reading float4s of 8 different keys hit 8 different bank quads), sV (SPLIT,
 * HS), sP (ROWS, SPLIT), sW and sLs (ROWS, FUSE_MAX), sM, sL, sLt (ROWS), sNs (ROWS ints). */
static size_t dec_smem(int HS) {
    const size_t hs4 = (size_t)dec_hs4(HS);
    return sizeof(float) * (DEC_ROWS * hs4 + KILN_ATTN_SPLIT * (hs4 + 4) +
                            (size_t)KILN_ATTN_SPLIT * HS + DEC_ROWS * KILN_ATTN_SPLIT +
                            2 * DEC_ROWS * DEC_FUSE_MAX + 4 * DEC_ROWS);
}

/* Query head and token of row rr (= n * G + g) of kv head kvh's group. */
static __device__ __forceinline__ void dec_row(int rr, int G, int kvh, int *n, int *h) {
    *n = rr / G;
    *h = kvh * G + rr % G;
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
 * + g, query head h = kvh * G + g. Block (blockIdx.x = chunk * KVH + kvh, blockIdx.y = split
 * s, blockIdx.z = sequence b) takes rows r0 .. r0 + nr - 1 of the chunk (16 at most) and keys
 * kb = s * SPLIT .. kb + nk - 1, the split's keys that some row of the chunk sees (none: the
 * block returns at once). Per block:
 *   1. q rows, K and V of the split go to shared memory by cp.async (q and K first, their
 *      own group, so the scores start while V is still arriving; K, V by 16-byte copies when
 *      VEC, else 4-byte ones; q by 4-byte ones), keys past nk as zeros.
 *   2. Scores: thread (key j = tid % 64, row group tid / 64) takes rows of its group; per row
 *      four fmaf chains over d = 4c + i (c increasing; chain i takes component i), dot =
 *      (c0 + c1) + (c2 + c3), score = dot * scale, -inf when key > n_past + n.
 *   3. Per row (a warp each), over the split's 64 keys: m = max, p = kiln_expf(s - m) (0 for
 *      -inf scores), l = butterfly sum of (p_lane + p_lane+32).
 *   4. acc(r, d) = fmaf(p_j, v_j(d), acc) for j = 0 .. nk - 1 in order.
 *   5. Output. fuse == 0: the partial (m, l, acc) of every row goes to the workspace and
 *      combine_kernel follows. fuse == 1: if every row of the chunk sees only split 0, this
 *      (only) block writes out directly; otherwise the partials go to the workspace, and the
 *      block that arrives last at the group's counter (atomicAdd, for signalling only)
 *      resets the counter and does the combine of every row of the chunk in split order.
 * window > 0 (a sliding window): row n sees keys lo_n = window_lo(n_past + n) .. n_past + n
 * only. Its splits are those holding some of them, s_lo = lo_n / SPLIT .. its last; a split
 * below the chunk's first row's s_lo returns at once (reading neither keys nor the table),
 * keys below the chunk's first row's lo are staged as zeros, and a key outside a row's range
 * scores -inf; the combine runs over the row's splits only. window 0: lo_n = 0.
 * A row's operations depend on its q, its keys and SPLIT only (not on the grid, the block
 * order or which block combines), so the result is deterministic and decode_dev (any B,
 * max_T) has the bits of attention_fast with N = 1. A sequence whose keys pass max_T (or a
 * negative n_past) reads nothing; its rows get NaN (from split 0 when fuse, else from the
 * combine). q, out: (B, N, NH, HS); k, v: sequence b at b * kv_seq_stride, (T, KVH, HS);
 * paged (pg.table; N = 1): b is a decode token of a batch and its split's rows are found
 * through the block table (kiln_cuda_attn_pages), nothing else changes;
 * ws_cnt: B * gridDim.x counters, all 0 on entry and on exit. */
template <bool VEC>
static __global__ void __launch_bounds__(DEC_THREADS, 2)
decode_kernel(float *__restrict__ out, float *ws_acc, float *ws_ml, unsigned *ws_cnt,
              const float *__restrict__ q, const float *__restrict__ k,
              const float *__restrict__ v, int N, int n_past_host,
              const int32_t *__restrict__ d_n_past, size_t kv_seq_stride,
              kiln_cuda_attn_pages pg, int NH, int KVH, int HS, float scale, int nsplit_max,
              int max_T, int fuse, int window) {
    constexpr int S = KILN_ATTN_SPLIT;
    extern __shared__ __align__(16) float dec_sm[];
    __shared__ int s_last;
    const int G = NH / KVH;
    const int R = G * N;
    const int kvh = (int)(blockIdx.x % (unsigned)KVH);
    const int chunk = (int)(blockIdx.x / (unsigned)KVH);
    const int split = (int)blockIdx.y, b = (int)blockIdx.z;
    /* paged: b is a decode token (N = 1), batch token pg.tok[b] (b without tok) */
    const int tok = pg.table ? (pg.tok ? pg.tok[b] : b) : 0;
    const int n_past = pg.table ? pg.pos[tok] : d_n_past ? d_n_past[b] : n_past_host;
    const int r0 = chunk * DEC_ROWS;
    const int nr = R - r0 < DEC_ROWS ? R - r0 : DEC_ROWS;
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
    const int n_last = (r0 + nr - 1) / G;
    const int all_end = n_past + n_last + 1; /* keys any row of the chunk sees (<= max_T) */
    const int all_lo = window_lo(n_past + r0 / G, window); /* the chunk's first row's first */
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
    int *sNs = reinterpret_cast<int *>(sLt + DEC_ROWS); /* (ROWS): splits of the row */

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
    /* q rows by 4-byte cp.async, in K's group (they were plain loads in a loop of 4-16
     * trips, each trip waiting for its load before the next could issue: a serial chain of
     * global round trips in every thread; now all copies are in flight at once); rows past
     * nr and columns HS .. hs4 - 1 are zeros */
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
    if (VEC) { /* HS % 4 == 0 (so hs4 == HS) and every row start 16-byte aligned */
        const int c4 = HS / 4;
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
    __syncthreads();          /* everyone's q and K copies, and the zeros */

    /* 2. scores */
    {
        const int j = tid % S, rg = tid / S; /* rg is warp-uniform (S = 2 warps) */
        float a[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = a[i][2] = a[i][3] = 0.0f;
        const float *kr = sK + j * kst;
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
                const int n = (r0 + r) / G;
                const float dot = (a[i][0] + a[i][1]) + (a[i][2] + a[i][3]);
                const bool ok = j < nk && kb + j <= n_past + n &&
                                kb + j >= window_lo(n_past + n, window);
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

    /* 4. acc = sum_j p_j v_j over the split's keys in order; element e = tid + i * THREADS
     * of the chunk's (nr, HS) rows */
    const int ne = nr * HS;
    float acc[DEC_ACC];
    int pofs[DEC_ACC], vofs[DEC_ACC]; /* sP offset r * S, d */
#pragma unroll
    for (int i = 0; i < DEC_ACC; i++) {
        const int e = tid + i * DEC_THREADS;
        const int r = e < ne ? e / HS : 0;
        acc[i] = 0.0f;
        pofs[i] = r * S;
        vofs[i] = e < ne ? e - r * HS : 0;
    }
    /* DEC_ACC (16) is sized for 16 rows of HS 256; a decode chunk of 7 rows of HS 64 has
     * na = 2, so stop at na rather than issue 16 predicated (load, load, fmaf) per key */
    const int na = (ne + DEC_THREADS - 1) / DEC_THREADS; /* block-uniform */
    for (int j = 0; j < nk; j++) {
        const float *pj = sP + j, *vj = sV + j * HS;
#pragma unroll
        for (int i = 0; i < DEC_ACC; i++) {
            if (i >= na) break;
            if (tid + i * DEC_THREADS < ne) acc[i] = fmaf(pj[pofs[i]], vj[vofs[i]], acc[i]);
        }
    }

    /* 5. output */
    if (fuse && nsg - s_first == 1) { /* the chunk's rows see only this split: ns = 1 */
#pragma unroll
        for (int i = 0; i < DEC_ACC; i++) {
            if (tid + i * DEC_THREADS < ne) {
                const int r = pofs[i] / S, d = vofs[i];
                int n, h;
                dec_row(r0 + r, G, kvh, &n, &h);
                const float w = kiln_expf(sM[r] - sM[r]);
                const float L = fmaf(w, sL[r], 0.0f);
                out[((out_b + n) * NH + h) * HS + d] = fmaf(w, acc[i], 0.0f) / L;
            }
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < DEC_ACC; i++) {
        if (tid + i * DEC_THREADS < ne) {
            const int r = pofs[i] / S, d = vofs[i];
            int n, h;
            dec_row(r0 + r, G, kvh, &n, &h);
            ws_acc[partial_index(b, split, n, h, N, NH, nsplit_max) * HS + d] = acc[i];
        }
    }
    for (int r = tid; r < nr; r += DEC_THREADS) {
        int n, h;
        dec_row(r0 + r, G, kvh, &n, &h);
        const int64_t pi = partial_index(b, split, n, h, N, NH, nsplit_max);
        ws_ml[2 * pi] = sM[r];
        ws_ml[2 * pi + 1] = sL[r];
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
    const int64_t mstep = 2 * (int64_t)N * NH;     /* ws_ml floats from split s to s + 1 */
    const int64_t astep = (int64_t)N * NH * HS;    /* ws_acc floats from split s to s + 1 */
    for (int r = warp; r < nr; r += DEC_WARPS) { /* warp-uniform */
        int n, h;
        dec_row(r0 + r, G, kvh, &n, &h);
        /* the row's splits s_lo .. s_lo + ns - 1 (ns <= nsg <= nsplit_max <= FUSE_MAX), taken
         * from 0 below */
        const int s_lo = window_lo(n_past + n, window) / S;
        const int ns = (n_past + n) / S + 1 - s_lo;
        const float *ml = ws_ml + 2 * partial_index(b, s_lo, n, h, N, NH, nsplit_max);
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
        int n, h;
        dec_row(r0 + r, G, kvh, &n, &h);
        const int ns = sNs[r];
        const int s_lo = window_lo(n_past + n, window) / S;
        const float *ap = ws_acc + partial_index(b, s_lo, n, h, N, NH, nsplit_max) * HS + d;
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
        out[((out_b + n) * NH + h) * HS + d] = a / sLt[r];
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
 * hold none of its keys), as in decode_kernel's combine. */
#define COMBINE_THREADS 128
#define COMBINE_CHUNK 256 /* split weights staged in shared memory at a time */

static __global__ void __launch_bounds__(COMBINE_THREADS, 4)
combine_kernel(float *__restrict__ out, const float *__restrict__ ws_acc,
               const float *__restrict__ ws_ml, int N, int n_past_host,
               const int32_t *__restrict__ d_n_past, kiln_cuda_attn_pages pg, int NH,
               int HS, int nsplit_max, int max_T, int window) {
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
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(decode_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)dec_smem(KILN_ATTN_FAST_MAX_HS));
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(decode_kernel<false>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)dec_smem(KILN_ATTN_FAST_MAX_HS));
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
    const unsigned gx = split_grid_x(N, NH, KVH);
    if (gx == 0 || nsplit > 65535 || B > 65535 || (int64_t)N * NH > INT_MAX)
        return cudaErrorInvalidConfiguration;
    info->grid[0] = gx;
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
    /* 16-byte copies when every row start of k and v is 16-byte aligned (the bits do not
     * depend on it: it only changes how the tiles are copied) */
    const bool vec = HS % 4 == 0 && (((uintptr_t)k | (uintptr_t)v) & 15) == 0 &&
                     (B == 1 || pages || kv_seq_stride % 4 == 0);
    const kiln_cuda_attn_pages none = {NULL, NULL, NULL, NULL, 0, 0};
    const kiln_cuda_attn_pages pg = pages ? *pages : none;
    const int fuse = li.combine ? 0 : 1;
    const dim3 grid(li.grid[0], li.grid[1], li.grid[2]);
    if (vec)
        decode_kernel<true><<<grid, DEC_THREADS, li.smem, s>>>(
            out, ws_acc, ws_ml, a->cnt, q, k, v, N, n_past_host, d_n_past, kv_seq_stride, pg,
            NH, KVH, HS, scale, (int)nsplit, max_T, fuse, window);
    else
        decode_kernel<false><<<grid, DEC_THREADS, li.smem, s>>>(
            out, ws_acc, ws_ml, a->cnt, q, k, v, N, n_past_host, d_n_past, kv_seq_stride, pg,
            NH, KVH, HS, scale, (int)nsplit, max_T, fuse, window);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess || fuse) return e;
    combine_kernel<<<dim3((unsigned)(N * NH), (unsigned)B), COMBINE_THREADS, 0, s>>>(
        out, ws_acc, ws_ml, N, n_past_host, d_n_past, pg, NH, HS, (int)nsplit, max_T, window);
    return cudaGetLastError();
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
