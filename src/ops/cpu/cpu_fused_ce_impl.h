/*
 * cpu_fused_ce_impl.h -- what the CPU bodies of the fused losses share: the linear
 * cross-entropy (cpu_fused_ce.c, which defines these) and the distillation loss
 * (cpu_fused_kd.c). Both gather the S supervised rows, walk the vocabulary in chunks and turn
 * each chunk's gradient g(S, n) into dh and dW with the same three products; the row work runs
 * on the backend's pool in pieces that each own their outputs, so no bit depends on the
 * thread count. For these two files only; callers use fused_ce.h and fused_kd.h.
 */
#ifndef KILN_CPU_FUSED_CE_IMPL_H
#define KILN_CPU_FUSED_CE_IMPL_H

#include "../../base/threadpool.h"
#include "../fused_ce_impl.h"
#include "cpu_kernels.h"

/* The kernel table of the CPU backend be's SIMD path. */
const kiln_cpu_kernels *kiln_cpu_ce_kernels(const kiln_backend *be);

/* The defined sum of v[0..n) (docs/ARITHMETIC.md's sum16): the dot of v with ones(n). */
float kiln_cpu_ce_lane_sum(const kiln_cpu_kernels *k, const float *v, const float *ones,
                           int64_t n);

/* A piece of row work: the outputs of [lo, hi) of some index range, in the serial order. */
typedef void (*kiln_cpu_ce_range_fn)(const void *job, int64_t lo, int64_t hi);

/* fn(job, lo, hi) over [0, n) in pieces that start at multiples of grain: on pool when it has
 * several threads, else on the calling thread. */
void kiln_cpu_ce_parallel(kiln_pool *pool, int64_t n, int64_t grain, kiln_cpu_ce_range_fn fn,
                          const void *job);

/* *block = kiln_malloc(bytes), the scratch of a call with S supervised rows and chunk cn;
 * bytes 0 (the layout's overflow) -> KILN_ERR_INVALID_ARG, no memory -> KILN_ERR_NOMEM, with
 * op naming the call in the message. The caller kiln_frees it. */
kiln_status kiln_cpu_ce_alloc(const char *op, size_t bytes, int64_t S, int64_t cn,
                              uint8_t **block);

/* The start of a call on scratch sc (kiln_ce_layout, KILN_CE_FULL, chunk cn): ones(max(cn,
 * S)) = 1, the S supervised rows of p gathered into hs in ascending position order (idx their
 * positions; bf16 hidden widened exactly), and pass 1's statistics reset (m = -inf, l = 0,
 * zt = 0). */
void kiln_cpu_ce_prepare(const kiln_fused_ce_params *p, kiln_ce_scratch *sc, int64_t S,
                         int64_t cn);

/* Before pass 2: hs^T into hT (dW requested) and dh_acc = 0 (dh requested); nothing when the
 * head's products run in an exact format (kiln_backend_cpu_weight_format). */
void kiln_cpu_ce_grad_begin(kiln_backend *be, const kiln_fused_ce_params *p, kiln_ce_scratch *sc, int64_t S);

/* One chunk of pass 2, columns [c0, c0+n), from its gradient g(S, n) (d loss / d logits):
 * dh_acc += g @ W[c0:c0+n] and p->dweight[c0:c0+n] += g^T @ hs, each as requested, with the
 * backend's matmul on transposed copies (docs/ARITHMETIC.md, "Fused linear cross-entropy");
 * in an exact format, one matmul_backward of the weight's chunk in the format (dh_acc
 * overwritten at c0 = 0). g is read only. */
void kiln_cpu_ce_grad_chunk(kiln_backend *be, const kiln_fused_ce_params *p,
                            kiln_ce_scratch *sc, int64_t S, const float *g, int64_t c0,
                            int64_t n);

/* After pass 2: dh_acc into p->dhidden (overwritten, unsupervised rows 0; or accumulated into
 * the supervised rows with dhidden_accumulate). */
void kiln_cpu_ce_write_dhidden(kiln_backend *be, const kiln_fused_ce_params *p,
                               const kiln_ce_scratch *sc, int64_t S);

/* A per-row output: dst(N) = 0 but dst[idx[i]] = src[i] for the S supervised rows. */
void kiln_cpu_ce_scatter_rows(float *dst, int64_t N, const int64_t *idx, const float *src,
                              int64_t S);

#endif /* KILN_CPU_FUSED_CE_IMPL_H */
