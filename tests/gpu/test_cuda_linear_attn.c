/*
 * test_cuda_linear_attn.c -- Qwen3.5's ops (ops.h, "Qwen3.5's ops") of the CUDA backend against
 * the CPU backend (src/ops/cpu/cpu_linear_attn.c), bit for bit (memcmp), in both CUDA modes
 * (auditable and fast: these ops have one arithmetic, the CPU's), through the backend tables.
 *
 * Cases: the element-wise ops (gates with softplus past its threshold and below 2^-24, the
 * output gate in place, halves, the partial RoPE and its transpose with host and device
 * positions, their backwards with every allowed aliasing); gdn_gates_backward with token counts
 * around its 256-token blocks, with and without the dA_log / dt_bias sums; conv1d_silu and
 * gated_delta as training calls (state NULL, runs given: irregular run lengths, more runs than
 * one launch takes) and as generation (a state with garbage in it that the position-0 runs must
 * ignore, prefill runs, continuation chunks shorter and longer than the window, single-token
 * runs in a shuffled order, runs NULL with seq and pos on the device, a sequence restarting mid
 * stream, a conv1d token of no sequence), the outputs and the states compared after every
 * batch; their backwards (T 150: chunks of 64 and a partial one; T 1, 64, 65; key-head groups
 * of 1, 2 and 3; head sizes 16, 128, 32 x 64 and odd ones, 20 x 24 and 16 x 48; 16 x 80: the
 * backward's three column groups of 32, 32 and 16 whose partial sums meet); a decode step
 * of conv1d_silu and gated_delta recorded in a CUDA graph (runs NULL) and replayed at other
 * positions. Every output of the GPU is NaN before each run (so an unwritten element cannot
 * pass), `+=` outputs start from random values, and the backward's ws starts NaN.
 * After the checks, GPU timings of Qwen3.5-sized calls (16 value and key heads of 128, 6144
 * conv channels; the Gated DeltaNet backward at 2 and 4 sequences of 2048 tokens), informative.
 *
 * Without a usable GPU: exits 77 (skipped).
 * Usage: test_cuda_linear_attn [seed] [--no-time] [--quick]   (--no-time: no timings; --quick:
 * no timings, no head size 128 and the auditable mode only (both modes run the same kernels),
 * for compute-sanitizer runs)
 */
#include "base/base.h"
#include "ops/ops.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- random numbers (splitmix64) ---------------------------------------------------------- */

static uint64_t g_rng = 0x6c696e6561724154ull;
static uint64_t rnd_u64(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static int rnd_int(int lo, int hi) {
    return lo + (int)(rnd_u64() % (uint64_t)(hi - lo + 1));
}
/* uniform in [lo, hi) */
static float rnd_range(float lo, float hi) {
    return lo + (hi - lo) * (float)((double)(rnd_u64() >> 11) * 0x1p-53);
}

/* ---- results ------------------------------------------------------------------------------- */

enum {
    R_GATES,
    R_SIGMUL,
    R_HALVES,
    R_ROPE,
    R_GATES_BWD,
    R_SIGMUL_BWD,
    R_CONV,
    R_CONV_BWD,
    R_GDN,
    R_GDN_BWD,
    R_GRAPH,
    R_COUNT
};
static const char *g_names[R_COUNT] = {
    "gdn_gates",          "sigmoid_mul",          "split/join_halves", "rope_partial(+bwd)",
    "gdn_gates_backward", "sigmoid_mul_backward", "conv1d_silu",       "conv1d_silu_backward",
    "gated_delta",        "gated_delta_backward", "graph replay"};
static long g_cases[2][R_COUNT], g_elems[2][R_COUNT], g_bad[2][R_COUNT];
static int g_failed, g_mode;   /* g_mode: the CUDA backend's fast flag */
static int g_quick, g_no_time; /* --quick, --no-time */
static kiln_backend *g_cpu, *g_gpu;

static void fail_status(const char *what) {
    fprintf(stderr, "FAIL %s: %s\n", what, kiln_last_error());
    g_failed = 1;
}

/* ---- buffers ----------------------------------------------------------------------------------
 */

static void *dev_alloc(size_t nbytes) {
    void *p = kiln_backend_alloc(g_gpu, nbytes ? nbytes : 4);
    if (!p) {
        fail_status("alloc");
        exit(1);
    }
    return p;
}
static void dev_free(void *p) {
    kiln_backend_free_buf(g_gpu, p);
}
static void up(void *d, const void *h, size_t nbytes) {
    if (nbytes && kiln_backend_upload(g_gpu, d, h, nbytes) != KILN_OK) fail_status("upload");
}
static void down(void *h, const void *d, size_t nbytes) {
    if (nbytes && kiln_backend_download(g_gpu, h, d, nbytes) != KILN_OK) fail_status("download");
}
static void *dev_copy(const void *h, size_t nbytes) {
    void *d = dev_alloc(nbytes);
    up(d, h, nbytes);
    return d;
}
static float *host_rand(size_t n, float lo, float hi) {
    float *h = kiln_malloc(n * 4 + 4);
    for (size_t i = 0; i < n; i++)
        h[i] = rnd_range(lo, hi);
    return h;
}
static float *host_nan(size_t n) {
    float *h = kiln_malloc(n * 4 + 4);
    for (size_t i = 0; i < n; i++)
        h[i] = NAN;
    return h;
}
static float *host_dup(const float *h, size_t n) {
    float *c = kiln_malloc(n * 4 + 4);
    if (n) memcpy(c, h, n * 4);
    return c;
}
/* n device floats, all NaN. */
static float *dev_nan(size_t n) {
    float *h = host_nan(n);
    float *d = dev_copy(h, n * 4);
    kiln_free(h);
    return d;
}
static void status_ok(const char *what) {
    if (kiln_backend_status(g_gpu) != KILN_OK) fail_status(what);
}

/* want (host) against n device floats at dev, bit for bit; the first difference reported. */
static void compare_dev(int row, const char *ctx, const float *want, const float *dev, size_t n) {
    float *got = host_nan(n);
    down(got, dev, n * 4);
    long bad = 0;
    size_t first = 0;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&want[i], &got[i], 4) != 0) {
            if (!bad) first = i;
            bad++;
        }
    g_cases[g_mode][row]++;
    g_elems[g_mode][row] += (long)n;
    g_bad[g_mode][row] += bad;
    if (bad) {
        uint32_t a, b;
        memcpy(&a, &want[first], 4);
        memcpy(&b, &got[first], 4);
        fprintf(
            stderr,
            "FAIL %s (%s) %s: %ld of %zu differ; first [%zu] cpu %.9g (0x%08x) gpu %.9g (0x%08x)\n",
            g_names[row], g_mode ? "fast" : "auditable", ctx, bad, n, first, want[first], a,
            got[first], b);
        g_failed = 1;
    }
    kiln_free(got);
}

