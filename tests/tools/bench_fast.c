/*
 * bench_fast.c -- decode (N=1) matmuls at SmolLM2-135M's shapes, exact mode vs fast mode
 * (8-bit activations), for Q4_1 and Q8_0 weights, one backend of each in the same run so the
 * two are measured in the same time window on a shared machine. Median of `rounds` rounds.
 *
 *   bench_fast [n_threads] [rounds]
 */
#include "base/tensor.h"
#include "ops/ops.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t g_rng = 88172645463325252ull;
static uint64_t rnd(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}
static float rndf(void) { return (float)((rnd() >> 40) / 16777216.0) * 2.0f - 1.0f; }

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    int n_threads = argc > 1 ? atoi(argv[1]) : 1;
    int rounds = argc > 2 ? atoi(argv[2]) : 7;
    if (rounds < 1 || rounds > 99) rounds = 7;
    kiln_backend *be[2] = {0};
    for (int f = 0; f < 2; f++)
        if (kiln_backend_cpu_create_mode(n_threads, f, &be[f]) != KILN_OK) {
            fprintf(stderr, "bench_fast: %s\n", kiln_last_error());
            return 1;
        }
    struct { const char *name; int64_t R, C; int per_layer; } shapes[] = {
        {"attn_q/o 576x576", 576, 576, 2}, {"attn_k/v 192x576", 192, 576, 2},
        {"ffn_gate/up 1536x576", 1536, 576, 2}, {"ffn_down 576x1536", 576, 1536, 1},
        {"lm_head 49152x576", 49152, 576, 0}};
    const kiln_dtype dts[] = {KILN_DTYPE_Q4_1, KILN_DTYPE_Q8_0};
    printf("bench_fast: %d threads, median of %d rounds, N = 1\n", n_threads, rounds);
    printf("%-22s %-5s %12s %12s %8s\n", "shape", "dtype", "exact(us)", "fast(us)", "speedup");
    for (int d = 0; d < 2; d++) {
        double tok[2] = {0, 0};
        for (int s = 0; s < 5; s++) {
            const kiln_dtype_traits *tr = kiln_dtype_get_traits(dts[d]);
            int64_t R = shapes[s].R, C = shapes[s].C;
            size_t nb = (size_t)(R * C / 32) * (size_t)tr->type_size;
            uint8_t *w = malloc(nb);
            for (size_t i = 0; i < nb; i++) w[i] = (uint8_t)rnd();
            for (size_t b = 0; b < nb / (size_t)tr->type_size; b++) {
                uint16_t h[2] = {kiln_fp32_to_fp16(rndf() * 0.05f), kiln_fp32_to_fp16(rndf() * 0.05f)};
                memcpy(w + b * (size_t)tr->type_size, h, dts[d] == KILN_DTYPE_Q4_1 ? 4 : 2);
            }
            float *x = malloc(sizeof(float) * (size_t)C), *out = malloc(sizeof(float) * (size_t)R);
            for (int64_t i = 0; i < C; i++) x[i] = rndf();
            kiln_tensor W = {"w", dts[d], 2, {R, C, 1, 1}, w, nb};
            double med[2], t[99];
            int reps = R * C > 10000000 ? 5 : 200;
            for (int f = 0; f < 2; f++) be[f]->i->matmul(be[f], out, x, &W, NULL, 1);
            for (int f = 0; f < 2; f++) {
                for (int r = 0; r < rounds; r++) {
                    double t0 = kiln_time_seconds();
                    for (int k = 0; k < reps; k++) be[f]->i->matmul(be[f], out, x, &W, NULL, 1);
                    t[r] = (kiln_time_seconds() - t0) / reps;
                }
                qsort(t, (size_t)rounds, sizeof t[0], cmp_d);
                med[f] = t[rounds / 2];
                tok[f] += med[f] * (shapes[s].per_layer ? 30 * shapes[s].per_layer : 1);
            }
            printf("%-22s %-5s %12.1f %12.1f %7.2fx\n", shapes[s].name, kiln_dtype_name(dts[d]),
                   med[0] * 1e6, med[1] * 1e6, med[0] / med[1]);
            free(w), free(x), free(out);
        }
        printf("  all %s (30 layers + lm_head): exact %.2f ms, fast %.2f ms per token\n",
               kiln_dtype_name(dts[d]), tok[0] * 1e3, tok[1] * 1e3);
    }
    for (int f = 0; f < 2; f++) kiln_backend_free(be[f]);
    return 0;
}
