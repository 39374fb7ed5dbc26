/*
 * checkpoint.c -- the KILNCKPT container: streaming writer with the atomic save protocol,
 * and a reader that validates every field and checksum (layout in docs/TRAINING_FORMATS.md).
 *
 * File layout (all integers little-endian; kiln builds only on little-endian hosts):
 *   [0, 128)              header
 *   [128, table_offset)   section data, each section at a multiple of 64, zero padding
 *   [table_offset, end)   n_sections table entries of 256 bytes
 * The table goes last so sections stream straight to disk while their SHA-256 is computed;
 * the header is written last of all, at offset 0.
 */
#include "checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kiln checkpoints are little-endian; this host is not"
#endif

enum {
    HDR_SIZE = 128,
    HDR_HASHED = 96,   /* header_sha256 covers bytes [0, 96) */
    ENTRY_SIZE = 256,
    NAME_FIELD = 128,
};

static int all_zero(const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

/* A section name: 1..KILN_CKPT_NAME_MAX bytes of [A-Za-z0-9_.:/-]. Returns 0 or explains. */
static const char *name_problem(const char *name, size_t len) {
    if (len == 0) return "empty name";
    if (len > KILN_CKPT_NAME_MAX) return "name longer than 127 bytes";
    for (size_t i = 0; i < len; i++) {
        char ch = name[i];
        int ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
                 ch == '_' || ch == '.' || ch == ':' || ch == '/' || ch == '-';
        if (!ok) return "name has a byte outside [A-Za-z0-9_.:/-]";
    }
    return NULL;
}

/* ---- fault injection and syscalls --------------------------------------------------------- */

static kiln_ckpt_fault_fn g_fault_fn;
static void *g_fault_user;

void kiln_ckpt_set_fault_hook(kiln_ckpt_fault_fn fn, void *user) {
    g_fault_fn = fn;
    g_fault_user = user;
}

/* 0, or the errno the hook injects for this operation. */
static int fault(kiln_ckpt_io_op op, const char *path) {
    return g_fault_fn ? g_fault_fn(op, path, g_fault_user) : 0;
}

static char *path_join(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    char *p = kiln_malloc(la + lb + 2);
    if (!p) return NULL;
    memcpy(p, a, la);
    p[la] = '/';
    memcpy(p + la + 1, b, lb + 1);
    return p;
}

static char *path_printf(const char *fmt, const char *dir, uint64_t step, long pid) {
    char buf[64];
    if (pid >= 0) snprintf(buf, sizeof buf, fmt, (unsigned long long)step, pid);
    else snprintf(buf, sizeof buf, fmt, (unsigned long long)step);
    return path_join(dir, buf);
}

static kiln_status fsync_path(const char *path, int is_dir) {
    int e = fault(KILN_CKPT_IO_FSYNC, path);
    if (e) return kiln_error(KILN_ERR_IO, "%s: fsync failed: %s", path, strerror(e));
    int fd = open(path, (is_dir ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
    if (fd < 0) return kiln_error(KILN_ERR_IO, "%s: cannot open to fsync: %s", path, strerror(errno));
    int r = fsync(fd);
    e = errno;
    close(fd);
    if (r != 0) return kiln_error(KILN_ERR_IO, "%s: fsync failed: %s", path, strerror(e));
    return KILN_OK;
}

static kiln_status do_rename(const char *from, const char *to) {
    int e = fault(KILN_CKPT_IO_RENAME, to);
    if (!e && rename(from, to) != 0) e = errno;
    if (e) return kiln_error(KILN_ERR_IO, "%s: cannot rename to %s: %s", from, to, strerror(e));
    return KILN_OK;
}

/* Write all of data at the current position of fd (path for messages). */
static kiln_status write_all(int fd, const char *path, uint64_t at, const void *data, size_t n) {
    int e = fault(KILN_CKPT_IO_WRITE, path);
    if (e)
        return kiln_error(KILN_ERR_IO, "%s: write of %zu bytes at offset %llu failed: %s", path, n,
                          (unsigned long long)at, strerror(e));
    const uint8_t *p = data;
    size_t done = 0;
    while (done < n) {
        size_t chunk = n - done < ((size_t)1 << 30) ? n - done : ((size_t)1 << 30);
        ssize_t r = write(fd, p + done, chunk);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            e = r < 0 ? errno : EIO;
            return kiln_error(KILN_ERR_IO, "%s: write of %zu bytes at offset %llu failed: %s", path,
                              n - done, (unsigned long long)(at + done), strerror(e));
        }
        done += (size_t)r;
    }
    return KILN_OK;
}

/* Remove a directory holding only plain files (what kiln puts in a checkpoint directory).
 * Best effort; returns 0 on success. */
static int remove_flat_dir(const char *path) {
    DIR *d = opendir(path);
    if (!d) return errno == ENOENT ? 0 : -1;
    struct dirent *de;
    int rc = 0;
    while ((de = readdir(d)) != NULL) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        char *p = path_join(path, de->d_name);
        if (!p || unlink(p) != 0) rc = -1;
        kiln_free(p);
    }
    closedir(d);
    if (rmdir(path) != 0) rc = -1;
    return rc;
}

/* ---- names in a checkpoint directory ------------------------------------------------------ */

/* Parse a decimal u64 with no sign, no leading zeros (except "0"), exactly n bytes. */
static int parse_u64(const char *s, size_t n, uint64_t *out) {
    if (n == 0 || n > 20 || (n > 1 && s[0] == '0')) return 0;
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return 0;
        if (kiln_mul_overflow_u64(v, 10, &v) || kiln_add_overflow_u64(v, (uint64_t)(s[i] - '0'), &v))
            return 0;
    }
    *out = v;
    return 1;
}

/* "step-<k>" -> 1 and *step; "step-<k>.tmp-<pid>" -> 2 and *step, *pid; else 0. */
static int classify_name(const char *name, uint64_t *step, uint64_t *pid) {
    if (strncmp(name, "step-", 5) != 0) return 0;
    const char *s = name + 5;
    const char *dot = strstr(s, ".tmp-");
    if (!dot) return parse_u64(s, strlen(s), step) ? 1 : 0;
    if (!parse_u64(s, (size_t)(dot - s), step)) return 0;
    return parse_u64(dot + 5, strlen(dot + 5), pid) ? 2 : 0;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Steps of every "step-<k>" directory in dir (complete or not), ascending. */
static kiln_status list_step_dirs(const char *dir, uint64_t **steps, size_t *n) {
    *steps = NULL;
    *n = 0;
    DIR *d = opendir(dir);
    if (!d) return kiln_error(KILN_ERR_IO, "%s: cannot open checkpoint directory: %s", dir, strerror(errno));
    size_t cap = 0, cnt = 0;
    uint64_t *v = NULL;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        uint64_t step, pid;
        if (classify_name(de->d_name, &step, &pid) != 1) continue;
        if (cnt == cap) {
            size_t ncap = cap ? 2 * cap : 16;
            uint64_t *nv = kiln_realloc(v, ncap * sizeof *v);
            if (!nv) {
                kiln_free(v);
                closedir(d);
                return kiln_error(KILN_ERR_NOMEM, "%s: out of memory listing checkpoints", dir);
            }
            v = nv;
            cap = ncap;
        }
        v[cnt++] = step;
    }
    closedir(d);
    if (cnt) qsort(v, cnt, sizeof *v, cmp_u64);
    *steps = v;
    *n = cnt;
    return KILN_OK;
}

static int step_dir_has_marker(const char *dir, uint64_t step) {
    char buf[64];
    snprintf(buf, sizeof buf, "step-%llu/" KILN_CKPT_MARKER, (unsigned long long)step);
    char *p = path_join(dir, buf);
    int r = p && kiln_path_is_file(p);
    kiln_free(p);
    return r;
}

kiln_status kiln_ckpt_list(const char *dir, uint64_t **steps, size_t *n) {
    if (!dir || !steps || !n) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_ckpt_list: NULL argument");
    KILN_TRY(list_step_dirs(dir, steps, n));
    size_t k = 0;
    for (size_t i = 0; i < *n; i++)
        if (step_dir_has_marker(dir, (*steps)[i])) (*steps)[k++] = (*steps)[i];
    *n = k;
    if (!k) {
        kiln_free(*steps);
        *steps = NULL;
    }
    return KILN_OK;
}

/* ---- writer ------------------------------------------------------------------------------------ */

typedef struct entry {
    char name[NAME_FIELD];
    uint32_t type, dtype, n_dims;
    int64_t shape[KILN_CKPT_MAX_DIMS];
    uint64_t offset, size;
    uint8_t sha[32];
} entry;

