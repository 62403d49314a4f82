/*
 * test_half.c - the half precision conversions (issue 36): the scalar ones
 * of csrc/core/half.h against definitions written from the formats'
 * fields, and every ISA's row converters (the kernel tables' widen_f16,
 * narrow_f16, widen_bf16, narrow_bf16; csrc/kernels/kernels.inc) against
 * the scalar ones.
 *
 * Build and run (see the Makefile beside this file):
 *   make -C tests/c check      # optimised build + ASan/UBSan build, both run
 *   ./test_half [quick]        quick: a smaller random sample
 *   ./test_half all            also every one of the 2^32 float32 patterns
 *                              narrowed (minutes)
 *
 * What is checked:
 *   - widening, float16 and bfloat16, for all 65536 patterns of each: the
 *     value (with the sign of a zero) from ldexp of the fields, infinities,
 *     and a NaN's sign, quiet bit and payload;
 *   - narrowing, float16 and bfloat16, against IEEE round to nearest, ties
 *     to even, written as a search of the format's values (the nearest one;
 *     on a tie the even pattern; past the largest finite value's half ulp,
 *     infinity), on every float32 near a boundary of either format (each of
 *     the 65536 values, each midpoint between neighbours and the float32
 *     one ulp either side of it) and on a pseudo-random sample of float32
 *     patterns weighted towards NaNs, infinities, subnormals, ties and
 *     values past the float16 range;
 *   - on every ISA this machine runs (the portable path included), each
 *     row converter gives the scalar conversion's bits for all of the
 *     above in one long row, and for every length 0 .. 67 (main body and
 *     leftovers) at element offsets 0 .. 3 of source and destination
 *     (unaligned vectors), reading nothing past the row (the ASan build
 *     has the source end where the row does) and writing nothing outside
 *     it (guards on both sides);
 *   - the float and double tables of an ISA hold the same converters;
 *   - mha_convert (mha.h), the whole-buffer entry point: on every ISA and
 *     with 1 and 3 threads, each of the four directions gives the scalar
 *     conversion's bits over lengths that cross its chunks (0, 1, one
 *     chunk and one either side, several chunks and a tail) and writes
 *     nothing past n; any other pair of types and a NULL buffer with
 *     n > 0 are MHA_ERR_ARG, with n == 0 and NULL buffers MHA_OK;
 *   - half weights (mha_params.w_storage, mha_pack_weight of a half type),
 *     on every ISA and with 1 and 3 threads, both formats: the panels of a
 *     half weight are those of its widened float32 copy, bit for bit (K >
 *     the GEMM's KC, so several K blocks; K and N not multiples of any
 *     panel width; a row stride past N), and mha_forward with half wq, wk,
 *     wv, wo gives the out of the float32 forward on the widened weights
 *     bit for bit: self- and cross-attention, with and without W^O, a
 *     bias, GEMMs that multiply panels and GEMMs small enough for the
 *     plain loop; a half w_storage is MHA_ERR_ARG naming it in a float64
 *     call, with int8 or an unknown kind, and in every other operation;
 *   - a call's ISA pin: half-weight forwards while another thread flips
 *     the ISA each give the bits of one ISA's call (test_isa_pin).
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "gemm.h"
#include "half.h"
#include "kernels.h"
#include "mha.h"
#include "threads.h"

#include "harness.h"

/* ------------------------------------------------------------------ */
/* The definitions, from the fields.                                   */

/* Everything one format's test needs to know about it. */
typedef struct {
    const char *name;
    int frac_bits;       /* 10 (float16), 7 (bfloat16)               */
    int bias;            /* 15, 127                                  */
    uint16_t inf_bits;   /* 0x7c00, 0x7f80: the exponent field full  */
    float (*widen)(uint16_t);
    uint16_t (*narrow)(float);
} format;

static const format k_f16 = {"float16", 10, 15, 0x7c00, mha_f16_to_f32, mha_f32_to_f16};
static const format k_bf16 = {"bfloat16", 7, 127, 0x7f80, mha_bf16_to_f32, mha_f32_to_bf16};

/* The value of a pattern that is not a NaN, in double (exact): with e the
   exponent field and m the fraction field, 2^(1 - bias) m 2^-frac for
   e = 0, 2^(e - bias) (1 + m 2^-frac) otherwise, infinity for a full e. */
static double def_value(const format *F, uint16_t h)
{
    const int e = (h & 0x7fff) >> F->frac_bits, m = h & ((1 << F->frac_bits) - 1);
    double mag;
    if ((h & 0x7fff) >= F->inf_bits)
        mag = INFINITY;
    else if (e == 0)
        mag = ldexp(m, 1 - F->bias - F->frac_bits);
    else
        mag = ldexp((1 << F->frac_bits) + m, e - F->bias - F->frac_bits);
    return h & 0x8000 ? -mag : mag;
}

static int def_is_nan(const format *F, uint16_t h)
{
    return (h & 0x7fff) > F->inf_bits;
}

/* The float32 a NaN pattern widens to: its sign, the exponent field full,
   the quiet bit (bit 22) and the fraction in the top fraction bits; a
   float16 NaN is made quiet, a bfloat16 one is kept as it is (half.h). */
static uint32_t def_widen_nan(const format *F, uint16_t h)
{
    const uint32_t frac = (uint32_t)(h & ((1u << F->frac_bits) - 1)) << (23 - F->frac_bits);
    const uint32_t quiet = F == &k_f16 ? 1u << 22 : 0;
    return ((uint32_t)(h & 0x8000) << 16) | 0x7f800000u | quiet | frac;
}

