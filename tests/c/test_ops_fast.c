/*
 * test_ops_fast.c -- the fast mode's int8-activation matmul (docs/ARITHMETIC.md, "Fast mode:
 * 8-bit activations"):
 *   - the AVX2 kernels equal the portable reference bit for bit (Q8_0, Q4_0, Q4_1; odd row
 *     counts, block counts that are not multiples of 8, N = 1..8, with and without bias,
 *     non-finite and tiny activation blocks, extreme weight bytes);
 *   - the quantization: |q| <= 127, |x - q*d| <= d/2 (+ rounding), sums;
 *   - the backend in fast mode: identical bits for 1, 2, 3 threads and both SIMD paths,
 *     exact mode untouched, N > 8 and unsupported types take the exact path;
 *   - the error against the exact f32 path on random data: relative L2 < 1e-2.
 */
#include "base/cpu_features.h"
#include "base/tensor.h"
#include "ops/cpu/cpu_kernels.h"
#include "ops/cpu/kernels_q8act.h"
#include "ops/ops.h"
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

static const kiln_dtype k_types[] = {KILN_DTYPE_Q8_0, KILN_DTYPE_Q4_0, KILN_DTYPE_Q4_1};

/* Random blocks of type dt with f16 scales in [-scale, scale] (Q4_1's m too). */
static uint8_t *make_weights(kiln_dtype dt, int64_t R, int64_t C, float scale, size_t *nbytes) {
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(dt);
    size_t nblk = (size_t)(R * C / 32), nb = nblk * (size_t)tr->type_size;
    uint8_t *w = malloc(nb);
    for (size_t i = 0; i < nb; i++) w[i] = (uint8_t)rnd_u64();
    for (size_t b = 0; b < nblk; b++) {
        uint16_t h[2] = {kiln_fp32_to_fp16(rnd_f(-scale, scale)),
                         kiln_fp32_to_fp16(rnd_f(-scale, scale))};
        memcpy(w + b * (size_t)tr->type_size, h, dt == KILN_DTYPE_Q4_1 ? 4 : 2);
    }
    *nbytes = nb;
    return w;
}

static void run_kernels(const kiln_q8act_kernels *k, kiln_dtype dt, const uint8_t *w,
                        int64_t R, int64_t C, const float *x, int N, const float *bias,
                        float *out) {
    size_t nbytes = kiln_q8act_bytes(N, C);
    void *buf = malloc(nbytes);
    kiln_q8act xa;
    kiln_q8act_init(&xa, buf, N, C);
    k->quantize(&xa, x, C);
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(dt);
    kiln_q8act_mm m = {&xa, w, (size_t)(C / 32) * (size_t)tr->type_size, dt, bias, out, R};
    /* two calls over a split row range: the split must not matter */
    int64_t mid = R / 3;
    k->rows(&m, 0, mid);
    k->rows(&m, mid, R);
    free(buf);
}

/* ---- AVX2 == portable ---------------------------------------------------------------------- */

