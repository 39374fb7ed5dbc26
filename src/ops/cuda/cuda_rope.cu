/*
 * cuda_rope.cu -- RoPE on the GPU: the forward rotation and its backward (the transpose), the
 * backward also rounded to bf16, and their launchers (contracts: cuda_rope.h). One thread per
 * rotated pair; the forward's pair is cuda_common.cuh's kiln_rope_pair, which the fast
 * attention's packing applies too (cuda_attention.cu), so a pair rotated by either has the same
 * bits.
 *
 * Auditable arithmetic: each kernel transcribes docs/ARITHMETIC.md (the backward ops: its
 * "Backward ops", as src/ops/cpu/backward_portable.c computes them): the same binary32
 * operations, in the same order, per output element, as the CPU reference. Parallelism only ever
 * splits work ACROSS output elements or across the 16 lanes of the defined dot product, never
 * along a sequential chain, so the bits cannot depend on the launch shape. Compiled with
 * --fmad=false (no a*b+c contraction: every FMA is a written __fmaf_rn / fmaf), IEEE division
 * and square root (nvcc's defaults without --use_fast_math) and no flush-to-zero.
 */
#include "cuda_rope.h"

#include "cuda_common.cuh"

/* =================================================================================================
 * Forward.
 * ============================================================================================== */

/* ---- rope: one thread per rotated pair ------------------------------------------------------ */

static __global__ void rope_kernel(float *x, const int32_t *__restrict__ pos, int N, int H,
                                   int HS, const float *__restrict__ cos_tab,
                                   const float *__restrict__ sin_tab, int64_t total) {
    const int half = HS / 2;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (int64_t)gridDim.x * blockDim.x) {
        int64_t nh = u / half; /* token * H + head */
        int i = (int)(u - nh * half);
        int64_t n = nh / H;
        float *v = x + nh * HS;
        const float c = cos_tab[(int64_t)pos[n] * half + i];
        const float sn = sin_tab[(int64_t)pos[n] * half + i];
        const float2 r = kiln_rope_pair(v[i], v[i + half], c, sn);
        v[i] = r.x;
        v[i + half] = r.y;
    }
}

cudaError_t kiln_cuda_rope(cudaStream_t s, float *x, const int32_t *pos, int N, int H, int HS,
                           const float *cos_tab, const float *sin_tab) {
    int64_t total = (int64_t)N * H * (HS / 2);
    if (total <= 0) return cudaSuccess;
    rope_kernel<<<grid_for(total, 256), 256, 0, s>>>(x, pos, N, H, HS, cos_tab, sin_tab, total);
    return cudaGetLastError();
}

/* ---- rope_kv_store: a thread per rotated pair of q and k, and per pair of v elements -------- */

static __global__ void rope_kv_store_kernel(float *q, float *k, const float *__restrict__ v,
                                            const int32_t *__restrict__ pos, int NH, int KVH,
                                            int HS, const float *__restrict__ cos_tab,
                                            const float *__restrict__ sin_tab,
                                            float *__restrict__ k_pool,
                                            float *__restrict__ v_pool,
                                            const int32_t *__restrict__ slots, int64_t per_tok,
                                            int64_t total) {
    pdl_wait(); /* launched by launch_pdl (cuda_common.cuh) */
    pdl_launch_dependents();
    const int half = HS / 2;
    const int64_t KD = (int64_t)KVH * HS, nq = (int64_t)NH * half, nk = (int64_t)KVH * half;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (int64_t)gridDim.x * blockDim.x) {
        const int64_t n = u / per_tok;
        int64_t i = u - n * per_tok;
        if (i < nq + nk) { /* a pair of q or of k, rotated in place */
            const bool is_k = i >= nq;
            if (is_k) i -= nq;
            const int64_t h = i / half;
            const int j = (int)(i - h * half);
            float *x = is_k ? k + n * KD + h * HS : q + (n * NH + h) * HS;
            const float c = cos_tab[(int64_t)pos[n] * half + j];
            const float sn = sin_tab[(int64_t)pos[n] * half + j];
            const float2 r = kiln_rope_pair(x[j], x[j + half], c, sn);
            x[j] = r.x;
            x[j + half] = r.y;
            if (is_k) {
                float *kp = k_pool + (int64_t)slots[n] * KD + h * HS;
                kp[j] = r.x;
                kp[j + half] = r.y;
            }
        } else { /* a pair of v, copied */
            i -= nq + nk;
            const int64_t h = i / half;
            const int j = (int)(i - h * half);
            const float *x = v + n * KD + h * HS;
            float *vp = v_pool + (int64_t)slots[n] * KD + h * HS;
            vp[j] = x[j];
            vp[j + half] = x[j + half];
        }
    }
}

