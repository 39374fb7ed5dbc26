/*
 * cuda_common.cuh -- the helpers every CUDA kernel file shares: the grid of the grid-stride
 * kernels (host), the lane-16 tree of the defined dot, the bf16 rounding, the RoPE rotation of
 * a pair, per-element dequantization of every GGUF block type with tensor.c's formulas,
 * operation for operation (so a dequantized weight has the CPU's bits in both modes), and the
 * runtime-dtype dispatch macro. Included from .cu files only; everything is static (one copy
 * per translation unit, inlined).
 */
#ifndef KILN_CUDA_COMMON_CUH
#define KILN_CUDA_COMMON_CUH

#include "cuda_internal.h"

/* ---- launch grids ---------------------------------------------------------------------- */

/* Blocks of `threads` for a grid-stride loop over total elements: one element a thread, at
 * most 2^20 blocks (the loop takes the rest). The element-wise, rope and row kernels' grid. */
static inline unsigned grid_for(int64_t total, int threads) {
    int64_t g = (total + threads - 1) / threads;
    return (unsigned)(g > (1 << 20) ? (1 << 20) : g);
}

/* ---- programmatic dependent launch: a step's kernels overlap their neighbours ----------- */

/* The fast decode step is a chain of small kernels, each reading what the one before wrote
 * (docs/CUDA.md, "Decode graphs"). With programmatic dependent launch (Hopper), a kernel
 * launched by launch_pdl may be scheduled while the kernel before it in the stream still
 * runs; it must call pdl_wait() before it reads or writes anything another kernel touches
 * (pdl_wait returns when the previous kernel has completed, its writes visible, and with it
 * every kernel before). After its wait a kernel calls pdl_launch_dependents(), so that the
 * kernel after it may start up early in turn (one kernel ahead, never a cascade of waiting
 * kernels). Neither changes an operation's inputs or order: the bits are those of plain
 * launches. Without the launch attribute (KILN_CUDA_PDL=0, or a plain <<<>>> launch)
 * pdl_wait returns at once and the stream orders kernels as always. */
static __device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
static __device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Whether launch_pdl asks for programmatic dependent launch: on unless KILN_CUDA_PDL=0 (an A/B
 * switch; read once per process). */
static inline bool pdl_enabled() {
    static const bool on = !kiln_env_off("KILN_CUDA_PDL");
    return on;
}

/* kernel<<<grid, block, smem, s>>>(args...); return cudaGetLastError(); with the
 * programmatic-dependent-launch attribute (see pdl_wait): only for kernels that call pdl_wait()
 * before touching what another kernel writes. Recorded into CUDA graphs as a programmatic
 * edge. Like the plain launch it replaces, it takes the launch's error out of the runtime's
 * last error, so that no later check reports it again. */
template <typename... KP, typename... A>
static cudaError_t launch_pdl(void (*kernel)(KP...), dim3 grid, dim3 block, size_t smem,
                              cudaStream_t s, A &&...args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = pdl_enabled() ? 1 : 0;
    (void)cudaLaunchKernelEx(&cfg, kernel, static_cast<A &&>(args)...);
    return cudaGetLastError();
}

/* ---- the lane-16 dot: one half-warp per dot, thread j = lane j -------------------------- */

/* The fixed tree of kiln_lane16_reduce over the 16 lanes of this thread's half-warp:
 * (j, j+8), then (j, j+4), (j, j+2), (j, j+1). XOR partners give every lane the same sums
 * (IEEE addition is commutative), so all 16 lanes return the dot's bits. mask: the
 * half-warp's threads. */
static __device__ __forceinline__ float lane16_tree(float a, unsigned mask) {
    a = a + __shfl_xor_sync(mask, a, 8, 16);
    a = a + __shfl_xor_sync(mask, a, 4, 16);
    a = a + __shfl_xor_sync(mask, a, 2, 16);
    a = a + __shfl_xor_sync(mask, a, 1, 16);
    return a;
}

static __device__ __forceinline__ unsigned half_warp_mask() {
    return (threadIdx.x & 16) ? 0xffff0000u : 0x0000ffffu;
}

/* ---- f32 -> bf16 ------------------------------------------------------------------------ */

/* tensor.c's kiln_fp32_to_bf16, operation for operation: round to nearest even; a NaN keeps
 * its sign and top payload bits and is made quiet. Every fast-mode rounding to bf16 (the GEMM
 * module's conversions, the fused loss, the bf16 activations) is this one. */
