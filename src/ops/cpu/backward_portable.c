/*
 * backward_portable.c -- the backward ops of the CPU backend (training), and the portable
 * (plain C) table of their inner loops.
 *
 * The arithmetic of every op is defined in docs/ARITHMETIC.md, "Backward ops"; this file is
 * its reference. Each output element is written by exactly one task, in that order, so
 * results never depend on the thread count, on how outputs are grouped into tasks or tiles,
 * or on the SIMD path (the AVX2 table computes the same IEEE operations per element). No
 * float atomics, no per-thread partial sums: where many terms meet (dW, dw, dk/dv, the
 * embedding rows) one task owns the output and adds the terms in the defined order.
 */
#include "backward.h"

#include <string.h>

/* ---- shared helpers -------------------------------------------------------------------- */

/* Tasks for `work` multiply-adds (as cpu_backend.c's n_tasks_for): 1 when small or single
 * threaded, else 4 per thread (threads claim them dynamically), at most max_tasks. */
static int bwd_n_tasks(kiln_pool *pool, double work, double min_work, int64_t max_tasks) {
    int nt = kiln_pool_n_threads(pool);
    int n = (work < min_work || nt <= 1) ? 1 : 4 * nt;
    if (n > max_tasks) n = (int)(max_tasks > 0 ? max_tasks : 1);
    return n;
}

static void bwd_split(int64_t n, int n_tasks, int task, int64_t align, int64_t *lo, int64_t *hi) {
    int64_t chunk = (n + n_tasks - 1) / n_tasks;
    chunk = (chunk + align - 1) / align * align;
    *lo = (int64_t)task * chunk;
    *hi = *lo + chunk;
    if (*lo > n) *lo = n;
    if (*hi > n) *hi = n;
}

/* kiln_lane16_reduce over lanes held `stride` floats apart. */
static float lanes_reduce(const float *p, int64_t stride) {
    float acc[KILN_DOT_LANES];
    for (int j = 0; j < KILN_DOT_LANES; j++) acc[j] = p[j * stride];
    return kiln_lane16_reduce(acc);
}

/* v[c] = lanes_reduce(p + c, stride) for c < nc (nc <= KILN_BWD_NC): kiln_lane16_reduce's
 * tree applied column by column, the same additions in the same order for each column, in
 * loops over c that the compiler vectorizes. */
static void lanes_reduce_cols(float *v, const float *p, int64_t stride, int nc) {
    float s8[8][KILN_BWD_NC], s4[4][KILN_BWD_NC], s2[2][KILN_BWD_NC];
    for (int j = 0; j < 8; j++)
        for (int c = 0; c < nc; c++) s8[j][c] = p[j * stride + c] + p[(j + 8) * stride + c];
    for (int j = 0; j < 4; j++)
        for (int c = 0; c < nc; c++) s4[j][c] = s8[j][c] + s8[j + 4][c];
    for (int j = 0; j < 2; j++)
        for (int c = 0; c < nc; c++) s2[j][c] = s4[j][c] + s4[j + 2][c];
    for (int c = 0; c < nc; c++) v[c] = s2[0][c] + s2[1][c];
}

/* ---- the portable kernel table ---------------------------------------------------------- */

static void p_tile(float *P, const float *A, int64_t asi, int64_t ask, const kiln_bwd_b *B,
                   int64_t c0, int64_t k0, int64_t k1, int mi, int nc, int first) {
    kiln_bwd_tile_generic(P, A, asi, ask, B, c0, k0, k1, mi, nc, first);
}

static void p_col_lanes(float *acc, const float *a, const float *b, const float *s, int64_t ld,
                        int64_t n0, int64_t n1, int w) {
    kiln_bwd_col_lanes_generic(acc, a, b, s, ld, n0, n1, w);
}

const kiln_bwd_kernels kiln_bwd_kernels_portable = {.tile = p_tile, .col_lanes = p_col_lanes};

const kiln_bwd_kernels *kiln_bwd_kernels_for(kiln_cpu_path p) {
#if defined(__x86_64__)
    if (p == KILN_CPU_PATH_AVX512) return &kiln_bwd_kernels_avx512;
    if (p == KILN_CPU_PATH_AVX2) return &kiln_bwd_kernels_avx2;
#else
    (void)p;
#endif
    return &kiln_bwd_kernels_portable;
}

/* ---- matmul backward: the lane-16 GEMM ------------------------------------------------- */

/* out(M, NCOL) (+)= A(M, K) @ B(K, NCOL), each element the defined dot over k:
 * lane k % 16 accumulates fmaf(A(i,k), B(k,c), .) in increasing k, then the fixed tree;
 * then out = v (overwrite) or out = out + v (accumulate). A(i,k) = A[i*asi + k*ask]. */
typedef struct bwd_gemm {
    float *out;
    int64_t ldo;
    bool accumulate;
    const float *A;
    int64_t asi, ask;
    kiln_bwd_b B;
    int64_t M, NCOL, K;
    /* B's whole 16-column panels packed once for every task (bwd_pack_rows), panel p's chunk
     * j at pk + (p * bwd_chunks(K) + j) * BWD_KC * 16; NULL: packed per row block */
    const float *pk;
} bwd_gemm;

