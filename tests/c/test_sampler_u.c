/*
 * test_sampler_u.c -- the hooks the device sampler uses (kiln_sampler_draw_u,
 * kiln_sampler_get_params) keep the CPU's stream, and the device sampler's algorithm
 * (src/ops/cuda/cuda_sampling.h: rank keys, a full sort of the keys, the zero-tail bound m and
 * kiln_sample_walk), run here on the host step by step as the kernels do it, draws the CPU
 * sampler's tokens: random logits with ties, +-0, -inf, +inf, all -inf, peaked and flat
 * distributions, every parameter combination, sequences of 20 draws per seed.
 */
#define KILN_CUDA_SAMPLING_WALK_ONLY
#include "ops/cuda/cuda_sampling.h"

#include "base/base.h"
#include "generate/sampler.h"
#include "test_util.h"

#include <math.h>

static uint64_t rng_state;
static uint32_t rnd(void) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng_state >> 33);
}
static float rnd_unit(void) { return (float)(rnd() & 0xffffff) / 16777216.0f; }

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* The device sampler's steps on the host (cuda_sampling.cu's kernels, in order). */
static int32_t model_sample(const kiln_sampler_params *p, const float *logits, int V,
                            const int32_t *hist, int n_hist, float u) {
    float *v = malloc((size_t)V * sizeof *v), *l = malloc((size_t)V * sizeof *l);
    float *q = calloc((size_t)V, sizeof *q);
    uint8_t *marks = calloc((size_t)V, 1);
    uint64_t *keys = malloc((size_t)V * sizeof *keys);
    int32_t out = -1;
    int start = n_hist;
    if (p->repeat_penalty != 1.0f && n_hist > 0) {
        start = 0;
        if (p->repeat_last_n >= 0 && n_hist > p->repeat_last_n) start = n_hist - p->repeat_last_n;
    }
    for (int j = start; j < n_hist; j++)
        if (hist[j] >= 0 && hist[j] < V) marks[hist[j]] = 1;
    int nan = 0, greedy = p->temperature <= 0.0f, id_bits = kiln_sample_id_bits(V);
    uint64_t best = ~0ull;
    for (int i = 0; i < V; i++) {
        v[i] = logits[i];
        if (marks[i]) v[i] = v[i] > 0.0f ? v[i] / p->repeat_penalty : v[i] * p->repeat_penalty;
        if (v[i] != v[i]) nan = 1;
        if (greedy) {
            uint64_t k = kiln_sample_key(v[i], i, 32);
            if (k < best) best = k;
        } else {
            l[i] = v[i] / p->temperature;
            keys[i] = kiln_sample_key(l[i], i, id_bits);
        }
    }
    if (nan) goto done;
    if (greedy) {
        out = (int32_t)(best & 0xffffffffu);
        goto done;
    }
    qsort(keys, (size_t)V, sizeof *keys, cmp_u64);
    uint64_t mask = ((uint64_t)1 << id_bits) - 1;
    int n = (p->top_k > 0 && p->top_k < V) ? p->top_k : V;
    float mx = l[keys[0] & mask];
    int m = n;
    if (mx - mx == 0.0f) {
        int lo = 1, hi = n;
        while (lo < hi) {
            int mid = lo + (hi - lo) / 2;
            if (l[keys[mid] & mask] - mx < KILN_EXP_LO) hi = mid;
            else lo = mid + 1;
        }
        m = lo;
        /* the bound's claim: every later rank's kiln_expf is +0 */
        for (int i = m; i < n; i++) CHECK(kiln_f32_bits(kiln_expf(l[keys[i] & mask] - mx)) == 0);
    }
    for (int i = 0; i < m; i++) q[i] = kiln_expf(l[keys[i] & mask] - mx);
    float sum = kiln_sample_seq_sum(q, m);
    for (int i = 0; i < m; i++) q[i] = q[i] / sum;
    int pick = kiln_sample_walk(q, m, n, p->top_p, p->min_p, u);
    CHECK(pick >= 0 && pick < n);
    out = (int32_t)(keys[pick] & mask);
done:
    free(v);
    free(l);
    free(q);
    free(marks);
    free(keys);
    return out;
}

enum { PAT_NORMAL, PAT_TIES, PAT_PEAKED, PAT_ZEROS, PAT_POSINF, PAT_ALLNEGINF, PAT_COUNT };
static const char *pat_name[PAT_COUNT] = {"normal", "ties", "peaked", "signed-zeros", "+inf", "all-inf"};

static void fill(float *x, int V, int pat) {
    for (int i = 0; i < V; i++) {
        float g = (rnd_unit() + rnd_unit() + rnd_unit() - 1.5f) * 4.0f;
        switch (pat) {
        case PAT_NORMAL: x[i] = g; break;
        case PAT_TIES: x[i] = (rnd() % 10 == 0) ? -INFINITY : floorf(g); break; /* few values */
        case PAT_PEAKED: x[i] = g * 60.0f; break;   /* most ranks have kiln_expf == 0 */
        case PAT_ZEROS: x[i] = (rnd() % 3 == 0) ? ((rnd() & 1) ? -0.0f : 0.0f) : (float)(int)(g * 0.5f); break;
        case PAT_POSINF: x[i] = (rnd() % 50 == 0) ? INFINITY : g; break;
        default: x[i] = -INFINITY; break;
        }
    }
}

