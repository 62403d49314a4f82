/*
 * core_calls.c - every call the glue makes into the core's compute API
 * (mha.h), in one place: the five entry points' core steps, run by the
 * skeleton with the GIL released (call.c, run_core), the config check, and
 * the packing of a weight. A change of the core's API is adapted here.
 */
#include "glue.h"

#include <string.h>

/* The element type of a call's arrays (NPY_FLOAT or NPY_DOUBLE). */
#define DTYPE_OF(typenum) ((typenum) == NPY_FLOAT ? MHA_DTYPE_F32 : MHA_DTYPE_F64)

/* mha_check_config on the config the skeleton filled (call.c,
   fill_config): -1 with the core's verdict as a Python exception (its
   message, which names the rule and the values seen, for MHA_ERR_ARG). */
int core_check(const mha_config *cfg, int typenum)
{
    mha_layout lay;
    mha_error err;
    const mha_status st = mha_check_config_typed(&lay, cfg, DTYPE_OF(typenum), &err);
    if (st != MHA_OK) {
        raise_status(st, &err);
        return -1;
    }
    return 0;
}

/* An mha_params of the call's element type, its buffers from the call's
   arrays as the function's table says (args_gen.c, <name>_params: each
   where the schema's c_field puts it). A pointer's bytes are the same as a
   void * and as a const void * (C11 6.2.5), so memcpy stores either. */
static mha_params params_of(const call *c, const param_slot *slot)
{
    mha_params prm = {.dtype = DTYPE_OF(c->typenum)};
    for (; slot->pos >= 0; slot++) {
        void *data = DATA((slot->out ? c->out : c->in)[slot->pos]);
        memcpy((char *)&prm + slot->offset, &data, sizeof data);
    }
    return prm;
}

/* Each core step runs one operation on the params of its call; a rejection
   of the params (a NULL required buffer, say) is kept in c->err for
   run_core to raise. */
/* The weights as the call's storage (c->w: float32, or half bits that the
   core widens as it packs them). */
mha_status forward_core(call *c)
{
    mha_params prm = params_of(c, forward_params);
    prm.w_storage = c->w;
    return mha_forward(&c->cfg, &prm, &c->err);
}

mha_status backward_core(call *c)
{
    // A role fed by another input adds into that input's gradient: dkey is
    // made only when key is not x, dvalue only when value is not key.
    mha_params prm = params_of(c, backward_params);
    if (prm.dkey == NULL)
        prm.dkey = prm.dx;
    if (prm.dvalue == NULL)
        prm.dvalue = prm.dkey;
    return mha_backward(&c->cfg, &prm, &c->err);
}

mha_status project_core(call *c)
{
    const mha_params prm = params_of(c, project_params);
    return mha_project(&c->cfg, &prm, &c->err);
}

/* q, k, v read in place with the strides the converter recorded (c->st),
   out written with those of its layout; k and v as the call's storage
   (c->kv: a KV cache's half or int8, with the scales' strides). */
mha_status attention_core(call *c)
{
    mha_params prm = params_of(c, attention_params);
    prm.sq = c->st[0], prm.sk = c->st[1], prm.sv = c->st[2], prm.so = c->st[3];
    prm.kv_storage = c->kv, prm.sks = c->st[4], prm.svs = c->st[5];
    return mha_attend(&c->cfg, &prm, &c->err);
}

/* Fused dq, dk, dv, and dsinks. */
mha_status attention_backward_core(call *c)
{
    const mha_params prm = params_of(c, attention_backward_params);
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
