/*
 * cpu_linear_attn.c -- the CPU backend's Qwen3.5 ops (ops.h, "Qwen3.5's ops"): the causal
 * depthwise convolution, the Gated DeltaNet recurrence and their backwards, the gates, the
 * output gate, halves of rows and the partial rotary embedding.
 *
 * This file is the reference of docs/ARITHMETIC.md, "Gated DeltaNet": every output element is
 * computed by one task in the order written there, so results do not depend on the thread
 * count. A state S is row-major (dk rows i, dv columns j): S[i * dv + j].
 */
#include "../ops.h"
#include "../../base/kmath.h"
#include "../../base/threadpool.h"
#include "cpu_train.h"

#include <string.h>

/* The hot loops run as an FMA build where the CPU has it (GCC and clang pick the clone at load
 * time): fmaf is one correctly rounded operation either way, so the bits are the same, but
 * without FMA hardware it is a library call. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
/* (not under the sanitizers: their instrumented ifunc resolvers run before the runtime starts) */
#define LA_HOT __attribute__((target_clones("fma", "default")))
#else
#define LA_HOT
#endif

static int la_n_tasks(kiln_pool *pool, double work, int64_t max_tasks) {
    int nt = kiln_pool_n_threads(pool);
    int n = (work < 65536.0 || nt <= 1) ? 1 : 4 * nt;
    if (n > max_tasks) n = (int)(max_tasks > 0 ? max_tasks : 1);
    return n;
}

static void la_split(int64_t n, int n_tasks, int task, int64_t *lo, int64_t *hi) {
    int64_t chunk = (n + n_tasks - 1) / n_tasks;
    *lo = (int64_t)task * chunk;
    *hi = *lo + chunk;
    if (*lo > n) *lo = n;
    if (*hi > n) *hi = n;
}

/* The batch's runs, or one run per token when runs is NULL (each at pos[n] of seq[n]). */
static kiln_batch_run la_run(const kiln_batch_run *runs, const int32_t *seq, const int32_t *pos, int r) {
    if (runs) return runs[r];
    kiln_batch_run one = {r, 1, seq[r], pos[r]};
    return one;
}

/* ---- conv1d_silu ------------------------------------------------------------------------ */

typedef struct conv_job {
    float *out, *state;
    const float *x, *w;
    const int32_t *seq, *pos;
    const kiln_batch_run *runs;
    int n_runs, CH, K, n_tasks;
} conv_job;

/* Per channel c (a task owns a range of channels), per run in order: the window of the K
 * inputs before and at each token (the sequence's state for positions before the run, zeros
 * before position 0), acc = 0, acc = fmaf(w[c,j], in_j, acc) for j ascending, out = silu(acc);
 * then the state keeps the last K-1 inputs. */
LA_HOT static void conv_task(void *arg, int task, int thread) {
    (void)thread;
    const conv_job *j = arg;
    int64_t lo, hi;
    la_split(j->CH, j->n_tasks, task, &lo, &hi);
    const int K = j->K, CH = j->CH;
    float win[64]; /* K <= 64 (checked by the caller) */
    for (int r = 0; r < j->n_runs; r++) {
        const kiln_batch_run run = la_run(j->runs, j->seq, j->pos, r);
        float *st = j->state && run.seq >= 0 ? j->state + (size_t)run.seq * (size_t)(K - 1) * CH : NULL;
        for (int64_t c = lo; c < hi; c++) {
            /* win[0..K-1): the inputs before the run's first token */
            for (int i = 0; i < K - 1; i++) win[i] = (st && run.pos0 > 0) ? st[(size_t)i * CH + c] : 0.0f;
            for (int t = 0; t < run.n; t++) {
                const size_t row = (size_t)(run.first + t);
                win[K - 1] = j->x[row * CH + c];
                float acc = 0.0f;
                for (int i = 0; i < K; i++) acc = fmaf(j->w[c * K + i], win[i], acc);
                j->out[row * CH + c] = kiln_silu(acc);
                memmove(win, win + 1, (size_t)(K - 1) * sizeof(float));
            }
            if (st)
                for (int i = 0; i < K - 1; i++) st[(size_t)i * CH + c] = win[i];
        }
    }
}

