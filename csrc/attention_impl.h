/*
 * attention_impl.h - template body of the forward pass; included by
 * attention.c with `real` (float / double), `sfx` (f32 / f64) and `mha_exp`
 * (expf / exp) defined. No include guard on purpose.
 *
 * Legend: see mha.h. Pointers carry the indices they fix: q_bi is row
 * (b, i) of q, s_bhi is the score row of (b, h, i).
 */
#if !defined(real) || !defined(sfx) || !defined(mha_exp)
#error "attention_impl.h needs real, sfx and mha_exp defined"
#endif

/*
 * Pass 2 for one work item (b, h): every query row i of head h in batch b.
 * Work items are independent and write disjoint outputs, so they can later
 * be split across threads by (thread index, thread count).
 *
 *   cat     (B, Tq, Svq)   head output goes to columns cvoff[h] ..
 *   weights (B, H, Tq, Tk) or NULL
 *   lse     (B, H, Tq)     or NULL
 *   q (B, Tq, Sq), k (B, Tk, Sk), v (B, Tk, Sv)
 *   row     (Tk,)          score scratch, used when weights is NULL
 */
static void MHA_CAT(attend_bh, sfx)(real *cat, real *weights, real *lse,
                                    const real *q, const real *k,
                                    const real *v, real *row,
                                    const mha_config *cfg,
                                    const mha_layout *lay,
                                    const size_t *qoff, const size_t *cvoff,
                                    const size_t *koff, const size_t *voff,
                                    size_t b, size_t h)
{
    const size_t Tq = cfg->Tq, Tk = cfg->Tk, H = cfg->H;
    const size_t Sq = lay->Sq, Sk = lay->Sk, Sv = lay->Sv, Svq = lay->Svq;
    const size_t g = h / (H / cfg->G);
    const size_t dkg = cfg->dk[g], dvg = cfg->dv[g];
    const real sc = (real)cfg->scale[h];
    const real ninf = (real)-INFINITY;

    // Keys j >= len_b are padding: never scored, weight 0.
    size_t len_b = Tk;
    if (cfg->key_lengths != NULL) {
        const int64_t len = cfg->key_lengths[b];
        len_b = len < 0 ? 0 : ((uint64_t)len < (uint64_t)Tk ? (size_t)len : Tk);
    }

    for (size_t i = 0; i < Tq; i++) {
        // One (b, h) item can take seconds at long sequences: poll the
        // caller's interrupt flag per query row (the caller sees it too).
        if (interrupted(cfg))
            return;
        const real *q_bi = q + (b * Tq + i) * Sq + qoff[h];   // (dkg,)
        real *o_bi = cat + (b * Tq + i) * Svq + cvoff[h];     // (dvg,)
        real *s_bhi = weights ? weights + ((b * H + h) * Tq + i) * Tk : row;

        // 2a. visible keys are j < jend: key length, then causality. The
        //     causal bound i + Tk - Tq is signed: when Tk < Tq the first rows
        //     see no key at all.
        size_t jend = len_b;
        if (cfg->causal) {
            const ptrdiff_t last = (ptrdiff_t)i + (ptrdiff_t)Tk - (ptrdiff_t)Tq;
            if (last < 0)
                jend = 0;
            else if ((size_t)last + 1 < jend)
                jend = (size_t)last + 1;
        }

        // 2b. scaled, masked scores and their maximum. A NaN score makes the
        //     maximum NaN (sticky), so it propagates to the row's output
        //     instead of being mistaken for a fully masked row.
        ptrdiff_t m_bhi = 0;
        if (cfg->mask_kind != MHA_MASK_NONE)
            m_bhi = (ptrdiff_t)b * cfg->mask_stride[0] +
                    (ptrdiff_t)h * cfg->mask_stride[1] +
                    (ptrdiff_t)i * cfg->mask_stride[2];
        const ptrdiff_t mj = cfg->mask_stride[3];
        real mx = ninf;
        for (size_t j = 0; j < jend; j++) {
            const real *k_bj = k + (b * Tk + j) * Sk + koff[g];   // (dkg,)
            real dot = 0;
            for (size_t d = 0; d < dkg; d++)
                dot += q_bi[d] * k_bj[d];
            real s = sc * dot;
            if (cfg->mask_kind == MHA_MASK_BOOL) {
                const uint8_t *mask_u8 = (const uint8_t *)cfg->mask;
                if (mask_u8[m_bhi + (ptrdiff_t)j * mj] == 0)
                    s = ninf;
            } else if (cfg->mask_kind == MHA_MASK_ADD) {
                const real *mask_r = (const real *)cfg->mask;
                s += mask_r[m_bhi + (ptrdiff_t)j * mj];
            }
            s_bhi[j] = s;
            if (s > mx || s != s)
                mx = s;
        }

        // 2c. a fully masked row (every key blocked, or Tk == 0) attends to
        //     nothing: weights 0, head output 0, lse -inf.
        if (mx == ninf) {
            if (weights)
                for (size_t j = 0; j < Tk; j++)
                    s_bhi[j] = 0;
            for (size_t d = 0; d < dvg; d++)
                o_bi[d] = 0;
            if (lse)
                lse[(b * H + h) * Tq + i] = ninf;
            continue;
        }

        // 2d. softmax. The sum is accumulated in double, in key order, so it
        //     is deterministic and accurate for float32 as well.
        double sum = 0.0;
        for (size_t j = 0; j < jend; j++) {
            const real p = mha_exp(s_bhi[j] - mx);
            s_bhi[j] = p;
            sum += (double)p;
        }
        for (size_t j = 0; j < jend; j++)
            s_bhi[j] = (real)((double)s_bhi[j] / sum);
        for (size_t j = jend; j < Tk; j++)
            s_bhi[j] = 0;
        if (lse)
            lse[(b * H + h) * Tq + i] = (real)((double)mx + log(sum));

        // 2e. head output = weights @ v over the visible keys, accumulated
        //     in key order. A key of weight exactly 0 (blocked by the mask,
        //     or underflowed) adds nothing: 0 * inf would make the row NaN
        //     from a value the row does not attend to.
        for (size_t d = 0; d < dvg; d++)
            o_bi[d] = 0;
        for (size_t j = 0; j < jend; j++) {
            const real w = s_bhi[j];
            if (w == 0)
                continue;
            const real *v_bj = v + (b * Tk + j) * Sv + voff[g];   // (dvg,)
            for (size_t d = 0; d < dvg; d++)
                o_bi[d] += w * v_bj[d];
        }
    }
}

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
    real *q_s = NULL, *k_s = NULL, *v_s = NULL, *cat_s = NULL, *row = NULL;
    size_t *off = NULL;   // (2H + 2G,): qoff, cvoff, koff, voff
    if ((st = scratch_alloc((void **)&off, 2 * (H + G), sizeof *off)) != MHA_OK)
        goto fail;
    if (q == NULL) {
        if ((st = scratch_alloc((void **)&q_s, nq * Sq, sizeof(real))) != MHA_OK)
            goto fail;
        q = q_s;   // q: (B, Tq, Sq)
    }
    if (k == NULL) {
        if ((st = scratch_alloc((void **)&k_s, nk * Sk, sizeof(real))) != MHA_OK)
            goto fail;
        k = k_s;   // k: (B, Tk, Sk)
    }
    if (v == NULL) {
        if ((st = scratch_alloc((void **)&v_s, nk * Sv, sizeof(real))) != MHA_OK)
            goto fail;
        v = v_s;   // v: (B, Tk, Sv)
    }
    // Without W^O the heads can be written straight into out (Dout == Svq).
    real *cat = concat;   // cat: (B, Tq, Svq)
    if (cat == NULL) {
        if (!cfg->has_wo) {
            cat = out;
        } else {
            if ((st = scratch_alloc((void **)&cat_s, nq * Svq, sizeof(real))) != MHA_OK)
                goto fail;
            cat = cat_s;
        }
    }
    if (weights == NULL) {
        if ((st = scratch_alloc((void **)&row, Tk, sizeof(real))) != MHA_OK)
            goto fail;   // row: (Tk,)
    }
    size_t *qoff = off, *cvoff = off + H, *koff = off + 2 * H;
    size_t *voff = off + 2 * H + G;
    head_offsets(qoff, cvoff, koff, voff, cfg);

    // 1. projections: q = x @ wq + bq, k = key @ wk + bk, v = value @ wv + bv.
    //    The interrupt flag is polled between stages (a GEMM is not split).
    if ((st = MHA_CAT(mha_gemm, sfx)(q, Sq, x, cfg->Din, 0, wq, Sq, 0, bq,
                                     nq, Sq, cfg->Din, 0)) != MHA_OK)
        goto fail;
    if (interrupted(cfg))
        goto interrupt;
    if ((st = MHA_CAT(mha_gemm, sfx)(k, Sk, key, cfg->Dkin, 0, wk, Sk, 0, bk,
                                     nk, Sk, cfg->Dkin, 0)) != MHA_OK)
        goto fail;
    if (interrupted(cfg))
        goto interrupt;
    if ((st = MHA_CAT(mha_gemm, sfx)(v, Sv, value, cfg->Dvin, 0, wv, Sv, 0, bv,
                                     nk, Sv, cfg->Dvin, 0)) != MHA_OK)
        goto fail;

    // 2. attention per (b, h): scores, mask, softmax, weighted values. With
    //    no query row (Tq == 0 or B == 0) there is nothing to do, however
    //    large B * H is.
    const size_t items = nq == 0 ? 0 : B * H;
    for (size_t bh = 0; bh < items; bh++) {
        if (interrupted(cfg))
            goto interrupt;
        MHA_CAT(attend_bh, sfx)(cat, weights, lse, q, k, v, row, cfg, &lay,
                                qoff, cvoff, koff, voff, bh / H, bh % H);
    }
    if (interrupted(cfg))   // the last item may have stopped early
        goto interrupt;

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
    free(row);
    return st;
}
