/*
 * gguf.c -- GGUF v2/v3 reader. The file layout (all little-endian):
 *
 *   u32 magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
 *   n_kv x   { string key | u32 value_type | value }
 *   n_tensors x { string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset }
 *   padding to general.alignment (default 32) | tensor data (offsets relative to here)
 *
 * where string = u64 len | len bytes, and an array value = u32 elem_type | u64 n | elements.
 *
 * Open runs two passes over the header. Pass 1 validates everything reading only the
 * caller's bytes (every count is checked against the bytes left before it is used, every
 * product and sum is checked) and measures what the tables need; only then are the tables
 * allocated, at sizes bounded by what pass 1 actually walked. Pass 2 re-walks the (now
 * known good) header to fill them, then checks the properties that need the whole table:
 * duplicate keys and names, tensor offsets, bounds and overlaps.
 */
#include "gguf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GGUF_MAGIC 0x46554747u /* "GGUF" read little-endian */
#define GGUF_DEFAULT_ALIGNMENT 32u
#define GGUF_MAX_ARRAY_DEPTH 4 /* arrays of arrays are walked (and skipped) this deep */
/* Minimum encoded sizes, used to refuse counts that cannot fit in the bytes left. */
#define GGUF_MIN_KV_BYTES 13u     /* key length 8 + type 4 + 1-byte value */
#define GGUF_MIN_TENSOR_BYTES 32u /* name length 8 + n_dims 4 + ne 8 + type 4 + offset 8 */

struct kiln_gguf {
    char *label;         /* file path or caller's label (owned) */
    kiln_file_map map;   /* when opened from a path */
    int own_map;
    const uint8_t *data; /* the whole file */
    size_t size;
    uint32_t version, alignment;
    size_t data_offset;  /* start of the tensor data section */
    int64_t n_kv, n_tensors;
    kiln_gguf_kv *kvs;               /* (n_kv) in file order */
    kiln_tensor *tensors;            /* (n_tensors) in file order */
    char *strings;                   /* keys and tensor names, NUL-terminated (owned) */
    kiln_gguf_str *arr_strs;         /* every string-array element, kv by kv (owned) */
    const kiln_gguf_kv **kv_by_key;  /* (n_kv) sorted by key, for find */
    const kiln_tensor **t_by_name;   /* (n_tensors) sorted by name, for find */
};

/* ---- a bounds-checked cursor ----------------------------------------------------------- */

typedef struct cursor {
    const uint8_t *p;
    size_t size, off;
    const char *label;
} cursor;

static size_t cur_left(const cursor *c) { return c->size - c->off; }

static kiln_status cur_need(cursor *c, uint64_t n, const char *what) {
    if (n > cur_left(c))
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: offset %zu: %s needs %llu bytes but only %zu are left (truncated "
                          "or corrupt file)",
                          c->label, c->off, what, (unsigned long long)n, cur_left(c));
    return KILN_OK;
}

static kiln_status cur_u32(cursor *c, uint32_t *v, const char *what) {
    KILN_TRY(cur_need(c, 4, what));
    *v = kiln_le32(c->p + c->off);
    c->off += 4;
    return KILN_OK;
}

static kiln_status cur_u64(cursor *c, uint64_t *v, const char *what) {
    KILN_TRY(cur_need(c, 8, what));
    *v = kiln_le64(c->p + c->off);
    c->off += 8;
    return KILN_OK;
}

static kiln_status cur_str(cursor *c, kiln_gguf_str *s, const char *what) {
    uint64_t len;
    size_t at = c->off;
    KILN_TRY(cur_u64(c, &len, what));
    if (len > cur_left(c))
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: offset %zu: %s: string length %llu runs past the end of the file "
                          "(%zu bytes left)",
                          c->label, at, what, (unsigned long long)len, cur_left(c));
    s->ptr = (const char *)c->p + c->off;
    s->len = len;
    c->off += (size_t)len;
    return KILN_OK;
}

/* ---- small helpers --------------------------------------------------------------------- */

