/*
 * mha.c - the multi-head entry points: forward(), backward() and project(),
 * each with its argument table.
 */
#include "glue.h"

/* ---- forward ------------------------------------------------------------ */

GLUE_DOC(forward_doc,
"forward(x, key, value, wq, wk, wv, wo, bq, bk, bv, bo, dk, dv, scales,\n"
"        mask, causal, key_lengths, variants, want_weights, keep,\n"
"        packed=None)\n"
"--\n\n"
"Multi-head attention forward pass (low level; see mhattn for the public\n"
"API). x (B,Tq,Din), key (B,Tk,Dkin), value (B,Tk,Dvin), wq (Din,Sq),\n"
"wk (Dkin,Sk), wv (Dvin,Sv), wo (Svq,Dout) or None, biases 1-D or None,\n"
"all of one dtype (float32 or float64). dk, dv: int64 (G,); scales:\n"
"float64 (H,); mask: None or bool or float, any strides, of shape\n"
"(B,H,Tq,Tk) or one that broadcasts to it;\n"
"key_lengths: None or int64 (B,); variants: None or the tuple of\n"
"mhattn._core.variant_args (window, softcap, ALiBi, sinks, key_mask,\n"
"packed sequences, q/k norm, RoPE); packed: None or a 4-tuple of\n"
"pack_weight() capsules (or None) of wq, wk, wv, wo.\n\n"
"Returns (out, weights or None, (q, k, v, concat, lse) or None).");

/* forward()'s positional arguments. */
enum {
    FWD_X, FWD_KEY, FWD_VALUE, FWD_WQ, FWD_WK, FWD_WV, FWD_WO,
    FWD_BQ, FWD_BK, FWD_BV, FWD_BO, FWD_DK, FWD_DV, FWD_SCALES, FWD_MASK,
    FWD_CAUSAL, FWD_KEY_LENGTHS, FWD_VARIANTS, FWD_WANT_WEIGHTS, FWD_KEEP,
    FWD_PACKED, FWD_NARGS
};

static const arg_spec forward_args[FWD_NARGS] = {
    [FWD_X] = {"x", ARG_ARRAY, SHAPE3(L_B, L_TQ, L_DIN), 0},
    [FWD_KEY] = {"key", ARG_ARRAY, SHAPE3(L_B, L_TK, L_DKIN), 0},
    [FWD_VALUE] = {"value", ARG_ARRAY, SHAPE3(L_B, L_TK, L_DVIN), 0},
    [FWD_WQ] = {"wq", ARG_ARRAY, SHAPE2(L_DIN, L_SQ), 0},
    [FWD_WK] = {"wk", ARG_ARRAY, SHAPE2(L_DKIN, L_SK), 0},
    [FWD_WV] = {"wv", ARG_ARRAY, SHAPE2(L_DVIN, L_SV), 0},
    [FWD_WO] = {"wo", ARG_ARRAY_OPT, SHAPE2(L_SVQ, L_DOUT), 0},
    [FWD_BQ] = {"bq", ARG_ARRAY_OPT, SHAPE1(L_SQ), 0},
    [FWD_BK] = {"bk", ARG_ARRAY_OPT, SHAPE1(L_SK), 0},
    [FWD_BV] = {"bv", ARG_ARRAY_OPT, SHAPE1(L_SV), 0},
    [FWD_BO] = {"bo", ARG_ARRAY_OPT, SHAPE1(L_DOUT), 0},
    [FWD_DK] = {.name = "dk", .kind = ARG_INT64},
    [FWD_DV] = {.name = "dv", .kind = ARG_INT64},
    [FWD_SCALES] = {.name = "scales", .kind = ARG_FLOAT64},
    [FWD_MASK] = {.name = "mask", .kind = ARG_MASK},
    [FWD_CAUSAL] = {.name = "causal", .kind = ARG_BOOL},
    [FWD_KEY_LENGTHS] = {.name = "key_lengths", .kind = ARG_LENGTHS},
    [FWD_VARIANTS] = {.name = "variants", .kind = ARG_VARIANTS},
    [FWD_WANT_WEIGHTS] = {.name = "want_weights", .kind = ARG_BOOL},
    [FWD_KEEP] = {.name = "keep", .kind = ARG_BOOL},
    [FWD_PACKED] = {.name = "packed", .kind = ARG_PACKED},
};

