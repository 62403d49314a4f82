/*
 * alloc.c - the core's scratch allocations (contract in alloc.h).
 */
#define _GNU_SOURCE /* madvise, MADV_HUGEPAGE */

#include "alloc.h"

#include <stdint.h>
#include <stdlib.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#define HUGE_PAGE ((size_t)2 << 20)

static mha_status scratch(void **p, size_t n, size_t size, int huge_ok)
{
    *p = NULL;
    if (size != 0 && n > SIZE_MAX / size)
        return MHA_ERR_SIZE;
    size_t bytes = n * size;
    if (bytes > SIZE_MAX - HUGE_PAGE)
        return MHA_ERR_SIZE;
    if (!huge_ok || bytes < MHA_HUGE_MIN) {
        /* aligned_alloc wants a multiple of the alignment, and not 0 */
        bytes = bytes == 0 ? 64 : (bytes + 63) / 64 * 64;
        *p = aligned_alloc(64, bytes);
        return *p ? MHA_OK : MHA_ERR_NOMEM;
    }
    bytes = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    if (posix_memalign(p, HUGE_PAGE, bytes) != 0) {
        *p = NULL;
        return MHA_ERR_NOMEM;
    }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    (void)madvise(*p, bytes, MADV_HUGEPAGE); /* advice: failure is harmless */
#endif
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
