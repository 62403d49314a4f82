/* panels.c: bfloat16 weight panels against float32 ones in the packed
 * GEMM's micro-kernel (issue 36, item 5), for benchmarks/panels.py.
 *
 * pack_weights of bfloat16 weights cuts float32 panels (core/gemm.c,
 * mha_pack_half): widened once, at packing. The alternative keeps the
 * panels in bfloat16, half the bytes, and widens each B vector in the
 * micro-kernel's K loop. Both are timed here through the library's own
 * micro-kernel (csrc/kernels/gemm_ukr.inc, compiled twice: once as it is,
 * once with GEMM_B_T / GEMM_LOAD_B bound to bfloat16 and v_widen_bf16) and
 * a one-thread driver with the library's blocking (isa_x86.h: KC, MC, NR).
 * Widening is exact and the loops are the same, so both products must be
 * equal bit for bit; the program checks that before it times anything.
 *
 * Build (panels.py does): cc -O2 -Icsrc/core -Icsrc/kernels -Icsrc
 *   [-DPANELS_AVX512=1] benchmarks/panels.c -o panels -lm
 * Run: panels M K N WEIGHTS REPS. WEIGHTS distinct (K, N) weights are
 * multiplied in turn, each by the same A (M, K), as a layer's projections
 * are: 4 keeps them in the LLC, many more streams them from memory.
 * Prints one line: "M K N WEIGHTS f32_ms bf16_ms" (medians of REPS passes
 * over all the weights, the two kinds alternating pass by pass).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "isa_target.h"

/* gemm_ukr.inc defines the rest of the GEMM's kernels too; only the
   micro-kernel is timed here. */
#pragma GCC diagnostic ignored "-Wunused-function"

#ifndef PANELS_AVX512
#define PANELS_AVX512 0
#endif

#define MHA_F64 0
#if PANELS_AVX512
MHA_TARGET_BEGIN("avx512f,avx2,fma,f16c")
#include "simd_avx512.h"
#else
MHA_TARGET_BEGIN("avx2,fma,f16c")
#include "simd_avx2.h"
#endif
#include "isa_x86.h"
#include "simd_dtype.h"

/* gemm_ukr.inc as the library compiles it: float32 panels. */
#define gemm_ukr_f32 ukr_f32
#define gemm_ukr4_f32 ukr4_f32
#define gemm_row_body_f32 row_body_f32
#define gemm_row_f32 row_f32
#define gemm_tpack_f32 tpack_f32
#include "gemm_ukr.inc"
#undef gemm_ukr_f32
#undef gemm_ukr4_f32
#undef gemm_row_body_f32
#undef gemm_row_f32
#undef gemm_tpack_f32
#undef GEMM_UKR4

/* The same loop on bfloat16 panels, each B vector widened as loaded. */
#define GEMM_B_T uint16_t
#define GEMM_LOAD_B(p) v_widen_bf16(p)
#define gemm_ukr_f32 ukr_bf16
#define gemm_ukr4_f32 ukr4_bf16
#define gemm_row_body_f32 row_body_bf16
#define gemm_row_f32 row_bf16
#define gemm_tpack_f32 tpack_bf16
#include "gemm_ukr.inc"
MHA_TARGET_END

#define NR (GEMM_NV * VLEN)
#define KC GEMM_KC
#define MC GEMM_MC

typedef void (*ukr_fn)(size_t, const void *, const void *, size_t, void *, size_t, int);

static size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

/* float32 -> bfloat16, to nearest even (no NaN here). */
static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* B (K, N) into panels: block pc of KC rows, panel j of NR columns, each
   (kc, NR) row-major, zero past N; elem bytes 4 (float) or 2 (bfloat16). */
static void *pack_b(const float *b, size_t K, size_t N, int bf16)
{
    size_t np = round_up(N, NR) / NR, elem = bf16 ? 2 : 4;
    char *out = aligned_alloc(64, round_up(round_up(K, KC) * np * NR * elem, 64));
    size_t off = 0;
    for (size_t pc = 0; pc < K; pc += KC) {
        size_t kc = K - pc < KC ? K - pc : KC;
        for (size_t j = 0; j < np; j++)
            for (size_t p = 0; p < kc; p++)
                for (size_t n = 0; n < NR; n++, off++) {
                    size_t col = j * NR + n;
                    float v = col < N ? b[(pc + p) * N + col] : 0.0f;
                    if (bf16)
                        ((uint16_t *)out)[off] = to_bf16(v);
                    else
                        ((float *)out)[off] = v;
                }
    }
    return out;
}

