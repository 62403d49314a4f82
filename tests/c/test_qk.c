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
 *     loss = sum(out * R) at entries of x, key, wq, wk, q_norm, k_norm, bq,
 *     and every float32 gradient against float64's;
 *   - a backward asked for dq_norm / dk_norm alone gives the same bits, and
 *     one not asked for them (the norm's passes A and C fused) the same bits
 *     of every other gradient;
 *   - bitwise equality of every output and gradient for 1 and 3 threads.
 * The problem, the reference's shared loops and the checks alike in
 * test_gate.c are problem.h's.
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

#include "problem.h"

/* Every input but the gate's is drawn; the calls pass the biases with
   bias, the norms' weights with qn / kn. */
static void problem_init(problem *P, const tcase *c)
{
    size_t dk[MAXG];
    for (size_t g = 0; g < c->G; g++)
        dk[g] = c->dk[g] ? c->dk[g] : c->dk[0];
    problem_start(P, c,
                  (mha_config){.B = c->B, .Tq = c->Tq, .Tk = c->Tk, .Din = c->Din,
                               .Dkin = c->Din, .Dvin = c->Din, .H = c->H, .G = c->G,
                               .causal = c->causal, .has_wo = c->has_wo},
                  dk, c->dv);
    const size_t d = P->dk[0], half = c->rot / 2;
    for (size_t i = 0; i < half; i++)
        P->inv_freq[i] = c->custom_freq ? 0.05 + 1.2 * (0.5 + 0.5 * rng_unit())
                                        : pow(10000.0, -2.0 * (double)i / (double)c->rot);
    mha_config *cfg = &P->cfg;
    cfg->q_norm_hstride = c->qn == 2 ? d : 0;
    cfg->k_norm_hstride = c->kn == 2 ? d : 0;
    cfg->norm_eps = 1e-5;
    cfg->norm_type = c->ln ? MHA_NORM_LAYER : MHA_NORM_RMS;
    cfg->rotary_dim = c->rot;
    cfg->rope_interleaved = c->inter;
    cfg->inv_freq = c->rot ? P->inv_freq : NULL;
    const int has[NIN] = {[X] = 1, [KEY] = 1, [VALUE] = 1, [WQ] = 1, [WK] = 1, [WV] = 1,
                          [WO] = 1, [BQ] = 1, [BK] = 1, [BV] = 1, [BO] = 1, [QN] = 1, [KN] = 1};
    problem_inputs(P, has);
    const size_t nq = c->B * c->Tq, nk = c->B * c->Tk;
    P->pos = xcalloc(nq, sizeof *P->pos);
    P->kpos = xcalloc(nk, sizeof *P->kpos);
    for (size_t i = 0; i < nq; i++)
        P->pos[i] = (int64_t)(rng_u64() % 300) - 20;
    for (size_t i = 0; i < nk; i++)
        P->kpos[i] = (int64_t)(rng_u64() % 300) - 20;
    cfg->positions = c->pos ? P->pos : NULL;
    cfg->positions_bstride = c->pos == 1 ? c->Tq : 0;
    cfg->key_positions = c->kpos ? P->kpos : NULL;
    cfg->key_positions_bstride = c->kpos == 1 ? c->Tk : 0;
}

/* Points the config's norm weights at the typed copies of one type. */
static void cfg_bind(problem *P, int f64)
{
    P->cfg.q_norm = P->c.qn ? P->t[f64][QN] : NULL;
    P->cfg.k_norm = P->c.kn ? P->t[f64][KN] : NULL;
}

/* ---- the reference, in double with plain loops ---- */

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
    const double *w = P->in[key ? KN : QN];
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
    const size_t nq = c->B * c->Tq, nk = c->B * c->Tk;
    double *const *in = P->in;
    double *qt = xcalloc(nq * P->Sq, sizeof *qt), *kt = xcalloc(nk * P->Sk, sizeof *kt);
    double *v = xcalloc(nk * P->Sv, sizeof *v), *cat = xcalloc(nq * P->Svq, sizeof *cat);
    ref_proj(q, in[X], in[WQ], c->bias ? in[BQ] : NULL, nq, c->Din, P->Sq);
    ref_proj(k, in[KEY], in[WK], c->bias ? in[BK] : NULL, nk, c->Din, P->Sk);
    ref_proj(v, in[VALUE], in[WV], c->bias ? in[BV] : NULL, nk, c->Din, P->Sv);
    memcpy(qt, q, nq * P->Sq * sizeof *qt);
    memcpy(kt, k, nk * P->Sk * sizeof *kt);
    ref_transform(qt, P, 0);
    ref_transform(kt, P, 1);
    ref_attend(cat, qt, kt, v, P);
    ref_out(out, cat, c->bias ? in[BO] : NULL, P);
    free(qt);
    free(kt);
    free(v);
    free(cat);
}

