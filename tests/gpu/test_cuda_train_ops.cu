/*
 * test_cuda_train_ops.cu -- AdamW and the fused linear cross-entropy on the CUDA backend
 * against the CPU reference, bit for bit (auditable mode).
 *
 *   AdamW: every storage combination (4 weight variants x 2 moment variants), parameters of
 *   odd sizes, a weight-decay map with an excluded parameter, 5 steps with fresh random
 *   gradients, grad_norm and clip_grads (clipping active) each step: norms, total, coef,
 *   clipped gradients, weights, moments, master, compensation and the saved state equal to a
 *   CPU optimizer fed the same data; GPU state -> CPU optimizer and CPU state -> GPU optimizer,
 *   then both continue: equal; a NaN gradient: the same refusal and nothing changed.
 *   AdamW multi-tensor step: per storage combination (and f32 with weight_decay 0), 300
 *   parameters of odd sizes (1, 2, 3, 7, 255 .. 257, 4097, 16383 .. 16385 around the chunk,
 *   40000, 200003), some weights and grads at addresses that forbid the 16-byte loads, decay
 *   flags changed by a state load (the device table must follow): a GPU optimizer (one launch
 *   a step) equals a CPU optimizer bit for bit (weights, moments, master, compensation) after
 *   each of 3 steps.
 *   AdamW timing (skipped by --no-big): SmolLM2-135M's 272 parameter shapes, every storage
 *   combination, kiln_cuda_adamw_step_multi (cudaEvent, ms per step, mean of 10).
 *   Fused CE: V 1000 (H 64 and 896) and 151936, N 1/7/64, chunk 0/300, MEAN/SUM, masks,
 *   targets -100, dh overwrite/accumulate, dW, row_loss, row_stats_out then row_stats_in,
 *   f32 and bf16 weights: every output memcmp-equal to the CPU; the same errors.
 *   Fused distillation loss: V 1000 (H 64 and 896, teacher rows longer than V) and 151936,
 *   N 1/7/64, chunk 0/300, KL + CE, KL alone, CE alone, temperatures 0.5 and 2, MEAN/SUM,
 *   masks, dh overwrite/accumulate, dW, row_kl, row_ce, f32 and bf16 weights: every output
 *   memcmp-equal to the CPU in auditable mode and in mx16 and mx8 (both backends in the
 *   format); fast mode within bf16 products' error of it; a non-finite teacher logit gives
 *   the CPU's error, a host teacher buffer is refused.
 *
 * Usage: test_cuda_train_ops [--no-big] [--seed N]. --no-big skips the V 151936 cases and the
 * AdamW timing. Exit 0 all OK, 1 on a mismatch, 77 without a GPU (after the checks that need
 * none).
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
#include "train/adamw.h"
#include "ops/fused_ce.h"
#include "ops/fused_kd.h"
}

#define GPU_TEST_SEED 0x1234567ull
#include "gpu_test_check.h"
#include "ops/cuda/cuda_internal.h"
extern "C" {
#include "ops/cuda/cuda_train.h"
}

#define CUDA_OR_FAIL(expr)                                                                     \
    do {                                                                                       \
        cudaError_t e_ = (expr);                                                               \
        if (e_ != cudaSuccess) FAIL("%s: %s", #expr, cudaGetErrorString(e_));                  \
    } while (0)

/* Bytes equal; reports the first differing element (elem bytes each). */
static bool same_bytes(const void *a, const void *b, size_t nbytes, size_t elem, const char *what) {
    if (memcmp(a, b, nbytes) == 0) return true;
    const uint8_t *x = (const uint8_t *)a, *y = (const uint8_t *)b;
    size_t i = 0;
    while (i < nbytes && x[i] == y[i]) i++;
    size_t e = i / elem;
    if (elem == 4) {
        float fa, fb;
        memcpy(&fa, x + e * 4, 4);
        memcpy(&fb, y + e * 4, 4);
        uint32_t ua, ub;
        memcpy(&ua, x + e * 4, 4);
        memcpy(&ub, y + e * 4, 4);
        FAIL("%s: element %zu differs: gpu %.9g (0x%08x) cpu %.9g (0x%08x)", what, e, (double)fa,
             ua, (double)fb, ub);
    } else {
        FAIL("%s: element %zu (byte %zu) differs: gpu 0x%02x cpu 0x%02x", what, e, i, x[i], y[i]);
    }
    return false;
}

static bool same_f(float a, float b, const char *what) {
    uint32_t ua, ub;
    memcpy(&ua, &a, 4);
    memcpy(&ub, &b, 4);
    if (ua == ub) return true;
    FAIL("%s: gpu %.9g (0x%08x) cpu %.9g (0x%08x)", what, (double)a, ua, (double)b, ub);
    return false;
}

static kiln_backend *g_gpu = nullptr, *g_cpu = nullptr;

static void *dalloc(size_t n) {
    void *p = kiln_backend_alloc(g_gpu, n);
    if (!p) {
        fprintf(stderr, "device allocation of %zu bytes failed: %s\n", n, kiln_last_error());
        exit(1);
    }
    return p;
}
static void up(void *d, const void *h, size_t n) { OK_OR_FAIL(kiln_backend_upload(g_gpu, d, h, n)); }
static void down(void *h, const void *d, size_t n) {
    OK_OR_FAIL(kiln_backend_download(g_gpu, h, d, n));
}

/* ---- AdamW --------------------------------------------------------------------------------- */

static kiln_status vec_writer(void *ctx, const void *data, size_t n) {
    std::vector<uint8_t> *v = (std::vector<uint8_t> *)ctx;
    v->insert(v->end(), (const uint8_t *)data, (const uint8_t *)data + n);
    return KILN_OK;
}

struct AdamSide {
    std::vector<std::vector<uint8_t>> w;  /* host weights (CPU side) */
    std::vector<std::vector<float>> g;    /* host grads (CPU side) */
    std::vector<void *> dw;               /* device weights (GPU side) */
    std::vector<float *> dg;              /* device grads (GPU side) */
};

static const int64_t kSizes[] = {1, 255, 256, 257, 10000};
static const char *kNames[] = {"model.layers.0.attn.q.weight", "model.layers.0.attn.q.bias",
                               "model.layers.0.mlp.w256", "model.layers.0.input_layernorm.weight",
                               "model.embed_tokens.weight"};
static const int kP = 5;

/* Compare everything of the two optimizers (and their weights); tag names the point. */
static void adam_compare(kiln_adamw *gpu, kiln_adamw *cpu, AdamSide &G, AdamSide &C, int bf16,
                         const kiln_adamw_config &cfg, const char *tag) {
    char what[256];
    for (int i = 0; i < kP; i++) {
        int64_t n = kSizes[i];
        size_t wb = (size_t)n * (bf16 ? 2 : 4);
        std::vector<uint8_t> hw(wb);
        down(hw.data(), G.dw[i], wb);
        snprintf(what, sizeof what, "%s: weights of '%s'", tag, kNames[i]);
        same_bytes(hw.data(), C.w[i].data(), wb, bf16 ? 2 : 4, what);
        std::vector<float> gm(n), gv(n), cm(n), cv(n);
        OK_OR_FAIL(kiln_adamw_get_moments(gpu, i, gm.data(), gv.data()));
        OK_OR_FAIL(kiln_adamw_get_moments(cpu, i, cm.data(), cv.data()));
        snprintf(what, sizeof what, "%s: m of '%s'", tag, kNames[i]);
        same_bytes(gm.data(), cm.data(), (size_t)n * 4, 4, what);
        snprintf(what, sizeof what, "%s: v of '%s'", tag, kNames[i]);
        same_bytes(gv.data(), cv.data(), (size_t)n * 4, 4, what);
        const float *gms = kiln_adamw_master(gpu, i), *cms = kiln_adamw_master(cpu, i);
        if ((gms == nullptr) != (cms == nullptr) ||
            (cfg.weights == KILN_ADAMW_BF16_MASTER) != (cms != nullptr))
            FAIL("%s: master presence differs for '%s'", tag, kNames[i]);
        else if (gms) {
            snprintf(what, sizeof what, "%s: master of '%s'", tag, kNames[i]);
            same_bytes(gms, cms, (size_t)n * 4, 4, what);
        }
        const uint16_t *gc = kiln_adamw_compensation(gpu, i), *cc = kiln_adamw_compensation(cpu, i);
        if ((gc == nullptr) != (cc == nullptr) ||
            (cfg.weights == KILN_ADAMW_BF16_KAHAN) != (cc != nullptr))
            FAIL("%s: compensation presence differs for '%s'", tag, kNames[i]);
        else if (gc) {
            snprintf(what, sizeof what, "%s: compensation of '%s'", tag, kNames[i]);
            same_bytes(gc, cc, (size_t)n * 2, 2, what);
        }
    }
    if (kiln_adamw_get_step(gpu) != kiln_adamw_get_step(cpu))
        FAIL("%s: step %lld vs %lld", tag, (long long)kiln_adamw_get_step(gpu),
             (long long)kiln_adamw_get_step(cpu));
}