static const int forward_checks_x[] = {FWD_KEY, FWD_VALUE, -1};
static const int forward_checks_widths[] = {
    FWD_WQ, FWD_WK, FWD_WV, FWD_WO, FWD_BQ, FWD_BK, FWD_BV, FWD_BO, -1};

static const call_spec forward_spec = {
    .name = "forward", .nargs = FWD_NARGS, .args = forward_args,
    .checks_x = forward_checks_x, .checks_widths = forward_checks_widths,
    .x = FWD_X, .key = FWD_KEY, .value = FWD_VALUE, .wo = FWD_WO,
    .dk = FWD_DK, .dv = FWD_DV, .scales = FWD_SCALES, .mask = FWD_MASK,
    .causal = FWD_CAUSAL, .key_lengths = FWD_KEY_LENGTHS,
    .variants = FWD_VARIANTS, .broadcast_mask = 1, .nopt = 1,
};

/* forward()'s outputs, in the order mha_forward_<sfx> takes them. */
enum {
    FWD_OUT, FWD_WEIGHTS, FWD_Q, FWD_K, FWD_V, FWD_CONCAT, FWD_LSE, FWD_NOUTS
};
_Static_assert(FWD_NARGS <= MAX_ARGS && FWD_NOUTS <= MAX_OUTS,
               "a call holds forward()'s arguments and outputs");

static const shape forward_outs[FWD_NOUTS] = {
    [FWD_OUT] = SHAPE3(L_B, L_TQ, L_DOUT),
    [FWD_WEIGHTS] = SHAPE4(L_B, L_H, L_TQ, L_TK),
    [FWD_Q] = SHAPE3(L_B, L_TQ, L_SQ),
    [FWD_K] = SHAPE3(L_B, L_TK, L_SK),
    [FWD_V] = SHAPE3(L_B, L_TK, L_SV),
    [FWD_CONCAT] = SHAPE3(L_B, L_TQ, L_SVQ),
    [FWD_LSE] = SHAPE3(L_B, L_H, L_TQ),
};

/* mha_forward_f32 and _f64 take the same arguments, each in its dtype. */
#define FORWARD_CORE(fn, in, out, cfg)                                        \
    fn(DATA(out[FWD_OUT]), DATA(out[FWD_WEIGHTS]), DATA(out[FWD_Q]),          \
       DATA(out[FWD_K]), DATA(out[FWD_V]), DATA(out[FWD_CONCAT]),             \
       DATA(out[FWD_LSE]), DATA(in[FWD_X]), DATA(in[FWD_KEY]),                \
       DATA(in[FWD_VALUE]), DATA(in[FWD_WQ]), DATA(in[FWD_WK]),               \
       DATA(in[FWD_WV]), DATA(in[FWD_WO]), DATA(in[FWD_BQ]),                  \
       DATA(in[FWD_BK]), DATA(in[FWD_BV]), DATA(in[FWD_BO]), cfg)

static mha_status forward_core(const call *c)
{
    if (c->typenum == NPY_FLOAT)
        return FORWARD_CORE(mha_forward_f32, c->in, c->out, &c->cfg);
    return FORWARD_CORE(mha_forward_f64, c->in, c->out, &c->cfg);
}

/* Multiply-adds of a forward call: the four projections and attention. */
static double forward_work(const npy_intp n[N_LETTERS])
{
    return (double)n[L_B] *
           ((double)n[L_TQ] * ((double)n[L_DIN] * (double)n[L_SQ] +
                               (double)n[L_SVQ] * (double)n[L_DOUT]) +
            (double)n[L_TK] * ((double)n[L_DKIN] * (double)n[L_SK] +
                               (double)n[L_DVIN] * (double)n[L_SV]) +
            (double)n[L_TQ] * (double)n[L_TK] *
                (double)(n[L_SQ] + n[L_SVQ]));
}

