/*
 * backward_impl.h - the backward driver, once per element type; included
 * by backward.c with MHA_F64 defined (0 float, 1 double) and PICK naming
 * each function in full. No include guard on purpose.
 *
 * Legend: see mha.h. The driver plans, then computes: bwd_plan sizes and
 * allocates everything once, and each pass below is one function. The
 * tiles of passes 3-5 are the kernels of the ISA in force (kernels/bwd.inc,
 * through the table of kernels.h); the GEMMs are core/gemm.c's.
 *
 *  0b. with the output gate: g = sigmoid(x wgate + bgate) recomputed, and
 *      gated = g concat when dwo is wanted (core/gate.c, the forward's
 *      function, so bitwise the forward's)
 *   1. d(concat) = dout wo^T, dwo = concat^T dout, dbo = colsum(dout);
 *      with the gate these are d(gated) and gated^T dout
 *  1b. with the gate: d(concat) = d(gated) g, dz = d(gated) concat
 *      g (1 - g) (core/gate.c)
 *   2. D = rowsum(dO * O) per (b, h, query row)
 *  2b. with a q/k transform: qt, kt recomputed from q, k (core/qk.c, the
 *      forward's function, so bitwise the forward's); the tiles read them
 *   3. pack q, d(concat) per (b, h) and k, v per (b, key block)
 *   4. dK, dV per (b, kv head, key block): per tile, S and P = exp(S - lse)
 *      recomputed, dP, dS = P (dP - D)
 *   5. dQ per (b, query head, query block), P recomputed;
 *      or 4 and 5 fused per (b, kv head) when those tasks fill the threads
 *      (bwd_plan_fused): bitwise the same gradients, with less work
 *  5b. with a q/k transform: dq, dk from d(qt), d(kt) in place, and
 *      dq_norm, dk_norm (core/qk.c)
 *   6. dwq, dbq, dx and likewise for k and v; with the gate, dwgate =
 *      x^T dz, dbgate = colsum(dz), dx += dz wgate^T
 * Outside the tiles no pass contracts a * b + c or reassociates a sum, and
 * every reduction has one order: the gradients are bitwise the same for
 * any thread count.
 */
#if !defined(MHA_F64)
#error "backward_impl.h needs MHA_F64"
#endif
#include "dtype.h"
#define BWD_CTX PICK(mha_bwd_ctx_f32, mha_bwd_ctx_f64)
#define BWD_ARGS PICK(bwd_args_t_f32, bwd_args_t_f64)
#define BWD_PLAN PICK(bwd_plan_t_f32, bwd_plan_t_f64)

/* The call's arrays, typed, as mha_backward reads them from mha_params. */
typedef struct {
    REAL *dx, *dkey, *dvalue;           /* (B, Tq, Din) (B, Tk, Dkin) (B, Tk, Dvin) */
    REAL *dwq, *dwk, *dwv, *dwo;        /* (Din, Sq) (Dkin, Sk) (Dvin, Sv) (Svq, Dout) */
    REAL *dbq, *dbk, *dbv, *dbo;        /* (Sq,) (Sk,) (Sv,) (Dout,) */
    REAL *dsinks, *dq_norm, *dk_norm;   /* (H,), as q_norm, as k_norm (mha.h) */
    REAL *dwgate, *dbgate;              /* (Din, Svq) (Svq,) */
    REAL *dmask;                        /* (B, H, Tq, Tk), with an additive mask */
    REAL *drel_table;                   /* (rel_buckets, H), with T5's bias */
    const REAL *dout;                   /* (B, Tq, Dout) */
    const REAL *x, *key, *value;        /* (B, Tq, Din) (B, Tk, Dkin) (B, Tk, Dvin) */
    const REAL *wq, *wk, *wv, *wo;      /* as the forward's */
    const REAL *wgate, *bgate;          /* (Din, Svq) (Svq,), or NULL: no gate */
    const REAL *q, *k, *v, *concat;     /* kept by the forward */
    const REAL *lse;                    /* (B, H, Tq) */
} BWD_ARGS;

/* Sizes and scratch of one call, computed once by bwd_plan. */
typedef struct {
    const mha_config *cfg;
    const mha_kernels *kern;
    mha_layout lay;
    size_t nq, nk;          /* B Tq and B Tk: rows of the projections */
    int nth;                /* threads handed to the pool             */
    int need_dq, need_dkv;  /* some wanted gradient needs dQ / dK, dV */
    size_t *off;            /* (2H + 2G,): qoff, cvoff, koff, voff    */
    REAL *dcat_s;           /* (B, Tq, Svq) d(concat), when W^O or the
                               gate is there                          */
    REAL *gate;             /* (B, Tq, Svq) g, with the gate           */
    REAL *gz;               /* (B, Tq, Svq) gated (pass 1's dwo), then
                               dz (pass 1b), with the gate             */
    int need_dz;            /* some wanted gradient needs dz           */
    REAL *D;                /* (B, H, Tq)                             */
    REAL *qt, *kt;          /* (B, Tq, Sq) (B, Tk, Sk) transformed q, k
                               (q/k transforms), else NULL            */
    REAL *grad_s[3];        /* dq, dk, dv scratch, where the tiles do not
                               write into the caller's (mha_attend_backward) */
    REAL *lse_s;            /* (B, H, Tq) lse recomputed, else NULL   */
    mha_rel rel;            /* T5's bias by distance (relbias.h)      */
    BWD_CTX c;              /* the tiles' view; its buffers are scratch */
} BWD_PLAN;