/* Fresh random gradients (scale varies per parameter so that the norms differ). */
static void adam_new_grads(AdamSide &G, AdamSide &C, int step) {
    for (int i = 0; i < kP; i++) {
        float sc = 0.05f * (float)(i + 1) * (float)(step + 1);
        for (auto &x : C.g[i]) x = rndu() * sc;
        up(G.dg[i], C.g[i].data(), C.g[i].size() * 4);
    }
}

/* One clip + step on both, with every check. */
static void adam_step_both(kiln_adamw *gpu, kiln_adamw *cpu, AdamSide &G, AdamSide &C, int bf16,
                           const kiln_adamw_config &cfg, const char *tag, int step) {
    char what[256];
    /* grad_norm */
    float gn[kP], cn[kP], gt = 0, ct = 0, gsq = 0, csq = 0;
    OK_OR_FAIL(kiln_adamw_grad_norm(gpu, nullptr, gn, &gt, &gsq));
    OK_OR_FAIL(kiln_adamw_grad_norm(cpu, nullptr, cn, &ct, &csq));
    snprintf(what, sizeof what, "%s step %d: per-tensor norms", tag, step);
    same_bytes(gn, cn, sizeof gn, 4, what);
    snprintf(what, sizeof what, "%s step %d: total norm", tag, step);
    same_f(gt, ct, what);
    snprintf(what, sizeof what, "%s step %d: grad_sq_norm", tag, step);
    same_f(gsq, csq, what);
    /* clip with a max_norm small enough to clip */
    double max_norm = 0.5 * (double)ct;
    float gtn = 0, ctn = 0, gcoef = 0, ccoef = 0;
    OK_OR_FAIL(kiln_adamw_clip_grads(gpu, nullptr, max_norm, &gtn, &gcoef));
    OK_OR_FAIL(kiln_adamw_clip_grads(cpu, nullptr, max_norm, &ctn, &ccoef));
    snprintf(what, sizeof what, "%s step %d: clip total", tag, step);
    same_f(gtn, ctn, what);
    snprintf(what, sizeof what, "%s step %d: clip coef", tag, step);
    same_f(gcoef, ccoef, what);
    if (!(ccoef < 1.0f)) FAIL("%s step %d: clipping inactive (coef %g)", tag, step, (double)ccoef);
    for (int i = 0; i < kP; i++) {
        std::vector<float> hg(kSizes[i]);
        down(hg.data(), G.dg[i], hg.size() * 4);
        snprintf(what, sizeof what, "%s step %d: clipped grad of '%s'", tag, step, kNames[i]);
        same_bytes(hg.data(), C.g[i].data(), hg.size() * 4, 4, what);
    }
    OK_OR_FAIL(kiln_adamw_step(gpu, nullptr));
    OK_OR_FAIL(kiln_adamw_step(cpu, nullptr));
    snprintf(what, sizeof what, "%s step %d", tag, step);
    adam_compare(gpu, cpu, G, C, bf16, cfg, what);
    (void)bf16;
}

static void adam_make_side(AdamSide &S, int bf16, bool device, const AdamSide *from) {
    S.w.resize(kP);
    S.g.resize(kP);
    S.dw.assign(kP, nullptr);
    S.dg.assign(kP, nullptr);
    for (int i = 0; i < kP; i++) {
        int64_t n = kSizes[i];
        size_t wb = (size_t)n * (bf16 ? 2 : 4);
        S.w[i].resize(wb);
        S.g[i].assign(n, 0.0f);
        if (from) {
            S.w[i] = from->w[i];
        } else {
            for (int64_t e = 0; e < n; e++) {
                float x = rndu() * 0.5f;
                if (bf16) {
                    uint16_t b = kiln_fp32_to_bf16(x);
                    memcpy(S.w[i].data() + 2 * e, &b, 2);
                } else {
                    memcpy(S.w[i].data() + 4 * e, &x, 4);
                }
            }
        }
        if (device) {
            S.dw[i] = dalloc(wb);
            S.dg[i] = (float *)dalloc((size_t)n * 4);
            up(S.dw[i], S.w[i].data(), wb);
            up(S.dg[i], S.g[i].data(), (size_t)n * 4);
        }
    }
}

static void adam_free_side(AdamSide &S) {
    for (auto p : S.dw) kiln_backend_free_buf(g_gpu, p);
    for (auto p : S.dg) kiln_backend_free_buf(g_gpu, p);
    S.dw.clear();
    S.dg.clear();
}

static std::vector<kiln_adamw_param> adam_params(AdamSide &S, bool device) {
    std::vector<kiln_adamw_param> ps(kP);
    for (int i = 0; i < kP; i++) {
        ps[i].name = kNames[i];
        ps[i].n = kSizes[i];
        ps[i].weights = device ? S.dw[i] : (void *)S.w[i].data();
        ps[i].grad = device ? S.dg[i] : S.g[i].data();
    }
    return ps;
}

static void test_adamw_case(kiln_adamw_weights wk, kiln_adamw_moments mk) {
    const int fails0 = g_fail;
    const int bf16 = wk != KILN_ADAMW_F32;
    kiln_adamw_decay_rule rules[1] = {{"model.layers.0.mlp.w256", 0}};
    kiln_adamw_config cfg = kiln_adamw_default_config();
    cfg.lr = 1e-2;
    cfg.weight_decay = 0.1;
    cfg.weights = wk;
    cfg.moments = mk;
    cfg.seed = 4242;
    cfg.decay_map = rules;
    cfg.n_decay_map = 1;
    char tag[128];
    snprintf(tag, sizeof tag, "adamw w%d m%d", (int)wk, (int)mk);

    AdamSide C, G;
    adam_make_side(C, bf16, false, nullptr);
    adam_make_side(G, bf16, true, &C);
    auto pc = adam_params(C, false), pg = adam_params(G, true);
    kiln_adamw *cpu = nullptr, *gpu = nullptr;
    OK_OR_FAIL(kiln_adamw_create(pc.data(), kP, &cfg, &cpu));
    OK_OR_FAIL(kiln_adamw_create_on(g_gpu, pg.data(), kP, &cfg, &gpu));
    if (!cpu || !gpu) {
        kiln_adamw_free(cpu);
        kiln_adamw_free(gpu);
        adam_free_side(G);
        return;
    }
    for (int i = 0; i < kP; i++)
        if (kiln_adamw_param_decays(gpu, i) != kiln_adamw_param_decays(cpu, i))
            FAIL("%s: decay flag of '%s' differs", tag, kNames[i]);
    if (kiln_adamw_param_decays(cpu, 2) != 0 || kiln_adamw_param_decays(cpu, 1) != 0 ||
        kiln_adamw_param_decays(cpu, 0) != 1)
        FAIL("%s: decay map not as intended", tag);
    char dg[512], dc[512];
    kiln_adamw_memory mg, mc;
    kiln_adamw_describe(gpu, dg, sizeof dg, &mg);
    kiln_adamw_describe(cpu, dc, sizeof dc, &mc);
    if (strcmp(dg, dc) != 0 || memcmp(&mg, &mc, sizeof mg) != 0)
        FAIL("%s: describe differs:\n  gpu %s\n  cpu %s", tag, dg, dc);
    adam_compare(gpu, cpu, G, C, bf16, cfg, "after create");

    for (int step = 0; step < 5; step++) {
        adam_new_grads(G, C, step);
        adam_step_both(gpu, cpu, G, C, bf16, cfg, tag, step);
    }
    /* state: equal bytes; GPU state into a CPU optimizer, CPU state into the GPU optimizer */
    std::vector<uint8_t> sg, sc;
    OK_OR_FAIL(kiln_adamw_save(gpu, vec_writer, &sg));
    OK_OR_FAIL(kiln_adamw_save(cpu, vec_writer, &sc));
    if (sg.size() != kiln_adamw_state_size(gpu) || sg.size() != sc.size())
        FAIL("%s: state sizes %zu (gpu) %zu (cpu) state_size %llu", tag, sg.size(), sc.size(),
             (unsigned long long)kiln_adamw_state_size(gpu));
    else
        same_bytes(sg.data(), sc.data(), sg.size(), 1, "saved state gpu vs cpu");
    AdamSide C2;
    adam_make_side(C2, bf16, false, &C);
    auto pc2 = adam_params(C2, false);
    kiln_adamw *cpu2 = nullptr;
    kiln_adamw_config cfg2 = cfg;
    cfg2.lr = 0.5; /* restored by load */
    OK_OR_FAIL(kiln_adamw_create(pc2.data(), kP, &cfg2, &cpu2));
    if (cpu2) {
        OK_OR_FAIL(kiln_adamw_load(cpu2, sg.data(), sg.size()));
        OK_OR_FAIL(kiln_adamw_load(gpu, sc.data(), sc.size()));
        for (int step = 5; step < 7; step++) {
            adam_new_grads(G, C2, step);
            adam_step_both(gpu, cpu2, G, C2, bf16, cfg, "resumed", step);
        }
    }
    /* A NaN gradient: the same refusal, nothing changed. */
    adam_new_grads(G, C2, 9);
    C2.g[3][7] = NAN;
    C2.g[4][5000] = INFINITY;
    C2.g[4][3] = NAN;
    for (int i = 3; i < kP; i++) up(G.dg[i], C2.g[i].data(), C2.g[i].size() * 4);
    if (cpu2) {
        kiln_status s1 = kiln_adamw_step(gpu, nullptr);
        std::string m1 = kiln_last_error();
        kiln_status s2 = kiln_adamw_step(cpu2, nullptr);
        std::string m2 = kiln_last_error();
        if (s1 != KILN_ERR_RANGE || s2 != KILN_ERR_RANGE || m1 != m2)
            FAIL("%s: NaN refusal differs: gpu %d '%s' cpu %d '%s'", tag, (int)s1, m1.c_str(),
                 (int)s2, m2.c_str());
        if (m2.find("input_layernorm") == std::string::npos ||
            m2.find("element 7") == std::string::npos)
            FAIL("%s: NaN refusal names the wrong element: '%s'", tag, m2.c_str());
        OK_OR_FAIL(kiln_adamw_grads_finite(gpu, nullptr) == KILN_ERR_RANGE ? KILN_OK
                                                                           : KILN_ERR_INTERNAL);
        adam_compare(gpu, cpu2, G, C2, bf16, cfg, "after NaN refusal");
    }
    kiln_adamw_free(cpu2);
    kiln_adamw_free(cpu);
    kiln_adamw_free(gpu);
    adam_free_side(G);
    printf("%s (%s): 7 steps, 5 params (1..10000), clip + norms + state round trips: %s\n", tag,
           dc, g_fail == fails0 ? "OK" : "FAILED");
}

