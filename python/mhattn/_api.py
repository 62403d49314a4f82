"""mhattn.multi_head_attention: checks arguments in Python, computes in C."""
from __future__ import annotations

from . import _C, _core
from ._core import make_context, run_core

__all__ = ["multi_head_attention", "run_core"]


def multi_head_attention(x, w_q, w_k, w_v, w_o=None, *, num_heads=None, key=None,
                         value=None, scale=None, return_weights=False, mask=None,
                         causal=False, key_lengths=None, num_kv_heads=None,
                         b_q=None, b_k=None, b_v=None, b_o=None, return_context=False):
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
        repeat one array (the document's shared W_V).
    w_o : (sum d_v, d_out) or None
        The output projection; None is the identity (returns the concat).
    num_heads : int
        Number of query heads; required for fused weights.
    key, value : arrays, optional
        Sources of keys and values for cross-attention: (T_k, d) or
        (B, T_k, d).  ``key`` defaults to ``x``, ``value`` to ``key``.
    scale : float, optional
        Multiplier of Q K^T; defaults to 1/sqrt(d_k) of each head.
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
    b_q, b_k, b_v : biases in the form of their weights; b_o : (d_out,)
    return_context : bool
        Also return a :class:`mhattn.Context` for :func:`mhattn.backward`
        (O(T d) state: the projections, the concatenation and each row's
        log-sum-exp), so gradients need no second forward pass.

    Returns
    -------
    out : (T_q, d_out) or (B, T_q, d_out), a new C-contiguous array
        float32 for float32 inputs, else float64.
    weights : returned too when ``return_weights``.
    ctx : returned last when ``return_context``.

    A query row that may attend to no key at all is *fully masked*: its
    weights are 0 and each head contributes zeros, so its output is b_o (or
    0).  No NaN is produced for it.
    """
    args = call = None
    if return_context is False:
        args = _core.fast(x, w_q, w_k, w_v, w_o, num_heads, key, value, scale,
                          return_weights, mask, causal, key_lengths, num_kv_heads,
                          b_q, b_k, b_v, b_o)
    if args is None:
        args, call = _core.slow(x, w_q, w_k, w_v, w_o, num_heads, key, value, scale,
                                mask, causal, key_lengths, num_kv_heads, b_q, b_k, b_v,
                                b_o, return_weights, return_context)
    out, weights, extras = _C.forward(*args)
    if (x.ndim == 2) if call is None else not call.batched:
        out = out[0]
        if weights is not None:
            weights = weights[0]
    if not return_context:
        return (out, weights) if return_weights else out
    ctx = make_context(call, extras, b_q=b_q, b_k=b_k, b_v=b_v)
    return (out, weights, ctx) if return_weights else (out, ctx)
