/*
 * cpu_adamw.c -- AdamW's ops (src/ops/adamw_op.h) on host memory: the reference. torch's
 * single-tensor AdamW in float32 operation order with the storage variants of adamw_math.h
 * (whose per-element arithmetic the CUDA kernels share), and torch's clip_grad_norm_
 * arithmetic; the definitions are in docs/ARITHMETIC.md, "AdamW and clipping".
 *
 * The work is cut into chunks of CPU_ADAMW_CHUNK elements of one tensor, each a task of the
 * pool; every element is updated alone and every norm is one task's sequential sum, so the
 * split changes no bit. The workspace holds the chunk list, the finite check's result per
 * chunk and the per-tensor norms.
 */
#include "../adamw_op.h"

#include "../../base/cpu_features.h"
#include "../../base/kmath.h"
#include "../../base/tensor.h"
#include "cpu_train.h"

#include <math.h>
#include <string.h>

/* Elements per task (a multiple of KILN_ADAMW_Q8_BLOCK so that every 8-bit block belongs to
 * one task). */
#define CPU_ADAMW_CHUNK 16384

typedef struct adamw_chunk {
    int param;
    int64_t start, len; /* start a multiple of CPU_ADAMW_CHUNK */
} adamw_chunk;

/* The workspace's regions: chunks (n_chunks, in tensor order, then element order), bad
 * (n_chunks: the finite check's first bad element of each chunk, or -1) and norms (P). */
typedef struct adamw_ws {
    adamw_chunk *chunks;
    int64_t *bad;
    float *norms;
    int n_chunks;
} adamw_ws;

/* The regions of ws for tab (ws NULL: sizes only); returns the bytes, 0 on overflow (more
 * chunks than the pool's int task count; prepare is never reached then). */
static size_t ws_layout(const kiln_adamw_table *tab, void *ws, adamw_ws *w) {
    if (w) memset(w, 0, sizeof *w);
    int64_t n_chunks = 0;
    for (int i = 0; i < tab->P; i++) {
        n_chunks += (tab->t[i].n + CPU_ADAMW_CHUNK - 1) / CPU_ADAMW_CHUNK;
        if (n_chunks > INT32_MAX) return 0;
    }
    const size_t cb = ((size_t)n_chunks * sizeof(adamw_chunk) + 63) & ~(size_t)63;
    const size_t bb = ((size_t)n_chunks * sizeof(int64_t) + 63) & ~(size_t)63;
    const size_t nb = ((size_t)tab->P * sizeof(float) + 63) & ~(size_t)63;
    if (w) {
        uint8_t *base = ws;
        w->chunks = (adamw_chunk *)(void *)base;
        w->bad = (int64_t *)(void *)(base + cb);
        w->norms = (float *)(void *)(base + cb + bb);
        w->n_chunks = (int)n_chunks;
    }
    return cb + bb + nb;
}

/* ---- prepare ------------------------------------------------------------------------------ */

size_t kiln_cpu_adamw_workspace(const kiln_adamw_table *tab) {
    return ws_layout(tab, NULL, NULL);
}

kiln_status kiln_cpu_adamw_prepare(kiln_pool *pool, const kiln_adamw_table *tab, void *ws,
                                   int init) {
    (void)pool;
    adamw_ws w;
    ws_layout(tab, ws, &w);
    int c = 0;
    for (int i = 0; i < tab->P; i++) {
        const kiln_adamw_tensor *t = &tab->t[i];
        for (int64_t st = 0; st < t->n; st += CPU_ADAMW_CHUNK) {
            w.chunks[c].param = i;
            w.chunks[c].start = st;
            w.chunks[c].len = t->n - st < CPU_ADAMW_CHUNK ? t->n - st : CPU_ADAMW_CHUNK;
            c++;
        }
        if (!init) continue;
        const size_t n = (size_t)t->n, nb = (n + KILN_ADAMW_Q8_BLOCK - 1) / KILN_ADAMW_Q8_BLOCK;
        if (tab->moments == KILN_ADAMW_MOMENTS_Q8) {
            memset(t->mq, 0, n);
            memset(t->vq, 0, n);
            memset(t->ms, 0, nb * sizeof(float));
            memset(t->vs, 0, nb * sizeof(float));
        } else {
            memset(t->m, 0, n * sizeof(float));
            memset(t->v, 0, n * sizeof(float));
        }
        if (tab->weights == KILN_ADAMW_BF16_MASTER) {
            const uint16_t *wb = t->weights;
            for (int64_t e = 0; e < t->n; e++) t->master[e] = kiln_bf16_to_fp32(wb[e]);
        } else if (tab->weights == KILN_ADAMW_BF16_KAHAN) {
            memset(t->comp, 0, n * sizeof(uint16_t));
        }
    }
    return KILN_OK;
}

/* ---- finite check ------------------------------------------------------------------------ */

typedef struct finite_ctx {
    const kiln_adamw_table *tab;
    const adamw_ws *w;
} finite_ctx;

