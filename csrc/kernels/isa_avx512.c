/*
 * isa_avx512.c - the kernels on AVX-512F (simd_avx512.h), float32 and
 * float64.
 *
 * ISA flags: this file only, through MHA_TARGET_BEGIN (isa_target.h), which
 * gcc, clang and MSVC all take: no build needs per-file flags. Nothing here
 * runs unless mha_get_isa() == MHA_ISA_AVX512, i.e. cpuid reports AVX-512F
 * and XCR0 shows the OS saves opmask and zmm state.
 *
 * MHA_EMULATE_AVX512 (a test build, setup.py) compiles the same kernels on
 * simd_emu512.h instead, which gives the same bits without AVX-512.
 *
 * Blocking: isa_x86.h, shared with AVX2 (vectors twice as wide), except:
 *   flash    float key blocks are 128 keys, not 64: that halves the per-row
 *            bookkeeping per key (horizontal max and sum, alpha, rescaling
 *            O), which was 5% faster at T = 4096 on 2 threads of a Zen 5;
 *            for double, 128 was 2% slower. Float blocks are not prefetched
 *            in software: on Zen 5 the hardware prefetchers follow their
 *            rows, and the prefetch loops bought nothing (T = 4096, quiet
 *            machine, min of 28 calls: 194 ms without vs 196 ms with on 1
 *            thread, 101.6 ms either way on 2; double and AVX2 were the same
 *            either way).
 *   bwd      the tile product keeps 8 rows x 2 vectors of C in 16 zmm
 *            accumulators: per k, two loads of B, eight broadcasts of A and
 *            sixteen FMAs, which keeps both 512-bit FMA pipes busy without
 *            running out of the 32 registers.
 */
#include "kernels.h"

#ifdef MHA_HAVE_X86_KERNELS

/* System headers first: they stay outside the region (isa_target.h). */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "isa_target.h"

#if MHA_EMULATE_AVX512
/* The test build's stand-in (setup.py MHATTN_EMULATE_AVX512=1): the same
   kernels on simd_emu512.h's plain-C lanes, compiled for AVX2 + FMA so
   that fmaf is one instruction; dispatch.c offers it where AVX2 runs. */
MHA_TARGET_BEGIN("avx2,fma")
#include "simd_emu512.h"
#else
MHA_TARGET_BEGIN("avx512f,avx2,fma")
#include "simd_avx512.h"
#endif

/* Parameters of both types, beyond isa_x86.h's. */
#include "isa_x86.h"
#define KERNELS_NAME PICK(mha_kernels_avx512_f32, mha_kernels_avx512_f64)
#define KERNELS_LABEL PICK("avx512_f32", "avx512_f64")
#define FLASH_BK PICK(128, 64)
#define FLASH_PREFETCH PICK(0, 1)
/* The decode kernels' GQA groups: 4 heads x 4 keys (or 4 column vectors)
   of sums in 16 of the 32 registers (AVX2's 16 take flash.inc's 2), each
   key's row read start to end. Their key blocks are 32 keys: K and V are
   then read 8 KiB at a time each (float, d = 64), not 32, and on a Zen 4
   the prefetchers kept both streams going. One step on (1, 8, 32768, 64)
   float caches, 1 thread, medians of 3 interleaved runs: 11.8 ms before
   this and the in-order rows, 8.3 ms in order with 64-key blocks, 5.5 ms
   with 32; 2 threads: 6.2, 4.7, 4.0 ms; with 4096 keys 0.52 -> 0.37 ms on
   1 thread. GQA, 32 heads over 8 of d = 64 beyond the LLC: 13.5 -> 8.8 ms
   (1 thread); of d = 128 (bench_decode.py's row) and in the LLC: the same
   within the noise. Double: 32768 keys, 1 thread, 29-40 -> 20-24 ms. On
   AVX2 (its own file) the in-order GQA kernel was 8 to 10% slower in the
   LLC on this Zen 4, so it keeps the columns' order and 64-key blocks
   (Zen 3's measure). Outputs of steps over more than 32 keys moved by at
   most 4.3e-7 (float) and 6.1e-16 (double) relative: the online softmax
   rescales at other keys. */
#define FLASH_HG 4
#define FLASH_BK1 32
#define FLASH_ROWS_IN_ORDER 1
#define BWD_MR 8

#include "kernels.inc"

MHA_TARGET_END

#else
/* Not x86: nothing to compile; ISO C forbids an empty translation unit. */
typedef int mha_isa_avx512_unused;
#endif
