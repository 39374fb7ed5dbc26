/*
 * chat.c -- built-in chat templates (ChatML, Llama 3, Gemma), chosen by fingerprints of the
 * model's Jinja template text (or, for a Gemma GGUF that carries none, by its architecture).
 * kiln does not run Jinja: each template family is written out here to produce exactly what
 * jinja2 renders for the reference templates (docs/TOKENIZER.md).
 */
#include "tok_internal.h"

#include <string.h>

const char *tok_detect_chat_template(const char *tmpl) {
    if (!tmpl) return NULL;
    if (strstr(tmpl, "<|im_start|>")) return "chatml";
    if (strstr(tmpl, "<|start_header_id|>")) {
        /* Llama 3.1+ inject a dated system header and tool blocks: not reproduced */
        if (strstr(tmpl, "Cutting Knowledge Date")) return NULL;
        return "llama3";
    }
    if (strstr(tmpl, "<start_of_turn>")) return "gemma";
    return NULL;
}

typedef struct chat_buf {
    char *p;
    size_t n, cap;
} chat_buf;

static kiln_status cb_add(chat_buf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap : 256;
        while (c < b->n + n + 1) {
            if (kiln_mul_overflow(c, 2, &c)) return kiln_error(KILN_ERR_NOMEM, "kiln_chat_apply: too large");
        }
        char *q = kiln_realloc(b->p, c);
        if (!q) return kiln_error(KILN_ERR_NOMEM, "kiln_chat_apply: out of memory (%zu bytes)", c);
        b->p = q;
        b->cap = c;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return KILN_OK;
}

static kiln_status cb_str(chat_buf *b, const char *s) { return cb_add(b, s, strlen(s)); }

/* Jinja's |trim (Python str.strip() over ASCII whitespace). */
static kiln_status cb_trimmed(chat_buf *b, const char *s) {
    size_t n = strlen(s), i = 0;
    while (i < n && strchr(" \t\n\r\f\v", s[i])) i++;
    while (n > i && strchr(" \t\n\r\f\v", s[n - 1])) n--;
    return cb_add(b, s + i, n - i);
}

/* The default system message of a ChatML template: the literal text in
 * '<|im_start|>system\n...<|im_end|>' when it is a plain string (no expression inside).
 * Returns a kiln_malloc'd string (Jinja escapes resolved) or NULL. */
static char *chatml_default_system(const char *tmpl) {
    static const char head[] = "<|im_start|>system";
    for (const char *p = strstr(tmpl, head); p; p = strstr(p + 1, head)) {
        const char *q = p + sizeof head - 1;
        if (*q == '\n') q++;
        else if (q[0] == '\\' && q[1] == 'n') q += 2;
        else continue;
        const char *end = strstr(q, "<|im_end|>");
        if (!end) return NULL;
        int plain = 1;
        for (const char *r = q; r < end; r++)
            if (*r == '\'' || *r == '"' || *r == '{' || *r == '}') {
                if (r > q && r[-1] == '\\') continue;
                plain = 0;
                break;
            }
        if (!plain) continue;
        char *out = kiln_malloc((size_t)(end - q) + 1);
        if (!out) return NULL;
        size_t o = 0;
        for (const char *r = q; r < end; r++) {
            if (*r == '\\' && r + 1 < end) {
                r++;
                out[o++] = *r == 'n' ? '\n' : *r == 't' ? '\t' : *r;
            } else {
                out[o++] = *r;
            }
        }
        out[o] = 0;
        return out;
    }
    return NULL;
}

static kiln_status render_chatml(const kiln_tokenizer *t, const kiln_chat_message *m, size_t n,
                                 int gen, chat_buf *b) {
    /* The default system block is rendered only inside the message loop (loop.first), so an
     * empty conversation gets none, as jinja2 renders the reference templates. */
    if (n > 0 && strcmp(m[0].role, "system") != 0 &&
        strstr(t->chat_template, "'system'")) {
        char *sys = chatml_default_system(t->chat_template);
        if (sys) {
            kiln_status st = cb_str(b, "<|im_start|>system\n");
            if (st == KILN_OK) st = cb_str(b, sys);
            if (st == KILN_OK) st = cb_str(b, "<|im_end|>\n");
            kiln_free(sys);
            KILN_TRY(st);
        }
    }
    for (size_t i = 0; i < n; i++) {
        KILN_TRY(cb_str(b, "<|im_start|>"));
        KILN_TRY(cb_str(b, m[i].role));
        KILN_TRY(cb_str(b, "\n"));
        KILN_TRY(cb_str(b, m[i].content));
        KILN_TRY(cb_str(b, "<|im_end|>\n"));
    }
    if (gen) KILN_TRY(cb_str(b, "<|im_start|>assistant\n"));
    return KILN_OK;
}

