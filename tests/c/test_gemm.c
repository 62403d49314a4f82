/*
 * test_gemm.c - tests and micro-benchmark of the packed GEMM, the thread
 * pool and the ISA dispatch (csrc/core/gemm.c, threads.c, dispatch.c).
 *
 * Build and run (see the Makefile beside this file):
 *   make -C tests/c check      # optimised build + ASan/UBSan build, both run
 *   make -C tests/c bench      # GFLOP/s against a measured FMA peak
 * The kernels come from the core's table (csrc/kernels/isa_*.c), so the
 * Makefile links the whole core but the glue.
 *
 *   ./test_gemm            correctness (exit status 1 on any failure)
 *   ./test_gemm bench [reps]   timings (median of reps, default 7)
 *   ./test_gemm env        prints the ISA and thread count in force, to
 *                          check MHATTN_ISA / MHATTN_NUM_THREADS
 *   ./test_gemm run M N K reps
 *                          reps float32 GEMMs (M, K) @ (K, N) with B's
 *                          panels prepacked, as the layer's projections
 *                          run, and nothing else to speak of: for counts
 *                          that noise does not move, per GEMM, from two
 *                          reps, e.g. (valgrind --tool=callgrind, the
 *                          difference of reps 6 and 2, divided by 4)
 *   ./test_gemm time M N K reps [plain] [cold]
 *                          the same float32 GEMM over four B's in turn (four
 *                          weights), reps rounds: min and median us per
 *                          GEMM; `plain` passes B as is (packed by the
 *                          call, as without pack_weights), `cold` writes 64
 *                          MiB before each round (B from DRAM, not L3)
 *
 * What is checked, for every ISA this machine runs (scalar, avx2, avx512)
 * and thread counts 1, 2, 3, 8:
 *   - C against a naive triple loop summed in long double, within
 *     1e-5 * sqrt(K) (float32) / 1e-12 (float64) of sum_k |a b| + |init|;
 *   - bitwise equality of C across thread counts;
 *   - all four transA / transB, bias or not, accumulate or not, padded
 *     leading dimensions, C's padding and the inputs left untouched;
 *   - sizes 0, 1, primes, non-multiples of MR / NR / KC / NC, both paths
 *     (small loop and packed), and random shapes;
 *   - bad arguments return MHA_ERR_ARG / MHA_ERR_SIZE;
 *   - the pool: every task exactly once, ith < nth, nesting, two OS threads
 *     calling at once, resizing during calls, and fork().
 */
#ifndef _WIN32
#define _GNU_SOURCE /* fork, waitpid: the one POSIX-only check, not on Windows */
#endif

/* The fork check is left to the build without AddressSanitizer: GCC's
   libasan takes no lock around fork(), so a child forked while another
   thread held its quarantine's lock spins forever on its first free()
   (seen twice in test_gemm_san on a loaded machine; google/sanitizers#774,
   fixed in LLVM 18's runtime by llvm-project#75290). CPython skips its fork
   tests under ASan for the same reason. The plain build runs it. */
#if defined(__SANITIZE_ADDRESS__)
#define TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TEST_ASAN 1
#endif
#endif

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifndef _WIN32
#include <sys/wait.h>
#include <unistd.h>
#endif

#include "dispatch.h"
#include "gemm.h"
#include "mha.h"
#include "threads.h"

#include "harness.h"

static const int k_threads[] = {1, 2, 3, 8};
#define N_THREADS ((int)(sizeof k_threads / sizeof k_threads[0]))

/* ------------------------------------------------------------------ */
/* GEMM correctness, one template for float and double                 */
/* ------------------------------------------------------------------ */

/* The mha_dtype of a real type (float or double). */
#define DTYPE(real) (sizeof(real) == sizeof(double) ? MHA_DTYPE_F64 : MHA_DTYPE_F32)

