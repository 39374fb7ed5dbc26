/*
 * test_cuda_fused_ce_fast.cu -- the fused linear cross-entropy (kiln_fused_ce) on the CUDA
 * backend's FAST mode against the same call on the auditable CUDA backend (whose bits are the
 * CPU's: tests/gpu/test_cuda_train_ops.cu), and against itself.
 *
 * Cases: N in {1, 7, 2047, 2048} x H in {64, 576, 896} x V in {1000, 49152}, weights f32 and
 * bf16 (alternating), MEAN and SUM, dhidden overwritten (poisoned with NaN first) or
 * accumulated, dweight accumulated, targets -1 mixed in (every 5th row; for N = 2048 only the
 * last row, which gives the odd S = 2047 of a shifted training sequence), one case with a
 * mask, and extra cases with chunk 300 (several chunks of a width not a multiple of 8).
 * Per case:
 *   - the fast call runs three times: twice in full (row_stats_out), once with row_stats_in
 *     from the first: all three give the same bits (loss, loss_f64, row_loss, row_stats,
 *     dhidden, dweight); a fourth run, with row_stats_in, no_wait and the caller's scratch
 *     (the trainer's backward call), gives the third's dhidden and dweight and a NaN loss;
 *   - against the auditable call: the loss within a relative 1e-2, and row_loss, dhidden and
 *     the dweight gradient (output minus its initial value) within a norm-wise relative error
 *     ||fast - aud|| / ||aud|| <= 1e-2 (bf16 operands: 2^-8 per rounding; the measured figures
 *     are printed); row_stats' max logit and target logit norm-wise within 1e-2;
 *   - exact properties: every output element finite, unsupervised rows of row_loss and of an
 *     overwritten dhidden exactly 0, an accumulated dhidden's unsupervised rows untouched;
 *     n_supervised equal; scratch_bytes <= kiln_fused_ce_scratch_bytes.
 * One line per case ("fused_ce fast ... err loss 3.1e-4 row 2.0e-3 dh 2.5e-3 dW 2.7e-3 OK").
 *
 * Then the bf16 path (fused_ce.c, ce_pass2_bf16: hs rounded once, g written in bf16, the GEMMs
 * called directly) against the composition it replaced (the backend's matmul and
 * matmul_backward per chunk, still reachable through kiln_cuda_ce_set_legacy): the same call
 * both ways must give the SAME BITS (loss, loss_f64, row_loss, row_stats, dhidden, dweight),
 * the bf16 path twice in a row too. Cases: odd S (2047, 801, 10), chunks that do not divide V
 * (last chunks of 848, 7 and 1 columns), H = 100 (leading dimension padded to 104), f32 and
 * bf16 weights, a bf16 weight 2 bytes off 16-byte alignment (the GEMMs take a copy), dh only,
 * dW only, the loss alone, pass 2 alone from row_stats_in (the trainer's backward call).
 * Each case also says which path ran: the two layouts have different scratch sizes, so
 * scratch_bytes differs between the two calls exactly when the bf16 path ran (expected for
 * all but S <= 8 and a dh-only call with a chunk far above 3 H, which keep the composition),
 * and scratch_bytes stays within kiln_fused_ce_scratch_bytes of that call's gradients.
 * One line per case ("fused_ce bits ... path bf16 OK"). Without --quick, the same comparison
 * at V 151936, H 896, N 8192 (Qwen2.5-0.5B's head over 4 x 2048 positions), with a timing
 * line per weight dtype:
 *   "fused_ce fast timing N=8192 H=896 V=151936 f32 fwd+bwd: bf16 path 12.34 ms, composition
 *    31.40 ms per call (median of 5)".
 * Then the row-block walk (kiln_fused_ce_params.row_block, the one-call form) against the
 * vocabulary walk and the auditable call, with bf16 logits (the default) and f32 logits
 * (row_logits_f32): the same bits twice;
 * with f32 logits the loss within 1e-4, the row statistics within 1e-5 and the gradients
 * within 2e-3 norm-wise of the vocabulary walk; with bf16 logits within 1e-3, 2e-2 and 1e-2
 * (each logit rounded once more); each within 1e-2 of auditable mode; calls the walk does not
 * take (f32 or misaligned weight, S <= 8) give the vocabulary walk's bits (the walk reads the
 * weight in place: bf16 rows of a multiple of 16 bytes, 16-byte aligned), whatever the
 * logits setting. Cases: blocks of 512 with a padding row, V % 8 == 1 and 2, blocks rounded
 * up to 8, dh only, dW only, one block, a mask, and (without --quick) V 480,000, where the
 * row kernel is one cluster a row with bf16 logits (two slices a block do not fit the
 * H200's shared memory) and one block a row with f32 logits (a slice would pass 200 KiB).
 * Without --quick the 0.5B head (N 8192, V 151936, blocks of 2048), timed against the
 * vocabulary walk:
 *   "fused_ce fast timing N=8192 H=896 V=151936 one-call fwd+bwd: row-block walk (2048 rows)
 *    ... ms with bf16 logits (f32 logits: ... ms), vocabulary walk ... ms per call (median
 *    of 5)".
 * Then "ALL OK" or "FAILED n".
 *
 * Usage: test_cuda_fused_ce_fast [--quick] [--seed N]   (--quick: V 49152 and 151936 cases
 * skipped).
 * Exit 0 all OK, 1 on a failure, 77 without a GPU (after the host-side checks of the error
 * measure itself).
 */
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

extern "C" {
#include "base/tensor.h"
#include "ops/ops.h"
#include "ops/fused_ce.h"
}
#include "ops/cuda/cuda_train.h" /* kiln_cuda_ce_set_legacy (C linkage by its own guard) */

#include <algorithm>
#include <chrono>

#define GPU_TEST_SEED 0xf00dull
#include "gpu_test_check.h"

static const double kTol = 1e-2; /* norm-wise relative, bf16 products */

/* ||a - b|| / ||b|| over n elements, with a[i] - a0[i] and b[i] - a0[i] when a0 is given (the
 * gradient part of an accumulated output); 0 when both are 0; +inf when a non-finite value
 * appears in a. *worst: the index of the largest |difference|. */
static double norm_err(const float *a, const float *b, const float *a0, size_t n, size_t *worst) {
    double num = 0.0, den = 0.0, big = -1.0;
    *worst = 0;
    for (size_t i = 0; i < n; i++) {
        double x = a[i], y = b[i];
        if (!std::isfinite(x)) {
            *worst = i;
            return INFINITY;
        }
        if (a0) {
            x -= a0[i];
            y -= a0[i];
        }
        double d = x - y;
        num += d * d;
        den += y * y;
        if (std::fabs(d) > big) {
            big = std::fabs(d);
            *worst = i;
        }
    }
    if (num == 0.0) return 0.0;
    return den > 0.0 ? std::sqrt(num / den) : INFINITY;
}

/* The measure itself (runs without a GPU): equal arrays 0, a known relative perturbation
 * measured as such, a NaN infinite, the accumulated form subtracting a0. */