/* c (Mp, Np) = a (Mp, K) b, b in panels; Mp a multiple of MR. */
static void gemm(ukr_fn ukr, size_t Mp, size_t K, size_t N, const float *a, const void *panels,
                 size_t elem, float *c, float *apack)
{
    size_t np = round_up(N, NR) / NR, ldc = np * NR;
    for (size_t pc = 0; pc < K; pc += KC) {
        size_t kc = K - pc < KC ? K - pc : KC;
        const char *bblock = (const char *)panels + pc * np * NR * elem;
        for (size_t ic = 0; ic < Mp; ic += MC) {
            size_t mc = Mp - ic < MC ? Mp - ic : MC;
            for (size_t ir = 0; ir < mc; ir += GEMM_MR)   /* A's row panels */
                for (size_t p = 0; p < kc; p++)
                    for (size_t r = 0; r < GEMM_MR; r++)
                        apack[ir * kc + p * GEMM_MR + r] = a[(ic + ir + r) * K + pc + p];
            for (size_t j = 0; j < np; j++)
                for (size_t ir = 0; ir < mc; ir += GEMM_MR)
                    ukr(kc, apack + ir * kc, bblock + j * kc * NR * elem, NR,
                        c + (ic + ir) * ldc + j * NR, ldc, pc > 0);
        }
    }
}

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

static int cmp(const void *x, const void *y)
{
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: %s M K N WEIGHTS REPS\n", argv[0]);
        return 2;
    }
    size_t M = strtoul(argv[1], 0, 10), K = strtoul(argv[2], 0, 10);
    size_t N = strtoul(argv[3], 0, 10), W = strtoul(argv[4], 0, 10);
    int reps = atoi(argv[5]);
    size_t Mp = round_up(M, GEMM_MR), ldc = round_up(N, NR);
    float *a = aligned_alloc(64, round_up(Mp * K * 4, 64));
    float *b = malloc(K * N * 4);
    float *c32 = aligned_alloc(64, round_up(Mp * ldc * 4, 64));
    float *c16 = aligned_alloc(64, round_up(Mp * ldc * 4, 64));
    float *apack = aligned_alloc(64, round_up(MC * KC * 4, 64));
    void **p32 = malloc(W * sizeof *p32), **p16 = malloc(W * sizeof *p16);
    uint32_t s = 12345;
    for (size_t i = 0; i < Mp * K; i++, s = s * 1664525u + 1013904223u)
        a[i] = i < M * K ? (float)(s >> 8) / 16777216.0f - 0.5f : 0.0f;
    for (size_t w = 0; w < W; w++) {
        for (size_t i = 0; i < K * N; i++, s = s * 1664525u + 1013904223u)
            b[i] = from_bf16(to_bf16((float)(s >> 8) / 16777216.0f - 0.5f));  /* bf16 values */
        p32[w] = pack_b(b, K, N, 0);
        p16[w] = pack_b(b, K, N, 1);
    }
    /* the same bits from both kinds of panel, on every weight */
    for (size_t w = 0; w < W; w++) {
        gemm(ukr_f32, Mp, K, N, a, p32[w], 4, c32, apack);
        gemm(ukr_bf16, Mp, K, N, a, p16[w], 2, c16, apack);
        if (memcmp(c32, c16, Mp * ldc * 4) != 0) {
            fprintf(stderr, "panels: float32 and bfloat16 panels differ on weight %zu\n", w);
            return 1;
        }
    }
    double *t32 = malloc(reps * sizeof *t32), *t16 = malloc(reps * sizeof *t16);
    for (int r = 0; r < reps; r++) {
        double t0 = now_ms();
        for (size_t w = 0; w < W; w++)
            gemm(ukr_f32, Mp, K, N, a, p32[w], 4, c32, apack);
        double t1 = now_ms();
        for (size_t w = 0; w < W; w++)
            gemm(ukr_bf16, Mp, K, N, a, p16[w], 2, c16, apack);
        t16[r] = now_ms() - t1;
        t32[r] = t1 - t0;
    }
    qsort(t32, reps, sizeof *t32, cmp);
    qsort(t16, reps, sizeof *t16, cmp);
    printf("%zu %zu %zu %zu %.4f %.4f\n", M, K, N, W, t32[reps / 2], t16[reps / 2]);
    return 0;
}
