/*
 * test_safetensors.c -- the safetensors reader: a file written by the reference Python
 * library, hand-built files, sharded folders, every hostile case the header promises to
 * refuse, and an allocation-failure sweep (fail the Nth allocation for every N: a clean
 * KILN_ERR_NOMEM and no leaked block).
 */
#include "formats/safetensors.h"
#include "test_util.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* safetensors.torch.save_file({"a": arange(6).f32.reshape(2,3), "b": bf16 [1,-2,.5,3],
 * "c": int64 scalar 7, "e": f16 zeros (0,3)}, metadata={"format": "pt"}) with safetensors
 * 0.x from the oracle venv: the exact bytes the reference writer produces (header padded
 * with spaces to a multiple of 8). */
static const uint8_t ref_file[] = {
    0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x7b, 0x22, 0x5f, 0x5f, 0x6d, 0x65, 0x74, 0x61,
    0x64, 0x61, 0x74, 0x61, 0x5f, 0x5f, 0x22, 0x3a, 0x7b, 0x22, 0x66, 0x6f, 0x72, 0x6d, 0x61, 0x74,
    0x22, 0x3a, 0x22, 0x70, 0x74, 0x22, 0x7d, 0x2c, 0x22, 0x63, 0x22, 0x3a, 0x7b, 0x22, 0x64, 0x74,
    0x79, 0x70, 0x65, 0x22, 0x3a, 0x22, 0x49, 0x36, 0x34, 0x22, 0x2c, 0x22, 0x73, 0x68, 0x61, 0x70,
    0x65, 0x22, 0x3a, 0x5b, 0x5d, 0x2c, 0x22, 0x64, 0x61, 0x74, 0x61, 0x5f, 0x6f, 0x66, 0x66, 0x73,
    0x65, 0x74, 0x73, 0x22, 0x3a, 0x5b, 0x30, 0x2c, 0x38, 0x5d, 0x7d, 0x2c, 0x22, 0x61, 0x22, 0x3a,
    0x7b, 0x22, 0x64, 0x74, 0x79, 0x70, 0x65, 0x22, 0x3a, 0x22, 0x46, 0x33, 0x32, 0x22, 0x2c, 0x22,
    0x73, 0x68, 0x61, 0x70, 0x65, 0x22, 0x3a, 0x5b, 0x32, 0x2c, 0x33, 0x5d, 0x2c, 0x22, 0x64, 0x61,
    0x74, 0x61, 0x5f, 0x6f, 0x66, 0x66, 0x73, 0x65, 0x74, 0x73, 0x22, 0x3a, 0x5b, 0x38, 0x2c, 0x33,
    0x32, 0x5d, 0x7d, 0x2c, 0x22, 0x62, 0x22, 0x3a, 0x7b, 0x22, 0x64, 0x74, 0x79, 0x70, 0x65, 0x22,
    0x3a, 0x22, 0x42, 0x46, 0x31, 0x36, 0x22, 0x2c, 0x22, 0x73, 0x68, 0x61, 0x70, 0x65, 0x22, 0x3a,
    0x5b, 0x34, 0x5d, 0x2c, 0x22, 0x64, 0x61, 0x74, 0x61, 0x5f, 0x6f, 0x66, 0x66, 0x73, 0x65, 0x74,
    0x73, 0x22, 0x3a, 0x5b, 0x33, 0x32, 0x2c, 0x34, 0x30, 0x5d, 0x7d, 0x2c, 0x22, 0x65, 0x22, 0x3a,
    0x7b, 0x22, 0x64, 0x74, 0x79, 0x70, 0x65, 0x22, 0x3a, 0x22, 0x46, 0x31, 0x36, 0x22, 0x2c, 0x22,
    0x73, 0x68, 0x61, 0x70, 0x65, 0x22, 0x3a, 0x5b, 0x30, 0x2c, 0x33, 0x5d, 0x2c, 0x22, 0x64, 0x61,
    0x74, 0x61, 0x5f, 0x6f, 0x66, 0x66, 0x73, 0x65, 0x74, 0x73, 0x22, 0x3a, 0x5b, 0x34, 0x30, 0x2c,
    0x34, 0x30, 0x5d, 0x7d, 0x7d, 0x20, 0x20, 0x20, 0x07, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0x40, 0x00, 0x00, 0x40, 0x40,
    0x00, 0x00, 0x80, 0x40, 0x00, 0x00, 0xa0, 0x40, 0x80, 0x3f, 0x00, 0xc0, 0x00, 0x3f, 0x40, 0x40,
};

