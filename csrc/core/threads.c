/*
 * threads.c - a small persistent thread pool (see threads.h).
 *
 * One pool per process, used by one caller at a time. Whoever wins the
 * g_busy flag (a compare-and-swap, never a blocking lock) owns the pool for
 * the call: it grows the worker set if needed, publishes the job under the
 * pool mutex, bumps the generation counter and broadcasts. Workers wait for
 * a new generation (a short spin, then the condition variable), join it,
 * grab task indices from an atomic counter, and count themselves out; the
 * caller works too, then closes the generation and waits for the workers
 * that joined it. A caller that loses the flag runs its tasks inline.
 *
 * Joining (`state`: the generation, a closed bit and the count of workers
 * in it, in one atomic word). A worker joins only while the generation it
 * read is the current one and still open. The caller closes it once every
 * task has been handed out, so it waits only for workers that are running
 * tasks, never for one that has not yet woken: one descheduled behind
 * another library's spinning threads, or asleep after an idle spell, would
 * otherwise hold up a call that the caller had already finished alone. A
 * worker that comes too late goes back to waiting; it joined nothing, so
 * it touches nothing of that call. Which tasks a thread runs changes, the
 * tasks do not, and so neither do the results.
 *
 * Manners under contention. Spinning pays only while each waiter has a
 * core to itself. When another pool's threads are spinning too (OpenBLAS
 * spins for about 0.1 s after every call by default), a spinning worker
 * shares its core with them, is descheduled for whole time slices, and
 * holds up every phase; its spinning also takes that core from them. So a
 * worker checks whether it was off its CPU while it meant to spin: it saw
 * the new generation more than LATE_NS after the caller published it, or
 * two reads of the clock in its spin loop were more than LATE_NS apart.
 * Either means that the worker lost its CPU. That is contention when the
 * OS gave the CPU to another of its threads (the worker was preempted:
 * mha_thread_preemptions moved since its last check), and then nobody in
 * the pool (workers and the waiting caller) spins for the next
 * CALM_PHASES phases: they go straight to the condition variable. A
 * virtual machine's host that deschedules the whole virtual CPU (steal
 * time) makes the worker late too, but no other thread of this OS waits
 * for that core, so spinning still pays. Where preemptions cannot be
 * counted, every late worker counts as contention. (Calls at (T=128,
 * d_model=512, h=8) after 0.1 s idle spells, as in a notebook or
 * bench.py's interleaving, Zen 4 VM: late workers after nearly every
 * spell, about half of them not preempted; with those alarms, and 256
 * calm phases per alarm, the calls took 1.1-1.8x as long as with no
 * contention check at all.) A
 * sleeping worker is woken ahead of a thread that has been spinning (the
 * scheduler favours threads that slept), and a caller that sleeps leaves
 * its core idle, so that the kernel can move a descheduled worker there.
 * After CALM_PHASES phases the pool spins again, which probes whether the
 * contention is gone. (sched_yield would not do: on Linux's EEVDF
 * scheduler a yield puts the yielding thread behind a spinning peer for a
 * whole slice.) This changes only who waits how: the tasks, and so the
 * results, are the same.
 *
 * Because workers can only be released by the owner of g_busy, a worker
 * that joined generation g counts itself out before g + 1 is published; a
 * worker that did not may wake to find g + 1 or later, and joins that.
 *
 * Fork: the child inherits the memory of the pool but none of its threads
 * (and maybe a mutex held by a thread that no longer exists), so the fork
 * child handler (mha_atfork_child) forgets the pool (leaking it,
 * deliberately) and clears g_busy; the next call builds a fresh one.
 * Nothing is locked around fork, so the parent can never deadlock on it.
 * pool_get returns only once each new worker has started (freed its
 * start-up blocks and reached its loop): a worker is then in the allocator
 * only inside a task, so when a call of ours returns, none is, and a fork
 * right after it cannot inherit an allocator lock held by one. (glibc's
 * malloc takes its locks around fork; ASan's quarantine, in clang 14's
 * runtime, does not: the child of a fork taken while a new worker freed its
 * start-up block spun forever in tests/c/test_gemm's ASan build.)
 *
 * Threads, locks, the CPU count and the clock come from platform.h: this
 * file is ISO C11.
 */
#include "threads.h"

#include "platform.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

/* How long a worker (or the waiting caller) spins before sleeping: long
   enough to bridge back-to-back calls such as the pack and compute phases
   of one GEMM, short enough not to hold a core hostage. */
