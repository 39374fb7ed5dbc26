/*
 * cpu_fused_ce.c -- the fused linear cross-entropy (src/ops/fused_ce.h) on the CPU backend: the
 * reference. kiln_fused_ce checks the call and counts its S supervised rows; this is its body
 * on host memory, with the backend's matmul for the three products and the row work, the
 * transposes and the sums split over the backend's pool by rows or ranges (each output one
 * task's, in the serial order: kiln_cpu_ce_parallel), so the results are the same bits for any
 * thread count (docs/ARITHMETIC.md, "Fused linear cross-entropy"). The gathering and pass 2's
 * products are shared with the distillation loss (cpu_fused_ce_impl.h, cpu_fused_kd.c).
 */
#include "../fused_ce.h"

#include "../../base/kmath.h"
#include "../../base/tensor.h"
#include "../../base/threadpool.h"
#include "../fused_ce_impl.h"
#include "cpu_fused_ce_impl.h"
#include "cpu_kernels.h"
#include "cpu_train.h"

#include <math.h>
#include <string.h>

/* ---- helpers ------------------------------------------------------------------------------ */

/* dst(C, R) = src(R, C)^T, in 32 x 32 tiles (a copy: no arithmetic). */
/* Rows [rlo, rhi) of that transpose (the parallel pieces of transpose_f32). */
static void transpose_f32_rows(float *dst, const float *src, int64_t R, int64_t C, int64_t rlo,
                               int64_t rhi) {
    for (int64_t r0 = rlo; r0 < rhi; r0 += 32)
        for (int64_t c0 = 0; c0 < C; c0 += 32) {
            int64_t r1 = r0 + 32 < rhi ? r0 + 32 : rhi, c1 = c0 + 32 < C ? c0 + 32 : C;
            for (int64_t r = r0; r < r1; r++)
                for (int64_t c = c0; c < c1; c++) dst[c * R + r] = src[r * C + c];
        }
}

static void transpose_f32(float *dst, const float *src, int64_t R, int64_t C) {
    transpose_f32_rows(dst, src, R, C, 0, R);
}

/* dst(H, n) = W rows [rlo, rhi) of [0, n) transposed and widened to f32 (exact for bf16). */
static void transpose_weight_rows(float *dst, const void *w, kiln_dtype dt, int64_t n, int64_t H,
                                  int64_t rlo, int64_t rhi) {
    if (dt == KILN_DTYPE_F32) {
        transpose_f32_rows(dst, (const float *)w, n, H, rlo, rhi);
        return;
    }
    const uint16_t *b = (const uint16_t *)w;
    for (int64_t r0 = rlo; r0 < rhi; r0 += 32)
        for (int64_t c0 = 0; c0 < H; c0 += 32) {
            int64_t r1 = r0 + 32 < rhi ? r0 + 32 : rhi, c1 = c0 + 32 < H ? c0 + 32 : H;
            for (int64_t r = r0; r < r1; r++)
                for (int64_t c = c0; c < c1; c++) dst[c * n + r] = kiln_bf16_to_fp32(b[r * H + c]);
        }
}

const kiln_cpu_kernels *kiln_cpu_ce_kernels(const kiln_backend *be) {
#if defined(KILN_CPU_HAVE_X86)
    kiln_cpu_path path = kiln_backend_cpu_path(be);
    if (path == KILN_CPU_PATH_AVX512) return &kiln_cpu_kernels_avx512;
    if (path == KILN_CPU_PATH_AVX2) return &kiln_cpu_kernels_avx2;
#else
    (void)be;
#endif
    return &kiln_cpu_kernels_portable;
}

/* The defined sum of v[0..n): 16 lanes (lane i % 16), then the fixed tree -- the dot of v
 * with ones (fmaf(v, 1, acc) rounds exactly like v + acc). */
float kiln_cpu_ce_lane_sum(const kiln_cpu_kernels *k, const float *v, const float *ones,
                           int64_t n) {
    float acc[KILN_DOT_LANES] = {0};
    k->dot_accum(acc, v, ones, n);
    return kiln_lane16_reduce(acc);
}

/* ---- the row work on the backend's pool ---------------------------------------------------- */

