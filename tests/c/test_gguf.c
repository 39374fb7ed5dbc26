/* test_gguf.c -- the GGUF reader on files built in memory: a valid file with every value
 * type parses exactly; each hostile variant gets the expected status and a message naming
 * the file and the field; every truncation fails cleanly; failing the Nth allocation of an
 * open, for every N, returns KILN_ERR_NOMEM and leaks nothing. */
#include "formats/gguf.h"
#include "test_util.h"

#include <math.h>
#include <stdint.h>
#include <unistd.h>

#define LABEL "hostile.gguf"

/* ---- a little GGUF writer --------------------------------------------------------------- */

typedef struct buf {
    uint8_t *p;
    size_t n, cap;
} buf;

static void b_put(buf *b, const void *d, size_t n) {
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 256;
        while (cap < b->n + n) cap *= 2;
        b->p = realloc(b->p, cap);
        if (!b->p) abort(); /* the test harness, not the library */
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, d, n);
    b->n += n;
}
static void b_u8(buf *b, uint8_t v) { b_put(b, &v, 1); }
static void b_u16(buf *b, uint16_t v) { uint8_t x[2] = {(uint8_t)v, (uint8_t)(v >> 8)}; b_put(b, x, 2); }
static void b_u32(buf *b, uint32_t v) {
    uint8_t x[4];
    for (int i = 0; i < 4; i++) x[i] = (uint8_t)(v >> (8 * i));
    b_put(b, x, 4);
}
static void b_u64(buf *b, uint64_t v) {
    uint8_t x[8];
    for (int i = 0; i < 8; i++) x[i] = (uint8_t)(v >> (8 * i));
    b_put(b, x, 8);
}
static void b_strn(buf *b, const char *s, size_t n) { b_u64(b, n); b_put(b, s, n); }
static void b_str(buf *b, const char *s) { b_strn(b, s, strlen(s)); }
static void b_f32(buf *b, float f) { uint32_t u; memcpy(&u, &f, 4); b_u32(b, u); }
static void b_f64(buf *b, double f) { uint64_t u; memcpy(&u, &f, 8); b_u64(b, u); }
static void b_key(buf *b, const char *k, uint32_t type) { b_str(b, k); b_u32(b, type); }

typedef struct tspec {
    const char *name;
    uint32_t n_dims;
    uint64_t ne[6];
    uint32_t type; /* ggml type id */
    uint64_t offset;
} tspec;

typedef struct spec {
    uint32_t magic, version;
    int64_t n_kv_override, n_tensors_override; /* < 0: the real count */
    uint32_t alignment;                        /* 0: no general.alignment kv (default 32) */
    buf extra;                                 /* raw kvs appended after the standard ones */
    int n_extra;
    int n_tensors;
    tspec t[6];
    size_t data_size; /* bytes of tensor data after the data section start */
} spec;

#define N_STD_KV 16

