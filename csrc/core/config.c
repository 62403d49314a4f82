/*
 * config.c - the checks of a call's sizes and options, and the head
 * offsets (contract in mha.h). Every size the core allocates or indexes
 * with is checked here, once, before any driver runs.
 *
 * Letters (see mha.h): B batch, Tq queries, Tk keys, H query heads, G kv
 * heads, dk[g] / dv[g] head widths, Sq / Sk / Sv / Svq fused widths.
 * Element counts are bounded by MHA_MAX_ELEMS (mha.h), so that byte sizes
 * of float and double buffers fit in size_t and pointer differences, and
 * Tq, Tk can be used in signed ptrdiff_t arithmetic without overflow.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "mha.h"

/* *r = a * b; returns 0 when the product exceeds MHA_MAX_ELEMS. */
static int mul_ok(size_t *r, size_t a, size_t b)
{
    if (a != 0 && b > MHA_MAX_ELEMS / a)
        return 0;
    *r = a * b;
    return 1;
}

/* *r = a + b; returns 0 when the sum exceeds MHA_MAX_ELEMS. */
static int add_ok(size_t *r, size_t a, size_t b)
{
    if (a > MHA_MAX_ELEMS || b > MHA_MAX_ELEMS - a)
        return 0;
    *r = a + b;
    return 1;
}

/* Returns 1 when a * b * c * d <= MHA_MAX_ELEMS. A zero factor makes the
   product 0 whatever the others are (an empty batch is valid). */
static int count_ok(size_t a, size_t b, size_t c, size_t d)
{
    size_t r;
    if (a == 0 || b == 0 || c == 0 || d == 0)
        return 1;
    return mul_ok(&r, a, b) && mul_ok(&r, r, c) && mul_ok(&r, r, d);
}

/* Packed offsets cu (nseq + 1,): cu[0] = 0, nondecreasing, cu[nseq] = n. */
static int cu_ok(const int64_t *cu, size_t nseq, size_t n)
{
    if (cu == NULL || cu[0] != 0)
        return 0;
    for (size_t s = 0; s < nseq; s++)
        if (cu[s + 1] < cu[s])
            return 0;
    return (uint64_t)cu[nseq] == (uint64_t)n;
}

/* The variants (mha.h): window, softcap, ALiBi, packed sequences,
   lengths_aligned. */
static int variants_ok(const mha_config *cfg)
{
    if (!cfg->windowed && (cfg->window_left != 0 || cfg->window_right != 0))
        return 0;
    if (!(cfg->softcap >= 0) || !isfinite(cfg->softcap))
        return 0;
    if (cfg->alibi_bstride != 0 && (cfg->alibi == NULL || cfg->alibi_bstride != cfg->H))
        return 0;
    if (cfg->nseq > 0 &&
        (cfg->B != 1 || cfg->nseq > MHA_MAX_ELEMS ||
         !cu_ok(cfg->cu_q, cfg->nseq, cfg->Tq) || !cu_ok(cfg->cu_k, cfg->nseq, cfg->Tk)))
        return 0;
    // Packed sequences place their queries by their own sequence's keys:
    // lengths_aligned (a KV cache's batch items) has no meaning with them.
    if (cfg->lengths_aligned && cfg->nseq > 0)
        return 0;
    return 1;
}

/* The q/k transforms (mha.h): RMSNorm and RoPE, their positions. */
static int transforms_ok(const mha_config *cfg)
{
    const size_t G = cfg->G, d = cfg->dk[0];
    if (cfg->rotary_dim % 2 != 0 || (cfg->rotary_dim > 0 && cfg->inv_freq == NULL))
        return 0;
    if (cfg->rope_interleaved != 0 && cfg->rope_interleaved != 1)
        return 0;
    for (size_t g = 0; g < G; g++) {
        if (cfg->rotary_dim > cfg->dk[g])
            return 0;
        if ((cfg->q_norm != NULL || cfg->k_norm != NULL) && cfg->dk[g] != d)
            return 0;
    }
    if ((cfg->q_norm_hstride != 0 && (cfg->q_norm == NULL || cfg->q_norm_hstride != d)) ||
        (cfg->k_norm_hstride != 0 && (cfg->k_norm == NULL || cfg->k_norm_hstride != d)))
        return 0;
    if (!(cfg->norm_eps >= 0) || !isfinite(cfg->norm_eps))
        return 0;
    if ((cfg->positions_bstride != 0 && cfg->positions_bstride != cfg->Tq) ||
        (cfg->key_positions_bstride != 0 && cfg->key_positions_bstride != cfg->Tk))
        return 0;
    return 1;
}