static __device__ __forceinline__ uint16_t kiln_bf16_rne(float f) {
    const uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)(((uint64_t)u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* An output element: f32, or its bf16 rounding (a fast mode's bf16 activations: the same f32
 * value first, so the bits are those of the f32 kernel followed by a conversion). */
static __device__ __forceinline__ void store_out(float *p, float v) { *p = v; }
static __device__ __forceinline__ void store_out(uint16_t *p, float v) { *p = kiln_bf16_rne(v); }

/* ---- fast-mode exponentials ---------------------------------------------------------- */

/* 2^x, the MUFU approximation (ex2.approx.ftz: about 2 ulp; what __expf is built on). */
static __device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
/* log2(e): exp(x) = 2^(x log2 e), so exp(s * scale - m) = ex2_approx(fmaf(s, c, -m log2 e))
 * with c = scale log2 e: one FMA and the MUFU per softmax weight (the fast
 * attention and the fast fused loss; auditable code uses kiln_expf). */
#define KILN_LOG2E 1.4426950408889634f

/* An input element: f32 as is, bf16 widened (exact). */
static __device__ __forceinline__ float load_in(const float *p) { return *p; }
static __device__ __forceinline__ float load_in(const uint16_t *p) {
    return __uint_as_float((uint32_t)*p << 16);
}
/* 4 bf16 (8 bytes) widened. */
static __device__ __forceinline__ float4 bf16x4_f32(uint2 v) {
    return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                       __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
}
/* 4 values rounded to bf16 (kiln_bf16_rne), packed in 8 bytes, the first at the lowest. */
static __device__ __forceinline__ uint2 f32x4_bf16(float a, float b, float c, float d) {
    return make_uint2((uint32_t)kiln_bf16_rne(a) | ((uint32_t)kiln_bf16_rne(b) << 16),
                      (uint32_t)kiln_bf16_rne(c) | ((uint32_t)kiln_bf16_rne(d) << 16));
}

/* 8 bf16 (16 bytes) widened to f32 / 8 values rounded to bf16 (kiln_bf16_rne) and packed. */
static __device__ __forceinline__ void bf16x8_f32(uint4 v, float *f) {
    const float4 a = bf16x4_f32(make_uint2(v.x, v.y)), b = bf16x4_f32(make_uint2(v.z, v.w));
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}
static __device__ __forceinline__ uint4 f32x8_bf16(const float *f) {
    const uint2 a = f32x4_bf16(f[0], f[1], f[2], f[3]), b = f32x4_bf16(f[4], f[5], f[6], f[7]);
    return make_uint4(a.x, a.y, b.x, b.y);
}

/* ---- fast mode's SwiGLU (the bf16 mixed-precision kernels of a fast-mode backend) ---------
 * sigmoid(g) = 1 / (1 + 2^(-g log2 e)) with the MUFU's 2^x and reciprocal (ex2.approx,
 * rcp.approx: a few f32 ulps) instead of kiln_expf and IEEE divisions: about 15 instructions
 * an element instead of about 60, so the kernels run at the copy rate. The results are
 * rounded to bf16 next, so they differ from the exact formula's rounding by one bf16 ulp in
 * a small fraction of elements (tests/gpu/test_cuda_backward_fast.cu measures it); the same
 * bits from run to run. silu(g) = g * sigmoid(g); swiglu = silu(g) * u. */
static __device__ __forceinline__ float kiln_fast_sigmoid(float g) {
    float e, r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
    return r;
}
static __device__ __forceinline__ float kiln_fast_swiglu(float g, float u) {
    return (g * kiln_fast_sigmoid(g)) * u;
}
/* d/dgate and d/dup of swiglu (dov the output's gradient), with the fast sigmoid: the exact
 * kernel's formula (cuda_elementwise.cu swiglu_bwd_elem) with its sigmoid */
static __device__ __forceinline__ void kiln_fast_swiglu_bwd(float g, float uv, float dov,
                                                            float *r_gate, float *r_up) {
    const float sg = kiln_fast_sigmoid(g);
    *r_up = dov * (g * sg);
    *r_gate = (dov * uv) * (sg * (1.0f + g * (1.0f - sg)));
}

/* ---- RoPE ------------------------------------------------------------------------------- */

/* The rotation of one pair (a, b) = (x[i], x[i + HS/2]) of a head by the angle whose cosine
 * and sine are c, sn: (a c - b sn, b c + a sn), each product rounded, then the sum (no FMA:
 * the files are compiled with --fmad=false). THE definition of RoPE's bits on the GPU:
 * kiln_cuda_rope's kernel and the fast attention's packing (kiln_cuda_attn_rope) both take
 * it, so a pair rotated by either has the same bits. */
static __device__ __forceinline__ float2 kiln_rope_pair(float a, float b, float c, float sn) {
    return make_float2(a * c - b * sn, b * c + a * sn);
}

/* ---- dequantization of one element: tensor.c's formulas, operation for operation -------- */

static __device__ __forceinline__ uint32_t rd_u16(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8);
}

/* tensor.c's fp16_to_fp32: exact widening built from bits (NaN keeps sign and payload). */
static __device__ __forceinline__ float fp16_f32(uint32_t h) {
    uint32_t sign = (h & 0x8000u) << 16;
    uint32_t em = h & 0x7fffu;
    uint32_t normal = (em << 13) + 0x38000000u;
    uint32_t special = (em << 13) + 0x70000000u;
    uint32_t sub = __float_as_uint((float)(int32_t)em * 0x1p-24f);
    uint32_t r = em < 0x400u ? sub : em >= 0x7c00u ? special : normal;
    return __uint_as_float(r | sign);
}

/* The 6-bit scale and min of group g of a q4_k / q5_k block (tensor.c's k_scale_min). */
static __device__ __forceinline__ void k_scale_min(const uint8_t *s, int g, uint32_t *sc,
                                                   uint32_t *mn) {
    if (g < 4) {
        *sc = s[g] & 0x3fu;
        *mn = s[g + 4] & 0x3fu;
    } else {
        int j = g - 4;
        *sc = (s[j + 8] & 0x0fu) | ((s[j] >> 2) & 0x30u);
        *mn = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30u);
    }
}

