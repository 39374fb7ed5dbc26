/*
 * dump_gguf FILE OUTDIR -- open a GGUF with kiln's reader and, for tensor i, write
 * OUTDIR/<i>.f32 (raw little-endian float32 of kiln_dequantize over the whole tensor); print
 * one JSON line per tensor: {"index": i, "name": ..., "dtype": ..., "shape": [...]}, shape
 * outermost first. tests/python/test_dequant.py compares the floats bit for bit with
 * gguf-py. Exit status 1 (message on stderr) when the file does not open.
 */
#include "formats/gguf.h"

#include <stdio.h>
#include <stdlib.h>

static void print_json_string(const char *s) {
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') printf("\\%c", *p);
        else if (*p < 0x20) printf("\\u%04x", *p);
        else putchar(*p);
    }
    putchar('"');
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s FILE.gguf OUTDIR\n", argv[0]);
        return 2;
    }
    kiln_gguf *g;
    kiln_status st = kiln_gguf_open(argv[1], 1, &g);
    if (st != KILN_OK) {
        fprintf(stderr, "dump_gguf: %s: %s\n", kiln_status_string(st), kiln_last_error());
        return 1;
    }
    int rc = 0;
    for (int64_t i = 0; i < kiln_gguf_n_tensors(g) && rc == 0; i++) {
        const kiln_tensor *t = kiln_gguf_tensor_at(g, i);
        int64_t n = kiln_tensor_nelements(t);
        float *buf = malloc((size_t)n * sizeof(float));
        char path[4096];
        snprintf(path, sizeof path, "%s/%lld.f32", argv[2], (long long)i);
        FILE *f = buf ? fopen(path, "wb") : NULL;
        if (!f) {
            fprintf(stderr, "dump_gguf: cannot write %s\n", path);
            free(buf);
            rc = 1;
            break;
        }
        kiln_dequantize(t->dtype, t->data, buf, n);
        if (fwrite(buf, sizeof(float), (size_t)n, f) != (size_t)n) rc = 1;
        if (fclose(f) != 0) rc = 1;
        free(buf);
        printf("{\"index\": %lld, \"name\": ", (long long)i);
        print_json_string(t->name);
        printf(", \"dtype\": \"%s\", \"shape\": [", kiln_dtype_name(t->dtype));
        for (int d = 0; d < t->n_dims; d++) printf("%s%lld", d ? ", " : "", (long long)t->shape[d]);
        printf("]}\n");
    }
    kiln_gguf_close(g);
    return rc;
}
