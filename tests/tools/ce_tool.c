/*
 * ce_tool.c -- drive kiln_fused_ce (src/train/fused_ce.h) from Python tests and benchmarks.
 *
 *   ce_tool run DIR N H V CHUNK mean|sum SCALE THREADS f32|bf16
 *       reads DIR/h.f32 (N*H), DIR/w.f32 (V*H f32) or DIR/w.bf16 (V*H bf16 bits),
 *       DIR/targets.i32 (N) and, if present, DIR/mask.u8 (N) -- raw little-endian arrays --
 *       writes DIR/dh.f32 (N*H), DIR/dw.f32 (V*H, accumulated from zero), DIR/row_loss.f32
 *       (N) and prints one JSON line {"loss", "loss_f64", "n_supervised", "scratch_bytes"}.
 *   ce_tool bench N H V CHUNK THREADS REPS [SUPERVISED_FRACTION]
 *       random f32 h and W, MEAN, one warm-up call (when REPS > 1), REPS timed calls; one JSON
 *       line with the peak bytes kiln's accounting saw during a call beyond what was live
 *       before it, the scratch, the materialised logits' N*V*4 bytes, and seconds per call.
 *
 * On a kiln error it prints "error: STATUS: MESSAGE" on stderr and exits 2 (1: bad usage
 * or files).
 */
#include "kiln.h"
#include "base/base.h"
#include "ops/fused_ce.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void *read_file(const char *dir, const char *name, size_t want, int optional) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (!optional) fprintf(stderr, "ce_tool: cannot open %s\n", path);
        return NULL;
    }
    void *buf = malloc(want ? want : 1);
    size_t got = fread(buf, 1, want, f);
    int extra = fgetc(f) != EOF;
    fclose(f);
    if (got != want || extra) {
        fprintf(stderr, "ce_tool: %s: expected %zu bytes\n", path, want);
        free(buf);
        return NULL;
    }
    return buf;
}

static int write_file(const char *dir, const char *name, const void *data, size_t n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, n, f) != n) {
        fprintf(stderr, "ce_tool: cannot write %s\n", path);
        if (f) fclose(f);
        return 1;
    }
    return fclose(f) != 0;
}

static int fail(kiln_status st) {
    fprintf(stderr, "error: %s: %s\n", kiln_status_string(st), kiln_last_error());
    return 2;
}

static int cmd_run(int argc, char **argv) {
    if (argc != 11) {
        fprintf(stderr, "usage: ce_tool run DIR N H V CHUNK mean|sum SCALE THREADS f32|bf16\n");
        return 1;
    }
    const char *dir = argv[2];
    int64_t N = atoll(argv[3]), H = atoll(argv[4]), V = atoll(argv[5]), chunk = atoll(argv[6]);
    int bf16 = !strcmp(argv[10], "bf16");
    if (N <= 0 || H <= 0 || V <= 0) {
        fprintf(stderr, "ce_tool: bad sizes\n");
        return 1;
    }
    float *h = read_file(dir, "h.f32", (size_t)(N * H) * 4, 0);
    void *w = read_file(dir, bf16 ? "w.bf16" : "w.f32", (size_t)(V * H) * (bf16 ? 2 : 4), 0);
    int32_t *tg = read_file(dir, "targets.i32", (size_t)N * 4, 0);
    uint8_t *mask = read_file(dir, "mask.u8", (size_t)N, 1);
    if (!h || !w || !tg) return 1;
    float *dh = malloc((size_t)(N * H) * 4), *dw = calloc((size_t)(V * H), 4);
    float *rl = malloc((size_t)N * 4);
    kiln_backend *be = NULL;
    kiln_status st = kiln_backend_cpu_create(atoi(argv[9]), &be);
    if (st != KILN_OK) return fail(st);
    kiln_fused_ce_params p = kiln_fused_ce_default_params();
    p.N = N;
    p.H = H;
    p.V = V;
    p.hidden = h;
    p.weight = w;
    p.weight_dtype = bf16 ? KILN_DTYPE_BF16 : KILN_DTYPE_F32;
    p.targets = tg;
    p.mask = mask;
    p.reduction = !strcmp(argv[7], "sum") ? KILN_CE_REDUCTION_SUM : KILN_CE_REDUCTION_MEAN;
    p.scale = strtof(argv[8], NULL);
    p.chunk = chunk;
    p.dhidden = dh;
    p.dweight = dw;
    p.row_loss = rl;
    kiln_fused_ce_result r;
    st = kiln_fused_ce(be, &p, &r);
    kiln_backend_free(be);
    if (st != KILN_OK) return fail(st);
    if (write_file(dir, "dh.f32", dh, (size_t)(N * H) * 4) ||
        write_file(dir, "dw.f32", dw, (size_t)(V * H) * 4) ||
        write_file(dir, "row_loss.f32", rl, (size_t)N * 4))
        return 1;
    printf("{\"loss\": %.9g, \"loss_f64\": %.17g, \"n_supervised\": %lld, \"scratch_bytes\": %zu}\n",
           (double)r.loss, r.loss_f64, (long long)r.n_supervised, r.scratch_bytes);
    free(h); free(w); free(tg); free(mask); free(dh); free(dw); free(rl);
    return 0;
}

