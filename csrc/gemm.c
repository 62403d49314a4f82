/*
 * gemm.c - the plain, portable matrix multiply of the core (see gemm.h).
 *
 *   C (M, N) = op(A) (M, K) @ op(B) (K, N) [+ bias (N,)]
 *
 * This is the reference kernel: row-major, i-k-j loop order so that the
 * innermost loop streams one row of B and one row of C. Faster packed SIMD
 * kernels may sit beside it later; this one stays as the tested baseline.
 *
 * float32 and float64 come from one source, gemm_impl.h, included twice.
 */
#include <stddef.h>

#include "gemm.h"

#define MHA_CAT_(a, b) a##_##b
#define MHA_CAT(a, b) MHA_CAT_(a, b)

#define real float
#define sfx f32
#include "gemm_impl.h"
#undef real
#undef sfx

#define real double
#define sfx f64
#include "gemm_impl.h"
#undef real
#undef sfx
