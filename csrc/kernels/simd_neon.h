/*
 * simd_neon.h - the vector vocabulary on AArch64 Advanced SIMD (NEON,
 * 128-bit q registers): the names of simd_ref.h, with 4 float or 2 double
 * lanes. Included by isa_neon.c only, and only on aarch64, where NEON is
 * part of the base ISA: no target flag and no run-time check are needed.
 *
 * Where the semantics of simd_ref.h are not those of the obvious
 * instruction, the obvious instruction is not used:
 *   v_max / v_min  fmax / fmin return NaN when either operand is NaN; the
 *                  vocabulary wants x86's rule (the second operand then,
 *                  and the second on equal operands too, +-0 included), so
 *                  they are a compare and a bit select;
 *   v_madd, v_fma  both fused (fmla), as on AVX2; s_madd is fmaf / fma,
 *                  which GCC and clang inline to fmadd here;
 *   v_hsum         a fixed order, pairs first: (v0 + v1) + (v2 + v3) for
 *                  float, v0 + v1 for double (faddp), so that v_hsum4,
 *                  three faddp for four vectors, gives the same bits;
 *   v_abs, v_copysign  sign-bit operations (fabs, bsl), never arithmetic.
 */
#ifndef MHA_SIMD_NEON_H
#define MHA_SIMD_NEON_H

#include <arm_neon.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MHA_SIMD_ISA_NAME "neon"
/* Kernel helpers whose calls must disappear: a function made of prefetches
   alone, which GCC would otherwise deem free of effects and delete. */
#define MHA_ALWAYS_INLINE inline __attribute__((always_inline))

typedef float32x4_t v_f32;
typedef float64x2_t v_f64;
#define V_LEN_F32 4
#define V_LEN_F64 2
/* Rows of one v_tpack call: one 4 x 4 (float) or 2 x 2 (double) register
   transpose. */
#define V_TPACK_ROWS_F32 4
#define V_TPACK_ROWS_F64 2

static inline v_f32 v_zero_f32(void) { return vdupq_n_f32(0.0f); }
static inline v_f64 v_zero_f64(void) { return vdupq_n_f64(0.0); }
static inline v_f32 v_set1_f32(float x) { return vdupq_n_f32(x); }
static inline v_f64 v_set1_f64(double x) { return vdupq_n_f64(x); }
static inline v_f32 v_load_f32(const float *p) { return vld1q_f32(p); }
static inline v_f64 v_load_f64(const double *p) { return vld1q_f64(p); }
static inline v_f32 v_loadu_f32(const float *p) { return vld1q_f32(p); }
static inline v_f64 v_loadu_f64(const double *p) { return vld1q_f64(p); }
static inline void v_store_f32(float *p, v_f32 v) { vst1q_f32(p, v); }
static inline void v_store_f64(double *p, v_f64 v) { vst1q_f64(p, v); }
static inline void v_storeu_f32(float *p, v_f32 v) { vst1q_f32(p, v); }
static inline void v_storeu_f64(double *p, v_f64 v) { vst1q_f64(p, v); }
/*
 * The broadcast is an ld1r the compiler keeps as written and in order: the
 * kernels' register blocks (6 x 4 or 8 x 3 = 24 accumulators) use it once
 * per row per k. Left to itself, GCC 12 turns each vld1q_dup into a scalar
 * load and a by-element fmla and hoists the loads of all six rows (and,
 * unrolled, of the next k) ahead of the FMAs: 24 + 4 + 6 live registers,
 * two more than there are, and two accumulators spilled to the stack on
 * every k. As volatile asm, the broadcasts stay in program order, each
 * register dies after its row's FMAs, and the 6 x 4 block fits in 29
 * registers with no spill (aarch64-linux-gnu-gcc 12 -O2, counted in the
 * assembly). Clang 14 schedules the 4-times unrolled k loop its own way and
 * still keeps two of the 24 accumulators on the stack there (8 extra loads,
 * 9 stores per 4 k); not yet addressed.
 */
static inline v_f32 v_bcast_f32(const float *p)
{
    v_f32 r;
    __asm__ volatile("ld1r {%0.4s}, %1" : "=w"(r) : "Q"(*p));
    return r;
}
static inline v_f64 v_bcast_f64(const double *p)
{
    v_f64 r;
    __asm__ volatile("ld1r {%0.2d}, %1" : "=w"(r) : "Q"(*p));
    return r;
}

