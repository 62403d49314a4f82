/*
 * isa_avx2.c - the kernels on AVX2 + FMA (simd_avx2.h), float32 and
 * float64.
 *
 * ISA flags: this file only, through #pragma GCC target, because setuptools
 * applies extra_compile_args to every source. Nothing here runs unless
 * mha_get_isa() >= MHA_ISA_AVX2 (dispatch.c checks cpuid and xgetbv).
 *
 * Blocking:
 *   flash    6 x 16 (float) or 6 x 8 (double) register blocks: 12
 *            accumulators + 2 loaded vectors + 1 broadcast of the 16 ymm
 *            registers; 192 query rows per tile, so that streaming a 64-key
 *            block of K and V from L3 and packing it is paid once per 192
 *            rows (96 measured ~5% slower at T = 4096).
 *   gemm     6 x 16 / 6 x 8 tiles; B panel KC x NR (16 KiB) in L1, A block
 *            MC x KC (144 KiB) in L2, B block KC x NC (3-4 MiB) in L3
 *            (Zen 3: 32 KiB L1d, 512 KiB L2 per core).
 *   bwd      the tile product keeps 4 rows x 2 vectors of C in registers.
 */
#include "kernels.h"

#ifdef MHA_HAVE_X86_KERNELS

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include "simd_avx2.h"

/* Parameters of both types; PICK(float, double) where they differ. */
#define KERNELS_NAME PICK(mha_kernels_avx2_f32, mha_kernels_avx2_f64)
#define KERNELS_LABEL PICK("avx2_f32", "avx2_f64")
#define FLASH_MR 6
#define FLASH_NV 2
#define FLASH_BQ 192
#define FLASH_BK 64
#define FLASH_PREFETCH 1
#define GEMM_MR 6
#define GEMM_NV 2
#define GEMM_KC 256
#define GEMM_MC PICK(144, 72)
#define GEMM_NC PICK(3072, 2048)
#define BWD_MR 4
#define BWD_NV 2

#define MHA_F64 0
#include "kernels.inc"
#undef MHA_F64
#define MHA_F64 1
#include "kernels.inc"
#undef MHA_F64

#pragma GCC pop_options

#else
/* Not x86: nothing to compile; ISO C forbids an empty translation unit. */
typedef int mha_isa_avx2_unused;
#endif
