/*
 * packed.c - prepacked weights (issue 16): pack_weight(), packed_info(), and
 * the packed argument of forward() and project().
 */
#include "glue.h"

#include "dispatch.h"

/* A packed weight is a PACKED_CAPSULE around a PyMem block holding an
   mha_packed (its panels from the core's allocator), made only by
   pack_weight(): Python code cannot reach inside, so its sizes and panels
   are the glue's own. */
void packed_destroy(PyObject *cap)
{
    mha_packed *p = PyCapsule_GetPointer(cap, PACKED_CAPSULE);
    if (p != NULL) {
        mha_packed_free(p);
        PyMem_Free(p);
    }
}

GLUE_DOC(pack_weight_doc, PACK_WEIGHT_DOC);

PyObject *pack_weight(PyObject *self, PyObject *arg)
{
    (void)self;
    if (!PyArray_Check(arg) || PyArray_NDIM((PyArrayObject *)arg) != 2 ||
        (PyArray_TYPE((PyArrayObject *)arg) != NPY_FLOAT &&
         PyArray_TYPE((PyArrayObject *)arg) != NPY_DOUBLE)) {
        PyErr_SetString(PyExc_TypeError,
                        "w: expected a 2-D float32 or float64 ndarray");
        return NULL;
    }
    const int typenum = PyArray_TYPE((PyArrayObject *)arg);
    PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(
        arg, typenum, 2, 2, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
    if (a == NULL)
        return NULL;
    PyObject *cap = pack_core(a);
    Py_DECREF(a);
    return cap;
}

GLUE_DOC(packed_info_doc, PACKED_INFO_DOC);

PyObject *packed_info(PyObject *self, PyObject *cap)
{
    (void)self;
    const mha_packed *p = PyCapsule_IsValid(cap, PACKED_CAPSULE)
                              ? PyCapsule_GetPointer(cap, PACKED_CAPSULE)
                              : NULL;
    if (p == NULL) {
        PyErr_SetString(PyExc_TypeError, "packed: expected a pack_weight() capsule");
        return NULL;
    }
    const size_t bytes = p->elems * (p->f64 ? sizeof(double) : sizeof(float));
    return Py_BuildValue("(nnssn)", (Py_ssize_t)p->K, (Py_ssize_t)p->N,
                         mha_isa_name((mha_isa)p->isa), p->f64 ? "float64" : "float32",
                         (Py_ssize_t)bytes);
}

/* The packed argument of forward() and project(): None, or a tuple of n
   (forward: wq, wk, wv, wo) or at least n (project: wq, wk, wv, and a
   fourth that is ignored) entries, each None or a pack_weight() capsule of
   the dtype and shape of the weight at position wpos[i], which c->cfg then
   borrows (the caller's tuple keeps the capsules alive for the call). */
int read_packed(call *c, PyObject *t, const int *wpos, int n)
{
    if (t == Py_None)
        return 0;
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < n || PyTuple_GET_SIZE(t) > 4) {
        PyErr_Format(PyExc_TypeError, "packed: expected None or a tuple of %d "
                     "pack_weight() capsules or None", n);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        PyObject *cap = PyTuple_GET_ITEM(t, i);
        if (cap == Py_None)
            continue;
        const mha_packed *p = PyCapsule_IsValid(cap, PACKED_CAPSULE)
                                  ? PyCapsule_GetPointer(cap, PACKED_CAPSULE)
                                  : NULL;
        if (p == NULL) {
            PyErr_Format(PyExc_TypeError, "packed[%d]: expected a pack_weight() "
                         "capsule or None, got %s", i, Py_TYPE(cap)->tp_name);
            return -1;
        }
        PyArrayObject *w = c->in[wpos[i]];
        const int f64 = c->typenum == NPY_DOUBLE;
        if (w == NULL || p->f64 != f64 || (npy_intp)p->K != PyArray_DIM(w, 0) ||
            (npy_intp)p->N != PyArray_DIM(w, 1)) {
            static const char *const names[4] = {"wq", "wk", "wv", "wo"};
            if (w == NULL)
                PyErr_Format(PyExc_ValueError, "packed[%d]: given, but the call's %s "
                             "is None", i, names[i]);
            else
                PyErr_Format(PyExc_ValueError, "packed[%d]: packed from a (%zu, %zu) "
                             "%s weight, but the call's %s is (%zd, %zd) %s", i, p->K,
                             p->N, p->f64 ? "float64" : "float32", names[i],
                             (Py_ssize_t)PyArray_DIM(w, 0), (Py_ssize_t)PyArray_DIM(w, 1),
                             f64 ? "float64" : "float32");
            return -1;
        }
        c->cfg.packed[i] = p;
    }
    return 0;
}