/* Strict UTF-8: no overlongs, no surrogates, nothing past U+10FFFF. */
static bool utf8_valid(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t b = s[i];
        if (b < 0x80) {
            i++;
            continue;
        }
        size_t k;
        uint32_t cp, min;
        if ((b & 0xe0) == 0xc0) k = 1, cp = b & 0x1f, min = 0x80;
        else if ((b & 0xf0) == 0xe0) k = 2, cp = b & 0x0f, min = 0x800;
        else if ((b & 0xf8) == 0xf0) k = 3, cp = b & 0x07, min = 0x10000;
        else return false;
        if (k > n - i - 1) return false;
        for (size_t j = 1; j <= k; j++) {
            if ((s[i + j] & 0xc0) != 0x80) return false;
            cp = (cp << 6) | (s[i + j] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
        i += k + 1;
    }
    return true;
}

/* A key or tensor name becomes a C string: it must be non-empty, NUL-free, valid UTF-8. */
static kiln_status check_name(const cursor *c, size_t at, kiln_gguf_str s, const char *what) {
    int shown = s.len > 80 ? 80 : (int)s.len;
    if (s.len == 0)
        return kiln_error(KILN_ERR_FORMAT, "%s: offset %zu: %s is empty", c->label, at, what);
    if (memchr(s.ptr, 0, (size_t)s.len))
        return kiln_error(KILN_ERR_FORMAT, "%s: offset %zu: %s '%.*s' contains a NUL byte",
                          c->label, at, what, shown, s.ptr);
    if (!utf8_valid((const uint8_t *)s.ptr, (size_t)s.len))
        return kiln_error(KILN_ERR_FORMAT, "%s: offset %zu: %s is not valid UTF-8", c->label, at,
                          what);
    return KILN_OK;
}

static const char *type_name(uint32_t t) {
    static const char *names[] = {"uint8",  "int8",   "uint16", "int16",  "uint32",
                                  "int32",  "float32", "bool",  "string", "array",
                                  "uint64", "int64",  "float64"};
    return t < sizeof names / sizeof names[0] ? names[t] : "unknown";
}

/* Bytes of one scalar of type t; 0 for string, array and unknown types. */
static size_t scalar_size(uint32_t t) {
    switch (t) {
    case KILN_GGUF_UINT8: case KILN_GGUF_INT8: case KILN_GGUF_BOOL: return 1;
    case KILN_GGUF_UINT16: case KILN_GGUF_INT16: return 2;
    case KILN_GGUF_UINT32: case KILN_GGUF_INT32: case KILN_GGUF_FLOAT32: return 4;
    case KILN_GGUF_UINT64: case KILN_GGUF_INT64: case KILN_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

static bool is_integer_type(uint32_t t) {
    return t <= KILN_GGUF_INT32 || t == KILN_GGUF_UINT64 || t == KILN_GGUF_INT64;
}

/* An integer scalar at p of type t as (neg, magnitude-or-value). */
static void load_int(const uint8_t *p, uint32_t t, int64_t *sv, uint64_t *uv, bool *neg) {
    int64_t s = 0;
    uint64_t u = 0;
    bool is_signed = true;
    switch (t) {
    case KILN_GGUF_UINT8: u = p[0], is_signed = false; break;
    case KILN_GGUF_INT8: s = (int8_t)p[0]; break;
    case KILN_GGUF_UINT16: u = (uint16_t)(p[0] | (p[1] << 8)), is_signed = false; break;
    case KILN_GGUF_INT16: s = (int16_t)(uint16_t)(p[0] | (p[1] << 8)); break;
    case KILN_GGUF_UINT32: u = kiln_le32(p), is_signed = false; break;
    case KILN_GGUF_INT32: s = (int32_t)kiln_le32(p); break;
    case KILN_GGUF_UINT64: u = kiln_le64(p), is_signed = false; break;
    case KILN_GGUF_INT64: s = (int64_t)kiln_le64(p); break;
    default: break;
    }
    if (is_signed) {
        *neg = s < 0;
        *sv = s;
        *uv = s < 0 ? 0 : (uint64_t)s;
    } else {
        *neg = false;
        *uv = u;
        *sv = u > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)u;
    }
}

/* ---- ggml tensor types ----------------------------------------------------------------- */

bool kiln_gguf_dtype_from_ggml(uint32_t ggml_type, kiln_dtype *out) {
    kiln_dtype t;
    switch (ggml_type) {
    case 0: t = KILN_DTYPE_F32; break;
    case 1: t = KILN_DTYPE_F16; break;
    case 2: t = KILN_DTYPE_Q4_0; break;
    case 3: t = KILN_DTYPE_Q4_1; break;
    case 6: t = KILN_DTYPE_Q5_0; break;
    case 7: t = KILN_DTYPE_Q5_1; break;
    case 8: t = KILN_DTYPE_Q8_0; break;
    case 12: t = KILN_DTYPE_Q4_K; break;
    case 13: t = KILN_DTYPE_Q5_K; break;
    case 14: t = KILN_DTYPE_Q6_K; break;
    case 26: t = KILN_DTYPE_I32; break;
    case 27: t = KILN_DTYPE_I64; break;
    case 30: t = KILN_DTYPE_BF16; break;
    default: return false;
    }
    if (out) *out = t;
    return true;
}

/* Names of ggml types kiln knows of but does not read, for a precise message. */
static const char *ggml_type_name(uint32_t t) {
    static const char *names[] = {
        [4] = "Q4_2 (removed)", [5] = "Q4_3 (removed)", [9] = "Q8_1", [10] = "Q2_K",
        [11] = "Q3_K", [15] = "Q8_K", [16] = "IQ2_XXS", [17] = "IQ2_XS", [18] = "IQ3_XXS",
        [19] = "IQ1_S", [20] = "IQ4_NL", [21] = "IQ3_S", [22] = "IQ2_S", [23] = "IQ4_XS",
        [24] = "I8", [25] = "I16", [28] = "F64", [29] = "IQ1_M", [34] = "TQ1_0",
        [35] = "TQ2_0", [39] = "MXFP4"};
    return t < sizeof names / sizeof names[0] ? names[t] : NULL;
}

/* ---- pass over the metadata ------------------------------------------------------------ */

typedef struct pass_state {
    bool fill;            /* pass 2: write into the tables */
    size_t str_bytes;     /* pass 1: bytes for keys + names, each with its NUL */
    uint64_t n_arr_strs;  /* pass 1: string-array elements to record */
    size_t str_used;      /* pass 2 cursors */
    uint64_t arr_used;
    uint32_t alignment;
    bool have_alignment;
} pass_state;

/* Walk n array elements of type t; record top-level string elements into strs if given. */
static kiln_status walk_array(cursor *c, uint32_t t, uint64_t n, int depth, const char *ctx,
                              kiln_gguf_str *strs) {
    size_t at = c->off;
    if (t > KILN_GGUF_FLOAT64)
        return kiln_error(KILN_ERR_FORMAT, "%s: offset %zu: %s: unknown array element type %u",
                          c->label, at, ctx, t);
    size_t es = scalar_size(t);
    if (es) {
        uint64_t bytes;
        if (kiln_mul_overflow_u64(n, es, &bytes) || bytes > cur_left(c))
            return kiln_error(KILN_ERR_FORMAT,
                              "%s: offset %zu: %s: array of %llu %s values cannot fit in the "
                              "%zu bytes left",
                              c->label, at, ctx, (unsigned long long)n, type_name(t), cur_left(c));
        if (t == KILN_GGUF_BOOL) {
            for (uint64_t i = 0; i < n; i++)
                if (c->p[c->off + i] > 1)
                    return kiln_error(KILN_ERR_FORMAT,
                                      "%s: offset %llu: %s: bool element %llu is %u (not 0 or 1)",
                                      c->label, (unsigned long long)(c->off + i), ctx,
                                      (unsigned long long)i, c->p[c->off + i]);
        }
        c->off += (size_t)bytes;
        return KILN_OK;
    }
    /* strings (8-byte length each) and nested arrays (12-byte header each) */
    uint64_t min = t == KILN_GGUF_STRING ? 8 : 12, bytes;
    if (kiln_mul_overflow_u64(n, min, &bytes) || bytes > cur_left(c))
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: offset %zu: %s: array of %llu %s values cannot fit in the %zu "
                          "bytes left",
                          c->label, at, ctx, (unsigned long long)n, type_name(t), cur_left(c));
    if (t == KILN_GGUF_STRING) {
        for (uint64_t i = 0; i < n; i++) {
            kiln_gguf_str s;
            KILN_TRY(cur_str(c, &s, ctx));
            if (strs) strs[i] = s;
        }
        return KILN_OK;
    }
    if (depth >= GGUF_MAX_ARRAY_DEPTH)
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "%s: offset %zu: %s: arrays nested deeper than %d levels", c->label, at,
                          ctx, GGUF_MAX_ARRAY_DEPTH);
    for (uint64_t i = 0; i < n; i++) {
        uint32_t it;
        uint64_t in;
        KILN_TRY(cur_u32(c, &it, ctx));
        KILN_TRY(cur_u64(c, &in, ctx));
        KILN_TRY(walk_array(c, it, in, depth + 1, ctx, NULL));
    }
    return KILN_OK;
}

