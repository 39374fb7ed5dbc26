/*
 * safetensors.c -- reader for .safetensors files and sharded folders.
 *
 * File layout (https://huggingface.co/docs/safetensors):
 *   u64 LE  N                      header length in bytes
 *   N bytes JSON object            { name: {dtype, shape, data_offsets}, "__metadata__": {..} }
 *   rest    data section           tensors, data_offsets relative to its start
 *
 * Everything is validated before a tensor is exposed (see safetensors.h). Tensor data is never
 * copied: kiln_tensor.data points into the mapped (or read) file, so it has whatever alignment
 * the writer gave it (the reference writer aligns; a hostile file need not).
 *
 * A handle is a list of parts (one per file) plus one table of all tensors, parts in the order
 * their file names sort, header order inside a part, and a by-name index for O(log n) lookup.
 *
 * JSON is parsed by cJSON with its default allocator: kiln does not install process-wide cJSON
 * hooks, so cJSON's own (short-lived) allocations are outside kiln's accounting. Every tree is
 * deleted before returning.
 */
#include "safetensors.h"
#include "json_text.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The header is JSON text; 100 MB is what the reference implementation allows. */
#define ST_HEADER_CAP (100u * 1000u * 1000u)
/* model.safetensors.index.json: a name -> file map, a few hundred kB for the largest models. */
#define ST_INDEX_CAP (64u * 1024u * 1024u)
/* Integers above 2^53 are not exact in the double cJSON stores; no real size gets near it. */
#define ST_MAX_EXACT 9007199254740992.0

typedef struct st_part {
    char *label;        /* the file path (or the caller's label), for messages */
    kiln_file_map map;  /* the file, when the part came from a path (map.data == NULL if not) */
    char *names;        /* pool of NUL-terminated tensor names */
    kiln_tensor *tensors; /* moved into the handle's table by st_assemble */
    int64_t n;
} st_part;

struct kiln_safetensors {
    st_part *parts;
    int n_parts;
    kiln_tensor *tensors;       /* (n) all parts, in part order */
    int64_t n;
    int64_t *part_start;        /* (n_parts + 1) first table index of each part */
    const kiln_tensor **by_name; /* (n) sorted by strcmp(name) */
};

/* ---- dtypes -------------------------------------------------------------------------------- */

typedef struct st_dtype {
    const char *name;  /* as the format spells it */
    int supported;     /* kiln computes with it */
    kiln_dtype dtype;
    unsigned size;     /* bytes per element */
} st_dtype;

/* Every dtype the safetensors format defines; kiln computes with the first five. */
static const st_dtype st_dtypes[] = {
    {"F32", 1, KILN_DTYPE_F32, 4},  {"F16", 1, KILN_DTYPE_F16, 2}, {"BF16", 1, KILN_DTYPE_BF16, 2},
    {"I32", 1, KILN_DTYPE_I32, 4},  {"I64", 1, KILN_DTYPE_I64, 8}, {"F64", 0, 0, 8},
    {"I8", 0, 0, 1},    {"U8", 0, 0, 1},      {"I16", 0, 0, 2},     {"U16", 0, 0, 2},
    {"U32", 0, 0, 4},   {"U64", 0, 0, 8},     {"BOOL", 0, 0, 1},    {"F8_E4M3", 0, 0, 1},
    {"F8_E5M2", 0, 0, 1}, {"F8_E8M0", 0, 0, 1}, {"F6_E2M3", 0, 0, 1}, {"F6_E3M2", 0, 0, 1},
    {"F4", 0, 0, 1},    {"C64", 0, 0, 8},
};

static const st_dtype *st_dtype_find(const char *s) {
    for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
        if (strcmp(st_dtypes[i].name, s) == 0) return &st_dtypes[i];
    return NULL;
}

/* ---- small helpers ------------------------------------------------------------------------- */

/* 1 if s[0..n) is well-formed UTF-8 (no overlongs, no surrogates, <= U+10FFFF). */
static int st_utf8_valid(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        if (c < 0x80) { i++; continue; }
        size_t len;
        unsigned cp, min;
        if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; min = 0x80; }
        else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; min = 0x800; }
        else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; min = 0x10000; }
        else return 0;
        if (n - i < len) return 0;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
        i += len;
    }
    return 1;
}

