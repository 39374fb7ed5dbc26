/*
 * test_linear_attn.c -- the CPU backend's Qwen3.5 ops (ops.h, "Qwen3.5's ops";
 * src/ops/cpu/cpu_linear_attn.c) against float64 references written here from the math as
 * transformers defines it (docs/models/qwen35-notes.md), not from the CPU code's order:
 *
 *   conv1d_silu    the causal depthwise convolution + SiLU, fed every way a sequence can be
 *                  fed (one prefill; chunked prefill, chunks shorter than K - 1 among them;
 *                  decode with runs == NULL, sequences interleaved, runs mixed in; training
 *                  with no state), from a state of garbage or the one a previous feeding
 *                  left (a run at position 0 must ignore it): every way gives the same bits,
 *                  within FWD_TOL of float64, and leaves the last K - 1 inputs as the
 *                  state, bit for bit;
 *   gated_delta    the Gated DeltaNet recurrence fed the same ways: the same bits every way
 *                  (same recurrence), within GDN_TOL of float64, the same final states;
 *   backwards      conv1d_silu, gated_delta (T = 150: three KILN_GDN_CHUNK chunks): central
 *                  differences of a float64 loss sum(out * R), R random; gdn_gates and
 *                  sigmoid_mul: the float64 derivative; `+=` outputs add exactly once;
 *   the rest       gdn_gates, sigmoid_mul, split/join_halves, rope_partial (rot == HS is rope,
 *                  bit for bit; the backward is the transpose), kiln_logf, kiln_softplus and
 *                  kiln_sigmoid's ulp error over sweeps.
 *
 * Every op runs on kiln_backend_cpu_create(1), (2) and (3) with outputs poisoned with NaN:
 * identical bits. Errors are printed; each bound is 1.2 to 20 times what was measured.
 */
#include "base/kmath.h"
#include "ops/ops.h"
#include "test_util.h"

#include <math.h>
#include <time.h>

#define FWD_TOL 1e-6 /* conv1d_silu vs float64, relative to the largest |output| */
#define GDN_TOL 1e-6 /* gated_delta vs float64 (150 steps), relative to the largest |output| */
#define FD_TOL 1e-5  /* f32 gradient vs float64 central differences, per tensor's max |grad| */
#define FD_H 1e-6

/* ---- helpers ------------------------------------------------------------------------- */

static uint64_t g_rng = 0x13198a2e03707344ull;
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
    for (size_t i = 0; i < n; i++)
        v[i] = rnd_f(lo, hi);
    return v;
}
static float *new_vec(size_t n) {
    return malloc((n ? n : 1) * sizeof(float));
}
static double *to_d(const float *a, size_t n) {
    double *v = malloc((n ? n : 1) * sizeof *v);
    for (size_t i = 0; i < n; i++)
        v[i] = a[i];
    return v;
}
/* Folds |got - want| into *err and |want| into *scale; NaN sticks in *err. */
static void fold_err(double got, double want, double *err, double *scale) {
    const double e = fabs(got - want);
    if (!(e <= *err)) *err = e;
    if (fabs(want) > *scale) *scale = fabs(want);
}
/* The spacing of binary32 at |want| (2^-149 below the normal range). */
static double ulp_of(double want) {
    const double a = fabs(want);
    return a < 0x1p-126 ? 0x1p-149 : ldexp(1.0, ilogb(a) - 23);
}
static double ulp_err(float got, double want) {
    if (isnan(want)) return isnan(got) ? 0 : INFINITY;
    if (isinf(want)) return (double)got == want ? 0 : INFINITY;
    const double e = fabs((double)got - want) / ulp_of(want);
    return e == e ? e : INFINITY;
}
static double silu_d(double s) {
    return s / (1.0 + exp(-s));
}
static double sigmoid_d(double x) {
    return 1.0 / (1.0 + exp(-x));
}
/* torch's F.softplus (beta 1, threshold 20). */
static double softplus_d(double x) {
    return x > 20.0 ? x : log1p(exp(x));
}

/* The backends under test: the CPU with 1, 2 and 3 threads. */
#define N_BE 3
static kiln_backend *g_be[N_BE];

static void make_backends(void) {
    for (int b = 0; b < N_BE; b++)
        if (kiln_backend_cpu_create(b + 1, &g_be[b]) != KILN_OK || !g_be[b]) {
            fprintf(stderr, "cannot create the CPU backend with %d threads\n", b + 1);
            exit(1);
        }
    const kiln_backend_i *i = g_be[0]->i;
    CHECK(i->conv1d_silu && i->gated_delta && i->gdn_gates && i->sigmoid_mul && i->split_halves &&
          i->join_halves && i->rope_partial && i->rope_partial_backward &&
          i->conv1d_silu_backward && i->gated_delta_backward && i->gdn_gates_backward &&
          i->sigmoid_mul_backward);
}

/* ---- kiln_logf, kiln_softplus, kiln_sigmoid -------------------------------------------- */

/* Worst ulp error of f against ref over the floats from lo to hi (same sign, |lo| < |hi|)
 * taken every `stride` bit patterns, hi itself included. */
static double sweep_ulp(float (*f)(float), double (*ref)(double), float lo, float hi,
                        uint32_t stride, float *worst_x) {
    double worst = 0;
    const uint32_t u0 = kiln_f32_bits(lo), u1 = kiln_f32_bits(hi);
    for (uint64_t u = u0;; u += stride) {
        if (u > u1) u = u1; /* end on hi */
        const float x = kiln_bits_f32((uint32_t)u);
        const double e = ulp_err(f(x), ref((double)x));
        if (!(e <= worst)) {
            worst = e;
            *worst_x = x;
        }
        if (u == u1) break;
    }
    return worst;
}
static float logf_k(float x) {
    return kiln_logf(x);
}
static float softplus_k(float x) {
    return kiln_softplus(x);
}
static float sigmoid_k(float x) {
    return kiln_sigmoid(x);
}

