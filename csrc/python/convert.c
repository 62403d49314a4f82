/*
 * convert.c - the glue's conversions: arrays (checked, then made C-contiguous),
 * the shapes checked against the call's sizes by letter, the mask, the key
 * lengths, the head widths and the snapshots of them that the core reads.
 */
#include "glue.h"

#include <string.h>

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
int check_shape(PyArrayObject *a, const char *name, int nd,
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
void prefix_error(const char *name)
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

/* *res = a itself when its strides over its leading axes ((B, heads, T)
   of a 4-D array, (B, G, Tk) but the last of a cache's 3-D scales) are
   non-negative multiples of its item size and its last axis is
   contiguous, and it is aligned and native (the core reads it in place),
   else a C-contiguous copy in native byte order. */
static int as_strided(PyArrayObject **res, PyArrayObject *a)
{
    const npy_intp item = PyArray_ITEMSIZE(a);
    const int last = PyArray_NDIM(a) - 1;
    int in_place = PyArray_ISALIGNED(a) && PyArray_ISNOTSWAPPED(a) &&
                   (PyArray_DIM(a, last) <= 1 || PyArray_STRIDE(a, last) == item);
    for (int d = 0; d < last; d++)
        in_place &= PyArray_STRIDE(a, d) >= 0 && PyArray_STRIDE(a, d) % item == 0;
    if (in_place) {
        Py_INCREF(a);
        *res = a;
        return 0;
    }
    // The copy in native byte order: a byte-swapped array's elements
    // would otherwise reach the core swapped.
    PyArray_Descr *native = PyArray_DescrNewByteorder(PyArray_DESCR(a), NPY_NATIVE);
    if (native == NULL)
        return -1;
    *res = (PyArrayObject *)PyArray_FromArray(
        a, native, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | NPY_ARRAY_ENSURECOPY);
    return *res == NULL ? -1 : 0;
}

/* What a KV cache's storage array holds (mha_kv_storage): float16 is
   NumPy's own; bfloat16 a user dtype (ml_dtypes registers it) known by
   its scalar type's name, so the glue imports no ml_dtypes; int8. -1 for
   anything else. */
int kv_storage_of(PyArrayObject *a)
{
    if (PyArray_TYPE(a) == NPY_HALF)
        return MHA_KV_F16;
    if (PyArray_TYPE(a) == NPY_INT8)
        return MHA_KV_I8;
    return glue_is_bfloat16(a) ? MHA_KV_BF16 : -1;
}

/* glue.h: a user dtype of 2 bytes whose scalar type is named bfloat16
   (tp_name "ml_dtypes.bfloat16", or a bare "bfloat16"): no import of
   ml_dtypes is needed. */
int glue_is_bfloat16(PyArrayObject *a)
{
    PyArray_Descr *d = PyArray_DESCR(a);
    if (PyArray_TYPE(a) < NPY_USERDEF || PyDataType_ELSIZE(d) != 2)
        return 0;
    const char *name = d->typeobj->tp_name, *dot = strrchr(name, '.');
    return strcmp(dot != NULL ? dot + 1 : name, "bfloat16") == 0;
}

static int is_vector(arg_kind kind)
{
    return kind == ARG_INT64 || kind == ARG_FLOAT64;
}

/* One of a group of arrays that hold one storage (k and v; the weights),
   converted in positional order from `first`: the first sets *group, and
   each other must hold the same (kind < 0: plain). -1 with a TypeError
   naming both otherwise. */
static int stored_alike(const call *c, const call_spec *sp, int pos, int first, int kind,
                        mha_kv_storage *group, const char *what)
{
    const int got = kind < 0 ? MHA_KV_PLAIN : kind;
    if (pos == first)
        *group = (mha_kv_storage)got;
    if (got == (int)*group)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s: dtype %S, but %s has dtype %S: %s must be stored alike",
                 sp->args[pos].name, (PyObject *)PyArray_DESCR((PyArrayObject *)c->arg[pos].obj),
                 sp->args[first].name,
                 (PyObject *)PyArray_DESCR((PyArrayObject *)c->arg[first].obj), what);
    return -1;
}

/*
 * The one array converter: c->in[pos] = the argument at pos as its
 * arg_spec says. A vector (ARG_INT64, ARG_FLOAT64) is any object NumPy
 * converts to a 1-D array of that dtype with its safe casting, made
 * C-contiguous. A float array must be an ndarray of the call's dtype (x's,
 * or q's) and of the table's ndim, and is handed to the core as the call's
 * layout says; None stands for an absent one (ARG_ARRAY_OPT: NULL) or for
 * another input (ARG_ARRAY_ALIAS: a new reference to that input's array).
 * -1 with an exception naming the argument on failure.
 */
