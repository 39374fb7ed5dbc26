/*
 * cuda_matvec.cu -- fast mode's decode products on the raw weights (contracts: cuda_matmul.h):
 *   - the f32 matrix-vector kernel of every dtype (N <= 8): chunks dequantized in registers
 *     with the CPU's values, fixed-order sums, the norm prologue and the epilogues;
 *   - bf16 weights on the tensor cores (mma.sync), N 2..8 in fast mode and every N in the
 *     batch-invariant fast mode.
 * The int8-activation products are in cuda_matvec_i8.cu; the shared job and load helpers in
 * cuda_products.cuh.
 */
#include "cuda_products.cuh"

#include "cuda_mma.cuh" /* pack_bf16 */

#include <cuda_fp16.h>
#include <float.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    static constexpr int ALIGN = pow2_align(TSZ);
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
