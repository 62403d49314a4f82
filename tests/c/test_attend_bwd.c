/*
 * test_attend_bwd.c - issue 17's mha_attend_backward and mha_project
 * (contract in mha.h).
 *
 * Build and run (see the Makefile beside this file):
 *   make -C tests/c check
 *   ./test_attend_bwd          everything (exit status 1 on any failure)
 *   ./test_attend_bwd quick    fewer ISA / type combinations (sanitizers)
 *
 * What is checked:
 *   - mha_attend_backward: central finite differences of sum(out * R) of a
 *     naive dense attention in double, written here from mha.h's contract,
 *     for entries of q, k, v and the sinks, with masks, causal, GQA,
 *     key_lengths, window, softcap, ALiBi, sinks, key_mask and packed
 *     sequences; out and lse come from mha_forward over identity
 *     projections (checked against the same reference);
 *   - its gradients are bitwise the same at 1 and 3 threads (the fused and
 *     the two-pass plans), and equal mha_backward's on the same problem
 *     with identity projections and no W^O (dx == dq, dkey == dk, dvalue
 *     == dv, dsinks), on every ISA this CPU runs, float and double; a
 *     subset of the gradients (dq only, dk only) equals the full call's;
 *     ragged heads (kv heads of different widths) likewise;
 *   - lse NULL (recomputed by the forward's attention pass) gives the bits
 *     of the forward's lse;
 *   - q/k transforms in cfg and missing inputs are MHA_ERR_ARG;
 *   - mha_project: without transforms, bitwise mha_forward's kept q, k, v
 *     (biases included); with q_norm, k_norm and RoPE, a naive RMSNorm +
 *     RoPE in double; NULL outputs skip a projection and leave the others'
 *     bits unchanged.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "mha.h"
#include "threads.h"

#include "harness.h"

enum { AL_NONE, AL_H, AL_BH };

typedef struct {
    const char *name;
    size_t B, Tq, Tk, H, G, dk, dv;
    int causal, windowed;
    int64_t wl, wr;
    double softcap;
    int alibi, sinks, key_mask;
    mha_mask_kind mask_kind;
    int key_lengths;
    size_t nseq;
    int64_t cu_q[8], cu_k[8];
} spec;

/* A problem: its config and inputs in double (values exact in float). */
typedef struct {
    spec sp;
    mha_config cfg;
    size_t dkv[8], dvv[8];
    double scale[16], slopes[32], sinks[16];
    int64_t klen[8];
    size_t Sq, Sk, Sv, Svq, nq, nk, nm;
    double *q, *k, *v, *R, *maskd;
    uint8_t *maskb, *km;
} prob;

static void prob_init(prob *P, const spec *sp)
{
    memset(P, 0, sizeof *P);
    P->sp = *sp;
    const size_t B = sp->B, Tq = sp->Tq, Tk = sp->Tk, H = sp->H, G = sp->G;
    for (size_t g = 0; g < G; g++)
        P->dkv[g] = sp->dk, P->dvv[g] = sp->dv;
    for (size_t h = 0; h < H; h++) {
        P->scale[h] = 1.3 / sqrt((double)sp->dk);
        P->sinks[h] = (double)(float)(0.5 + rng_unit());
    }
    for (size_t e = 0; e < B * H; e++)
        P->slopes[e] = 0.02 + 0.2 * fabs(rng_unit());
    P->Sq = H * sp->dk, P->Sk = G * sp->dk, P->Sv = G * sp->dv, P->Svq = H * sp->dv;
    P->nq = B * Tq, P->nk = B * Tk, P->nm = B * H * Tq * Tk;
    P->q = rand_vec(P->nq * P->Sq, 1.2);
    P->k = rand_vec(P->nk * P->Sk, 1.2);
    P->v = rand_vec(P->nk * P->Sv, 1);
    P->R = rand_vec(P->nq * P->Svq, 1);
    P->maskd = rand_vec(P->nm, 0.7);
    P->maskb = xcalloc(P->nm, 1);
    for (size_t e = 0; e < P->nm; e++)
        P->maskb[e] = (rng_u64() % 5) != 0;
    P->km = xcalloc(B * Tk, 1);
    for (size_t b = 0; b < B; b++)
        for (size_t j = 0; j < Tk; j++)
            P->km[b * Tk + j] = (uint8_t)(b % 2 == 0 ? j >= 70 : (j < 40 || j >= 100));
    for (size_t b = 0; b < B; b++)
        P->klen[b] = b == 1 ? 0 : (int64_t)(Tk - 9 * b);

    mha_config *c = &P->cfg;
    c->B = B, c->Tq = Tq, c->Tk = Tk;
    c->Din = P->Sq, c->Dkin = P->Sk, c->Dvin = P->Sv, c->Dout = P->Svq;
    c->H = H, c->G = G, c->dk = P->dkv, c->dv = P->dvv, c->scale = P->scale;
    c->causal = sp->causal;
    c->mask_kind = sp->mask_kind;
    c->mask = sp->mask_kind == MHA_MASK_BOOL ? (const void *)P->maskb
              : sp->mask_kind == MHA_MASK_ADD ? (const void *)P->maskd : NULL;
    c->mask_stride[0] = (ptrdiff_t)(H * Tq * Tk);
    c->mask_stride[1] = (ptrdiff_t)(Tq * Tk);
    c->mask_stride[2] = (ptrdiff_t)Tk;
    c->mask_stride[3] = 1;
    c->key_lengths = sp->key_lengths ? P->klen : NULL;
    c->windowed = sp->windowed;
    c->window_left = sp->wl, c->window_right = sp->wr;
    c->softcap = sp->softcap;
    c->alibi = sp->alibi ? P->slopes : NULL;
    c->alibi_bstride = sp->alibi == AL_BH ? H : 0;
    c->sinks = NULL; /* bound per type by the runners */
    c->key_mask = sp->key_mask ? P->km : NULL;
    c->nseq = sp->nseq;
    c->cu_q = sp->nseq ? P->sp.cu_q : NULL;
    c->cu_k = sp->nseq ? P->sp.cu_k : NULL;
}

