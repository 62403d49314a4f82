/*
 * backward.h - internal to the backward pass (backward.c, backward_avx2.c,
 * backward_avx512.c):
 * tile sizes, small helpers and the per-ISA entry points. The public
 * declaration is MHA_DECLARE_BACKWARD in mha.h.
 *
 * Letters: see mha.h. BQ query rows times BK keys make one tile.
 */
#ifndef MHA_BACKWARD_H
#define MHA_BACKWARD_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm.h"
#include "mha.h"
#include "threads.h"

/* Tile sizes. A tile's S and dP (BQ x BK each) stay in L1/L2 while it is
   worked. */
#define BWD_BQ ((size_t)64)
#define BWD_BK ((size_t)64)

#define MHA_CAT_(a, b) a##_##b
#define MHA_CAT(a, b) MHA_CAT_(a, b)

/* malloc of n elements of `size` bytes, never 0 bytes (so NULL is always a
   failure); checks the byte count. */
static inline mha_status bwd_alloc(void **p, size_t n, size_t size)
{
    if (size != 0 && n > SIZE_MAX / size)
        return MHA_ERR_SIZE;
    *p = malloc(n == 0 ? 1 : n * size);
    return *p ? MHA_OK : MHA_ERR_NOMEM;
}

/* *r = a * b; 0 when the product overflows size_t. */
static inline int bwd_mul_ok(size_t *r, size_t a, size_t b)
{
    if (a != 0 && b > SIZE_MAX / a)
        return 0;
    *r = a * b;
    return 1;
}

/* Reals of one thread's tile scratch, S (BQ, BK) and dP (BQ, BK), rounded
   up to a whole number of 64-byte cache lines for either element size. */
#define BWD_TILE_STRIDE ((2 * BWD_BQ * BWD_BK + 15) / 16 * 16)

/*
 * Which plan passes 4 and 5 follow (both give bitwise the same gradients,
 * see fused_task in backward_impl.h): fused, one task per (b, kv head),
 * does 5 tile products per tile; two-pass, one task per key block and then
 * per query block, does 7 but splits the work finer. Fused is chosen when
 * its ntasks (= B G) tasks keep nth threads at least 3/4 busy in whole
 * rounds, ntasks / (nth ceil(ntasks / nth)) >= 3/4, where it is cheaper.
 * The choice depends on the thread count, the gradients do not.
 */
static inline int bwd_plan_fused(size_t ntasks, int nth)
{
    const size_t n = nth < 1 ? 1 : (size_t)nth;
    const size_t rounds = (ntasks + n - 1) / n;
    return ntasks > 0 && ntasks <= SIZE_MAX / 4 && 4 * ntasks >= 3 * rounds * n;
}

/* The caller's interrupt flag (cfg->interrupt, may be NULL) is raised. The
   backward polls it between stages (a GEMM is not split) and before every
   tile, and then returns MHA_ERR_INTERRUPTED with the gradients unset. */
static inline int bwd_interrupted(const mha_config *cfg)
{
    return cfg->interrupt != NULL && *cfg->interrupt != 0;
}

/* The bits of a float and back (memcpy: the defined way to pun). */
static inline uint32_t bwd_fbits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bwd_bitsf(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/*
 * exp(x) in float32 without branches or calls, so that a loop of it
 * vectorises (libm's expf does not, short of fast-math flags). Cephes' expf:
 * x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two so that n ln2 is
 * exact), exp(r) by a degree-7 polynomial, 2^n through the exponent bits.
 * Within 1e-7 relative of exp for x in [-87.3, 88]; 0 below (and for -inf:
 * a masked probability), exp(88) above. NaN gives garbage, not NaN; it is
 * only called with x <= ~0 here.
 *
 * The range tests compare the bits as integers: under the default
 * -ftrapping-math GCC does not if-convert floating-point comparisons, and
 * the loop would not vectorise. For negative floats a larger bit pattern
 * is a more negative number; for the rest, signed order is float order.
 */
static inline float bwd_expf(float x)
{
    const uint32_t lo = 0xC2AEAC50u;   // -87.3365479f: below, exp is subnormal
    const int32_t hi = 0x42B00000;     // 88.0f
    const uint32_t ux = bwd_fbits(x);
    const uint32_t keep = 0u - (uint32_t)(ux <= lo);   // all ones unless x < lo
    uint32_t uc = ux > lo ? lo : ux;
    uc = (int32_t)uc > hi ? (uint32_t)hi : uc;
    const float xc = bwd_bitsf(uc);
    // n = round(x / ln2) by the 1.5 * 2^23 trick (exact for |n| < 2^22).
    const float magic = 12582912.0f;
    const float n = (xc * 1.44269504088896341f + magic) - magic;
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = (p * r) * r + r + 1.0f;
    // 2^n through the exponent field, n in [-126, 127].
    const uint32_t two_n = (uint32_t)((int32_t)n + 127) << 23;
    return bwd_bitsf(bwd_fbits(y * bwd_bitsf(two_n)) & keep);
}

#define MHA_DECLARE_BACKWARD_ISA(real, sfx, isa)                              \
    mha_status mha_backward_##sfx##_##isa(                                    \
        real *dx, real *dkey, real *dvalue,                                   \
        real *dwq, real *dwk, real *dwv, real *dwo,                           \
        real *dbq, real *dbk, real *dbv, real *dbo,                           \
        const real *dout,                                                     \
        const real *x, const real *key, const real *value,                    \
        const real *wq, const real *wk, const real *wv, const real *wo,       \
        const real *q, const real *k, const real *v, const real *concat,      \
        const real *lse, const mha_config *cfg);

MHA_DECLARE_BACKWARD_ISA(float, f32, ref)
MHA_DECLARE_BACKWARD_ISA(double, f64, ref)

/* The AVX2 build of the same template (backward_avx2.c), x86-64 with GCC or
   Clang only. */
#if (defined(__x86_64__) || defined(__i386__)) && \
    (defined(__GNUC__) || defined(__clang__))
#define MHA_BWD_HAVE_AVX2 1
MHA_DECLARE_BACKWARD_ISA(float, f32, avx2)
MHA_DECLARE_BACKWARD_ISA(double, f64, avx2)
/* And its AVX-512F build (backward_avx512.c), where the AVX2 one exists. */
MHA_DECLARE_BACKWARD_ISA(float, f32, avx512)
MHA_DECLARE_BACKWARD_ISA(double, f64, avx512)
#endif

#endif /* MHA_BACKWARD_H */
