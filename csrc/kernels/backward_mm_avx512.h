/*
 * backward_mm_avx512.h - template of the backward's tile product for
 * AVX-512F; included by backward_avx512.c (inside its target pragma) with
 * REAL, SFX, VEC, MASK, VLEN, VZERO, VLOADU, VMLOADU (masked, zeroing),
 * VSTOREU, VMSTOREU (masked), VBCAST and VFMA defined, once per element
 * type. No include guard on purpose.
 *
 * Same contract as the portable mm of backward_impl.h:
 *   C (M, N) [+]= A (M, K) @ B (K, N),  A(m, k) = A[m * sam + k * sak],
 * B and C row-major with row strides ldb and ldc. Each element is reduced
 * in increasing k by fused multiply-adds on every path (full block, masked
 * columns, leftover rows), so its value depends on the sizes only -- and is
 * the one backward_mm_avx2.h computes.
 *
 * Main body: 8 rows x 2 vectors of C in 16 zmm accumulators; per k, two
 * loads of B, eight broadcasts of A (folded into the FMAs' memory operand)
 * and sixteen FMAs, which keeps both 512-bit FMA pipes busy without
 * running out of the 32 registers. Columns past the last whole pair of
 * vectors are done by the same code with masked loads and stores (a head
 * width of 40 floats is one full and one half vector, never a scalar
 * loop); rows past the last group of eight, one at a time.
 */
#if !defined(REAL) || !defined(SFX) || !defined(VEC) || !defined(VLEN) || \
    !defined(MASK)
#error "backward_mm_avx512.h needs REAL, SFX, VEC, MASK, VLEN and the vector macros"
#endif

/* The lanes of a vector that hold columns n .. n + r - 1 (all when r >=
   VLEN, none when r == 0). */
static inline MASK MHA_CAT(MHA_CAT(mm_lanes, SFX), avx512)(size_t r)
{
    return r >= VLEN ? (MASK)~(MASK)0 : (MASK)(((unsigned)1 << r) - 1u);
}

static void MHA_CAT(MHA_CAT(mm, SFX), avx512)(REAL *C, size_t ldc,
                                              const REAL *A, size_t sam,
                                              size_t sak, const REAL *B,
                                              size_t ldb, size_t M, size_t N,
                                              size_t K, int add)
{
    const VEC zero = VZERO();
    for (size_t n = 0; n < N; n += 2 * VLEN) {
        // Columns n .. n + 2 VLEN - 1, the last pair possibly partial.
        const size_t r = N - n;
        const MASK k0 = MHA_CAT(MHA_CAT(mm_lanes, SFX), avx512)(r);
        const MASK k1 = MHA_CAT(MHA_CAT(mm_lanes, SFX), avx512)(
            r > VLEN ? r - VLEN : 0);
        const int full = r >= 2 * VLEN;
        size_t m = 0;
        for (; m + 8 <= M; m += 8) {
            const REAL *a0 = A + m * sam;
            REAL *c0 = C + m * ldc + n;
            VEC x00 = zero, x01 = zero, x10 = zero, x11 = zero;
            VEC x20 = zero, x21 = zero, x30 = zero, x31 = zero;
            VEC x40 = zero, x41 = zero, x50 = zero, x51 = zero;
            VEC x60 = zero, x61 = zero, x70 = zero, x71 = zero;
#define MM_LOAD_ROW(i)                                                        \
    do {                                                                      \
        x##i##0 = VMLOADU(k0, c0 + (i) * ldc);                                \
        x##i##1 = VMLOADU(k1, c0 + (i) * ldc + VLEN);                         \
    } while (0)
            if (add) {
                MM_LOAD_ROW(0);
                MM_LOAD_ROW(1);
                MM_LOAD_ROW(2);
                MM_LOAD_ROW(3);
                MM_LOAD_ROW(4);
                MM_LOAD_ROW(5);
                MM_LOAD_ROW(6);
                MM_LOAD_ROW(7);
            }
#undef MM_LOAD_ROW
            const REAL *b_p = B + n;
#define MM_FMA_ROW(i)                                                         \
    do {                                                                      \
        const VEC a = VBCAST(a0 + (i) * sam + pa);                            \
        x##i##0 = VFMA(a, b0, x##i##0);                                       \
        x##i##1 = VFMA(a, b1, x##i##1);                                       \
    } while (0)
            if (full) {
                for (size_t p = 0, pa = 0; p < K; p++, pa += sak, b_p += ldb) {
                    const VEC b0 = VLOADU(b_p), b1 = VLOADU(b_p + VLEN);
                    MM_FMA_ROW(0);
                    MM_FMA_ROW(1);
                    MM_FMA_ROW(2);
                    MM_FMA_ROW(3);
                    MM_FMA_ROW(4);
                    MM_FMA_ROW(5);
                    MM_FMA_ROW(6);
                    MM_FMA_ROW(7);
                }
            } else {
                for (size_t p = 0, pa = 0; p < K; p++, pa += sak, b_p += ldb) {
                    const VEC b0 = VMLOADU(k0, b_p);
                    const VEC b1 = VMLOADU(k1, b_p + VLEN);
                    MM_FMA_ROW(0);
                    MM_FMA_ROW(1);
                    MM_FMA_ROW(2);
                    MM_FMA_ROW(3);
                    MM_FMA_ROW(4);
                    MM_FMA_ROW(5);
                    MM_FMA_ROW(6);
                    MM_FMA_ROW(7);
                }
            }
#undef MM_FMA_ROW
#define MM_STORE_ROW(i)                                                       \
    do {                                                                      \
        VMSTOREU(c0 + (i) * ldc, k0, x##i##0);                                \
        VMSTOREU(c0 + (i) * ldc + VLEN, k1, x##i##1);                         \
    } while (0)
            MM_STORE_ROW(0);
            MM_STORE_ROW(1);
            MM_STORE_ROW(2);
            MM_STORE_ROW(3);
            MM_STORE_ROW(4);
            MM_STORE_ROW(5);
            MM_STORE_ROW(6);
            MM_STORE_ROW(7);
#undef MM_STORE_ROW
        }
        // Leftover rows, one at a time, same order.
        for (; m < M; m++) {
            const REAL *a_m = A + m * sam;
            REAL *c_m = C + m * ldc + n;
            VEC x0 = add ? VMLOADU(k0, c_m) : zero;
            VEC x1 = add ? VMLOADU(k1, c_m + VLEN) : zero;
            const REAL *b_p = B + n;
            for (size_t p = 0, pa = 0; p < K; p++, pa += sak, b_p += ldb) {
                const VEC a = VBCAST(a_m + pa);
                x0 = VFMA(a, VMLOADU(k0, b_p), x0);
                x1 = VFMA(a, VMLOADU(k1, b_p + VLEN), x1);
            }
            VMSTOREU(c_m, k0, x0);
            VMSTOREU(c_m + VLEN, k1, x1);
        }
    }
}