int main(void) {
    /* 1. the u stream: draw_u is the CPU's draw (two samplers, same seed, same tokens) */
    {
        kiln_sampler_params p = kiln_sampler_default_params();
        p.seed = 1234;
        p.top_k = 0;
        p.top_p = 1.0f;
        p.min_p = 0.0f;
        p.temperature = 1.0f;
        kiln_sampler *a = NULL, *b = NULL;
        CHECK(kiln_sampler_create(&p, &a) == KILN_OK);
        CHECK(kiln_sampler_create(&p, &b) == KILN_OK);
        CHECK(kiln_sampler_get_params(a)->seed == 1234 && kiln_sampler_get_params(a)->top_k == 0);
        /* two equal logits: token 0 iff u * 2 < 1 (p = 0.5 each), so the CPU's tokens reveal
         * its u stream's top bit; and a draw_u between samples shifts the stream by one */
        float two[2] = {0.0f, 0.0f};
        for (int t = 0; t < 200; t++) {
            int32_t id = -1;
            CHECK(kiln_sampler_sample(a, two, 2, NULL, 0, &id) == KILN_OK);
            float u = kiln_sampler_draw_u(b);
            CHECK(u >= 0.0f && u < 1.0f);
            CHECK_MSG(id == (u * 1.0f < 0.5f ? 0 : 1), "t %d id %d u %.9g", t, id, (double)u);
        }
        kiln_sampler_free(a);
        kiln_sampler_free(b);
    }
    /* 2. the device algorithm equals the CPU sampler */
    static const int Vs[] = {1, 7, 300, 2003};
    static const float temps[] = {0.0f, 0.7f, 1.0f, 1.5f};
    static const int topks[] = {0, 1, 40, 1000};
    static const float topps[] = {1.0f, 0.9f, 0.5f};
    static const float minps[] = {0.0f, 0.05f};
    static const float pens[] = {1.0f, 1.3f};
    int cases = 0, draws = 0, bad_cases = 0;
    rng_state = 42;
    for (size_t vi = 0; vi < sizeof Vs / sizeof *Vs; vi++) {
        int V = Vs[vi];
        float *x = malloc((size_t)V * sizeof *x);
        for (int pat = 0; pat < PAT_COUNT; pat++) {
            fill(x, V, pat);
            int combo = 0;
            for (size_t ti = 0; ti < 4; ti++)
                for (size_t ki = 0; ki < 4; ki++)
                    for (size_t pi = 0; pi < 3; pi++)
                        for (size_t mi = 0; mi < 2; mi++)
                            for (size_t ri = 0; ri < 2; ri++, combo++) {
                                if (temps[ti] <= 0.0f && (ki || pi || mi)) continue; /* greedy ignores them */
                                kiln_sampler_params p = kiln_sampler_default_params();
                                p.temperature = temps[ti];
                                p.top_k = topks[ki];
                                p.top_p = topps[pi];
                                p.min_p = minps[mi];
                                p.repeat_penalty = pens[ri];
                                p.repeat_last_n = (combo & 1) ? -1 : 64;
                                int n_seeds = V <= 300 ? 2 : 1;
                                int case_bad = 0;
                                for (int si = 0; si < n_seeds; si++) {
                                    p.seed = (uint64_t)(1 + (combo * n_seeds + si) % 50);
                                    kiln_sampler *cpu = NULL, *dev = NULL;
                                    CHECK(kiln_sampler_create(&p, &cpu) == KILN_OK);
                                    CHECK(kiln_sampler_create(&p, &dev) == KILN_OK);
                                    int32_t hist[64 + 20];
                                    int nh = 64;
                                    for (int j = 0; j < nh; j++) hist[j] = (int32_t)(rnd() % (uint32_t)(V + 2)) - 1;
                                    for (int t = 0; t < 20; t++) {
                                        int32_t a = -7;
                                        kiln_status st = kiln_sampler_sample(cpu, x, V, hist, (size_t)nh, &a);
                                        const kiln_sampler_params *dp = kiln_sampler_get_params(dev);
                                        float u = dp->temperature > 0.0f ? kiln_sampler_draw_u(dev) : 0.0f;
                                        int32_t b = model_sample(dp, x, V, hist, nh, u);
                                        if (st != KILN_OK) a = -1;
                                        draws++;
                                        if (a != b) {
                                            if (!case_bad)
                                                fprintf(stderr, "V %d %s T %g k %d p %g minp %g pen %g seed %llu draw %d: cpu %d model %d\n",
                                                        V, pat_name[pat], (double)p.temperature, p.top_k, (double)p.top_p,
                                                        (double)p.min_p, (double)p.repeat_penalty,
                                                        (unsigned long long)p.seed, t, a, b);
                                            case_bad = 1;
                                        }
                                        hist[nh++] = a >= 0 ? a : 0;
                                    }
                                    kiln_sampler_free(cpu);
                                    kiln_sampler_free(dev);
                                }
                                cases++;
                                bad_cases += case_bad;
                            }
        }
        free(x);
    }
    CHECK(bad_cases == 0);
    printf("device-sampler model vs CPU sampler: %d cases, %d draws, %d mismatching cases\n", cases,
           draws, bad_cases);
    printf("%d checks, %d failures\n", t_checks, t_failures);
    return t_failures ? 1 : 0;
}
