/*
 * safetensors_write.c -- the .safetensors writer and durable-file helpers (see the header).
 *
 * The header JSON is built with cJSON (its own allocator, outside kiln's accounting, as in
 * the reader); integers print exactly (cJSON uses %d or %1.15g, and every offset is checked
 * to stay below 2^53). Data goes to disk in one write per tensor.
 */
#include "safetensors_write.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors is little-endian; this host is not"
#endif

#define STW_MAX_EXACT 9007199254740992.0 /* 2^53 */

/* ---- durable files --------------------------------------------------------------------- */

/* The folder part of path ("." when it has none) into buf. */
static void stw_dirname(const char *path, char *buf, size_t cap) {
    const char *slash = strrchr(path, '/');
    if (!slash) snprintf(buf, cap, ".");
    else if (slash == path) snprintf(buf, cap, "/");
    else snprintf(buf, cap, "%.*s", (int)(slash - path), path);
}

/* An open temporary file beside its final path. */
typedef struct stw_file {
    char *path;     /* final */
    char *tmp_path; /* <path>.tmp-<pid> */
    int fd;
} stw_file;

static kiln_status stw_open(stw_file *f, const char *path) {
    memset(f, 0, sizeof *f);
    f->fd = -1;
    size_t n = strlen(path) + 32;
    f->path = kiln_strdup(path);
    f->tmp_path = kiln_malloc(n);
    if (!f->path || !f->tmp_path) {
        kiln_free(f->path);
        kiln_free(f->tmp_path);
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", path);
    }
    snprintf(f->tmp_path, n, "%s.tmp-%ld", path, (long)getpid());
    unlink(f->tmp_path); /* a stale one of a dead writer with our pid */
    f->fd = open(f->tmp_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (f->fd < 0) {
        kiln_status st = kiln_error(KILN_ERR_IO, "%s: cannot create: %s", f->tmp_path, strerror(errno));
        kiln_free(f->path);
        kiln_free(f->tmp_path);
        return st;
    }
    return KILN_OK;
}

/* fsync, close, rename into place, fsync the folder; on failure (or when st is already an
 * error) remove the temporary file. Returns the first error. */
static kiln_status stw_close(stw_file *f, kiln_status st) {
    if (st == KILN_OK && fsync(f->fd) != 0)
        st = kiln_error(KILN_ERR_IO, "%s: fsync failed: %s", f->tmp_path, strerror(errno));
    if (close(f->fd) != 0 && st == KILN_OK)
        st = kiln_error(KILN_ERR_IO, "%s: close failed: %s", f->tmp_path, strerror(errno));
    if (st == KILN_OK && rename(f->tmp_path, f->path) != 0)
        st = kiln_error(KILN_ERR_IO, "%s: cannot rename to %s: %s", f->tmp_path, f->path,
                        strerror(errno));
    if (st != KILN_OK) {
        unlink(f->tmp_path);
    } else {
        char dir[4096];
        stw_dirname(f->path, dir, sizeof dir);
        st = kiln_fsync_path(dir);
    }
    kiln_free(f->path);
    kiln_free(f->tmp_path);
    return st;
}

kiln_status kiln_write_file_durable(const char *path, const void *data, size_t len) {
    if (!path || (!data && len)) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_write_file_durable: NULL argument");
    stw_file f;
    KILN_TRY(stw_open(&f, path));
    return stw_close(&f, kiln_write_all(f.fd, data, len, path));
}

kiln_status kiln_remove_tree(const char *path) {
    struct stat sb;
    if (lstat(path, &sb) != 0) {
        if (errno == ENOENT) return KILN_OK;
        return kiln_error(KILN_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
    }
    if (!S_ISDIR(sb.st_mode)) {
        if (unlink(path) != 0) return kiln_error(KILN_ERR_IO, "%s: cannot remove: %s", path, strerror(errno));
        return KILN_OK;
    }
    DIR *d = opendir(path);
    if (!d) return kiln_error(KILN_ERR_IO, "%s: cannot open folder: %s", path, strerror(errno));
    kiln_status st = KILN_OK;
    struct dirent *e;
    while (st == KILN_OK && (e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        size_t n = strlen(path) + strlen(e->d_name) + 2;
        char *child = kiln_malloc(n);
        if (!child) {
            st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory", path);
            break;
        }
        snprintf(child, n, "%s/%s", path, e->d_name);
        st = kiln_remove_tree(child);
        kiln_free(child);
    }
    closedir(d);
    if (st == KILN_OK && rmdir(path) != 0)
        st = kiln_error(KILN_ERR_IO, "%s: cannot remove folder: %s", path, strerror(errno));
    return st;
}

/* ---- safetensors ----------------------------------------------------------------------- */

static const char *stw_dtype_name(kiln_dtype t) {
    switch (t) {
    case KILN_DTYPE_F32: return "F32";
    case KILN_DTYPE_F16: return "F16";
    case KILN_DTYPE_BF16: return "BF16";
    case KILN_DTYPE_I32: return "I32";
    case KILN_DTYPE_I64: return "I64";
    default: return NULL;
    }
}

static size_t stw_dtype_size(kiln_dtype t) {
    return t == KILN_DTYPE_I64 ? 8 : (t == KILN_DTYPE_F32 || t == KILN_DTYPE_I32) ? 4 : 2;
}

typedef struct stw_entry {
    const kiln_st_write_tensor *t;
    int index;     /* in the caller's array */
    size_t nbytes;
    uint64_t begin;
} stw_entry;

static int stw_entry_cmp(const void *pa, const void *pb) {
    const stw_entry *a = pa, *b = pb;
    size_t sa = stw_dtype_size(a->t->dtype), sb = stw_dtype_size(b->t->dtype);
    if (sa != sb) return sa > sb ? -1 : 1;
    return strcmp(a->t->name, b->t->name);
}

/* Validate the tensors and compute sizes; entries sorted into file order. */
static kiln_status stw_plan(const char *path, const kiln_st_write_tensor *tensors, int n,
                            kiln_st_fill_fn fill, stw_entry *e, size_t *max_fill) {
    *max_fill = 0;
    for (int i = 0; i < n; i++) {
        const kiln_st_write_tensor *t = &tensors[i];
        if (!t->name || !t->name[0] || !strcmp(t->name, "__metadata__"))
            return kiln_error(KILN_ERR_INVALID_ARG, "%s: tensor %d: missing or reserved name", path, i);
        if (!stw_dtype_name(t->dtype))
            return kiln_error(KILN_ERR_INVALID_ARG, "%s: tensor '%s': dtype %s cannot be written to "
                              "safetensors", path, t->name, kiln_dtype_name(t->dtype));
        if (t->n_dims < 0 || t->n_dims > KILN_MAX_DIMS)
            return kiln_error(KILN_ERR_INVALID_ARG, "%s: tensor '%s': %d dimensions", path, t->name,
                              t->n_dims);
        size_t bytes = stw_dtype_size(t->dtype);
        for (int d = 0; d < t->n_dims; d++) {
            if (t->shape[d] < 0 || kiln_mul_overflow(bytes, (size_t)t->shape[d], &bytes))
                return kiln_error(KILN_ERR_INVALID_ARG, "%s: tensor '%s': bad shape[%d] = %lld", path,
                                  t->name, d, (long long)t->shape[d]);
        }
        if (!t->data && !fill)
            return kiln_error(KILN_ERR_INVALID_ARG, "%s: tensor '%s': no data and no fill callback",
                              path, t->name);
        if (!t->data && bytes > *max_fill) *max_fill = bytes;
        e[i].t = t;
        e[i].index = i;
        e[i].nbytes = bytes;
    }
    qsort(e, (size_t)n, sizeof *e, stw_entry_cmp);
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        if (i > 0 && !strcmp(e[i - 1].t->name, e[i].t->name))
            return kiln_error(KILN_ERR_INVALID_ARG, "%s: tensor name '%s' appears twice", path, e[i].t->name);
        e[i].begin = off;
        if (kiln_add_overflow_u64(off, e[i].nbytes, &off) || (double)off >= STW_MAX_EXACT)
            return kiln_error(KILN_ERR_INVALID_ARG, "%s: data section too large", path);
    }
    return KILN_OK;
}

/* The header JSON, unpadded, as a malloc'd string (cJSON's allocator). */
static kiln_status stw_header(const char *path, const stw_entry *e, int n, const char *const *metadata,
                              char **out) {
    cJSON *root = cJSON_CreateObject();
    int ok = root != NULL;
    if (ok && metadata) {
        cJSON *md = cJSON_AddObjectToObject(root, "__metadata__");
        ok = md != NULL;
        for (int i = 0; ok && metadata[i]; i += 2) {
            if (!metadata[i + 1]) {
                cJSON_Delete(root);
                return kiln_error(KILN_ERR_INVALID_ARG, "%s: metadata key '%s' has no value", path,
                                  metadata[i]);
            }
            ok = cJSON_AddStringToObject(md, metadata[i], metadata[i + 1]) != NULL;
        }
    }
    for (int i = 0; ok && i < n; i++) {
        /* keys in the reference writer's order: dtype, shape, data_offsets */
        cJSON *t = cJSON_AddObjectToObject(root, e[i].t->name);
        ok = t && cJSON_AddStringToObject(t, "dtype", stw_dtype_name(e[i].t->dtype));
        cJSON *shape = ok ? cJSON_AddArrayToObject(t, "shape") : NULL;
        ok = shape != NULL;
        for (int d = 0; ok && d < e[i].t->n_dims; d++)
            ok = cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)e[i].t->shape[d]));
        cJSON *offs = ok ? cJSON_AddArrayToObject(t, "data_offsets") : NULL;
        ok = offs && cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)e[i].begin)) &&
             cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)(e[i].begin + e[i].nbytes)));
    }
    char *s = ok ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    if (!s) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory (header)", path);
    *out = s;
    return KILN_OK;
}