/* ---- building files -------------------------------------------------------------------- */

/* A file: 8-byte LE header length (hlen, normally strlen(header)), header, then dlen bytes of
 * data (byte i = i & 0xff). Caller frees. */
static uint8_t *make_file_hlen(const char *header, uint64_t hlen, size_t dlen, size_t *size) {
    size_t h = strlen(header);
    *size = 8 + h + dlen;
    uint8_t *b = malloc(*size ? *size : 1);
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(hlen >> (8 * i));
    memcpy(b + 8, header, h);
    for (size_t i = 0; i < dlen; i++) b[8 + h + i] = (uint8_t)i;
    return b;
}

static uint8_t *make_file(const char *header, size_t dlen, size_t *size) {
    return make_file_hlen(header, strlen(header), dlen, size);
}

static void write_bytes(const char *path, const uint8_t *b, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) { perror(path); exit(2); }
    if (n) fwrite(b, 1, n, f);
    fclose(f);
}

static void write_text(const char *dir, const char *name, const char *text) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    write_bytes(path, (const uint8_t *)text, strlen(text));
}

static void write_st(const char *dir, const char *name, const char *header, size_t dlen) {
    char path[512];
    size_t n;
    uint8_t *b = make_file(header, dlen, &n);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    write_bytes(path, b, n);
    free(b);
}

static kiln_status open_hdr(const char *header, size_t dlen) {
    size_t n;
    uint8_t *b = make_file(header, dlen, &n);
    kiln_safetensors *s = NULL;
    kiln_status st = kiln_safetensors_open_memory(b, n, "t.safetensors", &s);
    kiln_safetensors_close(s);
    free(b);
    return st;
}

static char tmp_root[256];

/* A fresh empty folder under the test's temporary root. */
static const char *new_dir(const char *name) {
    static char path[512];
    snprintf(path, sizeof path, "%s/%s", tmp_root, name);
    mkdir(path, 0700);
    return path;
}

/* ---- tests ------------------------------------------------------------------------------- */

static void test_reference_file(void) {
    for (int mode = 0; mode < 3; mode++) {
        kiln_safetensors *s = NULL;
        kiln_status st;
        char path[512];
        snprintf(path, sizeof path, "%s/ref.safetensors", tmp_root);
        if (mode == 0) st = kiln_safetensors_open_memory(ref_file, sizeof ref_file, "ref", &s);
        else {
            write_bytes(path, ref_file, sizeof ref_file);
            st = kiln_safetensors_open(path, mode == 1, &s);
        }
        CHECK_MSG(st == KILN_OK, "mode %d: %s", mode, kiln_last_error());
        if (st != KILN_OK) continue;
        CHECK(kiln_safetensors_n_tensors(s) == 4);
        /* header order */
        CHECK(strcmp(kiln_safetensors_tensor_at(s, 0)->name, "c") == 0);
        CHECK(strcmp(kiln_safetensors_tensor_at(s, 1)->name, "a") == 0);
        CHECK(kiln_safetensors_tensor_at(s, 4) == NULL);
        CHECK(kiln_safetensors_tensor_at(s, -1) == NULL);
        const kiln_tensor *a = kiln_safetensors_find(s, "a");
        CHECK(a && a->dtype == KILN_DTYPE_F32 && a->n_dims == 2 && a->shape[0] == 2 &&
              a->shape[1] == 3 && a->shape[2] == 1 && a->nbytes == 24);
        if (a) {
            float v[6];
            memcpy(v, a->data, sizeof v);
            CHECK(v[0] == 0.0f && v[5] == 5.0f);
        }
        const kiln_tensor *b = kiln_safetensors_find(s, "b");
        CHECK(b && b->dtype == KILN_DTYPE_BF16 && b->n_dims == 1 && b->shape[0] == 4 &&
              b->nbytes == 8);
        if (b) {
            uint16_t h[4];
            memcpy(h, b->data, sizeof h);
            CHECK(h[0] == 0x3f80 && h[1] == 0xc000 && h[2] == 0x3f00 && h[3] == 0x4040);
        }
        const kiln_tensor *c = kiln_safetensors_find(s, "c");
        CHECK(c && c->dtype == KILN_DTYPE_I64 && c->n_dims == 1 && c->shape[0] == 1 &&
              c->nbytes == 8);
        if (c) {
            int64_t x;
            memcpy(&x, c->data, 8);
            CHECK(x == 7);
        }
        const kiln_tensor *e = kiln_safetensors_find(s, "e");
        CHECK(e && e->dtype == KILN_DTYPE_F16 && e->n_dims == 2 && e->shape[0] == 0 &&
              e->shape[1] == 3 && e->nbytes == 0);
        CHECK(kiln_safetensors_find(s, "d") == NULL);
        CHECK(kiln_safetensors_find(s, "") == NULL);
        kiln_safetensors_close(s);
    }
}