struct kiln_ckpt_writer {
    char *dir, *tmp_dir, *final_dir, *file_path;
    int fd;
    uint64_t step, pos; /* pos: bytes written to the file so far */
    kiln_ckpt_save_params params;
    entry *entries;
    size_t n_entries, cap_entries;
    int in_section;
    uint64_t expect_size; /* tensor / u64 sections: the size the data must reach; else ~0 */
    kiln_sha256_ctx *sha;
    int failed; /* an I/O error happened; the tmp directory is already removed */
    int shard;  /* a shard of a set (kiln_ckpt_begin_shard): finished, not committed */
};

kiln_ckpt_save_params kiln_ckpt_default_save_params(void) {
    kiln_ckpt_save_params p = {0};
    return p;
}

static void writer_free(kiln_ckpt_writer *w) {
    if (!w) return;
    if (w->fd >= 0) close(w->fd);
    kiln_sha256_free(w->sha);
    kiln_free(w->dir);
    kiln_free(w->tmp_dir);
    kiln_free(w->final_dir);
    kiln_free(w->file_path);
    kiln_free(w->entries);
    kiln_free(w);
}

/* After an I/O error: close, remove the tmp directory, refuse further calls. Returns st. */
static kiln_status writer_fail(kiln_ckpt_writer *w, kiln_status st) {
    if (w->fd >= 0) close(w->fd);
    w->fd = -1;
    if (w->shard) /* the set's directory holds the other ranks' shards: only this one goes */
        unlink(w->file_path);
    else
        remove_flat_dir(w->tmp_dir);
    w->failed = 1;
    return st;
}

static kiln_status writer_check(kiln_ckpt_writer *w, const char *fn) {
    if (!w) return kiln_error(KILN_ERR_INVALID_ARG, "%s: NULL writer", fn);
    if (w->failed)
        return kiln_error(KILN_ERR_STATE, "%s: checkpoint step %llu in %s: an earlier write failed",
                          fn, (unsigned long long)w->step, w->dir);
    return KILN_OK;
}

static kiln_status writer_write(kiln_ckpt_writer *w, const void *data, size_t n) {
    if (!n) return KILN_OK;
    kiln_status st = write_all(w->fd, w->file_path, w->pos, data, n);
    if (st != KILN_OK) return writer_fail(w, st);
    w->pos += n;
    return KILN_OK;
}

static kiln_status writer_pad(kiln_ckpt_writer *w) {
    static const uint8_t zeros[KILN_CKPT_ALIGN];
    size_t pad = (size_t)((KILN_CKPT_ALIGN - w->pos % KILN_CKPT_ALIGN) % KILN_CKPT_ALIGN);
    return writer_write(w, zeros, pad);
}

/* Create w's file (it must not exist) and write the header's placeholder: *out = w, or w
 * consumed and the error (a single file's tmp directory removed, as writer_fail does). */