static void prob_free(prob *P)
{
    free(P->q), free(P->k), free(P->v), free(P->R), free(P->maskd);
    free(P->maskb), free(P->km);
}

/* ------------------------------------------------------------------ */
/* The reference: attention alone (harness.h's ref_row).              */

/* sum(out * R) of attention on q, k, v with the sinks given (NULL: none);
   out (B, Tq, Svq) and lse (B, H, Tq) written when not NULL. */
static double ref_attend(const prob *P, const double *q, const double *k, const double *v,
                         const double *sinks, double *out, double *lse)
{
    const spec *sp = &P->sp;
    const size_t B = sp->B, Tq = sp->Tq, Tk = sp->Tk, H = sp->H, dk = sp->dk, dv = sp->dv;
    double *o = xcalloc(dv, sizeof *o), loss = 0;
    for (size_t b = 0; b < B; b++)
        for (size_t h = 0; h < H; h++)
            for (size_t i = 0; i < Tq; i++) {
                const size_t g = h / (H / sp->G);
                const double l = ref_row(&P->cfg, P->scale[h], P->maskb, P->maskd,
                                         sinks ? &sinks[h] : NULL, b, h, i,
                                         q + (b * Tq + i) * P->Sq + h * dk,
                                         k + b * Tk * P->Sk + g * dk, P->Sk,
                                         v + b * Tk * P->Sv + g * dv, P->Sv, dk, dv, o, NULL);
                if (lse)
                    lse[(b * H + h) * Tq + i] = l;
                for (size_t d = 0; d < dv; d++) {
                    const size_t at = (b * Tq + i) * P->Svq + h * dv + d;
                    loss += o[d] * P->R[at];
                    if (out)
                        out[at] = o[d];
                }
            }
    free(o);
    return loss;
}

/* ------------------------------------------------------------------ */
/* The core, either type, through double arrays.                       */

static float *to_f(const double *a, size_t n)
{
    float *f = xcalloc(n, sizeof *f);
    for (size_t i = 0; a != NULL && i < n; i++)
        f[i] = (float)a[i];
    return f;
}

static void from_f(double *a, const float *f, size_t n)
{
    for (size_t i = 0; a != NULL && i < n; i++)
        a[i] = (double)f[i];
}

static double *identity(size_t n)
{
    double *w = xcalloc(n * n, sizeof *w);
    for (size_t i = 0; i < n; i++)
        w[i * n + i] = 1;
    return w;
}

/* Gradients of one call: dq, dk, dv, dsinks (any NULL: not asked for). */
typedef struct {
    double *g[4];
} grads;

static void grads_alloc(grads *G, const prob *P)
{
    G->g[0] = xcalloc(P->nq * P->Sq, sizeof(double));
    G->g[1] = xcalloc(P->nk * P->Sk, sizeof(double));
    G->g[2] = xcalloc(P->nk * P->Sv, sizeof(double));
    G->g[3] = xcalloc(P->sp.H, sizeof(double));
}

static void grads_free(grads *G)
{
    for (int t = 0; t < 4; t++)
        free(G->g[t]);
}

static void grad_sizes(const prob *P, size_t n[4])
{
    n[0] = P->nq * P->Sq, n[1] = P->nk * P->Sk, n[2] = P->nk * P->Sv, n[3] = P->sp.H;
}

/* The forward's out (B, Tq, Svq) and lse (B, H, Tq). */
typedef struct {
    double *out, *lse;
} fwd_res;

/* mha_forward over identity projections and no W^O: out = attention. */
static mha_status run_fwd(const prob *P, int f64, fwd_res *o)
{
    mha_config cfg = P->cfg;
    double *wq = identity(P->Sq), *wk = identity(P->Sk), *wv = identity(P->Sv);
    mha_status st;
    if (f64) {
        cfg.sinks = P->sp.sinks ? P->sinks : NULL;
        const mha_params prm = {.dtype = MHA_DTYPE_F64, .out = o->out, .lse = o->lse,
                                .x = P->q, .key = P->k, .value = P->v, .wq = wq, .wk = wk,
                                .wv = wv};
        st = mha_forward(&cfg, &prm, NULL);
    } else {
        float *q = to_f(P->q, P->nq * P->Sq), *k = to_f(P->k, P->nk * P->Sk);
        float *v = to_f(P->v, P->nk * P->Sv), *fwq = to_f(wq, P->Sq * P->Sq);
        float *fwk = to_f(wk, P->Sk * P->Sk), *fwv = to_f(wv, P->Sv * P->Sv);
        float *maskd = to_f(P->maskd, P->nm), *sinks = to_f(P->sinks, P->sp.H);
        float *out = to_f(NULL, P->nq * P->Svq), *lse = to_f(NULL, P->sp.B * P->sp.H * P->sp.Tq);
        if (cfg.mask_kind == MHA_MASK_ADD)
            cfg.mask = maskd;
        cfg.sinks = P->sp.sinks ? sinks : NULL;
        const mha_params prm = {.dtype = MHA_DTYPE_F32, .out = out, .lse = lse, .x = q,
                                .key = k, .value = v, .wq = fwq, .wk = fwk, .wv = fwv};
        st = mha_forward(&cfg, &prm, NULL);
        from_f(o->out, out, P->nq * P->Svq);
        from_f(o->lse, lse, P->sp.B * P->sp.H * P->sp.Tq);
        free(q), free(k), free(v), free(fwq), free(fwk), free(fwv), free(maskd);
        free(sinks), free(out), free(lse);
    }
    free(wq), free(wk), free(wv);
    return st;
}

