/*
 * test_tokenizer_vectors.c -- llama.cpp's tokenizer test vectors (see
 * shared/testdata/tokenizer-vectors/README.md): every text of every supported vocabulary must
 * encode to exactly the expected ids (no BOS, special strings not parsed). Also decode round
 * trips, streaming decode, buffer-size contracts and hostile inputs on the same vocabularies.
 */
#include "test_util.h"
#include "tokenizer/tokenizer.h"

#include <stdint.h>

static char *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)sz + 1);
    if (b && fread(b, 1, (size_t)sz, f) != (size_t)sz) {
        free(b);
        b = NULL;
    }
    if (b) b[sz] = 0;
    fclose(f);
    *n = (size_t)sz;
    return b;
}

static const char SEP[] = "\n__ggml_vocab_test__\n";

/* Check round trip decode(encode(text)) == text where HF's decode gives the text back. */
static void check_roundtrip(const kiln_tokenizer *t, const char *name, const char *text, size_t n,
                            const int32_t *ids, size_t nid, int spm) {
    size_t need = 0;
    kiln_status st = kiln_detokenize(t, ids, nid, 0, NULL, 0, &need);
    CHECK_MSG(st == KILN_OK || st == KILN_ERR_BUFFER_TOO_SMALL, "%s: detokenize size", name);
    char *out = malloc(need + 1);
    size_t got = 0;
    CHECK(kiln_detokenize(t, ids, nid, 0, out, need, &got) == KILN_OK && got == need);
    /* SentencePiece decode drops the one leading space it added; texts starting with a space
     * lose it too (HF behaves the same), so compare from the first non-space for those. */
    if (!spm || (n > 0 && text[0] != ' ')) {
        CHECK_MSG(got == n && memcmp(out, text, n) == 0, "%s: round trip of '%.*s' gave '%.*s'",
                  name, (int)n, text, (int)got, out);
    }
    /* streaming decode of the same ids concatenates to the same text */
    kiln_detok_stream *s = NULL;
    CHECK(kiln_detok_stream_create(t, 0, &s) == KILN_OK);
    char *sb = malloc(need + 64);
    size_t sn = 0;
    for (size_t i = 0; i < nid && s; i++) {
        size_t k = 0;
        CHECK(kiln_detok_stream_push(s, ids[i], sb + sn, need + 64 - sn, &k) == KILN_OK);
        sn += k;
    }
    size_t k = 0;
    if (s) CHECK(kiln_detok_stream_flush(s, sb + sn, need + 64 - sn, &k) == KILN_OK);
    sn += k;
    CHECK_MSG(sn == got && memcmp(sb, out, got) == 0, "%s: stream decode differs for '%.*s'",
              name, (int)n, text);
    kiln_detok_stream_free(s);
    free(sb);
    free(out);
}

