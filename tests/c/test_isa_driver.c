/*
 * test_isa_driver.c - the best SIMD path of this CPU against the portable
 * one, through the public API: mha_forward_*, mha_backward_* and the
 * decode path of mha_attend_*, float32 and float64, at 1, 2 and 3 threads.
 * On aarch64 that is NEON against portable C (tools/ci/aarch64.sh runs it
 * under qemu-aarch64); on x86 AVX2 or AVX-512 against portable C.
 *
 * Build (no Makefile rule; tools/ci/aarch64.sh builds it, or by hand):
 *   cc -std=c11 -O2 -pthread -Icsrc -Icsrc/core -Icsrc/kernels \
 *      tests/c/test_isa_driver.c csrc/core/[every].c csrc/kernels/[every].c -lm
 *   ./test_isa_driver          the whole grid (exit status 1 on any failure)
 *   ./test_isa_driver quick    the small cases only (for slow emulators)
 *
 * What is checked, per case and element type:
 *   - on each ISA, every output and gradient is bitwise the same at 1, 2
 *     and 3 threads, and with the forward's key blocks packed per tile or
 *     once for all tiles;
 *   - the best ISA's outputs and gradients are within tolerance of the
 *     portable path's (they differ by rounding only: fused multiply-adds,
 *     horizontal sums in another order), relative to each array's largest
 *     magnitude: 1e-12 in float64, 1e-4 in float32 (whose gradients sum a
 *     few hundred products through a softmax);
 *   - every call returns MHA_OK.
 * The grid: T, d_k and d_v not multiples of any vector width, T = 1, one
 * head, GQA, ragged heads, causal, boolean and additive masks,
 * key_lengths, softcap, ALiBi, sinks, a window, tiles cut by a 192-row
 * query block and 64-key blocks, with and without W^O and weights; and
 * mha_attend with Tq = 1 and 3 (the decode kernels, split-K).
 */
#define _GNU_SOURCE /* clock_gettime */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attend_fused.h"
#include "dispatch.h"
#include "mha.h"
#include "threads.h"

#include "harness.h"

typedef struct {
    const char *name;
    size_t B, Tq, Tk, Din, Dkin, Dvin, Dout, H, G;
    size_t dk[4], dv[4];        /* per kv head */
    int causal;
    int mask;                   /* 0 none, 1 boolean, 2 additive */
    int key_lengths, has_wo, sinks, alibi, windowed, weights;
    double softcap;
    int big;                    /* skipped by `quick` */
} spec;

static const spec k_specs[] = {
    {"T=1, one head", 1, 1, 1, 3, 2, 2, 1, 1, 1, {1}, {1}, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0},
    {"odd widths", 2, 7, 9, 5, 6, 4, 3, 2, 2, {5, 5}, {3, 3}, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0},
    {"gqa causal key_lengths", 2, 37, 37, 6, 6, 6, 5, 4, 2, {13, 13}, {7, 7}, 1, 0, 1, 1, 0, 0,
     0, 1, 0, 0},
    {"ragged heads, bool mask", 1, 50, 70, 7, 5, 9, 4, 3, 3, {3, 9, 17}, {5, 2, 11}, 0, 1, 0,
     1, 0, 0, 0, 0, 0, 0},
    {"softcap alibi sinks window add-mask", 2, 33, 41, 6, 6, 6, 6, 2, 1, {10}, {6}, 0, 2, 0, 1,
     1, 1, 1, 1, 5.0, 0},
    {"big causal gqa", 1, 203, 211, 24, 24, 24, 19, 4, 2, {18, 18}, {22, 22}, 1, 0, 0, 1, 0, 0,
     0, 0, 0, 1},
    {"big key_lengths no W^O", 2, 130, 260, 10, 12, 14, 0, 2, 2, {33, 33}, {31, 31}, 0, 0, 1,
     0, 1, 0, 0, 1, 0, 1},
};

/* The results of one (spec, type, ISA, threads), widened to double
   (exactly), by name. */
enum { R_OUT, R_LSE, R_W, R_Q, R_K, R_V, R_CAT, R_DX, R_DKEY, R_DVAL, R_DWQ, R_DWK, R_DWV,
       R_DWO, R_DBQ, R_DBK, R_DBV, R_DBO, R_DSINK, NRES };
static const char *const k_res[NRES] = {
    "out", "lse", "weights", "q", "k", "v", "concat", "dx", "dkey", "dvalue", "dwq", "dwk",
    "dwv", "dwo", "dbq", "dbk", "dbv", "dbo", "dsinks"};

typedef struct {
    double *r[NRES];
    size_t n[NRES];
} results;