/* ---- element-wise ops --------------------------------------------------------------------------
 */

static void test_gates(int N, int nv) {
    const size_t n = (size_t)N * nv;
    /* a + dt_bias from -40 to 40: softplus's threshold (20) and exp(x) < 2^-24 (x < -16.6) */
    float *a = host_rand(n, -30.0f, 30.0f), *b = host_rand(n, -12.0f, 12.0f);
    float *A = host_rand((size_t)nv, -2.0f, 2.5f), *dt = host_rand((size_t)nv, -10.0f, 10.0f);
    float *g = host_nan(n), *beta = host_nan(n);
    g_cpu->i->gdn_gates(g_cpu, g, beta, a, b, A, dt, N, nv);
    float *da = dev_copy(a, n * 4), *db = dev_copy(b, n * 4), *dA = dev_copy(A, (size_t)nv * 4);
    float *ddt = dev_copy(dt, (size_t)nv * 4), *dg = dev_nan(n), *dbeta = dev_nan(n);
    g_gpu->i->gdn_gates(g_gpu, dg, dbeta, da, db, dA, ddt, N, nv);
    status_ok("gdn_gates");
    char ctx[64];
    snprintf(ctx, sizeof ctx, "N %d nv %d", N, nv);
    compare_dev(R_GATES, ctx, g, dg, n);
    compare_dev(R_GATES, ctx, beta, dbeta, n);
    kiln_free(a), kiln_free(b), kiln_free(A), kiln_free(dt), kiln_free(g), kiln_free(beta);
    dev_free(da), dev_free(db), dev_free(dA), dev_free(ddt), dev_free(dg), dev_free(dbeta);
}

/* gdn_gates_backward: da, db overwritten; dA_log, ddt_bias += (sums: pre-filled random, or NULL).
 */
static void test_gates_backward(int N, int nv, int sums) {
    const size_t n = (size_t)N * nv;
    float *a = host_rand(n, -30.0f, 30.0f), *b = host_rand(n, -12.0f, 12.0f);
    float *A = host_rand((size_t)nv, -2.0f, 2.0f), *dt = host_rand((size_t)nv, -5.0f, 5.0f);
    float *dgr = host_rand(n, -1.0f, 1.0f), *dbr = host_rand(n, -1.0f, 1.0f);
    float *sA = host_rand((size_t)nv, -1.0f, 1.0f), *sT = host_rand((size_t)nv, -1.0f, 1.0f);
    float *da = host_nan(n), *db = host_nan(n), *cA = host_dup(sA, (size_t)nv),
          *cT = host_dup(sT, (size_t)nv);
    g_cpu->i->gdn_gates_backward(g_cpu, da, db, sums ? cA : NULL, sums ? cT : NULL, dgr, dbr, a, b,
                                 A, dt, N, nv);
    float *d_a = dev_copy(a, n * 4), *d_b = dev_copy(b, n * 4), *d_A = dev_copy(A, (size_t)nv * 4);
    float *d_dt = dev_copy(dt, (size_t)nv * 4), *d_dg = dev_copy(dgr, n * 4),
          *d_dbeta = dev_copy(dbr, n * 4);
    float *d_da = dev_nan(n), *d_db = dev_nan(n), *d_sA = dev_copy(sA, (size_t)nv * 4),
          *d_sT = dev_copy(sT, (size_t)nv * 4);
    g_gpu->i->gdn_gates_backward(g_gpu, d_da, d_db, sums ? d_sA : NULL, sums ? d_sT : NULL, d_dg,
                                 d_dbeta, d_a, d_b, d_A, d_dt, N, nv);
    status_ok("gdn_gates_backward");
    char ctx[64];
    snprintf(ctx, sizeof ctx, "N %d nv %d sums %d", N, nv, sums);
    compare_dev(R_GATES_BWD, ctx, da, d_da, n);
    compare_dev(R_GATES_BWD, ctx, db, d_db, n);
    compare_dev(R_GATES_BWD, ctx, cA, d_sA, (size_t)nv);
    compare_dev(R_GATES_BWD, ctx, cT, d_sT, (size_t)nv);
    kiln_free(a), kiln_free(b), kiln_free(A), kiln_free(dt), kiln_free(dgr), kiln_free(dbr),
        kiln_free(sA);
    kiln_free(sT), kiln_free(da), kiln_free(db), kiln_free(cA), kiln_free(cT);
    dev_free(d_a), dev_free(d_b), dev_free(d_A), dev_free(d_dt), dev_free(d_dg), dev_free(d_dbeta);
    dev_free(d_da), dev_free(d_db), dev_free(d_sA), dev_free(d_sT);
}

/* sigmoid_mul (alias: out is x) and its backward (alias 1: dx is dout, 2: dgate is dout). */
static void test_sigmoid_mul(size_t n, int alias) {
    float *x = host_rand(n, -4.0f, 4.0f), *gate = host_rand(n, -20.0f, 20.0f),
          *dout = host_rand(n, -2.0f, 2.0f);
    char ctx[64];
    snprintf(ctx, sizeof ctx, "n %zu alias %d", n, alias);
    { /* forward */
        float *out = alias ? host_dup(x, n) : host_nan(n);
        g_cpu->i->sigmoid_mul(g_cpu, out, alias ? out : x, gate, n);
        float *d_x = dev_copy(x, n * 4), *d_g = dev_copy(gate, n * 4),
              *d_out = alias ? d_x : dev_nan(n);
        g_gpu->i->sigmoid_mul(g_gpu, d_out, d_x, d_g, n);
        status_ok("sigmoid_mul");
        compare_dev(R_SIGMUL, ctx, out, d_out, n);
        kiln_free(out);
        if (!alias) dev_free(d_out);
        dev_free(d_x), dev_free(d_g);
    }
    { /* backward */
        float *dx = alias == 1 ? host_dup(dout, n) : host_nan(n);
        float *dgate = alias == 2 ? host_dup(dout, n) : host_nan(n);
        const float *cd = alias == 1 ? dx : alias == 2 ? dgate : dout;
        g_cpu->i->sigmoid_mul_backward(g_cpu, dx, dgate, cd, x, gate, n);
        float *d_x = dev_copy(x, n * 4), *d_g = dev_copy(gate, n * 4), *d_d = dev_copy(dout, n * 4);
        float *d_dx = alias == 1 ? d_d : dev_nan(n), *d_dgate = alias == 2 ? d_d : dev_nan(n);
        g_gpu->i->sigmoid_mul_backward(g_gpu, d_dx, d_dgate, d_d, d_x, d_g, n);
        status_ok("sigmoid_mul_backward");
        compare_dev(R_SIGMUL_BWD, ctx, dx, d_dx, n);
        compare_dev(R_SIGMUL_BWD, ctx, dgate, d_dgate, n);
        kiln_free(dx), kiln_free(dgate);
        if (alias != 1) dev_free(d_dx);
        if (alias != 2) dev_free(d_dgate);
        dev_free(d_x), dev_free(d_g), dev_free(d_d);
    }
    kiln_free(x), kiln_free(gate), kiln_free(dout);
}

