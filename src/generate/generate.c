/*
 * generate.c -- prefill a prompt, then sample token by token with streaming text, stop
 * strings and end-of-generation tokens.
 *
 * Streaming contract: the callback receives text only once it can no longer become part of
 * a stop string, so a caller never sees text that is later taken back.
 */
#include "../tokenizer/tokenizer.h"
#include "generate.h"

#include <string.h>

kiln_generate_params kiln_generate_default_params(void) {
    kiln_generate_params p;
    memset(&p, 0, sizeof p);
    p.max_tokens = 256;
    p.sampler = kiln_sampler_default_params();
    return p;
}

static kiln_status text_append(kiln_gen_text *g, const char *s, size_t n) {
    if (g->len + n + 1 > g->cap) {
        size_t cap = g->cap ? g->cap : 256;
        while (cap < g->len + n + 1) cap *= 2;
        char *d = kiln_realloc(g->data, cap);
        if (!d) return kiln_error(KILN_ERR_NOMEM, "generate: out of memory for the output text");
        g->data = d;
        g->cap = cap;
    }
    memcpy(g->data + g->len, s, n);
    g->len += n;
    g->data[g->len] = '\0';
    return KILN_OK;
}

/* Earliest occurrence of any stop string in text[from..len): its offset, or -1. */
static long find_stop(const kiln_gen_text *g, size_t from) {
    long best = -1;
    for (size_t i = 0; g->stops && g->stops[i]; i++) {
        size_t sl = strlen(g->stops[i]);
        if (!sl || sl > g->len) continue;
        for (size_t at = from; at + sl <= g->len; at++)
            if (!memcmp(g->data + at, g->stops[i], sl)) {
                if (best < 0 || (long)at < best) best = (long)at;
                break;
            }
    }
    return best;
}

/* Length of the longest suffix of text that is a proper prefix of some stop string. */
static size_t stop_prefix_hold(const kiln_gen_text *g) {
    size_t hold = 0;
    for (size_t i = 0; g->stops && g->stops[i]; i++) {
        size_t sl = strlen(g->stops[i]);
        for (size_t k = sl > 1 ? sl - 1 : 0; k > hold; k--)
            if (k <= g->len && !memcmp(g->data + g->len - k, g->stops[i], k)) {
                hold = k;
                break;
            }
    }
    return hold;
}

static bool is_end_token(const kiln_model *m, int32_t id) {
    if (kiln_tokenizer_is_eog(m->tok, id)) return true;
    for (int i = 0; i < m->cfg.n_eos_ids; i++)
        if (m->cfg.eos_ids[i] == id) return true;
    return false;
}

kiln_status kiln_gen_text_init(kiln_gen_text *g, const kiln_model *m, const char *const *stops, int ignore_eos) {
    memset(g, 0, sizeof *g);
    g->m = m;
    g->stops = stops;
    g->ignore_eos = ignore_eos;
    KILN_TRY(kiln_detok_stream_create(m->tok, 0, &g->ds));
    return text_append(g, "", 0);
}

void kiln_gen_text_free(kiln_gen_text *g) {
    kiln_detok_stream_free(g->ds);
    kiln_free(g->data);
    memset(g, 0, sizeof *g);
}

