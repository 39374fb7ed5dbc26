/*
 * tok_decode.c -- ids back to text: per-token bytes, the HF decoder pipeline (ByteLevel,
 * Replace, ByteFallback, Fuse, Strip, Metaspace) and the streaming decoder.
 */
#include "../base/sha256.h"
#include "tok_internal.h"

#include <string.h>

/* A growable byte string. */
typedef struct tok_buf {
    char *p;
    size_t n, cap;
} tok_buf;

static kiln_status buf_add(tok_buf *b, const void *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap : 64;
        while (c < b->n + n + 1) c *= 2;
        char *q = kiln_realloc(b->p, c);
        if (!q) return kiln_error(KILN_ERR_NOMEM, "detokenize: out of memory (%zu bytes)", c);
        b->p = q;
        b->cap = c;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return KILN_OK;
}

/* Append s with invalid UTF-8 replaced (one U+FFFD per maximal invalid subpart, as Rust's
 * String::from_utf8_lossy and Python's errors="replace"). */
static kiln_status buf_add_lossy(tok_buf *b, const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        int k = tok_utf8_valid_len((const uint8_t *)s + i, n - i);
        if (k > 0) {
            size_t j = i + (size_t)k;
            while (j < n && (k = tok_utf8_valid_len((const uint8_t *)s + j, n - j)) > 0) j += (size_t)k;
            KILN_TRY(buf_add(b, s + i, j - i));
            i = j;
        } else {
            KILN_TRY(buf_add(b, "\xef\xbf\xbd", 3));
            i += (size_t)tok_utf8_invalid_len((const uint8_t *)s + i, n - i);
        }
    }
    return KILN_OK;
}

/* Byte-level: the token's bytes if every char is a GPT-2 byte image, else its UTF-8 as is. */
static kiln_status bytelevel_token(tok_buf *b, const char *s, size_t n) {
    size_t start = b->n;
    for (size_t i = 0; i < n;) {
        int k = tok_utf8_valid_len((const uint8_t *)s + i, n - i);
        uint32_t cp = 0;
        if (k == 1) cp = (uint8_t)s[i];
        else if (k == 2) cp = ((uint32_t)(s[i] & 0x1F) << 6) | (s[i + 1] & 0x3F);
        else cp = 0xFFFFFFFFu;
        int byte = k > 0 ? tok_cp_to_byte(cp) : -1;
        if (byte < 0) {
            b->n = start;
            return buf_add(b, s, n);
        }
        uint8_t c = (uint8_t)byte;
        KILN_TRY(buf_add(b, &c, 1));
        i += (size_t)k;
    }
    return KILN_OK;
}

