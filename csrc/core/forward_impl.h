/*
 * forward_impl.h - the forward driver, once per element type; included by
 * forward.c with MHA_F64 defined (0 float, 1 double) and PICK naming each
 * function in full. No include guard on purpose.
 *
 * Legend: see mha.h. The driver plans, then computes: fwd_plan checks the
 * call and allocates all scratch once, and each pass is one function.
 *   1. projections: q = x wq + bq, k = key wk + bk, v = value wv + bv
 *      (the document's Q = X W^Q, one GEMM over every head at once)
 *  1b. q/k transforms, when on: qt = RoPE(RMSNorm(q)), kt likewise
 *      (core/qk.c); the attention reads qt, kt, the kept q, k stay raw
 *   2. attention per (b, h, query block): scores, scale, masks, softmax
 *      and weights V, fused (kernels/flash.inc via attend())
 *   3. output: out = concat wo + bo, or out = concat (+ bo) without W^O
 * The interrupt flag is polled between passes (a GEMM is not split) and by
 * every attention tile.
 */
#if !defined(MHA_F64)
#error "forward_impl.h needs MHA_F64"
#endif
#include "dtype.h"
#define FWD_ARGS PICK(fwd_args_t_f32, fwd_args_t_f64)
#define FWD_PLAN PICK(fwd_plan_t_f32, fwd_plan_t_f64)

/* The call's arrays, as mha_forward_<type> takes them (see mha.h). */
typedef struct {
    REAL *out;                         /* (B, Tq, Dout)                  */
    REAL *weights;                     /* (B, H, Tq, Tk) or NULL         */
    REAL *q, *k, *v, *concat;          /* kept when non-NULL (mha.h)     */
    REAL *lse;                         /* (B, H, Tq) or NULL             */
    const REAL *x, *key, *value;       /* (B, Tq, Din) (B, Tk, Dkin) (B, Tk, Dvin) */
    const REAL *wq, *wk, *wv, *wo;     /* (Din, Sq) (Dkin, Sk) (Dvin, Sv) (Svq, Dout) */
    const REAL *bq, *bk, *bv, *bo;     /* (Sq,) (Sk,) (Sv,) (Dout,) or NULL */
} FWD_ARGS;

/* Sizes and buffers of one call, computed once by fwd_plan. */
typedef struct {
    const mha_config *cfg;
    mha_layout lay;
    size_t nq, nk;          /* B Tq and B Tk: rows of the projections   */
    size_t *off;            /* (2H + 2G,): qoff, cvoff, koff, voff      */
    REAL *q, *k, *v;        /* (B, Tq, Sq) (B, Tk, Sk) (B, Tk, Sv)      */
    REAL *cat;              /* (B, Tq, Svq): the heads side by side     */
    REAL *qt, *kt;          /* what the attention reads: transformed
                               copies (B, Tq, Sq) (B, Tk, Sk) of q, k
                               when a q/k transform is on, else q, k   */
    REAL *scratch[6];       /* what of q, k, v, cat, qt, kt is ours     */
} FWD_PLAN;

/* Scratch for a buffer the caller does not keep: *use = given, or a new
   buffer of n reals recorded in *own. */
static mha_status PICK(fwd_buffer_f32, fwd_buffer_f64)(REAL **use, REAL **own,
                                                       REAL *given, size_t n)
{
    *use = given;
    if (given != NULL)
        return MHA_OK;
    mha_status st = mha_scratch((void **)own, n, sizeof(REAL));
    *use = *own;
    return st;
}

/* Plans the call: checks it, and allocates every buffer (freed by
   fwd_plan_free whatever happens). */
