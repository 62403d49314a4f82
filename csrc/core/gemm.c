/*
 * gemm.c - the core's matrix multiply (contract in gemm.h).
 *
 * Every caller in the core goes through mha_gemm_*; the work is done by the
 * packed, threaded GEMM of gemm_packed.c, whose own scalar micro-kernel is
 * the portable path (MHATTN_ISA=scalar) and whose plain loop handles small
 * problems.
 */
#include "gemm.h"
#include "gemm_packed.h"

mha_status mha_gemm_f32(float *C, size_t ldc, const float *A, size_t lda,
                        int transA, const float *B, size_t ldb, int transB,
                        const float *bias, size_t M, size_t N, size_t K,
                        int accumulate)
{
    return mha_gemm_packed_f32(C, ldc, A, lda, transA, B, ldb, transB, bias,
                               M, N, K, accumulate);
}

mha_status mha_gemm_f64(double *C, size_t ldc, const double *A, size_t lda,
                        int transA, const double *B, size_t ldb, int transB,
                        const double *bias, size_t M, size_t N, size_t K,
                        int accumulate)
{
    return mha_gemm_packed_f64(C, ldc, A, lda, transA, B, ldb, transB, bias,
                               M, N, K, accumulate);
}
