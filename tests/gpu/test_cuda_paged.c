/*
 * test_cuda_paged.c -- the batch ops over a paged KV cache (ops.h: kv_store_rows,
 * attention_paged, get_rows) of the CUDA backend against the CPU backend, through the backend
 * tables.
 *
 * Cases are random: head counts with and without GQA, head sizes 64, 128 and 80, block sizes
 * 64 and 128, a few sequences per batch whose block tables are consecutive runs of the pool
 * or shuffled blocks, batches that mix prefill runs (short ones and ones past 8 tokens, from
 * position 0 or after a context) with single decode tokens in a random order. Pool rows that
 * hold no stored position are NaN, so a kernel that reads outside its sequence's keys cannot
 * pass; every output is NaN before each run, so an unwritten element cannot pass.
 * Every check runs without a window and with sliding windows (ops.h attention_paged's window:
 * 1, 8, 64, 100, 509, 512 keys, sequences and runs longer than the window, runs up to 257
 * tokens). In a windowed mixed case the rows of each sequence below its first batch token's
 * window are NaN and the table entries of blocks wholly below it name a block that holds
 * only NaN, so a kernel that reads a key or a table entry below the window cannot pass.
 *
 * Checked:
 *   - auditable mode (the default): kv_store_rows, attention_paged and get_rows give the
 *     CPU's bits (memcmp); a token's attention_paged output is the same bits computed alone
 *     (N = 1) as inside the mixed batch; a decode batch recorded in a CUDA graph (runs and
 *     host_table NULL) and replayed at other positions (uploaded to the same device array)
 *     gives the bits of the direct call (with the step's kv_store_rows recorded too).
 *   - fast mode: within the fast attention's bounds of the CPU result (|gpu - cpu| / max|v|:
 *     2e-2 for tokens of prefill runs the bf16 tensor-core kernel takes, 1e-5 for the f32
 *     paths: the split decode and the f32 kernels; tests/gpu/test_cuda_fast_attention.cu
 *     states why); two runs give the same bits; a batch over shuffled blocks (prefill runs
 *     gathered) gives the bits of the same batch over a pool where every sequence is
 *     consecutive (prefill runs read in place); the graph replay equals the direct call and
 *     is within the decode bound of the CPU.
 * Without a usable GPU: exits 77 (skipped). Prints a table last, one row per check and window
 * kind (none / sliding).
 * Usage: test_cuda_paged [seed [mixed-cases]]   (mixed-cases: default 30; fewer for
 * compute-sanitizer runs)
 */
#include "base/base.h"
#include "ops/ops.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- random numbers (splitmix64) ---------------------------------------------------------- */

static uint64_t g_rng = 0x706167656443554bull;
static uint64_t rnd_u64(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static int rnd_int(int lo, int hi) { return lo + (int)(rnd_u64() % (uint64_t)(hi - lo + 1)); }
static float rnd_unit(void) { return (float)((double)(rnd_u64() >> 11) * 0x1p-53 * 2.0 - 1.0); }

/* ---- results ------------------------------------------------------------------------------- */

enum { R_STORE, R_GET, R_ATTN, R_ALONE, R_GRAPH, R_F_DEC, R_F_FLASH, R_F_F32, R_F_TWICE,
       R_F_GATHER, R_F_GRAPH, R_COUNT };
static const char *g_names[R_COUNT] = {
    "kv_store_rows == cpu",       "get_rows == cpu",
    "attention_paged == cpu",     "  token alone == in batch",
    "  graph step == direct",   "fast: decode tokens vs cpu",
    "fast: prefill (bf16 mma)",   "fast: prefill (f32 kernels)",
    "fast: two runs, same bits",  "fast: gathered == in place",
    "fast: graph step == direct"};
/* [0]: no window, [1]: a sliding window (g_w: the set the running case counts into) */
static long g_cases[2][R_COUNT], g_elems[2][R_COUNT], g_bad[2][R_COUNT];
static double g_worst[2][R_COUNT]; /* fast rows: max |gpu - cpu| / max|v| */
static int g_w;
static int g_failed;
static long g_runs_inplace, g_runs_gathered;

static kiln_backend *g_cpu, *g_gpu, *g_fast;

static void fail_status(const char *what) {
    fprintf(stderr, "FAIL %s: %s\n", what, kiln_last_error());
    g_failed = 1;
}

/* Compare n floats bit for bit; report the first difference. */
static void compare(int row, const char *ctx, const float *want, const float *got, size_t n) {
    long bad = 0;
    size_t first = 0;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&want[i], &got[i], 4) != 0) {
            if (!bad) first = i;
            bad++;
        }
    g_cases[g_w][row]++;
    g_elems[g_w][row] += (long)n;
    g_bad[g_w][row] += bad;
    if (bad) {
        fprintf(stderr, "FAIL %s (%s): %ld of %zu differ; first [%zu] want %.9g got %.9g\n",
                g_names[row], ctx, bad, n, first, want[first], got[first]);
        g_failed = 1;
    }
}