#define DEFINE_GEMM_TEST(real, sfx, TOL)                                      \
    static void test_case_##sfx(size_t M, size_t N, size_t K, int tA, int tB, \
                                int use_bias, int acc, size_t pad)            \
    {                                                                         \
        /* op(A) (M, K) stored (M, K) or (K, M) with row stride lda, etc. */  \
        const size_t a_rows = tA ? K : M, a_cols = tA ? M : K;                \
        const size_t b_rows = tB ? N : K, b_cols = tB ? K : N;                \
        const size_t lda = a_cols + pad, ldb = b_cols + pad, ldc = N + pad;   \
        const size_t na = a_rows * lda + 1, nb = b_rows * ldb + 1;            \
        const size_t nc = M * ldc + 1;                                        \
        real *A = malloc(na * sizeof(real)), *B = malloc(nb * sizeof(real));  \
        real *A0 = malloc(na * sizeof(real)), *B0 = malloc(nb * sizeof(real));\
        real *C0 = malloc(nc * sizeof(real));                                 \
        real *C1 = malloc(nc * sizeof(real)), *Ct = malloc(nc * sizeof(real));\
        real *bias = malloc((N + 1) * sizeof(real));                          \
        long double *ref = malloc((M * N + 1) * sizeof(long double));         \
        double *scale = malloc((M * N + 1) * sizeof(double));                 \
        real *small = malloc((M * N + 1) * sizeof(real));                     \
        if (!A || !B || !A0 || !B0 || !C0 || !C1 || !Ct || !bias || !ref ||   \
            !scale || !small) {                                               \
            fprintf(stderr, "out of memory in test\n");                       \
            exit(2);                                                          \
        }                                                                     \
        for (size_t i = 0; i < na; i++) A[i] = A0[i] = (real)rng_unit();     \
        for (size_t i = 0; i < nb; i++) B[i] = B0[i] = (real)rng_unit();     \
        for (size_t i = 0; i < nc; i++) C0[i] = (real)rng_unit();            \
        for (size_t j = 0; j <= N; j++) bias[j] = (real)rng_unit();          \
        const real *bias_p = use_bias ? bias : NULL;                          \
        for (size_t i = 0; i < M; i++)                                        \
            for (size_t j = 0; j < N; j++) {                                  \
                long double s = 0, sa = 0;                                    \
                for (size_t k = 0; k < K; k++) {                              \
                    const real a = tA ? A[k * lda + i] : A[i * lda + k];      \
                    const real b = tB ? B[j * ldb + k] : B[k * ldb + j];      \
                    s += (long double)a * b;                                  \
                    sa += fabsl((long double)a * b);                          \
                }                                                             \
                long double init = acc ? C0[i * ldc + j] : 0;                 \
                if (bias_p) init += bias_p[j];                                \
                ref[i * N + j] = init + s;                                    \
                /* the plain loop's own arithmetic (gemm.h): 0 + a b + ...   \
                   in k order, unfused, then init + that, in `real` */        \
                real sr = 0;                                                  \
                for (size_t k = 0; k < K; k++)                                \
                    sr += (tA ? A[k * lda + i] : A[i * lda + k]) *            \
                          (tB ? B[j * ldb + k] : B[k * ldb + j]);             \
                const real c0 = C0[i * ldc + j];                              \
                small[i * N + j] = bias_p ? (acc ? c0 + bias_p[j] : bias_p[j]) + sr\
                                   : acc ? c0 + sr : sr;                      \
                scale[i * N + j] = (double)(sa + fabsl(init));                \
            }                                                                 \
        const double tol = TOL;                                               \
        for (int t = 0; t < N_THREADS; t++) {                                 \
            mha_set_num_threads(k_threads[t]);                                \
            real *C = t == 0 ? C1 : Ct;                                       \
            memcpy(C, C0, nc * sizeof(real));                                 \
            mha_status st = mha_gemm_##sfx(C, ldc, A, lda, tA, B, ldb, \
                                                  tB, bias_p, M, N, K, acc);  \
            CHECK(st == MHA_OK, "status %s", mha_status_name(st));            \
            int bad = 0, diff = 0, pad_bad = 0, small_bad = 0;                \
            const int plain = M * N * K < MHA_GEMM_SMALL;                     \
            double worst = 0;                                                 \
            for (size_t i = 0; i < M; i++)                                    \
                for (size_t j = 0; j < ldc; j++) {                            \
                    const real c = C[i * ldc + j];                            \
                    if (j >= N) {                                             \
                        pad_bad += memcmp(&c, &C0[i * ldc + j], sizeof c) != 0;\
                        continue;                                             \
                    }                                                         \
                    const double err =                                        \
                        fabs((double)((long double)c - ref[i * N + j]));      \
                    const double lim = tol * (scale[i * N + j] + 1e-30);      \
                    if (!(err <= lim)) bad++;                                 \
                    if (err / (scale[i * N + j] + 1e-30) > worst)             \
                        worst = err / (scale[i * N + j] + 1e-30);             \
                    if (t > 0)                                                \
                        diff += memcmp(&c, &C1[i * ldc + j], sizeof c) != 0;  \
                    if (plain)                                                \
                        small_bad += memcmp(&c, &small[i * N + j], sizeof c) != 0;\
                }                                                             \
            pad_bad += memcmp(&C[M * ldc], &C0[M * ldc], sizeof(real)) != 0;  \
            CHECK(bad == 0,                                                   \
                  #sfx " %s M=%zu N=%zu K=%zu tA=%d tB=%d bias=%d acc=%d "    \
                  "pad=%zu nth=%d: %d elements off, worst rel %.3g",          \
                  mha_isa_name(mha_get_isa()), M, N, K, tA, tB, use_bias,     \
                  acc, pad, k_threads[t], bad, worst);                        \
            CHECK(small_bad == 0,                                             \
                  #sfx " M=%zu N=%zu K=%zu tA=%d tB=%d bias=%d acc=%d: %d "   \
                  "elements not the plain loop's bits", M, N, K, tA, tB,      \
                  use_bias, acc, small_bad);                                  \
            CHECK(diff == 0,                                                  \
                  #sfx " %s M=%zu N=%zu K=%zu tA=%d tB=%d: %d elements differ"\
                  " between 1 and %d threads",                                \
                  mha_isa_name(mha_get_isa()), M, N, K, tA, tB, diff,         \
                  k_threads[t]);                                              \
            CHECK(pad_bad == 0, #sfx " M=%zu N=%zu K=%zu: padding written",   \
                  M, N, K);                                                   \
        }                                                                     \
        CHECK(memcmp(A, A0, na * sizeof(real)) == 0 &&                        \
                  memcmp(B, B0, nb * sizeof(real)) == 0,                      \
              #sfx " inputs mutated");                                        \
        mha_set_num_threads(0);                                               \
        free(A); free(B); free(A0); free(B0); free(C0); free(C1); free(Ct);   \
        free(bias); free(ref); free(scale); free(small);                      \
    }

/* float32: the SIMD kernels fuse, the loops do not; errors grow like
   sqrt(K) for random signs, and the bound is relative to sum |a b|. */
DEFINE_GEMM_TEST(float, f32, 1e-5 * sqrt((double)(K > 0 ? K : 1)))
DEFINE_GEMM_TEST(double, f64, 1e-12)

static void test_shape_all_options(size_t M, size_t N, size_t K)
{
    for (int tA = 0; tA < 2; tA++)
        for (int tB = 0; tB < 2; tB++)
            for (int opt = 0; opt < 4; opt++) {
                const size_t pad = (opt == 3) ? 3 : 0;
                test_case_f32(M, N, K, tA, tB, opt & 1, (opt >> 1) & 1, pad);
                test_case_f64(M, N, K, tA, tB, opt & 1, (opt >> 1) & 1, pad);
            }
}

static void test_gemm_shapes(int quick)
{
    /* fixed awkward shapes: zeros, ones, primes, tile and block edges;
       f32 NC is 3072 and f64 NC is 2048, KC is 256 */
    static const size_t shapes[][3] = {
        {0, 5, 7},      {5, 0, 7},     {5, 7, 0},     {0, 0, 0},
        {1, 1, 1},      {1, 1, 300},   {7, 13, 17},   {31, 37, 29},
        {6, 16, 256},   {12, 32, 512}, {13, 17, 257}, {97, 89, 101},
        {64, 64, 64},   {1, 4099, 9},  {257, 1, 131}, {6, 8, 1000},
        {3, 500, 70},   {200, 3, 100}, {130, 70, 513}, {145, 33, 255},
        {40, 200, 1},   {300, 7, 40},  {73, 79, 83},  {2, 2, 20000},
    };
    const size_t nshapes = sizeof shapes / sizeof shapes[0];
    for (size_t s = 0; s < nshapes; s++)
        test_shape_all_options(shapes[s][0], shapes[s][1], shapes[s][2]);

    /* wider than one NC block (f32 3072, f64 2048) */
    test_case_f32(20, 3100, 40, 0, 0, 1, 1, 0);
    test_case_f32(19, 3100, 300, 1, 1, 1, 0, 1);
    test_case_f64(25, 2100, 33, 0, 1, 0, 1, 0);
    test_case_f64(8, 4200, 270, 1, 0, 1, 0, 2);

    /* random shapes, biased towards the packed path */
    const int nrand = quick ? 8 : 40;
    for (int r = 0; r < nrand; r++) {
        const size_t M = 1 + rng_below(160), N = 1 + rng_below(160);
        const size_t K = 1 + rng_below(600);
        const int tA = (int)rng_below(2), tB = (int)rng_below(2);
        const int bias = (int)rng_below(2), acc = (int)rng_below(2);
        const size_t pad = rng_below(3);
        test_case_f32(M, N, K, tA, tB, bias, acc, pad);
        test_case_f64(M, N, K, tA, tB, bias, acc, pad);
    }
}