kiln_status kiln_gen_text_push(kiln_gen_text *g, int32_t id, const char **reason, const char **out, size_t *n_out) {
    *reason = NULL;
    *out = g->data + g->emitted;
    *n_out = 0;
    if (!g->ignore_eos && is_end_token(g->m, id)) {
        *reason = "eos";
        return KILN_OK;
    }
    char piece[256];
    size_t np = 0;
    kiln_status st;
    /* Embeddings may have padding rows past the tokenizer's vocabulary (Qwen2.5 has 151936
     * rows for 151665 tokens): such an id has no text, as in transformers. */
    if (id >= kiln_tokenizer_n_vocab(g->m->tok)) st = KILN_OK;
    else st = kiln_detok_stream_push(g->ds, id, piece, sizeof piece, &np);
    if (st == KILN_ERR_BUFFER_TOO_SMALL) { /* a very long token: retry with its size */
        char *big = kiln_malloc(np);
        st = big ? kiln_detok_stream_push(g->ds, id, big, np, &np) : kiln_error(KILN_ERR_NOMEM, "generate: out of memory");
        if (st == KILN_OK) st = text_append(g, big, np);
        kiln_free(big);
    } else if (st == KILN_OK) {
        st = text_append(g, piece, np);
    }
    if (st != KILN_OK) return st;
    long at = find_stop(g, g->emitted);
    size_t safe;
    if (at >= 0) {
        g->len = (size_t)at;
        g->data[g->len] = '\0';
        safe = g->len;
        *reason = "stop_string";
        g->stopped = 1;
    } else {
        safe = g->len - stop_prefix_hold(g);
    }
    if (safe < g->emitted) safe = g->emitted;
    *out = g->data + g->emitted;
    *n_out = safe - g->emitted;
    g->emitted = safe;
    return KILN_OK;
}

kiln_status kiln_gen_text_flush(kiln_gen_text *g, const char **out, size_t *n_out) {
    *out = g->data + g->emitted;
    *n_out = 0;
    if (g->stopped) return KILN_OK; /* the stop string and what followed are dropped */
    char piece[64];
    size_t np = 0;
    KILN_TRY(kiln_detok_stream_flush(g->ds, piece, sizeof piece, &np));
    KILN_TRY(text_append(g, piece, np));
    *out = g->data + g->emitted;
    *n_out = g->len - g->emitted;
    g->emitted = g->len;
    return KILN_OK;
}

static kiln_status generate(kiln_context *c, const int32_t *prompt, size_t n_prompt,
                            const kiln_generate_params *gp, kiln_generate_result *out);

kiln_status kiln_generate(kiln_context *c, const int32_t *prompt, size_t n_prompt,
                          const kiln_generate_params *gp, kiln_generate_result *out) {
    KILN_TRY(kiln_context_enter(c, "kiln_generate"));
    return kiln_context_leave(c, generate(c, prompt, n_prompt, gp, out), "kiln_generate");
}

