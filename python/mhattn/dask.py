"""Exact attention over Dask arrays (issue 40): ``pip install mhattn[dask]``.

``attention`` and ``attention_grad`` cut a call into blocks, one task per
(query chunk, key chunk) that some query of the chunk may see a key of, each
task one :func:`mhattn.attention` (or :func:`mhattn.attention_grad`) on
NumPy blocks; ``multi_head_attention`` adds the projections around them.

How a block sees the whole call's rules: the whole call places query i at
``p_i = i + (T_k - T_q)`` (bottom-right), so the block of queries from q0
against keys from k0 passes ``q_offset = q0 + (T_k - T_q) - k0``, and
causal, the window and ALiBi line up with the global positions;
``key_lengths`` becomes each item's count of the block's keys, and
``key_mask`` its columns of the block's keys.

The partials of one query chunk (its out and lse over the block's keys) are
merged by :func:`mhattn.merge_attention` in a binary tree over the visible
key chunks in increasing order, so that the graph, and so the bits, depend
on the chunks alone, never on the scheduler, the cluster or the order in
which tasks finish. The backward sums dq over the key chunks and dk, dv
over the query chunks by the same kind of tree. A sink is counted once per
query row: only the first visible block of a query chunk is given
``sinks`` (its lse then holds the sink's term, which the merge keeps), and
only that block's gradient holds the sinks' part.

No task holds more than one query chunk by one key chunk of scores: the
core's tiles hold less. Blocks that causal, a window, ``key_lengths`` or
``key_mask`` leave empty are not in the graph.

Threads: on a Dask worker, a task alone there (nothing else executing or
ready) runs mhattn on the worker's ``nthreads``, and the worker's next
mhattn task waits for it; tasks side by side run one thread each, so a
worker of n threads never runs more than n. Other pool threads (the
threaded scheduler's) run one thread; the synchronous scheduler (one task
at a time, in the calling thread) keeps mhattn's own count. The count is
set for the tasks running and restored when the last one ends; results do
not depend on it.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import sys
import threading
from contextlib import contextmanager
from typing import Any, Dict, List, Optional

import numpy as np

try:
    import dask.array as da
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph
except ImportError as e:   # the optional extra
    raise ImportError("mhattn.dask needs Dask: pip install mhattn[dask] "
                      f"(importing dask.array failed: {e})") from e

from .compute.attention import attention as _attention
from .compute.attention import attention_grad as _attention_grad
from .compute.attention import merge_attention as _merge_attention
from .compute.attention import check_projected as _check_projected
from .compute.forward import multi_head_attention as _multi_head_attention
from ._internal import core as _core
from ._internal.args import normalize as _normalize
from ._internal.core import _fused_bias, head_arrays as _head_arrays
from ._internal.variants import _positions
from ._internal.variants import variants_tuple_of as _variants_tuple_of
from ._internal.runtime import get_num_threads, set_num_threads

__all__ = ["attention", "attention_grad", "multi_head_attention"]

_LAYOUTS = ("bhtd", "bthd")


# ---- threads --------------------------------------------------------------

_cond = threading.Condition()
_running = 0            # tasks of this module running in this process
_wide = False           # one of them runs on more than one thread
_saved: Optional[int] = None


def _worker_state():
    """The Dask worker's state (``WorkerState``) when this thread runs one
    of its tasks, else None."""
    # A worker process has imported distributed; elsewhere no import is tried
    # (a failed import is not cached, and this runs once per task).
    dist = sys.modules.get("distributed")
    if dist is not None:
        try:
            return dist.get_worker().state
        except ValueError:   # not in a worker's task
            pass
    return None


def _concurrent() -> bool:
    """True when other tasks may run in this process alongside this one: a
    Dask worker's thread or a pool thread (not the synchronous scheduler's
    calling thread)."""
    if _worker_state() is not None:
        return True
    return threading.current_thread() is not threading.main_thread()


def _alone(ws) -> int:
    """The worker's thread count when the task calling this is the only one
    it runs or has ready to run, else 1."""
    n = int(getattr(ws, "nthreads", 1) or 1)
    try:
        busy = ws.executing_count + len(ws.ready) + len(getattr(ws, "constrained", ()))
    except (AttributeError, TypeError):   # another distributed's state: be modest
        return 1
    return n if busy <= 1 else 1


@contextmanager
def _task_threads():
    """mhattn's thread count for one task (restored after the last).

    On a Dask worker a task that is alone there (nothing else executing or
    ready) takes the worker's ``nthreads``, and until it ends the worker's
    next mhattn task waits for it rather than add a thread the cores do not
    have; tasks that run together take one thread each. Other pool threads
    (the threaded scheduler's) take one thread; the synchronous scheduler's
    tasks keep the caller's count. Results do not depend on the count.
    """
    global _running, _wide, _saved
    if not _concurrent():
        yield
        return
    ws = _worker_state()
    with _cond:
        while _wide:   # a lone task has every core: wait for it
            _cond.wait()
        if _running == 0:
            _saved = get_num_threads()
        n = 1 if ws is None or _running else _alone(ws)
        _wide = n > 1
        set_num_threads(n)
        _running += 1
    try:
        yield
    finally:
        with _cond:
            _running -= 1
            if n > 1:
                _wide = False
                set_num_threads(1)
                _cond.notify_all()
            if _running == 0:
                set_num_threads(_saved)


def _in_task(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with _task_threads():
            return fn(*args, **kwargs)
    return run


# ---- the tasks ------------------------------------------------------------

@_in_task
def _fwd_block(q, k, v, opts):
    """One block's (out, lse): mhattn.attention on NumPy blocks (bhtd)."""
    return _attention(q, k, v, return_lse=True, **opts)


@_in_task
def _merge(a, b):
    """Two partials (out, lse) of the same queries over disjoint keys."""
    return _merge_attention([a[0], b[0]], [a[1], b[1]])


def _empty_rows(shape, dtype, lse_dtype, sinks):
    """(out, lse) of query rows that see no key: out 0, lse -inf, or the
    sink's logit (the softmax over the sink alone) with sinks."""
    out = np.zeros(shape, dtype)
    lse = np.full(shape[:-1], -np.inf, lse_dtype)
    if sinks is not None:
        lse[...] = np.asarray(sinks, lse_dtype)[None, :, None]
    return out, lse


@_in_task
def _bwd_block(g, q, k, v, out, lse, opts):
    """One block's gradients, given the whole call's out and lse."""
    return _attention_grad(g, q, k, v, out=out, lse=lse, **opts)


def _add(a, b):
    return a + b


# ---- checking and planning ------------------------------------------------

def _proxy(a, layout: str, one_row: bool):
    """A zero-strided stand-in of a's shape and dtype (no memory), with its
    time axis cut to one row when ``one_row``: mhattn checks it as it
    would check the array."""
    shape = list(a.shape)
    if one_row and len(shape) in (3, 4):
        shape[-2 if layout == "bhtd" else -3] = 1
    return np.broadcast_to(np.zeros((), a.dtype), tuple(shape))


@contextmanager
def _real_shapes(q, k, v, layout):
    """A rejection of the one-row stand-ins that is about q's, k's and v's
    shapes is raised again from whole-length stand-ins (shapes alone,
    nothing computed), so that its message names the shapes given."""
    try:
        yield
    except (ValueError, TypeError):
        full = [np.broadcast_to(np.zeros((), a.dtype), a.shape) for a in (q, k, v)]
        try:
            _check_projected(*full, layout)
        except (ValueError, TypeError) as e:
            raise e from None
        raise


def _arrays(names, arrays):
    out = []
    for name, a in zip(names, arrays):
        if not isinstance(a, da.Array):
            if not hasattr(a, "shape") or not hasattr(a, "dtype"):
                a = np.asarray(a)
            a = da.from_array(a, chunks=a.shape or ())
        out.append(a)
    return out


def _layout(layout) -> str:
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise ValueError(f"layout: expected 'bhtd' or 'bthd', got {layout!r:.80}")
    return layout


def _to_bhtd(a, layout: str):
    """(B, H, T, d) of a (3-D: unbatched, B = 1)."""
    if a.ndim == 3:
        a = a[None]
    return a if layout == "bhtd" else a.transpose(0, 2, 1, 3)


def _from_bhtd(a, layout: str, batched: bool):
    if layout == "bthd" and a.ndim == 4:
        a = a.transpose(0, 2, 1, 3)
    return a if batched else a[0]


def _cuts(chunks) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)


