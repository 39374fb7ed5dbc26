/*
 * test_cuda_matmul_multi.c -- ops.h's matmul_multi and matmul_backward_multi on the CUDA
 * backend give, bit for bit, what n separate matmul / matmul_backward calls give (the first
 * backward call with accumulate_dx, the others accumulating), in fast mode (x rounded to bf16
 * once, one stream-ordered buffer for all products) and in auditable mode. Shapes of a
 * training layer (q, k, v of different widths with biases; gate and up without), f32 and
 * bf16 weights, a token count that takes the GEMMs (N 300) and one that takes the fast
 * matrix-vector kernels (N 5), dx accumulated or not, dx or dW skipped. Every output starts
 * as NaN bits (overwritten outputs) or the same random values (accumulated ones).
 * Fast mode's bf16 activations too: matmul_multi_bf16x / matmul_backward_multi_bf16x on x's
 * (and, without biases, on every dy whose width is a multiple of 8) bf16 rounding (to_bf16)
 * give the bits of the f32 entries where ops.h promises them (C a multiple of 8, N > 8); their
 * bf16 outputs (out16) and epilogue residuals (add, in place and not) are the f32 entries'
 * results rounded / plus the residual within a stated bound (another cuBLASLt problem, so
 * not promised the same bits: |got - want| <= 2^-8 |want| + 2^-10 for bf16 outputs, 2^-20
 * |want| + 2^-10 for residuals, against sums of about 30 |a b| per element); and
 * swiglu_bf16 / swiglu_backward_bf16 / rmsnorm_backward_bf16 write the bf16 rounding of
 * swiglu / swiglu_backward / rmsnorm_backward's f32 results (the SwiGLU ones on bf16 gate and
 * up; odd widths included), and rmsnorm_bf16 that of rmsnorm's within one rounding flip (its
 * own row-sum order in fast mode; no more than 1 in 1000 elements may flip); in fast mode the
 * SwiGLU ones within one rounding flip too (the fast sigmoid; no more than 1 in 100).
 * Without a usable GPU it exits 77.
 */
#include "base/base.h"
#include "base/tensor.h"
#include "ops/ops.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t g_rng = 0x6d756c74694d4d31ull;
static float rnd_unit(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)((double)(z >> 11) * 0x1p-53 * 2.0 - 1.0);
}

static int g_failed, g_cases;

static void *dev(kiln_backend *be, size_t nbytes) {
    void *p = kiln_backend_alloc(be, nbytes);
    if (!p) {
        fprintf(stderr, "alloc: %s\n", kiln_last_error());
        exit(1);
    }
    return p;
}

static float *dev_floats(kiln_backend *be, const float *h, size_t n) {
    float *p = dev(be, n * sizeof(float));
    if (kiln_backend_upload(be, p, h, n * sizeof(float)) != KILN_OK) exit(1);
    return p;
}

static float *dev_nan(kiln_backend *be, size_t n) {
    float *h = malloc(n * sizeof(float));
    memset(h, 0xff, n * sizeof(float));
    float *p = dev_floats(be, h, n);
    free(h);
    return p;
}

/* Download a and b (n floats each) and compare their bits. */
static void same(kiln_backend *be, const char *ctx, const char *what, const float *a,
                 const float *b, size_t n) {
    float *ha = malloc(n * sizeof(float)), *hb = malloc(n * sizeof(float));
    if (kiln_backend_download(be, ha, a, n * sizeof(float)) != KILN_OK ||
        kiln_backend_download(be, hb, b, n * sizeof(float)) != KILN_OK) {
        fprintf(stderr, "FAIL %s %s: %s\n", ctx, what, kiln_last_error());
        g_failed++;
    } else {
        size_t bad = 0, first = 0;
        for (size_t i = 0; i < n; i++)
            if (memcmp(&ha[i], &hb[i], 4) != 0 && !bad++) first = i;
        /* NaN bits never written would also compare equal: require every element finite */
        size_t nonfinite = 0;
        for (size_t i = 0; i < n; i++) nonfinite += ha[i] != ha[i];
        if (bad || nonfinite) {
            fprintf(stderr, "FAIL %s %s: %zu of %zu differ (first [%zu] %.9g vs %.9g), %zu NaN\n",
                    ctx, what, bad, n, first, ha[first], hb[first], nonfinite);
            g_failed++;
        }
    }
    free(ha);
    free(hb);
}

