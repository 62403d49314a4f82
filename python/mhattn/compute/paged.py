"""A paged key/value cache (issue 39, item 4), and the steps that read it.

:class:`PagedKVCache` holds the keys and values of many sequences in one
pool of fixed-size pages, as vLLM's PagedAttention and FlashAttention's
``flash_attn_with_kvcache(block_table=...)`` do: key pages (num_pages, G,
page_size, d_k), value pages (num_pages, G, page_size, d_v), and per
sequence the list of pages it holds, in order.  A sequence takes a page
from the free pool when its last one is full and gives all of them back
when it is freed, so sequences of very different lengths share one pool
without each reserving the longest one's capacity.

The core reads the pages in place through a block table (csrc/mha.h,
``mha_config.block_table``): key j of a sequence is row j % page_size of
its page j // page_size.  The key blocks, their order and every sum are
those of a :class:`KVCache` holding the same tokens, so a step gives the
same bits (tests/test_paged_cache.py).

:func:`paged_step` is ``multi_head_attention(x_new, ..., cache=paged,
sequence_ids=ids)`` (project, append, attend, W^O, as
:func:`mhattn.compute.cache.cached_step`), and :func:`paged_attention` is
``attention(q, [k_new, v_new,] cache=paged, sequence_ids=ids)``.  Letters
follow ``csrc/mha.h``; n is the number of sequences of a call.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
from types import SimpleNamespace
from typing import Any, List, Optional

import numpy as np

from .._internal import core
from .._internal.args import (_scale_arg, _to_array, bool_arg, check_memory, head_scales,
                              normalize)
from .._internal.core import _fused_bias, head_arrays, variant_args
from .._internal.half import is_bfloat16, is_half, narrow, narrow_like
from .._internal.variants import normalize_variants, variants_tuple_of
from .cache import (_F32, _F64, _I8, _NOT_WITH_CACHE, _check_step_memory, _dtype,
                    _check_fits, _new_lengths, _output_gate, _quantise, _rows_of, _scores_only,
                    _size)

__all__ = ["PagedKVCache", "paged_step", "paged_attention"]

# Sequence ids come from one counter for every cache of the process, so an
# id that one cache issued is never another's: a foreign id is told apart
# from a freed one (next() on a count is atomic under the GIL).
_IDS = itertools.count()


def _pool_items(P: int, G: int, ps: int, dk: int, dv: int, itemsize: int,
                scales: bool) -> list:
    """What a PagedKVCache allocates, as check_memory items (its nbytes)."""
    items = [("the key pages", "num_pages*num_kv_heads*page_size*d_k", (P, G, ps, dk),
              itemsize),
             ("the value pages", "num_pages*num_kv_heads*page_size*d_v", (P, G, ps, dv),
              itemsize)]
    if scales:
        items += [("the key scales", "num_pages*num_kv_heads*page_size", (P, G, ps), 4),
                  ("the value scales", "num_pages*num_kv_heads*page_size", (P, G, ps), 4)]
    return items


class PagedKVCache:
    """A key/value cache in fixed-size pages, shared by many sequences.

    PagedKVCache(num_pages, page_size, num_kv_heads, d_k, d_v=None, dtype=np.float32)

    Parameters
    ----------
    num_pages : int
        P, the pages of the pool (every sequence's keys together).
    page_size : int
        The keys per page (any positive size).  On a CPU, 64 or more:
        the kernels read a page's rows as one run of memory, and runs of a
        few KiB scattered in the pool cost memory time (a decode step of 64
        sequences whose 16-key pages are all apart took 1.5 to 1.7 times a
        KVCache's; with 128-key pages, 1.06 to 1.1; benchmarks/bench_paged.py).
    num_kv_heads : int
        G, the number of key/value heads (the layer's ``num_kv_heads``).
    d_k, d_v : int
        Head widths of the keys and values; d_v defaults to d_k.
    dtype : np.float32 (default), np.float64, np.float16, ml_dtypes.bfloat16 or "int8"
        The pages' dtype, as :class:`mhattn.KVCache`'s: a float16,
        bfloat16 or int8 cache computes in float32 and stores each appended
        row rounded once to nearest even, or quantised (int8: one float32
        scale per token and kv head, :class:`mhattn.KVCache`'s Notes).

    Attributes
    ----------
    key_pages : (P, G, page_size, d_k) array of the cache's dtype
        The pool; key j of sequence s is ``key_pages[pages(s)[j //
        page_size], :, j % page_size]``.  Rows past a sequence's length and
        free pages are stale and never read.  A view of a (G, P,
        page_size, d_k) array: each kv head's pages lie together, so that
        the pages a sequence takes one after another are one run of
        memory for the task that reads that head.
    value_pages : (P, G, page_size, d_v) array
    key_scales, value_scales : (P, G, page_size) float32, or None
        An int8 cache's scales (laid out as the pages); None otherwise.
    nbytes : int
        The memory held by the pools: P * G * page_size * (d_k + d_v) *
        itemsize (plus P * G * page_size * 8 for an int8 cache's scales),
        allocated once, at construction (a MemoryError naming the sizes,
        before anything is allocated, when that is more than the machine's
        memory).
    pages_in_use, pages_free : int
        Pages held by live sequences, and pages in the free pool.

    Notes
    -----
    :meth:`add_sequence` issues a new id (an int, never reused, unique
    across every cache of the process); :meth:`append` writes new keys and
    values of any subset of sequences, taking pages from the free pool as
    their last pages fill; :meth:`free` gives a sequence's pages back.
    ``multi_head_attention(x_new, ..., cache=cache, sequence_ids=ids)``
    is one decoder step for the sequences ``ids`` (prefill or decode:
    project, append, attend, W^O), and ``attention(q, cache=cache,
    sequence_ids=ids)`` attends projected queries over their cached keys
    (with ``k``, ``v`` given, after appending them).  Sequence ids[i] is
    row i of the call's batch.

    The core reads the pages where they are, through a block table
    (csrc/mha.h, ``block_table``); a step gives the bits of a
    :class:`mhattn.KVCache` holding the same tokens, in every dtype.

    Errors: a call that raises leaves the cache as it was: no token
    written, no page taken or given back.  Too few free pages for an
    append or step is a MemoryError naming the argument, with the pages
    needed and free; a freed (stale) id, an id this cache never issued, a
    duplicated id, or new rows of the wrong shape or dtype are ValueErrors
    naming the argument.  No gradient flows through a cache.

    Thread safety: as :class:`mhattn.KVCache`, one lock per cache held by
    each :meth:`add_sequence`, :meth:`append`, :meth:`free` and step from
    its checks to its last write (a step until it has attended).  The
    pools are read without it: read them while no other thread writes.
    It pickles and copies (every page and the sequences' tables; a copy has
    its own pool and lock; ids stay valid in the copy).

    Examples
    --------
    >>> cache = mhattn.PagedKVCache(num_pages=8, page_size=4, num_kv_heads=2, d_k=8)
    >>> a, b = cache.add_sequence(), cache.add_sequence()
    >>> k = np.ones((2, 2, 5, 8), np.float32)              # 5 tokens for each
    >>> cache.append([a, b], k, k)
    >>> cache.lengths([a, b]), cache.pages_in_use         # 5 tokens: 2 pages each
    (array([5, 5]), 4)
    >>> cache.append([b], k[:1, :, :3], k[:1, :, :3])     # 3 more for b only
    >>> cache.length(b), cache.pages_in_use
    (8, 4)
    >>> cache.free(a)
    >>> cache.pages_in_use, cache.pages_free
    (2, 6)
    >>> cache.nbytes                                      # 8*2*4*(8 + 8)*4
    4096
    """

    def __init__(self, num_pages, page_size, num_kv_heads, d_k, d_v=None, dtype=np.float32):
        P, ps = _size("num_pages", num_pages), _size("page_size", page_size)
        G, dk = _size("num_kv_heads", num_kv_heads), _size("d_k", d_k)
        dv = dk if d_v is None else _size("d_v", d_v)
        if P > 2**31 - 1:
            # The block table is int32 (as vLLM's and FlashAttention's).
            raise ValueError(f"num_pages: at most 2**31 - 1 pages (int32 page ids), got {P}")
        dt = _dtype(dtype)
        int8 = dt == _I8
        check_memory(_pool_items(P, G, ps, dk, dv, dt.itemsize, int8))
        # Head-major: each kv head's pages lie together, (G, P, ps, d), and
        # the pools are its (P, G, ps, d) views.  A step's task reads one kv
        # head, and the pages a sequence takes one after another are then
        # one run of memory; page-major (P, G, ps, d), a 16-row page of one
        # head is 4 KiB between the other heads' (bench_paged.py: a decode
        # step took 1.5 times a KVCache's at page_size 16, G = 2, against
        # 1.1 head-major).  The core reads any strides in place.
        self.key_pages = np.zeros((G, P, ps, dk), dt).swapaxes(0, 1)
        self.value_pages = np.zeros((G, P, ps, dv), dt).swapaxes(0, 1)
        self.key_scales = np.zeros((G, P, ps), _F32).swapaxes(0, 1) if int8 else None
        self.value_scales = np.zeros((G, P, ps), _F32).swapaxes(0, 1) if int8 else None
        self._compute = _F64 if dt == _F64 else _F32
        # The free pool, a stack: the lowest page is taken first.
        self._free = list(range(P - 1, -1, -1))
        # Each live sequence's pages in order, and its length.
        self._pages: dict = {}
        self._len: dict = {}
        self._freed: set = set()     # ids this cache issued and freed
        self._lock = threading.Lock()

    # -- sizes ----------------------------------------------------------------

    num_pages = property(lambda self: self.key_pages.shape[0], doc="P")
    page_size = property(lambda self: self.key_pages.shape[2], doc="keys per page")
    num_kv_heads = property(lambda self: self.key_pages.shape[1], doc="G")
    d_k = property(lambda self: self.key_pages.shape[3], doc="key width")
    d_v = property(lambda self: self.value_pages.shape[3], doc="value width")
    dtype = property(lambda self: self.key_pages.dtype,
                     doc="the pages': float32, float64, float16, bfloat16 or int8")
    pages_free = property(lambda self: len(self._free), doc="pages in the free pool")

    @property
    def pages_in_use(self) -> int:
        """Pages held by live sequences: sum of ceil(length / page_size).

        Examples
        --------
        >>> cache = mhattn.PagedKVCache(4, 2, 1, 4)
        >>> s = cache.add_sequence()
        >>> kv = np.zeros((1, 1, 3, 4), np.float32)
        >>> cache.append([s], kv, kv)
        >>> cache.pages_in_use
        2
        """
        return self.num_pages - len(self._free)

    @property
    def nbytes(self) -> int:
        """Bytes held by the pools (and an int8 cache's scales).

        Examples
        --------
        >>> mhattn.PagedKVCache(16, 16, 2, 8).nbytes      # 16*2*16*(8 + 8)*4
        32768
        """
        n = self.key_pages.nbytes + self.value_pages.nbytes
        if self.key_scales is not None:
            n += self.key_scales.nbytes + self.value_scales.nbytes
        return n

    @property
    def sequences(self) -> tuple:
        """The live sequences' ids, in the order they were added.

        Examples
        --------
        >>> cache = mhattn.PagedKVCache(4, 2, 1, 4)
        >>> a, b = cache.add_sequence(), cache.add_sequence()
        >>> cache.free(a)
        >>> cache.sequences == (b,)
        True
        """
        return tuple(self._len)

    # -- sequences ----------------------------------------------------------------

    def add_sequence(self) -> int:
        """A new, empty sequence: its id, an int this cache alone issues.

        Returns
        -------
        int
            The sequence's id, for :meth:`append`, the attention calls'
            ``sequence_ids`` and :meth:`free`.

        Examples
        --------
        >>> cache = mhattn.PagedKVCache(4, 2, 1, 4)
        >>> s = cache.add_sequence()
        >>> cache.length(s), cache.pages_in_use
        (0, 0)
        """
        with self._lock:
            sid = next(_IDS)
            self._pages[sid] = []
            self._len[sid] = 0
            return sid

    @staticmethod
    def _int_id(name: str, sid: Any) -> int:
        """sid as an int; TypeError naming ``name`` otherwise."""
        if isinstance(sid, (bool, np.bool_)) or not isinstance(sid, (int, np.integer)):
            raise TypeError(f"{name}: expected a sequence id (an int from add_sequence), got "
                            f"{type(sid).__name__}")
        return int(sid)

    def _id(self, name: str, sid: Any) -> int:
        """sid as a live id of this cache; ValueError / TypeError naming
        ``name`` for a freed one, one never issued here, or a non-int."""
        sid = self._int_id(name, sid)
        if sid in self._len:
            return sid
        if sid in self._freed:
            raise ValueError(f"{name}: sequence {sid} was freed (a stale id); add_sequence() "
                             f"issues a new one")
        raise ValueError(f"{name}: {sid} is not a sequence of this cache (never issued by "
                         f"its add_sequence; another cache's id?)")

    @classmethod
    def _id_list(cls, ids: Any, name: str = "sequence_ids") -> List[int]:
        """ids (an int or a 1-D sequence of ints) as a list of distinct ints;
        errors name ``name``.  No lock: it reads only the caller's object
        (whose __index__ or __array__ may run any code)."""
        if isinstance(ids, (int, np.integer)) and not isinstance(ids, (bool, np.bool_)):
            ids = [ids]
        try:
            a = np.asarray(ids)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name}: expected a list of sequence ids, got "
                            f"{type(ids).__name__} ({e})") from None
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iuO"):
            raise TypeError(f"{name}: expected a 1-D list of sequence ids (ints), got "
                            f"{a.dtype} of shape {a.shape}")
        out = [cls._int_id(name, s) for s in a.tolist()]
        if len(set(out)) != len(out):
            dup = next(s for s in out if out.count(s) > 1)
            raise ValueError(f"{name}: sequence {dup} is listed more than once in one call")
        return out

    def _live(self, ids: List[int], name: str = "sequence_ids") -> List[int]:
        """ids (from _id_list), each a live id of this cache (the caller
        holds the lock, or reads without writing)."""
        for s in ids:
            self._id(name, s)
        return ids

    def _ids(self, ids: Any, name: str = "sequence_ids") -> List[int]:
        """_live(_id_list(ids))."""
        return self._live(self._id_list(ids, name), name)

    def length(self, sequence_id) -> int:
        """How many keys the sequence holds.

        Parameters
        ----------
        sequence_id : int
            A live id of this cache (from :meth:`add_sequence`); a freed or
            foreign one raises ValueError naming sequence_id.

        Returns
        -------
        int
            Its keys, 0 for a new sequence.

        Examples
        --------
        >>> cache = mhattn.PagedKVCache(4, 2, 1, 4)
        >>> s = cache.add_sequence()
        >>> kv = np.zeros((1, 1, 3, 4), np.float32)
        >>> cache.append([s], kv, kv)
        >>> cache.length(s)
        3
        """
        return self._len[self._id("sequence_id", sequence_id)]

    def lengths(self, sequence_ids) -> np.ndarray:
        """(n,) int64: the lengths of the listed sequences, in order.

        Parameters
        ----------
        sequence_ids : sequence of int
            Live ids of this cache, each at most once; a freed, foreign or
            repeated one raises ValueError naming sequence_ids.

        Returns
        -------
        (n,) int64 ndarray
            Each sequence's keys.

        Examples
        --------
        >>> cache = mhattn.PagedKVCache(4, 2, 1, 4)
        >>> a, b = cache.add_sequence(), cache.add_sequence()
        >>> cache.lengths([b, a])
        array([0, 0])
        """
        return np.array([self._len[s] for s in self._ids(sequence_ids)], np.int64)

    def pages(self, sequence_id) -> np.ndarray:
        """(ceil(length / page_size),) int32: the sequence's pages, in order
        (a copy).

        Parameters
        ----------
        sequence_id : int
            A live id of this cache (from :meth:`add_sequence`); a freed or
            foreign one raises ValueError naming sequence_id.

        Returns
        -------
        (ceil(length / page_size),) int32 ndarray
            Its pages' numbers in the pools, in the order of its keys.

        Examples
        --------
        >>> cache = mhattn.PagedKVCache(4, 2, 1, 4)
        >>> s = cache.add_sequence()
        >>> kv = np.zeros((1, 1, 3, 4), np.float32)
        >>> cache.append([s], kv, kv)
        >>> cache.pages(s)
        array([0, 1], dtype=int32)
        """
        return np.array(self._pages[self._id("sequence_id", sequence_id)], np.int32)

    def free(self, sequence_id) -> None:
        """Give the sequence's pages back to the pool; its id becomes stale.

        Parameters
        ----------
        sequence_id : int
            A live id of this cache (from :meth:`add_sequence`); a freed or
            foreign one raises ValueError naming sequence_id.

        Examples
        --------
        >>> cache = mhattn.PagedKVCache(4, 2, 1, 4)
        >>> s = cache.add_sequence()
        >>> kv = np.zeros((1, 1, 3, 4), np.float32)
        >>> cache.append([s], kv, kv)
        >>> cache.free(s)
        >>> cache.pages_in_use
        0
        """
        with self._lock:
            sid = self._id("sequence_id", sequence_id)
            self._free.extend(reversed(self._pages.pop(sid)))
            del self._len[sid]
            self._freed.add(sid)

    def block_table(self, sequence_ids) -> np.ndarray:
        """(n, max pages) int32: row i the pages of sequence_ids[i], padded
        with page 0 (never read: past the sequence's length).  What the
        core is given (a copy).

        Parameters
        ----------
        sequence_ids : sequence of int
            Live ids of this cache, each at most once; a freed, foreign or
            repeated one raises ValueError naming sequence_ids.

        Returns
        -------
        (n, max pages) int32 ndarray
            Row i holds sequence_ids[i]'s pages, then page 0.

        Examples
        --------
        >>> cache = mhattn.PagedKVCache(4, 2, 1, 4)
        >>> a, b = cache.add_sequence(), cache.add_sequence()
        >>> kv = np.zeros((2, 1, 3, 4), np.float32)
        >>> cache.append([a, b], kv, kv, lengths=[3, 1])
        >>> cache.block_table([a, b])
        array([[0, 1],
               [2, 0]], dtype=int32)
        """
        with self._lock:
            return self._table(self._ids(sequence_ids))

    def _table(self, ids: List[int]) -> np.ndarray:
        # One pass over the pages (thousands for 64 long sequences of
        # 16-key pages): a row per sequence, padded with page 0.
        rows = [self._pages[s] for s in ids]
        counts = np.fromiter(map(len, rows), np.intp, len(rows))
        bt = np.zeros((len(ids), max(int(counts.max(initial=0)), 1)), np.int32)
        bt[np.arange(bt.shape[1]) < counts[:, np.newaxis]] = np.fromiter(
            itertools.chain.from_iterable(rows), np.int32, int(counts.sum()))
        return bt

    def __repr__(self) -> str:
        return (f"PagedKVCache(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"num_kv_heads={self.num_kv_heads}, d_k={self.d_k}, d_v={self.d_v}, "
                f"dtype={self.dtype.name}, sequences={len(self._len)}, "
                f"pages_in_use={self.pages_in_use})")

    # -- pickling and copying: every page, the tables, a new lock -----------------

    def __getstate__(self) -> dict:
        with self._lock:
            state = {"shape": (self.num_pages, self.page_size, self.num_kv_heads, self.d_k,
                               self.d_v),
                     "dtype": self.dtype.name if is_bfloat16(self.dtype) else self.dtype.str,
                     "key_pages": self.key_pages.copy(),
                     "value_pages": self.value_pages.copy(),
                     "free": list(self._free),
                     "pages": {s: list(p) for s, p in self._pages.items()},
                     "lengths": dict(self._len), "freed": set(self._freed)}
            if self.key_scales is not None:
                state["key_scales"] = self.key_scales.copy()
                state["value_scales"] = self.value_scales.copy()
            return state

    def __setstate__(self, state: dict) -> None:
        P, ps, G, dk, dv = state["shape"]
        self.__init__(P, ps, G, dk, dv, _dtype(state["dtype"]))
        self.key_pages[...] = state["key_pages"]
        self.value_pages[...] = state["value_pages"]
        if self.key_scales is not None:
            self.key_scales[...] = state["key_scales"]
            self.value_scales[...] = state["value_scales"]
        self._free = list(state["free"])
        self._pages = {int(s): list(p) for s, p in state["pages"].items()}
        self._len = {int(s): int(n) for s, n in state["lengths"].items()}
        self._freed = set(state["freed"])
        # Ids issued after the copy must not collide with the copy's own
        # (the counter of another process starts again at 0).
        global _IDS
        _IDS = itertools.count(max([next(_IDS)] + [s + 1 for s in self._len] +
                                   [s + 1 for s in self._freed]))

    # -- writing ----------------------------------------------------------------

    def _check_new(self, name: str, a: Any, n: int, width: int, what: str) -> np.ndarray:
        a = _to_array(name, a)
        G = self.num_kv_heads
        want = f"(n, G, T_new, {what}) = ({n}, {G}, T_new, {width})"
        if a.ndim != 4 or a.shape[0] != n or a.shape[1] != G or a.shape[3] != width:
            raise ValueError(f"{name}: expected shape {want} (n = the sequences listed) for "
                             f"{self!r}, got {a.shape}")
        return _rows_of(name, a, self.dtype, self._compute)

    def _encode(self, a: np.ndarray):
        """As KVCache._encode: rows as the pages hold them, and int8 scales."""
        if self.dtype == _I8:
            return _quantise(a)
        if a.dtype != self.dtype:
            return narrow(a, self.dtype), None
        return a, None

    def _check_room(self, ids: List[int], counts, name: str) -> None:
        """MemoryError naming ``name``, changing nothing, unless the free pool
        holds the pages that counts[i] more keys of each ids[i] need."""
        ps = self.page_size
        need = sum(max(0, -(-(self._len[s] + int(c)) // ps) - len(self._pages[s]))
                   for s, c in zip(ids, counts))
        if need > len(self._free):
            raise MemoryError(f"{name}: appending {int(sum(int(c) for c in counts))} keys to "
                              f"{len(ids)} sequences needs {need} more pages of "
                              f"{ps} keys, but only {len(self._free)} of the cache's "
                              f"num_pages={self.num_pages} are free; the cache is unchanged "
                              f"(free a sequence, or make the cache larger)")

    def _write(self, ids: List[int], k: np.ndarray, v: np.ndarray, counts) -> None:
        """Write checked new rows: counts[i] rows of k[i], v[i] after
        sequence ids[i]'s last, taking pages from the pool.  The caller
        holds the lock and has checked the room (_check_room)."""
        (k, k_sc), (v, v_sc) = self._encode(k), self._encode(v)
        ps = self.page_size
        pg, rw, src_i, src_t = [], [], [], []
        for i, (s, c) in enumerate(zip(ids, counts)):
            c = int(c)
            if c == 0:
                continue
            pages, start = self._pages[s], self._len[s]
            while len(pages) * ps < start + c:
                pages.append(self._free.pop())
            j = np.arange(start, start + c)
            pg.append(np.asarray(pages, np.intp)[j // ps])
            rw.append(j % ps)
            src_i.append(np.full(c, i))
            src_t.append(np.arange(c))
            self._len[s] = start + c
        if not pg:
            return
        pg, rw = np.concatenate(pg), np.concatenate(rw)
        si, st = np.concatenate(src_i), np.concatenate(src_t)
        # One assignment per pool: rows (N, G, d) from (n, G, T, d).
        self.key_pages[pg, :, rw] = k[si, :, st]
        self.value_pages[pg, :, rw] = v[si, :, st]
        if k_sc is not None:
            self.key_scales[pg, :, rw] = k_sc[si, :, st]
            self.value_scales[pg, :, rw] = v_sc[si, :, st]

    def _truncate(self, ids: List[int], lengths) -> None:
        """Shorten each ids[i] to lengths[i] keys, giving back the pages it
        no longer needs (a failed step's, or a ragged step's padding)."""
        ps = self.page_size
        for s, n in zip(ids, lengths):
            n = int(n)
            keep = -(-n // ps)
            pages = self._pages[s]
            while len(pages) > keep:
                self._free.append(pages.pop())
            self._len[s] = n

    def append(self, sequence_ids, k_new, v_new, *, lengths=None) -> None:
        """Write new keys and values after each listed sequence's last.

        Parameters
        ----------
        sequence_ids : int or list of n ints
            Live sequences of this cache (from :meth:`add_sequence`), each
            at most once; row i of k_new and v_new goes to sequence_ids[i].
        k_new : (n, G, T_new, d_k), of the cache's dtype (or float32 for a half or int8 cache)
        v_new : (n, G, T_new, d_v), as k_new
        lengths : (n,) ints in [0, T_new], optional
            A ragged append: sequence i takes only its first lengths[i] new
            rows.  Default: all T_new rows for every sequence.

        Raises
        ------
        ValueError, TypeError
            Naming the argument, with the cache unchanged: a freed, foreign
            or repeated id, a wrong shape, dtype, head count or width.
        MemoryError
            When the free pool lacks the pages the rows need (the pages
            needed and free are named), with the cache unchanged.

        Examples
        --------
        >>> cache = mhattn.PagedKVCache(8, 4, 1, 4)
        >>> a, b = cache.add_sequence(), cache.add_sequence()
        >>> kv = np.zeros((2, 1, 3, 4), np.float32)
        >>> cache.append([a, b], kv, kv, lengths=[3, 1])
        >>> cache.lengths([a, b])
        array([3, 1])
        """
        # The caller's objects are converted and checked before the lock is
        # taken (as KVCache.append): none of their code runs while others wait.
        ids = self._id_list(sequence_ids)
        n = len(ids)
        k = self._check_new("k_new", k_new, n, self.d_k, "d_k")
        v = self._check_new("v_new", v_new, n, self.d_v, "d_v")
        T = k.shape[2]
        if v.shape[2] != T:
            raise ValueError(f"v_new: has {v.shape[2]} rows but k_new has {T}")
        counts = np.full(n, T, np.int64)
        if lengths is not None:
            c = _to_array("lengths", lengths)
            if c.dtype.kind not in "iu" or c.shape != (n,):
                raise ValueError(f"lengths: expected ({n},) integers, got "
                                 f"{c.dtype} {c.shape}")
            if (c < 0).any() or (c > T).any():
                raise ValueError(f"lengths: each must lie in [0, T_new={T}], got "
                                 f"{c.tolist()}")
            counts = c.astype(np.int64)
        with self._lock:
            self._live(ids)
            self._check_room(ids, counts, "k_new")
            self._write(ids, k, v, counts)

    # -- attending ----------------------------------------------------------------

    def _attend(self, ids: List[int], q4: np.ndarray, scales, causal: bool, variants,
                want_w: bool, want_lse: bool = False, out_bthd: bool = True):
        """The core's attention of q4 (n, H, T_new, d_k) over the listed
        sequences' keys, through their block table (the lock is held): out
        (n, T_new, H, d_v) for the layer's step (out_bthd), else (n, H,
        T_new, d_v)."""
        lens = np.array([self._len[s] for s in ids], np.int64)
        return core.attention_in_layer_words(
            q4, self.key_pages, self.value_pages, scales, None, causal, lens, variants,
            True, out_bthd, want_w, want_lse, self.key_scales, self.value_scales,
            self._table(ids))


def _check_paged(cache: PagedKVCache, call) -> None:
    """The cache must fit the call: ValueError naming ``cache`` otherwise."""
    _check_fits(cache, call, [])


def paged_step(x, w_q, w_k, w_v, w_o, *, cache, sequence_ids, num_heads=None, scale=None,
               return_weights=False, causal=False, num_kv_heads=None, b_q=None, b_k=None,
               b_v=None, b_o=None, return_context=False, new_lengths=None, packed=None,
               w_gate=None, b_gate=None, **options):
    """One step of multi_head_attention through a :class:`PagedKVCache`:
    ``multi_head_attention(x_new, ..., cache=cache, sequence_ids=ids)``.

    As :func:`mhattn.compute.cache.cached_step`, row i of x (n, T_new, d_in)
    belonging to sequence ids[i]: 1. project the new rows (q_norm, k_norm,
    RoPE at positions length(ids[i]) + t); 2. append their keys and values
    (taking pages from the pool); 3. attend from the new queries over each
    sequence's keys through the block table, aligned bottom-right
    (``causal=True`` for a prefill); 4. the output gate and W^O.
    ``new_lengths`` (n,) makes it ragged (causal only): sequence i keeps
    only its first new_lengths[i] rows, the others' outputs are 0 and their
    pages go back to the pool.  Returns out (n, T_new, d_out) (and the
    weights (n, H, T_new, max length) with ``return_weights``).  On any
    error the cache is unchanged; too few free pages is a MemoryError
    naming ``x``.
    """
    for name in _NOT_WITH_CACHE:
        if options.get(name) is not None:
            raise ValueError(f"{name}: not with cache= (the keys are the cache's, at "
                             "positions length + i)")
    if bool_arg("return_context", return_context):
        raise ValueError("return_context: no gradients flow through a KV cache")
    want_w = bool_arg("return_weights", return_weights)
    xa = _to_array("x", x)
    if xa.ndim == 2:
        xa = xa[np.newaxis]    # one sequence's rows
    call = normalize(xa, w_q, w_k, w_v, w_o, num_heads=num_heads, scale=scale,
                     causal=causal, num_kv_heads=num_kv_heads, b_q=b_q, b_k=b_k, b_v=b_v,
                     b_o=b_o, w_gate=w_gate, b_gate=b_gate, core_checks_next=True,
                     **options)
    _check_paged(cache, call)
    counts = _new_lengths(new_lengths, call.B, call.Tq, call.causal)
    rope = call.var.rotary_dim > 0
    dk, dv, scales = head_arrays(call)
    variants = variant_args(call)
    scores_only = _scores_only(call.var)
    fused = (call.wq.fused(), call.wk.fused(), call.wv.fused(), _fused_bias(call.bq),
             _fused_bias(call.bk), _fused_bias(call.bv))
    capsules = None if packed is None else packed._core_packed(call.dtype)
    B, Tq, H, G = call.B, call.Tq, call.H, call.G
    ids = PagedKVCache._id_list(sequence_ids)
    if len(ids) != B:
        raise ValueError(f"sequence_ids: {len(ids)} sequences listed but x holds {B} "
                         f"(x {xa.shape}: row i of x is sequence_ids[i])")
    with cache._lock:
        cache._live(ids)
        before = np.array([cache._len[s] for s in ids], np.int64)
        longest = int(before.max(initial=0)) + Tq
        _check_step_memory(call, -(-longest // cache.page_size) * cache.page_size, want_w,
                           rope)
        every = np.full(B, Tq, np.int64)
        cache._check_room(ids, every, "x")
        if rope:
            pos = before[:, np.newaxis] + np.arange(Tq, dtype=np.int64)
            variants = variants_tuple_of(dataclasses.replace(call.var, positions=pos,
                                                             key_positions=pos))
        q, k, v = core.project(call.x, call.key, call.value, *fused, dk, dv, scales,
                               variants, capsules)
        q4 = q.reshape(B, Tq, H, cache.d_k).swapaxes(1, 2)
        k4 = k.reshape(B, Tq, G, cache.d_k).swapaxes(1, 2)
        v4 = v.reshape(B, Tq, G, cache.d_v).swapaxes(1, 2)
        try:
            cache._write(ids, k4, v4, every)
            concat, weights, _ = cache._attend(ids, q4, scales, call.causal, scores_only,
                                               want_w)
        except BaseException:
            cache._truncate(ids, before)   # a failed (or interrupted) step appends nothing
            raise
        if counts is not None:
            cache._truncate(ids, before + counts)
        if weights is not None:
            weights = weights[..., :int(max(cache._len[s] for s in ids))]
    if counts is not None:
        pad = np.arange(Tq)[np.newaxis, :] >= counts[:, np.newaxis]
        concat[pad] = 0
        if weights is not None:
            weights[pad] = 0
    out = concat.reshape(B, Tq, H * cache.d_v)
    if call.w_gate is not None:
        out = _output_gate(call) * out
    if call.w_o is not None:
        out = out @ call.w_o
    if call.b_o is not None:
        out = out + call.b_o
    if counts is not None:
        out[np.arange(Tq)[np.newaxis, :] >= counts[:, np.newaxis]] = 0
    out = np.ascontiguousarray(out)
    if call.out_dtype != call.dtype:      # half x: rounded once
        out, weights = narrow(out, call.out_dtype), narrow_like(weights, call.out_dtype)
    return (out, weights) if want_w else out


def paged_attention(q, k_new, v_new, *, cache, sequence_ids, scale=None, causal=False,
                    return_weights=False, return_lse=False, variants=None,
                    layout="bhtd"):
    """``attention(q, [k_new, v_new,] cache=cache, sequence_ids=ids)``: q (n,
    H, T_new, d_k) of the cache's compute dtype, row i of sequence ids[i].
    With k_new, v_new (n, G, T_new, d) they are appended first (as
    :meth:`PagedKVCache.append`, under the same lock); then each query
    attends over its sequence's keys, aligned bottom-right (query t of
    sequence i at length - T_new + t).  ``variants`` holds attention's score
    keywords (window, softcap, alibi_slopes, sinks, ...).  Returns what :func:`mhattn.attention`
    returns, the weights (n, H, T_new, max length)."""
    want_w = bool_arg("return_weights", return_weights)
    want_lse = bool_arg("return_lse", return_lse)
    if layout != "bhtd":
        raise ValueError(f"layout: with cache=, q is (n, H, T_new, d_k) ('bhtd'), got "
                         f"{layout!r}")
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a mhattn.PagedKVCache, got {type(cache).__name__}")
    if (k_new is None) != (v_new is None):
        raise ValueError(f"{'v' if v_new is None else 'k'}: with cache=, k and v are the new "
                         f"rows to append, both or neither")
    qa = _to_array("q", q)
    if qa.ndim != 4 or qa.shape[3] != cache.d_k or qa.shape[1] % cache.num_kv_heads:
        raise ValueError(f"q: expected shape (n, H, T_new, d_k) with d_k = {cache.d_k} and H "
                         f"a multiple of the cache's {cache.num_kv_heads} kv heads, got "
                         f"{qa.shape}")
    if qa.dtype != cache._compute:
        raise ValueError(f"q: dtype {qa.dtype}, but the cache computes in {cache._compute}; "
                         f"pass q.astype(np.{cache._compute.name})")
    n, H, Tq = qa.shape[:3]
    scales = np.asarray(head_scales(H, H, [cache.d_k] * H, _scale_arg(scale)), np.float64)
    causal = bool_arg("causal", causal)
    ids = PagedKVCache._id_list(sequence_ids)
    if len(ids) != n:
        raise ValueError(f"sequence_ids: {len(ids)} sequences listed but q holds {n} "
                         f"(q {qa.shape}: row i of q is sequence_ids[i])")
    k = None if k_new is None else cache._check_new("k", k_new, len(ids), cache.d_k, "d_k")
    v = None if v_new is None else cache._check_new("v", v_new, len(ids), cache.d_v, "d_v")
    var = None
    if variants and any(a is not None for a in variants.values()):
        # The score rules' checks as attention's (Tk: the longest sequence
        # after this call's rows; the core checks again with its own).
        ids0 = cache._live(ids)
        Tk = max([cache._len[s] for s in ids0] + [0]) + (0 if k_new is None else Tq)
        G = cache.num_kv_heads
        var = variant_args(SimpleNamespace(var=normalize_variants(
            variants, batched=True, B=n, Tq=Tq, Tk=max(Tk, 1), H=H, G=G,
            dk=[cache.d_k] * G, dtype=cache._compute, key_given=True, names=("q", "k"))))
    with cache._lock:
        cache._live(ids)
        before = np.array([cache._len[s] for s in ids], np.int64)
        if k is not None:
            if k.shape[2] != Tq or v.shape[2] != Tq:
                raise ValueError(f"k, v: hold {k.shape[2]} and {v.shape[2]} new rows, but q "
                                 f"holds T_new = {Tq}")
            cache._check_room(ids, np.full(n, Tq), "k")
            cache._write(ids, k, v, np.full(n, Tq))
        try:
            out, weights, lse = cache._attend(ids, qa, scales, causal, var, want_w,
                                              want_lse, out_bthd=False)
        except BaseException:
            cache._truncate(ids, before)
            raise
        if weights is not None:
            weights = weights[..., :int(max(cache._len[s] for s in ids))]
    res = (out,) + ((weights,) if want_w else ()) + ((lse,) if want_lse else ())
    return res[0] if len(res) == 1 else res