cudaError_t kiln_cuda_rope_kv_store(cudaStream_t s, float *q, float *k, const float *v,
                                    const int32_t *pos, int N, int NH, int KVH, int HS,
                                    const float *cos_tab, const float *sin_tab, float *k_pool,
                                    float *v_pool, const int32_t *slots) {
    if (N <= 0) return cudaSuccess;
    if (NH <= 0 || KVH <= 0 || HS <= 0 || HS % 2 || !q || !k || !v || !pos || !cos_tab ||
        !sin_tab || !k_pool || !v_pool || !slots)
        return cudaErrorInvalidValue;
    const int64_t per_tok = (int64_t)(NH + 2 * KVH) * (HS / 2), total = per_tok * N;
    return launch_pdl(rope_kv_store_kernel, grid_for(total, 256), 256, 0, s, q, k, v, pos, NH, KVH,
                      HS, cos_tab, sin_tab, k_pool, v_pool, slots, per_tok, total);
}

/* =================================================================================================
 * Backward.
 * ============================================================================================== */

/* ---- rope backward: one thread per rotated pair --------------------------------------------- */

static __global__ void rope_bwd_kernel(float *d, const int32_t *__restrict__ pos, int H, int HS,
                                       const float *__restrict__ cos_tab,
                                       const float *__restrict__ sin_tab, int64_t total) {
    const int half = HS / 2;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (int64_t)gridDim.x * blockDim.x) {
        const int64_t nh = u / half; /* token * H + head */
        const int i = (int)(u - nh * half);
        const int64_t n = nh / H;
        float *v = d + nh * HS;
        const float c = cos_tab[(int64_t)pos[n] * half + i];
        const float sn = sin_tab[(int64_t)pos[n] * half + i];
        const float a = v[i], b = v[i + half];
        v[i] = a * c + b * sn;
        v[i + half] = b * c - a * sn;
    }
}

/* The same pairs, each result also (or only) stored as its bf16 rounding into d16 (token n's
 * row at d16 + n * ld16). */
static __global__ void rope_bwd_bf16_kernel(float *d, uint16_t *__restrict__ d16, int64_t ld16,
                                            int keep_f32, const int32_t *__restrict__ pos, int H,
                                            int HS, const float *__restrict__ cos_tab,
                                            const float *__restrict__ sin_tab, int64_t total) {
    const int half = HS / 2;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (int64_t)gridDim.x * blockDim.x) {
        const int64_t nh = u / half;
        const int i = (int)(u - nh * half);
        const int64_t n = nh / H;
        float *v = d + nh * HS;
        uint16_t *v16 = d16 + n * ld16 + (nh - n * H) * HS;
        const float c = cos_tab[(int64_t)pos[n] * half + i];
        const float sn = sin_tab[(int64_t)pos[n] * half + i];
        const float a = v[i], b = v[i + half];
        const float ra = a * c + b * sn, rb = b * c - a * sn;
        v16[i] = kiln_bf16_rne(ra);
        v16[i + half] = kiln_bf16_rne(rb);
        if (keep_f32) {
            v[i] = ra;
            v[i + half] = rb;
        }
    }
}

/* The same for half = HALF (head sizes 64 and 128), a thread per two neighbouring pairs
 * (i, i + 1 and i + HALF, i + HALF + 1: 8-byte loads, a 4-byte bf16 store each), 32-bit
 * indices, the division by the pairs a row a shift: the same operations on each element. */