/* ---- AdamW: the multi-tensor step ---------------------------------------------------------- */

/* Pack P tensors of sizes n into one array of elem-byte elements: offsets in elements, each
 * start 64-byte aligned, plus one element (16-byte loads refused) where misalign(i). */
static std::vector<int64_t> pack_offsets(const std::vector<int64_t> &n, size_t elem,
                                         bool (*misalign)(int), int64_t *total) {
    std::vector<int64_t> off(n.size());
    int64_t t = 0;
    const int64_t a = 64 / (int64_t)elem;
    for (size_t i = 0; i < n.size(); i++) {
        t = (t + a - 1) / a * a;
        if (misalign((int)i)) t += 1;
        off[i] = t;
        t += n[i];
    }
    *total = t;
    return off;
}
static bool w_misaligned(int i) { return i % 4 == 1; }
static bool g_misaligned(int i) { return i % 5 == 2; }

static void test_adamw_multi_case(kiln_adamw_weights wk, kiln_adamw_moments mk, double wd) {
    const int fails0 = g_fail;
    const int P = 300;
    const int bf16 = wk != KILN_ADAMW_F32;
    const size_t we = bf16 ? 2 : 4;
    static const int64_t base[] = {1,     7,     4097, 3, 255,   256, 257,  16383,
                                   16384, 16385, 2,    5, 40000, 4,   1023, 33000};
    std::vector<int64_t> n(P);
    for (int i = 0; i < P; i++) n[i] = base[i % 16];
    n[150] = 200003;
    std::vector<std::string> names(P);
    std::vector<const char *> cnames(P);
    for (int i = 0; i < P; i++) {
        char b[96];
        if (i % 6 == 3) /* a norm: no decay by default */
            snprintf(b, sizeof b, "model.layers.%d.post_attention_layernorm.weight", i);
        else
            snprintf(b, sizeof b, "model.layers.%d.mlp.w%d.weight", i, i % 7);
        names[i] = b;
    }
    for (int i = 0; i < P; i++) cnames[i] = names[i].c_str();
    int64_t wt = 0, gt = 0;
    const std::vector<int64_t> woff = pack_offsets(n, we, w_misaligned, &wt);
    const std::vector<int64_t> goff = pack_offsets(n, 4, g_misaligned, &gt);

    /* host: weights (the CPU's, updated in place) and grads; device: two weight copies, one
     * gradient array both GPU optimizers read */
    std::vector<uint8_t> hw((size_t)wt * we);
    std::vector<float> hg((size_t)gt, 0.0f);
    for (int64_t e = 0; e < wt; e++) {
        const float x = rndu() * 0.5f;
        if (bf16) {
            const uint16_t b = kiln_fp32_to_bf16(x);
            memcpy(hw.data() + 2 * e, &b, 2);
        } else {
            memcpy(hw.data() + 4 * e, &x, 4);
        }
    }
    uint8_t *dw = (uint8_t *)dalloc(hw.size());
    float *dg = (float *)dalloc(hg.size() * 4);
    /* f32 weights: the GPU optimizer also writes a bf16 copy (w16), laid out as the weights
     * (so misaligned where they are: both the quad and the element path write it) */
    uint16_t *d16 = bf16 ? nullptr : (uint16_t *)dalloc((size_t)wt * 2);
    up(dw, hw.data(), hw.size());
    up(dg, hg.data(), hg.size() * 4);

    kiln_adamw_config cfg = kiln_adamw_default_config();
    cfg.lr = 1e-2;
    cfg.weight_decay = wd;
    cfg.weights = wk;
    cfg.moments = mk;
    cfg.seed = 777;
    std::vector<kiln_adamw_param> pc(P), pd(P);
    for (int i = 0; i < P; i++) {
        pc[i] = {cnames[i], n[i], hw.data() + (size_t)woff[i] * we, hg.data() + goff[i], nullptr};
        pd[i] = pc[i];
        pd[i].weights = dw + (size_t)woff[i] * we;
        pd[i].grad = dg + goff[i];
        pd[i].w16 = d16 ? d16 + woff[i] : nullptr;
    }
    /* the CPU optimizer's decay map flips two defaults; the GPU one gets the flags by load */
    kiln_adamw_decay_rule rules[2] = {{cnames[0], 0}, {cnames[3], 1}};
    kiln_adamw_config ccfg = cfg;
    ccfg.decay_map = rules;
    ccfg.n_decay_map = 2;
    kiln_adamw *cpu = nullptr, *gpu = nullptr;
    char tag[128];
    snprintf(tag, sizeof tag, "adamw multi w%d m%d wd %g", (int)wk, (int)mk, wd);
    OK_OR_FAIL(kiln_adamw_create(pc.data(), P, &ccfg, &cpu));
    OK_OR_FAIL(kiln_adamw_create_on(g_gpu, pd.data(), P, &cfg, &gpu));
    if (cpu && gpu) {
        std::vector<uint8_t> st;
        OK_OR_FAIL(kiln_adamw_save(cpu, vec_writer, &st));
        if (kiln_adamw_param_decays(gpu, 3) != 0)
            FAIL("%s: '%s' should not decay before the load", tag, cnames[3]);
        OK_OR_FAIL(kiln_adamw_load(gpu, st.data(), st.size()));
        for (int i = 0; i < P; i++)
            if (kiln_adamw_param_decays(gpu, i) != kiln_adamw_param_decays(cpu, i))
                FAIL("%s: decay flag of '%s' not restored", tag, cnames[i]);
        if (kiln_adamw_param_decays(cpu, 0) != 0 || kiln_adamw_param_decays(cpu, 3) != 1)
            FAIL("%s: decay map not as intended", tag);
    }
    for (int step = 0; step < 3 && cpu && gpu && g_fail == fails0; step++) {
        for (int i = 0; i < P; i++) {
            const float sc = 0.02f * (float)(i % 9 + 1) * (float)(step + 1);
            for (int64_t e = 0; e < n[i]; e++) hg[(size_t)(goff[i] + e)] = rndu() * sc;
        }
        up(dg, hg.data(), hg.size() * 4);
        OK_OR_FAIL(kiln_adamw_step(gpu, nullptr));
        OK_OR_FAIL(kiln_adamw_step(cpu, nullptr));
        char what[256];
        std::vector<uint8_t> gw(hw.size()), sc, sg;
        OK_OR_FAIL(kiln_adamw_save(cpu, vec_writer, &sc));
        /* the saved states (moments or 8-bit codes and scales, master, compensation, flags) */
        OK_OR_FAIL(kiln_adamw_save(gpu, vec_writer, &sg));
        snprintf(what, sizeof what, "%s step %d: saved state", tag, step);
        if (sg.size() != sc.size()) FAIL("%s: %zu vs %zu bytes", what, sg.size(), sc.size());
        else same_bytes(sg.data(), sc.data(), sg.size(), 1, what);
        down(gw.data(), dw, gw.size());
        std::vector<uint16_t> g16(d16 ? (size_t)wt : 0);
        if (d16) down(g16.data(), d16, g16.size() * 2);
        for (int i = 0; i < P && g_fail == fails0; i++) {
            const size_t o = (size_t)woff[i] * we, b = (size_t)n[i] * we;
            snprintf(what, sizeof what, "%s step %d: weights of '%s' (n %lld)", tag, step,
                     cnames[i], (long long)n[i]);
            same_bytes(gw.data() + o, hw.data() + o, b, we, what);
            if (d16) { /* w16: the bf16 (RNE) of the CPU's weights, bit for bit */
                std::vector<uint16_t> want((size_t)n[i]);
                for (int64_t e = 0; e < n[i]; e++) {
                    float x;
                    memcpy(&x, hw.data() + o + 4 * (size_t)e, 4);
                    want[(size_t)e] = kiln_fp32_to_bf16(x);
                }
                snprintf(what, sizeof what, "%s step %d: w16 of '%s' (n %lld)", tag, step,
                         cnames[i], (long long)n[i]);
                same_bytes(g16.data() + woff[i], want.data(), (size_t)n[i] * 2, 2, what);
            }
            std::vector<float> gm(n[i]), gv(n[i]), cm(n[i]), cv(n[i]);
            OK_OR_FAIL(kiln_adamw_get_moments(gpu, i, gm.data(), gv.data()));
            OK_OR_FAIL(kiln_adamw_get_moments(cpu, i, cm.data(), cv.data()));
            snprintf(what, sizeof what, "%s step %d: m of '%s'", tag, step, cnames[i]);
            same_bytes(gm.data(), cm.data(), (size_t)n[i] * 4, 4, what);
            snprintf(what, sizeof what, "%s step %d: v of '%s'", tag, step, cnames[i]);
            same_bytes(gv.data(), cv.data(), (size_t)n[i] * 4, 4, what);
            if (wk == KILN_ADAMW_BF16_MASTER) {
                const float *a = kiln_adamw_master(gpu, i), *c = kiln_adamw_master(cpu, i);
                snprintf(what, sizeof what, "%s step %d: master of '%s'", tag, step, cnames[i]);
                if (!a || !c) FAIL("%s: missing", what);
                else same_bytes(a, c, (size_t)n[i] * 4, 4, what);
            }
            if (wk == KILN_ADAMW_BF16_KAHAN) {
                const uint16_t *a = kiln_adamw_compensation(gpu, i);
                const uint16_t *c = kiln_adamw_compensation(cpu, i);
                snprintf(what, sizeof what, "%s step %d: compensation of '%s'", tag, step,
                         cnames[i]);
                if (!a || !c) FAIL("%s: missing", what);
                else same_bytes(a, c, (size_t)n[i] * 2, 2, what);
            }
        }
    }
    OK_OR_FAIL(kiln_backend_status(g_gpu));
    kiln_adamw_free(cpu);
    kiln_adamw_free(gpu);
    kiln_backend_free_buf(g_gpu, dw);
    if (d16) kiln_backend_free_buf(g_gpu, d16);
    kiln_backend_free_buf(g_gpu, dg);
    printf("%s: 300 params (1..200003, misaligned ones), 3 steps, GPU == CPU: %s\n", tag,
           g_fail == fails0 ? "OK" : "FAILED");
}