void kiln_cpu_conv1d_silu(kiln_pool *pool, float *out, const float *x, const float *w, float *state,
                          const int32_t *seq, const int32_t *pos, const kiln_batch_run *runs, int n_runs, int N,
                          int CH, int K) {
    if (N <= 0 || K < 1 || K > 64) return;
    conv_job j = {out, state, x, w, seq, pos, runs, runs ? n_runs : N, CH, K, 0};
    j.n_tasks = la_n_tasks(pool, (double)N * CH * K, (CH + 15) / 16);
    kiln_pool_run(pool, j.n_tasks, conv_task, &j);
}

typedef struct conv_bwd_job {
    float *dx, *dw;
    const float *dout, *x, *w;
    int n_seq, T, CH, K, n_tasks;
} conv_bwd_job;

/* One channel's input window value at position t of sequence b (0 before the sequence). */
static inline float conv_in(const conv_bwd_job *j, int b, int t, int64_t c) {
    return t < 0 ? 0.0f : j->x[((size_t)b * j->T + (size_t)t) * j->CH + (size_t)c];
}

/* Per channel c: dpre[t] = dout * silu'(pre) with pre recomputed as the forward does and
 * silu' = s (1 + pre (1 - s)), s = 1 / (1 + kiln_expf(-pre)) (swiglu_backward's form);
 * dx[t] = sum over i of dpre[t + K - 1 - i] w[c,i] within the sequence, acc = fmaf(dpre, w, acc)
 * for i descending (the outputs t, t + 1, ... in order); dw[c,i] += lane-16 over all tokens (sequence by
 * sequence, t ascending) of dpre[t] in(t - K + 1 + i). */
LA_HOT static void conv_bwd_task(void *arg, int task, int thread) {
    (void)thread;
    const conv_bwd_job *j = arg;
    int64_t lo, hi;
    la_split(j->CH, j->n_tasks, task, &lo, &hi);
    const int K = j->K, T = j->T, CH = j->CH;
    float acc[64][KILN_DOT_LANES];
    for (int64_t c = lo; c < hi; c++) {
        memset(acc, 0, sizeof acc);
        int64_t lane = 0;
        for (int b = 0; b < j->n_seq; b++) {
            /* dpre of the sequence's last K tokens, in a ring (dx[t] needs dpre[t..t+K-1]) */
            float ring[64];
            for (int t = 0; t < T + K - 1; t++) {
                /* dpre of token t (when t < T) */
                if (t < T) {
                    float pre = 0.0f;
                    for (int i = 0; i < K; i++) pre = fmaf(j->w[c * K + i], conv_in(j, b, t - K + 1 + i, c), pre);
                    const float e = kiln_expf(-pre), den = 1.0f + e, s = 1.0f / den;
                    const float d = j->dout[((size_t)b * T + (size_t)t) * CH + c];
                    const float dp = d * (s * (1.0f + pre * (1.0f - s)));
                    ring[t % K] = dp;
                    for (int i = 0; i < K; i++) {
                        float *a = &acc[i][lane % KILN_DOT_LANES];
                        *a = fmaf(dp, conv_in(j, b, t - K + 1 + i, c), *a);
                    }
                    lane++;
                }
                /* dx of token t - K + 1, whose outputs t - K + 1 .. t are known now */
                const int tx = t - K + 1;
                if (tx >= 0) {
                    float s = 0.0f;
                    for (int i = K - 1; i >= 0; i--) {
                        const int to = tx + K - 1 - i; /* the output that read x[tx] through w[c,i] */
                        if (to < T) s = fmaf(ring[to % K], j->w[c * K + i], s);
                    }
                    j->dx[((size_t)b * T + (size_t)tx) * CH + c] = s;
                }
            }
        }
        for (int i = 0; i < K; i++) j->dw[c * K + i] = j->dw[c * K + i] + kiln_lane16_reduce(acc[i]);
    }
}

