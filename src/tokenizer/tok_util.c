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

kiln_status tok_compile_regex(const char *pattern, size_t len, int literal, const char *label,
                              pcre2_code **out) {
    int err = 0;
    PCRE2_SIZE erroff = 0;
    /* PCRE2 refuses PCRE2_UCP next to PCRE2_LITERAL (it has no character classes to affect) */
    uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, len, opts, &err, &erroff, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: pre-tokenizer regex: %s at offset %zu: %.*s",
                          label, (const char *)msg, (size_t)erroff, (int)(len > 200 ? 200 : len),
                          pattern);
    }
    /* JIT is an optimization only: a failure leaves the interpreter, same results. */
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    *out = re;
    return KILN_OK;
}