template <int HALF>
static __global__ void rope_bwd_bf16_vec_kernel(float *d, uint16_t *__restrict__ d16,
                                                size_t ld16, int keep_f32,
                                                const int32_t *__restrict__ pos, unsigned H,
                                                const float *__restrict__ cos_tab,
                                                const float *__restrict__ sin_tab, unsigned total) {
    constexpr unsigned Q = HALF / 2; /* items a (token, head) row */
    for (unsigned u = blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += gridDim.x * blockDim.x) {
        const unsigned nh = u / Q, i = 2 * (u - nh * Q), n = nh / H;
        float *v = d + (size_t)nh * (2 * HALF);
        const size_t t = (size_t)pos[n] * HALF + i;
        const float2 c = *(const float2 *)(cos_tab + t), sn = *(const float2 *)(sin_tab + t);
        const float2 a = *(const float2 *)(v + i), b = *(const float2 *)(v + i + HALF);
        const float ra0 = a.x * c.x + b.x * sn.x, rb0 = b.x * c.x - a.x * sn.x;
        const float ra1 = a.y * c.y + b.y * sn.y, rb1 = b.y * c.y - a.y * sn.y;
        uint16_t *v16 = d16 + (size_t)n * ld16 + (size_t)(nh - n * H) * (2 * HALF);
        *(uint32_t *)(v16 + i) = (uint32_t)kiln_bf16_rne(ra0) | ((uint32_t)kiln_bf16_rne(ra1) << 16);
        *(uint32_t *)(v16 + i + HALF) =
            (uint32_t)kiln_bf16_rne(rb0) | ((uint32_t)kiln_bf16_rne(rb1) << 16);
        if (keep_f32) {
            *(float2 *)(v + i) = make_float2(ra0, ra1);
            *(float2 *)(v + i + HALF) = make_float2(rb0, rb1);
        }
    }
}

cudaError_t kiln_cuda_rope_backward_bf16(cudaStream_t s, float *d, uint16_t *d16, int64_t ld16,
                                         int keep_f32, const int32_t *pos, int N, int H, int HS,
                                         const float *cos_tab, const float *sin_tab) {
    const int64_t total = (int64_t)N * H * (HS / 2);
    if (N <= 0 || H <= 0 || total <= 0) return cudaSuccess;
    if (ld16 < (int64_t)H * HS) return cudaErrorInvalidValue;
    const bool vec = (HS == 64 || HS == 128) && total / 2 < (int64_t)1 << 31 &&
                     ((uintptr_t)d & 7u) == 0 && ((uintptr_t)d16 & 3u) == 0 && ld16 % 2 == 0 &&
                     ((uintptr_t)cos_tab & 7u) == 0 && ((uintptr_t)sin_tab & 7u) == 0;
    if (vec) {
        const unsigned items = (unsigned)(total / 2);
        if (HS == 64)
            rope_bwd_bf16_vec_kernel<32><<<grid_for(items, 256), 256, 0, s>>>(
                d, d16, (size_t)ld16, keep_f32, pos, (unsigned)H, cos_tab, sin_tab, items);
        else
            rope_bwd_bf16_vec_kernel<64><<<grid_for(items, 256), 256, 0, s>>>(
                d, d16, (size_t)ld16, keep_f32, pos, (unsigned)H, cos_tab, sin_tab, items);
        return cudaGetLastError();
    }
    rope_bwd_bf16_kernel<<<grid_for(total, 256), 256, 0, s>>>(d, d16, ld16, keep_f32, pos, H, HS,
                                                              cos_tab, sin_tab, total);
    return cudaGetLastError();
}

cudaError_t kiln_cuda_rope_backward(cudaStream_t s, float *d, const int32_t *pos, int N, int H,
                                    int HS, const float *cos_tab, const float *sin_tab) {
    const int64_t total = (int64_t)N * H * (HS / 2);
    if (N <= 0 || H <= 0 || total <= 0) return cudaSuccess;
    rope_bwd_kernel<<<grid_for(total, 256), 256, 0, s>>>(d, pos, H, HS, cos_tab, sin_tab, total);
    return cudaGetLastError();
}
