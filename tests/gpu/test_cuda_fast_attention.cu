/*
 * test_cuda_fast_attention.cu -- the fast-mode attention kernels (src/ops/cuda/
 * cuda_attention.h) against a host reference in double precision: plain causal
 * grouped-query softmax attention, written here from ops.h's definition.
 *
 * Bounds (|gpu - ref| over every checked element, relative to max|v| of the case):
 *   tensor-core flash path (N > 8, HS 64/128): 2e-2. q, k, v are rounded to bf16 (relative
 *     error <= 2^-9 each) and so are the softmax weights before the p.v product; the scores'
 *     error is about sqrt(HS) * |q||k| * 2^-9 * scale, a few 1e-3, so the expected error is
 *     a few 1e-3 * max|v|. The largest seen is printed.
 *   f32 paths (decode split, plain f32 kernel): 1e-5.
 * The split decode (N <= 8) must also give, bit for bit, the bits of its definition, emulated
 * on the host in f32 (split_def).
 * Every run starts from outputs poisoned with NaN bits, every case runs twice and must give
 * the same bits, and decode_dev (B = 1 and 3, different n_past per sequence, caches an odd
 * stride apart, through a captured CUDA graph replayed at several new positions) must give
 * the bits of kiln_cuda_attention_fast with N = 1 -- across the split decode's three ways of
 * finishing (one split: direct output; <= 64 splits: the last block combines; more: the
 * combine kernel), which must agree bit for bit. The split decode must also give the same
 * bits with 16-byte aligned and unaligned pointers (16- vs 4-byte tile copies).
 * Without a GPU: checks the reference and the host-side validation, then exits 77.
 * Usage: test_cuda_fast_attention
 */
#include "ops/cuda/cuda_attention.h"
#include "base/kmath.h" /* kiln_expf */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "gpu_test_cuda_check.h"

static int g_fail = 0, g_cases = 0;
static double g_mma_worst = 0.0, g_f32_worst = 0.0;

/* ---- host reference --------------------------------------------------------------------- */

/* out row n (all NH heads) of causal GQA attention, in double: token n of the call sits at
 * position n_past + n and sees keys 0..n_past+n; head h reads kv head h / (NH/KVH). */
static void ref_row(double *out, const float *q, const float *k, const float *v, int n,
                    int n_past, int NH, int KVH, int HS, float scale) {
    const int G = NH / KVH, nk = n_past + n + 1;
    std::vector<double> s((size_t)nk);
    for (int h = 0; h < NH; h++) {
        const int kvh = h / G;
        const float *qr = q + ((size_t)n * NH + h) * HS;
        double m = -INFINITY;
        for (int j = 0; j < nk; j++) {
            const float *kr = k + ((size_t)j * KVH + kvh) * HS;
            double a = 0.0;
            for (int d = 0; d < HS; d++) a += (double)qr[d] * (double)kr[d];
            s[j] = a * (double)scale;
            if (s[j] > m) m = s[j];
        }
        double l = 0.0;
        for (int j = 0; j < nk; j++) {
            s[j] = exp(s[j] - m);
            l += s[j];
        }
        double *o = out + (size_t)h * HS;
        for (int d = 0; d < HS; d++) o[d] = 0.0;
        for (int j = 0; j < nk; j++) {
            const float *vr = v + ((size_t)j * KVH + kvh) * HS;
            for (int d = 0; d < HS; d++) o[d] += s[j] / l * (double)vr[d];
        }
    }
}

/* The split decode's bits (N <= KILN_ATTN_DECODE_MAX_N; cuda_attention.cu, decode_kernel and
 * the combine defined above it), emulated operation by operation in f32 on the host, so that
 * the kernel is held to its definition bit for bit, not only to the double reference. Rows
 * of kv head kvh are r = n * G + g in chunks of 16; a chunk's keys end at its last row's
 * (n_past + n_last + 1), and each row's p.v chain runs over all of them (p = 0 past its own).
 * Per row and split of 64 keys: score = ((c0 + c1) + (c2 + c3)) * scale with chain i =
 * fmaf over d = 4c + i (columns past HS as zeros), m = max, p = kiln_expf(s - m) (0 when
 * masked), l = the butterfly sum of p_j + p_j+32, acc(d) = fmaf(p_j, v_j(d), acc) in key
 * order; then M = max m_s, w_s = kiln_expf(m_s - M), L = fmaf(w_s, l_s, L), a(d) = fmaf(w_s,
 * acc_s(d), a) in split order, out = a / L. No window. */
