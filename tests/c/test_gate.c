/*
 * test_gate.c - tests of the output gate (csrc/core/gate.c; mha.h, the
 * wgate and bgate of mha_params) in mha_forward and mha_backward:
 * out = (sigmoid(x wgate + bgate) * concat) wo + bo.
 *
 * Build and run (see the Makefile beside this file):
 *   make -C tests/c check      # optimised build + ASan/UBSan build, both run
 *   ./test_gate [quick]
 *
 * What is checked:
 *   - mha_forward (float32 and float64) against a naive double reference
 *     (plain loops: project, softmax attention, the gate, W^O), on every
 *     ISA this machine runs: self- and cross-attention (the gate reads x,
 *     never key), GQA, causal, with and without W^O and bgate; the kept
 *     concat is the heads' own, before the gate;
 *   - a gate held open (wgate 0, bgate 40: g is 1 exactly) gives the bits
 *     of the call without a gate, and one held shut (bgate -800: g is 0)
 *     out = bo exactly;
 *   - mha_backward_f64 against central finite differences of
 *     loss = sum(out * R) at entries of x, key, wq, wo, wgate and bgate,
 *     float32's gradients against float64's, and dwgate / dbgate asked for
 *     alone give the bits of a call that asks for every gradient;
 *   - bitwise equality of the output and every gradient for 1 and 3
 *     threads, the GEMMs split between them (mha_gemm_set_grain);
 *   - a float32 forward with float16 or bfloat16 weights (wgate among
 *     them, mha_params.w_storage) gives the bits of the forward on the
 *     widened weights;
 *   - bgate without wgate is refused (MHA_ERR_ARG, field PARAMS) by both.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "gemm.h"
#include "half.h"
#include "mha.h"
#include "threads.h"

#include "harness.h"

/* One case. Without cross, key and value are x (Tk == Tq, Dkin == Din);
   with it, value is key. bias: bgate and bo. */
typedef struct {
    const char *name;
    size_t B, Tq, Tk, Din, Dkin, H, G, dk, dv;
    int has_wo, causal, bias, cross;
} tcase;

/* The inputs, by index into problem.in and its typed copies. */
enum { X, KEY, WQ, WK, WV, WO, BO, WG, BG, NIN };

typedef struct {
    tcase c;
    size_t Sq, Sk, Sv, Svq, Dout, n[NIN];
    size_t dk[8], dv[8];
    double scale[16];
    double *in[NIN];   /* as doubles that are exactly floats */
    void *t[2][NIN];   /* typed copies: [0] float, [1] double */
    double *R;         /* (B, Tq, Dout): loss = sum(out * R) */
    mha_config cfg;
} problem;

static void problem_init(problem *P, const tcase *c)
{
    memset(P, 0, sizeof *P);
    P->c = *c;
    for (size_t g = 0; g < c->G; g++)
        P->dk[g] = c->dk, P->dv[g] = c->dv;
    P->Sk = c->G * c->dk, P->Sv = c->G * c->dv;
    P->Sq = c->H * c->dk, P->Svq = c->H * c->dv;
    for (size_t h = 0; h < c->H; h++)
        P->scale[h] = 1.0 / sqrt((double)c->dk) * (1.0 + 0.1 * (double)h);
    P->Dout = c->has_wo ? 5 : P->Svq;
    const size_t nq = c->B * c->Tq, nk = c->B * c->Tk;
    const size_t n[NIN] = {nq * c->Din, nk * c->Dkin, c->Din * P->Sq, c->Dkin * P->Sk,
                           c->Dkin * P->Sv, P->Svq * P->Dout, P->Dout, c->Din * P->Svq,
                           P->Svq};
    const double amp[NIN] = {1, 1, 0.6, 0.6, 0.6, 0.5, 0.5, 0.7, 0.8};
    for (int i = 0; i < NIN; i++) {
        P->n[i] = n[i];
        P->in[i] = rand_vec(n[i], amp[i]);
        P->t[0][i] = typed(P->in[i], n[i], 0);
        P->t[1][i] = typed(P->in[i], n[i], 1);
    }
    P->R = rand_vec(nq * P->Dout, 1);
    P->cfg = (mha_config){
        .B = c->B, .Tq = c->Tq, .Tk = c->Tk, .Din = c->Din, .Dkin = c->Dkin,
        .Dvin = c->Dkin, .Dout = P->Dout, .H = c->H, .G = c->G, .dk = P->dk, .dv = P->dv,
        .scale = P->scale, .causal = c->causal, .has_wo = c->has_wo,
    };
}

