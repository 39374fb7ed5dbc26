/* test_metrics.c -- CRC-32 / Adler-32 vectors, the PNG container, the metrics CSV (round trip,
 * crash leftovers, resume cut, malformed input) and clear errors for unwritable paths. */
#include "train/metrics.h"
#include "test_util.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char tmpdir[256];

static void path_in(char *buf, size_t cap, const char *name) { snprintf(buf, cap, "%s/%s", tmpdir, name); }

static size_t live_bytes(void) {
    kiln_mem_stats s;
    kiln_mem_get_stats(&s);
    return s.live_bytes;
}

static uint8_t *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)sz + 1);
    if (b && fread(b, 1, (size_t)sz, f) != (size_t)sz) {
        free(b);
        b = NULL;
    }
    fclose(f);
    *n = (size_t)sz;
    return b;
}

static void spit(const char *path, const char *text, const char *mode) {
    FILE *f = fopen(path, mode);
    if (!f) return;
    fputs(text, f);
    fclose(f);
}

/* Bitwise CRC-32 (the definition, one bit at a time) and per-byte Adler-32 (the definition,
 * a modulo every byte): independent of the table and the deferred reduction under test. */
static uint32_t crc_ref(const uint8_t *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
    }
    return ~c;
}

static uint32_t adler_ref(const uint8_t *p, size_t n) {
    uint32_t a = 1, b = 0;
    for (size_t i = 0; i < n; i++) {
        a = (a + p[i]) % 65521u;
        b = (b + a) % 65521u;
    }
    return (b << 16) | a;
}

static void test_checksums(void) {
    CHECK(kiln_crc32(0, "", 0) == 0);
    CHECK(kiln_crc32(0, "123456789", 9) == 0xCBF43926u);
    CHECK(kiln_crc32(0, "The quick brown fox jumps over the lazy dog", 43) == 0x414FA339u);
    CHECK(kiln_crc32(0, "IEND", 4) == 0xAE426082u); /* the CRC every PNG ends with */
    CHECK(kiln_crc32(kiln_crc32(0, "1234", 4), "56789", 5) == 0xCBF43926u);
    CHECK(kiln_adler32(1, "", 0) == 1);
    CHECK(kiln_adler32(1, "Wikipedia", 9) == 0x11E60398u);
    CHECK(kiln_adler32(1, "abc", 3) == 0x024D0127u);
    CHECK(kiln_adler32(kiln_adler32(1, "Wiki", 4), "pedia", 5) == 0x11E60398u);
    /* long inputs of 0xFF bytes stress the deferred modulo (5552-byte rounds) */
    size_t n = 1 << 20;
    uint8_t *buf = malloc(n);
    for (size_t i = 0; i < n; i++) buf[i] = (uint8_t)(i < n / 2 ? 0xFF : (i * 2654435761u) >> 13);
    CHECK(kiln_adler32(1, buf, n) == adler_ref(buf, n));
    CHECK(kiln_crc32(0, buf, n) == crc_ref(buf, n));
    CHECK(kiln_adler32(kiln_adler32(1, buf, 7777), buf + 7777, n - 7777) == adler_ref(buf, n));
    free(buf);
}

static uint32_t be32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

/* Write an image whose raw stream spans several stored blocks, then parse the file by hand:
 * signature, chunk CRCs, IHDR, the stored blocks (LEN/NLEN, BFINAL on the last), Adler-32,
 * and the pixels. (tests/python/test_plot_png.py decodes with Python's zlib as well.) */
