/*
 * cuda_elementwise.cu -- the element-wise ops on the GPU and their launchers (contracts:
 * cuda_elementwise.h): the gated activations of the MLP (SwiGLU and GeGLU, forward and
 * backward, f32 and bf16, auditable and fast), the residual add and the scale. One thread per
 * element (or per 4 or 8 elements with vector loads, each element computed as the scalar
 * kernel computes it), so the bits never depend on the launch shape.
 * The ops that move whole rows by index (embed, get_rows, kv_store_rows) are cuda_rows.cu's.
 *
 * Auditable arithmetic: each kernel transcribes docs/ARITHMETIC.md (the backward ops: its
 * "Backward ops", as src/ops/cpu/backward_portable.c computes them): the same binary32
 * operations, in the same order, per output element, as the CPU reference. Parallelism only ever
 * splits work ACROSS output elements or across the 16 lanes of the defined dot product, never
 * along a sequential chain, so the bits cannot depend on the launch shape. Compiled with
 * --fmad=false (no a*b+c contraction: every FMA is a written __fmaf_rn / fmaf), IEEE division
 * and square root (nvcc's defaults without --use_fast_math) and no flush-to-zero.
 */
#include "cuda_elementwise.h"

#include "cuda_common.cuh"

#include "../../base/kmath.h"

/* =================================================================================================
 * Forward.
 * ============================================================================================== */

/* ---- elementwise ----------------------------------------------------------------------------- */

template <typename O, typename I>
static __global__ void swiglu_kernel(O *out, const I *gate, const I *up, size_t n) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (size_t)gridDim.x * blockDim.x)
        store_out(out + u, kiln_swiglu(load_in(gate + u), load_in(up + u)));
}

/* out[i] = kiln_geglu(gate[i], up[i]) (kmath.h: GELU's tanh form, kiln_tanhf), the CPU's
 * bits; out may alias gate (each element is read before it is written, by its own thread). */
static __global__ void geglu_kernel(float *out, const float *gate, const float *up, size_t n) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (size_t)gridDim.x * blockDim.x)
        out[u] = kiln_geglu(gate[u], up[u]);
}

static __global__ void scale_kernel(float *x, float sc, size_t n) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (size_t)gridDim.x * blockDim.x)
        x[u] = x[u] * sc;
}

cudaError_t kiln_cuda_scale(cudaStream_t s, float *x, float sc, size_t n) {
    if (n == 0) return cudaSuccess;
    scale_kernel<<<grid_for((int64_t)n, 256), 256, 0, s>>>(x, sc, n);
    return cudaGetLastError();
}

static __global__ void add_kernel(float *x, const float *y, size_t n) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (size_t)gridDim.x * blockDim.x)
        x[u] = x[u] + y[u];
}

cudaError_t kiln_cuda_swiglu(cudaStream_t s, float *out, const float *gate, const float *up,
                             size_t n) {
    if (n == 0) return cudaSuccess;
    swiglu_kernel<float, float><<<grid_for((int64_t)n, 256), 256, 0, s>>>(out, gate, up, n);
    return cudaGetLastError();
}

cudaError_t kiln_cuda_geglu(cudaStream_t s, float *out, const float *gate, const float *up,
                            size_t n) {
    if (n == 0) return cudaSuccess;
    geglu_kernel<<<grid_for((int64_t)n, 256), 256, 0, s>>>(out, gate, up, n);
    return cudaGetLastError();
}

/* bf16 in and out, 4 elements a thread (8-byte loads and store; each element as swiglu_kernel
 * computes it, so the same bits): n4 groups of 4. */
static __global__ void swiglu_bf16x4_kernel(uint2 *out, const uint2 *gate, const uint2 *up,
                                            size_t n4) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n4;
         u += (size_t)gridDim.x * blockDim.x) {
        const float4 g = bf16x4_f32(gate[u]), v = bf16x4_f32(up[u]);
        out[u] = f32x4_bf16(kiln_swiglu(g.x, v.x), kiln_swiglu(g.y, v.y), kiln_swiglu(g.z, v.z),
                            kiln_swiglu(g.w, v.w));
    }
}

/* Fast mode (kiln_fast_swiglu): 8 elements an item (16-byte loads and store), two items a
 * thread with both loads issued first; n8 groups of 8. */
