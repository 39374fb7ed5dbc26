/*
 * alloc_fail_load.c -- `alloc_fail_load MODEL`: open MODEL (and a context, and one decode)
 * once to count allocations, then again failing the 1st, 2nd, ... Nth allocation. Every
 * failing run must return a clean error (no crash) and leave no live allocation behind.
 * `alloc_fail_load --train MODEL CKPT_DIR` sweeps training instead: a trainer over MODEL,
 * one training step, and the load of the checkpoint in CKPT_DIR (saved once, before the
 * sweep, with the hook off). Prints "N runs, F failed" and exits nonzero on any failure.
 */
#include "kiln.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static long g_count, g_fail_at;

static void *hook_alloc(size_t size, void *user) {
    (void)user;
    g_count++;
    if (g_fail_at > 0 && g_count == g_fail_at) return NULL;
    return malloc(size);
}

static void hook_free(void *p, void *user) {
    (void)user;
    free(p);
}

/* Open, create a context, decode two tokens; returns the status. */
static kiln_status run_once(const char *path) {
    kiln_model *m = NULL;
    kiln_context *c = NULL;
    kiln_status st = kiln_model_open(path, NULL, &m);
    if (st == KILN_OK) {
        kiln_context_params cp = kiln_context_default_params();
        cp.n_ctx = 16;
        cp.n_threads = 1;
        st = kiln_context_create(m, &cp, &c);
    }
    if (st == KILN_OK) {
        int32_t ids[2] = {1, 2};
        st = kiln_decode(c, ids, 2, 0, NULL);
    }
    kiln_context_free(c);
    kiln_model_close(m);
    return st;
}

/* Open, create a trainer, take one step, load the checkpoint of ckpt_dir; returns the status. */
static kiln_status run_train_once(const char *path, const char *ckpt_dir) {
    kiln_model *m = NULL;
    kiln_trainer *t = NULL;
    kiln_status st = kiln_model_open(path, NULL, &m);
    if (st == KILN_OK) {
        kiln_train_params tp = kiln_train_default_params();
        tp.max_seq = 8;
        tp.n_threads = 1;
        st = kiln_trainer_create(m, &tp, &t);
    }
    if (st == KILN_OK) {
        int32_t ids[5] = {1, 2, 3, 4, 5};
        float loss;
        st = kiln_train_step_batch(t, ids, 1, 4, ids + 1, KILN_LOSS_MEAN, 1.0f, 0, &loss);
        if (st == KILN_OK) st = kiln_train_optimizer_step(t, 1e-3);
    }
    if (st == KILN_OK && ckpt_dir) {
        uint64_t step = 0;
        char *run = NULL;
        st = kiln_train_load(t, ckpt_dir, &step, &run);
        kiln_string_free(run);
    }
    kiln_trainer_free(t);
    kiln_model_close(m);
    return st;
}

static const char *g_model, *g_ckpt;

static kiln_status run_selected(void) { return g_ckpt ? run_train_once(g_model, g_ckpt) : run_once(g_model); }

int main(int argc, char **argv) {
    if (argc == 4 && !strcmp(argv[1], "--train")) {
        g_model = argv[2];
        g_ckpt = argv[3];
        /* the checkpoint the sweep loads: saved once, with plain allocation */
        kiln_model *m = NULL;
        kiln_trainer *t = NULL;
        kiln_train_params tp = kiln_train_default_params();
        tp.max_seq = 8;
        tp.n_threads = 1;
        kiln_status st = kiln_model_open(g_model, NULL, &m);
        if (st == KILN_OK) st = kiln_trainer_create(m, &tp, &t);
        if (st == KILN_OK) st = kiln_train_save(t, g_ckpt, 1, "{\"steps\":1}", 0);
        kiln_trainer_free(t);
        kiln_model_close(m);
        if (st != KILN_OK) {
            fprintf(stderr, "saving the checkpoint failed: %s\n", kiln_last_error());
            return 1;
        }
    } else if (argc == 2) {
        g_model = argv[1];
    } else {
        fprintf(stderr, "usage: alloc_fail_load MODEL | alloc_fail_load --train MODEL CKPT_DIR\n");
        return 2;
    }
    kiln_allocator a = {hook_alloc, hook_free, NULL};
    kiln_set_allocator(&a);
    kiln_mem_stats s0, s;
    kiln_mem_get_stats(&s0);
    g_count = 0;
    g_fail_at = 0;
    kiln_status st = run_selected();
    if (st != KILN_OK) {
        fprintf(stderr, "baseline run failed: %s\n", kiln_last_error());
        return 1;
    }
    /* A failed allocation gives KILN_ERR_NOMEM, or -- where kiln has a fallback that needs no
     * memory and gives the same bits (the CPU backward's packed panels) -- success; either way
     * every block is freed. Any other status is a failure. */
    long total = g_count, failed = 0, fell_back = 0;
    for (long n = 1; n <= total; n++) {
        g_count = 0;
        g_fail_at = n;
        st = run_selected();
        kiln_mem_get_stats(&s);
        if ((st != KILN_ERR_NOMEM && st != KILN_OK) || s.live_blocks != s0.live_blocks) {
            failed++;
            fprintf(stderr, "failing allocation %ld: status %s (%s), live blocks %zu (start %zu)\n", n,
                    kiln_status_string(st), kiln_last_error(), s.live_blocks, s0.live_blocks);
        }
        fell_back += st == KILN_OK;
    }
    printf("%ld runs, %ld failed (%ld fell back and succeeded)\n", total, failed, fell_back);
    return failed ? 1 : 0;
}