static void split_def(float *out, const float *q, const float *k, const float *v, int N,
                      int n_past, int NH, int KVH, int HS, float scale) {
    const int S = KILN_ATTN_SPLIT, G = NH / KVH, R = G * N, hs4 = (HS + 3) & ~3;
    for (int kvh = 0; kvh < KVH; kvh++)
        for (int r0 = 0; r0 < R; r0 += 16) {
            const int nr = R - r0 < 16 ? R - r0 : 16;
            const int all_end = n_past + (r0 + nr - 1) / G + 1;
            for (int r = r0; r < r0 + nr; r++) {
                const int n = r / G, h = kvh * G + r % G, last = n_past + n;
                const int ns = last / S + 1;
                const float *qr = q + ((size_t)n * NH + h) * HS;
                std::vector<float> m(ns), l(ns), acc((size_t)ns * HS);
                for (int sp = 0; sp < ns; sp++) {
                    const int kb = sp * S, nk = all_end - kb < S ? all_end - kb : S;
                    float sc[64], p[64];
                    for (int j = 0; j < S; j++) {
                        const int key = kb + j;
                        sc[j] = -INFINITY;
                        if (j >= nk || key > last) continue;
                        const float *kr = k + ((size_t)key * KVH + kvh) * HS;
                        float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                        for (int c = 0; c < hs4; c += 4)
                            for (int i = 0; i < 4; i++) {
                                const int d = c + i;
                                a[i] = fmaf(d < HS ? qr[d] : 0.0f, d < HS ? kr[d] : 0.0f, a[i]);
                            }
                        sc[j] = ((a[0] + a[1]) + (a[2] + a[3])) * scale;
                    }
                    float mx = -INFINITY;
                    for (int j = 0; j < S; j++) mx = fmaxf(mx, sc[j]);
                    for (int j = 0; j < S; j++)
                        p[j] = sc[j] == -INFINITY ? 0.0f : kiln_expf(sc[j] - mx);
                    float x[32], y[32];
                    for (int i = 0; i < 32; i++) x[i] = p[i] + p[i + 32];
                    for (int o = 16; o > 0; o >>= 1) {
                        for (int i = 0; i < 32; i++) y[i] = x[i] + x[i ^ o];
                        memcpy(x, y, sizeof x);
                    }
                    m[sp] = mx;
                    l[sp] = x[0];
                    for (int d = 0; d < HS; d++) {
                        float a = 0.0f;
                        for (int j = 0; j < nk; j++)
                            a = fmaf(p[j], v[((size_t)(kb + j) * KVH + kvh) * HS + d], a);
                        acc[(size_t)sp * HS + d] = a;
                    }
                }
                float M = -INFINITY, L = 0.0f;
                for (int sp = 0; sp < ns; sp++) M = fmaxf(M, m[sp]);
                std::vector<float> w(ns);
                for (int sp = 0; sp < ns; sp++) {
                    w[sp] = kiln_expf(m[sp] - M);
                    L = fmaf(w[sp], l[sp], L);
                }
                for (int d = 0; d < HS; d++) {
                    float a = 0.0f;
                    for (int sp = 0; sp < ns; sp++) a = fmaf(w[sp], acc[(size_t)sp * HS + d], a);
                    out[((size_t)n * NH + h) * HS + d] = a / L;
                }
            }
        }
}

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static float urand(float lo, float hi) { /* xorshift64*, uniform in [lo, hi] */
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    const uint64_t r = g_rng * 0x2545f4914f6cdd1dull;
    return lo + (hi - lo) * (float)((double)(r >> 40) / (double)(1ull << 24));
}
static void fill(std::vector<float> &x, float lo, float hi) {
    for (float &f : x) f = urand(lo, hi);
}

static bool same_bits(const float *a, const float *b, size_t n, size_t *first) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(a + i, b + i, 4) != 0) {
            *first = i;
            return false;
        }
    return true;
}

/* Checks that need no GPU: the reference on cases with known answers, the path switch, and
 * the validation that happens before any CUDA call. */
