/*
 * attend.c - attention on projected tensors (issue 17): attention() and
 * attention_backward(), each with its argument table.
 */
#include "glue.h"

/* ---- attention (issue 17) ---------------------------------------------- */

GLUE_DOC(attention_doc,
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
    void *w = DATA(c->out[1]), *l = DATA(c->out[2]);
    if (c->typenum == NPY_FLOAT)
        return mha_attend_f32(DATA(c->out[0]), w, l, DATA(c->in[ATT_Q]),
                              DATA(c->in[ATT_K]), DATA(c->in[ATT_V]), &s[0], &s[1],
                              &s[2], &s[3], &c->cfg);
    return mha_attend_f64(DATA(c->out[0]), w, l, DATA(c->in[ATT_Q]), DATA(c->in[ATT_K]),
                          DATA(c->in[ATT_V]), &s[0], &s[1], &s[2], &s[3], &c->cfg);
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

PyObject *attention(PyObject *self, PyObject *const *argv, Py_ssize_t nargs,
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

GLUE_DOC(attention_backward_doc,
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
    const mha_status st = mha_check_config(&lay, &c->cfg);
    if (st != MHA_OK) {
        raise_status(st);
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

/* mha_attend_backward_f32 and _f64 take the same arguments, each in its
   dtype: fused dq, dk, dv (out[0..2]), dsinks (out[3]). */
#define ATTEND_BACKWARD_CORE(fn, in, out, cfg)                                \
    fn(DATA(out[0]), DATA(out[1]), DATA(out[2]), DATA(out[3]),                \
       DATA(in[ABW_DOUT]), DATA(in[ABW_Q]), DATA(in[ABW_K]), DATA(in[ABW_V]), \
       DATA(in[ABW_OUT]), DATA(in[ABW_LSE]), cfg)

static mha_status attention_backward_core(const call *c)
{
    if (c->typenum == NPY_FLOAT)
        return ATTEND_BACKWARD_CORE(mha_attend_backward_f32, c->in, c->out, &c->cfg);
    return ATTEND_BACKWARD_CORE(mha_attend_backward_f64, c->in, c->out, &c->cfg);
}

PyObject *attention_backward(PyObject *self, PyObject *const *argv,
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
