/*
 * cuda_sampling.h -- kiln's sampler on the device: the token id that the CPU sampler
 * (src/generate/sampler.c, docs/ARITHMETIC.md "Sampling") draws from the same logits,
 * parameters, history and u (ops/sampling.h's stream), bit for bit.
 *
 * How the device follows the definition (kernels in cuda_sampling.cu):
 *   1. penalty: the distinct ids of the history window are marked (a byte per id), and the
 *      elementwise pass applies `l > 0 ? l / p : l * p` once to each marked logit (and clears
 *      the mark, so the marks are all zero between calls);
 *   2. greedy: each block reduces the 64-bit keys (order bits of the logit, id) to their
 *      minimum and one atomicMin per block combines them: the minimum key is the argmax with
 *      the lowest id on ties (+0 and -0 compare equal, as the CPU's `>` does);
 *   3. otherwise l / temperature is stored and every candidate gets the key
 *      (descending-order bits of l, id), which cub's radix sort orders exactly as the CPU's
 *      cand_cmp ranks (logit descending, id ascending; -0 ranked as +0);
 *   4. one block then walks the ranking: l_0 = mx; m = the number of leading ranks (of the n
 *      top-k candidates) with l - mx >= KILN_EXP_LO (whose kiln_expf may be nonzero: the
 *      others' are exactly +0 and add nothing to any running sum); p_i = kiln_expf(l_i - mx)
 *      in parallel, sum sequentially by one thread, p_i / sum in parallel, then one thread
 *      does top-p, min-p, total and the draw (kiln_sample_walk below, shared with a host
 *      test). With a non-finite mx every rank is walked literally (m = n).
 *
 * The walk helpers below are C and CUDA (KILN_HD). Define KILN_CUDA_SAMPLING_WALK_ONLY
 * before including this header to get only them (a C translation unit without CUDA).
 */
#ifndef KILN_CUDA_SAMPLING_H
#define KILN_CUDA_SAMPLING_H

#include "../../base/kmath.h"

#include <stdint.h>

#if defined(__CUDA_ARCH__)
#define KILN_SAMPLE_UNROLL _Pragma("unroll")
#else
#define KILN_SAMPLE_UNROLL
#endif

/* Values a sequential loop loads ahead of its dependent chain of additions. */
#define KILN_SAMPLE_CHUNK 32

/* Rank key of a candidate: 32 bits that sort ascending as l descends. -0 is keyed as +0 (the
 * CPU's comparisons do not tell them apart; the id then decides). NaN is never ranked (the
 * sampler refuses it before). */
static inline KILN_HD uint32_t kiln_sample_desc_bits(float l) {
    if (l == 0.0f) l = 0.0f;
    uint32_t u = kiln_f32_bits(l);
    uint32_t asc = (u & 0x80000000u) ? ~u : (u | 0x80000000u); /* ascending with l */
    return ~asc;
}

/* Bits the id needs in a sampling key for a vocabulary of V (>= 1, at most 32). */
static inline KILN_HD int kiln_sample_id_bits(int V) {
    int b = 1;
    while (b < 32 && ((uint64_t)1 << b) < (uint64_t)V) b++;
    return b;
}

/* The full key: ascending order of keys is the CPU's rank order. */
static inline KILN_HD uint64_t kiln_sample_key(float l, int32_t id, int id_bits) {
    return ((uint64_t)kiln_sample_desc_bits(l) << id_bits) | (uint64_t)(uint32_t)id;
}

/* s = s + q[0] + q[1] + ... + q[m-1], one addition at a time in order (from s = +0). */
static inline KILN_HD float kiln_sample_seq_sum(const float *q, int m) {
    float s = 0.0f;
    int i = 0;
    for (; i + KILN_SAMPLE_CHUNK <= m; i += KILN_SAMPLE_CHUNK) {
        float v[KILN_SAMPLE_CHUNK];
        KILN_SAMPLE_UNROLL
        for (int j = 0; j < KILN_SAMPLE_CHUNK; j++) v[j] = q[i + j];
        KILN_SAMPLE_UNROLL
        for (int j = 0; j < KILN_SAMPLE_CHUNK; j++) s += v[j];
    }
    for (; i < m; i++) s += q[i];
    return s;
}

/* With cum_i = q[0] + ... + q[i] summed in order: the first i < m with cum_i >= thr, or -1. */
static inline KILN_HD int kiln_sample_first_reach(const float *q, int m, float thr) {
    float cum = 0.0f;
    int i = 0;
    for (; i + KILN_SAMPLE_CHUNK <= m; i += KILN_SAMPLE_CHUNK) {
        float v[KILN_SAMPLE_CHUNK];
        KILN_SAMPLE_UNROLL
        for (int j = 0; j < KILN_SAMPLE_CHUNK; j++) v[j] = q[i + j];
        for (int j = 0; j < KILN_SAMPLE_CHUNK; j++) {
            cum += v[j];
            if (cum >= thr) return i + j;
        }
    }
    for (; i < m; i++) {
        cum += q[i];
        if (cum >= thr) return i;
    }
    return -1;
}

