/*
 * test_variants.c - the score-level variants of issue 13 in the fused core
 * (csrc/core/rules.h, kernels/flash.inc, kernels/bwd.inc): sliding windows,
 * softcap, ALiBi, attention sinks (and dsinks), key_mask, packed sequences
 * and T5's relative bias (issue 38, and drel_table), alone and together
 * with the bool / additive masks and key_lengths.
 *
 * Build and run (see the Makefile beside this file):
 *   make -C tests/c check
 *   ./test_variants          everything (exit status 1 on any failure)
 *   ./test_variants quick    fewer ISA / thread combinations (sanitizers)
 *
 * What is checked:
 *   - the forward (out, weights, lse) of mha_forward (float, double) against a
 *     naive dense reference in double written from mha.h's contract (loops,
 *     one rule per line), on every ISA this CPU runs and at 1 and 3
 *     threads, with bitwise equality across the thread counts; shapes are
 *     awkward on purpose (T not a multiple of any tile, GQA G < H, Tq != Tk);
 *   - the backward: central finite differences of sum(out * R) for a few
 *     entries of x, wq, key, of the sinks (dsinks) and of T5's table
 *     (drel_table), per case; bitwise
 *     equality of every gradient across thread counts (1 thread runs the
 *     fused dK/dV/dQ pass, 3 threads the two-pass plan); a window's
 *     gradients equal those of the same call with the window written as a
 *     dense bool mask;
 *   - block skipping: see test_skipping (NaN keys in blocks that must be
 *     skipped; the backward's dQ product would turn them into NaN if the
 *     block were computed) and test_skip_timing (a narrow window must cost
 *     a fraction of the full causal call);
 *   - mha_check_config rejects each malformed field with its field id and
 *     a message naming the values; the entry points' own checks likewise.
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

/* ------------------------------------------------------------------ */
/* One case: the options of a call.                                    */

enum { KM_NONE, KM_PATTERN };       /* key_mask: none, or left/inner/right */
enum { AL_NONE, AL_H, AL_BH };      /* ALiBi slopes (H,) or (B, H)         */
enum { REL_NONE, REL_BI, REL_DEC }; /* T5's bias: encoder, decoder         */
enum { BM_NONE, BM_ONE, BM_BH };    /* a block mask: none, shared, per (b, h) */
#define REL_NB 16                   /* its buckets, and its max distance   */
#define REL_MD 40

typedef struct {
    const char *name;
    size_t B, Tq, Tk, Din, H, G, dk, dv;
    int has_wo;
    int causal, windowed;
    int64_t wl, wr;
    size_t chunk;
    int has_q_offset;            /* query i at i + q_offset (issue 40)      */
    int64_t q_offset;
    int bm;                      /* BM_*, in blocks of bq x bk               */
    size_t bq, bk;
    double softcap;
    int alibi, sinks, key_mask, rel;
    mha_mask_kind mask_kind;
    int key_lengths;             /* 1: key_lengths (B,), item 1 gets 0 keys */
    size_t nseq;
    int64_t cu_q[8], cu_k[8];
    double scale;                /* multiplier of every head's 1/sqrt(dk)   */
} spec;

/* A problem: the spec's config and its inputs, in double (the float32
   calls use the same values rounded to float, and so does the reference). */
typedef struct {
    spec sp;
    mha_config cfg;
    size_t dkv[8], dvv[8];
    double scale[16], slopes[32], sinks[16], reltab[REL_NB * 16];
    int64_t klen[8];
    size_t Sq, Sk, Sv, Svq, Dout;
    double *x, *key, *value, *wq, *wk, *wv, *wo, *maskd, *R;
    uint8_t *maskb, *km;
    int32_t *bm_e;               /* the block mask's entries and bits         */
    uint8_t *bm_bits;
} prob;

/* The block mask's pattern (True: visible): documents of 37 queries and
   keys, a stripe across them that depends on b and h, and rows i = 5 mod
   11 that see nothing. */
static int bm_pattern(size_t b, size_t h, size_t i, size_t j)
{
    if (i % 11 == 5)
        return 0;
    return i / 37 == j / 37 || (i + 2 * j + b + 3 * h) % 5 == 0;
}

/* The spec's block mask of bm_pattern, (B or 1, H or 1) patterns of
   (Tq, Tk) in blocks of bq x bk, into P->bm_e, P->bm_bits and the config. */
static void bm_init(prob *P, mha_config *c)
{
    const spec *sp = &P->sp;
    const size_t nb = sp->bm == BM_BH ? sp->B : 1, nh = sp->bm == BM_BH ? sp->H : 1;
    const size_t bq = sp->bq, bk = sp->bk, rb = (bk + 7) / 8;
    const size_t nqb = (sp->Tq + bq - 1) / bq, nkb = (sp->Tk + bk - 1) / bk;
    const size_t n = nb * nh * nqb * nkb;
    P->bm_e = xcalloc(n, sizeof *P->bm_e);
    P->bm_bits = xcalloc(n * bq * rb + 1, 1);     /* room for every block */
    size_t np = 0;
    for (size_t e = 0; e < n; e++) {
        const size_t kb = e % nkb, qb = e / nkb % nqb, h = e / nkb / nqb % nh;
        const size_t b = e / nkb / nqb / nh;
        size_t seen = 0, all = 0;
        uint8_t *bits = P->bm_bits + np * bq * rb;
        for (size_t r = 0; r < bq && qb * bq + r < sp->Tq; r++)
            for (size_t t = 0; t < bk && kb * bk + t < sp->Tk; t++) {
                all++;
                if (bm_pattern(b, h, qb * bq + r, kb * bk + t)) {
                    seen++;
                    bits[r * rb + t / 8] |= (uint8_t)(1u << (t % 8));
                }
            }
        if (seen == 0 || seen == all) {
            memset(bits, 0, bq * rb);
            P->bm_e[e] = seen == 0 ? MHA_BM_EMPTY : MHA_BM_FULL;
        } else {
            P->bm_e[e] = (int32_t)np++;
        }
    }
    c->bm_block = P->bm_e, c->bm_bits = P->bm_bits;
    c->bm_bq = bq, c->bm_bk = bk, c->bm_npartial = np;
    c->bm_hstride = nh > 1 ? nqb * nkb : 0;
    c->bm_bstride = nb > 1 ? nh * nqb * nkb : 0;
}

static void prob_init(prob *P, const spec *sp)
{
    memset(P, 0, sizeof *P);
    P->sp = *sp;
    const size_t B = sp->B, Tq = sp->Tq, Tk = sp->Tk, H = sp->H, G = sp->G;
    for (size_t g = 0; g < G; g++) {
        P->dkv[g] = sp->dk;
        P->dvv[g] = sp->dv;
    }
    for (size_t h = 0; h < H; h++) {
        P->scale[h] = sp->scale / sqrt((double)sp->dk);
        P->sinks[h] = (double)(float)(0.5 + rng_unit());
    }
    for (size_t e = 0; e < B * H; e++)
        P->slopes[e] = 0.02 + 0.2 * fabs(rng_unit());
    for (size_t e = 0; e < REL_NB * H; e++)
        P->reltab[e] = (double)(float)rng_unit();
    P->Sq = H * sp->dk, P->Sk = G * sp->dk, P->Sv = G * sp->dv, P->Svq = H * sp->dv;
    P->Dout = sp->has_wo ? 20 : P->Svq;
    P->x = rand_vec(B * Tq * sp->Din, 1);
    P->key = rand_vec(B * Tk * sp->Din, 1);
    P->value = rand_vec(B * Tk * sp->Din, 1);
    P->wq = rand_vec(sp->Din * P->Sq, 0.5);
    P->wk = rand_vec(sp->Din * P->Sk, 0.5);
    P->wv = rand_vec(sp->Din * P->Sv, 0.5);
    P->wo = sp->has_wo ? rand_vec(P->Svq * P->Dout, 0.5) : NULL;
    P->R = rand_vec(B * Tq * P->Dout, 1);
    P->maskd = rand_vec(B * H * Tq * Tk, 0.7);
    P->maskb = xcalloc(B * H * Tq * Tk, 1);
    for (size_t e = 0; e < B * H * Tq * Tk; e++)
        P->maskb[e] = (rng_u64() % 5) != 0;
    P->km = xcalloc(B * Tk, 1);
    for (size_t b = 0; b < B; b++)
        for (size_t j = 0; j < Tk; j++) {
            // item 0: left padding; item 1: inner; item 2+: right padding
            int real = 1;
            if (b % 3 == 0)
                real = j >= 70;
            else if (b % 3 == 1)
                real = j < 64 || j >= 140;
            else
                real = j < Tk - 45;
            P->km[b * Tk + j] = (uint8_t)(real ? 1 + (rng_u64() % 3 != 0) * 7 : 0);
        }
    for (size_t b = 0; b < B; b++)
        P->klen[b] = b == 1 ? 0 : (int64_t)(Tk - 7 * b);

    mha_config *c = &P->cfg;
    c->B = B, c->Tq = Tq, c->Tk = Tk;
    c->Din = c->Dkin = c->Dvin = sp->Din;
    c->Dout = P->Dout;
    c->H = H, c->G = G, c->dk = P->dkv, c->dv = P->dvv, c->scale = P->scale;
    c->causal = sp->causal;
    c->has_wo = sp->has_wo;
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
    c->chunk = sp->chunk;
    c->has_q_offset = sp->has_q_offset, c->q_offset = sp->q_offset;
    c->softcap = sp->softcap;
    c->alibi = sp->alibi ? P->slopes : NULL;
    c->alibi_bstride = sp->alibi == AL_BH ? H : 0;
    c->sinks = sp->sinks ? P->sinks : NULL; /* rebound per type by the runners */
    c->key_mask = sp->key_mask ? P->km : NULL;
    if (sp->rel) { /* rebound per type by the runners */
        c->rel_table = P->reltab;
        c->rel_buckets = REL_NB, c->rel_max_distance = REL_MD;
        c->rel_bidirectional = sp->rel == REL_BI;
    }
    c->nseq = sp->nseq;
    c->cu_q = sp->nseq ? P->sp.cu_q : NULL;
    c->cu_k = sp->nseq ? P->sp.cu_k : NULL;
    if (sp->bm)
        bm_init(P, c);
}

