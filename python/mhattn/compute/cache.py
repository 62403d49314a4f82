"""A preallocated key/value cache, and the cached layer step that uses it.

:class:`KVCache` holds the keys and values of B sequences in storage of
shape (B, G, capacity, d) with per-sequence ``lengths`` (B,).
:func:`cached_step` is ``multi_head_attention(x_new, ..., cache=cache)``:
it projects only the new rows (``_C.project``: biases, k_norm / q_norm and
RoPE at positions ``lengths[b] + i``), appends the new keys and values, and
attends from the new queries over each sequence's cached keys
(``_C.attention`` on the storage itself, aligned bottom-right per sequence),
then applies W^O.  Letters follow ``csrc/mha.h``.

A cache may store its keys and values in float16, bfloat16 or int8 (issue
36) and compute in float32: rows are rounded (or quantised) once, as they
are appended, and ``_C.attention`` reads the storage itself, each key block
widened by the kernel that reads it (csrc/mha.h, ``mha_kv_storage``).

One lock per cache makes each append, reset and cached step atomic: the
lengths are read, the rows written, the lengths bumped and (in a step) the
rows attended with the lock held, so that no two writes share an offset and
no step reads a row being written.
"""
from __future__ import annotations

import dataclasses
import numbers
import threading
from typing import Any, Optional

import numpy as np

from .._internal import core
from .._internal.args import (_to_array, bool_arg, check_memory, memory_limit, normalize,
                              plan)
from .._internal.core import _fused_bias, head_arrays, variant_args
from .._internal.variants import Variants, variants_tuple_of
from .._internal.half import bfloat16_dtype, is_bfloat16, is_half, narrow, narrow_like

__all__ = ["KVCache", "cached_step"]


def _size(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) \
            or int(value) <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)


_F32, _F64, _F16, _I8 = (np.dtype(t) for t in (np.float32, np.float64, np.float16, np.int8))
_DTYPES = ("np.float32, np.float64, np.float16, ml_dtypes.bfloat16 or 'int8' (or the "
           "strings 'float16', 'bfloat16')")


def _dtype(dtype: Any) -> np.dtype:
    """The storage's dtype: float32, float64, float16, bfloat16 or int8,
    native; ValueError naming ``dtype`` otherwise (ImportError for
    "bfloat16" without ml_dtypes)."""
    dt = None
    if isinstance(dtype, str) and dtype == "bfloat16":
        return bfloat16_dtype()
    # np.dtype(None) is float64: a None meant as "the default" would get the
    # wrong one, so it is refused with the other non-dtypes.
    if dtype is not None:
        try:
            dt = np.dtype(dtype)
        except (TypeError, ValueError, SyntaxError):
            pass
    if dt is not None and (dt in (_F32, _F64, _F16, _I8) or
                           (is_bfloat16(dt) and dt.isnative)):
        return dt
    got = repr(dtype) if dt is None else str(dt)
    raise ValueError(f"dtype: expected {_DTYPES}, got {got}")


def _storage_items(B: int, G: int, C: int, dk: int, dv: int, itemsize: int,
                   scales: bool = False) -> list:
    """What a KVCache allocates, as check_memory items (its nbytes)."""
    items = [("the key storage", "batch*num_kv_heads*capacity*d_k", (B, G, C, dk), itemsize),
             ("the value storage", "batch*num_kv_heads*capacity*d_v", (B, G, C, dv),
              itemsize)]
    if scales:
        items += [("the key scales", "batch*num_kv_heads*capacity", (B, G, C), 4),
                  ("the value scales", "batch*num_kv_heads*capacity", (B, G, C), 4)]
    return items + [("the lengths", "batch", (B,), 8)]


