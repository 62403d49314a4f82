/*
 * mha.c - the multi-head entry points: forward(), backward() and project(),
 * each with its argument table (arg_spec[]) and its call_spec, and the
 * steps of their family that the skeleton (call.c) runs: the sizes from x,
 * key, value and the head widths, the outputs, the result.
 */
#include "glue.h"

/* ---- the family's sizes -------------------------------------------------- */

/*
 * The vectors converted; the sizes (c->size) from x, key, value, dk, dv,
 * scales and wo, and the head widths (c->widths): the shapes of
 * sp->checks_x against x's, key's and value's sizes, then, with the widths
 * known, those of sp->checks_widths.
 */
static int mha_sizes(call *c, const call_spec *sp)
{
    if (convert_vectors(c, sp) < 0)
        return -1;
    PyArrayObject *const *in = c->in;
    PyArrayObject *x = in[sp->x], *key = in[sp->key], *value = in[sp->value];
    PyArrayObject *wo = in[sp->wo];
    npy_intp *n = c->size;
    n[L_B] = PyArray_DIM(x, 0);
    n[L_TQ] = PyArray_DIM(x, 1);
    n[L_DIN] = PyArray_DIM(x, 2);
    n[L_TK] = PyArray_DIM(key, 1);
    n[L_DKIN] = PyArray_DIM(key, 2);
    n[L_DVIN] = PyArray_DIM(value, 2);
    n[L_H] = PyArray_DIM(in[sp->scales], 0);
    if (check_shapes(c, sp, sp->checks_x) < 0)
        return -1;

    size_t fused[4];   // Sq, Sk, Sv, Svq
    if (head_widths(&c->widths, fused, in[sp->dk], in[sp->dv], n[L_H]) < 0)
        return -1;
    n[L_G] = PyArray_DIM(in[sp->dk], 0);
    n[L_SQ] = (npy_intp)fused[0];
    n[L_SK] = (npy_intp)fused[1];
    n[L_SV] = (npy_intp)fused[2];
    n[L_SVQ] = (npy_intp)fused[3];
    n[L_DOUT] = wo != NULL ? PyArray_DIM(wo, 1) : n[L_SVQ];
    return check_shapes(c, sp, sp->checks_widths);
}

/* ---- forward ------------------------------------------------------------ */

GLUE_DOC(forward_doc, FORWARD_DOC);

