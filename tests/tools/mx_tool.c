/*
 * mx_tool.c -- drive the exact block formats (src/ops/mx.h) from Python tests and benchmarks.
 *
 *   mx_tool run DIR KIND N R K [threads=T] [stochastic=SEED]
 *       KIND mx8|mx16. Reads DIR/x.f32 (N*K) and DIR/w.f32 (R*K), raw little-endian f32;
 *       quantizes both (kiln_mx_quantize) and multiplies (kiln_mx_matmul_cpu on
 *       kiln_cpu_select_path(): KILN_CPU_PATH forces one). Writes, for P in x, w:
 *       DIR/P_q.i8 (rows*nb*32: mx8 q, mx16 hi), DIR/P_lo.i8 (mx16 only), DIR/P_e.i16
 *       (rows*nb), DIR/P_bad.u8 (rows), and DIR/out.f32 (N*R). Prints one JSON line
 *       {"kernel", "nb"}. stochastic=SEED: kiln_mx_quantize_stochastic with that seed, tensor
 *       id 1 for x and 2 for w.
 *   mx_tool round DIR COUNT
 *       Reads DIR/s.i64 and DIR/p.i32 (COUNT each), writes DIR/r.f32 = kiln_mx_round(s, p).
 *   mx_tool bench N K R THREADS REPS
 *       Random x (N,K) ~ U[-1,1) and W (R,K) ~ U[-0.1,0.1); times per call, for mx8 and mx16,
 *       the product alone (W and x quantized before) on kiln_mx_select_path(N) and on the portable
 *       reference, the quantization of x, and kiln's CPU backend f32 matmul (the auditable
 *       one) on the same shape. Prints one line per measurement.
 *
 * On a kiln error it prints "error: STATUS: MESSAGE" on stderr and exits 2 (1: bad usage or
 * files).
 */
#include "kiln.h"
#include "base/base.h"
#include "base/tensor.h"
#include "ops/mx.h"
#include "ops/cpu/cpu_kernels.h"
#include "ops/ops.h"
#include "tool_files.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *TOOL = "mx_tool";


static int write_mx(const char *dir, const char *p, const kiln_mx_matrix *m) {
    char name[64];
    size_t plane = (size_t)(m->rows * m->nb * KILN_MX_BLOCK);
    snprintf(name, sizeof name, "%s_q.i8", p);
    if (tool_write_file(TOOL, dir, name, m->q, plane)) return 1;
    if (m->kind == KILN_MX16) {
        snprintf(name, sizeof name, "%s_lo.i8", p);
        if (tool_write_file(TOOL, dir, name, m->lo, plane)) return 1;
    }
    snprintf(name, sizeof name, "%s_e.i16", p);
    if (tool_write_file(TOOL, dir, name, m->e, (size_t)(m->rows * m->nb) * 2)) return 1;
    snprintf(name, sizeof name, "%s_bad.u8", p);
    return tool_write_file(TOOL, dir, name, m->row_nonfinite, (size_t)m->rows);
}

static int cmd_run(int argc, char **argv) {
    if (argc < 5) return fprintf(stderr, "usage: mx_tool run DIR KIND N R K [threads=T]\n"), 1;
    const char *dir = argv[0];
    kiln_mx_kind kind = !strcmp(argv[1], "mx16") ? KILN_MX16 : KILN_MX8;
    int64_t N = atoll(argv[2]), R = atoll(argv[3]), K = atoll(argv[4]);
    int threads = 1, stochastic = 0;
    uint64_t seed = 0;
    for (int i = 5; i < argc; i++) {
        if (!strncmp(argv[i], "threads=", 8)) threads = atoi(argv[i] + 8);
        if (!strncmp(argv[i], "stochastic=", 11))
            stochastic = 1, seed = strtoull(argv[i] + 11, NULL, 0);
    }
    float *x = tool_read_file(TOOL, dir, "x.f32", (size_t)(N * K) * 4, 0);
    float *w = tool_read_file(TOOL, dir, "w.f32", (size_t)(R * K) * 4, 0);
    float *out = malloc((size_t)(N * R) * 4 + 4);
    if (!x || !w || !out) return free(x), free(w), free(out), 1;
    kiln_pool *pool = NULL;
    kiln_mx_matrix qx, qw;
    memset(&qx, 0, sizeof qx);
    memset(&qw, 0, sizeof qw);
    kiln_status st = kiln_pool_create(threads, &pool);
    if (st == KILN_OK) st = kiln_mx_matrix_alloc(&qx, kind, N, K);
    if (st == KILN_OK) st = kiln_mx_matrix_alloc(&qw, kind, R, K);
    if (st == KILN_OK)
        st = stochastic ? kiln_mx_quantize_stochastic(&qx, x, K, seed, 1, pool)
                        : kiln_mx_quantize(&qx, x, K, pool);
    if (st == KILN_OK)
        st = stochastic ? kiln_mx_quantize_stochastic(&qw, w, K, seed, 2, pool)
                        : kiln_mx_quantize(&qw, w, K, pool);
    kiln_cpu_path path = kiln_cpu_select_path();
    if (st == KILN_OK) st = kiln_mx_matmul_cpu(&qx, &qw, out, R, pool, path);
    int rc = 0;
    if (st != KILN_OK)
        rc = tool_fail(st);
    else if (write_mx(dir, "x", &qx) || write_mx(dir, "w", &qw) ||
             tool_write_file(TOOL, dir, "out.f32", out, (size_t)(N * R) * 4))
        rc = 1;
    else
        printf("{\"kernel\": \"%s\", \"nb\": %lld}\n", kiln_mx_kernel_name(path), (long long)qx.nb);
    kiln_mx_matrix_free(&qx);
    kiln_mx_matrix_free(&qw);
    kiln_pool_free(pool);
    free(x), free(w), free(out);
    return rc;
}

