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
 *     loss = sum(out * R) at entries of x, key, wq, wv, wgate, wo and
 *     bgate, every float32 gradient against float64's, and dwgate / dbgate
 *     asked for alone give the bits of a call that asks for every gradient;
 *   - bitwise equality of every output and gradient for 1 and 3 threads,
 *     the GEMMs split between them (mha_gemm_set_grain);
 *   - a float32 forward with float16 or bfloat16 weights (wgate among
 *     them, mha_params.w_storage) gives the bits of the forward on the
 *     widened weights;
 *   - bgate without wgate is refused (MHA_ERR_ARG, field PARAMS) by both.
 * The problem, the reference's shared loops and the checks alike in
 * test_qk.c are problem.h's.
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

#include "problem.h"

/* The inputs: x, key with cross, wq, wk, wv, wo, bo, wgate and bgate; the
   calls pass bo and bgate with bias. */
static void problem_init(problem *P, const tcase *c)
{
    size_t dk[MAXG];
    for (size_t g = 0; g < c->G; g++)
        dk[g] = c->dk;
    problem_start(P, c,
                  (mha_config){.B = c->B, .Tq = c->Tq, .Tk = c->Tk, .Din = c->Din,
                               .Dkin = c->Dkin, .Dvin = c->Dkin, .H = c->H, .G = c->G,
                               .causal = c->causal, .has_wo = c->has_wo},
                  dk, c->dv);
    const int has[NIN] = {[X] = 1, [KEY] = c->cross, [WQ] = 1, [WK] = 1, [WV] = 1, [WO] = 1,
                          [BO] = 1, [WG] = 1, [BG] = 1};
    problem_inputs(P, has);
}

/* ---- the reference, in double with plain loops ---- */

/* out (B, Tq, Dout) and cat (B, Tq, Svq), the heads before the gate. */
static void ref_forward(double *out, double *cat, const problem *P)
{
    const tcase *c = &P->c;
    const size_t nq = c->B * c->Tq, nk = c->B * c->Tk, Svq = P->Svq;
    double *const *in = P->in;
    const double *key = c->cross ? in[KEY] : in[X];
    double *q = xcalloc(nq * P->Sq, sizeof *q), *k = xcalloc(nk * P->Sk, sizeof *k);
    double *v = xcalloc(nk * P->Sv, sizeof *v), *gated = xcalloc(nq * Svq, sizeof *gated);
    ref_proj(q, in[X], in[WQ], NULL, nq, c->Din, P->Sq);
    ref_proj(k, key, in[WK], NULL, nk, c->Dkin, P->Sk);
    ref_proj(v, key, in[WV], NULL, nk, c->Dkin, P->Sv);
    ref_attend(cat, q, k, v, P);
    // The gate: z = x wgate + bgate, per query row; gated = sigmoid(z) cat.
    ref_proj(gated, in[X], in[WG], c->bias ? in[BG] : NULL, nq, c->Din, Svq);
    for (size_t r = 0; r < nq * Svq; r++)
        gated[r] = cat[r] / (1.0 + exp(-gated[r]));
    ref_out(out, gated, c->bias ? in[BO] : NULL, P);
    free(q);
    free(k);
    free(v);
    free(gated);
}

/* ---- calls into the core ---- */

/* The forward of the inputs in (typed: in[i] for f64 or float), with the
   gate when gate, of element type dtype and weight storage ws. */
static mha_status forward_of(problem *P, void *const *in, int f64, int gate, fwd_out *o,
                             mha_kv_storage ws)
{
    const tcase *c = &P->c;
    mha_params prm = fwd_params(P, in, f64, o);
    prm.bo = c->bias ? in[BO] : NULL;
    prm.wgate = gate ? in[WG] : NULL;
    prm.bgate = gate && c->bias ? in[BG] : NULL;
    prm.w_storage = ws;
    return mha_forward(&P->cfg, &prm, NULL);
}

static mha_status run_fwd(problem *P, int f64, fwd_out *o)
{
    return forward_of(P, P->t[f64], f64, 1, o, MHA_KV_PLAIN);
}

/* The backward reads wgate and bgate (the gate is recomputed), not bo. */
static mha_status run_bwd(problem *P, int f64, grads *g, const void *dout, const fwd_out *o)
{
    void *const *in = P->t[f64];
    mha_params prm = bwd_params(P, in, f64, g, dout, o);
    prm.wgate = in[WG];
    prm.bgate = P->c.bias ? in[BG] : NULL;
    return mha_backward(&P->cfg, &prm, NULL);
}

/* ---- the tests ---- */

/* Forward against the reference, both types, every ISA; the kept concat
   is the heads' own, before the gate. */
static void test_forward(problem *P)
{
    const size_t nq = P->c.B * P->c.Tq;
    double *out = xcalloc(nq * P->Dout, sizeof *out), *cat = xcalloc(nq * P->Svq, sizeof *cat);
    ref_forward(out, cat, P);
    check_forward(P, out, NULL, NULL, cat, 1e-12);
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

/* The backward: finite differences (float64), float32 against float64,
   and dwgate, dbgate asked for alone. */
static void test_backward(problem *P)
{
    const tcase *c = &P->c;
    const int nfd[NIN] = {[X] = 4, [KEY] = c->cross ? 3 : 0, [WQ] = 2, [WV] = 2,
                          [WO] = c->has_wo ? 3 : 0, [WG] = 5, [BG] = c->bias ? 4 : 0};
    const int gate_only[1][NIN] = {{[WG] = 1, [BG] = 1}};
    const char *const what[1] = {"dwgate / dbgate alone"};
    check_backward(P, nfd, 1, gate_only, what);
}

/* The output and every gradient bitwise the same for 1 and 3 threads,
   with the GEMMs split between the threads however small. */
static void test_threads(problem *P)
{
    const size_t grain = mha_gemm_set_grain(1);
    check_threads(P);
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
    grads_alloc(&g, P, 1, NULL);
    prm.dout = P->t[1][X];   // never read: the call is refused first
    prm.dx = g.d[X], prm.dkey = g.d[X], prm.dvalue = g.d[X], prm.dwgate = g.d[WG];
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
