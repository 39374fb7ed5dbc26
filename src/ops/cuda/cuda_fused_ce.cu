/*
 * cuda_fused_ce.cu -- the row-wise pieces of the fused linear cross-entropy on the CUDA
 * backend (cuda_train.h; the driver is cuda_fused_ce_op.c, the products are the backend's
 * matmul). Each kernel performs, per output element, the binary32 operations of
 * docs/ARITHMETIC.md ("Fused linear cross-entropy") in the CPU's order:
 *   - the per-row max: one thread walks the chunk in order (`z > bm ? z : bm`, whose NaN and
 *     -0/+0 choices depend on the order, so it is not a tree);
 *   - the sum of exponentials: the lane-16 sum (one half-warp per row, lane j walking
 *     j, j+16, ... with fmaf(e, 1, acc), then the fixed tree), i.e. the CPU's dot with ones;
 *   - g, the transposes, the adds and the gathers/scatters are one thread per element.
 *
 * Fast mode (kiln_cuda_is_fast; the op picks the *_fast entry points) replaces two of
 * them and keeps every other piece above:
 *   - the exponentials are the MUFU's 2^x of one FMA (ex2_approx(fmaf(z, log2 e, -m log2 e)),
 *     cuda_common.cuh; relative error about 2^-22 against auditable mode's kiln_expf), which
 *     leaves these kernels bound by memory rather than by kiln_expf's arithmetic;
 *   - pass 1 (pass1_fast_kernel): one block of CE_FAST_THREADS threads per row, one read of
 *     the row: each thread keeps a running max and the sum of exponentials relative to it,
 *     rescaled when the max grows (online softmax), and the threads' pairs merge in a fixed
 *     tree. Run to run the bits are the same; against auditable mode the exponentials, the
 *     rescales and the order of the sum differ (the max itself is exact either way);
 *   - g (grad_fast_kernel): per element (e / l - [j = t]) gs as grad_kernel, but e as above
 *     and e / l as e * (1 / l), on a 2-D grid (no 64-bit division per element), and zero rows
 *     from S to the padded row count, so the products see a row count that is a multiple of 8
 *     (the op's ce_pass2_fast).
 * The distillation loss's row kernels (kd_pass1_kernel, kd_grad_kernel; cuda_fused_kd_op.c)
 * take the same two exponentials in fast mode (and 1 / tau and each row sum's reciprocal once
 * per row), and keep their auditable arithmetic otherwise.
 * and its bf16 path (the op's ce_pass2_bf16) adds the bf16 operands of the products: the
 * gathered hidden rows rounded once per call (gather_bf16_kernel), g written in bf16 by the
 * gradient kernel itself (grad_bf16_kernel: grad_fast_kernel's value, then the rounding), and
 * thin entry points that run the GEMM module (cuda_matmul.h) on the backend's handle.
 */
#include "cuda_common.cuh"
#include "cuda_matmul.h"
#include "cuda_mma.cuh"

#include <atomic>
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cstdlib>

namespace cg = cooperative_groups;

extern "C" {
#include "cuda_train.h"
}

/* The backend's GEMM handle, made on first use as the fast matmul makes it; NULL when the
 * backend is poisoned or the handle cannot be made (which poisons it). Defined at the end of
 * cuda_backend.cu for this file. */
kiln_cuda_gemm *kiln_cuda_backend_gemm(kiln_backend *be);

#define CE_BEGIN(be)                                                                           \
    do {                                                                                       \
        if (!kiln_cuda_begin(be)) return kiln_backend_status(be);                              \
    } while (0)

static kiln_status ce_launched(kiln_backend *be, const char *what) {
    if (!kiln_cuda_check(be, cudaGetLastError(), what)) return kiln_backend_status(be);
    return KILN_OK;
}

static unsigned ce_grid(int64_t total, int threads) {
    int64_t g = (total + threads - 1) / threads;
    if (g > (1 << 20)) g = 1 << 20;
    return (unsigned)(g < 1 ? 1 : g);
}

/* ---- gathers and scatters ------------------------------------------------------------------ */

static __global__ void gather_kernel(float *hs, const float *hidden, const int64_t *idx,
                                     int64_t S, int64_t H) {
    const int64_t total = S * H;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = u / H, k = u - i * H;
        hs[u] = hidden[idx[i] * H + k];
    }
}

extern "C" kiln_status kiln_cuda_ce_gather(kiln_backend *be, float *hs, const float *hidden,
                                           const int64_t *idx, int64_t S, int64_t H) {
    CE_BEGIN(be);
    if (S <= 0 || H <= 0) return KILN_OK;
    gather_kernel<<<ce_grid(S * H, 256), 256, 0, kiln_cuda_stream(be)>>>(hs, hidden, idx, S, H);
    return ce_launched(be, "fused_ce gather");
}

static __global__ void init_rows_kernel(float *m, float *l, float *zt, const float *stats,
                                        const int64_t *idx, int64_t S) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < S;
         i += (int64_t)gridDim.x * blockDim.x) {
        if (stats) {
            const float *rs = stats + 3 * idx[i];
            m[i] = rs[0];
            l[i] = rs[1];
            zt[i] = rs[2];
        } else {
            m[i] = -INFINITY;
            l[i] = 0.0f;
            zt[i] = 0.0f;
        }
    }
}

extern "C" kiln_status kiln_cuda_ce_init_rows(kiln_backend *be, float *m, float *l, float *zt,
                                              const float *stats, const int64_t *idx,
                                              int64_t S) {
    CE_BEGIN(be);
    if (S <= 0) return KILN_OK;
    init_rows_kernel<<<ce_grid(S, 256), 256, 0, kiln_cuda_stream(be)>>>(m, l, zt, stats, idx, S);
    return ce_launched(be, "fused_ce init rows");
}

static __global__ void stats_out_kernel(float *stats, const float *m, const float *l,
                                        const float *zt, const int64_t *idx, int64_t S) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < S;
         i += (int64_t)gridDim.x * blockDim.x) {
        float *rs = stats + 3 * idx[i];
        rs[0] = m[i];
        rs[1] = l[i];
        rs[2] = zt[i];
    }
}

extern "C" kiln_status kiln_cuda_ce_stats_out(kiln_backend *be, float *stats, const float *m,
                                              const float *l, const float *zt,
                                              const int64_t *idx, int64_t S) {
    CE_BEGIN(be);
    if (S <= 0) return KILN_OK;
    stats_out_kernel<<<ce_grid(S, 256), 256, 0, kiln_cuda_stream(be)>>>(stats, m, l, zt, idx, S);
    return ce_launched(be, "fused_ce stats out");
}

/* dst row idx[i] = src row i, or dst row idx[i] + src row i (k->add's x + y). */
static __global__ void scatter_rows_kernel(float *dst, const float *src, const int64_t *idx,
                                           int64_t S, int64_t H, int accumulate) {
    const int64_t total = S * H;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = u / H, k = u - i * H;
        float *d = dst + idx[i] * H + k;
        *d = accumulate ? *d + src[u] : src[u];
    }
}

extern "C" kiln_status kiln_cuda_ce_scatter_rows(kiln_backend *be, float *dst, const float *src,
                                                 const int64_t *idx, int64_t S, int64_t H,
                                                 int accumulate) {
    CE_BEGIN(be);
    if (S <= 0 || H <= 0) return KILN_OK;
    scatter_rows_kernel<<<ce_grid(S * H, 256), 256, 0, kiln_cuda_stream(be)>>>(dst, src, idx, S,
                                                                               H, accumulate);
    return ce_launched(be, "fused_ce scatter rows");
}

/* ---- pass 1: one half-warp per row ----------------------------------------------------------- */

#define CE_ROWS_THREADS 256

static __global__ void __launch_bounds__(CE_ROWS_THREADS)
pass1_kernel(const float *__restrict__ z, int64_t S, int64_t n, int64_t c0,
             const int32_t *__restrict__ tgt, float *m, float *l, float *zt) {
    const int lane = threadIdx.x & 15;
    const int64_t i = (int64_t)blockIdx.x * (CE_ROWS_THREADS / 16) + (threadIdx.x >> 4);
    if (i >= S) return; /* whole half-warps leave together */
    const unsigned mask = half_warp_mask();
    const float *zr = z + i * n;
    const float mi = m[i];
    float m_new = 0.0f;
    if (lane == 0) {
        float bm = zr[0];
        for (int64_t j = 1; j < n; j++) bm = zr[j] > bm ? zr[j] : bm;
        m_new = bm > mi ? bm : mi;
    }
    m_new = __shfl_sync(mask, m_new, 0, 16);
    float acc = 0.0f;
    for (int64_t j = lane; j < n; j += 16) acc = __fmaf_rn(kiln_expf(zr[j] - m_new), 1.0f, acc);
    const float csum = lane16_tree(acc, mask);
    if (lane == 0) {
        const int64_t t = (int64_t)tgt[i] - c0;
        if (t >= 0 && t < n) zt[i] = zr[t];
        const float alpha = kiln_expf(mi - m_new); /* first chunk: exp(-inf) = 0 */
        l[i] = l[i] * alpha + csum;
        m[i] = m_new;
    }
}

extern "C" kiln_status kiln_cuda_ce_pass1(kiln_backend *be, const float *z, int64_t S, int64_t n,
                                          int64_t c0, const int32_t *tgt, float *m, float *l,
                                          float *zt) {
    CE_BEGIN(be);
    if (S <= 0 || n <= 0) return KILN_OK;
    const int64_t blocks = (S + CE_ROWS_THREADS / 16 - 1) / (CE_ROWS_THREADS / 16);
    if (blocks > 0x7fffffff)
        return kiln_cuda_fail(be, KILN_ERR_INVALID_ARG, "fused_ce pass 1: %lld rows",
                              (long long)S);
    pass1_kernel<<<(unsigned)blocks, CE_ROWS_THREADS, 0, kiln_cuda_stream(be)>>>(z, S, n, c0, tgt,
                                                                                 m, l, zt);
    return ce_launched(be, "fused_ce pass 1");
}

