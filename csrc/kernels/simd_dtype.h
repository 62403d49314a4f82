/*
 * simd_dtype.h - the generic names the kernel templates are written in,
 * bound to one element type of the vocabulary in force (simd_<isa>.h):
 * with MHA_F64 0, VADD is v_add_f32, VEC is v_f32, and so on; with
 * MHA_F64 1, the _f64 names. REAL, PICK and NINF come from core/dtype.h.
 * A compile unit includes a template once per type, each time after this
 * file. No include guard on purpose: each inclusion rebinds the names.
 * One name is optional: VHSUMV (lane i = VHSUM(a[i]) for the VLEN vectors
 * a, the same bits), bound only where the vocabulary defines
 * V_HAVE_HSUMV_F32 (AVX2 and AVX-512, float); a template tests it with
 * #ifdef and keeps its VHSUM path for the rest.
 */
#if !defined(MHA_F64)
#error "simd_dtype.h: define MHA_F64 to 0 or 1 first"
#endif
#include "dtype.h" /* REAL, PICK, NINF */

#undef VEC
#undef VLEN
#undef TPACK_ROWS
#undef SMADD
#undef VZERO
#undef VSET1
#undef VLOAD
#undef VLOADU
#undef VSTORE
#undef VSTOREU
#undef VBCAST
#undef VMADD
#undef VFMA
#undef VFNMA
#undef VADD
#undef VSUB
#undef VMUL
#undef VDIV
#undef VMAX
#undef VMIN
#undef VHMAX
#undef VHSUM
#undef VHSUM4
#undef VHSUMV
#undef VSELBOOL
#undef VPOW2
#undef VTPACK
#undef VEXP
#undef VABS
#undef VCOPYSIGN
#undef VIOTA
#undef VTANH

#if MHA_F64
#define VEC v_f64
#define VLEN V_LEN_F64
#define TPACK_ROWS V_TPACK_ROWS_F64
#define SMADD s_madd_f64
#define VZERO v_zero_f64
#define VSET1 v_set1_f64
#define VLOAD v_load_f64
#define VLOADU v_loadu_f64
#define VSTORE v_store_f64
#define VSTOREU v_storeu_f64
#define VBCAST v_bcast_f64
#define VMADD v_madd_f64
#define VFMA v_fma_f64
#define VFNMA v_fnma_f64
#define VADD v_add_f64
#define VSUB v_sub_f64
#define VMUL v_mul_f64
#define VDIV v_div_f64
#define VMAX v_max_f64
#define VMIN v_min_f64
#define VHMAX v_hmax_f64
#define VHSUM v_hsum_f64
#define VHSUM4 v_hsum4_f64
#define VSELBOOL v_selbool_f64
#define VPOW2 v_pow2_f64
#define VTPACK v_tpack_f64
#define VEXP v_exp_f64
#define VABS v_abs_f64
#define VCOPYSIGN v_copysign_f64
#define VIOTA v_iota_f64
#define VTANH v_tanh_f64

#else /* float */
#define VEC v_f32
#define VLEN V_LEN_F32
#define TPACK_ROWS V_TPACK_ROWS_F32
#define SMADD s_madd_f32
#define VZERO v_zero_f32
#define VSET1 v_set1_f32
#define VLOAD v_load_f32
#define VLOADU v_loadu_f32
#define VSTORE v_store_f32
#define VSTOREU v_storeu_f32
#define VBCAST v_bcast_f32
#define VMADD v_madd_f32
#define VFMA v_fma_f32
#define VFNMA v_fnma_f32
#define VADD v_add_f32
#define VSUB v_sub_f32
#define VMUL v_mul_f32
#define VDIV v_div_f32
#define VMAX v_max_f32
#define VMIN v_min_f32
#define VHMAX v_hmax_f32
#define VHSUM v_hsum_f32
#define VHSUM4 v_hsum4_f32
#ifdef V_HAVE_HSUMV_F32
#define VHSUMV v_hsumv_f32
#endif
#define VSELBOOL v_selbool_f32
#define VPOW2 v_pow2_f32
#define VTPACK v_tpack_f32
#define VEXP v_exp_f32
#define VABS v_abs_f32
#define VCOPYSIGN v_copysign_f32
#define VIOTA v_iota_f32
#define VTANH v_tanh_f32
#endif
