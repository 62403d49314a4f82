/*
 * problem.h - what the tests of a whole layer (mha_forward and
 * mha_backward, projections included: test_qk.c, test_gate.c) share:
 *   - a problem: a case's inputs as doubles and their typed copies, by
 *     index (X, KEY, ...), and the storage its config points at;
 *   - the forward's outputs and the gradients as typed buffers, and the
 *     mha_params of both calls but for what a test adds;
 *   - the reference's plain loops (projection, softmax attention, W^O);
 *   - loss = sum(out * R), central differences of it, and the checks the
 *     tests make alike: the forward against the reference; the backward
 *     against finite differences, float32's against float64's, subsets of
 *     the gradients asked for alone; 1 and 3 threads.
 * One copy of each, so that a fix to one reaches both tests.
 *
 * Include it once the test has defined `tcase` (its case, with a
 * `const char *name`); the test then defines run_fwd and run_bwd
 * (declared here), the calls it makes, which the helpers below run.
 *
 * Letters: B batch, Tq queries, Tk keys, Din / Dkin / Dvin the widths of
 * x / key / value, H heads, G key/value heads (groups), dk / dv a head's
 * q/k and v widths, Sq / Sk / Sv / Svq the widths of q, k, v and the
 * heads' concat, Dout the output's.
 */
#ifndef MHA_TEST_PROBLEM_H
#define MHA_TEST_PROBLEM_H

#include "harness.h"
#include "threads.h"

/* At most so many key/value heads (a test's tcase may use MAXG, defining
   it first) and query heads or RoPE frequencies. */
#ifndef MAXG
#define MAXG 8
#endif
#define MAXH 64

/* The inputs, by index into problem.n, .in, .t and grads.d. */
enum {
    X,      /* x (B, Tq, Din) */
    KEY,    /* key (B, Tk, Dkin); not an input: key is x */
    VALUE,  /* value (B, Tk, Dvin); not an input: value is key */
    WQ,     /* wq (Din, Sq) */
    WK,     /* wk (Dkin, Sk) */
    WV,     /* wv (Dvin, Sv) */
    WO,     /* wo (Svq, Dout) */
    BQ,     /* bq (Sq) */
    BK,     /* bk (Sk) */
    BV,     /* bv (Sv) */
    BO,     /* bo (Dout) */
    QN,     /* q_norm (d) or (H, d) */
    KN,     /* k_norm (d) or (G, d) */
    WG,     /* wgate (Din, Svq) */
    BG,     /* bgate (Svq) */
    NIN
};

typedef struct {
    tcase c;
    size_t Sq, Sk, Sv, Svq, Dout;
    size_t dk[MAXG], dv[MAXG];    /* per key/value head */
    size_t qoff[MAXH], koff[MAXG];  /* a head's first column of q / k */
    double scale[MAXH];
    double inv_freq[MAXH];        /* RoPE's (test_qk) */
    int64_t *pos, *kpos;          /* explicit positions (test_qk): (B, T) */
    size_t n[NIN];                /* the inputs' sizes */
    double *in[NIN];              /* as doubles that are exactly floats;
                                     NULL: not an input of this case */
    void *t[2][NIN];              /* typed copies: [0] float, [1] double */
    double *R;                    /* (B, Tq, Dout): loss = sum(out * R) */
    mha_config cfg;
} problem;

/* Starts P for case c: the heads' widths, offsets and scales (head h's
   scale 1/sqrt(dk) * (1 + 0.1 h), so that a head mixed up with another is
   seen), Dout (5 with W^O, else Svq), and P->cfg = cfg with dk, dv,
   scale and Dout pointing into P. dk: cfg.G widths, dv: every head's. */