class _Plan:
    """The blocks of a call: its arrays rechunked so that q's and k's chunks
    line up (batch; heads, by groups under GQA; whole head widths), and per
    (batch chunk, query chunk) the key chunks some query of it may see."""

    def __init__(self, q, k, v, causal, window, key_lengths, key_mask, batched):
        B, H, Tq, dk = q.shape
        G, Tk, dv = k.shape[1], k.shape[2], v.shape[3]
        r = H // G   # mhattn has checked H % G == 0
        # heads: q's chunk boundaries rounded down to whole groups of r
        hb = sorted({int(c) // r * r for c in _cuts(q.chunks[1])} | {H})
        hc = tuple(np.diff(hb).tolist())
        self.q = q.rechunk((q.chunks[0], hc, q.chunks[2], (dk,)))
        gc = tuple(c // r for c in hc)
        self.k = k.rechunk((q.chunks[0], gc, k.chunks[2], (dk,)))
        self.v = v.rechunk((q.chunks[0], gc, k.chunks[2], (dv,)))
        self.B, self.H, self.G, self.Tq, self.Tk, self.dv = B, H, G, Tq, Tk, dv
        self.bcut, self.hcut = _cuts(q.chunks[0]), np.array(hb, np.int64)
        self.qcut, self.kcut = _cuts(self.q.chunks[2]), _cuts(self.k.chunks[2])
        self.kl = None
        if key_lengths is not None:
            self.kl = np.asarray(key_lengths, np.int64).reshape(B)
        self.km = None   # (B, T_k), as given (mhattn has checked it)
        if key_mask is not None:
            self.km = np.broadcast_to(np.asarray(key_mask), (B, Tk))
        self.seen = [self._seen(bi, causal, window)
                     for bi in range(len(self.bcut) - 1)]

    def _seen(self, bi, causal, window) -> List[List[int]]:
        """Per query chunk, the key chunks (increasing) that a query of it
        may see in batch chunk bi: each row's keys are one interval [lo, hi)
        (core/rules.h, mha_rules_key_range), here for every row at once."""
        p = np.arange(self.Tq, dtype=np.int64) + (self.Tk - self.Tq)
        lo = np.zeros_like(p)
        n, nxt = self.Tk, None
        b0, b1 = self.bcut[bi], self.bcut[bi + 1]
        if self.km is not None:   # the keys real for some item of the chunk
            real = self.km[b0:b1].astype(bool)
            if self.kl is not None:
                real = real & (np.arange(self.Tk) < self.kl[b0:b1, None])
            nxt = _next_real(real.any(axis=0))
        elif self.kl is not None:
            n = int(self.kl[b0:b1].max(initial=0))
        hi = np.full_like(p, n)
        if causal:
            hi = np.minimum(hi, p + 1)
        if window is not None:
            left, right = window
            if left is not None:
                lo = np.maximum(lo, p - int(left))
            if right is not None:
                hi = np.minimum(hi, p + int(right) + 1)
        # Among the rows that see something (lo < hi; lo and hi stay
        # nondecreasing), key chunk [k0, k1) is seen iff the first row with
        # hi > k0 comes no later than the last with lo < k1: two binary
        # searches per (query chunk, key chunk).
        k0, k1 = self.kcut[:-1], self.kcut[1:]
        seen = []
        for i in range(len(self.qcut) - 1):
            a, b = lo[self.qcut[i]:self.qcut[i + 1]], hi[self.qcut[i]:self.qcut[i + 1]]
            a, b = a[a < b], b[a < b]
            if nxt is None:
                first = np.searchsorted(b, k0, side="right")
                last = np.searchsorted(a, k1, side="left") - 1
                seen.append(np.flatnonzero(first <= last).tolist())
            else:
                seen.append(np.flatnonzero(_sees_real(a, b, k0, k1, nxt)).tolist())
        return seen

    def opts(self, bi, hi_, i, j, base: Dict[str, Any], sinks, alibi, first: bool):
        """The keywords of block (bi, hi_, i, j)'s call."""
        b0, b1 = self.bcut[bi], self.bcut[bi + 1]
        h0, h1 = self.hcut[hi_], self.hcut[hi_ + 1]
        k0, k1 = self.kcut[j], self.kcut[j + 1]
        o = dict(base, q_offset=int(self.qcut[i] + (self.Tk - self.Tq) - k0))
        if self.kl is not None:
            o["key_lengths"] = np.clip(self.kl[b0:b1] - k0, 0, k1 - k0)
        if self.km is not None:
            o["key_mask"] = self.km[b0:b1, k0:k1]
        if alibi is not None:
            o["alibi_slopes"] = alibi[h0:h1] if alibi.ndim == 1 else alibi[b0:b1, h0:h1]
        if sinks is not None and first:
            o["sinks"] = sinks[h0:h1]
        return o

    def blocks(self):
        """(bi, hi, i, visible key chunks) of every query chunk."""
        for bi, seen in enumerate(self.seen):
            for hi_ in range(len(self.hcut) - 1):
                for i, js in enumerate(seen):
                    yield bi, hi_, i, js


def _next_real(real) -> np.ndarray:
    """(T + 1,): entry t the first key >= t with ``real`` True, T if none."""
    T = len(real)
    idx = np.where(real, np.arange(T), T)
    return np.append(np.minimum.accumulate(idx[::-1])[::-1], T)


def _sees_real(lo, hi, k0, k1, nxt) -> np.ndarray:
    """Per key chunk [k0, k1): whether some row's keys [lo, hi) hold a real
    key there: the first real key at or after max(lo, k0) (``nxt``, from
    _next_real) lies before min(hi, k1). Rows in slabs, about 2^20 pairs
    each."""
    T = len(nxt) - 1
    seen = np.zeros(len(k0), bool)
    step = max(1, (1 << 20) // max(len(k0), 1))
    for r in range(0, len(lo), step):
        a = np.maximum(lo[r:r + step, None], k0[None, :])
        b = np.minimum(hi[r:r + step, None], k1[None, :])
        seen |= (nxt[np.minimum(a, T)] < b).any(axis=0)
    return seen


def _tree(tasks: dict, keys: list, name: str, fn) -> Any:
    """The root of a binary tree of ``fn`` over ``keys`` in their order,
    adjacent pairs first: a fixed shape for a given number of parts."""
    level = 0
    while len(keys) > 1:
        nxt = []
        for n in range(0, len(keys) - 1, 2):
            key = name + (level, n // 2)
            tasks[key] = (fn, keys[n], keys[n + 1])
            nxt.append(key)
        if len(keys) % 2:
            nxt.append(keys[-1])
        keys, level = nxt, level + 1
    return keys[0]


def _graph(tasks: dict, name: str, deps, outs: Dict[str, dict]):
    """A HighLevelGraph of the blocks' layer ``name`` (on ``deps``) and one
    layer per output array (named by its key, holding its tasks)."""
    g = HighLevelGraph.from_collections(name, tasks, dependencies=deps)
    layers, dependencies = dict(g.layers), dict(g.dependencies)
    for out_name, layer in outs.items():
        layers[out_name], dependencies[out_name] = layer, {name}
    return HighLevelGraph(layers, dependencies)


def _options(scale, causal, window, softcap, alibi_slopes, sinks):
    base = dict(scale=scale, causal=causal, window=window, softcap=softcap)
    alibi = None if alibi_slopes is None else np.asarray(alibi_slopes, np.float64)
    return base, alibi, None if sinks is None else np.asarray(sinks)


# ---- the entry points -----------------------------------------------------

def attention(q, k, v, *, layout="bhtd", scale=None, causal=False, key_lengths=None,
              window=None, softcap=None, alibi_slopes=None, sinks=None, key_mask=None,
              return_lse=False):
    """:func:`mhattn.attention` over Dask arrays, exact, as a graph of blocks.

    attention(q, k, v, *, layout="bhtd", scale=None, causal=False,
    key_lengths=None, window=None, softcap=None, alibi_slopes=None,
    sinks=None, key_mask=None, return_lse=False) -> out or (out, lse)

    Every argument is checked by mhattn, with its messages, before any task
    exists: the arrays' shapes and dtypes through zero-strided stand-ins
    (one query row, no memory). A task computes one (query chunk, key
    chunk) block that some query may see with ``mhattn.attention(...,
    q_offset=, return_lse=True)``; a query chunk's blocks are merged by a
    fixed binary tree of :func:`mhattn.merge_attention` (the module's
    docstring says why the bits are those of every run).

    Parameters
    ----------
    q, k, v : dask.array.Array (or array-likes)
        As :func:`mhattn.attention`: (B, h, T_q, d_k), (B, g, T_k, d_k),
        (B, g, T_k, d_v) with ``layout="bhtd"`` (or (B, T, heads, d) with
        "bthd", or unbatched 3-D), chunked along any of batch, heads and
        time, the queries and the keys independently. k and v are rechunked
        to q's batch chunks and to q's head chunks (by groups of h // g
        query heads), v to k's time chunks; the head widths are made one
        chunk.
    layout, scale, causal, key_lengths, window, softcap, alibi_slopes, sinks, key_mask
        As :func:`mhattn.attention`; ``key_lengths`` (B,), ``alibi_slopes``,
        ``sinks`` and ``key_mask`` ((T_k,) or (B, T_k) bool) are NumPy
        arrays, cut for each block. Key chunks that ``key_mask`` leaves
        without a real key in a batch chunk are not in its graph.
    return_lse : bool, default False
        Also return the log-sum-exp (B, h, T_q), the whole call's.

    Returns
    -------
    out : dask.array.Array, q's layout and chunks (its time chunks),
        ``(out, lse)`` with ``return_lse``.

    Examples
    --------
    >>> import dask, dask.array as da
    >>> rng = np.random.default_rng(0)
    >>> q = da.from_array(rng.standard_normal((1, 2, 100, 8)), chunks=(1, 2, 30, 8))
    >>> out = mhattn.dask.attention(q, q, q, causal=True)
    >>> np.allclose(out.compute(scheduler="sync"),
    ...             mhattn.attention(q.compute(), q.compute(), q.compute(), causal=True))
    True
    """
    layout = _layout(layout)
    q, k, v = _arrays("qkv", (q, k, v))
    with _real_shapes(q, k, v, layout):
        proxy = _attention(_proxy(q, layout, True), _proxy(k, layout, False),
                           _proxy(v, layout, False), layout=layout, scale=scale,
                           causal=causal, key_lengths=key_lengths, window=window,
                           softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                           key_mask=key_mask, return_lse=True)
    batched = q.ndim == 4
    plan = _Plan(_to_bhtd(q, layout), _to_bhtd(k, layout), _to_bhtd(v, layout), causal,
                 window, key_lengths, key_mask, batched)
    base, alibi, sinks = _options(scale, causal, window, softcap, alibi_slopes, sinks)
    dtype = proxy[0].dtype
    tok = tokenize(plan.q.name, plan.k.name, plan.v.name, base, alibi, sinks, plan.kl,
                   plan.km)
    name = "mhattn-attention-" + tok
    out_name, lse_name = "mhattn-attention-out-" + tok, "mhattn-attention-lse-" + tok
    tasks, outs, lses = {}, {}, {}
    for bi, h, i, js in plan.blocks():
        parts = []
        for n, j in enumerate(js):
            key = (name + "-block", bi, h, i, j)
            o = plan.opts(bi, h, i, j, base, sinks, alibi, n == 0)
            tasks[key] = (functools.partial(_fwd_block, opts=o), (plan.q.name, bi, h, i, 0),
                          (plan.k.name, bi, h, j, 0), (plan.v.name, bi, h, j, 0))
            parts.append(key)
        if parts:
            root = _tree(tasks, parts, (name + "-merge", bi, h, i), _merge)
        else:   # no key visible from any query of the chunk
            root = (name + "-empty", bi, h, i)
            shape = (plan.q.chunks[0][bi], plan.q.chunks[1][h], plan.q.chunks[2][i], plan.dv)
            s = None if sinks is None else sinks[plan.hcut[h]:plan.hcut[h + 1]]
            tasks[root] = (_empty_rows, shape, dtype, proxy[1].dtype, s)
        outs[(out_name, bi, h, i, 0)] = (operator.getitem, root, 0)
        lses[(lse_name, bi, h, i)] = (operator.getitem, root, 1)
    g = _graph(tasks, name, [plan.q, plan.k, plan.v], {out_name: outs, lse_name: lses})
    chunks = plan.q.chunks[:3]
    out = da.Array(g, out_name, chunks + ((plan.dv,),), dtype=dtype)
    out = _from_bhtd(out, layout, batched)
    if not return_lse:
        return out
    lse = da.Array(g, lse_name, chunks, dtype=proxy[1].dtype)
    return out, (lse if batched else lse[0])


def _bwd_graph(plan, arrs, base, alibi, sinks, name):
    """The backward's tasks: a block per visible (query chunk, key chunk),
    dq summed over its key chunks, dk and dv over their query chunks, the
    sinks' gradient over the first block of every query chunk, each by a
    fixed tree; zeros where nothing is visible."""
    g_, q, k, v, o, lse = (a.name for a in arrs)
    tasks, into_k, into_s = {}, {}, {}
    for bi, h, i, js in plan.blocks():
        dq = []
        for n, j in enumerate(js):
            key = (name + "-block", bi, h, i, j)
            opts = plan.opts(bi, h, i, j, base, sinks, alibi, n == 0)
            tasks[key] = (functools.partial(_bwd_block, opts=opts), (g_, bi, h, i, 0),
                          (q, bi, h, i, 0), (k, bi, h, j, 0), (v, bi, h, j, 0),
                          (o, bi, h, i, 0), (lse, bi, h, i))
            for part in ("q", "k", "v") + (("sinks",) if sinks is not None and n == 0 else ()):
                tasks[key + (part,)] = (operator.getitem, key, part)
            dq.append(key + ("q",))
            into_k.setdefault((bi, h, j), []).append(key)
            if sinks is not None and n == 0:
                into_s.setdefault(h, []).append(key + ("sinks",))
        shape = (plan.q.chunks[0][bi], plan.q.chunks[1][h], plan.q.chunks[2][i], plan.q.shape[3])
        yield "q", (bi, h, i, 0), (_tree(tasks, dq, (name + "-dq", bi, h, i), _add) if dq
                                    else (np.zeros, shape, plan.dtype))
    for bi in range(len(plan.bcut) - 1):
        for h in range(len(plan.hcut) - 1):
            for j in range(len(plan.kcut) - 1):
                parts = into_k.get((bi, h, j), [])   # in increasing query chunk
                for part, width in (("k", plan.q.shape[3]), ("v", plan.dv)):
                    shape = (plan.k.chunks[0][bi], plan.k.chunks[1][h], plan.k.chunks[2][j],
                             width)
                    keys = [p + (part,) for p in parts]
                    yield part, (bi, h, j, 0), (
                        _tree(tasks, keys, (name + "-d" + part, bi, h, j), _add) if keys
                        else (np.zeros, shape, plan.dtype))
    if sinks is not None:
        for h in range(len(plan.hcut) - 1):
            n = int(plan.hcut[h + 1] - plan.hcut[h])
            keys = into_s.get(h, [])
            yield "sinks", (h,), (_tree(tasks, keys, (name + "-dsinks", h), _add) if keys
                                  else (np.zeros, (n,), plan.dtype))
    yield None, None, tasks


def attention_grad(grad_out, q, k, v, out, lse, *, layout="bhtd", scale=None, causal=False,
                   key_lengths=None, window=None, softcap=None, alibi_slopes=None,
                   sinks=None, key_mask=None) -> Dict[str, Any]:
    """:func:`mhattn.attention_grad` over Dask arrays, as a graph of blocks.

    attention_grad(grad_out, q, k, v, out, lse, *, <attention's keywords>)
    -> {"q": dq, "k": dk, "v": dv[, "sinks": dsinks]}

    Each task is one ``mhattn.attention_grad(..., q_offset=, out=, lse=)`` of
    a block the forward computes; dq is summed over a query chunk's key
    chunks, dk and dv over a key chunk's query chunks, in increasing order
    by a fixed binary tree. Arguments are checked by mhattn first, as in
    :func:`attention`.

    Parameters
    ----------
    grad_out : dask.array.Array, the shape of ``out``
    q, k, v, layout, scale, causal, key_lengths, window, softcap, alibi_slopes, sinks, key_mask
        As :func:`attention`, the forward's.
    out, lse : the forward's results, :func:`attention` with
        ``return_lse=True`` (Dask or NumPy arrays): each block reads its
        query chunk's rows of them, so no forward runs again.

    Returns
    -------
    dict of dask arrays: 'q', 'k', 'v' in their inputs' shapes and layout
    (q's chunks for dq, k's time chunks for dk and dv), and 'sinks' (h,)
    when sinks are given.

    Examples
    --------
    >>> import dask, dask.array as da
    >>> rng = np.random.default_rng(0)
    >>> q = da.from_array(rng.standard_normal((1, 2, 100, 8)), chunks=(1, 2, 30, 8))
    >>> out, lse = mhattn.dask.attention(q, q, q, causal=True, return_lse=True)
    >>> grads = mhattn.dask.attention_grad(da.ones_like(q), q, q, q, out, lse, causal=True)
    >>> got = dask.compute(grads, scheduler="sync")[0]
    >>> qn = q.compute()
    >>> want = mhattn.attention_grad(np.ones_like(qn), qn, qn, qn, causal=True)
    >>> all(np.allclose(got[n], want[n]) for n in ("q", "k", "v"))
    True
    """
    layout = _layout(layout)
    grad_out, q, k, v, out, lse = _arrays(("grad_out", "q", "k", "v", "out", "lse"),
                                          (grad_out, q, k, v, out, lse))
    # One query row stands for T_q when the four agree on it; when they do
    # not, the whole lengths (still no memory), whose mismatch mhattn names.
    rows = {_rows(a, layout) for a in (grad_out, q, out)} | {lse.shape[-1] if lse.ndim else -1}
    one = len(rows) == 1
    with _real_shapes(q, k, v, layout):
        probe = _attention_grad(
            _proxy(grad_out, layout, one), _proxy(q, layout, one), _proxy(k, layout, False),
            _proxy(v, layout, False), layout=layout, scale=scale, causal=causal,
            key_lengths=key_lengths, window=window, softcap=softcap,
            alibi_slopes=alibi_slopes, sinks=sinks, key_mask=key_mask,
            out=_proxy(out, layout, one),
            lse=_lse_proxy(lse, one))
    batched = q.ndim == 4
    plan = _Plan(_to_bhtd(q, layout), _to_bhtd(k, layout), _to_bhtd(v, layout), causal,
                 window, key_lengths, key_mask, batched)
    plan.dtype = probe["q"].dtype   # the gradients' dtype, mhattn's choice
    qc = plan.q.chunks
    g_ = _to_bhtd(grad_out, layout).rechunk(qc[:3] + ((plan.dv,),))
    o = _to_bhtd(out, layout).rechunk(qc[:3] + ((plan.dv,),))
    lse = (lse if batched else lse[None]).rechunk(qc[:3])
    base, alibi, sinks = _options(scale, causal, window, softcap, alibi_slopes, sinks)
    tok = tokenize(g_.name, plan.q.name, plan.k.name, plan.v.name, o.name, lse.name, base,
                   alibi, sinks, plan.kl, plan.km)
    name = "mhattn-attention-grad-" + tok
    names = {p: f"mhattn-attention-grad-d{p}-{tok}" for p in ("q", "k", "v", "sinks")}
    layers: Dict[str, dict] = {}
    for part, idx, task in _bwd_graph(plan, (g_, plan.q, plan.k, plan.v, o, lse), base,
                                      alibi, sinks, name):
        if part is None:
            tasks = task
        else:
            layers.setdefault(names[part], {})[(names[part],) + idx] = task
    g = _graph(tasks, name, [g_, plan.q, plan.k, plan.v, o, lse], layers)
    kc = plan.k.chunks
    res = {"q": da.Array(g, names["q"], qc, dtype=plan.dtype),
           "k": da.Array(g, names["k"], kc, dtype=plan.dtype),
           "v": da.Array(g, names["v"], plan.v.chunks, dtype=plan.dtype)}
    res = {n: _from_bhtd(a, layout, batched) for n, a in res.items()}
    if sinks is not None:
        res["sinks"] = da.Array(g, names["sinks"], (qc[1],), dtype=plan.dtype)
    return res


def _rows(a, layout: str) -> int:
    """a's time length (-1 when a is not 3-D or 4-D)."""
    return a.shape[-2 if layout == "bhtd" else -3] if a.ndim in (3, 4) else -1


def _lse_proxy(lse, one_row: bool):
    """lse's stand-in: one query row, as q's, when ``one_row``."""
    shape = list(lse.shape)
    if one_row and len(shape) in (2, 3):
        shape[-1] = 1
    return np.broadcast_to(np.zeros((), lse.dtype), tuple(shape))


def _batch_rows(a, b0, b1):
    """Rows b0 .. b1-1 of a checked (1, T) or (B, T) array (its one row,
    (T,), when it is shared by the batch); None stays None."""
    if a is None:
        return None
    return a[0] if a.shape[0] == 1 else a[b0:b1]


def _first_column(a, checked: bool):
    """The positions of the probe's one row: column 0 of a checked (1, T)
    or (B, T) array (shape (1,) or (B, 1)); a when not checked."""
    if a is None or not checked:
        return a
    return a[0, :1] if a.shape[0] == 1 else a[:, :1]


@_in_task
def _mha_block(x, *, weights, opts, kl, km, pos, kpos, bcut, block_id=None):
    """mhattn.multi_head_attention on one batch chunk of whole sequences."""
    b0, b1 = bcut[block_id[0]], bcut[block_id[0] + 1]
    rows = dict(key_lengths=None if kl is None else kl[b0:b1],
                key_mask=None if km is None else km[b0:b1],
                positions=_batch_rows(pos, b0, b1), key_positions=_batch_rows(kpos, b0, b1))
    opts = dict(opts, **{n: a for n, a in rows.items() if a is not None})
    return _multi_head_attention(x, *weights, **opts)


@_in_task
def _project_block(x, *, weights, opts, pos, kpos, bcut, tcut, out_dtype, block_id=None):
    """The q, k and v of one (batch chunk, time chunk) of x, side by side
    along the last axis: mhattn's projections, with the biases, the q/k
    norm and RoPE at the chunk's columns t0 .. t1-1 of ``pos`` and ``kpos``
    (the whole call's checked (1, T) or (B, T) positions, or None: then the
    global positions t0 + i, as the whole call's queries and keys have)."""
    b0, b1 = bcut[block_id[0]], bcut[block_id[0] + 1]
    t0, t1 = int(tcut[block_id[1]]), int(tcut[block_id[1] + 1])
    call = _normalize(x, *weights, core_checks_next=True, **opts)
    dk, dv, scales = _head_arrays(call)
    var = call.var
    if var.rotary_dim > 0:
        own = t0 + np.arange(t1 - t0, dtype=np.int64)
        at = [own if a is None else _batch_rows(a, b0, b1)[..., t0:t1] for a in (pos, kpos)]
        var = dataclasses.replace(var, **{
            n: np.broadcast_to(a, (call.B, call.Tq))
            for n, a in zip(("positions", "key_positions"), at)})
    fused = (call.wq.fused(), call.wk.fused(), call.wv.fused(), _fused_bias(call.bq),
             _fused_bias(call.bk), _fused_bias(call.bv))
    q, k, v = _core.project(call.x, call.key, call.value, *fused, dk, dv, scales,
                            _variants_tuple_of(var))
    return np.concatenate([q, k, v], axis=-1).astype(out_dtype, copy=False)


_PROJECTION_KW = ("num_heads", "num_kv_heads", "b_q", "b_k", "b_v", "q_norm", "k_norm",
                  "norm_eps", "norm_type", "rope")


def multi_head_attention(x, w_q, w_k, w_v, w_o=None, *, num_heads, num_kv_heads=None,
                         scale=None, causal=False, key_lengths=None, window=None,
                         softcap=None, alibi_slopes=None, sinks=None, key_mask=None,
                         b_q=None, b_k=None, b_v=None, b_o=None, w_gate=None, b_gate=None,
                         q_norm=None, k_norm=None, norm_eps=1e-6, norm_type="rms",
                         rope=None, positions=None, key_positions=None):
    """:func:`mhattn.multi_head_attention` (self-attention) over a Dask x.

    multi_head_attention(x, w_q, w_k, w_v, w_o=None, *, num_heads,
    num_kv_heads=None, scale=None, causal=False, key_lengths=None,
    window=None, softcap=None, alibi_slopes=None, sinks=None,
    key_mask=None, b_q=None, b_k=None, b_v=None, b_o=None, w_gate=None,
    b_gate=None, q_norm=None, k_norm=None, norm_eps=1e-6, norm_type="rms",
    rope=None, positions=None, key_positions=None) -> out

    With T in one chunk the sequences are independent: one
    ``mhattn.multi_head_attention`` task per batch chunk (``map_blocks``), no
    merge. Otherwise the projections are one mhattn task per x chunk (q, k
    and v with the biases, the q/k norm and RoPE at the chunk's global
    positions), attention is :func:`attention` (layout "bthd": the heads
    are the projections' columns) and W^O a blockwise product.

    Parameters
    ----------
    x : dask.array.Array (B, T, d_model) (or (T, d_model)), chunked along
        batch and time (its features are made one chunk)
    w_q, w_k, w_v : fused NumPy weights (d_model, h*d_k), (d_model, g*d_k),
        (d_model, g*d_v), head i owning columns [i*d_k, (i+1)*d_k)
    w_o : (h*d_v, d_out), or None for the heads' concatenation
    num_heads, num_kv_heads, scale, causal, key_lengths, window, softcap, alibi_slopes, sinks, key_mask
        As :func:`mhattn.multi_head_attention`; ``key_mask`` (T,) or
        (B, T) bool, a NumPy array.
    b_q, b_k, b_v, b_o : NumPy biases (h*d_k,), (g*d_k,), (g*d_v,), (d_out,)
        or None (default): added to the projections and to the output, as
        :func:`mhattn.multi_head_attention` adds them; ``b_o`` without
        ``w_o`` is added to the concatenation.
    w_gate, b_gate : NumPy (d_model, h*d_v) and (h*d_v,), or None (default):
        the output gate, concat * sigmoid(x @ w_gate + b_gate), before W^O.
    q_norm, k_norm : NumPy (d_k,), (h, d_k) / (num_kv_heads, d_k), or None
        (default): the q/k norm's weights, as :func:`mhattn.multi_head_attention`
        applies them.
    norm_eps : float, default 1e-6
        The q/k norm's epsilon.
    norm_type : "rms" (default) or "layer"
        The q/k norm's kind: RMSNorm or LayerNorm.
    rope : mhattn.RoPE or None (default)
        RoPE after the q/k norm, at positions 0 .. T-1 of each sequence
        unless ``positions`` / ``key_positions`` say otherwise.
    positions, key_positions : NumPy int (T,) or (B, T), or None (default)
        The positions RoPE turns the queries and the keys to (e.g. HF's
        ``position_ids`` for a left-padded batch), as
        :func:`mhattn.multi_head_attention` takes them; each time chunk
        uses its columns.

    Returns
    -------
    out : dask.array.Array (B, T, d_out), x's batch and time chunks.

    Examples
    --------
    >>> import dask.array as da
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((2, 50, 16))
    >>> w = [0.3 * rng.standard_normal((16, 16)) for _ in range(4)]
    >>> out = mhattn.dask.multi_head_attention(da.from_array(x, chunks=(1, 20, 16)), *w,
    ...                                        num_heads=2, causal=True)
    >>> np.allclose(out.compute(scheduler="sync"),
    ...             mhattn.multi_head_attention(x, *w, num_heads=2, causal=True))
    True
    """
    x = _arrays(("x",), (x,))[0]
    weights = (w_q, w_k, w_v, w_o)
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, scale=scale, causal=causal,
              window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
              b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o, w_gate=w_gate, b_gate=b_gate,
              q_norm=q_norm, k_norm=k_norm, norm_eps=norm_eps, norm_type=norm_type,
              rope=rope)
    # mhattn checks the weights and keywords on one row (no memory), the
    # positions against (B, T) here and the key lengths against T on the
    # projected stand-ins below.
    batched = x.ndim == 3
    pos, kpos, one = positions, key_positions, _proxy(x, "bthd", False)
    if x.ndim in (2, 3):
        B0, T0 = (x.shape[0] if batched else 1), x.shape[-2]
        pos = _positions("positions", positions, B0, T0, batched, "query row")
        kpos = _positions("key_positions", key_positions, B0, T0, batched, "key row")
        one = one[..., :1, :]
    probe = _multi_head_attention(one, *weights, **kw,
                                  positions=_first_column(pos, x.ndim in (2, 3)),
                                  key_positions=_first_column(kpos, x.ndim in (2, 3)))
    xb = (x if batched else x[None]).rechunk({2: -1})
    B, T = xb.shape[:2]
    H = int(num_heads)
    G = H if num_kv_heads is None else int(num_kv_heads)
    wq, wk, wv = (np.asarray(w) for w in weights[:3])
    dk, dv = wq.shape[1] // H, wv.shape[1] // G
    dtype = probe.dtype
    if len(xb.chunks[1]) == 1:
        _attention(np.broadcast_to(np.zeros((), dtype), (B, H, 1, dk)),
                   np.broadcast_to(np.zeros((), dtype), (B, G, T, dk)),
                   np.broadcast_to(np.zeros((), dtype), (B, G, T, dv)), causal=causal,
                   key_lengths=key_lengths, window=window, key_mask=key_mask)
        kl = None if key_lengths is None else np.asarray(key_lengths, np.int64).reshape(B)
        km = None if key_mask is None else np.broadcast_to(np.asarray(key_mask), (B, T))
        out = xb.map_blocks(_mha_block, weights=weights, opts=kw, kl=kl, km=km, pos=pos,
                            kpos=kpos, bcut=_cuts(xb.chunks[0]), dtype=dtype,
                            chunks=xb.chunks[:2] + ((probe.shape[-1],),))
        return out if batched else out[0]
    Sq, Sk = H * dk, G * dk
    qkv = xb.map_blocks(_project_block, weights=weights[:3],
                        opts={n: kw[n] for n in _PROJECTION_KW}, pos=pos, kpos=kpos,
                        bcut=_cuts(xb.chunks[0]), tcut=_cuts(xb.chunks[1]), out_dtype=dtype,
                        dtype=dtype,
                        chunks=xb.chunks[:2] + ((Sq + Sk + G * dv,),))
    q = qkv[..., :Sq].reshape(B, T, H, dk)
    k = qkv[..., Sq:Sq + Sk].reshape(B, T, G, dk)
    v = qkv[..., Sq + Sk:].reshape(B, T, G, dv)
    heads = attention(q, k, v, layout="bthd", scale=scale, causal=causal,
                      key_lengths=key_lengths, window=window, softcap=softcap,
                      alibi_slopes=alibi_slopes, sinks=sinks, key_mask=key_mask)
    cat = heads.reshape(B, T, H * dv)
    if w_gate is not None:
        cat = cat * _affine(xb, w_gate, b_gate, dtype).map_blocks(_sigmoid, dtype=dtype)
    out = _affine(cat, w_o, b_o, dtype)
    return out if batched else out[0]


def _affine(a, w, b, dtype):
    """a @ w + b, blockwise, in dtype; w or b None: that step left out."""
    out = a if w is None else a @ np.asarray(w)
    if b is not None:
        out = out + np.asarray(b)
    return out.astype(dtype, copy=False)


def _sigmoid(z):
    """1 / (1 + exp(-z)) of one block, in its dtype: exp(-z) = inf for z << 0
    makes the gate 0, as mhattn's does."""
    with np.errstate(over="ignore"):
        return (1 / (1 + np.exp(-z))).astype(z.dtype, copy=False)