/* Frees every buffer of the plan (NULL ones included). */
static void PICK(bwd_plan_free_f32, bwd_plan_free_f64)(BWD_PLAN *p)
{
    mha_scratch_free(p->off);
    mha_scratch_free(p->dcat_s);
    mha_scratch_free(p->gate);
    mha_scratch_free(p->gz);
    mha_scratch_free(p->D);
    mha_scratch_free(p->qt);
    mha_scratch_free(p->kt);
    for (int i = 0; i < 3; i++)
        mha_scratch_free(p->grad_s[i]);
    mha_scratch_free(p->lse_s);
    mha_rel_free(&p->rel);
    mha_scratch_free(p->c.drel_part);
    mha_scratch_free(p->c.rel_acc);
    mha_scratch_free(p->c.scratch);
    mha_scratch_free(p->c.qh);
    mha_scratch_free(p->c.doh);
    mha_scratch_free(p->c.kh);
    mha_scratch_free(p->c.kT);
    mha_scratch_free(p->c.vT);
    mha_scratch_free(p->c.qbad);
    mha_scratch_free(p->c.kvbad);
}

/* The gradients of variants the call lacks are not written (mha.h: dsinks
   with sinks, dmask with an additive mask, drel_table with T5's table). */
static void PICK(bwd_absent_grads_f32, bwd_absent_grads_f64)(BWD_ARGS *a,
                                                             const mha_config *cfg)
{
    if (cfg->sinks == NULL)
        a->dsinks = NULL;
    if (cfg->mask_kind != MHA_MASK_ADD)
        a->dmask = NULL;
    if (cfg->rel_table == NULL)
        a->drel_table = NULL;
}

/* The arguments a call must have: required buffers may only be NULL when
   they hold no element, and a shared gradient buffer means a shared input,
   whose shapes must then agree. Drops dwo when there is no W^O, dwgate
   and dbgate when there is no gate. */
static mha_status PICK(bwd_check_args_f32, bwd_check_args_f64)(BWD_ARGS *a,
                                                               const BWD_PLAN *p,
                                                               mha_error *err)
{
    const mha_config *cfg = p->cfg;
    const size_t nq = p->nq, nk = p->nk;
    const mha_required req[] = {
        {a->dout, nq * cfg->Dout != 0, "dout"},   {a->x, nq * cfg->Din != 0, "x"},
        {a->key, nk * cfg->Dkin != 0, "key"},     {a->value, nk * cfg->Dvin != 0, "value"},
        {a->wq, cfg->Din != 0, "wq"},             {a->wk, cfg->Dkin != 0, "wk"},
        {a->wv, cfg->Dvin != 0, "wv"},            {a->wo, cfg->has_wo, "wo (has_wo = 1)"},
        {a->q, nq != 0, "q"},                     {a->k, nk != 0, "k"},
        {a->v, nk != 0, "v"},                     {a->concat, nq != 0, "concat"},
        {a->lse, nq != 0, "lse"},
    };
    mha_status st = mha_check_required(req, sizeof req / sizeof req[0], err);
    if (st != MHA_OK)
        return st;
    if (a->dx != NULL && a->dkey == a->dx && (cfg->Tk != cfg->Tq || cfg->Dkin != cfg->Din))
        return mha_reject(err, MHA_ERR_ARG, MHA_FIELD_PARAMS,
                          "dkey == dx (key is x) needs Tk == Tq and Dkin == Din: Tk = %zu, "
                          "Tq = %zu, Dkin = %zu, Din = %zu", cfg->Tk, cfg->Tq, cfg->Dkin,
                          cfg->Din);
    if (a->dx != NULL && a->dvalue == a->dx && (cfg->Tk != cfg->Tq || cfg->Dvin != cfg->Din))
        return mha_reject(err, MHA_ERR_ARG, MHA_FIELD_PARAMS,
                          "dvalue == dx (value is x) needs Tk == Tq and Dvin == Din: "
                          "Tk = %zu, Tq = %zu, Dvin = %zu, Din = %zu", cfg->Tk, cfg->Tq,
                          cfg->Dvin, cfg->Din);
    if (a->dkey != NULL && a->dvalue == a->dkey && cfg->Dvin != cfg->Dkin)
        return mha_reject(err, MHA_ERR_ARG, MHA_FIELD_PARAMS,
                          "dvalue == dkey (value is key) needs Dvin == Dkin: Dvin = %zu, "
                          "Dkin = %zu", cfg->Dvin, cfg->Dkin);
    if (a->bgate != NULL && a->wgate == NULL)
        return mha_reject(err, MHA_ERR_ARG, MHA_FIELD_PARAMS,
                          "bgate is given without wgate: the output gate needs its weight");
    if (!cfg->has_wo)
        a->dwo = NULL;
    if (a->wgate == NULL)
        a->dwgate = a->dbgate = NULL;
    PICK(bwd_absent_grads_f32, bwd_absent_grads_f64)(a, cfg);
    return MHA_OK;
}

/* What both plans (the layer's and mha_attend_backward's) start from: the
   thread count, and every head's column offsets in the fused buffers
   (p->off: qoff (H,), cvoff (H,), koff (G,), voff (G,)). */
static mha_status PICK(bwd_plan_heads_f32, bwd_plan_heads_f64)(BWD_PLAN *p,
                                                               const mha_config *cfg)
{
    const int nth = mha_get_num_threads();
    p->nth = nth < 1 ? 1 : nth;
    const size_t H = cfg->H, G = cfg->G;
    const mha_status st = mha_scratch((void **)&p->off, 2 * (H + G), sizeof *p->off);
    if (st == MHA_OK)
        mha_head_offsets(p->off, p->off + H, p->off + 2 * H, p->off + 2 * H + G, cfg);
    return st;
}

