/*
 * args.c - the arguments as passed: exactly as many positional ones as
 * mhattn passes (read at no cost), or any other call through PyArg.
 */
#include "glue.h"

#include <string.h>

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

/* Exactly sp->nargs - sp->nkw positional arguments (or sp->nopt fewer in
   all) and no keyword, as mhattn passes them: what parse_args would read,
   without the cost of the general parser. */
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
    char format[2 * MAX_ARGS + 33], *f = format;
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
            if (i == sp->nargs - sp->nkw)
                *f++ = '$';   // after '|': keyword-only ones are optional
            *f++ = 'O';
            *f++ = '&';
        }
    }
    kwlist[sp->nargs] = NULL;
    // PyArg leaves an optional argument that is not given alone: None.
    for (int i = sp->nargs - sp->nopt; i < sp->nargs; i++)
        c->arg[i] = (arg_value){Py_None, 0};
    *f++ = ':';   // then the name, which fits: sp->name is a short literal
    memcpy(f, sp->name, strlen(sp->name) + 1);
#define PAIR(i) cv[i], slot[i]
    _Static_assert(MAX_ARGS == 27, "the call below passes MAX_ARGS pairs");
    const int ok = PyArg_ParseTupleAndKeywords(
        args, kwds, format, kwlist, PAIR(0), PAIR(1), PAIR(2), PAIR(3),
        PAIR(4), PAIR(5), PAIR(6), PAIR(7), PAIR(8), PAIR(9), PAIR(10),
        PAIR(11), PAIR(12), PAIR(13), PAIR(14), PAIR(15), PAIR(16), PAIR(17),
        PAIR(18), PAIR(19), PAIR(20), PAIR(21), PAIR(22), PAIR(23), PAIR(24),
        PAIR(25), PAIR(26));
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

/* 1 when a call passes its arguments as mhattn does: by position alone,
   all of them but the keyword-only ones, or all but the optional ones. */
static int positional(const call_spec *sp, Py_ssize_t nargs)
{
    return nargs <= sp->nargs - sp->nkw && nargs >= sp->nargs - sp->nopt;
}

/* The arguments of a METH_FASTCALL | METH_KEYWORDS entry point into c. */
int parse_fast(call *c, const call_spec *sp, PyObject *const *argv, Py_ssize_t nargs,
               PyObject *kwnames)
{
    return kwnames == NULL && positional(sp, nargs)
               ? read_positional(c, sp, argv, nargs)
               : parse_fastcall(c, sp, argv, nargs, kwnames);
}

/* The arguments of a METH_VARARGS | METH_KEYWORDS entry point into c. A
   tuple is its own PySequence_Fast, so its items are an argv. */
int parse_tuple(call *c, const call_spec *sp, PyObject *args, PyObject *kwds)
{
    const Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    return (kwds == NULL || PyDict_GET_SIZE(kwds) == 0) && positional(sp, nargs)
               ? read_positional(c, sp, PySequence_Fast_ITEMS(args), nargs)
               : parse_args(c, sp, args, kwds);
}