/* general.alignment: an integer, nonzero power of two that fits uint32. */
static kiln_status read_alignment(const cursor *c, size_t at, uint32_t type, const uint8_t *v,
                                  uint32_t *out) {
    if (!is_integer_type(type))
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: offset %zu: key 'general.alignment' has type %s, expected uint32",
                          c->label, at, type_name(type));
    int64_t sv;
    uint64_t uv;
    bool neg;
    load_int(v, type, &sv, &uv, &neg);
    if (neg || uv == 0 || uv > UINT32_MAX || (uv & (uv - 1)) != 0)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: offset %zu: key 'general.alignment' is %lld: alignment must be a "
                          "nonzero power of two",
                          c->label, at, (long long)sv);
    *out = (uint32_t)uv;
    return KILN_OK;
}

static kiln_status pass_kvs(kiln_gguf *g, cursor *c, pass_state *ps) {
    for (int64_t i = 0; i < g->n_kv; i++) {
        char ctx[160];
        size_t at = c->off;
        kiln_gguf_str key;
        snprintf(ctx, sizeof ctx, "kv %lld key", (long long)i);
        KILN_TRY(cur_str(c, &key, ctx));
        KILN_TRY(check_name(c, at, key, ctx));
        int shown = key.len > 100 ? 100 : (int)key.len;
        snprintf(ctx, sizeof ctx, "kv '%.*s'", shown, key.ptr);

        uint32_t type;
        size_t type_at = c->off;
        KILN_TRY(cur_u32(c, &type, ctx));
        if (type > KILN_GGUF_FLOAT64)
            return kiln_error(KILN_ERR_FORMAT, "%s: offset %zu: %s: unknown value type %u",
                              c->label, type_at, ctx, type);
        kiln_gguf_kv kv = {.type = (kiln_gguf_type)type};
        size_t value_at = c->off;
        if (type == KILN_GGUF_ARRAY) {
            uint32_t et;
            uint64_t n;
            KILN_TRY(cur_u32(c, &et, ctx));
            KILN_TRY(cur_u64(c, &n, ctx));
            kv.arr_type = (kiln_gguf_type)et;
            kv.arr_len = n;
            kv.value = c->p + c->off;
            kiln_gguf_str *strs = NULL;
            if (ps->fill && et == KILN_GGUF_STRING) strs = g->arr_strs + ps->arr_used;
            KILN_TRY(walk_array(c, et, n, 1, ctx, strs));
            if (et == KILN_GGUF_STRING) {
                /* n is bounded by the file size / 8, so this sum cannot overflow */
                if (ps->fill) kv.arr_strs = strs, ps->arr_used += n;
                else ps->n_arr_strs += n;
            }
        } else if (type == KILN_GGUF_STRING) {
            kiln_gguf_str s;
            KILN_TRY(cur_str(c, &s, ctx));
            kv.value = (const uint8_t *)s.ptr;
        } else {
            size_t es = scalar_size(type);
            KILN_TRY(cur_need(c, es, ctx));
            kv.value = c->p + c->off;
            if (type == KILN_GGUF_BOOL && kv.value[0] > 1)
                return kiln_error(KILN_ERR_FORMAT, "%s: offset %zu: %s: bool value is %u (not 0 "
                                  "or 1)", c->label, c->off, ctx, kv.value[0]);
            c->off += es;
        }
        if (key.len == 17 && memcmp(key.ptr, "general.alignment", 17) == 0 && !ps->fill) {
            if (type == KILN_GGUF_ARRAY || type == KILN_GGUF_STRING)
                return kiln_error(KILN_ERR_FORMAT,
                                  "%s: offset %zu: key 'general.alignment' has type %s, expected "
                                  "uint32", c->label, type_at, type_name(type));
            KILN_TRY(read_alignment(c, value_at, type, kv.value, &ps->alignment));
            ps->have_alignment = true;
        }
        if (ps->fill) {
            char *dst = g->strings + ps->str_used;
            memcpy(dst, key.ptr, (size_t)key.len);
            dst[key.len] = '\0';
            ps->str_used += (size_t)key.len + 1;
            kv.key.ptr = dst;
            kv.key.len = key.len;
            g->kvs[i] = kv;
        } else {
            ps->str_bytes += (size_t)key.len + 1; /* bounded by the file size */
        }
    }
    return KILN_OK;
}