/* The magnitudes of a format, grid[k] the value of pattern k for
   k < inf_bits, in increasing order, and grid[inf_bits] = 2^(emax + 1),
   where the next binade would start: half-way between it and the largest
   finite value is where round to nearest overflows (IEEE 754, 4.3.1). */
static double *def_grid(const format *F)
{
    double *grid = xcalloc((size_t)F->inf_bits + 1, sizeof *grid);
    for (uint32_t k = 0; k < F->inf_bits; k++)
        grid[k] = def_value(F, (uint16_t)k);
    grid[F->inf_bits] = ldexp(1.0, (1 << (15 - F->frac_bits)) - 1 - F->bias);
    return grid;
}

/* The pattern x rounds to: a NaN keeps its sign and top fraction bits and
   gets the quiet bit; otherwise the nearest of the grid's values to |x|,
   the even pattern on a tie, infinity from grid[inf_bits] on. */
static uint16_t def_narrow(const format *F, const double *grid, float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    if (isnan(x)) {
        const uint16_t top = (uint16_t)((u & 0x7fffff) >> (23 - F->frac_bits));
        return (uint16_t)(sign | F->inf_bits | (1u << (F->frac_bits - 1)) | top);
    }
    const double a = fabs((double)x);
    if (a >= grid[F->inf_bits])
        return (uint16_t)(sign | F->inf_bits);
    uint32_t lo = 0, hi = F->inf_bits; /* grid[lo] <= a < grid[hi] */
    while (hi - lo > 1) {
        const uint32_t mid = lo + (hi - lo) / 2;
        if (grid[mid] <= a)
            lo = mid;
        else
            hi = mid;
    }
    const double below = a - grid[lo], above = grid[hi] - a; /* exact in double */
    const uint32_t k = below < above ? lo : above < below ? hi : (lo & 1) ? hi : lo;
    return (uint16_t)(sign | k);
}

static uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* ------------------------------------------------------------------ */
/* Inputs.                                                              */

/* Every float32 near a boundary of F, both signs: each value of F (inf
   included), and for each pair of neighbours k, k + 1 (k + 1 = inf_bits
   standing for the overflow threshold's far side) their midpoint, exact in
   float32 since it needs one bit more than F has, and the float32 values
   one ulp below and above it. Returns the count; *out is malloc'd. */
static size_t boundary_inputs(const format *F, const double *grid, float **out)
{
    const size_t nk = F->inf_bits;
    float *x = xcalloc(2 * (4 * nk + 1), sizeof *x);
    size_t n = 0;
    for (int neg = 0; neg < 2; neg++) {
        const float s = neg ? -1.0f : 1.0f;
        x[n++] = s * (float)def_value(F, F->inf_bits);
        for (size_t k = 0; k < nk; k++) {
            const double mid = 0.5 * (grid[k] + grid[k + 1]);
            const float m = (float)mid;
            CHECK((double)m == mid, "%s: midpoint %.17g is not a float32", F->name, mid);
            x[n++] = s * (float)grid[k];
            x[n++] = s * m;
            x[n++] = s * nextafterf(m, 0.0f);
            x[n++] = s * nextafterf(m, INFINITY);
        }
    }
    *out = x;
    return n;
}

/* n pseudo-random float32 patterns, one kind after another: any bits;
   exponents around float16's range; NaNs (quiet and signalling, payloads
   anywhere); zeros and subnormals; float16 ties and their neighbours
   (low 13 bits 0x1000 - 1 .. + 1) and bfloat16's (low 16 bits 0x8000 - 1
   .. + 1); and values around the largest finite float16 and float32. */
static float *random_inputs(size_t n)
{
    float *x = xcalloc(n, sizeof *x);
    for (size_t i = 0; i < n; i++) {
        const uint32_t r = (uint32_t)(rng_u64() >> 32), sign = r & 0x80000000u;
        const uint32_t frac = r & 0x7fffffu;
        const int near = (int)rng_below(3) - 1;
        uint32_t u;
        switch (i % 8) {
        case 0: u = r; break;
        case 1: u = sign | ((uint32_t)(100 + rng_below(46)) << 23) | frac; break;
        case 2: u = sign | 0x7f800000u | (frac ? frac : 1u); break;
        case 3: u = sign | (frac >> rng_below(24)); break;
        case 4:
            u = sign | ((uint32_t)(100 + rng_below(46)) << 23) | (frac & ~0x1fffu) |
                (uint32_t)(0x1000 + near);
            break;
        case 5: u = (r & ~0xffffu) | (uint32_t)(0x8000 + near); break;
        case 6: u = sign | (uint32_t)((int)0x477fe000 + (int)rng_below(0x4000)); break;
        default: /* up to the largest float32 and one past it, inf */
            u = sign | (uint32_t)((int)0x7f7f0000 + (int)rng_below(0x10000) + near);
            break;
        }
        memcpy(&x[i], &u, sizeof u);
    }
    return x;
}

/* ------------------------------------------------------------------ */
/* The scalar conversions against the definitions.                      */

