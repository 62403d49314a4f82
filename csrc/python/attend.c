/*
 * attend.c - attention on projected tensors (issue 17): attention() and
 * attention_backward(), each with its call_spec (its argument table and
 * the fields that follow from its arguments are generated: args_gen.h),
 * and the steps of their family that the skeleton (call.c)
 * runs: the sizes from q, k and v (one head width for every head), the
 * outputs, the result.
 */
#include "glue.h"

/* The sizes by letter from a (B, H, Tq, dk) q, a (B, G, Tk, dk) k and a
   (B, G, Tk, dv) v, their shapes unchecked. */
static void attend_letters(call *c, PyArrayObject *q, PyArrayObject *k, PyArrayObject *v)
{
    sizes_from(c->size, q, 4, (const signed char[]){L_B, L_H, L_TQ, L_DK});
    sizes_from(c->size, k, 4, (const signed char[]){-1, L_G, L_TK, -1});
    sizes_from(c->size, v, 4, (const signed char[]){-1, -1, -1, L_DV});
}

/* ---- attention ---------------------------------------------------------- */

/* block_table: None (c->table stays NULL) or int32 (B, P), P >= 1, copied
   into c->table (B P, PyMem): the core indexes the page pools with its
   entries, which it checks on this copy (mha_check_config: each in [0,
   num_pages)) before any is used, and which no other thread can change once
   the GIL is released. NumPy's safe casting: int64 entries are refused. */
static int as_block_table(call *c, PyObject *obj, npy_intp B)
{
    c->table = NULL;
    c->pages_per_seq = 0;
    if (obj == Py_None)
        return 0;
    PyArrayObject *a;
    a = (PyArrayObject *)PyArray_FROMANY(obj, NPY_INT32, 2, 2, NPY_ARRAY_IN_ARRAY);
    if (a == NULL) {
        prefix_error("block_table");
        return -1;
    }
    const npy_intp P = PyArray_DIM(a, 1);
    int res = 0;
    if (PyArray_DIM(a, 0) != B || P < 1) {
        PyErr_Format(PyExc_ValueError, "block_table: expected shape (B, pages_per_seq) = "
                     "(%zd, >= 1) (q's B), got (%zd, %zd)", (Py_ssize_t)B,
                     (Py_ssize_t)PyArray_DIM(a, 0), (Py_ssize_t)P);
        res = -1;
    }
    const size_t n = (size_t)B * (size_t)P;
    if (res == 0 && (c->table = PyMem_Malloc(n * sizeof *c->table + 1)) == NULL) {
        PyErr_NoMemory();
        res = -1;
    }
    if (res == 0) {
        memcpy(c->table, PyArray_DATA(a), n * sizeof *c->table);
        c->pages_per_seq = (size_t)P;
    }
    Py_DECREF(a);
    return res;
}

/* A paged cache (block_table, c->table): k, v (num_pages, G, page_size,
   dk | dv) and the int8 scales (num_pages, G, page_size) are page pools,
   checked here instead of against (B, G, Tk); Tk is what the table's
   pages hold, pages_per_seq page_size (the lengths say how many keys each
   item has). q and the scales are checked as usual. */
static int paged_sizes(call *c)
{
    npy_intp *n = c->size;
    PyArrayObject *k = c->in[ATT_K];
    const npy_intp P = PyArray_DIM(k, 0), ps = PyArray_DIM(k, 2);
    const npy_intp G = PyArray_DIM(k, 1), dk = PyArray_DIM(k, 3);
    const npy_intp dv = PyArray_DIM(c->in[ATT_V], 3);
    if (P < 1 || ps < 1) {
        PyErr_Format(PyExc_ValueError, "k: a paged cache's pool (num_pages, G, page_size, dk) "
                     "needs num_pages >= 1 and page_size >= 1, got num_pages = %zd, "
                     "page_size = %zd", (Py_ssize_t)P, (Py_ssize_t)ps);
        return -1;
    }
    if ((size_t)ps > MHA_MAX_ELEMS / c->pages_per_seq) {
        PyErr_Format(PyExc_ValueError, "block_table: %zu pages of page_size = %zd overflow",
                     c->pages_per_seq, (Py_ssize_t)ps);
        return -1;
    }
    c->page_size = (size_t)ps, c->num_pages = (size_t)P;
    n[L_TK] = (npy_intp)(c->pages_per_seq * (size_t)ps);
    const npy_intp wq[4] = {n[L_B], n[L_H], n[L_TQ], dk}, wv[4] = {P, G, ps, dv};
    const npy_intp wsc[3] = {P, G, ps};
    if (check_shape(c->in[ATT_Q], "q", 4, wq, "(B, H, Tq, dk), dk from k") < 0 ||
        check_shape(c->in[ATT_V], "v", 4, wv, "(num_pages, G, page_size, dv) from k") < 0)
        return -1;
    for (int i = 0; i < 2; i++) {
        PyArrayObject *a = c->in[ATT_K_SCALES + i];
        if (a != NULL && check_shape(a, i ? "v_scales" : "k_scales", 3, wsc,
                                     "(num_pages, G, page_size) from k") < 0)
            return -1;
    }
    return 0;
}

