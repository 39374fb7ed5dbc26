/*
 * cuda_adamw.cu -- AdamW, the gradient norm and clipping on the CUDA backend (cuda_train.h),
 * with the CPU's bits: the per-element arithmetic is src/ops/adamw_math.h, the same source
 * cpu_adamw.c runs, and every element is updated alone, as on the CPU, so the thread split cannot
 * change a bit. The step runs over an optimizer's whole tensor table in one launch
 * (kiln_cuda_adamw_step_multi: blocks take (tensor, chunk) pairs from a chunk table uploaded
 * once, f32 moments in quads of 4 elements with 16-byte loads where aligned); it runs
 * update_vals on every element, so it agrees bit for bit with the CPU whatever the split,
 * load width or grid. (One launch per tensor took 1.95 against 0.98 ms a step for the 135M
 * shape's 272 tensors, f32 weights and moments: bench/RESULTS.md, 2026-12-01, 3c12238.) The
 * only reductions are
 *   - the 8-bit block absmax: a max of non-negative, non-NaN values (a NaN |m| is skipped by
 *     the CPU's `b > a` scan starting from 0, here mapped to 0), which has one answer in any
 *     order;
 *   - the gradient norm: torch's 8-lane order, each lane's chain sequential in one thread
 *     (the order is defined, so only the 8 lanes and the P tensors run in parallel); in fast
 *     mode (with a plan) a fixed chunked order in double instead, at memory bandwidth;
 *   - the lowest non-finite index: an atomicMin on integers (order-free).
 * Also the generic helpers of cuda_train.h (is_device, memset).
 */
#include "cuda_common.cuh"
#include "cuda_mma.cuh" /* cp.async */

extern "C" {
#include "cuda_train.h" /* and ../adamw_math.h: the per-element arithmetic, the storage kinds */
}

/* ---- generic ------------------------------------------------------------------------------ */

#define TR_BEGIN(be)                                                                           \
    do {                                                                                       \
        if (!kiln_cuda_begin(be)) return kiln_backend_status(be);                              \
    } while (0)

static kiln_status tr_launched(kiln_backend *be, const char *what) {
    if (!kiln_cuda_check(be, cudaGetLastError(), what)) return kiln_backend_status(be);
    return KILN_OK;
}

static unsigned tr_grid(int64_t total, int threads, int64_t cap) {
    int64_t g = (total + threads - 1) / threads;
    if (g > cap) g = cap;
    return (unsigned)(g < 1 ? 1 : g);
}

