/*
 * sampler.c -- greedy and seeded sampling.
 *
 * Order (Hugging Face's logits processors): repetition penalty, temperature, top-k, softmax,
 * top-p, min-p, draw. Candidates are ranked by (logit descending, id ascending), so ties
 * never depend on a sort's stability. Draws use xoshiro256** seeded by splitmix64(seed):
 * the same seed gives the same tokens on every machine (docs/ARITHMETIC.md, "Sampling").
 */
#include "../base/base.h"
#include "../base/handle.h"
#include "../base/kmath.h"
#include "../ops/sampling.h"
#include "sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct sampler_cand {
    float logit;
    int32_t id;
} sampler_cand;

struct kiln_sampler {
    kiln_handle_head head; /* first: the registry's magic (base/handle.h) */
    kiln_sampler_params p;
    kiln_sample_rng rng; /* xoshiro256** state (ops/sampling.h) */
    sampler_cand *cand;  /* (cap) */
    float *probs;        /* (cap) */
    uint8_t *seen;       /* (cap) penalty marks */
    int cap;
};

kiln_sampler_params kiln_sampler_default_params(void) {
    kiln_sampler_params p;
    p.temperature = 0.8f;
    p.top_k = 40;
    p.top_p = 0.95f;
    p.min_p = 0.05f;
    p.repeat_penalty = 1.0f;
    p.repeat_last_n = 64;
    p.seed = 0;
    return p;
}

