/*
 * half.h - the scalar conversions between float32 and the two half
 * precision storage formats (issue 36), in plain C on the bit patterns:
 *
 *   float16   IEEE binary16: sign, 5 exponent bits (bias 15), 10 fraction
 *             bits; largest finite 65504, smallest subnormal 2^-24
 *   bfloat16  the top 16 bits of a float32: sign, 8 exponent bits (bias
 *             127), 7 fraction bits; float32's range, 8 significant bits
 *
 * Half values are a storage format (STYLE.md): the kernels widen them to
 * float32 while packing a panel or tile, compute in float32, and round a
 * result once when storing it. A value travels as its uint16_t bit pattern,
 * so no compiler's _Float16 or __bf16 support is needed.
 *
 * These are the definitions every ISA's row converters (mha_kernels'
 * widen_f16 ... narrow_bf16, kernels.inc) reproduce bit for bit, so their
 * NaN rules are the instructions' rather than free choices:
 *   - widening is exact; a float16 NaN comes out quiet, with its sign and
 *     its payload in the top fraction bits, which is what vcvtph2ps (F16C,
 *     AVX-512) and fcvtl (NEON, FPCR.DN clear) do to a signalling one;
 *     bfloat16 widens by a shift, which keeps even a signalling NaN as it is;
 *   - narrowing rounds to nearest, ties to even, never flushes a subnormal,
 *     and overflows to infinity as IEEE says: float16 from |x| >= 65520
 *     (65504 plus half its ulp, the tie going to the even pattern, inf);
 *     a NaN stays a NaN with its sign, its quiet bit set and the top
 *     fraction bits kept (what vcvtps2ph and fcvtn do; bfloat16 follows
 *     the same rule).
 * The scalar conversions use integers only. The rows' float16
 * instructions on x86 (F16C, AVX-512F) ignore MXCSR: the rounding is the
 * immediate's, and nothing is flushed (checked on a Xeon with FTZ, DAZ and
 * round toward zero set). NEON's follow FPCR, so the NEON rows assume the
 * one a thread starts with: round to nearest, no flush to zero, AHP clear.
 */
#ifndef MHA_HALF_H
#define MHA_HALF_H

#include <stdint.h>
#include <string.h>

static inline float mha_f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t mha_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* float16 -> float32, exact. */
static inline float mha_f16_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu;
    uint32_t m = h & 0x3ffu;
    if (e == 0x1f) /* inf, or a NaN: made quiet (see above) */
        return mha_f32_from_bits(sign | 0x7f800000u | (m << 13) | (m != 0 ? 0x400000u : 0));
    if (e != 0) /* normal: rebias 15 -> 127 */
        return mha_f32_from_bits(sign | ((e + 112) << 23) | (m << 13));
    if (m == 0)
        return mha_f32_from_bits(sign);
    /* Subnormal, m 2^-24: float32 holds it as a normal number. Shift m
       until its leading one is the implicit bit (bit 10); each shift
       lowers the exponent of 2^-14 by one. */
    uint32_t e32 = 127 - 14;
    while ((m & 0x400u) == 0) {
        m <<= 1;
        e32--;
    }
    return mha_f32_from_bits(sign | (e32 << 23) | ((m & 0x3ffu) << 13));
}

/* float32 -> float16, round to nearest, ties to even. */
static inline uint16_t mha_f32_to_f16(float f)
{
    const uint32_t x = mha_f32_bits(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t a = x & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN: quiet, top 10 fraction bits kept */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) /* >= 65520, inf included */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) {
        /* >= 2^-14, a normal float16: rebias the exponent (127 -> 15) in
           place, then drop 13 fraction bits rounding to nearest even. A
           carry out of the fraction moves to the next binade, which is
           right; it cannot reach inf below 65520. */
        const uint32_t r = a - 0x38000000u;
        return (uint16_t)(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
    }
    if (a <= 0x33000000u) /* <= 2^-25, half the smallest subnormal: 0 (a tie goes to even 0) */
        return sign;
    /* A float16 subnormal, in units of 2^-24: the significand m (24 bits,
       implicit bit set) times 2^(e - 150) is m 2^(e - 126) units, so m
       shifted right by s = 126 - e (14 .. 24), rounded to nearest even.
       Rounding up from 0x3ff gives 0x400, the smallest normal: right. */
    const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
    const uint32_t s = 126 - e, q = m >> s, rem = m & ((1u << s) - 1), tie = 1u << (s - 1);
    return (uint16_t)(sign | (q + (rem > tie || (rem == tie && (q & 1u)))));
}

/* bfloat16 -> float32, exact: the top half of the float's bits. */
static inline float mha_bf16_to_f32(uint16_t h)
{
    return mha_f32_from_bits((uint32_t)h << 16);
}

/* float32 -> bfloat16, round to nearest, ties to even. */
static inline uint16_t mha_f32_to_bf16(float f)
{
    const uint32_t x = mha_f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        /* NaN: adding the bias could carry it into inf; keep the top
           bits and set the quiet bit instead */
        return (uint16_t)((x >> 16) | 0x40u);
    /* Add just under half the dropped part's range, plus the kept lsb, so
       that a tie rounds up exactly when the kept value is odd; a carry
       moves to the next binade, and out of the largest to inf. No
       uint32 overflow: x <= 0xff800000 here. */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

#endif /* MHA_HALF_H */
