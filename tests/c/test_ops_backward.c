/*
 * test_ops_backward.c -- the CPU backend's backward ops (training) against
 *   (a) finite differences: L = sum(out * Rw) for a random Rw, central differences in float64
 *       of a float64 forward written here, vs the backend's f32 gradients (bound FD_TOL,
 *       relative to the largest gradient of the tensor);
 *   (b) a float64 analytic gradient written here (bound AN_TOL, same norm);
 *   (c) this file's own transcription of docs/ARITHMETIC.md "Backward ops": bit-exact;
 *   (d) every SIMD path the CPU has x 1, 2, 3 threads: bit-identical, outputs poisoned with
 *       NaN before every run (accumulated outputs start from the same random values).
 * Shapes are small and odd (N = 1, C not a multiple of 16, GQA groups, n_past > 0, more
 * than one key block), plus larger ones that cross the GEMM's tiles and k chunks. Last, a
 * timing of matmul_backward at SmolLM2-135M shapes (printed, not asserted).
 */
#include "base/cpu_features.h"
#include "base/kmath.h"
#include "base/tensor.h"
#include "ops/cpu/cpu_kernels.h"
#include "ops/ops.h"
#include "test_util.h"

#include <math.h>
#include <time.h>

#define FD_TOL 1e-4 /* f32 analytic gradient vs float64 central differences */
#define AN_TOL 2e-5 /* f32 analytic gradient vs float64 analytic gradient */
#define FD_H 1e-6

/* ---- helpers ------------------------------------------------------------------------- */

static uint64_t g_rng = 0x243f6a8885a308d3ull;
static uint64_t rnd_u64(void) {
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return g_rng * 2685821657736338717ull;
}
static float rnd_f(float lo, float hi) {
    return lo + (hi - lo) * (float)((rnd_u64() >> 40) / 16777216.0);
}
static float *rnd_vec(size_t n, float lo, float hi) {
    float *v = malloc((n ? n : 1) * sizeof *v);
    for (size_t i = 0; i < n; i++) v[i] = rnd_f(lo, hi);
    return v;
}
static float *dup_vec(const float *a, size_t n) {
    float *v = malloc((n ? n : 1) * sizeof *v);
    memcpy(v, a, n * sizeof *v);
    return v;
}
static double *to_d(const float *a, size_t n) {
    double *v = malloc((n ? n : 1) * sizeof *v);
    for (size_t i = 0; i < n; i++) v[i] = a[i];
    return v;
}

/* max |got - want| / max(max |want|, 1e-30): the error relative to the tensor's scale. */
static double rel_err(const float *got, const float *base, const double *want, size_t n) {
    double e = 0, m = 1e-30;
    for (size_t i = 0; i < n; i++) {
        double g = base ? (double)got[i] - (double)base[i] : (double)got[i];
        if (!(fabs(g - want[i]) <= e)) e = fabs(g - want[i]); /* NaN sticks */
        if (fabs(want[i]) > m) m = fabs(want[i]);
    }
    return e / m;
}

/* Central differences of loss(ctx) w.r.t. p[0..n) into fd (every element, or `limit`
 * elements spread over the tensor when n is larger). Returns how many were computed; fd
 * entries not computed are NaN and skipped by fd_err. */
typedef double (*loss_fn)(void *ctx);
static void fd_grad(double *p, size_t n, loss_fn loss, void *ctx, double *fd, size_t limit) {
    size_t step = n > limit ? n / limit : 1;
    for (size_t i = 0; i < n; i++) fd[i] = NAN;
    for (size_t i = 0; i < n; i += step) {
        double keep = p[i];
        p[i] = keep + FD_H;
        double lp = loss(ctx);
        p[i] = keep - FD_H;
        double lm = loss(ctx);
        p[i] = keep;
        fd[i] = (lp - lm) / (2 * FD_H);
    }
}
static double fd_err(const float *got, const float *base, const double *fd, size_t n) {
    double e = 0, m = 1e-30;
    for (size_t i = 0; i < n; i++) {
        if (isnan(fd[i])) continue;
        double g = base ? (double)got[i] - (double)base[i] : (double)got[i];
        if (!(fabs(g - fd[i]) <= e)) e = fabs(g - fd[i]);
        if (fabs(fd[i]) > m) m = fabs(fd[i]);
    }
    return e / m;
}

/* The backends under test: every supported path x {1, 2, 3} threads. */
#define MAX_BE 9
static kiln_backend *g_be[MAX_BE];
static char g_be_name[MAX_BE][32];
static int g_n_be;

static void make_backends(void) {
    const kiln_cpu_path paths[] = {KILN_CPU_PATH_PORTABLE, KILN_CPU_PATH_AVX2,
                                   KILN_CPU_PATH_AVX512};
    for (int p = 0; p < 3; p++) {
        if (!kiln_cpu_path_supported(paths[p])) {
            printf("path %s: not supported by this CPU, skipped\n", kiln_cpu_path_name(paths[p]));
            continue;
        }
        setenv("KILN_CPU_PATH", kiln_cpu_path_name(paths[p]), 1);
        for (int nt = 1; nt <= 3; nt++) {
            kiln_backend *be = NULL;
            CHECK(kiln_backend_cpu_create(nt, &be) == KILN_OK);
            if (!be) continue;
            CHECK(kiln_backend_cpu_path(be) == paths[p]);
            snprintf(g_be_name[g_n_be], sizeof g_be_name[0], "%s/%dt",
                     kiln_cpu_path_name(paths[p]), nt);
            g_be[g_n_be++] = be;
        }
    }
    unsetenv("KILN_CPU_PATH");
}

/* The defined dot over strided operands: lane i % 16, fmaf in increasing i, the tree. */
static float def_dot_s(const float *a, int64_t sa, const float *b, int64_t sb, int64_t n) {
    float lane[16];
    for (int j = 0; j < 16; j++) {
        lane[j] = 0.0f;
        for (int64_t i = j; i < n; i += 16) lane[j] = fmaf(a[i * sa], b[i * sb], lane[j]);
    }
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) lane[j] = lane[j] + lane[j + w];
    return lane[0];
}
static float def_dot(const float *a, const float *b, int64_t n) { return def_dot_s(a, 1, b, 1, n); }

/* ---- matmul ---------------------------------------------------------------------------- */

typedef struct mm_ctx {
    double *x, *w, *b, *Rw;
    int N, R, C;
} mm_ctx;