static void host_checks(void) {
    /* one key: out = v[0] exactly */
    {
        const int NH = 4, KVH = 2, HS = 8;
        std::vector<float> q(NH * HS), k(KVH * HS), v(KVH * HS);
        fill(q, -2, 2);
        fill(k, -2, 2);
        fill(v, -2, 2);
        std::vector<double> o(NH * HS);
        ref_row(o.data(), q.data(), k.data(), v.data(), 0, 0, NH, KVH, HS, 0.3f);
        for (int h = 0; h < NH; h++)
            for (int d = 0; d < HS; d++)
                EXPECT(o[h * HS + d] == (double)v[(h / 2) * HS + d], "one key h %d d %d", h, d);
    }
    /* q = 0: uniform weights, out = mean of v over the visible keys (causal: row n sees
     * n_past + n + 1 keys) */
    {
        const int NH = 2, KVH = 1, HS = 4, n_past = 3, N = 2, T = n_past + N;
        std::vector<float> q(N * NH * HS, 0.0f), k(T * HS), v(T * HS);
        fill(k, -2, 2);
        fill(v, -2, 2);
        for (int n = 0; n < N; n++) {
            std::vector<double> o(NH * HS);
            ref_row(o.data(), q.data(), k.data(), v.data(), n, n_past, NH, KVH, HS, 1.0f);
            for (int d = 0; d < HS; d++) {
                double mean = 0.0;
                for (int j = 0; j <= n_past + n; j++) mean += v[j * HS + d];
                mean /= n_past + n + 1;
                EXPECT(fabs(o[d] - mean) < 1e-12 && fabs(o[HS + d] - mean) < 1e-12,
                       "uniform n %d d %d: %g vs %g", n, d, o[d], mean);
            }
        }
    }
    EXPECT(!kiln_cuda_attn_fast_is_mma(8, 64) && kiln_cuda_attn_fast_is_mma(9, 64) &&
               kiln_cuda_attn_fast_is_mma(1000, 128) && !kiln_cuda_attn_fast_is_mma(100, 96),
           "path switch");
    float dummy = 0.0f;
    EXPECT(kiln_cuda_attention_fast(NULL, 0, &dummy, &dummy, &dummy, &dummy, 1, 0, 4, 2, 300,
                                    1.0f) == cudaErrorInvalidValue, "HS 300");
    EXPECT(kiln_cuda_attention_fast(NULL, 0, &dummy, &dummy, &dummy, &dummy, 1, 0, 6, 4, 64,
                                    1.0f) == cudaErrorInvalidValue, "NH %% KVH");
    EXPECT(kiln_cuda_attention_fast(NULL, 0, &dummy, &dummy, &dummy, &dummy, -1, 0, 4, 2, 64,
                                    1.0f) == cudaErrorInvalidValue, "N < 0");
    EXPECT(kiln_cuda_attention_fast(NULL, 0, &dummy, &dummy, &dummy, &dummy, 0, 0, 4, 2, 64,
                                    1.0f) == cudaSuccess, "N = 0 is a no-op");
    EXPECT(kiln_cuda_attention_decode_dev(NULL, 0, &dummy, &dummy, &dummy, &dummy, 0, 0, NULL,
                                          1, 4, 2, 64, 1.0f) == cudaSuccess, "B = 0 is a no-op");
    EXPECT(kiln_cuda_attn_reserve(NULL, 1, 1, 4, 64, 10) == cudaErrorInvalidValue, "reserve NULL");

    /* the decode's launch: grid sized by the keys (x = KVH * chunks of 16 rows * blocks of
     * 4 rows a chunk, y = 64-key splits, z = B), 256 threads, shared memory of q, K, V, p and
     * the combine's staging */
    kiln_cuda_attn_launch li;
    EXPECT(kiln_cuda_attn_decode_launch_info(1, 1, 14, 2, 64, 512, &li) == cudaSuccess &&
               li.grid[0] == 4 && li.grid[1] == 8 && li.grid[2] == 1 && li.block == 256 &&
               li.smem == 4 * (16 * 64 + 64 * 68 + 64 * 64 + 16 * 64 + 2 * 16 * 64 + 9 * 16) &&
               li.combine == 0,
           "launch Qwen ctx 512: grid (%u, %u, %u) block %u smem %zu combine %d", li.grid[0],
           li.grid[1], li.grid[2], li.block, li.smem, li.combine);
    EXPECT(kiln_cuda_attn_decode_launch_info(3, 1, 24, 8, 128, 4097, &li) == cudaSuccess &&
               li.grid[0] == 8 && li.grid[1] == 65 && li.grid[2] == 3 && li.combine == 1,
           "launch Llama max_T 4097 B 3: grid (%u, %u, %u) combine %d", li.grid[0], li.grid[1],
           li.grid[2], li.combine);
    EXPECT(kiln_cuda_attn_decode_launch_info(1, 8, 16, 1, 64, 4096, &li) == cudaSuccess &&
               li.grid[0] == 32 && li.grid[1] == 64 && li.combine == 0,
           "launch N 8 G 16: grid x %u y %u combine %d", li.grid[0], li.grid[1], li.combine);
    EXPECT(kiln_cuda_attn_decode_launch_info(1, 1, 6, 4, 64, 10, &li) == cudaErrorInvalidValue &&
               kiln_cuda_attn_decode_launch_info(1, 1, 4, 2, 64, 0, &li) ==
                   cudaErrorInvalidValue &&
               kiln_cuda_attn_decode_launch_info(1, 1, 4, 2, 64, 10, NULL) ==
                   cudaErrorInvalidValue,
           "launch info rejects bad shapes");
}