static void test_log_softplus(void) {
    float wx = 0;
    /* every float in [1/2, 2) (where ln x is small and the reduction matters), then every
     * 61st pattern of all positive finite floats, subnormals included */
    double near1 = sweep_ulp(logf_k, log, 0.5f, 1.99999988f, 1, &wx);
    printf("kiln_logf: %.3f ulp max on [1/2, 2) (every float; at %.9g)\n", near1, (double)wx);
    double all = sweep_ulp(logf_k, log, 0x1p-149f, 3.40282347e38f, 61, &wx);
    printf("kiln_logf: %.3f ulp max over all positive floats (every 61st; at %.9g)\n", all,
           (double)wx);
    CHECK_MSG(near1 <= 1.0 && all <= 1.0, "%g %g", near1, all);
    CHECK(kiln_logf(1.0f) == 0.0f && !signbit(kiln_logf(1.0f)));
    CHECK(kiln_logf(0.0f) == -INFINITY && kiln_logf(-0.0f) == -INFINITY);
    CHECK(kiln_logf(INFINITY) == INFINITY);
    CHECK(isnan(kiln_logf(-1.0f)) && isnan(kiln_logf(-INFINITY)) && isnan(kiln_logf(NAN)));
    CHECK(kiln_logf(2.0f) == 0.693147182f);

    /* softplus: every 223rd float of [-104, 25] on both sides of 0 (results below 2^-126 are
     * measured in units of 2^-149), then every float of [-20, -14] (its branches) */
    double neg = sweep_ulp(softplus_k, softplus_d, -0.0f, -104.0f, 223, &wx);
    float wneg = wx;
    const double branch = sweep_ulp(softplus_k, softplus_d, -14.0f, -20.0f, 1, &wx);
    if (branch > neg) neg = branch, wneg = wx;
    double pos = sweep_ulp(softplus_k, softplus_d, 0.0f, 25.0f, 223, &wx);
    printf("kiln_softplus: %.3f ulp max on [-104, 0] (at %.9g), %.3f on [0, 25] (at %.9g)\n", neg,
           (double)wneg, pos, (double)wx);
    CHECK_MSG(neg <= 2.0 && pos <= 2.0, "%g %g", neg, pos);
    CHECK(kiln_softplus(30.0f) == 30.0f && kiln_softplus(-200.0f) == 0.0f);
    CHECK(kiln_softplus(INFINITY) == INFINITY && kiln_softplus(-INFINITY) == 0.0f);
    CHECK(isnan(kiln_softplus(NAN)));

    /* sigmoid: normal results (x >= -87.33); below, 1 + kiln_expf(-x) overflows to +inf from
     * x < -88.72 on, so a result under 2^-126 may be flushed to 0 (as torch's float32 sigmoid
     * does): only |error| < 2^-126 is asked there */
    double sn = sweep_ulp(sigmoid_k, sigmoid_d, -0.0f, -87.33f, 223, &wx);
    const float wsn = wx;
    double sp = sweep_ulp(sigmoid_k, sigmoid_d, 0.0f, 40.0f, 223, &wx);
    double tiny = 0;
    for (float x = -87.33f; x > -110.0f; x -= 0.001f)
        tiny = fmax(tiny, fabs(kiln_sigmoid(x) - sigmoid_d(x)));
    printf("kiln_sigmoid: %.3f ulp max on [-87.33, 0] (at %.9g), %.3f on [0, 40] (at %.9g); below "
           "-87.33 "
           "|error| <= %.3g\n",
           sn, (double)wsn, sp, (double)wx, tiny);
    CHECK_MSG(sn <= 2.5 && sp <= 2.0 && tiny < 0x1p-126, "%g %g %g", sn, sp, tiny);
    CHECK(kiln_sigmoid(0.0f) == 0.5f && kiln_sigmoid(40.0f) == 1.0f &&
          kiln_sigmoid(-200.0f) == 0.0f);
}

/* ---- feeding sequences to a stateful op ------------------------------------------------ */

/* The ways a batch of sequences can reach conv1d_silu / gated_delta. Every way starts each
 * sequence at position 0 over a state of garbage. */
enum { FEED_ONE_PREFILL, FEED_CHUNKED, FEED_DECODE, FEED_TRAIN, N_FEED };
static const char *feed_name[N_FEED] = {"one prefill", "chunked prefill", "decode", "training"};

#define MAX_SEQ 3
#define MAX_TOK 512

typedef struct feed_batch {
    int n, no_runs; /* no_runs: runs == NULL, one token per sequence */
    int32_t seq[MAX_TOK], pos[MAX_TOK];
} feed_batch;

/* Appends the next k tokens of sequence s. */
static void feed_take(feed_batch *fb, int s, int k, int *done) {
    for (int i = 0; i < k; i++) {
        fb->seq[fb->n] = s;
        fb->pos[fb->n] = done[s]++;
        fb->n++;
    }
}
static int imin(int a, int b) {
    return a < b ? a : b;
}

/* Batch `step` of feeding `how` (done: tokens fed per sequence so far). 0 when all are fed. */
static int feed_next(int how, int step, int n_seq, const int *len, int *done, feed_batch *fb) {
    static const int chunk[] = {1, 2, 37, 3, 64, 5, 70, 1};
    static const int prefill[MAX_SEQ] = {5, 0, 17}; /* decode: sequence 1 starts in decode */
    fb->n = 0;
    fb->no_runs = 0;
    int live = 0;
    for (int s = 0; s < n_seq; s++)
        live += done[s] < len[s];
    if (!live) return 0;
    for (int k = 0; k < n_seq; k++) {
        const int s = (step + k) % n_seq, rem = len[s] - done[s]; /* a different order each batch */
        if (rem <= 0) continue;
        switch (how) {
        case FEED_ONE_PREFILL:
        case FEED_TRAIN:
            feed_take(fb, s, rem, done);
            break;
        case FEED_CHUNKED:
            feed_take(fb, s, imin(rem, chunk[(step + s) % 8]), done);
            break;
        case FEED_DECODE:
            if (step == 0)
                feed_take(fb, s, imin(rem, prefill[s]), done);
            else if (step % 5 == 4)
                feed_take(fb, s, imin(rem, 1 + (step + s) % 4), done);
            else
                feed_take(fb, s, 1, done);
            break;
        }
    }
    fb->no_runs = how == FEED_DECODE && step > 0 && step % 5 != 4;
    return 1;
}

/* One call of the op on a gathered batch: in (N, row_in), out (N, row_out). */
typedef void (*feed_call_fn)(kiln_backend *be, void *ctx, float *out, const float *in, float *state,
                             const int32_t *seq, const int32_t *pos, const kiln_batch_run *runs,
                             int n_runs, int N);
typedef struct feed_op {
    feed_call_fn call;
    void *ctx;
    int row_in, row_out;
} feed_op;

/* Feeds in[s] (len[s], row_in) as `how` says; out[s] (len[s], row_out). state: the op's
 * state (its garbage kept by the caller), NULL for FEED_TRAIN. Returns the number of calls. */
static int feed_run(kiln_backend *be, const feed_op *op, int how, int n_seq, const int *len,
                    float *const *in, float *const *out, float *state) {
    static feed_batch fb;
    int done[MAX_SEQ] = {0}, calls = 0;
    float *bin = new_vec((size_t)MAX_TOK * op->row_in),
          *bout = new_vec((size_t)MAX_TOK * op->row_out);
    kiln_batch_run runs[MAX_SEQ];
    for (int step = 0; feed_next(how, step, n_seq, len, done, &fb); step++) {
        const int N = fb.n;
        int n_runs = 0;
        for (int t = 0; t < N; t++) {
            memcpy(bin + (size_t)t * op->row_in, in[fb.seq[t]] + (size_t)fb.pos[t] * op->row_in,
                   (size_t)op->row_in * sizeof(float));
            if (t == 0 || fb.seq[t] != fb.seq[t - 1])
                runs[n_runs++] = (kiln_batch_run){t, 0, fb.seq[t], fb.pos[t]};
            runs[n_runs - 1].n++;
        }
        poison(bout, (size_t)N * op->row_out);
        if (how == FEED_TRAIN)
            op->call(be, op->ctx, bout, bin, NULL, NULL, NULL, runs, n_runs, N);
        else
            op->call(be, op->ctx, bout, bin, state, fb.seq, fb.pos, fb.no_runs ? NULL : runs,
                     n_runs, N);
        for (int t = 0; t < N; t++)
            memcpy(out[fb.seq[t]] + (size_t)fb.pos[t] * op->row_out, bout + (size_t)t * op->row_out,
                   (size_t)op->row_out * sizeof(float));
        calls++;
    }
    free(bin), free(bout);
    return calls;
}