static double mm_loss(void *p) {
    mm_ctx *c = p;
    double L = 0;
    for (int n = 0; n < c->N; n++)
        for (int r = 0; r < c->R; r++) {
            double s = c->b[r];
            for (int k = 0; k < c->C; k++) s += c->x[n * c->C + k] * c->w[r * c->C + k];
            L += s * c->Rw[n * c->R + r];
        }
    return L;
}

static void test_matmul_case(int N, int R, int C, kiln_dtype dt, int fd, int accumulate) {
    size_t nx = (size_t)N * C, nw = (size_t)R * C, ny = (size_t)N * R;
    float *x = rnd_vec(nx, -1, 1), *wf = rnd_vec(nw, -1, 1), *dy = rnd_vec(ny, -1, 1);
    float *b = rnd_vec((size_t)R, -1, 1);
    uint16_t *wh = malloc(nw * 2);
    for (size_t i = 0; i < nw; i++) {
        if (dt == KILN_DTYPE_BF16) wh[i] = kiln_fp32_to_bf16(wf[i]), wf[i] = kiln_bf16_to_fp32(wh[i]);
        if (dt == KILN_DTYPE_F16) wh[i] = kiln_fp32_to_fp16(wf[i]), wf[i] = kiln_fp16_to_fp32(wh[i]);
    }
    kiln_tensor W = {"w", dt, 2, {R, C, 1, 1}, dt == KILN_DTYPE_F32 ? (void *)wf : (void *)wh,
                     nw * (dt == KILN_DTYPE_F32 ? 4 : 2)};
    /* accumulated outputs start from these */
    float *dx0 = rnd_vec(nx, -0.5f, 0.5f), *dW0 = rnd_vec(nw, -0.5f, 0.5f);
    float *db0 = rnd_vec((size_t)R, -0.5f, 0.5f);

    /* (c) the transcription */
    float *tdx = malloc(nx * 4), *tdW = malloc(nw * 4), *tdb = malloc((size_t)R * 4);
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) {
            float v = def_dot_s(dy + (size_t)n * R, 1, wf + c, C, R);
            tdx[(size_t)n * C + c] = accumulate ? dx0[(size_t)n * C + c] + v : v;
        }
    for (int r = 0; r < R; r++) {
        for (int c = 0; c < C; c++)
            tdW[(size_t)r * C + c] = dW0[(size_t)r * C + c] + def_dot_s(dy + r, R, x + c, C, N);
        float one = 1.0f;
        tdb[r] = db0[r] + def_dot_s(dy + r, R, &one, 0, N);
    }
    /* (b) float64 analytic */
    double *adx = calloc(nx, 8), *adW = calloc(nw, 8), *adb = calloc((size_t)R, 8);
    for (int n = 0; n < N; n++)
        for (int r = 0; r < R; r++) {
            double g = dy[(size_t)n * R + r];
            adb[r] += g;
            for (int c = 0; c < C; c++) {
                adx[(size_t)n * C + c] += g * wf[(size_t)r * C + c];
                adW[(size_t)r * C + c] += g * x[(size_t)n * C + c];
            }
        }
    CHECK_MSG(rel_err(tdx, accumulate ? dx0 : NULL, adx, nx) < AN_TOL, "mm dx vs f64");
    CHECK_MSG(rel_err(tdW, dW0, adW, nw) < AN_TOL, "mm dW vs f64");
    CHECK_MSG(rel_err(tdb, db0, adb, (size_t)R) < AN_TOL, "mm dbias vs f64");
    /* (a) finite differences */
    if (fd) {
        mm_ctx m = {to_d(x, nx), to_d(wf, nw), to_d(b, (size_t)R), to_d(dy, ny), N, R, C};
        double *g = malloc((nx + nw + (size_t)R) * 8);
        fd_grad(m.x, nx, mm_loss, &m, g, 400);
        double e1 = fd_err(tdx, accumulate ? dx0 : NULL, g, nx);
        fd_grad(m.w, nw, mm_loss, &m, g, 400);
        double e2 = fd_err(tdW, dW0, g, nw);
        fd_grad(m.b, (size_t)R, mm_loss, &m, g, 400);
        double e3 = fd_err(tdb, db0, g, (size_t)R);
        CHECK_MSG(e1 < FD_TOL && e2 < FD_TOL && e3 < FD_TOL,
                  "mm FD N=%d R=%d C=%d: dx %g dW %g db %g", N, R, C, e1, e2, e3);
        free(m.x), free(m.w), free(m.b), free(m.Rw), free(g);
    }
    /* (d) every backend */
    float *dx = malloc(nx * 4), *dW = malloc(nw * 4), *db = malloc((size_t)R * 4);
    for (int i = 0; i < g_n_be; i++) {
        kiln_backend *be = g_be[i];
        CHECK(be->i->supports_op(be, KILN_OP_MATMUL_BACKWARD, dt));
        if (accumulate) memcpy(dx, dx0, nx * 4);
        else poison(dx, nx);
        memcpy(dW, dW0, nw * 4), memcpy(db, db0, (size_t)R * 4);
        be->i->matmul_backward(be, dx, dW, db, dy, x, &W, N, accumulate != 0);
        CHECK_MSG(same_bits(dx, tdx, nx, "dx") && same_bits(dW, tdW, nw, "dW") &&
                      same_bits(db, tdb, (size_t)R, "dbias"),
                  "%s: matmul_backward %s N=%d R=%d C=%d acc=%d", g_be_name[i],
                  kiln_dtype_name(dt), N, R, C, accumulate);
        /* optional outputs: dx only; dW only */
        poison(dx, nx);
        be->i->matmul_backward(be, dx, NULL, NULL, dy, x, &W, N, false);
        int ok = 1;
        for (int n = 0; n < N; n++)
            for (int c = 0; c < C; c++)
                ok &= bits(dx[(size_t)n * C + c]) ==
                      bits(def_dot_s(dy + (size_t)n * R, 1, wf + c, C, R));
        memcpy(dW, dW0, nw * 4);
        be->i->matmul_backward(be, NULL, dW, NULL, dy, x, &W, N, false);
        ok &= same_bits(dW, tdW, nw, "dW alone");
        CHECK_MSG(ok, "%s: matmul_backward optional outputs N=%d R=%d C=%d", g_be_name[i], N, R, C);
    }
    free(x), free(wf), free(dy), free(b), free(wh), free(dx0), free(dW0), free(db0);
    free(tdx), free(tdW), free(tdb), free(adx), free(adW), free(adb), free(dx), free(dW), free(db);
}