static mha_status PICK(fwd_plan_f32, fwd_plan_f64)(FWD_PLAN *p, const FWD_ARGS *a,
                                                   const mha_config *cfg)
{
    *p = (FWD_PLAN){.cfg = cfg};
    mha_status st = mha_check_config(&p->lay, cfg);
    if (st != MHA_OK)
        return st;
    const size_t nq = cfg->B * cfg->Tq, nk = cfg->B * cfg->Tk;
    p->nq = nq;
    p->nk = nk;
    // Required buffers may only be NULL when they hold no element.
    if ((a->out == NULL && nq * cfg->Dout != 0) ||
        (a->x == NULL && nq * cfg->Din != 0) ||
        (a->key == NULL && nk * cfg->Dkin != 0) ||
        (a->value == NULL && nk * cfg->Dvin != 0) ||
        (a->wq == NULL && cfg->Din != 0) || (a->wk == NULL && cfg->Dkin != 0) ||
        (a->wv == NULL && cfg->Dvin != 0) || (cfg->has_wo && a->wo == NULL))
        return MHA_ERR_ARG;
    const size_t H = cfg->H, G = cfg->G;
    if ((st = mha_scratch((void **)&p->off, 2 * (H + G), sizeof *p->off)) != MHA_OK)
        return st;
    mha_head_offsets(p->off, p->off + H, p->off + 2 * H, p->off + 2 * H + G, cfg);
    // Without W^O the heads can be written straight into out (Dout == Svq).
    REAL *cat = a->concat != NULL ? a->concat : (cfg->has_wo ? NULL : a->out);
    if ((st = PICK(fwd_buffer_f32, fwd_buffer_f64)(&p->q, &p->scratch[0], a->q,
                                                   nq * p->lay.Sq)) != MHA_OK ||
        (st = PICK(fwd_buffer_f32, fwd_buffer_f64)(&p->k, &p->scratch[1], a->k,
                                                   nk * p->lay.Sk)) != MHA_OK ||
        (st = PICK(fwd_buffer_f32, fwd_buffer_f64)(&p->v, &p->scratch[2], a->v,
                                                   nk * p->lay.Sv)) != MHA_OK)
        return st;
    if ((st = PICK(fwd_buffer_f32, fwd_buffer_f64)(&p->cat, &p->scratch[3], cat,
                                                   nq * p->lay.Svq)) != MHA_OK)
        return st;
    // The q/k transforms' copies, only for a side they change.
    p->qt = p->q;
    p->kt = p->k;
    if (mha_qk_active(cfg, 0) &&
        (st = PICK(fwd_buffer_f32, fwd_buffer_f64)(&p->qt, &p->scratch[4], NULL,
                                                   nq * p->lay.Sq)) != MHA_OK)
        return st;
    if (mha_qk_active(cfg, 1) &&
        (st = PICK(fwd_buffer_f32, fwd_buffer_f64)(&p->kt, &p->scratch[5], NULL,
                                                   nk * p->lay.Sk)) != MHA_OK)
        return st;
    return MHA_OK;
}

static void PICK(fwd_plan_free_f32, fwd_plan_free_f64)(FWD_PLAN *p)
{
    free(p->off);
    for (int i = 0; i < 6; i++)
        free(p->scratch[i]);
}

/* Pass 1: the three projections, each `proj (rows, S) = input (rows,
   d_in) @ w (d_in, S) + bias`. */
static mha_status PICK(fwd_pass_project_f32, fwd_pass_project_f64)(const FWD_PLAN *p,
                                                                   const FWD_ARGS *a)
{
    const mha_config *cfg = p->cfg;
    const REAL *input[3] = {a->x, a->key, a->value};
    const REAL *w[3] = {a->wq, a->wk, a->wv}, *bias[3] = {a->bq, a->bk, a->bv};
    REAL *proj[3] = {p->q, p->k, p->v};
    const size_t rows[3] = {p->nq, p->nk, p->nk};
    const size_t d_in[3] = {cfg->Din, cfg->Dkin, cfg->Dvin};
    const size_t S[3] = {p->lay.Sq, p->lay.Sk, p->lay.Sv};
    for (int r = 0; r < 3; r++) {
        const mha_status st = GEMM(proj[r], S[r], input[r], d_in[r], 0, w[r], S[r],
                                   0, bias[r], rows[r], S[r], d_in[r], 0);
        if (st != MHA_OK)
            return st;
        if (mha_interrupted(cfg))
            return MHA_ERR_INTERRUPTED;
    }
    return MHA_OK;
}

/* Pass 1b: the q/k transforms (RMSNorm, RoPE) into qt, kt, when on. */
static mha_status PICK(fwd_pass_qk_f32, fwd_pass_qk_f64)(const FWD_PLAN *p)
{
    const mha_config *cfg = p->cfg;
    if (!mha_qk_active(cfg, 0) && !mha_qk_active(cfg, 1))
        return MHA_OK;
    return PICK(mha_qk_forward_f32, mha_qk_forward_f64)(
        p->qt, p->kt, p->q, p->k, cfg, &p->lay, p->off, p->off + 2 * cfg->H);
}