static void emit_std_kvs(buf *b) {
    b_key(b, "general.architecture", KILN_GGUF_STRING), b_str(b, "llama");
    b_key(b, "t.u8", KILN_GGUF_UINT8), b_u8(b, 200);
    b_key(b, "t.i8", KILN_GGUF_INT8), b_u8(b, (uint8_t)-5);
    b_key(b, "t.u16", KILN_GGUF_UINT16), b_u16(b, 60000);
    b_key(b, "t.i16", KILN_GGUF_INT16), b_u16(b, (uint16_t)-30000);
    b_key(b, "t.u32", KILN_GGUF_UINT32), b_u32(b, 4000000000u);
    b_key(b, "t.i32", KILN_GGUF_INT32), b_u32(b, (uint32_t)-7);
    b_key(b, "t.f32", KILN_GGUF_FLOAT32), b_f32(b, 1.5f);
    b_key(b, "t.bool", KILN_GGUF_BOOL), b_u8(b, 1);
    b_key(b, "t.u64", KILN_GGUF_UINT64), b_u64(b, (uint64_t)1 << 40);
    b_key(b, "t.i64", KILN_GGUF_INT64), b_u64(b, (uint64_t)-((int64_t)1 << 40));
    b_key(b, "t.f64", KILN_GGUF_FLOAT64), b_f64(b, 0.25);
    b_key(b, "t.arr_i32", KILN_GGUF_ARRAY), b_u32(b, KILN_GGUF_INT32), b_u64(b, 3);
    b_u32(b, 1), b_u32(b, (uint32_t)-2), b_u32(b, 3);
    b_key(b, "t.arr_f32", KILN_GGUF_ARRAY), b_u32(b, KILN_GGUF_FLOAT32), b_u64(b, 2);
    b_f32(b, 0.5f), b_f32(b, -1.0f);
    b_key(b, "t.arr_str", KILN_GGUF_ARRAY), b_u32(b, KILN_GGUF_STRING), b_u64(b, 3);
    b_str(b, "a"), b_str(b, "bc"), b_str(b, "");
    b_key(b, "t.nested", KILN_GGUF_ARRAY), b_u32(b, KILN_GGUF_ARRAY), b_u64(b, 2);
    b_u32(b, KILN_GGUF_UINT8), b_u64(b, 2), b_u8(b, 1), b_u8(b, 2);
    b_u32(b, KILN_GGUF_STRING), b_u64(b, 1), b_str(b, "x");
}

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
static uint8_t data_byte(size_t k) { return (uint8_t)(k * 7 + 1); }

/* The valid file: four tensors of different types, the last ending exactly at EOF. */
static void valid_spec(spec *s, uint32_t alignment) {
    memset(s, 0, sizeof *s);
    s->magic = 0x46554747u;
    s->version = 3;
    s->n_kv_override = s->n_tensors_override = -1;
    s->alignment = alignment;
    uint64_t a = alignment ? alignment : 32;
    s->n_tensors = 4;
    s->t[0] = (tspec){"w.f32", 2, {4, 3}, 0, 0};                /* 48 bytes */
    s->t[1] = (tspec){"w.q4_0", 2, {64, 2}, 2, 0};              /* 72 bytes */
    s->t[2] = (tspec){"w.q6_k", 1, {256}, 14, 0};               /* 210 bytes */
    s->t[3] = (tspec){"w.bf16", 4, {2, 2, 2, 2}, 30, 0};        /* 32 bytes */
    uint64_t sizes[4] = {48, 72, 210, 32}, off = 0;
    for (int i = 0; i < 4; i++) {
        s->t[i].offset = off;
        off = align_up(off + sizes[i], a);
    }
    s->data_size = (size_t)(s->t[3].offset + sizes[3]);
}

/* Serialize s into b; *data_start = where the data section begins. */
static void build(const spec *s, buf *b, size_t *data_start) {
    b->n = 0;
    int n_kv = N_STD_KV + (s->alignment ? 1 : 0) + s->n_extra;
    b_u32(b, s->magic);
    b_u32(b, s->version);
    b_u64(b, s->n_tensors_override >= 0 ? (uint64_t)s->n_tensors_override : (uint64_t)s->n_tensors);
    b_u64(b, s->n_kv_override >= 0 ? (uint64_t)s->n_kv_override : (uint64_t)n_kv);
    emit_std_kvs(b);
    if (s->alignment) b_key(b, "general.alignment", KILN_GGUF_UINT32), b_u32(b, s->alignment);
    b_put(b, s->extra.p, s->extra.n);
    for (int i = 0; i < s->n_tensors; i++) {
        const tspec *t = &s->t[i];
        b_str(b, t->name);
        b_u32(b, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims && d < 6; d++) b_u64(b, t->ne[d]);
        b_u32(b, t->type);
        b_u64(b, t->offset);
    }
    uint64_t a = s->alignment && (s->alignment & (s->alignment - 1)) == 0 ? s->alignment : 32;
    while (b->n % a) b_u8(b, 0);
    *data_start = b->n;
    for (size_t k = 0; k < s->data_size; k++) b_u8(b, data_byte(k));
}

/* Build s and open it from memory. */
static kiln_status open_spec(const spec *s, kiln_gguf **g) {
    buf b = {0};
    size_t ds;
    build(s, &b, &ds);
    kiln_status st = kiln_gguf_open_memory(b.p, b.n, LABEL, g);
    if (st == KILN_OK) kiln_gguf_close(*g); /* the buffer dies here; callers only want st */
    free(b.p);
    return st;
}

