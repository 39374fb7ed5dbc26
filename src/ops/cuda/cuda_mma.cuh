/*
 * cuda_mma.cuh -- the bf16 tensor-core building blocks shared by the fast-mode flash
 * attention kernels (cuda_attention.cu, forward and backward) and other fast-mode kernels
 * (cuda_fused_ce.cu, cuda_norm.cu): the m16n8k16 mma.sync with its fragment layout, and bf16
 * packing/staging helpers.
 * Included from .cu files only.
 */
#ifndef KILN_CUDA_MMA_CUH
#define KILN_CUDA_MMA_CUH

#include "cuda_common.cuh"

#include <cuda_bf16.h>
#include <stdint.h>
#include <string.h>

/* ---- mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: D(16x8) = A(16x16) B(16x8) + C.
 * Fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"),
 * with g = lane >> 2 (groupID) and t = lane & 3 (threadID_in_group); a .b32 register holds
 * two bf16, the lower-indexed element in the low 16 bits:
 *   A (row-major 16x16), 4 regs: a[0] = A[g][2t..2t+1]     a[1] = A[g+8][2t..2t+1]
 *                                a[2] = A[g][2t+8..2t+9]   a[3] = A[g+8][2t+8..2t+9]
 *   B (16x8, k x n, "col"), 2 regs: b[0] = B[2t..2t+1][g]  b[1] = B[2t+8..2t+9][g]
 *   C, D (16x8 f32), 4 regs:  c[0] = C[g][2t]    c[1] = C[g][2t+1]
 *                             c[2] = C[g+8][2t]  c[3] = C[g+8][2t+1]
 * Every fragment load and every use of an accumulator below goes by this table:
 *   S = Q K^T:  A = Q rows (sQ row-major: pairs along d are contiguous), B[k=d][n=key] =
 *               K[key][d] (sK row-major: pairs along d contiguous), C = S (rows, keys).
 *   O += P V:   A = P: its 16 x 16 block j (keys 16j..16j+15) is exactly the C fragments of
 *               S tiles 2j (keys 16j..+7) and 2j+1 (keys 16j+8..+15): a[0] = S tile 2j
 *               c[0..1], a[1] = tile 2j c[2..3], a[2] = tile 2j+1 c[0..1], a[3] = tile 2j+1
 *               c[2..3], rounded to bf16 pairs; B[k=key][n=d] = V[key][d], so V is stored
 *               transposed (sVt[d][key]: pairs along keys contiguous). */
