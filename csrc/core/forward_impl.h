/*
 * forward_impl.h - the forward driver, once per element type; included by
 * forward.c with MHA_F64 defined (0 float, 1 double) and PICK naming each
 * function in full. No include guard on purpose.
 *
 * Legend: see mha.h. The driver plans, then computes: fwd_plan checks the
 * call and allocates all scratch once, and each pass is one function.
 *   1. projections: q = x wq + bq, k = key wk + bk, v = value wv + bv
 *      (the document's Q = X W^Q, one GEMM over every head at once)
 *  1b. q/k transforms, when on: qt = RoPE(norm(q)), kt likewise, the norm
 *      RMSNorm or LayerNorm (core/qk.c); the attention reads qt, kt, the kept q, k stay raw
 *   2. attention per (b, h, query block): scores, scale, masks, softmax
 *      and weights V, fused (kernels/flash.inc via attend())
 *  2b. the output gate, when on (wgate): gated = sigmoid(x wgate + bgate)
 *      * concat (core/gate.c); the kept concat stays the heads' own
 *   3. output: out = concat wo + bo, or out = concat (+ bo) without W^O,
 *      concat the gated one when there is a gate
 * The interrupt flag is polled between passes (a GEMM is not split) and by
 * every attention tile.
 */
#if !defined(MHA_F64)
#error "forward_impl.h needs MHA_F64"
#endif
#include "dtype.h"
#define FWD_ARGS PICK(fwd_args_t_f32, fwd_args_t_f64)
#define FWD_PLAN PICK(fwd_plan_t_f32, fwd_plan_t_f64)

/* The call's arrays, typed, as mha_forward reads them from mha_params. */
typedef struct {
    REAL *out;                         /* (B, Tq, Dout)                  */
    REAL *weights;                     /* (B, H, Tq, Tk) or NULL         */
    REAL *q, *k, *v, *concat;          /* kept when non-NULL (mha.h)     */
    REAL *lse;                         /* (B, H, Tq) or NULL             */
    const REAL *x, *key, *value;       /* (B, Tq, Din) (B, Tk, Dkin) (B, Tk, Dvin) */
    const REAL *wq, *wk, *wv, *wo;     /* (Din, Sq) (Dkin, Sk) (Dvin, Sv) (Svq, Dout) */
    const REAL *bq, *bk, *bv, *bo;     /* (Sq,) (Sk,) (Sv,) (Dout,) or NULL */
    const REAL *wgate, *bgate;         /* (Din, Svq) (Svq,), or NULL: no gate */
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
    REAL *gated;            /* (B, Tq, Svq) the gated concatenation, which
                               W^O reads; NULL without the gate         */
    const mha_packed *pk_gate; /* wgate's panels (half weights) or NULL */
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
                                                   const mha_config *cfg, mha_error *err)
{
    *p = (FWD_PLAN){.cfg = cfg};
    mha_status st = mha_check_config_typed(&p->lay, cfg, MHA_DTYPE, err);
    if (st != MHA_OK)
        return st;
    const size_t nq = cfg->B * cfg->Tq, nk = cfg->B * cfg->Tk;
    p->nq = nq;
    p->nk = nk;
    // Required buffers may only be NULL when they hold no element.
    const mha_required req[] = {
        {a->out, nq * cfg->Dout != 0, "out"},     {a->x, nq * cfg->Din != 0, "x"},
        {a->key, nk * cfg->Dkin != 0, "key"},     {a->value, nk * cfg->Dvin != 0, "value"},
        {a->wq, cfg->Din != 0, "wq"},             {a->wk, cfg->Dkin != 0, "wk"},
        {a->wv, cfg->Dvin != 0, "wv"},            {a->wo, cfg->has_wo, "wo (has_wo = 1)"},
    };
    if ((st = mha_check_required(req, sizeof req / sizeof req[0], err)) != MHA_OK)
        return st;
    if (a->bgate != NULL && a->wgate == NULL)
        return mha_reject(err, MHA_ERR_ARG, MHA_FIELD_PARAMS,
                          "bgate is given without wgate: the output gate needs its weight");
    const size_t H = cfg->H, G = cfg->G;
    if ((st = mha_scratch((void **)&p->off, 2 * (H + G), sizeof *p->off)) != MHA_OK)
        return st;
    mha_head_offsets(p->off, p->off + H, p->off + 2 * H, p->off + 2 * H + G, cfg);
    if (a->wgate != NULL &&
        (st = mha_scratch((void **)&p->gated, nq * p->lay.Svq, sizeof(REAL))) != MHA_OK)
        return st;
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
    mha_scratch_free(p->off);
    for (int i = 0; i < 6; i++)
        mha_scratch_free(p->scratch[i]);
    mha_scratch_free(p->gated);
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
    // Self-attention: the three share x, one phase.
    if (mha_gemm_one_input(cfg, a->x, a->key, a->value)) {
        const mha_status st = GEMM_MULTI(3, proj, a->x, cfg->Din, w, cfg->packed, bias,
                                         p->nq, S, cfg->Din);
        if (st == MHA_OK && mha_interrupted(cfg))
            return MHA_ERR_INTERRUPTED;
        return st;
    }
    for (int r = 0; r < 3; r++) {
        const mha_status st = GEMM_PACKED(proj[r], S[r], input[r], d_in[r], 0, w[r], S[r],
                                          0, cfg->packed[r], bias[r], rows[r], S[r],
                                          d_in[r], 0);
        if (st != MHA_OK)
            return st;
        if (mha_interrupted(cfg))
            return MHA_ERR_INTERRUPTED;
    }
    return MHA_OK;
}