/* ---- pass over the tensor infos -------------------------------------------------------- */

static kiln_status pass_tensors(kiln_gguf *g, cursor *c, pass_state *ps, uint64_t *offsets) {
    for (int64_t i = 0; i < g->n_tensors; i++) {
        char ctx[160];
        size_t at = c->off;
        kiln_gguf_str name;
        snprintf(ctx, sizeof ctx, "tensor %lld name", (long long)i);
        KILN_TRY(cur_str(c, &name, ctx));
        KILN_TRY(check_name(c, at, name, ctx));
        int shown = name.len > 100 ? 100 : (int)name.len;
        snprintf(ctx, sizeof ctx, "tensor '%.*s'", shown, name.ptr);

        uint32_t n_dims;
        size_t dims_at = c->off;
        KILN_TRY(cur_u32(c, &n_dims, ctx));
        if (n_dims < 1 || n_dims > KILN_MAX_DIMS)
            return kiln_error(KILN_ERR_FORMAT, "%s: offset %zu: %s: n_dims %u (must be 1..%d)",
                              c->label, dims_at, ctx, n_dims, KILN_MAX_DIMS);
        int64_t ne[KILN_MAX_DIMS];
        uint64_t nel = 1;
        for (uint32_t d = 0; d < n_dims; d++) {
            uint64_t v;
            size_t ne_at = c->off;
            KILN_TRY(cur_u64(c, &v, ctx));
            if ((int64_t)v < 1)
                return kiln_error(KILN_ERR_FORMAT,
                                  "%s: offset %zu: %s: dim ne[%u] is %lld (must be >= 1)",
                                  c->label, ne_at, ctx, d, (long long)(int64_t)v);
            if (kiln_mul_overflow_u64(nel, v, &nel) || nel > (uint64_t)INT64_MAX)
                return kiln_error(KILN_ERR_FORMAT,
                                  "%s: offset %zu: %s: element count overflows at ne[%u]",
                                  c->label, ne_at, ctx, d);
            ne[d] = (int64_t)v;
        }
        uint32_t gt;
        size_t type_at = c->off;
        KILN_TRY(cur_u32(c, &gt, ctx));
        kiln_dtype dt;
        if (!kiln_gguf_dtype_from_ggml(gt, &dt)) {
            const char *known = ggml_type_name(gt);
            if (known)
                return kiln_error(KILN_ERR_UNSUPPORTED,
                                  "%s: offset %zu: %s: ggml type %u (%s) is not supported by kiln",
                                  c->label, type_at, ctx, gt, known);
            return kiln_error(KILN_ERR_FORMAT, "%s: offset %zu: %s: unknown ggml type %u",
                              c->label, type_at, ctx, gt);
        }
        const kiln_dtype_traits *tr = kiln_dtype_get_traits(dt);
        if (ne[0] % tr->block_size != 0)
            return kiln_error(KILN_ERR_FORMAT,
                              "%s: offset %zu: %s: row length ne[0] = %lld is not a multiple of "
                              "the %s block size %d",
                              c->label, dims_at, ctx, (long long)ne[0], tr->name, tr->block_size);
        uint64_t nbytes;
        if (!kiln_dtype_nbytes(dt, nel, &nbytes) || nbytes > SIZE_MAX)
            return kiln_error(KILN_ERR_FORMAT, "%s: offset %zu: %s: byte count overflows",
                              c->label, dims_at, ctx);
        uint64_t off;
        size_t off_at = c->off;
        KILN_TRY(cur_u64(c, &off, ctx));
        if (off % ps->alignment != 0)
            return kiln_error(KILN_ERR_FORMAT,
                              "%s: offset %zu: %s: data offset %llu is not aligned to %u",
                              c->label, off_at, ctx, (unsigned long long)off, ps->alignment);
        if (ps->fill) {
            char *dst = g->strings + ps->str_used;
            memcpy(dst, name.ptr, (size_t)name.len);
            dst[name.len] = '\0';
            ps->str_used += (size_t)name.len + 1;
            kiln_tensor *t = &g->tensors[i];
            t->name = dst;
            t->dtype = dt;
            t->n_dims = (int)n_dims;
            for (int d = 0; d < KILN_MAX_DIMS; d++)
                t->shape[d] = d < (int)n_dims ? ne[n_dims - 1 - d] : 1;
            t->nbytes = (size_t)nbytes;
            offsets[i] = off;
        } else {
            ps->str_bytes += (size_t)name.len + 1;
            /* the data must lie inside the file; the data section start is not known yet,
             * so this is rechecked exactly in pass 2 */
            uint64_t end;
            if (kiln_add_overflow_u64(off, nbytes, &end) || end > c->size)
                return kiln_error(KILN_ERR_FORMAT,
                                  "%s: offset %zu: %s: data [%llu, +%llu) runs past the end of "
                                  "the file (%zu bytes)",
                                  c->label, off_at, ctx, (unsigned long long)off,
                                  (unsigned long long)nbytes, c->size);
        }
    }
    return KILN_OK;
}

