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
#include "docstrings_gen.h"   /* the _C docstrings: tools/gen_schema.py */

/* A docstring the method table (module.c) names from another file. */
#define GLUE_DOC(name, str) const char name[] = PyDoc_STR(str)

#define DATA(a) ((a) != NULL ? PyArray_DATA(a) : NULL)

/* The variants' tuple, position by position (see read_variants). */
enum {
    V_WINDOW, V_SOFTCAP, V_ALIBI, V_SINKS, V_KEY_MASK, V_CU_Q, V_CU_K,
    V_Q_NORM, V_K_NORM, V_NORM_EPS, V_NORM_TYPE, V_ROTARY_DIM, V_INTERLEAVED,
    V_INV_FREQ, V_POSITIONS, V_KEY_POSITIONS, V_DROPOUT, V_SEED, V_REL, V_CHUNK,
    V_BLOCK_MASK, V_Q_OFFSET, V_N,
    V_BM_BITS = V_N, /* c->var only: the block mask's bits (V_BLOCK_MASK: its entries) */
    V_HELD
};

/* ---- the argument tables and the call skeleton -------------------------- */
/*
 * Every entry point that calls the core (forward, backward, project,
 * attention, attention_backward) reads its arguments by a table (one
 * arg_spec per position) and is described by one call_spec, which the one
 * skeleton (call.c, call_fast and call_tuple) follows: parse, convert the
 * arrays in positional order with the one converter (convert.c), so that
 * the first bad argument is the one reported, derive the sizes by letter
 * (the family's sizes step), fill the mha_config (in one place,
 * fill_config), make the outputs, run the core with the GIL released and
 * Ctrl-C seen, and turn a status into an exception. Every reference a call
 * owns is in its `call`, released by call_release alone.
 */

/* The sizes of a call, by the letters of mha.h (and, for attention on
   projected tensors, G and the one head width dk, dv); indices into
   call.size. */
enum {
    L_B, L_TQ, L_TK, L_DIN, L_DKIN, L_DVIN, L_DOUT, L_H,
    L_SQ, L_SK, L_SV, L_SVQ, L_G, L_DK, L_DV, N_LETTERS
};

/* The sizes a's axes give: size[letter[i]] = a's axis i, for the first nd
   axes, skipping those whose letter is -1 (set by another array). */
static inline void sizes_from(npy_intp size[N_LETTERS], PyArrayObject *a, int nd,
                              const signed char *letter)
{
    for (int i = 0; i < nd; i++)
        if (letter[i] >= 0)
            size[letter[i]] = PyArray_DIM(a, i);
}

/* A shape in letters: {3, {L_B, L_TQ, L_DIN}} is (B, Tq, Din). */
typedef struct {
    int nd;
    unsigned char dim[4];
} shape;
#define SHAPE1(a) {1, {a}}
#define SHAPE2(a, b) {2, {a, b}}
#define SHAPE3(a, b, c) {3, {a, b, c}}
#define SHAPE4(a, b, c, d) {4, {a, b, c, d}}

/* The float arrays' kinds come first (convert_arrays). */
typedef enum {
    ARG_ARRAY,       /* a float array of the call's dtype (x's, or q's) */
    ARG_ARRAY_OPT,   /* the same, or None for an absent one */
    ARG_ARRAY_ALIAS, /* the same, or None for the array of argument .alias */
    ARG_INT64,       /* a vector, converted to int64 (dk, dv) */
    ARG_FLOAT64,     /* a vector, converted to float64 (scales) */
    ARG_MASK,        /* None or a mask: converted once the sizes are known */
    ARG_LENGTHS,     /* None or key lengths: likewise */
    ARG_BOOL,        /* any object, read as its truth value */
    ARG_VARIANTS,    /* None or the variants' tuple (see read_variants) */
    ARG_PACKED,      /* None or a tuple of packed weights (read_packed) */
    ARG_BLOCK_TABLE, /* None or a paged cache's int32 block table (as_block_table) */
} arg_kind;