/* Pass 1b: the q/k transforms (the q/k norm, RoPE) into qt, kt, when on. */
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
        .Svq = p->lay.Svq, .q_bs = p->cfg->Tq * p->lay.Sq,
        .k_bs = p->cfg->Tk * p->lay.Sk, .v_bs = p->cfg->Tk * p->lay.Sv,
        .c_bs = p->cfg->Tq * p->lay.Svq, .qoff = p->off, .cvoff = p->off + H,
        .koff = p->off + 2 * H, .voff = p->off + 2 * H + G, .q = p->qt,
        .k = p->kt, .v = p->v, .cat = p->cat, .weights = a->weights,
        .lse = a->lse,
    };
    return attend(&fctx, mha_kernels_for(mha_get_isa(), MHA_F64), sizeof(REAL), NULL);
}

/* Pass 2b: the output gate, gated = sigmoid(x @ wgate + bgate) * concat,
   into p->gated (core/gate.c), when there is one. */
static mha_status PICK(fwd_pass_gate_f32, fwd_pass_gate_f64)(const FWD_PLAN *p,
                                                             const FWD_ARGS *a)
{
    if (p->gated == NULL)
        return MHA_OK;
    return PICK(mha_gate_forward_f32, mha_gate_forward_f64)(
        p->gated, p->gated, a->x, a->wgate, a->bgate, p->cat, p->pk_gate, p->cfg, p->nq,
        p->cfg->Din, p->lay.Svq);
}

/* Pass 3: out = concat @ wo + bo, or out = concat (+ bo) without W^O;
   concat is the gated one when there is a gate. */
static mha_status PICK(fwd_pass_output_f32, fwd_pass_output_f64)(const FWD_PLAN *p,
                                                                 const FWD_ARGS *a)
{
    const size_t Dout = p->cfg->Dout, Svq = p->lay.Svq;
    // cat: (B, Tq, Svq), what W^O reads.
    const REAL *cat = p->gated != NULL ? p->gated : p->cat;
    if (p->cfg->has_wo)
        return GEMM_PACKED(a->out, Dout, cat, Svq, 0, a->wo, Dout, 0,
                           p->cfg->packed[3], a->bo, p->nq, Dout, Svq, 0);
    if (cat != a->out || a->bo != NULL) {
        for (size_t r = 0; r < p->nq; r++) {
            REAL *out_r = a->out + r * Dout;
            const REAL *cat_r = cat + r * Svq;
            for (size_t c = 0; c < Dout; c++)
                out_r[c] = a->bo ? cat_r[c] + a->bo[c] : cat_r[c];
        }
    }
    return MHA_OK;
}