static void test_matmul_backward(void) {
    /* N, R, C */
    test_matmul_case(1, 3, 5, KILN_DTYPE_F32, 1, 0);
    test_matmul_case(7, 17, 33, KILN_DTYPE_F32, 1, 1);
    test_matmul_case(13, 50, 32, KILN_DTYPE_F32, 1, 0);
    test_matmul_case(20, 37, 40, KILN_DTYPE_BF16, 1, 1);
    test_matmul_case(9, 21, 48, KILN_DTYPE_F16, 1, 0);
    /* crosses the 6-row tiles, 48-row blocks and the 16-column tail */
    test_matmul_case(70, 300, 80, KILN_DTYPE_F32, 0, 1);
    /* K past one 512-k chunk (BWD_KC) for both products: R for dx, N for dW */
    test_matmul_case(540, 530, 24, KILN_DTYPE_F32, 0, 1);
    test_matmul_case(100, 64, 35, KILN_DTYPE_BF16, 0, 0);
    test_matmul_case(290, 19, 64, KILN_DTYPE_F32, 0, 0);
    kiln_backend *be = g_be[0];
    CHECK(!be->i->supports_op(be, KILN_OP_MATMUL_BACKWARD, KILN_DTYPE_Q4_0));
    CHECK(be->i->supports_op(be, KILN_OP_ATTENTION_BACKWARD, KILN_DTYPE_F32));
}

/* ---- rmsnorm --------------------------------------------------------------------------- */

typedef struct rms_ctx {
    double *x, *w, *Rw;
    int N, C;
    double eps;
} rms_ctx;

static double rms_loss(void *p) {
    rms_ctx *c = p;
    double L = 0;
    for (int n = 0; n < c->N; n++) {
        const double *x = c->x + (size_t)n * c->C;
        double ss = 0;
        for (int k = 0; k < c->C; k++) ss += x[k] * x[k];
        double r = 1 / sqrt(ss / c->C + c->eps);
        for (int k = 0; k < c->C; k++)
            L += x[k] * r * (c->w ? c->w[k] : 1.0) * c->Rw[(size_t)n * c->C + k];
    }
    return L;
}

static void test_rmsnorm_case(int N, int C, int with_w, int accumulate) {
    const float eps = 1e-5f;
    size_t nx = (size_t)N * C;
    float *x = rnd_vec(nx, -1, 1), *dy = rnd_vec(nx, -1, 1), *w = rnd_vec((size_t)C, 0.5f, 1.5f);
    float *dx0 = rnd_vec(nx, -0.5f, 0.5f), *dw0 = rnd_vec((size_t)C, -0.5f, 0.5f);
    const float *wp = with_w ? w : NULL;
    /* (c) transcription */
    float *tdx = malloc(nx * 4), *tdw = dup_vec(dw0, (size_t)C), *rs = malloc((size_t)N * 4);
    for (int n = 0; n < N; n++) {
        const float *xr = x + (size_t)n * C, *dr = dy + (size_t)n * C;
        float r = kiln_rms_scale(def_dot(xr, xr, C), C, eps);
        rs[n] = r;
        float *g = malloc((size_t)C * 4);
        for (int c = 0; c < C; c++) g[c] = wp ? dr[c] * wp[c] : dr[c];
        float u = ((def_dot(g, xr, C) / (float)C) * r) * r;
        for (int c = 0; c < C; c++) {
            float v = (g[c] - xr[c] * u) * r;
            tdx[(size_t)n * C + c] = accumulate ? dx0[(size_t)n * C + c] + v : v;
        }
        free(g);
    }
    if (wp)
        for (int c = 0; c < C; c++) {
            float lane[16] = {0};
            for (int n = 0; n < N; n++)
                lane[n % 16] = fmaf(dy[(size_t)n * C + c], x[(size_t)n * C + c] * rs[n], lane[n % 16]);
            tdw[c] = tdw[c] + kiln_lane16_reduce(lane);
        }
    /* (b) float64 analytic: dx = r (g - x r^2 (g.x)/C), dw = sum dy x r */
    double *adx = calloc(nx, 8), *adw = calloc((size_t)C, 8);
    for (int n = 0; n < N; n++) {
        const float *xr = x + (size_t)n * C, *dr = dy + (size_t)n * C;
        double ss = 0, gx = 0;
        for (int c = 0; c < C; c++) ss += (double)xr[c] * xr[c];
        double r = 1 / sqrt(ss / C + (double)eps);
        for (int c = 0; c < C; c++) gx += (double)dr[c] * (wp ? wp[c] : 1.0) * xr[c];
        for (int c = 0; c < C; c++) {
            adx[(size_t)n * C + c] = r * ((double)dr[c] * (wp ? wp[c] : 1.0) - xr[c] * r * r * gx / C);
            adw[c] += (double)dr[c] * xr[c] * r;
        }
    }
    CHECK_MSG(rel_err(tdx, accumulate ? dx0 : NULL, adx, nx) < AN_TOL, "rms dx vs f64 N=%d C=%d", N, C);
    if (wp) CHECK_MSG(rel_err(tdw, dw0, adw, (size_t)C) < AN_TOL, "rms dw vs f64 N=%d C=%d", N, C);
    /* (a) FD */
    {
        rms_ctx m = {to_d(x, nx), wp ? to_d(w, (size_t)C) : NULL, to_d(dy, nx), N, C, eps};
        double *g = malloc((nx + (size_t)C) * 8);
        fd_grad(m.x, nx, rms_loss, &m, g, 500);
        double e1 = fd_err(tdx, accumulate ? dx0 : NULL, g, nx), e2 = 0;
        if (wp) {
            fd_grad(m.w, (size_t)C, rms_loss, &m, g, 500);
            e2 = fd_err(tdw, dw0, g, (size_t)C);
        }
        CHECK_MSG(e1 < FD_TOL && e2 < FD_TOL, "rms FD N=%d C=%d: dx %g dw %g", N, C, e1, e2);
        free(m.x), free(m.w), free(m.Rw), free(g);
    }
    /* (d) backends */
    float *dx = malloc(nx * 4), *dw = malloc((size_t)C * 4), *rstd = malloc((size_t)N * 4);
    for (int i = 0; i < g_n_be; i++) {
        kiln_backend *be = g_be[i];
        if (accumulate) memcpy(dx, dx0, nx * 4);
        else poison(dx, nx);
        memcpy(dw, dw0, (size_t)C * 4);
        poison(rstd, (size_t)N);
        be->i->rmsnorm_backward(be, dx, dw, dy, x, wp, N, C, eps, rstd, accumulate != 0);
        CHECK_MSG(same_bits(dx, tdx, nx, "dx") && same_bits(dw, tdw, (size_t)C, "dw") &&
                      same_bits(rstd, rs, (size_t)N, "rstd"),
                  "%s: rmsnorm_backward N=%d C=%d w=%d acc=%d", g_be_name[i], N, C, with_w,
                  accumulate);
    }
    free(x), free(dy), free(w), free(dx0), free(dw0), free(tdx), free(tdw), free(rs);
    free(adx), free(adw), free(dx), free(dw), free(rstd);
}