extern "C" bool kiln_cuda_train_is_device(const void *p) {
    if (!p) return false;
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError(); /* not sticky */
        return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

extern "C" kiln_status kiln_cuda_train_memset(kiln_backend *be, void *p, int byte,
                                              size_t nbytes) {
    TR_BEGIN(be);
    if (nbytes == 0) return KILN_OK;
    if (!kiln_cuda_check(be, cudaMemsetAsync(p, byte, nbytes, kiln_cuda_stream(be)),
                         "cudaMemsetAsync"))
        return kiln_backend_status(be);
    return KILN_OK;
}

/* ---- the step ------------------------------------------------------------------------------ */

/* Element e of a parameter on its values: cpu_adamw.c's update_range body for storage W.
 * w32 is the f32 weight (F32), w16 the bf16 weight (the bf16 variants), master the f32 master
 * (BF16_MASTER), comp the bf16 compensation (BF16_KAHAN); the arguments W does not use are
 * neither read nor written. g the gradient, *m, *v the f32 moments. key: mix64(sr_key + param
 * index) (stochastic rounding only). decay: already and-ed with use_wd. */
template <int W>
static __device__ __forceinline__ void update_vals(const kiln_adamw_scalars &s, int decay,
                                                   uint64_t key, int64_t e, float g, float &w32,
                                                   uint16_t &w16, float &master, uint16_t &comp,
                                                   float *m, float *v) {
    if (W == KILN_ADAMW_F32) {
        w32 = kiln_adamw_update(&s, decay, w32, g, m, v);
    } else if (W == KILN_ADAMW_BF16_MASTER) {
        const float x = kiln_adamw_update(&s, decay, master, g, m, v);
        master = x;
        w16 = kiln_adamw_f32_bf16(x);
    } else if (W == KILN_ADAMW_BF16_KAHAN) {
        float x = kiln_adamw_bf16_f32(w16) + kiln_adamw_bf16_f32(comp);
        x = kiln_adamw_update(&s, decay, x, g, m, v);
        const uint16_t nw = kiln_adamw_f32_bf16(x);
        w16 = nw;
        comp = kiln_adamw_f32_bf16(x - kiln_adamw_bf16_f32(nw));
    } else { /* KILN_ADAMW_BF16_SR */
        const float x = kiln_adamw_update(&s, decay, kiln_adamw_bf16_f32(w16), g, m, v);
        w16 = kiln_adamw_bf16_stochastic(x, kiln_adamw_sr_bits(key, (uint64_t)e));
    }
}

/* Element e of the parameter p's arrays that storage W reads (the gradient, the weight, and
 * the master or compensation), into registers; the rest stay zero. */
template <int W>
static __device__ __forceinline__ void load_elem(const kiln_cuda_adamw_param &p, int64_t e,
                                                 float &g, float &w32, uint16_t &w16,
                                                 float &master, uint16_t &comp) {
    g = p.grad[e];
    w32 = 0.0f, master = 0.0f, w16 = 0, comp = 0;
    if (W == KILN_ADAMW_F32) w32 = ((const float *)p.weights)[e];
    else if (W != KILN_ADAMW_BF16_MASTER) w16 = ((const uint16_t *)p.weights)[e];
    if (W == KILN_ADAMW_BF16_MASTER) master = p.master[e];
    if (W == KILN_ADAMW_BF16_KAHAN) comp = p.comp[e];
}

/* Element e's updated weight (and the bf16 copy w16, the master or the compensation) back. */
template <int W>
static __device__ __forceinline__ void store_elem(const kiln_cuda_adamw_param &p, int64_t e,
                                                  float w32, uint16_t w16, float master,
                                                  uint16_t comp) {
    if (W == KILN_ADAMW_F32) ((float *)p.weights)[e] = w32;
    else ((uint16_t *)p.weights)[e] = w16;
    if (W == KILN_ADAMW_F32 && p.w16) p.w16[e] = kiln_bf16_rne(w32);
    if (W == KILN_ADAMW_BF16_MASTER) p.master[e] = master;
    if (W == KILN_ADAMW_BF16_KAHAN) p.comp[e] = comp;
}

/* Element e of the parameter p (p.decay already and-ed with use_wd), with its f32 moments at
 * *m, *v (global memory). */
template <int W>
static __device__ __forceinline__ void update_elem(const kiln_adamw_scalars &s,
                                                   const kiln_cuda_adamw_param &p, uint64_t key,
                                                   int64_t e, float *m, float *v) {
    float g, w32, master;
    uint16_t w16, comp;
    load_elem<W>(p, e, g, w32, w16, master, comp);
    update_vals<W>(s, p.decay, key, e, g, w32, w16, master, comp, m, v);
    store_elem<W>(p, e, w32, w16, master, comp);
}

/* Whether the arrays of p (f32 moments) that storage W touches allow quad loads: the f32 ones
 * 16-byte aligned, the bf16 ones 8-byte aligned (quads start at multiples of 4). */
template <int W>
static __device__ __forceinline__ bool quad_aligned(const kiln_cuda_adamw_param &p) {
    uintptr_t a16 = (uintptr_t)p.grad | (uintptr_t)p.m | (uintptr_t)p.v, a8 = 0;
    if (W == KILN_ADAMW_F32) a16 |= (uintptr_t)p.weights, a8 |= (uintptr_t)p.w16;
    else a8 |= (uintptr_t)p.weights;
    if (W == KILN_ADAMW_BF16_MASTER) a16 |= (uintptr_t)p.master;
    if (W == KILN_ADAMW_BF16_KAHAN) a8 |= (uintptr_t)p.comp;
    return (a16 & 15u) == 0 && (a8 & 7u) == 0;
}

/* Elements q .. q + 3 of p with f32 moments (quad_aligned(p), q a multiple of 4, q + 3 < n):
 * one 16-byte (f32) or 8-byte (bf16) load and store per array, then update_vals on each
 * element in order -- the same operations on the same values as update_elem. The loads and
 * stores are streaming (ld/st.global.cs): every byte is touched once per step. */
template <int W>
static __device__ __forceinline__ void update_quad(const kiln_adamw_scalars &s,
                                                   const kiln_cuda_adamw_param &p, uint64_t key,
                                                   int64_t q) {
    const float4 g4 = __ldcs((const float4 *)(p.grad + q));
    const float4 m4 = __ldcs((const float4 *)(p.m + q)), v4 = __ldcs((const float4 *)(p.v + q));
    const float g[4] = {g4.x, g4.y, g4.z, g4.w};
    float m[4] = {m4.x, m4.y, m4.z, m4.w}, v[4] = {v4.x, v4.y, v4.z, v4.w};
    float w32[4] = {0.0f, 0.0f, 0.0f, 0.0f}, master[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    uint16_t w16[4] = {0, 0, 0, 0}, comp[4] = {0, 0, 0, 0};
    float *const wf = (float *)p.weights;
    uint16_t *const wh = (uint16_t *)p.weights;
    if (W == KILN_ADAMW_F32) {
        const float4 x = __ldcs((const float4 *)(wf + q));
        w32[0] = x.x, w32[1] = x.y, w32[2] = x.z, w32[3] = x.w;
    } else if (W != KILN_ADAMW_BF16_MASTER) { /* the master's update does not read them */
        const ushort4 x = __ldcs((const ushort4 *)(wh + q));
        w16[0] = x.x, w16[1] = x.y, w16[2] = x.z, w16[3] = x.w;
    }
    if (W == KILN_ADAMW_BF16_MASTER) {
        const float4 x = __ldcs((const float4 *)(p.master + q));
        master[0] = x.x, master[1] = x.y, master[2] = x.z, master[3] = x.w;
    }
    if (W == KILN_ADAMW_BF16_KAHAN) {
        const ushort4 x = __ldcs((const ushort4 *)(p.comp + q));
        comp[0] = x.x, comp[1] = x.y, comp[2] = x.z, comp[3] = x.w;
    }
#pragma unroll
    for (int k = 0; k < 4; k++)
        update_vals<W>(s, p.decay, key, q + k, g[k], w32[k], w16[k], master[k], comp[k], &m[k],
                       &v[k]);
    __stcs((float4 *)(p.m + q), make_float4(m[0], m[1], m[2], m[3]));
    __stcs((float4 *)(p.v + q), make_float4(v[0], v[1], v[2], v[3]));
    if (W == KILN_ADAMW_F32)
        __stcs((float4 *)(wf + q), make_float4(w32[0], w32[1], w32[2], w32[3]));
    else
        __stcs((ushort4 *)(wh + q), make_ushort4(w16[0], w16[1], w16[2], w16[3]));
    if (W == KILN_ADAMW_F32 && p.w16) /* the caller's bf16 copy (quad_aligned checked it) */
        __stcs((ushort4 *)(p.w16 + q),
               make_ushort4(kiln_bf16_rne(w32[0]), kiln_bf16_rne(w32[1]), kiln_bf16_rne(w32[2]),
                            kiln_bf16_rne(w32[3])));
    if (W == KILN_ADAMW_BF16_MASTER)
        __stcs((float4 *)(p.master + q), make_float4(master[0], master[1], master[2], master[3]));
    if (W == KILN_ADAMW_BF16_KAHAN)
        __stcs((ushort4 *)(p.comp + q), make_ushort4(comp[0], comp[1], comp[2], comp[3]));
}

/* The table entry of a multi-tensor chunk, its decay and-ed with use_wd, and its key. */
static __device__ __forceinline__ kiln_cuda_adamw_param multi_entry(
    const kiln_cuda_adamw_param *table, int32_t param, const kiln_adamw_scalars &s,
    uint64_t *key) {
    kiln_cuda_adamw_param p = table[param];
    p.decay = p.decay && s.use_wd;
    *key = kiln_adamw_mix64(s.sr_key + (uint64_t)p.param_index);
    return p;
}

/* f32 moments, every tensor of a plan: block b takes chunks b, b + gridDim.x, ...; in a chunk,
 * thread t the quads at 4 t, 4 t + 4 MULTI_THREADS, ... from its start (update_quad when the
 * entry is quad_aligned and the quad whole, else update_elem on its elements). */
#define MULTI_THREADS 256
static_assert(KILN_CUDA_ADAMW_CHUNK % (4 * MULTI_THREADS) == 0, "a chunk is whole sweeps");

template <int W>
static __global__ void __launch_bounds__(MULTI_THREADS)
adamw_f32_multi_kernel(const kiln_cuda_adamw_param *table, const kiln_cuda_adamw_chunk *chunk,
                       int64_t n_chunks, kiln_adamw_scalars s) {
    for (int64_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const kiln_cuda_adamw_chunk ck = chunk[c];
        uint64_t key;
        const kiln_cuda_adamw_param p = multi_entry(table, ck.param, s, &key);
        const int64_t c0 = (int64_t)ck.index * KILN_CUDA_ADAMW_CHUNK;
        const int64_t end = p.n < c0 + KILN_CUDA_ADAMW_CHUNK ? p.n : c0 + KILN_CUDA_ADAMW_CHUNK;
        const bool vec = quad_aligned<W>(p);
        for (int64_t q = c0 + 4 * (int64_t)threadIdx.x; q < end; q += 4 * MULTI_THREADS) {
            if (vec && q + 4 <= end) {
                update_quad<W>(s, p, key, q);
            } else {
                for (int64_t e = q; e < q + 4 && e < end; e++)
                    update_elem<W>(s, p, key, e, &p.m[e], &p.v[e]);
            }
        }
    }
}

/* 8-bit moments: one WARP per block of KILN_ADAMW_Q8_BLOCK elements (lane l: elements l, l +
 * 32, ... of the block, coalesced), 8 warps a thread block. Each lane loads all of its
 * elements first (so they are in flight together), dequantizes and updates them in f32, the
 * block's absmax of the new m and v comes from the warp's shuffles, then the lane requantizes
 * -- cpu_adamw.c's step_task, element for element. The absmax is a max of non-negative non-NaN
 * values, exact in any order, so the codes and scales are the CPU's. (It was a 256-thread
 * block per 8-bit block with three barriers, a third slower than the f32 moments it shrinks.) */
#define Q8_THREADS 256
#define Q8_WARPS (Q8_THREADS / 32)
#define Q8_PER_LANE (KILN_ADAMW_Q8_BLOCK / 32)
static_assert(KILN_ADAMW_Q8_BLOCK % 32 == 0, "whole lanes per 8-bit block");
static_assert(KILN_CUDA_ADAMW_CHUNK % KILN_ADAMW_Q8_BLOCK == 0, "8-bit blocks inside chunks");
#define Q8_PER_CHUNK (KILN_CUDA_ADAMW_CHUNK / KILN_ADAMW_Q8_BLOCK)

static __device__ __forceinline__ float max_nonneg(float a, float b) { return b > a ? b : a; }

/* 8-bit block b of p by the calling warp (p.decay already and-ed). */
template <int W>
static __device__ __forceinline__ void q8_block(const kiln_adamw_scalars &s,
                                                const kiln_cuda_adamw_param &p, uint64_t key,
                                                int64_t b) {
    const int lane = threadIdx.x & 31;
    const int64_t b0 = b * KILN_ADAMW_Q8_BLOCK;
    const int len = (int)(p.n - b0 < KILN_ADAMW_Q8_BLOCK ? p.n - b0 : KILN_ADAMW_Q8_BLOCK);
    const float sm = p.ms[b], sv = p.vs[b];
    float g[Q8_PER_LANE], w32[Q8_PER_LANE], master[Q8_PER_LANE];
    float m[Q8_PER_LANE], v[Q8_PER_LANE];
    uint16_t w16[Q8_PER_LANE], comp[Q8_PER_LANE];
    uint8_t mc[Q8_PER_LANE], vc[Q8_PER_LANE];
#pragma unroll
    for (int k = 0; k < Q8_PER_LANE; k++) {
        const int i = lane + 32 * k;
        mc[k] = vc[k] = 0;
        g[k] = w32[k] = master[k] = 0.0f, w16[k] = comp[k] = 0;
        if (i < len) {
            load_elem<W>(p, b0 + i, g[k], w32[k], w16[k], master[k], comp[k]);
            mc[k] = p.mq[b0 + i];
            vc[k] = p.vq[b0 + i];
        }
    }
    float am = 0.0f, av = 0.0f;
#pragma unroll
    for (int k = 0; k < Q8_PER_LANE; k++) {
        const int i = lane + 32 * k;
        m[k] = v[k] = 0.0f;
        if (i < len) {
            m[k] = kiln_adamw_q8_m(mc[k], sm);
            v[k] = kiln_adamw_q8_v(vc[k], sv);
            update_vals<W>(s, p.decay, key, b0 + i, g[k], w32[k], w16[k], master[k], comp[k],
                           &m[k], &v[k]);
            store_elem<W>(p, b0 + i, w32[k], w16[k], master[k], comp[k]);
        }
        /* |m|, |v| with NaN (and the absent tail) as 0: the CPU's scan from 0 skips NaN */
        const float a = fabsf(m[k]), c = fabsf(v[k]);
        am = max_nonneg(am, a > 0.0f ? a : 0.0f);
        av = max_nonneg(av, c > 0.0f ? c : 0.0f);
    }
#pragma unroll
    for (int d = 16; d >= 1; d >>= 1) {
        am = max_nonneg(am, __shfl_xor_sync(0xffffffffu, am, d));
        av = max_nonneg(av, __shfl_xor_sync(0xffffffffu, av, d));
    }
    /* every lane read ms[b], vs[b] above, before the shuffles that lane 0 waited on */
    if (lane == 0) {
        p.ms[b] = am;
        p.vs[b] = av;
    }
#pragma unroll
    for (int k = 0; k < Q8_PER_LANE; k++) {
        const int i = lane + 32 * k;
        if (i < len) {
            p.mq[b0 + i] = kiln_adamw_q8_mcode(m[k], am);
            p.vq[b0 + i] = kiln_adamw_q8_vcode(v[k], av);
        }
    }
}

/* 8-bit moments, every tensor of a plan: unit u = chunk u / Q8_PER_CHUNK, 8-bit block
 * u % Q8_PER_CHUNK inside it (units past a parameter's end do nothing); warp w of block x
 * takes units x Q8_WARPS + w, then that plus gridDim.x Q8_WARPS, ... (uniform per warp). */
template <int W>
static __global__ void __launch_bounds__(Q8_THREADS)
adamw_q8_multi_kernel(const kiln_cuda_adamw_param *table, const kiln_cuda_adamw_chunk *chunk,
                      int64_t n_units, kiln_adamw_scalars s) {
    for (int64_t u = (int64_t)blockIdx.x * Q8_WARPS + (threadIdx.x >> 5); u < n_units;
         u += (int64_t)gridDim.x * Q8_WARPS) {
        const kiln_cuda_adamw_chunk ck = chunk[u / Q8_PER_CHUNK];
        uint64_t key;
        const kiln_cuda_adamw_param p = multi_entry(table, ck.param, s, &key);
        const int64_t b = (int64_t)ck.index * Q8_PER_CHUNK + u % Q8_PER_CHUNK;
        if (b * KILN_ADAMW_Q8_BLOCK < p.n) q8_block<W>(s, p, key, b);
    }
}

template <int W>
static void adamw_multi_launch(cudaStream_t st, const kiln_cuda_adamw_plan &pl,
                               const kiln_adamw_scalars &s) {
    if (pl.q8) {
        const int64_t units = pl.n_chunks * Q8_PER_CHUNK;
        adamw_q8_multi_kernel<W><<<tr_grid(units, Q8_WARPS, 1 << 20), Q8_THREADS, 0, st>>>(
            pl.table, pl.chunk, units, s);
    } else {
        adamw_f32_multi_kernel<W><<<tr_grid(pl.n_chunks, 1, 1 << 20), MULTI_THREADS, 0, st>>>(
            pl.table, pl.chunk, pl.n_chunks, s);
    }
}

extern "C" kiln_status kiln_cuda_adamw_step_multi(kiln_backend *be,
                                                  const kiln_cuda_adamw_plan *plan,
                                                  const kiln_adamw_scalars *s) {
    TR_BEGIN(be);
    if (!plan || plan->n_chunks < 0 || plan->n_chunks > INT32_MAX ||
        (plan->n_chunks > 0 && (!plan->table || !plan->chunk)))
        return kiln_cuda_fail(be, KILN_ERR_INVALID_ARG, "adamw multi-tensor step: invalid plan");
    if (plan->n_chunks == 0) return KILN_OK;
    cudaStream_t st = kiln_cuda_stream(be);
    switch (plan->weights_kind) {
    case KILN_ADAMW_F32: adamw_multi_launch<KILN_ADAMW_F32>(st, *plan, *s); break;
    case KILN_ADAMW_BF16_MASTER: adamw_multi_launch<KILN_ADAMW_BF16_MASTER>(st, *plan, *s); break;
    case KILN_ADAMW_BF16_KAHAN: adamw_multi_launch<KILN_ADAMW_BF16_KAHAN>(st, *plan, *s); break;
    case KILN_ADAMW_BF16_SR: adamw_multi_launch<KILN_ADAMW_BF16_SR>(st, *plan, *s); break;
    default:
        return kiln_cuda_fail(be, KILN_ERR_INVALID_ARG,
                              "adamw multi-tensor step: weight storage %d", plan->weights_kind);
    }
    return tr_launched(be, "adamw multi-tensor step");
}

static __global__ void widen_bf16_kernel(float *master, const uint16_t *w, int64_t n) {
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (int64_t)gridDim.x * blockDim.x)
        master[e] = kiln_adamw_bf16_f32(w[e]);
}

extern "C" kiln_status kiln_cuda_adamw_widen_bf16(kiln_backend *be, float *master,
                                                  const uint16_t *w, int64_t n) {
    TR_BEGIN(be);
    if (n <= 0) return KILN_OK;
    widen_bf16_kernel<<<tr_grid(n, 256, 1 << 20), 256, 0, kiln_cuda_stream(be)>>>(master, w, n);
    return tr_launched(be, "adamw widen bf16");
}

/* ---- finite check, norms, scaling ----------------------------------------------------------- */

/* grid (x: element blocks, y: parameter). */
static __global__ void nonfinite_kernel(const kiln_cuda_grad_entry *table, uint64_t *bad) {
    const kiln_cuda_grad_entry t = table[blockIdx.y];
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < t.n;
         e += (int64_t)gridDim.x * blockDim.x)
        if ((__float_as_uint(t.grad[e]) & 0x7f800000u) == 0x7f800000u) {
            atomicMin((unsigned long long *)&bad[blockIdx.y], (unsigned long long)e);
            break; /* this thread's later elements are higher */
        }
}