static uint64_t g_rng = 0x853c49e6748fea9bull;
static float rnd_f(float lo, float hi) {
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    uint64_t x = g_rng * 2685821657736338717ull;
    return lo + (hi - lo) * (float)((x >> 40) / 16777216.0);
}

static int cmd_bench(int argc, char **argv) {
    if (argc != 8 && argc != 9) {
        fprintf(stderr, "usage: ce_tool bench N H V CHUNK THREADS REPS [SUPERVISED_FRACTION]\n");
        return 1;
    }
    int64_t N = atoll(argv[2]), H = atoll(argv[3]), V = atoll(argv[4]), chunk = atoll(argv[5]);
    int threads = atoi(argv[6]), reps = atoi(argv[7]);
    double frac = argc == 9 ? atof(argv[8]) : 1.0;
    if (N <= 0 || H <= 0 || V <= 0 || reps < 1) {
        fprintf(stderr, "ce_tool: bad arguments\n");
        return 1;
    }
    float *h = malloc((size_t)(N * H) * 4), *w = malloc((size_t)(V * H) * 4);
    float *dh = malloc((size_t)(N * H) * 4), *dw = calloc((size_t)(V * H), 4);
    int32_t *tg = malloc((size_t)N * 4);
    uint8_t *mask = malloc((size_t)N);
    if (!h || !w || !dh || !dw || !tg || !mask) {
        fprintf(stderr, "ce_tool: out of memory\n");
        return 1;
    }
    for (int64_t i = 0; i < N * H; i++) h[i] = rnd_f(-1, 1);
    for (int64_t i = 0; i < V * H; i++) w[i] = rnd_f(-0.1f, 0.1f);
    for (int64_t n = 0; n < N; n++) {
        tg[n] = (int32_t)(rnd_f(0, 1) * (float)(V - 1));
        mask[n] = rnd_f(0, 1) < frac;
    }
    kiln_backend *be = NULL;
    kiln_status st = kiln_backend_cpu_create(threads, &be);
    if (st != KILN_OK) return fail(st);
    kiln_fused_ce_params p = kiln_fused_ce_default_params();
    p.N = N;
    p.H = H;
    p.V = V;
    p.hidden = h;
    p.weight = w;
    p.targets = tg;
    p.mask = mask;
    p.chunk = chunk;
    p.dhidden = dh;
    p.dweight = dw;
    kiln_fused_ce_result r;
    if (reps > 1) {
        st = kiln_fused_ce(be, &p, &r); /* warm-up */
        if (st != KILN_OK) return fail(st);
    }
    kiln_mem_stats s0, s1;
    kiln_mem_get_stats(&s0);
    kiln_mem_reset_peak();
    double t0 = kiln_time_seconds();
    for (int i = 0; i < reps; i++) {
        st = kiln_fused_ce(be, &p, &r);
        if (st != KILN_OK) return fail(st);
    }
    double dt = (kiln_time_seconds() - t0) / reps;
    kiln_mem_get_stats(&s1);
    printf("{\"N\": %lld, \"S\": %lld, \"H\": %lld, \"V\": %lld, \"chunk\": %lld, \"threads\": %d, "
           "\"peak_extra_bytes\": %zu, \"scratch_bytes\": %zu, \"logits_bytes\": %.0f, "
           "\"seconds_per_call\": %.4f, \"loss\": %.9g}\n",
           (long long)N, (long long)r.n_supervised, (long long)H, (long long)V,
           (long long)(chunk ? chunk : KILN_FUSED_CE_DEFAULT_CHUNK), be->n_threads,
           s1.peak_bytes - s0.live_bytes, r.scratch_bytes, (double)N * (double)V * 4.0, dt,
           (double)r.loss);
    kiln_backend_free(be);
    free(h); free(w); free(dh); free(dw); free(tg); free(mask);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "run")) return cmd_run(argc, argv);
    if (argc >= 2 && !strcmp(argv[1], "bench")) return cmd_bench(argc, argv);
    fprintf(stderr, "usage: ce_tool run ... | ce_tool bench ... (see the file's header)\n");
    return 1;
}
