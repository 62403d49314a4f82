/*
 * alloc.c - the core's scratch allocations (contract in alloc.h). The
 * aligned blocks and the huge-page advice come from platform.h.
 */
#include "alloc.h"

#include <stdint.h>

#include "platform.h"

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
        /* a multiple of the alignment, and never 0 */
        bytes = bytes == 0 ? 64 : (bytes + 63) / 64 * 64;
        *p = mha_aligned_alloc(64, bytes);
        return *p ? MHA_OK : MHA_ERR_NOMEM;
    }
    bytes = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    if ((*p = mha_aligned_alloc(HUGE_PAGE, bytes)) == NULL)
        return MHA_ERR_NOMEM;
    mha_advise_huge(*p, bytes);
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
    mha_aligned_free(p);
}