/* A JSON number that is an exact non-negative integer (below 2^53). */
static int st_json_uint(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v)) return 0;
    double d = v->valuedouble;
    if (!(d >= 0.0) || d > ST_MAX_EXACT) return 0; /* also rejects NaN */
    uint64_t u = (uint64_t)d;
    if ((double)u != d) return 0;
    *out = u;
    return 1;
}

static char *st_path_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name), n;
    if (kiln_add_overflow(a, b, &n) || kiln_add_overflow(n, 2, &n)) return NULL;
    char *p = kiln_malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static void st_part_free(st_part *p) {
    kiln_free(p->label);
    kiln_file_map_close(&p->map);
    kiln_free(p->names);
    kiln_free(p->tensors);
    memset(p, 0, sizeof *p);
}

/* ---- one file's header ---------------------------------------------------------------------- */

typedef struct st_span {
    uint64_t begin, end;
    int64_t idx;
} st_span;

static int st_span_cmp(const void *a, const void *b) {
    const st_span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

/* "__metadata__": an object whose values are all strings. */
static kiln_status st_check_metadata(const cJSON *m, const char *label) {
    if (!cJSON_IsObject(m))
        return kiln_error(KILN_ERR_FORMAT, "%s: __metadata__: not a JSON object", label);
    for (const cJSON *kv = m->child; kv; kv = kv->next)
        if (!cJSON_IsString(kv))
            return kiln_error(KILN_ERR_FORMAT, "%s: __metadata__: value of '%.200s' is not a string",
                              label, kv->string);
    return KILN_OK;
}

/* Fill t (everything but the name) from one header entry; *span gets its data_offsets. */
static kiln_status st_parse_entry(const cJSON *e, const char *name, const uint8_t *data,
                                  uint64_t data_size, const char *label, kiln_tensor *t,
                                  st_span *span) {
    if (!cJSON_IsObject(e))
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%.200s': entry is not a JSON object", label,
                          name);
    const cJSON *jdtype = NULL, *jshape = NULL, *joff = NULL;
    for (const cJSON *kv = e->child; kv; kv = kv->next) {
        const cJSON **slot = NULL;
        if (strcmp(kv->string, "dtype") == 0) slot = &jdtype;
        else if (strcmp(kv->string, "shape") == 0) slot = &jshape;
        else if (strcmp(kv->string, "data_offsets") == 0) slot = &joff;
        else continue; /* unknown keys are ignored, as the reference reader does */
        if (*slot)
            return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%.200s': duplicate key '%s'", label,
                              name, kv->string);
        *slot = kv;
    }

    /* dtype */
    if (!jdtype) return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%.200s': missing dtype", label, name);
    if (!cJSON_IsString(jdtype))
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%.200s': dtype is not a string", label, name);
    const st_dtype *dt = st_dtype_find(jdtype->valuestring);
    if (!dt)
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%.200s': unknown dtype '%.40s'", label, name,
                          jdtype->valuestring);
    if (!dt->supported)
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "%s: tensor '%.200s': unsupported dtype %s (kiln reads F32, F16, BF16, "
                          "I32, I64)", label, name, dt->name);

    /* shape: [] is a scalar (kept as n_dims 1, shape {1}) */
    if (!jshape) return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%.200s': missing shape", label, name);
    if (!cJSON_IsArray(jshape))
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%.200s': shape is not an array", label, name);
    int nd = 0;
    uint64_t count = 1;
    t->shape[0] = t->shape[1] = t->shape[2] = t->shape[3] = 1;
    for (const cJSON *d = jshape->child; d; d = d->next, nd++) {
        if (nd == KILN_MAX_DIMS)
            return kiln_error(KILN_ERR_UNSUPPORTED,
                              "%s: tensor '%.200s': shape has more than %d dims", label, name,
                              KILN_MAX_DIMS);
        uint64_t v;
        if (!st_json_uint(d, &v)) {
            if (cJSON_IsNumber(d) && d->valuedouble < 0)
                return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%.200s': shape[%d] = %g is negative",
                                  label, name, nd, d->valuedouble);
            return kiln_error(KILN_ERR_FORMAT,
                              "%s: tensor '%.200s': shape[%d] is not an exact non-negative integer",
                              label, name, nd);
        }
        if (kiln_mul_overflow_u64(count, v, &count))
            return kiln_error(KILN_ERR_FORMAT,
                              "%s: tensor '%.200s': shape: element count overflows 64 bits", label,
                              name);
        t->shape[nd] = (int64_t)v;
    }
    uint64_t nbytes;
    if (kiln_mul_overflow_u64(count, dt->size, &nbytes))
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%.200s': shape: byte count overflows 64 bits",
                          label, name);

    /* data_offsets */
    if (!joff)
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%.200s': missing data_offsets", label, name);
    uint64_t b, en;
    if (!cJSON_IsArray(joff) || cJSON_GetArraySize(joff) != 2 || !st_json_uint(joff->child, &b) ||
        !st_json_uint(joff->child->next, &en))
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: tensor '%.200s': data_offsets is not [begin, end] of non-negative "
                          "integers", label, name);
    if (b > en)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: tensor '%.200s': data_offsets begin %llu > end %llu", label, name,
                          (unsigned long long)b, (unsigned long long)en);
    if (en > data_size)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: tensor '%.200s': data_offsets end %llu is past the data section "
                          "(%llu bytes)", label, name, (unsigned long long)en,
                          (unsigned long long)data_size);
    if (en - b != nbytes)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: tensor '%.200s': data_offsets span %llu bytes but dtype %s and shape "
                          "need %llu", label, name, (unsigned long long)(en - b), dt->name,
                          (unsigned long long)nbytes);

    t->dtype = dt->dtype;
    t->n_dims = nd == 0 ? 1 : nd;
    t->data = data + b;
    t->nbytes = (size_t)nbytes; /* <= data_size, so it fits */
    span->begin = b;
    span->end = en;
    return KILN_OK;
}