/* Exact cases: small integers make every sum exact, so all ISAs and both
   paths must agree bitwise with the naive loop. Also checks the order
   of init terms cannot lose the sign of a zero in the simplest case. */
static void test_gemm_exact(void)
{
    const size_t M = 37, N = 45, K = 600; /* packed path, 3 K blocks */
    float *A = malloc(M * K * sizeof *A), *B = malloc(K * N * sizeof *B);
    float *C = malloc(M * N * sizeof *C), *bias = malloc(N * sizeof *bias);
    for (size_t i = 0; i < M * K; i++) A[i] = (float)((int)rng_below(7) - 3);
    for (size_t i = 0; i < K * N; i++) B[i] = (float)((int)rng_below(7) - 3);
    for (size_t j = 0; j < N; j++) bias[j] = (float)j;
    for (int isa = 0; isa <= (int)harness_best_isa(); isa++) {
        mha_set_isa((mha_isa)isa);
        for (size_t i = 0; i < M * N; i++) C[i] = 1.0f;
        mha_gemm_f32(C, N, A, K, 0, B, N, 0, bias, M, N, K, 1);
        int bad = 0;
        for (size_t i = 0; i < M; i++)
            for (size_t j = 0; j < N; j++) {
                double s = 1.0 + (double)j;
                for (size_t k = 0; k < K; k++)
                    s += (double)A[i * K + k] * B[k * N + j];
                bad += C[i * N + j] != (float)s;
            }
        CHECK(bad == 0, "exact integer GEMM, isa %s: %d wrong",
              mha_isa_name((mha_isa)isa), bad);
    }
    mha_set_isa(MHA_ISA_AVX512);
    free(A); free(B); free(C); free(bias);
}

/* Layout never changes the bits: transA / transB only change how operands
   are packed, and where tile edges fall only changes which tiles go
   through the leftovers buffer. So: C(A, B) == C(A^T stored, B^T stored)
   bitwise, and the first 128 columns of a 129-wide product equal the
   128-wide product bitwise. */
#define DEFINE_LAYOUT_TEST(real, sfx)                                         \
    static void test_layout_##sfx(void)                                       \
    {                                                                         \
        const size_t M = 53, K = 300, N = 129;                                \
        real *A = malloc(M * K * sizeof *A), *At = malloc(K * M * sizeof *A); \
        real *B = malloc(K * N * sizeof *B), *Bt = malloc(N * K * sizeof *B); \
        real *C1 = malloc(M * N * sizeof *C1), *C2 = malloc(M * N * sizeof *C1);\
        for (size_t i = 0; i < M; i++)                                        \
            for (size_t k = 0; k < K; k++)                                    \
                A[i * K + k] = At[k * M + i] = (real)rng_unit();              \
        for (size_t k = 0; k < K; k++)                                        \
            for (size_t j = 0; j < N; j++)                                    \
                B[k * N + j] = Bt[j * K + k] = (real)rng_unit();              \
        for (int isa = 0; isa <= (int)harness_best_isa(); isa++) {            \
            mha_set_isa((mha_isa)isa);                                        \
            mha_gemm_##sfx(C1, N, A, K, 0, B, N, 0, NULL, M, N, K, 0); \
            mha_gemm_##sfx(C2, N, At, M, 1, Bt, K, 1, NULL, M, N, K, 0);\
            CHECK(memcmp(C1, C2, M * N * sizeof *C1) == 0,                    \
                  #sfx " %s: transposed storage changed the bits",            \
                  mha_isa_name((mha_isa)isa));                                \
            mha_gemm_##sfx(C2, N, A, K, 0, B, N, 0, NULL, M, N - 1, K, \
                                  0);                                         \
            int diff = 0;                                                     \
            for (size_t i = 0; i < M; i++)                                    \
                diff += memcmp(C1 + i * N, C2 + i * N,                        \
                               (N - 1) * sizeof *C1) != 0;                    \
            CHECK(diff == 0, #sfx " %s: N=128 vs N=129 differ in %d rows",    \
                  mha_isa_name((mha_isa)isa), diff);                          \
        }                                                                     \
        mha_set_isa(MHA_ISA_AVX512);                                          \
        free(A); free(At); free(B); free(Bt); free(C1); free(C2);             \
    }
DEFINE_LAYOUT_TEST(float, f32)
DEFINE_LAYOUT_TEST(double, f64)

/* B read in place (few enough rows of A, B not transposed: gemm_in_place)
   and B packed (more rows, or B stored transposed) give the same bits: the
   first rows of a product too tall to read B in place equal the product of
   those rows alone, whichever way each is done (when that is not a small
   problem, whose plain loop may round differently: gemm.h), also where the
   last row panel has so few rows that they are done one by one (gemm_row).
   B holds exactly its K N elements, so a read past its end, as a full
   panel over the edge of its last row would make, is caught by the ASan
   build of these tests. Both types, every ISA, 1 and 2 threads. */
#define DEFINE_IN_PLACE_TEST(real, sfx)                                       \
    static void test_in_place_##sfx(void)                                     \
    {                                                                         \
        static const size_t shapes[][3] = {                                   \
            /* M_tall, N, K: tall enough to pack, and N with an edge */       \
            {700, 129, 300}, {600, 64, 257}, {900, 40, 70}, {350, 37, 513},   \
            {600, 130, 520},                                                  \
            /* power-of-two strides: where an L2 under 1 MiB reads in place \
               only the first rows (gemm_in_place) */                       \
            {300, 512, 300}, {300, 1024, 260},                                \
        };                                                                    \
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {       \
            const size_t M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];\
            const size_t ldb = N;                                             \
            real *A = malloc(M * K * sizeof *A), *B = malloc(K * ldb * sizeof *B);\
            real *C1 = malloc(M * N * sizeof *C1), *C2 = malloc(M * N * sizeof *C1);\
            for (size_t i = 0; i < M * K; i++) A[i] = (real)rng_unit();       \
            for (size_t k = 0; k < K; k++)                                    \
                for (size_t j = 0; j < ldb; j++)                              \
                    B[k * ldb + j] = (real)rng_unit();                        \
            for (int isa = 0; isa <= (int)harness_best_isa(); isa++)          \
                for (int nth = 1; nth <= 2; nth++) {                          \
                    mha_set_isa((mha_isa)isa);                                \
                    mha_set_num_threads(nth);                                 \
                    mha_gemm_##sfx(C1, N, A, K, 0, B, ldb, 0, NULL, M, N, K, 0);\
                    /* 1, 2, 7, 145: a last row panel done row by row; 6-7,  \
                       12-13, 85-86: either side of a small L2's in-place     \
                       limits (double at 4 KiB strides, float at 4 KiB, float \
                       at N = 512) */                                         \
                    static const size_t ms[] = {1, 2, 6, 7, 12, 13, 85, 86,   \
                                                144, 145, 288};               \
                    for (size_t r = 0; r < sizeof ms / sizeof ms[0]; r++) {   \
                        const size_t m = ms[r];                               \
                        if (m * N * K < MHA_GEMM_SMALL) /* the plain loop */  \
                            continue;                                         \
                        mha_gemm_##sfx(C2, N, A, K, 0, B, ldb, 0, NULL, m, N, K, 0);\
                        int diff = 0;                                         \
                        for (size_t i = 0; i < m * N; i++)                    \
                            diff += memcmp(&C1[i], &C2[i], sizeof *C1) != 0;  \
                        CHECK(diff == 0,                                      \
                              #sfx " %s nth=%d M=%zu of %zu N=%zu K=%zu: %d " \
                              "elements differ from the taller product",      \
                              mha_isa_name((mha_isa)isa), nth, m, M, N, K,    \
                              diff);                                          \
                    }                                                         \
                }                                                             \
            mha_set_isa(harness_best_isa());                                  \
            mha_set_num_threads(0);                                           \
            free(A); free(B); free(C1); free(C2);                             \
        }                                                                     \
    }
