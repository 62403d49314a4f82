/*
 * mhattn_module.c - the CPython / NumPy glue of mhattn._C.
 *
 * This is the only file that includes Python.h and the NumPy headers. It
 * parses and converts the arguments, re-checks every shape and dtype the
 * core relies on, allocates the outputs, releases the GIL around the core
 * call and turns a core status into a Python exception. The friendly,
 * documented validation lives in the Python layer; this file must still
 * never crash whatever it is given, since _C can be imported alone.
 *
 * Letters: see mha.h.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define PY_ARRAY_UNIQUE_SYMBOL mhattn_ARRAY_API
#include <numpy/arrayobject.h>

#include <stdint.h>
#include <string.h>

#include "dispatch.h"
#include "mha.h"
#include "threads.h"

static const char *dtype_name(int typenum)
{
    return typenum == NPY_FLOAT ? "float32" : "float64";
}

/* A new tuple (d0, d1, ...) of nd sizes, for error messages. */
static PyObject *dims_tuple(int nd, const npy_intp *dims)
{
    PyObject *t = PyTuple_New(nd);
    if (t == NULL)
        return NULL;
    for (int d = 0; d < nd; d++) {
        PyObject *n = PyLong_FromSsize_t((Py_ssize_t)dims[d]);
        if (n == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, d, n);
    }
    return t;
}

/*
 * Raises ValueError "name: expected shape (..) letters, got (..)" and
 * returns -1 unless a has exactly the shape `want`.
 */
static int check_shape(PyArrayObject *a, const char *name, int nd,
                       const npy_intp *want, const char *letters)
{
    int same = PyArray_NDIM(a) == nd;
    for (int d = 0; same && d < nd; d++)
        same = PyArray_DIM(a, d) == want[d];
    if (same)
        return 0;
    PyObject *w = dims_tuple(nd, want);
    PyObject *g = dims_tuple(PyArray_NDIM(a), PyArray_DIMS(a));
    if (w != NULL && g != NULL)
        PyErr_Format(PyExc_ValueError, "%s: expected shape %R %s, got %R",
                     name, w, letters, g);
    Py_XDECREF(w);
    Py_XDECREF(g);
    return -1;
}

/* Puts "name: " in front of a pending TypeError / ValueError message. */
static void prefix_error(const char *name)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && (PyErr_GivenExceptionMatches(type, PyExc_TypeError) ||
                          PyErr_GivenExceptionMatches(type, PyExc_ValueError))) {
        PyErr_Format(type, "%s: %S", name, value);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
    } else {
        PyErr_Restore(type, value, tb);
    }
}

/*
 * *res = a C-contiguous, aligned, native copy or view of the float array
 * obj (dtype typenum, nd dimensions), or NULL for None when allow_none.
 * Returns -1 with an exception set on failure.
 */
static int as_float(PyArrayObject **res, PyObject *obj, const char *name,
                    int typenum, int nd, int allow_none)
{
    *res = NULL;
    if (obj == Py_None && allow_none)
        return 0;
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a numpy.ndarray%s, got %s",
                     name, allow_none ? " or None" : "", Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyArrayObject *a = (PyArrayObject *)obj;
    if (PyArray_TYPE(a) != typenum) {
        PyErr_Format(PyExc_TypeError,
                     "%s: expected dtype %s (the dtype of x), got %R", name,
                     dtype_name(typenum), (PyObject *)PyArray_DESCR(a));
        return -1;
    }
    if (PyArray_NDIM(a) != nd) {
        PyObject *g = dims_tuple(PyArray_NDIM(a), PyArray_DIMS(a));
        if (g != NULL)
            PyErr_Format(PyExc_ValueError,
                         "%s: expected a %d-D array, got shape %R", name, nd, g);
        Py_XDECREF(g);
        return -1;
    }
    // What PyArray_FROMANY would return unchanged, without its cost.
    if (PyArray_ISCARRAY_RO(a) && PyArray_ISNOTSWAPPED(a)) {
        Py_INCREF(a);
        *res = a;
        return 0;
    }
    *res = (PyArrayObject *)PyArray_FROMANY(obj, typenum, nd, nd,
                                            NPY_ARRAY_IN_ARRAY);
    if (*res == NULL) {
        prefix_error(name);
        return -1;
    }
    return 0;
}

/* *res = a 1-D C-contiguous copy or view of obj as typenum (int64 or
   float64), converted with NumPy's safe casting. */
static int as_vector(PyArrayObject **res, PyObject *obj, const char *name,
                     int typenum)
{
    if (PyArray_Check(obj)) {   // what PyArray_FROMANY would return unchanged
        PyArrayObject *a = (PyArrayObject *)obj;
        if (PyArray_TYPE(a) == typenum && PyArray_NDIM(a) == 1 &&
            PyArray_ISCARRAY_RO(a) && PyArray_ISNOTSWAPPED(a)) {
            Py_INCREF(a);
            *res = a;
            return 0;
        }
    }
    *res = (PyArrayObject *)PyArray_FROMANY(obj, typenum, 1, 1,
                                            NPY_ARRAY_IN_ARRAY);
    if (*res == NULL) {
        prefix_error(name);
        return -1;
    }
    return 0;
}

/* Turns a core status into a Python exception. */
static void raise_status(mha_status st)
{
    switch (st) {
    case MHA_ERR_NOMEM:
        PyErr_NoMemory();
        break;
    case MHA_ERR_SIZE:   // no buffer of these sizes can be allocated
        PyErr_SetString(PyExc_MemoryError,
                        "mhattn: the sizes of this call overflow size_t "
                        "(MHA_ERR_SIZE)");
        break;
    case MHA_ERR_INTERRUPTED:
        PyErr_SetNone(PyExc_KeyboardInterrupt);
        break;
    default:
        PyErr_Format(PyExc_ValueError,
                     "mhattn: inconsistent arguments (%s)", mha_status_name(st));
        break;
    }
}

#define DATA(a) ((a) != NULL ? PyArray_DATA(a) : NULL)

/*
 * Ctrl-C during a long call. Python's own SIGINT handler only sets a flag
 * that the interpreter reads between bytecodes, which never happens while
 * the core runs with the GIL released. So while the main thread is inside
 * the core, a C handler is installed that raises sigint_flag, which the
 * core polls between work items (cfg->interrupt), and then calls the
 * handler it replaced (Python's), so Python still sees the signal: after
 * the GIL is re-acquired PyErr_CheckSignals() runs the Python-level handler,
 * which raises KeyboardInterrupt by default. Only main-thread calls poll
 * the flag, since Python delivers KeyboardInterrupt to the main thread
 * alone; installs are counted under a mutex, so whichever call leaves last
 * restores the previous handler, exactly once. SIG_IGN and SIG_DFL are left
 * alone: ignored stays ignored, and the default ends the process anyway.
 */
