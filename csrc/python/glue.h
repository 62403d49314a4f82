/*
 * glue.h - what the files of the CPython / NumPy glue of mhattn._C share.
 *
 * Only the files of csrc/python/ include Python.h and the NumPy headers.
 * They parse and convert the arguments, re-check every shape and dtype the
 * core relies on, allocate the outputs, release the GIL around the core
 * call and turn a core status into a Python exception. The friendly,
 * documented validation lives in the Python layer; the glue must still
 * never crash whatever it is given, since _C can be imported alone.
 *
 * Letters: see mha.h.
 */
#ifndef MHATTN_GLUE_H
#define MHATTN_GLUE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* One NumPy API table for all the glue's files; module.c alone fills it
   (import_array), the others name it. */
#define PY_ARRAY_UNIQUE_SYMBOL mhattn_ARRAY_API
#ifndef GLUE_IMPORTS_ARRAY
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#include <stddef.h>
#include <stdint.h>

#include "mha.h"

/* A docstring the method table (module.c) names from another file. */
#define GLUE_DOC(name, str) const char name[] = PyDoc_STR(str)

#define DATA(a) ((a) != NULL ? PyArray_DATA(a) : NULL)

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


/* ---- convert.c: arrays, shapes, masks, key lengths, head widths --------- */
const char *dtype_name(int typenum);
PyObject *dims_tuple(int nd, const npy_intp *dims);
int check_shape(PyArrayObject *a, const char *name, int nd, const npy_intp *want,
                const char *letters);
void prefix_error(const char *name);
int as_vector(PyArrayObject **res, PyObject *obj, const char *name, int typenum);
int head_widths(size_t **widths, size_t fused[4], PyArrayObject *dk_a, PyArrayObject *dv_a,
                npy_intp H);
int as_lengths(int64_t **snap, PyObject *obj, npy_intp B, npy_intp Tk);
int snapshot_scales(double **snap, PyArrayObject *scales);
void shape_dims(npy_intp dims[4], const shape *s, const npy_intp size[N_LETTERS]);
int convert_arrays(call *c, const call_spec *sp);
int check_shapes(const call *c, const call_spec *sp, const int *pos);
int convert_mask(call *c, const call_spec *sp, mha_mask_kind *kind, ptrdiff_t stride[4]);

/* ---- args.c: the arguments as passed ------------------------------------ */
int read_positional(call *c, const call_spec *sp, PyObject *const *argv, Py_ssize_t nargs);
int parse_args(call *c, const call_spec *sp, PyObject *args, PyObject *kwds);
int parse_fastcall(call *c, const call_spec *sp, PyObject *const *argv, Py_ssize_t nargs,
                   PyObject *kwnames);

/* ---- variants.c ---------------------------------------------------------- */
int read_variants(call *c, PyObject *t);

/* ---- call.c: the call skeleton ------------------------------------------- */
void raise_status(mha_status st);
int sigint_setup(void);
int on_main_thread(void);
void call_init(call *c);
void call_release(call *c);
int build_config(call *c, const call_spec *sp);
int make_outputs(call *c, int nout, const shape *shapes, const int *want);
int run_core(call *c, mha_status (*core)(const call *), int main_thread);
PyObject *arrays_tuple(PyArrayObject *const *a, int n);

/* ---- packed.c ------------------------------------------------------------- */
int read_packed(call *c, PyObject *t, const int *wpos, int n);

/* ---- the entry points and their docstrings (module.c's method table) ----- */
PyObject *forward(PyObject *self, PyObject *const *argv, Py_ssize_t nargs, PyObject *kwnames);
PyObject *backward(PyObject *self, PyObject *args, PyObject *kwds);
PyObject *project(PyObject *self, PyObject *const *argv, Py_ssize_t nargs, PyObject *kwnames);
PyObject *attention(PyObject *self, PyObject *const *argv, Py_ssize_t nargs, PyObject *kwnames);
PyObject *attention_backward(PyObject *self, PyObject *const *argv, Py_ssize_t nargs,
                             PyObject *kwnames);
PyObject *pack_weight(PyObject *self, PyObject *arg);
PyObject *packed_info(PyObject *self, PyObject *cap);
extern const char forward_doc[], backward_doc[], project_doc[], attention_doc[],
    attention_backward_doc[], pack_weight_doc[], packed_info_doc[];

#endif
