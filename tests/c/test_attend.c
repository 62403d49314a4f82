/*
 * test_attend.c - mha_attend (issue 17): attention on tensors
 * already projected, read at any strides, with lengths_aligned and the
 * split-K decode path.
 *
 * Build and run (see the Makefile beside this file):
 *   make -C tests/c check
 *   ./test_attend          everything (exit status 1 on any failure)
 *   ./test_attend quick    fewer ISA / thread combinations (sanitizers)
 *
 * What is checked, per case, on every ISA this CPU runs:
 *   - out, weights and lse against a naive dense reference in double
 *     written from mha.h's contract (one rule per line), for q / k / v / out
 *     laid out as (B, H, T, d), (B, T, H, d) and a KV cache's
 *     (B, G, capacity, d) storage with capacity > Tk;
 *   - every score variant (window, softcap, ALiBi, sinks, key_mask, packed
 *     sequences), masks, causal, key_lengths with and without
 *     lengths_aligned, GQA, Tq = 1 and Tq > 1;
 *   - calls without weights with Tk large take the split-K path: the same
 *     reference, and bitwise the same out and lse at 1 and 3 threads;
 *   - the checks: q/k transforms, NULL buffers, ragged heads, packed with
 *     lengths_aligned, overflowing strides are refused.
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

enum { L_BHTD, L_BTHD, L_CACHE };   /* layouts of q, k, v and out */

typedef struct {
    const char *name;
    size_t B, Tq, Tk, H, G, dk, dv;
    int layout;
    int causal, windowed, aligned;
    int64_t wl, wr;
    double softcap;
    int alibi, sinks, key_mask, key_lengths;
    mha_mask_kind mask_kind;
    size_t nseq;
    int64_t cu_q[8], cu_k[8];
} spec;

/* A problem: the config and its inputs in double, in the spec's layout
   (the float32 calls use the same values, which are floats). */
typedef struct {
    spec sp;
    mha_config cfg;
    size_t dkv[16], dvv[16];
    double scale[32], slopes[64], sinks[32];
    float sinks_f[32];
    int64_t klen[8];
    mha_strides sq, sk, sv, so;
    size_t nq, nk, nv, no;           /* elements of each buffer */
    double *q, *k, *v, *maskd;
    uint8_t *maskb, *km;
} prob;

/* Strides of a (B, n, T, d) tensor in the layout; the cache holds
   capacity T + 5 rows. *len = its element count. */
static mha_strides layout_strides(int layout, size_t B, size_t n, size_t T,
                                  size_t d, size_t *len)
{
    mha_strides s;
    const size_t cap = layout == L_CACHE ? T + 5 : T;
    if (layout == L_BTHD)
        s = (mha_strides){T * n * d, d, n * d};
    else
        s = (mha_strides){n * cap * d, cap * d, d};
    *len = B * n * cap * d;
    (void)B;
    return s;
}

