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

/* Turns a core status into a Python exception. */
void raise_status(mha_status st)
{
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
int on_main_thread(void)
{
    return mha_sigint_supported() && PyThread_get_thread_ident() == sigint_main_ident;
}

/*
 * After a core call made with the GIL released, on the main thread: puts
 * Python's SIGINT handling back and runs any Python handler the signal
 * called for. -1 when that handler raised (the caller fails with its
 * exception), 1 when the core stopped early and the handler did not raise
 * (the caller starts the call over), else 0. Shared by forward and backward.
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


/* Nulls what call_release frees. The rest is written before it is read:
   that is cheaper than zeroing the whole struct on every small call. */
void call_init(call *c)
{
    memset(c->in, 0, sizeof c->in);
    memset(c->out, 0, sizeof c->out);
    memset(c->var, 0, sizeof c->var);
    c->widths = NULL;
    c->scales = NULL;
    c->lengths = NULL;
}

void call_release(call *c)
{
    PyMem_Free(c->widths);
    PyMem_Free(c->scales);
    PyMem_Free(c->lengths);
    for (int i = 0; i < MAX_ARGS; i++)
        Py_XDECREF(c->in[i]);
    for (int i = 0; i < MAX_OUTS; i++)
        Py_XDECREF(c->out[i]);
    for (int i = 0; i < V_N; i++)
        Py_XDECREF(c->var[i]);
}

/*
 * The sizes (c->size) from x, key, value, dk, dv, scales and wo; the
 * shapes of the other arrays against them; the key lengths and the mask;
 * then c->cfg, checked by the core.
 */
int build_config(call *c, const call_spec *sp)
{
    PyArrayObject *const *in = c->in;
    PyArrayObject *x = in[sp->x], *key = in[sp->key], *value = in[sp->value];
    PyArrayObject *wo = in[sp->wo];
    npy_intp *n = c->size;
    n[L_B] = PyArray_DIM(x, 0);
    n[L_TQ] = PyArray_DIM(x, 1);
    n[L_DIN] = PyArray_DIM(x, 2);
    n[L_TK] = PyArray_DIM(key, 1);
    n[L_DKIN] = PyArray_DIM(key, 2);
    n[L_DVIN] = PyArray_DIM(value, 2);
    n[L_H] = PyArray_DIM(in[sp->scales], 0);
    if (check_shapes(c, sp, sp->checks_x) < 0)
        return -1;

    size_t fused[4];   // Sq, Sk, Sv, Svq
    if (head_widths(&c->widths, fused, in[sp->dk], in[sp->dv], n[L_H]) < 0)
        return -1;
    const size_t G = (size_t)PyArray_DIM(in[sp->dk], 0);
    n[L_SQ] = (npy_intp)fused[0];
    n[L_SK] = (npy_intp)fused[1];
    n[L_SV] = (npy_intp)fused[2];
    n[L_SVQ] = (npy_intp)fused[3];
    n[L_DOUT] = wo != NULL ? PyArray_DIM(wo, 1) : n[L_SVQ];
    if (check_shapes(c, sp, sp->checks_widths) < 0)
        return -1;

    mha_mask_kind mask_kind;
    ptrdiff_t mask_stride[4];
    if (as_lengths(&c->lengths, c->arg[sp->key_lengths].obj, n[L_B],
                   n[L_TK]) < 0 ||
        convert_mask(c, sp, &mask_kind, mask_stride) < 0 ||
        snapshot_scales(&c->scales, in[sp->scales]) < 0)
        return -1;

    c->cfg = (mha_config){
        .B = (size_t)n[L_B], .Tq = (size_t)n[L_TQ], .Tk = (size_t)n[L_TK],
        .Din = (size_t)n[L_DIN], .Dkin = (size_t)n[L_DKIN],
        .Dvin = (size_t)n[L_DVIN], .Dout = (size_t)n[L_DOUT],
        .H = (size_t)n[L_H], .G = G,
        .dk = c->widths, .dv = c->widths + G,
        .scale = c->scales,
        .causal = c->arg[sp->causal].truth,
        .mask_kind = mask_kind, .mask = DATA(in[sp->mask]),
        .mask_stride = {mask_stride[0], mask_stride[1], mask_stride[2],
                        mask_stride[3]},
        .key_lengths = c->lengths,
        .has_wo = wo != NULL, .interrupt = NULL,
    };
    if (read_variants(c, c->arg[sp->variants].obj) < 0)
        return -1;
    mha_layout lay;
    const mha_status st = mha_check_config(&lay, &c->cfg);
    if (st != MHA_OK) {
        raise_status(st);
        return -1;
    }
    return 0;
}

/* The outputs: new C-contiguous arrays of x's dtype, out[i] of shape
   shapes[i] where want[i] (sizes checked by mha_check_config). */
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
int run_core(call *c, mha_status (*core)(const call *), int main_thread)
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
        raise_status(st);
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