mha_status mha_check_config(mha_layout *lay, const mha_config *cfg)
{
    if (lay == NULL || cfg == NULL)
        return MHA_ERR_ARG;
    const size_t B = cfg->B, Tq = cfg->Tq, Tk = cfg->Tk;
    const size_t H = cfg->H, G = cfg->G;

    if (H == 0 || G == 0 || H % G != 0)
        return MHA_ERR_ARG;
    if (cfg->dk == NULL || cfg->dv == NULL || cfg->scale == NULL)
        return MHA_ERR_ARG;
    if (cfg->mask_kind != MHA_MASK_NONE && cfg->mask_kind != MHA_MASK_BOOL &&
        cfg->mask_kind != MHA_MASK_ADD)
        return MHA_ERR_ARG;
    if (cfg->mask_kind != MHA_MASK_NONE && cfg->mask == NULL)
        return MHA_ERR_ARG;

    // Fused widths. Each head is at least one column wide.
    size_t Sq = 0, Sk = 0, Sv = 0, Svq = 0;
    for (size_t g = 0; g < G; g++) {
        if (cfg->dk[g] == 0 || cfg->dv[g] == 0)
            return MHA_ERR_ARG;
        if (!add_ok(&Sk, Sk, cfg->dk[g]) || !add_ok(&Sv, Sv, cfg->dv[g]))
            return MHA_ERR_SIZE;
    }
    const size_t per_kv = H / G;
    for (size_t h = 0; h < H; h++) {
        const size_t g = h / per_kv;
        if (!add_ok(&Sq, Sq, cfg->dk[g]) || !add_ok(&Svq, Svq, cfg->dv[g]))
            return MHA_ERR_SIZE;
    }
    if (!cfg->has_wo && cfg->Dout != Svq)
        return MHA_ERR_ARG;

    // Every size used to allocate or index a buffer (element counts).
    const size_t one = 1;
    size_t tmp;
    if (Tq > MHA_MAX_ELEMS || Tk > MHA_MAX_ELEMS || B > MHA_MAX_ELEMS ||
        cfg->Din > MHA_MAX_ELEMS || cfg->Dkin > MHA_MAX_ELEMS ||
        cfg->Dvin > MHA_MAX_ELEMS || cfg->Dout > MHA_MAX_ELEMS ||
        !add_ok(&tmp, H, G) || !mul_ok(&tmp, tmp, 2) ||          // offsets
        !count_ok(B, Tq, cfg->Din, one) ||                        // x
        !count_ok(B, Tk, cfg->Dkin, one) ||                       // key
        !count_ok(B, Tk, cfg->Dvin, one) ||                       // value
        !count_ok(cfg->Din, Sq, one, one) ||                      // wq
        !count_ok(cfg->Dkin, Sk, one, one) ||                     // wk
        !count_ok(cfg->Dvin, Sv, one, one) ||                     // wv
        !count_ok(Svq, cfg->Dout, one, one) ||                    // wo
        !count_ok(B, Tq, Sq, one) ||                              // q
        !count_ok(B, Tk, Sk, one) ||                              // k
        !count_ok(B, Tk, Sv, one) ||                              // v
        !count_ok(B, Tq, Svq, one) ||                             // concat
        !count_ok(B, H, Tq, Tk) ||                                // weights
        !count_ok(B, H, Tq, one) ||                               // lse
        !count_ok(B, Tq, cfg->Dout, one))                         // out
        return MHA_ERR_SIZE;

    if (!variants_ok(cfg) || !transforms_ok(cfg))
        return MHA_ERR_ARG;
    if (cfg->key_lengths != NULL) {
        for (size_t b = 0; b < B; b++) {
            const int64_t len = cfg->key_lengths[b];
            if (len < 0 || (uint64_t)len > (uint64_t)Tk)
                return MHA_ERR_ARG;
        }
    }

    lay->Sq = Sq;
    lay->Sk = Sk;
    lay->Sv = Sv;
    lay->Svq = Svq;
    return MHA_OK;
}

/*
 * Column offsets of every head in the fused buffers:
 *   qoff[h]  = sum_{h' < h} dk[h' / (H/G)]   in q      (B, Tq, Sq)
 *   cvoff[h] = sum_{h' < h} dv[h' / (H/G)]   in concat (B, Tq, Svq)
 *   koff[g]  = sum_{g' < g} dk[g']           in k      (B, Tk, Sk)
 *   voff[g]  = sum_{g' < g} dv[g']           in v      (B, Tk, Sv)
 * The sums were checked by mha_check_config.
 */
void mha_head_offsets(size_t *qoff, size_t *cvoff, size_t *koff,
                      size_t *voff, const mha_config *cfg)
{
    const size_t per_kv = cfg->H / cfg->G;
    size_t a = 0, c = 0;
    for (size_t h = 0; h < cfg->H; h++) {
        qoff[h] = a;
        cvoff[h] = c;
        a += cfg->dk[h / per_kv];
        c += cfg->dv[h / per_kv];
    }
    a = 0;
    c = 0;
    for (size_t g = 0; g < cfg->G; g++) {
        koff[g] = a;
        voff[g] = c;
        a += cfg->dk[g];
        c += cfg->dv[g];
    }
}