/* T5's bias for the tiles (the forward's, by distance, with the buckets)
   and, with drel_table wanted, pass 4's partial sums by bucket (B G nkb
   slots of H / G rows of rel_buckets) and the threads' sums by distance
   (nth rows of rel.n), those zeroed: bwd_kv_block keeps them 0 between
   uses. */
static mha_status PICK(bwd_plan_rel_f32, bwd_plan_rel_f64)(BWD_PLAN *p, const BWD_ARGS *a)
{
    const mha_config *cfg = p->cfg;
    BWD_CTX *c = &p->c;
    mha_status st = mha_rel_prepare(&p->rel, cfg, sizeof(REAL), 1);
    if (st != MHA_OK || p->rel.bias == NULL)
        return st;
    c->rel = &p->rel;
    if (a->drel_table == NULL)
        return MHA_OK;
    size_t np, na;
    if (!mha_mul_ok(&np, cfg->B * cfg->H, c->nkb) || !mha_mul_ok(&np, np, cfg->rel_buckets) ||
        !mha_mul_ok(&na, (size_t)p->nth, p->rel.n))
        return MHA_ERR_SIZE;
    if ((st = mha_scratch((void **)&c->drel_part, np, sizeof(REAL))) != MHA_OK ||
        (st = mha_scratch((void **)&c->rel_acc, na, sizeof(REAL))) != MHA_OK)
        return st;
    for (size_t e = 0; e < na; e++)
        c->rel_acc[e] = 0;
    return MHA_OK;
}

/* Allocates the tiles' scratch: per-thread S and dP tiles, the packed
   operands (kh, kT: B nkb BK Sk reals, vT: B nkb BK Sv, with B nkb BK <
   B Tk + B BK; qh: B Tq Sq, doh: B Tq Svq), their flags (qbad: B H nqb
   bytes, kvbad: B nkb G) and dq, dk, dv as needed, unless c->dq, c->dk,
   c->dv already point at the caller's. */
static mha_status PICK(bwd_plan_tiles_f32, bwd_plan_tiles_f64)(BWD_PLAN *p,
                                                               const BWD_ARGS *a)
{
    BWD_CTX *c = &p->c;
    const size_t B = p->cfg->B, Sk = p->lay.Sk, Sv = p->lay.Sv;
    mha_status st = MHA_OK;
    if ((p->need_dq || p->need_dkv) &&
        (st = PICK(bwd_plan_rel_f32, bwd_plan_rel_f64)(p, a)) != MHA_OK)
        return st;
    if (p->need_dq || p->need_dkv) {
        size_t nkT, nvT;
        if (!mha_mul_ok(&nkT, B * c->nkb, MHA_BWD_BK) || !mha_mul_ok(&nvT, nkT, Sv) ||
            !mha_mul_ok(&nkT, nkT, Sk))
            return MHA_ERR_SIZE;
        if ((st = mha_scratch((void **)&c->scratch, (size_t)p->nth,
                              MHA_BWD_TILE_STRIDE * sizeof(REAL))) != MHA_OK ||
            (st = mha_scratch((void **)&c->kh, nkT, sizeof(REAL))) != MHA_OK ||
            (st = mha_scratch((void **)&c->kT, nkT, sizeof(REAL))) != MHA_OK ||
            (st = mha_scratch((void **)&c->vT, nvT, sizeof(REAL))) != MHA_OK ||
            (st = mha_scratch((void **)&c->qh, p->nq * p->lay.Sq, sizeof(REAL))) != MHA_OK ||
            (st = mha_scratch((void **)&c->doh, p->nq * p->lay.Svq, sizeof(REAL))) != MHA_OK ||
            (st = mha_scratch_small((void **)&c->qbad, B * p->cfg->H * c->nqb, 1)) != MHA_OK ||
            (st = mha_scratch_small((void **)&c->kvbad, B * c->nkb * p->cfg->G, 1)) != MHA_OK)
            return st;
    }
    REAL **grad[3] = {&c->dq, &c->dk, &c->dv};
    const int need[3] = {p->need_dq, p->need_dkv, p->need_dkv};
    const size_t n[3] = {p->nq * p->lay.Sq, p->nk * Sk, p->nk * Sv};
    for (int i = 0; i < 3 && st == MHA_OK; i++) {
        if (!need[i] || *grad[i] != NULL)
            continue;
        st = mha_scratch((void **)&p->grad_s[i], n[i], sizeof(REAL));
        *grad[i] = p->grad_s[i];
    }
    return st;
}

/* Plans the call: sizes, which gradients need which passes, and every
   buffer, allocated here and freed by bwd_plan_free whatever happens. */