/* ---- duplicate and overlap checks ------------------------------------------------------ */

static int cmp_kv_key(const void *a, const void *b) {
    const kiln_gguf_kv *x = *(const kiln_gguf_kv *const *)a, *y = *(const kiln_gguf_kv *const *)b;
    int r = strcmp(x->key.ptr, y->key.ptr);
    return r ? r : (x < y ? -1 : x > y);
}

static int cmp_tensor_name(const void *a, const void *b) {
    const kiln_tensor *x = *(const kiln_tensor *const *)a, *y = *(const kiln_tensor *const *)b;
    int r = strcmp(x->name, y->name);
    return r ? r : (x < y ? -1 : x > y);
}

static int cmp_tensor_data(const void *a, const void *b) {
    const kiln_tensor *x = *(const kiln_tensor *const *)a, *y = *(const kiln_tensor *const *)b;
    const uint8_t *p = x->data, *q = y->data;
    if (p != q) return p < q ? -1 : 1;
    return x < y ? -1 : x > y;
}

static kiln_status check_tables(kiln_gguf *g, const uint64_t *offsets) {
    for (int64_t i = 0; i < g->n_kv; i++) g->kv_by_key[i] = &g->kvs[i];
    qsort(g->kv_by_key, (size_t)g->n_kv, sizeof *g->kv_by_key, cmp_kv_key);
    for (int64_t i = 1; i < g->n_kv; i++)
        if (strcmp(g->kv_by_key[i - 1]->key.ptr, g->kv_by_key[i]->key.ptr) == 0)
            return kiln_error(KILN_ERR_FORMAT, "%s: duplicate key '%s' (kv %lld and kv %lld)",
                              g->label, g->kv_by_key[i]->key.ptr,
                              (long long)(g->kv_by_key[i - 1] - g->kvs),
                              (long long)(g->kv_by_key[i] - g->kvs));

    for (int64_t i = 0; i < g->n_tensors; i++) {
        kiln_tensor *t = &g->tensors[i];
        uint64_t start, end;
        if (kiln_add_overflow_u64(g->data_offset, offsets[i], &start) ||
            kiln_add_overflow_u64(start, t->nbytes, &end) || end > g->size)
            return kiln_error(KILN_ERR_FORMAT,
                              "%s: tensor '%s': data at file offset %zu + %llu (%zu bytes) runs "
                              "past the end of the file (%zu bytes)",
                              g->label, t->name, g->data_offset, (unsigned long long)offsets[i],
                              t->nbytes, g->size);
        t->data = g->data + start;
        g->t_by_name[i] = t;
    }
    qsort(g->t_by_name, (size_t)g->n_tensors, sizeof *g->t_by_name, cmp_tensor_name);
    for (int64_t i = 1; i < g->n_tensors; i++)
        if (strcmp(g->t_by_name[i - 1]->name, g->t_by_name[i]->name) == 0)
            return kiln_error(KILN_ERR_FORMAT, "%s: duplicate tensor name '%s'", g->label,
                              g->t_by_name[i]->name);

    /* Overlap: sort a scratch copy by data address; it is t_by_name's storage reused after
     * the check so no further allocation is needed, then restored by name. */
    qsort(g->t_by_name, (size_t)g->n_tensors, sizeof *g->t_by_name, cmp_tensor_data);
    kiln_status st = KILN_OK;
    for (int64_t i = 1; i < g->n_tensors && st == KILN_OK; i++) {
        const kiln_tensor *a = g->t_by_name[i - 1], *b = g->t_by_name[i];
        if ((const uint8_t *)a->data + a->nbytes > (const uint8_t *)b->data)
            st = kiln_error(KILN_ERR_FORMAT,
                            "%s: tensor '%s' (data offset %llu, %zu bytes) overlaps tensor '%s' "
                            "(data offset %llu)",
                            g->label, a->name,
                            (unsigned long long)((const uint8_t *)a->data - g->data - g->data_offset),
                            a->nbytes, b->name,
                            (unsigned long long)((const uint8_t *)b->data - g->data - g->data_offset));
    }
    qsort(g->t_by_name, (size_t)g->n_tensors, sizeof *g->t_by_name, cmp_tensor_name);
    return st;
}

