"""Attention on tensors that are already projected: mhattn.attention, its
gradient and the exact merge of attention over disjoint key sets.

The letters follow ``csrc/mha.h``: B batch, H query heads, G key/value heads
(G < H: grouped-query attention, query head h uses kv head h // (H // G)),
Tq queries, Tk keys, dk and dv the head widths.

Layouts: ``"bhtd"`` is q (B, H, Tq, dk), k (B, G, Tk, dk), v (B, G, Tk, dv);
``"bthd"`` swaps the head and time axes, q (B, Tq, H, dk), as FlashAttention,
JAX and Hugging Face's caches hold them.  Either may drop the batch axis.
Both are handed to the C core as strided views (``np.swapaxes``), so nothing
is copied when the last axis is contiguous.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, Optional

import numpy as np

from .._internal import core
from .._internal.args import (_cast, _normalize_lengths, _scale_arg, bool_arg, check_memory,
                              compute_dtype, head_scales, mask_and_form, mask_grad_arg,
                              mask_gradient)
from .._internal.arrays import _check_numeric, _to_array
from .._internal.core import variant_args
from .._internal.half import F32, half_of, is_half, narrow, narrow_like, shared_half
from .._internal.variants import Variants, dropout_kwargs, normalize_variants
from .paged import paged_attention

__all__ = ["attention", "attention_grad", "merge_attention", "Projected",
           "check_projected", "projected_variants"]

_LAYOUTS = ("bhtd", "bthd")
# The variant keywords of attention on projected tensors: the score rules.
# The q/k transforms (q_norm, k_norm, rope) belong to the projections.
_ATTENTION_VARIANTS = ("window", "softcap", "alibi_slopes", "sinks", "key_mask",
                       "cu_seqlens", "key_cu_seqlens", "relative_bias", "chunk", "block_mask",
                       "q_offset")
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
# (H, dk, scale) -> the glue's read-only scales (H,): a decode step builds none.
_SCALES: Dict[tuple, np.ndarray] = {}


class Projected(SimpleNamespace):
    """The checked q, k, v of one call, as batched bhtd views of one dtype,
    with B, H, G, Tq, Tk, dk, dv, dtype (the compute dtype), out_dtype (the
    results': dtype, or the inputs' half dtype), batched and layout."""


def _layout(layout: Any) -> str:
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise ValueError(f"layout: expected 'bhtd' (B, H, T, d) or 'bthd' (B, T, H, d), "
                         f"got {layout!r}")
    return layout


def _read(name: str, obj: Any) -> np.ndarray:
    a = _to_array(name, obj)
    _check_numeric(name, a)
    if a.ndim not in (3, 4):
        raise ValueError(f"{name}: expected a 4-D (B, heads, T, d) array or an unbatched "
                         f"3-D one, got shape {a.shape}")
    return a


def check_projected(q, k, v, layout: str = "bhtd") -> Projected:
    """Check q, k and v against each other; every error names the argument
    and the shapes seen.  Returns a :class:`Projected` whose q, k, v are
    bhtd views (B, heads, T, d) in the compute dtype (float32 or float64)."""
    layout = _layout(layout)
    arrays = [_read("q", q), _read("k", k), _read("v", v)]
    seen = f"(q {arrays[0].shape}, k {arrays[1].shape}, v {arrays[2].shape}, " \
           f"layout={layout!r})"
    nd = arrays[0].ndim
    for name, a in zip("kv", arrays[1:]):
        if a.ndim != nd:
            raise ValueError(f"{name}: has {a.ndim} dimensions but q has {nd} {seen}")
    half = shared_half(list(zip("qkv", arrays)))
    dts = {a.dtype for a in arrays}
    dtype = F32 if half is not None else dts.pop() if (
        len(dts) == 1 and arrays[0].dtype in _FLOATS) else compute_dtype(arrays)
    views = []
    for a in arrays:
        a = _cast(a, dtype)
        if nd == 3:
            a = a[np.newaxis]
        views.append(np.swapaxes(a, 1, 2) if layout == "bthd" else a)
    qb, kb, vb = views
    (B, H, Tq, dk), (Bk, G, Tk, dkk), (Bv, Gv, Tv, dv) = qb.shape, kb.shape, vb.shape
    if Bk != B or Bv != B:
        raise ValueError(f"{'k' if Bk != B else 'v'}: batch size disagrees with q's {seen}")
    if Gv != G:
        raise ValueError(f"v: has {Gv} heads but k has {G} {seen}")
    if Tv != Tk:
        raise ValueError(f"v: has {Tv} keys but k has {Tk}; they must share T_k {seen}")
    if dkk != dk:
        raise ValueError(f"k: its width d_k = {dkk} differs from q's {dk} {seen}")
    # H a positive multiple of G, and heads at least one column wide: the
    # core's rules, checked once there (core.attention).
    return Projected(q=qb, k=kb, v=vb, B=B, H=H, G=G, Tq=Tq, Tk=Tk, dk=dk, dv=dv,
                     dtype=dtype, out_dtype=dtype if half is None else half,
                     batched=nd == 4, layout=layout)


def projected_variants(p: Projected, variants: Dict[str, Any],
                       key_lengths: Any = None) -> Variants:
    """The checked score variants of a call on projected tensors."""
    return normalize_variants(variants, batched=p.batched, B=p.B, Tq=p.Tq, Tk=p.Tk,
                              H=p.H, G=p.G, dk=[p.dk] * p.G, dtype=p.dtype,
                              key_given=True, key_lengths=key_lengths,
                              names=("q", "k"))


def _glue_args(p: Projected, scale, mask, causal, key_lengths, variants) -> tuple:
    """(scales, mask, causal, key_lengths, variants) as the glue takes them,
    and the mask's (shape, dtype) as given (None, None without one)."""
    if p.batched and variants.get("cu_seqlens") is not None:
        raise ValueError(f"cu_seqlens: packed sequences take unbatched 3-D q, k, v, the "
                         f"tokens along T (q (H, total, d_k) with layout='bhtd'); got q "
                         f"of {p.B} batch items")
    var = None
    if any(a is not None for a in variants.values()):
        var = variant_args(SimpleNamespace(var=projected_variants(p, variants,
                                                                  key_lengths)))
    scales = _scales(p.H, p.dk, _scale_arg(scale))
    causal = bool_arg("causal", causal)
    m, mshape, mdtype = mask_and_form(mask, p.batched, p.B, p.H, p.Tq, p.Tk, p.dtype)
    kl = _normalize_lengths(key_lengths, p.batched, p.B, p.Tk)
    return scales, m, causal, kl, var, (mshape, mdtype)


