/*
 * isa_x86.h - the tuning AVX2 and AVX-512 share, included by isa_avx2.c and
 * isa_avx512.c before what each sets alone. AVX-512's vectors are twice as
 * wide, so every NR below (NV vectors) is twice as wide there by itself.
 *
 *   flash    6-row x 2-vector register blocks: 12 accumulators + 2 loaded
 *            vectors + 1 broadcast of the 16 ymm registers; 192 query rows
 *            per tile, so that streaming a key block of K and V from L3 and
 *            packing it is paid once per 192 rows (96 measured ~5% slower
 *            at T = 4096).
 *   gemm     6-row x 2-vector tiles; B panel KC x NR (16 KiB) in L1, A block
 *            MC x KC (144 KiB) in L2, B block KC x NC (3-4 MiB) in L3
 *            (Zen 3: 32 KiB L1d, 512 KiB L2 per core).
 *   bwd      the tile product keeps BWD_MR rows x 2 vectors of C.
 * PICK(float, double) where the types differ (core/dtype.h).
 */
#ifndef MHA_ISA_X86_H
#define MHA_ISA_X86_H

#define FLASH_MR 6
#define FLASH_NV 2
#define FLASH_BQ 192
#define GEMM_MR 6
#define GEMM_NV 2
#define GEMM_KC 256
#define GEMM_MC PICK(144, 72)
#define GEMM_NC PICK(3072, 2048)
#define BWD_NV 2

#endif /* MHA_ISA_X86_H */