static void test_png_container(void) {
    const int w = 301, h = 157; /* raw = 157 * 904 = 141928 bytes: 3 stored blocks */
    uint8_t *img = malloc((size_t)w * h * 3);
    for (size_t i = 0; i < (size_t)w * h * 3; i++) img[i] = (uint8_t)(i * 7 + i / 991);
    char path[512];
    path_in(path, sizeof path, "c.png");
    CHECK(kiln_png_write_rgb(path, img, w, h) == KILN_OK);
    size_t n;
    uint8_t *f = slurp(path, &n);
    CHECK(f && n > 8 && memcmp(f, "\x89PNG\r\n\x1a\n", 8) == 0);
    if (!f) return;
    size_t pos = 8, raw_n = 0;
    int saw_ihdr = 0, saw_iend = 0, crc_ok = 1;
    uint8_t *z = malloc(n);
    size_t zn = 0;
    while (pos + 12 <= n) {
        uint32_t len = be32(f + pos);
        if (pos + 12 + len > n) break;
        const uint8_t *type = f + pos + 4, *data = f + pos + 8;
        crc_ok &= kiln_crc32(0, type, len + 4) == be32(data + len);
        crc_ok &= crc_ref(type, len + 4) == be32(data + len);
        if (!memcmp(type, "IHDR", 4)) {
            saw_ihdr = 1;
            CHECK(len == 13 && be32(data) == (uint32_t)w && be32(data + 4) == (uint32_t)h);
            CHECK(data[8] == 8 && data[9] == 2 && data[10] == 0 && data[11] == 0 && data[12] == 0);
        } else if (!memcmp(type, "IDAT", 4)) {
            memcpy(z + zn, data, len);
            zn += len;
        } else if (!memcmp(type, "IEND", 4)) {
            saw_iend = 1;
            CHECK(pos + 12 + len == n); /* nothing after IEND */
        }
        pos += 12 + len;
    }
    CHECK(saw_ihdr && saw_iend && crc_ok);
    CHECK(zn > 6 && z[0] == 0x78 && ((z[0] << 8) | z[1]) % 31 == 0);
    size_t rowb = 1 + 3 * (size_t)w;
    uint8_t *raw = malloc(rowb * h);
    size_t zp = 2;
    int blocks = 0, last = 0, blocks_ok = 1;
    while (!last && zp + 5 <= zn) {
        last = z[zp] & 1;
        blocks_ok &= (z[zp] >> 1) == 0; /* BTYPE 00 */
        uint32_t bl = z[zp + 1] | (uint32_t)z[zp + 2] << 8, nbl = z[zp + 3] | (uint32_t)z[zp + 4] << 8;
        blocks_ok &= (bl ^ 0xFFFFu) == nbl;
        zp += 5;
        if (zp + bl > zn || raw_n + bl > rowb * h) {
            blocks_ok = 0;
            break;
        }
        memcpy(raw + raw_n, z + zp, bl);
        raw_n += bl;
        zp += bl;
        blocks++;
    }
    CHECK(blocks_ok && last && blocks == 3 && raw_n == rowb * h);
    CHECK(zp + 4 == zn && be32(z + zp) == adler_ref(raw, raw_n));
    int pix_ok = 1;
    for (int y = 0; y < h && raw_n == rowb * h; y++) {
        pix_ok &= raw[y * rowb] == 0;
        pix_ok &= memcmp(raw + y * rowb + 1, img + (size_t)y * w * 3, (size_t)w * 3) == 0;
    }
    CHECK(pix_ok);
    free(raw);
    free(z);
    free(f);
    free(img);
    /* no temporary left beside it */
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%s.tmp-%ld", path, (long)getpid());
    CHECK(access(tmp, F_OK) != 0);
}

static int same_double(double a, double b) {
    return (isnan(a) && isnan(b)) || memcmp(&a, &b, sizeof a) == 0;
}

