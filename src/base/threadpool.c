/*
 * threadpool.c -- see threadpool.h.
 *
 * Protocol. The owner publishes a job (fn, ctx in a slot, n_tasks in the claim word) and
 * bumps the generation counter gen. Workers wait for gen to change: first by spinning, then
 * by sleeping on cv_start after announcing themselves in n_sleepers. The announce-then-
 * recheck (worker) and publish-then-check-sleepers (owner) pairs are seq_cst, so either the
 * owner sees the sleeper and broadcasts under the mutex, or the worker sees the new
 * generation and does not sleep: no lost wake-ups. Every thread, the owner included, then
 * claims task indices with one atomic fetch_add until none are left, and the owner waits
 * until `done` counts every task. Tasks are claimed dynamically (a descheduled or sleeping
 * worker never holds up work it has not claimed), which cannot change results: the split
 * of the work into tasks depends only on the shapes and n_threads, and each task computes
 * its outputs alone in a fixed order.
 */
#include "threadpool.h"

#include <pthread.h>
#include <stdatomic.h>

#define SPIN_ITERS (1 << 15)

/* The claim word: job sequence (24 bits) | n_tasks (20 bits) | next task index (20 bits).
 * fetch_add(claim, 1) hands out task indices; a thread stops at the first index >= n_tasks,
 * so the index never exceeds n_tasks + n_threads < 2^20 and never carries into n_tasks. */
#define IDX_BITS 20
#define MAX_BATCH (1 << 19)
#define IDX_MASK ((1ull << IDX_BITS) - 1)

typedef struct worker {
    kiln_pool *pool;
    int index;
} worker;

typedef struct job_slot {
    kiln_pool_fn fn;
    void *ctx;
    int offset; /* task index of this batch's first task */
} job_slot;

struct kiln_pool {
    int n_threads;
    pthread_t *threads;
    worker *workers;
    int n_started;

    /* Job seq uses slot[seq & 1]: written by the owner before the claim word publishes seq,
     * read by a thread only after it claimed a valid task of seq, which keeps seq (and so
     * the slot) alive until that task is done. */
    job_slot slot[2];
    uint64_t seq;

    _Atomic uint64_t claim;
    _Atomic uint64_t gen; /* bumped per job: what sleeping / spinning workers wait for */
    _Atomic int done;     /* tasks of the current job finished */
    _Atomic int n_sleepers;
    _Atomic int owner_sleeping;
    _Atomic int stop;
    pthread_mutex_t mu;
    pthread_cond_t cv_start, cv_done;
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Claim and run tasks of the current job until none are left. */
static void work(kiln_pool *p, int thread) {
    for (;;) {
        uint64_t c = atomic_fetch_add_explicit(&p->claim, 1, memory_order_acq_rel);
        uint64_t idx = c & IDX_MASK, n = (c >> IDX_BITS) & IDX_MASK;
        if (idx >= n) return;
        const job_slot *js = &p->slot[(c >> (2 * IDX_BITS)) & 1];
        js->fn(js->ctx, js->offset + (int)idx, thread);
        if (atomic_fetch_add_explicit(&p->done, 1, memory_order_acq_rel) + 1 == (int)n &&
            atomic_load(&p->owner_sleeping)) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->cv_done);
            pthread_mutex_unlock(&p->mu);
        }
    }
}

static void *worker_main(void *arg) {
    worker *w = arg;
    kiln_pool *p = w->pool;
    uint64_t seen = 0;
    for (;;) {
        uint64_t g = atomic_load_explicit(&p->gen, memory_order_acquire);
        for (int i = 0; g == seen && i < SPIN_ITERS; i++) {
            cpu_relax();
            g = atomic_load_explicit(&p->gen, memory_order_acquire);
        }
        if (g == seen) {
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->n_sleepers, 1);
            while ((g = atomic_load(&p->gen)) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->cv_start, &p->mu);
            atomic_fetch_sub(&p->n_sleepers, 1);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop)) break;
        seen = g;
        work(p, w->index);
    }
    return NULL;
}

kiln_status kiln_pool_create(int n_threads, kiln_pool **out) {
    *out = NULL;
    if (n_threads <= 0) n_threads = kiln_cpu_count();
    if (n_threads > 1024)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_pool_create: n_threads %d > 1024", n_threads);
    kiln_pool *p = kiln_calloc(1, sizeof *p);
    if (!p) return kiln_error(KILN_ERR_NOMEM, "kiln_pool_create: out of memory");
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_start, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    if (n_threads > 1) {
        p->threads = kiln_calloc((size_t)n_threads, sizeof *p->threads);
        p->workers = kiln_calloc((size_t)n_threads, sizeof *p->workers);
        if (!p->threads || !p->workers) {
            kiln_pool_free(p);
            return kiln_error(KILN_ERR_NOMEM, "kiln_pool_create: out of memory");
        }
        for (int i = 1; i < n_threads; i++) {
            p->workers[i] = (worker){p, i};
            if (pthread_create(&p->threads[i], NULL, worker_main, &p->workers[i]) != 0) {
                kiln_pool_free(p);
                return kiln_error(KILN_ERR_NOMEM, "kiln_pool_create: pthread_create failed for "
                                  "worker %d of %d", i, n_threads);
            }
            p->n_started = i;
        }
    }
    *out = p;
    return KILN_OK;
}

void kiln_pool_free(kiln_pool *p) {
    if (!p) return;
    if (p->n_started > 0) {
        pthread_mutex_lock(&p->mu);
        atomic_store(&p->stop, 1);
        atomic_fetch_add(&p->gen, 1);
        pthread_cond_broadcast(&p->cv_start);
        pthread_mutex_unlock(&p->mu);
        for (int i = 1; i <= p->n_started; i++) pthread_join(p->threads[i], NULL);
    }
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv_start);
    pthread_cond_destroy(&p->cv_done);
    kiln_free(p->threads);
    kiln_free(p->workers);
    kiln_free(p);
}

int kiln_pool_n_threads(const kiln_pool *p) { return p ? p->n_threads : 1; }

static void run_batch(kiln_pool *p, int offset, int n, kiln_pool_fn fn, void *ctx) {
    p->seq = (p->seq + 1) & 0xffffff;
    p->slot[p->seq & 1] = (job_slot){fn, ctx, offset};
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->claim, (p->seq << (2 * IDX_BITS)) | ((uint64_t)n << IDX_BITS),
                          memory_order_release);
    atomic_fetch_add(&p->gen, 1); /* seq_cst: pairs with the sleepers' announce-and-recheck */
    if (atomic_load(&p->n_sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv_start);
        pthread_mutex_unlock(&p->mu);
    }
    work(p, 0);
    for (int i = 0; i < SPIN_ITERS; i++) {
        if (atomic_load_explicit(&p->done, memory_order_acquire) == n) return;
        cpu_relax();
    }
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->owner_sleeping, 1);
    while (atomic_load(&p->done) != n) pthread_cond_wait(&p->cv_done, &p->mu);
    atomic_store(&p->owner_sleeping, 0);
    pthread_mutex_unlock(&p->mu);
}

void kiln_pool_run(kiln_pool *p, int n_tasks, kiln_pool_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (!p || p->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    for (int off = 0; off < n_tasks; off += MAX_BATCH)
        run_batch(p, off, n_tasks - off < MAX_BATCH ? n_tasks - off : MAX_BATCH, fn, ctx);
}