static void test_avx2_equals_portable(void) {
#if defined(__x86_64__)
    if (!kiln_cpu_path_supported(KILN_CPU_PATH_AVX2)) {
        printf("  (no AVX2: AVX2 kernels not tested)\n");
        return;
    }
    const int64_t Cs[] = {32, 96, 256, 288, 576, 1536};
    const int64_t Rs[] = {1, 3, 7, 13};
    for (int ti = 0; ti < 3; ti++)
        for (int ci = 0; ci < 6; ci++)
            for (int ri = 0; ri < 4; ri++)
                for (int ni = 0; ni < 6; ni++) {
                    /* 17 and 35: tiles of 16 tokens and a short last one (the AVX2 rows pass) */
                    static const int Ns[] = {1, 2, 3, 8, 17, 35};
                    const int N = Ns[ni];
                    kiln_dtype dt = k_types[ti];
                    int64_t C = Cs[ci], R = Rs[ri];
                    size_t nb;
                    uint8_t *w = make_weights(dt, R, C, 0.1f, &nb);
                    float *x = malloc(sizeof(float) * (size_t)(N * C));
                    for (int64_t i = 0; i < N * C; i++) x[i] = rnd_f(-3, 3);
                    /* special activation blocks: a zero block, a tiny one, one with a huge
                     * value, exact halves (ties), one with inf, one with NaN */
                    if (C >= 96 && N >= 2) {
                        for (int i = 0; i < 32; i++) x[i] = 0.0f;
                        for (int i = 32; i < 64; i++) x[i] = 1e-30f * (float)(i - 40);
                        for (int i = 64; i < 96; i++) x[i] = (float)(i - 80) * 0.5f;
                        x[C + 5] = INFINITY;
                        x[C + 40] = 3e38f;
                        if (C >= 288) x[C + 200] = NAN;
                    }
                    float *bias = malloc(sizeof(float) * (size_t)R);
                    for (int64_t r = 0; r < R; r++) bias[r] = rnd_f(-1, 1);
                    float *o1 = malloc(sizeof(float) * (size_t)(N * R));
                    float *o2 = malloc(sizeof(float) * (size_t)(N * R));
                    for (int b = 0; b < 2; b++) {
                        const float *bb = b ? bias : NULL;
                        run_kernels(&kiln_q8act_kernels_portable, dt, w, R, C, x, N, bb, o1);
                        run_kernels(&kiln_q8act_kernels_avx2, dt, w, R, C, x, N, bb, o2);
                        char what[96];
                        snprintf(what, sizeof what, "%s R=%lld C=%lld N=%d bias=%d",
                                 kiln_dtype_name(dt), (long long)R, (long long)C, N, b);
                        CHECK_MSG(same_bits(o1, o2, (size_t)(N * R), what), "%s", what);
                        if (kiln_cpu_get_features()->avx512vnni && kiln_cpu_path_supported(KILN_CPU_PATH_AVX512)) {
                            run_kernels(&kiln_q8act_kernels_vnni, dt, w, R, C, x, N, bb, o2);
                            CHECK_MSG(same_bits(o1, o2, (size_t)(N * R), what), "vnni %s", what);
                        }
                    }
                    free(w), free(x), free(bias), free(o1), free(o2);
                }
    /* the quantized activations themselves agree too */
    int64_t C = 4096;
    float *x = malloc(sizeof(float) * (size_t)C);
    for (int64_t i = 0; i < C; i++) x[i] = rnd_f(-1, 1) * powf(10.0f, rnd_f(-6, 6));
    for (int i = 0; i < 32; i++) x[64 + i] = (float)(i - 16) * (1.0f / 127.0f) * 3.0f;
    void *b1 = malloc(kiln_q8act_bytes(1, C)), *b2 = malloc(kiln_q8act_bytes(1, C));
    kiln_q8act q1, q2;
    kiln_q8act_init(&q1, b1, 1, C);
    kiln_q8act_init(&q2, b2, 1, C);
    kiln_q8act_kernels_portable.quantize(&q1, x, C);
    kiln_q8act_kernels_avx2.quantize(&q2, x, C);
    CHECK(memcmp(b1, b2, kiln_q8act_bytes(1, C)) == 0);
    free(x), free(b1), free(b2);
#endif
}

/* ---- quantization properties ---------------------------------------------------------------- */