/* ---- AdamW: timing on SmolLM2-135M's shapes ------------------------------------------------ */

static __device__ __forceinline__ float hash_unit(uint64_t seed, int64_t i) {
    uint64_t z = seed + (uint64_t)i * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f; /* [-1, 1) */
}
static __global__ void fill_f32_kernel(float *x, int64_t n, uint64_t seed, float scale) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] = hash_unit(seed, i) * scale;
}
static __global__ void fill_bf16_kernel(uint16_t *x, int64_t n, uint64_t seed, float scale) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] = kiln_adamw_f32_bf16(hash_unit(seed, i) * scale);
}
/* Every state array, packed: tensor i at element off[i] (blocks boff[i]). */
struct BenchState {
    uint8_t *w;        /* (N) f32 or bf16 */
    float *g, *m, *v, *master;
    uint16_t *comp;
    int8_t *mq;
    uint8_t *vq;
    float *ms, *vs;    /* (NB) */
};

/* The scalars of step t as adamw.c computes them (lr 1e-3, betas 0.9/0.999, eps 1e-8,
 * weight_decay 0.01, seed 7). */
static kiln_adamw_scalars bench_scalars(int64_t t) {
    const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01;
    kiln_adamw_scalars s;
    memset(&s, 0, sizeof s);
    s.use_wd = 1;
    s.wd_mul = (float)(1.0 - lr * wd);
    const float w1 = (float)(1.0 - b1);
    s.lerp_small = fabsf(w1) < 0.5f;
    s.lerp_coeff = s.lerp_small ? w1 : w1 - 1.0f;
    s.beta2 = (float)b2;
    s.c2 = (float)(1.0 - b2);
    s.bc2_sqrt = (float)pow(1.0 - pow(b2, (double)t), 0.5);
    s.eps = (float)eps;
    s.neg_step_size = (float)(-(lr / (1.0 - pow(b1, (double)t))));
    s.sr_key = kiln_adamw_mix64(kiln_adamw_mix64(7) + (uint64_t)t);
    return s;
}