extern "C" kiln_status kiln_cuda_adamw_nonfinite(kiln_backend *be,
                                                 const kiln_cuda_grad_entry *table, int P,
                                                 int64_t max_n, uint64_t *bad) {
    TR_BEGIN(be);
    if (P <= 0) return KILN_OK;
    if (P > 65535)
        return kiln_cuda_fail(be, KILN_ERR_UNSUPPORTED, "adamw: %d parameters > 65535", P);
    cudaStream_t st = kiln_cuda_stream(be);
    if (!kiln_cuda_check(be, cudaMemsetAsync(bad, 0xff, (size_t)P * sizeof(uint64_t), st),
                         "adamw nonfinite: cudaMemsetAsync"))
        return kiln_backend_status(be);
    nonfinite_kernel<<<dim3(tr_grid(max_n, 256, 256), (unsigned)P), 256, 0, st>>>(table, bad);
    return tr_launched(be, "adamw nonfinite");
}

/* One 32-thread block per tensor: lane j < 8 runs torch's lane j (acc = acc + x*x over
 * elements 8k + j of the full groups, sequentially), then lane 0 adds the 8 lanes in order and
 * the tail, as adamw_math.h's kiln_adamw_sumsq8. The lanes' chains are sequential by
 * definition (an add's latency an element: the embedding's 136M elements are 17M adds a lane),
 * so the speed is in feeding them with as little else on the warp's path as possible: the whole
 * warp streams the tensor through a ring of NORM_STAGES shared stages of NORM_STAGE floats
 * (cp.async, 16 bytes a copy where the tensor is 16-byte aligned, else 4), NORM_STAGES - 1
 * stages in flight ahead of the one lanes 0-7 are adding; a stage is 128 adds a lane, so the
 * copies, the waits and the loads of a stage (issued before its adds) cost little beside
 * them. The stage a step refills is the one the step before consumed. */
