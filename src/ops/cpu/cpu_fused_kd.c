/*
 * cpu_fused_kd.c -- the fused distillation loss (src/ops/fused_kd.h) on the CPU backend: the
 * reference. kiln_fused_kd checks the call and counts its S supervised rows; this is its body
 * on host memory. The student side is the cross-entropy's (cpu_fused_ce_impl.h): the rows are
 * gathered, each chunk's logits z(S, n) come from the backend's matmul, and pass 2's gradient
 * goes into dh and dW with the cross-entropy's products. What is this file's own is the row
 * work of the two passes, split over the backend's pool by rows (each row one task's, in the
 * serial order), so the results are the same bits for any thread count (docs/ARITHMETIC.md,
 * "Fused distillation loss").
 *
 * A row's chunk is worked through in blocks of KD_BLOCK columns with temporaries on the stack,
 * so the scratch is the cross-entropy's plus a few floats per row: the lane sums continue from
 * block to block (every block but the last is a multiple of 16 columns), so blocking changes
 * no bit.
 */
#include "../fused_kd.h"

#include "../../base/kmath.h"
#include "../../base/threadpool.h"
#include "../fused_ce_impl.h"
#include "cpu_fused_ce_impl.h"
#include "cpu_kernels.h"
#include "cpu_train.h"

#include <math.h>
#include <string.h>

/* Columns per block of a row's work: a multiple of KILN_DOT_LANES. */
#define KD_BLOCK 256

typedef struct kd_cpu_job {
    const kiln_fused_kd_params *p;
    kiln_ce_scratch *sc;       /* the student's rows and statistics at temperature 1 */
    kiln_kd_rows *rows;        /* the statistics at tau */
    const kiln_cpu_kernels *k;
    int64_t c0, n;             /* the chunk: columns [c0, c0 + n); its logits in sc->z (S, n) */
    int64_t teacher_ld;
    float kd_coef;             /* pass 2: kd_weight * tau */
    float gs;                  /* pass 2: the gradient's factor (scale / S or scale) */
} kd_cpu_job;

/* max(x[0..n)), n >= 1, in increasing index (a NaN never wins a comparison). */
static float row_max(const float *x, int64_t n) {
    float bm = x[0];
    for (int64_t c = 1; c < n; c++) bm = x[c] > bm ? x[c] : bm;
    return bm;
}

/* Pass 1 on rows [lo, hi) of one chunk, per row: the target's logit; the three maxima (the
 * student's logits, then s/tau and Z/tau as the maxima over tau: dividing by tau > 0 keeps the
 * order); the online rescale of the four sums; the chunk's lane sums of exp(s - m1),
 * exp(s/tau - ms), exp(Z/tau - mt) and exp(Z/tau - mt) * (Z/tau - s/tau). A teacher logit that
 * is not finite is noted (its first column) for the error after pass 1. */
