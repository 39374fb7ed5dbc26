/* test_step_cost.c -- the serving step's cost model and prefill cap (src/serve/step_cost.h),
 * fed steps of a known cost t = d(n) + p x (d(n) = 4 ms + 1.5 ms n, p = 1.2 ms, a little
 * deterministic noise): the pooled slope is recovered, an unseen band borrows its neighbour's
 * decode part from the right side, and the cap keeps a step within the bound of the step all
 * running requests will share. */
#include "serve/step_cost.h"
#include "test_util.h"

#include <limits.h>
#include <math.h>
#include <stdint.h>

static double d_true(int n) { return 4e-3 + 1.5e-3 * n; }
static const double P_TRUE = 1.2e-3;

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static double noise(void) { /* uniform in [-1, 1) */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / (double)(1ull << 52) - 1.0;
}

static void feed(kiln_step_cost *c, int n_dec, int steps) {
    for (int i = 0; i < steps; i++) {
        const int x = (i % 3 == 0) ? 0 : 8 + (i * 37) % 120; /* decode-only and mixed steps */
        kiln_step_cost_add(c, (d_true(n_dec) + P_TRUE * x) * (1.0 + 0.01 * noise()), n_dec, x);
    }
}

static int near(double got, double want, double rel) { return fabs(got - want) <= rel * fabs(want); }

/* A GPU's step as the H100 gave it (bench/RESULTS.md, 2026-12-07): d = 1.2 ms + 10 us a row, any
 * prefill beside decodes a fixed 2.3 ms more, a token 5 us; a step of prefill alone 1 ms + the
 * same. */
static double gpu_step(int n_dec, int x) {
    double t = n_dec ? 1.2e-3 + 1e-5 * n_dec : 1.0e-3;
    return x ? t + 2.3e-3 + 5e-6 * x : t;
}

/* C closed-loop clients on an engine's schedule (decodes first, then prompts in order under
 * 512 tokens a step and the prefill cap), each sending a new prompt of 100-999 tokens when its
 * 64 tokens are out, for `secs` seconds of modelled steps. Returns output tokens a second;
 * *small: the steps with at most 32 prefill tokens beside decodes. */
static double closed_loop(kiln_step_cost *c, int C, double secs, int *small) {
    int prompt[64], done[64], out[64];
    unsigned r = 12345;
    for (int i = 0; i < C; i++) {
        r = r * 1103515245u + 12345u;
        prompt[i] = 100 + (int)((r >> 8) % 900), done[i] = out[i] = 0;
    }
    double t = 0;
    long tokens = 0;
    *small = 0;
    while (t < secs) {
        int n_dec = 0;
        for (int i = 0; i < C; i++) n_dec += done[i] == prompt[i];
        int budget = 512 - n_dec;
        const int cap = n_dec ? kiln_step_cost_prefill_cap(c, 2.0, n_dec, C) : INT_MAX;
        if (cap < budget) budget = cap;
        int x = 0, first[64] = {0};
        for (int i = 0; i < C && budget > 0; i++) {
            if (done[i] == prompt[i]) continue;
            const int ch = prompt[i] - done[i] < budget ? prompt[i] - done[i] : budget;
            done[i] += ch, x += ch, budget -= ch;
            first[i] = done[i] == prompt[i];
        }
        const double dt = gpu_step(n_dec, x);
        t += dt;
        *small += n_dec && x && x <= 32;
        kiln_step_cost_add(c, dt, n_dec, x);
        for (int i = 0; i < C; i++) {
            if (done[i] != prompt[i]) continue;
            tokens++;
            if (++out[i] == 64 && !first[i]) {
                r = r * 1103515245u + 12345u;
                prompt[i] = 100 + (int)((r >> 8) % 900), done[i] = out[i] = 0;
            }
        }
    }
    return (double)tokens / t;
}

