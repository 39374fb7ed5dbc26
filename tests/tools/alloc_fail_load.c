/*
 * alloc_fail_load.c -- `alloc_fail_load MODEL`: open MODEL (and a context, and one decode)
 * once to count allocations, then again failing the 1st, 2nd, ... Nth allocation. Every
 * failing run must return a clean error (no crash) and leave no live allocation behind.
 * Prints "N runs, F failed" and exits nonzero on any failure.
 */
#include "kiln.h"

#include <stdio.h>
#include <stdlib.h>

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

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: alloc_fail_load MODEL\n");
        return 2;
    }
    kiln_allocator a = {hook_alloc, hook_free, NULL};
    kiln_set_allocator(&a);
    kiln_mem_stats s0, s;
    kiln_mem_get_stats(&s0);
    g_count = 0;
    g_fail_at = 0;
    kiln_status st = run_once(argv[1]);
    if (st != KILN_OK) {
        fprintf(stderr, "baseline run failed: %s\n", kiln_last_error());
        return 1;
    }
    long total = g_count, failed = 0;
    for (long n = 1; n <= total; n++) {
        g_count = 0;
        g_fail_at = n;
        st = run_once(argv[1]);
        kiln_mem_get_stats(&s);
        if (st != KILN_ERR_NOMEM || s.live_blocks != s0.live_blocks) {
            failed++;
            fprintf(stderr, "failing allocation %ld: status %s (%s), live blocks %zu (start %zu)\n", n,
                    kiln_status_string(st), kiln_last_error(), s.live_blocks, s0.live_blocks);
        }
    }
    printf("%ld runs, %ld failed\n", total, failed);
    return failed ? 1 : 0;
}