/* Runs every feeding on every backend; checks that each gives (backend 0, one prefill)'s bits
 * (outputs, and final states but for training), and leaves those in out0 / state0. Backend 0
 * starts each feeding from garbage, the others from the state the previous run left: either
 * way every sequence's first run is at position 0 and must ignore it. */
static void feed_all(const feed_op *op, const char *what, int n_seq, const int *len,
                     float *const *in, float *const *out0, float *state0, size_t state_n) {
    float *garbage = rnd_vec(state_n, -5, 5), *state = new_vec(state_n);
    float *out[MAX_SEQ];
    for (int s = 0; s < n_seq; s++)
        out[s] = new_vec((size_t)len[s] * op->row_out);
    for (int how = 0; how < N_FEED; how++)
        for (int b = 0; b < N_BE; b++) {
            if (b == 0) memcpy(state, garbage, state_n * sizeof(float));
            const int calls =
                feed_run(g_be[b], op, how, n_seq, len, in, how || b ? out : out0, state);
            if (!how && !b) {
                memcpy(state0, state, state_n * sizeof(float));
                continue;
            }
            if (b == 0) printf("  %s, %s: %d calls\n", what, feed_name[how], calls);
            for (int s = 0; s < n_seq; s++)
                CHECK_MSG(same_bits(out[s], out0[s], (size_t)len[s] * op->row_out, what),
                          "%s: %s, %d threads, sequence %d: not one prefill's bits", what,
                          feed_name[how], b + 1, s);
            if (how != FEED_TRAIN)
                CHECK_MSG(same_bits(state, state0, state_n, what),
                          "%s: %s, %d threads: final state", what, feed_name[how], b + 1);
        }
    for (int s = 0; s < n_seq; s++)
        free(out[s]);
    free(garbage), free(state);
}

/* ---- conv1d_silu ----------------------------------------------------------------------- */

typedef struct conv_ctx {
    const float *w; /* (CH, K) */
    int CH, K;
} conv_ctx;

static void conv_call(kiln_backend *be, void *ctx, float *out, const float *in, float *state,
                      const int32_t *seq, const int32_t *pos, const kiln_batch_run *runs,
                      int n_runs, int N) {
    const conv_ctx *c = ctx;
    be->i->conv1d_silu(be, out, in, c->w, state, seq, pos, runs, n_runs, N, c->CH, c->K);
}

/* float64: out[t, c] = silu(sum_j w[c, j] x[t - K + 1 + j, c]), x before position 0 zero. */
static void ref_conv(double *out, const double *x, const double *w, int T, int CH, int K) {
    for (int t = 0; t < T; t++)
        for (int c = 0; c < CH; c++) {
            double s = 0;
            for (int j = 0; j < K; j++) {
                const int p = t - K + 1 + j;
                if (p >= 0) s += w[(size_t)c * K + j] * x[(size_t)p * CH + c];
            }
            out[(size_t)t * CH + c] = silu_d(s);
        }
}

static void test_conv1d_silu(void) {
    const int CH = 600, K = 4, n_seq = 3, len[MAX_SEQ] = {150, 131, 2};
    float *w = rnd_vec((size_t)CH * K, -1, 1), *in[MAX_SEQ], *out[MAX_SEQ];
    for (int s = 0; s < n_seq; s++) {
        in[s] = rnd_vec((size_t)len[s] * CH, -3, 3);
        out[s] = new_vec((size_t)len[s] * CH);
    }
    conv_ctx cc = {w, CH, K};
    const feed_op op = {conv_call, &cc, CH, CH};
    const size_t state_n = (size_t)n_seq * (K - 1) * CH;
    float *state = new_vec(state_n);
    feed_all(&op, "conv1d_silu", n_seq, len, in, out, state, state_n);

    double err = 0, scale = 1e-30;
    double *wd = to_d(w, (size_t)CH * K);
    int state_ok = 1;
    for (int s = 0; s < n_seq; s++) {
        double *xd = to_d(in[s], (size_t)len[s] * CH),
               *ref = malloc((size_t)len[s] * CH * sizeof *ref);
        ref_conv(ref, xd, wd, len[s], CH, K);
        for (size_t i = 0; i < (size_t)len[s] * CH; i++)
            fold_err(out[s][i], ref[i], &err, &scale);
        /* the state: row r holds the input at position len - (K - 1) + r, zero before 0 */
        for (int r = 0; r < K - 1; r++)
            for (int c = 0; c < CH; c++) {
                const int p = len[s] - (K - 1) + r;
                const float want = p >= 0 ? in[s][(size_t)p * CH + c] : 0.0f;
                state_ok &= bits(state[((size_t)s * (K - 1) + r) * CH + c]) == bits(want);
            }
        free(xd), free(ref);
    }
    printf("conv1d_silu: max error %.3g of max |out| vs float64 (CH=%d, K=%d, lengths %d %d %d)\n",
           err / scale, CH, K, len[0], len[1], len[2]);
    CHECK_MSG(err / scale <= FWD_TOL, "%g", err / scale);
    CHECK_MSG(state_ok, "conv1d_silu: the state is not the last K - 1 inputs");
    for (int s = 0; s < n_seq; s++)
        free(in[s]), free(out[s]);
    free(w), free(wd), free(state);
}

/* ---- conv1d_silu_backward -------------------------------------------------------------- */

typedef struct conv_fd {
    double *x, *w, *R; /* x (n_seq T, CH), w (CH, K), R (n_seq T, CH) */
    int n_seq, T, CH, K;
} conv_fd;

/* The loss's part from sequence b, channel c: sum over t of out[b, t, c] R[b, t, c]. */
static double conv_loss_part(const conv_fd *f, int b, int c) {
    double L = 0;
    for (int t = 0; t < f->T; t++) {
        double s = 0;
        for (int j = 0; j < f->K; j++) {
            const int p = t - f->K + 1 + j;
            if (p >= 0) s += f->w[(size_t)c * f->K + j] * f->x[((size_t)b * f->T + p) * f->CH + c];
        }
        L += silu_d(s) * f->R[((size_t)b * f->T + t) * f->CH + c];
    }
    return L;
}