static void prob_free(prob *P)
{
    free(P->x), free(P->key), free(P->value), free(P->wq), free(P->wk);
    free(P->wv), free(P->wo), free(P->maskd), free(P->R), free(P->maskb);
    free(P->km), free(P->bm_e), free(P->bm_bits);
}

/* ------------------------------------------------------------------ */
/* The reference: the projections, harness.h's ref_row, W^O.          */

/* out (B, Tq, Dout), w (B, H, Tq, Tk), lse (B, H, Tq). `sinks` is the
   sink values in use (NULL: none). */
static void ref_forward(const prob *P, const double *sinks, double *out,
                        double *w, double *lse)
{
    const spec *sp = &P->sp;
    const size_t B = sp->B, Tq = sp->Tq, Tk = sp->Tk, H = sp->H, Din = sp->Din;
    const size_t dk = sp->dk, dv = sp->dv, per = H / sp->G;
    double *q = xcalloc(B * Tq * P->Sq, sizeof *q), *k = xcalloc(B * Tk * P->Sk, sizeof *k);
    double *v = xcalloc(B * Tk * P->Sv, sizeof *v), *cat = xcalloc(B * Tq * P->Svq, sizeof *cat);
    for (size_t r = 0; r < B * Tq; r++)
        for (size_t c = 0; c < P->Sq; c++)
            for (size_t d = 0; d < Din; d++)
                q[r * P->Sq + c] += P->x[r * Din + d] * P->wq[d * P->Sq + c];
    for (size_t r = 0; r < B * Tk; r++) {
        for (size_t c = 0; c < P->Sk; c++)
            for (size_t d = 0; d < Din; d++)
                k[r * P->Sk + c] += P->key[r * Din + d] * P->wk[d * P->Sk + c];
        for (size_t c = 0; c < P->Sv; c++)
            for (size_t d = 0; d < Din; d++)
                v[r * P->Sv + c] += P->value[r * Din + d] * P->wv[d * P->Sv + c];
    }
    for (size_t b = 0; b < B; b++)
        for (size_t h = 0; h < H; h++)
            for (size_t i = 0; i < Tq; i++) {
                const size_t g = h / per, bhi = (b * H + h) * Tq + i;
                lse[bhi] = ref_row(&P->cfg, P->scale[h], P->maskb, P->maskd,
                                   sinks ? &sinks[h] : NULL, b, h, i,
                                   q + (b * Tq + i) * P->Sq + h * dk,
                                   k + b * Tk * P->Sk + g * dk, P->Sk,
                                   v + b * Tk * P->Sv + g * dv, P->Sv, dk, dv,
                                   cat + (b * Tq + i) * P->Svq + h * dv, w + bhi * Tk);
            }
    for (size_t r = 0; r < B * Tq; r++)
        for (size_t c = 0; c < P->Dout; c++) {
            double acc = 0;
            if (!sp->has_wo)
                acc = cat[r * P->Svq + c];
            else
                for (size_t d = 0; d < P->Svq; d++)
                    acc += cat[r * P->Svq + d] * P->wo[d * P->Dout + c];
            out[r * P->Dout + c] = acc;
        }
    free(q), free(k), free(v), free(cat);
}

/* ------------------------------------------------------------------ */
/* The core, either type, through double arrays.                       */

typedef struct {
    double *out, *w, *lse, *q, *k, *v, *cat;   /* forward outputs */
} fwd_out;

typedef struct {
    double *dx, *dkey, *dvalue, *dwq, *dwk, *dwv, *dwo, *dsinks;
    double *drel;   /* (REL_NB, H), with T5's bias */
} bwd_out;

static float *to_f(const double *a, size_t n)
{
    if (a == NULL)
        return NULL;
    float *f = xcalloc(n, sizeof *f);
    for (size_t i = 0; i < n; i++)
        f[i] = (float)a[i];
    return f;
}

static void from_f(double *a, const float *f, size_t n)
{
    for (size_t i = 0; i < n; i++)
        a[i] = (double)f[i];
}

static size_t nx(const prob *P) { return P->sp.B * P->sp.Tq * P->sp.Din; }
static size_t nkey(const prob *P) { return P->sp.B * P->sp.Tk * P->sp.Din; }

static void fwd_alloc(fwd_out *o, const prob *P)
{
    const size_t B = P->sp.B, Tq = P->sp.Tq, Tk = P->sp.Tk, H = P->sp.H;
    o->out = xcalloc(B * Tq * P->Dout, sizeof(double));
    o->w = xcalloc(B * H * Tq * Tk, sizeof(double));
    o->lse = xcalloc(B * H * Tq, sizeof(double));
    o->q = xcalloc(B * Tq * P->Sq, sizeof(double));
    o->k = xcalloc(B * Tk * P->Sk, sizeof(double));
    o->v = xcalloc(B * Tk * P->Sv, sizeof(double));
    o->cat = xcalloc(B * Tq * P->Svq, sizeof(double));
}

static void fwd_free(fwd_out *o)
{
    free(o->out), free(o->w), free(o->lse), free(o->q), free(o->k), free(o->v);
    free(o->cat);
}

/* The sizes of the forward's outputs, in the order of fwd_out. */
static void fwd_sizes(const prob *P, size_t n[7])
{
    const size_t B = P->sp.B, Tq = P->sp.Tq, Tk = P->sp.Tk, H = P->sp.H;
    n[0] = B * Tq * P->Dout, n[1] = B * H * Tq * Tk, n[2] = B * H * Tq;
    n[3] = B * Tq * P->Sq, n[4] = B * Tk * P->Sk, n[5] = B * Tk * P->Sv;
    n[6] = B * Tq * P->Svq;
}

static mha_status run_fwd(const prob *P, int f64, const fwd_out *o)
{
    size_t n[7];
    fwd_sizes(P, n);
    mha_config cfg = P->cfg;
    // Every output starts as NaN: an element the core leaves unwritten
    // fails the comparisons.
    double *od0[7] = {o->out, o->w, o->lse, o->q, o->k, o->v, o->cat};
    for (int t = 0; t < 7; t++)
        for (size_t e = 0; od0[t] != NULL && e < n[t]; e++)
            od0[t][e] = NAN;
    if (f64) {
        cfg.sinks = P->sp.sinks ? P->sinks : NULL;
        const mha_params prm = {
            .dtype = MHA_DTYPE_F64, .out = o->out, .weights = o->w, .q = o->q, .k = o->k,
            .v = o->v, .concat = o->cat, .lse = o->lse, .x = P->x, .key = P->key,
            .value = P->value, .wq = P->wq, .wk = P->wk, .wv = P->wv, .wo = P->wo};
        return mha_forward(&cfg, &prm, NULL);
    }
    const size_t Din = P->sp.Din;
    float *x = to_f(P->x, nx(P)), *key = to_f(P->key, nkey(P));
    float *value = to_f(P->value, nkey(P)), *wq = to_f(P->wq, Din * P->Sq);
    float *wk = to_f(P->wk, Din * P->Sk), *wv = to_f(P->wv, Din * P->Sv);
    float *wo = to_f(P->wo, P->Svq * P->Dout);
    float *maskd = to_f(P->maskd, n[1]), *sinks = to_f(P->sinks, P->sp.H);
    float *rel = to_f(P->reltab, REL_NB * P->sp.H);
    if (cfg.mask_kind == MHA_MASK_ADD)
        cfg.mask = maskd;
    cfg.sinks = P->sp.sinks ? sinks : NULL;
    cfg.rel_table = P->sp.rel ? rel : NULL;
    float *of[7];
    for (int t = 0; t < 7; t++) {
        of[t] = xcalloc(n[t], sizeof(float));
        for (size_t e = 0; e < n[t]; e++)
            of[t][e] = NAN;
    }
    const mha_params prm = {
        .dtype = MHA_DTYPE_F32, .out = of[0], .weights = of[1], .q = of[3], .k = of[4],
        .v = of[5], .concat = of[6], .lse = of[2], .x = x, .key = key, .value = value,
        .wq = wq, .wk = wk, .wv = wv, .wo = wo};
    const mha_status st = mha_forward(&cfg, &prm, NULL);
    double *od[7] = {o->out, o->w, o->lse, o->q, o->k, o->v, o->cat};
    for (int t = 0; t < 7; t++) {
        from_f(od[t], of[t], n[t]);
        free(of[t]);
    }
    free(x), free(key), free(value), free(wq), free(wk), free(wv), free(wo);
    free(maskd), free(sinks), free(rel);
    return st;
}

