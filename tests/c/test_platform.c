/*
 * test_platform.c - the platform layer (csrc/core/platform.h) on the OS it
 * runs on: Linux and macOS through POSIX, Windows (under wine here).
 *
 * Build and run (see the Makefile beside this file, and tools/ci/cross.sh
 * for the Windows build):
 *   make -C tests/c check
 *   ./test_platform        exit status 1 on any failure
 *
 * What is checked:
 *   - the clock is monotonic and advances across a 20 ms sleep by about
 *     that much (int64 nanoseconds: no overflow whatever time_t is);
 *   - the CPU count is at least 1, and is what the pool uses by default;
 *   - aligned blocks are aligned (64 bytes and 2 MiB), writable, freed;
 *   - the scratch cache (alloc.h): a freed huge block comes back for a
 *     request of its size or down to half of it, never for a larger one,
 *     at most 64 MiB is kept, and two threads allocating at once never
 *     share a block (with the cache off, in the sanitizer build, nothing
 *     is kept);
 *   - threads run, and a mutex and condition variable hand a count over;
 *   - Ctrl-C: with a handler of the caller's in place, an installed Ctrl-C
 *     raises the flag and still runs the caller's handler (POSIX:
 *     raise(SIGINT); Windows: GenerateConsoleCtrlEvent, which needs a
 *     console: without one the check says so and is skipped); nested
 *     installs count; the last uninstall puts the caller's handler back.
 */
#ifndef _WIN32
#define _GNU_SOURCE /* sigaction, nanosleep */
#endif

#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#ifdef _WIN32
#define WIN32_LEAN_AND_MEAN
#include <windows.h>
#else
#include <time.h>
#endif

#include "alloc.h"
#include "platform.h"
#include "threads.h"

#include "harness.h"

static void sleep_ms(int ms)
{
#ifdef _WIN32
    Sleep((DWORD)ms);
#else
    const struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
#endif
}

static void test_clock(void)
{
    const int64_t t0 = mha_now_ns();
    int64_t prev = t0, back = 0;
    for (int i = 0; i < 100000; i++) {
        const int64_t t = mha_now_ns();
        back += t < prev;
        prev = t;
    }
    CHECK(back == 0, "clock went back %lld times", (long long)back);
    const int64_t a = mha_now_ns();
    sleep_ms(20);
    const int64_t d = mha_now_ns() - a;
    CHECK(d >= 15000000 && d < 5000000000LL, "20 ms sleep measured %lld ns",
          (long long)d);
}

static void test_cpus_and_memory(void)
{
    const int n = mha_cpu_count();
    CHECK(n >= 1, "cpu count %d", n);
    if (getenv("MHATTN_NUM_THREADS") == NULL)
        CHECK(mha_get_num_threads() == (n < MHA_MAX_THREADS ? n : MHA_MAX_THREADS),
              "pool default %d, cpus %d", mha_get_num_threads(), n);
    const size_t aligns[2] = {64, (size_t)2 << 20};
    for (int k = 0; k < 2; k++) {
        const size_t bytes = 3 * aligns[k];
        unsigned char *p = mha_aligned_alloc(aligns[k], bytes);
        CHECK(p != NULL, "aligned_alloc(%zu, %zu)", aligns[k], bytes);
        if (p == NULL)
            continue;
        CHECK((uintptr_t)p % aligns[k] == 0, "block %p not aligned to %zu",
              (void *)p, aligns[k]);
        memset(p, 0xa5, bytes);
        mha_advise_huge(p, bytes);
        CHECK(p[bytes - 1] == 0xa5, "block contents");
        mha_aligned_free(p);
    }
    mha_aligned_free(NULL);
}

typedef struct {
    mha_mutex lock;
    mha_cond cv;
    int value;
} handoff;

static void bump(void *p)
{
    handoff *h = p;
    mha_mutex_lock(&h->lock);
    h->value++;
    mha_cond_broadcast(&h->cv);
    mha_mutex_unlock(&h->lock);
}

