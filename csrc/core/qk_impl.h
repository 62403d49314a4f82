/*
 * qk_impl.h - the q/k transforms, once per element type; included by qk.c
 * with MHA_F64 defined (0 float, 1 double). No include guard on purpose.
 *
 * Legend: see mha.h and qk.h. Per side (q, then k):
 *   forward   1b. t = RoPE(norm(x)) per row and head (qk_fwd_task)
 *   backward  A. g = RoPE^T(g): the rotation by -angle, in place; r (and
 *                LayerNorm's mean m) saved
 *             B. dw = sum over rows (and heads, when w is shared) of
 *                g xhat, per weight column, rows in increasing order
 *             C. g = r (g w - xhat mean(g w xhat)), in place (RMSNorm);
 *                g = r (g w - mean(g w) - xhat mean(g w xhat)) (LayerNorm)
 * with g the gradient (rows, S): dL/dt on entry, dL/dx on return, and
 * xhat = x r (RMSNorm) or (x - m) r (LayerNorm). Every sum is in double
 * (for float32 too, so that a long row's mean is not the error's main
 * source) in increasing index order. The RMSNorm's code is its own: a
 * LayerNorm call takes the branches marked for it, and an RMSNorm call
 * computes exactly what it computed before LayerNorm joined it.
 */
#if !defined(MHA_F64)
#error "qk_impl.h needs MHA_F64"
#endif
#include "dtype.h"

/* The names this template defines, bound to this type (dtype.h). */
#define QK_CTX PICK(qk_ctx_t_f32, qk_ctx_t_f64)
#define qk_rinv PICK(qk_rinv_f32, qk_rinv_f64)
#define qk_layer_stats PICK(qk_layer_stats_f32, qk_layer_stats_f64)
#define qk_head_fwd PICK(qk_head_fwd_f32, qk_head_fwd_f64)
#define qk_weight PICK(qk_weight_f32, qk_weight_f64)
#define qk_fwd_index PICK(qk_fwd_index_f32, qk_fwd_index_f64)
#define qk_fwd_task PICK(qk_fwd_task_f32, qk_fwd_task_f64)
#define mha_qk_forward PICK(mha_qk_forward_f32, mha_qk_forward_f64)
#define qk_head_norm_bwd PICK(qk_head_norm_bwd_f32, qk_head_norm_bwd_f64)
#define qk_head_layer_bwd PICK(qk_head_layer_bwd_f32, qk_head_layer_bwd_f64)
#define qk_head_unseen PICK(qk_head_unseen_f32, qk_head_unseen_f64)
#define qk_bwd_rows_task PICK(qk_bwd_rows_task_f32, qk_bwd_rows_task_f64)
#define qk_bwd_norm_task PICK(qk_bwd_norm_task_f32, qk_bwd_norm_task_f64)
#define qk_dw_task PICK(qk_dw_task_f32, qk_dw_task_f64)
#define qk_bwd_side PICK(qk_bwd_side_f32, qk_bwd_side_f64)
#define mha_qk_backward PICK(mha_qk_backward_f32, mha_qk_backward_f64)

/* What the tasks of one side read; shared read-only but for the rows (and
   weight columns) each task owns. */
typedef struct {
    qk_side s;
    REAL *dst;        /* forward: t (rows, S); backward: g, in place  */
    const REAL *x;    /* (rows, S): the raw projection                */
    double *rinv;     /* backward with the norm: (rows, nh) r values  */
    double *mean;     /* backward with LayerNorm: (rows, nh) means m,
                         else NULL                                    */
    REAL *dw;         /* backward: the weight's gradient or NULL      */
    int fuse;         /* backward: pass C inside pass A's task        */
    const void *also; /* forward: the k side's QK_CTX, turned by q's
                         tasks with the same angles (qk_share_angles) */
} QK_CTX;

/* r = 1 / sqrt(mean(x^2) + eps) over one head's d features, the sum in
   double in one fixed order: four partial sums over c mod 4 (for speed:
   four independent chains), then (s0 + s1) + (s2 + s3). The forward's r
   and the backward's are bitwise the same. */
static double qk_rinv(const REAL *x, size_t d, double eps)
{
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t c = 0;
    for (; c + 4 <= d; c += 4) {
        s0 += (double)x[c] * (double)x[c];
        s1 += (double)x[c + 1] * (double)x[c + 1];
        s2 += (double)x[c + 2] * (double)x[c + 2];
        s3 += (double)x[c + 3] * (double)x[c + 3];
    }
    for (; c < d; c++)
        s0 += (double)x[c] * (double)x[c];
    return 1.0 / sqrt(((s0 + s1) + (s2 + s3)) / (double)d + eps);
}

