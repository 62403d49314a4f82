/*
 * mha.h - the public API of mhattn's C core.
 *
 * The core is plain C11: it knows nothing of Python or NumPy. The only file
 * that includes Python.h is mhattn_module.c (the glue).
 *
 * Letters used in every shape comment of the core:
 *   B    batch size
 *   Tq   number of queries (rows of x)
 *   Tk   number of keys and values (rows of key / value)
 *   Din  width of x            (d_in)
 *   Dkin width of key          (rows of w_k)
 *   Dvin width of value        (rows of w_v)
 *   Dout width of the output   (columns of w_o, or Svq when w_o is absent)
 *   H    number of query heads
 *   G    number of key/value heads (H % G == 0; query head h uses kv head
 *        h / (H / G)). G == H is ordinary multi-head attention.
 *   dk[g], dv[g]  key (== query) width and value width of kv head g; heads
 *        may be ragged, so every width is per head.
 *   Sq   = sum over query heads h of dk[h / (H/G)]  (fused query width)
 *   Sk   = sum over kv heads g of dk[g]             (fused key width)
 *   Sv   = sum over kv heads g of dv[g]             (fused value width)
 *   Svq  = sum over query heads h of dv[h / (H/G)]  (concatenation width)
 *
 * Every buffer is row-major and contiguous unless a stride says otherwise.
 * Head h's block of a fused buffer starts at the sum of the widths of the
 * heads before it (see mha_layout).
 *
 * Conventions: outputs come first, then inputs, then sizes and options.
 * Every function returns an mha_status; none prints, exits or asserts on
 * anything a caller can pass.
 */
#ifndef MHA_H
#define MHA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Limits of the core that callers may rely on (the glue does).
 *
 * MHA_MAX_ELEMS: the largest element count of any buffer, head width or
 * fused width the core accepts; mha_check_config returns MHA_ERR_SIZE past
 * it. Bounding counts by PTRDIFF_MAX / sizeof(double) keeps the byte sizes
 * of float and double buffers within size_t and pointer differences.
 *
 * MHA_SMALL_WORK: a forward call whose attention does fewer multiply-adds
 * than this runs on the calling thread alone, since waking a worker costs
 * more than the call (well under a millisecond on any machine).
 */
#define MHA_MAX_ELEMS ((size_t)PTRDIFF_MAX / sizeof(double))
#define MHA_SMALL_WORK 262144.0

typedef enum {
    MHA_OK = 0,
    MHA_ERR_NOMEM,       /* an allocation failed */
    MHA_ERR_SIZE,        /* a size product overflows size_t */
    MHA_ERR_ARG,         /* inconsistent sizes or a NULL required buffer */
    MHA_ERR_INTERRUPTED, /* the caller's interrupt flag was raised */
} mha_status;

/* A static, human-readable name for a status ("MHA_OK", ...). */
const char *mha_status_name(mha_status s);

typedef enum {
    MHA_MASK_NONE = 0,
    MHA_MASK_BOOL, /* uint8: nonzero = may attend (SDPA / JAX / Keras) */
    MHA_MASK_ADD,  /* real, added to the scaled scores; -inf allowed   */
} mha_mask_kind;

/*
 * Sizes and options of one call. The head-width arrays are borrowed: they
 * must outlive the call.
 */
typedef struct {
    size_t B, Tq, Tk;
    size_t Din, Dkin, Dvin, Dout;
    size_t H, G;
    const size_t *dk;     /* (G,) */
    const size_t *dv;     /* (G,) */
    const double *scale;  /* (H,) multiplier of q.k for each query head */
    int causal;           /* query i sees keys j <= i + (Tk - Tq)       */
    mha_mask_kind mask_kind;
    const void *mask;     /* uint8 or real, see mask_stride              */
    ptrdiff_t mask_stride[4]; /* element strides over (B, H, Tq, Tk); 0 broadcasts */
    const int64_t *key_lengths; /* (B,) or NULL: keys j >= len[b] ignored */
    int has_wo;           /* 0: out is the concatenation (Dout == Svq)  */
    /* Optional flag polled between work items; when it becomes nonzero the
       call stops early with MHA_ERR_INTERRUPTED. May be NULL. */
    volatile const int *interrupt;
} mha_config;

/* Derived sizes of a config, checked for overflow. */
typedef struct {
    size_t Sq, Sk, Sv, Svq;
} mha_layout;

/* Fills *lay and checks that every size product the core allocates fits in
   size_t and that the config is self-consistent. */
mha_status mha_check_config(mha_layout *lay, const mha_config *cfg);

/* Column offsets of every head in the fused buffers of a checked config:
     qoff[h]  (H,) in q (B, Tq, Sq)     cvoff[h] (H,) in concat (B, Tq, Svq)
     koff[g]  (G,) in k (B, Tk, Sk)     voff[g]  (G,) in v (B, Tk, Sv) */
