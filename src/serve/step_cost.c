/* step_cost.c -- the serving step's cost model and the prefill cap (step_cost.h). */
#include "step_cost.h"

#include <limits.h>

int kiln_step_band_of(int n_dec) {
    int b = 0;
    while (b + 1 < KILN_STEP_BANDS && (2 << b) <= n_dec) b++;
    return b;
}

void kiln_step_cost_add(kiln_step_cost *c, double seconds, int n_dec, int n_pre) {
    if (n_pre >= 64 && seconds > 0) {
        const double per = seconds / (double)(n_pre + (n_dec > 0 ? n_dec : 0));
        c->p_prior = c->p_prior > 0 ? c->p_prior + 0.25 * (per - c->p_prior) : per;
    }
    if (n_dec < 1) return;
    kiln_step_band *f = &c->band[kiln_step_band_of(n_dec)];
    const double x = n_pre, t = seconds, a = f->n < 10 ? 1.0 / (f->n + 1) : 0.1; /* plain means at first */
    f->n += 1;
    f->x += a * (x - f->x);
    f->y += a * (t - f->y);
    f->xx += a * (x * x - f->xx);
    f->xy += a * (x * t - f->xy);
    f->rows += a * (n_dec - f->rows);
    double cov = 0, var = 0;
    for (int b = 0; b < KILN_STEP_BANDS; b++) {
        const kiln_step_band *g = &c->band[b];
        const double w = g->n < 10 ? g->n : 10;
        cov += w * (g->xy - g->x * g->y);
        var += w * (g->xx - g->x * g->x);
    }
    if (var > 640.0 && cov > 0) {
        c->p = cov / var;
        c->have_p = 1;
    }
}

/* The slope in use: the measured one, else the prior (0: none). */
static double slope(const kiln_step_cost *c) { return c->have_p ? c->p : c->p_prior; }

static double band_decode(const kiln_step_cost *c, int b) {
    const kiln_step_band *f = &c->band[b];
    return f->n > 0 ? f->y - slope(c) * f->x : 0;
}

double kiln_step_cost_decode(const kiln_step_cost *c, int n_dec) {
    const int b = kiln_step_band_of(n_dec < 1 ? 1 : n_dec);
    for (int k = 0; k < KILN_STEP_BANDS; k++) {
        if (b - k >= 0) { /* a row more costs about a prefill token more */
            const double d = band_decode(c, b - k);
            if (d > 0) return k ? d + slope(c) * (n_dec - c->band[b - k].rows) : d;
        }
        if (k && b + k < KILN_STEP_BANDS) {
            const double d = band_decode(c, b + k);
            if (d > 0) return d * n_dec / c->band[b + k].rows;
        }
    }
    return 0;
}

int kiln_step_cost_prefill_cap(const kiln_step_cost *c, double itl_bound, int n_dec, int n_running) {
    const double p = slope(c);
    if (n_dec < 1 || !(itl_bound > 1.0) || !(p > 0)) return INT_MAX;
    const double d_ref = kiln_step_cost_decode(c, n_running > n_dec ? n_running : n_dec);
    const double d = kiln_step_cost_decode(c, n_dec);
    if (!(d_ref > 0) || !(d > 0)) return INT_MAX;
    const double tokens = (itl_bound * d_ref - d) / p;
    return tokens < 16 ? 16 : tokens >= INT_MAX ? INT_MAX : (int)tokens;
}
