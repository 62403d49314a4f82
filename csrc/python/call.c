/*
 * call.c - the call skeleton: a call's life (call_init, call_release), its
 * mha_config, its outputs, the core run with the GIL released and Ctrl-C
 * seen, and a core status turned into a Python exception.
 */
#include "glue.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include "platform.h"

/* The ValueError of a core rejection: "mhattn: <the core's message>", with
   the field's name (mha_field_names, args_gen.c, from the schema) as its
   attribute .field, which the door to _C (mhattn._internal.core) reads to
   name the user's argument. */
static void raise_rejection(const mha_error *err)
{
    const char *field = (unsigned)err->field < MHA_FIELD_COUNT ? mha_field_names[err->field]
                                                               : "";
    PyObject *exc = PyObject_CallFunction(PyExc_ValueError, "s", "");
    if (exc == NULL)
        return;
    PyObject *msg = PyUnicode_FromFormat("mhattn: %s", err->msg);
    PyObject *name = PyUnicode_FromString(field);
    PyObject *args = msg != NULL ? PyTuple_Pack(1, msg) : NULL;
    if (args != NULL && name != NULL && PyObject_SetAttrString(exc, "args", args) == 0 &&
        PyObject_SetAttrString(exc, "field", name) == 0)
        PyErr_SetObject(PyExc_ValueError, exc);
    Py_XDECREF(args);
    Py_XDECREF(msg);
    Py_XDECREF(name);
    Py_DECREF(exc);
}

/* Turns a core status into a Python exception: MHA_ERR_ARG with the
   core's message (err, which may be NULL or empty) is the ValueError of
   that message, which names the rule and the values seen, and carries
   the field's name (raise_rejection). */
void raise_status(mha_status st, const mha_error *err)
{
    if (st == MHA_ERR_ARG && err != NULL && err->msg[0] != '\0') {
        raise_rejection(err);
        return;
    }
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
int sigint_setup(void)
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
 * (the caller starts the call over), else 0.
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


/* Nulls what call_release frees, and fills the ARG_NONE slot. The rest is
   written before it is read: that is cheaper than zeroing the whole struct
   on every small call. */
static void call_init(call *c)
{
    memset(c->in, 0, sizeof c->in);
    memset(c->out, 0, sizeof c->out);
    memset(c->var, 0, sizeof c->var);
    c->arg[ARG_NONE] = (arg_value){Py_None, 0};
    c->widths = NULL;
    c->scales = NULL;
    c->lengths = NULL;
    c->table = NULL;
    c->pages_per_seq = c->page_size = c->num_pages = 0;
    c->kv = MHA_KV_PLAIN;
    c->w = MHA_KV_PLAIN;
    c->err.msg[0] = '\0';   /* read only after a status of MHA_ERR_ARG */
}

static void call_release(call *c)
{
    PyMem_Free(c->widths);
    PyMem_Free(c->scales);
    PyMem_Free(c->lengths);
    PyMem_Free(c->table);
    for (int i = 0; i <= MAX_ARGS; i++)
        Py_XDECREF(c->in[i]);
    for (int i = 0; i < MAX_OUTS; i++)
        Py_XDECREF(c->out[i]);
    for (int i = 0; i < V_HELD; i++)
        Py_XDECREF(c->var[i]);
}

/* c->cfg, the one place an mha_config is filled: the sizes by letter, the
   glue's snapshots, the mask and the truths at the positions sp names. */
static void fill_config(call *c, const call_spec *sp, mha_mask_kind mask_kind,
                        const ptrdiff_t ms[4])
{
    const npy_intp *n = c->size;
    const size_t G = (size_t)n[L_G];
    c->cfg = (mha_config){
        .B = (size_t)n[L_B], .Tq = (size_t)n[L_TQ], .Tk = (size_t)n[L_TK],
        .Din = (size_t)n[L_DIN], .Dkin = (size_t)n[L_DKIN],
        .Dvin = (size_t)n[L_DVIN], .Dout = (size_t)n[L_DOUT],
        .H = (size_t)n[L_H], .G = G,
        .dk = c->widths, .dv = c->widths + G,
        .scale = c->scales,
        .causal = c->arg[sp->causal].truth,
        .mask_kind = mask_kind, .mask = DATA(c->in[sp->mask]),
        .mask_stride = {ms[0], ms[1], ms[2], ms[3]},
        .key_lengths = c->lengths,
        .has_wo = c->in[sp->wo] != NULL || sp->has_wo,
        .lengths_aligned = c->arg[sp->lengths_aligned].truth,
        .block_table = c->table, .pages_per_seq = c->pages_per_seq,
        .page_size = c->page_size, .num_pages = c->num_pages,
        .interrupt = NULL,
    };
}

/*
 * The float arrays converted; the vectors, the sizes (c->size) and the
 * head widths by the family's sizes step, which checks the shapes against
 * them (in the order of errors its family has always had); the key
 * lengths, the mask and the scales' snapshot; then c->cfg, the variants,
 * the family's own checks and the core's, and the family's finish.
 */
static int build_config(call *c, const call_spec *sp)
{
    if (convert_arrays(c, sp) < 0 || sp->sizes(c, sp) < 0)
        return -1;
    const npy_intp *n = c->size;
    mha_mask_kind mask_kind;
    ptrdiff_t mask_stride[4];
    if (as_lengths(&c->lengths, c->arg[sp->key_lengths].obj, n[L_B]) < 0 ||
        convert_mask(c, sp, &mask_kind, mask_stride) < 0 ||
        snapshot_scales(&c->scales, c->in[sp->scales]) < 0)
        return -1;
    fill_config(c, sp, mask_kind, mask_stride);
    if (read_variants(c, c->arg[sp->variants].obj) < 0 ||
        (sp->check != NULL && sp->check(c) < 0) ||
        (sp->checked && core_check(&c->cfg, c->typenum) < 0) ||
        (sp->finish != NULL && sp->finish(c) < 0))
        return -1;
    return 0;
}

/* The outputs: new C-contiguous arrays of x's dtype, out[i] of shape
   shapes[i] where want[i] (sizes checked by mha_check_config). */
/* want_dmask asks for the gradient of an additive mask: a ValueError,
   naming it, for a call whose mask is bool or absent. */
int want_dmask_check(const call *c)
{
    if (c->cfg.mask_kind == MHA_MASK_ADD)
        return 0;
    PyErr_Format(PyExc_ValueError, "want_dmask: dmask is the gradient of an additive "
                 "(float) mask; this call's mask is %s",
                 c->cfg.mask_kind == MHA_MASK_BOOL ? "bool" : "None");
    return -1;
}

int make_outputs(call *c, int nout, const shape *shapes, const int *want)
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
static int run_core(call *c, mha_status (*core)(call *), int main_thread)
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
        raise_status(st, &c->err);
        return -1;
    }
    return 0;
}