void mha_head_offsets(size_t *qoff, size_t *cvoff, size_t *koff, size_t *voff,
                      const mha_config *cfg);

/*
 * Forward pass, float32 and float64 (one templated source).
 *
 * Outputs (NULL where optional and not wanted):
 *   out      (B, Tq, Dout)           required
 *   weights  (B, H, Tq, Tk)          optional: post-softmax probabilities
 *   q        (B, Tq, Sq)             optional: kept projections (else scratch)
 *   k        (B, Tk, Sk)             optional
 *   v        (B, Tk, Sv)             optional
 *   concat   (B, Tq, Svq)            optional: heads side by side, pre-W^O
 *   lse      (B, H, Tq)              optional: each row's log-sum-exp of the
 *                                    masked, scaled scores (-inf when the row
 *                                    is fully masked)
 * Inputs:
 *   x (B, Tq, Din), key (B, Tk, Dkin), value (B, Tk, Dvin)
 *   wq (Din, Sq), wk (Dkin, Sk), wv (Dvin, Sv), wo (Svq, Dout) or NULL
 *   bq (Sq,), bk (Sk,), bv (Sv,), bo (Dout,): each may be NULL (zero)
 *
 * A query row whose keys are all masked gets zero attention: its head
 * output is 0, its weights are 0 and its lse is -inf. No NaN is made; a
 * NaN score (from NaN inputs, or +inf in an additive mask) makes its row's
 * head output and lse NaN, and its weights NaN at the keys it sees.
 *
 * Runs on mha_get_num_threads() threads (threads.h) with the kernels of
 * mha_get_isa() (dispatch.h); the result does not depend on the thread
 * count, nor `out` on whether weights are wanted.
 */
#define MHA_DECLARE_FORWARD(real, sfx)                                        \
    mha_status mha_forward_##sfx(                                             \
        real *out, real *weights, real *q, real *k, real *v, real *concat,    \
        real *lse,                                                            \
        const real *x, const real *key, const real *value,                    \
        const real *wq, const real *wk, const real *wv, const real *wo,       \
        const real *bq, const real *bk, const real *bv, const real *bo,       \
        const mha_config *cfg);

MHA_DECLARE_FORWARD(float, f32)
MHA_DECLARE_FORWARD(double, f64)

/*
 * Backward pass of mha_forward_<sfx>, float32 and float64 (one templated
 * source, backward_impl.h): the gradient of a scalar loss with respect to
 * every input, given dout = dL/dout. FlashAttention-2 style: the forward's
 * probabilities are recomputed tile by tile from its lse, never stored.
 *
 * Overwrites (never adds into) every gradient it is given; pass NULL for a
 * gradient that is not wanted (work that no wanted gradient needs is
 * skipped). Gradients:
 *   dx (B, Tq, Din), dkey (B, Tk, Dkin), dvalue (B, Tk, Dvin)
 *   dwq (Din, Sq), dwk (Dkin, Sk), dwv (Dvin, Sv), dwo (Svq, Dout)
 *   dbq (Sq,), dbk (Sk,), dbv (Sv,), dbo (Dout,)
 * dwo is ignored without W^O (cfg->has_wo == 0); biases need not have been
 * given to the forward for their gradient to be computed.
 * Inputs:
 *   dout (B, Tq, Dout)
 *   x, key, value, wq, wk, wv, wo: as given to the forward (biases are not
 *   needed); q, k, v, concat, lse: as kept by the forward, same cfg.
 *
 * One input feeding several roles: when key is x (self-attention), pass
 * dkey == dx; the keys' gradient is then added into dx, which holds the
 * full gradient of x. Likewise dvalue == dx (value is x) or dvalue == dkey
 * (value is key). The shapes of the shared roles must agree.
 *
 * Fully masked query rows (lse -inf) contribute nothing: zero gradients,
 * never NaN. An additive mask gets no gradient. The result is bitwise the
 * same for any thread count.
 */
#define MHA_DECLARE_BACKWARD(real, sfx)                                       \
    mha_status mha_backward_##sfx(                                            \
        real *dx, real *dkey, real *dvalue,                                   \
        real *dwq, real *dwk, real *dwv, real *dwo,                           \
        real *dbq, real *dbk, real *dbv, real *dbo,                           \
        const real *dout,                                                     \
        const real *x, const real *key, const real *value,                    \
        const real *wq, const real *wk, const real *wv, const real *wo,       \
        const real *q, const real *k, const real *v, const real *concat,      \
        const real *lse, const mha_config *cfg);

MHA_DECLARE_BACKWARD(float, f32)
MHA_DECLARE_BACKWARD(double, f64)

#ifdef __cplusplus
}
#endif

#endif /* MHA_H */