static int convert_array(call *c, const call_spec *sp, int pos)
{
    const arg_spec *a = &sp->args[pos];
    PyArrayObject **res = &c->in[pos];
    PyObject *obj = c->arg[pos].obj;
    if (is_vector(a->kind))
        return as_c_array(res, obj, a->name, a->kind == ARG_INT64 ? NPY_INT64 : NPY_DOUBLE, 1);
    const int allow_none = a->kind != ARG_ARRAY, nd = a->shape.nd;
    if (obj == Py_None && allow_none) {
        if (a->kind == ARG_ARRAY_ALIAS) {
            *res = c->in[a->alias];
            Py_INCREF(*res);
        }
        return 0;
    }
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a numpy.ndarray%s, got %s",
                     a->name, allow_none ? " or None" : "", Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyArrayObject *arr = (PyArrayObject *)obj;
    const int kv_role = sp->kv_storage && (pos == sp->key || pos == sp->value);
    const int w_role = sp->w_storage && (pos == sp->wq || pos == sp->wk || pos == sp->wv ||
                                         pos == sp->wo || pos == sp->wgate);
    // k and v may hold a KV cache's half or int8, the weights half values:
    // the core widens them as it reads (packs) them
    int kind = (kv_role || w_role) && c->typenum == NPY_FLOAT ? kv_storage_of(arr) : -1;
    kind = w_role && kind == MHA_KV_I8 ? -1 : kind;
    if (PyArray_TYPE(arr) != c->typenum && kind < 0) {
        PyErr_Format(PyExc_TypeError, "%s: expected dtype %s (the dtype of %s)%s, got %R",
                     a->name, dtype_name(c->typenum), sp->args[sp->x].name,
                     kv_role  ? ", or a KV cache's float16, bfloat16 or int8 with float32 q"
                     : w_role ? ", or float16 or bfloat16 with float32 x"
                              : "",
                     (PyObject *)PyArray_DESCR(arr));
        return -1;
    }
    if ((kv_role && stored_alike(c, sp, pos, sp->key, kind, &c->kv, "k and v") < 0) ||
        (w_role && stored_alike(c, sp, pos, sp->wq, kind, &c->w, "the weights") < 0))
        return -1;
    if (PyArray_NDIM(arr) != nd) {
        PyObject *g = dims_tuple(PyArray_NDIM(arr), PyArray_DIMS(arr));
        if (g != NULL)
            PyErr_Format(PyExc_ValueError,
                         "%s: expected a %d-D array, got shape %R", a->name, nd, g);
        Py_XDECREF(g);
        return -1;
    }
    switch (sp->layout) {
    case LAYOUT_STRIDED:
        return as_strided(res, arr);
    case LAYOUT_KEEP:
        Py_INCREF(arr);
        *res = arr;
        return 0;
    default:
        return as_c_array(res, obj, a->name, kind < 0 ? c->typenum : PyArray_TYPE(arr), nd);
    }
}

/*
 * The dtype of x (q for attention on projected tensors) is the compute
 * dtype. Converts the float arrays in positional order; the vectors are
 * converted by the family's sizes step (convert_vectors), where its order
 * of errors puts them; masks and lengths need the sizes, and truths are
 * read as parsed.
 */
int convert_arrays(call *c, const call_spec *sp)
{
    const char *x = sp->args[sp->x].name;
    PyObject *x_o = c->arg[sp->x].obj;
    if (!PyArray_Check(x_o)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a numpy.ndarray, got %s", x,
                     Py_TYPE(x_o)->tp_name);
        return -1;
    }
    c->typenum = PyArray_TYPE((PyArrayObject *)x_o);
    if (c->typenum != NPY_FLOAT && c->typenum != NPY_DOUBLE) {
        PyErr_Format(PyExc_TypeError, "%s: expected dtype float32 or float64, got %R", x,
                     (PyObject *)PyArray_DESCR((PyArrayObject *)x_o));
        return -1;
    }
    for (int i = 0; i < sp->nargs; i++)
        if (sp->args[i].kind <= ARG_ARRAY_ALIAS && convert_array(c, sp, i) < 0)
            return -1;
    return 0;
}

/* The vectors (dk, dv, scales) in positional order. */
int convert_vectors(call *c, const call_spec *sp)
{
    for (int i = 0; i < sp->nargs; i++)
        if (is_vector(sp->args[i].kind) && convert_array(c, sp, i) < 0)
            return -1;
    return 0;
}

