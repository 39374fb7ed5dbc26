/*
 * test_fused_ce.c -- the fused linear cross-entropy (src/train/fused_ce.h) against
 *   (a) this file's own transcription of docs/ARITHMETIC.md "Fused linear cross-entropy"
 *       (kiln_dot_ref, kiln_expf): bit-exact, for every SIMD path and 1, 2, 3 threads;
 *   (b) a float64 reference with materialised logits: within a stated tolerance;
 * on small shapes with odd V, chunk sizes 1, 7, V-1, V, > V and the default, masks, ignored
 * targets (< 0), both reductions and several scales, f32 and bf16 weights. Also: accumulate
 * flags, errors (empty mask, target >= V, non-finite loss, bad parameters) with the outputs
 * left untouched, kiln_fused_ce_logf's accuracy, and the memory bound at N=2048, H=64,
 * V=49152 against the materialised logits.
 */
#include "base/cpu_features.h"
#include "base/kmath.h"
#include "base/tensor.h"
#include "ops/ops.h"
#include "ops/fused_ce.h"
#include "test_util.h"

#include <math.h>

static uint64_t g_rng = 0x2545f4914f6cdd1dull;
static uint64_t rnd_u64(void) {
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return g_rng * 2685821657736338717ull;
}
static float rnd_f(float lo, float hi) {
    return lo + (hi - lo) * (float)((rnd_u64() >> 40) / 16777216.0);
}

/* Backends: every supported SIMD path x {1, 2, 3} threads. */
#define MAX_BE 9
static kiln_backend *g_be[MAX_BE];
static char g_be_name[MAX_BE][32];
static int g_n_be;

static void backends_create(void) {
    const kiln_cpu_path paths[] = {KILN_CPU_PATH_PORTABLE, KILN_CPU_PATH_AVX2,
                                   KILN_CPU_PATH_AVX512};
    for (int pi = 0; pi < 3; pi++) {
        if (!kiln_cpu_path_supported(paths[pi])) continue;
        setenv("KILN_CPU_PATH", kiln_cpu_path_name(paths[pi]), 1);
        for (int nt = 1; nt <= 3; nt++) {
            kiln_backend *be = NULL;
            CHECK(kiln_backend_cpu_create(nt, &be) == KILN_OK);
            if (!be) continue;
            snprintf(g_be_name[g_n_be], sizeof g_be_name[0], "%s/%dt",
                     kiln_cpu_path_name(paths[pi]), nt);
            g_be[g_n_be++] = be;
        }
    }
    unsetenv("KILN_CPU_PATH");
}

/* ---- a problem ------------------------------------------------------------------------ */

typedef struct problem {
    int64_t N, H, V;
    float *h;       /* (N, H) */
    float *w32;     /* (V, H): the weight as f32 (bf16 widened when bf16) */
    uint16_t *wb;   /* (V, H) bf16 or NULL */
    int32_t *tg;    /* (N) */
    uint8_t *mask;  /* (N) or NULL */
} problem;

static problem problem_make(int64_t N, int64_t H, int64_t V, float wscale, int use_mask,
                            int ignore, int bf16) {
    problem pr = {N, H, V, NULL, NULL, NULL, NULL, NULL};
    pr.h = malloc((size_t)(N * H) * sizeof(float));
    pr.w32 = malloc((size_t)(V * H) * sizeof(float));
    pr.tg = malloc((size_t)N * sizeof(int32_t));
    for (int64_t i = 0; i < N * H; i++) pr.h[i] = rnd_f(-1, 1);
    for (int64_t i = 0; i < V * H; i++) pr.w32[i] = rnd_f(-wscale, wscale);
    if (bf16) {
        pr.wb = malloc((size_t)(V * H) * sizeof(uint16_t));
        for (int64_t i = 0; i < V * H; i++) {
            pr.wb[i] = kiln_fp32_to_bf16(pr.w32[i]);
            pr.w32[i] = kiln_bf16_to_fp32(pr.wb[i]);
        }
    }
    for (int64_t n = 0; n < N; n++) pr.tg[n] = (int32_t)(rnd_u64() % (uint64_t)V);
    /* make sure the first and last columns are targets somewhere (chunk edges) */
    pr.tg[0] = 0;
    if (N > 1) pr.tg[N - 1] = (int32_t)(V - 1);
    if (ignore)
        for (int64_t n = 1; n < N; n += 3) pr.tg[n] = -100;
    if (use_mask) {
        pr.mask = malloc((size_t)N);
        for (int64_t n = 0; n < N; n++) pr.mask[n] = (rnd_u64() % 4) != 0;
        pr.mask[0] = 1;
    }
    return pr;
}

static void problem_free(problem *pr) {
    free(pr->h);
    free(pr->w32);
    free(pr->wb);
    free(pr->tg);
    free(pr->mask);
}

static int supervised(const problem *pr, int64_t n) {
    return (!pr->mask || pr->mask[n]) && pr->tg[n] >= 0;
}