static void test_csv_round_trip(void) {
    char path[512];
    path_in(path, sizeof path, "m.csv");
    size_t base = live_bytes();
    static const double vals[][6] = {
        {10.8249998, NAN, 3e-4, 4.125, 1543.25, 0.25},
        {0.1, 2.5, 1e-300, 1e300, NAN, NAN},
        {-0.0, NAN, 5e-324, 1.7976931348623157e308, 123456789.123456789, 1.0 / 3.0},
        {NAN, NAN, NAN, NAN, NAN, NAN},
        {(double)3.14159274f, INFINITY, -INFINITY, 2.0 / 3.0, 1e-7, 86400.5},
    };
    static const uint64_t steps[] = {1, 2, 1000000, UINT64_MAX, 0};
    const size_t R = sizeof steps / sizeof steps[0];
    kiln_metrics *m = NULL;
    CHECK(kiln_metrics_open(path, &m) == KILN_OK);
    for (size_t i = 0; i < R; i++) {
        kiln_metrics_values v = kiln_metrics_values_empty();
        v.step = steps[i];
        v.loss = vals[i][0];
        v.eval_loss = vals[i][1];
        v.lr = vals[i][2];
        v.grad_norm = vals[i][3];
        v.tokens_per_s = vals[i][4];
        v.elapsed_s = vals[i][5];
        CHECK(kiln_metrics_row(m, &v) == KILN_OK);
        if (i == 1) {
            /* flushed every row: a reader sees the rows so far while the writer is open */
            kiln_metrics_log mid;
            CHECK(kiln_metrics_read(path, &mid) == KILN_OK);
            CHECK(mid.n == 2);
            kiln_metrics_log_free(&mid);
        }
    }
    CHECK(kiln_metrics_close(m) == KILN_OK);
    size_t n;
    char *text = (char *)slurp(path, &n);
    CHECK(text && n > 60 && !strncmp(text, KILN_METRICS_HEADER "\n1,10.8249998,,0.0003,4.125,1543.25,0.25\n",
                                     sizeof KILN_METRICS_HEADER + 39));
    CHECK(text && strstr(text, "\n2,0.1,2.5,1e-300,1e+300,,\n"));
    free(text);

    kiln_metrics_log log;
    CHECK(kiln_metrics_read(path, &log) == KILN_OK);
    CHECK(log.n == R);
    int exact = 1;
    for (size_t i = 0; i < R && log.n == R; i++) {
        exact &= log.step[i] == steps[i];
        exact &= same_double(log.loss[i], vals[i][0]) && same_double(log.eval_loss[i], vals[i][1]);
        exact &= same_double(log.lr[i], vals[i][2]) && same_double(log.grad_norm[i], vals[i][3]);
        exact &= same_double(log.tokens_per_s[i], vals[i][4]) && same_double(log.elapsed_s[i], vals[i][5]);
    }
    CHECK_MSG(exact, "values differ after the round trip");
    kiln_metrics_log_free(&log);
    CHECK(live_bytes() == base);
}

/* A crash mid-row leaves a partial last line: the reader ignores it; a resume from step k
 * cuts it and every row past k, then appends. */
static void test_csv_crash_and_resume(void) {
    char path[512];
    path_in(path, sizeof path, "r.csv");
    kiln_metrics *m = NULL;
    CHECK(kiln_metrics_open(path, &m) == KILN_OK);
    for (uint64_t s = 1; s <= 10; s++) {
        kiln_metrics_values v = kiln_metrics_values_empty();
        v.step = s;
        v.loss = 5.0 - 0.25 * (double)s;
        if (s % 5 == 0) v.eval_loss = 5.5 - 0.25 * (double)s;
        CHECK(kiln_metrics_row(m, &v) == KILN_OK);
    }
    CHECK(kiln_metrics_close(m) == KILN_OK);
    spit(path, "11,2.2", "a"); /* the process died while writing step 11 */

    kiln_metrics_log log;
    CHECK(kiln_metrics_read(path, &log) == KILN_OK);
    CHECK(log.n == 10 && log.step[9] == 10 && log.eval_loss[9] == 3.0 && isnan(log.eval_loss[8]));
    kiln_metrics_log_free(&log);

    /* the last checkpoint was step 7: steps 8..10 are redone by the resumed run */
    CHECK(kiln_metrics_open_resume(path, 7, &m) == KILN_OK);
    for (uint64_t s = 8; s <= 12; s++) {
        kiln_metrics_values v = kiln_metrics_values_empty();
        v.step = s;
        v.loss = 100.0 + (double)s; /* distinguishable from the first run */
        CHECK(kiln_metrics_row(m, &v) == KILN_OK);
    }
    CHECK(kiln_metrics_close(m) == KILN_OK);
    CHECK(kiln_metrics_read(path, &log) == KILN_OK);
    int ok = log.n == 12;
    for (size_t i = 0; i < log.n && ok; i++) {
        ok &= log.step[i] == i + 1;
        ok &= log.loss[i] == (i + 1 <= 7 ? 5.0 - 0.25 * (double)(i + 1) : 100.0 + (double)(i + 1));
    }
    CHECK_MSG(ok, "resumed CSV has %zu rows, expected steps 1..7 then 8..12 of the new run", log.n);
    kiln_metrics_log_free(&log);

    /* resume past every row keeps them all; resume of a missing file creates it */
    CHECK(kiln_metrics_open_resume(path, 1000, &m) == KILN_OK);
    CHECK(kiln_metrics_close(m) == KILN_OK);
    CHECK(kiln_metrics_read(path, &log) == KILN_OK && log.n == 12);
    kiln_metrics_log_free(&log);
    char fresh[512];
    path_in(fresh, sizeof fresh, "fresh.csv");
    CHECK(kiln_metrics_open_resume(fresh, 5, &m) == KILN_OK);
    CHECK(kiln_metrics_close(m) == KILN_OK);
    CHECK(kiln_metrics_read(fresh, &log) == KILN_OK && log.n == 0);
    kiln_metrics_log_free(&log);
    /* a header cut short by a crash: start over */
    spit(fresh, "step,loss,ev", "w");
    CHECK(kiln_metrics_open_resume(fresh, 5, &m) == KILN_OK);
    CHECK(kiln_metrics_close(m) == KILN_OK);
    CHECK(kiln_metrics_read(fresh, &log) == KILN_OK && log.n == 0);
    kiln_metrics_log_free(&log);
}