static void test_conv1d_silu_backward_case(int n_seq, int T, int CH, int K) {
    const size_t N = (size_t)n_seq * T, nx = N * CH, nw = (size_t)CH * K;
    float *x = rnd_vec(nx, -3, 3), *w = rnd_vec(nw, -1, 1), *dout = rnd_vec(nx, -1, 1);
    float *dw_base = rnd_vec(nw, -1, 1), *dx[N_BE], *dw[N_BE], *dw0 = new_vec(nw);
    for (int b = 0; b < N_BE; b++) {
        dx[b] = new_vec(nx);
        dw[b] = new_vec(nw);
        poison(dx[b], nx);
        memcpy(dw[b], dw_base, nw * sizeof(float));
        g_be[b]->i->conv1d_silu_backward(g_be[b], dx[b], dw[b], dout, x, w, n_seq, T, CH, K);
        if (b) {
            CHECK_MSG(same_bits(dx[b], dx[0], nx, "conv dx"), "%d threads", b + 1);
            CHECK_MSG(same_bits(dw[b], dw[0], nw, "conv dw"), "%d threads", b + 1);
        }
    }
    /* dw is accumulated: from zero it gives v, from the base exactly base + v */
    float *dx0 = new_vec(nx);
    memset(dw0, 0, nw * sizeof(float));
    g_be[0]->i->conv1d_silu_backward(g_be[0], dx0, dw0, dout, x, w, n_seq, T, CH, K);
    int acc_ok = 1;
    for (size_t i = 0; i < nw; i++)
        acc_ok &= bits(dw[0][i]) == bits(dw_base[i] + dw0[i]);
    CHECK_MSG(acc_ok, "conv1d_silu_backward: dw is not dw + the step's sum");
    CHECK(same_bits(dx0, dx[0], nx, "conv dx (dw from zero)"));

    conv_fd f = {to_d(x, nx), to_d(w, nw), to_d(dout, nx), n_seq, T, CH, K};
    double ex = 0, sx = 1e-30, ew = 0, sw = 1e-30;
    const size_t stride = nx > 20000 ? 7 : 1; /* the large case: every 7th input */
    for (size_t i = 0; i < nx; i += stride) {
        const int b = (int)(i / CH / T), c = (int)(i % CH);
        const double keep = f.x[i];
        f.x[i] = keep + FD_H;
        const double lp = conv_loss_part(&f, b, c);
        f.x[i] = keep - FD_H;
        const double lm = conv_loss_part(&f, b, c);
        f.x[i] = keep;
        fold_err(dx[0][i], (lp - lm) / (2 * FD_H), &ex, &sx);
    }
    for (size_t i = 0; i < nw; i++) {
        const int c = (int)(i / K);
        const double keep = f.w[i];
        double lp = 0, lm = 0;
        for (int b = 0; b < n_seq; b++) {
            f.w[i] = keep + FD_H;
            lp += conv_loss_part(&f, b, c);
            f.w[i] = keep - FD_H;
            lm += conv_loss_part(&f, b, c);
        }
        f.w[i] = keep;
        fold_err(dw0[i], (lp - lm) / (2 * FD_H), &ew, &sw);
    }
    printf(
        "conv1d_silu_backward n_seq=%d T=%d CH=%d K=%d: dx %.3g, dw %.3g of max |grad| vs central "
        "differences\n",
        n_seq, T, CH, K, ex / sx, ew / sw);
    CHECK_MSG(ex / sx <= FD_TOL && ew / sw <= FD_TOL, "%g %g", ex / sx, ew / sw);
    for (int b = 0; b < N_BE; b++)
        free(dx[b]), free(dw[b]);
    free(x), free(w), free(dout), free(dw_base), free(dw0), free(dx0);
    free(f.x), free(f.w), free(f.R);
}

static void test_conv1d_silu_backward(void) {
    test_conv1d_silu_backward_case(2, 70, 40, 4);
    test_conv1d_silu_backward_case(3, 2, 5, 4);     /* fewer tokens than K - 1 */
    test_conv1d_silu_backward_case(2, 150, 600, 4); /* large enough for several tasks */
}

/* ---- gated_delta ----------------------------------------------------------------------- */

typedef struct gdn_dims {
    int nk, nv, dk, dv;
    float scale;
} gdn_dims;
static int gdn_W(const gdn_dims *d) {
    return 2 * d->nk * d->dk + d->nv * d->dv;
}

/* float64, one value head h of one sequence from a zero state, straight from the math:
 * q, k of key head h / (nv / nk) l2-normalised (x / sqrt(sum x^2 + 1e-6)), q times scale;
 * S = exp(g) S; delta = beta (v - S^T k); S = S + k delta^T; o = S^T q.
 * qkv (T, W), g, beta (T, nv); o (T, dv) of the head; S_end (dk, dv) or NULL. */
static void ref_gdn_head(double *o, double *S_end, const double *qkv, const double *g,
                         const double *beta, int T, const gdn_dims *d, int h) {
    const int W = gdn_W(d), kh = h / (d->nv / d->nk), dk = d->dk, dv = d->dv;
    double *S = calloc((size_t)dk * dv, sizeof *S), *qn = malloc(dk * sizeof *qn),
           *kn = malloc(dk * sizeof *kn);
    double *delta = malloc(dv * sizeof *delta);
    for (int t = 0; t < T; t++) {
        const double *q = qkv + (size_t)t * W + (size_t)kh * dk, *k = q + (size_t)d->nk * dk;
        const double *v = qkv + (size_t)t * W + 2 * (size_t)d->nk * dk + (size_t)h * dv;
        double sq = 0, sk = 0;
        for (int i = 0; i < dk; i++)
            sq += q[i] * q[i], sk += k[i] * k[i];
        for (int i = 0; i < dk; i++) {
            qn[i] = q[i] / sqrt(sq + 1e-6) * d->scale;
            kn[i] = k[i] / sqrt(sk + 1e-6);
        }
        const double decay = exp(g[(size_t)t * d->nv + h]), bt = beta[(size_t)t * d->nv + h];
        for (size_t e = 0; e < (size_t)dk * dv; e++)
            S[e] *= decay;
        for (int j = 0; j < dv; j++) {
            double mem = 0;
            for (int i = 0; i < dk; i++)
                mem += S[(size_t)i * dv + j] * kn[i];
            delta[j] = bt * (v[j] - mem);
        }
        for (int i = 0; i < dk; i++)
            for (int j = 0; j < dv; j++)
                S[(size_t)i * dv + j] += kn[i] * delta[j];
        for (int j = 0; j < dv; j++) {
            double acc = 0;
            for (int i = 0; i < dk; i++)
                acc += S[(size_t)i * dv + j] * qn[i];
            o[(size_t)t * dv + j] = acc;
        }
    }
    if (S_end) memcpy(S_end, S, (size_t)dk * dv * sizeof *S);
    free(S), free(qn), free(kn), free(delta);
}

/* A token row of the feed: [qkv (W) | g (nv) | beta (nv)]. */
typedef struct gdn_ctx {
    gdn_dims d;
    float *qkv, *g, *beta; /* (MAX_TOK, ...) gathered */
} gdn_ctx;