/* The core's verdict on H query heads and G kv heads: the glue needs H / G
   to lay out the fused widths before a call's config is complete, so it
   asks the core's rule alone (mha_check_heads, which mha_check_config
   applies too: the rule and its message live there, once). -1 with the
   core's ValueError (call.c, raise_status) when H or G is wrong. */
int check_heads(npy_intp H, npy_intp G)
{
    mha_error err;
    const mha_status st = mha_check_heads((size_t)H, (size_t)G, &err);
    if (st == MHA_OK)
        return 0;
    raise_status(st, &err);
    return -1;
}

/* Head widths dk, dv (G,) as size_t in *widths (2G, PyMem; dk then dv),
   checked against the H = len(scales) query heads (check_heads), and the
   fused widths fused = {Sq, Sk, Sv, Svq} (see mha.h). -1 with an
   exception on failure. */
int head_widths(size_t **widths, size_t fused[4], PyArrayObject *dk_a,
                       PyArrayObject *dv_a, npy_intp H)
{
    const npy_intp G = PyArray_DIM(dk_a, 0);
    if (check_heads(H, G) < 0)
        return -1;
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
        // As size_t; a width of 0 is the core's to reject (mha_check_config).
        if (dk_g < 0 || dv_g < 0 || (uint64_t)dk_g > MHA_MAX_ELEMS ||
            (uint64_t)dv_g > MHA_MAX_ELEMS) {
            PyErr_Format(PyExc_ValueError,
                         "dk, dv: head widths must be between 0 and %zu, got "
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

/* The G kv heads all of width dk and dv (attention on projected tensors):
   c->widths as head_widths makes it. */
int uniform_widths(call *c, npy_intp G, npy_intp dk, npy_intp dv)
{
    if ((c->widths = PyMem_Malloc(2 * (size_t)G * sizeof *c->widths)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (npy_intp g = 0; g < G; g++) {
        c->widths[g] = (size_t)dk;
        c->widths[G + g] = (size_t)dv;
    }
    return 0;
}

/* key_lengths: None (*snap stays NULL) or int64 (B,), copied into *snap
   (B, PyMem): the core checks and reads the copy, which no other thread
   can change once the GIL is released. */
int as_lengths(int64_t **snap, PyObject *obj, npy_intp B)
{
    *snap = NULL;
    if (obj == Py_None)
        return 0;
    PyArrayObject *a;
    if (as_c_array(&a, obj, "key_lengths", NPY_INT64, 1) < 0)
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
    return res;   // each length in [0, Tk]: the core's rule (mha_check_config)
}

/* scales (H,) float64 copied into *snap (H, PyMem), for the same reason. */
int snapshot_scales(double **snap, PyArrayObject *scales)
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

/* The sizes of shape s, given the call's sizes by letter. */
void shape_dims(npy_intp dims[4], const shape *s, const npy_intp size[N_LETTERS])
{
    for (int d = 0; d < s->nd; d++)
        dims[d] = size[s->dim[d]];
}

static const char *const letter_name[N_LETTERS] = {
    "B", "Tq", "Tk", "Din", "Dkin", "Dvin", "Dout", "H",
    "Sq", "Sk", "Sv", "Svq", "G", "dk", "dv"};

/* a's shape's letters as a Python tuple would print, "(B, Tk, Dkin)",
   "(Sq,)", then its note if it has one. */
static void shape_letters(char buf[96], const arg_spec *a)
{
    const shape *s = &a->shape;
    int n = snprintf(buf, 96, "(");
    for (int d = 0; d < s->nd; d++)
        n += snprintf(buf + n, (size_t)(96 - n), "%s%s", d ? ", " : "",
                      letter_name[s->dim[d]]);
    snprintf(buf + n, (size_t)(96 - n), "%s%s", s->nd == 1 ? ",)" : ")",
             a->note != NULL ? a->note : "");
}

/* Checks the shapes of the float arrays at the positions pos (ended by
   -1; NULL for none) against c->size; None (absent) arrays are skipped. */
int check_shapes(const call *c, const call_spec *sp, const int *pos)
{
    for (; pos != NULL && *pos >= 0; pos++) {
        const arg_spec *a = &sp->args[*pos];
        PyArrayObject *arr = c->in[*pos];
        npy_intp want[4];
        char letters[96];
        if (arr == NULL)
            continue;
        shape_dims(want, &a->shape, c->size);
        if (same_shape(arr, a->shape.nd, want))
            continue;
        shape_letters(letters, a);
        return check_shape(arr, a->name, a->shape.nd, want, letters);
    }
    return 0;
}

/* The mask as the core reads it (see as_mask), broadcast first when the
   function allows it (see broadcast_mask). */
int convert_mask(call *c, const call_spec *sp, mha_mask_kind *kind,
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
