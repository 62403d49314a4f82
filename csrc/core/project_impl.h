/*
 * project_impl.h - mha_project, once per element type; included by
 * project.c with MHA_F64 defined (0 float, 1 double) and PICK naming each
 * function in full. No include guard on purpose.
 *
 * Legend: see mha.h.
 *   1. projections: q = x wq + bq, k = key wk + bk, v = value wv + bv
 *      (one GEMM each, as the forward's fwd_pass_project)
 *  1b. q/k transforms, when on: q = RoPE(norm(q)), k likewise (the norm
 *      RMSNorm or LayerNorm)
 *      (mha_qk_forward, as the forward's fwd_pass_qk), from scratch copies
 *      of the raw projections into the caller's q, k
 * A NULL output is not computed; with a q/k transform on, q and k are
 * computed together when either is wanted (one task of mha_qk_forward may
 * turn both sides' rows), the unwanted one into scratch.
 */
#if !defined(MHA_F64)
#error "project_impl.h needs MHA_F64"
#endif
#include "dtype.h"

/* mha_project (project.c) for one element type; prm checked by mha_call_typed. */
static mha_status PICK(mha_project_f32, mha_project_f64)(const mha_config *cfg,
                                                         const mha_params *prm,
                                                         mha_error *err)
{
    // q (B, Tq, Sq), k (B, Tk, Sk), v (B, Tk, Sv); x (B, Tq, Din),
    // key (B, Tk, Dkin), value (B, Tk, Dvin); wq (Din, Sq), wk (Dkin, Sk),
    // wv (Dvin, Sv); bq (Sq,), bk (Sk,), bv (Sv,) or NULL.
    REAL *q = prm->q, *k = prm->k, *v = prm->v;
    const REAL *x = prm->x, *key = prm->key, *value = prm->value;
    const REAL *wq = prm->wq, *wk = prm->wk, *wv = prm->wv;
    const REAL *bq = prm->bq, *bk = prm->bk, *bv = prm->bv;
    mha_layout lay;
    mha_status st = mha_check_config_typed(&lay, cfg, MHA_DTYPE, err);
    if (st != MHA_OK)
        return st;
    const REAL *input[3] = {x, key, value}, *w[3] = {wq, wk, wv}, *bias[3] = {bq, bk, bv};
    REAL *dst[3] = {q, k, v};
    const size_t rows[3] = {cfg->B * cfg->Tq, cfg->B * cfg->Tk, cfg->B * cfg->Tk};
    const size_t d_in[3] = {cfg->Din, cfg->Dkin, cfg->Dvin};
    const size_t S[3] = {lay.Sq, lay.Sk, lay.Sv};
    static const char *const in_name[3] = {"x", "key", "value"};
    static const char *const w_name[3] = {"wq", "wk", "wv"};
    const int qk_on = mha_qk_active(cfg, 0) || mha_qk_active(cfg, 1);
    int need[3];
    for (int r = 0; r < 3; r++) {
        need[r] = dst[r] != NULL || (r < 2 && qk_on && (q != NULL || k != NULL));
        const mha_required req[2] = {
            {input[r], need[r] && rows[r] * d_in[r] != 0, in_name[r]},
            {w[r], need[r] && d_in[r] != 0, w_name[r]},
        };
        if ((st = mha_check_required(req, 2, err)) != MHA_OK)
            return st;
    }
    // raw[r]: where projection r goes; scratch[r] holds what is ours of
    // it, scratch[3 + r] an unwanted side's transformed copy.
    REAL *raw[3] = {q, k, v}, *scratch[5] = {NULL, NULL, NULL, NULL, NULL};
    size_t *off = NULL;
    for (int r = 0; r < 2 && qk_on && st == MHA_OK; r++) {
        if (!need[r])
            continue;
        if (dst[r] == NULL) {   // unwanted, but turned with the other side
            st = mha_scratch((void **)&scratch[3 + r], rows[r] * S[r], sizeof(REAL));
            dst[r] = scratch[3 + r];
        }
        if (st == MHA_OK && mha_qk_active(cfg, r))
            st = mha_scratch((void **)&scratch[r], rows[r] * S[r], sizeof(REAL));
        raw[r] = scratch[r] != NULL ? scratch[r] : dst[r];
    }
    // All three of one input (a cached step): one phase.
    const int joint = need[0] && need[1] && need[2] && mha_gemm_one_input(cfg, x, key, value);
    if (joint && st == MHA_OK) {
        st = GEMM_MULTI(3, raw, x, cfg->Din, w, cfg->packed, bias, rows[0], S, cfg->Din);
        if (st == MHA_OK && mha_interrupted(cfg))
            st = MHA_ERR_INTERRUPTED;
    }
    for (int r = 0; r < 3 && st == MHA_OK && !joint; r++) {
        if (!need[r])
            continue;
        st = GEMM_PACKED(raw[r], S[r], input[r], d_in[r], 0, w[r], S[r], 0,
                         cfg->packed[r], bias[r], rows[r], S[r], d_in[r], 0);
        if (st == MHA_OK && mha_interrupted(cfg))
            st = MHA_ERR_INTERRUPTED;
    }
    if (st == MHA_OK && qk_on && (need[0] || need[1])) {
        const size_t H = cfg->H, G = cfg->G;
        st = mha_scratch((void **)&off, 2 * (H + G), sizeof *off);
        if (st == MHA_OK) {
            mha_head_offsets(off, off + H, off + 2 * H, off + 2 * H + G, cfg);
            st = PICK(mha_qk_forward_f32, mha_qk_forward_f64)(
                mha_qk_active(cfg, 0) ? dst[0] : NULL,
                mha_qk_active(cfg, 1) ? dst[1] : NULL, raw[0], raw[1], cfg, &lay,
                off, off + 2 * H);
        }
    }
    mha_scratch_free(off);
    for (int i = 0; i < 5; i++)
        mha_scratch_free(scratch[i]);
    return st;
}