#define NORM_STAGE 1024
#define NORM_STAGES 11

/* Copy stage s (elements [s NORM_STAGE, ...) of the head) into its slot, lane l taking every
 * 32nd run of V floats; then close the group (empty when s is past the end). */
template <int V>
static __device__ __forceinline__ void norm_issue(float (*ring)[NORM_STAGE], const float *g,
                                                  int64_t head, int64_t n_st, int64_t s,
                                                  int j) {
    if (s < n_st) {
        const int64_t d0 = s * NORM_STAGE;
        float *dst = ring[s % NORM_STAGES];
#pragma unroll
        for (int u = 0; u < NORM_STAGE / (32 * V); u++) {
            const int off = (u * 32 + j) * V;
            if (d0 + off < head) { /* head and d0 are multiples of 8: the run is whole */
                if (V == 4) cp_async16(dst + off, g + d0 + off);
                else cp_async4(dst + off, g + d0 + off);
            }
        }
    }
    cp_async_commit();
}

template <int V>
static __device__ __forceinline__ float norm_lane_sum(const float *g, int64_t head, int j,
                                                      float (*ring)[NORM_STAGE]) {
    const int64_t n_st = (head + NORM_STAGE - 1) / NORM_STAGE;
    for (int64_t s = 0; s < NORM_STAGES - 1; s++) norm_issue<V>(ring, g, head, n_st, s, j);
    float acc = 0.0f;
    for (int64_t s = 0; s < n_st; s++) {
        cp_async_wait<NORM_STAGES - 2>(); /* stage s is here (this lane's copies) */
        __syncwarp();                     /* ... and every lane's */
        /* refill the slot of stage s - 1, read by the step before */
        norm_issue<V>(ring, g, head, n_st, s + NORM_STAGES - 1, j);
        if (j < 8) {
            const float *st = ring[s % NORM_STAGES];
            const int64_t left = head - s * NORM_STAGE;
            if (left >= NORM_STAGE) {
                float x[NORM_STAGE / 8];
#pragma unroll
                for (int u = 0; u < NORM_STAGE / 8; u++) x[u] = st[8 * u + j];
#pragma unroll
                for (int u = 0; u < NORM_STAGE / 8; u++) acc = acc + x[u] * x[u];
            } else {
                const int groups = (int)(left / 8);
                for (int u = 0; u < groups; u++) acc = acc + st[8 * u + j] * st[8 * u + j];
            }
        }
        __syncwarp(); /* lanes 0-7 have read stage s: the next step refills its slot */
    }
    cp_async_wait<0>();
    return acc;
}

