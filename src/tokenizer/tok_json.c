/*
 * tok_json.c -- what serde_json (the parser of Hugging Face `tokenizers`) refuses in a
 * tokenizer.json and cJSON accepts, checked on the raw text before cJSON parses it; and the
 * one thing cJSON cannot carry, a NUL inside a string.
 *
 * serde_json refuses a file that is not UTF-8, a raw control character (U+0000..U+001F)
 * inside a string, and a number written with a fraction, an exponent or a sign where the
 * field is a u32 (model.vocab ids, added_tokens[].id: "3.0", "3e0" and "-0" are all refused).
 * cJSON accepts all three and loses the distinction, so they are checked here, on the text,
 * with the JSON path of the offending value in the message.
 *
 * A "\u0000" escape is legal JSON and `tokenizers` keeps it (a Rust String may hold NUL), but
 * cJSON returns NUL-terminated strings, so the NUL would silently cut the string. The escape
 * is rewritten to the two bytes C0 80 (the overlong encoding of U+0000, "modified UTF-8"),
 * which cannot occur in the text once it is known to be valid UTF-8; tok_json_nul_decode turns
 * them back into NUL where kiln keeps a length, and tok_json_has_nul finds them where kiln
 * keeps a C string (those fields are refused by name: see tok_load.c).
 */
#include "tok_internal.h"

#include <stdio.h>
#include <string.h>

#define TJ_MAX_DEPTH 64

typedef struct tj_frame {
    int is_obj;
    int64_t index;       /* array: the element being read */
    const char *key;     /* object: raw (escaped) text of the current key */
    size_t key_len;
    int want_key;        /* object: the next string is a key */
} tj_frame;

typedef struct tj_scan {
    const char *src;
    size_t len, pos;
    const char *label;
    int check_ids;
    tj_frame f[TJ_MAX_DEPTH];
    int depth;           /* frames in use; deeper nesting is not tracked (its path is cut) */
    int nested;          /* true depth, may exceed TJ_MAX_DEPTH */
} tj_scan;

static int tj_key_is(const tj_frame *f, const char *k) {
    return f->is_obj && f->key && f->key_len == strlen(k) && !memcmp(f->key, k, f->key_len);
}

/* A key written as .key in a path: a short identifier (vocabulary strings go in ["..."]). */
static int tj_ident(const char *k, size_t n) {
    if (n == 0 || n > 48) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = k[i];
        if (!(c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (i && c >= '0' && c <= '9')))
            return 0;
    }
    return 1;
}

/* The JSON path of the value being read, e.g. model.vocab["o"] or added_tokens[2].id. */
static void tj_path(const tj_scan *s, char *buf, size_t cap) {
    size_t n = 0;
    buf[0] = 0;
    for (int i = 0; i < s->depth && n + 1 < cap; i++) {
        const tj_frame *f = &s->f[i];
        int w;
        if (!f->is_obj) w = snprintf(buf + n, cap - n, "[%lld]", (long long)f->index);
        else if (!f->key) break;
        else if (tj_ident(f->key, f->key_len) && !(i > 0 && tj_key_is(&s->f[i - 1], "vocab")))
            w = snprintf(buf + n, cap - n, "%s%.*s", n ? "." : "", (int)f->key_len, f->key);
        else w = snprintf(buf + n, cap - n, "[\"%.*s\"]", (int)(f->key_len > 48 ? 48 : f->key_len),
                          f->key);
        if (w < 0) break;
        n += (size_t)w;
        if (n >= cap) n = cap - 1;
    }
    if (!buf[0]) snprintf(buf, cap, "(top level)");
}

/* model.vocab[K] or added_tokens[i].id: a u32 for serde_json. */
static int tj_at_id(const tj_scan *s) {
    if (s->depth != 3 || s->nested != 3) return 0;
    if (tj_key_is(&s->f[0], "model") && tj_key_is(&s->f[1], "vocab") && s->f[2].is_obj) return 1;
    return tj_key_is(&s->f[0], "added_tokens") && !s->f[1].is_obj && tj_key_is(&s->f[2], "id");
}

/* Scan the string at s->pos (just past the opening quote): UTF-8, control characters, and
 * "\u0000" -> C0 80 into out (when out is not NULL); *end: the index just past the closing
 * quote. */
