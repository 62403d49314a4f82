/*
 * variants.c - the variants' tuple (issue 13: window, softcap, ALiBi, sinks, key
 * mask, packed sequences, q/k norm, RoPE) read into the call's mha_config.
 */
#include "glue.h"

#include <limits.h>

/* ---- the variants (issue 13) ------------------------------------------- */
/*
 * forward() and backward() take the variants of today's models as one
 * argument: None (all off), or a tuple of V_N items in this order, as
 * mhattn._core.variant_args makes it:
 *   window         None or (left, right): ints, -1 for an unbounded side
 *   softcap        float, 0 for off
 *   alibi          None or float64 (1 or B, H), with packed sequences
 *                  (1 or n, H): one row per sequence
 *   sinks          None or (H,) of x's dtype
 *   key_mask       None or bool (B, Tk)
 *   cu_q, cu_k     None or int64 (n + 1,) each, both or neither
 *   q_norm         None, (d,) or (H, d) of x's dtype
 *   k_norm         None, (d,) or (G, d) of x's dtype
 *   norm_eps       float
 *   norm_type      str: the norm's name, "rms" or "layer" (the core's
 *                  mha_norm_type_parse takes it, and names the accepted
 *                  ones when it refuses it)
 *   rotary_dim     int, 0 for off
 *   interleaved    truth value
 *   inv_freq       None or float64 (rotary_dim / 2,)
 *   positions      None or int64 (1 or B, Tq)
 *   key_positions  None or int64 (1 or B, Tk)
 *   dropout        float, 0 for off (the core checks 0 <= dropout < 1)
 *   seed           int in [0, 2**64): dropout's seed
 *   relative_bias  None or (table, max_distance, bidirectional): T5's
 *                  bias, table (num_buckets, H) of x's dtype, max_distance
 *                  an int, bidirectional a truth value (the core checks
 *                  the buckets and the distance: mha_check_config)
 *   chunk          int >= 0, 0 for off (the core checks its bound)
 *   block_mask     None or (entries, bits, bq, bk): a BlockMask's int32
 *                  entries (1 or B, 1 or H, nqb, nkb) and uint8 bits
 *                  (npartial, bq, ceil(bk / 8)), bq and bk ints (the core
 *                  checks every entry: mha_check_config)
 *   q_offset       None (bottom-right) or an int: query 0's position
 *                  relative to key 0 (the core checks its bound)
 * Every array is copied into memory the call owns (they are small), so no
 * index, offset or size the core uses lives where another thread can write
 * during the call; mha_check_config then checks the copies.
 */
static const char *const variant_name[V_N] = {
    "window", "softcap", "alibi_slopes", "sinks", "key_mask", "cu_seqlens",
    "key_cu_seqlens", "q_norm", "k_norm", "norm_eps", "norm_type", "rotary_dim",
    "interleaved", "inv_freq", "positions", "key_positions", "dropout", "seed",
    "relative_bias", "chunk", "block_mask", "q_offset"};

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
        // Per row unless one row is shared; (0, n) for B = 0 is per row
        // too, so the core reads B * n = 0 items, not n.
        *bstride = nd == 2 && r != 1 ? (size_t)n : 0;
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
        // An int past long long is a value error, not a type error.
        const int range = PyErr_ExceptionMatches(PyExc_OverflowError);
        PyErr_Clear();
        if (range)
            PyErr_Format(PyExc_ValueError, "window: expected each side in [-1, %lld] "
                         "(-1 for an unbounded side), got %R", LLONG_MAX, w);
        else
            PyErr_Format(PyExc_TypeError, "window: expected None or a tuple of two ints "
                         "(-1 for an unbounded side), got %R", w);
        return -1;
    }
    cfg->windowed = 1;
    cfg->window_left = left < 0 ? -1 : (int64_t)left;
    cfg->window_right = right < 0 ? -1 : (int64_t)right;
    return 0;
}

