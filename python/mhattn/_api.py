"""mhattn.multi_head_attention: checks arguments in Python, computes in C."""
from __future__ import annotations

import numpy as np

from . import _C
from ._args import Call, bool_arg, check_memory, normalize, plan

__all__ = ["multi_head_attention", "run_core"]


def _fused_bias(parts):
    """Per-head biases side by side, matching the fused weights' columns."""
    if parts is None:
        return None
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def run_core(call: Call, *, want_weights: bool = False, keep: bool = False):
    """Hand a checked Call to the C core.

    Returns (out, weights, extras), batched: out (B, Tq, Dout), weights
    (B, H, Tq, Tk) or None, extras (q, k, v, concat, lse) or None.
    """
    check_memory(plan(call, want_weights=want_weights, keep=keep))
    # Fused query weights must hold head h's block at sum of the widths before
    # it; with ragged or grouped heads that is exactly the concatenation.
    wq = call.wq.fused()
    wk = call.wk.fused()
    wv = call.wv.fused()
    dk = np.asarray(call.dk, dtype=np.int64)
    dv = np.asarray(call.dv, dtype=np.int64)
    scales = np.asarray(call.scales, dtype=np.float64)
    return _C.forward(
        call.x, call.key, call.value, wq, wk, wv, call.w_o,
        _fused_bias(call.bq), _fused_bias(call.bk), _fused_bias(call.bv),
        call.b_o, dk, dv, scales, call.mask, call.causal, call.key_lengths,
        bool(want_weights), bool(keep))


_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)
_HEADS = {}   # (num_heads, Sk, Sv) -> (dk, dv, default scales), for _fast_path
# The fast path only takes calls whose every allocation is small, so that the
# memory check of the full path (which costs more than such a call) can be
# skipped: at most this many elements in projections, outputs and weights.
_FAST_ELEMENTS = 1 << 22


def _fast_path(x, w_q, w_k, w_v, w_o, num_heads, return_weights):
    """The common small call (plain float arrays of one dtype, fused weights,
    no options) without the cost of normalize(). Returns None whenever the
    call is anything else, or when the glue rejects it: the full path then
    runs and raises the friendly error."""
    if not (type(x) is np.ndarray and type(w_q) is np.ndarray
            and type(w_k) is np.ndarray and type(w_v) is np.ndarray
            and type(num_heads) is int and num_heads > 0
            and (return_weights is False or return_weights is True)):
        return None
    dt = x.dtype
    if not ((dt == _F32 or dt == _F64) and w_q.dtype == dt and w_k.dtype == dt
            and w_v.dtype == dt and w_q.ndim == 2 and w_k.ndim == 2 and w_v.ndim == 2
            and x.ndim in (2, 3)):
        return None
    if w_o is not None and not (type(w_o) is np.ndarray and w_o.dtype == dt
                                and w_o.ndim == 2):
        return None
    Sk, Sv = w_k.shape[1], w_v.shape[1]
    if w_q.shape[1] != Sk or Sk % num_heads or Sv % num_heads or Sk == 0 or Sv == 0:
        return None
    rows = x.shape[0] * x.shape[1] if x.ndim == 3 else x.shape[0]
    T = x.shape[-2]
    d_out = w_o.shape[1] if w_o is not None else Sv
    n = rows * (2 * Sk + 2 * Sv + d_out) + (rows * num_heads * T if return_weights else 0)
    if n > _FAST_ELEMENTS:
        return None
    key = (num_heads, Sk, Sv)
    heads = _HEADS.get(key)
    if heads is None:
        dk, dv = Sk // num_heads, Sv // num_heads
        heads = (np.full(num_heads, dk, np.int64), np.full(num_heads, dv, np.int64),
                 np.full(num_heads, 1.0 / np.sqrt(dk)))
        if len(_HEADS) < 256:
            _HEADS[key] = heads
    xb = x if x.ndim == 3 else x[np.newaxis]
    try:
        out, weights, _ = _C.forward(xb, xb, xb, w_q, w_k, w_v, w_o, None, None, None,
                                     None, heads[0], heads[1], heads[2], None, False,
                                     None, return_weights, False)
    except (TypeError, ValueError):
        return None
    if x.ndim == 2:
        out = out[0]
        weights = weights[0] if return_weights else None
    return (out, weights) if return_weights else out


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
    if (key is None and value is None and scale is None and mask is None
            and causal is False and key_lengths is None and num_kv_heads is None
            and b_q is None and b_k is None and b_v is None and b_o is None
            and return_context is False):
        res = _fast_path(x, w_q, w_k, w_v, w_o, num_heads, return_weights)
        if res is not None:
            return res
    call = normalize(x, w_q, w_k, w_v, w_o, num_heads=num_heads, key=key, value=value,
                     scale=scale, mask=mask, causal=causal, key_lengths=key_lengths,
                     num_kv_heads=num_kv_heads, b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o)
    return_weights = bool_arg("return_weights", return_weights)
    return_context = bool_arg("return_context", return_context)
    out, weights, extras = run_core(call, want_weights=return_weights, keep=return_context)
    out = call.unbatch(out)
    result = (out,)
    if return_weights:
        result += (call.unbatch(weights),)
    if return_context:
        from ._grad import make_context
        result += (make_context(call, extras, b_q=b_q, b_k=b_k, b_v=b_v),)
    return result[0] if len(result) == 1 else result