static void kd_pass1_rows(const void *arg, int64_t lo, int64_t hi) {
    const kd_cpu_job *j = arg;
    kiln_ce_scratch *sc = j->sc;
    kiln_kd_rows *r = j->rows;
    const kiln_cpu_kernels *k = j->k;
    const int64_t n = j->n;
    const float tau = j->p->tau;
    float e[KD_BLOCK], zs[KD_BLOCK], u[KD_BLOCK], d[KD_BLOCK];
    for (int64_t i = lo; i < hi; i++) {
        const float *zr = sc->z + i * n;
        const float *tr = j->p->teacher_logits + sc->idx[i] * j->teacher_ld + j->c0;
        int64_t t = j->p->targets[sc->idx[i]] - j->c0;
        if (t >= 0 && t < n) sc->zt[i] = zr[t];
        for (int64_t c = 0; r->bad[i] < 0 && c < n; c++)
            if (!isfinite(tr[c])) r->bad[i] = j->c0 + c;
        const float bm = row_max(zr, n), bt = row_max(tr, n);
        const float m1 = bm > sc->m[i] ? bm : sc->m[i];
        const float ms = bm / tau > r->ms[i] ? bm / tau : r->ms[i];
        const float mt = bt / tau > r->mt[i] ? bt / tau : r->mt[i];
        const float alpha1 = kiln_expf(sc->m[i] - m1); /* first chunk: exp(-inf) = 0 */
        const float alphas = kiln_expf(r->ms[i] - ms);
        const float alphat = kiln_expf(r->mt[i] - mt);
        float s1[KILN_DOT_LANES] = {0}, ss[KILN_DOT_LANES] = {0};
        float st[KILN_DOT_LANES] = {0}, sa[KILN_DOT_LANES] = {0};
        for (int64_t b = 0; b < n; b += KD_BLOCK) {
            const int len = (int)(n - b < KD_BLOCK ? n - b : KD_BLOCK);
            k->exp_sub(e, zr + b, m1, len);
            k->dot_accum(s1, e, sc->ones, len);
            for (int c = 0; c < len; c++) zs[c] = zr[b + c] / tau;
            k->exp_sub(e, zs, ms, len);
            k->dot_accum(ss, e, sc->ones, len);
            for (int c = 0; c < len; c++) {
                u[c] = tr[b + c] / tau;
                d[c] = u[c] - zs[c];
            }
            k->exp_sub(e, u, mt, len);
            k->dot_accum(st, e, sc->ones, len);
            k->dot_accum(sa, e, d, len);
        }
        sc->l[i] = sc->l[i] * alpha1 + kiln_lane16_reduce(s1);
        sc->m[i] = m1;
        r->ls[i] = r->ls[i] * alphas + kiln_lane16_reduce(ss);
        r->ms[i] = ms;
        r->lt[i] = r->lt[i] * alphat + kiln_lane16_reduce(st);
        r->a[i] = r->a[i] * alphat + kiln_lane16_reduce(sa);
        r->mt[i] = mt;
    }
}

/* Pass 2 on rows [lo, hi) of one chunk: the chunk's logits turned into the gradient in place,
 *   g = (kd_coef * (q - p) + ce_weight * (softmax(s) - onehot)) * gs,
 * a term whose weight is 0 not computed (+0 in its place). */
static void kd_pass2_rows(const void *arg, int64_t lo, int64_t hi) {
    const kd_cpu_job *j = arg;
    const kiln_ce_scratch *sc = j->sc;
    const kiln_kd_rows *r = j->rows;
    const kiln_cpu_kernels *k = j->k;
    const int64_t n = j->n;
    const float tau = j->p->tau, cew = j->p->ce_weight, kd_coef = j->kd_coef, gs = j->gs;
    const int with_kd = j->p->kd_weight != 0.0f, with_ce = cew != 0.0f;
    float e1[KD_BLOCK], eq[KD_BLOCK], ep[KD_BLOCK], x[KD_BLOCK];
    for (int64_t i = lo; i < hi; i++) {
        float *zr = sc->z + i * n;
        const float *tr = j->p->teacher_logits + sc->idx[i] * j->teacher_ld + j->c0;
        const int64_t t = j->p->targets[sc->idx[i]] - j->c0;
        const float l1 = sc->l[i], ls = r->ls[i], lt = r->lt[i];
        for (int64_t b = 0; b < n; b += KD_BLOCK) {
            const int len = (int)(n - b < KD_BLOCK ? n - b : KD_BLOCK);
            if (with_ce) k->exp_sub(e1, zr + b, sc->m[i], len);
            if (with_kd) {
                for (int c = 0; c < len; c++) x[c] = zr[b + c] / tau;
                k->exp_sub(eq, x, r->ms[i], len);
                for (int c = 0; c < len; c++) x[c] = tr[b + c] / tau;
                k->exp_sub(ep, x, r->mt[i], len);
            }
            for (int c = 0; c < len; c++) {
                float kd = 0.0f, ce = 0.0f;
                if (with_kd) kd = kd_coef * ((eq[c] / ls) - (ep[c] / lt));
                if (with_ce) {
                    float sm = e1[c] / l1;
                    if (b + c == t) sm = sm - 1.0f;
                    ce = cew * sm;
                }
                zr[b + c] = (kd + ce) * gs;
            }
        }
    }
}

/* In an exact format's mode the student's head products run in the format, as the fused
 * cross-entropy's do (kiln_cpu_ce_grad_chunk). */
