"""The one door to the C core: a call's arguments in the glue's canonical form.

The public functions decide, as bottleneck's do, between two branches that
turn their arguments into the 19 positional arguments of ``_C.forward``:
:func:`fast`, an O(1) branch for calls already in canonical form (plain
ndarrays of one float dtype; weights fused, stacked or per-head lists;
options in their usual forms), which returns None for anything else; and
:func:`slow`, which checks every argument through
:func:`mhattn._internal.args.normalize` and raises the friendly errors.

The fast branch takes only calls the glue and the core accept, and hands
anything else to the slow one; it never relies on the glue's errors. What
it returns is bitwise what the slow branch returns: the same arrays, or
views with the same values.

Each rule about a call's config is checked once, by the core's
``mha_check_config``; its rejection reaches Python as a ValueError with a
``field`` attribute, which the entry points below re-raise naming the
user's argument (:mod:`mhattn._internal.fields`). Other exceptions pass
through untouched (a KeyboardInterrupt, or whatever a user's SIGINT
handler raises).

:func:`run_core` hands a checked :class:`mhattn._internal.args.Call` to the core;
:class:`Context` is what the forward keeps for the backward.
``compute.forward`` and ``compute.grad`` are built on this module, and
every call of the core goes through its named entry points below.
The letters follow ``csrc/mha.h``.
"""
from __future__ import annotations

import functools
import types
from typing import Any, Dict, Optional

import numpy as np

from .. import _C  # the one module of the package that imports the extension
from . import args as _args
from . import half as _half
from .fields import ATTENTION, LAYER, Names, user_error
from .variants import Variants, dropout_arg, norm_type_arg, variants_tuple
from .args import (PER_HEAD_BYTES, Call, bool_arg, check_memory, fused_widths,
                   head_scales, memory_limit, normalize, plan)

__all__ = ["fast", "slow", "core_args", "gate_args", "variant_args", "head_arrays",
           "run_core", "Context", "make_context",
           # the C entry points
           "forward", "backward", "attention", "attention_backward", "project", "check_heads",
           "check_config", "check_norm_type", "attention_in_layer_words",
           "pack_weight", "packed_info", "get_isa", "set_isa", "get_num_threads",
           "set_num_threads", "library_path", "cast_half"]


# --- the C entry points --------------------------------------------------------
# This module is the only one that imports mhattn._C (tests/test_structure.py
# holds the package to that); the rest of the package calls the core through
# these functions. Each holds _C's function from import on (a test that
# stands in for one replaces the door). Their arguments are those of _C.pyi.

# A rejection by the core's config check (a ValueError with .field, see
# mhattn._internal.fields) is re-raised naming the user's argument: each
# entry point's ``names`` says how its family of public functions names the
# fields. _door makes each entry point one function (no extra frame on the
# small call's path); a ``try`` costs nothing until something is raised.

def _door(name: str, names: Names, doc: str):
    """The entry point ``_C.<name>(*args, **keywords)``, a core rejection
    raised in the words of ``names``. A plain ``*args`` function, with no
    keyword of its own: CPython calls it as cheaply as a direct wrapper (the
    small call); the keywords are the keyword-only arguments of _C (the
    output gate's), empty on the common path."""
    fn = getattr(_C, name)

    def door(*args, **keywords):
        try:
            return fn(*args, **keywords)
        except ValueError as e:
            if not hasattr(e, "field"):
                raise
            raise user_error(e, names) from None
    door.__name__ = door.__qualname__ = name
    door.__doc__ = doc
    return door


forward = _door("forward", LAYER, "``_C.forward``: the layer's forward pass "
                "(:func:`core_args` and the packed capsules).")
backward = _door("backward", LAYER, "``_C.backward``: the layer's backward pass.")
# A KV cache's step attends in the layer's words (it was given num_heads...).
attention_in_layer_words = _door("attention", LAYER, "``_C.attention`` for the cached "
                                 "decode step, its rejections in the layer's words.")
attention = _door("attention", ATTENTION, "``_C.attention``: attention on projected q, k, v.")
attention_backward = _door("attention_backward", ATTENTION,
                           "``_C.attention_backward``: the gradients of :func:`attention`.")
project = _door("project", LAYER, "``_C.project``: the q, k, v projections of new rows "
                "(a KV cache's step).")




def cast_half(src: np.ndarray, dst: np.ndarray) -> None:
    """``_C.cast_half``: dst = src between float32 and a half type."""
    _C.cast_half(src, dst)