static void test_halves(int64_t rows, int n) {
    const size_t m = (size_t)rows * n;
    float *x = host_rand(2 * m, -1.0f, 1.0f), *a = host_nan(m), *b = host_nan(m),
          *x2 = host_nan(2 * m);
    g_cpu->i->split_halves(g_cpu, a, b, x, rows, n);
    g_cpu->i->join_halves(g_cpu, x2, a, b, rows, n);
    float *d_x = dev_copy(x, 2 * m * 4), *d_a = dev_nan(m), *d_b = dev_nan(m),
          *d_x2 = dev_nan(2 * m);
    g_gpu->i->split_halves(g_gpu, d_a, d_b, d_x, rows, n);
    g_gpu->i->join_halves(g_gpu, d_x2, d_a, d_b, rows, n);
    status_ok("halves");
    char ctx[64];
    snprintf(ctx, sizeof ctx, "rows %lld n %d", (long long)rows, n);
    compare_dev(R_HALVES, ctx, a, d_a, m);
    compare_dev(R_HALVES, ctx, b, d_b, m);
    compare_dev(R_HALVES, ctx, x2, d_x2, 2 * m);
    kiln_free(x), kiln_free(a), kiln_free(b), kiln_free(x2);
    dev_free(d_x), dev_free(d_a), dev_free(d_b), dev_free(d_x2);
}

/* rope_partial then rope_partial_backward, pos in host (host_pos) or device memory. */
static void test_rope_partial(int N, int H, int HS, int rot, int host_pos) {
    const int P = 300, half = rot / 2;
    const size_t n = (size_t)N * H * HS, nt = (size_t)P * (half ? half : 1);
    float *x = host_rand(n, -2.0f, 2.0f), *ct = host_rand(nt, -1.0f, 1.0f),
          *st = host_rand(nt, -1.0f, 1.0f);
    int32_t *pos = kiln_malloc((size_t)N * 4);
    for (int i = 0; i < N; i++)
        pos[i] = rnd_int(0, P - 1);
    float *fw = host_dup(x, n);
    g_cpu->i->rope_partial(g_cpu, fw, pos, N, H, HS, rot, ct, st);
    float *bw = host_dup(fw, n);
    g_cpu->i->rope_partial_backward(g_cpu, bw, pos, N, H, HS, rot, ct, st);
    float *d_x = dev_copy(x, n * 4), *d_ct = dev_copy(ct, nt * 4), *d_st = dev_copy(st, nt * 4);
    int32_t *d_pos = host_pos ? pos : dev_copy(pos, (size_t)N * 4);
    char ctx[96];
    snprintf(ctx, sizeof ctx, "N %d H %d HS %d rot %d pos %s", N, H, HS, rot,
             host_pos ? "host" : "device");
    g_gpu->i->rope_partial(g_gpu, d_x, d_pos, N, H, HS, rot, d_ct, d_st);
    status_ok("rope_partial");
    compare_dev(R_ROPE, ctx, fw, d_x, n);
    g_gpu->i->rope_partial_backward(g_gpu, d_x, d_pos, N, H, HS, rot, d_ct, d_st);
    status_ok("rope_partial_backward");
    compare_dev(R_ROPE, ctx, bw, d_x, n);
    kiln_free(x), kiln_free(ct), kiln_free(st), kiln_free(fw), kiln_free(bw);
    dev_free(d_x), dev_free(d_ct), dev_free(d_st);
    if (!host_pos) dev_free(d_pos);
    kiln_free(pos);
}

/* ---- batches of runs ---------------------------------------------------------------------------
 */

typedef struct la_batch {
    int N, n_runs;
    kiln_batch_run *runs; /* n_runs, in a shuffled order of sequences */
    int32_t *seq, *pos;   /* per token */
} la_batch;

/* The sequences s with take[s] > 0 as one run each (a shuffled order), continuing at len[s]
 * (at 0 where reset[s]); len advanced. take[s] < 0: a run of -take[s] tokens of no sequence
 * (seq -1, position 3). */
static la_batch batch_make(int n_seq, int *len, const int *take, const int *reset) {
    la_batch B = {0, 0, NULL, NULL, NULL};
    int *order = kiln_malloc((size_t)n_seq * sizeof(int));
    for (int s = 0; s < n_seq; s++)
        order[s] = s;
    for (int s = n_seq - 1; s > 0; s--) {
        const int k = rnd_int(0, s), t = order[s];
        order[s] = order[k];
        order[k] = t;
    }
    for (int s = 0; s < n_seq; s++)
        B.N += take[s] < 0 ? -take[s] : take[s];
    B.runs = kiln_malloc((size_t)n_seq * sizeof *B.runs + 16);
    B.seq = kiln_malloc((size_t)B.N * 4 + 4);
    B.pos = kiln_malloc((size_t)B.N * 4 + 4);
    int first = 0;
    for (int k = 0; k < n_seq; k++) {
        const int s = order[k];
        if (!take[s]) continue;
        const int n = take[s] < 0 ? -take[s] : take[s];
        const int sq = take[s] < 0 ? -1 : s;
        if (take[s] > 0 && reset && reset[s]) len[s] = 0;
        const int p0 = take[s] < 0 ? 3 : len[s];
        B.runs[B.n_runs++] = (kiln_batch_run){first, n, sq, p0};
        for (int t = 0; t < n; t++) {
            B.seq[first + t] = sq;
            B.pos[first + t] = p0 + t;
        }
        if (take[s] > 0) len[s] += n;
        first += n;
    }
    kiln_free(order);
    return B;
}
static void batch_free(la_batch *B) {
    kiln_free(B->runs), kiln_free(B->seq), kiln_free(B->pos);
}

/* Runs of the given lengths back to back (training calls). */
static kiln_batch_run *runs_of(const int *lens, int n_runs, int *N) {
    kiln_batch_run *r = kiln_malloc((size_t)n_runs * sizeof *r + 16);
    int first = 0;
    for (int i = 0; i < n_runs; i++) {
        r[i] = (kiln_batch_run){first, lens[i], 0, 0};
        first += lens[i];
    }
    *N = first;
    return r;
}