static int cmd_round(int argc, char **argv) {
    if (argc < 2) return fprintf(stderr, "usage: mx_tool round DIR COUNT\n"), 1;
    size_t n = (size_t)atoll(argv[1]);
    int64_t *s = tool_read_file(TOOL, argv[0], "s.i64", n * 8, 0);
    int32_t *p = tool_read_file(TOOL, argv[0], "p.i32", n * 4, 0);
    float *r = malloc(n * 4 + 4);
    if (!s || !p || !r) return free(s), free(p), free(r), 1;
    for (size_t i = 0; i < n; i++)
        r[i] = kiln_mx_round(s[i], p[i]);
    int rc = tool_write_file(TOOL, argv[0], "r.f32", r, n * 4);
    free(s), free(p), free(r);
    return rc;
}

/* ---- bench ---------------------------------------------------------------------------------- */

typedef struct mx_bench {
    kiln_mx_matrix *qx, *qw;
    float *out;
    int64_t R;
    kiln_pool *pool;
    kiln_cpu_path path;
} mx_bench;

static double time_product(const mx_bench *b, int reps) {
    kiln_mx_matmul_cpu(b->qx, b->qw, b->out, b->R, b->pool, b->path); /* warm-up */
    double t0 = kiln_time_seconds();
    for (int i = 0; i < reps; i++)
        kiln_mx_matmul_cpu(b->qx, b->qw, b->out, b->R, b->pool, b->path);
    return (kiln_time_seconds() - t0) / reps;
}

static int cmd_bench(int argc, char **argv) {
    if (argc < 5) return fprintf(stderr, "usage: mx_tool bench N K R THREADS REPS\n"), 1;
    int64_t N = atoll(argv[0]), K = atoll(argv[1]), R = atoll(argv[2]);
    int threads = atoi(argv[3]), reps = atoi(argv[4]);
    float *x = malloc((size_t)(N * K) * 4), *w = malloc((size_t)(R * K) * 4);
    float *out = malloc((size_t)(N * R) * 4);
    if (!x || !w || !out) return free(x), free(w), free(out), 1;
    for (int64_t i = 0; i < N * K; i++)
        x[i] = tool_rnd_f(-1.0f, 1.0f);
    for (int64_t i = 0; i < R * K; i++)
        w[i] = tool_rnd_f(-0.1f, 0.1f);
    kiln_pool *pool = NULL;
    kiln_backend *be = NULL;
    kiln_status st = kiln_pool_create(threads, &pool);
    if (st == KILN_OK) st = kiln_backend_cpu_create(threads, &be);
    if (st != KILN_OK) return tool_fail(st);
    double gmac = (double)N * (double)K * (double)R / 1e9;
    printf("mx_tool bench: N=%lld K=%lld R=%lld, %d threads, selected path %s\n", (long long)N,
           (long long)K, (long long)R, threads, kiln_cpu_path_name(kiln_cpu_select_path()));
    for (int kind = 8; kind <= 16; kind += 8) {
        kiln_mx_matrix qx, qw;
        st = kiln_mx_matrix_alloc(&qx, (kiln_mx_kind)kind, N, K);
        if (st == KILN_OK) st = kiln_mx_matrix_alloc(&qw, (kiln_mx_kind)kind, R, K);
        if (st == KILN_OK) st = kiln_mx_quantize(&qw, w, K, pool);
        if (st != KILN_OK) return tool_fail(st);
        double t0 = kiln_time_seconds();
        for (int i = 0; i < reps; i++)
            kiln_mx_quantize(&qx, x, K, pool);
        double tq = (kiln_time_seconds() - t0) / reps;
        mx_bench b = {&qx, &qw, out, R, pool, kiln_mx_select_path(N)};
        double ts = time_product(&b, reps);
        b.path = KILN_CPU_PATH_PORTABLE;
        double tp = time_product(&b, reps > 3 ? 3 : reps);
        printf("mx%d: product %s %.3f ms (%.1f GMAC/s), portable %.3f ms, quantize x %.3f ms\n",
               kind, kiln_mx_kernel_name(kiln_mx_select_path(N)), ts * 1e3, gmac / ts, tp * 1e3,
               tq * 1e3);
        kiln_mx_matrix_free(&qx);
        kiln_mx_matrix_free(&qw);
    }
    kiln_tensor W = {"w", KILN_DTYPE_F32, 2, {R, K, 1, 1}, w, (size_t)(R * K) * 4};
    be->i->matmul(be, out, x, &W, NULL, (int)N);
    double t0 = kiln_time_seconds();
    for (int i = 0; i < reps; i++)
        be->i->matmul(be, out, x, &W, NULL, (int)N);
    double tf = (kiln_time_seconds() - t0) / reps;
    printf("f32 auditable matmul (CPU backend, path %s): %.3f ms (%.1f GMAC/s)\n",
           kiln_cpu_path_name(kiln_backend_cpu_path(be)), tf * 1e3, gmac / tf);
    kiln_backend_free(be);
    kiln_pool_free(pool);
    free(x), free(w), free(out);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "run")) return cmd_run(argc - 2, argv + 2);
    if (argc >= 2 && !strcmp(argv[1], "round")) return cmd_round(argc - 2, argv + 2);
    if (argc >= 2 && !strcmp(argv[1], "bench")) return cmd_bench(argc - 2, argv + 2);
    fprintf(stderr, "usage: mx_tool run|round|bench ...\n");
    return 1;
}
