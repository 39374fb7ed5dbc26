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

/* The band's prefill steps' intercept: d plus the fixed cost of any prefill (0: no such step). */
static double band_intercept(const kiln_step_cost *c, int b) {
    const kiln_step_band *f = &c->band[b];
    return f->n > 0 ? f->y - slope(c) * f->x : 0;
}

/* d(n_dec) from decode-only steps: the band's own mean, else the nearest band's that has them
 * (a lower band's plus p for each row more: a decode row passes the same products as a prefill
 * token, its attention left out, so this errs low; a higher band's scaled down to n_dec rows,
 * low too). 0 when no band has a decode-only step. */
static double decode_measured(const kiln_step_cost *c, int n_dec) {
    const int b = kiln_step_band_of(n_dec < 1 ? 1 : n_dec);
    for (int k = 0; k < KILN_STEP_BANDS; k++) {
        if (b - k >= 0 && c->band[b - k].n0 > 0) {
            const kiln_step_band *f = &c->band[b - k];
            return k ? f->y0 + slope(c) * (n_dec - f->rows) : f->y0;
        }
        if (k && b + k < KILN_STEP_BANDS && c->band[b + k].n0 > 0) {
            const kiln_step_band *f = &c->band[b + k];
            return f->y0 * n_dec / f->rows;
        }
    }
    return 0;
}

/* The fixed cost of any prefill beside n_dec decode rows: the band's prefill steps' intercept
 * less d(n_dec) from decode-only steps (the band's, or its nearest neighbour's: a band whose
 * steps all mix -- rows joining while prompts wait -- has none of its own), at least 0; 0
 * where either is unknown. */
static double band_prefill_fixed(const kiln_step_cost *c, int n_dec) {
    const double icpt = band_intercept(c, kiln_step_band_of(n_dec));
    const double d = decode_measured(c, n_dec);
    if (!(icpt > 0) || !(d > 0)) return 0;
    return icpt > d ? icpt - d : 0;
}

double kiln_step_cost_decode(const kiln_step_cost *c, int n_dec) {
    const double m = decode_measured(c, n_dec);
    if (m > 0) return m;
    /* no decode-only step yet: the prefill steps' intercepts (on a GPU they hold the fixed
     * cost of a prefill too, so this errs high), the nearest band's as above */
    const int b = kiln_step_band_of(n_dec < 1 ? 1 : n_dec);
    for (int k = 0; k < KILN_STEP_BANDS; k++) {
        if (b - k >= 0) {
            const double d = band_intercept(c, b - k);
            if (d > 0) return k ? d + slope(c) * (n_dec - c->band[b - k].rows) : d;
        }
        if (k && b + k < KILN_STEP_BANDS) {
            const double d = band_intercept(c, b + k);
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