static void prob_init(prob *P, const spec *sp)
{
    memset(P, 0, sizeof *P);
    P->sp = *sp;
    const size_t B = sp->B, Tq = sp->Tq, Tk = sp->Tk, H = sp->H, G = sp->G;
    for (size_t g = 0; g < G; g++)
        P->dkv[g] = sp->dk, P->dvv[g] = sp->dv;
    for (size_t h = 0; h < H; h++) {
        P->scale[h] = 1.3 / sqrt((double)sp->dk);
        P->sinks_f[h] = (float)(0.5 + rng_unit());
        P->sinks[h] = P->sinks_f[h];
    }
    for (size_t e = 0; e < B * H; e++)
        P->slopes[e] = 0.02 + 0.2 * fabs(rng_unit());
    P->sq = layout_strides(sp->layout, B, H, Tq, sp->dk, &P->nq);
    P->sk = layout_strides(sp->layout, B, G, Tk, sp->dk, &P->nk);
    P->sv = layout_strides(sp->layout, B, G, Tk, sp->dv, &P->nv);
    P->so = layout_strides(sp->layout, B, H, Tq, sp->dv, &P->no);
    P->q = rand_vec(P->nq, 1.5);
    P->k = rand_vec(P->nk, 1.5);
    P->v = rand_vec(P->nv, 1);
    P->maskd = rand_vec(B * H * Tq * Tk, 0.7);
    P->maskb = xcalloc(B * H * Tq * Tk, 1);
    for (size_t e = 0; e < B * H * Tq * Tk; e++)
        P->maskb[e] = (rng_u64() % 5) != 0;
    P->km = xcalloc(B * Tk, 1);
    for (size_t b = 0; b < B; b++)
        for (size_t j = 0; j < Tk; j++)
            P->km[b * Tk + j] = b % 2 == 0 ? j >= 70 : (j < 64 || j >= 140 + 600);
    for (size_t b = 0; b < B; b++)
        P->klen[b] = b == 1 ? 0 : b == 2 ? (int64_t)(Tk / 3 + 1) : (int64_t)(Tk - 37 * b % Tk);

    mha_config *c = &P->cfg;
    c->B = B, c->Tq = Tq, c->Tk = Tk;
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
    c->lengths_aligned = sp->aligned;
    c->windowed = sp->windowed;
    c->window_left = sp->wl, c->window_right = sp->wr;
    c->softcap = sp->softcap;
    c->alibi = sp->alibi ? P->slopes : NULL;
    c->alibi_bstride = sp->alibi == 2 ? H : 0;
    c->key_mask = sp->key_mask ? P->km : NULL;
    c->nseq = sp->nseq;
    c->cu_q = sp->nseq ? P->sp.cu_q : NULL;
    c->cu_k = sp->nseq ? P->sp.cu_k : NULL;
}

static void prob_free(prob *P)
{
    free(P->q), free(P->k), free(P->v), free(P->maskd), free(P->maskb), free(P->km);
}

static size_t at(const mha_strides *s, size_t b, size_t h, size_t t)
{
    return b * s->sb + h * s->sh + t * s->st;
}

/* ------------------------------------------------------------------ */
/* The reference (harness.h's ref_row), over the spec's layout.       */

/* out (B, H, Tq, dv) contiguous, w (B, H, Tq, Tk), lse (B, H, Tq). */
static void ref_attend(const prob *P, double *out, double *w, double *lse)
{
    const mha_config *c = &P->cfg;
    const size_t Tq = c->Tq, Tk = c->Tk, H = c->H, dk = P->sp.dk, dv = P->sp.dv;
    for (size_t b = 0; b < c->B; b++)
        for (size_t h = 0; h < H; h++)
            for (size_t i = 0; i < Tq; i++) {
                const size_t g = h / (H / c->G), bhi = (b * H + h) * Tq + i;
                lse[bhi] = ref_row(c, P->scale[h], P->maskb, P->maskd,
                                   P->sp.sinks ? &P->sinks[h] : NULL, b, h, i,
                                   P->q + at(&P->sq, b, h, i), P->k + at(&P->sk, b, g, 0),
                                   P->sk.st, P->v + at(&P->sv, b, g, 0), P->sv.st, dk, dv,
                                   out + bhi * dv, w + bhi * Tk);
            }
}

/* ------------------------------------------------------------------ */
/* The core, either type, through double arrays.                       */

static float *to_f(const double *a, size_t n)
{
    float *f = xcalloc(n, sizeof *f);
    for (size_t i = 0; i < n; i++)
        f[i] = (float)a[i];
    return f;
}