#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#include <signal.h>

_Static_assert(_Generic((sig_atomic_t)0, int: 1, default: 0),
               "cfg->interrupt points to an int: sig_atomic_t must be int");

static volatile sig_atomic_t sigint_flag;
static struct sigaction sigint_prev;    // what our handler replaced
static int sigint_installs;             // guarded by sigint_lock
static int sigint_active;               // our handler is in place; ditto
static pthread_mutex_t sigint_lock = PTHREAD_MUTEX_INITIALIZER;

static void sigint_handler(int sig, siginfo_t *info, void *ctx)
{
    sigint_flag = 1;
    if (sigint_prev.sa_flags & SA_SIGINFO)
        sigint_prev.sa_sigaction(sig, info, ctx);
    else if (sigint_prev.sa_handler != SIG_DFL && sigint_prev.sa_handler != SIG_IGN)
        sigint_prev.sa_handler(sig);
}

static void sigint_install(void)
{
    pthread_mutex_lock(&sigint_lock);
    if (sigint_installs++ == 0) {
        struct sigaction cur, sa;
        // A flag left raised by an earlier call must not stop this one,
        // even when no handler is installed (SIG_IGN) to raise it again.
        sigint_flag = 0;
        sigint_active = 0;
        if (sigaction(SIGINT, NULL, &cur) == 0 &&
            ((cur.sa_flags & SA_SIGINFO) ||
             (cur.sa_handler != SIG_DFL && cur.sa_handler != SIG_IGN))) {
            memset(&sa, 0, sizeof sa);
            sa.sa_sigaction = sigint_handler;
            sa.sa_mask = cur.sa_mask;
            sa.sa_flags = SA_SIGINFO | (cur.sa_flags & (SA_ONSTACK | SA_RESTART));
            sigint_prev = cur;
            sigint_active = sigaction(SIGINT, &sa, NULL) == 0;
        }
    }
    pthread_mutex_unlock(&sigint_lock);
}

static void sigint_uninstall(void)
{
    pthread_mutex_lock(&sigint_lock);
    if (--sigint_installs == 0 && sigint_active) {
        struct sigaction cur;
        // Put the previous handler back unless someone replaced ours since.
        if (sigaction(SIGINT, NULL, &cur) == 0 && (cur.sa_flags & SA_SIGINFO) &&
            cur.sa_sigaction == sigint_handler)
            sigaction(SIGINT, &sigint_prev, NULL);
        sigint_active = 0;
    }
    pthread_mutex_unlock(&sigint_lock);
}

/* 1 when called from Python's main thread (the one signals are handled in). */
static int on_main_thread(void)
{
    int res = 0;
    PyObject *threading = PyImport_ImportModule("threading");
    PyObject *main = threading ? PyObject_CallMethod(threading, "main_thread", NULL)
                               : NULL;
    PyObject *ident = main ? PyObject_GetAttrString(main, "ident") : NULL;
    if (ident != NULL && ident != Py_None)
        res = PyLong_AsUnsignedLong(ident) == PyThread_get_thread_ident();
    Py_XDECREF(ident);
    Py_XDECREF(main);
    Py_XDECREF(threading);
    if (PyErr_Occurred())   // no interrupt support then, but never an error
        PyErr_Clear();
    return res;
}
#else  /* no sigaction: a long call finishes before Ctrl-C is seen */
static volatile int sigint_flag;
static void sigint_install(void) {}
static void sigint_uninstall(void) {}
static int on_main_thread(void) { return 0; }
#endif

/*
 * After a core call made with the GIL released, on the main thread: puts
 * Python's SIGINT handling back and runs any Python handler the signal
 * called for. -1 when that handler raised (the caller fails with its
 * exception), 1 when the core stopped early and the handler did not raise
 * (the caller starts the call over), else 0. Shared by forward and backward.
 */
static int sigint_after_call(int main_thread, mha_status st)
{
    if (!main_thread)
        return 0;
    const int signalled = sigint_flag != 0;
    sigint_uninstall();
    if (signalled || st == MHA_ERR_INTERRUPTED) {
        if (PyErr_CheckSignals() < 0)
            return -1;
        if (st == MHA_ERR_INTERRUPTED)
            return 1;
    }
    return 0;
}

/* Head widths dk, dv (G,) as size_t in *widths (2G, PyMem; dk then dv),
   checked against the H = len(scales) query heads, and the fused widths
   fused = {Sq, Sk, Sv, Svq} (see mha.h). -1 with an exception on failure. */