static void test_scalar_widen(const format *F)
{
    int bad = 0;
    for (uint32_t h = 0; h < 0x10000; h++) {
        const uint32_t got = bits_of(F->widen((uint16_t)h));
        uint32_t want;
        if (def_is_nan(F, (uint16_t)h))
            want = def_widen_nan(F, (uint16_t)h);
        else
            want = bits_of((float)def_value(F, (uint16_t)h));
        bad += got != want;
        CHECK(got == want, "%s widen %04x: %08x, not %08x", F->name, (unsigned)h,
              (unsigned)got, (unsigned)want);
    }
    printf("%s widen: 65536 patterns, %d wrong\n", F->name, bad);
}

static void test_scalar_narrow(const format *F, const double *grid, const float *x,
                               size_t n, const char *what)
{
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        const uint16_t got = F->narrow(x[i]), want = def_narrow(F, grid, x[i]);
        bad += got != want;
        CHECK(got == want, "%s narrow %08x (%.9g): %04x, not %04x", F->name,
              (unsigned)bits_of(x[i]), (double)x[i], (unsigned)got, (unsigned)want);
    }
    printf("%s narrow, %s: %zu values, %d wrong\n", F->name, what, n, bad);
}

/* The cases the definitions turn on, by hand, so that a wrong definition
   cannot hide a wrong conversion. */
static void test_known(void)
{
    static const struct { uint32_t f; uint16_t h, b; } k[] = {
        {0x3f800000u, 0x3c00, 0x3f80}, /* 1                                    */
        {0x477fe000u, 0x7bff, 0x4780}, /* 65504, the largest finite float16   */
        {0x477fefffu, 0x7bff, 0x4780}, /* just under 65520                    */
        {0x477ff000u, 0x7c00, 0x4780}, /* 65520: the tie goes to even, inf    */
        {0xc77ff000u, 0xfc00, 0xc780}, /* -65520                              */
        {0x38800000u, 0x0400, 0x3880}, /* 2^-14, the smallest normal float16  */
        {0x387fc000u, 0x03ff, 0x3880}, /* the largest subnormal float16       */
        {0x387fe000u, 0x0400, 0x3880}, /* its tie with 2^-14: even, up        */
        {0x33800000u, 0x0001, 0x3380}, /* 2^-24, the smallest subnormal       */
        {0x33000000u, 0x0000, 0x3300}, /* 2^-25, the tie with 0: even, 0      */
        {0x33000001u, 0x0001, 0x3300}, /* just over it                        */
        {0x80000001u, 0x8000, 0x8000}, /* a float32 subnormal: -0             */
        {0x3f808000u, 0x3c04, 0x3f80}, /* bfloat16 tie, even below            */
        {0x3f818000u, 0x3c0c, 0x3f82}, /* bfloat16 tie, odd below: up         */
        {0x7f7fffffu, 0x7c00, 0x7f80}, /* the largest float32: inf in both    */
        {0x7f800000u, 0x7c00, 0x7f80}, /* inf                                 */
        {0x7f800001u, 0x7e00, 0x7fc0}, /* a signalling NaN: made quiet       */
        {0xffc00000u, 0xfe00, 0xffc0}, /* -NaN keeps its sign                 */
        {0x7fa02000u, 0x7f01, 0x7fe0}, /* the payload's top bits are kept    */
    };
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        float f;
        memcpy(&f, &k[i].f, sizeof f);
        CHECK(mha_f32_to_f16(f) == k[i].h, "f16(%08x) = %04x, not %04x", (unsigned)k[i].f,
              (unsigned)mha_f32_to_f16(f), (unsigned)k[i].h);
        CHECK(mha_f32_to_bf16(f) == k[i].b, "bf16(%08x) = %04x, not %04x",
              (unsigned)k[i].f, (unsigned)mha_f32_to_bf16(f), (unsigned)k[i].b);
    }
    CHECK(bits_of(mha_f16_to_f32(0x7c01)) == 0x7fc02000u, "f16 sNaN widens quiet");
    CHECK(bits_of(mha_f16_to_f32(0x0001)) == 0x33800000u, "f16 2^-24");
    CHECK(bits_of(mha_f16_to_f32(0x8000)) == 0x80000000u, "f16 -0");
    CHECK(bits_of(mha_bf16_to_f32(0x7f81)) == 0x7f810000u, "bf16 sNaN widens as it is");
}

/* ------------------------------------------------------------------ */
/* Every ISA's rows against the scalar conversions.                     */

typedef void (*widen_row)(float *dst, const uint16_t *src, size_t n);
typedef void (*narrow_row)(uint16_t *dst, const float *src, size_t n);

static widen_row row_widen(const mha_kernels *K, const format *F)
{
    return F == &k_f16 ? K->widen_f16 : K->widen_bf16;
}

static narrow_row row_narrow(const mha_kernels *K, const format *F)
{
    return F == &k_f16 ? K->narrow_f16 : K->narrow_bf16;
}

/* The tables of every ISA this machine runs, the portable one first (as
   mha_set_isa grants them; on aarch64 the x86 names are skipped). */
static size_t isa_tables(const mha_kernels *tables[4])
{
    size_t n = 0;
    const mha_isa best = harness_best_isa();
    for (int isa = 0; isa <= (int)best; isa++)
        if (mha_set_isa((mha_isa)isa) == isa) {
            tables[n++] = mha_kernels_for(mha_get_isa(), 0);
            const mha_kernels *K64 = mha_kernels_for(mha_get_isa(), 1);
            const mha_kernels *K = tables[n - 1];
            CHECK(K->widen_f16 != NULL && K64->widen_f16 == K->widen_f16 &&
                      K64->narrow_f16 == K->narrow_f16 && K64->widen_bf16 == K->widen_bf16 &&
                      K64->narrow_bf16 == K->narrow_bf16,
                  "%s: the double table's half rows are not the float table's", K->name);
        }
    mha_set_isa(best);
    return n;
}

