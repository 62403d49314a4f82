/*
 * platform.c - the OS-specific code of the core (contract in platform.h).
 *
 * Two implementations side by side: _WIN32 (Win32 API, MSVC or MinGW) and
 * POSIX (everything else). Each section is short; what differs between
 * Linux and macOS is inside the POSIX one.
 */
#if !defined(_WIN32) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT, madvise, sigaction, RUSAGE_THREAD */
#endif

#include "platform.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#ifdef _WIN32
#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#include <windows.h>
#include <malloc.h>  /* _aligned_malloc */
#include <process.h> /* _beginthreadex */
#else
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/mman.h>
#include <sys/resource.h> /* getrusage(RUSAGE_THREAD) */
#endif
#if defined(__APPLE__)
#include <sys/sysctl.h>
#endif
#endif

#if defined(_MSC_VER) && (defined(_M_X64) || defined(_M_IX86) || defined(_M_ARM64))
#include <intrin.h>
#elif defined(__x86_64__) || defined(__i386__)
#include <immintrin.h> /* _mm_pause: SSE2, baseline on x86-64 */
#endif

/* ---- spinning --------------------------------------------------------- */

void mha_cpu_relax(void)
{
#if defined(_M_X64) || defined(_M_IX86) || defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(_MSC_VER) && defined(_M_ARM64)
    __yield();
#elif defined(__aarch64__) || (defined(__arm__) && defined(__ARM_ARCH) && __ARM_ARCH >= 7)
    __asm__ __volatile__("yield");
#endif
}

/* ---- the usable CPUs -------------------------------------------------- */

int mha_cpu_count(void)
{
    long n = 0;
#if defined(_WIN32)
    /* The process's mask covers its processor group (at most 64 CPUs). */
    DWORD_PTR proc, sys;
    if (GetProcessAffinityMask(GetCurrentProcess(), &proc, &sys))
        for (; proc != 0; proc &= proc - 1)
            n++;
    if (n <= 0) {
        SYSTEM_INFO si;
        GetSystemInfo(&si);
        n = (long)si.dwNumberOfProcessors;
    }
#else
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) == 0)
        n = CPU_COUNT(&set);
#elif defined(__APPLE__)
    /* macOS has no affinity masks: the CPUs currently active. */
    int active = 0;
    size_t len = sizeof active;
    if (sysctlbyname("hw.activecpu", &active, &len, NULL, 0) == 0)
        n = active;
#endif
    if (n <= 0)
        n = sysconf(_SC_NPROCESSORS_ONLN);
#endif
    if (n <= 0)
        return 1;
    return n > 1 << 20 ? 1 << 20 : (int)n;
}

/* ---- memory ----------------------------------------------------------- */

/*
 * MHA_ALIGNED_CHECK (the C tests' sanitizer build defines it): blocks come
 * from malloc at an offset, the original pointer stored just below, so a
 * block that reaches plain free() instead of mha_aligned_free is an
 * AddressSanitizer error on Linux, as it is a heap corruption on Windows.
 */
#if defined(MHA_ALIGNED_CHECK)
void *mha_aligned_alloc(size_t align, size_t bytes)
{
    if (bytes > SIZE_MAX - align - sizeof(void *))
        return NULL;
    char *raw = malloc(bytes + align + sizeof(void *));
    if (raw == NULL)
        return NULL;
    const uintptr_t at = ((uintptr_t)(raw + sizeof(void *)) + align - 1) &
                         ~(uintptr_t)(align - 1);
    char *p = raw + (at - (uintptr_t)raw);
    memcpy(p - sizeof(void *), &raw, sizeof raw);
    return p;
}

void mha_aligned_free(void *p)
{
    if (p != NULL) {
        void *raw;
        memcpy(&raw, (char *)p - sizeof(void *), sizeof raw);
        free(raw);
    }
}
#elif defined(_WIN32)
void *mha_aligned_alloc(size_t align, size_t bytes)
{
    return _aligned_malloc(bytes, align);
}