static void test_quantize(void) {
    int64_t C = 32 * 40;
    float *x = malloc(sizeof(float) * (size_t)C);
    for (int64_t i = 0; i < C; i++) x[i] = rnd_f(-1, 1) * powf(10.0f, (float)(i / 32 % 9) - 4);
    void *buf = malloc(kiln_q8act_bytes(1, C));
    kiln_q8act xa;
    kiln_q8act_init(&xa, buf, 1, C);
    CHECK(xa.nb == 40 && xa.nbp == 40);
    kiln_q8act_kernels_portable.quantize(&xa, x, C);
    int ok = 1;
    for (int64_t b = 0; b < xa.nb; b++) {
        float amax = 0;
        int32_t s = 0;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[b * 32 + i]));
        ok &= xa.d[b] == amax / 127.0f;
        for (int i = 0; i < 32; i++) {
            int q = xa.q[b * 32 + i];
            s += q;
            ok &= q >= -127 && q <= 127;
            /* round to nearest: within half a step (plus the rounding of 127 / amax) */
            ok &= fabs((double)x[b * 32 + i] - (double)q * xa.d[b]) <= 0.5001 * xa.d[b];
        }
        ok &= s == xa.sum[b] && xa.s[b] == xa.d[b] * (float)s;
        /* the largest magnitude maps to +-127 */
        int hit = 0;
        for (int i = 0; i < 32; i++) hit |= abs(xa.q[b * 32 + i]) == 127;
        ok &= hit;
    }
    CHECK(ok);
    free(buf);
    /* padding blocks: C = 96 gives 3 blocks, padded to 8 */
    buf = malloc(kiln_q8act_bytes(2, 96));
    kiln_q8act_init(&xa, buf, 2, 96);
    CHECK(xa.nb == 3 && xa.nbp == 8);
    kiln_q8act_kernels_portable.quantize(&xa, x, 96);
    for (int t = 0; t < 2; t++)
        for (int b = 3; b < 8; b++) CHECK(xa.d[t * 8 + b] == 0.0f && xa.sum[t * 8 + b] == 0);
    free(buf);
    free(x);
    CHECK(kiln_q8act_bytes(1, 576) == 24 * 44);
}

/* ---- the backend: fast mode, threads, paths, error vs exact --------------------------------- */