/* out (P->no, at so), w, lse in double; want_w: weights wanted. */
static mha_status run_attend(const prob *P, int f64, int want_w, double *out,
                             double *w, double *lse)
{
    const size_t nw = P->cfg.B * P->cfg.H * P->cfg.Tq * P->cfg.Tk;
    const size_t nl = P->cfg.B * P->cfg.H * P->cfg.Tq;
    mha_config c = P->cfg;
    mha_status st;
    if (f64) {
        c.sinks = P->sp.sinks ? P->sinks : NULL;
        const mha_params prm = {.dtype = MHA_DTYPE_F64, .out = out,
                                .weights = want_w ? w : NULL, .lse = lse, .q = P->q,
                                .k = P->k, .v = P->v, .sq = P->sq, .sk = P->sk,
                                .sv = P->sv, .so = P->so};
        return mha_attend(&c, &prm, NULL);
    }
    c.sinks = P->sp.sinks ? P->sinks_f : NULL;
    float *qf = to_f(P->q, P->nq), *kf = to_f(P->k, P->nk), *vf = to_f(P->v, P->nv);
    float *of = xcalloc(P->no, sizeof *of), *wf = xcalloc(nw, sizeof *wf);
    float *lf = xcalloc(nl, sizeof *lf);
    float *maskf = NULL;
    if (c.mask_kind == MHA_MASK_ADD) {
        maskf = to_f(P->maskd, nw);
        c.mask = maskf;
    }
    const mha_params prm = {.dtype = MHA_DTYPE_F32, .out = of, .weights = want_w ? wf : NULL,
                            .lse = lf, .q = qf, .k = kf, .v = vf, .sq = P->sq, .sk = P->sk,
                            .sv = P->sv, .so = P->so};
    st = mha_attend(&c, &prm, NULL);
    for (size_t i = 0; i < P->no; i++)
        out[i] = of[i];
    for (size_t i = 0; i < nw && want_w; i++)
        w[i] = wf[i];
    for (size_t i = 0; i < nl; i++)
        lse[i] = lf[i];
    free(qf), free(kf), free(vf), free(of), free(wf), free(lf), free(maskf);
    return st;
}

/* Largest |a - b| / (1 + |b|), with -inf == -inf and NaN anywhere = inf. */
static double max_err(const double *a, const double *b, size_t n)
{
    double e = 0;
    for (size_t i = 0; i < n; i++) {
        if (a[i] == b[i])
            continue;
        const double d = fabs(a[i] - b[i]) / (1 + fabs(b[i]));
        e = d > e || d != d ? (d != d ? INFINITY : d) : e;
    }
    return e;
}

static int g_quick;
static const int k_isas[] = {MHA_ISA_SCALAR, MHA_ISA_AVX2, MHA_ISA_AVX512};

/* One case against the reference on every ISA this CPU runs, with and
   without weights (the second may split), and bitwise at 1 and 3
   threads. */
static void check_case(const spec *sp)
{
    prob P;
    prob_init(&P, sp);
    const size_t B = sp->B, H = sp->H, Tq = sp->Tq, Tk = sp->Tk, dv = sp->dv;
    const size_t nw = B * H * Tq * Tk, nl = B * H * Tq, nr = B * H * Tq * dv;
    double *ro = xcalloc(nr, 8), *rw = xcalloc(nw, 8), *rl = xcalloc(nl, 8);
    double *o = xcalloc(P.no, 8), *w = xcalloc(nw, 8), *l = xcalloc(nl, 8);
    double *o1 = xcalloc(P.no, 8), *l1 = xcalloc(nl, 8), *og = xcalloc(nr, 8);
    ref_attend(&P, ro, rw, rl);
    for (size_t ii = 0; ii < 3; ii++) {
        const int isa = mha_set_isa(k_isas[ii]);
        if (isa != k_isas[ii] || (g_quick && ii == 0 && Tk > 1000))
            continue;
        for (int f64 = 0; f64 < 2; f64++) {
            const double tol = f64 ? 1e-12 : 3e-5;
            for (int want_w = 1; want_w >= 0; want_w--) {
                mha_set_num_threads(1);
                mha_status st = run_attend(&P, f64, want_w, o1, w, l1);
                CHECK(st == MHA_OK, "%s: status %d", sp->name, (int)st);
                mha_set_num_threads(3);
                st = run_attend(&P, f64, want_w, o, w, l);
                CHECK(st == MHA_OK, "%s: status %d", sp->name, (int)st);
                for (size_t b = 0; b < B; b++)
                    for (size_t h = 0; h < H; h++)
                        for (size_t i = 0; i < Tq; i++)
                            for (size_t c = 0; c < dv; c++) {
                                const size_t x = at(&P.so, b, h, i) + c;
                                og[((b * H + h) * Tq + i) * dv + c] = o[x];
                                CHECK(o[x] == o1[x] || (o[x] != o[x] && o1[x] != o1[x]),
                                      "%s: out differs at 1 and 3 threads", sp->name);
                            }
                CHECK(memcmp(l, l1, nl * 8) == 0, "%s: lse differs at 1 and 3 threads",
                      sp->name);
                const double eo = max_err(og, ro, nr), el = max_err(l, rl, nl);
                const double ew = want_w ? max_err(w, rw, nw) : 0;
                CHECK(eo < tol && el < tol && ew < tol,
                      "%s %s f%d weights %d: err out %.3g lse %.3g w %.3g", sp->name,
                      mha_isa_name((mha_isa)isa), f64 ? 64 : 32, want_w, eo, el, ew);
            }
        }
    }
    mha_set_isa(MHA_ISA_AVX512);
    mha_set_num_threads(0);
    free(ro), free(rw), free(rl), free(o), free(w), free(l), free(o1), free(l1), free(og);
    prob_free(&P);
}

