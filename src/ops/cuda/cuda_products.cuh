/*
 * cuda_products.cuh -- what the CUDA product kernels share (cuda_matmul.cu: the auditable
 * products; cuda_matvec.cu: fast decode's f32 and tensor-core products; cuda_matvec_i8.cu:
 * the int8-activation products): a launch's jobs (kiln_cuda_product_job with its grid
 * bookkeeping) and their checks, the RMSNorm prologue, and the weight loads and bit fields the
 * fast kernels decode. Internal to src/ops/cuda; contracts are in cuda_matmul.h.
 */
#ifndef KILN_CUDA_PRODUCTS_CUH
#define KILN_CUDA_PRODUCTS_CUH

#include "cuda_matmul.h"

#include "cuda_common.cuh"

#include "../../base/kmath.h"

#include <stdint.h>
#include <string.h>

/* One product of a launch of either product kernel (kiln_cuda_product_job), with its first
 * block in the grid and (the fast kernel) its split S, and the launch's jobs. */
struct prod_job {
    float *out;
    const float *res;
    const uint8_t *w, *w_up;
    const float *bias, *bias_up;
    size_t row_bytes;
    int64_t R;
    int S;
    unsigned blk0;
};
struct prod_jobs {
    prod_job job[KILN_CUDA_PRODUCT_MAX_JOBS];
    int n;
    const float *norm_w; /* NORM: x is rmsnorm(x) * norm_w (kiln_cuda_rmsnorm's bits) */
    float eps;
};

/* The launch's jobs from the caller's (checked by product_jobs_ok), norm as given. */
static inline prod_jobs prod_jobs_of(int n, const kiln_cuda_product_job *in, const float *norm_w, float eps) {
    prod_jobs a;
    memset(&a, 0, sizeof a);
    a.n = n;
    a.norm_w = norm_w;
    a.eps = eps;
    for (int j = 0; j < n; j++)
        a.job[j] = prod_job{in[j].out, in[j].res, in[j].w, in[j].w_up, in[j].bias, in[j].bias_up,
                            in[j].row_bytes, in[j].R, 0, 0};
    return a;
}

/* The RMSNorm prologue of the product kernels (NORM): the scale r of token rows n0 .. n0 +
 * nt - 1 of x(., C) into sr[0 .. nt), half-warp t taking row n0 + t exactly as
 * kiln_cuda_rmsnorm does (lane j's fmaf chain over elements j + 16k, the lane-16 tree,
 * kiln_rms_scale), so x's normed element i is (x[i] * r) * w[i] with rmsnorm's bits. Every
 * thread of the block calls it (it ends with a barrier). */
static __device__ __forceinline__ void norm_prologue(float *sr, const float *__restrict__ x,
                                                     int64_t C, int n0, int nt, float eps) {
    const int hw = threadIdx.x >> 4, lane = threadIdx.x & 15;
    if (hw < nt) {
        const float *xr = x + (int64_t)(n0 + hw) * C;
        float acc = 0.0f;
        for (int64_t i = lane; i < C; i += 16) acc = __fmaf_rn(xr[i], xr[i], acc);
        const float sum = lane16_tree(acc, half_warp_mask());
        if (lane == 0) sr[hw] = kiln_rms_scale(sum, (int)C, eps);
    }
    __syncthreads();
}
/* x's normed element: rmsnorm's (x * r) * w, two roundings. */
static __device__ __forceinline__ float normed(float x, float r, float w) {
    return __fmul_rn(__fmul_rn(x, r), w);
}

/* Whether [a, a + an) and [b, b + bn) share a byte. */
static inline bool ranges_overlap(const void *a, size_t an, const void *b, size_t bn) {
    const uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return a && b && an && bn && x < y + bn && y < x + an;
}

/* The checks kiln_cuda_matmul_multi and kiln_cuda_matvec_fast_multi share (cuda_matmul.h):
 * n, the pair rule, NULLs, R, float alignment, and the outputs apart from x and from each
 * other's outputs and residuals. */
static inline bool product_jobs_ok(int n, const kiln_cuda_product_job *jobs, const float *x, int64_t C,
                            int N, bool *pair) {
    if (n < 1 || n > KILN_CUDA_PRODUCT_MAX_JOBS || !jobs || !x || C < 1 || N < 1 ||
        (uintptr_t)x % 4 || (uint64_t)C > ((uint64_t)1 << 40))
        return false;
    *pair = jobs[0].w_up != NULL;
    for (int j = 0; j < n; j++) {
        const kiln_cuda_product_job &in = jobs[j];
        /* R <= 2^40 keeps every index product far from overflow */
        if (!in.out || !in.w || in.R < 1 || (uint64_t)in.R > ((uint64_t)1 << 40) ||
            (in.w_up != NULL) != *pair || (!*pair && in.bias_up) || (uintptr_t)in.out % 4 ||
            (uintptr_t)in.res % 4 || (uintptr_t)in.bias % 4 || (uintptr_t)in.bias_up % 4)
            return false;
        const size_t ob = (size_t)N * (size_t)in.R * sizeof(float);
        if (ranges_overlap(in.out, ob, x, (size_t)N * (size_t)C * sizeof(float)) ||
            (in.res && in.res != in.out && ranges_overlap(in.out, ob, in.res, ob)))
            return false;
        for (int i = 0; i < j; i++) {
            const size_t pb = (size_t)N * (size_t)jobs[i].R * sizeof(float);
            if (ranges_overlap(in.out, ob, jobs[i].out, pb) ||
                ranges_overlap(in.out, ob, jobs[i].res, pb) ||
                ranges_overlap(jobs[i].out, pb, in.res, ob))
                return false;
        }
    }
    return true;
}

/* The largest power of two, at most 16, dividing n (n even): the alignment of a run of
 * n-byte blocks on the fast paths (w and row_bytes multiples of it). */
static __host__ __device__ constexpr int pow2_align(int n) {
    return n % 16 == 0 ? 16 : n % 8 == 0 ? 8 : n % 4 == 0 ? 4 : 2;
}

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

/* ---- bit fields ------------------------------------------------------------------------- */

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

#endif /* KILN_CUDA_PRODUCTS_CUH */
