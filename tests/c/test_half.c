/*
 * test_half.c - the half precision conversions (issue 36): the scalar ones
 * of csrc/core/half.h against definitions written from the formats'
 * fields.
 *
 * Build and run (see the Makefile beside this file):
 *   make -C tests/c check      # optimised build + ASan/UBSan build, both run
 *   ./test_half [quick]        quick: a smaller random sample
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
 *     values past the float16 range.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"

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

int main(int argc, char **argv)
{
    const int quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    const double t0 = now_s();
    test_known();
    const size_t nrand = quick ? (size_t)1 << 18 : (size_t)1 << 22;
    float *rnd = random_inputs(nrand);
    const format *fmts[2] = {&k_f16, &k_bf16};
    for (int f = 0; f < 2; f++) {
        const format *F = fmts[f];
        double *grid = def_grid(F);
        float *edge;
        const size_t nedge = boundary_inputs(F, grid, &edge);
        test_scalar_widen(F);
        test_scalar_narrow(F, grid, edge, nedge, "boundaries");
        test_scalar_narrow(F, grid, rnd, nrand, "random");
        free(edge);
        free(grid);
    }
    free(rnd);
    printf("test_half: %ld checks, %d failures (%.1f s)\n", g_checks, g_failures,
           now_s() - t0);
    return g_failures != 0;
}