static kiln_status generate(kiln_context *c, const int32_t *prompt, size_t n_prompt,
                            const kiln_generate_params *gp, kiln_generate_result *out) {
    if (!prompt || !gp || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_generate: NULL argument");
    if (n_prompt == 0) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_generate: the prompt is empty");
    if (gp->max_tokens < 0) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_generate: max_tokens must be >= 0");
    if (n_prompt > (size_t)c->fs.n_ctx)
        return kiln_error(KILN_ERR_RANGE, "kiln_generate: prompt of %zu tokens exceeds the context length %d",
                          n_prompt, c->fs.n_ctx);
    const kiln_model *m = c->model;
    int V = m->cfg.n_vocab;
    kiln_generate_result r;
    memset(&r, 0, sizeof r);
    kiln_sampler *smp = NULL;
    kiln_gen_text text;
    memset(&text, 0, sizeof text);
    float *logits = NULL;
    int32_t *hist = NULL;
    size_t n_hist = 0;
    kiln_status st = kiln_sampler_create(&gp->sampler, &smp);
    if (st == KILN_OK) st = kiln_gen_text_init(&text, m, gp->stop_strings, gp->ignore_eos);
    if (st == KILN_OK) st = kiln_alloc_or_fail((void **)&logits, (size_t)V * sizeof(float), "logits");
    if (st == KILN_OK)
        st = kiln_alloc_or_fail((void **)&hist, (n_prompt + (size_t)gp->max_tokens + 1) * sizeof(int32_t), "token history");
    if (st != KILN_OK) goto done;
    kiln_receipt_chain chain;
    const kiln_logits_hook *hook = NULL;
    if (gp->logits_chain) {
        st = kiln_receipt_chain_begin(&chain, m, prompt, n_prompt, gp->logits_chain);
        if (st != KILN_OK) goto done;
        hook = &chain.hook;
    }
    memcpy(hist, prompt, n_prompt * sizeof(int32_t));
    n_hist = n_prompt;
    r.n_prompt = (int)n_prompt;
    r.stop_reason = "length";

    /* Reuse the cached prefix the prompt shares with the context (at least the last prompt
     * token is recomputed, for its logits). Ops are batch-invariant, so this gives the same
     * bits as recomputing everything (tests/python/test_parity.py checks it). */
    size_t keep = 0;
    while (keep + 1 < n_prompt && keep < (size_t)c->n_past && c->tokens[keep] == prompt[keep]) keep++;
    /* a recurrent state (linear-attention layers) cannot go back: continue it only where it
     * stands, else start again */
    if (c->fs.state_floats && keep != (size_t)c->n_past) keep = 0;
    c->n_past = (int)keep;
    r.n_prompt_cached = (int)keep;
    /* the prefill and the first token's sampling (on the device where the backend samples:
     * only the id comes back); prefill_seconds includes that sampling */
    int32_t id;
    double t0 = kiln_time_seconds();
    if (gp->max_tokens == 0) /* nothing to sample */
        st = kiln_decode(c, prompt + keep, (int)(n_prompt - keep), 0, logits);
    else
        st = kiln_decode_and_sample(c, prompt + keep, (int)(n_prompt - keep), smp, hist, n_hist, logits, hook, &id);
    r.prefill_seconds = kiln_time_seconds() - t0;
    if (st != KILN_OK) goto done;
    t0 = kiln_time_seconds();
    for (int i = 0; i < gp->max_tokens; i++) {
        hist[n_hist++] = id;
        r.n_ids++;
        const char *reason, *piece;
        size_t np;
        st = kiln_gen_text_push(&text, id, &reason, &piece, &np);
        if (st != KILN_OK) goto done;
        if (reason && !strcmp(reason, "eos")) {
            r.stop_reason = reason;
            break;
        }
        int stop_cb = 0;
        if (gp->on_token) stop_cb = gp->on_token(id, piece, np, gp->user);
        if (reason) {
            r.stop_reason = reason;
            break;
        }
        if (stop_cb) {
            r.stop_reason = "callback";
            break;
        }
        if (i + 1 == gp->max_tokens) break;
        if (c->n_past >= c->fs.n_ctx) {
            r.stop_reason = "context";
            break;
        }
        int32_t next;
        st = kiln_decode_and_sample(c, &id, 1, smp, hist, n_hist, logits, hook, &next);
        if (st != KILN_OK) goto done;
        id = next;
    }
    { /* flush held bytes (nothing after a stop string) */
        const char *tail;
        size_t nt;
        st = kiln_gen_text_flush(&text, &tail, &nt);
        if (st != KILN_OK) goto done;
        if (gp->on_token && nt) gp->on_token(-1, tail, nt, gp->user);
    }
    r.decode_seconds = kiln_time_seconds() - t0;
    r.ids = kiln_malloc((r.n_ids ? r.n_ids : 1) * sizeof(int32_t));
    if (!r.ids) {
        st = kiln_error(KILN_ERR_NOMEM, "generate: out of memory");
        goto done;
    }
    memcpy(r.ids, hist + n_prompt, r.n_ids * sizeof(int32_t));
    r.text = text.data;
    r.text_len = text.len;
    text.data = NULL;
    *out = r;
done:
    kiln_gen_text_free(&text);
    kiln_free(hist);
    kiln_free(logits);
    kiln_sampler_free(smp);
    return st;
}

void kiln_generate_result_free(kiln_generate_result *r) {
    if (!r) return;
    kiln_free(r->ids);
    kiln_free(r->text);
    memset(r, 0, sizeof *r);
}
