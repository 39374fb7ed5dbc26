/* fuzz_file.h -- for fuzz targets whose reader takes a path: the input as a file that lives in
 * memory (memfd), named by /proc/self/fd/N, rewritten in place for each input. No disk I/O,
 * so the run is bound by the reader, not by the file system. */
#ifndef KILN_FUZZ_FILE_H
#define KILN_FUZZ_FILE_H

#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* The path of a file holding exactly data[0..size); aborts when the memfd cannot be made. */
static const char *fuzz_file_write(const char *name, const uint8_t *data, size_t size) {
    static int fd = -1;
    static char path[64];
    if (fd < 0) {
        fd = memfd_create(name, MFD_CLOEXEC);
        if (fd < 0) abort();
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    }
    if (ftruncate(fd, 0) != 0 || (size && pwrite(fd, data, size, 0) != (ssize_t)size)) abort();
    return path;
}

/* The input of a target whose first byte is a mode: *mode = data[0]; the rest, passed through
 * reseal (when mode bit 0 is set and reseal is not NULL: it recomputes the format's checksums
 * in place, inside the n bytes it is given), becomes the file whose path is returned. NULL for
 * an empty input or when memory runs out. */
static const char *fuzz_file_with_mode(const char *name, const uint8_t *data, size_t size, int *mode,
                                       void (*reseal)(uint8_t *b, size_t n)) {
    if (size < 1) return NULL;
    *mode = data[0];
    data++, size--;
    uint8_t *b = malloc(size ? size : 1);
    if (!b) return NULL;
    memcpy(b, data, size);
    if ((*mode & 1) && reseal) reseal(b, size);
    const char *path = fuzz_file_write(name, b, size);
    free(b);
    return path;
}

#endif /* KILN_FUZZ_FILE_H */