static void test_valid_small(void) {
    /* empty file set, empty data */
    CHECK(open_hdr("{}", 0) == KILN_OK);
    CHECK(open_hdr("{\"__metadata__\":{}}", 0) == KILN_OK);
    /* trailing padding in the header is allowed */
    CHECK(open_hdr("{\"x\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[0,8]}}    ", 8) ==
          KILN_OK);
    /* unknown keys inside an entry are ignored */
    CHECK(open_hdr("{\"x\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[0,8],\"z\":1}}", 8) ==
          KILN_OK);
    /* offsets not in header order; zero-size tensors anywhere on the boundary */
    CHECK(open_hdr("{\"y\":{\"dtype\":\"F16\",\"shape\":[1,2],\"data_offsets\":[8,12]},"
                   "\"z\":{\"dtype\":\"F16\",\"shape\":[3,0],\"data_offsets\":[12,12]},"
                   "\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 12) == KILN_OK);

    /* A thousand tensors: every one found by name, with the right data. */
    size_t cap = 1000 * 100 + 16, len = 0;
    char *h = malloc(cap);
    len += (size_t)snprintf(h + len, cap - len, "{");
    for (int i = 0; i < 1000; i++)
        len += (size_t)snprintf(h + len, cap - len,
                                "%s\"model.layers.%d.w\":{\"dtype\":\"F32\",\"shape\":[1],"
                                "\"data_offsets\":[%d,%d]}", i ? "," : "", 999 - i, 4 * i,
                                4 * i + 4);
    snprintf(h + len, cap - len, "}");
    size_t n;
    uint8_t *b = make_file(h, 4000, &n);
    kiln_safetensors *s = NULL;
    CHECK(kiln_safetensors_open_memory(b, n, "big", &s) == KILN_OK);
    CHECK(kiln_safetensors_n_tensors(s) == 1000);
    int bad = 0;
    for (int i = 0; i < 1000; i++) {
        char name[64];
        snprintf(name, sizeof name, "model.layers.%d.w", 999 - i);
        const kiln_tensor *t = kiln_safetensors_find(s, name);
        if (!t || strcmp(t->name, name) != 0 ||
            (const uint8_t *)t->data != b + 8 + strlen(h) + 4 * (size_t)i)
            bad++;
    }
    CHECK(bad == 0);
    kiln_safetensors_close(s);
    free(b);
    free(h);
}

#define T1(dtype, shape, off) "{\"t\":{\"dtype\":\"" dtype "\",\"shape\":" shape ",\"data_offsets\":" off "}}"

static void test_hostile_files(void) {
    kiln_safetensors *s = NULL;
    size_t n;
    uint8_t *b;

    /* truncated: shorter than the length field, and cut inside the header */
    CHECK_ERR(kiln_safetensors_open_memory(ref_file, 5, "t", &s), KILN_ERR_FORMAT, "too short");
    CHECK_ERR(kiln_safetensors_open_memory(ref_file, 100, "t", &s), KILN_ERR_FORMAT,
              "runs past the end");
    /* cut inside the data section: the last tensor now reaches past it */
    CHECK_ERR(kiln_safetensors_open_memory(ref_file, sizeof ref_file - 1, "t", &s), KILN_ERR_FORMAT,
              "past the data section");
    CHECK(s == NULL);

    /* header length past the end, and huge */
    b = make_file_hlen("{}", 3, 0, &n);
    CHECK_ERR(kiln_safetensors_open_memory(b, n, "t", &s), KILN_ERR_FORMAT, "runs past the end");
    free(b);
    b = make_file_hlen("{}", UINT64_MAX, 0, &n);
    CHECK_ERR(kiln_safetensors_open_memory(b, n, "t", &s), KILN_ERR_FORMAT, "cap");
    free(b);
    b = make_file_hlen("{}", 100000001, 0, &n);
    CHECK_ERR(kiln_safetensors_open_memory(b, n, "t", &s), KILN_ERR_FORMAT, "cap");
    free(b);

    /* not JSON, not an object, trailing garbage */
    CHECK_ERR(open_hdr("{\"t\":", 0), KILN_ERR_FORMAT, "not valid JSON");
    CHECK_ERR(open_hdr("hello", 0), KILN_ERR_FORMAT, "not valid JSON");
    CHECK_ERR(open_hdr("", 0), KILN_ERR_FORMAT, "not valid JSON");
    CHECK_ERR(open_hdr("[1,2]", 0), KILN_ERR_FORMAT, "not a JSON object");
    CHECK_ERR(open_hdr("{} x", 0), KILN_ERR_FORMAT, "trailing bytes");
    CHECK_ERR(open_hdr("{\"t\":3}", 0), KILN_ERR_FORMAT, "entry is not a JSON object");
    CHECK_ERR(open_hdr("{\"\":{}}", 0), KILN_ERR_FORMAT, "name is empty");
    CHECK_ERR(open_hdr("{\"\xff\xfe\":{}}", 0), KILN_ERR_FORMAT, "not valid UTF-8");

    /* dtype */
    CHECK_ERR(open_hdr(T1("F33", "[1]", "[0,4]"), 4), KILN_ERR_FORMAT, "unknown dtype 'F33'");
    CHECK_ERR(open_hdr(T1("F64", "[1]", "[0,8]"), 8), KILN_ERR_UNSUPPORTED, "unsupported dtype F64");
    CHECK_ERR(open_hdr(T1("F8_E4M3", "[1]", "[0,1]"), 1), KILN_ERR_UNSUPPORTED,
              "unsupported dtype F8_E4M3");
    CHECK_ERR(open_hdr("{\"t\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", 4),
              KILN_ERR_FORMAT, "dtype is not a string");
    CHECK_ERR(open_hdr("{\"t\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4), KILN_ERR_FORMAT,
              "missing dtype");
    CHECK_ERR(open_hdr("{\"t\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],"
                       "\"data_offsets\":[0,4]}}", 4), KILN_ERR_FORMAT, "duplicate key 'dtype'");

    /* shape */
    CHECK_ERR(open_hdr(T1("F32", "4", "[0,16]"), 16), KILN_ERR_FORMAT, "shape is not an array");
    CHECK_ERR(open_hdr(T1("F32", "[2,-2]", "[0,16]"), 16), KILN_ERR_FORMAT, "shape[1] = -2 is negative");
    CHECK_ERR(open_hdr(T1("F32", "[2.5]", "[0,16]"), 16), KILN_ERR_FORMAT, "shape[0] is not an exact");
    CHECK_ERR(open_hdr(T1("F32", "[\"2\"]", "[0,16]"), 16), KILN_ERR_FORMAT, "shape[0] is not an exact");
    CHECK_ERR(open_hdr(T1("F32", "[1e300]", "[0,16]"), 16), KILN_ERR_FORMAT, "shape[0] is not an exact");
    CHECK_ERR(open_hdr(T1("F32", "[1,1,1,1,1]", "[0,4]"), 4), KILN_ERR_UNSUPPORTED,
              "more than 4 dims");
    CHECK_ERR(open_hdr(T1("F32", "[4294967296,4294967296,2]", "[0,16]"), 16), KILN_ERR_FORMAT,
              "element count overflows");
    CHECK_ERR(open_hdr(T1("I64", "[4294967296,1073741824]", "[0,16]"), 16), KILN_ERR_FORMAT,
              "byte count overflows");
    CHECK_ERR(open_hdr("{\"t\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4), KILN_ERR_FORMAT,
              "missing shape");

    /* offsets */
    CHECK_ERR(open_hdr(T1("F32", "[2]", "[0,8]"), 4), KILN_ERR_FORMAT, "past the data section");
    CHECK_ERR(open_hdr(T1("F32", "[2]", "[9007199254740000,9007199254740008]"), 8), KILN_ERR_FORMAT,
              "past the data section");
    CHECK_ERR(open_hdr(T1("F32", "[2]", "[0,12]"), 12), KILN_ERR_FORMAT, "need 8");
    CHECK_ERR(open_hdr(T1("F32", "[2]", "[8,0]"), 8), KILN_ERR_FORMAT, "begin 8 > end 0");
    CHECK_ERR(open_hdr(T1("F32", "[2]", "[0]"), 8), KILN_ERR_FORMAT, "data_offsets is not [begin, end]");
    CHECK_ERR(open_hdr(T1("F32", "[2]", "[0,8,9]"), 8), KILN_ERR_FORMAT, "data_offsets is not");
    CHECK_ERR(open_hdr(T1("F32", "[2]", "[-1,7]"), 8), KILN_ERR_FORMAT, "data_offsets is not");
    CHECK_ERR(open_hdr(T1("F32", "[2]", "{}"), 8), KILN_ERR_FORMAT, "data_offsets is not");
    CHECK_ERR(open_hdr("{\"t\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8), KILN_ERR_FORMAT,
              "missing data_offsets");

    /* overlap, holes */
    CHECK_ERR(open_hdr("{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                       "\"y\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12),
              KILN_ERR_FORMAT, "overlap");
    CHECK_ERR(open_hdr("{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                       "\"y\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8),
              KILN_ERR_FORMAT, "overlap");
    CHECK_ERR(open_hdr("{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                       "\"y\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}", 20),
              KILN_ERR_FORMAT, "hole: bytes [8, 12)");
    CHECK_ERR(open_hdr(T1("F32", "[2]", "[0,8]"), 9), KILN_ERR_FORMAT, "hole: bytes [8, 9)");
    CHECK_ERR(open_hdr("{}", 4), KILN_ERR_FORMAT, "hole: bytes [0, 4)");

    /* duplicate names (cJSON keeps both) */
    CHECK_ERR(open_hdr("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                       "\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8),
              KILN_ERR_FORMAT, "tensor 'x' appears twice");

    /* __metadata__ */
    CHECK_ERR(open_hdr("{\"__metadata__\":{\"format\":1}}", 0), KILN_ERR_FORMAT,
              "__metadata__: value of 'format' is not a string");
    CHECK_ERR(open_hdr("{\"__metadata__\":[]}", 0), KILN_ERR_FORMAT, "__metadata__: not a JSON object");
    CHECK_ERR(open_hdr("{\"__metadata__\":{},\"__metadata__\":{}}", 0), KILN_ERR_FORMAT,
              "__metadata__ appears twice");

    /* the message names the file */
    CHECK_ERR(open_hdr(T1("F33", "[1]", "[0,4]"), 4), KILN_ERR_FORMAT, "t.safetensors: tensor 't'");

    /* arguments */
    CHECK_ERR(kiln_safetensors_open_memory(NULL, 4, "t", &s), KILN_ERR_INVALID_ARG, "NULL");
    CHECK_ERR(kiln_safetensors_open(NULL, 1, &s), KILN_ERR_INVALID_ARG, "NULL");
    CHECK_ERR(kiln_safetensors_open("/nonexistent/x.safetensors", 1, &s), KILN_ERR_IO,
              "/nonexistent/x.safetensors");
    CHECK(s == NULL);
    kiln_safetensors_close(NULL);
    CHECK(kiln_safetensors_n_tensors(NULL) == 0);
    CHECK(kiln_safetensors_find(NULL, "x") == NULL);
}

#define SHARD1 "{\"__metadata__\":{\"format\":\"pt\"},"                                          \
               "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"                  \
               "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}"
#define SHARD2 "{\"c\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,8]}}"
#define INDEX_OK "{\"metadata\":{\"total_size\":20},\"weight_map\":{"                              \
                 "\"a\":\"model-00001-of-00002.safetensors\","                                    \
                 "\"c\":\"model-00002-of-00002.safetensors\","                                    \
                 "\"b\":\"model-00001-of-00002.safetensors\"}}"

/* A sharded folder with the two good shards and the given index. */
static const char *sharded_dir(const char *name, const char *index) {
    const char *d = new_dir(name);
    write_st(d, "model-00001-of-00002.safetensors", SHARD1, 12);
    write_st(d, "model-00002-of-00002.safetensors", SHARD2, 8);
    write_text(d, "model.safetensors.index.json", index);
    return d;
}

static void test_dirs(void) {
    kiln_safetensors *s = NULL;

    /* single file */
    const char *d = new_dir("single");
    write_st(d, "model.safetensors", SHARD2, 8);
    CHECK(kiln_safetensors_open_dir(d, 1, &s) == KILN_OK);
    CHECK(kiln_safetensors_n_tensors(s) == 1 && kiln_safetensors_find(s, "c"));
    kiln_safetensors_close(s);
    s = NULL;

    /* sharded: all tensors through one handle, shards in name order */
    for (int mm = 0; mm < 2; mm++) {
        d = sharded_dir("sharded", INDEX_OK);
        kiln_status st = kiln_safetensors_open_dir(d, mm, &s);
        CHECK_MSG(st == KILN_OK, "%s", kiln_last_error());
        CHECK(kiln_safetensors_n_tensors(s) == 3);
        if (st == KILN_OK) {
            CHECK(strcmp(kiln_safetensors_tensor_at(s, 0)->name, "a") == 0);
            CHECK(strcmp(kiln_safetensors_tensor_at(s, 2)->name, "c") == 0);
            const kiln_tensor *c = kiln_safetensors_find(s, "c");
            CHECK(c && c->dtype == KILN_DTYPE_BF16 && c->shape[0] == 2 && c->shape[1] == 2);
            if (c) CHECK(((const uint8_t *)c->data)[7] == 7);
            const kiln_tensor *b = kiln_safetensors_find(s, "b");
            if (b) CHECK(((const uint8_t *)b->data)[0] == 8);
            CHECK(kiln_safetensors_find(s, "a") == kiln_safetensors_tensor_at(s, 0));
        }
        kiln_safetensors_close(s);
        s = NULL;
    }

    /* missing folder contents */
    d = new_dir("empty");
    CHECK_ERR(kiln_safetensors_open_dir(d, 1, &s), KILN_ERR_IO, "no model.safetensors");

    /* index naming a shard that does not exist */
    d = sharded_dir("missing_shard",
                    "{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
                    "\"b\":\"model-00001-of-00002.safetensors\","
                    "\"c\":\"model-00003-of-00002.safetensors\"}}");
    CHECK_ERR(kiln_safetensors_open_dir(d, 1, &s), KILN_ERR_IO, "model-00003-of-00002.safetensors");

    /* a tensor missing from the shard the index names */
    d = sharded_dir("missing_tensor",
                    "{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
                    "\"b\":\"model-00001-of-00002.safetensors\","
                    "\"c\":\"model-00002-of-00002.safetensors\","
                    "\"zz\":\"model-00002-of-00002.safetensors\"}}");
    CHECK_ERR(kiln_safetensors_open_dir(d, 1, &s), KILN_ERR_FORMAT, "tensor 'zz' is not in its shard");

    /* a tensor in a different shard than the index says */
    d = sharded_dir("wrong_shard",
                    "{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
                    "\"b\":\"model-00002-of-00002.safetensors\","
                    "\"c\":\"model-00002-of-00002.safetensors\"}}");
    CHECK_ERR(kiln_safetensors_open_dir(d, 1, &s), KILN_ERR_FORMAT, "tensor 'b' is said to be in");

    /* a shard tensor the index does not list */
    d = sharded_dir("unlisted",
                    "{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
                    "\"c\":\"model-00002-of-00002.safetensors\"}}");
    CHECK_ERR(kiln_safetensors_open_dir(d, 1, &s), KILN_ERR_FORMAT, "tensor 'b' is not listed");

    /* shard names that leave the folder */
    d = sharded_dir("escape", "{\"weight_map\":{\"a\":\"../model-00001-of-00002.safetensors\"}}");
    CHECK_ERR(kiln_safetensors_open_dir(d, 1, &s), KILN_ERR_FORMAT, "not a plain file name");
    d = sharded_dir("escape2", "{\"weight_map\":{\"a\":\"..\"}}");
    CHECK_ERR(kiln_safetensors_open_dir(d, 1, &s), KILN_ERR_FORMAT, "not a plain file name");
    d = sharded_dir("escape3", "{\"weight_map\":{\"a\":\"/etc/passwd\"}}");
    CHECK_ERR(kiln_safetensors_open_dir(d, 1, &s), KILN_ERR_FORMAT, "not a plain file name");

    /* malformed indexes */
    d = sharded_dir("idx_notjson", "{\"weight_map\":");
    CHECK_ERR(kiln_safetensors_open_dir(d, 1, &s), KILN_ERR_FORMAT, "not valid JSON");
    d = sharded_dir("idx_trailing", INDEX_OK " x");
    CHECK_ERR(kiln_safetensors_open_dir(d, 1, &s), KILN_ERR_FORMAT, "not valid JSON");
    d = sharded_dir("idx_nomap", "{\"metadata\":{}}");
    CHECK_ERR(kiln_safetensors_open_dir(d, 1, &s), KILN_ERR_FORMAT, "weight_map: missing");
    d = sharded_dir("idx_empty", "{\"weight_map\":{}}");
    CHECK_ERR(kiln_safetensors_open_dir(d, 1, &s), KILN_ERR_FORMAT, "weight_map is empty");
    d = sharded_dir("idx_badval", "{\"weight_map\":{\"a\":1}}");
    CHECK_ERR(kiln_safetensors_open_dir(d, 1, &s), KILN_ERR_FORMAT, "value of 'a' is not a string");
    d = sharded_dir("idx_dup",
                    "{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
                    "\"a\":\"model-00001-of-00002.safetensors\","
                    "\"b\":\"model-00001-of-00002.safetensors\","
                    "\"c\":\"model-00002-of-00002.safetensors\"}}");
    CHECK_ERR(kiln_safetensors_open_dir(d, 1, &s), KILN_ERR_FORMAT, "tensor 'a' is listed twice");

    /* the same name in two shards */
    d = new_dir("dup_across");
    write_st(d, "s1.safetensors", SHARD1, 12);
    write_st(d, "s2.safetensors",
             "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4);
    write_text(d, "model.safetensors.index.json",
               "{\"weight_map\":{\"a\":\"s1.safetensors\",\"b\":\"s1.safetensors\","
               "\"c\":\"s2.safetensors\"}}");
    CHECK_ERR(kiln_safetensors_open_dir(d, 1, &s), KILN_ERR_FORMAT, "tensor 'a' appears in two shards");

    /* a bad shard: its own error, naming the shard file */
    d = new_dir("bad_shard");
    write_st(d, "s1.safetensors", T1("F32", "[2]", "[0,12]"), 12);
    write_text(d, "model.safetensors.index.json", "{\"weight_map\":{\"t\":\"s1.safetensors\"}}");
    CHECK_ERR(kiln_safetensors_open_dir(d, 1, &s), KILN_ERR_FORMAT, "s1.safetensors: tensor 't'");
    CHECK(s == NULL);
}

/* ---- allocation-failure sweep ------------------------------------------------------------- */

static long g_calls, g_fail_at;

static void *failing_alloc(size_t size, void *user) {
    (void)user;
    g_calls++;
    if (g_fail_at > 0 && g_calls == g_fail_at) return NULL;
    return malloc(size);
}
static void failing_free(void *p, void *user) {
    (void)user;
    free(p);
}

typedef kiln_status (*open_fn)(kiln_safetensors **out);

static const char *g_sharded, *g_single_path;
static kiln_status open_mem_ref(kiln_safetensors **out) {
    return kiln_safetensors_open_memory(ref_file, sizeof ref_file, "ref", out);
}
static kiln_status open_file_read(kiln_safetensors **out) {
    return kiln_safetensors_open(g_single_path, 0, out);
}
static kiln_status open_sharded_read(kiln_safetensors **out) {
    return kiln_safetensors_open_dir(g_sharded, 0, out);
}
static kiln_status open_sharded_mmap(kiln_safetensors **out) {
    return kiln_safetensors_open_dir(g_sharded, 1, out);
}

static void sweep(const char *what, open_fn fn) {
    kiln_allocator a = {failing_alloc, failing_free, NULL};
    kiln_set_allocator(&a);
    kiln_mem_stats m0, m1;
    kiln_mem_get_stats(&m0);
    kiln_safetensors *s = NULL;
    g_calls = 0;
    g_fail_at = 0;
    kiln_status st = fn(&s);
    long count = g_calls;
    CHECK_MSG(st == KILN_OK, "%s: %s", what, kiln_last_error());
    kiln_safetensors_close(s);
    int bad_status = 0, leaks = 0;
    for (long n = 1; n <= count; n++) {
        s = NULL;
        g_calls = 0;
        g_fail_at = n;
        st = fn(&s);
        if (st != KILN_ERR_NOMEM || s != NULL) {
            bad_status++;
            fprintf(stderr, "%s: failing allocation %ld of %ld gave %s: %s\n", what, n, count,
                    kiln_status_string(st), kiln_last_error());
            kiln_safetensors_close(s);
        }
        kiln_mem_get_stats(&m1);
        if (m1.live_blocks != m0.live_blocks || m1.live_bytes != m0.live_bytes) leaks++;
    }
    g_fail_at = 0;
    kiln_set_allocator(NULL);
    CHECK_MSG(count >= 4, "%s: only %ld allocations", what, count);
    CHECK_MSG(bad_status == 0, "%s: %d of %ld failure points did not give KILN_ERR_NOMEM", what,
              bad_status, count);
    CHECK_MSG(leaks == 0, "%s: %d failure points leaked", what, leaks);
    printf("alloc sweep %s: %ld allocations, each failed once\n", what, count);
}

static void test_alloc_sweep(void) {
    static char single[512];
    snprintf(single, sizeof single, "%s/ref.safetensors", tmp_root);
    write_bytes(single, ref_file, sizeof ref_file);
    g_single_path = single;
    g_sharded = sharded_dir("sweep", INDEX_OK);
    sweep("open_memory", open_mem_ref);
    sweep("open (read)", open_file_read);
    sweep("open_dir sharded (read)", open_sharded_read);
    sweep("open_dir sharded (mmap)", open_sharded_mmap);
}

static void rm_rf(const char *path) {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", path);
}

int main(void) {
    snprintf(tmp_root, sizeof tmp_root, "/tmp/kiln_test_st_XXXXXX");
    if (!mkdtemp(tmp_root)) {
        perror("mkdtemp");
        return 2;
    }
    kiln_mem_stats m0, m1;
    kiln_mem_get_stats(&m0);
    test_reference_file();
    test_valid_small();
    test_hostile_files();
    test_dirs();
    test_alloc_sweep();
    kiln_mem_get_stats(&m1);
    CHECK_MSG(m1.live_blocks == m0.live_blocks, "leaked %zu blocks",
              m1.live_blocks - m0.live_blocks);
    rm_rf(tmp_root);
    return test_finish("test_safetensors");
}