/* A fast-mode row: |got - want| <= bound * maxv elementwise, every value finite. */
static void within(int row, const char *ctx, const float *want, const float *got, size_t n,
                   float maxv, double bound) {
    long bad = 0;
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - (double)want[i]) / maxv;
        if (!(e <= bound)) { /* NaN too */
            if (!bad)
                fprintf(stderr, "FAIL %s (%s): [%zu] cpu %.9g gpu %.9g (err %.3g max|v|)\n",
                        g_names[row], ctx, i, want[i], got[i], e);
            bad++;
        }
        if (e > worst) worst = e;
    }
    g_cases[g_w][row]++;
    g_elems[g_w][row] += (long)n;
    g_bad[g_w][row] += bad;
    if (worst > g_worst[g_w][row]) g_worst[g_w][row] = worst;
    if (bad) g_failed = 1;
}

/* ---- device buffers (allocated and filled through the auditable backend; the fast one runs
 * on the same device, after a status of the other) ---------------------------------------- */

static void *dev_alloc(size_t nbytes) {
    void *p = kiln_backend_alloc(g_gpu, nbytes ? nbytes : 4);
    if (!p) {
        fail_status("alloc");
        exit(1);
    }
    return p;
}
static void up(void *d, const void *h, size_t nbytes) {
    if (kiln_backend_upload(g_gpu, d, h, nbytes) != KILN_OK) fail_status("upload");
}
static void down(kiln_backend *be, void *h, const void *d, size_t nbytes) {
    if (kiln_backend_download(be, h, d, nbytes) != KILN_OK) fail_status("download");
}
static void *dev_copy(const void *h, size_t nbytes) {
    void *d = dev_alloc(nbytes);
    up(d, h, nbytes);
    return d;
}
static float *host_floats(size_t n, float scale) {
    float *h = kiln_malloc(n * 4 + 4);
    for (size_t i = 0; i < n; i++) h[i] = rnd_unit() * scale;
    return h;
}
static float *host_nan(size_t n) {
    float *h = kiln_malloc(n * 4 + 4);
    for (size_t i = 0; i < n; i++) h[i] = NAN;
    return h;
}
static void status_ok(kiln_backend *be, const char *what) {
    if (kiln_backend_status(be) != KILN_OK) fail_status(what);
}

/* ---- a random batch over a random paged pool ------------------------------------------------ */

typedef struct pcase {
    int NH, KVH, HS, bs, n_seq, max_blocks, n_blocks;
    int32_t *table;            /* (n_seq, max_blocks) host; -1 past each sequence's blocks */
    int32_t *dense_table;      /* the same sequences, each on consecutive blocks s*max_blocks.. */
    int N, n_runs, max_T;
    kiln_batch_run *runs;      /* (n_runs) in token order */
    int32_t *seq, *pos, *slots, *dense_slots; /* (N) */
    float *q, *k_new, *v_new;  /* (N, NH, HS), (N, KVH, HS) x 2 */
    float *k_pool, *v_pool;    /* (n_blocks * bs, KVH, HS): the context rows, NaN elsewhere */
    float *k_dense, *v_dense;  /* (n_seq * max_blocks * bs, KVH, HS): the same, dense table */
    float maxv;                /* max |v| over every stored row */
    int n_prefill_mma;         /* prefill runs the tensor-core kernel takes in fast mode */
    int window;                /* attention_paged's window (0: none) */
} pcase;

/* The first position a query at position p sees under window (0: none): ops.h. */
static int window_lo(int p, int window) {
    return window > 0 && p + 1 > window ? p + 1 - window : 0;
}

static size_t rowf(const pcase *c) { return (size_t)c->KVH * c->HS; }

/* Pool row of position p of sequence s under table t. */
static int64_t slot_of(const pcase *c, const int32_t *t, int s, int p) {
    return (int64_t)t[(int64_t)s * c->max_blocks + p / c->bs] * c->bs + p % c->bs;
}

/* decode_only: every sequence brings one token (the graph tests); max_ctx: the longest
 * context before the batch; window: the case's sliding window (0: none). With a window and
 * not decode_only, the rows of each sequence below its first batch token's window are NaN
 * and the table entries of the blocks wholly below it name a free block (NaN rows only): no
 * key or table entry below a window may be read. */
