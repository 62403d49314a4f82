"""mhattn.pack_weights: a layer's weights packed once for the C core's GEMM.

Every GEMM of the core cuts its right-hand matrix into column panels
sized for the micro-kernel (csrc/core/gemm_impl.h), and does so on every
call.  A model's weights do not change between calls, so
:func:`pack_weights` cuts them once, as ONNX Runtime does with a graph's
constant weights.  The panels live in C memory that Python cannot reach;
the weights themselves are kept too, as immutable arrays (a bytes buffer
underneath, so not even ``flags.writeable = True`` can open them), because
small calls, calls of another dtype and the backward read them.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np

from .._internal import core
from .._internal.args import (_int_arg, _split_bias, _vector, check_memory, compute_dtype,
                              fused_widths, split_heads)
from .._internal.half import F32, as_dtype, half_of, is_half, shared_half, widen

__all__ = ["pack_weights", "PackedWeights"]

_NAMES = ("w_q", "w_k", "w_v", "w_o")
_BIASES = ("b_q", "b_k", "b_v", "b_o")


def _immutable(a: np.ndarray) -> np.ndarray:
    """A copy of a whose memory is a bytes object: read-only for good."""
    a = np.ascontiguousarray(a)
    return np.frombuffer(a.tobytes(), dtype=a.dtype).reshape(a.shape)


def _as_dtype(a: Any, dtype: np.dtype) -> np.ndarray:
    """``a`` as an array of ``dtype`` (a half dtype: rounded once)."""
    a = np.asarray(a)
    return a if a.dtype == dtype else a.astype(dtype)


def _as_given(fused: np.ndarray, form: str, widths) -> Any:
    """Read-only views of a fused (rows, sum widths) weight in the form it
    was given: fused itself, stacked (h, rows, width), or a list of
    per-head column blocks. Fusing them again gives back `fused` without a
    copy (stacked) or an equal copy (list)."""
    if form == "fused":
        return fused
    if form == "stacked":
        rows = fused.shape[0]
        return fused.reshape(rows, len(widths), widths[0]).transpose(1, 0, 2)
    starts = np.concatenate([[0], np.cumsum(widths)]).astype(int)
    return [fused[:, starts[i]:starts[i + 1]] for i in range(len(widths))]


# No Parameters section: PackedWeights(...) raises TypeError; its
# ``*args, **kwargs`` only catch a direct call. pack_weights makes one.
class PackedWeights:  # numpydoc ignore=PR01
    """Weights packed once for this machine's kernels: see :func:`pack_weights`.

    Immutable: the attributes are read-only arrays, and assigning one
    raises AttributeError. Pass the object where ``w_q`` goes:
    ``multi_head_attention(x, packed, ...)``. Only :func:`pack_weights`
    makes one (``PackedWeights(...)`` raises TypeError); copies and pickles
    pack the same weights again.

    Attributes
    ----------
    w_q, w_k, w_v : read-only arrays (or lists of them)
        The weights, in the form they were given (fused 2-D, stacked 3-D or
        per-head lists), cast to ``dtype``.
    w_o : read-only (sum d_v, d_out) array or None
    b_q, b_k, b_v, b_o : read-only arrays or None
        The biases given to :func:`pack_weights`, in their forms.
    num_heads, num_kv_heads : int
    d_k, d_v : tuple of int
        Each kv head's widths.
    dtype : numpy.dtype
        float32, float64, float16 or bfloat16: the weights' dtype, and the
        dtype of the calls the panels are for (the panels of half weights
        are float32: half calls compute in float32).
    isa : str
        The instruction set the panels were cut for (``mhattn.get_isa()`` at
        packing time). Calls made under another ISA (``MHATTN_ISA``) ignore
        the panels and pack as usual, with that ISA's results.
    nbytes : int
        Bytes of the panels (the weights' own arrays come on top).

    Examples
    --------
    >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    >>> packed = mhattn.pack_weights(w_q, w_k, w_v, w_o)
    >>> packed
    PackedWeights(num_heads=2, num_kv_heads=2, d_model=4, d_out=4, dtype=float64, isa=...)
    >>> out = mhattn.multi_head_attention(X, packed, causal=True)
    >>> np.array_equal(out, mhattn.multi_head_attention(X, w_q, w_k, w_v, w_o, causal=True))
    True
    """

    __slots__ = ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o", "num_heads",
                 "num_kv_heads", "d_k", "d_v", "dtype", "isa", "nbytes", "_fused",
                 "_caps", "_args", "_compute", "_wide")

    _packs_weights = True   # what _to_array recognises one by, in another argument

    def __new__(cls, *args, **kwargs):
        # Only _pack makes one (object.__new__), whole: an empty one would
        # raise AttributeError on its first use.
        raise TypeError("PackedWeights: cannot be made directly; use "
                        "mhattn.pack_weights(w_q, w_k, w_v, w_o, ...) to make one")

    def __setattr__(self, name, value):
        raise AttributeError(f"{name}: PackedWeights is immutable; pack new weights "
                             "with mhattn.pack_weights")

    def __delattr__(self, name):
        raise AttributeError(f"{name}: PackedWeights is immutable")

    def _set(self, **items) -> None:
        for name, value in items.items():
            object.__setattr__(self, name, value)

    def arguments(self) -> Dict[str, Any]:
        """The keyword arguments of the unpacked call:
        ``multi_head_attention(x, **packed.arguments())`` (or the reference's)
        computes what ``multi_head_attention(x, packed)`` does, bit for bit.

        Returns
        -------
        dict
            ``w_q``, ``w_k``, ``w_v``, ``w_o``, ``num_heads``,
            ``num_kv_heads`` and the biases that were given, by name.

        Examples
        --------
        >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
        >>> packed = mhattn.pack_weights(w_q, w_k, w_v, w_o)
        >>> sorted(packed.arguments())
        ['num_heads', 'num_kv_heads', 'w_k', 'w_o', 'w_q', 'w_v']
        >>> np.array_equal(mhattn.multi_head_attention(X, **packed.arguments()),
        ...                mhattn.multi_head_attention(X, packed))
        True
        """
        kw: Dict[str, Any] = {n: getattr(self, n) for n in _NAMES}
        kw.update(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)
        kw.update({n: getattr(self, n) for n in _BIASES if getattr(self, n) is not None})
        return kw

    def replace(self, **changes) -> "PackedWeights":
        """A new PackedWeights with some weights or biases replaced; the
        panels of the others are shared, not cut again.

        Parameters
        ----------
        **changes : arrays or None
            New values of ``w_q``, ``w_k``, ``w_v``, ``w_o``, ``b_q``,
            ``b_k``, ``b_v`` or ``b_o``, by name, in the forms
            :func:`mhattn.pack_weights` takes (another name raises
            TypeError).

        Returns
        -------
        PackedWeights
            The weights and biases of this one, with ``changes`` in place
            of theirs, packed for the same heads and dtype.

        Examples
        --------
        >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
        >>> packed = mhattn.pack_weights(w_q, w_k, w_v, w_o)
        >>> np.array_equal(packed.replace(w_o=2 * w_o).w_o, 2 * w_o)
        True
        """
        unknown = sorted(set(changes) - set(_NAMES + _BIASES))
        if unknown:
            raise TypeError(f"replace() got an unexpected keyword argument {unknown[0]!r}")
        kw = {n: getattr(self, n) for n in _NAMES + _BIASES}
        kw.update(changes)
        reuse = {n: (self._fused[i], self._caps[i]) for i, n in enumerate(_NAMES)
                 if n not in changes}
        return _pack(kw, self.num_heads, self.num_kv_heads, self.dtype, reuse)

    def __reduce__(self):
        # The panels are C memory and cut for one machine: pickling keeps
        # the weights and packs them again where it is loaded.
        kw = {n: getattr(self, n) for n in _NAMES + _BIASES}
        return (_unpickle, (kw, self.num_heads, self.num_kv_heads, self.dtype.name))

    def __repr__(self) -> str:
        if not hasattr(self, "_args"):   # only object.__new__ makes one so
            return "PackedWeights(<empty: not made by mhattn.pack_weights>)"
        d_out = self.w_o.shape[1] if self.w_o is not None else sum(
            self.d_v) * (self.num_heads // self.num_kv_heads)
        return (f"PackedWeights(num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, d_model={self._fused[0].shape[0]}, "
                f"d_out={d_out}, dtype={self.dtype.name}, isa={self.isa!r})")

    def _core_packed(self, dtype) -> Optional[Tuple]:
        """The capsules for ``_C.forward``'s packed argument, when the call
        computes in the panels' dtype (float32 for half weights); else None
        (the weights are cast)."""
        return self._caps if dtype == self._compute else None


# (ISA, dtype) -> NR, the width of the micro-kernel's column panels.
_PANEL_WIDTH: Dict[Tuple[str, np.dtype], int] = {}


def _panel_width(dtype: np.dtype) -> int:
    """NR for the ISA in force: a packed (1, 1) weight is one panel of one
    row, NR elements (the core pads the last column block to whole panels)."""
    key = (core.get_isa(), dtype)
    if key not in _PANEL_WIDTH:
        cap = core.pack_weight(np.zeros((1, 1), dtype))
        _PANEL_WIDTH[key] = core.packed_info(cap)[4] // dtype.itemsize
    return _PANEL_WIDTH[key]


def _pack_items(shapes: Dict[str, Tuple[int, int]], dtype: np.dtype, biases: int) -> list:
    """What packing the weights of ``shapes`` ({name: (rows, cols)}, the
    fused weights to pack) allocates, for check_memory: per weight its
    panels, rows*(cols + NR - 1) at most (the last column block is padded
    to whole panels of NR columns), and up to three copies of it (fused
    from heads, cast to dtype, and the immutable one kept), a bound on
    what _immutable and hs.fused() make; and the biases' copies."""
    n, nr = dtype.itemsize, _panel_width(dtype)
    items = []
    for name, (rows, cols) in shapes.items():
        items.append((f"{name}'s panels", "rows*(cols + NR - 1)",
                      (rows, cols + nr - 1 if cols else 0), n))
        items.append((f"{name}'s fused, cast and kept copies", "3*rows*cols",
                      (3, rows, cols), n))
    items.append(("the biases' copies", "2*sum of their sizes", (2, biases), n))
    return items


def _unpickle(kw, num_heads, num_kv_heads, dtype):
    return _pack(kw, num_heads, num_kv_heads, as_dtype("dtype", dtype), {})


def _pack(kw: Dict[str, Any], num_heads, num_kv_heads, dtype, reuse) -> PackedWeights:
    wq, wk, wv, G = split_heads(kw["w_q"], kw["w_k"], kw["w_v"],
                                _int_arg("num_heads", num_heads),
                                _int_arg("num_kv_heads", num_kv_heads))
    H = len(wq.heads)
    Svq = fused_widths(H, G, sum(wk.widths), sum(wv.widths))[1]
    w_o = _vector("w_o", kw.get("w_o"), (Svq, None),
                  f"w_o: expected shape ({Svq}, d_out) — its rows must equal the "
                  f"concatenated head width sum(d_v) = {Svq} — got {{shape}}")
    d_out = w_o.shape[1] if w_o is not None else Svq
    biases = {"b_q": _split_bias("b_q", kw.get("b_q"), wq.widths),
              "b_k": _split_bias("b_k", kw.get("b_k"), wk.widths),
              "b_v": _split_bias("b_v", kw.get("b_v"), wv.widths)}
    b_o = _vector("b_o", kw.get("b_o"), (d_out,),
                  f"b_o: expected shape ({d_out},) (d_out), got {{shape}}")
    if dtype is None:
        floats = wq.heads + wk.heads + wv.heads + [a for a in (w_o,) if a is not None]
        # half weights are kept half (a call's numbers share one half dtype)
        dtype = shared_half([(n, hs.fused()) for n, hs in zip(_NAMES, (wq, wk, wv))]
                            + [("w_o", w_o)]) or compute_dtype(floats)
    else:
        dtype = as_dtype("dtype", dtype)
        if dtype not in (np.dtype(np.float32), np.dtype(np.float64)) and not is_half(dtype):
            raise TypeError(f"dtype: expected float32, float64, float16 or bfloat16, "
                            f"got {dtype}")
        dtype = half_of(dtype) or dtype
    # The panels are in the dtype the calls compute in: float32 for half
    # weights, which are widened (exactly) before they are cut.
    compute = F32 if is_half(dtype) else dtype

    def reused(name):
        return name in reuse and reuse[name][0] is not None and reuse[name][0].dtype == dtype

    shapes = {name: (hs.rows, sum(hs.widths)) for name, hs in zip(_NAMES, (wq, wk, wv))
              if not reused(name)}
    if w_o is not None and not reused("w_o"):
        shapes["w_o"] = w_o.shape
    bias_size = sum(sum(hs.widths) for name, hs in zip(_BIASES, (wq, wk, wv))
                    if biases[name] is not None) + (0 if b_o is None else b_o.size)
    check_memory(_pack_items(shapes, compute, bias_size))

    pw = object.__new__(PackedWeights)
    fused, caps = [], []
    for name, hs in zip(_NAMES, (wq, wk, wv, None)):
        if reused(name):
            f, cap = reuse[name]
        else:
            raw = w_o if hs is None else hs.fused()
            f = None if raw is None else _immutable(_as_dtype(raw, dtype))
            cap = None if f is None or f.size == 0 else core.pack_weight(
                widen(f) if compute != dtype else f)
        fused.append(f)
        caps.append(cap)
    pw._set(w_q=_as_given(fused[0], wq.form, wq.widths),
            w_k=_as_given(fused[1], wk.form, wk.widths),
            w_v=_as_given(fused[2], wv.form, wv.widths), w_o=fused[3])
    for name in _BIASES[:3]:
        given = kw.get(name)
        if biases[name] is None:
            b = None
        elif isinstance(given, (list, tuple)) and np.ndim(given[0]) == 1:   # per head
            b = [_immutable(_as_dtype(a, dtype)) for a in biases[name]]
        else:
            b = _immutable(_as_dtype(np.asarray(given), dtype))
        pw._set(**{name: b})
    pw._set(b_o=None if b_o is None else _immutable(_as_dtype(b_o, dtype)))
    isa = core.get_isa()
    nbytes = sum(core.packed_info(c)[4] for c in caps if c is not None)
    pw._set(num_heads=H, num_kv_heads=G, d_k=tuple(wk.widths), d_v=tuple(wv.widths),
            dtype=dtype, isa=isa, nbytes=int(nbytes), _fused=tuple(fused),
            _caps=tuple(caps), _compute=compute)
    # What a call that passes nothing else takes (multi_head_attention's
    # weights, head counts and biases, in its argument order).
    pw._set(_args=(pw.w_q, pw.w_k, pw.w_v, pw.w_o, H, G, pw.b_q, pw.b_k, pw.b_v, pw.b_o))
    # Half weights: their float32 twins (widened exactly, read-only), which
    # a half call's fast branch computes with (compute.forward), so that no
    # call widens the weights again.
    wide = None
    if compute != dtype:
        fw = [None if f is None else _frozen(widen(f)) for f in fused]
        wide = (_as_given(fw[0], wq.form, wq.widths), _as_given(fw[1], wk.form, wk.widths),
                _as_given(fw[2], wv.form, wv.widths), fw[3],
                *(_widen_bias(getattr(pw, n)) for n in _BIASES))
    pw._set(_wide=wide)
    return pw


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _widen_bias(b: Any) -> Any:
    if b is None:
        return None
    if isinstance(b, list):
        return [_frozen(widen(a)) for a in b]
    return _frozen(widen(b))


def pack_weights(w_q, w_k, w_v, w_o=None, *, num_heads=None, num_kv_heads=None,
                 b_q=None, b_k=None, b_v=None, b_o=None, dtype=None) -> PackedWeights:
    """Pack a layer's weights once for the C core: pass the result where
    ``w_q`` goes, ``multi_head_attention(x, packed, ...)``.

    pack_weights(w_q, w_k, w_v, w_o=None, *, num_heads=None,
                 num_kv_heads=None, b_q=None, b_k=None, b_v=None, b_o=None,
                 dtype=None) -> PackedWeights

    Each projection of a call is a GEMM whose weight the core would cut into
    the micro-kernel's column panels on every call; packed weights are cut
    once. The results are bitwise those of the unpacked call,
    ``multi_head_attention(x, **packed.arguments())``; what changes is the
    time: no packing, and half the thread-pool phases of the projections.
    :func:`mhattn.backward` and :func:`mhattn.multi_head_attention_grad`
    take the packed object too.

    Parameters
    ----------
    w_q, w_k, w_v : weights in any of multi_head_attention's forms
        Fused 2-D (d_in, h*d_k) with ``num_heads``, stacked 3-D
        (h, d_in, d_k), or per-head lists.
    w_o : (sum d_v, d_out) or None
    num_heads, num_kv_heads : int, optional
        As for multi_head_attention (num_heads is needed for fused weights).
    b_q, b_k, b_v, b_o : optional
        Biases, in multi_head_attention's forms; kept in the object (they are
        not packed), so a call then may not pass them again.
    dtype : np.float32, np.float64, np.float16 or bfloat16, optional
        The dtype to pack for; default: the weights' (float64 if any is
        float64, as multi_head_attention promotes; float16 or bfloat16 if
        they are, which must then all share it). A call computing in
        another dtype casts the weights as an unpacked call would. Half
        weights are kept in their dtype (``w_q`` ... are half) and cut
        into float32 panels (widened exactly): half calls compute in
        float32, and the micro-kernels read float32 panels at full speed.

    Returns
    -------
    PackedWeights
        Immutable. Its panels take about the weights' own size again
        (``nbytes``), cut for the ISA in force (``isa``).

    A call with a packed object may not also pass w_k, w_v, w_o,
    num_kv_heads or a bias the object holds; num_heads may be passed if it
    agrees. With ``cache=`` the projections use the panels as well.

    Packing needs each weight's panels (rows * (cols + NR - 1) at most, NR
    the kernel's panel width) and up to three copies of it (fused, cast,
    kept); when that exceeds the machine's memory, MemoryError is raised
    before anything is packed.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> w_q, w_k, w_v, w_o = (rng.standard_normal((64, 64)).astype(np.float32)
    ...                       for _ in range(4))
    >>> packed = mhattn.pack_weights(w_q, w_k, w_v, w_o, num_heads=8)
    >>> x = rng.standard_normal((2, 128, 64)).astype(np.float32)
    >>> out = mhattn.multi_head_attention(x, packed, causal=True)
    >>> np.array_equal(out, mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o,
    ...                                                 num_heads=8, causal=True))
    True
    >>> packed.w_q.flags.writeable
    False
    """
    kw = dict(w_q=w_q, w_k=w_k, w_v=w_v, w_o=w_o, b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o)
    return _pack(kw, num_heads, num_kv_heads, dtype, {})


def call_weights(w_q, w_k, w_v, w_o, num_heads, num_kv_heads, b_q, b_k, b_v, b_o):
    """(packed or None, (w_q, w_k, w_v, w_o, num_heads, num_kv_heads, b_q,
    b_k, b_v, b_o)) of a call whose w_q may be a PackedWeights: the object's
    weights and biases in their place, or a TypeError for a weight given
    twice or w_k / w_v missing without one. Callers call it only when w_q is
    a PackedWeights or w_k or w_v is None."""
    if type(w_q) is not PackedWeights:
        name = "w_k" if w_k is None else "w_v"
        raise TypeError(f"{name}: expected an array, got None (w_k and w_v are "
                        "required unless w_q is a PackedWeights from "
                        "mhattn.pack_weights)")
    packed = w_q
    # checked as the unpacked call checks them, before any comparison
    num_heads = _int_arg("num_heads", num_heads)
    num_kv_heads = _int_arg("num_kv_heads", num_kv_heads)
    if (w_k is None and w_v is None and w_o is None and num_kv_heads is None
            and b_q is None and b_k is None and b_v is None and b_o is None
            and (num_heads is None or num_heads == packed.num_heads)):
        return packed, packed._args   # the common call: nothing else given
    for name, given in (("w_k", w_k), ("w_v", w_v), ("w_o", w_o)):
        if given is not None:
            raise TypeError(f"{name}: given both in the PackedWeights and in the call; "
                            "pass one or the other")
    for name, given in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if given is not None and given != getattr(packed, name):
            raise ValueError(f"{name}: {given} but the PackedWeights has "
                             f"{name}={getattr(packed, name)}")
    biases = []
    for name, given in zip(_BIASES, (b_q, b_k, b_v, b_o)):
        mine = getattr(packed, name)
        if mine is not None and given is not None:
            raise TypeError(f"{name}: given both in the PackedWeights and in the "
                            "call; pass one or the other")
        biases.append(given if mine is None else mine)
    return packed, (packed.w_q, packed.w_k, packed.w_v, packed.w_o, packed.num_heads,
                    packed.num_kv_heads, *biases)
