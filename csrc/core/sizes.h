/*
 * sizes.h - checked size arithmetic of the core, internal to csrc/core/.
 *
 * Every product or sum that sizes an allocation or an index is checked.
 * Element counts are bounded by MHA_MAX_ELEMS (mha.h): byte sizes of float
 * and double buffers then fit in size_t and pointer differences, and Tq, Tk
 * can be used in signed ptrdiff_t arithmetic without overflow.
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
