/*
 * simd_emu512.h - the AVX-512 vocabulary emulated in plain C, for a test
 * build only (MHATTN_EMULATE_AVX512=1, setup.py): the names of
 * simd_avx512.h, on structs of 16 float or 8 double lanes, each operation
 * lane by lane with the IEEE operation the instruction performs. Compiled
 * in place of simd_avx512.h by isa_avx512.c, it runs the AVX-512 kernels'
 * code (their tiles, vector widths and tails) on a machine without
 * AVX-512, and gives the AVX-512 path's bits: tests/test_golden.py checks
 * it against tests/golden/avx512.npz, recorded on AVX-512 hardware, and
 * tests/golden/make_golden.py can then record that file on any x86 machine
 * with AVX2. Never part of a release build: GCC vectorises the lane loops,
 * but a call still takes ~3x as long as on the AVX2 kernels (Zen 3, float32
 * attention at T = 1024: 53 against 20 ms, the layer 120 against 41 ms).
 *
 * What makes the bits the same:
 *   - v_madd and v_fma are both fused (fmaf / fma), as _mm512_fmadd is;
 *   - v_max / v_min return the second operand when either is NaN or both
 *     are equal (maxps / minps);
 *   - v_hsum and v_hmax reduce in the tree of GCC's _mm512_reduce_add_ps /
 *     _mm512_reduce_max_ps (avx512fintrin.h; clang's gives the same bits on
 *     the golden cases): the 256-bit halves (high op low), then the 128-bit
 *     halves, then lanes two apart, then lanes one apart;
 *   - the transposing copy moves values only, eight float or four double
 *     rows at a time (V_TPACK_ROWS), as simd_x86.h's does.
 */
#ifndef MHA_SIMD_EMU512_H
#define MHA_SIMD_EMU512_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MHA_SIMD_ISA_NAME "avx512 (emulated)"
#define MHA_ALWAYS_INLINE inline

#define V_LEN_F32 16
#define V_LEN_F64 8
#define V_TPACK_ROWS_F32 8
#define V_TPACK_ROWS_F64 4

typedef struct { float l[V_LEN_F32]; } v_f32;
typedef struct { double l[V_LEN_F64]; } v_f64;

/* Lane-wise bodies, once per type: N lanes of R, vector V. */
#define EMU_MAP1(V, N, expr)                                                  \
    V o;                                                                      \
    for (int i = 0; i < (N); i++)                                             \
        o.l[i] = (expr);                                                      \
    return o

static inline v_f32 v_zero_f32(void) { EMU_MAP1(v_f32, V_LEN_F32, 0.0f); }
static inline v_f64 v_zero_f64(void) { EMU_MAP1(v_f64, V_LEN_F64, 0.0); }
static inline v_f32 v_set1_f32(float x) { EMU_MAP1(v_f32, V_LEN_F32, x); }
static inline v_f64 v_set1_f64(double x) { EMU_MAP1(v_f64, V_LEN_F64, x); }
static inline v_f32 v_load_f32(const float *p) { EMU_MAP1(v_f32, V_LEN_F32, p[i]); }
static inline v_f64 v_load_f64(const double *p) { EMU_MAP1(v_f64, V_LEN_F64, p[i]); }
static inline v_f32 v_loadu_f32(const float *p) { EMU_MAP1(v_f32, V_LEN_F32, p[i]); }
static inline v_f64 v_loadu_f64(const double *p) { EMU_MAP1(v_f64, V_LEN_F64, p[i]); }
static inline void v_store_f32(float *p, v_f32 v) { memcpy(p, v.l, sizeof v.l); }
static inline void v_store_f64(double *p, v_f64 v) { memcpy(p, v.l, sizeof v.l); }
static inline void v_storeu_f32(float *p, v_f32 v) { memcpy(p, v.l, sizeof v.l); }
static inline void v_storeu_f64(double *p, v_f64 v) { memcpy(p, v.l, sizeof v.l); }
static inline v_f32 v_bcast_f32(const float *p) { EMU_MAP1(v_f32, V_LEN_F32, *p); }
static inline v_f64 v_bcast_f64(const double *p) { EMU_MAP1(v_f64, V_LEN_F64, *p); }