static void test_rmsnorm_backward(void) {
    test_rmsnorm_case(1, 7, 1, 0);
    test_rmsnorm_case(5, 33, 1, 1);
    test_rmsnorm_case(9, 16, 0, 0);
    test_rmsnorm_case(19, 100, 1, 0);  /* more than 16 rows: every lane of dw */
    test_rmsnorm_case(40, 1100, 1, 1); /* C past the 1024 chunk, slices of 64 columns */
}

/* A row whose d = dot(g, x) is exactly -0: x = 1e-30, g = -1e-30 in the first 16 elements
 * (products below the subnormals: every lane becomes -0) and -0 after (fmaf(-0, x, -0) keeps
 * -0). Then u = -0 and dx = (-0 - x * -0) * r = +0 past the 16th element; a SIMD tail that
 * turns the lanes past C (or past a 1024-element chunk's end) from -0 into +0 gives d = +0
 * and dx = -0 there. Compared bit for bit with the transcription, w absent and w = 1. */
static void test_rmsnorm_backward_signed_zero(void) {
    const int Cs[] = {23, 40, 1030}, N = 2;
    const float eps = 1e-5f;
    for (int ci = 0; ci < 3; ci++)
        for (int with_w = 0; with_w < 2; with_w++) {
            const int C = Cs[ci];
            const size_t nx = (size_t)N * C;
            float *x = malloc(nx * 4), *dy = malloc(nx * 4), *w = malloc((size_t)C * 4);
            float *tdx = malloc(nx * 4), *tdw = calloc((size_t)C, 4), *rs = malloc((size_t)N * 4);
            float *g = malloc((size_t)C * 4);
            for (size_t i = 0; i < nx; i++)
                x[i] = 1e-30f, dy[i] = i % (size_t)C < 16 ? -1e-30f : -0.0f;
            for (int c = 0; c < C; c++) w[c] = 1.0f;
            const float *wp = with_w ? w : NULL;
            for (int n = 0; n < N; n++) {
                const float *xr = x + (size_t)n * C, *dr = dy + (size_t)n * C;
                float r = kiln_rms_scale(def_dot(xr, xr, C), C, eps);
                rs[n] = r;
                for (int c = 0; c < C; c++) g[c] = wp ? dr[c] * wp[c] : dr[c];
                float d = def_dot(g, xr, C), u = ((d / (float)C) * r) * r;
                CHECK(bits(d) == 0x80000000u);
                for (int c = 0; c < C; c++) tdx[(size_t)n * C + c] = (g[c] - xr[c] * u) * r;
                CHECK(bits(tdx[(size_t)n * C + C - 1]) == 0);
            }
            if (wp)
                for (int c = 0; c < C; c++) {
                    float lane[16] = {0};
                    for (int n = 0; n < N; n++)
                        lane[n % 16] = fmaf(dy[(size_t)n * C + c], x[(size_t)n * C + c] * rs[n],
                                            lane[n % 16]);
                    tdw[c] = tdw[c] + kiln_lane16_reduce(lane);
                }
            float *dx = malloc(nx * 4), *dw = malloc((size_t)C * 4), *rstd = malloc((size_t)N * 4);
            for (int i = 0; i < g_n_be; i++) {
                kiln_backend *be = g_be[i];
                poison(dx, nx);
                memset(dw, 0, (size_t)C * 4);
                poison(rstd, (size_t)N);
                be->i->rmsnorm_backward(be, dx, dw, dy, x, wp, N, C, eps, rstd, false);
                CHECK_MSG(same_bits(dx, tdx, nx, "dx") && same_bits(dw, tdw, (size_t)C, "dw") &&
                              same_bits(rstd, rs, (size_t)N, "rstd"),
                          "%s: rmsnorm_backward -0 N=%d C=%d w=%d", g_be_name[i], N, C, with_w);
            }
            free(x), free(dy), free(w), free(tdx), free(tdw), free(rs), free(g);
            free(dx), free(dw), free(rstd);
        }
}

/* ---- rope ------------------------------------------------------------------------------ */

