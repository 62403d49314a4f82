/*
 * gate_impl.h - the output gate, once per element type; included by
 * gate.c with MHA_F64 defined (0 float, 1 double). No include guard on
 * purpose.
 *
 * Legend: see mha.h and gate.h.
 *   forward   z = x wgate + bgate (the GEMM), then per element
 *             g = 1 / (1 + exp(-z)) and gated = g cat (gate_fwd_task)
 *   backward  per element dz = d(gated) cat g (1 - g), d(concat) =
 *             d(gated) g (gate_bwd_task)
 * g in the element type (the C library's expf or exp: float's expf is
 * several times faster than exp, over as many elements as the
 * concatenation has); the backward's products in double,
 * rounded once when stored.
 */
#if !defined(MHA_F64)
#error "gate_impl.h needs MHA_F64"
#endif
#include "dtype.h"

/* The names this template defines, bound to this type (dtype.h). */
#define GATE_FWD_CTX PICK(gate_fwd_ctx_t_f32, gate_fwd_ctx_t_f64)
#define GATE_BWD_CTX PICK(gate_bwd_ctx_t_f32, gate_bwd_ctx_t_f64)
#define gate_fwd_task PICK(gate_fwd_task_f32, gate_fwd_task_f64)
#define gate_bwd_task PICK(gate_bwd_task_f32, gate_bwd_task_f64)
#define mha_gate_forward PICK(mha_gate_forward_f32, mha_gate_forward_f64)
#define mha_gate_backward PICK(mha_gate_backward_f32, mha_gate_backward_f64)

/* What the forward's tasks read and write, n elements each. */
typedef struct {
    REAL *g;              /* (n,) z on entry, g on return             */
    REAL *gated;          /* (n,) or NULL; may be g                   */
    const REAL *cat;      /* (n,) the heads side by side              */
    size_t n;
} GATE_FWD_CTX;

/* What the backward's tasks read and write, n elements each. */
typedef struct {
    REAL *dcat;           /* (n,) may be dgated                       */
    REAL *dz;             /* (n,) or NULL                             */
    const REAL *dgated, *g, *cat;
    size_t n;
} GATE_BWD_CTX;

/* Task t: the elements [t GATE_BLOCK, (t + 1) GATE_BLOCK) of g, z on
   entry: g = sigmoid(z), then gated = g cat (last: g may be gated). */
static void gate_fwd_task(void *ctxp, size_t t, int ith)
{
    (void)ith;
    const GATE_FWD_CTX *c = ctxp;
    const size_t i0 = t * GATE_BLOCK, i1 = c->n - i0 < GATE_BLOCK ? c->n : i0 + GATE_BLOCK;
    for (size_t i = i0; i < i1; i++) {
        // exp(-z) overflows to inf for z below about -709 (-88 in float):
        // g is then 0, as it should be; NaN stays NaN.
        const REAL g = (REAL)1 / ((REAL)1 + PICK(expf, exp)(-c->g[i]));
        c->g[i] = g;
        if (c->gated != NULL)
            c->gated[i] = g * c->cat[i];
    }
}

mha_status mha_gate_forward(REAL *g, REAL *gated, const REAL *x, const REAL *wgate,
                            const REAL *bgate, const REAL *cat, const mha_packed *pk,
                            const mha_config *cfg, size_t rows, size_t Din, size_t S)
{
    // g (rows, S) = x (rows, Din) wgate (Din, S) + bgate: z, every head's
    // columns in one GEMM; then the sigmoid in place.
    mha_status st = GEMM_PACKED(g, S, x, Din, 0, wgate, S, 0, pk, bgate, rows, S, Din, 0);
    if (st != MHA_OK)
        return st;
    if (mha_interrupted(cfg))
        return MHA_ERR_INTERRUPTED;
    // rows S is the concatenation's size: mha_check_config bounds it.
    GATE_FWD_CTX c = {g, gated, cat, rows * S};
    return mha_parallel_for_n((c.n + GATE_BLOCK - 1) / GATE_BLOCK, gate_threads(c.n),
                              gate_fwd_task, &c);
}

/* Task t: the elements [t GATE_BLOCK, (t + 1) GATE_BLOCK). Through
   `gated = g * cat`, `g = sigmoid(z)` (gate_fwd_task): d(cat) = d(gated)
   g, dg = d(gated) cat, dz = dg g (1 - g). d(gated) is read before
   d(cat) is written over it. */
static void gate_bwd_task(void *ctxp, size_t t, int ith)
{
    (void)ith;
    const GATE_BWD_CTX *c = ctxp;
    const size_t i0 = t * GATE_BLOCK, i1 = c->n - i0 < GATE_BLOCK ? c->n : i0 + GATE_BLOCK;
    for (size_t i = i0; i < i1; i++) {
        const double dgated = (double)c->dgated[i], g = (double)c->g[i];
        if (c->dz != NULL)
            c->dz[i] = (REAL)(dgated * (double)c->cat[i] * g * (1.0 - g));
        c->dcat[i] = (REAL)(dgated * g);
    }
}

mha_status mha_gate_backward(REAL *dcat, REAL *dz, const REAL *dgated, const REAL *g,
                             const REAL *cat, size_t n)
{
    GATE_BWD_CTX c = {dcat, dz, dgated, g, cat, n};
    return mha_parallel_for_n((n + GATE_BLOCK - 1) / GATE_BLOCK, gate_threads(n),
                              gate_bwd_task, &c);
}

#undef GATE_FWD_CTX
#undef GATE_BWD_CTX
#undef gate_fwd_task
#undef gate_bwd_task
#undef mha_gate_forward
#undef mha_gate_backward
