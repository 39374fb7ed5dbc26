/*
 * fuzz_tokenizer.c -- libFuzzer target: arbitrary bytes through kiln_tokenize (both special
 * modes), kiln_detokenize, the streaming decoder and kiln_token_to_bytes.
 *
 * Tokenizers: the shared llama-bpe / llama-spm vocab GGUFs when found (env KILN_SHARED_DIR or
 * the source tree's ../shared), plus a small tokenizer.json embedded here (Metaspace + byte
 * fallback + NFC + added tokens), so the target runs anywhere. The first input byte picks one.
 * Properties checked: no crash; ids in range; streamed text equals detokenized text; every
 * decode is valid UTF-8; re-encoding valid text that has no special strings is stable.
 */
#include "tokenizer/tok_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char EMBEDDED[] =
    "{\"version\":\"1.0\",\"added_tokens\":["
    "{\"id\":0,\"content\":\"<unk>\",\"special\":true},"
    "{\"id\":1,\"content\":\"<s>\",\"special\":true},"
    "{\"id\":2,\"content\":\"</s>\",\"special\":true,\"rstrip\":true},"
    "{\"id\":11,\"content\":\"<sep>\",\"special\":false,\"lstrip\":true}],"
    "\"normalizer\":{\"type\":\"NFC\"},"
    "\"pre_tokenizer\":{\"type\":\"Metaspace\",\"replacement\":\"\\u2581\","
    "\"prepend_scheme\":\"always\",\"split\":true},"
    "\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":\"<s>\","
    "\"type_id\":0}},{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],\"pair\":[],\"special_tokens\":"
    "{\"<s>\":{\"id\":\"<s>\",\"ids\":[1],\"tokens\":[\"<s>\"]}}},"
    "\"decoder\":{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Replace\",\"pattern\":{\"String\":"
    "\"\\u2581\"},\"content\":\" \"},{\"type\":\"ByteFallback\"},{\"type\":\"Fuse\"},{\"type\":"
    "\"Strip\",\"content\":\" \",\"start\":1,\"stop\":0}]},"
    "\"model\":{\"type\":\"BPE\",\"unk_token\":\"<unk>\",\"byte_fallback\":true,\"vocab\":{"
    "\"<unk>\":0,\"<s>\":1,\"</s>\":2,\"<0xE2>\":3,\"<0x9C>\":4,\"<0x93>\":5,\"<0xF0>\":6,"
    "\"<0x9F>\":7,\"<0x98>\":8,\"<0x80>\":9,\"<0x41>\":10,\"<sep>\":11,"
    "\"\\u2581\":12,\"a\":13,\"b\":14,\"c\":15,\"\\u2581a\":16,\"ab\":17,\"\\u2581ab\":18,"
    "\"\\u00e9\":19,\"\\u2581\\u2581\":20},"
    "\"merges\":[\"\\u2581 a\",\"a b\",\"\\u2581a b\",\"\\u2581 \\u2581\"]}}";

#ifndef KILN_FUZZ_SRC
#define KILN_FUZZ_SRC "/work/main"
#endif

#define N_TOK 3
static kiln_tokenizer *toks[N_TOK];
static int n_toks;

static void open_shared(const char *name) {
    const char *env = getenv("KILN_SHARED_DIR");
    char path[2048];
    if (env) snprintf(path, sizeof path, "%s/testdata/tokenizer-vectors/%s", env, name);
    else snprintf(path, sizeof path, "%s/../shared/testdata/tokenizer-vectors/%s", KILN_FUZZ_SRC, name);
    kiln_tokenizer *t = NULL;
    if (kiln_tokenizer_open(path, &t) == KILN_OK) toks[n_toks++] = t;
}

static int valid_utf8(const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        int k = tok_utf8_valid_len((const uint8_t *)s + i, n - i);
        if (k <= 0) return 0;
        i += (size_t)k;
    }
    return 1;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    kiln_tokenizer *t = NULL;
    if (kiln_tokenizer_from_hf_json(EMBEDDED, sizeof EMBEDDED - 1, NULL, 0, "embedded", &t) != KILN_OK) {
        fprintf(stderr, "fuzz_tokenizer: embedded tokenizer.json: %s\n", kiln_last_error());
        abort(); /* the harness itself is broken */
    }
    toks[n_toks++] = t;
    open_shared("ggml-vocab-llama-bpe.gguf");
    open_shared("ggml-vocab-llama-spm.gguf");
    fprintf(stderr, "fuzz_tokenizer: %d tokenizers\n", n_toks);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || size > 4096) return 0;
    kiln_tokenizer *t = toks[data[0] % n_toks];
    int flags = data[0] >> 4;
    const char *text = (const char *)data + 1;
    size_t n = size - 1;
    size_t cap = n * 4 + 16, got = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    kiln_status st = kiln_tokenize(t, text, n, flags & 1, (flags >> 1) & 1, ids, cap, &got);
    if (st != KILN_OK) abort();
    for (size_t i = 0; i < got; i++)
        if (ids[i] < 0 || ids[i] >= kiln_tokenizer_n_vocab(t)) abort();
    int render = (flags >> 2) & 1;
    size_t need = 0;
    st = kiln_detokenize(t, ids, got, render, NULL, 0, &need);
    if (st != KILN_OK && st != KILN_ERR_BUFFER_TOO_SMALL) abort();
    char *dec = malloc(need + 1);
    size_t dn = 0;
    if (kiln_detokenize(t, ids, got, render, dec, need, &dn) != KILN_OK || dn != need) abort();
    if (!valid_utf8(dec, dn)) abort();
    /* streaming gives the same text (up to the leading-space rule of Strip, done once) */
    kiln_detok_stream *s = NULL;
    if (kiln_detok_stream_create(t, render, &s) != KILN_OK) abort();
    size_t scap = need * 2 + 64, sn = 0;
    char *sb = malloc(scap);
    for (size_t i = 0; i < got; i++) {
        size_t k = 0;
        if (kiln_detok_stream_push(s, ids[i], sb + sn, scap - sn, &k) != KILN_OK) abort();
        if (!valid_utf8(sb + sn, k)) abort();
        sn += k;
    }
    size_t k = 0;
    if (kiln_detok_stream_flush(s, sb + sn, scap - sn, &k) != KILN_OK) abort();
    sn += k;
    kiln_detok_stream_free(s);
    if (!valid_utf8(sb, sn)) abort();
    /* byte-level: the stream's hold-back + U+FFFD rule equals the whole-text lossy decode */
    if (t->byte_level && (sn != dn || memcmp(sb, dec, dn) != 0)) abort();
    for (size_t i = 0; i < got && i < 16; i++) {
        char b[256];
        size_t bn;
        st = kiln_token_to_bytes(t, ids[i], 1, b, sizeof b, &bn);
        if (st != KILN_OK && st != KILN_ERR_BUFFER_TOO_SMALL) abort();
    }
    free(sb);
    free(dec);
    free(ids);
    return 0;
}