typedef struct ce_par {
    kiln_cpu_ce_range_fn fn;
    const void *job;
    int64_t n, grain;
    int tasks;
} ce_par;

static void ce_par_task(void *arg, int task, int thread) {
    (void)thread;
    const ce_par *q = arg;
    int64_t per = (q->n + q->tasks - 1) / q->tasks;
    per = (per + q->grain - 1) / q->grain * q->grain;
    int64_t lo = (int64_t)task * per, hi = lo + per < q->n ? lo + per : q->n;
    if (lo < hi) q->fn(q->job, lo, hi);
}

void kiln_cpu_ce_parallel(kiln_pool *pool, int64_t n, int64_t grain, kiln_cpu_ce_range_fn fn,
                          const void *job) {
    int nt = pool ? kiln_pool_n_threads(pool) : 1;
    int64_t tasks = n / (grain * 8) + 1;
    if (tasks > 4 * (int64_t)nt) tasks = 4 * (int64_t)nt;
    if (nt <= 1 || tasks <= 1) {
        fn(job, 0, n);
        return;
    }
    ce_par q = {fn, job, n, grain, (int)tasks};
    kiln_pool_run(pool, (int)tasks, ce_par_task, &q);
}

/* Every piece below computes outputs of its own (rows of z and of the row statistics, rows of
 * a transpose, a range of a sum) in the serial code's order, so the split changes no bit. */
typedef struct ce_cpu_job {
    const kiln_fused_ce_params *p;
    kiln_ce_scratch *sc;
    const kiln_cpu_kernels *k;
    int64_t c0, n;    /* the chunk: columns [c0, c0 + n) */
    float *z;         /* the chunk's logits (S, n): sc->z, or its slot in p->keep */
    float gs;         /* the gradient's factor (pass 2) */
    float *dst;       /* transposes and sums: the destination */
    const float *src; /* ... and the source */
    const void *w;    /* the weight chunk's first row (its transpose) */
    int64_t rows, cols;
} ce_cpu_job;

/* Pass 1 on rows [lo, hi) of one chunk: the target's logit, the chunk's max, the online
 * rescale and the lane sum of the exponentials. */
static void ce_pass1_rows(const void *arg, int64_t lo, int64_t hi) {
    const ce_cpu_job *j = arg;
    kiln_ce_scratch *sc = j->sc;
    const int64_t n = j->n;
    for (int64_t i = lo; i < hi; i++) {
        const float *zr = j->z + i * n; /* the logits: left as they are when kept */
        float *er = sc->z + i * n;      /* their exponentials (in place when not kept) */
        int64_t t = j->p->targets[sc->idx[i]] - j->c0;
        if (t >= 0 && t < n) sc->zt[i] = zr[t];
        float bm = zr[0];
        for (int64_t c = 1; c < n; c++) bm = zr[c] > bm ? zr[c] : bm;
        float m_new = bm > sc->m[i] ? bm : sc->m[i];
        float alpha = kiln_expf(sc->m[i] - m_new); /* first chunk: exp(-inf) = 0 */
        j->k->exp_sub(er, zr, m_new, (int)n);
        float csum = kiln_cpu_ce_lane_sum(j->k, er, sc->ones, n);
        sc->l[i] = sc->l[i] * alpha + csum;
        sc->m[i] = m_new;
    }
}

/* Pass 2 on rows [lo, hi) of one chunk: g = (softmax - onehot) * gs in place. */
static void ce_pass2_rows(const void *arg, int64_t lo, int64_t hi) {
    const ce_cpu_job *j = arg;
    kiln_ce_scratch *sc = j->sc;
    const int64_t n = j->n;
    const float gs = j->gs;
    for (int64_t i = lo; i < hi; i++) {
        float *zr = j->z + i * n;
        float li = sc->l[i];
        int64_t t = j->p->targets[sc->idx[i]] - j->c0;
        j->k->exp_sub(zr, zr, sc->m[i], (int)n);
        float et = (t >= 0 && t < n) ? zr[t] : 0.0f;
        for (int64_t c = 0; c < n; c++) zr[c] = (zr[c] / li) * gs;
        if (t >= 0 && t < n) zr[t] = ((et / li) - 1.0f) * gs;
    }
}