static const arg_spec forward_args[FWD_NARGS] = {
    [FWD_X] = {"x", ARG_ARRAY, SHAPE3(L_B, L_TQ, L_DIN), 0, NULL},
    [FWD_KEY] = {"key", ARG_ARRAY, SHAPE3(L_B, L_TK, L_DKIN), 0, NULL},
    [FWD_VALUE] = {"value", ARG_ARRAY, SHAPE3(L_B, L_TK, L_DVIN), 0, NULL},
    [FWD_WQ] = {"wq", ARG_ARRAY, SHAPE2(L_DIN, L_SQ), 0, NULL},
    [FWD_WK] = {"wk", ARG_ARRAY, SHAPE2(L_DKIN, L_SK), 0, NULL},
    [FWD_WV] = {"wv", ARG_ARRAY, SHAPE2(L_DVIN, L_SV), 0, NULL},
    [FWD_WO] = {"wo", ARG_ARRAY_OPT, SHAPE2(L_SVQ, L_DOUT), 0, NULL},
    [FWD_BQ] = {"bq", ARG_ARRAY_OPT, SHAPE1(L_SQ), 0, NULL},
    [FWD_BK] = {"bk", ARG_ARRAY_OPT, SHAPE1(L_SK), 0, NULL},
    [FWD_BV] = {"bv", ARG_ARRAY_OPT, SHAPE1(L_SV), 0, NULL},
    [FWD_BO] = {"bo", ARG_ARRAY_OPT, SHAPE1(L_DOUT), 0, NULL},
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

static const shape forward_outs[FWD_NOUTS] = {
    [FWD_OUT] = SHAPE3(L_B, L_TQ, L_DOUT),
    [FWD_WEIGHTS] = SHAPE4(L_B, L_H, L_TQ, L_TK),
    [FWD_Q] = SHAPE3(L_B, L_TQ, L_SQ),
    [FWD_K] = SHAPE3(L_B, L_TK, L_SK),
    [FWD_V] = SHAPE3(L_B, L_TK, L_SV),
    [FWD_CONCAT] = SHAPE3(L_B, L_TQ, L_SVQ),
    [FWD_LSE] = SHAPE3(L_B, L_H, L_TQ),
};

/* The packed weights, once the config is checked. */
static int forward_packed(call *c)
{
    static const int wpos[4] = {FWD_WQ, FWD_WK, FWD_WV, FWD_WO};
    return read_packed(c, c->arg[FWD_PACKED].obj, wpos, 4);
}

static int forward_outputs(call *c)
{
    const int keep = c->arg[FWD_KEEP].truth;
    const int want[FWD_NOUTS] = {
        [FWD_OUT] = 1, [FWD_WEIGHTS] = c->arg[FWD_WANT_WEIGHTS].truth,
        [FWD_Q] = keep, [FWD_K] = keep, [FWD_V] = keep, [FWD_CONCAT] = keep,
        [FWD_LSE] = keep};
    return make_outputs(c, FWD_NOUTS, forward_outs, want);
}

/* Multiply-adds of a forward call: the four projections and attention. */
static double forward_work(const call *c)
{
    const npy_intp *n = c->size;
    return (double)n[L_B] *
           ((double)n[L_TQ] * ((double)n[L_DIN] * (double)n[L_SQ] +
                               (double)n[L_SVQ] * (double)n[L_DOUT]) +
            (double)n[L_TK] * ((double)n[L_DKIN] * (double)n[L_SK] +
                               (double)n[L_DVIN] * (double)n[L_SV]) +
            (double)n[L_TQ] * (double)n[L_TK] *
                (double)(n[L_SQ] + n[L_SVQ]));
}

/* (out, weights or None, (q, k, v, concat, lse) or None) */
static PyObject *forward_result(call *c)
{
    PyObject *extras = Py_None;
    Py_INCREF(extras);
    if (c->arg[FWD_KEEP].truth) {
        Py_DECREF(extras);
        if ((extras = arrays_tuple(&c->out[FWD_Q], FWD_NOUTS - FWD_Q)) == NULL)
            return NULL;
    }
    PyObject *weights = (PyObject *)c->out[FWD_WEIGHTS];
    PyObject *result = PyTuple_Pack(3, (PyObject *)c->out[FWD_OUT],
                                    weights != NULL ? weights : Py_None, extras);
    Py_DECREF(extras);
    return result;
}

static const call_spec forward_spec = {
    .name = "forward", .nargs = FWD_NARGS, .args = forward_args, .nopt = 1,
    .layout = LAYOUT_C,
    .checks_x = forward_checks_x, .checks_widths = forward_checks_widths,
    .x = FWD_X, .key = FWD_KEY, .value = FWD_VALUE, .wo = FWD_WO,
    .dk = FWD_DK, .dv = FWD_DV, .scales = FWD_SCALES, .mask = FWD_MASK,
    .causal = FWD_CAUSAL, .key_lengths = FWD_KEY_LENGTHS,
    .variants = FWD_VARIANTS, .lengths_aligned = ARG_NONE,
    .broadcast_mask = 1, .has_wo = 0, .checked = 1,
    .sizes = mha_sizes, .check = NULL, .finish = forward_packed,
    .outputs = forward_outputs, .work = forward_work, .core = forward_core,
    .result = forward_result,
};

PyObject *forward(PyObject *self, PyObject *const *argv, Py_ssize_t nargs,
                  PyObject *kwnames)
{
    (void)self;
    return call_fast(&forward_spec, argv, nargs, kwnames);
}

/* ---- backward ----------------------------------------------------------- */

GLUE_DOC(backward_doc, BACKWARD_DOC);

/* key None means key is x; value None means value is key (or x). */
static const arg_spec backward_args[BWD_NARGS] = {
    [BWD_DOUT] = {"dout", ARG_ARRAY, SHAPE3(L_B, L_TQ, L_DOUT), 0, NULL},
    [BWD_X] = {"x", ARG_ARRAY, SHAPE3(L_B, L_TQ, L_DIN), 0, NULL},
    [BWD_KEY] = {"key", ARG_ARRAY_ALIAS,
                 SHAPE3(L_B, L_TK, L_DKIN), BWD_X, NULL},
    [BWD_VALUE] = {"value", ARG_ARRAY_ALIAS,
                   SHAPE3(L_B, L_TK, L_DVIN), BWD_KEY, NULL},
    [BWD_WQ] = {"wq", ARG_ARRAY, SHAPE2(L_DIN, L_SQ), 0, NULL},
    [BWD_WK] = {"wk", ARG_ARRAY, SHAPE2(L_DKIN, L_SK), 0, NULL},
    [BWD_WV] = {"wv", ARG_ARRAY, SHAPE2(L_DVIN, L_SV), 0, NULL},
    [BWD_WO] = {"wo", ARG_ARRAY_OPT, SHAPE2(L_SVQ, L_DOUT), 0, NULL},
    [BWD_Q] = {"q", ARG_ARRAY, SHAPE3(L_B, L_TQ, L_SQ), 0, NULL},
    [BWD_K] = {"k", ARG_ARRAY, SHAPE3(L_B, L_TK, L_SK), 0, NULL},
    [BWD_V] = {"v", ARG_ARRAY, SHAPE3(L_B, L_TK, L_SV), 0, NULL},
    [BWD_CONCAT] = {"concat", ARG_ARRAY,
                    SHAPE3(L_B, L_TQ, L_SVQ), 0, NULL},
    [BWD_LSE] = {"lse", ARG_ARRAY, SHAPE3(L_B, L_H, L_TQ), 0, NULL},
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

static int backward_outputs(call *c)
{
    const arg_value *a = c->arg;
    const int want[BWD_NOUTS] = {
        [BWD_DX] = 1, [BWD_DKEY] = a[BWD_KEY].obj != Py_None,
        [BWD_DVALUE] = a[BWD_VALUE].obj != Py_None,
        [BWD_DWQ] = 1, [BWD_DWK] = 1, [BWD_DWV] = 1,
        [BWD_DWO] = c->in[BWD_WO] != NULL,
        [BWD_DBQ] = a[BWD_WANT_BQ].truth, [BWD_DBK] = a[BWD_WANT_BK].truth,
        [BWD_DBV] = a[BWD_WANT_BV].truth, [BWD_DBO] = a[BWD_WANT_BO].truth};
    if (make_outputs(c, BWD_NOUTS, backward_outs, want) < 0)
        return -1;
    return variant_gradients(c);
}

static PyObject *backward_result(call *c)
{
    return arrays_tuple(c->out, BWD_NOUTS);
}

/* Unlike forward(), no small-call shortcut (.work NULL): a main-thread
   call always polls for Ctrl-C. */
static const call_spec backward_spec = {
    .name = "backward", .nargs = BWD_NARGS, .args = backward_args, .nopt = 0,
    .layout = LAYOUT_C,
    .checks_x = backward_checks_x, .checks_widths = backward_checks_widths,
    .x = BWD_X, .key = BWD_KEY, .value = BWD_VALUE, .wo = BWD_WO,
    .dk = BWD_DK, .dv = BWD_DV, .scales = BWD_SCALES, .mask = BWD_MASK,
    .causal = BWD_CAUSAL, .key_lengths = BWD_KEY_LENGTHS,
    .variants = BWD_VARIANTS, .lengths_aligned = ARG_NONE,
    .broadcast_mask = 0, .has_wo = 0, .checked = 1,
    .sizes = mha_sizes, .check = NULL, .finish = NULL,
    .outputs = backward_outputs, .work = NULL, .core = backward_core,
    .result = backward_result,
};

PyObject *backward(PyObject *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    return call_tuple(&backward_spec, args, kwds);
}

/* ---- project ------------------------------------------------------------ */

GLUE_DOC(project_doc, PROJECT_DOC);

/* project() has no W^O, mask, causal or key_lengths: its call_spec names
   ARG_NONE for them. */
static const arg_spec project_args[PRJ_NARGS] = {
    [PRJ_X] = {"x", ARG_ARRAY, SHAPE3(L_B, L_TQ, L_DIN), 0, NULL},
    [PRJ_KEY] = {"key", ARG_ARRAY, SHAPE3(L_B, L_TK, L_DKIN), 0, NULL},
    [PRJ_VALUE] = {"value", ARG_ARRAY, SHAPE3(L_B, L_TK, L_DVIN), 0, NULL},
    [PRJ_WQ] = {"wq", ARG_ARRAY, SHAPE2(L_DIN, L_SQ), 0, NULL},
    [PRJ_WK] = {"wk", ARG_ARRAY, SHAPE2(L_DKIN, L_SK), 0, NULL},
    [PRJ_WV] = {"wv", ARG_ARRAY, SHAPE2(L_DVIN, L_SV), 0, NULL},
    [PRJ_BQ] = {"bq", ARG_ARRAY_OPT, SHAPE1(L_SQ), 0, NULL},
    [PRJ_BK] = {"bk", ARG_ARRAY_OPT, SHAPE1(L_SK), 0, NULL},
    [PRJ_BV] = {"bv", ARG_ARRAY_OPT, SHAPE1(L_SV), 0, NULL},
    [PRJ_DK] = {.name = "dk", .kind = ARG_INT64},
    [PRJ_DV] = {.name = "dv", .kind = ARG_INT64},
    [PRJ_SCALES] = {.name = "scales", .kind = ARG_FLOAT64},
    [PRJ_VARIANTS] = {.name = "variants", .kind = ARG_VARIANTS},
    [PRJ_PACKED] = {.name = "packed", .kind = ARG_PACKED},
};

static const int project_checks_x[] = {PRJ_KEY, PRJ_VALUE, -1};
static const int project_checks_widths[] = {
    PRJ_WQ, PRJ_WK, PRJ_WV, PRJ_BQ, PRJ_BK, PRJ_BV, -1};

static const shape project_outs[PRJ_NOUTS] = {
    [PRJ_Q] = SHAPE3(L_B, L_TQ, L_SQ),
    [PRJ_K] = SHAPE3(L_B, L_TK, L_SK),
    [PRJ_V] = SHAPE3(L_B, L_TK, L_SV),
};

/* The packed weights (a fourth entry is ignored), once the config is
   checked. */
static int project_packed(call *c)
{
    static const int wpos[3] = {PRJ_WQ, PRJ_WK, PRJ_WV};
    return read_packed(c, c->arg[PRJ_PACKED].obj, wpos, 3);
}

static int project_outputs(call *c)
{
    static const int want[PRJ_NOUTS] = {1, 1, 1};
    return make_outputs(c, PRJ_NOUTS, project_outs, want);
}

/* Multiply-adds of the three projections. */
static double project_work(const call *c)
{
    const npy_intp *n = c->size;
    return (double)n[L_B] * ((double)n[L_TQ] * (double)n[L_DIN] * (double)n[L_SQ] +
                             (double)n[L_TK] * ((double)n[L_DKIN] * (double)n[L_SK] +
                                                (double)n[L_DVIN] * (double)n[L_SV]));
}

static PyObject *project_result(call *c)
{
    return arrays_tuple(c->out, PRJ_NOUTS);
}

static const call_spec project_spec = {
    .name = "project", .nargs = PRJ_NARGS, .args = project_args, .nopt = 1,
    .layout = LAYOUT_C,
    .checks_x = project_checks_x, .checks_widths = project_checks_widths,
    .x = PRJ_X, .key = PRJ_KEY, .value = PRJ_VALUE, .wo = ARG_NONE,
    .dk = PRJ_DK, .dv = PRJ_DV, .scales = PRJ_SCALES, .mask = ARG_NONE,
    .causal = ARG_NONE, .key_lengths = ARG_NONE, .variants = PRJ_VARIANTS,
    .lengths_aligned = ARG_NONE, .broadcast_mask = 0, .has_wo = 0, .checked = 1,
    .sizes = mha_sizes, .check = NULL, .finish = project_packed,
    .outputs = project_outputs, .work = project_work, .core = project_core,
    .result = project_result,
};

PyObject *project(PyObject *self, PyObject *const *argv, Py_ssize_t nargs,
                  PyObject *kwnames)
{
    (void)self;
    return call_fast(&project_spec, argv, nargs, kwnames);
}