static mha_status PICK(bwd_plan_f32, bwd_plan_f64)(BWD_PLAN *p, BWD_ARGS *a,
                                                   const mha_config *cfg, mha_error *err)
{
    *p = (BWD_PLAN){.cfg = cfg};
    mha_status st = mha_check_config_typed(&p->lay, cfg, MHA_DTYPE, err);
    if (st != MHA_OK)
        return st;
    p->nq = cfg->B * cfg->Tq;
    p->nk = cfg->B * cfg->Tk;
    if ((st = PICK(bwd_check_args_f32, bwd_check_args_f64)(a, p, err)) != MHA_OK)
        return st;
    p->kern = mha_kernels_for(mha_get_isa(), MHA_F64);
    p->need_dq = a->dx != NULL || a->dwq != NULL || a->dbq != NULL ||
                 (a->dq_norm != NULL && cfg->q_norm != NULL);
    // dmask and drel_table are written by pass 4, the dK, dV tiles (into
    // scratch when neither is wanted).
    p->need_dkv = a->dkey != NULL || a->dvalue != NULL || a->dwk != NULL ||
                  a->dbk != NULL || a->dwv != NULL || a->dbv != NULL ||
                  (a->dk_norm != NULL && cfg->k_norm != NULL) || a->dmask != NULL ||
                  a->drel_table != NULL;
    const size_t H = cfg->H, G = cfg->G;
    if ((st = PICK(bwd_plan_heads_f32, bwd_plan_heads_f64)(p, cfg)) != MHA_OK)
        return st;
    // With the gate: g for d(concat) (the attention's gradients), gated
    // for dwo, dz for dwgate, dbgate and dx (pass 1b), each when wanted.
    const int attn = p->need_dq || p->need_dkv || a->dsinks != NULL;
    const size_t ncat = p->nq * p->lay.Svq;
    p->need_dz = a->wgate != NULL && (a->dwgate != NULL || a->dbgate != NULL || a->dx != NULL);
    if (a->wgate != NULL && (attn || a->dwo != NULL || p->need_dz) &&
        (st = mha_scratch((void **)&p->gate, ncat, sizeof(REAL))) != MHA_OK)
        return st;
    if (a->wgate != NULL && (a->dwo != NULL || p->need_dz) &&
        (st = mha_scratch((void **)&p->gz, ncat, sizeof(REAL))) != MHA_OK)
        return st;
    if ((cfg->has_wo || a->wgate != NULL) && (attn || p->need_dz) &&
        (st = mha_scratch((void **)&p->dcat_s, ncat, sizeof(REAL))) != MHA_OK)
        return st;
    if ((p->need_dq || p->need_dkv || a->dsinks != NULL) &&
        (st = mha_scratch((void **)&p->D, cfg->B * H * cfg->Tq, sizeof(REAL))) != MHA_OK)
        return st;
    // The q/k transforms' copies, for a side they change (pass 2b).
    if ((p->need_dq || p->need_dkv) && mha_qk_active(cfg, 0) &&
        (st = mha_scratch((void **)&p->qt, p->nq * p->lay.Sq, sizeof(REAL))) != MHA_OK)
        return st;
    if ((p->need_dq || p->need_dkv) && mha_qk_active(cfg, 1) &&
        (st = mha_scratch((void **)&p->kt, p->nk * p->lay.Sk, sizeof(REAL))) != MHA_OK)
        return st;
    p->c = (BWD_CTX){
        .cfg = cfg, .lay = &p->lay, .qoff = p->off, .cvoff = p->off + H,
        .koff = p->off + 2 * H, .voff = p->off + 2 * H + G,
        .q = p->qt != NULL ? p->qt : a->q, .k = p->kt != NULL ? p->kt : a->k,
        .v = a->v, .lse = a->lse, .D = p->D, .dmask = a->dmask,
        .nqb = (cfg->Tq + MHA_BWD_BQ - 1) / MHA_BWD_BQ,
        .nkb = (cfg->Tk + MHA_BWD_BK - 1) / MHA_BWD_BK,
    };
    return PICK(bwd_plan_tiles_f32, bwd_plan_tiles_f64)(p, a);
}

/* dst (cols,) = sum over rows of src (rows, cols), rows in increasing
   order: a bias's gradient. Overwrites dst. */
static void PICK(bwd_colsum_f32, bwd_colsum_f64)(REAL *dst, const REAL *src,
                                                 size_t rows, size_t cols)
{
    for (size_t c = 0; c < cols; c++)
        dst[c] = 0;
    for (size_t r = 0; r < rows; r++) {
        const REAL *src_r = src + r * cols;
        for (size_t c = 0; c < cols; c++)
            dst[c] += src_r[c];
    }
}

/* Pass 0b, with the output gate: g = sigmoid(x @ wgate + bgate) and, for
   dwo, gated = g * concat, by the forward's function (its pass 2b), so
   bitwise what the forward's W^O read. */
static mha_status PICK(bwd_pass_gate_fwd_f32, bwd_pass_gate_fwd_f64)(const BWD_PLAN *p,
                                                                     const BWD_ARGS *a)
{
    if (p->gate == NULL)
        return MHA_OK;
    return PICK(mha_gate_forward_f32, mha_gate_forward_f64)(
        p->gate, a->dwo != NULL ? p->gz : NULL, a->x, a->wgate, a->bgate, a->concat, NULL,
        p->cfg, p->nq, p->cfg->Din, p->lay.Svq);
}

/* Pass 1, through the output projection `out = concat @ wo + bo`:
   d(concat) = dout wo^T, dwo = concat^T dout, dbo = colsum(dout). Without
   W^O, `out = concat (+ bo)`: d(concat) = dout. With the gate, concat is
   the gated one (pass 0b's, in gz) and d(concat) is d(gated), which pass
   1b takes through the gate. */
static mha_status PICK(bwd_pass_output_f32, bwd_pass_output_f64)(BWD_PLAN *p,
                                                                 const BWD_ARGS *a)
{
    const mha_config *cfg = p->cfg;
    const size_t Svq = p->lay.Svq, Dout = cfg->Dout;
    mha_status st = MHA_OK;
    p->c.dcat = a->dout;
    if (p->dcat_s != NULL && cfg->has_wo) {
        if ((st = GEMM(p->dcat_s, Svq, a->dout, Dout, 0, a->wo, Dout, 1, NULL,
                       p->nq, Svq, Dout, 0)) != MHA_OK)
            return st;
        p->c.dcat = p->dcat_s;
    }
    // What W^O read: (B, Tq, Svq).
    const REAL *cat = a->wgate != NULL ? p->gz : a->concat;
    if (a->dwo != NULL &&
        (st = GEMM(a->dwo, Dout, cat, Svq, 1, a->dout, Dout, 0, NULL, Svq,
                   Dout, p->nq, 0)) != MHA_OK)
        return st;
    if (a->dbo != NULL)
        PICK(bwd_colsum_f32, bwd_colsum_f64)(a->dbo, a->dout, p->nq, Dout);
    return mha_interrupted(cfg) ? MHA_ERR_INTERRUPTED : MHA_OK;
}

