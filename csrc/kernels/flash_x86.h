/*
 * flash_x86.h - AVX2 helpers of the attention kernels: transposing packs,
 * horizontal reductions and the bool-mask select on 256-bit vectors.
 * Included by flash_avx2.c and flash_avx512.c under their target pragmas
 * (AVX-512F implies AVX2), after <immintrin.h>.
 */
#ifndef MHA_FLASH_X86_H
#define MHA_FLASH_X86_H

#include <stdint.h>
#include <string.h>

/*
 * dst[c*ldd + r] = src[r*lds + c] for r < 8, c < cols: 8 x 8 register
 * transposes, then a leftovers tail of cols % 8 one by one.
 */
static inline void flash_tpack8_ps(float *dst, size_t ldd, const float *src,
                                   size_t lds, size_t cols)
{
    size_t c = 0;
    for (; c + 8 <= cols; c += 8) {
        const float *s = src + c;
        const __m256 r0 = _mm256_loadu_ps(s), r1 = _mm256_loadu_ps(s + lds);
        const __m256 r2 = _mm256_loadu_ps(s + 2 * lds);
        const __m256 r3 = _mm256_loadu_ps(s + 3 * lds);
        const __m256 r4 = _mm256_loadu_ps(s + 4 * lds);
        const __m256 r5 = _mm256_loadu_ps(s + 5 * lds);
        const __m256 r6 = _mm256_loadu_ps(s + 6 * lds);
        const __m256 r7 = _mm256_loadu_ps(s + 7 * lds);
        /* t0 = a0 b0 a1 b1 | a4 b4 a5 b5, ... */
        const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
        const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
        const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
        const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
        /* u0 = a0 b0 c0 d0 | a4 b4 c4 d4, ... */
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
        const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
        const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
        float *d = dst + c * ldd;
        _mm256_storeu_ps(d, _mm256_permute2f128_ps(u0, u4, 0x20));
        _mm256_storeu_ps(d + ldd, _mm256_permute2f128_ps(u1, u5, 0x20));
        _mm256_storeu_ps(d + 2 * ldd, _mm256_permute2f128_ps(u2, u6, 0x20));
        _mm256_storeu_ps(d + 3 * ldd, _mm256_permute2f128_ps(u3, u7, 0x20));
        _mm256_storeu_ps(d + 4 * ldd, _mm256_permute2f128_ps(u0, u4, 0x31));
        _mm256_storeu_ps(d + 5 * ldd, _mm256_permute2f128_ps(u1, u5, 0x31));
        _mm256_storeu_ps(d + 6 * ldd, _mm256_permute2f128_ps(u2, u6, 0x31));
        _mm256_storeu_ps(d + 7 * ldd, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
    for (; c < cols; c++)
        for (size_t r = 0; r < 8; r++)
            dst[c * ldd + r] = src[r * lds + c];
}

/* The same for doubles, 4 x 4. */
static inline void flash_tpack4_pd(double *dst, size_t ldd, const double *src,
                                   size_t lds, size_t cols)
{
    size_t c = 0;
    for (; c + 4 <= cols; c += 4) {
        const double *s = src + c;
        const __m256d r0 = _mm256_loadu_pd(s), r1 = _mm256_loadu_pd(s + lds);
        const __m256d r2 = _mm256_loadu_pd(s + 2 * lds);
        const __m256d r3 = _mm256_loadu_pd(s + 3 * lds);
        /* t0 = a0 b0 | a2 b2, t1 = a1 b1 | a3 b3, ... */
        const __m256d t0 = _mm256_unpacklo_pd(r0, r1), t1 = _mm256_unpackhi_pd(r0, r1);
        const __m256d t2 = _mm256_unpacklo_pd(r2, r3), t3 = _mm256_unpackhi_pd(r2, r3);
        double *d = dst + c * ldd;
        _mm256_storeu_pd(d, _mm256_permute2f128_pd(t0, t2, 0x20));
        _mm256_storeu_pd(d + ldd, _mm256_permute2f128_pd(t1, t3, 0x20));
        _mm256_storeu_pd(d + 2 * ldd, _mm256_permute2f128_pd(t0, t2, 0x31));
        _mm256_storeu_pd(d + 3 * ldd, _mm256_permute2f128_pd(t1, t3, 0x31));
    }
    for (; c < cols; c++)
        for (size_t r = 0; r < 4; r++)
            dst[c * ldd + r] = src[r * lds + c];
}

/* Horizontal sums and maxima in a fixed order: halves, then pairs. */
static inline float flash_hsum8_ps(__m256 v)
{
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline float flash_hmax8_ps(__m256 v)
{
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline double flash_hsum4_pd(__m256d v)
{
    __m128d x = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    x = _mm_add_sd(x, _mm_unpackhi_pd(x, x));
    return _mm_cvtsd_f64(x);
}

static inline double flash_hmax4_pd(__m256d v)
{
    __m128d x = _mm_max_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    x = _mm_max_sd(x, _mm_unpackhi_pd(x, x));
    return _mm_cvtsd_f64(x);
}

/* Lane l of v where the byte p[l] != 0, else -inf (8 or 4 bytes read). */
static inline __m256 flash_selbool8_ps(__m256 v, const uint8_t *p)
{
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256 blocked =
        _mm256_castsi256_ps(_mm256_cmpeq_epi32(w, _mm256_setzero_si256()));
    return _mm256_blendv_ps(v, _mm256_set1_ps(-INFINITY), blocked);
}

static inline __m256d flash_selbool4_pd(__m256d v, const uint8_t *p)
{
    int32_t bytes;
    memcpy(&bytes, p, sizeof bytes);
    const __m256i w = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(bytes));
    const __m256d blocked =
        _mm256_castsi256_pd(_mm256_cmpeq_epi64(w, _mm256_setzero_si256()));
    return _mm256_blendv_pd(v, _mm256_set1_pd(-INFINITY), blocked);
}

#endif /* MHA_FLASH_X86_H */