static int head_widths(size_t **widths, size_t fused[4], PyArrayObject *dk_a,
                       PyArrayObject *dv_a, npy_intp H)
{
    const npy_intp G = PyArray_DIM(dk_a, 0);
    if (G == 0 || H == 0 || H % G != 0) {
        PyErr_Format(PyExc_ValueError,
                     "dk, scales: the number of query heads H = len(scales) = %zd "
                     "must be a positive multiple of the number of kv heads "
                     "G = len(dk) = %zd", (Py_ssize_t)H, (Py_ssize_t)G);
        return -1;
    }
    if (PyArray_DIM(dv_a, 0) != G) {
        PyErr_Format(PyExc_ValueError,
                     "dv: expected length %zd (G = len(dk)), got %zd",
                     (Py_ssize_t)G, (Py_ssize_t)PyArray_DIM(dv_a, 0));
        return -1;
    }
    size_t *w = *widths = PyMem_Malloc(2 * (size_t)G * sizeof *w);
    if (w == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t *dk = w, *dv = w + G;
    const int64_t *dk64 = PyArray_DATA(dk_a), *dv64 = PyArray_DATA(dv_a);
    for (npy_intp g = 0; g < G; g++) {
        if (dk64[g] <= 0 || dv64[g] <= 0 || (uint64_t)dk64[g] > MHA_MAX_ELEMS ||
            (uint64_t)dv64[g] > MHA_MAX_ELEMS) {
            PyErr_Format(PyExc_ValueError,
                         "dk, dv: head widths must be between 1 and %zu, got "
                         "dk[%zd] = %lld, dv[%zd] = %lld", MHA_MAX_ELEMS,
                         (Py_ssize_t)g, (long long)dk64[g], (Py_ssize_t)g,
                         (long long)dv64[g]);
            return -1;
        }
        dk[g] = (size_t)dk64[g];
        dv[g] = (size_t)dv64[g];
    }
    // Sums checked as they grow: each stays below MHA_MAX_ELEMS.
    size_t Sq = 0, Sk = 0, Sv = 0, Svq = 0;
    for (npy_intp g = 0; g < G; g++) {
        Sk += dk[g];
        Sv += dv[g];
        if (Sk > MHA_MAX_ELEMS || Sv > MHA_MAX_ELEMS)
            goto overflow;
    }
    for (npy_intp h = 0; h < H; h++) {
        Sq += dk[h / (H / G)];
        Svq += dv[h / (H / G)];
        if (Sq > MHA_MAX_ELEMS || Svq > MHA_MAX_ELEMS)
            goto overflow;
    }
    fused[0] = Sq;
    fused[1] = Sk;
    fused[2] = Sv;
    fused[3] = Svq;
    return 0;
overflow:
    PyErr_SetString(PyExc_ValueError, "dk, dv: sizes overflow");
    return -1;
}

/* key_lengths: None (*res stays NULL) or int64 (B,), each in [0, Tk]. */
static int as_lengths(PyArrayObject **res, PyObject *obj, npy_intp B,
                      npy_intp Tk)
{
    *res = NULL;
    if (obj == Py_None)
        return 0;
    if (as_vector(res, obj, "key_lengths", NPY_INT64) < 0)
        return -1;
    const npy_intp want = B;
    if (check_shape(*res, "key_lengths", 1, &want, "(B,)") < 0)
        return -1;
    const int64_t *len = PyArray_DATA(*res);
    for (npy_intp b = 0; b < B; b++) {
        if (len[b] < 0 || len[b] > (int64_t)Tk) {
            PyErr_Format(PyExc_ValueError,
                         "key_lengths: expected 0 <= key_lengths[b] <= Tk = %zd, "
                         "got key_lengths[%zd] = %lld", (Py_ssize_t)Tk,
                         (Py_ssize_t)b, (long long)len[b]);
            return -1;
        }
    }
    return 0;
}

/* The mask of forward() and backward(): *mask is NULL for None, else a
   view (or aligned copy) of a bool or compute-dtype (B, H, Tq, Tk) array, with its
   element strides. Returns -1 with an exception set on failure. */
static int as_mask(PyArrayObject **mask, mha_mask_kind *kind,
                   ptrdiff_t stride[4], PyObject *mask_o, int typenum,
                   const npy_intp want[4])
{
    *mask = NULL;
    *kind = MHA_MASK_NONE;
    for (int d = 0; d < 4; d++)
        stride[d] = 0;
    if (mask_o == Py_None)
        return 0;
    if (!PyArray_Check(mask_o)) {
        PyErr_Format(PyExc_TypeError,
                     "mask: expected a numpy.ndarray or None, got %s",
                     Py_TYPE(mask_o)->tp_name);
        return -1;
    }
    const int mt = PyArray_TYPE((PyArrayObject *)mask_o);
    if (mt != NPY_BOOL && mt != typenum) {
        PyErr_Format(PyExc_TypeError,
                     "mask: expected dtype bool or %s (the dtype of x), got %R",
                     dtype_name(typenum),
                     (PyObject *)PyArray_DESCR((PyArrayObject *)mask_o));
        return -1;
    }
    if (check_shape((PyArrayObject *)mask_o, "mask", 4, want,
                    "(B, H, Tq, Tk)") < 0)
        return -1;
    PyArrayObject *m = (PyArrayObject *)PyArray_FROMANY(
        mask_o, mt, 4, 4, NPY_ARRAY_ALIGNED | NPY_ARRAY_NOTSWAPPED);
    if (m == NULL) {
        prefix_error("mask");
        return -1;
    }
    const npy_intp item = PyArray_ITEMSIZE(m);
    int copy = 0;
    for (int d = 0; d < 4; d++)
        copy |= PyArray_STRIDE(m, d) % item != 0;
    if (copy) {
        PyArrayObject *c = (PyArrayObject *)PyArray_NewCopy(m, NPY_CORDER);
        Py_DECREF(m);
        if (c == NULL)
            return -1;
        m = c;
    }
    for (int d = 0; d < 4; d++)
        stride[d] = (ptrdiff_t)(PyArray_STRIDE(m, d) / item);
    *kind = mt == NPY_BOOL ? MHA_MASK_BOOL : MHA_MASK_ADD;
    *mask = m;
    return 0;
}

/*
 * forward()'s mask may have fewer dimensions than (B, H, Tq, Tk), or sizes
 * of 1, as np.broadcast_to allows: *res = a new reference to mask_o itself
 * when it is not an array of at most 4 dimensions (as_mask then reports
 * it) or already has the shape want, else to a read-only view of shape want
 * with stride 0 along the broadcast dimensions. The values seen are those of
 * np.broadcast_to(mask_o, want), so the result is the same as for such a
 * view. -1 with ValueError when the shapes do not broadcast.
 */
static int broadcast_mask(PyObject **res, PyObject *mask_o, const npy_intp want[4])
{
    *res = NULL;
    if (!PyArray_Check(mask_o) || PyArray_NDIM((PyArrayObject *)mask_o) > 4) {
        Py_INCREF(mask_o);
        *res = mask_o;
        return 0;
    }
    PyArrayObject *m = (PyArrayObject *)mask_o;
    const int nd = PyArray_NDIM(m);
    npy_intp strides[4];
    int same = nd == 4;
    for (int d = 0; d < 4; d++) {
        const int md = d - (4 - nd);   // the mask's dimension aligned with d
        if (md < 0) {
            strides[d] = 0;
            continue;
        }
        const npy_intp n = PyArray_DIM(m, md);
        if (n == want[d]) {
            strides[d] = PyArray_STRIDE(m, md);
        } else if (n == 1) {
            strides[d] = 0;
            same = 0;
        } else {
            PyObject *w = dims_tuple(4, want);
            PyObject *g = dims_tuple(nd, PyArray_DIMS(m));
            if (w != NULL && g != NULL)
                PyErr_Format(PyExc_ValueError,
                             "mask: shape %R does not broadcast to (B, H, Tq, Tk) "
                             "= %R", g, w);
            Py_XDECREF(w);
            Py_XDECREF(g);
            return -1;
        }
    }
    if (same) {
        Py_INCREF(mask_o);
        *res = mask_o;
        return 0;
    }
    PyArray_Descr *descr = PyArray_DESCR(m);
    Py_INCREF(descr);   // stolen by PyArray_NewFromDescr
    PyObject *view = PyArray_NewFromDescr(&PyArray_Type, descr, 4, want, strides,
                                          PyArray_DATA(m), 0, NULL);
    if (view == NULL)
        return -1;
    Py_INCREF(mask_o);  // stolen by PyArray_SetBaseObject
    if (PyArray_SetBaseObject((PyArrayObject *)view, mask_o) < 0) {
        Py_DECREF(view);
        return -1;
    }
    *res = view;
    return 0;
}

PyDoc_STRVAR(forward_doc,
"forward(x, key, value, wq, wk, wv, wo, bq, bk, bv, bo, dk, dv, scales,\n"
"        mask, causal, key_lengths, want_weights, keep)\n"
"--\n\n"
"Multi-head attention forward pass (low level; see mhattn for the public\n"
"API). x (B,Tq,Din), key (B,Tk,Dkin), value (B,Tk,Dvin), wq (Din,Sq),\n"
"wk (Dkin,Sk), wv (Dvin,Sv), wo (Svq,Dout) or None, biases 1-D or None,\n"
"all of one dtype (float32 or float64). dk, dv: int64 (G,); scales:\n"
"float64 (H,); mask: None or bool or float, any strides, of shape\n"
"(B,H,Tq,Tk) or one that broadcasts to it;\n"
"key_lengths: None or int64 (B,).\n\n"
"Returns (out, weights or None, (q, k, v, concat, lse) or None).");

/* forward()'s arguments by keyword, with PyArg_ParseTupleAndKeywords. */
static int forward_parse_keywords(PyObject *const *argv, Py_ssize_t nargs,
                                  PyObject *kwnames, PyObject *o[17], int p[3])
{
    static char *kwlist[] = {
        "x", "key", "value", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo",
        "dk", "dv", "scales", "mask", "causal", "key_lengths", "want_weights",
        "keep", NULL};
    // The objects parsed stay alive in argv, which the caller owns.
    PyObject *args = PyTuple_New(nargs), *kwds = NULL;
    int ok = 0;
    if (args == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        Py_INCREF(argv[i]);
        PyTuple_SET_ITEM(args, i, argv[i]);
    }
    if (kwnames != NULL) {
        if ((kwds = PyDict_New()) == NULL)
            goto done;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++)
            if (PyDict_SetItem(kwds, PyTuple_GET_ITEM(kwnames, i),
                               argv[nargs + i]) < 0)
                goto done;
    }
    ok = PyArg_ParseTupleAndKeywords(
        args, kwds, "OOOOOOOOOOOOOOOpOpp:forward", kwlist, &o[0], &o[1],
        &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8], &o[9], &o[10], &o[11],
        &o[12], &o[13], &o[14], &p[0], &o[15], &p[1], &p[2]);