static inline void problem_start(problem *P, const tcase *c, mha_config cfg, const size_t *dk,
                                 size_t dv)
{
    memset(P, 0, sizeof *P);
    P->c = *c;
    const size_t per = cfg.H / cfg.G;
    for (size_t g = 0; g < cfg.G; g++) {
        P->dk[g] = dk[g];
        P->dv[g] = dv;
        P->koff[g] = P->Sk;
        P->Sk += dk[g];
        P->Sv += dv;
    }
    for (size_t h = 0; h < cfg.H; h++) {
        P->qoff[h] = P->Sq;
        P->Sq += P->dk[h / per];
        P->Svq += dv;
        P->scale[h] = 1.0 / sqrt((double)P->dk[h / per]) * (1.0 + 0.1 * (double)h);
    }
    P->Dout = cfg.has_wo ? 5 : P->Svq;
    cfg.Dout = P->Dout, cfg.dk = P->dk, cfg.dv = P->dv, cfg.scale = P->scale;
    P->cfg = cfg;
}

/* Input i's name, as the calls' parameter says it. */
static inline const char *input_name(int i)
{
    static const char *const names[NIN] = {
        [X] = "x", [KEY] = "key", [VALUE] = "value", [WQ] = "wq", [WK] = "wk",
        [WV] = "wv", [WO] = "wo", [BQ] = "bq", [BK] = "bk", [BV] = "bv", [BO] = "bo",
        [QN] = "q_norm", [KN] = "k_norm", [WG] = "wgate", [BG] = "bgate"};
    return names[i];
}

/* Input i's size, from the config (q_norm's and k_norm's: per head with
   q_norm_hstride / k_norm_hstride, every head dk[0] wide, else shared). */
static inline size_t input_size(const problem *P, int i)
{
    const mha_config *c = &P->cfg;
    const size_t nq = c->B * c->Tq, nk = c->B * c->Tk;
    switch (i) {
    case X: return nq * c->Din;
    case KEY: return nk * c->Dkin;
    case VALUE: return nk * c->Dvin;
    case WQ: return c->Din * P->Sq;
    case WK: return c->Dkin * P->Sk;
    case WV: return c->Dvin * P->Sv;
    case WO: return P->Svq * P->Dout;
    case BQ: return P->Sq;
    case BK: return P->Sk;
    case BV: return P->Sv;
    case BO: return P->Dout;
    case QN: return (c->q_norm_hstride ? c->H : 1) * P->dk[0];
    case KN: return (c->k_norm_hstride ? c->G : 1) * P->dk[0];
    case WG: return c->Din * P->Svq;
    default: return P->Svq; /* BG */
    }
}

/* The inputs with has[i], then R (in [-1, 1)), as doubles and typed
   copies. Each input is uniform in its range: x, key, value in [-1, 1),
   wq, wk, wv in [-0.6, 0.6), wo and the biases in [-0.5, 0.5), the norms'
   weights in [0.5, 1.5), wgate in [-0.7, 0.7), bgate in [-0.8, 0.8): O(1)
   values, so that one tolerance fits every case. Drawn in index order,
   so that a case's inputs are the same from run to run. */
static inline void problem_inputs(problem *P, const int has[NIN])
{
    static const double mid[NIN] = {[QN] = 1, [KN] = 1};
    static const double amp[NIN] = {
        [X] = 1, [KEY] = 1, [VALUE] = 1, [WQ] = 0.6, [WK] = 0.6, [WV] = 0.6,
        [WO] = 0.5, [BQ] = 0.5, [BK] = 0.5, [BV] = 0.5, [BO] = 0.5, [QN] = 0.5,
        [KN] = 0.5, [WG] = 0.7, [BG] = 0.8};
    for (int i = 0; i < NIN; i++) {
        if (!has[i])
            continue;
        P->n[i] = input_size(P, i);
        P->in[i] = rand_range(P->n[i], mid[i] - amp[i], mid[i] + amp[i]);
        P->t[0][i] = typed(P->in[i], P->n[i], 0);
        P->t[1][i] = typed(P->in[i], P->n[i], 1);
    }
    P->R = rand_vec(P->cfg.B * P->cfg.Tq * P->Dout, 1);
}

static inline void problem_free(problem *P)
{
    for (int i = 0; i < NIN; i++) {
        free(P->in[i]);
        free(P->t[0][i]);
        free(P->t[1][i]);
    }
    free(P->R);
    free(P->pos);
    free(P->kpos);
}