/* Pass 2: the fused attention of every (b, h, query block). */
static mha_status PICK(fwd_pass_attend_f32, fwd_pass_attend_f64)(const FWD_PLAN *p,
                                                                 const FWD_ARGS *a)
{
    const size_t H = p->cfg->H, G = p->cfg->G;
    mha_flash_ctx fctx = {
        .cfg = p->cfg, .Sq = p->lay.Sq, .Sk = p->lay.Sk, .Sv = p->lay.Sv,
        .Svq = p->lay.Svq, .qoff = p->off, .cvoff = p->off + H,
        .koff = p->off + 2 * H, .voff = p->off + 2 * H + G, .q = p->qt,
        .k = p->kt, .v = p->v, .cat = p->cat, .weights = a->weights,
        .lse = a->lse,
    };
    return attend(&fctx, mha_kernels_for(mha_get_isa(), MHA_F64));
}

/* Pass 3: out = concat @ wo + bo, or out = concat (+ bo) without W^O. */
static mha_status PICK(fwd_pass_output_f32, fwd_pass_output_f64)(const FWD_PLAN *p,
                                                                 const FWD_ARGS *a)
{
    const size_t Dout = p->cfg->Dout, Svq = p->lay.Svq;
    if (p->cfg->has_wo)
        return GEMM(a->out, Dout, p->cat, Svq, 0, a->wo, Dout, 0, a->bo, p->nq,
                    Dout, Svq, 0);
    if (p->cat != a->out || a->bo != NULL) {
        for (size_t r = 0; r < p->nq; r++) {
            REAL *out_r = a->out + r * Dout;
            const REAL *cat_r = p->cat + r * Svq;
            for (size_t c = 0; c < Dout; c++)
                out_r[c] = a->bo ? cat_r[c] + a->bo[c] : cat_r[c];
        }
    }
    return MHA_OK;
}

mha_status PICK(mha_forward_f32, mha_forward_f64)(
    REAL *out, REAL *weights, REAL *q, REAL *k, REAL *v, REAL *concat,
    REAL *lse,
    const REAL *x, const REAL *key, const REAL *value,
    const REAL *wq, const REAL *wk, const REAL *wv, const REAL *wo,
    const REAL *bq, const REAL *bk, const REAL *bv, const REAL *bo,
    const mha_config *cfg)
{
    // Shapes: see FWD_ARGS above and mha.h.
    const FWD_ARGS a = {out, weights, q, k, v, concat, lse, x, key, value,
                        wq, wk, wv, wo, bq, bk, bv, bo};
    FWD_PLAN p;
    mha_status st = PICK(fwd_plan_f32, fwd_plan_f64)(&p, &a, cfg);
    if (st == MHA_OK)
        st = PICK(fwd_pass_project_f32, fwd_pass_project_f64)(&p, &a);
    if (st == MHA_OK)
        st = PICK(fwd_pass_qk_f32, fwd_pass_qk_f64)(&p);
    if (st == MHA_OK)
        st = PICK(fwd_pass_attend_f32, fwd_pass_attend_f64)(&p, &a);
    if (st == MHA_OK)
        st = PICK(fwd_pass_output_f32, fwd_pass_output_f64)(&p, &a);
    PICK(fwd_plan_free_f32, fwd_plan_free_f64)(&p);
    return st;
}

/* Pass 2 alone (attend_fused.h): mha_attend_backward's recomputed lse. */
mha_status PICK(mha_attend_fused_f32, mha_attend_fused_f64)(REAL *cat, REAL *lse,
                                                           const REAL *q, const REAL *k,
                                                           const REAL *v,
                                                           const mha_config *cfg)
{
    // cat (B, Tq, Svq), lse (B, H, Tq); q (B, Tq, Sq), k (B, Tk, Sk), v (B, Tk, Sv).
    mha_layout lay;
    mha_status st = mha_check_config(&lay, cfg);
    if (st != MHA_OK)
        return st;
    if (mha_qk_active(cfg, 0) || mha_qk_active(cfg, 1))
        return MHA_ERR_ARG;
    const size_t H = cfg->H, G = cfg->G;
    size_t *off;
    if ((st = mha_scratch((void **)&off, 2 * (H + G), sizeof *off)) != MHA_OK)
        return st;
    mha_head_offsets(off, off + H, off + 2 * H, off + 2 * H + G, cfg);
    mha_flash_ctx fctx = {
        .cfg = cfg, .Sq = lay.Sq, .Sk = lay.Sk, .Sv = lay.Sv, .Svq = lay.Svq,
        .qoff = off, .cvoff = off + H, .koff = off + 2 * H, .voff = off + 2 * H + G,
        .q = q, .k = k, .v = v, .cat = cat, .weights = NULL, .lse = lse,
    };
    st = attend(&fctx, mha_kernels_for(mha_get_isa(), MHA_F64));
    free(off);
    return st;
}

#undef FWD_ARGS
#undef FWD_PLAN
