/*
 * simd_x86.h - what the AVX2 and AVX-512 vocabularies share (AVX-512F
 * implies AVX2): transposing copies on 256-bit registers and horizontal
 * reductions in a fixed order. Included by simd_avx2.h and simd_avx512.h,
 * inside their compile unit's target region (isa_target.h), after
 * <immintrin.h>.
 */
#ifndef MHA_SIMD_X86_H
#define MHA_SIMD_X86_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Kernel helpers whose calls must disappear: a function made of prefetches
   alone, which GCC would otherwise deem free of effects and delete. */
#if defined(_MSC_VER) && !defined(__clang__)
#define MHA_ALWAYS_INLINE __forceinline
#else
#define MHA_ALWAYS_INLINE inline __attribute__((always_inline))
#endif

/*
 * dst[p*ldd + r] = src[r*lds + p] for r < rows, p < kc: 8 x 8 (float) or
 * 4 x 4 (double) register transposes; rows past `rows` read row 0 again and
 * are never stored. A leftovers tail of kc % 8 (or % 4) goes one by one.
 * `next` (the rows the caller copies next) is prefetched as we go.
 */
static inline void x86_tpack8_f32(float *dst, size_t ldd, const float *src,
                                  size_t lds, size_t rows, size_t kc,
                                  const float *next)
{
    /* src: (rows, kc) row stride lds; dst: (kc, rows) row stride ldd */
    const float *s[8];
    for (size_t r = 0; r < 8; r++)
        s[r] = src + (r < rows ? r : 0) * lds;
    size_t p = 0;
    for (; p + 8 <= kc; p += 8) {
        if ((p & 15) == 0)
            for (size_t r = 0; r < rows; r++)
                _mm_prefetch((const char *)(next + r * lds + p), _MM_HINT_T0);
        const __m256 r0 = _mm256_loadu_ps(s[0] + p), r1 = _mm256_loadu_ps(s[1] + p);
        const __m256 r2 = _mm256_loadu_ps(s[2] + p), r3 = _mm256_loadu_ps(s[3] + p);
        const __m256 r4 = _mm256_loadu_ps(s[4] + p), r5 = _mm256_loadu_ps(s[5] + p);
        const __m256 r6 = _mm256_loadu_ps(s[6] + p), r7 = _mm256_loadu_ps(s[7] + p);
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
        /* column q of the 8 x 8 block: rows 0..7 at k = p + q */
        __m256 col[8];
        col[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
        col[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
        col[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
        col[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
        col[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
        col[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
        col[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
        col[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
        if (rows == 8) {
            for (int q = 0; q < 8; q++)
                _mm256_storeu_ps(dst + (p + q) * ldd, col[q]);
        } else if (rows == 6) {
            for (int q = 0; q < 8; q++) {
                float *d = dst + (p + q) * ldd;
                _mm_storeu_ps(d, _mm256_castps256_ps128(col[q]));
                _mm_storel_pi((__m64 *)(d + 4), _mm256_extractf128_ps(col[q], 1));
            }
        } else {
            for (int q = 0; q < 8; q++) {
                float tmp[8];
                _mm256_storeu_ps(tmp, col[q]);
                for (size_t r = 0; r < rows; r++)
                    dst[(p + q) * ldd + r] = tmp[r];
            }
        }
    }
    for (; p < kc; p++)
        for (size_t r = 0; r < rows; r++)
            dst[p * ldd + r] = s[r][p];
}

static inline void x86_tpack4_f64(double *dst, size_t ldd, const double *src,
                                  size_t lds, size_t rows, size_t kc,
                                  const double *next)
{
    /* src: (rows, kc) row stride lds; dst: (kc, rows) row stride ldd */
    const double *s[4];
    for (size_t r = 0; r < 4; r++)
        s[r] = src + (r < rows ? r : 0) * lds;
    size_t p = 0;
    for (; p + 4 <= kc; p += 4) {
        if ((p & 7) == 0)
            for (size_t r = 0; r < rows; r++)
                _mm_prefetch((const char *)(next + r * lds + p), _MM_HINT_T0);
        const __m256d r0 = _mm256_loadu_pd(s[0] + p), r1 = _mm256_loadu_pd(s[1] + p);
        const __m256d r2 = _mm256_loadu_pd(s[2] + p), r3 = _mm256_loadu_pd(s[3] + p);
        /* t0 = a0 b0 | a2 b2, t1 = a1 b1 | a3 b3, ... */
        const __m256d t0 = _mm256_unpacklo_pd(r0, r1), t1 = _mm256_unpackhi_pd(r0, r1);
        const __m256d t2 = _mm256_unpacklo_pd(r2, r3), t3 = _mm256_unpackhi_pd(r2, r3);
        __m256d col[4];
        col[0] = _mm256_permute2f128_pd(t0, t2, 0x20);
        col[1] = _mm256_permute2f128_pd(t1, t3, 0x20);
        col[2] = _mm256_permute2f128_pd(t0, t2, 0x31);
        col[3] = _mm256_permute2f128_pd(t1, t3, 0x31);
        if (rows == 4) {
            for (int q = 0; q < 4; q++)
                _mm256_storeu_pd(dst + (p + q) * ldd, col[q]);
        } else if (rows == 2) {
            for (int q = 0; q < 4; q++)
                _mm_storeu_pd(dst + (p + q) * ldd, _mm256_castpd256_pd128(col[q]));
        } else {
            for (int q = 0; q < 4; q++) {
                double tmp[4];
                _mm256_storeu_pd(tmp, col[q]);
                for (size_t r = 0; r < rows; r++)
                    dst[(p + q) * ldd + r] = tmp[r];
            }
        }
    }
    for (; p < kc; p++)
        for (size_t r = 0; r < rows; r++)
            dst[p * ldd + r] = s[r][p];
}

/* Horizontal sums and maxima in a fixed order: halves, then pairs. */
static inline float x86_hsum8_f32(__m256 v)
{
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* The four sums x86_hsum8_f32(a[u]) at once, bit for bit: every lane is
   added in the same order (halves, then lanes two apart, then
   neighbours), four vectors to a shuffle. a[0] and a[2] share the 128-bit
   halves of one register, a[1] and a[3] of another. */
static inline void x86_hsum8x4_f32(const __m256 *a, float *out)
{
    // halves: lane 0 holds p = a[u].lo + a[u].hi of a[0] (then a[1]),
    // lane 1 of a[2] (then a[3])
    const __m256 t02 = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[2], 0x20),
                                     _mm256_permute2f128_ps(a[0], a[2], 0x31));
    const __m256 t13 = _mm256_add_ps(_mm256_permute2f128_ps(a[1], a[3], 0x20),
                                     _mm256_permute2f128_ps(a[1], a[3], 0x31));
    // p0 + p2, p1 + p3, interleaved: (q0 of a[0], q0 of a[1], q1 of a[0], q1 of a[1])
    const __m256 u = _mm256_add_ps(_mm256_unpacklo_ps(t02, t13), _mm256_unpackhi_ps(t02, t13));
    // q0 + q1 (= q1 + q0: addition commutes bit for bit)
    const __m256 w = _mm256_add_ps(u, _mm256_castpd_ps(_mm256_unpackhi_pd(
                                          _mm256_castps_pd(u), _mm256_castps_pd(u))));
    const __m128 lo = _mm256_castps256_ps128(w), hi = _mm256_extractf128_ps(w, 1);
    _mm_storeu_ps(out, _mm_movelh_ps(lo, hi));
}

/* Lane i = x86_hsum8_f32(a[i]) for i < 8, bit for bit: the same tree run
   across the 8 vectors at once (7 adds and 14 shuffles for 8 sums, where
   two x86_hsum8x4_f32 take 8 and 18 and leave them in memory). Level 1
   adds the 128-bit halves of two vectors into one register (a[0] in the
   low half, a[4] in the high, and so on: the order P), level 2 lanes two
   apart and level 3 neighbours, inside each half. */
static inline __m256 x86_hsum8x8_f32(const __m256 *a)
{
    static const int P[8] = {0, 4, 1, 5, 2, 6, 3, 7};
    __m256 b[4], e[2];
    for (int m = 0; m < 4; m++) {
        const __m256 x = a[P[2 * m]], y = a[P[2 * m + 1]];
        b[m] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20),
                             _mm256_permute2f128_ps(x, y, 0x31));
    }
    for (int m = 0; m < 2; m++)
        e[m] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * m], b[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(b[2 * m], b[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The four sums x86_hsum4_f64(a[u]) at once, bit for bit (halves, then
   neighbours). */
static inline void x86_hsum4x4_f64(const __m256d *a, double *out)
{
    const __m256d t02 = _mm256_add_pd(_mm256_permute2f128_pd(a[0], a[2], 0x20),
                                      _mm256_permute2f128_pd(a[0], a[2], 0x31));
    const __m256d t13 = _mm256_add_pd(_mm256_permute2f128_pd(a[1], a[3], 0x20),
                                      _mm256_permute2f128_pd(a[1], a[3], 0x31));
    _mm256_storeu_pd(out, _mm256_hadd_pd(t02, t13));
}

static inline float x86_hmax8_f32(__m256 v)
{
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline double x86_hsum4_f64(__m256d v)
{
    __m128d x = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    x = _mm_add_sd(x, _mm_unpackhi_pd(x, x));
    return _mm_cvtsd_f64(x);
}

static inline double x86_hmax4_f64(__m256d v)
{
    __m128d x = _mm_max_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    x = _mm_max_sd(x, _mm_unpackhi_pd(x, x));
    return _mm_cvtsd_f64(x);
}

/* Prefetch hints: into every cache level (t0), or into L2 and up (t1). */
static inline void v_prefetch_t0(const void *p)
{
    _mm_prefetch((const char *)p, _MM_HINT_T0);
}

static inline void v_prefetch_t1(const void *p)
{
    _mm_prefetch((const char *)p, _MM_HINT_T1);
}

/* The vocabulary's transposing copy, on both ISAs: 8 float or 4 double
   rows at a time (a zmm version bought nothing, as the copy is bound by
   its loads). */
#define V_TPACK_ROWS_F32 8
#define V_TPACK_ROWS_F64 4

static inline void v_tpack_f32(float *dst, size_t ldd, const float *src,
                               size_t lds, size_t rows, size_t cols,
                               const float *next)
{
    x86_tpack8_f32(dst, ldd, src, lds, rows, cols, next);
}

static inline void v_tpack_f64(double *dst, size_t ldd, const double *src,
                               size_t lds, size_t rows, size_t cols,
                               const double *next)
{
    x86_tpack4_f64(dst, ldd, src, lds, rows, cols, next);
}

#endif /* MHA_SIMD_X86_H */