void mha_aligned_free(void *p)
{
    _aligned_free(p);
}
#else
void *mha_aligned_alloc(size_t align, size_t bytes)
{
    /* posix_memalign rather than aligned_alloc: macOS has it since always */
    void *p;
    return posix_memalign(&p, align, bytes) == 0 ? p : NULL;
}

void mha_aligned_free(void *p)
{
    free(p);
}
#endif

void mha_advise_huge(void *p, size_t bytes)
{
#if defined(__linux__) && defined(MADV_HUGEPAGE) && !defined(MHA_ALIGNED_CHECK)
    (void)madvise(p, bytes, MADV_HUGEPAGE); /* advice: failure is harmless */
#else
    (void)p;
    (void)bytes;
#endif
}

/* ---- time ------------------------------------------------------------- */

int64_t mha_now_ns(void)
{
#ifdef _WIN32
    static LARGE_INTEGER freq; /* the same value in every thread */
    LARGE_INTEGER c;
    if (freq.QuadPart == 0)
        QueryPerformanceFrequency(&freq);
    QueryPerformanceCounter(&c);
    /* seconds and remainder apart: c * 1e9 alone overflows after days */
    const int64_t f = freq.QuadPart, t = c.QuadPart;
    return t / f * 1000000000 + t % f * 1000000000 / f;
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    /* int64 first: (long)tv_sec * 1e9 overflows a 32-bit long in 2 s */
    return (int64_t)ts.tv_sec * 1000000000 + (int64_t)ts.tv_nsec;
#endif
}

long mha_thread_preemptions(void)
{
#if defined(__linux__) && defined(RUSAGE_THREAD)
    struct rusage ru;
    if (getrusage(RUSAGE_THREAD, &ru) == 0)
        return ru.ru_nivcsw;
#endif
    return -1;
}

/* ---- threads ---------------------------------------------------------- */

/* What a new thread runs, in a block the spawner allocates and the thread
   frees (start_run) before it calls fn(arg). */
typedef struct {
    void (*fn)(void *);
    void *arg;
} start_arg;

static start_arg *start_arg_new(void (*fn)(void *), void *arg)
{
    start_arg *a = malloc(sizeof *a);
    if (a != NULL)
        *a = (start_arg){fn, arg};
    return a;
}

static void start_run(void *p)
{
    const start_arg a = *(start_arg *)p;
    free(p);
    a.fn(a.arg);
}

#ifdef _WIN32
_Static_assert(sizeof(mha_mutex) == sizeof(SRWLOCK), "mha_mutex: SRWLOCK");
_Static_assert(sizeof(mha_cond) == sizeof(CONDITION_VARIABLE),
               "mha_cond: CONDITION_VARIABLE");
#define SRW(m) ((PSRWLOCK)(void *)(m))
#define CV(c) ((PCONDITION_VARIABLE)(void *)(c))

static unsigned __stdcall thread_start(void *p)
{
    start_run(p);
    return 0;
}

/* Console control events have no per-thread mask: nothing to block. */
int mha_thread_spawn(void (*fn)(void *), void *arg)
{
    start_arg *a = start_arg_new(fn, arg);
    if (a == NULL)
        return ENOMEM;
    const uintptr_t h = _beginthreadex(NULL, 0, thread_start, a, 0, NULL);
    if (h == 0) {
        free(a);
        return EAGAIN;
    }
    CloseHandle((HANDLE)h); /* detached */
    return 0;
}

int mha_mutex_init(mha_mutex *m)
{
    InitializeSRWLock(SRW(m));
    return 0;
}
void mha_mutex_destroy(mha_mutex *m) { (void)m; /* SRW locks hold nothing */ }
void mha_mutex_lock(mha_mutex *m) { AcquireSRWLockExclusive(SRW(m)); }
void mha_mutex_unlock(mha_mutex *m) { ReleaseSRWLockExclusive(SRW(m)); }

