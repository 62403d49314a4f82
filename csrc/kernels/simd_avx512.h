/*
 * simd_avx512.h - the vector vocabulary on AVX-512F (512-bit zmm): the
 * names of simd_ref.h, with 16 float or 8 double lanes. Included by
 * isa_avx512.c only, inside its target region: nothing here runs unless
 * mha_get_isa() == MHA_ISA_AVX512 (dispatch.c: cpuid reports AVX-512F and
 * XCR0 shows the OS saves opmask and zmm state). The transposing copy
 * stays on 256-bit registers (simd_x86.h).
 * v_madd and v_fma are both the fused multiply-add.
 */
#ifndef MHA_SIMD_AVX512_H
#define MHA_SIMD_AVX512_H

#include <immintrin.h>
#include <math.h>

#include "simd_x86.h"

#define MHA_SIMD_ISA_NAME "avx512"

typedef __m512 v_f32;
typedef __m512d v_f64;
#define V_LEN_F32 16
#define V_LEN_F64 8

static inline v_f32 v_zero_f32(void) { return _mm512_setzero_ps(); }
static inline v_f64 v_zero_f64(void) { return _mm512_setzero_pd(); }
static inline v_f32 v_set1_f32(float x) { return _mm512_set1_ps(x); }
static inline v_f64 v_set1_f64(double x) { return _mm512_set1_pd(x); }
static inline v_f32 v_load_f32(const float *p) { return _mm512_load_ps(p); }
static inline v_f64 v_load_f64(const double *p) { return _mm512_load_pd(p); }
static inline v_f32 v_loadu_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline v_f64 v_loadu_f64(const double *p) { return _mm512_loadu_pd(p); }
static inline void v_store_f32(float *p, v_f32 v) { _mm512_store_ps(p, v); }
static inline void v_store_f64(double *p, v_f64 v) { _mm512_store_pd(p, v); }
static inline void v_storeu_f32(float *p, v_f32 v) { _mm512_storeu_ps(p, v); }
static inline void v_storeu_f64(double *p, v_f64 v) { _mm512_storeu_pd(p, v); }
static inline v_f32 v_bcast_f32(const float *p) { return _mm512_set1_ps(*p); }
static inline v_f64 v_bcast_f64(const double *p) { return _mm512_set1_pd(*p); }

static inline v_f32 v_madd_f32(v_f32 a, v_f32 b, v_f32 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v_f64 v_madd_f64(v_f64 a, v_f64 b, v_f64 c) { return _mm512_fmadd_pd(a, b, c); }
static inline float s_madd_f32(float a, float b, float c) { return fmaf(a, b, c); }
static inline double s_madd_f64(double a, double b, double c) { return fma(a, b, c); }
static inline v_f32 v_fma_f32(v_f32 a, v_f32 b, v_f32 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v_f64 v_fma_f64(v_f64 a, v_f64 b, v_f64 c) { return _mm512_fmadd_pd(a, b, c); }
static inline v_f32 v_fnma_f32(v_f32 a, v_f32 b, v_f32 c) { return _mm512_fnmadd_ps(a, b, c); }
static inline v_f64 v_fnma_f64(v_f64 a, v_f64 b, v_f64 c) { return _mm512_fnmadd_pd(a, b, c); }

static inline v_f32 v_add_f32(v_f32 a, v_f32 b) { return _mm512_add_ps(a, b); }
static inline v_f64 v_add_f64(v_f64 a, v_f64 b) { return _mm512_add_pd(a, b); }
static inline v_f32 v_sub_f32(v_f32 a, v_f32 b) { return _mm512_sub_ps(a, b); }
static inline v_f64 v_sub_f64(v_f64 a, v_f64 b) { return _mm512_sub_pd(a, b); }
static inline v_f32 v_mul_f32(v_f32 a, v_f32 b) { return _mm512_mul_ps(a, b); }
static inline v_f64 v_mul_f64(v_f64 a, v_f64 b) { return _mm512_mul_pd(a, b); }
static inline v_f32 v_div_f32(v_f32 a, v_f32 b) { return _mm512_div_ps(a, b); }
static inline v_f64 v_div_f64(v_f64 a, v_f64 b) { return _mm512_div_pd(a, b); }
static inline v_f32 v_max_f32(v_f32 a, v_f32 b) { return _mm512_max_ps(a, b); }
static inline v_f64 v_max_f64(v_f64 a, v_f64 b) { return _mm512_max_pd(a, b); }
static inline v_f32 v_min_f32(v_f32 a, v_f32 b) { return _mm512_min_ps(a, b); }
static inline v_f64 v_min_f64(v_f64 a, v_f64 b) { return _mm512_min_pd(a, b); }
static inline float v_hmax_f32(v_f32 v) { return _mm512_reduce_max_ps(v); }
static inline double v_hmax_f64(v_f64 v) { return _mm512_reduce_max_pd(v); }
/* The sum of the 16 lanes as a tree of lanes 8, 4, 2 and 1 apart: lane i
   + lane i + 8 (i < 8), then i + 4, i + 2, i + 1. GCC's
   _mm512_reduce_add_ps adds in this order and LLVM's lowering of it too,
   but neither promises it; written out, the order is this file's, and
   v_hsumv_f32 below gives its bits 16 sums at a time. */
static inline float v_hsum_f32(v_f32 v)
{
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(
                                       _mm512_castps_pd(v), 1)));
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}
static inline double v_hsum_f64(v_f64 v) { return _mm512_reduce_add_pd(v); }
/* out[u] = v_hsum(a[u]) for u < 4 (v_hsum's order, four times). */
static inline void v_hsum4_f32(const v_f32 *a, float *out)
{
    for (int u = 0; u < 4; u++)
        out[u] = v_hsum_f32(a[u]);
}