static mha_status call_bwd_f64(const prob *P, int mode, const fwd_res *o, double *const g[4],
                               mha_config *cfg)
{
    if (mode == 0) {
        const mha_params prm = {.dtype = MHA_DTYPE_F64, .dq = g[0], .dk = g[1], .dv = g[2],
                                .dsinks = g[3], .dout = P->R, .q = P->q, .k = P->k,
                                .v = P->v, .out = o->out, .lse = o->lse};
        return mha_attend_backward(cfg, &prm, NULL);
    }
    double *wq = identity(P->Sq), *wk = identity(P->Sk), *wv = identity(P->Sv);
    const mha_params prm = {.dtype = MHA_DTYPE_F64, .dx = g[0], .dkey = g[1], .dvalue = g[2],
                            .dsinks = g[3], .dout = P->R, .x = P->q, .key = P->k,
                            .value = P->v, .wq = wq, .wk = wk, .wv = wv, .q = P->q,
                            .k = P->k, .v = P->v, .concat = o->out, .lse = o->lse};
    const mha_status st = mha_backward(cfg, &prm, NULL);
    free(wq), free(wk), free(wv);
    return st;
}

static mha_status call_bwd_f32(const prob *P, int mode, const fwd_res *o, float *const g[4],
                               mha_config *cfg)
{
    float *q = to_f(P->q, P->nq * P->Sq), *k = to_f(P->k, P->nk * P->Sk);
    float *v = to_f(P->v, P->nk * P->Sv), *R = to_f(P->R, P->nq * P->Svq);
    float *out = to_f(o->out, P->nq * P->Svq);
    float *lse = o->lse ? to_f(o->lse, P->sp.B * P->sp.H * P->sp.Tq) : NULL;
    float *maskd = to_f(P->maskd, P->nm), *sinks = to_f(P->sinks, P->sp.H);
    if (cfg->mask_kind == MHA_MASK_ADD)
        cfg->mask = maskd;
    cfg->sinks = P->sp.sinks ? sinks : NULL;
    mha_status st;
    if (mode == 0) {
        const mha_params prm = {.dtype = MHA_DTYPE_F32, .dq = g[0], .dk = g[1], .dv = g[2],
                                .dsinks = g[3], .dout = R, .q = q, .k = k, .v = v,
                                .out = out, .lse = lse};
        st = mha_attend_backward(cfg, &prm, NULL);
    } else {
        double *wqd = identity(P->Sq), *wkd = identity(P->Sk), *wvd = identity(P->Sv);
        float *wq = to_f(wqd, P->Sq * P->Sq), *wk = to_f(wkd, P->Sk * P->Sk);
        float *wv = to_f(wvd, P->Sv * P->Sv);
        const mha_params prm = {.dtype = MHA_DTYPE_F32, .dx = g[0], .dkey = g[1],
                                .dvalue = g[2], .dsinks = g[3], .dout = R, .x = q, .key = k,
                                .value = v, .wq = wq, .wk = wk, .wv = wv, .q = q, .k = k,
                                .v = v, .concat = out, .lse = lse};
        st = mha_backward(cfg, &prm, NULL);
        free(wqd), free(wkd), free(wvd), free(wq), free(wk), free(wv);
    }
    free(q), free(k), free(v), free(R), free(out), free(lse), free(maskd), free(sinks);
    return st;
}

/* mode 0: mha_attend_backward; 1: mha_backward with identity projections
   and no W^O, its dx, dkey, dvalue, dsinks in G. o: the forward's
   (run_fwd). `want` masks which gradients are asked for (bits 0-3). */
static mha_status run_bwd(const prob *P, int f64, int mode, int want, const fwd_res *o,
                          grads *G)
{
    size_t n[4];
    grad_sizes(P, n);
    mha_config cfg = P->cfg;
    // Every gradient starts as NaN: an element left unwritten fails.
    for (int t = 0; t < 4; t++)
        for (size_t e = 0; e < n[t]; e++)
            G->g[t][e] = NAN;
    if (f64) {
        cfg.sinks = P->sp.sinks ? P->sinks : NULL;
        double *g[4];
        for (int t = 0; t < 4; t++)
            g[t] = (want >> t) & 1 ? G->g[t] : NULL;
        return call_bwd_f64(P, mode, o, g, &cfg);
    }
    float *g[4];
    for (int t = 0; t < 4; t++) {
        g[t] = to_f(G->g[t], n[t]);
        if (!((want >> t) & 1)) {
            free(g[t]);
            g[t] = NULL;
        }
    }
    const mha_status st = call_bwd_f32(P, mode, o, g, &cfg);
    for (int t = 0; t < 4; t++) {
        if (g[t] != NULL)
            from_f(G->g[t], g[t], n[t]);
        free(g[t]);
    }
    return st;
}