/* The data section must be covered exactly: sorted by offset, each tensor starts where the
 * previous one ended, and the last one ends at the end of the file. */
static kiln_status st_check_coverage(st_span *spans, int64_t n, uint64_t data_size,
                                     const kiln_tensor *tensors, const char *label) {
    if (n > 0) qsort(spans, (size_t)n, sizeof *spans, st_span_cmp);
    uint64_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        const st_span *s = &spans[i];
        if (s->begin < at)
            return kiln_error(KILN_ERR_FORMAT,
                              "%s: tensor '%.200s': data_offsets [%llu, %llu) overlap tensor "
                              "'%.200s' (which ends at %llu)", label, tensors[s->idx].name,
                              (unsigned long long)s->begin, (unsigned long long)s->end,
                              tensors[spans[i - 1].idx].name, (unsigned long long)at);
        if (s->begin > at)
            return kiln_error(KILN_ERR_FORMAT,
                              "%s: data section has a hole: bytes [%llu, %llu) before tensor "
                              "'%.200s' belong to no tensor", label, (unsigned long long)at,
                              (unsigned long long)s->begin, tensors[s->idx].name);
        at = s->end;
    }
    if (at != data_size)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: data section has a hole: bytes [%llu, %llu) at its end belong to no "
                          "tensor", label, (unsigned long long)at, (unsigned long long)data_size);
    return KILN_OK;
}

/* Validate the header of one file held in data[0..size) and fill p->names, p->tensors, p->n.
 * On failure p's tensor fields are left empty. */