static __global__ void __launch_bounds__(32) norms_kernel(const kiln_cuda_grad_entry *table,
                                                          float *norms) {
    __shared__ __align__(16) float ring[NORM_STAGES][NORM_STAGE];
    __shared__ float acc8[8];
    const kiln_cuda_grad_entry t = table[blockIdx.x];
    const int j = threadIdx.x;
    const int64_t head = t.n - t.n % 8;
    const float acc = ((uintptr_t)t.grad & 15u) == 0 ? norm_lane_sum<4>(t.grad, head, j, ring)
                                                     : norm_lane_sum<1>(t.grad, head, j, ring);
    if (j < 8) acc8[j] = acc;
    __syncthreads();
    if (j == 0) {
        float s = acc8[0];
        for (int k = 1; k < 8; k++) s = s + acc8[k];
        for (int64_t d = head; d < t.n; d++) s = s + t.grad[d] * t.grad[d];
        norms[blockIdx.x] = sqrtf(s);
    }
}

/* Fast mode (cuda_train.h's kiln_cuda_norm_plan). Stage 1: one block per chunk of
 * KILN_CUDA_NORM_CHUNK elements. In step s of the chunk (NORM_STEP elements), thread t takes
 * the quads at s + u * NORM_THREADS * 4 + 4 t for u = 0 .. NORM_QUADS - 1 and adds their
 * squares, element by element in index order, to its double acc (a float squared is exact in
 * double, so only the additions round); elements past the end read as 0, which adds nothing
 * (acc >= +0 or NaN). A 16-byte-aligned grad loads each whole quad as one float4, otherwise
 * element by element: the same values in the same order, so the bits depend only on the
 * gradient, not on its address. The threads' sums then go through norm_block_sum's fixed
 * tree into partial[chunk]. Stage 2: one block per parameter, thread t summing partials
 * first[p] + t, + t + NORM_THREADS, ... in order, the same tree, norms[p] = (float)sqrt. */