/* ---- conv1d_silu -------------------------------------------------------------------------------
 */

/* One conv1d_silu call on both backends with the batch's runs (runs_null: runs NULL, seq and pos
 * per token), out and the state compared. */
static void conv_call(const char *what, const la_batch *B, int runs_null, const float *w,
                      const float *d_w, float *state, float *d_state, int n_seq, int CH, int K) {
    const size_t n = (size_t)B->N * CH, ns = (size_t)n_seq * (K - 1) * CH;
    float *x = host_rand(n, -2.0f, 2.0f), *out = host_nan(n);
    g_cpu->i->conv1d_silu(g_cpu, out, x, w, state, B->seq, B->pos, runs_null ? NULL : B->runs,
                          B->n_runs, B->N, CH, K);
    float *d_x = dev_copy(x, n * 4), *d_out = dev_nan(n);
    int32_t *d_seq = dev_copy(B->seq, (size_t)B->N * 4),
            *d_pos = dev_copy(B->pos, (size_t)B->N * 4);
    g_gpu->i->conv1d_silu(g_gpu, d_out, d_x, d_w, d_state, d_seq, d_pos, runs_null ? NULL : B->runs,
                          B->n_runs, B->N, CH, K);
    status_ok("conv1d_silu");
    char ctx[128];
    snprintf(ctx, sizeof ctx, "%s: N %d, %d runs%s, CH %d K %d", what, B->N, B->n_runs,
             runs_null ? " (NULL)" : "", CH, K);
    compare_dev(R_CONV, ctx, out, d_out, n);
    if (state) compare_dev(R_CONV, ctx, state, d_state, ns);
    kiln_free(x), kiln_free(out);
    dev_free(d_x), dev_free(d_out), dev_free(d_seq), dev_free(d_pos);
}

/* Training calls: runs of the given lengths, state NULL. */
static void test_conv_train(const int *lens, int n_runs, int CH, int K) {
    int N;
    kiln_batch_run *r = runs_of(lens, n_runs, &N);
    la_batch B = {N, n_runs, r, kiln_malloc((size_t)N * 4 + 4), kiln_malloc((size_t)N * 4 + 4)};
    for (int i = 0; i < N; i++)
        B.seq[i] = B.pos[i] = 0;
    float *w = host_rand((size_t)CH * K, -1.0f, 1.0f), *d_w = dev_copy(w, (size_t)CH * K * 4);
    conv_call("training", &B, 0, w, d_w, NULL, NULL, 1, CH, K);
    kiln_free(w);
    dev_free(d_w);
    batch_free(&B);
}

/* Generation: a state (garbage first), prefill, continuation chunks, decode tokens with runs and
 * with runs NULL, a restart, a token of no sequence. */
static void test_conv_gen(int n_seq, int CH, int K) {
    const size_t ns = (size_t)n_seq * (K - 1) * CH;
    float *w = host_rand((size_t)CH * K, -1.0f, 1.0f), *d_w = dev_copy(w, (size_t)CH * K * 4);
    float *state = host_rand(ns, -50.0f, 50.0f), *d_state = dev_copy(state, ns * 4 + 4);
    int *len = kiln_calloc((size_t)n_seq, sizeof(int)),
        *take = kiln_malloc((size_t)n_seq * sizeof(int));
    int *reset = kiln_calloc((size_t)n_seq, sizeof(int));
    for (int round = 0; round < 7; round++) {
        const char *what = "?";
        int runs_null = 0;
        for (int s = 0; s < n_seq; s++)
            reset[s] = 0;
        switch (round) {
        case 0: /* prefill from position 0 (the garbage state must not be read) */
            what = "prefill";
            for (int s = 0; s < n_seq; s++)
                take[s] = s == 0 ? 1 : rnd_int(1, 70), reset[s] = 1;
            break;
        case 1: /* chunks shorter and longer than the window, some sequences absent */
            what = "continuation";
            for (int s = 0; s < n_seq; s++)
                take[s] = rnd_int(0, 3) == 0 ? 0 : rnd_int(1, K + 3);
            break;
        case 2: /* decode tokens as runs, and a token of no sequence */
            what = "decode (runs)";
            for (int s = 0; s < n_seq; s++)
                take[s] = 1;
            take[rnd_int(0, n_seq - 1)] = -1;
            break;
        case 3:
        case 4: /* decode tokens, runs NULL */
            what = "decode (runs NULL)";
            runs_null = 1;
            for (int s = 0; s < n_seq; s++)
                take[s] = 1;
            break;
        case 5: /* a restart among decode tokens and chunks */
            what = "restart";
            for (int s = 0; s < n_seq; s++)
                take[s] = rnd_int(1, 2) == 1 ? 1 : rnd_int(2, 9);
            reset[rnd_int(0, n_seq - 1)] = 1;
            break;
        default: /* long chunks again */
            what = "long chunks";
            for (int s = 0; s < n_seq; s++)
                take[s] = rnd_int(1, 40);
            break;
        }
        la_batch B = batch_make(n_seq, len, take, reset);
        conv_call(what, &B, runs_null, w, d_w, state, d_state, n_seq, CH, K);
        batch_free(&B);
    }
    kiln_free(w), kiln_free(state), kiln_free(len), kiln_free(take), kiln_free(reset);
    dev_free(d_w), dev_free(d_state);
}

static void test_conv_backward(int n_seq, int T, int CH, int K) {
    const size_t n = (size_t)n_seq * T * CH, nw = (size_t)CH * K;
    float *x = host_rand(n, -2.0f, 2.0f), *w = host_rand(nw, -1.0f, 1.0f),
          *dout = host_rand(n, -1.0f, 1.0f);
    float *dw0 = host_rand(nw, -1.0f, 1.0f), *dx = host_nan(n), *dw = host_dup(dw0, nw);
    g_cpu->i->conv1d_silu_backward(g_cpu, dx, dw, dout, x, w, n_seq, T, CH, K);
    float *d_x = dev_copy(x, n * 4), *d_w = dev_copy(w, nw * 4), *d_dout = dev_copy(dout, n * 4);
    float *d_dx = dev_nan(n), *d_dw = dev_copy(dw0, nw * 4);
    g_gpu->i->conv1d_silu_backward(g_gpu, d_dx, d_dw, d_dout, d_x, d_w, n_seq, T, CH, K);
    status_ok("conv1d_silu_backward");
    char ctx[96];
    snprintf(ctx, sizeof ctx, "n_seq %d T %d CH %d K %d", n_seq, T, CH, K);
    compare_dev(R_CONV_BWD, ctx, dx, d_dx, n);
    compare_dev(R_CONV_BWD, ctx, dw, d_dw, nw);
    kiln_free(x), kiln_free(w), kiln_free(dout), kiln_free(dw0), kiln_free(dx), kiln_free(dw);
    dev_free(d_x), dev_free(d_w), dev_free(d_dout), dev_free(d_dx), dev_free(d_dw);
}