static kiln_fused_ce_params params_of(const problem *pr, kiln_ce_reduction red, float scale,
                                      int64_t chunk) {
    kiln_fused_ce_params p = kiln_fused_ce_default_params();
    p.N = pr->N;
    p.H = pr->H;
    p.V = pr->V;
    p.hidden = pr->h;
    p.weight = pr->wb ? (const void *)pr->wb : (const void *)pr->w32;
    p.weight_dtype = pr->wb ? KILN_DTYPE_BF16 : KILN_DTYPE_F32;
    p.targets = pr->tg;
    p.mask = pr->mask;
    p.reduction = red;
    p.scale = scale;
    p.chunk = chunk;
    return p;
}

/* ---- (a) transcription of docs/ARITHMETIC.md ------------------------------------------- */

static float sum16(const float *v, int64_t n) {
    float *ones = malloc((size_t)(n ? n : 1) * sizeof(float));
    for (int64_t i = 0; i < n; i++) ones[i] = 1.0f;
    float s = kiln_dot_ref(v, ones, n);
    free(ones);
    return s;
}

/* loss, dh (N,H; overwrite), dW (V,H; += into the given values), row_loss (N). */
static float transcribe(const problem *pr, kiln_ce_reduction red, float scale, int64_t chunk,
                        float *dh, float *dW, float *row_loss) {
    const int64_t N = pr->N, H = pr->H, V = pr->V;
    int64_t cn = chunk == 0 ? 4096 : chunk;
    if (cn > V) cn = V;
    int64_t S = 0;
    int64_t *idx = malloc((size_t)N * sizeof(int64_t));
    for (int64_t n = 0; n < N; n++)
        if (supervised(pr, n)) idx[S++] = n;
    float *m = malloc((size_t)S * sizeof(float)), *l = malloc((size_t)S * sizeof(float));
    float *zt = calloc((size_t)S, sizeof(float)), *loss = malloc((size_t)S * sizeof(float));
    float *z = malloc((size_t)cn * sizeof(float)), *e = malloc((size_t)cn * sizeof(float));
    float *g = malloc((size_t)(S * cn) * sizeof(float));
    float *dh_acc = calloc((size_t)(S * H), sizeof(float));
    float *a = malloc((size_t)(cn > S ? cn : S) * sizeof(float));
    float *b = malloc((size_t)(cn > S ? cn : S) * sizeof(float));
    for (int64_t i = 0; i < S; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    for (int64_t c0 = 0; c0 < V; c0 += cn) {
        int64_t n = V - c0 < cn ? V - c0 : cn;
        for (int64_t i = 0; i < S; i++) {
            const float *hs = pr->h + idx[i] * H;
            for (int64_t j = 0; j < n; j++) z[j] = kiln_dot_ref(hs, pr->w32 + (c0 + j) * H, H);
            int64_t t = pr->tg[idx[i]] - c0;
            if (t >= 0 && t < n) zt[i] = z[t];
            float bm = z[0];
            for (int64_t j = 1; j < n; j++) bm = z[j] > bm ? z[j] : bm;
            float m_new = bm > m[i] ? bm : m[i];
            float alpha = kiln_expf(m[i] - m_new);
            for (int64_t j = 0; j < n; j++) e[j] = kiln_expf(z[j] - m_new);
            l[i] = l[i] * alpha + sum16(e, n);
            m[i] = m_new;
        }
    }
    for (int64_t i = 0; i < S; i++) loss[i] = (m[i] - zt[i]) + kiln_fused_ce_logf(l[i]);
    float sum = sum16(loss, S), out, gs;
    if (red == KILN_CE_REDUCTION_MEAN) {
        out = (sum / (float)S) * scale;
        gs = scale / (float)S;
    } else {
        out = sum * scale;
        gs = scale;
    }
    for (int64_t c0 = 0; c0 < V; c0 += cn) {
        int64_t n = V - c0 < cn ? V - c0 : cn;
        for (int64_t i = 0; i < S; i++) {
            const float *hs = pr->h + idx[i] * H;
            int64_t t = pr->tg[idx[i]] - c0;
            for (int64_t j = 0; j < n; j++) {
                float zz = kiln_dot_ref(hs, pr->w32 + (c0 + j) * H, H);
                float p = kiln_expf(zz - m[i]) / l[i];
                g[i * n + j] = j == t ? (p - 1.0f) * gs : p * gs;
            }
        }
        /* dh_acc[i][k] += dot over the chunk's columns j of g[i][j] * W[c0+j][k] */
        for (int64_t i = 0; i < S; i++)
            for (int64_t k = 0; k < H; k++) {
                for (int64_t j = 0; j < n; j++) b[j] = pr->w32[(c0 + j) * H + k];
                dh_acc[i * H + k] = dh_acc[i * H + k] + kiln_dot_ref(g + i * n, b, n);
            }
        /* dW[c0+j][k] += dot over the supervised rows s of g[s][j] * hs[s][k] */
        for (int64_t j = 0; j < n; j++)
            for (int64_t k = 0; k < H; k++) {
                for (int64_t s = 0; s < S; s++) {
                    a[s] = g[s * n + j];
                    b[s] = pr->h[idx[s] * H + k];
                }
                dW[(c0 + j) * H + k] = dW[(c0 + j) * H + k] + kiln_dot_ref(a, b, S);
            }
    }
    memset(dh, 0, (size_t)(N * H) * sizeof(float));
    memset(row_loss, 0, (size_t)N * sizeof(float));
    for (int64_t i = 0; i < S; i++) {
        memcpy(dh + idx[i] * H, dh_acc + i * H, (size_t)H * sizeof(float));
        row_loss[idx[i]] = loss[i];
    }
    free(idx); free(m); free(l); free(zt); free(loss); free(z); free(e); free(g);
    free(dh_acc); free(a); free(b);
    return out;
}

/* ---- (b) float64 reference with materialised logits ------------------------------------ */

static double reference(const problem *pr, kiln_ce_reduction red, double scale, double *dh,
                        double *dW) {
    const int64_t N = pr->N, H = pr->H, V = pr->V;
    int64_t S = 0;
    for (int64_t n = 0; n < N; n++) S += supervised(pr, n);
    double gs = red == KILN_CE_REDUCTION_MEAN ? scale / (double)S : scale;
    double *z = malloc((size_t)V * sizeof(double));
    double total = 0;
    memset(dh, 0, (size_t)(N * H) * sizeof(double));
    memset(dW, 0, (size_t)(V * H) * sizeof(double));
    for (int64_t n = 0; n < N; n++) {
        if (!supervised(pr, n)) continue;
        double mx = -INFINITY, se = 0;
        for (int64_t v = 0; v < V; v++) {
            double s = 0;
            for (int64_t k = 0; k < H; k++) s += (double)pr->h[n * H + k] * pr->w32[v * H + k];
            z[v] = s;
            if (s > mx) mx = s;
        }
        for (int64_t v = 0; v < V; v++) se += exp(z[v] - mx);
        double lse = mx + log(se);
        total += lse - z[pr->tg[n]];
        for (int64_t v = 0; v < V; v++) {
            double g = (exp(z[v] - lse) - (v == pr->tg[n] ? 1.0 : 0.0)) * gs;
            for (int64_t k = 0; k < H; k++) {
                dh[n * H + k] += g * pr->w32[v * H + k];
                dW[v * H + k] += g * pr->h[n * H + k];
            }
        }
    }
    free(z);
    return red == KILN_CE_REDUCTION_MEAN ? total / (double)S * scale : total * scale;
}

/* max |a - ref| / max |ref| */
static double rel_err(const float *a, const double *ref, size_t n) {
    double md = 0, mr = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - ref[i]);
        if (d > md || d != d) md = d;
        if (fabs(ref[i]) > mr) mr = fabs(ref[i]);
    }
    return mr > 0 ? md / mr : md;
}