static inline v_f32 v_madd_f32(v_f32 a, v_f32 b, v_f32 c)
{
    EMU_MAP1(v_f32, V_LEN_F32, fmaf(a.l[i], b.l[i], c.l[i]));
}
static inline v_f64 v_madd_f64(v_f64 a, v_f64 b, v_f64 c)
{
    EMU_MAP1(v_f64, V_LEN_F64, fma(a.l[i], b.l[i], c.l[i]));
}
static inline float s_madd_f32(float a, float b, float c) { return fmaf(a, b, c); }
static inline double s_madd_f64(double a, double b, double c) { return fma(a, b, c); }
static inline v_f32 v_fma_f32(v_f32 a, v_f32 b, v_f32 c) { return v_madd_f32(a, b, c); }
static inline v_f64 v_fma_f64(v_f64 a, v_f64 b, v_f64 c) { return v_madd_f64(a, b, c); }
static inline v_f32 v_fnma_f32(v_f32 a, v_f32 b, v_f32 c)
{
    EMU_MAP1(v_f32, V_LEN_F32, fmaf(-a.l[i], b.l[i], c.l[i]));
}
static inline v_f64 v_fnma_f64(v_f64 a, v_f64 b, v_f64 c)
{
    EMU_MAP1(v_f64, V_LEN_F64, fma(-a.l[i], b.l[i], c.l[i]));
}

static inline v_f32 v_add_f32(v_f32 a, v_f32 b) { EMU_MAP1(v_f32, V_LEN_F32, a.l[i] + b.l[i]); }
static inline v_f64 v_add_f64(v_f64 a, v_f64 b) { EMU_MAP1(v_f64, V_LEN_F64, a.l[i] + b.l[i]); }
static inline v_f32 v_sub_f32(v_f32 a, v_f32 b) { EMU_MAP1(v_f32, V_LEN_F32, a.l[i] - b.l[i]); }
static inline v_f64 v_sub_f64(v_f64 a, v_f64 b) { EMU_MAP1(v_f64, V_LEN_F64, a.l[i] - b.l[i]); }
static inline v_f32 v_mul_f32(v_f32 a, v_f32 b) { EMU_MAP1(v_f32, V_LEN_F32, a.l[i] * b.l[i]); }
static inline v_f64 v_mul_f64(v_f64 a, v_f64 b) { EMU_MAP1(v_f64, V_LEN_F64, a.l[i] * b.l[i]); }
static inline v_f32 v_div_f32(v_f32 a, v_f32 b) { EMU_MAP1(v_f32, V_LEN_F32, a.l[i] / b.l[i]); }
static inline v_f64 v_div_f64(v_f64 a, v_f64 b) { EMU_MAP1(v_f64, V_LEN_F64, a.l[i] / b.l[i]); }

/* maxps / minps: the second operand unless the first is strictly larger
   (smaller); so a NaN in either gives the second. */
static inline float emu_max_f32(float a, float b) { return a > b ? a : b; }
static inline double emu_max_f64(double a, double b) { return a > b ? a : b; }
static inline v_f32 v_max_f32(v_f32 a, v_f32 b) { EMU_MAP1(v_f32, V_LEN_F32, emu_max_f32(a.l[i], b.l[i])); }
static inline v_f64 v_max_f64(v_f64 a, v_f64 b) { EMU_MAP1(v_f64, V_LEN_F64, emu_max_f64(a.l[i], b.l[i])); }
static inline v_f32 v_min_f32(v_f32 a, v_f32 b) { EMU_MAP1(v_f32, V_LEN_F32, a.l[i] < b.l[i] ? a.l[i] : b.l[i]); }
static inline v_f64 v_min_f64(v_f64 a, v_f64 b) { EMU_MAP1(v_f64, V_LEN_F64, a.l[i] < b.l[i] ? a.l[i] : b.l[i]); }

