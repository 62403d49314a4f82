"""The variants of today's models: their checks, in one place.

:func:`normalize_variants` turns the keywords ``window``, ``softcap``,
``alibi_slopes``, ``sinks``, ``q_norm``, ``k_norm``, ``norm_eps``,
``norm_type``, ``rope``,
``positions``, ``key_positions``, ``key_mask``, ``cu_seqlens`` and
``key_cu_seqlens`` into one :class:`Variants`, held by the checked
:class:`mhattn._internal.args.Call` as ``call.var``.  Every error names the argument
and the shapes it saw.  Letters follow ``csrc/mha.h``.

The order of a score's life, which the reference, the trace and the C core
all follow:

 1. project, plus bias;          7. + ALiBi + additive mask;
 2. q/k norm (RMS or Layer);     8. the visibility rules (mask, causal,
 3. RoPE;                           window, key_mask, key_lengths,
 4. q . k;                          packed sequences): -inf;
 5. x scale;                     9. softmax, with sinks;
 6. softcap: c tanh(s / c);     10. . V;  11. concat;  12. W^O.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from .arrays import _check_numeric, _to_array
from .blockmask import BlockMask

__all__ = ["RoPE", "RelativeBias", "Variants", "normalize_variants", "VARIANT_DEFAULTS", "norm_type_arg",
           "variant_kwargs",
           "query_positions", "key_positions_of", "sequence_ids"]

#: Every variant keyword and its default (off).
VARIANT_DEFAULTS = dict(window=None, softcap=None, alibi_slopes=None, sinks=None,
                        q_norm=None, k_norm=None, norm_eps=1e-6, norm_type="rms",
                        rope=None, positions=None, key_positions=None, key_mask=None,
                        cu_seqlens=None, key_cu_seqlens=None, dropout=0.0, seed=None,
                        relative_bias=None, chunk=None, block_mask=None)


def variant_kwargs(ns: dict) -> dict:
    """The variants' keywords of a public function, from its ``locals()``:
    every entry point takes them by name (for its signature and its docs)
    and hands them on as one dict."""
    return {name: ns[name] for name in VARIANT_DEFAULTS}


# RoPE.frequencies refuses a rotary_dim above this before allocating.
_MAX_ROTARY_DIM = 2 ** 20


class RoPE:
    """Rotary position embedding of q and k (after the q/k norm, before the scale).

    RoPE(theta=10000.0, rotary_dim=None, interleaved=False, inv_freq=None)

    Parameters
    ----------
    theta : float, default 10000.0
        Base of the frequencies ``theta ** (-2 c / rotary_dim)``, c = 0 ..
        rotary_dim/2 - 1.
    rotary_dim : int, optional
        How many leading features of each head turn (even, <= d_k); the
        rest pass unchanged.  Default: all d_k of them.
    interleaved : bool, default False
        False pairs feature c with c + rotary_dim/2, the rotate-half of
        GPT-NeoX and Llama; True pairs (2c, 2c+1), as in GPT-J and RoFormer.
    inv_freq : (rotary_dim/2,) array, optional
        The frequencies themselves, overriding theta: Llama 3's or YaRN's
        scaled frequencies, or a model's ``rotary_emb.inv_freq``.

    Notes
    -----
    Pair c of a row at position p turns by the angle ``p * inv_freq[c]``:
    ``(a, b) -> (a cos - b sin, a sin + b cos)``.  Positions are p_i for
    queries and j for keys unless ``positions=`` / ``key_positions=`` say
    otherwise.

    Examples
    --------
    >>> rope = mhattn.RoPE(theta=500000.0)            # Llama 3's base
    >>> x = np.random.default_rng(0).standard_normal((5, 16))
    >>> w = np.eye(16)
    >>> mhattn.multi_head_attention(x, w, w, w, num_heads=2, causal=True,
    ...                             rope=rope).shape
    (5, 16)
    """

    def __init__(self, theta: float = 10000.0, rotary_dim: Optional[int] = None,
                 interleaved: bool = False, inv_freq: Any = None):
        if isinstance(theta, bool) or not isinstance(theta, numbers.Real):
            raise TypeError(f"theta: expected a real number > 1, got {theta!r}")
        if not (math.isfinite(float(theta)) and float(theta) > 1.0):
            raise ValueError(f"theta: expected a finite number > 1, got {theta!r}")
        if rotary_dim is not None:
            if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, numbers.Integral):
                raise TypeError(f"rotary_dim: expected an int or None, got {rotary_dim!r}")
            if rotary_dim <= 0:   # 0 would be no RoPE; even and <= d_k: the core's rules
                raise ValueError(f"rotary_dim: expected a positive int or None, got "
                                 f"{rotary_dim}")
        if not isinstance(interleaved, (bool, np.bool_)):
            raise TypeError(f"interleaved: expected True or False, got {interleaved!r}")
        self.theta = float(theta)
        self.rotary_dim = None if rotary_dim is None else int(rotary_dim)
        self.interleaved = bool(interleaved)
        if inv_freq is not None:
            try:
                raw = np.asarray(inv_freq)
            except (TypeError, ValueError) as e:   # a ragged list, an odd object
                raise TypeError(f"inv_freq: expected a 1-D array of real numbers, got "
                                f"{type(inv_freq).__name__} that NumPy cannot read "
                                f"({e})") from None
            if raw.dtype.kind not in "iuf" and not (
                    raw.dtype == object and all(
                        isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))
                        for v in raw.reshape(-1))):
                # complex would lose its imaginary part, strings and bools are no
                # frequencies
                raise TypeError(f"inv_freq: expected real numbers, got dtype {raw.dtype}")
            f = np.array(raw, dtype=np.float64)
            if f.ndim != 1 or f.size == 0 or not np.isfinite(f).all():
                raise ValueError(f"inv_freq: expected a 1-D array of finite numbers, "
                                 f"got shape {f.shape}")
            if self.rotary_dim is not None and f.size != self.rotary_dim // 2:
                raise ValueError(f"inv_freq: expected shape ({self.rotary_dim // 2},) "
                                 f"(rotary_dim/2), got {f.shape}")
            f.flags.writeable = False
            inv_freq = f
        self.inv_freq = inv_freq

    def __repr__(self) -> str:
        extra = "" if self.inv_freq is None else f", inv_freq=<{self.inv_freq.size}>"
        return (f"RoPE(theta={self.theta!r}, rotary_dim={self.rotary_dim!r}, "
                f"interleaved={self.interleaved!r}{extra})")

    def frequencies(self, rotary_dim: int) -> np.ndarray:
        """(rotary_dim/2,) float64: inv_freq, or theta ** (-2c / rotary_dim).

        Parameters
        ----------
        rotary_dim : int
            How many features of a head turn.  It must be a positive int
            (TypeError / ValueError naming it).  Whether it is even and
            <= d_k is the core's rule, checked at the call: an odd
            rotary_dim here gives rotary_dim // 2 frequencies.  A rotary_dim
            above 2**20 (no model's head is that wide; the core would refuse
            it as wider than d_k anyway) raises ValueError before the
            frequencies are allocated, so a huge one set after construction
            never reaches np.arange.  (A cap, not check_memory: args imports
            this module, and the import graph runs one way.)

        Returns
        -------
        (rotary_dim/2,) float64 array
            ``inv_freq`` when it was given, else
            ``theta ** (-2c / rotary_dim)`` for c = 0 .. rotary_dim/2 - 1.

        Examples
        --------
        >>> mhattn.RoPE(theta=10000.0).frequencies(4)
        array([1.  , 0.01])
        >>> mhattn.RoPE(inv_freq=[1.0, 0.5]).frequencies(4)
        array([1. , 0.5])
        """
        if isinstance(rotary_dim, (bool, np.bool_)) or not isinstance(rotary_dim,
                                                                      numbers.Integral):
            raise TypeError(f"rotary_dim: expected a positive int, got {rotary_dim!r:.80} "
                            f"({type(rotary_dim).__name__})")
        rotary_dim = int(rotary_dim)
        if rotary_dim <= 0:
            raise ValueError(f"rotary_dim: expected a positive int, got {rotary_dim}")
        if self.inv_freq is not None:
            return self.inv_freq
        if rotary_dim > _MAX_ROTARY_DIM:
            raise ValueError(f"rotary_dim: {rotary_dim} is wider than any head "
                             f"(at most {_MAX_ROTARY_DIM} = 2**20 here)")
        c = np.arange(rotary_dim // 2, dtype=np.float64)
        return 1.0 / self.theta ** (2 * c / rotary_dim)


class RelativeBias:
    """T5's relative position bias: a learned table of per-head biases by bucketed distance.

    RelativeBias(table, num_buckets=32, max_distance=128, bidirectional=True)

    Passed as ``relative_bias=`` to :func:`mhattn.multi_head_attention`,
    :func:`mhattn.attention`, their ``_grad`` functions, the layer and the
    reference.  Score (i, j) of head h gains ``table[bucket(j_pos - i_pos), h]``
    after the softcap and ALiBi, before the additive mask, as in
    transformers' ``T5Attention`` (which also uses ``scale=1.0``: T5 does
    not divide by sqrt(d_k)).

    Parameters
    ----------
    table : (num_buckets, h) array
        The biases, as ``T5Attention.relative_attention_bias.weight``.  Its
        gradient is returned under ``'relative_bias'``, shaped as the table.
    num_buckets : int, default 32
        Rows of the table.  Bidirectional (an encoder) gives each direction
        ``num_buckets // 2``; a decoder (``bidirectional=False``) tells only
        earlier keys apart.  A direction needs at least 2 buckets.
    max_distance : int, default 128
        Half of a direction's buckets are exact distances, the rest are
        logarithmic up to ``max_distance``, beyond which all distances share
        the last bucket.  It must be at least a direction's bucket count
        (``num_buckets // 2`` when bidirectional): fewer distances than
        buckets would leave buckets empty.
    bidirectional : bool, default True
        True for T5's encoder, False for its decoder.

    Notes
    -----
    The bucket depends on the distance alone, so the C core looks up one
    bias per distance and head per call (O(h (T_q + T_k))) and each tile
    adds a contiguous slice of it: no (T_q, T_k) array is made.  The
    buckets are transformers' ``_relative_position_bucket``, in float32 as
    torch computes them (:func:`mhattn.reference.relative_position_bucket`).
    Positions are those of ALiBi and causal masking: query i sits at
    ``i + T_k - T_q`` (a KV cache's queries at their own position), key j
    at j, within its own sequence when packed.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((6, 16))
    >>> w = rng.standard_normal((16, 16)) / 4
    >>> rb = mhattn.RelativeBias(rng.standard_normal((32, 2)))
    >>> out = mhattn.multi_head_attention(x, w, w, w, num_heads=2, scale=1.0,
    ...                                   relative_bias=rb)
    >>> out.shape
    (6, 16)
    >>> g = mhattn.multi_head_attention_grad(np.ones_like(out), x, w, w, w,
    ...                                      num_heads=2, scale=1.0, relative_bias=rb)
    >>> g['relative_bias'].shape
    (32, 2)
    """

    def __init__(self, table: Any, num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = True):
        for name, v in (("num_buckets", num_buckets), ("max_distance", max_distance)):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Integral,
                                                                     np.integer)):
                raise TypeError(f"{name}: expected an int, got {v!r:.80}")
        if not isinstance(bidirectional, (bool, np.bool_)):
            raise TypeError(f"bidirectional: expected True or False, got {bidirectional!r:.80}")
        num_buckets, max_distance = int(num_buckets), int(max_distance)
        per = num_buckets // 2 if bidirectional else num_buckets
        what = "num_buckets // 2 (a direction's buckets)" if bidirectional else "num_buckets"
        if per < 2:
            raise ValueError(f"num_buckets: {num_buckets} gives {what} = {per}; a direction "
                             f"needs at least 2 buckets")
        if max_distance < per:
            raise ValueError(f"max_distance: {max_distance} is less than {what} = {per}, "
                             f"which leaves buckets empty (T5 uses 128 with 32 buckets)")
        t = _real_array("relative_bias", table)
        if t.ndim != 2 or t.shape[0] != num_buckets:
            raise ValueError(f"relative_bias: expected a table of shape ({num_buckets}, h) "
                             f"(num_buckets, heads), got {t.shape}")
        self.table = t
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bool(bidirectional)

    def __repr__(self) -> str:
        return (f"RelativeBias(table=<{self.table.shape[0]}x{self.table.shape[1]}>, "
                f"num_buckets={self.num_buckets}, max_distance={self.max_distance}, "
                f"bidirectional={self.bidirectional})")


def _relative_bias(rb: Any, H: int, dtype) -> Optional[tuple]:
    """(table (num_buckets, H) of dtype, max_distance, bidirectional), checked."""
    if rb is None:
        return None
    if not isinstance(rb, RelativeBias):
        raise TypeError(f"relative_bias: expected mhattn.RelativeBias(table, ...) or None, "
                        f"got {type(rb).__name__}")
    t = rb.table
    if t.shape != (rb.num_buckets, H):
        raise ValueError(f"relative_bias: expected a table of shape ({rb.num_buckets}, {H}) "
                         f"(num_buckets, heads), got {t.shape}")
    return _frozen(t.astype(dtype)), rb.max_distance, rb.bidirectional


def _block_mask(bm: Any, B: int, H: int, Tq: int, Tk: int):
    """A BlockMask whose shape fits the call's (B or 1, H or 1, Tq, Tk), or
    None; TypeError / ValueError naming block_mask otherwise."""
    if bm is None:
        return None
    if not isinstance(bm, BlockMask):
        raise TypeError(f"block_mask: expected mhattn.BlockMask or None, got "
                        f"{type(bm).__name__}")
    b, h, tq, tk = bm.shape
    if b not in (1, B) or h not in (1, H) or (tq, tk) != (Tq, Tk):
        raise ValueError(f"block_mask: expected shape (B or 1, H or 1, T_q, T_k) = "
                         f"({B} or 1, {H} or 1, {Tq}, {Tk}), got {bm.shape}")
    return bm


@dataclass
class Variants:
    """The checked variants of one call (all off by default).

    Shapes use the call's batched letters, even for an unbatched call.
    """
    window: Optional[tuple] = None           # (left, right), each int >= 0 or None
    softcap: Optional[float] = None          # > 0
    alibi: Optional[np.ndarray] = None       # (B, H), (n, H) packed, or (1, H) float64
    sinks: Optional[np.ndarray] = None       # (H,) compute dtype
    q_norm: Optional[np.ndarray] = None      # (d_k,) or (H, d_k) compute dtype
    k_norm: Optional[np.ndarray] = None      # (d_k,) or (G, d_k)
    norm_eps: float = 1e-6
    norm_type: str = "rms"                   # the q/k norm: "rms" or "layer"
    rotary_dim: int = 0                      # 0: no RoPE
    interleaved: bool = False
    inv_freq: Optional[np.ndarray] = None    # (rotary_dim/2,) float64
    positions: Optional[np.ndarray] = None   # (B, Tq) or (1, Tq) int64
    key_positions: Optional[np.ndarray] = None  # (B, Tk) or (1, Tk) int64
    key_mask: Optional[np.ndarray] = None    # (B, Tk) bool
    cu_q: Optional[np.ndarray] = None        # (n+1,) int64: packed sequences (B == 1)
    cu_k: Optional[np.ndarray] = None        # (n+1,) int64
    dropout: float = 0.0                     # 0 <= dropout < 1 (the core's rule)
    seed: int = 0                            # dropout's seed, in [0, 2**64)
    rel: Optional[tuple] = None              # T5: (table (nb, H), max_distance, bidir)
    chunk: int = 0                           # chunked attention's chunk; 0: off
    block_mask: Optional[BlockMask] = None   # (B or 1, H or 1, Tq, Tk)
    q_offset: Optional[int] = None           # query 0's position; None: Tk - Tq

    @property
    def any(self) -> bool:
        """Whether any variant is on."""
        return (self.window is not None or self.softcap is not None
                or self.alibi is not None or self.sinks is not None
                or self.key_mask is not None or self.packed or self.transforms
                or self.dropout != 0    # a bad one too (NaN, < 0): the core refuses it
                or self.rel is not None or self.chunk != 0 or self.block_mask is not None
                or self.q_offset is not None)

    @property
    def transforms(self) -> bool:
        """Whether q or k is transformed (norm or RoPE) before the scores."""
        return self.q_norm is not None or self.k_norm is not None or self.rotary_dim > 0

    @property
    def packed(self) -> bool:
        return self.cu_q is not None


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    if a.flags.writeable and a.base is None:
        a.flags.writeable = False
    return a


def _real_array(name: str, obj: Any) -> np.ndarray:
    a = _to_array(name, obj)
    _check_numeric(name, a)
    return a


def _window(window: Any) -> Optional[tuple]:
    if window is None:
        return None
    if isinstance(window, (str, bytes)) or not (
            isinstance(window, Sequence) or (isinstance(window, np.ndarray)
                                             and window.ndim == 1)):
        raise TypeError(f"window: expected (left, right), each an int >= 0 or None, "
                        f"got {window!r}; Mistral's sliding_window=W is window=(W-1, 0)")
    sides = list(window)
    if len(sides) != 2:
        raise ValueError(f"window: expected (left, right), got {len(sides)} values "
                         f"{window!r}; Mistral's sliding_window=W is window=(W-1, 0)")
    out = []
    for side, v in zip(("left", "right"), sides):
        if v is None:
            out.append(None)
            continue
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Integral, np.integer)):
            raise TypeError(f"window: the {side} side must be an int >= 0 or None, got {v!r}")
        if v < 0:
            raise ValueError(f"window: the {side} side must be >= 0 (None for unbounded), "
                             f"got {int(v)}")
        if v > 2 ** 62:
            raise ValueError(f"window: the {side} side {int(v)} is too large; "
                             "None means unbounded")
        out.append(int(v))
    return tuple(out)


def _softcap(softcap: Any) -> Optional[float]:
    if softcap is None:
        return None
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(
            softcap, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"softcap: expected a positive real number or None, got {softcap!r}")
    # 0 is off, as in FlashAttention; the rest (finite, >= 0) is the core's rule.
    c = float(softcap)
    return None if c == 0 else c


def _chunk(chunk: Any) -> int:
    """chunk= as an int (0: off, from None): a positive int, else TypeError /
    ValueError naming it. (Its upper bound is the core's.)"""
    if chunk is None:
        return 0
    if isinstance(chunk, (bool, np.bool_)) or not isinstance(chunk, (numbers.Integral,
                                                                     np.integer)):
        raise TypeError(f"chunk: expected a positive int or None, got {chunk!r:.80}")
    if chunk <= 0:
        raise ValueError(f"chunk: expected a positive int (keys per chunk) or None, got "
                         f"{int(chunk)}")
    if chunk > 2 ** 62:
        raise ValueError(f"chunk: {int(chunk)} is too large; None means no chunks")
    return int(chunk)


def _q_offset(q_offset: Any) -> Optional[int]:
    """q_offset= (attention's alone, so not in VARIANT_DEFAULTS): None or an
    int of either sign, else TypeError naming it. (Its bound and the rules
    it cannot go with are the core's.)"""
    if q_offset is None:
        return None
    if isinstance(q_offset, (bool, np.bool_)) or not isinstance(q_offset, (numbers.Integral,
                                                                           np.integer)):
        raise TypeError(f"q_offset: expected an int or None, got {q_offset!r:.80}")
    if not -2 ** 63 <= q_offset < 2 ** 63:
        raise ValueError(f"q_offset: {int(q_offset)} does not fit in int64")
    return int(q_offset)


def dropout_arg(dropout: Any) -> float:
    if isinstance(dropout, (bool, np.bool_)) or not isinstance(
            dropout, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"dropout: expected a probability in [0, 1), got {dropout!r:.80}")
    return float(dropout)   # 0 <= dropout < 1: the core's rule (config.c)


def dropout_kwargs(dropout: Any, seed: Any) -> dict:
    """dropout and seed as variant keywords, or {} when both are off (a
    dropout of 0 and no seed): an entry point whose variants are all None
    when off (attention's) keeps its plain path."""
    off = (seed is None and type(dropout) in (float, int) and dropout == 0)
    return {} if off else {"dropout": dropout, "seed": seed}


def dropout_seed(seed: Any, dropout: float) -> int:
    """The 64-bit seed of a call's dropout: an int in [0, 2**64) as it is,
    one drawn from a ``numpy.random.Generator``, or, for None, one drawn
    from fresh OS entropy when dropout is on (0 when it is off: unused)."""
    if isinstance(seed, np.random.Generator):
        return int(seed.integers(0, 2 ** 64, dtype=np.uint64))
    if seed is None:
        return int(np.random.default_rng().integers(0, 2 ** 64, dtype=np.uint64)) \
            if dropout > 0 else 0
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (numbers.Integral,
                                                                    np.integer)):
        raise ValueError(f"seed: expected an int in [0, 2**64) or a numpy.random.Generator, "
                         f"got {seed!r:.80} ({type(seed).__name__})")
    if not 0 <= int(seed) < 2 ** 64:
        raise ValueError(f"seed: expected an int in [0, 2**64), got {int(seed)}")
    return int(seed)


def _per_head(name: str, obj: Any, H: int, B: int, batched: bool, dtype,
              finite: bool = True) -> np.ndarray:
    """(H,) or, batched, (B, H) as (B or 1, H) of dtype; each value finite
    unless ``finite`` is False (a rule the core checks itself)."""
    a = _real_array(name, obj)
    forms = f"({H},) (one per query head)" + (f" or ({B}, {H})" if batched else "")
    if a.shape == (H,):
        a = a[np.newaxis]
    elif not (batched and a.shape == (B, H)):
        raise ValueError(f"{name}: expected shape {forms}, got {a.shape}")
    a = a.astype(dtype)
    if finite and not np.isfinite(a).all():
        raise ValueError(f"{name}: every value must be finite")
    return _frozen(a)


def _alibi(obj: Any, H: int, B: int, batched: bool, cu_q: Optional[np.ndarray]) -> np.ndarray:
    """ALiBi's slopes as (rows, H) float64: (H,) shared, (B, H) per batch
    item, or with packed sequences (n, H), one row per sequence, as
    FlashAttention's varlen calls take them. Their values are the core's to
    check (precision_check: a slope whose bias at the largest distance the
    call's type cannot hold, inf and NaN among them)."""
    if cu_q is None:
        return _per_head("alibi_slopes", obj, H, B, batched, np.float64, finite=False)
    n = cu_q.size - 1
    a = _real_array("alibi_slopes", obj)
    if a.shape not in ((H,), (n, H)):
        raise ValueError(f"alibi_slopes: expected shape ({H},) (one per query head) or "
                         f"({n}, {H}) (one row per packed sequence), got {a.shape}")
    return _frozen(np.atleast_2d(a).astype(np.float64))


def _norm_weight(name: str, obj: Any, heads: int, head_word: str, dk: Sequence[int],
                 dtype) -> Optional[np.ndarray]:
    if obj is None:
        return None
    a = _real_array(name, obj)
    if len(set(dk)) != 1:
        raise ValueError(f"{name}: needs every head to have the same d_k; the heads "
                         f"have widths {list(dk)}")
    d = dk[0]
    if a.shape not in ((d,), (heads, d)):
        raise ValueError(f"{name}: expected shape ({d},) (d_k, shared by every head) or "
                         f"({heads}, {d}) (one row per {head_word}), got {a.shape}")
    return _frozen(a.astype(dtype))


def _eps(norm_eps: Any) -> float:
    if isinstance(norm_eps, (bool, np.bool_)) or not isinstance(
            norm_eps, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"norm_eps: expected a real number >= 0, got {norm_eps!r}")
    return float(norm_eps)   # finite and >= 0: the core's rule


def norm_type_arg(norm_type: Any) -> str:
    """``norm_type`` as a str (TypeError for anything else); which names
    exist is the core's rule (mha_norm_type_parse), asked at the call."""
    if not isinstance(norm_type, str):
        raise TypeError(f"norm_type: expected a str (\"rms\" or \"layer\"), got "
                        f"{norm_type!r:.80} ({type(norm_type).__name__})")
    return str(norm_type)


def _rope(rope: Any, dk: Sequence[int]) -> tuple:
    """(rotary_dim, interleaved, inv_freq) of a RoPE, checked against d_k."""
    if rope is None:
        return 0, False, None
    if not isinstance(rope, RoPE):
        raise TypeError(f"rope: expected mhattn.RoPE(...) or None, got {type(rope).__name__}")
    rd = rope.rotary_dim
    if rd is None:
        if rope.inv_freq is not None:
            rd = 2 * rope.inv_freq.size
        elif len(set(dk)) == 1:
            rd = dk[0]
        else:
            raise ValueError(f"rope: the heads have widths {list(dk)}; give "
                             "RoPE(rotary_dim=...) <= the smallest")
    # Even and <= d_k: the core's rules (rd is RoPE's, >= 2, or d_k, >= 1).
    f = rope.frequencies(rd)
    if f.size != rd // 2:
        raise ValueError(f"inv_freq: expected shape ({rd // 2},) (rotary_dim/2), got {f.shape}")
    return rd, rope.interleaved, _frozen(np.asarray(f, dtype=np.float64))


def _positions(name: str, obj: Any, B: int, T: int, batched: bool, what: str
               ) -> Optional[np.ndarray]:
    if obj is None:
        return None
    a = _to_array(name, obj)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {a.dtype}")
    if a.shape == (T,):
        a = a[np.newaxis]
    elif not (batched and a.shape == (B, T)):
        forms = f"({T},)" + (f" or ({B}, {T})" if batched else "")
        raise ValueError(f"{name}: expected shape {forms}, one per {what}, got {a.shape}")
    if a.dtype.kind == "u" and a.size and a.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name}: positions above 2**63 - 1")
    return _frozen(a.astype(np.int64))


def _key_mask(key_mask: Any, B: int, Tk: int, batched: bool) -> Optional[np.ndarray]:
    if key_mask is None:
        return None
    m = _to_array("key_mask", key_mask)
    if m.dtype.kind != "b":
        raise TypeError(f"key_mask: expected a bool array (True = a real key), got "
                        f"dtype {m.dtype}")
    forms = f"({Tk},)" + (f" or ({B}, {Tk})" if batched else "")
    if m.shape == (Tk,):
        m = np.broadcast_to(m, (B, Tk))
    elif not (batched and m.shape == (B, Tk)):
        raise ValueError(f"key_mask: expected shape {forms} (True = a real key), "
                         f"got {m.shape}")
    return _frozen(np.array(m, dtype=np.bool_))


def _offsets(name: str, obj: Any, total: int, what: str) -> np.ndarray:
    a = _to_array(name, obj)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integer offsets, got dtype {a.dtype}")
    if a.ndim != 1 or a.size < 2:
        raise ValueError(f"{name}: expected a 1-D array (n+1,) of offsets [0, ..., "
                         f"{total}], got shape {a.shape}")
    # 0, ..., total and non-decreasing: the core's rules (cu_q, cu_k).
    return _frozen(a.astype(np.int64))


def _packing(cu_seqlens: Any, key_cu_seqlens: Any, batched: bool, Tq: int, Tk: int,
             key_given: bool, key_lengths: Any, names: tuple = ("x", "key")) -> tuple:
    """names: what the call calls its query and key inputs, for the messages."""
    if cu_seqlens is None:
        if key_cu_seqlens is not None:
            raise ValueError("key_cu_seqlens: given without cu_seqlens")
        return None, None
    if batched:
        raise ValueError("cu_seqlens: packed sequences take a 2-D x of shape (total, d_in); "
                         "got a batched (B, T, d_in) x")
    if key_lengths is not None:
        raise ValueError("key_lengths: not with cu_seqlens (each sequence's keys are "
                         "its own); pad with key_mask= instead")
    cu_q = _offsets("cu_seqlens", cu_seqlens, Tq, "rows of x")
    if key_cu_seqlens is None:
        if key_given and Tk != Tq:
            raise ValueError(f"key_cu_seqlens: required for packed cross-attention "
                             f"({names[1]} has {Tk} rows, {names[0]} has {Tq})")
        return cu_q, cu_q
    cu_k = _offsets("key_cu_seqlens", key_cu_seqlens, Tk, "rows of key")
    if cu_k.size != cu_q.size:
        raise ValueError(f"key_cu_seqlens: has {cu_k.size - 1} sequences but cu_seqlens "
                         f"has {cu_q.size - 1}")
    return cu_q, cu_k


def normalize_variants(v: dict, *, batched: bool, B: int, Tq: int, Tk: int, H: int,
                       G: int, dk: Sequence[int], dtype, key_given: bool,
                       key_lengths: Any, names: tuple = ("x", "key")) -> Variants:
    """The checked :class:`Variants` of the keywords in ``v`` (names as in
    VARIANT_DEFAULTS; missing ones are off); ``names``: the call's words for
    its query and key inputs."""
    get = lambda n: v.get(n, VARIANT_DEFAULTS[n])  # noqa: E731
    cu_q, cu_k = _packing(get("cu_seqlens"), get("key_cu_seqlens"), batched, Tq, Tk,
                          key_given, key_lengths, names)
    rd, inter, freq = _rope(get("rope"), dk)
    pos = _positions("positions", get("positions"), B, Tq, batched, "query row")
    kpos = _positions("key_positions", get("key_positions"), B, Tk, batched, "key row")
    if rd == 0 and (pos is not None or kpos is not None):
        raise ValueError(f"{'positions' if pos is not None else 'key_positions'}: "
                         "positions are used by RoPE only; pass rope=mhattn.RoPE(...)")
    alibi = get("alibi_slopes")
    if alibi is not None:
        alibi = _alibi(alibi, H, B, batched, cu_q)
    sinks = get("sinks")
    p = dropout_arg(get("dropout"))
    return Variants(
        window=_window(get("window")), softcap=_softcap(get("softcap")),
        alibi=alibi,
        sinks=None if sinks is None else _per_head("sinks", sinks, H, 1, False, dtype)[0],
        q_norm=_norm_weight("q_norm", get("q_norm"), H, "query head", dk, dtype),
        k_norm=_norm_weight("k_norm", get("k_norm"), G, "key/value head", dk, dtype),
        norm_eps=_eps(get("norm_eps")), norm_type=norm_type_arg(get("norm_type")),
        rotary_dim=rd, interleaved=inter, inv_freq=freq,
        positions=pos, key_positions=kpos,
        key_mask=_key_mask(get("key_mask"), B, Tk, batched), cu_q=cu_q, cu_k=cu_k,
        dropout=p, seed=dropout_seed(get("seed"), p),
        rel=_relative_bias(get("relative_bias"), H, dtype), chunk=_chunk(get("chunk")),
        block_mask=_block_mask(get("block_mask"), B, H, Tq, Tk),
        q_offset=_q_offset(v.get("q_offset")))


def variants_tuple(call: Any, always: bool = False):
    """The glue's ``variants`` argument for ``call.var`` (a :class:`Variants`):
    None when every variant is off (unless ``always``), else the tuple whose
    layout csrc/python/variants.c (read_variants) gives. A norm_type other
    than the default counts as given: the core reads its name (and refuses
    an unknown one) even where no norm weight uses it."""
    return variants_tuple_of(call.var, always)


def variants_tuple_of(v: Variants, always: bool = False):
    """:func:`variants_tuple` of a :class:`Variants` ``v``."""
    if not (v.any or always or v.norm_type != VARIANT_DEFAULTS["norm_type"]):
        return None
    window = None
    if v.window is not None:
        window = tuple(-1 if side is None else side for side in v.window)
    return (window, 0.0 if v.softcap is None else v.softcap, v.alibi, v.sinks,
            v.key_mask, v.cu_q, v.cu_k, v.q_norm, v.k_norm, v.norm_eps, v.norm_type,
            v.rotary_dim, v.interleaved, v.inv_freq, v.positions, v.key_positions,
            v.dropout, v.seed, v.rel, v.chunk,
            None if v.block_mask is None else v.block_mask._glue(), v.q_offset)


def variant_floats(v: dict) -> list:
    """The learnable variants given as arrays (sinks, q_norm, k_norm, T5's
    table): they
    take part in choosing the compute dtype, as the biases do."""
    out = []
    for n in ("sinks", "q_norm", "k_norm"):
        a = v.get(n)
        if a is not None:
            out.append(_real_array(n, a))
    rb = v.get("relative_bias")
    if isinstance(rb, RelativeBias):
        out.append(rb.table)
    return out


def sequence_ids(cu: np.ndarray, total: int) -> np.ndarray:
    """(total,) int: the packed sequence each row belongs to."""
    return np.searchsorted(cu, np.arange(total), side="right") - 1


def query_positions(var: Variants, B: int, Tq: int, Tk: int, *,
                    for_rope: bool = True) -> np.ndarray:
    """(B, Tq) int64: each query's position: p_i = i + (T_k - T_q) (i +
    q_offset when given), within its own sequence when packed, or
    ``positions=`` for RoPE."""
    if for_rope and var.positions is not None:
        return np.broadcast_to(var.positions, (B, Tq))
    i = np.arange(Tq, dtype=np.int64)
    if var.packed:
        s = sequence_ids(var.cu_q, Tq)
        nq, nk = np.diff(var.cu_q), np.diff(var.cu_k)
        p = i - var.cu_q[s] + (nk[s] - nq[s])
    else:
        p = i + (Tk - Tq if var.q_offset is None else var.q_offset)
    return np.broadcast_to(p, (B, Tq))


def key_positions_of(var: Variants, B: int, Tk: int, *, for_rope: bool = True) -> np.ndarray:
    """(B, Tk) int64: each key's position j (within its sequence when
    packed), or ``key_positions=`` for RoPE."""
    if for_rope and var.key_positions is not None:
        return np.broadcast_to(var.key_positions, (B, Tk))
    j = np.arange(Tk, dtype=np.int64)
    if var.packed:
        j = j - var.cu_k[sequence_ids(var.cu_k, Tk)]
    return np.broadcast_to(j, (B, Tk))