def _scales(H: int, dk: int, scale: Optional[float]) -> np.ndarray:
    """The glue's scales (H,) float64, read-only, kept for the next call."""
    key = (H, dk, scale)
    a = _SCALES.get(key)
    if a is None:
        a = np.asarray(head_scales(H, H, [dk] * H, scale), dtype=np.float64)
        a.flags.writeable = False
        # NaN != NaN, and 0.0 == -0.0 would hand one the other's array.
        if len(_SCALES) < 256 and (scale is None or (scale == scale and scale)):
            _SCALES[key] = a
    return a


def _unbatch(p: Projected, a):
    return a if a is None or p.batched else a[0]


def _bhtd(p: Projected, a: np.ndarray) -> np.ndarray:
    """A (B, H, T, d) result in the call's layout, unbatched if the call was."""
    if p.layout == "bthd":
        a = np.ascontiguousarray(np.swapaxes(a, 1, 2))
    return _unbatch(p, a)


def attention(q, k=None, v=None, *, layout="bhtd", scale=None, mask=None, causal=False,
              key_lengths=None, return_weights=False, return_lse=False, window=None,
              softcap=None, alibi_slopes=None, sinks=None, key_mask=None,
              cu_seqlens=None, key_cu_seqlens=None, dropout=0.0, seed=None,
              relative_bias=None, chunk=None, block_mask=None, q_offset=None,
              cache=None, sequence_ids=None):
    """Scaled dot-product attention on tensors that are already projected.

    attention(q, k, v, *, layout="bhtd", scale=None, mask=None, causal=False,
              key_lengths=None, return_weights=False, return_lse=False, **variants)
        -> out | (out, weights) | (out, lse) | (out, weights, lse)

    For each query head h: softmax(q_h k_g^T * scale) v_g with g = h // (H // G),
    computed by the C core's fused kernels (no Python loop over heads), on
    every ISA, bitwise the same for any thread count.

    Parameters
    ----------
    q : (B, H, T_q, d_k), or (B, T_q, H, d_k) with ``layout="bthd"``
    k : (B, G, T_k, d_k), or (B, T_k, G, d_k)
    v : (B, G, T_k, d_v), or (B, T_k, G, d_v)
        G < H is grouped-query attention (G must divide H).  Each may drop
        the batch axis (unbatched 3-D inputs, all three alike).  Any strides
        are read in place when the last axis is contiguous; float32 stays
        float32, anything else follows NumPy promotion with a float32 floor;
        float16 or bfloat16 (all three alike) are computed in float32 and
        the results rounded once into that dtype.  Without ``cache`` k and
        v are required; with a :class:`mhattn.PagedKVCache` as ``cache``
        they are the new rows (n, G, T_new, d) to append before attending,
        or None.
    layout : "bhtd" (default) or "bthd"
    scale : float, optional
        Multiplier of q k^T; default 1/sqrt(d_k). It must be finite and within the call's dtype's largest value.
    mask, causal, key_lengths
        As :func:`mhattn.multi_head_attention`: ``mask`` bool (True = may
        attend) or float (added), broadcastable to (B, H, T_q, T_k);
        ``causal`` bottom-right aligned (query i sees keys j <= i + T_k - T_q);
        ``key_lengths`` (B,) (a scalar unbatched): keys >= the length are
        padding.
    return_weights : bool, default False
        Also return the post-softmax weights (B, H, T_q, T_k).
    return_lse : bool, default False
        Also return each row's log-sum-exp (B, H, T_q) of its finished
        scores, in **natural log** (not base 2), the sinks included, and
        **-inf for a fully masked row** (without sinks).  Always (B, H, T_q),
        whatever the layout; :func:`merge_attention` takes it.
    window, softcap, alibi_slopes, sinks, key_mask, cu_seqlens, key_cu_seqlens
        The score variants of :func:`mhattn.multi_head_attention`, with the
        same meanings and checks.  Packed sequences take unbatched 3-D
        inputs, the tokens along T.  The q/k transforms (q_norm, k_norm,
        RoPE) are not attention keywords: apply them before.
    dropout, seed
        As :func:`mhattn.multi_head_attention`.
    relative_bias
        As :func:`mhattn.multi_head_attention`.
    chunk, block_mask
        As :func:`mhattn.multi_head_attention`.
    q_offset : int, optional
        Where the queries sit: query i at position ``i + q_offset``, key j at
        j, for causal masking, the window, ``chunk`` and ALiBi's distances.
        None (the default) is the bottom-right placement ``q_offset = T_k -
        T_q``.  A block of a longer call, queries from q0 against keys from
        k0, passes ``q_offset = q0 + (T_k - T_q) - k0`` (of the whole call)
        to see exactly the whole call's causal, window and ALiBi rules
        (:mod:`mhattn.dask` does; ``chunk``'s boundaries too when k0 is a
        multiple of chunk, since key j of the block sits at j).  Any
        sign; a row that sees no key has lse -inf and out 0.  A value that is
        not an int raises TypeError naming q_offset; not with packed
        sequences (cu_seqlens) or relative_bias (ValueError).
    cache : mhattn.PagedKVCache, optional
        Attention of q (n, H, T_new, d_k) over the cached keys of the
        sequences ``sequence_ids`` (row i of q is sequence_ids[i]), each
        query aligned bottom-right to its sequence's length (``causal=True``
        for a prefill's rows).  With k and v (n, G, T_new, d_k | d_v) given,
        they are appended first, under the cache's lock, as
        ``cache.append(sequence_ids, k, v)``; without them nothing is
        written.  Not with mask, key_lengths, key_mask or packed sequences;
        the weights, if returned, are (n, H, T_new, max length).  The core
        reads the pages in place, through a block table.
    sequence_ids : list of n ints, with a PagedKVCache as ``cache``
        The sequences (ids from ``cache.add_sequence()``, each at most
        once) whose new rows the call holds: row i of the batch is sequence
        sequence_ids[i], at its own length (RoPE, causal alignment).  Any
        subset of the cache's sequences, of any lengths, decodes or
        prefills in one call; the core reads their pages in place through a
        block table.

    Returns
    -------
    out : in the layout of q: (B, H, T_q, d_v) or (B, T_q, H, d_v), new and
        C-contiguous, of the compute dtype, or of q's half dtype (float16,
        bfloat16).  A fully masked query row gets 0, never NaN.
    weights : (B, H, T_q, T_k), when ``return_weights``; the dtype of out.
    lse : (B, H, T_q), when ``return_lse``; float32 in a half call.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 8, 5, 16)).astype(np.float32)
    >>> k = rng.standard_normal((2, 2, 7, 16)).astype(np.float32)   # GQA, G = 2
    >>> v = rng.standard_normal((2, 2, 7, 16)).astype(np.float32)
    >>> out, lse = mhattn.attention(q, k, v, causal=True, return_lse=True)
    >>> out.shape, lse.shape
    ((2, 8, 5, 16), (2, 8, 5))
    """
    if cache is not None:
        # A paged cache (compute/paged.py): q's rows over each listed
        # sequence's cached keys, k and v (if given) appended first.
        for name, a in (("mask", mask), ("key_lengths", key_lengths), ("key_mask", key_mask),
                        ("cu_seqlens", cu_seqlens), ("key_cu_seqlens", key_cu_seqlens),
                        ("block_mask", block_mask), ("q_offset", q_offset)):
            if a is not None:
                raise ValueError(f"{name}: not with cache= (the keys are the cache's, each "
                                 f"sequence's length its own)")
        if sequence_ids is None:
            raise ValueError("sequence_ids: required with cache= (row i of q is sequence "
                             "sequence_ids[i] of the cache)")
        variants = dict(window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                        sinks=sinks, relative_bias=relative_bias, chunk=chunk,
                        **dropout_kwargs(dropout, seed))
        return paged_attention(q, k, v, cache=cache, sequence_ids=sequence_ids, scale=scale,
                               causal=causal, return_weights=return_weights,
                               return_lse=return_lse, variants=variants, layout=layout)
    if sequence_ids is not None:
        raise ValueError("sequence_ids: only with cache= (a PagedKVCache)")
    if k is None or v is None:
        raise TypeError(f"{'k' if k is None else 'v'}: required without cache= (None only "
                        f"with a PagedKVCache, whose new rows it is)")
    p = check_projected(q, k, v, layout)
    want_w = bool_arg("return_weights", return_weights)
    want_lse = bool_arg("return_lse", return_lse)
    variants = dict(window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                    key_mask=key_mask, cu_seqlens=cu_seqlens, key_cu_seqlens=key_cu_seqlens,
                    relative_bias=relative_bias, chunk=chunk, block_mask=block_mask,
                    q_offset=q_offset,
                    **dropout_kwargs(dropout, seed))
    scales, m, c, kl, var, _ = _glue_args(p, scale, mask, causal, key_lengths, variants)
    n = p.dtype.itemsize
    check_memory([("out", "B*h*T_q*d_v", (p.B, p.H, p.Tq, p.dv), n),
                  ("the log-sum-exp", "B*h*T_q", (p.B, p.H, p.Tq), n)]
                 + ([("return_weights=True", "B*h*T_q*T_k", (p.B, p.H, p.Tq, p.Tk), n)]
                    if want_w else []))
    out, weights, lse = core.attention(p.q, p.k, p.v, scales, m, c, kl, var, False,
                                     p.layout == "bthd", want_w, want_lse)
    result = (_unbatch(p, narrow_like(out, p.out_dtype)),)
    if want_w:
        result += (_unbatch(p, narrow_like(weights, p.out_dtype)),)
    if want_lse:
        result += (_unbatch(p, lse),)
    return result if len(result) > 1 else result[0]


