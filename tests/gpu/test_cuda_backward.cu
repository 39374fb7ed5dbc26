/*
 * test_cuda_backward.cu -- every auditable backward launcher (cuda_matmul.h, cuda_norm.h,
 * cuda_rope.h, cuda_attention.h, cuda_elementwise.h, cuda_rows.h) against the CPU backend's
 * backward ops, bit for bit (auditable mode: docs/ARITHMETIC.md, "Backward ops"), on random
 * shapes with odd sizes: matmul_backward with W in f32, bf16 and f16, accumulate and
 * overwrite, NULL optional outputs; rmsnorm_backward with and without w / dw, in place;
 * rope_backward; attention_backward with GQA and MHA, n_past 0 and > 0, several key and query
 * blocks; swiglu_backward with every allowed aliasing; embed_backward with repeated ids.
 * Overwritten outputs are poisoned with NaN bits before each run (so an unwritten element
 * cannot pass), `+=` outputs pre-filled with random values; the scratch the ops write (rstd,
 * ws) is compared too, and so are the dk/dv rows the op must leave untouched.
 *
 * Host-side checks (argument validation that never touches the device) run first; without a
 * usable GPU the test then exits 77 (skipped). After the cases, a few GPU timings of
 * training-sized shapes (informative, not compared).
 *
 * Usage: test_cuda_backward [seed]     prints one line per case, the timings, then "ALL OK" or
 * "FAILED n".
 */
#include "ops/cuda/cuda_attention.h"
#include "ops/cuda/cuda_elementwise.h"
#include "ops/cuda/cuda_matmul.h"
#include "ops/cuda/cuda_norm.h"
#include "ops/cuda/cuda_rope.h"
#include "ops/cuda/cuda_rows.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <vector>

#define GPU_TEST_FAILS g_failed /* CUDA_FATAL's count */
#include "gpu_test_cuda_check.h"

/* ---- random numbers (splitmix64) ---------------------------------------------------------- */

static uint64_t g_rng = 0x6b696c6e42574421ull;
static uint64_t rnd_u64(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static int rnd_int(int lo, int hi) { return lo + (int)(rnd_u64() % (uint64_t)(hi - lo + 1)); }
static float rnd_unit(void) { return (float)((double)(rnd_u64() >> 11) * 0x1p-53 * 2.0 - 1.0); }

/* Values in [-1, 1], one in 16 an exact zero (lanes whose products vanish). */
static void fill_rand(float *v, size_t n, float scale) {
    for (size_t i = 0; i < n; i++) v[i] = (rnd_u64() & 15) == 0 ? 0.0f : rnd_unit() * scale;
}

/* A quiet NaN with a payload no arithmetic produces (CUDA's canonical NaN is 0x7fffffff). */
static const uint32_t POISON_BITS = 0x7fedcba9u;
static void poison(float *v, size_t n) {
    for (size_t i = 0; i < n; i++) memcpy(&v[i], &POISON_BITS, 4);
}

/* ---- results ------------------------------------------------------------------------------- */

static int g_failed;
static long g_cases, g_elems;

/* Compare n floats bit for bit; report the first difference. Returns 1 when they differ. */
static int compare(const char *ctx, const char *what, const float *want, const float *got,
                   size_t n) {
    long bad = 0;
    size_t first = 0;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&want[i], &got[i], 4) != 0) {
            if (!bad) first = i;
            bad++;
        }
    g_elems += (long)n;
    if (!bad) return 0;
    uint32_t a, b;
    memcpy(&a, &want[first], 4);
    memcpy(&b, &got[first], 4);
    fprintf(stderr, "FAIL %s: %s: %ld of %zu differ; first [%zu] cpu %.9g (0x%08x) gpu %.9g (0x%08x)\n",
            ctx, what, bad, n, first, want[first], a, got[first], b);
    return 1;
}

static void report(const char *ctx, int bad) {
    g_cases++;
    if (bad) g_failed++;
    printf("%-72s %s\n", ctx, bad ? "FAILED" : "OK");
}

/* ---- device buffers (freed at the end of each case) ---------------------------------------- */

static std::vector<void *> g_dev;