static void test_rope_backward(void) {
    const int shapes[][3] = {{1, 1, 2}, {3, 2, 6}, {5, 3, 16}, {40, 4, 10}};
    for (int s = 0; s < 4; s++) {
        int N = shapes[s][0], H = shapes[s][1], HS = shapes[s][2], half = HS / 2, P = 7;
        size_t n = (size_t)N * H * HS;
        float *ct = rnd_vec((size_t)P * half, -1, 1), *st = rnd_vec((size_t)P * half, -1, 1);
        int32_t *pos = malloc((size_t)N * 4);
        for (int i = 0; i < N; i++) pos[i] = (int32_t)(rnd_u64() % P);
        float *dy = rnd_vec(n, -1, 1), *t = malloc(n * 4), *d = malloc(n * 4);
        double *an = malloc(n * 8);
        /* out = rope(x) is linear: dL/dx[i] = Rw[i]*c + Rw[i+half]*s, and
         * dL/dx[i+half] = -Rw[i]*s + Rw[i+half]*c: the transcription and float64 */
        for (int tok = 0; tok < N; tok++)
            for (int h = 0; h < H; h++)
                for (int i = 0; i < half; i++) {
                    size_t o = ((size_t)tok * H + h) * HS;
                    float c = ct[pos[tok] * half + i], sn = st[pos[tok] * half + i];
                    float a = dy[o + i], b = dy[o + i + half];
                    t[o + i] = a * c + b * sn;
                    t[o + i + half] = b * c - a * sn;
                    an[o + i] = (double)a * c + (double)b * sn;
                    an[o + i + half] = (double)b * c - (double)a * sn;
                }
        CHECK(rel_err(t, NULL, an, n) < AN_TOL);
        /* FD through the backend's own forward (linear: differences are exact up to f32) */
        for (int i = 0; i < g_n_be; i++) {
            kiln_backend *be = g_be[i];
            memcpy(d, dy, n * 4);
            be->i->rope_backward(be, d, pos, N, H, HS, ct, st);
            CHECK_MSG(same_bits(d, t, n, "rope_backward"), "%s: rope_backward N=%d H=%d HS=%d",
                      g_be_name[i], N, H, HS);
        }
        /* <rope(x), y> == <x, rope_backward(y)> in float64 (the adjoint property) */
        float *x = rnd_vec(n, -1, 1), *rx = dup_vec(x, n);
        g_be[0]->i->rope(g_be[0], rx, pos, N, H, HS, ct, st);
        double l1 = 0, l2 = 0;
        for (size_t i = 0; i < n; i++) l1 += (double)rx[i] * dy[i], l2 += (double)x[i] * t[i];
        CHECK_MSG(fabs(l1 - l2) <= 1e-5 * (fabs(l1) + 1), "rope adjoint %g vs %g", l1, l2);
        free(ct), free(st), free(pos), free(dy), free(t), free(d), free(an), free(x), free(rx);
    }
}

/* ---- attention ------------------------------------------------------------------------- */

typedef struct att_ctx {
    double *q, *k, *v, *Rw;
    int N, n_past, NH, KVH, HS;
    double scale;
    int window; /* > 0: a sliding window (ops.h attention) */
} att_ctx;

/* float64 forward; with grads != NULL also the analytic gradients (dq, dk, dv). */
static double att_run(att_ctx *c, double *dq, double *dk, double *dv) {
    int N = c->N, NH = c->NH, KVH = c->KVH, HS = c->HS, T = c->n_past + N;
    double L = 0;
    double *p = malloc((size_t)T * 8), *dp = malloc((size_t)T * 8);
    for (int i = 0; i < N; i++)
        for (int h = 0; h < NH; h++) {
            int g = h / (NH / KVH), nk = c->n_past + i + 1;
            const int lo = c->window > 0 && nk > c->window ? nk - c->window : 0;
            const double *q = c->q + ((size_t)i * NH + h) * HS, *R = c->Rw + ((size_t)i * NH + h) * HS;
            double m = -INFINITY, l = 0;
            for (int j = 0; j < lo; j++) p[j] = 0, dp[j] = 0; /* outside the window */
            for (int j = lo; j < nk; j++) {
                double s = 0;
                for (int d = 0; d < HS; d++) s += q[d] * c->k[((size_t)j * KVH + g) * HS + d];
                p[j] = s * c->scale;
                if (p[j] > m) m = p[j];
            }
            for (int j = lo; j < nk; j++) p[j] = exp(p[j] - m), l += p[j];
            double D = 0;
            for (int j = lo; j < nk; j++) {
                p[j] /= l;
                const double *vj = c->v + ((size_t)j * KVH + g) * HS;
                dp[j] = 0;
                for (int d = 0; d < HS; d++) L += p[j] * vj[d] * R[d], dp[j] += R[d] * vj[d];
                D += p[j] * dp[j];
            }
            if (!dq) continue;
            for (int j = lo; j < nk; j++) {
                double ds = p[j] * (dp[j] - D) * c->scale;
                const double *kj = c->k + ((size_t)j * KVH + g) * HS;
                for (int d = 0; d < HS; d++) {
                    dq[((size_t)i * NH + h) * HS + d] += ds * kj[d];
                    dk[((size_t)j * KVH + g) * HS + d] += ds * q[d];
                    dv[((size_t)j * KVH + g) * HS + d] += p[j] * R[d];
                }
            }
        }
    free(p), free(dp);
    return L;
}
static double att_loss(void *p) { return att_run(p, NULL, NULL, NULL); }

/* The transcription of docs/ARITHMETIC.md "attention backward". */
static void def_attention_backward(float *dq, float *dk, float *dv, const float *dout,
                                   const float *q, const float *k, const float *v,
                                   const float *out, int N, int n_past, int NH, int KVH, int HS,
                                   float scale, int window) {
    int G = NH / KVH, T = n_past + N;
#define LO_(nk) (window > 0 && (nk) > window ? (nk) - window : 0) /* the window's first key */
    float *m = malloc((size_t)N * NH * 4), *l = malloc((size_t)N * NH * 4);
    float *D = malloc((size_t)N * NH * 4);
    for (int i = 0; i < N; i++)
        for (int h = 0; h < NH; h++) {
            size_t u = (size_t)i * NH + h;
            int nk = n_past + i + 1, g = h / G;
            float mm = -INFINITY, ll = 0;
            for (int kb0 = LO_(nk) / 64 * 64; kb0 < nk; kb0 += 64) { /* blocks aligned at 64 */
                int kb = kb0 > LO_(nk) ? kb0 : LO_(nk), e = kb0 + 64 < nk ? kb0 + 64 : nk;
                float s[64], bm = -INFINITY;
                for (int j = kb; j < e; j++) {
                    s[j - kb] = def_dot(q + u * HS, k + ((size_t)j * KVH + g) * HS, HS) * scale;
                    bm = s[j - kb] > bm ? s[j - kb] : bm;
                }
                float mn = bm > mm ? bm : mm, alpha = kiln_expf(mm - mn);
                ll = ll * alpha;
                for (int j = kb; j < e; j++) ll = ll + kiln_expf(s[j - kb] - mn);
                mm = mn;
            }
            m[u] = mm, l[u] = ll, D[u] = def_dot(dout + u * HS, out + u * HS, HS);
        }
#define P_(i, h, j, g) (kiln_expf(def_dot(q + ((size_t)(i) * NH + (h)) * HS, \
                                          k + ((size_t)(j) * KVH + (g)) * HS, HS) * scale - \
                                  m[(size_t)(i) * NH + (h)]) / l[(size_t)(i) * NH + (h)])
