/*
 * alloc.c - the core's scratch allocations (contract in alloc.h). The
 * aligned blocks and the huge-page advice come from platform.h.
 */
#include "alloc.h"

#include <stdatomic.h>
#include <stdint.h>

#include "platform.h"

#define HUGE_PAGE ((size_t)2 << 20)

/*
 * The cache of huge blocks (alloc.h). g_live lists the huge blocks handed
 * out (a block that finds no free slot is simply never cached), g_free the
 * ones kept after their free, at most CACHE_BYTES in all. One spin lock
 * guards both: it is held for a scan of a few entries, and calls from
 * several threads are rare. A forked child clears it, in case a thread of
 * the parent held it at the fork. Off under AddressSanitizer, whose
 * quarantine must see every free to catch a use after it.
 */
#if defined(__SANITIZE_ADDRESS__) || defined(MHA_ALIGNED_CHECK)
#define CACHE_ON 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CACHE_ON 0
#endif
#endif
#ifndef CACHE_ON
#define CACHE_ON 1
#endif

#define LIVE_SLOTS 32
#define CACHE_SLOTS 8
#define CACHE_BYTES ((size_t)64 << 20)

typedef struct {
    void *p;
    size_t bytes;
} block;

static block g_live[LIVE_SLOTS];
static block g_free[CACHE_SLOTS];
static size_t g_free_bytes;
static atomic_flag g_lock = ATOMIC_FLAG_INIT;
static atomic_int g_atfork; /* 0 none, 1 registering, 2 done */

static void cache_unlock(void)
{
    atomic_flag_clear_explicit(&g_lock, memory_order_release);
}

static void cache_lock(void)
{
    int state = atomic_load_explicit(&g_atfork, memory_order_acquire);
    if (state == 0 && atomic_compare_exchange_strong(&g_atfork, &state, 1)) {
        (void)mha_atfork_child(cache_unlock); /* failure: no fork safety, no harm */
        atomic_store_explicit(&g_atfork, 2, memory_order_release);
    }
    while (atomic_flag_test_and_set_explicit(&g_lock, memory_order_acquire))
        mha_cpu_relax();
}

/* Lists b as live in a free slot; 0 when every slot is taken (then b is
   freed, not kept, when it comes back). Call with the lock held. */
static int live_add(block b)
{
    for (int i = 0; i < LIVE_SLOTS; i++)
        if (g_live[i].p == NULL) {
            g_live[i] = b;
            return 1;
        }
    return 0;
}

/* A cached block of at least `bytes` and at most twice that, the smallest,
   taken out of the cache and listed live; NULL when there is none. */
static void *cache_take(size_t bytes)
{
    if (!CACHE_ON)
        return NULL;
    cache_lock();
    int best = -1;
    for (int i = 0; i < CACHE_SLOTS; i++)
        if (g_free[i].p != NULL && g_free[i].bytes >= bytes && g_free[i].bytes / 2 <= bytes &&
            (best < 0 || g_free[i].bytes < g_free[best].bytes))
            best = i;
    void *p = NULL;
    if (best >= 0 && live_add(g_free[best])) {
        p = g_free[best].p;
        g_free_bytes -= g_free[best].bytes;
        g_free[best] = (block){NULL, 0};
    }
    cache_unlock();
    return p;
}

/* Lists a new huge block as live, if a slot is free. */
static void cache_note(void *p, size_t bytes)
{
    if (!CACHE_ON)
        return;
    cache_lock();
    (void)live_add((block){p, bytes});
    cache_unlock();
}

/* Keeps p for reuse when it is a live huge block and the cache has room;
   returns 0 when the caller must free it. */
static int cache_keep(void *p)
{
    if (!CACHE_ON)
        return 0;
    int kept = 0;
    cache_lock();
    for (int i = 0; i < LIVE_SLOTS; i++)
        if (g_live[i].p == p) {
            const block b = g_live[i];
            g_live[i] = (block){NULL, 0};
            for (int j = 0; j < CACHE_SLOTS && b.bytes <= CACHE_BYTES - g_free_bytes; j++)
                if (g_free[j].p == NULL) {
                    g_free[j] = b;
                    g_free_bytes += b.bytes;
                    kept = 1;
                    break;
                }
            break;
        }
    cache_unlock();
    return kept;
}

static mha_status scratch(void **p, size_t n, size_t size, int huge_ok)
{
    *p = NULL;
    if (size != 0 && n > SIZE_MAX / size)
        return MHA_ERR_SIZE;
    size_t bytes = n * size;
    if (bytes > SIZE_MAX - HUGE_PAGE)
        return MHA_ERR_SIZE;
    if (!huge_ok || bytes < MHA_HUGE_MIN) {
        /* a multiple of the alignment, and never 0 */
        bytes = bytes == 0 ? 64 : (bytes + 63) / 64 * 64;
        *p = mha_aligned_alloc(64, bytes);
        return *p ? MHA_OK : MHA_ERR_NOMEM;
    }
    bytes = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    if ((*p = cache_take(bytes)) != NULL)
        return MHA_OK;
    if ((*p = mha_aligned_alloc(HUGE_PAGE, bytes)) == NULL)
        return MHA_ERR_NOMEM;
    mha_advise_huge(*p, bytes);
    cache_note(*p, bytes);
    return MHA_OK;
}

mha_status mha_scratch(void **p, size_t n, size_t size)
{
    return scratch(p, n, size, 1);
}

mha_status mha_scratch_small(void **p, size_t n, size_t size)
{
    return scratch(p, n, size, 0);
}

void mha_scratch_free(void *p)
{
    if (p != NULL && !cache_keep(p))
        mha_aligned_free(p);
}

size_t mha_scratch_kept(void)
{
    if (!CACHE_ON)
        return 0;
    cache_lock();
    const size_t n = g_free_bytes;
    cache_unlock();
    return n;
}