/* All 65536 patterns widened, and the n floats x narrowed, each in one
   row, against the scalar conversions. */
static void test_rows_long(const mha_kernels *K, const format *F, const float *x, size_t n)
{
    uint16_t *h = xcalloc(0x10000, sizeof *h);
    float *w = xcalloc(0x10000, sizeof *w);
    for (uint32_t i = 0; i < 0x10000; i++)
        h[i] = (uint16_t)i;
    row_widen(K, F)(w, h, 0x10000);
    int bad = 0;
    for (uint32_t i = 0; i < 0x10000; i++) {
        const uint32_t got = bits_of(w[i]), want = bits_of(F->widen((uint16_t)i));
        bad += got != want;
        CHECK(got == want, "%s %s widen %04x: %08x, not %08x", K->name, F->name,
              (unsigned)i, (unsigned)got, (unsigned)want);
    }
    uint16_t *r = xcalloc(n, sizeof *r);
    row_narrow(K, F)(r, x, n);
    for (size_t i = 0; i < n; i++) {
        const uint16_t want = F->narrow(x[i]);
        bad += r[i] != want;
        CHECK(r[i] == want, "%s %s narrow %08x: %04x, not %04x", K->name, F->name,
              (unsigned)bits_of(x[i]), (unsigned)r[i], (unsigned)want);
    }
    printf("  %s %s rows: 65536 widened, %zu narrowed, %d wrong\n", K->name, F->name, n, bad);
    free(h);
    free(w);
    free(r);
}

#define GUARD 4
#define GUARD_BYTE 0xa5

/* dst's GUARD elements before off and after off + n still hold
   GUARD_BYTE: the row wrote only its own elements. */
static int guards_intact(const void *dst, size_t elem, size_t off, size_t n)
{
    const unsigned char *b = dst;
    for (size_t i = 0; i < off * elem; i++)
        if (b[i] != GUARD_BYTE)
            return 0;
    for (size_t i = (off + n) * elem; i < (off + n + GUARD) * elem; i++)
        if (b[i] != GUARD_BYTE)
            return 0;
    return 1;
}

/* Every length 0 .. 67 at source and destination offsets 0 .. 3: the
   source (a window of pats or x) copied into a block that ends where the
   row does, the destination between guards. */
static void test_rows_tails(const mha_kernels *K, const format *F, const uint16_t *pats,
                            size_t npats, const float *x, size_t nx)
{
    int bad = 0;
    for (size_t n = 0; n <= 67; n++)
        for (size_t so = 0; so < 4; so++)
            for (size_t d = 0; d < 4; d++) {
                const size_t at = (n * 977 + so * 131 + d * 17) % (nx - 80);
                uint16_t *hs = xcalloc(so + n, sizeof *hs);
                float *xs = xcalloc(so + n, sizeof *xs);
                memcpy(hs + so, pats + at % (npats - 80), n * sizeof *hs);
                memcpy(xs + so, x + at, n * sizeof *xs);
                float *wd = xcalloc(d + n + GUARD, sizeof *wd);
                uint16_t *nd = xcalloc(d + n + GUARD, sizeof *nd);
                memset(wd, GUARD_BYTE, (d + n + GUARD) * sizeof *wd);
                memset(nd, GUARD_BYTE, (d + n + GUARD) * sizeof *nd);
                row_widen(K, F)(wd + d, hs + so, n);
                row_narrow(K, F)(nd + d, xs + so, n);
                int wrong = !guards_intact(wd, sizeof *wd, d, n) ||
                            !guards_intact(nd, sizeof *nd, d, n);
                for (size_t i = 0; i < n; i++)
                    wrong |= bits_of(wd[d + i]) != bits_of(F->widen(hs[so + i])) ||
                             nd[d + i] != F->narrow(xs[so + i]);
                bad += wrong;
                CHECK(!wrong, "%s %s rows, n = %zu, offsets %zu, %zu: wrong bits or guards",
                      K->name, F->name, n, so, d);
                free(hs);
                free(xs);
                free(wd);
                free(nd);
            }
    printf("  %s %s rows: lengths 0 .. 67 at 16 offsets, %d wrong\n", K->name, F->name, bad);
}

/* `all`: every float32 pattern, 2^16 at a time, narrowed by each table's
   rows and by the scalar conversion, which is held to the definition. */
