"""mhattn.BlockMask: which keys each query sees, stored block by block.

The queries are cut into blocks of ``bq`` rows and the keys into blocks of
``bk`` (the last ones may be short).  Each (batch item, head, query block,
key block) is *empty* (no query of the block sees any of its keys),
*full* (every one sees every one) or *partial*, and only the partial
blocks keep their bits, packed eight to a byte.  The core skips the empty
blocks, forward and backward, applies the full ones with no per-element
test, and reads the bits of the partial ones (csrc/mha.h, ``bm_block``).

This is FlexAttention's ``BlockMask`` made from a vectorised ``mask_mod``:
the function is NumPy on broadcast index arrays, not a vmapped scalar
function, and it is evaluated a strip of query blocks at a time, so a
(B, H, T_q, T_k) boolean array is never made whole.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Tuple

import numpy as np

__all__ = ["BlockMask"]

EMPTY, FULL, PARTIAL = 0, 1, 2
_STRIP_ELEMS = 1 << 24     # booleans per evaluated strip of query blocks


def _count(name: str, value: Any, least: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral,
                                                                     np.integer)):
        raise TypeError(f"{name}: expected an int, got {value!r:.80}")
    if int(value) < least:
        raise ValueError(f"{name}: expected an int >= {least}, got {int(value)}")
    return int(value)


def _block(block: Any) -> Tuple[int, int]:
    """block= as (bq, bk): an int (square blocks) or a pair of positive ints."""
    pair = (block, block) if isinstance(block, (numbers.Integral, np.integer)) and \
        not isinstance(block, (bool, np.bool_)) else block
    try:
        bq, bk = pair
    except (TypeError, ValueError):
        raise TypeError(f"block: expected an int or a pair (bq, bk) of ints, got "
                        f"{block!r:.80}") from None
    return _count("block", bq, 1), _count("block", bk, 1)


def _classify(vis: np.ndarray, bq: int, bk: int):
    """Blocks of ``vis`` (B', H', n, Tk) bool: the kinds (B', H', ceil(n / bq),
    ceil(Tk / bk)) and the partial blocks' packed bits, in C order of the
    kinds, (m, bq, ceil(bk / 8)) uint8."""
    Bb, Hb, n, Tk = vis.shape
    nqb, nkb = -(-n // bq), -(-Tk // bk)
    pad = np.zeros((Bb, Hb, nqb * bq, nkb * bk), dtype=bool)
    pad[:, :, :n, :Tk] = vis
    blocks = pad.reshape(Bb, Hb, nqb, bq, nkb, bk).transpose(0, 1, 2, 4, 3, 5)
    seen = blocks.sum(axis=(4, 5), dtype=np.int64)
    rows = np.minimum(bq, n - bq * np.arange(nqb))
    cols = np.minimum(bk, Tk - bk * np.arange(nkb))
    whole = rows[:, None] * cols[None, :]
    kind = np.where(seen == 0, EMPTY, np.where(seen == whole, FULL, PARTIAL)).astype(np.uint8)
    bits = np.packbits(blocks[kind == PARTIAL], axis=-1, bitorder="little")
    return kind, bits.reshape(-1, bq, (bk + 7) // 8)


class BlockMask:
    """Which keys each query sees, stored block by block.

    A boolean pattern of shape (B, H, T_q, T_k), True where query i of head h
    in batch item b may see key j, kept as one state per block of (bq, bk)
    elements: empty, full, or partial with its bits.  Pass it as
    ``block_mask=`` to :func:`mhattn.multi_head_attention`,
    :func:`mhattn.attention`, their ``_grad`` functions and the layer's
    calls: it is ANDed with every other rule (``mask``, ``causal``, the
    window, ``chunk``, key lengths, ``key_mask``, packed sequences), blocks
    it marks empty are skipped forward and backward, and full ones cost no
    per-element test.  B or H of 1 means one pattern shared by every batch
    item or head.

    Make one with :meth:`from_function` (FlexAttention's ``mask_mod``,
    vectorised) or :meth:`from_dense`.

    **Memory.** One byte per block for its state, plus one *bit* per
    element of a partial block (``bq * ceil(bk / 8)`` bytes each); full and
    empty blocks hold no bits.  A 16-document mask at T = 4096 with
    (128, 128) blocks holds 1024 states and, when the documents' edges fall
    on block edges, no bits at all: 1 KiB where the dense mask takes 16 MiB.
    A call also makes 4 bytes per block of int32 entries, once per mask.

    The constructor takes the parts as :attr:`kind`, :attr:`bits`,
    :attr:`shape` and :attr:`block` give them back (pickling uses it), and
    checks them against each other; most callers use :meth:`from_function`
    or :meth:`from_dense`.

    Parameters
    ----------
    kind : (B, H, ceil(T_q / bq), ceil(T_k / bk)) array_like of uint8
        Each block's state: 0 empty, 1 full, 2 partial.
    bits : (num_partial, bq, ceil(bk / 8)) array_like of uint8
        The partial blocks' bits in C order of ``kind``: bit c % 8 of byte
        c // 8 of row r is key c of the block for query r
        (``numpy.packbits(..., bitorder="little")``).
    shape : (int, int, int, int)
        (B, H, T_q, T_k), B and H possibly 1 (shared).
    block : int or (int, int)
        (bq, bk), the query and key block sizes.

    Examples
    --------
    A causal mask over 4 documents of 64 tokens, in blocks of 32:

    >>> import numpy as np, mhattn
    >>> doc = np.repeat(np.arange(4), 64)
    >>> def documents(b, h, q, kv):
    ...     return (doc[q] == doc[kv]) & (kv <= q)
    >>> bm = mhattn.BlockMask.from_function(documents, 1, 1, 256, 256, block=(32, 32))
    >>> bm
    BlockMask(shape=(1, 1, 256, 256), block=(32, 32), full=4, partial=8, empty=52, nbytes=1088)
    >>> bool(np.array_equal(bm.to_dense()[0, 0], documents(0, 0, np.arange(256)[:, None],
    ...                                                     np.arange(256))))
    True
    """

    def __init__(self, kind: Any, bits: Any, shape: Any, block: Any) -> None:
        try:
            B, H, Tq, Tk = shape
        except (TypeError, ValueError):
            raise TypeError(f"shape: expected (B, H, T_q, T_k), got {shape!r:.80}") from None
        B, H = _count("shape", B, 1), _count("shape", H, 1)
        Tq, Tk = _count("shape", Tq, 0), _count("shape", Tk, 0)
        bq, bk = _block(block)
        kind = np.array(kind, dtype=np.uint8, copy=True, order="C")
        want = (B, H, -(-Tq // bq), -(-Tk // bk))
        if kind.shape != want:
            raise ValueError(f"kind: expected shape {want} for shape {(B, H, Tq, Tk)} and "
                             f"block {(bq, bk)}, got {kind.shape}")
        if kind.size and kind.max() > PARTIAL:
            raise ValueError(f"kind: expected 0 (empty), 1 (full) or 2 (partial), got "
                             f"{int(kind.max())}")
        m = int(np.count_nonzero(kind == PARTIAL))
        bits = np.array(bits, dtype=np.uint8, copy=True, order="C")
        if bits.shape != (m, bq, (bk + 7) // 8):
            raise ValueError(f"bits: expected shape {(m, bq, (bk + 7) // 8)} ({m} partial "
                             f"blocks of {bq} rows of {bk} bits), got {bits.shape}")
        kind.flags.writeable = False
        bits.flags.writeable = False
        self._shape = (B, H, Tq, Tk)
        self._block = (bq, bk)
        self._kind, self._bits = kind, bits
        self._entries = None

    # ---- construction ----------------------------------------------------
    @classmethod
    def from_function(cls, fn: Callable, B: int, H: int, T_q: int, T_k: int,
                      block: Any = (128, 128)) -> "BlockMask":
        """A BlockMask from a NumPy predicate (FlexAttention's ``mask_mod``).

        Parameters
        ----------
        fn : callable
            ``fn(b, h, q_idx, kv_idx)`` on int64 index arrays of shapes
            (B, 1, 1, 1), (1, H, 1, 1), (1, 1, n, 1) and (1, 1, 1, T_k),
            returning booleans that broadcast to (B, H, n, T_k): True where
            the key is visible.  It is called once per strip of query
            blocks (n rows, a multiple of bq but for the last strip), so it
            must be elementwise in q_idx.
        B, H : int
            Batch items and heads; 1 means one pattern shared by all.
        T_q, T_k : int
            Queries and keys (>= 0).
        block : int or (int, int), default (128, 128)
            (bq, bk), the block sizes; an int gives square blocks.  They need
            not divide T_q or T_k.

        Returns
        -------
        BlockMask

        Raises
        ------
        TypeError
            ``fn`` returned something not boolean, or a size is not an int.
        ValueError
            ``fn`` raised (chained), returned a shape that does not cover the
            grid, or a size or block is out of range.

        Examples
        --------
        A prefix-LM mask: the first 100 tokens see each other, the rest are
        causal.

        >>> import mhattn
        >>> bm = mhattn.BlockMask.from_function(
        ...     lambda b, h, q, kv: (kv <= q) | (kv < 100), 1, 1, 300, 300, block=64)
        >>> bm.kind[0, 0]
        array([[1, 2, 0, 0, 0],
               [1, 2, 0, 0, 0],
               [1, 1, 2, 0, 0],
               [1, 1, 1, 2, 0],
               [1, 1, 1, 1, 2]], dtype=uint8)
        """
        if not callable(fn):
            raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
        B, H = _count("B", B, 1), _count("H", H, 1)
        Tq, Tk = _count("T_q", T_q, 0), _count("T_k", T_k, 0)
        bq, bk = _block(block)
        b = np.arange(B, dtype=np.int64).reshape(B, 1, 1, 1)
        h = np.arange(H, dtype=np.int64).reshape(1, H, 1, 1)
        kv = np.arange(Tk, dtype=np.int64).reshape(1, 1, 1, Tk)

        def strip(i0: int, i1: int) -> np.ndarray:
            q = np.arange(i0, i1, dtype=np.int64).reshape(1, 1, i1 - i0, 1)
            try:
                r = fn(b, h, q, kv)
            except Exception as e:
                raise ValueError(f"fn: raised {type(e).__name__} on query rows {i0} to "
                                 f"{i1 - 1}: {e}") from e
            r = np.asarray(r)
            if r.dtype != np.bool_:
                raise TypeError(f"fn: expected booleans (True where the key is visible), "
                                f"got dtype {r.dtype}")
            grid = (B, H, i1 - i0, Tk)
            try:
                ok = r.ndim <= 4 and np.broadcast_shapes(r.shape, grid) == grid
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"fn: returned shape {r.shape}, which does not broadcast "
                                 f"to the grid (B, H, rows, T_k) = {grid} of query rows "
                                 f"{i0} to {i1 - 1}")
            return np.broadcast_to(r, grid)
        return cls._from_strips(strip, B, H, Tq, Tk, bq, bk)

    @classmethod
    def from_dense(cls, mask: Any, block: Any = (128, 128)) -> "BlockMask":
        """A BlockMask holding a boolean mask.

        Parameters
        ----------
        mask : (T_q, T_k), (H, T_q, T_k) or (B, H, T_q, T_k) bool array_like
            True where the key is visible; leading axes of 1 are shared.
        block : int or (int, int), default (128, 128)
            As :meth:`from_function`.

        Returns
        -------
        BlockMask
            Of shape ``mask.shape`` with 1s prepended to four axes.

        Examples
        --------
        >>> import numpy as np, mhattn
        >>> bm = mhattn.BlockMask.from_dense(np.tril(np.ones((5, 5), bool)), block=2)
        >>> bm.kind[0, 0]
        array([[2, 0, 0],
               [1, 2, 0],
               [1, 1, 1]], dtype=uint8)
        >>> bool(np.array_equal(bm.to_dense()[0, 0], np.tril(np.ones((5, 5), bool))))
        True
        """
        m = np.asarray(mask)
        if m.dtype != np.bool_:
            raise TypeError(f"mask: expected a boolean array, got dtype {m.dtype}")
        if not 2 <= m.ndim <= 4:
            raise ValueError(f"mask: expected (T_q, T_k), (H, T_q, T_k) or "
                             f"(B, H, T_q, T_k), got shape {m.shape}")
        m = m.reshape((1,) * (4 - m.ndim) + m.shape)
        B, H, Tq, Tk = m.shape
        if B == 0 or H == 0:
            raise ValueError(f"mask: B and H must be at least 1, got shape {m.shape}")
        bq, bk = _block(block)
        return cls._from_strips(lambda i0, i1: m[:, :, i0:i1], B, H, Tq, Tk, bq, bk)

    @classmethod
    def _from_strips(cls, strip: Callable, B: int, H: int, Tq: int, Tk: int, bq: int,
                     bk: int) -> "BlockMask":
        """Classifies the rows strip(i0, i1) (B, H, i1 - i0, Tk), a strip of
        whole query blocks at a time, bounded to about _STRIP_ELEMS."""
        nqb = -(-Tq // bq)
        per = max(1, _STRIP_ELEMS // max(1, B * H * bq * max(Tk, 1)))
        kinds, bits, order = [], [], []
        for qb0 in range(0, nqb, per):
            qb1 = min(nqb, qb0 + per)
            kind, b = _classify(strip(qb0 * bq, min(Tq, qb1 * bq)), bq, bk)
            kinds.append(kind)
            bits.append(b)
            # The partial blocks' places in the whole mask's C order.
            idx = np.argwhere(kind == PARTIAL)
            idx[:, 2] += qb0
            order.append(idx)
        nkb = -(-Tk // bk)
        kind = (np.concatenate(kinds, axis=2) if kinds
                else np.zeros((B, H, 0, nkb), np.uint8))
        rb = (bk + 7) // 8
        allbits = np.concatenate(bits) if bits else np.zeros((0, bq, rb), np.uint8)
        if allbits.shape[0]:
            flat = np.ravel_multi_index(tuple(np.concatenate(order).T), kind.shape)
            allbits = allbits[np.argsort(flat, kind="stable")]
        return cls(kind, allbits, (B, H, Tq, Tk), (bq, bk))

    # ---- what it holds ----------------------------------------------------
    @property
    def shape(self) -> Tuple[int, int, int, int]:
        """(B, H, T_q, T_k); B or H of 1 is shared.

        Examples
        --------
        >>> import numpy as np, mhattn
        >>> bm = mhattn.BlockMask.from_dense(np.tril(np.ones((6, 6), bool)), block=(4, 2))
        >>> bm.shape
        (1, 1, 6, 6)
        """
        return self._shape

    @property
    def block(self) -> Tuple[int, int]:
        """(bq, bk), the block sizes.

        Examples
        --------
        >>> import numpy as np, mhattn
        >>> bm = mhattn.BlockMask.from_dense(np.tril(np.ones((6, 6), bool)), block=(4, 2))
        >>> bm.block
        (4, 2)
        """
        return self._block

    @property
    def kind(self) -> np.ndarray:
        """(B, H, nqb, nkb) uint8: 0 empty, 1 full, 2 partial (read-only).

        Examples
        --------
        >>> import numpy as np, mhattn
        >>> bm = mhattn.BlockMask.from_dense(np.tril(np.ones((6, 6), bool)), block=(4, 2))
        >>> bm.kind[0, 0]
        array([[2, 2, 0],
               [1, 1, 2]], dtype=uint8)
        """
        return self._kind

    @property
    def bits(self) -> np.ndarray:
        """(num_partial, bq, ceil(bk / 8)) uint8: the partial blocks' bits.

        Examples
        --------
        >>> import numpy as np, mhattn
        >>> bm = mhattn.BlockMask.from_dense(np.tril(np.ones((6, 6), bool)), block=(4, 2))
        >>> bm.bits.shape
        (3, 4, 1)
        """
        return self._bits

    @property
    def nbytes(self) -> int:
        """Bytes held: the states and the partial blocks' bits.

        Examples
        --------
        >>> import numpy as np, mhattn
        >>> bm = mhattn.BlockMask.from_dense(np.tril(np.ones((6, 6), bool)), block=(4, 2))
        >>> bm.nbytes
        18
        """
        return self._kind.nbytes + self._bits.nbytes

    def to_dense(self) -> np.ndarray:
        """The mask as a dense array.

        Returns
        -------
        (B, H, T_q, T_k) bool ndarray
            A new array, True where the key is visible.

        Examples
        --------
        >>> import numpy as np, mhattn
        >>> m = np.random.default_rng(0).random((3, 7, 9)) < 0.5
        >>> bool(np.array_equal(mhattn.BlockMask.from_dense(m, block=(2, 4)).to_dense()[0], m))
        True
        """
        B, H, Tq, Tk = self._shape
        bq, bk = self._block
        nqb, nkb = self._kind.shape[2:]
        out = np.zeros((B, H, nqb, nkb, bq, bk), dtype=bool)
        out[self._kind == FULL] = True
        out[self._kind == PARTIAL] = np.unpackbits(self._bits, axis=-1, count=bk,
                                                   bitorder="little").astype(bool)
        dense = out.transpose(0, 1, 2, 4, 3, 5).reshape(B, H, nqb * bq, nkb * bk)
        return np.ascontiguousarray(dense[:, :, :Tq, :Tk])

    def __repr__(self) -> str:
        k = self._kind
        return (f"BlockMask(shape={self._shape}, block={self._block}, "
                f"full={int(np.count_nonzero(k == FULL))}, "
                f"partial={int(np.count_nonzero(k == PARTIAL))}, "
                f"empty={int(np.count_nonzero(k == EMPTY))}, nbytes={self.nbytes})")

    def __reduce__(self):
        return (type(self), (self._kind, self._bits, self._shape, self._block))

    # ---- for the core -----------------------------------------------------
    def _glue(self) -> tuple:
        """(entries, bits, bq, bk): entries (B, H, nqb, nkb) int32, -1 empty,
        -2 full, else the partial block's index into bits (csrc/mha.h,
        bm_block); made once."""
        if self._entries is None:
            k = self._kind
            idx = np.cumsum(k == PARTIAL, dtype=np.int64).reshape(k.shape) - 1
            e = np.where(k == EMPTY, -1, np.where(k == FULL, -2, idx)).astype(np.int32)
            e.flags.writeable = False
            self._entries = e
        return (self._entries, self._bits) + self._block