/* A problem: its config and inputs in double, every value exact in float. */
typedef struct {
    const spec *sp;
    mha_config cfg;
    mha_layout lay;
    size_t dk[4], dv[4];
    double scale[8], slopes[8], sinks[8];
    int64_t klen[4];
    /* inputs, index as in k_in */
    double *in[14];
    size_t nin[14];
    uint8_t *maskb;
} problem;

enum { I_X, I_KEY, I_VAL, I_WQ, I_WK, I_WV, I_WO, I_BQ, I_BK, I_BV, I_BO, I_DOUT, I_MASK,
       I_SINK, NIN };

static double rnd_f(double s) { return (double)(float)(s * rng_unit()); }

static void problem_make(problem *P, const spec *sp)
{
    memset(P, 0, sizeof *P);
    P->sp = sp;
    mha_config *c = &P->cfg;
    c->B = sp->B, c->Tq = sp->Tq, c->Tk = sp->Tk;
    c->Din = sp->Din, c->Dkin = sp->Dkin, c->Dvin = sp->Dvin;
    c->H = sp->H, c->G = sp->G;
    for (size_t g = 0; g < sp->G; g++)
        P->dk[g] = sp->dk[g], P->dv[g] = sp->dv[g];
    c->dk = P->dk, c->dv = P->dv;
    for (size_t h = 0; h < sp->H; h++) {
        P->scale[h] = 1.0 / sqrt((double)sp->dk[h / (sp->H / sp->G)]);
        P->slopes[h] = 0.125 * (double)(h + 1);
        P->sinks[h] = rnd_f(1.0);
    }
    c->scale = P->scale;
    c->causal = sp->causal;
    c->has_wo = sp->has_wo;
    c->softcap = sp->softcap;
    if (sp->alibi)
        c->alibi = P->slopes, c->alibi_bstride = 0;
    if (sp->windowed)
        c->windowed = 1, c->window_left = 11, c->window_right = 6;
    if (sp->key_lengths) {
        for (size_t b = 0; b < sp->B; b++)
            P->klen[b] = (int64_t)(sp->Tk - (b * 7) % sp->Tk);
        c->key_lengths = P->klen;
    }
    size_t Svq = 0;
    for (size_t h = 0; h < sp->H; h++)
        Svq += sp->dv[h / (sp->H / sp->G)];
    c->Dout = sp->has_wo ? sp->Dout : Svq;
    if (mha_check_config(&P->lay, c, NULL) != MHA_OK) {
        fprintf(stderr, "%s: bad config\n", sp->name);
        exit(2);
    }
    const mha_layout *L = &P->lay;
    const size_t n[NIN] = {
        sp->B * sp->Tq * sp->Din, sp->B * sp->Tk * sp->Dkin, sp->B * sp->Tk * sp->Dvin,
        sp->Din * L->Sq, sp->Dkin * L->Sk, sp->Dvin * L->Sv, sp->has_wo ? L->Svq * c->Dout : 0,
        L->Sq, L->Sk, L->Sv, c->Dout, sp->B * sp->Tq * c->Dout,
        sp->mask == 2 ? sp->Tq * sp->Tk : 0, sp->sinks ? sp->H : 0};
    for (int i = 0; i < NIN; i++) {
        P->nin[i] = n[i];
        P->in[i] = xcalloc(n[i], sizeof(double));
        const double s = i >= I_WQ && i <= I_WO ? 0.5 : 1.0;
        for (size_t e = 0; e < n[i]; e++)
            P->in[i][e] = rnd_f(s);
    }
    if (sp->sinks)
        for (size_t h = 0; h < sp->H; h++)
            P->in[I_SINK][h] = P->sinks[h];
    // masks (Tq, Tk), broadcast over B and H; every fifth key blocked, and
    // one row wholly (a fully masked row: zeros, never NaN)
    if (sp->mask == 1) {
        P->maskb = xcalloc(sp->Tq * sp->Tk, 1);
        for (size_t i = 0; i < sp->Tq; i++)
            for (size_t j = 0; j < sp->Tk; j++)
                P->maskb[i * sp->Tk + j] = (uint8_t)(i != 3 && (i + 2 * j) % 5 != 0);
        c->mask_kind = MHA_MASK_BOOL;
    } else if (sp->mask == 2) {
        for (size_t i = 0; i < sp->Tq; i++)
            for (size_t j = 0; j < sp->Tk; j++)
                if ((i + j) % 7 == 0)
                    P->in[I_MASK][i * sp->Tk + j] = -INFINITY;
        c->mask_kind = MHA_MASK_ADD;
    }
    c->mask_stride[0] = 0, c->mask_stride[1] = 0;
    c->mask_stride[2] = (ptrdiff_t)sp->Tk, c->mask_stride[3] = 1;
}