static __global__ void swiglu_fast_bf16x8_kernel(uint4 *out, const uint4 *gate, const uint4 *up,
                                                 size_t n8) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n8; u += 2 * stride) {
        const size_t u1 = u + stride;
        const bool two = u1 < n8;
        const uint4 g0 = gate[u], v0 = up[u];
        uint4 g1 = g0, v1 = v0;
        if (two) {
            g1 = gate[u1];
            v1 = up[u1];
        }
        float g[8], v[8], o[8];
        bf16x8_f32(g0, g);
        bf16x8_f32(v0, v);
#pragma unroll
        for (int i = 0; i < 8; i++) o[i] = kiln_fast_swiglu(g[i], v[i]);
        out[u] = f32x8_bf16(o);
        if (two) {
            bf16x8_f32(g1, g);
            bf16x8_f32(v1, v);
#pragma unroll
            for (int i = 0; i < 8; i++) o[i] = kiln_fast_swiglu(g[i], v[i]);
            out[u1] = f32x8_bf16(o);
        }
    }
}

static __global__ void swiglu_fast_bf16_kernel(uint16_t *out, const uint16_t *gate,
                                               const uint16_t *up, size_t n) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (size_t)gridDim.x * blockDim.x)
        out[u] = kiln_bf16_rne(kiln_fast_swiglu(load_in(gate + u), load_in(up + u)));
}

cudaError_t kiln_cuda_swiglu_bf16(cudaStream_t s, uint16_t *out, const uint16_t *gate,
                                  const uint16_t *up, size_t n, bool fast) {
    if (n == 0) return cudaSuccess;
    size_t done = 0;
    if (fast) {
        if ((((uintptr_t)gate | (uintptr_t)up | (uintptr_t)out) & 15) == 0 && n >= 8) {
            const size_t n8 = n / 8;
            swiglu_fast_bf16x8_kernel<<<grid_for((int64_t)((n8 + 1) / 2), 256), 256, 0, s>>>(
                reinterpret_cast<uint4 *>(out), reinterpret_cast<const uint4 *>(gate),
                reinterpret_cast<const uint4 *>(up), n8);
            done = 8 * n8;
        }
        if (done < n)
            swiglu_fast_bf16_kernel<<<grid_for((int64_t)(n - done), 256), 256, 0, s>>>(
                out + done, gate + done, up + done, n - done);
        return cudaGetLastError();
    }
    if ((((uintptr_t)gate | (uintptr_t)up | (uintptr_t)out) & 7) == 0 && n >= 4) {
        const size_t n4 = n / 4;
        swiglu_bf16x4_kernel<<<grid_for((int64_t)n4, 256), 256, 0, s>>>(
            reinterpret_cast<uint2 *>(out), reinterpret_cast<const uint2 *>(gate),
            reinterpret_cast<const uint2 *>(up), n4);
        done = 4 * n4;
    }
    if (done < n)
        swiglu_kernel<uint16_t, uint16_t><<<grid_for((int64_t)(n - done), 256), 256, 0, s>>>(
            out + done, gate + done, up + done, n - done);
    return cudaGetLastError();
}

cudaError_t kiln_cuda_add(cudaStream_t s, float *x, const float *y, size_t n) {
    if (n == 0) return cudaSuccess;
    add_kernel<<<grid_for((int64_t)n, 256), 256, 0, s>>>(x, y, n);
    return cudaGetLastError();
}

static __global__ void bf16_words_kernel(uint32_t *words, uint16_t *h, size_t n, bool to_words) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        if (to_words)
            words[i] = (uint32_t)h[i] << 16;
        else
            h[i] = (uint16_t)(words[i] >> 16);
    }
}

cudaError_t kiln_cuda_bf16_words(cudaStream_t s, uint32_t *words, uint16_t *h, size_t n, bool to_words) {
    if (n == 0) return cudaSuccess;
    bf16_words_kernel<<<grid_for((int64_t)n, 256), 256, 0, s>>>(words, h, n, to_words);
    return cudaGetLastError();
}

/* =================================================================================================
 * Backward.
 * ============================================================================================== */

/* ---- swiglu backward: one thread per element ------------------------------------------------ */

/* e = kiln_expf(-g); den = 1 + e; s = 1 / den; silu = g / den (the forward's silu);
 * dup = dout * silu; dgate = (dout * u) * (s * (1 + g * (1 - s))). All three inputs are read
 * before either output is written, so the outputs may alias inputs at the same index. */