int mha_cond_init(mha_cond *c)
{
    InitializeConditionVariable(CV(c));
    return 0;
}
void mha_cond_destroy(mha_cond *c) { (void)c; }
void mha_cond_wait(mha_cond *c, mha_mutex *m)
{
    SleepConditionVariableSRW(CV(c), SRW(m), INFINITE, 0);
}
void mha_cond_signal(mha_cond *c) { WakeConditionVariable(CV(c)); }
void mha_cond_broadcast(mha_cond *c) { WakeAllConditionVariable(CV(c)); }

int mha_atfork_child(void (*child)(void))
{
    (void)child; /* no fork on Windows */
    return 0;
}
#else
static void *thread_start(void *p)
{
    start_run(p);
    return NULL;
}

int mha_thread_spawn(void (*fn)(void *), void *arg)
{
    start_arg *a = start_arg_new(fn, arg);
    if (a == NULL)
        return ENOMEM;
    pthread_attr_t attr;
    int err = pthread_attr_init(&attr);
    if (err != 0) {
        free(a);
        return err;
    }
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    /* The new thread inherits the mask in force here: all blocked. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_t tid;
    err = pthread_create(&tid, &attr, thread_start, a);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (err != 0)
        free(a);
    return err;
}

int mha_mutex_init(mha_mutex *m) { return pthread_mutex_init(m, NULL); }
void mha_mutex_destroy(mha_mutex *m) { pthread_mutex_destroy(m); }
void mha_mutex_lock(mha_mutex *m) { pthread_mutex_lock(m); }
void mha_mutex_unlock(mha_mutex *m) { pthread_mutex_unlock(m); }
int mha_cond_init(mha_cond *c) { return pthread_cond_init(c, NULL); }
void mha_cond_destroy(mha_cond *c) { pthread_cond_destroy(c); }
void mha_cond_wait(mha_cond *c, mha_mutex *m) { pthread_cond_wait(c, m); }
void mha_cond_signal(mha_cond *c) { pthread_cond_signal(c); }
void mha_cond_broadcast(mha_cond *c) { pthread_cond_broadcast(c); }

int mha_atfork_child(void (*child)(void))
{
    return pthread_atfork(NULL, NULL, child);
}
#endif

/* ---- Ctrl-C ----------------------------------------------------------- */

/*
 * Python's own SIGINT handler only notes the signal for the interpreter,
 * which reads it between bytecodes: never while the core runs with the
 * GIL released. So around such a call the glue installs ours, which also
 * raises sigint_flag for the core to poll, and then lets Python's run.
 * Installs are counted under sigint_lock, so whichever call leaves last
 * restores the previous state, exactly once, whatever the threads do.
 */
_Static_assert(_Generic((sig_atomic_t)0, int: 1, default: 0),
               "cfg->interrupt points to an int: sig_atomic_t must be int");

static volatile sig_atomic_t sigint_flag;
static int sigint_installs; /* guarded by sigint_lock */
static int sigint_active;   /* our handler is in place; ditto */

volatile const int *mha_sigint_flag(void)
{
    return (volatile const int *)&sigint_flag;
}

#ifdef _WIN32
/*
 * Console control handlers run on a thread the system creates, most
 * recently added first, until one returns TRUE. Ours raises the flag and
 * returns FALSE, so the C runtime's handler, which runs Python's SIGINT
 * handler, still runs after it: the same chain as on POSIX.
 */
static SRWLOCK sigint_lock = SRWLOCK_INIT;

static BOOL WINAPI console_handler(DWORD event)
{
    if (event == CTRL_C_EVENT)
        sigint_flag = 1;
    return FALSE;
}

int mha_sigint_supported(void) { return 1; }
int mha_sigint_setup(void) { return 0; /* no fork */ }

void mha_sigint_install(void)
{
    AcquireSRWLockExclusive(&sigint_lock);
    sigint_flag = 0;
    if (sigint_installs++ == 0)
        sigint_active = SetConsoleCtrlHandler(console_handler, TRUE) != 0;
    ReleaseSRWLockExclusive(&sigint_lock);
}

void mha_sigint_uninstall(void)
{
    AcquireSRWLockExclusive(&sigint_lock);
    if (--sigint_installs == 0 && sigint_active) {
        SetConsoleCtrlHandler(console_handler, FALSE);
        sigint_active = 0;
    }
    ReleaseSRWLockExclusive(&sigint_lock);
}
#elif defined(SA_SIGINFO)
static struct sigaction sigint_prev; /* what our handler replaced */
static pthread_mutex_t sigint_lock = PTHREAD_MUTEX_INITIALIZER;

static void sigint_handler(int sig, siginfo_t *info, void *ctx)
{
    sigint_flag = 1;
    if (sigint_prev.sa_flags & SA_SIGINFO)
        sigint_prev.sa_sigaction(sig, info, ctx);
    else if (sigint_prev.sa_handler != SIG_DFL && sigint_prev.sa_handler != SIG_IGN)
        sigint_prev.sa_handler(sig);
}

/* 1 when the SIGINT handler in place is ours. */
static int sigint_ours(void)
{
    struct sigaction cur;
    return sigaction(SIGINT, NULL, &cur) == 0 && (cur.sa_flags & SA_SIGINFO) &&
           cur.sa_sigaction == sigint_handler;
}

void mha_sigint_install(void)
{
    pthread_mutex_lock(&sigint_lock);
    /* A flag left raised by an earlier call must not stop this one, even
       when no handler is installed (SIG_IGN) to raise it again. */
    sigint_flag = 0;
    if (sigint_installs++ == 0) {
        struct sigaction cur, sa;
        sigint_active = 0;
        if (sigint_ours()) {
            /* Ours already (never expected): chaining to it would loop. */
            sigint_active = 1;
        } else if (sigaction(SIGINT, NULL, &cur) == 0 &&
                   ((cur.sa_flags & SA_SIGINFO) ||
                    (cur.sa_handler != SIG_DFL && cur.sa_handler != SIG_IGN))) {
            memset(&sa, 0, sizeof sa);
            sa.sa_sigaction = sigint_handler;
            sa.sa_mask = cur.sa_mask;
            sa.sa_flags = SA_SIGINFO | (cur.sa_flags & (SA_ONSTACK | SA_RESTART));
            sigint_prev = cur;
            sigint_active = sigaction(SIGINT, &sa, NULL) == 0;
        }
    }
    pthread_mutex_unlock(&sigint_lock);
}

void mha_sigint_uninstall(void)
{
    pthread_mutex_lock(&sigint_lock);
    if (--sigint_installs == 0 && sigint_active) {
        /* Put the previous handler back unless someone replaced ours since. */
        if (sigint_ours())
            sigaction(SIGINT, &sigint_prev, NULL);
        sigint_active = 0;
    }
    pthread_mutex_unlock(&sigint_lock);
}

/*
 * In the child of a fork(), only the forking thread lives: no call is in
 * progress there, whatever the parent's threads were doing. So the child
 * starts from the state of no call: the previous handler back in place if
 * ours was installed, no install counted, the flag low, and a fresh lock
 * (another thread may have held it at the fork). Without this, the child
 * inherits sigint_installs > 0, never lowers the flag again, and every
 * later call stops at once. Only async-signal-safe calls here.
 */
static void sigint_atfork_child(void)
{
    if (sigint_active && sigint_ours())
        sigaction(SIGINT, &sigint_prev, NULL);
    sigint_installs = 0;
    sigint_active = 0;
    sigint_flag = 0;
    pthread_mutex_init(&sigint_lock, NULL);
}

int mha_sigint_supported(void) { return 1; }

int mha_sigint_setup(void)
{
    /* once per process: a second import of the glue must not add another */
    static int done;
    pthread_mutex_lock(&sigint_lock);
    int err = 0;
    if (!done && (err = pthread_atfork(NULL, NULL, sigint_atfork_child)) == 0)
        done = 1;
    pthread_mutex_unlock(&sigint_lock);
    return err;
}
#else /* neither sigaction nor the console API: a call runs to its end */
int mha_sigint_supported(void) { return 0; }
int mha_sigint_setup(void) { return 0; }
void mha_sigint_install(void) { (void)sigint_installs, (void)sigint_active; }
void mha_sigint_uninstall(void) {}
#endif