done:
    Py_DECREF(args);
    Py_XDECREF(kwds);
    return ok ? 0 : -1;
}

static PyObject *forward(PyObject *self, PyObject *const *argv, Py_ssize_t nargs,
                         PyObject *kwnames)
{
    (void)self;
    // o: the 16 object arguments in order, key_lengths last; p: causal,
    // want_weights, keep.
    PyObject *o[17];
    int p[3];
    if (kwnames == NULL && nargs == 19) {
        // All positional, as mhattn calls it: what "O...p" would parse,
        // without the cost of the general parser.
        for (int i = 0; i < 15; i++)
            o[i] = argv[i];
        o[15] = argv[16];
        if ((p[0] = PyObject_IsTrue(argv[15])) < 0 ||
            (p[1] = PyObject_IsTrue(argv[17])) < 0 ||
            (p[2] = PyObject_IsTrue(argv[18])) < 0)
            return NULL;
    } else if (forward_parse_keywords(argv, nargs, kwnames, o, p) < 0) {
        return NULL;
    }
    PyObject *x_o = o[0], *key_o = o[1], *value_o = o[2], *wq_o = o[3];
    PyObject *wk_o = o[4], *wv_o = o[5], *wo_o = o[6], *bq_o = o[7];
    PyObject *bk_o = o[8], *bv_o = o[9], *bo_o = o[10], *dk_o = o[11];
    PyObject *dv_o = o[12], *scales_o = o[13], *mask_o = o[14];
    PyObject *key_lengths_o = o[15];
    const int causal = p[0], want_weights = p[1], keep = p[2];

    PyObject *result = NULL;
    // inputs
    PyArrayObject *x = NULL, *key = NULL, *value = NULL;
    PyArrayObject *wq = NULL, *wk = NULL, *wv = NULL, *wo = NULL;
    PyArrayObject *bq = NULL, *bk = NULL, *bv = NULL, *bo = NULL;
    PyArrayObject *dk_a = NULL, *dv_a = NULL, *scales = NULL, *mask = NULL;
    PyArrayObject *key_lengths = NULL;
    // outputs
    PyArrayObject *out = NULL, *weights = NULL, *q = NULL, *k = NULL;
    PyArrayObject *v = NULL, *concat = NULL, *lse = NULL;
    size_t *widths = NULL;   // (2G,): dk then dv, as size_t
    size_t fused[4];         // Sq, Sk, Sv, Svq

    // The dtype of x is the compute dtype.
    if (!PyArray_Check(x_o)) {
        PyErr_Format(PyExc_TypeError, "x: expected a numpy.ndarray, got %s",
                     Py_TYPE(x_o)->tp_name);
        goto fail;
    }
    const int typenum = PyArray_TYPE((PyArrayObject *)x_o);
    if (typenum != NPY_FLOAT && typenum != NPY_DOUBLE) {
        PyErr_Format(PyExc_TypeError,
                     "x: expected dtype float32 or float64, got %R",
                     (PyObject *)PyArray_DESCR((PyArrayObject *)x_o));
        goto fail;
    }
    if (as_float(&x, x_o, "x", typenum, 3, 0) < 0 ||
        as_float(&key, key_o, "key", typenum, 3, 0) < 0 ||
        as_float(&value, value_o, "value", typenum, 3, 0) < 0 ||
        as_float(&wq, wq_o, "wq", typenum, 2, 0) < 0 ||
        as_float(&wk, wk_o, "wk", typenum, 2, 0) < 0 ||
        as_float(&wv, wv_o, "wv", typenum, 2, 0) < 0 ||
        as_float(&wo, wo_o, "wo", typenum, 2, 1) < 0 ||
        as_float(&bq, bq_o, "bq", typenum, 1, 1) < 0 ||
        as_float(&bk, bk_o, "bk", typenum, 1, 1) < 0 ||
        as_float(&bv, bv_o, "bv", typenum, 1, 1) < 0 ||
        as_float(&bo, bo_o, "bo", typenum, 1, 1) < 0 ||
        as_vector(&dk_a, dk_o, "dk", NPY_INT64) < 0 ||
        as_vector(&dv_a, dv_o, "dv", NPY_INT64) < 0 ||
        as_vector(&scales, scales_o, "scales", NPY_DOUBLE) < 0)
        goto fail;

    // Sizes from x, key, value, dk and scales.
    const npy_intp B = PyArray_DIM(x, 0), Tq = PyArray_DIM(x, 1);
    const npy_intp Din = PyArray_DIM(x, 2);
    const npy_intp Tk = PyArray_DIM(key, 1), Dkin = PyArray_DIM(key, 2);
    const npy_intp Dvin = PyArray_DIM(value, 2);
    const npy_intp G = PyArray_DIM(dk_a, 0), H = PyArray_DIM(scales, 0);
    {
        const npy_intp want_key[3] = {B, Tk, Dkin};
        const npy_intp want_value[3] = {B, Tk, Dvin};
        if (check_shape(key, "key", 3, want_key, "(B, Tk, Dkin)") < 0 ||
            check_shape(value, "value", 3, want_value, "(B, Tk, Dvin)") < 0)
            goto fail;
    }
    if (head_widths(&widths, fused, dk_a, dv_a, H) < 0)
        goto fail;
    size_t *dk = widths, *dv = widths + G;
    const size_t Sq = fused[0], Sk = fused[1], Sv = fused[2], Svq = fused[3];

    // Weights and biases against the fused widths.
    const npy_intp Dout = wo != NULL ? PyArray_DIM(wo, 1) : (npy_intp)Svq;
    {
        const npy_intp want_wq[2] = {Din, (npy_intp)Sq};
        const npy_intp want_wk[2] = {Dkin, (npy_intp)Sk};
        const npy_intp want_wv[2] = {Dvin, (npy_intp)Sv};
        const npy_intp want_wo[2] = {(npy_intp)Svq, Dout};
        const npy_intp want_bq = (npy_intp)Sq, want_bk = (npy_intp)Sk;
        const npy_intp want_bv = (npy_intp)Sv, want_bo = Dout;
        if (check_shape(wq, "wq", 2, want_wq, "(Din, Sq)") < 0 ||
            check_shape(wk, "wk", 2, want_wk, "(Dkin, Sk)") < 0 ||
            check_shape(wv, "wv", 2, want_wv, "(Dvin, Sv)") < 0 ||
            (wo && check_shape(wo, "wo", 2, want_wo, "(Svq, Dout)") < 0) ||
            (bq && check_shape(bq, "bq", 1, &want_bq, "(Sq,)") < 0) ||
            (bk && check_shape(bk, "bk", 1, &want_bk, "(Sk,)") < 0) ||
            (bv && check_shape(bv, "bv", 1, &want_bv, "(Sv,)") < 0) ||
            (bo && check_shape(bo, "bo", 1, &want_bo, "(Dout,)") < 0))
            goto fail;
    }

    if (as_lengths(&key_lengths, key_lengths_o, B, Tk) < 0)
        goto fail;

    mha_mask_kind mask_kind;
    ptrdiff_t mask_stride[4];
    {
        const npy_intp want[4] = {B, H, Tq, Tk};
        PyObject *mask_b;
        if (broadcast_mask(&mask_b, mask_o, want) < 0)
            goto fail;
        const int bad = as_mask(&mask, &mask_kind, mask_stride, mask_b, typenum, want);
        Py_DECREF(mask_b);
        if (bad < 0)
            goto fail;
    }

    mha_config cfg = {
        .B = (size_t)B, .Tq = (size_t)Tq, .Tk = (size_t)Tk,
        .Din = (size_t)Din, .Dkin = (size_t)Dkin, .Dvin = (size_t)Dvin,
        .Dout = (size_t)Dout, .H = (size_t)H, .G = (size_t)G,
        .dk = dk, .dv = dv, .scale = PyArray_DATA(scales),
        .causal = causal, .mask_kind = mask_kind, .mask = DATA(mask),
        .mask_stride = {mask_stride[0], mask_stride[1], mask_stride[2],
                        mask_stride[3]},
        .key_lengths = key_lengths ? PyArray_DATA(key_lengths) : NULL,
        .has_wo = wo != NULL, .interrupt = NULL,
    };
    mha_layout lay;
    mha_status st = mha_check_config(&lay, &cfg);
    if (st != MHA_OK) {
        raise_status(st);
        goto fail;
    }

    // Outputs, new C-contiguous arrays (sizes checked by mha_check_config).
    {
        const npy_intp d_out[3] = {B, Tq, Dout};
        const npy_intp d_w[4] = {B, H, Tq, Tk};
        const npy_intp d_q[3] = {B, Tq, (npy_intp)Sq};
        const npy_intp d_k[3] = {B, Tk, (npy_intp)Sk};
        const npy_intp d_v[3] = {B, Tk, (npy_intp)Sv};
        const npy_intp d_c[3] = {B, Tq, (npy_intp)Svq};
        const npy_intp d_l[3] = {B, H, Tq};
        if ((out = (PyArrayObject *)PyArray_EMPTY(3, d_out, typenum, 0)) == NULL)
            goto fail;
        if (want_weights &&
            (weights = (PyArrayObject *)PyArray_EMPTY(4, d_w, typenum, 0)) == NULL)
            goto fail;
        if (keep &&
            ((q = (PyArrayObject *)PyArray_EMPTY(3, d_q, typenum, 0)) == NULL ||
             (k = (PyArrayObject *)PyArray_EMPTY(3, d_k, typenum, 0)) == NULL ||
             (v = (PyArrayObject *)PyArray_EMPTY(3, d_v, typenum, 0)) == NULL ||
             (concat = (PyArrayObject *)PyArray_EMPTY(3, d_c, typenum, 0)) == NULL ||
             (lse = (PyArrayObject *)PyArray_EMPTY(3, d_l, typenum, 0)) == NULL))
            goto fail;
    }

    // Ctrl-C: see sigint_handler. A Python handler that does not raise lets
    // the call start over, as if the signal had come just before it. A small
    // call (at most MHA_SMALL_WORK multiply-adds: tens of microseconds) is not
    // worth the handler's two sigaction system calls, nor the look-up of the
    // main thread: Python sees a signal that comes during it as soon as it
    // returns, as if the signal had come just after it.
    const double work =
        (double)B * ((double)Tq * ((double)Din * (double)Sq +
                                   (double)Svq * (double)Dout) +
                     (double)Tk * ((double)Dkin * (double)Sk +
                                   (double)Dvin * (double)Sv) +
                     (double)Tq * (double)Tk * (double)(Sq + Svq));
    const int main_thread = work > MHA_SMALL_WORK && on_main_thread();
retry:
    if (main_thread) {
        sigint_install();
        cfg.interrupt = (volatile const int *)&sigint_flag;
    }
    Py_BEGIN_ALLOW_THREADS
    if (typenum == NPY_FLOAT)
        st = mha_forward_f32(DATA(out), DATA(weights), DATA(q), DATA(k),
                             DATA(v), DATA(concat), DATA(lse), DATA(x),
                             DATA(key), DATA(value), DATA(wq), DATA(wk),
                             DATA(wv), DATA(wo), DATA(bq), DATA(bk), DATA(bv),
                             DATA(bo), &cfg);
    else
        st = mha_forward_f64(DATA(out), DATA(weights), DATA(q), DATA(k),
                             DATA(v), DATA(concat), DATA(lse), DATA(x),
                             DATA(key), DATA(value), DATA(wq), DATA(wk),
                             DATA(wv), DATA(wo), DATA(bq), DATA(bk), DATA(bv),
                             DATA(bo), &cfg);
    Py_END_ALLOW_THREADS
    switch (sigint_after_call(main_thread, st)) {
    case -1: goto fail;
    case 1: goto retry;
    default: break;
    }
    if (st != MHA_OK) {
        raise_status(st);
        goto fail;
    }

    {
        PyObject *extras = Py_None;
        Py_INCREF(extras);
        if (keep) {
            Py_DECREF(extras);
            extras = PyTuple_Pack(5, q, k, v, concat, lse);
            if (extras == NULL)
                goto fail;
        }
        result = PyTuple_Pack(3, (PyObject *)out,
                              weights ? (PyObject *)weights : Py_None, extras);
        Py_DECREF(extras);
    }
    goto fail;   // success falls through the common cleanup with result set

fail:
    PyMem_Free(widths);
    Py_XDECREF(x);
    Py_XDECREF(key);
    Py_XDECREF(value);
    Py_XDECREF(wq);
    Py_XDECREF(wk);
    Py_XDECREF(wv);
    Py_XDECREF(wo);
    Py_XDECREF(bq);
    Py_XDECREF(bk);
    Py_XDECREF(bv);
    Py_XDECREF(bo);
    Py_XDECREF(dk_a);
    Py_XDECREF(dv_a);
    Py_XDECREF(scales);
    Py_XDECREF(mask);
    Py_XDECREF(key_lengths);
    Py_XDECREF(out);
    Py_XDECREF(weights);
    Py_XDECREF(q);
    Py_XDECREF(k);
    Py_XDECREF(v);
    Py_XDECREF(concat);
    Py_XDECREF(lse);
    return result;
}