def attention_grad(grad_out, q, k, v, *, layout="bhtd", scale=None, mask=None,
                   causal=False, key_lengths=None, window=None, softcap=None,
                   alibi_slopes=None, sinks=None, key_mask=None, cu_seqlens=None,
                   key_cu_seqlens=None, dropout=0.0, seed=None, relative_bias=None,
                   chunk=None, block_mask=None, q_offset=None, lse=None, out=None,
                   mask_grad=False) -> Dict[str, np.ndarray]:
    """Gradients of :func:`attention` with respect to q, k, v (and sinks).

    attention_grad(grad_out, q, k, v, *, <attention's keywords>, lse=None,
                   out=None) -> {'q': dq, 'k': dk, 'v': dv(, 'sinks': dsinks)}

    Parameters
    ----------
    grad_out : the shape of attention's ``out``
        dL/dout of a scalar loss L.
    q, k, v, layout, scale, mask, causal, key_lengths
        As :func:`attention` (not ``return_weights`` / ``return_lse``).
    window, softcap, alibi_slopes, sinks, key_mask, cu_seqlens, key_cu_seqlens
        As :func:`attention`.
    dropout, seed
        As :func:`attention`: the same seed gives the forward's mask.
    relative_bias
        As :func:`attention`; its table's gradient is 'relative_bias'.
    chunk, block_mask
        As :func:`attention`.
    q_offset
        As :func:`attention`.
    lse : (B, H, T_q), optional
        The forward's ``return_lse=True`` result, given with ``out``.
    out : the forward's ``out``, optional
        Given with ``lse``, no forward pass is run; with neither, the
        forward is recomputed (the backward needs both).  One without the
        other raises ValueError naming the missing one.
    mask_grad : bool, default False
        Also return ``'mask'``, the gradient of the additive (float) ``mask``
        (a learned bias: a relative-position table's scores, a FlexAttention
        ``score_mod`` over a captured tensor), summed over the axes along
        which the mask was broadcast: a (T_q, T_k) mask gets a (T_q, T_k)
        gradient, a (B, 1, 1, T_k) one a (B, 1, 1, T_k) gradient.  The core
        writes dL/dmask at every (b, h, i, j) (a B*h*T_q*T_k array, made only
        when asked for) and NumPy sums it, the same for any thread count.
        Keys a row does not see get 0.  A bool mask, or none, raises
        ValueError naming mask_grad.

    Returns
    -------
    dict
        'q', 'k', 'v': gradients in their arguments' layouts and shapes
        (new arrays of the compute dtype, or of q's half dtype, each
        rounded once); 'sinks' (H,) when ``sinks`` is given (half if it
        was); 'mask', shaped as ``mask``, with ``mask_grad=True``.  ALiBi
        slopes and bool masks get none.  Fully masked rows
        contribute zero.  In a half call ``out`` and ``grad_out`` of
        another half dtype raise TypeError; a half ``out`` enters the
        backward rounded, as FlashAttention's does (without it, the
        forward is recomputed in float32).

    Examples
    --------
    >>> q = k = v = np.random.default_rng(0).standard_normal((1, 2, 4, 8))
    >>> out, lse = mhattn.attention(q, k, v, causal=True, return_lse=True)
    >>> g = mhattn.attention_grad(np.ones_like(out), q, k, v, causal=True,
    ...                           lse=lse, out=out)
    >>> sorted(g), g['q'].shape
    (['k', 'q', 'v'], (1, 2, 4, 8))
    """
    p = check_projected(q, k, v, layout)
    variants = dict(window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                    key_mask=key_mask, cu_seqlens=cu_seqlens, key_cu_seqlens=key_cu_seqlens,
                    relative_bias=relative_bias, chunk=chunk, block_mask=block_mask,
                    q_offset=q_offset,
                    **dropout_kwargs(dropout, seed))
    scales, m, c, kl, var, (mshape, mdtype) = _glue_args(p, scale, mask, causal, key_lengths,
                                                         variants)
    want_dmask = mask_grad_arg(mask_grad, m)
    want = (p.B, p.Tq, p.H, p.dv) if p.layout == "bthd" else (p.B, p.H, p.Tq, p.dv)
    want = want if p.batched else want[1:]
    g = _as_like("grad_out", grad_out, want, p)
    # each one given is checked, then they are used together: one alone
    # names its missing partner
    o = None if out is None else _as_like("out", out, want, p)
    ls = None if lse is None else _as_like(
        "lse", lse, (p.B, p.H, p.Tq) if p.batched else (p.H, p.Tq), p, swap=False)
    if (o is None) != (ls is None):
        have, missing = ("lse", "out") if o is None else ("out", "lse")
        raise ValueError(f"{missing}: required with {have} (give the forward's out and "
                         f"lse together, or neither to have them recomputed)")
    if o is None:
        o, _, ls = core.attention(p.q, p.k, p.v, scales, m, c, kl, var, False, False,
                                False, True)
    # want_dmask: dmask, then with T5's bias drel_table, close the tuple.
    dq, dk, dv, dsinks, *rest = core.attention_backward(
        g, p.q, p.k, p.v, o, ls, scales, m, c, kl, var, False,
        **({"want_dmask": True} if want_dmask else {}))
    drel = rest.pop() if relative_bias is not None else None
    grads = {"q": _bhtd(p, dq), "k": _bhtd(p, dk), "v": _bhtd(p, dv)}
    if want_dmask:
        grads["mask"] = mask_gradient(rest[0], mshape, p.batched)
    if p.out_dtype != p.dtype:   # half: each gradient rounded once to q's dtype
        grads = {n: narrow(a, p.out_dtype) if n != "mask" or is_half(mdtype) else a
                 for n, a in grads.items()}
    # A variant's gradient: half when its array was given half.
    for name, given, gv in (("sinks", sinks, dsinks),
                            ("relative_bias", getattr(relative_bias, "table", None), drel)):
        if given is not None:
            grads[name] = gv if p.out_dtype == p.dtype or not is_half(
                getattr(given, "dtype", np.dtype(np.float64))) else narrow(gv, p.out_dtype)
    return grads