/* Pass 1b, through the output gate `gated = sigmoid(z) * concat`, `z = x
   @ wgate + bgate`: d(concat) = d(gated) g into dcat_s (in place when it
   holds d(gated)), and dz = d(gated) concat g (1 - g) into gz when wanted
   (pass 6 takes dz through z). */
static mha_status PICK(bwd_pass_gate_f32, bwd_pass_gate_f64)(BWD_PLAN *p, const BWD_ARGS *a)
{
    if (p->gate == NULL || p->dcat_s == NULL)
        return MHA_OK;
    const mha_status st = PICK(mha_gate_backward_f32, mha_gate_backward_f64)(
        p->dcat_s, p->need_dz ? p->gz : NULL, p->c.dcat, p->gate, a->concat,
        p->nq * p->lay.Svq);
    p->c.dcat = p->dcat_s;
    if (st == MHA_OK && mha_interrupted(p->cfg))
        return MHA_ERR_INTERRUPTED;
    return st;
}

/* Pass 2: D = rowsum(dO * O) per (b, h, i), where O is head h's slice of
   concat and dO the same slice of d(concat). */
static void PICK(bwd_pass_rowdot_f32, bwd_pass_rowdot_f64)(BWD_PLAN *p,
                                                           const BWD_ARGS *a)
{
    const mha_config *cfg = p->cfg;
    const size_t B = cfg->B, H = cfg->H, Tq = cfg->Tq, Svq = p->lay.Svq;
    const size_t *cvoff = p->c.cvoff;
    for (size_t b = 0; b < B; b++)
        for (size_t h = 0; h < H; h++) {
            const size_t dvh = cfg->dv[h / (H / cfg->G)];
            for (size_t i = 0; i < Tq; i++) {
                const REAL *o_bi = a->concat + (b * Tq + i) * Svq + cvoff[h];
                const REAL *do_bi = p->c.dcat + (b * Tq + i) * Svq + cvoff[h];
                REAL acc = 0;
                for (size_t d = 0; d < dvh; d++)
                    acc += do_bi[d] * o_bi[d];
                p->D[(b * H + h) * Tq + i] = acc;
            }
        }
}

/* Pass 2 (sinks): each row's softmax counted the sink h as a key of score
   sink_h and value zero, weight P_sink = exp(sink_h - lse); its dP is 0,
   so dS_sink = P_sink (0 - D) (bwd_tile_probs' softmax backward), and
     dsinks[h] = -sum over b, i of exp(sink_h - lse[b, h, i]) D[b, h, i],
   summed over b, then i, in increasing order (one order: bitwise for any
   thread count). A row with lse = -inf (a sink of -inf that saw no key)
   adds nothing; a fully masked row has O = 0, so D = 0 and adds 0. */
static void PICK(bwd_pass_dsinks_f32, bwd_pass_dsinks_f64)(const BWD_PLAN *p,
                                                           const BWD_ARGS *a)
{
    const mha_config *cfg = p->cfg;
    const size_t B = cfg->B, H = cfg->H, Tq = cfg->Tq;
    const REAL *sinks = (const REAL *)cfg->sinks;
    for (size_t h = 0; h < H; h++) {
        double acc = 0;
        for (size_t b = 0; b < B; b++)
            for (size_t i = 0; i < Tq; i++) {
                const size_t at = (b * H + h) * Tq + i;
                if (a->lse[at] != NINF)
                    acc -= exp((double)sinks[h] - (double)a->lse[at]) * (double)p->D[at];
            }
        a->dsinks[h] = (REAL)acc;
    }
}

/* After pass 4, with T5's bias: drel_table[k, h] = the sum of head h's
   bucket-k partials over b, then key blocks, in increasing order (one
   order: bitwise for any thread count), in double. */
static void PICK(bwd_pass_drel_f32, bwd_pass_drel_f64)(const BWD_PLAN *p, const BWD_ARGS *a)
{
    const mha_config *cfg = p->cfg;
    if (a->drel_table == NULL)
        return;
    const size_t H = cfg->H, G = cfg->G, per_kv = H / G, nbk = cfg->rel_buckets;
    const size_t nkb = p->c.nkb;
    for (size_t h = 0; h < H; h++) {
        const size_t g = h / per_kv, hl = h % per_kv;
        for (size_t k = 0; k < nbk; k++) {
            double acc = 0;
            for (size_t b = 0; b < cfg->B; b++)
                for (size_t kb = 0; kb < nkb; kb++)
                    acc += (double)p->c.drel_part[(((b * G + g) * nkb + kb) * per_kv + hl) *
                                                  nbk + k];
            a->drel_table[k * H + h] = (REAL)acc;
        }
    }
}

/* Pass 2b: qt, kt = the forward's q/k transforms of q, k (pass 1b there),
   recomputed by the same function, so the tiles see the forward's bits. */
static mha_status PICK(bwd_pass_qk_f32, bwd_pass_qk_f64)(const BWD_PLAN *p,
                                                         const BWD_ARGS *a)
{
    if (p->qt == NULL && p->kt == NULL)
        return MHA_OK;
    return PICK(mha_qk_forward_f32, mha_qk_forward_f64)(
        p->qt, p->kt, a->q, a->k, p->cfg, &p->lay, p->c.qoff, p->c.koff);
}