static void bwd_alloc(bwd_out *g, const prob *P)
{
    const size_t Din = P->sp.Din;
    g->dx = xcalloc(nx(P), sizeof(double));
    g->dkey = xcalloc(nkey(P), sizeof(double));
    g->dvalue = xcalloc(nkey(P), sizeof(double));
    g->dwq = xcalloc(Din * P->Sq, sizeof(double));
    g->dwk = xcalloc(Din * P->Sk, sizeof(double));
    g->dwv = xcalloc(Din * P->Sv, sizeof(double));
    g->dwo = xcalloc(P->Svq * P->Dout, sizeof(double));
    g->dsinks = xcalloc(P->sp.H, sizeof(double));
    g->drel = xcalloc(REL_NB * P->sp.H, sizeof(double));
}

static void bwd_free(bwd_out *g)
{
    free(g->dx), free(g->dkey), free(g->dvalue), free(g->dwq), free(g->dwk);
    free(g->dwv), free(g->dwo), free(g->dsinks), free(g->drel);
}

static void bwd_sizes(const prob *P, size_t n[8])
{
    const size_t Din = P->sp.Din;
    n[0] = nx(P), n[1] = nkey(P), n[2] = nkey(P), n[3] = Din * P->Sq;
    n[4] = Din * P->Sk, n[5] = Din * P->Sv, n[6] = P->Svq * P->Dout;
    n[7] = P->sp.H;
}

/* The backward of run_fwd's call with dout = P->R; fo holds that
   forward's kept outputs (in double, exact for float ones). */
static mha_status run_bwd(const prob *P, int f64, const fwd_out *fo, const bwd_out *g)
{
    size_t n[8], nf[7];
    bwd_sizes(P, n);
    fwd_sizes(P, nf);
    mha_config cfg = P->cfg;
    double *wo_d = P->sp.has_wo ? g->dwo : NULL;
    if (f64) {
        cfg.sinks = P->sp.sinks ? P->sinks : NULL;
        const mha_params prm = {
            .dtype = MHA_DTYPE_F64, .dx = g->dx, .dkey = g->dkey, .dvalue = g->dvalue,
            .dwq = g->dwq, .dwk = g->dwk, .dwv = g->dwv, .dwo = wo_d, .dsinks = g->dsinks,
            .drel_table = g->drel,
            .dout = P->R, .x = P->x, .key = P->key, .value = P->value, .wq = P->wq,
            .wk = P->wk, .wv = P->wv, .wo = P->wo, .q = fo->q, .k = fo->k, .v = fo->v,
            .concat = fo->cat, .lse = fo->lse};
        return mha_backward(&cfg, &prm, NULL);
    }
    const size_t Din = P->sp.Din;
    float *x = to_f(P->x, nx(P)), *key = to_f(P->key, nkey(P));
    float *value = to_f(P->value, nkey(P)), *wq = to_f(P->wq, Din * P->Sq);
    float *wk = to_f(P->wk, Din * P->Sk), *wv = to_f(P->wv, Din * P->Sv);
    float *wo = to_f(P->wo, P->Svq * P->Dout), *R = to_f(P->R, nf[0]);
    float *maskd = to_f(P->maskd, nf[1]), *sinks = to_f(P->sinks, P->sp.H);
    float *q = to_f(fo->q, nf[3]), *k = to_f(fo->k, nf[4]), *v = to_f(fo->v, nf[5]);
    float *cat = to_f(fo->cat, nf[6]), *lse = to_f(fo->lse, nf[2]);
    float *rel = to_f(P->reltab, REL_NB * P->sp.H);
    float *drel = xcalloc(REL_NB * P->sp.H, sizeof(float));
    if (cfg.mask_kind == MHA_MASK_ADD)
        cfg.mask = maskd;
    cfg.sinks = P->sp.sinks ? sinks : NULL;
    cfg.rel_table = P->sp.rel ? rel : NULL;
    float *gf[8];
    for (int t = 0; t < 8; t++)
        gf[t] = xcalloc(n[t], sizeof(float));
    const mha_params prm = {
        .dtype = MHA_DTYPE_F32, .dx = gf[0], .dkey = gf[1], .dvalue = gf[2], .dwq = gf[3],
        .dwk = gf[4], .dwv = gf[5], .dwo = P->sp.has_wo ? gf[6] : NULL, .dsinks = gf[7],
        .drel_table = drel,
        .dout = R, .x = x, .key = key, .value = value, .wq = wq, .wk = wk, .wv = wv,
        .wo = wo, .q = q, .k = k, .v = v, .concat = cat, .lse = lse};
    const mha_status st = mha_backward(&cfg, &prm, NULL);
    double *gd[8] = {g->dx, g->dkey, g->dvalue, g->dwq, g->dwk, g->dwv, g->dwo, g->dsinks};
    for (int t = 0; t < 8; t++) {
        from_f(gd[t], gf[t], n[t]);
        free(gf[t]);
    }
    free(x), free(key), free(value), free(wq), free(wk), free(wv), free(wo);
    from_f(g->drel, drel, REL_NB * P->sp.H);
    free(R), free(maskd), free(sinks), free(q), free(k), free(v), free(cat), free(lse);
    free(rel), free(drel);
    return st;
}

/* ------------------------------------------------------------------ */
/* Comparisons.                                                        */

/* Largest |a - b| / (1 + |b|), with -inf == -inf and NaN anywhere = inf. */
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

static int all_finite(const double *a, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(a[i]))
            return 0;
    return 1;
}

static int g_quick;
static const int k_isas[] = {MHA_ISA_SCALAR, MHA_ISA_AVX2, MHA_ISA_AVX512};

/* The forward of one case against the reference, on every ISA this CPU
   runs, both types, 1 and 3 threads, and bitwise across the counts. */
static void check_forward(const prob *P)
{
    size_t n[7];
    fwd_sizes(P, n);
    const size_t B = P->sp.B, Tq = P->sp.Tq, Tk = P->sp.Tk, H = P->sp.H;
    double *out = xcalloc(n[0], sizeof(double)), *w = xcalloc(n[1], sizeof(double));
    double *lse = xcalloc(n[2], sizeof(double));
    ref_forward(P, P->sp.sinks ? P->sinks : NULL, out, w, lse);
    (void)B, (void)Tq, (void)Tk, (void)H;
    for (int ii = 0; ii < 3; ii++) {
        if (mha_set_isa((mha_isa)k_isas[ii]) != k_isas[ii])
            continue;
        for (int f64 = 0; f64 <= 1; f64++) {
            if (g_quick && ii == 0 && !f64)
                continue;
            const double tol = f64 ? 1e-11 : 3e-5;
            fwd_out o[2];
            for (int t = 0; t < 2; t++) {
                fwd_alloc(&o[t], P);
                mha_set_num_threads(t == 0 ? 1 : 3);
                const mha_status st = run_fwd(P, f64, &o[t]);
                CHECK(st == MHA_OK, "%s: forward status %d", P->sp.name, (int)st);
            }
            const char *isa = mha_isa_name((mha_isa)k_isas[ii]);
            const double eo = max_err(o[0].out, out, n[0]);
            const double ew = max_err(o[0].w, w, n[1]);
            const double el = max_err(o[0].lse, lse, n[2]);
            CHECK(eo <= tol, "%s %s f%d: out err %.3g", P->sp.name, isa, f64 ? 64 : 32, eo);
            CHECK(ew <= tol, "%s %s f%d: weights err %.3g", P->sp.name, isa, f64 ? 64 : 32, ew);
            CHECK(el <= tol, "%s %s f%d: lse err %.3g", P->sp.name, isa, f64 ? 64 : 32, el);
            CHECK(all_finite(o[0].out, n[0]) && all_finite(o[0].w, n[1]),
                  "%s %s: NaN or inf in out / weights", P->sp.name, isa);
            CHECK(memcmp(o[0].out, o[1].out, n[0] * sizeof(double)) == 0 &&
                      memcmp(o[0].w, o[1].w, n[1] * sizeof(double)) == 0 &&
                      memcmp(o[0].lse, o[1].lse, n[2] * sizeof(double)) == 0,
                  "%s %s f%d: forward differs between 1 and 3 threads", P->sp.name,
                  isa, f64 ? 64 : 32);
            fwd_free(&o[0]), fwd_free(&o[1]);
        }
    }
    mha_set_isa(MHA_ISA_AVX512);
    mha_set_num_threads(0);
    free(out), free(w), free(lse);
}