static void check_norm_err() {
    std::vector<float> a(1000), b(1000), a0(1000);
    for (size_t i = 0; i < a.size(); i++) {
        b[i] = rndu();
        a0[i] = 100.0f * rndu();
        a[i] = b[i];
    }
    size_t w;
    if (norm_err(a.data(), b.data(), nullptr, a.size(), &w) != 0.0) FAIL("norm_err: equal != 0");
    for (size_t i = 0; i < a.size(); i++) a[i] = b[i] * 1.001f;
    double e = norm_err(a.data(), b.data(), nullptr, a.size(), &w);
    if (!(e > 0.9e-3 && e < 1.1e-3)) FAIL("norm_err: 1e-3 perturbation measured %g", e);
    a[17] = NAN;
    if (!std::isinf(norm_err(a.data(), b.data(), nullptr, a.size(), &w)) || w != 17)
        FAIL("norm_err: NaN not caught");
    std::vector<float> ga(1000), gb(1000);
    for (size_t i = 0; i < a.size(); i++) {
        ga[i] = a0[i] + 2.0f * b[i];
        gb[i] = a0[i] + b[i]; /* gradient part differs by a factor 2: error 1 */
    }
    e = norm_err(ga.data(), gb.data(), a0.data(), ga.size(), &w);
    if (!(e > 0.99 && e < 1.01)) FAIL("norm_err: accumulated form measured %g, want 1", e);
}

static void *dalloc(kiln_backend *be, size_t n) {
    void *p = kiln_backend_alloc(be, n);
    if (!p) {
        fprintf(stderr, "device allocation of %zu bytes failed: %s\n", n, kiln_last_error());
        exit(1);
    }
    return p;
}

struct CeCase {
    int64_t N, H, V, chunk;
    kiln_dtype dt;
    kiln_ce_reduction red;
    int accumulate; /* dhidden += (else overwritten) */
    int masked;
};

/* One backend's device copies of the inputs and outputs of a case. */
struct Side {
    kiln_backend *be = nullptr;
    float *hidden = nullptr, *dh = nullptr, *dw = nullptr, *rl = nullptr, *rs = nullptr;
    void *w = nullptr;  /* the allocation */
    void *wp = nullptr; /* the weight: w + w_off bytes */
    void init(kiln_backend *b, const std::vector<float> &h, const std::vector<uint8_t> &wt,
              int64_t N, int64_t H, int64_t V, size_t w_off = 0) {
        be = b;
        hidden = (float *)dalloc(be, h.size() * 4);
        w = dalloc(be, wt.size() + 16);
        wp = (uint8_t *)w + w_off;
        dh = (float *)dalloc(be, (size_t)N * H * 4);
        dw = (float *)dalloc(be, (size_t)V * H * 4);
        rl = (float *)dalloc(be, (size_t)N * 4);
        rs = (float *)dalloc(be, (size_t)N * 12);
        OK_OR_FAIL(kiln_backend_upload(be, hidden, h.data(), h.size() * 4));
        OK_OR_FAIL(kiln_backend_upload(be, wp, wt.data(), wt.size()));
    }
    void release() {
        for (void *p : {(void *)hidden, w, (void *)dh, (void *)dw, (void *)rl, (void *)rs})
            if (p) kiln_backend_free_buf(be, p);
    }
};

/* Host copies of one call's outputs. */
struct Outs {
    kiln_fused_ce_result r;
    std::vector<float> dh, dw, rl, rs;
};

/* Download the side's outputs (dh (N,H), dW (V,H), row_loss (N), row_stats (N,3)) into o. */
static bool download_outs(Side &s, int64_t N, int64_t H, int64_t V, Outs &o) {
    o.dh.resize((size_t)N * H);
    o.dw.resize((size_t)V * H);
    o.rl.resize((size_t)N);
    o.rs.resize((size_t)N * 3);
    OK_OR_FAIL(kiln_backend_download(s.be, o.dh.data(), s.dh, o.dh.size() * 4));
    OK_OR_FAIL(kiln_backend_download(s.be, o.dw.data(), s.dw, o.dw.size() * 4));
    OK_OR_FAIL(kiln_backend_download(s.be, o.rl.data(), s.rl, o.rl.size() * 4));
    OK_OR_FAIL(kiln_backend_download(s.be, o.rs.data(), s.rs, o.rs.size() * 4));
    return true;
}

/* Reset the outputs (dh: dh0, or NaN when overwritten; dW: dw0; row_loss and, unless
 * keep_stats, row_stats NaN), run the call, download everything. */
static bool run_side(Side &s, const kiln_fused_ce_params &base, const CeCase &c,
                     const std::vector<float> &dh0, const std::vector<float> &dw0, bool stats_in,
                     Outs &o, const char *tag, void *no_wait_scratch = nullptr,
                     size_t no_wait_cap = 0) {
    const int64_t N = c.N, H = c.H, V = c.V;
    std::vector<float> nan_n((size_t)N, NAN), nan_rs((size_t)N * 3, NAN);
    std::vector<float> nan_dh((size_t)N * H, NAN);
    OK_OR_FAIL(kiln_backend_upload(s.be, s.dh, c.accumulate ? dh0.data() : nan_dh.data(),
                                   dh0.size() * 4));
    OK_OR_FAIL(kiln_backend_upload(s.be, s.dw, dw0.data(), dw0.size() * 4));
    OK_OR_FAIL(kiln_backend_upload(s.be, s.rl, nan_n.data(), (size_t)N * 4));
    if (!stats_in) OK_OR_FAIL(kiln_backend_upload(s.be, s.rs, nan_rs.data(), (size_t)N * 12));
    kiln_fused_ce_params p = base;
    p.hidden = s.hidden;
    p.weight = s.wp;
    p.dhidden = s.dh;
    p.dweight = s.dw;
    p.row_loss = s.rl;
    p.row_stats_out = stats_in ? nullptr : s.rs;
    p.row_stats_in = stats_in ? s.rs : nullptr;
    if (no_wait_scratch) { /* the trainer's backward call: enqueue only, no loss */
        p.row_loss = nullptr;
        p.scratch = no_wait_scratch;
        p.scratch_cap = no_wait_cap;
        p.no_wait = 1;
    }
    memset(&o.r, 0xab, sizeof o.r);
    kiln_status st = kiln_fused_ce(s.be, &p, &o.r);
    if (st != KILN_OK) {
        FAIL("%s: kiln_fused_ce: %s: %s", tag, kiln_status_string(st), kiln_last_error());
        return false;
    }
    return download_outs(s, N, H, V, o);
}

/* Same bytes; names the first differing element. */
static bool same_bytes(const std::vector<float> &a, const std::vector<float> &b, const char *what,
                       const char *tag) {
    if (a.size() == b.size() && memcmp(a.data(), b.data(), a.size() * 4) == 0) return true;
    size_t i = 0;
    while (i < a.size() && i < b.size() && memcmp(&a[i], &b[i], 4) == 0) i++;
    FAIL("%s: %s not bit-identical: element %zu: %.9g vs %.9g", tag, what, i,
         i < a.size() ? (double)a[i] : 0.0, i < b.size() ? (double)b[i] : 0.0);
    return false;
}

