/* step_cost.h -- what a serving step costs, learned from the engine's own steps, and the
 * prefill a step may add under the inter-token latency bound (docs/SERVING.md, "A step").
 *
 * A step of n_dec decode rows takes d(n_dec) alone, and d(n_dec) + f + p x with x prefill
 * tokens: d the decode part, f the fixed cost of any prefill (a GPU's switch to the prefill
 * kernels; about 0 on a CPU), p one prefill token. d grows with the rows, so the moments are
 * kept per band of n_dec (1, 2-3, 4-7, ... rows: a d measured at 8 rows taken for 64 would
 * charge the difference to the prefill tokens). p does not depend on the decode rows beside
 * it: one slope, pooled over the bands. Pure arithmetic on the numbers it is given: no clock,
 * no engine. */
#ifndef KILN_SERVE_STEP_COST_H
#define KILN_SERVE_STEP_COST_H

#define KILN_STEP_BANDS 12

typedef struct kiln_step_band {
    double n0, y0;       /* decode-only steps seen; their weighted mean t */
    double n;            /* steps with prefill seen */
    double x, y, xx, xy; /* their exponentially weighted means of x, t, x^2, x t */
    double rows;         /* every step's weighted mean n_dec */
} kiln_step_band;

typedef struct kiln_step_cost {
    kiln_step_band band[KILN_STEP_BANDS];
    kiln_step_band prefill_only; /* steps without decode rows: for the slope only */
    double p;   /* seconds a prefill token (have_p: measured) */
    int have_p;
    double p_prior; /* before p: seconds a token of the recent steps of 64 or more prefill tokens */
} kiln_step_cost;

/* The band of n_dec >= 1 decode rows: 0 for 1, 1 for 2-3, 2 for 4-7, ... */
int kiln_step_band_of(int n_dec);

/* Fold a step of `seconds` (n_dec decode rows, n_pre prefill tokens) into its band: a
 * decode-only step into the band's d (its mean), a step with prefill into the band's
 * regression of t on x; steps without decode rows only into the slope (prefill_only). A step
 * of 64 or more prefill tokens, with decode rows or not, also updates the prior: its seconds a
 * token, every token counted as a prefill token (so the prior errs high and a cap from it
 * small), the slope a server has before its steps' prefill sizes spread (a first burst of
 * requests, all prompts at once). Then pools the slope over the steps with prefill only
 * (decode-only steps would charge a GPU's fixed cost of any prefill, its switch to the prefill
 * kernels, to the tokens): p = sum_b w_b cov_b(x, t) / sum_b w_b var_b(x), w_b the band's
 * steps with prefill up to 10, taken once that spread is worth a band of 10 steps of var(x) 64
 * (prefill sizes 8 tokens apart) and the slope is positive; else the last p stays. */
void kiln_step_cost_add(kiln_step_cost *c, double seconds, int n_dec, int n_pre);

/* d(n_dec) from decode-only steps: the band's mean, else -- a band not seen decoding alone --
 * its nearest lower band's plus p for each row more (a decode row passes the same products as
 * a prefill token; its attention is left out, so this errs low), else its nearest higher
 * band's scaled down to n_dec rows (low too). Before any decode-only step, the same walk over
 * the bands' prefill steps' intercepts (their mean t less p (or the prior) times their mean
 * prefill; on a GPU that intercept holds the fixed cost of a prefill too). 0 when nothing is
 * known. A cap relative to a d that errs low errs small; but d(n_running) taken as the lower
 * band's d unchanged held a CPU engine at 8 of 64 admitted requests decoding, and a band's
 * intercept taken for its d held a GPU engine at 16-token prefill chunks from a cold start
 * (docs/SERVING.md). */
double kiln_step_cost_decode(const kiln_step_cost *c, int n_dec);

/* The prefill tokens a step of n_dec decode rows may add while n_running requests are admitted:
 * as many as keep d(n_dec) + f + p x within itl_bound x d(max(n_running, n_dec)), the step all
 * of them will share once their prompts are in (p the prior until it is measured; f the fixed
 * cost of any prefill beside n_dec rows, the band's prefill intercept less d(n_dec) from
 * decode-only steps, 0 on a CPU and about two decode steps on a GPU). At least 16, and at least f / p: where
 * f alone breaks the bound, the prefill comes in chunks worth their fixed cost, not in 16-token
 * steps that pay it again and again (a GPU at 8 clients did that: every step mixed, 3x a
 * decode step, a third of the throughput). INT_MAX (no cap) without decode rows, with
 * itl_bound <= 1 (off), or before any step of 64 prefill tokens. */
int kiln_step_cost_prefill_cap(const kiln_step_cost *c, double itl_bound, int n_dec, int n_running);

#endif