PyObject *forward(PyObject *self, PyObject *const *argv, Py_ssize_t nargs,
                         PyObject *kwnames)
{
    (void)self;
    const call_spec *sp = &forward_spec;
    call c;
    PyObject *result = NULL;
    call_init(&c);
    const int parsed = kwnames == NULL && nargs <= FWD_NARGS && nargs >= FWD_NARGS - 1
                           ? read_positional(&c, sp, argv, nargs)
                           : parse_fastcall(&c, sp, argv, nargs, kwnames);
    static const int wpos[4] = {FWD_WQ, FWD_WK, FWD_WV, FWD_WO};
    if (parsed < 0 || convert_arrays(&c, sp) < 0 || build_config(&c, sp) < 0 ||
        read_packed(&c, c.arg[FWD_PACKED].obj, wpos, 4) < 0)
        goto fail;
    const int keep = c.arg[FWD_KEEP].truth;
    const int want[FWD_NOUTS] = {
        [FWD_OUT] = 1, [FWD_WEIGHTS] = c.arg[FWD_WANT_WEIGHTS].truth,
        [FWD_Q] = keep, [FWD_K] = keep, [FWD_V] = keep, [FWD_CONCAT] = keep,
        [FWD_LSE] = keep};
    if (make_outputs(&c, FWD_NOUTS, forward_outs, want) < 0)
        goto fail;

    // A small call (at most MHA_SMALL_WORK multiply-adds: tens of
    // microseconds) is not worth the Ctrl-C handler's two sigaction system
    // calls, nor the look-up of the main thread: Python sees a signal that
    // comes during it as soon as it returns, as if it had come just after.
    const int main_thread =
        forward_work(c.size) > MHA_SMALL_WORK && on_main_thread();
    if (run_core(&c, forward_core, main_thread) < 0)
        goto fail;

    // (out, weights or None, (q, k, v, concat, lse) or None)
    PyObject *extras = Py_None;
    Py_INCREF(extras);
    if (keep) {
        Py_DECREF(extras);
        if ((extras = arrays_tuple(&c.out[FWD_Q], FWD_NOUTS - FWD_Q)) == NULL)
            goto fail;
    }
    PyObject *weights = (PyObject *)c.out[FWD_WEIGHTS];
    result = PyTuple_Pack(3, (PyObject *)c.out[FWD_OUT],
                          weights != NULL ? weights : Py_None, extras);
    Py_DECREF(extras);
fail:
    call_release(&c);
    return result;
}

/* ---- backward ----------------------------------------------------------- */

GLUE_DOC(backward_doc,
"backward(dout, x, key, value, wq, wk, wv, wo, q, k, v, concat, lse, dk, dv,\n"
"         scales, mask, causal, key_lengths, variants, want_bq, want_bk,\n"
"         want_bv, want_bo)\n"
"--\n\n"
"Backward pass of forward() (low level; see mhattn.backward). dout\n"
"(B,Tq,Dout); x, key, value, wq, wk, wv, wo, dk, dv, scales, mask, causal,\n"
"key_lengths as given to forward(), except that key None means key is x and\n"
"value None means value is key (or x): their gradients are then added into\n"
"x's (key's). q, k, v, concat, lse: forward()'s kept extras.\n\n"
"Returns (dx, dkey or None, dvalue or None, dwq, dwk, dwv, dwo or None,\n"
"dbq, dbk, dbv, dbo, dsinks, dq_norm, dk_norm), each bias gradient None\n"
"unless its want_* is true, each variant's None unless it was given.");

/* backward()'s positional arguments. */
enum {
    BWD_DOUT, BWD_X, BWD_KEY, BWD_VALUE, BWD_WQ, BWD_WK, BWD_WV, BWD_WO,
    BWD_Q, BWD_K, BWD_V, BWD_CONCAT, BWD_LSE, BWD_DK, BWD_DV, BWD_SCALES,
    BWD_MASK, BWD_CAUSAL, BWD_KEY_LENGTHS, BWD_VARIANTS, BWD_WANT_BQ,
    BWD_WANT_BK, BWD_WANT_BV, BWD_WANT_BO, BWD_NARGS
};