/* ---- correctness ----------------------------------------------------------------------- */

/* Bounds against float64 (stated in docs/ARITHMETIC.md): the loss within 1e-5 relative,
 * every gradient element within 1e-5 of the largest gradient element in magnitude. */
#define TOL_LOSS 1e-5
#define TOL_GRAD 1e-5

static double g_worst_loss, g_worst_grad;

static void check_case(const problem *pr, kiln_ce_reduction red, float scale, int64_t chunk) {
    const int64_t N = pr->N, H = pr->H, V = pr->V;
    char label[160];
    snprintf(label, sizeof label, "N=%lld H=%lld V=%lld chunk=%lld %s %s scale=%g mask=%d",
             (long long)N, (long long)H, (long long)V, (long long)chunk,
             red == KILN_CE_REDUCTION_MEAN ? "mean" : "sum", pr->wb ? "bf16" : "f32",
             (double)scale, pr->mask != NULL);
    float *tdh = malloc((size_t)(N * H) * sizeof(float));
    float *tdw = calloc((size_t)(V * H), sizeof(float));
    float *trl = malloc((size_t)N * sizeof(float));
    float tloss = transcribe(pr, red, scale, chunk, tdh, tdw, trl);
    double *rdh = malloc((size_t)(N * H) * sizeof(double));
    double *rdw = malloc((size_t)(V * H) * sizeof(double));
    double rloss = reference(pr, red, scale, rdh, rdw);

    float *dh = malloc((size_t)(N * H) * sizeof(float));
    float *dw = malloc((size_t)(V * H) * sizeof(float));
    float *rl = malloc((size_t)N * sizeof(float));
    int64_t S = 0;
    for (int64_t n = 0; n < N; n++) S += supervised(pr, n);
    for (int b = 0; b < g_n_be; b++) {
        for (int64_t i = 0; i < N * H; i++) dh[i] = NAN; /* overwrite mode must write all */
        memset(dw, 0, (size_t)(V * H) * sizeof(float));
        for (int64_t i = 0; i < N; i++) rl[i] = NAN;
        kiln_fused_ce_params p = params_of(pr, red, scale, chunk);
        p.dhidden = dh;
        p.dweight = dw;
        p.row_loss = rl;
        kiln_fused_ce_result r;
        kiln_status st = kiln_fused_ce(g_be[b], &p, &r);
        CHECK_MSG(st == KILN_OK, "%s: %s", label, kiln_last_error());
        if (st != KILN_OK) continue;
        CHECK_MSG(r.n_supervised == S, "%s: S %lld vs %lld", label, (long long)r.n_supervised,
                  (long long)S);
        CHECK_MSG(bits(r.loss) == bits(tloss), "%s on %s: loss %.9g vs transcription %.9g",
                  label, g_be_name[b], (double)r.loss, (double)tloss);
        CHECK_MSG(same_bits(dh, tdh, (size_t)(N * H), "dh"), "%s on %s: dh", label,
                  g_be_name[b]);
        CHECK_MSG(same_bits(dw, tdw, (size_t)(V * H), "dW"), "%s on %s: dW", label,
                  g_be_name[b]);
        CHECK_MSG(same_bits(rl, trl, (size_t)N, "row_loss"), "%s on %s: row_loss", label,
                  g_be_name[b]);
        if (b == 0) {
            double el = fabs((double)r.loss - rloss) / fmax(fabs(rloss), 1e-30);
            double el64 = fabs(r.loss_f64 - rloss) / fmax(fabs(rloss), 1e-30);
            double eh = rel_err(dh, rdh, (size_t)(N * H)), ew = rel_err(dw, rdw, (size_t)(V * H));
            if (el > g_worst_loss) g_worst_loss = el;
            if (eh > g_worst_grad) g_worst_grad = eh;
            if (ew > g_worst_grad) g_worst_grad = ew;
            CHECK_MSG(el <= TOL_LOSS && el64 <= TOL_LOSS, "%s: loss %.9g (f64 %.12g) vs %.12g",
                      label, (double)r.loss, r.loss_f64, rloss);
            CHECK_MSG(eh <= TOL_GRAD, "%s: dh rel err %.3g", label, eh);
            CHECK_MSG(ew <= TOL_GRAD, "%s: dW rel err %.3g", label, ew);
        }
    }
    free(tdh); free(tdw); free(trl); free(rdh); free(rdw); free(dh); free(dw); free(rl);
}

