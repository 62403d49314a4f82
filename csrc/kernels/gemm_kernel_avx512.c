/*
 * gemm_kernel_avx512.c - AVX-512F GEMM micro-kernels (template in
 * gemm_ukr_impl.h, contract in gemm_kernels.h).
 *
 * ISA flags: this file only, through #pragma GCC target, because setuptools
 * applies extra_compile_args to every source. Nothing here runs unless
 * mha_get_isa() == MHA_ISA_AVX512, i.e. cpuid reports AVX-512F and XCR0
 * shows the OS saves opmask and zmm state.
 */
#include "gemm_kernels.h"

#ifdef MHA_HAVE_X86_KERNELS

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
#include <immintrin.h>

/* f32: 6 x 32 tile, two zmm of 16 floats per row */
#define UKR_NAME mha_gemm_ukr_avx512_f32
#define REAL float
#define VEC __m512
#define VLEN 16
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_load_ps(p)
#define VLOADU(p) _mm512_loadu_ps(p)
#define VSTOREU(p, v) _mm512_storeu_ps((p), (v))
#define VBCAST(p) _mm512_set1_ps(*(p))
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VADD(a, b) _mm512_add_ps((a), (b))
#define MR MHA_AVX512_MR
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

/* f64: 6 x 16 tile, two zmm of 8 doubles per row */
#define UKR_NAME mha_gemm_ukr_avx512_f64
#define REAL double
#define VEC __m512d
#define VLEN 8
#define VZERO() _mm512_setzero_pd()
#define VLOAD(p) _mm512_load_pd(p)
#define VLOADU(p) _mm512_loadu_pd(p)
#define VSTOREU(p, v) _mm512_storeu_pd((p), (v))
#define VBCAST(p) _mm512_set1_pd(*(p))
#define VFMA(a, b, c) _mm512_fmadd_pd((a), (b), (c))
#define VADD(a, b) _mm512_add_pd((a), (b))
#define MR MHA_AVX512_MR
#define NV 2
#include "gemm_ukr_impl.h"

#pragma GCC pop_options

#else
typedef int mha_gemm_kernel_avx512_unused;
#endif