static void test_adamw_timing() {
    const int fails0 = g_fail;
    /* SmolLM2-135M: embedding, 30 layers of q, k, v, o, gate, up, down and two norms, the
     * final norm (272 tensors, 134.5M elements) */
    const int64_t C = 576, KV = 192, F = 1536, V = 49152;
    std::vector<int64_t> n;
    std::vector<int> decay;
    n.push_back(V * C);
    decay.push_back(1);
    for (int l = 0; l < 30; l++) {
        for (int64_t x : {C * C, KV * C, KV * C, C * C, F * C, F * C, C * F}) {
            n.push_back(x);
            decay.push_back(1);
        }
        for (int k = 0; k < 2; k++) {
            n.push_back(C);
            decay.push_back(0);
        }
    }
    n.push_back(C);
    decay.push_back(0);
    const int P = (int)n.size();
    std::vector<int64_t> off(P), boff(P);
    int64_t N = 0, NB = 0;
    for (int i = 0; i < P; i++) {
        off[i] = N;
        boff[i] = NB;
        N += (n[i] + 63) / 64 * 64;
        NB += (n[i] + KILN_ADAMW_Q8_BLOCK - 1) / KILN_ADAMW_Q8_BLOCK;
    }
    BenchState S;
    S.w = (uint8_t *)dalloc((size_t)N * 4);
    S.g = (float *)dalloc((size_t)N * 4);
    S.m = (float *)dalloc((size_t)N * 4);
    S.v = (float *)dalloc((size_t)N * 4);
    S.master = (float *)dalloc((size_t)N * 4);
    S.comp = (uint16_t *)dalloc((size_t)N * 2);
    S.mq = (int8_t *)dalloc((size_t)N);
    S.vq = (uint8_t *)dalloc((size_t)N);
    S.ms = (float *)dalloc((size_t)NB * 4);
    S.vs = (float *)dalloc((size_t)NB * 4);
    kiln_cuda_adamw_param *d_table =
        (kiln_cuda_adamw_param *)dalloc((size_t)P * sizeof(kiln_cuda_adamw_param));
    cudaStream_t st = kiln_cuda_stream(g_gpu);
    cudaEvent_t e0, e1;
    CUDA_OR_FAIL(cudaEventCreate(&e0));
    CUDA_OR_FAIL(cudaEventCreate(&e1));
    printf("adamw timing, SmolLM2-135M shapes (%d tensors, %lld elements), ms per step "
           "(mean of 10):\n", P, (long long)(N));
    for (int wk = 0; wk < 4; wk++)
        for (int mk = 0; mk < 2; mk++) {
            const int bf16 = wk != KILN_ADAMW_F32;
            /* weights and grads, zero state, the master widened */
            if (bf16) fill_bf16_kernel<<<1024, 256, 0, st>>>((uint16_t *)S.w, N, 11, 0.05f);
            else fill_f32_kernel<<<1024, 256, 0, st>>>((float *)S.w, N, 11, 0.05f);
            fill_f32_kernel<<<1024, 256, 0, st>>>(S.g, N, 12, 0.01f);
            CUDA_OR_FAIL(cudaMemsetAsync(S.m, 0, (size_t)N * 4, st));
            CUDA_OR_FAIL(cudaMemsetAsync(S.v, 0, (size_t)N * 4, st));
            CUDA_OR_FAIL(cudaMemsetAsync(S.comp, 0, (size_t)N * 2, st));
            CUDA_OR_FAIL(cudaMemsetAsync(S.mq, 0, (size_t)N, st));
            CUDA_OR_FAIL(cudaMemsetAsync(S.vq, 0, (size_t)N, st));
            CUDA_OR_FAIL(cudaMemsetAsync(S.ms, 0, (size_t)NB * 4, st));
            CUDA_OR_FAIL(cudaMemsetAsync(S.vs, 0, (size_t)NB * 4, st));
            if (wk == KILN_ADAMW_BF16_MASTER)
                OK_OR_FAIL(kiln_cuda_adamw_widen_bf16(g_gpu, S.master, (const uint16_t *)S.w, N));
            std::vector<kiln_cuda_adamw_param> tab;
            for (int i = 0; i < P; i++) {
                kiln_cuda_adamw_param q;
                memset(&q, 0, sizeof q);
                q.n = n[i];
                q.param_index = i;
                q.weights_kind = wk;
                q.q8 = mk;
                q.decay = decay[i]; /* use_wd is 1 */
                q.weights = S.w + (size_t)off[i] * (bf16 ? 2 : 4);
                q.grad = S.g + off[i];
                if (mk) {
                    q.mq = S.mq + off[i];
                    q.vq = S.vq + off[i];
                    q.ms = S.ms + boff[i];
                    q.vs = S.vs + boff[i];
                } else {
                    q.m = S.m + off[i];
                    q.v = S.v + off[i];
                }
                if (wk == KILN_ADAMW_BF16_MASTER) q.master = S.master + off[i];
                if (wk == KILN_ADAMW_BF16_KAHAN) q.comp = S.comp + off[i];
                tab.push_back(q);
            }
            const int64_t n_chunks = kiln_cuda_adamw_chunks(tab.data(), P, nullptr);
            std::vector<kiln_cuda_adamw_chunk> ch((size_t)n_chunks);
            kiln_cuda_adamw_chunks(tab.data(), P, ch.data());
            kiln_cuda_adamw_chunk *d_chunk =
                (kiln_cuda_adamw_chunk *)dalloc((size_t)n_chunks * sizeof(kiln_cuda_adamw_chunk));
            up(d_chunk, ch.data(), ch.size() * sizeof(kiln_cuda_adamw_chunk));
            up(d_table, tab.data(), (size_t)P * sizeof(kiln_cuda_adamw_param));
            kiln_cuda_adamw_plan plan = {d_table, d_chunk, n_chunks, wk, mk};
            int64_t t = 0;
            float ms = 0.0f;
            for (int rep = 0; rep < 12; rep++) { /* 2 warm-up steps, then 10 timed */
                const kiln_adamw_scalars sc = bench_scalars(++t);
                CUDA_OR_FAIL(cudaEventRecord(e0, st));
                OK_OR_FAIL(kiln_cuda_adamw_step_multi(g_gpu, &plan, &sc));
                CUDA_OR_FAIL(cudaEventRecord(e1, st));
                CUDA_OR_FAIL(cudaEventSynchronize(e1));
                float x = 0.0f;
                CUDA_OR_FAIL(cudaEventElapsedTime(&x, e0, e1));
                if (rep >= 2) ms += x / 10.0f;
            }
            CUDA_OR_FAIL(cudaGetLastError());
            printf("  w%d m%d (%s, %s): %.3f ms (1 launch, %lld chunks)\n", wk, mk,
                   bf16 ? "bf16 weights" : "f32 weights", mk ? "8-bit moments" : "f32 moments",
                   (double)ms, (long long)n_chunks);
            kiln_backend_free_buf(g_gpu, d_chunk);
        }
    CUDA_OR_FAIL(cudaEventDestroy(e0));
    CUDA_OR_FAIL(cudaEventDestroy(e1));
    kiln_backend_free_buf(g_gpu, d_table);
    void *all[] = {S.w, S.g, S.m, S.v, S.master, S.comp, S.mq, S.vq, S.ms, S.vs};
    for (void *p : all) kiln_backend_free_buf(g_gpu, p);
    OK_OR_FAIL(kiln_backend_status(g_gpu));
    printf("adamw timing: %s\n", g_fail == fails0 ? "OK" : "FAILED");
}

/* ---- fused CE ------------------------------------------------------------------------------ */

struct CeCase {
    int64_t V, H, N, chunk;
    kiln_dtype dt;
    kiln_ce_reduction red;
    int accumulate;  /* dh accumulate */
    int with_dh, with_dw;
    int masked;      /* mask with unsupervised rows */
};

/* A fused loss's random inputs: hidden(N, H), the head w(V, H) in dt, targets (every fifth
 * -100), a mask (masked: every third row off), the initial dh (accumulate: random, else NaN: it
 * must be overwritten) and dW. N == 1: the target is the last column (the last chunk). */
struct LossInputs {
    std::vector<float> hidden, dh0, dw0;
    std::vector<uint8_t> w, mask;
    std::vector<int32_t> tg;
    size_t wb;
};

static LossInputs loss_inputs(int64_t N, int64_t H, int64_t V, kiln_dtype dt, int masked, int accumulate) {
    LossInputs in;
    const int bf16 = dt == KILN_DTYPE_BF16;
    in.wb = (size_t)V * (size_t)H * (bf16 ? 2 : 4);
    in.hidden.resize((size_t)N * H);
    for (auto &x : in.hidden) x = rndu() * 2.0f;
    in.w.resize(in.wb);
    for (int64_t e = 0; e < V * H; e++) {
        float x = rndu() * 0.5f;
        if (bf16) {
            uint16_t b = kiln_fp32_to_bf16(x);
            memcpy(in.w.data() + 2 * e, &b, 2);
        } else {
            memcpy(in.w.data() + 4 * e, &x, 4);
        }
    }
    in.tg.resize(N);
    in.mask.assign(N, 1);
    for (int64_t n = 0; n < N; n++) {
        in.tg[n] = (int32_t)(rnd64() % (uint64_t)V);
        if (n % 5 == 3) in.tg[n] = -100;
        if (masked && n % 3 == 1) in.mask[n] = 0;
    }
    if (N == 1) in.tg[0] = (int32_t)(V - 1), in.mask[0] = 1;
    in.dh0.resize((size_t)N * H);
    in.dw0.resize((size_t)V * H);
    for (auto &x : in.dh0) x = accumulate ? rndu() : NAN;
    for (auto &x : in.dw0) x = rndu() * 0.1f;
    return in;
}