static void test_correctness(void) {
    const kiln_ce_reduction reds[2] = {KILN_CE_REDUCTION_MEAN, KILN_CE_REDUCTION_SUM};
    /* tiny, every chunk size: 1, 7, V-1, V, > V, default */
    {
        problem pr = problem_make(7, 5, 13, 1.0f, 0, 0, 0);
        const int64_t chunks[] = {1, 7, 12, 13, 20, 0};
        for (int c = 0; c < 6; c++)
            for (int r = 0; r < 2; r++) check_case(&pr, reds[r], r ? 0.37f : 1.0f, chunks[c]);
        problem_free(&pr);
    }
    /* odd V, mask and ignored targets, H past one 16-lane group, scales */
    {
        problem pr = problem_make(19, 33, 101, 2.0f, 1, 1, 0);
        const int64_t chunks[] = {1, 7, 100, 101, 4096};
        for (int c = 0; c < 5; c++)
            for (int r = 0; r < 2; r++)
                check_case(&pr, reds[r], r ? 2.5f : 1.0f / 19.0f, chunks[c]);
        problem_free(&pr);
    }
    /* peaky softmax (large logits), more rows than 16 lanes of dW's dot */
    {
        problem pr = problem_make(40, 24, 67, 6.0f, 1, 0, 0);
        check_case(&pr, KILN_CE_REDUCTION_MEAN, 1.0f, 16);
        check_case(&pr, KILN_CE_REDUCTION_SUM, 0.125f, 33);
        problem_free(&pr);
    }
    /* bf16 weights */
    {
        problem pr = problem_make(9, 40, 77, 1.0f, 1, 1, 1);
        check_case(&pr, KILN_CE_REDUCTION_MEAN, 1.0f, 7);
        check_case(&pr, KILN_CE_REDUCTION_SUM, 0.5f, 0);
        problem_free(&pr);
    }
    printf("against float64: worst loss rel err %.3g (bound %g), worst gradient err %.3g of "
           "max |grad| (bound %g)\n", g_worst_loss, TOL_LOSS, g_worst_grad, TOL_GRAD);
}

/* dhidden_accumulate and dweight's +=: result = old + this call's gradient, bit for bit;
 * unsupervised rows of dh untouched; loss-only call gives the same loss. */