/* Expect st with a message naming the file and containing needle. */
#define CHECK_SPEC(s, st, needle)                                                              \
    do {                                                                                       \
        kiln_gguf *g_;                                                                         \
        CHECK_ERR(open_spec(s, &g_), st, needle);                                              \
        CHECK_MSG(strstr(kiln_last_error(), LABEL) != NULL, "no file label in '%s'",           \
                  kiln_last_error());                                                          \
        if (getenv("KILN_TEST_VERBOSE")) printf("  %s\n", kiln_last_error());                 \
    } while (0)

/* ---- the valid file --------------------------------------------------------------------- */

static void check_valid_contents(const kiln_gguf *g, const uint8_t *base, size_t data_start,
                                 uint32_t alignment) {
    CHECK(kiln_gguf_version(g) == 3);
    CHECK(kiln_gguf_alignment(g) == (alignment ? alignment : 32));
    CHECK(kiln_gguf_n_kv(g) == N_STD_KV + (alignment ? 1 : 0));
    CHECK(kiln_gguf_n_tensors(g) == 4);

    const kiln_gguf_kv *kv = kiln_gguf_kv_at(g, 0);
    CHECK(kv && strcmp(kv->key.ptr, "general.architecture") == 0 && kv->key.len == 20);
    CHECK(kiln_gguf_kv_at(g, -1) == NULL && kiln_gguf_kv_at(g, kiln_gguf_n_kv(g)) == NULL);
    CHECK(kiln_gguf_find(g, "t.f64") == kiln_gguf_kv_at(g, 11));
    CHECK(kiln_gguf_find(g, "t.f6") == NULL && kiln_gguf_find(g, "zzz") == NULL);

    kiln_gguf_str s;
    int found = -1;
    CHECK(kiln_gguf_get_str(g, "general.architecture", &s, &found) == KILN_OK && found == 1);
    CHECK(s.len == 5 && memcmp(s.ptr, "llama", 5) == 0);
    uint32_t u32 = 0;
    CHECK(kiln_gguf_get_u32(g, "t.u8", &u32, &found) == KILN_OK && u32 == 200);
    CHECK(kiln_gguf_get_u32(g, "t.u16", &u32, &found) == KILN_OK && u32 == 60000);
    CHECK(kiln_gguf_get_u32(g, "t.u32", &u32, &found) == KILN_OK && u32 == 4000000000u);
    CHECK_ERR(kiln_gguf_get_u32(g, "t.i32", &u32, &found), KILN_ERR_FORMAT, "does not fit");
    CHECK_ERR(kiln_gguf_get_u32(g, "t.u64", &u32, &found), KILN_ERR_FORMAT, "t.u64");
    CHECK_ERR(kiln_gguf_get_u32(g, "general.architecture", &u32, &found), KILN_ERR_FORMAT,
              "expected an integer");
    u32 = 99, found = -1;
    CHECK(kiln_gguf_get_u32(g, "absent.key", &u32, &found) == KILN_OK && found == 0 && u32 == 99);
    CHECK_ERR(kiln_gguf_get_u32(g, "absent.key", &u32, NULL), KILN_ERR_FORMAT, "missing key");
    int64_t i64 = 0;
    CHECK(kiln_gguf_get_i64(g, "t.i64", &i64, &found) == KILN_OK && i64 == -((int64_t)1 << 40));
    CHECK(kiln_gguf_get_i64(g, "t.i8", &i64, &found) == KILN_OK && i64 == -5);
    CHECK(kiln_gguf_get_i64(g, "t.i16", &i64, &found) == KILN_OK && i64 == -30000);
    CHECK(kiln_gguf_get_i64(g, "t.u64", &i64, &found) == KILN_OK && i64 == (int64_t)1 << 40);
    CHECK_ERR(kiln_gguf_get_i64(g, "t.f32", &i64, &found), KILN_ERR_FORMAT, "float32");
    float f = 0;
    CHECK(kiln_gguf_get_f32(g, "t.f32", &f, &found) == KILN_OK && f == 1.5f);
    CHECK(kiln_gguf_get_f32(g, "t.f64", &f, &found) == KILN_OK && f == 0.25f);
    CHECK_ERR(kiln_gguf_get_f32(g, "t.arr_f32", &f, &found), KILN_ERR_FORMAT, "array");
    int bv = 0;
    CHECK(kiln_gguf_get_bool(g, "t.bool", &bv, &found) == KILN_OK && bv == 1);
    CHECK_ERR(kiln_gguf_get_bool(g, "t.u8", &bv, &found), KILN_ERR_FORMAT, "bool");
    CHECK_ERR(kiln_gguf_get_str(g, "t.u8", &s, &found), KILN_ERR_FORMAT, "string");

    kv = kiln_gguf_find(g, "t.arr_i32");
    CHECK(kv && kv->type == KILN_GGUF_ARRAY && kv->arr_type == KILN_GGUF_INT32 && kv->arr_len == 3);
    if (kv) {
        CHECK(kiln_gguf_arr_i32(kv, 0) == 1 && kiln_gguf_arr_i32(kv, 1) == -2);
        CHECK(kiln_gguf_arr_i32(kv, 2) == 3 && kiln_gguf_arr_i32(kv, 3) == 0);
        CHECK(kiln_gguf_arr_f32(kv, 1) == -2.0f);
    }
    kv = kiln_gguf_find(g, "t.arr_f32");
    CHECK(kv && kv->arr_type == KILN_GGUF_FLOAT32 && kv->arr_len == 2);
    if (kv) CHECK(kiln_gguf_arr_f32(kv, 0) == 0.5f && kiln_gguf_arr_f32(kv, 1) == -1.0f);
    kv = kiln_gguf_find(g, "t.arr_str");
    CHECK(kv && kv->arr_type == KILN_GGUF_STRING && kv->arr_len == 3 && kv->arr_strs);
    if (kv && kv->arr_strs) {
        CHECK(kv->arr_strs[0].len == 1 && kv->arr_strs[0].ptr[0] == 'a');
        CHECK(kv->arr_strs[1].len == 2 && memcmp(kv->arr_strs[1].ptr, "bc", 2) == 0);
        CHECK(kv->arr_strs[2].len == 0);
        kiln_gguf_str e = kiln_gguf_arr_str(kv, 1);
        CHECK(e.len == 2 && memcmp(e.ptr, "bc", 2) == 0);
        CHECK(kiln_gguf_arr_str(kv, 3).ptr == NULL);
    }
    CHECK(kiln_gguf_arr_str(kiln_gguf_find(g, "t.arr_i32"), 0).ptr == NULL);
    kv = kiln_gguf_find(g, "t.nested");
    CHECK(kv && kv->arr_type == KILN_GGUF_ARRAY && kv->arr_len == 2 && !kv->arr_strs);

    static const struct {
        const char *name;
        kiln_dtype dt;
        int n_dims;
        int64_t shape[4];
        size_t nbytes;
    } want[4] = {{"w.f32", KILN_DTYPE_F32, 2, {3, 4, 1, 1}, 48},
                 {"w.q4_0", KILN_DTYPE_Q4_0, 2, {2, 64, 1, 1}, 72},
                 {"w.q6_k", KILN_DTYPE_Q6_K, 1, {256, 1, 1, 1}, 210},
                 {"w.bf16", KILN_DTYPE_BF16, 4, {2, 2, 2, 2}, 32}};
    for (int i = 0; i < 4; i++) {
        const kiln_tensor *t = kiln_gguf_tensor_at(g, i);
        CHECK(t && kiln_gguf_find_tensor(g, want[i].name) == t);
        if (!t) continue;
        CHECK(strcmp(t->name, want[i].name) == 0 && t->dtype == want[i].dt);
        CHECK_MSG(t->n_dims == want[i].n_dims && memcmp(t->shape, want[i].shape, sizeof t->shape) == 0,
                  "%s shape", t->name);
        CHECK(t->nbytes == want[i].nbytes);
        size_t off = (size_t)((const uint8_t *)t->data - base);
        CHECK(off >= data_start && (off - data_start) % kiln_gguf_alignment(g) == 0);
        CHECK(((const uint8_t *)t->data)[0] == data_byte(off - data_start));
    }
    CHECK(kiln_gguf_tensor_at(g, 4) == NULL && kiln_gguf_find_tensor(g, "w") == NULL);
}