PyDoc_STRVAR(get_isa_doc,
"get_isa()\n"
"--\n\n"
"The instruction set of the kernels now in force: 'avx512', 'avx2' or\n"
"'scalar' (detected once, capped by MHATTN_ISA or set_isa).");

static PyObject *get_isa(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyUnicode_FromString(mha_isa_name(mha_get_isa()));
}

PyDoc_STRVAR(set_isa_doc,
"set_isa(name)\n"
"--\n\n"
"Caps the instruction set at name ('scalar', 'avx2' or 'avx512'), lowered\n"
"to what this CPU supports; for tests. Returns the ISA now in force.");

static PyObject *set_isa(PyObject *self, PyObject *name)
{
    (void)self;
    static const mha_isa all[] = {MHA_ISA_SCALAR, MHA_ISA_AVX2, MHA_ISA_AVX512};
    if (!PyUnicode_Check(name)) {
        PyErr_Format(PyExc_TypeError, "name: expected a str, got %s",
                     Py_TYPE(name)->tp_name);
        return NULL;
    }
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        if (PyUnicode_CompareWithASCIIString(name, mha_isa_name(all[i])) == 0)
            return PyUnicode_FromString(
                mha_isa_name((mha_isa)mha_set_isa(all[i])));
    }
    PyErr_Format(PyExc_ValueError,
                 "name: expected 'scalar', 'avx2' or 'avx512', got %R", name);
    return NULL;
}