typedef struct {
    const char *name;   /* the keyword, and the prefix of its errors */
    arg_kind kind;
    shape shape;        /* arrays: ndim, and the letters checked */
    int alias;          /* ARG_ARRAY_ALIAS: the earlier position None
                           stands for */
    const char *note;   /* said after the letters of a wrong shape, or NULL */
} arg_spec;

/* How the converter hands a float array to the core. */
typedef enum {
    LAYOUT_C,        /* C-contiguous (a copy unless it is one already) */
    LAYOUT_STRIDED,  /* in place when its strides are non-negative
                        multiples of the item and its last axis contiguous,
                        else a C-contiguous copy: call.st holds them */
    LAYOUT_KEEP,     /* the caller's array as it is, for the family's
                        finish step to copy */
} layout;

/* run_core's restarts after a handler that did not raise, before a last
   try that is not polled: a call takes at most MAX_RESTARTS + 1 times its
   time, whatever the signals (a SIGINT storm included). */
#define MAX_RESTARTS 3
#define MAX_ARGS 27   /* backward()'s */
#define MAX_OUTS 18   /* backward()'s gradients */
/* A position past every function's arguments that holds None (false, no
   array): a call_spec names it for an argument its function lacks. */
#define ARG_NONE MAX_ARGS

/* One argument as passed: the object (borrowed from the caller, who keeps
   it alive for the call) and, for ARG_BOOL, its truth value. */
typedef struct {
    PyObject *obj;
    int truth;
} arg_value;

/* One call in progress: call_init starts it, call_release ends it. */
typedef struct {
    arg_value arg[MAX_ARGS + 1];      /* and ARG_NONE */
    int typenum;                      /* NPY_FLOAT or NPY_DOUBLE: the dtype
                                         of x (or q) */
    PyArrayObject *in[MAX_ARGS + 1];  /* owned: the converted arrays by
                                         position, shaped as their arg_spec
                                         says; NULL for None and for
                                         non-array arguments */
    PyArrayObject *out[MAX_OUTS];     /* owned: the outputs, shaped as the
                                         function's table says; NULL if
                                         unwanted */
    npy_intp size[N_LETTERS];         /* the call's sizes, by letter */
    mha_strides st[6];                /* LAYOUT_STRIDED: q, k, v, out, and
                                         attention's k_scales, v_scales */
    mha_kv_storage kv;                /* what k and v hold (call_spec
                                         kv_storage; else MHA_KV_PLAIN) */
    mha_kv_storage w;                 /* what the weights hold (call_spec
                                         w_storage; else MHA_KV_PLAIN) */
    /* Glue-owned snapshots of the index-bearing vectors, taken while the
       GIL is held: the core never reads a caller's dk, dv, scales or
       key_lengths, which another thread may change during the call. */
    size_t *widths;               /* (2G,) PyMem: dk then dv, as size_t */
    double *scales;               /* (H,) PyMem */
    int64_t *lengths;             /* (B,) PyMem, or NULL for None */
    int32_t *table;               /* (B, pages_per_seq) PyMem: a paged
                                     cache's block table, or NULL */
    size_t pages_per_seq;         /* its columns (0 without one) */
    size_t page_size, num_pages;  /* the pools' (from k; 0 without one) */
    /* owned: the glue's copies of the variants' arrays (read_variants),
       NULL where absent */
    PyArrayObject *var[V_HELD];
    mha_config cfg;               /* borrows widths, scales, mask, lengths,
                                     var */
    mha_error err;                /* the core step's rejection, if any */
} call;

typedef struct call_spec call_spec;

/*
 * An entry point, as the skeleton follows it: its arguments, the
 * positions of those the config reads (ARG_NONE where it has none), and
 * its family's steps. The float arrays' shapes are checked by the sizes
 * step, from lists of positions (each in the order its errors take
 * precedence, ended by -1): first those against the sizes of the arrays
 * that set them, then, once the head widths are known, the others.
 */
