/*
 * test_cuda_norm_fast.cu -- the gradient norm of the CUDA optimizer in fast mode (the chunked
 * double-precision order of cuda_adamw.cu, kiln_cuda_norm_plan) and, unchanged, in auditable
 * mode (torch's 8-lane order, the CPU's bits).
 *
 *   fast, per case (tensors of 1, 7, 1000003 and 28M elements in separate allocations; ~300
 *   tensors of odd sizes, chunk multiples and chunk +-1 packed at unaligned addresses):
 *   per-tensor norms, grad_sq_norm, total norm and clip coefficient within 1e-5 (relative) of
 *   a host double reference (the per-tensor norms within 2^-23); small-integer gradients
 *   give exactly (float)sqrt(the exact sum) (no element missed or counted twice); the
 *   gradients doubled give exactly doubled norms (a power-of-two scale is exact in this
 *   order; also catches a norm left unwritten); the same data again gives the same bits; the same values at other addresses (aligned vs unaligned loads) give
 *   the same bits; clip_grads scales every gradient by exactly its coefficient, and twice
 *   from the same gradients gives the same coefficient; a NaN, +Inf or -Inf gradient is
 *   refused by grads_finite / step (KILN_ERR_RANGE naming the parameter) and gives a
 *   non-finite norm for its tensor only.
 *   fast, the call itself: kiln_cuda_adamw_norms with a plan built here equals the
 *   optimizer's norms; with plan NULL it equals kiln_grad_norm_torch's bits.
 *   auditable: norms, total, grad_sq_norm, clip coefficient and clipped gradients equal to a
 *   CPU optimizer's bits on the same data.
 *   timing: 494M gradients (Qwen2.5-0.5B's count) in 5 tensors: the fast norm (cudaEvent, mean
 *   of 10) and the torch-order kernel once, for comparison.
 *
 * Usage: test_cuda_norm_fast [--no-big] [--seed N]. --no-big skips the 494M case. Exit 0 all
 * OK, 1 on a failure, 77 without a GPU (after the checks that need none).
 */
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ops/cuda/cuda_internal.h"
extern "C" {
#include "base/base.h"
#include "ops/cuda/cuda_train.h"
#include "ops/ops.h"
#include "train/adamw.h"
}

#define GPU_TEST_SEED 0x5eed1234ull
#include "gpu_test_check.h"