DEFINE_IN_PLACE_TEST(float, f32)
DEFINE_IN_PLACE_TEST(double, f64)

/* GEMMs sharing A (mha_gemm_packed_multi, the Q, K and V projections)
   give each segment the bits of its own mha_gemm_packed, whichever way B
   is read: prepacked panels, in place, packed panel by panel by the task
   that reads it (gemm_own_panels), packed by blocks (then one call each),
   or a mix; with a bias or without; across row counts either side of
   those rules' limits and of a row panel done row by row; segments of
   different widths, with edges. Every ISA, 1 to 3 threads, split however
   small the problem; `quick` (the sanitizer build) takes fewer row counts. */
#define DEFINE_MULTI_TEST(real, sfx)                                          \
    static void test_multi_##sfx(int quick)                                   \
    {                                                                         \
        const size_t K = 300, Ns[][3] = {{512, 512, 512}, {129, 40, 200}};    \
        static const size_t ms_all[] = {7, 8, 13, 86, 128, 145, 288, 290, 700},\
                            ms_quick[] = {8, 128, 290};                       \
        const size_t *ms = quick ? ms_quick : ms_all;                         \
        const size_t nms = quick ? 3 : sizeof ms_all / sizeof ms_all[0];      \
        const size_t Mmax = 700;                                              \
        const size_t old = mha_gemm_set_grain(1);                             \
        real *A = malloc(Mmax * K * sizeof *A);                               \
        for (size_t i = 0; i < Mmax * K; i++) A[i] = (real)rng_unit();        \
        for (size_t v = 0; v < 2; v++) {                                      \
            const size_t *N = Ns[v];                                          \
            real *B[3], *bias[3], *C1[3], *C2[3];                             \
            for (int s = 0; s < 3; s++) {                                     \
                B[s] = malloc(K * N[s] * sizeof *B[s]);                       \
                bias[s] = malloc(N[s] * sizeof *bias[s]);                     \
                C1[s] = malloc(Mmax * N[s] * sizeof *C1[s]);                  \
                C2[s] = malloc(Mmax * N[s] * sizeof *C2[s]);                  \
                for (size_t i = 0; i < K * N[s]; i++) B[s][i] = (real)rng_unit();\
                for (size_t j = 0; j < N[s]; j++) bias[s][j] = (real)rng_unit();\
            }                                                                 \
            for (int isa = 0; isa <= (int)harness_best_isa(); isa++) {        \
                mha_set_isa((mha_isa)isa);                                    \
                mha_packed pk[3];                                             \
                for (int s = 0; s < 3; s++)                                   \
                    CHECK(mha_pack_weight(&pk[s], B[s], N[s], K, N[s], DTYPE(real)) ==  \
                              MHA_OK, #sfx " pack");                          \
                /* which segments have panels: none, all, the middle one */   \
                for (int form = 0; form < 3; form++) {                        \
                    const mha_packed *pb[3];                                  \
                    for (int s = 0; s < 3; s++)                               \
                        pb[s] = form == 1 || (form == 2 && s == 1) ? &pk[s] : NULL;\
                    const real *bs[3] = {bias[0], v ? NULL : bias[1], bias[2]};\
                    for (size_t r = 0; r < nms; r++)                          \
                        for (int nth = 1; nth <= 3; nth += quick ? 2 : 1) {   \
                            const size_t M = ms[r];                           \
                            mha_set_num_threads(nth);                         \
                            for (int s = 0; s < 3; s++)                       \
                                mha_gemm_packed_##sfx(C1[s], N[s], A, K, 0, B[s], N[s], 0,\
                                                      pb[s], bs[s], M, N[s], K, 0);\
                            CHECK(mha_gemm_packed_multi_##sfx(                \
                                      3, C2, A, K, (const real *const *)B, pb,\
                                      bs, M, N, K) == MHA_OK, #sfx " multi"); \
                            int diff = 0;                                     \
                            for (int s = 0; s < 3; s++)                       \
                                diff += memcmp(C1[s], C2[s], M * N[s] * sizeof *C1[s]) != 0;\
                            CHECK(diff == 0,                                  \
                                  #sfx " %s form %d nth=%d M=%zu N=%zu,%zu,%zu: "\
                                  "%d segments differ from their own GEMM",   \
                                  mha_isa_name((mha_isa)isa), form, nth, M,   \
                                  N[0], N[1], N[2], diff);                    \
                        }                                                     \
                }                                                             \
                for (int s = 0; s < 3; s++)                                   \
                    mha_packed_free(&pk[s]);                                  \
            }                                                                 \
            for (int s = 0; s < 3; s++) {                                     \
                free(B[s]); free(bias[s]); free(C1[s]); free(C2[s]);          \
            }                                                                 \
        }                                                                     \
        mha_set_isa(harness_best_isa());                                      \
        mha_set_num_threads(0);                                               \
        mha_gemm_set_grain(old);                                              \
        free(A);                                                              \
    }
DEFINE_MULTI_TEST(float, f32)
DEFINE_MULTI_TEST(double, f64)

/* The last rows of a product whose last row panel is partial (M = 128 is
   21 panels of 6 and one of 2) have the bits those rows have in a taller
   product, where every panel is full: the first M rows of C (Mt rows)
   equal C (M rows) bitwise. The partial panel may be done differently
   (fewer rows per tile) but each element must still be summed over K in
   order from zero, then added to C. Every way B is read: prepacked panels,
   B stored transposed (packed by the GEMM), and B as is (read in place or
   packed, as the row count decides); with a bias (an add into C) and
   without; an N with an edge panel; K of two K blocks. Every ISA, 1 to 3
   threads; `quick` (the sanitizer build) takes two row counts and 3
   threads. */
