/*
 * threads.h - the core's persistent thread pool (platform.h threads, not OpenMP).
 *
 * mha_parallel_for runs fn(ctx, task, ith) once for every task index in
 * [0, ntasks). Tasks are grabbed dynamically, so which thread runs a task
 * varies from call to call: a task must own its outputs exclusively and
 * must not depend on ith except to pick per-thread scratch. Then results do
 * not depend on the thread count.
 *
 * The calling thread takes part (as ith == 0). The call runs every task
 * inline in the caller (ith == 0 throughout) when one thread is set, when
 * called from inside a task (nesting), or when another OS thread is using
 * the pool at that moment (no waiting, no deadlock).
 *
 * Waiting threads spin for up to 50 us, then sleep; while the cores are
 * oversubscribed (a worker finds it was descheduled while spinning) they
 * sleep at once, so that the pool neither loses its slices to, nor takes
 * them from, another library's spinning threads. Once every task has been
 * handed out the call waits only for the workers running one: a worker
 * that had not woken by then takes no part in that call.
 *
 * Default thread count: the CPUs in this process's affinity mask, or the
 * environment variable MHATTN_NUM_THREADS (read once) when it is a positive
 * integer. The pool survives fork(): the child's first call respawns it.
 */
#ifndef MHA_THREADS_H
#define MHA_THREADS_H

#include <stddef.h>

#include "mha.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Upper bound on any thread count the pool uses. */
#define MHA_MAX_THREADS 256

typedef void (*mha_task_fn)(void *ctx, size_t task, int ith);

/* Runs every task on at most mha_get_num_threads() threads. ith is below
   that count as read at the start of the call; a caller that sizes
   per-thread scratch by ith should use mha_parallel_for_n instead. */
mha_status mha_parallel_for(size_t ntasks, mha_task_fn fn, void *ctx);

/* Same, on at most nth threads (nth <= 0: mha_get_num_threads()). Always
   0 <= ith < max(nth, 1). */
mha_status mha_parallel_for_n(size_t ntasks, int nth, mha_task_fn fn,
                              void *ctx);

/* n <= 0 restores the default. Takes effect at the next call; safe while
   other threads are inside mha_parallel_for. */
void mha_set_num_threads(int n);
int mha_get_num_threads(void);

/* Nonzero inside a task (where a nested mha_parallel_for runs inline). */
int mha_in_parallel(void);

/* The phases left in which the pool's threads do not spin, because a
   worker found itself descheduled while spinning (other threads want the
   cores; see threads.c). 0 when spinning, or before the pool exists; -1
   while a call is using the pool. For tests and diagnostics: the value is
   only a snapshot. */
int mha_pool_calm_phases(void);

/* The phases a contention alarm makes calm: about one call at (T=128,
   d_model=512, h=8). Contention that lasts (another pool's threads spin
   for ~0.1 s after each of its calls) raises the alarm again at the first
   phase that spins; contention that passes (the OS woke a worker on its
   waker's CPU and moves it a few ms later) costs no more than a call.
   (At 256 phases, ~15 such calls, a transient alarm after each idle spell
   cost more than spinning through it.) */
#define MHA_POOL_CALM_PHASES 16

#ifdef __cplusplus
}
#endif

#endif /* MHA_THREADS_H */