static int byte_token_value(const char *s, size_t n) {
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = (c >= '0' && c <= '9') ? c - '0' : (c >= 'A' && c <= 'F') ? c - 'A' + 10
                : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

/* Replace all pat in s with rep, appending to b. */
static kiln_status add_replaced(tok_buf *b, const char *s, size_t n, const char *pat,
                                const char *rep) {
    size_t pl = strlen(pat), rl = strlen(rep);
    for (size_t i = 0; i < n;) {
        if (pl && i + pl <= n && memcmp(s + i, pat, pl) == 0) {
            KILN_TRY(buf_add(b, rep, rl));
            i += pl;
        } else {
            KILN_TRY(buf_add(b, s + i, 1));
            i++;
        }
    }
    return KILN_OK;
}

/* ---- per token ---------------------------------------------------------------------------- */

/* The bytes of one token without the whole-sequence steps (Strip, the first-token space). */
static kiln_status token_bytes(const kiln_tokenizer *t, int32_t id, int render_special, int first,
                               tok_buf *b) {
    uint8_t a = t->attr[id];
    const char *s = t->piece[id];
    size_t n = t->piece_len[id];
    if (a & TOK_ATTR_UNUSED) return KILN_OK;
    if ((a & TOK_ATTR_SPECIAL) && !render_special) return KILN_OK;
    if (a & TOK_ATTR_BYTE) {
        int v = byte_token_value(s, n);
        if (v >= 0) {
            uint8_t c = (uint8_t)v;
            return buf_add(b, &c, 1);
        }
    }
    if (t->dec_join_space) return buf_add(b, s, n);
    /* run the per-token steps on this one token */
    tok_buf cur = {0}, nxt = {0};
    kiln_status st = buf_add(&cur, s, n);
    for (int k = 0; k < t->n_dec && st == KILN_OK; k++) {
        const tok_dec_step *d = &t->dec[k];
        nxt.n = 0;
        if (d->kind == TOK_DEC_BYTELEVEL) st = bytelevel_token(&nxt, cur.p, cur.n);
        else if (d->kind == TOK_DEC_REPLACE) st = add_replaced(&nxt, cur.p, cur.n, d->a, d->b);
        else if (d->kind == TOK_DEC_METASPACE)
            st = add_replaced(&nxt, cur.p, cur.n, d->a, first && d->start ? "" : " ");
        else continue;
        tok_buf tmp = cur;
        cur = nxt;
        nxt = tmp;
    }
    if (st == KILN_OK) st = buf_add(b, cur.p, cur.n);
    kiln_free(cur.p);
    kiln_free(nxt.p);
    return st;
}

KILN_API kiln_status kiln_token_to_bytes(const kiln_tokenizer *t, int32_t id, int render_special,
                                         char *buf, size_t cap, size_t *n_out) {
    KILN_TRY(kiln_handle_check(t, KILN_HANDLE_TOKENIZER, "kiln_token_to_bytes"));
    if (!n_out || (!buf && cap))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_token_to_bytes: NULL argument");
    if (id < 0 || id >= t->n_vocab)
        return kiln_error(KILN_ERR_RANGE, "kiln_token_to_bytes: id %d outside [0, %d)", id,
                          t->n_vocab);
    tok_buf b = {0};
    kiln_status st = token_bytes(t, id, render_special, 0, &b);
    if (st == KILN_OK) {
        *n_out = b.n;
        if (b.n > cap)
            st = kiln_error(KILN_ERR_BUFFER_TOO_SMALL, "kiln_token_to_bytes: %zu bytes, cap %zu",
                            b.n, cap);
        else if (b.n)
            memcpy(buf, b.p, b.n);
    }
    kiln_free(b.p);
    return st;
}

KILN_API const char *kiln_token_piece(const kiln_tokenizer *t, int32_t id) {
    if (kiln_handle_check(t, KILN_HANDLE_TOKENIZER, "kiln_token_piece") != KILN_OK) return NULL;
    if (id < 0 || id >= t->n_vocab) {
        kiln_error(KILN_ERR_RANGE, "kiln_token_piece: id %d out of range", id);
        return NULL;
    }
    return t->piece[id] ? t->piece[id] : "";
}

/* SHA-256 over every piece, ids 0..n_vocab-1, each up to its first NUL and then one NUL byte
 * (an unused id as ""). Token shards store this value (train/shards.h), so it must not change. */
KILN_API kiln_status kiln_tokenizer_fingerprint(const kiln_tokenizer *t, uint8_t out[32]) {
    KILN_TRY(kiln_handle_check(t, KILN_HANDLE_TOKENIZER, "kiln_tokenizer_fingerprint"));
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_tokenizer_fingerprint: out is NULL");
    kiln_sha256_ctx *c = NULL;
    KILN_TRY(kiln_sha256_init(&c));
    kiln_status st = KILN_OK;
    for (int32_t i = 0; i < t->n_vocab && st == KILN_OK; i++) {
        const char *p = t->piece[i] ? t->piece[i] : "";
        st = kiln_sha256_update(c, p, strlen(p) + 1); /* with its NUL */
    }
    if (st != KILN_OK) {
        kiln_sha256_free(c);
        return st;
    }
    return kiln_sha256_final(c, out);
}

/* ---- whole-sequence decode (HF decoders over a list of token strings) ----------------------- */

typedef struct tok_list {
    tok_buf text;      /* all strings back to back */
    size_t *off, *len; /* per string */
    size_t n, cap;
} tok_list;

static kiln_status list_add(tok_list *l, const char *s, size_t n) {
    if (l->n == l->cap) {
        size_t c = l->cap ? l->cap * 2 : 64;
        size_t *o = kiln_realloc(l->off, c * sizeof *o);
        if (!o) return kiln_error(KILN_ERR_NOMEM, "detokenize: out of memory");
        l->off = o;
        size_t *q = kiln_realloc(l->len, c * sizeof *q);
        if (!q) return kiln_error(KILN_ERR_NOMEM, "detokenize: out of memory");
        l->len = q;
        l->cap = c;
    }
    l->off[l->n] = l->text.n;
    l->len[l->n] = n;
    l->n++;
    return buf_add(&l->text, s, n);
}

static void list_free(tok_list *l) {
    kiln_free(l->text.p);
    kiln_free(l->off);
    kiln_free(l->len);
    memset(l, 0, sizeof *l);
}

#define LS(l, i) ((l)->text.p + (l)->off[i])

static kiln_status dec_step(const tok_dec_step *d, const tok_list *in, tok_list *out) {
    tok_buf tmp = {0};
    kiln_status st = KILN_OK;
    switch (d->kind) {
    case TOK_DEC_BYTELEVEL: {
        tok_buf raw = {0};
        for (size_t i = 0; i < in->n && st == KILN_OK; i++) st = bytelevel_token(&raw, LS(in, i), in->len[i]);
        if (st == KILN_OK) st = buf_add_lossy(&tmp, raw.p ? raw.p : "", raw.n);
        if (st == KILN_OK) st = list_add(out, tmp.p ? tmp.p : "", tmp.n);
        kiln_free(raw.p);
        break;
    }
    case TOK_DEC_REPLACE:
    case TOK_DEC_METASPACE:
        for (size_t i = 0; i < in->n && st == KILN_OK; i++) {
            tmp.n = 0;
            /* HF's Metaspace decoder drops every marker of the first token (not only a
             * leading one) when the scheme prepends, and maps the others to ' ' */
            const char *rep = d->kind == TOK_DEC_REPLACE ? d->b
                              : (i == 0 && d->start) ? "" : " ";
            st = add_replaced(&tmp, LS(in, i), in->len[i], d->a, rep);
            if (st == KILN_OK) st = list_add(out, tmp.p ? tmp.p : "", tmp.n);
        }
        break;
    case TOK_DEC_BYTEFALLBACK: {
        /* a run of <0xXX> tokens becomes its text if valid UTF-8, else one U+FFFD per token */
        size_t i = 0;
        while (i < in->n && st == KILN_OK) {
            size_t j = i;
            tmp.n = 0;
            while (j < in->n) {
                int v = byte_token_value(LS(in, j), in->len[j]);
                if (v < 0) break;
                uint8_t c = (uint8_t)v;
                st = buf_add(&tmp, &c, 1);
                j++;
            }
            if (j == i) {
                st = list_add(out, LS(in, i), in->len[i]);
                i++;
                continue;
            }
            int ok = 1;
            for (size_t k = 0; k < tmp.n;) {
                int L = tok_utf8_valid_len((const uint8_t *)tmp.p + k, tmp.n - k);
                if (L <= 0) { ok = 0; break; }
                k += (size_t)L;
            }
            if (ok) st = list_add(out, tmp.p, tmp.n);
            else
                for (size_t k = i; k < j && st == KILN_OK; k++) st = list_add(out, "\xef\xbf\xbd", 3);
            i = j;
        }
        break;
    }
    case TOK_DEC_FUSE:
        for (size_t i = 0; i < in->n && st == KILN_OK; i++) st = buf_add(&tmp, LS(in, i), in->len[i]);
        if (st == KILN_OK) st = list_add(out, tmp.p ? tmp.p : "", tmp.n);
        break;
    case TOK_DEC_STRIP: {
        size_t cl = strlen(d->a);
        for (size_t i = 0; i < in->n && st == KILN_OK; i++) {
            const char *s = LS(in, i);
            size_t n = in->len[i];
            for (int k = 0; k < d->start && cl && n >= cl && memcmp(s, d->a, cl) == 0; k++) {
                s += cl;
                n -= cl;
            }
            for (int k = 0; k < d->stop && cl && n >= cl && memcmp(s + n - cl, d->a, cl) == 0; k++)
                n -= cl;
            st = list_add(out, s, n);
        }
        break;
    }
    }
    kiln_free(tmp.p);
    return st;
}

static kiln_status detok(const kiln_tokenizer *t, const int32_t *ids, size_t n, int render_special,
                         tok_buf *outb) {
    tok_list a = {0}, b = {0};
    kiln_status st = KILN_OK;
    for (size_t i = 0; i < n && st == KILN_OK; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->n_vocab) {
            st = kiln_error(KILN_ERR_RANGE, "kiln_detokenize: ids[%zu] = %d outside [0, %d)", i, id,
                            t->n_vocab);
            break;
        }
        if (t->attr[id] & TOK_ATTR_UNUSED) continue;
        if ((t->attr[id] & TOK_ATTR_SPECIAL) && !render_special) continue;
        st = list_add(&a, t->piece[id], t->piece_len[id]);
    }
    for (int k = 0; k < t->n_dec && st == KILN_OK; k++) {
        b.n = 0;
        b.text.n = 0;
        st = dec_step(&t->dec[k], &a, &b);
        tok_list tmp = a;
        a = b;
        b = tmp;
    }
    for (size_t i = 0; i < a.n && st == KILN_OK; i++) {
        if (t->dec_join_space && i > 0) st = buf_add(outb, " ", 1);
        if (st == KILN_OK) st = buf_add_lossy(outb, LS(&a, i), a.len[i]);
    }
    list_free(&a);
    list_free(&b);
    return st;
}

