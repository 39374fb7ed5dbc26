/*
 * threadpool.c -- see threadpool.h.
 *
 * Protocol. The owner publishes a job (fn, ctx, n_tasks), sets pending = n_threads - 1 and
 * bumps the generation counter gen (release). A worker waits for gen to change: first by
 * spinning, then by sleeping on cv_start after announcing itself in n_sleepers. The
 * announce-then-recheck (worker) and publish-then-check-sleepers (owner) pairs are seq_cst,
 * so either the owner sees the sleeper and broadcasts under the mutex, or the worker sees
 * the new generation and does not sleep: no lost wake-ups. Completion mirrors this with
 * pending / owner_sleeping / cv_done.
 */
#include "threadpool.h"

#include <pthread.h>
#include <stdatomic.h>

#define SPIN_ITERS (1 << 15)

typedef struct worker {
    kiln_pool *pool;
    int index;
} worker;

struct kiln_pool {
    int n_threads;
    pthread_t *threads;
    worker *workers;
    int n_started;

    /* the current job: written by the owner before gen is bumped */
    kiln_pool_fn fn;
    void *ctx;
    int n_tasks;

    _Atomic uint64_t gen;
    _Atomic int pending;
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

static void run_share(kiln_pool *p, int thread) {
    for (int t = thread; t < p->n_tasks; t += p->n_threads) p->fn(p->ctx, t, thread);
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
        run_share(p, w->index);
        if (atomic_fetch_sub_explicit(&p->pending, 1, memory_order_acq_rel) == 1) {
            if (atomic_load(&p->owner_sleeping)) {
                pthread_mutex_lock(&p->mu);
                pthread_cond_signal(&p->cv_done);
                pthread_mutex_unlock(&p->mu);
            }
        }
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

void kiln_pool_run(kiln_pool *p, int n_tasks, kiln_pool_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (!p || p->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store_explicit(&p->pending, p->n_threads - 1, memory_order_relaxed);
    atomic_fetch_add(&p->gen, 1); /* seq_cst: publishes the job */
    if (atomic_load(&p->n_sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv_start);
        pthread_mutex_unlock(&p->mu);
    }
    run_share(p, 0);
    for (int i = 0; i < SPIN_ITERS; i++) {
        if (atomic_load_explicit(&p->pending, memory_order_acquire) == 0) return;
        cpu_relax();
    }
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->owner_sleeping, 1);
    while (atomic_load(&p->pending) != 0) pthread_cond_wait(&p->cv_done, &p->mu);
    atomic_store(&p->owner_sleeping, 0);
    pthread_mutex_unlock(&p->mu);
}
