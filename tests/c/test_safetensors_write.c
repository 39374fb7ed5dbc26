/*
 * test_safetensors_write.c -- the writers of the Hugging Face export:
 *   - safetensors: every dtype written and read back by kiln's reader bit for bit, header
 *     8-byte aligned and padded with spaces, layout order (element size, then name), the
 *     fill callback, refused arguments, and failures (a fill error, a file-size limit that
 *     makes write() fail like a full disk) leave nothing behind and the old file intact;
 *   - tokenizer.json / tokenizer_config.json written from GGUF vocabularies (byte-level BPE:
 *     gpt-2, llama-bpe, qwen2; SentencePiece: llama-spm) and loaded back by kiln's
 *     tokenizer.json loader: the same ids for every text of the shared test vectors, the same
 *     decoded text, the same special-token ids. (HF `tokenizers` against the written files is
 *     checked in tests/python/test_export.py.)
 *   - config.json round trip: kiln_hf_config_write then kiln_hf_config_parse gives the same
 *     kiln_model_config for each architecture and RoPE scaling.
 */
#include "../../src/formats/hf_config.h"
#include "../../src/formats/hf_export.h"
#include "../../src/formats/safetensors.h"
#include "../../src/formats/safetensors_write.h"
#include "../../src/tokenizer/tokenizer.h"
#include "test_util.h"

#include <dirent.h>
#include <signal.h>
#include <stdint.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[256];

static int count_entries(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    if (d) closedir(d);
    return n;
}

static kiln_status fill_pattern(void *user, int i, void *buf, size_t nbytes) {
    (void)user;
    uint8_t *b = buf;
    for (size_t k = 0; k < nbytes; k++) b[k] = (uint8_t)(k * 31 + (size_t)i * 7 + 1);
    return KILN_OK;
}

static kiln_status fill_fail(void *user, int i, void *buf, size_t nbytes) {
    (void)user;
    (void)buf;
    (void)nbytes;
    return kiln_error(KILN_ERR_IO, "fill %d refused", i);
}