static inline v_f32 v_madd_f32(v_f32 a, v_f32 b, v_f32 c) { return vfmaq_f32(c, a, b); }
static inline v_f64 v_madd_f64(v_f64 a, v_f64 b, v_f64 c) { return vfmaq_f64(c, a, b); }
static inline float s_madd_f32(float a, float b, float c) { return fmaf(a, b, c); }
static inline double s_madd_f64(double a, double b, double c) { return fma(a, b, c); }
static inline v_f32 v_fma_f32(v_f32 a, v_f32 b, v_f32 c) { return vfmaq_f32(c, a, b); }
static inline v_f64 v_fma_f64(v_f64 a, v_f64 b, v_f64 c) { return vfmaq_f64(c, a, b); }
/* c - a b, one rounding: fma(-a, b, c) */
static inline v_f32 v_fnma_f32(v_f32 a, v_f32 b, v_f32 c) { return vfmsq_f32(c, a, b); }
static inline v_f64 v_fnma_f64(v_f64 a, v_f64 b, v_f64 c) { return vfmsq_f64(c, a, b); }

static inline v_f32 v_add_f32(v_f32 a, v_f32 b) { return vaddq_f32(a, b); }
static inline v_f64 v_add_f64(v_f64 a, v_f64 b) { return vaddq_f64(a, b); }
static inline v_f32 v_sub_f32(v_f32 a, v_f32 b) { return vsubq_f32(a, b); }
static inline v_f64 v_sub_f64(v_f64 a, v_f64 b) { return vsubq_f64(a, b); }
static inline v_f32 v_mul_f32(v_f32 a, v_f32 b) { return vmulq_f32(a, b); }
static inline v_f64 v_mul_f64(v_f64 a, v_f64 b) { return vmulq_f64(a, b); }
static inline v_f32 v_div_f32(v_f32 a, v_f32 b) { return vdivq_f32(a, b); }
static inline v_f64 v_div_f64(v_f64 a, v_f64 b) { return vdivq_f64(a, b); }
/* a > b ? a : b and a < b ? a : b, lane by lane (x86 maxps / minps) */
static inline v_f32 v_max_f32(v_f32 a, v_f32 b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
static inline v_f64 v_max_f64(v_f64 a, v_f64 b) { return vbslq_f64(vcgtq_f64(a, b), a, b); }
static inline v_f32 v_min_f32(v_f32 a, v_f32 b) { return vbslq_f32(vcltq_f32(a, b), a, b); }
static inline v_f64 v_min_f64(v_f64 a, v_f64 b) { return vbslq_f64(vcltq_f64(a, b), a, b); }

/* Horizontal maxima with v_max's rule: halves, then the two lanes left. */
static inline float v_hmax_f32(v_f32 v)
{
    const float32x2_t lo = vget_low_f32(v), hi = vget_high_f32(v);
    const float32x2_t x = vbsl_f32(vcgt_f32(lo, hi), lo, hi);
    const float x0 = vget_lane_f32(x, 0), x1 = vget_lane_f32(x, 1);
    return x0 > x1 ? x0 : x1;
}

static inline double v_hmax_f64(v_f64 v)
{
    const double x0 = vgetq_lane_f64(v, 0), x1 = vgetq_lane_f64(v, 1);
    return x0 > x1 ? x0 : x1;
}

/* Horizontal sums, pairs first (faddp adds neighbouring lanes). */
static inline float v_hsum_f32(v_f32 v)
{
    const float32x4_t p = vpaddq_f32(v, v); /* v0 + v1, v2 + v3, ... */
    return vpadds_f32(vget_low_f32(p));
}

static inline double v_hsum_f64(v_f64 v) { return vpaddd_f64(v); }

/* out[u] = v_hsum(a[u]) for u < 4, bit for bit: the same pairs, added in
   the same order, four vectors at a time. */
static inline void v_hsum4_f32(const v_f32 *a, float *out)
{
    const float32x4_t p01 = vpaddq_f32(a[0], a[1]);
    const float32x4_t p23 = vpaddq_f32(a[2], a[3]);
    vst1q_f32(out, vpaddq_f32(p01, p23));
}

static inline void v_hsum4_f64(const v_f64 *a, double *out)
{
    vst1q_f64(out, vpaddq_f64(a[0], a[1]));
    vst1q_f64(out + 2, vpaddq_f64(a[2], a[3]));
}

/* |v|, the magnitude of m with the sign of s (bit operations), and the
   lane indices 0 .. VLEN - 1: as simd_ref.h. */
static inline v_f32 v_abs_f32(v_f32 v) { return vabsq_f32(v); }
static inline v_f64 v_abs_f64(v_f64 v) { return vabsq_f64(v); }
static inline v_f32 v_copysign_f32(v_f32 m, v_f32 s)
{
    return vbslq_f32(vdupq_n_u32(0x80000000u), s, m);
}
static inline v_f64 v_copysign_f64(v_f64 m, v_f64 s)
{
    return vbslq_f64(vdupq_n_u64(0x8000000000000000u), s, m);
}
static inline v_f32 v_iota_f32(void)
{
    static const float iota[4] = {0.0f, 1.0f, 2.0f, 3.0f};
    return vld1q_f32(iota);
}
static inline v_f64 v_iota_f64(void)
{
    static const double iota[2] = {0.0, 1.0};
    return vld1q_f64(iota);
}

/* Lane l of v where the byte p[l] != 0, else -inf (4 or 2 bytes read). */
static inline v_f32 v_selbool_f32(v_f32 v, const uint8_t *p)
{
    uint32_t bytes;
    memcpy(&bytes, p, sizeof bytes);
    const uint16x8_t h = vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(bytes)));
    const uint32x4_t blocked = vceqzq_u32(vmovl_u16(vget_low_u16(h)));
    return vbslq_f32(blocked, vdupq_n_f32(-INFINITY), v);
}