static void test_all_floats(const mha_kernels *const *tables, size_t ntables,
                            const format *F, const double *grid)
{
    float *x = xcalloc(0x10000, sizeof *x);
    uint16_t *want = xcalloc(0x10000, sizeof *want), *got = xcalloc(0x10000, sizeof *got);
    long bad = 0;
    for (uint32_t hi = 0; hi < 0x10000; hi++) {
        for (uint32_t lo = 0; lo < 0x10000; lo++) {
            const uint32_t u = hi << 16 | lo;
            memcpy(&x[lo], &u, sizeof u);
            want[lo] = F->narrow(x[lo]);
            const uint16_t def = def_narrow(F, grid, x[lo]);
            bad += want[lo] != def;
            CHECK(want[lo] == def, "%s narrow %08x: %04x, not %04x", F->name, (unsigned)u,
                  (unsigned)want[lo], (unsigned)def);
        }
        for (size_t t = 0; t < ntables; t++) {
            row_narrow(tables[t], F)(got, x, 0x10000);
            for (uint32_t lo = 0; lo < 0x10000; lo++) {
                bad += got[lo] != want[lo];
                CHECK(got[lo] == want[lo], "%s %s narrow %08x: %04x, not %04x",
                      tables[t]->name, F->name, (unsigned)(hi << 16 | lo),
                      (unsigned)got[lo], (unsigned)want[lo]);
            }
        }
    }
    printf("%s narrow, all 2^32 float32 patterns, scalar and %zu tables: %ld wrong\n",
           F->name, ntables, bad);
    free(x);
    free(want);
    free(got);
}

/* mha_convert, through the public entry point: every direction on the ISA
   in force, each length in `lens`, against the scalar conversions. */
static void test_convert_lengths(const float *x, size_t nx)
{
    static const size_t lens[] = {0, 1, 7, 65535, 65536, 65537, 3 * 65536 + 123};
    const size_t nmax = 3 * 65536 + 123 + 8;   /* room for the guard */
    CHECK(nx >= nmax, "random inputs too short: %zu", nx);
    if (nx < nmax)
        return;
    uint16_t *h = xcalloc(nmax, sizeof *h);
    float *f = xcalloc(nmax, sizeof *f);
    const format *fmts[2] = {&k_f16, &k_bf16};
    const mha_dtype types[2] = {MHA_DTYPE_F16, MHA_DTYPE_BF16};
    for (int t = 0; t < 2; t++) {
        const format *F = fmts[t];
        for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
            const size_t n = lens[li];
            for (size_t i = 0; i < nmax; i++)
                h[i] = 0xABCD;
            CHECK(mha_convert(h, types[t], x, MHA_DTYPE_F32, n) == MHA_OK,
                  "%s narrow n=%zu: status", F->name, n);
            size_t bad = 0;
            for (size_t i = 0; i < n; i++)
                bad += h[i] != F->narrow(x[i]);
            for (size_t i = n; i < nmax; i++)
                bad += h[i] != 0xABCD;
            CHECK(bad == 0, "%s narrow n=%zu: %zu elements wrong", F->name, n, bad);
            for (size_t i = 0; i < nmax; i++)
                f[i] = -7.0f;
            CHECK(mha_convert(f, MHA_DTYPE_F32, h, types[t], n) == MHA_OK,
                  "%s widen n=%zu: status", F->name, n);
            bad = 0;
            for (size_t i = 0; i < n; i++)
                bad += bits_of(f[i]) != bits_of(F->widen(h[i]));
            for (size_t i = n; i < nmax; i++)
                bad += f[i] != -7.0f;
            CHECK(bad == 0, "%s widen n=%zu: %zu elements wrong", F->name, n, bad);
        }
    }
    free(h);
    free(f);
}

static void test_convert(const float *x, size_t nx)
{
    const mha_isa before = mha_get_isa();
    const mha_isa best = harness_best_isa();
    for (int isa = 0; isa <= (int)best; isa++) {
        if (mha_set_isa((mha_isa)isa) != isa)
            continue;
        for (int nth = 1; nth <= 3; nth += 2) {
            mha_set_num_threads(nth);
            test_convert_lengths(x, nx);
        }
    }
    mha_set_num_threads(0);
    mha_set_isa(before);
    float f = 1.0f;
    uint16_t h = 0;
    double d = 0.0;
    CHECK(mha_convert(&d, MHA_DTYPE_F64, &h, MHA_DTYPE_F16, 1) == MHA_ERR_ARG,
          "f16 -> f64 must be refused");
    CHECK(mha_convert(&h, MHA_DTYPE_BF16, &h, MHA_DTYPE_F16, 1) == MHA_ERR_ARG,
          "f16 -> bf16 must be refused");
    CHECK(mha_convert(&f, MHA_DTYPE_F32, &f, MHA_DTYPE_F32, 1) == MHA_ERR_ARG,
          "f32 -> f32 must be refused");
    CHECK(mha_convert(&h, (mha_dtype)7, &f, MHA_DTYPE_F32, 1) == MHA_ERR_ARG,
          "an unknown type must be refused");
    CHECK(mha_convert(NULL, MHA_DTYPE_F16, &f, MHA_DTYPE_F32, 1) == MHA_ERR_ARG,
          "a NULL dst with n = 1 must be refused");
    CHECK(mha_convert(&f, MHA_DTYPE_F32, NULL, MHA_DTYPE_BF16, 1) == MHA_ERR_ARG,
          "a NULL src with n = 1 must be refused");
    CHECK(mha_convert(NULL, MHA_DTYPE_F16, NULL, MHA_DTYPE_F32, 0) == MHA_OK,
          "n = 0 with NULL buffers is a no-op");
}

/* ------------------------------------------------------------------ */
/* Half weights: packed, and read by the forward.                      */

/* n random half values of format F, of magnitude about amp, and their
   widened float32 values. */
static uint16_t *half_weight(const format *F, size_t n, float amp, float **wide)
{
    uint16_t *h = xcalloc(n, sizeof *h);
    *wide = xcalloc(n, sizeof **wide);
    for (size_t i = 0; i < n; i++) {
        h[i] = F->narrow((float)((2.0 * rng_unit() - 1.0) * amp));
        (*wide)[i] = F->widen(h[i]);
    }
    return h;
}