/* ---- calls into the core ---- */

static mha_status run_fwd(problem *P, int f64, fwd_out *o)
{
    cfg_bind(P, f64);
    void *const *t = P->t[f64];
    mha_params prm = fwd_params(P, t, f64, o);
    if (P->c.bias)
        prm.bq = t[BQ], prm.bk = t[BK], prm.bv = t[BV], prm.bo = t[BO];
    return mha_forward(&P->cfg, &prm, NULL);
}

/* The backward needs no bias; the norms' weights come with the config. */
static mha_status run_bwd(problem *P, int f64, grads *g, const void *dout, const fwd_out *o)
{
    cfg_bind(P, f64);
    const mha_params prm = bwd_params(P, P->t[f64], f64, g, dout, o);
    return mha_backward(&P->cfg, &prm, NULL);
}

/* ---- the tests ---- */

/* Forward against the reference, both types, every ISA; the kept q, k are
   the raw projections. */
static void test_forward(problem *P)
{
    const size_t nq = P->c.B * P->c.Tq, nk = P->c.B * P->c.Tk;
    double *out = xcalloc(nq * P->Dout, sizeof *out);
    double *q = xcalloc(nq * P->Sq, sizeof *q), *k = xcalloc(nk * P->Sk, sizeof *k);
    ref_forward(out, q, k, P);
    check_forward(P, out, q, k, NULL, 1e-11);
    free(out);
    free(q);
    free(k);
}

/* The backward: finite differences (float64), float32 against float64,
   and, with a norm, the gradients other than dq_norm / dk_norm (the
   norm's passes A and C then fused: the same bits), then those alone. */
static void test_backward(problem *P)
{
    const tcase *c = &P->c;
    const int nfd[NIN] = {[X] = 3, [KEY] = 3, [WQ] = 3, [WK] = 3, [BQ] = c->bias ? 2 : 0,
                          [QN] = c->qn ? 4 : 0, [KN] = c->kn ? 4 : 0};
    const int want[2][NIN] = {
        {[X] = 1, [KEY] = 1, [VALUE] = 1, [WQ] = 1, [WK] = 1, [WV] = 1, [WO] = 1, [BQ] = 1,
         [BK] = 1, [BV] = 1, [BO] = 1},
        {[QN] = 1, [KN] = 1}};
    const char *const what[2] = {"without dq_norm / dk_norm, the other gradients",
                                 "dq_norm / dk_norm alone"};
    check_backward(P, nfd, c->qn || c->kn ? 2 : 0, want, what);
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
            for (size_t i = 0; i < P.n[QN]; i++)
                zq = zq && val(g.d[QN], i, f64) == 0.0;
            for (size_t i = 0; i < P.n[KN]; i++)
                zk = zk && val(g.d[KN], i, f64) == 0.0;
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
    grads_alloc(&g, &P, 1, NULL);
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
                const mha_params prm = fwd_params(&P, P.t[0], 0, &(fwd_out){.out = o.out});
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
        check_threads(&P);
        problem_free(&P);
    }
    const tcase *bigs[2] = {&k_big, &k_big_ln};
    for (int i = 0; i < 2; i++) {
        problem big;
        problem_init(&big, bigs[i]);
        printf("%s ...\n", bigs[i]->name);
        check_threads(&big);
        problem_free(&big);
    }
    printf("%ld checks, %d failures (%.1f s)\n", g_checks, g_failures, now_s() - t0);
    return g_failures != 0;
}