#define SPIN_NS 50000

/* A worker that meant to spin but finds it was off its CPU for longer than
   this (a time slice is ~1 ms; a spinning thread that holds its core sees
   the new generation within ~1 us) concludes that the cores are
   oversubscribed. */
#define LATE_NS 50000

/* After that, the phases in which nobody spins (threads.h). */
#define CALM_PHASES MHA_POOL_CALM_PHASES

typedef struct {
    mha_mutex lock;
    mha_cond wake; /* workers: a new generation was published */
    mha_cond done; /* caller: no worker left in a closed gen  */
    int nworkers;        /* spawned workers, ith 1..nworkers; owner only */
    int nstarted;        /* workers past their start-up, under lock; `done`
                            is signalled as each one starts */
    /* The job; written under lock before gen moves, read under lock. */
    mha_task_fn fn;
    void *ctx;
    size_t ntasks;
    int nactive; /* workers 1..nactive take part */
    int64_t published_ns; /* when gen last moved (mha_now_ns) */
    atomic_size_t next;
    atomic_uint gen;
    /* (gen << 32) | STATE_CLOSED | the workers in gen: see the top */
    atomic_uint_least64_t state;
    /* Phases left in which nobody spins (see the top of the file); set by
       any worker, counted down by the caller at each publish. */
    atomic_int calm;
} pool_t;

typedef struct {
    pool_t *p;
    int ith;
    unsigned gen0; /* generation before the worker's first job */
} worker_arg;

#define STATE_CLOSED ((uint64_t)1 << 31)
#define STATE_COUNT (STATE_CLOSED - 1)

static pool_t *g_pool;            /* touched only by the g_busy owner */
static atomic_int g_busy;         /* 1 while some caller owns the pool */
static int g_atfork_registered;   /* idem                             */
static atomic_int g_nth_set;      /* 0: default                       */
static atomic_int g_nth_default;  /* 0: not yet computed              */
static _Thread_local int tls_in_task;

static void run_tasks(pool_t *p, mha_task_fn fn, void *ctx, size_t ntasks,
                      int ith)
{
    for (;;) {
        const size_t t =
            atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
        if (t >= ntasks)
            break;
        fn(ctx, t, ith);
    }
}

/* Spins until *gen differs from seen, for at most SPIN_NS; returns the
   largest gap seen between two reads of the clock (0 when it did not spin:
   the pool is calm). */
static int64_t spin_for_gen(pool_t *p, unsigned seen)
{
    if (atomic_load_explicit(&p->calm, memory_order_relaxed) > 0)
        return 0;
    const int64_t t0 = mha_now_ns();
    int64_t last = t0, gap = 0;
    for (unsigned i = 1;
         atomic_load_explicit(&p->gen, memory_order_acquire) == seen; i++) {
        mha_cpu_relax();
        if ((i & 255) == 0) {
            const int64_t now = mha_now_ns();
            if (now - last > gap)
                gap = now - last;
            last = now;
            if (now - t0 > SPIN_NS || gap > LATE_NS)
                break;
        }
    }
    return gap > 0 ? gap : 1;
}