static void problem_free(problem *P)
{
    for (int i = 0; i < NIN; i++)
        free(P->in[i]);
    free(P->maskb);
}

static void results_free(results *R)
{
    for (int i = 0; i < NRES; i++)
        free(R->r[i]);
}

static double *widened(const void *src, size_t n, int f64)
{
    double *dst = xcalloc(n, sizeof(double));
    for (size_t e = 0; e < n; e++)
        dst[e] = f64 ? ((const double *)src)[e] : (double)((const float *)src)[e];
    return dst;
}

/* The forward, then the backward of every input, on the ISA and thread
   count in force; R gets every output and gradient. */
static void run_problem(results *R, problem *P, int f64)
{
    const spec *sp = P->sp;
    mha_config cfg = P->cfg;
    const mha_layout *L = &P->lay;
    void *in[NIN];
    for (int i = 0; i < NIN; i++)
        in[i] = P->nin[i] ? typed(P->in[i], P->nin[i], f64) : NULL;
    if (sp->mask == 1)
        cfg.mask = P->maskb;
    else if (sp->mask == 2)
        cfg.mask = in[I_MASK];
    cfg.sinks = in[I_SINK];
    const size_t n[NRES] = {
        sp->B * sp->Tq * cfg.Dout, sp->B * sp->H * sp->Tq,
        sp->weights ? sp->B * sp->H * sp->Tq * sp->Tk : 0, sp->B * sp->Tq * L->Sq,
        sp->B * sp->Tk * L->Sk, sp->B * sp->Tk * L->Sv, sp->B * sp->Tq * L->Svq,
        P->nin[I_X], P->nin[I_KEY], P->nin[I_VAL], P->nin[I_WQ], P->nin[I_WK], P->nin[I_WV],
        P->nin[I_WO], L->Sq, L->Sk, L->Sv, cfg.Dout, sp->sinks ? sp->H : 0};
    void *o[NRES];
    const size_t es = f64 ? sizeof(double) : sizeof(float);
    for (int i = 0; i < NRES; i++)
        o[i] = n[i] ? xcalloc(n[i], es) : NULL;
    mha_status st;
    const mha_params prm = {
        .dtype = f64 ? MHA_DTYPE_F64 : MHA_DTYPE_F32,
        .out = o[R_OUT], .weights = o[R_W], .q = o[R_Q], .k = o[R_K], .v = o[R_V],
        .concat = o[R_CAT], .lse = o[R_LSE], .x = in[I_X], .key = in[I_KEY],
        .value = in[I_VAL], .wq = in[I_WQ], .wk = in[I_WK], .wv = in[I_WV], .wo = in[I_WO],
        .bq = in[I_BQ], .bk = in[I_BK], .bv = in[I_BV], .bo = in[I_BO],
        .dout = in[I_DOUT], .dx = o[R_DX], .dkey = o[R_DKEY], .dvalue = o[R_DVAL],
        .dwq = o[R_DWQ], .dwk = o[R_DWK], .dwv = o[R_DWV], .dwo = o[R_DWO], .dbq = o[R_DBQ],
        .dbk = o[R_DBK], .dbv = o[R_DBV], .dbo = o[R_DBO], .dsinks = o[R_DSINK]};
    // One params struct for both: the backward reads q, k, v, concat, lse
    // where the forward kept them.
    st = mha_forward(&cfg, &prm, NULL);
    CHECK(st == MHA_OK, "%s f%d: forward %s", sp->name, f64 ? 64 : 32, mha_status_name(st));
    st = mha_backward(&cfg, &prm, NULL);
    CHECK(st == MHA_OK, "%s f%d: backward %s", sp->name, f64 ? 64 : 32, mha_status_name(st));
    for (int i = 0; i < NRES; i++) {
        R->n[i] = n[i];
        R->r[i] = n[i] ? widened(o[i], n[i], f64) : NULL;
        free(o[i]);
    }
    for (int i = 0; i < NIN; i++)
        free(in[i]);
}

/* max |a - b| over max(floor, max |b|) (1 when both are zero), over finite
   values; a non-finite value where the other is not counts as a mismatch
   (inf). */
static double rel_err(const double *a, const double *b, size_t n, double floor)
{
    double num = 0, den = floor;
    for (size_t e = 0; e < n; e++) {
        if (isfinite(a[e]) != isfinite(b[e]))
            return INFINITY;
        if (!isfinite(a[e])) {
            if (!(a[e] == b[e] || (isnan(a[e]) && isnan(b[e]))))
                return INFINITY;
            continue;
        }
        const double d = fabs(a[e] - b[e]);
        num = d > num ? d : num;
        den = fabs(b[e]) > den ? fabs(b[e]) : den;
    }
    return num / (den > 0 ? den : 1);
}