/* Pass 5b: through `qt = RoPE(norm(q))` (RMSNorm or LayerNorm) and
   likewise kt: dq, dk (which the tiles filled with d(qt), d(kt)) become
   dL/dq, dL/dk in place, and
   dq_norm, dk_norm are written when wanted and their norm is on. */
static mha_status PICK(bwd_pass_qk_grad_f32, bwd_pass_qk_grad_f64)(const BWD_PLAN *p,
                                                                   const BWD_ARGS *a)
{
    if (p->qt == NULL && p->kt == NULL)
        return MHA_OK;
    return PICK(mha_qk_backward_f32, mha_qk_backward_f64)(
        p->c.dq, p->c.dk, a->dq_norm, a->dk_norm, a->q, a->k, p->cfg, &p->lay,
        p->c.qoff, p->c.koff);
}

/* Passes 3-5, the tiles: pack the operands, then dK, dV and dQ, fused or
   in two passes (bwd_plan_fused). */
static mha_status PICK(bwd_pass_tiles_f32, bwd_pass_tiles_f64)(BWD_PLAN *p)
{
    const mha_config *cfg = p->cfg;
    const mha_kernels *kern = p->kern;
    const size_t B = cfg->B, H = cfg->H, G = cfg->G;
    BWD_CTX *c = &p->c;
    mha_status st;
    if ((st = mha_parallel_for_n(B * H, p->nth, kern->bwd_pack_q, c)) != MHA_OK ||
        (st = mha_parallel_for_n(B * c->nkb, p->nth, kern->bwd_pack_k, c)) != MHA_OK)
        return st;
    if (mha_interrupted(cfg))
        return MHA_ERR_INTERRUPTED;
    if (p->need_dq && p->need_dkv && mha_bwd_plan_fused(B * G, p->nth)) {
        st = mha_parallel_for_n(B * G, p->nth, kern->bwd_fused, c);
    } else {
        if (p->need_dkv)
            st = mha_parallel_for_n(B * G * c->nkb, p->nth, kern->bwd_dkv, c);
        if (st == MHA_OK && p->need_dq)
            st = mha_parallel_for_n(B * H * c->nqb, p->nth, kern->bwd_dq, c);
    }
    if (st == MHA_OK && mha_interrupted(cfg))
        st = MHA_ERR_INTERRUPTED;
    return st;
}

/* What dw = input^T dproj reads of input (rows, d_in): input itself, or,
   when a row whose gradient dproj (rows, S) is all zero holds an inf or
   NaN (a key no query sees, a query that sees none: the forward never read
   it), a copy (*copy, the caller's to free) with such rows zero, so that
   they add 0 to dw, not 0 * NaN. Finite inputs are never copied. */
static mha_status PICK(bwd_seen_input_f32, bwd_seen_input_f64)(
    const REAL **seen, REAL **copy, const REAL *input, const REAL *dproj,
    size_t rows, size_t d_in, size_t S)
{
    *seen = input;
    *copy = NULL;
    for (size_t r = 0; r < rows; r++) {
        const REAL *dp_r = dproj + r * S, *in_r = input + r * d_in;
        size_t c = 0;
        while (c < S && dp_r[c] == 0)
            c++;
        if (c < S)
            continue; /* the row has a gradient: most rows, at once */
        int bad = 0;
        for (size_t e = 0; e < d_in; e++)
            bad |= !(in_r[e] - in_r[e] == 0);
        if (!bad)
            continue;
        if (*copy == NULL) {
            const mha_status st = mha_scratch((void **)copy, rows * d_in, sizeof(REAL));
            if (st != MHA_OK)
                return st;
            memcpy(*copy, input, rows * d_in * sizeof(REAL));
            *seen = *copy;
        }
        for (size_t e = 0; e < d_in; e++)
            (*copy)[r * d_in + e] = 0;
    }
    return MHA_OK;
}

/* Pass 6 for one input projection, `proj = input @ w + bias` (rows of
   input, d_in wide; proj S wide): dw = input^T dproj, dbias =
   colsum(dproj), dinput = dproj w^T, added into dinput when `add` (a
   gradient buffer shared with an earlier role: key is x, value is key or
   x). dw reads input as bwd_seen_input says. The interrupt flag is polled
   after each GEMM (a GEMM is not split). */
static mha_status PICK(bwd_projection_f32, bwd_projection_f64)(
    const mha_config *cfg, REAL *dw, REAL *dbias, REAL *dinput,
    const REAL *input, const REAL *w, const REAL *dproj, size_t rows,
    size_t d_in, size_t S, int add)
{
    mha_status st = MHA_OK;
    if (dw != NULL) {
        const REAL *seen;
        REAL *copy;
        st = PICK(bwd_seen_input_f32, bwd_seen_input_f64)(&seen, &copy, input, dproj, rows,
                                                           d_in, S);
        if (st == MHA_OK)
            st = GEMM(dw, S, seen, d_in, 1, dproj, S, 0, NULL, d_in, S, rows, 0);
        mha_scratch_free(copy);
        if (st != MHA_OK)
            return st;
    }
    if (mha_interrupted(cfg))
        return MHA_ERR_INTERRUPTED;
    if (dbias != NULL)
        PICK(bwd_colsum_f32, bwd_colsum_f64)(dbias, dproj, rows, S);
    if (dinput != NULL &&
        (st = GEMM(dinput, d_in, dproj, S, 0, w, S, 1, NULL, rows, d_in, S, add)) != MHA_OK)
        return st;
    return mha_interrupted(cfg) ? MHA_ERR_INTERRUPTED : MHA_OK;
}