static void test_roundtrip(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/a.safetensors", g_dir);
    float w[6] = {1.5f, -2.25f, 0.0f, -0.0f, 3.4e38f, 1e-42f};
    uint16_t bf[5] = {0x3f80, 0xbf80, 0x7f80, 0x0001, 0x7fc1};
    int64_t i64[3] = {-1, INT64_MAX, 42};
    kiln_st_write_tensor ts[5] = {
        {.name = "z.weight", .dtype = KILN_DTYPE_F32, .n_dims = 2, .shape = {2, 3}, .data = w},
        {.name = "b.bias", .dtype = KILN_DTYPE_BF16, .n_dims = 1, .shape = {5}, .data = bf},
        {.name = "ids", .dtype = KILN_DTYPE_I64, .n_dims = 1, .shape = {3}, .data = i64},
        {.name = "filled", .dtype = KILN_DTYPE_F16, .n_dims = 3, .shape = {2, 1, 7}, .data = NULL},
        {.name = "a.weight", .dtype = KILN_DTYPE_F32, .n_dims = 1, .shape = {0}, .data = w},
    };
    const char *meta[] = {"format", "pt", NULL};
    kiln_status st = kiln_safetensors_write(path, ts, 5, meta, fill_pattern, NULL);
    CHECK_MSG(st == KILN_OK, "%s", kiln_last_error());
    CHECK(count_entries(g_dir) == 1); /* no temporary left */

    /* raw layout: header length a multiple of 8, space padded, metadata, tensor order */
    FILE *f = fopen(path, "rb");
    uint64_t hl = 0;
    CHECK(f && fread(&hl, 8, 1, f) == 1);
    CHECK(hl % 8 == 0 && hl < 4096);
    char hdr[4096] = {0};
    CHECK(f && fread(hdr, 1, (size_t)hl, f) == hl);
    if (f) fclose(f);
    CHECK(hdr[0] == '{');
    size_t jl = strlen(hdr);
    while (jl > 0 && hdr[jl - 1] == ' ') jl--;
    CHECK(hdr[jl - 1] == '}' && hl - jl < 8);
    CHECK(strstr(hdr, "\"__metadata__\":{\"format\":\"pt\"}") != NULL);
    /* 8-byte elements first, then 4 (a.weight before z.weight), then 2 (b.bias, filled) */
    const char *o_ids = strstr(hdr, "\"ids\""), *o_a = strstr(hdr, "\"a.weight\"");
    const char *o_z = strstr(hdr, "\"z.weight\""), *o_b = strstr(hdr, "\"b.bias\"");
    const char *o_f = strstr(hdr, "\"filled\"");
    CHECK(o_ids && o_a && o_z && o_b && o_f && o_ids < o_a && o_a < o_z && o_z < o_b && o_b < o_f);
    CHECK(strstr(hdr, "\"ids\":{\"dtype\":\"I64\",\"shape\":[3],\"data_offsets\":[0,24]}") != NULL);

    kiln_safetensors *s = NULL;
    st = kiln_safetensors_open(path, 1, &s);
    CHECK_MSG(st == KILN_OK, "%s", kiln_last_error());
    if (st != KILN_OK) return;
    CHECK(kiln_safetensors_n_tensors(s) == 5);
    const kiln_tensor *t = kiln_safetensors_find(s, "z.weight");
    CHECK(t && t->dtype == KILN_DTYPE_F32 && t->n_dims == 2 && t->shape[0] == 2 && t->shape[1] == 3 &&
          t->nbytes == sizeof w && !memcmp(t->data, w, sizeof w));
    t = kiln_safetensors_find(s, "b.bias");
    CHECK(t && t->dtype == KILN_DTYPE_BF16 && t->n_dims == 1 && t->shape[0] == 5 && !memcmp(t->data, bf, sizeof bf));
    t = kiln_safetensors_find(s, "ids");
    CHECK(t && t->dtype == KILN_DTYPE_I64 && !memcmp(t->data, i64, sizeof i64));
    t = kiln_safetensors_find(s, "a.weight");
    CHECK(t && t->nbytes == 0 && t->shape[0] == 0);
    t = kiln_safetensors_find(s, "filled");
    CHECK(t && t->dtype == KILN_DTYPE_F16 && t->n_dims == 3 && t->shape[2] == 7 && t->nbytes == 28);
    if (t) {
        uint8_t want[28];
        fill_pattern(NULL, 3, want, sizeof want);
        CHECK(!memcmp(t->data, want, sizeof want));
    }
    kiln_safetensors_close(s);
}