/* mha_forward (forward.c) for one element type; prm checked by mha_call_typed. */
static mha_status PICK(mha_forward_f32, mha_forward_f64)(const mha_config *cfg,
                                                         const mha_params *prm,
                                                         mha_error *err)
{
    // Shapes: see FWD_ARGS above and mha.h.
    FWD_ARGS a = {prm->out, prm->weights, prm->q, prm->k, prm->v, prm->concat,
                  prm->lse, prm->x, prm->key, prm->value, prm->wq, prm->wk,
                  prm->wv, prm->wo, prm->bq, prm->bk, prm->bv, prm->bo,
                  prm->wgate, prm->bgate};
    FWD_PLAN p;
    fwd_half_weights half = {.w = {NULL}};
    mha_status st = PICK(fwd_plan_f32, fwd_plan_f64)(&p, &a, cfg, err);
    // Half weights (float32 calls alone: mha_call_typed): the GEMMs read
    // their panels, through a copy of the config that carries them.
    if (st == MHA_OK && MHA_DTYPE == MHA_DTYPE_F32 && prm->w_storage != MHA_KV_PLAIN) {
        st = fwd_half_prepare(&half, cfg, &p.lay, prm);
        p.cfg = &half.cfg;
        a.wq = half.w[0], a.wk = half.w[1], a.wv = half.w[2], a.wo = half.w[3];
        a.wgate = half.w[4];
        p.pk_gate = half.pk_gate;
    }
    if (st == MHA_OK)
        st = PICK(fwd_pass_project_f32, fwd_pass_project_f64)(&p, &a);
    if (st == MHA_OK)
        st = PICK(fwd_pass_qk_f32, fwd_pass_qk_f64)(&p);
    if (st == MHA_OK)
        st = PICK(fwd_pass_attend_f32, fwd_pass_attend_f64)(&p, &a);
    if (st == MHA_OK)
        st = PICK(fwd_pass_gate_f32, fwd_pass_gate_f64)(&p, &a);
    if (st == MHA_OK)
        st = PICK(fwd_pass_output_f32, fwd_pass_output_f64)(&p, &a);
    PICK(fwd_plan_free_f32, fwd_plan_free_f64)(&p);
    fwd_half_free(&half);
    return st;
}

/* ---- mha_attend: attention on tensors already projected (mha.h) ---- */

/*
 * Split-K's merge, task t = tile (b, h, query block) as flash_tile_init
 * numbers it: the parts p = 0, 1, ..., nparts - 1 of each row, in that
 * order, into one softmax (flash-decoding), in double:
 *   m = max(sink, max_p m_p),  w_p = exp(m_p - m),
 *   l = exp(sink - m) + sum_p w_p l_p,  o = sum_p w_p o_p,
 *   out = o / l,  lse = m + log l.
 * A part that saw no key (l_p == 0) is skipped; a row that saw none, nor a
 * sink, gets 0 and lse -inf, as flash_tile_finish gives.
 */
