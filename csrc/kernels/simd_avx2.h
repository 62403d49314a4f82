/*
 * simd_avx2.h - the vector vocabulary on AVX2 + FMA (256-bit ymm): the
 * names of simd_ref.h, with 8 float or 4 double lanes, and F16C for
 * float16. Included by isa_avx2.c only, inside its target region: nothing
 * here runs unless mha_get_isa() >= MHA_ISA_AVX2 (dispatch.c checks cpuid
 * and xgetbv).
 * v_madd and v_fma are both the fused multiply-add.
 */
#ifndef MHA_SIMD_AVX2_H
#define MHA_SIMD_AVX2_H

#include <immintrin.h>
#include <math.h>

#include "simd_x86.h"

#define MHA_SIMD_ISA_NAME "avx2"

typedef __m256 v_f32;
typedef __m256d v_f64;
#define V_LEN_F32 8
#define V_LEN_F64 4

static inline v_f32 v_zero_f32(void) { return _mm256_setzero_ps(); }
static inline v_f64 v_zero_f64(void) { return _mm256_setzero_pd(); }
static inline v_f32 v_set1_f32(float x) { return _mm256_set1_ps(x); }
static inline v_f64 v_set1_f64(double x) { return _mm256_set1_pd(x); }
static inline v_f32 v_load_f32(const float *p) { return _mm256_load_ps(p); }
static inline v_f64 v_load_f64(const double *p) { return _mm256_load_pd(p); }
static inline v_f32 v_loadu_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline v_f64 v_loadu_f64(const double *p) { return _mm256_loadu_pd(p); }
static inline void v_store_f32(float *p, v_f32 v) { _mm256_store_ps(p, v); }
static inline void v_store_f64(double *p, v_f64 v) { _mm256_store_pd(p, v); }
static inline void v_storeu_f32(float *p, v_f32 v) { _mm256_storeu_ps(p, v); }
static inline void v_storeu_f64(double *p, v_f64 v) { _mm256_storeu_pd(p, v); }
static inline v_f32 v_bcast_f32(const float *p) { return _mm256_broadcast_ss(p); }
static inline v_f64 v_bcast_f64(const double *p) { return _mm256_broadcast_sd(p); }

static inline v_f32 v_madd_f32(v_f32 a, v_f32 b, v_f32 c) { return _mm256_fmadd_ps(a, b, c); }
static inline v_f64 v_madd_f64(v_f64 a, v_f64 b, v_f64 c) { return _mm256_fmadd_pd(a, b, c); }
static inline float s_madd_f32(float a, float b, float c) { return fmaf(a, b, c); }
static inline double s_madd_f64(double a, double b, double c) { return fma(a, b, c); }
static inline v_f32 v_fma_f32(v_f32 a, v_f32 b, v_f32 c) { return _mm256_fmadd_ps(a, b, c); }
static inline v_f64 v_fma_f64(v_f64 a, v_f64 b, v_f64 c) { return _mm256_fmadd_pd(a, b, c); }
static inline v_f32 v_fnma_f32(v_f32 a, v_f32 b, v_f32 c) { return _mm256_fnmadd_ps(a, b, c); }
static inline v_f64 v_fnma_f64(v_f64 a, v_f64 b, v_f64 c) { return _mm256_fnmadd_pd(a, b, c); }