static void problem_free(problem *P)
{
    for (int i = 0; i < NIN; i++) {
        free(P->in[i]);
        free(P->t[0][i]);
        free(P->t[1][i]);
    }
    free(P->R);
}

/* ---- the reference, in double with plain loops ---- */

/* y (rows, S) = a (rows, din) w (din, S) + bias */
static void ref_proj(double *y, const double *a, const double *w, const double *bias,
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

/* out (B, Tq, Dout) and cat (B, Tq, Svq), the heads before the gate. */
static void ref_forward(double *out, double *cat, const problem *P)
{
    const tcase *c = &P->c;
    const size_t B = c->B, Tq = c->Tq, Tk = c->Tk, per = c->H / c->G;
    const size_t nq = B * Tq, nk = B * Tk, Svq = P->Svq;
    double *const *in = P->in;
    const double *key = c->cross ? in[KEY] : in[X];
    double *q = xcalloc(nq * P->Sq, sizeof *q), *k = xcalloc(nk * P->Sk, sizeof *k);
    double *v = xcalloc(nk * P->Sv, sizeof *v), *p = xcalloc(Tk, sizeof *p);
    double *gated = xcalloc(nq * Svq, sizeof *gated);
    ref_proj(q, in[X], in[WQ], NULL, nq, c->Din, P->Sq);
    ref_proj(k, key, in[WK], NULL, nk, c->Dkin, P->Sk);
    ref_proj(v, key, in[WV], NULL, nk, c->Dkin, P->Sv);
    for (size_t b = 0; b < B; b++)
        for (size_t h = 0; h < c->H; h++)
            for (size_t i = 0; i < Tq; i++) {
                const size_t g = h / per;
                double m = -INFINITY, l = 0;
                for (size_t j = 0; j < Tk; j++) {
                    double s = 0;
                    for (size_t e = 0; e < c->dk; e++)
                        s += q[(b * Tq + i) * P->Sq + h * c->dk + e] *
                             k[(b * Tk + j) * P->Sk + g * c->dk + e];
                    const int vis = !c->causal || (double)j <= (double)i + (double)Tk - (double)Tq;
                    p[j] = vis ? P->scale[h] * s : -INFINITY;
                    m = p[j] > m ? p[j] : m;
                }
                for (size_t j = 0; j < Tk; j++) {
                    p[j] = m == -INFINITY ? 0.0 : exp(p[j] - m);
                    l += p[j];
                }
                for (size_t e = 0; e < c->dv; e++) {
                    double acc = 0;
                    for (size_t j = 0; j < Tk; j++)
                        acc += p[j] * v[(b * Tk + j) * P->Sv + g * c->dv + e];
                    cat[(b * Tq + i) * Svq + h * c->dv + e] = l > 0 ? acc / l : 0.0;
                }
            }
    // The gate: z = x wgate + bgate, per query row; gated = sigmoid(z) cat.
    ref_proj(gated, in[X], in[WG], c->bias ? in[BG] : NULL, nq, c->Din, Svq);
    for (size_t r = 0; r < nq * Svq; r++)
        gated[r] = cat[r] / (1.0 + exp(-gated[r]));
    if (c->has_wo)
        ref_proj(out, gated, in[WO], c->bias ? in[BO] : NULL, nq, Svq, P->Dout);
    else
        for (size_t r = 0; r < nq * Svq; r++)
            out[r] = gated[r] + (c->bias ? in[BO][r % Svq] : 0.0);
    free(q);
    free(k);
    free(v);
    free(p);
    free(gated);
}

/* ---- calls into the core ---- */

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

/* The forward of the inputs in (typed: in[i] for f64 or float), with the
   gate when gate, of element type dtype and weight storage ws. */
static mha_status forward_of(problem *P, void *const *in, int f64, int gate, fwd_out *o,
                             mha_kv_storage ws)
{
    const tcase *c = &P->c;
    const void *key = c->cross ? in[KEY] : in[X];
    const mha_params prm = {
        .dtype = f64 ? MHA_DTYPE_F64 : MHA_DTYPE_F32, .out = o->out, .q = o->q, .k = o->k,
        .v = o->v, .concat = o->cat, .lse = o->lse, .x = in[X], .key = key, .value = key,
        .wq = in[WQ], .wk = in[WK], .wv = in[WV], .wo = c->has_wo ? in[WO] : NULL,
        .bo = c->bias ? in[BO] : NULL, .wgate = gate ? in[WG] : NULL,
        .bgate = gate && c->bias ? in[BG] : NULL, .w_storage = ws};
    return mha_forward(&P->cfg, &prm, NULL);
}

static mha_status run_fwd(problem *P, int f64, fwd_out *o)
{
    return forward_of(P, P->t[f64], f64, 1, o, MHA_KV_PLAIN);
}

/* The gradients; NULL = not wanted. */
typedef struct {
    void *dx, *dkey, *dwq, *dwk, *dwv, *dwo, *dbo, *dwg, *dbg;
} grads;
#define NGRAD 9

static void grads_alloc(grads *g, const problem *P, int f64)
{
    const tcase *c = &P->c;
    g->dx = zalloc(P->n[X], f64);
    g->dkey = c->cross ? zalloc(P->n[KEY], f64) : NULL;
    g->dwq = zalloc(P->n[WQ], f64);
    g->dwk = zalloc(P->n[WK], f64);
    g->dwv = zalloc(P->n[WV], f64);
    g->dwo = zalloc(P->n[WO], f64);
    g->dbo = zalloc(P->n[BO], f64);
    g->dwg = zalloc(P->n[WG], f64);
    g->dbg = zalloc(P->n[BG], f64);
}

static void grads_free(grads *g)
{
    void *p[NGRAD] = {g->dx, g->dkey, g->dwq, g->dwk, g->dwv, g->dwo, g->dbo, g->dwg, g->dbg};
    for (int i = 0; i < NGRAD; i++)
        free(p[i]);
}

static mha_status run_bwd(problem *P, int f64, grads *g, const void *dout, const fwd_out *o)
{
    const tcase *c = &P->c;
    void *const *in = P->t[f64];
    const void *key = c->cross ? in[KEY] : in[X];
    // Self-attention: key and value are x, their gradients added into dx.
    void *dkey = c->cross ? g->dkey : g->dx;
    const mha_params prm = {
        .dtype = f64 ? MHA_DTYPE_F64 : MHA_DTYPE_F32, .dx = g->dx, .dkey = dkey,
        .dvalue = dkey, .dwq = g->dwq, .dwk = g->dwk, .dwv = g->dwv, .dwo = g->dwo,
        .dbo = g->dbo, .dwgate = g->dwg, .dbgate = g->dbg, .dout = dout, .x = in[X],
        .key = key, .value = key, .wq = in[WQ], .wk = in[WK], .wv = in[WV],
        .wo = c->has_wo ? in[WO] : NULL, .wgate = in[WG], .bgate = c->bias ? in[BG] : NULL,
        .q = o->q, .k = o->k, .v = o->v, .concat = o->cat, .lse = o->lse};
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

/* Forward against the reference, both types, every ISA; the kept concat
   is the heads' own, before the gate. */
static void test_forward(problem *P)
{
    const tcase *c = &P->c;
    const size_t nq = c->B * c->Tq;
    double *out = xcalloc(nq * P->Dout, sizeof *out), *cat = xcalloc(nq * P->Svq, sizeof *cat);
    ref_forward(out, cat, P);
    for (int isa = 0; isa <= (int)harness_best_isa(); isa++) {
        mha_set_isa((mha_isa)isa);
        for (int f64 = 0; f64 < 2; f64++) {
            // float32: a few roundings of O(1) values, sums of <= 50 terms
            const double tol = f64 ? 1e-12 : 3e-5;
            fwd_out o;
            fwd_alloc(&o, P, f64);
            const mha_status st = run_fwd(P, f64, &o);
            const double eo = max_err(o.out, out, nq * P->Dout, f64);
            const double ec = max_err(o.cat, cat, nq * P->Svq, f64);
            CHECK(st == MHA_OK && eo <= tol && ec <= tol, "%s %s f%d: %s, out err %.3g, "
                  "concat err %.3g", c->name, mha_isa_name((mha_isa)isa), f64 ? 64 : 32,
                  mha_status_name(st), eo, ec);
            fwd_free(&o);
        }
    }
    mha_set_isa(MHA_ISA_AVX512);
    free(out);
    free(cat);
}

/* A gate held open (g = 1 exactly) is no gate, bit for bit; one held shut
   (g = 0 exactly) leaves out = bo. */
static void test_open_and_shut(problem *P)
{
    const tcase *c = &P->c;
    const size_t nq = c->B * c->Tq, n = nq * P->Dout;
    for (int f64 = 0; f64 < 2; f64++) {
        void *in[NIN];
        memcpy(in, P->t[f64], sizeof in);
        in[WG] = zalloc(P->n[WG], f64);
        void *bias = zalloc(P->n[BG], f64);
        in[BG] = bias;
        fwd_out plain, open, shut;
        fwd_alloc(&plain, P, f64);
        fwd_alloc(&open, P, f64);
        fwd_alloc(&shut, P, f64);
        const mha_config keep = P->cfg;
        tcase *cm = &P->c;
        const int had_bias = cm->bias;
        cm->bias = 1;   // bgate and bo given
        for (size_t i = 0; i < P->n[BG]; i++) {
            if (f64)
                ((double *)bias)[i] = 40.0;
            else
                ((float *)bias)[i] = 40.0f;
        }
        mha_status st = forward_of(P, in, f64, 0, &plain, MHA_KV_PLAIN);
        if (st == MHA_OK)
            st = forward_of(P, in, f64, 1, &open, MHA_KV_PLAIN);
        for (size_t i = 0; i < P->n[BG]; i++) {
            if (f64)
                ((double *)bias)[i] = -800.0;
            else
                ((float *)bias)[i] = -800.0f;
        }
        if (st == MHA_OK)
            st = forward_of(P, in, f64, 1, &shut, MHA_KV_PLAIN);
        int shut_ok = 1;
        for (size_t r = 0; r < nq; r++)
            for (size_t o = 0; o < P->Dout; o++)
                shut_ok &= val(shut.out, r * P->Dout + o, f64) == val(in[BO], o, f64);
        CHECK(st == MHA_OK && same_bytes(open.out, plain.out, n, f64) && shut_ok,
              "%s f%d: an open gate differs from none, or a shut one leaves more than bo",
              c->name, f64 ? 64 : 32);
        cm->bias = had_bias;
        P->cfg = keep;
        fwd_free(&plain);
        fwd_free(&open);
        fwd_free(&shut);
        free(in[WG]);
        free(bias);
    }
}

/* loss = sum(out * R) by the float64 forward on the typed inputs. */
static double loss_f64(problem *P)
{
    fwd_out o;
    fwd_alloc(&o, P, 1);
    const mha_status st = run_fwd(P, 1, &o);
    CHECK(st == MHA_OK, "%s: loss forward %s", P->c.name, mha_status_name(st));
    double l = 0;
    for (size_t i = 0; i < P->c.B * P->c.Tq * P->Dout; i++)
        l += ((double *)o.out)[i] * P->R[i];
    fwd_free(&o);
    return l;
}

/* Forward, then backward with dout = R into g (allocated here). */
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

/* Central differences of loss_f64 at nent entries of input `which`. */
static void check_fd(problem *P, int which, const void *grad, const char *what, int nent)
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
              "difference %.12g", P->c.name, mha_isa_name(mha_get_isa()), what, i, gi, fd);
    }
}

