/*
 * attention_impl.h - template body of the forward pass; included by
 * attention.c with `real` (float / double) and `sfx` (f32 / f64) defined.
 * No include guard on purpose.
 *
 * Legend: see mha.h. Pass 2, the attention itself, is the fused kernel of
 * flash.h, run by attend() in attention.c.
 */
#if !defined(real) || !defined(sfx)
#error "attention_impl.h needs real and sfx defined"
#endif

mha_status MHA_CAT(mha_forward, sfx)(
    real *out, real *weights, real *q, real *k, real *v, real *concat,
    real *lse,
    const real *x, const real *key, const real *value,
    const real *wq, const real *wk, const real *wv, const real *wo,
    const real *bq, const real *bk, const real *bv, const real *bo,
    const mha_config *cfg)
{
    // out     (B, Tq, Dout)     weights (B, H, Tq, Tk)    lse (B, H, Tq)
    // q       (B, Tq, Sq)       k       (B, Tk, Sk)       v   (B, Tk, Sv)
    // concat  (B, Tq, Svq)
    // x (B, Tq, Din), key (B, Tk, Dkin), value (B, Tk, Dvin)
    // wq (Din, Sq), wk (Dkin, Sk), wv (Dvin, Sv), wo (Svq, Dout)
    // bq (Sq,), bk (Sk,), bv (Sv,), bo (Dout,)
    mha_layout lay;
    mha_status st = mha_check_config(&lay, cfg);
    if (st != MHA_OK)
        return st;
    const size_t B = cfg->B, Tq = cfg->Tq, Tk = cfg->Tk, H = cfg->H;
    const size_t G = cfg->G, Dout = cfg->Dout;
    const size_t Sq = lay.Sq, Sk = lay.Sk, Sv = lay.Sv, Svq = lay.Svq;
    const size_t nq = B * Tq, nk = B * Tk;   // rows of the projections

    // Required buffers may only be NULL when they hold no element.
    if ((out == NULL && nq * Dout != 0) ||
        (x == NULL && nq * cfg->Din != 0) ||
        (key == NULL && nk * cfg->Dkin != 0) ||
        (value == NULL && nk * cfg->Dvin != 0) ||
        (wq == NULL && cfg->Din != 0) || (wk == NULL && cfg->Dkin != 0) ||
        (wv == NULL && cfg->Dvin != 0) || (cfg->has_wo && wo == NULL))
        return MHA_ERR_ARG;

    // All scratch, allocated here and freed at fail:.
    real *q_s = NULL, *k_s = NULL, *v_s = NULL, *cat_s = NULL;
    size_t *off = NULL;   // (2H + 2G,): qoff, cvoff, koff, voff
    if ((st = mha_scratch((void **)&off, 2 * (H + G), sizeof *off)) != MHA_OK)
        goto fail;
    if (q == NULL) {
        if ((st = mha_scratch((void **)&q_s, nq * Sq, sizeof(real))) != MHA_OK)
            goto fail;
        q = q_s;   // q: (B, Tq, Sq)
    }
    if (k == NULL) {
        if ((st = mha_scratch((void **)&k_s, nk * Sk, sizeof(real))) != MHA_OK)
            goto fail;
        k = k_s;   // k: (B, Tk, Sk)
    }
    if (v == NULL) {
        if ((st = mha_scratch((void **)&v_s, nk * Sv, sizeof(real))) != MHA_OK)
            goto fail;
        v = v_s;   // v: (B, Tk, Sv)
    }
    // Without W^O the heads can be written straight into out (Dout == Svq).
    real *cat = concat;   // cat: (B, Tq, Svq)
    if (cat == NULL) {
        if (!cfg->has_wo) {
            cat = out;
        } else {
            if ((st = mha_scratch((void **)&cat_s, nq * Svq, sizeof(real))) != MHA_OK)
                goto fail;
            cat = cat_s;
        }
    }
    size_t *qoff = off, *cvoff = off + H, *koff = off + 2 * H;
    size_t *voff = off + 2 * H + G;
    mha_head_offsets(qoff, cvoff, koff, voff, cfg);

    // 1. projections: q = x @ wq + bq, k = key @ wk + bk, v = value @ wv + bv.
    //    The interrupt flag is polled between stages (a GEMM is not split)
    //    and by every attention tile.
    if ((st = MHA_CAT(mha_gemm, sfx)(q, Sq, x, cfg->Din, 0, wq, Sq, 0, bq,
                                     nq, Sq, cfg->Din, 0)) != MHA_OK)
        goto fail;
    if (mha_interrupted(cfg))
        goto interrupt;
    if ((st = MHA_CAT(mha_gemm, sfx)(k, Sk, key, cfg->Dkin, 0, wk, Sk, 0, bk,
                                     nk, Sk, cfg->Dkin, 0)) != MHA_OK)
        goto fail;
    if (mha_interrupted(cfg))
        goto interrupt;
    if ((st = MHA_CAT(mha_gemm, sfx)(v, Sv, value, cfg->Dvin, 0, wv, Sv, 0, bv,
                                     nk, Sv, cfg->Dvin, 0)) != MHA_OK)
        goto fail;
    if (mha_interrupted(cfg))
        goto interrupt;

    // 2. attention: one fused pass per tile (b, h, query block) with the
    //    online softmax; no (Tq, Tk) buffer unless weights are wanted.
    {
        mha_flash_ctx fctx = {
            .cfg = cfg, .Sq = Sq, .Sk = Sk, .Sv = Sv, .Svq = Svq,
            .qoff = qoff, .cvoff = cvoff, .koff = koff, .voff = voff,
            .q = q, .k = k, .v = v, .cat = cat, .weights = weights,
            .lse = lse,
        };
        st = attend(&fctx, mha_kernels_for(mha_get_isa(), sizeof(real) == sizeof(double)));
        if (st != MHA_OK)
            goto fail;
    }

    // 3. output: out = concat @ wo + bo, or out = concat (+ bo) without W^O.
    if (cfg->has_wo) {
        st = MHA_CAT(mha_gemm, sfx)(out, Dout, cat, Svq, 0, wo, Dout, 0, bo,
                                    nq, Dout, Svq, 0);
        if (st != MHA_OK)
            goto fail;
    } else if (cat != out || bo != NULL) {
        for (size_t r = 0; r < nq; r++) {
            real *out_r = out + r * Dout;
            const real *cat_r = cat + r * Svq;
            for (size_t c = 0; c < Dout; c++)
                out_r[c] = bo ? cat_r[c] + bo[c] : cat_r[c];
        }
    }
    st = MHA_OK;
    goto fail;   // success shares the cleanup

interrupt:
    st = MHA_ERR_INTERRUPTED;
fail:
    free(off);
    free(q_s);
    free(k_s);
    free(v_s);
    free(cat_s);
    return st;
}