/* ---- the reference, in double with plain loops ---- */

/* y (rows, S) = a (rows, din) w (din, S) + bias (NULL: none) */
static inline void ref_proj(double *y, const double *a, const double *w, const double *bias,
                            size_t rows, size_t din, size_t S)
{
    for (size_t r = 0; r < rows; r++)
        for (size_t s = 0; s < S; s++) {
            double acc = bias ? bias[s] : 0.0;
            for (size_t i = 0; i < din; i++)
                acc += a[r * din + i] * w[i * S + s];
            y[r * S + s] = acc;
        }
}

/* cat (B, Tq, Svq): each head's softmax attention of q (B, Tq, Sq) on
   k (B, Tk, Sk) and v (B, Tk, Sv), causal as the config says (query i at
   position i + Tk - Tq). Every head has the width dv[0], as in the cases
   of both tests. */
static inline void ref_attend(double *cat, const double *q, const double *k, const double *v,
                              const problem *P)
{
    const mha_config *cfg = &P->cfg;
    const size_t B = cfg->B, Tq = cfg->Tq, Tk = cfg->Tk, per = cfg->H / cfg->G, dv = P->dv[0];
    double *p = xcalloc(Tk, sizeof *p);
    for (size_t b = 0; b < B; b++)
        for (size_t h = 0; h < cfg->H; h++)
            for (size_t i = 0; i < Tq; i++) {
                const size_t g = h / per, d = P->dk[g];
                const double *q_i = q + (b * Tq + i) * P->Sq + P->qoff[h];
                double m = -INFINITY, l = 0;
                for (size_t j = 0; j < Tk; j++) {
                    const double *k_j = k + (b * Tk + j) * P->Sk + P->koff[g];
                    double s = 0;
                    for (size_t e = 0; e < d; e++)
                        s += q_i[e] * k_j[e];
                    const int vis = !cfg->causal ||
                                    (double)j <= (double)i + (double)Tk - (double)Tq;
                    p[j] = vis ? P->scale[h] * s : -INFINITY;
                    m = p[j] > m ? p[j] : m;
                }
                for (size_t j = 0; j < Tk; j++) {
                    p[j] = m == -INFINITY ? 0.0 : exp(p[j] - m);
                    l += p[j];
                }
                double *o = cat + (b * Tq + i) * P->Svq + h * dv;
                for (size_t e = 0; e < dv; e++) {
                    double acc = 0;
                    for (size_t j = 0; j < Tk; j++)
                        acc += p[j] * v[(b * Tk + j) * P->Sv + g * dv + e];
                    o[e] = l > 0 ? acc / l : 0.0;
                }
            }
    free(p);
}

/* out (B, Tq, Dout) = cat (B, Tq, Svq) wo + bo with W^O, else cat + bo
   (bo NULL: none). */
static inline void ref_out(double *out, const double *cat, const double *bo, const problem *P)
{
    const size_t nq = P->cfg.B * P->cfg.Tq;
    if (P->cfg.has_wo) {
        ref_proj(out, cat, P->in[WO], bo, nq, P->Svq, P->Dout);
    } else {
        for (size_t r = 0; r < nq * P->Dout; r++)
            out[r] = cat[r] + (bo ? bo[r % P->Dout] : 0.0);
    }
}

/* max over i of |a[i] - ref[i]| / (1 + |ref[i]|); NaN when one is NaN */
static inline double max_err(const void *a, const double *ref, size_t n, int f64)
{
    double e = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs(val(a, i, f64) - ref[i]) / (1.0 + fabs(ref[i]));
        e = d > e || d != d ? d : e;
    }
    return e;
}

/* ---- calls into the core ---- */

/* The forward's outputs, typed; NULL = not wanted. */
typedef struct {
    void *out, *q, *k, *v, *cat, *lse;
} fwd_out;