static void test_backend(void) {
    kiln_backend *fast[6] = {0}, *exact = NULL, *exact_ref = NULL;
    int n_fast = 0;
    const kiln_cpu_path paths[] = {KILN_CPU_PATH_PORTABLE, KILN_CPU_PATH_AVX2};
    for (int p = 0; p < 2; p++) {
        if (!kiln_cpu_path_supported(paths[p])) continue;
        setenv("KILN_CPU_PATH", kiln_cpu_path_name(paths[p]), 1);
        for (int th = 1; th <= 3; th++) {
            kiln_backend *be = NULL;
            CHECK(kiln_backend_cpu_create_mode(th, 1, &be) == KILN_OK);
            if (be) fast[n_fast++] = be;
        }
    }
    unsetenv("KILN_CPU_PATH");
    CHECK(kiln_backend_cpu_create_mode(2, 0, &exact) == KILN_OK);
    CHECK(kiln_backend_cpu_create(1, &exact_ref) == KILN_OK);
    kiln_backend *bad = NULL;
    CHECK_ERR(kiln_backend_cpu_create_mode(-1, 1, &bad), KILN_ERR_INVALID_ARG, "n_threads");
    CHECK(bad == NULL);

    /* SmolLM2-like shapes; activations uniform in [-1, 1] (error bound 1e-2: one step is
     * amax/127, so the expected relative error is about 0.4%), or with every 97th channel
     * 20x larger, as hidden states have a few large channels (bound 4e-2: a third of the
     * blocks then have a step 20x coarser; about 1.1% measured) */
    const int64_t shapes[][2] = {{576, 576}, {1536, 576}, {576, 1536}, {1001, 96}};
    for (int outl = 0; outl < 2; outl++)
    for (int ti = 0; ti < 3; ti++)
        for (int si = 0; si < 4; si++) {
            kiln_dtype dt = k_types[ti];
            int64_t R = shapes[si][0], C = shapes[si][1];
            const int Ns[] = {1, 3, 8, 9, 40};
            for (int ni = 0; ni < 5; ni++) {
                int N = Ns[ni];
                size_t nb;
                uint8_t *w = make_weights(dt, R, C, 0.02f, &nb);
                float *x = malloc(sizeof(float) * (size_t)(N * C));
                for (int64_t i = 0; i < N * C; i++)
                    x[i] = rnd_f(-1, 1) * (outl && i % 97 == 0 ? 20.0f : 1.0f);
                float *bias = malloc(sizeof(float) * (size_t)R);
                for (int64_t r = 0; r < R; r++) bias[r] = rnd_f(-0.1f, 0.1f);
                kiln_tensor W = {"w", dt, 2, {R, C, 1, 1}, w, nb};
                size_t no = (size_t)(N * R);
                float *ref = malloc(no * sizeof(float)), *o = malloc(no * sizeof(float));
                float *ex = malloc(no * sizeof(float)), *ex1 = malloc(no * sizeof(float));
                for (int b = 0; b < n_fast; b++) {
                    for (size_t i = 0; i < no; i++) o[i] = NAN;
                    fast[b]->i->matmul(fast[b], o, x, &W, bias, N);
                    if (b == 0) memcpy(ref, o, no * sizeof(float));
                    else CHECK_MSG(same_bits(ref, o, no, "fast backends"),
                                   "%s R=%lld C=%lld N=%d backend %d", kiln_dtype_name(dt),
                                   (long long)R, (long long)C, N, b);
                }
                exact->i->matmul(exact, ex, x, &W, bias, N);
                exact_ref->i->matmul(exact_ref, ex1, x, &W, bias, N);
                CHECK(same_bits(ex, ex1, no, "exact mode"));
                {
                    /* every N takes the int8 path, and each token's outputs are the bits it
                     * gets alone (batch invariance: a decode token among 39 others) */
                    size_t alone = 0;
                    for (int t = 0; t < N; t++) {
                        float *one = malloc((size_t)R * sizeof(float));
                        fast[0]->i->matmul(fast[0], one, x + (size_t)t * (size_t)C, &W, bias, 1);
                        alone += memcmp(one, ref + (size_t)t * (size_t)R, (size_t)R * sizeof(float)) != 0;
                        free(one);
                    }
                    CHECK_MSG(alone == 0, "%s R=%lld C=%lld N=%d: %zu tokens differ from their product alone",
                              kiln_dtype_name(dt), (long long)R, (long long)C, N, alone);
                    double num = 0, den = 0, maxabs = 0;
                    for (size_t i = 0; i < no; i++) {
                        double e = (double)ref[i] - (double)ex[i];
                        num += e * e;
                        den += (double)ex[i] * ex[i];
                        maxabs = fabs(e) > maxabs ? fabs(e) : maxabs;
                    }
                    double rel = sqrt(num / den);
                    if (si == 0 && N == 1)
                        printf("  %s 576x576 N=1%s: relative L2 error %.3g, max abs %.3g\n",
                               kiln_dtype_name(dt), outl ? " (outlier channels)" : "", rel,
                               maxabs);
                    CHECK_MSG(rel < (outl ? 4e-2 : 1e-2),
                              "%s R=%lld C=%lld N=%d outliers=%d: relative L2 error %g",
                              kiln_dtype_name(dt), (long long)R, (long long)C, N, outl, rel);
                    /* and it is not the exact path */
                    CHECK(memcmp(ref, ex, no * sizeof(float)) != 0);
                }
                free(w), free(x), free(bias), free(ref), free(o), free(ex), free(ex1);
            }
        }
    /* unsupported weight types (f32 here) take the exact path in fast mode */
    {
        int64_t R = 37, C = 64;
        float *wf = malloc(sizeof(float) * (size_t)(R * C)), *x = malloc(sizeof(float) * (size_t)C);
        for (int64_t i = 0; i < R * C; i++) wf[i] = rnd_f(-1, 1);
        for (int64_t i = 0; i < C; i++) x[i] = rnd_f(-1, 1);
        kiln_tensor W = {"w", KILN_DTYPE_F32, 2, {R, C, 1, 1}, wf, sizeof(float) * (size_t)(R * C)};
        float o1[37], o2[37];
        fast[0]->i->matmul(fast[0], o1, x, &W, NULL, 1);
        exact->i->matmul(exact, o2, x, &W, NULL, 1);
        CHECK(same_bits(o1, o2, 37, "f32 in fast mode"));
        free(wf), free(x);
    }
    for (int b = 0; b < n_fast; b++) kiln_backend_free(fast[b]);
    kiln_backend_free(exact);
    kiln_backend_free(exact_ref);
}

int main(void) {
    test_quantize();
    test_avx2_equals_portable();
    test_backend();
    return test_finish("test_ops_fast");
}