static void PICK(attend_merge_task_f32, attend_merge_task_f64)(void *ctxp, size_t t,
                                                               int ith)
{
    (void)ith;
    const mha_flash_ctx *ctx = ctxp;
    const mha_config *cfg = ctx->cfg;
    const size_t H = cfg->H, nqb = ctx->nqb, P = ctx->nparts, BQ = ctx->bq;
    const size_t b = t / (H * nqb), h = t / nqb % H, g = h / (H / cfg->G);
    const size_t i0 = (nqb - 1 - t % nqb) * BQ, dv = cfg->dv[g], dvm = ctx->dv_max;
    const size_t nq = cfg->Tq - i0 < BQ ? cfg->Tq - i0 : BQ;
    // Slots of Tq rows (one block per (b, h), see mha_flash_ctx).
    const size_t R = cfg->Tq;
    const REAL *po = (const REAL *)ctx->part_o + t * P * R * dvm;
    const REAL *pm = (const REAL *)ctx->part_m + t * P * R;
    const REAL *pl = (const REAL *)ctx->part_l + t * P * R;
    REAL *cat_b = (REAL *)ctx->cat + b * ctx->c_bs + ctx->cvoff[h];
    REAL *lse_bh = ctx->lse ? (REAL *)ctx->lse + (b * H + h) * cfg->Tq : NULL;
    const double sink = cfg->sinks ? (double)((const REAL *)cfg->sinks)[h] : -INFINITY;
    double w[MHA_SPLIT_MAX];
    for (size_t r = 0; r < nq; r++) {
        REAL *out_i = cat_b + (i0 + r) * ctx->Svq;
        double m = sink, l = 0;
        for (size_t p = 0; p < P; p++)
            if (pl[p * R + r] != 0 && (double)pm[p * R + r] > m)
                m = (double)pm[p * R + r];
        if (m == -INFINITY) { /* no key seen, no sink */
            for (size_t c = 0; c < dv; c++)
                out_i[c] = 0;
            if (lse_bh)
                lse_bh[i0 + r] = NINF;
            continue;
        }
        if (sink != -INFINITY)
            l = exp(sink - m);
        for (size_t p = 0; p < P; p++) {
            const REAL l_p = pl[p * R + r];
            w[p] = l_p != 0 ? exp((double)pm[p * R + r] - m) : 0;
            l += l_p != 0 ? w[p] * (double)l_p : 0;
        }
        for (size_t c = 0; c < dv; c++) {
            double o = 0;
            for (size_t p = 0; p < P; p++)
                if (w[p] != 0)
                    o += w[p] * (double)po[(p * R + r) * dvm + c];
            out_i[c] = (REAL)(o / l);
        }
        if (lse_bh)
            lse_bh[i0 + r] = (REAL)(m + log(l));
    }
}

/* 1 when the last element of a (B, n, T, d) tensor at strides st lies
   within MHA_MAX_ELEMS of its first (or it has none). */
static int PICK(attend_extent_ok_f32, attend_extent_ok_f64)(const mha_strides *st,
                                                             size_t B, size_t n,
                                                             size_t T, size_t d)
{
    if (B == 0 || n == 0 || T == 0 || d == 0)
        return 1;
    size_t a, e, c;
    if (!mha_mul_ok(&a, B - 1, st->sb) || !mha_mul_ok(&e, n - 1, st->sh) ||
        !mha_add_ok(&a, a, e) || !mha_mul_ok(&c, T - 1, st->st) ||
        !mha_add_ok(&a, a, c) || !mha_add_ok(&a, a, d))
        return 0;
    return a <= MHA_MAX_ELEMS;
}

/* The KV cache storage of mha_attend (mha.h, mha_kv_storage): a known
   kind; half or int8 only on a float32 call (the kernels widen to float32);
   int8 with both scales (when there are keys) and within bounds at their
   strides; the scales with int8 alone. */