#define DEFINE_TAIL_TEST(real, sfx)                                           \
    static void test_tail_##sfx(int quick)                                    \
    {                                                                         \
        const size_t Mt = 300, K = 300, Ns[] = {512, 129};                    \
        static const size_t ms_all[] = {3, 7, 8, 9, 10, 11, 13, 14, 15, 16,   \
                                        62, 64, 65, 124, 125, 127, 128, 129,  \
                                        130, 131, 134, 284, 286},             \
                            ms_quick[] = {9, 128};                            \
        const size_t *ms = quick ? ms_quick : ms_all;                         \
        const size_t nms = quick ? 2 : sizeof ms_all / sizeof ms_all[0];      \
        const size_t old = mha_gemm_set_grain(1);                             \
        real *A = malloc(Mt * K * sizeof *A), *bias = malloc(512 * sizeof *bias);\
        real *B = malloc(K * 512 * sizeof *B), *Bt = malloc(512 * K * sizeof *B);\
        real *C1 = malloc(Mt * 512 * sizeof *C1), *C2 = malloc(Mt * 512 * sizeof *C2);\
        for (size_t i = 0; i < Mt * K; i++) A[i] = (real)rng_unit();         \
        for (size_t j = 0; j < 512; j++) bias[j] = (real)rng_unit();          \
        for (int v = 0; v < 2; v++) {                                         \
            const size_t N = Ns[v];                                           \
            for (size_t k = 0; k < K; k++)                                    \
                for (size_t j = 0; j < N; j++)                                \
                    B[k * N + j] = Bt[j * K + k] = (real)rng_unit();          \
            for (int isa = 0; isa <= (int)harness_best_isa(); isa++) {        \
                mha_set_isa((mha_isa)isa);                                    \
                mha_packed pk;                                                \
                CHECK(mha_pack_weight(&pk, B, N, K, N, DTYPE(real)) == MHA_OK,    \
                      #sfx " pack");                                          \
                /* form 0: prepacked panels; 1: B transposed; 2: B as is */   \
                for (int form = 0; form < 3; form++)                          \
                    for (int nth = quick ? 3 : 1; nth <= 3; nth++) {          \
                        mha_set_num_threads(nth);                             \
                        const real *bb = form == 1 ? Bt : B;                  \
                        const size_t ldb = form == 1 ? K : N;                 \
                        const real *bs = v ? NULL : bias;                     \
                        const mha_packed *pb = form == 0 ? &pk : NULL;        \
                        mha_gemm_packed_##sfx(C1, N, A, K, 0, bb, ldb, form == 1, pb,\
                                              bs, Mt, N, K, 0);               \
                        for (size_t r = 0; r < nms; r++) {                    \
                            const size_t M = ms[r];                           \
                            for (size_t i = 0; i < M * N; i++)                \
                                C2[i] = (real)-7;                             \
                            mha_gemm_packed_##sfx(C2, N, A, K, 0, bb, ldb, form == 1,\
                                                  pb, bs, M, N, K, 0);        \
                            int diff = 0;                                     \
                            for (size_t i = 0; i < M * N; i++)                \
                                diff += memcmp(&C1[i], &C2[i], sizeof *C1) != 0;\
                            CHECK(diff == 0,                                  \
                                  #sfx " %s form %d nth=%d M=%zu of %zu N=%zu: "\
                                  "%d elements differ from the taller product",\
                                  mha_isa_name((mha_isa)isa), form, nth, M, Mt,\
                                  N, diff);                                   \
                        }                                                     \
                    }                                                         \
                mha_packed_free(&pk);                                         \
            }                                                                 \
        }                                                                     \
        mha_set_isa(harness_best_isa());                                      \
        mha_set_num_threads(0);                                               \
        mha_gemm_set_grain(old);                                              \
        free(A); free(bias); free(B); free(Bt); free(C1); free(C2);           \
    }
DEFINE_TAIL_TEST(float, f32)
DEFINE_TAIL_TEST(double, f64)

static void test_gemm_errors(void)
{
    float a[4] = {0}, b[4] = {0}, c[4] = {0};
    CHECK(mha_gemm_f32(NULL, 2, a, 2, 0, b, 2, 0, NULL, 2, 2, 2, 0) ==
              MHA_ERR_ARG, "C NULL");
    CHECK(mha_gemm_f32(c, 2, NULL, 2, 0, b, 2, 0, NULL, 2, 2, 2, 0) ==
              MHA_ERR_ARG, "A NULL");
    CHECK(mha_gemm_f32(c, 2, a, 2, 0, NULL, 2, 0, NULL, 2, 2, 2, 0) ==
              MHA_ERR_ARG, "B NULL");
    CHECK(mha_gemm_f32(c, 1, a, 2, 0, b, 2, 0, NULL, 2, 2, 2, 0) ==
              MHA_ERR_ARG, "ldc < N");
    CHECK(mha_gemm_f32(c, 2, a, 1, 0, b, 2, 0, NULL, 2, 2, 2, 0) ==
              MHA_ERR_ARG, "lda < K");
    CHECK(mha_gemm_f32(c, 2, a, 1, 1, b, 2, 0, NULL, 2, 2, 2, 0) ==
              MHA_ERR_ARG, "lda < M (transA)");
    CHECK(mha_gemm_f32(c, 2, a, 2, 0, b, 1, 1, NULL, 2, 2, 2, 0) ==
              MHA_ERR_ARG, "ldb < K (transB)");
    /* K == 0 needs neither A nor B */
    CHECK(mha_gemm_f64(NULL, 1, NULL, 0, 0, NULL, 0, 0, NULL, 0, 5, 0,
                              0) == MHA_OK, "empty C");
    double cd[6] = {1, 2, 3, 4, 5, 6}, bd[3] = {10, 20, 30};
    CHECK(mha_gemm_f64(cd, 3, NULL, 0, 0, NULL, 0, 0, bd, 2, 3, 0, 1) ==
              MHA_OK && cd[0] == 11 && cd[5] == 36, "K == 0, accumulate + bias");
    CHECK(mha_gemm_f64(cd, 3, NULL, 0, 0, NULL, 0, 0, NULL, 2, 3, 0,
                              0) == MHA_OK && cd[0] == 0 && cd[5] == 0,
          "K == 0 overwrites with 0");
    /* sizes whose span overflows size_t */
    CHECK(mha_gemm_f32(c, SIZE_MAX / 2, a, 2, 0, b, 2, 0, NULL, 4, 2,
                              2, 0) == MHA_ERR_SIZE, "ldc * M overflows");
    CHECK(mha_gemm_f32(c, 2, a, SIZE_MAX / 3, 0, b, 2, 0, NULL, 2, 2,
                              2, 0) == MHA_ERR_SIZE, "lda * M overflows");
}

/* ------------------------------------------------------------------ */
/* thread pool                                                         */
/* ------------------------------------------------------------------ */

typedef struct {
    atomic_int *hits; /* (ntasks,) */
    int nth;
    atomic_int bad_ith;
    atomic_int nested_ok;
} pf_ctx;