static void test_threads(void)
{
    handoff h;
    CHECK(mha_mutex_init(&h.lock) == 0 && mha_cond_init(&h.cv) == 0, "init");
    h.value = 0;
    void *args[8];
    for (int t = 0; t < 8; t++)
        args[t] = &h;
    run_threads(8, bump, args);
    CHECK(h.value == 8, "8 threads counted %d", h.value);
    CHECK(mha_thread_spawn(bump, &h) == 0, "spawn");
    mha_mutex_lock(&h.lock);
    while (h.value < 9)
        mha_cond_wait(&h.cv, &h.lock);
    mha_mutex_unlock(&h.lock);
    CHECK(h.value == 9, "detached thread");
    mha_cond_destroy(&h.cv);
    mha_mutex_destroy(&h.lock);
}

/* ---- Ctrl-C ---------------------------------------------------------- */

static volatile sig_atomic_t g_caller_seen;

static void caller_handler(int sig)
{
    (void)sig;
    g_caller_seen++;
#ifdef _WIN32
    signal(SIGINT, caller_handler); /* the C runtime resets it */
#endif
}

/* Sends one Ctrl-C to this process and waits up to 2 s for the caller's
   handler to have run. 0 when it cannot be sent (Windows without a
   console). */
static int send_ctrl_c(void)
{
    const sig_atomic_t before = g_caller_seen;
#ifdef _WIN32
    if (!GenerateConsoleCtrlEvent(CTRL_C_EVENT, 0))
        return 0;
#else
    raise(SIGINT);
#endif
    const int64_t t0 = mha_now_ns();
    while (g_caller_seen == before && mha_now_ns() - t0 < 2000000000)
        sleep_ms(1);
    return 1;
}

/* Is the caller's handler the one in place? */
static int caller_in_place(void)
{
#ifdef _WIN32
    void (*cur)(int) = signal(SIGINT, caller_handler);
    return cur == caller_handler;
#else
    struct sigaction cur;
    return sigaction(SIGINT, NULL, &cur) == 0 && !(cur.sa_flags & SA_SIGINFO) &&
           cur.sa_handler == caller_handler;
#endif
}

static void test_ctrl_c(void)
{
    if (!mha_sigint_supported()) {
        printf("ctrl-c: not supported on this platform, skipped\n");
        return;
    }
    CHECK(mha_sigint_setup() == 0 && mha_sigint_setup() == 0, "setup (twice)");
    signal(SIGINT, caller_handler);
    const volatile int *flag = mha_sigint_flag();
    mha_sigint_install();
    mha_sigint_install(); /* nested: counted */
    CHECK(*flag == 0, "flag low after install");
    if (!send_ctrl_c()) {
        printf("ctrl-c: no console to send CTRL_C_EVENT to, skipped\n");
        mha_sigint_uninstall();
        mha_sigint_uninstall();
        return;
    }
    CHECK(*flag == 1, "installed: Ctrl-C did not raise the flag");
    CHECK(g_caller_seen == 1, "installed: the caller's handler ran %d times",
          (int)g_caller_seen);
    mha_sigint_uninstall();
    mha_sigint_install(); /* lowers the flag; still installed underneath */
    CHECK(*flag == 0, "flag low after a new install");
    send_ctrl_c();
    CHECK(*flag == 1 && g_caller_seen == 2, "still installed: flag %d, caller %d",
          *flag, (int)g_caller_seen);
    mha_sigint_uninstall();
    mha_sigint_uninstall(); /* the last one: the caller's handler back */
    CHECK(caller_in_place(), "the caller's handler is not back");
    mha_sigint_install();
    mha_sigint_uninstall(); /* flag low, handler off */
    send_ctrl_c();
    CHECK(*flag == 0, "uninstalled: Ctrl-C still raised the flag");
    CHECK(g_caller_seen == 3, "uninstalled: the caller's handler ran %d times",
          (int)g_caller_seen);
    signal(SIGINT, SIG_DFL);
}

