/*
 * test_cuda_attention_bwd_fast.cu -- the fast-mode attention backward (src/ops/cuda/
 * cuda_attention.h) against a host reference in double precision written here from
 * ops.h's definition (causal grouped-query softmax attention, its gradients by hand:
 * P = softmax(scale q.k), dP = dout.v, D = sum P dP, dS = P (dP - D), dq = scale dS k,
 * dk = scale dS^T q, dv = P^T dout).
 *
 * Bound: for each of dq, dk, dv, max |gpu - ref| / max |ref| <= 2e-2. q, k, v, dout are rounded
 * to bf16 (2^-9 relative each) and so are P and dS before their products, so a few 1e-3 is
 * expected; the largest seen is printed. Every run starts from outputs and workspace poisoned
 * with NaN bits and every case runs twice and must give the same bits. Then the timing of the
 * fast backward against the auditable kernels (cuda_attention.h) on training shapes.
 * The batched entry points (B sequences in one launch, ops.h's attention_seqs and
 * attention_backward_seqs): the forward's out has the bits of per-sequence calls and its lse
 * is within 2e-2 of the exact log-sum-exp; the backward with that lse is within the same
 * 2e-2 of the reference and repeats its bits; without lse each sequence has the bits of a
 * per-sequence call. The bf16 output (out16): the forward's bits are kiln_fp32_to_bf16 of the
 * f32 forward's (lse too is the same), or cudaErrorNotSupported off the flash path; the
 * backward given out16 has the bits of the backward given an f32 out holding the widened
 * out16, with and without lse; both or neither of out, out16: cudaErrorInvalidValue.
 * keep and rope (f32 and bf16 outputs, HS 64 and 128, GQA and MHA): the forward with keep has
 * the bits of the forward without, and the backward from keep (q, k, v NULL) those of the
 * backward from q, k, v (with the saved lse and without); the forward with keep and RoPE
 * fused into its packing, on un-rotated q, k, has the bits of kiln_cuda_rope then the forward
 * (output, lse and the packed tiles), and its backward from keep those of the backward from
 * the rotated f32 q, k; rope without keep, keep misaligned or off the flash path are refused
 * with nothing enqueued. The backward's fused RoPE / bf16 epilogue (the trainer's call) has the
 * bits of the separate calls, GQA reductions of 2 elements a thread (G 9) and 4 included.
 * Then the batched forward + backward timed against per-sequence calls, with keep, and with
 * RoPE as a separate pass against RoPE fused with keep; at the trainer's shapes the forward
 * and the backward alone, and the epilogue fused against separate.
 * All of it runs, on an sm_90a device, both on the wgmma kernels (the default there) and on
 * mma.sync (KILN_WGMMA=0, the kernels of every other device). The HS 64 packing kernel with
 * 16-byte loads has the bits of the one-warp kernel (the one for unaligned pointers).
 * Without a GPU: checks the host-side validation, then exits 77.
 * Usage: test_cuda_attention_bwd_fast [--no-time | --time-only | --time-seqs B N NH KVH]
 * (--time-seqs: only the batched timing of one HS 64 shape in the default kernel form, for a
 * profiler such as ncu)
 */
#include "ops/cuda/cuda_attention.h"
#include "ops/cuda/cuda_matmul.h" /* kiln_cuda_f32_to_bf16, kiln_cuda_wgmma_usable */
#include "ops/cuda/cuda_rope.h"   /* kiln_cuda_rope, kiln_cuda_rope_backward_bf16 */

extern "C" {
#include "base/tensor.h" /* kiln_fp32_to_bf16, kiln_bf16_to_fp32: the host's RNE and widening */
}

#include <algorithm>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "gpu_test_cuda_check.h"

