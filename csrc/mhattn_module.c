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

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "dispatch.h"
#include "mha.h"
#include "platform.h"
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

/* 1 when a has exactly the shape want (nd,). */
static int same_shape(PyArrayObject *a, int nd, const npy_intp *want)
{
    int same = PyArray_NDIM(a) == nd;
    for (int d = 0; same && d < nd; d++)
        same = PyArray_DIM(a, d) == want[d];
    return same;
}

/*
 * Raises ValueError "name: expected shape (..) letters, got (..)" and
 * returns -1 unless a has exactly the shape `want`.
 */
static int check_shape(PyArrayObject *a, const char *name, int nd,
                       const npy_intp *want, const char *letters)
{
    if (same_shape(a, nd, want))
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
 * *res = obj converted by PyArray_FROMANY to a C-contiguous, aligned,
 * native array of dtype typenum and nd dimensions; obj itself (a new
 * reference) when it is one already, which is what PyArray_FROMANY would
 * return, without its cost. Returns -1 with an exception naming the
 * argument on failure.
 */
static int as_c_array(PyArrayObject **res, PyObject *obj, const char *name,
                      int typenum, int nd)
{
    if (PyArray_Check(obj)) {
        PyArrayObject *a = (PyArrayObject *)obj;
        if (PyArray_TYPE(a) == typenum && PyArray_NDIM(a) == nd &&
            PyArray_ISCARRAY_RO(a) && PyArray_ISNOTSWAPPED(a)) {
            Py_INCREF(a);
            *res = a;
            return 0;
        }
    }
    *res = (PyArrayObject *)PyArray_FROMANY(obj, typenum, nd, nd,
                                            NPY_ARRAY_IN_ARRAY);
    if (*res == NULL) {
        prefix_error(name);
        return -1;
    }
    return 0;
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
    return as_c_array(res, obj, name, typenum, nd);
}

/* *res = a 1-D C-contiguous copy or view of obj as typenum (int64 or
   float64), converted with NumPy's safe casting. */
static int as_vector(PyArrayObject **res, PyObject *obj, const char *name,
                     int typenum)
{
    return as_c_array(res, obj, name, typenum, 1);
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

/* Turns a rejection by the core's config check into a Python exception:
   MHA_ERR_ARG is the ValueError of the core's message, which names the
   rule and the values seen (mha_error); the other statuses as above. */
static void raise_check(mha_status st, const mha_error *err)
{
    if (st == MHA_ERR_ARG && err->msg[0] != '\0')
        PyErr_Format(PyExc_ValueError, "mhattn: %s", err->msg);
    else
        raise_status(st);
}

#define DATA(a) ((a) != NULL ? PyArray_DATA(a) : NULL)

/* The element type of a call's arrays (NPY_FLOAT or NPY_DOUBLE). */
#define DTYPE_OF(typenum) ((typenum) == NPY_FLOAT ? MHA_DTYPE_F32 : MHA_DTYPE_F64)

/*
 * Ctrl-C during a long call. Python's own SIGINT handler only sets a flag
 * that the interpreter reads between bytecodes, which never happens while
 * the core runs with the GIL released. So while the main thread is inside
 * the core, the platform layer's handler is installed (mha_sigint_install,
 * csrc/core/platform.c: a SIGINT handler chained to Python's on POSIX, a
 * console control handler ahead of the C runtime's on Windows). It raises
 * the flag the core polls between work items (cfg->interrupt) and lets
 * Python's handler run too, so Python still sees the signal: after the GIL
 * is re-acquired PyErr_CheckSignals() runs the Python-level handler, which
 * raises KeyboardInterrupt by default. Only main-thread calls poll the
 * flag, since Python delivers KeyboardInterrupt to the main thread alone;
 * installs are counted, so whichever call leaves last restores the
 * previous handler, exactly once.
 *
 * Free-threaded Python (3.13t, no GIL): this state needs no GIL. The
 * install count and the saved handler are guarded by the platform layer's
 * own lock; the flag is raised by the handler, lowered only under that
 * lock, and read by the core as it already is with the GIL released.
 * sigint_main_ident is written at module exec (under the import lock,
 * before any call) and in a fork child (where only the forking thread
 * lives), and only read otherwise.
 */
static unsigned long sigint_main_ident; // Python's main thread

/* In a fork child the forking thread is the only one, and Python makes it
   the main thread: the calls it makes are the ones to poll. */
static void sigint_atfork_child(void)
{
    sigint_main_ident = PyThread_get_thread_ident();
}

/*
 * Once, at import: registers the fork handlers and records the ident of
 * Python's main thread, from threading.main_thread() (mhattn is imported
 * on the main thread in practice, but need not be). -1 with an exception
 * set on failure.
 */
static int sigint_setup(void)
{
    static int atfork_done;
    int err = mha_sigint_setup();
    if (err == 0 && !atfork_done && (err = mha_atfork_child(sigint_atfork_child)) == 0)
        atfork_done = 1;
    if (err != 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    PyObject *threading = PyImport_ImportModule("threading");
    PyObject *main = threading ? PyObject_CallMethod(threading, "main_thread", NULL)
                               : NULL;
    PyObject *ident = main ? PyObject_GetAttrString(main, "ident") : NULL;
    if (ident != NULL)
        sigint_main_ident = PyLong_AsUnsignedLong(ident);
    Py_XDECREF(ident);
    Py_XDECREF(main);
    Py_XDECREF(threading);
    return PyErr_Occurred() ? -1 : 0;
}

/* 1 when called from Python's main thread (the one signals are handled in)
   and Ctrl-C can be seen during a call here. It runs no Python code, which
   could run a pending signal handler and then lose the exception it
   raised. */
static int on_main_thread(void)
{
    return mha_sigint_supported() && PyThread_get_thread_ident() == sigint_main_ident;
}

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
    const int signalled = *mha_sigint_flag() != 0;
    mha_sigint_uninstall();
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
        // Each caller value is read once, into the copy the core reads.
        const int64_t dk_g = dk64[g], dv_g = dv64[g];
        if (dk_g <= 0 || dv_g <= 0 || (uint64_t)dk_g > MHA_MAX_ELEMS ||
            (uint64_t)dv_g > MHA_MAX_ELEMS) {
            PyErr_Format(PyExc_ValueError,
                         "dk, dv: head widths must be between 1 and %zu, got "
                         "dk[%zd] = %lld, dv[%zd] = %lld", MHA_MAX_ELEMS,
                         (Py_ssize_t)g, (long long)dk_g, (Py_ssize_t)g,
                         (long long)dv_g);
            return -1;
        }
        dk[g] = (size_t)dk_g;
        dv[g] = (size_t)dv_g;
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

/* key_lengths: None (*snap stays NULL) or int64 (B,), each in [0, Tk],
   copied into *snap (B, PyMem) and checked there: the core reads the copy,
   which no other thread can change once the GIL is released. */
static int as_lengths(int64_t **snap, PyObject *obj, npy_intp B, npy_intp Tk)
{
    *snap = NULL;
    if (obj == Py_None)
        return 0;
    PyArrayObject *a;
    if (as_vector(&a, obj, "key_lengths", NPY_INT64) < 0)
        return -1;
    const npy_intp want = B;
    int res = check_shape(a, "key_lengths", 1, &want, "(B,)");
    if (res == 0 && (*snap = PyMem_Malloc((size_t)B * sizeof **snap + 1)) == NULL) {
        PyErr_NoMemory();
        res = -1;
    }
    if (res == 0)
        memcpy(*snap, PyArray_DATA(a), (size_t)B * sizeof **snap);
    Py_DECREF(a);
    for (npy_intp b = 0; res == 0 && b < B; b++) {
        const int64_t len = (*snap)[b];
        if (len < 0 || len > (int64_t)Tk) {
            PyErr_Format(PyExc_ValueError,
                         "key_lengths: expected 0 <= key_lengths[b] <= Tk = %zd, "
                         "got key_lengths[%zd] = %lld", (Py_ssize_t)Tk,
                         (Py_ssize_t)b, (long long)len);
            res = -1;
        }
    }
    return res;
}

/* scales (H,) float64 copied into *snap (H, PyMem), for the same reason. */
static int snapshot_scales(double **snap, PyArrayObject *scales)
{
    const size_t H = (size_t)PyArray_DIM(scales, 0);
    if ((*snap = PyMem_Malloc(H * sizeof **snap + 1)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(*snap, PyArray_DATA(scales), H * sizeof **snap);
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

/* The variants' tuple, position by position (see read_variants). */
enum {
    V_WINDOW, V_SOFTCAP, V_ALIBI, V_SINKS, V_KEY_MASK, V_CU_Q, V_CU_K,
    V_Q_NORM, V_K_NORM, V_NORM_EPS, V_ROTARY_DIM, V_INTERLEAVED, V_INV_FREQ,
    V_POSITIONS, V_KEY_POSITIONS, V_N
};

/* ---- one skeleton for forward() and backward() ------------------------- */
/*
 * Both read their arguments by a table (one arg_spec per position),
 * convert the arrays in positional order, so that the first bad argument is
 * the one reported, derive the sizes and the mha_config the same way, make
 * their outputs from a table of shapes, and run the core with the GIL
 * released. Every reference a call owns is in its `call`, released by
 * call_release alone.
 */

/* The sizes of a call, by the letters of mha.h; indices into call.size. */
enum {
    L_B, L_TQ, L_TK, L_DIN, L_DKIN, L_DVIN, L_DOUT, L_H,
    L_SQ, L_SK, L_SV, L_SVQ, N_LETTERS
};
static const char *const letter_name[N_LETTERS] = {
    "B", "Tq", "Tk", "Din", "Dkin", "Dvin", "Dout", "H",
    "Sq", "Sk", "Sv", "Svq"};

/* A shape in letters: {3, {L_B, L_TQ, L_DIN}} is (B, Tq, Din). */
typedef struct {
    int nd;
    unsigned char dim[4];
} shape;
#define SHAPE1(a) {1, {a}}
#define SHAPE2(a, b) {2, {a, b}}
#define SHAPE3(a, b, c) {3, {a, b, c}}
#define SHAPE4(a, b, c, d) {4, {a, b, c, d}}

/* The sizes of shape s, given the call's sizes by letter. */
static void shape_dims(npy_intp dims[4], const shape *s,
                       const npy_intp size[N_LETTERS])
{
    for (int d = 0; d < s->nd; d++)
        dims[d] = size[s->dim[d]];
}

/* s's letters as a Python tuple would print: "(B, Tk, Dkin)", "(Sq,)". */
static void shape_letters(char buf[64], const shape *s)
{
    int n = snprintf(buf, 64, "(");
    for (int d = 0; d < s->nd; d++)
        n += snprintf(buf + n, (size_t)(64 - n), "%s%s", d ? ", " : "",
                      letter_name[s->dim[d]]);
    snprintf(buf + n, (size_t)(64 - n), s->nd == 1 ? ",)" : ")");
}

typedef enum {
    ARG_ARRAY,       /* a float array of x's dtype */
    ARG_ARRAY_OPT,   /* the same, or None for an absent one */
    ARG_ARRAY_ALIAS, /* the same, or None for the array of argument .alias */
    ARG_INT64,       /* a vector, converted to int64 (dk, dv) */
    ARG_FLOAT64,     /* a vector, converted to float64 (scales) */
    ARG_MASK,        /* None or a mask: converted once the sizes are known */
    ARG_LENGTHS,     /* None or key lengths: likewise */
    ARG_BOOL,        /* any object, read as its truth value */
    ARG_VARIANTS,    /* None or the variants' tuple (see read_variants) */
    ARG_PACKED,      /* None or a tuple of packed weights (read_packed) */
} arg_kind;

typedef struct {
    const char *name;   /* the keyword, and the prefix of its errors */
    arg_kind kind;
    shape shape;        /* float arrays: ndim, and the letters checked */
    int alias;          /* ARG_ARRAY_ALIAS: the earlier position None
                           stands for */
} arg_spec;

/*
 * A function's arguments, and the positions of those every call has. The
 * float arrays' shapes are checked once the letters they name are known:
 * first those against x's sizes, then, after the head widths, the others;
 * each list in the order its errors take precedence, ended by -1.
 */
typedef struct {
    const char *name;       /* "forward", for PyArg's messages */
    int nargs;
    const arg_spec *args;   /* (nargs,) in positional order */
    const int *checks_x;       /* against x, key and value's sizes */
    const int *checks_widths;  /* against all, Sq, ..., Svq and Dout too */
    int x, key, value, wo, dk, dv, scales, mask, causal, key_lengths;
    int variants;
    int broadcast_mask;     /* the mask may broadcast to (B, H, Tq, Tk) */
    int nopt;               /* trailing arguments that may be left out
                               (None then) */
} call_spec;

/* run_core's restarts after a handler that did not raise, before a last
   try that is not polled: a call takes at most MAX_RESTARTS + 1 times its
   time, whatever the signals (a SIGINT storm included). */
#define MAX_RESTARTS 3
#define MAX_ARGS 24   /* backward()'s */
#define MAX_OUTS 14   /* backward()'s gradients */

/* One argument as passed: the object (borrowed from the caller, who keeps
   it alive for the call) and, for ARG_BOOL, its truth value. */
typedef struct {
    PyObject *obj;
    int truth;
} arg_value;

/* One call in progress: call_init starts it, call_release ends it. */
typedef struct {
    arg_value arg[MAX_ARGS];
    int typenum;                  /* NPY_FLOAT or NPY_DOUBLE: x's dtype */
    PyArrayObject *in[MAX_ARGS];  /* owned: the converted arrays by position,
                                     shaped as their arg_spec says; NULL for
                                     None and for non-array arguments */
    PyArrayObject *out[MAX_OUTS]; /* owned: the outputs, shaped as the
                                     function's table says; NULL if unwanted */
    npy_intp size[N_LETTERS];     /* the call's sizes, by letter */
    /* Glue-owned snapshots of the index-bearing vectors, taken while the
       GIL is held: the core never reads a caller's dk, dv, scales or
       key_lengths, which another thread may change during the call. */
    size_t *widths;               /* (2G,) PyMem: dk then dv, as size_t */
    double *scales;               /* (H,) PyMem */
    int64_t *lengths;             /* (B,) PyMem, or NULL for None */
    /* owned: the glue's copies of the variants' arrays (read_variants),
       NULL where absent */
    PyArrayObject *var[V_N];
    mha_config cfg;               /* borrows widths, scales, mask, lengths,
                                     var */
} call;

/* Nulls what call_release frees. The rest is written before it is read:
   that is cheaper than zeroing the whole struct on every small call. */
static void call_init(call *c)
{
    memset(c->in, 0, sizeof c->in);
    memset(c->out, 0, sizeof c->out);
    memset(c->var, 0, sizeof c->var);
    c->widths = NULL;
    c->scales = NULL;
    c->lengths = NULL;
}

static void call_release(call *c)
{
    PyMem_Free(c->widths);
    PyMem_Free(c->scales);
    PyMem_Free(c->lengths);
    for (int i = 0; i < MAX_ARGS; i++)
        Py_XDECREF(c->in[i]);
    for (int i = 0; i < MAX_OUTS; i++)
        Py_XDECREF(c->out[i]);
    for (int i = 0; i < V_N; i++)
        Py_XDECREF(c->var[i]);
}

/* PyArg "O&" converters. */
typedef int (*arg_converter)(PyObject *, void *);

static int store_object(PyObject *obj, void *slot)
{
    ((arg_value *)slot)->obj = obj;
    return 1;
}

static int store_truth(PyObject *obj, void *slot)
{
    arg_value *v = slot;
    v->obj = obj;
    return (v->truth = PyObject_IsTrue(obj)) >= 0;
}

static arg_converter converter_of(arg_kind kind)
{
    return kind == ARG_BOOL ? store_truth : store_object;
}

/* Exactly sp->nargs positional arguments and no keyword, as mhattn passes
   them: what parse_args would read, without the cost of the general
   parser. */
static int read_positional(call *c, const call_spec *sp, PyObject *const *argv,
                           Py_ssize_t nargs)
{
    for (int i = (int)nargs; i < sp->nargs; i++)
        c->arg[i] = (arg_value){Py_None, 0};   // optional ones left out
    for (int i = 0; i < (int)nargs; i++) {
        c->arg[i].obj = argv[i];
        if (sp->args[i].kind == ARG_BOOL && !store_truth(argv[i], &c->arg[i]))
            return -1;
    }
    return 0;
}

/*
 * Any other call: PyArg_ParseTupleAndKeywords, for its checks and its
 * messages. Every argument goes through an "O&" converter, so that the
 * variadic list is one (converter, slot) pair per position; the pairs past
 * sp->nargs are never read.
 */
static int parse_args(call *c, const call_spec *sp, PyObject *args,
                      PyObject *kwds)
{
    char format[2 * MAX_ARGS + 32], *f = format;
    char *kwlist[MAX_ARGS + 1];
    arg_converter cv[MAX_ARGS];
    void *slot[MAX_ARGS];
    for (int i = 0; i < MAX_ARGS; i++) {
        cv[i] = store_object;
        slot[i] = &c->arg[i];
        if (i < sp->nargs) {
            cv[i] = converter_of(sp->args[i].kind);
            kwlist[i] = (char *)sp->args[i].name;
            if (i == sp->nargs - sp->nopt)
                *f++ = '|';
            *f++ = 'O';
            *f++ = '&';
        }
    }
    kwlist[sp->nargs] = NULL;
    *f++ = ':';   // then the name, which fits: sp->name is a short literal
    memcpy(f, sp->name, strlen(sp->name) + 1);
#define PAIR(i) cv[i], slot[i]
    _Static_assert(MAX_ARGS == 24, "the call below passes MAX_ARGS pairs");
    const int ok = PyArg_ParseTupleAndKeywords(
        args, kwds, format, kwlist, PAIR(0), PAIR(1), PAIR(2), PAIR(3),
        PAIR(4), PAIR(5), PAIR(6), PAIR(7), PAIR(8), PAIR(9), PAIR(10),
        PAIR(11), PAIR(12), PAIR(13), PAIR(14), PAIR(15), PAIR(16), PAIR(17),
        PAIR(18), PAIR(19), PAIR(20), PAIR(21), PAIR(22), PAIR(23));
#undef PAIR
    return ok ? 0 : -1;
}

/* parse_args for METH_FASTCALL arguments, as a tuple and a dict. */
static int parse_fastcall(call *c, const call_spec *sp, PyObject *const *argv,
                          Py_ssize_t nargs, PyObject *kwnames)
{
    // The objects parsed stay alive in argv, which the caller owns.
    PyObject *args = PyTuple_New(nargs), *kwds = NULL;
    int res = -1;
    if (args == NULL)
        return -1;
    for (int i = sp->nargs - sp->nopt; i < sp->nargs; i++)
        c->arg[i] = (arg_value){Py_None, 0};   // unless given
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
    res = parse_args(c, sp, args, kwds);
done:
    Py_DECREF(args);
    Py_XDECREF(kwds);
    return res;
}

/*
 * The dtype of x is the compute dtype. Converts the float arrays and the
 * vectors in positional order; a None that stands for another input
 * becomes a reference to that input's array.
 */
static int convert_arrays(call *c, const call_spec *sp)
{
    PyObject *x_o = c->arg[sp->x].obj;
    if (!PyArray_Check(x_o)) {
        PyErr_Format(PyExc_TypeError, "x: expected a numpy.ndarray, got %s",
                     Py_TYPE(x_o)->tp_name);
        return -1;
    }
    c->typenum = PyArray_TYPE((PyArrayObject *)x_o);
    if (c->typenum != NPY_FLOAT && c->typenum != NPY_DOUBLE) {
        PyErr_Format(PyExc_TypeError,
                     "x: expected dtype float32 or float64, got %R",
                     (PyObject *)PyArray_DESCR((PyArrayObject *)x_o));
        return -1;
    }
    for (int i = 0; i < sp->nargs; i++) {
        const arg_spec *a = &sp->args[i];
        PyArrayObject **res = &c->in[i];
        PyObject *obj = c->arg[i].obj;
        int bad = 0;
        switch (a->kind) {
        case ARG_ARRAY:
        case ARG_ARRAY_OPT:
        case ARG_ARRAY_ALIAS:
            bad = as_float(res, obj, a->name, c->typenum, a->shape.nd,
                           a->kind != ARG_ARRAY);
            if (bad == 0 && *res == NULL && a->kind == ARG_ARRAY_ALIAS) {
                *res = c->in[a->alias];
                Py_INCREF(*res);
            }
            break;
        case ARG_INT64:
            bad = as_vector(res, obj, a->name, NPY_INT64);
            break;
        case ARG_FLOAT64:
            bad = as_vector(res, obj, a->name, NPY_DOUBLE);
            break;
        default:   // masks and lengths need the sizes; truths are read
            break;
        }
        if (bad < 0)
            return -1;
    }
    return 0;
}

/* Checks the shapes of the float arrays at the positions pos (ended by
   -1) against c->size; None (absent) arrays are skipped. */
static int check_shapes(const call *c, const call_spec *sp, const int *pos)
{
    for (; *pos >= 0; pos++) {
        const arg_spec *a = &sp->args[*pos];
        PyArrayObject *arr = c->in[*pos];
        npy_intp want[4];
        char letters[64];
        if (arr == NULL)
            continue;
        shape_dims(want, &a->shape, c->size);
        if (same_shape(arr, a->shape.nd, want))
            continue;
        shape_letters(letters, &a->shape);
        return check_shape(arr, a->name, a->shape.nd, want, letters);
    }
    return 0;
}

/* The mask as the core reads it (see as_mask), broadcast first when the
   function allows it (see broadcast_mask). */
static int convert_mask(call *c, const call_spec *sp, mha_mask_kind *kind,
                        ptrdiff_t stride[4])
{
    const npy_intp *n = c->size;
    const npy_intp want[4] = {n[L_B], n[L_H], n[L_TQ], n[L_TK]};
    PyObject *mask_o = c->arg[sp->mask].obj;
    if (!sp->broadcast_mask)
        return as_mask(&c->in[sp->mask], kind, stride, mask_o, c->typenum,
                       want);
    PyObject *mask_b;
    if (broadcast_mask(&mask_b, mask_o, want) < 0)
        return -1;
    const int res = as_mask(&c->in[sp->mask], kind, stride, mask_b,
                            c->typenum, want);
    Py_DECREF(mask_b);
    return res;
}

/* ---- the variants (issue 13) ------------------------------------------- */
/*
 * forward() and backward() take the variants of today's models as one
 * argument: None (all off), or a tuple of V_N items in this order, as
 * mhattn._core.variant_args makes it:
 *   window         None or (left, right): ints, -1 for an unbounded side
 *   softcap        float, 0 for off
 *   alibi          None or float64 (1 or B, H)
 *   sinks          None or (H,) of x's dtype
 *   key_mask       None or bool (B, Tk)
 *   cu_q, cu_k     None or int64 (n + 1,) each, both or neither
 *   q_norm         None, (d,) or (H, d) of x's dtype
 *   k_norm         None, (d,) or (G, d) of x's dtype
 *   norm_eps       float
 *   rotary_dim     int, 0 for off
 *   interleaved    truth value
 *   inv_freq       None or float64 (rotary_dim / 2,)
 *   positions      None or int64 (1 or B, Tq)
 *   key_positions  None or int64 (1 or B, Tk)
 * Every array is copied into memory the call owns (they are small), so no
 * index, offset or size the core uses lives where another thread can write
 * during the call; mha_check_config then checks the copies.
 */
static const char *const variant_name[V_N] = {
    "window", "softcap", "alibi_slopes", "sinks", "key_mask", "cu_seqlens",
    "key_cu_seqlens", "q_norm", "k_norm", "norm_eps", "rotary_dim",
    "interleaved", "inv_freq", "positions", "key_positions"};

/* *res = a C-contiguous copy of obj (1 to nd_max dimensions) as typenum,
   owned by the call, or NULL for None. */
static int variant_copy(PyArrayObject **res, PyObject *obj, const char *name,
                        int typenum, int nd_max)
{
    *res = NULL;
    if (obj == Py_None)
        return 0;
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a numpy.ndarray or None, got %s",
                     name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    *res = (PyArrayObject *)PyArray_FromAny(
        obj, PyArray_DescrFromType(typenum), 1, nd_max,
        NPY_ARRAY_CARRAY | NPY_ARRAY_ENSURECOPY, NULL);
    if (*res == NULL) {
        prefix_error(name);
        return -1;
    }
    return 0;
}

/* 0 when a is absent or has one of the shapes (rows, n) or, when rows1,
   (1, n) or, when flat, (n,); else ValueError naming it. *bstride = the
   row stride in elements (0 for one shared row). */
static int variant_rows(PyArrayObject *a, const char *name, npy_intp rows,
                        npy_intp n, int rows1, int flat, size_t *bstride)
{
    *bstride = 0;
    if (a == NULL)
        return 0;
    const int nd = PyArray_NDIM(a);
    const npy_intp r = nd == 2 ? PyArray_DIM(a, 0) : 1;
    const npy_intp cols = PyArray_DIM(a, nd - 1);
    if (cols == n && ((nd == 1 && flat) || (nd == 2 && (r == rows || (rows1 && r == 1))))) {
        *bstride = nd == 2 && r > 1 ? (size_t)n : 0;
        return 0;
    }
    const npy_intp want[2] = {rows, n};
    return check_shape(a, name, 2, want, "");
}

/* The window (left, right) of the tuple's first item into cfg. */
static int variant_window(mha_config *cfg, PyObject *w)
{
    if (w == Py_None)
        return 0;
    long long left, right;
    if (!PyTuple_Check(w) || !PyArg_ParseTuple(w, "LL", &left, &right)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "window: expected None or a tuple of two ints "
                     "(-1 for an unbounded side), got %R", w);
        return -1;
    }
    cfg->windowed = 1;
    cfg->window_left = left < 0 ? -1 : (int64_t)left;
    cfg->window_right = right < 0 ? -1 : (int64_t)right;
    return 0;
}

/* The scalars of the tuple t into cfg: softcap, norm_eps, rotary_dim,
   interleaved. */
static int variant_scalars(mha_config *cfg, PyObject *t)
{
    cfg->softcap = PyFloat_AsDouble(PyTuple_GET_ITEM(t, V_SOFTCAP));
    cfg->norm_eps = PyFloat_AsDouble(PyTuple_GET_ITEM(t, V_NORM_EPS));
    const Py_ssize_t rd = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, V_ROTARY_DIM));
    const int inter = PyObject_IsTrue(PyTuple_GET_ITEM(t, V_INTERLEAVED));
    if (PyErr_Occurred()) {
        prefix_error("variants");
        return -1;
    }
    if (rd < 0 || !(cfg->softcap >= 0) || !(cfg->norm_eps >= 0)) {
        PyErr_Format(PyExc_ValueError, "variants: expected softcap >= 0, norm_eps >= 0 "
                     "and rotary_dim >= 0, got %R", t);
        return -1;
    }
    cfg->rotary_dim = (size_t)rd;
    cfg->rope_interleaved = inter;
    return 0;
}

/* Copies the tuple's arrays into c->var, by dtype. */
static int variant_arrays(call *c, PyObject *t)
{
    // typenum + 1 of each array (0: not an array), -1: x's dtype
    static const int kind[V_N] = {
        [V_ALIBI] = NPY_DOUBLE + 1, [V_KEY_MASK] = NPY_BOOL + 1,
        [V_CU_Q] = NPY_INT64 + 1, [V_CU_K] = NPY_INT64 + 1,
        [V_INV_FREQ] = NPY_DOUBLE + 1, [V_POSITIONS] = NPY_INT64 + 1,
        [V_KEY_POSITIONS] = NPY_INT64 + 1, [V_SINKS] = -1, [V_Q_NORM] = -1,
        [V_K_NORM] = -1};
    for (int i = 0; i < V_N; i++) {
        if (kind[i] == 0)
            continue;
        const int typenum = kind[i] < 0 ? c->typenum : kind[i] - 1;
        const int nd_max = (i == V_SINKS || i == V_CU_Q || i == V_CU_K ||
                            i == V_INV_FREQ) ? 1 : 2;
        if (variant_copy(&c->var[i], PyTuple_GET_ITEM(t, i), variant_name[i],
                         typenum, nd_max) < 0)
            return -1;
    }
    return 0;
}

/* Packed-sequence offsets cu (n + 1,) of the glue's copy: they index rows,
   so they are checked here, naming the argument: B == 1, cu[0] == 0,
   nondecreasing, cu[n] == total. */
static int variant_offsets(PyArrayObject *a, const char *name, npy_intp B,
                           npy_intp total)
{
    const npy_intp n = PyArray_DIM(a, 0);
    const int64_t *cu = PyArray_DATA(a);
    if (B != 1 || n < 2) {
        PyErr_Format(PyExc_ValueError, "%s: packed sequences need B == 1 and at "
                     "least 2 offsets, got B = %zd and %zd", name, (Py_ssize_t)B,
                     (Py_ssize_t)n);
        return -1;
    }
    for (npy_intp s = 0; s < n; s++) {
        const int64_t lo = s == 0 ? 0 : cu[s - 1];
        if (cu[s] < lo || cu[s] > (int64_t)total || (s == 0 && cu[0] != 0) ||
            (s == n - 1 && cu[s] != (int64_t)total)) {
            PyErr_Format(PyExc_ValueError, "%s: expected offsets 0 <= ... nondecreasing "
                         "... == %zd, got %s[%zd] = %lld", name, (Py_ssize_t)total,
                         name, (Py_ssize_t)s, (long long)cu[s]);
            return -1;
        }
    }
    return 0;
}

/* The arrays' shapes against the call's sizes, and their pointers and
   strides into cfg. */
static int variant_shapes(call *c, mha_config *cfg)
{
    PyArrayObject *const *v = c->var;
    const npy_intp *n = c->size, G = (npy_intp)cfg->G;
    const npy_intp d = G > 0 ? (npy_intp)cfg->dk[0] : 0;
    size_t unused;
    if (variant_rows(v[V_ALIBI], "alibi_slopes", n[L_B], n[L_H], 1, 0,
                     &cfg->alibi_bstride) < 0 ||
        variant_rows(v[V_SINKS], "sinks", 1, n[L_H], 0, 1, &unused) < 0 ||
        variant_rows(v[V_KEY_MASK], "key_mask", n[L_B], n[L_TK], 0, 0, &unused) < 0 ||
        variant_rows(v[V_Q_NORM], "q_norm", n[L_H], d, 0, 1, &cfg->q_norm_hstride) < 0 ||
        variant_rows(v[V_K_NORM], "k_norm", G, d, 0, 1, &cfg->k_norm_hstride) < 0 ||
        variant_rows(v[V_INV_FREQ], "inv_freq", 1, (npy_intp)cfg->rotary_dim / 2, 0, 1,
                     &unused) < 0 ||
        variant_rows(v[V_POSITIONS], "positions", n[L_B], n[L_TQ], 1, 0,
                     &cfg->positions_bstride) < 0 ||
        variant_rows(v[V_KEY_POSITIONS], "key_positions", n[L_B], n[L_TK], 1, 0,
                     &cfg->key_positions_bstride) < 0)
        return -1;
    if ((v[V_CU_Q] == NULL) != (v[V_CU_K] == NULL) ||
        (v[V_CU_Q] != NULL && PyArray_DIM(v[V_CU_Q], 0) != PyArray_DIM(v[V_CU_K], 0))) {
        PyErr_SetString(PyExc_ValueError, "key_cu_seqlens: expected as many offsets "
                        "as cu_seqlens");
        return -1;
    }
    if (v[V_CU_Q] != NULL &&
        (variant_offsets(v[V_CU_Q], "cu_seqlens", n[L_B], n[L_TQ]) < 0 ||
         variant_offsets(v[V_CU_K], "key_cu_seqlens", n[L_B], n[L_TK]) < 0))
        return -1;
    cfg->alibi = DATA(v[V_ALIBI]);
    cfg->sinks = DATA(v[V_SINKS]);
    cfg->key_mask = DATA(v[V_KEY_MASK]);
    cfg->nseq = v[V_CU_Q] != NULL ? (size_t)PyArray_DIM(v[V_CU_Q], 0) - 1 : 0;
    cfg->cu_q = DATA(v[V_CU_Q]);
    cfg->cu_k = DATA(v[V_CU_K]);
    cfg->q_norm = DATA(v[V_Q_NORM]);
    cfg->k_norm = DATA(v[V_K_NORM]);
    cfg->inv_freq = DATA(v[V_INV_FREQ]);
    cfg->positions = DATA(v[V_POSITIONS]);
    cfg->key_positions = DATA(v[V_KEY_POSITIONS]);
    return 0;
}

/* The variants' argument (None or the tuple above) into c->cfg. */
static int read_variants(call *c, PyObject *t)
{
    if (t == Py_None)
        return 0;
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != V_N) {
        PyErr_Format(PyExc_TypeError, "variants: expected None or a tuple of %d "
                     "items, got %s", V_N, Py_TYPE(t)->tp_name);
        return -1;
    }
    if (variant_window(&c->cfg, PyTuple_GET_ITEM(t, V_WINDOW)) < 0 ||
        variant_scalars(&c->cfg, t) < 0 || variant_arrays(c, t) < 0)
        return -1;
    return variant_shapes(c, &c->cfg);
}

/*
 * The sizes (c->size) from x, key, value, dk, dv, scales and wo; the
 * shapes of the other arrays against them; the key lengths and the mask;
 * then c->cfg, checked by the core.
 */
static int build_config(call *c, const call_spec *sp)
{
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
    const size_t G = (size_t)PyArray_DIM(in[sp->dk], 0);
    n[L_SQ] = (npy_intp)fused[0];
    n[L_SK] = (npy_intp)fused[1];
    n[L_SV] = (npy_intp)fused[2];
    n[L_SVQ] = (npy_intp)fused[3];
    n[L_DOUT] = wo != NULL ? PyArray_DIM(wo, 1) : n[L_SVQ];
    if (check_shapes(c, sp, sp->checks_widths) < 0)
        return -1;

    mha_mask_kind mask_kind;
    ptrdiff_t mask_stride[4];
    if (as_lengths(&c->lengths, c->arg[sp->key_lengths].obj, n[L_B],
                   n[L_TK]) < 0 ||
        convert_mask(c, sp, &mask_kind, mask_stride) < 0 ||
        snapshot_scales(&c->scales, in[sp->scales]) < 0)
        return -1;

    c->cfg = (mha_config){
        .B = (size_t)n[L_B], .Tq = (size_t)n[L_TQ], .Tk = (size_t)n[L_TK],
        .Din = (size_t)n[L_DIN], .Dkin = (size_t)n[L_DKIN],
        .Dvin = (size_t)n[L_DVIN], .Dout = (size_t)n[L_DOUT],
        .H = (size_t)n[L_H], .G = G,
        .dk = c->widths, .dv = c->widths + G,
        .scale = c->scales,
        .causal = c->arg[sp->causal].truth,
        .mask_kind = mask_kind, .mask = DATA(in[sp->mask]),
        .mask_stride = {mask_stride[0], mask_stride[1], mask_stride[2],
                        mask_stride[3]},
        .key_lengths = c->lengths,
        .has_wo = wo != NULL, .interrupt = NULL,
    };
    if (read_variants(c, c->arg[sp->variants].obj) < 0)
        return -1;
    mha_layout lay;
    mha_error err;
    const mha_status st = mha_check_config(&lay, &c->cfg, &err);
    if (st != MHA_OK) {
        raise_check(st, &err);
        return -1;
    }
    return 0;
}

/* The outputs: new C-contiguous arrays of x's dtype, out[i] of shape
   shapes[i] where want[i] (sizes checked by mha_check_config). */
static int make_outputs(call *c, int nout, const shape *shapes, const int *want)
{
    for (int i = 0; i < nout; i++) {
        npy_intp dims[4];
        if (!want[i])
            continue;
        shape_dims(dims, &shapes[i], c->size);
        c->out[i] = (PyArrayObject *)PyArray_EMPTY(shapes[i].nd, dims,
                                                   c->typenum, 0);
        if (c->out[i] == NULL)
            return -1;
    }
    return 0;
}

/*
 * Runs core(c) with the GIL released. Ctrl-C: see sigint_setup; only
 * when main_thread is the handler installed and the flag polled. A Python
 * handler that does not raise lets the call start over, as if the signal
 * had come just before it (every output is overwritten, so a partial run
 * leaves no trace), at most MAX_RESTARTS times: then the call runs to its
 * end with Python's handling of SIGINT in place, which only notes the
 * signal, and the handler runs once the call is over. -1 with an exception
 * set on failure.
 */
static int run_core(call *c, mha_status (*core)(const call *), int main_thread)
{
    mha_status st;
    int again;
    // Every restart follows a signal whose handler did not raise; the
    // count bounds the loop whatever the signals do.
    int restarts = 0;
    const int polled = main_thread;
    do {
        c->cfg.interrupt = NULL;
        if (main_thread) {
            mha_sigint_install();
            c->cfg.interrupt = mha_sigint_flag();
            // A signal that came before the install (while the glue copied
            // an input, say) is Python's to handle: now, not after the call.
            if (PyErr_CheckSignals() < 0) {
                mha_sigint_uninstall();
                return -1;
            }
        }
        Py_BEGIN_ALLOW_THREADS
        st = core(c);
        Py_END_ALLOW_THREADS
        if ((again = sigint_after_call(main_thread, st)) < 0)
            return -1;
        if (again && ++restarts >= MAX_RESTARTS)
            main_thread = 0;   // the last try runs to the end, unpolled
    } while (again);
    // Signals the last try did not poll: their handler runs now.
    if (polled && !main_thread && PyErr_CheckSignals() < 0)
        return -1;
    if (st != MHA_OK) {
        raise_status(st);
        return -1;
    }
    return 0;
}

/* A new tuple of the n arrays a, None for each NULL. */
static PyObject *arrays_tuple(PyArrayObject *const *a, int n)
{
    PyObject *t = PyTuple_New(n);
    if (t == NULL)
        return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *o = a[i] != NULL ? (PyObject *)a[i] : Py_None;
        Py_INCREF(o);
        PyTuple_SET_ITEM(t, i, o);
    }
    return t;
}

/* ---- prepacked weights (issue 16) --------------------------------------- */

/* A packed weight is a capsule of this name around a PyMem block holding
   an mha_packed (its panels from the core's allocator), made only by
   pack_weight(): Python code cannot reach inside, so its sizes and panels
   are the glue's own. */
#define PACKED_CAPSULE "mhattn._C.packed"

static void packed_destroy(PyObject *cap)
{
    mha_packed *p = PyCapsule_GetPointer(cap, PACKED_CAPSULE);
    if (p != NULL) {
        mha_packed_free(p);
        PyMem_Free(p);
    }
}

PyDoc_STRVAR(pack_weight_doc,
"pack_weight(w)\n"
"--\n\n"
"w (K, N) float32 or float64: its GEMM panels for the ISA in force, as an\n"
"opaque capsule for forward()'s and project()'s packed argument (low\n"
"level; see mhattn.pack_weights). w is copied, never kept.");

static PyObject *pack_weight(PyObject *self, PyObject *arg)
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
    const size_t K = (size_t)PyArray_DIM(a, 0), N = (size_t)PyArray_DIM(a, 1);
    mha_packed *p = PyMem_Calloc(1, sizeof *p);
    if (p == NULL) {
        Py_DECREF(a);
        return PyErr_NoMemory();
    }
    mha_status st;
    Py_BEGIN_ALLOW_THREADS
    st = mha_pack_weight(p, PyArray_DATA(a), N, K, N, DTYPE_OF(typenum));
    Py_END_ALLOW_THREADS
    Py_DECREF(a);
    PyObject *cap = st == MHA_OK ? PyCapsule_New(p, PACKED_CAPSULE, packed_destroy) : NULL;
    if (cap == NULL) {
        if (st != MHA_OK)
            raise_status(st);
        mha_packed_free(p);
        PyMem_Free(p);
    }
    return cap;
}