static pcase make_case(int NH, int KVH, int HS, int bs, int n_seq, int decode_only, int max_ctx,
                       int window) {
    pcase c;
    memset(&c, 0, sizeof c);
    c.NH = NH, c.KVH = KVH, c.HS = HS, c.bs = bs, c.n_seq = n_seq, c.window = window;
    const size_t ns = sizeof(int) * (size_t)n_seq;
    int *n = kiln_malloc(ns), *pos0 = kiln_malloc(ns), *order = kiln_malloc(ns);
    int *cons = kiln_malloc(ns);
    static const int lens[] = {2, 3, 5, 8, 9, 16, 17, 40, 64, 65, 100, 150, 257};
    int nb_max = 1, total_nb = 0;
    for (int s = 0; s < n_seq; s++) {
        const int kind = decode_only ? 0 : rnd_int(0, 2); /* decode, prefill, prefill */
        /* windowed cases also take runs of more than 128 tokens (several query tiles) */
        n[s] = kind == 0 ? 1 : lens[rnd_int(0, window > 0 ? 12 : 10)];
        pos0[s] = rnd_int(0, 3) == 0 && kind ? 0 : rnd_int(kind ? 0 : 1, max_ctx);
        const int nb = (pos0[s] + n[s] - 1) / bs + 1;
        nb_max = nb > nb_max ? nb : nb_max;
        total_nb += nb;
        order[s] = s;
        cons[s] = rnd_int(0, 1);
    }
    c.max_blocks = nb_max + rnd_int(0, 1);
    for (int s = n_seq - 1; s > 0; s--) { /* the batch's order of sequences */
        int j = rnd_int(0, s), t = order[s];
        order[s] = order[j], order[j] = t;
    }
    /* the pool: consecutive sequences take ranges from a random start, the others the rest
     * of the blocks shuffled; a few blocks stay free */
    c.n_blocks = total_nb + 3;
    c.table = kiln_malloc(sizeof(int32_t) * (size_t)n_seq * (size_t)c.max_blocks);
    c.dense_table = kiln_malloc(sizeof(int32_t) * (size_t)n_seq * (size_t)c.max_blocks);
    for (int i = 0; i < n_seq * c.max_blocks; i++) c.table[i] = -1, c.dense_table[i] = i;
    int32_t *blocks = kiln_malloc(sizeof(int32_t) * (size_t)c.n_blocks);
    const int start = rnd_int(0, 2);
    int cursor = start, nfree = 0;
    for (int s = 0; s < n_seq; s++)
        if (cons[s])
            for (int j = 0; j < (pos0[s] + n[s] - 1) / bs + 1; j++)
                c.table[s * c.max_blocks + j] = cursor++;
    for (int b = 0; b < c.n_blocks; b++) /* the blocks no consecutive sequence took */
        if (b < start || b >= cursor) blocks[nfree++] = b;
    for (int i = nfree - 1; i > 0; i--) {
        int j = rnd_int(0, i), t = blocks[i];
        blocks[i] = blocks[j], blocks[j] = t;
    }
    int next = 0;
    for (int s = 0; s < n_seq; s++)
        if (!cons[s])
            for (int j = 0; j < (pos0[s] + n[s] - 1) / bs + 1; j++)
                c.table[s * c.max_blocks + j] = blocks[next++];

    /* the batch */
    for (int s = 0; s < n_seq; s++) c.N += n[s];
    c.n_runs = n_seq;
    c.runs = kiln_malloc(sizeof(kiln_batch_run) * (size_t)n_seq);
    c.seq = kiln_malloc(sizeof(int32_t) * (size_t)c.N);
    c.pos = kiln_malloc(sizeof(int32_t) * (size_t)c.N);
    c.slots = kiln_malloc(sizeof(int32_t) * (size_t)c.N);
    c.dense_slots = kiln_malloc(sizeof(int32_t) * (size_t)c.N);
    int t = 0;
    for (int r = 0; r < n_seq; r++) {
        const int s = order[r];
        c.runs[r] = (kiln_batch_run){t, n[s], s, pos0[s]};
        if (n[s] > 8 && (HS == 64 || HS == 128)) c.n_prefill_mma++;
        for (int i = 0; i < n[s]; i++, t++) {
            c.seq[t] = s;
            c.pos[t] = pos0[s] + i;
            c.slots[t] = (int32_t)slot_of(&c, c.table, s, pos0[s] + i);
            c.dense_slots[t] = (int32_t)slot_of(&c, c.dense_table, s, pos0[s] + i);
            if (c.pos[t] + 1 > c.max_T) c.max_T = c.pos[t] + 1;
        }
    }
    const size_t rf = rowf(&c), npool = (size_t)c.n_blocks * bs * rf;
    const size_t ndense = (size_t)n_seq * c.max_blocks * bs * rf;
    const float qscale = (float)rnd_int(1, 8);
    c.q = host_floats((size_t)c.N * NH * HS, qscale);
    c.k_new = host_floats((size_t)c.N * rf, 1.0f);
    c.v_new = host_floats((size_t)c.N * rf, 1.0f);
    c.k_pool = host_nan(npool);
    c.v_pool = host_nan(npool);
    c.k_dense = host_nan(ndense);
    c.v_dense = host_nan(ndense);
    c.maxv = 0.0f;
    for (size_t i = 0; i < (size_t)c.N * rf; i++)
        c.maxv = fmaxf(c.maxv, fabsf(c.v_new[i]));
    for (int s = 0; s < n_seq; s++)
        for (int p = 0; p < pos0[s]; p++) { /* the context the batch follows */
            float *kp = c.k_pool + slot_of(&c, c.table, s, p) * rf;
            float *vp = c.v_pool + slot_of(&c, c.table, s, p) * rf;
            for (size_t i = 0; i < rf; i++) {
                kp[i] = rnd_unit();
                vp[i] = rnd_unit();
                c.maxv = fmaxf(c.maxv, fabsf(vp[i]));
            }
            memcpy(c.k_dense + slot_of(&c, c.dense_table, s, p) * rf, kp, rf * 4);
            memcpy(c.v_dense + slot_of(&c, c.dense_table, s, p) * rf, vp, rf * 4);
        }
    if (window > 0 && !decode_only) {
        /* a free block: no table names it, so its rows stay NaN */
        int nan_block = -1;
        for (int b = 0; b < c.n_blocks && nan_block < 0; b++) {
            int used = 0;
            for (int i = 0; i < n_seq * c.max_blocks; i++) used |= c.table[i] == b;
            if (!used) nan_block = b;
        }
        for (int s = 0; s < n_seq; s++) {
            const int lo = window_lo(pos0[s], window);
            for (int p = 0; p < lo; p++) {
                float *rows[] = {c.k_pool + slot_of(&c, c.table, s, p) * rf,
                                 c.v_pool + slot_of(&c, c.table, s, p) * rf,
                                 c.k_dense + slot_of(&c, c.dense_table, s, p) * rf,
                                 c.v_dense + slot_of(&c, c.dense_table, s, p) * rf};
                for (int k = 0; k < 4; k++)
                    for (size_t i = 0; i < rf; i++) rows[k][i] = NAN;
            }
            for (int j = 0; j < lo / bs; j++) c.table[s * c.max_blocks + j] = nan_block;
        }
    }
    for (int r = 0; r < c.n_runs; r++) {
        const kiln_batch_run *u = &c.runs[r];
        if (u->n < 2) continue;
        const int nb = (u->pos0 + u->n - 1) / bs + 1, b0 = window_lo(u->pos0, window) / bs;
        const int32_t *row = c.table + u->seq * c.max_blocks;
        int consecutive = 1;
        for (int j = b0 + 1; j < nb; j++) consecutive &= row[j] == row[b0] + (j - b0);
        if (consecutive) g_runs_inplace++;
        else g_runs_gathered++;
    }
    kiln_free(n), kiln_free(pos0), kiln_free(order), kiln_free(cons), kiln_free(blocks);
    return c;
}

