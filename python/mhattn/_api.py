"""mhattn.multi_head_attention: checks arguments in Python, computes in C."""
from __future__ import annotations

import numpy as np

from . import _C, _args
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
_BOOL = np.dtype(np.bool_)
_ndarray = np.ndarray
_count_nonzero = np.count_nonzero
# Scalar types whose float() is the full path's float(scale), exactly.
_SCALE_TYPES = frozenset((float, int, np.float64, np.float32))
# (H, G, dk, dv, scale or None) -> (dk (G,), dv (G,), scales (H,)), read-only
# arrays for _fast_path, so that a call builds none of them.
_HEADS = {}
# Unbatched key_lengths=n -> int64 (1,) read-only array.
_LENGTHS = {}
_CACHE_MAX = 256
# The fast path only takes calls whose every allocation is small, so that the
# memory check of the full path (which costs more than such a call) can be
# skipped: at most this many elements in inputs, projections, outputs and
# weights.
_FAST_ELEMENTS = 1 << 22
# ...and at most this many heads in stacked or list form (a per-head tuple
# of widths is built before the sizes are known).
_FAST_HEADS = 1024


def _frozen(a):
    a.flags.writeable = False
    return a


def _head_arrays(H, G, dk, dv, scale):
    """The glue's dk, dv and scales arrays of a uniform-width call, cached.

    scale None is the default 1/sqrt(dk), computed as normalize() does."""
    key = (H, G, dk, dv, scale)
    heads = _HEADS.get(key)
    if heads is None:
        s = 1.0 / float(np.sqrt(dk)) if scale is None else scale
        heads = (_frozen(np.full(G, dk, np.int64)), _frozen(np.full(G, dv, np.int64)),
                 _frozen(np.full(H, s, np.float64)))
        # A NaN or a zero scale is not cached: NaN != NaN, and 0.0 == -0.0
        # would hand one the other's array.
        if len(_HEADS) < _CACHE_MAX and (scale is None or (scale == scale and scale)):
            _HEADS[key] = heads
    return heads


def _fused_bias_fast(b, dt, H, width, total):
    """A bias the full path would pass to the glue unchanged in value: fused
    (total,) or, when every head has the same width, stacked (H, width), of
    the compute dtype. Else None."""
    if type(b) is not _ndarray or b.dtype is not dt:
        return None
    if b.ndim == 1:
        return b if b.shape[0] == total else None
    if b.ndim == 2 and width is not None and b.shape[0] == H and b.shape[1] == width:
        return b.reshape(-1)
    return None


def _fuse_one(w, count, dt):
    """(fused (rows, sum widths), widths) of a weight in any of its forms,
    as normalize() and _Heads.fused() make them, or None for anything the
    fast path leaves to the full path. count None: not known yet."""
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
    """Stacked or per-head-list weights (or fused ones among them), fused.

    Returns (w_q, w_k, w_v, H, G, dk, dv), dk and dv tuples per kv head,
    or None."""
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