static void gdn_call(kiln_backend *be, void *ctx, float *out, const float *in, float *state,
                     const int32_t *seq, const int32_t *pos, const kiln_batch_run *runs, int n_runs,
                     int N) {
    gdn_ctx *c = ctx;
    const int W = gdn_W(&c->d), nv = c->d.nv;
    for (int t = 0; t < N; t++) {
        const float *row = in + (size_t)t * (W + 2 * nv);
        memcpy(c->qkv + (size_t)t * W, row, (size_t)W * sizeof(float));
        memcpy(c->g + (size_t)t * nv, row + W, (size_t)nv * sizeof(float));
        memcpy(c->beta + (size_t)t * nv, row + W + nv, (size_t)nv * sizeof(float));
    }
    be->i->gated_delta(be, out, c->qkv, c->g, c->beta, state, seq, pos, runs, n_runs, N, c->d.nk,
                       c->d.nv, c->d.dk, c->d.dv, c->d.scale);
}

/* Random inputs of T tokens: q, k, v in [-1, 1] (one token with q, k ~1e-3, where the eps of
 * the l2 norm matters), g = -exp(U(-5, 0.5)) (decays from 0.19 to 0.993), beta in (0, 1). */
static void gdn_inputs(float *qkv, float *g, float *beta, int T, const gdn_dims *d) {
    const int W = gdn_W(d);
    for (int t = 0; t < T; t++) {
        const float amp = t == 10 ? 1e-3f : 1.0f;
        for (int c = 0; c < W; c++)
            qkv[(size_t)t * W + c] = rnd_f(-1, 1) * (c < 2 * d->nk * d->dk ? amp : 1.0f);
        for (int h = 0; h < d->nv; h++) {
            g[(size_t)t * d->nv + h] = -expf(rnd_f(-5.0f, 0.5f));
            beta[(size_t)t * d->nv + h] = rnd_f(0.02f, 0.98f);
        }
    }
}

static void test_gated_delta_case(const gdn_dims *d) {
    const int n_seq = 3, len[MAX_SEQ] = {150, 131, 77}, W = gdn_W(d), nv = d->nv, dk = d->dk,
              dv = d->dv;
    const int row_in = W + 2 * nv, row_out = nv * dv;
    float *in[MAX_SEQ], *out[MAX_SEQ];
    float *qkv = new_vec((size_t)150 * W), *g = new_vec((size_t)150 * nv),
          *beta = new_vec((size_t)150 * nv);
    for (int s = 0; s < n_seq; s++) {
        gdn_inputs(qkv, g, beta, len[s], d);
        in[s] = new_vec((size_t)len[s] * row_in);
        for (int t = 0; t < len[s]; t++) {
            memcpy(in[s] + (size_t)t * row_in, qkv + (size_t)t * W, (size_t)W * sizeof(float));
            memcpy(in[s] + (size_t)t * row_in + W, g + (size_t)t * nv, (size_t)nv * sizeof(float));
            memcpy(in[s] + (size_t)t * row_in + W + nv, beta + (size_t)t * nv,
                   (size_t)nv * sizeof(float));
        }
        out[s] = new_vec((size_t)len[s] * row_out);
    }
    gdn_ctx gc = {*d, new_vec((size_t)MAX_TOK * W), new_vec((size_t)MAX_TOK * nv),
                  new_vec((size_t)MAX_TOK * nv)};
    const feed_op op = {gdn_call, &gc, row_in, row_out};
    const size_t SN = (size_t)dk * dv, state_n = (size_t)n_seq * nv * SN;
    float *state = new_vec(state_n);
    char what[64];
    snprintf(what, sizeof what, "gated_delta nk=%d nv=%d dk=%d dv=%d", d->nk, nv, dk, dv);
    feed_all(&op, what, n_seq, len, in, out, state, state_n);

    double eo = 0, so = 1e-30, es = 0, ss = 1e-30;
    for (int s = 0; s < n_seq; s++) {
        const int T = len[s];
        double *qd = malloc((size_t)T * W * sizeof *qd), *gd = malloc((size_t)T * nv * sizeof *gd);
        double *bd = malloc((size_t)T * nv * sizeof *bd), *o = malloc((size_t)T * dv * sizeof *o);
        double *S = malloc(SN * sizeof *S);
        for (int t = 0; t < T; t++) {
            for (int c = 0; c < W; c++)
                qd[(size_t)t * W + c] = in[s][(size_t)t * row_in + c];
            for (int h = 0; h < nv; h++) {
                gd[(size_t)t * nv + h] = in[s][(size_t)t * row_in + W + h];
                bd[(size_t)t * nv + h] = in[s][(size_t)t * row_in + W + nv + h];
            }
        }
        for (int h = 0; h < nv; h++) {
            ref_gdn_head(o, S, qd, gd, bd, T, d, h);
            for (int t = 0; t < T; t++)
                for (int j = 0; j < dv; j++)
                    fold_err(out[s][(size_t)t * row_out + (size_t)h * dv + j],
                             o[(size_t)t * dv + j], &eo, &so);
            for (size_t e = 0; e < SN; e++)
                fold_err(state[((size_t)s * nv + h) * SN + e], S[e], &es, &ss);
        }
        free(qd), free(gd), free(bd), free(o), free(S);
    }
    printf("%s: max error vs float64 %.3g of max |out|, final state %.3g of max |S|\n", what,
           eo / so, es / ss);
    CHECK_MSG(eo / so <= GDN_TOL && es / ss <= GDN_TOL, "%g %g", eo / so, es / ss);
    for (int s = 0; s < n_seq; s++)
        free(in[s]), free(out[s]);
    free(qkv), free(g), free(beta), free(gc.qkv), free(gc.g), free(gc.beta), free(state);
}

static void test_gated_delta(void) {
    const gdn_dims a = {2, 4, 16, 16, 0.25f}, b = {1, 2, 32, 16, 0.176776695f};
    test_gated_delta_case(&a);
    test_gated_delta_case(&b);
    const gdn_dims c = {1, 2, 16, 80, 0.25f};
    test_gated_delta_case(&c);
}

/* ---- gated_delta_backward -------------------------------------------------------------- */

typedef struct gdn_fd {
    gdn_dims d;
    int n_seq, T;
    double *qkv, *g, *beta, *R; /* (N, W), (N, nv), (N, nv), (N, nv dv) */
    double *o;                  /* (T, dv) scratch */
} gdn_fd;

/* The loss's part from sequence b, value head h: sum over t, j of o[t, j] R[b T + t, h dv + j]. */
static double gdn_loss_part(gdn_fd *f, int b, int h) {
    const size_t r0 = (size_t)b * f->T;
    const int W = gdn_W(&f->d), nv = f->d.nv, dv = f->d.dv;
    ref_gdn_head(f->o, NULL, f->qkv + r0 * W, f->g + r0 * nv, f->beta + r0 * nv, f->T, &f->d, h);
    double L = 0;
    for (int t = 0; t < f->T; t++)
        for (int j = 0; j < dv; j++)
            L += f->o[(size_t)t * dv + j] * f->R[(r0 + t) * nv * dv + (size_t)h * dv + j];
    return L;
}
/* Central difference in p[i], which reaches value heads h0 .. h1 - 1 of sequence b only. */
static double gdn_fd_at(gdn_fd *f, double *p, size_t i, int b, int h0, int h1) {
    const double keep = p[i];
    double lp = 0, lm = 0;
    for (int h = h0; h < h1; h++) {
        p[i] = keep + FD_H;
        lp += gdn_loss_part(f, b, h);
        p[i] = keep - FD_H;
        lm += gdn_loss_part(f, b, h);
    }
    p[i] = keep;
    return (lp - lm) / (2 * FD_H);
}