PyDoc_STRVAR(get_num_threads_doc,
"get_num_threads()\n"
"--\n\n"
"The number of threads the core uses.");

static PyObject *get_num_threads(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyLong_FromLong(mha_get_num_threads());
}

PyDoc_STRVAR(set_num_threads_doc,
"set_num_threads(n)\n"
"--\n\n"
"Uses n threads from the next call on (at most 256); 0 restores the\n"
"default (MHATTN_NUM_THREADS, else the CPUs this process may use).");

/* ---- backward ---------------------------------------------------------- */

/* A new C-contiguous array of the compute dtype, or NULL with an exception
   set; *res stays NULL (and nothing is allocated) when !wanted. */
static int bwd_empty(PyArrayObject **res, int wanted, int nd,
                     const npy_intp *dims, int typenum)
{
    *res = NULL;
    if (!wanted)
        return 0;
    *res = (PyArrayObject *)PyArray_EMPTY(nd, dims, typenum, 0);
    return *res == NULL ? -1 : 0;
}

PyDoc_STRVAR(backward_doc,
"backward(dout, x, key, value, wq, wk, wv, wo, q, k, v, concat, lse, dk, dv,\n"
"         scales, mask, causal, key_lengths, want_bq, want_bk, want_bv,\n"
"         want_bo)\n"
"--\n\n"
"Backward pass of forward() (low level; see mhattn.backward). dout\n"
"(B,Tq,Dout); x, key, value, wq, wk, wv, wo, dk, dv, scales, mask, causal,\n"
"key_lengths as given to forward(), except that key None means key is x and\n"
"value None means value is key (or x): their gradients are then added into\n"
"x's (key's). q, k, v, concat, lse: forward()'s kept extras.\n\n"
"Returns (dx, dkey or None, dvalue or None, dwq, dwk, dwv, dwo or None,\n"
"dbq, dbk, dbv, dbo), each bias gradient None unless its want_* is true.");