void kiln_cpu_conv1d_silu_backward(kiln_pool *pool, float *dx, float *dw, const float *dout, const float *x,
                                   const float *w, int n_seq, int T, int CH, int K) {
    if (n_seq <= 0 || T <= 0 || K < 1 || K > 64) return;
    conv_bwd_job j = {dx, dw, dout, x, w, n_seq, T, CH, K, 0};
    j.n_tasks = la_n_tasks(pool, (double)n_seq * T * CH * K * 3, (CH + 15) / 16);
    kiln_pool_run(pool, j.n_tasks, conv_bwd_task, &j);
}

/* ---- the Gated DeltaNet recurrence ------------------------------------------------------- */

typedef struct gdn_shape {
    int nk, nv, dk, dv;
    float scale;
    int64_t W; /* qkv's row: 2 nk dk + nv dv */
} gdn_shape;

/* q and k of token row `row` for value head h, normalised: qn = (q * rq) * scale, kn = k * rk,
 * r = 1 / sqrtf(dot(x, x) + 1e-6f) (dot: the lane-16 dot). rq, rk out. */
static void gdn_qk(const gdn_shape *s, const float *qkv, size_t row, int h, float *qn, float *kn, float *rq,
                   float *rk) {
    const int kh = h / (s->nv / s->nk);
    const float *q = qkv + row * (size_t)s->W + (size_t)kh * s->dk;
    const float *k = q + (size_t)s->nk * s->dk;
    *rq = 1.0f / sqrtf(kiln_dot_ref(q, q, s->dk) + 1e-6f);
    *rk = 1.0f / sqrtf(kiln_dot_ref(k, k, s->dk) + 1e-6f);
    for (int i = 0; i < s->dk; i++) {
        qn[i] = (q[i] * *rq) * s->scale;
        kn[i] = k[i] * *rk;
    }
}

/* lane-16 over i of S[i][j] * x[i], for every column j: out[j]. acc: 16 dv floats. */
LA_HOT static void gdn_cols_dot(float *out, const float *S, const float *x, int dk, int dv, float *acc) {
    memset(acc, 0, (size_t)KILN_DOT_LANES * dv * sizeof(float));
    for (int i = 0; i < dk; i++) {
        float *a = acc + (size_t)(i % KILN_DOT_LANES) * dv;
        const float *row = S + (size_t)i * dv, xi = x[i];
        for (int c = 0; c < dv; c++) a[c] = fmaf(row[c], xi, a[c]);
    }
    for (int c = 0; c < dv; c++) {
        float l[KILN_DOT_LANES];
        for (int q = 0; q < KILN_DOT_LANES; q++) l[q] = acc[(size_t)q * dv + c];
        out[c] = kiln_lane16_reduce(l);
    }
}

/* One token of one head: S = a S; u = S^T kn; d = b (v - u); S += kn d^T; o = S^T qn. u, d
 * out when not NULL. */
LA_HOT static void gdn_step(float *S, const float *qn, const float *kn, const float *v, float a, float b, float *o,
                     float *u, float *d, int dk, int dv, float *acc) {
    const size_t n = (size_t)dk * dv;
    for (size_t e = 0; e < n; e++) S[e] = S[e] * a;
    float uu[512], dd[512]; /* dv <= 512 (checked by the caller) */
    gdn_cols_dot(uu, S, kn, dk, dv, acc);
    for (int c = 0; c < dv; c++) dd[c] = b * (v[c] - uu[c]);
    for (int i = 0; i < dk; i++) {
        float *row = S + (size_t)i * dv;
        for (int c = 0; c < dv; c++) row[c] = fmaf(kn[i], dd[c], row[c]);
    }
    gdn_cols_dot(o, S, qn, dk, dv, acc);
    if (u) memcpy(u, uu, (size_t)dv * sizeof(float));
    if (d) memcpy(d, dd, (size_t)dv * sizeof(float));
}

