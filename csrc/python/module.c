/*
 * module.c - the module mhattn._C: its method table, multi-phase init and
 * slots, and the settings (get_isa, set_isa, get_num_threads,
 * set_num_threads).
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
