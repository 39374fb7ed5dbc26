/*
 * cuda_matvec_fast.cu -- fast-mode decode matrix-vector kernels (cuda_matvec_fast.h):
 * out(N,R) = x(N,C) @ W(R,C)^T on the raw weight bytes, N <= 8.
 *
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
#include "cuda_matvec_fast.h"

#include "cuda_common.cuh"

#include <cuda_fp16.h>

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
 * in flight per thread. Neither changes the summation order. */
static __host__ __device__ constexpr int fmv_rows(bool plain, int NT) { return plain && NT == 1 ? 2 : 4; }
static __host__ __device__ constexpr int fmv_unroll(bool plain, int NT) {
    return NT == 1 ? (plain ? 4 : 2) : NT == 2 ? 2 : 1;
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

/* Grid: x = row blocks of (FMV_WARPS / S) row groups of ROWS rows. NT: token tile (N <= NT;
 * tokens t >= N are skipped). FAST: w, row_bytes multiples of fmv<DT>::ALIGN, x 16-byte
 * aligned and C % 4 == 0 (vector loads); else byte loads and scalar x loads, same order. */
template <int DT, int NT, bool FAST>
static __global__ void __launch_bounds__(FMV_THREADS)
matvec_fast_kernel(float *__restrict__ out, const float *__restrict__ x,
                   const uint8_t *__restrict__ w, size_t row_bytes,
                   const float *__restrict__ bias, int64_t R, int64_t C, int N, int S,
                   int accumulate) {
    using T = fmv<DT>;
    constexpr int ROWS = fmv_rows(T::plain, NT), UNR = fmv_unroll(T::plain, NT);
    constexpr int A = FAST ? T::ALIGN : 1;
    static_assert(ROWS * NT <= 32, "one warp's sums fit a row of red");
    __shared__ float red[FMV_WARPS][32];

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int G = FMV_WARPS / S; /* row groups per block */
    const int grp = warp / S, k = warp - grp * S;
    const int64_t r0 = ((int64_t)blockIdx.x * G + grp) * ROWS;
    const uint8_t *rowp[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; i++) /* rows past R reload row R - 1; their sums are dropped */
        rowp[i] = w + (size_t)(r0 + i < R ? r0 + i : R - 1) * row_bytes;

    float acc[ROWS][NT];
#pragma unroll
    for (int i = 0; i < ROWS; i++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[i][t] = 0.0f;

    const int64_t nblk = C / T::BSZ, nch = nblk * T::CPB;
    const int stride = S * 32;
    for (int64_t c0 = k * 32 + lane; c0 < nch; c0 += (int64_t)UNR * stride) {
        uint32_t raw[UNR][ROWS][T::RAW];
#pragma unroll
        for (int u = 0; u < UNR; u++) {
            const int64_t c = c0 + (int64_t)u * stride;
            if (c < nch) {
#pragma unroll
                for (int i = 0; i < ROWS; i++)
                    fmv_load<DT, A>(raw[u][i], rowp[i] + (size_t)(c / T::CPB) * T::TSZ,
                                    (int)(c % T::CPB));
            }
        }
#pragma unroll
        for (int u = 0; u < UNR; u++) {
            const int64_t c = c0 + (int64_t)u * stride;
            if (c >= nch) break; /* chunks only grow with u */
            const int ci = (int)(c % T::CPB);
            const int64_t col0 = (c / T::CPB) * T::BSZ;
            float wv[ROWS][T::EPC];
#pragma unroll
            for (int i = 0; i < ROWS; i++) fmv_deq<DT>(raw[u][i], ci, wv[i]);
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
#pragma unroll
                            for (int i = 0; i < ROWS; i++)
#pragma unroll
                                for (int e = 0; e < 4; e++)
                                    acc[i][t] = __fmaf_rn(xv[e], wv[i][j * T::RL + 4 * q + e],
                                                          acc[i][t]);
                        }
                    }
                }
            }
        }
    }
    if constexpr (T::plain) { /* the C % EPC elements after the last whole chunk */
        const int64_t e = nch * T::EPC + k * 32 + lane;
        if (e < C) {
#pragma unroll
            for (int i = 0; i < ROWS; i++) {
                const float wl = fmv_plain_elem<DT, FAST>(rowp[i], e);
#pragma unroll
                for (int t = 0; t < NT; t++)
                    if (t < N) acc[i][t] = __fmaf_rn(__ldg(x + (int64_t)t * C + e), wl, acc[i][t]);
            }
        }
    }

    /* fixed tree per warp: xor partners give every lane the same bits */