/* ---- gated_delta --------------------------------------------------------------------------------
 */

typedef struct gdn_shape {
    int nk, nv, dk, dv;
} gdn_shape;
static int64_t gdn_W(gdn_shape s) {
    return 2 * (int64_t)s.nk * s.dk + (int64_t)s.nv * s.dv;
}
static float gdn_scale(gdn_shape s) {
    return 1.0f / sqrtf((float)s.dk);
}

/* The recurrence's inputs for N tokens: qkv in [-1, 1], log decays g in [-2, -0.01], beta in
 * [0.02, 1). */
static void gdn_inputs(gdn_shape s, int N, float **qkv, float **g, float **beta) {
    *qkv = host_rand((size_t)N * gdn_W(s), -1.0f, 1.0f);
    *g = host_rand((size_t)N * s.nv, -2.0f, -0.01f);
    *beta = host_rand((size_t)N * s.nv, 0.02f, 1.0f);
}

static void gdn_call(const char *what, gdn_shape s, const la_batch *B, int runs_null, float *state,
                     float *d_state, int n_seq) {
    const size_t no = (size_t)B->N * s.nv * s.dv, nq = (size_t)B->N * gdn_W(s),
                 ng = (size_t)B->N * s.nv;
    const size_t ns = (size_t)n_seq * s.nv * s.dk * s.dv;
    float *qkv, *g, *beta, *out = host_nan(no);
    gdn_inputs(s, B->N, &qkv, &g, &beta);
    g_cpu->i->gated_delta(g_cpu, out, qkv, g, beta, state, B->seq, B->pos,
                          runs_null ? NULL : B->runs, B->n_runs, B->N, s.nk, s.nv, s.dk, s.dv,
                          gdn_scale(s));
    float *d_qkv = dev_copy(qkv, nq * 4), *d_g = dev_copy(g, ng * 4),
          *d_beta = dev_copy(beta, ng * 4);
    float *d_out = dev_nan(no);
    int32_t *d_seq = dev_copy(B->seq, (size_t)B->N * 4),
            *d_pos = dev_copy(B->pos, (size_t)B->N * 4);
    g_gpu->i->gated_delta(g_gpu, d_out, d_qkv, d_g, d_beta, d_state, d_seq, d_pos,
                          runs_null ? NULL : B->runs, B->n_runs, B->N, s.nk, s.nv, s.dk, s.dv,
                          gdn_scale(s));
    status_ok("gated_delta");
    char ctx[160];
    snprintf(ctx, sizeof ctx, "%s: nk %d nv %d dk %d dv %d, N %d, %d runs%s", what, s.nk, s.nv,
             s.dk, s.dv, B->N, B->n_runs, runs_null ? " (NULL)" : "");
    compare_dev(R_GDN, ctx, out, d_out, no);
    if (state) compare_dev(R_GDN, ctx, state, d_state, ns);
    kiln_free(qkv), kiln_free(g), kiln_free(beta), kiln_free(out);
    dev_free(d_qkv), dev_free(d_g), dev_free(d_beta), dev_free(d_out), dev_free(d_seq),
        dev_free(d_pos);
}

static void test_gdn_train(gdn_shape s, const int *lens, int n_runs) {
    int N;
    kiln_batch_run *r = runs_of(lens, n_runs, &N);
    la_batch B = {N, n_runs, r, kiln_malloc((size_t)N * 4 + 4), kiln_malloc((size_t)N * 4 + 4)};
    for (int i = 0; i < N; i++)
        B.seq[i] = B.pos[i] = 0;
    gdn_call("training", s, &B, 0, NULL, NULL, 1);
    batch_free(&B);
}

static void test_gdn_gen(gdn_shape s, int n_seq, int max_prefill) {
    const size_t ns = (size_t)n_seq * s.nv * s.dk * s.dv;
    float *state = host_rand(ns, -30.0f, 30.0f), *d_state = dev_copy(state, ns * 4);
    int *len = kiln_calloc((size_t)n_seq, sizeof(int)),
        *take = kiln_malloc((size_t)n_seq * sizeof(int));
    int *reset = kiln_calloc((size_t)n_seq, sizeof(int));
    for (int round = 0; round < 7; round++) {
        const char *what = "?";
        int runs_null = 0;
        for (int q = 0; q < n_seq; q++)
            reset[q] = 0;
        switch (round) {
        case 0:
            what = "prefill";
            for (int q = 0; q < n_seq; q++)
                take[q] = q == 0 ? 1 : rnd_int(1, max_prefill), reset[q] = 1;
            break;
        case 1:
            what = "continuation";
            for (int q = 0; q < n_seq; q++)
                take[q] = rnd_int(0, 3) == 0 ? 0 : rnd_int(1, 20);
            break;
        case 2:
            what = "decode (runs)";
            for (int q = 0; q < n_seq; q++)
                take[q] = 1;
            break;
        case 3:
        case 4:
            what = "decode (runs NULL)";
            runs_null = 1;
            for (int q = 0; q < n_seq; q++)
                take[q] = 1;
            break;
        case 5:
            what = "restart";
            for (int q = 0; q < n_seq; q++)
                take[q] = rnd_int(1, 2) == 1 ? 1 : rnd_int(2, 9);
            reset[rnd_int(0, n_seq - 1)] = 1;
            break;
        default:
            what = "long chunks";
            for (int q = 0; q < n_seq; q++)
                take[q] = rnd_int(1, 30);
            break;
        }
        la_batch B = batch_make(n_seq, len, take, reset);
        gdn_call(what, s, &B, runs_null, state, d_state, n_seq);
        batch_free(&B);
    }
    kiln_free(state), kiln_free(len), kiln_free(take), kiln_free(reset);
    dev_free(d_state);
}