static inline v_f64 v_selbool_f64(v_f64 v, const uint8_t *p)
{
    const uint64x2_t w = vsetq_lane_u64(p[1], vdupq_n_u64(p[0]), 1);
    return vbslq_f64(vceqzq_u64(w), vdupq_n_f64(-INFINITY), v);
}

/* The bits of t shifted left by the mantissa width (vexp.inc). */
static inline v_f32 v_pow2_f32(v_f32 t)
{
    return vreinterpretq_f32_u32(vshlq_n_u32(vreinterpretq_u32_f32(t), 23));
}

static inline v_f64 v_pow2_f64(v_f64 t)
{
    return vreinterpretq_f64_u64(vshlq_n_u64(vreinterpretq_u64_f64(t), 52));
}

/* Half precision (simd_ref.h), 4 lanes. float16: fcvtl and fcvtn, which
   every aarch64 CPU has; with the FPCR a thread starts with (round to
   nearest, no flush to zero, FPCR.DN and AHP clear) they give half.h's
   bits, NaNs included. bfloat16: half.h's integer rule, lane by lane
   (the BF16 extension's bfcvtn is optional, and not used). */
static inline v_f32 v_widen_f16(const uint16_t *p)
{
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}

static inline void v_narrow_f16(uint16_t *p, v_f32 v)
{
    vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(v)));
}

static inline v_f32 v_widen_bf16(const uint16_t *p)
{
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}

/* The 4 int8 values at p as floats, exactly (an int8 KV cache's rows):
   4 bytes read, not the 8 of vld1_s8, which could pass a row's end. */
static inline v_f32 v_widen_i8(const int8_t *p)
{
    int32_t w;
    memcpy(&w, p, sizeof w);
    const int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(w)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
}

static inline void v_narrow_bf16(uint16_t *p, v_f32 v)
{
    const uint32x4_t x = vreinterpretq_u32_f32(v), hi = vshrq_n_u32(x, 16);
    const uint32x4_t lsb = vandq_u32(hi, vdupq_n_u32(1));
    const uint32x4_t rounded =
        vshrq_n_u32(vaddq_u32(vaddq_u32(x, vdupq_n_u32(0x7fff)), lsb), 16);
    /* |x| > inf as integers: a NaN, made quiet */
    const uint32x4_t nan =
        vcgtq_u32(vandq_u32(x, vdupq_n_u32(0x7fffffff)), vdupq_n_u32(0x7f800000));
    const uint32x4_t r = vbslq_u32(nan, vorrq_u32(hi, vdupq_n_u32(0x40)), rounded);
    vst1_u16(p, vmovn_u32(r));
}

/* Prefetch hints: into every cache level (t0), or into L2 and up (t1):
   prfm pldl1keep, pldl2keep. */