static mha_status PICK(attend_check_kv_f32, attend_check_kv_f64)(const mha_params *prm,
                                                                 const mha_config *cfg,
                                                                 mha_error *err)
{
    static const char *const names[] = {"MHA_KV_PLAIN", "MHA_KV_F16", "MHA_KV_BF16",
                                        "MHA_KV_I8"};
    const unsigned kind = (unsigned)prm->kv_storage;
    if (kind > MHA_KV_I8)
        return mha_reject(err, MHA_ERR_ARG, MHA_FIELD_PARAMS,
                          "kv_storage = %u is none of MHA_KV_PLAIN, MHA_KV_F16, "
                          "MHA_KV_BF16, MHA_KV_I8", kind);
    if (kind != MHA_KV_PLAIN && MHA_DTYPE != MHA_DTYPE_F32)
        return mha_reject(err, MHA_ERR_ARG, MHA_FIELD_PARAMS,
                          "kv_storage = %s needs dtype MHA_DTYPE_F32 (the kernels widen "
                          "it to float32), not MHA_DTYPE_F64", names[kind]);
    const int int8 = kind == MHA_KV_I8;
    if (!int8 && (prm->k_scale != NULL || prm->v_scale != NULL))
        return mha_reject(err, MHA_ERR_ARG, MHA_FIELD_PARAMS,
                          "%s is given, but kv_storage = %s holds no int8 (scales are "
                          "MHA_KV_I8's alone)", prm->k_scale != NULL ? "k_scale" : "v_scale",
                          names[kind]);
    if (!int8)
        return MHA_OK;
    const int keys = cfg->B * cfg->Tk != 0;
    if ((prm->k_scale == NULL || prm->v_scale == NULL) && keys)
        return mha_reject(err, MHA_ERR_ARG, MHA_FIELD_PARAMS,
                          "%s is NULL, but kv_storage = MHA_KV_I8 needs it (one scale per "
                          "key and kv head)", prm->k_scale == NULL ? "k_scale" : "v_scale");
    const mha_strides *st[2] = {&prm->sks, &prm->svs};
    // Paged (block_table): the scales are pools of num_pages pages too.
    const int paged = cfg->block_table != NULL;
    const size_t nb = paged ? cfg->num_pages : cfg->B, nt = paged ? cfg->page_size : cfg->Tk;
    for (int i = 0; i < 2; i++)
        if (!PICK(attend_extent_ok_f32, attend_extent_ok_f64)(st[i], nb, cfg->G, nt, 1))
            return mha_reject(err, MHA_ERR_SIZE, MHA_FIELD_PARAMS,
                              "%s at strides (sb, sh, st) = (%zu, %zu, %zu) reaches past "
                              "MHA_MAX_ELEMS", i ? "v_scale" : "k_scale", st[i]->sb,
                              st[i]->sh, st[i]->st);
    return MHA_OK;
}

/* mha_attend's checks: *lc = cfg with the projections' sizes ignored, as
   mha_check_config then checks it; q/k transforms off; every kv head the
   same widths; the buffers there and their extents within bounds. */
static mha_status PICK(attend_check_f32, attend_check_f64)(mha_config *lc,
                                                           const mha_params *prm,
                                                           const mha_config *cfg,
                                                           mha_error *err)
{
    *lc = *cfg;
    lc->Din = lc->Dkin = lc->Dvin = lc->Dout = 0;
    lc->has_wo = 1;
    mha_layout lay;
    mha_status st = mha_check_config_typed(&lay, lc, MHA_DTYPE, err);
    if (st != MHA_OK)
        return st;
    if ((st = mha_check_no_qk(cfg, err)) != MHA_OK)
        return st;
    if ((st = PICK(attend_check_kv_f32, attend_check_kv_f64)(prm, cfg, err)) != MHA_OK)
        return st;
    const size_t dk = cfg->dk[0], dv = cfg->dv[0];
    for (size_t g = 1; g < cfg->G; g++)
        if (cfg->dk[g] != dk || cfg->dv[g] != dv)
            return mha_reject(err, MHA_ERR_ARG, cfg->dk[g] != dk ? MHA_FIELD_DK : MHA_FIELD_DV,
                              "attention alone needs every kv head the same widths: "
                              "dk[%zu] = %zu, dv[%zu] = %zu, dk[0] = %zu, dv[0] = %zu",
                              g, cfg->dk[g], g, cfg->dv[g], dk, dv);
    const size_t B = cfg->B, Tq = cfg->Tq, Tk = cfg->Tk, H = cfg->H, G = cfg->G;
    const mha_required req[] = {
        {prm->out, B * Tq != 0, "out"}, {prm->q, B * Tq != 0, "q"},
        {prm->k, B * Tk != 0, "k"},     {prm->v, B * Tk != 0, "v"},
    };
    if ((st = mha_check_required(req, sizeof req / sizeof req[0], err)) != MHA_OK)
        return st;
    // A paged cache's k and v are pools of num_pages pages of page_size
    // keys (mha.h, block_table), whatever B and Tk.
    const int paged = cfg->block_table != NULL;
    const size_t kB = paged ? cfg->num_pages : B, kT = paged ? cfg->page_size : Tk;
    const struct {
        const mha_strides *st;
        size_t B, n, T, d;
        const char *name;
    } ext[] = {{&prm->sq, B, H, Tq, dk, "q"}, {&prm->so, B, H, Tq, dv, "out"},
               {&prm->sk, kB, G, kT, dk, "k"}, {&prm->sv, kB, G, kT, dv, "v"}};
    for (size_t i = 0; i < sizeof ext / sizeof ext[0]; i++)
        if (!PICK(attend_extent_ok_f32, attend_extent_ok_f64)(ext[i].st, ext[i].B, ext[i].n,
                                                               ext[i].T, ext[i].d))
            return mha_reject(err, MHA_ERR_SIZE, MHA_FIELD_PARAMS,
                              "%s at strides (sb, sh, st) = (%zu, %zu, %zu) reaches past "
                              "MHA_MAX_ELEMS", ext[i].name, ext[i].st->sb, ext[i].st->sh,
                              ext[i].st->st);
    return MHA_OK;
}