static void ce_transpose_rows(const void *arg, int64_t lo, int64_t hi) {
    const ce_cpu_job *j = arg;
    transpose_f32_rows(j->dst, j->src, j->rows, j->cols, lo, hi);
}

/* The W chunk (n rows from src) transposed into dst(H, n), rows [lo, hi) of the chunk. */
static void ce_weight_t_rows(const void *arg, int64_t lo, int64_t hi) {
    const ce_cpu_job *j = arg;
    transpose_weight_rows(j->dst, j->w, j->p->weight_dtype, j->n, j->p->H, lo, hi);
}

static void ce_add_range(const void *arg, int64_t lo, int64_t hi) {
    const ce_cpu_job *j = arg;
    j->k->add(j->dst + lo, j->src + lo, (size_t)(hi - lo));
}

/* ---- the steps both fused losses take (cpu_fused_ce_impl.h) -------------------------------- */

void kiln_cpu_ce_prepare(const kiln_fused_ce_params *p, kiln_ce_scratch *sc, int64_t S,
                         int64_t cn) {
    const int64_t N = p->N, H = p->H;
    int64_t ones_n = cn > S ? cn : S;
    for (int64_t j = 0; j < ones_n; j++) sc->ones[j] = 1.0f;

    /* Gather (ascending positions): row n of hidden at n x ld elements, f32 or bf16 widened
     * (exact), so the gathered rows hold the same values either way. */
    const int64_t ld = p->hidden_ld > 0 ? p->hidden_ld : H;
    for (int64_t n = 0, i = 0; n < N; n++) {
        if ((p->mask && !p->mask[n]) || p->targets[n] < 0) continue;
        sc->idx[i] = n;
        if (p->hidden16) {
            const uint16_t *src = p->hidden16 + n * ld;
            for (int64_t j = 0; j < H; j++) sc->hs[i * H + j] = kiln_bf16_to_fp32(src[j]);
        } else {
            memcpy(sc->hs + i * H, p->hidden + n * ld, (size_t)H * sizeof(float));
        }
        i++;
    }
    for (int64_t i = 0; i < S; i++) {
        sc->m[i] = -INFINITY;
        sc->l[i] = 0.0f;
        sc->zt[i] = 0.0f;
    }
}

void kiln_cpu_ce_grad_begin(kiln_backend *be, const kiln_fused_ce_params *p, kiln_ce_scratch *sc,
                            int64_t S) {
    if (kiln_backend_cpu_weight_format(be, p->weight)) return; /* kiln_cpu_ce_grad_chunk: matmul_backward */
    if (p->dweight) transpose_f32(sc->hT, sc->hs, S, p->H);
    if (p->dhidden) memset(sc->dh_acc, 0, (size_t)S * (size_t)p->H * sizeof(float));
}

void kiln_cpu_ce_grad_chunk(kiln_backend *be, const kiln_fused_ce_params *p,
                            kiln_ce_scratch *sc, int64_t S, const float *g, int64_t c0,
                            int64_t n) {
    const int64_t H = p->H;
    const size_t row_bytes = (size_t)H * (p->weight_dtype == KILN_DTYPE_BF16 ? 2 : 4);
    kiln_pool *pool = kiln_backend_cpu_pool(be);
    if (kiln_backend_cpu_weight_format(be, p->weight)) {
        /* the head in an exact format: the chunk's backward is the backend's matmul_backward in the
         * format, dh_acc overwritten by the first chunk and added to by the later ones */
        kiln_tensor wc = kiln_ce_weight_chunk(p, c0, n, row_bytes);
        be->i->matmul_backward(be, p->dhidden ? sc->dh_acc : NULL, p->dweight ? p->dweight + c0 * H : NULL, NULL, g,
                               sc->hs, &wc, (int)S, c0 > 0);
        return;
    }
    ce_cpu_job job = {p, sc, kiln_cpu_ce_kernels(be), c0, n, NULL, 0.0f, NULL, NULL, NULL, 0, 0};
    if (p->dhidden) {
        job.dst = sc->wT;
        job.w = (const uint8_t *)p->weight + (size_t)c0 * row_bytes;
        kiln_cpu_ce_parallel(pool, n, 32, ce_weight_t_rows, &job);
        kiln_tensor wt = kiln_ce_f32_view("fused_ce.weight_chunk_t", sc->wT, H, n);
        kiln_backend_cpu_matmul_f32(be, sc->dpart, g, &wt, NULL, (int)S);
        job.dst = sc->dh_acc;
        job.src = sc->dpart;
        kiln_cpu_ce_parallel(pool, S * H, 4096, ce_add_range, &job);
    }
    if (p->dweight) {
        job.dst = sc->gT;
        job.src = g;
        job.rows = S;
        job.cols = n;
        kiln_cpu_ce_parallel(pool, S, 32, ce_transpose_rows, &job);
        kiln_tensor ht = kiln_ce_f32_view("fused_ce.hidden_t", sc->hT, H, S);
        kiln_backend_cpu_matmul_f32(be, sc->wpart, sc->gT, &ht, NULL, (int)n);
        job.dst = p->dweight + c0 * H;
        job.src = sc->wpart;
        kiln_cpu_ce_parallel(pool, n * H, 4096, ce_add_range, &job);
    }
}

