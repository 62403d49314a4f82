/*
 * test_threads.c - the pool (csrc/core/threads.h) when the cores are
 * oversubscribed: hog threads, twice as many as CPUs, as another library's
 * pool would be (OpenBLAS's threads spin ~0.1 s after each call): each hog
 * spins 200 us, sleeps 50 us, and spins again.
 *
 *   make -C tests/c check
 *   ./test_threads [quick]   exit status 1 on any failure (quick: fewer calls)
 *
 * What is checked:
 *   - under the hogs, thousands of short parallel calls (the shape of the
 *     phases of one attention call) each run every task exactly once, with
 *     ith in range, on more threads than CPUs;
 *   - the pool notices the contention: a worker finds it was descheduled
 *     while spinning, and the pool stops spinning for a while
 *     (mha_pool_calm_phases() > 0 at some point; the calls go on past the
 *     first 500 or 3000 until it does, for at most 20 s). The hogs' naps
 *     make it likely: a hog that wakes takes a CPU from whoever runs, a
 *     spinning worker among them. With hogs that only spun, a worker that
 *     slept between calls was woken, ran its tasks and spun its 50 us
 *     within one time slice in some runs, so none was seen descheduled
 *     mid-spin (0 alarms in 10033 calls once on CI; 1-4 late workers in
 *     3000 calls in 1 of 8 runs here, 14-36 in the others). With the naps,
 *     30-54 workers were seen preempted mid-spin in each of 8 runs of 3000
 *     calls (Zen 3 VM, 2 CPUs);
 *   - the calm phases run out after the hogs stop (the count goes down by
 *     one per call, and reaches 0 once the calls find no contention, which
 *     on a shared machine is not guaranteed: only the countdown is checked).
 */
#ifndef _WIN32
#define _GNU_SOURCE /* nanosleep */
#endif

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef _WIN32
#define WIN32_LEAN_AND_MEAN
#include <windows.h>
#else
#include <time.h>
#endif

#include "platform.h"
#include "threads.h"

#include "harness.h"

static atomic_int g_stop, g_hogs_running;

static void nap_50us(void)
{
#ifdef _WIN32
    Sleep(0); /* not run on Windows (no wine run of this test); compiles */
#else
    const struct timespec ts = {0, 50000};
    nanosleep(&ts, NULL);
#endif
}

static void hog(void *arg)
{
    (void)arg;
    atomic_fetch_add(&g_hogs_running, 1);
    while (!atomic_load_explicit(&g_stop, memory_order_relaxed)) {
        const int64_t t0 = mha_now_ns();
        while (mha_now_ns() - t0 < 200000 &&
               !atomic_load_explicit(&g_stop, memory_order_relaxed))
            mha_cpu_relax();
        nap_50us();
    }
    atomic_fetch_sub(&g_hogs_running, 1);
}

typedef struct {
    atomic_int hits[64];
    int nth;
    atomic_int bad_ith;
    double out[64]; /* keeps each task's work from being optimised away */
} job;

static void task(void *ctxp, size_t t, int ith)
{
    job *j = ctxp;
    atomic_fetch_add(&j->hits[t], 1);
    if (ith < 0 || ith >= j->nth)
        atomic_fetch_add(&j->bad_ith, 1);
    double acc = 0; /* ~10 us of work (a sequential sum: no reassociation) */
    for (int i = 0; i < 20000; i++)
        acc += (double)i * 0.5;
    j->out[t] = acc;
}

/* At least ncalls calls of 64 tasks on nth threads, then more until the
   pool is calm or max_s seconds have passed (0: no more); returns the
   largest calm count seen between calls, counts the calls that ran a task
   not once, and the calls made (in *made, if not NULL). */
static int run_calls(int ncalls, int nth, int *wrong_calls, double max_s, int *made)
{
    int calm_max = 0;
    const double t0 = now_s();
    int c = 0;
    for (; c < ncalls || (calm_max == 0 && now_s() - t0 < max_s); c++) {
        job j;
        for (int t = 0; t < 64; t++)
            atomic_init(&j.hits[t], 0);
        j.nth = nth;
        atomic_init(&j.bad_ith, 0);
        CHECK(mha_parallel_for_n(64, nth, task, &j) == MHA_OK, "status");
        int wrong = atomic_load(&j.bad_ith) != 0;
        for (int t = 0; t < 64; t++)
            wrong |= atomic_load(&j.hits[t]) != 1;
        *wrong_calls += wrong;
        const int calm = mha_pool_calm_phases();
        CHECK(calm >= 0, "calm count %d between calls", calm);
        if (calm > calm_max)
            calm_max = calm;
    }
    if (made)
        *made = c;
    return calm_max;
}

int main(int argc, char **argv)
{
    const int quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    const int ncpu = mha_cpu_count();
    const int nth = ncpu + 1 < 3 ? 3 : ncpu + 1;
    int wrong = 0;
    CHECK(mha_pool_calm_phases() == 0, "no pool yet: calm %d", mha_pool_calm_phases());
    run_calls(50, nth, &wrong, 0, NULL); /* the pool exists */

    const int nhogs = 2 * ncpu;
    int spawned = 0;
    for (int h = 0; h < nhogs; h++)
        spawned += mha_thread_spawn(hog, NULL) == 0;
    CHECK(spawned == nhogs, "spawned %d of %d hogs", spawned, nhogs);
    /* Whether a given call sees a worker preempted mid-spin is up to the
       scheduler (CI once saw none in 500 calls under ASan), so the calls go
       on until the pool notices, for at most 20 s. */
    int made = 0;
    const int calm_max =
        run_calls(quick ? 500 : 3000, nth, &wrong, 20.0, &made);
    atomic_store(&g_stop, 1);
    while (atomic_load(&g_hogs_running) > 0)
        mha_cpu_relax();
    CHECK(wrong == 0, "%d calls under contention ran a task not once", wrong);
    CHECK(calm_max > 0, "the pool never noticed %d hogs on %d CPUs", nhogs, ncpu);

    /* The countdown: each call uses up one calm phase. */
    const int before = mha_pool_calm_phases();
    run_calls(1, nth, &wrong, 0, NULL);
    const int after = mha_pool_calm_phases();
    CHECK(before == 0 || after < before || after == MHA_POOL_CALM_PHASES,
          "calm phases %d -> %d after one call (down by one, or re-armed)", before,
          after);
    CHECK(wrong == 0, "a call after the hogs ran a task not once");
    printf("test_threads: %ld checks, %d failures (%d CPUs, %d threads, %d hogs, "
           "calm up to %d in %d calls)\n",
           g_checks, g_failures, ncpu, nth, nhogs, calm_max, made);
    return g_failures != 0;
}