static kiln_status open_file(kiln_ckpt_writer *w, kiln_ckpt_writer **out) {
    w->fd = open(w->file_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (w->fd < 0) {
        kiln_status st = kiln_error(KILN_ERR_IO, "%s: cannot create: %s", w->file_path, strerror(errno));
        if (!w->shard) writer_fail(w, st); /* a shard's file that exists is not this writer's */
        writer_free(w);
        return st;
    }
    static const uint8_t zeros[HDR_SIZE];
    kiln_status st = writer_write(w, zeros, sizeof zeros); /* header placeholder */
    if (st != KILN_OK) {
        writer_free(w);
        return st;
    }
    *out = w;
    return KILN_OK;
}

kiln_status kiln_ckpt_begin(const char *dir, uint64_t step, const kiln_ckpt_save_params *params,
                            kiln_ckpt_writer **out) {
    if (!dir || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_ckpt_begin: NULL argument");
    *out = NULL;
    if (params && params->keep_last < 0)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_ckpt_begin: keep_last %d < 0", params->keep_last);
    if (step > KILN_CKPT_MAX_STEP)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_ckpt_begin: step %llu is past the largest step %lld",
                          (unsigned long long)step, (long long)KILN_CKPT_MAX_STEP);
    int e = fault(KILN_CKPT_IO_MKDIR, dir);
    if (!e && mkdir(dir, 0755) != 0 && errno != EEXIST) e = errno;
    if (e) return kiln_error(KILN_ERR_IO, "%s: cannot create checkpoint directory: %s", dir, strerror(e));
    if (!kiln_path_is_dir(dir)) return kiln_error(KILN_ERR_IO, "%s: not a directory", dir);

    kiln_ckpt_writer *w = kiln_calloc(1, sizeof *w);
    if (!w) return kiln_error(KILN_ERR_NOMEM, "kiln_ckpt_begin: out of memory");
    w->fd = -1;
    w->step = step;
    w->params = params ? *params : kiln_ckpt_default_save_params();
    w->dir = kiln_strdup(dir);
    w->final_dir = path_printf("step-%llu", dir, step, -1);
    w->tmp_dir = path_printf("step-%llu.tmp-%ld", dir, step, (long)getpid());
    w->file_path = w->tmp_dir ? path_join(w->tmp_dir, KILN_CKPT_FILE) : NULL;
    if (!w->dir || !w->final_dir || !w->tmp_dir || !w->file_path) {
        writer_free(w);
        return kiln_error(KILN_ERR_NOMEM, "kiln_ckpt_begin: out of memory");
    }
    if (step_dir_has_marker(dir, step)) {
        writer_free(w);
        return kiln_error(KILN_ERR_STATE,
                          "%s/step-%llu: a complete checkpoint of this step already exists; remove "
                          "it or save into another directory",
                          dir, (unsigned long long)step);
    }
    /* an unmarked step-<k> (crash between rename and marker) or our own stale tmp dir */
    if (kiln_path_is_dir(w->final_dir) && remove_flat_dir(w->final_dir) != 0) {
        kiln_status st = kiln_error(KILN_ERR_IO, "%s: cannot remove incomplete checkpoint: %s",
                                    w->final_dir, strerror(errno));
        writer_free(w);
        return st;
    }
    remove_flat_dir(w->tmp_dir);
    e = fault(KILN_CKPT_IO_MKDIR, w->tmp_dir);
    if (!e && mkdir(w->tmp_dir, 0755) != 0) e = errno;
    if (e) {
        kiln_status st = kiln_error(KILN_ERR_IO, "%s: cannot create: %s", w->tmp_dir, strerror(e));
        writer_free(w);
        return st;
    }
    return open_file(w, out);
}

static kiln_status section_begin(kiln_ckpt_writer *w, const char *name, kiln_ckpt_type type,
                                 kiln_dtype dtype, int n_dims, const int64_t *shape) {
    KILN_TRY(writer_check(w, "kiln_ckpt_section_begin"));
    if (w->in_section)
        return kiln_error(KILN_ERR_STATE, "checkpoint: section '%s' begun while '%s' is open",
                          name ? name : "(null)", w->entries[w->n_entries - 1].name);
    if (!name) return kiln_error(KILN_ERR_INVALID_ARG, "checkpoint: NULL section name");
    const char *why = name_problem(name, strlen(name));
    if (why) return kiln_error(KILN_ERR_INVALID_ARG, "checkpoint: section name '%.200s': %s", name, why);
    if (type < KILN_CKPT_RAW || type > KILN_CKPT_TENSOR)
        return kiln_error(KILN_ERR_INVALID_ARG, "checkpoint: section '%s': unknown type %d", name, (int)type);
    for (size_t i = 0; i < w->n_entries; i++)
        if (!strcmp(w->entries[i].name, name))
            return kiln_error(KILN_ERR_INVALID_ARG, "checkpoint: duplicate section name '%s'", name);
    if (w->n_entries == w->cap_entries) {
        size_t ncap = w->cap_entries ? 2 * w->cap_entries : 32;
        entry *ne = kiln_realloc(w->entries, ncap * sizeof *ne);
        if (!ne) return kiln_error(KILN_ERR_NOMEM, "checkpoint: out of memory for section table");
        w->entries = ne;
        w->cap_entries = ncap;
    }
    KILN_TRY(writer_pad(w));
    KILN_TRY(kiln_sha256_init(&w->sha));
    entry *en = &w->entries[w->n_entries++];
    memset(en, 0, sizeof *en);
    strcpy(en->name, name);
    en->type = (uint32_t)type;
    en->offset = w->pos;
    w->expect_size = UINT64_MAX;
    if (type == KILN_CKPT_U64) w->expect_size = 8;
    if (type == KILN_CKPT_TENSOR) {
        en->dtype = (uint32_t)dtype;
        en->n_dims = (uint32_t)n_dims;
        uint64_t nel = 1;
        for (int i = 0; i < KILN_CKPT_MAX_DIMS; i++) {
            en->shape[i] = i < n_dims ? shape[i] : 1;
            if (kiln_mul_overflow_u64(nel, (uint64_t)en->shape[i], &nel)) nel = UINT64_MAX;
        }
        if (!kiln_dtype_nbytes(dtype, nel, &w->expect_size)) {
            w->n_entries--;
            kiln_sha256_free(w->sha);
            w->sha = NULL;
            return kiln_error(KILN_ERR_INVALID_ARG,
                              "checkpoint: tensor '%s': %llu elements of %s is not a valid size",
                              name, (unsigned long long)nel, kiln_dtype_name(dtype));
        }
    }
    w->in_section = 1;
    return KILN_OK;
}

kiln_status kiln_ckpt_section_begin(kiln_ckpt_writer *w, const char *name, kiln_ckpt_type type) {
    if (type == KILN_CKPT_TENSOR)
        return kiln_error(KILN_ERR_INVALID_ARG, "checkpoint: section '%s': use kiln_ckpt_add_tensor",
                          name ? name : "(null)");
    return section_begin(w, name, type, KILN_DTYPE_F32, 0, NULL);
}

kiln_status kiln_ckpt_section_write(kiln_ckpt_writer *w, const void *data, size_t size) {
    KILN_TRY(writer_check(w, "kiln_ckpt_section_write"));
    if (!w->in_section) return kiln_error(KILN_ERR_STATE, "checkpoint: section_write with no open section");
    if (size && !data) return kiln_error(KILN_ERR_INVALID_ARG, "checkpoint: NULL data");
    entry *en = &w->entries[w->n_entries - 1];
    uint64_t total;
    if (kiln_add_overflow_u64(en->size, size, &total) ||
        (w->expect_size != UINT64_MAX && total > w->expect_size))
        return kiln_error(KILN_ERR_INVALID_ARG, "checkpoint: section '%s': more data than its %llu bytes",
                          en->name, (unsigned long long)w->expect_size);
    KILN_TRY(kiln_sha256_update(w->sha, data, size));
    KILN_TRY(writer_write(w, data, size));
    en->size = total;
    return KILN_OK;
}

kiln_status kiln_ckpt_section_end(kiln_ckpt_writer *w) {
    KILN_TRY(writer_check(w, "kiln_ckpt_section_end"));
    if (!w->in_section) return kiln_error(KILN_ERR_STATE, "checkpoint: section_end with no open section");
    entry *en = &w->entries[w->n_entries - 1];
    if (w->expect_size != UINT64_MAX && en->size != w->expect_size)
        return kiln_error(KILN_ERR_INVALID_ARG, "checkpoint: section '%s': %llu bytes written, %llu expected",
                          en->name, (unsigned long long)en->size, (unsigned long long)w->expect_size);
    kiln_sha256_ctx *c = w->sha;
    w->sha = NULL;
    w->in_section = 0;
    return kiln_sha256_final(c, en->sha);
}

kiln_status kiln_ckpt_add_section(kiln_ckpt_writer *w, const char *name, kiln_ckpt_type type,
                                  const void *data, size_t size) {
    KILN_TRY(kiln_ckpt_section_begin(w, name, type));
    KILN_TRY(kiln_ckpt_section_write(w, data, size));
    return kiln_ckpt_section_end(w);
}

kiln_status kiln_ckpt_add_u64(kiln_ckpt_writer *w, const char *name, uint64_t value) {
    uint8_t b[8];
    kiln_put_le64(b, value);
    return kiln_ckpt_add_section(w, name, KILN_CKPT_U64, b, 8);
}

kiln_status kiln_ckpt_add_json(kiln_ckpt_writer *w, const char *name, const char *json) {
    if (!json) return kiln_error(KILN_ERR_INVALID_ARG, "checkpoint: section '%s': NULL JSON", name ? name : "");
    return kiln_ckpt_add_section(w, name, KILN_CKPT_JSON, json, strlen(json));
}

kiln_status kiln_ckpt_add_tensor(kiln_ckpt_writer *w, const char *name, kiln_dtype dtype,
                                 int n_dims, const int64_t *shape, const void *data) {
    if (!name) return kiln_error(KILN_ERR_INVALID_ARG, "checkpoint: NULL tensor name");
    if ((int)dtype < 0 || dtype >= KILN_DTYPE_COUNT)
        return kiln_error(KILN_ERR_INVALID_ARG, "checkpoint: tensor '%s': bad dtype %d", name, (int)dtype);
    if (n_dims < 1 || n_dims > KILN_CKPT_MAX_DIMS || !shape)
        return kiln_error(KILN_ERR_INVALID_ARG, "checkpoint: tensor '%s': n_dims %d not in 1..4", name, n_dims);
    for (int i = 0; i < n_dims; i++)
        if (shape[i] < 0)
            return kiln_error(KILN_ERR_INVALID_ARG, "checkpoint: tensor '%s': negative dim %d", name, i);
    KILN_TRY(section_begin(w, name, KILN_CKPT_TENSOR, dtype, n_dims, shape));
    KILN_TRY(kiln_ckpt_section_write(w, data, (size_t)w->expect_size));
    return kiln_ckpt_section_end(w);
}

void kiln_ckpt_abort(kiln_ckpt_writer *w) {
    if (!w) return;
    if (!w->failed) writer_fail(w, KILN_OK);
    writer_free(w);
}

static void encode_entry(const entry *en, uint8_t *b) {
    memset(b, 0, ENTRY_SIZE);
    memcpy(b, en->name, strlen(en->name));
    kiln_put_le32(b + 128, en->type);
    kiln_put_le32(b + 132, en->dtype);
    kiln_put_le32(b + 136, en->n_dims);
    for (int i = 0; i < KILN_CKPT_MAX_DIMS; i++) kiln_put_le64(b + 144 + 8 * i, (uint64_t)en->shape[i]);
    kiln_put_le64(b + 176, en->offset);
    kiln_put_le64(b + 184, en->size);
    memcpy(b + 192, en->sha, 32);
}

/* Append a line to a kiln_malloc'd warning text. */
static void warn_add(char **warning, const char *fmt, const char *path, int e) {
    if (!warning) return;
    char line[1024];
    snprintf(line, sizeof line, fmt, path, strerror(e));
    size_t old = *warning ? strlen(*warning) : 0, add = strlen(line);
    char *n = kiln_realloc(*warning, old + add + 2);
    if (!n) return;
    memcpy(n + old, line, add);
    n[old + add] = '\n';
    n[old + add + 1] = 0;
    *warning = n;
}

/* Remove a complete checkpoint: marker first (then it is merely incomplete), then the rest. */
static int remove_checkpoint(const char *step_dir) {
    char *m = path_join(step_dir, KILN_CKPT_MARKER);
    if (!m) return -1;
    int r = unlink(m);
    kiln_free(m);
    if (r != 0 && errno != ENOENT) return -1;
    return remove_flat_dir(step_dir);
}

/* Protocol step 4. Failures become warnings. */
static void housekeeping(kiln_ckpt_writer *w, char **warning) {
    DIR *d = opendir(w->dir);
    if (!d) {
        warn_add(warning, "%s: cannot list for cleanup: %s", w->dir, errno);
        return;
    }
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        uint64_t step, pid = 0;
        int kind = classify_name(de->d_name, &step, &pid);
        int stale = 0;
        if (kind == 2) {
            /* a tmp dir of ours is stale now; another pid's only once that process is gone */
            stale = pid == (uint64_t)getpid() ||
                    (pid <= (uint64_t)INT32_MAX && kill((pid_t)pid, 0) != 0 && errno == ESRCH);
        } else if (kind == 1 && step < w->step && !step_dir_has_marker(w->dir, step)) {
            stale = 1;
        }
        if (!stale) continue;
        char *p = path_join(w->dir, de->d_name);
        if (p && remove_flat_dir(p) != 0) warn_add(warning, "%s: cannot remove stale directory: %s", p, errno);
        kiln_free(p);
    }
    closedir(d);
    if (w->params.keep_last <= 0) return;
    uint64_t *steps = NULL;
    size_t n = 0;
    if (kiln_ckpt_list(w->dir, &steps, &n) != KILN_OK) {
        warn_add(warning, "%s: cannot list for retention: %s", w->dir, EIO);
        return;
    }
    size_t keep = (size_t)w->params.keep_last;
    for (size_t i = 0; i + keep < n; i++) {
        if (steps[i] == w->step) continue;
        char *p = path_printf("step-%llu", w->dir, steps[i], -1);
        if (p && remove_checkpoint(p) != 0) warn_add(warning, "%s: cannot remove old checkpoint: %s", p, errno);
        kiln_free(p);
    }
    kiln_free(steps);
    fsync_path(w->dir, 1); /* best effort: removals need not be durable for correctness */
}