# mhattn._internal.half sits below this module: it is handed the cast here.
_half.cast_half = _C.cast_half


def check_config(B: int, Tq: int, Tk: int, dk, dv, scales, dtype=np.float64, *,
                 key_lengths=None, variants=None, lengths_aligned: bool = False,
                 names: Names = LAYER) -> None:
    """The core's verdict on a call's config, nothing computed: for what uses
    a call's values in Python before (or instead of) a call of the core, such
    as normalize() before the reference and the checker. x and key are
    passed as (B, Tq, 0) and (B, Tk, 0) arrays of ``dtype``, which hold no
    elements; dk, dv (G,), scales (H,), the key lengths and the variants'
    tuple (:func:`variant_args`) as forward() takes them. Every rule and its
    message live in the core (mha_check_config); this raises them in the
    words of ``names``."""
    dt = np.dtype(dtype)
    try:
        _C.check_config(np.empty((B, Tq, 0), dt), np.empty((B, Tk, 0), dt),
                        np.asarray(dk, dtype=np.int64), np.asarray(dv, dtype=np.int64),
                        np.asarray(scales, dtype=np.float64), key_lengths, variants,
                        lengths_aligned)
    except ValueError as e:
        if not hasattr(e, "field"):
            raise
        raise user_error(e, names) from None


def check_heads(H: int, G: int, dk=None, dv=None, names: Names = LAYER) -> None:
    """The core's verdict on H query heads and G kv heads (and, given, the
    kv heads' widths dk, dv), for what splits weights per head before any
    call of the core (normalize, pack_weights, the layer's constructor).
    A verdict depends on these numbers alone: the accepted ones are kept
    (a decode step asks each token), a rejection is asked again. Asking
    builds (H,) and (G,) vectors: first the memory rule on head counts
    (a head's bookkeeping, args.PER_HEAD_BYTES), so that a huge count is a
    MemoryError naming it, never an allocation."""
    for letter, count in (("H", H), ("G", G)):
        _args._check_head_count(names.argument[letter], count)
    try:
        _heads_ok(H, G, None if dk is None else tuple(dk), None if dv is None else tuple(dv))
    except ValueError as e:
        if not hasattr(e, "field"):
            raise
        raise user_error(e, names) from None


def check_norm_type(norm_type: Any, names: Names = LAYER) -> str:
    """The core's verdict on a q/k norm's name (``norm_type``), for what
    holds one before any call of the core (the layer's constructor): the
    name as a str, or the core's rejection (mha_norm_type_parse), the very
    message a call would raise. A TypeError for anything but a str."""
    name = norm_type_arg(norm_type)
    try:
        _norm_type_ok(name)
    except ValueError as e:
        if not hasattr(e, "field"):
            raise
        raise user_error(e, names) from None
    return name


def check_dropout(dropout: Any, names: Names = LAYER) -> float:
    """The core's verdict on a dropout probability, for what holds one
    before any call (the layer's constructor): the value as a float, or the
    very rejection a call would raise (0 <= dropout < 1 is core/config.c's
    rule). A TypeError for anything but a real number."""
    p = dropout_arg(dropout)
    try:
        _scalars_ok(dropout=p)
    except ValueError as e:
        if not hasattr(e, "field"):
            raise
        raise user_error(e, names) from None
    return p


def _norm_type_ok(name: str) -> None:
    """``_C.check_config`` of one head on no rows, with the norm ``name``."""
    _scalars_ok(norm_type=name)


@functools.lru_cache(maxsize=16)
def _scalars_ok(norm_type: str = "rms", dropout: float = 0.0) -> None:
    """``_C.check_config`` of one head on no rows, with the variants'
    scalars ``norm_type`` and ``dropout``."""
    call = types.SimpleNamespace(var=Variants(norm_type=norm_type, dropout=dropout))
    _C.check_config(np.empty((1, 0, 0)), np.empty((1, 0, 0)), np.ones(1, dtype=np.int64),
                    np.ones(1, dtype=np.int64), np.ones(1), None,
                    variants_tuple(call, always=True), False)