typedef struct gdn_job {
    gdn_shape s;
    float *out, *state, *scratch; /* per task: S (dk dv; no state), acc (16 dv), qn, kn */
    const float *qkv, *g, *beta;
    const int32_t *seq, *pos;
    const kiln_batch_run *runs;
    int n_runs, per_run; /* per_run: a task is (run, head) (no state); else a head, runs in order */
} gdn_job;

static void gdn_task(void *arg, int task, int thread) {
    (void)thread;
    const gdn_job *j = arg;
    const gdn_shape *s = &j->s;
    const int h = task % s->nv, r0 = j->per_run ? task / s->nv : 0, r1 = j->per_run ? r0 + 1 : j->n_runs;
    const size_t SN = (size_t)s->dk * s->dv;
    float *scr = j->scratch + (size_t)task * (SN + 16 * (size_t)s->dv + 2 * (size_t)s->dk);
    float *acc = scr + SN, *qn = acc + 16 * (size_t)s->dv, *kn = qn + s->dk;
    for (int r = r0; r < r1; r++) {
        const kiln_batch_run run = la_run(j->runs, j->seq, j->pos, r);
        /* a run of no sequence (seq < 0) starts from zero and keeps nothing, as conv1d_silu */
        float *S = j->state && run.seq >= 0 ? j->state + ((size_t)run.seq * s->nv + (size_t)h) * SN : scr;
        if (S == scr || run.pos0 == 0) memset(S, 0, SN * sizeof(float));
        for (int t = 0; t < run.n; t++) {
            const size_t row = (size_t)(run.first + t);
            float rq, rk;
            gdn_qk(s, j->qkv, row, h, qn, kn, &rq, &rk);
            const float *v = j->qkv + row * (size_t)s->W + 2 * (size_t)s->nk * s->dk + (size_t)h * s->dv;
            const float a = kiln_expf(j->g[row * s->nv + h]), b = j->beta[row * s->nv + h];
            gdn_step(S, qn, kn, v, a, b, j->out + row * (size_t)s->nv * s->dv + (size_t)h * s->dv, NULL, NULL,
                     s->dk, s->dv, acc);
        }
    }
}

void kiln_cpu_gated_delta(kiln_pool *pool, float *out, const float *qkv, const float *g, const float *beta,
                          float *state, const int32_t *seq, const int32_t *pos, const kiln_batch_run *runs,
                          int n_runs, int N, int nk, int nv, int dk, int dv, float scale) {
    if (N <= 0 || nk <= 0 || nv <= 0 || nv % nk || dv > 512) return;
    gdn_job j = {{nk, nv, dk, dv, scale, 2 * (int64_t)nk * dk + (int64_t)nv * dv}, out, state, NULL, qkv, g,
                 beta, seq, pos, runs, runs ? n_runs : N, !state};
    const int tasks = j.per_run ? j.n_runs * nv : nv;
    const size_t per = (size_t)dk * dv + 16 * (size_t)dv + 2 * (size_t)dk;
    j.scratch = kiln_malloc((size_t)tasks * per * sizeof(float));
    if (!j.scratch) {
        kiln_error(KILN_ERR_NOMEM, "gated_delta: out of memory for %d heads' scratch", tasks);
        return;
    }
    kiln_pool_run(pool, tasks, gdn_task, &j);
    kiln_free(j.scratch);
}

/* ---- its backward ------------------------------------------------------------------------ */

typedef struct gdn_bwd_job {
    gdn_shape s;
    float *dqkv, *dg, *dbeta, *ws;
    const float *dout, *qkv, *g, *beta;
    int n_seq, T, n_chunks, G, Wmax; /* G column groups of at most Wmax = KILN_GDN_COLS columns */
    float *part;      /* (N, nv, G, 2 dk + 2): each group's pq, pk, pbeta, pa (gdn_bwd_task) */
    float *dqn, *dkn; /* (N, nv, dk) each: the value heads' gradients of qn, kn */
} gdn_bwd_job;