/* sum(out * R) of the f64 core's forward (the loss the FD checks). */
static double loss_f64(const prob *P)
{
    fwd_out o;
    fwd_alloc(&o, P);
    run_fwd(P, 1, &o);
    double L = 0;
    for (size_t e = 0; e < P->sp.B * P->sp.Tq * P->Dout; e++)
        L += o.out[e] * P->R[e];
    fwd_free(&o);
    return L;
}

/* d loss / d *p by central differences. */
static double fd(prob *P, double *p)
{
    const double h = 1e-5, keep = *p;
    *p = keep + h;
    const double up = loss_f64(P);
    *p = keep - h;
    const double dn = loss_f64(P);
    *p = keep;
    return (up - dn) / (2 * h);
}

/* The backward of one case: finite differences (f64, this ISA), and
   bitwise equality across 1 and 3 threads on every ISA and type. */
static void check_backward(prob *P)
{
    size_t n[8];
    bwd_sizes(P, n);
    fwd_out fo;
    bwd_out g;
    fwd_alloc(&fo, P);
    bwd_alloc(&g, P);
    mha_set_num_threads(1);
    CHECK(run_fwd(P, 1, &fo) == MHA_OK, "%s: forward", P->sp.name);
    CHECK(run_bwd(P, 1, &fo, &g) == MHA_OK, "%s: backward", P->sp.name);
    // A few entries of x, wq and key, and every sink.
    struct { double *arr, *grad; size_t n; const char *what; } t[3] = {
        {P->x, g.dx, nx(P), "x"}, {P->wq, g.dwq, P->sp.Din * P->Sq, "wq"},
        {P->key, g.dkey, nkey(P), "key"}};
    for (int a = 0; a < 3; a++)
        for (int r = 0; r < 3; r++) {
            const size_t e = (size_t)(rng_u64() % t[a].n);
            const double num = fd(P, t[a].arr + e);
            CHECK(fabs(num - t[a].grad[e]) <= 2e-7 * (1 + fabs(num)),
                  "%s: d%s[%zu] fd %.10g backward %.10g", P->sp.name, t[a].what, e,
                  num, t[a].grad[e]);
        }
    for (size_t h = 0; P->sp.sinks && h < P->sp.H; h++) {
        const double num = fd(P, P->sinks + h);
        CHECK(fabs(num - g.dsinks[h]) <= 2e-7 * (1 + fabs(num)),
              "%s: dsinks[%zu] fd %.10g backward %.10g", P->sp.name, h, num, g.dsinks[h]);
    }
    // T5's table: a few entries, among them the last bucket (far keys).
    for (int r = 0; P->sp.rel && r < 4; r++) {
        const size_t e = r == 0 ? (REL_NB - 1) * P->sp.H : (size_t)(rng_u64() % (REL_NB * P->sp.H));
        const double num = fd(P, P->reltab + e);
        CHECK(fabs(num - g.drel[e]) <= 2e-7 * (1 + fabs(num)),
              "%s: drel_table[%zu] fd %.10g backward %.10g", P->sp.name, e, num, g.drel[e]);
    }
    for (int f = 0; f < 8; f++) {
        const double *gd[8] = {g.dx, g.dkey, g.dvalue, g.dwq, g.dwk, g.dwv, g.dwo, g.dsinks};
        CHECK(all_finite(gd[f], n[f]), "%s: gradient %d not finite", P->sp.name, f);
    }
    bwd_free(&g);
    fwd_free(&fo);

    for (int ii = 0; ii < 3; ii++) {
        if (mha_set_isa((mha_isa)k_isas[ii]) != k_isas[ii])
            continue;
        for (int f64 = 0; f64 <= 1; f64++) {
            if (g_quick && !(ii == 1 && f64))
                continue;
            bwd_out gt[2];
            fwd_alloc(&fo, P);
            mha_set_num_threads(1);
            run_fwd(P, f64, &fo);
            for (int k = 0; k < 2; k++) {
                bwd_alloc(&gt[k], P);
                mha_set_num_threads(k == 0 ? 1 : 3);
                CHECK(run_bwd(P, f64, &fo, &gt[k]) == MHA_OK, "%s: backward", P->sp.name);
            }
            const double *a[8] = {gt[0].dx, gt[0].dkey, gt[0].dvalue, gt[0].dwq,
                                  gt[0].dwk, gt[0].dwv, gt[0].dwo, gt[0].dsinks};
            const double *b[8] = {gt[1].dx, gt[1].dkey, gt[1].dvalue, gt[1].dwq,
                                  gt[1].dwk, gt[1].dwv, gt[1].dwo, gt[1].dsinks};
            for (int f = 0; f < 8; f++)
                CHECK(memcmp(a[f], b[f], n[f] * sizeof(double)) == 0,
                      "%s %s f%d: gradient %d differs between 1 and 3 threads",
                      P->sp.name, mha_isa_name((mha_isa)k_isas[ii]), f64 ? 64 : 32, f);
            CHECK(memcmp(gt[0].drel, gt[1].drel, REL_NB * P->sp.H * sizeof(double)) == 0,
                  "%s %s f%d: drel_table differs between 1 and 3 threads", P->sp.name,
                  mha_isa_name((mha_isa)k_isas[ii]), f64 ? 64 : 32);
            bwd_free(&gt[0]), bwd_free(&gt[1]);
            fwd_free(&fo);
        }
    }
    mha_set_isa(MHA_ISA_AVX512);
    mha_set_num_threads(0);
}

/* ------------------------------------------------------------------ */
/* The cases.                                                          */

/* A case overrides BASE's fields: designated initialisers, the last one
   wins (C11 6.7.9), which GCC's -Wextra flags. */
#pragma GCC diagnostic ignored "-Woverride-init"
#define BASE .B = 2, .Tq = 203, .Tk = 203, .Din = 12, .H = 4, .G = 2, .dk = 16, \
             .dv = 12, .has_wo = 1, .scale = 1.0