static void test_gated_delta_backward_case(const gdn_dims *d, int n_seq, int T, int n_fd_qkv) {
    const int W = gdn_W(d), nv = d->nv, dk = d->dk, dv = d->dv, G = nv / d->nk, KD = d->nk * dk;
    const size_t N = (size_t)n_seq * T;
    float *qkv = new_vec(N * W), *g = new_vec(N * nv), *beta = new_vec(N * nv);
    for (int b = 0; b < n_seq; b++)
        gdn_inputs(qkv + (size_t)b * T * W, g + (size_t)b * T * nv, beta + (size_t)b * T * nv, T,
                   d);
    float *dout = rnd_vec(N * nv * dv, -1, 1);
    const size_t ws_n = kiln_gated_delta_backward_ws_floats(n_seq, T, d->nk, nv, dk, dv);
    float *ws = new_vec(ws_n), *dqkv[N_BE], *dg[N_BE], *dbeta[N_BE];
    for (int b = 0; b < N_BE; b++) {
        dqkv[b] = new_vec(N * W), dg[b] = new_vec(N * nv), dbeta[b] = new_vec(N * nv);
        poison(dqkv[b], N * W), poison(dg[b], N * nv), poison(dbeta[b], N * nv), poison(ws, ws_n);
        g_be[b]->i->gated_delta_backward(g_be[b], dqkv[b], dg[b], dbeta[b], dout, qkv, g, beta, ws,
                                         n_seq, T, d->nk, nv, dk, dv, d->scale);
        if (b) {
            CHECK_MSG(same_bits(dqkv[b], dqkv[0], N * W, "gdn dqkv"), "%d threads", b + 1);
            CHECK_MSG(same_bits(dg[b], dg[0], N * nv, "gdn dg"), "%d threads", b + 1);
            CHECK_MSG(same_bits(dbeta[b], dbeta[0], N * nv, "gdn dbeta"), "%d threads", b + 1);
        }
    }
    /* against central differences of the float64 forward: a random sample of qkv's elements,
     * every g and beta; errors per part (q, k, v, g, beta) relative to the part's max |grad| */
    gdn_fd f = {*d,
                n_seq,
                T,
                to_d(qkv, N * W),
                to_d(g, N * nv),
                to_d(beta, N * nv),
                to_d(dout, N * nv * dv),
                malloc((size_t)T * dv * sizeof(double))};
    double e[5] = {0}, sc[5] = {1e-30, 1e-30, 1e-30, 1e-30, 1e-30};
    for (int n = 0; n < n_fd_qkv; n++) {
        const size_t i = (size_t)(rnd_u64() % (N * W));
        const int b = (int)(i / W / T), col = (int)(i % W);
        const int part = col < KD ? 0 : col < 2 * KD ? 1 : 2;
        const int h0 = part == 2 ? (col - 2 * KD) / dv : (col % KD) / dk * G,
                  h1 = part == 2 ? h0 + 1 : h0 + G;
        fold_err(dqkv[0][i], gdn_fd_at(&f, f.qkv, i, b, h0, h1), &e[part], &sc[part]);
    }
    for (size_t i = 0; i < N * nv; i++) {
        const int b = (int)(i / nv / T), h = (int)(i % nv);
        fold_err(dg[0][i], gdn_fd_at(&f, f.g, i, b, h, h + 1), &e[3], &sc[3]);
        fold_err(dbeta[0][i], gdn_fd_at(&f, f.beta, i, b, h, h + 1), &e[4], &sc[4]);
    }
    printf("gated_delta_backward nk=%d nv=%d dk=%d dv=%d n_seq=%d T=%d vs central differences (of "
           "max |grad|):"
           " dq %.3g, dk %.3g, dv %.3g, dg %.3g, dbeta %.3g\n",
           d->nk, nv, dk, dv, n_seq, T, e[0] / sc[0], e[1] / sc[1], e[2] / sc[2], e[3] / sc[3],
           e[4] / sc[4]);
    for (int p = 0; p < 5; p++)
        CHECK_MSG(e[p] / sc[p] <= FD_TOL, "part %d: %g", p, e[p] / sc[p]);
    for (int b = 0; b < N_BE; b++)
        free(dqkv[b]), free(dg[b]), free(dbeta[b]);
    free(qkv), free(g), free(beta), free(dout), free(ws);
    free(f.qkv), free(f.g), free(f.beta), free(f.R), free(f.o);
}

static void test_gated_delta_backward(void) {
    const gdn_dims a = {2, 4, 16, 16, 0.25f}, b = {1, 2, 32, 16, 0.176776695f};
    test_gated_delta_backward_case(&a, 2, 150, 1500);
    test_gated_delta_backward_case(&b, 3, 150, 1500);
    test_gated_delta_backward_case(&a, 1, 64, 300); /* exactly one chunk */
    /* dv 80: three column groups (32, 32, 16) whose partial sums meet */
    const gdn_dims c = {1, 2, 16, 80, 0.25f};
    test_gated_delta_backward_case(&c, 2, 70, 600);
}

/* ---- gdn_gates (+backward) ------------------------------------------------------------- */