static void finite_task(void *vctx, int task, int thread) {
    (void)thread;
    const finite_ctx *ctx = vctx;
    const adamw_chunk *ch = &ctx->w->chunks[task];
    const float *g = ctx->tab->t[ch->param].grad + ch->start;
    int64_t bad = -1;
    /* blocks of 256 with a branch-free test (vectorized), the element found only in a block
     * that has one */
    for (int64_t b0 = 0; b0 < ch->len && bad < 0; b0 += 256) {
        const int64_t n = ch->len - b0 < 256 ? ch->len - b0 : 256;
        uint32_t any = 0;
        for (int64_t i = 0; i < n; i++)
            any |= (uint32_t)((kiln_f32_bits(g[b0 + i]) & 0x7f800000u) == 0x7f800000u);
        for (int64_t i = 0; any && i < n; i++)
            if ((kiln_f32_bits(g[b0 + i]) & 0x7f800000u) == 0x7f800000u) {
                bad = ch->start + b0 + i;
                break;
            }
    }
    ctx->w->bad[task] = bad;
}

kiln_status kiln_cpu_adamw_nonfinite(kiln_pool *pool, const kiln_adamw_table *tab, void *ws,
                                     int64_t *bad) {
    adamw_ws w;
    ws_layout(tab, ws, &w);
    finite_ctx ctx = {tab, &w};
    kiln_pool_run(pool, w.n_chunks, finite_task, &ctx);
    for (int i = 0; i < tab->P; i++) bad[i] = -1;
    /* a tensor's chunks in element order: its first bad chunk holds its lowest bad element */
    for (int c = 0; c < w.n_chunks; c++)
        if (w.bad[c] >= 0 && bad[w.chunks[c].param] < 0) bad[w.chunks[c].param] = w.bad[c];
    return KILN_OK;
}

/* ---- step -------------------------------------------------------------------------------- */

/* Update elements [start, start + len) of tensor pi, whose moments are f32 values m, v
 * (indexed from start). The body is compiled twice: plain (the portable path, where fmaf is
 * a libm call) and, on x86-64, for AVX2 + FMA, where fmaf is one vfmadd and the loops
 * vectorize. Every operation is an IEEE one, correctly rounded (fmaf, sqrtf, +, *, /; no
 * contraction: -ffp-contract=off), so both give the same bits (tests/c/test_adamw.c checks
 * it); the AVX2 one is chosen by kiln_cpu_select_path, as the backend's kernels are. */
#if defined(__x86_64__) && defined(__GNUC__)
#define ADAMW_HAVE_AVX2 1
#endif
static inline __attribute__((always_inline)) void update_range_body(
    const kiln_adamw_table *tab, const kiln_adamw_scalars *sc, int pi, int64_t start,
    int64_t len, float *m, float *v) {
    const kiln_adamw_tensor *s = &tab->t[pi];
    const int decay = s->decay && sc->use_wd;
    const float *g = s->grad + start;
    switch (tab->weights) {
    case KILN_ADAMW_F32: {
        float *w = (float *)s->weights + start;
        for (int64_t i = 0; i < len; i++) w[i] = kiln_adamw_update(sc, decay, w[i], g[i], &m[i], &v[i]);
        break;
    }
    case KILN_ADAMW_BF16_MASTER: {
        uint16_t *w = (uint16_t *)s->weights + start;
        float *ma = s->master + start;
        for (int64_t i = 0; i < len; i++) {
            float p = kiln_adamw_update(sc, decay, ma[i], g[i], &m[i], &v[i]);
            ma[i] = p;
            w[i] = kiln_fp32_to_bf16(p);
        }
        break;
    }
    case KILN_ADAMW_BF16_KAHAN: {
        uint16_t *w = (uint16_t *)s->weights + start;
        uint16_t *cp = s->comp + start;
        for (int64_t i = 0; i < len; i++) {
            float p = kiln_bf16_to_fp32(w[i]) + kiln_bf16_to_fp32(cp[i]);
            p = kiln_adamw_update(sc, decay, p, g[i], &m[i], &v[i]);
            uint16_t nw = kiln_fp32_to_bf16(p);
            w[i] = nw;
            cp[i] = kiln_fp32_to_bf16(p - kiln_bf16_to_fp32(nw));
        }
        break;
    }
    case KILN_ADAMW_BF16_SR: {
        uint16_t *w = (uint16_t *)s->weights + start;
        const uint64_t key = kiln_adamw_mix64(sc->sr_key + (uint64_t)pi);
        for (int64_t i = 0; i < len; i++) {
            float p = kiln_adamw_update(sc, decay, kiln_bf16_to_fp32(w[i]), g[i], &m[i], &v[i]);
            w[i] = kiln_adamw_bf16_stochastic(p, kiln_adamw_sr_bits(key, (uint64_t)(start + i)));
        }
        break;
    }
    }
}

static void update_range_plain(const kiln_adamw_table *tab, const kiln_adamw_scalars *sc, int pi,
                               int64_t start, int64_t len, float *m, float *v) {
    update_range_body(tab, sc, pi, start, len, m, v);
}

