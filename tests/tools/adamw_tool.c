/*
 * adamw_tool.c -- runs kiln's AdamW (and clip_grad_norm_) on inputs written by
 * tests/python/test_adamw.py, so the test can compare with torch.optim.AdamW.
 *
 *   adamw_tool IN OUT THREADS
 *
 * IN (little-endian): i32 P, i32 steps, i32 weights, i32 moments, f64 beta1, beta2, eps,
 * weight_decay, u64 seed, f64 max_norm (<= 0: no clipping); per step f64 lr; per parameter
 * i32 name_len, name bytes, i64 n, i32 decay (-1: Trainer default, 0/1: explicit map); then
 * per parameter n f32 initial weights (bf16 variants: rounded to bf16 RNE); then per step,
 * per parameter n f32 gradients.
 * OUT: per step (if clipping) f32 total norm, f32 coefficient, P f32 per-tensor norms; then
 * per parameter: i32 decay flag, n f32 weights (bf16 widened), n f32 master (zeros unless
 * BF16_MASTER), n f32 compensation (zeros unless KAHAN), n f32 m, n f32 v; then a line of
 * describe() text.
 */
#include "base/base.h"
#include "base/tensor.h"
#include "train/adamw.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void die(const char *what) {
    fprintf(stderr, "adamw_tool: %s: %s\n", what, kiln_last_error());
    exit(1);
}

static void rd(FILE *f, void *p, size_t n) {
    if (fread(p, 1, n, f) != n) {
        fprintf(stderr, "adamw_tool: truncated input\n");
        exit(1);
    }
}

static void wr(FILE *f, const void *p, size_t n) {
    if (fwrite(p, 1, n, f) != n) {
        fprintf(stderr, "adamw_tool: write failed\n");
        exit(1);
    }
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: adamw_tool IN OUT THREADS\n");
        return 2;
    }
    FILE *in = fopen(argv[1], "rb");
    if (!in) return 2;
    int32_t P, steps, weights, moments;
    rd(in, &P, 4);
    rd(in, &steps, 4);
    rd(in, &weights, 4);
    rd(in, &moments, 4);
    kiln_adamw_config cfg = kiln_adamw_default_config();
    double max_norm;
    rd(in, &cfg.beta1, 8);
    rd(in, &cfg.beta2, 8);
    rd(in, &cfg.eps, 8);
    rd(in, &cfg.weight_decay, 8);
    rd(in, &cfg.seed, 8);
    rd(in, &max_norm, 8);
    cfg.weights = (kiln_adamw_weights)weights;
    cfg.moments = (kiln_adamw_moments)moments;
    double *lrs = malloc(sizeof(double) * (size_t)steps);
    rd(in, lrs, sizeof(double) * (size_t)steps);
    cfg.lr = lrs[0];

    kiln_adamw_param *ps = calloc((size_t)P, sizeof *ps);
    kiln_adamw_decay_rule *map = calloc((size_t)P, sizeof *map);
    int n_map = 0;
    for (int i = 0; i < P; i++) {
        int32_t len, decay;
        rd(in, &len, 4);
        char *nm = calloc((size_t)len + 1, 1);
        rd(in, nm, (size_t)len);
        rd(in, &ps[i].n, 8);
        rd(in, &decay, 4);
        ps[i].name = nm;
        if (decay >= 0) {
            map[n_map].name = nm;
            map[n_map].decay = decay;
            n_map++;
        }
    }
    cfg.decay_map = map;
    cfg.n_decay_map = n_map;
    for (int i = 0; i < P; i++) {
        size_t n = (size_t)ps[i].n;
        float *w = malloc(n * sizeof(float));
        rd(in, w, n * sizeof(float));
        if (weights == KILN_ADAMW_F32) {
            ps[i].weights = w;
        } else {
            uint16_t *b = malloc(n * sizeof(uint16_t));
            for (size_t e = 0; e < n; e++) b[e] = kiln_fp32_to_bf16(w[e]);
            free(w);
            ps[i].weights = b;
        }
        ps[i].grad = malloc(n * sizeof(float));
    }

    kiln_pool *pool = NULL;
    if (kiln_pool_create(atoi(argv[3]), &pool) != KILN_OK) die("pool");
    kiln_adamw *o = NULL;
    if (kiln_adamw_create(ps, P, &cfg, &o) != KILN_OK) die("create");
    FILE *out = fopen(argv[2], "wb");
    if (!out) return 2;
    float *norms = malloc(sizeof(float) * (size_t)P);
    for (int t = 0; t < steps; t++) {
        for (int i = 0; i < P; i++) rd(in, ps[i].grad, (size_t)ps[i].n * sizeof(float));
        if (max_norm > 0) {
            float total, coef;
            if (kiln_adamw_grad_norm(o, pool, norms, NULL, NULL) != KILN_OK) die("norm");
            if (kiln_adamw_clip_grads(o, pool, max_norm, &total, &coef) != KILN_OK) die("clip");
            wr(out, &total, 4);
            wr(out, &coef, 4);
            wr(out, norms, sizeof(float) * (size_t)P);
        }
        kiln_adamw_set_lr(o, lrs[t]);
        if (kiln_adamw_step(o, pool) != KILN_OK) die("step");
    }
    for (int i = 0; i < P; i++) {
        size_t n = (size_t)ps[i].n;
        int32_t decay = kiln_adamw_param_decays(o, i);
        wr(out, &decay, 4);
        float *buf = calloc(n, sizeof(float));
        for (size_t e = 0; e < n; e++)
            buf[e] = weights == KILN_ADAMW_F32 ? ((float *)ps[i].weights)[e]
                                               : kiln_bf16_to_fp32(((uint16_t *)ps[i].weights)[e]);
        wr(out, buf, n * 4);
        const float *ma = kiln_adamw_master(o, i);
        for (size_t e = 0; e < n; e++) buf[e] = ma ? ma[e] : 0.0f;
        wr(out, buf, n * 4);
        const uint16_t *cp = kiln_adamw_compensation(o, i);
        for (size_t e = 0; e < n; e++) buf[e] = cp ? kiln_bf16_to_fp32(cp[e]) : 0.0f;
        wr(out, buf, n * 4);
        float *v = calloc(n, sizeof(float));
        if (kiln_adamw_get_moments(o, i, buf, v) != KILN_OK) die("moments");
        wr(out, buf, n * 4);
        wr(out, v, n * 4);
        free(buf);
        free(v);
    }
    char desc[512];
    kiln_adamw_describe(o, desc, sizeof desc, NULL);
    fprintf(out, "%s\n", desc);
    fclose(out);
    fclose(in);
    kiln_adamw_free(o);
    kiln_pool_free(pool);
    return 0;
}
