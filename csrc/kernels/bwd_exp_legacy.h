/* TEMPORARY (removed by the exp unification): the backward's own exps. */
#ifndef MHA_BWD_EXP_LEGACY_H
#define MHA_BWD_EXP_LEGACY_H
#include <stdint.h>
#include <string.h>
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

/* The bits of a double and back. */
static inline uint64_t bwd_dbits(double d)
{
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
}

static inline double bwd_bitsd(uint64_t u)
{
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
}

/*
 * exp(x) in float64, like bwd_expf: no branches or calls, so that a loop
 * of it vectorises, where libm's exp is one call per element (it took ~12 %
 * of a float64 backward). x = n ln2 + r with |r| <= ln2 / 2 (Cephes' split
 * of ln2, C1 + C2, C1 with few enough bits that n C1 is exact), exp(r) by
 * flash_exp_impl.h's degree-11 polynomial (fitted error 3e-18; evaluated
 * here without fused multiply-adds, within ~2 ulp of exp), and 2^n by the
 * shift trick: adding 1.5 * 2^52 + 1023 to x log2(e) rounds it to an
 * integer and leaves n + 1023 in the low bits, which a shift moves into the
 * exponent field (no double-to-integer conversion, which 64-bit lanes lack
 * before AVX-512DQ). x below -708 (and -inf: a masked probability) gives 0,
 * above 709 exp(709); NaN gives NaN. Range tests compare bits as integers,
 * as in bwd_expf.
 */
static inline double bwd_expd(double x)
{
    const uint64_t lo = 0xC086200000000000u;   // -708.0: below, 2^n is subnormal
    const int64_t hi = 0x4086280000000000;     // 709.0
    const uint64_t ux = bwd_dbits(x);
    const uint64_t keep = 0u - (uint64_t)(ux <= lo);   // all ones unless x < lo
    uint64_t uc = ux > lo ? lo : ux;
    uc = (int64_t)uc > hi ? (uint64_t)hi : uc;
    const double xc = bwd_bitsd(uc);
    const double shift = 6755399441055744.0 + 1023.0;  // 1.5 * 2^52 + bias
    const double t = xc * 1.4426950408889634 + shift;
    const double n = t - shift;   // round(x log2 e), exact
    double r = xc - n * 6.93145751953125e-1;
    r = r - n * 1.42860682030941723212e-6;
    double p = 2.5110037605963777e-08;
    p = p * r + 2.763263963904103e-07;
    p = p * r + 2.755724091857897e-06;
    p = p * r + 2.4801485482328494e-05;
    p = p * r + 0.00019841269890047113;
    p = p * r + 0.0013888888952314775;
    p = p * r + 0.008333333333319601;
    p = p * r + 0.0416666666664881;
    p = p * r + 0.1666666666666668;
    p = p * r + 0.5000000000000019;
    p = p * r + 1.0;
    p = p * r + 1.0;
    // 2^n: n + 1023 in [0, 2046] sits in t's low bits.
    const uint64_t y = bwd_dbits(p * bwd_bitsd(bwd_dbits(t) << 52)) & keep;
    // NaN in, NaN out (the clamps above turned it into a number).
    const uint64_t nan = 0u - (uint64_t)((ux & 0x7FFFFFFFFFFFFFFFu) > 0x7FF0000000000000u);
    return bwd_bitsd((y & ~nan) | (ux & nan));
}

#endif