/* ------------------------------------------------------------------ */
/* Checks.                                                             */

static int g_quick;
static const int k_isas[] = {MHA_ISA_SCALAR, MHA_ISA_AVX2, MHA_ISA_AVX512};

static double max_err(const double *a, const double *b, size_t n)
{
    double e = 0;
    for (size_t i = 0; i < n; i++) {
        if (a[i] == b[i])
            continue;
        const double d = fabs(a[i] - b[i]) / (1 + fabs(b[i]));
        e = (d > e || d != d) ? (d != d ? INFINITY : d) : e;
    }
    return e;
}

/* Equal values (== : -0 and +0 alike, NaN never) at every element. */
static int same_values(const double *a, const double *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!(a[i] == b[i]))
            return 0;
    return 1;
}

/* Central differences of the reference's loss at a few entries of q, k,
   v and every sink, against the f64 gradients G. */
static void check_fd(prob *P, const grads *G)
{
    double *arr[3] = {P->q, P->k, P->v};
    const size_t n[3] = {P->nq * P->Sq, P->nk * P->Sk, P->nk * P->Sv};
    const char *name[3] = {"dq", "dk", "dv"};
    const double eps = 1e-5;
    double *sinks = P->sp.sinks ? P->sinks : NULL;
    for (int t = 0; t < 3; t++)
        for (int e = 0; e < 6; e++) {
            const size_t at = rng_below(n[t]);
            const double keep = arr[t][at];
            arr[t][at] = keep + eps;
            const double lp = ref_attend(P, P->q, P->k, P->v, sinks, NULL, NULL);
            arr[t][at] = keep - eps;
            const double lm = ref_attend(P, P->q, P->k, P->v, sinks, NULL, NULL);
            arr[t][at] = keep;
            const double fd = (lp - lm) / (2 * eps), got = G->g[t][at];
            CHECK(fabs(fd - got) <= 1e-6 * (1 + fabs(fd)), "%s: %s[%zu] = %.10g, FD %.10g",
                  P->sp.name, name[t], at, got, fd);
        }
    for (size_t h = 0; sinks != NULL && h < P->sp.H; h++) {
        const double keep = sinks[h];
        sinks[h] = keep + eps;
        const double lp = ref_attend(P, P->q, P->k, P->v, sinks, NULL, NULL);
        sinks[h] = keep - eps;
        const double lm = ref_attend(P, P->q, P->k, P->v, sinks, NULL, NULL);
        sinks[h] = keep;
        const double fd = (lp - lm) / (2 * eps);
        CHECK(fabs(fd - G->g[3][h]) <= 1e-6 * (1 + fabs(fd)), "%s: dsinks[%zu] = %.10g, FD %.10g",
              P->sp.name, h, G->g[3][h], fd);
    }
}

/* One case: the forward against the reference, then the backward's
   checks on every ISA and type. */
static void check_case(const spec *sp)
{
    prob P;
    prob_init(&P, sp);
    size_t n[4];
    grad_sizes(&P, n);
    const size_t nlse = sp->B * sp->H * sp->Tq, nout = P.nq * P.Svq;
    double *rout = xcalloc(nout, sizeof(double)), *rlse = xcalloc(nlse, sizeof(double));
    ref_attend(&P, P.q, P.k, P.v, sp->sinks ? P.sinks : NULL, rout, rlse);
    const int want_all = sp->sinks ? 15 : 7;
    grads ref64;
    grads_alloc(&ref64, &P);
    for (int ii = 0; ii < 3; ii++) {
        if (mha_set_isa((mha_isa)k_isas[ii]) != k_isas[ii])
            continue;
        const char *isa = mha_isa_name((mha_isa)k_isas[ii]);
        for (int f64 = 1; f64 >= 0; f64--) {
            if (g_quick && ii == 0 && !f64)
                continue;
            const double tol = f64 ? 1e-11 : 3e-5;
            fwd_res o = {xcalloc(nout, sizeof(double)), xcalloc(nlse, sizeof(double))};
            mha_set_num_threads(1);
            CHECK(run_fwd(&P, f64, &o) == MHA_OK, "%s: forward", sp->name);
            CHECK(max_err(o.out, rout, nout) <= tol && max_err(o.lse, rlse, nlse) <= tol,
                  "%s %s f%d: forward vs reference %.3g %.3g", sp->name, isa, f64 ? 64 : 32,
                  max_err(o.out, rout, nout), max_err(o.lse, rlse, nlse));
            grads G[5];
            const fwd_res no_lse = {o.out, NULL};
            for (int r = 0; r < 5; r++) {
                grads_alloc(&G[r], &P);
                mha_set_num_threads(r == 1 ? 3 : 1);
                const int mode = r == 2;
                const int want = r == 3 ? (int)(1 + rng_below(6)) : want_all;
                const mha_status st = run_bwd(&P, f64, mode, want, r == 4 ? &no_lse : &o, &G[r]);
                CHECK(st == MHA_OK, "%s: backward %d status %d", sp->name, r, (int)st);
                for (int t = 0; r == 3 && t < 4; t++)
                    CHECK(!((want >> t) & 1) || same_values(G[3].g[t], G[0].g[t], n[t]),
                          "%s %s f%d: gradient %d alone differs", sp->name, isa, f64 ? 64 : 32, t);
            }
            for (int t = 0; t < 4; t++) {
                if (!((want_all >> t) & 1))
                    continue;
                CHECK(memcmp(G[0].g[t], G[1].g[t], n[t] * sizeof(double)) == 0,
                      "%s %s f%d: gradient %d differs between 1 and 3 threads", sp->name, isa,
                      f64 ? 64 : 32, t);
                CHECK(memcmp(G[0].g[t], G[4].g[t], n[t] * sizeof(double)) == 0,
                      "%s %s f%d: gradient %d differs with lse recomputed", sp->name, isa,
                      f64 ? 64 : 32, t);
                CHECK(same_values(G[0].g[t], G[2].g[t], n[t]),
                      "%s %s f%d: gradient %d differs from mha_backward's (err %.3g)", sp->name,
                      isa, f64 ? 64 : 32, t, max_err(G[0].g[t], G[2].g[t], n[t]));
                if (f64 && ii == 0)
                    memcpy(ref64.g[t], G[0].g[t], n[t] * sizeof(double));
                else
                    CHECK(max_err(G[0].g[t], ref64.g[t], n[t]) <= (f64 ? 1e-11 : 1e-4),
                          "%s %s f%d: gradient %d vs scalar f64: %.3g", sp->name, isa,
                          f64 ? 64 : 32, t, max_err(G[0].g[t], ref64.g[t], n[t]));
            }
            if (f64 && ii == 0)
                check_fd(&P, &G[0]);
            for (int r = 0; r < 5; r++)
                grads_free(&G[r]);
            free(o.out), free(o.lse);
        }
    }
    mha_set_isa(MHA_ISA_AVX512);
    mha_set_num_threads(0);
    grads_free(&ref64);
    free(rout), free(rlse);
    prob_free(&P);
}

