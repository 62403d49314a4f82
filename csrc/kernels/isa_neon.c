/*
 * isa_neon.c - the kernels on AArch64 Advanced SIMD (simd_neon.h), float32
 * and float64.
 *
 * ISA flags: none. NEON is part of the AArch64 base ISA, so this unit
 * compiles with the extension's own flags and mha_isa_detect() returns
 * MHA_ISA_NEON on every aarch64 CPU; off aarch64 it is an empty unit.
 *
 * Blocking, for the 32 q registers (4 floats or 2 doubles each). Nothing
 * here has been timed on ARM hardware: the sizes follow the register count
 * and the x86 units' cache reasoning, not a measurement.
 *   flash    6-row x 4-vector register blocks: 24 accumulators + 4 loaded
 *            vectors of K^T (or V) + 1 broadcast = 29 registers; NR = 16
 *            floats or 8 doubles, so 64-key blocks are whole NR columns;
 *            192 query rows per tile, as on x86.
 *   gemm     6-row x 4-vector tiles (24 accumulators, the same 29
 *            registers): per k, 4 loads of B, 6 broadcasts of A, 24 FMAs.
 *            B panel KC x NR (16 KiB) in L1, A block MC x KC (144 KiB)
 *            in L2, B block KC x NC (3-4 MiB) in L3 or memory.
 *   bwd      the tile product keeps 8 rows x 3 vectors of C in 24
 *            accumulators (3 loads of B, 8 broadcasts, 24 FMAs per k); 8
 *            rows divide the 64-row and 64-key tiles, so no row goes alone.
 * PICK(float, double) where the types differ (core/dtype.h).
 */
#include "kernels.h"

#ifdef MHA_HAVE_NEON_KERNELS

#include "simd_neon.h"

#define KERNELS_NAME PICK(mha_kernels_neon_f32, mha_kernels_neon_f64)
#define KERNELS_LABEL PICK("neon_f32", "neon_f64")
#define FLASH_MR 6
#define FLASH_NV 4
#define FLASH_BQ 192
#define FLASH_BK 64
#define FLASH_PREFETCH 1
/* The decode kernels' GQA groups: 4 heads x 4 sums of the 32 registers. */
#define FLASH_HG 4
#define GEMM_MR 6
#define GEMM_NV 4
#define GEMM_KC 256
#define GEMM_MC PICK(144, 72)
#define GEMM_NC PICK(3072, 2048)
#define BWD_MR 8
#define BWD_NV 3

#include "kernels.inc"

#else
/* Not aarch64: nothing to compile; ISO C forbids an empty translation unit. */
typedef int mha_isa_neon_unused;
#endif