static void test_gdn_gates(void) {
    const int N = 64, nv = 5;
    const size_t n = (size_t)N * nv;
    float *a = rnd_vec(n, -8, 8), *b = rnd_vec(n, -8, 8), *A_log = rnd_vec(nv, -2, 2.5f),
          *dt = rnd_vec(nv, -3, 3);
    /* softplus's branches: a + dt_bias above 20 (x), below about -16.6 (e^x), and b far out */
    const float special[][2] = {{25, 30}, {-30, -30}, {21, 12}, {-17, 16}, {-16.5f, -16}, {0, 0}};
    for (int i = 0; i < 6; i++) {
        a[i * nv] = special[i][0] - dt[0];
        b[i * nv + 1] = special[i][1];
    }
    float *g[N_BE], *beta[N_BE];
    for (int e = 0; e < N_BE; e++) {
        g[e] = new_vec(n), beta[e] = new_vec(n);
        poison(g[e], n), poison(beta[e], n);
        g_be[e]->i->gdn_gates(g_be[e], g[e], beta[e], a, b, A_log, dt, N, nv);
        if (e) CHECK(same_bits(g[e], g[0], n, "g") && same_bits(beta[e], beta[0], n, "beta"));
    }
    /* x = a + dt_bias is a float32 add in transformers too (softplus(a.float() + dt_bias)):
     * the float64 references start from that sum (near x = -17 its rounding alone moves
     * softplus by 16 ulp) */
    double ug = 0, ub = 0;
    for (size_t i = 0; i < n; i++) {
        const int h = (int)(i % nv);
        const double x = (double)(a[i] + dt[h]);
        const double eg = ulp_err(g[0][i], -exp((double)A_log[h]) * softplus_d(x));
        const double eb = ulp_err(beta[0][i], sigmoid_d(b[i]));
        ug = eg > ug || eg != eg ? eg : ug;
        ub = eb > ub || eb != eb ? eb : ub;
    }
    printf("gdn_gates: g within %.3f ulp, beta within %.3f ulp of float64\n", ug, ub);
    CHECK_MSG(ug <= 3.5 && ub <= 2.0, "%g %g", ug, ub);

    /* backward: da, db against the float64 derivative; dA_log and ddt_bias (+=) against the
     * float64 sums, relative to the sums of |terms| */
    float *dg = rnd_vec(n, -1, 1), *dbeta = rnd_vec(n, -1, 1), *da[N_BE], *db[N_BE], *dA[N_BE],
          *ddt[N_BE];
    float *dA_base = rnd_vec(nv, -1, 1), *ddt_base = rnd_vec(nv, -1, 1);
    for (int e = 0; e < N_BE; e++) {
        da[e] = new_vec(n), db[e] = new_vec(n), dA[e] = new_vec(nv), ddt[e] = new_vec(nv);
        poison(da[e], n), poison(db[e], n);
        memcpy(dA[e], dA_base, nv * sizeof(float)), memcpy(ddt[e], ddt_base, nv * sizeof(float));
        g_be[e]->i->gdn_gates_backward(g_be[e], da[e], db[e], dA[e], ddt[e], dg, dbeta, a, b, A_log,
                                       dt, N, nv);
        if (e)
            CHECK(same_bits(da[e], da[0], n, "da") && same_bits(db[e], db[0], n, "db") &&
                  same_bits(dA[e], dA[0], nv, "dA_log") &&
                  same_bits(ddt[e], ddt[0], nv, "ddt_bias"));
    }
    float *da0 = new_vec(n), *db0 = new_vec(n), *dA0 = calloc(nv, sizeof(float)),
          *ddt0 = calloc(nv, sizeof(float));
    g_be[0]->i->gdn_gates_backward(g_be[0], da0, db0, dA0, ddt0, dg, dbeta, a, b, A_log, dt, N, nv);
    int acc_ok = 1;
    for (int h = 0; h < nv; h++)
        acc_ok &= bits(dA[0][h]) == bits(dA_base[h] + dA0[h]) &&
                  bits(ddt[0][h]) == bits(ddt_base[h] + ddt0[h]);
    CHECK_MSG(acc_ok, "gdn_gates_backward: dA_log, ddt_bias are not base + the step's sums");
    double uda = 0, edb = 0, sdb = 1e-30, eA = 0, eT = 0;
    for (int h = 0; h < nv; h++) {
        double sA = 0, mA = 0, sT = 0, mT = 0;
        for (int t = 0; t < N; t++) {
            const size_t i = (size_t)t * nv + h;
            const double x = (double)(a[i] + dt[h]), eA_ = exp((double)A_log[h]);
            const double gd = -eA_ * softplus_d(x), bd = sigmoid_d(b[i]);
            const double dad =
                dg[i] * -eA_ * (x > 20.0 ? 1.0 : sigmoid_d(x)); /* torch: 1 past the threshold */
            const double e = ulp_err(da0[i], dad);
            uda = e > uda || e != e ? e : uda;
            fold_err(db0[i], dbeta[i] * bd * (1.0 - bd), &edb, &sdb);
            sA += dg[i] * gd, mA += fabs(dg[i] * gd);
            sT += dad, mT += fabs(dad);
        }
        const double rA = fabs(dA0[h] - sA) / mA, rT = fabs(ddt0[h] - sT) / mT;
        eA = rA > eA || rA != rA ? rA : eA;
        eT = rT > eT || rT != rT ? rT : eT;
    }
    printf("gdn_gates_backward: da within %.3f ulp, db %.3g of max |db|, dA_log %.3g and ddt_bias "
           "%.3g of "
           "the sums of |terms|\n",
           uda, edb / sdb, eA, eT);
    CHECK_MSG(uda <= 3.5 && edb / sdb <= 1e-6 && eA <= 1e-6 && eT <= 1e-6, "%g %g %g %g", uda,
              edb / sdb, eA, eT);
    for (int e = 0; e < N_BE; e++)
        free(g[e]), free(beta[e]), free(da[e]), free(db[e]), free(dA[e]), free(ddt[e]);
    free(a), free(b), free(A_log), free(dt), free(dg), free(dbeta), free(dA_base), free(ddt_base);
    free(da0), free(db0), free(dA0), free(ddt0);
}

/* ---- sigmoid_mul (+backward), split/join_halves ---------------------------------------- */

static void test_sigmoid_mul(void) {
    const size_t n = 1003;
    float *x = rnd_vec(n, -3, 3), *gate = rnd_vec(n, -12, 12), *dout = rnd_vec(n, -1, 1);
    float *out = new_vec(n), *out0 = new_vec(n), *dx = new_vec(n), *dgate = new_vec(n),
          *dx0 = new_vec(n);
    float *dgate0 = new_vec(n), *alias = new_vec(n);
    for (int e = 0; e < N_BE; e++) {
        poison(out, n), poison(dx, n), poison(dgate, n);
        g_be[e]->i->sigmoid_mul(g_be[e], out, x, gate, n);
        g_be[e]->i->sigmoid_mul_backward(g_be[e], dx, dgate, dout, x, gate, n);
        if (!e) {
            memcpy(out0, out, n * 4), memcpy(dx0, dx, n * 4), memcpy(dgate0, dgate, n * 4);
            continue;
        }
        CHECK(same_bits(out, out0, n, "sigmoid_mul") && same_bits(dx, dx0, n, "sigmoid_mul dx") &&
              same_bits(dgate, dgate0, n, "sigmoid_mul dgate"));
    }
    /* aliasing: out over x; dx over dout; dgate over dout */
    memcpy(alias, x, n * 4);
    g_be[0]->i->sigmoid_mul(g_be[0], alias, alias, gate, n);
    CHECK(same_bits(alias, out0, n, "sigmoid_mul in place"));
    memcpy(alias, dout, n * 4);
    g_be[0]->i->sigmoid_mul_backward(g_be[0], alias, dgate, alias, x, gate, n);
    CHECK(same_bits(alias, dx0, n, "dx over dout") &&
          same_bits(dgate, dgate0, n, "dgate (dx over dout)"));
    memcpy(alias, dout, n * 4);
    g_be[0]->i->sigmoid_mul_backward(g_be[0], dx, alias, alias, x, gate, n);
    CHECK(same_bits(alias, dgate0, n, "dgate over dout") &&
          same_bits(dx, dx0, n, "dx (dgate over dout)"));

    double uo = 0, udx = 0, eg = 0, sg = 1e-30;
    for (size_t i = 0; i < n; i++) {
        const double s = sigmoid_d(gate[i]);
        const double e1 = ulp_err(out0[i], x[i] * s), e2 = ulp_err(dx0[i], dout[i] * s);
        uo = e1 > uo || e1 != e1 ? e1 : uo;
        udx = e2 > udx || e2 != e2 ? e2 : udx;
        fold_err(dgate0[i], (double)dout[i] * x[i] * s * (1.0 - s), &eg, &sg);
    }
    printf("sigmoid_mul: out within %.3f ulp; backward: dx within %.3f ulp, dgate %.3g of max "
           "|dgate| of float64\n",
           uo, udx, eg / sg);
    CHECK_MSG(uo <= 3.0 && udx <= 3.0 && eg / sg <= 1e-6, "%g %g %g", uo, udx, eg / sg);
    free(x), free(gate), free(dout), free(out), free(out0), free(dx), free(dgate), free(dx0),
        free(dgate0);
    free(alias);
}