#define BWD_KC 512 /* k per chunk: A rows and the B panel of a chunk stay in L1/L2 over 16 lanes */
#define BWD_IB 48  /* rows per block: A's block stays in L2 while the c tiles sweep it */

/* A tile's outputs from its lane partials P: rows it .. it+mi-1, columns c0 .. c0+nc-1, each
 * the tree over its 16 lanes, written or added (g->accumulate). */
static void bwd_store_tile(const bwd_gemm *g, const float *P, int64_t it, int64_t c0, int mi,
                           int nc) {
    for (int i = 0; i < mi; i++) {
        float *o = g->out + (it + i) * g->ldo + c0, v[KILN_BWD_NC];
        lanes_reduce_cols(v, P + i * KILN_BWD_NC, KILN_BWD_MR * KILN_BWD_NC, nc);
        if (g->accumulate)
            for (int c = 0; c < nc; c++) o[c] = o[c] + v[c];
        else
            for (int c = 0; c < nc; c++) o[c] = v[c];
    }
}

/* The panel of B's columns [c0, c0 + 16) for k in [k0, k1), as f32, lane by lane (the layout
 * of kiln_bwd_kernels.tile_packed, mstride = ceil((k1 - k0) / 16)). */
static void bwd_pack_panel(float *pk, const kiln_bwd_b *B, int64_t c0, int64_t k0, int64_t k1) {
    const int64_t ms = (k1 - k0 + 15) / 16;
    for (int64_t k = k0; k < k1; k++) {
        float *d = pk + ((k - k0) % 16 * ms + (k - k0) / 16) * 16;
        if (B->dtype == KILN_DTYPE_F32)
            memcpy(d, B->b + (size_t)k * B->row_bytes + (size_t)c0 * 4, 16 * sizeof(float));
        else
            for (int c = 0; c < 16; c++) d[c] = kiln_bwd_b_at(B, k, c0 + c);
    }
}

/* Chunks of BWD_KC in K (the last one partial). */
static int64_t bwd_chunks(int64_t K) { return (K + BWD_KC - 1) / BWD_KC; }

/* Rows [k_lo, k_hi) of B into the packed panels of bwd_gemm.pk (every whole panel of the
 * first `full` columns): each row is read once, front to back, and its 16-column pieces go
 * to their panels at bwd_pack_panel's places. */
static void bwd_pack_rows(float *pk, const kiln_bwd_b *B, int64_t K, int64_t full, int64_t k_lo,
                          int64_t k_hi) {
    const int64_t nch = bwd_chunks(K);
    for (int64_t k = k_lo; k < k_hi; k++) {
        const int64_t j = k / BWD_KC, k0 = j * BWD_KC, k1 = k0 + BWD_KC < K ? k0 + BWD_KC : K;
        const int64_t ms = (k1 - k0 + 15) / 16;
        const int64_t at = ((k - k0) % 16 * ms + (k - k0) / 16) * 16;
        for (int64_t c0 = 0; c0 < full; c0 += KILN_BWD_NC) {
            float *d = pk + ((c0 / KILN_BWD_NC) * nch + j) * (BWD_KC * KILN_BWD_NC) + at;
            if (B->dtype == KILN_DTYPE_F32)
                memcpy(d, B->b + (size_t)k * B->row_bytes + (size_t)c0 * 4, 16 * sizeof(float));
            else
                for (int c = 0; c < 16; c++) d[c] = kiln_bwd_b_at(B, k, c0 + c);
        }
    }
}

/* np (1 or 2) whole 16-column panels from c0 with the packed tiles, on the panels' chunks
 * at pk (chunk j at pk + j * BWD_KC * 16, the second panel per_panel floats further), packed
 * once per call for every task (bwd_gemm.pk); with pk NULL (no memory for that; np 1), packed
 * again for each row block into a stack buffer (the same values, so the same bits). Every
 * 6-row tile of a row block runs on them (np 2: tile_packed2, both panels at once), its lane
 * partials waiting in Ps between chunks. With 4 tasks a thread, a task has one or two row
 * blocks: packing per block repeated W's panels in every task, about a sixth of a 135M
 * training step on a Sapphire Rapids core. */