/* Download got (n floats, or n bf16 when got16) and want (n floats) and require
 * |got - want| <= rel |want| + abs_tol for every element (NaN fails). */
static void near(kiln_backend *be, const char *ctx, const char *what, const void *got, int got16,
                 const float *want, size_t n, double rel, double abs_tol) {
    float *hg = malloc(n * sizeof(float)), *hw = malloc(n * sizeof(float));
    uint16_t *h16 = malloc(n * sizeof(uint16_t));
    kiln_status st = got16 ? kiln_backend_download(be, h16, got, n * 2) : kiln_backend_download(be, hg, got, n * 4);
    if (st == KILN_OK) st = kiln_backend_download(be, hw, want, n * sizeof(float));
    if (st != KILN_OK) {
        fprintf(stderr, "FAIL %s %s: %s\n", ctx, what, kiln_last_error());
        g_failed++;
    } else {
        size_t bad = 0, first = 0;
        double worst = 0.0;
        for (size_t i = 0; i < n; i++) {
            const double g = got16 ? (double)kiln_bf16_to_fp32(h16[i]) : (double)hg[i], w = hw[i];
            const double err = fabs(g - w), tol = rel * fabs(w) + abs_tol;
            if (!(err <= tol) && !bad++) first = i;
            if (err / tol > worst) worst = err / tol;
        }
        if (bad) {
            fprintf(stderr, "FAIL %s %s: %zu of %zu off the bound (first [%zu] want %.9g), worst err/tol %.3g\n",
                    ctx, what, bad, n, first, (double)hw[first], worst);
            g_failed++;
        }
    }
    free(hg);
    free(hw);
    free(h16);
}

enum { NMAX = 3 };