static inline void fwd_alloc(fwd_out *o, const problem *P, int f64)
{
    const size_t nq = P->cfg.B * P->cfg.Tq, nk = P->cfg.B * P->cfg.Tk;
    o->out = zalloc(nq * P->Dout, f64);
    o->q = zalloc(nq * P->Sq, f64);
    o->k = zalloc(nk * P->Sk, f64);
    o->v = zalloc(nk * P->Sv, f64);
    o->cat = zalloc(nq * P->Svq, f64);
    o->lse = zalloc(P->cfg.B * P->cfg.H * P->cfg.Tq, f64);
}

static inline void fwd_free(fwd_out *o)
{
    free(o->out);
    free(o->q);
    free(o->k);
    free(o->v);
    free(o->cat);
    free(o->lse);
}

/* The gradients, typed, by input; NULL = not wanted. */
typedef struct {
    void *d[NIN];
} grads;

/* The gradient of every input of the case; want: of those with want[i]
   (NULL: all). */
static inline void grads_alloc(grads *g, const problem *P, int f64, const int *want)
{
    for (int i = 0; i < NIN; i++)
        g->d[i] = P->in[i] && (!want || want[i]) ? zalloc(P->n[i], f64) : NULL;
}

static inline void grads_free(grads *g)
{
    for (int i = 0; i < NIN; i++)
        free(g->d[i]);
}

/* The test's calls: the forward of its typed inputs P->t[f64] into o, and
   the backward of dout into g, after that forward's o. */
static mha_status run_fwd(problem *P, int f64, fwd_out *o);
static mha_status run_bwd(problem *P, int f64, grads *g, const void *dout, const fwd_out *o);

/* The forward's mha_params for the typed inputs in (indexed as P->in):
   the outputs o, x, key (x when the case has none), value (key when it has
   none), wq, wk, wv and wo with W^O. A test adds the rest. */
static inline mha_params fwd_params(const problem *P, void *const *in, int f64, fwd_out *o)
{
    const void *key = P->in[KEY] ? in[KEY] : in[X];
    return (mha_params){
        .dtype = f64 ? MHA_DTYPE_F64 : MHA_DTYPE_F32, .out = o->out, .q = o->q, .k = o->k,
        .v = o->v, .concat = o->cat, .lse = o->lse, .x = in[X], .key = key,
        .value = P->in[VALUE] ? in[VALUE] : key, .wq = in[WQ], .wk = in[WK], .wv = in[WV],
        .wo = P->cfg.has_wo ? in[WO] : NULL};
}

/* The backward's: fwd_params' inputs, the kept q, k, v, concat, lse of o,
   dout, and every gradient of g; when key is x (value is key), dkey is dx
   (dvalue is dkey), so that dx holds the whole gradient of x. */
static inline mha_params bwd_params(const problem *P, void *const *in, int f64, grads *g,
                                    const void *dout, const fwd_out *o)
{
    mha_params prm = fwd_params(P, in, f64, &(fwd_out){0});
    void *dkey = P->in[KEY] ? g->d[KEY] : g->d[X];
    prm.q = o->q, prm.k = o->k, prm.v = o->v, prm.concat = o->cat, prm.lse = o->lse;
    prm.dout = dout;
    prm.dx = g->d[X], prm.dkey = dkey, prm.dvalue = P->in[VALUE] ? g->d[VALUE] : dkey;
    prm.dwq = g->d[WQ], prm.dwk = g->d[WK], prm.dwv = g->d[WV], prm.dwo = g->d[WO];
    prm.dbq = g->d[BQ], prm.dbk = g->d[BK], prm.dbv = g->d[BV], prm.dbo = g->d[BO];
    prm.dq_norm = g->d[QN], prm.dk_norm = g->d[KN], prm.dwgate = g->d[WG];
    prm.dbgate = g->d[BG];
    return prm;
}

/* loss = sum(out * R) by the float64 forward, the only output it asks for
   (so that the forward without kept tensors is the one differentiated). */
static inline double loss_f64(problem *P)
{
    fwd_out o = {0};
    o.out = zalloc(P->cfg.B * P->cfg.Tq * P->Dout, 1);
    const mha_status st = run_fwd(P, 1, &o);
    CHECK(st == MHA_OK, "%s: loss forward %s", P->c.name, mha_status_name(st));
    double l = 0;
    for (size_t i = 0; i < P->cfg.B * P->cfg.Tq * P->Dout; i++)
        l += ((double *)o.out)[i] * P->R[i];
    free(o.out);
    return l;
}