static void bwd_gemm_rows_packed(const kiln_bwd_kernels *bk, const bwd_gemm *g, int64_t i0,
                                 int64_t i1, int64_t c0, const float *pk, int np,
                                 int64_t per_panel) {
    enum { TILES = (BWD_IB + KILN_BWD_MR - 1) / KILN_BWD_MR };
    float Ps[2][TILES][KILN_DOT_LANES * KILN_BWD_MR * KILN_BWD_NC];
    float chunk[BWD_KC * KILN_BWD_NC];
    for (int64_t ib0 = i0; ib0 < i1; ib0 += BWD_IB) {
        int64_t ib1 = ib0 + BWD_IB < i1 ? ib0 + BWD_IB : i1;
        /* the block's 64-byte pieces of the output, read by bwd_store_tile when accumulating:
         * one per row and panel, a stride the hardware prefetchers do not follow, asked for
         * now so that they arrive while the tiles compute (no effect on any value) */
        if (g->accumulate)
            for (int64_t i = ib0; i < ib1; i++)
                for (int q = 0; q < np; q++)
                    __builtin_prefetch(g->out + i * g->ldo + c0 + q * KILN_BWD_NC, 1);
        for (int64_t k0 = 0; k0 < g->K; k0 += BWD_KC) { /* K >= 1: every Ps is written */
            int64_t k1 = k0 + BWD_KC < g->K ? k0 + BWD_KC : g->K;
            const float *pc = pk ? pk + k0 * KILN_BWD_NC : chunk;
            if (!pk) bwd_pack_panel(chunk, &g->B, c0, k0, k1);
            for (int64_t it = ib0; it < ib1; it += KILN_BWD_MR) {
                int mi = (int)(ib1 - it < KILN_BWD_MR ? ib1 - it : KILN_BWD_MR);
                float *P0 = Ps[0][(it - ib0) / KILN_BWD_MR], *P1 = Ps[1][(it - ib0) / KILN_BWD_MR];
                if (np == 2)
                    bk->tile_packed2(P0, P1, g->A + it * g->asi, g->asi, g->ask, pc,
                                     pc + per_panel, (k1 - k0 + 15) / 16, k0, k1, mi, k0 == 0);
                else
                    bk->tile_packed(P0, g->A + it * g->asi, g->asi, g->ask, pc,
                                    (k1 - k0 + 15) / 16, k0, k1, mi, k0 == 0);
            }
        }
        for (int64_t it = ib0; it < ib1; it += KILN_BWD_MR) {
            int mi = (int)(ib1 - it < KILN_BWD_MR ? ib1 - it : KILN_BWD_MR);
            for (int q = 0; q < np; q++)
                bwd_store_tile(g, Ps[q][(it - ib0) / KILN_BWD_MR], it, c0 + q * KILN_BWD_NC, mi,
                               KILN_BWD_NC);
        }
    }
}

static void bwd_gemm_rows(const kiln_bwd_kernels *bk, const bwd_gemm *g, int64_t i0,
                          int64_t i1) {
    int64_t full = bk->tile_packed ? g->NCOL / KILN_BWD_NC * KILN_BWD_NC : 0;
    if (full > 0 && i1 > i0 && g->pk) {
        const int64_t per_panel = bwd_chunks(g->K) * BWD_KC * KILN_BWD_NC;
        int64_t c0 = 0;
        for (; c0 < full;) {
            const int np = bk->tile_packed2 && c0 + 2 * KILN_BWD_NC <= full ? 2 : 1;
            bwd_gemm_rows_packed(bk, g, i0, i1, c0, g->pk + (c0 / KILN_BWD_NC) * per_panel, np,
                                 per_panel);
            c0 += np * KILN_BWD_NC;
        }
    } else if (full > 0 && i1 > i0) { /* no memory for the packed panels: per row block */
        for (int64_t c0 = 0; c0 < full; c0 += KILN_BWD_NC)
            bwd_gemm_rows_packed(bk, g, i0, i1, c0, NULL, 1, 0);
    }
    if (full == g->NCOL) return;
    float P[KILN_DOT_LANES * KILN_BWD_MR * KILN_BWD_NC];
    for (int64_t ib0 = i0; ib0 < i1; ib0 += BWD_IB) {
        int64_t ib1 = ib0 + BWD_IB < i1 ? ib0 + BWD_IB : i1;
        for (int64_t c0 = full; c0 < g->NCOL; c0 += KILN_BWD_NC) {
            int nc = (int)(g->NCOL - c0 < KILN_BWD_NC ? g->NCOL - c0 : KILN_BWD_NC);
            for (int64_t it = ib0; it < ib1; it += KILN_BWD_MR) {
                int mi = (int)(ib1 - it < KILN_BWD_MR ? ib1 - it : KILN_BWD_MR);
                const float *A = g->A + it * g->asi;
                for (int64_t k0 = 0; k0 < g->K; k0 += BWD_KC) { /* K >= 1: P is written */
                    int64_t k1 = k0 + BWD_KC < g->K ? k0 + BWD_KC : g->K;
                    bk->tile(P, A, g->asi, g->ask, &g->B, c0, k0, k1, mi, nc, k0 == 0);
                }
                bwd_store_tile(g, P, it, c0, mi, nc);
            }
        }
    }
}

typedef struct mm_bwd_job {
    const kiln_bwd_kernels *bk;
    bwd_gemm gx, gw;        /* dx = dy @ W;  dW += dy^T @ x */
    int tx, tw;             /* tasks of each part; tasks [0, tx) do dx, [tx, tx+tw) dW */
    float *dbias;
    const float *dy;
    int64_t R;
    int N;
} mm_bwd_job;

/* dbias[r] += sum over tokens n of dy[n, r]: lanes n % 16, increasing n, then the tree. */
static void dbias_rows(const mm_bwd_job *j, int64_t r0, int64_t r1) {
    float acc[KILN_DOT_LANES * 64];
    for (int64_t c0 = r0; c0 < r1; c0 += 64) {
        int w = (int)(r1 - c0 < 64 ? r1 - c0 : 64);
        memset(acc, 0, sizeof acc);
        j->bk->col_lanes(acc, j->dy + c0, NULL, NULL, j->R, 0, j->N, w);
        for (int c = 0; c < w; c++) j->dbias[c0 + c] = j->dbias[c0 + c] + lanes_reduce(acc + c, w);
    }
}