static void same_run(const Outs &a, const Outs &b, const char *which, const char *tag) {
    char t[300];
    snprintf(t, sizeof t, "%s (%s)", tag, which);
    if (memcmp(&a.r.loss, &b.r.loss, 4) != 0 || memcmp(&a.r.loss_f64, &b.r.loss_f64, 8) != 0)
        FAIL("%s: loss %.9g / %.17g vs %.9g / %.17g", t, (double)a.r.loss, a.r.loss_f64,
             (double)b.r.loss, b.r.loss_f64);
    same_bytes(a.dh, b.dh, "dhidden", t);
    same_bytes(a.dw, b.dw, "dweight", t);
    same_bytes(a.rl, b.rl, "row_loss", t);
    same_bytes(a.rs, b.rs, "row_stats", t);
}

/* A norm-wise comparison against the auditable result; prints the worst element on failure. */
static double cmp(const std::vector<float> &f, const std::vector<float> &a, const float *a0,
                  const char *what, const char *tag) {
    size_t w;
    double e = norm_err(f.data(), a.data(), a0, f.size(), &w);
    if (!(e <= kTol))
        FAIL("%s: %s: norm-wise relative error %.3g > %.1g (worst element %zu: fast %.9g "
             "auditable %.9g)", tag, what, e, kTol, w, (double)f[w], (double)a[w]);
    return e;
}

/* The random hidden states (N, H) and weights (V, H), drawn in that order: logits of order 1,
 * hidden in [-1, 1), weights in [-2, 2) / sqrt(H), stored as f32 or (bf16) rounded. */
static void random_inputs(int64_t N, int64_t H, int64_t V, int bf16, std::vector<float> &hidden,
                          std::vector<uint8_t> &w) {
    const float wamp = 2.0f / std::sqrt((float)H);
    hidden.resize((size_t)N * H);
    for (auto &x : hidden) x = rndu();
    w.resize((size_t)V * H * (bf16 ? 2 : 4));
    for (int64_t e = 0; e < V * H; e++) {
        float x = rndu() * wamp;
        if (bf16) {
            uint16_t b = kiln_fp32_to_bf16(x);
            memcpy(w.data() + 2 * e, &b, 2);
        } else {
            memcpy(w.data() + 4 * e, &x, 4);
        }
    }
}

static void test_case(kiln_backend *fast_be, kiln_backend *aud_be, const CeCase &c) {
    const int fails0 = g_fail;
    const int64_t N = c.N, H = c.H, V = c.V;
    const int bf16 = c.dt == KILN_DTYPE_BF16;
    std::vector<float> hidden;
    std::vector<uint8_t> w;
    random_inputs(N, H, V, bf16, hidden, w);
    std::vector<int32_t> tg((size_t)N);
    std::vector<uint8_t> mask((size_t)N, 1);
    for (int64_t n = 0; n < N; n++) {
        tg[n] = (int32_t)(rnd64() % (uint64_t)V);
        if (N == 2048) {
            if (n == N - 1) tg[n] = -1; /* a shifted sequence: S = 2047 */
        } else if (n % 5 == 3) {
            tg[n] = -1;
        }
        if (c.masked && n % 3 == 1) mask[n] = 0;
    }
    if (N == 1) tg[0] = (int32_t)(V - 1); /* the last column: the last chunk */
    int64_t S = 0;
    for (int64_t n = 0; n < N; n++) S += (mask[n] && tg[n] >= 0) ? 1 : 0;
    /* initial dhidden (accumulate) and dweight: of the order of the gradients, so that an
     * overwrite instead of an accumulation shows in the gradient part */
    const float gscale = c.red == KILN_CE_REDUCTION_MEAN ? 1.0f / (float)S : 1.0f;
    std::vector<float> dh0((size_t)N * H), dw0((size_t)V * H);
    for (auto &x : dh0) x = rndu() * 1e-2f * gscale;
    for (auto &x : dw0) x = rndu() * 1e-3f * gscale;

    char tag[200];
    snprintf(tag, sizeof tag, "fused_ce fast %s N=%lld H=%lld V=%lld chunk=%lld S=%lld %s%s%s",
             bf16 ? "bf16" : "f32", (long long)N, (long long)H, (long long)V, (long long)c.chunk,
             (long long)S, c.red == KILN_CE_REDUCTION_MEAN ? "MEAN" : "SUM",
             c.masked ? " mask" : "", c.accumulate ? " dh+=" : " dh=");

    kiln_fused_ce_params base = kiln_fused_ce_default_params();
    base.N = N;
    base.H = H;
    base.V = V;
    base.weight_dtype = c.dt;
    base.targets = tg.data();
    base.mask = c.masked ? mask.data() : nullptr;
    base.reduction = c.red;
    base.scale = 0.75f;
    base.chunk = c.chunk;
    base.dhidden_accumulate = c.accumulate;

    Side fs, as;
    fs.init(fast_be, hidden, w, N, H, V);
    as.init(aud_be, hidden, w, N, H, V);
    Outs f1, f2, f3, au;
    bool ok = run_side(fs, base, c, dh0, dw0, false, f1, tag) &&
              run_side(fs, base, c, dh0, dw0, false, f2, tag) &&
              run_side(fs, base, c, dh0, dw0, true, f3, tag) &&
              run_side(as, base, c, dh0, dw0, false, au, tag);
    double e_loss = 0, e_rl = 0, e_dh = 0, e_dw = 0;
    if (ok) {
        same_run(f1, f2, "run 2", tag);
        same_run(f1, f3, "row_stats_in", tag);
        /* no_wait with the caller's scratch: the same gradients' bits, a NaN loss */
        void *scr = kiln_backend_alloc(fast_be, f1.r.scratch_bytes);
        Outs f4;
        if (!scr) {
            FAIL("%s: no_wait: kiln_backend_alloc %zu bytes", tag, f1.r.scratch_bytes);
        } else if (run_side(fs, base, c, dh0, dw0, true, f4, tag, scr, f1.r.scratch_bytes)) {
            char t4[300];
            snprintf(t4, sizeof t4, "%s (no_wait)", tag);
            same_bytes(f3.dh, f4.dh, "dhidden", t4);
            same_bytes(f3.dw, f4.dw, "dweight", t4);
            if (!std::isnan(f4.r.loss) || !std::isnan(f4.r.loss_f64))
                FAIL("%s: loss %.9g, want NaN", t4, (double)f4.r.loss);
        }
        kiln_backend_free_buf(fast_be, scr);
        if (f1.r.n_supervised != S || au.r.n_supervised != S)
            FAIL("%s: n_supervised fast %lld auditable %lld, want %lld", tag,
                 (long long)f1.r.n_supervised, (long long)au.r.n_supervised, (long long)S);
        size_t bound = kiln_fused_ce_scratch_bytes(S, H, V, c.chunk, 1, 1);
        if (f1.r.scratch_bytes == 0 || f1.r.scratch_bytes > bound)
            FAIL("%s: scratch_bytes %zu not in (0, kiln_fused_ce_scratch_bytes %zu]", tag,
                 f1.r.scratch_bytes, bound);
        e_loss = std::fabs((double)f1.r.loss - (double)au.r.loss) / std::fabs((double)au.r.loss);
        if (!(e_loss <= kTol))
            FAIL("%s: loss fast %.9g auditable %.9g (relative %.3g)", tag, (double)f1.r.loss,
                 (double)au.r.loss, e_loss);
        double e64 = std::fabs(f1.r.loss_f64 - au.r.loss_f64) / std::fabs(au.r.loss_f64);
        if (!(e64 <= kTol)) FAIL("%s: loss_f64 relative error %.3g", tag, e64);
        /* exact properties of the fast outputs */
        for (int64_t n = 0; n < N; n++) {
            bool sup = mask[n] && tg[n] >= 0;
            if (!sup && f1.rl[n] != 0.0f) FAIL("%s: row_loss[%lld] = %g, want 0", tag, (long long)n, (double)f1.rl[n]);
            for (int64_t k = 0; k < H && !sup; k++) {
                float want = c.accumulate ? dh0[(size_t)n * H + k] : 0.0f;
                float got = f1.dh[(size_t)n * H + k];
                if (memcmp(&got, &want, 4) != 0) {
                    FAIL("%s: dhidden[%lld][%lld] = %g at an unsupervised row, want %g", tag,
                         (long long)n, (long long)k, (double)got, (double)want);
                    break;
                }
            }
        }
        e_rl = cmp(f1.rl, au.rl, nullptr, "row_loss", tag);
        e_dh = cmp(f1.dh, au.dh, c.accumulate ? dh0.data() : nullptr, "dhidden", tag);
        e_dw = cmp(f1.dw, au.dw, dw0.data(), "dweight", tag);
        /* row_stats of the supervised rows: max logit and target logit (the sum of
         * exponentials is covered by row_loss) */
        std::vector<float> fm, am;
        for (int64_t n = 0; n < N; n++)
            if (mask[n] && tg[n] >= 0) {
                fm.push_back(f1.rs[(size_t)n * 3 + 0]);
                fm.push_back(f1.rs[(size_t)n * 3 + 2]);
                am.push_back(au.rs[(size_t)n * 3 + 0]);
                am.push_back(au.rs[(size_t)n * 3 + 2]);
            }
        cmp(fm, am, nullptr, "row_stats (max, target logit)", tag);
    }
    fs.release();
    as.release();
    printf("%s: err loss %.2e row %.2e dh %.2e dW %.2e %s\n", tag, e_loss, e_rl, e_dh, e_dw,
           g_fail == fails0 ? "OK" : "FAILED");
    fflush(stdout);
}

