/*
 * attend_fused.h - the forward's attention pass alone, on fused buffers
 * (core/forward_impl.h): what mha_attend_backward calls to recompute the
 * lse it was not given. Internal to csrc/core/.
 *
 * cat (B, Tq, Svq) and lse (B, H, Tq) are overwritten from q (B, Tq, Sq),
 * k (B, Tk, Sk), v (B, Tk, Sv) of a config without q/k transforms: pass 2
 * of mha_forward, so bitwise its concat and lse on the same problem.
 */
#ifndef MHA_ATTEND_FUSED_H
#define MHA_ATTEND_FUSED_H

#include "mha.h"

mha_status mha_attend_fused_f32(float *cat, float *lse, const float *q, const float *k,
                                const float *v, const mha_config *cfg);
mha_status mha_attend_fused_f64(double *cat, double *lse, const double *q, const double *k,
                                const double *v, const mha_config *cfg);

/* When the forward's attention packs each key block once for all its
   tiles (forward.c, "Shared key blocks"): 0 never, 1 when that pays (the
   default), 2 whenever it may. Returns the previous mode. For tests: the
   bits are the same in every mode. */
int mha_attend_set_share(int mode);

#endif /* MHA_ATTEND_FUSED_H */