/* Bytes per block and elements per block of the quantized types (plain types: one element). */
template <int DT> struct blk {
    static constexpr int BS = DT == KILN_DTYPE_F32 || DT == KILN_DTYPE_F16 || DT == KILN_DTYPE_BF16
                                  ? 1
                              : DT == KILN_DTYPE_Q4_K || DT == KILN_DTYPE_Q5_K || DT == KILN_DTYPE_Q6_K
                                  ? 256
                                  : 32;
    static constexpr int TS = DT == KILN_DTYPE_F32 ? 4
                              : DT == KILN_DTYPE_F16 || DT == KILN_DTYPE_BF16 ? 2
                              : DT == KILN_DTYPE_Q8_0 ? 34
                              : DT == KILN_DTYPE_Q4_0 ? 18
                              : DT == KILN_DTYPE_Q4_1 ? 20
                              : DT == KILN_DTYPE_Q5_0 ? 22
                              : DT == KILN_DTYPE_Q5_1 ? 24
                              : DT == KILN_DTYPE_Q4_K ? 144
                              : DT == KILN_DTYPE_Q5_K ? 176
                                                      : 210;
};

/* Element e of the block that starts at b (plain types: element e of the run at b). Loads of
 * the block header are the same expressions for every e, so an unrolled caller that asks for
 * several elements of one block loads the header once. */