/* The first i < m with r < cum_i (cum_i as above), or -1. */
static inline KILN_HD int kiln_sample_first_above(const float *q, int m, float r) {
    float cum = 0.0f;
    int i = 0;
    for (; i + KILN_SAMPLE_CHUNK <= m; i += KILN_SAMPLE_CHUNK) {
        float v[KILN_SAMPLE_CHUNK];
        KILN_SAMPLE_UNROLL
        for (int j = 0; j < KILN_SAMPLE_CHUNK; j++) v[j] = q[i + j];
        for (int j = 0; j < KILN_SAMPLE_CHUNK; j++) {
            cum += v[j];
            if (r < cum) return i + j;
        }
    }
    for (; i < m; i++) {
        cum += q[i];
        if (r < cum) return i;
    }
    return -1;
}

/* Steps 6-8 of the definition (top-p, min-p, draw) over the ranking. q[0..m) are the
 * normalised probabilities p_i / sum of ranks 0..m-1; ranks m..n-1 (the rest of the top-k
 * candidates) have probability exactly +0, so they change no running sum and the loops stop
 * at m (1 <= m <= n). Returns the rank drawn (in [0, n)): the CPU's pick. */
static inline KILN_HD int kiln_sample_walk(const float *q, int m, int n, float top_p, float min_p,
                                           float u) {
    if (top_p < 1.0f) { /* shortest prefix whose running sum reaches top_p; else all n */
        int i = kiln_sample_first_reach(q, m, top_p);
        if (i >= 0) n = i + 1;
    }
    int mm = m < n ? m : n;
    if (min_p > 0.0f) { /* keep while p_i >= min_p * p_0 */
        float thr = min_p * q[0];
        int keep = 1;
        while (keep < mm && q[keep] >= thr) keep++;
        /* past m the CPU compares +0 >= thr: all of the zero tail is kept, or none */
        if (keep == mm && mm < n && 0.0f >= thr) keep = n;
        n = keep;
        mm = m < n ? m : n;
    }
    float total = kiln_sample_seq_sum(q, mm);
    float r = u * total;
    int pick = kiln_sample_first_above(q, mm, r);
    return pick >= 0 ? pick : n - 1;
}

#ifndef KILN_CUDA_SAMPLING_WALK_ONLY

#include <cuda_runtime.h>

#include "../sampling.h"
#include "kiln.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Device scratch for sampling from up to max_vocab logits (about 30 bytes per id, plus cub's
 * radix-sort storage), on the current device. Owns it all; free with kiln_cuda_sampler_free. */
typedef struct kiln_cuda_sampler kiln_cuda_sampler;

/* Allocate the scratch (cudaMalloc; the penalty marks are zeroed, synchronously). Returns
 * cudaErrorInvalidValue for max_vocab < 1 or a NULL out, else the first CUDA error (nothing
 * is left allocated then). */
cudaError_t kiln_cuda_sampler_create(int max_vocab, kiln_cuda_sampler **out);
void kiln_cuda_sampler_free(kiln_cuda_sampler *sp);

/* Enqueue on stream s the sampling of one token from logits (V floats, device memory, read
 * only) with parameters p (p->seed is not used: the draw is u), the history d_history
 * (n_history ids, device memory; only read when the penalty is on) and the uniform u (from
 * kiln_sample_rng_u, ../sampling.h; *d_u instead when d_u is not NULL, so a captured graph
 * can take a new u each replay; not read when greedy). Writes the id to *d_token (device
 * int32) and, when h_token is not NULL, copies it to *h_token (pinned host memory)
 * asynchronously on s.
 * A NaN logit (after the penalty) gives the id -1 (the CPU sampler returns KILN_ERR_RANGE).
 * No host synchronisation and no allocation: capturable into a CUDA graph (with d_u). Uses
 * the sampler's scratch: calls on one sampler must be ordered (one stream).
 * Returns cudaErrorInvalidValue for bad arguments (V < 1 or > max_vocab, invalid p as
 * kiln_sampler_create refuses it, a non-finite positive temperature, NULL pointers), else
 * the first launch error. */
cudaError_t kiln_cuda_sample(kiln_cuda_sampler *sp, cudaStream_t s, const float *logits, int V,
                             const kiln_sampler_params *p, const int32_t *d_history,
                             int n_history, float u, const float *d_u, int32_t *d_token,
                             int32_t *h_token);

/* kiln_cuda_sample with a sampler's parameters p, drawing u from its stream rng on the host
 * first when it samples (temperature > 0) -- exactly when kiln_sampler_sample would draw it,
 * so tokens sampled this way continue the CPU sequence (except that a NaN logit also consumes
 * a u). */
cudaError_t kiln_cuda_sample_next(kiln_cuda_sampler *sp, cudaStream_t s,
                                  const kiln_sampler_params *p, kiln_sample_rng *rng,
                                  const float *logits, int V, const int32_t *d_history,
                                  int n_history, int32_t *d_token, int32_t *h_token);

#ifdef __cplusplus
}
#endif

#endif /* KILN_CUDA_SAMPLING_WALK_ONLY */

#endif /* KILN_CUDA_SAMPLING_H */