static void test_valid(void) {
    uint32_t aligns[3] = {0, 64, 1};
    for (int a = 0; a < 3; a++) {
        spec s;
        valid_spec(&s, aligns[a]);
        buf b = {0};
        size_t ds;
        build(&s, &b, &ds);
        kiln_gguf *g = NULL;
        kiln_status st = kiln_gguf_open_memory(b.p, b.n, LABEL, &g);
        CHECK_MSG(st == KILN_OK, "alignment %u: %s", aligns[a], kiln_last_error());
        if (st == KILN_OK) check_valid_contents(g, b.p, ds, aligns[a]);
        kiln_gguf_close(g);
        free(b.p);
    }
    /* version 2 reads the same */
    spec s;
    valid_spec(&s, 0);
    s.version = 2;
    kiln_gguf *g;
    CHECK(open_spec(&s, &g) == KILN_OK);
    /* no tensors, no padding at all after the kvs */
    valid_spec(&s, 0);
    s.n_tensors = 0, s.data_size = 0;
    CHECK(open_spec(&s, &g) == KILN_OK);

    /* through a file, mapped and read */
    valid_spec(&s, 64);
    buf b = {0};
    size_t ds;
    build(&s, &b, &ds);
    char path[64];
    snprintf(path, sizeof path, "/tmp/kiln_test_gguf_%d.gguf", (int)getpid());
    FILE *fp = fopen(path, "wb");
    CHECK(fp && fwrite(b.p, 1, b.n, fp) == b.n);
    if (fp) fclose(fp);
    for (int mm = 0; mm < 2; mm++) {
        g = NULL;
        CHECK_MSG(kiln_gguf_open(path, mm, &g) == KILN_OK, "%s", kiln_last_error());
        if (g) {
            const kiln_tensor *t = kiln_gguf_find_tensor(g, "w.q6_k");
            CHECK(t && memcmp(t->data, b.p + ds + s.t[2].offset, 210) == 0);
            CHECK(kiln_gguf_alignment(g) == 64);
        }
        kiln_gguf_close(g);
    }
    remove(path);
    free(b.p);
    CHECK_ERR(kiln_gguf_open("/nonexistent/x.gguf", 1, &g), KILN_ERR_IO, "/nonexistent/x.gguf");
    CHECK_ERR(kiln_gguf_open_memory(NULL, 5, LABEL, &g), KILN_ERR_INVALID_ARG, "NULL");
    kiln_gguf_close(NULL);
    CHECK(kiln_gguf_n_tensors(NULL) == 0 && kiln_gguf_find(NULL, "x") == NULL);
}