/* ---- pass 2: g in place, one thread per element ------------------------------------------------ */

static __global__ void grad_kernel(float *z, int64_t S, int64_t n, int64_t c0,
                                   const int32_t *__restrict__ tgt, const float *__restrict__ m,
                                   const float *__restrict__ l, float gs) {
    const int64_t total = S * n;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = u / n, j = u - i * n;
        const float e = kiln_expf(z[u] - m[i]);
        const float li = l[i];
        const int64_t t = (int64_t)tgt[i] - c0;
        z[u] = j == t ? ((e / li) - 1.0f) * gs : (e / li) * gs;
    }
}

extern "C" kiln_status kiln_cuda_ce_grad(kiln_backend *be, float *z, int64_t S, int64_t n,
                                         int64_t c0, const int32_t *tgt, const float *m,
                                         const float *l, float gs) {
    CE_BEGIN(be);
    if (S <= 0 || n <= 0) return KILN_OK;
    grad_kernel<<<ce_grid(S * n, 256), 256, 0, kiln_cuda_stream(be)>>>(z, S, n, c0, tgt, m, l, gs);
    return ce_launched(be, "fused_ce gradient");
}

/* ---- the distillation loss's row work (cuda_fused_kd_op.c; cpu_fused_kd.c's operations) ------ */

/* The two maxima of a row's chunk and its first non-finite teacher column (bad: the row's so
 * far, -1 none), in lane 0 of the half-warp: TREE == false walks the chunk in lane 0 in order
 * (`x > b ? x : b`, whose NaN and -0/+0 choices depend on the order: the CPU's); TREE == true
 * (fast mode) lets lane j walk j, j+16, ... and merges in a fixed tree: the same maxima but for
 * those choices, each half-warp reading its row once. */
template <bool TREE>
static __device__ __forceinline__ void kd_row_max(const float *zr, const float *tr, int64_t n,
                                                  int64_t c0, int lane, unsigned mask,
                                                  float &bm, float &bt, int64_t &bad) {
    if (!TREE) {
        if (lane != 0) return;
        bm = zr[0];
        bt = tr[0];
        if (bad < 0 && !isfinite(bt)) bad = c0;
        for (int64_t j = 1; j < n; j++) {
            bm = zr[j] > bm ? zr[j] : bm;
            const float x = tr[j];
            bt = x > bt ? x : bt;
            if (bad < 0 && !isfinite(x)) bad = c0 + j;
        }
        return;
    }
    bm = -INFINITY;
    bt = -INFINITY;
    int64_t first = INT64_MAX;
    for (int64_t j = lane; j < n; j += 16) {
        bm = zr[j] > bm ? zr[j] : bm;
        const float x = tr[j];
        bt = x > bt ? x : bt;
        if (first == INT64_MAX && !isfinite(x)) first = j;
    }
    for (int o = 8; o >= 1; o >>= 1) {
        const float om = __shfl_xor_sync(mask, bm, o, 16), ot = __shfl_xor_sync(mask, bt, o, 16);
        const long long of = __shfl_xor_sync(mask, (long long)first, o, 16);
        bm = om > bm ? om : bm;
        bt = ot > bt ? ot : bt;
        first = of < first ? of : first;
    }
    if (bad < 0 && first != INT64_MAX) bad = c0 + first;
}

/* Pass 1 of the distillation loss on one chunk: one half-warp per row, as pass1_kernel. The
 * maxima as kd_row_max<TREE>; lane j's four sums walk columns j, j+16, ... as the CPU's lane j
 * of its 16 accumulators (kd_pass1_rows continues its lanes from block to block), then the
 * fixed tree. */
template <bool TREE>
static __global__ void __launch_bounds__(CE_ROWS_THREADS)
kd_pass1_kernel(const float *__restrict__ z, const float *__restrict__ teacher, int64_t tld,
                const int64_t *__restrict__ idx, int64_t S, int64_t n, int64_t c0,
                const int32_t *__restrict__ tgt, float tau, kiln_cuda_kd_stats r) {
    const int lane = threadIdx.x & 15;
    const int64_t i = (int64_t)blockIdx.x * (CE_ROWS_THREADS / 16) + (threadIdx.x >> 4);
    if (i >= S) return; /* whole half-warps leave together */
    const unsigned mask = half_warp_mask();
    const float *zr = z + i * n;
    const float *tr = teacher + idx[i] * tld + c0;
    float m1 = 0.0f, ms = 0.0f, mt = 0.0f, bm = 0.0f, bt = 0.0f;
    int64_t bad = r.bad[i];
    kd_row_max<TREE>(zr, tr, n, c0, lane, mask, bm, bt, bad);
    if (lane == 0) {
        r.bad[i] = bad;
        m1 = bm > r.m[i] ? bm : r.m[i];
        ms = bm / tau > r.ms[i] ? bm / tau : r.ms[i];
        mt = bt / tau > r.mt[i] ? bt / tau : r.mt[i];
    }
    m1 = __shfl_sync(mask, m1, 0, 16);
    ms = __shfl_sync(mask, ms, 0, 16);
    mt = __shfl_sync(mask, mt, 0, 16);
    float s1 = 0.0f, ss = 0.0f, st = 0.0f, sa = 0.0f;
    if (TREE) { /* fast mode: the MUFU's 2^x of one FMA (file comment), 1 / tau once */
        const float it = 1.0f / tau, a = KILN_LOG2E * it;
        const float n1 = -m1 * KILN_LOG2E, ns = -ms * KILN_LOG2E, nt = -mt * KILN_LOG2E;
        for (int64_t j = lane; j < n; j += 16) {
            const float zv = zr[j], tv = tr[j];
            s1 += ex2_approx(fmaf(zv, KILN_LOG2E, n1));
            ss += ex2_approx(fmaf(zv, a, ns));
            const float e = ex2_approx(fmaf(tv, a, nt));
            st += e;
            sa = fmaf(e, (tv - zv) * it, sa);
        }
    } else {
        for (int64_t j = lane; j < n; j += 16) {
            const float zs = zr[j] / tau;
            const float u = tr[j] / tau;
            const float d = u - zs;
            s1 = __fmaf_rn(kiln_expf(zr[j] - m1), 1.0f, s1);
            ss = __fmaf_rn(kiln_expf(zs - ms), 1.0f, ss);
            const float e = kiln_expf(u - mt);
            st = __fmaf_rn(e, 1.0f, st);
            sa = __fmaf_rn(e, d, sa);
        }
    }
    s1 = lane16_tree(s1, mask);
    ss = lane16_tree(ss, mask);
    st = lane16_tree(st, mask);
    sa = lane16_tree(sa, mask);
    if (lane == 0) {
        const int64_t t = (int64_t)tgt[i] - c0;
        if (t >= 0 && t < n) r.zt[i] = zr[t];
        /* first chunk: the old maxima are -inf, exp(-inf) = 0 */
        const float alpha1 = kiln_expf(r.m[i] - m1);
        const float alphas = kiln_expf(r.ms[i] - ms);
        const float alphat = kiln_expf(r.mt[i] - mt);
        r.l[i] = r.l[i] * alpha1 + s1;
        r.m[i] = m1;
        r.ls[i] = r.ls[i] * alphas + ss;
        r.ms[i] = ms;
        r.lt[i] = r.lt[i] * alphat + st;
        r.a[i] = r.a[i] * alphat + sa;
        r.mt[i] = mt;
    }
}

extern "C" kiln_status kiln_cuda_kd_pass1(kiln_backend *be, const float *z, const float *teacher,
                                          int64_t teacher_ld, const int64_t *idx, int64_t S,
                                          int64_t n, int64_t c0, const int32_t *tgt, float tau,
                                          const kiln_cuda_kd_stats *r) {
    CE_BEGIN(be);
    if (S <= 0 || n <= 0) return KILN_OK;
    const int64_t blocks = (S + CE_ROWS_THREADS / 16 - 1) / (CE_ROWS_THREADS / 16);
    if (blocks > 0x7fffffff)
        return kiln_cuda_fail(be, KILN_ERR_INVALID_ARG, "fused_kd pass 1: %lld rows",
                              (long long)S);
    if (kiln_cuda_is_fast(be))
        kd_pass1_kernel<true><<<(unsigned)blocks, CE_ROWS_THREADS, 0, kiln_cuda_stream(be)>>>(
            z, teacher, teacher_ld, idx, S, n, c0, tgt, tau, *r);
    else
        kd_pass1_kernel<false><<<(unsigned)blocks, CE_ROWS_THREADS, 0, kiln_cuda_stream(be)>>>(
            z, teacher, teacher_ld, idx, S, n, c0, tgt, tau, *r);
    return ce_launched(be, "fused_kd pass 1");
}

static __global__ void kd_stats_init_kernel(kiln_cuda_kd_stats r, int64_t S) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < S;
         i += (int64_t)gridDim.x * blockDim.x) {
        r.m[i] = -INFINITY;
        r.l[i] = 0.0f;
        r.zt[i] = 0.0f;
        r.ms[i] = -INFINITY;
        r.ls[i] = 0.0f;
        r.mt[i] = -INFINITY;
        r.lt[i] = 0.0f;
        r.a[i] = 0.0f;
        r.bad[i] = -1;
    }
}

extern "C" kiln_status kiln_cuda_kd_stats_init(kiln_backend *be, const kiln_cuda_kd_stats *r,
                                               int64_t S) {
    CE_BEGIN(be);
    if (S <= 0) return KILN_OK;
    kd_stats_init_kernel<<<ce_grid(S, 256), 256, 0, kiln_cuda_stream(be)>>>(*r, S);
    return ce_launched(be, "fused_kd init rows");
}