static void inner_task(void *ctxp, size_t t, int ith)
{
    (void)ctxp; (void)t;
    (void)ith;
}

static void pf_task(void *ctxp, size_t t, int ith)
{
    pf_ctx *x = ctxp;
    atomic_fetch_add(&x->hits[t], 1);
    if (ith < 0 || ith >= x->nth)
        atomic_fetch_add(&x->bad_ith, 1);
    if (t % 7 == 0) {
        /* nested call: must run inline, with in-parallel set */
        mha_parallel_for(3, inner_task, NULL);
        if (mha_in_parallel())
            atomic_fetch_add(&x->nested_ok, 1);
    }
}

static void test_parallel_for(void)
{
    for (int nth = 1; nth <= 9; nth += 2) {
        for (size_t ntasks = 0; ntasks < 200; ntasks += 37) {
            pf_ctx x;
            x.hits = calloc(ntasks + 1, sizeof *x.hits);
            x.nth = nth;
            atomic_init(&x.bad_ith, 0);
            atomic_init(&x.nested_ok, 0);
            CHECK(mha_parallel_for_n(ntasks, nth, pf_task, &x) == MHA_OK,
                  "parallel_for status");
            int wrong = 0;
            for (size_t t = 0; t < ntasks; t++)
                wrong += atomic_load(&x.hits[t]) != 1;
            CHECK(wrong == 0, "nth=%d ntasks=%zu: %d tasks not run once", nth,
                  ntasks, wrong);
            CHECK(atomic_load(&x.bad_ith) == 0, "ith out of range");
            CHECK((size_t)atomic_load(&x.nested_ok) == (ntasks + 6) / 7,
                  "nested calls");
            free(x.hits);
        }
    }
    CHECK(mha_parallel_for(5, NULL, NULL) == MHA_ERR_ARG, "NULL fn");
    CHECK(mha_in_parallel() == 0, "in_parallel outside");
    mha_set_num_threads(5);
    CHECK(mha_get_num_threads() == 5, "set_num_threads");
    mha_set_num_threads(0);
    CHECK(mha_get_num_threads() >= 1, "default threads");
}

/* Several OS threads run GEMMs at once (and one resizes the pool): every
   result must still equal the one-thread result bitwise. */
typedef struct {
    const float *A, *B;
    const float *expect;
    size_t M, N, K;
    int rounds;
    int resize;
    int bad;
} conc_ctx;

static void conc_main(void *p)
{
    conc_ctx *x = p;
    float *C = malloc(x->M * x->N * sizeof *C);
    for (int r = 0; r < x->rounds; r++) {
        if (x->resize)
            mha_set_num_threads(1 + r % 4);
        mha_gemm_f32(C, x->N, x->A, x->K, 0, x->B, x->N, 0, NULL, x->M,
                            x->N, x->K, 0);
        if (memcmp(C, x->expect, x->M * x->N * sizeof *C) != 0)
            x->bad++;
    }
    free(C);
}

static void test_concurrency_and_fork(void)
{
    const size_t M = 150, N = 130, K = 300;
    float *A = malloc(M * K * sizeof *A), *B = malloc(K * N * sizeof *B);
    float *E = malloc(M * N * sizeof *E);
    for (size_t i = 0; i < M * K; i++) A[i] = (float)rng_unit();
    for (size_t i = 0; i < K * N; i++) B[i] = (float)rng_unit();
    mha_set_num_threads(1);
    mha_gemm_f32(E, N, A, K, 0, B, N, 0, NULL, M, N, K, 0);
    mha_set_num_threads(2);

    enum { NT = 4 };
    conc_ctx cx[NT];
    void *args[NT];
    for (int t = 0; t < NT; t++) {
        cx[t] = (conc_ctx){A, B, E, M, N, K, 30, t == NT - 1, 0};
        args[t] = &cx[t];
    }
    run_threads(NT, conc_main, args);
    for (int t = 0; t < NT; t++)
        CHECK(cx[t].bad == 0, "concurrent caller %d: %d results differ", t,
              cx[t].bad);

    /* fork with a live pool: the child must rebuild it and get the same
       result; the parent must carry on. (Windows has no fork.) */
    mha_set_num_threads(2);
    float *C = malloc(M * N * sizeof *C);
    mha_gemm_f32(C, N, A, K, 0, B, N, 0, NULL, M, N, K, 0);
#if !defined(_WIN32) && !defined(TEST_ASAN)
    fflush(NULL);
    const pid_t pid = fork();
    if (pid == 0) {
        int ok = 1;
        for (int r = 0; r < 3; r++) {
            memset(C, 0, M * N * sizeof *C);
            mha_gemm_f32(C, N, A, K, 0, B, N, 0, NULL, M, N, K, 0);
            ok &= memcmp(C, E, M * N * sizeof *C) == 0;
        }
        _exit(ok ? 0 : 1);
    }
    CHECK(pid > 0, "fork failed");
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "child after fork: status %d", status);
#endif
    memset(C, 0, M * N * sizeof *C);
    mha_gemm_f32(C, N, A, K, 0, B, N, 0, NULL, M, N, K, 0);
    CHECK(memcmp(C, E, M * N * sizeof *C) == 0, "parent after fork");
    mha_set_num_threads(0);
    free(A); free(B); free(E); free(C);
}

static void test_dispatch(void)
{
    const mha_isa detected = mha_isa_detect();
#if MHA_EMULATE_AVX512 && (defined(__x86_64__) || defined(__i386__))
    /* dispatch.c offers the emulated AVX-512 wherever AVX2 runs */
    const mha_isa det = detected >= MHA_ISA_AVX2 ? MHA_ISA_AVX512 : detected;
#else
    const mha_isa det = detected;
#endif
    CHECK(strcmp(mha_isa_name(MHA_ISA_SCALAR), "scalar") == 0 &&
              strcmp(mha_isa_name(MHA_ISA_AVX2), "avx2") == 0 &&
              strcmp(mha_isa_name(MHA_ISA_AVX512), "avx512") == 0,
          "isa names");
    CHECK(mha_set_isa(MHA_ISA_AVX512) == (int)det, "cap at detected");
    CHECK(mha_get_isa() == det, "get after set");
    CHECK(mha_set_isa(MHA_ISA_SCALAR) == MHA_ISA_SCALAR, "force scalar");
    CHECK(mha_get_isa() == MHA_ISA_SCALAR, "scalar in force");
    mha_set_isa(MHA_ISA_AVX512);
}

