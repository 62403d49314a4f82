/*
 * flash_avx512.c - the fused attention pass with AVX-512F (template in
 * flash_impl.h, contract in flash.h), float32 and float64.
 *
 * ISA flags: this file only, through #pragma GCC target, because setuptools
 * applies extra_compile_args to every source. Nothing here runs unless
 * mha_get_isa() == MHA_ISA_AVX512, i.e. cpuid reports AVX-512F and XCR0
 * shows the OS saves opmask and zmm state.
 *
 * Same blocking as the AVX2 file with vectors twice as wide: 6 x 32
 * (float) or 6 x 16 (double) register blocks. Float key blocks are 128
 * keys, not 64: that halves the per-row bookkeeping per key (horizontal
 * max and sum, alpha, rescaling O), which was 5% faster at T = 4096 on
 * 2 threads of a Zen 5; for double, 128 was 2% slower. Float blocks are
 * not prefetched in software: on Zen 5 the hardware prefetchers follow
 * their rows, and the prefetch loops bought nothing (T = 4096, quiet
 * machine, min of 28 calls: 194 ms without vs 196 ms with on 1 thread,
 * 101.6 ms either way on 2; double and AVX2 were the same either way).
 * The transposing pack stays 8 x 8 / 4 x 4 on ymm registers
 * (flash_x86.h).
 */
#include "flash.h"

#ifdef MHA_FLASH_X86

#include <math.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
#include <immintrin.h>

#include "flash_x86.h"

/* Lane l of v where the byte p[l] != 0, else -inf (16 or 8 bytes read). */
static inline __m512 flash_selbool16_ps(__m512 v, const uint8_t *p)
{
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_mask_blend_ps(_mm512_test_epi32_mask(w, w),
                                _mm512_set1_ps(-INFINITY), v);
}

static inline __m512d flash_selbool8_pd(__m512d v, const uint8_t *p)
{
    const __m512i w = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)p));
    return _mm512_mask_blend_pd(_mm512_test_epi64_mask(w, w),
                                _mm512_set1_pd(-INFINITY), v);
}

/* float32: 16 lanes */
#define FN(name) flash_avx512_f32_##name
#define FLASH_KERNEL mha_flash_avx512_f32
#define REAL float
#define FLASH_F64 0
#define VEC __m512
#define VLEN 16
#define MR 6
#define NV 2
#define BQ 192
#define BK 128
#define FLASH_NO_PREFETCH 1
#define VZERO() _mm512_setzero_ps()
#define VSET1(x) _mm512_set1_ps(x)
#define VLOAD(p) _mm512_load_ps(p)
#define VLOADU(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_store_ps((p), (v))
#define VSTOREU(p, v) _mm512_storeu_ps((p), (v))
#define VBCAST(p) _mm512_set1_ps(*(p))
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define SFMA(a, b, c) __builtin_fmaf((a), (b), (c))
#define VFNMA(a, b, c) _mm512_fnmadd_ps((a), (b), (c))
#define VMUL(a, b) _mm512_mul_ps((a), (b))
#define VADD(a, b) _mm512_add_ps((a), (b))
#define VSUB(a, b) _mm512_sub_ps((a), (b))
#define VDIV(a, b) _mm512_div_ps((a), (b))
#define VMAX(a, b) _mm512_max_ps((a), (b))
#define VMIN(a, b) _mm512_min_ps((a), (b))
#define VHMAX(v) _mm512_reduce_max_ps(v)
#define VHSUM(v) _mm512_reduce_add_ps(v)
#define VSELBOOL(v, p) flash_selbool16_ps((v), (p))
#define VPOW2(t) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(t), 23))
#define FLASH_POLY_EXP 1
#define TB 8
#define TPACK(dst, ldd, src, lds, cols) flash_tpack8_ps((dst), (ldd), (src), (lds), (cols))
#include "flash_impl.h"

/* float64: 8 lanes */
#define FN(name) flash_avx512_f64_##name
#define FLASH_KERNEL mha_flash_avx512_f64
#define REAL double
#define FLASH_F64 1
#define VEC __m512d
#define VLEN 8
#define MR 6
#define NV 2
#define BQ 192
#define BK 64
#define VZERO() _mm512_setzero_pd()
#define VSET1(x) _mm512_set1_pd(x)
#define VLOAD(p) _mm512_load_pd(p)
#define VLOADU(p) _mm512_loadu_pd(p)
#define VSTORE(p, v) _mm512_store_pd((p), (v))
#define VSTOREU(p, v) _mm512_storeu_pd((p), (v))
#define VBCAST(p) _mm512_set1_pd(*(p))
#define VFMA(a, b, c) _mm512_fmadd_pd((a), (b), (c))
#define SFMA(a, b, c) __builtin_fma((a), (b), (c))
#define VFNMA(a, b, c) _mm512_fnmadd_pd((a), (b), (c))
#define VMUL(a, b) _mm512_mul_pd((a), (b))
#define VADD(a, b) _mm512_add_pd((a), (b))
#define VSUB(a, b) _mm512_sub_pd((a), (b))
#define VDIV(a, b) _mm512_div_pd((a), (b))
#define VMAX(a, b) _mm512_max_pd((a), (b))
#define VMIN(a, b) _mm512_min_pd((a), (b))
#define VHMAX(v) _mm512_reduce_max_pd(v)
#define VHSUM(v) _mm512_reduce_add_pd(v)
#define VSELBOOL(v, p) flash_selbool8_pd((v), (p))
#define VPOW2(t) _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_castpd_si512(t), 52))
#define FLASH_POLY_EXP 1
#define TB 4
#define TPACK(dst, ldd, src, lds, cols) flash_tpack4_pd((dst), (ldd), (src), (lds), (cols))
#include "flash_impl.h"

#pragma GCC pop_options

#else
/* Not x86: nothing to compile; ISO C forbids an empty translation unit. */
typedef int mha_flash_avx512_unused;
#endif