static void free_case(pcase *c) {
    kiln_free(c->table), kiln_free(c->dense_table), kiln_free(c->runs);
    kiln_free(c->seq), kiln_free(c->pos), kiln_free(c->slots), kiln_free(c->dense_slots);
    kiln_free(c->q), kiln_free(c->k_new), kiln_free(c->v_new);
    kiln_free(c->k_pool), kiln_free(c->v_pool), kiln_free(c->k_dense), kiln_free(c->v_dense);
}

/* The case's arrays in device memory. */
typedef struct dcase {
    int32_t *table, *dense_table, *seq, *pos, *slots, *dense_slots;
    float *q, *k_new, *v_new, *k_pool, *v_pool, *k_dense, *v_dense, *out;
} dcase;

static dcase upload_case(const pcase *c) {
    dcase d;
    const size_t rf = rowf(c), nt = (size_t)c->n_seq * c->max_blocks;
    const size_t npool = (size_t)c->n_blocks * c->bs * rf, ndense = nt * c->bs * rf;
    d.table = dev_copy(c->table, nt * 4);
    d.dense_table = dev_copy(c->dense_table, nt * 4);
    d.seq = dev_copy(c->seq, (size_t)c->N * 4);
    d.pos = dev_copy(c->pos, (size_t)c->N * 4);
    d.slots = dev_copy(c->slots, (size_t)c->N * 4);
    d.dense_slots = dev_copy(c->dense_slots, (size_t)c->N * 4);
    d.q = dev_copy(c->q, (size_t)c->N * c->NH * c->HS * 4);
    d.k_new = dev_copy(c->k_new, (size_t)c->N * rf * 4);
    d.v_new = dev_copy(c->v_new, (size_t)c->N * rf * 4);
    d.k_pool = dev_copy(c->k_pool, npool * 4);
    d.v_pool = dev_copy(c->v_pool, npool * 4);
    d.k_dense = dev_copy(c->k_dense, ndense * 4);
    d.v_dense = dev_copy(c->v_dense, ndense * 4);
    d.out = dev_alloc((size_t)c->N * c->NH * c->HS * 4);
    return d;
}

static void free_dcase(dcase *d) {
    void *p[] = {d->table, d->dense_table, d->seq, d->pos, d->slots, d->dense_slots, d->q,
                 d->k_new, d->v_new, d->k_pool, d->v_pool, d->k_dense, d->v_dense, d->out};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) kiln_backend_free_buf(g_gpu, p[i]);
}

static float scale_of(int HS) { return 1.0f / sqrtf((float)HS); }

/* attention_paged on be into d->out (poisoned first) and back into host out. */
static void gpu_attention(kiln_backend *be, const pcase *c, const dcase *d, int dense,
                          int with_runs, int with_host_table, float *out) {
    const size_t nout = (size_t)c->N * c->NH * c->HS;
    float *nan = host_nan(nout);
    up(d->out, nan, nout * 4);
    kiln_free(nan);
    status_ok(g_gpu, "upload");
    kiln_kv_pages pg = {c->bs, c->max_blocks, dense ? d->dense_table : d->table,
                        with_host_table ? (dense ? c->dense_table : c->table) : NULL};
    be->i->attention_paged(be, d->out, d->q, dense ? d->k_dense : d->k_pool,
                           dense ? d->v_dense : d->v_pool, &pg, d->seq, d->pos,
                           with_runs ? c->runs : NULL, with_runs ? c->n_runs : 0, c->N, c->max_T,
                           c->NH, c->KVH, c->HS, scale_of(c->HS), c->window);
    status_ok(be, "attention_paged");
    down(be, out, d->out, nout * 4);
}