static void test_csv_malformed(void) {
    char path[512];
    path_in(path, sizeof path, "bad.csv");
    kiln_metrics_log log;
    kiln_metrics *m = NULL;
    spit(path, "step,loss\n1,2\n", "w");
    CHECK_ERR(kiln_metrics_read(path, &log), KILN_ERR_FORMAT, "line 1: not a kiln metrics CSV");
    CHECK_ERR(kiln_metrics_open_resume(path, 3, &m), KILN_ERR_FORMAT, "not a kiln metrics CSV");
    CHECK(m == NULL);
    spit(path, KILN_METRICS_HEADER "\n1,2,,,,,\n2,abc,,,,,\n", "w");
    CHECK_ERR(kiln_metrics_read(path, &log), KILN_ERR_FORMAT, "line 3: column loss: 'abc' is not a number");
    spit(path, KILN_METRICS_HEADER "\n1,2,,,,\n", "w");
    CHECK_ERR(kiln_metrics_read(path, &log), KILN_ERR_FORMAT, "line 2: 6 cells, expected 7");
    spit(path, KILN_METRICS_HEADER "\n1,2,,,,,,\n", "w");
    CHECK_ERR(kiln_metrics_read(path, &log), KILN_ERR_FORMAT, "line 2: more than 7 cells");
    spit(path, KILN_METRICS_HEADER "\n-1,2,,,,,\n", "w");
    CHECK_ERR(kiln_metrics_read(path, &log), KILN_ERR_FORMAT, "column step: '-1' is not an unsigned integer");
    spit(path, KILN_METRICS_HEADER "\n99999999999999999999,2,,,,,\n", "w");
    CHECK_ERR(kiln_metrics_read(path, &log), KILN_ERR_FORMAT, "is not an unsigned integer");
    spit(path, "", "w");
    CHECK_ERR(kiln_metrics_read(path, &log), KILN_ERR_FORMAT, "not a kiln metrics CSV");
    char missing[512];
    path_in(missing, sizeof missing, "missing.csv");
    CHECK_ERR(kiln_metrics_read(missing, &log), KILN_ERR_IO, "missing.csv");
}