/* The norm type, a str, into cfg: its name is the core's to read and to
   refuse (mha_norm_type_parse: a ValueError with field norm_type). */
static int variant_norm_type(mha_config *cfg, PyObject *name)
{
    if (!PyUnicode_Check(name)) {
        PyErr_Format(PyExc_TypeError, "norm_type: expected a str, got %s",
                     Py_TYPE(name)->tp_name);
        return -1;
    }
    // Its UTF-8 (cached in the str), or, for a str that has none (a lone
    // surrogate), a copy with '?' in its place: no such str is a name, and
    // the core's rejection then says so, as for any other.
    Py_ssize_t len;
    const char *s = PyUnicode_AsUTF8AndSize(name, &len);
    PyObject *utf8 = NULL;
    if (s == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError))
            return -1;
        PyErr_Clear();
        if ((utf8 = PyUnicode_AsEncodedString(name, "utf-8", "replace")) == NULL)
            return -1;
        s = PyBytes_AS_STRING(utf8);
        len = PyBytes_GET_SIZE(utf8);
    }
    mha_error err;
    const mha_status st = mha_norm_type_parse(&cfg->norm_type, s, (size_t)len, &err);
    Py_XDECREF(utf8);
    if (st != MHA_OK) {
        raise_status(st, &err);
        return -1;
    }
    return 0;
}

/* *out = obj, an int that must convert to a size_t (rotary_dim, chunk,
   max_distance): an int past Py_ssize_t (a RoPE's rotary_dim set to 2**64
   after construction) is out of range, a ValueError naming it, as a
   negative one is, not an OverflowError; a non-int is a TypeError naming
   it. */
static int variant_size(PyObject *obj, const char *name, size_t *out)
{
    const Py_ssize_t v = PyLong_AsSsize_t(obj);
    if (v == -1 && PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_OverflowError)) {
        prefix_error(name);
        return -1;
    }
    if (v < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: expected an int in [0, %zd], got %R", name,
                     PY_SSIZE_T_MAX, obj);
        return -1;
    }
    *out = (size_t)v;
    return 0;
}

/* The scalars of the tuple t into cfg: softcap, norm_eps, dropout, seed,
   norm_type, rotary_dim, interleaved, chunk, q_offset. */
static int variant_scalars(mha_config *cfg, PyObject *t)
{
    cfg->softcap = PyFloat_AsDouble(PyTuple_GET_ITEM(t, V_SOFTCAP));
    cfg->norm_eps = PyFloat_AsDouble(PyTuple_GET_ITEM(t, V_NORM_EPS));
    cfg->dropout = PyFloat_AsDouble(PyTuple_GET_ITEM(t, V_DROPOUT));
    const int inter = PyObject_IsTrue(PyTuple_GET_ITEM(t, V_INTERLEAVED));
    if (PyErr_Occurred()) {
        prefix_error("variants");
        return -1;
    }
    // The seed: any int in [0, 2**64) (Python draws it); anything else is
    // refused here, naming it, rather than wrapped.
    PyObject *seed = PyTuple_GET_ITEM(t, V_SEED);
    if (!PyLong_Check(seed)) {
        PyErr_Format(PyExc_TypeError, "seed: expected an int, got %s", Py_TYPE(seed)->tp_name);
        return -1;
    }
    const unsigned long long sv = PyLong_AsUnsignedLongLong(seed);
    if (sv == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "seed: expected an int in [0, 2**64), got %R", seed);
        return -1;
    }
    cfg->dropout_seed = (uint64_t)sv;
    if (variant_norm_type(cfg, PyTuple_GET_ITEM(t, V_NORM_TYPE)) < 0)
        return -1;
    // softcap and norm_eps are the core's to check (mha_check_config).
    if (variant_size(PyTuple_GET_ITEM(t, V_ROTARY_DIM), "rotary_dim", &cfg->rotary_dim) < 0 ||
        variant_size(PyTuple_GET_ITEM(t, V_CHUNK), "chunk", &cfg->chunk) < 0)
        return -1;
    cfg->rope_interleaved = inter;
    // q_offset: None, or any int that fits int64_t (the core bounds it);
    // past that an OverflowError naming it rather than a wrapped value.
    PyObject *qo = PyTuple_GET_ITEM(t, V_Q_OFFSET);
    if (qo != Py_None) {
        const long long v = PyLong_AsLongLong(qo);
        if (v == -1 && PyErr_Occurred()) {
            prefix_error("q_offset");
            return -1;
        }
        cfg->has_q_offset = 1;
        cfg->q_offset = (int64_t)v;
    }
    return 0;
}

