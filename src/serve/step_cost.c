/* step_cost.c -- the serving step's cost model and the prefill cap (step_cost.h). */
#include "step_cost.h"

#include <limits.h>

int kiln_step_band_of(int n_dec) {
    int b = 0;
    while (b + 1 < KILN_STEP_BANDS && (2 << b) <= n_dec) b++;
    return b;
}

/* Exponentially weighted mean: plain at first, then a weight of 0.1 for the newest. */
static double ew(double mean, double v, double n_before) {
    return mean + (n_before < 10 ? 1.0 / (n_before + 1) : 0.1) * (v - mean);
}

void kiln_step_cost_add(kiln_step_cost *c, double seconds, int n_dec, int n_pre) {
    if (n_pre >= 64 && seconds > 0) {
        const double per = seconds / (double)(n_pre + (n_dec > 0 ? n_dec : 0));
        c->p_prior = c->p_prior > 0 ? c->p_prior + 0.25 * (per - c->p_prior) : per;
    }
    if (n_dec < 1 && n_pre < 1) return;
    kiln_step_band *f = n_dec < 1 ? &c->prefill_only : &c->band[kiln_step_band_of(n_dec)];
    const double x = n_pre, t = seconds;
    f->rows = ew(f->rows, n_dec, f->n0 + f->n);
    if (!n_pre) { /* decode only: the band's d, measured */
        f->y0 = ew(f->y0, t, f->n0);
        f->n0 += 1;
        return;
    }
    f->x = ew(f->x, x, f->n);
    f->y = ew(f->y, t, f->n);
    f->xx = ew(f->xx, x * x, f->n);
    f->xy = ew(f->xy, x * t, f->n);
    f->n += 1;
    double cov = 0, var = 0;
    for (int b = -1; b < KILN_STEP_BANDS; b++) {
        const kiln_step_band *g = b < 0 ? &c->prefill_only : &c->band[b];
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

/* The band's d: its decode-only steps' mean, else its prefill steps' intercept. */
static double band_decode(const kiln_step_cost *c, int b) {
    const kiln_step_band *f = &c->band[b];
    return f->n0 > 0 ? f->y0 : f->n > 0 ? f->y - slope(c) * f->x : 0;
}

/* The fixed cost of any prefill beside n_dec decode rows: the band's prefill steps' intercept
 * less its decode-only mean, where it has both (else 0), at least 0. */
static double band_prefill_fixed(const kiln_step_cost *c, int n_dec) {
    const kiln_step_band *f = &c->band[kiln_step_band_of(n_dec)];
    if (!(f->n0 > 0 && f->n > 0)) return 0;
    const double fixed = f->y - slope(c) * f->x - f->y0;
    return fixed > 0 ? fixed : 0;
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
    const double fixed = band_prefill_fixed(c, n_dec);
    const double tokens = (itl_bound * d_ref - d - fixed) / p;
    /* at least the tokens that pay for the prefill's fixed cost once over (where the bound
     * leaves fewer, no prefill keeps it: take prompts in chunks worth their fixed cost) */
    const double floor = fixed / p > 16 ? fixed / p : 16;
    const double cap = tokens < floor ? floor : tokens;
    return cap >= INT_MAX ? INT_MAX : (int)cap;
}