static __device__ __forceinline__ void mma_bf16_16816(float c[4], const uint32_t a[4],
                                                      const uint32_t b[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* Two floats rounded to bf16 (nearest even), lo in the low 16 bits. */
static __device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

/* The two bf16 of a pair, widened (exact). */
static __device__ __forceinline__ float bf16_lo(uint32_t u) { return __uint_as_float(u << 16); }
static __device__ __forceinline__ float bf16_hi(uint32_t u) {
    return __uint_as_float(u & 0xffff0000u);
}

/* A 4-byte aligned pair of bf16 in shared memory. */
static __device__ __forceinline__ uint32_t ld_pair(const __nv_bfloat16 *p) {
    return *reinterpret_cast<const uint32_t *>(p);
}

/* Four floats -> four bf16 at p (8-byte aligned). */
static __device__ __forceinline__ void st_bf16x4(__nv_bfloat16 *p, float4 x) {
    uint2 u;
    u.x = pack_bf16(x.x, x.y);
    u.y = pack_bf16(x.z, x.w);
    *reinterpret_cast<uint2 *>(p) = u;
}

/* ---- shared-memory fragment loads (ldmatrix) and asynchronous tile copies (cp.async) ------
 * A tile in shared memory is bf16 rows of LD elements (LD * 2 bytes a multiple of 16, and
 * LD * 2 mod 128 = 16: the 8 rows an ldmatrix reads fall in 8 different 16-byte bank
 * groups). ldmatrix.x4 gives a thread one .b32 of each of four 8x8 matrices; lane l gives
 * the row address of matrix l / 8 (its row l % 8). Mapped onto the mma fragments of the
 * table above (X a row-major tile in shared memory):
 *   ldsm_a(X, r0, c0):   the A fragment of X[r0..r0+15][c0..c0+15].
 *   ldsm_b(X, n0, k0):   B[k][n] = X[n][k] (X's rows are n: K for S = Q K^T): b[0..1] the
 *                        fragment of n-tile n0..n0+7, b[2..3] of n0+8..n0+15, k0..k0+15.
 *   ldsm_bt(X, k0, n0):  B[k][n] = X[k][n] (X's rows are k: V for O = P V), .trans: b[0..1]
 *                        for n-tile n0..n0+7, b[2..3] for n0+8..n0+15, k0..k0+15. */
static __device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void ldsm_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

static __device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

static __device__ __forceinline__ void ldsm_a(uint32_t a[4], const __nv_bfloat16 *X, int LD,
                                              int r0, int c0, int lane) {
    ldsm_x4(a, smem_u32(X + (r0 + (lane & 15)) * LD + c0 + (lane >> 4) * 8));
}

static __device__ __forceinline__ void ldsm_b(uint32_t b[4], const __nv_bfloat16 *X, int LD,
                                              int n0, int k0, int lane) {
    ldsm_x4(b, smem_u32(X + (n0 + (lane & 7) + ((lane >> 4) & 1) * 8) * LD + k0 +
                        ((lane >> 3) & 1) * 8));
}

/* ldsm_at(Y, k0, m0): the A fragment of A[m][k] = Y[k][m] (Y stored k-major: A transposed),
 * m0..m0+15 x k0..k0+15, with .trans: matrix j of the x4 is Y rows k0 + 8 (j >> 1), columns
 * m0 + 8 (j & 1), which .trans turns into a[j]. */
static __device__ __forceinline__ void ldsm_at(uint32_t a[4], const __nv_bfloat16 *Y, int LD,
                                               int k0, int m0, int lane) {
    ldsm_x4_trans(a, smem_u32(Y + (k0 + (lane & 7) + ((lane >> 4) & 1) * 8) * LD + m0 +
                              ((lane >> 3) & 1) * 8));
}

static __device__ __forceinline__ void ldsm_bt(uint32_t b[4], const __nv_bfloat16 *X, int LD,
                                               int k0, int n0, int lane) {
    ldsm_x4_trans(b, smem_u32(X + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + n0 +
                              ((lane >> 4) & 1) * 8));
}

/* 16 bytes global -> shared, asynchronous (cp.async.cg: through L2 only); both 16-byte
 * aligned. Completion: cp_async_commit() closes a group, cp_async_wait<n>() waits until at
 * most n groups of this thread are pending; then __syncthreads() before other threads read. */
static __device__ __forceinline__ void cp_async16(void *dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src));
}
/* 8 bytes, through L1 (cp.async.ca: .cg takes 16 only); both 8-byte aligned. */
static __device__ __forceinline__ void cp_async8(void *dst, const void *src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_u32(dst)), "l"(src));
}
/* 4 bytes, through L1; both 4-byte aligned (any float of an array). */
static __device__ __forceinline__ void cp_async4(void *dst, const void *src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(dst)), "l"(src));
}
static __device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
static __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* Copy rows r < R of HS bf16 (global row stride HS: a packed head) into shared rows of LD,
 * asynchronously, by NT threads. */
template <int HS, int R, int NT>
static __device__ __forceinline__ void cp_tile(__nv_bfloat16 *dst, int LD,
                                               const __nv_bfloat16 *src) {
    constexpr int CH = HS / 8; /* 16-byte chunks per row */
    static_assert((R * CH) % NT == 0, "whole chunks per thread");
#pragma unroll
    for (int i = 0; i < R * CH / NT; i++) {
        const int idx = (int)threadIdx.x + i * NT, r = idx / CH, c = (idx - r * CH) * 8;
        cp_async16(dst + r * LD + c, src + (int64_t)r * HS + c);
    }
}

/* acc(16 x HS) += A x B, A one 16 x 16 fragment a, B rows k0..k0+15 of the shared tile sB
 * (row-major, rows k, HS along a row): O += P V, dq += dS k and their kin. */
template <int HS>
static __device__ __forceinline__ void frag_times_rows(float acc[HS / 8][4], const uint32_t a[4],
                                                       const __nv_bfloat16 *sB, int LD, int k0,
                                                       int lane) {
#pragma unroll
    for (int dp = 0; dp < HS / 16; dp++) {
        uint32_t b[4];
        ldsm_bt(b, sB, LD, k0, dp * 16, lane);
        mma_bf16_16816(acc[2 * dp], a, b);
        mma_bf16_16816(acc[2 * dp + 1], a, b + 2);
    }
}

/* c[nt] = A(16 x HS, fragments f) x B^T over the NT rows of the shared tile sB (row-major,
 * rows n, HS along a row): S = q k^T and its kin (the flash forward and the backward). */
template <int HS, int NT>
static __device__ __forceinline__ void rows_times_tile(float c[NT / 8][4],
                                                       const uint32_t f[HS / 16][4],
                                                       const __nv_bfloat16 *sB, int LD, int lane) {
#pragma unroll
    for (int nt = 0; nt < NT / 8; nt++) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HS / 16; kk++) {
#pragma unroll
        for (int np = 0; np < NT / 16; np++) {
            uint32_t b[4];
            ldsm_b(b, sB, LD, np * 16, kk * 16, lane);
            mma_bf16_16816(c[2 * np], f[kk], b);
            mma_bf16_16816(c[2 * np + 1], f[kk], b + 2);
        }
    }
}

#endif /* KILN_CUDA_MMA_CUH */