static void test_refusals_and_failures(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/b.safetensors", g_dir);
    float w[4] = {1, 2, 3, 4};
    kiln_st_write_tensor ok = {.name = "w", .dtype = KILN_DTYPE_F32, .n_dims = 1, .shape = {4}, .data = w};
    CHECK(kiln_safetensors_write(path, &ok, 1, NULL, NULL, NULL) == KILN_OK);
    struct stat before;
    CHECK(stat(path, &before) == 0);
    int n0 = count_entries(g_dir);

    kiln_st_write_tensor dup[2] = {ok, ok};
    CHECK_ERR(kiln_safetensors_write(path, dup, 2, NULL, NULL, NULL), KILN_ERR_INVALID_ARG, "appears twice");
    kiln_st_write_tensor q = ok;
    q.dtype = KILN_DTYPE_Q4_0;
    CHECK_ERR(kiln_safetensors_write(path, &q, 1, NULL, NULL, NULL), KILN_ERR_INVALID_ARG, "q4_0");
    kiln_st_write_tensor meta = ok;
    meta.name = "__metadata__";
    CHECK_ERR(kiln_safetensors_write(path, &meta, 1, NULL, NULL, NULL), KILN_ERR_INVALID_ARG, "reserved");
    kiln_st_write_tensor neg = ok;
    neg.shape[0] = -4;
    CHECK_ERR(kiln_safetensors_write(path, &neg, 1, NULL, NULL, NULL), KILN_ERR_INVALID_ARG, "shape[0]");
    kiln_st_write_tensor nodata = ok;
    nodata.data = NULL;
    CHECK_ERR(kiln_safetensors_write(path, &nodata, 1, NULL, NULL, NULL), KILN_ERR_INVALID_ARG, "no fill");
    /* a fill callback error aborts: nothing new on disk, old file untouched */
    CHECK_ERR(kiln_safetensors_write(path, &nodata, 1, NULL, fill_fail, NULL), KILN_ERR_IO, "fill 0 refused");
    CHECK(count_entries(g_dir) == n0);

    /* write() failing (EFBIG under a file-size limit, as ENOSPC on a full disk) */
    static float big[1 << 16];
    kiln_st_write_tensor large = {.name = "big", .dtype = KILN_DTYPE_F32, .n_dims = 1, .shape = {1 << 16}, .data = big};
    struct rlimit old, lim;
    getrlimit(RLIMIT_FSIZE, &old);
    lim = old;
    lim.rlim_cur = 100000;
    signal(SIGXFSZ, SIG_IGN);
    CHECK(setrlimit(RLIMIT_FSIZE, &lim) == 0);
    kiln_status st = kiln_safetensors_write(path, &large, 1, NULL, NULL, NULL);
    setrlimit(RLIMIT_FSIZE, &old);
    CHECK_MSG(st == KILN_ERR_IO && strstr(kiln_last_error(), "write failed"), "%d %s", (int)st, kiln_last_error());
    CHECK(count_entries(g_dir) == n0);
    struct stat after;
    CHECK(stat(path, &after) == 0 && after.st_size == before.st_size && after.st_ino == before.st_ino);
    kiln_safetensors *s = NULL;
    CHECK(kiln_safetensors_open(path, 1, &s) == KILN_OK);
    const kiln_tensor *t = s ? kiln_safetensors_find(s, "w") : NULL;
    CHECK(t && !memcmp(t->data, w, sizeof w));
    kiln_safetensors_close(s);

    /* a folder that does not exist */
    char bad[600];
    snprintf(bad, sizeof bad, "%s/no/such/dir/x.safetensors", g_dir);
    CHECK_ERR(kiln_safetensors_write(bad, &ok, 1, NULL, NULL, NULL), KILN_ERR_IO, "cannot create");
    CHECK(count_entries(g_dir) == n0);
}

/* ---- config.json ------------------------------------------------------------------------- */

static void config_roundtrip(const char *label, kiln_model_config c) {
    char *text = NULL;
    kiln_status st = kiln_hf_config_write(&c, "float32", &text);
    CHECK_MSG(st == KILN_OK, "%s: %s", label, kiln_last_error());
    if (st != KILN_OK) return;
    kiln_model_config back;
    st = kiln_hf_config_parse(text, strlen(text), label, &back);
    CHECK_MSG(st == KILN_OK, "%s: %s\n%s", label, kiln_last_error(), text);
    CHECK_MSG(st == KILN_OK && memcmp(&back, &c, sizeof c) == 0, "%s: config differs after the round trip\n%s",
              label, text);
    kiln_free(text);
}