static void test_halves(void) {
    const int64_t rows = 7;
    const int n = 13;
    float *x = rnd_vec((size_t)rows * 2 * n, -1, 1), *a = new_vec((size_t)rows * n),
          *b = new_vec((size_t)rows * n);
    float *y = new_vec((size_t)rows * 2 * n);
    for (int e = 0; e < N_BE; e++) {
        poison(a, (size_t)rows * n), poison(b, (size_t)rows * n), poison(y, (size_t)rows * 2 * n);
        g_be[e]->i->split_halves(g_be[e], a, b, x, rows, n);
        int ok = 1;
        for (int64_t r = 0; r < rows; r++)
            for (int i = 0; i < n; i++)
                ok &= bits(a[r * n + i]) == bits(x[r * 2 * n + i]) &&
                      bits(b[r * n + i]) == bits(x[r * 2 * n + n + i]);
        CHECK_MSG(ok, "split_halves");
        g_be[e]->i->join_halves(g_be[e], y, a, b, rows, n);
        CHECK(same_bits(y, x, (size_t)rows * 2 * n, "join_halves(split_halves(x))"));
    }
    free(x), free(a), free(b), free(y);
}

/* ---- rope_partial (+backward) ---------------------------------------------------------- */

static void test_rope_partial(void) {
    const int N = 6, H = 3, HS = 32, P = 64;
    const int32_t pos[6] = {0, 1, 7, 39, 20, 63};
    const size_t n = (size_t)N * H * HS;
    const int rots[] = {HS, 16, 8, 2, 0};
    for (int ri = 0; ri < 5; ri++) {
        const int rot = rots[ri], half = rot / 2;
        float *ct = new_vec((size_t)P * half), *st = new_vec((size_t)P * half);
        for (int p = 0; p < P; p++)
            for (int i = 0; i < half; i++) { /* transformers: inv_freq[i] = theta^(-2i / rot) */
                const double th = p * pow(10000.0, -2.0 * i / rot);
                ct[p * half + i] = (float)cos(th);
                st[p * half + i] = (float)sin(th);
            }
        float *x = rnd_vec(n, -2, 2), *y = rnd_vec(n, -2, 2), *rx = new_vec(n), *ry = new_vec(n);
        float *rx0 = new_vec(n), *ry0 = new_vec(n);
        for (int e = 0; e < N_BE; e++) {
            memcpy(rx, x, n * 4), memcpy(ry, y, n * 4);
            g_be[e]->i->rope_partial(g_be[e], rx, pos, N, H, HS, rot, ct, st);
            g_be[e]->i->rope_partial_backward(g_be[e], ry, pos, N, H, HS, rot, ct, st);
            if (!e)
                memcpy(rx0, rx, n * 4), memcpy(ry0, ry, n * 4);
            else
                CHECK(same_bits(rx, rx0, n, "rope_partial") &&
                      same_bits(ry, ry0, n, "rope_partial_backward"));
        }
        if (rot == HS) { /* the whole head: rope and rope_backward, bit for bit */
            memcpy(rx, x, n * 4), memcpy(ry, y, n * 4);
            g_be[0]->i->rope(g_be[0], rx, pos, N, H, HS, ct, st);
            g_be[0]->i->rope_backward(g_be[0], ry, pos, N, H, HS, ct, st);
            CHECK(same_bits(rx0, rx, n, "rope_partial(rot = HS) vs rope"));
            CHECK(same_bits(ry0, ry, n, "rope_partial_backward(rot = HS) vs rope_backward"));
        }
        /* float64 rotation of the first rot dims (by the tables' angles); the rest untouched */
        double err = 0, xr = 0, ry_ = 0, mag = 0;
        int pass_ok = 1;
        for (int t = 0; t < N; t++)
            for (int h = 0; h < H; h++) {
                const size_t o = ((size_t)t * H + h) * HS;
                for (int i = 0; i < half; i++) {
                    const double c = ct[pos[t] * half + i], s = st[pos[t] * half + i];
                    const double a = x[o + i], b = x[o + i + half];
                    err = fmax(err, fabs(rx0[o + i] - (a * c - b * s)) / (fabs(a) + fabs(b)));
                    err =
                        fmax(err, fabs(rx0[o + i + half] - (b * c + a * s)) / (fabs(a) + fabs(b)));
                }
                for (int i = rot; i < HS; i++)
                    pass_ok = pass_ok && bits(rx0[o + i]) == bits(x[o + i]) &&
                              bits(ry0[o + i]) == bits(y[o + i]);
            }
        /* the transpose: <rope(x), y> = <x, rope_backward(y)> */
        for (size_t i = 0; i < n; i++) {
            xr += (double)rx0[i] * y[i];
            ry_ += (double)x[i] * ry0[i];
            mag += fabs((double)x[i] * y[i]);
        }
        printf("rope_partial HS=%d rot=%d: %.3g of |a|+|b| vs float64; <rope(x),y> - "
               "<x,rope_backward(y)> = "
               "%.3g of sum |x y|\n",
               HS, rot, err, fabs(xr - ry_) / mag);
        CHECK_MSG(err <= 1.2e-7 && pass_ok && fabs(xr - ry_) <= 1e-6 * mag, "rot %d: %g %g", rot,
                  err, fabs(xr - ry_) / mag);
        free(ct), free(st), free(x), free(y), free(rx), free(ry), free(rx0), free(ry0);
    }
}

int main(void) {
    const clock_t t0 = clock();
    make_backends();
    test_log_softplus();
    test_gdn_gates();
    test_sigmoid_mul();
    test_halves();
    test_rope_partial();
    test_conv1d_silu();
    test_conv1d_silu_backward();
    test_gated_delta();
    test_gated_delta_backward();
    for (int b = 0; b < N_BE; b++)
        kiln_backend_free(g_be[b]);
    printf("(%.1f s of CPU)\n", (double)(clock() - t0) / CLOCKS_PER_SEC);
    return test_finish("test_linear_attn");
}
