/*
 * test_qk.c - tests of the q/k transforms (csrc/core/qk.c): per-head
 * RMSNorm or LayerNorm (cfg.norm_type) of q and k and RoPE, in mha_forward
 * and mha_backward.
 *
 * Build and run (see the Makefile beside this file):
 *   make -C tests/c check      # optimised build + ASan/UBSan build, both run
 *   ./test_qk [quick]
 *
 * What is checked:
 *   - mha_forward (float32 and float64) against a naive double reference (plain loops:
 *     project, RMSNorm or LayerNorm, RoPE, softmax attention, W^O), on every ISA this
 *     machine runs, for: norm only (shared (d,) and per-head weights), RoPE
 *     only (both pairings, partial rotary_dim, custom inv_freq, explicit
 *     positions (B, Tq) and (Tq,), key_positions), both, GQA, biases,
 *     causal, Tq != Tk, ragged heads (RoPE only); the kept q, k are the raw
 *     projections;
 *   - mha_qk_forward_f64 alone against the reference transform with packed
 *     sequences (the default positions within each sequence);
 *   - mha_backward_f64 against central finite differences of
 *     loss = sum(out * R) at entries of x, key, wq, wk, q_norm, k_norm, and
 *     float32's gradients against float64's;
 *   - a backward asked for dq_norm / dk_norm alone gives the same bits, and
 *     one not asked for them (the norm's passes A and C fused) the same dx,
 *     dkey, dwq, dwk;
 *   - bitwise equality of every output and gradient for 1 and 3 threads.
 */
#ifndef _WIN32
#define _GNU_SOURCE /* CLOCK_THREAD_CPUTIME_ID, for the bench alone */
#endif

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dispatch.h"
#include "mha.h"
#include "qk.h"
#include "threads.h"

#include "harness.h"

#define MAXG 8

/* One test case. qn / kn: 0 off, 1 shared (d,) weight, 2 per head.
   pos / kpos: 0 default positions, 1 (B, T), 2 (T,). ln: the norm is
   LayerNorm (MHA_NORM_LAYER), else RMSNorm. */
typedef struct {
    const char *name;
    size_t B, Tq, Tk, Din, H, G, dv;
    size_t dk[MAXG];
    int has_wo, causal, bias;
    int qn, kn;
    size_t rot;
    int inter, custom_freq;
    int pos, kpos;
    int ln;
} tcase;

/* The inputs of one case, as doubles that are exactly floats (so float32
   and float64 calls see the same values), and typed copies. */
typedef struct {
    void *x, *key, *value, *wq, *wk, *wv, *wo, *bq, *bk, *bv, *bo, *qn, *kn;
} typed_in;

typedef struct {
    tcase c;
    size_t Sq, Sk, Sv, Svq, Dout, nqn, nkn;
    size_t dk[MAXG], dv[MAXG], qoff[64], koff[MAXG];
    double scale[64];
    double inv_freq[64];
    int64_t *pos, *kpos;
    double *x, *key, *value, *wq, *wk, *wv, *wo, *bq, *bk, *bv, *bo, *qn, *kn;
    double *R; /* (B, Tq, Dout): loss = sum(out * R) */
    typed_in t[2];
    mha_config cfg;
} problem;

static void typed_fill(problem *P, int f64)
{
    const tcase *c = &P->c;
    const size_t nq = c->B * c->Tq, nk = c->B * c->Tk;
    typed_in *t = &P->t[f64];
    t->x = typed(P->x, nq * c->Din, f64);
    t->key = typed(P->key, nk * c->Din, f64);
    t->value = typed(P->value, nk * c->Din, f64);
    t->wq = typed(P->wq, c->Din * P->Sq, f64);
    t->wk = typed(P->wk, c->Din * P->Sk, f64);
    t->wv = typed(P->wv, c->Din * P->Sv, f64);
    t->wo = typed(P->wo, P->Svq * P->Dout, f64);
    t->bq = typed(P->bq, P->Sq, f64);
    t->bk = typed(P->bk, P->Sk, f64);
    t->bv = typed(P->bv, P->Sv, f64);
    t->bo = typed(P->bo, P->Dout, f64);
    t->qn = typed(P->qn, P->nqn, f64);
    t->kn = typed(P->kn, P->nkn, f64);
}