static int g_fail = 0;
static double g_worst = 0.0;

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static float urand(void) { /* uniform in [-1, 1) */
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (float)((double)(g_rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

struct Case {
    int N, n_past, NH, KVH, HS;
    float amp; /* q, k amplitude: larger = peakier softmax */
};

/* The forward out and the gradients in double, straight from the definition. */
static void reference(const std::vector<float> &q, const std::vector<float> &k,
                      const std::vector<float> &v, const std::vector<float> &dout, const Case &c,
                      float scale, std::vector<float> &out, std::vector<double> &dq,
                      std::vector<double> &dk, std::vector<double> &dv) {
    const int N = c.N, NH = c.NH, KVH = c.KVH, HS = c.HS, G = NH / KVH, T = c.n_past + N;
    out.assign((size_t)N * NH * HS, 0.0f);
    dq.assign((size_t)N * NH * HS, 0.0);
    dk.assign((size_t)T * KVH * HS, 0.0);
    dv.assign((size_t)T * KVH * HS, 0.0);
    std::vector<double> p(T), dp(T);
    for (int n = 0; n < N; n++)
        for (int h = 0; h < NH; h++) {
            const int kvh = h / G, nk = c.n_past + n + 1;
            const float *qr = &q[((size_t)n * NH + h) * HS];
            const float *gr = &dout[((size_t)n * NH + h) * HS];
            double mx = -1e300;
            for (int j = 0; j < nk; j++) {
                const float *kr = &k[((size_t)j * KVH + kvh) * HS];
                double s = 0;
                for (int d = 0; d < HS; d++) s += (double)qr[d] * kr[d];
                p[j] = s * scale;
                if (p[j] > mx) mx = p[j];
            }
            double sum = 0;
            for (int j = 0; j < nk; j++) sum += (p[j] = exp(p[j] - mx));
            double D = 0;
            for (int j = 0; j < nk; j++) {
                p[j] /= sum;
                const float *vr = &v[((size_t)j * KVH + kvh) * HS];
                double s = 0;
                for (int d = 0; d < HS; d++) s += (double)gr[d] * vr[d];
                dp[j] = s;
                D += p[j] * s;
            }
            for (int d = 0; d < HS; d++) {
                double o = 0;
                for (int j = 0; j < nk; j++) o += p[j] * v[((size_t)j * KVH + kvh) * HS + d];
                out[((size_t)n * NH + h) * HS + d] = (float)o;
            }
            for (int j = 0; j < nk; j++) {
                const double ds = p[j] * (dp[j] - D);
                const float *kr = &k[((size_t)j * KVH + kvh) * HS];
                double *dkr = &dk[((size_t)j * KVH + kvh) * HS], *dvr = &dv[((size_t)j * KVH + kvh) * HS];
                double *dqr = &dq[((size_t)n * NH + h) * HS];
                for (int d = 0; d < HS; d++) {
                    dqr[d] += scale * ds * kr[d];
                    dkr[d] += scale * ds * qr[d];
                    dvr[d] += p[j] * gr[d];
                }
            }
        }
}

static double norm_err(const std::vector<float> &got, const std::vector<double> &ref,
                       size_t *first_bad) {
    double mx = 0, err = 0;
    *first_bad = (size_t)-1;
    for (size_t i = 0; i < ref.size(); i++) mx = fmax(mx, fabs(ref[i]));
    for (size_t i = 0; i < ref.size(); i++) {
        const double e = fabs((double)got[i] - ref[i]);
        if (!(e <= err)) { /* NaN counts */
            err = isnan(e) ? INFINITY : e;
            if (isnan(e) && *first_bad == (size_t)-1) *first_bad = i;
        }
    }
    return mx > 0 ? err / mx : err;
}

struct Dev {
    float *q, *k, *v, *out, *dout, *dq, *dk, *dv, *ws;
    size_t nq, nkv, nws;
};

static Dev dev_alloc(const Case &c) {
    Dev d;
    const int T = c.n_past + c.N;
    d.nq = (size_t)c.N * c.NH * c.HS;
    d.nkv = (size_t)T * c.KVH * c.HS;
    d.nws = kiln_cuda_attention_backward_fast_ws(c.N, c.n_past, c.NH, c.KVH, c.HS);
    size_t aud = (size_t)3 * c.N * c.NH;
    if (aud > d.nws) d.nws = aud;
    CUDA_OK(cudaMalloc(&d.q, d.nq * 4));
    CUDA_OK(cudaMalloc(&d.out, d.nq * 4));
    CUDA_OK(cudaMalloc(&d.dout, d.nq * 4));
    CUDA_OK(cudaMalloc(&d.dq, d.nq * 4));
    CUDA_OK(cudaMalloc(&d.k, d.nkv * 4));
    CUDA_OK(cudaMalloc(&d.v, d.nkv * 4));
    CUDA_OK(cudaMalloc(&d.dk, d.nkv * 4));
    CUDA_OK(cudaMalloc(&d.dv, d.nkv * 4));
    CUDA_OK(cudaMalloc(&d.ws, d.nws * 4));
    return d;
}

static void dev_free(Dev &d) {
    float *ps[] = {d.q, d.k, d.v, d.out, d.dout, d.dq, d.dk, d.dv, d.ws};
    for (float *p : ps) CUDA_OK(cudaFree(p));
}

static void poison(const Dev &d) {
    CUDA_OK(cudaMemset(d.dq, 0xff, d.nq * 4));
    CUDA_OK(cudaMemset(d.dk, 0xff, d.nkv * 4));
    CUDA_OK(cudaMemset(d.dv, 0xff, d.nkv * 4));
    CUDA_OK(cudaMemset(d.ws, 0xff, d.nws * 4));
}

static void run_fast(const Dev &d, const Case &c, float scale) {
    CUDA_OK(kiln_cuda_attention_backward_fast(0, d.dq, d.dk, d.dv, d.dout, d.q, d.k, d.v, d.out,
                                              d.ws, d.nws, c.N, c.n_past, c.NH, c.KVH, c.HS,
                                              scale));
    CUDA_OK(cudaDeviceSynchronize());
}

static void check_case(const Case &c) {
    const float scale = 1.0f / sqrtf((float)c.HS);
    const int T = c.n_past + c.N;
    std::vector<float> q((size_t)c.N * c.NH * c.HS), dout(q.size());
    std::vector<float> k((size_t)T * c.KVH * c.HS), v(k.size());
    for (auto &x : q) x = c.amp * urand();
    for (auto &x : k) x = c.amp * urand();
    for (auto &x : v) x = urand();
    for (auto &x : dout) x = urand();
    std::vector<float> out;
    std::vector<double> rq, rk, rv;
    reference(q, k, v, dout, c, scale, out, rq, rk, rv);
    Dev d = dev_alloc(c);
    CUDA_OK(cudaMemcpy(d.q, q.data(), d.nq * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d.dout, dout.data(), d.nq * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d.out, out.data(), d.nq * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d.k, k.data(), d.nkv * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d.v, v.data(), d.nkv * 4, cudaMemcpyHostToDevice));
    std::vector<float> gq[2], gk[2], gv[2];
    for (int run = 0; run < 2; run++) {
        poison(d);
        run_fast(d, c, scale);
        gq[run].resize(d.nq);
        gk[run].resize(d.nkv);
        gv[run].resize(d.nkv);
        CUDA_OK(cudaMemcpy(gq[run].data(), d.dq, d.nq * 4, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(gk[run].data(), d.dk, d.nkv * 4, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(gv[run].data(), d.dv, d.nkv * 4, cudaMemcpyDeviceToHost));
    }
    size_t b1, b2, b3;
    const double e1 = norm_err(gq[0], rq, &b1), e2 = norm_err(gk[0], rk, &b2),
                 e3 = norm_err(gv[0], rv, &b3);
    const bool same = memcmp(gq[0].data(), gq[1].data(), d.nq * 4) == 0 &&
                      memcmp(gk[0].data(), gk[1].data(), d.nkv * 4) == 0 &&
                      memcmp(gv[0].data(), gv[1].data(), d.nkv * 4) == 0;
    const double e = fmax(e1, fmax(e2, e3));
    if (e > g_worst) g_worst = e;
    const bool ok = e <= 2e-2 && same;
    printf("attention_backward fast N=%d n_past=%d NH=%d KVH=%d HS=%d amp=%g: dq %.2e dk %.2e dv "
           "%.2e, two runs %s %s\n",
           c.N, c.n_past, c.NH, c.KVH, c.HS, c.amp, e1, e2, e3, same ? "same bits" : "DIFFER",
           ok ? "OK" : "FAILED");
    if (b1 != (size_t)-1 || b2 != (size_t)-1 || b3 != (size_t)-1)
        printf("  first NaN: dq %zd dk %zd dv %zd\n", (ssize_t)b1, (ssize_t)b2, (ssize_t)b3);
    EXPECT(ok, "N=%d NH=%d KVH=%d HS=%d", c.N, c.NH, c.KVH, c.HS);
    dev_free(d);
}

static void time_case(const Case &c) {
    const float scale = 1.0f / sqrtf((float)c.HS);
    Dev d = dev_alloc(c);
    const int T = c.n_past + c.N;
    std::vector<float> h(d.nq > d.nkv ? d.nq : d.nkv);
    for (auto &x : h) x = urand();
    float *ins[] = {d.q, d.dout, d.out};
    for (float *p : ins) CUDA_OK(cudaMemcpy(p, h.data(), d.nq * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d.k, h.data(), d.nkv * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d.v, h.data(), d.nkv * 4, cudaMemcpyHostToDevice));
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    float ms_fast = 0, ms_aud = 0;
    for (int which = 0; which < 2; which++) { /* fast, auditable */
        const int reps = which == 1 ? 2 : 10;
        for (int r = -1; r < reps; r++) {
            if (r == 0) CUDA_OK(cudaEventRecord(e0));
            if (which == 0)
                CUDA_OK(kiln_cuda_attention_backward_fast(0, d.dq, d.dk, d.dv, d.dout, d.q, d.k,
                                                          d.v, d.out, d.ws, d.nws, c.N, c.n_past,
                                                          c.NH, c.KVH, c.HS, scale));
            else
                CUDA_OK(kiln_cuda_attention_backward(0, d.dq, d.dk, d.dv, d.dout, d.q, d.k, d.v,
                                                     d.out, d.ws, c.N, c.n_past, c.NH, c.KVH,
                                                     c.HS, scale, 0));
        }
        CUDA_OK(cudaEventRecord(e1));
        CUDA_OK(cudaEventSynchronize(e1));
        float ms;
        CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
        (which == 0 ? ms_fast : ms_aud) = ms / reps;
    }
    /* causal backward: 5 products of N x T/2 x HS per head (S, dP, dq, dk, dv) + the stats
     * pass's S: count the 4 of FlashAttention-2's (2.5 x forward) for TFLOP/s */
    const double flops = 4.0 * 2.0 * c.N * (double)T / 2.0 * c.HS * c.NH;
    printf("time attention_backward N=%d NH=%d KVH=%d HS=%d: fast %.3f ms (%.0f TFLOP/s), "
           "auditable %.3f ms, %.0fx\n",
           c.N, c.NH, c.KVH, c.HS, ms_fast, flops / ms_fast / 1e9, ms_aud, ms_aud / ms_fast);
    CUDA_OK(cudaEventDestroy(e0));
    CUDA_OK(cudaEventDestroy(e1));
    dev_free(d);
}

static float *dev_upload(const std::vector<float> &h) {
    float *p = nullptr;
    CUDA_OK(cudaMalloc(&p, h.size() * 4 + 16));
    CUDA_OK(cudaMemcpy(p, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    return p;
}

static std::vector<float> dev_download(const float *p, size_t n) {
    std::vector<float> h(n);
    CUDA_OK(cudaMemcpy(h.data(), p, n * 4, cudaMemcpyDeviceToHost));
    return h;
}

static float *dev_nan(size_t n) {
    float *p = nullptr;
    CUDA_OK(cudaMalloc(&p, n * 4 + 16));
    CUDA_OK(cudaMemset(p, 0xff, n * 4 + 16));
    return p;
}

/* The backward's three gradients after a call, for bit comparisons. */
struct Grads {
    std::vector<float> g[3];
    bool operator==(const Grads &o) const {
        for (int i = 0; i < 3; i++)
            if (g[i].size() != o.g[i].size() ||
                memcmp(g[i].data(), o.g[i].data(), g[i].size() * 4) != 0)
                return false;
        return true;
    }
};

/* The forward's out as bf16 (out16) against the f32 forward's o_f32 and lse_f32 (already on
 * the host), and the backward with out16 against the backward with an f32 out holding the
 * widened out16 (with the saved lse, and without). Returns whether every check held. */
static bool check_seqs_bf16(int B, const Case &c, kiln_cuda_attn *attn, const float *d_q,
                            const float *d_k, const float *d_v, const float *d_dout,
                            const std::vector<float> &out_ref, const std::vector<float> &o_f32,
                            const std::vector<float> &lse_f32, const float *lse, float *ws,
                            size_t nws, float *gq, float *gk, float *gv) {
    const float scale = 1.0f / sqrtf((float)c.HS);
    const int N = c.N, NH = c.NH, KVH = c.KVH, HS = c.HS;
    const size_t nq = (size_t)B * N * NH * HS, nk = (size_t)B * N * KVH * HS;
    const size_t nl = (size_t)B * NH * kiln_cuda_attn_pack_rows(N);
    uint16_t *o16 = nullptr;
    CUDA_OK(cudaMalloc(&o16, nq * 2 + 16));
    CUDA_OK(cudaMemset(o16, 0xff, nq * 2 + 16));
    float *lse16 = dev_nan(nl);
    /* forward: RNE of the f32 forward's bits, on the flash path only */
    const bool flash = kiln_cuda_attn_saves_lse(o16, d_q, d_k, d_v, N, HS);
    const cudaError_t fe = kiln_cuda_attention_fast_seqs(
        attn, 0, nullptr, o16, lse16, nullptr, nullptr, d_q, d_k, d_v, B, N, NH, KVH, HS, scale);
    bool fwd = fe == (flash ? cudaSuccess : cudaErrorNotSupported);
    if (flash) /* out16 not 16-byte aligned: off the flash path */
        fwd = fwd && kiln_cuda_attention_fast_seqs(attn, 0, nullptr, o16 + 1, nullptr, nullptr,
                                                   nullptr, d_q, d_k, d_v, B, N, NH, KVH, HS,
                                                   scale) == cudaErrorNotSupported;
    if (flash && fe == cudaSuccess) {
        std::vector<uint16_t> h16(nq);
        CUDA_OK(cudaMemcpy(h16.data(), o16, nq * 2, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < nq && fwd; i++) fwd = h16[i] == kiln_fp32_to_bf16(o_f32[i]);
        const std::vector<float> hl = dev_download(lse16, nl);
        fwd = fwd && memcmp(hl.data(), lse_f32.data(), nl * 4) == 0;
    }
    /* both or neither of out, out16 */
    float *of = dev_nan(nq);
    const bool refused =
        kiln_cuda_attention_fast_seqs(attn, 0, of, o16, nullptr, nullptr, nullptr, d_q, d_k, d_v, B,
                                      N, NH, KVH, HS, scale) == cudaErrorInvalidValue &&
        kiln_cuda_attention_fast_seqs(attn, 0, nullptr, nullptr, nullptr, nullptr, nullptr, d_q,
                                      d_k, d_v, B, N, NH, KVH, HS,
                                      scale) == cudaErrorInvalidValue &&
        kiln_cuda_attention_backward_fast_seqs(0, gq, gk, gv, d_dout, d_q, d_k, d_v, of, o16, lse,
                                               nullptr, ws, nws, B, N, NH, KVH, HS,
                                               scale) == cudaErrorInvalidValue &&
        kiln_cuda_attention_backward_fast_seqs(0, gq, gk, gv, d_dout, d_q, d_k, d_v, nullptr,
                                               nullptr, lse, nullptr, ws, nws, B, N, NH, KVH, HS,
                                               scale) == cudaErrorInvalidValue;
    /* backward: out16 = the reference out in bf16, of = its widened values */
    std::vector<uint16_t> h16(nq);
    std::vector<float> hw(nq);
    for (size_t i = 0; i < nq; i++) {
        h16[i] = kiln_fp32_to_bf16(out_ref[i]);
        hw[i] = kiln_bf16_to_fp32(h16[i]);
    }
    CUDA_OK(cudaMemcpy(o16, h16.data(), nq * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(of, hw.data(), nq * 4, cudaMemcpyHostToDevice));
    bool bwd = true;
    for (int with_lse = 0; with_lse < 2; with_lse++) {
        Grads g[2]; /* [0] out16, [1] f32 of */
        for (int i = 0; i < 2; i++) {
            CUDA_OK(cudaMemset(gq, 0xff, nq * 4));
            CUDA_OK(cudaMemset(gk, 0xff, nk * 4));
            CUDA_OK(cudaMemset(gv, 0xff, nk * 4));
            CUDA_OK(cudaMemset(ws, 0xff, nws * 4));
            CUDA_OK(kiln_cuda_attention_backward_fast_seqs(
                0, gq, gk, gv, d_dout, d_q, d_k, d_v, i ? of : nullptr, i ? nullptr : o16,
                with_lse ? lse : nullptr, nullptr, ws, nws, B, N, NH, KVH, HS, scale));
            g[i].g[0] = dev_download(gq, nq);
            g[i].g[1] = dev_download(gk, nk);
            g[i].g[2] = dev_download(gv, nk);
        }
        bwd = bwd && g[0] == g[1];
    }
    const bool ok = fwd && refused && bwd;
    printf("attention seqs bf16 out B=%d N=%d NH=%d KVH=%d HS=%d: forward %s; both/neither of "
           "out, out16 %s; backward with out16 (lse, none) %s f32 out of its values %s\n",
           B, N, NH, KVH, HS,
           !flash ? (fwd ? "not supported off the flash path" : "NOT REFUSED")
                  : (fwd ? "= RNE of the f32 bits, same lse" : "!= RNE of the f32 bits"),
           refused ? "refused" : "NOT REFUSED", bwd ? "=" : "!=", ok ? "OK" : "FAILED");
    float *all[] = {lse16, of};
    for (float *p : all) CUDA_OK(cudaFree(p));
    CUDA_OK(cudaFree(o16));
    return ok;
}

/* B sequences of c.N tokens (c.n_past 0) through the batched entry points. */
static void check_seqs(int B, const Case &c, kiln_cuda_attn *attn) {
    const float scale = 1.0f / sqrtf((float)c.HS);
    const int N = c.N, NH = c.NH, KVH = c.KVH, HS = c.HS, Npad = kiln_cuda_attn_pack_rows(N);
    const size_t qs = (size_t)N * NH * HS, ks = (size_t)N * KVH * HS, nq = B * qs, nk = B * ks;
    std::vector<float> q(nq), dout(nq), k(nk), v(nk), out(nq);
    std::vector<double> rq(nq), rk(nk), rv(nk), rl((size_t)B * NH * N);
    for (auto &x : q) x = c.amp * urand();
    for (auto &x : k) x = c.amp * urand();
    for (auto &x : v) x = urand();
    for (auto &x : dout) x = urand();
    for (int b = 0; b < B; b++) { /* the reference per sequence, and its log-sum-exp */
        std::vector<float> sq(q.begin() + b * qs, q.begin() + (b + 1) * qs),
            sd(dout.begin() + b * qs, dout.begin() + (b + 1) * qs),
            sk(k.begin() + b * ks, k.begin() + (b + 1) * ks),
            sv(v.begin() + b * ks, v.begin() + (b + 1) * ks), so;
        std::vector<double> dq1, dk1, dv1;
        reference(sq, sk, sv, sd, c, scale, so, dq1, dk1, dv1);
        std::copy(so.begin(), so.end(), out.begin() + b * qs);
        std::copy(dq1.begin(), dq1.end(), rq.begin() + b * qs);
        std::copy(dk1.begin(), dk1.end(), rk.begin() + b * ks);
        std::copy(dv1.begin(), dv1.end(), rv.begin() + b * ks);
        for (int n = 0; n < N; n++)
            for (int h = 0; h < NH; h++) {
                double mx = -1e300, sum = 0;
                std::vector<double> sc(n + 1);
                for (int j = 0; j <= n; j++) {
                    double d = 0;
                    for (int i = 0; i < HS; i++)
                        d += (double)sq[((size_t)n * NH + h) * HS + i] *
                             sk[((size_t)j * KVH + h / (NH / KVH)) * HS + i];
                    sc[j] = d * scale;
                    mx = fmax(mx, sc[j]);
                }
                for (int j = 0; j <= n; j++) sum += exp(sc[j] - mx);
                rl[((size_t)b * NH + h) * N + n] = mx + log(sum);
            }
    }
    float *d_q = dev_upload(q), *d_k = dev_upload(k), *d_v = dev_upload(v), *d_dout = dev_upload(dout),
          *dout_ref = dev_upload(out);
    const size_t nl = (size_t)B * NH * Npad;
    const size_t nws = (size_t)B * kiln_cuda_attention_backward_fast_ws(N, 0, NH, KVH, HS);
    float *o_b = dev_nan(nq), *o_1 = dev_nan(nq), *lse = dev_nan(nl), *ws = dev_nan(nws);
    float *gq = dev_nan(nq), *gk = dev_nan(nk), *gv = dev_nan(nk);
    /* forward: batched (with lse) against per-sequence calls, bit for bit */
    CUDA_OK(kiln_cuda_attention_fast_seqs(attn, 0, o_b, nullptr, lse, nullptr, nullptr, d_q, d_k,
                                          d_v, B, N, NH, KVH, HS, scale));
    for (int b = 0; b < B; b++)
        CUDA_OK(kiln_cuda_attention_fast(attn, 0, o_1 + b * qs, d_q + b * qs, d_k + b * ks,
                                         d_v + b * ks, N, 0, NH, KVH, HS, scale));
    const std::vector<float> hb = dev_download(o_b, nq), h1 = dev_download(o_1, nq),
                             hl = dev_download(lse, nl);
    const bool fwd_same = memcmp(hb.data(), h1.data(), nq * 4) == 0;
    /* N <= 8 runs the split decode per sequence, which saves no lse (left NaN, ignored) */
    const bool saved = kiln_cuda_attn_saves_lse(o_b, d_q, d_k, d_v, N, HS);
    double lerr = 0;
    for (int b = 0; saved && b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int n = 0; n < N; n++) {
                const double e = fabs((double)hl[((size_t)b * NH + h) * Npad + n] -
                                      rl[((size_t)b * NH + h) * N + n]);
                if (!(e <= lerr)) lerr = isnan(e) ? INFINITY : e;
            }
    /* backward with the saved lse (out: the reference's), twice */
    std::vector<float> g[2][3];
    for (int run = 0; run < 2; run++) {
        CUDA_OK(cudaMemset(gq, 0xff, nq * 4));
        CUDA_OK(cudaMemset(gk, 0xff, nk * 4));
        CUDA_OK(cudaMemset(gv, 0xff, nk * 4));
        CUDA_OK(cudaMemset(ws, 0xff, nws * 4));
        CUDA_OK(kiln_cuda_attention_backward_fast_seqs(0, gq, gk, gv, d_dout, d_q, d_k, d_v,
                                                       dout_ref, nullptr, lse, nullptr, ws, nws, B,
                                                       N, NH, KVH, HS, scale));
        g[run][0] = dev_download(gq, nq);
        g[run][1] = dev_download(gk, nk);
        g[run][2] = dev_download(gv, nk);
    }
    size_t bad[3];
    const double e1 = norm_err(g[0][0], rq, &bad[0]), e2 = norm_err(g[0][1], rk, &bad[1]),
                 e3 = norm_err(g[0][2], rv, &bad[2]);
    bool same = true;
    for (int i = 0; i < 3; i++)
        same = same && memcmp(g[0][i].data(), g[1][i].data(), g[0][i].size() * 4) == 0;
    /* without lse: per sequence, the bits of kiln_cuda_attention_backward_fast */
    CUDA_OK(kiln_cuda_attention_backward_fast_seqs(0, gq, gk, gv, d_dout, d_q, d_k, d_v, dout_ref,
                                                   nullptr, nullptr, nullptr, ws, nws, B, N, NH,
                                                   KVH, HS, scale));
    const std::vector<float> nq_b = dev_download(gq, nq), nk_b = dev_download(gk, nk),
                             nv_b = dev_download(gv, nk);
    bool per_seq = true;
    for (int b = 0; b < B; b++) {
        CUDA_OK(kiln_cuda_attention_backward_fast(0, gq, gk, gv, d_dout + b * qs, d_q + b * qs,
                                                  d_k + b * ks, d_v + b * ks, dout_ref + b * qs,
                                                  ws, nws, N, 0, NH, KVH, HS, scale));
        const std::vector<float> a = dev_download(gq, qs), bk = dev_download(gk, ks),
                                 bv = dev_download(gv, ks);
        per_seq = per_seq && memcmp(a.data(), nq_b.data() + b * qs, qs * 4) == 0 &&
                  memcmp(bk.data(), nk_b.data() + b * ks, ks * 4) == 0 &&
                  memcmp(bv.data(), nv_b.data() + b * ks, ks * 4) == 0;
    }
    const double e = fmax(e1, fmax(e2, e3));
    if (e > g_worst) g_worst = e;
    const bool ok = fwd_same && lerr <= 2e-2 && e <= 2e-2 && same && per_seq;
    printf("attention seqs B=%d N=%d NH=%d KVH=%d HS=%d: forward %s per-sequence bits, lse err "
           "%.2e%s; backward with lse dq %.2e dk %.2e dv %.2e, two runs %s; without lse %s "
           "per-sequence bits %s\n",
           B, N, NH, KVH, HS, fwd_same ? "=" : "!=", lerr, saved ? "" : " (none saved)", e1, e2, e3,
           same ? "same bits" : "DIFFER", per_seq ? "=" : "!=", ok ? "OK" : "FAILED");
    EXPECT(ok, "seqs B=%d N=%d NH=%d KVH=%d HS=%d", B, N, NH, KVH, HS);
    const bool ok16 = check_seqs_bf16(B, c, attn, d_q, d_k, d_v, d_dout, out, hb, hl, lse, ws,
                                      nws, gq, gk, gv);
    EXPECT(ok16, "seqs bf16 out B=%d N=%d NH=%d KVH=%d HS=%d", B, N, NH, KVH, HS);
    float *all[] = {d_q, d_k, d_v, d_dout, dout_ref, o_b, o_1, lse, ws, gq, gk, gv};
    for (float *p : all) CUDA_OK(cudaFree(p));
}

/* RoPE for B sequences of N rows: positions pos[b * N + n] = n + offset(b) (offsets 0..49,
 * so sequences start at different positions), tables (P = N + 50, HS/2) of the usual angles
 * p * 10000^(-2i/HS), cos and sin computed in double and rounded to f32. d: the device copy
 * (what kiln_cuda_rope and kiln_cuda_attention_fast_seqs take). */
struct Rope {
    kiln_cuda_attn_rope d;
};

static Rope rope_upload(int B, int N, int HS) {
    const int P = N + 50, half = HS / 2;
    std::vector<int32_t> pos((size_t)B * N);
    std::vector<float> ct((size_t)P * half), st(ct.size());
    for (int b = 0; b < B; b++)
        for (int n = 0; n < N; n++) pos[(size_t)b * N + n] = n + (b * 37 + 11) % 50;
    for (int p = 0; p < P; p++)
        for (int i = 0; i < half; i++) {
            const double a = p * pow(10000.0, -2.0 * i / HS);
            ct[(size_t)p * half + i] = (float)cos(a);
            st[(size_t)p * half + i] = (float)sin(a);
        }
    int32_t *d_pos = nullptr;
    CUDA_OK(cudaMalloc(&d_pos, pos.size() * 4));
    CUDA_OK(cudaMemcpy(d_pos, pos.data(), pos.size() * 4, cudaMemcpyHostToDevice));
    Rope r;
    r.d.pos = d_pos;
    r.d.cos_tab = dev_upload(ct);
    r.d.sin_tab = dev_upload(st);
    return r;
}

static void rope_free(const Rope &r) {
    CUDA_OK(cudaFree((void *)r.d.pos));
    CUDA_OK(cudaFree((void *)r.d.cos_tab));
    CUDA_OK(cudaFree((void *)r.d.sin_tab));
}

/* One forward (keep, rope as given; the output f32 or, with use16, bf16), NaN-poisoned
 * outputs first; returns the output's and lse's bits. */
struct Fwd {
    std::vector<uint8_t> out, lse;
    bool operator==(const Fwd &o) const { return out == o.out && lse == o.lse; }
};

static Fwd fwd_bits(kiln_cuda_attn *attn, void *o, float *lse, void *keep,
                    const kiln_cuda_attn_rope *rope, const float *q, const float *k,
                    const float *v, int B, const Case &c, bool use16) {
    const size_t nq = (size_t)B * c.N * c.NH * c.HS;
    const size_t nl = (size_t)B * c.NH * kiln_cuda_attn_pack_rows(c.N);
    const size_t ob = nq * (use16 ? 2 : 4);
    CUDA_OK(cudaMemset(o, 0xff, ob));
    CUDA_OK(cudaMemset(lse, 0xff, nl * 4));
    CUDA_OK(kiln_cuda_attention_fast_seqs(attn, 0, use16 ? nullptr : (float *)o,
                                          use16 ? (uint16_t *)o : nullptr, lse, keep, rope, q, k,
                                          v, B, c.N, c.NH, c.KVH, c.HS,
                                          1.0f / sqrtf((float)c.HS)));
    Fwd f;
    f.out.resize(ob);
    f.lse.resize(nl * 4);
    CUDA_OK(cudaMemcpy(f.out.data(), o, ob, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(f.lse.data(), lse, nl * 4, cudaMemcpyDeviceToHost));
    return f;
}

/* One backward (keep as given; q, k, v NULL with keep), NaN-poisoned outputs and workspace
 * first; returns the gradients. */
static Grads bwd_bits(float *gq, float *gk, float *gv, float *ws, size_t nws, const float *dout,
                      const float *q, const float *k, const float *v, const void *o,
                      const float *lse, const void *keep, int B, const Case &c, bool use16) {
    const size_t nq = (size_t)B * c.N * c.NH * c.HS, nk = (size_t)B * c.N * c.KVH * c.HS;
    CUDA_OK(cudaMemset(gq, 0xff, nq * 4));
    CUDA_OK(cudaMemset(gk, 0xff, nk * 4));
    CUDA_OK(cudaMemset(gv, 0xff, nk * 4));
    CUDA_OK(cudaMemset(ws, 0xff, nws * 4));
    CUDA_OK(kiln_cuda_attention_backward_fast_seqs(
        0, gq, gk, gv, dout, keep ? nullptr : q, keep ? nullptr : k, keep ? nullptr : v,
        use16 ? nullptr : (const float *)o, use16 ? (const uint16_t *)o : nullptr, lse, keep, ws,
        nws, B, c.N, c.NH, c.KVH, c.HS, 1.0f / sqrtf((float)c.HS)));
    Grads g;
    g.g[0] = dev_download(gq, nq);
    g.g[1] = dev_download(gk, nk);
    g.g[2] = dev_download(gv, nk);
    return g;
}

/* Random inputs of nq query and nk key values: q and k in [-amp, amp), v and dout in [-1, 1),
 * drawn in the order q, k, v, dout. */
struct Qkvd {
    std::vector<float> q, k, v, dout;
};

static Qkvd draw_qkvd(size_t nq, size_t nk, float amp) {
    Qkvd in{std::vector<float>(nq), std::vector<float>(nk), std::vector<float>(nk),
            std::vector<float>(nq)};
    for (auto &x : in.q) x = amp * urand();
    for (auto &x : in.k) x = amp * urand();
    for (auto &x : in.v) x = urand();
    for (auto &x : in.dout) x = urand();
    return in;
}

/* keep and rope of the batched entry points, B sequences of c.N tokens (the flash path), the
 * output f32 or (use16) bf16:
 *   - the forward with keep has the bits (output, lse) of the forward without; the backward
 *     from that keep with q, k, v NULL has the bits of the backward from q, k, v, with the
 *     saved lse and without;
 *   - the forward with keep and rope on the un-rotated q, k has the bits of kiln_cuda_rope on
 *     q and k and then the forward without rope (output, lse, and the packed tiles in keep);
 *     the backward from that keep has the bits of the backward from the rotated f32 q, k.
 * Returns whether every check held. */
static bool check_keep(int B, const Case &c, kiln_cuda_attn *attn, bool use16) {
    const int N = c.N, NH = c.NH, KVH = c.KVH, HS = c.HS;
    const size_t nq = (size_t)B * N * NH * HS, nk = (size_t)B * N * KVH * HS;
    const size_t nl = (size_t)B * NH * kiln_cuda_attn_pack_rows(N);
    const Qkvd in = draw_qkvd(nq, nk, c.amp);
    const std::vector<float> &q = in.q, &k = in.k, &v = in.v, &dout = in.dout;
    float *d_q = dev_upload(q), *d_k = dev_upload(k), *d_v = dev_upload(v);
    float *d_dout = dev_upload(dout), *q_rot = dev_upload(q), *k_rot = dev_upload(k);
    const size_t nws = (size_t)B * kiln_cuda_attention_backward_fast_ws(N, 0, NH, KVH, HS);
    float *o = dev_nan(nq), *lse = dev_nan(nl), *ws = dev_nan(nws);
    float *gq = dev_nan(nq), *gk = dev_nan(nk), *gv = dev_nan(nk);
    const size_t kb = kiln_cuda_attn_keep_bytes(B, N, NH, KVH, HS);
    void *keep = nullptr, *keep2 = nullptr;
    CUDA_OK(cudaMalloc(&keep, kb));
    CUDA_OK(cudaMalloc(&keep2, kb));

    /* keep alone */
    const Fwd f0 = fwd_bits(attn, o, lse, nullptr, nullptr, d_q, d_k, d_v, B, c, use16);
    const Fwd f1 = fwd_bits(attn, o, lse, keep, nullptr, d_q, d_k, d_v, B, c, use16);
    const bool fwd_keep = f0 == f1;
    bool bwd_keep = true;
    for (int with_lse = 0; with_lse < 2; with_lse++) {
        const float *l = with_lse ? lse : nullptr; /* lse holds f1's (= f0's) */
        const Grads g0 =
            bwd_bits(gq, gk, gv, ws, nws, d_dout, d_q, d_k, d_v, o, l, nullptr, B, c, use16);
        const Grads g1 =
            bwd_bits(gq, gk, gv, ws, nws, d_dout, d_q, d_k, d_v, o, l, keep, B, c, use16);
        bwd_keep = bwd_keep && g0 == g1;
    }

    /* rope: kiln_cuda_rope then the forward, against the rotation in the forward's packing */
    const Rope rope = rope_upload(B, N, HS);
    CUDA_OK(kiln_cuda_rope(0, q_rot, rope.d.pos, B * N, NH, HS, rope.d.cos_tab, rope.d.sin_tab));
    CUDA_OK(kiln_cuda_rope(0, k_rot, rope.d.pos, B * N, KVH, HS, rope.d.cos_tab, rope.d.sin_tab));
    CUDA_OK(cudaMemset(keep, 0x5a, kb));
    CUDA_OK(cudaMemset(keep2, 0x5a, kb));
    const Fwd r0 = fwd_bits(attn, o, lse, keep2, nullptr, q_rot, k_rot, d_v, B, c, use16);
    const Fwd r1 = fwd_bits(attn, o, lse, keep, &rope.d, d_q, d_k, d_v, B, c, use16);
    std::vector<uint8_t> h0(kb), h1(kb);
    CUDA_OK(cudaMemcpy(h0.data(), keep2, kb, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(h1.data(), keep, kb, cudaMemcpyDeviceToHost));
    const bool fwd_rope = r0 == r1 && h0 == h1 && !(r0 == f0); /* and the rotation did act */
    /* lse and o hold r1's (= r0's) */
    const Grads g0 =
        bwd_bits(gq, gk, gv, ws, nws, d_dout, q_rot, k_rot, d_v, o, lse, nullptr, B, c, use16);
    const Grads g1 =
        bwd_bits(gq, gk, gv, ws, nws, d_dout, nullptr, nullptr, nullptr, o, lse, keep, B, c,
                 use16);
    const bool bwd_rope = g0 == g1;

    const bool ok = fwd_keep && bwd_keep && fwd_rope && bwd_rope;
    printf("attention seqs keep B=%d N=%d NH=%d KVH=%d HS=%d %s out: forward with keep %s "
           "without; backward from keep (q, k, v NULL; lse, none) %s from q, k, v; forward "
           "with keep + rope %s rope + forward (out, lse, keep); its backward %s from the rotated "
           "q, k %s\n",
           B, N, NH, KVH, HS, use16 ? "bf16" : "f32", fwd_keep ? "=" : "!=",
           bwd_keep ? "=" : "!=", fwd_rope ? "=" : "!=", bwd_rope ? "=" : "!=",
           ok ? "OK" : "FAILED");
    rope_free(rope);
    CUDA_OK(cudaFree(keep));
    CUDA_OK(cudaFree(keep2));
    float *all[] = {d_q, d_k, d_v, d_dout, q_rot, k_rot, o, lse, ws, gq, gk, gv};
    for (float *p : all) CUDA_OK(cudaFree(p));
    return ok;
}

/* The refusals of keep and rope: rope without keep, or with a NULL table ->
 * cudaErrorInvalidValue; keep misaligned -> cudaErrorInvalidValue; keep where the flash path
 * does not run (N <= 8: the split decode; an unaligned q) -> cudaErrorNotSupported, the
 * output untouched; the backward with keep for a shape the flash forward does not take, or
 * without keep and q NULL -> cudaErrorInvalidValue. Returns whether all held. */
static bool check_keep_refusals(kiln_cuda_attn *attn) {
    const int B = 2, N = 5, NH = 4, KVH = 2, HS = 64, N2 = 70;
    const float scale = 0.125f;
    const size_t nq = (size_t)B * N2 * NH * HS, nk = (size_t)B * N2 * KVH * HS;
    std::vector<float> h(nq);
    for (auto &x : h) x = urand();
    float *q = dev_upload(h), *k = dev_upload(h), *v = dev_upload(h), *o = dev_nan(nq);
    float *lse = dev_nan((size_t)B * NH * 128);
    const size_t nws = (size_t)B * kiln_cuda_attention_backward_fast_ws(N2, 0, NH, KVH, HS);
    float *ws = dev_nan(nws), *gq = dev_nan(nq), *gk = dev_nan(nk), *gv = dev_nan(nk);
    void *keep = nullptr;
    CUDA_OK(cudaMalloc(&keep, kiln_cuda_attn_keep_bytes(B, N2, NH, KVH, HS) + 256));
    const Rope rope = rope_upload(B, N2, HS);
    kiln_cuda_attn_rope no_sin = rope.d;
    no_sin.sin_tab = nullptr;
    bool ok = true;
    /* rope without keep; rope with a NULL table; keep off its 256-byte alignment */
    ok = ok && kiln_cuda_attention_fast_seqs(attn, 0, o, nullptr, lse, nullptr, &rope.d, q, k, v,
                                             B, N2, NH, KVH, HS, scale) == cudaErrorInvalidValue;
    ok = ok && kiln_cuda_attention_fast_seqs(attn, 0, o, nullptr, lse, keep, &no_sin, q, k, v, B,
                                             N2, NH, KVH, HS, scale) == cudaErrorInvalidValue;
    ok = ok && kiln_cuda_attention_fast_seqs(attn, 0, o, nullptr, lse, (char *)keep + 16, nullptr,
                                             q, k, v, B, N2, NH, KVH, HS,
                                             scale) == cudaErrorInvalidValue;
    /* keep off the flash path: N = 5 (split decode), q not 16-byte aligned (f32 kernel) */
    ok = ok && kiln_cuda_attention_fast_seqs(attn, 0, o, nullptr, lse, keep, nullptr, q, k, v, B,
                                             N, NH, KVH, HS, scale) == cudaErrorNotSupported;
    ok = ok && kiln_cuda_attention_fast_seqs(attn, 0, o, nullptr, lse, keep, &rope.d, q, k, v, B,
                                             N, NH, KVH, HS, scale) == cudaErrorNotSupported;
    ok = ok && kiln_cuda_attention_fast_seqs(attn, 0, o, nullptr, lse, keep, nullptr, q + 1, k,
                                             v, B, N2, NH, KVH, HS,
                                             scale) == cudaErrorNotSupported;
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> ho = dev_download(o, nq);
    for (size_t i = 0; i < nq && ok; i++) ok = isnan(ho[i]); /* nothing was enqueued */
    /* the backward: keep with N = 5 (no flash forward); no keep and q NULL */
    ok = ok && kiln_cuda_attention_backward_fast_seqs(0, gq, gk, gv, q, nullptr, nullptr, nullptr,
                                                      o, nullptr, lse, keep, ws, nws, B, N, NH,
                                                      KVH, HS, scale) == cudaErrorInvalidValue;
    ok = ok && kiln_cuda_attention_backward_fast_seqs(0, gq, gk, gv, q, nullptr, k, v, o,
                                                      nullptr, lse, nullptr, ws, nws, B, N2, NH,
                                                      KVH, HS, scale) == cudaErrorInvalidValue;
    printf("attention seqs keep/rope refusals: %s\n", ok ? "OK" : "FAILED");
    rope_free(rope);
    CUDA_OK(cudaFree(keep));
    float *all[] = {q, k, v, o, lse, ws, gq, gk, gv};
    for (float *p : all) CUDA_OK(cudaFree(p));
    return ok;
}

/* Milliseconds a call of fn (work enqueued on stream 0) over reps calls, after warm untimed
 * ones. */
template <typename F>
static float time_ms(int warm, int reps, F fn) {
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    for (int r = -warm; r < reps; r++) {
        if (r == 0) CUDA_OK(cudaEventRecord(e0));
        fn();
    }
    CUDA_OK(cudaEventRecord(e1));
    CUDA_OK(cudaEventSynchronize(e1));
    float ms = 0.0f;
    CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    CUDA_OK(cudaEventDestroy(e0));
    CUDA_OK(cudaEventDestroy(e1));
    return ms / (float)reps;
}

/* A training layer's attention for B sequences: forward + backward, batched with the saved
 * lse against per-sequence calls (forward, then backward with its statistics pass); and the
 * batched calls with keep (the backward packs only dout), and as training runs them with
 * RoPE: kiln_cuda_rope on q and k then the batched calls, against RoPE fused into the
 * forward's packing with keep. */
static void time_seqs(int B, const Case &c, kiln_cuda_attn *attn) {
    const float scale = 1.0f / sqrtf((float)c.HS);
    const int N = c.N, NH = c.NH, KVH = c.KVH, HS = c.HS;
    const size_t qs = (size_t)N * NH * HS, ks = (size_t)N * KVH * HS, nq = B * qs, nk = B * ks;
    std::vector<float> h(nq);
    for (auto &x : h) x = urand();
    std::vector<float> hk(h.begin(), h.begin() + nk);
    float *q = dev_upload(h), *dout = dev_upload(h), *k = dev_upload(hk), *v = dev_upload(hk);
    const size_t nws = (size_t)B * kiln_cuda_attention_backward_fast_ws(N, 0, NH, KVH, HS);
    float *out = dev_nan(nq), *lse = dev_nan((size_t)B * NH * kiln_cuda_attn_pack_rows(N)),
          *ws = dev_nan(nws), *gq = dev_nan(nq), *gk = dev_nan(nk), *gv = dev_nan(nk);
    void *keep = nullptr;
    CUDA_OK(cudaMalloc(&keep, kiln_cuda_attn_keep_bytes(B, N, NH, KVH, HS)));
    const Rope rope = rope_upload(B, N, HS);
    /* batched; batched with keep; rope + batched; batched with keep + fused rope; per sequence */
    float ms[5];
    for (int which = 0; which < 5; which++) {
        ms[which] = time_ms(1, 10, [&]() {
            if (which == 2) { /* rotates q, k again on every repetition: a timing only */
                CUDA_OK(kiln_cuda_rope(0, q, rope.d.pos, B * N, NH, HS, rope.d.cos_tab,
                                       rope.d.sin_tab));
                CUDA_OK(kiln_cuda_rope(0, k, rope.d.pos, B * N, KVH, HS, rope.d.cos_tab,
                                       rope.d.sin_tab));
            }
            if (which == 0 || which == 2) {
                CUDA_OK(kiln_cuda_attention_fast_seqs(attn, 0, out, nullptr, lse, nullptr, nullptr,
                                                      q, k, v, B, N, NH, KVH, HS, scale));
                CUDA_OK(kiln_cuda_attention_backward_fast_seqs(0, gq, gk, gv, dout, q, k, v, out,
                                                               nullptr, lse, nullptr, ws, nws, B, N,
                                                               NH, KVH, HS, scale));
            } else if (which == 1 || which == 3) {
                CUDA_OK(kiln_cuda_attention_fast_seqs(attn, 0, out, nullptr, lse, keep,
                                                      which == 3 ? &rope.d : nullptr, q, k, v, B,
                                                      N, NH, KVH, HS, scale));
                CUDA_OK(kiln_cuda_attention_backward_fast_seqs(
                    0, gq, gk, gv, dout, nullptr, nullptr, nullptr, out, nullptr, lse, keep, ws,
                    nws, B, N, NH, KVH, HS, scale));
            } else {
                for (int b = 0; b < B; b++)
                    CUDA_OK(kiln_cuda_attention_fast(attn, 0, out + b * qs, q + b * qs,
                                                     k + b * ks, v + b * ks, N, 0, NH, KVH, HS,
                                                     scale));
                for (int b = 0; b < B; b++)
                    CUDA_OK(kiln_cuda_attention_backward_fast(
                        0, gq + b * qs, gk + b * ks, gv + b * ks, dout + b * qs, q + b * qs,
                        k + b * ks, v + b * ks, out + b * qs, ws, nws, N, 0, NH, KVH, HS, scale));
            }
        });
    }
    printf("time attention fwd+bwd B=%d N=%d NH=%d KVH=%d HS=%d: batched with lse %.3f ms, "
           "with keep %.3f ms (%.2fx); rope + batched %.3f ms, keep + fused rope %.3f ms "
           "(%.2fx); per sequence %.3f ms (%.2fx of batched)\n",
           B, N, NH, KVH, HS, ms[0], ms[1], ms[0] / ms[1], ms[2], ms[3], ms[2] / ms[3], ms[4],
           ms[4] / ms[0]);
    rope_free(rope);
    CUDA_OK(cudaFree(keep));
    float *all[] = {q, dout, k, v, out, lse, ws, gq, gk, gv};
    for (float *p : all) CUDA_OK(cudaFree(p));
}

/* The fused epilogue (kiln_cuda_attention_backward_fast_seqs16, the trainer's call: the
 * forward's keep, RoPE and lse, a bf16 output) against the calls it stands for: the backward,
 * kiln_cuda_rope_backward_bf16 on dq and dk, kiln_cuda_f32_to_bf16 on dv, into one stacked
 * bf16 matrix (token rows of NH HS + 2 KVH HS: dq | dk | dv, as the trainer lays them out for
 * one product, plus pad columns), bit for bit, NaN-poisoned first; with keep_f32 the f32 dq,
 * dk, dv too. With timing, both forms timed (the backward and its epilogue, the forward not
 * counted). */
static bool check_grad16(int B, const Case &c, kiln_cuda_attn *attn, bool keep_f32,
                         bool timing, int pad = 0) {
    const int N = c.N, NH = c.NH, KVH = c.KVH, HS = c.HS, T = B * N;
    const float scale = 1.0f / sqrtf((float)HS);
    const size_t nq = (size_t)T * NH * HS, nk = (size_t)T * KVH * HS;
    /* pad (even): token rows wider than the heads, e.g. 2 so that the GQA reduction takes its
     * 4-byte stores (ld16 not a multiple of 4) */
    const int64_t ld = (int64_t)(NH + 2 * KVH) * HS + pad;
    const size_t n16 = (size_t)T * (size_t)ld;
    const Qkvd in = draw_qkvd(nq, nk, c.amp);
    const std::vector<float> &q = in.q, &k = in.k, &v = in.v, &dout = in.dout;
    float *d_q = dev_upload(q), *d_k = dev_upload(k), *d_v = dev_upload(v);
    float *d_dout = dev_upload(dout);
    const size_t nws = (size_t)B * kiln_cuda_attention_backward_fast_ws(N, 0, NH, KVH, HS);
    const size_t nl = (size_t)B * NH * kiln_cuda_attn_pack_rows(N);
    float *o = dev_nan(nq / 2 + 4), *lse = dev_nan(nl), *ws = dev_nan(nws);
    float *gq = dev_nan(nq), *gk = dev_nan(nk), *gv = dev_nan(nk);
    uint16_t *s16[2] = {nullptr, nullptr};
    for (auto &p : s16) CUDA_OK(cudaMalloc(&p, n16 * 2));
    void *keep = nullptr;
    CUDA_OK(cudaMalloc(&keep, kiln_cuda_attn_keep_bytes(B, N, NH, KVH, HS)));
    const Rope rope = rope_upload(B, N, HS);
    uint16_t *o16 = reinterpret_cast<uint16_t *>(o);
    CUDA_OK(kiln_cuda_attention_fast_seqs(attn, 0, nullptr, o16, lse, keep, &rope.d, d_q, d_k,
                                          d_v, B, N, NH, KVH, HS, scale));
    auto separate = [&](uint16_t *d16) {
        CUDA_OK(kiln_cuda_attention_backward_fast_seqs(0, gq, gk, gv, d_dout, nullptr, nullptr,
                                                       nullptr, nullptr, o16, lse, keep, ws, nws,
                                                       B, N, NH, KVH, HS, scale));
        CUDA_OK(kiln_cuda_rope_backward_bf16(0, gq, d16, ld, keep_f32, rope.d.pos, T, NH, HS,
                                             rope.d.cos_tab, rope.d.sin_tab));
        CUDA_OK(kiln_cuda_rope_backward_bf16(0, gk, d16 + NH * HS, ld, keep_f32, rope.d.pos, T,
                                             KVH, HS, rope.d.cos_tab, rope.d.sin_tab));
        CUDA_OK(kiln_cuda_f32_to_bf16(0, d16 + (NH + KVH) * HS, ld, gv, (int64_t)KVH * HS, T,
                                      (int64_t)KVH * HS));
    };
    const kiln_attn_grad16 g = {s16[1], s16[1] + NH * HS, s16[1] + (NH + KVH) * HS, ld,
                                keep_f32, rope.d.pos, rope.d.cos_tab, rope.d.sin_tab};
    auto fused = [&]() {
        CUDA_OK(kiln_cuda_attention_backward_fast_seqs16(0, gq, gk, gv, &g, d_dout, nullptr,
                                                         nullptr, nullptr, nullptr, o16, lse,
                                                         keep, ws, nws, B, N, NH, KVH, HS,
                                                         scale));
    };
    std::vector<uint16_t> h16[2];
    std::vector<float> f32[2][3];
    for (int form = 0; form < 2; form++) {
        CUDA_OK(cudaMemset(s16[form], 0xff, n16 * 2));
        CUDA_OK(cudaMemset(gq, 0xff, nq * 4));
        CUDA_OK(cudaMemset(gk, 0xff, nk * 4));
        CUDA_OK(cudaMemset(gv, 0xff, nk * 4));
        if (form == 0) separate(s16[0]);
        else fused();
        CUDA_OK(cudaDeviceSynchronize());
        h16[form].resize(n16);
        CUDA_OK(cudaMemcpy(h16[form].data(), s16[form], n16 * 2, cudaMemcpyDeviceToHost));
        f32[form][0] = dev_download(gq, nq);
        f32[form][1] = dev_download(gk, nk);
        f32[form][2] = dev_download(gv, nk);
    }
    size_t nan16 = 0, diff16 = 0, diff32 = 0;
    for (size_t i = 0; i < n16; i++) { /* the pad columns: left as poisoned by both forms */
        const bool in_heads = (int64_t)(i % (size_t)ld) < ld - pad;
        nan16 += in_heads && (h16[0][i] & 0x7f80) == 0x7f80 && (h16[0][i] & 0x7f) != 0;
        diff16 += h16[0][i] != h16[1][i];
    }
    if (keep_f32)
        for (int t = 0; t < 3; t++)
            diff32 += memcmp(f32[0][t].data(), f32[1][t].data(), f32[0][t].size() * 4) != 0;
    const bool ok = nan16 == 0 && diff16 == 0 && diff32 == 0;
    printf("attention backward + rope/bf16 epilogue B=%d N=%d NH=%d KVH=%d HS=%d keep_f32 %d "
           "pad %d: fused %s separate (%zu of %zu bf16 differ, %zu NaN; f32 %s) %s\n",
           B, N, NH, KVH, HS, (int)keep_f32, pad, ok ? "=" : "!=", diff16, n16, nan16,
           keep_f32 ? (diff32 ? "DIFFER" : "same") : "not kept", ok ? "OK" : "FAILED");
    if (timing) {
        const float ms[2] = {time_ms(2, 20, [&]() { separate(s16[0]); }), time_ms(2, 20, fused)};
        printf("time attention backward + rope/bf16 epilogue B=%d N=%d NH=%d KVH=%d HS=%d "
               "keep_f32 %d: separate %.3f ms, fused %.3f ms (%.2fx)\n",
               B, N, NH, KVH, HS, (int)keep_f32, ms[0], ms[1], ms[0] / ms[1]);
    }
    rope_free(rope);
    CUDA_OK(cudaFree(keep));
    for (auto p : s16) CUDA_OK(cudaFree(p));
    float *all[] = {d_q, d_k, d_v, d_dout, o, lse, ws, gq, gk, gv};
    for (float *p : all) CUDA_OK(cudaFree(p));
    return ok;
}

/* The trainer's attention calls timed alone: the forward with keep and a bf16 output, then the
 * batched backward from its keep and lse (cudaEvent, mean of 20). */
static void time_fwd_bwd(int B, const Case &c, kiln_cuda_attn *attn) {
    const int N = c.N, NH = c.NH, KVH = c.KVH, HS = c.HS;
    const float scale = 1.0f / sqrtf((float)HS);
    const size_t nq = (size_t)B * N * NH * HS, nk = (size_t)B * N * KVH * HS;
    const Qkvd in = draw_qkvd(nq, nk, c.amp);
    float *d_q = dev_upload(in.q), *d_k = dev_upload(in.k), *d_v = dev_upload(in.v);
    float *d_dout = dev_upload(in.dout);
    const size_t nws = (size_t)B * kiln_cuda_attention_backward_fast_ws(N, 0, NH, KVH, HS);
    const size_t nl = (size_t)B * NH * kiln_cuda_attn_pack_rows(N);
    float *o = dev_nan(nq / 2 + 4), *lse = dev_nan(nl), *ws = dev_nan(nws);
    float *gq = dev_nan(nq), *gk = dev_nan(nk), *gv = dev_nan(nk);
    void *keep = nullptr;
    CUDA_OK(cudaMalloc(&keep, kiln_cuda_attn_keep_bytes(B, N, NH, KVH, HS)));
    uint16_t *o16 = reinterpret_cast<uint16_t *>(o);
    const float fms = time_ms(2, 20, [&]() {
        CUDA_OK(kiln_cuda_attention_fast_seqs(attn, 0, nullptr, o16, lse, keep, nullptr, d_q, d_k,
                                              d_v, B, N, NH, KVH, HS, scale));
    });
    const float bms = time_ms(2, 20, [&]() {
        CUDA_OK(kiln_cuda_attention_backward_fast_seqs(0, gq, gk, gv, d_dout, nullptr, nullptr,
                                                       nullptr, nullptr, o16, lse, keep, ws, nws,
                                                       B, N, NH, KVH, HS, scale));
    });
    printf("time attention B=%d N=%d NH=%d KVH=%d HS=%d: forward %.3f ms, backward %.3f ms\n", B,
           N, NH, KVH, HS, fms, bms);
    CUDA_OK(cudaFree(keep));
    float *all[] = {d_q, d_k, d_v, d_dout, o, lse, ws, gq, gk, gv};
    for (float *p : all) CUDA_OK(cudaFree(p));
}

/* The packing's HS 64 kernels: the half-warp one with 16-byte loads (taken where every job's
 * pointers are 16-byte aligned) against the one-warp one (taken otherwise: the same values
 * from a copy of q 4 bytes past alignment), bit for bit: RoPE'd and plain jobs, D with a bf16
 * and an f32 out, B sequences of R rows (padding rows included), in one launch; then with src
 * 8 bytes past alignment (the one-warp kernel either way). Also timed at the 135M shape's
 * forward packing (8 x 2048 rows, 9 + 3 + 3 heads, RoPE on q and k). */
static bool check_pack_vec(int B, int R, int NH, int KVH, int max_pos, bool timing) {
    const int HS = 64, Rpad = kiln_cuda_attn_pack_rows(R);
    const size_t rows = (size_t)B * R, nq = rows * NH * HS, nk = rows * KVH * HS;
    const size_t pq = (size_t)B * NH * Rpad * HS, pk = (size_t)B * KVH * Rpad * HS;
    std::vector<float> h(nq + 4), cs((size_t)max_pos * HS / 2), sn(cs.size());
    for (auto &v : h) v = urand() * 3.0f;
    for (size_t i = 0; i < cs.size(); i++) cs[i] = cosf(0.01f * (float)i), sn[i] = sinf(0.01f * (float)i);
    std::vector<int32_t> pos(rows);
    for (size_t i = 0; i < rows; i++) pos[i] = (int32_t)((i * 7 + 3) % (size_t)max_pos);
    std::vector<uint16_t> o16(nq);
    for (size_t i = 0; i < nq; i++) o16[i] = kiln_fp32_to_bf16(urand());
    float *q, *qm, *k, *out, *dq, *dk, *tc, *ts;
    uint16_t *out16;
    int32_t *dpos;
    __nv_bfloat16 *dst[2];
    CUDA_OK(cudaMalloc(&q, (nq + 4) * 4));
    CUDA_OK(cudaMalloc(&qm, (nq + 8) * 4));
    CUDA_OK(cudaMalloc(&k, nk * 4));
    CUDA_OK(cudaMalloc(&out, nq * 4));
    CUDA_OK(cudaMalloc(&out16, nq * 2));
    CUDA_OK(cudaMalloc(&dq, (size_t)B * NH * Rpad * 4 * 2));
    CUDA_OK(cudaMalloc(&dk, (size_t)B * NH * Rpad * 4 * 2));
    CUDA_OK(cudaMalloc(&tc, cs.size() * 4));
    CUDA_OK(cudaMalloc(&ts, cs.size() * 4));
    CUDA_OK(cudaMalloc(&dpos, rows * 4));
    for (int i = 0; i < 2; i++) CUDA_OK(cudaMalloc(&dst[i], (3 * pq + 2 * pk) * 2));
    CUDA_OK(cudaMemcpy(q, h.data(), (nq + 4) * 4, cudaMemcpyHostToDevice));
    /* 8 bytes off: the one-warp kernel's 8-byte loads, not the half-warp kernel's 16 */
    CUDA_OK(cudaMemcpy(qm + 2, h.data(), (nq + 4) * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(k, h.data(), nk * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(out, h.data() + 1, nq * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(out16, o16.data(), nq * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(tc, cs.data(), cs.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(ts, sn.data(), cs.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dpos, pos.data(), rows * 4, cudaMemcpyHostToDevice));
    const kiln_cuda_attn_rope rp = {dpos, tc, ts}, none = {NULL, NULL, NULL};
    bool ok = true;
    for (int misalign = 0; misalign < 2; misalign++) {
        std::vector<uint16_t> got[2];
        std::vector<float> dgot[2];
        for (int form = 0; form < 2; form++) { /* 0: one warp, 1: half-warp where aligned */
            __nv_bfloat16 *d = dst[form];
            CUDA_OK(cudaMemset(d, 0xff, (3 * pq + 2 * pk) * 2));
            /* q's values; form 0 from the copy 8 bytes off: the kernel the other form does not
             * take (misalign 0: the one-warp kernel against the half-warp one; 1: the reverse) */
            const float *src = (form == 0 ? qm + 2 : q) + (misalign ? 2 : 0);
            const kiln_cuda_attn_pack_job fwd[3] = {{d, src, NULL, NULL, NULL, R, Rpad, NH, B, rp},
                                                    {d + pq, k, NULL, NULL, NULL, R, Rpad, KVH, B, rp},
                                                    {d + pq + pk, k, NULL, NULL, NULL, R, Rpad, KVH, B, none}};
            const kiln_cuda_attn_pack_job bwd[2] = {
                {d + pq + 2 * pk, src, NULL, out16, dq + (size_t)form * B * NH * Rpad, R, Rpad, NH, B, none},
                {d + 2 * pq + 2 * pk, src, out, NULL, dk + (size_t)form * B * NH * Rpad, R, Rpad, NH, B, none}};
            CUDA_OK(kiln_cuda_attn_pack_heads(0, fwd, 3, HS));
            CUDA_OK(kiln_cuda_attn_pack_heads(0, bwd, 2, HS));
            CUDA_OK(cudaDeviceSynchronize());
            got[form].resize(3 * pq + 2 * pk);
            CUDA_OK(cudaMemcpy(got[form].data(), d, got[form].size() * 2, cudaMemcpyDeviceToHost));
            dgot[form].resize((size_t)B * NH * Rpad * 2);
            CUDA_OK(cudaMemcpy(dgot[form].data(), dq + (size_t)form * B * NH * Rpad,
                               (size_t)B * NH * Rpad * 4, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(dgot[form].data() + (size_t)B * NH * Rpad, dk + (size_t)form * B * NH * Rpad,
                               (size_t)B * NH * Rpad * 4, cudaMemcpyDeviceToHost));
        }
        const bool same = got[0] == got[1] &&
                          memcmp(dgot[0].data(), dgot[1].data(), dgot[0].size() * 4) == 0;
        printf("pack HS 64 B=%d R=%d heads %d/%d%s: half-warp kernel vs one-warp kernel: %s\n", B, R,
               NH, KVH, misalign ? " (src misaligned)" : "", same ? "same bits" : "DIFFER");
        ok &= same;
    }
    if (timing) {
        cudaEvent_t a, e;
        CUDA_OK(cudaEventCreate(&a));
        CUDA_OK(cudaEventCreate(&e));
        float ms[2];
        for (int form = 0; form < 2; form++) { /* 0: one warp (q's copy), 1: half-warp */
            const float *src = form == 0 ? qm + 2 : q;
            const kiln_cuda_attn_pack_job fwd[3] = {
                {dst[0], src, NULL, NULL, NULL, R, Rpad, NH, B, rp},
                {dst[0] + pq, k, NULL, NULL, NULL, R, Rpad, KVH, B, rp},
                {dst[0] + pq + pk, k, NULL, NULL, NULL, R, Rpad, KVH, B, none}};
            for (int it = 0; it < 6; it++) {
                if (it == 1) CUDA_OK(cudaEventRecord(a, 0));
                CUDA_OK(kiln_cuda_attn_pack_heads(0, fwd, 3, HS));
            }
            CUDA_OK(cudaEventRecord(e, 0));
            CUDA_OK(cudaEventSynchronize(e));
            CUDA_OK(cudaEventElapsedTime(&ms[form], a, e));
            ms[form] /= 5.0f;
        }
        const double bytes = (double)(nq + 2 * nk) * 6.0;
        printf("time pack (forward: q, k with RoPE, v) B=%d R=%d: one warp %.1f us, half-warp %.1f us "
               "(%.2f TB/s)\n", B, R, ms[0] * 1e3, ms[1] * 1e3, bytes / (ms[1] * 1e9));
        CUDA_OK(cudaEventDestroy(a));
        CUDA_OK(cudaEventDestroy(e));
    }
    cudaFree(q), cudaFree(qm), cudaFree(k), cudaFree(out), cudaFree(out16), cudaFree(dq);
    cudaFree(dk);
    cudaFree(tc), cudaFree(ts), cudaFree(dpos), cudaFree(dst[0]), cudaFree(dst[1]);
    return ok;
}

int main(int argc, char **argv) {
    /* --no-time: the checks only; --time-only: the timings only (for a profiler) */
    const bool timing = !(argc > 1 && strcmp(argv[1], "--no-time") == 0);
    const bool checks = !(argc > 1 && strcmp(argv[1], "--time-only") == 0);
    if (argc > 1 && strcmp(argv[1], "--time-seqs") == 0) {
        int s[4] = {0, 0, 0, 0};
        for (int i = 0; i < 4; i++) s[i] = argc > 2 + i ? atoi(argv[2 + i]) : 0;
        if (s[0] < 1 || s[1] < 1 || s[2] < 1 || s[3] < 1 || s[2] % s[3] != 0) {
            fprintf(stderr, "--time-seqs B N NH KVH: four positive integers, KVH dividing NH\n");
            return 2;
        }
        int n = 0;
        if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return 77;
        kiln_cuda_attn *attn = nullptr;
        CUDA_OK(kiln_cuda_attn_create(&attn));
        time_seqs(s[0], {s[1], 0, s[2], s[3], 64, 1.0f}, attn);
        kiln_cuda_attn_free(attn);
        return 0;
    }
    /* host-side validation */
    float *a = (float *)(uintptr_t)4096, *u = (float *)(uintptr_t)4100;
    EXPECT(kiln_cuda_attention_backward_fast_ok(a, a, a, a, a, a, a, a, 7, 0, 4, 2, 64), "ok");
    EXPECT(!kiln_cuda_attention_backward_fast_ok(a, a, a, a, a, a, a, a, 7, 0, 4, 2, 80), "HS 80");
    EXPECT(!kiln_cuda_attention_backward_fast_ok(a, a, a, a, u, a, a, a, 7, 0, 4, 2, 64), "align");
    EXPECT(!kiln_cuda_attention_backward_fast_ok(a, a, a, a, a, a, a, a, 7, 0, 4, 3, 64), "GQA");
    /* D, L [NH][Npad]; GQA partials 2 T NH HS; bf16 q, dout [NH][Npad][HS], k, v
     * [KVH][Tpad][HS] (two bf16 a float); Npad = Tpad = 64 here */
    EXPECT(kiln_cuda_attention_backward_fast_ws(10, 2, 4, 2, 64) ==
               2 * 4 * 64 + 2 * 12 * 4 * 64 + (4 * 64 + 2 * 64) * 64,
           "ws");
    EXPECT(kiln_cuda_attention_backward_fast_ws(10, 0, 4, 4, 64) ==
               2 * 4 * 64 + (4 * 64 + 4 * 64) * 64,
           "ws MHA");
    EXPECT(kiln_cuda_attention_backward_fast_ws(65, 0, 4, 4, 128) ==
               2 * 4 * 128 + (4 * 128 + 4 * 128) * 128,
           "ws padded to 128 rows");
    EXPECT(kiln_cuda_attention_backward_fast_ws(10, 2, 4, 2, 64) ==
               kiln_attention_backward_fast_ws_floats(10, 2, 4, 2, 64),
           "ops.h counts the workspace");
    /* keep: q [B][NH][Npad][HS] then k, v [B][KVH][Npad][HS] in bf16, regions 256-aligned;
     * ops.h's count for the backend interface is the same */
    EXPECT(kiln_cuda_attn_keep_bytes(2, 100, 4, 2, 64) == 2 * 4 * 128 * 64 * 2 +
                                                             2 * (2 * 2 * 128 * 64 * 2),
           "keep bytes");
    EXPECT(kiln_cuda_attn_keep_bytes(1, 1, 1, 1, 3) == 512 + 2 * 512, "keep regions aligned");
    EXPECT(kiln_cuda_attn_keep_bytes(1, 1, 3, 2, 64) == 0 &&
               kiln_cuda_attn_keep_bytes(0, 1, 2, 2, 64) == 0 &&
               kiln_cuda_attn_keep_bytes(1, INT_MAX, 2, 2, 64) == 0 &&
               kiln_cuda_attn_keep_bytes(65535, 1 << 30, 65535, 65535, 128) == 0,
           "keep bytes refused");
    {
        const int shapes[][5] = {{4, 2048, 9, 3, 64}, {3, 200, 4, 2, 64}, {2, 129, 14, 2, 64},
                                 {2, 70, 6, 6, 128}, {1, 1, 1, 1, 3}};
        for (const auto &x : shapes)
            EXPECT(kiln_cuda_attn_keep_bytes(x[0], x[1], x[2], x[3], x[4]) ==
                       kiln_attention_keep_bytes(x[0], x[1], x[2], x[3], x[4]),
                   "keep bytes = ops.h's for B=%d N=%d NH=%d KVH=%d HS=%d", x[0], x[1], x[2],
                   x[3], x[4]);
    }
    {
        /* the fused epilogue's arguments: HS 64, 4-byte aligned bf16 rows, an even ld16 wide
         * enough for the query heads, 8-byte aligned tables */
        uint16_t *h = (uint16_t *)(uintptr_t)4096;
        const int32_t *pp = (const int32_t *)(uintptr_t)4096;
        const kiln_attn_grad16 g = {h, h + 256, h + 384, 512, false, pp, a, a};
        kiln_attn_grad16 bad[5] = {g, g, g, g, g};
        bad[0].dk16 = h + 1;
        bad[1].ld16 = 511;
        bad[2].ld16 = 4 * 64 - 2;
        bad[3].sin_tab = u;
        bad[4].pos = nullptr;
        EXPECT(kiln_cuda_attention_grad16_ok(&g, 4, 2, 64), "epilogue ok");
        EXPECT(!kiln_cuda_attention_grad16_ok(&g, 4, 2, 128), "epilogue HS 128");
        EXPECT(!kiln_cuda_attention_grad16_ok(nullptr, 4, 2, 64), "epilogue NULL");
        for (int i = 0; i < 5; i++)
            EXPECT(!kiln_cuda_attention_grad16_ok(&bad[i], 4, 2, 64), "epilogue refusal %d", i);
    }
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("no GPU: host checks %s; skipped\n", g_fail ? "FAILED" : "passed");
        return g_fail ? 1 : 77;
    }
    const Case cases[] = {
        {1, 0, 2, 1, 64, 1.0f},    {7, 0, 4, 2, 64, 1.0f},     {64, 0, 9, 3, 64, 1.0f},
        {100, 0, 14, 2, 64, 2.0f}, {65, 0, 4, 4, 64, 1.0f},    {257, 0, 4, 4, 128, 1.0f},
        {130, 20, 8, 2, 128, 1.5f}, {33, 70, 6, 3, 64, 1.0f},  {31, 0, 2, 2, 128, 3.0f},
        {512, 0, 9, 3, 64, 1.0f},  {300, 0, 16, 8, 128, 1.0f},
    };
    if (checks) {
        EXPECT(check_pack_vec(2, 70, 9, 3, 300, false), "pack HS 64");
        EXPECT(check_pack_vec(3, 1, 4, 4, 8, false), "pack HS 64, one row");
    }
    if (timing) EXPECT(check_pack_vec(8, 2048, 9, 3, 2048, true), "pack HS 64 (135M shape)");
    kiln_cuda_attn *attn = nullptr;
    CUDA_OK(kiln_cuda_attn_create(&attn));
    /* on an sm_90a device the flash forward and the backward run on wgmma for HS 64
     * (cuda_matmul.h); every check and timing runs there and on the mma.sync kernels too
     * (KILN_WGMMA=0: the kernels of every other device) */
    const bool wg = kiln_cuda_wgmma_usable(0);
    for (int mode = wg ? 0 : 1; mode < 2; mode++) {
        const bool on_wgmma = mode == 0;
        setenv("KILN_WGMMA", on_wgmma ? "1" : "0", 1);
        printf("== %s for HS 64 ==\n", on_wgmma ? "wgmma (sm_90a)" : "mma.sync");
        if (checks) {
            for (const Case &c : cases) check_case(c);
            const Case seqs[] = {{200, 0, 4, 2, 64, 1.0f}, {70, 0, 6, 6, 128, 2.0f},
                                 {129, 0, 9, 3, 64, 1.0f}, {9, 0, 2, 1, 64, 1.0f},
                                 {5, 0, 4, 2, 64, 1.0f},   {100, 0, 8, 2, 128, 1.0f}};
            const int Bs[] = {3, 2, 4, 5, 3, 2};
            for (int i = 0; i < 6; i++) check_seqs(Bs[i], seqs[i], attn);
            EXPECT(check_keep(3, {200, 0, 4, 2, 64, 1.0f}, attn, false), "keep HS 64");
            EXPECT(check_keep(2, {129, 0, 9, 3, 64, 1.0f}, attn, true), "keep HS 64 bf16");
            EXPECT(check_keep(2, {100, 0, 8, 2, 128, 2.0f}, attn, true), "keep HS 128 bf16");
            EXPECT(check_keep(2, {70, 0, 6, 6, 128, 1.0f}, attn, false), "keep HS 128 MHA");
            EXPECT(check_keep_refusals(attn), "keep refusals");
            /* G 2, 1, 7, 3 (the GQA reduction 4 elements a thread) and 9 (2 a thread) */
            const Case g16[] = {{200, 0, 4, 2, 64, 1.0f}, {129, 0, 6, 6, 64, 2.0f},
                                {130, 0, 14, 2, 64, 1.0f}, {77, 0, 9, 3, 64, 1.0f},
                                {100, 0, 18, 2, 64, 1.0f}};
            const int gB[] = {3, 2, 2, 3, 2};
            for (int i = 0; i < 5; i++)
                for (int kf = 0; kf < 2; kf++)
                    EXPECT(check_grad16(gB[i], g16[i], attn, kf, false),
                           "rope/bf16 epilogue B=%d N=%d NH=%d KVH=%d keep_f32 %d", gB[i],
                           g16[i].N, g16[i].NH, g16[i].KVH, kf);
            for (int kf = 0; kf < 2; kf++)
                EXPECT(check_grad16(3, g16[0], attn, kf, false, 2),
                       "rope/bf16 epilogue, token rows 2 wider (4-byte stores), keep_f32 %d", kf);
        }
        if (timing) {
            const Case shapes[] = {{2048, 0, 9, 3, 64, 1.0f},
                                   {2048, 0, 14, 2, 64, 1.0f},
                                   {2048, 0, 16, 8, 128, 1.0f},
                                   {4096, 0, 32, 8, 128, 1.0f}};
            for (const Case &c : shapes) time_case(c);
            time_seqs(4, {2048, 0, 9, 3, 64, 1.0f}, attn);
            time_seqs(2, {2048, 0, 14, 2, 64, 1.0f}, attn);
            if (on_wgmma) { /* the trainer's shapes (the 0.5B with its biases) */
                EXPECT(check_grad16(4, {2048, 0, 14, 2, 64, 1.0f}, attn, true, true),
                       "rope/bf16 epilogue, 0.5B shape");
                EXPECT(check_grad16(8, {2048, 0, 9, 3, 64, 1.0f}, attn, false, true),
                       "rope/bf16 epilogue, 135M shape");
                time_fwd_bwd(4, {2048, 0, 14, 2, 64, 1.0f}, attn);
                time_fwd_bwd(8, {2048, 0, 9, 3, 64, 1.0f}, attn);
            }
        }
    }
    unsetenv("KILN_WGMMA");
    kiln_cuda_attn_free(attn);
    printf("worst normalised error %.3e (bound 2e-2)\n", g_worst);
    if (g_fail) {
        printf("FAILED %d\n", g_fail);
        return 1;
    }
    printf("ALL OK\n");
    return 0;
}