static kiln_status tj_string(tj_scan *s, char *out, size_t *o, size_t *end) {
    const uint8_t *p = (const uint8_t *)s->src;
    size_t i = s->pos;
    while (i < s->len) {
        uint8_t c = p[i];
        if (c == '"') {
            if (out) out[(*o)++] = '"';
            *end = i + 1;
            return KILN_OK;
        }
        char path[200];
        if (c < 0x20) {
            tj_path(s, path, sizeof path);
            return kiln_error(KILN_ERR_FORMAT, "%s: %s: raw control character 0x%02x inside a "
                              "string (JSON wants it escaped; tokenizers refuses it)", s->label,
                              path, c);
        }
        if (c == '\\' && i + 5 < s->len && p[i + 1] == 'u' && !memcmp(p + i + 2, "0000", 4)) {
            if (out) {
                out[(*o)++] = (char)0xC0;
                out[(*o)++] = (char)0x80;
            }
            i += 6;
            continue;
        }
        if (c == '\\' && i + 1 < s->len) { /* any other escape: cJSON decodes it */
            if (out) {
                out[(*o)++] = (char)c;
                out[(*o)++] = (char)p[i + 1];
            }
            i += 2;
            continue;
        }
        int n = c < 0x80 ? 1 : tok_utf8_valid_len(p + i, s->len - i);
        if (n == 0) {
            tj_path(s, path, sizeof path);
            return kiln_error(KILN_ERR_FORMAT, "%s: %s: invalid UTF-8 (byte 0x%02x at offset %zu; "
                              "tokenizers refuses a file that is not UTF-8)", s->label, path, c, i);
        }
        if (out) memcpy(out + *o, p + i, (size_t)n);
        if (out) *o += (size_t)n;
        i += (size_t)n;
    }
    *end = s->len; /* unterminated: cJSON reports it */
    return KILN_OK;
}

kiln_status tok_json_prepare(const char *text, size_t len, const char *label, int check_ids,
                             char **out, size_t *out_len) {
    tj_scan s = {.src = text, .len = len, .label = label, .check_ids = check_ids};
    char *buf = kiln_malloc(len + 1);
    if (!buf) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory (%zu bytes)", label, len);
    size_t o = 0;
    const uint8_t *p = (const uint8_t *)text;
    kiln_status st = KILN_OK;
    while (s.pos < len && st == KILN_OK) {
        uint8_t c = p[s.pos];
        tj_frame *top = s.depth > 0 && s.depth == s.nested ? &s.f[s.depth - 1] : NULL;
        if (c == '"') {
            size_t start = s.pos + 1, end = 0;
            buf[o++] = '"';
            s.pos = start;
            st = tj_string(&s, buf, &o, &end);
            if (st != KILN_OK) break;
            if (top && top->is_obj && top->want_key) {
                top->key = text + start;
                top->key_len = end > start ? end - start - 1 : 0;
                top->want_key = 0;
            }
            s.pos = end;
            continue;
        }
        if (c == '{' || c == '[') {
            if (s.nested < TJ_MAX_DEPTH && s.depth == s.nested) {
                tj_frame *f = &s.f[s.depth++];
                memset(f, 0, sizeof *f);
                f->is_obj = c == '{';
                f->want_key = f->is_obj;
            }
            s.nested++;
        } else if (c == '}' || c == ']') {
            if (s.nested > 0) {
                if (s.depth == s.nested) s.depth--;
                s.nested--;
            }
        } else if (c == ',') {
            if (top && top->is_obj) {
                top->want_key = 1;
                top->key = NULL;
            } else if (top) {
                top->index++;
            }
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            size_t e = s.pos;
            int plain = 1;
            while (e < len && (p[e] == '-' || p[e] == '+' || p[e] == '.' || p[e] == 'e' ||
                               p[e] == 'E' || (p[e] >= '0' && p[e] <= '9'))) {
                if (p[e] < '0' || p[e] > '9') plain = 0;
                e++;
            }
            if (s.check_ids && tj_at_id(&s)) {
                uint64_t v = 0;
                for (size_t k = s.pos; plain && k < e; k++) {
                    v = v * 10 + (uint64_t)(p[k] - '0');
                    if (v > UINT32_MAX) plain = 0;
                }
                if (!plain) {
                    char path[200];
                    tj_path(&s, path, sizeof path);
                    st = kiln_error(KILN_ERR_FORMAT, "%s: %s: id %.*s is not an integer in "
                                    "0..4294967295 (tokenizers wants a u32)", label, path,
                                    (int)(e - s.pos > 32 ? 32 : e - s.pos), text + s.pos);
                    break;
                }
            }
            memcpy(buf + o, text + s.pos, e - s.pos);
            o += e - s.pos;
            s.pos = e;
            continue;
        } else if (c >= 0x80) {
            char path[200];
            tj_path(&s, path, sizeof path);
            st = kiln_error(KILN_ERR_FORMAT, "%s: %s: byte 0x%02x outside a string at offset %zu",
                            label, path, c, s.pos);
            break;
        }
        buf[o++] = (char)c;
        s.pos++;
    }
    if (st != KILN_OK) {
        kiln_free(buf);
        return st;
    }
    buf[o] = 0;
    *out = buf;
    *out_len = o;
    return KILN_OK;
}

int tok_json_has_nul(const char *s) { return s && strstr(s, "\xC0\x80") != NULL; }

size_t tok_json_nul_decode(char *s) {
    size_t o = 0;
    for (size_t i = 0; s[i]; i++) {
        if ((uint8_t)s[i] == 0xC0 && (uint8_t)s[i + 1] == 0x80) {
            s[o++] = 0;
            i++;
        } else {
            s[o++] = s[i];
        }
    }
    s[o] = 0;
    return o;
}