@functools.lru_cache(maxsize=64)
def _heads_ok(H: int, G: int, dk: Optional[tuple], dv: Optional[tuple]) -> None:
    """``_C.check_config`` on no rows: the core's raw rejection, or None."""
    ones = np.ones(max(G, 0), dtype=np.int64)
    _C.check_config(np.empty((1, 0, 0)), np.empty((1, 0, 0)),
                    ones if dk is None else np.asarray(dk, dtype=np.int64),
                    ones if dv is None else np.asarray(dv, dtype=np.int64),
                    np.ones(max(H, 0)), None, None, False)


_args.heads_verdict = check_heads
_args.config_verdict = check_config


def pack_weight(w):
    """``_C.pack_weight``: a weight's GEMM panels, as a capsule."""
    return _C.pack_weight(w)


def packed_info(capsule) -> tuple:
    """``_C.packed_info``: what a capsule of :func:`pack_weight` holds."""
    return _C.packed_info(capsule)


def get_isa() -> str:
    """``_C.get_isa``: the instruction set of the kernels in force."""
    return _C.get_isa()


def set_isa(name: str) -> str:
    """``_C.set_isa``: caps the instruction set; returns the one in force."""
    return _C.set_isa(name)


def get_num_threads() -> int:
    """``_C.get_num_threads``: the core's thread count for the next call."""
    return _C.get_num_threads()


def set_num_threads(n: int) -> None:
    """``_C.set_num_threads``: the core's thread count, 0 for the default."""
    _C.set_num_threads(n)


def library_path() -> str:
    """The file of the compiled extension (threadpoolctl's ``filepath``)."""
    return _C.__file__

_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)
_BOOL = np.dtype(np.bool_)
_ndarray = np.ndarray
_newaxis = np.newaxis
_count_nonzero = np.count_nonzero
# Scalar types whose float() is the slow branch's float(scale), exactly.
_SCALE_TYPES = frozenset((float, int, np.float64, np.float32))
# (H, G, dk, dv, scale or None) -> the glue's dk (G,), dv (G,) and scales
# (H,), read-only, so that a fast call builds none of them, and the fused
# widths Sq and Svq. dk and dv are ints when every head has the same widths,
# else tuples per kv head.
_HEADS = {}
# Unbatched key_lengths=n -> int64 (1,) read-only array.
_LENGTHS = {}
_CACHE_MAX = 256
# Thread safety, with or without the GIL (the glue declares Py_mod_gil =
# Py_MOD_GIL_NOT_USED): each cache is only read with .get / [key] and
# written with one [key] = value, single dict operations that are atomic in
# the free-threaded build too. Values are read-only arrays and tuples, never
# changed after they are stored. Two threads that miss the same key both
# build an equal value and one store wins; the len() < _CACHE_MAX test may
# let a cache grow past the cap by at most the number of racing threads.
# The fast branch only takes calls whose every allocation is small, so that
# the memory check of the slow branch (which costs more than such a call)
# can be skipped: at most this many elements in inputs, projections,
# outputs and weights. It also keeps every size far below what the core
# could reject as too large (B*H*Tq*Tk < 2^42).
_FAST_ELEMENTS = 1 << 22
# ...and at most this many heads (per-head arrays and tuples of widths are
# built before the sizes are known).
_FAST_HEADS = 1024


def slow(x, w_q, w_k, w_v, w_o, num_heads, key, value, scale, mask, causal,
         key_lengths, num_kv_heads, b_q, b_k, b_v, b_o, want_weights, keep,
         half_weights=False, w_gate=None, b_gate=None, **variants):
    """The glue's arguments for any call, and its checked :class:`Call`:
    (args, call). Every check, every friendly error. ``half_weights``: as
    :func:`normalize`'s (a call without a context). The output gate's
    arrays are not among the positional args: :func:`gate_args` of the
    call gives them."""
    call = normalize(x, w_q, w_k, w_v, w_o, num_heads=num_heads, key=key, value=value,
                     scale=scale, mask=mask, causal=causal, key_lengths=key_lengths,
                     num_kv_heads=num_kv_heads, b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o,
                     w_gate=w_gate, b_gate=b_gate,
                     half_weights=half_weights and not keep, **variants)
    want_weights = bool_arg("return_weights", want_weights)
    keep = bool_arg("return_context", keep)
    return core_args(call, want_weights=want_weights, keep=keep), call


def _fused_bias(parts):
    """Per-head biases side by side, matching the fused weights' columns."""
    if parts is None:
        return None
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def head_arrays(call: Call) -> tuple:
    """The glue's dk (G,) and dv (G,) int64 and scales (H,) float64."""
    return (np.asarray(call.dk, dtype=np.int64), np.asarray(call.dv, dtype=np.int64),
            np.asarray(call.scales, dtype=np.float64))


