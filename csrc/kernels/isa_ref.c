/*
 * isa_ref.c - the portable kernels: plain C, "vectors" of one lane
 * (simd_ref.h). Always compiled and always tested; what runs under
 * MHATTN_ISA=scalar and on every CPU without a SIMD path.
 */
#include "kernels.h"
#include "simd_ref.h"

/* Parameters of both types; PICK(float, double) where they differ. */
#define KERNELS_NAME PICK(mha_kernels_ref_f32, mha_kernels_ref_f64)
#define KERNELS_LABEL PICK("ref_f32", "ref_f64")
#define FLASH_MR 4
#define FLASH_NV 4
#define FLASH_BQ 96
#define FLASH_BK 64
#define FLASH_PREFETCH 0
#define GEMM_MR 4
#define GEMM_NV 4
#define GEMM_KC 256
#define GEMM_MC 64
#define GEMM_NC 1024
#define BWD_MR 4
#define BWD_NV PICK(16, 8)   /* 64 bytes of C per row, as plain C vectorises it */

#include "kernels.inc"