static inline v_f32 v_add_f32(v_f32 a, v_f32 b) { return _mm256_add_ps(a, b); }
static inline v_f64 v_add_f64(v_f64 a, v_f64 b) { return _mm256_add_pd(a, b); }
static inline v_f32 v_sub_f32(v_f32 a, v_f32 b) { return _mm256_sub_ps(a, b); }
static inline v_f64 v_sub_f64(v_f64 a, v_f64 b) { return _mm256_sub_pd(a, b); }
static inline v_f32 v_mul_f32(v_f32 a, v_f32 b) { return _mm256_mul_ps(a, b); }
static inline v_f64 v_mul_f64(v_f64 a, v_f64 b) { return _mm256_mul_pd(a, b); }
static inline v_f32 v_div_f32(v_f32 a, v_f32 b) { return _mm256_div_ps(a, b); }
static inline v_f64 v_div_f64(v_f64 a, v_f64 b) { return _mm256_div_pd(a, b); }
static inline v_f32 v_max_f32(v_f32 a, v_f32 b) { return _mm256_max_ps(a, b); }
static inline v_f64 v_max_f64(v_f64 a, v_f64 b) { return _mm256_max_pd(a, b); }
static inline v_f32 v_min_f32(v_f32 a, v_f32 b) { return _mm256_min_ps(a, b); }
static inline v_f64 v_min_f64(v_f64 a, v_f64 b) { return _mm256_min_pd(a, b); }
static inline float v_hmax_f32(v_f32 v) { return x86_hmax8_f32(v); }
static inline double v_hmax_f64(v_f64 v) { return x86_hmax4_f64(v); }
static inline float v_hsum_f32(v_f32 v) { return x86_hsum8_f32(v); }
static inline double v_hsum_f64(v_f64 v) { return x86_hsum4_f64(v); }
static inline void v_hsum4_f32(const v_f32 *a, float *out) { x86_hsum8x4_f32(a, out); }
/* Lane i = v_hsum_f32(a[i]) for the VLEN vectors a[i], bit for bit. */
static inline v_f32 v_hsumv_f32(const v_f32 *a) { return x86_hsum8x8_f32(a); }
#define V_HAVE_HSUMV_F32 1
static inline void v_hsum4_f64(const v_f64 *a, double *out) { x86_hsum4x4_f64(a, out); }

/* |v|, the magnitude of m with the sign of s (bit operations), and the
   lane indices 0 .. VLEN - 1: as simd_ref.h. */
static inline v_f32 v_abs_f32(v_f32 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
static inline v_f64 v_abs_f64(v_f64 v) { return _mm256_andnot_pd(_mm256_set1_pd(-0.0), v); }
static inline v_f32 v_copysign_f32(v_f32 m, v_f32 s)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return _mm256_or_ps(_mm256_andnot_ps(sign, m), _mm256_and_ps(sign, s));
}
static inline v_f64 v_copysign_f64(v_f64 m, v_f64 s)
{
    const __m256d sign = _mm256_set1_pd(-0.0);
    return _mm256_or_pd(_mm256_andnot_pd(sign, m), _mm256_and_pd(sign, s));
}
static inline v_f32 v_iota_f32(void) { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
static inline v_f64 v_iota_f64(void) { return _mm256_setr_pd(0, 1, 2, 3); }

/* Lane l of v where the byte p[l] != 0, else -inf (8 or 4 bytes read). */
static inline v_f32 v_selbool_f32(v_f32 v, const uint8_t *p)
{
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256 blocked =
        _mm256_castsi256_ps(_mm256_cmpeq_epi32(w, _mm256_setzero_si256()));
    return _mm256_blendv_ps(v, _mm256_set1_ps(-INFINITY), blocked);
}

static inline v_f64 v_selbool_f64(v_f64 v, const uint8_t *p)
{
    int32_t bytes;
    memcpy(&bytes, p, sizeof bytes);
    const __m256i w = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(bytes));
    const __m256d blocked =
        _mm256_castsi256_pd(_mm256_cmpeq_epi64(w, _mm256_setzero_si256()));
    return _mm256_blendv_pd(v, _mm256_set1_pd(-INFINITY), blocked);
}

static inline v_f32 v_pow2_f32(v_f32 t)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23));
}

static inline v_f64 v_pow2_f64(v_f64 t)
{
    return _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_castpd_si256(t), 52));
}

/* Half precision (simd_ref.h), 8 lanes. float16: F16C's vcvtph2ps and
   vcvtps2ph, whose rounding the immediate sets (MXCSR's is not consulted)
   and whose NaNs are half.h's. bfloat16: half.h's integer rule, lane by
   lane. */
static inline v_f32 v_widen_f16(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline void v_narrow_f16(uint16_t *p, v_f32 v)
{
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

static inline v_f32 v_widen_bf16(const uint16_t *p)
{
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* The 8 int8 values at p as floats, exactly (an int8 KV cache's rows). */
static inline v_f32 v_widen_i8(const int8_t *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline void v_narrow_bf16(uint16_t *p, v_f32 v)
{
    const __m256i x = _mm256_castps_si256(v), hi = _mm256_srli_epi32(x, 16);
    const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb), 16);
    /* |x| > inf as integers (both non-negative): a NaN, made quiet */
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
    /* every lane is 0 .. 0xffff, which packus's saturation keeps */
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r),
                                                    _mm256_extracti128_si256(r, 1)));
}

#endif /* MHA_SIMD_AVX2_H */