def _as_like(name: str, obj: Any, shape: tuple, p: Projected, swap: bool = True):
    """grad_out, out or lse checked against ``shape`` (in the call's layout),
    as a batched bhtd view of the compute dtype."""
    a = _to_array(name, obj)
    _check_numeric(name, a)
    if a.shape != shape:
        raise ValueError(f"{name}: expected shape {shape} (the forward's), got {a.shape}")
    if is_half(a.dtype) and half_of(a.dtype) != p.out_dtype:
        raise TypeError(f"{name}: dtype {a.dtype} does not match q's {p.out_dtype}")
    a = _cast(a, p.dtype)
    if not p.batched:
        a = a[np.newaxis]
    return np.swapaxes(a, 1, 2) if swap and p.layout == "bthd" else a


def merge_attention(outs, lses, *, layout="bhtd"):
    """Merge attention computed over disjoint sets of keys into the attention
    over their union: exactly one softmax over all the keys.

    merge_attention(outs, lses, *, layout="bhtd") -> (out, lse)

    With parts i of outputs o_i and log-sum-exps l_i (natural log), the
    merged lse is L = log(sum_i exp(l_i)) and out = sum_i exp(l_i - L) o_i.

    Parameters
    ----------
    outs : sequence of arrays, each (..., H, T_q, d_v) ("bhtd") or
        (..., T_q, H, d_v) ("bthd"), as :func:`attention` returns them
    lses : sequence of arrays, each (..., H, T_q)
        Their ``return_lse=True`` results.  A part whose lse is -inf (no key
        visible: fully masked) gets weight 0, and no NaN arises; a row that
        is -inf in every part stays lse -inf, out 0.
    layout : "bhtd" (default) or "bthd", the layout of ``outs``

    Returns
    -------
    (out, lse) : the merged output, shaped as each part, and lse (..., H, T_q).
        Half parts (float16, bfloat16; one dtype) merge in float32 and the
        out is rounded once to their dtype; the lse is then float32.

    Parts computed with ``sinks`` each count the sink once: merge parts
    without sinks (the sinks belong to the whole softmax, not to a part).

    The merge is the unsplit call's result under IEEE arithmetic: a part
    whose lse is -inf has no visible key and contributes nothing (its out
    is never read, so a part's garbage there cannot leak in); a part that
    contributes with a NaN lse (a NaN score) makes its row's out and lse
    NaN, and a NaN in its out gives NaN where the unsplit call's would.

    Examples
    --------
    >>> q, k, v = (np.random.default_rng(0).standard_normal((1, 2, 3, 4)) for _ in "qkv")
    >>> a = mhattn.attention(q, k[:, :, :2], v[:, :, :2], return_lse=True)
    >>> b = mhattn.attention(q, k[:, :, 2:], v[:, :, 2:], return_lse=True)
    >>> out, lse = mhattn.merge_attention([a[0], b[0]], [a[1], b[1]])
    >>> np.allclose(out, mhattn.attention(q, k, v))
    True
    """
    layout = _layout(layout)
    outs = [_to_array(f"outs[{i}]", o) for i, o in enumerate(_parts("outs", outs))]
    lses = [_to_array(f"lses[{i}]", s) for i, s in enumerate(_parts("lses", lses))]
    if not outs or len(outs) != len(lses):
        raise ValueError(f"outs, lses: expected the same non-zero number of parts, got "
                         f"{len(outs)} and {len(lses)}")
    for i, (o, s) in enumerate(zip(outs, lses)):
        _check_numeric(f"outs[{i}]", o)
        _check_numeric(f"lses[{i}]", s)
        if o.ndim < 3:
            raise ValueError(f"outs[{i}]: expected (..., H, T_q, d_v), got shape {o.shape}")
        if o.shape != outs[0].shape:
            raise ValueError(f"outs[{i}]: shape {o.shape} differs from outs[0]'s "
                             f"{outs[0].shape}; the parts must have one shape")
        lead = o.shape[:-3] + ((o.shape[-3], o.shape[-2]) if layout == "bhtd"
                               else (o.shape[-2], o.shape[-3]))
        if s.shape != lead:
            raise ValueError(f"lses[{i}]: expected shape {lead} to match outs[{i}] "
                             f"{o.shape} (layout={layout!r}), got {s.shape}")
    # Half outs: merged in float32, the out rounded once to their dtype (the
    # lse stays float32, as attention returns it).
    half = shared_half([(f"outs[{i}]", o) for i, o in enumerate(outs)])
    dtype = F32 if half is not None else compute_dtype(outs + lses)
    outs = [_cast(o, dtype) for o in outs]
    lse_all = np.stack([_cast(s, dtype) for s in lses])
    # A part with lse -inf saw no key: it is selected out, never multiplied
    # (its out may hold anything). NaN != -inf: a NaN part contributes.
    seen = lse_all != -np.inf
    # Inf - inf, exp of +inf and the like are the IEEE arithmetic the merge
    # means (a +inf or NaN lse makes its row NaN, as in the unsplit call).
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        top = lse_all.max(axis=0)            # NaN if a part's lse is NaN
        top = np.where(top == -np.inf, 0, top)
        w = np.where(seen, np.exp(lse_all - top), 0)
        total = w.sum(axis=0)
        some = seen.any(axis=0)             # total >= 1 there, or NaN
        lse = np.where(some, top + np.log(np.where(some, total, 1)), -np.inf)
        share = np.where(some, w / np.where(some, total, 1), 0).astype(dtype)
        if layout == "bthd":
            share, seen = np.swapaxes(share, -1, -2), np.swapaxes(seen, -1, -2)
        out = np.zeros(outs[0].shape, dtype)
        for part, s, o in zip(share, seen, outs):
            term = part[..., np.newaxis] * o
            if not s.all():
                term = np.where(s[..., np.newaxis], term, 0)
            out += term
    return (out if half is None else narrow(out, half)), lse.astype(dtype)


def _parts(name: str, parts: Any) -> list:
    """The list of a merge's parts: a list, tuple or other iterable of
    arrays, one per part, never one array (whose rows would be read as
    parts)."""
    if parts is None or isinstance(parts, (str, bytes, dict)) or hasattr(parts, "shape") \
            or hasattr(parts, "__array__") or not hasattr(parts, "__iter__"):
        got = (f"one array of shape {tuple(parts.shape)}" if hasattr(parts, "shape")
               else repr(parts) if parts is None else type(parts).__name__)
        raise TypeError(f"{name}: expected a list of arrays, one per part, got {got}")
    return list(parts)