static mha_dtype half_dtype(const format *F)
{
    return F == &k_f16 ? MHA_DTYPE_F16 : MHA_DTYPE_BF16;
}

/* mha_pack_weight of a half (K, N) weight, row stride ldw, against the
   packing of its widened copy. */
static void test_pack_half(const format *F, size_t K, size_t N, size_t ldw)
{
    float *wide;
    uint16_t *h = half_weight(F, K * ldw, 1.0f, &wide);
    mha_packed ph, pf;
    const mha_status sh = mha_pack_weight(&ph, h, ldw, K, N, half_dtype(F));
    const mha_status sf = mha_pack_weight(&pf, wide, ldw, K, N, MHA_DTYPE_F32);
    CHECK(sh == MHA_OK && sf == MHA_OK, "%s pack (%zu, %zu): %s, %s", F->name, K, N,
          mha_status_name(sh), mha_status_name(sf));
    CHECK(ph.elems == pf.elems && ph.f64 == 0 && ph.isa == pf.isa && ph.K == K && ph.N == N,
          "%s pack (%zu, %zu): elems %zu vs %zu", F->name, K, N, ph.elems, pf.elems);
    if (ph.elems == pf.elems && ph.elems > 0)
        CHECK(memcmp(ph.data, pf.data, ph.elems * sizeof(float)) == 0,
              "%s pack (%zu, %zu, ldw %zu): panels differ from the widened weight's",
              F->name, K, N, ldw);
    mha_packed_free(&ph);
    mha_packed_free(&pf);
    free(h);
    free(wide);
}

/* One forward: B, Tq, Tk, Din, H, dk, dv, Dout (0: no W^O), cross (key
   and value a source of their own), bias (bq given). */
typedef struct {
    size_t B, Tq, Tk, Din, H, dk, dv, Dout;
    int cross, bias;
} half_fwd_case;

/* mha_forward with half weights against the float32 forward on their
   widened copies: out bitwise. */
static void test_forward_half(const format *F, const half_fwd_case *c)
{
    const size_t H = c->H, Sq = H * c->dk, Sv = H * c->dv;
    const size_t Dout = c->Dout ? c->Dout : Sv, Tk = c->cross ? c->Tk : c->Tq;
    size_t dk[8], dv[8];
    double scale[8];
    for (size_t h = 0; h < H; h++)
        dk[h] = c->dk, dv[h] = c->dv, scale[h] = 1.0 / sqrt((double)c->dk);
    const mha_config cfg = {.B = c->B, .Tq = c->Tq, .Tk = Tk, .Din = c->Din, .Dkin = c->Din,
                            .Dvin = c->Din, .Dout = Dout, .H = H, .G = H, .dk = dk, .dv = dv,
                            .scale = scale, .has_wo = c->Dout != 0};
    const size_t nx = c->B * c->Tq * c->Din, nkey = c->B * Tk * c->Din;
    float *x = xcalloc(nx, sizeof *x), *key = xcalloc(nkey, sizeof *key);
    float *bq = xcalloc(Sq, sizeof *bq);
    for (size_t i = 0; i < nx; i++)
        x[i] = (float)(2.0 * rng_unit() - 1.0);
    for (size_t i = 0; i < nkey; i++)
        key[i] = (float)(2.0 * rng_unit() - 1.0);
    for (size_t i = 0; i < Sq; i++)
        bq[i] = (float)(0.2 * rng_unit() - 0.1);
    const size_t K[4] = {c->Din, c->Din, c->Din, Sv}, N[4] = {Sq, Sq, Sv, Dout};
    uint16_t *wh[4];
    float *wf[4];
    for (int i = 0; i < 4; i++)
        wh[i] = half_weight(F, K[i] * N[i], (float)(1.0 / sqrt((double)K[i])), &wf[i]);
    const size_t nout = c->B * c->Tq * Dout;
    float *out_h = xcalloc(nout, sizeof *out_h), *out_f = xcalloc(nout, sizeof *out_f);
    const void *src = c->cross ? (const void *)key : (const void *)x;
    mha_params prm = {.dtype = MHA_DTYPE_F32, .out = out_f, .x = x, .key = src,
                      .value = src, .wq = wf[0], .wk = wf[1], .wv = wf[2],
                      .wo = c->Dout ? wf[3] : NULL, .bq = c->bias ? bq : NULL};
    const mha_status sf = mha_forward(&cfg, &prm, NULL);
    prm.out = out_h, prm.wq = wh[0], prm.wk = wh[1], prm.wv = wh[2];
    prm.wo = c->Dout ? wh[3] : NULL;
    prm.w_storage = F == &k_f16 ? MHA_KV_F16 : MHA_KV_BF16;
    mha_error err;
    const mha_status sh = mha_forward(&cfg, &prm, &err);
    CHECK(sf == MHA_OK && sh == MHA_OK, "%s forward: %s, %s (%s)", F->name,
          mha_status_name(sf), mha_status_name(sh), err.msg);
    size_t bad = 0;
    for (size_t i = 0; i < nout; i++)
        bad += bits_of(out_h[i]) != bits_of(out_f[i]);
    CHECK(bad == 0, "%s forward (B %zu, Tq %zu, Tk %zu, Din %zu, H %zu, dk %zu, dv %zu, "
          "Dout %zu, bias %d): %zu of %zu outputs differ from the widened weights' call",
          F->name, c->B, c->Tq, Tk, c->Din, H, c->dk, c->dv, Dout, c->bias, bad, nout);
    for (int i = 0; i < 4; i++)
        free(wh[i]), free(wf[i]);
    free(x), free(key), free(bq), free(out_h), free(out_f);
}