static void mm_bwd_task(void *arg, int task, int thread) {
    const mm_bwd_job *j = arg;
    int64_t lo, hi;
    if (task < j->tx) {
        bwd_split(j->gx.M, j->tx, task, KILN_BWD_MR, &lo, &hi);
        if (lo < hi) bwd_gemm_rows(j->bk, &j->gx, lo, hi);
    } else {
        bwd_split(j->gw.M, j->tw, task - j->tx, KILN_BWD_MR, &lo, &hi);
        if (lo >= hi) return;
        if (j->gw.out) bwd_gemm_rows(j->bk, &j->gw, lo, hi);
        if (j->dbias) dbias_rows(j, lo, hi);
    }
}

/* The packing of both products' B before their tasks run: tasks [0, t[0]) take row ranges
 * of g[0]'s B, the others g[1]'s. */
typedef struct bwd_pack_job {
    bwd_gemm *g[2];
    float *pk[2];
    int t[2];
} bwd_pack_job;

static void bwd_pack_task(void *arg, int task, int thread) {
    (void)thread;
    const bwd_pack_job *p = arg;
    const int w = task < p->t[0] ? 0 : 1;
    const bwd_gemm *g = p->g[w];
    int64_t lo, hi;
    bwd_split(g->K, p->t[w], w ? task - p->t[0] : task, 1, &lo, &hi);
    bwd_pack_rows(p->pk[w], &g->B, g->K, g->NCOL / KILN_BWD_NC * KILN_BWD_NC, lo, hi);
}

/* The buffer for g's packed panels (bwd_gemm.pk) when it has whole panels and the memory is
 * there; NULL otherwise (the tasks then pack per row block). */
static float *bwd_pack_alloc(const kiln_bwd_kernels *bk, const bwd_gemm *g, int wanted) {
    const int64_t full = g->NCOL / KILN_BWD_NC * KILN_BWD_NC;
    if (!wanted || !bk->tile_packed || full == 0 || g->K <= 0) return NULL;
    return kiln_malloc((size_t)(full / KILN_BWD_NC) * (size_t)bwd_chunks(g->K) * BWD_KC *
                       KILN_BWD_NC * sizeof(float));
}

void kiln_cpu_matmul_backward(kiln_pool *pool, const kiln_cpu_kernels *k, float *dx, float *dW,
                              float *dbias, const float *dy, const float *x,
                              const kiln_tensor *W, int N, bool accumulate_dx) {
    int64_t C = W->shape[W->n_dims - 1];
    int64_t R = C > 0 ? kiln_tensor_nelements(W) / C : 0;
    if (N <= 0 || R <= 0 || C <= 0) return;
    /* supports_op's contract; never read a quantized row as if it were plain */
    if (W->dtype != KILN_DTYPE_F32 && W->dtype != KILN_DTYPE_BF16 && W->dtype != KILN_DTYPE_F16)
        return;
    size_t esize = W->dtype == KILN_DTYPE_F32 ? 4 : 2;
    mm_bwd_job j;
    memset(&j, 0, sizeof j);
    j.bk = kiln_bwd_kernels_for(k->path);
    j.gx = (bwd_gemm){dx, C, accumulate_dx, dy, R, 1,
                      {(const uint8_t *)W->data, (size_t)C * esize, W->dtype}, N, C, R, NULL};
    j.gw = (bwd_gemm){dW, C, true, dy, 1, R,
                      {(const uint8_t *)x, (size_t)C * 4, KILN_DTYPE_F32}, R, C, N, NULL};
    j.dbias = dbias;
    j.dy = dy;
    j.R = R;
    j.N = N;
    double work = (double)N * R * C;
    j.tx = dx ? bwd_n_tasks(pool, work, 65536, (N + KILN_BWD_MR - 1) / KILN_BWD_MR) : 0;
    j.tw = (dW || dbias) ? bwd_n_tasks(pool, work, 65536, (R + KILN_BWD_MR - 1) / KILN_BWD_MR)
                         : 0;
    /* B's panels packed once for all tasks (the same values: the same bits) */
    float *pkx = bwd_pack_alloc(j.bk, &j.gx, dx != NULL);
    float *pkw = bwd_pack_alloc(j.bk, &j.gw, dW != NULL);
    if (pkx || pkw) {
        bwd_pack_job pj = {{&j.gx, &j.gw}, {pkx, pkw}, {0, 0}};
        const int nt = 2 * kiln_pool_n_threads(pool);
        pj.t[0] = pkx ? nt : 0;
        pj.t[1] = pkw ? nt : 0;
        kiln_pool_run(pool, pj.t[0] + pj.t[1], bwd_pack_task, &pj);
        j.gx.pk = pkx;
        j.gw.pk = pkw;
    }
    kiln_pool_run(pool, j.tx + j.tw, mm_bwd_task, &j);
    kiln_free(pkx);
    kiln_free(pkw);
}

/* ---- rmsnorm backward ------------------------------------------------------------------- */