static void *dev_alloc(size_t nbytes) {
    void *p = NULL;
    CUDA_FATAL(cudaMalloc(&p, nbytes ? nbytes : 4));
    g_dev.push_back(p);
    return p;
}
static float *dev_copy(const float *h, size_t n) {
    float *d = (float *)dev_alloc(n * sizeof(float));
    CUDA_FATAL(cudaMemcpy(d, h, n * sizeof(float), cudaMemcpyHostToDevice));
    return d;
}
static void *dev_copy_bytes(const void *h, size_t nbytes) {
    void *d = dev_alloc(nbytes);
    CUDA_FATAL(cudaMemcpy(d, h, nbytes, cudaMemcpyHostToDevice));
    return d;
}
static std::vector<float> to_host(const float *d, size_t n) {
    std::vector<float> h(n);
    CUDA_FATAL(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
}
static void dev_free_all(void) {
    for (void *p : g_dev) CUDA_FATAL(cudaFree(p));
    g_dev.clear();
}

static kiln_backend *g_cpu;
static cudaStream_t g_s;

static void run_and_sync(cudaError_t launch, const char *ctx) {
    if (launch != cudaSuccess) {
        fprintf(stderr, "FAIL %s: launcher returned %s\n", ctx, cudaGetErrorString(launch));
        printf("FAILED (launch error)\n");
        exit(1);
    }
    CUDA_FATAL(cudaStreamSynchronize(g_s));
}

/* ---- matmul backward ----------------------------------------------------------------------- */

static const char *dt_name(kiln_dtype dt) {
    return dt == KILN_DTYPE_F32 ? "f32" : dt == KILN_DTYPE_BF16 ? "bf16" : "f16";
}

static void case_matmul(kiln_dtype dt, int N, int64_t R, int64_t C, bool acc, bool want_dx,
                        bool want_dW, bool want_db) {
    char ctx[160];
    snprintf(ctx, sizeof ctx, "matmul_backward %s N=%d R=%lld C=%lld acc=%d%s%s%s", dt_name(dt),
             N, (long long)R, (long long)C, (int)acc, want_dx ? " dx" : "", want_dW ? " dW" : "",
             want_db ? " dbias" : "");
    const size_t nx = (size_t)N * C, ny = (size_t)N * R, nw = (size_t)R * C;
    std::vector<float> x(nx), dy(ny), wf(nw), dx(nx), dW(nw), db(R);
    fill_rand(x.data(), nx, 1.0f);
    fill_rand(dy.data(), ny, 1.0f);
    fill_rand(wf.data(), nw, 1.0f);
    const size_t esize = dt == KILN_DTYPE_F32 ? 4 : 2;
    std::vector<uint8_t> wb(nw * esize);
    for (size_t i = 0; i < nw; i++) {
        if (dt == KILN_DTYPE_F32) {
            memcpy(&wb[4 * i], &wf[i], 4);
        } else {
            uint16_t h = dt == KILN_DTYPE_BF16 ? kiln_fp32_to_bf16(wf[i]) : kiln_fp32_to_fp16(wf[i]);
            memcpy(&wb[2 * i], &h, 2);
        }
    }
    if (acc) fill_rand(dx.data(), nx, 2.0f);
    else poison(dx.data(), nx);
    fill_rand(dW.data(), nw, 2.0f);
    fill_rand(db.data(), (size_t)R, 2.0f);

    float *d_x = dev_copy(x.data(), nx), *d_dy = dev_copy(dy.data(), ny);
    float *d_dx = dev_copy(dx.data(), nx), *d_dW = dev_copy(dW.data(), nw);
    float *d_db = dev_copy(db.data(), (size_t)R);
    const uint8_t *d_w = (const uint8_t *)dev_copy_bytes(wb.data(), wb.size());

    kiln_tensor W;
    memset(&W, 0, sizeof W);
    W.name = "W";
    W.dtype = dt;
    W.n_dims = 2;
    for (int d = 0; d < KILN_MAX_DIMS; d++) W.shape[d] = 1;
    W.shape[0] = R;
    W.shape[1] = C;
    W.data = wb.data();
    W.nbytes = wb.size();
    g_cpu->i->matmul_backward(g_cpu, want_dx ? dx.data() : NULL, want_dW ? dW.data() : NULL,
                              want_db ? db.data() : NULL, dy.data(), x.data(), &W, N, acc);
    run_and_sync(kiln_cuda_matmul_backward(g_s, want_dx ? d_dx : NULL, want_dW ? d_dW : NULL,
                                           want_db ? d_db : NULL, d_dy, d_x, d_w, C * esize, dt,
                                           R, C, N, acc),
                 ctx);
    int bad = 0;
    /* outputs not asked for must be untouched: compared against the unchanged host copy */
    bad |= compare(ctx, "dx", dx.data(), to_host(d_dx, nx).data(), nx);
    bad |= compare(ctx, "dW", dW.data(), to_host(d_dW, nw).data(), nw);
    bad |= compare(ctx, "dbias", db.data(), to_host(d_db, (size_t)R).data(), (size_t)R);
    report(ctx, bad);
    dev_free_all();
}

/* ---- rmsnorm backward ---------------------------------------------------------------------- */

static void case_rmsnorm(int N, int C, bool with_w, bool with_dw, bool acc, bool in_place) {
    char ctx[160];
    snprintf(ctx, sizeof ctx, "rmsnorm_backward N=%d C=%d w=%d dw=%d acc=%d%s", N, C, (int)with_w,
             (int)with_dw, (int)acc, in_place ? " in-place(dx=dy)" : "");
    const size_t n = (size_t)N * C;
    std::vector<float> x(n), dy(n), w(C), dx(n), dw(C), rstd(N);
    fill_rand(x.data(), n, 1.0f);
    for (int r = 0; r < N; r++) { /* rows of different magnitudes */
        float f = 0.25f + 4.0f * fabsf(rnd_unit());
        for (int c = 0; c < C; c++) x[(size_t)r * C + c] *= f;
    }
    fill_rand(dy.data(), n, 1.0f);
    for (int c = 0; c < C; c++) w[c] = 1.0f + 0.5f * rnd_unit();
    if (acc) fill_rand(dx.data(), n, 2.0f);
    else poison(dx.data(), n);
    fill_rand(dw.data(), (size_t)C, 2.0f);
    poison(rstd.data(), (size_t)N);
    if (in_place) dx = dy; /* dx is dy: the op reads dy and writes dx in the same buffer */
    const float eps = 1e-5f;

    float *d_x = dev_copy(x.data(), n), *d_dy = dev_copy(dy.data(), n);
    float *d_w = dev_copy(w.data(), (size_t)C), *d_dw = dev_copy(dw.data(), (size_t)C);
    float *d_dx = in_place ? d_dy : dev_copy(dx.data(), n);
    float *d_rstd = dev_copy(rstd.data(), (size_t)N);
    float *h_dx = in_place ? dy.data() : dx.data();
    g_cpu->i->rmsnorm_backward(g_cpu, h_dx, with_dw ? dw.data() : NULL, dy.data(), x.data(),
                               with_w ? w.data() : NULL, N, C, eps, rstd.data(), acc);
    run_and_sync(kiln_cuda_rmsnorm_backward(g_s, d_dx, with_dw ? d_dw : NULL, d_dy, d_x,
                                            with_w ? d_w : NULL, N, C, eps, d_rstd, acc),
                 ctx);
    int bad = 0;
    bad |= compare(ctx, "dx", h_dx, to_host(d_dx, n).data(), n);
    if (!in_place) bad |= compare(ctx, "dy", dy.data(), to_host(d_dy, n).data(), n);
    bad |= compare(ctx, "dw", dw.data(), to_host(d_dw, (size_t)C).data(), (size_t)C);
    bad |= compare(ctx, "rstd", rstd.data(), to_host(d_rstd, (size_t)N).data(), (size_t)N);
    report(ctx, bad);
    dev_free_all();
}

/* ---- rope backward ------------------------------------------------------------------------- */

static void case_rope(int N, int H, int HS) {
    char ctx[160];
    snprintf(ctx, sizeof ctx, "rope_backward N=%d H=%d HS=%d", N, H, HS);
    const int P = 300, half = HS / 2;
    const size_t n = (size_t)N * H * HS, nt = (size_t)P * half;
    std::vector<float> d(n), ct(nt), st(nt);
    std::vector<int32_t> pos(N);
    fill_rand(d.data(), n, 1.0f);
    for (size_t i = 0; i < nt; i++) {
        double a = (double)rnd_unit() * 3.14159;
        ct[i] = (float)cos(a);
        st[i] = (float)sin(a);
    }
    for (int i = 0; i < N; i++) pos[i] = rnd_int(0, P - 1);
    float *d_d = dev_copy(d.data(), n), *d_ct = dev_copy(ct.data(), nt);
    float *d_st = dev_copy(st.data(), nt);
    const int32_t *d_pos = (const int32_t *)dev_copy_bytes(pos.data(), pos.size() * 4);
    float *d_d2 = dev_copy(d.data(), n), *d_d3 = dev_copy(d.data(), n);
    const size_t ldb = (size_t)H * HS + 8; /* d16b: a column block of a wider matrix */
    uint16_t *d16 = (uint16_t *)dev_alloc(n * 2), *d16b = (uint16_t *)dev_alloc((size_t)N * ldb * 2);
    const std::vector<float> d0 = d;
    g_cpu->i->rope_backward(g_cpu, d.data(), pos.data(), N, H, HS, ct.data(), st.data());
    run_and_sync(kiln_cuda_rope_backward(g_s, d_d, d_pos, N, H, HS, d_ct, d_st), ctx);
    int bad = compare(ctx, "d", d.data(), to_host(d_d, n).data(), n);
    /* the bf16 form: the CPU's results rounded; f32 kept or left alone */
    run_and_sync(kiln_cuda_rope_backward_bf16(g_s, d_d2, d16, (int64_t)H * HS, 1, d_pos, N, H, HS,
                                              d_ct, d_st), ctx);
    run_and_sync(kiln_cuda_rope_backward_bf16(g_s, d_d3, d16b, (int64_t)ldb, 0, d_pos, N, H, HS,
                                              d_ct, d_st), ctx);
    bad += compare(ctx, "d (bf16 form, kept)", d.data(), to_host(d_d2, n).data(), n);
    bad += compare(ctx, "d (bf16 form, not kept)", d0.data(), to_host(d_d3, n).data(), n);
    std::vector<uint16_t> h16(n), h16b(n);
    CUDA_FATAL(cudaMemcpy(h16.data(), d16, n * 2, cudaMemcpyDeviceToHost));
    CUDA_FATAL(cudaMemcpy2D(h16b.data(), (size_t)H * HS * 2, d16b, ldb * 2, (size_t)H * HS * 2, N,
                            cudaMemcpyDeviceToHost));
    size_t b16 = 0;
    for (size_t i = 0; i < n; i++) {
        const uint16_t want = kiln_fp32_to_bf16(d[i]);
        b16 += (h16[i] != want) + (h16b[i] != want);
    }
    if (b16) fprintf(stderr, "%s: %zu bf16 values differ from the rounded CPU results\n", ctx, b16);
    report(ctx, bad + (b16 != 0));
    dev_free_all();
}

/* ---- attention backward -------------------------------------------------------------------- */

static void case_attention(int N, int n_past, int NH, int KVH, int HS, int window) {
    char ctx[160];
    snprintf(ctx, sizeof ctx, "attention_backward N=%d n_past=%d NH=%d KVH=%d HS=%d window=%d", N,
             n_past, NH, KVH, HS, window);
    const int T = n_past + N + 2; /* two rows past n_past+N: must stay untouched */
    const size_t nq = (size_t)N * NH * HS, nkv = (size_t)T * KVH * HS, nws = (size_t)3 * N * NH;
    std::vector<float> q(nq), k(nkv), v(nkv), out(nq), dout(nq), dq(nq), dk(nkv), dv(nkv),
        ws(nws);
    fill_rand(q.data(), nq, 1.5f);
    fill_rand(k.data(), nkv, 1.5f);
    fill_rand(v.data(), nkv, 1.0f);
    fill_rand(dout.data(), nq, 1.0f);
    const float scale = 1.0f / sqrtf((float)HS);
    g_cpu->i->attention(g_cpu, out.data(), q.data(), k.data(), v.data(), N, n_past, NH, KVH, HS,
                        scale, window);
    poison(dq.data(), nq);
    poison(dk.data(), nkv);
    poison(dv.data(), nkv);
    poison(ws.data(), nws);
    float *d_q = dev_copy(q.data(), nq), *d_k = dev_copy(k.data(), nkv);
    float *d_v = dev_copy(v.data(), nkv), *d_out = dev_copy(out.data(), nq);
    float *d_dout = dev_copy(dout.data(), nq), *d_dq = dev_copy(dq.data(), nq);
    float *d_dk = dev_copy(dk.data(), nkv), *d_dv = dev_copy(dv.data(), nkv);
    float *d_ws = dev_copy(ws.data(), nws);
    g_cpu->i->attention_backward(g_cpu, dq.data(), dk.data(), dv.data(), dout.data(), q.data(),
                                 k.data(), v.data(), out.data(), ws.data(), N, n_past, NH, KVH,
                                 HS, scale, window);
    run_and_sync(kiln_cuda_attention_backward(g_s, d_dq, d_dk, d_dv, d_dout, d_q, d_k, d_v, d_out,
                                              d_ws, N, n_past, NH, KVH, HS, scale, window),
                 ctx);
    std::vector<float> gdk = to_host(d_dk, nkv), gdv = to_host(d_dv, nkv);
    int bad = 0;
    bad |= compare(ctx, "dq", dq.data(), to_host(d_dq, nq).data(), nq);
    bad |= compare(ctx, "dk", dk.data(), gdk.data(), nkv);
    bad |= compare(ctx, "dv", dv.data(), gdv.data(), nkv);
    bad |= compare(ctx, "ws", ws.data(), to_host(d_ws, nws).data(), nws);
    /* rows n_past+N.. must keep their poison on the device (not only equal the CPU's) */
    for (size_t i = (size_t)(n_past + N) * KVH * HS; i < nkv; i++) {
        uint32_t a, b;
        memcpy(&a, &gdk[i], 4);
        memcpy(&b, &gdv[i], 4);
        if (a != POISON_BITS || b != POISON_BITS) {
            fprintf(stderr, "FAIL %s: dk/dv element %zu past row n_past+N was written\n", ctx, i);
            bad = 1;
            break;
        }
    }
    report(ctx, bad);
    dev_free_all();
}

/* ---- swiglu backward ----------------------------------------------------------------------- */

/* alias: 0 separate outputs; 1 dgate = gate, dup = up; 2 dgate = dout, dup = gate;
 * 3 dgate = up, dup = dout. */
static void case_swiglu(size_t n, int alias) {
    static const char *names[4] = {"separate", "dgate=gate dup=up", "dgate=dout dup=gate",
                                   "dgate=up dup=dout"};
    char ctx[160];
    snprintf(ctx, sizeof ctx, "swiglu_backward n=%zu %s", n, names[alias]);
    /* buffers: 0 gate, 1 up, 2 dout, 3 dgate, 4 dup */
    std::vector<float> hb[5];
    for (int b = 0; b < 5; b++) hb[b].resize(n);
    for (size_t i = 0; i < n; i++) {
        uint64_t r = rnd_u64();
        /* mostly [-12, 12]; one in 32 at +-100 (kiln_expf's clamps), one in 64 exactly 0 */
        hb[0][i] = (r & 63) == 0 ? 0.0f : (r & 31) == 1 ? ((r & 64) ? 100.0f : -100.0f)
                                                      : 12.0f * rnd_unit();
    }
    fill_rand(hb[1].data(), n, 2.0f);
    fill_rand(hb[2].data(), n, 1.0f);
    poison(hb[3].data(), n);
    poison(hb[4].data(), n);
    float *db[5];
    for (int b = 0; b < 5; b++) db[b] = dev_copy(hb[b].data(), n);
    static const int out_gate[4] = {3, 0, 2, 1}, out_up[4] = {4, 1, 0, 2};
    const int og = out_gate[alias], ou = out_up[alias];
    g_cpu->i->swiglu_backward(g_cpu, hb[og].data(), hb[ou].data(), hb[2].data(), hb[0].data(),
                              hb[1].data(), n);
    run_and_sync(kiln_cuda_swiglu_backward(g_s, db[og], db[ou], db[2], db[0], db[1], n), ctx);
    static const char *bn[5] = {"gate", "up", "dout", "dgate", "dup"};
    int bad = 0;
    for (int b = 0; b < 5; b++) bad |= compare(ctx, bn[b], hb[b].data(), to_host(db[b], n).data(), n);
    report(ctx, bad);
    dev_free_all();
}

/* ---- embed backward ------------------------------------------------------------------------ */

static void case_embed(int N, int V, int C, bool all_same = false) {
    char ctx[160];
    snprintf(ctx, sizeof ctx, "embed_backward N=%d V=%d C=%d", N, V, C);
    const size_t nt = (size_t)V * C, ny = (size_t)N * C;
    std::vector<float> table(nt), dy(ny);
    std::vector<int32_t> ids(N);
    fill_rand(table.data(), nt, 2.0f);
    fill_rand(dy.data(), ny, 1.0f);
    /* repeated ids: half the tokens from a few hot rows */
    int hot = V < 4 ? V : 4;
    for (int i = 0; i < N; i++) ids[i] = (rnd_u64() & 1) ? rnd_int(0, hot - 1) : rnd_int(0, V - 1);
    if (all_same)
        for (int i = 0; i < N; i++) ids[i] = V - 1;
    float *d_table = dev_copy(table.data(), nt), *d_dy = dev_copy(dy.data(), ny);
    float *d_table2 = dev_copy(table.data(), nt);
    const int32_t *d_ids = (const int32_t *)dev_copy_bytes(ids.data(), ids.size() * 4);
    /* the plan path (host grouping), with the same bits */
    std::vector<int32_t> plan(3 * (size_t)N + 1), counts(V, 12345);
    const int G = kiln_embed_plan(ids.data(), N, V, plan.data(), counts.data());
    const int32_t *d_plan = (const int32_t *)dev_copy_bytes(plan.data(), plan.size() * 4);
    g_cpu->i->embed_backward(g_cpu, table.data(), dy.data(), ids.data(), N, V, C);
    run_and_sync(kiln_cuda_embed_backward(g_s, d_table, d_dy, d_ids, N, V, C), ctx);
    int bad = compare(ctx, "dtable", table.data(), to_host(d_table, nt).data(), nt);
    run_and_sync(kiln_cuda_embed_backward_plan(g_s, d_table2, d_dy, d_plan, G, C), ctx);
    bad += compare(ctx, "dtable (plan)", table.data(), to_host(d_table2, nt).data(), nt);
    report(ctx, bad);
    dev_free_all();
}

/* kiln_embed_plan itself: groups in first-occurrence order, positions increasing, ids outside
 * [0, V) left out. */
static void case_embed_plan(void) {
    const int32_t ids[] = {3, -1, 5, 3, 7, 5, 3, 9, 0};
    const int N = 9, V = 8;
    std::vector<int32_t> plan(3 * N + 1, -7), counts(V, 99);
    const int G = kiln_embed_plan(ids, N, V, plan.data(), counts.data());
    const int32_t want[] = {3, 5, 7, 0, /* starts */ 0, 3, 5, 6, 7,
                            /* positions */ 0, 3, 6, 2, 5, 4, 8};
    int bad = G != 4;
    for (size_t i = 0; !bad && i < sizeof want / sizeof want[0]; i++) bad |= plan[i] != want[i];
    if (bad) fprintf(stderr, "embed plan: G %d, got %d %d %d %d ...\n", G, plan[0], plan[1],
                     plan[2], plan[3]);
    report("kiln_embed_plan groups and order", bad);
}

/* ---- timings (GPU only, informative: not compared) ------------------------------------------ */

/* Median of 5 runs of f (each after one warm-up), in ms. */
template <typename F> static float time_ms(F f) {
    cudaEvent_t a, b;
    CUDA_FATAL(cudaEventCreate(&a));
    CUDA_FATAL(cudaEventCreate(&b));
    float t[5];
    run_and_sync(f(), "timing warm-up");
    for (int r = 0; r < 5; r++) {
        CUDA_FATAL(cudaEventRecord(a, g_s));
        cudaError_t e = f();
        CUDA_FATAL(cudaEventRecord(b, g_s));
        run_and_sync(e, "timing");
        CUDA_FATAL(cudaEventElapsedTime(&t[r], a, b));
    }
    CUDA_FATAL(cudaEventDestroy(a));
    CUDA_FATAL(cudaEventDestroy(b));
    for (int i = 1; i < 5; i++)
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            float x = t[j];
            t[j] = t[j - 1];
            t[j - 1] = x;
        }
    return t[2];
}