#ifdef ADAMW_HAVE_AVX2
__attribute__((target("avx2,fma"))) static void update_range_avx2(
    const kiln_adamw_table *tab, const kiln_adamw_scalars *sc, int pi, int64_t start,
    int64_t len, float *m, float *v) {
    update_range_body(tab, sc, pi, start, len, m, v);
}
#endif

typedef void (*update_range_fn)(const kiln_adamw_table *tab, const kiln_adamw_scalars *sc,
                                int pi, int64_t start, int64_t len, float *m, float *v);

/* The body for this CPU (and KILN_CPU_PATH). */
static update_range_fn update_range_for_cpu(void) {
#ifdef ADAMW_HAVE_AVX2
    if (kiln_cpu_select_path() >= KILN_CPU_PATH_AVX2) return update_range_avx2;
#endif
    return update_range_plain;
}

typedef struct step_ctx {
    const kiln_adamw_table *tab;
    const adamw_ws *w;
    const kiln_adamw_scalars *s;
    update_range_fn update_range;
} step_ctx;

static void step_task(void *vctx, int task, int thread) {
    (void)thread;
    const step_ctx *ctx = vctx;
    const adamw_chunk *ch = &ctx->w->chunks[task];
    const kiln_adamw_tensor *s = &ctx->tab->t[ch->param];
    if (ctx->tab->moments == KILN_ADAMW_MOMENTS_F32) {
        ctx->update_range(ctx->tab, ctx->s, ch->param, ch->start, ch->len, s->m + ch->start,
                          s->v + ch->start);
        return;
    }
    /* 8-bit: dequantize a block, update it in f32, requantize */
    float m[KILN_ADAMW_Q8_BLOCK], v[KILN_ADAMW_Q8_BLOCK];
    for (int64_t b0 = ch->start; b0 < ch->start + ch->len; b0 += KILN_ADAMW_Q8_BLOCK) {
        int len = (int)(s->n - b0 < KILN_ADAMW_Q8_BLOCK ? s->n - b0 : KILN_ADAMW_Q8_BLOCK);
        int64_t b = b0 / KILN_ADAMW_Q8_BLOCK;
        kiln_adamw_q8_dequant_block(s->mq + b0, s->vq + b0, s->ms[b], s->vs[b], m, v, len);
        ctx->update_range(ctx->tab, ctx->s, ch->param, b0, len, m, v);
        kiln_adamw_q8_quant_block(m, v, s->mq + b0, s->vq + b0, &s->ms[b], &s->vs[b], len);
    }
}

kiln_status kiln_cpu_adamw_step(kiln_pool *pool, const kiln_adamw_table *tab, void *ws,
                                const kiln_adamw_scalars *s) {
    adamw_ws w;
    ws_layout(tab, ws, &w);
    step_ctx ctx = {tab, &w, s, update_range_for_cpu()};
    kiln_pool_run(pool, w.n_chunks, step_task, &ctx);
    return KILN_OK;
}

/* ---- gradient norm and clipping ---------------------------------------------------------- */

typedef struct norm_ctx {
    const kiln_adamw_table *tab;
    float *norms;
} norm_ctx;

static void norm_task(void *vctx, int task, int thread) {
    (void)thread;
    const norm_ctx *c = vctx;
    const kiln_adamw_tensor *t = &c->tab->t[task];
    c->norms[task] = sqrtf(kiln_adamw_sumsq8(t->grad, t->n));
}

kiln_status kiln_cpu_adamw_grad_norm(kiln_pool *pool, const kiln_adamw_table *tab, void *ws,
                                     float *norms, float *sq_norm, float *total) {
    adamw_ws w;
    ws_layout(tab, ws, &w);
    norm_ctx c = {tab, w.norms};
    kiln_pool_run(pool, tab->P, norm_task, &c);
    float sq = kiln_adamw_sumsq8(w.norms, tab->P);
    if (norms) memcpy(norms, w.norms, (size_t)tab->P * sizeof(float));
    if (sq_norm) *sq_norm = sq;
    if (total) *total = sqrtf(sq);
    return KILN_OK;
}

typedef struct scale_ctx {
    const kiln_adamw_table *tab;
    const adamw_ws *w;
    float coef;
} scale_ctx;

static void scale_task(void *vctx, int task, int thread) {
    (void)thread;
    const scale_ctx *c = vctx;
    const adamw_chunk *ch = &c->w->chunks[task];
    float *g = c->tab->t[ch->param].grad + ch->start;
    for (int64_t i = 0; i < ch->len; i++) g[i] = g[i] * c->coef;
}

kiln_status kiln_cpu_adamw_clip(kiln_pool *pool, const kiln_adamw_table *tab, void *ws,
                                float max_norm_f, float *total_norm, float *coef) {
    float total;
    KILN_TRY(kiln_cpu_adamw_grad_norm(pool, tab, ws, NULL, NULL, &total));
    adamw_ws w;
    ws_layout(tab, ws, &w);
    scale_ctx c = {tab, &w, kiln_adamw_clip_coef(total, max_norm_f)}; /* NaN stays NaN */
    kiln_pool_run(pool, w.n_chunks, scale_task, &c);
    if (total_norm) *total_norm = total;
    if (coef) *coef = c.coef;
    return KILN_OK;
}
