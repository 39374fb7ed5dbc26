/* fuzz_checkpoint.c -- libFuzzer target for the KILNCKPT reader (src/train/checkpoint.h):
 * arbitrary bytes are written to a file in memory (fuzz_file.h) and opened with kiln_ckpt_open_file; when accepted,
 * every section is looked up by name and read end to end and its fields are checked against
 * the format's rules, so a table entry or pointer the reader lets through that is not inside
 * the file shows up under ASan.
 *
 * The first input byte picks a mode: bit 0 set reseals the rest before opening (every
 * section's SHA-256 in the table, the table's and the header's recomputed, within bounds), so
 * mutations reach the table and field checks behind the checksums instead of stopping at
 * "header checksum mismatch". Seeds: tests/fuzz/corpus_checkpoint/ (make_corpus_checkpoint.py).
 * KILN_FUZZ_VERBOSE=1 prints each input's verdict (to check the seeds). */
#include "fuzz_file.h"
#include "train/checkpoint.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static volatile uint64_t g_sink; /* keeps the reads from being optimized away */

static uint64_t rd64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* Recompute the checksums of a candidate image in place, touching only bytes inside it. */
static void reseal(uint8_t *b, size_t n) {
    if (n < 128) return;
    uint32_t ns;
    memcpy(&ns, b + 24, 4);
    uint64_t t = rd64(b + 32);
    if (t <= n && (uint64_t)ns <= (n - t) / 256) {
        for (uint32_t i = 0; i < ns; i++) {
            uint8_t *e = b + t + 256 * (uint64_t)i;
            uint64_t off = rd64(e + 176), size = rd64(e + 184);
            if (off <= n && size <= n - off) kiln_sha256(b + off, (size_t)size, e + 192);
        }
        kiln_sha256(b + t, (size_t)ns * 256, b + 48);
    }
    kiln_sha256(b, 96, b + 96);
}

static void touch(const kiln_ckpt *c, const kiln_ckpt_section *s) {
    const kiln_ckpt_section *f = NULL;
    if (kiln_ckpt_find(c, s->name, 0, &f) != KILN_OK || f != s) abort(); /* names are unique */
    size_t len = strlen(s->name);
    if (len < 1 || len > KILN_CKPT_NAME_MAX) abort();
    if ((uintptr_t)s->data % KILN_CKPT_ALIGN) abort();
    const uint8_t *p = s->data;
    uint64_t h = s->size;
    for (uint64_t i = 0; i < s->size; i++) h = h * 31 + p[i];
    switch (s->type) {
    case KILN_CKPT_U64: {
        uint64_t v = 0;
        if (s->size != 8 || kiln_ckpt_get_u64(c, s->name, &v) != KILN_OK) abort();
        h += v;
        break;
    }
    case KILN_CKPT_JSON:
        if (memchr(p, 0, (size_t)s->size)) abort();
        break;
    case KILN_CKPT_TENSOR: {
        if (s->n_dims < 1 || s->n_dims > KILN_CKPT_MAX_DIMS || (int)s->dtype < 0 || s->dtype >= KILN_DTYPE_COUNT)
            abort();
        uint64_t nel = 1, nbytes = 0;
        for (int k = 0; k < KILN_CKPT_MAX_DIMS; k++) {
            if (s->shape[k] < 0 || (k >= s->n_dims && s->shape[k] != 1)) abort();
            if (kiln_mul_overflow_u64(nel, (uint64_t)s->shape[k], &nel)) abort();
        }
        if (!kiln_dtype_nbytes(s->dtype, nel, &nbytes) || nbytes != s->size) abort();
        break;
    }
    case KILN_CKPT_RAW:
        break;
    default:
        abort();
    }
    g_sink += h;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    int mode = 0;
    const char *path = fuzz_file_with_mode("kiln_fuzz_ckpt", data, size, &mode, reseal);
    if (!path) return 0;
    kiln_ckpt *c = NULL;
    kiln_status st = kiln_ckpt_open_file(path, &c);
    if (getenv("KILN_FUZZ_VERBOSE")) fprintf(stderr, "fuzz_checkpoint: %s\n", st == KILN_OK ? "accepted" : kiln_last_error());
    if (st != KILN_OK) {
        if (c) abort(); /* output untouched on failure */
        return 0;
    }
    if (kiln_ckpt_step(c) > KILN_CKPT_MAX_STEP) abort();
    int n = kiln_ckpt_section_count(c);
    for (int i = 0; i < n; i++) touch(c, kiln_ckpt_section_at(c, i));
    if (kiln_ckpt_section_at(c, n) != NULL || kiln_ckpt_section_at(c, -1) != NULL) abort();
    const kiln_ckpt_section *s;
    (void)kiln_ckpt_find(c, "step", KILN_CKPT_U64, &s);
    g_sink += strlen(kiln_ckpt_path(c)) + strlen(kiln_ckpt_rejected(c));
    kiln_ckpt_close(c);
    return 0;
}