/* Pass 2 of the distillation loss on one chunk, in place, per element:
 * kd_pass2_rows's g = (kd_coef (q - p) + ce_weight (softmax(s) - onehot)) gs, a term whose
 * weight is 0 left out (+0 in its place). FAST (fast mode): the exponentials as pass 1's fast
 * ones, each division by a row's sum a product with its reciprocal (once per row). Grid: x over
 * the columns, y over the rows (both strided; no 64-bit division per element). */
template <bool FAST>
static __global__ void kd_grad_kernel(float *z, const float *__restrict__ teacher, int64_t tld,
                                      const int64_t *__restrict__ idx, int64_t S, int64_t n,
                                      int64_t c0, const int32_t *__restrict__ tgt, float tau,
                                      bool with_kd, float kd_coef, float cew, float gs,
                                      kiln_cuda_kd_stats r) {
    const bool with_ce = cew != 0.0f;
    const int64_t j0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, js = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = blockIdx.y; i < S; i += gridDim.y) {
        float *zr = z + i * n;
        const float *trow = teacher + idx[i] * tld + c0;
        const int64_t t = (int64_t)tgt[i] - c0;
        const float ms = r.ms[i], mt = r.mt[i], ls = r.ls[i], lt = r.lt[i], m = r.m[i], l = r.l[i];
        const float a = KILN_LOG2E / tau, ns = -ms * KILN_LOG2E, nt = -mt * KILN_LOG2E, n1 = -m * KILN_LOG2E;
        const float rls = 1.0f / ls, rlt = 1.0f / lt, rl = 1.0f / l;
        for (int64_t j = j0; j < n; j += js) {
            const float zv = zr[j];
            float kd = 0.0f, ce = 0.0f;
            if (with_kd) {
                if (FAST) {
                    kd = kd_coef * (ex2_approx(fmaf(zv, a, ns)) * rls - ex2_approx(fmaf(trow[j], a, nt)) * rlt);
                } else {
                    const float eq = kiln_expf(zv / tau - ms);
                    const float ep = kiln_expf(trow[j] / tau - mt);
                    kd = kd_coef * ((eq / ls) - (ep / lt));
                }
            }
            if (with_ce) {
                float sm = FAST ? ex2_approx(fmaf(zv, KILN_LOG2E, n1)) * rl : kiln_expf(zv - m) / l;
                if (j == t) sm = sm - 1.0f;
                ce = cew * sm;
            }
            zr[j] = (kd + ce) * gs;
        }
    }
}

extern "C" kiln_status kiln_cuda_kd_grad(kiln_backend *be, float *z, const float *teacher,
                                         int64_t teacher_ld, const int64_t *idx, int64_t S,
                                         int64_t n, int64_t c0, const int32_t *tgt, float tau,
                                         float kd_weight, float ce_weight, float gs,
                                         const kiln_cuda_kd_stats *r) {
    CE_BEGIN(be);
    if (S <= 0 || n <= 0) return KILN_OK;
    const int64_t gx = (n + 255) / 256;
    const dim3 grid((unsigned)(gx < 65535 ? gx : 65535), (unsigned)(S < 65535 ? S : 65535));
    if (kiln_cuda_is_fast(be))
        kd_grad_kernel<true><<<grid, 256, 0, kiln_cuda_stream(be)>>>(
            z, teacher, teacher_ld, idx, S, n, c0, tgt, tau, kd_weight != 0.0f, kd_weight * tau,
            ce_weight, gs, *r);
    else
        kd_grad_kernel<false><<<grid, 256, 0, kiln_cuda_stream(be)>>>(
            z, teacher, teacher_ld, idx, S, n, c0, tgt, tau, kd_weight != 0.0f, kd_weight * tau,
            ce_weight, gs, *r);
    return ce_launched(be, "fused_kd gradient");
}

/* ---- transpose (a copy, exact) and add --------------------------------------------------------- */

#define TP_TILE 32
#define TP_ROWS 8

/* dst(C, R) = src(R, C)^T through a 32 x 33 shared tile; block (32, 8) covers a 32 x 32 tile,
 * grid (x: column tiles, y: row tiles, grid-strided). */
template <bool BF16>
static __global__ void __launch_bounds__(TP_TILE * TP_ROWS)
transpose_kernel(float *__restrict__ dst, const void *__restrict__ src, int64_t R, int64_t C) {
    __shared__ float tile[TP_TILE][TP_TILE + 1];
    const int64_t tiles_r = (R + TP_TILE - 1) / TP_TILE, tiles_c = (C + TP_TILE - 1) / TP_TILE;
    for (int64_t tr = blockIdx.y; tr < tiles_r; tr += gridDim.y)
        for (int64_t tc = blockIdx.x; tc < tiles_c; tc += gridDim.x) {
            const int64_t r0 = tr * TP_TILE, c0 = tc * TP_TILE;
            for (int k = threadIdx.y; k < TP_TILE; k += TP_ROWS) {
                const int64_t r = r0 + k, c = c0 + threadIdx.x;
                if (r < R && c < C) {
                    const int64_t o = r * C + c;
                    tile[k][threadIdx.x] =
                        BF16 ? __uint_as_float((uint32_t)((const uint16_t *)src)[o] << 16)
                             : ((const float *)src)[o];
                }
            }
            __syncthreads();
            for (int k = threadIdx.y; k < TP_TILE; k += TP_ROWS) {
                const int64_t c = c0 + k, r = r0 + threadIdx.x;
                if (r < R && c < C) dst[c * R + r] = tile[threadIdx.x][k];
            }
            __syncthreads(); /* the tile is rewritten next */
        }
}

extern "C" kiln_status kiln_cuda_ce_transpose(kiln_backend *be, float *dst, const void *src,
                                              int src_bf16, int64_t R, int64_t C) {
    CE_BEGIN(be);
    if (R <= 0 || C <= 0) return KILN_OK;
    const int64_t tr = (R + TP_TILE - 1) / TP_TILE, tc = (C + TP_TILE - 1) / TP_TILE;
    const dim3 grid((unsigned)(tc < 65535 ? tc : 65535), (unsigned)(tr < 65535 ? tr : 65535));
    const dim3 block(TP_TILE, TP_ROWS);
    if (src_bf16)
        transpose_kernel<true><<<grid, block, 0, kiln_cuda_stream(be)>>>(dst, src, R, C);
    else
        transpose_kernel<false><<<grid, block, 0, kiln_cuda_stream(be)>>>(dst, src, R, C);
    return ce_launched(be, "fused_ce transpose");
}

static __global__ void ce_add_kernel(float *x, const float *y, size_t n) {
    for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < n;
         u += (size_t)gridDim.x * blockDim.x)
        x[u] = x[u] + y[u];
}

extern "C" kiln_status kiln_cuda_ce_add(kiln_backend *be, float *x, const float *y, size_t n) {
    CE_BEGIN(be);
    if (n == 0) return KILN_OK;
    ce_add_kernel<<<ce_grid((int64_t)n, 256), 256, 0, kiln_cuda_stream(be)>>>(x, y, n);
    return ce_launched(be, "fused_ce add");
}

/* ---- fast mode ------------------------------------------------------------------------------ */

extern "C" bool kiln_cuda_ce_is_fast(kiln_backend *be) { return kiln_cuda_is_fast(be); }

#define CE_FAST_THREADS 256
#define CE_FAST_WARPS (CE_FAST_THREADS / 32)
static_assert(CE_FAST_THREADS % 32 == 0 && CE_FAST_WARPS <= 32, "whole warps, one smem slot each");

/* Pass 1 on one chunk, one block per row (rows grid-strided), reading the row once. Order,
 * fixed for a given n and the vector choice (z 16-byte aligned and n % 4 == 0: float4 slots,
 * else single elements; a function of the call's arguments, never of the timing):
 *   thread t walks its slots j = t, t + 256, ... (a slot: 4 consecutive columns, or one) in
 *   groups of CE_P1_GROUP slots, ascending (the row's last group padded with -inf values,
 *   whose terms are exact zeros), keeping (mt, st): the running max and the sum of
 *   e(z) = ex2_approx(fmaf(z, log2 e, -mt log2 e)) relative to it. Per group: gm = the fmaxf of
 *   its values in slot order; when gm > mt, st = st * ce_rescale(mt, gm) and mt = gm; then st
 *   = st + e(v) for each value in slot order (skipped while mt is -inf: every value so far was
 *   -inf, contributing 0);
 *   (mt, st) pairs combine as ce_merge: m = fmaxf, s = sa * ce_rescale(ma, m) + sb *
 *   ce_rescale(mb, m) (symmetric in its operands, bit for bit, so both lanes of a butterfly
 *   pair hold the same result): each warp by the xor butterfly (16, 8, 4, 2, 1), then thread 0
 *   takes the 8 warps in order from warp 0;
 *   with the row's (M, L) so far, m_new = M > m ? M : m (as auditable) and l = l * ce_rescale(m,
 *   m_new) + L * ce_rescale(M, m_new); zt = z[t] (as auditable).
 * A NaN logit makes the sum, hence the loss, NaN (the call then fails as in auditable mode);
 * a max never rounds, so the only roundings are the exponentials, the rescales and the sums.
 * One read of the row (the earlier kernel read it twice, max then sum): with four float4 loads
 * in flight per thread the kernel runs near the memory's rate. */
#define CE_P1_GROUP 4

/* 2^((m_old - m_new) log2 e), exactly 1 when m_old == m_new (also both -inf: no NaN from
 * -inf - -inf) and 0 for m_old = -inf < m_new. */
static __device__ __forceinline__ float ce_rescale(float m_old, float m_new) {
    return m_old == m_new ? 1.0f : ex2_approx((m_old - m_new) * KILN_LOG2E);
}