/* T5's relative bias, None or (table, max_distance, bidirectional): the
   table copied into c->var[V_REL] (as the arrays below), its size and the
   scalars into cfg. */
static int variant_rel(call *c, PyObject *t)
{
    PyObject *r = PyTuple_GET_ITEM(t, V_REL);
    if (r == Py_None)
        return 0;
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 3) {
        PyErr_Format(PyExc_TypeError, "relative_bias: expected None or a tuple (table, "
                     "max_distance, bidirectional), got %s", Py_TYPE(r)->tp_name);
        return -1;
    }
    size_t md;
    if (variant_size(PyTuple_GET_ITEM(r, 1), "max_distance", &md) < 0)
        return -1;
    const int bidir = PyObject_IsTrue(PyTuple_GET_ITEM(r, 2));
    if (bidir < 0) {
        prefix_error("relative_bias");
        return -1;
    }
    if (variant_copy(&c->var[V_REL], PyTuple_GET_ITEM(r, 0), "relative_bias", c->typenum,
                     2) < 0)
        return -1;
    PyArrayObject *a = c->var[V_REL];
    if (PyArray_NDIM(a) != 2 || PyArray_DIM(a, 1) != c->size[L_H]) {
        const npy_intp want[2] = {PyArray_NDIM(a) == 2 ? PyArray_DIM(a, 0) : 32,
                                  c->size[L_H]};
        return check_shape(a, "relative_bias", 2, want, "(num_buckets, H)");
    }
    c->cfg.rel_table = PyArray_DATA(a);
    c->cfg.rel_buckets = (size_t)PyArray_DIM(a, 0);
    c->cfg.rel_max_distance = md;
    c->cfg.rel_bidirectional = bidir;
    return 0;
}

/* The block mask, None or (entries, bits, bq, bk): entries and bits copied
   into c->var[V_BLOCK_MASK] and c->var[V_BM_BITS], their shapes checked
   against the call's sizes and each other; the entries' values are the
   core's to check. */