/* ---- the checks ------------------------------------------------------------------------------ */

/* One mixed case: store, attention (auditable, and fast within bounds), batch invariance,
 * gathered == in place; window: the sliding window (0: none). */
static void test_mixed(int NH, int KVH, int HS, int bs, int n_seq, int max_ctx, int window) {
    pcase c = make_case(NH, KVH, HS, bs, n_seq, 0, max_ctx, window);
    g_w = window > 0;
    char ctx[160];
    snprintf(ctx, sizeof ctx, "NH %d KVH %d HS %d bs %d, %d seqs, %d tokens, max_T %d, window %d",
             NH, KVH, HS, bs, n_seq, c.N, c.max_T, window);
    const size_t rf = rowf(&c), npool = (size_t)c.n_blocks * bs * rf;
    const size_t ndense = (size_t)n_seq * c.max_blocks * bs * rf;
    const size_t nout = (size_t)c.N * NH * HS;
    dcase d = upload_case(&c);

    /* the CPU: store the batch's rows into both pools, then attention over the shuffled one */
    g_cpu->i->kv_store_rows(g_cpu, c.k_pool, c.v_pool, c.k_new, c.v_new, c.slots, c.N, rf);
    g_cpu->i->kv_store_rows(g_cpu, c.k_dense, c.v_dense, c.k_new, c.v_new, c.dense_slots, c.N, rf);
    float *want = host_nan(nout);
    kiln_kv_pages cpg = {bs, c.max_blocks, c.table, c.table};
    g_cpu->i->attention_paged(g_cpu, want, c.q, c.k_pool, c.v_pool, &cpg, c.seq, c.pos, c.runs,
                              c.n_runs, c.N, c.max_T, NH, KVH, HS, scale_of(HS), window);

    /* kv_store_rows */
    g_gpu->i->kv_store_rows(g_gpu, d.k_pool, d.v_pool, d.k_new, d.v_new, d.slots, c.N, rf);
    g_gpu->i->kv_store_rows(g_gpu, d.k_dense, d.v_dense, d.k_new, d.v_new, d.dense_slots, c.N, rf);
    status_ok(g_gpu, "kv_store_rows");
    float *got_pool = kiln_malloc((npool > ndense ? npool : ndense) * 4);
    down(g_gpu, got_pool, d.k_pool, npool * 4);
    compare(R_STORE, ctx, c.k_pool, got_pool, npool);
    down(g_gpu, got_pool, d.v_pool, npool * 4);
    compare(R_STORE, ctx, c.v_pool, got_pool, npool);
    down(g_gpu, got_pool, d.v_dense, ndense * 4);
    compare(R_STORE, ctx, c.v_dense, got_pool, ndense);
    kiln_free(got_pool);

    /* auditable attention: the CPU's bits, with and without runs */
    float *got = host_nan(nout), *got2 = host_nan(nout);
    gpu_attention(g_gpu, &c, &d, 0, 1, 1, got);
    compare(R_ATTN, ctx, want, got, nout);
    gpu_attention(g_gpu, &c, &d, 1, 0, 0, got2);
    compare(R_ATTN, ctx, want, got2, nout);

    /* each token alone (N = 1) */
    {
        const size_t row = (size_t)NH * HS;
        float *one = host_nan(row);
        kiln_kv_pages pg = {bs, c.max_blocks, d.table, c.table};
        for (int t = 0; t < c.N; t++) {
            up(d.out, one, row * 4);
            kiln_batch_run run = {0, 1, c.seq[t], c.pos[t]};
            g_gpu->i->attention_paged(g_gpu, d.out, d.q + t * row, d.k_pool, d.v_pool, &pg,
                                      d.seq + t, d.pos + t, &run, 1, 1, c.pos[t] + 1, NH, KVH, HS,
                                      scale_of(HS), window);
            status_ok(g_gpu, "attention_paged (alone)");
            float *h = kiln_malloc(row * 4);
            down(g_gpu, h, d.out, row * 4);
            compare(R_ALONE, ctx, got + t * row, h, row);
            kiln_free(h);
        }
        kiln_free(one);
    }

    /* fast mode */
    status_ok(g_gpu, "sync before fast");
    float *f1 = host_nan(nout), *f2 = host_nan(nout), *f3 = host_nan(nout);
    gpu_attention(g_fast, &c, &d, 0, 1, 1, f1);
    gpu_attention(g_fast, &c, &d, 0, 1, 1, f2);
    compare(R_F_TWICE, ctx, f1, f2, nout);
    gpu_attention(g_fast, &c, &d, 1, 1, 1, f3);
    compare(R_F_GATHER, ctx, f3, f1, nout);
    const size_t row = (size_t)NH * HS;
    for (int r = 0; r < c.n_runs; r++) {
        const kiln_batch_run *u = &c.runs[r];
        const int mma = u->n > 8 && (HS == 64 || HS == 128);
        const int rr = u->n == 1 ? R_F_DEC : mma ? R_F_FLASH : R_F_F32;
        within(rr, ctx, want + u->first * row, f1 + u->first * row, (size_t)u->n * row, c.maxv,
               mma ? 2e-2 : 1e-5);
    }
    /* fast without the host table: every token through the split decode */
    gpu_attention(g_fast, &c, &d, 0, 1, 0, f2);
    within(R_F_DEC, ctx, want, f2, nout, c.maxv, 1e-5);

    kiln_free(want), kiln_free(got), kiln_free(got2), kiln_free(f1), kiln_free(f2),
        kiln_free(f3);
    free_dcase(&d);
    free_case(&c);
}