KILN_API kiln_status kiln_detokenize(const kiln_tokenizer *t, const int32_t *ids, size_t n,
                                     int render_special, char *buf, size_t cap, size_t *n_out) {
    KILN_TRY(kiln_handle_check(t, KILN_HANDLE_TOKENIZER, "kiln_detokenize"));
    if ((!ids && n) || !n_out || (!buf && cap))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_detokenize: NULL argument");
    tok_buf b = {0};
    kiln_status st = detok(t, ids, n, render_special, &b);
    if (st == KILN_OK) {
        *n_out = b.n;
        if (b.n > cap)
            st = kiln_error(KILN_ERR_BUFFER_TOO_SMALL, "kiln_detokenize: %zu bytes, cap %zu", b.n, cap);
        else if (b.n)
            memcpy(buf, b.p, b.n);
    }
    kiln_free(b.p);
    return st;
}

/* ---- streaming ------------------------------------------------------------------------------ */

struct kiln_detok_stream {
    kiln_handle_head head;  /* first: the registry's magic (base/handle.h) */
    const kiln_tokenizer *t; /* a user of t (and of t's model, when t is a model's) */
    int render_special;
    int strip_first_space; /* the decoder drops one leading space of the whole text */
    int started;           /* some text has been produced */
    int n_tokens;          /* tokens pushed that were not skipped */
    uint8_t pend[4];       /* an incomplete UTF-8 sequence held back */
    size_t n_pend;
};