static void test_ce_case(const CeCase &c) {
    const int fails0 = g_fail;
    const int64_t N = c.N, H = c.H, V = c.V;
    const int bf16 = c.dt == KILN_DTYPE_BF16;
    LossInputs in = loss_inputs(N, H, V, c.dt, c.masked, c.accumulate);
    const size_t wb = in.wb;
    const std::vector<float> &hidden = in.hidden, &dh0 = in.dh0, &dw0 = in.dw0;
    const std::vector<uint8_t> &w = in.w, &mask = in.mask;
    std::vector<int32_t> &tg = in.tg;

    /* device copies */
    float *d_hidden = (float *)dalloc(hidden.size() * 4);
    void *d_w = dalloc(wb);
    float *d_dh = (float *)dalloc(dh0.size() * 4), *d_dw = (float *)dalloc(dw0.size() * 4);
    float *d_rl = (float *)dalloc((size_t)N * 4), *d_rs = (float *)dalloc((size_t)N * 12);
    up(d_hidden, hidden.data(), hidden.size() * 4);
    up(d_w, w.data(), wb);

    char tag[200];
    snprintf(tag, sizeof tag, "fused_ce %s V=%lld H=%lld N=%lld chunk=%lld %s%s%s%s%s",
             bf16 ? "bf16" : "f32", (long long)V, (long long)H, (long long)N, (long long)c.chunk,
             c.red == KILN_CE_REDUCTION_MEAN ? "MEAN" : "SUM", c.masked ? " mask" : "",
             c.with_dh ? (c.accumulate ? " dh+=" : " dh=") : "", c.with_dw ? " dW" : "", "");

    std::vector<float> stats_cpu; /* round 0's row_stats_out (the GPU's stay in d_rs) */
    for (int round = 0; round < 2; round++) { /* 0: full; 1: with row_stats_in */
        std::vector<float> cdh = dh0, cdw = dw0, crl(N, NAN), crs((size_t)N * 3, NAN);
        std::vector<float> gdh(dh0.size()), gdw(dw0.size()), grl(N), grs((size_t)N * 3);
        std::vector<float> nan_n(N, NAN), nan_rs((size_t)N * 3, NAN);
        up(d_dh, dh0.data(), dh0.size() * 4);
        up(d_dw, dw0.data(), dw0.size() * 4);
        up(d_rl, nan_n.data(), (size_t)N * 4);
        if (round == 0) up(d_rs, nan_rs.data(), (size_t)N * 12);

        kiln_fused_ce_params p = kiln_fused_ce_default_params();
        p.N = N;
        p.H = H;
        p.V = V;
        p.weight_dtype = c.dt;
        p.targets = tg.data();
        p.mask = c.masked ? mask.data() : nullptr;
        p.reduction = c.red;
        p.scale = 0.75f;
        p.chunk = c.chunk;
        p.dhidden_accumulate = c.accumulate;
        kiln_fused_ce_params pc = p, pg = p;
        pc.hidden = hidden.data();
        pc.weight = w.data();
        pc.dhidden = c.with_dh ? cdh.data() : nullptr;
        pc.dweight = c.with_dw ? cdw.data() : nullptr;
        pc.row_loss = crl.data();
        pg.hidden = d_hidden;
        pg.weight = d_w;
        pg.dhidden = c.with_dh ? d_dh : nullptr;
        pg.dweight = c.with_dw ? d_dw : nullptr;
        pg.row_loss = d_rl;
        if (round == 0) {
            pc.row_stats_out = crs.data();
            pg.row_stats_out = d_rs;
        } else {
            pc.row_stats_in = stats_cpu.data();
            pg.row_stats_in = d_rs;
        }
        kiln_fused_ce_result rc, rg;
        memset(&rg, 0xab, sizeof rg);
        kiln_status sc = kiln_fused_ce(g_cpu, &pc, &rc);
        std::string mc = kiln_last_error();
        kiln_status sg = kiln_fused_ce(g_gpu, &pg, &rg);
        std::string mg = kiln_last_error();
        if (sc != KILN_OK || sg != KILN_OK) {
            FAIL("%s round %d: status cpu %d '%s' gpu %d '%s'", tag, round, (int)sc, mc.c_str(),
                 (int)sg, mg.c_str());
            break;
        }
        char what[300];
        snprintf(what, sizeof what, "%s round %d: loss", tag, round);
        same_f(rg.loss, rc.loss, what);
        if (memcmp(&rg.loss_f64, &rc.loss_f64, 8) != 0)
            FAIL("%s round %d: loss_f64 %.17g vs %.17g", tag, round, rg.loss_f64, rc.loss_f64);
        if (rg.n_supervised != rc.n_supervised || rg.scratch_bytes != rc.scratch_bytes)
            FAIL("%s round %d: S %lld/%lld scratch %zu/%zu", tag, round,
                 (long long)rg.n_supervised, (long long)rc.n_supervised, rg.scratch_bytes,
                 rc.scratch_bytes);
        if (rc.scratch_bytes != kiln_fused_ce_scratch_bytes(rc.n_supervised, H, V, c.chunk,
                                                            c.with_dh, c.with_dw))
            FAIL("%s: scratch %zu is not kiln_fused_ce_scratch_bytes", tag, rc.scratch_bytes);
        down(grl.data(), d_rl, (size_t)N * 4);
        snprintf(what, sizeof what, "%s round %d: row_loss", tag, round);
        same_bytes(grl.data(), crl.data(), (size_t)N * 4, 4, what);
        if (c.with_dh) {
            down(gdh.data(), d_dh, gdh.size() * 4);
            snprintf(what, sizeof what, "%s round %d: dhidden", tag, round);
            same_bytes(gdh.data(), cdh.data(), gdh.size() * 4, 4, what);
        }
        if (c.with_dw) {
            down(gdw.data(), d_dw, gdw.size() * 4);
            snprintf(what, sizeof what, "%s round %d: dweight", tag, round);
            same_bytes(gdw.data(), cdw.data(), gdw.size() * 4, 4, what);
        }
        if (round == 0) {
            down(grs.data(), d_rs, grs.size() * 4);
            snprintf(what, sizeof what, "%s: row_stats_out", tag);
            same_bytes(grs.data(), crs.data(), grs.size() * 4, 4, what);
            stats_cpu = crs;
        }
        if (round == 1 && V > 100000)
            printf("  big case: S %lld, scratch %zu bytes on the device "
                   "(kiln_fused_ce_scratch_bytes %zu; the logits would be %zu bytes)\n",
                   (long long)rc.n_supervised, rg.scratch_bytes,
                   kiln_fused_ce_scratch_bytes(rc.n_supervised, H, V, c.chunk, c.with_dh,
                                               c.with_dw),
                   (size_t)rc.n_supervised * (size_t)V * 4);
    }
    kiln_backend_free_buf(g_gpu, d_hidden);
    kiln_backend_free_buf(g_gpu, d_w);
    kiln_backend_free_buf(g_gpu, d_dh);
    kiln_backend_free_buf(g_gpu, d_dw);
    kiln_backend_free_buf(g_gpu, d_rl);
    kiln_backend_free_buf(g_gpu, d_rs);
    printf("%s: %s\n", tag, g_fail == fails0 ? "OK" : "FAILED");
}

static void test_ce_errors() {
    const int fails0 = g_fail;
    const int64_t N = 4, H = 16, V = 50;
    std::vector<float> hidden(N * H, 0.5f), w(V * H, 0.25f);
    float *d_hidden = (float *)dalloc(hidden.size() * 4), *d_w = (float *)dalloc(w.size() * 4);
    up(d_hidden, hidden.data(), hidden.size() * 4);
    up(d_w, w.data(), w.size() * 4);
    int32_t tg[4] = {1, 2, 50, 3}; /* 50 >= V */
    kiln_fused_ce_params p = kiln_fused_ce_default_params();
    p.N = N;
    p.H = H;
    p.V = V;
    p.targets = tg;
    kiln_fused_ce_params pc = p, pg = p;
    pc.hidden = hidden.data();
    pc.weight = w.data();
    pg.hidden = d_hidden;
    pg.weight = d_w;
    kiln_status sc = kiln_fused_ce(g_cpu, &pc, nullptr);
    std::string mc = kiln_last_error();
    kiln_status sg = kiln_fused_ce(g_gpu, &pg, nullptr);
    std::string mg = kiln_last_error();
    if (sc != KILN_ERR_RANGE || sg != sc || mc != mg)
        FAIL("target >= V: cpu %d '%s' gpu %d '%s'", (int)sc, mc.c_str(), (int)sg, mg.c_str());
    int32_t none[4] = {-100, -100, -100, -100};
    pc.targets = pg.targets = none;
    sc = kiln_fused_ce(g_cpu, &pc, nullptr);
    mc = kiln_last_error();
    sg = kiln_fused_ce(g_gpu, &pg, nullptr);
    mg = kiln_last_error();
    if (sc != KILN_ERR_INVALID_ARG || sg != sc || mc != mg)
        FAIL("no supervised: cpu %d '%s' gpu %d '%s'", (int)sc, mc.c_str(), (int)sg, mg.c_str());
    int32_t ok[4] = {1, 2, 3, 4};
    pg.targets = ok;
    pg.hidden = hidden.data(); /* host memory on the GPU path: refused */
    sg = kiln_fused_ce(g_gpu, &pg, nullptr);
    if (sg != KILN_ERR_INVALID_ARG || !strstr(kiln_last_error(), "device memory"))
        FAIL("host hidden on the GPU: %d '%s'", (int)sg, kiln_last_error());
    OK_OR_FAIL(kiln_backend_status(g_gpu));
    kiln_backend_free_buf(g_gpu, d_hidden);
    kiln_backend_free_buf(g_gpu, d_w);
    printf("fused_ce errors (target >= V, no supervised row, host buffer): %s\n",
           g_fail == fails0 ? "OK" : "FAILED");
}

/* ---- fused distillation loss --------------------------------------------------------------- */

struct KdCase {
    int64_t V, H, N, chunk, tld_pad;
    kiln_dtype dt;
    kiln_ce_reduction red;
    float tau, kd_weight, ce_weight;
    int accumulate, with_dh, with_dw, masked;
};