/*
 * The scales converted; the sizes from q, k and v, whose shapes (and
 * scales') are checked against them: H a positive multiple of G, widths
 * >= 1. The head widths, and the element strides of q, k and v (c->st)
 * over (B, heads, T): the last axis is contiguous.
 */
static int attention_sizes(call *c, const call_spec *sp)
{
    if (convert_vectors(c, sp) < 0)
        return -1;
    attend_letters(c, c->in[ATT_Q], c->in[ATT_K], c->in[ATT_V]);
    npy_intp *n = c->size;
    const npy_intp H = n[L_H], G = n[L_G];
    if (as_block_table(c, c->arg[ATT_BLOCK_TABLE].obj, n[L_B]) < 0)
        return -1;
    if (c->table != NULL) {
        if (paged_sizes(c) < 0)
            return -1;
    } else if (check_shapes(c, sp, sp->checks_x) < 0) {
        return -1;
    }
    if (check_heads(H, G) < 0)   // the widths (>= 1) are the core's, in mha_attend
        return -1;
    // No projections: the config's projection sizes stay 0.
    n[L_DIN] = n[L_DKIN] = n[L_DVIN] = n[L_DOUT] = 0;
    n[L_SQ] = n[L_SK] = n[L_SV] = n[L_SVQ] = 0;
    for (int i = 0; i < 3; i++) {
        PyArrayObject *a = c->in[ATT_Q + i];
        const npy_intp item = PyArray_ITEMSIZE(a);
        c->st[i] = (mha_strides){(size_t)(PyArray_STRIDE(a, 0) / item),
                                 (size_t)(PyArray_STRIDE(a, 1) / item),
                                 (size_t)(PyArray_STRIDE(a, 2) / item)};
    }
    // An int8 cache's scales (B, G, Tk): strides over (B, G) and between
    // keys; whether they go with k's storage is the core's rule.
    for (int i = 0; i < 2; i++) {
        PyArrayObject *a = c->in[ATT_K_SCALES + i];
        c->st[4 + i] = (mha_strides){0, 0, 0};
        if (a == NULL)
            continue;
        const npy_intp item = PyArray_ITEMSIZE(a);
        c->st[4 + i] = (mha_strides){(size_t)(PyArray_STRIDE(a, 0) / item),
                                     (size_t)(PyArray_STRIDE(a, 1) / item),
                                     (size_t)(PyArray_STRIDE(a, 2) / item)};
    }
    return uniform_widths(c, G, n[L_DK], n[L_DV]);
}

/* The variants as for forward(); the q/k transforms, which belong to the
   projections, and lengths_aligned with packed sequences are the core's to
   reject (mha_attend: mha_check_no_qk, mha_check_config). */

/* out (B, H, Tq, dv) or, out_bthd, (B, Tq, H, dv); weights, lse if
   wanted; c->st[3] = out's strides. */
static int attention_outputs(call *c)
{
    const npy_intp *n = c->size;
    const size_t H = (size_t)n[L_H], Tq = (size_t)n[L_TQ], dv = (size_t)n[L_DV];
    const int out_bthd = c->arg[ATT_OUT_BTHD].truth;
    c->st[3] = out_bthd ? (mha_strides){Tq * H * dv, dv, H * dv}
                        : (mha_strides){H * Tq * dv, Tq * dv, dv};
    const int want[ATT_NOUTS] = {
        [ATT_OUT] = 1, [ATT_WEIGHTS] = c->arg[ATT_WANT_WEIGHTS].truth,
        [ATT_LSE] = c->arg[ATT_WANT_LSE].truth};
    return make_outputs(c, ATT_NOUTS, attention_outs[out_bthd], want);
}

/* Multiply-adds of attention: as forward(), a small call runs without the
   Ctrl-C handler. */
static double attention_work(const call *c)
{
    const npy_intp *n = c->size;
    return (double)n[L_B] * (double)n[L_H] * (double)n[L_TQ] * (double)n[L_TK] *
           (double)(n[L_DK] + n[L_DV]);
}

static PyObject *attention_result(call *c)
{
    return arrays_tuple(c->out, ATT_NOUTS);
}

/* mha_attend checks its own config (.checked 0): no projections. */
static const call_spec attention_spec = {
    ATTENTION_SPEC_ARGS, .layout = LAYOUT_STRIDED, .broadcast_mask = 1, .has_wo = 1, .checked = 0,
    .kv_storage = 1,
    .sizes = attention_sizes, .check = NULL, .finish = NULL,
    .outputs = attention_outputs, .work = attention_work, .core = attention_core,
    .result = attention_result,
};

GLUE_FASTCALL_ENTRY(attention, ATTENTION_DOC)

/* ---- attention_backward ------------------------------------------------- */

/* The sizes from q, k and v, every array's shape checked against them,
   the head widths (the fused widths are heads times width, and stand for
   the projections' sizes too); then the scales, converted and checked. */
