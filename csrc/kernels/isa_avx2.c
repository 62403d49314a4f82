/*
 * isa_avx2.c - the kernels on AVX2 + FMA (simd_avx2.h), float32 and
 * float64, and the half precision rows on F16C.
 *
 * ISA flags: this file only, through MHA_TARGET_BEGIN (isa_target.h), which
 * gcc, clang and MSVC all take: no build needs per-file flags. Nothing here
 * runs unless mha_get_isa() >= MHA_ISA_AVX2 (dispatch.c checks cpuid and
 * xgetbv).
 *
 * Blocking: isa_x86.h, shared with AVX-512; the backward's tile product
 * keeps 4 rows x 2 vectors of C in registers. Key blocks of 128 floats
 * (64 doubles), as on AVX-512: each row group's softmax has fixed costs
 * (horizontal max and sum, the alpha exp, the loop ramps) that a longer
 * block spreads over twice the keys. On Zen 3, 1 thread, against 64:
 * attention (1, 8, T, 64) 1.3-2.3% faster at T = 128 .. 4096, causal or
 * not (fastest of 6 alternating runs), though K^T and V of a block now
 * fill 64 KiB, twice the L1d. The decode kernels keep blocks of 64 keys
 * (FLASH_BK1): with 128-key blocks and a 128-row prefetch up front, a step
 * on a (1, 8, 4096, 64) cache was 8-20% slower; the prefetch was most of
 * it (flash_tile_init's share of the step doubled), and 128-key decode
 * blocks with a 64-row prefetch were not measured. Tried on a Zen 4 under
 * MHATTN_ISA=avx2 (bench_ab.py decode cases, 32 heads over 8, min of 7
 * rounds, 2 threads) and not kept: 32-key blocks, with or without a
 * prefetch of a GQA group's V block into L2 before its scores. One run
 * read 1.10-1.23x at d = 64 beyond the LLC and d = 128 at 4096 keys; the
 * same builds minutes later read 0.69-1.00x at d = 128 (2048, 4096 and
 * 16384 keys), and the V prefetch took one-head decode to 0.71-0.81x.
 * The GQA decode kernel reads rows in order for a block's first pair of
 * heads and 4 rows at a time for the next (FLASH_ROWS_IN_ORDER 2): the
 * first pass brings the block in from memory, and in order the prefetchers
 * keep up (isa_avx512.c); the second finds it in cache, where 4 rows at a
 * time give 8 independent sums, not 2. Zen 4 under MHATTN_ISA=avx2,
 * bench_ab.py decode cases, 32 heads over 8, min of 5 alternating rounds,
 * 2 threads, against 4 rows at a time throughout (and against in order
 * throughout): 32768 keys 1.23x (1.17x) at d = 128 and 1.15x (1.11x) at
 * d = 64; 4096 keys of 128 1.22x (1.19x); 1024 keys, in cache, 0.96x
 * (0.92x) at d = 128 and 0.98x (0.94x) at d = 64. Two rows at a time in
 * both passes read 0.98x at 32768 keys of 128.
 */
#include "kernels.h"

#ifdef MHA_HAVE_X86_KERNELS

/* System headers first: they stay outside the region (isa_target.h). */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "isa_target.h"

MHA_TARGET_BEGIN("avx2,fma,f16c")
#include "simd_avx2.h"

/* Parameters of both types, beyond isa_x86.h's. */
#include "isa_x86.h"
#define KERNELS_NAME PICK(mha_kernels_avx2_f32, mha_kernels_avx2_f64)
#define KERNELS_LABEL PICK("avx2_f32", "avx2_f64")
#define FLASH_BK PICK(128, 64)
#define FLASH_BK1 64
#define FLASH_PREFETCH 1
#define FLASH_ROWS_IN_ORDER 2
#define BWD_MR 4

#include "kernels.inc"

MHA_TARGET_END

#else
/* Not x86: nothing to compile; ISO C forbids an empty translation unit. */
typedef int mha_isa_avx2_unused;
#endif