static void worker_main(void *argp)
{
    worker_arg arg = *(worker_arg *)argp;
    free(argp);
    pool_t *p = arg.p;
    unsigned seen = arg.gen0;
    /* this thread's preemptions at its last sleep or contention check */
    long preempted = mha_thread_preemptions();
    tls_in_task = 1; /* anything a task calls runs inline */
    mha_mutex_lock(&p->lock); /* started: pool_get may return */
    p->nstarted++;
    mha_cond_broadcast(&p->done);
    mha_mutex_unlock(&p->lock);
    for (;;) {
        /* 1. wait for a new generation: spin a little (unless the pool is
              calm), then sleep */
        const int64_t gap = spin_for_gen(p, seen);
        const int spun_into_it =
            gap > 0 &&
            atomic_load_explicit(&p->gen, memory_order_relaxed) != seen;
        mha_mutex_lock(&p->lock);
        if (atomic_load_explicit(&p->gen, memory_order_relaxed) == seen) {
            do
                mha_cond_wait(&p->wake, &p->lock);
            while (atomic_load_explicit(&p->gen, memory_order_relaxed) == seen);
            preempted = mha_thread_preemptions(); /* a new epoch after a sleep */
        }
        seen = atomic_load_explicit(&p->gen, memory_order_relaxed);
        const int active = arg.ith <= p->nactive;
        const mha_task_fn fn = p->fn;
        void *const ctx = p->ctx;
        const size_t ntasks = p->ntasks;
        const int64_t published = p->published_ns;
        mha_mutex_unlock(&p->lock);
        /* 2. off the CPU while spinning, for another of the OS's threads?
              then the cores are contended */
        if (gap > LATE_NS || (spun_into_it && mha_now_ns() - published > LATE_NS)) {
            const long now = mha_thread_preemptions();
            if (now < 0 || now != preempted)
                atomic_store_explicit(&p->calm, CALM_PHASES, memory_order_relaxed);
            preempted = now;
        }
        if (!active)
            continue;
        /* 3. join generation `seen` if it is still current and open (else
              the caller has handed out every task and returns without us) */
        uint64_t st = atomic_load(&p->state);
        int joined = 0;
        while (!joined && (unsigned)(st >> 32) == seen && !(st & STATE_CLOSED))
            joined = atomic_compare_exchange_weak(&p->state, &st, st + 1);
        if (!joined)
            continue;
        /* 4. work, then count out; the last one out of a closed generation
              wakes the caller */
        run_tasks(p, fn, ctx, ntasks, arg.ith);
        st = atomic_fetch_sub(&p->state, 1) - 1;
        if ((st & STATE_COUNT) == 0 && (st & STATE_CLOSED)) {
            mha_mutex_lock(&p->lock);
            mha_cond_signal(&p->done);
            mha_mutex_unlock(&p->lock);
        }
    }
}

static void atfork_child(void)
{
    g_pool = NULL; /* leaked: its mutex may be held by a vanished thread */
    atomic_store(&g_busy, 0);
}

/* The pool with as many workers as we could get, up to nwant; NULL if even
   the pool itself could not be made. Called by the g_busy owner only. */
static pool_t *pool_get(int nwant)
{
    pool_t *p = g_pool;
    if (p == NULL) {
        if (!g_atfork_registered) {
            if (mha_atfork_child(atfork_child) != 0)
                return NULL; /* unsafe across fork: stay single-threaded */
            g_atfork_registered = 1;
        }
        p = calloc(1, sizeof *p);
        if (p == NULL)
            return NULL;
        if (mha_mutex_init(&p->lock) != 0) {
            free(p);
            return NULL;
        }
        if (mha_cond_init(&p->wake) != 0) {
            mha_mutex_destroy(&p->lock);
            free(p);
            return NULL;
        }
        if (mha_cond_init(&p->done) != 0) {
            mha_cond_destroy(&p->wake);
            mha_mutex_destroy(&p->lock);
            free(p);
            return NULL;
        }
        atomic_init(&p->next, 0);
        atomic_init(&p->gen, 0);
        atomic_init(&p->state, 0);
        atomic_init(&p->calm, 0);
        g_pool = p;
    }
    if (p->nworkers >= nwant)
        return p;

    /* Workers block every signal (mha_thread_spawn), so that signals
       (SIGINT for Python's KeyboardInterrupt) go to the threads that
       expect them. */
    while (p->nworkers < nwant) {
        worker_arg *arg = malloc(sizeof *arg);
        if (arg == NULL)
            break;
        arg->p = p;
        arg->ith = p->nworkers + 1;
        arg->gen0 = atomic_load(&p->gen);
        if (mha_thread_spawn(worker_main, arg) != 0) {
            free(arg);
            break; /* run with fewer workers: results do not change */
        }
        p->nworkers++;
    }
    mha_mutex_lock(&p->lock);
    while (p->nstarted < p->nworkers)
        mha_cond_wait(&p->done, &p->lock);
    mha_mutex_unlock(&p->lock);
    return p;
}

static void run_inline(size_t ntasks, mha_task_fn fn, void *ctx)
{
    const int saved = tls_in_task;
    tls_in_task = 1;
    for (size_t t = 0; t < ntasks; t++)
        fn(ctx, t, 0);
    tls_in_task = saved;
}