static void run_vocab(const char *dir, const char *vocab, int spm) {
    char path[1100], inp[1200], outp[1200];
    snprintf(path, sizeof path, "%s/ggml-vocab-%s.gguf", dir, vocab);
    snprintf(inp, sizeof inp, "%s.inp", path);
    snprintf(outp, sizeof outp, "%s.out", path);
    kiln_tokenizer *t = NULL;
    kiln_status st = kiln_tokenizer_open(path, &t);
    CHECK_MSG(st == KILN_OK, "%s: open: %s", vocab, kiln_last_error());
    if (st != KILN_OK) return;
    size_t ni = 0, no = 0;
    char *in = read_all(inp, &ni), *out = read_all(outp, &no);
    CHECK(in && out);
    int total = 0, pass = 0;
    char *p = in, *q = out;
    size_t cap = 1 << 16;
    int32_t *ids = malloc(cap * sizeof *ids);
    while (in && out && *p) {
        char *e = strstr(p, SEP);
        if (!e) break;
        size_t tn = (size_t)(e - p);
        char *nl = strchr(q, '\n');
        if (!nl) nl = q + strlen(q);
        /* expected ids */
        int32_t want[4096];
        size_t nw = 0;
        for (char *r = q; r < nl;) {
            char *end;
            long v = strtol(r, &end, 10);
            if (end == r) break;
            want[nw++] = (int32_t)v;
            r = end;
        }
        size_t got = 0;
        st = kiln_tokenize(t, p, tn, 0, 0, ids, cap, &got);
        int ok = st == KILN_OK && got == nw && memcmp(ids, want, nw * sizeof *ids) == 0;
        total++;
        pass += ok;
        if (!ok) {
            fprintf(stderr, "%s: case %d '%.*s': got", vocab, total, (int)tn, p);
            for (size_t i = 0; i < got && i < 40; i++) fprintf(stderr, " %d", ids[i]);
            fprintf(stderr, "\n   want");
            for (size_t i = 0; i < nw && i < 40; i++) fprintf(stderr, " %d", want[i]);
            fprintf(stderr, "\n");
        }
        CHECK(ok);
        if (ok) check_roundtrip(t, vocab, p, tn, ids, got, spm);
        /* too-small buffer: exact count reported */
        if (ok && got > 0) {
            size_t need = 0;
            CHECK(kiln_tokenize(t, p, tn, 0, 0, ids, got - 1, &need) == KILN_ERR_BUFFER_TOO_SMALL &&
                  need == got);
        }
        p = e + sizeof SEP - 1;
        q = *nl ? nl + 1 : nl;
    }
    printf("%-10s %d/%d cases pass\n", vocab, pass, total);
    CHECK(total == 46);

    /* hostile inputs: invalid UTF-8, NUL bytes, ids out of range */
    const char bad[] = "ab\xff\xfe c\xe2\x82 \xf0\x9f\x98 d\xc0\x80 \xed\xa0\x80 \x00x";
    size_t got = 0;
    CHECK(kiln_tokenize(t, bad, sizeof bad - 1, 1, 1, ids, cap, &got) == KILN_OK && got > 0);
    /* the rule: invalid bytes encode exactly like U+FFFD (one per maximal invalid subpart) */
    const char fixed[] = "ab\xef\xbf\xbd\xef\xbf\xbd c\xef\xbf\xbd \xef\xbf\xbd d\xef\xbf\xbd"
                         "\xef\xbf\xbd \xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd \x00x";
    int32_t ids2[256];
    size_t got2 = 0;
    CHECK(kiln_tokenize(t, fixed, sizeof fixed - 1, 1, 1, ids2, 256, &got2) == KILN_OK);
    CHECK(got == got2 && memcmp(ids, ids2, got * sizeof *ids) == 0);
    int32_t bad_ids[] = {0, -1};
    char buf[64];
    CHECK_ERR(kiln_detokenize(t, bad_ids, 2, 0, buf, sizeof buf, &got), KILN_ERR_RANGE, "ids[1]");
    int32_t big = kiln_tokenizer_n_vocab(t);
    CHECK_ERR(kiln_token_to_bytes(t, big, 0, buf, sizeof buf, &got), KILN_ERR_RANGE, "outside");

    /* streaming: a 4-byte emoji split over byte tokens is held until complete */
    if (spm) {
        int32_t e[4];
        for (int i = 0; i < 4; i++) {
            char nm[8];
            snprintf(nm, sizeof nm, "<0x%02X>", (unsigned)(uint8_t)"\xf0\x9f\x98\x80"[i]);
            e[i] = -1;
            for (int32_t id = 0; id < 300; id++)
                if (!strcmp(kiln_token_piece(t, id), nm)) e[i] = id;
        }
        kiln_detok_stream *s = NULL;
        CHECK(kiln_detok_stream_create(t, 0, &s) == KILN_OK);
        size_t k = 0, tot = 0;
        for (int i = 0; i < 3; i++) {
            CHECK(kiln_detok_stream_push(s, e[i], buf, sizeof buf, &k) == KILN_OK && k == 0);
        }
        CHECK(kiln_detok_stream_push(s, e[3], buf, sizeof buf, &k) == KILN_OK && k == 4 &&
              memcmp(buf, "\xf0\x9f\x98\x80", 4) == 0);
        /* an incomplete sequence at the end becomes U+FFFD on flush */
        CHECK(kiln_detok_stream_push(s, e[0], buf, sizeof buf, &k) == KILN_OK && k == 0);
        CHECK(kiln_detok_stream_flush(s, buf, sizeof buf, &tot) == KILN_OK && tot == 3 &&
              memcmp(buf, "\xef\xbf\xbd", 3) == 0);
        kiln_detok_stream_free(s);
    }
    free(ids);
    free(in);
    free(out);
    kiln_tokenizer_close(t);
}

static void perf_check(const char *dir) {
    char path[1100];
    snprintf(path, sizeof path, "%s/ggml-vocab-llama-bpe.gguf", dir);
    kiln_tokenizer *t = NULL;
    if (kiln_tokenizer_open(path, &t) != KILN_OK) return;
    /* 100 KB of mixed text, plus a 100 KB run without spaces (worst case for one pre-token) */
    size_t n = 100000;
    char *a = malloc(n + 1), *b = malloc(n + 1);
    const char *words = "The quick brown fox 12345 jumps; over\tthe lazy dog's back.\n";
    for (size_t i = 0; i < n; i++) {
        a[i] = words[i % strlen(words)];
        b[i] = (char)('a' + (i * 7 + i / 13) % 26);
    }
    int32_t *ids = malloc(n * sizeof *ids);
    size_t got;
    double t0 = kiln_time_seconds();
    CHECK(kiln_tokenize(t, a, n, 0, 0, ids, n, &got) == KILN_OK);
    double t1 = kiln_time_seconds();
    CHECK(kiln_tokenize(t, b, n, 0, 0, ids, n, &got) == KILN_OK);
    double t2 = kiln_time_seconds();
    printf("perf: 100 KB text %.1f ms, 100 KB single word %.1f ms\n", (t1 - t0) * 1e3, (t2 - t1) * 1e3);
    CHECK(t1 - t0 < 1.0 && t2 - t1 < 1.0);
    free(a);
    free(b);
    free(ids);
    kiln_tokenizer_close(t);
}

int main(void) {
    const char *env = getenv("KILN_SHARED_DIR");
    char dir[1024];
    if (env) snprintf(dir, sizeof dir, "%s/testdata/tokenizer-vectors", env);
    else snprintf(dir, sizeof dir, "%s", KILN_SOURCE_DIR "/../shared/testdata/tokenizer-vectors");
    char probe[1100];
    snprintf(probe, sizeof probe, "%s/ggml-vocab-gpt-2.gguf", dir);
    FILE *f = fopen(probe, "rb");
    if (!f) { /* 77: ctest's SKIP_RETURN_CODE, so the run reports it skipped, not passed */
        printf("SKIPPED: tokenizer vectors not found at %s\n", dir);
        return 77;
    }
    fclose(f);
    run_vocab(dir, "llama-bpe", 0);
    run_vocab(dir, "llama-spm", 1);
    run_vocab(dir, "qwen2", 0);
    run_vocab(dir, "gpt-2", 0);
    perf_check(dir);
    return test_finish("test_tokenizer_vectors");
}