/* q/k transforms are the projections' (MHA_ERR_ARG); required inputs. */
static void test_errors(void)
{
    const spec sp = {.name = "errors", 1, 5, 7, 2, 1, 4, 4, .causal = 0};
    prob P;
    prob_init(&P, &sp);
    grads G;
    grads_alloc(&G, &P);
    double lse[10] = {0}, out[5 * 8] = {0}, normw[4] = {1, 1, 1, 1}, inv[2] = {1, 0.1};
    mha_config cfg = P.cfg;
    mha_error err;
    mha_params prm = {.dtype = MHA_DTYPE_F64, .dq = G.g[0], .dk = G.g[1], .dv = G.g[2],
                      .dout = P.R, .q = P.q, .k = P.k, .v = P.v, .out = out, .lse = lse};
    cfg.q_norm = normw;
    CHECK(mha_attend_backward(&cfg, &prm, &err) == MHA_ERR_ARG &&
              err.field == MHA_FIELD_Q_NORM, "q_norm accepted (%s)", err.msg);
    cfg = P.cfg;
    cfg.k_norm = normw;
    CHECK(mha_attend_backward(&cfg, &prm, &err) == MHA_ERR_ARG &&
              err.field == MHA_FIELD_K_NORM, "k_norm accepted (%s)", err.msg);
    cfg = P.cfg;
    cfg.rotary_dim = 2, cfg.inv_freq = inv;
    CHECK(mha_attend_backward(&cfg, &prm, &err) == MHA_ERR_ARG &&
              err.field == MHA_FIELD_ROTARY_DIM, "RoPE accepted (%s)", err.msg);
    prm.q = NULL;
    CHECK(mha_attend_backward(&P.cfg, &prm, &err) == MHA_ERR_ARG &&
              err.field == MHA_FIELD_PARAMS && strstr(err.msg, "q is NULL") != NULL,
          "q NULL accepted (%s)", err.msg);
    CHECK(mha_attend_backward(&P.cfg, &(mha_params){.dtype = MHA_DTYPE_F64}, &err) == MHA_OK &&
              err.field == MHA_FIELD_NONE, "nothing wanted");
    grads_free(&G);
    prob_free(&P);
}

static void test_cases(void)
{
    const spec cases[] = {
        {.name = "plain", 2, 70, 150, 4, 4, 8, 6},
        {.name = "causal gqa", 2, 70, 150, 4, 2, 8, 6, .causal = 1},
        {.name = "bool mask, key_lengths", 3, 33, 70, 2, 1, 5, 7,
         .mask_kind = MHA_MASK_BOOL, .key_lengths = 1},
        {.name = "additive mask gqa", 2, 65, 64, 4, 2, 8, 8, .mask_kind = MHA_MASK_ADD},
        {.name = "window", 2, 70, 150, 2, 2, 8, 6, .windowed = 1, .wl = 20, .wr = 5},
        {.name = "softcap alibi", 2, 40, 130, 4, 2, 8, 6, .softcap = 1.5, .alibi = AL_BH},
        {.name = "sinks causal alibi", 3, 70, 100, 4, 2, 8, 6, .causal = 1, .sinks = 1,
         .alibi = AL_H, .key_lengths = 1},
        {.name = "key_mask", 2, 50, 150, 2, 1, 8, 6, .key_mask = 1},
        {.name = "packed causal", 1, 70, 150, 4, 2, 8, 6, .causal = 1, .nseq = 3,
         .cu_q = {0, 20, 45, 70}, .cu_k = {0, 60, 100, 150}},
        {.name = "mix", 2, 70, 150, 4, 2, 8, 6, .causal = 1, .windowed = 1, .wl = 40,
         .wr = -1, .softcap = 2.0, .sinks = 1, .key_mask = 1, .mask_kind = MHA_MASK_ADD},
        {.name = "tiny", 1, 1, 1, 1, 1, 1, 1},
    };
    const size_t n = sizeof cases / sizeof cases[0];
    for (size_t c = 0; c < n; c++)
        if (!g_quick || c % 3 == 0)
            check_case(&cases[c]);
}

