/* tok_util.c -- UTF-8 helpers, GPT-2's byte<->unicode map, regex compilation. */
#include "tok_internal.h"

#include <string.h>

/* GPT-2 (openai/gpt-2 encoder.py bytes_to_unicode): printable Latin-1 bytes stand for
 * themselves; the other 68 bytes map, in byte order, to U+0100 upward. */
static int tok_byte_printable(int b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

uint32_t tok_byte_to_cp(uint8_t b) {
    if (tok_byte_printable(b)) return b;
    uint32_t n = 0;
    for (int i = 0; i < b; i++)
        if (!tok_byte_printable(i)) n++;
    return 256 + n;
}

int tok_cp_to_byte(uint32_t cp) {
    if (cp < 256) return tok_byte_printable((int)cp) ? (int)cp : -1;
    if (cp >= 256 + 68) return -1;
    uint32_t n = 0;
    for (int i = 0; i < 256; i++) {
        if (tok_byte_printable(i)) continue;
        if (256 + n == cp) return i;
        n++;
    }
    return -1;
}

int tok_utf8_encode(uint32_t cp, char *out) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Valid second-byte range for a lead byte (Unicode Table 3-7), 0 hi when the lead is bad. */
static void tok_utf8_second_range(uint8_t lead, uint8_t *lo, uint8_t *hi, int *need) {
    *lo = 0x80;
    *hi = 0xBF;
    *need = 0;
    if (lead >= 0xC2 && lead <= 0xDF) *need = 2;
    else if (lead == 0xE0) { *need = 3; *lo = 0xA0; }
    else if (lead >= 0xE1 && lead <= 0xEC) *need = 3;
    else if (lead == 0xED) { *need = 3; *hi = 0x9F; }
    else if (lead >= 0xEE && lead <= 0xEF) *need = 3;
    else if (lead == 0xF0) { *need = 4; *lo = 0x90; }
    else if (lead >= 0xF1 && lead <= 0xF3) *need = 4;
    else if (lead == 0xF4) { *need = 4; *hi = 0x8F; }
}

/* Number of leading bytes of s that form a prefix of a valid sequence (1..need), and need. */
static int tok_utf8_prefix(const uint8_t *s, size_t n, int *need) {
    if (n == 0) { *need = 0; return 0; }
    if (s[0] < 0x80) { *need = 1; return 1; }
    uint8_t lo, hi;
    tok_utf8_second_range(s[0], &lo, &hi, need);
    if (*need == 0) return 0;
    int k = 1;
    if (k < *need && (size_t)k < n && s[k] >= lo && s[k] <= hi) {
        k++;
        while (k < *need && (size_t)k < n && s[k] >= 0x80 && s[k] <= 0xBF) k++;
    }
    return k;
}

int tok_utf8_valid_len(const uint8_t *s, size_t n) {
    int need;
    int k = tok_utf8_prefix(s, n, &need);
    return (need > 0 && k == need) ? need : 0;
}

int tok_utf8_invalid_len(const uint8_t *s, size_t n) {
    int need;
    int k = tok_utf8_prefix(s, n, &need);
    return k > 0 ? k : 1;
}

/* 1 when s[0..n) is an incomplete but so far valid sequence (could complete with more bytes). */
int tok_utf8_incomplete(const uint8_t *s, size_t n) {
    int need;
    int k = tok_utf8_prefix(s, n, &need);
    return need > 1 && (size_t)k == n && k < need;
}

/* Unicode's White_Space property: \t..\r, U+0085 and the separators \p{Z} (Zs, Zl, Zp). Ends
 * with a class escape, so a '-' written after \s in a class cannot make a range of it. */
#define TOK_WHITE_SPACE "\\t-\\r\\x{85}\\p{Z}"

/* Under PCRE2_UCP, PCRE2's \s is Perl's space, which still holds U+180E MONGOLIAN VOWEL
 * SEPARATOR (a space until Unicode 6.3); Rust's regex (tiktoken), Oniguruma (tokenizers) and
 * llama.cpp take Unicode's White_Space, which does not. So \s becomes [TOK_WHITE_SPACE] (in a
 * class, its items) and \S outside a class [^TOK_WHITE_SPACE]. In a class \S keeps PCRE2's
 * meaning (a class cannot subtract a set; no pattern kiln knows has one). \Q..\E text and
 * \c's operand are copied as they are. Returns a kiln_malloc'd, NUL-terminated pattern. */
static char *tok_regex_white_space(const char *p, size_t len, size_t *out_len) {
    static const char in_set[] = TOK_WHITE_SPACE, set[] = "[" TOK_WHITE_SPACE "]",
                      not_set[] = "[^" TOK_WHITE_SPACE "]";
    size_t cap; /* each 2-byte escape grows to at most sizeof not_set - 1 bytes */
    if (kiln_mul_overflow(len, sizeof not_set, &cap) || kiln_add_overflow(cap, 1, &cap))
        return NULL;
    char *out = kiln_malloc(cap);
    if (!out) return NULL;
    size_t o = 0;
    int in_class = 0;
    for (size_t i = 0; i < len; i++) {
        char c = p[i];
        if (c == '\\' && i + 1 < len) {
            char e = p[++i];
            const char *sub = NULL;
            if (e == 's') sub = in_class ? in_set : set;
            else if (e == 'S' && !in_class) sub = not_set;
            if (sub) {
                memcpy(out + o, sub, strlen(sub));
                o += strlen(sub);
                continue;
            }
            out[o++] = c;
            out[o++] = e;
            if (e == 'c' && i + 1 < len) out[o++] = p[++i];
            if (e == 'Q') /* to the \E (kept) or the end */
                for (; i + 1 < len && !(p[i + 1] == '\\' && i + 2 < len && p[i + 2] == 'E'); i++)
                    out[o++] = p[i + 1];
            continue;
        }
        out[o++] = c;
        if (!in_class && c == '[') {
            in_class = 1;
            if (i + 1 < len && p[i + 1] == '^') out[o++] = p[++i];
            if (i + 1 < len && p[i + 1] == ']') out[o++] = p[++i]; /* a literal ']' first */
        } else if (in_class && c == '[' && i + 1 < len && p[i + 1] == ':') {
            for (; i + 1 < len && !(p[i] == ':' && p[i + 1] == ']'); i++)
                out[o++] = p[i + 1];
            if (i + 1 < len) out[o++] = p[++i]; /* [:name:] */
        } else if (in_class && c == ']') {
            in_class = 0;
        }
    }
    out[o] = 0;
    *out_len = o;
    return out;
}

kiln_status tok_compile_regex(const char *pattern, size_t len, int literal, const char *label,
                              pcre2_code **out) {
    int err = 0;
    PCRE2_SIZE erroff = 0;
    /* PCRE2 refuses PCRE2_UCP next to PCRE2_LITERAL (it has no character classes to affect) */
    uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    size_t rlen = len;
    char *rewritten = literal ? NULL : tok_regex_white_space(pattern, len, &rlen);
    if (!literal && !rewritten)
        return kiln_error(KILN_ERR_NOMEM, "%s: pre-tokenizer regex: out of memory", label);
    pcre2_code *re =
        pcre2_compile((PCRE2_SPTR)(literal ? pattern : rewritten), rlen, opts, &err, &erroff, NULL);
    kiln_free(rewritten);
    int as_written = 1; /* the error's offset is in the pattern as written */
    if (!re && !literal) {
        int err0 = 0;
        PCRE2_SIZE erroff0 = 0;
        pcre2_code *re0 = pcre2_compile((PCRE2_SPTR)pattern, len, opts, &err0, &erroff0, NULL);
        if (!re0) {
            err = err0;
            erroff = erroff0;
        }
        as_written = !re0; /* else only the rewrite fails (too large) */
        pcre2_code_free(re0);
    }
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        if (!as_written)
            return kiln_error(KILN_ERR_UNSUPPORTED, "%s: pre-tokenizer regex: %s with \\s as "
                              "Unicode White_Space: %.*s", label, (const char *)msg,
                              (int)(len > 200 ? 200 : len), pattern);
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: pre-tokenizer regex: %s at offset %zu: %.*s",
                          label, (const char *)msg, (size_t)erroff, (int)(len > 200 ? 200 : len),
                          pattern);
    }
    /* JIT is an optimization only: a failure leaves the interpreter, same results. */
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    *out = re;
    return KILN_OK;
}