/* A decode step (one token per sequence: kv_store_rows of its k, v rows, then
 * attention_paged with runs and host_table NULL) recorded in a graph on be, replayed at the
 * recorded positions and at new ones (positions and slots uploaded to the same arrays), each
 * replay against the direct calls from the same pool: the outputs and the pools after the
 * store must be the same bits (auditable: also the CPU's; fast: within the decode bound of
 * the CPU). max_T is above every position (the graph's bound); window: the recorded sliding
 * window (0: none). */
static void test_graph(kiln_backend *be, int row_id, int NH, int KVH, int HS, int bs, int n_seq,
                       int max_ctx, int window) {
    pcase c = make_case(NH, KVH, HS, bs, n_seq, 1, max_ctx, window);
    g_w = window > 0;
    const size_t rf = rowf(&c), nout = (size_t)c.N * NH * HS;
    const size_t npool = (size_t)c.n_blocks * bs * rf;
    /* every position of every sequence's blocks holds a key, so any position is valid */
    int max_T = 0;
    for (int s = 0; s < n_seq; s++) {
        int nb = 0;
        while (nb < c.max_blocks && c.table[s * c.max_blocks + nb] >= 0) nb++;
        max_T = nb * bs > max_T ? nb * bs : max_T;
        for (int p = 0; p < nb * bs; p++) {
            float *kp = c.k_pool + slot_of(&c, c.table, s, p) * rf;
            float *vp = c.v_pool + slot_of(&c, c.table, s, p) * rf;
            if (kp[0] == kp[0]) continue; /* a context row already */
            for (size_t i = 0; i < rf; i++) kp[i] = rnd_unit(), vp[i] = rnd_unit();
        }
    }
    float maxv = 0.0f; /* max |v| over the pool (fmaxf skips the NaN rows) */
    for (size_t i = 0; i < npool; i++) maxv = fmaxf(maxv, fabsf(c.v_pool[i]));
    for (size_t i = 0; i < (size_t)c.N * rf; i++) maxv = fmaxf(maxv, fabsf(c.v_new[i]));
    char ctx[160];
    snprintf(ctx, sizeof ctx, "%s%s NH %d KVH %d HS %d bs %d, %d seqs, max_T %d, window %d",
             be->i->name, be == g_fast ? " fast" : "", NH, KVH, HS, bs, n_seq, max_T, window);
    dcase d = upload_case(&c);
    status_ok(g_gpu, "upload");
    kiln_kv_pages pg = {bs, c.max_blocks, d.table, NULL};
    float *want = host_nan(nout), *got = host_nan(nout), *nan = host_nan(nout);
    float *pool_want = kiln_malloc(npool * 4), *pool_got = kiln_malloc(npool * 4);
    const float scale = scale_of(HS);
    /* the step's calls, enqueued on be */
#define STEP()                                                                                 \
    do {                                                                                       \
        be->i->kv_store_rows(be, d.k_pool, d.v_pool, d.k_new, d.v_new, d.slots, c.N, rf);       \
        be->i->attention_paged(be, d.out, d.q, d.k_pool, d.v_pool, &pg, d.seq, d.pos, NULL, 0,  \
                               c.N, max_T, NH, KVH, HS, scale, window);                        \
    } while (0)
    /* the direct calls first: they size any workspace outside the capture */
    STEP();
    status_ok(be, "direct step");
    void *graph = NULL;
    kiln_status st = be->i->graph_begin(be, c.N, NH, HS, max_T);
    if (st == KILN_OK) {
        STEP();
        st = be->i->graph_end(be, &graph);
    }
    if (st != KILN_OK) {
        fail_status("graph record");
        goto done;
    }
    for (int round = 0; round < 3; round++) {
        if (round) { /* new positions anywhere inside each sequence's blocks */
            for (int t = 0; t < c.N; t++) {
                int nb = 0;
                while (nb < c.max_blocks && c.table[c.seq[t] * c.max_blocks + nb] >= 0) nb++;
                c.pos[t] = rnd_int(0, nb * bs - 1);
                c.slots[t] = (int32_t)slot_of(&c, c.table, c.seq[t], c.pos[t]);
            }
            up(d.pos, c.pos, (size_t)c.N * 4);
            up(d.slots, c.slots, (size_t)c.N * 4);
        }
        for (int replay = 0; replay < 2; replay++) { /* direct, then the graph */
            up(d.k_pool, c.k_pool, npool * 4);
            up(d.v_pool, c.v_pool, npool * 4);
            up(d.out, nan, nout * 4);
            status_ok(g_gpu, "upload");
            if (!replay) STEP();
            else if (be->i->graph_launch(be, graph) != KILN_OK) fail_status("graph_launch");
            status_ok(be, replay ? "graph replay" : "direct step");
            down(be, replay ? got : want, d.out, nout * 4);
            down(be, replay ? pool_got : pool_want, d.k_pool, npool * 4);
        }
        compare(row_id, ctx, want, got, nout);
        compare(row_id, ctx, pool_want, pool_got, npool);
        { /* and the CPU's: its bits (auditable), within the decode bound (fast) */
            float *cpu = host_nan(nout), *kp = kiln_malloc(npool * 4), *vp = kiln_malloc(npool * 4);
            memcpy(kp, c.k_pool, npool * 4);
            memcpy(vp, c.v_pool, npool * 4);
            kiln_kv_pages cpg = {bs, c.max_blocks, c.table, c.table};
            g_cpu->i->kv_store_rows(g_cpu, kp, vp, c.k_new, c.v_new, c.slots, c.N, rf);
            g_cpu->i->attention_paged(g_cpu, cpu, c.q, kp, vp, &cpg, c.seq, c.pos, NULL, 0, c.N,
                                      max_T, NH, KVH, HS, scale, window);
            if (be == g_gpu) {
                compare(R_ATTN, ctx, cpu, got, nout);
                compare(R_STORE, ctx, kp, pool_got, npool);
            } else {
                within(R_F_DEC, ctx, cpu, got, nout, maxv, 1e-5);
            }
            kiln_free(cpu), kiln_free(kp), kiln_free(vp);
        }
    }
#undef STEP
    be->i->graph_free(be, graph);
done:
    kiln_free(want), kiln_free(got), kiln_free(nan), kiln_free(pool_want), kiln_free(pool_got);
    free_dcase(&d);
    free_case(&c);
}

