/*
 * simd_plain.h - the names of the vector vocabulary that plain C writes the
 * same whatever the lane count: the prefetch hints (none), the transposing
 * copy (value moves only), v_pow2 (a shift of each lane's bits), v_hsum4
 * (four v_hsum) and the half precision lanes (half.h's conversions, lane
 * by lane). Shared by the portable vocabulary (simd_ref.h) and the
 * emulated AVX-512 one (simd_emu512.h), included after their v_f32, v_f64
 * and v_hsum; each defines its own V_TPACK_ROWS.
 *
 * A family's body is written once for both types by a macro that is given
 * each function's full name (PLAIN_TPACK(v_tpack_f32, float), ...), so that
 * grep finds every name.
 */
#ifndef MHA_SIMD_PLAIN_H
#define MHA_SIMD_PLAIN_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "half.h"

/* Prefetch hints (t0: every cache level, t1: L2 and up); the portable
   path gives none, and stays ISO C. */
static inline void v_prefetch_t0(const void *p) { (void)p; }
static inline void v_prefetch_t1(const void *p) { (void)p; }

/*
 * Transposing copy: dst[c*ldd + r] = src[r*lds + c] for r < rows (<= the
 * V_TPACK_ROWS of the type), c < cols. `next` (rows the caller copies
 * next, same lds) is a prefetch hint the SIMD versions use.
 */
#define PLAIN_TPACK(name, R)                                                  \
    static inline void name(R *dst, size_t ldd, const R *src, size_t lds,     \
                            size_t rows, size_t cols, const R *next)          \
    {                                                                         \
        (void)next;                                                           \
        for (size_t c = 0; c < cols; c++)                                     \
            for (size_t r = 0; r < rows; r++)                                 \
                dst[c * ldd + r] = src[r * lds + c];                          \
    }
PLAIN_TPACK(v_tpack_f32, float)
PLAIN_TPACK(v_tpack_f64, double)

/* The bits of each lane of t shifted left by the mantissa width: 2^n when
   the lane's low bits hold n + bias (the exp's shift trick, vexp.inc). U
   is the unsigned integer of the lane's width. */
#define PLAIN_POW2(name, V, U, SHIFT)                                         \
    static inline V name(V t)                                                 \
    {                                                                         \
        U u[sizeof(V) / sizeof(U)];                                           \
        memcpy(u, &t, sizeof u);                                              \
        for (size_t i = 0; i < sizeof u / sizeof u[0]; i++)                   \
            u[i] <<= SHIFT;                                                   \
        memcpy(&t, u, sizeof u);                                              \
        return t;                                                             \
    }
PLAIN_POW2(v_pow2_f32, v_f32, uint32_t, 23)
PLAIN_POW2(v_pow2_f64, v_f64, uint64_t, 52)

/* out[u] = v_hsum(a[u]) for u < 4, bit for bit: four reductions in the
   vocabulary's own order. */
#define PLAIN_HSUM4(name, V, R, hsum)                                         \
    static inline void name(const V *a, R *out)                               \
    {                                                                         \
        for (int u = 0; u < 4; u++)                                           \
            out[u] = hsum(a[u]);                                              \
    }
PLAIN_HSUM4(v_hsum4_f32, v_f32, float, v_hsum_f32)
PLAIN_HSUM4(v_hsum4_f64, v_f64, double, v_hsum_f64)

/* Half precision lanes (simd_ref.h): the float lanes of a v_f32 from, or
   to, as many uint16_t bit patterns at p, each through core/half.h. */
#define PLAIN_WIDEN(name, widen)                                              \
    static inline v_f32 name(const uint16_t *p)                               \
    {                                                                         \
        float f[sizeof(v_f32) / sizeof(float)];                               \
        v_f32 v;                                                              \
        for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)                   \
            f[i] = widen(p[i]);                                               \
        memcpy(&v, f, sizeof v);                                              \
        return v;                                                             \
    }
#define PLAIN_NARROW(name, narrow)                                            \
    static inline void name(uint16_t *p, v_f32 v)                             \
    {                                                                         \
        float f[sizeof(v_f32) / sizeof(float)];                               \
        memcpy(f, &v, sizeof f);                                              \
        for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)                   \
            p[i] = narrow(f[i]);                                              \
    }
PLAIN_WIDEN(v_widen_f16, mha_f16_to_f32)
PLAIN_NARROW(v_narrow_f16, mha_f32_to_f16)
PLAIN_WIDEN(v_widen_bf16, mha_bf16_to_f32)
PLAIN_NARROW(v_narrow_bf16, mha_f32_to_bf16)

/* The float lanes of a v_f32 from as many int8 values at p, exactly. */
static inline v_f32 v_widen_i8(const int8_t *p)
{
    float f[sizeof(v_f32) / sizeof(float)];
    v_f32 v;
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        f[i] = (float)p[i];
    memcpy(&v, f, sizeof v);
    return v;
}

#undef PLAIN_TPACK
#undef PLAIN_POW2
#undef PLAIN_HSUM4
#undef PLAIN_WIDEN
#undef PLAIN_NARROW

#endif /* MHA_SIMD_PLAIN_H */