/* One (sequence, value head, group of value columns J): the columns of S are independent in
 * the recurrence, so a group recomputes its own: the forward from zero with S[:, J] saved at
 * each chunk's start, then the chunks last to first, each recomputed from its saved state (S
 * after every token, u and d), then walked back token by token. The sums over columns stop at
 * the group's edge: its partials (pq, pk, pbeta, pa per token) go to j->part and
 * gdn_bwd_sum_task adds the groups in order (docs/ARITHMETIC.md, "Gated DeltaNet backward"). */
LA_HOT static void gdn_bwd_task(void *arg, int task, int thread) {
    (void)thread;
    const gdn_bwd_job *j = arg;
    const gdn_shape *s = &j->s;
    const int G = j->G, g = task % G, h = (task / G) % s->nv, b = task / G / s->nv, dk = s->dk, T = j->T;
    const int c0 = g * j->Wmax, W = s->dv - c0 < j->Wmax ? s->dv - c0 : j->Wmax;
    const size_t Wm = (size_t)j->Wmax, SN = (size_t)dk * Wm, C = KILN_GDN_CHUNK;
    const size_t per = (size_t)j->n_chunks * SN + C * (SN + 2 * Wm) + 16 * Wm + 2 * (size_t)dk + 2 * SN;
    const size_t SW = (size_t)dk * W; /* this group's state */
    float *ck = j->ws + (size_t)task * per;     /* (n_chunks, dk, W) */
    float *cs = ck + (size_t)j->n_chunks * SN;   /* (C, dk, W) S after each token of a chunk */
    float *cu = cs + C * SN, *cd = cu + C * Wm;  /* (C, W) u, d */
    float *acc = cd + C * Wm, *qn = acc + 16 * Wm, *kn = qn + dk;
    float *dS = kn + dk, *S = dS + SN;
    float o[KILN_GDN_COLS], dd[KILN_GDN_COLS], du[KILN_GDN_COLS], w[KILN_GDN_COLS], sd[KILN_GDN_COLS];
    memset(dS, 0, SW * sizeof(float));
    const size_t row0 = (size_t)b * T, P = 2 * (size_t)dk + 2;
    const float *vbase = j->qkv + 2 * (size_t)s->nk * dk + (size_t)h * s->dv + (size_t)c0;
    float rq, rk;
    memset(S, 0, SW * sizeof(float));
    for (int t = 0; t < T; t++) {
        if (t % C == 0) memcpy(ck + (size_t)(t / C) * SN, S, SW * sizeof(float));
        const size_t row = row0 + (size_t)t;
        gdn_qk(s, j->qkv, row, h, qn, kn, &rq, &rk);
        gdn_step(S, qn, kn, vbase + row * (size_t)s->W, kiln_expf(j->g[row * s->nv + h]), j->beta[row * s->nv + h],
                 o, NULL, NULL, dk, W, acc);
    }
    for (int c = j->n_chunks - 1; c >= 0; c--) {
        const int t0 = c * (int)C, t1 = t0 + (int)C < T ? t0 + (int)C : T;
        memcpy(S, ck + (size_t)c * SN, SW * sizeof(float));
        for (int t = t0; t < t1; t++) {
            const size_t row = row0 + (size_t)t;
            gdn_qk(s, j->qkv, row, h, qn, kn, &rq, &rk);
            gdn_step(S, qn, kn, vbase + row * (size_t)s->W, kiln_expf(j->g[row * s->nv + h]),
                     j->beta[row * s->nv + h], o, cu + (size_t)(t - t0) * Wm, cd + (size_t)(t - t0) * Wm, dk, W, acc);
            memcpy(cs + (size_t)(t - t0) * SN, S, SW * sizeof(float));
        }
        for (int t = t1 - 1; t >= t0; t--) {
            const size_t row = row0 + (size_t)t;
            const float *St = cs + (size_t)(t - t0) * SN;
            const float *Sp = t > t0 ? cs + (size_t)(t - t0 - 1) * SN : ck + (size_t)c * SN;
            const float *u = cu + (size_t)(t - t0) * Wm, *d = cd + (size_t)(t - t0) * Wm;
            const float *v = vbase + row * (size_t)s->W;
            const float *dO = j->dout + row * (size_t)s->nv * s->dv + (size_t)h * s->dv + (size_t)c0;
            const float a = kiln_expf(j->g[row * s->nv + h]), bt = j->beta[row * s->nv + h];
            float *pq = j->part + ((row * s->nv + (size_t)h) * (size_t)G + (size_t)g) * P, *pk = pq + dk;
            gdn_qk(s, j->qkv, row, h, qn, kn, &rq, &rk);
            /* o = S_t^T qn:  dS += qn dO^T;  pq = S_t dO (this group's columns) */
            for (int i = 0; i < dk; i++) {
                float *r = dS + (size_t)i * W;
                for (int q = 0; q < W; q++) r[q] = fmaf(qn[i], dO[q], r[q]);
                pq[i] = kiln_dot_ref(St + (size_t)i * W, dO, W);
            }
            /* S_t = S' + kn d^T:  dd = dS^T kn;  pk = dS d */
            gdn_cols_dot(dd, dS, kn, dk, W, acc);
            for (int i = 0; i < dk; i++) pk[i] = kiln_dot_ref(dS + (size_t)i * W, d, W);
            /* d = b (v - u) */
            float *dvo = j->dqkv + row * (size_t)s->W + 2 * (size_t)s->nk * dk + (size_t)h * s->dv + (size_t)c0;
            for (int q = 0; q < W; q++) {
                dvo[q] = bt * dd[q];
                du[q] = -dvo[q];
                w[q] = v[q] - u[q];
            }
            pk[dk] = kiln_dot_ref(dd, w, W); /* pbeta */
            /* u = S'^T kn, S' = a S_p:  dS' = dS + kn du^T;  pk += S' du */
            for (int i = 0; i < dk; i++) {
                float *r = dS + (size_t)i * W;
                const float *p = Sp + (size_t)i * W;
                for (int q = 0; q < W; q++) {
                    r[q] = fmaf(kn[i], du[q], r[q]);
                    sd[q] = p[q] * a;
                }
                pk[i] = pk[i] + kiln_dot_ref(sd, du, W);
            }
            /* S' = a S_p:  pa = <dS', S_p>, row dots added lane-16 over rows;  dS = a dS' */
            float la[KILN_DOT_LANES] = {0};
            for (int i = 0; i < dk; i++)
                la[i % KILN_DOT_LANES] = la[i % KILN_DOT_LANES] + kiln_dot_ref(dS + (size_t)i * W, Sp + (size_t)i * W, W);
            pk[dk + 1] = kiln_lane16_reduce(la); /* pa */
            for (size_t e = 0; e < SW; e++) dS[e] = dS[e] * a;
        }
    }
}