#define NORM_THREADS 256
#define NORM_QUADS 4 /* float4 loads in flight per thread and step */
#define NORM_STEP (NORM_THREADS * 4 * NORM_QUADS)
static_assert(KILN_CUDA_NORM_CHUNK % NORM_STEP == 0, "a chunk is whole steps");
static_assert(NORM_THREADS % 32 == 0 && NORM_THREADS <= 1024, "whole warps");

/* The block's sum of v in a fixed order: within each warp shuffles down by 16, 8, 4, 2, 1
 * (lane 0 ends with its warp's sum), then thread 0 adds the warps' sums in warp order.
 * Valid in thread 0 only. Every thread of the block must call it (one __syncthreads). */
static __device__ __forceinline__ double norm_block_sum(double v, double *warp_sum) {
#pragma unroll
    for (int d = 16; d >= 1; d >>= 1) v = v + __shfl_down_sync(0xffffffffu, v, d);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sum[warp] = v;
    __syncthreads();
    double s = 0.0;
    if (threadIdx.x == 0) {
        s = warp_sum[0];
        for (int w = 1; w < NORM_THREADS / 32; w++) s = s + warp_sum[w];
    }
    return s;
}

static __global__ void __launch_bounds__(NORM_THREADS)
norm_partial_kernel(const kiln_cuda_grad_entry *table, const kiln_cuda_norm_chunk *chunk,
                    double *partial) {
    __shared__ double warp_sum[NORM_THREADS / 32];
    const kiln_cuda_norm_chunk ck = chunk[blockIdx.x];
    const kiln_cuda_grad_entry t = table[ck.param];
    const float *g = t.grad;
    const int64_t c0 = (int64_t)ck.index * KILN_CUDA_NORM_CHUNK;
    const int64_t end = t.n < c0 + KILN_CUDA_NORM_CHUNK ? t.n : c0 + KILN_CUDA_NORM_CHUNK;
    const bool vec = ((uintptr_t)g & 15u) == 0; /* c0 and every quad start are multiples of 4 */
    double acc = 0.0;
    for (int64_t s = c0; s < end; s += NORM_STEP) {
        float x[NORM_QUADS][4];
#pragma unroll
        for (int u = 0; u < NORM_QUADS; u++) {
            const int64_t q = s + (int64_t)u * (NORM_THREADS * 4) + 4 * (int64_t)threadIdx.x;
            if (vec && q + 4 <= end) {
                const float4 v = __ldg((const float4 *)(g + q));
                x[u][0] = v.x;
                x[u][1] = v.y;
                x[u][2] = v.z;
                x[u][3] = v.w;
            } else {
#pragma unroll
                for (int k = 0; k < 4; k++) x[u][k] = q + k < end ? g[q + k] : 0.0f;
            }
        }
#pragma unroll
        for (int u = 0; u < NORM_QUADS; u++)
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const double d = (double)x[u][k];
                acc = acc + d * d;
            }
    }
    const double sum = norm_block_sum(acc, warp_sum);
    if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