/* ---- hostile headers -------------------------------------------------------------------- */

static void test_header(void) {
    spec s;
    kiln_gguf *g;
    valid_spec(&s, 0);
    s.magic = 0x46554746u;
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "bad magic");
    valid_spec(&s, 0);
    s.version = 1;
    CHECK_SPEC(&s, KILN_ERR_UNSUPPORTED, "version 1");
    s.version = 4;
    CHECK_SPEC(&s, KILN_ERR_UNSUPPORTED, "version 4");
    s.version = 0x03000000u;
    CHECK_SPEC(&s, KILN_ERR_UNSUPPORTED, "big-endian");
    s.version = 0;
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "version 0");
    CHECK_ERR(kiln_gguf_open_memory((const uint8_t *)"GGUF", 4, LABEL, &g), KILN_ERR_FORMAT,
              "too small");
    CHECK_ERR(kiln_gguf_open_memory(NULL, 0, LABEL, &g), KILN_ERR_FORMAT, "too small");

    valid_spec(&s, 0);
    s.n_kv_override = (int64_t)1 << 60;
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "n_kv");
    valid_spec(&s, 0);
    s.n_tensors_override = (int64_t)1 << 60;
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "n_tensors");
    valid_spec(&s, 0);
    s.n_kv_override = INT64_MAX;
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "cannot fit");
    /* a count that fits the file but is one too many: the parser reads tensor infos as kvs */
    valid_spec(&s, 0);
    s.n_kv_override = N_STD_KV + 1;
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "offset");
    valid_spec(&s, 0);
    s.n_tensors_override = 5;
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "tensor 4");
}