typedef struct rms_bwd_job {
    const kiln_cpu_kernels *k;
    const kiln_bwd_kernels *bk;
    float *dx, *dw, *rstd;
    const float *dy, *x, *w;
    int N, C, n_tasks;
    float eps;
    bool accumulate;
} rms_bwd_job;

#define RMS_CHUNK 1024 /* g = dy * w is formed in pieces of this many (a multiple of 16) */

/* One row: r as the forward; g = dy*w; d = dot(g, x); u = ((d / C) * r) * r;
 * dx = (g - x*u) * r  (or dx + that). */
static void rms_bwd_row(const rms_bwd_job *j, int64_t n) {
    const int64_t C = j->C;
    const float *x = j->x + n * C, *dy = j->dy + n * C;
    float *dx = j->dx + n * C;
    float acc[KILN_DOT_LANES] = {0};
    j->k->dot_accum(acc, x, x, C);
    float r = kiln_rms_scale(kiln_lane16_reduce(acc), j->C, j->eps);
    j->rstd[n] = r;
    float g[RMS_CHUNK];
    memset(acc, 0, sizeof acc);
    for (int64_t c0 = 0; c0 < C; c0 += RMS_CHUNK) {
        int64_t m = C - c0 < RMS_CHUNK ? C - c0 : RMS_CHUNK;
        if (j->w) {
            for (int64_t c = 0; c < m; c++) g[c] = dy[c0 + c] * j->w[c0 + c];
            j->k->dot_accum(acc, g, x + c0, m);
        } else {
            j->k->dot_accum(acc, dy + c0, x + c0, m);
        }
    }
    float d = kiln_lane16_reduce(acc);
    float u = ((d / (float)j->C) * r) * r;
    for (int64_t c0 = 0; c0 < C; c0 += RMS_CHUNK) {
        int64_t m = C - c0 < RMS_CHUNK ? C - c0 : RMS_CHUNK;
        for (int64_t c = 0; c < m; c++) g[c] = j->w ? dy[c0 + c] * j->w[c0 + c] : dy[c0 + c];
        float *o = dx + c0;
        const float *xc = x + c0;
        if (j->accumulate)
            for (int64_t c = 0; c < m; c++) o[c] = o[c] + (g[c] - xc[c] * u) * r;
        else
            for (int64_t c = 0; c < m; c++) o[c] = (g[c] - xc[c] * u) * r;
    }
}

static void rms_bwd_rows_task(void *arg, int task, int thread) {
    const rms_bwd_job *j = arg;
    int64_t lo, hi;
    bwd_split(j->N, j->n_tasks, task, 1, &lo, &hi);
    for (int64_t n = lo; n < hi; n++) rms_bwd_row(j, n);
}

/* dw[c] += sum over rows n of dy[n,c] * (x[n,c] * r[n]): lanes n % 16, then the tree. One
 * task owns a slice of 64 columns (rows are never split). */
static void rms_bwd_cols_task(void *arg, int task, int thread) {
    const rms_bwd_job *j = arg;
    int64_t c0 = (int64_t)task * 64;
    int w = (int)(j->C - c0 < 64 ? j->C - c0 : 64);
    float acc[KILN_DOT_LANES * 64];
    memset(acc, 0, sizeof acc);
    j->bk->col_lanes(acc, j->dy + c0, j->x + c0, j->rstd, j->C, 0, j->N, w);
    for (int c = 0; c < w; c++) j->dw[c0 + c] = j->dw[c0 + c] + lanes_reduce(acc + c, w);
}

void kiln_cpu_rmsnorm_backward(kiln_pool *pool, const kiln_cpu_kernels *k, float *dx, float *dw,
                               const float *dy, const float *x, const float *w, int N, int C,
                               float eps, float *rstd, bool accumulate_dx) {
    if (N <= 0 || C <= 0) return;
    rms_bwd_job j = {k, kiln_bwd_kernels_for(k->path), dx, dw, rstd, dy, x, w, N, C, 0, eps,
                     accumulate_dx};
    j.n_tasks = bwd_n_tasks(pool, (double)N * C * 3, 32768, N);
    kiln_pool_run(pool, j.n_tasks, rms_bwd_rows_task, &j);
    if (dw && w) kiln_pool_run(pool, (C + 63) / 64, rms_bwd_cols_task, &j);
}

/* ---- rope backward ---------------------------------------------------------------------- */

typedef struct rope_bwd_job {
    float *d;
    const int32_t *pos;
    const float *ct, *st;
    int N, H, HS, n_tasks;
} rope_bwd_job;

/* The transpose of the forward rotation: with a = d[i], b = d[i+HS/2],
 * d[i] = a*c + b*s, d[i+HS/2] = b*c - a*s (two products, then one add or subtract). */
static void rope_bwd_task(void *arg, int task, int thread) {
    const rope_bwd_job *j = arg;
    int64_t lo, hi;
    int half = j->HS / 2;
    bwd_split(j->N, j->n_tasks, task, 1, &lo, &hi);
    for (int64_t n = lo; n < hi; n++) {
        const float *ct = j->ct + (int64_t)j->pos[n] * half;
        const float *st = j->st + (int64_t)j->pos[n] * half;
        for (int h = 0; h < j->H; h++) {
            float *v = j->d + (n * j->H + h) * j->HS;
            for (int i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * ct[i] + b * st[i];
                v[i + half] = b * ct[i] - a * st[i];
            }
        }
    }
}

