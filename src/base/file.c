/* file.c -- whole-file mapping and reading, path tests, clocks. */
#define _GNU_SOURCE
#include "base.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* What a stat mode is, for messages about files that are not regular. */
static const char *file_kind(mode_t mode) {
    if (S_ISDIR(mode)) return "a folder";
    if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    if (S_ISSOCK(mode)) return "a socket";
    return "not a regular file";
}

kiln_status kiln_path_check_file(const char *path) {
    struct stat st;
    if (!path) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_path_check_file: NULL path");
    if (stat(path, &st) != 0)
        return kiln_error(KILN_ERR_IO, "%s: %s", path, errno == ENOENT ? "no such file or folder" : strerror(errno));
    if (!S_ISREG(st.st_mode))
        return kiln_error(KILN_ERR_IO, "%s: is %s, not a regular file", path, file_kind(st.st_mode));
    return KILN_OK;
}

kiln_status kiln_path_optional_file(const char *path, int *present) {
    struct stat st;
    *present = 0;
    if (!path) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_path_optional_file: NULL path");
    if (stat(path, &st) != 0) {
        if (errno == ENOENT) return KILN_OK;
        return kiln_error(KILN_ERR_IO, "%s: %s", path, strerror(errno));
    }
    if (!S_ISREG(st.st_mode))
        return kiln_error(KILN_ERR_IO, "%s: is %s, not a regular file", path, file_kind(st.st_mode));
    *present = 1;
    return KILN_OK;
}

kiln_status kiln_open_file(const char *path, int flags, int mode, int regular_only, int *fd_out) {
    *fd_out = -1;
    /* O_NONBLOCK: opening a FIFO would otherwise wait for the other end forever (for writing
     * with no reader it fails with ENXIO instead); it is cleared again once open. */
    int fd = open(path, flags | O_CLOEXEC | O_NONBLOCK | O_NOCTTY, mode);
    if (fd < 0) {
        int e = errno;
        if (e == ENXIO) return kiln_error(KILN_ERR_IO, "%s: is a FIFO with no reader (or a device that is absent)", path);
        return kiln_error(KILN_ERR_IO, "%s: cannot open: %s", path, strerror(e));
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return kiln_error(KILN_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (regular_only && !S_ISREG(st.st_mode)) {
        close(fd);
        return kiln_error(KILN_ERR_IO, "%s: is %s, not a regular file", path, file_kind(st.st_mode));
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        int e = errno;
        close(fd);
        return kiln_error(KILN_ERR_IO, "%s: fcntl: %s", path, strerror(e));
    }
    *fd_out = fd;
    return KILN_OK;
}

kiln_status kiln_file_map_open(const char *path, int use_mmap, kiln_file_map *out) {
    if (!path || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_file_map_open: NULL argument");
    int fd;
    KILN_TRY(kiln_open_file(path, O_RDONLY, 0, 1, &fd));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return kiln_error(KILN_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    size_t size = (size_t)st.st_size;
    kiln_file_map m = {0};
    m.size = size;
    if (size == 0) {
        close(fd);
        m.data = (const uint8_t *)"";
        *out = m;
        return KILN_OK;
    }
    if (use_mmap) {
        void *p = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p != MAP_FAILED) {
            close(fd);
            m.data = p;
            m.mapped = 1;
            *out = m;
            return KILN_OK;
        }
        /* fall through to reading */
    }
    uint8_t *buf = kiln_malloc(size);
    if (!buf) {
        close(fd);
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory reading %zu bytes", path, size);
    }
    size_t got = 0;
    while (got < size) {
        ssize_t r = read(fd, buf + got, size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            int e = errno;
            kiln_free(buf);
            close(fd);
            return kiln_error(KILN_ERR_IO, "%s: read failed at byte %zu: %s", path, got,
                              r == 0 ? "unexpected end of file" : strerror(e));
        }
        got += (size_t)r;
    }
    close(fd);
    m.data = buf;
    *out = m;
    return KILN_OK;
}

void kiln_file_map_close(kiln_file_map *m) {
    if (!m || !m->data) return;
    if (m->size) {
        if (m->mapped) munmap((void *)m->data, m->size);
        else kiln_free((void *)m->data);
    }
    memset(m, 0, sizeof *m);
}

kiln_status kiln_read_text_file(const char *path, size_t max_size, char **out, size_t *len) {
    kiln_file_map m;
    KILN_TRY(kiln_file_map_open(path, 0, &m));
    if (m.size > max_size) {
        kiln_file_map_close(&m);
        return kiln_error(KILN_ERR_FORMAT, "%s: file is %zu bytes, more than the %zu allowed", path,
                          m.size, max_size);
    }
    char *s = kiln_strndup((const char *)m.data, m.size);
    size_t n = m.size;
    kiln_file_map_close(&m);
    if (!s) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", path);
    *out = s;
    if (len) *len = n;
    return KILN_OK;
}

kiln_status kiln_write_all(int fd, const void *data, size_t n, const char *path) {
    const uint8_t *p = data;
    while (n > 0) {
        size_t chunk = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
        ssize_t w = write(fd, p, chunk);
        if (w < 0) {
            if (errno == EINTR) continue;
            return kiln_error(KILN_ERR_IO, "%s: write failed: %s", path, strerror(errno));
        }
        if (w == 0) return kiln_error(KILN_ERR_IO, "%s: write wrote nothing (disk full?)", path);
        p += w;
        n -= (size_t)w;
    }
    return KILN_OK;
}

kiln_status kiln_fsync_path(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kiln_error(KILN_ERR_IO, "%s: cannot open to fsync: %s", path, strerror(errno));
    int r = fsync(fd), e = errno;
    close(fd);
    if (r != 0) return kiln_error(KILN_ERR_IO, "%s: fsync failed: %s", path, strerror(e));
    return KILN_OK;
}

kiln_status kiln_fsync_parent_dir(const char *path) {
    const char *slash = strrchr(path, '/');
    char *dir = slash ? kiln_strndup(path, slash == path ? 1 : (size_t)(slash - path)) : kiln_strdup(".");
    if (!dir) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", path);
    kiln_status st = kiln_fsync_path(dir);
    if (st != KILN_OK) kiln_error_prefix(st, "%s: directory fsync", path);
    kiln_free(dir);
    return st;
}

int kiln_path_is_dir(const char *path) {
    struct stat st;
    return path && stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

int kiln_path_is_file(const char *path) {
    struct stat st;
    return path && stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

double kiln_time_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int kiln_cpu_count(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : (int)n;
}
