/*
 * test_cuda_sampling.cu -- the device sampler (src/ops/cuda/cuda_sampling.h) draws the CPU
 * sampler's tokens: for V = 1000, 32000, 151936, logits with ties, +-0, -inf, +inf, all -inf,
 * peaked and flat distributions, greedy and temperature 0.7/1.0/1.5 x top_k 0/1/40/1000 x
 * top_p 1/0.9/0.5 x min_p 0/0.05 x penalty 1/1.3 (a history of 64 ids, some repeated or out
 * of range, window 64 or the whole history), seeds 1..50, sequences of 20 draws: each id equal
 * to kiln_sampler_sample's for the same seed (the CPU sampler through its real API, and a
 * second kiln_sampler with the same seed feeding the device its u via kiln_cuda_sample_next).
 * Also: u by device pointer, a captured CUDA graph replayed with new u, NaN logits (-1, and
 * the penalty marks left clean), argument refusals, and the time per call.
 *
 * Usage: test_cuda_sampling [--quick]   (--quick: V = 1000 only). Exit 77 without a GPU.
 */
#include "ops/cuda/cuda_sampling.h"

#include "generate/sampler.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu_test_cuda_check.h"

static int g_fail = 0;

static uint64_t rng_state = 42;
static uint32_t rnd(void) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng_state >> 33);
}
static float rnd_unit(void) { return (float)(rnd() & 0xffffff) / 16777216.0f; }

enum { PAT_NORMAL, PAT_TIES, PAT_PEAKED, PAT_ZEROS, PAT_POSINF, PAT_ALLNEGINF, PAT_COUNT };
static const char *pat_name[PAT_COUNT] = {"normal", "ties", "peaked", "signed-zeros", "+inf", "all-inf"};