static void test_gdn_backward(gdn_shape s, int n_seq, int T) {
    const int N = n_seq * T;
    const size_t nq = (size_t)N * gdn_W(s), ng = (size_t)N * s.nv, no = (size_t)N * s.nv * s.dv;
    const size_t nws = kiln_gated_delta_backward_ws_floats(n_seq, T, s.nk, s.nv, s.dk, s.dv);
    float *qkv, *g, *beta;
    gdn_inputs(s, N, &qkv, &g, &beta);
    float *dout = host_rand(no, -1.0f, 1.0f), *ws = host_nan(nws);
    float *dqkv = host_nan(nq), *dg = host_nan(ng), *dbeta = host_nan(ng);
    g_cpu->i->gated_delta_backward(g_cpu, dqkv, dg, dbeta, dout, qkv, g, beta, ws, n_seq, T, s.nk,
                                   s.nv, s.dk, s.dv, gdn_scale(s));
    float *d_qkv = dev_copy(qkv, nq * 4), *d_g = dev_copy(g, ng * 4),
          *d_beta = dev_copy(beta, ng * 4);
    float *d_dout = dev_copy(dout, no * 4), *d_ws = dev_nan(nws);
    float *d_dqkv = dev_nan(nq), *d_dg = dev_nan(ng), *d_dbeta = dev_nan(ng);
    g_gpu->i->gated_delta_backward(g_gpu, d_dqkv, d_dg, d_dbeta, d_dout, d_qkv, d_g, d_beta, d_ws,
                                   n_seq, T, s.nk, s.nv, s.dk, s.dv, gdn_scale(s));
    status_ok("gated_delta_backward");
    char ctx[128];
    snprintf(ctx, sizeof ctx, "nk %d nv %d dk %d dv %d, %d x %d tokens", s.nk, s.nv, s.dk, s.dv,
             n_seq, T);
    compare_dev(R_GDN_BWD, ctx, dqkv, d_dqkv, nq);
    compare_dev(R_GDN_BWD, ctx, dg, d_dg, ng);
    compare_dev(R_GDN_BWD, ctx, dbeta, d_dbeta, ng);
    kiln_free(qkv), kiln_free(g), kiln_free(beta), kiln_free(dout), kiln_free(ws), kiln_free(dqkv),
        kiln_free(dg);
    kiln_free(dbeta);
    dev_free(d_qkv), dev_free(d_g), dev_free(d_beta), dev_free(d_dout), dev_free(d_ws),
        dev_free(d_dqkv);
    dev_free(d_dg), dev_free(d_dbeta);
}

/* ---- a decode step in a CUDA graph
 * --------------------------------------------------------------- */

/* conv1d_silu then gated_delta on B decode tokens (runs NULL) recorded once, replayed with the
 * tokens at other positions of other sequences (seq, pos uploaded to the same device arrays),
 * against the CPU's calls on the same states. */
static void test_graph(gdn_shape s, int n_seq, int B, int CH, int K) {
    const size_t nsc = (size_t)n_seq * (K - 1) * CH, nsg = (size_t)n_seq * s.nv * s.dk * s.dv;
    const size_t nx = (size_t)B * CH, nq = (size_t)B * gdn_W(s), ng = (size_t)B * s.nv,
                 no = (size_t)B * s.nv * s.dv;
    float *w = host_rand((size_t)CH * K, -1.0f, 1.0f), *sc = host_rand(nsc, -2.0f, 2.0f);
    float *sg = host_rand(nsg, -1.0f, 1.0f);
    float *d_w = dev_copy(w, (size_t)CH * K * 4), *d_sc = dev_copy(sc, nsc * 4),
          *d_sg = dev_copy(sg, nsg * 4);
    float *d_x = dev_nan(nx), *d_cout = dev_nan(nx), *d_qkv = dev_nan(nq), *d_g = dev_nan(ng),
          *d_beta = dev_nan(ng);
    float *d_out = dev_nan(no);
    int32_t *seq = kiln_malloc((size_t)B * 4), *pos = kiln_malloc((size_t)B * 4);
    int32_t *d_seq = dev_alloc((size_t)B * 4), *d_pos = dev_alloc((size_t)B * 4);
    char ctx[128];
    snprintf(ctx, sizeof ctx,
             "graph: %d tokens of %d sequences, CH %d K %d, nk %d nv %d dk %d dv %d", B, n_seq, CH,
             K, s.nk, s.nv, s.dk, s.dv);
    void *graph = NULL;
    for (int round = 0; round < 4; round++) {
        /* B distinct sequences at positions 1..9 (round 2: position 0, a reset) */
        int *perm = kiln_malloc((size_t)n_seq * sizeof(int));
        for (int q = 0; q < n_seq; q++)
            perm[q] = q;
        for (int q = n_seq - 1; q > 0; q--) {
            const int k = rnd_int(0, q), t = perm[q];
            perm[q] = perm[k];
            perm[k] = t;
        }
        for (int t = 0; t < B; t++)
            seq[t] = perm[t], pos[t] = round == 2 && t == 0 ? 0 : rnd_int(1, 9);
        kiln_free(perm);
        up(d_seq, seq, (size_t)B * 4);
        up(d_pos, pos, (size_t)B * 4);
        float *x = host_rand(nx, -2.0f, 2.0f), *qkv, *g, *beta;
        gdn_inputs(s, B, &qkv, &g, &beta);
        up(d_x, x, nx * 4), up(d_qkv, qkv, nq * 4), up(d_g, g, ng * 4), up(d_beta, beta, ng * 4);
#define STEP()                                                                                     \
    do {                                                                                           \
        g_gpu->i->conv1d_silu(g_gpu, d_cout, d_x, d_w, d_sc, d_seq, d_pos, NULL, 0, B, CH, K);     \
        g_gpu->i->gated_delta(g_gpu, d_out, d_qkv, d_g, d_beta, d_sg, d_seq, d_pos, NULL, 0, B,    \
                              s.nk, s.nv, s.dk, s.dv, gdn_scale(s));                               \
    } while (0)
        if (round == 0) { /* the direct call, then the recording (which runs nothing) */
            STEP();
            status_ok("graph: direct step");
            float *c1 = host_nan(nx), *o1 = host_nan(no);
            g_cpu->i->conv1d_silu(g_cpu, c1, x, w, sc, seq, pos, NULL, 0, B, CH, K);
            g_cpu->i->gated_delta(g_cpu, o1, qkv, g, beta, sg, seq, pos, NULL, 0, B, s.nk, s.nv,
                                  s.dk, s.dv, gdn_scale(s));
            compare_dev(R_GRAPH, ctx, c1, d_cout, nx);
            compare_dev(R_GRAPH, ctx, o1, d_out, no);
            kiln_free(c1), kiln_free(o1);
            kiln_status st = g_gpu->i->graph_begin(g_gpu, 0, 1, 1, 1);
            if (st == KILN_OK) {
                STEP();
                st = g_gpu->i->graph_end(g_gpu, &graph);
            }
            if (st != KILN_OK) {
                fail_status("graph record");
                graph = NULL;
            }
        } else if (graph) {
            float *nan = host_nan(nx > no ? nx : no);
            up(d_cout, nan, nx * 4), up(d_out, nan, no * 4);
            kiln_free(nan);
            if (g_gpu->i->graph_launch(g_gpu, graph) != KILN_OK) fail_status("graph_launch");
            status_ok("graph replay");
            float *c1 = host_nan(nx), *o1 = host_nan(no);
            g_cpu->i->conv1d_silu(g_cpu, c1, x, w, sc, seq, pos, NULL, 0, B, CH, K);
            g_cpu->i->gated_delta(g_cpu, o1, qkv, g, beta, sg, seq, pos, NULL, 0, B, s.nk, s.nv,
                                  s.dk, s.dv, gdn_scale(s));
            compare_dev(R_GRAPH, ctx, c1, d_cout, nx);
            compare_dev(R_GRAPH, ctx, o1, d_out, no);
            compare_dev(R_GRAPH, ctx, sc, d_sc, nsc);
            compare_dev(R_GRAPH, ctx, sg, d_sg, nsg);
            kiln_free(c1), kiln_free(o1);
        }
#undef STEP
        kiln_free(x), kiln_free(qkv), kiln_free(g), kiln_free(beta);
    }
    if (graph) g_gpu->i->graph_free(g_gpu, graph);
    kiln_free(w), kiln_free(sc), kiln_free(sg), kiln_free(seq), kiln_free(pos);
    dev_free(d_w), dev_free(d_sc), dev_free(d_sg), dev_free(d_x), dev_free(d_cout), dev_free(d_qkv);
    dev_free(d_g), dev_free(d_beta), dev_free(d_out), dev_free(d_seq), dev_free(d_pos);
}

