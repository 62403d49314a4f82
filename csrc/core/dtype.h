/*
 * dtype.h - the names a per-type template of the core is written in, bound
 * to one element type: with MHA_F64 0, REAL is float, NINF is -inf as a
 * float, MHA_DTYPE is MHA_DTYPE_F32 (mha.h), GEMM is mha_gemm_f32 and
 * PICK(f32_name, f64_name) keeps the first; with MHA_F64 1, the double
 * ones. The drivers (forward_impl.h,
 * backward_impl.h, gemm_impl.h) and the kernels (kernels/simd_dtype.h)
 * include it first. No include guard on purpose: each inclusion rebinds the
 * names for the next type.
 *
 * PICK is how a template names what it defines: one block at the top of
 * the template binds each short name to both full names,
 *   #define gemm_tile PICK(gemm_tile_f32, gemm_tile_f64)
 * so that grep and ctags find every function; its definition and its calls
 * use the short name, and the template unbinds it at its end. (Or PICK
 * is written where the name is, as in kernels_type.inc's table.)
 * tests/test_source_layout.py holds both forms.
 */
#if !defined(MHA_F64)
#error "dtype.h: define MHA_F64 to 0 or 1 first"
#endif
#include <math.h> /* INFINITY */

#undef REAL
#undef PICK
#undef NINF
#undef MHA_DTYPE
#undef GEMM
#undef GEMM_PACKED
#undef GEMM_MULTI
#if MHA_F64
#define REAL double
#define PICK(f32, f64) f64
#define NINF ((double)-INFINITY)
#define MHA_DTYPE MHA_DTYPE_F64
#define GEMM mha_gemm_f64
#define GEMM_PACKED mha_gemm_packed_f64
#define GEMM_MULTI mha_gemm_packed_multi_f64
#else
#define REAL float
#define PICK(f32, f64) f32
#define NINF ((float)-INFINITY)
#define MHA_DTYPE MHA_DTYPE_F32
#define GEMM mha_gemm_f32
#define GEMM_PACKED mha_gemm_packed_f32
#define GEMM_MULTI mha_gemm_packed_multi_f32
#endif