static const char *bos_text(const kiln_tokenizer *t) {
    return t->bos_id >= 0 && t->piece[t->bos_id] ? t->piece[t->bos_id] : "";
}

static kiln_status render_llama3(const kiln_tokenizer *t, const kiln_chat_message *m, size_t n,
                                 int gen, chat_buf *b) {
    for (size_t i = 0; i < n; i++) {
        if (i == 0) KILN_TRY(cb_str(b, bos_text(t)));
        KILN_TRY(cb_str(b, "<|start_header_id|>"));
        KILN_TRY(cb_str(b, m[i].role));
        KILN_TRY(cb_str(b, "<|end_header_id|>\n\n"));
        KILN_TRY(cb_trimmed(b, m[i].content));
        KILN_TRY(cb_str(b, "<|eot_id|>"));
    }
    if (gen) KILN_TRY(cb_str(b, "<|start_header_id|>assistant<|end_header_id|>\n\n"));
    return KILN_OK;
}

static kiln_status render_gemma(const kiln_tokenizer *t, const kiln_chat_message *m, size_t n,
                                int gen, chat_buf *b) {
    KILN_TRY(cb_str(b, bos_text(t)));
    const char *system = NULL;
    size_t first = 0;
    if (n > 0 && !strcmp(m[0].role, "system")) {
        int fold = t->chat_template ? strstr(t->chat_template, "first_user_prefix") != NULL
                                    : t->chat_gemma_system;
        if (!fold)
            return kiln_error(KILN_ERR_INVALID_ARG, "kiln_chat_apply: this Gemma template does "
                              "not accept a system message");
        system = m[0].content;
        first = 1;
    }
    for (size_t i = first; i < n; i++) {
        int is_user = !strcmp(m[i].role, "user");
        if (is_user != ((i - first) % 2 == 0))
            return kiln_error(KILN_ERR_INVALID_ARG, "kiln_chat_apply: msgs[%zu]: Gemma's template "
                              "requires roles to alternate user/assistant/user/...", i);
        KILN_TRY(cb_str(b, "<start_of_turn>"));
        KILN_TRY(cb_str(b, !strcmp(m[i].role, "assistant") ? "model" : m[i].role));
        KILN_TRY(cb_str(b, "\n"));
        if (i == first && system) {
            KILN_TRY(cb_str(b, system));
            KILN_TRY(cb_str(b, "\n\n"));
        }
        KILN_TRY(cb_trimmed(b, m[i].content));
        KILN_TRY(cb_str(b, "<end_of_turn>\n"));
    }
    if (gen) KILN_TRY(cb_str(b, "<start_of_turn>model\n"));
    return KILN_OK;
}

KILN_API kiln_status kiln_chat_apply(const kiln_tokenizer *t, const kiln_chat_message *msgs,
                                     size_t n_msgs, int add_generation_prompt, char *buf,
                                     size_t cap, size_t *n_out) {
    KILN_TRY(kiln_handle_check(t, KILN_HANDLE_TOKENIZER, "kiln_chat_apply"));
    if ((!msgs && n_msgs) || !n_out || (!buf && cap))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_chat_apply: NULL argument");
    for (size_t i = 0; i < n_msgs; i++)
        if (!msgs[i].role || !msgs[i].content)
            return kiln_error(KILN_ERR_INVALID_ARG, "kiln_chat_apply: msgs[%zu]: NULL role or content", i);
    const char *name = t->chat_template_name;
    if (!t->chat_template && !name)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: model has no chat template", t->label);
    if (!name)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: chat template not recognized (kiln renders "
                          "chatml, llama3 and gemma templates): %.80s...", t->label, t->chat_template);
    chat_buf b = {0};
    kiln_status st = cb_add(&b, "", 0);
    if (st == KILN_OK) {
        if (!strcmp(name, "chatml")) st = render_chatml(t, msgs, n_msgs, add_generation_prompt, &b);
        else if (!strcmp(name, "llama3")) st = render_llama3(t, msgs, n_msgs, add_generation_prompt, &b);
        else st = render_gemma(t, msgs, n_msgs, add_generation_prompt, &b);
    }
    if (st == KILN_OK) {
        *n_out = b.n;
        if (b.n > cap)
            st = kiln_error(KILN_ERR_BUFFER_TOO_SMALL, "kiln_chat_apply: %zu bytes, cap %zu", b.n, cap);
        else if (b.n)
            memcpy(buf, b.p, b.n);
    }
    kiln_free(b.p);
    return st;
}