void kiln_cpu_rope_backward(kiln_pool *pool, float *d, const int32_t *pos, int N, int H, int HS,
                            const float *cos_tab, const float *sin_tab) {
    if (N <= 0) return;
    rope_bwd_job j = {d, pos, cos_tab, sin_tab, N, H, HS, 0};
    j.n_tasks = bwd_n_tasks(pool, (double)N * H * HS * 3, 65536, N);
    kiln_pool_run(pool, j.n_tasks, rope_bwd_task, &j);
}

/* ---- attention backward ----------------------------------------------------------------- */

/* ws holds, per (token i, head h), at (i*NH + h)*3: m and l, the forward's online-softmax
 * max and sum, recomputed with the forward's exact operations (so a forward that saved
 * them would give the same bits), and D = dot(dout_ih, out_ih). Then
 *   p_ij  = kiln_expf(s_ij - m) / l,     s_ij = dot(q_ih, k_j) * scale
 *   dp_ij = dot(dout_ih, v_j);           ds_ij = p_ij * (dp_ij - D)
 *   dq_ih = (sum_j ds_ij k_j) * scale                 keys j ascending
 *   dk_j  = (sum_{h in group, i} ds_ij q_ih) * scale  heads ascending, then tokens ascending
 *   dv_j  =  sum_{h in group, i} p_ij dout_ih         same order
 * each sum a sequence of fmaf into the output row (attn_pv), never split across tasks.
 * With a sliding window the keys of token i are [kiln_attn_window_lo(T, window), T) in the
 * forward's blocks (aligned at multiples of 64, the first cut to start at the window), and key
 * j's queries are those at positions j..j + window - 1. */
typedef struct attn_bwd_job {
    const kiln_cpu_kernels *k;
    float *dq, *dk, *dv, *ws;
    const float *dout, *q, *kc, *vc, *out;
    int N, n_past, NH, KVH, HS, n_tasks;
    float scale;
    int window; /* > 0: a sliding window (ops.h attention) */
} attn_bwd_job;

static void attn_bwd_stats(const attn_bwd_job *j, int i, int h) {
    const kiln_cpu_kernels *k = j->k;
    const int HS = j->HS, kvh = h / (j->NH / j->KVH);
    const int64_t stride = (int64_t)j->KVH * HS, u = (int64_t)i * j->NH + h;
    const float *q = j->q + u * HS;
    const int T = j->n_past + i + 1;
    const int lo = kiln_attn_window_lo(T, j->window);
    float s[KILN_ATTN_BLOCK], p[KILN_ATTN_BLOCK];
    float m = -INFINITY, l = 0.0f;
    for (int kb0 = lo / KILN_ATTN_BLOCK * KILN_ATTN_BLOCK; kb0 < T; kb0 += KILN_ATTN_BLOCK) {
        const int kb = kb0 > lo ? kb0 : lo; /* the block's first key */
        const int nk = T - kb0 < KILN_ATTN_BLOCK ? T - kb : kb0 + KILN_ATTN_BLOCK - kb;
        k->dots(s, q, j->kc + (int64_t)kb * stride + (int64_t)kvh * HS, stride, nk, HS);
        float bm = -INFINITY;
        for (int t = 0; t < nk; t++) {
            s[t] = s[t] * j->scale;
            bm = s[t] > bm ? s[t] : bm;
        }
        float m_new = bm > m ? bm : m;
        float alpha = kiln_expf(m - m_new);
        k->exp_sub(p, s, m_new, nk);
        l = l * alpha;
        for (int t = 0; t < nk; t++) l = l + p[t];
        m = m_new;
    }
    float D;
    k->dots(&D, j->dout + u * HS, j->out + u * HS, 0, 1, HS);
    j->ws[u * 3 + 0] = m;
    j->ws[u * 3 + 1] = l;
    j->ws[u * 3 + 2] = D;
}

static void attn_bwd_dq(const attn_bwd_job *j, int i, int h) {
    const kiln_cpu_kernels *k = j->k;
    const int HS = j->HS, kvh = h / (j->NH / j->KVH);
    const int64_t stride = (int64_t)j->KVH * HS, u = (int64_t)i * j->NH + h;
    const float *q = j->q + u * HS, *dout = j->dout + u * HS;
    const float m = j->ws[u * 3], l = j->ws[u * 3 + 1], D = j->ws[u * 3 + 2];
    float *dq = j->dq + u * HS;
    const int T = j->n_past + i + 1;
    float s[KILN_ATTN_BLOCK], p[KILN_ATTN_BLOCK], dp[KILN_ATTN_BLOCK];
    const int lo = kiln_attn_window_lo(T, j->window);
    for (int d = 0; d < HS; d++) dq[d] = 0.0f;
    for (int kb0 = lo / KILN_ATTN_BLOCK * KILN_ATTN_BLOCK; kb0 < T; kb0 += KILN_ATTN_BLOCK) {
        const int kb = kb0 > lo ? kb0 : lo;
        const int nk = T - kb0 < KILN_ATTN_BLOCK ? T - kb : kb0 + KILN_ATTN_BLOCK - kb;
        const float *kblk = j->kc + (int64_t)kb * stride + (int64_t)kvh * HS;
        const float *vblk = j->vc + (int64_t)kb * stride + (int64_t)kvh * HS;
        k->dots(s, q, kblk, stride, nk, HS);
        for (int t = 0; t < nk; t++) s[t] = s[t] * j->scale;
        k->exp_sub(p, s, m, nk);
        k->dots(dp, dout, vblk, stride, nk, HS);
        for (int t = 0; t < nk; t++) dp[t] = (p[t] / l) * (dp[t] - D); /* ds */
        k->attn_pv(dq, 1.0f, dp, kblk, stride, nk, HS);
    }
    for (int d = 0; d < HS; d++) dq[d] = dq[d] * j->scale;
}