static void test_accumulate(void) {
    problem pr = problem_make(11, 20, 37, 1.0f, 1, 1, 0);
    const int64_t N = pr.N, H = pr.H, V = pr.V;
    float *dh0 = malloc((size_t)(N * H) * 4), *dh = malloc((size_t)(N * H) * 4);
    float *dw0 = malloc((size_t)(V * H) * 4), *dw = malloc((size_t)(V * H) * 4);
    float *fdh = malloc((size_t)(N * H) * 4), *fdw = calloc((size_t)(V * H), 4);
    for (int64_t i = 0; i < N * H; i++) dh[i] = dh0[i] = rnd_f(-1, 1);
    for (int64_t i = 0; i < V * H; i++) dw[i] = dw0[i] = rnd_f(-1, 1);
    kiln_fused_ce_params p = params_of(&pr, KILN_CE_REDUCTION_SUM, 0.25f, 8);
    p.dhidden = fdh;
    p.dweight = fdw;
    kiln_fused_ce_result r1, r2, r3;
    CHECK(kiln_fused_ce(g_be[0], &p, &r1) == KILN_OK);
    p.dhidden = dh;
    p.dweight = dw;
    p.dhidden_accumulate = 1;
    CHECK(kiln_fused_ce(g_be[g_n_be - 1], &p, &r2) == KILN_OK);
    CHECK(bits(r1.loss) == bits(r2.loss));
    int ok_h = 1, ok_w = 1;
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < H; k++) {
            float want = supervised(&pr, n) ? dh0[n * H + k] + fdh[n * H + k] : dh0[n * H + k];
            if (bits(dh[n * H + k]) != bits(want)) ok_h = 0;
        }
    for (int64_t i = 0; i < V * H; i++)
        if (bits(dw[i]) != bits(dw0[i] + fdw[i])) ok_w = 0;
    CHECK_MSG(ok_h, "dh accumulate != old + gradient");
    CHECK_MSG(ok_w, "dW accumulate != old + gradient");
    /* loss only */
    kiln_fused_ce_params q = params_of(&pr, KILN_CE_REDUCTION_SUM, 0.25f, 8);
    CHECK(kiln_fused_ce(g_be[0], &q, &r3) == KILN_OK);
    CHECK(bits(r3.loss) == bits(r1.loss));
    CHECK(r3.scratch_bytes < r1.scratch_bytes);
    CHECK(r3.scratch_bytes == kiln_fused_ce_scratch_bytes(r3.n_supervised, H, V, 8, 0, 0));
    CHECK(r1.scratch_bytes == kiln_fused_ce_scratch_bytes(r1.n_supervised, H, V, 8, 1, 1));
    /* the op's workspace query: what the call takes */
    size_t ws = 0;
    CHECK(kiln_fused_ce_workspace(g_be[0], &q, &ws) == KILN_OK && ws == r3.scratch_bytes);
    CHECK(kiln_fused_ce_workspace(g_be[0], &p, &ws) == KILN_OK && ws == r1.scratch_bytes);
    /* loss first (pass-1 statistics out), then gradients from those statistics: the same
     * bits as the one-call computation above */
    float *stats = malloc((size_t)N * 3 * 4);
    float *sdh = malloc((size_t)(N * H) * 4), *sdw = calloc((size_t)(V * H), 4);
    kiln_fused_ce_params a = params_of(&pr, KILN_CE_REDUCTION_SUM, 0.25f, 8);
    a.row_stats_out = stats;
    kiln_fused_ce_result r4, r5;
    CHECK(kiln_fused_ce(g_be[0], &a, &r4) == KILN_OK);
    kiln_fused_ce_params b = params_of(&pr, KILN_CE_REDUCTION_SUM, 0.25f, 8);
    b.row_stats_in = stats;
    b.dhidden = sdh;
    b.dweight = sdw;
    CHECK(kiln_fused_ce(g_be[g_n_be - 1], &b, &r5) == KILN_OK);
    CHECK(bits(r4.loss) == bits(r1.loss) && bits(r5.loss) == bits(r1.loss));
    CHECK(same_bits(sdh, fdh, (size_t)(N * H), "dh from saved statistics"));
    CHECK(same_bits(sdw, fdw, (size_t)(V * H), "dW from saved statistics"));
    /* the loss from downloaded statistics (a no_wait call's pending loss): the call's bits,
     * MEAN and SUM; the rows' errors named */
    kiln_fused_ce_result r6;
    CHECK(kiln_fused_ce_loss_from_stats(&a, stats, &r6) == KILN_OK);
    CHECK(bits(r6.loss) == bits(r4.loss) && r6.loss_f64 == r4.loss_f64 && r6.n_supervised == r4.n_supervised);
    kiln_fused_ce_params am = params_of(&pr, KILN_CE_REDUCTION_MEAN, 0.5f, 8);
    am.row_stats_out = stats;
    CHECK(kiln_fused_ce(g_be[0], &am, &r4) == KILN_OK);
    CHECK(kiln_fused_ce_loss_from_stats(&am, stats, &r6) == KILN_OK);
    CHECK(bits(r6.loss) == bits(r4.loss) && r6.loss_f64 == r4.loss_f64);
    int64_t first = 0;
    while (!supervised(&pr, first)) first++;
    stats[3 * first + 1] = INFINITY; /* a sum of exponentials past the float range */
    CHECK_ERR(kiln_fused_ce_loss_from_stats(&am, stats, &r6), KILN_ERR_RANGE, "not finite");
    int32_t *none = malloc((size_t)N * sizeof(int32_t));
    for (int64_t n = 0; n < N; n++) none[n] = -1;
    am.targets = none;
    CHECK_ERR(kiln_fused_ce_loss_from_stats(&am, stats, &r6), KILN_ERR_INVALID_ARG, "no supervised");
    free(none);
    free(stats); free(sdh); free(sdw);
    free(dh0); free(dh); free(dw0); free(dw); free(fdh); free(fdw);
    problem_free(&pr);
}

/* Kept logits (p.keep): none, some and all of the chunks kept, in one call and across the
 * loss-then-gradient pair, on every backend: the bits of recomputing them. */