static kiln_status st_parse(const uint8_t *data, size_t size, st_part *p) {
    const char *label = p->label;
    if (size < 8)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: file is %zu bytes, too short for the 8-byte header length", label,
                          size);
    uint64_t hlen = kiln_le64(data);
    if (hlen > ST_HEADER_CAP)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: header length %llu is larger than the %u-byte cap", label,
                          (unsigned long long)hlen, ST_HEADER_CAP);
    if (hlen > size - 8)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: header length %llu runs past the end of the file (%zu bytes)", label,
                          (unsigned long long)hlen, size);
    const char *hdr = (const char *)data + 8;
    const uint8_t *dsec = data + 8 + hlen;
    uint64_t data_size = size - 8 - hlen;

    KILN_TRY(kiln_json_check_no_nul(hdr, (size_t)hlen, label));
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(hdr, (size_t)hlen, &end, 0);
    if (!root) {
        size_t at = end && end >= hdr && end <= hdr + hlen ? (size_t)(end - hdr) : 0;
        return kiln_error(KILN_ERR_FORMAT, "%s: header is not valid JSON (at header byte %zu)",
                          label, at);
    }
    /* The format allows trailing padding after the object. */
    for (const char *q = end; q < hdr + hlen; q++) {
        if (*q != ' ' && *q != '\t' && *q != '\n' && *q != '\r') {
            cJSON_Delete(root);
            return kiln_error(KILN_ERR_FORMAT,
                              "%s: header has trailing bytes after the JSON object (at header "
                              "byte %zu)", label, (size_t)(q - hdr));
        }
    }
    kiln_status st = KILN_OK;
    st_span *spans = NULL;
    if (!cJSON_IsObject(root)) {
        st = kiln_error(KILN_ERR_FORMAT, "%s: header is not a JSON object", label);
        goto done;
    }

    /* Pass 1: count tensors and name bytes, check names and __metadata__. */
    int64_t n = 0;
    size_t name_bytes = 0;
    int seen_meta = 0;
    for (const cJSON *e = root->child; e; e = e->next) {
        if (strcmp(e->string, "__metadata__") == 0) {
            if (seen_meta++) {
                st = kiln_error(KILN_ERR_FORMAT, "%s: __metadata__ appears twice", label);
                goto done;
            }
            if ((st = st_check_metadata(e, label)) != KILN_OK) goto done;
            continue;
        }
        size_t len = strlen(e->string);
        if (len == 0 || !st_utf8_valid((const unsigned char *)e->string, len)) {
            st = kiln_error(KILN_ERR_FORMAT, "%s: tensor #%lld: name is empty or not valid UTF-8",
                            label, (long long)n);
            goto done;
        }
        if (kiln_add_overflow(name_bytes, len + 1, &name_bytes)) {
            st = kiln_error(KILN_ERR_FORMAT, "%s: tensor names overflow", label);
            goto done;
        }
        n++;
    }

    p->names = kiln_malloc(name_bytes);
    p->tensors = kiln_calloc((size_t)n, sizeof *p->tensors);
    spans = kiln_calloc((size_t)n, sizeof *spans);
    if (!p->names || !p->tensors || !spans) {
        st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory for %lld tensors", label, (long long)n);
        goto done;
    }

    /* Pass 2: fill the tensors. */
    char *w = p->names;
    int64_t i = 0;
    for (const cJSON *e = root->child; e; e = e->next) {
        if (strcmp(e->string, "__metadata__") == 0) continue;
        size_t len = strlen(e->string);
        memcpy(w, e->string, len + 1);
        kiln_tensor *t = &p->tensors[i];
        t->name = w;
        w += len + 1;
        spans[i].idx = i;
        st = st_parse_entry(e, t->name, dsec, data_size, label, t, &spans[i]);
        if (st != KILN_OK) goto done;
        i++;
    }
    st = st_check_coverage(spans, n, data_size, p->tensors, label);
    if (st == KILN_OK) p->n = n;

done:
    kiln_free(spans);
    cJSON_Delete(root);
    if (st != KILN_OK) {
        kiln_free(p->names);
        kiln_free(p->tensors);
        p->names = NULL;
        p->tensors = NULL;
        p->n = 0;
    }
    return st;
}

/* ---- the handle ---------------------------------------------------------------------------- */

static int st_by_name_cmp(const void *a, const void *b) {
    const kiln_tensor *x = *(const kiln_tensor *const *)a, *y = *(const kiln_tensor *const *)b;
    int c = strcmp(x->name, y->name);
    if (c) return c;
    return x < y ? -1 : x > y; /* same table, so comparable: keeps the sort deterministic */
}

static int st_part_of(const kiln_safetensors *s, const kiln_tensor *t) {
    int64_t i = t - s->tensors;
    int p = 0;
    while (p + 1 < s->n_parts && s->part_start[p + 1] <= i) p++;
    return p;
}

