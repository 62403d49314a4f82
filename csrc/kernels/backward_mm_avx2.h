/*
 * backward_mm_avx2.h - template of the backward's tile product for AVX2 +
 * FMA; included by backward_avx2.c (inside its target pragma) with REAL,
 * SFX, VEC, VLEN, VLOADU, VSTOREU, VBCAST and VFMA defined, once per
 * element type. No include guard on purpose.
 *
 * Same contract as the portable mm of backward_impl.h:
 *   C (M, N) [+]= A (M, K) @ B (K, N),  A(m, k) = A[m * sam + k * sak],
 * B and C row-major with row strides ldb and ldc. Each element is reduced
 * in increasing k by fused multiply-adds, on every path (vector body,
 * vector tail, scalar tail), so its value depends on the sizes only.
 *
 * Main body: 4 rows x 2 vectors of C in 8 accumulators; per k, two loads
 * of B, four broadcasts of A and eight FMAs.
 */
#if !defined(REAL) || !defined(SFX) || !defined(VEC) || !defined(VLEN)
#error "backward_mm_avx2.h needs REAL, SFX, VEC, VLEN and the vector macros"
#endif

static void MHA_CAT(MHA_CAT(mm, SFX), avx2)(REAL *C, size_t ldc, const REAL *A,
                                            size_t sam, size_t sak,
                                            const REAL *B, size_t ldb,
                                            size_t M, size_t N, size_t K,
                                            int add)
{
    const VEC zero = VZERO();
    size_t m = 0;
    for (; m + 4 <= M; m += 4) {
        const REAL *a0 = A + m * sam, *a1 = a0 + sam, *a2 = a1 + sam;
        const REAL *a3 = a2 + sam;
        REAL *c0 = C + m * ldc, *c1 = c0 + ldc, *c2 = c1 + ldc, *c3 = c2 + ldc;
        size_t n = 0;
        for (; n + 2 * VLEN <= N; n += 2 * VLEN) {
            VEC x00 = zero, x01 = zero, x10 = zero, x11 = zero;
            VEC x20 = zero, x21 = zero, x30 = zero, x31 = zero;
            if (add) {
                x00 = VLOADU(c0 + n);
                x01 = VLOADU(c0 + n + VLEN);
                x10 = VLOADU(c1 + n);
                x11 = VLOADU(c1 + n + VLEN);
                x20 = VLOADU(c2 + n);
                x21 = VLOADU(c2 + n + VLEN);
                x30 = VLOADU(c3 + n);
                x31 = VLOADU(c3 + n + VLEN);
            }
            const REAL *b_p = B + n;
            for (size_t p = 0, pa = 0; p < K; p++, pa += sak, b_p += ldb) {
                const VEC b0 = VLOADU(b_p), b1 = VLOADU(b_p + VLEN);
                VEC a = VBCAST(a0 + pa);
                x00 = VFMA(a, b0, x00);
                x01 = VFMA(a, b1, x01);
                a = VBCAST(a1 + pa);
                x10 = VFMA(a, b0, x10);
                x11 = VFMA(a, b1, x11);
                a = VBCAST(a2 + pa);
                x20 = VFMA(a, b0, x20);
                x21 = VFMA(a, b1, x21);
                a = VBCAST(a3 + pa);
                x30 = VFMA(a, b0, x30);
                x31 = VFMA(a, b1, x31);
            }
            VSTOREU(c0 + n, x00);
            VSTOREU(c0 + n + VLEN, x01);
            VSTOREU(c1 + n, x10);
            VSTOREU(c1 + n + VLEN, x11);
            VSTOREU(c2 + n, x20);
            VSTOREU(c2 + n + VLEN, x21);
            VSTOREU(c3 + n, x30);
            VSTOREU(c3 + n + VLEN, x31);
        }
        for (; n + VLEN <= N; n += VLEN) {
            VEC x0 = zero, x1 = zero, x2 = zero, x3 = zero;
            if (add) {
                x0 = VLOADU(c0 + n);
                x1 = VLOADU(c1 + n);
                x2 = VLOADU(c2 + n);
                x3 = VLOADU(c3 + n);
            }
            const REAL *b_p = B + n;
            for (size_t p = 0, pa = 0; p < K; p++, pa += sak, b_p += ldb) {
                const VEC b0 = VLOADU(b_p);
                x0 = VFMA(VBCAST(a0 + pa), b0, x0);
                x1 = VFMA(VBCAST(a1 + pa), b0, x1);
                x2 = VFMA(VBCAST(a2 + pa), b0, x2);
                x3 = VFMA(VBCAST(a3 + pa), b0, x3);
            }
            VSTOREU(c0 + n, x0);
            VSTOREU(c1 + n, x1);
            VSTOREU(c2 + n, x2);
            VSTOREU(c3 + n, x3);
        }
        for (; n < N; n++) {
            REAL x0 = 0, x1 = 0, x2 = 0, x3 = 0;
            if (add) {
                x0 = c0[n];
                x1 = c1[n];
                x2 = c2[n];
                x3 = c3[n];
            }
            for (size_t p = 0, pa = 0; p < K; p++, pa += sak) {
                const REAL b = B[p * ldb + n];
                x0 = SFMA(a0[pa], b, x0);
                x1 = SFMA(a1[pa], b, x1);
                x2 = SFMA(a2[pa], b, x2);
                x3 = SFMA(a3[pa], b, x3);
            }
            c0[n] = x0;
            c1[n] = x1;
            c2[n] = x2;
            c3[n] = x3;
        }
    }
    for (; m < M; m++) {
        const REAL *a0 = A + m * sam;
        REAL *c0 = C + m * ldc;
        size_t n = 0;
        for (; n + VLEN <= N; n += VLEN) {
            VEC x0 = add ? VLOADU(c0 + n) : zero;
            const REAL *b_p = B + n;
            for (size_t p = 0, pa = 0; p < K; p++, pa += sak, b_p += ldb)
                x0 = VFMA(VBCAST(a0 + pa), VLOADU(b_p), x0);
            VSTOREU(c0 + n, x0);
        }
        for (; n < N; n++) {
            REAL x0 = add ? c0[n] : 0;
            for (size_t p = 0, pa = 0; p < K; p++, pa += sak)
                x0 = SFMA(a0[pa], B[p * ldb + n], x0);
            c0[n] = x0;
        }
    }
}