/* Per (token, value head): the groups' partials added in group order (acc = p_0; acc = acc +
 * p_g): dqn, dkn, dbeta, and dg = (the sum of pa) * exp(g). */
static void gdn_bwd_sum_task(void *arg, int task, int thread) {
    (void)thread;
    const gdn_bwd_job *j = arg;
    const gdn_shape *s = &j->s;
    const size_t N = (size_t)j->n_seq * j->T, P = 2 * (size_t)s->dk + 2;
    int64_t lo, hi;
    la_split((int64_t)N, (int)(((int64_t)N + 63) / 64), task, &lo, &hi);
    for (int64_t row = lo; row < hi; row++)
        for (int h = 0; h < s->nv; h++) {
            const size_t rh = (size_t)row * s->nv + (size_t)h;
            const float *p0 = j->part + rh * (size_t)j->G * P;
            float *dq = j->dqn + rh * s->dk, *dkk = j->dkn + rh * s->dk;
            for (int e = 0; e < 2 * s->dk + 2; e++) {
                float a = p0[e];
                for (int g = 1; g < j->G; g++) a = a + p0[(size_t)g * P + (size_t)e];
                if (e < s->dk) dq[e] = a;
                else if (e < 2 * s->dk) dkk[e - s->dk] = a;
                else if (e == 2 * s->dk) j->dbeta[rh] = a;
                else j->dg[rh] = a * kiln_expf(j->g[rh]);
            }
        }
}

