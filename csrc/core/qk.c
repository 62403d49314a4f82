/*
 * qk.c - the q/k transforms (contract in mha.h and qk.h): RMSNorm or
 * LayerNorm per head, then RoPE, and their backward. The per-type passes are qk_impl.h,
 * included twice below; what does not depend on the element type (the
 * sides, the positions, the angles, the threads) is here.
 *
 * Plain C compiled once for every ISA, and no a * b + c is contracted
 * (-std=c11 keeps GCC's -ffp-contract=off): the same bits on every ISA
 * path. cos and sin are the C library's, so they are the same on one
 * machine; another libm may differ in the last bit.
 *
 * A row pass goes over the row indices i of a side in blocks of QK_ROWS,
 * one task each, a task owning its rows, so the result does not depend on
 * the thread count. When the positions do not depend on the batch item
 * (the default ones, (T,) positions, or B = 1), index i stands for the
 * rows (b, i) of every b, which share one computation of the angles; and
 * in self-attention with the default positions (Tq = Tk, not packed) a
 * forward task turns q's and k's rows i with the same angles.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "alloc.h"
#include "kernels.h"
#include "mha.h"
#include "qk.h"
#include "rules.h"
#include "sizes.h"
#include "threads.h"

#define QK_ROWS ((size_t)16)     /* rows per task of a row pass          */
#define QK_COLS ((size_t)64)     /* weight columns per task of dw        */
#define QK_SMALL ((size_t)65536) /* fewer elements: the caller's thread  */

int mha_qk_active(const mha_config *cfg, int key)
{
    return (key ? cfg->k_norm : cfg->q_norm) != NULL || cfg->rotary_dim > 0;
}

/* One side of the transform (qk.h): q or k. */
typedef struct {
    const mha_config *cfg;
    size_t T, rows, S;        /* rows = B T of a (B, T, S) buffer        */
    size_t nh, per;           /* heads; head h is dk[h / per] wide       */
    const size_t *off;        /* (nh,) head offsets                      */
    const void *w;            /* the norm's weight or NULL               */
    size_t wstride;           /* 0: one (d,) weight shared by all heads  */
    const int64_t *pos;       /* (B, T) / (T,) positions or NULL         */
    size_t pos_bstride;
    int key;                  /* 1: the k side (key positions)           */
    size_t nidx, nb, rstep;   /* indices i < nidx, each the rows
                                 b rstep + i of b < nb (see above)      */
    int nth;                  /* threads of the row passes               */
    double *cs;               /* per thread: cos, sin of one row's pairs
                                 (rotary_dim), then a head (dk_max)     */
    size_t cs_stride;         /* doubles per thread, a multiple of 8     */
} qk_side;

/* The row indices of a side: i < T standing for rows (b, i) of every b
   when the positions do not depend on b, else one index per row. */
static qk_side qk_side_rows(qk_side s)
{
    const int per_i = s.cfg->B == 1 || s.pos == NULL || s.pos_bstride == 0;
    s.nidx = per_i ? s.T : s.rows;
    s.nb = per_i ? s.cfg->B : 1;
    s.rstep = per_i ? s.T : 0;
    return s;
}

static qk_side qk_side_q(const mha_config *cfg, const mha_layout *lay,
                         const size_t *qoff)
{
    return qk_side_rows((qk_side){
        .cfg = cfg, .T = cfg->Tq, .rows = cfg->B * cfg->Tq, .S = lay->Sq,
        .nh = cfg->H, .per = cfg->H / cfg->G, .off = qoff, .w = cfg->q_norm,
        .wstride = cfg->q_norm_hstride, .pos = cfg->positions,
        .pos_bstride = cfg->positions_bstride, .key = 0,
    });
}

static qk_side qk_side_k(const mha_config *cfg, const mha_layout *lay,
                         const size_t *koff)
{
    return qk_side_rows((qk_side){
        .cfg = cfg, .T = cfg->Tk, .rows = cfg->B * cfg->Tk, .S = lay->Sk,
        .nh = cfg->G, .per = 1, .off = koff, .w = cfg->k_norm,
        .wstride = cfg->k_norm_hstride, .pos = cfg->key_positions,
        .pos_bstride = cfg->key_positions_bstride, .key = 1,
    });
}

/* Width of head h of a side. */
static inline size_t qk_width(const qk_side *s, size_t h)
{
    return s->cfg->dk[h / s->per];
}

/* What the transforms read must be there and fit every head; config.c
   checks the same, this keeps the core safe on its own. */