#define CUDA_OR_FAIL(expr)                                                                     \
    do {                                                                                       \
        cudaError_t e_ = (expr);                                                               \
        if (e_ != cudaSuccess) FAIL("%s: %s", #expr, cudaGetErrorString(e_));                  \
    } while (0)

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float nan_poison() {
    uint32_t u = 0x7fc0dead;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static kiln_backend *g_fast = nullptr, *g_aud = nullptr;

static void *dalloc(kiln_backend *be, size_t n) {
    void *p = kiln_backend_alloc(be, n ? n : 1);
    if (!p) {
        fprintf(stderr, "device allocation of %zu bytes failed: %s\n", n, kiln_last_error());
        exit(1);
    }
    return p;
}

/* ---- data --------------------------------------------------------------------------------- */

/* P tensors packed in one host array: tensor i is h[off[i] .. off[i] + n[i]). */
struct HostGrads {
    std::vector<int64_t> n, off;
    std::vector<float> h;
    std::vector<double> ref_sq; /* (P) sum of squares in double, in element order */
    double ref_total_sq = 0.0;
    int64_t max_n = 0;
};

static const float kScales[7] = {1e-3f, 1e-2f, 1e-1f, 1.0f, 10.0f, 100.0f, 1000.0f};

static void host_make(HostGrads &G, const std::vector<int64_t> &sizes) {
    G.n = sizes;
    G.off.resize(sizes.size());
    int64_t t = 0;
    for (size_t i = 0; i < sizes.size(); i++) {
        G.off[i] = t;
        t += sizes[i];
        if (sizes[i] > G.max_n) G.max_n = sizes[i];
    }
    G.h.resize((size_t)t);
    for (size_t i = 0; i < sizes.size(); i++) {
        const float sc = kScales[i % 7];
        float *g = G.h.data() + G.off[i];
        if (sizes[i] == 5 && i % 2 == 1) { /* an all-zero tensor: norm exactly 0 */
            for (int64_t e = 0; e < sizes[i]; e++) g[e] = 0.0f;
            continue;
        }
        for (int64_t e = 0; e < sizes[i]; e++) g[e] = rndu() * sc;
    }
}

static void host_ref(HostGrads &G) {
    G.ref_sq.assign(G.n.size(), 0.0);
    G.ref_total_sq = 0.0;
    for (size_t i = 0; i < G.n.size(); i++) {
        const float *g = G.h.data() + G.off[i];
        double s = 0.0;
        for (int64_t e = 0; e < G.n[i]; e++) s += (double)g[e] * (double)g[e];
        G.ref_sq[i] = s;
        G.ref_total_sq += s;
    }
}

/* Device copy: separate allocations (shift < 0, each 256-byte aligned by cudaMalloc) or one
 * allocation with tensor i at element shift + off[i]. */
struct DevGrads {
    kiln_backend *be = nullptr;
    std::vector<float *> ptr;
    std::vector<void *> owned;
};

static void dev_make(DevGrads &D, kiln_backend *be, const HostGrads &G, int shift) {
    D.be = be;
    D.ptr.resize(G.n.size());
    if (shift < 0) {
        for (size_t i = 0; i < G.n.size(); i++) {
            D.ptr[i] = (float *)dalloc(be, (size_t)G.n[i] * 4);
            D.owned.push_back(D.ptr[i]);
        }
    } else {
        float *base = (float *)dalloc(be, (G.h.size() + (size_t)shift) * 4);
        D.owned.push_back(base);
        for (size_t i = 0; i < G.n.size(); i++) D.ptr[i] = base + shift + G.off[i];
    }
}

static void dev_free(DevGrads &D) {
    for (void *p : D.owned) kiln_backend_free_buf(D.be, p);
    D.owned.clear();
    D.ptr.clear();
}

/* Upload G's data times mul (1 or a power of two). */
static void dev_upload(DevGrads &D, const HostGrads &G, float mul) {
    std::vector<float> tmp;
    for (size_t i = 0; i < G.n.size(); i++) {
        const float *src = G.h.data() + G.off[i];
        if (mul != 1.0f) {
            tmp.resize((size_t)G.n[i]);
            for (int64_t e = 0; e < G.n[i]; e++) tmp[(size_t)e] = src[e] * mul;
            src = tmp.data();
        }
        OK_OR_FAIL(kiln_backend_upload(D.be, D.ptr[i], src, (size_t)G.n[i] * 4));
    }
}

/* An optimizer over D's gradients; every parameter's weights point at one shared buffer of
 * max_n floats (the norm never reads them, and no step here runs past grads_finite). */
struct Opt {
    kiln_adamw *o = nullptr;
    void *weights = nullptr;
    std::vector<std::string> names;
};

static bool opt_make(Opt &O, kiln_backend *be, const DevGrads &D, const HostGrads &G,
                     kiln_adamw_moments moments) {
    O.weights = dalloc(be, (size_t)G.max_n * 4);
    OK_OR_FAIL(kiln_backend_upload(be, O.weights, G.h.data(), 4)); /* any contents */
    O.names.resize(G.n.size());
    std::vector<kiln_adamw_param> ps(G.n.size());
    for (size_t i = 0; i < G.n.size(); i++) {
        O.names[i] = "model.p" + std::to_string(i);
        ps[i] = {O.names[i].c_str(), G.n[i], O.weights, D.ptr[i]};
    }
    kiln_adamw_config cfg = kiln_adamw_default_config();
    cfg.moments = moments;
    kiln_status st = kiln_adamw_create_on(be, ps.data(), (int)ps.size(), &cfg, &O.o);
    if (st != KILN_OK) {
        FAIL("kiln_adamw_create_on: %s: %s", kiln_status_string(st), kiln_last_error());
        return false;
    }
    return true;
}

static void opt_free(Opt &O, kiln_backend *be) {
    kiln_adamw_free(O.o);
    O.o = nullptr;
    kiln_backend_free_buf(be, O.weights);
    O.weights = nullptr;
}

struct NormOut {
    std::vector<float> norms;
    float total = 0, sq = 0;
};

static NormOut grad_norm(kiln_adamw *o, size_t P) {
    NormOut r;
    r.norms.assign(P, nan_poison());
    r.total = r.sq = nan_poison();
    OK_OR_FAIL(kiln_adamw_grad_norm(o, nullptr, r.norms.data(), &r.total, &r.sq));
    return r;
}

static double rel_err(double got, double ref) {
    if (ref == 0.0) return got == 0.0 ? 0.0 : INFINITY;
    return fabs(got - ref) / fabs(ref);
}

/* Every field bit-equal; reports the first difference. */
static bool same_norms(const NormOut &a, const NormOut &b, const char *what) {
    for (size_t i = 0; i < a.norms.size(); i++)
        if (bits(a.norms[i]) != bits(b.norms[i])) {
            FAIL("%s: norm %zu: %.9g (0x%08x) vs %.9g (0x%08x)", what, i, (double)a.norms[i],
                 bits(a.norms[i]), (double)b.norms[i], bits(b.norms[i]));
            return false;
        }
    if (bits(a.total) != bits(b.total) || bits(a.sq) != bits(b.sq)) {
        FAIL("%s: total %.9g / %.9g, sq %.9g / %.9g", what, (double)a.total, (double)b.total,
             (double)a.sq, (double)b.sq);
        return false;
    }
    return true;
}

static const double kTol = 1e-5;

/* ---- fast mode ----------------------------------------------------------------------------- */

/* The norm plan of cuda_train.h, built independently of adamw.c. */
struct DevPlan {
    kiln_cuda_norm_plan plan = {};
    void *chunk = nullptr, *first = nullptr, *partial = nullptr;
};

static void plan_make(DevPlan &D, kiln_backend *be, const std::vector<int64_t> &n) {
    std::vector<kiln_cuda_norm_chunk> ch;
    std::vector<int32_t> first;
    for (size_t i = 0; i < n.size(); i++) {
        first.push_back((int32_t)ch.size());
        for (int64_t c = 0; c * KILN_CUDA_NORM_CHUNK < n[i]; c++)
            ch.push_back({(int32_t)i, (int32_t)c});
    }
    first.push_back((int32_t)ch.size());
    D.chunk = dalloc(be, ch.size() * sizeof(kiln_cuda_norm_chunk));
    D.first = dalloc(be, first.size() * sizeof(int32_t));
    D.partial = dalloc(be, ch.size() * sizeof(double));
    OK_OR_FAIL(kiln_backend_upload(be, D.chunk, ch.data(), ch.size() * sizeof ch[0]));
    OK_OR_FAIL(kiln_backend_upload(be, D.first, first.data(), first.size() * sizeof first[0]));
    D.plan.chunk = (const kiln_cuda_norm_chunk *)D.chunk;
    D.plan.first = (const int32_t *)D.first;
    D.plan.partial = (double *)D.partial;
    D.plan.n_chunks = (int64_t)ch.size();
}

static void plan_free(DevPlan &D, kiln_backend *be) {
    kiln_backend_free_buf(be, D.chunk);
    kiln_backend_free_buf(be, D.first);
    kiln_backend_free_buf(be, D.partial);
}

/* The gradient table of cuda_train.h for D. */
static kiln_cuda_grad_entry *table_make(kiln_backend *be, const DevGrads &D, const HostGrads &G) {
    std::vector<kiln_cuda_grad_entry> t(G.n.size());
    for (size_t i = 0; i < t.size(); i++) t[i] = {D.ptr[i], G.n[i]};
    kiln_cuda_grad_entry *d = (kiln_cuda_grad_entry *)dalloc(be, t.size() * sizeof t[0]);
    OK_OR_FAIL(kiln_backend_upload(be, d, t.data(), t.size() * sizeof t[0]));
    return d;
}

/* kiln_cuda_adamw_norms directly: the norms and out[0..2], poisoned first. */
static NormOut direct_norms(kiln_backend *be, const kiln_cuda_grad_entry *table, size_t P,
                            const kiln_cuda_norm_plan *plan, float *d_norms, float *d_out) {
    NormOut r;
    std::vector<float> poison(P, nan_poison());
    float out[3] = {nan_poison(), nan_poison(), nan_poison()};
    OK_OR_FAIL(kiln_backend_upload(be, d_norms, poison.data(), P * 4));
    OK_OR_FAIL(kiln_backend_upload(be, d_out, out, sizeof out));
    OK_OR_FAIL(kiln_cuda_adamw_norms(be, table, (int)P, plan, d_norms, d_out, 0, 0.0f));
    r.norms.resize(P);
    OK_OR_FAIL(kiln_backend_download(be, r.norms.data(), d_norms, P * 4));
    OK_OR_FAIL(kiln_backend_download(be, out, d_out, sizeof out));
    r.sq = out[0];
    r.total = out[1];
    return r;
}

/* Norms within kTol of the reference; returns the largest relative error (+Inf on a miss).
 * tight: the per-tensor norms also within 2^-23 (the double sums leave only the final
 * rounding to float, half an ulp). */
static double check_ref(const NormOut &r, const HostGrads &G, const char *what, bool tight) {
    double worst = 0.0;
    for (size_t i = 0; i < G.n.size(); i++) {
        const double e = rel_err((double)r.norms[i], sqrt(G.ref_sq[i]));
        if (!(e <= (tight ? ldexp(1.0, -23) : kTol))) {
            FAIL("%s: norm %zu (n %lld): gpu %.9g ref %.12g rel %.3g", what, i,
                 (long long)G.n[i], (double)r.norms[i], sqrt(G.ref_sq[i]), e);
            return INFINITY;
        }
        if (e > worst) worst = e;
    }
    const double et = rel_err((double)r.total, sqrt(G.ref_total_sq));
    const double es = rel_err((double)r.sq, G.ref_total_sq);
    if (!(et <= kTol) || !(es <= kTol)) {
        FAIL("%s: total %.9g ref %.12g (rel %.3g), sq %.9g ref %.12g (rel %.3g)", what,
             (double)r.total, sqrt(G.ref_total_sq), et, (double)r.sq, G.ref_total_sq, es);
        return INFINITY;
    }
    return worst > et ? (worst > es ? worst : es) : (et > es ? et : es);
}

/* One float written into the device copy of tensor i at element e. */
static void poke(DevGrads &D, size_t i, int64_t e, float v) {
    OK_OR_FAIL(kiln_backend_upload(D.be, D.ptr[i] + e, &v, 4));
}

static void test_fast_case(const char *name, const std::vector<int64_t> &sizes, int shift,
                           int alt_shift) {
    const int fails0 = g_fail;
    HostGrads G;
    host_make(G, sizes);
    host_ref(G);
    const size_t P = sizes.size();
    DevGrads D;
    dev_make(D, g_fast, G, shift);
    dev_upload(D, G, 1.0f);
    Opt O;
    if (!opt_make(O, g_fast, D, G, KILN_ADAMW_MOMENTS_F32)) {
        dev_free(D);
        return;
    }
    char tag[160];

    /* against the double reference */
    const NormOut n1 = grad_norm(O.o, P);
    snprintf(tag, sizeof tag, "fast %s: vs double reference", name);
    const double worst = check_ref(n1, G, tag, true);

    /* doubled gradients: exactly doubled norms, total, and 4x sq */
    dev_upload(D, G, 2.0f);
    const NormOut n2 = grad_norm(O.o, P);
    for (size_t i = 0; i < P; i++)
        if (bits(n2.norms[i]) != bits(2.0f * n1.norms[i])) {
            FAIL("fast %s: 2g: norm %zu = %.9g, expected 2 x %.9g", name, i, (double)n2.norms[i],
                 (double)n1.norms[i]);
            break;
        }
    if (bits(n2.total) != bits(2.0f * n1.total) || bits(n2.sq) != bits(4.0f * n1.sq))
        FAIL("fast %s: 2g: total %.9g sq %.9g, expected 2 x %.9g, 4 x %.9g", name,
             (double)n2.total, (double)n2.sq, (double)n1.total, (double)n1.sq);

    /* the same data again: the same bits */
    dev_upload(D, G, 1.0f);
    const NormOut n3 = grad_norm(O.o, P);
    snprintf(tag, sizeof tag, "fast %s: run 2 vs run 1", name);
    same_norms(n3, n1, tag);

    /* the same values at other addresses */
    if (alt_shift != shift) {
        DevGrads D2;
        dev_make(D2, g_fast, G, alt_shift);
        dev_upload(D2, G, 1.0f);
        Opt O2;
        if (opt_make(O2, g_fast, D2, G, KILN_ADAMW_MOMENTS_Q8)) {
            const NormOut n4 = grad_norm(O2.o, P);
            snprintf(tag, sizeof tag, "fast %s: layout %d vs %d", name, alt_shift, shift);
            same_norms(n4, n1, tag);
            opt_free(O2, g_fast);
        }
        dev_free(D2);
    }

    /* the entry point with a plan built here, and with plan NULL (torch's order) */
    {
        kiln_cuda_grad_entry *table = table_make(g_fast, D, G);
        float *d_norms = (float *)dalloc(g_fast, P * 4);
        float *d_out = (float *)dalloc(g_fast, 64);
        DevPlan dp;
        plan_make(dp, g_fast, G.n);
        const NormOut d1 = direct_norms(g_fast, table, P, &dp.plan, d_norms, d_out);
        snprintf(tag, sizeof tag, "fast %s: direct call vs optimizer", name);
        same_norms(d1, n1, tag);
        const NormOut d0 = direct_norms(g_fast, table, P, nullptr, d_norms, d_out);
        for (size_t i = 0; i < P; i++) {
            const float want = kiln_grad_norm_torch(G.h.data() + G.off[i], G.n[i]);
            if (bits(d0.norms[i]) != bits(want)) {
                FAIL("fast %s: plan NULL: norm %zu = %.9g (0x%08x), torch order %.9g (0x%08x)",
                     name, i, (double)d0.norms[i], bits(d0.norms[i]), (double)want, bits(want));
                break;
            }
        }
        plan_free(dp, g_fast);
        kiln_backend_free_buf(g_fast, d_out);
        kiln_backend_free_buf(g_fast, d_norms);
        kiln_backend_free_buf(g_fast, table);
    }

    /* small integers: every partial sum is exact in double, so each norm must be exactly
     * (float)sqrt(the exact sum of squares) -- an element missed or counted twice shows */
    {
        HostGrads I = G;
        for (size_t i = 0; i < P; i++) {
            float *g = I.h.data() + I.off[i];
            for (int64_t e = 0; e < I.n[i]; e++) g[e] = (float)((int)(rnd64() % 17) - 8);
        }
        dev_upload(D, I, 1.0f);
        const NormOut ni = grad_norm(O.o, P);
        for (size_t i = 0; i < P; i++) {
            const float *g = I.h.data() + I.off[i];
            int64_t sum = 0;
            for (int64_t e = 0; e < I.n[i]; e++) sum += (int64_t)g[e] * (int64_t)g[e];
            const float want = (float)sqrt((double)sum);
            if (bits(ni.norms[i]) != bits(want)) {
                FAIL("fast %s: integers: norm %zu (n %lld) = %.9g, exact %.9g (sum %lld)", name,
                     i, (long long)I.n[i], (double)ni.norms[i], (double)want, (long long)sum);
                break;
            }
        }
        dev_upload(D, G, 1.0f);
    }

    /* clip (active): the coefficient, and every gradient times exactly it */
    const double max_norm = 0.25 * sqrt(G.ref_total_sq);
    float tn = nan_poison(), coef = nan_poison();
    OK_OR_FAIL(kiln_adamw_clip_grads(O.o, nullptr, max_norm, &tn, &coef));
    const double ref_coef = fmin(max_norm / (sqrt(G.ref_total_sq) + 1e-6), 1.0);
    if (bits(tn) != bits(n1.total))
        FAIL("fast %s: clip total %.9g vs grad_norm %.9g", name, (double)tn, (double)n1.total);
    if (!(rel_err((double)coef, ref_coef) <= kTol))
        FAIL("fast %s: clip coef %.9g ref %.12g", name, (double)coef, ref_coef);
    {
        std::vector<float> got;
        bool bad = false;
        for (size_t i = 0; i < P && !bad; i++) {
            got.resize((size_t)G.n[i]);
            OK_OR_FAIL(kiln_backend_download(g_fast, got.data(), D.ptr[i], (size_t)G.n[i] * 4));
            const float *h = G.h.data() + G.off[i];
            for (int64_t e = 0; e < G.n[i]; e++)
                if (bits(got[(size_t)e]) != bits(h[e] * coef)) {
                    FAIL("fast %s: clipped grad %zu[%lld] = %.9g, expected %.9g x %.9g", name, i,
                         (long long)e, (double)got[(size_t)e], (double)h[e], (double)coef);
                    bad = true;
                    break;
                }
        }
    }
    dev_upload(D, G, 1.0f);
    float tn2 = nan_poison(), coef2 = nan_poison();
    OK_OR_FAIL(kiln_adamw_clip_grads(O.o, nullptr, max_norm, &tn2, &coef2));
    if (bits(tn2) != bits(tn) || bits(coef2) != bits(coef))
        FAIL("fast %s: clip twice: total %.9g / %.9g, coef %.9g / %.9g", name, (double)tn2,
             (double)tn, (double)coef2, (double)coef);

    /* non-finite gradients: refused, and only that tensor's norm is non-finite */
    dev_upload(D, G, 1.0f);
    size_t big = 0;
    for (size_t i = 0; i < P; i++)
        if (G.n[i] > G.n[big]) big = i;
    const int64_t e_bad = G.n[big] / 2 + (G.n[big] > 3 ? 1 : 0);
    const float specials[3] = {NAN, INFINITY, -INFINITY};
    for (int k = 0; k < 3; k++) {
        poke(D, big, e_bad, specials[k]);
        kiln_status st = kiln_adamw_grads_finite(O.o, nullptr);
        const char *msg = kiln_last_error();
        if (st != KILN_ERR_RANGE || !strstr(msg, O.names[big].c_str()))
            FAIL("fast %s: grads_finite with %g at %s[%lld]: %s (%s)", name, (double)specials[k],
                 O.names[big].c_str(), (long long)e_bad, kiln_status_string(st), msg);
        if (kiln_adamw_step(O.o, nullptr) != KILN_ERR_RANGE || kiln_adamw_get_step(O.o) != 0)
            FAIL("fast %s: step with %g not refused", name, (double)specials[k]);
        const NormOut nb = grad_norm(O.o, P);
        for (size_t i = 0; i < P; i++) {
            const bool ok = i == big ? (k == 0 ? std::isnan(nb.norms[i])
                                               : nb.norms[i] == INFINITY)
                                     : bits(nb.norms[i]) == bits(n1.norms[i]);
            if (!ok) {
                FAIL("fast %s: with %g in tensor %zu: norm %zu = %.9g (clean %.9g)", name,
                     (double)specials[k], big, i, (double)nb.norms[i], (double)n1.norms[i]);
                break;
            }
        }
        if (k == 0 ? !std::isnan(nb.total) : nb.total != INFINITY)
            FAIL("fast %s: with %g: total %.9g", name, (double)specials[k], (double)nb.total);
        poke(D, big, e_bad, G.h[(size_t)(G.off[big] + e_bad)]);
    }
    if (kiln_adamw_grads_finite(O.o, nullptr) != KILN_OK)
        FAIL("fast %s: grads_finite after restoring: %s", name, kiln_last_error());

    OK_OR_FAIL(kiln_backend_status(g_fast));
    opt_free(O, g_fast);
    dev_free(D);
    printf("fast norm %s: P %zu, %zu elements, max rel err %.3g, total %.9g, coef %.9g: %s\n",
           name, P, G.h.size(), worst, (double)n1.total, (double)coef,
           g_fail == fails0 ? "OK" : "FAILED");
}

/* ---- auditable mode ------------------------------------------------------------------------ */

static void test_auditable_case(const char *name, const std::vector<int64_t> &sizes, int shift) {
    const int fails0 = g_fail;
    HostGrads G;
    host_make(G, sizes);
    const size_t P = sizes.size();
    DevGrads D;
    dev_make(D, g_aud, G, shift);
    dev_upload(D, G, 1.0f);
    Opt O;
    if (!opt_make(O, g_aud, D, G, KILN_ADAMW_MOMENTS_F32)) {
        dev_free(D);
        return;
    }
    /* the CPU optimizer over a host copy */
    std::vector<float> hg = G.h, hw((size_t)G.max_n, 0.0f);
    std::vector<kiln_adamw_param> ps(P);
    for (size_t i = 0; i < P; i++)
        ps[i] = {O.names[i].c_str(), G.n[i], hw.data(), hg.data() + G.off[i]};
    kiln_adamw_config cfg = kiln_adamw_default_config();
    kiln_adamw *cpu = nullptr;
    OK_OR_FAIL(kiln_adamw_create(ps.data(), (int)P, &cfg, &cpu));
    if (cpu) {
        const NormOut g1 = grad_norm(O.o, P), c1 = grad_norm(cpu, P);
        char tag[160];
        snprintf(tag, sizeof tag, "auditable %s: gpu vs cpu", name);
        same_norms(g1, c1, tag);
        for (size_t i = 0; i < P; i++) {
            const float want = kiln_grad_norm_torch(G.h.data() + G.off[i], G.n[i]);
            if (bits(g1.norms[i]) != bits(want)) {
                FAIL("auditable %s: norm %zu = %.9g, kiln_grad_norm_torch %.9g", name, i,
                     (double)g1.norms[i], (double)want);
                break;
            }
        }
        const double max_norm = 0.25 * (double)c1.total;
        float gt = nan_poison(), gc = nan_poison(), ct = nan_poison(), cc = nan_poison();
        OK_OR_FAIL(kiln_adamw_clip_grads(O.o, nullptr, max_norm, &gt, &gc));
        OK_OR_FAIL(kiln_adamw_clip_grads(cpu, nullptr, max_norm, &ct, &cc));
        if (bits(gt) != bits(ct) || bits(gc) != bits(cc))
            FAIL("auditable %s: clip total %.9g / %.9g, coef %.9g / %.9g", name, (double)gt,
                 (double)ct, (double)gc, (double)cc);
        std::vector<float> got;
        for (size_t i = 0; i < P; i++) {
            got.resize((size_t)G.n[i]);
            OK_OR_FAIL(kiln_backend_download(g_aud, got.data(), D.ptr[i], (size_t)G.n[i] * 4));
            if (memcmp(got.data(), hg.data() + G.off[i], (size_t)G.n[i] * 4) != 0) {
                FAIL("auditable %s: clipped gradient %zu differs from the CPU's", name, i);
                break;
            }
        }
        kiln_adamw_free(cpu);
    }
    OK_OR_FAIL(kiln_backend_status(g_aud));
    opt_free(O, g_aud);
    dev_free(D);
    printf("auditable norm %s: P %zu, %zu elements, CPU bits: %s\n", name, P, G.h.size(),
           g_fail == fails0 ? "OK" : "FAILED");
}

/* ---- timing -------------------------------------------------------------------------------- */

static void test_timing() {
    const int fails0 = g_fail;
    /* 494,000,000 floats (Qwen2.5-0.5B has 494M parameters): the 151936 x 896 embedding and
     * four equal tensors */
    const std::vector<int64_t> sizes = {151936LL * 896, 89466336, 89466336, 89466336, 89466336};
    HostGrads G;
    host_make(G, sizes);
    host_ref(G);
    const size_t P = sizes.size();
    DevGrads D;
    dev_make(D, g_fast, G, -1);
    dev_upload(D, G, 1.0f);
    kiln_cuda_grad_entry *table = table_make(g_fast, D, G);
    float *d_norms = (float *)dalloc(g_fast, P * 4);
    float *d_out = (float *)dalloc(g_fast, 64);
    DevPlan dp;
    plan_make(dp, g_fast, G.n);
    const NormOut r1 = direct_norms(g_fast, table, P, &dp.plan, d_norms, d_out);
    const double worst = check_ref(r1, G, "fast 494M: vs double reference", true);
    const NormOut r2 = direct_norms(g_fast, table, P, &dp.plan, d_norms, d_out);
    same_norms(r2, r1, "fast 494M: run 2 vs run 1");

    cudaStream_t st = kiln_cuda_stream(g_fast);
    cudaEvent_t e0, e1;
    CUDA_OR_FAIL(cudaEventCreate(&e0));
    CUDA_OR_FAIL(cudaEventCreate(&e1));
    const int iters = 10;
    CUDA_OR_FAIL(cudaEventRecord(e0, st));
    for (int k = 0; k < iters; k++)
        OK_OR_FAIL(kiln_cuda_adamw_norms(g_fast, table, (int)P, &dp.plan, d_norms, d_out, 1, 1.0f));
    CUDA_OR_FAIL(cudaEventRecord(e1, st));
    CUDA_OR_FAIL(cudaEventSynchronize(e1));
    float ms_fast = 0.0f, ms_torch = 0.0f;
    CUDA_OR_FAIL(cudaEventElapsedTime(&ms_fast, e0, e1));
    ms_fast /= (float)iters;
    CUDA_OR_FAIL(cudaEventRecord(e0, st));
    OK_OR_FAIL(kiln_cuda_adamw_norms(g_fast, table, (int)P, nullptr, d_norms, d_out, 1, 1.0f));
    CUDA_OR_FAIL(cudaEventRecord(e1, st));
    CUDA_OR_FAIL(cudaEventSynchronize(e1));
    CUDA_OR_FAIL(cudaEventElapsedTime(&ms_torch, e0, e1));
    CUDA_OR_FAIL(cudaEventDestroy(e0));
    CUDA_OR_FAIL(cudaEventDestroy(e1));
    OK_OR_FAIL(kiln_backend_status(g_fast));

    plan_free(dp, g_fast);
    kiln_backend_free_buf(g_fast, d_out);
    kiln_backend_free_buf(g_fast, d_norms);
    kiln_backend_free_buf(g_fast, table);
    dev_free(D);
    const double gb = (double)G.h.size() * 4.0 / 1e9;
    printf("fast norm 494M (%zu floats, %.2f GB): %.3f ms (%.0f GB/s, mean of %d; target < 1.5)"
           "%s; torch-order kernel %.1f ms; max rel err %.3g: %s\n",
           G.h.size(), gb, (double)ms_fast, gb / ((double)ms_fast * 1e-3), iters,
           ms_fast < 1.5f ? "" : " SLOW", (double)ms_torch, worst,
           g_fail == fails0 ? "OK" : "FAILED");
}

/* ---- main ---------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
    bool big = true;
    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--no-big")) big = false;
        else if (!strcmp(argv[a], "--seed") && a + 1 < argc) g_rng = strtoull(argv[++a], 0, 10);
    }
    /* without a GPU: the host reference the auditable mode must equal */
    {
        const float g[11] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
        if (kiln_grad_norm_torch(g, 11) != sqrtf(506.0f)) FAIL("kiln_grad_norm_torch(1..11)");
        if (KILN_CUDA_NORM_CHUNK % 4 != 0) FAIL("KILN_CUDA_NORM_CHUNK not a multiple of 4");
    }
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("no GPU: skipped (%s)\n", g_fail ? "FAILED" : "CPU checks OK");
        return g_fail ? 1 : 77;
    }
    if (kiln_backend_cuda_create_mode(0, 1, &g_fast) != KILN_OK ||
        kiln_backend_cuda_create_mode(0, 0, &g_aud) != KILN_OK) {
        printf("no usable GPU (%s): skipped\n", kiln_last_error());
        return 77;
    }

    const int64_t C = KILN_CUDA_NORM_CHUNK;
    const std::vector<int64_t> odd = {1, 7, 1000003, 28000001};
    std::vector<int64_t> many;
    for (int i = 0; i < 300; i++) {
        int64_t n;
        switch (i % 10) {
        case 0: n = 1 + (int64_t)(rnd64() % 8); break;
        case 1: n = 5; break; /* odd index and 5 elements: all zeros (host_make) */
        case 2: n = C * (1 + (int64_t)(rnd64() % 3)); break;
        case 3: n = C - 1; break;
        case 4: n = C + 1; break;
        case 5: n = 896; break;
        case 6: n = 4096 + 3; break;
        default: n = 1 + (int64_t)(rnd64() % 300000); break;
        }
        many.push_back(n);
    }
    test_fast_case("odd sizes {1, 7, 1000003, 28000001}", odd, -1, 3);
    test_fast_case("300 tensors packed (unaligned)", many, 1, -1);
    test_fast_case("one element", {1}, 0, 2);
    test_auditable_case("odd sizes {1, 7, 1000003, 28000001}", odd, -1);
    test_auditable_case("300 tensors packed", many, 1);
    if (big) test_timing();

    OK_OR_FAIL(kiln_backend_status(g_fast));
    OK_OR_FAIL(kiln_backend_status(g_aud));
    kiln_backend_free(g_aud);
    kiln_backend_free(g_fast);
    if (g_fail) {
        printf("FAILED %d\n", g_fail);
        return 1;
    }
    printf("ALL OK\n");
    return 0;
}
