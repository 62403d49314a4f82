/*
 * mha.c - the multi-head entry points: forward(), backward() and project(),
 * each with its call_spec (its argument table and the fields that follow
 * from its arguments are generated: args_gen.h), and the
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
    sizes_from(n, x, 3, (const signed char[]){L_B, L_TQ, L_DIN});
    sizes_from(n, key, 3, (const signed char[]){-1, L_TK, L_DKIN});
    if (value != NULL)   // check_config takes none
        sizes_from(n, value, 3, (const signed char[]){-1, -1, L_DVIN});
    else
        n[L_DVIN] = 0;
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

/* Multiply-adds of a forward call: the four projections (and the output
   gate's) and attention. */
static double forward_work(const call *c)
{
    const npy_intp *n = c->size;
    const double gate = c->in[FWD_WGATE] != NULL ? (double)n[L_DIN] * (double)n[L_SVQ] : 0.0;
    return (double)n[L_B] *
           ((double)n[L_TQ] * ((double)n[L_DIN] * (double)n[L_SQ] +
                               (double)n[L_SVQ] * (double)n[L_DOUT] + gate) +
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
    FORWARD_SPEC_ARGS, .layout = LAYOUT_C, .broadcast_mask = 1, .has_wo = 0, .checked = 1,
    .w_storage = 1,
    .sizes = mha_sizes, .check = NULL, .finish = forward_packed, .outputs = forward_outputs,
    .work = forward_work, .core = forward_core, .result = forward_result,
};

GLUE_FASTCALL_ENTRY(forward, FORWARD_DOC)

/* ---- backward ----------------------------------------------------------- */

/* The learnable variants' gradients, shaped as they are: dsinks (H,),
   dq_norm and dk_norm as q_norm and k_norm, drel_table as T5's table;
   none for an absent one. */
static int variant_gradients(call *c)
{
    static const int grad[4] = {BWD_DSINKS, BWD_DQ_NORM, BWD_DK_NORM, BWD_DREL_TABLE};
    static const int param[4] = {V_SINKS, V_Q_NORM, V_K_NORM, V_REL};
    for (int i = 0; i < 4; i++) {
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
        [BWD_DBV] = a[BWD_WANT_BV].truth, [BWD_DBO] = a[BWD_WANT_BO].truth,
        [BWD_DWGATE] = c->in[BWD_WGATE] != NULL, [BWD_DBGATE] = c->in[BWD_WGATE] != NULL,
        [BWD_DMASK] = a[BWD_WANT_DMASK].truth};
    if (a[BWD_WANT_DMASK].truth && want_dmask_check(c) < 0)
        return -1;
    if (make_outputs(c, BWD_NOUTS, backward_outs, want) < 0)
        return -1;
    return variant_gradients(c);
}

/* The gradients; the output gate's two only with wgate, then dmask only
   with want_dmask, then drel_table only with T5's bias, so a call without
   them gets the tuple it always had. */
static PyObject *backward_result(call *c)
{
    _Static_assert(BWD_DWGATE == BWD_NOUTS - 4 && BWD_DBGATE == BWD_NOUTS - 3 &&
                       BWD_DMASK == BWD_NOUTS - 2 && BWD_DREL_TABLE == BWD_NOUTS - 1,
                   "the gate's gradients, then dmask, then drel_table close the tuple");
    PyArrayObject *items[BWD_NOUTS];
    int n = c->in[BWD_WGATE] != NULL ? BWD_DMASK : BWD_DWGATE;
    for (int i = 0; i < n; i++)
        items[i] = c->out[i];
    if (c->out[BWD_DMASK] != NULL)
        items[n++] = c->out[BWD_DMASK];
    if (c->out[BWD_DREL_TABLE] != NULL)
        items[n++] = c->out[BWD_DREL_TABLE];
    return arrays_tuple(items, n);
}

/* Unlike forward(), no small-call shortcut (.work NULL): a main-thread
   call always polls for Ctrl-C. */
static const call_spec backward_spec = {
    BACKWARD_SPEC_ARGS, .layout = LAYOUT_C, .broadcast_mask = 0, .has_wo = 0, .checked = 1,
    .sizes = mha_sizes, .check = NULL, .finish = NULL, .outputs = backward_outputs,
    .work = NULL, .core = backward_core, .result = backward_result,
};

GLUE_TUPLE_ENTRY(backward, BACKWARD_DOC)

/* ---- project ------------------------------------------------------------ */

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
    PROJECT_SPEC_ARGS, .layout = LAYOUT_C, .broadcast_mask = 0, .has_wo = 0, .checked = 1,
    .sizes = mha_sizes, .check = NULL, .finish = project_packed, .outputs = project_outputs,
    .work = project_work, .core = project_core, .result = project_result,
};

GLUE_FASTCALL_ENTRY(project, PROJECT_DOC)

/* ---- check_config --------------------------------------------------------- */

/* Nothing to compute: build_config (call.c) has had the core check the
   config (.checked 1), which is all this entry point is for. */
static int check_config_outputs(call *c)
{
    (void)c;
    return 0;
}

static double check_config_work(const call *c)
{
    (void)c;
    return 0.0;
}

static mha_status check_config_core(call *c)
{
    (void)c;
    return MHA_OK;
}

static PyObject *check_config_result(call *c)
{
    (void)c;
    Py_RETURN_NONE;
}

static const call_spec check_config_spec = {
    CHECK_CONFIG_SPEC_ARGS, .layout = LAYOUT_C, .broadcast_mask = 0, .has_wo = 0,
    .checked = 1, .sizes = mha_sizes, .check = NULL, .finish = NULL,
    .outputs = check_config_outputs, .work = check_config_work, .core = check_config_core,
    .result = check_config_result,
};

GLUE_FASTCALL_ENTRY(check_config, CHECK_CONFIG_DOC)
