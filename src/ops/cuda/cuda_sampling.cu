/*
 * cuda_sampling.cu -- the device sampler (cuda_sampling.h says how it follows
 * docs/ARITHMETIC.md "Sampling"). Three layers: the kernels, the launch sequence
 * (kiln_cuda_sample: validation, then only enqueues), and the host-RNG entry
 * (kiln_cuda_sample_next).
 *
 * The ranking is a full radix sort of the V keys with cub (part of the CUDA toolkit): the walk
 * may need any rank up to n - 1 (the CPU's fallback pick), so a sorted prefix of unknown
 * length does not suffice in general. Sorting 151,936 keys of 50 bits is a few passes of a
 * memory-bound kernel; a top-k radix select for small top_k is a later speed-up.
 */
#include "cuda_sampling.h"

#include <cub/device/device_radix_sort.cuh>

#include <stdlib.h>


/* Per-call state, reset by the first kernel of every call. */
typedef struct sampler_state {
    unsigned long long best; /* greedy: minimum key (order bits << 32 | id) */
    int nan;                 /* a NaN logit was seen (after the penalty) */
    int pad;
} sampler_state;

struct kiln_cuda_sampler {
    int cap;                  /* max_vocab */
    float *l;                 /* (cap) penalised logits / temperature */
    float *q;                 /* (cap) p_i, then p_i / sum, in rank order */
    unsigned long long *keys; /* (cap) unsorted keys */
    unsigned long long *sorted; /* (cap) keys in rank order */
    uint8_t *marks;           /* (cap) penalty marks; all 0 between calls */
    sampler_state *state;     /* (1) */
    void *sort_tmp;           /* cub's temporary storage */
    size_t sort_bytes;
};

#define SAMPLER_PREP_THREADS 256
#define SAMPLER_MAIN_THREADS 256
#define SAMPLER_MAIN_MAX_BLOCKS 1024
#define SAMPLER_WALK_THREADS 1024

/* ---- kernels ------------------------------------------------------------------------------ */

/* One block: reset the per-call state; mark the ids of history[start..n_history) in [0, V).
 * Several threads may write 1 to the same mark: the value is the same, and the elementwise
 * pass (next kernel on the stream) applies each marked id's penalty once. */
static __global__ void sampler_prep_kernel(sampler_state *st, uint8_t *marks,
                                           const int32_t *history, int start, int n_history,
                                           int V) {
    if (threadIdx.x == 0) {
        st->best = ~0ull;
        st->nan = 0;
    }
    for (int j = start + (int)threadIdx.x; j < n_history; j += (int)blockDim.x) {
        int32_t id = history[j];
        if (id >= 0 && id < V) marks[id] = 1;
    }
}

static __device__ unsigned long long warp_min_u64(unsigned long long v) {
    for (int off = 16; off > 0; off >>= 1) {
        unsigned long long o = __shfl_down_sync(0xffffffffu, v, off);
        v = o < v ? o : v;
    }
    return v;
}

/* Elementwise over the V logits (grid-stride): the penalty of marked ids (clearing the mark),
 * the NaN check, then greedy: the block's minimum key into st->best by atomicMin (the minimum
 * of a set does not depend on the order of combination); sampling: l = v / temperature and
 * its rank key. */
static __global__ void sampler_main_kernel(const float *__restrict__ logits, int V,
                                           uint8_t *__restrict__ marks, float penalty,
                                           int greedy, float temperature, int id_bits,
                                           float *__restrict__ l_out,
                                           unsigned long long *__restrict__ keys,
                                           sampler_state *st) {
    __shared__ unsigned long long warp_best[SAMPLER_MAIN_THREADS / 32];
    unsigned long long best = ~0ull;
    int nan = 0;
    for (int i = (int)(blockIdx.x * blockDim.x + threadIdx.x); i < V;
         i += (int)(gridDim.x * blockDim.x)) {
        float v = logits[i];
        if (marks[i]) {
            marks[i] = 0;
            v = v > 0.0f ? v / penalty : v * penalty;
        }
        if (v != v) nan = 1;
        if (greedy) {
            unsigned long long k = kiln_sample_key(v, i, 32);
            best = k < best ? k : best;
        } else {
            float l = v / temperature;
            l_out[i] = l;
            keys[i] = kiln_sample_key(l, i, id_bits);
        }
    }
    if (nan) st->nan = 1;
    if (!greedy) return; /* uniform across the block */
    best = warp_min_u64(best);
    int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
    if (lane == 0) warp_best[warp] = best;
    __syncthreads();
    if (warp == 0) {
        best = lane < (int)(blockDim.x >> 5) ? warp_best[lane] : ~0ull;
        best = warp_min_u64(best);
        if (lane == 0 && best != ~0ull) atomicMin(&st->best, best);
    }
}

static __global__ void sampler_greedy_finish_kernel(const sampler_state *st, int32_t *d_token) {
    if (threadIdx.x == 0 && blockIdx.x == 0)
        *d_token = st->nan ? -1 : (int32_t)(uint32_t)(st->best & 0xffffffffull);
}