/* key None means key is x; value None means value is key (or x). */
static const arg_spec backward_args[BWD_NARGS] = {
    [BWD_DOUT] = {"dout", ARG_ARRAY, SHAPE3(L_B, L_TQ, L_DOUT), 0},
    [BWD_X] = {"x", ARG_ARRAY, SHAPE3(L_B, L_TQ, L_DIN), 0},
    [BWD_KEY] = {"key", ARG_ARRAY_ALIAS,
                 SHAPE3(L_B, L_TK, L_DKIN), BWD_X},
    [BWD_VALUE] = {"value", ARG_ARRAY_ALIAS,
                   SHAPE3(L_B, L_TK, L_DVIN), BWD_KEY},
    [BWD_WQ] = {"wq", ARG_ARRAY, SHAPE2(L_DIN, L_SQ), 0},
    [BWD_WK] = {"wk", ARG_ARRAY, SHAPE2(L_DKIN, L_SK), 0},
    [BWD_WV] = {"wv", ARG_ARRAY, SHAPE2(L_DVIN, L_SV), 0},
    [BWD_WO] = {"wo", ARG_ARRAY_OPT, SHAPE2(L_SVQ, L_DOUT), 0},
    [BWD_Q] = {"q", ARG_ARRAY, SHAPE3(L_B, L_TQ, L_SQ), 0},
    [BWD_K] = {"k", ARG_ARRAY, SHAPE3(L_B, L_TK, L_SK), 0},
    [BWD_V] = {"v", ARG_ARRAY, SHAPE3(L_B, L_TK, L_SV), 0},
    [BWD_CONCAT] = {"concat", ARG_ARRAY,
                    SHAPE3(L_B, L_TQ, L_SVQ), 0},
    [BWD_LSE] = {"lse", ARG_ARRAY, SHAPE3(L_B, L_H, L_TQ), 0},
    [BWD_DK] = {.name = "dk", .kind = ARG_INT64},
    [BWD_DV] = {.name = "dv", .kind = ARG_INT64},
    [BWD_SCALES] = {.name = "scales", .kind = ARG_FLOAT64},
    [BWD_MASK] = {.name = "mask", .kind = ARG_MASK},
    [BWD_CAUSAL] = {.name = "causal", .kind = ARG_BOOL},
    [BWD_KEY_LENGTHS] = {.name = "key_lengths", .kind = ARG_LENGTHS},
    [BWD_VARIANTS] = {.name = "variants", .kind = ARG_VARIANTS},
    [BWD_WANT_BQ] = {.name = "want_bq", .kind = ARG_BOOL},
    [BWD_WANT_BK] = {.name = "want_bk", .kind = ARG_BOOL},
    [BWD_WANT_BV] = {.name = "want_bv", .kind = ARG_BOOL},
    [BWD_WANT_BO] = {.name = "want_bo", .kind = ARG_BOOL},
};

static const int backward_checks_x[] = {BWD_KEY, BWD_VALUE, -1};
static const int backward_checks_widths[] = {
    BWD_WQ, BWD_WK, BWD_WV, BWD_WO, BWD_DOUT, BWD_Q, BWD_K, BWD_V, BWD_CONCAT,
    BWD_LSE, -1};

static const call_spec backward_spec = {
    .name = "backward", .nargs = BWD_NARGS, .args = backward_args,
    .checks_x = backward_checks_x, .checks_widths = backward_checks_widths,
    .x = BWD_X, .key = BWD_KEY, .value = BWD_VALUE, .wo = BWD_WO,
    .dk = BWD_DK, .dv = BWD_DV, .scales = BWD_SCALES, .mask = BWD_MASK,
    .causal = BWD_CAUSAL, .key_lengths = BWD_KEY_LENGTHS,
    .variants = BWD_VARIANTS, .broadcast_mask = 0,
};

/* backward()'s gradients, in the order mha_backward_<sfx> takes them. */
enum {
    BWD_DX, BWD_DKEY, BWD_DVALUE, BWD_DWQ, BWD_DWK, BWD_DWV, BWD_DWO,
    BWD_DBQ, BWD_DBK, BWD_DBV, BWD_DBO, BWD_DSINKS, BWD_DQ_NORM, BWD_DK_NORM,
    BWD_NOUTS
};
_Static_assert(BWD_NARGS <= MAX_ARGS && BWD_NOUTS <= MAX_OUTS,
               "a call holds backward()'s arguments and gradients");

