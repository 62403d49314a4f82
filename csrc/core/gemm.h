/*
 * gemm.h - the core's matrix multiply, internal to csrc/.
 *
 *   C (M, N) = op(A) (M, K) @ op(B) (K, N) [+ bias (N,) broadcast over rows]
 *
 * op(A) is A (M, K) with row stride lda when transA == 0, and the transpose
 * of A stored as (K, M) with row stride lda when transA != 0; likewise B.
 * accumulate == 0 overwrites C; accumulate != 0 adds into it.
 * All matrices are row-major with unit column stride.
 *
 * Each element of C is reduced over K in one fixed order by one thread, so
 * the result does not depend on the thread count.
 */
#ifndef MHA_GEMM_H
#define MHA_GEMM_H

#include "mha.h"

#define MHA_DECLARE_GEMM(real, sfx)                                           \
    mha_status mha_gemm_##sfx(real *C, size_t ldc,                            \
                              const real *A, size_t lda, int transA,          \
                              const real *B, size_t ldb, int transB,          \
                              const real *bias,                               \
                              size_t M, size_t N, size_t K, int accumulate);

MHA_DECLARE_GEMM(float, f32)
MHA_DECLARE_GEMM(double, f64)

#endif /* MHA_GEMM_H */