/* ---- GPU cases ---------------------------------------------------------------------------- */

struct dev_bufs {
    float *q, *k, *v, *out;
    size_t nq, nkv; /* floats allocated for q/out and for each of k, v */
};

/* Run the op into d_out (poisoned first), return the host copy. */
static std::vector<float> run_fast(kiln_cuda_attn *a, cudaStream_t s, float *d_out,
                                   const float *dq, const float *dk, const float *dv, int N,
                                   int n_past, int NH, int KVH, int HS, float scale) {
    const size_t no = (size_t)N * NH * HS;
    CUDA_OK(cudaMemsetAsync(d_out, 0xff, no * sizeof(float), s)); /* NaN bits */
    CUDA_OK(kiln_cuda_attention_fast(a, s, d_out, dq, dk, dv, N, n_past, NH, KVH, HS, scale));
    CUDA_OK(cudaStreamSynchronize(s));
    std::vector<float> h(no);
    CUDA_OK(cudaMemcpy(h.data(), d_out, no * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
}

/* One case of kiln_cuda_attention_fast; misalign offsets every pointer by one float (16-byte
 * alignment lost: the f32 kernel must take over). */
static void attention_case(kiln_cuda_attn *a, cudaStream_t s, const dev_bufs &db, int HS,
                           int NH, int KVH, int N, int n_past, bool misalign) {
    const int T = n_past + N;
    const float scale = 1.0f / sqrtf((float)HS);
    const size_t nq = (size_t)N * NH * HS, nkv = (size_t)T * KVH * HS;
    const size_t off = misalign ? 1 : 0;
    if (nq + off > db.nq || nkv + off > db.nkv) {
        g_fail++;
        fprintf(stderr, "test buffers too small for HS %d N %d n_past %d\n", HS, N, n_past);
        return;
    }
    std::vector<float> q(nq), k(nkv), v(nkv);
    fill(q, -2, 2);
    fill(k, -2, 2);
    fill(v, -2, 2);
    float maxv = 0.0f;
    for (float x : v) maxv = fmaxf(maxv, fabsf(x));
    float *dq = db.q + off, *dk = db.k + off, *dv = db.v + off, *dout = db.out + off;
    CUDA_OK(cudaMemcpy(dq, q.data(), nq * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dk, k.data(), nkv * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dv, v.data(), nkv * 4, cudaMemcpyHostToDevice));
    std::vector<float> o1 = run_fast(a, s, dout, dq, dk, dv, N, n_past, NH, KVH, HS, scale);
    std::vector<float> o2 = run_fast(a, s, dout, dq, dk, dv, N, n_past, NH, KVH, HS, scale);
    const bool mma = kiln_cuda_attn_fast_is_mma(N, HS) && !misalign;
    const double bound = (mma ? 2e-2 : 1e-5) * maxv;
    const char *path = mma ? "mma" : N <= KILN_ATTN_DECODE_MAX_N ? "split" : "f32";
    char name[160];
    snprintf(name, sizeof name, "HS %3d NH/KVH %2d/%d N %4d n_past %3d %-5s%s", HS, NH, KVH, N,
             n_past, path, misalign ? " unaligned" : "");
    g_cases++;
    size_t first;
    bool ok = true;
    if (!same_bits(o1.data(), o2.data(), nq, &first)) {
        ok = false;
        fprintf(stderr, "%s: two runs differ at %zu: %a vs %a\n", name, first, o1[first],
                o2[first]);
    }
    size_t nan_at = nq;
    for (size_t i = 0; i < nq && nan_at == nq; i++)
        if (!isfinite(o1[i])) nan_at = i;
    if (nan_at != nq) {
        ok = false;
        fprintf(stderr, "%s: element %zu (token %zu head %zu d %zu) is %f (unwritten?)\n", name,
                nan_at, nan_at / ((size_t)NH * HS), nan_at / HS % NH, nan_at % HS, o1[nan_at]);
    }
    /* the reference on every row of short cases, sampled rows of long ones */
    double worst = 0.0;
    size_t worst_i = 0;
    std::vector<double> ref((size_t)NH * HS);
    for (int n = 0; n < N; n++) {
        if (N > 64 && !(n < 8 || n >= N - 8 || n % 16 == 0)) continue;
        ref_row(ref.data(), q.data(), k.data(), v.data(), n, n_past, NH, KVH, HS, scale);
        for (size_t i = 0; i < (size_t)NH * HS; i++) {
            const size_t gi = (size_t)n * NH * HS + i;
            const double e = fabs((double)o1[gi] - ref[i]);
            if (!(e <= worst)) { /* NaN counts as worst */
                worst = isnan(e) ? INFINITY : e;
                worst_i = gi;
            }
        }
    }
    if (!(worst <= bound)) {
        ok = false;
        fprintf(stderr, "%s: worst at token %zu head %zu d %zu: gpu %.9g\n", name,
                worst_i / ((size_t)NH * HS), worst_i / HS % NH, worst_i % HS, o1[worst_i]);
    }
    /* the split decode: its defined bits, every element */
    if (N <= KILN_ATTN_DECODE_MAX_N) {
        std::vector<float> def(nq);
        split_def(def.data(), q.data(), k.data(), v.data(), N, n_past, NH, KVH, HS, scale);
        if (!same_bits(o1.data(), def.data(), nq, &first)) {
            ok = false;
            fprintf(stderr, "%s: element %zu (token %zu head %zu d %zu) %a, defined %a\n", name,
                    first, first / ((size_t)NH * HS), first / HS % NH, first % HS, o1[first],
                    def[first]);
        }
    }
    const double rel = worst / maxv;
    if (mma && rel > g_mma_worst) g_mma_worst = rel;
    if (!mma && rel > g_f32_worst) g_f32_worst = rel;
    printf("attention %s: max_err/max|v| %.2e (bound %.0e) %s\n", name, rel, mma ? 2e-2 : 1e-5,
           ok ? "OK" : "FAILED");
    if (!ok) g_fail++;
}

/* The split decode on the same inputs with q, k, v, out 16-byte aligned and one float off:
 * the aligned call copies tiles with 16-byte cp.async, the other with 4-byte ones, and that
 * must not change a bit. */
static void vec_scalar_case(kiln_cuda_attn *a, cudaStream_t s, const dev_bufs &db, int HS,
                            int NH, int KVH, int N, int n_past) {
    const int T = n_past + N;
    const float scale = 1.0f / sqrtf((float)HS);
    const size_t nq = (size_t)N * NH * HS, nkv = (size_t)T * KVH * HS;
    if (nq + 1 > db.nq || nkv + 1 > db.nkv || N > KILN_ATTN_DECODE_MAX_N) {
        g_fail++;
        fprintf(stderr, "vec_scalar_case: bad case HS %d N %d n_past %d\n", HS, N, n_past);
        return;
    }
    std::vector<float> q(nq), k(nkv), v(nkv);
    fill(q, -2, 2);
    fill(k, -2, 2);
    fill(v, -2, 2);
    std::vector<float> o[2];
    for (int off = 0; off < 2; off++) {
        CUDA_OK(cudaMemcpy(db.q + off, q.data(), nq * 4, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(db.k + off, k.data(), nkv * 4, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(db.v + off, v.data(), nkv * 4, cudaMemcpyHostToDevice));
        o[off] = run_fast(a, s, db.out + off, db.q + off, db.k + off, db.v + off, N, n_past, NH,
                          KVH, HS, scale);
    }
    size_t first = 0;
    const bool ok = same_bits(o[0].data(), o[1].data(), nq, &first);
    g_cases++;
    if (!ok) {
        g_fail++;
        fprintf(stderr, "vec_scalar HS %d N %d n_past %d: element %zu %a (aligned) vs %a\n", HS,
                N, n_past, first, o[0][first], o[1][first]);
    }
    printf("split decode HS %3d NH/KVH %2d/%d N %d n_past %4d: aligned == unaligned bits %s\n",
           HS, NH, KVH, N, n_past, ok ? "OK" : "FAILED");
}

/* decode_dev of B sequences (positions pos[0][b], caches kv_seq_stride floats apart) vs
 * kiln_cuda_attention_fast with N = 1 per sequence, bit for bit, and vs the reference; then the
 * same call captured once in a CUDA graph and replayed at the positions pos[1], pos[2], ...
 * (each replay checked: a fused-combine arrival counter left non-zero by one launch would
 * leave the next launch's outputs unwritten, i.e. NaN from the poison). */
static void decode_dev_case(kiln_cuda_attn *a, cudaStream_t s, int HS, int NH, int KVH, int B,
                            const std::vector<std::vector<int>> &pos, int max_T) {
    if (pos.size() < 2) {
        g_fail++;
        fprintf(stderr, "decode_dev_case: needs a direct and at least one replay position set\n");
        return;
    }
    for (const std::vector<int> &p : pos)
        if ((int)p.size() != B) {
            g_fail++;
            fprintf(stderr, "decode_dev_case: a position set is not B long\n");
            return;
        }
    const float scale = 1.0f / sqrtf((float)HS);
    const size_t row = (size_t)NH * HS;
    const size_t stride = (size_t)max_T * KVH * HS + 37; /* odd: sequences 1.. unaligned */
    std::vector<float> q(B * row), kv_k(B * stride), kv_v(B * stride);
    fill(q, -2, 2);
    fill(kv_k, -2, 2);
    fill(kv_v, -2, 2);
    float *dq, *dk, *dv, *dout, *dref;
    int32_t *dnp;
    CUDA_OK(cudaMalloc(&dq, q.size() * 4));
    CUDA_OK(cudaMalloc(&dk, kv_k.size() * 4));
    CUDA_OK(cudaMalloc(&dv, kv_v.size() * 4));
    CUDA_OK(cudaMalloc(&dout, B * row * 4));
    CUDA_OK(cudaMalloc(&dref, row * 4));
    CUDA_OK(cudaMalloc(&dnp, B * sizeof(int32_t)));
    CUDA_OK(cudaMemcpy(dq, q.data(), q.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dk, kv_k.data(), kv_k.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dv, kv_v.data(), kv_v.size() * 4, cudaMemcpyHostToDevice));

    /* the bits of kiln_cuda_attention_fast (N = 1) for sequence b at position np */
    auto fast_row = [&](int b, int np) {
        return run_fast(a, s, dref, dq + b * row, dk + b * stride, dv + b * stride, 1, np, NH,
                        KVH, HS, scale);
    };
    auto check = [&](const char *how, const int *np) {
        std::vector<float> got(B * row);
        CUDA_OK(cudaMemcpy(got.data(), dout, B * row * 4, cudaMemcpyDeviceToHost));
        bool ok = true;
        double worst = 0.0;
        for (int b = 0; b < B; b++) {
            std::vector<float> want = fast_row(b, np[b]);
            size_t first;
            if (!same_bits(got.data() + b * row, want.data(), row, &first)) {
                ok = false;
                fprintf(stderr, "decode_dev %s seq %d n_past %d: element %zu %a vs fast %a\n",
                        how, b, np[b], first, got[b * row + first], want[first]);
            }
            std::vector<double> ref(row);
            /* the reference reads sequence b's cache as (T, KVH, HS) at its offset */
            ref_row(ref.data(), q.data() + b * row, kv_k.data() + b * stride,
                    kv_v.data() + b * stride, 0, np[b], NH, KVH, HS, scale);
            float maxv = 0.0f;
            for (size_t i = 0; i < (size_t)(np[b] + 1) * KVH * HS; i++)
                maxv = fmaxf(maxv, fabsf(kv_v[b * stride + i]));
            for (size_t i = 0; i < row; i++) {
                const double e = fabs((double)got[b * row + i] - ref[i]) / maxv;
                if (!(e <= worst)) worst = isnan(e) ? INFINITY : e;
            }
        }
        if (worst > 1e-5) ok = false;
        if (worst > g_f32_worst) g_f32_worst = worst;
        g_cases++;
        if (!ok) g_fail++;
        printf("decode_dev %s HS %3d NH/KVH %2d/%d B %d n_past", how, HS, NH, KVH, B);
        for (int b = 0; b < B; b++) printf(" %d", np[b]);
        printf(" max_T %d: bits == fast N=1, max_err/max|v| %.2e %s\n", max_T, worst,
               ok ? "OK" : "FAILED");
    };

    CUDA_OK(kiln_cuda_attn_reserve(a, B, 1, NH, HS, max_T));
    CUDA_OK(cudaMemcpy(dnp, pos[0].data(), B * sizeof(int32_t), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemsetAsync(dout, 0xff, B * row * 4, s));
    CUDA_OK(kiln_cuda_attention_decode_dev(a, s, dout, dq, dk, dv, B, stride, dnp, max_T, NH,
                                           KVH, HS, scale));
    CUDA_OK(cudaStreamSynchronize(s));
    check("direct", pos[0].data());

    /* captured once, replayed at other positions: n_past is read on the device. The
     * workspace must not move between capture and replay: reserve covers every call below
     * (fast_row's N = 1 calls need less than B sequences over max_T keys). */
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    cudaError_t ce = kiln_cuda_attention_decode_dev(a, s, dout, dq, dk, dv, B, stride, dnp,
                                                    max_T, NH, KVH, HS, scale);
    CUDA_OK(cudaStreamEndCapture(s, &graph));
    CUDA_OK(ce);
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (size_t i = 1; i < pos.size(); i++) {
        CUDA_OK(cudaMemcpy(dnp, pos[i].data(), B * sizeof(int32_t), cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemsetAsync(dout, 0xff, B * row * 4, s));
        CUDA_OK(cudaGraphLaunch(exec, s));
        CUDA_OK(cudaStreamSynchronize(s));
        check("graph", pos[i].data());
    }

    /* a position past max_T: that sequence's outputs are NaN, the others unharmed */
    std::vector<int32_t> bad(pos.back().begin(), pos.back().end());
    bad[0] = max_T;
    CUDA_OK(cudaMemcpy(dnp, bad.data(), B * sizeof(int32_t), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemsetAsync(dout, 0, B * row * 4, s));
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    {
        std::vector<float> got(B * row);
        CUDA_OK(cudaMemcpy(got.data(), dout, B * row * 4, cudaMemcpyDeviceToHost));
        bool all_nan = true;
        for (size_t i = 0; i < row; i++) all_nan = all_nan && isnan(got[i]);
        EXPECT(all_nan, "decode_dev max_T %d: n_past = max_T must give NaN for that sequence",
               max_T);
        for (int b = 1; b < B; b++) {
            std::vector<float> want = fast_row(b, bad[b]);
            size_t first;
            EXPECT(same_bits(got.data() + b * row, want.data(), row, &first),
                   "decode_dev: seq %d next to a bad one differs at %zu", b, first);
        }
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaFree(dq));
    CUDA_OK(cudaFree(dk));
    CUDA_OK(cudaFree(dv));
    CUDA_OK(cudaFree(dout));
    CUDA_OK(cudaFree(dref));
    CUDA_OK(cudaFree(dnp));
}

int main(void) {
    host_checks();
    int ndev = 0;
    cudaError_t de = cudaGetDeviceCount(&ndev);
    if (de != cudaSuccess || ndev == 0) {
        printf("host checks: %s; no GPU (%s): skipped\n", g_fail ? "FAILED" : "OK",
               de != cudaSuccess ? cudaGetErrorString(de) : "0 devices");
        return g_fail ? 1 : 77;
    }
    CUDA_OK(cudaSetDevice(0));
    cudaStream_t s;
    CUDA_OK(cudaStreamCreate(&s));
    kiln_cuda_attn *a = NULL;
    CUDA_OK(kiln_cuda_attn_create(&a));

    /* decode_dev without a reserved workspace is refused (no allocation inside it) */
    {
        float *d;
        int32_t *np;
        CUDA_OK(cudaMalloc(&d, 64 * 4 * 4));
        CUDA_OK(cudaMalloc(&np, 4));
        EXPECT(kiln_cuda_attention_decode_dev(a, s, d, d, d, d, 1, 0, np, 10, 4, 2, 64, 1.0f) ==
                   cudaErrorInvalidValue, "decode_dev needs reserve");
        CUDA_OK(cudaFree(d));
        CUDA_OK(cudaFree(np));
    }

    dev_bufs db;
    db.nq = (size_t)1000 * 16 * 256 + 16;
    db.nkv = (size_t)40010 * 8 * 128 + 16;
    CUDA_OK(cudaMalloc(&db.q, db.nq * 4));
    CUDA_OK(cudaMalloc(&db.out, db.nq * 4));
    CUDA_OK(cudaMalloc(&db.k, db.nkv * 4));
    CUDA_OK(cudaMalloc(&db.v, db.nkv * 4));

    const int hss[] = {64, 128, 48, 96};
    const int heads[][2] = {{14, 2}, {8, 8}, {16, 4}, {8, 4}}; /* GQA ratios 7, 1, 4, 2 */
    const int ns[] = {1, 3, 8, 9, 100, 257, 1000};
    const int pasts[] = {0, 5, 300};
    for (int HS : hss)
        for (auto &hk : heads)
            for (int N : ns)
                for (int np : pasts) attention_case(a, s, db, HS, hk[0], hk[1], N, np, false);
    /* unaligned pointers: the f32 kernel instead of the tensor cores */
    attention_case(a, s, db, 64, 14, 2, 100, 5, true);
    attention_case(a, s, db, 128, 8, 4, 9, 0, true);
    /* other head sizes, up to the limit */
    attention_case(a, s, db, 80, 14, 2, 20, 5, false);
    attention_case(a, s, db, 256, 8, 4, 3, 300, false);
    attention_case(a, s, db, 256, 8, 4, 20, 5, false);
    attention_case(a, s, db, 256, 16, 1, 130, 3, false);
    /* long decode: 313 splits, more than one shared-memory chunk of the combine */
    attention_case(a, s, db, 64, 14, 2, 1, 40000, false);
    attention_case(a, s, db, 128, 8, 8, 2, 40000, false);
    /* split boundaries (64 keys): the last key at 63, 64, 127, 128, 255, 256; rows of one
     * call on both sides of a boundary (some rows one split, others two) */
    attention_case(a, s, db, 64, 14, 2, 1, 63, false);
    attention_case(a, s, db, 64, 14, 2, 1, 64, false);
    attention_case(a, s, db, 64, 14, 2, 1, 127, false);
    attention_case(a, s, db, 64, 14, 2, 1, 128, false);
    attention_case(a, s, db, 64, 14, 2, 2, 254, false);
    attention_case(a, s, db, 64, 14, 2, 8, 249, false);
    attention_case(a, s, db, 64, 14, 2, 8, 60, false);
    attention_case(a, s, db, 128, 24, 8, 3, 62, false);
    /* the most splits the fused combine takes (64: T = 4096) and one more (the combine
     * kernel) */
    attention_case(a, s, db, 128, 24, 8, 1, 4095, false);
    attention_case(a, s, db, 64, 14, 2, 2, 4094, false);
    attention_case(a, s, db, 128, 24, 8, 1, 4096, false);
    attention_case(a, s, db, 64, 14, 2, 8, 4090, false);
    /* many row chunks (G * N up to 128 rows) and head sizes that are not whole float4s */
    attention_case(a, s, db, 64, 16, 1, 8, 300, false);
    attention_case(a, s, db, 128, 32, 2, 5, 1000, false);
    attention_case(a, s, db, 50, 6, 2, 1, 0, false);
    attention_case(a, s, db, 50, 6, 2, 3, 200, false);
    attention_case(a, s, db, 7, 4, 4, 8, 130, false);
    attention_case(a, s, db, 1, 2, 1, 1, 70, false);
    attention_case(a, s, db, 256, 16, 2, 8, 700, false);
    /* unaligned decode: 4-byte copies, against the reference ... */
    attention_case(a, s, db, 64, 14, 2, 1, 300, true);
    attention_case(a, s, db, 128, 24, 8, 8, 100, true);
    /* ... and bit for bit against the aligned call */
    vec_scalar_case(a, s, db, 64, 14, 2, 1, 0);
    vec_scalar_case(a, s, db, 64, 14, 2, 1, 511);
    vec_scalar_case(a, s, db, 128, 24, 8, 1, 4095);
    vec_scalar_case(a, s, db, 128, 8, 4, 8, 5000);
    vec_scalar_case(a, s, db, 256, 8, 2, 3, 129);

    {
        /* max_T 1100: 18 splits, the combine fused into the split kernel (one split: direct
         * output; several: the last block); replays alternate between the two */
        const std::vector<std::vector<int>> p1 = {{127}, {700}, {63}, {64}, {700}, {0}};
        decode_dev_case(a, s, 64, 14, 2, 1, p1, 1100);
        const std::vector<std::vector<int>> p3 = {
            {0, 128, 1000}, {1099, 5, 256}, {63, 64, 1099}, {1099, 5, 256}};
        decode_dev_case(a, s, 64, 14, 2, 3, p3, 1100);
        decode_dev_case(a, s, 128, 16, 4, 3, p3, 1100);
        decode_dev_case(a, s, 96, 8, 8, 3, p3, 1100);
        decode_dev_case(a, s, 48, 8, 4, 1, p1, 1100);
        decode_dev_case(a, s, 50, 6, 2, 3, p3, 1100); /* HS % 4 != 0: 4-byte copies */
        decode_dev_case(a, s, 64, 16, 1, 3, p3, 1100); /* G 16: one full chunk of 16 rows */
        /* max_T 5000: 79 splits, the combine kernel; attention_fast at the same positions
         * takes the fused combine (T <= 4096) or the kernel (T > 4096): same bits */
        const std::vector<std::vector<int>> p5 = {
            {4095, 63, 4999}, {4096, 0, 2000}, {100, 4200, 4095}};
        decode_dev_case(a, s, 64, 14, 2, 3, p5, 5000);
        decode_dev_case(a, s, 128, 24, 8, 3, p5, 5000);
        const std::vector<std::vector<int>> p5b = {{4095}, {64}, {4999}};
        decode_dev_case(a, s, 128, 24, 8, 1, p5b, 5000);
    }

    kiln_cuda_attn_free(a);
    CUDA_OK(cudaFree(db.q));
    CUDA_OK(cudaFree(db.out));
    CUDA_OK(cudaFree(db.k));
    CUDA_OK(cudaFree(db.v));
    CUDA_OK(cudaStreamDestroy(s));
    printf("%d cases; worst max_err/max|v|: tensor cores %.2e (bound 2e-2), f32 %.2e (bound "
           "1e-5)\n", g_cases, g_mma_worst, g_f32_worst);
    if (g_fail) {
        printf("FAILED %d\n", g_fail);
        return 1;
    }
    printf("ALL OK\n");
    return 0;
}
