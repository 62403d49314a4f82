/*
 * backward_avx512.c - the backward pass (backward_impl.h) compiled for
 * AVX-512F.
 *
 * ISA flags: this file only, through #pragma GCC target, because setuptools
 * applies extra_compile_args to every source. As in backward_avx2.c, the
 * tile product is written with intrinsics and fused multiply-adds, here on
 * 512-bit registers (backward_mm_avx512.h, an 8 x 2-vector register block);
 * the rest is backward_impl.h's portable code, which the compiler
 * vectorises (-std=c11 keeps it from contracting a * b + c). Each element
 * of a tile product is the same chain of fused multiply-adds as in the
 * AVX2 build, so the two builds differ only through the projection GEMMs
 * (gemm.h, whose blocking depends on the ISA), and the gradients are
 * bitwise the same for any thread count within this build. Nothing here
 * runs unless mha_get_isa() == MHA_ISA_AVX512 (dispatch.c: cpuid reports
 * AVX-512F and XCR0 shows the OS saves opmask and zmm state). Elsewhere
 * the file is empty.
 */
#include "backward.h"

#ifdef MHA_BWD_HAVE_AVX2

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
#include <immintrin.h>

#define REAL float
#define SFX f32
#define VEC __m512
#define MASK __mmask16
#define VLEN 16
#define VZERO() _mm512_setzero_ps()
#define VLOADU(p) _mm512_loadu_ps(p)
#define VMLOADU(k, p) _mm512_maskz_loadu_ps((k), (p))
#define VMSTOREU(p, k, v) _mm512_mask_storeu_ps((p), (k), (v))
#define VBCAST(p) _mm512_set1_ps(*(p))
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#include "backward_mm_avx512.h"
#undef REAL
#undef SFX
#undef VEC
#undef MASK
#undef VLEN
#undef VZERO
#undef VLOADU
#undef VMLOADU
#undef VMSTOREU
#undef VBCAST
#undef VFMA

#define REAL double
#define SFX f64
#define VEC __m512d
#define MASK __mmask8
#define VLEN 8
#define VZERO() _mm512_setzero_pd()
#define VLOADU(p) _mm512_loadu_pd(p)
#define VMLOADU(k, p) _mm512_maskz_loadu_pd((k), (p))
#define VMSTOREU(p, k, v) _mm512_mask_storeu_pd((p), (k), (v))
#define VBCAST(p) _mm512_set1_pd(*(p))
#define VFMA(a, b, c) _mm512_fmadd_pd((a), (b), (c))
#include "backward_mm_avx512.h"
#undef REAL
#undef SFX
#undef VEC
#undef MASK
#undef VLEN
#undef VZERO
#undef VLOADU
#undef VMLOADU
#undef VMSTOREU
#undef VBCAST
#undef VFMA

#define BWD_HAVE_MM 1

#define real float
#define sfx f32
#define isa avx512
#define bwd_exp bwd_expf
#include "backward_impl.h"
#undef real
#undef sfx
#undef isa
#undef bwd_exp

#define real double
#define sfx f64
#define isa avx512
#define bwd_exp bwd_expd
#include "backward_impl.h"
#undef real
#undef sfx
#undef isa
#undef bwd_exp

#undef BWD_HAVE_MM
#pragma GCC pop_options

#else
typedef int mha_backward_avx512_empty; /* ISO C forbids an empty file */
#endif