static void problem_init(problem *P, const tcase *c)
{
    memset(P, 0, sizeof *P);
    P->c = *c;
    const size_t per = c->H / c->G;
    for (size_t g = 0; g < c->G; g++) {
        P->dk[g] = c->dk[g] ? c->dk[g] : c->dk[0];
        P->dv[g] = c->dv;
        P->koff[g] = P->Sk;
        P->Sk += P->dk[g];
        P->Sv += c->dv;
    }
    for (size_t h = 0; h < c->H; h++) {
        P->qoff[h] = P->Sq;
        P->Sq += P->dk[h / per];
        P->Svq += c->dv;
        P->scale[h] = 1.0 / sqrt((double)P->dk[h / per]) * (1.0 + 0.1 * (double)h);
    }
    P->Dout = c->has_wo ? 5 : P->Svq;
    const size_t d = P->dk[0], half = c->rot / 2;
    for (size_t i = 0; i < half; i++)
        P->inv_freq[i] = c->custom_freq ? 0.05 + 1.2 * (0.5 + 0.5 * rng_unit())
                                        : pow(10000.0, -2.0 * (double)i / (double)c->rot);
    const size_t nq = c->B * c->Tq, nk = c->B * c->Tk;
    P->x = rand_vec(nq * c->Din, 1);
    P->key = rand_vec(nk * c->Din, 1);
    P->value = rand_vec(nk * c->Din, 1);
    P->wq = rand_vec(c->Din * P->Sq, 0.6);
    P->wk = rand_vec(c->Din * P->Sk, 0.6);
    P->wv = rand_vec(c->Din * P->Sv, 0.6);
    P->wo = rand_vec(P->Svq * P->Dout, 0.5);
    P->bq = rand_vec(P->Sq, 0.5);
    P->bk = rand_vec(P->Sk, 0.5);
    P->bv = rand_vec(P->Sv, 0.5);
    P->bo = rand_vec(P->Dout, 0.5);
    P->nqn = c->qn == 2 ? c->H * d : d;
    P->nkn = c->kn == 2 ? c->G * d : d;
    P->qn = rand_range(P->nqn, 0.5, 1.5);
    P->kn = rand_range(P->nkn, 0.5, 1.5);
    P->R = rand_vec(nq * P->Dout, 1);
    P->pos = malloc((nq ? nq : 1) * sizeof *P->pos);
    P->kpos = malloc((nk ? nk : 1) * sizeof *P->kpos);
    for (size_t i = 0; i < nq; i++)
        P->pos[i] = (int64_t)(rng_u64() % 300) - 20;
    for (size_t i = 0; i < nk; i++)
        P->kpos[i] = (int64_t)(rng_u64() % 300) - 20;
    typed_fill(P, 0);
    typed_fill(P, 1);

    mha_config *cfg = &P->cfg;
    *cfg = (mha_config){
        .B = c->B, .Tq = c->Tq, .Tk = c->Tk, .Din = c->Din, .Dkin = c->Din,
        .Dvin = c->Din, .Dout = P->Dout, .H = c->H, .G = c->G, .dk = P->dk,
        .dv = P->dv, .scale = P->scale, .causal = c->causal, .has_wo = c->has_wo,
    };
    cfg->q_norm_hstride = c->qn == 2 ? d : 0;
    cfg->k_norm_hstride = c->kn == 2 ? d : 0;
    cfg->norm_eps = 1e-5;
    cfg->norm_type = c->ln ? MHA_NORM_LAYER : MHA_NORM_RMS;
    cfg->rotary_dim = c->rot;
    cfg->rope_interleaved = c->inter;
    cfg->inv_freq = c->rot ? P->inv_freq : NULL;
    cfg->positions = c->pos ? P->pos : NULL;
    cfg->positions_bstride = c->pos == 1 ? c->Tq : 0;
    cfg->key_positions = c->kpos ? P->kpos : NULL;
    cfg->key_positions_bstride = c->kpos == 1 ? c->Tk : 0;
}

static void typed_free(typed_in *t)
{
    void *p[] = {t->x, t->key, t->value, t->wq, t->wk, t->wv, t->wo,
                 t->bq, t->bk, t->bv, t->bo, t->qn, t->kn};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        free(p[i]);
}

static void problem_free(problem *P)
{
    double *p[] = {P->x, P->key, P->value, P->wq, P->wk, P->wv, P->wo, P->bq,
                   P->bk, P->bv, P->bo, P->qn, P->kn, P->R};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        free(p[i]);
    free(P->pos);
    free(P->kpos);
    typed_free(&P->t[0]);
    typed_free(&P->t[1]);
}

/* Points the config's norm weights at the typed copies of one type. */
static void cfg_bind(problem *P, int f64)
{
    P->cfg.q_norm = P->c.qn ? P->t[f64].qn : NULL;
    P->cfg.k_norm = P->c.kn ? P->t[f64].kn : NULL;
}

/* ---- the reference, in double with plain loops ---- */

/* proj (rows, S) = in (rows, din) w (din, S) + bias */
static void ref_proj(double *proj, const double *in, const double *w,
                     const double *bias, size_t rows, size_t din, size_t S)
{
    for (size_t r = 0; r < rows; r++)
        for (size_t s = 0; s < S; s++) {
            double acc = bias ? bias[s] : 0.0;
            for (size_t i = 0; i < din; i++)
                acc += in[r * din + i] * w[i * S + s];
            proj[r * S + s] = acc;
        }
}

/* One head of one row, in place: RMSNorm, or LayerNorm (cfg->norm_type:
   mean removed, the biased variance), with weight w (or none), then RoPE
   at position pos. */
static void ref_head(double *y, size_t d, const double *w, double pos,
                     const mha_config *cfg, const double *inv_freq)
{
    if (w != NULL) {
        double m = 0, ss = 0;
        if (cfg->norm_type == MHA_NORM_LAYER) {
            for (size_t c = 0; c < d; c++)
                m += y[c];
            m /= (double)d;
        }
        for (size_t c = 0; c < d; c++)
            ss += (y[c] - m) * (y[c] - m);
        const double r = 1.0 / sqrt(ss / (double)d + cfg->norm_eps);
        for (size_t c = 0; c < d; c++)
            y[c] = (y[c] - m) * r * w[c];
    }
    const size_t half = cfg->rotary_dim / 2;
    for (size_t c = 0; c < half; c++) {
        double *a = cfg->rope_interleaved ? &y[2 * c] : &y[c];
        double *b = cfg->rope_interleaved ? &y[2 * c + 1] : &y[c + half];
        const double ang = pos * inv_freq[c], co = cos(ang), si = sin(ang);
        const double a0 = *a, b0 = *b;
        *a = a0 * co - b0 * si;
        *b = a0 * si + b0 * co;
    }
}

