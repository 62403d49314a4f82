/*
 * gemm.h - the core's matrix multiply, internal to csrc/: every GEMM of the
 * forward and the backward goes through mha_gemm_f32 / mha_gemm_f64.
 *
 * Same contract and signature as mha_gemm_* in gemm.h:
 *
 *   C (M, N) = [C +] op(A) (M, K) @ op(B) (K, N) [+ bias (N,)]
 *
 * computed BLIS-style: C is cut into (MC x NC) blocks, K into KC blocks;
 * A slivers are packed into aligned scratch and fed to register-tiled
 * micro-kernels of the ISA in force (kernels/gemm_ukr.inc, through the
 * table of kernels.h), with B's slivers packed too, prepacked, or (few
 * rows of A, B not transposed) read in place. Threads split the
 * (row block, column block) tiles of C and never K, so each element's sum
 * has one fixed order whatever the thread count:
 *
 *   C[i][j] = ((init + s_0) + s_1) + ... + s_{nk-1}
 *   init    = (accumulate ? C[i][j] : 0) + bias[j]    (terms that are absent
 *             are skipped, not added as zero)
 *   s_b     = sum over k in K block b, in increasing k, from zero
 *
 * K blocks depend only on K and the ISA, so the result is bitwise identical
 * for any thread count with one ISA (ISAs may differ in rounding: the SIMD
 * kernels fuse multiply-adds). Problems with M*N*K < MHA_GEMM_SMALL use a
 * plain loop instead (no packing, no threads); that choice depends on the
 * sizes only.
 *
 * Returns MHA_OK, MHA_ERR_ARG (NULL buffer or leading dimension too small
 * for a non-empty matrix), MHA_ERR_SIZE (an index or scratch size overflows
 * size_t) or MHA_ERR_NOMEM (scratch). K == 0 gives C = init.
 */
#ifndef MHA_GEMM_H
#define MHA_GEMM_H

#include <stddef.h>
#include <stdint.h>

#include "mha.h"
#include "sizes.h"

#define MHA_GEMM_SMALL 32768u
/* Multiply-adds per thread below which fewer threads are used (this only
   changes speed, never results). */
#define MHA_GEMM_GRAIN 4194304u

/* Sets the multiply-adds per thread below which fewer threads are used
   (0 restores MHA_GEMM_GRAIN). For tests, which set 1 so that even small
   problems are split, and for tuning. Returns the previous value. */
size_t mha_gemm_set_grain(size_t grain);

mha_status mha_gemm_f32(float *C, size_t ldc, const float *A, size_t lda,
                        int transA, const float *B, size_t ldb, int transB,
                        const float *bias, size_t M, size_t N, size_t K,
                        int accumulate);
mha_status mha_gemm_f64(double *C, size_t ldc, const double *A, size_t lda,
                        int transA, const double *B, size_t ldb, int transB,
                        const double *bias, size_t M, size_t N, size_t K,
                        int accumulate);

/* The same with B's panels prepacked by mha_pack_weight (mha.h): pb, when
   it was packed from this (K, N) B for the ISA in force and this type,
   replaces packing B (pb NULL, or any other, is ignored: B is packed as
   usual). The bits are the same either way: the panels are. B itself is
   still read by the small-problem loop. */
mha_status mha_gemm_packed_f32(float *C, size_t ldc, const float *A, size_t lda,
                               int transA, const float *B, size_t ldb, int transB,
                               const mha_packed *pb, const float *bias, size_t M,
                               size_t N, size_t K, int accumulate);
mha_status mha_gemm_packed_f64(double *C, size_t ldc, const double *A, size_t lda,
                               int transA, const double *B, size_t ldb, int transB,
                               const mha_packed *pb, const double *bias, size_t M,
                               size_t N, size_t K, int accumulate);

/* Whether mha_gemm_packed multiplies panels of B (its own or a prepacked
   pb's) for an (M, N, K) problem: every problem but the small ones, which
   the plain loop computes from B itself (and the empty ones, which read
   no B). What a caller that hands the GEMM only panels must know. */
static inline int mha_gemm_reads_panels(size_t M, size_t N, size_t K)
{
    size_t mn, mnk;
    if (!mha_mul_ok(&mn, M, N) || !mha_mul_ok(&mnk, mn, K))
        return 1;
    return mnk >= MHA_GEMM_SMALL;
}

/* mha_pack_weight (mha.h) of n <= MHA_PACK_MAX weights of one half type
   (MHA_DTYPE_F16 or _BF16) at once, in one pool phase: p[i] from w[i]
   (K[i], N[i]), row stride ldw[i], the float32 panels that packing the
   widened weight gives, widened as they are packed (no float32 copy of a
   weight is made). On failure every p[i] is freed. */
#define MHA_PACK_MAX 5
mha_status mha_pack_half(mha_packed *p, const uint16_t *const *w, const size_t *ldw,
                         const size_t *K, const size_t *N, int n, mha_dtype dtype);

/* nseg <= MHA_GEMM_MAX_SEG GEMMs sharing A (M, K), row stride lda: C[s]
   (M, N[s]), contiguous, = A @ B[s] (K, N[s]) + bias[s] (or NULL), each
   bitwise what mha_gemm_packed gives it, in one pool phase when every
   B[s] has usable panels pb[s], is read in place, or is packed panel by
   panel by the tasks (A of few rows; else one call each).
   The Q, K and V projections of self-attention. */
#define MHA_GEMM_MAX_SEG 4

/* Whether a call's Q, K and V projections all read one input (x == key ==
   value, with the same rows and width), so that one mha_gemm_packed_multi
   can compute the three, with or without prepacked weights. */
static inline int mha_gemm_one_input(const mha_config *cfg, const void *x, const void *key,
                                     const void *value)
{
    return key == x && value == x && cfg->Tk == cfg->Tq && cfg->Dkin == cfg->Din &&
           cfg->Dvin == cfg->Din;
}
mha_status mha_gemm_packed_multi_f32(int nseg, float *const *C, const float *A, size_t lda,
                                     const float *const *B, const mha_packed *const *pb,
                                     const float *const *bias, size_t M, const size_t *N,
                                     size_t K);
mha_status mha_gemm_packed_multi_f64(int nseg, double *const *C, const double *A,
                                     size_t lda, const double *const *B,
                                     const mha_packed *const *pb,
                                     const double *const *bias, size_t M, const size_t *N,
                                     size_t K);

#endif /* MHA_GEMM_H */