static void test_config(void) {
    kiln_model_config c;
    memset(&c, 0, sizeof c);
    c.arch = KILN_ARCH_LLAMA;
    c.n_layer = 3;
    c.n_embd = 64;
    c.n_head = 4;
    c.n_head_kv = 2;
    c.head_dim = 16;
    c.n_ff = 160;
    c.n_vocab = 448;
    c.n_ctx_train = 256;
    c.rms_eps = 1e-5f;
    c.rope_theta = 10000.0f;
    c.rope_factor = 1.0f;
    c.bos_id = -1;
    c.eos_id = 0;
    c.eos_ids[0] = 0;
    c.n_eos_ids = 1;
    config_roundtrip("llama", c);
    kiln_model_config d = c;
    d.tie_embeddings = 1;
    d.attn_bias = d.attn_out_bias = d.mlp_bias = 1;
    d.rope_scaling = KILN_ROPE_SCALING_LLAMA3;
    d.rope_theta = 500000.0f;
    d.rope_factor = 8.0f;
    d.rope_low_freq_factor = 1.0f;
    d.rope_high_freq_factor = 4.0f;
    d.rope_original_max_pos = 32;
    d.bos_id = 1;
    d.eos_ids[1] = 7;
    d.n_eos_ids = 2;
    config_roundtrip("llama3 rope, biases, two eos", d);
    d = c;
    d.rope_scaling = KILN_ROPE_SCALING_LINEAR;
    d.rope_factor = 2.0f;
    d.rms_eps = 1e-6f;
    config_roundtrip("linear rope", d);
    d = c;
    d.arch = KILN_ARCH_MISTRAL;
    config_roundtrip("mistral", d);
    d.sliding_window = 64;
    config_roundtrip("mistral window", d);
    d = c;
    d.arch = KILN_ARCH_QWEN2;
    d.attn_bias = 1;
    d.eos_id = -1;
    d.n_eos_ids = 0;
    config_roundtrip("qwen2, no eos", d);
    d.sliding_window = 128;
    config_roundtrip("qwen2 window", d);
    d = c;
    d.arch = KILN_ARCH_QWEN3;
    d.qk_norm = 1;
    d.head_dim = 32;
    config_roundtrip("qwen3", d);
    /* what transformers cannot say */
    d = c;
    d.attn_bias = 1;
    char *text = NULL;
    CHECK_ERR(kiln_hf_config_write(&d, "float32", &text), KILN_ERR_UNSUPPORTED, "cannot express");
    d = c;
    d.arch = KILN_ARCH_QWEN2;
    CHECK_ERR(kiln_hf_config_write(&d, "float32", &text), KILN_ERR_UNSUPPORTED, "cannot express");
}

/* ---- tokenizer.json from GGUF vocabularies ---------------------------------------------- */

#define SEP "\n__ggml_vocab_test__\n"

static char *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)sz + 1);
    *n = fread(b, 1, (size_t)sz, f);
    b[*n] = 0;
    fclose(f);
    return b;
}

static int encode(const kiln_tokenizer *t, const char *s, size_t n, int add, int parse, int32_t *ids,
                  size_t cap, size_t *got) {
    return kiln_tokenize(t, s, n, add, parse, ids, cap, got) == KILN_OK;
}

