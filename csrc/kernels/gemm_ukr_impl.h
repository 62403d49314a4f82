/*
 * gemm_ukr_impl.h - template of the SIMD GEMM micro-kernels.
 *
 * Included once per (ISA, type) by gemm_kernel_<isa>.c, which defines:
 *   UKR_NAME          function name
 *   REAL              float or double
 *   VEC               vector type; VLEN lanes of REAL
 *   VZERO()           all-zero vector
 *   VLOAD(p)          aligned load of VLEN REALs
 *   VLOADU(p), VSTOREU(p, v)  unaligned load / store
 *   VBCAST(p)         broadcast *p
 *   VFMA(a, b, c)     a * b + c, one rounding
 *   VADD(a, b)        a + b
 *   MR, NV            tile: MR rows x (NV * VLEN) columns
 * The contract is in gemm_kernels.h. The loops over rows and vectors have
 * constant bounds and are fully unrolled, so acc[][] lives in registers
 * (2 * 6 = 12 accumulators + 2 B vectors + 1 broadcast of 16 registers).
 */
#define UKR_NR (NV * VLEN)
void UKR_NAME(size_t kc, const REAL *a, const REAL *b, REAL *c, size_t ldc,
              int add)
{
    /* a: (kc, MR) packed; b: (kc, NR) packed; c: (MR, NR) row stride ldc */

    /* Fetch the C tile now: it is touched only after the K loop, and a
       miss there would stall with nothing left to overlap it. */
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++) {
        __builtin_prefetch(c + (size_t)r * ldc, 1, 3);
        __builtin_prefetch(c + (size_t)r * ldc + UKR_NR - 1, 1, 3);
    }

    VEC acc[MR][NV];
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            acc[r][v] = VZERO();

#pragma GCC unroll 4
    for (size_t p = 0; p < kc; p++) {
        const REAL *a_p = a + p * MR;
        const REAL *b_p = b + p * UKR_NR;
        VEC bv[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            bv[v] = VLOAD(b_p + v * VLEN);
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++) {
            const VEC ar = VBCAST(a_p + r);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++)
                acc[r][v] = VFMA(ar, bv[v], acc[r][v]);
        }
    }

#pragma GCC unroll 16
    for (int r = 0; r < MR; r++) {
        REAL *c_r = c + (size_t)r * ldc;
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) {
            VEC out = acc[r][v];
            if (add)
                out = VADD(VLOADU(c_r + v * VLEN), out);
            VSTOREU(c_r + v * VLEN, out);
        }
    }
}

#undef UKR_NR
