/*
 * gate.h - the output gate of the core (contract in mha.h, mha_params'
 * wgate and bgate): Keras's MultiHeadAttention(use_gate=True), the gated
 * attention of Qwen3-Next. Internal to csrc/core/.
 *
 * Legend: see mha.h. Per query row r (B Tq rows) and column c of the
 * concatenation (Svq):
 *   z      = x wgate + bgate                  (one GEMM, every head at once)
 *   g      = sigmoid(z) = 1 / (1 + exp(-z))
 *   gated  = g concat                         (what W^O reads)
 * and, backward, given d(gated):
 *   d(concat) = d(gated) g
 *   dz        = d(gated) concat g (1 - g)
 * (dwgate = x^T dz, dbgate = colsum(dz), dx += dz wgate^T are the
 * backward's projection pass, backward_impl.h). The elementwise steps are
 * plain C compiled once, so the same bits on every ISA path, and
 * elementwise, so for any thread count: the sigmoid in the element type
 * (float's is the C library's expf, several times faster than exp on as
 * many elements as the concatenation has), the backward's products in
 * double, rounded once when stored. exp and expf are the C library's: the
 * same on one machine.
 */
#ifndef MHA_GATE_H
#define MHA_GATE_H

#include <stddef.h>

#include "mha.h"

/*
 * Forward: g (rows, S) = sigmoid(x (rows, Din) wgate (Din, S) + bgate (S,)),
 * bgate NULL for none, and, when gated is not NULL, gated (rows, S) =
 * g * cat (rows, S). g may be gated itself, which then holds the gated
 * values alone. pk: wgate's prepacked panels (mha.h, mha_packed) or NULL.
 * The backward calls this same function to recompute g and gated: bitwise
 * the forward's. Polls cfg->interrupt after the GEMM.
 */
mha_status mha_gate_forward_f32(float *g, float *gated, const float *x, const float *wgate,
                                const float *bgate, const float *cat, const mha_packed *pk,
                                const mha_config *cfg, size_t rows, size_t Din, size_t S);
mha_status mha_gate_forward_f64(double *g, double *gated, const double *x,
                                const double *wgate, const double *bgate, const double *cat,
                                const mha_packed *pk, const mha_config *cfg, size_t rows,
                                size_t Din, size_t S);

/*
 * Backward of `gated = g * cat`, `g = sigmoid(z)`, n elements: given
 * dgated, writes dcat = dgated g (dcat may be dgated: in place) and, when
 * dz is not NULL, dz = dgated cat g (1 - g). g and cat as the forward
 * read and made them.
 */
mha_status mha_gate_backward_f32(float *dcat, float *dz, const float *dgated,
                                 const float *g, const float *cat, size_t n);
mha_status mha_gate_backward_f64(double *dcat, double *dz, const double *dgated,
                                 const double *g, const double *cat, size_t n);

#endif /* MHA_GATE_H */
