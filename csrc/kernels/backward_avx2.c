/*
 * backward_avx2.c - the backward pass (backward_impl.h) compiled for AVX2.
 *
 * ISA flags: this file only, through #pragma GCC target, because setuptools
 * applies extra_compile_args to every source. The tile product (the bulk
 * of the work) is written with intrinsics and fused multiply-adds
 * (backward_mm_avx2.h); the rest is backward_impl.h's portable code, which
 * the compiler vectorises for AVX2 (-std=c11 keeps it from contracting
 * a * b + c there). The gradients therefore differ from the portable
 * build's by rounding only, and are bitwise the same for any thread count
 * within this build. Nothing here runs unless mha_get_isa() >=
 * MHA_ISA_AVX2 (dispatch.c checks cpuid and xgetbv, FMA included).
 * Elsewhere the file is empty.
 */
#include "backward.h"

#ifdef MHA_BWD_HAVE_AVX2

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>

/* The tile product, with intrinsics: GCC does not keep a 4 x 16 block of
   accumulators in registers reliably from plain C, and plain C may not
   contract a * b + c into one instruction. */
#define REAL float
#define SFX f32
#define VEC __m256
#define VLEN 8
#define VZERO() _mm256_setzero_ps()
#define VLOADU(p) _mm256_loadu_ps(p)
#define VSTOREU(p, v) _mm256_storeu_ps((p), (v))
#define VBCAST(p) _mm256_broadcast_ss(p)
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define SFMA(a, b, c) fmaf((a), (b), (c))
#include "backward_mm_avx2.h"
#undef REAL
#undef SFX
#undef VEC
#undef VLEN
#undef VZERO
#undef VLOADU
#undef VSTOREU
#undef VBCAST
#undef VFMA
#undef SFMA

#define REAL double
#define SFX f64
#define VEC __m256d
#define VLEN 4
#define VZERO() _mm256_setzero_pd()
#define VLOADU(p) _mm256_loadu_pd(p)
#define VSTOREU(p, v) _mm256_storeu_pd((p), (v))
#define VBCAST(p) _mm256_broadcast_sd(p)
#define VFMA(a, b, c) _mm256_fmadd_pd((a), (b), (c))
#define SFMA(a, b, c) fma((a), (b), (c))
#include "backward_mm_avx2.h"
#undef REAL
#undef SFX
#undef VEC
#undef VLEN
#undef VZERO
#undef VLOADU
#undef VSTOREU
#undef VBCAST
#undef VFMA
#undef SFMA

#define BWD_HAVE_MM 1

#define real float
#define sfx f32
#define isa avx2
#define bwd_exp bwd_expf
#include "backward_impl.h"
#undef real
#undef sfx
#undef isa
#undef bwd_exp

#define real double
#define sfx f64
#define isa avx2
#define bwd_exp bwd_expd
#include "backward_impl.h"
#undef real
#undef sfx
#undef isa
#undef bwd_exp

#undef BWD_HAVE_MM
#pragma GCC pop_options

#else
typedef int mha_backward_avx2_empty; /* ISO C forbids an empty file */
#endif
