/*
 * gemm_impl.h - template body of mha_gemm_<sfx>; included by gemm.c with
 * `real` (float or double) and `sfx` (f32 or f64) defined. No include guard
 * on purpose.
 *
 * Every element C[i, j] is reduced in one fixed order:
 *   C[i, j] = ((init + a[i,0] b[0,j]) + a[i,1] b[1,j]) + ...
 * where init is bias[j] (or 0) when overwriting, and C[i, j] (+ bias[j])
 * when accumulating. The transB branch follows the same order, so the result
 * does not depend on how B is stored.
 */
#if !defined(real) || !defined(sfx)
#error "gemm_impl.h needs real and sfx defined"
#endif

mha_status MHA_CAT(mha_gemm, sfx)(real *C, size_t ldc,
                                  const real *A, size_t lda, int transA,
                                  const real *B, size_t ldb, int transB,
                                  const real *bias,
                                  size_t M, size_t N, size_t K, int accumulate)
{
    // C: (M, N) row stride ldc
    // A: (M, K) row stride lda, or (K, M) when transA
    // B: (K, N) row stride ldb, or (N, K) when transB
    // bias: (N,) or NULL
    if (M == 0 || N == 0)
        return MHA_OK;
    if (C == NULL || ldc < N)
        return MHA_ERR_ARG;
    if (K > 0) {
        if (A == NULL || B == NULL)
            return MHA_ERR_ARG;
        if (lda < (transA ? M : K) || ldb < (transB ? K : N))
            return MHA_ERR_ARG;
    }

    for (size_t i = 0; i < M; i++) {
        real *c_i = C + i * ldc;

        // 1. initialise the row: bias (or 0), or add the bias into it.
        if (!accumulate) {
            for (size_t j = 0; j < N; j++)
                c_i[j] = bias ? bias[j] : (real)0;
        } else if (bias) {
            for (size_t j = 0; j < N; j++)
                c_i[j] += bias[j];
        }

        // 2. add op(A)[i, :] @ op(B), one k at a time.
        if (!transB) {
            for (size_t p = 0; p < K; p++) {
                const real a_ip = transA ? A[p * lda + i] : A[i * lda + p];
                const real *b_p = B + p * ldb;
                for (size_t j = 0; j < N; j++)
                    c_i[j] += a_ip * b_p[j];
            }
        } else {
            // B is stored (N, K): row j of the storage is column j of op(B),
            // so a dot product per element keeps the reads contiguous.
            for (size_t j = 0; j < N; j++) {
                const real *b_j = B + j * ldb;
                real acc = c_i[j];
                for (size_t p = 0; p < K; p++) {
                    const real a_ip = transA ? A[p * lda + i] : A[i * lda + p];
                    acc += a_ip * b_j[p];
                }
                c_i[j] = acc;
            }
        }
    }
    return MHA_OK;
}