KILN_API kiln_status kiln_detok_stream_create(const kiln_tokenizer *t, int render_special,
                                              kiln_detok_stream **out) {
    static const char fn[] = "kiln_detok_stream_create";
    KILN_TRY(kiln_handle_check(t, KILN_HANDLE_TOKENIZER, fn));
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_detok_stream_create: out is NULL");
    kiln_detok_stream *s = kiln_calloc(1, sizeof *s);
    if (!s) return kiln_error(KILN_ERR_NOMEM, "kiln_detok_stream_create: out of memory");
    kiln_status st = kiln_handle_register(&s->head, KILN_HANDLE_DETOK_STREAM, fn);
    if (st == KILN_OK && (st = kiln_handle_acquire(t, KILN_HANDLE_TOKENIZER, fn)) != KILN_OK)
        (void)kiln_handle_unregister(&s->head, KILN_HANDLE_DETOK_STREAM, fn);
    if (st == KILN_OK && t->owner && (st = kiln_handle_acquire(t->owner, KILN_HANDLE_MODEL, fn)) != KILN_OK) {
        kiln_handle_release(t, fn);
        (void)kiln_handle_unregister(&s->head, KILN_HANDLE_DETOK_STREAM, fn);
    }
    if (st != KILN_OK) {
        kiln_free(s);
        return st;
    }
    s->t = t;
    s->render_special = render_special;
    for (int k = 0; k < t->n_dec; k++) {
        const tok_dec_step *d = &t->dec[k];
        if (d->kind == TOK_DEC_STRIP && d->start > 0 && !strcmp(d->a, " ")) s->strip_first_space = 1;
    }
    *out = s;
    return KILN_OK;
}