static __device__ __forceinline__ void swiglu_bwd_elem(float g, float uv, float dov,
                                                       float *r_gate, float *r_up) {
    const float e = kiln_expf(-g);
    const float den = 1.0f + e;
    const float sg = 1.0f / den;
    const float silu = g / den;
    *r_up = dov * silu;
    *r_gate = (dov * uv) * (sg * (1.0f + g * (1.0f - sg)));
}

template <typename O, typename I>
static __global__ void swiglu_bwd_kernel(O *dgate, O *dup, const float *dout, const I *gate,
                                         const I *up, size_t n) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (size_t)gridDim.x * blockDim.x) {
        float r_gate, r_up;
        swiglu_bwd_elem(load_in(gate + u), load_in(up + u), dout[u], &r_gate, &r_up);
        store_out(dup + u, r_up);
        store_out(dgate + u, r_gate);
    }
}

/* bf16 gate, up in and dgate, dup out, 4 elements a thread (float4 dout, 8-byte bf16 loads
 * and stores), each element as above. */
static __global__ void swiglu_bwd_bf16x4_kernel(uint2 *dgate, uint2 *dup, const float4 *dout,
                                                const uint2 *gate, const uint2 *up, size_t n4) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n4;
         u += (size_t)gridDim.x * blockDim.x) {
        const float4 g = bf16x4_f32(gate[u]), v = bf16x4_f32(up[u]), d = dout[u];
        float a0, a1, a2, a3, b0, b1, b2, b3; /* dgate, dup */
        swiglu_bwd_elem(g.x, v.x, d.x, &a0, &b0);
        swiglu_bwd_elem(g.y, v.y, d.y, &a1, &b1);
        swiglu_bwd_elem(g.z, v.z, d.z, &a2, &b2);
        swiglu_bwd_elem(g.w, v.w, d.w, &a3, &b3);
        dgate[u] = f32x4_bf16(a0, a1, a2, a3);
        dup[u] = f32x4_bf16(b0, b1, b2, b3);
    }
}

cudaError_t kiln_cuda_swiglu_backward(cudaStream_t s, float *dgate, float *dup,
                                      const float *dout, const float *gate, const float *up,
                                      size_t n) {
    if (n == 0) return cudaSuccess;
    swiglu_bwd_kernel<float, float><<<grid_for((int64_t)n, 256), 256, 0, s>>>(dgate, dup, dout,
                                                                               gate, up, n);
    return cudaGetLastError();
}

/* ---- geglu backward: one thread per element (kmath.h kiln_geglu_backward, the CPU's bits) -- */

static __global__ void geglu_bwd_kernel(float *dgate, float *dup, const float *dout,
                                        const float *gate, const float *up, size_t n) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (size_t)gridDim.x * blockDim.x) {
        float dg, du;
        kiln_geglu_backward(gate[u], up[u], dout[u], &dg, &du);
        dup[u] = du;
        dgate[u] = dg;
    }
}

cudaError_t kiln_cuda_geglu_backward(cudaStream_t s, float *dgate, float *dup, const float *dout,
                                     const float *gate, const float *up, size_t n) {
    if (n == 0) return cudaSuccess;
    geglu_bwd_kernel<<<grid_for((int64_t)n, 256), 256, 0, s>>>(dgate, dup, dout, gate, up, n);
    return cudaGetLastError();
}

/* Fast mode (kiln_fast_swiglu_bwd), one element a thread: any alignment, any tail. dout in
 * f32 (DI float) or bf16 (DI uint16_t); dgate, dup rows of cols values ld apart. */
template <typename DI>
static __global__ void swiglu_bwd_fast_kernel(uint16_t *dgate, uint16_t *dup, int64_t ld,
                                              const DI *dout, const uint16_t *gate,
                                              const uint16_t *up, int64_t cols, int64_t n) {
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (int64_t)gridDim.x * blockDim.x) {
        float r_gate, r_up;
        kiln_fast_swiglu_bwd(load_in(gate + u), load_in(up + u), load_in(dout + u), &r_gate,
                             &r_up);
        const int64_t r = u / cols, o = r * ld + (u - r * cols);
        dup[o] = kiln_bf16_rne(r_up);
        dgate[o] = kiln_bf16_rne(r_gate);
    }
}

