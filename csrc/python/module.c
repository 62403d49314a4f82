/*
 * module.c - the module mhattn._C: its method table, multi-phase init and
 * slots, the settings (get_isa, set_isa, get_num_threads,
 * set_num_threads) and cast_half, the whole-array conversions between
 * float32 and the half storage types (issue 36).
 */
#define GLUE_IMPORTS_ARRAY   /* import_array fills the API table here */
#include "glue.h"

#include "dispatch.h"
#include "threads.h"

PyDoc_STRVAR(get_isa_doc, GET_ISA_DOC);

static PyObject *get_isa(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyUnicode_FromString(mha_isa_name(mha_get_isa()));
}

PyDoc_STRVAR(set_isa_doc, SET_ISA_DOC);

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

PyDoc_STRVAR(get_num_threads_doc, GET_NUM_THREADS_DOC);

static PyObject *get_num_threads(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyLong_FromLong(mha_get_num_threads());
}

PyDoc_STRVAR(set_num_threads_doc, SET_NUM_THREADS_DOC);


static PyObject *set_num_threads(PyObject *self, PyObject *arg)
{
    (void)self;
    PyObject *index = PyNumber_Index(arg);   // an int, or what has __index__
    if (index == NULL) {
        PyErr_Format(PyExc_TypeError, "n: expected an int, got %s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
    int overflow;
    const long n = PyLong_AsLongAndOverflow(index, &overflow);
    Py_DECREF(index);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (overflow > 0) {   // past long: as many threads as the core takes
        mha_set_num_threads(MHA_MAX_THREADS);
        Py_RETURN_NONE;
    }
    if (n < 0 || overflow < 0) {
        PyErr_Format(PyExc_ValueError,
                     "n: expected a thread count >= 0, got %R", arg);
        return NULL;
    }
    mha_set_num_threads(n > MHA_MAX_THREADS ? MHA_MAX_THREADS : (int)n);
    Py_RETURN_NONE;
}

/* The half storage type of a (2-byte) array's dtype: float16 is NumPy's
   own; bfloat16 is a user dtype (ml_dtypes registers it) known by its
   scalar type's name, so the glue needs no import of ml_dtypes. -1 for
   anything else. */
static int half_type(PyArrayObject *a)
{
    if (PyArray_TYPE(a) == NPY_HALF)
        return MHA_DTYPE_F16;
    if (glue_is_bfloat16(a))
        return MHA_DTYPE_BF16;
    return -1;
}

PyDoc_STRVAR(cast_half_doc, CAST_HALF_DOC);

static PyObject *cast_half(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *src_o, *dst_o;
    if (!PyArg_ParseTuple(args, "OO:cast_half", &src_o, &dst_o))
        return NULL;
    if (!PyArray_Check(src_o) || !PyArray_Check(dst_o)) {
        PyErr_SetString(PyExc_TypeError, "cast_half: src and dst must be ndarrays");
        return NULL;
    }
    PyArrayObject *src = (PyArrayObject *)src_o, *dst = (PyArrayObject *)dst_o;
    const int want = NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED;
    if (!PyArray_CHKFLAGS(src, want) || !PyArray_CHKFLAGS(dst, want) ||
        !PyArray_ISWRITEABLE(dst) || !PyArray_ISNOTSWAPPED(src) ||
        !PyArray_ISNOTSWAPPED(dst)) {
        PyErr_SetString(PyExc_ValueError,
                        "cast_half: src and dst must be C-contiguous, aligned and native; "
                        "dst writeable");
        return NULL;
    }
    if (PyArray_SIZE(src) != PyArray_SIZE(dst)) {
        PyErr_Format(PyExc_ValueError, "cast_half: src has %zd elements, dst %zd",
                     (Py_ssize_t)PyArray_SIZE(src), (Py_ssize_t)PyArray_SIZE(dst));
        return NULL;
    }
    int from, to;
    if (PyArray_TYPE(src) == NPY_FLOAT && (to = half_type(dst)) >= 0)
        from = MHA_DTYPE_F32;
    else if (PyArray_TYPE(dst) == NPY_FLOAT && (from = half_type(src)) >= 0)
        to = MHA_DTYPE_F32;
    else {
        PyErr_SetString(PyExc_TypeError,
                        "cast_half: one of src and dst must be float32, the other "
                        "float16 or bfloat16");
        return NULL;
    }
    if (PyArray_BYTES(src) < PyArray_BYTES(dst) + PyArray_NBYTES(dst) &&
        PyArray_BYTES(dst) < PyArray_BYTES(src) + PyArray_NBYTES(src)) {
        PyErr_SetString(PyExc_ValueError, "cast_half: src and dst overlap");
        return NULL;
    }
    mha_status st;
    Py_BEGIN_ALLOW_THREADS
    st = mha_convert(PyArray_DATA(dst), (mha_dtype)to, PyArray_DATA(src), (mha_dtype)from,
                     (size_t)PyArray_SIZE(src));
    Py_END_ALLOW_THREADS
    if (st != MHA_OK) {
        PyErr_Format(PyExc_RuntimeError, "cast_half: %s", mha_status_name(st));
        return NULL;
    }
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
    {"cast_half", cast_half, METH_VARARGS, cast_half_doc},
    {"backward", (PyCFunction)(void (*)(void))backward,
     METH_VARARGS | METH_KEYWORDS, backward_doc},
    {"attention", (PyCFunction)(void (*)(void))attention,
     METH_FASTCALL | METH_KEYWORDS, attention_doc},
    {"project", (PyCFunction)(void (*)(void))project,
     METH_FASTCALL | METH_KEYWORDS, project_doc},
    {"attention_backward", (PyCFunction)(void (*)(void))attention_backward,
     METH_FASTCALL | METH_KEYWORDS, attention_backward_doc},
    {"check_config", (PyCFunction)(void (*)(void))check_config,
     METH_FASTCALL | METH_KEYWORDS, check_config_doc},
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
 *   - the glue's own state is the SIGINT state (call.c, argued there) and
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