/* A case overrides BASE's fields: designated initialisers, the last one
   wins (C11 6.7.9), which GCC's -Wextra flags. */
#pragma GCC diagnostic ignored "-Woverride-init"
#define BASE .B = 3, .Tq = 5, .Tk = 77, .H = 4, .G = 2, .dk = 19, .dv = 13

static const spec k_cases[] = {
    {"plain bhtd", BASE},
    {"plain bthd", BASE, .layout = L_BTHD},
    {"cache", BASE, .layout = L_CACHE},
    {"decode mha", BASE, .Tq = 1, .G = 4, .layout = L_CACHE},
    {"causal lengths", BASE, .causal = 1, .key_lengths = 1},
    {"causal aligned", BASE, .causal = 1, .key_lengths = 1, .aligned = 1,
     .layout = L_CACHE},
    {"aligned Tq > len", BASE, .Tq = 50, .causal = 1, .key_lengths = 1, .aligned = 1},
    {"window aligned alibi", BASE, .windowed = 1, .wl = 9, .wr = 2, .causal = 1,
     .key_lengths = 1, .aligned = 1, .alibi = 2, .layout = L_BTHD},
    {"bool mask sinks", BASE, .mask_kind = MHA_MASK_BOOL, .sinks = 1},
    {"add mask softcap", BASE, .mask_kind = MHA_MASK_ADD, .softcap = 2.5, .alibi = 1},
    {"key_mask", BASE, .Tk = 300, .key_mask = 1, .layout = L_CACHE},
    {"packed", .B = 1, .Tq = 12, .Tk = 40, .H = 4, .G = 1, .dk = 8, .dv = 8,
     .causal = 1, .nseq = 3, .cu_q = {0, 5, 5, 12}, .cu_k = {0, 10, 22, 40},
     .layout = L_BTHD},
    {"big tile Tq", BASE, .Tq = 200, .Tk = 150, .causal = 1, .layout = L_BTHD},
    /* Tq <= 16 and Tk >= 1024 without weights: split-K */
    {"split decode", .B = 2, .Tq = 1, .Tk = 2500, .H = 8, .G = 2, .dk = 32, .dv = 24,
     .layout = L_CACHE},
    {"split decode aligned", .B = 3, .Tq = 1, .Tk = 3000, .H = 4, .G = 4, .dk = 16,
     .dv = 16, .causal = 1, .key_lengths = 1, .aligned = 1, .sinks = 1,
     .layout = L_CACHE},
    {"split Tq 7 variants", .B = 3, .Tq = 7, .Tk = 1900, .H = 4, .G = 2, .dk = 12,
     .dv = 20, .causal = 1, .key_lengths = 1, .aligned = 1, .windowed = 1, .wl = 700,
     .wr = -1, .alibi = 2, .softcap = 3, .key_mask = 1, .sinks = 1, .layout = L_BTHD},
    {"split group heads", .B = 2, .Tq = 1, .Tk = 1500, .H = 6, .G = 2, .dk = 20,
     .dv = 36, .mask_kind = MHA_MASK_BOOL, .alibi = 2, .softcap = 4, .layout = L_BTHD},
    {"split group add mask", .B = 2, .Tq = 1, .Tk = 1300, .H = 4, .G = 1, .dk = 8,
     .dv = 8, .mask_kind = MHA_MASK_ADD, .key_lengths = 1, .aligned = 1, .causal = 1},
    {"split masked", .B = 2, .Tq = 16, .Tk = 1100, .H = 2, .G = 1, .dk = 8, .dv = 8,
     .mask_kind = MHA_MASK_BOOL, .key_lengths = 1},
};