static PyObject *backward(PyObject *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    static char *kwlist[] = {
        "dout", "x", "key", "value", "wq", "wk", "wv", "wo", "q", "k", "v",
        "concat", "lse", "dk", "dv", "scales", "mask", "causal", "key_lengths",
        "want_bq", "want_bk", "want_bv", "want_bo", NULL};
    PyObject *dout_o, *x_o, *key_o, *value_o, *wq_o, *wk_o, *wv_o, *wo_o;
    PyObject *q_o, *k_o, *v_o, *concat_o, *lse_o, *dk_o, *dv_o, *scales_o;
    PyObject *mask_o, *key_lengths_o;
    int causal, want_bq, want_bk, want_bv, want_bo;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwds, "OOOOOOOOOOOOOOOOOpOpppp:backward", kwlist, &dout_o,
            &x_o, &key_o, &value_o, &wq_o, &wk_o, &wv_o, &wo_o, &q_o, &k_o,
            &v_o, &concat_o, &lse_o, &dk_o, &dv_o, &scales_o, &mask_o, &causal,
            &key_lengths_o, &want_bq, &want_bk, &want_bv, &want_bo))
        return NULL;

    PyObject *result = NULL;
    // inputs
    PyArrayObject *dout = NULL, *x = NULL, *key = NULL, *value = NULL;
    PyArrayObject *wq = NULL, *wk = NULL, *wv = NULL, *wo = NULL;
    PyArrayObject *q = NULL, *k = NULL, *v = NULL, *concat = NULL, *lse = NULL;
    PyArrayObject *dk_a = NULL, *dv_a = NULL, *scales = NULL, *mask = NULL;
    PyArrayObject *key_lengths = NULL;
    // outputs
    PyArrayObject *dx = NULL, *dkey = NULL, *dvalue = NULL;
    PyArrayObject *dwq = NULL, *dwk = NULL, *dwv = NULL, *dwo = NULL;
    PyArrayObject *dbq = NULL, *dbk = NULL, *dbv = NULL, *dbo = NULL;
    size_t *widths = NULL;   // (2G,): dk then dv, as size_t
    size_t fused[4];         // Sq, Sk, Sv, Svq

    if (!PyArray_Check(x_o)) {
        PyErr_Format(PyExc_TypeError, "x: expected a numpy.ndarray, got %s",
                     Py_TYPE(x_o)->tp_name);
        goto fail;
    }
    const int typenum = PyArray_TYPE((PyArrayObject *)x_o);
    if (typenum != NPY_FLOAT && typenum != NPY_DOUBLE) {
        PyErr_Format(PyExc_TypeError,
                     "x: expected dtype float32 or float64, got %R",
                     (PyObject *)PyArray_DESCR((PyArrayObject *)x_o));
        goto fail;
    }
    // key None: key is x; value None: value is key.
    const int key_is_x = key_o == Py_None, value_is_key = value_o == Py_None;
    if (as_float(&dout, dout_o, "dout", typenum, 3, 0) < 0 ||
        as_float(&x, x_o, "x", typenum, 3, 0) < 0 ||
        as_float(&key, key_o, "key", typenum, 3, 1) < 0 ||
        as_float(&value, value_o, "value", typenum, 3, 1) < 0 ||
        as_float(&wq, wq_o, "wq", typenum, 2, 0) < 0 ||
        as_float(&wk, wk_o, "wk", typenum, 2, 0) < 0 ||
        as_float(&wv, wv_o, "wv", typenum, 2, 0) < 0 ||
        as_float(&wo, wo_o, "wo", typenum, 2, 1) < 0 ||
        as_float(&q, q_o, "q", typenum, 3, 0) < 0 ||
        as_float(&k, k_o, "k", typenum, 3, 0) < 0 ||
        as_float(&v, v_o, "v", typenum, 3, 0) < 0 ||
        as_float(&concat, concat_o, "concat", typenum, 3, 0) < 0 ||
        as_float(&lse, lse_o, "lse", typenum, 3, 0) < 0 ||
        as_vector(&dk_a, dk_o, "dk", NPY_INT64) < 0 ||
        as_vector(&dv_a, dv_o, "dv", NPY_INT64) < 0 ||
        as_vector(&scales, scales_o, "scales", NPY_DOUBLE) < 0)
        goto fail;
    if (key_is_x) {
        Py_INCREF(x);
        key = x;
    }
    if (value_is_key) {
        Py_INCREF(key);
        value = key;
    }

    // Sizes from x, key, value, dk and scales.
    const npy_intp B = PyArray_DIM(x, 0), Tq = PyArray_DIM(x, 1);
    const npy_intp Din = PyArray_DIM(x, 2);
    const npy_intp Tk = PyArray_DIM(key, 1), Dkin = PyArray_DIM(key, 2);
    const npy_intp Dvin = PyArray_DIM(value, 2);
    const npy_intp G = PyArray_DIM(dk_a, 0), H = PyArray_DIM(scales, 0);
    {
        const npy_intp want_key[3] = {B, Tk, Dkin};
        const npy_intp want_value[3] = {B, Tk, Dvin};
        if (check_shape(key, "key", 3, want_key, "(B, Tk, Dkin)") < 0 ||
            check_shape(value, "value", 3, want_value, "(B, Tk, Dvin)") < 0)
            goto fail;
    }
    if (head_widths(&widths, fused, dk_a, dv_a, H) < 0)
        goto fail;
    size_t *dkw = widths, *dvw = widths + G;
    const size_t Sq = fused[0], Sk = fused[1], Sv = fused[2], Svq = fused[3];

    // Weights, gradient of the output and the forward's extras.
    const npy_intp Dout = wo != NULL ? PyArray_DIM(wo, 1) : (npy_intp)Svq;
    {
        const npy_intp want_wq[2] = {Din, (npy_intp)Sq};
        const npy_intp want_wk[2] = {Dkin, (npy_intp)Sk};
        const npy_intp want_wv[2] = {Dvin, (npy_intp)Sv};
        const npy_intp want_wo[2] = {(npy_intp)Svq, Dout};
        const npy_intp want_dout[3] = {B, Tq, Dout};
        const npy_intp want_q[3] = {B, Tq, (npy_intp)Sq};
        const npy_intp want_k[3] = {B, Tk, (npy_intp)Sk};
        const npy_intp want_v[3] = {B, Tk, (npy_intp)Sv};
        const npy_intp want_c[3] = {B, Tq, (npy_intp)Svq};
        const npy_intp want_l[3] = {B, H, Tq};
        if (check_shape(wq, "wq", 2, want_wq, "(Din, Sq)") < 0 ||
            check_shape(wk, "wk", 2, want_wk, "(Dkin, Sk)") < 0 ||
            check_shape(wv, "wv", 2, want_wv, "(Dvin, Sv)") < 0 ||
            (wo && check_shape(wo, "wo", 2, want_wo, "(Svq, Dout)") < 0) ||
            check_shape(dout, "dout", 3, want_dout, "(B, Tq, Dout)") < 0 ||
            check_shape(q, "q", 3, want_q, "(B, Tq, Sq)") < 0 ||
            check_shape(k, "k", 3, want_k, "(B, Tk, Sk)") < 0 ||
            check_shape(v, "v", 3, want_v, "(B, Tk, Sv)") < 0 ||
            check_shape(concat, "concat", 3, want_c, "(B, Tq, Svq)") < 0 ||
            check_shape(lse, "lse", 3, want_l, "(B, H, Tq)") < 0)
            goto fail;
    }

    if (as_lengths(&key_lengths, key_lengths_o, B, Tk) < 0)
        goto fail;

    mha_mask_kind mask_kind;
    ptrdiff_t mask_stride[4];
    {
        const npy_intp want[4] = {B, H, Tq, Tk};
        if (as_mask(&mask, &mask_kind, mask_stride, mask_o, typenum, want) < 0)
            goto fail;
    }

    mha_config cfg = {
        .B = (size_t)B, .Tq = (size_t)Tq, .Tk = (size_t)Tk,
        .Din = (size_t)Din, .Dkin = (size_t)Dkin, .Dvin = (size_t)Dvin,
        .Dout = (size_t)Dout, .H = (size_t)H, .G = (size_t)G,
        .dk = dkw, .dv = dvw, .scale = PyArray_DATA(scales),
        .causal = causal, .mask_kind = mask_kind, .mask = DATA(mask),
        .mask_stride = {mask_stride[0], mask_stride[1], mask_stride[2],
                        mask_stride[3]},
        .key_lengths = key_lengths ? PyArray_DATA(key_lengths) : NULL,
        .has_wo = wo != NULL, .interrupt = NULL,
    };
    mha_layout lay;
    mha_status st = mha_check_config(&lay, &cfg);
    if (st != MHA_OK) {
        raise_status(st);
        goto fail;
    }

    // Gradients, new C-contiguous arrays (sizes checked by mha_check_config).
    {
        const npy_intp d_x[3] = {B, Tq, Din}, d_key[3] = {B, Tk, Dkin};
        const npy_intp d_value[3] = {B, Tk, Dvin};
        const npy_intp d_wq[2] = {Din, (npy_intp)Sq};
        const npy_intp d_wk[2] = {Dkin, (npy_intp)Sk};
        const npy_intp d_wv[2] = {Dvin, (npy_intp)Sv};
        const npy_intp d_wo[2] = {(npy_intp)Svq, Dout};
        const npy_intp d_bq = (npy_intp)Sq, d_bk = (npy_intp)Sk;
        const npy_intp d_bv = (npy_intp)Sv, d_bo = Dout;
        if (bwd_empty(&dx, 1, 3, d_x, typenum) < 0 ||
            bwd_empty(&dkey, !key_is_x, 3, d_key, typenum) < 0 ||
            bwd_empty(&dvalue, !value_is_key, 3, d_value, typenum) < 0 ||
            bwd_empty(&dwq, 1, 2, d_wq, typenum) < 0 ||
            bwd_empty(&dwk, 1, 2, d_wk, typenum) < 0 ||
            bwd_empty(&dwv, 1, 2, d_wv, typenum) < 0 ||
            bwd_empty(&dwo, wo != NULL, 2, d_wo, typenum) < 0 ||
            bwd_empty(&dbq, want_bq, 1, &d_bq, typenum) < 0 ||
            bwd_empty(&dbk, want_bk, 1, &d_bk, typenum) < 0 ||
            bwd_empty(&dbv, want_bv, 1, &d_bv, typenum) < 0 ||
            bwd_empty(&dbo, want_bo, 1, &d_bo, typenum) < 0)
            goto fail;
    }
    // A role fed by another input adds into that input's gradient.
    void *dkey_p = key_is_x ? DATA(dx) : DATA(dkey);
    void *dvalue_p = value_is_key ? dkey_p : DATA(dvalue);

    // Ctrl-C: as in forward (see sigint_handler). A Python handler that
    // does not raise lets the call start over; every gradient is
    // overwritten, so a partial run leaves no trace.
    const int main_thread = on_main_thread();
