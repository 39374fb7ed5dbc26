/*
 * kd_tool.c -- drive kiln_fused_kd (src/ops/fused_kd.h) on the CPU backend from Python tests
 * and benchmarks.
 *
 *   kd_tool run DIR N H V [KEY=VALUE ...]
 *       keys (default): chunk (0), reduction mean|sum (mean), scale (1), threads (1),
 *       weight f32|bf16 (f32), tau (1), kd (1: kd_weight), ce (0: ce_weight), teacher_ld (0 =
 *       V), accumulate 0|1 (0), grads 0|1 (1: request dh and dW).
 *       Reads DIR/h.f32 (N*H), DIR/w.f32 (V*H f32) or DIR/w.bf16 (V*H bf16 bits),
 *       DIR/teacher.f32 (N*ld, ld = teacher_ld or V), DIR/targets.i32 (N) and, if present,
 *       DIR/mask.u8 (N) -- raw little-endian arrays. dh starts as DIR/dh_in.f32 with
 *       accumulate=1, else filled with 7.0 (overwritten: the unsupervised rows must come back
 *       0); dW starts as DIR/dw_in.f32 with accumulate=1, else 0. On a kiln error without
 *       accumulate it says on stderr whether the outputs are untouched. Writes DIR/dh.f32 (N*H),
 *       DIR/dw.f32 (V*H), DIR/row_kl.f32 and DIR/row_ce.f32 (N) and prints one JSON line
 *       {"loss", "kl", "ce", "loss_f64", "n_supervised", "scratch_bytes", "scratch_formula",
 *       "path"} (scratch_formula: kiln_fused_kd_scratch_bytes for the call's sizes; path: the
 *       backend's SIMD path).
 *   kd_tool bench N H V CHUNK THREADS REPS S
 *       random f32 h, W (tool_problem_random) and teacher logits in [-4, 4), S supervised
 *       rows spread over the N (every N/S-th), tau 2, kd 0.5, ce 0.5, MEAN, dh and dW; one
 *       warm-up call (when REPS > 1), REPS timed calls; one JSON line with the peak bytes
 *       kiln's accounting saw during a call beyond what was live before it, the scratch,
 *       kiln_fused_kd_scratch_bytes, the materialised logits' N*V*4 bytes and seconds per
 *       call.
 *
 * The SIMD path is the CPU backend's choice (KILN_CPU_PATH in the environment forces one).
 * On a kiln error it prints "error: STATUS: MESSAGE" on stderr and exits 2 (1: bad usage or
 * files).
 */
#include "kiln.h"
#include "base/base.h"
#include "ops/cpu/cpu_kernels.h"
#include "ops/fused_kd.h"
#include "tool_files.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The run command's KEY=VALUE options. */
typedef struct kd_options {
    int64_t chunk, teacher_ld;
    int sum, threads, bf16, accumulate, grads;
    float scale, tau, kd_weight, ce_weight;
} kd_options;

/* *o = the defaults, then argv's KEY=VALUE options over them; 1 (with a message) on a bad
 * one. */
static int parse_options(int argc, char **argv, kd_options *o) {
    *o = (kd_options){0, 0, 0, 1, 0, 0, 1, 1.0f, 1.0f, 1.0f, 0.0f};
    for (int i = 0; i < argc; i++) {
        const char *eq = strchr(argv[i], '=');
        if (!eq) goto bad;
        size_t klen = (size_t)(eq - argv[i]);
        const char *v = eq + 1;
#define KEY(name) (klen == strlen(name) && !strncmp(argv[i], name, klen))
        if (KEY("chunk")) o->chunk = atoll(v);
        else if (KEY("teacher_ld")) o->teacher_ld = atoll(v);
        else if (KEY("reduction")) o->sum = !strcmp(v, "sum");
        else if (KEY("threads")) o->threads = atoi(v);
        else if (KEY("weight")) o->bf16 = !strcmp(v, "bf16");
        else if (KEY("accumulate")) o->accumulate = atoi(v);
        else if (KEY("grads")) o->grads = atoi(v);
        else if (KEY("scale")) o->scale = strtof(v, NULL);
        else if (KEY("tau")) o->tau = strtof(v, NULL);
        else if (KEY("kd")) o->kd_weight = strtof(v, NULL);
        else if (KEY("ce")) o->ce_weight = strtof(v, NULL);
        else goto bad;
#undef KEY
    }
    return 0;
bad:
    fprintf(stderr, "kd_tool: bad option (KEY=VALUE, see the file's header)\n");
    return 1;
}