static float *dev_rand(size_t n, float scale) {
    std::vector<float> h(n);
    fill_rand(h.data(), n, scale);
    return dev_copy(h.data(), n);
}

static void timings(void) {
    const int N = 512;
    const int64_t R = 4864, C = 896;
    float *x = dev_rand((size_t)N * C, 1.0f), *dy = dev_rand((size_t)N * R, 1.0f);
    float *dx = dev_rand((size_t)N * C, 1.0f), *dW = dev_rand((size_t)R * C, 1.0f);
    float *db = dev_rand((size_t)R, 1.0f);
    std::vector<uint16_t> wb((size_t)R * C);
    for (size_t i = 0; i < wb.size(); i++) wb[i] = kiln_fp32_to_bf16(rnd_unit());
    const uint8_t *w = (const uint8_t *)dev_copy_bytes(wb.data(), wb.size() * 2);
    const double gf = 2.0 * N * R * C * 1e-6; /* one GEMM, in GFLOP per ms */
    float t_dx = time_ms([&] {
        return kiln_cuda_matmul_backward(g_s, dx, NULL, NULL, dy, x, w, C * 2, KILN_DTYPE_BF16, R,
                                         C, N, false);
    });
    float t_dw = time_ms([&] {
        return kiln_cuda_matmul_backward(g_s, NULL, dW, db, dy, x, w, C * 2, KILN_DTYPE_BF16, R,
                                         C, N, false);
    });
    printf("time matmul_backward bf16 N=%d R=%lld C=%lld: dx %.3f ms (%.0f GFLOP/s), dW+dbias "
           "%.3f ms (%.0f GFLOP/s)\n",
           N, (long long)R, (long long)C, t_dx, gf / t_dx, t_dw, gf / t_dw);
    const int NH = 14, KVH = 2, HS = 64;
    const size_t nq = (size_t)N * NH * HS, nkv = (size_t)N * KVH * HS;
    float *q = dev_rand(nq, 1.0f), *k = dev_rand(nkv, 1.0f), *v = dev_rand(nkv, 1.0f);
    float *out = dev_rand(nq, 1.0f), *dout = dev_rand(nq, 1.0f);
    float *dq = dev_rand(nq, 1.0f), *dk = dev_rand(nkv, 1.0f), *dv = dev_rand(nkv, 1.0f);
    float *ws = dev_rand((size_t)3 * N * NH, 1.0f);
    float t_at = time_ms([&] {
        return kiln_cuda_attention_backward(g_s, dq, dk, dv, dout, q, k, v, out, ws, N, 0, NH,
                                            KVH, HS, 0.125f, 0);
    });
    printf("time attention_backward N=%d NH=%d KVH=%d HS=%d: %.3f ms\n", N, NH, KVH, HS, t_at);
    float t_af = time_ms([&] {
        return kiln_cuda_attention(g_s, out, q, k, v, N, 0, NH, KVH, HS, 0.125f, 0);
    });
    printf("time attention N=%d NH=%d KVH=%d HS=%d: %.3f ms\n", N, NH, KVH, HS, t_af);
    {   /* a training sequence of the 0.5B shape */
        const int N2 = 1024;
        const size_t nq2 = (size_t)N2 * NH * HS, nkv2 = (size_t)N2 * KVH * HS;
        float *q2 = dev_rand(nq2, 1.0f), *k2 = dev_rand(nkv2, 1.0f), *v2 = dev_rand(nkv2, 1.0f);
        float *o2 = dev_rand(nq2, 1.0f), *do2 = dev_rand(nq2, 1.0f), *dq2 = dev_rand(nq2, 1.0f);
        float *dk2 = dev_rand(nkv2, 1.0f), *dv2 = dev_rand(nkv2, 1.0f), *ws2 = dev_rand((size_t)3 * N2 * NH, 1.0f);
        float f2 = time_ms([&] { return kiln_cuda_attention(g_s, o2, q2, k2, v2, N2, 0, NH, KVH, HS, 0.125f, 0); });
        float b2 = time_ms([&] {
            return kiln_cuda_attention_backward(g_s, dq2, dk2, dv2, do2, q2, k2, v2, o2, ws2, N2, 0, NH, KVH, HS,
                                                0.125f, 0);
        });
        printf("time attention N=%d NH=%d KVH=%d HS=%d: forward %.3f ms, backward %.3f ms\n", N2, NH, KVH, HS, f2, b2);
    }
    float *dt = dev_rand((size_t)151936 / 4 * C, 1.0f);
    std::vector<int32_t> ids(N);
    for (int i = 0; i < N; i++) ids[i] = rnd_int(0, 151936 / 4 - 1);
    const int32_t *d_ids = (const int32_t *)dev_copy_bytes(ids.data(), ids.size() * 4);
    float t_em = time_ms([&] {
        return kiln_cuda_embed_backward(g_s, dt, dx, d_ids, N, 151936 / 4, (int)C);
    });
    std::vector<int32_t> plan(3 * (size_t)N + 1), counts(151936 / 4);
    const int G = kiln_embed_plan(ids.data(), N, 151936 / 4, plan.data(), counts.data());
    const int32_t *d_plan = (const int32_t *)dev_copy_bytes(plan.data(), plan.size() * 4);
    float t_emp = time_ms([&] {
        return kiln_cuda_embed_backward_plan(g_s, dt, dx, d_plan, G, (int)C);
    });
    printf("time embed_backward from a plan (%d groups): %.3f ms\n", G, t_emp);
    float *rstd = dev_rand((size_t)N, 1.0f), *nw = dev_rand((size_t)C, 1.0f);
    float *dnw = dev_rand((size_t)C, 1.0f);
    float t_rms = time_ms([&] {
        return kiln_cuda_rmsnorm_backward(g_s, dx, dnw, dx, x, nw, N, (int)C, 1e-5f, rstd, true);
    });
    printf("time embed_backward N=%d C=%lld: %.3f ms; rmsnorm_backward N=%d C=%lld: %.3f ms\n", N,
           (long long)C, t_em, N, (long long)C, t_rms);
    dev_free_all();
}