/* mha_attend (forward.c) for one element type; prm checked by mha_call_typed. */
static mha_status PICK(mha_attend_f32, mha_attend_f64)(const mha_config *cfg,
                                                       const mha_params *prm,
                                                       mha_error *err)
{
    // out (B, H, Tq, dv) at so; weights (B, H, Tq, Tk), lse (B, H, Tq)
    // contiguous; q (B, H, Tq, dk) at sq; k, v (B, G, Tk, dk | dv) at sk, sv.
    REAL *out = prm->out, *weights = prm->weights, *lse = prm->lse;
    // k, v: elements of prm->kv_storage (REAL, or a cache's half or int8).
    const REAL *q = prm->q;
    const void *k = prm->k, *v = prm->v;
    const mha_strides *sq = &prm->sq, *sk = &prm->sk, *sv = &prm->sv, *so = &prm->so;
    mha_config lc;
    mha_status st = PICK(attend_check_f32, attend_check_f64)(&lc, prm, cfg, err);
    if (st != MHA_OK)
        return st;
    const size_t H = lc.H, G = lc.G;
    size_t *off;
    if ((st = mha_scratch((void **)&off, 2 * (H + G), sizeof *off)) != MHA_OK)
        return st;
    for (size_t h = 0; h < H; h++) {
        off[h] = h * sq->sh;
        off[H + h] = h * so->sh;
    }
    for (size_t g = 0; g < G; g++) {
        off[2 * H + g] = g * sk->sh;
        off[2 * H + G + g] = g * sv->sh;
    }
    mha_flash_ctx fctx = {
        .cfg = &lc, .Sq = sq->st, .Sk = sk->st, .Sv = sv->st, .Svq = so->st,
        .q_bs = sq->sb, .k_bs = sk->sb, .v_bs = sv->sb, .c_bs = so->sb,
        .qoff = off, .cvoff = off + H, .koff = off + 2 * H, .voff = off + 2 * H + G,
        .q = q, .k = k, .v = v, .cat = out, .weights = weights, .lse = lse,
        .decode = weights == NULL,
        .kv_storage = prm->kv_storage, .k_scale = prm->k_scale, .v_scale = prm->v_scale,
        .sks = prm->sks, .svs = prm->svs,
    };
    st = attend(&fctx, mha_kernels_for(mha_get_isa(), MHA_F64), sizeof(REAL),
                PICK(attend_merge_task_f32, attend_merge_task_f64));
    mha_scratch_free(off);
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
    mha_status st = mha_check_config(&lay, cfg, NULL);
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
        .q_bs = cfg->Tq * lay.Sq, .k_bs = cfg->Tk * lay.Sk, .v_bs = cfg->Tk * lay.Sv,
        .c_bs = cfg->Tq * lay.Svq, .qoff = off, .cvoff = off + H, .koff = off + 2 * H, .voff = off + 2 * H + G,
        .q = q, .k = k, .v = v, .cat = cat, .weights = NULL, .lse = lse,
    };
    st = attend(&fctx, mha_kernels_for(mha_get_isa(), MHA_F64), sizeof(REAL), NULL);
    mha_scratch_free(off);
    return st;
}

#undef FWD_ARGS
#undef FWD_PLAN