static const spec k_cases[] = {
    {.name = "plain", BASE},
    {.name = "causal+window(20,0)", BASE, .causal = 1, .windowed = 1, .wl = 20, .wr = 0},
    {.name = "window(15,9) Tq!=Tk", BASE, .Tq = 150, .Tk = 221, .windowed = 1, .wl = 15,
     .wr = 9},
    {.name = "window(None,12)", BASE, .Tq = 130, .windowed = 1, .wl = -1, .wr = 12},
    {.name = "window(30,None)+bool", BASE, .windowed = 1, .wl = 30, .wr = -1,
     .mask_kind = MHA_MASK_BOOL},
    {.name = "causal+window Tq>Tk", BASE, .Tq = 211, .Tk = 150, .causal = 1, .windowed = 1,
     .wl = 40, .wr = 5, .sinks = 1},
    {.name = "window(3,150) Tq>>Tk", BASE, .Tq = 230, .Tk = 70, .windowed = 1, .wl = 3,
     .wr = 150, .sinks = 1},
    {.name = "window(150,0) Tq>>Tk", BASE, .Tq = 230, .Tk = 70, .windowed = 1, .wl = 150,
     .wr = 0},
    {.name = "softcap", BASE, .softcap = 1.5, .scale = 4.0},
    {.name = "softcap+causal+add", BASE, .softcap = 2.0, .scale = 3.0, .causal = 1,
     .mask_kind = MHA_MASK_ADD},
    {.name = "alibi(H)", BASE, .alibi = AL_H},
    {.name = "alibi(B,H)+causal", BASE, .alibi = AL_BH, .causal = 1, .Tq = 170},
    {.name = "sinks", BASE, .sinks = 1},
    {.name = "sinks+masked rows", BASE, .B = 3, .Tq = 230, .Tk = 190, .causal = 1,
     .sinks = 1, .key_lengths = 1, .key_mask = KM_PATTERN},
    {.name = "key_mask", BASE, .B = 3, .Tk = 230, .key_mask = KM_PATTERN},
    {.name = "key_mask+causal+bool+lengths", BASE, .B = 3, .key_mask = KM_PATTERN,
     .causal = 1, .mask_kind = MHA_MASK_BOOL, .key_lengths = 1},
    {.name = "packed", BASE, .B = 1, .Tq = 197, .Tk = 230, .nseq = 4,
     .cu_q = {0, 50, 50, 120, 197}, .cu_k = {0, 70, 100, 100, 230}},
    {.name = "packed+causal+window+sinks+alibi", BASE, .B = 1, .Tq = 197, .Tk = 230,
     .nseq = 4, .cu_q = {0, 50, 50, 120, 197}, .cu_k = {0, 70, 100, 100, 230},
     .causal = 1, .windowed = 1, .wl = 25, .wr = 0, .sinks = 1, .alibi = AL_H},
    {.name = "packed+add+key_mask+lengths", BASE, .B = 1, .Tq = 199, .Tk = 240, .nseq = 3,
     .cu_q = {0, 99, 99, 199}, .cu_k = {0, 120, 180, 240}, .mask_kind = MHA_MASK_ADD,
     .key_mask = KM_PATTERN, .key_lengths = 1, .softcap = 3.0},
    {.name = "everything", BASE, .B = 3, .causal = 1, .windowed = 1, .wl = 50, .wr = 0,
     .softcap = 2.5, .scale = 2.0, .alibi = AL_BH, .sinks = 1, .key_mask = KM_PATTERN,
     .mask_kind = MHA_MASK_BOOL, .key_lengths = 1},
    {.name = "tiny: Tq 1, Tk 5, window+sinks+softcap", BASE, .B = 2, .Tq = 1, .Tk = 5,
     .windowed = 1, .wl = 2, .wr = 0, .sinks = 1, .softcap = 1.0, .key_lengths = 1},
    {.name = "tiny packed: one query per sequence", BASE, .B = 1, .Tq = 3, .Tk = 4,
     .nseq = 3, .cu_q = {0, 1, 2, 3}, .cu_k = {0, 0, 3, 4}, .causal = 1, .sinks = 1,
     .alibi = AL_H},
    {.name = "chunk 48 + causal", BASE, .chunk = 48, .causal = 1},
    {.name = "block mask per (b, h), 16 x 24 + causal", BASE, .bm = BM_BH, .bq = 16, .bk = 24,
     .causal = 1},
    {.name = "block mask 7 x 13 + window + sinks + softcap", BASE, .Tq = 150, .Tk = 190,
     .bm = BM_ONE, .bq = 7, .bk = 13, .windowed = 1, .wl = 60, .wr = -1, .sinks = 1,
     .softcap = 3.0},
    {.name = "block mask 32 x 32 + packed + key_mask + alibi", BASE, .B = 1, .Tq = 199,
     .Tk = 240, .nseq = 3, .cu_q = {0, 99, 99, 199}, .cu_k = {0, 120, 180, 240},
     .bm = BM_BH, .bq = 32, .bk = 32, .key_mask = 1, .alibi = AL_H},
    {.name = "block mask 1 x 1 + bool mask + lengths", BASE, .bm = BM_ONE, .bq = 1, .bk = 1,
     .mask_kind = MHA_MASK_BOOL, .key_lengths = 1},
    {.name = "chunk 37, Tq > Tk (negative positions) + sinks", BASE, .Tq = 230, .Tk = 150,
     .chunk = 37, .sinks = 1},
    {.name = "chunk 64 + window + packed + lengths", BASE, .B = 1, .Tq = 199, .Tk = 240,
     .nseq = 3, .cu_q = {0, 99, 99, 199}, .cu_k = {0, 120, 180, 240}, .chunk = 64,
     .windowed = 1, .wl = 40, .wr = 7, .key_lengths = 1},
    {.name = "q_offset -40 (top rows see nothing) + causal + alibi + sinks", BASE,
     .has_q_offset = 1, .q_offset = -40, .causal = 1, .alibi = AL_H, .sinks = 1},
    {.name = "q_offset 100, Tq < Tk + window + chunk + lengths", BASE, .Tq = 150, .Tk = 230,
     .has_q_offset = 1, .q_offset = 100, .windowed = 1, .wl = 70, .wr = 5, .chunk = 64,
     .key_lengths = 1},
    {.name = "t5 encoder (Tk > max distance)", BASE, .Tq = 150, .Tk = 221, .rel = REL_BI},
    {.name = "t5 decoder+causal+lengths+softcap+add", BASE, .B = 3, .causal = 1,
     .rel = REL_DEC, .key_lengths = 1, .softcap = 2.0, .mask_kind = MHA_MASK_ADD},
    {.name = "t5 packed+window+sinks+alibi", BASE, .B = 1, .Tq = 197, .Tk = 230, .nseq = 4,
     .cu_q = {0, 50, 50, 120, 197}, .cu_k = {0, 70, 100, 100, 230}, .windowed = 1,
     .wl = 60, .wr = 10, .sinks = 1, .alibi = AL_H, .rel = REL_BI},
    {.name = "everything(add), no wo", BASE, .B = 2, .Tq = 97, .Tk = 260, .has_wo = 0,
     .windowed = 1, .wl = 70, .wr = 30, .softcap = 2.5, .scale = 2.0, .alibi = AL_H,
     .sinks = 1, .key_mask = KM_PATTERN, .mask_kind = MHA_MASK_ADD, .key_lengths = 1},
};

static void test_cases(void)
{
    for (size_t c = 0; c < sizeof k_cases / sizeof k_cases[0]; c++) {
        prob P;
        prob_init(&P, &k_cases[c]);
        check_forward(&P);
        if (!g_quick || c % 4 == 1)
            check_backward(&P);
        prob_free(&P);
    }
}

/* A window's gradients equal those of the same call with the window
   written as a dense bool mask (to rounding: the window skips blocks, so
   some sums lose exact-zero terms, and the forward's blocks start at
   different keys). */
static void test_window_as_mask(void)
{
    spec sp = {.name = "window vs mask", BASE, .causal = 1, .windowed = 1, .wl = 37,
               .wr = 0, .softcap = 2.0, .sinks = 1};
    prob P;
    prob_init(&P, &sp);
    fwd_out fo[2];
    bwd_out g[2];
    mha_set_num_threads(3);
    for (int k = 0; k < 2; k++) {
        if (k == 1) { /* the window as a mask */
            const size_t Tq = sp.Tq, Tk = sp.Tk;
            for (size_t b = 0; b < sp.B; b++)
                for (size_t h = 0; h < sp.H; h++)
                    for (size_t i = 0; i < Tq; i++)
                        for (size_t j = 0; j < Tk; j++)
                            P.maskb[((b * sp.H + h) * Tq + i) * Tk + j] =
                                j <= i && i - j <= 37;
            P.cfg.windowed = 0, P.cfg.window_left = 0, P.cfg.window_right = 0;
            P.cfg.causal = 0;
            P.cfg.mask_kind = MHA_MASK_BOOL;
            P.cfg.mask = P.maskb;
        }
        fwd_alloc(&fo[k], &P);
        bwd_alloc(&g[k], &P);
        CHECK(run_fwd(&P, 1, &fo[k]) == MHA_OK, "window vs mask: forward");
        CHECK(run_bwd(&P, 1, &fo[k], &g[k]) == MHA_OK, "window vs mask: backward");
    }
    size_t n[8], nf[7];
    bwd_sizes(&P, n);
    fwd_sizes(&P, nf);
    CHECK(max_err(fo[0].out, fo[1].out, nf[0]) <= 1e-13, "window vs mask: out");
    const double *a[8] = {g[0].dx, g[0].dkey, g[0].dvalue, g[0].dwq, g[0].dwk,
                          g[0].dwv, g[0].dwo, g[0].dsinks};
    const double *b[8] = {g[1].dx, g[1].dkey, g[1].dvalue, g[1].dwq, g[1].dwk,
                          g[1].dwv, g[1].dwo, g[1].dsinks};
    for (int f = 0; f < 8; f++) {
        const double e = max_err(a[f], b[f], n[f]);
        CHECK(e <= 1e-12, "window vs mask: gradient %d err %.3g", f, e);
    }
    for (int k = 0; k < 2; k++)
        fwd_free(&fo[k]), bwd_free(&g[k]);
    prob_free(&P);
    mha_set_num_threads(0);
}

/*
 * Block skipping, by NaN keys. Keys (and values) of whole 64-key blocks of
 * the backward's grid (kernels.h: MHA_BWD_BK) are set to NaN where no
 * query may see them: before every row's window, under a key block
 * key_mask blocks wholly, or in a packed sequence without queries. The
 * forward masks a computed NaN score to -inf, so its output shows nothing
 * about skipping (it only proves the rules right); but the backward's dQ
 * product, dQ += dS k, multiplies a computed block's keys by dS = 0, and
 * 0 * NaN = NaN: dx is finite only if every such block is skipped by the
 * dQ pass and by the fused pass (1 thread runs the fused pass, 3 threads
 * the separate dK/dV and dQ passes), and, in a block some of whose keys
 * are seen, only if the tile's products skip the unseen keys' columns
 * (bwd.inc, bwd_mm_guarded). dx must also match the same call with those
 * keys finite. So must dwk = key^T dk and dwv = value^T dv, whose NaN rows
 * of key and value meet rows of dk, dv that are exactly 0: the backward
 * reads them as zeros (backward_impl.h, bwd_seen_input).
 */