static __device__ __forceinline__ void ce_merge(float &m, float &s, float mo, float so) {
    const float mn = fmaxf(m, mo);
    s = s * ce_rescale(m, mn) + so * ce_rescale(mo, mn);
    m = mn;
}

/* One group of K values (slot order) into the thread's (mt, st). */
template <int K>
static __device__ __forceinline__ void ce_p1_group(float &mt, float &st, const float (&v)[K]) {
    float gm = v[0];
#pragma unroll
    for (int q = 1; q < K; q++) gm = fmaxf(gm, v[q]);
    if (gm > mt) {
        st = st * ce_rescale(mt, gm);
        mt = gm;
    }
    if (mt == -INFINITY) return;
    const float nm = -mt * KILN_LOG2E;
#pragma unroll
    for (int q = 0; q < K; q++) st = st + ex2_approx(fmaf(v[q], KILN_LOG2E, nm));
}

/* The block's (m, s) from every thread's (mt, st): the xor butterfly (16, 8, 4, 2, 1) in
 * each warp, then thread 0 merges the WARPS warps in order from warp 0 (ce_merge), into bm,
 * bs (thread 0 only). part_m, part_s: WARPS floats of shared memory; the barrier between the
 * warps' writes and thread 0's reads is inside, the one before their next use is the
 * caller's. */
template <int WARPS>
static __device__ __forceinline__ void ce_block_pair(float mt, float st, float *part_m,
                                                     float *part_s, float &bm, float &bs) {
    for (int o = 16; o > 0; o >>= 1) {
        const float mo = __shfl_xor_sync(0xffffffffu, mt, o);
        const float so = __shfl_xor_sync(0xffffffffu, st, o);
        ce_merge(mt, st, mo, so);
    }
    if ((threadIdx.x & 31) == 0) {
        part_m[threadIdx.x >> 5] = mt;
        part_s[threadIdx.x >> 5] = st;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        bm = part_m[0], bs = part_s[0];
        for (int w = 1; w < WARPS; w++) ce_merge(bm, bs, part_m[w], part_s[w]);
    }
}

/* Slot j (4 columns) of a row of V logits, for the row kernels' statistics: x4 (loaded by the
 * caller, -inf past the row's slots) with its columns >= V as -inf, into v[0..3]. */
static __device__ __forceinline__ void ce_slot_vals(float4 x4, int64_t j, int64_t V, float *v) {
    const int64_t c = 4 * j;
    v[0] = x4.x;
    v[1] = c + 1 < V ? x4.y : -INFINITY;
    v[2] = c + 2 < V ? x4.z : -INFINITY;
    v[3] = c + 3 < V ? x4.w : -INFINITY;
}

template <bool VEC>
static __global__ void __launch_bounds__(CE_FAST_THREADS)
pass1_fast_kernel(const float *__restrict__ z, int64_t S, int64_t n, int64_t c0,
                  const int32_t *__restrict__ tgt, float *m, float *l, float *zt) {
    __shared__ float part_m[CE_FAST_WARPS], part_s[CE_FAST_WARPS];
    const int tid = threadIdx.x;
    constexpr int W = VEC ? 4 : 1;          /* columns per slot */
    constexpr int G = CE_P1_GROUP;          /* slots per group */
    constexpr int64_t STEP = (int64_t)CE_FAST_THREADS * G;
    const int64_t slots = n / W;            /* VEC: n % 4 == 0 */
    for (int64_t i = blockIdx.x; i < S; i += gridDim.x) { /* uniform per block */
        const float *zr = z + i * n;
        float mt = -INFINITY, st = 0.0f;
        for (int64_t j0 = tid; j0 < slots; j0 += STEP) {
            float v[G * W]; /* slots past the row: -inf, whose e(z) adds an exact 0 */
#pragma unroll
            for (int g = 0; g < G; g++) {
                const int64_t j = j0 + (int64_t)g * CE_FAST_THREADS;
                if (VEC) {
                    float4 x4 = make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
                    if (j < slots) x4 = __ldg(reinterpret_cast<const float4 *>(zr) + j);
                    v[4 * g] = x4.x, v[4 * g + 1] = x4.y;
                    v[4 * g + 2] = x4.z, v[4 * g + 3] = x4.w;
                } else {
                    v[g] = j < slots ? __ldg(zr + j) : -INFINITY;
                }
            }
            ce_p1_group<G * W>(mt, st, v);
        }
        float bm, bs;
        ce_block_pair<CE_FAST_WARPS>(mt, st, part_m, part_s, bm, bs);
        if (tid == 0) {
            const float mi = m[i];
            const float m_new = bm > mi ? bm : mi;
            const int64_t t = (int64_t)tgt[i] - c0;
            if (t >= 0 && t < n) zt[i] = zr[t];
            l[i] = l[i] * ce_rescale(mi, m_new) + bs * ce_rescale(bm, m_new);
            m[i] = m_new;
        }
        __syncthreads(); /* part_* are rewritten for the next row */
    }
}

extern "C" kiln_status kiln_cuda_ce_pass1_fast(kiln_backend *be, const float *z, int64_t S,
                                               int64_t n, int64_t c0, const int32_t *tgt,
                                               float *m, float *l, float *zt) {
    CE_BEGIN(be);
    if (S <= 0 || n <= 0) return KILN_OK;
    const unsigned blocks = (unsigned)(S < (1 << 20) ? S : (1 << 20));
    const bool vec = n % 4 == 0 && ((uintptr_t)z & 15u) == 0;
    if (vec)
        pass1_fast_kernel<true><<<blocks, CE_FAST_THREADS, 0, kiln_cuda_stream(be)>>>(
            z, S, n, c0, tgt, m, l, zt);
    else
        pass1_fast_kernel<false><<<blocks, CE_FAST_THREADS, 0, kiln_cuda_stream(be)>>>(
            z, S, n, c0, tgt, m, l, zt);
    return ce_launched(be, "fused_ce pass 1 (fast)");
}

/* One element of g, fast mode (file comment; is_t: the target's column). */
/* g of one logit z of row i: nm = -m_i log2 e, rl = 1 / l_i (each once per row). */
static __device__ __forceinline__ float ce_grad_value(float z, float nm, float rl, float gs,
                                                      bool is_t) {
    const float p = ex2_approx(fmaf(z, KILN_LOG2E, nm)) * rl;
    return is_t ? (p - 1.0f) * gs : p * gs;
}

/* g in place for rows [0, S) of z(Sp, n) (ce_grad_value per element), zeros in rows
 * [S, Sp). Grid: x over the columns, y over the rows (both grid-strided). */
static __global__ void __launch_bounds__(CE_FAST_THREADS)
grad_fast_kernel(float *z, int64_t S, int64_t Sp, int64_t n, int64_t c0,
                 const int32_t *__restrict__ tgt, const float *__restrict__ m,
                 const float *__restrict__ l, float gs) {
    const int64_t j0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t js = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = blockIdx.y; i < Sp; i += gridDim.y) {
        float *zr = z + i * n;
        if (i >= S) {
            for (int64_t j = j0; j < n; j += js) zr[j] = 0.0f;
            continue;
        }
        const float nm = -m[i] * KILN_LOG2E, rl = 1.0f / l[i];
        const int64_t t = (int64_t)tgt[i] - c0;
        for (int64_t j = j0; j < n; j += js) zr[j] = ce_grad_value(zr[j], nm, rl, gs, j == t);
    }
}

extern "C" kiln_status kiln_cuda_ce_grad_fast(kiln_backend *be, float *z, int64_t S, int64_t Sp,
                                              int64_t n, int64_t c0, const int32_t *tgt,
                                              const float *m, const float *l, float gs) {
    CE_BEGIN(be);
    if (Sp < S)
        return kiln_cuda_fail(be, KILN_ERR_INVALID_ARG,
                              "fused_ce gradient (fast): padded rows %lld < rows %lld",
                              (long long)Sp, (long long)S);
    if (Sp <= 0 || n <= 0) return KILN_OK;
    const int64_t gx = (n + CE_FAST_THREADS - 1) / CE_FAST_THREADS;
    const dim3 grid((unsigned)(gx < 65535 ? gx : 65535), (unsigned)(Sp < 65535 ? Sp : 65535));
    grad_fast_kernel<<<grid, CE_FAST_THREADS, 0, kiln_cuda_stream(be)>>>(z, S, Sp, n, c0, tgt, m,
                                                                         l, gs);
    return ce_launched(be, "fused_ce gradient (fast)");
}

/* ---- fast mode on bf16 operands -------------------------------------------------------------- */


/* The bf16 kernels below give each thread a run of CE_RUN = 8 columns of one row and store it
 * as one 16-byte word: the destination's leading dimension is a multiple of 8 elements and its
 * start 16-byte aligned, so a run starting at a multiple of 8 never leaves its row's padded
 * width. Columns past the matrix's width inside the last run are written as zeros (padding the
 * products never read). Grid: x over the runs of a row, y over the rows (strided). Eight
 * columns a thread (two float4 loads in flight, against one with runs of four, which left the
 * gradient kernel at about 2.5 TB/s on the H200). */
#define CE_RUN 8

static __device__ __forceinline__ void ce_store_run(uint16_t *dst, const uint16_t v[CE_RUN]) {
    uint4 o; /* little-endian: column j at the lower address */
    o.x = (uint32_t)v[0] | ((uint32_t)v[1] << 16);
    o.y = (uint32_t)v[2] | ((uint32_t)v[3] << 16);
    o.z = (uint32_t)v[4] | ((uint32_t)v[5] << 16);
    o.w = (uint32_t)v[6] | ((uint32_t)v[7] << 16);
    *(uint4 *)dst = o;
}