/* The reference position of query i / key j of batch item b (no packing). */
static double ref_qpos(const problem *P, size_t b, size_t i)
{
    const tcase *c = &P->c;
    if (c->pos == 1)
        return (double)P->pos[b * c->Tq + i];
    if (c->pos == 2)
        return (double)P->pos[i];
    return (double)i + (double)c->Tk - (double)c->Tq;
}

static double ref_kpos(const problem *P, size_t b, size_t j)
{
    const tcase *c = &P->c;
    if (c->kpos == 1)
        return (double)P->kpos[b * c->Tk + j];
    if (c->kpos == 2)
        return (double)P->kpos[j];
    return (double)j;
}

/* The transform of every row of q (key == 0) or k (key == 1), in place. */
static void ref_transform(double *t, const problem *P, int key)
{
    const tcase *c = &P->c;
    const size_t T = key ? c->Tk : c->Tq, S = key ? P->Sk : P->Sq;
    const size_t nh = key ? c->G : c->H, per = key ? 1 : c->H / c->G;
    const int mode = key ? c->kn : c->qn;
    const double *w = key ? P->kn : P->qn;
    for (size_t b = 0; b < c->B; b++)
        for (size_t i = 0; i < T; i++)
            for (size_t h = 0; h < nh; h++) {
                const size_t d = P->dk[h / per], off = key ? P->koff[h] : P->qoff[h];
                const double *wh = mode == 0 ? NULL : (mode == 1 ? w : w + h * d);
                const double pos = key ? ref_kpos(P, b, i) : ref_qpos(P, b, i);
                ref_head(t + (b * T + i) * S + off, d, wh, pos, &P->cfg, P->inv_freq);
            }
}

