/*
 * platform.h - the core's one door to the operating system.
 *
 * platform.c is the only file of csrc/ with OS-specific code: POSIX
 * (Linux, macOS, the BSDs) through pthreads, sigaction and clock_gettime,
 * Windows through Win32 threads, SRWLOCK / CONDITION_VARIABLE, the
 * performance counter and a console control handler. Everything else in
 * csrc/ is ISO C11 plus intrinsics and reaches the OS through here:
 *   threads   detached workers with every signal blocked, a mutex, a
 *             condition variable (what the pool in threads.c needs);
 *   CPUs      the number this process may run on;
 *   memory    aligned blocks, freed with mha_aligned_free (on Windows a
 *             block from _aligned_malloc must not reach free());
 *   time      a monotonic clock in int64 nanoseconds;
 *   spinning  mha_cpu_relax, one pause / yield hint;
 *   fork      a handler run in the child of fork() where fork exists;
 *   Ctrl-C    a counted install of a SIGINT (POSIX) or CTRL_C_EVENT
 *             (Windows) handler that raises a flag the core polls and
 *             then lets the previous handler (Python's) run too.
 * The header itself includes no OS header on Windows: the Win32 objects
 * are opaque, pointer-sized here and checked against <windows.h> in
 * platform.c.
 */
#ifndef MHA_PLATFORM_H
#define MHA_PLATFORM_H

#include <stddef.h>
#include <stdint.h>

#ifdef _WIN32
/* SRWLOCK and CONDITION_VARIABLE are one pointer each. */
typedef struct { void *opaque; } mha_mutex;
typedef struct { void *opaque; } mha_cond;
#else
#include <pthread.h>
typedef pthread_mutex_t mha_mutex;
typedef pthread_cond_t mha_cond;
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- threads ---------------------------------------------------------- */

/* Starts fn(arg) on a new detached thread that blocks every signal (so
   that SIGINT reaches the threads that expect it). 0 on success. */
int mha_thread_spawn(void (*fn)(void *), void *arg);

/* 0 on success (init); the others cannot fail on a valid object. */
int mha_mutex_init(mha_mutex *m);
void mha_mutex_destroy(mha_mutex *m);
void mha_mutex_lock(mha_mutex *m);
void mha_mutex_unlock(mha_mutex *m);
int mha_cond_init(mha_cond *c);
void mha_cond_destroy(mha_cond *c);
/* Spurious wake-ups happen: wait in a loop on the predicate. */
void mha_cond_wait(mha_cond *c, mha_mutex *m);
void mha_cond_signal(mha_cond *c);
void mha_cond_broadcast(mha_cond *c);

/* The CPUs this process may run on (its affinity mask on Linux and
   Windows, the active CPUs on macOS, the online ones elsewhere); >= 1. */
int mha_cpu_count(void);

/* One spin-wait hint: pause on x86, yield on aarch64, nothing elsewhere. */
void mha_cpu_relax(void);

/* ---- memory ----------------------------------------------------------- */

/* `bytes` (> 0, a multiple of align) aligned to align (a power of two,
   >= sizeof(void *)); NULL on failure. Free with mha_aligned_free only. */
void *mha_aligned_alloc(size_t align, size_t bytes);
void mha_aligned_free(void *p); /* NULL is a no-op */

/* Advises the OS to back [p, p + bytes) with huge pages (Linux's
   MADV_HUGEPAGE); elsewhere, or where refused, nothing. */
void mha_advise_huge(void *p, size_t bytes);

/* ---- time ------------------------------------------------------------- */

/* A monotonic clock in nanoseconds from an arbitrary origin. Computed in
   int64 whatever the width of time_t and long (32 bits on armhf). */
int64_t mha_now_ns(void);

/* How many times the OS has taken the CPU from the calling thread for
   another thread of the same OS (involuntary context switches: Linux's
   getrusage(RUSAGE_THREAD) ru_nivcsw); -1 where the platform cannot tell.
   A hypervisor that deschedules the whole virtual CPU does not count. */
long mha_thread_preemptions(void);

/* ---- fork ------------------------------------------------------------- */

/* Runs child() in the child of every later fork() (pthread_atfork). 0 on
   success or where there is no fork (Windows), else an errno value. */
int mha_atfork_child(void (*child)(void));

/* ---- Ctrl-C ----------------------------------------------------------- */

/*
 * While at least one installation is counted, Ctrl-C raises the flag that
 * mha_sigint_flag() points to (the core's cfg->interrupt) and then runs
 * the handler that was in place before (on POSIX the SIGINT handler we
 * replaced, called from ours; on Windows the next console control handler,
 * since ours returns FALSE). mha_sigint_install lowers the flag: a call
 * sees only the signals that come while it runs. The last uninstall puts
 * the previous state back, exactly once.
 *
 * On POSIX, SIG_IGN and SIG_DFL are left alone (ignored stays ignored, the
 * default ends the process anyway). On Windows the console handler cannot
 * see what the C runtime's SIGINT disposition is, so it raises the flag
 * whatever it is; a caller that restarts on a Ctrl-C nobody handled must
 * bound its restarts (the glue does).
 *
 * mha_sigint_setup registers what a fork child needs (no call in progress
 * there: no installation counted, the flag low) and is called once, before
 * any install. 0 on success, else an errno value.
 */
int mha_sigint_setup(void);
void mha_sigint_install(void);
void mha_sigint_uninstall(void);
volatile const int *mha_sigint_flag(void);
/* 0 where Ctrl-C cannot be seen during a call (no sigaction, no console
   API): then install / uninstall do nothing and the flag stays low. */
int mha_sigint_supported(void);

#ifdef __cplusplus
}
#endif

#endif /* MHA_PLATFORM_H */