/* ---- open / close ---------------------------------------------------------------------- */

void kiln_gguf_close(kiln_gguf *g) {
    if (!g) return;
    kiln_free(g->kv_by_key);
    kiln_free(g->t_by_name);
    kiln_free(g->arr_strs);
    kiln_free(g->strings);
    kiln_free(g->tensors);
    kiln_free(g->kvs);
    if (g->own_map) kiln_file_map_close(&g->map);
    kiln_free(g->label);
    kiln_free(g);
}

static kiln_status parse_header(kiln_gguf *g) {
    cursor c = {g->data, g->size, 0, g->label};
    if (g->size < 24)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: file is %zu bytes, too small for a GGUF header (24 bytes)",
                          g->label, g->size);
    uint32_t magic = kiln_le32(g->data);
    if (magic != GGUF_MAGIC)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: offset 0: bad magic 0x%08x (expected \"GGUF\"): not a GGUF file",
                          g->label, magic);
    uint32_t version = kiln_le32(g->data + 4);
    if (version == 1)
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "%s: offset 4: GGUF version 1 is not supported (only versions 2 and 3); "
                          "re-convert the model with a current llama.cpp",
                          g->label);
    if (version == 0)
        return kiln_error(KILN_ERR_FORMAT, "%s: offset 4: GGUF version 0 is invalid", g->label);
    if ((version & 0xffffu) == 0)
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "%s: offset 4: version field 0x%08x: not a little-endian GGUF "
                          "version (big-endian GGUF files are not supported)",
                          g->label, version);
    if (version > 3)
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "%s: offset 4: GGUF version %u is newer than this reader supports (3)",
                          g->label, version);
    g->version = version;
    uint64_t n_tensors = kiln_le64(g->data + 8), n_kv = kiln_le64(g->data + 16);
    c.off = 24;
    /* refuse counts that cannot fit before anything is sized from them */
    if (n_kv > cur_left(&c) / GGUF_MIN_KV_BYTES)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: offset 16: n_kv %llu cannot fit in the %zu bytes left (each kv "
                          "takes at least %u bytes)",
                          g->label, (unsigned long long)n_kv, cur_left(&c), GGUF_MIN_KV_BYTES);
    if (n_tensors > cur_left(&c) / GGUF_MIN_TENSOR_BYTES)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: offset 8: n_tensors %llu cannot fit in the %zu bytes left (each "
                          "tensor info takes at least %u bytes)",
                          g->label, (unsigned long long)n_tensors, cur_left(&c),
                          GGUF_MIN_TENSOR_BYTES);
    g->n_kv = (int64_t)n_kv;
    g->n_tensors = (int64_t)n_tensors;

    /* pass 1: validate and measure */
    pass_state ps = {.alignment = GGUF_DEFAULT_ALIGNMENT};
    KILN_TRY(pass_kvs(g, &c, &ps));
    KILN_TRY(pass_tensors(g, &c, &ps, NULL));
    g->alignment = ps.alignment;
    size_t end_of_infos = c.off, pad = (ps.alignment - end_of_infos % ps.alignment) % ps.alignment;
    if (kiln_add_overflow(end_of_infos, pad, &g->data_offset))
        return kiln_error(KILN_ERR_FORMAT, "%s: data section offset overflows", g->label);
    if (g->n_tensors > 0 && g->data_offset > g->size)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: offset %zu: data section (aligned to %u) starts past the end of "
                          "the file (%zu bytes)",
                          g->label, g->data_offset, g->alignment, g->size);

    /* allocate the tables: every size below was walked in pass 1 */
    size_t n_by_name = (size_t)g->n_tensors;
    uint64_t *offsets = NULL;
    g->kvs = kiln_calloc((size_t)g->n_kv, sizeof *g->kvs);
    g->tensors = kiln_calloc((size_t)g->n_tensors, sizeof *g->tensors);
    g->strings = kiln_malloc(ps.str_bytes);
    g->arr_strs = kiln_calloc((size_t)ps.n_arr_strs, sizeof *g->arr_strs);
    g->kv_by_key = kiln_calloc((size_t)g->n_kv, sizeof *g->kv_by_key);
    g->t_by_name = kiln_calloc(n_by_name, sizeof *g->t_by_name);
    offsets = kiln_calloc(n_by_name, sizeof *offsets);
    if (!g->kvs || !g->tensors || !g->strings || !g->arr_strs || !g->kv_by_key ||
        !g->t_by_name || !offsets) {
        kiln_free(offsets);
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory for the tables of %lld kvs and %lld "
                          "tensors", g->label, (long long)g->n_kv, (long long)g->n_tensors);
    }

    /* pass 2: fill (cannot fail: the same bytes passed pass 1), then whole-table checks */
    pass_state ps2 = {.fill = true, .alignment = ps.alignment};
    c.off = 24;
    kiln_status st = pass_kvs(g, &c, &ps2);
    if (st == KILN_OK) st = pass_tensors(g, &c, &ps2, offsets);
    if (st == KILN_OK) st = check_tables(g, offsets);
    kiln_free(offsets);
    return st;
}