/* A new tuple of the n arrays a, None for each NULL. */
PyObject *arrays_tuple(PyArrayObject *const *a, int n)
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

/*
 * The rest of a parsed call, the same for every entry point: its config,
 * its outputs, the core run (a call of at most MHA_SMALL_WORK multiply-adds,
 * tens of microseconds, is not worth the Ctrl-C handler's two sigaction
 * system calls, nor the look-up of the main thread: Python sees a signal
 * that comes during it as soon as it returns, as if it had come just
 * after), and its result. Releases the call.
 */
static PyObject *call_run(call *c, const call_spec *sp)
{
    PyObject *result = NULL;
    if (build_config(c, sp) == 0 && sp->outputs(c) == 0) {
        const int main_thread =
            (sp->work == NULL || sp->work(c) > MHA_SMALL_WORK) && on_main_thread();
        if (run_core(c, sp->core, main_thread) == 0)
            result = sp->result(c);
    }
    call_release(c);
    return result;
}

/* The one call skeleton, for a METH_FASTCALL | METH_KEYWORDS entry point
   described by sp. */
PyObject *call_fast(const call_spec *sp, PyObject *const *argv, Py_ssize_t nargs,
                    PyObject *kwnames)
{
    call c;
    call_init(&c);
    if (parse_fast(&c, sp, argv, nargs, kwnames) < 0) {
        call_release(&c);
        return NULL;
    }
    return call_run(&c, sp);
}

/* The same for a METH_VARARGS | METH_KEYWORDS one. */
PyObject *call_tuple(const call_spec *sp, PyObject *args, PyObject *kwds)
{
    call c;
    call_init(&c);
    if (parse_tuple(&c, sp, args, kwds) < 0) {
        call_release(&c);
        return NULL;
    }
    return call_run(&c, sp);
}