static void check_nan_skip(const spec *sp, size_t j_lo, size_t j_hi, size_t b_nan)
{
    prob P;
    prob_init(&P, sp);
    fwd_out fo, fo_ref;
    bwd_out g, g_ref;
    const size_t Din = sp->Din, Tk = sp->Tk;
    for (int ii = 0; ii < 3; ii++) {
        if (mha_set_isa((mha_isa)k_isas[ii]) != k_isas[ii])
            continue;
        for (int t = 0; t < 2; t++) {
            mha_set_num_threads(t == 0 ? 1 : 3);
            // The finite call first, then the same with NaN keys.
            fwd_alloc(&fo_ref, &P), bwd_alloc(&g_ref, &P);
            run_fwd(&P, 1, &fo_ref);
            run_bwd(&P, 1, &fo_ref, &g_ref);
            double *keep = xcalloc(2 * (j_hi - j_lo) * Din, sizeof(double));
            for (size_t j = j_lo; j < j_hi; j++)
                for (size_t d = 0; d < Din; d++) {
                    const size_t at = (b_nan * Tk + j) * Din + d;
                    keep[2 * ((j - j_lo) * Din + d)] = P.key[at];
                    keep[2 * ((j - j_lo) * Din + d) + 1] = P.value[at];
                    P.key[at] = NAN;
                    P.value[at] = NAN;
                }
            fwd_alloc(&fo, &P), bwd_alloc(&g, &P);
            CHECK(run_fwd(&P, 1, &fo) == MHA_OK, "%s: forward", sp->name);
            CHECK(run_bwd(&P, 1, &fo, &g) == MHA_OK, "%s: backward", sp->name);
            const size_t n_out = sp->B * sp->Tq * P.Dout;
            const char *isa = mha_isa_name((mha_isa)k_isas[ii]);
            CHECK(all_finite(fo.out, n_out), "%s %s: NaN keys reached out", sp->name, isa);
            CHECK(max_err(fo.out, fo_ref.out, n_out) <= 1e-13, "%s: out", sp->name);
            CHECK(all_finite(g.dx, nx(&P)) && all_finite(g.dwq, Din * P.Sq),
                  "%s %s %d threads: a skipped block's NaN keys reached dx / dwq "
                  "(the block was computed)", sp->name, isa, t == 0 ? 1 : 3);
            CHECK(all_finite(g.dkey, nkey(&P)) && all_finite(g.dvalue, nkey(&P)) &&
                      all_finite(g.dwo, P.Svq * P.Dout),
                  "%s %s: NaN in dkey / dvalue / dwo", sp->name, isa);
            CHECK(all_finite(g.dwk, Din * P.Sk) && all_finite(g.dwv, Din * P.Sv),
                  "%s %s: the NaN rows of key / value reached dwk / dwv", sp->name, isa);
            CHECK(max_err(g.dx, g_ref.dx, nx(&P)) <= 1e-12 &&
                      max_err(g.dkey, g_ref.dkey, nkey(&P)) <= 1e-12 &&
                      max_err(g.dwk, g_ref.dwk, Din * P.Sk) <= 1e-12 &&
                      max_err(g.dwv, g_ref.dwv, Din * P.Sv) <= 1e-12,
                  "%s %s: gradients differ from the finite call", sp->name, isa);
            for (size_t j = j_lo; j < j_hi; j++)
                for (size_t d = 0; d < Din; d++) {
                    const size_t at = (b_nan * Tk + j) * Din + d;
                    P.key[at] = keep[2 * ((j - j_lo) * Din + d)];
                    P.value[at] = keep[2 * ((j - j_lo) * Din + d) + 1];
                }
            free(keep);
            fwd_free(&fo), bwd_free(&g), fwd_free(&fo_ref), bwd_free(&g_ref);
        }
    }
    mha_set_isa(MHA_ISA_AVX512);
    mha_set_num_threads(0);
    prob_free(&P);
}

static void test_skipping(void)
{
    // Window: query i sits at i + 170 and sees keys >= i + 150; keys
    // 0 .. 127 (two blocks) are before every window.
    const spec win = {.name = "skip: window", BASE, .B = 1, .Tq = 130, .Tk = 300,
                      .causal = 1, .windowed = 1, .wl = 20, .wr = 0, .sinks = 1};
    check_nan_skip(&win, 0, 128, 0);
    // key_mask: item 1 has keys 64 .. 139 masked (KM_PATTERN), so block
    // 64 .. 127 is masked wholly, and keys 128 .. 139 of the next block,
    // whose other keys are seen, are masked too.
    const spec km = {.name = "skip: key_mask", BASE, .B = 2, .Tq = 150, .Tk = 256,
                     .key_mask = KM_PATTERN, .softcap = 2.0};
    check_nan_skip(&km, 64, 140, 1);
    // Packed: sequence 1 has keys 64 .. 191 and no query; the query tiles
    // spanning sequences 0 and 2 must skip its blocks (off-diagonal).
    const spec pk = {.name = "skip: packed", BASE, .B = 1, .Tq = 150, .Tk = 300,
                     .nseq = 3, .cu_q = {0, 70, 70, 150}, .cu_k = {0, 64, 192, 300},
                     .alibi = AL_H};
    check_nan_skip(&pk, 64, 192, 0);
    const spec pkc = {.name = "skip: packed causal", BASE, .B = 1, .Tq = 150, .Tk = 300,
                      .nseq = 3, .cu_q = {0, 70, 70, 150}, .cu_k = {0, 64, 192, 300},
                      .causal = 1, .windowed = 1, .wl = 9, .wr = 0};
    check_nan_skip(&pkc, 64, 192, 0);
}

/* The forward of a narrow causal window must cost a fraction of the full
   causal call's (each tile of 192 rows sees ~4 key blocks of 64 instead of
   ~T / 128 on average): a forward that computed and masked the blocks
   would take at least as long. Best of 5 each, on 1 thread. */
static void test_skip_timing(void)
{
    const size_t T = 4096, D = 64, H = 2;
    size_t dk[2] = {D, D}, dv[2] = {D, D};
    double scale[2] = {0.125, 0.125};
    float *x = xcalloc(T * D, sizeof(float)), *w = xcalloc(D * H * D, sizeof(float));
    float *out = xcalloc(T * H * D, sizeof(float));
    for (size_t e = 0; e < T * D; e++)
        x[e] = (float)rng_unit();
    for (size_t e = 0; e < D * H * D; e++)
        w[e] = (float)(0.2 * rng_unit());
    mha_config cfg = {.B = 1, .Tq = T, .Tk = T, .Din = D, .Dkin = D, .Dvin = D,
                      .Dout = H * D, .H = H, .G = H, .dk = dk, .dv = dv,
                      .scale = scale, .causal = 1};
    mha_set_num_threads(1);
    double best[2] = {1e9, 1e9};
    for (int k = 0; k < 2; k++) {
        cfg.windowed = k, cfg.window_left = k ? 63 : 0;
        for (int r = 0; r < 5; r++) {
            const double t0 = now_s();
            const mha_params prm = {.dtype = MHA_DTYPE_F32, .out = out, .x = x, .key = x,
                                    .value = x, .wq = w, .wk = w, .wv = w};
            const mha_status st = mha_forward(&cfg, &prm, NULL);
            const double dt = now_s() - t0;
            CHECK(st == MHA_OK, "timing call");
            best[k] = dt < best[k] ? dt : best[k];
        }
    }
    printf("skip timing (T = %zu, 1 thread, best of 5): causal %.1f ms, "
           "causal + window(63, 0) %.1f ms\n", T, 1e3 * best[0], 1e3 * best[1]);
    CHECK(best[1] < 0.5 * best[0], "window(63, 0) took %.3g of the causal call",
          best[1] / best[0]);
    mha_set_num_threads(0);
    free(x), free(w), free(out);
}

/* ------------------------------------------------------------------ */
/* mha_check_config: each rule accepts a good config and rejects a bad one
   with its status, its field id and a message that names the values.      */

/* 1 when hay contains every needle of the NULL-terminated list. */
static int has_all(const char *hay, const char *const *needles)
{
    for (; *needles != NULL; needles++)
        if (strstr(hay, *needles) == NULL)
            return 0;
    return 1;
}