/* Protocol step 1: pad, the section table, the header (hdr_sha: its SHA-256), fsync and close
 * the file, fsync the tmp directory. On failure the tmp directory is removed. */
static kiln_status finish_file(kiln_ckpt_writer *w, uint8_t hdr_sha[32]) {
    uint8_t hdr[HDR_SIZE] = {0};
    uint8_t *table = NULL;
    kiln_status st;
    if ((st = writer_pad(w)) != KILN_OK) goto fail;
    uint64_t table_offset = w->pos;
    size_t table_bytes = w->n_entries * (size_t)ENTRY_SIZE;
    table = kiln_malloc(table_bytes ? table_bytes : 1);
    if (!table) {
        st = kiln_error(KILN_ERR_NOMEM, "checkpoint: out of memory for the section table");
        goto fail;
    }
    for (size_t i = 0; i < w->n_entries; i++) encode_entry(&w->entries[i], table + i * ENTRY_SIZE);
    if ((st = writer_write(w, table, table_bytes)) != KILN_OK) goto fail;

    memcpy(hdr, KILN_CKPT_MAGIC, 8);
    kiln_put_le32(hdr + 8, KILN_CKPT_VERSION);
    kiln_put_le32(hdr + 12, HDR_SIZE);
    kiln_put_le64(hdr + 16, w->step);
    kiln_put_le32(hdr + 24, (uint32_t)w->n_entries);
    kiln_put_le32(hdr + 28, ENTRY_SIZE);
    kiln_put_le64(hdr + 32, table_offset);
    kiln_put_le64(hdr + 40, w->pos);
    if ((st = kiln_sha256(table, table_bytes, hdr + 48)) != KILN_OK) goto fail;
    if ((st = kiln_sha256(hdr, HDR_HASHED, hdr + 96)) != KILN_OK) goto fail;
    if (lseek(w->fd, 0, SEEK_SET) != 0) {
        st = kiln_error(KILN_ERR_IO, "%s: seek failed: %s", w->file_path, strerror(errno));
        goto fail;
    }
    if ((st = write_all(w->fd, w->file_path, 0, hdr, HDR_SIZE)) != KILN_OK) goto fail;
    int e = fault(KILN_CKPT_IO_FSYNC, w->file_path);
    if (!e && fsync(w->fd) != 0) e = errno;
    if (e) {
        st = kiln_error(KILN_ERR_IO, "%s: fsync failed: %s", w->file_path, strerror(e));
        goto fail;
    }
    int cr = close(w->fd);
    w->fd = -1;
    if (cr != 0) {
        st = kiln_error(KILN_ERR_IO, "%s: close failed: %s", w->file_path, strerror(errno));
        goto fail;
    }
    if ((st = fsync_path(w->tmp_dir, 1)) != KILN_OK) goto fail;
    memcpy(hdr_sha, hdr + 96, 32);
    kiln_free(table);
    return KILN_OK;
fail:
    kiln_free(table);
    return writer_fail(w, st);
}

/* Protocol steps 2-4 for w's tmp directory (its files durable already), the marker saying
 * `text`. On failure nothing new is complete and the directory is removed. */
static kiln_status publish(kiln_ckpt_writer *w, const char *text, char **warning) {
    char *marker = NULL, *marker_tmp = NULL;
    int marker_fd = -1;
    kiln_status st;
    /* 2. publish the directory */
    if ((st = do_rename(w->tmp_dir, w->final_dir)) != KILN_OK) {
        writer_fail(w, st);
        goto out;
    }
    if ((st = fsync_path(w->dir, 1)) != KILN_OK) goto fail_published;

    /* 3. the marker, itself written atomically */
    marker = path_join(w->final_dir, KILN_CKPT_MARKER);
    marker_tmp = path_join(w->final_dir, KILN_CKPT_MARKER ".tmp");
    if (!marker || !marker_tmp) {
        st = kiln_error(KILN_ERR_NOMEM, "checkpoint: out of memory");
        goto fail_published;
    }
    marker_fd = open(marker_tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (marker_fd < 0) {
        st = kiln_error(KILN_ERR_IO, "%s: cannot create: %s", marker_tmp, strerror(errno));
        goto fail_published;
    }
    if ((st = write_all(marker_fd, marker_tmp, 0, text, strlen(text))) != KILN_OK) goto fail_published;
    int e = fault(KILN_CKPT_IO_FSYNC, marker_tmp);
    if (!e && fsync(marker_fd) != 0) e = errno;
    if (e) {
        st = kiln_error(KILN_ERR_IO, "%s: fsync failed: %s", marker_tmp, strerror(e));
        goto fail_published;
    }
    close(marker_fd);
    marker_fd = -1;
    if ((st = do_rename(marker_tmp, marker)) != KILN_OK) goto fail_published;
    if ((st = fsync_path(w->final_dir, 1)) != KILN_OK) {
        /* the marker may or may not be durable: take it back so the result is definite */
        unlink(marker);
        goto fail_published;
    }
    housekeeping(w, warning);
    goto out;
fail_published:
    /* the unmarked step directory is incomplete: remove it (a later save would anyway) */
    if (marker_fd >= 0) close(marker_fd);
    remove_flat_dir(w->final_dir);
    fsync_path(w->dir, 1);
out:
    kiln_free(marker);
    kiln_free(marker_tmp);
    return st;
}

kiln_status kiln_ckpt_commit(kiln_ckpt_writer *w, char **warning) {
    if (warning) *warning = NULL;
    kiln_status st = writer_check(w, "kiln_ckpt_commit");
    if (st != KILN_OK) {
        writer_free(w);
        return st;
    }
    if (w->shard) {
        st = kiln_error(KILN_ERR_INVALID_ARG, "kiln_ckpt_commit: a shard's writer (kiln_ckpt_finish_shard, then "
                        "kiln_ckpt_set_commit on one rank)");
        kiln_ckpt_abort(w);
        return st;
    }
    if (w->in_section) {
        st = kiln_error(KILN_ERR_STATE, "checkpoint: commit while section '%s' is open",
                        w->entries[w->n_entries - 1].name);
        kiln_ckpt_abort(w);
        return st;
    }
    uint8_t sha[32];
    char hex[65], text[160];
    if ((st = finish_file(w, sha)) == KILN_OK) {
        kiln_sha256_hex(sha, hex);
        snprintf(text, sizeof text, "KILNCKPT-COMPLETE step %llu header-sha256 %s\n", (unsigned long long)w->step, hex);
        st = publish(w, text, warning);
    }
    if (st != KILN_OK) kiln_error_prefix(st, "checkpoint step %llu not saved", (unsigned long long)w->step);
    writer_free(w);
    return st;
}

/* ---- sets of shards --------------------------------------------------------------------------- */

/* A writer's paths for a set: <dir>/step-<step>.tmp-<tag>/ and, rank >= 0, the shard's file in it. */
static kiln_ckpt_writer *set_writer(const char *dir, uint64_t step, long tag, int rank, int n_ranks) {
    kiln_ckpt_writer *w = kiln_calloc(1, sizeof *w);
    if (!w) return NULL;
    w->fd = -1;
    w->step = step;
    w->dir = kiln_strdup(dir);
    w->final_dir = path_printf("step-%llu", dir, step, -1);
    w->tmp_dir = path_printf("step-%llu.tmp-%ld", dir, step, tag);
    char name[64];
    if (rank >= 0) snprintf(name, sizeof name, KILN_CKPT_SHARD_FMT, rank, n_ranks);
    w->file_path = w->tmp_dir && rank >= 0 ? path_join(w->tmp_dir, name) : NULL;
    if (!w->dir || !w->final_dir || !w->tmp_dir || (rank >= 0 && !w->file_path)) {
        writer_free(w);
        return NULL;
    }
    return w;
}

static int set_args_ok(const char *dir, uint64_t step, long tag, int n_ranks) {
    return dir && step <= KILN_CKPT_MAX_STEP && tag >= 0 && n_ranks >= 1 && n_ranks <= KILN_CKPT_MAX_SHARDS;
}

kiln_status kiln_ckpt_set_prepare(const char *dir, uint64_t step, long tag) {
    if (!set_args_ok(dir, step, tag, 1))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_ckpt_set_prepare: bad argument (dir %s, step %llu, tag %ld)",
                          dir ? dir : "NULL", (unsigned long long)step, tag);
    int e = fault(KILN_CKPT_IO_MKDIR, dir);
    if (!e && mkdir(dir, 0755) != 0 && errno != EEXIST) e = errno;
    if (e) return kiln_error(KILN_ERR_IO, "%s: cannot create checkpoint directory: %s", dir, strerror(e));
    if (!kiln_path_is_dir(dir)) return kiln_error(KILN_ERR_IO, "%s: not a directory", dir);
    if (step_dir_has_marker(dir, step))
        return kiln_error(KILN_ERR_STATE, "%s/step-%llu: a complete checkpoint of this step already exists; remove "
                          "it or save into another directory", dir, (unsigned long long)step);
    kiln_ckpt_writer *w = set_writer(dir, step, tag, -1, 1);
    if (!w) return kiln_error(KILN_ERR_NOMEM, "kiln_ckpt_set_prepare: out of memory");
    kiln_status st = KILN_OK;
    if (kiln_path_is_dir(w->final_dir) && remove_flat_dir(w->final_dir) != 0)
        st = kiln_error(KILN_ERR_IO, "%s: cannot remove incomplete checkpoint: %s", w->final_dir, strerror(errno));
    if (st == KILN_OK) {
        remove_flat_dir(w->tmp_dir);
        e = fault(KILN_CKPT_IO_MKDIR, w->tmp_dir);
        if (!e && mkdir(w->tmp_dir, 0755) != 0) e = errno;
        if (e) st = kiln_error(KILN_ERR_IO, "%s: cannot create: %s", w->tmp_dir, strerror(e));
    }
    writer_free(w);
    return st;
}