int main(void) {
    CHECK(kiln_step_band_of(1) == 0 && kiln_step_band_of(2) == 1 && kiln_step_band_of(3) == 1);
    CHECK(kiln_step_band_of(4) == 2 && kiln_step_band_of(7) == 2 && kiln_step_band_of(64) == 6);
    CHECK(kiln_step_band_of(1 << 30) == KILN_STEP_BANDS - 1);

    /* nothing known: no cap, no decode part */
    kiln_step_cost c = {0};
    CHECK(kiln_step_cost_prefill_cap(&c, 2.0, 8, 8) == INT_MAX);
    CHECK(kiln_step_cost_decode(&c, 8) == 0);

    /* decode-only steps: d known, p not (no spread): still no cap */
    for (int i = 0; i < 30; i++) kiln_step_cost_add(&c, d_true(5), 5, 0);
    CHECK(!c.have_p);
    CHECK(near(kiln_step_cost_decode(&c, 5), d_true(5), 1e-9));
    CHECK(kiln_step_cost_prefill_cap(&c, 2.0, 5, 5) == INT_MAX);

    /* steps without decode rows are not counted */
    kiln_step_cost_add(&c, 1.0, 0, 500);
    CHECK(!c.have_p);

    /* one band with spread: p measured, pooled with the decode-only band's zero spread */
    feed(&c, 10, 40);
    CHECK(c.have_p);
    CHECK_MSG(near(c.p, P_TRUE, 0.05), "p %g, want %g", c.p, P_TRUE);
    CHECK_MSG(near(kiln_step_cost_decode(&c, 10), d_true(10), 0.05), "d(10) %g, want %g",
              kiln_step_cost_decode(&c, 10), d_true(10));

    /* an unseen band: its nearest lower band's d plus p a row more, else (below every seen
     * band) the nearest higher band's scaled down */
    CHECK(near(kiln_step_cost_decode(&c, 6), d_true(5), 0.02));
    CHECK(near(kiln_step_cost_decode(&c, 40), kiln_step_cost_decode(&c, 10) + c.p * (40 - c.band[3].rows), 1e-9));
    CHECK(kiln_step_cost_decode(&c, 40) < d_true(40)); /* errs low */
    /* below every seen band: the nearest higher band scaled down to the rows */
    kiln_step_cost hi = {0};
    feed(&hi, 20, 40);
    const double d20 = kiln_step_cost_decode(&hi, 20);
    CHECK_MSG(near(kiln_step_cost_decode(&hi, 2), d20 * 2 / 20, 1e-9), "d(2) %g", kiln_step_cost_decode(&hi, 2));
    CHECK(kiln_step_cost_decode(&hi, 2) < d_true(2)); /* errs low: the cap errs small */

    /* a first burst (every prompt at once): before the prefill sizes spread, the prior (a
     * step's seconds a token, decode rows counted as prefill tokens) gives a cap, about
     * 2 n_running - n_dec tokens (a prefill token priced as a decode row: small on purpose) */
    {
        kiln_step_cost b = {0};
        kiln_step_cost_add(&b, d_true(0) + P_TRUE * 512, 0, 512); /* prefill only */
        CHECK(!b.have_p && b.p_prior > 0);
        kiln_step_cost_add(&b, d_true(1) + P_TRUE * 500, 1, 500);
        CHECK(!b.have_p);
        const int cap = kiln_step_cost_prefill_cap(&b, 2.0, 1, 64);
        CHECK_MSG(cap >= 16 && cap <= 2 * 64 + 16, "cold cap %d", cap);
        /* steps of fewer than 64 prefill tokens leave the prior alone */
        const double prior = b.p_prior;
        kiln_step_cost_add(&b, d_true(1) + P_TRUE * 63, 1, 63);
        CHECK(b.p_prior == prior);
        /* a measured slope replaces it */
        feed(&b, 10, 40);
        CHECK(b.have_p && near(kiln_step_cost_prefill_cap(&b, 2.0, 10, 10), d_true(10) / P_TRUE, 0.1));
    }

    /* a GPU's step: flat d = 1.2 ms, any prefill a fixed 2.3 ms more, a token 5 us. Decode-only
     * steps do not enter the slope (with them, 16-token mixed steps would price a token at
     * 2.3 ms / 16 and hold the cap at 16); prefill-only steps of varied sizes give it; the cap
     * is then at least the fixed cost's worth of tokens, f / p = 460 */
    {
        kiln_step_cost g = {0};
        for (int i = 0; i < 40; i++) {
            kiln_step_cost_add(&g, 1.2e-3, 8, 0);
            kiln_step_cost_add(&g, 1.2e-3 + 2.3e-3 + 5e-6 * 16, 8, 16);
        }
        CHECK(!g.have_p); /* no spread among the steps with prefill */
        for (int i = 0; i < 20; i++) {
            const int x = 100 + 37 * (i % 11);
            kiln_step_cost_add(&g, 1.0e-3 + 2.3e-3 + 5e-6 * x, 0, x);
        }
        CHECK_MSG(g.have_p && near(g.p, 5e-6, 0.01), "GPU p %g", g.p);
        CHECK(near(kiln_step_cost_decode(&g, 8), 1.2e-3, 1e-9));
        const int cap = kiln_step_cost_prefill_cap(&g, 2.0, 8, 8);
        CHECK_MSG(cap >= 440 && cap <= 480, "GPU cap %d, want about 460", cap);
        /* where the bound leaves room past the fixed cost, it is the bound */
        kiln_step_cost h = g;
        for (int i = 0; i < 40; i++) kiln_step_cost_add(&h, 6.0e-3, 64, 0);
        for (int i = 0; i < 40; i++) kiln_step_cost_add(&h, 6.0e-3 + 1.0e-3 + 5e-6 * (16 + 20 * (i % 7)), 64, 16 + 20 * (i % 7));
        const int cap64 = kiln_step_cost_prefill_cap(&h, 2.0, 64, 64);
        CHECK_MSG(near(cap64, (2 * 6.0e-3 - 6.0e-3 - 1.0e-3) / 5e-6, 0.05), "GPU cap at 64 rows %d, want 1000", cap64);
    }

    /* several bands: the pooled slope, every band's own d */
    kiln_step_cost m = {0};
    for (int n = 1; n <= 64; n *= 2) feed(&m, n, 60);
    CHECK_MSG(near(m.p, P_TRUE, 0.03), "pooled p %g, want %g", m.p, P_TRUE);
    for (int n = 1; n <= 64; n *= 2)
        CHECK_MSG(near(kiln_step_cost_decode(&m, n), d_true(n), 0.05), "d(%d) %g, want %g", n,
                  kiln_step_cost_decode(&m, n), d_true(n));

    /* the cap: all running requests decoding, the step stays within the bound of its decode part */
    for (int n = 1; n <= 64; n *= 2) {
        const int cap = kiln_step_cost_prefill_cap(&m, 2.0, n, n);
        const double want = d_true(n) / P_TRUE;
        CHECK_MSG(cap >= 16 && (want < 16 || near(cap, want, 0.08)), "cap(%d) %d, want %g", n, cap, want);
    }
    /* few rows decoding, many admitted: the reference is the step of all of them decoding */
    {
        const int cap = kiln_step_cost_prefill_cap(&m, 2.0, 4, 32);
        const double want = (2.0 * d_true(32) - d_true(4)) / P_TRUE;
        CHECK_MSG(near(cap, want, 0.08), "cap(4 of 32) %d, want %g", cap, want);
        CHECK(cap > 4 * kiln_step_cost_prefill_cap(&m, 2.0, 4, 4));
        /* and never below the step's own bound: n_running below n_dec counts as n_dec */
        CHECK(kiln_step_cost_prefill_cap(&m, 2.0, 16, 1) == kiln_step_cost_prefill_cap(&m, 2.0, 16, 16));
    }
    /* a tighter bound, a smaller cap; at least 16 tokens; off at <= 1 and without decode rows */
    CHECK(kiln_step_cost_prefill_cap(&m, 1.5, 16, 16) < kiln_step_cost_prefill_cap(&m, 2.0, 16, 16));
    CHECK(kiln_step_cost_prefill_cap(&m, 1.01, 1, 1) == 16);
    CHECK(kiln_step_cost_prefill_cap(&m, 1.0, 16, 16) == INT_MAX);
    CHECK(kiln_step_cost_prefill_cap(&m, 0.0, 16, 16) == INT_MAX);
    CHECK(kiln_step_cost_prefill_cap(&m, 2.0, 0, 16) == INT_MAX);

    /* a GPU from cold, 8 clients: rows join while prompts wait, so the bands of 1-7 rows see
     * only mixed steps. Their intercept (d + the fixed cost) once stood for d, their fixed cost
     * read 0, and the cap held 16 tokens a step (a third of the throughput, TTFT p50 260 ms on
     * an H100); with d from decode-only steps of any band and the fixed cost as the rest of the
     * intercept, prompts come in chunks worth that cost */
    {
        kiln_step_cost g = {0};
        int small = 0;
        const double tps8 = closed_loop(&g, 8, 6.0, &small);
        CHECK_MSG(tps8 > 3000 && small < 100, "GPU cold, 8 clients: %.0f tok/s, %d small mixed steps", tps8, small);
        printf("GPU cold, 8 closed-loop clients: %.0f tok/s, %d small mixed steps\n", tps8, small);
        const double tps64 = closed_loop(&g, 64, 6.0, &small);
        CHECK_MSG(tps64 > 6000 && small < 100, "GPU, then 64 clients: %.0f tok/s, %d small mixed steps", tps64, small);
        printf("then 64: %.0f tok/s, %d small mixed steps\n", tps64, small);
    }

    /* a band whose steps grow slower with more prefill (noise, a cache effect) never makes p
     * negative: the last p stays */
    const double p_before = m.p;
    for (int i = 0; i < 200; i++) kiln_step_cost_add(&m, 0.1 - 1e-4 * (i % 50), 3, i % 50);
    CHECK(m.p > 0);
    CHECK(m.p <= p_before * 1.0001);
    return test_finish("test_step_cost");
}