/* 8 values of dout at item u: 16 bytes of bf16, or 32 bytes of f32 */
static __device__ __forceinline__ void load8(const uint16_t *d, size_t u, float *f) {
    bf16x8_f32(reinterpret_cast<const uint4 *>(d)[u], f);
}
static __device__ __forceinline__ void load8(const float *d, size_t u, float *f) {
    const float4 a = reinterpret_cast<const float4 *>(d)[2 * u];
    const float4 b = reinterpret_cast<const float4 *>(d)[2 * u + 1];
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

/* Fast mode, 8 elements an item (16-byte loads and stores), two items a thread with their
 * loads first; q_row items a row (cols / 8), rows ld apart in dgate, dup; nq items. */
template <typename DI>
static __global__ void swiglu_bwd_fast_x8_kernel(uint16_t *dgate, uint16_t *dup, size_t ld,
                                                 const DI *dout, const uint4 *gate,
                                                 const uint4 *up, size_t q_row, size_t nq) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < nq; u += 2 * stride) {
        size_t it[2] = {u, u + stride};
        const int m = it[1] < nq ? 2 : 1;
        float g[2][8], v[2][8], d[2][8];
#pragma unroll
        for (int k = 0; k < 2; k++)
            if (k < m) {
                bf16x8_f32(gate[it[k]], g[k]);
                bf16x8_f32(up[it[k]], v[k]);
                load8(dout, it[k], d[k]);
            }
#pragma unroll
        for (int k = 0; k < 2; k++)
            if (k < m) {
                float a[8], b[8]; /* dgate, dup */
#pragma unroll
                for (int i = 0; i < 8; i++)
                    kiln_fast_swiglu_bwd(g[k][i], v[k][i], d[k][i], &a[i], &b[i]);
                const size_t r = it[k] / q_row, o = r * ld + (it[k] - r * q_row) * 8;
                *reinterpret_cast<uint4 *>(dgate + o) = f32x8_bf16(a);
                *reinterpret_cast<uint4 *>(dup + o) = f32x8_bf16(b);
            }
    }
}

/* The fast kernels for rows x cols: 8-wide where cols, ld and every pointer allow it. */
template <typename DI>
static cudaError_t swiglu_bwd_fast_launch(cudaStream_t s, uint16_t *dgate, uint16_t *dup,
                                          int64_t ld, const DI *dout, const uint16_t *gate,
                                          const uint16_t *up, int64_t rows, int64_t cols) {
    const int64_t n = rows * cols;
    if (cols % 8 == 0 && ld % 8 == 0 &&
        (((uintptr_t)dout | (uintptr_t)dgate | (uintptr_t)dup | (uintptr_t)gate |
          (uintptr_t)up) & 15) == 0) {
        const size_t nq = (size_t)(n / 8);
        swiglu_bwd_fast_x8_kernel<DI><<<grid_for((int64_t)((nq + 1) / 2), 256), 256, 0, s>>>(
            dgate, dup, (size_t)ld, dout, reinterpret_cast<const uint4 *>(gate),
            reinterpret_cast<const uint4 *>(up), (size_t)(cols / 8), nq);
    } else {
        swiglu_bwd_fast_kernel<DI><<<grid_for(n, 256), 256, 0, s>>>(dgate, dup, ld, dout, gate,
                                                                    up, cols, n);
    }
    return cudaGetLastError();
}

cudaError_t kiln_cuda_swiglu_backward_bf16(cudaStream_t s, uint16_t *dgate, uint16_t *dup,
                                           const float *dout, const uint16_t *gate,
                                           const uint16_t *up, size_t n, bool fast) {
    if (n == 0) return cudaSuccess;
    if (fast)
        return swiglu_bwd_fast_launch<float>(s, dgate, dup, (int64_t)n, dout, gate, up, 1, (int64_t)n);
    size_t done = 0;
    if (((uintptr_t)dout & 15) == 0 &&
        (((uintptr_t)dgate | (uintptr_t)dup | (uintptr_t)gate | (uintptr_t)up) & 7) == 0 &&
        n >= 4) {
        const size_t n4 = n / 4;
        swiglu_bwd_bf16x4_kernel<<<grid_for((int64_t)n4, 256), 256, 0, s>>>(
            reinterpret_cast<uint2 *>(dgate), reinterpret_cast<uint2 *>(dup),
            reinterpret_cast<const float4 *>(dout), reinterpret_cast<const uint2 *>(gate),
            reinterpret_cast<const uint2 *>(up), n4);
        done = 4 * n4;
    }
    if (done < n)
        swiglu_bwd_kernel<uint16_t, uint16_t><<<grid_for((int64_t)(n - done), 256), 256, 0, s>>>(
            dgate + done, dup + done, dout + done, gate + done, up + done, n - done);
    return cudaGetLastError();
}