static __global__ void __launch_bounds__(CE_FAST_THREADS)
gather_bf16_kernel(uint16_t *__restrict__ hsb, int64_t ld, const float *__restrict__ hidden,
                   const int64_t *__restrict__ idx, int64_t S, int64_t Sp, int64_t H) {
    const int64_t j0 = ((int64_t)blockIdx.x * CE_FAST_THREADS + threadIdx.x) * CE_RUN;
    if (j0 >= H) return;
    for (int64_t i = blockIdx.y; i < Sp; i += gridDim.y) {
        uint16_t v[CE_RUN] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (i < S) {
            const float *src = hidden + idx[i] * H;
#pragma unroll
            for (int q = 0; q < CE_RUN; q++)
                if (j0 + q < H) v[q] = kiln_bf16_rne(src[j0 + q]);
        }
        ce_store_run(hsb + i * ld + j0, v);
    }
}

/* The grid of the bf16 kernels for rows x cols; false when cols is too wide. */
static bool ce_run_grid(int64_t rows, int64_t cols, dim3 *grid) {
    const int64_t per_block = (int64_t)CE_FAST_THREADS * CE_RUN;
    const int64_t gx = (cols + per_block - 1) / per_block;
    if (gx > 0x7fffffff) return false;
    *grid = dim3((unsigned)gx, (unsigned)(rows < 65535 ? rows : 65535));
    return true;
}

/* The destination's contract for the bf16 kernels (see CE_RUN). */
static bool ce_run_dst_ok(const uint16_t *dst, int64_t ld, int64_t cols) {
    return dst && ld >= cols && ld % 8 == 0 && ((uintptr_t)dst & 15u) == 0;
}

extern "C" kiln_status kiln_cuda_ce_gather_bf16(kiln_backend *be, uint16_t *hsb, int64_t ld,
                                                const float *hidden, const int64_t *idx,
                                                int64_t S, int64_t Sp, int64_t H) {
    CE_BEGIN(be);
    dim3 grid;
    if (Sp < S || !ce_run_dst_ok(hsb, ld, H) || !ce_run_grid(Sp, H, &grid))
        return kiln_cuda_fail(be, KILN_ERR_INVALID_ARG,
                              "fused_ce gather (bf16): rows %lld, padded %lld, H %lld, ld %lld",
                              (long long)S, (long long)Sp, (long long)H, (long long)ld);
    if (Sp <= 0 || H <= 0) return KILN_OK;
    gather_bf16_kernel<<<grid, CE_FAST_THREADS, 0, kiln_cuda_stream(be)>>>(hsb, ld, hidden, idx,
                                                                           S, Sp, H);
    return ce_launched(be, "fused_ce gather (bf16)");
}

/* g(Sp, ldg) in bf16 from z(S, n): the value of grad_fast_kernel, rounded once. Two float4
 * loads where the run is whole and 16-byte aligned (the same values either way). */
static __global__ void __launch_bounds__(CE_FAST_THREADS)
grad_bf16_kernel(uint16_t *__restrict__ g, int64_t ldg, const float *__restrict__ z, int64_t S,
                 int64_t Sp, int64_t n, int64_t c0, const int32_t *__restrict__ tgt,
                 const float *__restrict__ m, const float *__restrict__ l, float gs) {
    const int64_t j0 = ((int64_t)blockIdx.x * CE_FAST_THREADS + threadIdx.x) * CE_RUN;
    if (j0 >= n) return;
    for (int64_t i = blockIdx.y; i < Sp; i += gridDim.y) {
        uint16_t v[CE_RUN] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (i < S) {
            const float nm = -m[i] * KILN_LOG2E, rl = 1.0f / l[i];
            const int64_t t = (int64_t)tgt[i] - c0;
            const float *zr = z + i * n + j0;
            float x[CE_RUN];
            if (j0 + CE_RUN <= n && ((uintptr_t)zr & 15u) == 0) {
                const float4 a = __ldg((const float4 *)zr), b = __ldg((const float4 *)zr + 1);
                x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
                x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
            } else {
#pragma unroll
                for (int q = 0; q < CE_RUN; q++) x[q] = j0 + q < n ? zr[q] : 0.0f;
            }
#pragma unroll
            for (int q = 0; q < CE_RUN; q++)
                if (j0 + q < n) v[q] = kiln_bf16_rne(ce_grad_value(x[q], nm, rl, gs, j0 + q == t));
        }
        ce_store_run(g + i * ldg + j0, v);
    }
}

extern "C" kiln_status kiln_cuda_ce_grad_bf16(kiln_backend *be, uint16_t *g, int64_t ldg,
                                              const float *z, int64_t S, int64_t Sp, int64_t n,
                                              int64_t c0, const int32_t *tgt, const float *m,
                                              const float *l, float gs) {
    CE_BEGIN(be);
    dim3 grid;
    if (Sp < S || !ce_run_dst_ok(g, ldg, n) || !ce_run_grid(Sp, n, &grid))
        return kiln_cuda_fail(be, KILN_ERR_INVALID_ARG,
                              "fused_ce gradient (bf16): rows %lld, padded %lld, n %lld, ld %lld",
                              (long long)S, (long long)Sp, (long long)n, (long long)ldg);
    if (Sp <= 0 || n <= 0) return KILN_OK;
    grad_bf16_kernel<<<grid, CE_FAST_THREADS, 0, kiln_cuda_stream(be)>>>(g, ldg, z, S, Sp, n, c0,
                                                                         tgt, m, l, gs);
    return ce_launched(be, "fused_ce gradient (bf16)");
}

/* ---- fast mode's row-block walk ---------------------------------------------------------------- */

/* The four bf16 gradient values of slot j (columns 4j .. 4j+3) from its logits x: ce_grad_value
 * rounded once for the columns < V, zeros past them; packed as stored (column 4j lowest). */
static __device__ __forceinline__ uint2 ce_grad_slot(float4 x, int64_t j, int64_t V, int64_t t,
                                                     float nm, float rl, float gs) {
    const int64_t c = 4 * j;
    const float xs[4] = {x.x, x.y, x.z, x.w};
    uint16_t b[4];
#pragma unroll
    for (int q = 0; q < 4; q++)
        b[q] = c + q < V ? kiln_bf16_rne(ce_grad_value(xs[q], nm, rl, gs, c + q == t))
                         : (uint16_t)0;
    return make_uint2((uint32_t)b[0] | ((uint32_t)b[1] << 16),
                      (uint32_t)b[2] | ((uint32_t)b[3] << 16));
}

/* One row of a row block (the op's ce_rows_bf16) with f32 logits where the clusters below do
 * not take them (V above 409,600, or 2^28 rows or more): z(R, ldz) f32 holds the block's whole
 * logits (columns [0, V), ldz % 8 == 0, 16-byte aligned rows); one block of CE_FAST_THREADS
 * threads per row (rows grid-strided) makes the row's statistics and then its gradient, which
 * it writes in bf16 IN PLACE, as g(R, 2 ldz): row i's bf16 values start at row i's own f32
 * bytes, so a row's gradient never touches another row.
 *   Statistics (rows < Rs, the supervised ones): pass1_fast_kernel's order on the float4 slots
 *   of the row (its VEC form, the columns >= V of the last slot as -inf), from m = -inf, l = 0:
 *   m = the block's max, l = its sum, zt = z[t]; written to m, l, zt[i].
 *   Gradient: ce_grad_value per column < V, rounded once (grad_bf16_kernel's values for those
 *   statistics); columns [V, 4 ceil(V/4)) and every column of the padding rows [Rs, R) zero.
 * In place: the walk reads the row in tiles of STEP = CE_FAST_THREADS x CE_P1_GROUP slots;
 * tile k's slots are [k STEP, (k+1) STEP), and its bf16 values land on bytes [8 k STEP,
 * 8 (k+1) STEP) of the row, i.e. on the f32 slots below (k+1) STEP / 2, all read by then. A
 * barrier between a tile's loads and its stores keeps every thread's loads ahead of every
 * store into them (the loop count is the same for every thread of the block). Plain loads
 * (no __ldg): the kernel writes what it reads. */
static __global__ void __launch_bounds__(CE_FAST_THREADS)
rows_fast_kernel(float *z, int64_t ldz, int64_t R, int64_t Rs, int64_t V,
                 const int32_t *__restrict__ tgt, float *__restrict__ m, float *__restrict__ l,
                 float *__restrict__ zt, float gs) {
    __shared__ float part_m[CE_FAST_WARPS], part_s[CE_FAST_WARPS];
    __shared__ float row_nm, row_rl;
    const int tid = threadIdx.x;
    constexpr int G = CE_P1_GROUP;
    constexpr int64_t STEP = (int64_t)CE_FAST_THREADS * G;
    const int64_t slots = (V + 3) / 4;
    for (int64_t i = blockIdx.x; i < R; i += gridDim.x) { /* uniform per block */
        float *zr = z + i * ldz;
        uint2 *gr = reinterpret_cast<uint2 *>(zr); /* slot j's four bf16 values: gr[j] */
        if (i >= Rs) {                              /* a padding row: zeros */
            for (int64_t j = tid; j < slots; j += CE_FAST_THREADS) gr[j] = make_uint2(0u, 0u);
            continue;
        }
        float mt = -INFINITY, st = 0.0f;
        for (int64_t j0 = tid; j0 < slots; j0 += STEP) {
            float v[G * 4];
#pragma unroll
            for (int g = 0; g < G; g++) {
                const int64_t j = j0 + (int64_t)g * CE_FAST_THREADS;
                float4 x4 = make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
                if (j < slots) x4 = reinterpret_cast<const float4 *>(zr)[j];
                ce_slot_vals(x4, j, V, v + 4 * g);
            }
            ce_p1_group<G * 4>(mt, st, v);
        }
        float bm, bs;
        ce_block_pair<CE_FAST_WARPS>(mt, st, part_m, part_s, bm, bs);
        const int64_t t = tgt[i];
        if (tid == 0) {
            /* pass1_fast_kernel's update from m = -inf, l = 0 gives exactly m = bm, l = bs */
            m[i] = bm;
            l[i] = bs;
            zt[i] = zr[t]; /* read before any store of this row (the barrier below) */
            row_nm = -bm * KILN_LOG2E;
            row_rl = 1.0f / bs;
        }
        __syncthreads();
        const float nm = row_nm, rl = row_rl;
        for (int64_t base = 0; base < slots; base += STEP) {
            float4 x[G];
#pragma unroll
            for (int g = 0; g < G; g++) {
                const int64_t j = base + tid + (int64_t)g * CE_FAST_THREADS;
                x[g] = j < slots ? reinterpret_cast<const float4 *>(zr)[j] : make_float4(0, 0, 0, 0);
            }
            __syncthreads(); /* every load of this tile before any store into it */
#pragma unroll
            for (int g = 0; g < G; g++) {
                const int64_t j = base + tid + (int64_t)g * CE_FAST_THREADS;
                if (j >= slots) continue;
                gr[j] = ce_grad_slot(x[g], j, V, t, nm, rl, gs);
            }
        }
        __syncthreads(); /* part_*, row_* are rewritten for the next row */
    }
}

