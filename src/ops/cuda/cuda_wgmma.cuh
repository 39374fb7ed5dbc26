/*
 * cuda_wgmma.cuh -- Hopper's warpgroup matrix products (wgmma.mma_async, sm_90a only) for
 * the fast-mode attention kernels: the shared-memory tile layout they read, its descriptor,
 * the m64n64k16 bf16 -> f32 product in its two operand forms, and the fences. Included from
 * .cu files only. Host code and the sm_90 / compute_90 passes see the declarations; the
 * instructions exist only where KILN_WGMMA_DEVICE is 1 (the sm_90a pass): a kernel built on
 * them guards its body with it, and the host takes that kernel only when
 * kiln_cuda_wgmma_usable (cuda_matmul.h) says the running binary is sm_90a and the device's
 * products passed the self-check.
 *
 * The tile layout ("SW128", the canonical 128-byte swizzle of the PTX ISA's "Shared Memory
 * Matrix Layout"): a tile of R rows x 64 bf16 is R rows of 128 bytes, row r at byte 128 r;
 * its 16-byte chunk c (elements 8c..8c+7) sits at chunk position c ^ (r & 7). The tile starts
 * on a 1024-byte boundary (the swizzle is a function of the address bits 4..9). Read as:
 *   - K-major ("no transpose"): the 64 elements of a row run along the product's k; the rows
 *     are M (operand A) or N (operand B). A k-step of 16 is 32 bytes further into the rows:
 *     the descriptor's address + 2 (16-byte units).
 *   - MN-major ("transpose"): the rows run along k, the 64 elements of a row along M or N. A
 *     k-step of 16 is 16 rows: the descriptor's address + 128.
 * Either way consecutive groups of 8 rows are 1024 bytes apart (the stride byte offset) and a
 * 64-wide operand is one swizzle atom wide, so the leading byte offset is never used (it is
 * set to the same 1024 bytes, which is the one value both readings of the field agree on).
 *
 * Fragments (PTX ISA, "Register Fragments" of wgmma .m64nNk16): warp w of the warpgroup owns
 * rows 16w..16w+15; with g = lane >> 2, t = lane & 3 the f32 accumulator d[32] of an m64n64
 * product holds, for n-tile j = 0..7:
 *   d[4j] = D[16w+g][8j+2t], d[4j+1] = D[16w+g][8j+2t+1], d[4j+2] = D[16w+g+8][8j+2t],
 *   d[4j+3] = D[16w+g+8][8j+2t+1]
 * -- the m16n8 C fragments of cuda_mma.cuh, n-tile by n-tile, so float c[8][4] arrays are
 * accumulators of both. An A operand from registers is, per warp, the m16n8k16 A fragment of
 * cuda_mma.cuh (a[0..3]) of its 16 rows.
 *
 * Ordering (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):
 *   - shared memory written by the threads (st.shared, cp.async) is made visible to the
 *     products by wgmma_proxy_fence() in the writing threads, then a barrier;
 *   - wgmma_fence() before the first product of a batch whose accumulators or A registers
 *     other instructions wrote;
 *   - wgmma_commit(), then wgmma_wait<0>() before anything reads the accumulators, and
 *     wgmma_fence_operands() on them after the wait so the compiler does not move their uses
 *     above it.
 */
#ifndef KILN_CUDA_WGMMA_CUH
#define KILN_CUDA_WGMMA_CUH

#include "cuda_mma.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KILN_WGMMA_DEVICE 1
#else
#define KILN_WGMMA_DEVICE 0
#endif

#define KILN_SW128_ALIGN 1024 /* bytes: a SW128 tile's start */

/* The first 1024-byte boundary of the dynamic shared memory sm (kernels ask for
 * KILN_SW128_ALIGN bytes more), as an offset from sm rather than through an integer, so that
 * the compiler still knows the pointer is shared memory: through an integer, reads by C++
 * pointers derived from it were generic 64-bit loads (LD.E) with their address arithmetic
 * (ncu, session 19: the attention backward's reads of L and D). */
static __device__ __forceinline__ __nv_bfloat16 *sw128_tiles(unsigned char *sm) {
    const uintptr_t g = (uintptr_t)sm;
    const uintptr_t off = ((g + KILN_SW128_ALIGN - 1) & ~(uintptr_t)(KILN_SW128_ALIGN - 1)) - g;
    return reinterpret_cast<__nv_bfloat16 *>(sm + off);
}