static const int k_threads[3] = {1, 2, 3};

/* Runs `fn` on isa at 1, 2, 3 threads into R (1 thread's), checking that
   the other counts give the same bits; and, at 2 and 3 threads, with the
   forward's key blocks packed by each tile and packed once for all
   (mha_attend_set_share 0 and 2), which must give the same bits too. */
typedef void (*run_fn)(results *R, problem *P, int f64);

static void run_at_threads(results *R, problem *P, int f64, mha_isa isa, run_fn fn,
                        const char *what)
{
    static const char *const k_share[3] = {"tiles pack their own key blocks",
                                           "default", "key blocks always shared"};
    mha_set_isa(isa);
    for (int t = 0; t < 5; t++) {
        const int nth = k_threads[t < 3 ? t : t - 2], share = t < 3 ? 1 : t == 3 ? 0 : 2;
        mha_set_num_threads(nth);
        const int before = mha_attend_set_share(share);
        results cur;
        fn(&cur, P, f64);
        mha_attend_set_share(before);
        if (t == 0) {
            *R = cur;
            continue;
        }
        for (int i = 0; i < NRES; i++)
            CHECK(cur.n[i] == R->n[i] &&
                      (cur.n[i] == 0 || memcmp(cur.r[i], R->r[i], cur.n[i] * sizeof(double)) == 0),
                  "%s %s f%d %s: %s differs at 1 and %d threads (%s)", what, P->sp->name,
                  f64 ? 64 : 32, mha_isa_name(isa), k_res[i], nth, k_share[share]);
        results_free(&cur);
    }
}

static double compare(const results *fast, const results *ref, const problem *P, int f64,
                      const char *what, mha_isa best)
{
    const double tolv = f64 ? 1e-12 : 1e-4;
    double worst = 0;
    for (int i = 0; i < NRES; i++) {
        if (ref->n[i] == 0)
            continue;
        // dbk is zero but for rounding (softmax does not change when every
        // score of a row moves by q . bk): measured on the scale of dwk,
        // key^T times the same dK rows.
        double floor = 0;
        if (i == R_DBK)
            for (size_t e = 0; e < ref->n[R_DWK]; e++)
                floor = fabs(ref->r[R_DWK][e]) > floor ? fabs(ref->r[R_DWK][e]) : floor;
        const double e = rel_err(fast->r[i], ref->r[i], ref->n[i], floor);
        worst = e > worst ? e : worst;
        CHECK(e <= tolv, "%s %s f%d: %s %s vs scalar: relative error %.3g > %.1g", what,
              P->sp->name, f64 ? 64 : 32, k_res[i], mha_isa_name(best), e, tolv);
    }
    return worst;
}

/* ---- mha_attend with few query rows: the decode kernels and split-K ---- */

typedef struct {
    const char *name;
    size_t B, Tq, Tk, H, G, dk, dv;
    int causal, key_lengths;
} aspec;

static const aspec k_aspecs[] = {
    {"decode T=1", 2, 1, 37, 4, 2, 19, 13, 0, 1},
    {"decode split-K", 1, 1, 1100, 2, 1, 40, 36, 0, 0},
    {"decode Tq=3 causal", 2, 3, 600, 2, 2, 9, 21, 1, 1},
};

static const aspec *g_aspec;

/* One mha_attend call (B, H, T, d) contiguous; R gets out and lse. */
static void run_attend(results *R, problem *P, int f64)
{
    const aspec *a = g_aspec;
    mha_config cfg = P->cfg;
    const size_t nq = a->B * a->H * a->Tq * a->dk, nk = a->B * a->G * a->Tk * a->dk;
    const size_t nv = a->B * a->G * a->Tk * a->dv, no = a->B * a->H * a->Tq * a->dv;
    const size_t nl = a->B * a->H * a->Tq;
    void *q = typed(P->in[0], nq, f64), *k = typed(P->in[1], nk, f64);
    void *v = typed(P->in[2], nv, f64);
    const size_t es = f64 ? sizeof(double) : sizeof(float);
    void *out = xcalloc(no, es), *lse = xcalloc(nl, es);
    const mha_strides sq = {a->H * a->Tq * a->dk, a->Tq * a->dk, a->dk};
    const mha_strides sk = {a->G * a->Tk * a->dk, a->Tk * a->dk, a->dk};
    const mha_strides sv = {a->G * a->Tk * a->dv, a->Tk * a->dv, a->dv};
    const mha_strides so = {a->H * a->Tq * a->dv, a->Tq * a->dv, a->dv};
    const mha_params prm = {.dtype = f64 ? MHA_DTYPE_F64 : MHA_DTYPE_F32, .out = out,
                            .lse = lse, .q = q, .k = k, .v = v, .sq = sq, .sk = sk, .sv = sv,
                            .so = so};
    const mha_status st = mha_attend(&cfg, &prm, NULL);
    CHECK(st == MHA_OK, "%s f%d: attend %s", a->name, f64 ? 64 : 32, mha_status_name(st));
    memset(R, 0, sizeof *R);
    R->n[R_OUT] = no, R->r[R_OUT] = widened(out, no, f64);
    R->n[R_LSE] = nl, R->r[R_LSE] = widened(lse, nl, f64);
    free(q), free(k), free(v), free(out), free(lse);
}