def _quantise(x: np.ndarray):
    """int8 rows of float32 ``x`` (..., d) and their float32 scales (...):
    symmetric, one scale per row, scale = max|row| / 127 and q = x / scale
    rounded to nearest even, clamped to [-127, 127] (as llama.cpp's q8_0
    rows).  An all-zero row has scale 0 (q 0); a row holding a NaN or an
    infinity has scale NaN and q 0, so that it reads back as NaN (as a
    float32 cache would give NaN scores for it).  A row whose scale
    underflows to 0 takes the smallest subnormal instead."""
    x = np.asarray(x, _F32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        amax = np.max(np.abs(x), axis=-1)
        scale = amax / np.float32(127)
        finite = np.isfinite(scale)
        scale = np.where((scale == 0) & (amax > 0),
                         np.finfo(np.float32).smallest_subnormal, scale)
        safe = np.where(finite & (scale > 0), scale, np.float32(1)).astype(_F32)
        q = np.clip(np.rint(x / safe[..., np.newaxis]), -127, 127)
        q = np.where(finite[..., np.newaxis], q, 0).astype(np.int8)
    return q, np.where(finite, scale, np.float32(np.nan)).astype(_F32)


def _rows_of(name: str, a: np.ndarray, dtype: np.dtype, compute: np.dtype) -> np.ndarray:
    """New rows ``a`` (of the right shape) as a cache stored in ``dtype``
    and computing in ``compute`` takes them: its own dtype, or float32 rows
    that a half or int8 cache rounds or quantises as it stores them
    (_encode); ValueError naming ``name`` and what to pass otherwise.
    KVCache's and PagedKVCache's rule."""
    if a.dtype == dtype and dtype != _I8:
        return a
    if a.dtype == _F32 and compute == _F32 and dtype != _F32:
        return a      # rounded or quantised as it is stored (_encode)
    if dtype == _I8:
        raise ValueError(f"{name}: dtype {a.dtype}, but an int8 cache takes float32 rows "
                         f"and quantises them as they are appended; pass "
                         f"{name}.astype(np.float32)")
    if is_half(dtype):
        raise ValueError(f"{name}: dtype {a.dtype}, but the cache holds {dtype}; "
                         f"pass {dtype} or float32 rows (rounded once to "
                         f"{dtype} as they are stored)")
    raise ValueError(f"{name}: dtype {a.dtype}, but the cache holds {dtype}; "
                     f"pass {name}.astype(np.{dtype.name})")


class KVCache:
    """A preallocated key/value cache for decoding, B sequences at a time.

    KVCache(batch, num_kv_heads, capacity, d_k, d_v=None, dtype=np.float32)

    Parameters
    ----------
    batch : int
        B, the number of sequences.
    num_kv_heads : int
        G, the number of key/value heads (the layer's ``num_kv_heads``).
    capacity : int
        The most keys any one sequence may hold.
    d_k, d_v : int
        Head widths of the keys and values; d_v defaults to d_k.
    dtype : np.float32 (default), np.float64, np.float16, ml_dtypes.bfloat16 or "int8"
        The storage's dtype ("float16" and "bfloat16" are also taken).  A
        float16, bfloat16 or int8 cache computes in float32 and stores each
        appended row rounded once to nearest even (half), or quantised
        (int8: one float32 scale per token and kv head, see Notes).

    Attributes
    ----------
    key_storage : (B, G, capacity, d_k) array of the cache's dtype
        Item b's keys are ``key_storage[b, :, :lengths[b]]``; rows past a
        length are stale and never read.
    value_storage : (B, G, capacity, d_v) array
    key_scales, value_scales : (B, G, capacity) float32, or None
        An int8 cache's scales: key j of item b, kv head g is
        ``key_scales[b, g, j] * key_storage[b, g, j]`` in float32.  None
        for the other dtypes.
    lengths : (B,) int64, read-only view
        How many keys each sequence holds.
    nbytes : int
        The memory held: B * G * capacity * (d_k + d_v) * itemsize (plus
        B * G * capacity * 8 for an int8 cache's scales), plus 8 * B for
        the lengths, allocated once, at construction (a MemoryError naming
        the sizes, before anything is allocated, when that is more than
        the machine's memory).

    Notes
    -----
    Half and int8 caches (issue 36): a float16 or bfloat16 cache stores
    each appended value rounded once to nearest even; an int8 cache
    quantises each appended row of d features (one token, one kv head):
    scale = max|row| / 127, q = round-half-even(row / scale) in
    [-127, 127] (an all-zero row: scale 0; a row holding a NaN or an
    infinity: scale NaN, so that it reads back as NaN, and a query that
    sees that key gets NaN, as with a NaN key in a float32 cache, while
    queries that do not see it are unaffected).  Each dequantised value
    is within max|row| / 254 of the appended one.  A step computes in
    float32 (x float32, or x of the cache's half dtype, whose result is
    rounded once to it); the kernels read the storage itself and widen
    each row in the registers that read it, never the whole cache.  A half
    cache's step gives the bits of a float32 cache holding the same
    (rounded) keys and values.  An int8 cache's step differs from a
    float32 cache's holding the unquantised rows by at most, in each
    element of a head's output, ::

        e_v + (exp(2 delta) - 1) * max_j max abs(v_j)

    with ``e_v = max_j max abs(v_j) / 254`` and ``delta = abs(scale) *
    sum abs(q) * max_j max abs(k_j) / 254`` (q the head's query after its norm and RoPE,
    scale the call's multiplier of q.k, j over the keys the query sees),
    plus float32 rounding: the bound does not grow with the cache's
    length (tests/test_kvcache_half.py holds it from 1 to 32768 keys).

    The cache is filled by :meth:`append` or by
    ``multi_head_attention(x_new, ..., cache=cache)`` /
    ``layer(x_new, cache=cache)``.  No gradient flows through a cache.
    It pickles and copies (only the filled rows are saved; a copy has its
    own storage and lock) and :meth:`reset` empties it.

    Thread safety: one cache may be shared by threads.  Each
    :meth:`append`, :meth:`reset` and cached step holds the cache's lock
    from reading the lengths to bumping them, and a step until it has
    attended over the rows, so that concurrent writes never share rows and
    a step never reads a row being written; they run one after another,
    in the order they took the lock.  The storage and its views
    :attr:`keys`, :attr:`values` and :attr:`lengths` are read without the
    lock: read them while no other thread writes.

    Bits: a step's result depends on the tokens held, its arguments and
    the ISA, never on the capacity, the storage's strides or the thread
    count: the core plans a decode's split of the keys from the keys held
    (the longest sequence's length), so caches of any capacity holding the
    same tokens give the same bits, and a step gives those of
    :func:`mhattn.attention` on the keys held contiguously (T_k the longest
    length, ``key_lengths`` the lengths) with the query at its length - 1.

    Examples
    --------
    >>> cache = mhattn.KVCache(2, 4, 128, 16)
    >>> k = np.ones((2, 4, 3, 16), np.float32)
    >>> cache.append(k, k)
    >>> cache.lengths, cache.keys.shape
    (array([3, 3]), (2, 4, 3, 16))
    >>> cache.nbytes
    131088
    >>> mhattn.KVCache(2, 4, 128, 16, dtype=np.float16).nbytes   # half the bytes
    65552
    >>> q8 = mhattn.KVCache(1, 2, 64, 8, dtype="int8")
    >>> k = np.linspace(-1, 1, 2 * 5 * 8, dtype=np.float32).reshape(1, 2, 5, 8)
    >>> q8.append(k, k)
    >>> q8.key_storage.dtype, q8.key_scales.shape
    (dtype('int8'), (1, 2, 64))
    >>> back = q8.keys * q8.key_scales[:, :, :5, np.newaxis]      # dequantised
    >>> bool((np.abs(back - k) <= np.abs(k).max(axis=-1, keepdims=True) / 254).all())
    True
    """

    def __init__(self, batch, num_kv_heads, capacity, d_k, d_v=None, dtype=np.float32):
        B, G = _size("batch", batch), _size("num_kv_heads", num_kv_heads)
        C, dk = _size("capacity", capacity), _size("d_k", d_k)
        dv = dk if d_v is None else _size("d_v", d_v)
        dt = _dtype(dtype)
        int8 = dt == _I8
        # Python's integers are exact: a size NumPy would call "too big"
        # (or 2**62 rows that it would try to allocate) is a MemoryError
        # naming the sizes, as for any call's plan.
        check_memory(_storage_items(B, G, C, dk, dv, dt.itemsize, int8))
        self.key_storage = np.zeros((B, G, C, dk), dt)
        self.value_storage = np.zeros((B, G, C, dv), dt)
        # int8: one float32 scale per (item, kv head, token); else None.
        self.key_scales = np.zeros((B, G, C), _F32) if int8 else None
        self.value_scales = np.zeros((B, G, C), _F32) if int8 else None
        # What a step computes in: float64 for a float64 cache, else float32.
        self._compute = _F64 if dt == _F64 else _F32
        self._lengths = np.zeros(B, np.int64)
        # Held across read-lengths / write-rows / bump-lengths (and a step's
        # attend). A plain Lock: nothing called with it held calls back
        # into the cache (the step converts the caller's objects first).
        self._lock = threading.Lock()

    # -- sizes ----------------------------------------------------------------

    batch = property(lambda self: self.key_storage.shape[0], doc="B")
    num_kv_heads = property(lambda self: self.key_storage.shape[1], doc="G")
    capacity = property(lambda self: self.key_storage.shape[2], doc="keys per sequence")
    d_k = property(lambda self: self.key_storage.shape[3], doc="key width")
    d_v = property(lambda self: self.value_storage.shape[3], doc="value width")
    dtype = property(lambda self: self.key_storage.dtype,
                     doc="the storage's: float32, float64, float16, bfloat16 or int8")

    @property
    def lengths(self) -> np.ndarray:
        """(B,) int64, read-only: how many keys each sequence holds.

        Examples
        --------
        >>> cache = mhattn.KVCache(2, 1, 8, 4)
        >>> kv = np.zeros((2, 1, 3, 4), np.float32)
        >>> cache.append(kv, kv, lengths=[3, 1])
        >>> cache.lengths
        array([3, 1])
        """
        view = self._lengths.view()
        view.flags.writeable = False
        return view

    @property
    def nbytes(self) -> int:
        """Bytes held by the storage (and an int8 cache's scales) and the lengths.

        Examples
        --------
        >>> mhattn.KVCache(2, 4, 128, 16).nbytes      # 2*4*128*(16 + 16)*4 + 8*2
        131088
        """
        n = self.key_storage.nbytes + self.value_storage.nbytes + self._lengths.nbytes
        if self.key_scales is not None:
            n += self.key_scales.nbytes + self.value_scales.nbytes
        return n

    @property
    def keys(self) -> np.ndarray:
        """(B, G, max(lengths), d_k) view of the storage; item b's keys are its
        first lengths[b] rows (the rest, in a ragged batch, are stale).  Of
        the cache's dtype: an int8 cache's values times ``key_scales``.

        Examples
        --------
        >>> cache = mhattn.KVCache(2, 1, 8, 4)
        >>> kv = np.zeros((2, 1, 3, 4), np.float32)
        >>> cache.append(kv, kv, lengths=[3, 1])
        >>> cache.keys.shape                 # max(lengths) = 3 rows
        (2, 1, 3, 4)
        """
        return self.key_storage[:, :, :int(self._lengths.max(initial=0))]

    @property
    def values(self) -> np.ndarray:
        """(B, G, max(lengths), d_v) view, as :attr:`keys`.

        Examples
        --------
        >>> cache = mhattn.KVCache(2, 1, 8, 4, d_v=6)
        >>> cache.append(np.zeros((2, 1, 3, 4), np.float32),
        ...              np.zeros((2, 1, 3, 6), np.float32))
        >>> cache.values.shape
        (2, 1, 3, 6)
        """
        return self.value_storage[:, :, :int(self._lengths.max(initial=0))]

    def reset(self) -> None:
        """Empty every sequence (lengths to 0; the storage is kept).

        Examples
        --------
        >>> cache = mhattn.KVCache(1, 1, 8, 4)
        >>> kv = np.zeros((1, 1, 3, 4), np.float32)
        >>> cache.append(kv, kv)
        >>> cache.reset()
        >>> cache.lengths
        array([0])
        """
        with self._lock:
            self._lengths[:] = 0

    def __repr__(self) -> str:
        return (f"KVCache(batch={self.batch}, num_kv_heads={self.num_kv_heads}, "
                f"capacity={self.capacity}, d_k={self.d_k}, d_v={self.d_v}, "
                f"dtype={self.dtype.name}, lengths={self._lengths.tolist()})")

    # -- pickling and copying: only the filled rows, a new lock -----------------

    def __getstate__(self) -> dict:
        with self._lock:       # rows and lengths of one moment
            n = int(self._lengths.max(initial=0))
            state = {"shape": (self.batch, self.num_kv_heads, self.capacity, self.d_k,
                               self.d_v),
                     # a name _dtype reads back ("bfloat16" has no dtype.str of its own)
                     "dtype": self.dtype.name if is_bfloat16(self.dtype) else self.dtype.str,
                     "keys": self.key_storage[:, :, :n].copy(),
                     "values": self.value_storage[:, :, :n].copy(),
                     "lengths": self._lengths.copy()}
            if self.key_scales is not None:
                state["key_scales"] = self.key_scales[:, :, :n].copy()
                state["value_scales"] = self.value_scales[:, :, :n].copy()
            return state

    def __setstate__(self, state: dict) -> None:
        B, G, C, dk, dv = state["shape"]
        self.__init__(B, G, C, dk, dv, _dtype(state["dtype"]))
        n = state["keys"].shape[2]
        self.key_storage[:, :, :n] = state["keys"]
        self.value_storage[:, :, :n] = state["values"]
        if self.key_scales is not None:
            self.key_scales[:, :, :n] = state["key_scales"]
            self.value_scales[:, :, :n] = state["value_scales"]
        self._lengths[:] = state["lengths"]

    # -- writing ----------------------------------------------------------------

    def _check_new(self, name: str, a: Any, width: int, what: str) -> np.ndarray:
        a = _to_array(name, a)
        want = f"(B, G, T_new, {what}) = ({self.batch}, {self.num_kv_heads}, T_new, {width})"
        if a.ndim != 4 or a.shape[0] != self.batch or a.shape[1] != self.num_kv_heads \
                or a.shape[3] != width:
            raise ValueError(f"{name}: expected shape {want} for {self!r}, got {a.shape}")
        return _rows_of(name, a, self.dtype, self._compute)

    def _encode(self, a: np.ndarray):
        """Checked new rows (B, G, T, d) as the storage holds them, and their
        scales (B, G, T) for an int8 cache (else None): float32 rows of a
        half cache rounded once to nearest even, of an int8 cache
        quantised (_quantise)."""
        if self.dtype == _I8:
            return _quantise(a)
        if a.dtype != self.dtype:
            return narrow(a, self.dtype), None
        return a, None

    def check_room(self, counts: np.ndarray, name: str = "k_new") -> None:
        """Raise ValueError, changing nothing, unless every sequence b has room
        for counts[b] more keys.  (Append and the cached step call it with
        the lock held, just before they write; it takes no lock itself.)

        Parameters
        ----------
        counts : int or (B,) ints
            Each >= 0 (TypeError / ValueError starting "counts: " otherwise).
        name : str, default "k_new"
            The argument that the error for a lack of room names.

        Raises
        ------
        ValueError
            When some sequence b holds more than ``capacity - counts[b]``
            keys; the cache is unchanged.

        Examples
        --------
        >>> cache = mhattn.KVCache(2, 1, 4, 8)
        >>> cache.check_room([4, 1])          # room for both: nothing happens
        >>> cache.check_room([1, 5])
        Traceback (most recent call last):
            ...
        ValueError: k_new: appending 5 keys to sequence 1, which holds 0, exceeds ...
        """
        B = self._lengths.shape[0]
        if isinstance(counts, (bool, np.bool_)):
            raise TypeError(f"counts: expected an int or ({B},) ints, got {counts!r}")
        try:
            c = np.asarray(counts)
        except (TypeError, ValueError) as e:   # ragged lists, odd objects
            raise TypeError(f"counts: expected an int or ({B},) ints, got "
                            f"{type(counts).__name__} ({e})") from None
        if c.dtype.kind not in "iu" and not (c.dtype == object and c.size and all(
                isinstance(n, numbers.Integral) and not isinstance(n, (bool, np.bool_))
                for n in c.reshape(-1))):
            raise TypeError(f"counts: expected an int or ({B},) ints, got "
                            f"{type(counts).__name__} of dtype {c.dtype}")
        if c.shape not in ((), (B,)):
            raise ValueError(f"counts: expected an int or shape ({B},) (one per "
                             f"sequence), got shape {c.shape}")
        c = np.broadcast_to(c, (B,))
        ints = [int(n) for n in c]      # Python ints: none overflows
        neg = [b for b, n in enumerate(ints) if n < 0]
        if neg:
            raise ValueError(f"counts: expected ints >= 0, got {ints[neg[0]]} for "
                             f"sequence {neg[0]}")
        after = self._lengths + np.array([min(n, self.capacity + 1) for n in ints],
                                         dtype=np.int64)
        if (after > self.capacity).any():
            b = int(np.argmax(after > self.capacity))
            raise ValueError(f"{name}: appending {ints[b]} keys to sequence {b}, "
                             f"which holds {int(self._lengths[b])}, exceeds the cache's "
                             f"capacity {self.capacity}; the cache is unchanged")

    def append(self, k_new, v_new, *, lengths=None) -> None:
        """Write new keys and values after each sequence's last, in place.

        Parameters
        ----------
        k_new : (B, G, T_new, d_k), of the cache's dtype (or float32 for a half or int8 cache)
        v_new : (B, G, T_new, d_v), as k_new
        lengths : (B,) ints in [0, T_new], optional
            A ragged append: sequence b takes only its first lengths[b] new
            rows.  Default: all T_new rows for every sequence.

        Raises
        ------
        ValueError
            Naming the argument, with the cache unchanged, for a wrong
            shape, dtype, head count or width, or an append past the
            capacity.

        Examples
        --------
        Three keys for both sequences, then two more for the first only:

        >>> cache = mhattn.KVCache(2, 1, 8, 4)
        >>> kv = np.zeros((2, 1, 3, 4), np.float32)
        >>> cache.append(kv, kv)
        >>> cache.append(kv[:, :, :2], kv[:, :, :2], lengths=[2, 0])
        >>> cache.lengths
        array([5, 3])
        """
        k = self._check_new("k_new", k_new, self.d_k, "d_k")
        v = self._check_new("v_new", v_new, self.d_v, "d_v")
        T = k.shape[2]
        if v.shape[2] != T:
            raise ValueError(f"v_new: has {v.shape[2]} rows but k_new has {T}")
        counts = np.full(self.batch, T, np.int64)
        if lengths is not None:
            n = _to_array("lengths", lengths)
            if n.dtype.kind not in "iu" or n.shape != (self.batch,):
                raise ValueError(f"lengths: expected ({self.batch},) integers, got "
                                 f"{n.dtype} {n.shape}")
            if (n < 0).any() or (n > T).any():
                raise ValueError(f"lengths: each must lie in [0, T_new={T}], got "
                                 f"{n.tolist()}")
            counts = n.astype(np.int64)
        with self._lock:
            self.check_room(counts)
            self._write(k, v, counts)

    def _write(self, k: np.ndarray, v: np.ndarray, counts: np.ndarray) -> None:
        """Write checked new rows: counts[b] rows of item b.  The caller
        holds the lock (NumPy's copies release the GIL: without it two
        writers would read the same lengths and write the same rows)."""
        (k, k_sc), (v, v_sc) = self._encode(k), self._encode(v)
        if (counts == counts[0]).all() and (self._lengths == self._lengths[0]).all():
            start, n = int(self._lengths[0]), int(counts[0])
            self.key_storage[:, :, start:start + n] = k[:, :, :n]
            self.value_storage[:, :, start:start + n] = v[:, :, :n]
            if k_sc is not None:
                self.key_scales[:, :, start:start + n] = k_sc[:, :, :n]
                self.value_scales[:, :, start:start + n] = v_sc[:, :, :n]
        else:
            for b in range(self.batch):
                start, n = int(self._lengths[b]), int(counts[b])
                self.key_storage[b, :, start:start + n] = k[b, :, :n]
                self.value_storage[b, :, start:start + n] = v[b, :, :n]
                if k_sc is not None:
                    self.key_scales[b, :, start:start + n] = k_sc[b, :, :n]
                    self.value_scales[b, :, start:start + n] = v_sc[b, :, :n]
        self._lengths += counts


# Keywords of multi_head_attention that a cached step cannot take.
_NOT_WITH_CACHE = ("key", "value", "mask", "key_lengths", "key_mask", "cu_seqlens",
                   "key_cu_seqlens", "positions", "key_positions", "block_mask")


def _check_cache(cache: Any, call) -> None:
    """The cache must fit the call: ValueError naming ``cache`` otherwise.
    (Whether it has room is only known under its lock: check_room.)"""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache: expected a mhattn.KVCache, got {type(cache).__name__}")
    _check_fits(cache, call, [] if cache.batch == call.B else
                [f"batch {cache.batch} but x has {call.B} sequences"])


def _check_fits(cache, call, problems: list) -> None:
    """A cache (KVCache or PagedKVCache) fits the call's heads, widths and
    dtype: ValueError naming ``cache`` with every problem (``problems``
    first) otherwise."""
    if cache.num_kv_heads != call.G:
        problems.append(f"{cache.num_kv_heads} kv heads but the weights have {call.G}")
    if set(call.dk) != {cache.d_k} or set(call.dv) != {cache.d_v}:
        problems.append(f"widths d_k={cache.d_k}, d_v={cache.d_v} but the heads have "
                        f"d_k={sorted(set(call.dk))}, d_v={sorted(set(call.dv))}")
    if cache._compute != call.dtype:
        problems.append(f"dtype {cache.dtype} (computing in {cache._compute}) but the call "
                        f"computes in {call.dtype}")
    elif is_half(cache.dtype) and is_half(call.out_dtype) and cache.dtype != call.out_dtype:
        problems.append(f"dtype {cache.dtype} but x is {call.out_dtype} (pass x as "
                        f"{cache.dtype} or float32)")
    if problems:
        raise ValueError(f"cache: {'; '.join(problems)} ({cache!r})")


def _new_lengths(new_lengths: Any, B: int, T: int, causal: bool) -> Optional[np.ndarray]:
    """(B,) int64 in [0, T], or None for every row of every sequence."""
    if new_lengths is None:
        return None
    n = _to_array("new_lengths", new_lengths)
    if n.dtype.kind not in "iu" or n.shape not in ((B,), ()):
        raise ValueError(f"new_lengths: expected ({B},) integers (one per sequence), got "
                         f"{n.dtype} {n.shape}")
    n = np.broadcast_to(n, (B,)).astype(np.int64)
    if (n < 0).any() or (n > T).any():
        raise ValueError(f"new_lengths: each must lie in [0, T_new={T}], got {n.tolist()}")
    if not causal and (n < T).any():
        raise ValueError("new_lengths: shorter than T_new needs causal=True (the padding "
                         "rows are keys that a real query would otherwise see)")
    return n


def _step_items(call, capacity: int, want_weights: bool, rope: bool) -> list:
    """Every allocation of a cached step, as check_memory items: the main
    call's plan (the projections of the new rows, the heads' concatenation,
    out, the weights' and inputs' copies), then what only a step makes."""
    B, Tq, n = call.B, call.Tq, call.dtype.itemsize
    items = plan(call)
    if call.b_o is not None:
        items.append(("out + b_o", "B*T_q*d_out", (B, Tq, call.d_out), n))
    if want_weights:
        items.append(("return_weights=True", "B*h*T_new*capacity", (B, call.H, Tq, capacity),
                      n))
    if rope:
        items.append(("the RoPE positions", "B*T_new", (B, Tq), 8))
    return items


def _check_step_memory(call, capacity: int, want_weights: bool, rope: bool) -> None:
    """check_memory(_step_items(...)), the items built only when a cheap
    upper bound of their sum does not fit: building the plan costs about a
    tenth of a decode step.  The bound counts every element at 8 bytes and
    every copy the plan may count, as core.fast bounds a small call."""
    rows, d_in = call.B * call.Tq, call.x.shape[-1]
    Sq, Sk, Sv, Svq, d_out = call.Sq, call.Sk, call.Sv, call.Svq, call.d_out
    bound = (rows * (2 * d_out + 2 * Sq + 2 * Sk + Sv + Svq + 3 * d_in + 1)
             + d_in * (Sq + Sk + Sv) + Svq * d_out
             + (rows * call.H * capacity if want_weights else 0)
             + (2 * rows * Svq + d_in * Svq if call.w_gate is not None else 0))
    if 8 * bound > memory_limit():
        check_memory(_step_items(call, capacity, want_weights, rope))


def _scores_only(var: Variants) -> Optional[tuple]:
    """The variants' tuple (csrc/python/variants.c, read_variants) without the
    q/k transforms, which the projections applied: None when no score rule
    (window, softcap, ALiBi, sinks, key_mask, dropout) is left."""
    if not var.any:
        return None
    rules = dataclasses.replace(var, q_norm=None, k_norm=None, rotary_dim=0,
                                interleaved=False, inv_freq=None, positions=None,
                                key_positions=None)
    return variants_tuple_of(rules) if rules.any else None


def _output_gate(call) -> np.ndarray:
    """(B, T_new, sum d_v): the output gate of the new rows, sigmoid(x @
    w_gate + b_gate), in the call's dtype (csrc/core/gate.h's gate; the
    step applies it here, as it applies W^O)."""
    # Contiguous operands: NumPy's BLAS takes a Fortran-ordered w_gate by
    # another kernel, whose sums round differently (a step's bits would
    # then depend on the gate's layout).
    z = np.ascontiguousarray(call.x) @ np.ascontiguousarray(call.w_gate)
    if call.b_gate is not None:
        z += call.b_gate
    with np.errstate(over="ignore"):   # exp(-z) = inf for z << 0: the gate is 0
        return 1 / (1 + np.exp(-z))


def cached_step(x, w_q, w_k, w_v, w_o, *, cache, num_heads=None, scale=None,
                return_weights=False, causal=False, num_kv_heads=None, b_q=None,
                b_k=None, b_v=None, b_o=None, return_context=False, new_lengths=None,
                packed=None, w_gate=None, b_gate=None, **options):
    """One step of multi_head_attention through a :class:`KVCache`:
    ``multi_head_attention(x_new, ..., cache=cache)`` calls this.

    1. project only the new rows x (B, T_new, d_in) (or (T_new, d_in) with a
       cache of batch 1), with q_norm / k_norm and RoPE at positions
       lengths[b] + i;  2. append the new keys and values;  3. attend from
    the new queries over each sequence's lengths[b] + T_new keys, aligned
    bottom-right per sequence (``causal=True`` for a decoder's prefill);
    4. apply the output gate (with ``w_gate``: each new row's own, from x)
    and W^O (+ b_o).  ``new_lengths`` (B,) makes the step ragged:
    sequence b takes only its first new_lengths[b] rows of x (causal=True);
    its other rows are padding, their outputs 0.  Returns out (B, T_new, d_out) (and the weights
    (B, H, T_new, capacity) with ``return_weights``; keys past a sequence's
    length get 0).  No gradients through a cache: ``return_context=True``
    raises.  On any error the cache is unchanged; a step whose allocations
    (those weights among them) do not fit raises MemoryError before any.
    The caller's arguments are converted first, then the cache's lock is
    held from the room check through the attend (see :class:`KVCache`).
    """
    for name in _NOT_WITH_CACHE:
        if options.get(name) is not None:
            raise ValueError(f"{name}: not with cache= (the keys are the cache's, at "
                             "positions lengths[b] + i)")
    if bool_arg("return_context", return_context):
        raise ValueError("return_context: no gradients flow through a KV cache")
    want_w = bool_arg("return_weights", return_weights)
    # Everything the caller passed is converted and checked before the
    # cache's lock is taken: no caller's __array__ or __index__ runs, and no
    # error is found, while other threads wait on the lock.
    call = normalize(_to_array("x", x), w_q, w_k, w_v, w_o, num_heads=num_heads,
                     scale=scale, causal=causal, num_kv_heads=num_kv_heads, b_q=b_q,
                     b_k=b_k, b_v=b_v, b_o=b_o, w_gate=w_gate, b_gate=b_gate,
                     core_checks_next=True, **options)
    _check_cache(cache, call)
    counts = _new_lengths(new_lengths, call.B, call.Tq, call.causal)
    rope = call.var.rotary_dim > 0
    _check_step_memory(call, cache.capacity, want_w, rope)
    dk, dv, scales = head_arrays(call)
    variants = variant_args(call)
    scores_only = _scores_only(call.var)
    fused = (call.wq.fused(), call.wk.fused(), call.wv.fused(), _fused_bias(call.bq),
             _fused_bias(call.bk), _fused_bias(call.bv))
    capsules = None if packed is None else packed._core_packed(call.dtype)
    B, Tq, H, G = call.B, call.Tq, call.H, call.G
    every = np.full(B, Tq, np.int64)
    with cache._lock:
        cache.check_room(every, "x")
        if rope:
            # RoPE turns the new rows at their places in the cache, lengths[b]
            # + i: the variants' positions and key_positions.
            pos = cache._lengths[:, np.newaxis] + np.arange(Tq, dtype=np.int64)
            variants = variants_tuple_of(dataclasses.replace(call.var, positions=pos,
                                                             key_positions=pos))
        q, k, v = core.project(call.x, call.key, call.value, *fused, dk, dv, scales,
                               variants, capsules)
        q4 = q.reshape(B, Tq, H, cache.d_k).swapaxes(1, 2)
        k4 = k.reshape(B, Tq, G, cache.d_k).swapaxes(1, 2)
        v4 = v.reshape(B, Tq, G, cache.d_v).swapaxes(1, 2)
        before = cache._lengths.copy()
        try:
            # Every new row is written and attended at lengths[b] + i, so the
            # real rows sit where they belong; with new_lengths the padding
            # rows are then dropped from the lengths (causal: no real query
            # saw them).
            cache._write(k4, v4, every)
            # A half or int8 storage is read as it is (the kernels widen it).
            concat, weights, _ = core.attention_in_layer_words(
                q4, cache.key_storage, cache.value_storage, scales, None, call.causal,
                cache._lengths.copy(), scores_only, True,
                True, want_w, False, cache.key_scales, cache.value_scales)
        except BaseException:
            cache._lengths[:] = before    # a failed (or interrupted) step appends nothing
            raise
        if counts is not None:
            cache._lengths[:] = before + counts
    if counts is not None:
        concat[np.arange(Tq)[np.newaxis, :] >= counts[:, np.newaxis]] = 0
        if weights is not None:
            weights[np.arange(Tq)[np.newaxis, :] >= counts[:, np.newaxis]] = 0
    out = concat.reshape(B, Tq, H * cache.d_v)
    if call.w_gate is not None:
        out = _output_gate(call) * out
    if call.w_o is not None:
        out = out @ call.w_o
    if call.b_o is not None:
        out = out + call.b_o
    if counts is not None:
        out[np.arange(Tq)[np.newaxis, :] >= counts[:, np.newaxis]] = 0
    out = call.unbatch(np.ascontiguousarray(out))
    if call.out_dtype != call.dtype:      # half x: rounded once
        out, weights = narrow(out, call.out_dtype), narrow_like(weights, call.out_dtype)
    return (out, call.unbatch(weights)) if want_w else out