/* LayerNorm's statistics of one head's d features: *m = mean(x) and the
   returned r = 1 / sqrt(mean((x - m)^2) + eps), the biased (population)
   variance, computed from the deviations (two passes: no cancellation, as
   E[x^2] - m^2 would have for a large mean). Each sum in double in one
   fixed order, as qk_rinv's: the forward's m, r and the backward's are
   bitwise the same. */
static double qk_layer_stats(const REAL *x, size_t d, double eps, double *m)
{
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t c = 0;
    for (; c + 4 <= d; c += 4) {
        s0 += (double)x[c];
        s1 += (double)x[c + 1];
        s2 += (double)x[c + 2];
        s3 += (double)x[c + 3];
    }
    for (; c < d; c++)
        s0 += (double)x[c];
    const double mu = ((s0 + s1) + (s2 + s3)) / (double)d;
    s0 = s1 = s2 = s3 = 0;
    for (c = 0; c + 4 <= d; c += 4) {
        const double e0 = (double)x[c] - mu, e1 = (double)x[c + 1] - mu;
        const double e2 = (double)x[c + 2] - mu, e3 = (double)x[c + 3] - mu;
        s0 += e0 * e0;
        s1 += e1 * e1;
        s2 += e2 * e2;
        s3 += e3 * e3;
    }
    for (; c < d; c++) {
        const double e = (double)x[c] - mu;
        s0 += e * e;
    }
    *m = mu;
    return 1.0 / sqrt(((s0 + s1) + (s2 + s3)) / (double)d + eps);
}

/* One head of one row: y (d,) = RoPE(x r w), or RoPE(x) without the
   weight w (LayerNorm: RoPE((x - m) r w)); cs holds the row's cos, sin
   (qk_angles), u is scratch of d doubles. Loops without branches inside,
   so the compiler may vectorise them (element-wise, so the bits do not
   change). */
static void qk_head_fwd(REAL *y, const REAL *x, size_t d, const REAL *w, const double *cs,
                        double *u, const mha_config *cfg)
{
    if (w != NULL && cfg->norm_type == MHA_NORM_LAYER) {
        double m;
        const double r = qk_layer_stats(x, d, cfg->norm_eps, &m);
        for (size_t c = 0; c < d; c++)
            u[c] = ((double)x[c] - m) * r * (double)w[c]; /* xhat w, xhat = (x - m) r */
    } else if (w != NULL) {
        const double r = qk_rinv(x, d, cfg->norm_eps);
        for (size_t c = 0; c < d; c++)
            u[c] = (double)x[c] * r * (double)w[c]; /* xhat w, xhat = x r */
    } else {
        for (size_t c = 0; c < d; c++)
            u[c] = x[c];
    }
    const size_t rot = cfg->rotary_dim, half = rot / 2;
    const double *co = cs, *si = cs + half;
    if (cfg->rope_interleaved) {
        for (size_t c = 0; c < half; c++) {
            y[2 * c] = (REAL)(u[2 * c] * co[c] - u[2 * c + 1] * si[c]);
            y[2 * c + 1] = (REAL)(u[2 * c] * si[c] + u[2 * c + 1] * co[c]);
        }
    } else {
        for (size_t c = 0; c < half; c++) {
            y[c] = (REAL)(u[c] * co[c] - u[c + half] * si[c]);
            y[c + half] = (REAL)(u[c] * si[c] + u[c + half] * co[c]);
        }
    }
    for (size_t c = rot; c < d; c++)
        y[c] = (REAL)u[c];
}

/* Head h's weight, or NULL without the norm. */
static inline const REAL *qk_weight(const qk_side *s, size_t h)
{
    return s->w != NULL ? (const REAL *)s->w + h * s->wstride : NULL;
}

/* Forward, the rows of index i (every b of it, see qk.c): every head,
   with the angles cs of i. */
static void qk_fwd_index(const QK_CTX *c, size_t i, const double *cs, double *u)
{
    const qk_side *s = &c->s;
    for (size_t b = 0; b < s->nb; b++) {
        const size_t r = b * s->rstep + i;
        for (size_t h = 0; h < s->nh; h++)
            qk_head_fwd(c->dst + r * s->S + s->off[h], c->x + r * s->S + s->off[h], qk_width(s, h),
                        qk_weight(s, h), cs, u, s->cfg);
    }
}

/* Forward, one block of QK_ROWS row indices, the angles of each computed
   once (and used for the k side too when c->also). */
