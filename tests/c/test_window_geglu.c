/*
 * test_window_geglu.c -- the CPU backend's GeGLU and sliding-window attention_paged against
 * float64 references: geglu(g, u) = gelu_tanh(g) * u; with window W a token at position p
 * attends to positions p - W < j <= p (W keys, its own included), whatever the layout of its
 * cache blocks; with p < W it gives the bits of no window.
 */
#include "base/kmath.h"
#include "ops/ops.h"
#include "test_util.h"

#include <math.h>

static uint64_t g_rng = 12345;
static float rnd(void) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(g_rng >> 11) * 0x1p-53 * 2.0 - 1.0);
}

static void test_geglu(kiln_backend *be) {
    enum { n = 4099 };
    static float g[n], u[n], out[n];
    for (int i = 0; i < n; i++) {
        g[i] = 12.0f * rnd();
        u[i] = rnd();
    }
    g[0] = 0.0f, g[1] = -0.0f, g[2] = 1e-6f, g[3] = -40.0f, g[4] = 40.0f, g[5] = 0.0624f;
    be->i->geglu(be, out, g, u, n);
    double worst = 0;
    for (int i = 0; i < n; i++) {
        double x = g[i], want = 0.5 * x * (1.0 + tanh(sqrt(2.0 / 3.14159265358979323846) * (x + 0.044715 * x * x * x))) * u[i];
        /* relative to |x u|: where tanh is near -1, 1 + tanh cancels in f32 (as in PyTorch's
         * own f32 formula), so the error is one of x u's ulps, not of the result's */
        double err = fabs(out[i] - want) / (fabs(x * u[i]) + 1e-30);
        if (err > worst) worst = err;
        CHECK(memcmp(&out[i], &(float){kiln_geglu(g[i], u[i])}, 4) == 0);
    }
    CHECK_MSG(worst < 2e-6, "geglu: worst error relative to |x u| %.3g", worst);
    be->i->geglu(be, g, g, u, n); /* out may alias gate */
    CHECK(memcmp(g, out, sizeof out) == 0);
}

/* One sequence of T positions in a paged pool with shuffled blocks; every token's windowed
 * attention against float64. */
static void test_window(kiln_backend *be, int W, int T, int NH, int KVH, int HS) {
    const int bs = 64, mb = (T + bs - 1) / bs, KD = KVH * HS, QD = NH * HS;
    int32_t *table = malloc(sizeof(int32_t) * (size_t)mb);
    for (int b = 0; b < mb; b++) table[b] = (b * 5 + 3) % mb; /* a permutation (5 coprime to mb) */
    if (mb % 5 == 0)
        for (int b = 0; b < mb; b++) table[b] = mb - 1 - b;
    float *kp = malloc(sizeof(float) * (size_t)mb * bs * KD), *vp = malloc(sizeof(float) * (size_t)mb * bs * KD);
    float *q = malloc(sizeof(float) * (size_t)T * QD), *out = malloc(sizeof(float) * (size_t)T * QD);
    float *full = malloc(sizeof(float) * (size_t)T * QD);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)T), *seq = calloc((size_t)T, sizeof(int32_t));
    for (size_t i = 0; i < (size_t)mb * bs * KD; i++) kp[i] = 2.0f * rnd(), vp[i] = rnd();
    for (size_t i = 0; i < (size_t)T * QD; i++) q[i] = 2.0f * rnd();
    for (int t = 0; t < T; t++) pos[t] = t;
    kiln_kv_pages pg = {bs, mb, table, table};
    const float scale = 1.0f / sqrtf((float)HS);
    be->i->attention_paged(be, out, q, kp, vp, &pg, seq, pos, NULL, 0, T, T, NH, KVH, HS, scale, W);
    be->i->attention_paged(be, full, q, kp, vp, &pg, seq, pos, NULL, 0, T, T, NH, KVH, HS, scale, 0);
    double worst = 0;
    int same_early = 1;
    for (int t = 0; t < T; t++) {
        if (t < W) same_early &= memcmp(out + (size_t)t * QD, full + (size_t)t * QD, sizeof(float) * QD) == 0;
        for (int h = 0; h < NH; h++) {
            const int kvh = h / (NH / KVH), lo = t - W + 1 > 0 ? t - W + 1 : 0;
            double m = -INFINITY, l = 0, acc[256] = {0};
            for (int j = lo; j <= t; j++) {
                const int64_t row = (int64_t)table[j / bs] * bs + j % bs;
                double s = 0;
                for (int d = 0; d < HS; d++) s += (double)q[(size_t)t * QD + h * HS + d] * kp[row * KD + kvh * HS + d];
                s *= scale;
                if (s > m) m = s;
            }
            for (int j = lo; j <= t; j++) {
                const int64_t row = (int64_t)table[j / bs] * bs + j % bs;
                double s = 0;
                for (int d = 0; d < HS; d++) s += (double)q[(size_t)t * QD + h * HS + d] * kp[row * KD + kvh * HS + d];
                const double p = exp(s * scale - m);
                l += p;
                for (int d = 0; d < HS; d++) acc[d] += p * vp[row * KD + kvh * HS + d];
            }
            for (int d = 0; d < HS; d++) {
                double err = fabs(out[(size_t)t * QD + h * HS + d] - acc[d] / l);
                if (err > worst) worst = err;
            }
        }
    }
    CHECK_MSG(worst < 1e-5, "window %d, T %d: worst error %.3g", W, T, worst);
    CHECK_MSG(same_early, "window %d: tokens before the window's length differ from no window", W);
    free(table), free(kp), free(vp), free(q), free(out), free(full), free(pos), free(seq);
}

int main(void) {
    kiln_backend *be = NULL;
    CHECK(kiln_backend_cpu_create(3, &be) == KILN_OK);
    test_geglu(be);
    test_window(be, 8, 150, 4, 2, 16);
    test_window(be, 64, 200, 4, 1, 32);
    test_window(be, 100, 260, 2, 2, 24);
    test_window(be, 1, 70, 2, 1, 16);
    test_window(be, 300, 200, 2, 1, 16); /* wider than the sequence: no window */
    kiln_backend_free(be);
    return test_finish("test_window_geglu");
}