/* Ragged heads (kv head widths differ), GQA: mha_attend_backward, with
   and without lse, equals mha_backward over identity projections, and is
   the same at 1 and 3 threads. */
static void test_ragged(void)
{
    const spec sp = {.name = "ragged", 2, 45, 90, 4, 2, 4, 5, .causal = 1, .sinks = 1};
    prob P;
    prob_init(&P, &sp);
    const size_t dks[2] = {4, 7}, dvs[2] = {5, 3};
    P.Sq = P.Sk = P.Sv = P.Svq = 0;
    for (size_t g = 0; g < 2; g++) {
        P.dkv[g] = dks[g], P.dvv[g] = dvs[g];
        P.Sk += dks[g], P.Sv += dvs[g], P.Sq += 2 * dks[g], P.Svq += 2 * dvs[g];
    }
    free(P.q), free(P.k), free(P.v), free(P.R);
    P.q = rand_vec(P.nq * P.Sq, 1.2), P.k = rand_vec(P.nk * P.Sk, 1.2);
    P.v = rand_vec(P.nk * P.Sv, 1), P.R = rand_vec(P.nq * P.Svq, 1);
    P.cfg.Din = P.Sq, P.cfg.Dkin = P.Sk, P.cfg.Dvin = P.Sv, P.cfg.Dout = P.Svq;
    size_t n[4];
    grad_sizes(&P, n);
    for (int f64 = 0; f64 <= 1; f64++) {
        fwd_res o = {xcalloc(P.nq * P.Svq, sizeof(double)),
                     xcalloc(sp.B * sp.H * sp.Tq, sizeof(double))};
        const fwd_res no_lse = {o.out, NULL};
        CHECK(run_fwd(&P, f64, &o) == MHA_OK, "ragged forward");
        grads G[4];
        for (int r = 0; r < 4; r++) {
            grads_alloc(&G[r], &P);
            mha_set_num_threads(r == 1 ? 3 : 1);
            CHECK(run_bwd(&P, f64, r == 2, 15, r == 3 ? &no_lse : &o, &G[r]) == MHA_OK,
                  "ragged backward %d", r);
        }
        for (int t = 0; t < 4; t++) {
            CHECK(memcmp(G[0].g[t], G[1].g[t], n[t] * sizeof(double)) == 0 &&
                      memcmp(G[0].g[t], G[3].g[t], n[t] * sizeof(double)) == 0,
                  "ragged f%d: gradient %d differs (threads or lse recomputed)", f64 ? 64 : 32, t);
            CHECK(same_values(G[0].g[t], G[2].g[t], n[t]),
                  "ragged f%d: gradient %d differs from mha_backward's", f64 ? 64 : 32, t);
        }
        for (int r = 0; r < 4; r++)
            grads_free(&G[r]);
        free(o.out), free(o.lse);
    }
    mha_set_num_threads(0);
    prob_free(&P);
}

/* ------------------------------------------------------------------ */
/* mha_project.                                                        */

typedef struct {
    mha_config cfg;
    size_t dkv[2], dvv[2], Sq, Sk, Sv, nq, nk;
    double scale[4], qn[4 * 8], kn[8], inv[3];
    double *x, *key, *value, *wq, *wk, *wv, *bq, *bk, *bv;
} pprob;

static void pprob_init(pprob *P, int transforms, int interleaved)
{
    memset(P, 0, sizeof *P);
    const size_t B = 2, Tq = 37, Tk = 53, H = 4, G = 2, dk = 8, dv = 6;
    mha_config *c = &P->cfg;
    c->B = B, c->Tq = Tq, c->Tk = Tk, c->Din = 24, c->Dkin = 20, c->Dvin = 18;
    c->H = H, c->G = G;
    for (size_t g = 0; g < G; g++)
        P->dkv[g] = dk, P->dvv[g] = dv;
    for (size_t h = 0; h < H; h++)
        P->scale[h] = 1 / sqrt((double)dk);
    c->dk = P->dkv, c->dv = P->dvv, c->scale = P->scale;
    P->Sq = H * dk, P->Sk = G * dk, P->Sv = G * dv, P->nq = B * Tq, P->nk = B * Tk;
    c->Dout = H * dv;
    P->x = rand_vec(P->nq * c->Din, 1), P->key = rand_vec(P->nk * c->Dkin, 1);
    P->value = rand_vec(P->nk * c->Dvin, 1);
    P->wq = rand_vec(c->Din * P->Sq, 0.5), P->wk = rand_vec(c->Dkin * P->Sk, 0.5);
    P->wv = rand_vec(c->Dvin * P->Sv, 0.5);
    P->bq = rand_vec(P->Sq, 0.3), P->bk = rand_vec(P->Sk, 0.3), P->bv = rand_vec(P->Sv, 0.3);
    for (size_t e = 0; e < H * dk; e++)
        P->qn[e] = (double)(float)(1 + 0.5 * rng_unit());
    for (size_t e = 0; e < dk; e++)
        P->kn[e] = (double)(float)(1 + 0.5 * rng_unit());
    P->inv[0] = 1, P->inv[1] = 0.1, P->inv[2] = 0.01;
    if (transforms) {
        c->q_norm = P->qn, c->q_norm_hstride = dk;
        c->k_norm = P->kn, c->k_norm_hstride = 0;
        c->norm_eps = 1e-6;
        c->rotary_dim = 6, c->rope_interleaved = interleaved, c->inv_freq = P->inv;
    }
}