/* The refusals of mha_attend, each with its field (mha_error). */
static void test_refusals(void)
{
    const spec sp = {"refusals", BASE};
    prob P;
    prob_init(&P, &sp);
    double *o = xcalloc(P.no, 8), *l = xcalloc(64 * 64, 8);
    mha_config c = P.cfg;
    double qn[19];
    mha_error err;
    const mha_params good = {.dtype = MHA_DTYPE_F64, .out = o, .lse = l, .q = P.q, .k = P.k,
                             .v = P.v, .sq = P.sq, .sk = P.sk, .sv = P.sv, .so = P.so};
    mha_params prm = good;
#define REFUSED(status, fid, what)                                                        \
    CHECK(mha_attend(&c, &prm, &err) == (status) && err.field == (fid), "%s (%s)", what,  \
          err.msg)
    c.q_norm = qn;
    REFUSED(MHA_ERR_ARG, MHA_FIELD_Q_NORM, "q_norm accepted");
    c = P.cfg;
    c.rotary_dim = 2;
    c.inv_freq = qn;
    REFUSED(MHA_ERR_ARG, MHA_FIELD_ROTARY_DIM, "rotary_dim accepted");
    c = P.cfg;
    prm.q = NULL;
    REFUSED(MHA_ERR_ARG, MHA_FIELD_PARAMS, "NULL q accepted");
    prm = good;
    prm.out = NULL;
    REFUSED(MHA_ERR_ARG, MHA_FIELD_PARAMS, "NULL out accepted");
    prm = good;
    CHECK(mha_attend(&c, NULL, &err) == MHA_ERR_ARG && err.field == MHA_FIELD_CALL,
          "NULL params accepted");
    size_t dkr[2] = {19, 20};
    c.dk = dkr;
    REFUSED(MHA_ERR_ARG, MHA_FIELD_DK, "ragged heads accepted");
    c = P.cfg;
    prm.sq = (mha_strides){SIZE_MAX / 2, 1, 1};
    REFUSED(MHA_ERR_SIZE, MHA_FIELD_PARAMS, "overflowing strides accepted");
    prm = good;
    REFUSED(MHA_OK, MHA_FIELD_NONE, "the good call refused");
    prob_free(&P);
    const spec pk = {"packed aligned", .B = 1, .Tq = 4, .Tk = 4, .H = 1, .G = 1,
                     .dk = 4, .dv = 4, .nseq = 1, .cu_q = {0, 4}, .cu_k = {0, 4},
                     .aligned = 1};
    prob_init(&P, &pk);
    mha_layout lay;
    c = P.cfg;
    c.has_wo = 1; // mha_attend ignores it; mha_check_config would reject Dout != Svq
    CHECK(mha_check_config(&lay, &c, &err) == MHA_ERR_ARG &&
              err.field == MHA_FIELD_LENGTHS_ALIGNED,
          "lengths_aligned with packed sequences accepted (%d: %s)", (int)err.field, err.msg);
    c = P.cfg;
    prm = (mha_params){.dtype = MHA_DTYPE_F64, .out = o, .lse = l, .q = P.q, .k = P.k,
                       .v = P.v, .sq = P.sq, .sk = P.sk, .sv = P.sv, .so = P.so};
    REFUSED(MHA_ERR_ARG, MHA_FIELD_LENGTHS_ALIGNED, "attend: packed + aligned accepted");
#undef REFUSED
    prob_free(&P);
    free(o), free(l);
}

int main(int argc, char **argv)
{
    g_quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    const size_t n = sizeof k_cases / sizeof k_cases[0];
    for (size_t i = 0; i < n; i++)
        check_case(&k_cases[i]);
    test_refusals();
    printf("test_attend: %ld checks, %d failures\n", g_checks, g_failures);
    return g_failures != 0;
}