/* Key position jp, kv head g: dk and dv rows. */
static void attn_bwd_dkv(const attn_bwd_job *j, int jp, int g) {
    const kiln_cpu_kernels *k = j->k;
    const int HS = j->HS, G = j->NH / j->KVH;
    const int64_t kvrow = ((int64_t)jp * j->KVH + g) * HS, qstride = (int64_t)j->NH * HS;
    const float *kj = j->kc + kvrow, *vj = j->vc + kvrow;
    float *dk = j->dk + kvrow, *dv = j->dv + kvrow;
    float s[KILN_ATTN_BLOCK], p[KILN_ATTN_BLOCK], dp[KILN_ATTN_BLOCK];
    for (int d = 0; d < HS; d++) dk[d] = 0.0f, dv[d] = 0.0f;
    int i_lo = jp - j->n_past > 0 ? jp - j->n_past : 0; /* causal: n_past + i >= jp */
    int i_hi = j->N; /* the window: n_past + i < jp + window */
    if (j->window > 0 && (int64_t)jp - j->n_past + j->window < i_hi) i_hi = jp - j->n_past + j->window;
    for (int h = g * G; h < (g + 1) * G; h++) {
        for (int ib = i_lo; ib < i_hi; ib += KILN_ATTN_BLOCK) {
            int nb = i_hi - ib < KILN_ATTN_BLOCK ? i_hi - ib : KILN_ATTN_BLOCK;
            const float *qb = j->q + ((int64_t)ib * j->NH + h) * HS;
            const float *db = j->dout + ((int64_t)ib * j->NH + h) * HS;
            const float *st = j->ws + ((int64_t)ib * j->NH + h) * 3;
            k->dots(s, kj, qb, qstride, nb, HS);
            for (int t = 0; t < nb; t++) s[t] = s[t] * j->scale - st[t * j->NH * 3];
            k->exp_sub(p, s, 0.0f, nb); /* kiln_expf((s - m) - 0) == kiln_expf(s - m) */
            k->dots(dp, vj, db, qstride, nb, HS);
            for (int t = 0; t < nb; t++) {
                const float *stt = st + t * j->NH * 3;
                p[t] = p[t] / stt[1];
                dp[t] = p[t] * (dp[t] - stt[2]);
            }
            k->attn_pv(dv, 1.0f, p, db, qstride, nb, HS);
            k->attn_pv(dk, 1.0f, dp, qb, qstride, nb, HS);
        }
    }
    for (int d = 0; d < HS; d++) dk[d] = dk[d] * j->scale;
}

/* Work units are assigned cyclically (unit u to task u % n_tasks): causal rows differ in
 * length, and the assignment never changes a result. */
static void attn_bwd_stats_task(void *arg, int task, int thread) {
    const attn_bwd_job *j = arg;
    for (int64_t u = task; u < (int64_t)j->N * j->NH; u += j->n_tasks)
        attn_bwd_stats(j, (int)(u / j->NH), (int)(u % j->NH));
}

static void attn_bwd_dq_task(void *arg, int task, int thread) {
    const attn_bwd_job *j = arg;
    for (int64_t u = task; u < (int64_t)j->N * j->NH; u += j->n_tasks)
        attn_bwd_dq(j, (int)(u / j->NH), (int)(u % j->NH));
}

static void attn_bwd_dkv_task(void *arg, int task, int thread) {
    const attn_bwd_job *j = arg;
    int64_t n_units = (int64_t)(j->n_past + j->N) * j->KVH;
    for (int64_t u = task; u < n_units; u += j->n_tasks)
        attn_bwd_dkv(j, (int)(u / j->KVH), (int)(u % j->KVH));
}

void kiln_cpu_attention_backward(kiln_pool *pool, const kiln_cpu_kernels *k, float *dq,
                                 float *dk, float *dv, const float *dout, const float *q,
                                 const float *kc, const float *vc, const float *out, float *ws,
                                 int N, int n_past, int NH, int KVH, int HS, float scale,
                                 int window) {
    if (N <= 0) return;
    attn_bwd_job j = {k, dq, dk, dv, ws, dout, q, kc, vc, out, N, n_past, NH, KVH, HS, 0, scale, window};
    double work = (double)N * NH * HS * (n_past + N);
    j.n_tasks = bwd_n_tasks(pool, work, 16384, (int64_t)N * NH);
    kiln_pool_run(pool, j.n_tasks, attn_bwd_stats_task, &j);
    kiln_pool_run(pool, j.n_tasks, attn_bwd_dq_task, &j);
    int nkv = bwd_n_tasks(pool, work, 16384, (int64_t)(n_past + N) * KVH);
    j.n_tasks = nkv;
    kiln_pool_run(pool, j.n_tasks, attn_bwd_dkv_task, &j);
}