#define DS_(i, h, j, g, p) ((p) * (def_dot(dout + ((size_t)(i) * NH + (h)) * HS, \
                                           v + ((size_t)(j) * KVH + (g)) * HS, HS) - \
                                   D[(size_t)(i) * NH + (h)]))
    for (int i = 0; i < N; i++)
        for (int h = 0; h < NH; h++) {
            float *o = dq + ((size_t)i * NH + h) * HS;
            for (int d = 0; d < HS; d++) o[d] = 0;
            for (int j = LO_(n_past + i + 1); j < n_past + i + 1; j++) {
                float p = P_(i, h, j, h / G), ds = DS_(i, h, j, h / G, p);
                for (int d = 0; d < HS; d++) o[d] = fmaf(ds, k[((size_t)j * KVH + h / G) * HS + d], o[d]);
            }
            for (int d = 0; d < HS; d++) o[d] = o[d] * scale;
        }
    for (int j = 0; j < T; j++)
        for (int g = 0; g < KVH; g++) {
            float *ok = dk + ((size_t)j * KVH + g) * HS, *ov = dv + ((size_t)j * KVH + g) * HS;
            for (int d = 0; d < HS; d++) ok[d] = 0, ov[d] = 0;
            for (int h = g * G; h < (g + 1) * G; h++)
                for (int i = j - n_past > 0 ? j - n_past : 0; i < N && (window <= 0 || n_past + i < j + window); i++) {
                    float p = P_(i, h, j, g), ds = DS_(i, h, j, g, p);
                    const float *qi = q + ((size_t)i * NH + h) * HS, *di = dout + ((size_t)i * NH + h) * HS;
                    for (int d = 0; d < HS; d++) ov[d] = fmaf(p, di[d], ov[d]);
                    for (int d = 0; d < HS; d++) ok[d] = fmaf(ds, qi[d], ok[d]);
                }
            for (int d = 0; d < HS; d++) ok[d] = ok[d] * scale;
        }
#undef P_
#undef DS_
#undef LO_
    free(m), free(l), free(D);
}

static void test_attention_case(int N, int n_past, int NH, int KVH, int HS, float amp, int fd, int window) {
    int T = n_past + N;
    size_t nq = (size_t)N * NH * HS, nkv = (size_t)T * KVH * HS;
    float scale = 1.0f / sqrtf((float)HS);
    float *q = rnd_vec(nq, -amp, amp), *k = rnd_vec(nkv, -amp, amp), *v = rnd_vec(nkv, -1, 1);
    float *dout = rnd_vec(nq, -1, 1), *out = malloc(nq * 4);
    g_be[0]->i->attention(g_be[0], out, q, k, v, N, n_past, NH, KVH, HS, scale, window);
    float *tq = malloc(nq * 4), *tk = malloc(nkv * 4), *tv = malloc(nkv * 4);
    def_attention_backward(tq, tk, tv, dout, q, k, v, out, N, n_past, NH, KVH, HS, scale, window);
    att_ctx c = {to_d(q, nq), to_d(k, nkv), to_d(v, nkv), to_d(dout, nq), N, n_past, NH, KVH, HS, scale, window};
    double *aq = calloc(nq, 8), *ak = calloc(nkv, 8), *av = calloc(nkv, 8);
    att_run(&c, aq, ak, av);
    double e1 = rel_err(tq, NULL, aq, nq), e2 = rel_err(tk, NULL, ak, nkv), e3 = rel_err(tv, NULL, av, nkv);
    CHECK_MSG(e1 < AN_TOL && e2 < AN_TOL && e3 < AN_TOL,
              "attention vs f64 N=%d n_past=%d NH=%d KVH=%d HS=%d window=%d: dq %g dk %g dv %g", N,
              n_past, NH, KVH, HS, window, e1, e2, e3);
    if (fd) {
        double *g = malloc((nq > nkv ? nq : nkv) * 8);
        fd_grad(c.q, nq, att_loss, &c, g, 120);
        e1 = fd_err(tq, NULL, g, nq);
        fd_grad(c.k, nkv, att_loss, &c, g, 120);
        e2 = fd_err(tk, NULL, g, nkv);
        fd_grad(c.v, nkv, att_loss, &c, g, 120);
        e3 = fd_err(tv, NULL, g, nkv);
        CHECK_MSG(e1 < FD_TOL && e2 < FD_TOL && e3 < FD_TOL,
                  "attention FD N=%d n_past=%d NH=%d KVH=%d HS=%d: dq %g dk %g dv %g", N, n_past,
                  NH, KVH, HS, e1, e2, e3);
        free(g);
    }
    float *dq = malloc(nq * 4), *dk = malloc(nkv * 4), *dv = malloc(nkv * 4);
    size_t nws = kiln_attention_backward_ws_floats(N, n_past, NH, KVH, HS);
    float *ws = malloc(nws * 4);
    for (int i = 0; i < g_n_be; i++) {
        kiln_backend *be = g_be[i];
        poison(dq, nq), poison(dk, nkv), poison(dv, nkv), poison(ws, nws);
        be->i->attention_backward(be, dq, dk, dv, dout, q, k, v, out, ws, N, n_past, NH, KVH, HS,
                                  scale, window);
        CHECK_MSG(same_bits(dq, tq, nq, "dq") && same_bits(dk, tk, nkv, "dk") &&
                      same_bits(dv, tv, nkv, "dv"),
                  "%s: attention_backward N=%d n_past=%d NH=%d KVH=%d HS=%d window=%d", g_be_name[i], N,
                  n_past, NH, KVH, HS, window);
    }
    free(q), free(k), free(v), free(dout), free(out), free(tq), free(tk), free(tv);
    free(c.q), free(c.k), free(c.v), free(c.Rw), free(aq), free(ak), free(av);
    free(dq), free(dk), free(dv), free(ws);
}