/* n weights of widths R[i] (dtype dt) over C columns, biases where bias_on. */
static void run_case(kiln_backend *be, const char *mode, kiln_dtype dt, int n, const int *R,
                     int C, int N, int bias_on, int acc, int want_dx, int want_dw) {
    char ctx[160];
    snprintf(ctx, sizeof ctx, "%s %s n=%d N=%d C=%d%s%s%s%s", mode, kiln_dtype_name(dt), n, N, C,
             bias_on ? " bias" : "", acc ? " acc" : "", want_dx ? "" : " no-dx",
             want_dw ? "" : " no-dW");
    g_cases++;
    size_t nx = (size_t)N * C;
    float *hx = malloc(nx * sizeof(float));
    for (size_t i = 0; i < nx; i++) hx[i] = rnd_unit();
    float *x = dev_floats(be, hx, nx);
    kiln_tensor Wt[NMAX];
    const kiln_tensor *W[NMAX];
    void *wdata[NMAX];
    float *bias[NMAX], *dy[NMAX], *out_m[NMAX], *out_s[NMAX], *out_b[NMAX];
    float *dW_m[NMAX], *dW_s[NMAX], *db_m[NMAX], *db_s[NMAX], *dW_b[NMAX], *db_b[NMAX];
    /* the bf16-input entries: fast mode, where they promise the f32 entries' bits */
    const int b16 = strcmp(mode, "fast") == 0 && C % 8 == 0 && N > 8;
    for (int i = 0; i < n; i++) {
        size_t nw = (size_t)R[i] * C, es = dt == KILN_DTYPE_F32 ? 4 : 2;
        uint8_t *hw = malloc(nw * es);
        for (size_t j = 0; j < nw; j++) {
            float f = rnd_unit() * 0.2f;
            if (es == 4)
                memcpy(hw + 4 * j, &f, 4);
            else {
                uint16_t b = kiln_fp32_to_bf16(f);
                memcpy(hw + 2 * j, &b, 2);
            }
        }
        wdata[i] = dev(be, nw * es);
        if (kiln_backend_upload(be, wdata[i], hw, nw * es) != KILN_OK) exit(1);
        free(hw);
        kiln_tensor t = {"w", dt, 2, {R[i], C, 1, 1}, wdata[i], nw * es};
        Wt[i] = t;
        W[i] = &Wt[i];
        float *hb = malloc((size_t)R[i] * sizeof(float)), *hd = malloc((size_t)N * R[i] * sizeof(float));
        for (int j = 0; j < R[i]; j++) hb[j] = rnd_unit();
        for (size_t j = 0; j < (size_t)N * R[i]; j++) hd[j] = rnd_unit();
        bias[i] = bias_on ? dev_floats(be, hb, (size_t)R[i]) : NULL;
        dy[i] = dev_floats(be, hd, (size_t)N * R[i]);
        out_m[i] = dev_nan(be, (size_t)N * R[i]);
        out_s[i] = dev_nan(be, (size_t)N * R[i]);
        out_b[i] = dev_nan(be, (size_t)N * R[i]);
        /* accumulated outputs: the same starting values for both */
        float *hg = malloc(nw * sizeof(float));
        for (size_t j = 0; j < nw; j++) hg[j] = rnd_unit();
        dW_m[i] = dev_floats(be, hg, nw);
        dW_s[i] = dev_floats(be, hg, nw);
        dW_b[i] = dev_floats(be, hg, nw);
        db_b[i] = dev_floats(be, hb, (size_t)R[i]);
        db_m[i] = dev_floats(be, hb, (size_t)R[i]);
        db_s[i] = dev_floats(be, hb, (size_t)R[i]);
        free(hg);
        free(hb);
        free(hd);
    }
    /* forward */
    be->i->matmul_multi(be, n, out_m, x, W, (const float *const *)bias, N);
    for (int i = 0; i < n; i++) be->i->matmul(be, out_s[i], x, W[i], bias[i], N);
    uint16_t *x16 = dev(be, nx * sizeof(uint16_t));
    if (b16) {
        be->i->to_bf16(be, x16, x, nx);
        be->i->matmul_multi_bf16x(be, n, out_b, NULL, NULL, x16, W, (const float *const *)bias, N);
    }
    /* b16: bf16 outputs (without biases) and residuals added in the epilogue (product 0 in
     * place: out[0] holds the residual; the others from their own buffers) */
    uint16_t *o16[NMAX] = {NULL};
    float *res[NMAX] = {NULL}, *out_r[NMAX] = {NULL}, *want_r[NMAX] = {NULL};
    if (b16) {
        for (int i = 0; i < n; i++) {
            size_t m = (size_t)N * R[i];
            float *h = malloc(m * sizeof(float));
            for (size_t j = 0; j < m; j++) h[j] = rnd_unit();
            res[i] = dev_floats(be, h, m);
            out_r[i] = i == 0 ? dev_floats(be, h, m) : dev_nan(be, m);
            free(h);
            want_r[i] = dev_nan(be, m); /* out_s + res, in f32 */
            be->i->zero(be, want_r[i], m);
            be->i->add(be, want_r[i], out_s[i], m);
            be->i->add(be, want_r[i], res[i], m);
            if (!bias_on) o16[i] = dev(be, m * sizeof(uint16_t));
        }
        const float *adds[NMAX];
        for (int i = 0; i < n; i++) adds[i] = i == 0 ? out_r[0] : res[i];
        be->i->matmul_multi_bf16x(be, n, out_r, NULL, adds, x16, W, (const float *const *)bias, N);
        if (!bias_on) be->i->matmul_multi_bf16x(be, n, NULL, o16, NULL, x16, W, NULL, N);
    }
    if (kiln_backend_status(be) != KILN_OK) {
        fprintf(stderr, "FAIL %s forward: %s\n", ctx, kiln_last_error());
        g_failed++;
    }
    for (int i = 0; i < n; i++) {
        same(be, ctx, "out", out_m[i], out_s[i], (size_t)N * R[i]);
        if (b16) same(be, ctx, "out (bf16 x)", out_b[i], out_s[i], (size_t)N * R[i]);
        if (b16) near(be, ctx, i == 0 ? "out + residual (in place)" : "out + residual", out_r[i], 0, want_r[i],
                      (size_t)N * R[i], 0x1p-20, 0x1p-10);
        if (o16[i]) near(be, ctx, "out16", o16[i], 1, out_s[i], (size_t)N * R[i], 0x1p-8, 0x1p-10);
    }
    /* backward */
    float *hdx = malloc(nx * sizeof(float));
    for (size_t i = 0; i < nx; i++) hdx[i] = rnd_unit();
    float *dx_m = acc ? dev_floats(be, hdx, nx) : dev_nan(be, nx);
    float *dx_s = acc ? dev_floats(be, hdx, nx) : dev_nan(be, nx);
    float *dx_b = acc ? dev_floats(be, hdx, nx) : dev_nan(be, nx);
    /* dy in bf16 too where it may be (no dbias wanted, R a multiple of 8): the rest in f32 */
    uint16_t *dy16[NMAX] = {NULL};
    if (b16) {
        for (int i = 0; i < n; i++)
            if (!bias_on && R[i] % 8 == 0) {
                dy16[i] = dev(be, (size_t)N * R[i] * sizeof(uint16_t));
                be->i->to_bf16(be, dy16[i], dy[i], (size_t)N * R[i]);
            }
        be->i->matmul_backward_multi_bf16x(be, n, want_dx ? dx_b : NULL, want_dw ? dW_b : NULL,
                                           bias_on ? db_b : NULL, (const float *const *)dy,
                                           (const uint16_t *const *)dy16, x16, W, N, acc != 0);
    }
    be->i->matmul_backward_multi(be, n, want_dx ? dx_m : NULL, want_dw ? dW_m : NULL,
                                 bias_on ? db_m : NULL, (const float *const *)dy, x, W, N,
                                 acc != 0);
    for (int i = 0; i < n; i++)
        be->i->matmul_backward(be, want_dx ? dx_s : NULL, want_dw ? dW_s[i] : NULL,
                               bias_on ? db_s[i] : NULL, dy[i], x, W[i], N, i > 0 || acc);
    if (kiln_backend_status(be) != KILN_OK) {
        fprintf(stderr, "FAIL %s backward: %s\n", ctx, kiln_last_error());
        g_failed++;
    }
    if (want_dx) same(be, ctx, "dx", dx_m, dx_s, nx);
    if (want_dx && b16) same(be, ctx, "dx (bf16 x)", dx_b, dx_s, nx);
    for (int i = 0; i < n; i++) {
        same(be, ctx, "dW", dW_m[i], dW_s[i], (size_t)R[i] * C);
        same(be, ctx, "dbias", db_m[i], db_s[i], (size_t)R[i]);
        if (b16) {
            same(be, ctx, "dW (bf16 x)", dW_b[i], dW_s[i], (size_t)R[i] * C);
            same(be, ctx, "dbias (bf16 x)", db_b[i], db_s[i], (size_t)R[i]);
        }
    }
    free(hx);
    free(hdx);
    kiln_backend_free_buf(be, x);
    kiln_backend_free_buf(be, dx_m);
    kiln_backend_free_buf(be, dx_s);
    kiln_backend_free_buf(be, dx_b);
    kiln_backend_free_buf(be, x16);
    for (int i = 0; i < n; i++) {
        void *ps[] = {wdata[i], bias[i], dy[i], out_m[i], out_s[i], out_b[i], dW_m[i], dW_s[i],
                      db_m[i],  db_s[i], dW_b[i], db_b[i], dy16[i], o16[i], res[i], out_r[i], want_r[i]};
        for (size_t j = 0; j < sizeof ps / sizeof ps[0]; j++) kiln_backend_free_buf(be, ps[j]);
    }
}