void kiln_cpu_ce_write_dhidden(kiln_backend *be, const kiln_fused_ce_params *p,
                               const kiln_ce_scratch *sc, int64_t S) {
    const int64_t N = p->N, H = p->H;
    if (!p->dhidden) return;
    if (!p->dhidden_accumulate) {
        memset(p->dhidden, 0, (size_t)N * (size_t)H * sizeof(float));
        for (int64_t i = 0; i < S; i++)
            memcpy(p->dhidden + sc->idx[i] * H, sc->dh_acc + i * H, (size_t)H * sizeof(float));
    } else {
        const kiln_cpu_kernels *k = kiln_cpu_ce_kernels(be);
        for (int64_t i = 0; i < S; i++)
            k->add(p->dhidden + sc->idx[i] * H, sc->dh_acc + i * H, (size_t)H);
    }
}

kiln_status kiln_cpu_ce_alloc(const char *op, size_t bytes, int64_t S, int64_t cn,
                              uint8_t **block) {
    if (bytes == 0) return kiln_error(KILN_ERR_INVALID_ARG, "%s: scratch size overflows", op);
    *block = kiln_malloc(bytes);
    if (!*block)
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory for %zu bytes of scratch "
                          "(%lld supervised rows x chunk %lld)", op, bytes, (long long)S,
                          (long long)cn);
    return KILN_OK;
}

void kiln_cpu_ce_scatter_rows(float *dst, int64_t N, const int64_t *idx, const float *src,
                              int64_t S) {
    memset(dst, 0, (size_t)N * sizeof(float));
    for (int64_t i = 0; i < S; i++) dst[idx[i]] = src[i];
}

/* ---- the op ------------------------------------------------------------------------------- */

size_t kiln_cpu_fused_ce_workspace(kiln_backend *be, const kiln_fused_ce_params *p, int64_t S) {
    (void)be;
    return kiln_ce_layout(S, S, p->H, kiln_ce_chunk(p), p->dhidden != NULL, p->dweight != NULL,
                          KILN_CE_FULL, 0, 0, NULL, NULL);
}