static kiln_status gguf_open_impl(const uint8_t *data, size_t size, const char *label,
                                  kiln_file_map *map, kiln_gguf **out) {
    kiln_gguf *g = kiln_calloc(1, sizeof *g);
    if (!g) {
        if (map) kiln_file_map_close(map);
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory opening GGUF", label);
    }
    if (map) g->map = *map, g->own_map = 1;
    g->data = data;
    g->size = size;
    g->label = kiln_strdup(label);
    if (!g->label) {
        kiln_gguf_close(g);
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory opening GGUF", label);
    }
    kiln_status st = parse_header(g);
    if (st != KILN_OK) {
        kiln_gguf_close(g);
        return st;
    }
    *out = g;
    return KILN_OK;
}

kiln_status kiln_gguf_open_memory(const uint8_t *data, size_t size, const char *label,
                                  kiln_gguf **out) {
    if (!out || (!data && size))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_gguf_open_memory: NULL argument");
    if (!label) label = "<memory>";
    return gguf_open_impl(data ? data : (const uint8_t *)"", size, label, NULL, out);
}

kiln_status kiln_gguf_open(const char *path, int use_mmap, kiln_gguf **out) {
    if (!path || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_gguf_open: NULL argument");
    kiln_file_map map;
    KILN_TRY(kiln_file_map_open(path, use_mmap, &map));
    return gguf_open_impl(map.data, map.size, path, &map, out);
}

/* ---- accessors ------------------------------------------------------------------------- */

uint32_t kiln_gguf_version(const kiln_gguf *g) { return g ? g->version : 0; }
uint32_t kiln_gguf_alignment(const kiln_gguf *g) { return g ? g->alignment : 0; }
int64_t kiln_gguf_n_kv(const kiln_gguf *g) { return g ? g->n_kv : 0; }
int64_t kiln_gguf_n_tensors(const kiln_gguf *g) { return g ? g->n_tensors : 0; }

const kiln_gguf_kv *kiln_gguf_kv_at(const kiln_gguf *g, int64_t i) {
    return g && i >= 0 && i < g->n_kv ? &g->kvs[i] : NULL;
}

const kiln_tensor *kiln_gguf_tensor_at(const kiln_gguf *g, int64_t i) {
    return g && i >= 0 && i < g->n_tensors ? &g->tensors[i] : NULL;
}

const kiln_gguf_kv *kiln_gguf_find(const kiln_gguf *g, const char *key) {
    if (!g || !key) return NULL;
    int64_t lo = 0, hi = g->n_kv;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        int r = strcmp(g->kv_by_key[mid]->key.ptr, key);
        if (r == 0) return g->kv_by_key[mid];
        if (r < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

const kiln_tensor *kiln_gguf_find_tensor(const kiln_gguf *g, const char *name) {
    if (!g || !name) return NULL;
    int64_t lo = 0, hi = g->n_tensors;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        int r = strcmp(g->t_by_name[mid]->name, name);
        if (r == 0) return g->t_by_name[mid];
        if (r < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

/* Common start of the typed getters: the kv, or *found = 0 (or an error when found is NULL,
 * meaning the caller requires the key). */
static kiln_status getter_find(const kiln_gguf *g, const char *key, int *found,
                               const kiln_gguf_kv **kv) {
    if (!g || !key) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_gguf_get: NULL argument");
    *kv = kiln_gguf_find(g, key);
    if (!*kv) {
        if (found) {
            *found = 0;
            return KILN_OK;
        }
        return kiln_error(KILN_ERR_FORMAT, "%s: missing key '%s'", g->label, key);
    }
    return KILN_OK;
}

static kiln_status wrong_type(const kiln_gguf *g, const kiln_gguf_kv *kv, const char *want) {
    return kiln_error(KILN_ERR_FORMAT, "%s: key '%s' has type %s%s%s, expected %s", g->label,
                      kv->key.ptr, type_name(kv->type), kv->type == KILN_GGUF_ARRAY ? " of " : "",
                      kv->type == KILN_GGUF_ARRAY ? type_name(kv->arr_type) : "", want);
}

kiln_status kiln_gguf_get_u32(const kiln_gguf *g, const char *key, uint32_t *out, int *found) {
    const kiln_gguf_kv *kv;
    KILN_TRY(getter_find(g, key, found, &kv));
    if (!kv) return KILN_OK;
    if (!is_integer_type(kv->type)) return wrong_type(g, kv, "an integer");
    int64_t sv;
    uint64_t uv;
    bool neg;
    load_int(kv->value, kv->type, &sv, &uv, &neg);
    if (neg || uv > UINT32_MAX)
        return kiln_error(KILN_ERR_FORMAT, "%s: key '%s': value %s%llu does not fit uint32",
                          g->label, kv->key.ptr, neg ? "-" : "",
                          neg ? (unsigned long long)(-(sv + 1)) + 1ull : (unsigned long long)uv);
    if (out) *out = (uint32_t)uv;
    if (found) *found = 1;
    return KILN_OK;
}

kiln_status kiln_gguf_get_i64(const kiln_gguf *g, const char *key, int64_t *out, int *found) {
    const kiln_gguf_kv *kv;
    KILN_TRY(getter_find(g, key, found, &kv));
    if (!kv) return KILN_OK;
    if (!is_integer_type(kv->type)) return wrong_type(g, kv, "an integer");
    int64_t sv;
    uint64_t uv;
    bool neg;
    load_int(kv->value, kv->type, &sv, &uv, &neg);
    if (!neg && uv > (uint64_t)INT64_MAX)
        return kiln_error(KILN_ERR_FORMAT, "%s: key '%s': value %llu does not fit int64",
                          g->label, kv->key.ptr, (unsigned long long)uv);
    if (out) *out = sv;
    if (found) *found = 1;
    return KILN_OK;
}

kiln_status kiln_gguf_get_f32(const kiln_gguf *g, const char *key, float *out, int *found) {
    const kiln_gguf_kv *kv;
    KILN_TRY(getter_find(g, key, found, &kv));
    if (!kv) return KILN_OK;
    float v;
    if (kv->type == KILN_GGUF_FLOAT32) {
        uint32_t u = kiln_le32(kv->value);
        memcpy(&v, &u, 4);
    } else if (kv->type == KILN_GGUF_FLOAT64) { /* narrowed, rounding to nearest */
        uint64_t u = kiln_le64(kv->value);
        double dv;
        memcpy(&dv, &u, 8);
        v = (float)dv;
    } else {
        return wrong_type(g, kv, "float32");
    }
    if (out) *out = v;
    if (found) *found = 1;
    return KILN_OK;
}

kiln_status kiln_gguf_get_bool(const kiln_gguf *g, const char *key, int *out, int *found) {
    const kiln_gguf_kv *kv;
    KILN_TRY(getter_find(g, key, found, &kv));
    if (!kv) return KILN_OK;
    if (kv->type != KILN_GGUF_BOOL) return wrong_type(g, kv, "bool");
    if (out) *out = kv->value[0] != 0;
    if (found) *found = 1;
    return KILN_OK;
}

kiln_status kiln_gguf_get_str(const kiln_gguf *g, const char *key, kiln_gguf_str *out,
                              int *found) {
    const kiln_gguf_kv *kv;
    KILN_TRY(getter_find(g, key, found, &kv));
    if (!kv) return KILN_OK;
    if (kv->type != KILN_GGUF_STRING) return wrong_type(g, kv, "string");
    if (out) {
        out->ptr = (const char *)kv->value;
        out->len = kiln_le64(kv->value - 8);
    }
    if (found) *found = 1;
    return KILN_OK;
}

/* Element i of a numeric array as a double (0 when out of range or not numeric). */
static double arr_elem(const kiln_gguf_kv *kv, uint64_t i, bool *is_int, int64_t *iv) {
    *is_int = false;
    *iv = 0;
    if (!kv || kv->type != KILN_GGUF_ARRAY || i >= kv->arr_len) return 0.0;
    size_t es = scalar_size(kv->arr_type);
    if (!es) return 0.0;
    const uint8_t *p = kv->value + i * es;
    if (kv->arr_type == KILN_GGUF_FLOAT32) {
        float f;
        uint32_t u = kiln_le32(p);
        memcpy(&f, &u, 4);
        return f;
    }
    if (kv->arr_type == KILN_GGUF_FLOAT64) {
        double d;
        uint64_t u = kiln_le64(p);
        memcpy(&d, &u, 8);
        return d;
    }
    if (kv->arr_type == KILN_GGUF_BOOL) {
        *is_int = true;
        *iv = p[0] != 0;
        return (double)*iv;
    }
    uint64_t uv;
    bool neg;
    load_int(p, kv->arr_type, iv, &uv, &neg);
    *is_int = true;
    return neg ? (double)*iv : (double)uv;
}

int32_t kiln_gguf_arr_i32(const kiln_gguf_kv *kv, uint64_t i) {
    bool is_int;
    int64_t iv;
    arr_elem(kv, i, &is_int, &iv);
    if (!is_int) return 0;
    /* integer arrays narrower than 64 bits convert exactly; wider values saturate */
    return iv > INT32_MAX ? INT32_MAX : iv < INT32_MIN ? INT32_MIN : (int32_t)iv;
}

float kiln_gguf_arr_f32(const kiln_gguf_kv *kv, uint64_t i) {
    bool is_int;
    int64_t iv;
    return (float)arr_elem(kv, i, &is_int, &iv); /* float32 elements round-trip exactly */
}

kiln_gguf_str kiln_gguf_arr_str(const kiln_gguf_kv *kv, uint64_t i) {
    kiln_gguf_str none = {NULL, 0};
    if (!kv || kv->type != KILN_GGUF_ARRAY || kv->arr_type != KILN_GGUF_STRING || !kv->arr_strs ||
        i >= kv->arr_len)
        return none;
    return kv->arr_strs[i];
}