static void test_keep(void) {
    problem pr = problem_make(23, 20, 37, 1.0f, 1, 1, 0);
    const int64_t N = pr.N, H = pr.H, V = pr.V, cn = 8, chunks = (V + cn - 1) / cn;
    float *rdh = malloc((size_t)(N * H) * 4), *rdw = calloc((size_t)(V * H), 4);
    kiln_fused_ce_params p = params_of(&pr, KILN_CE_REDUCTION_MEAN, 0.5f, cn);
    p.dhidden = rdh;
    p.dweight = rdw;
    kiln_fused_ce_result r0;
    CHECK(kiln_fused_ce(g_be[0], &p, &r0) == KILN_OK);
    const int64_t S = r0.n_supervised;
    const int64_t kinds[4] = {0, 1, 2, chunks}; /* chunks kept */
    float *keep = malloc((size_t)(chunks * S * cn + 5) * 4);
    float *stats = malloc((size_t)N * 3 * 4);
    float *dh = malloc((size_t)(N * H) * 4), *dw = malloc((size_t)(V * H) * 4);
    for (int b = 0; b < g_n_be; b++)
        for (int kk = 0; kk < 4; kk++)
            for (int split = 0; split < 2; split++) {
                /* room for kinds[kk] chunks and a little (not another chunk) */
                const size_t floats = (size_t)(kinds[kk] * S * cn) + (kinds[kk] ? 5 : 0);
                for (size_t i = 0; i < floats; i++) keep[i] = NAN;
                memset(dw, 0, (size_t)(V * H) * 4);
                kiln_fused_ce_params q = params_of(&pr, KILN_CE_REDUCTION_MEAN, 0.5f, cn);
                q.keep = keep;
                q.keep_floats = floats;
                kiln_fused_ce_result r1, r2;
                if (split) { /* the trainer's pattern: loss, then the gradient */
                    q.row_stats_out = stats;
                    CHECK(kiln_fused_ce(g_be[b], &q, &r1) == KILN_OK);
                    q.row_stats_out = NULL;
                    q.row_stats_in = stats;
                }
                q.dhidden = dh;
                q.dweight = dw;
                CHECK(kiln_fused_ce(g_be[b], &q, &r2) == KILN_OK);
                char what[96];
                snprintf(what, sizeof what, "kept logits: %s, %lld chunks, %s", g_be_name[b],
                         (long long)kinds[kk], split ? "loss then gradient" : "one call");
                CHECK_MSG(bits(r2.loss) == bits(r0.loss) && (!split || bits(r1.loss) == bits(r0.loss)),
                          "%s: loss", what);
                CHECK(same_bits(dh, rdh, (size_t)(N * H), what));
                CHECK(same_bits(dw, rdw, (size_t)(V * H), what));
            }
    free(keep); free(stats); free(dh); free(dw); free(rdh); free(rdw);
    problem_free(&pr);
}

/* ---- errors ---------------------------------------------------------------------------- */

static int all_bits(const float *v, size_t n, float x) {
    for (size_t i = 0; i < n; i++)
        if (bits(v[i]) != bits(x)) return 0;
    return 1;
}