/* ---- host-side checks (no device needed) ---------------------------------------------------- */

static int host_checks(void) {
    int bad = 0;
#define HCHECK(cond)                                                                           \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "FAIL host check %s:%d: %s\n", __FILE__, __LINE__, #cond);         \
            bad++;                                                                             \
        }                                                                                      \
    } while (0)
    HCHECK(kiln_cuda_backward_dtype_supported(KILN_DTYPE_F32));
    HCHECK(kiln_cuda_backward_dtype_supported(KILN_DTYPE_BF16));
    HCHECK(kiln_cuda_backward_dtype_supported(KILN_DTYPE_F16));
    HCHECK(!kiln_cuda_backward_dtype_supported(KILN_DTYPE_Q8_0));
    HCHECK(!kiln_cuda_backward_dtype_supported(KILN_DTYPE_Q4_K));
    /* refused before anything is enqueued (no pointer is touched) */
    float *bogus = (float *)(uintptr_t)0x1000;
    HCHECK(kiln_cuda_matmul_backward(0, bogus, bogus, bogus, bogus, bogus, (const uint8_t *)bogus,
                                     32, KILN_DTYPE_Q8_0, 4, 32, 2, false) == cudaErrorInvalidValue);
    HCHECK(kiln_cuda_attention_backward(0, bogus, bogus, bogus, bogus, bogus, bogus, bogus, bogus,
                                        bogus, 2, 0, 4, 3, 8, 1.0f, 0) == cudaErrorInvalidValue);
    HCHECK(kiln_cuda_attention_backward(0, bogus, bogus, bogus, bogus, bogus, bogus, bogus, bogus,
                                        bogus, 2, 0, 4, 2, KILN_CUDA_MAX_HS + 2,
                                        1.0f, 0) == cudaErrorInvalidValue);
    HCHECK(kiln_cuda_attention_backward(0, bogus, bogus, bogus, bogus, bogus, bogus, bogus, bogus,
                                        bogus, 2, -1, 4, 2, 8, 1.0f, 0) == cudaErrorInvalidValue);
    HCHECK(kiln_cuda_embed_backward(0, bogus, bogus, (const int32_t *)bogus, 2, 4,
                                    65535 * 256 + 1) == cudaErrorInvalidConfiguration);
    /* nothing to do: success without a launch */
    HCHECK(kiln_cuda_matmul_backward(0, bogus, bogus, bogus, bogus, bogus, (const uint8_t *)bogus,
                                     32, KILN_DTYPE_F32, 4, 8, 0, false) == cudaSuccess);
    HCHECK(kiln_cuda_rmsnorm_backward(0, bogus, bogus, bogus, bogus, bogus, 0, 8, 1e-5f, bogus,
                                      false) == cudaSuccess);
    HCHECK(kiln_cuda_rope_backward(0, bogus, (const int32_t *)bogus, 0, 2, 8, bogus, bogus) ==
           cudaSuccess);
    HCHECK(kiln_cuda_attention_backward(0, bogus, bogus, bogus, bogus, bogus, bogus, bogus, bogus,
                                        bogus, 0, 3, 4, 2, 8, 1.0f, 0) == cudaSuccess);
    HCHECK(kiln_cuda_swiglu_backward(0, bogus, bogus, bogus, bogus, bogus, 0) == cudaSuccess);
    HCHECK(kiln_cuda_embed_backward(0, bogus, bogus, (const int32_t *)bogus, 0, 4, 8) ==
           cudaSuccess);