struct call_spec {
    const char *name;       /* "forward", for PyArg's messages */
    int nargs;
    const arg_spec *args;   /* (nargs,) in positional order */
    int nopt;               /* trailing arguments that may be left out
                               (None then) */
    int nkw;                /* the last nkw of those are keyword-only:
                               mhattn passes them by name, and only when
                               it has them (the output gate) */
    layout layout;          /* of the float arrays */
    const int *checks_x;       /* against x, key and value's sizes (q's) */
    const int *checks_widths;  /* against the head widths too */
    int x;                  /* the array whose dtype is the call's */
    int key, value, wq, wk, wv, wo, wgate, dk, dv, scales, mask, causal, key_lengths;
    int variants, lengths_aligned, block_table;
    int broadcast_mask;     /* the mask may broadcast to (B, H, Tq, Tk) */
    int has_wo;             /* cfg.has_wo when there is no wo argument */
    int kv_storage;         /* key and value may be a KV cache's float16,
                               bfloat16 or int8 storage with a float32
                               call (call.kv, convert.c) */
    int w_storage;          /* wq, wk, wv, wo, wgate may be float16 or bfloat16
                               with a float32 call (call.w, convert.c) */
    int checked;            /* mha_check_config checks the config first */
    /* the family's steps, in the order the skeleton runs them: each
       returns -1 with an exception set on failure; check and finish may be
       NULL, work NULL polls every main-thread call for Ctrl-C */
    int (*sizes)(call *c, const call_spec *sp);  /* the vectors (convert_vectors),
                                                    c->size, c->widths */
    int (*check)(call *c);    /* after the variants, before the core's check */
    int (*finish)(call *c);   /* once the config is checked */
    int (*outputs)(call *c);
    double (*work)(const call *c);   /* multiply-adds, for MHA_SMALL_WORK */
    mha_status (*core)(call *c);       /* its errors in c->err */
    PyObject *(*result)(call *c);
};

/* Where one array of a call goes in its mha_params: c->in[pos] (or, out,
   c->out[pos]) at byte offset `offset`, a void * or const void * field.
   A table of them (args_gen.c, <name>_params) ends with pos -1. */
typedef struct {
    signed char pos;
    unsigned char out;
    unsigned short offset;
} param_slot;
_Static_assert(sizeof(mha_params) <= 65535, "a param_slot's offset fits");

/* ---- each entry point's positions and tables --------------------------- */
/*
 * Generated from the schema (python/mhattn/_internal/schema.py) by
 * tools/gen_schema.py: per entry point the positions of its arguments and
 * outputs (FWD_X ... FWD_NARGS, FWD_OUT ... FWD_NOUTS), its arg_spec table
 * and output shapes (args_gen.c), and <NAME>_SPEC_ARGS, the fields of its
 * call_spec that follow from its arguments (name, table, nopt, the shape
 * checks in the order their errors take precedence, the roles' positions).
 * The rest of a call_spec (layout, flags, the family's steps) is code,
 * beside its entry point (mha.c, attend.c).
 */
#include "args_gen.h"

/* ---- convert.c: the one array converter, shapes, masks, lengths --------- */
int kv_storage_of(PyArrayObject *a);
int check_shape(PyArrayObject *a, const char *name, int nd, const npy_intp *want,
                const char *letters);
void prefix_error(const char *name);
int convert_arrays(call *c, const call_spec *sp);
int convert_vectors(call *c, const call_spec *sp);
int check_shapes(const call *c, const call_spec *sp, const int *pos);
int check_heads(npy_intp H, npy_intp G);
int head_widths(size_t **widths, size_t fused[4], PyArrayObject *dk_a, PyArrayObject *dv_a,
                npy_intp H);
void shape_dims(npy_intp dims[4], const shape *s, const npy_intp size[N_LETTERS]);
int uniform_widths(call *c, npy_intp G, npy_intp dk, npy_intp dv);
int convert_mask(call *c, const call_spec *sp, mha_mask_kind *kind, ptrdiff_t stride[4]);
int as_lengths(int64_t **snap, PyObject *obj, npy_intp B);
int snapshot_scales(double **snap, PyArrayObject *scales);