static const shape backward_outs[BWD_NOUTS] = {
    [BWD_DX] = SHAPE3(L_B, L_TQ, L_DIN),
    [BWD_DKEY] = SHAPE3(L_B, L_TK, L_DKIN),
    [BWD_DVALUE] = SHAPE3(L_B, L_TK, L_DVIN),
    [BWD_DWQ] = SHAPE2(L_DIN, L_SQ),
    [BWD_DWK] = SHAPE2(L_DKIN, L_SK),
    [BWD_DWV] = SHAPE2(L_DVIN, L_SV),
    [BWD_DWO] = SHAPE2(L_SVQ, L_DOUT),
    [BWD_DBQ] = SHAPE1(L_SQ),
    [BWD_DBK] = SHAPE1(L_SK),
    [BWD_DBV] = SHAPE1(L_SV),
    [BWD_DBO] = SHAPE1(L_DOUT),
};

/* mha_backward_f32 and _f64 take the same arguments, each in its dtype. */
#define BACKWARD_CORE(fn, in, out, dkey, dvalue, cfg)                         \
    fn(DATA(out[BWD_DX]), dkey, dvalue, DATA(out[BWD_DWQ]),                   \
       DATA(out[BWD_DWK]), DATA(out[BWD_DWV]), DATA(out[BWD_DWO]),            \
       DATA(out[BWD_DBQ]), DATA(out[BWD_DBK]), DATA(out[BWD_DBV]),            \
       DATA(out[BWD_DBO]), DATA(out[BWD_DSINKS]), DATA(out[BWD_DQ_NORM]),     \
       DATA(out[BWD_DK_NORM]), DATA(in[BWD_DOUT]),                            \
       DATA(in[BWD_X]),                                                       \
       DATA(in[BWD_KEY]), DATA(in[BWD_VALUE]), DATA(in[BWD_WQ]),              \
       DATA(in[BWD_WK]), DATA(in[BWD_WV]), DATA(in[BWD_WO]), DATA(in[BWD_Q]), \
       DATA(in[BWD_K]), DATA(in[BWD_V]), DATA(in[BWD_CONCAT]),                \
       DATA(in[BWD_LSE]), cfg)

static mha_status backward_core(const call *c)
{
    // A role fed by another input adds into that input's gradient: dkey is
    // made only when key is not x, dvalue only when value is not key.
    PyArrayObject *const *out = c->out;
    void *dkey = out[BWD_DKEY] != NULL ? DATA(out[BWD_DKEY]) : DATA(out[BWD_DX]);
    void *dvalue = out[BWD_DVALUE] != NULL ? DATA(out[BWD_DVALUE]) : dkey;
    if (c->typenum == NPY_FLOAT)
        return BACKWARD_CORE(mha_backward_f32, c->in, out, dkey, dvalue, &c->cfg);
    return BACKWARD_CORE(mha_backward_f64, c->in, out, dkey, dvalue, &c->cfg);
}

/* The learnable variants' gradients, shaped as they are: dsinks (H,),
   dq_norm and dk_norm as q_norm and k_norm; none for an absent one. */
static int variant_gradients(call *c)
{
    static const int grad[3] = {BWD_DSINKS, BWD_DQ_NORM, BWD_DK_NORM};
    static const int param[3] = {V_SINKS, V_Q_NORM, V_K_NORM};
    for (int i = 0; i < 3; i++) {
        PyArrayObject *p = c->var[param[i]];
        if (p == NULL)
            continue;
        c->out[grad[i]] = (PyArrayObject *)PyArray_EMPTY(
            PyArray_NDIM(p), PyArray_DIMS(p), c->typenum, 0);
        if (c->out[grad[i]] == NULL)
            return -1;
    }
    return 0;
}