static void qk_fwd_task(void *vctx, size_t t, int ith)
{
    const QK_CTX *c = vctx;
    const qk_side *s = &c->s;
    double *cs = s->cs + (size_t)ith * s->cs_stride;
    double *u = cs + s->cfg->rotary_dim;
    const size_t i1 = (t + 1) * QK_ROWS < s->nidx ? (t + 1) * QK_ROWS : s->nidx;
    for (size_t i = t * QK_ROWS; i < i1; i++) {
        if (s->cfg->rotary_dim > 0)
            qk_angles(cs, s, i);
        qk_fwd_index(c, i, cs, u);
        if (c->also != NULL)
            qk_fwd_index(c->also, i, cs, u);
    }
}

mha_status mha_qk_forward(REAL *qt, REAL *kt, const REAL *q, const REAL *k, const mha_config *cfg,
                          const mha_layout *lay, const size_t *qoff, const size_t *koff)
{
    // q, qt: (B, Tq, Sq); k, kt: (B, Tk, Sk).
    QK_CTX ctx[2] = {{.s = qk_side_q(cfg, lay, qoff), .dst = qt, .x = q},
                     {.s = qk_side_k(cfg, lay, koff), .dst = kt, .x = k}};
    // Self-attention with the default positions: q's tasks turn k's rows
    // too (same positions, so the same angles, computed once). The q side
    // is active then, and its heads are as wide as every kv head.
    const int share = qk_share_angles(cfg);
    if (share)
        ctx[0].also = &ctx[1];
    for (int side = 0; side < 2; side++) {
        const mha_status st = mha_qk_active(cfg, side) ? qk_check(&ctx[side].s) : MHA_OK;
        if (st != MHA_OK)
            return st;
    }
    for (int side = 0; side < 2; side++) {
        if (!mha_qk_active(cfg, side) || (share && side == 1))
            continue; /* off, or done by the q side's tasks */
        const mha_status st = qk_run_rows(&ctx[side].s, qk_fwd_task, &ctx[side]);
        if (st != MHA_OK)
            return st;
    }
    return MHA_OK;
}

/* Pass C for one head of one row, through `y = xhat w, xhat = x r`:
   dxhat = g w, g = r (dxhat - xhat mean(dxhat xhat)), in place. */
static void qk_head_norm_bwd(REAL *g, const REAL *x, size_t d, const REAL *w, double r)
{
    double m0 = 0, m1 = 0; /* two chains, then m0 + m1: one fixed order */
    size_t c = 0;
    for (; c + 2 <= d; c += 2) {
        m0 += ((double)g[c] * (double)w[c]) * ((double)x[c] * r);
        m1 += ((double)g[c + 1] * (double)w[c + 1]) * ((double)x[c + 1] * r);
    }
    for (; c < d; c++)
        m0 += ((double)g[c] * (double)w[c]) * ((double)x[c] * r);
    const double m = (m0 + m1) / (double)d;
    for (c = 0; c < d; c++) {
        const double dxhat = (double)g[c] * (double)w[c], xhat = (double)x[c] * r;
        g[c] = (REAL)(r * (dxhat - xhat * m));
    }
}

/* Pass C of LayerNorm for one head of one row, through `y = xhat w,
   xhat = (x - m) r`, m = mean(x), r = 1 / sqrt(mean((x - m)^2) + eps):
   dxhat = g w, g = r (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), in
   place (m and r depend on every x[c]: the two means are their terms). */
static void qk_head_layer_bwd(REAL *g, const REAL *x, size_t d, const REAL *w, double r,
                              double m)
{
    double a0 = 0, a1 = 0, m0 = 0, m1 = 0; /* two chains each, as above */
    size_t c = 0;
    for (; c + 2 <= d; c += 2) {
        const double g0 = (double)g[c] * (double)w[c], g1 = (double)g[c + 1] * (double)w[c + 1];
        a0 += g0;
        a1 += g1;
        m0 += g0 * (((double)x[c] - m) * r);
        m1 += g1 * (((double)x[c + 1] - m) * r);
    }
    for (; c < d; c++) {
        const double g0 = (double)g[c] * (double)w[c];
        a0 += g0;
        m0 += g0 * (((double)x[c] - m) * r);
    }
    const double mg = (a0 + a1) / (double)d, mx = (m0 + m1) / (double)d;
    for (c = 0; c < d; c++) {
        const double dxhat = (double)g[c] * (double)w[c], xhat = ((double)x[c] - m) * r;
        g[c] = (REAL)(r * ((dxhat - mg) - xhat * mx));
    }
}

