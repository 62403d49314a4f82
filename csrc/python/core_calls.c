/*
 * core_calls.c - every call the glue makes into the core's compute API
 * (mha.h), in one place: the five entry points' core steps, run by the
 * skeleton with the GIL released (call.c, run_core), the config check, and
 * the packing of a weight. A change of the core's API is adapted here.
 */
#include "glue.h"

/* The element type of a call's arrays (NPY_FLOAT or NPY_DOUBLE). */
#define DTYPE_OF(typenum) ((typenum) == NPY_FLOAT ? MHA_DTYPE_F32 : MHA_DTYPE_F64)

/* mha_check_config on the config the skeleton filled (call.c,
   fill_config): -1 with the core's verdict as a Python exception (its
   message, which names the rule and the values seen, for MHA_ERR_ARG). */
int check_config(const mha_config *cfg)
{
    mha_layout lay;
    mha_error err;
    const mha_status st = mha_check_config(&lay, cfg, &err);
    if (st != MHA_OK) {
        raise_status(st, &err);
        return -1;
    }
    return 0;
}

/* Each core step fills an mha_params from the call's arrays and runs one
   operation; a rejection of the params (a NULL required buffer, say) is
   kept in c->err for run_core to raise. */
mha_status forward_core(call *c)
{
    PyArrayObject *const *in = c->in, *const *out = c->out;
    const mha_params prm = {
        .dtype = DTYPE_OF(c->typenum),
        .out = DATA(out[FWD_OUT]), .weights = DATA(out[FWD_WEIGHTS]),
        .q = DATA(out[FWD_Q]), .k = DATA(out[FWD_K]), .v = DATA(out[FWD_V]),
        .concat = DATA(out[FWD_CONCAT]), .lse = DATA(out[FWD_LSE]),
        .x = DATA(in[FWD_X]), .key = DATA(in[FWD_KEY]), .value = DATA(in[FWD_VALUE]),
        .wq = DATA(in[FWD_WQ]), .wk = DATA(in[FWD_WK]), .wv = DATA(in[FWD_WV]),
        .wo = DATA(in[FWD_WO]), .bq = DATA(in[FWD_BQ]), .bk = DATA(in[FWD_BK]),
        .bv = DATA(in[FWD_BV]), .bo = DATA(in[FWD_BO]),
    };
    return mha_forward(&c->cfg, &prm, &c->err);
}

mha_status backward_core(call *c)
{
    // A role fed by another input adds into that input's gradient: dkey is
    // made only when key is not x, dvalue only when value is not key.
    PyArrayObject *const *in = c->in, *const *out = c->out;
    void *dkey = out[BWD_DKEY] != NULL ? DATA(out[BWD_DKEY]) : DATA(out[BWD_DX]);
    void *dvalue = out[BWD_DVALUE] != NULL ? DATA(out[BWD_DVALUE]) : dkey;
    const mha_params prm = {
        .dtype = DTYPE_OF(c->typenum),
        .dx = DATA(out[BWD_DX]), .dkey = dkey, .dvalue = dvalue,
        .dwq = DATA(out[BWD_DWQ]), .dwk = DATA(out[BWD_DWK]), .dwv = DATA(out[BWD_DWV]),
        .dwo = DATA(out[BWD_DWO]), .dbq = DATA(out[BWD_DBQ]), .dbk = DATA(out[BWD_DBK]),
        .dbv = DATA(out[BWD_DBV]), .dbo = DATA(out[BWD_DBO]),
        .dsinks = DATA(out[BWD_DSINKS]), .dq_norm = DATA(out[BWD_DQ_NORM]),
        .dk_norm = DATA(out[BWD_DK_NORM]), .dout = DATA(in[BWD_DOUT]),
        .x = DATA(in[BWD_X]), .key = DATA(in[BWD_KEY]), .value = DATA(in[BWD_VALUE]),
        .wq = DATA(in[BWD_WQ]), .wk = DATA(in[BWD_WK]), .wv = DATA(in[BWD_WV]),
        .wo = DATA(in[BWD_WO]), .q = DATA(in[BWD_Q]), .k = DATA(in[BWD_K]),
        .v = DATA(in[BWD_V]), .concat = DATA(in[BWD_CONCAT]), .lse = DATA(in[BWD_LSE]),
    };
    return mha_backward(&c->cfg, &prm, &c->err);
}