/* ---- swiglu backward -------------------------------------------------------------------- */

typedef struct swiglu_bwd_job {
    const kiln_cpu_kernels *k;
    float *dgate, *dup;
    const float *dout, *gate, *up;
    size_t n;
    int n_tasks;
} swiglu_bwd_job;

#define SWIGLU_CHUNK 256

/* e = kiln_expf(-g); den = 1 + e; s = 1 / den; silu = g / den (the forward's bits);
 * dup = dout * silu;  dgate = (dout * u) * (s * (1 + g * (1 - s))). */
static void swiglu_bwd_task(void *arg, int task, int thread) {
    const swiglu_bwd_job *j = arg;
    int64_t lo, hi;
    bwd_split((int64_t)j->n, j->n_tasks, task, SWIGLU_CHUNK, &lo, &hi);
    float e[SWIGLU_CHUNK];
    for (int64_t i0 = lo; i0 < hi; i0 += SWIGLU_CHUNK) {
        int m = (int)(hi - i0 < SWIGLU_CHUNK ? hi - i0 : SWIGLU_CHUNK);
        for (int i = 0; i < m; i++) e[i] = -j->gate[i0 + i];
        j->k->exp_sub(e, e, 0.0f, m); /* kiln_expf(-g - 0) == kiln_expf(-g) */
        for (int i = 0; i < m; i++) {
            float g = j->gate[i0 + i], u = j->up[i0 + i], dout = j->dout[i0 + i];
            float den = 1.0f + e[i];
            float s = 1.0f / den;
            float silu = g / den;
            j->dup[i0 + i] = dout * silu;
            j->dgate[i0 + i] = (dout * u) * (s * (1.0f + g * (1.0f - s)));
        }
    }
}

void kiln_cpu_swiglu_backward(kiln_pool *pool, const kiln_cpu_kernels *k, float *dgate,
                              float *dup, const float *dout, const float *gate, const float *up,
                              size_t n) {
    if (n == 0) return;
    swiglu_bwd_job j = {k, dgate, dup, dout, gate, up, n, 0};
    j.n_tasks = bwd_n_tasks(pool, (double)n * 12, 65536, (int64_t)(n / SWIGLU_CHUNK) + 1);
    kiln_pool_run(pool, j.n_tasks, swiglu_bwd_task, &j);
}

/* ---- geglu backward: kiln_geglu_backward per element ------------------------------------ */

static void geglu_bwd_task(void *arg, int task, int thread) {
    const swiglu_bwd_job *j = arg;
    int64_t lo, hi;
    bwd_split((int64_t)j->n, j->n_tasks, task, SWIGLU_CHUNK, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) {
        float dg, du;
        kiln_geglu_backward(j->gate[i], j->up[i], j->dout[i], &dg, &du);
        j->dup[i] = du;
        j->dgate[i] = dg;
    }
}

void kiln_cpu_geglu_backward(kiln_pool *pool, float *dgate, float *dup, const float *dout, const float *gate,
                             const float *up, size_t n) {
    if (n == 0) return;
    swiglu_bwd_job j = {NULL, dgate, dup, dout, gate, up, n, 0};
    j.n_tasks = bwd_n_tasks(pool, (double)n * 24, 65536, (int64_t)(n / SWIGLU_CHUNK) + 1);
    kiln_pool_run(pool, j.n_tasks, geglu_bwd_task, &j);
}

/* ---- embed backward --------------------------------------------------------------------- */

/* A task owns a range of vocabulary rows and scans all ids in increasing token order,
 * adding dy[n,:] into row ids[n] when it is one of its own: each row receives its tokens'
 * gradients in increasing token order, whatever the thread count. */
typedef struct embed_bwd_job {
    float *dtable;
    const float *dy;
    const int32_t *ids;
    int N, V, C, n_tasks;
} embed_bwd_job;

static void embed_bwd_task(void *arg, int task, int thread) {
    const embed_bwd_job *j = arg;
    int64_t lo, hi;
    bwd_split(j->V, j->n_tasks, task, 1, &lo, &hi);
    for (int n = 0; n < j->N; n++) {
        int64_t v = j->ids[n];
        if (v < lo || v >= hi) continue;
        float *row = j->dtable + v * j->C;
        const float *g = j->dy + (int64_t)n * j->C;
        for (int c = 0; c < j->C; c++) row[c] = row[c] + g[c];
    }
}

void kiln_cpu_embed_backward(kiln_pool *pool, float *dtable, const float *dy, const int32_t *ids,
                             int N, int V, int C) {
    if (N <= 0 || V <= 0 || C <= 0) return;
    embed_bwd_job j = {dtable, dy, ids, N, V, C, 0};
    j.n_tasks = bwd_n_tasks(pool, (double)N * C, 65536, V);
    kiln_pool_run(pool, j.n_tasks, embed_bwd_task, &j);
}