template <int DT>
static __device__ __forceinline__ float deq_blk(const uint8_t *__restrict__ b, int e) {
    if (DT == KILN_DTYPE_F32) {
        return ((const float *)b)[e];
    } else if (DT == KILN_DTYPE_F16) {
        return fp16_f32(((const uint16_t *)b)[e]);
    } else if (DT == KILN_DTYPE_BF16) {
        return __uint_as_float((uint32_t)((const uint16_t *)b)[e] << 16);
    } else if (DT == KILN_DTYPE_Q8_0) {
        const float d = fp16_f32(rd_u16(b));
        return (float)(int8_t)b[2 + e] * d;
    } else if (DT == KILN_DTYPE_Q4_0) {
        const float d = fp16_f32(rd_u16(b));
        int q = e < 16 ? (b[2 + e] & 0x0f) : (b[2 + e - 16] >> 4);
        return d * (float)(q - 8);
    } else if (DT == KILN_DTYPE_Q4_1) {
        const float d = fp16_f32(rd_u16(b));
        const float m = fp16_f32(rd_u16(b + 2));
        uint32_t q = e < 16 ? (b[4 + e] & 0x0fu) : (uint32_t)(b[4 + e - 16] >> 4);
        return d * (float)q + m;
    } else if (DT == KILN_DTYPE_Q5_0) {
        const float d = fp16_f32(rd_u16(b));
        uint32_t hb = ((uint32_t)(b[2 + (e >> 3)] >> (e & 7)) & 1u) << 4;
        uint32_t lo = e < 16 ? (b[6 + e] & 0x0fu) : (uint32_t)(b[6 + e - 16] >> 4);
        return d * (float)((int)(lo | hb) - 16);
    } else if (DT == KILN_DTYPE_Q5_1) {
        const float d = fp16_f32(rd_u16(b));
        const float m = fp16_f32(rd_u16(b + 2));
        uint32_t hb = ((uint32_t)(b[4 + (e >> 3)] >> (e & 7)) & 1u) << 4;
        uint32_t lo = e < 16 ? (b[8 + e] & 0x0fu) : (uint32_t)(b[8 + e - 16] >> 4);
        return d * (float)(lo | hb) + m;
    } else if (DT == KILN_DTYPE_Q4_K) {
        const float d = fp16_f32(rd_u16(b));
        const float dmin = fp16_f32(rd_u16(b + 2));
        int g = e >> 5, l = e & 31;
        uint32_t sc, mn;
        k_scale_min(b + 4, g, &sc, &mn);
        const float dg = d * (float)sc, mg = dmin * (float)mn;
        uint32_t q = (b[16 + (g >> 1) * 32 + l] >> ((g & 1) * 4)) & 0x0fu;
        return dg * (float)q - mg;
    } else if (DT == KILN_DTYPE_Q5_K) {
        const float d = fp16_f32(rd_u16(b));
        const float dmin = fp16_f32(rd_u16(b + 2));
        int g = e >> 5, l = e & 31;
        uint32_t sc, mn;
        k_scale_min(b + 4, g, &sc, &mn);
        const float dg = d * (float)sc, mg = dmin * (float)mn;
        uint32_t v = ((b[48 + (g >> 1) * 32 + l] >> ((g & 1) * 4)) & 0x0fu) |
                     (((uint32_t)(b[16 + l] >> g) & 1u) << 4);
        return dg * (float)v - mg;
    } else { /* KILN_DTYPE_Q6_K */
        const float d = fp16_f32(rd_u16(b + 208));
        int h = e >> 7, g = (e >> 5) & 3, l = e & 31;
        const uint8_t *lq = b + h * 64 + (g & 1) * 32;
        const uint8_t *h2 = b + 128 + h * 32;
        int q = (int)(((lq[l] >> ((g >> 1) * 4)) & 0x0fu) | (((uint32_t)(h2[l] >> (g * 2)) & 3u) << 4));
        const float dd = d * (float)(int8_t)b[192 + h * 8 + g * 2 + (l >= 16)];
        return dd * (float)(q - 32);
    }
}

/* Element i of a row of dtype DT (row: its first byte). */
template <int DT>
static __device__ __forceinline__ float deq(const uint8_t *__restrict__ row, int64_t i) {
    return deq_blk<DT>(row + (i / blk<DT>::BS) * blk<DT>::TS, (int)(i % blk<DT>::BS));
}

/* Call F<DT>(args) for the runtime dtype dt (one of kiln_cuda_dtype_supported's). */
#define KILN_CUDA_DTYPE_SWITCH(dt, F, ...)                                                      \
    switch (dt) {                                                                              \
    case KILN_DTYPE_F32: F<KILN_DTYPE_F32>(__VA_ARGS__); break;                                \
    case KILN_DTYPE_F16: F<KILN_DTYPE_F16>(__VA_ARGS__); break;                                \
    case KILN_DTYPE_BF16: F<KILN_DTYPE_BF16>(__VA_ARGS__); break;                              \
    case KILN_DTYPE_Q8_0: F<KILN_DTYPE_Q8_0>(__VA_ARGS__); break;                              \
    case KILN_DTYPE_Q4_0: F<KILN_DTYPE_Q4_0>(__VA_ARGS__); break;                              \
    case KILN_DTYPE_Q4_1: F<KILN_DTYPE_Q4_1>(__VA_ARGS__); break;                              \
    case KILN_DTYPE_Q5_0: F<KILN_DTYPE_Q5_0>(__VA_ARGS__); break;                              \
    case KILN_DTYPE_Q5_1: F<KILN_DTYPE_Q5_1>(__VA_ARGS__); break;                              \
    case KILN_DTYPE_Q4_K: F<KILN_DTYPE_Q4_K>(__VA_ARGS__); break;                              \
    case KILN_DTYPE_Q5_K: F<KILN_DTYPE_Q5_K>(__VA_ARGS__); break;                              \
    case KILN_DTYPE_Q6_K: F<KILN_DTYPE_Q6_K>(__VA_ARGS__); break;                              \
    default: return cudaErrorInvalidValue;                                                     \
    }

#endif /* KILN_CUDA_COMMON_CUH */