/* Every proper prefix of the valid file fails with KILN_ERR_FORMAT (the last tensor ends at
 * EOF, so no prefix is itself valid). */
static void test_truncation(void) {
    spec s;
    valid_spec(&s, 0);
    buf b = {0};
    size_t ds;
    build(&s, &b, &ds);
    int bad = 0;
    for (size_t n = 0; n < b.n; n++) {
        uint8_t *copy = malloc(n ? n : 1); /* exact size so ASan sees any over-read */
        memcpy(copy, b.p, n);
        kiln_gguf *g = NULL;
        kiln_status st = kiln_gguf_open_memory(copy, n, LABEL, &g);
        if (st != KILN_ERR_FORMAT || !strstr(kiln_last_error(), LABEL)) {
            if (bad++ < 5)
                fprintf(stderr, "prefix %zu: status %d '%s'\n", n, (int)st, kiln_last_error());
            if (st == KILN_OK) kiln_gguf_close(g);
        }
        free(copy);
    }
    CHECK_MSG(bad == 0, "%d of %zu prefixes not refused cleanly", bad, b.n);
    free(b.p);
}

/* ---- hostile metadata ------------------------------------------------------------------- */

/* Start a spec whose extra kv section gets one raw kv. */
static buf *extra_kv(spec *s) {
    valid_spec(s, 0);
    s->n_extra = 1;
    return &s->extra;
}

