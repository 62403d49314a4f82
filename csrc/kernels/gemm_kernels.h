/*
 * gemm_kernels.h - micro-kernels of the packed GEMM, internal to csrc/.
 *
 * A micro-kernel multiplies one packed A sliver by one packed B sliver:
 *
 *   c (MR, NR), row stride ldc  =  [c +] a^T b
 *   a: (kc, MR) packed: a[p*MR + r] = op(A)(i0 + r, k0 + p)
 *   b: (kc, NR) packed: b[p*NR + j] = op(B)(k0 + p, j0 + j)
 *
 * Each element is summed over p = 0, 1, ..., kc-1 in that order into an
 * accumulator that starts at zero, and only then added to c (add != 0) or
 * stored over it (add == 0). Slivers are 64-byte aligned.
 *
 * Variants: _ref (portable C, always compiled), _avx2 (AVX2 + FMA),
 * _avx512 (AVX-512F). The SIMD ones come from one template,
 * gemm_ukr_impl.h, compiled per ISA in gemm_kernel_<isa>.c.
 */
#ifndef MHA_GEMM_KERNELS_H
#define MHA_GEMM_KERNELS_H

#include <stddef.h>

#if defined(__x86_64__) || defined(__i386__)
#define MHA_HAVE_X86_KERNELS 1
#endif

/* Register tiles (MR rows x NR columns of C). */
#define MHA_REF_MR 4
#define MHA_REF_NR 4
#define MHA_AVX2_MR 6
#define MHA_AVX2_NR_F32 16 /* 2 ymm of 8  */
#define MHA_AVX2_NR_F64 8  /* 2 ymm of 4  */
#define MHA_AVX512_MR 6
#define MHA_AVX512_NR_F32 32 /* 2 zmm of 16 */
#define MHA_AVX512_NR_F64 16 /* 2 zmm of 8  */

#define MHA_DECLARE_UKR(real, name)                                           \
    void name(size_t kc, const real *a, const real *b, real *c, size_t ldc,   \
              int add);

/*
 * Transposing copy used to pack (row-walk slivers of A, column slivers of
 * B stored transposed):
 *
 *   dst[p*ldd + r] = src[r*lds + p]   for r < rows, p < kc
 *
 * rows <= 8 (float) or <= 4 (double). `next` points at the rows the caller
 * will copy next (same lds), to be prefetched; it may equal src.
 */
#define MHA_DECLARE_TPACK(real, name)                                         \
    void name(real *dst, size_t ldd, const real *src, size_t lds,             \
              size_t rows, size_t kc, const real *next);

#ifdef MHA_HAVE_X86_KERNELS
MHA_DECLARE_TPACK(float, mha_gemm_tpack_avx2_f32)
MHA_DECLARE_TPACK(double, mha_gemm_tpack_avx2_f64)
MHA_DECLARE_UKR(float, mha_gemm_ukr_avx2_f32)
MHA_DECLARE_UKR(double, mha_gemm_ukr_avx2_f64)
MHA_DECLARE_UKR(float, mha_gemm_ukr_avx512_f32)
MHA_DECLARE_UKR(double, mha_gemm_ukr_avx512_f64)
#endif

#endif /* MHA_GEMM_KERNELS_H */