/* Move the parts' tensors into one table, build the name index, refuse duplicate names. */
static kiln_status st_assemble(kiln_safetensors *s) {
    s->part_start = kiln_calloc((size_t)s->n_parts + 1, sizeof *s->part_start);
    if (!s->part_start) return kiln_error(KILN_ERR_NOMEM, "safetensors: out of memory");
    int64_t n = 0;
    for (int p = 0; p < s->n_parts; p++) {
        s->part_start[p] = n;
        n += s->parts[p].n;
    }
    s->part_start[s->n_parts] = n;
    if (s->n_parts == 1) {
        s->tensors = s->parts[0].tensors;
        s->parts[0].tensors = NULL;
    } else {
        s->tensors = kiln_calloc((size_t)n, sizeof *s->tensors);
        if (!s->tensors) return kiln_error(KILN_ERR_NOMEM, "safetensors: out of memory");
        for (int p = 0; p < s->n_parts; p++) {
            if (s->parts[p].n)
                memcpy(s->tensors + s->part_start[p], s->parts[p].tensors,
                       (size_t)s->parts[p].n * sizeof *s->tensors);
            kiln_free(s->parts[p].tensors);
            s->parts[p].tensors = NULL;
        }
    }
    s->n = n;
    s->by_name = kiln_calloc((size_t)n, sizeof *s->by_name);
    if (!s->by_name) return kiln_error(KILN_ERR_NOMEM, "safetensors: out of memory");
    for (int64_t i = 0; i < n; i++) s->by_name[i] = &s->tensors[i];
    if (n > 1) qsort(s->by_name, (size_t)n, sizeof *s->by_name, st_by_name_cmp);
    for (int64_t i = 1; i < n; i++) {
        if (strcmp(s->by_name[i - 1]->name, s->by_name[i]->name) == 0) {
            int a = st_part_of(s, s->by_name[i - 1]), b = st_part_of(s, s->by_name[i]);
            if (a == b)
                return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%.200s' appears twice in the header",
                                  s->parts[a].label, s->by_name[i]->name);
            return kiln_error(KILN_ERR_FORMAT, "tensor '%.200s' appears in two shards: %s and %s",
                              s->by_name[i]->name, s->parts[a].label, s->parts[b].label);
        }
    }
    return KILN_OK;
}

static kiln_safetensors *st_new(int n_parts) {
    kiln_safetensors *s = kiln_calloc(1, sizeof *s);
    if (!s) return NULL;
    s->parts = kiln_calloc((size_t)n_parts, sizeof *s->parts);
    if (!s->parts) {
        kiln_free(s);
        return NULL;
    }
    s->n_parts = n_parts;
    return s;
}

void kiln_safetensors_close(kiln_safetensors *s) {
    if (!s) return;
    for (int p = 0; p < s->n_parts; p++) st_part_free(&s->parts[p]);
    kiln_free(s->parts);
    kiln_free(s->tensors);
    kiln_free(s->part_start);
    kiln_free(s->by_name);
    kiln_free(s);
}

/* Open one file into part p (label = path). */
static kiln_status st_part_open_file(st_part *p, const char *path, int use_mmap) {
    if (!p->label && !(p->label = kiln_strdup(path)))
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", path);
    KILN_TRY(kiln_file_map_open(path, use_mmap, &p->map));
    return st_parse(p->map.data, p->map.size, p);
}

kiln_status kiln_safetensors_open_memory(const uint8_t *data, size_t size, const char *label,
                                         kiln_safetensors **out) {
    if ((!data && size) || !out)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_safetensors_open_memory: NULL argument");
    if (!label) label = "<memory>";
    kiln_safetensors *s = st_new(1);
    if (!s) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", label);
    kiln_status st = KILN_OK;
    if (!(s->parts[0].label = kiln_strdup(label)))
        st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory", label);
    if (st == KILN_OK) st = st_parse(data, size, &s->parts[0]);
    if (st == KILN_OK) st = st_assemble(s);
    if (st != KILN_OK) {
        kiln_safetensors_close(s);
        return st;
    }
    *out = s;
    return KILN_OK;
}