/* A half w_storage where it is not read: MHA_ERR_ARG naming w_storage. */
static void test_w_storage_refused(void)
{
    size_t dk = 2;
    double scale = 1.0, d1[4] = {0};
    uint16_t h[4] = {0};
    const mha_config cfg = {.B = 1, .Tq = 1, .Tk = 1, .Din = 2, .Dkin = 2, .Dvin = 2,
                            .Dout = 2, .H = 1, .G = 1, .dk = &dk, .dv = &dk, .scale = &scale};
    const struct {
        mha_dtype dtype;
        mha_kv_storage kind;
        int op; /* 0 forward, 1 backward, 2 project, 3 attend */
        const char *what;
    } bad[] = {{MHA_DTYPE_F64, MHA_KV_F16, 0, "a float64 forward"},
               {MHA_DTYPE_F32, MHA_KV_I8, 0, "int8 weights"},
               {MHA_DTYPE_F32, (mha_kv_storage)9, 0, "an unknown kind"},
               {MHA_DTYPE_F32, MHA_KV_BF16, 1, "the backward"},
               {MHA_DTYPE_F32, MHA_KV_BF16, 2, "mha_project"},
               {MHA_DTYPE_F32, MHA_KV_F16, 3, "mha_attend"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const mha_params prm = {.dtype = bad[i].dtype, .out = d1, .x = d1, .key = d1,
                                .value = d1, .wq = h, .wk = h, .wv = h, .q = d1, .k = d1,
                                .v = d1, .w_storage = bad[i].kind};
        mha_error err = {MHA_FIELD_NONE, ""};
        const mha_status st = bad[i].op == 0   ? mha_forward(&cfg, &prm, &err)
                              : bad[i].op == 1 ? mha_backward(&cfg, &prm, &err)
                              : bad[i].op == 2 ? mha_project(&cfg, &prm, &err)
                                               : mha_attend(&cfg, &prm, &err);
        CHECK(st == MHA_ERR_ARG && err.field == MHA_FIELD_PARAMS &&
                  strstr(err.msg, "w_storage") != NULL,
              "w_storage with %s: %s, field %d, \"%s\"", bad[i].what, mha_status_name(st),
              (int)err.field, err.msg);
    }
}

/* The call's ISA pin (dispatch.h, mha_isa_pin): mha_forward packs half
   weights for the ISA in force and then runs GEMMs that read the ISA
   again; a GEMM seeing another ISA would reject the panels and read the
   half bits as float32, past their end. A thread flips the ISA between
   the portable path and the best one while this one runs half-weight
   forwards: each out must be the bits of one of the two ISAs' calls (and
   the ASan build sees every read). Also: a pinned thread's mha_get_isa
   ignores mha_set_isa until it unpins. */
typedef struct {
    atomic_int stop, done;
    mha_isa lo, hi;
} isa_flipper;

static void isa_flip(void *p)
{
    isa_flipper *f = p;
    for (unsigned i = 0; !atomic_load(&f->stop); i++)
        mha_set_isa(i & 1 ? f->hi : f->lo);
    atomic_store(&f->done, 1);
}

static void test_isa_pin(void)
{
    const mha_isa before = mha_get_isa(), best = harness_best_isa();
    const int outer = mha_isa_pin();
    mha_set_isa(MHA_ISA_SCALAR);
    CHECK(mha_get_isa() == before, "pinned: mha_get_isa %d after mha_set_isa, want %d",
          (int)mha_get_isa(), (int)before);
    mha_isa_unpin(outer);
    CHECK(mha_get_isa() == MHA_ISA_SCALAR, "unpinned: mha_get_isa %d, want scalar",
          (int)mha_get_isa());
    if (best == MHA_ISA_SCALAR) {
        mha_set_isa(before);
        return;
    }
    const size_t B = 2, Tq = 37, Din = 300, H = 3, d = 13, Dout = 45, S = H * d;
    size_t dk[3] = {d, d, d};
    double scale[3] = {0.25, 0.25, 0.25};
    const mha_config cfg = {.B = B, .Tq = Tq, .Tk = Tq, .Din = Din, .Dkin = Din, .Dvin = Din,
                            .Dout = Dout, .H = H, .G = H, .dk = dk, .dv = dk,
                            .scale = scale, .has_wo = 1};
    float *x = xcalloc(B * Tq * Din, sizeof *x), *wide[4];
    for (size_t i = 0; i < B * Tq * Din; i++)
        x[i] = (float)(2.0 * rng_unit() - 1.0);
    const size_t K[4] = {Din, Din, Din, S}, N[4] = {S, S, S, Dout};
    uint16_t *w[4];
    for (int i = 0; i < 4; i++)
        w[i] = half_weight(&k_bf16, K[i] * N[i], 0.06f, &wide[i]);
    const size_t n = B * Tq * Dout;
    float *want[2] = {xcalloc(n, sizeof(float)), xcalloc(n, sizeof(float))};
    float *got = xcalloc(n, sizeof *got);
    mha_params prm = {.dtype = MHA_DTYPE_F32, .x = x, .key = x, .value = x, .wq = w[0],
                      .wk = w[1], .wv = w[2], .wo = w[3], .w_storage = MHA_KV_BF16};
    for (int k = 0; k < 2; k++) {
        mha_set_isa(k ? best : MHA_ISA_SCALAR);
        prm.out = want[k];
        CHECK(mha_forward(&cfg, &prm, NULL) == MHA_OK, "pin: forward on ISA %d", k);
    }
    isa_flipper f = {.lo = MHA_ISA_SCALAR, .hi = best};
    atomic_init(&f.stop, 0);
    atomic_init(&f.done, 0);
    prm.out = got;
    size_t mixed = 0, calls = 0;
    if (mha_thread_spawn(isa_flip, &f) == 0) {
        for (; calls < 100; calls++) {
            CHECK(mha_forward(&cfg, &prm, NULL) == MHA_OK, "pin: forward %zu", calls);
            mixed += memcmp(got, want[0], n * sizeof *got) != 0 &&
                     memcmp(got, want[1], n * sizeof *got) != 0;
        }
        atomic_store(&f.stop, 1);
        while (!atomic_load(&f.done))
            ;
    }
    CHECK(calls > 0 && mixed == 0, "pin: %zu of %zu forwards under a flipping ISA gave the "
          "bits of neither ISA's call", mixed, calls);
    mha_set_isa(before);
    for (int i = 0; i < 4; i++)
        free(w[i]), free(wide[i]);
    free(x), free(want[0]), free(want[1]), free(got);
}

static void test_half_weights(void)
{
    /* K 300 > KC 256; no width a multiple of 8; small GEMMs (Tq 1 and 2
       rows of small weights) take the GEMM's plain loop */
    const half_fwd_case cases[] = {
        {2, 37, 0, 300, 3, 13, 11, 45, 0, 1}, {2, 37, 0, 300, 3, 13, 11, 0, 0, 0},
        {2, 19, 29, 300, 3, 13, 11, 45, 1, 1}, {1, 2, 0, 20, 2, 5, 3, 7, 0, 1},
        {1, 1, 5, 300, 2, 40, 24, 33, 1, 0}};
    const mha_isa before = mha_get_isa();
    const mha_isa best = harness_best_isa();
    const format *fmts[2] = {&k_f16, &k_bf16};
    const long checks = g_checks;
    const int failures = g_failures;
    /* threads split even these small GEMMs (only speed depends on it) */
    const size_t grain = mha_gemm_set_grain(1);
    for (int isa = 0; isa <= (int)best; isa++) {
        if (mha_set_isa((mha_isa)isa) != isa)
            continue;
        for (int nth = 1; nth <= 3; nth += 2) {
            mha_set_num_threads(nth);
            for (int f = 0; f < 2; f++) {
                test_pack_half(fmts[f], 300, 45, 45);
                test_pack_half(fmts[f], 517, 3109, 3111); /* two column blocks */
                test_pack_half(fmts[f], 7, 5, 9);
                test_pack_half(fmts[f], 0, 5, 5);
                for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
                    test_forward_half(fmts[f], &cases[i]);
            }
        }
    }
    mha_set_num_threads(0);
    mha_set_isa(before);
    mha_gemm_set_grain(grain);
    test_w_storage_refused();
    test_isa_pin();
    printf("half weights: %ld checks, %d wrong\n", g_checks - checks, g_failures - failures);
}

int main(int argc, char **argv)
{
    const int quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    const int all = argc > 1 && strcmp(argv[1], "all") == 0;
    const double t0 = now_s();
    test_known();
    const mha_kernels *tables[4];
    const size_t ntables = isa_tables(tables);
    const size_t nrand = quick ? (size_t)1 << 18 : (size_t)1 << 22;
    float *rnd = random_inputs(nrand);
    /* float16 patterns in an order that puts specials in every window */
    uint16_t *pats = xcalloc(0x10000, sizeof *pats);
    for (uint32_t i = 0; i < 0x10000; i++)
        pats[i] = (uint16_t)(i * 40503u);
    const format *fmts[2] = {&k_f16, &k_bf16};
    for (int f = 0; f < 2; f++) {
        const format *F = fmts[f];
        double *grid = def_grid(F);
        float *edge;
        const size_t nedge = boundary_inputs(F, grid, &edge);
        test_scalar_widen(F);
        test_scalar_narrow(F, grid, edge, nedge, "boundaries");
        test_scalar_narrow(F, grid, rnd, nrand, "random");
        for (size_t t = 0; t < ntables; t++) {
            test_rows_long(tables[t], F, edge, nedge);
            test_rows_long(tables[t], F, rnd, nrand);
            test_rows_tails(tables[t], F, pats, 0x10000, rnd, nrand);
        }
        if (all)
            test_all_floats(tables, ntables, F, grid);
        free(edge);
        free(grid);
    }
    test_convert(rnd, nrand);
    test_half_weights();
    free(rnd);
    free(pats);
    printf("test_half: %ld checks, %d failures (%.1f s); rows on", g_checks, g_failures,
           now_s() - t0);
    for (size_t t = 0; t < ntables; t++)
        printf(" %s", tables[t]->name);
    printf(" (detected: %s)\n", mha_isa_name(mha_isa_detect()));
    return g_failures != 0;
}