/* bf16 dout too, dgate and dup written as rows of cols values ld apart (column blocks of a
 * wider matrix): a thread per 4 elements of a row (cols % 4 == 0), or one per element. */
static __global__ void swiglu_bwd_d16_x4_kernel(uint16_t *dgate, uint16_t *dup, size_t ld,
                                                const uint2 *dout, const uint2 *gate,
                                                const uint2 *up, unsigned q_row, unsigned nq) {
    for (unsigned u = blockIdx.x * blockDim.x + threadIdx.x; u < nq;
         u += gridDim.x * blockDim.x) {
        const float4 g = bf16x4_f32(gate[u]), v = bf16x4_f32(up[u]), d = bf16x4_f32(dout[u]);
        float a0, a1, a2, a3, b0, b1, b2, b3; /* dgate, dup */
        swiglu_bwd_elem(g.x, v.x, d.x, &a0, &b0);
        swiglu_bwd_elem(g.y, v.y, d.y, &a1, &b1);
        swiglu_bwd_elem(g.z, v.z, d.z, &a2, &b2);
        swiglu_bwd_elem(g.w, v.w, d.w, &a3, &b3);
        const unsigned r = u / q_row;
        const size_t o = (size_t)r * ld + (size_t)(u - r * q_row) * 4;
        *reinterpret_cast<uint2 *>(dgate + o) = f32x4_bf16(a0, a1, a2, a3);
        *reinterpret_cast<uint2 *>(dup + o) = f32x4_bf16(b0, b1, b2, b3);
    }
}

static __global__ void swiglu_bwd_d16_kernel(uint16_t *dgate, uint16_t *dup, int64_t ld,
                                             const uint16_t *dout, const uint16_t *gate,
                                             const uint16_t *up, int64_t cols, int64_t n) {
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (int64_t)gridDim.x * blockDim.x) {
        float r_gate, r_up;
        swiglu_bwd_elem(load_in(gate + u), load_in(up + u), load_in(dout + u), &r_gate, &r_up);
        const int64_t r = u / cols, o = r * ld + (u - r * cols);
        store_out(dup + o, r_up);
        store_out(dgate + o, r_gate);
    }
}

cudaError_t kiln_cuda_swiglu_backward_bf16_d16(cudaStream_t s, uint16_t *dgate, uint16_t *dup,
                                               int64_t ld, const uint16_t *dout,
                                               const uint16_t *gate, const uint16_t *up,
                                               int64_t rows, int64_t cols, bool fast) {
    if (rows <= 0 || cols <= 0) return cudaSuccess;
    if (ld < cols) return cudaErrorInvalidValue;
    if (fast) return swiglu_bwd_fast_launch<uint16_t>(s, dgate, dup, ld, dout, gate, up, rows, cols);
    const int64_t n = rows * cols;
    if (cols % 4 == 0 && ld % 4 == 0 && n / 4 < ((int64_t)1 << 32) &&
        (((uintptr_t)dout | (uintptr_t)dgate | (uintptr_t)dup | (uintptr_t)gate |
          (uintptr_t)up) & 7) == 0) {
        const unsigned nq = (unsigned)(n / 4);
        swiglu_bwd_d16_x4_kernel<<<grid_for((int64_t)nq, 256), 256, 0, s>>>(
            dgate, dup, (size_t)ld, reinterpret_cast<const uint2 *>(dout),
            reinterpret_cast<const uint2 *>(gate), reinterpret_cast<const uint2 *>(up),
            (unsigned)(cols / 4), nq);
    } else {
        swiglu_bwd_d16_kernel<<<grid_for(n, 256), 256, 0, s>>>(dgate, dup, ld, dout, gate, up,
                                                               cols, n);
    }
    return cudaGetLastError();
}
