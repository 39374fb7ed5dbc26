/* crash_writer.c -- drives tests/python/test_checkpoint_crash.py.
 *
 *   crash_writer write DIR MB   resume from the newest valid checkpoint in DIR (or step 0) and
 *                               save steps k+1, k+2, ... forever (keep_last 3), each holding
 *                               MB MiB of parameters whose bytes are a function of the step;
 *                               prints "saved <k>" after each commit returns.
 *   crash_writer check DIR      open the newest valid checkpoint, verify that its contents are
 *                               the ones its step implies, and that every checkpoint marked
 *                               complete in DIR verifies too; prints "latest <k>" (or
 *                               "latest none"); exit 1 on any invalid complete checkpoint.
 */
#include "train/checkpoint.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The parameter bytes of step k: a xorshift stream seeded by k (cheap, step-specific). */
static void fill(uint32_t *p, size_t n, uint64_t step) {
    uint64_t x = 0x9E3779B97F4A7C15ull * (step + 1);
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        p[i] = (uint32_t)(x >> 32);
    }
}

static int verify(const kiln_ckpt *c, uint32_t *scratch, size_t cap) {
    uint64_t step = kiln_ckpt_step(c), s2 = 0;
    const kiln_ckpt_section *p, *cfg;
    if (kiln_ckpt_get_u64(c, "step", &s2) != KILN_OK || s2 != step) return 0;
    if (kiln_ckpt_find(c, "config", KILN_CKPT_JSON, &cfg) != KILN_OK) return 0;
    if (kiln_ckpt_find(c, "param/w", KILN_CKPT_TENSOR, &p) != KILN_OK) return 0;
    size_t n = (size_t)(p->size / 4);
    if (n > cap) return 0;
    fill(scratch, n, step);
    return memcmp(scratch, p->data, p->size) == 0;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: crash_writer write DIR MB | check DIR\n");
        return 2;
    }
    const char *dir = argv[2];
    size_t cap = 64u << 20;
    uint32_t *buf = malloc(cap * 4);
    if (!buf) return 2;
    kiln_ckpt *c = NULL;
    if (!strcmp(argv[1], "check")) {
        int bad = 0;
        if (kiln_ckpt_open_latest(dir, &c) != KILN_OK) {
            printf("latest none (%s)\n", kiln_last_error());
        } else {
            if (!verify(c, buf, cap)) {
                printf("CONTENT MISMATCH in %s\n", kiln_ckpt_path(c));
                bad = 1;
            }
            printf("latest %llu\n", (unsigned long long)kiln_ckpt_step(c));
            kiln_ckpt_close(c);
        }
        uint64_t *steps;
        size_t n;
        if (kiln_ckpt_list(dir, &steps, &n) == KILN_OK) {
            for (size_t i = 0; i < n; i++) {
                kiln_ckpt *o;
                if (kiln_ckpt_open_step(dir, steps[i], &o) != KILN_OK) {
                    printf("INVALID complete checkpoint %llu: %s\n", (unsigned long long)steps[i],
                           kiln_last_error());
                    bad = 1;
                    continue;
                }
                if (!verify(o, buf, cap)) {
                    printf("CONTENT MISMATCH step %llu\n", (unsigned long long)steps[i]);
                    bad = 1;
                }
                kiln_ckpt_close(o);
            }
            printf("complete %zu\n", n);
            kiln_free(steps);
        }
        free(buf);
        return bad;
    }
    if (strcmp(argv[1], "write") || argc < 4) return 2;
    size_t n = (size_t)atoi(argv[3]) * (1u << 20) / 4;
    if (n == 0 || n > cap) return 2;
    uint64_t step = 0;
    if (kiln_ckpt_open_latest(dir, &c) == KILN_OK) {
        step = kiln_ckpt_step(c);
        kiln_ckpt_close(c);
    }
    kiln_ckpt_save_params sp = kiln_ckpt_default_save_params();
    sp.keep_last = 3;
    for (;;) {
        step++;
        fill(buf, n, step);
        kiln_ckpt_writer *w;
        int64_t shape[1] = {(int64_t)n};
        char cfg[64];
        snprintf(cfg, sizeof cfg, "{\"step\": %llu}", (unsigned long long)step);
        kiln_status st = kiln_ckpt_begin(dir, step, &sp, &w);
        if (st == KILN_OK) st = kiln_ckpt_add_json(w, "config", cfg);
        if (st == KILN_OK) st = kiln_ckpt_add_tensor(w, "param/w", KILN_DTYPE_I32, 1, shape, buf);
        if (st == KILN_OK) st = kiln_ckpt_add_u64(w, "step", step);
        if (st == KILN_OK) st = kiln_ckpt_commit(w, NULL);
        else kiln_ckpt_abort(w);
        if (st != KILN_OK) {
            fprintf(stderr, "save failed: %s\n", kiln_last_error());
            return 1;
        }
        printf("saved %llu\n", (unsigned long long)step);
        fflush(stdout);
    }
}
