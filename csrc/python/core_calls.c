/*
 * core_calls.c - every call the glue makes into the core's compute API
 * (mha.h), in one place: the five entry points' core steps, run by the
 * skeleton with the GIL released (call.c, run_core), the config check, and
 * the packing of a weight. A change of the core's API is adapted here.
 */
#include "glue.h"

/* mha_check_config on the config the skeleton filled (call.c,
   fill_config): -1 with its status as a Python exception. */
int check_config(const mha_config *cfg)
{
    mha_layout lay;
    const mha_status st = mha_check_config(&lay, cfg);
    if (st != MHA_OK) {
        raise_status(st);
        return -1;
    }
    return 0;
}

/* mha_forward_f32 and _f64 take the same arguments, each in its dtype. */
#define FORWARD_CORE(fn, in, out, cfg)                                        \
    fn(DATA(out[FWD_OUT]), DATA(out[FWD_WEIGHTS]), DATA(out[FWD_Q]),          \
       DATA(out[FWD_K]), DATA(out[FWD_V]), DATA(out[FWD_CONCAT]),             \
       DATA(out[FWD_LSE]), DATA(in[FWD_X]), DATA(in[FWD_KEY]),                \
       DATA(in[FWD_VALUE]), DATA(in[FWD_WQ]), DATA(in[FWD_WK]),               \
       DATA(in[FWD_WV]), DATA(in[FWD_WO]), DATA(in[FWD_BQ]),                  \
       DATA(in[FWD_BK]), DATA(in[FWD_BV]), DATA(in[FWD_BO]), cfg)

mha_status forward_core(const call *c)
{
    if (c->typenum == NPY_FLOAT)
        return FORWARD_CORE(mha_forward_f32, c->in, c->out, &c->cfg);
    return FORWARD_CORE(mha_forward_f64, c->in, c->out, &c->cfg);
}

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

mha_status backward_core(const call *c)
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

/* mha_project_f32 and _f64 take the same arguments, each in its dtype. */
#define PROJECT_CORE(fn, in, out, cfg)                                        \
    fn(DATA(out[PRJ_Q]), DATA(out[PRJ_K]), DATA(out[PRJ_V]), DATA(in[PRJ_X]), \
       DATA(in[PRJ_KEY]), DATA(in[PRJ_VALUE]), DATA(in[PRJ_WQ]),              \
       DATA(in[PRJ_WK]), DATA(in[PRJ_WV]), DATA(in[PRJ_BQ]),                  \
       DATA(in[PRJ_BK]), DATA(in[PRJ_BV]), cfg)

mha_status project_core(const call *c)
{
    if (c->typenum == NPY_FLOAT)
        return PROJECT_CORE(mha_project_f32, c->in, c->out, &c->cfg);
    return PROJECT_CORE(mha_project_f64, c->in, c->out, &c->cfg);
}

/* mha_attend_f32 and _f64: q, k, v read in place with the strides the
   converter recorded (c->st), out written with those of its layout. */
#define ATTEND_CORE(fn, in, out, st, cfg)                                     \
    fn(DATA(out[ATT_OUT]), DATA(out[ATT_WEIGHTS]), DATA(out[ATT_LSE]),        \
       DATA(in[ATT_Q]), DATA(in[ATT_K]), DATA(in[ATT_V]), &st[0], &st[1],     \
       &st[2], &st[3], cfg)

mha_status attention_core(const call *c)
{
    if (c->typenum == NPY_FLOAT)
        return ATTEND_CORE(mha_attend_f32, c->in, c->out, c->st, &c->cfg);
    return ATTEND_CORE(mha_attend_f64, c->in, c->out, c->st, &c->cfg);
}

/* mha_attend_backward_f32 and _f64 take the same arguments, each in its
   dtype: fused dq, dk, dv, and dsinks. */
#define ATTEND_BACKWARD_CORE(fn, in, out, cfg)                                \
    fn(DATA(out[ABW_DQ]), DATA(out[ABW_DK]), DATA(out[ABW_DV]),               \
       DATA(out[ABW_DSINKS]), DATA(in[ABW_DOUT]), DATA(in[ABW_Q]),            \
       DATA(in[ABW_K]), DATA(in[ABW_V]), DATA(in[ABW_OUT]), DATA(in[ABW_LSE]), \
       cfg)

mha_status attention_backward_core(const call *c)
{
    if (c->typenum == NPY_FLOAT)
        return ATTEND_BACKWARD_CORE(mha_attend_backward_f32, c->in, c->out, &c->cfg);
    return ATTEND_BACKWARD_CORE(mha_attend_backward_f64, c->in, c->out, &c->cfg);
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
    st = typenum == NPY_FLOAT
             ? mha_pack_weight_f32(p, PyArray_DATA(w), N, K, N)
             : mha_pack_weight_f64(p, PyArray_DATA(w), N, K, N);
    Py_END_ALLOW_THREADS
    PyObject *cap = st == MHA_OK ? PyCapsule_New(p, PACKED_CAPSULE, packed_destroy) : NULL;
    if (cap == NULL) {
        if (st != MHA_OK)
            raise_status(st);
        mha_packed_free(p);
        PyMem_Free(p);
    }
    return cap;
}