def variant_args(call: Call):
    """The glue's ``variants`` argument of a checked call:
    :func:`mhattn._internal.variants.variants_tuple`."""
    return variants_tuple(call)


def core_args(call: Call, *, want_weights: bool = False, keep: bool = False) -> tuple:
    """The 20 arguments of ``_C.forward`` for a checked call, once its
    allocations are known to fit (MemoryError otherwise)."""
    check_memory(plan(call, want_weights=want_weights, keep=keep))
    dk, dv, scales = head_arrays(call)
    # Fused query weights must hold head h's block at sum of the widths before
    # it; with ragged or grouped heads that is exactly the concatenation.
    return (call.x, call.key, call.value, call.wq.fused(), call.wk.fused(),
            call.wv.fused(), call.w_o, _fused_bias(call.bq), _fused_bias(call.bk),
            _fused_bias(call.bv), call.b_o, dk, dv, scales, call.mask, call.causal,
            call.key_lengths, variant_args(call), bool(want_weights), bool(keep))


def gate_args(call: Optional[Call]) -> Dict[str, np.ndarray]:
    """The keyword-only arguments ``wgate`` and ``bgate`` of ``_C.forward``
    and ``_C.backward`` for a checked call with an output gate; empty
    without one (or for the fast branch's calls, call None, which have
    none)."""
    if call is None or call.w_gate is None:
        return {}
    return {"wgate": call.w_gate, "bgate": call.b_gate}


def run_core(call: Call, *, want_weights: bool = False, keep: bool = False, packed=None):
    """Hand a checked Call to the C core; ``packed``: None or the capsules
    of a PackedWeights (``_core_packed``) for the call's weights.

    Returns (out, weights, extras), batched: out (B, Tq, Dout), weights
    (B, H, Tq, Tk) or None, extras (q, k, v, concat, lse) or None.
    """
    return forward(*core_args(call, want_weights=want_weights, keep=keep), packed,
                   **gate_args(call))


# --- the fast branch ---------------------------------------------------------

def _frozen(a):
    a.flags.writeable = False
    return a


def _fast_heads(H, G, dk, dv, scale):
    """An entry of _HEADS: head_arrays() of a fast call, read-only, and the
    fused widths (Sq, Svq). dk, dv are ints or tuples per kv head, scale a
    float or None (the default 1/sqrt(dk), as normalize() makes it)."""
    dks = (dk,) * G if type(dk) is int else dk
    dvs = (dv,) * G if type(dv) is int else dv
    heads = (_frozen(np.array(dks, np.int64)), _frozen(np.array(dvs, np.int64)),
             _frozen(np.array(head_scales(H, G, dks, scale), np.float64)),
             *fused_widths(H, G, sum(dks), sum(dvs)))
    # A NaN or a zero scale is not cached: NaN != NaN, and 0.0 == -0.0
    # would hand one the other's array.
    if len(_HEADS) < _CACHE_MAX and (scale is None or (scale == scale and scale)):
        _HEADS[(H, G, dk, dv, scale)] = heads
    return heads


