/*
 * bench_cuda_rmsnorm.cu -- time and check the auditable CUDA rmsnorm kernels:
 * kiln_cuda_rmsnorm (forward) and kiln_cuda_rmsnorm_backward (rows kernel, then dw by column
 * lanes), both cuda_norm.cu.
 *
 * Check: every output bit for bit against a plain host reference written here from
 * docs/ARITHMETIC.md ("rmsnorm", "rmsnorm backward"; the CPU's order in
 * src/ops/cpu/cpu_backend.c and backward_portable.c): lane i % 16 does fmaf in increasing i,
 * the fixed tree, r = 1 / sqrtf(ss / C + eps), out = (x * r) * w; g = dy * w, d = dot(g, x),
 * u = ((d / C) * r) * r, dx = (g - x * u) * r (or dx + that), dw[c] = dw[c] + tree of the
 * lanes n % 16 of fmaf(dy[n,c], x[n,c] * r_n, .). Forward with w, without w, in place;
 * backward with w and dw (dx overwritten, then accumulated into random values) and without
 * w, in place (dx = dy). Overwritten outputs are poisoned with NaN bits first; dw starts
 * random. The timed shapes and a few odd ones that reach every kernel variant (tails, the
 * chunked kernels, each column-block width) are checked.
 *
 * Time: per timed shape, 50 reps (or argv[1]) between cudaEvents after one warm-up call:
 * forward; backward with dw (the whole op); backward without dw (the rows kernel alone).
 * GB/s counts each tensor once: forward reads x, writes out (2 N C floats); backward reads
 * dy, x, writes dx (3 N C floats).
 *
 * First, on the host: the reference against float64 math (close, not bits) and against
 * kiln's CPU backend (bit for bit, odd shapes); without a GPU the program then exits 77. Prints one line per case, then "ALL OK" or "FAILED n" (exit 0 / 1).
 *
 * Usage: bench_cuda_rmsnorm [reps]
 */
#include "ops/cuda/cuda_norm.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "gpu_test_cuda_check.h"

static int g_failed;

/* ---- random data (splitmix64) ------------------------------------------------------------- */