/* The same work, one CLUSTER of CE_CL blocks per row (Hopper's thread-block clusters): block
 * q of the cluster takes the row's slots [q per, (q+1) per) and keeps them in its shared
 * memory, so the row is read from memory once, not twice (rows_fast_kernel's second read of a
 * row of 600 KB misses the L2). A slot is Slot::W consecutive columns, one vector load: f32
 * logits (ce_slot_f32: 4 columns, a float4) or bf16 logits (ce_slot_bf16: 8 columns, 16
 * bytes; kiln_fused_ce_params.row_logits_f32 == 0). Order, fixed for a given V and Slot:
 *   each block (CE_CL_THREADS threads): pass1_fast_kernel's walk of its own slots (thread t:
 *   slots t, t + CE_CL_THREADS, ... of the slice, in groups of Slot::G slots, 16 values, -inf
 *   past V), the xor butterfly, then thread 0 merges the warps in order: the block's (m, s);
 *   every block's thread 0 then merges the CE_CL blocks' pairs in rank order 0, 1, ... through
 *   distributed shared memory (the same operations in every block, so the same row m, l);
 *   rank 0 writes m, l; the block holding the target's slot writes zt from its copy;
 *   g per slot from the shared copy (ce_grad_value, rounded once), stored in bf16 in place.
 * The first cluster barrier orders every block's loads before any store of the row (with f32
 * logits a store of slot j lands on slot j / 2's bytes, another block's; with bf16 logits on
 * slot j's own bytes) and makes the blocks' (m, s) visible; the second keeps them alive until
 * every block of the cluster has read them. */
#define CE_CL 8
/* largest slice (16-byte slots) a block keeps in shared memory: 200 KiB */
#define CE_CL_MAX_SLOTS (200 * 1024 / 16)
static_assert(KILN_CUDA_CE_ROWS16_MAX_V == (int64_t)8 * CE_CL * CE_CL_MAX_SLOTS,
              "bf16 logits: every V up to the bound fits the clusters' slices");
/* threads a block: two blocks of 76 KB fit an SM at V 151,936 with f32 logits. 512 rather
 * than 256 for more loads in flight; on the H200 the gain was within the noise (the fused loss
 * 13.96 -> 13.70 ms), and the kernel streams at about 2.2-2.5 TB/s either way */
#define CE_CL_THREADS 512
#define CE_CL_WARPS (CE_CL_THREADS / 32)
static_assert(CE_CL_THREADS % 32 == 0 && CE_CL_WARPS <= 32, "whole warps, one smem slot each");

/* f32 logits: a float4 slot; its bf16 gradient at slot j of the row's bf16 view (g(R, 2 ldz):
 * the row's first half) */
struct ce_slot_f32 {
    typedef float elem;
    typedef float4 raw;
    static constexpr int W = 4;
    static constexpr int G = CE_P1_GROUP; /* slots a statistics group */
    static constexpr int MIN_BLOCKS = 2;  /* two slices of 76 KB an SM at V 151,936 */
    static __device__ __forceinline__ raw load(const elem *zr, int64_t j) {
        return reinterpret_cast<const float4 *>(zr)[j];
    }
    static __device__ __forceinline__ void vals(raw x, float *v) {
        v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
    }
    static __device__ __forceinline__ void grad_store(elem *zr, int64_t j, raw x, int64_t V,
                                                      int64_t t, float nm, float rl, float gs) {
        reinterpret_cast<uint2 *>(zr)[j] = ce_grad_slot(x, j, V, t, nm, rl, gs);
    }
    static __device__ __forceinline__ void zero_store(elem *zr, int64_t j) {
        reinterpret_cast<uint2 *>(zr)[j] = make_uint2(0u, 0u);
    }
};

/* Two values rounded to bf16 by the hardware's conversion (cvt.rn.bf16x2.f32: round to
 * nearest even, as kiln_bf16_rne for every finite value; NaN would come out as the canonical
 * NaN, but a NaN logit fails the loss and leaves the gradient unspecified), the first in the
 * low half: one instruction for two values instead of about a dozen integer operations. */
static __device__ __forceinline__ uint32_t ce_bf16x2_rn(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&h);
}

/* bf16 logits: 8 columns in 16 bytes; the gradient in bf16 over the same bytes (g(R, ldz)).
 * A whole slot without the target (every slot but the row's last one or two) takes the
 * straight path: ce_grad_value's arithmetic with no per-column tests. */
struct ce_slot_bf16 {
    typedef uint16_t elem;
    typedef uint4 raw;
    static constexpr int W = 8;
    static constexpr int G = 2;          /* 16 values a group, as f32's 4 slots */
    static constexpr int MIN_BLOCKS = 3; /* slices of 38 KB: three blocks an SM */
    static __device__ __forceinline__ raw load(const elem *zr, int64_t j) {
        return reinterpret_cast<const uint4 *>(zr)[j];
    }
    static __device__ __forceinline__ void vals(raw x, float *v) { bf16x8_f32(x, v); }
    static __device__ __forceinline__ void grad_store(elem *zr, int64_t j, raw x, int64_t V,
                                                      int64_t t, float nm, float rl, float gs) {
        float v[8];
        bf16x8_f32(x, v);
        const int64_t c = 8 * j;
        if (c + 8 <= V && (t < c || t >= c + 8)) {
#pragma unroll
            for (int q = 0; q < 8; q++) v[q] = ce_grad_value(v[q], nm, rl, gs, false);
        } else {
#pragma unroll
            for (int q = 0; q < 8; q++)
                v[q] = c + q < V ? ce_grad_value(v[q], nm, rl, gs, c + q == t) : 0.0f;
        }
        reinterpret_cast<uint4 *>(zr)[j] = make_uint4(ce_bf16x2_rn(v[0], v[1]), ce_bf16x2_rn(v[2], v[3]),
                                                      ce_bf16x2_rn(v[4], v[5]), ce_bf16x2_rn(v[6], v[7]));
    }
    static __device__ __forceinline__ void zero_store(elem *zr, int64_t j) {
        reinterpret_cast<uint4 *>(zr)[j] = make_uint4(0u, 0u, 0u, 0u);
    }
};

/* A block's shared scalars: the warps' pairs, the block's pair (read by the cluster's other
 * blocks) and the row's -m log2 e and 1 / l. The persistent kernel alternates two of the
 * block pair by row parity (ce_row_finish). */
struct ce_row_shared {
    float part_m[CE_CL_WARPS], part_s[CE_CL_WARPS];
    float blk_m[2], blk_s[2], row_nm, row_rl;
};

/* The thread's (mt, st) over its slots of the block's slice [0, ns) (slice slot k is the row's
 * slot s0 + k): slots tid, tid + CE_CL_THREADS, ... in groups of Slot::G, -inf past the slice
 * or the row. load(k) gives slice slot k. Only slots k = tid (mod CE_CL_THREADS) are touched,
 * here and in ce_row_finish: a thread's slice slots are its own. */
template <class Slot, class Load>
static __device__ __forceinline__ void ce_slice_stats(int64_t ns, int64_t s0, int64_t V,
                                                      Load load, float &mt, float &st) {
    constexpr int W = Slot::W, G = Slot::G;
    constexpr int64_t STEP = (int64_t)CE_CL_THREADS * G;
    mt = -INFINITY;
    st = 0.0f;
    for (int64_t k0 = threadIdx.x; k0 < ns; k0 += STEP) {
        float v[G * W];
#pragma unroll
        for (int g = 0; g < G; g++) {
            const int64_t k = k0 + (int64_t)g * CE_CL_THREADS, c = (s0 + k) * W;
            if (k < ns) Slot::vals(load(k), v + W * g);
            if (k >= ns || c + W > V) { /* past the slice or the row: -inf, exact zero terms */
#pragma unroll
                for (int q = 0; q < W; q++)
                    if (k >= ns || c + q >= V) v[W * g + q] = -INFINITY;
            }
        }
        ce_p1_group<G * W>(mt, st, v);
    }
}