/* out (B, Tq, Dout) and the raw projections q (B, Tq, Sq), k (B, Tk, Sk). */
static void ref_forward(double *out, double *q, double *k, const problem *P)
{
    const tcase *c = &P->c;
    const size_t B = c->B, Tq = c->Tq, Tk = c->Tk, H = c->H, per = c->H / c->G;
    const size_t nq = B * Tq, nk = B * Tk, dv = c->dv;
    double *qt = malloc((nq * P->Sq + 1) * sizeof *qt);
    double *kt = malloc((nk * P->Sk + 1) * sizeof *kt);
    double *v = malloc((nk * P->Sv + 1) * sizeof *v);
    double *cat = malloc((nq * P->Svq + 1) * sizeof *cat);
    double *p = malloc((Tk + 1) * sizeof *p);
    ref_proj(q, P->x, P->wq, c->bias ? P->bq : NULL, nq, c->Din, P->Sq);
    ref_proj(k, P->key, P->wk, c->bias ? P->bk : NULL, nk, c->Din, P->Sk);
    ref_proj(v, P->value, P->wv, c->bias ? P->bv : NULL, nk, c->Din, P->Sv);
    memcpy(qt, q, nq * P->Sq * sizeof *qt);
    memcpy(kt, k, nk * P->Sk * sizeof *kt);
    ref_transform(qt, P, 0);
    ref_transform(kt, P, 1);
    for (size_t b = 0; b < B; b++)
        for (size_t h = 0; h < H; h++)
            for (size_t i = 0; i < Tq; i++) {
                const size_t g = h / per, d = P->dk[g];
                const double *q_i = qt + (b * Tq + i) * P->Sq + P->qoff[h];
                double m = -INFINITY, l = 0;
                for (size_t j = 0; j < Tk; j++) {
                    const double *k_j = kt + (b * Tk + j) * P->Sk + P->koff[g];
                    double s = 0;
                    for (size_t e = 0; e < d; e++)
                        s += q_i[e] * k_j[e];
                    const int vis = !c->causal || (double)j <= (double)i + (double)Tk - (double)Tq;
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
    if (c->has_wo) {
        ref_proj(out, cat, P->wo, c->bias ? P->bo : NULL, nq, P->Svq, P->Dout);
    } else {
        for (size_t r = 0; r < nq * P->Dout; r++)
            out[r] = cat[r] + (c->bias ? P->bo[r % P->Dout] : 0.0);
    }
    free(qt);
    free(kt);
    free(v);
    free(cat);
    free(p);
}

/* ---- calls into the core ---- */

/* Forward outputs, typed (f64: double, else float); NULL = not wanted. */
typedef struct {
    void *out, *q, *k, *v, *cat, *lse;
} fwd_out;

static void fwd_alloc(fwd_out *o, const problem *P, int f64)
{
    const size_t nq = P->c.B * P->c.Tq, nk = P->c.B * P->c.Tk;
    o->out = zalloc(nq * P->Dout, f64);
    o->q = zalloc(nq * P->Sq, f64);
    o->k = zalloc(nk * P->Sk, f64);
    o->v = zalloc(nk * P->Sv, f64);
    o->cat = zalloc(nq * P->Svq, f64);
    o->lse = zalloc(P->c.B * P->c.H * P->c.Tq, f64);
}

static void fwd_free(fwd_out *o)
{
    free(o->out);
    free(o->q);
    free(o->k);
    free(o->v);
    free(o->cat);
    free(o->lse);
}

/* A bias argument: the typed bias when the case has biases, else NULL. */
#define BIAS(t, name) (P->c.bias ? (t)->name : NULL)

static mha_status run_fwd(problem *P, int f64, fwd_out *o)
{
    cfg_bind(P, f64);
    const typed_in *t = &P->t[f64];
    const void *bo = BIAS(t, bo);
    const mha_params prm = {
        .dtype = f64 ? MHA_DTYPE_F64 : MHA_DTYPE_F32, .out = o->out, .q = o->q, .k = o->k,
        .v = o->v, .concat = o->cat, .lse = o->lse, .x = t->x, .key = t->key,
        .value = t->value, .wq = t->wq, .wk = t->wk, .wv = t->wv,
        .wo = P->c.has_wo ? t->wo : NULL, .bq = BIAS(t, bq), .bk = BIAS(t, bk),
        .bv = BIAS(t, bv), .bo = bo};
    return mha_forward(&P->cfg, &prm, NULL);
}

/* Gradients, typed; NULL = not wanted. */
typedef struct {
    void *dx, *dkey, *dvalue, *dwq, *dwk, *dwv, *dwo, *dbq, *dbk, *dbv, *dbo, *dqn, *dkn;
} grads;

static void grads_alloc(grads *g, const problem *P, int f64)
{
    const tcase *c = &P->c;
    const size_t nq = c->B * c->Tq, nk = c->B * c->Tk;
    g->dx = zalloc(nq * c->Din, f64);
    g->dkey = zalloc(nk * c->Din, f64);
    g->dvalue = zalloc(nk * c->Din, f64);
    g->dwq = zalloc(c->Din * P->Sq, f64);
    g->dwk = zalloc(c->Din * P->Sk, f64);
    g->dwv = zalloc(c->Din * P->Sv, f64);
    g->dwo = zalloc(P->Svq * P->Dout, f64);
    g->dbq = zalloc(P->Sq, f64);
    g->dbk = zalloc(P->Sk, f64);
    g->dbv = zalloc(P->Sv, f64);
    g->dbo = zalloc(P->Dout, f64);
    g->dqn = zalloc(P->nqn, f64);
    g->dkn = zalloc(P->nkn, f64);
}

static void grads_free(grads *g)
{
    void *p[] = {g->dx, g->dkey, g->dvalue, g->dwq, g->dwk, g->dwv, g->dwo,
                 g->dbq, g->dbk, g->dbv, g->dbo, g->dqn, g->dkn};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        free(p[i]);
}

static mha_status run_bwd(problem *P, int f64, grads *g, const void *dout,
                          const fwd_out *o)
{
    cfg_bind(P, f64);
    const typed_in *t = &P->t[f64];
    const void *wo = P->c.has_wo ? t->wo : NULL;
    const mha_params prm = {
        .dtype = f64 ? MHA_DTYPE_F64 : MHA_DTYPE_F32, .dx = g->dx, .dkey = g->dkey,
        .dvalue = g->dvalue, .dwq = g->dwq, .dwk = g->dwk, .dwv = g->dwv, .dwo = g->dwo,
        .dbq = g->dbq, .dbk = g->dbk, .dbv = g->dbv, .dbo = g->dbo, .dq_norm = g->dqn,
        .dk_norm = g->dkn, .dout = dout, .x = t->x, .key = t->key, .value = t->value,
        .wq = t->wq, .wk = t->wk, .wv = t->wv, .wo = wo, .q = o->q, .k = o->k, .v = o->v,
        .concat = o->cat, .lse = o->lse};
    return mha_backward(&P->cfg, &prm, NULL);
}

/* max over i of |a[i] - ref[i]| / (1 + |ref[i]|) */
static double max_err(const void *a, const double *ref, size_t n, int f64)
{
    double e = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs(val(a, i, f64) - ref[i]) / (1.0 + fabs(ref[i]));
        e = d > e || d != d ? d : e;
    }
    return e;
}


/* ---- the tests ---- */

/* Forward against the reference, both types, every ISA. */
static void test_forward(problem *P)
{
    const tcase *c = &P->c;
    const size_t nq = c->B * c->Tq, nk = c->B * c->Tk;
    double *out = malloc((nq * P->Dout + 1) * sizeof *out);
    double *q = malloc((nq * P->Sq + 1) * sizeof *q);
    double *k = malloc((nk * P->Sk + 1) * sizeof *k);
    ref_forward(out, q, k, P);
    for (int isa = 0; isa <= (int)harness_best_isa(); isa++) {
        mha_set_isa((mha_isa)isa);
        for (int f64 = 0; f64 < 2; f64++) {
            /* float32: a few roundings of O(1) values, sums of <= 16 terms */
            const double tol = f64 ? 1e-11 : 3e-5;
            fwd_out o;
            fwd_alloc(&o, P, f64);
            const mha_status st = run_fwd(P, f64, &o);
            CHECK(st == MHA_OK, "%s: forward status %s", c->name, mha_status_name(st));
            const double eo = max_err(o.out, out, nq * P->Dout, f64);
            const double eq = max_err(o.q, q, nq * P->Sq, f64);
            const double ek = max_err(o.k, k, nk * P->Sk, f64);
            CHECK(eo <= tol, "%s %s f%d: out err %.3g", c->name,
                  mha_isa_name((mha_isa)isa), f64 ? 64 : 32, eo);
            CHECK(eq <= tol && ek <= tol, "%s %s f%d: kept q/k not raw (%.3g %.3g)",
                  c->name, mha_isa_name((mha_isa)isa), f64 ? 64 : 32, eq, ek);
            fwd_free(&o);
        }
    }
    mha_set_isa(MHA_ISA_AVX512);
    free(out);
    free(q);
    free(k);
}

/* loss = sum(out * R) by the float64 forward. */
static double loss_f64(problem *P)
{
    fwd_out o = {0};
    o.out = zalloc(P->c.B * P->c.Tq * P->Dout, 1);
    const mha_status st = run_fwd(P, 1, &o);
    CHECK(st == MHA_OK, "%s: loss forward %s", P->c.name, mha_status_name(st));
    double l = 0;
    for (size_t i = 0; i < P->c.B * P->c.Tq * P->Dout; i++)
        l += ((double *)o.out)[i] * P->R[i];
    free(o.out);
    return l;
}

/* Forward then backward with dout = R; every gradient of g filled. */
static void fwd_bwd(problem *P, int f64, fwd_out *o, grads *g)
{
    fwd_alloc(o, P, f64);
    grads_alloc(g, P, f64);
    mha_status st = run_fwd(P, f64, o);
    void *dout = typed(P->R, P->c.B * P->c.Tq * P->Dout, f64);
    if (st == MHA_OK)
        st = run_bwd(P, f64, g, dout, o);
    CHECK(st == MHA_OK, "%s: fwd/bwd %s", P->c.name, mha_status_name(st));
    free(dout);
}

/* Central differences of loss_f64 at `nent` entries of arr (the float64
   copy of an input, n entries) against the gradient grad. */
static void check_fd(problem *P, double *arr, size_t n, const double *grad,
                     const char *what, int nent)
{
    const double h = 1e-5;
    for (int e = 0; e < nent && n > 0; e++) {
        const size_t i = (size_t)(rng_u64() % n);
        const double keep = arr[i];
        arr[i] = keep + h;
        const double lp = loss_f64(P);
        arr[i] = keep - h;
        const double lm = loss_f64(P);
        arr[i] = keep;
        const double fd = (lp - lm) / (2 * h);
        CHECK(fabs(fd - grad[i]) <= 1e-6 * (1 + fabs(grad[i])),
              "%s %s: d%s[%zu] = %.12g, finite difference %.12g", P->c.name,
              mha_isa_name(mha_get_isa()), what, i, grad[i], fd);
    }
}

/* The backward: finite differences (float64), float32 against float64,
   and dq_norm / dk_norm asked for alone. */
static void test_backward(problem *P)
{
    const tcase *c = &P->c;
    const size_t nq = c->B * c->Tq, nk = c->B * c->Tk;
    for (int isa = 0; isa <= (int)harness_best_isa(); isa++) {
        mha_set_isa((mha_isa)isa);
        fwd_out o64, o32;
        grads g64, g32;
        fwd_bwd(P, 1, &o64, &g64);
        typed_in *t = &P->t[1];
        check_fd(P, t->x, nq * c->Din, g64.dx, "x", 3);
        check_fd(P, t->key, nk * c->Din, g64.dkey, "key", 3);
        check_fd(P, t->wq, c->Din * P->Sq, g64.dwq, "wq", 3);
        check_fd(P, t->wk, c->Din * P->Sk, g64.dwk, "wk", 3);
        if (c->qn)
            check_fd(P, t->qn, P->nqn, g64.dqn, "q_norm", 4);
        if (c->kn)
            check_fd(P, t->kn, P->nkn, g64.dkn, "k_norm", 4);
        if (c->bias)
            check_fd(P, t->bq, P->Sq, g64.dbq, "bq", 2);

        // float32 within 1e-4 of float64 (same inputs; O(1) values).
        fwd_bwd(P, 0, &o32, &g32);
        const void *a32[] = {g32.dx, g32.dkey, g32.dwq, g32.dwk, g32.dqn, g32.dkn};
        const double *a64[] = {g64.dx, g64.dkey, g64.dwq, g64.dwk, g64.dqn, g64.dkn};
        const size_t n[] = {nq * c->Din, nk * c->Din, c->Din * P->Sq,
                            c->Din * P->Sk, c->qn ? P->nqn : 0, c->kn ? P->nkn : 0};
        for (int i = 0; i < 6; i++) {
            const double e = max_err(a32[i], a64[i], n[i], 0);
            CHECK(e <= 1e-4, "%s: float32 gradient %d off by %.3g", c->name, i, e);
        }

        // Without dq_norm / dk_norm (passes A and C of the norm fused): the
        // same bits of every other gradient.
        for (int f64 = 0; f64 < 2 && (c->qn || c->kn); f64++) {
            grads none;
            grads_alloc(&none, P, f64);
            free(none.dqn);
            free(none.dkn);
            none.dqn = none.dkn = NULL;
            void *dout = typed(P->R, nq * P->Dout, f64);
            const mha_status st = run_bwd(P, f64, &none, dout, f64 ? &o64 : &o32);
            const grads *all = f64 ? &g64 : &g32;
            CHECK(st == MHA_OK && same_bytes(none.dx, all->dx, nq * c->Din, f64) &&
                      same_bytes(none.dkey, all->dkey, nk * c->Din, f64) &&
                      same_bytes(none.dwq, all->dwq, c->Din * P->Sq, f64) &&
                      same_bytes(none.dwk, all->dwk, c->Din * P->Sk, f64),
                  "%s f%d: the fused norm backward differs", c->name, f64 ? 64 : 32);
            free(dout);
            grads_free(&none);
        }

        // dq_norm / dk_norm alone: the same bits as with every gradient.
        for (int f64 = 0; f64 < 2 && (c->qn || c->kn); f64++) {
            grads only = {0};
            only.dqn = zalloc(P->nqn, f64);
            only.dkn = zalloc(P->nkn, f64);
            void *dout = typed(P->R, nq * P->Dout, f64);
            const mha_status st = run_bwd(P, f64, &only, dout, f64 ? &o64 : &o32);
            const size_t es = f64 ? sizeof(double) : sizeof(float);
            const grads *all = f64 ? &g64 : &g32;
            CHECK(st == MHA_OK && (!c->qn || memcmp(only.dqn, all->dqn, P->nqn * es) == 0) &&
                      (!c->kn || memcmp(only.dkn, all->dkn, P->nkn * es) == 0),
                  "%s f%d: dq_norm / dk_norm alone differ", c->name, f64 ? 64 : 32);
            free(dout);
            grads_free(&only);
        }
        fwd_free(&o64);
        fwd_free(&o32);
        grads_free(&g64);
        grads_free(&g32);
    }
    mha_set_isa(MHA_ISA_AVX512);
}

/* Every output and gradient bitwise the same for 1 and 3 threads. */
static void test_threads(problem *P)
{
    const tcase *c = &P->c;
    const size_t nq = c->B * c->Tq, nk = c->B * c->Tk;
    for (int f64 = 0; f64 < 2; f64++) {
        fwd_out o[2];
        grads g[2];
        for (int r = 0; r < 2; r++) {
            mha_set_num_threads(r == 0 ? 1 : 3);
            fwd_bwd(P, f64, &o[r], &g[r]);
        }
        mha_set_num_threads(0);
        const int fo = same_bytes(o[0].out, o[1].out, nq * P->Dout, f64) &&
                       same_bytes(o[0].lse, o[1].lse, c->B * c->H * c->Tq, f64);
        const void *a[] = {g[0].dx, g[0].dkey, g[0].dvalue, g[0].dwq, g[0].dwk,
                           g[0].dbq, g[0].dbk, g[0].dqn, g[0].dkn};
        const void *b[] = {g[1].dx, g[1].dkey, g[1].dvalue, g[1].dwq, g[1].dwk,
                           g[1].dbq, g[1].dbk, g[1].dqn, g[1].dkn};
        const size_t n[] = {nq * c->Din, nk * c->Din, nk * c->Din, c->Din * P->Sq,
                            c->Din * P->Sk, P->Sq, P->Sk, P->nqn, P->nkn};
        int fg = 1;
        for (int i = 0; i < 9; i++)
            fg = fg && same_bytes(a[i], b[i], n[i], f64);
        CHECK(fo && fg, "%s f%d: 1 and 3 threads differ (forward %d, gradients %d)",
              c->name, f64 ? 64 : 32, fo, fg);
        for (int r = 0; r < 2; r++) {
            fwd_free(&o[r]);
            grads_free(&g[r]);
        }
    }
}

/* mha_qk_forward_f64 alone with packed sequences: the default positions
   restart in each sequence (query r of a sequence of nq queries and nk
   keys at r + nk - nq, key j at its offset in its sequence). */
static void test_packed_positions(void)
{
    const size_t dk[1] = {8}, Tq = 7, Tk = 9, H = 2, S = 8;
    const int64_t cu_q[3] = {0, 3, 7}, cu_k[3] = {0, 5, 9};
    double inv_freq[3] = {1.0, 0.3, 0.07}, scale[2] = {1, 1};
    double *w = rand_range(8, 0.5, 1.5);
    mha_config cfg = {
        .B = 1, .Tq = Tq, .Tk = Tk, .H = H, .G = 1, .dk = dk, .dv = dk,
        .scale = scale, .nseq = 2, .cu_q = cu_q, .cu_k = cu_k, .q_norm = w,
        .norm_eps = 1e-6, .rotary_dim = 6, .inv_freq = inv_freq,
    };
    const mha_layout lay = {.Sq = H * S, .Sk = S, .Sv = S, .Svq = H * S};
    const size_t qoff[2] = {0, 8}, koff[1] = {0};
    double *q = rand_vec(Tq * H * S, 1), *k = rand_vec(Tk * S, 1);
    double *qt = calloc(Tq * H * S, sizeof *qt), *kt = calloc(Tk * S, sizeof *kt);
    mha_status st = mha_qk_forward_f64(qt, kt, q, k, &cfg, &lay, qoff, koff);
    CHECK(st == MHA_OK, "packed: status %s", mha_status_name(st));
    double worst = 0;
    for (size_t i = 0; i < Tq; i++) {
        const size_t s = i < 3 ? 0 : 1;
        const double nqs = (double)(cu_q[s + 1] - cu_q[s]), nks = (double)(cu_k[s + 1] - cu_k[s]);
        const double pos = (double)i - (double)cu_q[s] + nks - nqs;
        for (size_t h = 0; h < H; h++) {
            double y[8];
            memcpy(y, q + i * H * S + h * S, sizeof y);
            ref_head(y, 8, w, pos, &cfg, inv_freq);
            for (size_t c = 0; c < 8; c++)
                worst = fmax(worst, fabs(y[c] - qt[i * H * S + h * S + c]));
        }
    }
    for (size_t j = 0; j < Tk; j++) {
        double y[8];
        memcpy(y, k + j * S, sizeof y);
        ref_head(y, 8, NULL, (double)j - (j < 5 ? 0.0 : 5.0), &cfg, inv_freq);
        for (size_t c = 0; c < 8; c++)
            worst = fmax(worst, fabs(y[c] - kt[j * S + c]));
    }
    CHECK(worst <= 1e-14, "packed positions: qt / kt off by %.3g", worst);
    // Bad settings are refused, not read out of bounds.
    cfg.rotary_dim = 10;
    CHECK(mha_qk_forward_f64(qt, kt, q, k, &cfg, &lay, qoff, koff) == MHA_ERR_ARG,
          "rotary_dim > dk accepted");
    cfg.rotary_dim = 5;
    CHECK(mha_qk_forward_f64(qt, kt, q, k, &cfg, &lay, qoff, koff) == MHA_ERR_ARG,
          "odd rotary_dim accepted");
    free(w);
    free(q);
    free(k);
    free(qt);
    free(kt);
}

/* Empty axes (no keys, no queries, no batch) with both transforms: the
   calls succeed, and a weight's gradient summed over no row is 0. A raised
   interrupt flag stops the calls (ASan: nothing leaks on that path). */
static void test_edges(void)
{
    const tcase base = {"edge", 2, 3, 4, 5, 2, 1, 3, {6}, 1, 1, 1, 2, 1, 4, 0, 0, 0, 0, 0};
    const size_t shapes[3][3] = {{2, 3, 0}, {2, 0, 4}, {0, 3, 4}};
    for (int e = 0; e < 6; e++) {
        tcase c = base;
        c.ln = e >= 3;   /* each empty axis with RMSNorm, then LayerNorm */
        c.B = shapes[e % 3][0];
        c.Tq = shapes[e % 3][1];
        c.Tk = shapes[e % 3][2];
        problem P;
        problem_init(&P, &c);
        for (int f64 = 0; f64 < 2; f64++) {
            fwd_out o;
            grads g;
            fwd_bwd(&P, f64, &o, &g);
            int zq = 1, zk = 1;
            for (size_t i = 0; i < P.nqn; i++)
                zq = zq && val(g.dqn, i, f64) == 0.0;
            for (size_t i = 0; i < P.nkn; i++)
                zk = zk && val(g.dkn, i, f64) == 0.0;
            CHECK((c.B * c.Tq == 0 ? zq : 1) && (c.B * c.Tk == 0 || c.B * c.Tq == 0 ? zk : 1),
                  "edge B=%zu Tq=%zu Tk=%zu f%d: norm gradients not 0", c.B, c.Tq, c.Tk,
                  f64 ? 64 : 32);
            fwd_free(&o);
            grads_free(&g);
        }
        problem_free(&P);
    }
    problem P;
    problem_init(&P, &base);
    int flag = 1;
    fwd_out o;
    grads g;
    fwd_alloc(&o, &P, 1);
    grads_alloc(&g, &P, 1);
    CHECK(run_fwd(&P, 1, &o) == MHA_OK, "edge: forward");
    P.cfg.interrupt = &flag;
    CHECK(run_fwd(&P, 1, &o) == MHA_ERR_INTERRUPTED, "edge: forward not interrupted");
    double *dout = typed(P.R, base.B * base.Tq * P.Dout, 1);
    CHECK(run_bwd(&P, 1, &g, dout, &o) == MHA_ERR_INTERRUPTED,
          "edge: backward not interrupted");
    free(dout);
    fwd_free(&o);
    grads_free(&g);
    problem_free(&P);
}

/* name, B, Tq, Tk, Din, H, G, dv, dk[], has_wo, causal, bias, qn, kn, rot,
   inter, custom_freq, pos, kpos, ln */
static const tcase k_cases[] = {
    {"norm shared", 2, 5, 7, 6, 2, 2, 4, {8}, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0},
    {"norm per head gqa causal bias", 2, 6, 6, 6, 4, 2, 3, {6}, 1, 1, 1, 2, 2, 0, 0, 0, 0, 0, 0},
    {"q norm only", 1, 4, 5, 5, 2, 1, 3, {7}, 1, 0, 1, 2, 0, 0, 0, 0, 0, 0, 0},
    {"rope neox full", 2, 5, 5, 6, 2, 2, 4, {8}, 1, 0, 0, 0, 0, 8, 0, 0, 0, 0, 0},
    {"rope gptj partial custom freq", 1, 6, 8, 5, 2, 2, 4, {10}, 1, 0, 0, 0, 0, 6, 1, 1, 0, 0, 0},
    {"rope positions (B,Tq) key (B,Tk) causal", 2, 5, 6, 6, 2, 2, 4, {8}, 1, 1, 0, 0, 0, 4, 0, 0, 1, 1, 0},
    {"rope positions (Tq,) key (Tk,) gqa", 2, 4, 7, 5, 4, 1, 3, {6}, 1, 0, 1, 0, 0, 6, 1, 0, 2, 2, 0},
    {"rope ragged heads", 2, 5, 6, 6, 2, 2, 3, {8, 12}, 1, 0, 0, 0, 0, 8, 0, 0, 0, 0, 0},
    {"both gqa bias causal no wo", 2, 4, 9, 6, 4, 2, 3, {8}, 0, 1, 1, 2, 1, 6, 0, 0, 0, 0, 0},
    {"both interleaved custom", 1, 6, 6, 7, 3, 3, 2, {6}, 1, 0, 0, 1, 2, 4, 1, 1, 1, 0, 0},
    {"k norm rope Tq > Tk causal", 2, 7, 4, 5, 2, 2, 3, {8}, 1, 1, 0, 0, 2, 4, 1, 0, 0, 0, 0},
    // LayerNorm (issue 38): shared and per-head weights, one side alone, odd
    // widths (d = 7, 5: the four-chain sums' tails), with RoPE, GQA, biases.
    {"layer norm shared", 2, 5, 7, 6, 2, 2, 4, {8}, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1},
    {"layer norm per head gqa causal bias odd", 2, 6, 6, 6, 4, 2, 3, {7}, 1, 1, 1, 2, 2, 0, 0,
     0, 0, 0, 1},
    {"layer q norm only d 5", 1, 4, 5, 5, 2, 1, 3, {5}, 1, 0, 1, 2, 0, 0, 0, 0, 0, 0, 1},
    {"layer k norm rope Tq > Tk causal", 2, 7, 4, 5, 2, 2, 3, {8}, 1, 1, 0, 0, 2, 4, 1, 0, 0,
     0, 1},
    {"layer both rope gqa bias no wo positions", 2, 4, 9, 6, 4, 2, 3, {6}, 0, 1, 1, 2, 1, 6, 0,
     1, 1, 2, 1},
};

/* Large enough that the transforms, the attention and the GEMMs all split
   their work over the threads. */
static const tcase k_big = {"big", 2, 256, 256, 64, 4, 2, 16, {64}, 1, 1, 1, 2, 1, 32, 0, 0, 0,
                            0, 0};
static const tcase k_big_ln = {"big layer norm", 2, 256, 256, 64, 4, 2, 16, {64}, 1, 1, 1, 2,
                               1, 32, 0, 0, 0, 0, 1};

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* ./test_qk bench [reps]: medians (thread CPU time, one thread, float32)
   of the transforms alone and of forwards of T = 1024, d_model = 512,
   8 heads, causal, with and without RoPE + q/k norm. */
/* Seconds of this thread's CPU time where POSIX has the clock (steadier
   on a shared machine), else of the monotonic clock. */
static double cpu_s(void)
{
#if defined(CLOCK_THREAD_CPUTIME_ID)
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
#else
    return now_s();
#endif
}

static void bench(int reps)
{
    const tcase c = {"bench", 1, 1024, 1024, 512, 8, 8, 64, {64}, 1, 1, 0, 1, 1, 64, 0, 0, 0, 0, 0};
    problem P;
    problem_init(&P, &c);
    mha_set_num_threads(1);
    fwd_out o;
    fwd_alloc(&o, &P, 0);
    float *qt = malloc(1024 * 512 * sizeof *qt), *kt = malloc(1024 * 512 * sizeof *kt);
    double t[64];
    reps = reps < 1 ? 1 : (reps > 64 ? 64 : reps);
    const char *names[4] = {"transforms alone", "forward, rope + norm", "forward, plain",
                            "forward, rope only"};
    for (int which = 0; which < 4; which++) {
        cfg_bind(&P, 0);
        if (which == 2)
            P.cfg.q_norm = P.cfg.k_norm = NULL, P.cfg.rotary_dim = 0;
        if (which == 3)
            P.cfg.q_norm = P.cfg.k_norm = NULL, P.cfg.rotary_dim = 64;
        for (int r = 0; r < reps; r++) {
            const double a = cpu_s();
            if (which == 0) {
                mha_qk_forward_f32(qt, kt, o.q, o.k, &P.cfg,
                                   &(mha_layout){.Sq = P.Sq, .Sk = P.Sk, .Sv = P.Sv, .Svq = P.Svq},
                                   P.qoff, P.koff);
            } else {
                const mha_config keep = P.cfg;
                const typed_in *ti = &P.t[0];
                const mha_params prm = {.dtype = MHA_DTYPE_F32, .out = o.out, .x = ti->x,
                                        .key = ti->key, .value = ti->value, .wq = ti->wq,
                                        .wk = ti->wk, .wv = ti->wv, .wo = ti->wo};
                mha_forward(&P.cfg, &prm, NULL);
                P.cfg = keep;
            }
            t[r] = cpu_s() - a;
        }
        qsort(t, (size_t)reps, sizeof t[0], cmp_double);
        printf("%-22s median %.3f ms (min %.3f) of %d\n", names[which], 1e3 * t[reps / 2],
               1e3 * t[0], reps);
    }
    mha_set_num_threads(0);
    free(qt);
    free(kt);
    fwd_free(&o);
    problem_free(&P);
}

/* ./test_qk once plain|qk: one forward and one backward of the bench's
   shape on one thread, float32, for an instruction count, e.g.
   valgrind --tool=callgrind --toggle-collect=mha_forward ./test_qk once qk */
static void once(int qk)
{
    const tcase c = {"once", 1, 1024, 1024, 512, 8, 8, 64, {64}, 1, 1, 0, 1, 1, 64, 0, 0, 0, 0, 0};
    problem P;
    problem_init(&P, &c);
    mha_set_num_threads(1);
    if (!qk) {
        P.c.qn = P.c.kn = 0;
        P.cfg.rotary_dim = 0;
    }
    fwd_out o;
    grads g;
    fwd_bwd(&P, 0, &o, &g);
    fwd_free(&o);
    grads_free(&g);
    problem_free(&P);
}

int main(int argc, char **argv)
{
    if (argc > 2 && strcmp(argv[1], "once") == 0) {
        once(strcmp(argv[2], "qk") == 0);
        return g_failures != 0;
    }
    if (argc > 1 && strcmp(argv[1], "bench") == 0) {
        bench(argc > 2 ? atoi(argv[2]) : 7);
        return 0;
    }
    const int quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    const double t0 = now_s();
    test_packed_positions();
    test_edges();
    const size_t ncases = sizeof k_cases / sizeof k_cases[0];
    for (size_t i = 0; i < ncases; i++) {
        problem P;
        problem_init(&P, &k_cases[i]);
        printf("%s ...\n", k_cases[i].name);
        fflush(stdout);
        test_forward(&P);
        if (!quick || i % 3 == 0)
            test_backward(&P);
        test_threads(&P);
        problem_free(&P);
    }
    const tcase *bigs[2] = {&k_big, &k_big_ln};
    for (int i = 0; i < 2; i++) {
        problem big;
        problem_init(&big, bigs[i]);
        printf("%s ...\n", bigs[i]->name);
        test_threads(&big);
        problem_free(&big);
    }
    printf("%ld checks, %d failures (%.1f s)\n", g_checks, g_failures, now_s() - t0);
    return g_failures != 0;
}
