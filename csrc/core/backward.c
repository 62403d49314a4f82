/*
 * backward.c - the backward pass of multi-head attention (see mha.h).
 *
 * Letters (see mha.h): B batch, Tq queries, Tk keys, H query heads, G kv
 * heads, dk[g] / dv[g] head widths, Sq / Sk / Sv / Svq fused widths.
 *
 * FlashAttention-2's backward, with the forward's log-sum-exp instead of a
 * stored T x T probability matrix; the passes are numbered in
 * backward_impl.h:
 *   1. d(concat) = dout wo^T, dwo, dbo            (GEMMs)
 *   2. D = rowsum(dO * O) per (b, h, query row)
 *   3. per tile: S, P = exp(S - lse), dP, dS = P (dP - D) (the operands are
 *      packed head by head first, in parallel)
 *   4. dK, dV per (b, kv head, key block)          (threads)
 *   5. dQ per (b, query head, query block)         (threads; P recomputed)
 *      or 4 and 5 fused per (b, kv head) when those tasks fill the threads
 *      (bwd_plan_fused): same gradients, bitwise, with less work
 *   6. dwq, dbq, dx and likewise for k, v         (GEMMs)
 *
 * The template is included twice here (float32, float64) for the portable
 * build, and twice in each of backward_avx2.c and backward_avx512.c for the
 * same source compiled for AVX2 and AVX-512F, with their own tile products
 * (intrinsics, fused multiply-adds). Outside the tile products no build
 * contracts a * b + c or reassociates a sum; the builds differ by rounding
 * only, and each is bitwise the same for any thread count.
 */
#include "backward.h"
#include "dispatch.h"

#define real float
#define sfx f32
#define isa ref
#define bwd_exp bwd_expf
#include "backward_impl.h"
#undef real
#undef sfx
#undef isa
#undef bwd_exp

#define real double
#define sfx f64
#define isa ref
#define bwd_exp bwd_expd
#include "backward_impl.h"
#undef real
#undef sfx
#undef isa
#undef bwd_exp

/* The public entry points: the widest build the ISA in force allows
   (mha_get_isa: detected, capped by MHATTN_ISA or mha_set_isa), else the
   portable one. */
#ifdef MHA_BWD_HAVE_AVX2
#define BWD_PICK(sfx)                                                         \
    (mha_get_isa() >= MHA_ISA_AVX512 ? mha_backward_##sfx##_avx512            \
     : mha_get_isa() >= MHA_ISA_AVX2 ? mha_backward_##sfx##_avx2              \
                                     : mha_backward_##sfx##_ref)
#else
#define BWD_PICK(sfx) mha_backward_##sfx##_ref
#endif

#define BWD_DEFINE_PUBLIC(real, sfx)                                          \
    mha_status mha_backward_##sfx(                                            \
        real *dx, real *dkey, real *dvalue,                                   \
        real *dwq, real *dwk, real *dwv, real *dwo,                           \
        real *dbq, real *dbk, real *dbv, real *dbo,                           \
        const real *dout,                                                     \
        const real *x, const real *key, const real *value,                    \
        const real *wq, const real *wk, const real *wv, const real *wo,       \
        const real *q, const real *k, const real *v, const real *concat,      \
        const real *lse, const mha_config *cfg)                               \
    {                                                                         \
        return BWD_PICK(sfx)(dx, dkey, dvalue, dwq, dwk, dwv, dwo, dbq, dbk,  \
                             dbv, dbo, dout, x, key, value, wq, wk, wv, wo,   \
                             q, k, v, concat, lse, cfg);                      \
    }

BWD_DEFINE_PUBLIC(float, f32)
BWD_DEFINE_PUBLIC(double, f64)