/* ------------------------------------------------------------------ */
/* benchmark                                                           */
/* ------------------------------------------------------------------ */

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
/* 12 independent FMA chains: enough to cover 2 pipes x 4-cycle latency. */
__attribute__((target("avx2,fma"))) static double fma_loop_f32(long iters)
{
    __m256 acc[12];
    const __m256 m = _mm256_set1_ps(0.999999f), a = _mm256_set1_ps(1e-6f);
    for (int r = 0; r < 12; r++)
        acc[r] = _mm256_set1_ps((float)r);
    for (long i = 0; i < iters; i++)
#pragma GCC unroll 12
        for (int r = 0; r < 12; r++)
            acc[r] = _mm256_fmadd_ps(acc[r], m, a);
    __m256 s = acc[0];
    for (int r = 1; r < 12; r++)
        s = _mm256_add_ps(s, acc[r]);
    float out[8];
    _mm256_storeu_ps(out, s);
    return out[0];
}
/* The same on zmm registers: the peak of the avx512 path. (On Zen 5 a
   512-bit FMA issues as fast as a 256-bit one, so it is twice the above.) */
__attribute__((target("avx512f"))) static double fma_loop_f32_avx512(long iters)
{
    __m512 acc[12];
    const __m512 m = _mm512_set1_ps(0.999999f), a = _mm512_set1_ps(1e-6f);
    for (int r = 0; r < 12; r++)
        acc[r] = _mm512_set1_ps((float)r);
    for (long i = 0; i < iters; i++)
#pragma GCC unroll 12
        for (int r = 0; r < 12; r++)
            acc[r] = _mm512_fmadd_ps(acc[r], m, a);
    __m512 s = acc[0];
    for (int r = 1; r < 12; r++)
        s = _mm512_add_ps(s, acc[r]);
    return (double)_mm512_reduce_add_ps(s);
}
#define HAVE_PEAK 1
#endif

typedef struct { long iters; double gflops; double sink; } peak_arg;

/* The burst uses the vectors of the ISA in force, so "ratio" is against
   the peak of the kernels being timed. */
static void peak_main(void *p)
{
    peak_arg *x = p;
    double lanes = 8;
    const double t0 = now_s();
#ifdef HAVE_PEAK
    if (mha_get_isa() == MHA_ISA_AVX512) {
        x->sink = fma_loop_f32_avx512(x->iters);
        lanes = 16;
    } else {
        x->sink = fma_loop_f32(x->iters);
    }
#endif
    x->gflops = (double)x->iters * 12 * lanes * 2 / (now_s() - t0) * 1e-9;
}

/* f32 FMA throughput of nth threads together, GFLOP/s, over ~10 ms. */
static double peak_burst(int nth)
{
    peak_arg args[2];
    void *argp[2] = {NULL, NULL};
    double sum = 0;
    for (int t = 0; t < nth; t++) {
        args[t].iters = 4000000;
        argp[t] = &args[t];
    }
    run_threads(nth, peak_main, argp);
    for (int t = 0; t < nth; t++)
        sum += args[t].gflops;
    return sum;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof v[0], cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* The box is shared and noisy, so every timed GEMM is paired with an FMA
   burst right before it on the same number of threads; the ratio of the
   two is steadier than either. Reported: medians of GFLOP/s, of the peak
   and of the per-pair ratio (f64 peak = f32 peak / 2), and the best GEMM
   and best peak, whose ratio says what an idle machine would give. */
#define DEFINE_BENCH(real, sfx, PEAKDIV)                                      \
    static void bench_##sfx(size_t M, size_t N, size_t K, int tA, int tB,     \
                            int nth, int reps, double out[5])                 \
    {                                                                         \
        real *A = mha_aligned_alloc(64, (M * K * sizeof(real) + 63) / 64 * 64);   \
        real *B = mha_aligned_alloc(64, (K * N * sizeof(real) + 63) / 64 * 64);   \
        real *C = mha_aligned_alloc(64, (M * N * sizeof(real) + 63) / 64 * 64);   \
        for (size_t i = 0; i < M * K; i++) A[i] = (real)rng_unit();          \
        for (size_t i = 0; i < K * N; i++) B[i] = (real)rng_unit();          \
        double g[64], pk[64], ratio[64];                                      \
        mha_gemm_##sfx(C, N, A, tA ? M : K, tA, B, tB ? K : N, tB,     \
                              NULL, M, N, K, 0); /* warm-up */                \
        for (int r = 0; r < reps; r++) {                                      \
            pk[r] = peak_burst(nth) / (PEAKDIV);                              \
            const double t0 = now_s();                                        \
            mha_gemm_##sfx(C, N, A, tA ? M : K, tA, B, tB ? K : N, tB, \
                                  NULL, M, N, K, 0);                          \
            g[r] = 2.0 * (double)M * (double)N * (double)K /                  \
                   (now_s() - t0) * 1e-9;                                     \
            ratio[r] = g[r] / pk[r];                                          \
        }                                                                     \
        out[0] = median(g, reps);                                             \
        out[1] = median(pk, reps);                                            \
        out[2] = median(ratio, reps);                                         \
        out[3] = g[reps - 1];  /* sorted by median(): the best run */         \
        out[4] = pk[reps - 1];                                                \
        mha_aligned_free(A); mha_aligned_free(B); mha_aligned_free(C);        \
    }
DEFINE_BENCH(float, f32, 1.0)
DEFINE_BENCH(double, f64, 2.0)

static void bench(int reps)
{
    if (reps < 1) reps = 1;
    if (reps > 64) reps = 64;
    printf("isa %s (detected %s), %d CPUs by default; median of %d runs,\n"
           "each paired with an f32 FMA-throughput burst on as many threads "
           "(12 chains of vfmadd on the ISA's vectors; f64 peak = half)\n",
           mha_isa_name(mha_get_isa()), mha_isa_name(mha_isa_detect()),
           mha_get_num_threads(), reps);
    static const size_t shapes[][5] = {
        /* M, N, K, transA, transB */
        {1024, 1024, 1024, 0, 0}, {2048, 512, 512, 0, 0},
        {512, 2048, 512, 0, 0},   {1024, 1024, 1024, 0, 1},
        {1024, 1024, 1024, 1, 0}, {256, 256, 64, 0, 1},
        {4096, 64, 512, 0, 0},
        /* the projections of d_model 512 at T = 128, 1024, 4096 */
        {128, 512, 512, 0, 0},    {128, 1024, 1024, 0, 0},
        {1024, 512, 512, 0, 0},
        {4096, 512, 512, 0, 0},
    };
    printf("%-22s %-3s %-4s | %8s %8s %7s | %8s %8s %7s\n",
           "M x N x K (tA,tB)", "nth", "type", "GFLOP/s", "peak", "ratio",
           "best", "bestpk", "ratio");
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int nth = 1; nth <= 2; nth++) {
            mha_set_num_threads(nth);
            const size_t *sh = shapes[s];
            char name[64];
            snprintf(name, sizeof name, "%zux%zux%zu (%zu,%zu)", sh[0], sh[1],
                     sh[2], sh[3], sh[4]);
            double r32[5], r64[5];
            bench_f32(sh[0], sh[1], sh[2], (int)sh[3], (int)sh[4], nth, reps,
                      r32);
            bench_f64(sh[0], sh[1], sh[2], (int)sh[3], (int)sh[4], nth, reps,
                      r64);
            printf("%-22s %-3d %-4s | %8.1f %8.1f %6.1f%% | %8.1f %8.1f "
                   "%6.1f%%\n", name, nth, "f32", r32[0], r32[1], 100 * r32[2],
                   r32[3], r32[4], 100 * r32[3] / r32[4]);
            printf("%-22s %-3d %-4s | %8.1f %8.1f %6.1f%% | %8.1f %8.1f "
                   "%6.1f%%\n", name, nth, "f64", r64[0], r64[1], 100 * r64[2],
                   r64[3], r64[4], 100 * r64[3] / r64[4]);
            fflush(stdout);
        }
    mha_set_num_threads(0);
}

