/*
 * bench_ops.c -- time the CPU backend's matmul at SmolLM2-135M's shapes (C=576, FF=1536,
 * KV=192, V=49152), decode (N=1) and prefill (N=512), for f32 / Q4_1 / Q8_0 weights, and the
 * attention of one decode step. Prints GFLOP/s and GB/s of weights read.
 *
 *   bench_ops [n_threads] [min_seconds_per_case]      (KILN_CPU_PATH forces a SIMD path)
 */
#include "base/tensor.h"
#include "ops/cpu/cpu_kernels.h"
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

/* Random valid weights of type dt (f16 scales at the block start for the types used here). */
static void *make_weights(kiln_dtype dt, int64_t R, int64_t C, size_t *nbytes) {
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(dt);
    size_t nb = (size_t)(R * C / tr->block_size) * (size_t)tr->type_size;
    uint8_t *w = malloc(nb);
    if (!w) return NULL;
    if (dt == KILN_DTYPE_F32) {
        for (size_t i = 0; i < nb / 4; i++) ((float *)w)[i] = rndf();
    } else {
        for (size_t i = 0; i < nb; i++) w[i] = (uint8_t)rnd();
        for (size_t b = 0; b < nb / (size_t)tr->type_size; b++) {
            uint16_t h[2] = {kiln_fp32_to_fp16(rndf() * 0.05f), kiln_fp32_to_fp16(rndf() * 0.05f)};
            memcpy(w + b * (size_t)tr->type_size, h, dt == KILN_DTYPE_Q4_1 ? 4 : 2);
        }
    }
    *nbytes = nb;
    return w;
}

static double bench_matmul(kiln_backend *be, kiln_dtype dt, int N, int64_t R, int64_t C,
                           double min_s, double *gbs) {
    size_t nbytes = 0;
    void *w = make_weights(dt, R, C, &nbytes);
    float *x = malloc(sizeof(float) * (size_t)(N * C)), *out = malloc(sizeof(float) * (size_t)(N * R));
    for (int64_t i = 0; i < N * C; i++) x[i] = rndf();
    kiln_tensor W = {"w", dt, 2, {R, C, 1, 1}, w, nbytes};
    be->i->matmul(be, out, x, &W, NULL, N); /* warm up */
    int reps = 0;
    double t0 = kiln_time_seconds(), t;
    do {
        be->i->matmul(be, out, x, &W, NULL, N);
        reps++;
        t = kiln_time_seconds() - t0;
    } while (t < min_s);
    double per = t / reps;
    *gbs = (double)nbytes / per / 1e9;
    free(w), free(x), free(out);
    return per;
}

int main(int argc, char **argv) {
    int n_threads = argc > 1 ? atoi(argv[1]) : 2;
    double min_s = argc > 2 ? atof(argv[2]) : 0.3;
    kiln_backend *be = NULL;
    if (kiln_backend_cpu_create(n_threads, &be) != KILN_OK) {
        fprintf(stderr, "bench_ops: %s\n", kiln_last_error());
        return 1;
    }
    printf("bench_ops: path %s, %d threads\n", kiln_cpu_path_name(kiln_backend_cpu_path(be)),
           be->n_threads);
    struct { const char *name; int64_t R, C; int per_layer; } shapes[] = {
        {"attn_q/o 576x576", 576, 576, 2}, {"attn_k/v 192x576", 192, 576, 2},
        {"ffn_gate/up 1536x576", 1536, 576, 2}, {"ffn_down 576x1536", 576, 1536, 1},
        {"lm_head 49152x576", 49152, 576, 0}};
    const kiln_dtype dts[] = {KILN_DTYPE_F32, KILN_DTYPE_Q4_1, KILN_DTYPE_Q8_0};
    printf("%-22s %-5s %4s %10s %9s %8s\n", "shape", "dtype", "N", "time(us)", "GFLOP/s", "GB/s");
    for (int d = 0; d < 3; d++) {
        double decode_layer = 0, lm_head = 0;
        for (int s = 0; s < 5; s++)
            for (int ni = 0; ni < 2; ni++) {
                int N = ni ? 512 : 1;
                if (N == 512 && shapes[s].per_layer == 0) continue;
                double gbs, t = bench_matmul(be, dts[d], N, shapes[s].R, shapes[s].C, min_s, &gbs);
                double gf = 2.0 * N * shapes[s].R * shapes[s].C / t / 1e9;
                printf("%-22s %-5s %4d %10.1f %9.2f %8.2f\n", shapes[s].name,
                       kiln_dtype_name(dts[d]), N, t * 1e6, gf, gbs);
                if (N == 1) {
                    if (shapes[s].per_layer) decode_layer += t * shapes[s].per_layer;
                    else lm_head = t;
                }
            }
        double tok = 30 * decode_layer + lm_head;
        printf("  %s: decode matmuls per token (30 layers + lm_head): %.2f ms -> %.1f tok/s "
               "upper bound\n", kiln_dtype_name(dts[d]), tok * 1e3, 1.0 / tok);
    }
    /* one decode step of attention at T positions (9 heads, 3 kv heads, HS 64) */
    const int Ts[] = {64, 512, 2048};
    for (int i = 0; i < 3; i++) {
        int T = Ts[i], NH = 9, KVH = 3, HS = 64;
        float *q = malloc(sizeof(float) * NH * HS), *o = malloc(sizeof(float) * NH * HS);
        float *k = malloc(sizeof(float) * (size_t)T * KVH * HS), *v = malloc(sizeof(float) * (size_t)T * KVH * HS);
        for (int j = 0; j < NH * HS; j++) q[j] = rndf();
        for (int64_t j = 0; j < (int64_t)T * KVH * HS; j++) k[j] = rndf(), v[j] = rndf();
        int reps = 0;
        double t0 = kiln_time_seconds(), t;
        do {
            be->i->attention(be, o, q, k, v, 1, T - 1, NH, KVH, HS, 0.125f, 0);
            reps++;
            t = kiln_time_seconds() - t0;
        } while (t < min_s);
        printf("attention decode T=%-5d %10.1f us per layer\n", T, t / reps * 1e6);
        free(q), free(o), free(k), free(v);
    }
    kiln_backend_free(be);
    return 0;
}
