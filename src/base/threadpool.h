/*
 * threadpool.h -- a persistent pool of pthreads for parallel-for with static partitioning.
 *
 * kiln_pool_run(pool, n_tasks, fn, ctx) calls fn(ctx, task, thread) once for every task in
 * [0, n_tasks) and returns when all have finished. The split into tasks is static (the
 * caller's choice); threads (the caller is thread 0) claim tasks with an atomic counter, so
 * which thread runs a task varies. kiln's ops make every output element the work of exactly
 * one task, computed in a fixed order, so results never depend on the thread count or on
 * scheduling. Workers spin briefly after a job (decode issues hundreds of small jobs per
 * token) and then sleep on a condition variable.
 *
 * A pool is driven by one thread at a time (the one that owns it); fn must not call
 * kiln_pool_run on the same pool.
 */
#ifndef KILN_THREADPOOL_H
#define KILN_THREADPOOL_H

#include "base.h"

typedef struct kiln_pool kiln_pool;

/* task in [0, n_tasks); thread in [0, n_threads): index for per-thread scratch. */
typedef void (*kiln_pool_fn)(void *ctx, int task, int thread);

/* A pool of n_threads threads in all, counting the caller (n_threads <= 0: all CPUs). */
kiln_status kiln_pool_create(int n_threads, kiln_pool **out);
/* Joins the workers. NULL is a no-op. */
void kiln_pool_free(kiln_pool *pool);
int kiln_pool_n_threads(const kiln_pool *pool);
/* Run fn over n_tasks tasks (n_tasks <= 0 does nothing). pool may be NULL: runs inline. */
void kiln_pool_run(kiln_pool *pool, int n_tasks, kiln_pool_fn fn, void *ctx);

#endif /* KILN_THREADPOOL_H */