static int attention_backward_sizes(call *c, const call_spec *sp)
{
    attend_letters(c, c->in[ABW_Q], c->in[ABW_K], c->in[ABW_V]);
    npy_intp *n = c->size;
    const npy_intp H = n[L_H], G = n[L_G], dk = n[L_DK], dv = n[L_DV];
    if (check_shapes(c, sp, sp->checks_x) < 0)
        return -1;
    if (check_heads(H, G) < 0)   // the widths (>= 1) are the core's
        return -1;
    if ((size_t)dk > MHA_MAX_ELEMS / (size_t)H || (size_t)dv > MHA_MAX_ELEMS / (size_t)H) {
        PyErr_SetString(PyExc_ValueError, "q, v: sizes overflow");
        return -1;
    }
    if (uniform_widths(c, G, dk, dv) < 0)
        return -1;
    n[L_SQ] = n[L_DIN] = H * dk, n[L_SK] = n[L_DKIN] = G * dk;
    n[L_SV] = n[L_DVIN] = G * dv, n[L_SVQ] = n[L_DOUT] = H * dv;
    if (convert_vectors(c, sp) < 0)
        return -1;
    return check_shapes(c, sp, sp->checks_widths);
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

/* Once the config is checked: the snapshot the core reads of every array
   in the fused layout (lse as a C-contiguous copy), in place of the
   caller's arrays the converter kept (LAYOUT_KEEP). */
static int attention_backward_fused(call *c)
{
    for (int i = 0; i <= ABW_LSE; i++) {
        PyArrayObject *a = c->in[i];
        if (a == NULL)
            continue;
        int res;
        c->in[i] = NULL;
        if (i == ABW_LSE) {
            c->in[i] = (PyArrayObject *)PyArray_NewCopy(a, NPY_CORDER);
            res = c->in[i] != NULL ? 0 : -1;
        } else {
            res = fused_copy(&c->in[i], a);
        }
        Py_DECREF(a);
        if (res < 0)
            return -1;
    }
    return 0;
}

/* The gradients in the fused layout, as q, k, v's snapshots; dsinks (H,)
   when sinks are given. */
static int attention_backward_outputs(call *c)
{
    const int dmask = c->arg[ABW_WANT_DMASK].truth;
    const int want[ABW_NOUTS] = {1, 1, 1, c->var[V_SINKS] != NULL, dmask, 0};
    if (dmask && want_dmask_check(c) < 0)
        return -1;
    if (make_outputs(c, ABW_NOUTS, attention_backward_outs, want) < 0)
        return -1;
    // T5's table's gradient, shaped as the table.
    PyArrayObject *t = c->var[V_REL];
    if (t != NULL && (c->out[ABW_DREL_TABLE] = (PyArrayObject *)PyArray_EMPTY(
                          2, PyArray_DIMS(t), c->typenum, 0)) == NULL)
        return -1;
    return 0;
}

/* (dq, dk, dv, dsinks or None): dq, dk, dv C-contiguous copies of the
   fused gradients' (B, heads, T, d) views. */
static PyObject *attention_backward_result(call *c)
{
    PyArrayObject *grad[3] = {NULL, NULL, NULL};
    PyObject *result = NULL;
    for (int i = 0; i < 3; i++) {
        PyArrayObject *view = fused_view(c->out[ABW_DQ + i]);
        grad[i] = view != NULL ? (PyArrayObject *)PyArray_NewCopy(view, NPY_CORDER) : NULL;
        Py_XDECREF(view);
        if (grad[i] == NULL)
            goto done;
    }
    PyObject *dsinks = (PyObject *)c->out[ABW_DSINKS];
    // want_dmask: dmask, then with T5's bias drel_table, close the tuple.
    PyObject *items[6] = {(PyObject *)grad[0], (PyObject *)grad[1], (PyObject *)grad[2],
                          dsinks != NULL ? dsinks : Py_None};
    Py_ssize_t n = 4;
    if (c->out[ABW_DMASK] != NULL)
        items[n++] = (PyObject *)c->out[ABW_DMASK];
    if (c->out[ABW_DREL_TABLE] != NULL)
        items[n++] = (PyObject *)c->out[ABW_DREL_TABLE];
    result = PyTuple_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        Py_INCREF(items[i]);
        PyTuple_SET_ITEM(result, i, items[i]);
    }
done:
    for (int i = 0; i < 3; i++)
        Py_XDECREF(grad[i]);
    return result;
}

/* Every main-thread call polls for Ctrl-C (.work NULL). */
static const call_spec attention_backward_spec = {
    ATTENTION_BACKWARD_SPEC_ARGS, .layout = LAYOUT_KEEP, .broadcast_mask = 1, .has_wo = 0, .checked = 1,
    .sizes = attention_backward_sizes, .check = NULL,   /* the q/k transforms: mha_check_no_qk */
    .finish = attention_backward_fused, .outputs = attention_backward_outputs, .work = NULL,
    .core = attention_backward_core, .result = attention_backward_result,
};

GLUE_FASTCALL_ENTRY(attention_backward, ATTENTION_BACKWARD_DOC)