#pragma unroll
    for (int i = 0; i < ROWS; i++)
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float v = acc[i][t];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v = v + __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) red[warp][i * NT + t] = v;
        }
    __syncthreads();
    /* one thread per (group, row, token): the S warp sums in warp order */
    const int o = threadIdx.x;
    if (o < G * ROWS * NT) {
        const int g = o / (ROWS * NT), j = o - g * (ROWS * NT), i = j / NT, t = j - i * NT;
        const int64_t r = ((int64_t)blockIdx.x * G + g) * ROWS + i;
        if (r < R && t < N) {
            float s = red[g * S][j];
            for (int kk = 1; kk < S; kk++) s = s + red[g * S + kk][j];
            if (bias) s = s + bias[r];
            float *po = out + (int64_t)t * R + r;
            *po = accumulate ? *po + s : s;
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

template <int NT, int DT, bool FAST>
static cudaError_t fmv_launch_nt(cudaStream_t s, float *out, const float *x, const uint8_t *w,
                                 size_t row_bytes, const float *bias, int64_t R, int64_t C,
                                 int N, int S, int accumulate) {
    constexpr int rows = fmv_rows(fmv<DT>::plain, NT);
    const int64_t per_block = (int64_t)(FMV_WARPS / S) * rows;
    const int64_t gx = (R + per_block - 1) / per_block;
    if (gx > 0x7fffffff) return cudaErrorInvalidValue;
    matvec_fast_kernel<DT, NT, FAST><<<(unsigned)gx, FMV_THREADS, 0, s>>>(
        out, x, w, row_bytes, bias, R, C, N, S, accumulate);
    return cudaGetLastError();
}

template <int DT>
static void fmv_launch(cudaError_t *err, cudaStream_t s, float *out, const float *x,
                       const uint8_t *w, size_t row_bytes, const float *bias, int64_t R,
                       int64_t C, int N, int accumulate) {
    using T = fmv<DT>;
    if (C % blk<DT>::BS != 0 || row_bytes < (size_t)(C / blk<DT>::BS) * blk<DT>::TS) {
        *err = cudaErrorInvalidValue;
        return;
    }
    const int S = fmv_split<DT>(R, C, N);
    const bool fast = (uintptr_t)w % T::ALIGN == 0 && row_bytes % T::ALIGN == 0 &&
                      (uintptr_t)x % 16 == 0 && C % 4 == 0;
    if (!fast) /* rare (misaligned data): two tiles only, same order */
        *err = N == 1 ? fmv_launch_nt<1, DT, false>(s, out, x, w, row_bytes, bias, R, C, N, S,
                                                    accumulate)
                      : fmv_launch_nt<8, DT, false>(s, out, x, w, row_bytes, bias, R, C, N, S,
                                                    accumulate);
    else if (N == 1)
        *err = fmv_launch_nt<1, DT, true>(s, out, x, w, row_bytes, bias, R, C, N, S, accumulate);
    else if (N == 2)
        *err = fmv_launch_nt<2, DT, true>(s, out, x, w, row_bytes, bias, R, C, N, S, accumulate);
    else if (N <= 4)
        *err = fmv_launch_nt<4, DT, true>(s, out, x, w, row_bytes, bias, R, C, N, S, accumulate);
    else
        *err = fmv_launch_nt<8, DT, true>(s, out, x, w, row_bytes, bias, R, C, N, S, accumulate);
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

cudaError_t kiln_cuda_matvec_fast(cudaStream_t s, float *out, const float *x, const uint8_t *w,
                                  size_t row_bytes, kiln_dtype dt, int64_t R, int64_t C,
                                  const float *bias, int N, int accumulate) {
    if (!out || !x || !w || R < 1 || C < 1 || N < 1 || N > 8 || !kiln_cuda_dtype_supported(dt))
        return cudaErrorInvalidValue;
    if ((uintptr_t)out % 4 || (uintptr_t)x % 4 || (uintptr_t)bias % 4)
        return cudaErrorInvalidValue;
    if ((uint64_t)R > ((uint64_t)1 << 40) || (uint64_t)C > ((uint64_t)1 << 40))
        return cudaErrorInvalidValue; /* keeps every index product far from overflow */
    cudaError_t err = cudaSuccess;
    KILN_CUDA_DTYPE_SWITCH(dt, fmv_launch, &err, s, out, x, w, row_bytes, bias, R, C, N,
                           accumulate);
    return err;
}