/* Row i's merge and gradient, once every thread of the cluster has its (mt, st) and its slice
 * slots [s0, s0 + ns) of the row in `slice`: the block's pair, the cluster's pairs merged in
 * rank order (lanes q < CE_CL of warp 0 each read rank q's pair through distributed shared
 * memory, one round trip, then every lane merges them from rank 0 up: the same operations in
 * every block, so the same row m, l), m, l and zt written, then g stored in place from the
 * slice. The cluster barrier orders every block's loads of the row before any store to it
 * (with f32 logits a store of slot j lands on slot j / 2's bytes, another block's; with bf16
 * logits on slot j's own bytes) and makes the blocks' pairs visible.
 * PERSIST (rows_pipe_kernel, rows of one parity par in turn): the block pair lives in
 * blk_*[par], which no block rewrites before every block has passed the next row's barrier,
 * hence finished reading this one, so a block barrier suffices for row_nm, row_rl (the caller
 * ends with a cluster barrier after its last row). Else (one row, then the block exits) a second
 * cluster barrier keeps the pairs alive until every block has read them. */
template <class Slot, bool PERSIST>
static __device__ __forceinline__ void ce_row_finish(ce_row_shared &sh, int par, int64_t i,
                                                     const typename Slot::raw *slice, int64_t s0,
                                                     int64_t ns, int64_t V,
                                                     typename Slot::elem *zr, int64_t t,
                                                     float *m, float *l, float *zt, float gs,
                                                     float mt, float st) {
    constexpr int W = Slot::W;
    static_assert(CE_CL <= 32, "one lane of warp 0 a block of the cluster");
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = (int)cluster.block_rank(), tid = threadIdx.x;
    float bm, bs;
    ce_block_pair<CE_CL_WARPS>(mt, st, sh.part_m, sh.part_s, bm, bs);
    if (tid == 0) {
        sh.blk_m[par] = bm;
        sh.blk_s[par] = bs;
    }
    cluster.sync(); /* every block's slice loaded and its (m, s) written */
    if (tid < 32) {
        const int q = tid < CE_CL ? tid : 0;
        const float qm = *cluster.map_shared_rank(&sh.blk_m[par], q);
        const float qs = *cluster.map_shared_rank(&sh.blk_s[par], q);
        float bm = __shfl_sync(0xffffffffu, qm, 0), bs = __shfl_sync(0xffffffffu, qs, 0);
#pragma unroll
        for (int r = 1; r < CE_CL; r++)
            ce_merge(bm, bs, __shfl_sync(0xffffffffu, qm, r), __shfl_sync(0xffffffffu, qs, r));
        if (tid == 0) {
            if (rank == 0) {
                m[i] = bm;
                l[i] = bs;
            }
            const int64_t ts = t / W;
            if (ts >= s0 && ts < s0 + ns) {
                float v[W];
                Slot::vals(slice[ts - s0], v);
                float x = v[0];
#pragma unroll
                for (int q = 1; q < W; q++) /* selects: no local-memory index */
                    x = (int)(t % W) == q ? v[q] : x;
                zt[i] = x;
            }
            sh.row_nm = -bm * KILN_LOG2E;
            sh.row_rl = 1.0f / bs;
        }
    }
    if (PERSIST)
        __syncthreads(); /* row_nm, row_rl visible to the block */
    else
        cluster.sync(); /* every remote read done; row_nm, row_rl visible to the block */
    const float nm = sh.row_nm, rl = sh.row_rl;
    for (int64_t k = tid; k < ns; k += CE_CL_THREADS)
        Slot::grad_store(zr, s0 + k, slice[k], V, t, nm, rl, gs);
}

/* The block's slice of the row's slots: [s0, s0 + ns). */
static __device__ __forceinline__ void ce_slice_range(int rank, int64_t per, int64_t slots,
                                                      int64_t &s0, int64_t &ns) {
    s0 = rank * per < slots ? rank * per : slots;
    const int64_t s1 = s0 + per < slots ? s0 + per : slots;
    ns = s1 - s0;
}

/* One cluster a row (grid: R clusters); the slice is loaded by the statistics' walk itself.
 * Where rows_pipe_kernel's two slices a block do not fit. */
template <class Slot>
static __global__ void __cluster_dims__(CE_CL, 1, 1) __launch_bounds__(CE_CL_THREADS,
                                                                       Slot::MIN_BLOCKS)
rows_cluster_kernel(typename Slot::elem *z, int64_t ldz, int64_t Rs, int64_t V, int64_t per,
                    const int32_t *__restrict__ tgt, float *__restrict__ m,
                    float *__restrict__ l, float *__restrict__ zt, float gs) {
    typedef typename Slot::raw raw;
    extern __shared__ uint4 slice_mem[];
    raw *slice = reinterpret_cast<raw *>(slice_mem); /* per slots */
    __shared__ ce_row_shared sh;
    const int rank = (int)cg::this_cluster().block_rank();
    const int64_t i = blockIdx.x / CE_CL; /* the row: uniform per cluster */
    int64_t s0, ns;
    ce_slice_range(rank, per, (V + Slot::W - 1) / Slot::W, s0, ns);
    typename Slot::elem *zr = z + i * ldz;
    if (i >= Rs) { /* a padding row: zeros (nothing reads its logits) */
        for (int64_t k = threadIdx.x; k < ns; k += CE_CL_THREADS) Slot::zero_store(zr, s0 + k);
        return;
    }
    float mt, st;
    ce_slice_stats<Slot>(ns, s0, V, [&](int64_t k) {
        const raw x = Slot::load(zr, s0 + k);
        slice[k] = x;
        return x;
    }, mt, st);
    ce_row_finish<Slot, false>(sh, 0, i, slice, s0, ns, V, zr, tgt[i], m, l, zt, gs, mt, st);
}

/* The same rows and arithmetic, each row's bits as rows_cluster_kernel's, by persistent
 * clusters (grid: as many clusters as fit the GPU at once, cluster c taking rows c, c + nc,
 * ...) that load the next row's slice while working on this one, with one cluster barrier a
 * row (ce_row_finish, PERSIST). A cluster's row is a chain of waits: the slice's loads, the
 * block's merge, the cluster barrier, the cluster's merge, the gradient; rows_cluster_kernel
 * moved about 2.5 TB/s. Loading one row ahead alone took 519 -> 501 us a block of 2048 rows
 * at V 151,936 (H200), so the loads were not the chain's long part; the merge's remote reads
 * in one round trip and one barrier fewer a row shorten the rest (447 us: bench/RESULTS.md,
 * 2026-12-02, 75eedd8; three slices a block, two rows ahead, were no faster: 456d69a). Two
 * slices a block, this row's and the next's: each thread copies its own slice slots by
 * cp.async (16 bytes each, through L2), so no barrier guards the buffers (a thread's slots
 * are its own; see ce_slice_stats). */