static void test_config(void)
{
    size_t dk[2] = {8, 8}, dv[2] = {4, 4}, dk_r[2] = {8, 6}, dk0[2] = {8, 0},
           dv0[2] = {4, 0}, huge[2] = {MHA_MAX_ELEMS, MHA_MAX_ELEMS};
    double scale[4] = {1, 1, 1, 1}, slopes[8] = {0};
    int64_t cu_q[3] = {0, 3, 5}, cu_k[3] = {0, 4, 7}, bad_cu[3] = {0, 4, 3};
    int64_t lens[1] = {8};
    float qn[8] = {0};
    uint8_t maskb[1] = {1};
    mha_layout lay;
    mha_error err;
    const mha_config base = {.B = 1, .Tq = 5, .Tk = 7, .Din = 3, .Dkin = 3, .Dvin = 3,
                             .Dout = 2, .H = 4, .G = 2, .dk = dk, .dv = dv,
                             .scale = scale, .has_wo = 1};
    CHECK(mha_check_config(&lay, &base, &err) == MHA_OK && err.field == MHA_FIELD_NONE &&
              err.msg[0] == '\0', "base config");
    CHECK(mha_check_config(&lay, &base, NULL) == MHA_OK, "base config, err NULL");
    mha_config c;
    // BAD(setting, status, field, substrings of the message...): with err
    // and, for the status alone, with err NULL.
#define BAD(field_setting, what, status, fid, ...)                                         \
    do {                                                                                   \
        c = base;                                                                          \
        field_setting;                                                                     \
        static const char *const want_[] = {__VA_ARGS__, NULL};                            \
        err.field = MHA_FIELD_NONE, err.msg[0] = '\0';                                     \
        const mha_status st_ = mha_check_config(&lay, &c, &err);                          \
        CHECK(st_ == (status), "accepted or wrong status: %s (%s)", what,                  \
              mha_status_name(st_));                                                       \
        CHECK(err.field == (fid), "%s: field %d, not %d (%s)", what,             \
              (int)err.field, (int)(fid), err.msg);                              \
        CHECK(has_all(err.msg, want_), "%s: message \"%s\"", what, err.msg);               \
        CHECK(mha_check_config(&lay, &c, NULL) == (status), "%s: err NULL", what);         \
    } while (0)
#define GOOD(field_setting, what)                                             \
    do {                                                                      \
        c = base;                                                             \
        field_setting;                                                        \
        CHECK(mha_check_config(&lay, &c, &err) == MHA_OK && err.field == MHA_FIELD_NONE, \
              "rejected: %s (%s)", what, err.msg);                            \
    } while (0)
    const int A = MHA_ERR_ARG, S = MHA_ERR_SIZE;
    CHECK(mha_check_config(NULL, &base, &err) == MHA_ERR_ARG && err.field == MHA_FIELD_CALL,
          "NULL layout");
    CHECK(mha_check_config(&lay, NULL, &err) == MHA_ERR_ARG && err.field == MHA_FIELD_CALL,
          "NULL config");
    // Heads and widths.
    BAD(c.H = 0, "H = 0", A, MHA_FIELD_H, "H = 0");
    BAD(c.G = 0, "G = 0", A, MHA_FIELD_G, "G = 0");
    BAD((c.H = 6, c.G = 4), "H % G", A, MHA_FIELD_G, "H = 6 is not a multiple of G = 4");
    BAD(c.dk = NULL, "dk NULL", A, MHA_FIELD_DK, "dk is NULL");
    BAD(c.dv = NULL, "dv NULL", A, MHA_FIELD_DV, "dv is NULL");
    BAD(c.scale = NULL, "scale NULL", A, MHA_FIELD_SCALE, "scale is NULL");
    BAD(c.mask_kind = (mha_mask_kind)7, "mask_kind 7", A, MHA_FIELD_MASK_KIND,
        "mask_kind = 7");
    BAD(c.mask_kind = MHA_MASK_BOOL, "mask NULL", A, MHA_FIELD_MASK, "mask is NULL",
        "mask_kind = 1");
    GOOD((c.mask_kind = MHA_MASK_BOOL, c.mask = maskb), "bool mask");
    BAD(c.dk = dk0, "dk[1] = 0", A, MHA_FIELD_DK, "dk[1] = 0");
    BAD(c.dv = dv0, "dv[1] = 0", A, MHA_FIELD_DV, "dv[1] = 0");
    BAD(c.has_wo = 0, "Dout != Svq", A, MHA_FIELD_DOUT, "Dout = 2", "Svq = 16");
    GOOD((c.has_wo = 0, c.Dout = 16), "no W^O, Dout = Svq");
    BAD(c.dk = huge, "Sk overflows", S, MHA_FIELD_DK, "dk[0..1]", "MHA_MAX_ELEMS");
    BAD(c.dv = huge, "Sv overflows", S, MHA_FIELD_DV, "dv[0..1]", "MHA_MAX_ELEMS");
    // Sizes past MHA_MAX_ELEMS.
    BAD(c.Tq = MHA_MAX_ELEMS + 1, "Tq too large", S, MHA_FIELD_TQ, "Tq = ", "MHA_MAX_ELEMS");
    BAD(c.B = MHA_MAX_ELEMS + 1, "B too large", S, MHA_FIELD_B, "B = ", "MHA_MAX_ELEMS");
    BAD(c.Dout = MHA_MAX_ELEMS + 1, "Dout too large", S, MHA_FIELD_DOUT, "Dout = ");
    BAD(c.Din = MHA_MAX_ELEMS / 2, "x too large", S, MHA_FIELD_DIN,
        "x (B, Tq, Din) = (1, 5, ");
    BAD((c.Tq = (size_t)1 << 31, c.Tk = (size_t)1 << 31), "weights too large", S, MHA_FIELD_TK,
        "weights (B, H, Tq, Tk) = (1, 4, 2147483648, 2147483648)");
    // Key lengths.
    GOOD((lens[0] = 7, c.key_lengths = lens), "key_lengths");
    BAD((lens[0] = 8, c.key_lengths = lens), "key_lengths > Tk", A, MHA_FIELD_KEY_LENGTHS,
        "key_lengths[0] = 8", "Tk = 7");
    BAD((lens[0] = -1, c.key_lengths = lens), "key_lengths < 0", A, MHA_FIELD_KEY_LENGTHS,
        "key_lengths[0] = -1");
    // The variants.
    GOOD((c.windowed = 1, c.window_left = -1, c.window_right = 3), "window");
    BAD((c.window_left = 3), "window without windowed", A, MHA_FIELD_WINDOW, "window_left = 3",
        "windowed");
    GOOD(c.softcap = 30, "softcap");
    BAD(c.softcap = -1, "softcap < 0", A, MHA_FIELD_SOFTCAP, "softcap = -1");
    BAD(c.softcap = NAN, "softcap NaN", A, MHA_FIELD_SOFTCAP, "softcap = ");
    BAD(c.softcap = INFINITY, "softcap inf", A, MHA_FIELD_SOFTCAP, "softcap = inf");
    GOOD((c.alibi = slopes, c.alibi_bstride = 4), "alibi (B, H)");
    GOOD((c.alibi = slopes), "alibi (H,)");
    BAD((c.alibi = slopes, c.alibi_bstride = 3), "alibi_bstride 3", A, MHA_FIELD_ALIBI_BSTRIDE,
        "alibi_bstride = 3", "H = 4");
    BAD((c.alibi_bstride = 4), "alibi_bstride without alibi", A, MHA_FIELD_ALIBI,
        "alibi is NULL",
        "alibi_bstride = 4");
    GOOD((c.nseq = 2, c.cu_q = cu_q, c.cu_k = cu_k), "packed");
    BAD((c.nseq = 2, c.cu_q = NULL, c.cu_k = cu_k), "packed, cu_q NULL", A, MHA_FIELD_CU_Q,
        "cu_q is NULL", "nseq = 2");
    BAD((c.nseq = 2, c.cu_q = cu_q, c.cu_k = NULL), "packed, cu_k NULL", A, MHA_FIELD_CU_K,
        "cu_k is NULL");
    BAD((c.nseq = 2, c.cu_q = cu_q, c.cu_k = bad_cu), "packed, decreasing cu_k", A,
        MHA_FIELD_CU_K,
        "cu_k[2] = 3 < cu_k[1] = 4");
    BAD((c.nseq = 2, c.cu_q = cu_k, c.cu_k = cu_k), "packed, cu_q[nseq] != Tq", A,
        MHA_FIELD_CU_Q,
        "cu_q[nseq = 2] = 7 is not Tq = 5");
    BAD((c.nseq = 2, c.cu_q = cu_q, c.cu_k = cu_k, c.B = 2), "packed, B = 2", A,
        MHA_FIELD_NSEQ,
        "nseq = 2", "B = 2");
    BAD((c.nseq = 1, c.cu_q = cu_q + 1, c.cu_k = cu_k), "packed, cu_q[0] != 0", A,
        MHA_FIELD_CU_Q,
        "cu_q[0] = 3");
    BAD((c.nseq = 2, c.cu_q = cu_q, c.cu_k = cu_k, c.lengths_aligned = 1),
        "packed, lengths_aligned", A, MHA_FIELD_LENGTHS_ALIGNED, "lengths_aligned = 1",
        "nseq = 2");
    // q_offset (issue 40): any sign within MHA_MAX_ELEMS, not with the
    // placements of packed sequences or lengths_aligned, nor T5's bias.
    GOOD((c.has_q_offset = 1, c.q_offset = -(int64_t)MHA_MAX_ELEMS), "q_offset -MAX");
    GOOD((c.has_q_offset = 1, c.q_offset = 12, c.causal = 1), "q_offset 12, causal");
    BAD((c.has_q_offset = 1, c.q_offset = (int64_t)MHA_MAX_ELEMS + 1), "q_offset past MAX", A,
        MHA_FIELD_Q_OFFSET, "q_offset = ", "MHA_MAX_ELEMS");
    BAD((c.has_q_offset = 1, c.q_offset = INT64_MIN), "q_offset INT64_MIN", A,
        MHA_FIELD_Q_OFFSET, "MHA_MAX_ELEMS");
    BAD((c.has_q_offset = 1, c.q_offset = 1, c.nseq = 2, c.cu_q = cu_q, c.cu_k = cu_k),
        "q_offset, packed", A, MHA_FIELD_Q_OFFSET, "q_offset = 1", "nseq = 2");
    BAD((c.has_q_offset = 1, c.lengths_aligned = 1, c.key_lengths = lens),
        "q_offset, lengths_aligned", A, MHA_FIELD_Q_OFFSET, "q_offset = 0",
        "lengths_aligned = 1");
    BAD((c.q_offset = 3), "q_offset without has_q_offset", A, MHA_FIELD_Q_OFFSET,
        "q_offset = 3", "has_q_offset");
    // The q/k transforms.
    GOOD((c.rotary_dim = 8, c.inv_freq = slopes), "rotary_dim 8");
    BAD((c.rotary_dim = 6), "rotary_dim without inv_freq", A, MHA_FIELD_INV_FREQ,
        "inv_freq is NULL",
        "rotary_dim = 6");
    BAD((c.rotary_dim = 5, c.inv_freq = slopes), "rotary_dim odd", A, MHA_FIELD_ROTARY_DIM,
        "rotary_dim = 5");
    BAD((c.rotary_dim = 10, c.inv_freq = slopes), "rotary_dim > dk", A, MHA_FIELD_ROTARY_DIM,
        "rotary_dim = 10", "dk[0] = 8");
    BAD((c.dk = dk_r, c.rotary_dim = 8, c.inv_freq = slopes), "rotary_dim > one dk", A,
        MHA_FIELD_ROTARY_DIM, "rotary_dim = 8", "dk[1] = 6");
    BAD((c.rope_interleaved = 2), "rope_interleaved 2", A, MHA_FIELD_ROPE_INTERLEAVED,
        "rope_interleaved = 2");
    GOOD((c.q_norm = qn, c.q_norm_hstride = 8, c.k_norm = qn), "q_norm, k_norm");
    BAD((c.q_norm = qn, c.q_norm_hstride = 4), "q_norm_hstride", A, MHA_FIELD_Q_NORM_HSTRIDE,
        "q_norm_hstride = 4", "dk = 8");
    BAD((c.q_norm_hstride = 8), "q_norm_hstride without q_norm", A, MHA_FIELD_Q_NORM,
        "q_norm is NULL");
    BAD((c.k_norm = qn, c.k_norm_hstride = 7), "k_norm_hstride", A, MHA_FIELD_K_NORM_HSTRIDE,
        "k_norm_hstride = 7");
    BAD((c.k_norm_hstride = 8), "k_norm_hstride without k_norm", A, MHA_FIELD_K_NORM,
        "k_norm is NULL");
    BAD((c.q_norm = qn, c.dk = dk_r), "q_norm with ragged heads", A, MHA_FIELD_DK, "dk[1] = 6",
        "dk[0] = 8");
    BAD((c.norm_eps = -1e-6), "norm_eps < 0", A, MHA_FIELD_NORM_EPS, "norm_eps = -1e-06");
    BAD((c.norm_eps = NAN), "norm_eps NaN", A, MHA_FIELD_NORM_EPS, "norm_eps = ");
    GOOD((c.q_norm = qn, c.norm_type = MHA_NORM_LAYER), "norm_type LayerNorm");
    GOOD((c.norm_type = MHA_NORM_LAYER), "norm_type LayerNorm without a norm weight");
    BAD((c.q_norm = qn, c.norm_type = (mha_norm_type)2), "norm_type 2", A,
        MHA_FIELD_NORM_TYPE, "norm_type = 2", "MHA_NORM_RMS (0, \"rms\")",
        "MHA_NORM_LAYER (1, \"layer\")");
    // Checked without a norm weight too: a wrong value is never ignored.
    BAD((c.norm_type = (mha_norm_type)-1), "norm_type -1 without q_norm", A,
        MHA_FIELD_NORM_TYPE, "norm_type = -1");
    GOOD((c.positions_bstride = 5, c.key_positions_bstride = 7), "positions strides");
    BAD((c.positions_bstride = 7), "positions_bstride", A, MHA_FIELD_POSITIONS_BSTRIDE,
        "positions_bstride = 7", "Tq = 5");
    BAD((c.key_positions_bstride = 5), "key_positions_bstride", A,
        MHA_FIELD_KEY_POSITIONS_BSTRIDE,
        "key_positions_bstride = 5", "Tk = 7");
#undef BAD
#undef GOOD

    // The norm types by name (mha_norm_type_parse, mha_norm_type_name).
    mha_norm_type nt = MHA_NORM_LAYER;
    CHECK(mha_norm_type_parse(&nt, "rms", 3, &err) == MHA_OK && nt == MHA_NORM_RMS &&
              err.field == MHA_FIELD_NONE, "parse rms");
    CHECK(mha_norm_type_parse(&nt, "layerX", 5, &err) == MHA_OK && nt == MHA_NORM_LAYER,
          "parse layer (by length)");
    CHECK(strcmp(mha_norm_type_name(MHA_NORM_RMS), "rms") == 0 &&
              strcmp(mha_norm_type_name(MHA_NORM_LAYER), "layer") == 0 &&
              mha_norm_type_name((mha_norm_type)2) == NULL, "mha_norm_type_name");
    static const struct {
        const char *name;
        size_t len;
        const char *seen;
    } bad_names[] = {{"batch", 5, "\"batch\""}, {"rms", 2, "\"rm\""},
                     {"rms\0", 4, "\"rms?\""}, {"RMS", 3, "\"RMS\""}, {"", 0, "\"\""},
                     {NULL, 0, "\"\""},
                     {"0123456789012345678901234567890123456789", 40,
                      "\"01234567890123456789012345678901...\""}};
    for (size_t i = 0; i < sizeof bad_names / sizeof bad_names[0]; i++) {
        nt = MHA_NORM_LAYER;
        const mha_status st = mha_norm_type_parse(&nt, bad_names[i].name, bad_names[i].len, &err);
        CHECK(st == MHA_ERR_ARG && nt == MHA_NORM_LAYER && err.field == MHA_FIELD_NORM_TYPE &&
                  strstr(err.msg, bad_names[i].seen) != NULL &&
                  strstr(err.msg, "\"rms\", \"layer\"") != NULL,
              "parse %zu: %s (%s)", i, mha_status_name(st), err.msg);
    }
    CHECK(mha_norm_type_parse(&nt, "x", 1, NULL) == MHA_ERR_ARG, "parse, err NULL");

    // The entry points' own checks report through the same mha_error.
    double buf[64] = {0};
    mha_params prm = {.dtype = MHA_DTYPE_F64, .out = buf, .x = buf, .key = buf,
                      .value = buf, .wq = buf, .wk = buf, .wv = buf, .wo = NULL};
    c = base;
    CHECK(mha_forward(&c, &prm, &err) == MHA_ERR_ARG && err.field == MHA_FIELD_PARAMS &&
              strstr(err.msg, "wo") != NULL, "forward: wo NULL with has_wo (%s)", err.msg);
    prm.dtype = (mha_dtype)5;
    CHECK(mha_forward(&c, &prm, &err) == MHA_ERR_ARG && err.field == MHA_FIELD_DTYPE &&
              strstr(err.msg, "dtype = 5") != NULL, "forward: dtype 5 (%s)", err.msg);
    CHECK(mha_forward(&c, NULL, &err) == MHA_ERR_ARG && err.field == MHA_FIELD_CALL,
          "forward: params NULL");
    prm.dtype = MHA_DTYPE_F64;
    c.H = 6, c.G = 4;
    CHECK(mha_backward(&c, &prm, &err) == MHA_ERR_ARG && err.field == MHA_FIELD_G &&
              strstr(err.msg, "H = 6 is not a multiple of G = 4") != NULL,
          "backward: the config's message (%s)", err.msg);
    CHECK(mha_project(&c, &prm, NULL) == MHA_ERR_ARG, "project: err NULL");
    c = base;
    prm.x = NULL;
    prm.q = buf;
    CHECK(mha_project(&c, &prm, &err) == MHA_ERR_ARG && err.field == MHA_FIELD_PARAMS &&
              strstr(err.msg, "x is NULL") != NULL, "project: x NULL (%s)", err.msg);
    c.q_norm = qn;
    CHECK(mha_attend(&c, &prm, &err) == MHA_ERR_ARG && err.field == MHA_FIELD_Q_NORM &&
              strstr(err.msg, "mha_project") != NULL, "attend: q_norm (%s)", err.msg);
    CHECK(mha_attend_backward(&c, &prm, &err) == MHA_ERR_ARG &&
              err.field == MHA_FIELD_Q_NORM, "attend_backward: q_norm (%s)", err.msg);
    c = base;
    c.dk = dk_r;
    CHECK(mha_attend(&c, &prm, &err) == MHA_ERR_ARG && err.field == MHA_FIELD_DK &&
              strstr(err.msg, "dk[1] = 6") != NULL, "attend: ragged (%s)", err.msg);
    c = base;
    prm.k = prm.v = buf;
    prm.sq = (mha_strides){1, SIZE_MAX / 2, 1};
    CHECK(mha_attend(&c, &prm, &err) == MHA_ERR_SIZE && err.field == MHA_FIELD_PARAMS &&
              strstr(err.msg, "q at strides") != NULL, "attend: strides (%s)", err.msg);
}

int main(int argc, char **argv)
{
    g_quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    test_config();
    test_cases();
    test_window_as_mask();
    test_skipping();
    if (!g_quick)
        test_skip_timing();
    printf("test_variants: %ld checks, %d failures (ISAs up to %s; CPU: %s)\n",
           g_checks, g_failures, mha_isa_name(harness_best_isa()), mha_isa_name(mha_isa_detect()));
    return g_failures != 0;
}