kiln_status kiln_sampler_create(const kiln_sampler_params *p, kiln_sampler **out) {
    if (!p || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_sampler_create: NULL argument");
    if (!(p->temperature == p->temperature) || !(p->top_p == p->top_p) || !(p->min_p == p->min_p))
        return kiln_error(KILN_ERR_INVALID_ARG, "sampler: temperature, top_p and min_p must not be NaN");
    if (p->top_p <= 0.0f)
        return kiln_error(KILN_ERR_INVALID_ARG, "sampler: top_p must be > 0 (got %g)", (double)p->top_p);
    if (p->min_p > 1.0f)
        return kiln_error(KILN_ERR_INVALID_ARG, "sampler: min_p must be <= 1 (got %g)", (double)p->min_p);
    if (!(p->repeat_penalty > 0.0f))
        return kiln_error(KILN_ERR_INVALID_ARG, "sampler: repeat_penalty must be > 0 (got %g)",
                          (double)p->repeat_penalty);
    if (p->repeat_last_n < -1)
        return kiln_error(KILN_ERR_INVALID_ARG, "sampler: repeat_last_n must be >= -1");
    kiln_sampler *s = kiln_calloc(1, sizeof *s);
    if (!s) return kiln_error(KILN_ERR_NOMEM, "sampler: out of memory");
    s->p = *p;
    kiln_sample_rng_seed(&s->rng, p->seed);
    kiln_status st = kiln_handle_register(&s->head, KILN_HANDLE_SAMPLER, "kiln_sampler_create");
    if (st != KILN_OK) {
        kiln_free(s);
        return st;
    }
    *out = s;
    return KILN_OK;
}

const kiln_sampler_params *kiln_sampler_get_params(const kiln_sampler *s) { return &s->p; }

float kiln_sampler_draw_u(kiln_sampler *s) { return kiln_sample_rng_u(&s->rng); }

kiln_sample_rng *kiln_sampler_rng(kiln_sampler *s) { return &s->rng; }

void kiln_sampler_free(kiln_sampler *s) {
    if (!s || kiln_handle_unregister(&s->head, KILN_HANDLE_SAMPLER, "kiln_sampler_free") != KILN_OK) return;
    kiln_free(s->cand);
    kiln_free(s->probs);
    kiln_free(s->seen);
    kiln_free(s);
}

static int cand_cmp(const void *a, const void *b) {
    const sampler_cand *x = a, *y = b;
    if (x->logit > y->logit) return -1;
    if (x->logit < y->logit) return 1;
    return (x->id > y->id) - (x->id < y->id);
}

static int cand_before(const sampler_cand *x, const sampler_cand *y) { return cand_cmp(x, y) < 0; }

/* Move the k best candidates (by cand_cmp) to c[0..k), in no particular order. */
static void select_top_k(sampler_cand *c, int n, int k) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        sampler_cand pivot = c[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (cand_before(&c[i], &pivot)) i++;
            while (cand_before(&pivot, &c[j])) j--;
            if (i <= j) {
                sampler_cand t = c[i];
                c[i] = c[j];
                c[j] = t;
                i++;
                j--;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
}

static kiln_status ensure_cap(kiln_sampler *s, int n) {
    if (n <= s->cap) return KILN_OK;
    kiln_free(s->cand);
    kiln_free(s->probs);
    kiln_free(s->seen);
    s->cand = kiln_malloc((size_t)n * sizeof *s->cand);
    s->probs = kiln_malloc((size_t)n * sizeof *s->probs);
    s->seen = kiln_calloc((size_t)n, 1);
    if (!s->cand || !s->probs || !s->seen) {
        s->cap = 0;
        return kiln_error(KILN_ERR_NOMEM, "sampler: out of memory for %d candidates", n);
    }
    s->cap = n;
    return KILN_OK;
}

kiln_status kiln_sampler_sample(kiln_sampler *s, const float *logits, int n_vocab,
                                const int32_t *history, size_t n_history, int32_t *out_id) {
    KILN_TRY(kiln_handle_check(s, KILN_HANDLE_SAMPLER, "kiln_sampler_sample"));
    if (!logits || !out_id || (n_history && !history))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_sampler_sample: NULL argument");
    if (n_vocab <= 0) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_sampler_sample: n_vocab must be > 0");
    KILN_TRY(ensure_cap(s, n_vocab));
    const kiln_sampler_params *p = &s->p;
    sampler_cand *c = s->cand;
    for (int i = 0; i < n_vocab; i++) {
        c[i].logit = logits[i];
        c[i].id = i;
    }
    /* repetition penalty, once per distinct token in the window */
    if (p->repeat_penalty != 1.0f && n_history > 0) {
        size_t start = 0;
        if (p->repeat_last_n >= 0 && n_history > (size_t)p->repeat_last_n) start = n_history - (size_t)p->repeat_last_n;
        for (size_t i = start; i < n_history; i++) {
            int32_t id = history[i];
            if (id < 0 || id >= n_vocab || s->seen[id]) continue;
            s->seen[id] = 1;
            float l = c[id].logit;
            c[id].logit = l > 0.0f ? l / p->repeat_penalty : l * p->repeat_penalty;
        }
        for (size_t i = start; i < n_history; i++)
            if (history[i] >= 0 && history[i] < n_vocab) s->seen[history[i]] = 0;
    }
    for (int i = 0; i < n_vocab; i++)
        if (c[i].logit != c[i].logit)
            return kiln_error(KILN_ERR_RANGE, "kiln_sampler_sample: logit of token %d is NaN", i);
    if (p->temperature <= 0.0f) { /* greedy: argmax, lowest id on ties */
        int best = 0;
        for (int i = 1; i < n_vocab; i++)
            if (c[i].logit > c[best].logit) best = i;
        *out_id = c[best].id;
        return KILN_OK;
    }
    for (int i = 0; i < n_vocab; i++) c[i].logit = c[i].logit / p->temperature;
    int n = n_vocab;
    if (p->top_k > 0 && p->top_k < n) {
        select_top_k(c, n, p->top_k);
        n = p->top_k;
    }
    qsort(c, (size_t)n, sizeof *c, cand_cmp);
    /* softmax over the kept candidates, summed in rank order */
    float *pr = s->probs;
    float mx = c[0].logit, sum = 0.0f;
    for (int i = 0; i < n; i++) {
        pr[i] = kiln_expf(c[i].logit - mx);
        sum += pr[i];
    }
    for (int i = 0; i < n; i++) pr[i] = pr[i] / sum;
    if (p->top_p < 1.0f) {
        float cum = 0.0f;
        int keep = n;
        for (int i = 0; i < n; i++) {
            cum += pr[i];
            if (cum >= p->top_p) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
    }
    if (p->min_p > 0.0f) {
        float thr = p->min_p * pr[0];
        int keep = 1;
        while (keep < n && pr[keep] >= thr) keep++;
        n = keep;
    }
    float total = 0.0f;
    for (int i = 0; i < n; i++) total += pr[i];
    float r = kiln_sample_rng_u(&s->rng) * total;
    float cum = 0.0f;
    int pick = n - 1;
    for (int i = 0; i < n; i++) {
        cum += pr[i];
        if (r < cum) {
            pick = i;
            break;
        }
    }
    *out_id = c[pick].id;
    return KILN_OK;
}