kiln_status kiln_cpu_fused_kd(kiln_backend *be, const kiln_fused_kd_params *p, int64_t S, kiln_fused_kd_result *out) {
    const kiln_fused_ce_params ce = kiln_kd_ce_view(p);
    const int64_t H = p->H, V = p->V, cn = kiln_ce_chunk(&ce);
    const int with_dh = p->dhidden != NULL, with_dw = p->dweight != NULL;
    kiln_ce_scratch sc;
    kiln_kd_rows rows;
    size_t bytes = kiln_kd_layout(S, H, cn, with_dh, with_dw, NULL, NULL, NULL);
    uint8_t *block = NULL;
    KILN_TRY(kiln_cpu_ce_alloc("fused_kd", bytes, S, cn, &block));
    kiln_kd_layout(S, H, cn, with_dh, with_dw, block, &sc, &rows);

    const kiln_cpu_kernels *k = kiln_cpu_ce_kernels(be);
    kiln_pool *pool = kiln_backend_cpu_pool(be);
    const size_t row_bytes = (size_t)H * (p->weight_dtype == KILN_DTYPE_BF16 ? 2 : 4);
    kiln_cpu_ce_prepare(&ce, &sc, S, cn);
    for (int64_t i = 0; i < S; i++) {
        rows.ms[i] = -INFINITY;
        rows.ls[i] = 0.0f;
        rows.mt[i] = -INFINITY;
        rows.lt[i] = 0.0f;
        rows.a[i] = 0.0f;
        rows.bad[i] = -1;
    }
    kd_cpu_job job = {p, &sc, &rows, k, 0, 0, p->teacher_ld > 0 ? p->teacher_ld : V,
                      p->kd_weight * p->tau, 0.0f};

    /* Pass 1: the online statistics, chunks ascending. */
    for (int64_t c0 = 0; c0 < V; c0 += cn) {
        job.c0 = c0;
        job.n = V - c0 < cn ? V - c0 : cn;
        kiln_ce_chunk_logits(be, &ce, sc.hs, S, c0, job.n, row_bytes, sc.z);
        kiln_cpu_ce_parallel(pool, S, 1, kd_pass1_rows, &job);
    }
    kiln_status st = kiln_kd_row_losses(p, &sc, &rows, S);
    if (st != KILN_OK) {
        kiln_free(block);
        return st;
    }
    float loss = 0.0f, kl = 0.0f, ce_part = 0.0f, gs = 0.0f;
    double loss64 = 0.0, part64 = 0.0;
    kiln_ce_reduce(&ce, sc.loss, kiln_cpu_ce_lane_sum(k, sc.loss, sc.ones, S), S, &loss, &gs,
                   &loss64);
    kiln_ce_reduce(&ce, rows.kl, kiln_cpu_ce_lane_sum(k, rows.kl, sc.ones, S), S, &kl, &gs,
                   &part64);
    kiln_ce_reduce(&ce, rows.ce, kiln_cpu_ce_lane_sum(k, rows.ce, sc.ones, S), S, &ce_part, &gs,
                   &part64);

    /* Pass 2: the gradient per chunk, into dh and dW. */
    if (with_dh || with_dw) {
        kiln_cpu_ce_grad_begin(be, &ce, &sc, S);
        job.gs = gs;
        for (int64_t c0 = 0; c0 < V; c0 += cn) {
            job.c0 = c0;
            job.n = V - c0 < cn ? V - c0 : cn;
            kiln_ce_chunk_logits(be, &ce, sc.hs, S, c0, job.n, row_bytes, sc.z);
            kiln_cpu_ce_parallel(pool, S, 1, kd_pass2_rows, &job);
            kiln_cpu_ce_grad_chunk(be, &ce, &sc, S, sc.z, c0, job.n);
        }
    }

    /* Outputs. */
    if (p->row_kl) kiln_cpu_ce_scatter_rows(p->row_kl, p->N, sc.idx, rows.kl, S);
    if (p->row_ce) kiln_cpu_ce_scatter_rows(p->row_ce, p->N, sc.idx, rows.ce, S);
    kiln_cpu_ce_write_dhidden(be, &ce, &sc, S);
    if (out) *out = (kiln_fused_kd_result){loss, kl, ce_part, loss64, S, bytes};
    kiln_free(block);
    return KILN_OK;
}