def _ragged_head_arrays(H, G, dk, dv, scale):
    """_head_arrays for per-head widths dk, dv (tuples per kv head)."""
    key = (H, G, dk, dv, scale)
    heads = _HEADS.get(key)
    if heads is None:
        group = H // G
        scales = ([1.0 / float(np.sqrt(dk[h // group])) for h in range(H)]
                  if scale is None else [scale] * H)
        heads = (_frozen(np.array(dk, np.int64)), _frozen(np.array(dv, np.int64)),
                 _frozen(np.array(scales, np.float64)))
        if len(_HEADS) < _CACHE_MAX and (scale is None or (scale == scale and scale)):
            _HEADS[key] = heads
    return heads


def _fast_path(x, w_q, w_k, w_v, w_o, num_heads, key, value, scale, return_weights,
               mask, causal, key_lengths, num_kv_heads, b_q, b_k, b_v, b_o):
    """A small call of plain arrays of one float dtype, without the cost of
    normalize(). Weights may be fused, stacked or per-head lists (fused here
    as the full path fuses them); options are taken in their usual forms.

    Returns None whenever the call is anything else, or when the glue rejects
    it: the full path then runs and raises the friendly error. Whatever it
    returns is bitwise what the full path returns: it hands the glue the same
    arrays (or views with the same values) that normalize() would."""
    if not (type(x) is _ndarray
            and (num_heads is None or (type(num_heads) is int and num_heads > 0))
            and (num_kv_heads is None
                 or (type(num_kv_heads) is int and num_kv_heads > 0))
            and (return_weights is False or return_weights is True)
            and (causal is False or causal is True)):
        return None
    # Dtypes are compared by identity: NumPy's native float32 and float64
    # are singletons, and anything else (byte-swapped...) is declined.
    dt = x.dtype
    nd = x.ndim
    if not ((dt is _F32 or dt is _F64) and (nd == 2 or nd == 3)):
        return None
    if (type(w_q) is _ndarray and type(w_k) is _ndarray and type(w_v) is _ndarray
            and w_q.dtype is dt and w_k.dtype is dt and w_v.dtype is dt
            and w_q.ndim == 2 and w_k.ndim == 2 and w_v.ndim == 2):
        # Fused weights, the common form: every head has the same width.
        if num_heads is None:
            return None
        H = num_heads
        G = H if num_kv_heads is None else num_kv_heads
        if H % G:
            return None
        ragged = None
    else:
        fused = _fuse_heads(w_q, w_k, w_v, num_heads, num_kv_heads, dt)
        if fused is None:
            return None
        w_q, w_k, w_v, H, G, dk, dv = fused
        ragged = (dk, dv)
    # Sources of the keys and values: value defaults to key, key to x.
    if key is None:
        k = x
    elif type(key) is _ndarray and key.dtype is dt and key.ndim == nd:
        k = key
    else:
        return None
    if value is None:
        v = k
    elif type(value) is _ndarray and value.dtype is dt and value.ndim == nd:
        v = value
    else:
        return None
    # Shapes that disagree are left to the glue, which rejects them (and so
    # hands the call to normalize()): it checks key and value against x,
    # each weight against its source and against dk and dv, and w_o and the
    # fused biases against the fused widths.
    xs, ks, vs = x.shape, k.shape, v.shape
    Sq, Sk, Sv = w_q.shape[1], w_k.shape[1], w_v.shape[1]
    if ragged is None:
        dk = dk_one = Sk // G
        dv = dv_one = Sv // G
        if not (dk and dv):
            return None
    else:
        # One width for every head, or None: the stacked biases need one.
        dk_one = dk[0] if dk.count(dk[0]) == G else None
        dv_one = dv[0] if dv.count(dv[0]) == G else None
    Svq = H // G * Sv
    if w_o is None:
        d_out = Svq
    elif type(w_o) is _ndarray and w_o.dtype is dt and w_o.ndim == 2:
        d_out = w_o.shape[1]
    else:
        return None
    B = xs[0] if nd == 3 else 1
    Tq, Tk = xs[-2], ks[-2]
    Din, Dkin, Dvin = xs[-1], ks[-1], vs[-1]
    # Outputs and projections, and inputs the glue may copy.
    n = (B * Tq * (Sq + Svq + d_out + Din) + B * Tk * (Sk + Sv + Dkin + Dvin)
         + Din * Sq + Dkin * Sk + Dvin * Sv + Svq * d_out
         + (B * H * Tq * Tk if return_weights else 0))
    # normalize() also bounds the per-head bookkeeping by memory_limit();
    # until a full call has found that limit, calls take the full path.
    limit = _args._memory_limit_bytes
    if n > _FAST_ELEMENTS or limit is None or n * 8 + H * _args.PER_HEAD_BYTES > limit:
        return None

    if b_q is not None and (b_q := _fused_bias_fast(b_q, dt, H, dk_one, Sq)) is None:
        return None
    if b_k is not None and (b_k := _fused_bias_fast(b_k, dt, G, dk_one, Sk)) is None:
        return None
    if b_v is not None and (b_v := _fused_bias_fast(b_v, dt, G, dv_one, Sv)) is None:
        return None
    if b_o is not None and not (type(b_o) is _ndarray and b_o.dtype is dt
                                and b_o.shape == (d_out,)):
        return None

    if scale is not None:
        if type(scale) not in _SCALE_TYPES:
            return None
        try:
            scale = float(scale)
        except OverflowError:
            return None
    heads = _HEADS.get((H, G, dk, dv, scale))
    if heads is None:
        heads = (_head_arrays(H, G, dk, dv, scale) if ragged is None
                 else _ragged_head_arrays(H, G, dk, dv, scale))
    dk_a, dv_a, scales = heads

    # The mask is passed as it is: the glue broadcasts it to (B, H, Tq, Tk)
    # as np.broadcast_to would (an unbatched call's (H, Tq, Tk) gains B = 1
    # in front either way), and rejects what does not broadcast.
    if mask is not None:
        if type(mask) is not _ndarray or mask.ndim > nd + 1:
            return None
        if mask.dtype is _BOOL:
            if mask.size and not _count_nonzero(mask):
                return None      # the full path warns: is the mask inverted?
        elif not (mask.dtype is dt and mask.flags.aligned):
            return None

    if key_lengths is not None:
        if nd == 2 and type(key_lengths) is int:
            if not 0 <= key_lengths <= Tk:
                return None
            kl = _LENGTHS.get(key_lengths)
            if kl is None:
                kl = _frozen(np.full(1, key_lengths, np.int64))
                if len(_LENGTHS) < _CACHE_MAX:
                    _LENGTHS[key_lengths] = kl
            key_lengths = kl
        elif not (type(key_lengths) is _ndarray and key_lengths.dtype.kind in "iu"
                  and key_lengths.shape == ((B,) if nd == 3 else ())):
            return None
        elif nd == 2:
            key_lengths = key_lengths.reshape(1)

    if nd == 2:
        xb = x[np.newaxis]
        kb = xb if k is x else k[np.newaxis]
        v = kb if v is k else (xb if v is x else v[np.newaxis])
        x, k = xb, kb
    try:
        out, weights, _ = _C.forward(x, k, v, w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o,
                                     dk_a, dv_a, scales, mask, causal, key_lengths,
                                     return_weights, False)
    except (TypeError, ValueError):
        return None
    if nd == 2:
        out = out[0]
        if return_weights:
            weights = weights[0]
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
    if return_context is False:
        res = _fast_path(x, w_q, w_k, w_v, w_o, num_heads, key, value, scale,
                         return_weights, mask, causal, key_lengths, num_kv_heads,
                         b_q, b_k, b_v, b_o)
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
