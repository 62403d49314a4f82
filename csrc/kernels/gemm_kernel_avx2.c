/*
 * gemm_kernel_avx2.c - AVX2 + FMA GEMM micro-kernels (template in
 * gemm_ukr_impl.h, contract in gemm_kernels.h).
 *
 * ISA flags: this file only, through #pragma GCC target, because setuptools
 * applies extra_compile_args to every source. Nothing here runs unless
 * mha_get_isa() >= MHA_ISA_AVX2 (dispatch.c checks cpuid and xgetbv).
 */
#include "gemm_kernels.h"

#ifdef MHA_HAVE_X86_KERNELS

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>

/* f32: 6 x 16 tile, two ymm of 8 floats per row */
#define UKR_NAME mha_gemm_ukr_avx2_f32
#define REAL float
#define VEC __m256
#define VLEN 8
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_load_ps(p)
#define VLOADU(p) _mm256_loadu_ps(p)
#define VSTOREU(p, v) _mm256_storeu_ps((p), (v))
#define VBCAST(p) _mm256_broadcast_ss(p)
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VADD(a, b) _mm256_add_ps((a), (b))
#define MR MHA_AVX2_MR
#define NV 2
#include "gemm_ukr_impl.h"
#undef UKR_NAME
#undef REAL
#undef VEC
#undef VLEN
#undef VZERO
#undef VLOAD
#undef VLOADU
#undef VSTOREU
#undef VBCAST
#undef VFMA
#undef VADD
#undef MR
#undef NV

/* f64: 6 x 8 tile, two ymm of 4 doubles per row */
#define UKR_NAME mha_gemm_ukr_avx2_f64
#define REAL double
#define VEC __m256d
#define VLEN 4
#define VZERO() _mm256_setzero_pd()
#define VLOAD(p) _mm256_load_pd(p)
#define VLOADU(p) _mm256_loadu_pd(p)
#define VSTOREU(p, v) _mm256_storeu_pd((p), (v))
#define VBCAST(p) _mm256_broadcast_sd(p)
#define VFMA(a, b, c) _mm256_fmadd_pd((a), (b), (c))
#define VADD(a, b) _mm256_add_pd((a), (b))
#define MR MHA_AVX2_MR
#define NV 2
#include "gemm_ukr_impl.h"

/*
 * Transposing pack (contract in gemm_kernels.h): 8 x 8 (float) or 4 x 4
 * (double) register transposes; the rows past `rows` read row 0 again and
 * are never stored. A leftovers tail of kc % 8 (or % 4) goes one by one.
 */
void mha_gemm_tpack_avx2_f32(float *dst, size_t ldd, const float *src,
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
                __builtin_prefetch(next + r * lds + p, 0, 3);
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

void mha_gemm_tpack_avx2_f64(double *dst, size_t ldd, const double *src,
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
                __builtin_prefetch(next + r * lds + p, 0, 3);
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

#pragma GCC pop_options

#else
/* Not x86: nothing to compile; ISO C forbids an empty translation unit. */
typedef int mha_gemm_kernel_avx2_unused;
#endif