static void test_metadata(void) {
    spec s;
    buf *e;

    e = extra_kv(&s);
    b_u64(e, (uint64_t)1 << 40); /* a key length past EOF */
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "string length");
    free(e->p);

    e = extra_kv(&s);
    b_key(e, "x.bad", 13), b_u32(e, 0);
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "unknown value type 13");
    CHECK(strstr(kiln_last_error(), "x.bad") != NULL);
    free(e->p);

    e = extra_kv(&s);
    b_key(e, "x.arr", KILN_GGUF_ARRAY), b_u32(e, 99), b_u64(e, 1), b_u32(e, 0);
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "unknown array element type 99");
    free(e->p);

    e = extra_kv(&s);
    b_key(e, "x.arr", KILN_GGUF_ARRAY), b_u32(e, KILN_GGUF_UINT32), b_u64(e, (uint64_t)1 << 62);
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "cannot fit");
    CHECK(strstr(kiln_last_error(), "x.arr") != NULL);
    free(e->p);

    e = extra_kv(&s); /* 2^62 * 4 overflows uint64 */
    b_key(e, "x.arr", KILN_GGUF_ARRAY), b_u32(e, KILN_GGUF_UINT64), b_u64(e, UINT64_MAX / 4);
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "cannot fit");
    free(e->p);

    e = extra_kv(&s);
    b_key(e, "x.strs", KILN_GGUF_ARRAY), b_u32(e, KILN_GGUF_STRING), b_u64(e, (uint64_t)1 << 61);
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "cannot fit");
    free(e->p);

    e = extra_kv(&s);
    b_key(e, "x.strs", KILN_GGUF_ARRAY), b_u32(e, KILN_GGUF_STRING), b_u64(e, 1);
    b_u64(e, (uint64_t)1 << 40);
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "string length");
    free(e->p);

    e = extra_kv(&s);
    b_key(e, "x.str", KILN_GGUF_STRING), b_u64(e, UINT64_MAX);
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "x.str");
    free(e->p);

    e = extra_kv(&s);
    b_key(e, "x.b", KILN_GGUF_BOOL), b_u8(e, 2);
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "bool");
    free(e->p);

    e = extra_kv(&s);
    b_key(e, "x.ba", KILN_GGUF_ARRAY), b_u32(e, KILN_GGUF_BOOL), b_u64(e, 3);
    b_u8(e, 0), b_u8(e, 1), b_u8(e, 7);
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "bool element 2");
    free(e->p);

    e = extra_kv(&s);
    b_key(e, "t.u8", KILN_GGUF_UINT8), b_u8(e, 1);
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "duplicate key 't.u8'");
    free(e->p);

    e = extra_kv(&s);
    b_strn(e, "\xff\xfe", 2), b_u32(e, KILN_GGUF_UINT8), b_u8(e, 1);
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "UTF-8");
    free(e->p);

    e = extra_kv(&s);
    b_strn(e, "a\0b", 3), b_u32(e, KILN_GGUF_UINT8), b_u8(e, 1);
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "NUL");
    free(e->p);

    e = extra_kv(&s);
    b_strn(e, "", 0), b_u32(e, KILN_GGUF_UINT8), b_u8(e, 1);
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "empty");
    free(e->p);

    e = extra_kv(&s); /* arrays nested 5 deep */
    b_key(e, "x.deep", KILN_GGUF_ARRAY);
    for (int i = 0; i < 5; i++) b_u32(e, KILN_GGUF_ARRAY), b_u64(e, 1);
    b_u32(e, KILN_GGUF_UINT8), b_u64(e, 0);
    CHECK_SPEC(&s, KILN_ERR_UNSUPPORTED, "nested");
    free(e->p);

    e = extra_kv(&s); /* nested array whose inner count does not fit */
    b_key(e, "x.nest", KILN_GGUF_ARRAY), b_u32(e, KILN_GGUF_ARRAY), b_u64(e, 1);
    b_u32(e, KILN_GGUF_INT16), b_u64(e, (uint64_t)1 << 50);
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "cannot fit");
    free(e->p);

    /* general.alignment: zero, not a power of two, wrong type */
    e = extra_kv(&s);
    b_key(e, "general.alignment", KILN_GGUF_UINT32), b_u32(e, 0);
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "power of two");
    free(e->p);
    e = extra_kv(&s);
    b_key(e, "general.alignment", KILN_GGUF_UINT32), b_u32(e, 48);
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "power of two");
    free(e->p);
    e = extra_kv(&s);
    b_key(e, "general.alignment", KILN_GGUF_STRING), b_str(e, "32");
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "general.alignment");
    free(e->p);
    e = extra_kv(&s);
    b_key(e, "general.alignment", KILN_GGUF_INT32), b_u32(e, (uint32_t)-64);
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "power of two");
    free(e->p);
}

/* ---- hostile tensor infos ---------------------------------------------------------------- */

static void test_tensors(void) {
    spec s;
    valid_spec(&s, 0);
    s.t[1].n_dims = 0;
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "n_dims 0");
    CHECK(strstr(kiln_last_error(), "w.q4_0") != NULL);
    valid_spec(&s, 0);
    s.t[1].n_dims = 5;
    s.t[1].ne[2] = s.t[1].ne[3] = s.t[1].ne[4] = 1;
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "n_dims 5");
    valid_spec(&s, 0);
    s.t[0].ne[1] = 0;
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "ne[1] is 0");
    valid_spec(&s, 0);
    s.t[0].ne[0] = UINT64_MAX;
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "ne[0] is -1");
    valid_spec(&s, 0);
    s.t[0].ne[0] = (uint64_t)1 << 32, s.t[0].ne[1] = (uint64_t)1 << 32;
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "element count overflows");
    valid_spec(&s, 0);
    s.t[0].n_dims = 1, s.t[0].ne[0] = (uint64_t)1 << 62;
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "byte count overflows");
    CHECK(strstr(kiln_last_error(), "w.f32") != NULL);
    valid_spec(&s, 0);
    s.t[2].ne[0] = 128, s.t[2].ne[1] = 2, s.t[2].n_dims = 2;
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "not a multiple");
    valid_spec(&s, 0);
    s.t[2].type = 99;
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "unknown ggml type 99");
    CHECK(strstr(kiln_last_error(), "w.q6_k") != NULL);
    valid_spec(&s, 0);
    s.t[2].type = 10;
    CHECK_SPEC(&s, KILN_ERR_UNSUPPORTED, "Q2_K");
    valid_spec(&s, 0);
    s.t[1].offset += 8;
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "not aligned");
    valid_spec(&s, 0);
    s.t[3].offset += 32; /* the last tensor now ends 32 bytes past EOF */
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "past the end");
    CHECK(strstr(kiln_last_error(), "w.bf16") != NULL);
    valid_spec(&s, 0);
    s.t[3].offset = (uint64_t)1 << 63; /* offset + size overflows nothing but is far off */
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "past the end");
    valid_spec(&s, 0);
    s.t[3].offset = UINT64_MAX - 31; /* aligned, and offset + size wraps */
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "past the end");
    valid_spec(&s, 0);
    s.t[2].offset = s.t[1].offset; /* q6_k over q4_0 */
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "overlaps");
    valid_spec(&s, 0);
    s.t[0].offset = 32; /* 48 bytes at 32 run into w.q4_0 at 64 */
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "overlaps");
    valid_spec(&s, 0);
    s.t[3].name = "w.f32";
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "duplicate tensor name 'w.f32'");
    valid_spec(&s, 0);
    s.t[3].name = "w.\xc0\xaf"; /* overlong '/' */
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "UTF-8");
    valid_spec(&s, 0);
    s.t[3].name = "";
    CHECK_SPEC(&s, KILN_ERR_FORMAT, "empty");
}