/* ---- the bf16 path against the composition ------------------------------------------------ */

struct BitCase {
    int64_t N, H, V, chunk;
    kiln_dtype dt;
    int dh, dw;      /* which gradients are asked for */
    int stats_in;    /* a loss-only call with row_stats_out, then pass 2 alone from it */
    int w_misalign;  /* the weight 2 bytes past a 16-byte boundary */
    int masked;      /* every 3rd row masked out */
    int expect_bf16; /* the bf16 path runs (else both calls run the composition) */
};

/* reps more calls of p, each timed from a synchronized device to its return (with
 * wait_status, to the backend's status: the end of the work a no_wait call only enqueued);
 * their median in *ms (ms not NULL, reps > 0). The first failure's status, else KILN_OK. */
static kiln_status time_calls(kiln_backend *be, const kiln_fused_ce_params &p, int reps,
                              bool wait_status, double *ms) {
    kiln_status st = KILN_OK;
    std::vector<double> t;
    for (int i = 0; i < reps && st == KILN_OK; i++) { /* dweight keeps accumulating: fine */
        if (cudaDeviceSynchronize() != cudaSuccess) break;
        auto t0 = std::chrono::steady_clock::now();
        kiln_fused_ce_result r2;
        st = kiln_fused_ce(be, &p, &r2);
        if (st == KILN_OK && wait_status) st = kiln_backend_status(be);
        auto t1 = std::chrono::steady_clock::now();
        t.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    if (st == KILN_OK && ms && !t.empty()) {
        std::sort(t.begin(), t.end());
        *ms = t[t.size() / 2];
    }
    return st;
}

/* One fast call (legacy: through the composition), its outputs reset first (dhidden NaN and
 * overwritten, dweight dw0 and accumulated, row_loss and row_stats NaN), downloaded after.
 * stats_in: a loss-only call writes row_stats first, then the gradient call reads them.
 * *ms (when not NULL): the median time of `reps` more calls of the gradient call. */
static bool run_bits(Side &s, const kiln_fused_ce_params &base, const BitCase &c,
                     const std::vector<float> &dw0, int legacy, Outs &o, const char *tag,
                     int reps, double *ms) {
    const int64_t N = c.N, H = c.H, V = c.V;
    std::vector<float> nan_n((size_t)N, NAN), nan_rs((size_t)N * 3, NAN);
    std::vector<float> nan_dh((size_t)N * H, NAN);
    OK_OR_FAIL(kiln_backend_upload(s.be, s.dh, nan_dh.data(), nan_dh.size() * 4));
    OK_OR_FAIL(kiln_backend_upload(s.be, s.dw, dw0.data(), dw0.size() * 4));
    OK_OR_FAIL(kiln_backend_upload(s.be, s.rl, nan_n.data(), (size_t)N * 4));
    OK_OR_FAIL(kiln_backend_upload(s.be, s.rs, nan_rs.data(), (size_t)N * 12));
    kiln_cuda_ce_set_legacy(legacy);
    kiln_fused_ce_params p = base;
    p.hidden = s.hidden;
    p.weight = s.wp;
    p.row_loss = s.rl;
    kiln_status st = KILN_OK;
    if (c.stats_in) {
        p.row_stats_out = s.rs;
        st = kiln_fused_ce(s.be, &p, &o.r);
        p.row_stats_out = nullptr;
        p.row_stats_in = s.rs;
    } else {
        p.row_stats_out = s.rs;
    }
    p.dhidden = c.dh ? s.dh : nullptr;
    p.dweight = c.dw ? s.dw : nullptr;
    memset(&o.r, 0xab, sizeof o.r);
    if (st == KILN_OK) st = kiln_fused_ce(s.be, &p, &o.r);
    if (st == KILN_OK) st = time_calls(s.be, p, reps, false, ms);
    kiln_cuda_ce_set_legacy(0);
    if (st != KILN_OK) {
        FAIL("%s (%s): kiln_fused_ce: %s: %s", tag, legacy ? "composition" : "bf16 path",
             kiln_status_string(st), kiln_last_error());
        return false;
    }
    if (reps > 0) return true; /* timed: the outputs moved on, nothing to compare */
    return download_outs(s, N, H, V, o);
}

/* A case's random inputs, drawn in this order: hidden and weights (random_inputs), then the
 * targets (N % 1024 == 0: every row supervised but the last, a shifted sequence's, while N <
 * shift_below; otherwise every 5th row from row 3 unsupervised), the mask (masked: every 3rd
 * row from row 1 out), then tg[0] = V - 1 (the last column: the last, maybe partial, chunk or
 * slot) and, with col0, tg[1] = 0; S the supervised rows; dw0 (V x H) dweight's start. */
struct CaseInputs {
    std::vector<float> hidden, dw0;
    std::vector<uint8_t> w, mask;
    std::vector<int32_t> tg;
    int64_t S = 0;
};

static void case_inputs(int64_t N, int64_t H, int64_t V, int bf16, int masked,
                        int64_t shift_below, bool col0, CaseInputs &in) {
    random_inputs(N, H, V, bf16, in.hidden, in.w);
    in.tg.assign((size_t)N, 0);
    in.mask.assign((size_t)N, 1);
    for (int64_t n = 0; n < N; n++) {
        in.tg[n] = (int32_t)(rnd64() % (uint64_t)V);
        if (N % 1024 == 0) {
            if (n == N - 1 && N < shift_below) in.tg[n] = -1; /* a shifted sequence: odd S */
        } else if (n % 5 == 3) {
            in.tg[n] = -1;
        }
        if (masked && n % 3 == 1) in.mask[n] = 0;
    }
    in.tg[0] = (int32_t)(V - 1);
    if (col0) in.tg[1] = 0;
    in.S = 0;
    for (int64_t n = 0; n < N; n++) in.S += (in.mask[n] && in.tg[n] >= 0) ? 1 : 0;
    in.dw0.resize((size_t)V * H);
    for (auto &x : in.dw0) x = rndu() * 1e-3f / (float)in.S;
}

/* The parameters every call of a case shares (targets and mask from in). */
static kiln_fused_ce_params case_params(int64_t N, int64_t H, int64_t V, kiln_dtype dt,
                                        int masked, const CaseInputs &in) {
    kiln_fused_ce_params base = kiln_fused_ce_default_params();
    base.N = N;
    base.H = H;
    base.V = V;
    base.weight_dtype = dt;
    base.targets = in.tg.data();
    base.mask = masked ? in.mask.data() : nullptr;
    base.reduction = KILN_CE_REDUCTION_MEAN;
    base.scale = 0.75f;
    return base;
}

/* The case's call through the bf16 path (twice) and through the composition: the same bits.
 * reps > 0: then time `reps` calls of each and print the timing line. */
static void test_bits(kiln_backend *be, const BitCase &c, int reps) {
    const int fails0 = g_fail;
    const int64_t N = c.N, H = c.H, V = c.V;
    const int bf16 = c.dt == KILN_DTYPE_BF16;
    CaseInputs in;
    case_inputs(N, H, V, bf16, c.masked, 8192, false, in);
    const std::vector<float> &hidden = in.hidden, &dw0 = in.dw0;
    const std::vector<uint8_t> &w = in.w;
    const int64_t S = in.S;

    char tag[220];
    snprintf(tag, sizeof tag,
             "fused_ce bits %s N=%lld H=%lld V=%lld chunk=%lld S=%lld%s%s%s%s%s",
             bf16 ? "bf16" : "f32", (long long)N, (long long)H, (long long)V, (long long)c.chunk,
             (long long)S,
             c.dh && c.dw ? " dh+dW" : c.dh ? " dh only" : c.dw ? " dW only" : " loss only",
             c.stats_in ? " stats_in" : "", c.w_misalign ? " w+2B" : "", c.masked ? " mask" : "",
             reps > 0 ? " (timed)" : "");

    kiln_fused_ce_params base = case_params(N, H, V, c.dt, c.masked, in);
    base.chunk = c.chunk;

    Side s;
    s.init(be, hidden, w, N, H, V, c.w_misalign ? 2 : 0);
    Outs nb1, nb2, leg;
    bool ok = run_bits(s, base, c, dw0, 0, nb1, tag, 0, nullptr) &&
              run_bits(s, base, c, dw0, 1, leg, tag, 0, nullptr) &&
              run_bits(s, base, c, dw0, 0, nb2, tag, 0, nullptr);
    bool ran_bf16 = false;
    if (ok) {
        same_run(nb1, leg, "bf16 path vs composition", tag);
        same_run(nb1, nb2, "bf16 path twice", tag);
        if (!std::isfinite(nb1.r.loss)) FAIL("%s: loss %g", tag, (double)nb1.r.loss);
        for (size_t e = 0; c.dh && e < nb1.dh.size(); e++) /* overwritten: no NaN left */
            if (!std::isfinite(nb1.dh[e])) {
                FAIL("%s: dhidden[%zu] = %g", tag, e, (double)nb1.dh[e]);
                break;
            }
        size_t moved = 0; /* the gradient reached dweight (not a vacuous comparison) */
        for (size_t e = 0; e < nb1.dw.size(); e++) moved += nb1.dw[e] != dw0[e];
        if (c.dw && moved == 0) FAIL("%s: dweight unchanged", tag);
        if (!c.dw && moved != 0) FAIL("%s: dweight written without being asked for", tag);
        ran_bf16 = nb1.r.scratch_bytes != leg.r.scratch_bytes;
        if (ran_bf16 != (c.expect_bf16 != 0))
            FAIL("%s: the %s ran (scratch %zu, composition %zu), expected the %s", tag,
                 ran_bf16 ? "bf16 path" : "composition", nb1.r.scratch_bytes,
                 leg.r.scratch_bytes, c.expect_bf16 ? "bf16 path" : "composition");
        size_t bound = kiln_fused_ce_scratch_bytes(S, H, V, c.chunk, c.dh, c.dw);
        if (nb1.r.scratch_bytes == 0 || nb1.r.scratch_bytes > bound ||
            leg.r.scratch_bytes > bound)
            FAIL("%s: scratch_bytes %zu (composition %zu) not in (0, %zu]", tag,
                 nb1.r.scratch_bytes, leg.r.scratch_bytes, bound);
    }
    double ms_new = 0.0, ms_old = 0.0;
    if (ok && reps > 0) {
        Outs tmp;
        run_bits(s, base, c, dw0, 0, tmp, tag, reps, &ms_new);
        run_bits(s, base, c, dw0, 1, tmp, tag, reps, &ms_old);
    }
    s.release();
    printf("%s: path %s, scratch %zu bytes %s\n", tag, ran_bf16 ? "bf16" : "composition",
           ok ? nb1.r.scratch_bytes : (size_t)0, g_fail == fails0 ? "OK" : "FAILED");
    if (reps > 0)
        printf("fused_ce fast timing N=%lld H=%lld V=%lld %s %s: bf16 path %.2f ms, composition "
               "%.2f ms per call (median of %d)\n", (long long)N, (long long)H, (long long)V,
               bf16 ? "bf16" : "f32", c.dh || c.dw ? "fwd+bwd" : "fwd", ms_new, ms_old, reps);
    fflush(stdout);
}

/* ---- the row-block walk against the vocabulary walk ------------------------------------------ */

struct RowCase {
    int64_t N, H, V, row_block;
    kiln_dtype dt;
    int dh, dw;     /* which gradients are asked for */
    int masked;     /* every 3rd row masked out */
    int w_misalign; /* the weight 2 bytes past a 16-byte boundary (no walk: a copy of W) */
    int expect_rows; /* the row-block walk runs (else the call keeps the vocabulary walk) */
};

/* The one-call form (no_wait, row_stats_out, the caller's scratch of cap bytes) with
 * row_block rb; outputs reset first (dhidden NaN, overwritten; dweight dw0; row_stats NaN),
 * then downloaded, and the loss made from the downloaded statistics
 * (kiln_fused_ce_loss_from_stats) into o.r.loss / loss_f64. *ms (when not NULL): the median
 * time of `reps` more calls, each waited for. */
static bool run_rows(Side &s, const kiln_fused_ce_params &base, const RowCase &c, int64_t rb,
                     int logits_f32, const std::vector<float> &dw0, void *scr, size_t cap,
                     Outs &o, const char *tag, int reps, double *ms) {
    const int64_t N = c.N, H = c.H, V = c.V;
    std::vector<float> nan_rs((size_t)N * 3, NAN), nan_dh((size_t)N * H, NAN), zero_n((size_t)N, 0);
    OK_OR_FAIL(kiln_backend_upload(s.be, s.dh, nan_dh.data(), nan_dh.size() * 4));
    OK_OR_FAIL(kiln_backend_upload(s.be, s.dw, dw0.data(), dw0.size() * 4));
    OK_OR_FAIL(kiln_backend_upload(s.be, s.rl, zero_n.data(), (size_t)N * 4));
    OK_OR_FAIL(kiln_backend_upload(s.be, s.rs, nan_rs.data(), (size_t)N * 12));
    kiln_fused_ce_params p = base;
    p.hidden = s.hidden;
    p.weight = s.wp;
    p.dhidden = c.dh ? s.dh : nullptr;
    p.dweight = c.dw ? s.dw : nullptr;
    p.row_stats_out = s.rs;
    p.no_wait = 1;
    p.scratch = scr;
    p.scratch_cap = cap;
    p.row_block = rb;
    p.row_logits_f32 = logits_f32;
    memset(&o.r, 0xab, sizeof o.r);
    kiln_status st = kiln_fused_ce(s.be, &p, &o.r);
    if (st == KILN_OK && !o.r.loss_pending) {
        FAIL("%s (row_block %lld): the loss was not left pending", tag, (long long)rb);
        return false;
    }
    if (st == KILN_OK) st = time_calls(s.be, p, reps, true, ms);
    if (st != KILN_OK) {
        FAIL("%s (row_block %lld): kiln_fused_ce: %s: %s", tag, (long long)rb,
             kiln_status_string(st), kiln_last_error());
        return false;
    }
    if (reps > 0) return true;
    if (!download_outs(s, N, H, V, o)) return false;
    kiln_fused_ce_result lr;
    st = kiln_fused_ce_loss_from_stats(&p, o.rs.data(), &lr);
    if (st != KILN_OK) {
        FAIL("%s (row_block %lld): loss_from_stats: %s", tag, (long long)rb, kiln_last_error());
        return false;
    }
    o.r.loss = lr.loss;
    o.r.loss_f64 = lr.loss_f64;
    return true;
}

/* The row walk's outputs r against the vocabulary walk's vw (within a RowTol: loss relative,
 * row statistics and the gradients norm-wise) and the auditable au (within kTol); the exact
 * properties (an overwritten dhidden's unsupervised rows exactly +0, dweight untouched when
 * not asked for). e[4]: loss, stats, dh, dW against vw; a[2]: dh, dW against au.
 * With f32 logits (kRowsF32) the statistics' sums run in another order, hence some bf16
 * roundings of g fall on the other side, and dW is summed block by block. With bf16 logits
 * (kRowsBf16, the default) each logit is also rounded once to bf16 (relative 2^-9, about
 * 2e-3 at these inputs' logits of order 1): each probability moves by about that much; the
 * statistics more, as the row's max m moves by its rounding and the sum l by the factor
 * e^(that), together (m + log l hardly moves: the loss's error is 1e-7 to 7e-5 on the H200,
 * the statistics' 4.3e-3 to 4.7e-3). */
struct RowTol {
    double loss, stats, grad;
};
static const RowTol kRowsF32 = {1e-4, 1e-5, 2e-3};
static const RowTol kRowsBf16 = {1e-3, 2e-2, 1e-2};

static void cmp_rows(const Outs &r, const Outs &vw, const Outs &au, const RowCase &c,
                     const RowTol &tol, const std::vector<int32_t> &tg,
                     const std::vector<uint8_t> &mask, const std::vector<float> &dw0,
                     const char *tag, double e[4], double a[2]) {
    const int64_t N = c.N, H = c.H;
    e[0] = e[1] = e[2] = e[3] = a[0] = a[1] = 0.0;
    e[0] = std::fabs((double)r.r.loss - (double)vw.r.loss) / std::fabs((double)vw.r.loss);
    if (!(e[0] <= tol.loss))
        FAIL("%s: loss row walk %.9g vocabulary walk %.9g (relative %.3g > %.1g)", tag,
             (double)r.r.loss, (double)vw.r.loss, e[0], tol.loss);
    std::vector<float> fm, vm;
    for (int64_t n = 0; n < N; n++)
        if (mask[n] && tg[n] >= 0)
            for (int q = 0; q < 3; q++) {
                fm.push_back(r.rs[(size_t)n * 3 + q]);
                vm.push_back(vw.rs[(size_t)n * 3 + q]);
            }
    size_t wi;
    e[1] = norm_err(fm.data(), vm.data(), nullptr, fm.size(), &wi);
    if (!(e[1] <= tol.stats)) FAIL("%s: row_stats norm-wise %.3g > %.1g", tag, e[1], tol.stats);
    if (c.dh) {
        e[2] = norm_err(r.dh.data(), vw.dh.data(), nullptr, r.dh.size(), &wi);
        if (!(e[2] <= tol.grad)) FAIL("%s: dhidden vs vocabulary walk %.3g > %.1g", tag, e[2], tol.grad);
        a[0] = cmp(r.dh, au.dh, nullptr, "dhidden vs auditable", tag);
        for (int64_t n = 0; n < N; n++) /* overwritten: unsupervised rows exactly +0 */
            if (!(mask[n] && tg[n] >= 0))
                for (int64_t k = 0; k < H; k++) {
                    const float x = r.dh[(size_t)n * H + k];
                    if (x != 0.0f || std::signbit(x)) {
                        FAIL("%s: dhidden[%lld][%lld] = %g at an unsupervised row", tag,
                             (long long)n, (long long)k, (double)x);
                        n = N;
                        break;
                    }
                }
    }
    if (c.dw) {
        e[3] = norm_err(r.dw.data(), vw.dw.data(), dw0.data(), r.dw.size(), &wi);
        if (!(e[3] <= tol.grad)) FAIL("%s: dweight vs vocabulary walk %.3g > %.1g", tag, e[3], tol.grad);
        a[1] = cmp(r.dw, au.dw, dw0.data(), "dweight vs auditable", tag);
    } else if (memcmp(r.dw.data(), dw0.data(), dw0.size() * 4) != 0) {
        FAIL("%s: dweight written without being asked for", tag);
    }
    double ea = std::fabs((double)r.r.loss - (double)au.r.loss) / std::fabs((double)au.r.loss);
    if (!(ea <= kTol)) FAIL("%s: loss vs auditable relative %.3g", tag, ea);
}

/* The case through the row-block walk with bf16 logits (the default) twice (the same bits),
 * with f32 logits (row_logits_f32), through the vocabulary walk (row_block 0) and on the
 * auditable backend; each row walk within cmp_rows' bounds for its logits. reps > 0: then the
 * three fast calls are timed. */
static void test_rows(kiln_backend *be, kiln_backend *aud_be, const RowCase &c, int reps) {
    const int fails0 = g_fail;
    const int64_t N = c.N, H = c.H, V = c.V;
    const int bf16 = c.dt == KILN_DTYPE_BF16;
    CaseInputs in;
    case_inputs(N, H, V, bf16, c.masked, INT64_MAX, true, in);
    const std::vector<float> &hidden = in.hidden, &dw0 = in.dw0;
    const std::vector<uint8_t> &w = in.w, &mask = in.mask;
    const std::vector<int32_t> &tg = in.tg;
    const int64_t S = in.S;

    char tag[220], tag32[260];
    snprintf(tag, sizeof tag, "fused_ce rows %s N=%lld H=%lld V=%lld row_block=%lld S=%lld%s%s%s%s",
             bf16 ? "bf16" : "f32", (long long)N, (long long)H, (long long)V,
             (long long)c.row_block, (long long)S,
             c.dh && c.dw ? " dh+dW" : c.dh ? " dh only" : " dW only",
             c.w_misalign ? " w+2B" : "", c.masked ? " mask" : "", reps > 0 ? " (timed)" : "");
    snprintf(tag32, sizeof tag32, "%s [f32 logits]", tag);
    const kiln_fused_ce_params base = case_params(N, H, V, c.dt, c.masked, in);

    const size_t want = kiln_fused_ce_row_block_bytes(S, H, V, c.row_block, c.dh, c.dw, 0);
    const size_t want32 = kiln_fused_ce_row_block_bytes(S, H, V, c.row_block, c.dh, c.dw, 1);
    const size_t vocab = kiln_fused_ce_scratch_bytes(S, H, V, 0, c.dh, c.dw);
    const size_t cap = want32 > vocab ? want32 : vocab;
    if (!(want < want32)) FAIL("%s: scratch with bf16 logits %zu, f32 %zu", tag, want, want32);
    void *scr = kiln_backend_alloc(be, cap);
    Side s, as;
    s.init(be, hidden, w, N, H, V, c.w_misalign ? 2 : 0);
    as.init(aud_be, hidden, w, N, H, V);
    Outs r1, r2, r3, vw, au;
    bool ok = scr != nullptr;
    if (!scr) FAIL("%s: kiln_backend_alloc %zu bytes", tag, cap);
    const int64_t rb = c.row_block;
    ok = ok && run_rows(s, base, c, rb, 0, dw0, scr, cap, r1, tag, 0, nullptr) &&
         run_rows(s, base, c, rb, 0, dw0, scr, cap, r2, tag, 0, nullptr) &&
         run_rows(s, base, c, rb, 1, dw0, scr, cap, r3, tag32, 0, nullptr);
    ok = ok && run_rows(s, base, c, 0, 0, dw0, scr, cap, vw, tag, 0, nullptr);
    if (ok) { /* the auditable reference: a plain call with both gradients */
        CeCase ac = {N, H, V, 0, c.dt, KILN_CE_REDUCTION_MEAN, 0, c.masked};
        std::vector<float> dh0((size_t)N * H, 0.0f);
        ok = run_side(as, base, ac, dh0, dw0, false, au, tag);
    }
    double e[4] = {0}, a[2] = {0}, e3[4] = {0}, a3[2] = {0};
    bool ran_rows = false;
    if (ok) {
        same_run(r1, r2, "row-block walk twice", tag);
        ran_rows = r1.r.scratch_bytes == want && want != vw.r.scratch_bytes;
        if (ran_rows != (c.expect_rows != 0))
            FAIL("%s: the %s ran (scratch %zu; row walk %zu, vocabulary walk %zu), expected "
                 "the %s", tag, ran_rows ? "row-block walk" : "vocabulary walk",
                 r1.r.scratch_bytes, want, vw.r.scratch_bytes,
                 c.expect_rows ? "row-block walk" : "vocabulary walk");
        if (ran_rows && r3.r.scratch_bytes != want32)
            FAIL("%s: scratch %zu, expected %zu", tag32, r3.r.scratch_bytes, want32);
        if (!ran_rows) {
            same_run(r1, vw, "no walk: the vocabulary walk's bits", tag);
            same_run(r3, vw, "no walk: the vocabulary walk's bits", tag32);
        }
        cmp_rows(r1, vw, au, c, kRowsBf16, tg, mask, dw0, tag, e, a);
        cmp_rows(r3, vw, au, c, kRowsF32, tg, mask, dw0, tag32, e3, a3);
    }
    double ms_rows = 0.0, ms_f32 = 0.0, ms_vocab = 0.0;
    if (ok && reps > 0) {
        Outs tmp;
        run_rows(s, base, c, rb, 0, dw0, scr, cap, tmp, tag, reps, &ms_rows);
        run_rows(s, base, c, rb, 1, dw0, scr, cap, tmp, tag32, reps, &ms_f32);
        run_rows(s, base, c, 0, 0, dw0, scr, cap, tmp, tag, reps, &ms_vocab);
    }
    s.release();
    as.release();
    if (scr) kiln_backend_free_buf(be, scr);
    printf("%s: path %s; vs vocabulary walk: bf16 logits loss %.2e stats %.2e dh %.2e dW %.2e "
           "(f32 logits: %.2e %.2e %.2e %.2e); vs auditable dh %.2e dW %.2e (f32 logits %.2e "
           "%.2e) %s\n", tag, ran_rows ? "rows" : "vocabulary", e[0], e[1], e[2], e[3], e3[0],
           e3[1], e3[2], e3[3], a[0], a[1], a3[0], a3[1], g_fail == fails0 ? "OK" : "FAILED");
    if (reps > 0)
        printf("fused_ce fast timing N=%lld H=%lld V=%lld one-call fwd+bwd: row-block walk "
               "(%lld rows) %.2f ms with bf16 logits (f32 logits: %.2f ms), vocabulary walk "
               "%.2f ms per call (median of %d); scratch %.1f (f32 logits %.1f) vs %.1f MiB\n",
               (long long)N, (long long)H, (long long)V, (long long)c.row_block, ms_rows, ms_f32,
               ms_vocab, reps, want / 1048576.0, want32 / 1048576.0, vocab / 1048576.0);
    fflush(stdout);
}

int main(int argc, char **argv) {
    bool quick = false;
    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--quick")) quick = true;
        else if (!strcmp(argv[a], "--seed") && a + 1 < argc) g_rng = strtoull(argv[++a], 0, 10);
        else {
            fprintf(stderr, "usage: %s [--quick] [--seed N]\n", argv[0]);
            return 2;
        }
    }
    check_norm_err();
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("no GPU: skipped (%s)\n", g_fail ? "FAILED" : "host checks OK");
        return g_fail ? 1 : 77;
    }
    kiln_backend *fast_be = nullptr, *aud_be = nullptr;
    if (kiln_backend_cuda_create_mode(0, 1, &fast_be) != KILN_OK) {
        printf("no usable GPU (%s): skipped\n", kiln_last_error());
        return 77;
    }
    if (kiln_backend_cuda_create_mode(0, 0, &aud_be) != KILN_OK) {
        printf("auditable backend: %s\n", kiln_last_error());
        kiln_backend_free(fast_be);
        return 1;
    }
    int k = 0;
    for (int64_t V : {1000, 49152}) {
        if (quick && V > 1000) continue;
        for (int64_t N : {1, 7, 2047, 2048})
            for (int64_t H : {64, 576, 896}) {
                CeCase c = {N, H, V, 0, (k % 2) ? KILN_DTYPE_BF16 : KILN_DTYPE_F32,
                            (k % 3 == 2) ? KILN_CE_REDUCTION_SUM : KILN_CE_REDUCTION_MEAN,
                            (k / 2) % 2, k == 7};
                k++;
                test_case(fast_be, aud_be, c);
            }
    }
    /* several chunks of widths 300 and 100 (not multiples of 8): the online rescaling */
    for (int64_t N : {7, 2047}) {
        CeCase c = {N, 64, 1000, 300, KILN_DTYPE_BF16, KILN_CE_REDUCTION_MEAN, 1, 0};
        test_case(fast_be, aud_be, c);
        c.dt = KILN_DTYPE_F32;
        c.accumulate = 0;
        c.masked = 1;
        test_case(fast_be, aud_be, c);
    }
    /* the bf16 path against the composition: {N, H, V, chunk, dtype, dh, dw, stats_in,
     * w_misalign, masked, expect_bf16} */
    const BitCase bit_cases[] = {
        {2048, 896, 49152, 0, KILN_DTYPE_F32, 1, 1, 0, 0, 0, 1},    /* S 2047 -> Sp 2048 */
        {2048, 896, 49152, 0, KILN_DTYPE_BF16, 1, 1, 1, 0, 0, 1},   /* the trainer's calls */
        {2047, 576, 50000, 4096, KILN_DTYPE_BF16, 1, 1, 0, 1, 1, 1}, /* copy of W, last 848 */
        {1001, 100, 3001, 1000, KILN_DTYPE_BF16, 1, 1, 0, 0, 0, 1}, /* ld 104, last chunk 1 */
        {1001, 100, 3001, 1000, KILN_DTYPE_F32, 1, 1, 1, 0, 1, 1},
        {2048, 896, 10007, 1000, KILN_DTYPE_F32, 1, 0, 0, 0, 0, 1}, /* dh only, last 7 */
        {2048, 896, 49152, 8192, KILN_DTYPE_F32, 1, 0, 0, 0, 0, 0}, /* dh only: too big */
        {2047, 576, 49152, 0, KILN_DTYPE_BF16, 0, 1, 0, 0, 0, 1},   /* dW only */
        {2048, 896, 49152, 0, KILN_DTYPE_F32, 0, 0, 0, 0, 0, 1},    /* the loss alone */
        {12, 64, 1000, 300, KILN_DTYPE_F32, 1, 1, 0, 0, 0, 1},      /* S 10 -> Sp 16 */
        {7, 64, 1000, 300, KILN_DTYPE_BF16, 1, 1, 0, 0, 0, 0},      /* S 6: matvec logits */
    };
    for (const BitCase &c : bit_cases) {
        if (quick && c.V > 10007) continue;
        test_bits(fast_be, c, 0);
    }
    if (!quick) /* the benchmark shape, checked and timed, f32 and bf16 weights */
        for (kiln_dtype dt : {KILN_DTYPE_F32, KILN_DTYPE_BF16}) {
            BitCase c = {8192, 896, 151936, 0, dt, 1, 1, 0, 0, 0, 1};
            test_bits(fast_be, c, 5);
        }
    /* the row-block walk: {N, H, V, row_block, dtype, dh, dw, masked, w_misalign,
     * expect_rows} */
    const RowCase row_cases[] = {
        {2048, 896, 49152, 512, KILN_DTYPE_BF16, 1, 1, 0, 0, 1}, /* S 2047: 4 blocks, 1 pad */
        {1001, 96, 3001, 256, KILN_DTYPE_BF16, 1, 1, 1, 0, 1},   /* V % 4 == 1: ld(V) 3008 */
        {1001, 96, 3001, 60, KILN_DTYPE_BF16, 0, 1, 0, 0, 1},    /* blocks of 64, dW only */
        {1001, 96, 3002, 100, KILN_DTYPE_BF16, 1, 0, 0, 0, 1},   /* blocks of 104, dh only */
        {1001, 100, 3001, 256, KILN_DTYPE_BF16, 1, 1, 0, 0, 0},  /* 200-byte rows: a copy */
        {2048, 576, 49152, 1 << 20, KILN_DTYPE_BF16, 1, 1, 1, 0, 1}, /* one block */
        {12, 64, 1000, 8, KILN_DTYPE_BF16, 1, 1, 0, 0, 1},       /* S 10: blocks 8 + 8 */
        {7, 64, 1000, 8, KILN_DTYPE_BF16, 1, 1, 0, 0, 0},        /* S 6: matvec logits */
        {1001, 100, 3001, 256, KILN_DTYPE_F32, 1, 1, 0, 0, 0},   /* f32 weight */
        {1001, 96, 3001, 256, KILN_DTYPE_BF16, 1, 1, 0, 1, 0},   /* misaligned weight */
        /* V 480,000: the row kernel one cluster a row (bf16 logits: 2 x 117 KiB slices a block
         * pass the shared memory), one block a row (f32 logits: a slice would pass 200 KiB) */
        {64, 64, 480000, 32, KILN_DTYPE_BF16, 1, 1, 0, 0, 1},
    };
    for (const RowCase &c : row_cases) {
        if (quick && c.V > 10007) continue;
        test_rows(fast_be, aud_be, c, 0);
    }
    if (!quick) { /* the benchmark shape, checked and timed */
        RowCase c = {8192, 896, 151936, 2048, KILN_DTYPE_BF16, 1, 1, 0, 0, 1};
        test_rows(fast_be, aud_be, c, 5);
    }
    OK_OR_FAIL(kiln_backend_status(fast_be));
    OK_OR_FAIL(kiln_backend_status(aud_be));
    kiln_backend_free(fast_be);
    kiln_backend_free(aud_be);
    if (g_fail) {
        printf("FAILED %d\n", g_fail);
        return 1;
    }
    printf("ALL OK\n");
    return 0;
}
