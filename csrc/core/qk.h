/*
 * qk.h - the q/k transforms of the core (contract in mha.h, "q/k
 * transforms"): per-head RMSNorm or LayerNorm (cfg->norm_type) of the
 * projections q and k, then RoPE on the first rotary_dim features of each
 * head. Internal to csrc/core/.
 *
 * Legend: see mha.h. A "side" is q (B Tq rows, Sq wide, H heads, head h
 * dk[h / (H/G)] wide, weight q_norm + h q_norm_hstride) or k (B Tk rows,
 * Sk wide, G heads, weight k_norm + g k_norm_hstride). Per row and head:
 *   xhat = x r,   r = 1 / sqrt(mean(x^2) + norm_eps)        (RMSNorm)
 *   xhat = (x - m) r,   m = mean(x),
 *                 r = 1 / sqrt(mean((x - m)^2) + norm_eps)  (LayerNorm)
 *   y    = xhat w
 *   (y_a, y_b) -> (y_a cos - y_b sin, y_a sin + y_b cos) for each pair c
 *                 of the first rotary_dim features, angle pos inv_freq[c]
 * Everything is computed in double for both element types, and rounded
 * once when stored: plain C compiled once, so the bits are the same on
 * every ISA path and for any thread count (rows are split in fixed blocks,
 * and each reduction has one order).
 */
#ifndef MHA_QK_H
#define MHA_QK_H

#include <stddef.h>

#include "mha.h"

/* Nonzero when cfg transforms the q side (key == 0: q_norm or RoPE) or
   the k side (key == 1: k_norm or RoPE). The drivers keep a transformed
   copy (qt, kt) for the attention of an active side only, and read the
   projection itself otherwise. */
int mha_qk_active(const mha_config *cfg, int key);

/*
 * Forward: qt (B, Tq, Sq) = transform(q), kt (B, Tk, Sk) = transform(k).
 * q and k are the raw projections (x wq + bq, key wk + bk); qt and kt are
 * overwritten and must not overlap them; a side that is not active
 * (mha_qk_active) is skipped, and its qt / kt may be NULL. qoff (H,),
 * koff (G,) are the head offsets (mha_head_offsets). The backward calls
 * this same function to recompute qt, kt: bitwise the forward's.
 */
mha_status mha_qk_forward_f32(float *qt, float *kt, const float *q,
                              const float *k, const mha_config *cfg,
                              const mha_layout *lay, const size_t *qoff,
                              const size_t *koff);
mha_status mha_qk_forward_f64(double *qt, double *kt, const double *q,
                              const double *k, const mha_config *cfg,
                              const mha_layout *lay, const size_t *qoff,
                              const size_t *koff);

/*
 * Backward of mha_qk_forward: dq (B, Tq, Sq) holds dL/dqt on entry and
 * dL/dq on return (overwritten in place), dk likewise; either may be NULL
 * (that side is skipped). dq_norm (as q_norm: (H, dk) or (dk,)) and
 * dk_norm are overwritten when non-NULL and their norm is on (and their
 * side's dq / dk is given), else left alone. q, k: the raw projections the
 * forward transformed.
 */
mha_status mha_qk_backward_f32(float *dq, float *dk, float *dq_norm,
                               float *dk_norm, const float *q, const float *k,
                               const mha_config *cfg, const mha_layout *lay,
                               const size_t *qoff, const size_t *koff);
mha_status mha_qk_backward_f64(double *dq, double *dk, double *dq_norm,
                               double *dk_norm, const double *q,
                               const double *k, const mha_config *cfg,
                               const mha_layout *lay, const size_t *qoff,
                               const size_t *koff);

#endif /* MHA_QK_H */