retry:
    if (main_thread) {
        sigint_install();
        cfg.interrupt = (volatile const int *)&sigint_flag;
    }
    Py_BEGIN_ALLOW_THREADS
    if (typenum == NPY_FLOAT)
        st = mha_backward_f32(DATA(dx), dkey_p, dvalue_p, DATA(dwq), DATA(dwk),
                              DATA(dwv), DATA(dwo), DATA(dbq), DATA(dbk),
                              DATA(dbv), DATA(dbo), DATA(dout), DATA(x),
                              DATA(key), DATA(value), DATA(wq), DATA(wk),
                              DATA(wv), DATA(wo), DATA(q), DATA(k), DATA(v),
                              DATA(concat), DATA(lse), &cfg);
    else
        st = mha_backward_f64(DATA(dx), dkey_p, dvalue_p, DATA(dwq), DATA(dwk),
                              DATA(dwv), DATA(dwo), DATA(dbq), DATA(dbk),
                              DATA(dbv), DATA(dbo), DATA(dout), DATA(x),
                              DATA(key), DATA(value), DATA(wq), DATA(wk),
                              DATA(wv), DATA(wo), DATA(q), DATA(k), DATA(v),
                              DATA(concat), DATA(lse), &cfg);
    Py_END_ALLOW_THREADS
    switch (sigint_after_call(main_thread, st)) {
    case -1: goto fail;
    case 1: goto retry;
    default: break;
    }
    if (st != MHA_OK) {
        raise_status(st);
        goto fail;
    }

    {
        PyObject *items[11] = {
            (PyObject *)dx, (PyObject *)dkey, (PyObject *)dvalue,
            (PyObject *)dwq, (PyObject *)dwk, (PyObject *)dwv, (PyObject *)dwo,
            (PyObject *)dbq, (PyObject *)dbk, (PyObject *)dbv, (PyObject *)dbo};
        result = PyTuple_New(11);
        if (result == NULL)
            goto fail;
        for (int t = 0; t < 11; t++) {
            PyObject *o = items[t] != NULL ? items[t] : Py_None;
            Py_INCREF(o);
            PyTuple_SET_ITEM(result, t, o);
        }
    }
    goto fail;   // success falls through the common cleanup with result set

fail:
    PyMem_Free(widths);
    Py_XDECREF(dout);
    Py_XDECREF(x);
    Py_XDECREF(key);
    Py_XDECREF(value);
    Py_XDECREF(wq);
    Py_XDECREF(wk);
    Py_XDECREF(wv);
    Py_XDECREF(wo);
    Py_XDECREF(q);
    Py_XDECREF(k);
    Py_XDECREF(v);
    Py_XDECREF(concat);
    Py_XDECREF(lse);
    Py_XDECREF(dk_a);
    Py_XDECREF(dv_a);
    Py_XDECREF(scales);
    Py_XDECREF(mask);
    Py_XDECREF(key_lengths);
    Py_XDECREF(dx);
    Py_XDECREF(dkey);
    Py_XDECREF(dvalue);
    Py_XDECREF(dwq);
    Py_XDECREF(dwk);
    Py_XDECREF(dwv);
    Py_XDECREF(dwo);
    Py_XDECREF(dbq);
    Py_XDECREF(dbk);
    Py_XDECREF(dbv);
    Py_XDECREF(dbo);
    return result;
}

static PyObject *set_num_threads(PyObject *self, PyObject *arg)
{
    (void)self;
    const long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError,
                     "n: expected a thread count >= 0, got %ld", n);
        return NULL;
    }
    mha_set_num_threads(n > MHA_MAX_THREADS ? MHA_MAX_THREADS : (int)n);
    Py_RETURN_NONE;
}

static PyMethodDef mhattn_methods[] = {
    {"forward", (PyCFunction)(void (*)(void))forward,
     METH_FASTCALL | METH_KEYWORDS, forward_doc},
    {"get_isa", get_isa, METH_NOARGS, get_isa_doc},
    {"set_isa", set_isa, METH_O, set_isa_doc},
    {"get_num_threads", get_num_threads, METH_NOARGS, get_num_threads_doc},
    {"set_num_threads", set_num_threads, METH_O, set_num_threads_doc},
    {"backward", (PyCFunction)(void (*)(void))backward,
     METH_VARARGS | METH_KEYWORDS, backward_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef mhattn_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mhattn._C",
    .m_doc = "C core of mhattn (multi-head attention).",
    .m_size = -1,
    .m_methods = mhattn_methods,
};

PyMODINIT_FUNC PyInit__C(void)
{
    import_array();
    return PyModule_Create(&mhattn_module);
}