mha_status mha_parallel_for_n(size_t ntasks, int nth, mha_task_fn fn,
                              void *ctx)
{
    if (ntasks == 0)
        return MHA_OK;
    if (fn == NULL)
        return MHA_ERR_ARG;
    if (nth <= 0)
        nth = mha_get_num_threads();
    if (nth > MHA_MAX_THREADS)
        nth = MHA_MAX_THREADS;
    if ((size_t)nth > ntasks)
        nth = (int)ntasks;
    if (nth <= 1 || tls_in_task) {
        run_inline(ntasks, fn, ctx);
        return MHA_OK;
    }
    int expected = 0;
    if (!atomic_compare_exchange_strong(&g_busy, &expected, 1)) {
        run_inline(ntasks, fn, ctx); /* another OS thread has the pool */
        return MHA_OK;
    }
    pool_t *p = pool_get(nth - 1);
    if (p == NULL || p->nworkers == 0) {
        atomic_store(&g_busy, 0);
        run_inline(ntasks, fn, ctx);
        return MHA_OK;
    }
    const int nactive = nth - 1 < p->nworkers ? nth - 1 : p->nworkers;

    /* 1. publish the job (and count down the calm phases) */
    const int calm = atomic_load_explicit(&p->calm, memory_order_relaxed);
    if (calm > 0)
        atomic_store_explicit(&p->calm, calm - 1, memory_order_relaxed);
    mha_mutex_lock(&p->lock);
    p->fn = fn;
    p->ctx = ctx;
    p->ntasks = ntasks;
    p->nactive = nactive;
    atomic_store(&p->next, 0);
    const unsigned gen = atomic_load_explicit(&p->gen, memory_order_relaxed) + 1u;
    atomic_store(&p->state, (uint64_t)gen << 32); /* open, nobody in it */
    p->published_ns = mha_now_ns();
    atomic_store_explicit(&p->gen, gen, memory_order_release);
    mha_cond_broadcast(&p->wake);
    mha_mutex_unlock(&p->lock);

    /* 2. work alongside */
    tls_in_task = 1;
    run_tasks(p, fn, ctx, ntasks, 0);
    tls_in_task = 0;

    /* 3. every task is handed out: close the generation, and wait for
          the workers in it: spin a little (unless the pool is calm: then a
          sleeping caller leaves its core to a descheduled worker), then
          sleep */
    if ((atomic_fetch_or(&p->state, STATE_CLOSED) & STATE_COUNT) != 0) {
        if (calm == 0) {
            const int64_t t0 = mha_now_ns();
            for (unsigned i = 1; (atomic_load(&p->state) & STATE_COUNT) != 0; i++) {
                mha_cpu_relax();
                if ((i & 255) == 0 && mha_now_ns() - t0 > SPIN_NS)
                    break;
            }
        }
        if ((atomic_load(&p->state) & STATE_COUNT) != 0) {
            mha_mutex_lock(&p->lock);
            while ((atomic_load(&p->state) & STATE_COUNT) != 0)
                mha_cond_wait(&p->done, &p->lock);
            mha_mutex_unlock(&p->lock);
        }
    }
    atomic_store(&g_busy, 0);
    return MHA_OK;
}

mha_status mha_parallel_for(size_t ntasks, mha_task_fn fn, void *ctx)
{
    return mha_parallel_for_n(ntasks, 0, fn, ctx);
}

static int default_threads(void)
{
    int v = atomic_load_explicit(&g_nth_default, memory_order_relaxed);
    if (v > 0)
        return v;
    v = 0;
    const char *s = getenv("MHATTN_NUM_THREADS");
    if (s != NULL && *s != '\0') {
        char *end;
        const long n = strtol(s, &end, 10);
        while (*end == ' ' || *end == '\t' || *end == '\n')
            end++;
        if (*end == '\0' && n > 0)
            v = n > MHA_MAX_THREADS ? MHA_MAX_THREADS : (int)n;
    }
    if (v == 0) {
        const int n = mha_cpu_count();
        v = n > MHA_MAX_THREADS ? MHA_MAX_THREADS : n;
    }
    if (v > MHA_MAX_THREADS)
        v = MHA_MAX_THREADS;
    atomic_store(&g_nth_default, v);
    return v;
}

void mha_set_num_threads(int n)
{
    if (n > MHA_MAX_THREADS)
        n = MHA_MAX_THREADS;
    atomic_store(&g_nth_set, n > 0 ? n : 0);
}

int mha_get_num_threads(void)
{
    const int n = atomic_load(&g_nth_set);
    return n > 0 ? n : default_threads();
}

int mha_in_parallel(void)
{
    return tls_in_task;
}

int mha_pool_calm_phases(void)
{
    int expected = 0;
    if (!atomic_compare_exchange_strong(&g_busy, &expected, 1))
        return -1; /* some call owns the pool: g_pool is its to touch */
    const int n =
        g_pool == NULL ? 0 : atomic_load_explicit(&g_pool->calm, memory_order_relaxed);
    atomic_store(&g_busy, 0);
    return n;
}