/* ---- args.c: the arguments as passed ------------------------------------ */
int parse_fast(call *c, const call_spec *sp, PyObject *const *argv, Py_ssize_t nargs,
               PyObject *kwnames);
int parse_tuple(call *c, const call_spec *sp, PyObject *args, PyObject *kwds);

/* ---- variants.c ---------------------------------------------------------- */
int read_variants(call *c, PyObject *t);

/* ---- call.c: the one call skeleton --------------------------------------- */
PyObject *call_fast(const call_spec *sp, PyObject *const *argv, Py_ssize_t nargs,
                    PyObject *kwnames);
PyObject *call_tuple(const call_spec *sp, PyObject *args, PyObject *kwds);
int make_outputs(call *c, int nout, const shape *shapes, const int *want);
int want_dmask_check(const call *c);
PyObject *arrays_tuple(PyArrayObject *const *a, int n);
void raise_status(mha_status st, const mha_error *err);
int sigint_setup(void);

/* ---- core_calls.c: every call into the core ------------------------------ */
int core_check(const mha_config *cfg, int typenum);
mha_status forward_core(call *c);
mha_status backward_core(call *c);
mha_status project_core(call *c);
mha_status attention_core(call *c);
mha_status attention_backward_core(call *c);
PyObject *pack_core(PyArrayObject *w);

/* ---- packed.c ------------------------------------------------------------- */
int read_packed(call *c, PyObject *t, const int *wpos, int n);
void packed_destroy(PyObject *cap);
/* The name of a pack_weight() capsule (packed.c), which core_calls.c makes. */
#define PACKED_CAPSULE "mhattn._C.packed"

/* ---- the entry points and their docstrings (module.c's method table) ----- */
/* The entry point name(), which the skeleton runs by name_spec (its
   call_spec), and its docstring name_doc: METH_FASTCALL | METH_KEYWORDS,
   or (TUPLE) METH_VARARGS | METH_KEYWORDS. Declared below by their full
   names. */
#define GLUE_FASTCALL_ENTRY(name, doc)                                                  \
    GLUE_DOC(name##_doc, doc);                                                           \
    PyObject *name(PyObject *self, PyObject *const *argv, Py_ssize_t nargs,              \
                   PyObject *kwnames)                                                    \
    {                                                                                    \
        (void)self;                                                                      \
        return call_fast(&name##_spec, argv, nargs, kwnames);                            \
    }
#define GLUE_TUPLE_ENTRY(name, doc)                                                     \
    GLUE_DOC(name##_doc, doc);                                                           \
    PyObject *name(PyObject *self, PyObject *args, PyObject *kwds)                       \
    {                                                                                    \
        (void)self;                                                                      \
        return call_tuple(&name##_spec, args, kwds);                                     \
    }
PyObject *forward(PyObject *self, PyObject *const *argv, Py_ssize_t nargs, PyObject *kwnames);
PyObject *backward(PyObject *self, PyObject *args, PyObject *kwds);
PyObject *project(PyObject *self, PyObject *const *argv, Py_ssize_t nargs, PyObject *kwnames);
PyObject *check_config(PyObject *self, PyObject *const *argv, Py_ssize_t nargs,
                       PyObject *kwnames);
PyObject *attention(PyObject *self, PyObject *const *argv, Py_ssize_t nargs, PyObject *kwnames);
PyObject *attention_backward(PyObject *self, PyObject *const *argv, Py_ssize_t nargs,
                             PyObject *kwnames);
PyObject *pack_weight(PyObject *self, PyObject *arg);
/* Whether a's dtype is bfloat16 (ml_dtypes'), known by name (convert.c). */
int glue_is_bfloat16(PyArrayObject *a);
PyObject *packed_info(PyObject *self, PyObject *cap);
extern const char forward_doc[], backward_doc[], project_doc[], attention_doc[],
    attention_backward_doc[], check_config_doc[], pack_weight_doc[], packed_info_doc[];

#endif