/* Whether bf16 values a and b (finite) are neighbours: RMSNorm's fast row sum may flip a
 * rounding (ops.h rmsnorm_bf16). */
static int one_ulp(uint16_t a, uint16_t b) {
    if ((a ^ b) & 0x8000u) return 0; /* signs differ */
    return (a > b ? a - b : b - a) == 1 && (a & 0x7f80u) != 0x7f80u && (b & 0x7f80u) != 0x7f80u;
}

/* rmsnorm_bf16 (within one rounding flip) / swiglu_bf16 / swiglu_backward_bf16 /
 * rmsnorm_backward_bf16 (bit for bit) against to_bf16 of
 * rmsnorm / swiglu / swiglu_backward / rmsnorm_backward (fast backend), N rows of C. x and up
 * hold bf16 values (so x16, up16 are exactly them for the SwiGLU ones). */
static void bf16_producers(kiln_backend *be, int N, int C) {
    char ctx[96];
    snprintf(ctx, sizeof ctx, "bf16 producers N=%d C=%d", N, C);
    g_cases++;
    size_t n = (size_t)N * C;
    float *h = malloc(n * sizeof(float)), *hw = malloc((size_t)C * sizeof(float));
    for (size_t i = 0; i < n; i++) h[i] = kiln_bf16_to_fp32(kiln_fp32_to_bf16(rnd_unit() * 3.0f));
    for (int i = 0; i < C; i++) hw[i] = rnd_unit();
    float *x = dev_floats(be, h, n), *w = dev_floats(be, hw, (size_t)C), *f = dev_nan(be, n);
    for (size_t i = 0; i < n; i++) h[i] = kiln_bf16_to_fp32(kiln_fp32_to_bf16(rnd_unit() * 2.0f));
    float *up = dev_floats(be, h, n);
    uint16_t *a = dev(be, n * 2), *b = dev(be, n * 2);
    uint16_t *ha = malloc(n * 2), *hb = malloc(n * 2);
    float *f2 = dev_nan(be, n), *dw1 = dev_nan(be, (size_t)C), *dw2 = dev_nan(be, (size_t)C);
    float *rs = dev_nan(be, (size_t)N);
    uint16_t *b2 = dev(be, n * 2), *x16 = dev(be, n * 2), *up16 = dev(be, n * 2);
    be->i->to_bf16(be, x16, x, n);
    be->i->to_bf16(be, up16, up, n);
    for (int k = 0; k < 5; k++) {
        if (k == 0) {
            be->i->rmsnorm(be, f, x, w, N, C, 1e-5f);
            be->i->rmsnorm_bf16(be, b, x, w, N, C, 1e-5f);
        } else if (k == 1) {
            be->i->swiglu(be, f, x, up, n);
            be->i->swiglu_bf16(be, b, x16, up16, n);
        } else if (k == 2) { /* dout = up: dgate (k 2) and dup (k 3) of the same call */
            be->i->swiglu_backward(be, f, f2, up, x, up, n);
            be->i->swiglu_backward_bf16(be, b, b2, up, x16, up16, n);
        } else if (k == 4) { /* dy = up; f2 = dx of the bf16 entry, which must be f's bits */
            be->i->zero(be, dw1, (size_t)C);
            be->i->zero(be, dw2, (size_t)C);
            be->i->rmsnorm_backward(be, f, dw1, up, x, w, N, C, 1e-5f, rs, false);
            be->i->rmsnorm_backward_bf16(be, f2, b, dw2, up, x, w, N, C, 1e-5f, rs, false);
            same(be, ctx, "rmsnorm_backward_bf16 dx", f2, f, n);
            same(be, ctx, "rmsnorm_backward_bf16 dw", dw2, dw1, (size_t)C);
        } else {
            float *tf = f;
            f = f2;
            f2 = tf;
            uint16_t *tb = b;
            b = b2;
            b2 = tb;
        }
        be->i->to_bf16(be, a, f, n);
        if (kiln_backend_status(be) != KILN_OK || kiln_backend_download(be, ha, a, n * 2) != KILN_OK ||
            kiln_backend_download(be, hb, b, n * 2) != KILN_OK) {
            fprintf(stderr, "FAIL %s: %s\n", ctx, kiln_last_error());
            g_failed++;
            break;
        }
        static const char *what[5] = {"rmsnorm", "swiglu", "swiglu_backward dgate", "swiglu_backward dup",
                                      "rmsnorm_backward dx16"};
        size_t flips = 0;
        for (size_t i = 0; i < n; i++) {
            if (ha[i] == hb[i]) continue;
            /* rmsnorm: the fast row sum; swiglu's: the fast sigmoid (the MUFU's 2^x) */
            if (k <= 3 && one_ulp(ha[i], hb[i])) {
                flips++;
                continue;
            }
            fprintf(stderr, "FAIL %s %s [%zu]: 0x%04x, want 0x%04x\n", ctx, what[k], i, hb[i], ha[i]);
            g_failed++;
            break;
        }
        if (flips > (k == 0 ? n / 1000 : n / 100) + 1) {
            fprintf(stderr, "FAIL %s %s: %zu of %zu values a rounding flip apart\n", ctx, what[k], flips, n);
            g_failed++;
        }
    }
    free(h);
    free(hw);
    free(ha);
    free(hb);
    void *ps[] = {x, w, f, f2, up, a, b, b2, dw1, dw2, rs, x16, up16};
    for (size_t j = 0; j < sizeof ps / sizeof ps[0]; j++) kiln_backend_free_buf(be, ps[j]);
}