static kiln_status stw_write_body(stw_file *f, const stw_entry *e, int n, const char *const *metadata,
                                  kiln_st_fill_fn fill, void *user, size_t max_fill) {
    char *json = NULL;
    KILN_TRY(stw_header(f->path, e, n, metadata, &json));
    size_t jlen = strlen(json), padded = (jlen + 7) & ~(size_t)7;
    uint8_t *hdr = kiln_malloc(8 + padded);
    if (!hdr) {
        free(json);
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory (header)", f->path);
    }
    kiln_put_le64(hdr, padded);
    memcpy(hdr + 8, json, jlen);
    memset(hdr + 8 + jlen, ' ', padded - jlen);
    free(json);
    kiln_status st = kiln_write_all(f->fd, hdr, 8 + padded, f->path);
    kiln_free(hdr);
    KILN_TRY(st);

    void *buf = NULL;
    if (max_fill > 0) KILN_TRY(kiln_alloc_or_fail(&buf, max_fill, "safetensors write buffer"));
    for (int i = 0; st == KILN_OK && i < n; i++) {
        const void *src = e[i].t->data;
        if (!src) {
            st = fill(user, e[i].index, buf, e[i].nbytes);
            if (st != KILN_OK) {
                kiln_error_prefix(st, "%s: tensor '%s'", f->path, e[i].t->name);
                break;
            }
            src = buf;
        }
        st = kiln_write_all(f->fd, src, e[i].nbytes, f->path);
    }
    kiln_free(buf);
    return st;
}

kiln_status kiln_safetensors_write(const char *path, const kiln_st_write_tensor *tensors, int n,
                                   const char *const *metadata, kiln_st_fill_fn fill, void *user) {
    if (!path || n < 0 || (n > 0 && !tensors))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_safetensors_write: NULL or negative argument");
    stw_entry *e = kiln_calloc(n > 0 ? (size_t)n : 1, sizeof *e);
    if (!e) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", path);
    size_t max_fill = 0;
    kiln_status st = stw_plan(path, tensors, n, fill, e, &max_fill);
    if (st == KILN_OK) {
        stw_file f;
        st = stw_open(&f, path);
        if (st == KILN_OK) st = stw_close(&f, stw_write_body(&f, e, n, metadata, fill, user, max_fill));
    }
    kiln_free(e);
    return st;
}
