/*
 * isa_ref.c - the portable kernels: plain C, "vectors" of one lane
 * (simd_ref.h). Always compiled and always tested; what runs under
 * MHATTN_ISA=scalar and on every CPU without a SIMD path.
 */
#include "kernels.h"
#include "simd_ref.h"

/* float32 */
#define MHA_F64 0
#define KERNELS_NAME mha_kernels_ref_f32
#define KERNELS_LABEL "ref_f32"
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
#define BWD_NV 16
#include "kernels.inc"
#undef MHA_F64

/* float64 */
#define MHA_F64 1
#define KERNELS_NAME mha_kernels_ref_f64
#define KERNELS_LABEL "ref_f64"
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
#define BWD_NV 8
#include "kernels.inc"
#undef MHA_F64
