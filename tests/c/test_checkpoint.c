/* test_checkpoint.c -- the KILNCKPT container: round trip, every corruption detected, hostile
 * tables with valid checksums, the marker protocol, retention, and write failures at every
 * I/O operation of a save (fault hook) and on a real full filesystem (tmpfs, when mountable). */
#include "test_util.h"
#include "train/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char g_root[256];

static void sh(const char *fmt, const char *a) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, fmt, a);
    if (system(cmd) != 0) fprintf(stderr, "command failed: %s\n", cmd);
}

static void mkdir_fresh(char *out, size_t cap, const char *name) {
    snprintf(out, cap, "%s/%s", g_root, name);
    sh("rm -rf '%s'", out);
    mkdir(out, 0755);
}

static uint8_t *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)sz + 1);
    *n = fread(b, 1, (size_t)sz, f);
    fclose(f);
    return b;
}

static void write_file(const char *path, const uint8_t *b, size_t n) {
    FILE *f = fopen(path, "wb");
    fwrite(b, 1, n, f);
    fclose(f);
}

/* A standard checkpoint of `step`: the sections a trainer writes. */
static float g_w[3 * 4];
static uint8_t g_blob[1000];

static kiln_status save_std(const char *dir, uint64_t step, int keep_last) {
    kiln_ckpt_save_params p = kiln_ckpt_default_save_params();
    p.keep_last = keep_last;
    kiln_ckpt_writer *w;
    KILN_TRY(kiln_ckpt_begin(dir, step, &p, &w));
    for (int i = 0; i < 12; i++) g_w[i] = (float)step + 0.25f * (float)i;
    for (int i = 0; i < 1000; i++) g_blob[i] = (uint8_t)(i * 7 + step);
    int64_t shape[2] = {3, 4};
    kiln_status st;
    if ((st = kiln_ckpt_add_json(w, "config", "{\"n_layer\": 2}")) != KILN_OK ||
        (st = kiln_ckpt_add_tensor(w, "param/model.embed_tokens.weight", KILN_DTYPE_F32, 2, shape, g_w)) != KILN_OK ||
        (st = kiln_ckpt_section_begin(w, "optimizer", KILN_CKPT_RAW)) != KILN_OK ||
        (st = kiln_ckpt_section_write(w, g_blob, 300)) != KILN_OK ||
        (st = kiln_ckpt_section_write(w, g_blob + 300, 700)) != KILN_OK ||
        (st = kiln_ckpt_section_end(w)) != KILN_OK || (st = kiln_ckpt_add_u64(w, "step", step)) != KILN_OK ||
        (st = kiln_ckpt_add_section(w, "rng", KILN_CKPT_RAW, "seed", 4)) != KILN_OK) {
        kiln_ckpt_abort(w);
        return st;
    }
    return kiln_ckpt_commit(w, NULL);
}

/* Names in dir other than complete step-<k> directories (tmp dirs, unmarked dirs). */
static int count_debris(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    struct dirent *de;
    int n = 0;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.') continue;
        char p[512];
        snprintf(p, sizeof p, "%s/%s/COMPLETE", dir, de->d_name);
        if (strchr(de->d_name, '.') || access(p, F_OK) != 0) n++;
    }
    closedir(d);
    return n;
}