kiln_status kiln_ckpt_begin_shard(const char *dir, uint64_t step, long tag, int rank, int n_ranks,
                                  kiln_ckpt_writer **out) {
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_ckpt_begin_shard: out is NULL");
    *out = NULL;
    if (!set_args_ok(dir, step, tag, n_ranks) || rank < 0 || rank >= n_ranks)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_ckpt_begin_shard: bad argument (step %llu, tag %ld, rank %d "
                          "of %d)", (unsigned long long)step, tag, rank, n_ranks);
    kiln_ckpt_writer *w = set_writer(dir, step, tag, rank, n_ranks);
    if (!w) return kiln_error(KILN_ERR_NOMEM, "kiln_ckpt_begin_shard: out of memory");
    w->shard = 1;
    if (!kiln_path_is_dir(w->tmp_dir)) {
        kiln_status st = kiln_error(KILN_ERR_STATE, "%s: no such directory (kiln_ckpt_set_prepare makes it)", w->tmp_dir);
        writer_free(w);
        return st;
    }
    return open_file(w, out);
}

kiln_status kiln_ckpt_finish_shard(kiln_ckpt_writer *w, uint8_t header_sha[32]) {
    kiln_status st = writer_check(w, "kiln_ckpt_finish_shard");
    if (st == KILN_OK && !w->shard) st = kiln_error(KILN_ERR_INVALID_ARG, "kiln_ckpt_finish_shard: not a shard's writer");
    if (st == KILN_OK && w->in_section)
        st = kiln_error(KILN_ERR_STATE, "checkpoint: finish while section '%s' is open", w->entries[w->n_entries - 1].name);
    if (st == KILN_OK) st = finish_file(w, header_sha);
    if (st != KILN_OK) kiln_error_prefix(st, "checkpoint shard %s not saved", w ? w->file_path : "");
    writer_free(w);
    return st;
}

kiln_status kiln_ckpt_set_commit(const char *dir, uint64_t step, long tag, int n_ranks, const uint8_t *header_shas,
                                 int keep_last, char **warning) {
    if (warning) *warning = NULL;
    if (!set_args_ok(dir, step, tag, n_ranks) || !header_shas || keep_last < 0)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_ckpt_set_commit: bad argument");
    kiln_ckpt_writer *w = set_writer(dir, step, tag, -1, n_ranks);
    size_t cap = 96 + (size_t)n_ranks * 128;
    char *text = kiln_malloc(cap);
    kiln_status st = w && text ? KILN_OK : kiln_error(KILN_ERR_NOMEM, "kiln_ckpt_set_commit: out of memory");
    if (st == KILN_OK) {
        w->params.keep_last = keep_last;
        size_t n = (size_t)snprintf(text, cap, "KILNCKPT-COMPLETE step %llu shards %d\n", (unsigned long long)step,
                                    n_ranks);
        for (int r = 0; r < n_ranks; r++) {
            char hex[65], name[64];
            kiln_sha256_hex(header_shas + 32 * (size_t)r, hex);
            snprintf(name, sizeof name, KILN_CKPT_SHARD_FMT, r, n_ranks);
            n += (size_t)snprintf(text + n, cap - n, "%s header-sha256 %s\n", name, hex);
        }
        /* every shard is there (each rank fsynced its file and the directory) */
        for (int r = 0; r < n_ranks && st == KILN_OK; r++) {
            char name[64];
            snprintf(name, sizeof name, KILN_CKPT_SHARD_FMT, r, n_ranks);
            char *f = path_join(w->tmp_dir, name);
            if (!f) st = kiln_error(KILN_ERR_NOMEM, "kiln_ckpt_set_commit: out of memory");
            else if (!kiln_path_is_file(f)) st = kiln_error(KILN_ERR_STATE, "%s: missing: shard %d was not written", f, r);
            kiln_free(f);
        }
        if (st == KILN_OK) st = fsync_path(w->tmp_dir, 1);
        if (st != KILN_OK) writer_fail(w, st);
        else st = publish(w, text, warning);
    }
    if (st != KILN_OK) kiln_error_prefix(st, "checkpoint step %llu (%d shards) not saved", (unsigned long long)step, n_ranks);
    kiln_free(text);
    writer_free(w);
    return st;
}

void kiln_ckpt_set_abort(const char *dir, uint64_t step, long tag) {
    if (!set_args_ok(dir, step, tag, 1)) return;
    kiln_ckpt_writer *w = set_writer(dir, step, tag, -1, 1);
    if (w) remove_flat_dir(w->tmp_dir);
    writer_free(w);
}

/* ---- reader ------------------------------------------------------------------------------------ */

struct kiln_ckpt {
    kiln_file_map map;
    char *path;
    char *rejected;
    uint64_t step;
    uint8_t header_sha[32];
    int n_sections;
    kiln_ckpt_section *sections;
    char *names; /* n_sections * NAME_FIELD */
    int lazy;           /* sections' checksums verified at their first kiln_ckpt_find, not at open */
    uint8_t *sec_sha;   /* lazy: (n_sections, 32) the table's checksums */
    uint8_t *verified;  /* lazy: (n_sections) 1 once checked */
    int n_shards;       /* 0: a single state.kiln; N: shard 0 of a set of N (this file) */
    kiln_ckpt **shards; /* (n_shards) the set's shards, [0] == this one; NULL when 0 */
};

void kiln_ckpt_close(kiln_ckpt *c) {
    if (!c) return;
    for (int k = 1; k < c->n_shards; k++) kiln_ckpt_close(c->shards[k]);
    kiln_free(c->shards);
    kiln_free(c->sec_sha);
    kiln_free(c->verified);
    kiln_file_map_close(&c->map);
    kiln_free(c->path);
    kiln_free(c->rejected);
    kiln_free(c->sections);
    kiln_free(c->names);
    kiln_free(c);
}

uint64_t kiln_ckpt_step(const kiln_ckpt *c) { return c ? c->step : 0; }
const char *kiln_ckpt_path(const kiln_ckpt *c) { return c ? c->path : ""; }
const char *kiln_ckpt_rejected(const kiln_ckpt *c) { return c && c->rejected ? c->rejected : ""; }
int kiln_ckpt_section_count(const kiln_ckpt *c) { return c ? c->n_sections : 0; }
int kiln_ckpt_shard_count(const kiln_ckpt *c) { return c ? c->n_shards : 0; }
const kiln_ckpt *kiln_ckpt_shard(const kiln_ckpt *c, int k) {
    return c && k >= 0 && k < c->n_shards ? c->shards[k] : NULL;
}

const kiln_ckpt_section *kiln_ckpt_section_at(const kiln_ckpt *c, int i) {
    if (!c || i < 0 || i >= c->n_sections) return NULL;
    return &c->sections[i];
}