static __device__ __forceinline__ int32_t key_id(unsigned long long k, unsigned long long id_mask) {
    return (int32_t)(k & id_mask);
}

/* One block walks the ranking (cuda_sampling.h, step 4). n: the top-k count (1..V). */
static __global__ void __launch_bounds__(SAMPLER_WALK_THREADS)
sampler_walk_kernel(const float *__restrict__ l, const unsigned long long *__restrict__ sorted,
                    int id_bits, int n, float top_p, float min_p, float u, const float *d_u,
                    float *q, const sampler_state *st, int32_t *d_token) {
    __shared__ float s_mx, s_sum;
    __shared__ int s_m;
    if (st->nan) { /* the same value for every thread: the block leaves together */
        if (threadIdx.x == 0) *d_token = -1;
        return;
    }
    const unsigned long long id_mask = (id_bits >= 64) ? ~0ull : ((1ull << id_bits) - 1ull);
    const int tid = (int)threadIdx.x;
    if (tid == 0) {
        float mx = l[key_id(sorted[0], id_mask)];
        int m = n;
        if (mx - mx == 0.0f) {
            /* finite mx: first rank in [1, n) whose l - mx < KILN_EXP_LO (kiln_expf gives +0
             * there and at every later rank: l - mx does not increase along the ranking) */
            int lo = 1, hi = n;
            while (lo < hi) {
                int mid = lo + (hi - lo) / 2;
                if (l[key_id(sorted[mid], id_mask)] - mx < KILN_EXP_LO) hi = mid;
                else lo = mid + 1;
            }
            m = lo;
        }
        s_mx = mx;
        s_m = m;
    }
    __syncthreads();
    const float mx = s_mx;
    const int m = s_m;
    for (int i = tid; i < m; i += (int)blockDim.x) q[i] = kiln_expf(l[key_id(sorted[i], id_mask)] - mx);
    __syncthreads();
    if (tid == 0) s_sum = kiln_sample_seq_sum(q, m); /* rank order, one thread */
    __syncthreads();
    const float sum = s_sum;
    for (int i = tid; i < m; i += (int)blockDim.x) q[i] = q[i] / sum;
    __syncthreads();
    if (tid == 0) {
        float uu = d_u ? *d_u : u;
        int pick = kiln_sample_walk(q, m, n, top_p, min_p, uu);
        *d_token = key_id(sorted[pick], id_mask);
    }
}

/* ---- host side ---------------------------------------------------------------------------- */

extern "C" void kiln_cuda_sampler_free(kiln_cuda_sampler *sp) {
    if (!sp) return;
    cudaFree(sp->l);
    cudaFree(sp->q);
    cudaFree(sp->keys);
    cudaFree(sp->sorted);
    cudaFree(sp->marks);
    cudaFree(sp->state);
    cudaFree(sp->sort_tmp);
    free(sp);
}

extern "C" cudaError_t kiln_cuda_sampler_create(int max_vocab, kiln_cuda_sampler **out) {
    if (!out || max_vocab < 1) return cudaErrorInvalidValue;
    *out = NULL;
    kiln_cuda_sampler *sp = (kiln_cuda_sampler *)calloc(1, sizeof *sp);
    if (!sp) return cudaErrorMemoryAllocation;
    sp->cap = max_vocab;
    size_t V = (size_t)max_vocab;
    cudaError_t e = cudaSuccess;
    /* the largest request: cap items over all 64 key bits (a call sorts V <= cap items over
     * 32 + id_bits <= 64 bits; kiln_cuda_sample checks its own request against this) */
    if (e == cudaSuccess)
        e = cub::DeviceRadixSort::SortKeys(NULL, sp->sort_bytes, (const unsigned long long *)NULL,
                                           (unsigned long long *)NULL, max_vocab, 0, 64);
    if (e == cudaSuccess) e = cudaMalloc((void **)&sp->l, V * sizeof(float));
    if (e == cudaSuccess) e = cudaMalloc((void **)&sp->q, V * sizeof(float));
    if (e == cudaSuccess) e = cudaMalloc((void **)&sp->keys, V * sizeof(unsigned long long));
    if (e == cudaSuccess) e = cudaMalloc((void **)&sp->sorted, V * sizeof(unsigned long long));
    if (e == cudaSuccess) e = cudaMalloc((void **)&sp->marks, V);
    if (e == cudaSuccess) e = cudaMalloc((void **)&sp->state, sizeof(sampler_state));
    if (e == cudaSuccess) e = cudaMalloc(&sp->sort_tmp, sp->sort_bytes > 0 ? sp->sort_bytes : 1);
    if (e == cudaSuccess) e = cudaMemset(sp->marks, 0, V);
    if (e == cudaSuccess) e = cudaMemset(sp->state, 0, sizeof(sampler_state));
    if (e == cudaSuccess) e = cudaDeviceSynchronize(); /* the marks are zero before any call */
    if (e != cudaSuccess) {
        kiln_cuda_sampler_free(sp);
        return e;
    }
    *out = sp;
    return cudaSuccess;
}

