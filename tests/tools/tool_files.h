/*
 * tool_files.h -- what the tools (ce_tool.c, kd_tool.c, mx_tool.c) share: raw little-endian arrays
 * read from and written to a case's folder, kiln errors reported the same way, and for their
 * benchmarks a small deterministic random stream and the measurement of a call's time and
 * memory. Header-only: each tool is one executable.
 */
#ifndef KILN_TOOL_FILES_H
#define KILN_TOOL_FILES_H

#include "kiln.h"
#include "ops/fused_ce.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* DIR/NAME's bytes, exactly want of them, in a malloc'd buffer the caller frees; NULL (with a
 * message on stderr unless optional) when the file is absent or of another size. */
static inline void *tool_read_file(const char *tool, const char *dir, const char *name, size_t want,
                            int optional) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (!optional) fprintf(stderr, "%s: cannot open %s\n", tool, path);
        return NULL;
    }
    void *buf = malloc(want ? want : 1);
    size_t got = buf ? fread(buf, 1, want, f) : 0;
    int extra = fgetc(f) != EOF;
    fclose(f);
    if (!buf || got != want || extra) {
        fprintf(stderr, "%s: %s: expected %zu bytes\n", tool, path, want);
        free(buf);
        return NULL;
    }
    return buf;
}

/* n bytes of data into DIR/NAME; 0 on success, 1 (with a message) on failure. */
static inline int tool_write_file(const char *tool, const char *dir, const char *name, const void *data,
                           size_t n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, n, f) != n) {
        fprintf(stderr, "%s: cannot write %s\n", tool, path);
        if (f) fclose(f);
        return 1;
    }
    return fclose(f) != 0;
}

/* "error: STATUS: MESSAGE" on stderr; the tools' exit status for a kiln error, 2. */
static inline int tool_fail(kiln_status st) {
    fprintf(stderr, "error: %s: %s\n", kiln_status_string(st), kiln_last_error());
    return 2;
}

/* Uniform in [lo, hi) from a xorshift64* stream (the same sequence in every run). */
static uint64_t g_tool_rng = 0x853c49e6748fea9bull;
static inline float tool_rnd_f(float lo, float hi) {
    g_tool_rng ^= g_tool_rng >> 12;
    g_tool_rng ^= g_tool_rng << 25;
    g_tool_rng ^= g_tool_rng >> 27;
    uint64_t x = g_tool_rng * 2685821657736338717ull;
    return lo + (hi - lo) * (float)((x >> 40) / 16777216.0);
}

/* A benchmark's problem: h(N,H) in [-1, 1), W(V,H) f32 in [-0.1, 0.1), targets(N) in [0, V),
 * a mask(N) that keeps each position with probability supervised_fraction (drawn in that
 * order: h, W, then per position its target and its mask), dh(N,H) and dW(V,H) = 0 for the
 * outputs. Malloc'd: tool_problem_free. 1 (with a message) when out of memory. */
typedef struct tool_problem {
    float *h, *w, *dh, *dw;
    int32_t *targets;
    uint8_t *mask;
} tool_problem;

static inline int tool_problem_random(const char *tool, int64_t N, int64_t H, int64_t V,
                               double supervised_fraction, tool_problem *pr) {
    pr->h = malloc((size_t)(N * H) * 4);
    pr->w = malloc((size_t)(V * H) * 4);
    pr->dh = malloc((size_t)(N * H) * 4);
    pr->dw = calloc((size_t)(V * H), 4);
    pr->targets = malloc((size_t)N * 4);
    pr->mask = malloc((size_t)N);
    if (!pr->h || !pr->w || !pr->dh || !pr->dw || !pr->targets || !pr->mask) {
        fprintf(stderr, "%s: out of memory\n", tool);
        return 1;
    }
    for (int64_t i = 0; i < N * H; i++) pr->h[i] = tool_rnd_f(-1, 1);
    for (int64_t i = 0; i < V * H; i++) pr->w[i] = tool_rnd_f(-0.1f, 0.1f);
    for (int64_t n = 0; n < N; n++) {
        pr->targets[n] = (int32_t)(tool_rnd_f(0, 1) * (float)(V - 1));
        pr->mask[n] = tool_rnd_f(0, 1) < supervised_fraction;
    }
    return 0;
}

static inline void tool_problem_free(tool_problem *pr) {
    free(pr->h);
    free(pr->w);
    free(pr->dh);
    free(pr->dw);
    free(pr->targets);
    free(pr->mask);
}

/* One call of a loss op: op(be, params, result), op a one-line wrapper of the op's entry. */
typedef struct tool_call {
    kiln_status (*op)(kiln_backend *be, const void *params, void *result);
    kiln_backend *be;
    const void *params;
    void *result;
} tool_call;

/* reps timed calls of c, after one warm-up call when reps > 1: *seconds per call and
 * *peak_extra, the peak bytes kiln's accounting saw during them beyond what was live before.
 * The first error stops it and is returned. */
static inline kiln_status tool_measure(int reps, const tool_call *c, double *seconds,
                                size_t *peak_extra) {
    kiln_status st;
    if (reps > 1 && (st = c->op(c->be, c->params, c->result)) != KILN_OK) return st;
    kiln_mem_stats s0, s1;
    kiln_mem_get_stats(&s0);
    kiln_mem_reset_peak();
    double t0 = kiln_time_seconds();
    for (int i = 0; i < reps; i++)
        if ((st = c->op(c->be, c->params, c->result)) != KILN_OK) return st;
    *seconds = (kiln_time_seconds() - t0) / reps;
    kiln_mem_get_stats(&s1);
    *peak_extra = s1.peak_bytes - s0.live_bytes;
    return KILN_OK;
}

/* A benchmark's JSON line: the sizes (chunk 0: the default), the S supervised rows, the
 * threads, what tool_measure saw, the call's scratch, the materialised logits' N*V*4 bytes and
 * the loss; extra: more "KEY": VALUE pairs, each followed by ", " ("" for none). */
static inline void tool_bench_report(int64_t N, int64_t S, int64_t H, int64_t V, int64_t chunk,
                              int threads, double seconds, size_t peak_extra, size_t scratch,
                              const char *extra, float loss) {
    printf("{\"N\": %lld, \"S\": %lld, \"H\": %lld, \"V\": %lld, \"chunk\": %lld, "
           "\"threads\": %d, \"peak_extra_bytes\": %zu, \"scratch_bytes\": %zu, "
           "%s\"logits_bytes\": %.0f, \"seconds_per_call\": %.4f, \"loss\": %.9g}\n",
           (long long)N, (long long)S, (long long)H, (long long)V,
           (long long)(chunk ? chunk : KILN_FUSED_CE_DEFAULT_CHUNK), threads, peak_extra, scratch,
           extra, (double)N * (double)V * 4.0, seconds, (double)loss);
}

#endif /* KILN_TOOL_FILES_H */