static int cmp_name_ptr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

#define FMT_ERR(...) kiln_error(KILN_ERR_FORMAT, __VA_ARGS__)

/* Validate the mapped file completely and fill c's section list. */
static kiln_status parse_file(kiln_ckpt *c) {
    const uint8_t *d = c->map.data;
    const char *path = c->path;
    uint64_t fsize = c->map.size;
    if (fsize < HDR_SIZE)
        return FMT_ERR("%s: %llu bytes, shorter than the %d-byte header (truncated?)", path,
                       (unsigned long long)fsize, HDR_SIZE);
    if (memcmp(d, KILN_CKPT_MAGIC, 8) != 0) return FMT_ERR("%s: bad magic (not a kiln checkpoint)", path);
    uint32_t version = kiln_le32(d + 8);
    if (version != KILN_CKPT_VERSION)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: checkpoint version %u (this kiln reads version %u)",
                          path, version, KILN_CKPT_VERSION);
    uint8_t sha[32];
    KILN_TRY(kiln_sha256(d, HDR_HASHED, sha));
    if (memcmp(sha, d + 96, 32) != 0) return FMT_ERR("%s: header checksum mismatch (corrupt header)", path);
    if (kiln_le32(d + 12) != HDR_SIZE) return FMT_ERR("%s: header_size %u, expected %d", path, kiln_le32(d + 12), HDR_SIZE);
    if (kiln_le32(d + 28) != ENTRY_SIZE)
        return FMT_ERR("%s: entry_size %u, expected %d", path, kiln_le32(d + 28), ENTRY_SIZE);
    if (!all_zero(d + 80, 16)) return FMT_ERR("%s: reserved header bytes are not zero", path);
    c->step = kiln_le64(d + 16);
    if (c->step > KILN_CKPT_MAX_STEP)
        return FMT_ERR("%s: header step %llu is out of range (largest %lld)", path, (unsigned long long)c->step,
                       (long long)KILN_CKPT_MAX_STEP);
    memcpy(c->header_sha, d + 96, 32);
    uint64_t n = kiln_le32(d + 24);
    uint64_t table_offset = kiln_le64(d + 32), file_size = kiln_le64(d + 40);
    if (file_size != fsize)
        return FMT_ERR("%s: header says %llu bytes, file has %llu (truncated or extended)", path,
                       (unsigned long long)file_size, (unsigned long long)fsize);
    uint64_t table_bytes = n * ENTRY_SIZE, table_end;
    if (table_offset < HDR_SIZE || table_offset % KILN_CKPT_ALIGN ||
        kiln_add_overflow_u64(table_offset, table_bytes, &table_end) || table_end != fsize)
        return FMT_ERR("%s: table_offset %llu with %llu sections does not end at the file size %llu",
                       path, (unsigned long long)table_offset, (unsigned long long)n, (unsigned long long)fsize);
    const uint8_t *table = d + table_offset;
    KILN_TRY(kiln_sha256(table, (size_t)table_bytes, sha));
    if (memcmp(sha, d + 48, 32) != 0) return FMT_ERR("%s: section table checksum mismatch", path);

    c->sections = kiln_calloc(n ? (size_t)n : 1, sizeof *c->sections);
    if (c->lazy) {
        c->sec_sha = kiln_calloc(n ? (size_t)n : 1, 32);
        c->verified = kiln_calloc(n ? (size_t)n : 1, 1);
        if (!c->sec_sha || !c->verified) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", path);
    }
    c->names = kiln_calloc(n ? (size_t)n : 1, NAME_FIELD);
    const char **sorted = kiln_calloc(n ? (size_t)n : 1, sizeof *sorted);
    if (!c->sections || !c->names || !sorted) {
        kiln_free(sorted);
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory for %llu sections", path, (unsigned long long)n);
    }
    kiln_status st = KILN_OK;
    uint64_t prev_end = HDR_SIZE;
    for (uint64_t i = 0; i < n && st == KILN_OK; i++) {
        const uint8_t *e = table + i * ENTRY_SIZE;
        uint64_t eoff = table_offset + i * ENTRY_SIZE;
        const char *nm = (const char *)e;
        size_t len = strnlen(nm, NAME_FIELD);
        if (len == NAME_FIELD) {
            st = FMT_ERR("%s: section %llu (entry at offset %llu): name not NUL-terminated", path,
                         (unsigned long long)i, (unsigned long long)eoff);
            break;
        }
        const char *why = name_problem(nm, len);
        if (why || !all_zero(e + len, NAME_FIELD - len)) {
            st = FMT_ERR("%s: section %llu (entry at offset %llu): %s", path, (unsigned long long)i,
                         (unsigned long long)eoff, why ? why : "bytes after the name's NUL are not zero");
            break;
        }
        char *name = c->names + i * NAME_FIELD;
        memcpy(name, nm, len + 1);
        sorted[i] = name;
        kiln_ckpt_section *s = &c->sections[i];
        s->name = name;
        uint32_t type = kiln_le32(e + 128), dtype = kiln_le32(e + 132), n_dims = kiln_le32(e + 136);
        uint64_t off = kiln_le64(e + 176), size = kiln_le64(e + 184), end;
        if (kiln_le32(e + 140) || !all_zero(e + 224, 32)) {
            st = FMT_ERR("%s: section '%s': reserved bytes are not zero", path, name);
            break;
        }
        if (type < KILN_CKPT_RAW || type > KILN_CKPT_TENSOR) {
            st = FMT_ERR("%s: section '%s': unknown type %u", path, name, type);
            break;
        }
        s->type = (kiln_ckpt_type)type;
        if (off % KILN_CKPT_ALIGN || off < prev_end || kiln_add_overflow_u64(off, size, &end) ||
            end > table_offset) {
            st = FMT_ERR("%s: section '%s': offset %llu size %llu is misaligned, overlaps the "
                         "previous section or runs past the data area (ends at %llu)",
                         path, name, (unsigned long long)off, (unsigned long long)size,
                         (unsigned long long)table_offset);
            break;
        }
        if (!all_zero(d + prev_end, (size_t)(off - prev_end))) {
            st = FMT_ERR("%s: padding before section '%s' (offset %llu) is not zero", path, name,
                         (unsigned long long)prev_end);
            break;
        }
        prev_end = end;
        for (int k = 0; k < KILN_CKPT_MAX_DIMS; k++) s->shape[k] = (int64_t)kiln_le64(e + 144 + 8 * k);
        if (type == KILN_CKPT_TENSOR) {
            if (dtype >= KILN_DTYPE_COUNT || n_dims < 1 || n_dims > KILN_CKPT_MAX_DIMS) {
                st = FMT_ERR("%s: tensor '%s': dtype %u / n_dims %u out of range", path, name, dtype, n_dims);
                break;
            }
            uint64_t nel = 1, nbytes = 0;
            int bad = 0;
            for (uint32_t k = 0; k < KILN_CKPT_MAX_DIMS; k++) {
                if (s->shape[k] < 0 || (k >= n_dims && s->shape[k] != 1)) bad = 1;
                else if (kiln_mul_overflow_u64(nel, (uint64_t)s->shape[k], &nel)) bad = 1;
            }
            if (bad || !kiln_dtype_nbytes((kiln_dtype)dtype, nel, &nbytes) || nbytes != size) {
                st = FMT_ERR("%s: tensor '%s': shape and dtype %s do not give its size %llu", path,
                             name, kiln_dtype_name((kiln_dtype)dtype), (unsigned long long)size);
                break;
            }
            s->dtype = (kiln_dtype)dtype;
            s->n_dims = (int)n_dims;
        } else {
            if (dtype || n_dims || !all_zero(e + 144, 32)) {
                st = FMT_ERR("%s: section '%s': dtype/shape set on a non-tensor section", path, name);
                break;
            }
            for (int k = 0; k < KILN_CKPT_MAX_DIMS; k++) s->shape[k] = 1;
            if (type == KILN_CKPT_U64 && size != 8) {
                st = FMT_ERR("%s: section '%s': a u64 section of %llu bytes", path, name, (unsigned long long)size);
                break;
            }
            if (type == KILN_CKPT_JSON && memchr(d + off, 0, (size_t)size)) {
                st = FMT_ERR("%s: section '%s': JSON text holds a NUL byte", path, name);
                break;
            }
        }
        s->data = d + off;
        s->size = size;
        if (c->lazy) { /* kiln_ckpt_find checks it when asked for it */
            memcpy(c->sec_sha + 32 * (size_t)i, e + 192, 32);
            continue;
        }
        if ((st = kiln_sha256(s->data, (size_t)size, sha)) != KILN_OK) break;
        if (memcmp(sha, e + 192, 32) != 0)
            st = FMT_ERR("%s: section '%s' (offset %llu, %llu bytes): checksum mismatch (corrupt data)",
                         path, name, (unsigned long long)off, (unsigned long long)size);
    }
    if (st == KILN_OK && !all_zero(d + prev_end, (size_t)(table_offset - prev_end)))
        st = FMT_ERR("%s: padding before the section table is not zero", path);
    if (st == KILN_OK && n > 1) {
        qsort(sorted, (size_t)n, sizeof *sorted, cmp_name_ptr);
        for (uint64_t i = 1; i < n; i++)
            if (!strcmp(sorted[i - 1], sorted[i])) {
                st = FMT_ERR("%s: duplicate section name '%s'", path, sorted[i]);
                break;
            }
    }
    kiln_free(sorted);
    c->n_sections = (int)n;
    return st;
}

