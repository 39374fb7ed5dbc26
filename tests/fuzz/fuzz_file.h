/* fuzz_file.h -- for fuzz targets whose reader takes a path: the input as a file that lives in
 * memory (memfd), named by /proc/self/fd/N, rewritten in place for each input. No disk I/O,
 * so the run is bound by the reader, not by the file system. */
#ifndef KILN_FUZZ_FILE_H
#define KILN_FUZZ_FILE_H

#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
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

#endif /* KILN_FUZZ_FILE_H */