/* The call on these arrays with o's settings; outputs NULL (the commands set them). */
static kiln_fused_kd_params params_of(int64_t N, int64_t H, int64_t V, const float *h,
                                      const void *w, const float *z, const int32_t *tg,
                                      const uint8_t *mask, const kd_options *o) {
    kiln_fused_kd_params p = kiln_fused_kd_default_params();
    p.N = N;
    p.H = H;
    p.V = V;
    p.hidden = h;
    p.weight = w;
    p.weight_dtype = o->bf16 ? KILN_DTYPE_BF16 : KILN_DTYPE_F32;
    p.teacher_logits = z;
    p.teacher_ld = o->teacher_ld;
    p.targets = tg;
    p.mask = mask;
    p.tau = o->tau;
    p.kd_weight = o->kd_weight;
    p.ce_weight = o->ce_weight;
    p.reduction = o->sum ? KILN_CE_REDUCTION_SUM : KILN_CE_REDUCTION_MEAN;
    p.scale = o->scale;
    p.chunk = o->chunk;
    return p;
}

static int cmd_run(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: kd_tool run DIR N H V [KEY=VALUE ...]\n");
        return 1;
    }
    const char *dir = argv[2];
    int64_t N = atoll(argv[3]), H = atoll(argv[4]), V = atoll(argv[5]);
    kd_options o;
    if (N <= 0 || H <= 0 || V <= 0 || parse_options(argc - 6, argv + 6, &o)) {
        fprintf(stderr, "kd_tool: bad sizes or options\n");
        return 1;
    }
    const int64_t zld = o.teacher_ld > 0 ? o.teacher_ld : V;
    const size_t NH = (size_t)(N * H), VH = (size_t)(V * H);
    float *h = tool_read_file("kd_tool", dir, "h.f32", NH * 4, 0);
    void *w = tool_read_file("kd_tool", dir, o.bf16 ? "w.bf16" : "w.f32", VH * (o.bf16 ? 2 : 4),
                             0);
    float *z = tool_read_file("kd_tool", dir, "teacher.f32", (size_t)(N * zld) * 4, 0);
    int32_t *tg = tool_read_file("kd_tool", dir, "targets.i32", (size_t)N * 4, 0);
    uint8_t *mask = tool_read_file("kd_tool", dir, "mask.u8", (size_t)N, 1);
    float *dh = o.accumulate ? tool_read_file("kd_tool", dir, "dh_in.f32", NH * 4, 0)
                             : malloc(NH * 4);
    float *dw = o.accumulate ? tool_read_file("kd_tool", dir, "dw_in.f32", VH * 4, 0)
                             : calloc(VH, 4);
    float *rkl = malloc((size_t)N * 4), *rce = malloc((size_t)N * 4);
    if (!h || !w || !z || !tg || !dh || !dw || !rkl || !rce) return 1;
    if (!o.accumulate)
        for (size_t i = 0; i < NH; i++) dh[i] = 7.0f;
    for (int64_t n = 0; n < N; n++) rkl[n] = rce[n] = -1.0f;
    kiln_backend *be = NULL;
    kiln_status st = kiln_backend_cpu_create(o.threads, &be);
    if (st != KILN_OK) return tool_fail(st);
    kiln_fused_kd_params p = params_of(N, H, V, h, w, z, tg, mask, &o);
    p.dhidden = o.grads ? dh : NULL;
    p.dhidden_accumulate = o.accumulate;
    p.dweight = o.grads ? dw : NULL;
    p.row_kl = rkl;
    p.row_ce = rce;
    kiln_fused_kd_result r;
    st = kiln_fused_kd(be, &p, &r);
    const char *path = kiln_cpu_path_name(kiln_backend_cpu_path(be));
    kiln_backend_free(be);
    if (st != KILN_OK && !o.accumulate) {
        /* the contract: nothing the caller passed is written on an error */
        int untouched = 1;
        for (size_t i = 0; i < NH; i++) untouched &= dh[i] == 7.0f;
        for (size_t i = 0; i < VH; i++) untouched &= dw[i] == 0.0f;
        for (int64_t n = 0; n < N; n++) untouched &= rkl[n] == -1.0f && rce[n] == -1.0f;
        fprintf(stderr, "kd_tool: outputs %s\n", untouched ? "untouched" : "WRITTEN");
    }
    if (st != KILN_OK) return tool_fail(st);
    if (tool_write_file("kd_tool", dir, "dh.f32", dh, NH * 4) ||
        tool_write_file("kd_tool", dir, "dw.f32", dw, VH * 4) ||
        tool_write_file("kd_tool", dir, "row_kl.f32", rkl, (size_t)N * 4) ||
        tool_write_file("kd_tool", dir, "row_ce.f32", rce, (size_t)N * 4))
        return 1;
    printf("{\"loss\": %.9g, \"kl\": %.9g, \"ce\": %.9g, \"loss_f64\": %.17g, "
           "\"n_supervised\": %lld, \"scratch_bytes\": %zu, \"scratch_formula\": %zu, "
           "\"path\": \"%s\"}\n",
           (double)r.loss, (double)r.kl, (double)r.ce, r.loss_f64, (long long)r.n_supervised,
           r.scratch_bytes,
           kiln_fused_kd_scratch_bytes(r.n_supervised, H, V, o.chunk, o.grads, o.grads), path);
    free(h); free(w); free(z); free(tg); free(mask); free(dh); free(dw); free(rkl); free(rce);
    return 0;
}