static void fill(float *x, int V, int pat) {
    for (int i = 0; i < V; i++) {
        float g = (rnd_unit() + rnd_unit() + rnd_unit() - 1.5f) * 4.0f;
        switch (pat) {
        case PAT_NORMAL: x[i] = g; break;
        case PAT_TIES: x[i] = (rnd() % 10 == 0) ? -INFINITY : floorf(g); break; /* few values */
        case PAT_PEAKED: x[i] = g * 60.0f; break; /* most ranks have kiln_expf == 0 */
        case PAT_ZEROS:
            x[i] = (rnd() % 3 == 0) ? ((rnd() & 1) ? -0.0f : 0.0f) : (float)(int)(g * 0.5f);
            break;
        case PAT_POSINF: x[i] = (rnd() % 50 == 0) ? INFINITY : g; break;
        default: x[i] = -INFINITY; break;
        }
    }
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct dev_bufs {
    kiln_cuda_sampler *sp;
    cudaStream_t s;
    float *logits;   /* (VMAX) */
    int32_t *hist;   /* (HMAX) */
    int32_t *token;  /* (1) */
    float *u;        /* (1) */
    int32_t *h_token; /* (1) pinned */
} dev_bufs;

#define VMAX 151936
#define HMAX (64 + 20)

static kiln_sampler_params make_params(float T, int k, float tp, float mp, float pen, int last_n,
                                       uint64_t seed) {
    kiln_sampler_params p = kiln_sampler_default_params();
    p.temperature = T;
    p.top_k = k;
    p.top_p = tp;
    p.min_p = mp;
    p.repeat_penalty = pen;
    p.repeat_last_n = last_n;
    p.seed = seed;
    return p;
}

/* One sequence of 20 draws: CPU sampler vs device sampler (each with its own kiln_sampler of
 * the same seed). The CPU's token is appended to the history of both. Returns 1 if all equal. */
static int run_sequence(dev_bufs *d, const float *x, int V, const kiln_sampler_params *p,
                        const char *label, int *n_draws) {
    kiln_sampler *cpu = NULL, *dev = NULL;
    if (kiln_sampler_create(p, &cpu) != KILN_OK || kiln_sampler_create(p, &dev) != KILN_OK) {
        fprintf(stderr, "%s: kiln_sampler_create failed\n", label);
        exit(1);
    }
    int32_t hist[HMAX];
    int nh = 64;
    for (int j = 0; j < nh; j++) hist[j] = (int32_t)(rnd() % (uint32_t)(V + 2)) - 1; /* -1, V too */
    for (int j = 8; j < 16; j++) hist[j] = hist[j - 8];                             /* repeats */
    int ok = 1;
    for (int t = 0; t < 20; t++) {
        int32_t a = -7;
        kiln_status st = kiln_sampler_sample(cpu, x, V, hist, (size_t)nh, &a);
        if (st != KILN_OK) a = -1;
        CUDA_OK(cudaMemcpyAsync(d->hist, hist, (size_t)nh * sizeof(int32_t), cudaMemcpyHostToDevice, d->s));
        CUDA_OK(cudaMemsetAsync(d->token, 0xAB, sizeof(int32_t), d->s)); /* poison */
        *d->h_token = -99;
        CUDA_OK(kiln_cuda_sample_next(d->sp, d->s, kiln_sampler_get_params(dev),
                                      kiln_sampler_rng(dev), d->logits, V, d->hist, nh,
                                      d->token, d->h_token));
        CUDA_OK(cudaStreamSynchronize(d->s));
        int32_t b = *d->h_token, b2 = 0;
        CUDA_OK(cudaMemcpy(&b2, d->token, sizeof b2, cudaMemcpyDeviceToHost));
        (*n_draws)++;
        if (a != b || b != b2) {
            if (ok)
                fprintf(stderr, "MISMATCH %s seed %llu draw %d: cpu %d gpu %d (d_token %d)\n", label,
                        (unsigned long long)p->seed, t, a, b, b2);
            ok = 0;
        }
        hist[nh++] = a >= 0 ? a : 0;
    }
    kiln_sampler_free(cpu);
    kiln_sampler_free(dev);
    return ok;
}

/* Every parameter combination on one logits vector; big: the reduced set for V = 151936. */
static void run_matrix(dev_bufs *d, const float *x, int V, int pat, int seeds_per_case, int big,
                       int *seed_ctr) {
    static const float temps[] = {0.0f, 0.7f, 1.0f, 1.5f};
    static const int topks[] = {0, 1, 40, 1000};
    static const float topps[] = {1.0f, 0.9f, 0.5f};
    static const float minps[] = {0.0f, 0.05f};
    static const float pens[] = {1.0f, 1.3f};
    CUDA_OK(cudaMemcpy(d->logits, x, (size_t)V * sizeof(float), cudaMemcpyHostToDevice));
    int cases = 0, bad = 0, draws = 0;
    double t0 = now_s();
    for (int ti = 0; ti < 4; ti++)
        for (int ki = 0; ki < 4; ki++)
            for (int pi = 0; pi < 3; pi++)
                for (int mi = 0; mi < 2; mi++)
                    for (int ri = 0; ri < 2; ri++) {
                        if (temps[ti] <= 0.0f && (ki || pi || mi)) continue; /* greedy ignores them */
                        if (big && (ti == 1 || ti == 3 || ki == 1 || ki == 3 || pi == 2)) continue;
                        if (big && pat != PAT_NORMAL && pat != PAT_TIES && !(ki == 0 && pi == 0)) continue;
                        int last_n = ((ti + ki + pi + mi) & 1) ? -1 : 64;
                        for (int si = 0; si < seeds_per_case; si++) {
                            uint64_t seed = (uint64_t)(1 + (*seed_ctr)++ % 50);
                            kiln_sampler_params p = make_params(temps[ti], topks[ki], topps[pi], minps[mi],
                                                                pens[ri], last_n, seed);
                            char label[160];
                            snprintf(label, sizeof label, "V %d %s T %g k %d p %g minp %g pen %g last %d", V,
                                     pat_name[pat], (double)p.temperature, p.top_k, (double)p.top_p,
                                     (double)p.min_p, (double)p.repeat_penalty, last_n);
                            if (!run_sequence(d, x, V, &p, label, &draws)) bad++;
                            cases++;
                        }
                    }
    printf("sampling V=%d %-12s: %4d sequences, %5d draws, %d mismatching  %s (%.1f s)\n", V,
           pat_name[pat], cases, draws, bad, bad ? "FAILED" : "OK", now_s() - t0);
    g_fail += bad;
}

/* u by device pointer, and a captured graph replayed with a new u each time. */
static void run_graph(dev_bufs *d, const float *x, int V) {
    kiln_sampler_params p = make_params(1.0f, 0, 0.9f, 0.0f, 1.3f, 64, 7);
    kiln_sampler *cpu = NULL, *dev = NULL;
    if (kiln_sampler_create(&p, &cpu) != KILN_OK || kiln_sampler_create(&p, &dev) != KILN_OK) exit(1);
    int32_t hist[64];
    for (int j = 0; j < 64; j++) hist[j] = (int32_t)(rnd() % (uint32_t)V);
    CUDA_OK(cudaMemcpy(d->logits, x, (size_t)V * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d->hist, hist, sizeof hist, cudaMemcpyHostToDevice));
    /* u by device pointer, no graph */
    int bad = 0;
    for (int t = 0; t < 10; t++) {
        int32_t a = -7;
        if (kiln_sampler_sample(cpu, x, V, hist, 64, &a) != KILN_OK) a = -1;
        float u = kiln_sampler_draw_u(dev);
        CUDA_OK(cudaMemcpyAsync(d->u, &u, sizeof u, cudaMemcpyHostToDevice, d->s));
        CUDA_OK(cudaMemsetAsync(d->token, 0xAB, sizeof(int32_t), d->s));
        *d->h_token = -99;
        CUDA_OK(kiln_cuda_sample(d->sp, d->s, d->logits, V, &p, d->hist, 64, -1.0f, d->u, d->token,
                                 d->h_token));
        CUDA_OK(cudaStreamSynchronize(d->s));
        if (*d->h_token != a) {
            if (!bad) fprintf(stderr, "d_u draw %d: cpu %d gpu %d\n", t, a, *d->h_token);
            bad++;
        }
    }
    /* graph: capture once, replay with u updated in device memory */
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CUDA_OK(cudaStreamBeginCapture(d->s, cudaStreamCaptureModeRelaxed));
    cudaError_t ce = kiln_cuda_sample(d->sp, d->s, d->logits, V, &p, d->hist, 64, -1.0f, d->u,
                                      d->token, d->h_token);
    CUDA_OK(cudaStreamEndCapture(d->s, &g));
    CUDA_OK(ce);
    CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
    for (int t = 0; t < 10; t++) {
        int32_t a = -7;
        if (kiln_sampler_sample(cpu, x, V, hist, 64, &a) != KILN_OK) a = -1;
        float u = kiln_sampler_draw_u(dev);
        CUDA_OK(cudaMemcpyAsync(d->u, &u, sizeof u, cudaMemcpyHostToDevice, d->s));
        *d->h_token = -99;
        CUDA_OK(cudaGraphLaunch(ge, d->s));
        CUDA_OK(cudaStreamSynchronize(d->s));
        if (*d->h_token != a) {
            if (!bad) fprintf(stderr, "graph draw %d: cpu %d gpu %d\n", t, a, *d->h_token);
            bad++;
        }
    }
    CUDA_OK(cudaGraphExecDestroy(ge));
    CUDA_OK(cudaGraphDestroy(g));
    kiln_sampler_free(cpu);
    kiln_sampler_free(dev);
    printf("u by device pointer and CUDA graph replay V=%d: 20 draws, %d mismatching  %s\n", V, bad,
           bad ? "FAILED" : "OK");
    g_fail += bad;
}

/* A NaN logit gives -1 (greedy and sampling), and leaves the marks clean: the next calls on
 * clean logits still equal the CPU. */
static void run_nan(dev_bufs *d, float *x, int V) {
    int bad = 0;
    for (int greedy = 0; greedy < 2; greedy++) {
        kiln_sampler_params p = make_params(greedy ? 0.0f : 1.0f, 40, 0.9f, 0.05f, 1.3f, 64, 3);
        int32_t hist[64];
        for (int j = 0; j < 64; j++) hist[j] = (int32_t)(rnd() % (uint32_t)V);
        CUDA_OK(cudaMemcpy(d->hist, hist, sizeof hist, cudaMemcpyHostToDevice));
        float saved = x[V / 2];
        x[V / 2] = nanf("");
        CUDA_OK(cudaMemcpy(d->logits, x, (size_t)V * sizeof(float), cudaMemcpyHostToDevice));
        x[V / 2] = saved;
        *d->h_token = -99;
        CUDA_OK(kiln_cuda_sample(d->sp, d->s, d->logits, V, &p, d->hist, 64, 0.5f, NULL, d->token,
                                 d->h_token));
        CUDA_OK(cudaStreamSynchronize(d->s));
        if (*d->h_token != -1) {
            fprintf(stderr, "NaN logit (greedy %d): token %d\n", greedy, *d->h_token);
            bad++;
        }
        /* clean logits: the same draw as the CPU with the same u */
        CUDA_OK(cudaMemcpy(d->logits, x, (size_t)V * sizeof(float), cudaMemcpyHostToDevice));
        kiln_sampler *cpu = NULL, *dev = NULL;
        if (kiln_sampler_create(&p, &cpu) != KILN_OK || kiln_sampler_create(&p, &dev) != KILN_OK) exit(1);
        int32_t a = -7;
        if (kiln_sampler_sample(cpu, x, V, hist, 64, &a) != KILN_OK) a = -1;
        *d->h_token = -99;
        CUDA_OK(kiln_cuda_sample_next(d->sp, d->s, kiln_sampler_get_params(dev),
                                      kiln_sampler_rng(dev), d->logits, V, d->hist, 64,
                                      d->token, d->h_token));
        CUDA_OK(cudaStreamSynchronize(d->s));
        if (*d->h_token != a) {
            fprintf(stderr, "after NaN (greedy %d): cpu %d gpu %d\n", greedy, a, *d->h_token);
            bad++;
        }
        kiln_sampler_free(cpu);
        kiln_sampler_free(dev);
    }
    printf("NaN logits V=%d: -1, then clean draws equal the CPU  %s\n", V, bad ? "FAILED" : "OK");
    g_fail += bad;
}

static void run_timing(dev_bufs *d, const float *x, int V) {
    CUDA_OK(cudaMemcpy(d->logits, x, (size_t)V * sizeof(float), cudaMemcpyHostToDevice));
    struct {
        const char *name;
        kiln_sampler_params p;
    } cfg[] = {
        {"greedy", make_params(0.0f, 0, 1.0f, 0.0f, 1.0f, 64, 1)},
        {"greedy+penalty", make_params(0.0f, 0, 1.0f, 0.0f, 1.3f, 64, 1)},
        {"T1 k40 p0.95 minp0.05", make_params(1.0f, 40, 0.95f, 0.05f, 1.0f, 64, 1)},
        {"T1 k0 p0.9", make_params(1.0f, 0, 0.9f, 0.0f, 1.0f, 64, 1)},
        {"T1 k0 p1 (full softmax)", make_params(1.0f, 0, 1.0f, 0.0f, 1.0f, 64, 1)},
    };
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        const int reps = 20;
        CUDA_OK(kiln_cuda_sample(d->sp, d->s, d->logits, V, &cfg[c].p, d->hist, 64, 0.5f, NULL, d->token, NULL));
        CUDA_OK(cudaEventRecord(e0, d->s));
        for (int r = 0; r < reps; r++)
            CUDA_OK(kiln_cuda_sample(d->sp, d->s, d->logits, V, &cfg[c].p, d->hist, 64, 0.5f, NULL, d->token,
                                     NULL));
        CUDA_OK(cudaEventRecord(e1, d->s));
        CUDA_OK(cudaEventSynchronize(e1));
        float ms = 0.0f;
        CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
        printf("time V=%d %-24s: %8.1f us per token\n", V, cfg[c].name, 1000.0 * ms / reps);
    }
    CUDA_OK(cudaEventDestroy(e0));
    CUDA_OK(cudaEventDestroy(e1));
}