static kiln_status kiln_cpu_fused_ce_body(kiln_backend *be, const kiln_fused_ce_params *p, int64_t S,
                              kiln_fused_ce_result *out) {
    const int64_t N = p->N, H = p->H, V = p->V, cn = kiln_ce_chunk(p);
    const int with_dh = p->dhidden != NULL, with_dw = p->dweight != NULL;
    kiln_ce_scratch sc;
    size_t bytes = kiln_ce_layout(S, S, H, cn, with_dh, with_dw, KILN_CE_FULL, 0, 0, NULL, NULL);
    uint8_t *block = NULL;
    KILN_TRY(kiln_cpu_ce_alloc("fused_ce", bytes, S, cn, &block));
    kiln_ce_layout(S, S, H, cn, with_dh, with_dw, KILN_CE_FULL, 0, 0, block, &sc);

    const kiln_cpu_kernels *k = kiln_cpu_ce_kernels(be);
    kiln_pool *pool = kiln_backend_cpu_pool(be);
    const size_t row_bytes = (size_t)H * (p->weight_dtype == KILN_DTYPE_BF16 ? 2 : 4);
    kiln_cpu_ce_prepare(p, &sc, S, cn);

    /* Pass 1: online log-sum-exp, chunks ascending (or its statistics from an earlier call). */
    if (p->row_stats_in)
        for (int64_t i = 0; i < S; i++) {
            const float *rs = p->row_stats_in + 3 * sc.idx[i];
            sc.m[i] = rs[0];
            sc.l[i] = rs[1];
            sc.zt[i] = rs[2];
        }
    ce_cpu_job job = {p, &sc, k, 0, 0, sc.z, 0.0f, NULL, NULL, NULL, 0, 0};
    /* the chunks whose logits p->keep holds: the first kept_chunks */
    const int64_t slot = S * cn;
    const int64_t kept_chunks = p->keep ? (int64_t)(p->keep_floats / (size_t)slot) : 0;
    for (int64_t c0 = 0; !p->row_stats_in && c0 < V; c0 += cn) {
        int64_t n = V - c0 < cn ? V - c0 : cn;
        job.z = c0 / cn < kept_chunks ? p->keep + (c0 / cn) * slot : sc.z;
        kiln_ce_chunk_logits(be, p, sc.hs, S, c0, n, row_bytes, job.z);
        job.c0 = c0;
        job.n = n;
        kiln_cpu_ce_parallel(pool, S, 1, ce_pass1_rows, &job);
    }
    if (p->row_stats_out)
        for (int64_t i = 0; i < S; i++) {
            float *rs = p->row_stats_out + 3 * sc.idx[i];
            rs[0] = sc.m[i];
            rs[1] = sc.l[i];
            rs[2] = sc.zt[i];
        }
    kiln_status lst = kiln_ce_row_losses(sc.idx, sc.m, sc.l, sc.zt, sc.loss, S);
    if (lst != KILN_OK) {
        kiln_free(block);
        return lst;
    }
    float loss = 0.0f, gs;
    double loss64 = 0.0;
    kiln_ce_reduce(p, sc.loss, kiln_cpu_ce_lane_sum(k, sc.loss, sc.ones, S), S, &loss, &gs,
                   &loss64);

    /* Pass 2: g = (softmax - onehot) * gs per chunk, into dh and dW. */
    if (with_dh || with_dw) {
        kiln_cpu_ce_grad_begin(be, p, &sc, S);
        job.gs = gs;
        for (int64_t c0 = 0; c0 < V; c0 += cn) {
            int64_t n = V - c0 < cn ? V - c0 : cn;
            float *g = c0 / cn < kept_chunks ? p->keep + (c0 / cn) * slot : sc.z;
            if (g == sc.z) kiln_ce_chunk_logits(be, p, sc.hs, S, c0, n, row_bytes, sc.z);
            job.z = g;
            job.c0 = c0;
            job.n = n;
            kiln_cpu_ce_parallel(pool, S, 1, ce_pass2_rows, &job);
            kiln_cpu_ce_grad_chunk(be, p, &sc, S, g, c0, n);
        }
    }

    /* Outputs. */
    if (p->row_loss) kiln_cpu_ce_scatter_rows(p->row_loss, N, sc.idx, sc.loss, S);
    kiln_cpu_ce_write_dhidden(be, p, &sc, S);
    if (out) {
        out->loss = loss;
        out->loss_f64 = loss64;
        out->n_supervised = S;
        out->scratch_bytes = bytes;
    }
    kiln_free(block);
    return KILN_OK;
}

/* In an exact format's mode the loss's products run in the format too (docs/ARITHMETIC.md,
 * "Training in a format"): the logits are the backend's matmul of hs and the weight's rows
 * (the chunk's quantized rows kept like any weight's), the gradients its matmul_backward. */
kiln_status kiln_cpu_fused_ce(kiln_backend *be, const kiln_fused_ce_params *p, int64_t S, kiln_fused_ce_result *out) {
    return kiln_cpu_fused_ce_body(be, p, S, out);
}