/* get_rows: out row i = x row idx[i] (host idx, repeats allowed). */
static void test_get_rows(int rows, int n, int C) {
    float *x = host_floats((size_t)rows * C, 4.0f), *want = host_nan((size_t)n * C);
    float *got = host_nan((size_t)n * C);
    int32_t *idx = kiln_malloc(sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++) idx[i] = rnd_int(0, rows - 1);
    float *dx = dev_copy(x, (size_t)rows * C * 4), *dout = dev_copy(got, (size_t)n * C * 4);
    g_cpu->i->get_rows(g_cpu, want, x, idx, n, C);
    g_gpu->i->get_rows(g_gpu, dout, dx, idx, n, C);
    status_ok(g_gpu, "get_rows");
    down(g_gpu, got, dout, (size_t)n * C * 4);
    char ctx[64];
    snprintf(ctx, sizeof ctx, "%d of %d rows of %d", n, rows, C);
    compare(R_GET, ctx, want, got, (size_t)n * C);
    kiln_backend_free_buf(g_gpu, dx), kiln_backend_free_buf(g_gpu, dout);
    kiln_free(x), kiln_free(want), kiln_free(got), kiln_free(idx);
}

/* kv_store_rows alone: N rows to distinct random slots of a pool of n_slots rows. */
static void test_store(int n_slots, int N, size_t row_floats) {
    const size_t np = (size_t)n_slots * row_floats, nr = (size_t)N * row_floats;
    float *kp = host_nan(np), *vp = host_nan(np), *kr = host_floats(nr, 1.0f);
    float *vr = host_floats(nr, 1.0f), *got = kiln_malloc(np * 4);
    int32_t *perm = kiln_malloc(sizeof(int32_t) * (size_t)n_slots);
    for (int i = 0; i < n_slots; i++) perm[i] = i;
    for (int i = n_slots - 1; i > 0; i--) {
        int j = rnd_int(0, i), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    float *dkp = dev_copy(kp, np * 4), *dvp = dev_copy(vp, np * 4);
    float *dkr = dev_copy(kr, nr * 4), *dvr = dev_copy(vr, nr * 4);
    int32_t *ds = dev_copy(perm, (size_t)N * 4);
    g_cpu->i->kv_store_rows(g_cpu, kp, vp, kr, vr, perm, N, row_floats);
    g_gpu->i->kv_store_rows(g_gpu, dkp, dvp, dkr, dvr, ds, N, row_floats);
    status_ok(g_gpu, "kv_store_rows");
    char ctx[64];
    snprintf(ctx, sizeof ctx, "%d rows of %zu into %d slots", N, row_floats, n_slots);
    down(g_gpu, got, dkp, np * 4);
    compare(R_STORE, ctx, kp, got, np);
    down(g_gpu, got, dvp, np * 4);
    compare(R_STORE, ctx, vp, got, np);
    void *p[] = {dkp, dvp, dkr, dvr, ds};
    for (int i = 0; i < 5; i++) kiln_backend_free_buf(g_gpu, p[i]);
    kiln_free(kp), kiln_free(vp), kiln_free(kr), kiln_free(vr), kiln_free(got), kiln_free(perm);
}

int main(int argc, char **argv) {
    if (argc > 1) g_rng = strtoull(argv[1], NULL, 0);
    const int n_mixed = argc > 2 ? atoi(argv[2]) : 30;
    kiln_status st = kiln_backend_cuda_create(0, &g_gpu);
    if (st != KILN_OK) {
        const char *msg = kiln_last_error();
        printf("no CUDA backend: %s\n", msg);
        if (st != KILN_ERR_UNSUPPORTED || !msg || !*msg) {
            fprintf(stderr, "FAIL: expected KILN_ERR_UNSUPPORTED with a message, got %d\n", st);
            return 1;
        }
        return 77; /* skipped: no GPU here */
    }
    if (kiln_backend_cuda_create_mode(0, 1, &g_fast) != KILN_OK ||
        kiln_backend_cpu_create(8, &g_cpu) != KILN_OK) {
        fail_status("backends");
        return 1;
    }
    if (!g_gpu->i->attention_paged || !g_gpu->i->kv_store_rows || !g_gpu->i->get_rows) {
        fprintf(stderr, "FAIL: the CUDA backend lacks the paged ops\n");
        return 1;
    }
    printf("seed 0x%llx\n", (unsigned long long)g_rng);

    /* (NH, KVH): plain, GQA groups of 2..7 */
    static const int heads[][2] = {{4, 4}, {8, 2}, {14, 2}, {6, 3}, {2, 1}, {12, 4}};
    static const int HSs[] = {64, 128, 80};
    for (int rep = 0; rep < n_mixed; rep++) {
        const int *h = heads[rep % 6];
        test_mixed(h[0], h[1], HSs[rep % 3], rep & 1 ? 128 : 64, rnd_int(2, 6),
                   rep < n_mixed * 3 / 5 ? 300 : 1200, 0);
    }
    /* decode graphs: short, and past 64 splits of 64 keys (the combine kernel) */
    for (int rep = 0; rep < (n_mixed < 6 ? n_mixed : 6); rep++) {
        const int *h = heads[rep % 6];
        const int ctx = rep < 4 ? 400 : 5000;
        const int bs = rep & 1 ? 128 : 64;
        test_graph(g_gpu, R_GRAPH, h[0], h[1], HSs[rep % 3], bs, rnd_int(1, 5), ctx, 0);
        test_graph(g_fast, R_F_GRAPH, h[0], h[1], HSs[rep % 3], bs, rnd_int(1, 5), ctx, 0);
    }
    /* sliding windows: one key, inside one 64-key block, exactly one, across block edges, and
     * about 512 (Gemma's local layers use 512 to 4096); contexts past the window */
    static const int windows[] = {1, 8, 64, 100, 509, 512};
    const int n_win = n_mixed >= 30 ? 3 : 1;
    for (int w = 0; w < 6; w++)
        for (int rep = 0; rep < n_win; rep++) {
            const int *h = heads[(w + rep) % 6];
            test_mixed(h[0], h[1], HSs[(w + 2 * rep) % 3], (w + rep) & 1 ? 128 : 64,
                       rnd_int(2, 6), windows[w] > 100 ? 1500 : 400, windows[w]);
        }
    /* windowed decode graphs: the fused combine (400) and the combine kernel (5000) */
    for (int rep = 0; rep < (n_mixed < 6 ? n_mixed : 6); rep++) {
        const int *h = heads[(rep + 3) % 6];
        const int ctx = rep < 3 ? 400 : 5000, window = windows[(rep * 5 + 1) % 6];
        const int bs = rep & 1 ? 64 : 128;
        test_graph(g_gpu, R_GRAPH, h[0], h[1], HSs[rep % 3], bs, rnd_int(1, 5), ctx, window);
        test_graph(g_fast, R_F_GRAPH, h[0], h[1], HSs[rep % 3], bs, rnd_int(1, 5), ctx, window);
    }
    g_w = 0;
    static const int Cs[] = {1, 7, 64, 896, 1001};
    for (int rep = 0; rep < 5; rep++) test_get_rows(rnd_int(1, 50), rnd_int(1, 40), Cs[rep]);
    test_get_rows(300, 70000, 5);  /* more rows than a grid's y */
    test_store(100, 37, 3 * 80);
    test_store(80000, 70000, 8);

    kiln_backend_free(g_gpu);
    kiln_backend_free(g_fast);
    kiln_backend_free(g_cpu);
    printf("\nprefill runs: %ld read in place, %ld gathered\n", g_runs_inplace, g_runs_gathered);
    printf("%-30s %-7s %6s %10s %10s %12s\n", "check", "window", "cases", "elements", "bad",
           "max err/|v|");
    for (int w = 0; w < 2; w++)
        for (int i = 0; i < R_COUNT; i++) {
            char err[32];
            if (i >= R_F_DEC && i <= R_F_F32)
                snprintf(err, sizeof err, "%.2e", g_worst[w][i]);
            else
                snprintf(err, sizeof err, "bits");
            printf("%-30s %-7s %6ld %10ld %10ld %12s\n", g_names[i], w ? "sliding" : "none",
                   g_cases[w][i], g_elems[w][i], g_bad[w][i], err);
        }
    printf("%s\n", g_failed ? "FAILED" : "all paged ops OK");
    return g_failed ? 1 : 0;
}