#undef HCHECK
    return bad;
}

int main(int argc, char **argv) {
    if (argc > 1) g_rng = strtoull(argv[1], NULL, 0);
    printf("test_cuda_backward: seed %llu\n", (unsigned long long)g_rng);
    int hbad = host_checks();
    printf("host-side checks: %s\n", hbad ? "FAILED" : "OK");
    int n_dev = 0;
    cudaError_t e = cudaGetDeviceCount(&n_dev);
    if (e != cudaSuccess || n_dev == 0) {
        printf("no usable CUDA device (%s): skipped\n",
               e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return hbad ? 1 : 77;
    }
    g_failed = hbad;
    if (kiln_backend_cpu_create(0, &g_cpu) != KILN_OK) {
        fprintf(stderr, "cpu backend: %s\n", kiln_last_error());
        return 1;
    }
    CUDA_FATAL(cudaSetDevice(0));
    CUDA_FATAL(cudaStreamCreateWithFlags(&g_s, cudaStreamNonBlocking));
    clock_t t0 = clock();

    /* matmul_backward: every dtype x N x R x C; the variant (accumulate, NULL outputs) cycles
     * with the case number so that every combination of the three outputs appears */
    static const kiln_dtype dts[3] = {KILN_DTYPE_F32, KILN_DTYPE_BF16, KILN_DTYPE_F16};
    static const int Ns[4] = {1, 3, 17, 64};
    static const int64_t Rs[2] = {3, 97}, Cs[4] = {5, 64, 100, 896};
    int k = 0;
    for (int d = 0; d < 3; d++)
        for (int a = 0; a < 4; a++)
            for (int r = 0; r < 2; r++)
                for (int c = 0; c < 4; c++, k++)
                    case_matmul(dts[d], Ns[a], Rs[r], Cs[c], (k & 1) != 0, k % 5 != 3,
                                k % 4 != 2, k % 3 != 1);
    case_matmul(KILN_DTYPE_BF16, 64, 4864, 896, true, true, true, true);
    case_matmul(KILN_DTYPE_F32, 70, 33, 47, false, true, true, true); /* K tails of every tile */

    k = 0;
    for (int a = 0; a < 4; a++)
        for (int c = 0; c < 4; c++, k++)
            case_rmsnorm(Ns[a], (int)Cs[c], k % 3 != 2, k % 4 != 1, (k & 1) != 0, false);
    case_rmsnorm(17, 100, true, true, false, true);
    case_rmsnorm(17, 100, true, true, true, true);

    static const int HSs[4] = {8, 48, 64, 128}, Hs[4] = {1, 4, 14, 2};
    for (int a = 0; a < 4; a++)
        for (int h = 0; h < 4; h++) case_rope(Ns[a], Hs[(a + h) % 4], HSs[h]);

    static const int att[][6] = {
        /* N, n_past, NH, KVH, HS, sliding window */
        {1, 0, 4, 2, 8, 0},     {3, 0, 4, 2, 48, 0},   {3, 7, 14, 2, 64, 0},  {17, 0, 6, 6, 128, 0},
        {17, 70, 4, 2, 48, 0},  {64, 0, 14, 2, 64, 0}, {64, 100, 6, 6, 8, 0}, {1, 130, 4, 2, 128, 0},
        {130, 5, 4, 2, 64, 0},  {17, 0, 14, 2, 128, 0}, {65, 64, 6, 6, 48, 0}, {70, 0, 4, 2, 48, 5},
        {150, 0, 4, 1, 64, 64}, {140, 3, 14, 2, 64, 70}, {17, 70, 4, 2, 48, 1}, {20, 0, 6, 6, 8, 100},
        /* the tiled kernels with 16 rows a CTA (many rows), a window, a head size of 80 */
        {700, 0, 14, 2, 64, 0}, {600, 40, 8, 2, 128, 300}, {333, 5, 12, 4, 80, 0}, {2200, 0, 2, 2, 64, 0},
    };
    for (size_t i = 0; i < sizeof att / sizeof att[0]; i++)
        case_attention(att[i][0], att[i][1], att[i][2], att[i][3], att[i][4], att[i][5]);

    static const size_t sw_n[4] = {1, 17, 1000, 100003};
    for (int i = 0; i < 4; i++) case_swiglu(sw_n[i], i);
    for (int a = 0; a < 4; a++) case_swiglu(1000, a);

    static const int emb[][3] = {
        /* N, V, C */
        {1, 1, 5},    {3, 5, 64},  {17, 5, 100}, {64, 1000, 896}, {300, 7, 64},
        {600, 3, 100}, {64, 1, 5}, {17, 1000, 300}, {257, 2, 257},
    };
    for (size_t i = 0; i < sizeof emb / sizeof emb[0]; i++) case_embed(emb[i][0], emb[i][1], emb[i][2]);
    case_embed(5000, 50, 96, true); /* one group of 5000 tokens: the unrolled loop's tail */
    case_embed(4099, 100000, 200);   /* mostly distinct ids */
    case_embed_plan();

    timings();
    CUDA_FATAL(cudaStreamDestroy(g_s));
    kiln_backend_free(g_cpu);
    printf("%ld cases, %ld elements compared, %.1f s CPU time\n", g_cases, g_elems,
           (double)(clock() - t0) / CLOCKS_PER_SEC);
    if (g_failed) {
        printf("FAILED %d\n", g_failed);
        return 1;
    }
    printf("ALL OK\n");
    return 0;
}