/* ---- the scratch cache ------------------------------------------------ */

#if defined(MHA_ALIGNED_CHECK)
#define CACHE_EXPECTED 0 /* alloc.c: off in this build */
#else
#define CACHE_EXPECTED 1
#endif
#define MIB ((size_t)1 << 20)

static unsigned char *scratch_bytes(size_t bytes)
{
    void *p = NULL;
    CHECK(mha_scratch(&p, bytes, 1) == MHA_OK && p != NULL, "scratch of %zu bytes", bytes);
    CHECK(p == NULL || (uintptr_t)p % 64 == 0, "scratch %p not aligned", p);
    if (p != NULL)
        memset(p, 0x5a, bytes); /* writable, all of it */
    return p;
}

/* Each of two threads: 100 rounds of a block of 2-6 MiB, filled with its
   own byte, checked, freed. */
typedef struct {
    unsigned char tag;
    int bad;
} churn_arg;

static void churn(void *p)
{
    churn_arg *a = p;
    for (int r = 0; r < 100; r++) {
        const size_t bytes = (size_t)(2 + (r + a->tag) % 5) * MIB;
        unsigned char *b = NULL;
        if (mha_scratch((void **)&b, bytes, 1) != MHA_OK || b == NULL) {
            a->bad++;
            continue;
        }
        memset(b, a->tag, bytes);
        for (size_t i = 0; i < bytes; i += 4093)
            a->bad += b[i] != a->tag;
        mha_scratch_free(b);
    }
}

static void test_scratch_cache(void)
{
    unsigned char *p = scratch_bytes(3 * MIB); /* 4 MiB of 2 MiB pages */
    mha_scratch_free(p);
    const size_t kept = mha_scratch_kept();
    CHECK(CACHE_EXPECTED ? kept >= 4 * MIB : kept == 0,
          "kept %zu bytes after freeing 4 MiB (cache %s)", kept, CACHE_EXPECTED ? "on" : "off");
    unsigned char *q = scratch_bytes(3 * MIB);
    CHECK(!CACHE_EXPECTED || q == p, "the same size again: %p, not the freed %p", (void *)q,
          (void *)p);
    mha_scratch_free(q);
    unsigned char *r = scratch_bytes(2 * MIB); /* half of the kept 4 MiB */
    CHECK(!CACHE_EXPECTED || r == p, "half the size: %p, not the freed %p", (void *)r,
          (void *)p);
    unsigned char *s = scratch_bytes(9 * MIB); /* larger than any kept */
    CHECK(s != p && s != r, "a larger block must be another");
    mha_scratch_free(r);
    mha_scratch_free(s);

    unsigned char *big[3];
    for (int i = 0; i < 3; i++)
        big[i] = scratch_bytes(30 * MIB);
    for (int i = 0; i < 3; i++)
        mha_scratch_free(big[i]);
    CHECK(mha_scratch_kept() <= 64 * MIB, "kept %zu bytes, over 64 MiB", mha_scratch_kept());

    churn_arg args[2] = {{1, 0}, {2, 0}};
    void *argp[2] = {&args[0], &args[1]};
    run_threads(2, churn, argp);
    CHECK(args[0].bad == 0 && args[1].bad == 0,
          "two threads: %d and %d bytes overwritten or blocks refused", args[0].bad,
          args[1].bad);
    CHECK(mha_scratch_kept() <= 64 * MIB, "kept %zu bytes, over 64 MiB", mha_scratch_kept());
}

int main(void)
{
    test_clock();
    test_cpus_and_memory();
    test_threads();
    test_scratch_cache();
    test_ctrl_c();
    printf("test_platform: %ld checks, %d failures (%d CPUs)\n", g_checks, g_failures,
           mha_cpu_count());
    return g_failures != 0;
}