static uint64_t g_rng = 0x726d736e6f726d31ull;
static uint64_t rnd_u64(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rnd_unit(void) { return (float)((double)(rnd_u64() >> 11) * 0x1p-53 * 2.0 - 1.0); }

/* Values in [-scale, scale], one in 16 an exact zero. */
static void fill_rand(std::vector<float> &v, float scale) {
    for (float &e : v) e = (rnd_u64() & 15) == 0 ? 0.0f : rnd_unit() * scale;
}

/* Rows of different magnitudes (r far from 1), row 0 all zeros (r = 1 / sqrtf(eps)). */
static void fill_rows(std::vector<float> &v, int N, int C) {
    for (int n = 0; n < N; n++) {
        const float scale = n == 0 ? 0.0f : ldexpf(1.0f, (int)(rnd_u64() % 13) - 6);
        for (int c = 0; c < C; c++) {
            float e = (rnd_u64() & 15) == 0 ? 0.0f : rnd_unit() * scale;
            v[(size_t)n * C + c] = e;
        }
    }
}

static const uint32_t POISON_BITS = 0x7fedcba9u; /* a NaN payload no arithmetic produces */

/* ---- the host reference ------------------------------------------------------------------- */

/* The fixed tree over 16 lanes. */
static float ref_tree(const float l[16]) {
    float s8[8], s4[4], s2[2];
    for (int j = 0; j < 8; j++) s8[j] = l[j] + l[j + 8];
    for (int j = 0; j < 4; j++) s4[j] = s8[j] + s8[j + 4];
    for (int j = 0; j < 2; j++) s2[j] = s4[j] + s4[j + 2];
    return s2[0] + s2[1];
}

/* dot(a, b, n): lane i % 16 does fmaf(a[i], b[i], acc) in increasing i, then the tree. */
static float ref_dot(const float *a, const float *b, int n) {
    float l[16] = {0};
    for (int i = 0; i < n; i++) l[i % 16] = fmaf(a[i], b[i], l[i % 16]);
    return ref_tree(l);
}

static float ref_r(const float *x, int C, float eps) {
    const float mean = ref_dot(x, x, C) / (float)C;
    return 1.0f / sqrtf(mean + eps);
}

static void ref_rmsnorm(float *out, const float *x, const float *w, int N, int C, float eps) {
    for (int64_t n = 0; n < N; n++) {
        const float *xr = x + n * C;
        const float r = ref_r(xr, C, eps);
        for (int c = 0; c < C; c++) out[n * C + c] = w ? (xr[c] * r) * w[c] : xr[c] * r;
    }
}

/* dx may be dy (each element read before it is written). dw NULL or w NULL: no dw. */
static void ref_rmsnorm_bwd(float *dx, float *dw, const float *dy, const float *x,
                            const float *w, int N, int C, float eps, float *rstd,
                            bool accumulate) {
    std::vector<float> g(C);
    for (int64_t n = 0; n < N; n++) {
        const float *xr = x + n * C, *dyr = dy + n * C;
        float *dxr = dx + n * C;
        const float r = ref_r(xr, C, eps);
        rstd[n] = r;
        for (int c = 0; c < C; c++) g[c] = w ? dyr[c] * w[c] : dyr[c];
        const float d = ref_dot(g.data(), xr, C);
        const float u = ((d / (float)C) * r) * r;
        for (int c = 0; c < C; c++) {
            const float v = (g[c] - xr[c] * u) * r;
            dxr[c] = accumulate ? dxr[c] + v : v;
        }
    }
    if (!dw || !w) return;
    std::vector<float> l((size_t)16 * C, 0.0f);
    for (int64_t n = 0; n < N; n++)
        for (int c = 0; c < C; c++) {
            float &acc = l[(size_t)(n % 16) * C + c];
            acc = fmaf(dy[n * C + c], x[n * C + c] * rstd[n], acc);
        }
    for (int c = 0; c < C; c++) {
        float lanes[16];
        for (int j = 0; j < 16; j++) lanes[j] = l[(size_t)j * C + c];
        dw[c] = dw[c] + ref_tree(lanes);
    }
}

/* ---- host-only sanity of the reference: against float64 math ------------------------------ */

static void check_reference_f64(void) {
    const int N = 9, C = 333;
    const float eps = 1e-6f;
    std::vector<float> x((size_t)N * C), w(C), dy((size_t)N * C), out((size_t)N * C),
        dx((size_t)N * C), dw(C, 0.0f), rstd(N);
    fill_rows(x, N, C);
    fill_rand(w, 1.5f);
    fill_rand(dy, 1.0f);
    ref_rmsnorm(out.data(), x.data(), w.data(), N, C, eps);
    ref_rmsnorm_bwd(dx.data(), dw.data(), dy.data(), x.data(), w.data(), N, C, eps, rstd.data(),
                    false);
    double max_fwd = 0, max_dx = 0, max_dw = 0, max_ref = 0;
    std::vector<double> dwd(C, 0.0);
    for (int n = 0; n < N; n++) {
        const float *xr = &x[(size_t)n * C], *dyr = &dy[(size_t)n * C];
        double ss = 0, gx = 0;
        for (int c = 0; c < C; c++) ss += (double)xr[c] * xr[c];
        const double r = 1.0 / sqrt(ss / C + eps);
        for (int c = 0; c < C; c++) gx += (double)dyr[c] * w[c] * xr[c];
        for (int c = 0; c < C; c++) {
            const double o = xr[c] * r * w[c];
            const double g = (double)dyr[c] * w[c];
            const double d = r * (g - xr[c] * r * r * gx / C);
            max_ref = fmax(max_ref, fabs(o));
            max_fwd = fmax(max_fwd, fabs(o - out[(size_t)n * C + c]) / (fabs(o) + 1e-3));
            max_dx = fmax(max_dx, fabs(d - dx[(size_t)n * C + c]) / (fabs(r) * 1e-3 + fabs(d)));
            dwd[c] += (double)dyr[c] * xr[c] * r;
        }
    }
    for (int c = 0; c < C; c++) max_dw = fmax(max_dw, fabs(dwd[c] - dw[c]) / (fabs(dwd[c]) + 1e-2));
    const bool ok = max_fwd < 1e-5 && max_dx < 1e-3 && max_dw < 1e-4 && max_ref > 0;
    printf("reference vs float64 N=%d C=%d: rel err fwd %.2e dx %.2e dw %.2e %s\n", N, C,
           max_fwd, max_dx, max_dw, ok ? "OK" : "FAIL");
    if (!ok) g_failed++;
}

/* ---- host-only: the reference is the CPU backend's bits ---------------------------------- */

static size_t count_bits_diff(const std::vector<float> &a, const std::vector<float> &b) {
    size_t bad = 0;
    for (size_t i = 0; i < a.size(); i++) bad += memcmp(&a[i], &b[i], 4) != 0;
    return bad;
}

/* Forward with and without w; backward with w + dw overwrite and accumulate, and without w
 * in place, against kiln's CPU backend (its SIMD path, 2 threads). */
static void check_reference_cpu(kiln_backend *cpu, int N, int C, float eps) {
    const size_t NC = (size_t)N * C;
    std::vector<float> x(NC), w(C), dy(NC), dw0(C), dx0(NC);
    fill_rows(x, N, C);
    fill_rand(w, 1.5f);
    fill_rand(dy, 1.0f);
    fill_rand(dw0, 4.0f);
    fill_rand(dx0, 2.0f);
    size_t bad = 0;
    for (int with_w = 0; with_w < 2; with_w++) {
        std::vector<float> a(NC), b(NC);
        ref_rmsnorm(a.data(), x.data(), with_w ? w.data() : nullptr, N, C, eps);
        cpu->i->rmsnorm(cpu, b.data(), x.data(), with_w ? w.data() : nullptr, N, C, eps);
        bad += count_bits_diff(a, b);
    }
    for (int variant = 0; variant < 3; variant++) { /* w overwrite, w accumulate, no w in place */
        const bool acc = variant == 1, with_w = variant < 2;
        std::vector<float> a = acc ? dx0 : dy, b = a, adw = dw0, bdw = dw0, ar(N), br(N);
        const float *wp = with_w ? w.data() : nullptr;
        ref_rmsnorm_bwd(a.data(), adw.data(), with_w ? dy.data() : a.data(), x.data(), wp, N, C,
                        eps, ar.data(), acc);
        cpu->i->rmsnorm_backward(cpu, b.data(), bdw.data(), with_w ? dy.data() : b.data(),
                                 x.data(), wp, N, C, eps, br.data(), acc);
        bad += count_bits_diff(a, b) + count_bits_diff(adw, bdw) + count_bits_diff(ar, br);
    }
    printf("reference vs CPU backend N=%d C=%d: %zu differing elements %s\n", N, C, bad,
           bad ? "FAIL" : "OK");
    if (bad) g_failed++;
}

/* ---- device helpers ----------------------------------------------------------------------- */

struct dbuf {
    float *p = nullptr;
    size_t n = 0;
    explicit dbuf(size_t count) : n(count) {
        CUDA_OK(cudaMalloc(&p, (count ? count : 1) * sizeof(float)));
    }
    ~dbuf() { cudaFree(p); }
    dbuf(const dbuf &) = delete;
    dbuf &operator=(const dbuf &) = delete;
    void put(const std::vector<float> &v) {
        CUDA_OK(cudaMemcpy(p, v.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    }
    std::vector<float> get() const {
        std::vector<float> v(n);
        CUDA_OK(cudaMemcpy(v.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost));
        return v;
    }
    void poison() {
        std::vector<float> v(n);
        for (float &e : v) memcpy(&e, &POISON_BITS, 4);
        put(v);
    }
};

/* Bitwise comparison; prints the first mismatch. Returns the number of mismatches. */
static size_t compare(const char *what, const std::vector<float> &got,
                      const std::vector<float> &want, int C) {
    size_t bad = 0;
    for (size_t i = 0; i < want.size(); i++) {
        uint32_t a, b;
        memcpy(&a, &got[i], 4);
        memcpy(&b, &want[i], 4);
        if (a != b) {
            if (!bad)
                printf("    %s: first mismatch at [%zu] (row %zu, col %zu): got %.9g (0x%08x) "
                       "want %.9g (0x%08x)\n",
                       what, i, i / (size_t)C, i % (size_t)C, got[i], a, want[i], b);
            bad++;
        }
    }
    return bad;
}

/* ---- one shape: check every variant bit for bit ------------------------------------------ */

static void check_shape(int N, int C, float eps) {
    const size_t NC = (size_t)N * C;
    std::vector<float> x(NC), w(C), dy(NC), dw0(C), dx0(NC);
    fill_rows(x, N, C);
    fill_rand(w, 1.5f);
    fill_rand(dy, 1.0f);
    fill_rand(dw0, 4.0f);
    fill_rand(dx0, 2.0f);
    dbuf d_x(NC), d_w(C), d_dy(NC), d_out(NC), d_dx(NC), d_dw(C), d_rstd(N);
    d_x.put(x);
    d_w.put(w);
    size_t bad = 0;
    std::vector<float> want(NC), want_dw(C), want_rstd(N);

    /* forward with w, without w, in place (out = x) */
    ref_rmsnorm(want.data(), x.data(), w.data(), N, C, eps);
    d_out.poison();
    CUDA_OK(kiln_cuda_rmsnorm(0, d_out.p, d_x.p, d_w.p, N, C, eps));
    bad += compare("fwd w", d_out.get(), want, C);
    d_out.put(x);
    CUDA_OK(kiln_cuda_rmsnorm(0, d_out.p, d_out.p, d_w.p, N, C, eps));
    bad += compare("fwd w in place", d_out.get(), want, C);
    ref_rmsnorm(want.data(), x.data(), nullptr, N, C, eps);
    d_out.poison();
    CUDA_OK(kiln_cuda_rmsnorm(0, d_out.p, d_x.p, nullptr, N, C, eps));
    bad += compare("fwd no w", d_out.get(), want, C);

    /* backward with w and dw: dx overwritten */
    want_dw = dw0;
    ref_rmsnorm_bwd(want.data(), want_dw.data(), dy.data(), x.data(), w.data(), N, C, eps,
                    want_rstd.data(), false);
    d_dy.put(dy);
    d_dx.poison();
    d_rstd.poison();
    d_dw.put(dw0);
    CUDA_OK(kiln_cuda_rmsnorm_backward(0, d_dx.p, d_dw.p, d_dy.p, d_x.p, d_w.p, N, C, eps,
                                       d_rstd.p, false));
    bad += compare("bwd dx", d_dx.get(), want, C);
    bad += compare("bwd dw", d_dw.get(), want_dw, C);
    bad += compare("bwd rstd", d_rstd.get(), want_rstd, 1);

    /* backward with w and dw: dx accumulated into random values */
    want = dx0;
    want_dw = dw0;
    ref_rmsnorm_bwd(want.data(), want_dw.data(), dy.data(), x.data(), w.data(), N, C, eps,
                    want_rstd.data(), true);
    d_dx.put(dx0);
    d_rstd.poison();
    d_dw.put(dw0);
    CUDA_OK(kiln_cuda_rmsnorm_backward(0, d_dx.p, d_dw.p, d_dy.p, d_x.p, d_w.p, N, C, eps,
                                       d_rstd.p, true));
    bad += compare("bwd acc dx", d_dx.get(), want, C);
    bad += compare("bwd acc dw", d_dw.get(), want_dw, C);
    bad += compare("bwd acc rstd", d_rstd.get(), want_rstd, 1);

    /* backward without w (dw untouched), in place: dx = dy, overwritten; then accumulated */
    for (int acc = 0; acc < 2; acc++) {
        want = dy;
        ref_rmsnorm_bwd(want.data(), nullptr, want.data(), x.data(), nullptr, N, C, eps,
                        want_rstd.data(), acc != 0);
        d_dx.put(dy);
        d_rstd.poison();
        d_dw.put(dw0);
        CUDA_OK(kiln_cuda_rmsnorm_backward(0, d_dx.p, d_dw.p, d_dx.p, d_x.p, nullptr, N, C, eps,
                                           d_rstd.p, acc != 0));
        bad += compare(acc ? "bwd no w in place acc dx" : "bwd no w in place dx", d_dx.get(),
                       want, C);
        bad += compare("bwd no w dw untouched", d_dw.get(), dw0, C);
        bad += compare("bwd no w rstd", d_rstd.get(), want_rstd, 1);
    }
    CUDA_OK(cudaDeviceSynchronize());
    printf("check N=%d C=%d: %zu mismatching elements %s\n", N, C, bad, bad ? "FAIL" : "OK");
    if (bad) g_failed++;
}

/* ---- one shape: timings ------------------------------------------------------------------- */

static void time_shape(int N, int C, float eps, int reps) {
    const size_t NC = (size_t)N * C;
    std::vector<float> x(NC), w(C), dy(NC);
    fill_rows(x, N, C);
    fill_rand(w, 1.5f);
    fill_rand(dy, 1.0f);
    dbuf d_x(NC), d_w(C), d_dy(NC), d_out(NC), d_dx(NC), d_dw(C), d_rstd(N);
    d_x.put(x);
    d_w.put(w);
    d_dy.put(dy);
    CUDA_OK(cudaMemset(d_dw.p, 0, C * sizeof(float)));
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    float us[3];
    for (int which = 0; which < 3; which++) {
        for (int rep = -1; rep < reps; rep++) { /* rep -1: the warm-up call */
            if (rep == 0) CUDA_OK(cudaEventRecord(e0, 0));
            if (which == 0)
                CUDA_OK(kiln_cuda_rmsnorm(0, d_out.p, d_x.p, d_w.p, N, C, eps));
            else
                CUDA_OK(kiln_cuda_rmsnorm_backward(0, d_dx.p, which == 1 ? d_dw.p : nullptr,
                                                   d_dy.p, d_x.p, d_w.p, N, C, eps, d_rstd.p,
                                                   false));
        }
        CUDA_OK(cudaEventRecord(e1, 0));
        CUDA_OK(cudaEventSynchronize(e1));
        float ms = 0;
        CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
        us[which] = ms * 1000.0f / (float)reps;
    }
    CUDA_OK(cudaEventDestroy(e0));
    CUDA_OK(cudaEventDestroy(e1));
    const double mb = (double)NC * sizeof(float) / 1e6; /* MB per us = 1000 GB/s */
    printf("time N=%d C=%d: fwd %.2f us (%.0f GB/s)  bwd+dw %.2f us (%.0f GB/s)  bwd rows %.2f "
           "us (%.0f GB/s)  dw alone ~%.2f us\n",
           N, C, us[0], 2 * mb / us[0] * 1e3, us[1], 3 * mb / us[1] * 1e3, us[2],
           3 * mb / us[2] * 1e3,
           us[1] - us[2]);
}

int main(int argc, char **argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 50;
    if (reps <= 0) {
        fprintf(stderr, "usage: bench_cuda_rmsnorm [reps > 0]\n");
        return 1;
    }
    const float eps = 1e-5f;
    check_reference_f64();
    kiln_backend *cpu = nullptr;
    if (kiln_backend_cpu_create(2, &cpu) != KILN_OK) {
        printf("cannot create the CPU backend\nFAILED 1\n");
        return 1;
    }
    static const int ref_shapes[][2] = {{1, 1}, {5, 17}, {37, 1000}, {70, 64}, {3, 2100}};
    for (const auto &s : ref_shapes) check_reference_cpu(cpu, s[0], s[1], 1e-5f);
    kiln_backend_free(cpu);
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("no CUDA device: skipped (host reference checked: %s)\n",
               g_failed ? "FAILED" : "OK");
        return g_failed ? 1 : 77;
    }
    /* the timed shapes (SmolLM2-135M, Qwen2.5-0.5B, a wide model, a per-head norm), then odd
     * shapes: C % 16 != 0 tails, per_lane 2 / 63 / 65 / 132 (cached, chunked backward, cached
     * and chunked forward), dw widths picking column blocks of 8, 16 and 32 */
    static const int timed[][2] = {{2048, 576}, {2048, 896}, {4096, 2048}, {2048 * 9, 64}};
    static const int odd[][2] = {{1, 1},    {5, 17},     {37, 1000}, {33, 1030},
                                 {7, 2100}, {300, 4100}, {19, 2049}, {1000, 24}};
    for (const auto &s : timed) check_shape(s[0], s[1], eps);
    for (const auto &s : odd) check_shape(s[0], s[1], eps);
    for (const auto &s : timed) time_shape(s[0], s[1], eps, reps);
    if (g_failed) printf("FAILED %d\n", g_failed);
    else printf("ALL OK\n");
    return g_failed ? 1 : 0;
}