/* Lane i = v_hsum_f32(a[i]) for i < 16, bit for bit: the same tree, run
   across the 16 vectors at once (15 adds and 30 shuffles, where 16 v_hsum
   take 64 and 64). Each level adds the two halves of every partial sum
   that the level before left, two vectors' partials packed into one:
   lanes 8 apart (whole 256-bit halves), 4 apart (128-bit lanes), then 2
   and 1 apart inside each 128-bit lane. The level-1 pairs are taken in
   the order P below, so that the result's lanes come out in a's order. */
static inline v_f32 v_hsumv_f32(const v_f32 *a)
{
    static const int P[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
    v_f32 b[8], e[4], g[2];
    for (int m = 0; m < 8; m++) {
        const v_f32 x = a[P[2 * m]], y = a[P[2 * m + 1]];
        // [x.lo256 | y.lo256] + [x.hi256 | y.hi256]
        b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    for (int m = 0; m < 4; m++)   // 128-bit lane k: the 4 partials of one vector
        e[m] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int m = 0; m < 2; m++)
        g[m] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * m], e[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(e[2 * m], e[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#define V_HAVE_HSUMV_F32 1
static inline void v_hsum4_f64(const v_f64 *a, double *out)
{
    for (int u = 0; u < 4; u++)
        out[u] = _mm512_reduce_add_pd(a[u]);
}

/* |v|, the magnitude of m with the sign of s (integer bit operations:
   AVX-512F has no float and/or), and the lane indices: as simd_ref.h. */
static inline v_f32 v_abs_f32(v_f32 v)
{
    return _mm512_castsi512_ps(_mm512_andnot_si512(
        _mm512_set1_epi32((int32_t)0x80000000u), _mm512_castps_si512(v)));
}
static inline v_f64 v_abs_f64(v_f64 v)
{
    return _mm512_castsi512_pd(_mm512_andnot_si512(
        _mm512_set1_epi64((int64_t)0x8000000000000000u), _mm512_castpd_si512(v)));
}
static inline v_f32 v_copysign_f32(v_f32 m, v_f32 s)
{
    const __m512i sign = _mm512_set1_epi32((int32_t)0x80000000u);
    return _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_andnot_si512(sign, _mm512_castps_si512(m)),
                        _mm512_and_si512(sign, _mm512_castps_si512(s))));
}
static inline v_f64 v_copysign_f64(v_f64 m, v_f64 s)
{
    const __m512i sign = _mm512_set1_epi64((int64_t)0x8000000000000000u);
    return _mm512_castsi512_pd(
        _mm512_or_si512(_mm512_andnot_si512(sign, _mm512_castpd_si512(m)),
                        _mm512_and_si512(sign, _mm512_castpd_si512(s))));
}
static inline v_f32 v_iota_f32(void)
{
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
static inline v_f64 v_iota_f64(void) { return _mm512_setr_pd(0, 1, 2, 3, 4, 5, 6, 7); }

/* Lane l of v where the byte p[l] != 0, else -inf (16 or 8 bytes read). */
static inline v_f32 v_selbool_f32(v_f32 v, const uint8_t *p)
{
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_mask_blend_ps(_mm512_test_epi32_mask(w, w),
                                _mm512_set1_ps(-INFINITY), v);
}

static inline v_f64 v_selbool_f64(v_f64 v, const uint8_t *p)
{
    const __m512i w = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)p));
    return _mm512_mask_blend_pd(_mm512_test_epi64_mask(w, w),
                                _mm512_set1_pd(-INFINITY), v);
}

static inline v_f32 v_pow2_f32(v_f32 t)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(t), 23));
}

static inline v_f64 v_pow2_f64(v_f64 t)
{
    return _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_castpd_si512(t), 52));
}

/*
 * Half precision (simd_ref.h), 16 lanes. float16: the 512-bit vcvtph2ps
 * and vcvtps2ph (AVX-512F), rounding set by the immediate, NaNs as
 * half.h's. bfloat16: half.h's integer rule, lane by lane. Not
 * vcvtneps2bf16 (AVX512_BF16), though it rounds to nearest even: it
 * treats a float32 subnormal as zero (measured on a Xeon with avx512_bf16:
 * 0x007fffff gives 0x0000, where rounding gives 0x0080): its bits would
 * not be every other path's.
 */
static inline v_f32 v_widen_f16(const uint16_t *p)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

static inline void v_narrow_f16(uint16_t *p, v_f32 v)
{
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

static inline v_f32 v_widen_bf16(const uint16_t *p)
{
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* The 16 int8 values at p as floats, exactly (an int8 KV cache's rows). */
static inline v_f32 v_widen_i8(const int8_t *p)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

static inline void v_narrow_bf16(uint16_t *p, v_f32 v)
{
    const __m512i x = _mm512_castps_si512(v), hi = _mm512_srli_epi32(x, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb), 16);
    /* |x| > inf as integers: a NaN, made quiet */
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i r =
        _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    /* vpmovdw keeps each lane's low 16 bits: all of it */
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}

#endif /* MHA_SIMD_AVX512_H */
