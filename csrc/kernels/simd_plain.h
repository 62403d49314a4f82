/*
 * simd_plain.h - the names of the vector vocabulary that plain C writes the
 * same whatever the lane count: the prefetch hints (none) and the
 * transposing copy (value moves only). Shared by the portable vocabulary
 * (simd_ref.h) and the emulated AVX-512 one (simd_emu512.h); each defines
 * its own V_TPACK_ROWS.
 */
#ifndef MHA_SIMD_PLAIN_H
#define MHA_SIMD_PLAIN_H

#include <stddef.h>

/* Prefetch hints (t0: every cache level, t1: L2 and up); the portable
   path gives none, and stays ISO C. */
static inline void v_prefetch_t0(const void *p) { (void)p; }
static inline void v_prefetch_t1(const void *p) { (void)p; }

/*
 * Transposing copy: dst[c*ldd + r] = src[r*lds + c] for r < rows (<= the
 * V_TPACK_ROWS of the type), c < cols. `next` (rows the caller copies
 * next, same lds) is a prefetch hint the SIMD versions use.
 */
static inline void v_tpack_f32(float *dst, size_t ldd, const float *src,
                               size_t lds, size_t rows, size_t cols,
                               const float *next)
{
    (void)next;
    for (size_t c = 0; c < cols; c++)
        for (size_t r = 0; r < rows; r++)
            dst[c * ldd + r] = src[r * lds + c];
}

static inline void v_tpack_f64(double *dst, size_t ldd, const double *src,
                               size_t lds, size_t rows, size_t cols,
                               const double *next)
{
    (void)next;
    for (size_t c = 0; c < cols; c++)
        for (size_t r = 0; r < rows; r++)
            dst[c * ldd + r] = src[r * lds + c];
}

#endif /* MHA_SIMD_PLAIN_H */