/* Per (token, key head): the group's value heads' dqn (dkn) summed in head order, then through
 * the scale and the l2 norm: y = x r, dy = (sum) * scale for q, (sum) for k;
 * dx = r (dy - y c), c = dot(y, dy). */
static void gdn_bwd_qk_task(void *arg, int task, int thread) {
    (void)thread;
    const gdn_bwd_job *j = arg;
    const gdn_shape *s = &j->s;
    const size_t N = (size_t)j->n_seq * j->T;
    int64_t lo, hi;
    const int n_tasks = (int)(((int64_t)N + 63) / 64);
    la_split((int64_t)N, n_tasks, task, &lo, &hi);
    const int dk = s->dk, G = s->nv / s->nk;
    float y[512], dy[512];
    for (int64_t row = lo; row < hi; row++)
        for (int kh = 0; kh < s->nk; kh++)
            for (int which = 0; which < 2; which++) {
                const float *x = j->qkv + (size_t)row * s->W + (size_t)which * s->nk * dk + (size_t)kh * dk;
                float *dx = j->dqkv + (size_t)row * s->W + (size_t)which * s->nk * dk + (size_t)kh * dk;
                const float *src = which ? j->dkn : j->dqn;
                for (int i = 0; i < dk; i++) {
                    float a = src[((size_t)row * s->nv + (size_t)kh * G) * dk + i];
                    for (int g = 1; g < G; g++) a = a + src[((size_t)row * s->nv + (size_t)kh * G + g) * dk + i];
                    dy[i] = which ? a : a * s->scale;
                }
                const float r = 1.0f / sqrtf(kiln_dot_ref(x, x, dk) + 1e-6f);
                for (int i = 0; i < dk; i++) y[i] = x[i] * r;
                const float c = kiln_dot_ref(y, dy, dk);
                for (int i = 0; i < dk; i++) dx[i] = r * (dy[i] - y[i] * c);
            }
}

void kiln_cpu_gated_delta_backward(kiln_pool *pool, float *dqkv, float *dg, float *dbeta, const float *dout,
                                   const float *qkv, const float *g, const float *beta, float *ws, int n_seq, int T,
                                   int nk, int nv, int dk, int dv, float scale) {
    if (n_seq <= 0 || T <= 0 || nk <= 0 || nv <= 0 || nv % nk || dv > 512 || dk > 512) return;
    gdn_bwd_job j = {{nk, nv, dk, dv, scale, 2 * (int64_t)nk * dk + (int64_t)nv * dv}, dqkv, dg, dbeta, ws, dout,
                     qkv, g, beta, n_seq, T, (T + KILN_GDN_CHUNK - 1) / KILN_GDN_CHUNK, 0, 0, NULL, NULL, NULL};
    j.Wmax = dv < KILN_GDN_COLS ? dv : KILN_GDN_COLS;
    j.G = (dv + j.Wmax - 1) / j.Wmax;
    const size_t Wm = (size_t)j.Wmax, SN = (size_t)dk * Wm, tasks = (size_t)n_seq * nv * (size_t)j.G;
    const size_t per = (size_t)j.n_chunks * SN + KILN_GDN_CHUNK * (SN + 2 * Wm) + 16 * Wm + 2 * (size_t)dk + 2 * SN;
    const size_t N = (size_t)n_seq * T;
    j.part = ws + tasks * per;
    j.dqn = j.part + N * nv * (size_t)j.G * (2 * (size_t)dk + 2);
    j.dkn = j.dqn + N * nv * (size_t)dk;
    kiln_pool_run(pool, (int)tasks, gdn_bwd_task, &j);
    kiln_pool_run(pool, (int)(((int64_t)N + 63) / 64), gdn_bwd_sum_task, &j);
    kiln_pool_run(pool, (int)(((int64_t)N + 63) / 64), gdn_bwd_qk_task, &j);
}

/* ---- gates, output gate, halves ---------------------------------------------------------- */