/* Relative L2 distance of a from b. */
static double rel_l2(const std::vector<float> &a, const std::vector<float> &b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); i++) {
        const double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * (double)b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* kiln_fused_kd on cpu and gpu with the same inputs: every output memcmp-equal (exact: the
 * auditable mode or an exact format's, the CPU's bits), or (exact 0: the GPU in fast mode)
 * within bf16 products' error of the CPU's auditable result. */
static void test_kd_case(const KdCase &c, kiln_backend *cpu, kiln_backend *gpu, bool exact,
                         const char *mode) {
    const int fails0 = g_fail;
    const int64_t N = c.N, H = c.H, V = c.V, tld = V + c.tld_pad;
    const int bf16 = c.dt == KILN_DTYPE_BF16;
    LossInputs in = loss_inputs(N, H, V, c.dt, c.masked, c.accumulate);
    const size_t wb = in.wb;
    const std::vector<float> &hidden = in.hidden, &dh0 = in.dh0, &dw0 = in.dw0;
    const std::vector<uint8_t> &w = in.w, &mask = in.mask;
    std::vector<int32_t> &tg = in.tg;
    std::vector<float> teacher((size_t)N * tld);
    for (auto &x : teacher) x = rndu() * 6.0f;

    float *d_hidden = (float *)dalloc(hidden.size() * 4), *d_t = (float *)dalloc(teacher.size() * 4);
    void *d_w = dalloc(wb);
    float *d_dh = (float *)dalloc(dh0.size() * 4), *d_dw = (float *)dalloc(dw0.size() * 4);
    float *d_kl = (float *)dalloc((size_t)N * 4), *d_ce = (float *)dalloc((size_t)N * 4);
    up(d_hidden, hidden.data(), hidden.size() * 4);
    up(d_t, teacher.data(), teacher.size() * 4);
    up(d_w, w.data(), wb);
    up(d_dh, dh0.data(), dh0.size() * 4);
    up(d_dw, dw0.data(), dw0.size() * 4);
    std::vector<float> nan_n(N, NAN);
    up(d_kl, nan_n.data(), (size_t)N * 4);
    up(d_ce, nan_n.data(), (size_t)N * 4);

    char tag[240];
    snprintf(tag, sizeof tag, "fused_kd %s %s V=%lld H=%lld N=%lld chunk=%lld tau=%g kd=%g ce=%g %s%s%s%s",
             mode, bf16 ? "bf16" : "f32", (long long)V, (long long)H, (long long)N,
             (long long)c.chunk, (double)c.tau, (double)c.kd_weight, (double)c.ce_weight,
             c.red == KILN_CE_REDUCTION_MEAN ? "MEAN" : "SUM", c.masked ? " mask" : "",
             c.with_dh ? (c.accumulate ? " dh+=" : " dh=") : "", c.with_dw ? " dW" : "");
    std::vector<float> cdh = dh0, cdw = dw0, ckl(N, NAN), cce(N, NAN);
    std::vector<float> gdh(dh0.size()), gdw(dw0.size()), gkl(N), gce(N);
    kiln_fused_kd_params p = kiln_fused_kd_default_params();
    p.N = N;
    p.H = H;
    p.V = V;
    p.weight_dtype = c.dt;
    p.teacher_ld = tld;
    p.targets = tg.data();
    p.mask = c.masked ? mask.data() : nullptr;
    p.tau = c.tau;
    p.kd_weight = c.kd_weight;
    p.ce_weight = c.ce_weight;
    p.reduction = c.red;
    p.scale = 0.75f;
    p.chunk = c.chunk;
    p.dhidden_accumulate = c.accumulate;
    kiln_fused_kd_params pc = p, pg = p;
    pc.hidden = hidden.data();
    pc.weight = w.data();
    pc.teacher_logits = teacher.data();
    pc.dhidden = c.with_dh ? cdh.data() : nullptr;
    pc.dweight = c.with_dw ? cdw.data() : nullptr;
    pc.row_kl = ckl.data();
    pc.row_ce = cce.data();
    pg.hidden = d_hidden;
    pg.weight = d_w;
    pg.teacher_logits = d_t;
    pg.dhidden = c.with_dh ? d_dh : nullptr;
    pg.dweight = c.with_dw ? d_dw : nullptr;
    pg.row_kl = d_kl;
    pg.row_ce = d_ce;
    kiln_fused_kd_result rc, rg;
    memset(&rg, 0xab, sizeof rg);
    kiln_status sc = kiln_fused_kd(cpu, &pc, &rc);
    std::string mc = kiln_last_error();
    kiln_status sg = kiln_fused_kd(gpu, &pg, &rg);
    std::string mg = kiln_last_error();
    if (sc != KILN_OK || sg != KILN_OK) {
        FAIL("%s: status cpu %d '%s' gpu %d '%s'", tag, (int)sc, mc.c_str(), (int)sg, mg.c_str());
    } else {
        down(gkl.data(), d_kl, (size_t)N * 4);
        down(gce.data(), d_ce, (size_t)N * 4);
        if (c.with_dh) down(gdh.data(), d_dh, gdh.size() * 4);
        if (c.with_dw) down(gdw.data(), d_dw, gdw.size() * 4);
        if (rg.n_supervised != rc.n_supervised || rg.scratch_bytes != rc.scratch_bytes ||
            rc.scratch_bytes != kiln_fused_kd_scratch_bytes(rc.n_supervised, H, V, c.chunk,
                                                            c.with_dh, c.with_dw))
            FAIL("%s: S %lld/%lld scratch %zu/%zu", tag, (long long)rg.n_supervised,
                 (long long)rc.n_supervised, rg.scratch_bytes, rc.scratch_bytes);
        char what[300];
        if (exact) {
            snprintf(what, sizeof what, "%s: loss", tag);
            same_f(rg.loss, rc.loss, what);
            snprintf(what, sizeof what, "%s: kl", tag);
            same_f(rg.kl, rc.kl, what);
            snprintf(what, sizeof what, "%s: ce", tag);
            same_f(rg.ce, rc.ce, what);
            if (memcmp(&rg.loss_f64, &rc.loss_f64, 8) != 0)
                FAIL("%s: loss_f64 %.17g vs %.17g", tag, rg.loss_f64, rc.loss_f64);
            snprintf(what, sizeof what, "%s: row_kl", tag);
            same_bytes(gkl.data(), ckl.data(), (size_t)N * 4, 4, what);
            snprintf(what, sizeof what, "%s: row_ce", tag);
            same_bytes(gce.data(), cce.data(), (size_t)N * 4, 4, what);
            snprintf(what, sizeof what, "%s: dhidden", tag);
            if (c.with_dh) same_bytes(gdh.data(), cdh.data(), gdh.size() * 4, 4, what);
            snprintf(what, sizeof what, "%s: dweight", tag);
            if (c.with_dw) same_bytes(gdw.data(), cdw.data(), gdw.size() * 4, 4, what);
        } else {
            /* fast mode: bf16 products (8 significant bits in, f32 sums) */
            const double el = fabs((double)rg.loss - (double)rc.loss) / fabs((double)rc.loss);
            const double ekl = rel_l2(gkl, ckl), edh = c.with_dh ? rel_l2(gdh, cdh) : 0;
            std::vector<float> ddw(dw0.size()), ddc(dw0.size());
            for (size_t i = 0; i < dw0.size(); i++) ddw[i] = gdw[i] - dw0[i], ddc[i] = cdw[i] - dw0[i];
            const double edw = c.with_dw ? rel_l2(ddw, ddc) : 0;
            printf("  %s: relative error loss %.2e row_kl %.2e dh %.2e dW %.2e\n", tag, el, ekl, edh, edw);
            if (!(el < 2e-2 && ekl < 5e-2 && edh < 5e-2 && edw < 5e-2))
                FAIL("%s: fast mode too far from auditable", tag);
        }
    }
    for (void *q : {(void *)d_hidden, (void *)d_t, d_w, (void *)d_dh, (void *)d_dw, (void *)d_kl,
                    (void *)d_ce})
        kiln_backend_free_buf(g_gpu, q);
    printf("%s: %s\n", tag, g_fail == fails0 ? "OK" : "FAILED");
}

static void test_kd_errors() {
    const int fails0 = g_fail;
    const int64_t N = 4, H = 16, V = 50;
    std::vector<float> hidden(N * H, 0.5f), w(V * H, 0.25f), teacher(N * V, 1.0f);
    teacher[2 * V + 17] = INFINITY; /* row 2, column 17 */
    float *d_hidden = (float *)dalloc(hidden.size() * 4), *d_w = (float *)dalloc(w.size() * 4);
    float *d_t = (float *)dalloc(teacher.size() * 4);
    up(d_hidden, hidden.data(), hidden.size() * 4);
    up(d_w, w.data(), w.size() * 4);
    up(d_t, teacher.data(), teacher.size() * 4);
    int32_t tg[4] = {1, 2, 3, 4};
    kiln_fused_kd_params p = kiln_fused_kd_default_params();
    p.N = N;
    p.H = H;
    p.V = V;
    p.targets = tg;
    kiln_fused_kd_params pc = p, pg = p;
    pc.hidden = hidden.data();
    pc.weight = w.data();
    pc.teacher_logits = teacher.data();
    pg.hidden = d_hidden;
    pg.weight = d_w;
    pg.teacher_logits = d_t;
    kiln_status sc = kiln_fused_kd(g_cpu, &pc, nullptr);
    std::string mc = kiln_last_error();
    kiln_status sg = kiln_fused_kd(g_gpu, &pg, nullptr);
    std::string mg = kiln_last_error();
    if (sc != KILN_ERR_RANGE || sg != sc || mc != mg)
        FAIL("non-finite teacher logit: cpu %d '%s' gpu %d '%s'", (int)sc, mc.c_str(), (int)sg,
             mg.c_str());
    pg.teacher_logits = teacher.data(); /* host memory on the GPU path: refused */
    sg = kiln_fused_kd(g_gpu, &pg, nullptr);
    if (sg != KILN_ERR_INVALID_ARG || !strstr(kiln_last_error(), "device memory"))
        FAIL("host teacher logits on the GPU: %d '%s'", (int)sg, kiln_last_error());
    OK_OR_FAIL(kiln_backend_status(g_gpu));
    for (void *q : {(void *)d_hidden, (void *)d_w, (void *)d_t}) kiln_backend_free_buf(g_gpu, q);
    printf("fused_kd errors (non-finite teacher logit, host buffer): %s\n",
           g_fail == fails0 ? "OK" : "FAILED");
}

static void test_kd_all(bool big) {
    int k = 0;
    for (int64_t N : {1, 7, 64})
        for (int64_t chunk : {0, 300})
            for (int w3 = 0; w3 < 3; w3++) { /* KL + CE, KL alone, CE alone */
                KdCase c = {1000, 64, N, chunk, (int64_t)(k % 2) * 5,
                            k % 3 == 1 ? KILN_DTYPE_BF16 : KILN_DTYPE_F32,
                            (kiln_ce_reduction)(k % 2), k % 4 == 2 ? 0.5f : 2.0f,
                            w3 == 2 ? 0.0f : 0.7f, w3 == 1 ? 0.0f : 0.3f, k % 2, 1, 1, k % 3 != 0};
                if (k % 7 == 5) c.with_dw = 0;
                if (k % 7 == 6) c.with_dh = 0;
                test_kd_case(c, g_cpu, g_gpu, true, "auditable");
                k++;
            }
    { /* the loss alone */
        KdCase c = {1000, 64, 64, 300, 0, KILN_DTYPE_F32, KILN_CE_REDUCTION_SUM, 1.0f, 1.0f, 0.0f, 0, 0, 0, 1};
        test_kd_case(c, g_cpu, g_gpu, true, "auditable");
    }
    { /* Qwen2.5's padded head: the teacher's rows longer than V */
        KdCase c = {1000, 896, 9, 0, 271, KILN_DTYPE_BF16, KILN_CE_REDUCTION_MEAN, 2.0f, 0.5f, 0.5f, 1, 1, 1, 1};
        test_kd_case(c, g_cpu, g_gpu, true, "auditable");
    }
    if (big) {
        KdCase c = {151936, 896, 16, 0, 0, KILN_DTYPE_BF16, KILN_CE_REDUCTION_MEAN, 2.0f, 0.5f, 0.5f, 0, 1, 1, 1};
        test_kd_case(c, g_cpu, g_gpu, true, "auditable");
    }
    /* an exact format: the head's products in mx16 on both */
    for (int mode = KILN_MODE_MX16; mode <= KILN_MODE_MX8; mode++) {
        kiln_backend *cpu = nullptr, *gpu = nullptr;
        if (kiln_backend_acquire(-1, mode, 2, &cpu) != KILN_OK || kiln_backend_acquire(0, mode, 0, &gpu) != KILN_OK) {
            FAIL("backends in mode %d: %s", mode, kiln_last_error());
            break;
        }
        KdCase c = {1000, 64, 40, 300, 3, KILN_DTYPE_BF16, KILN_CE_REDUCTION_MEAN, 2.0f, 0.7f, 0.3f, 0, 1, 1, 1};
        test_kd_case(c, cpu, gpu, true, mode == KILN_MODE_MX16 ? "mx16" : "mx8");
        c.N = 5;
        c.dt = KILN_DTYPE_F32;
        test_kd_case(c, cpu, gpu, true, mode == KILN_MODE_MX16 ? "mx16" : "mx8");
        kiln_backend_release(cpu);
        kiln_backend_release(gpu);
    }
    /* fast mode: bf16 products, against the CPU */
    {
        kiln_backend *fast = nullptr;
        if (kiln_backend_cuda_create_mode(0, KILN_MODE_FAST, &fast) != KILN_OK) {
            FAIL("fast backend: %s", kiln_last_error());
        } else {
            KdCase c = {1000, 256, 64, 300, 3, KILN_DTYPE_BF16, KILN_CE_REDUCTION_MEAN, 2.0f, 0.7f, 0.3f, 0, 1, 1, 1};
            test_kd_case(c, g_cpu, fast, false, "fast");
            c.N = 5;
            test_kd_case(c, g_cpu, fast, false, "fast");
            c.N = 64; /* a temperature whose reciprocal rounds (fast mode multiplies by 1 / tau) */
            c.tau = 1.7f;
            test_kd_case(c, g_cpu, fast, false, "fast, tau 1.7");
            kiln_backend_free(fast);
        }
    }
    test_kd_errors();
}

int main(int argc, char **argv) {
    bool big = true;
    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--no-big")) big = false;
        else if (!strcmp(argv[a], "--seed") && a + 1 < argc) g_rng = strtoull(argv[++a], 0, 10);
    }
    /* without a GPU: the CPU entry of create_on, then skip */
    {
        float wv[3] = {1, 2, 3}, gv[3] = {0.1f, 0.2f, 0.3f};
        kiln_adamw_param q = {"w", 3, wv, gv, nullptr};
        kiln_adamw_config cfg = kiln_adamw_default_config();
        kiln_adamw *o = nullptr;
        OK_OR_FAIL(kiln_adamw_create_on(nullptr, &q, 1, &cfg, &o));
        if (o) OK_OR_FAIL(kiln_adamw_step(o, nullptr));
        kiln_adamw_free(o);
        uint16_t w16[3]; /* the step's bf16 copy is a device optimizer's option */
        q.w16 = w16;
        o = nullptr;
        if (kiln_adamw_create_on(nullptr, &q, 1, &cfg, &o) != KILN_ERR_UNSUPPORTED ||
            !strstr(kiln_last_error(), "w16"))
            FAIL("a CPU optimizer with w16: %s", kiln_last_error());
        kiln_adamw_free(o);
    }
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("no GPU: skipped (%s)\n", g_fail ? "FAILED" : "CPU checks OK");
        return g_fail ? 1 : 77;
    }
    if (kiln_backend_cuda_create(0, &g_gpu) != KILN_OK) {
        printf("no usable GPU (%s): skipped\n", kiln_last_error());
        return 77;
    }
    if (kiln_backend_cpu_create(0, &g_cpu) != KILN_OK) {
        printf("cpu backend: %s\n", kiln_last_error());
        return 1;
    }

    for (int wk = 0; wk < 4; wk++)
        for (int mk = 0; mk < 2; mk++)
            test_adamw_case((kiln_adamw_weights)wk, (kiln_adamw_moments)mk);
    for (int wk = 0; wk < 4; wk++)
        for (int mk = 0; mk < 2; mk++)
            test_adamw_multi_case((kiln_adamw_weights)wk, (kiln_adamw_moments)mk, 0.1);
    test_adamw_multi_case(KILN_ADAMW_F32, KILN_ADAMW_MOMENTS_F32, 0.0);
    if (big) test_adamw_timing();

    int k = 0;
    for (int64_t N : {1, 7, 64})
        for (int64_t chunk : {0, 300})
            for (int red = 0; red < 2; red++)
                for (int bf = 0; bf < 2; bf++) {
                    CeCase c = {1000, 64, N, chunk, bf ? KILN_DTYPE_BF16 : KILN_DTYPE_F32,
                                (kiln_ce_reduction)red, k % 2, 1, 1, (k % 3) != 0};
                    if (k % 7 == 5) c.with_dw = 0;
                    if (k % 7 == 6) c.with_dh = 0;
                    test_ce_case(c);
                    k++;
                }
    for (int bf = 0; bf < 2; bf++) {
        CeCase c = {1000, 896, 7, 300, bf ? KILN_DTYPE_BF16 : KILN_DTYPE_F32,
                    KILN_CE_REDUCTION_MEAN, bf, 1, 1, 1};
        test_ce_case(c);
    }
    { /* loss only */
        CeCase c = {1000, 64, 64, 300, KILN_DTYPE_F32, KILN_CE_REDUCTION_SUM, 0, 0, 0, 1};
        test_ce_case(c);
    }
    if (big) {
        CeCase c = {151936, 896, 16, 0, KILN_DTYPE_BF16, KILN_CE_REDUCTION_MEAN, 0, 1, 1, 1};
        test_ce_case(c);
    }
    test_ce_errors();
    test_kd_all(big);
    OK_OR_FAIL(kiln_backend_status(g_gpu));
    kiln_backend_free(g_cpu);
    kiln_backend_free(g_gpu);
    if (g_fail) {
        printf("FAILED %d\n", g_fail);
        return 1;
    }
    printf("ALL OK\n");
    return 0;
}