def _fuse_one(w, count, dt):
    """(fused (rows, sum widths), widths) of a stacked, list or fused weight,
    as normalize() and _Heads.fused() make them, or None for anything the
    fast branch leaves to the slow one. count None: not known yet."""
    if count is not None and count > _FAST_HEADS:
        return None
    if type(w) is _ndarray:
        if w.dtype is not dt or w.size > _FAST_ELEMENTS:
            return None
        if w.ndim == 2:
            total = w.shape[1]
            if count is None or total == 0 or total % count:
                return None
            return w, (total // count,) * count
        if w.ndim == 3:
            h, rows, width = w.shape
            if h == 0 or h > _FAST_HEADS or (count is not None and h != count):
                return None
            return w.transpose(1, 0, 2).reshape(rows, h * width), (width,) * h
        return None
    if type(w) is list or type(w) is tuple:
        if not w or len(w) > _FAST_HEADS or (count is not None and len(w) != count):
            return None
        rows, size = None, 0
        for a in w:
            if type(a) is not _ndarray or a.dtype is not dt or a.ndim != 2:
                return None
            if rows is None:
                rows = a.shape[0]
            elif a.shape[0] != rows:
                return None
            size += a.size
        if size > _FAST_ELEMENTS:
            return None
        return np.concatenate(w, axis=1), tuple(a.shape[1] for a in w)
    return None


def _fuse_heads(w_q, w_k, w_v, num_heads, num_kv_heads, dt):
    """(wq, wk, wv, H, G, dk, dv) of stacked or per-head-list weights (or
    fused ones among them), fused; dk and dv tuples per kv head. Or None."""
    q = _fuse_one(w_q, num_heads, dt)
    if q is None:
        return None
    H = len(q[1])
    if num_kv_heads is None:
        G = H
    elif H % num_kv_heads == 0:
        G = num_kv_heads
    else:
        return None
    k = _fuse_one(w_k, G, dt)
    v = _fuse_one(w_v, G, dt)
    if k is None or v is None:
        return None
    group = H // G
    dq, dk = q[1], k[1]
    if 0 in dk or 0 in v[1]:
        return None
    for h in range(H):
        if dq[h] != dk[h // group]:
            return None
    return q[0], k[0], v[0], H, G, dk, v[1]


def _fast_bias(b, dt, H, width, total):
    """A bias the slow branch would hand the glue unchanged in value: fused
    (total,) or, when every head has the same width, stacked (H, width), of
    the compute dtype. Else None."""
    if type(b) is not _ndarray or b.dtype is not dt:
        return None
    if b.ndim == 1:
        return b if b.shape[0] == total else None
    if b.ndim == 2 and type(width) is int and b.shape[0] == H and b.shape[1] == width:
        return b.reshape(-1)
    return None


def _fast_mask(mask, dt, full):
    """Whether the glue takes the mask as it is. ``full`` is (B, H, Tq, Tk),
    or (H, Tq, Tk) unbatched: the glue broadcasts the mask to (B, H, Tq, Tk)
    as np.broadcast_to does, and an unbatched call's (H, Tq, Tk) gains B = 1
    in front either way."""
    if type(mask) is not _ndarray:
        return False
    shape = mask.shape
    # Shapes with two readings (see _args.ambiguous_mask) go to the slow
    # branch, which refuses them: B > 1 equal to h (3-D) or to T_q (2-D).
    if len(full) == 4 and full[0] > 1 and 2 <= len(shape) <= 3 and (
            shape[0] == full[0] == full[4 - len(shape)]):
        return False
    lead = len(full) - len(shape)
    if lead < 0:
        return False
    if lead:
        full = full[lead:]
    if shape != full:
        for n, want in zip(shape, full):
            if n != want and n != 1:
                return False
    if mask.dtype is _BOOL:
        # The slow branch warns when no key may be seen: is it inverted?
        return not mask.size or bool(_count_nonzero(mask))
    return mask.dtype is dt and mask.flags.aligned


def _fast_lengths(key_lengths, nd, B, Tk):
    """key_lengths as the glue takes them, each in [0, Tk], or None."""
    if nd == 2 and type(key_lengths) is int:
        if not 0 <= key_lengths <= Tk:
            return None
        kl = _LENGTHS.get(key_lengths)
        if kl is None:
            kl = _frozen(np.full(1, key_lengths, np.int64))
            if len(_LENGTHS) < _CACHE_MAX:
                _LENGTHS[key_lengths] = kl
        return kl
    if type(key_lengths) is not _ndarray:
        return None
    kind, size = key_lengths.dtype.kind, key_lengths.dtype.itemsize
    # What the glue casts to int64 safely: no uint64, no bool.
    if not (kind == "i" or (kind == "u" and size < 8)):
        return None
    if key_lengths.shape != ((B,) if nd == 3 else ()):
        return None
    if nd == 2:
        return key_lengths.reshape(1) if 0 <= key_lengths.item() <= Tk else None
    lengths = key_lengths.tolist()
    if lengths and (min(lengths) < 0 or max(lengths) > Tk):
        return None
    return key_lengths


def fast(x, w_q, w_k, w_v, w_o, num_heads, key, value, scale, want_weights, mask,
         causal, key_lengths, num_kv_heads, b_q, b_k, b_v, b_o, w_dtype=None):
    """The O(1) branch: the glue's 19 arguments for a call already in
    canonical form, or None for :func:`slow` to take it. Each shape the glue
    checks against another is checked here first. Dtypes are compared by
    identity: NumPy's native float32 and float64 are singletons, and
    anything else (byte-swapped...) is declined. ``w_dtype``: the native
    half dtype of fused 2-D weights (and w_o) of a float32 call, which the
    core widens as it packs them (mha.h, ``w_storage``); None: x's."""
    if not (type(x) is _ndarray
            and (num_heads is None or (type(num_heads) is int and num_heads > 0))
            and (num_kv_heads is None or (type(num_kv_heads) is int and num_kv_heads > 0))
            and (want_weights is False or want_weights is True)
            and (causal is False or causal is True)):
        return None
    dt, nd = x.dtype, x.ndim
    # Sources of the keys and values: value defaults to key, key to x.
    k = x if key is None else key
    v = k if value is None else value
    if not ((dt is _F32 or dt is _F64) and (nd == 2 or nd == 3)
            and (k is x or (type(k) is _ndarray and k.dtype is dt and k.ndim == nd))
            and (v is k or (type(v) is _ndarray and v.dtype is dt and v.ndim == nd))):
        return None
    if nd == 2:
        xb = x[_newaxis]
        kb = xb if k is x else k[_newaxis]
        v = kb if v is k else (xb if v is x else v[_newaxis])
        x, k = xb, kb
    (B, Tq, Din), (Bk, Tk, Dkin), (Bv, Tv, Dvin) = x.shape, k.shape, v.shape
    if Bk != B or Bv != B or Tv != Tk:
        return None

    wdt = dt if w_dtype is None else w_dtype if dt is _F32 else None
    if (type(w_q) is _ndarray and type(w_k) is _ndarray and type(w_v) is _ndarray
            and w_q.dtype is wdt and w_k.dtype is wdt and w_v.dtype is wdt
            and w_q.ndim == 2 and w_k.ndim == 2 and w_v.ndim == 2):
        # Fused weights, the common form: every head has the same widths.
        if num_heads is None:
            return None
        H = num_heads
        G = H if num_kv_heads is None else num_kv_heads
        Sk, Sv = w_k.shape[1], w_v.shape[1]
        dk, dv = Sk // G, Sv // G
        if H > _FAST_HEADS or H % G or not (dk and dv) or dk * G != Sk or dv * G != Sv:
            return None
        dk_one, dv_one = dk, dv
    elif w_dtype is not None:
        return None
    else:
        fused = _fuse_heads(w_q, w_k, w_v, num_heads, num_kv_heads, dt)
        if fused is None:
            return None
        w_q, w_k, w_v, H, G, dk, dv = fused
        # One width for every head, or None: the stacked biases need one.
        dk_one = dk[0] if dk.count(dk[0]) == G else None
        dv_one = dv[0] if dv.count(dv[0]) == G else None
    if scale is not None:
        if type(scale) not in _SCALE_TYPES:
            return None
        try:
            scale = float(scale)
        except OverflowError:
            return None
    # (dk, dv, scales, Sq, Svq): the glue's arrays and the fused widths.
    heads = _HEADS.get((H, G, dk, dv, scale))
    if heads is None:
        heads = _fast_heads(H, G, dk, dv, scale)
    (Din_q, Sq), (Dkin_k, Sk), (Dvin_v, Sv) = w_q.shape, w_k.shape, w_v.shape
    Svq = heads[4]
    if Din_q != Din or Dkin_k != Dkin or Dvin_v != Dvin or Sq != heads[3]:
        return None
    if w_o is None:
        d_out = Svq
    elif (type(w_o) is _ndarray and w_o.dtype is wdt and w_o.ndim == 2
          and w_o.shape[0] == Svq):
        d_out = w_o.shape[1]
    else:
        return None
    # Outputs and projections, and inputs the glue may copy. normalize()
    # also bounds the per-head bookkeeping by memory_limit().
    n = (B * Tq * (Sq + Svq + d_out + Din) + B * Tk * (Sk + Sv + Dkin + Dvin)
         + Din * Sq + Dkin * Sk + Dvin * Sv + Svq * d_out
         + (B * H * Tq * Tk if want_weights else 0))
    # memory_limit() is read once and kept in _args; its value is read here
    # without the call.
    if n > _FAST_ELEMENTS or n * 8 + H * PER_HEAD_BYTES > (
            _args._memory_limit_bytes or memory_limit()):
        return None

    if ((b_q is not None and (b_q := _fast_bias(b_q, dt, H, dk_one, Sq)) is None)
            or (b_k is not None and (b_k := _fast_bias(b_k, dt, G, dk_one, Sk)) is None)
            or (b_v is not None and (b_v := _fast_bias(b_v, dt, G, dv_one, Sv)) is None)
            or (b_o is not None and not (type(b_o) is _ndarray and b_o.dtype is dt
                                         and b_o.shape == (d_out,)))):
        return None
    if mask is not None and not _fast_mask(mask, dt, (B, H, Tq, Tk) if nd == 3
                                           else (H, Tq, Tk)):
        return None
    if key_lengths is not None and (
            key_lengths := _fast_lengths(key_lengths, nd, B, Tk)) is None:
        return None
    return (x, k, v, w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o, heads[0], heads[1],
            heads[2], mask, causal, key_lengths, None, want_weights, False)


# --- what the forward keeps for the backward ---------------------------------

# No Parameters section: only multi_head_attention(..., return_context=True)
# makes a Context, and its constructor's arguments are the forward's internals.
class Context:  # numpydoc ignore=PR01
    """What :func:`backward` needs from one forward call.

    O(T d) state only, never a T x T buffer: references to the checked
    arguments (``call``), the projections ``q`` (B, Tq, Sq), ``k``
    (B, Tk, Sk), ``v`` (B, Tk, Sv), the concatenation ``concat``
    (B, Tq, Svq) and each query row's log-sum-exp ``lse`` (B, H, Tq) of its
    scaled, masked scores (-inf for a fully masked row).  The softmax
    probabilities are recomputed from ``lse`` by the backward pass.  With
    an output gate, ``concat`` is still the heads side by side, *before*
    the gate (what the attention made, and what its backward needs); the
    backward recomputes the gate sigmoid(x w_gate + b_gate) from the call's
    x, w_gate and b_gate, and the gated concatenation W^O saw from both.

    A context may be used for any number of backward calls.  It holds
    references, not copies: modifying an input or weight in place between
    the forward and the backward call gives wrong gradients.

    Examples
    --------
    >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    >>> out, ctx = mhattn.multi_head_attention(X, w_q, w_k, w_v, w_o, return_context=True)
    >>> ctx
    <mhattn.Context B=1 Tq=3 Tk=3 H=2 G=2 dtype=float64>
    >>> ctx.lse.shape                 # (B, H, T_q), batched even for an unbatched call
    (1, 2, 3)
    """
    __slots__ = ("call", "q", "k", "v", "concat", "lse", "bias_forms")

    def __init__(self, call: Call, extras, bias_forms: Dict[str, Optional[str]]):
        # Made by the forward alone (return_context=True): never half made.
        if not isinstance(call, Call) or not (
                isinstance(extras, tuple) and len(extras) == 5
                and all(isinstance(a, np.ndarray) for a in extras)) \
                or not isinstance(bias_forms, dict):
            raise TypeError("Context: made by multi_head_attention(..., "
                            "return_context=True), not by hand")
        self.call = call
        self.q, self.k, self.v, self.concat, self.lse = extras
        self.bias_forms = bias_forms

    @property
    def out_shape(self) -> tuple:
        """The shape of the forward's output, which grad_out must have.

        Examples
        --------
        >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
        >>> out, ctx = mhattn.multi_head_attention(X, w_q, w_k, w_v, w_o,
        ...                                        return_context=True)
        >>> ctx.out_shape, out.shape
        ((3, 4), (3, 4))
        """
        c = self.call
        shape = (c.B, c.Tq, c.d_out)
        return shape if c.batched else shape[1:]

    def __repr__(self) -> str:
        c = self.call
        return (f"<mhattn.Context B={c.B} Tq={c.Tq} Tk={c.Tk} H={c.H} G={c.G} "
                f"dtype={c.dtype.name}>")


def _bias_form(b: Any) -> Optional[str]:
    """The form of a bias that normalize() accepted: list, fused or stacked."""
    if b is None:
        return None
    if isinstance(b, (list, tuple)) and len(b) > 0 and np.ndim(b[0]) == 1:
        return "list"
    return "fused" if np.ndim(b) == 1 else "stacked"


def make_context(call: Call, extras, *, b_q=None, b_k=None, b_v=None) -> Context:
    """A Context from a checked call and run_core's kept extras."""
    return Context(call, extras, {"b_q": _bias_form(b_q), "b_k": _bias_form(b_k),
                                  "b_v": _bias_form(b_v)})