static void test_attention_backward(void) {
    /* N, n_past, NH, KVH, HS, amplitude of q and k, FD, sliding window */
    test_attention_case(1, 0, 1, 1, 4, 1, 1, 0);
    test_attention_case(5, 0, 4, 2, 6, 2, 1, 0);
    test_attention_case(7, 3, 6, 2, 5, 2, 1, 0);   /* n_past > 0, GQA groups of 3 */
    test_attention_case(9, 0, 3, 3, 17, 3, 1, 0);  /* no sharing, peaky softmax */
    test_attention_case(70, 0, 2, 1, 8, 2, 1, 0);  /* two key blocks, two query blocks */
    test_attention_case(3, 66, 4, 1, 16, 1, 1, 0); /* keys past n_past seen by fewer tokens */
    test_attention_case(130, 5, 2, 2, 64, 1, 0, 0);
    /* sliding windows: shorter than the sequence, across block edges, of one key, longer */
    test_attention_case(9, 0, 4, 2, 6, 2, 1, 4);
    test_attention_case(70, 0, 2, 1, 8, 2, 1, 5);    /* windows cut at different block offsets */
    test_attention_case(150, 0, 2, 1, 8, 1, 0, 64);  /* a window of one whole block */
    test_attention_case(140, 3, 4, 2, 16, 1, 0, 70); /* a window straddling block edges */
    test_attention_case(7, 3, 6, 2, 5, 2, 1, 1);     /* each query sees itself only */
    test_attention_case(20, 0, 2, 2, 8, 2, 1, 100);  /* a window longer than the sequence */
}

/* ---- swiglu ---------------------------------------------------------------------------- */

static void test_swiglu_backward(void) {
    const size_t ns[] = {1, 17, 300, 1000};
    for (int s = 0; s < 4; s++) {
        size_t n = ns[s];
        float *g = rnd_vec(n, -8, 8), *u = rnd_vec(n, -2, 2), *dout = rnd_vec(n, -1, 1);
        if (n >= 17) { /* extremes: exp overflow / underflow, zeros */
            g[0] = -90.0f, g[1] = 100.0f, g[2] = 0.0f, g[3] = -0.0f, g[4] = -87.5f, g[5] = 30.0f;
        }
        float *tg = malloc(n * 4), *tu = malloc(n * 4), *dg = malloc(n * 4), *du = malloc(n * 4);
        double *ag = malloc(n * 8), *au = malloc(n * 8), *fg = malloc(n * 8), *fu = malloc(n * 8);
        for (size_t i = 0; i < n; i++) {
            float e = kiln_expf(-g[i]), den = 1.0f + e, sg = 1.0f / den;
            tu[i] = dout[i] * (g[i] / den);
            tg[i] = (dout[i] * u[i]) * (sg * (1.0f + g[i] * (1.0f - sg)));
            CHECK(bits(g[i] / den) == bits(kiln_silu(g[i]))); /* the forward's silu */
            double G = g[i], S = 1 / (1 + exp(-G));
            au[i] = dout[i] * G * S;
            ag[i] = (double)dout[i] * u[i] * S * (1 + G * (1 - S));
            /* central differences of L = dout * silu(g) * u in float64 */
            double h = 1e-6, sp = (G + h) / (1 + exp(-(G + h))), sm = (G - h) / (1 + exp(-(G - h)));
            fg[i] = (double)dout[i] * u[i] * (sp - sm) / (2 * h);
            fu[i] = dout[i] * G * S; /* linear in u */
        }
        CHECK_MSG(rel_err(tg, NULL, ag, n) < AN_TOL && rel_err(tu, NULL, au, n) < AN_TOL,
                  "swiglu vs f64 n=%zu", n);
        CHECK_MSG(fd_err(tg, NULL, fg, n) < FD_TOL && fd_err(tu, NULL, fu, n) < FD_TOL,
                  "swiglu FD n=%zu: %g", n, fd_err(tg, NULL, fg, n));
        for (int i = 0; i < g_n_be; i++) {
            kiln_backend *be = g_be[i];
            poison(dg, n), poison(du, n);
            be->i->swiglu_backward(be, dg, du, dout, g, u, n);
            CHECK_MSG(same_bits(dg, tg, n, "dgate") && same_bits(du, tu, n, "dup"),
                      "%s: swiglu_backward n=%zu", g_be_name[i], n);
            /* in place: dgate over gate, dup over up */
            float *g2 = dup_vec(g, n), *u2 = dup_vec(u, n);
            be->i->swiglu_backward(be, g2, u2, dout, g2, u2, n);
            CHECK_MSG(same_bits(g2, tg, n, "dgate in place") && same_bits(u2, tu, n, "dup in place"),
                      "%s: swiglu_backward in place n=%zu", g_be_name[i], n);
            free(g2), free(u2);
        }
        free(g), free(u), free(dout), free(tg), free(tu), free(dg), free(du);
        free(ag), free(au), free(fg), free(fu);
    }
}

/* ---- geglu ---------------------------------------------------------------------------- */

/* gelu_tanh(g) in float64. */
static double gelu_tanh_d(double g) { return 0.5 * g * (1 + tanh(sqrt(2 / 3.14159265358979323846) * (g + 0.044715 * g * g * g))); }

static void test_geglu_backward(void) {
    const size_t ns[] = {1, 17, 300, 1000};
    for (int s = 0; s < 4; s++) {
        size_t n = ns[s];
        float *g = rnd_vec(n, -6, 6), *u = rnd_vec(n, -2, 2), *dout = rnd_vec(n, -1, 1);
        if (n >= 17) { /* extremes: tanh saturated both ways, zeros, tanh's series branch */
            g[0] = -90.0f, g[1] = 100.0f, g[2] = 0.0f, g[3] = -0.0f, g[4] = 0.01f, g[5] = -12.0f;
        }
        float *tg = malloc(n * 4), *tu = malloc(n * 4), *dg = malloc(n * 4), *du = malloc(n * 4);
        double *ag = malloc(n * 8), *au = malloc(n * 8), *fg = malloc(n * 8), *fu = malloc(n * 8);
        for (size_t i = 0; i < n; i++) {
            kiln_geglu_backward(g[i], u[i], dout[i], &tg[i], &tu[i]);
            CHECK(bits(tu[i]) == bits(dout[i] * kiln_gelu_tanh(g[i]))); /* the forward's gelu */
            double G = g[i], k = sqrt(2 / 3.14159265358979323846), t = tanh(k * (G + 0.044715 * G * G * G));
            double dgelu = 0.5 * (1 + t) + 0.5 * G * (1 - t * t) * k * (1 + 3 * 0.044715 * G * G);
            au[i] = dout[i] * gelu_tanh_d(G);
            ag[i] = (double)dout[i] * u[i] * dgelu;
            double h = 1e-6; /* central differences of L = dout * gelu(g) * u in float64 */
            fg[i] = (double)dout[i] * u[i] * (gelu_tanh_d(G + h) - gelu_tanh_d(G - h)) / (2 * h);
            fu[i] = dout[i] * gelu_tanh_d(G); /* linear in u */
        }
        CHECK_MSG(rel_err(tg, NULL, ag, n) < AN_TOL && rel_err(tu, NULL, au, n) < AN_TOL,
                  "geglu vs f64 n=%zu: %g %g", n, rel_err(tg, NULL, ag, n), rel_err(tu, NULL, au, n));
        CHECK_MSG(fd_err(tg, NULL, fg, n) < FD_TOL && fd_err(tu, NULL, fu, n) < FD_TOL,
                  "geglu FD n=%zu: %g", n, fd_err(tg, NULL, fg, n));
        for (int i = 0; i < g_n_be; i++) {
            kiln_backend *be = g_be[i];
            if (!be->i->geglu_backward) continue;
            poison(dg, n), poison(du, n);
            be->i->geglu_backward(be, dg, du, dout, g, u, n);
            CHECK_MSG(same_bits(dg, tg, n, "dgate") && same_bits(du, tu, n, "dup"),
                      "%s: geglu_backward n=%zu", g_be_name[i], n);
            float *g2 = dup_vec(g, n), *u2 = dup_vec(u, n); /* in place */
            be->i->geglu_backward(be, g2, u2, dout, g2, u2, n);
            CHECK_MSG(same_bits(g2, tg, n, "dgate in place") && same_bits(u2, tu, n, "dup in place"),
                      "%s: geglu_backward in place n=%zu", g_be_name[i], n);
            free(g2), free(u2);
        }
        free(g), free(u), free(dout), free(tg), free(tu), free(dg), free(du);
        free(ag), free(au), free(fg), free(fu);
    }
}