int main(void) {
    kiln_backend *fast = NULL, *aud = NULL;
    if (kiln_backend_cuda_create_mode(0, 1, &fast) != KILN_OK ||
        kiln_backend_cuda_create_mode(0, 0, &aud) != KILN_OK) {
        printf("no usable GPU (%s): skipped\n", kiln_last_error());
        return 77;
    }
    if (!fast->i->matmul_multi || !fast->i->matmul_backward_multi) {
        printf("FAILED: the CUDA backend has no matmul_multi\n");
        return 1;
    }
    const int qkv[3] = {576, 192, 192}, gu[2] = {1536, 1536}, odd[3] = {100, 7, 33};
    kiln_backend *bes[2] = {fast, aud};
    const char *names[2] = {"fast", "auditable"};
    for (int b = 0; b < 2; b++) {
        kiln_backend *be = bes[b];
        const int Ns[2] = {300, 5};
        for (int k = 0; k < 2; k++) {
            int N = Ns[k];
            run_case(be, names[b], KILN_DTYPE_F32, 3, qkv, 576, N, 1, 0, 1, 1);
            run_case(be, names[b], KILN_DTYPE_F32, 2, gu, 576, N, 0, 1, 1, 1);
            run_case(be, names[b], KILN_DTYPE_BF16, 3, qkv, 576, N, 1, 1, 1, 1);
            run_case(be, names[b], KILN_DTYPE_F32, 3, odd, 72, N, 1, 0, 0, 1);
            run_case(be, names[b], KILN_DTYPE_F32, 3, odd, 72, N, 0, 1, 1, 0);
        }
    }
    bf16_producers(fast, 300, 576);
    bf16_producers(fast, 37, 4864);
    bf16_producers(fast, 5, 72);
    bf16_producers(fast, 3, 2100); /* the chunked rmsnorm kernel (more than 16 x 128 columns) */
    bf16_producers(fast, 3, 2101); /* n % 4 = 3: the element-wise kernels' scalar tail */
    kiln_backend_free(fast);
    kiln_backend_free(aud);
    printf("matmul_multi / matmul_backward_multi: %d cases against separate calls\n", g_cases);
    if (g_failed) {
        printf("FAILED %d\n", g_failed);
        return 1;
    }
    printf("ALL OK\n");
    return 0;
}