PyObject *backward(PyObject *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    const call_spec *sp = &backward_spec;
    call c;
    PyObject *result = NULL;
    call_init(&c);
    // mhattn passes every argument by position: no need to parse then. A
    // tuple is its own PySequence_Fast, so its items are an argv.
    const int parsed =
        (kwds == NULL || PyDict_GET_SIZE(kwds) == 0) &&
                PyTuple_GET_SIZE(args) == BWD_NARGS
            ? read_positional(&c, sp, PySequence_Fast_ITEMS(args), BWD_NARGS)
            : parse_args(&c, sp, args, kwds);
    if (parsed < 0 || convert_arrays(&c, sp) < 0 || build_config(&c, sp) < 0)
        goto fail;
    const arg_value *a = c.arg;
    const int want[BWD_NOUTS] = {
        [BWD_DX] = 1, [BWD_DKEY] = a[BWD_KEY].obj != Py_None,
        [BWD_DVALUE] = a[BWD_VALUE].obj != Py_None,
        [BWD_DWQ] = 1, [BWD_DWK] = 1, [BWD_DWV] = 1,
        [BWD_DWO] = c.in[BWD_WO] != NULL,
        [BWD_DBQ] = a[BWD_WANT_BQ].truth, [BWD_DBK] = a[BWD_WANT_BK].truth,
        [BWD_DBV] = a[BWD_WANT_BV].truth, [BWD_DBO] = a[BWD_WANT_BO].truth};
    if (make_outputs(&c, BWD_NOUTS, backward_outs, want) < 0 ||
        variant_gradients(&c) < 0)
        goto fail;
    // Unlike forward(), no small-call shortcut: a main-thread call always
    // polls for Ctrl-C.
    if (run_core(&c, backward_core, on_main_thread()) < 0)
        goto fail;
    result = arrays_tuple(c.out, BWD_NOUTS);
fail:
    call_release(&c);
    return result;
}

/* ---- project and attention_backward (issue 17) -------------------------- */

GLUE_DOC(project_doc,
"project(x, key, value, wq, wk, wv, bq, bk, bv, dk, dv, scales, variants,\n"
"        packed=None)\n"
"--\n\n"
"The projections of forward() alone (low level): x, key, value, wq, wk,\n"
"wv, biases, dk, dv, scales, variants and packed (a 3- or 4-tuple, its\n"
"fourth ignored) as given to forward(). Returns\n"
"(q (B,Tq,Sq), k (B,Tk,Sk), v (B,Tk,Sv)), q and k after the q/k norm and\n"
"RoPE (positions from the variants tuple, or the defaults).");

/* project()'s positional arguments. PRJ_NONE is a slot past them that
   holds None (false): project() has no W^O, mask, causal or key_lengths,
   and the skeleton reads those from there. */
enum {
    PRJ_X, PRJ_KEY, PRJ_VALUE, PRJ_WQ, PRJ_WK, PRJ_WV, PRJ_BQ, PRJ_BK, PRJ_BV,
    PRJ_DK, PRJ_DV, PRJ_SCALES, PRJ_VARIANTS, PRJ_PACKED, PRJ_NARGS,
    PRJ_NONE = PRJ_NARGS
};
_Static_assert(PRJ_NONE < MAX_ARGS, "a call holds project()'s arguments");

static const arg_spec project_args[PRJ_NARGS] = {
    [PRJ_X] = {"x", ARG_ARRAY, SHAPE3(L_B, L_TQ, L_DIN), 0},
    [PRJ_KEY] = {"key", ARG_ARRAY, SHAPE3(L_B, L_TK, L_DKIN), 0},
    [PRJ_VALUE] = {"value", ARG_ARRAY, SHAPE3(L_B, L_TK, L_DVIN), 0},
    [PRJ_WQ] = {"wq", ARG_ARRAY, SHAPE2(L_DIN, L_SQ), 0},
    [PRJ_WK] = {"wk", ARG_ARRAY, SHAPE2(L_DKIN, L_SK), 0},
    [PRJ_WV] = {"wv", ARG_ARRAY, SHAPE2(L_DVIN, L_SV), 0},
    [PRJ_BQ] = {"bq", ARG_ARRAY_OPT, SHAPE1(L_SQ), 0},
    [PRJ_BK] = {"bk", ARG_ARRAY_OPT, SHAPE1(L_SK), 0},
    [PRJ_BV] = {"bv", ARG_ARRAY_OPT, SHAPE1(L_SV), 0},
    [PRJ_DK] = {.name = "dk", .kind = ARG_INT64},
    [PRJ_DV] = {.name = "dv", .kind = ARG_INT64},
    [PRJ_SCALES] = {.name = "scales", .kind = ARG_FLOAT64},
    [PRJ_VARIANTS] = {.name = "variants", .kind = ARG_VARIANTS},
    [PRJ_PACKED] = {.name = "packed", .kind = ARG_PACKED},
};