static void pprob_free(pprob *P)
{
    free(P->x), free(P->key), free(P->value), free(P->wq), free(P->wk), free(P->wv);
    free(P->bq), free(P->bk), free(P->bv);
}

/* out (rows, S) = in (rows, d) w (d, S) + b, in double. */
static void ref_proj(double *out, const double *in, const double *w, const double *b,
                     size_t rows, size_t d, size_t S)
{
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < S; c++) {
            double acc = b[c];
            for (size_t e = 0; e < d; e++)
                acc += in[r * d + e] * w[e * S + c];
            out[r * S + c] = acc;
        }
}

/* RMSNorm then RoPE of every head of y (rows of T, nh heads dk wide), in
   place; w + h wstride the norm's weight; positions i + shift. */
static void ref_transform(double *y, size_t rows, size_t T, size_t nh, size_t dk,
                          const double *w, size_t wstride, const mha_config *c,
                          int64_t shift)
{
    for (size_t r = 0; r < rows; r++)
        for (size_t h = 0; h < nh; h++) {
            double *y_h = y + r * nh * dk + h * dk, ms = 0;
            for (size_t d = 0; d < dk; d++)
                ms += y_h[d] * y_h[d];
            const double rr = 1 / sqrt(ms / (double)dk + c->norm_eps);
            for (size_t d = 0; d < dk; d++)
                y_h[d] = y_h[d] * rr * w[h * wstride + d];
            const size_t half = c->rotary_dim / 2;
            const double pos = (double)((int64_t)(r % T) + shift);
            for (size_t p = 0; p < half; p++) {
                const size_t a = c->rope_interleaved ? 2 * p : p;
                const size_t b = c->rope_interleaved ? 2 * p + 1 : p + half;
                const double ang = pos * c->inv_freq[p], ya = y_h[a], yb = y_h[b];
                y_h[a] = ya * cos(ang) - yb * sin(ang);
                y_h[b] = ya * sin(ang) + yb * cos(ang);
            }
        }
}

static mha_status project_f(const pprob *P, int f64, double *q, double *k, double *v)
{
    if (f64) {
        const mha_params prm = {.dtype = MHA_DTYPE_F64, .q = q, .k = k, .v = v, .x = P->x,
                                .key = P->key, .value = P->value, .wq = P->wq, .wk = P->wk,
                                .wv = P->wv, .bq = P->bq, .bk = P->bk, .bv = P->bv};
        return mha_project(&P->cfg, &prm, NULL);
    }
    const mha_config *c = &P->cfg;
    mha_config cfg = *c;
    float *x = to_f(P->x, P->nq * c->Din), *key = to_f(P->key, P->nk * c->Dkin);
    float *value = to_f(P->value, P->nk * c->Dvin), *wq = to_f(P->wq, c->Din * P->Sq);
    float *wk = to_f(P->wk, c->Dkin * P->Sk), *wv = to_f(P->wv, c->Dvin * P->Sv);
    float *bq = to_f(P->bq, P->Sq), *bk = to_f(P->bk, P->Sk), *bv = to_f(P->bv, P->Sv);
    float *qn = to_f(P->qn, 32), *kn = to_f(P->kn, 8);
    float *qf = to_f(NULL, P->nq * P->Sq), *kf = to_f(NULL, P->nk * P->Sk);
    float *vf = to_f(NULL, P->nk * P->Sv);
    cfg.q_norm = c->q_norm ? qn : NULL, cfg.k_norm = c->k_norm ? kn : NULL;
    const mha_params prm = {.dtype = MHA_DTYPE_F32, .q = q ? qf : NULL, .k = k ? kf : NULL,
                            .v = v ? vf : NULL, .x = x, .key = key, .value = value, .wq = wq,
                            .wk = wk, .wv = wv, .bq = bq, .bk = bk, .bv = bv};
    const mha_status st = mha_project(&cfg, &prm, NULL);
    from_f(q, qf, P->nq * P->Sq), from_f(k, kf, P->nk * P->Sk), from_f(v, vf, P->nk * P->Sv);
    free(x), free(key), free(value), free(wq), free(wk), free(wv), free(bq), free(bk);
    free(bv), free(qn), free(kn), free(qf), free(kf), free(vf);
    return st;
}