void kiln_cpu_gdn_gates(float *g, float *beta, const float *a, const float *b, const float *A_log,
                        const float *dt_bias, int N, int nv) {
    for (int64_t n = 0; n < N; n++)
        for (int h = 0; h < nv; h++) {
            const size_t i = (size_t)n * nv + (size_t)h;
            kiln_gdn_gates(a[i], b[i], A_log[h], dt_bias[h], &g[i], &beta[i]);
        }
}

/* dA_log[h], ddt_bias[h] += lane-16 over tokens of their terms. */
void kiln_cpu_gdn_gates_backward(float *da, float *db, float *dA_log, float *ddt_bias, const float *dg,
                                 const float *dbeta, const float *a, const float *b, const float *A_log,
                                 const float *dt_bias, int N, int nv) {
    for (int h = 0; h < nv; h++) {
        float accA[KILN_DOT_LANES] = {0}, accT[KILN_DOT_LANES] = {0};
        for (int64_t n = 0; n < N; n++) {
            const size_t i = (size_t)n * nv + (size_t)h;
            float dA;
            kiln_gdn_gates_backward(a[i], b[i], A_log[h], dt_bias[h], dg[i], dbeta[i], &da[i], &db[i], &dA);
            accA[n % KILN_DOT_LANES] = accA[n % KILN_DOT_LANES] + dA;
            accT[n % KILN_DOT_LANES] = accT[n % KILN_DOT_LANES] + da[i];
        }
        if (dA_log) dA_log[h] = dA_log[h] + kiln_lane16_reduce(accA);
        if (ddt_bias) ddt_bias[h] = ddt_bias[h] + kiln_lane16_reduce(accT);
    }
}

void kiln_cpu_sigmoid_mul(float *out, const float *x, const float *gate, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = x[i] * kiln_sigmoid(gate[i]);
}

/* s = sigmoid(gate): dx = dout * s; dgate = (dout * x) * (s * (1 - s)). */
void kiln_cpu_sigmoid_mul_backward(float *dx, float *dgate, const float *dout, const float *x, const float *gate,
                                   size_t n) {
    for (size_t i = 0; i < n; i++) {
        const float s = kiln_sigmoid(gate[i]), d = dout[i], xv = x[i];
        dx[i] = d * s;
        dgate[i] = (d * xv) * (s * (1.0f - s));
    }
}

void kiln_cpu_split_halves(float *a, float *b, const float *x, int64_t rows, int n) {
    for (int64_t r = 0; r < rows; r++) {
        memcpy(a + (size_t)r * n, x + (size_t)r * 2 * n, (size_t)n * sizeof(float));
        memcpy(b + (size_t)r * n, x + (size_t)r * 2 * n + n, (size_t)n * sizeof(float));
    }
}

void kiln_cpu_join_halves(float *x, const float *a, const float *b, int64_t rows, int n) {
    for (int64_t r = 0; r < rows; r++) {
        memcpy(x + (size_t)r * 2 * n, a + (size_t)r * n, (size_t)n * sizeof(float));
        memcpy(x + (size_t)r * 2 * n + n, b + (size_t)r * n, (size_t)n * sizeof(float));
    }
}

/* rope / rope_backward's arithmetic on the first rot dims: x' = x c -+ y s as there. */
void kiln_cpu_rope_partial(float *x, const int32_t *pos, int N, int H, int HS, int rot, const float *cos_tab,
                           const float *sin_tab, int transpose) {
    const int half = rot / 2;
    for (int n = 0; n < N; n++) {
        const float *ct = cos_tab + (int64_t)pos[n] * half, *st = sin_tab + (int64_t)pos[n] * half;
        for (int h = 0; h < H; h++) {
            float *v = x + ((int64_t)n * H + h) * HS;
            for (int i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                if (transpose) {
                    v[i] = a * ct[i] + b * st[i];
                    v[i + half] = b * ct[i] - a * st[i];
                } else {
                    v[i] = a * ct[i] - b * st[i];
                    v[i + half] = b * ct[i] + a * st[i];
                }
            }
        }
    }
}
