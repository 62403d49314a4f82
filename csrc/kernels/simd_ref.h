/*
 * simd_ref.h - the vector vocabulary of the portable path: "vectors" of one
 * lane, plain C. Every kernel template (flash.inc, bwd.inc, gemm_ukr.inc,
 * vexp.inc) is written once against this vocabulary and compiled per ISA;
 * simd_avx2.h and simd_avx512.h define the same names on ymm and zmm
 * registers. Both element types, suffixed: v_add_f32, v_add_f64. The
 * kernels reach them through the generic names of simd_dtype.h.
 *
 * Two multiply-adds, on purpose:
 *   v_madd: the kernels' a * b + c. The portable path rounds twice, as
 *           plain C does (no contraction under -std=c11); the SIMD paths
 *           fuse it. Only rounding differs.
 *   v_fma:  one rounding on every path (C99 fma), for the exp, so that the
 *           exp gives the same bits on every ISA.
 * v_max / v_min follow x86 maxps / minps: the second operand when either
 * is NaN, so that a clamp keeps a NaN in the first place.
 */
#ifndef MHA_SIMD_REF_H
#define MHA_SIMD_REF_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MHA_SIMD_ISA_NAME "scalar"
/* Inlining is the compiler's call on the portable path. */
#define MHA_ALWAYS_INLINE inline

typedef float v_f32;
typedef double v_f64;
#define V_LEN_F32 1
#define V_LEN_F64 1
/* Rows of one v_tpack call (see below). */
#define V_TPACK_ROWS_F32 8
#define V_TPACK_ROWS_F64 8

static inline v_f32 v_zero_f32(void) { return 0.0f; }
static inline v_f64 v_zero_f64(void) { return 0.0; }
static inline v_f32 v_set1_f32(float x) { return x; }
static inline v_f64 v_set1_f64(double x) { return x; }
static inline v_f32 v_load_f32(const float *p) { return *p; }
static inline v_f64 v_load_f64(const double *p) { return *p; }
static inline v_f32 v_loadu_f32(const float *p) { return *p; }
static inline v_f64 v_loadu_f64(const double *p) { return *p; }
static inline void v_store_f32(float *p, v_f32 v) { *p = v; }
static inline void v_store_f64(double *p, v_f64 v) { *p = v; }
static inline void v_storeu_f32(float *p, v_f32 v) { *p = v; }
static inline void v_storeu_f64(double *p, v_f64 v) { *p = v; }
static inline v_f32 v_bcast_f32(const float *p) { return *p; }
static inline v_f64 v_bcast_f64(const double *p) { return *p; }

static inline v_f32 v_madd_f32(v_f32 a, v_f32 b, v_f32 c) { return a * b + c; }
static inline v_f64 v_madd_f64(v_f64 a, v_f64 b, v_f64 c) { return a * b + c; }
static inline float s_madd_f32(float a, float b, float c) { return a * b + c; }
static inline double s_madd_f64(double a, double b, double c) { return a * b + c; }
static inline v_f32 v_fma_f32(v_f32 a, v_f32 b, v_f32 c) { return fmaf(a, b, c); }
static inline v_f64 v_fma_f64(v_f64 a, v_f64 b, v_f64 c) { return fma(a, b, c); }
static inline v_f32 v_fnma_f32(v_f32 a, v_f32 b, v_f32 c) { return fmaf(-a, b, c); }
static inline v_f64 v_fnma_f64(v_f64 a, v_f64 b, v_f64 c) { return fma(-a, b, c); }

static inline v_f32 v_add_f32(v_f32 a, v_f32 b) { return a + b; }
static inline v_f64 v_add_f64(v_f64 a, v_f64 b) { return a + b; }
static inline v_f32 v_sub_f32(v_f32 a, v_f32 b) { return a - b; }
static inline v_f64 v_sub_f64(v_f64 a, v_f64 b) { return a - b; }
static inline v_f32 v_mul_f32(v_f32 a, v_f32 b) { return a * b; }
static inline v_f64 v_mul_f64(v_f64 a, v_f64 b) { return a * b; }
static inline v_f32 v_div_f32(v_f32 a, v_f32 b) { return a / b; }
static inline v_f64 v_div_f64(v_f64 a, v_f64 b) { return a / b; }
static inline v_f32 v_max_f32(v_f32 a, v_f32 b) { return a > b ? a : b; }
static inline v_f64 v_max_f64(v_f64 a, v_f64 b) { return a > b ? a : b; }
static inline v_f32 v_min_f32(v_f32 a, v_f32 b) { return a < b ? a : b; }
static inline v_f64 v_min_f64(v_f64 a, v_f64 b) { return a < b ? a : b; }
static inline float v_hmax_f32(v_f32 v) { return v; }
static inline double v_hmax_f64(v_f64 v) { return v; }
static inline float v_hsum_f32(v_f32 v) { return v; }
static inline double v_hsum_f64(v_f64 v) { return v; }
/* v_hsum4, four v_hsum: simd_plain.h. (v_hsumv, VLEN sums at once, is
   optional: simd_dtype.h; none here.) */

/* |v|, the magnitude of m with the sign of s, and the lane indices
   (0, 1, ..., VLEN - 1): bit operations and exact values, the same bits on
   every ISA (the softcap's tanh and ALiBi's distances, core/rules.h). */
static inline v_f32 v_abs_f32(v_f32 v) { return fabsf(v); }
static inline v_f64 v_abs_f64(v_f64 v) { return fabs(v); }
static inline v_f32 v_copysign_f32(v_f32 m, v_f32 s) { return copysignf(m, s); }
static inline v_f64 v_copysign_f64(v_f64 m, v_f64 s) { return copysign(m, s); }
static inline v_f32 v_iota_f32(void) { return 0.0f; }
static inline v_f64 v_iota_f64(void) { return 0.0; }

/* Lane l of v where the byte p[l] != 0, else -inf. */
static inline v_f32 v_selbool_f32(v_f32 v, const uint8_t *p) { return *p ? v : -INFINITY; }
static inline v_f64 v_selbool_f64(v_f64 v, const uint8_t *p) { return *p ? v : -INFINITY; }

/*
 * Half precision, float lanes only (core/half.h: half values are a storage
 * format, widened when packed and rounded once when stored), each lane
 * with half.h's bits on every ISA; p is a row of uint16_t bit patterns,
 * any alignment of that type:
 *   v_widen_f16(p)      the V_LEN_F32 float16 values at p, exactly
 *   v_narrow_f16(p, v)  v rounded to nearest even, stored at p
 *   v_widen_bf16(p), v_narrow_bf16(p, v)  the same for bfloat16
 *   v_widen_i8(p)       the V_LEN_F32 int8 values at p (int8_t *), exactly
 * Here, as in simd_emu512.h: half.h's conversions, lane by lane.
 */

/* v_pow2, v_tpack, the prefetch hints and the half precision lanes:
   simd_plain.h. */
#include "simd_plain.h"

#endif /* MHA_SIMD_REF_H */