/* The checks of kiln_sampler_create, plus what the device needs: a finite temperature (an
 * infinite one makes inf / inf = NaN keys, which the CPU's qsort ranks arbitrarily). */
static bool sampler_params_ok(const kiln_sampler_params *p) {
    if (!(p->temperature == p->temperature) || !(p->top_p == p->top_p) || !(p->min_p == p->min_p))
        return false;
    if (p->temperature > 0.0f && !(p->temperature - p->temperature == 0.0f)) return false;
    if (p->top_p <= 0.0f || p->min_p > 1.0f) return false;
    if (!(p->repeat_penalty > 0.0f) || p->repeat_last_n < -1) return false;
    return true;
}

extern "C" cudaError_t kiln_cuda_sample(kiln_cuda_sampler *sp, cudaStream_t s, const float *logits,
                                        int V, const kiln_sampler_params *p,
                                        const int32_t *d_history, int n_history, float u,
                                        const float *d_u, int32_t *d_token, int32_t *h_token) {
    if (!sp || !logits || !p || !d_token || V < 1 || V > sp->cap || n_history < 0)
        return cudaErrorInvalidValue;
    if (!sampler_params_ok(p)) return cudaErrorInvalidValue;
    /* the penalty window, as the CPU computes it */
    int start = n_history;
    if (p->repeat_penalty != 1.0f && n_history > 0) {
        if (!d_history) return cudaErrorInvalidValue;
        start = 0;
        if (p->repeat_last_n >= 0 && n_history > p->repeat_last_n) start = n_history - p->repeat_last_n;
    }
    const int greedy = p->temperature <= 0.0f;
    const int id_bits = kiln_sample_id_bits(V);
    const int end_bit = 32 + id_bits;
    size_t need = 0;
    cudaError_t e = cub::DeviceRadixSort::SortKeys(NULL, need, (const unsigned long long *)NULL,
                                                   (unsigned long long *)NULL, V, 0, end_bit, s);
    if (e != cudaSuccess) return e;
    if (need > sp->sort_bytes) return cudaErrorInvalidValue; /* cannot happen: sized for cap, 64 bits */

    sampler_prep_kernel<<<1, SAMPLER_PREP_THREADS, 0, s>>>(sp->state, sp->marks, d_history, start,
                                                           n_history, V);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    int blocks = (V + SAMPLER_MAIN_THREADS - 1) / SAMPLER_MAIN_THREADS;
    if (blocks > SAMPLER_MAIN_MAX_BLOCKS) blocks = SAMPLER_MAIN_MAX_BLOCKS;
    sampler_main_kernel<<<blocks, SAMPLER_MAIN_THREADS, 0, s>>>(
        logits, V, sp->marks, p->repeat_penalty, greedy, greedy ? 1.0f : p->temperature, id_bits,
        sp->l, sp->keys, sp->state);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    if (greedy) {
        sampler_greedy_finish_kernel<<<1, 32, 0, s>>>(sp->state, d_token);
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
    } else {
        size_t bytes = sp->sort_bytes;
        e = cub::DeviceRadixSort::SortKeys(sp->sort_tmp, bytes, (const unsigned long long *)sp->keys,
                                           sp->sorted, V, 0, end_bit, s);
        if (e != cudaSuccess) return e;
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
        int n = (p->top_k > 0 && p->top_k < V) ? p->top_k : V;
        sampler_walk_kernel<<<1, SAMPLER_WALK_THREADS, 0, s>>>(sp->l, sp->sorted, id_bits, n, p->top_p,
                                                               p->min_p, u, d_u, sp->q, sp->state,
                                                               d_token);
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
    if (h_token) {
        e = cudaMemcpyAsync(h_token, d_token, sizeof(int32_t), cudaMemcpyDeviceToHost, s);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

extern "C" cudaError_t kiln_cuda_sample_next(kiln_cuda_sampler *sp, cudaStream_t s,
                                             const kiln_sampler_params *p, kiln_sample_rng *rng,
                                             const float *logits, int V,
                                             const int32_t *d_history, int n_history,
                                             int32_t *d_token, int32_t *h_token) {
    if (!p || !rng) return cudaErrorInvalidValue;
    /* validate before drawing, so a refused call leaves the stream where it was */
    if (!sp || !logits || !d_token || V < 1 || V > sp->cap || n_history < 0 || !sampler_params_ok(p))
        return cudaErrorInvalidValue;
    if (p->repeat_penalty != 1.0f && n_history > 0 && !d_history) return cudaErrorInvalidValue;
    float u = p->temperature > 0.0f ? kiln_sample_rng_u(rng) : 0.0f;
    return kiln_cuda_sample(sp, s, logits, V, p, d_history, n_history, u, NULL, d_token, h_token);
}