PyDoc_STRVAR(packed_info_doc,
"packed_info(packed)\n"
"--\n\n"
"(K, N, isa, dtype name, bytes) of a pack_weight() capsule.");

static PyObject *packed_info(PyObject *self, PyObject *cap)
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
static int read_packed(call *c, PyObject *t, const int *wpos, int n)
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

/* ---- forward ------------------------------------------------------------ */

PyDoc_STRVAR(forward_doc,
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

static mha_status forward_core(const call *c)
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
    return mha_forward(&c->cfg, &prm, NULL);
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

static PyObject *forward(PyObject *self, PyObject *const *argv, Py_ssize_t nargs,
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

PyDoc_STRVAR(backward_doc,
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

static mha_status backward_core(const call *c)
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
    return mha_backward(&c->cfg, &prm, NULL);
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

static PyObject *backward(PyObject *self, PyObject *args, PyObject *kwds)
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

/* ---- attention (issue 17) ---------------------------------------------- */

PyDoc_STRVAR(attention_doc,
"attention(q, k, v, scales, mask, causal, key_lengths, variants,\n"
"          lengths_aligned, out_bthd, want_weights, want_lse)\n"
"--\n\n"
"Attention on tensors already projected (low level; see mhattn.attention).\n"
"q (B,H,Tq,dk), k (B,G,Tk,dk), v (B,G,Tk,dv): 4-D arrays of one dtype\n"
"(float32 or float64); any non-negative strides with a contiguous last\n"
"axis are read in place, anything else is copied. scales: float64 (H,);\n"
"mask, causal, key_lengths, variants as for forward() (variants' q/k\n"
"transforms must be off); lengths_aligned: align each batch item's queries\n"
"to its own key length (a KV cache).\n\n"
"Returns (out, weights or None, lse or None): out (B,H,Tq,dv), or with\n"
"out_bthd (B,Tq,H,dv), C-contiguous; weights (B,H,Tq,Tk); lse (B,H,Tq),\n"
"natural log, -inf for a fully masked row.");

/* attention()'s positional arguments. */
enum {
    ATT_Q, ATT_K, ATT_V, ATT_SCALES, ATT_MASK, ATT_CAUSAL, ATT_KEY_LENGTHS,
    ATT_VARIANTS, ATT_ALIGNED, ATT_OUT_BTHD, ATT_WANT_WEIGHTS, ATT_WANT_LSE,
    ATT_NARGS
};

static const arg_spec attention_args[ATT_NARGS] = {
    [ATT_Q] = {.name = "q", .kind = ARG_ARRAY},
    [ATT_K] = {.name = "k", .kind = ARG_ARRAY},
    [ATT_V] = {.name = "v", .kind = ARG_ARRAY},
    [ATT_SCALES] = {.name = "scales", .kind = ARG_FLOAT64},
    [ATT_MASK] = {.name = "mask", .kind = ARG_MASK},
    [ATT_CAUSAL] = {.name = "causal", .kind = ARG_BOOL},
    [ATT_KEY_LENGTHS] = {.name = "key_lengths", .kind = ARG_LENGTHS},
    [ATT_VARIANTS] = {.name = "variants", .kind = ARG_VARIANTS},
    [ATT_ALIGNED] = {.name = "lengths_aligned", .kind = ARG_BOOL},
    [ATT_OUT_BTHD] = {.name = "out_bthd", .kind = ARG_BOOL},
    [ATT_WANT_WEIGHTS] = {.name = "want_weights", .kind = ARG_BOOL},
    [ATT_WANT_LSE] = {.name = "want_lse", .kind = ARG_BOOL},
};
_Static_assert(ATT_NARGS <= MAX_ARGS, "a call holds attention()'s arguments");

/* Only the fields parse_args, read_positional and convert_mask read. */
static const call_spec attention_spec = {
    .name = "attention", .nargs = ATT_NARGS, .args = attention_args,
    .mask = ATT_MASK, .broadcast_mask = 1,
};

/* One attention() call: the skeleton's call, and the element strides of
   q, k, v and out (mha_strides) beside it. */
typedef struct {
    call c;              /* first: a `const call *` is an attention_call's */
    mha_strides st[4];   /* q, k, v, out */
} attention_call;

/*
 * c->in[pos] = the argument at pos as a 4-D array of dtype typenum (or of
 * any float dtype when typenum is 0: q's sets the call's): itself when it
 * is aligned and native with non-negative strides, each a multiple of the
 * item size, and a contiguous last axis, else a C-contiguous copy. *st =
 * its element strides over (B, heads, T) (the last axis is contiguous).
 */
static int attention_array(call *c, int pos, mha_strides *st)
{
    const char *name = attention_args[pos].name;
    PyObject *obj = c->arg[pos].obj;
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a numpy.ndarray, got %s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyArrayObject *a = (PyArrayObject *)obj;
    const int t = PyArray_TYPE(a);
    if (pos == ATT_Q && t != NPY_FLOAT && t != NPY_DOUBLE) {
        PyErr_Format(PyExc_TypeError, "q: expected dtype float32 or float64, got %R",
                     (PyObject *)PyArray_DESCR(a));
        return -1;
    }
    if (pos == ATT_Q)
        c->typenum = t;
    if (t != c->typenum) {
        PyErr_Format(PyExc_TypeError, "%s: expected dtype %s (the dtype of q), got %R",
                     name, dtype_name(c->typenum), (PyObject *)PyArray_DESCR(a));
        return -1;
    }
    if (PyArray_NDIM(a) != 4) {
        PyObject *g = dims_tuple(PyArray_NDIM(a), PyArray_DIMS(a));
        if (g != NULL)
            PyErr_Format(PyExc_ValueError, "%s: expected a 4-D array, got shape %R",
                         name, g);
        Py_XDECREF(g);
        return -1;
    }
    const npy_intp item = PyArray_ITEMSIZE(a);
    int in_place = PyArray_ISALIGNED(a) && PyArray_ISNOTSWAPPED(a) &&
                   (PyArray_DIM(a, 3) <= 1 || PyArray_STRIDE(a, 3) == item);
    for (int d = 0; d < 3; d++)
        in_place &= PyArray_STRIDE(a, d) >= 0 && PyArray_STRIDE(a, d) % item == 0;
    if (in_place) {
        Py_INCREF(a);
        c->in[pos] = a;
    } else if ((c->in[pos] = (PyArrayObject *)PyArray_NewCopy(a, NPY_CORDER)) == NULL) {
        return -1;
    }
    PyArrayObject *u = c->in[pos];
    *st = (mha_strides){(size_t)(PyArray_STRIDE(u, 0) / item),
                        (size_t)(PyArray_STRIDE(u, 1) / item),
                        (size_t)(PyArray_STRIDE(u, 2) / item)};
    return 0;
}

/* k, v and scales against q's sizes: k (B, G, Tk, dk), v (B, G, Tk, dv),
   scales (H,), H a positive multiple of G, widths >= 1. */
static int attention_shapes(const call *c)
{
    PyArrayObject *q = c->in[ATT_Q], *k = c->in[ATT_K], *v = c->in[ATT_V];
    const npy_intp B = PyArray_DIM(q, 0), H = PyArray_DIM(q, 1);
    const npy_intp G = PyArray_DIM(k, 1), Tk = PyArray_DIM(k, 2);
    const npy_intp want_k[4] = {B, G, Tk, PyArray_DIM(q, 3)};
    const npy_intp want_v[4] = {B, G, Tk, PyArray_DIM(v, 3)};
    const npy_intp want_s = H;
    if (check_shape(k, "k", 4, want_k, "(B, G, Tk, dk) from q's B and dk") < 0 ||
        check_shape(v, "v", 4, want_v, "(B, G, Tk, dv) from k") < 0 ||
        check_shape(c->in[ATT_SCALES], "scales", 1, &want_s, "(H,) from q") < 0)
        return -1;
    if (G == 0 || H % G != 0) {
        PyErr_Format(PyExc_ValueError, "k: the number of query heads H = %zd (q's axis "
                     "1) must be a positive multiple of the number of kv heads G = %zd",
                     (Py_ssize_t)H, (Py_ssize_t)G);
        return -1;
    }
    if (PyArray_DIM(q, 3) == 0 || PyArray_DIM(v, 3) == 0) {
        PyErr_SetString(PyExc_ValueError, PyArray_DIM(q, 3) == 0
                        ? "q: head width dk must be at least 1"
                        : "v: head width dv must be at least 1");
        return -1;
    }
    return 0;
}

/* The variants as for forward(), but the q/k transforms, which belong to
   the projections: ValueError naming the first one given. */
static int attention_variants(call *c)
{
    if (read_variants(c, c->arg[ATT_VARIANTS].obj) < 0)
        return -1;
    const mha_config *cfg = &c->cfg;
    const char *on = cfg->q_norm ? "q_norm" : cfg->k_norm ? "k_norm"
                     : cfg->rotary_dim ? "rotary_dim" : cfg->positions ? "positions"
                     : cfg->key_positions ? "key_positions" : NULL;
    if (on != NULL) {
        PyErr_Format(PyExc_ValueError, "variants: %s is a q/k transform, applied with "
                     "the projections; attention() takes q and k already "
                     "transformed (%s must be off)", on, on);
        return -1;
    }
    if (cfg->lengths_aligned && cfg->nseq > 0) {
        PyErr_SetString(PyExc_ValueError, "lengths_aligned: not with packed sequences "
                        "(cu_seqlens)");
        return -1;
    }
    return 0;
}

/* The arrays, the sizes and c->cfg of an attention() call. */
static int attention_config(attention_call *ac)
{
    call *c = &ac->c;
    if (attention_array(c, ATT_Q, &ac->st[0]) < 0 ||
        attention_array(c, ATT_K, &ac->st[1]) < 0 ||
        attention_array(c, ATT_V, &ac->st[2]) < 0 ||
        as_vector(&c->in[ATT_SCALES], c->arg[ATT_SCALES].obj, "scales", NPY_DOUBLE) < 0 ||
        attention_shapes(c) < 0)
        return -1;
    PyArrayObject *q = c->in[ATT_Q], *k = c->in[ATT_K], *v = c->in[ATT_V];
    npy_intp *n = c->size;
    memset(n, 0, sizeof c->size);
    n[L_B] = PyArray_DIM(q, 0), n[L_H] = PyArray_DIM(q, 1);
    n[L_TQ] = PyArray_DIM(q, 2), n[L_TK] = PyArray_DIM(k, 2);
    const size_t G = (size_t)PyArray_DIM(k, 1);
    if ((c->widths = PyMem_Malloc(2 * G * sizeof *c->widths)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t g = 0; g < G; g++) {
        c->widths[g] = (size_t)PyArray_DIM(q, 3);
        c->widths[G + g] = (size_t)PyArray_DIM(v, 3);
    }
    mha_mask_kind mask_kind;
    ptrdiff_t ms[4];
    if (as_lengths(&c->lengths, c->arg[ATT_KEY_LENGTHS].obj, n[L_B], n[L_TK]) < 0 ||
        convert_mask(c, &attention_spec, &mask_kind, ms) < 0 ||
        snapshot_scales(&c->scales, c->in[ATT_SCALES]) < 0)
        return -1;
    c->cfg = (mha_config){
        .B = (size_t)n[L_B], .Tq = (size_t)n[L_TQ], .Tk = (size_t)n[L_TK],
        .H = (size_t)n[L_H], .G = G, .dk = c->widths, .dv = c->widths + G,
        .scale = c->scales, .causal = c->arg[ATT_CAUSAL].truth,
        .mask_kind = mask_kind, .mask = DATA(c->in[ATT_MASK]),
        .mask_stride = {ms[0], ms[1], ms[2], ms[3]},
        .key_lengths = c->lengths, .has_wo = 1,
        .lengths_aligned = c->arg[ATT_ALIGNED].truth,
    };
    return attention_variants(c);
}

static mha_status attention_core(const call *c)
{
    const attention_call *ac = (const attention_call *)c;
    const mha_strides *s = ac->st;
    const mha_params prm = {
        .dtype = DTYPE_OF(c->typenum),
        .out = DATA(c->out[0]), .weights = DATA(c->out[1]), .lse = DATA(c->out[2]),
        .q = DATA(c->in[ATT_Q]), .k = DATA(c->in[ATT_K]), .v = DATA(c->in[ATT_V]),
        .sq = s[0], .sk = s[1], .sv = s[2], .so = s[3],
    };
    return mha_attend(&c->cfg, &prm, NULL);
}

/* out (B, H, Tq, dv) or, out_bthd, (B, Tq, H, dv); weights, lse if wanted;
   ac->st[3] = out's strides. */
static int attention_outputs(attention_call *ac)
{
    call *c = &ac->c;
    const npy_intp *n = c->size, dv = PyArray_DIM(c->in[ATT_V], 3);
    const npy_intp B = n[L_B], H = n[L_H], Tq = n[L_TQ];
    const int bthd = c->arg[ATT_OUT_BTHD].truth;
    const npy_intp od[4] = {B, bthd ? Tq : H, bthd ? H : Tq, dv};
    const npy_intp wd[4] = {B, H, Tq, n[L_TK]};
    ac->st[3] = bthd ? (mha_strides){(size_t)(Tq * H * dv), (size_t)dv, (size_t)(H * dv)}
                     : (mha_strides){(size_t)(H * Tq * dv), (size_t)(Tq * dv), (size_t)dv};
    if ((c->out[0] = (PyArrayObject *)PyArray_EMPTY(4, od, c->typenum, 0)) == NULL)
        return -1;
    if (c->arg[ATT_WANT_WEIGHTS].truth &&
        (c->out[1] = (PyArrayObject *)PyArray_EMPTY(4, wd, c->typenum, 0)) == NULL)
        return -1;
    if (c->arg[ATT_WANT_LSE].truth &&
        (c->out[2] = (PyArrayObject *)PyArray_EMPTY(3, wd, c->typenum, 0)) == NULL)
        return -1;
    return 0;
}

static PyObject *attention(PyObject *self, PyObject *const *argv, Py_ssize_t nargs,
                           PyObject *kwnames)
{
    (void)self;
    const call_spec *sp = &attention_spec;
    attention_call ac;
    call *c = &ac.c;
    PyObject *result = NULL;
    call_init(c);
    const int parsed = kwnames == NULL && nargs == ATT_NARGS
                           ? read_positional(c, sp, argv, nargs)
                           : parse_fastcall(c, sp, argv, nargs, kwnames);
    if (parsed < 0 || attention_config(&ac) < 0 || attention_outputs(&ac) < 0)
        goto fail;
    // As forward(): a small call runs without the Ctrl-C handler.
    const npy_intp *n = c->size;
    const double work = (double)n[L_B] * (double)n[L_H] * (double)n[L_TQ] *
                        (double)n[L_TK] *
                        (double)(c->cfg.dk[0] + c->cfg.dv[0]);
    if (run_core(c, attention_core, work > MHA_SMALL_WORK && on_main_thread()) < 0)
        goto fail;
    result = arrays_tuple(c->out, 3);
fail:
    call_release(c);
    return result;
}

/* ---- project and attention_backward (issue 17) -------------------------- */

PyDoc_STRVAR(project_doc,
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

static mha_status project_core(const call *c)
{
    PyArrayObject *const *in = c->in, *const *out = c->out;
    const mha_params prm = {
        .dtype = DTYPE_OF(c->typenum),
        .q = DATA(out[0]), .k = DATA(out[1]), .v = DATA(out[2]),
        .x = DATA(in[PRJ_X]), .key = DATA(in[PRJ_KEY]), .value = DATA(in[PRJ_VALUE]),
        .wq = DATA(in[PRJ_WQ]), .wk = DATA(in[PRJ_WK]), .wv = DATA(in[PRJ_WV]),
        .bq = DATA(in[PRJ_BQ]), .bk = DATA(in[PRJ_BK]), .bv = DATA(in[PRJ_BV]),
    };
    return mha_project(&c->cfg, &prm, NULL);
}

static PyObject *project(PyObject *self, PyObject *const *argv, Py_ssize_t nargs,
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

PyDoc_STRVAR(attention_backward_doc,
"attention_backward(dout, q, k, v, out, lse, scales, mask, causal,\n"
"                   key_lengths, variants, lengths_aligned)\n"
"--\n\n"
"Backward of attention on projected tensors (low level; see\n"
"mhattn.attention_grad). dout, out (B,H,Tq,dv), q (B,H,Tq,dk),\n"
"k (B,G,Tk,dk), v (B,G,Tk,dv): 4-D arrays of one dtype (float32 or\n"
"float64), any strides; lse (B,H,Tq) or None (recomputed); scales float64\n"
"(H,); mask, causal, key_lengths, variants as for forward() (the q/k\n"
"transforms off); lengths_aligned: a truth value.\n\n"
"Returns (dq (B,H,Tq,dk), dk (B,G,Tk,dk), dv (B,G,Tk,dv), dsinks (H,) or\n"
"None), C-contiguous.");

/* attention_backward()'s positional arguments. */
enum {
    ABW_DOUT, ABW_Q, ABW_K, ABW_V, ABW_OUT, ABW_LSE, ABW_SCALES, ABW_MASK,
    ABW_CAUSAL, ABW_KEY_LENGTHS, ABW_VARIANTS, ABW_LENGTHS_ALIGNED, ABW_NARGS
};
_Static_assert(ABW_NARGS <= MAX_ARGS, "a call holds attention_backward()'s arguments");

/* The shapes are checked by attn_arrays, not by the skeleton's tables. */
static const arg_spec attention_backward_args[ABW_NARGS] = {
    [ABW_DOUT] = {.name = "dout", .kind = ARG_ARRAY},
    [ABW_Q] = {.name = "q", .kind = ARG_ARRAY},
    [ABW_K] = {.name = "k", .kind = ARG_ARRAY},
    [ABW_V] = {.name = "v", .kind = ARG_ARRAY},
    [ABW_OUT] = {.name = "out", .kind = ARG_ARRAY},
    [ABW_LSE] = {.name = "lse", .kind = ARG_ARRAY_OPT},
    [ABW_SCALES] = {.name = "scales", .kind = ARG_FLOAT64},
    [ABW_MASK] = {.name = "mask", .kind = ARG_MASK},
    [ABW_CAUSAL] = {.name = "causal", .kind = ARG_BOOL},
    [ABW_KEY_LENGTHS] = {.name = "key_lengths", .kind = ARG_LENGTHS},
    [ABW_VARIANTS] = {.name = "variants", .kind = ARG_VARIANTS},
    [ABW_LENGTHS_ALIGNED] = {.name = "lengths_aligned", .kind = ARG_BOOL},
};

static const call_spec attention_backward_spec = {
    .name = "attention_backward", .nargs = ABW_NARGS,
    .args = attention_backward_args, .mask = ABW_MASK, .causal = ABW_CAUSAL,
    .key_lengths = ABW_KEY_LENGTHS, .variants = ABW_VARIANTS,
    .broadcast_mask = 1,
};

/* *res = a new reference to obj when it is a float ndarray of dtype
   typenum (q's) and nd dimensions, NULL for None when allow_none; else -1
   with an exception naming it. */
static int attn_array(PyArrayObject **res, PyObject *obj, const char *name, int typenum,
                      int nd, int allow_none)
{
    *res = NULL;
    if (obj == Py_None && allow_none)
        return 0;
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a numpy.ndarray%s, got %s", name,
                     allow_none ? " or None" : "", Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyArrayObject *a = (PyArrayObject *)obj;
    if (PyArray_TYPE(a) != typenum) {
        PyErr_Format(PyExc_TypeError, "%s: expected dtype %s (the dtype of q), got %R", name,
                     dtype_name(typenum), (PyObject *)PyArray_DESCR(a));
        return -1;
    }
    if (PyArray_NDIM(a) != nd) {
        PyObject *g = dims_tuple(PyArray_NDIM(a), PyArray_DIMS(a));
        if (g != NULL)
            PyErr_Format(PyExc_ValueError, "%s: expected a %d-D array, got shape %R", name, nd, g);
        Py_XDECREF(g);
        return -1;
    }
    Py_INCREF(a);
    *res = a;
    return 0;
}

/* A new (B, T, heads, d) C-contiguous array: the fused layout (B, T,
   heads d) of a (B, heads, T, d) one. */
static PyArrayObject *fused_empty(const npy_intp dims[4], int typenum)
{
    const npy_intp f[4] = {dims[0], dims[2], dims[1], dims[3]};
    return (PyArrayObject *)PyArray_EMPTY(4, f, typenum, 0);
}

/* fused's axes 1 and 2 swapped: a (B, heads, T, d) view of it. */
static PyArrayObject *fused_view(PyArrayObject *fused)
{
    npy_intp perm[4] = {0, 2, 1, 3};
    PyArray_Dims p = {perm, 4};
    return (PyArrayObject *)PyArray_Transpose(fused, &p);
}

/* *dst = a copy of a (B, heads, T, d), any strides, in the fused layout. */
static int fused_copy(PyArrayObject **dst, PyArrayObject *a)
{
    PyArrayObject *f = fused_empty(PyArray_DIMS(a), PyArray_TYPE(a)), *view;
    if (f == NULL || (view = fused_view(f)) == NULL) {
        Py_XDECREF(f);
        return -1;
    }
    const int res = PyArray_CopyInto(view, a);
    Py_DECREF(view);
    if (res < 0) {
        Py_DECREF(f);
        return -1;
    }
    *dst = f;
    return 0;
}

/* The arrays of attention_backward(): dtype and dimensions, then shapes
   against q's (B, H, Tq, dk), k's (G, Tk) and v's dv, in positional order.
   a[]: new references, NULL for lse None. */
static int attn_arrays(call *c, PyArrayObject *a[ABW_SCALES])
{
    static const int nd[ABW_SCALES] = {4, 4, 4, 4, 4, 3};
    static const char *const letters[ABW_SCALES] = {
        "(B, H, Tq, dv)", "(B, H, Tq, dk)", "(B, G, Tk, dk)", "(B, G, Tk, dv)",
        "(B, H, Tq, dv)", "(B, H, Tq)"};
    PyObject *q_o = c->arg[ABW_Q].obj;
    const int tq = PyArray_Check(q_o) ? PyArray_TYPE((PyArrayObject *)q_o) : -1;
    if (tq != NPY_FLOAT && tq != NPY_DOUBLE) {
        if (tq < 0)
            PyErr_Format(PyExc_TypeError, "q: expected a numpy.ndarray, got %s",
                         Py_TYPE(q_o)->tp_name);
        else
            PyErr_Format(PyExc_TypeError, "q: expected dtype float32 or float64, got %R",
                         (PyObject *)PyArray_DESCR((PyArrayObject *)q_o));
        return -1;
    }
    c->typenum = tq;
    for (int i = 0; i < ABW_SCALES; i++)
        if (attn_array(&a[i], c->arg[i].obj, attention_backward_args[i].name, tq, nd[i],
                       i == ABW_LSE) < 0)
            return -1;
    const npy_intp *q = PyArray_DIMS(a[ABW_Q]), *k = PyArray_DIMS(a[ABW_K]);
    const npy_intp dv = PyArray_DIM(a[ABW_V], 3);
    const npy_intp want[ABW_SCALES][4] = {
        {q[0], q[1], q[2], dv}, {q[0], q[1], q[2], q[3]}, {q[0], k[1], k[2], q[3]},
        {q[0], k[1], k[2], dv}, {q[0], q[1], q[2], dv}, {q[0], q[1], q[2]}};
    for (int i = 0; i < ABW_SCALES; i++)
        if (a[i] != NULL && check_shape(a[i], attention_backward_args[i].name, nd[i], want[i],
                                        letters[i]) < 0)
            return -1;
    return 0;
}

/* The sizes by letter and the head widths (c->widths) of a (B, H, Tq, dk)
   q, (B, G, Tk, dk) k and (B, G, Tk, dv) v; the fused widths are heads
   times width. */
static int attn_sizes(call *c, PyArrayObject *const a[ABW_SCALES])
{
    npy_intp *n = c->size;
    const npy_intp B = PyArray_DIM(a[ABW_Q], 0), H = PyArray_DIM(a[ABW_Q], 1);
    const npy_intp G = PyArray_DIM(a[ABW_K], 1), dk = PyArray_DIM(a[ABW_Q], 3);
    const npy_intp dv = PyArray_DIM(a[ABW_V], 3);
    if (G == 0 || H == 0 || H % G != 0 || dk == 0 || dv == 0) {
        PyErr_Format(PyExc_ValueError, "k: expected G >= 1 kv heads dividing the H = %zd "
                     "query heads, and head widths >= 1, got G = %zd, dk = %zd, dv = %zd",
                     (Py_ssize_t)H, (Py_ssize_t)G, (Py_ssize_t)dk, (Py_ssize_t)dv);
        return -1;
    }
    if ((size_t)dk > MHA_MAX_ELEMS / (size_t)H || (size_t)dv > MHA_MAX_ELEMS / (size_t)H) {
        PyErr_SetString(PyExc_ValueError, "q, v: sizes overflow");
        return -1;
    }
    if ((c->widths = PyMem_Malloc(2 * (size_t)G * sizeof *c->widths)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (npy_intp g = 0; g < G; g++)
        c->widths[g] = (size_t)dk, c->widths[G + g] = (size_t)dv;
    n[L_B] = B, n[L_H] = H, n[L_TQ] = PyArray_DIM(a[ABW_Q], 2), n[L_TK] = PyArray_DIM(a[ABW_K], 2);
    n[L_SQ] = n[L_DIN] = H * dk, n[L_SK] = n[L_DKIN] = G * dk;
    n[L_SV] = n[L_DVIN] = G * dv, n[L_SVQ] = n[L_DOUT] = H * dv;
    return 0;
}

/* attention_backward()'s config: sizes, scales, lengths, mask and the
   variants (the q/k transforms off), checked by the core; then the
   snapshot of every array in the fused layout (lse as a copy). */
static int attn_config(call *c, const call_spec *sp)
{
    PyArrayObject *a[ABW_SCALES] = {NULL};
    int res = -1;
    if (attn_arrays(c, a) < 0 || attn_sizes(c, a) < 0 ||
        as_vector(&c->in[ABW_SCALES], c->arg[ABW_SCALES].obj, "scales", NPY_DOUBLE) < 0 ||
        check_shape(c->in[ABW_SCALES], "scales", 1, &c->size[L_H], "(H,)") < 0)
        goto done;
    const npy_intp *n = c->size;
    mha_mask_kind mask_kind;
    ptrdiff_t ms[4];
    if (as_lengths(&c->lengths, c->arg[ABW_KEY_LENGTHS].obj, n[L_B], n[L_TK]) < 0 ||
        convert_mask(c, sp, &mask_kind, ms) < 0 ||
        snapshot_scales(&c->scales, c->in[ABW_SCALES]) < 0)
        goto done;
    const size_t G = (size_t)PyArray_DIM(a[ABW_K], 1);
    c->cfg = (mha_config){
        .B = (size_t)n[L_B], .Tq = (size_t)n[L_TQ], .Tk = (size_t)n[L_TK],
        .Din = (size_t)n[L_DIN], .Dkin = (size_t)n[L_DKIN], .Dvin = (size_t)n[L_DVIN],
        .Dout = (size_t)n[L_DOUT], .H = (size_t)n[L_H], .G = G,
        .dk = c->widths, .dv = c->widths + G, .scale = c->scales,
        .causal = c->arg[ABW_CAUSAL].truth, .mask_kind = mask_kind,
        .mask = DATA(c->in[ABW_MASK]), .mask_stride = {ms[0], ms[1], ms[2], ms[3]},
        .key_lengths = c->lengths, .lengths_aligned = c->arg[ABW_LENGTHS_ALIGNED].truth,
    };
    if (read_variants(c, c->arg[ABW_VARIANTS].obj) < 0)
        goto done;
    if (c->cfg.q_norm != NULL || c->cfg.k_norm != NULL || c->cfg.rotary_dim != 0) {
        PyErr_SetString(PyExc_ValueError, "variants: q_norm, k_norm and RoPE belong to the "
                        "projections (project()), not to attention_backward()");
        goto done;
    }
    mha_layout lay;
    mha_error err;
    const mha_status st = mha_check_config(&lay, &c->cfg, &err);
    if (st != MHA_OK) {
        raise_check(st, &err);
        goto done;
    }
    for (int i = 0; i < ABW_LSE; i++)
        if (fused_copy(&c->in[i], a[i]) < 0)
            goto done;
    if (a[ABW_LSE] != NULL &&
        (c->in[ABW_LSE] = (PyArrayObject *)PyArray_NewCopy(a[ABW_LSE], NPY_CORDER)) == NULL)
        goto done;
    res = 0;
done:
    for (int i = 0; i < ABW_SCALES; i++)
        Py_XDECREF(a[i]);
    return res;
}

/* Fused dq, dk, dv (out[0..2]), dsinks (out[3]). */
static mha_status attention_backward_core(const call *c)
{
    PyArrayObject *const *in = c->in, *const *out = c->out;
    const mha_params prm = {
        .dtype = DTYPE_OF(c->typenum),
        .dq = DATA(out[0]), .dk = DATA(out[1]), .dv = DATA(out[2]),
        .dsinks = DATA(out[3]), .dout = DATA(in[ABW_DOUT]), .q = DATA(in[ABW_Q]),
        .k = DATA(in[ABW_K]), .v = DATA(in[ABW_V]), .out = DATA(in[ABW_OUT]),
        .lse = DATA(in[ABW_LSE]),
    };
    return mha_attend_backward(&c->cfg, &prm, NULL);
}

static PyObject *attention_backward(PyObject *self, PyObject *const *argv,
                                    Py_ssize_t nargs, PyObject *kwnames)
{
    (void)self;
    const call_spec *sp = &attention_backward_spec;
    call c;
    PyObject *result = NULL;
    PyArrayObject *grad[3] = {NULL, NULL, NULL};
    call_init(&c);
    const int parsed = kwnames == NULL && nargs == ABW_NARGS
                           ? read_positional(&c, sp, argv, nargs)
                           : parse_fastcall(&c, sp, argv, nargs, kwnames);
    if (parsed < 0 || attn_config(&c, sp) < 0)
        goto fail;
    // The gradients in the fused layout, as q, k, v's snapshots.
    for (int i = 0; i < 3; i++)
        if ((c.out[i] = (PyArrayObject *)PyArray_EMPTY(4, PyArray_DIMS(c.in[ABW_Q + i]),
                                                       c.typenum, 0)) == NULL)
            goto fail;
    if (c.var[V_SINKS] != NULL &&
        (c.out[3] = (PyArrayObject *)PyArray_EMPTY(1, &c.size[L_H], c.typenum, 0)) == NULL)
        goto fail;
    if (run_core(&c, attention_backward_core, on_main_thread()) < 0)
        goto fail;
    for (int i = 0; i < 3; i++) {
        PyArrayObject *view = fused_view(c.out[i]);
        grad[i] = view != NULL ? (PyArrayObject *)PyArray_NewCopy(view, NPY_CORDER) : NULL;
        Py_XDECREF(view);
        if (grad[i] == NULL)
            goto fail;
    }
    result = PyTuple_Pack(4, (PyObject *)grad[0], (PyObject *)grad[1], (PyObject *)grad[2],
                          c.out[3] != NULL ? (PyObject *)c.out[3] : Py_None);
fail:
    for (int i = 0; i < 3; i++)
        Py_XDECREF(grad[i]);
    call_release(&c);
    return result;
}

PyDoc_STRVAR(get_isa_doc,
"get_isa()\n"
"--\n\n"
"The instruction set of the kernels now in force: 'avx512', 'avx2',\n"
"'neon' or 'scalar' (detected once, capped by MHATTN_ISA or set_isa).");

static PyObject *get_isa(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyUnicode_FromString(mha_isa_name(mha_get_isa()));
}

PyDoc_STRVAR(set_isa_doc,
"set_isa(name)\n"
"--\n\n"
"Caps the instruction set at name ('scalar', 'avx2', 'avx512' or 'neon'),\n"
"lowered to what this CPU supports; for tests. Returns the ISA now in force.");

static PyObject *set_isa(PyObject *self, PyObject *name)
{
    (void)self;
    static const mha_isa all[] = {MHA_ISA_SCALAR, MHA_ISA_AVX2, MHA_ISA_AVX512,
                                  MHA_ISA_NEON};
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
                 "name: expected 'scalar', 'avx2', 'avx512' or 'neon', got %R", name);
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
    {"pack_weight", pack_weight, METH_O, pack_weight_doc},
    {"packed_info", packed_info, METH_O, packed_info_doc},
    {"set_isa", set_isa, METH_O, set_isa_doc},
    {"get_num_threads", get_num_threads, METH_NOARGS, get_num_threads_doc},
    {"set_num_threads", set_num_threads, METH_O, set_num_threads_doc},
    {"backward", (PyCFunction)(void (*)(void))backward,
     METH_VARARGS | METH_KEYWORDS, backward_doc},
    {"attention", (PyCFunction)(void (*)(void))attention,
     METH_FASTCALL | METH_KEYWORDS, attention_doc},
    {"project", (PyCFunction)(void (*)(void))project,
     METH_FASTCALL | METH_KEYWORDS, project_doc},
    {"attention_backward", (PyCFunction)(void (*)(void))attention_backward,
     METH_FASTCALL | METH_KEYWORDS, attention_backward_doc},
    {NULL, NULL, 0, NULL},
};

/*
 * Multi-phase init (PEP 489), so that the module can declare its slots.
 *
 * Py_mod_gil = Py_MOD_GIL_NOT_USED (3.13+, PEP 703): this module is safe to
 * run without the GIL. The argument for each piece of shared state:
 *   - the core already runs with the GIL released, concurrently with other
 *     calls, so nothing it touches relied on the GIL: the thread pool
 *     (csrc/core/threads.c: one owner at a time by compare-and-swap, the
 *     others run inline; the settings are atomics), the ISA choice
 *     (dispatch.c: an atomic) and the scratch (per call);
 *   - the glue's own state is the SIGINT state above (argued there) and
 *     nothing else mutable: every other static is const. Each call's
 *     arguments, conversions and outputs are its own; arrays a caller
 *     shares between threads are read (or written) as they already are
 *     while the GIL is released;
 *   - the Python fast path's caches (python/mhattn/_core.py, _HEADS and
 *     _LENGTHS) are dicts whose single operations are atomic in the
 *     free-threaded build, hold read-only arrays, and at worst are filled
 *     twice with equal values by racing threads (argued there).
 * Py_mod_multiple_interpreters: not supported (3.12+), as for the
 * single-phase module this was: the SIGINT state and the pool are
 * process-wide, and NumPy does not support subinterpreters.
 */
static int mhattn_exec(PyObject *module)
{
    import_array1(-1);
    /* 1 in the test build whose 'avx512' kernels are emulated in plain C
       (setup.py MHATTN_EMULATE_AVX512=1; csrc/kernels/simd_emu512.h) */
#if MHA_EMULATE_AVX512
    const long emulated = 1;
#else
    const long emulated = 0;
#endif
    if (PyModule_AddIntConstant(module, "EMULATED_AVX512", emulated) < 0)
        return -1;
    return sigint_setup();
}

static PyModuleDef_Slot mhattn_slots[] = {
    {Py_mod_exec, (void *)mhattn_exec},
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
#if PY_VERSION_HEX >= 0x030D0000
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef mhattn_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mhattn._C",
    .m_doc = "C core of mhattn (multi-head attention).",
    .m_size = 0,
    .m_methods = mhattn_methods,
    .m_slots = mhattn_slots,
};

PyMODINIT_FUNC PyInit__C(void)
{
    return PyModuleDef_Init(&mhattn_module);
}