/* Pass 6: through the input projections `q = x @ wq + bq` and likewise k
   and v, and then the output gate's `z = x @ wgate + bgate` (dz from pass
   1b), whose dx is added last. */
static mha_status PICK(bwd_pass_inputs_f32, bwd_pass_inputs_f64)(const BWD_PLAN *p,
                                                                 const BWD_ARGS *a)
{
    const mha_config *cfg = p->cfg;
    mha_status st = PICK(bwd_projection_f32, bwd_projection_f64)(
        cfg, a->dwq, a->dbq, a->dx, a->x, a->wq, p->c.dq, p->nq, cfg->Din,
        p->lay.Sq, 0);
    if (st == MHA_OK)
        st = PICK(bwd_projection_f32, bwd_projection_f64)(
            cfg, a->dwk, a->dbk, a->dkey, a->key, a->wk, p->c.dk, p->nk,
            cfg->Dkin, p->lay.Sk, a->dkey == a->dx);
    if (st == MHA_OK)
        st = PICK(bwd_projection_f32, bwd_projection_f64)(
            cfg, a->dwv, a->dbv, a->dvalue, a->value, a->wv, p->c.dv, p->nk,
            cfg->Dvin, p->lay.Sv, a->dvalue == a->dx || a->dvalue == a->dkey);
    // dx was written above (any dx makes dQ wanted, need_dq).
    if (st == MHA_OK && p->need_dz)
        st = PICK(bwd_projection_f32, bwd_projection_f64)(
            cfg, a->dwgate, a->dbgate, a->dx, a->x, a->wgate, p->gz, p->nq, cfg->Din,
            p->lay.Svq, 1);
    return st;
}

/* mha_backward (backward.c) for one element type; prm checked by
   mha_call_typed. */
static mha_status PICK(mha_backward_f32, mha_backward_f64)(const mha_config *cfg,
                                                           const mha_params *prm,
                                                           mha_error *err)
{
    // Shapes: see BWD_ARGS above and mha.h.
    BWD_ARGS a = {
        .dx = prm->dx, .dkey = prm->dkey, .dvalue = prm->dvalue,
        .dwq = prm->dwq, .dwk = prm->dwk, .dwv = prm->dwv, .dwo = prm->dwo,
        .dbq = prm->dbq, .dbk = prm->dbk, .dbv = prm->dbv, .dbo = prm->dbo,
        .dsinks = prm->dsinks, .dq_norm = prm->dq_norm, .dk_norm = prm->dk_norm,
        .dwgate = prm->dwgate, .dbgate = prm->dbgate, .dmask = prm->dmask,
        .drel_table = prm->drel_table,
        .dout = prm->dout, .x = prm->x, .key = prm->key, .value = prm->value,
        .wq = prm->wq, .wk = prm->wk, .wv = prm->wv, .wo = prm->wo,
        .wgate = prm->wgate, .bgate = prm->bgate,
        .q = prm->q, .k = prm->k, .v = prm->v, .concat = prm->concat, .lse = prm->lse,
    };
    BWD_PLAN p;
    mha_status st = PICK(bwd_plan_f32, bwd_plan_f64)(&p, &a, cfg, err);
    if (st == MHA_OK)
        st = PICK(bwd_pass_gate_fwd_f32, bwd_pass_gate_fwd_f64)(&p, &a);
    if (st == MHA_OK)
        st = PICK(bwd_pass_output_f32, bwd_pass_output_f64)(&p, &a);
    if (st == MHA_OK)
        st = PICK(bwd_pass_gate_f32, bwd_pass_gate_f64)(&p, &a);
    if (st == MHA_OK && (p.need_dq || p.need_dkv || a.dsinks != NULL)) {
        PICK(bwd_pass_rowdot_f32, bwd_pass_rowdot_f64)(&p, &a);
        if (a.dsinks != NULL)
            PICK(bwd_pass_dsinks_f32, bwd_pass_dsinks_f64)(&p, &a);
        if (p.need_dq || p.need_dkv) {
            st = PICK(bwd_pass_qk_f32, bwd_pass_qk_f64)(&p, &a);
            if (st == MHA_OK)
                st = PICK(bwd_pass_tiles_f32, bwd_pass_tiles_f64)(&p);
            if (st == MHA_OK)
                PICK(bwd_pass_drel_f32, bwd_pass_drel_f64)(&p, &a);
            if (st == MHA_OK)
                st = PICK(bwd_pass_qk_grad_f32, bwd_pass_qk_grad_f64)(&p, &a);
        }
    }
    if (st == MHA_OK)
        st = PICK(bwd_pass_inputs_f32, bwd_pass_inputs_f64)(&p, &a);
    PICK(bwd_plan_free_f32, bwd_plan_free_f64)(&p);
    return st;
}

/*
 * mha_attend_backward: the plan and passes of mha_backward on attention
 * alone. No pass 1 (no W^O: d(concat) is dout, concat is out), no pass 2b
 * or 5b (no q/k transform: the caller's q, k are what the tiles read), no
 * pass 6 (no input projection): pass 0 (the lse, when not given, by the
 * forward's attention pass), pass 2 (D = rowsum(dout * out), dsinks), then
 * the tiles of passes 3-5, which write dq, dk, dv straight into the
 * caller's buffers (scratch for one not wanted but written by a fused
 * task). The gradients are the tiles' d(qt), d(kt), dv of mha_backward,
 * bitwise, on the same problem.
 */