KILN_API void kiln_detok_stream_free(kiln_detok_stream *s) {
    static const char fn[] = "kiln_detok_stream_free";
    if (!s || kiln_handle_unregister(&s->head, KILN_HANDLE_DETOK_STREAM, fn) != KILN_OK) return;
    if (s->t->owner) kiln_handle_release(s->t->owner, fn);
    kiln_handle_release(s->t, fn);
    kiln_free(s);
}

/* Convert pend + bytes into complete text; keep a trailing incomplete sequence. */
static kiln_status stream_emit(kiln_detok_stream *s, const char *bytes, size_t n, int flush,
                               char *buf, size_t cap, size_t *n_out) {
    tok_buf in = {0}, out = {0};
    kiln_status st = buf_add(&in, s->pend, s->n_pend);
    if (st == KILN_OK) st = buf_add(&in, bytes, n);
    size_t keep = 0;
    if (st == KILN_OK && !flush) {
        /* hold back the longest tail (< 4 bytes) that could still become a character */
        for (size_t k = in.n < 3 ? in.n : 3; k >= 1; k--) {
            if (tok_utf8_incomplete((const uint8_t *)in.p + in.n - k, k)) {
                keep = k;
                break;
            }
        }
    }
    if (st == KILN_OK) st = buf_add_lossy(&out, in.p ? in.p : "", in.n - keep);
    size_t skip = 0;
    if (st == KILN_OK && s->strip_first_space && !s->started && out.n > 0 && out.p[0] == ' ') skip = 1;
    if (st == KILN_OK) {
        size_t need = out.n - skip;
        *n_out = need;
        if (need > cap) {
            st = kiln_error(KILN_ERR_BUFFER_TOO_SMALL, "kiln_detok_stream: %zu bytes, cap %zu", need, cap);
        } else {
            if (need) memcpy(buf, out.p + skip, need);
            if (out.n > 0) s->started = 1;
            memcpy(s->pend, in.p + in.n - keep, keep);
            s->n_pend = keep;
        }
    }
    kiln_free(in.p);
    kiln_free(out.p);
    return st;
}

KILN_API kiln_status kiln_detok_stream_push(kiln_detok_stream *s, int32_t id, char *buf,
                                            size_t cap, size_t *n_out) {
    KILN_TRY(kiln_handle_check(s, KILN_HANDLE_DETOK_STREAM, "kiln_detok_stream_push"));
    if (!n_out || (!buf && cap))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_detok_stream_push: NULL argument");
    if (id < 0 || id >= s->t->n_vocab)
        return kiln_error(KILN_ERR_RANGE, "kiln_detok_stream_push: id %d outside [0, %d)", id,
                          s->t->n_vocab);
    tok_buf b = {0};
    const kiln_tokenizer *t = s->t;
    int skipped = (t->attr[id] & TOK_ATTR_UNUSED) ||
                  ((t->attr[id] & TOK_ATTR_SPECIAL) && !s->render_special);
    kiln_status st = token_bytes(t, id, s->render_special, s->n_tokens == 0, &b);
    if (st == KILN_OK) st = stream_emit(s, b.p ? b.p : "", b.n, 0, buf, cap, n_out);
    if (st == KILN_OK && !skipped) s->n_tokens++;
    kiln_free(b.p);
    return st;
}

KILN_API kiln_status kiln_detok_stream_flush(kiln_detok_stream *s, char *buf, size_t cap,
                                             size_t *n_out) {
    KILN_TRY(kiln_handle_check(s, KILN_HANDLE_DETOK_STREAM, "kiln_detok_stream_flush"));
    if (!n_out || (!buf && cap))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_detok_stream_flush: NULL argument");
    return stream_emit(s, "", 0, 1, buf, cap, n_out);
}