static mha_status qk_check(const qk_side *s)
{
    const mha_config *cfg = s->cfg;
    if (cfg->rotary_dim % 2 != 0 || (cfg->rotary_dim > 0 && cfg->inv_freq == NULL))
        return MHA_ERR_ARG;
    for (size_t h = 0; h < s->nh; h++) {
        const size_t d = qk_width(s, h);
        if (cfg->rotary_dim > d || (s->w != NULL && d != qk_width(s, 0)))
            return MHA_ERR_ARG;
    }
    if (s->w != NULL && s->wstride != 0 && s->wstride != qk_width(s, 0))
        return MHA_ERR_ARG;
    return MHA_OK;
}

/* The RoPE position of row r (b = r / T, i = r % T) of a side: the
   caller's, or the default one of core/rules.h (packed sequences too). */
static int64_t qk_pos(const qk_side *s, size_t r)
{
    const size_t b = r / s->T, i = r % s->T;
    if (s->pos != NULL)
        return s->pos[b * s->pos_bstride + i];
    return s->key ? mha_rules_key_pos(s->cfg, i) : mha_rules_query_pos(s->cfg, b, i);
}

/* q's and k's rows i have the same positions (self-attention with the
   default ones): a forward task may turn both with one set of angles. */
static int qk_share_angles(const mha_config *cfg)
{
    return cfg->rotary_dim > 0 && cfg->positions == NULL &&
           cfg->key_positions == NULL && cfg->nseq == 0 && cfg->Tq == cfg->Tk &&
           !cfg->lengths_aligned && /* which moves query rows by key_len(b) */
           !cfg->has_q_offset;      /* which moves them by q_offset */
}

/* cs (2 half,) = cos then sin of row r's angles pos inv_freq[c], c < half
   = rotary_dim / 2, in double; once per row index, for every head (and
   batch item) of it. */
static void qk_angles(double *cs, const qk_side *s, size_t r)
{
    const size_t half = s->cfg->rotary_dim / 2;
    const double pos = (double)qk_pos(s, r);
    for (size_t c = 0; c < half; c++) {
        const double ang = pos * s->cfg->inv_freq[c];
        cs[c] = cos(ang);
        cs[half + c] = sin(ang);
    }
}

/* The two features of pair c: (c, c + half), or (2c, 2c + 1) interleaved. */
static inline void qk_pair(size_t *ia, size_t *ib, size_t c, size_t half,
                           int interleaved)
{
    *ia = interleaved ? 2 * c : c;
    *ib = interleaved ? 2 * c + 1 : c + half;
}

/* Threads for ntasks tasks over `elems` elements: one for a small call
   (waking a worker costs more), else at most one per task. Only speed
   depends on this. */
static int qk_threads(size_t ntasks, size_t elems)
{
    int nth = mha_get_num_threads();
    if (nth < 1 || elems < QK_SMALL)
        nth = 1;
    if ((size_t)nth > ntasks)
        nth = ntasks > 0 ? (int)ntasks : 1;
    return nth;
}

/* Runs fn over the blocks of row indices of side s, with each thread's
   scratch allocated here and freed before returning. */
static mha_status qk_run_rows(qk_side *s, mha_task_fn fn, void *ctx)
{
    const size_t ntasks = (s->nidx + QK_ROWS - 1) / QK_ROWS;
    if (ntasks == 0 || s->rows == 0)
        return MHA_OK;
    size_t elems;
    if (!mha_mul_ok(&elems, s->rows, s->S))
        return MHA_ERR_SIZE;
    s->nth = qk_threads(ntasks, elems);
    size_t dmax = 0, ncs;
    for (size_t h = 0; h < s->nh; h++)
        dmax = qk_width(s, h) > dmax ? qk_width(s, h) : dmax;
    // rotary_dim <= dk <= MHA_MAX_ELEMS: the sum cannot overflow.
    s->cs_stride = (s->cfg->rotary_dim + dmax + 7) / 8 * 8 + 8;
    if (!mha_mul_ok(&ncs, (size_t)s->nth, s->cs_stride))
        return MHA_ERR_SIZE;
    mha_status st = mha_scratch((void **)&s->cs, ncs, sizeof(double));
    if (st == MHA_OK)
        st = mha_parallel_for_n(ntasks, s->nth, fn, ctx);
    mha_scratch_free(s->cs);
    s->cs = NULL;
    if (st == MHA_OK && mha_interrupted(s->cfg))
        st = MHA_ERR_INTERRUPTED;
    return st;
}

#define MHA_TEMPLATE "qk_impl.h"
#include "each_type.h"