template <class Slot>
static __global__ void __cluster_dims__(CE_CL, 1, 1) __launch_bounds__(CE_CL_THREADS, 2)
rows_pipe_kernel(typename Slot::elem *z, int64_t ldz, int64_t R, int64_t Rs, int64_t V,
                 int64_t per, const int32_t *__restrict__ tgt, float *__restrict__ m,
                 float *__restrict__ l, float *__restrict__ zt, float gs) {
    constexpr int NBUF = 2; /* slices a block: one row ahead */
    typedef typename Slot::raw raw;
    extern __shared__ uint4 slice_mem[];
    raw *slices = reinterpret_cast<raw *>(slice_mem); /* NBUF x per slots */
    __shared__ ce_row_shared sh;
    const int rank = (int)cg::this_cluster().block_rank();
    const int64_t nc = gridDim.x / CE_CL, c = blockIdx.x / CE_CL;
    int64_t s0, ns;
    ce_slice_range(rank, per, (V + Slot::W - 1) / Slot::W, s0, ns);
    auto prefetch = [&](int64_t i, int buf) { /* row i's slice into buffer buf, one group */
        if (i < Rs) {
            const raw *src = reinterpret_cast<const raw *>(z + i * ldz) + s0;
            raw *dst = slices + buf * per;
            for (int64_t k = threadIdx.x; k < ns; k += CE_CL_THREADS) cp_async16(dst + k, src + k);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int b = 0; b < NBUF - 1; b++) prefetch(c + b * nc, b);
    int buf = 0, par = 0; /* par: the block pair's parity, one step a merged row */
    for (int64_t i = c; i < R; i += nc, buf = buf + 1 < NBUF ? buf + 1 : 0) {
        /* the buffer before buf: its slots were last read by this thread, a row ago */
        prefetch(i + (NBUF - 1) * nc, buf > 0 ? buf - 1 : NBUF - 1);
        typename Slot::elem *zr = z + i * ldz;
        if (i >= Rs) { /* a padding row (uniform per cluster): zeros */
            for (int64_t k = threadIdx.x; k < ns; k += CE_CL_THREADS)
                Slot::zero_store(zr, s0 + k);
            continue;
        }
        cp_async_wait<NBUF - 1>(); /* row i's slots of this thread have landed */
        const raw *slice = slices + buf * per;
        float mt, st;
        ce_slice_stats<Slot>(ns, s0, V, [&](int64_t k) { return slice[k]; }, mt, st);
        ce_row_finish<Slot, true>(sh, par, i, slice, s0, ns, V, zr, tgt[i], m, l, zt, gs, mt,
                                  st);
        par ^= 1;
    }
    cp_async_wait<0>();
    cg::this_cluster().sync(); /* the last row's pairs stay until every block has read them */
}

/* Lets kernel ask for smem bytes of dynamic shared memory (over the default 48 KiB). */
template <class K>
static bool ce_smem_attr(kiln_backend *be, K kernel, size_t smem) {
    return smem <= 48 * 1024 ||
           kiln_cuda_check(be, cudaFuncSetAttribute(kernel,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    (int)smem),
                           "fused_ce row block (fast): shared memory");
}

/* How many clusters of rows_pipe_kernel<Slot> with smem bytes of slices a block the current
 * device runs at once (0: none, or the query failed: the caller keeps rows_cluster_kernel).
 * Asked once per (device, smem) and remembered. */
template <class Slot>
static int ce_rows_pipe_clusters(size_t smem) {
    static std::atomic<long long> memo{-1}; /* device << 40 | smem << 8 | clusters (< 256) */
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    const long long key = ((long long)dev << 40) | ((long long)smem << 8);
    const long long got = memo.load();
    if (got >= 0 && (got & ~0xffLL) == key) return (int)(got & 0xff);
    int n = 0, maxsm = 0;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(CE_CL, 1, 1);
    cfg.blockDim = dim3(CE_CL_THREADS, 1, 1);
    cfg.dynamicSmemBytes = smem;
    if (cudaDeviceGetAttribute(&maxsm, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
            cudaSuccess ||
        smem > (size_t)maxsm ||
        cudaFuncSetAttribute(rows_pipe_kernel<Slot>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)smem) != cudaSuccess ||
        cudaOccupancyMaxActiveClusters(&n, rows_pipe_kernel<Slot>, &cfg) != cudaSuccess) {
        (void)cudaGetLastError(); /* not an error of the stream: the other kernel runs instead */
        n = 0;
    }
    n = n < 0 ? 0 : n > 255 ? 255 : n;
    memo.store(key | n);
    return n;
}

/* The rows in clusters of CE_CL blocks, slices of per slots: rows_pipe_kernel's persistent
 * clusters where two slices a block fit, else one cluster a row (rows_cluster_kernel: 12.06
 * against 11.44 ms for the loss at the 0.5B head, bench/RESULTS.md, 2026-12-02, 75eedd8). */
template <class Slot>
static kiln_status ce_rows_cluster_launch(kiln_backend *be, typename Slot::elem *z, int64_t ldz,
                                          int64_t R, int64_t Rs, int64_t V, int64_t per,
                                          const int32_t *tgt, float *m, float *l, float *zt,
                                          float gs) {
    const size_t smem = (size_t)per * sizeof(typename Slot::raw);
    const int nc = ce_rows_pipe_clusters<Slot>(2 * smem);
    if (nc > 0) {
        const int64_t grid = (R < nc ? R : nc) * CE_CL;
        rows_pipe_kernel<Slot><<<(unsigned)grid, CE_CL_THREADS, 2 * smem, kiln_cuda_stream(be)>>>(
            z, ldz, R, Rs, V, per, tgt, m, l, zt, gs);
        return ce_launched(be, "fused_ce row block (fast, persistent clusters)");
    }
    if (!ce_smem_attr(be, rows_cluster_kernel<Slot>, smem)) return kiln_backend_status(be);
    rows_cluster_kernel<Slot><<<(unsigned)(R * CE_CL), CE_CL_THREADS, smem,
                                kiln_cuda_stream(be)>>>(z, ldz, Rs, V, per, tgt, m, l, zt, gs);
    return ce_launched(be, "fused_ce row block (fast, clusters)");
}

extern "C" kiln_status kiln_cuda_ce_rows_fast(kiln_backend *be, void *z, int64_t ldz,
                                              int64_t R, int64_t Rs, int64_t V, int z16,
                                              const int32_t *tgt, float *m, float *l, float *zt,
                                              float gs) {
    CE_BEGIN(be);
    if (Rs < 0 || Rs > R || V <= 0 || ldz < V || ldz % 8 != 0 || ((uintptr_t)z & 15u) != 0 ||
        (z16 && V > KILN_CUDA_CE_ROWS16_MAX_V))
        return kiln_cuda_fail(be, KILN_ERR_INVALID_ARG,
                              "fused_ce row block (fast): rows %lld of %lld, V %lld, ld %lld%s",
                              (long long)Rs, (long long)R, (long long)V, (long long)ldz,
                              z16 ? ", bf16 logits" : "");
    if (R <= 0) return KILN_OK;
    const bool clusters_fit = R <= (int64_t)0x7fffffff / CE_CL; /* the grid's blocks */
    if (z16 && !clusters_fit)
        return kiln_cuda_fail(be, KILN_ERR_INVALID_ARG,
                              "fused_ce row block (fast): %lld rows, bf16 logits", (long long)R);
    if (z16) { /* 8 columns a slot; V <= KILN_CUDA_CE_ROWS16_MAX_V keeps per within the cap */
        const int64_t per = ((V + 7) / 8 + CE_CL - 1) / CE_CL;
        return ce_rows_cluster_launch<ce_slot_bf16>(be, (uint16_t *)z, ldz, R, Rs, V, per, tgt, m,
                                                    l, zt, gs);
    }
    const int64_t slots = (V + 3) / 4, per = (slots + CE_CL - 1) / CE_CL;
    if (per <= CE_CL_MAX_SLOTS && clusters_fit)
        return ce_rows_cluster_launch<ce_slot_f32>(be, (float *)z, ldz, R, Rs, V, per, tgt, m, l,
                                                   zt, gs);
    const unsigned blocks = (unsigned)(R < (1 << 20) ? R : (1 << 20));
    rows_fast_kernel<<<blocks, CE_FAST_THREADS, 0, kiln_cuda_stream(be)>>>(
        (float *)z, ldz, R, Rs, V, tgt, m, l, zt, gs);
    return ce_launched(be, "fused_ce row block (fast)");
}

/* The GEMM module's rule (bf16_in_place in cuda_matmul.cu): rows
 * that start 16-byte aligned are read in place; a copy would have other alignments and leading
 * dimension, hence possibly another algorithm and other bits. */
extern "C" bool kiln_cuda_ce_weight_in_place(const void *w, size_t row_bytes, kiln_dtype dt) {
    return dt == KILN_DTYPE_BF16 && ((uintptr_t)w & 15u) == 0 && row_bytes % 16 == 0;
}

/* A failed GEMM-module call: poison the backend with the module's message. */
static kiln_status ce_gemm_failed(kiln_backend *be, kiln_cuda_gemm *g, cudaError_t e,
                                  const char *what) {
    return kiln_cuda_fail(be, KILN_ERR_INTERNAL, "fused_ce %s (fast gemm): %s (%s)", what,
                          kiln_cuda_gemm_error(g), cudaGetErrorName(e));
}

extern "C" kiln_status kiln_cuda_ce_weight_bf16(kiln_backend *be, uint16_t *dst, int64_t ld,
                                                const void *w, size_t row_bytes, kiln_dtype dt,
                                                int64_t n, int64_t H) {
    CE_BEGIN(be);
    if (n <= 0 || H <= 0) return KILN_OK;
    if (!ce_run_dst_ok(dst, ld, H) || (dt != KILN_DTYPE_F32 && dt != KILN_DTYPE_BF16))
        return kiln_cuda_fail(be, KILN_ERR_INVALID_ARG,
                              "fused_ce weight (bf16): dtype %d, H %lld, ld %lld", (int)dt,
                              (long long)H, (long long)ld);
    cudaError_t e = kiln_cuda_weights_to_bf16(kiln_cuda_stream(be), dst, ld, (const uint8_t *)w,
                                              row_bytes, dt, n, H);
    if (!kiln_cuda_check(be, e, "fused_ce weight (bf16)")) return kiln_backend_status(be);
    return KILN_OK;
}

extern "C" kiln_status kiln_cuda_ce_linear_bf16(kiln_backend *be, float *z, const uint16_t *hsb,
                                                int64_t ldh, const void *w, size_t row_bytes,
                                                kiln_dtype dt, int64_t n, int64_t H, int64_t S) {
    CE_BEGIN(be);
    if (S > 0x7fffffff)
        return kiln_cuda_fail(be, KILN_ERR_INVALID_ARG, "fused_ce logits (bf16): %lld rows",
                              (long long)S);
    kiln_cuda_gemm *g = kiln_cuda_backend_gemm(be);
    if (!g) return kiln_backend_status(be);
    cudaError_t e = kiln_cuda_gemm_linear_bf16(g, kiln_cuda_stream(be), z, hsb, ldh,
                                               (const uint8_t *)w, row_bytes, dt, n, H, NULL,
                                               (int)S, 0);
    return e == cudaSuccess ? KILN_OK : ce_gemm_failed(be, g, e, "logits");
}

extern "C" kiln_status kiln_cuda_ce_gemm_bf16(kiln_backend *be, int trans_a, int trans_b,
                                              int64_t M, int64_t N, int64_t K, const uint16_t *A,
                                              int64_t lda, const uint16_t *B, int64_t ldb,
                                              float *D, int64_t ldd, int accumulate) {
    CE_BEGIN(be);
    kiln_cuda_gemm *g = kiln_cuda_backend_gemm(be);
    if (!g) return kiln_backend_status(be);
    cudaError_t e = kiln_cuda_gemm_bf16(g, kiln_cuda_stream(be), trans_a, trans_b, M, N, K, A,
                                        lda, B, ldb, D, ldd, accumulate);
    return e == cudaSuccess ? KILN_OK : ce_gemm_failed(be, g, e, "product");
}

extern "C" kiln_status kiln_cuda_ce_gemm_bf16_out16(kiln_backend *be, int trans_a, int trans_b,
                                                    int64_t M, int64_t N, int64_t K,
                                                    const uint16_t *A, int64_t lda,
                                                    const uint16_t *B, int64_t ldb, uint16_t *D,
                                                    int64_t ldd) {
    CE_BEGIN(be);
    kiln_cuda_gemm *g = kiln_cuda_backend_gemm(be);
    if (!g) return kiln_backend_status(be);
    cudaError_t e = kiln_cuda_gemm_bf16_out16(g, kiln_cuda_stream(be), trans_a, trans_b, M, N, K,
                                              A, lda, B, ldb, D, ldd);
    return e == cudaSuccess ? KILN_OK : ce_gemm_failed(be, g, e, "product (bf16 out)");
}

static std::atomic<int> g_ce_legacy{0};

extern "C" void kiln_cuda_ce_set_legacy(int on) { g_ce_legacy.store(on != 0); }

extern "C" int kiln_cuda_ce_legacy(void) { return g_ce_legacy.load(); }