/* ---- allocation failure ----------------------------------------------------------------- */

static int g_fail_at, g_calls;
static void *failing_alloc(size_t size, void *user) {
    (void)user;
    if (++g_calls == g_fail_at) return NULL;
    return malloc(size);
}
static void plain_free(void *p, void *user) {
    (void)user;
    free(p);
}

static void test_alloc_failures(void) {
    spec s;
    valid_spec(&s, 0);
    buf b = {0};
    size_t ds;
    build(&s, &b, &ds);
    char path[64];
    snprintf(path, sizeof path, "/tmp/kiln_test_gguf_a%d.gguf", (int)getpid());
    FILE *fp = fopen(path, "wb");
    CHECK(fp && fwrite(b.p, 1, b.n, fp) == b.n);
    if (fp) fclose(fp);

    kiln_allocator a = {failing_alloc, plain_free, NULL};
    CHECK(kiln_set_allocator(&a) == KILN_OK);
    for (int mode = 0; mode < 2; mode++) { /* 0: open_memory, 1: open(path) read, no mmap */
        kiln_mem_stats before, after;
        kiln_gguf *g = NULL;
        kiln_mem_get_stats(&before);
        g_fail_at = 0, g_calls = 0;
        kiln_status st = mode ? kiln_gguf_open(path, 0, &g) : kiln_gguf_open_memory(b.p, b.n, LABEL, &g);
        CHECK(st == KILN_OK);
        kiln_gguf_close(g);
        int n_allocs = g_calls;
        CHECK(n_allocs >= 3);
        int bad = 0;
        for (int n = 1; n <= n_allocs; n++) {
            g_fail_at = n, g_calls = 0;
            g = NULL;
            st = mode ? kiln_gguf_open(path, 0, &g) : kiln_gguf_open_memory(b.p, b.n, LABEL, &g);
            kiln_mem_get_stats(&after);
            if (st != KILN_ERR_NOMEM || g != NULL || after.live_blocks != before.live_blocks) {
                if (bad++ < 5)
                    fprintf(stderr, "mode %d fail at %d: status %d, live %zu vs %zu: %s\n", mode,
                            n, (int)st, after.live_blocks, before.live_blocks, kiln_last_error());
                if (st == KILN_OK) kiln_gguf_close(g);
            }
        }
        CHECK_MSG(bad == 0, "mode %d: %d of %d allocation failures mishandled", mode, bad, n_allocs);
        g_fail_at = 0;
    }
    kiln_set_allocator(NULL);
    remove(path);
    free(b.p);
}

int main(void) {
    test_valid();
    test_header();
    test_truncation();
    test_metadata();
    test_tensors();
    test_alloc_failures();
    return test_finish("test_gguf");
}