int main(int argc, char **argv) {
    int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    /* checks that need no device */
    {
        kiln_sampler_params p = kiln_sampler_default_params();
        int32_t tok;
        EXPECT(kiln_cuda_sample(NULL, 0, (const float *)&p, 10, &p, NULL, 0, 0.5f, NULL, &tok, NULL) ==
                   cudaErrorInvalidValue, "NULL sampler accepted");
        EXPECT(kiln_cuda_sampler_create(0, NULL) == cudaErrorInvalidValue, "create(0, NULL) accepted");
        float u0 = 0.0f;
        EXPECT(kiln_sample_walk(&u0, 1, 1, 1.0f, 0.0f, 0.5f) == 0, "walk of one candidate");
        EXPECT(kiln_sample_desc_bits(-0.0f) == kiln_sample_desc_bits(0.0f), "+-0 keys differ");
        EXPECT(kiln_sample_desc_bits(1.0f) < kiln_sample_desc_bits(-1.0f) &&
                   kiln_sample_desc_bits(-1.0f) < kiln_sample_desc_bits(-INFINITY) &&
                   kiln_sample_desc_bits(INFINITY) < kiln_sample_desc_bits(1.0f),
               "key order");
        EXPECT(kiln_sample_id_bits(151936) == 18 && kiln_sample_id_bits(1) == 1 && kiln_sample_id_bits(1024) == 10,
               "id bits");
    }
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev < 1) {
        printf("no CUDA device: skipped (host-side checks: %s)\n", g_fail ? "FAILED" : "ok");
        return g_fail ? 1 : 77;
    }
    CUDA_OK(cudaSetDevice(0));
    dev_bufs d;
    memset(&d, 0, sizeof d);
    CUDA_OK(kiln_cuda_sampler_create(VMAX, &d.sp));
    CUDA_OK(cudaStreamCreateWithFlags(&d.s, cudaStreamNonBlocking));
    CUDA_OK(cudaMalloc((void **)&d.logits, VMAX * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&d.hist, HMAX * sizeof(int32_t)));
    CUDA_OK(cudaMalloc((void **)&d.token, sizeof(int32_t)));
    CUDA_OK(cudaMalloc((void **)&d.u, sizeof(float)));
    CUDA_OK(cudaMallocHost((void **)&d.h_token, sizeof(int32_t)));
    {
        kiln_sampler_params p = kiln_sampler_default_params();
        EXPECT(kiln_cuda_sample(d.sp, d.s, d.logits, VMAX + 1, &p, d.hist, 0, 0.5f, NULL, d.token, NULL) ==
                   cudaErrorInvalidValue, "V > max_vocab accepted");
        p.top_p = 0.0f;
        EXPECT(kiln_cuda_sample(d.sp, d.s, d.logits, 100, &p, d.hist, 0, 0.5f, NULL, d.token, NULL) ==
                   cudaErrorInvalidValue, "top_p 0 accepted");
        p = kiln_sampler_default_params();
        p.temperature = INFINITY;
        EXPECT(kiln_cuda_sample(d.sp, d.s, d.logits, 100, &p, d.hist, 0, 0.5f, NULL, d.token, NULL) ==
                   cudaErrorInvalidValue, "infinite temperature accepted");
        p = kiln_sampler_default_params();
        p.repeat_penalty = 1.3f;
        EXPECT(kiln_cuda_sample(d.sp, d.s, d.logits, 100, &p, NULL, 5, 0.5f, NULL, d.token, NULL) ==
                   cudaErrorInvalidValue, "NULL history with a penalty accepted");
    }
    float *x = (float *)malloc(VMAX * sizeof(float));
    if (!x) return 1;
    int seed_ctr = 0;
    const int Vs[3] = {1000, 32000, VMAX};
    for (int vi = 0; vi < (quick ? 1 : 3); vi++) {
        int V = Vs[vi];
        for (int pat = 0; pat < PAT_COUNT; pat++) {
            if (V == 32000 && pat != PAT_NORMAL && pat != PAT_TIES && pat != PAT_ZEROS) continue;
            if (V == VMAX && pat != PAT_NORMAL && pat != PAT_TIES && pat != PAT_PEAKED) continue;
            fill(x, V, pat);
            run_matrix(&d, x, V, pat, V == 1000 ? 2 : 1, V == VMAX, &seed_ctr);
        }
    }
    int Vlast = quick ? 1000 : VMAX;
    fill(x, Vlast, PAT_NORMAL);
    run_graph(&d, x, Vlast);
    run_nan(&d, x, Vlast);
    run_timing(&d, x, Vlast);
    CUDA_OK(cudaGetLastError());
    free(x);
    CUDA_OK(cudaFreeHost(d.h_token));
    CUDA_OK(cudaFree(d.u));
    CUDA_OK(cudaFree(d.token));
    CUDA_OK(cudaFree(d.hist));
    CUDA_OK(cudaFree(d.logits));
    CUDA_OK(cudaStreamDestroy(d.s));
    kiln_cuda_sampler_free(d.sp);
    if (g_fail) printf("FAILED %d\n", g_fail);
    else printf("ALL OK\n");
    return g_fail ? 1 : 0;
}