/* mha_forward's kept q, k, v (no transforms). */
static mha_status forward_kept(const pprob *P, int f64, double *q, double *k, double *v)
{
    const mha_config *c = &P->cfg;
    double *out = xcalloc(P->nq * c->Dout, sizeof(double));
    mha_status st;
    if (f64) {
        const mha_params prm = {.dtype = MHA_DTYPE_F64, .out = out, .q = q, .k = k, .v = v,
                                .x = P->x, .key = P->key, .value = P->value, .wq = P->wq,
                                .wk = P->wk, .wv = P->wv, .bq = P->bq, .bk = P->bk,
                                .bv = P->bv};
        st = mha_forward(c, &prm, NULL);
    } else {
        float *x = to_f(P->x, P->nq * c->Din), *key = to_f(P->key, P->nk * c->Dkin);
        float *value = to_f(P->value, P->nk * c->Dvin), *wq = to_f(P->wq, c->Din * P->Sq);
        float *wk = to_f(P->wk, c->Dkin * P->Sk), *wv = to_f(P->wv, c->Dvin * P->Sv);
        float *bq = to_f(P->bq, P->Sq), *bk = to_f(P->bk, P->Sk), *bv = to_f(P->bv, P->Sv);
        float *of = to_f(NULL, P->nq * c->Dout), *qf = to_f(NULL, P->nq * P->Sq);
        float *kf = to_f(NULL, P->nk * P->Sk), *vf = to_f(NULL, P->nk * P->Sv);
        const mha_params prm = {.dtype = MHA_DTYPE_F32, .out = of, .q = qf, .k = kf, .v = vf,
                                .x = x, .key = key, .value = value, .wq = wq, .wk = wk,
                                .wv = wv, .bq = bq, .bk = bk, .bv = bv};
        st = mha_forward(c, &prm, NULL);
        from_f(q, qf, P->nq * P->Sq), from_f(k, kf, P->nk * P->Sk);
        from_f(v, vf, P->nk * P->Sv);
        free(x), free(key), free(value), free(wq), free(wk), free(wv), free(bq), free(bk);
        free(bv), free(of), free(qf), free(kf), free(vf);
    }
    free(out);
    return st;
}

static void test_project(void)
{
    for (int mode = 0; mode < 3; mode++) /* plain, transforms, interleaved */
        for (int f64 = 0; f64 <= 1; f64++) {
            pprob P;
            pprob_init(&P, mode > 0, mode == 2);
            const size_t n[3] = {P.nq * P.Sq, P.nk * P.Sk, P.nk * P.Sv};
            double *got[3], *want[3], *one[3];
            for (int t = 0; t < 3; t++) {
                got[t] = xcalloc(n[t], sizeof(double));
                want[t] = xcalloc(n[t], sizeof(double));
                one[t] = xcalloc(n[t], sizeof(double));
            }
            mha_set_num_threads(mode == 1 ? 3 : 1);
            CHECK(project_f(&P, f64, got[0], got[1], got[2]) == MHA_OK, "project status");
            if (mode == 0) {
                CHECK(forward_kept(&P, f64, want[0], want[1], want[2]) == MHA_OK, "forward");
                for (int t = 0; t < 3; t++)
                    CHECK(memcmp(got[t], want[t], n[t] * sizeof(double)) == 0,
                          "project f%d: output %d differs from mha_forward's kept one",
                          f64 ? 64 : 32, t);
            } else {
                const mha_config *c = &P.cfg;
                ref_proj(want[0], P.x, P.wq, P.bq, P.nq, c->Din, P.Sq);
                ref_proj(want[1], P.key, P.wk, P.bk, P.nk, c->Dkin, P.Sk);
                ref_proj(want[2], P.value, P.wv, P.bv, P.nk, c->Dvin, P.Sv);
                ref_transform(want[0], P.nq, c->Tq, c->H, 8, P.qn, 8, c,
                              (int64_t)c->Tk - (int64_t)c->Tq);
                ref_transform(want[1], P.nk, c->Tk, c->G, 8, P.kn, 0, c, 0);
                for (int t = 0; t < 3; t++)
                    CHECK(max_err(got[t], want[t], n[t]) <= (f64 ? 1e-12 : 1e-5),
                          "project mode %d f%d: output %d vs naive: %.3g", mode, f64 ? 64 : 32,
                          t, max_err(got[t], want[t], n[t]));
            }
            // Each output alone: the same bits.
            for (int t = 0; t < 3; t++) {
                for (size_t e = 0; e < n[t]; e++)
                    one[t][e] = NAN;
                CHECK(project_f(&P, f64, t == 0 ? one[0] : NULL, t == 1 ? one[1] : NULL,
                                t == 2 ? one[2] : NULL) == MHA_OK, "project alone");
                CHECK(memcmp(one[t], got[t], n[t] * sizeof(double)) == 0,
                      "project mode %d f%d: output %d alone differs", mode, f64 ? 64 : 32, t);
            }
            mha_error err;
            const mha_params bad = {.dtype = MHA_DTYPE_F64, .q = got[0], .key = P.key,
                                    .value = P.value, .wq = P.wq, .wk = P.wk, .wv = P.wv};
            CHECK(mha_project(&P.cfg, &bad, &err) == MHA_ERR_ARG &&
                      err.field == MHA_FIELD_PARAMS && strstr(err.msg, "x is NULL") != NULL,
                  "x NULL accepted (%s)", err.msg);
            for (int t = 0; t < 3; t++)
                free(got[t]), free(want[t]), free(one[t]);
            pprob_free(&P);
        }
    mha_set_num_threads(0);
}

int main(int argc, char **argv)
{
    g_quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    test_errors();
    test_cases();
    test_ragged();
    test_project();
    printf("test_attend_bwd: %ld checks, %d failures (ISAs up to %s; CPU: %s)\n",
           g_checks, g_failures, mha_isa_name(harness_best_isa()), mha_isa_name(mha_isa_detect()));
    return g_failures != 0;
}