/* kiln_fused_kd as a tool_call's op. */
static kiln_status call_kd(kiln_backend *be, const void *p, void *r) {
    return kiln_fused_kd(be, p, r);
}

static int cmd_bench(int argc, char **argv) {
    if (argc != 9) {
        fprintf(stderr, "usage: kd_tool bench N H V CHUNK THREADS REPS S\n");
        return 1;
    }
    int64_t N = atoll(argv[2]), H = atoll(argv[3]), V = atoll(argv[4]), chunk = atoll(argv[5]);
    int threads = atoi(argv[6]), reps = atoi(argv[7]);
    int64_t S = atoll(argv[8]);
    if (N <= 0 || H <= 0 || V <= 0 || reps < 1 || S < 1 || S > N) {
        fprintf(stderr, "kd_tool: bad arguments\n");
        return 1;
    }
    tool_problem pr;
    float *z = malloc((size_t)(N * V) * 4);
    if (!z || tool_problem_random("kd_tool", N, H, V, 1.0, &pr)) return 1;
    for (int64_t i = 0; i < N * V; i++) z[i] = tool_rnd_f(-4, 4);
    const int64_t stride = N / S; /* exactly S supervised rows, every stride-th */
    for (int64_t n = 0; n < N; n++) pr.mask[n] = n % stride == 0 && n / stride < S;
    kiln_backend *be = NULL;
    kiln_status st = kiln_backend_cpu_create(threads, &be);
    if (st != KILN_OK) return tool_fail(st);
    kd_options o;
    parse_options(0, NULL, &o); /* the defaults */
    o.chunk = chunk;
    o.tau = 2.0f;
    o.kd_weight = 0.5f;
    o.ce_weight = 0.5f;
    kiln_fused_kd_params p = params_of(N, H, V, pr.h, pr.w, z, pr.targets, pr.mask, &o);
    p.dhidden = pr.dh;
    p.dweight = pr.dw;
    kiln_fused_kd_result r;
    double dt = 0.0;
    size_t peak_extra = 0;
    st = tool_measure(reps, &(tool_call){call_kd, be, &p, &r}, &dt, &peak_extra);
    if (st != KILN_OK) return tool_fail(st);
    char formula[64];
    snprintf(formula, sizeof formula, "\"scratch_formula\": %zu, ",
             kiln_fused_kd_scratch_bytes(r.n_supervised, H, V, chunk, 1, 1));
    tool_bench_report(N, r.n_supervised, H, V, chunk, be->n_threads, dt, peak_extra,
                      r.scratch_bytes, formula, r.loss);
    kiln_backend_free(be);
    tool_problem_free(&pr);
    free(z);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "run")) return cmd_run(argc, argv);
    if (argc >= 2 && !strcmp(argv[1], "bench")) return cmd_bench(argc, argv);
    fprintf(stderr, "usage: kd_tool run ... | kd_tool bench ... (see the file's header)\n");
    return 1;
}