static int variant_block_mask(call *c, PyObject *t)
{
    PyObject *r = PyTuple_GET_ITEM(t, V_BLOCK_MASK);
    if (r == Py_None)
        return 0;
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 4) {
        PyErr_Format(PyExc_TypeError, "block_mask: expected None or a tuple (entries, "
                     "bits, bq, bk), got %s", Py_TYPE(r)->tp_name);
        return -1;
    }
    size_t bq, bk;
    if (variant_size(PyTuple_GET_ITEM(r, 2), "block_mask's bq", &bq) < 0 ||
        variant_size(PyTuple_GET_ITEM(r, 3), "block_mask's bk", &bk) < 0)
        return -1;
    if (bq == 0 || bk == 0) {
        PyErr_Format(PyExc_ValueError, "block_mask: block (%zu, %zu) has a size of 0", bq, bk);
        return -1;
    }
    if (variant_copy(&c->var[V_BLOCK_MASK], PyTuple_GET_ITEM(r, 0), "block_mask", NPY_INT32,
                     4) < 0 ||
        variant_copy(&c->var[V_BM_BITS], PyTuple_GET_ITEM(r, 1), "block_mask", NPY_UINT8,
                     3) < 0)
        return -1;
    PyArrayObject *e = c->var[V_BLOCK_MASK], *bits = c->var[V_BM_BITS];
    const npy_intp *n = c->size;
    const npy_intp nqb = (npy_intp)((size_t)n[L_TQ] / bq + ((size_t)n[L_TQ] % bq != 0));
    const npy_intp nkb = (npy_intp)((size_t)n[L_TK] / bk + ((size_t)n[L_TK] % bk != 0));
    const npy_intp eb = PyArray_NDIM(e) == 4 ? PyArray_DIM(e, 0) : -1;
    const npy_intp eh = PyArray_NDIM(e) == 4 ? PyArray_DIM(e, 1) : -1;
    if (eb < 0 || (eb != 1 && eb != n[L_B]) || (eh != 1 && eh != n[L_H]) ||
        PyArray_DIM(e, 2) != nqb || PyArray_DIM(e, 3) != nkb) {
        const npy_intp want[4] = {n[L_B], n[L_H], nqb, nkb};
        return check_shape(e, "block_mask", 4, want, "(B or 1, H or 1, nqb, nkb)");
    }
    if (PyArray_NDIM(bits) != 3 || PyArray_DIM(bits, 1) != (npy_intp)bq ||
        PyArray_DIM(bits, 2) != (npy_intp)((bk + 7) / 8)) {
        const npy_intp want[3] = {PyArray_NDIM(bits) == 3 ? PyArray_DIM(bits, 0) : 0,
                                  (npy_intp)bq, (npy_intp)((bk + 7) / 8)};
        return check_shape(bits, "block_mask", 3, want, "(npartial, bq, ceil(bk / 8))");
    }
    mha_config *cfg = &c->cfg;
    cfg->bm_block = PyArray_DATA(e);
    cfg->bm_bits = PyArray_DATA(bits);
    cfg->bm_bq = bq, cfg->bm_bk = bk;
    cfg->bm_hstride = eh > 1 ? (size_t)(nqb * nkb) : 0;
    cfg->bm_bstride = eb > 1 ? (size_t)(eh * nqb * nkb) : 0;
    cfg->bm_npartial = (size_t)PyArray_DIM(bits, 0);
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

/* Packed-sequence offsets cu (n + 1,): at least 2 of them (the glue's
   shape check; their values, and B == 1, are the core's: mha_check_config
   checks the glue's copy before any row is indexed). */
static int variant_offsets(PyArrayObject *a, const char *name)
{
    const npy_intp n = PyArray_DIM(a, 0);
    if (n < 2) {
        PyErr_Format(PyExc_ValueError, "%s: expected at least 2 offsets (n + 1,), got "
                     "shape (%zd,)", name, (Py_ssize_t)n);
        return -1;
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
    // ALiBi's rows: one per batch item, or per packed sequence.
    const npy_intp arows = v[V_CU_Q] != NULL ? PyArray_DIM(v[V_CU_Q], 0) - 1 : n[L_B];
    if (variant_rows(v[V_ALIBI], "alibi_slopes", arows, n[L_H], 1, 0,
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
        (variant_offsets(v[V_CU_Q], "cu_seqlens") < 0 ||
         variant_offsets(v[V_CU_K], "key_cu_seqlens") < 0))
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
int read_variants(call *c, PyObject *t)
{
    if (t == Py_None)
        return 0;
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != V_N) {
        PyErr_Format(PyExc_TypeError, "variants: expected None or a tuple of %d "
                     "items, got %s", V_N, Py_TYPE(t)->tp_name);
        return -1;
    }
    if (variant_window(&c->cfg, PyTuple_GET_ITEM(t, V_WINDOW)) < 0 ||
        variant_scalars(&c->cfg, t) < 0 || variant_arrays(c, t) < 0 || variant_rel(c, t) < 0 ||
        variant_block_mask(c, t) < 0)
        return -1;
    return variant_shapes(c, &c->cfg);
}
