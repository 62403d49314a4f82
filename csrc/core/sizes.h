/*
 * sizes.h - checked size arithmetic of the core, internal to csrc/core/.
 *
 * The drivers and the GEMM check every product or sum that sizes their
 * scratch with these. The sizes of a call itself are checked once, against
 * MHA_MAX_ELEMS (mha.h), by mha_check_config (config.c).
 */
#ifndef MHA_SIZES_H
#define MHA_SIZES_H

#include <stddef.h>
#include <stdint.h>

#include "mha.h"

/* *r = a * b; returns 0 when that overflows size_t. */
static inline int mha_mul_ok(size_t *r, size_t a, size_t b)
{
    if (a != 0 && b > SIZE_MAX / a)
        return 0;
    *r = a * b;
    return 1;
}

/* *r = a + b; returns 0 when that overflows size_t. */
static inline int mha_add_ok(size_t *r, size_t a, size_t b)
{
    if (b > SIZE_MAX - a)
        return 0;
    *r = a + b;
    return 1;
}

#endif /* MHA_SIZES_H */