/* Forward, then backward with dout = R into g: every output and gradient,
   allocated here. */
static inline void fwd_bwd(problem *P, int f64, fwd_out *o, grads *g)
{
    fwd_alloc(o, P, f64);
    grads_alloc(g, P, f64, NULL);
    mha_status st = run_fwd(P, f64, o);
    void *dout = typed(P->R, P->cfg.B * P->cfg.Tq * P->Dout, f64);
    if (st == MHA_OK)
        st = run_bwd(P, f64, g, dout, o);
    CHECK(st == MHA_OK, "%s: fwd/bwd %s", P->c.name, mha_status_name(st));
    free(dout);
}

/* Central differences of loss_f64 at nent random entries of input `which`
   (its float64 copy, put back after) against the float64 gradient grad. */
static inline void check_fd(problem *P, int which, const void *grad, int nent)
{
    const double h = 1e-5;
    double *arr = P->t[1][which];
    for (int e = 0; e < nent && P->n[which] > 0; e++) {
        const size_t i = rng_below(P->n[which]);
        const double keep = arr[i];
        arr[i] = keep + h;
        const double lp = loss_f64(P);
        arr[i] = keep - h;
        const double lm = loss_f64(P);
        arr[i] = keep;
        const double fd = (lp - lm) / (2 * h), gi = val(grad, i, 1);
        CHECK(fabs(fd - gi) <= 1e-6 * (1 + fabs(gi)), "%s %s: d%s[%zu] = %.12g, finite "
              "difference %.12g", P->c.name, mha_isa_name(mha_get_isa()), input_name(which),
              i, gi, fd);
    }
}

/* ---- checks both tests make ---- */

/* The forward of both types on every ISA against the reference: out, and
   the kept q, k, concat where the test gives their reference (NULL: not
   checked). tol64: float64's tolerance; float32's is 3e-5 (a few roundings
   of O(1) values, sums of <= 50 terms). */
static inline void check_forward(problem *P, const double *out, const double *q,
                                 const double *k, const double *cat, double tol64)
{
    const size_t nq = P->cfg.B * P->cfg.Tq, nk = P->cfg.B * P->cfg.Tk;
    for (int isa = 0; isa <= (int)harness_best_isa(); isa++) {
        mha_set_isa((mha_isa)isa);
        for (int f64 = 0; f64 < 2; f64++) {
            const double tol = f64 ? tol64 : 3e-5;
            fwd_out o;
            fwd_alloc(&o, P, f64);
            const mha_status st = run_fwd(P, f64, &o);
            const double eo = max_err(o.out, out, nq * P->Dout, f64);
            const double eq = q ? max_err(o.q, q, nq * P->Sq, f64) : 0;
            const double ek = k ? max_err(o.k, k, nk * P->Sk, f64) : 0;
            const double ec = cat ? max_err(o.cat, cat, nq * P->Svq, f64) : 0;
            const char *isa_name = mha_isa_name((mha_isa)isa);
            CHECK(st == MHA_OK && eo <= tol, "%s %s f%d: %s, out err %.3g", P->c.name,
                  isa_name, f64 ? 64 : 32, mha_status_name(st), eo);
            if (q || k || cat)
                CHECK(eq <= tol && ek <= tol && ec <= tol, "%s %s f%d: kept q err %.3g, "
                      "k %.3g, concat %.3g", P->c.name, isa_name, f64 ? 64 : 32, eq, ek, ec);
            fwd_free(&o);
        }
    }
    mha_set_isa(MHA_ISA_AVX512);
}

/* float32's gradients g[0] within 1e-4 of float64's g[1] (the same inputs,
   O(1) values), every gradient of the case. */