static __global__ void __launch_bounds__(NORM_THREADS)
norm_combine_kernel(const int32_t *first, const double *partial, float *norms) {
    __shared__ double warp_sum[NORM_THREADS / 32];
    const int p = blockIdx.x;
    const int32_t b = first[p], e = first[p + 1];
    double acc = 0.0;
    for (int32_t c = b + (int32_t)threadIdx.x; c < e; c += NORM_THREADS) acc = acc + partial[c];
    const double sum = norm_block_sum(acc, warp_sum);
    if (threadIdx.x == 0) norms[p] = (float)sqrt(sum);
}

static __global__ void total_kernel(const float *norms, int P, float *out, int clip,
                                    float max_norm_f) {
    const float sq = kiln_adamw_sumsq8(norms, P);
    const float total = sqrtf(sq);
    out[0] = sq;
    out[1] = total;
    if (clip) out[2] = kiln_adamw_clip_coef(total, max_norm_f);
}

extern "C" kiln_status kiln_cuda_adamw_norms(kiln_backend *be, const kiln_cuda_grad_entry *table,
                                             int P, const kiln_cuda_norm_plan *plan,
                                             float *norms, float *out, int clip,
                                             float max_norm_f) {
    TR_BEGIN(be);
    if (P <= 0) return KILN_OK;
    cudaStream_t st = kiln_cuda_stream(be);
    if (plan && kiln_cuda_is_fast(be)) {
        if (!plan->chunk || !plan->first || !plan->partial || plan->n_chunks < 0 ||
            plan->n_chunks > INT32_MAX)
            return kiln_cuda_fail(be, KILN_ERR_INVALID_ARG,
                                  "adamw norms: invalid plan (%lld chunks)",
                                  (long long)plan->n_chunks);
        if (plan->n_chunks > 0) {
            norm_partial_kernel<<<(unsigned)plan->n_chunks, NORM_THREADS, 0, st>>>(
                table, plan->chunk, plan->partial);
            KILN_TRY(tr_launched(be, "adamw norms (fast, chunks)"));
        }
        norm_combine_kernel<<<(unsigned)P, NORM_THREADS, 0, st>>>(plan->first, plan->partial,
                                                                   norms);
        KILN_TRY(tr_launched(be, "adamw norms (fast, tensors)"));
    } else {
        norms_kernel<<<(unsigned)P, 32, 0, st>>>(table, norms);
        KILN_TRY(tr_launched(be, "adamw norms"));
    }
    total_kernel<<<1, 1, 0, st>>>(norms, P, out, clip, max_norm_f);
    return tr_launched(be, "adamw total norm");
}

static __global__ void scale_kernel(const kiln_cuda_grad_entry *table, const float *coef) {
    const kiln_cuda_grad_entry t = table[blockIdx.y];
    const float c = *coef;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < t.n;
         e += (int64_t)gridDim.x * blockDim.x)
        t.grad[e] = t.grad[e] * c;
}

extern "C" kiln_status kiln_cuda_adamw_scale(kiln_backend *be, const kiln_cuda_grad_entry *table,
                                             int P, int64_t max_n, const float *coef) {
    TR_BEGIN(be);
    if (P <= 0) return KILN_OK;
    if (P > 65535)
        return kiln_cuda_fail(be, KILN_ERR_UNSUPPORTED, "adamw: %d parameters > 65535", P);
    scale_kernel<<<dim3(tr_grid(max_n, 256, 1024), (unsigned)P), 256, 0,
                   kiln_cuda_stream(be)>>>(table, coef);
    return tr_launched(be, "adamw clip scale");
}