/* ---- embed ----------------------------------------------------------------------------- */

static void test_embed_backward(void) {
    const int shapes[][3] = {{1, 3, 5}, {30, 11, 19}, {200, 7, 33}, {64, 1000, 16}};
    for (int s = 0; s < 4; s++) {
        int N = shapes[s][0], V = shapes[s][1], C = shapes[s][2];
        size_t nt = (size_t)V * C;
        int32_t *ids = malloc((size_t)N * 4);
        for (int n = 0; n < N; n++) ids[n] = (int32_t)(rnd_u64() % (uint64_t)(V < 9 ? V : 9));
        float *dy = rnd_vec((size_t)N * C, -1, 1), *t0 = rnd_vec(nt, -0.5f, 0.5f);
        float *t = dup_vec(t0, nt), *got = malloc(nt * 4);
        double *an = calloc(nt, 8);
        for (int n = 0; n < N; n++)
            for (int c = 0; c < C; c++) {
                size_t o = (size_t)ids[n] * C + c;
                t[o] = t[o] + dy[(size_t)n * C + c];
                an[o] += dy[(size_t)n * C + c];
            }
        /* L = sum_n <table[ids[n]], dy[n]> is linear: its exact gradient is `an`, which the
         * f32 result matches to the rounding of the additions */
        CHECK(rel_err(t, t0, an, nt) < AN_TOL);
        for (int i = 0; i < g_n_be; i++) {
            kiln_backend *be = g_be[i];
            memcpy(got, t0, nt * 4);
            be->i->embed_backward(be, got, dy, ids, N, V, C);
            CHECK_MSG(same_bits(got, t, nt, "dtable"), "%s: embed_backward N=%d V=%d C=%d",
                      g_be_name[i], N, V, C);
        }
        free(ids), free(dy), free(t0), free(t), free(got), free(an);
    }
}

/* ---- timing ---------------------------------------------------------------------------- */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* matmul_backward (dx and dW) at SmolLM2-135M's shapes, N = 512 tokens, on the best path
 * with 1 and 2 threads; printed as GFLOP/s (4*N*R*C flops), next to the forward. */
static void time_matmul_backward(void) {
    const int N = 512, shapes[][2] = {{576, 576}, {1536, 576}, {576, 1536}}; /* R, C */
    kiln_backend *bes[2] = {NULL, NULL};
    kiln_backend_cpu_create(1, &bes[0]);
    kiln_backend_cpu_create(2, &bes[1]);
    if (!bes[0] || !bes[1]) return;
    for (int s = 0; s < 3; s++) {
        int R = shapes[s][0], C = shapes[s][1];
        float *x = rnd_vec((size_t)N * C, -1, 1), *w = rnd_vec((size_t)R * C, -1, 1);
        float *dy = rnd_vec((size_t)N * R, -1, 1), *dx = malloc((size_t)N * C * 4);
        float *dW = calloc((size_t)R * C, 4), *y = malloc((size_t)N * R * 4);
        kiln_tensor W = {"w", KILN_DTYPE_F32, 2, {R, C, 1, 1}, w, (size_t)R * C * 4};
        for (int b = 0; b < 2; b++) {
            kiln_backend *be = bes[b];
            double best = 1e9, bestf = 1e9;
            for (int rep = 0; rep < 3; rep++) {
                double t0 = now_s();
                be->i->matmul_backward(be, dx, dW, NULL, dy, x, &W, N, false);
                double t1 = now_s();
                be->i->matmul(be, y, x, &W, NULL, N);
                double t2 = now_s();
                if (t1 - t0 < best) best = t1 - t0;
                if (t2 - t1 < bestf) bestf = t2 - t1;
            }
            printf("matmul_backward %s %dt N=%d R=%d C=%d: %.1f ms, %.1f GFLOP/s "
                   "(forward %.1f GFLOP/s)\n",
                   kiln_cpu_path_name(kiln_backend_cpu_path(be)), be->n_threads, N, R, C,
                   best * 1e3, 4.0 * N * R * C / best * 1e-9, 2.0 * N * R * C / bestf * 1e-9);
        }
        free(x), free(w), free(dy), free(dx), free(dW), free(y);
    }
    kiln_backend_free(bes[0]);
    kiln_backend_free(bes[1]);
}

int main(void) {
    make_backends();
    test_matmul_backward();
    test_rmsnorm_backward();
    test_rmsnorm_backward_signed_zero();
    test_rope_backward();
    test_attention_backward();
    test_geglu_backward();
    test_swiglu_backward();
    test_embed_backward();
    if (!getenv("KILN_TEST_NO_TIMING")) time_matmul_backward();
    for (int i = 0; i < g_n_be; i++) kiln_backend_free(g_be[i]);
    return test_finish("test_ops_backward");
}