/* ---- timings
 * ------------------------------------------------------------------------------------- */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* GPU times of Qwen3.5-sized calls (not compared): the mean of 3 after a warm-up. The
 * backward's dout and the conv backward's are the forward's inputs (finite values). */
static void bench(void) {
    const gdn_shape s = {16, 16, 128, 128};
    const int CH = 6144, K = 4, Np = 4096, Bd = 64, n_seq = 4, T = 2048; /* backward: 2 and 4 x T */
    const int Nmax = n_seq * T > Np ? n_seq * T : Np;
    float *d_qkv = dev_nan((size_t)Nmax * gdn_W(s)), *d_g = dev_nan((size_t)Nmax * s.nv);
    float *d_beta = dev_nan((size_t)Nmax * s.nv), *d_out = dev_nan((size_t)Nmax * s.nv * s.dv);
    float *d_x = dev_nan((size_t)Nmax * CH), *d_c = dev_nan((size_t)Nmax * CH),
          *d_w = dev_nan((size_t)CH * K);
    float *d_sg = dev_nan((size_t)Bd * s.nv * s.dk * s.dv),
          *d_sc = dev_nan((size_t)Bd * (K - 1) * CH);
    { /* finite inputs */
        float *qkv, *g, *beta;
        gdn_inputs(s, Nmax, &qkv, &g, &beta);
        up(d_qkv, qkv, (size_t)Nmax * gdn_W(s) * 4), up(d_g, g, (size_t)Nmax * s.nv * 4);
        up(d_beta, beta, (size_t)Nmax * s.nv * 4);
        kiln_free(qkv), kiln_free(g), kiln_free(beta);
        float *x = host_rand((size_t)Nmax * CH, -1.0f, 1.0f),
              *w = host_rand((size_t)CH * K, -1.0f, 1.0f);
        up(d_x, x, (size_t)Nmax * CH * 4), up(d_w, w, (size_t)CH * K * 4),
            up(d_out, x, (size_t)Nmax * s.nv * s.dv * 4);
        kiln_free(x), kiln_free(w);
    }
    int32_t *seq = kiln_malloc(Bd * 4), *pos = kiln_malloc(Bd * 4);
    for (int t = 0; t < Bd; t++)
        seq[t] = t, pos[t] = 0;
    int32_t *d_seq = dev_copy(seq, Bd * 4), *d_pos = dev_copy(pos, Bd * 4);
    const size_t nws = kiln_gated_delta_backward_ws_floats(n_seq, T, s.nk, s.nv, s.dk, s.dv);
    float *d_ws = dev_alloc(nws * 4), *d_dqkv = dev_alloc((size_t)n_seq * T * gdn_W(s) * 4);
    float *d_dg = dev_alloc((size_t)n_seq * T * s.nv * 4),
          *d_db = dev_alloc((size_t)n_seq * T * s.nv * 4);
    float *d_dw = dev_alloc((size_t)CH * K * 4);
    const kiln_batch_run prefill = {0, Np, 0, 0};
    printf("\ntimings (%s mode, ms):\n", g_mode ? "fast" : "auditable");
    for (int op = 0; op < 7; op++) {
        double t0 = 0.0;
        for (int rep = 0; rep < 4; rep++) {
            if (rep == 1) {
                status_ok("bench");
                t0 = now_s();
            }
            switch (op) {
            case 0:
                g_gpu->i->gated_delta(g_gpu, d_out, d_qkv, d_g, d_beta, NULL, NULL, NULL, &prefill,
                                      1, Np, s.nk, s.nv, s.dk, s.dv, 0.088f);
                break;
            case 1:
                g_gpu->i->gated_delta(g_gpu, d_out, d_qkv, d_g, d_beta, d_sg, d_seq, d_pos, NULL, 0,
                                      Bd, s.nk, s.nv, s.dk, s.dv, 0.088f);
                break;
            case 2:
                g_gpu->i->conv1d_silu(g_gpu, d_c, d_x, d_w, NULL, NULL, NULL, &prefill, 1, Np, CH,
                                      K);
                break;
            case 3:
                g_gpu->i->conv1d_silu(g_gpu, d_c, d_x, d_w, d_sc, d_seq, d_pos, NULL, 0, Bd, CH, K);
                break;
            case 4:
                g_gpu->i->conv1d_silu_backward(g_gpu, d_c, d_dw, d_x, d_x, d_w, 2, T, CH, K);
                break;
            default:
                g_gpu->i->gated_delta_backward(g_gpu, d_dqkv, d_dg, d_db, d_out, d_qkv, d_g, d_beta,
                                               d_ws, op == 5 ? 2 : 4, T, s.nk, s.nv, s.dk, s.dv,
                                               0.088f);
                break;
            }
        }
        status_ok("bench");
        const double ms = (now_s() - t0) / 3 * 1e3;
        static const char *what[] = {"gated_delta prefill 4096 tokens, 16 heads of 128",
                                     "gated_delta decode 64 sequences (runs NULL)",
                                     "conv1d_silu prefill 4096 tokens, 6144 channels, K 4",
                                     "conv1d_silu decode 64 sequences",
                                     "conv1d_silu_backward 2 x 2048 tokens",
                                     "gated_delta_backward 2 x 2048 tokens, 16 heads of 128",
                                     "gated_delta_backward 4 x 2048 tokens, 16 heads of 128"};
        printf("  %-58s %9.3f\n", what[op], ms);
    }
    kiln_free(seq), kiln_free(pos);
    dev_free(d_qkv), dev_free(d_g), dev_free(d_beta), dev_free(d_out), dev_free(d_x), dev_free(d_c),
        dev_free(d_w);
    dev_free(d_sg), dev_free(d_sc), dev_free(d_seq), dev_free(d_pos), dev_free(d_ws),
        dev_free(d_dqkv);
    dev_free(d_dg), dev_free(d_db), dev_free(d_dw);
}

