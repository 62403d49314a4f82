/*
 * flash_exp_impl.h - template of the vector exp used by the SIMD attention
 * kernels; included by flash_avx2.c and flash_avx512.c once per element
 * type, under their target pragma. No include guard on purpose.
 *
 * The including file defines:
 *   FLASH_VEXP        name of the function to define
 *   FLASH_F64         1 for double lanes, 0 for float lanes
 *   VEC, VSET1(x)     vector type and broadcast of a constant
 *   VFMA(a, b, c)     a * b + c, one rounding
 *   VFNMA(a, b, c)    c - a * b, one rounding
 *   VSUB, VMUL        lane-wise a - b, a * b
 *   VMAX(a, b), VMIN(a, b)  x86 semantics: b when either lane is NaN
 *   VPOW2(t)          the bits of t shifted left by the mantissa width
 *
 * Algorithm: exp(x) = 2^n exp(r), n = round(x log2 e), r = x - n ln 2 in
 * two steps (Cody-Waite: ln 2 = hi + lo), |r| <= ln2 / 2, and exp(r) by a
 * polynomial fitted to exp on [-ln2/2, ln2/2] (mpmath.chebyfit: degree 6,
 * error 2e-9, for float; degree 11, error 3e-18, for double). Rounding is
 * the "shift" trick: adding 1.5 * 2^m + bias (m = 23 or 52) rounds x log2 e
 * to an integer and leaves n + bias in the low mantissa bits, so shifting
 * those bits into the exponent field builds 2^n with no conversion.
 *
 * Special values, with x first clamped to [lo, hi] so that n + bias stays
 * in [0, 2 bias + 1]:
 *   x = -inf or x <= lo: n + bias = 0 makes 2^n the bit pattern 0, so the
 *                        result is exactly 0 (results below ~6e-39 resp.
 *                        ~1e-308 flush to 0; softmax never needs them);
 *   x >= ~88.38 (float) or ~709.44 (double): n + bias is all ones, 2^n is
 *                        +inf, and so is the result (the true overflow is
 *                        at 88.72 resp. 709.78; softmax arguments are <= 0);
 *   x = NaN:             the clamps keep NaN (it is their second operand)
 *                        and the polynomial propagates it.
 * Accuracy, measured against expl: at most 1.1 ulp over every float in
 * [-87.3, 88.3], and at most 0.96 ulp over 2^26 random doubles in
 * [-708, 709].
 */
#if !defined(FLASH_VEXP) || !defined(FLASH_F64)
#error "flash_exp_impl.h needs FLASH_VEXP and FLASH_F64 defined"
#endif

static inline VEC FLASH_VEXP(VEC x)
{
#if FLASH_F64
    const VEC lo = VSET1(-709.0), hi = VSET1(710.0);
    const VEC log2e = VSET1(1.4426950408889634);
    const VEC shift = VSET1(6755399441055744.0 + 1023.0); /* 1.5 * 2^52 + bias */
    const VEC ln2_hi = VSET1(0.6931471805599453);
    const VEC ln2_lo = VSET1(2.3190468138462996e-17);
#else
    const VEC lo = VSET1(-88.0f), hi = VSET1(88.7f);
    const VEC log2e = VSET1(1.44269504f);
    const VEC shift = VSET1(12582912.0f + 127.0f); /* 1.5 * 2^23 + bias */
    const VEC ln2_hi = VSET1(0.693147182f);
    const VEC ln2_lo = VSET1(-1.90465421e-09f);
#endif
    x = VMIN(hi, VMAX(lo, x));
    const VEC t = VFMA(x, log2e, shift);
    const VEC n = VSUB(t, shift); /* round(x log2 e), exact */
    VEC r = VFNMA(n, ln2_hi, x);
    r = VFNMA(n, ln2_lo, r);
#if FLASH_F64
    VEC p = VSET1(2.5110037605963777e-08);
    p = VFMA(p, r, VSET1(2.763263963904103e-07));
    p = VFMA(p, r, VSET1(2.755724091857897e-06));
    p = VFMA(p, r, VSET1(2.4801485482328494e-05));
    p = VFMA(p, r, VSET1(0.00019841269890047113));
    p = VFMA(p, r, VSET1(0.0013888888952314775));
    p = VFMA(p, r, VSET1(0.008333333333319601));
    p = VFMA(p, r, VSET1(0.0416666666664881));
    p = VFMA(p, r, VSET1(0.1666666666666668));
    p = VFMA(p, r, VSET1(0.5000000000000019));
    p = VFMA(p, r, VSET1(1.0));
    p = VFMA(p, r, VSET1(1.0));
#else
    VEC p = VSET1(0.00139411084f);
    p = VFMA(p, r, VSET1(0.00837512640f));
    p = VFMA(p, r, VSET1(0.0416663529f));
    p = VFMA(p, r, VSET1(0.166664155f));
    p = VFMA(p, r, VSET1(0.500000005f));
    p = VFMA(p, r, VSET1(1.00000004f));
    p = VFMA(p, r, VSET1(1.0f));
#endif
    /* shifting n + bias into the exponent field is 2^n; the other bits of
       the shift constant leave through the top (its low bits are zero) */
    return VMUL(p, VPOW2(t));
}