/* The tree of _mm512_reduce_add_ps and _mm512_reduce_max_ps, with op the
   lane operation: t[i] = op(hi256[i], lo256[i]) (8 lanes), then
   u[i] = op(t[4 + i], t[i]), then w[i] = op(u[i], u[i + 2]), then
   op(w[0], w[1]). */
static inline float emu_tree_f32(v_f32 v, float (*op)(float, float))
{
    float t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = op(v.l[8 + i], v.l[i]);
    for (int i = 0; i < 4; i++)
        u[i] = op(t[4 + i], t[i]);
    for (int i = 0; i < 2; i++)
        w[i] = op(u[i], u[i + 2]);
    return op(w[0], w[1]);
}

/* _pd: t[i] = op(hi256[i], lo256[i]), u[i] = op(t[2 + i], t[i]), then
   op(u[0], u[1]). */
static inline double emu_tree_f64(v_f64 v, double (*op)(double, double))
{
    double t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = op(v.l[4 + i], v.l[i]);
    for (int i = 0; i < 2; i++)
        u[i] = op(t[2 + i], t[i]);
    return op(u[0], u[1]);
}

static inline float emu_add_f32(float a, float b) { return a + b; }
static inline double emu_add_f64(double a, double b) { return a + b; }
static inline float v_hsum_f32(v_f32 v) { return emu_tree_f32(v, emu_add_f32); }
static inline double v_hsum_f64(v_f64 v) { return emu_tree_f64(v, emu_add_f64); }
static inline float v_hmax_f32(v_f32 v) { return emu_tree_f32(v, emu_max_f32); }
static inline double v_hmax_f64(v_f64 v) { return emu_tree_f64(v, emu_max_f64); }

/* v_hsum4: four v_hsum, as simd_avx512.h does it (simd_plain.h). */

/* Bit operations and exact values, as simd_ref.h's per lane. */
static inline v_f32 v_abs_f32(v_f32 v) { EMU_MAP1(v_f32, V_LEN_F32, fabsf(v.l[i])); }
static inline v_f64 v_abs_f64(v_f64 v) { EMU_MAP1(v_f64, V_LEN_F64, fabs(v.l[i])); }
static inline v_f32 v_copysign_f32(v_f32 m, v_f32 s)
{
    EMU_MAP1(v_f32, V_LEN_F32, copysignf(m.l[i], s.l[i]));
}
static inline v_f64 v_copysign_f64(v_f64 m, v_f64 s)
{
    EMU_MAP1(v_f64, V_LEN_F64, copysign(m.l[i], s.l[i]));
}
static inline v_f32 v_iota_f32(void) { EMU_MAP1(v_f32, V_LEN_F32, (float)i); }
static inline v_f64 v_iota_f64(void) { EMU_MAP1(v_f64, V_LEN_F64, (double)i); }

/* Lane l of v where the byte p[l] != 0, else -inf. */
static inline v_f32 v_selbool_f32(v_f32 v, const uint8_t *p)
{
    EMU_MAP1(v_f32, V_LEN_F32, p[i] ? v.l[i] : -INFINITY);
}
static inline v_f64 v_selbool_f64(v_f64 v, const uint8_t *p)
{
    EMU_MAP1(v_f64, V_LEN_F64, p[i] ? v.l[i] : -INFINITY);
}

/* v_pow2 (vpslld / vpsllq by the mantissa width, per lane), v_tpack, the
   prefetch hints and the half precision lanes (half.h per lane, which
   gives vcvtph2ps's and vcvtps2ph's bits, and simd_avx512.h's bfloat16
   rule): simd_plain.h. */
#include "simd_plain.h"

#undef EMU_MAP1

#endif /* MHA_SIMD_EMU512_H */