static void tokenizer_roundtrip(const char *dir, const char *vocab) {
    char path[1100], inp[1200];
    snprintf(path, sizeof path, "%s/ggml-vocab-%s.gguf", dir, vocab);
    snprintf(inp, sizeof inp, "%s.inp", path);
    kiln_tokenizer *g = NULL, *j = NULL;
    kiln_status st = kiln_tokenizer_open(path, &g);
    CHECK_MSG(st == KILN_OK, "%s: %s", vocab, kiln_last_error());
    if (st != KILN_OK) return;
    char *json = NULL, *cfg = NULL;
    size_t jl = 0, cl = 0;
    st = kiln_tokenizer_write_hf_json(g, &json, &jl);
    CHECK_MSG(st == KILN_OK, "%s: write json: %s", vocab, kiln_last_error());
    if (st == KILN_OK) st = kiln_tokenizer_write_hf_config(g, 4096, &cfg, &cl);
    CHECK_MSG(st == KILN_OK, "%s: write config: %s", vocab, kiln_last_error());
    if (st == KILN_OK) st = kiln_tokenizer_from_hf_json(json, jl, cfg, cl, vocab, &j);
    CHECK_MSG(st == KILN_OK, "%s: load written json: %s", vocab, kiln_last_error());
    if (st != KILN_OK) {
        kiln_free(json);
        kiln_free(cfg);
        kiln_tokenizer_close(g);
        return;
    }
    kiln_tokenizer_info a, b;
    kiln_tokenizer_get_info(g, &a);
    kiln_tokenizer_get_info(j, &b);
    CHECK_MSG(a.n_vocab == b.n_vocab && a.bos_id == b.bos_id && a.eos_id == b.eos_id &&
              a.unk_id == b.unk_id && a.add_bos == b.add_bos && a.add_eos == b.add_eos &&
              !strcmp(a.type, b.type), "%s: info differs", vocab);
    CHECK((a.chat_template == NULL) == (b.chat_template == NULL));

    size_t ni = 0;
    char *in = read_all(inp, &ni);
    CHECK(in != NULL);
    size_t cap = 1 << 16;
    int32_t *x = malloc(cap * sizeof *x), *y = malloc(cap * sizeof *y);
    char *dx = malloc(1 << 20), *dy = malloc(1 << 20);
    int cases = 0, same = 0;
    /* the vector texts, plus special tokens in running text */
    const char *extra[] = {"<s>Hello</s> world<|endoftext|>x", "<|im_start|>user\nhi<|im_end|>",
                           "  leading\tand trailing  ", ""};
    for (char *p = in; p && *p;) {
        char *e = strstr(p, SEP);
        size_t tn = e ? (size_t)(e - p) : strlen(p);
        for (int add = 0; add < 2; add++)
            for (int parse = 0; parse < 2; parse++) {
                size_t nx = 0, ny = 0;
                int ok = encode(g, p, tn, add, parse, x, cap, &nx) && encode(j, p, tn, add, parse, y, cap, &ny) &&
                         nx == ny && !memcmp(x, y, nx * sizeof *x);
                size_t lx = 0, ly = 0;
                ok = ok && kiln_detokenize(g, x, nx, parse, dx, 1 << 20, &lx) == KILN_OK &&
                     kiln_detokenize(j, x, nx, parse, dy, 1 << 20, &ly) == KILN_OK && lx == ly &&
                     !memcmp(dx, dy, lx);
                cases++;
                same += ok;
                if (!ok) fprintf(stderr, "%s: '%.*s' (add %d parse %d) differs\n", vocab, (int)(tn > 60 ? 60 : tn), p, add, parse);
            }
        if (!e) break;
        p = e + sizeof SEP - 1;
    }
    for (size_t k = 0; k < sizeof extra / sizeof extra[0]; k++) {
        size_t nx = 0, ny = 0;
        int ok = encode(g, extra[k], strlen(extra[k]), 1, 1, x, cap, &nx) &&
                 encode(j, extra[k], strlen(extra[k]), 1, 1, y, cap, &ny) && nx == ny && !memcmp(x, y, nx * sizeof *x);
        cases++;
        same += ok;
        if (!ok) fprintf(stderr, "%s: extra '%s' differs\n", vocab, extra[k]);
    }
    printf("%s: tokenizer.json written (%zu bytes), %d/%d encodings identical\n", vocab, jl, same, cases);
    CHECK(cases > 20 && same == cases);
    free(x);
    free(y);
    free(dx);
    free(dy);
    free(in);
    kiln_free(json);
    kiln_free(cfg);
    kiln_tokenizer_close(j);
    kiln_tokenizer_close(g);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/kiln_test_stw_%ld", (long)getpid());
    CHECK(mkdir(g_dir, 0755) == 0);
    test_roundtrip();
    test_refusals_and_failures();
    test_config();

    const char *env = getenv("KILN_SHARED_DIR");
    char dir[1024];
    if (env) snprintf(dir, sizeof dir, "%s/testdata/tokenizer-vectors", env);
    else snprintf(dir, sizeof dir, "%s", KILN_SOURCE_DIR "/../shared/testdata/tokenizer-vectors");
    char probe[1100];
    snprintf(probe, sizeof probe, "%s/ggml-vocab-gpt-2.gguf", dir);
    if (kiln_path_is_file(probe)) {
        tokenizer_roundtrip(dir, "gpt-2");
        tokenizer_roundtrip(dir, "llama-bpe");
        tokenizer_roundtrip(dir, "qwen2");
        tokenizer_roundtrip(dir, "llama-spm");
    } else {
        printf("tokenizer vectors not found at %s: tokenizer.json round trips skipped\n", dir);
    }
    CHECK(kiln_remove_tree(g_dir) == KILN_OK);
    return test_finish("test_safetensors_write");
}