/* ---- main
 * ---------------------------------------------------------------------------------------- */

static void run_checks(void) {
    const kiln_backend_i *i = g_gpu->i;
    if (!i->conv1d_silu || !i->gated_delta || !i->gdn_gates || !i->sigmoid_mul ||
        !i->split_halves || !i->join_halves || !i->rope_partial || !i->rope_partial_backward ||
        !i->conv1d_silu_backward || !i->gated_delta_backward || !i->gdn_gates_backward ||
        !i->sigmoid_mul_backward) {
        fprintf(stderr, "FAIL: the CUDA backend lacks one of Qwen3.5's ops\n");
        g_failed = 1;
        return;
    }
    /* element-wise */
    static const int Ns[] = {1, 7, 256, 300, 1000};
    for (int k = 0; k < 5; k++) {
        test_gates(Ns[k], k % 2 ? 16 : 3);
        test_gates_backward(Ns[k], k % 2 ? 16 : 3, 1);
        test_gates_backward(Ns[k], 4, 0);
    }
    test_gates_backward(4097, 2, 1);
    static const size_t ns[] = {1, 31, 1000, 100003};
    for (int k = 0; k < 4; k++)
        for (int alias = 0; alias < 3; alias++)
            test_sigmoid_mul(ns[k], alias);
    test_halves(1, 1), test_halves(7, 33), test_halves(300, 1024);
    test_rope_partial(5, 3, 256, 64, 1), test_rope_partial(17, 8, 256, 64, 0);
    test_rope_partial(3, 2, 64, 64, 0), test_rope_partial(9, 4, 80, 2, 1),
        test_rope_partial(4, 2, 16, 10, 0);

    /* conv1d_silu */
    {
        const int a[] = {150, 150}, b[] = {1, 2, 3, 5, 17, 64, 65, 1}, c[] = {4097};
        test_conv_train(a, 2, 200, 4);
        test_conv_train(b, 8, 37, 4);
        test_conv_train(b, 8, 130, 2);
        test_conv_train(b, 8, 19, 7);
        test_conv_train(c, 1, 64, 4);
        int many[150];
        for (int k = 0; k < 150; k++)
            many[k] = rnd_int(0, 12);
        test_conv_train(many, 150, 100, 4); /* three launches of runs, empty runs among them */
        test_conv_gen(5, 200, 4);
        test_conv_gen(3, 33, 1);
        test_conv_gen(4, 70, 6);
        test_conv_gen(70, 40, 4); /* more sequences than one launch takes */
        test_conv_backward(2, 150, 200, 4);
        test_conv_backward(3, 17, 33, 4);
        test_conv_backward(1, 5, 70, 7);
        test_conv_backward(2, 64, 129, 1);
        test_conv_backward(1, 40, 50, 12);
        if (!g_quick) test_conv_backward(4, 33, 6144, 4);
    }

    /* gated_delta (dv 80: the backward's three column groups, 32, 32 and 16) */
    static const gdn_shape shapes[] = {{2, 4, 16, 16}, {2, 2, 128, 128}, {1, 3, 20, 24},
                                       {2, 6, 32, 64}, {1, 2, 16, 48},   {1, 1, 128, 32},
                                       {1, 2, 16, 80}};
    for (int k = 0; k < 7; k++) {
        const gdn_shape s = shapes[k];
        const int big = s.dk * s.dv > 4096;
        if (g_quick && (s.dk > 64 || s.dv > 64)) continue;
        const int lens[] = {150, 150, 37}, one[] = {1}, odd[] = {64, 65, 1, 9};
        test_gdn_train(s, lens, big ? 2 : 3);
        test_gdn_train(s, one, 1);
        test_gdn_train(s, odd, 4);
        test_gdn_gen(s, big ? 3 : 5, big ? 100 : 150);
        test_gdn_backward(s, 2, 150);
        test_gdn_backward(s, 1, 1);
        test_gdn_backward(s, big ? 1 : 3, 64);
        test_gdn_backward(s, 1, 65);
    }
    {
        int many[140];
        for (int k = 0; k < 140; k++)
            many[k] = rnd_int(0, 6);
        test_gdn_train(shapes[0], many, 140);
        test_gdn_gen(shapes[0], 70, 20); /* more sequences than one launch takes */
    }
    test_graph(shapes[0], 9, 6, 96, 4);
    if (!g_quick) test_graph(shapes[1], 4, 3, 6144, 4);
}

int main(int argc, char **argv) {
    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--quick"))
            g_quick = g_no_time = 1;
        else if (!strcmp(argv[a], "--no-time"))
            g_no_time = 1;
        else
            g_rng = strtoull(argv[a], NULL, 0);
    }
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
    kiln_backend_free(g_gpu);
    g_gpu = NULL;
    if (kiln_backend_cpu_create(2, &g_cpu) != KILN_OK) {
        fail_status("cpu backend");
        return 1;
    }
    printf("test_cuda_linear_attn: seed 0x%llx\n", (unsigned long long)g_rng);
    for (g_mode = 0; g_mode < (g_quick ? 1 : 2); g_mode++) {
        if (kiln_backend_cuda_create_mode(0, g_mode, &g_gpu) != KILN_OK) {
            fail_status("cuda backend");
            break;
        }
        run_checks();
        if (kiln_backend_status(g_gpu) != KILN_OK) fail_status("final status");
        if (g_mode == 0 && !g_no_time) bench(); /* one arithmetic: the same kernels in both modes */
        kiln_backend_free(g_gpu);
        g_gpu = NULL;
    }
    kiln_backend_free(g_cpu);
    printf("\n%-22s %-10s %6s %12s %10s\n", "op", "mode", "cases", "elements", "bits-diff");
    for (int m = 0; m < 2; m++)
        for (int r = 0; r < R_COUNT; r++)
            printf("%-22s %-10s %6ld %12ld %10ld\n", g_names[r], m ? "fast" : "auditable",
                   g_cases[m][r], g_elems[m][r], g_bad[m][r]);
    printf("%s\n", g_failed ? "FAILED" : "ALL OK");
    return g_failed ? 1 : 0;
}