static mha_status PICK(bwd_attend_plan_f32, bwd_attend_plan_f64)(
    BWD_PLAN *p, BWD_ARGS *a, REAL *dq, REAL *dk, REAL *dv, const mha_config *cfg,
    mha_error *err)
{
    *p = (BWD_PLAN){.cfg = cfg};
    mha_status st = mha_check_config_typed(&p->lay, cfg, MHA_DTYPE, err);
    if (st != MHA_OK)
        return st;
    // The q/k transforms belong to the projections (mha_project).
    if ((st = mha_check_no_qk(cfg, err)) != MHA_OK)
        return st;
    const size_t nq = p->nq = cfg->B * cfg->Tq, nk = p->nk = cfg->B * cfg->Tk;
    PICK(bwd_absent_grads_f32, bwd_absent_grads_f64)(a, cfg);
    p->need_dq = dq != NULL;
    p->need_dkv = dk != NULL || dv != NULL || a->dmask != NULL ||
                  a->drel_table != NULL;   /* pass 4's */
    const int any = p->need_dq || p->need_dkv || a->dsinks != NULL;
    const mha_required req[] = {
        {a->dout, any && nq != 0, "dout"}, {a->q, any && nq != 0, "q"},
        {a->concat, any && nq != 0, "out"}, {a->k, any && nk != 0, "k"},
        {a->v, any && nk != 0, "v"},
    };
    if ((st = mha_check_required(req, sizeof req / sizeof req[0], err)) != MHA_OK)
        return st;
    p->kern = mha_kernels_for(mha_get_isa(), MHA_F64);
    const size_t H = cfg->H, G = cfg->G;
    if ((st = PICK(bwd_plan_heads_f32, bwd_plan_heads_f64)(p, cfg)) != MHA_OK)
        return st;
    if (any && (st = mha_scratch((void **)&p->D, cfg->B * H * cfg->Tq, sizeof(REAL))) != MHA_OK)
        return st;
    // Without lse, pass 0 recomputes it (bwd_attend_lse).
    if (any && a->lse == NULL && nq != 0) {
        if ((st = mha_scratch((void **)&p->lse_s, cfg->B * H * cfg->Tq, sizeof(REAL))) != MHA_OK)
            return st;
        a->lse = p->lse_s;
    }
    p->c = (BWD_CTX){
        .cfg = cfg, .lay = &p->lay, .qoff = p->off, .cvoff = p->off + H,
        .koff = p->off + 2 * H, .voff = p->off + 2 * H + G,
        .q = a->q, .k = a->k, .v = a->v, .dcat = a->dout, .lse = a->lse, .D = p->D,
        .dq = dq, .dk = dk, .dv = dv, .dmask = a->dmask,
        .nqb = (cfg->Tq + MHA_BWD_BQ - 1) / MHA_BWD_BQ,
        .nkb = (cfg->Tk + MHA_BWD_BK - 1) / MHA_BWD_BK,
    };
    return PICK(bwd_plan_tiles_f32, bwd_plan_tiles_f64)(p, a);
}

/* Pass 0, without the caller's lse: the forward's attention pass on q,
   k, v recomputes it (into p->lse_s; its output goes to scratch), so it is
   bitwise mha_forward's on the same problem. */
static mha_status PICK(bwd_attend_lse_f32, bwd_attend_lse_f64)(const BWD_PLAN *p,
                                                               const BWD_ARGS *a)
{
    REAL *cat;
    mha_status st = mha_scratch((void **)&cat, p->nq * p->lay.Svq, sizeof(REAL));
    if (st == MHA_OK)
        st = PICK(mha_attend_fused_f32, mha_attend_fused_f64)(cat, p->lse_s, a->q, a->k,
                                                              a->v, p->cfg);
    mha_scratch_free(cat);
    return st;
}

/* mha_attend_backward (backward.c) for one element type; prm checked by
   mha_call_typed. */
static mha_status PICK(mha_attend_backward_f32, mha_attend_backward_f64)(
    const mha_config *cfg, const mha_params *prm, mha_error *err)
{
    // dq, q (B, Tq, Sq); dk, k (B, Tk, Sk); dv, v (B, Tk, Sv);
    // dout, out (B, Tq, Svq); lse (B, H, Tq); dsinks (H,).
    BWD_ARGS a = {.dsinks = prm->dsinks, .dmask = prm->dmask,
                  .drel_table = prm->drel_table, .dout = prm->dout,
                  .q = prm->q, .k = prm->k, .v = prm->v, .concat = prm->out,
                  .lse = prm->lse};
    BWD_PLAN p;
    mha_status st = PICK(bwd_attend_plan_f32, bwd_attend_plan_f64)(&p, &a, prm->dq, prm->dk,
                                                                   prm->dv, cfg, err);
    if (st == MHA_OK && p.lse_s != NULL)
        st = PICK(bwd_attend_lse_f32, bwd_attend_lse_f64)(&p, &a);
    if (st == MHA_OK && (p.need_dq || p.need_dkv || a.dsinks != NULL)) {
        PICK(bwd_pass_rowdot_f32, bwd_pass_rowdot_f64)(&p, &a);
        if (a.dsinks != NULL)
            PICK(bwd_pass_dsinks_f32, bwd_pass_dsinks_f64)(&p, &a);
        if (mha_interrupted(cfg))
            st = MHA_ERR_INTERRUPTED;
        if (st == MHA_OK && (p.need_dq || p.need_dkv))
            st = PICK(bwd_pass_tiles_f32, bwd_pass_tiles_f64)(&p);
        if (st == MHA_OK)
            PICK(bwd_pass_drel_f32, bwd_pass_drel_f64)(&p, &a);
    }
    PICK(bwd_plan_free_f32, bwd_plan_free_f64)(&p);
    return st;
}

#undef BWD_CTX
#undef BWD_ARGS
#undef BWD_PLAN