/* The byte offset of element (r, col) of a SW128 tile (col < 64). */
static __device__ __forceinline__ uint32_t sw128_offset(int r, int col) {
    return (uint32_t)(r * 128 + ((((col >> 3) ^ (r & 7)) << 4) | ((col & 7) << 1)));
}

/* Copy rows r < R of 64 bf16 (global row stride ld elements, rows 16-byte aligned) into the
 * SW128 tile dst, asynchronously (cp.async), by NT threads (threadIdx.x < NT). Thread x copies
 * chunk x & 7 of rows x / 8 + i NT / 8; as NT / 8 is a multiple of 8 its swizzle is the same
 * in every row it copies, so its addresses are one base each plus constant steps (no 64-bit
 * arithmetic per chunk). */
template <int R, int NT>
static __device__ __forceinline__ void cp_tile_sw128(__nv_bfloat16 *dst,
                                                     const __nv_bfloat16 *src, int64_t ld) {
    static_assert((R * 8) % NT == 0 && NT % 64 == 0, "whole chunks per thread, same swizzle");
    const int r0 = (int)threadIdx.x >> 3, c = (int)threadIdx.x & 7;
    unsigned char *d = reinterpret_cast<unsigned char *>(dst) + r0 * 128 + ((c ^ (r0 & 7)) << 4);
    const __nv_bfloat16 *s = src + (int64_t)r0 * ld + c * 8;
#pragma unroll
    for (int i = 0; i < R * 8 / NT; i++)
        cp_async16(d + i * (NT / 8) * 128, s + (int64_t)i * (NT / 8) * ld);
}

/* The descriptor of a SW128 tile at shared address p (1024-byte aligned): start address,
 * leading and stride byte offsets 1024 (16-byte units), layout type 1 (128-byte swizzle). */
static __device__ __forceinline__ uint64_t sw128_desc(const void *p) {
    const uint64_t a = (smem_u32(p) & 0x3FFFFu) >> 4;
    return a | ((uint64_t)(1024 >> 4) << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
/* k-step kk of a descriptor: K-major + 2 kk, MN-major + 128 kk (16-byte units, see above) */
#define SW128_KSTEP_K 2
#define SW128_KSTEP_MN 128

#if KILN_WGMMA_DEVICE
static __device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
static __device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
static __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
static __device__ __forceinline__ void wgmma_proxy_fence() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
/* Step j of a double-buffered walk over n tiles: starts copying tile j + 1 into the other
 * buffer (copy(j + 1, buffer), then commits it) and waits for tile j's copies, then makes
 * them visible to the products and to every thread of the block. */
template <typename Copy>
static __device__ __forceinline__ void tile_walk_step(int j, int n, Copy copy) {
    if (j + 1 < n) {
        copy(j + 1, (j & 1) ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    wgmma_proxy_fence();
    __syncthreads();
}

/* The accumulators d[0..31] are (re)defined here as far as the compiler knows. */
static __device__ __forceinline__ void wgmma_fence_operands(float *d) {
#pragma unroll
    for (int i = 0; i < 32; i++) asm volatile("" : "+f"(d[i])::"memory");
}

#define KILN_WGMMA_D32                                                                          \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "   \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define KILN_WGMMA_D32_OUT(d)                                                                  \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),             \
        "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),          \
        "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),          \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

/* d(64 x 64) (+)= A(64 x 16) B(16 x 64), A and B from SW128 tiles (descriptors da, db;
 * TA / TB 1: MN-major); accumulate 0 overwrites d. */
template <int TA, int TB>
static __device__ __forceinline__ void wgmma_ss(float *d, uint64_t da, uint64_t db,
                                                int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " KILN_WGMMA_D32
                 ", %32, %33, p, 1, 1, %35, %36;\n}\n"
                 : KILN_WGMMA_D32_OUT(d)
                 : "l"(da), "l"(db), "r"(accumulate), "n"(TA), "n"(TB));
}

/* d(64 x 64) (+)= A(64 x 16) B(16 x 64), A from registers (a: this warp's 16 x 16 fragment),
 * B from a SW128 tile (TB 1: MN-major). */
template <int TB>
static __device__ __forceinline__ void wgmma_rs(float *d, const uint32_t a[4], uint64_t db,
                                                int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " KILN_WGMMA_D32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
                 : KILN_WGMMA_D32_OUT(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate),
                   "n"(TB));
}
#undef KILN_WGMMA_D32
#undef KILN_WGMMA_D32_OUT
#endif /* KILN_WGMMA_DEVICE */

#endif /* KILN_CUDA_WGMMA_CUH */