mha_status project_core(call *c)
{
    PyArrayObject *const *in = c->in, *const *out = c->out;
    const mha_params prm = {
        .dtype = DTYPE_OF(c->typenum),
        .q = DATA(out[PRJ_Q]), .k = DATA(out[PRJ_K]), .v = DATA(out[PRJ_V]),
        .x = DATA(in[PRJ_X]), .key = DATA(in[PRJ_KEY]), .value = DATA(in[PRJ_VALUE]),
        .wq = DATA(in[PRJ_WQ]), .wk = DATA(in[PRJ_WK]), .wv = DATA(in[PRJ_WV]),
        .bq = DATA(in[PRJ_BQ]), .bk = DATA(in[PRJ_BK]), .bv = DATA(in[PRJ_BV]),
    };
    return mha_project(&c->cfg, &prm, &c->err);
}

/* q, k, v read in place with the strides the converter recorded (c->st),
   out written with those of its layout. */
mha_status attention_core(call *c)
{
    PyArrayObject *const *in = c->in, *const *out = c->out;
    const mha_params prm = {
        .dtype = DTYPE_OF(c->typenum),
        .out = DATA(out[ATT_OUT]), .weights = DATA(out[ATT_WEIGHTS]),
        .lse = DATA(out[ATT_LSE]),
        .q = DATA(in[ATT_Q]), .k = DATA(in[ATT_K]), .v = DATA(in[ATT_V]),
        .sq = c->st[0], .sk = c->st[1], .sv = c->st[2], .so = c->st[3],
    };
    return mha_attend(&c->cfg, &prm, &c->err);
}

/* Fused dq, dk, dv, and dsinks. */
mha_status attention_backward_core(call *c)
{
    PyArrayObject *const *in = c->in, *const *out = c->out;
    const mha_params prm = {
        .dtype = DTYPE_OF(c->typenum),
        .dq = DATA(out[ABW_DQ]), .dk = DATA(out[ABW_DK]), .dv = DATA(out[ABW_DV]),
        .dsinks = DATA(out[ABW_DSINKS]), .dout = DATA(in[ABW_DOUT]),
        .q = DATA(in[ABW_Q]), .k = DATA(in[ABW_K]), .v = DATA(in[ABW_V]),
        .out = DATA(in[ABW_OUT]), .lse = DATA(in[ABW_LSE]),
    };
    return mha_attend_backward(&c->cfg, &prm, &c->err);
}

/* w (K, N), C-contiguous, packed with the GIL released into a new
   PACKED_CAPSULE; NULL with an exception on failure. */
PyObject *pack_core(PyArrayObject *w)
{
    const size_t K = (size_t)PyArray_DIM(w, 0), N = (size_t)PyArray_DIM(w, 1);
    const int typenum = PyArray_TYPE(w);
    mha_packed *p = PyMem_Calloc(1, sizeof *p);
    if (p == NULL)
        return PyErr_NoMemory();
    mha_status st;
    Py_BEGIN_ALLOW_THREADS
    st = mha_pack_weight(p, PyArray_DATA(w), N, K, N, DTYPE_OF(typenum));
    Py_END_ALLOW_THREADS
    PyObject *cap = st == MHA_OK ? PyCapsule_New(p, PACKED_CAPSULE, packed_destroy) : NULL;
    if (cap == NULL) {
        if (st != MHA_OK)
            raise_status(st, NULL);
        mha_packed_free(p);
        PyMem_Free(p);
    }
    return cap;
}
