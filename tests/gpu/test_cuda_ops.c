/*
 * test_cuda_ops.c -- every inference op of the CUDA backend against the CPU backend, bit for
 * bit (auditable mode, docs/CUDA.md), on random shapes including odd sizes, every weight
 * dtype, weights in host memory (the backend's upload cache) and in device memory, with
 * every output poisoned with NaN before each run so an unwritten element cannot pass.
 * Also: the poisoning contract (a failed op poisons the backend and every later status says
 * so), staged uploads, and poll (no wait, and its "not ready" not kept as an error). Without a usable GPU it checks that kiln_backend_cuda_create refuses with
 * KILN_ERR_UNSUPPORTED and a message, then exits 77 (skipped).
 *
 * Prints a table last: op, cases, elements compared, elements whose bits differ.
 */
#include "base/base.h"
#include "base/tensor.h"
#include "ops/ops.h"

#include <math.h>
#include <stdio.h>
#include <time.h>

/* The load-ahead depth of the CUDA N = 1 matmul (cuda_matmul.cu): same bits for any. */
extern int kiln_cuda_matmul_step;
#include <stdlib.h>
#include <string.h>

/* ---- random numbers (splitmix64) ---------------------------------------------------------- */

static uint64_t g_rng = 0x6b696c6e43554441ull;
static uint64_t rnd_u64(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static int rnd_int(int lo, int hi) { return lo + (int)(rnd_u64() % (uint64_t)(hi - lo + 1)); }
static float rnd_unit(void) { return (float)((double)(rnd_u64() >> 11) * 0x1p-53 * 2.0 - 1.0); }

/* ---- results ------------------------------------------------------------------------------- */

enum { R_EMBED, R_RMSNORM, R_MATMUL, R_ROPE, R_ATTENTION, R_SWIGLU, R_GEGLU, R_ADD, R_POISON,
       R_UPLOAD, R_POLL, R_COUNT };
static const char *g_names[R_COUNT] = {"embed",  "rmsnorm", "matmul",          "rope",
                                       "attention", "swiglu", "geglu", "add", "poison contract",
                                       "staged uploads", "poll"};
static long g_cases[R_COUNT], g_elems[R_COUNT], g_bad[R_COUNT];
static int g_failed;

static kiln_backend *g_cpu, *g_gpu;

static void fail_status(const char *what) {
    fprintf(stderr, "FAIL %s: %s\n", what, kiln_last_error());
    g_failed = 1;
}

/* NaN results compared as NaN (compare_nan): a NaN the arithmetic makes from non-NaN operands
 * (0 * inf, inf - inf) has the hardware's default bits (x86 SSE: 0xffc00000; CUDA:
 * 0x7fffffff) and an input NaN's payload is propagated on x86 but not on the GPU, so only
 * "NaN here" is defined (docs/ARITHMETIC.md, "tanh and GELU"). Counted here. */
static long g_nan_outputs;

/* Compare n floats bit for bit; report the first difference. nan_any: a NaN matches any NaN
 * (and only a NaN). */
static void compare_nan(int op, const char *ctx, const float *want, const float *got, size_t n,
                        int nan_any) {
    long bad = 0;
    size_t first = 0;
    for (size_t i = 0; i < n; i++) {
        if (nan_any && isnan(want[i]) && isnan(got[i])) {
            g_nan_outputs++;
            continue;
        }
        if (memcmp(&want[i], &got[i], 4) != 0) {
            if (!bad) first = i;
            bad++;
        }
    }
    g_cases[op]++;
    g_elems[op] += (long)n;
    g_bad[op] += bad;
    if (bad) {
        uint32_t a, b;
        memcpy(&a, &want[first], 4);
        memcpy(&b, &got[first], 4);
        fprintf(stderr, "FAIL %s %s: %ld of %zu differ; first [%zu] cpu %.9g (0x%08x) gpu %.9g (0x%08x)\n",
                g_names[op], ctx, bad, n, first, want[first], a, got[first], b);
        g_failed = 1;
    }
}
static void compare(int op, const char *ctx, const float *want, const float *got, size_t n) {
    compare_nan(op, ctx, want, got, n, 0);
}

/* ---- device buffers ------------------------------------------------------------------------ */

static void *dev_alloc(size_t nbytes) {
    void *p = kiln_backend_alloc(g_gpu, nbytes);
    if (!p) {
        fail_status("alloc");
        exit(1);
    }
    return p;
}
static void up(void *d, const void *h, size_t nbytes) {
    if (kiln_backend_upload(g_gpu, d, h, nbytes) != KILN_OK) fail_status("upload");
}
static void down(void *h, const void *d, size_t nbytes) {
    if (kiln_backend_download(g_gpu, h, d, nbytes) != KILN_OK) fail_status("download");
}
/* Device copy of n host floats. */
static float *dev_copy(const float *h, size_t n) {
    float *d = dev_alloc(n * 4 + 4);
    up(d, h, n * 4);
    return d;
}
/* Fill n device floats with NaN. */
static void dev_poison(float *d, size_t n) {
    float *h = kiln_malloc(n * 4 + 4);
    for (size_t i = 0; i < n; i++) h[i] = NAN;
    up(d, h, n * 4);
    kiln_free(h);
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
static void check_status(const char *what) {
    if (kiln_backend_status(g_gpu) != KILN_OK) fail_status(what);
}

/* ---- random weights of any dtype ----------------------------------------------------------- */

static uint16_t rnd_scale_f16(float lo, float hi) {
    float v = lo + (hi - lo) * (rnd_unit() * 0.5f + 0.5f);
    return kiln_fp32_to_fp16(rnd_u64() & 1 ? v : -v);
}
static void put_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

/* R rows of C elements of dtype dt: plain types random finite values (f16 includes
 * subnormals), quantized blocks random bytes with finite, moderate scales. */
static uint8_t *rnd_weights(kiln_dtype dt, int64_t R, int64_t C, size_t *nbytes) {
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(dt);
    size_t rb = (size_t)(C / tr->block_size) * (size_t)tr->type_size, nb = rb * (size_t)R;
    uint8_t *w = kiln_malloc(nb + 1);
    for (size_t i = 0; i < nb; i++) w[i] = (uint8_t)rnd_u64();
    size_t nblk = nb / (size_t)tr->type_size;
    for (size_t b = 0; b < nblk; b++) {
        uint8_t *p = w + b * (size_t)tr->type_size;
        switch (dt) {
        case KILN_DTYPE_F32: {
            float f = rnd_unit();
            memcpy(p, &f, 4);
            break;
        }
        case KILN_DTYPE_F16: { /* any finite f16: exponent field below 31 */
            uint16_t h = (uint16_t)rnd_u64();
            if ((h & 0x7c00u) == 0x7c00u) h = (uint16_t)(h & ~0x4000u);
            put_u16(p, h);
            break;
        }
        case KILN_DTYPE_BF16: put_u16(p, kiln_fp32_to_bf16(rnd_unit() * 4.0f)); break;
        case KILN_DTYPE_Q8_0: case KILN_DTYPE_Q4_0: case KILN_DTYPE_Q5_0:
            put_u16(p, rnd_scale_f16(0.001f, 0.1f));
            break;
        case KILN_DTYPE_Q4_1: case KILN_DTYPE_Q5_1: case KILN_DTYPE_Q4_K: case KILN_DTYPE_Q5_K:
            put_u16(p, rnd_scale_f16(0.0005f, 0.05f));
            put_u16(p + 2, rnd_scale_f16(0.0005f, 0.05f));
            break;
        case KILN_DTYPE_Q6_K: put_u16(p + 208, rnd_scale_f16(0.0005f, 0.05f)); break;
        default: break;
        }
    }
    *nbytes = nb;
    return w;
}

static const kiln_dtype g_dtypes[] = {KILN_DTYPE_F32,  KILN_DTYPE_F16,  KILN_DTYPE_BF16,
                                      KILN_DTYPE_Q8_0, KILN_DTYPE_Q4_0, KILN_DTYPE_Q4_1,
                                      KILN_DTYPE_Q5_0, KILN_DTYPE_Q5_1, KILN_DTYPE_Q4_K,
                                      KILN_DTYPE_Q5_K, KILN_DTYPE_Q6_K};
#define N_DTYPES ((int)(sizeof g_dtypes / sizeof g_dtypes[0]))

/* A random valid width for dtype dt (odd where the type allows). */
static int64_t rnd_width(kiln_dtype dt) {
    int bs = kiln_dtype_get_traits(dt)->block_size;
    if (bs == 1) {
        static const int w[] = {1, 3, 15, 16, 17, 33, 77, 255, 300, 1001};
        return w[rnd_int(0, 9)];
    }
    return (int64_t)bs * rnd_int(1, bs == 32 ? 37 : 5);
}

/* Host weights the CUDA backend has cached stay alive until it is freed: its cache is keyed
 * by their address, which must not be reused for other data meanwhile (docs/CUDA.md). */
static void *g_keep[1024];
static int g_n_keep;
static void keep_or_free(void *p, int free_now) {
    if (free_now || g_n_keep == 1024) {
        if (!free_now) fprintf(stderr, "test: too many kept weights\n"), exit(1);
        kiln_free(p);
    } else {
        g_keep[g_n_keep++] = p;
    }
}

/* ---- ops --------------------------------------------------------------------------------- */

static void test_matmul(kiln_dtype dt, int64_t R, int64_t C, int N, int with_bias, int on_dev) {
    size_t nb;
    uint8_t *w = rnd_weights(dt, R, C, &nb);
    kiln_tensor W = {"w", dt, 2, {R, C, 1, 1}, w, nb};
    float *x = host_floats((size_t)N * C, 1.0f), *bias = with_bias ? host_floats(R, 1.0f) : NULL;
    float *want = host_nan((size_t)N * R), *got = host_nan((size_t)N * R);
    g_cpu->i->matmul(g_cpu, want, x, &W, bias, N);

    kiln_tensor Wd = W;
    void *wdev = NULL;
    if (on_dev) { /* weights already in device memory: used in place */
        wdev = dev_alloc(nb + 1);
        up(wdev, w, nb);
        Wd.data = wdev;
    }
    float *dx = dev_copy(x, (size_t)N * C), *db = bias ? dev_copy(bias, R) : NULL;
    float *dout = dev_alloc((size_t)N * R * 4 + 4);
    dev_poison(dout, (size_t)N * R);
    g_gpu->i->matmul(g_gpu, dout, dx, &Wd, db, N);
    check_status("matmul");
    down(got, dout, (size_t)N * R * 4);
    char ctx[128];
    snprintf(ctx, sizeof ctx, "%s R=%lld C=%lld N=%d bias=%d dev=%d", kiln_dtype_name(dt),
             (long long)R, (long long)C, N, with_bias, on_dev);
    compare(R_MATMUL, ctx, want, got, (size_t)N * R);
    kiln_backend_free_buf(g_gpu, dx);
    kiln_backend_free_buf(g_gpu, db);
    kiln_backend_free_buf(g_gpu, dout);
    kiln_backend_free_buf(g_gpu, wdev);
    kiln_free(x), kiln_free(bias), kiln_free(want), kiln_free(got);
    /* w stays alive: the backend's cache is keyed by its address, which must not be reused
     * for different data while the backend lives (docs/CUDA.md) */
    keep_or_free(w, on_dev);
}

static void test_embed(kiln_dtype dt, int64_t V, int64_t C, int N, int on_dev) {
    size_t nb;
    uint8_t *t = rnd_weights(dt, V, C, &nb);
    kiln_tensor T = {"tok_embd", dt, 2, {V, C, 1, 1}, t, nb};
    int32_t *ids = kiln_malloc((size_t)N * 4);
    for (int n = 0; n < N; n++) ids[n] = rnd_int(0, (int)V - 1);
    float *want = host_nan((size_t)N * C), *got = host_nan((size_t)N * C);
    g_cpu->i->embed(g_cpu, want, &T, ids, N);
    void *tdev = NULL;
    int32_t *ids_dev = NULL;
    if (on_dev) {
        tdev = dev_alloc(nb + 1);
        up(tdev, t, nb);
        T.data = tdev;
        ids_dev = dev_alloc((size_t)N * 4);
        up(ids_dev, ids, (size_t)N * 4);
    }
    float *dout = dev_alloc((size_t)N * C * 4 + 4);
    dev_poison(dout, (size_t)N * C);
    g_gpu->i->embed(g_gpu, dout, &T, on_dev ? ids_dev : ids, N);
    check_status("embed");
    down(got, dout, (size_t)N * C * 4);
    char ctx[128];
    snprintf(ctx, sizeof ctx, "%s V=%lld C=%lld N=%d dev=%d", kiln_dtype_name(dt),
             (long long)V, (long long)C, N, on_dev);
    compare(R_EMBED, ctx, want, got, (size_t)N * C);
    kiln_backend_free_buf(g_gpu, dout);
    kiln_backend_free_buf(g_gpu, tdev);
    kiln_backend_free_buf(g_gpu, ids_dev);
    kiln_free(ids), kiln_free(want), kiln_free(got);
    keep_or_free(t, on_dev);
}

static void test_rmsnorm(int N, int C, int with_w, int in_place) {
    size_t n = (size_t)N * C;
    float *x = host_floats(n, 3.0f), *w = with_w ? host_floats((size_t)C, 2.0f) : NULL;
    float *want = host_nan(n), *got = host_nan(n);
    g_cpu->i->rmsnorm(g_cpu, want, x, w, N, C, 1e-6f);
    float *dx = dev_copy(x, n), *dw = w ? dev_copy(w, (size_t)C) : NULL, *dout = dx;
    if (!in_place) {
        dout = dev_alloc(n * 4 + 4);
        dev_poison(dout, n);
    }
    g_gpu->i->rmsnorm(g_gpu, dout, dx, dw, N, C, 1e-6f);
    check_status("rmsnorm");
    down(got, dout, n * 4);
    char ctx[96];
    snprintf(ctx, sizeof ctx, "N=%d C=%d w=%d in_place=%d", N, C, with_w, in_place);
    compare(R_RMSNORM, ctx, want, got, n);
    if (dout != dx) kiln_backend_free_buf(g_gpu, dout);
    kiln_backend_free_buf(g_gpu, dx);
    kiln_backend_free_buf(g_gpu, dw);
    kiln_free(x), kiln_free(w), kiln_free(want), kiln_free(got);
}

static void test_rope(int N, int H, int HS, int max_pos, int pos_on_dev) {
    size_t n = (size_t)N * H * HS, nt = (size_t)(max_pos + 1) * (HS / 2);
    float *x = host_floats(n, 2.0f), *ct = host_floats(nt, 1.0f), *st = host_floats(nt, 1.0f);
    int32_t *pos = kiln_malloc((size_t)N * 4);
    for (int i = 0; i < N; i++) pos[i] = rnd_int(0, max_pos);
    float *want = kiln_malloc(n * 4), *got = host_nan(n);
    memcpy(want, x, n * 4);
    g_cpu->i->rope(g_cpu, want, pos, N, H, HS, ct, st);
    float *dx = dev_copy(x, n), *dct = dev_copy(ct, nt), *dst = dev_copy(st, nt);
    int32_t *dpos = NULL;
    if (pos_on_dev) {
        dpos = dev_alloc((size_t)N * 4);
        up(dpos, pos, (size_t)N * 4);
    }
    g_gpu->i->rope(g_gpu, dx, pos_on_dev ? dpos : pos, N, H, HS, dct, dst);
    check_status("rope");
    down(got, dx, n * 4);
    char ctx[96];
    snprintf(ctx, sizeof ctx, "N=%d H=%d HS=%d pos_dev=%d", N, H, HS, pos_on_dev);
    compare(R_ROPE, ctx, want, got, n);
    kiln_backend_free_buf(g_gpu, dx), kiln_backend_free_buf(g_gpu, dct);
    kiln_backend_free_buf(g_gpu, dst), kiln_backend_free_buf(g_gpu, dpos);
    kiln_free(x), kiln_free(ct), kiln_free(st), kiln_free(pos), kiln_free(want), kiln_free(got);
}

static void test_attention(int N, int n_past, int NH, int KVH, int HS, float qscale, int window) {
    int T = n_past + N + rnd_int(0, 3); /* the cache may hold more rows than are used */
    size_t nq = (size_t)N * NH * HS, nkv = (size_t)T * KVH * HS;
    float *q = host_floats(nq, qscale), *k = host_floats(nkv, 1.0f), *v = host_floats(nkv, 1.0f);
    float *want = host_nan(nq), *got = host_nan(nq);
    float scale = (float)(1.0 / sqrt((double)HS));
    g_cpu->i->attention(g_cpu, want, q, k, v, N, n_past, NH, KVH, HS, scale, window);
    float *dq = dev_copy(q, nq), *dk = dev_copy(k, nkv), *dv = dev_copy(v, nkv);
    float *dout = dev_alloc(nq * 4 + 4);
    dev_poison(dout, nq);
    g_gpu->i->attention(g_gpu, dout, dq, dk, dv, N, n_past, NH, KVH, HS, scale, window);
    check_status("attention");
    down(got, dout, nq * 4);
    char ctx[128];
    snprintf(ctx, sizeof ctx, "N=%d n_past=%d NH=%d KVH=%d HS=%d qscale=%g window=%d", N, n_past,
             NH, KVH, HS, qscale, window);
    compare(R_ATTENTION, ctx, want, got, nq);
    kiln_backend_free_buf(g_gpu, dq), kiln_backend_free_buf(g_gpu, dk);
    kiln_backend_free_buf(g_gpu, dv), kiln_backend_free_buf(g_gpu, dout);
    kiln_free(q), kiln_free(k), kiln_free(v), kiln_free(want), kiln_free(got);
}

static void test_swiglu(size_t n, int in_place) {
    float *g = host_floats(n, 30.0f), *u = host_floats(n, 2.0f);
    for (size_t i = 0; i < n; i += 7) g[i] = rnd_unit() * 120.0f; /* past exp's clamps */
    float *want = host_nan(n), *got = host_nan(n);
    g_cpu->i->swiglu(g_cpu, want, g, u, n);
    float *dg = dev_copy(g, n), *du = dev_copy(u, n), *dout = dg;
    if (!in_place) {
        dout = dev_alloc(n * 4 + 4);
        dev_poison(dout, n);
    }
    g_gpu->i->swiglu(g_gpu, dout, dg, du, n);
    check_status("swiglu");
    down(got, dout, n * 4);
    char ctx[64];
    snprintf(ctx, sizeof ctx, "n=%zu in_place=%d", n, in_place);
    compare(R_SWIGLU, ctx, want, got, n);
    if (dout != dg) kiln_backend_free_buf(g_gpu, dout);
    kiln_backend_free_buf(g_gpu, dg), kiln_backend_free_buf(g_gpu, du);
    kiln_free(g), kiln_free(u), kiln_free(want), kiln_free(got);
}

/* geglu (kmath.h's kiln_geglu: GELU's tanh form times up): random gates whose tanh argument
 * falls on both sides of kiln_tanhf's 2^-4 switch and past exp's clamps, then (special) a
 * table of edge values: +-0, subnormals, gates at and around the switch (|inner| = 2^-4 at
 * |x| ~ 0.0783), large |x| whose cube overflows, +-inf, NaN, each against several ups
 * (+-0, inf, NaN included). out aliases gate when in_place. Bits compared, except that a NaN
 * output need only be a NaN on both (compare_nan). */
static void test_geglu(size_t n, int in_place, int special) {
    static const float gates[] = {0.0f, -0.0f, 1e-40f, -1e-40f, 1e-20f, 0.05f, -0.05f,
                                  0.0783f, -0.0783f, 0.07833f, 0.07834f, -0.07834f, 0.0784f,
                                  0.1f, -0.1f, 0.5f, -1.0f, 1.0f, 3.0f, -3.0f, 5.9f, -9.0f,
                                  10.0f, -10.5f, 44.0f, -44.0f, 1e13f, -1e13f, 3e38f, -3e38f,
                                  INFINITY, -INFINITY, NAN};
    static const float ups[] = {1.0f, -0.75f, 0.0f, -0.0f, 3e38f, INFINITY, NAN, 1e-30f};
    const size_t ng = sizeof gates / sizeof gates[0], nu = sizeof ups / sizeof ups[0];
    if (special) n = ng * nu;
    float *g = host_floats(n, 4.0f), *u = host_floats(n, 2.0f);
    for (size_t i = 0; i < n; i += 5) g[i] = rnd_unit() * 0.125f; /* near the switch */
    for (size_t i = 3; i < n; i += 11) g[i] = rnd_unit() * 120.0f; /* past exp's clamps */
    if (special)
        for (size_t i = 0; i < n; i++) g[i] = gates[i / nu], u[i] = ups[i % nu];
    float *want = host_nan(n), *got = host_nan(n);
    g_cpu->i->geglu(g_cpu, want, g, u, n);
    float *dg = dev_copy(g, n), *du = dev_copy(u, n), *dout = dg;
    if (!in_place) {
        dout = dev_alloc(n * 4 + 4);
        dev_poison(dout, n);
    }
    g_gpu->i->geglu(g_gpu, dout, dg, du, n);
    check_status("geglu");
    down(got, dout, n * 4);
    char ctx[64];
    snprintf(ctx, sizeof ctx, "n=%zu in_place=%d special=%d", n, in_place, special);
    compare_nan(R_GEGLU, ctx, want, got, n, 1);
    if (dout != dg) kiln_backend_free_buf(g_gpu, dout);
    kiln_backend_free_buf(g_gpu, dg), kiln_backend_free_buf(g_gpu, du);
    kiln_free(g), kiln_free(u), kiln_free(want), kiln_free(got);
}

static void test_add(size_t n) {
    float *x = host_floats(n, 5.0f), *y = host_floats(n, 5.0f);
    float *want = kiln_malloc(n * 4 + 4), *got = host_nan(n);
    memcpy(want, x, n * 4);
    g_cpu->i->add(g_cpu, want, y, n);
    float *dx = dev_copy(x, n), *dy = dev_copy(y, n);
    g_gpu->i->add(g_gpu, dx, dy, n);
    check_status("add");
    down(got, dx, n * 4);
    char ctx[32];
    snprintf(ctx, sizeof ctx, "n=%zu", n);
    compare(R_ADD, ctx, want, got, n);
    kiln_backend_free_buf(g_gpu, dx), kiln_backend_free_buf(g_gpu, dy);
    kiln_free(x), kiln_free(y), kiln_free(want), kiln_free(got);
}

/* Uploads return before their copies run (pinned staging slots): the source is rewritten at
 * once, the slots are reused many times over while a long kernel queue is ahead of them, and
 * one upload is too large to be staged; every buffer must hold what was uploaded into it. */
static void test_staged_uploads(void) {
    enum { NB = 40, LEN = 1000 };
    float *buf[NB + 1] = {0};
    static float h[LEN];
    int ok = 1;
    for (int b = 0; b < NB && ok; b++) ok = (buf[b] = kiln_backend_alloc(g_gpu, LEN * 4)) != NULL;
    const size_t big = ((size_t)5 << 20) / 4; /* over the 4 MiB staged size */
    float *hb = malloc(big * 4);
    ok = ok && hb && (buf[NB] = kiln_backend_alloc(g_gpu, big * 4)) != NULL;
    for (int r = 0; r < 200 && ok; r++) /* a queue of work ahead of the uploads */
        g_gpu->i->add(g_gpu, buf[0], buf[0], LEN);
    for (int b = 0; b < NB && ok; b++) {
        for (int i = 0; i < LEN; i++) h[i] = (float)(b * LEN + i);
        ok = kiln_backend_upload(g_gpu, buf[b], h, sizeof h) == KILN_OK;
        for (int i = 0; i < LEN; i++) h[i] = -1.0f; /* the caller's buffer is free at once */
    }
    if (ok) {
        for (size_t i = 0; i < big; i++) hb[i] = (float)i;
        ok = kiln_backend_upload(g_gpu, buf[NB], hb, big * 4) == KILN_OK;
    }
    for (int b = 0; b < NB && ok; b++) {
        ok = kiln_backend_download(g_gpu, h, buf[b], sizeof h) == KILN_OK;
        for (int i = 0; i < LEN && ok; i++) ok = h[i] == (float)(b * LEN + i);
    }
    if (ok) {
        memset(hb, 0, big * 4);
        ok = kiln_backend_download(g_gpu, hb, buf[NB], big * 4) == KILN_OK;
        for (size_t i = 0; i < big && ok; i++) ok = hb[i] == (float)i;
    }
    for (int b = 0; b <= NB; b++) kiln_backend_free_buf(g_gpu, buf[b]);
    free(hb);
    g_cases[R_UPLOAD]++;
    if (!ok) {
        fprintf(stderr, "FAIL staged uploads (last error: %s)\n", kiln_last_error());
        g_bad[R_UPLOAD]++;
        g_failed = 1;
    }
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* poll (ops.h) answers without waiting for the queued work, and its "not ready" is not kept
 * as an error: a queue of adds is ahead of it, then one more add must still run and status
 * (which waits) must still say KILN_OK; the values must be right. When the queue outlasts
 * 5 ms, poll must have taken under half of the time status waited. */
static void test_poll(void) {
    enum { LEN = 1 << 24, REPS = 400 }; /* about 20 ms of adds on an H200 */
    float *a = kiln_backend_alloc(g_gpu, (size_t)LEN * 4), *b = kiln_backend_alloc(g_gpu, 64 * 4);
    float h[64];
    int ok = a && b;
    for (int i = 0; i < 64; i++) h[i] = 1.0f;
    if (ok) g_gpu->i->zero(g_gpu, a, LEN);
    ok = ok && kiln_backend_upload(g_gpu, b, h, sizeof h) == KILN_OK;
    ok = ok && kiln_backend_status(g_gpu) == KILN_OK;
    for (int r = 0; r < REPS && ok; r++) g_gpu->i->add(g_gpu, a, a, LEN); /* 0 + 0: stays 0 */
    const double t0 = now_s();
    const kiln_status polled = kiln_backend_poll(g_gpu);
    const double t1 = now_s();
    g_gpu->i->add(g_gpu, b, b, 64); /* launched after a "not ready" answer */
    const kiln_status waited = kiln_backend_status(g_gpu);
    const double t2 = now_s();
    ok = ok && polled == KILN_OK && waited == KILN_OK;
    ok = ok && kiln_backend_download(g_gpu, h, b, sizeof h) == KILN_OK;
    for (int i = 0; i < 64 && ok; i++) ok = h[i] == 2.0f;
    if (ok && t2 - t0 > 5e-3 && t1 - t0 > 0.5 * (t2 - t0)) {
        fprintf(stderr, "FAIL poll waited: %.2f ms of the queue's %.2f ms\n", 1e3 * (t1 - t0),
                1e3 * (t2 - t0));
        ok = 0;
    }
    printf("poll: %.3f ms with %.2f ms of work queued\n", 1e3 * (t1 - t0), 1e3 * (t2 - t0));
    kiln_backend_free_buf(g_gpu, a);
    kiln_backend_free_buf(g_gpu, b);
    g_cases[R_POLL]++;
    if (!ok) {
        fprintf(stderr, "FAIL poll (last error: %s)\n", kiln_last_error());
        g_bad[R_POLL]++;
        g_failed = 1;
    }
}

/* A refused op poisons the backend: status reports it, later ops do nothing, later status
 * calls still report it. */
static void test_poison(void) {
    kiln_backend *be = NULL;
    if (kiln_backend_cuda_create(0, &be) != KILN_OK) {
        fail_status("poison: create");
        return;
    }
    int ok = 1;
    float *buf = kiln_backend_alloc(be, 64 * 4);
    float h[64];
    for (int i = 0; i < 64; i++) h[i] = 1.0f;
    ok &= kiln_backend_upload(be, buf, h, sizeof h) == KILN_OK;
    ok &= kiln_backend_status(be) == KILN_OK;
    int32_t idata[16] = {0};
    kiln_tensor bad = {"bad", KILN_DTYPE_I32, 2, {4, 4, 1, 1}, idata, sizeof idata};
    be->i->matmul(be, buf, buf, &bad, NULL, 1); /* unsupported dtype: poisons */
    kiln_status st = kiln_backend_status(be);
    ok &= st == KILN_ERR_UNSUPPORTED && strstr(kiln_last_error(), "i32") != NULL;
    be->i->add(be, buf, buf, 64); /* must do nothing */
    ok &= kiln_backend_status(be) == KILN_ERR_UNSUPPORTED;
    ok &= kiln_backend_poll(be) == KILN_ERR_UNSUPPORTED; /* poll reports it too */
    ok &= kiln_backend_download(be, h, buf, sizeof h) == KILN_ERR_UNSUPPORTED;
    kiln_backend_free_buf(be, buf);
    kiln_backend_free(be);
    g_cases[R_POISON]++;
    if (!ok) {
        fprintf(stderr, "FAIL poison contract (last error: %s)\n", kiln_last_error());
        g_bad[R_POISON]++;
        g_failed = 1;
    }
}

int main(int argc, char **argv) {
    if (argc > 1) g_rng = strtoull(argv[1], NULL, 0);
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
    if (kiln_backend_cpu_create(2, &g_cpu) != KILN_OK) {
        fail_status("cpu backend");
        return 1;
    }
    printf("seed 0x%llx\n", (unsigned long long)g_rng);

    for (int d = 0; d < N_DTYPES; d++) {
        kiln_dtype dt = g_dtypes[d];
        for (int rep = 0; rep < 6; rep++) {
            static const int Ns[] = {1, 1, 2, 3, 5, 9, 17, 33};
            static const int Rs[] = {1, 7, 16, 17, 37, 100, 129};
            test_matmul(dt, Rs[rnd_int(0, 6)], rnd_width(dt), Ns[rnd_int(0, 7)], rnd_int(0, 1),
                        rep & 1);
        }
        /* decode shapes, under both load-ahead depths of the N = 1 kernel */
        for (int step = 32; step <= 64; step *= 2) {
            kiln_cuda_matmul_step = step;
            test_matmul(dt, 203, rnd_width(dt), 1, 1, 0);
            test_matmul(dt, rnd_int(1, 300), rnd_width(dt) * rnd_int(1, 3), 1, rnd_int(0, 1), 1);
        }
        kiln_cuda_matmul_step = 0; /* the default: per dtype */
        for (int rep = 0; rep < 2; rep++)
            test_embed(dt, rnd_int(1, 40), rnd_width(dt), rnd_int(1, 19), rep);
    }
    static const int Cs[] = {1, 7, 16, 64, 77, 128, 896, 1001};
    for (int rep = 0; rep < 16; rep++)
        test_rmsnorm(rnd_int(1, 40), Cs[rep % 8], rep & 1, (rep >> 1) & 1);
    static const int HSs[] = {2, 16, 64, 80, 128, 256};
    for (int rep = 0; rep < 12; rep++)
        test_rope(rnd_int(1, 20), rnd_int(1, 9), HSs[rep % 6], rnd_int(0, 300), rep & 1);
    /* attention: decode (N=1) and prefill, key counts across block edges of 64, GQA groups */
    test_attention(1, 0, 2, 1, 64, 1.0f, 0);
    test_attention(1, 63, 14, 2, 64, 4.0f, 0);
    test_attention(1, 64, 4, 4, 128, 1.0f, 0);
    test_attention(1, 1000, 8, 2, 128, 8.0f, 0);
    test_attention(7, 63, 4, 2, 80, 2.0f, 0);
    test_attention(17, 130, 6, 3, 128, 1.0f, 0);
    test_attention(3, 0, 2, 2, 16, 30.0f, 0);
    test_attention(65, 0, 4, 1, 64, 3.0f, 0);
    test_attention(2, 5, 3, 1, 256, 1.0f, 0);
    test_attention(1, 200, 2, 1, 18, 1.0f, 0);
    test_attention(7, 63, 4, 2, 80, 2.0f, 5);      /* sliding windows */
    test_attention(17, 130, 6, 3, 128, 1.0f, 64);
    test_attention(65, 0, 4, 1, 64, 3.0f, 70);
    /* the tiled schedule with 16 rows a CTA (many rows), windows, a head size of 80 */
    test_attention(700, 0, 14, 2, 64, 2.0f, 0);
    test_attention(600, 40, 8, 2, 128, 1.0f, 300);
    test_attention(333, 5, 12, 4, 80, 4.0f, 0);
    const int has_geglu = g_gpu->i->geglu != NULL;
    if (!has_geglu) {
        fprintf(stderr, "FAIL: the CUDA backend has no geglu\n");
        g_failed = 1;
    }
    static const size_t ns[] = {1, 31, 64, 1000, 4097, 100003};
    for (int rep = 0; rep < 6; rep++) {
        test_swiglu(ns[rep], rep & 1);
        if (has_geglu) test_geglu(ns[rep], rep & 1, 0);
        test_add(ns[rep]);
    }
    if (has_geglu) {
        test_geglu(0, 0, 1);
        test_geglu(0, 1, 1);
    }
    test_poison();
    test_staged_uploads();
    test_poll();

    kiln_backend_free(g_gpu);
    kiln_backend_free(g_cpu);
    for (int i = 0; i < g_n_keep; i++) kiln_free(g_keep[i]);
    printf("\n%-16s %6s %10s %10s\n", "op", "cases", "elements", "bits-diff");
    for (int i = 0; i < R_COUNT; i++)
        printf("%-16s %6ld %10ld %10ld\n", g_names[i], g_cases[i], g_elems[i], g_bad[i]);
    printf("(geglu: %ld NaN outputs, NaN on both sides; their bits are the hardware's)\n",
           g_nan_outputs);
    printf("%s\n", g_failed ? "FAILED" : "ALL BIT-IDENTICAL");
    return g_failed ? 1 : 0;
}
