"""mhattn.multi_head_attention: checks arguments in Python, computes in C."""
from __future__ import annotations

import numpy as np

from .._internal import core
from .._internal.core import make_context, run_core
from .._internal.half import is_bfloat16, narrow, narrow_like, widen
from .._internal.variants import VARIANT_DEFAULTS, variant_kwargs
from .cache import cached_step
from .paged import PagedKVCache, paged_step
from .packed import PackedWeights, call_weights

__all__ = ["multi_head_attention", "run_core"]

_EPS = VARIANT_DEFAULTS["norm_eps"]
_RMS = VARIANT_DEFAULTS["norm_type"]
_NODROP = VARIANT_DEFAULTS["dropout"]


_ndarray = np.ndarray
_HALVES = (np.dtype(np.float16),)


def _widened(x, key, value, numbers: tuple, packed):
    """(x, key, value, (w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o)) widened to
    float32, for the fast branch of a half call whose numbers are plain
    ndarrays of x's (native) half dtype; None for anything else, which the
    slow branch checks and names. The weights of a half PackedWeights are
    its float32 twins. Fused 2-D weights stay half: the core widens them as
    it packs them into its GEMM's panels (mha.h, ``w_storage``), and no
    float32 copy of them is made; only their biases are widened."""
    dt = x.dtype
    if not (dt in _HALVES or is_bfloat16(dt)) or not dt.isnative:
        return None
    if packed is not None and packed._wide is not None and packed.dtype == dt and all(
            a is b for a, b in zip(numbers, packed._args[:4] + packed._args[6:])):
        wide = packed._wide
    else:
        # the weights (numbers[:4]) stay half when fused: 2-D, as is w_o
        fused = all(a.ndim == 2 for a in numbers[:4] if type(a) is _ndarray)
        wide = []
        for i, a in enumerate(numbers):
            if a is None:
                wide.append(None)
            elif type(a) is _ndarray and a.dtype == dt:
                wide.append(a if fused and i < 4 else widen(a))
            else:
                return None
        if wide[0] is None or wide[1] is None or wide[2] is None:
            return None
    srcs = [widen(x)]
    for a in (key, value):
        if a is None:
            srcs.append(None)
        elif type(a) is _ndarray and a.dtype == dt:
            srcs.append(a if a is x else widen(a))
        else:
            return None
    if key is x:
        srcs[1] = srcs[0]
    if value is x or value is key:
        srcs[2] = srcs[0] if value is x else srcs[1]
    return (*srcs, tuple(wide))