static void attend_problem(problem *P, const aspec *a, spec *holder)
{
    memset(P, 0, sizeof *P);
    memset(holder, 0, sizeof *holder);
    holder->name = a->name;
    P->sp = holder;
    mha_config *c = &P->cfg;
    c->B = a->B, c->Tq = a->Tq, c->Tk = a->Tk, c->H = a->H, c->G = a->G;
    for (size_t g = 0; g < a->G; g++)
        P->dk[g] = a->dk, P->dv[g] = a->dv;
    c->dk = P->dk, c->dv = P->dv;
    for (size_t h = 0; h < a->H; h++)
        P->scale[h] = 1.0 / sqrt((double)a->dk);
    c->scale = P->scale;
    c->causal = a->causal;
    if (a->key_lengths) {
        for (size_t b = 0; b < a->B; b++)
            P->klen[b] = (int64_t)(a->Tk - (b * 5) % a->Tk);
        c->key_lengths = P->klen;
        c->lengths_aligned = 1;
    }
    const size_t n[3] = {a->B * a->H * a->Tq * a->dk, a->B * a->G * a->Tk * a->dk,
                         a->B * a->G * a->Tk * a->dv};
    for (int i = 0; i < 3; i++) {
        P->nin[i] = n[i];
        P->in[i] = xcalloc(n[i], sizeof(double));
        for (size_t e = 0; e < n[i]; e++)
            P->in[i][e] = rnd_f(1.0);
    }
}

/* P in float32 and float64: fn on the portable path, then on `best`, at 1,
   2 and 3 threads each, compared; prints the worst difference, returns the
   number of cases (2). */
static int both_types(problem *P, mha_isa best, run_fn fn, const char *what,
                      const char *name)
{
    for (int f64 = 0; f64 < 2; f64++) {
        results ref, fast;
        run_at_threads(&ref, P, f64, MHA_ISA_SCALAR, fn, what);
        double worst = 0;
        if (best != MHA_ISA_SCALAR) {
            run_at_threads(&fast, P, f64, best, fn, what);
            worst = compare(&fast, &ref, P, f64, what, best);
            results_free(&fast);
        }
        printf("  %-7s %-36s f%d: worst relative difference %.2g\n", what, name,
               f64 ? 64 : 32, worst);
        results_free(&ref);
    }
    return 2;
}

int main(int argc, char **argv)
{
    const int quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    const mha_isa best = harness_best_isa();
    printf("test_isa_driver: %s against scalar%s\n", mha_isa_name(best),
           best == MHA_ISA_SCALAR ? " (no SIMD path here: thread counts only)" : "");
    const double t0 = now_s();
    int cases = 0;
    for (size_t s = 0; s < sizeof k_specs / sizeof k_specs[0]; s++) {
        if (quick && k_specs[s].big)
            continue;
        problem P;
        problem_make(&P, &k_specs[s]);
        cases += both_types(&P, best, run_problem, "fwd+bwd", k_specs[s].name);
        problem_free(&P);
    }
    for (size_t s = 0; s < sizeof k_aspecs / sizeof k_aspecs[0]; s++) {
        problem P;
        spec holder;
        attend_problem(&P, &k_aspecs[s], &holder);
        g_aspec = &k_aspecs[s];
        cases += both_types(&P, best, run_attend, "attend", k_aspecs[s].name);
        problem_free(&P);
    }
    mha_set_isa(best);
    mha_set_num_threads(0);
    printf("test_isa_driver: %d cases x 2 ISAs x 3 thread counts, %ld checks, %d failures "
           "(%.1f s)\n",
           cases, g_checks, g_failures, now_s() - t0);
    return g_failures != 0;
}