static void test_write_errors(void) {
    const char *bad_png = "/nonexistent-kiln-dir/plot.png";
    const char *bad_csv = "/nonexistent-kiln-dir/metrics.csv";
    kiln_metrics *m = (kiln_metrics *)1;
    CHECK_ERR(kiln_metrics_open(bad_csv, &m), KILN_ERR_IO, bad_csv);
    CHECK(m == NULL);
    CHECK(strstr(kiln_last_error(), strerror(ENOENT)) != NULL);
    uint8_t px[3 * 4] = {0};
    CHECK_ERR(kiln_png_write_rgb(bad_png, px, 2, 2), KILN_ERR_IO, bad_png);
    CHECK(strstr(kiln_last_error(), strerror(ENOENT)) != NULL);
    double x[2] = {1, 2}, y[2] = {3, 2};
    kiln_plot_series s = {"train", 0x1F77B4u, x, y, 2};
    CHECK_ERR(kiln_plot_write_png(bad_png, 800, 500, "t", &s, 1), KILN_ERR_IO, bad_png);

    /* a directory in the way: the rename fails, the error names the path, the temporary goes */
    char dir[512], tmp[600];
    path_in(dir, sizeof dir, "adir.png");
    mkdir(dir, 0755);
    CHECK_ERR(kiln_plot_write_png(dir, 800, 500, "t", &s, 1), KILN_ERR_IO, dir);
    snprintf(tmp, sizeof tmp, "%s.tmp-%ld", dir, (long)getpid());
    CHECK(access(tmp, F_OK) != 0);
    rmdir(dir);

    /* a full disk: rows fail with the errno text, later rows are refused */
    if (access("/dev/full", W_OK) == 0) {
        CHECK_ERR(kiln_metrics_open("/dev/full", &m), KILN_ERR_IO, "/dev/full: write failed");
        CHECK(strstr(kiln_last_error(), strerror(ENOSPC)) != NULL);
    }

    /* bad arguments */
    CHECK_ERR(kiln_plot_write_png("/tmp/x.png", 100, 500, "t", &s, 1), KILN_ERR_INVALID_ARG, "100x500");
    kiln_plot_series nul = {"train", 0, NULL, y, 2};
    CHECK_ERR(kiln_plot_write_png("/tmp/x.png", 800, 500, "t", &nul, 1), KILN_ERR_INVALID_ARG, "NULL x or y");
    CHECK_ERR(kiln_png_write_rgb("/tmp/x.png", px, 0, 2), KILN_ERR_INVALID_ARG, "0x2");
    CHECK_ERR(kiln_metrics_row(NULL, NULL), KILN_ERR_INVALID_ARG, "NULL");
    CHECK(kiln_metrics_close(NULL) == KILN_OK);
}

/* Failing each allocation in turn gives KILN_ERR_NOMEM and leaks nothing. */
static int fail_at = -1, n_calls = 0;
static void *failing_alloc(size_t size, void *user) {
    (void)user;
    if (n_calls++ == fail_at) return NULL;
    return malloc(size);
}
static void failing_free(void *p, void *user) {
    (void)user;
    free(p);
}

static void test_alloc_failures(void) {
    char csv[512], png[512];
    path_in(csv, sizeof csv, "r.csv"); /* written by test_csv_crash_and_resume */
    path_in(png, sizeof png, "af.png");
    kiln_allocator a = {failing_alloc, failing_free, NULL};
    CHECK(kiln_set_allocator(&a) == KILN_OK);
    int saw_ok = 0, bad = 0;
    for (fail_at = 0; fail_at < 40 && !saw_ok; fail_at++) {
        n_calls = 0;
        size_t base = live_bytes();
        kiln_status st = kiln_metrics_plot(csv, png, 320, 200, "alloc");
        if (st == KILN_OK) saw_ok = 1;
        else if (st != KILN_ERR_NOMEM) bad++;
        if (live_bytes() != base) bad++;
    }
    fail_at = -1;
    CHECK(kiln_set_allocator(NULL) == KILN_OK);
    CHECK(saw_ok && bad == 0);
}

int main(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kiln_test_metrics_%ld", (long)getpid());
    mkdir(tmpdir, 0755);
    test_checksums();
    test_png_container();
    test_csv_round_trip();
    test_csv_crash_and_resume();
    test_csv_malformed();
    test_write_errors();
    test_alloc_failures();
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
    return test_finish("test_metrics");
}