static inline void check_f32_grads(const problem *P, const grads g[2])
{
    for (int i = 0; i < NIN; i++) {
        if (g[1].d[i] == NULL)
            continue;   // not an input of the case
        const double e = max_err(g[0].d[i], g[1].d[i], P->n[i], 0);
        CHECK(e <= 1e-4, "%s: float32 d%s off by %.3g", P->c.name, input_name(i), e);
    }
}

/* A backward asked only for the gradients with want[i] gives the bits of
   the call that asks for every one (g, after the forwards o; [f64]). */
static inline void check_wanted(problem *P, const fwd_out o[2], const grads g[2],
                                const int want[NIN], const char *what)
{
    for (int f64 = 0; f64 < 2; f64++) {
        grads some;
        grads_alloc(&some, P, f64, want);
        void *dout = typed(P->R, P->cfg.B * P->cfg.Tq * P->Dout, f64);
        const mha_status st = run_bwd(P, f64, &some, dout, &o[f64]);
        int same = st == MHA_OK;
        for (int i = 0; i < NIN; i++)
            same = same && (!some.d[i] || same_bytes(some.d[i], g[f64].d[i], P->n[i], f64));
        CHECK(same, "%s f%d: %s differ from the call asking for all (%s)", P->c.name,
              f64 ? 64 : 32, what, mha_status_name(st));
        free(dout);
        grads_free(&some);
    }
}

/* The backward on every ISA: central differences of loss_f64 at nfd[i]
   entries of each input i, every float32 gradient against float64's, and
   for each of the nsub subsets want[s] of the gradients, a call asking
   for those alone (what[s]) against the call asking for all. */
static inline void check_backward(problem *P, const int nfd[NIN], int nsub,
                                  const int (*want)[NIN], const char *const *what)
{
    for (int isa = 0; isa <= (int)harness_best_isa(); isa++) {
        mha_set_isa((mha_isa)isa);
        fwd_out o[2];
        grads g[2];
        fwd_bwd(P, 1, &o[1], &g[1]);
        for (int i = 0; i < NIN; i++)
            check_fd(P, i, g[1].d[i], nfd[i]);
        fwd_bwd(P, 0, &o[0], &g[0]);
        check_f32_grads(P, g);
        for (int s = 0; s < nsub; s++)
            check_wanted(P, o, g, want[s], what[s]);
        for (int f64 = 0; f64 < 2; f64++) {
            fwd_free(&o[f64]);
            grads_free(&g[f64]);
        }
    }
    mha_set_isa(MHA_ISA_AVX512);
}

/* The outputs and every gradient bitwise the same for 1 and 3 threads. */
static inline void check_threads(problem *P)
{
    const size_t nq = P->cfg.B * P->cfg.Tq, nk = P->cfg.B * P->cfg.Tk;
    for (int f64 = 0; f64 < 2; f64++) {
        fwd_out o[2];
        grads g[2];
        for (int r = 0; r < 2; r++) {
            mha_set_num_threads(r == 0 ? 1 : 3);
            fwd_bwd(P, f64, &o[r], &g[r]);
        }
        mha_set_num_threads(0);
        const int fo = same_bytes(o[0].out, o[1].out, nq * P->Dout, f64) &&
                       same_bytes(o[0].q, o[1].q, nq * P->Sq, f64) &&
                       same_bytes(o[0].k, o[1].k, nk * P->Sk, f64) &&
                       same_bytes(o[0].v, o[1].v, nk * P->Sv, f64) &&
                       same_bytes(o[0].cat, o[1].cat, nq * P->Svq, f64) &&
                       same_bytes(o[0].lse, o[1].lse, P->cfg.B * P->cfg.H * P->cfg.Tq, f64);
        int fg = 1;
        for (int i = 0; i < NIN; i++)
            fg = fg && same_bytes(g[0].d[i], g[1].d[i], P->n[i], f64);
        CHECK(fo && fg, "%s f%d: 1 and 3 threads differ (forward %d, gradients %d)",
              P->c.name, f64 ? 64 : 32, fo, fg);
        for (int r = 0; r < 2; r++) {
            fwd_free(&o[r]);
            grads_free(&g[r]);
        }
    }
}

#endif /* MHA_TEST_PROBLEM_H */
