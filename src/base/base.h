/*
 * base.h -- kiln's internal base layer: errors, allocation, checked arithmetic, files.
 * Every internal source file includes this. Nothing here depends on any other kiln layer.
 */
#ifndef KILN_BASE_H
#define KILN_BASE_H

#include "kiln.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__GNUC__)
#define KILN_PRINTF(a, b) __attribute__((format(printf, a, b)))
#define KILN_LIKELY(x) __builtin_expect(!!(x), 1)
#define KILN_UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define KILN_PRINTF(a, b)
#define KILN_LIKELY(x) (x)
#define KILN_UNLIKELY(x) (x)
#endif

/* ---- switches ------------------------------------------------------------------------- */

/* Whether environment variable name is set to exactly "0": how kiln's switches
 * (KILN_CUDA_GRAPHS=0, KILN_WGMMA=0, ...) turn a default path off. Read where the choice is
 * made, so tests may switch them between calls. */
static inline bool kiln_env_off(const char *name) {
    const char *v = getenv(name);
    return v && v[0] == '0' && v[1] == '\0';
}

/* ---- errors ---------------------------------------------------------------------------- */

/* Set this thread's error message and return st, so callers write
 *   return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': offset %llu past end", path, ...); */
kiln_status kiln_error(kiln_status st, const char *fmt, ...) KILN_PRINTF(2, 3);
/* Prefix the current message with more context: "ctx: <old message>". Returns st. */
kiln_status kiln_error_prefix(kiln_status st, const char *fmt, ...) KILN_PRINTF(2, 3);
void kiln_error_clear(void);

/* Propagate a failing status. */
#define KILN_TRY(expr)                                                                         \
    do {                                                                                       \
        kiln_status kiln_try_st_ = (expr);                                                     \
        if (kiln_try_st_ != KILN_OK) return kiln_try_st_;                                      \
    } while (0)

/* ---- allocation (all through the hook; 64-byte aligned; accounted) ----------------------- */

void *kiln_malloc(size_t size);                 /* NULL on failure (or size 0 -> valid ptr) */
void *kiln_calloc(size_t n, size_t size);       /* zeroed; NULL on overflow or failure */
void *kiln_realloc(void *p, size_t size);       /* like realloc; p kept on failure */
void kiln_free(void *p);                        /* NULL is a no-op */
/* 1 while kiln_malloc takes its memory from the C library's malloc (no kiln_set_allocator
 * hook): private anonymous memory, whose pages a caller may give back to the system with
 * madvise(MADV_DONTNEED) (they read as zero afterwards). */
int kiln_allocator_is_default(void);
/* The system's page size while kiln_allocator_is_default() (kiln_malloc's pages may be given
 * back), else 0 (an allocator hook's memory may not be anonymous: no page is given back). */
size_t kiln_alloc_page_size(void);
/* The whole pages inside [p, p + n) for a page size page (0: none): [*lo, *hi), lo == hi when
 * there is none. */
void kiln_pages_inside(const void *p, size_t n, size_t page, uintptr_t *lo, uintptr_t *hi);
/* kiln_malloc'd memory's whole pages inside [p, p + n) given back to the system with
 * madvise(MADV_DONTNEED) (they read as zero afterwards); page as kiln_alloc_page_size() gives
 * it. [*lo, *hi) is what was given back: lo == hi == p when nothing was (no whole page, page
 * 0, or madvise failed); the bytes outside it are untouched. */
void kiln_pages_give_back(void *p, size_t n, size_t page, uintptr_t *lo, uintptr_t *hi);
char *kiln_strdup(const char *s);
char *kiln_strndup(const char *s, size_t n);    /* copies n bytes and adds a NUL */

/* Allocate or fail with a kiln_error naming what: *out set on success. */
kiln_status kiln_alloc_or_fail(void **out, size_t size, const char *what);

/* ---- checked arithmetic: return true when the result OVERFLOWED -------------------------- */

static inline bool kiln_add_overflow(size_t a, size_t b, size_t *r) {
    return __builtin_add_overflow(a, b, r);
}
static inline bool kiln_mul_overflow(size_t a, size_t b, size_t *r) {
    return __builtin_mul_overflow(a, b, r);
}
static inline bool kiln_mul_overflow_u64(uint64_t a, uint64_t b, uint64_t *r) {
    return __builtin_mul_overflow(a, b, r);
}
static inline bool kiln_add_overflow_u64(uint64_t a, uint64_t b, uint64_t *r) {
    return __builtin_add_overflow(a, b, r);
}

/* ---- little-endian fields (GGUF, safetensors, checkpoints, shards) ----------------------- */

/* Byte by byte, so the files read and write the same on any host; compilers turn these into
 * single loads and stores on little-endian machines. p need not be aligned. */
static inline uint32_t kiln_le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t kiln_le64(const uint8_t *p) {
    return (uint64_t)kiln_le32(p) | ((uint64_t)kiln_le32(p + 4) << 32);
}
static inline void kiln_put_le32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void kiln_put_le64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* ---- files ------------------------------------------------------------------------------- */

typedef struct kiln_file_map {
    const uint8_t *data; /* the whole file, read-only */
    size_t size;
    int mapped;          /* 1: mmap'd (munmap on close); 0: read into kiln_malloc'd memory */
} kiln_file_map;

/* open(path, flags | O_CLOEXEC, mode) that never blocks on a FIFO: one with no other end is
 * refused (ENXIO for writing; for reading it is no regular file). regular_only: refuse
 * anything but a regular file (a FIFO, a device, a socket, a folder) naming what it is. */
kiln_status kiln_open_file(const char *path, int flags, int mode, int regular_only, int *fd_out);
/* Map (use_mmap) or read a whole file. Errors name the path and the errno text. */
kiln_status kiln_file_map_open(const char *path, int use_mmap, kiln_file_map *out);
void kiln_file_map_close(kiln_file_map *m);

/* Read a whole (small) text file into a NUL-terminated kiln_malloc'd buffer. */
kiln_status kiln_read_text_file(const char *path, size_t max_size, char **out, size_t *len);

/* Write all n bytes to fd (EINTR retried, large writes chunked); errors name path and errno
 * (a write of 0 bytes is reported as a full disk). */
kiln_status kiln_write_all(int fd, const void *data, size_t n, const char *path);
/* fsync a file or a directory by path. */
kiln_status kiln_fsync_path(const char *path);
/* fsync the directory that holds path ("." when path has no '/'), so a rename in it is
 * durable. */
kiln_status kiln_fsync_parent_dir(const char *path);

/* 1 if path exists and is a directory / a regular file. */
int kiln_path_is_dir(const char *path);
int kiln_path_is_file(const char *path);
/* KILN_OK if path names a regular file (after symlinks); else KILN_ERR_IO naming what it is
 * instead ("no such file or directory", "is a FIFO (named pipe), not a regular file", ...). */
kiln_status kiln_path_check_file(const char *path);
/* For a file that may be absent: *present = 0 and KILN_OK when nothing is at path, 1 when a
 * regular file is; anything else there (a FIFO, a folder, a dangling link's target that cannot
 * be read) is an error naming what it is, never skipped as absent. */
kiln_status kiln_path_optional_file(const char *path, int *present);

/* ---- misc -------------------------------------------------------------------------------- */

/* Wall clock in seconds (monotonic). */
double kiln_time_seconds(void);
/* Number of online CPUs (>= 1). */
int kiln_cpu_count(void);

#endif /* KILN_BASE_H */