/* 1 when one head of one row has g (d,) all zero and x (d,) holding an inf
   or NaN: a key no query sees, or a query that sees no key, of an inf or
   NaN projection. Its r and xhat are NaN, which would turn its g and the
   weight's gradient NaN through 0 * NaN; so passes B and C pass it by
   (its r is marked -1, which no other row's r, >= 0 or NaN, can be) and
   its gradient stays 0, as the forward never read it. */
static int qk_head_unseen(const REAL *g, const REAL *x, size_t d)
{
    for (size_t c = 0; c < d; c++)
        if (g[c] != 0)
            return 0;
    for (size_t c = 0; c < d; c++)
        if (!(x[c] - x[c] == 0))
            return 1;
    return 0;
}

/* Pass A (and C when fused) for one block of QK_ROWS row indices. Through
   `(a, b) -> (a cos - b sin, a sin + b cos)`: its transpose, the rotation
   by -angle, (ga, gb) -> (ga cos + gb sin, gb cos - ga sin). */
static void qk_bwd_rows_task(void *vctx, size_t t, int ith)
{
    const QK_CTX *c = vctx;
    const qk_side *s = &c->s;
    const mha_config *cfg = s->cfg;
    const size_t half = cfg->rotary_dim / 2;
    double *cs = s->cs + (size_t)ith * s->cs_stride;
    const size_t i1 = (t + 1) * QK_ROWS < s->nidx ? (t + 1) * QK_ROWS : s->nidx;
    for (size_t i = t * QK_ROWS; i < i1; i++) {
        if (half > 0)
            qk_angles(cs, s, i);
        for (size_t bh = 0; bh < s->nb * s->nh; bh++) {
            const size_t r = (bh / s->nh) * s->rstep + i, h = bh % s->nh;
            REAL *g = c->dst + r * s->S + s->off[h];
            const REAL *x = c->x + r * s->S + s->off[h];
            const size_t d = qk_width(s, h);
            for (size_t p = 0; p < half; p++) {
                size_t ia, ib;
                qk_pair(&ia, &ib, p, half, cfg->rope_interleaved);
                const double ga = g[ia], gb = g[ib];
                g[ia] = (REAL)(ga * cs[p] + gb * cs[half + p]);
                g[ib] = (REAL)(gb * cs[p] - ga * cs[half + p]);
            }
            if (s->w == NULL)
                continue;
            if (c->mean != NULL) { /* LayerNorm */
                double m = 0;
                const double rr = qk_head_unseen(g, x, d) ? -1.0
                                                          : qk_layer_stats(x, d, cfg->norm_eps, &m);
                c->rinv[r * s->nh + h] = rr;
                c->mean[r * s->nh + h] = m;
                if (c->fuse && !(rr < 0))
                    qk_head_layer_bwd(g, x, d, qk_weight(s, h), rr, m);
                continue;
            }
            const double rr = qk_head_unseen(g, x, d) ? -1.0 : qk_rinv(x, d, cfg->norm_eps);
            c->rinv[r * s->nh + h] = rr;
            if (c->fuse && !(rr < 0))
                qk_head_norm_bwd(g, x, d, qk_weight(s, h), rr);
        }
    }
}

/* Pass C alone, for one block of QK_ROWS row indices (after pass B read
   g). */
static void qk_bwd_norm_task(void *vctx, size_t t, int ith)
{
    (void)ith;
    const QK_CTX *c = vctx;
    const qk_side *s = &c->s;
    const size_t i1 = (t + 1) * QK_ROWS < s->nidx ? (t + 1) * QK_ROWS : s->nidx;
    for (size_t i = t * QK_ROWS; i < i1; i++)
        for (size_t bh = 0; bh < s->nb * s->nh; bh++) {
            const size_t r = (bh / s->nh) * s->rstep + i, h = bh % s->nh;
            const double rr = c->rinv[r * s->nh + h];
            if (rr < 0) /* an unseen head row (qk_head_unseen) */
                continue;
            if (c->mean != NULL)
                qk_head_layer_bwd(c->dst + r * s->S + s->off[h], c->x + r * s->S + s->off[h],
                                  qk_width(s, h), qk_weight(s, h), rr, c->mean[r * s->nh + h]);
            else
                qk_head_norm_bwd(c->dst + r * s->S + s->off[h], c->x + r * s->S + s->off[h],
                                 qk_width(s, h), qk_weight(s, h), rr);
        }
}

/* Pass B, one task per QK_COLS columns of one weight row hw: through
   `y = xhat w`, dw[hw, col] = sum over rows r (increasing), then over the
   heads that share the weight (increasing), of g xhat (xhat = x r, or
   (x - m) r with LayerNorm). */