kiln_status kiln_safetensors_open(const char *path, int use_mmap, kiln_safetensors **out) {
    if (!path || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_safetensors_open: NULL argument");
    kiln_safetensors *s = st_new(1);
    if (!s) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", path);
    kiln_status st = st_part_open_file(&s->parts[0], path, use_mmap);
    if (st == KILN_OK) st = st_assemble(s);
    if (st != KILN_OK) {
        kiln_safetensors_close(s);
        return st;
    }
    *out = s;
    return KILN_OK;
}

/* ---- sharded folders ----------------------------------------------------------------------- */

typedef struct st_wm_entry {
    const char *name;  /* tensor name (in the cJSON tree) */
    const char *shard; /* file name (in the cJSON tree) */
    int part;          /* index of the shard in the sorted distinct list */
} st_wm_entry;

static int st_str_cmp(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static int st_wm_cmp(const void *a, const void *b) {
    const st_wm_entry *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    if (c) return c;
    return x < y ? -1 : x > y;
}

/* A shard must be a plain file name inside the folder. */
static int st_shard_name_ok(const char *s) {
    if (!s[0] || strcmp(s, ".") == 0 || strcmp(s, "..") == 0) return 0;
    if (strchr(s, '/') || strchr(s, '\\')) return 0;
    return st_utf8_valid((const unsigned char *)s, strlen(s));
}

static const kiln_tensor *st_find_in(const kiln_safetensors *s, const char *name) {
    size_t lo = 0, hi = (size_t)s->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(s->by_name[mid]->name, name);
        if (c == 0) return s->by_name[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

static kiln_status st_open_index(const char *dir, const char *index_path, int use_mmap,
                                 kiln_safetensors **out) {
    char *text = NULL;
    size_t len = 0;
    KILN_TRY(kiln_read_text_file(index_path, ST_INDEX_CAP, &text, &len));
    kiln_status st = kiln_json_check_no_nul(text, len, index_path);
    if (st != KILN_OK) {
        kiln_free(text);
        return st;
    }
    /* text is NUL-terminated: require the document to end there (no trailing garbage) */
    cJSON *root = cJSON_ParseWithLengthOpts(text, len + 1, NULL, 1);
    kiln_free(text);
    st_wm_entry *wm = NULL;
    const char **shards = NULL;
    kiln_safetensors *s = NULL;
    char *path = NULL;
    if (!root) return kiln_error(KILN_ERR_FORMAT, "%s: not valid JSON", index_path);

    const cJSON *map = cJSON_IsObject(root) ? cJSON_GetObjectItemCaseSensitive(root, "weight_map")
                                            : NULL;
    if (!cJSON_IsObject(map)) {
        st = kiln_error(KILN_ERR_FORMAT, "%s: weight_map: missing or not a JSON object", index_path);
        goto done;
    }
    int n = cJSON_GetArraySize(map);
    if (n <= 0) {
        st = kiln_error(KILN_ERR_FORMAT, "%s: weight_map is empty", index_path);
        goto done;
    }
    wm = kiln_calloc((size_t)n, sizeof *wm);
    shards = kiln_calloc((size_t)n, sizeof *shards);
    if (!wm || !shards) {
        st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory", index_path);
        goto done;
    }
    int i = 0;
    for (const cJSON *e = map->child; e; e = e->next, i++) {
        if (!cJSON_IsString(e)) {
            st = kiln_error(KILN_ERR_FORMAT, "%s: weight_map: value of '%.200s' is not a string",
                            index_path, e->string);
            goto done;
        }
        if (!st_shard_name_ok(e->valuestring)) {
            st = kiln_error(KILN_ERR_FORMAT,
                            "%s: weight_map: tensor '%.200s': shard '%.200s' is not a plain file "
                            "name in the folder", index_path, e->string, e->valuestring);
            goto done;
        }
        wm[i].name = e->string;
        wm[i].shard = e->valuestring;
        shards[i] = e->valuestring;
    }

    /* Distinct shard names, sorted: each shard is opened once, in this order. */
    qsort(shards, (size_t)n, sizeof *shards, st_str_cmp);
    int n_shards = 0;
    for (i = 0; i < n; i++)
        if (n_shards == 0 || strcmp(shards[n_shards - 1], shards[i]) != 0) shards[n_shards++] = shards[i];
    for (i = 0; i < n; i++) {
        const char **hit = bsearch(&wm[i].shard, shards, (size_t)n_shards, sizeof *shards, st_str_cmp);
        wm[i].part = (int)(hit - shards);
    }

    s = st_new(n_shards);
    if (!s) {
        st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory", index_path);
        goto done;
    }
    for (int p = 0; p < n_shards; p++) {
        if (!(path = st_path_join(dir, shards[p]))) {
            st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory", index_path);
            goto done;
        }
        s->parts[p].label = path; /* the part owns it now */
        path = NULL;
        if ((st = st_part_open_file(&s->parts[p], s->parts[p].label, use_mmap)) != KILN_OK) {
            if (st == KILN_ERR_IO)
                kiln_error_prefix(st, "%s: shard named by weight_map", index_path);
            goto done;
        }
    }
    if ((st = st_assemble(s)) != KILN_OK) goto done;

    /* The index and the shards must agree exactly: names unique in weight_map, each found in
     * the shard it names, and no shard tensor missing from weight_map. */
    qsort(wm, (size_t)n, sizeof *wm, st_wm_cmp);
    for (i = 0; i < n; i++) {
        if (i > 0 && strcmp(wm[i - 1].name, wm[i].name) == 0) {
            st = kiln_error(KILN_ERR_FORMAT, "%s: weight_map: tensor '%.200s' is listed twice",
                            index_path, wm[i].name);
            goto done;
        }
        const kiln_tensor *t = st_find_in(s, wm[i].name);
        if (!t) {
            st = kiln_error(KILN_ERR_FORMAT,
                            "%s: weight_map: tensor '%.200s' is not in its shard %s", index_path,
                            wm[i].name, wm[i].shard);
            goto done;
        }
        int p = st_part_of(s, t);
        if (p != wm[i].part) {
            st = kiln_error(KILN_ERR_FORMAT,
                            "%s: weight_map: tensor '%.200s' is said to be in %s but is in %s",
                            index_path, wm[i].name, wm[i].shard, s->parts[p].label);
            goto done;
        }
    }
    if (s->n != n) {
        /* Every weight_map name was found and names are unique, so the shards hold more. */
        for (int64_t k = 0; k < s->n; k++) {
            st_wm_entry key = {s->tensors[k].name, NULL, 0};
            size_t lo = 0, hi = (size_t)n;
            int found = 0;
            while (lo < hi && !found) {
                size_t mid = lo + (hi - lo) / 2;
                int c = strcmp(wm[mid].name, key.name);
                if (c == 0) found = 1;
                else if (c < 0) lo = mid + 1;
                else hi = mid;
            }
            if (!found) {
                st = kiln_error(KILN_ERR_FORMAT, "%s: tensor '%.200s' is not listed in %s's weight_map",
                                s->parts[st_part_of(s, &s->tensors[k])].label, key.name, index_path);
                goto done;
            }
        }
        st = kiln_error(KILN_ERR_INTERNAL, "%s: weight_map and shards disagree", index_path);
    }

done:
    kiln_free(path);
    kiln_free(wm);
    kiln_free(shards);
    cJSON_Delete(root);
    if (st != KILN_OK) {
        kiln_safetensors_close(s);
        return st;
    }
    *out = s;
    return KILN_OK;
}

kiln_status kiln_safetensors_open_dir(const char *dir, int use_mmap, kiln_safetensors **out) {
    if (!dir || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_safetensors_open_dir: NULL argument");
    /* transformers looks for the single file first, then the index. */
    char *single = st_path_join(dir, "model.safetensors");
    if (!single) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", dir);
    int present = 0;
    kiln_status st = kiln_path_optional_file(single, &present);
    if (st != KILN_OK || present) {
        if (st == KILN_OK) st = kiln_safetensors_open(single, use_mmap, out);
        kiln_free(single);
        return st;
    }
    kiln_free(single);
    char *index = st_path_join(dir, "model.safetensors.index.json");
    if (!index) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", dir);
    st = kiln_path_optional_file(index, &present);
    if (st == KILN_OK && present) st = st_open_index(dir, index, use_mmap, out);
    else if (st == KILN_OK)
        st = kiln_error(KILN_ERR_IO, "%s: no model.safetensors or model.safetensors.index.json",
                        dir);
    kiln_free(index);
    return st;
}

/* ---- queries ------------------------------------------------------------------------------- */

int64_t kiln_safetensors_n_tensors(const kiln_safetensors *s) { return s ? s->n : 0; }

const kiln_tensor *kiln_safetensors_tensor_at(const kiln_safetensors *s, int64_t i) {
    if (!s || i < 0 || i >= s->n) return NULL;
    return &s->tensors[i];
}

const kiln_tensor *kiln_safetensors_find(const kiln_safetensors *s, const char *name) {
    if (!s || !name) return NULL;
    return st_find_in(s, name);
}