def multi_head_attention(x, w_q, w_k=None, w_v=None, w_o=None, *, num_heads=None, key=None,
                         value=None, scale=None, return_weights=False, mask=None,
                         causal=False, key_lengths=None, num_kv_heads=None,
                         b_q=None, b_k=None, b_v=None, b_o=None, w_gate=None, b_gate=None,
                         return_context=False, window=None, softcap=None, alibi_slopes=None,
                         sinks=None, q_norm=None, k_norm=None, norm_eps=1e-6, norm_type="rms",
                         rope=None, positions=None, key_positions=None, key_mask=None,
                         cu_seqlens=None, key_cu_seqlens=None, dropout=0.0, seed=None,
                         relative_bias=None, chunk=None, block_mask=None, cache=None,
                         new_lengths=None, sequence_ids=None):
    """Multi-head attention, computed by mhattn's C core.

    multi_head_attention(x, w_q, w_k, w_v, w_o=None, *, num_heads=None,
                         key=None, value=None, scale=None, return_weights=False,
                         mask=None, causal=False, key_lengths=None,
                         num_kv_heads=None, b_q=None, b_k=None, b_v=None,
                         b_o=None, return_context=False)
        -> out | (out, weights) | (out, ctx) | (out, weights, ctx)

    Row-vector convention, as in the document: Q = X W^Q.  For each head i,
    head_i = softmax(Q_i K_i^T * scale_i) V_i, and the result is
    Concat(head_1, ..., head_h) W^O (+ b_o).

    Parameters
    ----------
    x : (T_q, d_in) or (B, T_q, d_in)
        The queries' source.
    w_q, w_k, w_v : weights, each in one of three forms
        fused 2-D (d_in, h*d_k), head i owning columns [i*d_k, (i+1)*d_k)
        (``num_heads`` required); stacked 3-D (h, d_in, d_k); or a list of h
        2-D arrays, whose widths may differ between heads and which may
        repeat one array (the document's shared W_V).  Or, in place of
        w_q and without w_k, w_v and w_o, a :class:`mhattn.PackedWeights`
        from :func:`mhattn.pack_weights`: the same result, bit for bit,
        without packing the weights on every call.
    w_o : (sum d_v, d_out) or None
        The output projection; None is the identity (returns the concat).
    num_heads : int
        Number of query heads; required for fused weights.
    key, value : arrays, optional
        Sources of keys and values for cross-attention: (T_k, d) or
        (B, T_k, d).  ``key`` defaults to ``x``, ``value`` to ``key``.
    scale : float, optional
        Multiplier of Q K^T; defaults to 1/sqrt(d_k) of each head. It must be
        finite and within the call's dtype's largest value.
    return_weights : bool
        Also return the post-softmax weights, (h, T_q, T_k) or (B, h, T_q, T_k).
    mask : bool or float array, optional
        Broadcastable to (B, h, T_q, T_k) (or (h, T_q, T_k) unbatched).
        Boolean: True means *may attend*.  Float: added to the scaled scores;
        -inf blocks.
    causal : bool
        Query i sees keys j <= i + (T_k - T_q): the triangle is aligned
        bottom-right, as in FlashAttention.  PyTorch SDPA's ``is_causal``
        aligns it top-left (j <= i); the two agree when T_q == T_k.
    key_lengths : int array (B,) or int
        Keys at positions >= length are padding and ignored.
    num_kv_heads : int, optional
        Grouped-query attention: w_k and w_v hold this many heads, and query
        head i uses kv head i // (num_heads // num_kv_heads).
    b_q, b_k, b_v : arrays, optional
        Biases in the form of their weights, added to the projections Q, K
        and V: 1-D (fused), 2-D (stacked) or a list of 1-D arrays (per head).
    b_o : (d_out,), optional
        The output bias.
    w_gate, b_gate : (d_in, sum d_v), optional
        The output gate (Keras's ``MultiHeadAttention(use_gate=True)``,
        Qwen3-Next's gated attention): the concatenation of the heads becomes
        ``sigmoid(x @ w_gate + b_gate) * concat`` (elementwise) before W^O.
        x is the queries' source, so each query row has its own gate, also
        in cross-attention.  ``b_gate`` (sum d_v,) needs ``w_gate``.
    return_context : bool
        Also return a :class:`mhattn.Context` for :func:`mhattn.backward`
        (O(T d) state: the projections, the concatenation and each row's
        log-sum-exp), so gradients need no second forward pass.
    window : (left, right), optional
        Sliding window: key j is visible from query i iff
        p_i - left <= j <= p_i + right, with p_i = i + (T_k - T_q); either
        side may be None (unbounded).  Mistral's ``sliding_window=W`` is
        ``window=(W-1, 0)`` with ``causal=True``.  Key blocks wholly outside
        the window are skipped.
    softcap : float >= 0, optional
        Gemma 2's logit softcapping: each scaled score s becomes
        softcap * tanh(s / softcap), before ALiBi and the masks. None or 0
        (FlashAttention's convention) for none; otherwise softcap and 1 / softcap
        must be finite in the call's dtype.
    alibi_slopes : (h,) or (B, h), optional; (n, h) with cu_seqlens
        ALiBi: adds -slope_h * abs(p_i - j) to the scores (no gradient). Finite,
        and slope * (max(T_q, T_k) - 1) within the call's dtype. With packed
        sequences, (n, h) gives each of the n sequences its own row of
        slopes (FlashAttention's varlen alibi_slopes).
    sinks : (h,), optional
        One learnable logit per query head, counted in the softmax's
        denominator as an extra key of value zero (gpt-oss); the returned
        weights exclude it, so a row sums to less than 1.
    q_norm, k_norm : (d_k,), (h, d_k) / (num_kv_heads, d_k), optional
        Norm weights of each head's q and k over its d_k features, after
        the projection and bias, before RoPE: RMSNorm (Qwen3, Gemma 3), or
        LayerNorm with ``norm_type="layer"``.
    norm_eps : float, default 1e-6
        The q/k norm's epsilon, added to the mean square (or the variance).
    norm_type : "rms" (default) or "layer"
        The q/k norm's kind, for ``q_norm`` and ``k_norm`` over each head's
        d_k features x: "rms", RMSNorm (Qwen3, Gemma 3),
        x / sqrt(mean(x**2) + norm_eps) * weight; or "layer", LayerNorm,
        (x - mean(x)) / sqrt(var(x) + norm_eps) * weight, var the biased
        (population) variance, as Flax NNX's
        ``MultiHeadAttention(normalize_qk=True)`` (ViT-22B).  No bias: Flax
        builds those LayerNorms with ``use_bias=False`` (a bare
        ``nnx.LayerNorm`` would have one), so there is none to match.
        Only read where ``q_norm`` or ``k_norm`` is given, but always checked:
        any other value raises ValueError naming norm_type and the accepted
        values.
    rope : mhattn.RoPE, optional
        Rotary embedding of q and k after the norm (see :class:`mhattn.RoPE`).
    positions, key_positions : int (T_q,) / (B, T_q), (T_k,) / (B, T_k), optional
        The positions RoPE uses (default p_i and j), e.g. HF's
        ``position_ids`` for a left-padded batch.
    key_mask : bool (T_k,) or (B, T_k), optional
        True = a real key; any padding pattern.  ANDed with every other rule;
        key blocks with no real key are skipped.
    cu_seqlens, key_cu_seqlens : int (n+1,), optional
        Packed sequences: x is (total, d_in) and holds n sequences at the
        offsets [0, ..., total]; each attends only within itself (causal and
        window too).  ``key_cu_seqlens`` gives the keys' offsets for packed
        cross-attention.
    dropout : float in [0, 1), default 0.0
        Dropout on the attention weights, as PyTorch's ``dropout_p`` and
        FlashAttention's: after the softmax each weight is zeroed with
        probability ``dropout`` and the others are scaled by 1 / (1 - dropout).
        The keep mask is a counter-based hash of (seed, batch, head, query,
        key), so one seed gives the same mask, and the same bits, for any
        thread count, tiling or ISA; the backward regenerates it.  The
        log-sum-exp is the softmax's, before dropout.  Weights returned with
        ``return_weights=True`` are those after dropout.  0 (the default) is
        off; a value outside [0, 1) raises ValueError.
    seed : int, numpy.random.Generator or None, default None
        The seed of ``dropout``'s mask: an int in [0, 2**64), or a
        ``numpy.random.Generator`` from which one 64-bit seed is drawn; None
        draws one from fresh OS entropy (a new mask on each call).  A
        context (``return_context=True``) keeps the seed for its backward.
        Anything else raises ValueError naming seed.
    relative_bias : mhattn.RelativeBias, optional
        T5's relative position bias (:class:`mhattn.RelativeBias`): score (i, j)
        of head h gains ``table[bucket(j - p_i), h]``, after the softcap and
        ALiBi, before the additive mask, with transformers' ``T5Attention``
        buckets.  One bias per distance and head is looked up per call; no
        (T_q, T_k) array is made.  Its table's gradient is ``'relative_bias'``
        in the ``_grad`` functions' results.  A table whose shape is not
        (num_buckets, h) raises ValueError naming relative_bias.
    chunk : int, optional
        Chunked attention (Llama 4's chunked layers, FlashAttention 3's
        ``attention_chunk``): query i sees key j only when ``p_i // chunk ==
        j // chunk``, at the positions causal masking uses (so it lines up
        with a KV cache), ANDed with ``causal`` and every other rule.  Key
        blocks outside a row's chunk are skipped, forward and backward.  None
        (the default) is off; a value that is not a positive int raises
        TypeError or ValueError naming chunk.
    block_mask : mhattn.BlockMask, optional
        A :class:`mhattn.BlockMask` of shape (B or 1, h or 1, T_q, T_k): query
        i of head h in batch item b sees key j only where it is True, ANDed
        with ``mask``, ``causal``, the window, ``chunk``, the key lengths,
        ``key_mask`` and packed sequences.  Blocks it marks empty are skipped,
        forward and backward, and full ones cost no per-element test, so a
        document or prefix-LM mask costs what it keeps.  A BlockMask of another
        shape raises ValueError naming block_mask; not with ``cache=``.
    cache : mhattn.KVCache or mhattn.PagedKVCache, optional
        One step of a decoder through a key/value cache (prefill: many rows;
        decode: one): x holds only the new rows, (B, T_new, d_in) (or
        (T_new, d_in) with a cache of batch 1).  Only they are projected
        (q_norm, k_norm and RoPE at positions ``cache.lengths[b] + i``),
        their keys and values are appended to the cache, and the new
        queries attend over each sequence's cached keys, aligned
        bottom-right to its own length (pass ``causal=True`` for a
        decoder).  Not with key, value, mask, key_lengths, key_mask,
        positions, key_positions or packed sequences; the weights, if
        returned, are (B, h, T_new, capacity).  No gradients flow through
        a cache (``return_context=True`` raises).  On an error the cache
        is unchanged.  A :class:`mhattn.PagedKVCache` takes
        ``sequence_ids``: row i of x (n, T_new, d_in) is sequence
        sequence_ids[i], and the weights are (n, h, T_new, max length).
    new_lengths : int (B,), optional
        With ``cache``, a ragged step (prompts of different lengths):
        sequence b takes only the first new_lengths[b] rows of x; needs
        ``causal=True``; the other rows' outputs are 0.
    sequence_ids : list of n ints, with a PagedKVCache as ``cache``
        The sequences (ids from ``cache.add_sequence()``, each at most
        once) whose new rows the call holds: row i of the batch is sequence
        sequence_ids[i], at its own length (RoPE, causal alignment).  Any
        subset of the cache's sequences, of any lengths, decodes or
        prefills in one call; the core reads their pages in place through a
        block table.

    Returns
    -------
    out : (T_q, d_out) or (B, T_q, d_out), a new C-contiguous array
        float32 for float32 inputs, else float64; for float16 or bfloat16
        inputs (``ml_dtypes.bfloat16``), that dtype: computed in float32
        and rounded once to nearest even, so each element is within half
        an ulp of the exact value (2^-11 relative for float16, 2^-8 for
        bfloat16) plus 2^-16 of the largest magnitude of ``out``. In such a
        call x, key, value, the weights and their biases share one dtype
        (else TypeError naming both); masks, sinks and norms may be any
        float dtype.
    weights : returned too when ``return_weights``, in the dtype of ``out``.
    ctx : returned last when ``return_context``.

    A query row that may attend to no key at all is *fully masked*: its
    weights are 0 and each head contributes zeros, so its output is b_o (or
    0).  No NaN is produced for it.

    The order of a score's life: project (+ bias), q/k norm, RoPE, q.k,
    x scale, softcap, + ALiBi + additive mask, the visibility rules (mask,
    causal, window, key_mask, key_lengths, packed sequences), softmax with
    sinks, . V, concatenation, the output gate, W^O.

    Examples
    --------
    >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    >>> mhattn.multi_head_attention(X, w_q, w_k, w_v, w_o).shape
    (3, 4)
    >>> out = mhattn.multi_head_attention(X, w_q, w_k, w_v, w_o, causal=True,
    ...                                   window=(1, 0), softcap=30.0)
    >>> cache = mhattn.KVCache(1, 2, 16, 2, dtype=X.dtype)   # decode, row by row
    >>> steps = [mhattn.multi_head_attention(X[i:i + 1], w_q, w_k, w_v, w_o,
    ...                                      causal=True, cache=cache) for i in range(3)]
    >>> np.allclose(np.concatenate(steps), mhattn.multi_head_attention(
    ...     X, w_q, w_k, w_v, w_o, causal=True))
    True
    """
    # Every variant off (variants.VARIANT_DEFAULTS), checked without building
    # their dict: a chained `is` is all of them None. The fast branch needs
    # no more; the paths that take the variants build their dict there.
    # (tests/test_fast_path.py holds this list to VARIANT_DEFAULTS.)
    off = (window is softcap is alibi_slopes is sinks is q_norm is k_norm is rope is
           positions is key_positions is key_mask is cu_seqlens is key_cu_seqlens is
           relative_bias is chunk is block_mask is None
           and (norm_eps is _EPS or type(norm_eps) is float and norm_eps == _EPS)
           and (norm_type is _RMS or type(norm_type) is str and norm_type == _RMS)
           and (dropout is _NODROP or type(dropout) is float and dropout == 0) and seed is None
           and w_gate is b_gate is None)   # nor has the fast branch an output gate
    packed = None
    if type(w_q) is PackedWeights or w_k is None or w_v is None:
        packed, (w_q, w_k, w_v, w_o, num_heads, num_kv_heads, b_q, b_k, b_v, b_o) = \
            call_weights(w_q, w_k, w_v, w_o, num_heads, num_kv_heads, b_q, b_k, b_v, b_o)
    if isinstance(cache, PagedKVCache):
        return paged_step(x, w_q, w_k, w_v, w_o, cache=cache, sequence_ids=sequence_ids,
                          num_heads=num_heads, scale=scale, return_weights=return_weights,
                          causal=causal, num_kv_heads=num_kv_heads, b_q=b_q, b_k=b_k,
                          b_v=b_v, b_o=b_o, return_context=return_context, key=key,
                          value=value, mask=mask, key_lengths=key_lengths,
                          new_lengths=new_lengths, packed=packed, w_gate=w_gate,
                          b_gate=b_gate, **variant_kwargs(locals()))
    if sequence_ids is not None:
        raise ValueError("sequence_ids: only with a PagedKVCache as cache=")
    if cache is not None:
        return cached_step(x, w_q, w_k, w_v, w_o, cache=cache, num_heads=num_heads,
                           scale=scale, return_weights=return_weights, causal=causal,
                           num_kv_heads=num_kv_heads, b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o,
                           return_context=return_context, key=key, value=value,
                           mask=mask, key_lengths=key_lengths,
                           new_lengths=new_lengths, packed=packed, w_gate=w_gate,
                           b_gate=b_gate, **variant_kwargs(locals()))
    if new_lengths is not None:
        raise ValueError("new_lengths: only with cache= (a ragged cached step)")
    args = call = half = None
    if return_context is False and off:
        fx, fk, fv, fw = x, key, value, (w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o)
        if type(x) is _ndarray and x.dtype.itemsize == 2:
            # A half call of the common form takes the float32 branch on
            # its widened numbers (packed half weights keep theirs).
            wide = _widened(x, key, value, fw, packed)
            if wide is not None:
                half, (fx, fk, fv, fw) = x.dtype, wide
        args = core.fast(fx, fw[0], fw[1], fw[2], fw[3], num_heads, fk, fv, scale,
                         return_weights, mask, causal, key_lengths, num_kv_heads,
                         *fw[4:], half if half is not None and fw[0] is w_q else None)
        if args is None:
            half = None
    if args is None:
        args, call = core.slow(x, w_q, w_k, w_v, w_o, num_heads, key, value, scale,
                                mask, causal, key_lengths, num_kv_heads, b_q, b_k, b_v,
                                b_o, return_weights, return_context,
                                half_weights=packed is None, w_gate=w_gate, b_gate=b_gate,
                                **variant_kwargs(locals()))
    if packed is not None:
        args = (*args, packed._core_packed(args[0].dtype))
    out, weights, extras = core.forward(*args, **core.gate_args(call))
    if call is not None and call.out_dtype != call.dtype:   # half: round once
        half = call.out_dtype
    if half is not None:
        out, weights = narrow(out, half), narrow_like(weights, half)
    if (x.ndim == 2) if call is None else not call.batched:
        out = out[0]
        if weights is not None:
            weights = weights[0]
    if not return_context:
        return (out, weights) if return_weights else out
    ctx = make_context(call, extras, b_q=b_q, b_k=b_k, b_v=b_v)
    return (out, weights, ctx) if return_weights else (out, ctx)