static void test_round_trip(void) {
    char dir[512];
    mkdir_fresh(dir, sizeof dir, "rt");
    CHECK(save_std(dir, 7, 0) == KILN_OK);
    kiln_ckpt *c = NULL;
    CHECK(kiln_ckpt_open_latest(dir, &c) == KILN_OK);
    if (!c) return;
    CHECK(kiln_ckpt_step(c) == 7);
    CHECK(kiln_ckpt_section_count(c) == 5);
    CHECK(strcmp(kiln_ckpt_rejected(c), "") == 0);
    const kiln_ckpt_section *s;
    CHECK(kiln_ckpt_find(c, "param/model.embed_tokens.weight", KILN_CKPT_TENSOR, &s) == KILN_OK);
    CHECK(s && s->dtype == KILN_DTYPE_F32 && s->n_dims == 2 && s->shape[0] == 3 && s->shape[1] == 4 &&
          s->size == 48 && memcmp(s->data, g_w, 48) == 0 && ((uintptr_t)s->data % 64) == 0);
    CHECK(kiln_ckpt_find(c, "optimizer", KILN_CKPT_RAW, &s) == KILN_OK);
    CHECK(s && s->size == 1000 && memcmp(s->data, g_blob, 1000) == 0);
    CHECK(kiln_ckpt_find(c, "config", KILN_CKPT_JSON, &s) == KILN_OK);
    CHECK(s && s->size == 14 && memcmp(s->data, "{\"n_layer\": 2}", 14) == 0);
    uint64_t v = 0;
    CHECK(kiln_ckpt_get_u64(c, "step", &v) == KILN_OK && v == 7);
    CHECK_ERR(kiln_ckpt_find(c, "nope", 0, &s), KILN_ERR_FORMAT, "missing section 'nope'");
    CHECK_ERR(kiln_ckpt_find(c, "rng", KILN_CKPT_JSON, &s), KILN_ERR_FORMAT, "has type");
    CHECK(kiln_ckpt_section_at(c, 5) == NULL && kiln_ckpt_section_at(c, 0) != NULL);
    kiln_ckpt_close(c);
    CHECK(count_debris(dir) == 0);

    /* writer argument errors */
    kiln_ckpt_writer *w;
    CHECK_ERR(kiln_ckpt_begin(dir, 7, NULL, &w), KILN_ERR_STATE, "already exists");
    CHECK(kiln_ckpt_begin(dir, 8, NULL, &w) == KILN_OK);
    CHECK_ERR(kiln_ckpt_add_u64(w, "bad name", 1), KILN_ERR_INVALID_ARG, "outside");
    CHECK_ERR(kiln_ckpt_add_u64(w, "", 1), KILN_ERR_INVALID_ARG, "empty");
    CHECK(kiln_ckpt_add_u64(w, "a", 1) == KILN_OK);
    CHECK_ERR(kiln_ckpt_add_u64(w, "a", 1), KILN_ERR_INVALID_ARG, "duplicate");
    int64_t shape[1] = {10};
    CHECK_ERR(kiln_ckpt_add_tensor(w, "q", KILN_DTYPE_Q8_0, 1, shape, g_blob), KILN_ERR_INVALID_ARG,
              "not a valid size");
    CHECK(kiln_ckpt_section_begin(w, "u", KILN_CKPT_U64) == KILN_OK);
    CHECK_ERR(kiln_ckpt_section_write(w, g_blob, 9), KILN_ERR_INVALID_ARG, "more data");
    CHECK_ERR(kiln_ckpt_section_end(w), KILN_ERR_INVALID_ARG, "0 bytes written, 8 expected");
    CHECK_ERR(kiln_ckpt_commit(w, NULL), KILN_ERR_STATE, "section 'u' is open");
    CHECK(count_debris(dir) == 0);
    uint64_t *steps;
    size_t n;
    CHECK(kiln_ckpt_list(dir, &steps, &n) == KILN_OK && n == 1 && steps[0] == 7);
    kiln_free(steps);
    CHECK_ERR(kiln_ckpt_open_latest("/nonexistent/kiln", &c), KILN_ERR_IO, "/nonexistent/kiln");
}

/* Offsets of each section's data in the file, from the table. */
static int section_offsets(const uint8_t *b, uint64_t *off, uint64_t *size, int max) {
    uint32_t n;
    uint64_t t;
    memcpy(&n, b + 24, 4);
    memcpy(&t, b + 32, 8);
    for (uint32_t i = 0; i < n && (int)i < max; i++) {
        memcpy(&off[i], b + t + 256 * i + 176, 8);
        memcpy(&size[i], b + t + 256 * i + 184, 8);
    }
    return (int)n;
}

/* Recompute the table and header checksums after editing the table (hostile but sealed). */
static void reseal(uint8_t *b) {
    uint32_t n;
    uint64_t t;
    memcpy(&n, b + 24, 4);
    memcpy(&t, b + 32, 8);
    kiln_sha256(b + t, (size_t)n * 256, b + 48);
    kiln_sha256(b, 96, b + 96);
}