static inline void v_prefetch_t0(const void *p) { __builtin_prefetch(p, 0, 3); }
static inline void v_prefetch_t1(const void *p) { __builtin_prefetch(p, 0, 2); }

/*
 * Transposing copy (simd_ref.h): dst[c*ldd + r] = src[r*lds + c] for
 * r < rows (<= 4 floats, 2 doubles), c < cols. 4 x 4 (float) or 2 x 2
 * (double) register transposes; rows past `rows` read row 0 again and are
 * never stored; a leftovers tail of cols % 4 (or % 2) goes one by one.
 * `next` (the rows the caller copies next) is prefetched as we go.
 */
static inline void v_tpack_f32(float *dst, size_t ldd, const float *src,
                               size_t lds, size_t rows, size_t cols,
                               const float *next)
{
    /* src: (rows, cols) row stride lds; dst: (cols, rows) row stride ldd */
    const float *s[4];
    for (size_t r = 0; r < 4; r++)
        s[r] = src + (r < rows ? r : 0) * lds;
    size_t p = 0;
    for (; p + 4 <= cols; p += 4) {
        if ((p & 15) == 0)
            for (size_t r = 0; r < rows; r++)
                __builtin_prefetch(next + r * lds + p, 0, 3);
        const float32x4_t r0 = vld1q_f32(s[0] + p), r1 = vld1q_f32(s[1] + p);
        const float32x4_t r2 = vld1q_f32(s[2] + p), r3 = vld1q_f32(s[3] + p);
        /* t0 = a0 b0 a2 b2, t1 = a1 b1 a3 b3, t2 = c0 d0 c2 d2, ... */
        const float64x2_t t0 = vreinterpretq_f64_f32(vtrn1q_f32(r0, r1));
        const float64x2_t t1 = vreinterpretq_f64_f32(vtrn2q_f32(r0, r1));
        const float64x2_t t2 = vreinterpretq_f64_f32(vtrn1q_f32(r2, r3));
        const float64x2_t t3 = vreinterpretq_f64_f32(vtrn2q_f32(r2, r3));
        /* column q of the 4 x 4 block: rows 0..3 at p + q */
        float32x4_t col[4];
        col[0] = vreinterpretq_f32_f64(vtrn1q_f64(t0, t2));
        col[1] = vreinterpretq_f32_f64(vtrn1q_f64(t1, t3));
        col[2] = vreinterpretq_f32_f64(vtrn2q_f64(t0, t2));
        col[3] = vreinterpretq_f32_f64(vtrn2q_f64(t1, t3));
        if (rows == 4) {
            for (int q = 0; q < 4; q++)
                vst1q_f32(dst + (p + q) * ldd, col[q]);
        } else {
            for (int q = 0; q < 4; q++) {
                float tmp[4];
                vst1q_f32(tmp, col[q]);
                for (size_t r = 0; r < rows; r++)
                    dst[(p + q) * ldd + r] = tmp[r];
            }
        }
    }
    for (; p < cols; p++)
        for (size_t r = 0; r < rows; r++)
            dst[p * ldd + r] = s[r][p];
}

static inline void v_tpack_f64(double *dst, size_t ldd, const double *src,
                               size_t lds, size_t rows, size_t cols,
                               const double *next)
{
    /* src: (rows, cols) row stride lds; dst: (cols, rows) row stride ldd */
    if (rows == 0)
        return;
    const double *s0 = src, *s1 = src + (rows > 1 ? lds : 0);
    size_t p = 0;
    for (; p + 2 <= cols; p += 2) {
        if ((p & 7) == 0)
            for (size_t r = 0; r < rows; r++)
                __builtin_prefetch(next + r * lds + p, 0, 3);
        const float64x2_t r0 = vld1q_f64(s0 + p), r1 = vld1q_f64(s1 + p);
        if (rows == 2) {
            vst1q_f64(dst + p * ldd, vtrn1q_f64(r0, r1));
            vst1q_f64(dst + (p + 1) * ldd, vtrn2q_f64(r0, r1));
        } else {
            dst[p * ldd] = vgetq_lane_f64(r0, 0);
            dst[(p + 1) * ldd] = vgetq_lane_f64(r0, 1);
        }
    }
    for (; p < cols; p++) {
        dst[p * ldd] = s0[p];
        if (rows > 1)
            dst[p * ldd + 1] = s1[p];
    }
}

#endif /* MHA_SIMD_NEON_H */
