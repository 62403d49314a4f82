/*
 * flash_avx2.c - the fused attention pass with AVX2 + FMA (template in
 * flash_impl.h, contract in flash.h), float32 and float64.
 *
 * ISA flags: this file only, through #pragma GCC target, because setuptools
 * applies extra_compile_args to every source. Nothing here runs unless
 * mha_get_isa() >= MHA_ISA_AVX2 (dispatch.c checks cpuid and xgetbv).
 *
 * Tiles: 6 x 16 (float) or 6 x 8 (double) register blocks, 12 accumulators
 * + 2 loaded vectors + 1 broadcast of the 16 ymm registers; 192 query rows
 * per tile, so that streaming a 64-key block of K and V from L3 and packing
 * it is paid once per 192 rows (96 measured ~5% slower at T = 4096).
 */
#include "flash.h"

#ifdef MHA_FLASH_X86

#include <math.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>

#include "flash_x86.h"

/* float32: 8 lanes */
#define FN(name) flash_avx2_f32_##name
#define FLASH_KERNEL mha_flash_avx2_f32
#define REAL float
#define FLASH_F64 0
#define VEC __m256
#define VLEN 8
#define MR 6
#define NV 2
#define BQ 192
#define BK 64
#define VZERO() _mm256_setzero_ps()
#define VSET1(x) _mm256_set1_ps(x)
#define VLOAD(p) _mm256_load_ps(p)
#define VLOADU(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_store_ps((p), (v))
#define VSTOREU(p, v) _mm256_storeu_ps((p), (v))
#define VBCAST(p) _mm256_broadcast_ss(p)
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define SFMA(a, b, c) __builtin_fmaf((a), (b), (c))
#define VFNMA(a, b, c) _mm256_fnmadd_ps((a), (b), (c))
#define VMUL(a, b) _mm256_mul_ps((a), (b))
#define VADD(a, b) _mm256_add_ps((a), (b))
#define VSUB(a, b) _mm256_sub_ps((a), (b))
#define VDIV(a, b) _mm256_div_ps((a), (b))
#define VMAX(a, b) _mm256_max_ps((a), (b))
#define VMIN(a, b) _mm256_min_ps((a), (b))
#define VHMAX(v) flash_hmax8_ps(v)
#define VHSUM(v) flash_hsum8_ps(v)
#define VSELBOOL(v, p) flash_selbool8_ps((v), (p))
#define VPOW2(t) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23))
#define FLASH_POLY_EXP 1
#define TB 8
#define TPACK(dst, ldd, src, lds, cols) flash_tpack8_ps((dst), (ldd), (src), (lds), (cols))
#include "flash_impl.h"

/* float64: 4 lanes */
#define FN(name) flash_avx2_f64_##name
#define FLASH_KERNEL mha_flash_avx2_f64
#define REAL double
#define FLASH_F64 1
#define VEC __m256d
#define VLEN 4
#define MR 6
#define NV 2
#define BQ 192
#define BK 64
#define VZERO() _mm256_setzero_pd()
#define VSET1(x) _mm256_set1_pd(x)
#define VLOAD(p) _mm256_load_pd(p)
#define VLOADU(p) _mm256_loadu_pd(p)
#define VSTORE(p, v) _mm256_store_pd((p), (v))
#define VSTOREU(p, v) _mm256_storeu_pd((p), (v))
#define VBCAST(p) _mm256_broadcast_sd(p)
#define VFMA(a, b, c) _mm256_fmadd_pd((a), (b), (c))
#define SFMA(a, b, c) __builtin_fma((a), (b), (c))
#define VFNMA(a, b, c) _mm256_fnmadd_pd((a), (b), (c))
#define VMUL(a, b) _mm256_mul_pd((a), (b))
#define VADD(a, b) _mm256_add_pd((a), (b))
#define VSUB(a, b) _mm256_sub_pd((a), (b))
#define VDIV(a, b) _mm256_div_pd((a), (b))
#define VMAX(a, b) _mm256_max_pd((a), (b))
#define VMIN(a, b) _mm256_min_pd((a), (b))
#define VHMAX(v) flash_hmax4_pd(v)
#define VHSUM(v) flash_hsum4_pd(v)
#define VSELBOOL(v, p) flash_selbool4_pd((v), (p))
#define VPOW2(t) _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_castpd_si256(t), 52))
#define FLASH_POLY_EXP 1
#define TB 4
#define TPACK(dst, ldd, src, lds, cols) flash_tpack4_pd((dst), (ldd), (src), (lds), (cols))
#include "flash_impl.h"

#pragma GCC pop_options

#else
/* Not x86: nothing to compile; ISO C forbids an empty translation unit. */
typedef int mha_flash_avx2_unused;
#endif
