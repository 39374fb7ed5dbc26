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

typedef struct text_buf {
    char *data;
    size_t len, cap;
} text_buf;

static kiln_status text_append(text_buf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        char *d = kiln_realloc(b->data, cap);
        if (!d) return kiln_error(KILN_ERR_NOMEM, "generate: out of memory for the output text");
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = '\0';
    return KILN_OK;
}

/* Earliest occurrence of any stop string in text[from..len): its offset, or -1. */
static long find_stop(const text_buf *b, size_t from, const char *const *stops) {
    long best = -1;
    for (size_t i = 0; stops && stops[i]; i++) {
        size_t sl = strlen(stops[i]);
        if (!sl || sl > b->len) continue;
        for (size_t at = from; at + sl <= b->len; at++)
            if (!memcmp(b->data + at, stops[i], sl)) {
                if (best < 0 || (long)at < best) best = (long)at;
                break;
            }
    }
    return best;
}

/* Length of the longest suffix of text that is a proper prefix of some stop string. */
static size_t stop_prefix_hold(const text_buf *b, const char *const *stops) {
    size_t hold = 0;
    for (size_t i = 0; stops && stops[i]; i++) {
        size_t sl = strlen(stops[i]);
        for (size_t k = sl > 1 ? sl - 1 : 0; k > hold; k--)
            if (k <= b->len && !memcmp(b->data + b->len - k, stops[i], k)) {
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
    kiln_detok_stream *ds = NULL;
    text_buf text = {0};
    float *logits = NULL;
    int32_t *hist = NULL;
    size_t n_hist = 0, emitted = 0;
    kiln_status st = kiln_sampler_create(&gp->sampler, &smp);
    if (st == KILN_OK) st = kiln_detok_stream_create(m->tok, 0, &ds);
    if (st == KILN_OK) st = kiln_alloc_or_fail((void **)&logits, (size_t)V * sizeof(float), "logits");
    if (st == KILN_OK)
        st = kiln_alloc_or_fail((void **)&hist, (n_prompt + (size_t)gp->max_tokens + 1) * sizeof(int32_t), "token history");
    if (st == KILN_OK) st = text_append(&text, "", 0);
    if (st != KILN_OK) goto done;
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
        st = kiln_decode_and_sample(c, prompt + keep, (int)(n_prompt - keep), smp, hist, n_hist, logits, &id);
    r.prefill_seconds = kiln_time_seconds() - t0;
    if (st != KILN_OK) goto done;
    t0 = kiln_time_seconds();
    for (int i = 0; i < gp->max_tokens; i++) {
        hist[n_hist++] = id;
        r.n_ids++;
        if (!gp->ignore_eos && is_end_token(m, id)) {
            r.stop_reason = "eos";
            break;
        }
        char piece[256];
        size_t np = 0;
        /* Embeddings may have padding rows past the tokenizer's vocabulary (Qwen2.5 has
         * 151936 rows for 151665 tokens): such an id has no text, as in transformers. */
        if (id >= kiln_tokenizer_n_vocab(m->tok)) st = KILN_OK;
        else st = kiln_detok_stream_push(ds, id, piece, sizeof piece, &np);
        if (st == KILN_ERR_BUFFER_TOO_SMALL) { /* a very long token: retry with its size */
            char *big = kiln_malloc(np);
            st = big ? kiln_detok_stream_push(ds, id, big, np, &np)
                     : kiln_error(KILN_ERR_NOMEM, "generate: out of memory");
            if (st == KILN_OK) st = text_append(&text, big, np);
            kiln_free(big);
        } else if (st == KILN_OK) {
            st = text_append(&text, piece, np);
        }
        if (st != KILN_OK) goto done;
        size_t scan_from = emitted;
        long at = find_stop(&text, scan_from, gp->stop_strings);
        size_t safe;
        if (at >= 0) {
            text.len = (size_t)at;
            text.data[text.len] = '\0';
            safe = text.len;
        } else {
            safe = text.len - stop_prefix_hold(&text, gp->stop_strings);
        }
        if (safe < emitted) safe = emitted;
        int stop_cb = 0;
        if (gp->on_token) stop_cb = gp->on_token(id, text.data + emitted, safe - emitted, gp->user);
        emitted = safe;
        if (at >= 0) {
            r.stop_reason = "stop_string";
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
        st = kiln_decode_and_sample(c, &id, 1, smp, hist, n_hist, logits, &next);
        if (st != KILN_OK) goto done;
        id = next;
    }
    if (strcmp(r.stop_reason, "stop_string") != 0) { /* flush held bytes */
        char piece[64];
        size_t np = 0;
        st = kiln_detok_stream_flush(ds, piece, sizeof piece, &np);
        if (st == KILN_OK) st = text_append(&text, piece, np);
        if (st != KILN_OK) goto done;
        if (gp->on_token && text.len > emitted) gp->on_token(-1, text.data + emitted, text.len - emitted, gp->user);
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
    kiln_free(text.data);
    kiln_free(hist);
    kiln_free(logits);
    kiln_detok_stream_free(ds);
    kiln_sampler_free(smp);
    return st;
}

void kiln_generate_result_free(kiln_generate_result *r) {
    if (!r) return;
    kiln_free(r->ids);
    kiln_free(r->text);
    memset(r, 0, sizeof *r);
}
