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
#include "tool_files.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    float *h = tool_read_file("ce_tool", dir, "h.f32", (size_t)(N * H) * 4, 0);
    void *w = tool_read_file("ce_tool", dir, bf16 ? "w.bf16" : "w.f32",
                             (size_t)(V * H) * (bf16 ? 2 : 4), 0);
    int32_t *tg = tool_read_file("ce_tool", dir, "targets.i32", (size_t)N * 4, 0);
    uint8_t *mask = tool_read_file("ce_tool", dir, "mask.u8", (size_t)N, 1);
    if (!h || !w || !tg) return 1;
    float *dh = malloc((size_t)(N * H) * 4), *dw = calloc((size_t)(V * H), 4);
    float *rl = malloc((size_t)N * 4);
    kiln_backend *be = NULL;
    kiln_status st = kiln_backend_cpu_create(atoi(argv[9]), &be);
    if (st != KILN_OK) return tool_fail(st);
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
    if (st != KILN_OK) return tool_fail(st);
    if (tool_write_file("ce_tool", dir, "dh.f32", dh, (size_t)(N * H) * 4) ||
        tool_write_file("ce_tool", dir, "dw.f32", dw, (size_t)(V * H) * 4) ||
        tool_write_file("ce_tool", dir, "row_loss.f32", rl, (size_t)N * 4))
        return 1;
    printf("{\"loss\": %.9g, \"loss_f64\": %.17g, \"n_supervised\": %lld, \"scratch_bytes\": %zu}\n",
           (double)r.loss, r.loss_f64, (long long)r.n_supervised, r.scratch_bytes);
    free(h); free(w); free(tg); free(mask); free(dh); free(dw); free(rl);
    return 0;
}

/* kiln_fused_ce as a tool_call's op. */
static kiln_status call_ce(kiln_backend *be, const void *p, void *r) {
    return kiln_fused_ce(be, p, r);
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
    tool_problem pr;
    if (tool_problem_random("ce_tool", N, H, V, frac, &pr)) return 1;
    kiln_backend *be = NULL;
    kiln_status st = kiln_backend_cpu_create(threads, &be);
    if (st != KILN_OK) return tool_fail(st);
    kiln_fused_ce_params p = kiln_fused_ce_default_params();
    p.N = N;
    p.H = H;
    p.V = V;
    p.hidden = pr.h;
    p.weight = pr.w;
    p.targets = pr.targets;
    p.mask = pr.mask;
    p.chunk = chunk;
    p.dhidden = pr.dh;
    p.dweight = pr.dw;
    kiln_fused_ce_result r;
    double dt = 0.0;
    size_t peak_extra = 0;
    st = tool_measure(reps, &(tool_call){call_ce, be, &p, &r}, &dt, &peak_extra);
    if (st != KILN_OK) return tool_fail(st);
    tool_bench_report(N, r.n_supervised, H, V, chunk, be->n_threads, dt, peak_extra,
                      r.scratch_bytes, "", r.loss);
    kiln_backend_free(be);
    tool_problem_free(&pr);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "run")) return cmd_run(argc, argv);
    if (argc >= 2 && !strcmp(argv[1], "bench")) return cmd_bench(argc, argv);
    fprintf(stderr, "usage: ce_tool run ... | ce_tool bench ... (see the file's header)\n");
    return 1;
}