/* `run`: see the top of this file. */
static int run_gemms(size_t M, size_t N, size_t K, int reps)
{
    float *A = malloc(M * K * sizeof *A), *B = malloc(K * N * sizeof *B);
    float *C = malloc(M * N * sizeof *C);
    mha_packed pk;
    if (A == NULL || B == NULL || C == NULL || M == 0 || N == 0 || K == 0) {
        fprintf(stderr, "run: bad sizes or out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < M * K; i++) A[i] = (float)rng_unit();
    for (size_t i = 0; i < K * N; i++) B[i] = (float)rng_unit();
    if (mha_pack_weight(&pk, B, N, K, N, MHA_DTYPE_F32) != MHA_OK)
        return 1;
    for (int r = 0; r < reps; r++)
        mha_gemm_packed_f32(C, N, A, K, 0, B, N, 0, &pk, NULL, M, N, K, 0);
    printf("%s %d: %d GEMMs %zux%zux%zu, C[last] %g\n", mha_isa_name(mha_get_isa()),
           mha_get_num_threads(), reps, M, N, K, (double)C[M * N - 1]);
    mha_packed_free(&pk);
    free(A); free(B); free(C);
    return 0;
}

/* `time`: see the top of this file. */
static int time_gemms(size_t M, size_t N, size_t K, int reps, int plain, int cold)
{
    enum { NB = 4 };
    const size_t flush_bytes = (size_t)64 << 20;
    float *A = malloc(M * K * sizeof *A), *C = malloc(M * N * sizeof *C), *B[NB];
    unsigned char *flush = cold ? calloc(flush_bytes, 1) : NULL;
    double *t = malloc((reps > 0 ? (size_t)reps : 1) * sizeof *t);
    mha_packed pk[NB];
    int ok = A != NULL && C != NULL && t != NULL && (flush != NULL || !cold) && reps > 0 &&
             M > 0 && N > 0 && K > 0;
    for (int b = 0; b < NB; b++) {
        B[b] = ok ? malloc(K * N * sizeof *B[b]) : NULL;
        ok = ok && B[b] != NULL;
        for (size_t i = 0; ok && i < K * N; i++) B[b][i] = (float)rng_unit();
        ok = ok && mha_pack_weight(&pk[b], B[b], N, K, N, MHA_DTYPE_F32) == MHA_OK;
    }
    if (!ok) {
        fprintf(stderr, "time: bad sizes or out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < M * K; i++) A[i] = (float)rng_unit();
    for (int r = 0; r < reps; r++) {
        for (size_t i = 0; cold && i < flush_bytes; i += 64)
            flush[i] = (unsigned char)(flush[i] + 1);
        const double t0 = now_s();
        for (int b = 0; b < NB; b++)
            mha_gemm_packed_f32(C, N, A, K, 0, B[b], N, 0, plain ? NULL : &pk[b], NULL, M, N,
                                K, 0);
        t[r] = (now_s() - t0) / NB;
    }
    qsort(t, (size_t)reps, sizeof t[0], cmp_double);
    printf("%s %d thread(s): %zux%zux%zu float32, B %s, caches %s: min %.1f us, median "
           "%.1f us per GEMM (%d rounds of %d)\n", mha_isa_name(mha_get_isa()),
           mha_get_num_threads(), M, N, K, plain ? "as is" : "prepacked",
           cold ? "evicted" : "warm", 1e6 * t[0], 1e6 * median(t, reps), reps, NB);
    for (int b = 0; b < NB; b++) {
        mha_packed_free(&pk[b]);
        free(B[b]);
    }
    free(A); free(C); free(t); free(flush);
    return 0;
}

static int has_arg(int argc, char **argv, int from, const char *word)
{
    for (int i = from; i < argc; i++)
        if (strcmp(argv[i], word) == 0)
            return 1;
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 5 && strcmp(argv[1], "time") == 0)
        return time_gemms((size_t)atol(argv[2]), (size_t)atol(argv[3]), (size_t)atol(argv[4]),
                          atoi(argv[5]), has_arg(argc, argv, 6, "plain"),
                          has_arg(argc, argv, 6, "cold"));
    if (argc > 5 && strcmp(argv[1], "run") == 0)
        return run_gemms((size_t)atol(argv[2]), (size_t)atol(argv[3]), (size_t)atol(argv[4]),
                         atoi(argv[5]));
    if (argc > 1 && strcmp(argv[1], "bench") == 0) {
        bench(argc > 2 ? atoi(argv[2]) : 7);
        return 0;
    }
    if (argc > 1 && strcmp(argv[1], "env") == 0) {
        /* what the environment chose: "<isa> <threads>" (see Makefile) */
        printf("%s %d\n", mha_isa_name(mha_get_isa()), mha_get_num_threads());
        return 0;
    }
    const int quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    const double t0 = now_s();
    /* split even small problems over every thread, or the thread-count
       checks below would compare one thread with itself */
    mha_gemm_set_grain(1);
    test_dispatch();
    test_parallel_for();
    test_gemm_errors();
    test_gemm_exact();
    test_layout_f32();
    test_in_place_f32();
    test_in_place_f64();
    test_multi_f32(quick);
    test_multi_f64(quick);
    test_tail_f32(quick);
    test_tail_f64(quick);
    test_layout_f64();
    const mha_isa det = harness_best_isa();
    for (int isa = 0; isa <= (int)det; isa++) {
        /* NEON: aarch64's ladder is scalar < neon, without the x86 ISAs */
        if (det == MHA_ISA_NEON && isa != MHA_ISA_SCALAR && isa != MHA_ISA_NEON)
            continue;
        CHECK(mha_set_isa((mha_isa)isa) == isa, "set isa %d", isa);
        printf("isa %s ...\n", mha_isa_name((mha_isa)isa));
        fflush(stdout);
        test_gemm_shapes(quick);
    }
    mha_set_isa(MHA_ISA_AVX512);
    test_concurrency_and_fork();
    printf("%ld checks, %d failures (%.1f s)\n", g_checks, g_failures,
           now_s() - t0);
    return g_failures != 0;
}