static void qk_dw_task(void *vctx, size_t t, int ith)
{
    (void)ith;
    const QK_CTX *c = vctx;
    const qk_side *s = &c->s;
    const size_t d = qk_width(s, 0), nblk = (d + QK_COLS - 1) / QK_COLS;
    const size_t hw = t / nblk, c0 = (t % nblk) * QK_COLS;
    const size_t n = d - c0 < QK_COLS ? d - c0 : QK_COLS;
    const size_t h0 = s->wstride == 0 ? 0 : hw, h1 = s->wstride == 0 ? s->nh : hw + 1;
    double acc[QK_COLS];
    for (size_t j = 0; j < n; j++)
        acc[j] = 0;
    for (size_t r = 0; r < s->rows; r++)
        for (size_t h = h0; h < h1; h++) {
            const REAL *g = c->dst + r * s->S + s->off[h] + c0;
            const REAL *x = c->x + r * s->S + s->off[h] + c0;
            const double rr = c->rinv[r * s->nh + h];
            if (rr < 0) /* an unseen head row (qk_head_unseen) */
                continue;
            if (c->mean != NULL) {
                const double m = c->mean[r * s->nh + h];
                for (size_t j = 0; j < n; j++)
                    acc[j] += (double)g[j] * (((double)x[j] - m) * rr);
                continue;
            }
            for (size_t j = 0; j < n; j++)
                acc[j] += (double)g[j] * ((double)x[j] * rr);
        }
    for (size_t j = 0; j < n; j++)
        c->dw[hw * d + c0 + j] = (REAL)acc[j];
}

/* The backward of one side: A, then B and C when the weight's gradient is
   wanted, else A and C fused. */
static mha_status qk_bwd_side(QK_CTX *c)
{
    qk_side *s = &c->s;
    mha_status st = qk_check(s);
    if (st != MHA_OK)
        return st;
    if (s->w == NULL)
        c->dw = NULL;
    // r per (row, head), then LayerNorm's means m beside them: one block.
    const int layer = s->w != NULL && s->cfg->norm_type == MHA_NORM_LAYER;
    size_t nr;
    if (!mha_mul_ok(&nr, s->rows * s->nh, layer ? 2 : 1))
        return MHA_ERR_SIZE;
    if (s->w != NULL && (st = mha_scratch((void **)&c->rinv, nr, sizeof(double))) != MHA_OK)
        return st;
    c->mean = layer ? c->rinv + s->rows * s->nh : NULL;
    c->fuse = c->dw == NULL;
    st = qk_run_rows(s, qk_bwd_rows_task, c);
    if (st == MHA_OK && c->dw != NULL) {
        const size_t d = qk_width(s, 0);
        const size_t ntasks = (s->wstride == 0 ? 1 : s->nh) * ((d + QK_COLS - 1) / QK_COLS);
        st = mha_parallel_for_n(ntasks, qk_threads(ntasks, s->rows * s->S), qk_dw_task, c);
        if (st == MHA_OK && mha_interrupted(s->cfg))
            st = MHA_ERR_INTERRUPTED;
        if (st == MHA_OK)
            st = qk_run_rows(s, qk_bwd_norm_task, c);
    }
    mha_scratch_free(c->rinv);
    c->rinv = c->mean = NULL;
    return st;
}

mha_status mha_qk_backward(REAL *dq, REAL *dk, REAL *dq_norm, REAL *dk_norm, const REAL *q,
                           const REAL *k, const mha_config *cfg, const mha_layout *lay,
                           const size_t *qoff, const size_t *koff)
{
    // dq, q: (B, Tq, Sq); dk, k: (B, Tk, Sk); dq_norm, dk_norm: as the weights.
    QK_CTX ctx[2] = {
        {.s = qk_side_q(cfg, lay, qoff), .dst = dq, .x = q, .dw = dq_norm},
        {.s = qk_side_k(cfg, lay, koff), .dst = dk, .x = k, .dw = dk_norm}};
    for (int side = 0; side < 2; side++) {
        if (ctx[side].dst == NULL || !mha_qk_active(cfg, side))
            continue;
        const mha_status st = qk_bwd_side(&ctx[side]);
        if (st != MHA_OK)
            return st;
    }
    return MHA_OK;
}

#undef QK_CTX
#undef qk_rinv
#undef qk_layer_stats
#undef qk_head_fwd
#undef qk_weight
#undef qk_fwd_index
#undef qk_fwd_task
#undef mha_qk_forward
#undef qk_head_norm_bwd
#undef qk_head_layer_bwd
#undef qk_head_unseen
#undef qk_bwd_rows_task
#undef qk_bwd_norm_task
#undef qk_dw_task
#undef qk_bwd_side
#undef mha_qk_backward