/* kiln_ckpt_open_file; lazy: the sections' checksums at their first kiln_ckpt_find. */
static kiln_status open_file_ex(const char *path, int lazy, kiln_ckpt **out) {
    *out = NULL;
    kiln_ckpt *c = kiln_calloc(1, sizeof *c);
    if (!c || !(c->path = kiln_strdup(path))) {
        kiln_free(c);
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", path);
    }
    c->lazy = lazy;
    kiln_status st = kiln_file_map_open(path, 1, &c->map);
    if (st == KILN_OK) st = parse_file(c);
    if (st != KILN_OK) {
        kiln_ckpt_close(c);
        return st;
    }
    *out = c;
    return KILN_OK;
}

kiln_status kiln_ckpt_open_file(const char *path, kiln_ckpt **out) {
    if (!path || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_ckpt_open_file: NULL argument");
    return open_file_ex(path, 0, out);
}

/* A set's shards, as its marker (mpath) lists them in `lines` ("<file> header-sha256 <hex>\n"
 * each, files in rank order): every file there, its header hash the marker's, its step `step`.
 * *out: shard 0, holding the others. */
static kiln_status open_set(const char *sdir, const char *mpath, const char *lines, uint64_t step,
                            unsigned long long mstep, int n, int lazy, kiln_ckpt **out) {
    *out = NULL;
    if (mstep != step || n < 1 || n > KILN_CKPT_MAX_SHARDS)
        return FMT_ERR("%s: the marker says step %llu, %d shards, in the directory of step %llu", mpath, mstep, n,
                       (unsigned long long)step);
    kiln_ckpt **sh = kiln_calloc((size_t)n, sizeof *sh);
    if (!sh) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", sdir);
    kiln_status st = KILN_OK;
    const char *p = lines;
    for (int k = 0; k < n && st == KILN_OK; k++) {
        char name[64], want[160], hex[65];
        snprintf(name, sizeof name, KILN_CKPT_SHARD_FMT, k, n);
        const char *nl = strchr(p, '\n');
        char *f = path_join(sdir, name);
        if (!f) {
            st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory", sdir);
            break;
        }
        if (!nl || (size_t)(nl - p) < strlen(name) || strncmp(p, name, strlen(name)) != 0)
            st = FMT_ERR("%s: line %d should name %s", mpath, k + 2, name);
        else if (!kiln_path_is_file(f))
            st = FMT_ERR("%s: marked complete but shard %d of %d (%s) is missing", sdir, k, n, name);
        else if ((st = open_file_ex(f, lazy, &sh[k])) == KILN_OK) {
            kiln_sha256_hex(sh[k]->header_sha, hex);
            int wl = snprintf(want, sizeof want, "%s header-sha256 %s", name, hex);
            if ((size_t)(nl - p) != (size_t)wl || strncmp(p, want, (size_t)wl) != 0)
                st = FMT_ERR("%s: the marker does not match %s (a shard of another save, or a stale marker)", mpath, f);
            else if (sh[k]->step != step)
                st = FMT_ERR("%s: header step %llu in the set of step %llu", f, (unsigned long long)sh[k]->step,
                             (unsigned long long)step);
        }
        kiln_free(f);
        p = nl ? nl + 1 : p;
    }
    if (st == KILN_OK && *p) st = FMT_ERR("%s: text after the %d shards' lines", mpath, n);
    if (st != KILN_OK) {
        for (int k = 0; k < n; k++) kiln_ckpt_close(sh[k]);
        kiln_free(sh);
        return st;
    }
    sh[0]->n_shards = n;
    sh[0]->shards = sh;
    *out = sh[0];
    return KILN_OK;
}

/* Open <dir>/step-<step>: marker must exist and match the file's header hash and step (or,
 * a set's marker, every shard's: open_set). */
static kiln_status open_step_dir(const char *dir, uint64_t step, int lazy, kiln_ckpt **out) {
    char buf[64];
    snprintf(buf, sizeof buf, "step-%llu", (unsigned long long)step);
    char *sdir = path_join(dir, buf);
    char *mpath = sdir ? path_join(sdir, KILN_CKPT_MARKER) : NULL;
    char *fpath = sdir ? path_join(sdir, KILN_CKPT_FILE) : NULL;
    char *text = NULL;
    kiln_ckpt *c = NULL;
    kiln_status st = KILN_OK;
    if (!sdir || !mpath || !fpath) {
        st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory", dir);
        goto done;
    }
    if (!kiln_path_is_file(mpath)) {
        st = kiln_error(KILN_ERR_FORMAT, "%s: incomplete checkpoint (no %s marker)", sdir, KILN_CKPT_MARKER);
        goto done;
    }
    size_t len = 0;
    if ((st = kiln_read_text_file(mpath, 96 + (size_t)KILN_CKPT_MAX_SHARDS * 128, &text, &len)) != KILN_OK) goto done;
    unsigned long long mstep = 0;
    int n_shards = 0, used = 0;
    if (sscanf(text, "KILNCKPT-COMPLETE step %llu shards %d\n%n", &mstep, &n_shards, &used) == 2 && used > 0) {
        st = open_set(sdir, mpath, text + used, step, mstep, n_shards, lazy, &c);
        goto done;
    }
    if (!kiln_path_is_file(fpath)) {
        st = kiln_error(KILN_ERR_FORMAT, "%s: marked complete but %s is missing", sdir, KILN_CKPT_FILE);
        goto done;
    }
    if ((st = open_file_ex(fpath, lazy, &c)) != KILN_OK) goto done;
    char hex[65], want[160];
    kiln_sha256_hex(c->header_sha, hex);
    snprintf(want, sizeof want, "KILNCKPT-COMPLETE step %llu header-sha256 %s\n", (unsigned long long)step, hex);
    if (strcmp(text, want) != 0) {
        st = kiln_error(KILN_ERR_FORMAT, "%s: marker does not match %s (stale or corrupt marker)", mpath, fpath);
        goto done;
    }
    if (c->step != step) {
        st = kiln_error(KILN_ERR_FORMAT, "%s: header step %llu in directory of step %llu", fpath,
                        (unsigned long long)c->step, (unsigned long long)step);
        goto done;
    }
done:
    if (st != KILN_OK) {
        kiln_ckpt_close(c);
        c = NULL;
    }
    *out = c;
    kiln_free(sdir);
    kiln_free(mpath);
    kiln_free(fpath);
    kiln_free(text);
    return st;
}

kiln_status kiln_ckpt_open_step(const char *dir, uint64_t step, kiln_ckpt **out) {
    if (!dir || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_ckpt_open_step: NULL argument");
    return open_step_dir(dir, step, 0, out);
}

kiln_status kiln_ckpt_open_step_lazy(const char *dir, uint64_t step, kiln_ckpt **out) {
    if (!dir || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_ckpt_open_step_lazy: NULL argument");
    return open_step_dir(dir, step, 1, out);
}

/* Append "line\n" to a kiln_malloc'd text (bounded at 64 KiB; best effort). */
static void text_add(char **text, size_t *len, const char *line) {
    size_t ml = strlen(line);
    if (*len + ml + 2 > 64 * 1024) return;
    char *nr = kiln_realloc(*text, *len + ml + 2);
    if (!nr) return;
    *text = nr;
    memcpy(nr + *len, line, ml);
    *len += ml;
    nr[(*len)++] = '\n';
    nr[*len] = 0;
}

kiln_status kiln_ckpt_set_aside(const char *dir, uint64_t step, const char *reason, char **new_path) {
    if (new_path) *new_path = NULL;
    if (!dir || !reason) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_ckpt_set_aside: NULL argument");
    char *sdir = path_printf("step-%llu", dir, step, -1);
    char *rpath = sdir ? path_join(sdir, KILN_CKPT_REASON) : NULL;
    char *to = NULL;
    kiln_status st = KILN_OK;
    int fd = -1;
    if (!sdir || !rpath) {
        st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory", dir);
        goto done;
    }
    if (!kiln_path_is_dir(sdir)) {
        st = kiln_error(KILN_ERR_IO, "%s: no such checkpoint directory to set aside", sdir);
        goto done;
    }
    time_t now = time(NULL);
    struct tm tmv;
    char stamp[32] = "0";
    if (gmtime_r(&now, &tmv)) strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%SZ", &tmv);
    /* the REASON file first: the set-aside directory always says why it is there */
    fd = open(rpath, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        st = kiln_error(KILN_ERR_IO, "%s: cannot create: %s", rpath, strerror(errno));
        goto done;
    }
    char head[256];
    int hl = snprintf(head, sizeof head,
                      "kiln set checkpoint step %llu aside at %s: it carried its %s marker but failed "
                      "verification, so a resumed run could not save this step again.\n",
                      (unsigned long long)step, stamp, KILN_CKPT_MARKER);
    if ((st = write_all(fd, rpath, 0, head, (size_t)hl)) != KILN_OK ||
        (st = write_all(fd, rpath, (uint64_t)hl, reason, strlen(reason))) != KILN_OK ||
        (st = write_all(fd, rpath, (uint64_t)hl + strlen(reason), "\n", 1)) != KILN_OK)
        goto done;
    if (fsync(fd) != 0) {
        st = kiln_error(KILN_ERR_IO, "%s: fsync failed: %s", rpath, strerror(errno));
        goto done;
    }
    /* step-<k>.rejected-<UTC time>[-n]: a name the listing and housekeeping never match */
    char name[96];
    for (int n = 0; n < 1000; n++) {
        if (n == 0) snprintf(name, sizeof name, "step-%llu.rejected-%s", (unsigned long long)step, stamp);
        else snprintf(name, sizeof name, "step-%llu.rejected-%s-%d", (unsigned long long)step, stamp, n);
        kiln_free(to);
        to = path_join(dir, name);
        if (!to) {
            st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory", dir);
            goto done;
        }
        struct stat sb;
        if (lstat(to, &sb) != 0 && errno == ENOENT) break;
        if (n == 999) {
            st = kiln_error(KILN_ERR_IO, "%s: no free name to set step %llu aside", dir, (unsigned long long)step);
            goto done;
        }
    }
    if ((st = do_rename(sdir, to)) != KILN_OK) goto done;
    fsync_path(dir, 1); /* best effort: a lost rename only means the next resume does it again */
    if (new_path) {
        *new_path = to;
        to = NULL;
    }
done:
    if (fd >= 0) close(fd);
    if (st != KILN_OK) kiln_error_prefix(st, "checkpoint step %llu not set aside", (unsigned long long)step);
    kiln_free(sdir);
    kiln_free(rpath);
    kiln_free(to);
    return st;
}

/* kiln_ckpt_open_latest (set_aside 0) and kiln_ckpt_open_for_resume (set_aside 1). */
static kiln_status open_latest(const char *dir, int set_aside, kiln_ckpt **out) {
    *out = NULL;
    uint64_t *steps = NULL;
    size_t n = 0;
    KILN_TRY(list_step_dirs(dir, &steps, &n));
    if (n == 0) {
        kiln_free(steps);
        return kiln_error(KILN_ERR_IO, "%s: no checkpoint (no step-<k> directory)", dir);
    }
    char *rej = NULL;
    size_t rej_len = 0;
    /* complete-but-invalid candidates newer than the one loaded: set aside once one loads */
    uint64_t *bad = kiln_calloc(n, sizeof *bad);
    char **why = kiln_calloc(n, sizeof *why);
    size_t n_bad = 0;
    kiln_ckpt *c = NULL;
    kiln_status st = bad && why ? KILN_OK : kiln_error(KILN_ERR_NOMEM, "%s: out of memory", dir);
    for (size_t i = n; st == KILN_OK && i-- > 0;) {
        kiln_status r = open_step_dir(dir, steps[i], 0, &c);
        if (r == KILN_OK) break;
        char msg[2048]; /* a copy: the next kiln_error reuses the thread's message buffer */
        snprintf(msg, sizeof msg, "%s", kiln_last_error());
        if (set_aside && step_dir_has_marker(dir, steps[i])) {
            if (r != KILN_ERR_FORMAT) {
                /* an I/O error, a newer format, no memory: perhaps passing, perhaps the
                 * checkpoint is fine; falling back past it would wedge the run */
                st = kiln_error(r, "%s: cannot resume: the complete checkpoint step-%llu could not be "
                                   "read (%s); it is not set aside: fix the cause or move it away",
                                dir, (unsigned long long)steps[i], msg);
                break;
            }
            bad[n_bad] = steps[i];
            why[n_bad++] = kiln_strdup(msg);
        } else {
            text_add(&rej, &rej_len, msg);
        }
    }
    if (st == KILN_OK && !c) {
        for (size_t b = 0; b < n_bad; b++) text_add(&rej, &rej_len, why[b] ? why[b] : "(out of memory)");
        st = kiln_error(KILN_ERR_FORMAT, "%s: no valid checkpoint among %zu: %s", dir, n, rej ? rej : "");
    }
    for (size_t b = 0; st == KILN_OK && b < n_bad; b++) {
        char *to = NULL;
        const char *reason = why[b] ? why[b] : "(the reason could not be kept: out of memory)";
        st = kiln_ckpt_set_aside(dir, bad[b], reason, &to);
        if (st == KILN_OK && to) {
            size_t ll = strlen(reason) + strlen(to) + 64;
            char *line = kiln_malloc(ll);
            if (line) {
                snprintf(line, ll, "%s [set aside as %s]", reason, to);
                text_add(&rej, &rej_len, line);
            }
            kiln_free(line);
        }
        kiln_free(to);
    }
    for (size_t b = 0; b < n_bad; b++) kiln_free(why[b]);
    kiln_free(bad);
    kiln_free(why);
    kiln_free(steps);
    if (st != KILN_OK) {
        kiln_ckpt_close(c);
        kiln_free(rej);
        return st;
    }
    kiln_error_clear();
    c->rejected = rej;
    *out = c;
    return KILN_OK;
}

kiln_status kiln_ckpt_open_latest(const char *dir, kiln_ckpt **out) {
    if (!dir || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_ckpt_open_latest: NULL argument");
    return open_latest(dir, 0, out);
}

kiln_status kiln_ckpt_open_for_resume(const char *dir, kiln_ckpt **out) {
    if (!dir || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_ckpt_open_for_resume: NULL argument");
    return open_latest(dir, 1, out);
}

kiln_status kiln_ckpt_find(const kiln_ckpt *c, const char *name, kiln_ckpt_type type,
                           const kiln_ckpt_section **out) {
    if (!c || !name || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_ckpt_find: NULL argument");
    *out = NULL;
    for (int i = 0; i < c->n_sections; i++) {
        if (strcmp(c->sections[i].name, name) != 0) continue;
        if (type && c->sections[i].type != type)
            return kiln_error(KILN_ERR_FORMAT, "%s: section '%s' has type %d, expected %d", c->path,
                              name, (int)c->sections[i].type, (int)type);
        if (c->lazy && !c->verified[i]) {
            uint8_t sha[32];
            KILN_TRY(kiln_sha256(c->sections[i].data, (size_t)c->sections[i].size, sha));
            if (memcmp(sha, c->sec_sha + 32 * (size_t)i, 32) != 0)
                return kiln_error(KILN_ERR_FORMAT, "%s: section '%s' (%llu bytes): checksum mismatch (corrupt data)",
                                  c->path, name, (unsigned long long)c->sections[i].size);
            c->verified[i] = 1; /* the verification state is not the checkpoint's contents */
        }
        *out = &c->sections[i];
        return KILN_OK;
    }
    return kiln_error(KILN_ERR_FORMAT, "%s: missing section '%s'", c->path, name);
}

kiln_status kiln_ckpt_get_u64(const kiln_ckpt *c, const char *name, uint64_t *out) {
    const kiln_ckpt_section *s;
    KILN_TRY(kiln_ckpt_find(c, name, KILN_CKPT_U64, &s));
    *out = kiln_le64(s->data);
    return KILN_OK;
}