static void test_errors(void) {
    problem pr = problem_make(6, 8, 10, 1.0f, 1, 0, 0);
    const int64_t N = pr.N, H = pr.H, V = pr.V;
    float *dh = malloc((size_t)(N * H) * 4), *dw = malloc((size_t)(V * H) * 4);
    float *rl = malloc((size_t)N * 4);
    const float sentinel = 12345.0f;
#define RESET()                                                                                \
    do {                                                                                       \
        for (int64_t i_ = 0; i_ < N * H; i_++) dh[i_] = sentinel;                              \
        for (int64_t i_ = 0; i_ < V * H; i_++) dw[i_] = sentinel;                              \
        for (int64_t i_ = 0; i_ < N; i_++) rl[i_] = sentinel;                                  \
    } while (0)
#define UNTOUCHED()                                                                            \
    CHECK(all_bits(dh, (size_t)(N * H), sentinel) && all_bits(dw, (size_t)(V * H), sentinel) && \
          all_bits(rl, (size_t)N, sentinel))
    kiln_backend *be = g_be[g_n_be - 1];
    kiln_fused_ce_params p = params_of(&pr, KILN_CE_REDUCTION_MEAN, 1.0f, 4);
    p.dhidden = dh;
    p.dweight = dw;
    p.row_loss = rl;
    kiln_fused_ce_result r;

    /* a backend whose table has no fused_ce: refused, nothing written */
    kiln_backend_i no_ce = *be->i;
    no_ce.fused_ce = NULL;
    no_ce.fused_ce_workspace = NULL;
    kiln_backend without = *be;
    without.i = &no_ce;
    RESET();
    CHECK_ERR(kiln_fused_ce(&without, &p, &r), KILN_ERR_UNSUPPORTED, "no fused linear");
    UNTOUCHED();

    /* empty mask: an error, never a NaN */
    uint8_t zeros[6] = {0};
    kiln_fused_ce_params q = p;
    q.mask = zeros;
    RESET();
    r.loss = 1.0f;
    CHECK_ERR(kiln_fused_ce(be, &q, &r), KILN_ERR_INVALID_ARG, "no supervised positions");
    CHECK(r.n_supervised == 0 && r.loss == 0.0f);
    UNTOUCHED();
    /* every target ignored */
    int32_t ign[6] = {-100, -100, -1, -100, -100, -100};
    q = p;
    q.mask = NULL;
    q.targets = ign;
    RESET();
    CHECK_ERR(kiln_fused_ce(be, &q, &r), KILN_ERR_INVALID_ARG, "no supervised positions");
    UNTOUCHED();

    /* target >= V at a supervised position names the position; masked-out ones are ignored */
    int32_t bad[6] = {1, 2, 3, 4, 10, 5};
    q = p;
    q.mask = NULL;
    q.targets = bad;
    RESET();
    CHECK_ERR(kiln_fused_ce(be, &q, &r), KILN_ERR_RANGE, "position 4: target 10 >= vocabulary size 10");
    UNTOUCHED();
    uint8_t m4[6] = {1, 1, 1, 1, 0, 1};
    q.mask = m4;
    CHECK(kiln_fused_ce(be, &q, &r) == KILN_OK);
    CHECK(r.n_supervised == 5);

    /* non-finite loss: a NaN or an overflowing hidden row; the error names the position */
    float *h2 = malloc((size_t)(N * H) * 4);
    memcpy(h2, pr.h, (size_t)(N * H) * 4);
    h2[3 * H + 2] = NAN;
    q = p;
    q.mask = NULL;
    q.hidden = h2;
    RESET();
    CHECK_ERR(kiln_fused_ce(be, &q, &r), KILN_ERR_RANGE, "position 3 (supervised row 3): loss is not finite");
    UNTOUCHED();
    memcpy(h2, pr.h, (size_t)(N * H) * 4);
    for (int64_t k = 0; k < H; k++) h2[5 * H + k] = 3e38f;
    RESET();
    CHECK_ERR(kiln_fused_ce(be, &q, &r), KILN_ERR_RANGE, "position 5");
    UNTOUCHED();
    free(h2);

    /* bad parameters */
    CHECK_ERR(kiln_fused_ce(be, NULL, &r), KILN_ERR_INVALID_ARG, "NULL");
    CHECK_ERR(kiln_fused_ce(NULL, &p, &r), KILN_ERR_INVALID_ARG, "NULL");
    q = p;
    q.V = 0;
    CHECK_ERR(kiln_fused_ce(be, &q, &r), KILN_ERR_INVALID_ARG, "must be > 0");
    q = p;
    q.targets = NULL;
    CHECK_ERR(kiln_fused_ce(be, &q, &r), KILN_ERR_INVALID_ARG, "targets is NULL");
    q = p;
    q.weight_dtype = KILN_DTYPE_Q8_0;
    CHECK_ERR(kiln_fused_ce(be, &q, &r), KILN_ERR_UNSUPPORTED, "only f32 and bf16");
    q = p;
    q.chunk = -1;
    CHECK_ERR(kiln_fused_ce(be, &q, &r), KILN_ERR_INVALID_ARG, "chunk -1");
    q = p;
    q.scale = INFINITY;
    CHECK_ERR(kiln_fused_ce(be, &q, &r), KILN_ERR_INVALID_ARG, "scale");
    q = p;
    q.reduction = (kiln_ce_reduction)7;
    CHECK_ERR(kiln_fused_ce(be, &q, &r), KILN_ERR_INVALID_ARG, "reduction 7");
    q = p;
    q.N = (int64_t)1 << 40;
    CHECK_ERR(kiln_fused_ce(be, &q, &r), KILN_ERR_INVALID_ARG, "2^31");
    RESET();
    UNTOUCHED();

    free(dh); free(dw); free(rl);
    problem_free(&pr);
#undef RESET
#undef UNTOUCHED
}

/* Allocation failure through the hook: NOMEM, outputs untouched, nothing leaked. */
static int g_fail_alloc;
static void *failing_alloc(size_t size, void *user) {
    (void)user;
    if (g_fail_alloc) return NULL;
    return malloc(size);
}
static void plain_free(void *ptr, void *user) {
    (void)user;
    free(ptr);
}

static void test_nomem(void) {
    /* the backends are alive: swapping the allocator is only safe with no kiln object alive,
     * so make a private backend under the failing hook and free it before restoring */
    for (int b = 0; b < g_n_be; b++) kiln_backend_free(g_be[b]);
    g_n_be = 0;
    kiln_allocator a = {failing_alloc, plain_free, NULL};
    CHECK(kiln_set_allocator(&a) == KILN_OK);
    kiln_backend *be = NULL;
    CHECK(kiln_backend_cpu_create(2, &be) == KILN_OK);
    problem pr = problem_make(5, 8, 9, 1.0f, 0, 0, 0);
    float *dh = malloc((size_t)(5 * 8) * 4);
    for (int i = 0; i < 40; i++) dh[i] = 7.0f;
    kiln_fused_ce_params p = params_of(&pr, KILN_CE_REDUCTION_MEAN, 1.0f, 4);
    p.dhidden = dh;
    kiln_mem_stats s0, s1;
    kiln_mem_get_stats(&s0);
    g_fail_alloc = 1;
    kiln_fused_ce_result r;
    CHECK_ERR(kiln_fused_ce(be, &p, &r), KILN_ERR_NOMEM, "scratch");
    g_fail_alloc = 0;
    kiln_mem_get_stats(&s1);
    CHECK(s1.live_bytes == s0.live_bytes);
    CHECK(all_bits(dh, 40, 7.0f));
    CHECK(kiln_fused_ce(be, &p, &r) == KILN_OK);
    kiln_backend_free(be);
    CHECK(kiln_set_allocator(NULL) == KILN_OK);
    free(dh);
    problem_free(&pr);
    backends_create();
}