/* The backward: finite differences (float64), float32 against float64,
   and dwgate, dbgate asked for alone. */
static void test_backward(problem *P)
{
    const tcase *c = &P->c;
    for (int isa = 0; isa <= (int)harness_best_isa(); isa++) {
        mha_set_isa((mha_isa)isa);
        fwd_out o64, o32;
        grads g64, g32;
        fwd_bwd(P, 1, &o64, &g64);
        check_fd(P, X, g64.dx, "x", 4);
        if (c->cross)
            check_fd(P, KEY, g64.dkey, "key", 3);
        check_fd(P, WQ, g64.dwq, "wq", 2);
        check_fd(P, WV, g64.dwv, "wv", 2);
        check_fd(P, WG, g64.dwg, "wgate", 5);
        if (c->has_wo)
            check_fd(P, WO, g64.dwo, "wo", 3);
        if (c->bias)
            check_fd(P, BG, g64.dbg, "bgate", 4);

        // float32 within 1e-4 of float64 (the same inputs, O(1) values).
        fwd_bwd(P, 0, &o32, &g32);
        const void *a32[] = {g32.dx, g32.dwq, g32.dwg, g32.dbg};
        const void *a64[] = {g64.dx, g64.dwq, g64.dwg, g64.dbg};
        const size_t n[] = {P->n[X], P->n[WQ], P->n[WG], P->n[BG]};
        for (int i = 0; i < 4; i++) {
            double e = 0;
            for (size_t j = 0; j < n[i]; j++)
                e = fmax(e, fabs(val(a32[i], j, 0) - val(a64[i], j, 1)) /
                                (1 + fabs(val(a64[i], j, 1))));
            CHECK(e <= 1e-4, "%s: float32 gradient %d off by %.3g", c->name, i, e);
        }

        // dwgate and dbgate alone: the bits of the call that asks for all.
        for (int f64 = 0; f64 < 2; f64++) {
            grads only = {0};
            only.dwg = zalloc(P->n[WG], f64);
            only.dbg = zalloc(P->n[BG], f64);
            void *dout = typed(P->R, c->B * c->Tq * P->Dout, f64);
            const mha_status st = run_bwd(P, f64, &only, dout, f64 ? &o64 : &o32);
            const grads *all = f64 ? &g64 : &g32;
            CHECK(st == MHA_OK && same_bytes(only.dwg, all->dwg, P->n[WG], f64) &&
                      same_bytes(only.dbg, all->dbg, P->n[BG], f64),
                  "%s f%d: dwgate / dbgate alone differ", c->name, f64 ? 64 : 32);
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

/* The output and every gradient bitwise the same for 1 and 3 threads,
   with the GEMMs split between the threads however small. */
static void test_threads(problem *P)
{
    const tcase *c = &P->c;
    const size_t nq = c->B * c->Tq;
    const size_t grain = mha_gemm_set_grain(1);
    for (int f64 = 0; f64 < 2; f64++) {
        fwd_out o[2];
        grads g[2];
        for (int r = 0; r < 2; r++) {
            mha_set_num_threads(r == 0 ? 1 : 3);
            fwd_bwd(P, f64, &o[r], &g[r]);
        }
        mha_set_num_threads(0);
        const int fo = same_bytes(o[0].out, o[1].out, nq * P->Dout, f64) &&
                       same_bytes(o[0].cat, o[1].cat, nq * P->Svq, f64);
        const void *a[NGRAD] = {g[0].dx, g[0].dkey, g[0].dwq, g[0].dwk, g[0].dwv,
                                g[0].dwo, g[0].dbo, g[0].dwg, g[0].dbg};
        const void *b[NGRAD] = {g[1].dx, g[1].dkey, g[1].dwq, g[1].dwk, g[1].dwv,
                                g[1].dwo, g[1].dbo, g[1].dwg, g[1].dbg};
        const size_t n[NGRAD] = {P->n[X], P->n[KEY], P->n[WQ], P->n[WK], P->n[WV],
                                 P->n[WO], P->n[BO], P->n[WG], P->n[BG]};
        int fg = 1;
        for (int i = 0; i < NGRAD; i++)
            fg = fg && same_bytes(a[i], b[i], n[i], f64);
        CHECK(fo && fg, "%s f%d: 1 and 3 threads differ (forward %d, gradients %d)",
              c->name, f64 ? 64 : 32, fo, fg);
        for (int r = 0; r < 2; r++) {
            fwd_free(&o[r]);
            grads_free(&g[r]);
        }
    }
    mha_gemm_set_grain(grain);
}

/* Half weights (mha_params.w_storage): wq, wk, wv, wo and wgate as float16
   or bfloat16 bits give the bits of the float32 forward on the widened
   weights, the gate's GEMM reading panels packed with the others. */
static void test_half(problem *P)
{
    const tcase *c = &P->c;
    const size_t n = c->B * c->Tq * P->Dout;
    static const int weights[5] = {WQ, WK, WV, WO, WG};
    for (int bf = 0; bf < 2; bf++) {
        void *bits[NIN], *wide[NIN];
        memcpy(bits, P->t[0], sizeof bits);
        memcpy(wide, P->t[0], sizeof wide);
        for (int w = 0; w < 5; w++) {
            const int i = weights[w];
            uint16_t *h = xcalloc(P->n[i], sizeof *h);
            float *f = xcalloc(P->n[i], sizeof *f);
            for (size_t j = 0; j < P->n[i]; j++) {
                const float x = (float)P->in[i][j];
                h[j] = bf ? mha_f32_to_bf16(x) : mha_f32_to_f16(x);
                f[j] = bf ? mha_bf16_to_f32(h[j]) : mha_f16_to_f32(h[j]);
            }
            bits[i] = h;
            wide[i] = f;
        }
        fwd_out a, b;
        fwd_alloc(&a, P, 0);
        fwd_alloc(&b, P, 0);
        mha_status st = forward_of(P, bits, 0, 1, &a, bf ? MHA_KV_BF16 : MHA_KV_F16);
        const mha_status st2 = forward_of(P, wide, 0, 1, &b, MHA_KV_PLAIN);
        CHECK(st == MHA_OK && st2 == MHA_OK && same_bytes(a.out, b.out, n, 0),
              "%s %s: half weights differ from the float32 forward on their widened values "
              "(%s)", c->name, bf ? "bfloat16" : "float16", mha_status_name(st));
        fwd_free(&a);
        fwd_free(&b);
        for (int w = 0; w < 5; w++) {
            free(bits[weights[w]]);
            free(wide[weights[w]]);
        }
    }
}

/* bgate without wgate: refused by the forward and the backward alike. */
static void test_reject(problem *P)
{
    fwd_out o;
    fwd_alloc(&o, P, 1);
    void *const *in = P->t[1];
    mha_params prm = {.dtype = MHA_DTYPE_F64, .out = o.out, .q = o.q, .k = o.k, .v = o.v,
                      .concat = o.cat, .lse = o.lse, .x = in[X], .key = in[X], .value = in[X],
                      .wq = in[WQ], .wk = in[WK], .wv = in[WV], .wo = in[WO],
                      .bgate = in[BG]};
    mha_error err;
    mha_status st = mha_forward(&P->cfg, &prm, &err);
    CHECK(st == MHA_ERR_ARG && err.field == MHA_FIELD_PARAMS && strstr(err.msg, "bgate"),
          "forward: bgate without wgate gave %s (%s)", mha_status_name(st), err.msg);
    grads g;
    grads_alloc(&g, P, 1);
    prm.dout = P->t[1][X];   // never read: the call is refused first
    prm.dx = g.dx, prm.dkey = g.dx, prm.dvalue = g.dx, prm.dwgate = g.dwg;
    st = mha_backward(&P->cfg, &prm, &err);
    CHECK(st == MHA_ERR_ARG && err.field == MHA_FIELD_PARAMS && strstr(err.msg, "bgate"),
          "backward: bgate without wgate gave %s (%s)", mha_status_name(st), err.msg);
    grads_free(&g);
    fwd_free(&o);
}

/* name, B, Tq, Tk, Din, Dkin, H, G, dk, dv, has_wo, causal, bias, cross */
static const tcase k_cases[] = {
    {"self gqa causal bias", 2, 6, 6, 7, 7, 4, 2, 3, 5, 1, 1, 1, 0},
    {"cross, no bgate", 2, 5, 9, 6, 4, 2, 2, 4, 3, 1, 0, 0, 1},
    {"self, no wo, bias", 1, 7, 7, 5, 5, 3, 3, 2, 4, 0, 1, 1, 0},
    {"cross gqa, no wo, causal Tq < Tk", 2, 4, 8, 6, 3, 2, 1, 5, 2, 0, 1, 1, 1},
};

/* Large enough that the GEMMs multiply panels (half weights) and the gate's
   elementwise passes take several tasks. */
static const tcase k_big = {"big", 2, 200, 200, 48, 48, 4, 2, 16, 12, 1, 1, 1, 0};

int main(int argc, char **argv)
{
    const int quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    const double t0 = now_s();
    const size_t ncases = sizeof k_cases / sizeof k_cases[0];
    for (size_t i = 0; i < ncases; i++) {
        problem P;
        problem_init(&P, &k_cases[i]);
        printf("%s ...\n", k_cases[i].name);
        fflush(stdout);
        test_forward(&P);
        test_open_and_shut(&P);
        if (!quick || i % 2 == 0)
            test_backward(&P);
        test_threads(&P);
        test_half(&P);
        problem_free(&P);
    }
    problem big;
    problem_init(&big, &k_big);
    printf("%s ...\n", k_big.name);
    test_threads(&big);
    test_half(&big);
    test_reject(&big);
    problem_free(&big);
    printf("%ld checks, %d failures (%.1f s)\n", g_checks, g_failures, now_s() - t0);
    return g_failures != 0;
}