static void test_corruption(void) {
    char dir[512], path[600];
    mkdir_fresh(dir, sizeof dir, "corrupt");
    CHECK(save_std(dir, 1, 0) == KILN_OK);
    CHECK(save_std(dir, 2, 0) == KILN_OK);
    snprintf(path, sizeof path, "%s/step-2/state.kiln", dir);
    size_t n;
    uint8_t *orig = read_file(path, &n);
    uint8_t *b = malloc(n);
    uint64_t off[8], size[8];
    int ns = section_offsets(orig, off, size, 8);
    CHECK(ns == 5);
    const char *names[5] = {"config", "param/model.embed_tokens.weight", "optimizer", "step", "rng"};
    kiln_ckpt *c;
    for (int i = 0; i < ns; i++) {
        memcpy(b, orig, n);
        b[off[i] + size[i] / 2] ^= 0x10;
        write_file(path, b, n);
        char want[200];
        snprintf(want, sizeof want, "section '%s'", names[i]);
        CHECK_ERR(kiln_ckpt_open_file(path, &c), KILN_ERR_FORMAT, want);
        CHECK(strstr(kiln_last_error(), "checksum mismatch") != NULL);
        /* the loader falls back to step 1 and says why */
        c = NULL;
        CHECK(kiln_ckpt_open_latest(dir, &c) == KILN_OK && c && kiln_ckpt_step(c) == 1);
        if (c) CHECK(strstr(kiln_ckpt_rejected(c), "checksum mismatch") != NULL);
        kiln_ckpt_close(c);
    }
    /* every single byte of the header and the table matters */
    uint64_t t;
    memcpy(&t, orig + 32, 8);
    int undetected = 0;
    for (size_t i = 0; i < n; i += (i < 128 || i >= t) ? 1 : 13) {
        memcpy(b, orig, n);
        b[i] ^= 0x01;
        write_file(path, b, n);
        if (kiln_ckpt_open_file(path, &c) == KILN_OK) {
            undetected++;
            kiln_ckpt_close(c);
        }
    }
    CHECK_MSG(undetected == 0, "%d single-bit flips undetected", undetected);
    /* truncation at many lengths */
    int trunc_ok = 0;
    for (size_t len = 0; len < n; len += (len < 256 ? 1 : 61)) {
        write_file(path, orig, len);
        if (kiln_ckpt_open_file(path, &c) == KILN_OK) {
            trunc_ok++;
            kiln_ckpt_close(c);
        }
    }
    CHECK(trunc_ok == 0);
    write_file(path, orig, 100);
    CHECK_ERR(kiln_ckpt_open_file(path, &c), KILN_ERR_FORMAT, "shorter than the 128-byte header");
    write_file(path, orig, n - 256);
    CHECK_ERR(kiln_ckpt_open_file(path, &c), KILN_ERR_FORMAT, "truncated or extended");
    /* magic, version */
    memcpy(b, orig, n);
    memcpy(b, "KILNCKPX", 8);
    write_file(path, b, n);
    CHECK_ERR(kiln_ckpt_open_file(path, &c), KILN_ERR_FORMAT, "bad magic");
    memcpy(b, orig, n);
    b[8] = 2;
    write_file(path, b, n);
    CHECK_ERR(kiln_ckpt_open_file(path, &c), KILN_ERR_UNSUPPORTED, "version 2");

    /* hostile tables with valid checksums */
    struct {
        int entry, field, width;
        uint64_t value;
        const char *needle;
    } cases[] = {
        {1, 176, 8, 128, "misaligned, overlaps"},          /* overlaps section 0 */
        {1, 176, 8, 1000, "misaligned"},                   /* not a multiple of 64 */
        {4, 184, 8, 1ull << 40, "runs past the data area"}, /* size past the table */
        {4, 184, 8, UINT64_MAX, "runs past"},              /* offset + size overflows */
        {0, 128, 4, 9, "unknown type 9"},
        {3, 184, 8, 16, "u64 section of 16"},
        {1, 144, 8, 5, "do not give its size"},            /* shape[0] 3 -> 5 */
        {1, 152 + 16, 8, 2, "do not give its size"},       /* unused dim shape[3] = 2 */
        {1, 132, 4, 99, "out of range"},                   /* dtype */
        {1, 136, 4, 0, "out of range"},                    /* n_dims */
        {0, 132, 4, 1, "non-tensor"},
        {2, 140, 4, 1, "reserved"},
        {2, 230, 1, 1, "reserved"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        memcpy(b, orig, n);
        uint8_t *e = b + t + 256 * cases[k].entry + cases[k].field;
        memcpy(e, &cases[k].value, (size_t)cases[k].width);
        reseal(b);
        write_file(path, b, n);
        CHECK_ERR(kiln_ckpt_open_file(path, &c), KILN_ERR_FORMAT, cases[k].needle);
    }
    /* names: duplicate, unterminated, bad byte, junk after NUL */
    memcpy(b, orig, n);
    memcpy(b + t + 256 * 4, "step\0\0\0", 7);
    reseal(b);
    write_file(path, b, n);
    CHECK_ERR(kiln_ckpt_open_file(path, &c), KILN_ERR_FORMAT, "duplicate section name 'step'");
    memcpy(b, orig, n);
    memset(b + t, 'a', 128);
    reseal(b);
    write_file(path, b, n);
    CHECK_ERR(kiln_ckpt_open_file(path, &c), KILN_ERR_FORMAT, "not NUL-terminated");
    memcpy(b, orig, n);
    b[t] = ' ';
    reseal(b);
    write_file(path, b, n);
    CHECK_ERR(kiln_ckpt_open_file(path, &c), KILN_ERR_FORMAT, "outside");
    memcpy(b, orig, n);
    b[t + 100] = 'x';
    reseal(b);
    write_file(path, b, n);
    CHECK_ERR(kiln_ckpt_open_file(path, &c), KILN_ERR_FORMAT, "after the name's NUL");
    /* huge section count */
    memcpy(b, orig, n);
    uint32_t big = 0xffffffffu;
    memcpy(b + 24, &big, 4);
    kiln_sha256(b, 96, b + 96); /* header only: the size check comes before the table */
    write_file(path, b, n);
    CHECK_ERR(kiln_ckpt_open_file(path, &c), KILN_ERR_FORMAT, "does not end at the file size");

    /* a marker that names another file is stale */
    write_file(path, orig, n);
    char mpath[600];
    snprintf(mpath, sizeof mpath, "%s/step-1/COMPLETE", dir);
    size_t mn;
    uint8_t *m1 = read_file(mpath, &mn);
    snprintf(mpath, sizeof mpath, "%s/step-2/COMPLETE", dir);
    write_file(mpath, m1, mn);
    CHECK_ERR(kiln_ckpt_open_step(dir, 2, &c), KILN_ERR_FORMAT, "marker does not match");
    c = NULL;
    CHECK(kiln_ckpt_open_latest(dir, &c) == KILN_OK && c && kiln_ckpt_step(c) == 1);
    kiln_ckpt_close(c);
    free(m1);
    free(orig);
    free(b);
}

static void test_marker_and_retention(void) {
    char dir[512], p[600];
    mkdir_fresh(dir, sizeof dir, "marker");
    CHECK(save_std(dir, 1, 0) == KILN_OK);
    CHECK(save_std(dir, 2, 0) == KILN_OK);
    /* a crash between rename and marker: step-2 without COMPLETE */
    snprintf(p, sizeof p, "%s/step-2/COMPLETE", dir);
    unlink(p);
    kiln_ckpt *c = NULL;
    CHECK(kiln_ckpt_open_latest(dir, &c) == KILN_OK && c && kiln_ckpt_step(c) == 1);
    if (c) CHECK(strstr(kiln_ckpt_rejected(c), "no COMPLETE marker") != NULL);
    kiln_ckpt_close(c);
    uint64_t *steps;
    size_t n;
    CHECK(kiln_ckpt_list(dir, &steps, &n) == KILN_OK && n == 1 && steps[0] == 1);
    kiln_free(steps);
    /* a tmp dir of a dead writer is never loaded and is cleaned by the next save */
    pid_t child = fork();
    if (child == 0) _exit(0);
    waitpid(child, NULL, 0);
    snprintf(p, sizeof p, "%s/step-9.tmp-%ld", dir, (long)child);
    mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/step-9.tmp-%ld/state.kiln", dir, (long)child);
    write_file(p, (const uint8_t *)"junk", 4);
    CHECK(kiln_ckpt_open_latest(dir, &c) == KILN_OK && c && kiln_ckpt_step(c) == 1);
    kiln_ckpt_close(c);
    /* re-saving step 2 replaces the unmarked directory */
    CHECK(save_std(dir, 2, 0) == KILN_OK);
    CHECK(count_debris(dir) == 0);
    CHECK(kiln_ckpt_open_latest(dir, &c) == KILN_OK && c && kiln_ckpt_step(c) == 2);
    kiln_ckpt_close(c);
    /* retention */
    for (uint64_t s = 3; s <= 7; s++) CHECK(save_std(dir, s, 3) == KILN_OK);
    CHECK(kiln_ckpt_list(dir, &steps, &n) == KILN_OK && n == 3 && steps[0] == 5 && steps[2] == 7);
    kiln_free(steps);
    CHECK(count_debris(dir) == 0);
    /* an empty directory, and one with only broken checkpoints */
    mkdir_fresh(dir, sizeof dir, "empty");
    CHECK_ERR(kiln_ckpt_open_latest(dir, &c), KILN_ERR_IO, "no checkpoint");
    CHECK(save_std(dir, 1, 0) == KILN_OK);
    snprintf(p, sizeof p, "%s/step-1/state.kiln", dir);
    write_file(p, (const uint8_t *)"KILNCKPT", 8);
    CHECK_ERR(kiln_ckpt_open_latest(dir, &c), KILN_ERR_FORMAT, "no valid checkpoint among 1");
}

/* The name of the one "step-<step>.rejected-*" entry of dir in out (0 if none; -1 if several). */
static int find_set_aside(const char *dir, uint64_t step, char *out, size_t cap) {
    char prefix[64];
    snprintf(prefix, sizeof prefix, "step-%llu.rejected-", (unsigned long long)step);
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *de;
    int n = 0;
    while ((de = readdir(d)) != NULL)
        if (!strncmp(de->d_name, prefix, strlen(prefix))) {
            snprintf(out, cap, "%s/%s", dir, de->d_name);
            n++;
        }
    closedir(d);
    return n > 1 ? -1 : n;
}

/* Issue 34 item 1: a newest checkpoint that is complete but damaged is set aside on resume
 * (with a REASON file), so the run can save that step again; issue 34 item 6: the header's
 * step is range-checked. */
static void test_set_aside(void) {
    char dir[512], path[600], aside[700], p[800];
    mkdir_fresh(dir, sizeof dir, "aside");
    CHECK(save_std(dir, 1, 0) == KILN_OK);
    CHECK(save_std(dir, 2, 0) == KILN_OK);
    snprintf(path, sizeof path, "%s/step-2/state.kiln", dir);
    size_t n;
    uint8_t *orig = read_file(path, &n);
    uint8_t *b = malloc(n);
    memcpy(b, orig, n);
    b[200] ^= 0x04; /* inside section 0's data */
    write_file(path, b, n);
    /* the read-only loader passes over it and leaves it: the wedge this fixes */
    kiln_ckpt *c = NULL;
    CHECK(kiln_ckpt_open_latest(dir, &c) == KILN_OK && c && kiln_ckpt_step(c) == 1);
    kiln_ckpt_close(c);
    kiln_ckpt_writer *w;
    CHECK_ERR(kiln_ckpt_begin(dir, 2, NULL, &w), KILN_ERR_STATE, "already exists");
    /* resuming sets it aside, says so, and the save of step 2 then succeeds */
    c = NULL;
    CHECK(kiln_ckpt_open_for_resume(dir, &c) == KILN_OK && c && kiln_ckpt_step(c) == 1);
    if (c) {
        CHECK(strstr(kiln_ckpt_rejected(c), "checksum mismatch") != NULL);
        CHECK(strstr(kiln_ckpt_rejected(c), "[set aside as ") != NULL);
    }
    kiln_ckpt_close(c);
    CHECK(find_set_aside(dir, 2, aside, sizeof aside) == 1);
    snprintf(p, sizeof p, "%s/REASON", aside);
    size_t rn = 0;
    char *reason = (char *)read_file(p, &rn);
    CHECK(reason != NULL);
    if (reason) {
        reason[rn] = 0;
        CHECK(strstr(reason, "checksum mismatch") && strstr(reason, "step 2 aside"));
    }
    free(reason);
    snprintf(p, sizeof p, "%s/state.kiln", aside); /* kept, not deleted */
    CHECK(access(p, F_OK) == 0);
    uint64_t *steps;
    size_t ns;
    CHECK(kiln_ckpt_list(dir, &steps, &ns) == KILN_OK && ns == 1 && steps[0] == 1);
    kiln_free(steps);
    CHECK(save_std(dir, 2, 1) == KILN_OK); /* housekeeping keeps the set-aside directory too */
    c = NULL;
    CHECK(kiln_ckpt_open_for_resume(dir, &c) == KILN_OK && c && kiln_ckpt_step(c) == 2);
    if (c) CHECK(strcmp(kiln_ckpt_rejected(c), "") == 0);
    kiln_ckpt_close(c);
    CHECK(find_set_aside(dir, 2, aside, sizeof aside) == 1);

    /* a stale marker is set aside too; an unmarked directory is only passed over */
    CHECK(save_std(dir, 3, 0) == KILN_OK);
    CHECK(save_std(dir, 4, 0) == KILN_OK);
    snprintf(p, sizeof p, "%s/step-4/COMPLETE", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/step-3/COMPLETE", dir);
    write_file(p, (const uint8_t *)"KILNCKPT-COMPLETE step 3 header-sha256 00\n", 42);
    c = NULL;
    CHECK(kiln_ckpt_open_for_resume(dir, &c) == KILN_OK && c && kiln_ckpt_step(c) == 2);
    if (c) CHECK(strstr(kiln_ckpt_rejected(c), "no COMPLETE marker") && strstr(kiln_ckpt_rejected(c), "stale"));
    kiln_ckpt_close(c);
    CHECK(find_set_aside(dir, 3, aside, sizeof aside) == 1 && find_set_aside(dir, 4, aside, sizeof aside) == 0);
    snprintf(p, sizeof p, "%s/step-4", dir);
    CHECK(access(p, F_OK) == 0);

    /* a newer version is not "damaged": the resume stops and nothing moves */
    mkdir_fresh(dir, sizeof dir, "aside2");
    CHECK(save_std(dir, 1, 0) == KILN_OK);
    CHECK(save_std(dir, 2, 0) == KILN_OK);
    snprintf(path, sizeof path, "%s/step-2/state.kiln", dir);
    memcpy(b, orig, n);
    b[8] = 2;
    write_file(path, b, n);
    CHECK_ERR(kiln_ckpt_open_for_resume(dir, &c), KILN_ERR_UNSUPPORTED, "cannot resume");
    CHECK(strstr(kiln_last_error(), "version 2") != NULL);
    CHECK(find_set_aside(dir, 2, aside, sizeof aside) == 0);
    /* nothing valid at all: the error lists why, nothing is moved */
    memcpy(b, orig, n);
    b[200] ^= 0x04;
    write_file(path, b, n);
    snprintf(p, sizeof p, "%s/step-1/state.kiln", dir);
    write_file(p, b, 100);
    CHECK_ERR(kiln_ckpt_open_for_resume(dir, &c), KILN_ERR_FORMAT, "no valid checkpoint among 2");
    CHECK(find_set_aside(dir, 2, aside, sizeof aside) == 0 && find_set_aside(dir, 1, aside, sizeof aside) == 0);
    CHECK_ERR(kiln_ckpt_set_aside(dir, 9, "x", NULL), KILN_ERR_IO, "no such checkpoint directory");

    /* the header's step is range-checked on read and on write */
    memcpy(b, orig, n);
    uint64_t huge = UINT64_MAX;
    memcpy(b + 16, &huge, 8);
    kiln_sha256(b, 96, b + 96);
    write_file(path, b, n);
    CHECK_ERR(kiln_ckpt_open_file(path, &c), KILN_ERR_FORMAT, "header step 18446744073709551615 is out of range");
    CHECK_ERR(kiln_ckpt_begin(dir, UINT64_MAX, NULL, &w), KILN_ERR_INVALID_ARG, "past the largest step");
    free(orig);
    free(b);
}

/* ---- write failures ----------------------------------------------------------------------- */

static int g_fail_at, g_calls, g_fail_errno;
static int fail_nth(kiln_ckpt_io_op op, const char *path, void *user) {
    (void)op, (void)path, (void)user;
    return g_calls++ == g_fail_at ? g_fail_errno : 0;
}

static void test_fault_sweep(void) {
    char dir[512];
    mkdir_fresh(dir, sizeof dir, "faults");
    CHECK(save_std(dir, 1, 2) == KILN_OK);
    int failures_seen = 0;
    for (g_fail_at = 0; g_fail_at < 200; g_fail_at++) {
        g_calls = 0;
        g_fail_errno = (g_fail_at % 2) ? EIO : ENOSPC;
        kiln_ckpt_set_fault_hook(fail_nth, NULL);
        kiln_status st = save_std(dir, 2, 2);
        kiln_ckpt_set_fault_hook(NULL, NULL);
        if (st == KILN_OK) break; /* past the last I/O operation */
        failures_seen++;
        CHECK_MSG(st == KILN_ERR_IO && strstr(kiln_last_error(), strerror(g_fail_errno)) &&
                      strstr(kiln_last_error(), dir),
                  "fault %d: status %d '%s'", g_fail_at, (int)st, kiln_last_error());
        CHECK_MSG(count_debris(dir) == 0, "fault %d left debris", g_fail_at);
        kiln_ckpt *c = NULL;
        CHECK(kiln_ckpt_open_latest(dir, &c) == KILN_OK && c && kiln_ckpt_step(c) == 1);
        kiln_ckpt_close(c);
    }
    CHECK_MSG(failures_seen >= 10, "only %d injectable operations", failures_seen);
    printf("fault sweep: %d injected failures, each clean\n", failures_seen);
    kiln_ckpt *c = NULL;
    CHECK(kiln_ckpt_open_latest(dir, &c) == KILN_OK && c && kiln_ckpt_step(c) == 2);
    kiln_ckpt_close(c);
}

/* A real full disk: a 256 KiB tmpfs (needs CAP_SYS_ADMIN; skipped otherwise). */
static void test_tmpfs_enospc(void) {
    char dir[512];
    mkdir_fresh(dir, sizeof dir, "tmpfs");
    if (mount("tmpfs", dir, "tmpfs", 0, "size=256k") != 0) {
        printf("SKIP tmpfs ENOSPC test: mount failed: %s\n", strerror(errno));
        return;
    }
    CHECK(save_std(dir, 1, 0) == KILN_OK);
    kiln_ckpt_writer *w;
    kiln_status st = kiln_ckpt_begin(dir, 2, NULL, &w);
    CHECK(st == KILN_OK);
    if (st == KILN_OK) {
        static uint8_t big[512 * 1024];
        st = kiln_ckpt_add_section(w, "big", KILN_CKPT_RAW, big, sizeof big);
        CHECK_ERR(st, KILN_ERR_IO, "No space left on device");
        CHECK(strstr(kiln_last_error(), "step-2.tmp-") != NULL);
        CHECK_ERR(kiln_ckpt_commit(w, NULL), KILN_ERR_STATE, "an earlier write failed");
    }
    CHECK(count_debris(dir) == 0);
    kiln_ckpt *c = NULL;
    CHECK(kiln_ckpt_open_latest(dir, &c) == KILN_OK && c && kiln_ckpt_step(c) == 1);
    kiln_ckpt_close(c);
    CHECK(save_std(dir, 2, 0) == KILN_OK); /* space came back */
    umount(dir);
    printf("tmpfs ENOSPC test ran\n");
}

/* ---- sets of shards ------------------------------------------------------------------------- */

/* A set of n shards of `step` saved as the ranks would (one process playing every rank): shard r
 * holds "shard/rank" r and a section "data" of 100 + r bytes. A failure of any stage aborts
 * the set, as the trainer's rank 0 does. */
static kiln_status save_set(const char *dir, uint64_t step, int n, int keep_last) {
    const long tag = (long)getpid();
    KILN_TRY(kiln_ckpt_set_prepare(dir, step, tag));
    uint8_t sha[8 * 32];
    kiln_status st = KILN_OK;
    for (int r = 0; r < n && st == KILN_OK; r++) {
        kiln_ckpt_writer *w = NULL;
        uint8_t data[200];
        for (int i = 0; i < 100 + r; i++) data[i] = (uint8_t)(step * 31 + r * 7 + i);
        st = kiln_ckpt_begin_shard(dir, step, tag, r, n, &w);
        if (st == KILN_OK && (st = kiln_ckpt_add_u64(w, "shard/rank", (uint64_t)r)) == KILN_OK &&
            (st = kiln_ckpt_add_section(w, "data", KILN_CKPT_RAW, data, (size_t)(100 + r))) == KILN_OK)
            st = kiln_ckpt_finish_shard(w, sha + 32 * r);
        else if (w)
            kiln_ckpt_abort(w);
    }
    if (st == KILN_OK) return kiln_ckpt_set_commit(dir, step, tag, n, sha, keep_last, NULL);
    kiln_ckpt_set_abort(dir, step, tag);
    return st;
}

static void test_sets(void) {
    char dir[512], p[700], q[700];
    mkdir_fresh(dir, sizeof dir, "sets");
    CHECK(save_set(dir, 1, 3, 0) == KILN_OK);
    CHECK(save_set(dir, 2, 3, 0) == KILN_OK);
    CHECK(count_debris(dir) == 0);
    kiln_ckpt *c = NULL;
    CHECK(kiln_ckpt_open_latest(dir, &c) == KILN_OK && c && kiln_ckpt_step(c) == 2);
    if (c) {
        CHECK(kiln_ckpt_shard_count(c) == 3 && kiln_ckpt_shard(c, 0) == c && kiln_ckpt_shard(c, 3) == NULL);
        for (int r = 0; r < 3; r++) {
            const kiln_ckpt *sh = kiln_ckpt_shard(c, r);
            const kiln_ckpt_section *s = NULL;
            uint64_t v = 99;
            CHECK(sh && kiln_ckpt_get_u64(sh, "shard/rank", &v) == KILN_OK && v == (uint64_t)r);
            CHECK(sh && kiln_ckpt_find(sh, "data", KILN_CKPT_RAW, &s) == KILN_OK && s->size == (uint64_t)(100 + r) &&
                  ((const uint8_t *)s->data)[5] == (uint8_t)(2 * 31 + r * 7 + 5));
        }
    }
    kiln_ckpt_close(c);
    /* a single file says 0 shards */
    CHECK(save_std(dir, 3, 0) == KILN_OK);
    CHECK(kiln_ckpt_open_latest(dir, &c) == KILN_OK && c && kiln_ckpt_shard_count(c) == 0);
    kiln_ckpt_close(c);
    sh("rm -rf '%s/step-3'", dir);

    /* a missing shard, then a shard of step 1 in step 2's set: refused by name, step 1 loads */
    snprintf(p, sizeof p, "%s/step-2/shard-00001-of-00003.kiln", dir);
    snprintf(q, sizeof q, "%s/step-2/moved", dir);
    CHECK(rename(p, q) == 0);
    CHECK_ERR(kiln_ckpt_open_step(dir, 2, &c), KILN_ERR_FORMAT, "shard 1 of 3 (shard-00001-of-00003.kiln) is missing");
    CHECK(kiln_ckpt_open_latest(dir, &c) == KILN_OK && c && kiln_ckpt_step(c) == 1);
    kiln_ckpt_close(c);
    size_t n = 0;
    snprintf(q, sizeof q, "%s/step-1/shard-00001-of-00003.kiln", dir);
    uint8_t *b = read_file(q, &n);
    CHECK(b != NULL);
    if (b) write_file(p, b, n);
    free(b);
    CHECK_ERR(kiln_ckpt_open_step(dir, 2, &c), KILN_ERR_FORMAT, "the marker does not match");
    /* resume: the damaged set is set aside, step 1 loads, step 2 can be saved again */
    CHECK(kiln_ckpt_open_for_resume(dir, &c) == KILN_OK && c && kiln_ckpt_step(c) == 1);
    if (c) CHECK(strstr(kiln_ckpt_rejected(c), "set aside as") != NULL);
    kiln_ckpt_close(c);
    CHECK(find_set_aside(dir, 2, p, sizeof p) == 1);
    sh("rm -rf '%s'/step-2.rejected-*", dir);
    CHECK(save_set(dir, 2, 2, 2) == KILN_OK);
    CHECK(kiln_ckpt_open_latest(dir, &c) == KILN_OK && c && kiln_ckpt_step(c) == 2 && kiln_ckpt_shard_count(c) == 2);
    kiln_ckpt_close(c);

    /* misuse: a shard's writer cannot commit alone; a commit of a shard never written fails */
    kiln_ckpt_writer *w = NULL;
    CHECK(kiln_ckpt_set_prepare(dir, 3, 1) == KILN_OK);
    CHECK(kiln_ckpt_begin_shard(dir, 3, 1, 0, 2, &w) == KILN_OK);
    CHECK_ERR(kiln_ckpt_commit(w, NULL), KILN_ERR_INVALID_ARG, "a shard's writer");
    uint8_t sha[64] = {0};
    CHECK_ERR(kiln_ckpt_set_commit(dir, 3, 1, 2, sha, 0, NULL), KILN_ERR_STATE, "shard 0 was not written");
    CHECK_ERR(kiln_ckpt_begin_shard(dir, 3, 1, 2, 2, &w), KILN_ERR_INVALID_ARG, "rank 2 of 2");
    CHECK(count_debris(dir) == 0);

    /* a failure at every I/O operation of a set's save: nothing new complete, nothing left */
    int failures_seen = 0;
    for (g_fail_at = 0; g_fail_at < 300; g_fail_at++) {
        g_calls = 0;
        g_fail_errno = EIO;
        kiln_ckpt_set_fault_hook(fail_nth, NULL);
        kiln_status st = save_set(dir, 4, 3, 0);
        kiln_ckpt_set_fault_hook(NULL, NULL);
        if (st == KILN_OK) break;
        failures_seen++;
        CHECK_MSG(st == KILN_ERR_IO && strstr(kiln_last_error(), strerror(EIO)), "set fault %d: status %d '%s'",
                  g_fail_at, (int)st, kiln_last_error());
        CHECK_MSG(count_debris(dir) == 0, "set fault %d left debris", g_fail_at);
        CHECK(kiln_ckpt_open_latest(dir, &c) == KILN_OK && c && kiln_ckpt_step(c) == 2);
        kiln_ckpt_close(c);
    }
    CHECK_MSG(failures_seen >= 20, "only %d injectable operations in a set's save", failures_seen);
    printf("set fault sweep: %d injected failures, each clean\n", failures_seen);
    CHECK(kiln_ckpt_open_latest(dir, &c) == KILN_OK && c && kiln_ckpt_step(c) == 4 && kiln_ckpt_shard_count(c) == 3);
    kiln_ckpt_close(c);

    /* a lazy open (a rank after rank 0 verified the set) checks a section's checksum when it is
     * read: a flipped byte in shard 2's data opens, and is refused when that section is asked for */
    snprintf(p, sizeof p, "%s/step-4/shard-00002-of-00003.kiln", dir);
    b = read_file(p, &n);
    uint64_t off[8], size[8];
    CHECK(b && section_offsets(b, off, size, 8) == 2 && size[1] == 102);
    if (b) {
        b[off[1] + 7] ^= 0x10;
        write_file(p, b, n);
    }
    free(b);
    CHECK_ERR(kiln_ckpt_open_step(dir, 4, &c), KILN_ERR_FORMAT, "checksum mismatch");
    CHECK(kiln_ckpt_open_step_lazy(dir, 4, &c) == KILN_OK && c);
    if (c) {
        const kiln_ckpt_section *sec = NULL;
        uint64_t v = 0;
        CHECK(kiln_ckpt_get_u64(kiln_ckpt_shard(c, 2), "shard/rank", &v) == KILN_OK && v == 2);
        CHECK(kiln_ckpt_find(kiln_ckpt_shard(c, 1), "data", KILN_CKPT_RAW, &sec) == KILN_OK);
        CHECK_ERR(kiln_ckpt_find(kiln_ckpt_shard(c, 2), "data", KILN_CKPT_RAW, &sec), KILN_ERR_FORMAT,
                  "section 'data' (102 bytes): checksum mismatch");
    }
    kiln_ckpt_close(c);
}

int main(void) {
    snprintf(g_root, sizeof g_root, "/tmp/kiln_test_ckpt_%ld", (long)getpid());
    mkdir(g_root, 0755);
    test_round_trip();
    test_corruption();
    test_marker_and_retention();
    test_set_aside();
    test_fault_sweep();
    test_tmpfs_enospc();
    test_sets();
    if (!t_failures) sh("rm -rf '%s'", g_root);
    return test_finish("test_checkpoint");
}