/* ---- log -------------------------------------------------------------------------------- */

static double ulp_err(float got, double want) {
    float wf = (float)want;
    float next = nextafterf(wf, INFINITY);
    double ulp = (double)next - (double)wf;
    return fabs((double)got - want) / ulp;
}

static void test_logf(void) {
    double worst = 0, worst_range = 0;
    float worst_x = 0;
    /* the range the loss uses: sums of exponentials in [1, 2^20] densely */
    for (float x = 1.0f; x < 1048576.0f; x = x * 1.0001f + 1e-7f) {
        double e = ulp_err(kiln_fused_ce_logf(x), log((double)x));
        if (e > worst_range) worst_range = e;
    }
    /* everything positive: random bit patterns */
    for (int i = 0; i < 2000000; i++) {
        uint32_t u = (uint32_t)(rnd_u64() >> 33) % 0x7f800000u;
        if (u == 0) continue;
        float x = kiln_bits_f32(u);
        double want = log((double)x);
        if (want == 0) continue;
        double e = ulp_err(kiln_fused_ce_logf(x), want);
        if (e > worst) {
            worst = e;
            worst_x = x;
        }
    }
    printf("kiln_fused_ce_logf: worst %.3f ulp on [1, 2^20], %.3f ulp over all positive floats "
           "(at %g)\n", worst_range, worst, (double)worst_x);
    CHECK(worst_range < 1.5);
    CHECK(worst < 2.0);
    CHECK(kiln_fused_ce_logf(1.0f) == 0.0f);
    CHECK(isnan(kiln_fused_ce_logf(NAN)));
    CHECK(isnan(kiln_fused_ce_logf(-1.0f)));
    CHECK(kiln_fused_ce_logf(0.0f) == -INFINITY);
    CHECK(kiln_fused_ce_logf(INFINITY) == INFINITY);
    CHECK(fabs(kiln_fused_ce_logf(1e-45f) - log((double)1e-45f)) < 1e-5); /* subnormal */
}

/* ---- memory ----------------------------------------------------------------------------- */

/* N=2048, H=64, V=49152, chunk 4096: the peak of kiln's own accounting during the call,
 * beyond what was live before, must be the documented scratch (2 S x chunk + 4 S x H +
 * 2 chunk x H floats and O(S + chunk) more), while the materialised logits alone would be
 * N x V x 4 bytes = 402 MB. */
static void test_memory(void) {
    const int64_t N = 2048, H = 64, V = 49152, chunk = 4096;
    problem pr = problem_make(N, H, V, 0.5f, 1, 0, 0);
    int64_t S = 0;
    for (int64_t n = 0; n < N; n++) S += supervised(&pr, n);
    float *dh = malloc((size_t)(N * H) * 4);
    float *dw = calloc((size_t)(V * H), 4);
    kiln_fused_ce_params p = params_of(&pr, KILN_CE_REDUCTION_MEAN, 1.0f, chunk);
    p.dhidden = dh;
    p.dweight = dw;
    kiln_backend *be = g_be[g_n_be - 1];
    kiln_mem_stats s0, s1;
    kiln_mem_get_stats(&s0);
    kiln_mem_reset_peak();
    double t0 = kiln_time_seconds();
    kiln_fused_ce_result r;
    kiln_status st = kiln_fused_ce(be, &p, &r);
    double dt = kiln_time_seconds() - t0;
    kiln_mem_get_stats(&s1);
    CHECK_MSG(st == KILN_OK, "%s", kiln_last_error());
    size_t peak_extra = s1.peak_bytes - s0.live_bytes;
    double formula = 4.0 * (2.0 * S * chunk + 4.0 * S * H + 2.0 * chunk * H) +
                     4.0 * (double)(chunk > S ? chunk : S) + 24.0 * S;
    double logits = (double)N * V * 4;
    printf("memory N=%lld (S=%lld) H=%lld V=%lld chunk=%lld: kiln peak extra %.1f MB "
           "(scratch %.1f MB, bound %.1f MB) vs materialised logits %.1f MB: %.1fx smaller; "
           "%.2f s on %s, loss %.6f\n",
           (long long)N, (long long)S, (long long)H, (long long)V, (long long)chunk,
           peak_extra / 1e6, r.scratch_bytes / 1e6, formula / 1e6, logits / 1e6,
           logits / (double)peak_extra, dt, g_be_name[g_n_be - 1], (double)r.loss);
    CHECK(s1.live_bytes == s0.live_bytes);
    CHECK(peak_extra == r.scratch_bytes);
    CHECK(r.scratch_bytes == kiln_fused_ce_scratch_bytes(S, H, V, chunk, 1, 1));
    CHECK((double)peak_extra <= formula + 64.0 * 20);
    CHECK(logits / (double)peak_extra > 5.0);
    CHECK(isfinite(r.loss) && r.loss > 0);
    free(dh);
    free(dw);
    problem_free(&pr);
}

int main(void) {
    backends_create();
    CHECK(g_n_be >= 3);
    test_logf();
    test_correctness();
    test_accumulate();
    test_keep();
    test_errors();
    test_nomem();
    test_memory();
    for (int b = 0; b < g_n_be; b++) kiln_backend_free(g_be[b]);
    return test_finish("test_fused_ce");
}