static const int project_checks_x[] = {PRJ_KEY, PRJ_VALUE, -1};
static const int project_checks_widths[] = {
    PRJ_WQ, PRJ_WK, PRJ_WV, PRJ_BQ, PRJ_BK, PRJ_BV, -1};

static const call_spec project_spec = {
    .name = "project", .nargs = PRJ_NARGS, .args = project_args,
    .checks_x = project_checks_x, .checks_widths = project_checks_widths,
    .x = PRJ_X, .key = PRJ_KEY, .value = PRJ_VALUE, .wo = PRJ_NONE,
    .dk = PRJ_DK, .dv = PRJ_DV, .scales = PRJ_SCALES, .mask = PRJ_NONE,
    .causal = PRJ_NONE, .key_lengths = PRJ_NONE, .variants = PRJ_VARIANTS,
    .broadcast_mask = 0, .nopt = 1,
};

static const shape project_outs[3] = {
    SHAPE3(L_B, L_TQ, L_SQ), SHAPE3(L_B, L_TK, L_SK), SHAPE3(L_B, L_TK, L_SV)};

/* mha_project_f32 and _f64 take the same arguments, each in its dtype. */
#define PROJECT_CORE(fn, in, out, cfg)                                        \
    fn(DATA(out[0]), DATA(out[1]), DATA(out[2]), DATA(in[PRJ_X]),             \
       DATA(in[PRJ_KEY]), DATA(in[PRJ_VALUE]), DATA(in[PRJ_WQ]),              \
       DATA(in[PRJ_WK]), DATA(in[PRJ_WV]), DATA(in[PRJ_BQ]),                  \
       DATA(in[PRJ_BK]), DATA(in[PRJ_BV]), cfg)

static mha_status project_core(const call *c)
{
    if (c->typenum == NPY_FLOAT)
        return PROJECT_CORE(mha_project_f32, c->in, c->out, &c->cfg);
    return PROJECT_CORE(mha_project_f64, c->in, c->out, &c->cfg);
}

PyObject *project(PyObject *self, PyObject *const *argv, Py_ssize_t nargs,
                         PyObject *kwnames)
{
    (void)self;
    const call_spec *sp = &project_spec;
    call c;
    PyObject *result = NULL;
    call_init(&c);
    const int parsed = kwnames == NULL && nargs <= PRJ_NARGS && nargs >= PRJ_NARGS - 1
                           ? read_positional(&c, sp, argv, nargs)
                           : parse_fastcall(&c, sp, argv, nargs, kwnames);
    c.arg[PRJ_NONE] = (arg_value){Py_None, 0};
    static const int wpos[3] = {PRJ_WQ, PRJ_WK, PRJ_WV};
    if (parsed < 0 || convert_arrays(&c, sp) < 0 || build_config(&c, sp) < 0 ||
        read_packed(&c, c.arg[PRJ_PACKED].obj, wpos, 3) < 0)
        goto fail;
    const int want[3] = {1, 1, 1};
    if (make_outputs(&c, 3, project_outs, want) < 0)
        goto fail;
    const npy_intp *n = c.size;
    const double work = (double)n[L_B] * ((double)n[L_TQ] * (double)n[L_DIN] * (double)n[L_SQ] +
                                          (double)n[L_TK] * ((double)n[L_DKIN] * (double)n[L_SK] +
                                                             (double)n[L_DVIN] * (double)n[L_SV]));
    if (run_core(&c, project_core, work > MHA_SMALL_WORK && on_main_thread()) < 0)
        goto fail;
    result = arrays_tuple(c.out, 3);
fail:
    call_release(&c);
    return result;
}
