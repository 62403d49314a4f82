"""The pure-NumPy reference: the document's code, generalised.

This module is what mhattn's C core is tested against, and what a learner can
read next to the document *Multi-Head Attention Mechanism* (the specification
mhattn implements; not part of this repository).  Each function is one
equation of the document, written as plainly as NumPy allows:

    Q = X W^Q      K = X W^K      V = X W^V             (project)
    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V   (attention)
    head_i = Attention(X W_i^Q, X W_i^K, X W_i^V)       (one head)
    MultiHead(X) = Concat(head_1, ..., head_h) W^O      (combine)

and the variants of today's models (issue 13), one function per rule, in the
order of a score's life (``mhattn._internal.variants``):

 1. project, plus bias                     :func:`_project`
 2. q/k norm                               :func:`rms_norm`, :func:`layer_norm`
 3. RoPE                                   :func:`rope`
 4. q . k;  5. x scale                     :func:`score_steps`
 6. softcap: c tanh(s / c)                 :func:`softcap`
 7. + ALiBi + T5's bias + additive mask    :func:`alibi_bias`, :func:`relative_bias`
 8. the visibility rules -> -inf           :func:`allowed_keys`
 9. softmax, with sinks                    :func:`softmax`, :func:`log_sum_exp`
 9b. dropout (``dropout=p``, ``seed=``)     :func:`dropout_keep`
    (steps 2-9 of one head from its projections: :func:`head_scores`)
 10. . V;  11. concat;  12. W^O            :func:`weighted_values`,
                                           :func:`multi_head_attention`

and, with ``w_gate``, the output gate between 11 and 12 (Keras's
``use_gate=True``, Qwen3-Next's gated attention): the concatenation
becomes sigmoid(X W_gate + b_gate) * concat, elementwise, one gate per
query row (:func:`multi_head_attention`).

It takes exactly the arguments of :func:`mhattn.multi_head_attention` and
returns the same thing, computed in the same dtype (float32 stays float32),
except that float16 and bfloat16 inputs are computed and returned in
float64: the reference is the oracle that mhattn's half results are held to.
Speed is not a goal here: every head is a Python loop iteration and every
step a named intermediate.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .._internal.args import Call, bool_arg, check_memory, normalize, plan
from .._internal.half import shared_half
from .._internal.variants import key_positions_of, query_positions, sequence_ids, variant_kwargs

__all__ = ["multi_head_attention", "lse", "softmax", "log_sum_exp", "attention",
           "score_steps", "weighted_values", "allowed_keys", "rms_norm", "layer_norm",
           "rope", "softcap", "alibi_bias", "param_count", "head_intermediates",
           "head_scores", "worked_example", "projected_attention", "dropout_keep",
           "relative_position_bucket", "relative_bias"]

_U64 = np.uint64


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, lane by lane on uint64 (wrapping)."""
    z = (z ^ (z >> _U64(30))) * _U64(0xbf58476d1ce4e5b9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94d049bb133111eb)
    return z ^ (z >> _U64(31))


def _mix32(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finaliser, lane by lane on uint32 (wrapping)."""
    u = np.uint32
    x = (x ^ (x >> u(16))) * u(0x85ebca6b)
    x = (x ^ (x >> u(13))) * u(0xc2b2ae35)
    return x ^ (x >> u(16))


def dropout_keep(seed: int, b: int, h: int, Tq: int, Tk: int, p: float) -> np.ndarray:
    """Which weights of head h on batch item b dropout keeps: (Tq, Tk) bool.

    The C core's counter-based hash (``csrc/core/rules.h``), in NumPy:
    weight (b, h, i, j) is kept iff

        key  = mix64(... mix64(mix64(seed + G) + b + G) + h + G) + i + G) + (j >> 32) + G)
        bits = mix32(mix32(lo32(j) ^ lo32(key)) ^ hi32(key))
        bits >= floor(p * 2**32)

    (G = 0x9e3779b97f4a7c15; mix64 SplitMix64's finaliser, mix32
    MurmurHash3's; every operation wraps), so each weight is kept with
    probability 1 - p (within 2**-32), independently of the others, the
    same on every thread count, tiling and ISA.  i and j are the call's
    query and key rows (packed rows when the sequences are packed).

    Parameters
    ----------
    seed : int
        In [0, 2**64).
    b, h : int
        The batch item and the query head.
    Tq, Tk : int
        The call's query and key rows.
    p : float
        The dropout probability, in [0, 1).

    Returns
    -------
    keep : (Tq, Tk) bool

    Examples
    --------
    >>> keep = dropout_keep(seed=0, b=0, h=0, Tq=256, Tk=256, p=0.25)
    >>> keep.shape, bool(abs(keep.mean() - 0.75) < 0.01)
    ((256, 256), True)
    """
    gold = _U64(0x9e3779b97f4a7c15)
    with np.errstate(over="ignore"):
        k = _mix64(np.array([seed], dtype=_U64) + gold)
        k = _mix64(k + _U64(b) + gold)
        k = _mix64(k + _U64(h) + gold)
        k = _mix64(k + np.arange(Tq, dtype=_U64)[:, None] + gold)        # (Tq, 1)
        j = np.arange(Tk, dtype=_U64)[None, :]
        key = _mix64(k + (j >> _U64(32)) + gold)                          # (Tq, Tk)
        lo = (key & _U64(0xffffffff)).astype(np.uint32)
        hi = (key >> _U64(32)).astype(np.uint32)
        jlo = (j & _U64(0xffffffff)).astype(np.uint32)
        bits = _mix32(_mix32(jlo ^ lo) ^ hi)
    return bits >= np.uint32(int(p * 4294967296.0))


def softmax(scores: np.ndarray, sink=None) -> np.ndarray:
    """Softmax over the last axis, subtracting the row maximum as the document does.

    Parameters
    ----------
    scores : (..., Tk) array
        The finished scores (scaled, capped, biased, masked: -inf = blocked).
    sink : scalar, optional
        An attention sink (gpt-oss): one extra logit per row, of value zero,
        counted in the denominator only.  The returned weights exclude it, so
        a row then sums to 1 - p_sink with p_sink = exp(sink) / (exp(sink) +
        sum_j exp(s_j)).

    Returns
    -------
    weights : array of the shape and dtype of ``scores``

    Entries of -inf are blocked keys and get weight 0.  A row with every entry
    -inf is *fully masked*: its weights are all 0 (not NaN), with or without a
    sink (with one, all its mass is on the sink), so the head attends to
    nothing and contributes a zero vector.  A NaN score, or a +inf one
    (inf - inf), makes its row NaN, as IEEE arithmetic says: it is never
    mistaken for a fully masked row.

    Examples
    --------
    >>> softmax(np.array([0.0, 0.0]))
    array([0.5, 0.5])
    >>> softmax(np.array([0.0, 0.0]), sink=0.0)     # a third, invisible logit
    array([0.33333333, 0.33333333])
    >>> softmax(np.array([-np.inf, -np.inf]), sink=1.0)
    array([0., 0.])
    """
    m = _row_max(scores, sink)
    w = np.exp(scores - m)
    total = w.sum(axis=-1, keepdims=True)
    if sink is not None:
        total = total + np.exp(scores.dtype.type(sink) - m)
    # Only a fully masked row (and no sink) sums to exactly 0 (the maximum
    # contributes exp(0) = 1 otherwise); a NaN total stays NaN.
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total == 0, 0, w / np.where(total == 0, 1, total)).astype(scores.dtype)


def _row_max(scores: np.ndarray, sink=None) -> np.ndarray:
    """(..., 1): each row's maximum, the sink included, with a fully masked
    row's -inf replaced by 0 so that exp(-inf - 0) = 0 rather than
    exp(-inf - -inf) = exp(nan)."""
    # initial=-inf: with no key at all (T_k = 0) the row is fully masked too.
    m = scores.max(axis=-1, keepdims=True, initial=-np.inf)
    if sink is not None:
        m = np.maximum(m, scores.dtype.type(sink))
    return np.where(np.isneginf(m), 0, m).astype(scores.dtype)


def log_sum_exp(scores: np.ndarray, sink=None) -> np.ndarray:
    """Each row's log-sum-exp, the sink's logit included: the lse the C core keeps.

    Parameters
    ----------
    scores : (..., Tk) array
        The finished scores, as given to :func:`softmax`.
    sink : scalar, optional
        The row's attention sink logit.

    Returns
    -------
    lse : (...,) array of the dtype of ``scores``
        log(exp(sink) + sum_j exp(s_j)); -inf for a fully masked row without
        a sink, ``sink`` for one with.

    Examples
    --------
    >>> log_sum_exp(np.array([[0.0, 0.0]]))          # log 2
    array([0.69314718])
    >>> log_sum_exp(np.array([[-np.inf]]), sink=0.5)
    array([0.5])
    """
    m = _row_max(scores, sink)
    total = np.exp(scores - m).sum(axis=-1, keepdims=True)
    if sink is not None:
        total = total + np.exp(scores.dtype.type(sink) - m)
    with np.errstate(divide="ignore"):
        return (m + np.log(total)).astype(scores.dtype)[..., 0]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Step 2, the q/k RMSNorm of each row: y = x / sqrt(mean(x^2) + eps) * w.

    Parameters
    ----------
    x : (T, d) array
        One head's projected queries or keys.
    w : (d,) array
        The norm's weight (Qwen3's ``q_norm.weight``; note Gemma's norms
        use 1 + weight).
    eps : float
        ``norm_eps``, added to the mean square.

    Returns
    -------
    y : (T, d) array of the dtype of ``x``
        Computed in float64 and rounded once, as the C core does.

    Examples
    --------
    >>> rms_norm(np.array([[3.0, 4.0]]), np.ones(2), 0.0)   # RMS 5/sqrt(2)
    array([[0.84852814, 1.13137085]])
    """
    x64 = x.astype(np.float64)
    r = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (x64 * r * np.asarray(w, dtype=np.float64)).astype(x.dtype)


def layer_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Step 2 with ``norm_type="layer"``, the q/k LayerNorm of each row:
    y = (x - mean(x)) / sqrt(var(x) + eps) * w.

    var is the biased (population) variance, mean((x - mean(x))^2), and
    there is no bias, as in the LayerNorms of Flax NNX's
    ``MultiHeadAttention(normalize_qk=True)`` (``use_bias=False``).

    Parameters
    ----------
    x : (T, d) array
        One head's projected queries or keys.
    w : (d,) array
        The norm's weight (Flax's ``query_ln.scale`` / ``key_ln.scale``).
    eps : float
        ``norm_eps``, added to the variance (Flax's ``epsilon``, 1e-6 by
        default, as here).

    Returns
    -------
    y : (T, d) array of the dtype of ``x``
        Computed in float64 and rounded once, as the C core does.

    Examples
    --------
    >>> layer_norm(np.array([[1.0, 3.0]]), np.ones(2), 0.0)   # mean 2, variance 1
    array([[-1.,  1.]])
    """
    x64 = x.astype(np.float64)
    centred = x64 - np.mean(x64, axis=-1, keepdims=True)
    r = 1.0 / np.sqrt(np.mean(centred * centred, axis=-1, keepdims=True) + eps)
    return (centred * r * np.asarray(w, dtype=np.float64)).astype(x.dtype)


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, rotary_dim: int,
         interleaved: bool) -> np.ndarray:
    """Step 3, rotary position embedding: turn pair c of row t by positions[t] * inv_freq[c].

    Parameters
    ----------
    x : (T, d) array
        One head's (normed) queries or keys.
    positions : (T,) int array
        Each row's position.
    inv_freq : (rotary_dim/2,) float64 array
        The frequencies.
    rotary_dim : int
        The first ``rotary_dim`` features turn; the rest pass unchanged.
    interleaved : bool
        False: pair c is features (c, c + rotary_dim/2), the rotate-half of
        GPT-NeoX and Llama.  True: pair c is features (2c, 2c+1) (GPT-J).

    Returns
    -------
    y : (T, d) array of the dtype of ``x``
        ``(a, b) -> (a cos - b sin, a sin + b cos)``, the angle and the turn
        computed in float64 and rounded once.

    Examples
    --------
    >>> rope(np.array([[1.0, 0.0]]), np.array([1]), np.array([np.pi / 2]), 2, False)
    array([[6.123234e-17, 1.000000e+00]])
    """
    half = rotary_dim // 2
    c = np.arange(half)
    ia, ib = (2 * c, 2 * c + 1) if interleaved else (c, c + half)
    x64 = x.astype(np.float64)
    angle = np.asarray(positions, dtype=np.float64)[:, None] * \
        np.asarray(inv_freq, dtype=np.float64)[None, :]          # (T, rotary_dim/2)
    cos, sin = np.cos(angle), np.sin(angle)
    a, b = x64[:, ia], x64[:, ib]
    y = x64.copy()
    y[:, ia] = a * cos - b * sin
    y[:, ib] = a * sin + b * cos
    return y.astype(x.dtype)


def softcap(scores: np.ndarray, cap: float) -> np.ndarray:
    """Step 6, Gemma 2's logit soft-capping: c tanh(s / c), so abs(s) < c.

    Parameters
    ----------
    scores : array
        The scaled scores.
    cap : float
        c > 0 (``softcap=``).

    Returns
    -------
    capped : array of the shape and dtype of ``scores``

    Examples
    --------
    >>> softcap(np.array([0.0, 1.0, 1e9]), 2.0)
    array([0.        , 0.92423431, 2.        ])
    """
    c = scores.dtype.type(cap)
    return (c * np.tanh(scores / c)).astype(scores.dtype)


def alibi_bias(slope: float, query_pos: np.ndarray, key_pos: np.ndarray,
               dtype=np.float64) -> np.ndarray:
    """Step 7, ALiBi's linear bias: -slope abs(p_i - j).

    Parameters
    ----------
    slope : float or (Tq,) array
        The head's slope (``alibi_slopes[h]`` or ``[b, h]``), or each query
        row's (packed sequences with a row of slopes per sequence).
    query_pos : (Tq,) int array
        p_i = i + (Tk - Tq), within its sequence when packed.
    key_pos : (Tk,) int array
        j, within its sequence when packed.
    dtype : the result's dtype (computed in float64, rounded once)

    Returns
    -------
    bias : (Tq, Tk) array, added to the (capped) scores

    Examples
    --------
    >>> alibi_bias(0.5, np.array([2]), np.arange(3))
    array([[-1. , -0.5, -0. ]])
    """
    d = np.abs(np.asarray(query_pos, dtype=np.float64)[:, None]
               - np.asarray(key_pos, dtype=np.float64)[None, :])
    s = np.asarray(slope, dtype=np.float64)
    return (-(s[:, None] if s.ndim else s) * d).astype(dtype)


def relative_position_bucket(relative_position: np.ndarray, bidirectional: bool = True,
                             num_buckets: int = 32, max_distance: int = 128) -> np.ndarray:
    """T5's bucket of each signed distance ``key_pos - query_pos``.

    transformers' ``T5Attention._relative_position_bucket``, operation by
    operation in float32 as torch computes it there (the float32 log as the
    float64 log rounded, as the C core does: ``mha_rel_bucket``).

    Parameters
    ----------
    relative_position : int array
        Key position minus query position.
    bidirectional : bool, default True
        True (an encoder): each direction gets ``num_buckets // 2`` buckets,
        later keys from ``num_buckets // 2`` on; False (a decoder): later
        keys share bucket 0.
    num_buckets, max_distance : int
        As :class:`mhattn.RelativeBias`.

    Returns
    -------
    int64 array of the same shape, each in [0, num_buckets).

    Examples
    --------
    >>> relative_position_bucket(np.array([-200, -9, -1, 0, 1, 9, 200]))
    array([15,  8,  1,  0, 17, 24, 31])
    """
    d = np.asarray(relative_position, dtype=np.int64)
    n, at = num_buckets, np.zeros(d.shape, dtype=np.int64)
    if bidirectional:
        n //= 2
        at = np.where(d > 0, n, 0)
        r = np.abs(d)
    else:
        r = np.maximum(-d, 0)
    exact = n // 2
    f32 = np.float32
    with np.errstate(divide="ignore"):   # r = 0 takes the exact branch below
        q = r.astype(f32) / f32(exact)
        lq = np.log(q.astype(np.float64)).astype(f32)
    t = lq / f32(np.log(max_distance / exact)) * f32(n - exact)
    large = exact + np.minimum(np.where(r >= exact, t, 0), n).astype(np.int64)
    return at + np.where(r < exact, r, np.minimum(large, n - 1))


def relative_bias(table: np.ndarray, h: int, query_pos: np.ndarray, key_pos: np.ndarray,
                  bidirectional: bool = True, max_distance: int = 128,
                  dtype=np.float64) -> np.ndarray:
    """Step 7, T5's relative bias of head h: ``table[bucket(j - p_i), h]``.

    Parameters
    ----------
    table : (num_buckets, H) array
        :class:`mhattn.RelativeBias`'s table.
    h : int
        The query head.
    query_pos, key_pos : (Tq,) and (Tk,) int arrays
        p_i and j, as for :func:`alibi_bias`.
    bidirectional, max_distance
        As :class:`mhattn.RelativeBias`.
    dtype : the result's dtype

    Returns
    -------
    bias : (Tq, Tk) array, added after ALiBi's

    Examples
    --------
    >>> table = np.arange(8.0).reshape(4, 2)
    >>> relative_bias(table, 1, np.array([1]), np.arange(3), max_distance=2)
    array([[3., 1., 7.]])
    """
    d = np.asarray(key_pos, dtype=np.int64)[None, :] - np.asarray(query_pos,
                                                                  dtype=np.int64)[:, None]
    b = relative_position_bucket(d, bidirectional, table.shape[0], max_distance)
    return np.asarray(table)[b, h].astype(dtype)


def allowed_keys(call: Call, b: int, h: int) -> np.ndarray:
    """Step 8, (Tq, Tk) bool: which keys query row i of head h, batch item b may attend to.

    With p_i = i + (Tk - Tq) (i + q_offset when given: a block of a longer
    call) and key position j (both within their own sequence when packed),
    every rule below must allow a key (AND):

    - packed sequences (``cu_seqlens``): the query's and the key's sequences
      are the same one;
    - causal: j <= p_i, the triangle aligned bottom-right (FlashAttention's
      convention), so one new query against a long key cache sees every key;
    - window (left, right): p_i - left <= j <= p_i + right, a side of None
      unbounded (with causal the right side is capped at 0 by the rule above);
    - chunk N: p_i // N == j // N (floor division), Llama 4's chunked
      attention and FlashAttention 3's ``attention_chunk``;
    - key_lengths: keys j >= length are padding;
    - key_mask (B, Tk): False = padding;
    - a boolean mask: True = may attend;
    - a :class:`mhattn.BlockMask` (``block_mask``): True = may attend.

    Parameters
    ----------
    call : Call
        A checked call (:func:`mhattn._internal.args.normalize`).
    b, h : int
        The batch item and the query head.

    Returns
    -------
    allowed : (Tq, Tk) bool array

    Examples
    --------
    >>> call = normalize(np.eye(4), np.eye(4), np.eye(4), np.eye(4), num_heads=1,
    ...                  window=(1, 0))
    >>> allowed_keys(call, 0, 0).astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [0, 1, 1, 0],
           [0, 0, 1, 1]])
    """
    Tq, Tk, var = call.Tq, call.Tk, call.var
    p = query_positions(var, call.B, Tq, Tk, for_rope=False)[b][:, None]    # (Tq, 1)
    j = key_positions_of(var, call.B, Tk, for_rope=False)[b][None, :]       # (1, Tk)
    ok = np.ones((Tq, Tk), dtype=bool)
    if var.packed:
        ok &= (sequence_ids(var.cu_q, Tq)[:, None] == sequence_ids(var.cu_k, Tk)[None, :])
    if call.causal:
        ok &= j <= p
    if var.window is not None:
        left, right = var.window
        if left is not None:
            ok &= j >= p - left
        if right is not None:
            ok &= j <= p + right
    if var.chunk:
        ok &= (p // var.chunk) == (j // var.chunk)
    if var.block_mask is not None:
        bm = var.block_mask.to_dense()
        ok &= bm[b if bm.shape[0] > 1 else 0, h if bm.shape[1] > 1 else 0]
    if call.key_lengths is not None:
        ok &= (np.arange(Tk) < call.key_lengths[b])[None, :]
    if var.key_mask is not None:
        ok &= var.key_mask[b][None, :]
    if call.mask is not None and call.mask.dtype == bool:
        ok &= call.mask[b, h]
    return ok


def score_steps(q: np.ndarray, k: np.ndarray, scale: float, *, cap: Optional[float] = None,
                bias: Optional[np.ndarray] = None, additive: Optional[np.ndarray] = None,
                allowed: Optional[np.ndarray] = None,
                relative: Optional[np.ndarray] = None) -> dict:
    """Steps 4-8 of one head's scores, each kept.

    Parameters
    ----------
    q, k : (Tq, dk) and (Tk, dk) arrays
        The queries and keys as the scores use them (after norm and RoPE).
    scale : float
    cap : float, optional
        The softcap c.
    bias : (Tq, Tk), optional
        The ALiBi bias.
    additive : (Tq, Tk), optional
        The float mask.
    allowed : (Tq, Tk) bool, optional
        :func:`allowed_keys`; False becomes -inf.
    relative : (Tq, Tk), optional
        T5's relative bias (:func:`relative_bias`), added after ALiBi's.

    Returns
    -------
    dict with raw_scores = q k^T, scaled = raw * scale, capped (= scaled
    without a softcap) and scores (capped + bias + relative + additive,
    -inf where not allowed), each (Tq, Tk) of q's dtype.

    Examples
    --------
    >>> st = score_steps(np.ones((1, 2)), np.ones((1, 2)), 2.0, cap=1.0)
    >>> st["scaled"], st["capped"]
    (array([[4.]]), array([[0.9993293]]))
    """
    raw = q @ k.T
    scaled = raw * q.dtype.type(scale)
    capped = scaled if cap is None else softcap(scaled, cap)
    scores = capped
    if bias is not None:
        scores = scores + bias
    if relative is not None:
        scores = scores + relative
    if additive is not None:
        scores = scores + additive
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    scores = scores.astype(q.dtype)
    return dict(raw_scores=raw, scaled=scaled, capped=capped, scores=scores)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
              allowed: Optional[np.ndarray] = None,
              additive: Optional[np.ndarray] = None, *, cap: Optional[float] = None,
              bias: Optional[np.ndarray] = None, sink=None):
    """softmax(cap(q k^T * scale) [+ bias] [+ additive], blocked = -inf; sink) v, for one head.

    Parameters
    ----------
    q, k, v : (Tq, dk), (Tk, dk) and (Tk, dv) arrays
        One head's queries, keys and values.
    scale : float
    allowed : (Tq, Tk) bool, optional
    additive : (Tq, Tk), optional
    cap, bias : see :func:`score_steps`
    sink : scalar, optional
        The head's attention sink (:func:`softmax`).

    Returns
    -------
    (raw, scores, weights, out): raw = q k^T, scores = the finished scores
    (scaled, capped, biased, masked), weights (Tq, Tk) and out (Tq, dv).

    Examples
    --------
    >>> raw, s, w, out = attention(np.ones((1, 1)), np.ones((2, 1)), np.eye(2), 1.0)
    >>> w
    array([[0.5, 0.5]])
    """
    st = score_steps(q, k, scale, cap=cap, bias=bias, additive=additive, allowed=allowed)
    weights = softmax(st["scores"], sink)
    return st["raw_scores"], st["scores"], weights, weighted_values(weights, v)


def weighted_values(weights: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Step 10, weights @ v, where a key of weight exactly 0 adds nothing.

    0 * inf is NaN, so with a plain product an Inf or NaN value at a blocked
    key (padding beyond key_lengths, a masked or causally hidden key) would
    poison the row.  Keys the row does not attend to are never read; the
    C core does the same.

    Parameters
    ----------
    weights : (Tq, Tk) array
    v : (Tk, dv) array

    Returns
    -------
    out : (Tq, dv)

    Examples
    --------
    >>> weighted_values(np.array([[1.0, 0.0]]), np.array([[2.0], [np.inf]]))
    array([[2.]])
    """
    if np.isfinite(v).all():
        return weights @ v
    out = np.zeros((weights.shape[0], v.shape[1]), dtype=np.result_type(weights, v))
    for i in range(weights.shape[0]):
        seen = weights[i] != 0
        out[i] = weights[i, seen] @ v[seen]
    return out


def _project(inp: np.ndarray, w: np.ndarray, b: Optional[np.ndarray]) -> np.ndarray:
    """Step 1, X W (+ b): the document's row-vector convention."""
    out = inp @ w
    return out if b is None else out + b


def _norm_row(w: Optional[np.ndarray], head: int) -> Optional[np.ndarray]:
    """The (d,) norm weight of one head: shared (d,) or row ``head`` of (n, d)."""
    if w is None:
        return None
    return w if w.ndim == 1 else w[head]


def head_intermediates(call: Call, b: int, h: int) -> dict:
    """Every step of head h on batch item b, named as in the document.

    Parameters
    ----------
    call : Call
        A checked call (:func:`mhattn._internal.args.normalize`).
    b, h : int
        The batch item and the query head.

    Returns
    -------
    dict of the steps, in the order of a score's life:

    - q_proj (Tq, dk), k_proj (Tk, dk), v (Tk, dv): the projections plus bias;
    - q_normed, k_normed: after the q/k norm, RMSNorm or LayerNorm
      (``norm_type``; the projections without one);
    - q, k: as the scores use them, after RoPE (= q_normed, k_normed without);
    - raw_scores = q k^T, scaled = raw * scale, capped = softcap(scaled)
      (= scaled without one), each (Tq, Tk);
    - bias (Tq, Tk) or None: ALiBi's -slope abs(p_i - j);
    - additive (Tq, Tk) or None: the float mask;
    - allowed (Tq, Tk) bool: :func:`allowed_keys`;
    - scores (Tq, Tk): capped + bias + additive, -inf where not allowed;
    - sink: the head's sink logit or None;
    - probs (Tq, Tk): softmax with the sink, which they exclude;
    - keep (Tq, Tk) bool or None: dropout's mask (:func:`dropout_keep`),
      None without dropout;
    - weights (Tq, Tk): probs after dropout, kept ones times 1 / (1 - p)
      (= probs without dropout);
    - lse (Tq,): each row's log-sum-exp, the sink included (before dropout);
    - head (Tq, dv): weights . v.

    Examples
    --------
    >>> call = normalize(np.eye(3), np.eye(3), np.eye(3), np.eye(3), num_heads=1)
    >>> sorted(head_intermediates(call, 0, 0))[:4]
    ['additive', 'allowed', 'bias', 'capped']
    """
    g = call.kv_head(h)
    # 1. project, plus bias
    q_proj = _project(call.x[b], call.wq.heads[h], None if call.bq is None else call.bq[h])
    k_proj = _project(call.key[b], call.wk.heads[g], None if call.bk is None else call.bk[g])
    v = _project(call.value[b], call.wv.heads[g], None if call.bv is None else call.bv[g])
    # 2-9.
    st = head_scores(call, b, h, q_proj, k_proj)
    # 10. . V
    head = weighted_values(st["weights"], v)
    if st["keep"] is not None:
        # A row with a NaN score has a NaN softmax normaliser, and dropout
        # keeps that normaliser (its lse is the undropped softmax's): its
        # output is NaN even where dropout zeroed every weight, as the C
        # core's, which divides by it (mhattn.multi_head_attention's rule
        # for NaN scores).
        head = np.where(np.isnan(st["lse"])[:, None], head.dtype.type(np.nan), head)
    return dict(st, v=v, head=head)


def head_scores(call: Call, b: int, h: int, q_proj: np.ndarray, k_proj: np.ndarray) -> dict:
    """Steps 2-9 of head h on batch item b, from its projections.

    The C core keeps q and k *before* the norm and RoPE (``csrc/mha.h``):
    this turns them, or the reference's own, into every later step.

    Parameters
    ----------
    call : Call
        A checked call (:func:`mhattn._internal.args.normalize`).
    b, h : int
        The batch item and the query head.
    q_proj : (Tq, dk) array
        Head h's projected queries, bias included.
    k_proj : (Tk, dk) array
        Its kv head's projected keys, bias included.

    Returns
    -------
    dict: the keys of :func:`head_intermediates` except v and head.

    Examples
    --------
    >>> call = normalize(np.eye(3), np.eye(3), np.eye(3), np.eye(3), num_heads=1,
    ...                  sinks=[0.0])
    >>> st = head_scores(call, 0, 0, np.eye(3), np.eye(3))
    >>> st["lse"]                  # log(e^(1/sqrt 3) + 1 + 1 + e^0): the sink counts
    array([1.56471502, 1.56471502, 1.56471502])
    """
    var = call.var
    B, Tq, Tk = call.B, call.Tq, call.Tk
    g = call.kv_head(h)
    # 2. q/k norm: RMSNorm, or LayerNorm (mean-centred) with norm_type="layer"
    norm = layer_norm if var.norm_type == "layer" else rms_norm
    wqn, wkn = _norm_row(var.q_norm, h), _norm_row(var.k_norm, g)
    q_normed = q_proj if wqn is None else norm(q_proj, wqn, var.norm_eps)
    k_normed = k_proj if wkn is None else norm(k_proj, wkn, var.norm_eps)
    # 3. RoPE, at positions= / key_positions= or the default positions
    q, k = q_normed, k_normed
    if var.rotary_dim:
        q = rope(q_normed, query_positions(var, B, Tq, Tk)[b], var.inv_freq,
                 var.rotary_dim, var.interleaved)
        k = rope(k_normed, key_positions_of(var, B, Tk)[b], var.inv_freq,
                 var.rotary_dim, var.interleaved)
    # 7. the biases: ALiBi at the attention's own positions, and the float mask
    bias = None
    if var.alibi is not None:
        if var.packed and var.alibi.shape[0] > 1:   # a row per packed sequence
            slope = var.alibi[sequence_ids(var.cu_q, Tq), h]
        else:
            slope = var.alibi[b if var.alibi.shape[0] > 1 else 0, h]
        bias = alibi_bias(slope, query_positions(var, B, Tq, Tk, for_rope=False)[b],
                          key_positions_of(var, B, Tk, for_rope=False)[b], call.dtype)
    # T5's bias at the same positions
    relative = None
    if var.rel is not None:
        table, max_distance, bidirectional = var.rel
        relative = relative_bias(table, h, query_positions(var, B, Tq, Tk, for_rope=False)[b],
                                 key_positions_of(var, B, Tk, for_rope=False)[b],
                                 bidirectional, max_distance, call.dtype)
    additive = None
    if call.mask is not None and call.mask.dtype != bool:
        additive = call.mask[b, h]
    # 8. which keys the row sees
    allowed = allowed_keys(call, b, h)
    # 4-8. the scores
    st = score_steps(q, k, call.scales[h], cap=var.softcap, bias=bias, additive=additive,
                     allowed=allowed, relative=relative)
    # 9. softmax with the sink, which the weights exclude and the lse includes
    sink = None if var.sinks is None else var.sinks[h]
    probs = softmax(st["scores"], sink)
    # 9b. dropout: kept weights scaled by 1 / (1 - p), the others 0
    keep, weights = None, probs
    if var.dropout > 0:
        keep = dropout_keep(var.seed, b, h, Tq, Tk, var.dropout)
        inv = probs.dtype.type(1.0 / (1.0 - var.dropout))
        weights = np.where(keep, probs * inv, probs.dtype.type(0))
    return dict(q_proj=q_proj, k_proj=k_proj, q_normed=q_normed, k_normed=k_normed,
                q=q, k=k, raw_scores=st["raw_scores"], scaled=st["scaled"],
                capped=st["capped"], bias=bias, relative=relative, additive=additive,
                allowed=allowed,
                scores=st["scores"], sink=sink, probs=probs, keep=keep, weights=weights,
                lse=log_sum_exp(st["scores"], sink))


def _output_gate(call: Call, b: int) -> np.ndarray:
    """(Tq, sum d_v): the output gate of batch item b, sigmoid(X W_gate +
    b_gate), in the call's dtype; the concatenation is multiplied by it."""
    z = call.x[b] @ call.w_gate
    if call.b_gate is not None:
        z = z + call.b_gate
    with np.errstate(over="ignore"):   # exp(-z) = inf for z << 0: the gate is 0
        return (1 / (1 + np.exp(-z))).astype(call.dtype)


def _run(call: Call):
    """(out (B, Tq, d_out), weights (B, H, Tq, Tk), lse (B, H, Tq)) of a call."""
    B, Tq, Tk, H = call.B, call.Tq, call.Tk, call.H
    outs = []
    all_weights = np.zeros((B, H, Tq, Tk), dtype=call.dtype)
    all_lse = np.zeros((B, H, Tq), dtype=call.dtype)
    for b in range(B):
        heads = []
        for h in range(H):
            step = head_intermediates(call, b, h)
            heads.append(step["head"])
            all_weights[b, h] = step["weights"]
            all_lse[b, h] = step["lse"]
        # 11. Concat(head_1, ..., head_h): side by side along the features.
        concat = np.concatenate(heads, axis=-1)
        # The output gate, when there is one: elementwise, per query row.
        if call.w_gate is not None:
            concat = _output_gate(call, b) * concat
        # 12. W^O
        out = concat @ call.w_o if call.w_o is not None else concat
        if call.b_o is not None:
            out = out + call.b_o
        outs.append(out)
    out = np.stack(outs) if outs else np.zeros((0, Tq, call.d_out), dtype=call.dtype)
    return np.ascontiguousarray(out, dtype=call.dtype), all_weights, all_lse


def multi_head_attention(x, w_q, w_k, w_v, w_o=None, *, num_heads=None, key=None,
                         value=None, scale=None, return_weights=False, mask=None,
                         causal=False, key_lengths=None, num_kv_heads=None,
                         b_q=None, b_k=None, b_v=None, b_o=None, w_gate=None,
                         b_gate=None, window=None, softcap=None, alibi_slopes=None,
                         sinks=None, q_norm=None, k_norm=None, norm_eps=1e-6, norm_type="rms",
                         rope=None, positions=None, key_positions=None, key_mask=None,
                         cu_seqlens=None, key_cu_seqlens=None, dropout=0.0, seed=None,
                         relative_bias=None, chunk=None, block_mask=None):
    """Reference multi-head attention; same arguments and results as
    :func:`mhattn.multi_head_attention`.

    Parameters
    ----------
    x, w_q, w_k, w_v, w_o, num_heads, key, value, scale, return_weights, mask
        As :func:`mhattn.multi_head_attention`.
    causal, key_lengths, num_kv_heads, b_q, b_k, b_v, b_o
        As :func:`mhattn.multi_head_attention`.
    w_gate, b_gate : (d_in, sum d_v), (sum d_v,), optional
        The output gate: the concatenation becomes
        sigmoid(x @ w_gate + b_gate) * concat before W^O.
    window : (left, right), optional
        Key j is visible from query i iff p_i - left <= j <= p_i + right
        (None: unbounded).  Mistral's sliding_window=W is (W-1, 0).
    softcap : float, optional
        Scores become c tanh(s / c) after the scale.
    alibi_slopes : (h,) or (B, h), optional
        Adds -slope abs(p_i - j) after the softcap.
    sinks : (h,), optional
        One extra softmax logit of zero value per query head.
    q_norm, k_norm : (d_k,) or (h, d_k) / (h_kv, d_k), optional
        Norm weights applied to the projected q / k, eps ``norm_eps``.
    norm_eps : float, default 1e-6
        The q/k norm's epsilon.
    norm_type : "rms" (default) or "layer"
        The q/k norm: :func:`rms_norm`, or :func:`layer_norm` (mean-centred,
        no bias); read only where q_norm or k_norm is given.
    rope : mhattn.RoPE, optional
        Rotary embedding after the norm, at ``positions`` (queries, default
        p_i) and ``key_positions`` (keys, default j).
    positions, key_positions : int (T_q,) / (B, T_q), (T_k,) / (B, T_k), optional
        The positions RoPE uses, as :func:`mhattn.multi_head_attention`.
    key_mask : (T_k,) or (B, T_k) bool, optional
        False = a padding key.
    cu_seqlens, key_cu_seqlens : (n+1,) int, optional
        Packed sequences of a 2-D x (and key): a query sees only its own
        sequence's keys, and positions, causal and window are per sequence.
    dropout, seed : float, int or numpy.random.Generator, optional
        Dropout on the weights with :func:`dropout_keep`'s mask: the C
        core's, bit for bit, for the same seed.
    relative_bias : mhattn.RelativeBias, optional
        T5's bias, :func:`relative_bias` of each head, added after ALiBi's.
    chunk : int, optional
        Chunked attention: query i sees key j only when p_i // chunk ==
        j // chunk (:func:`allowed_keys`).
    block_mask : mhattn.BlockMask, optional
        Query i of head h in batch item b sees key j only where its
        :meth:`~mhattn.BlockMask.to_dense` is True (:func:`allowed_keys`).

    Returns
    -------
    out : (T_q, d_out) or (B, T_q, d_out)
    weights : (h, T_q, T_k) or (B, h, T_q, T_k), when ``return_weights``

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((5, 8))
    >>> w = rng.standard_normal((8, 8))
    >>> out = multi_head_attention(x, w, w, w, w, num_heads=2, causal=True,
    ...                            window=(2, 0), softcap=30.0)
    >>> out.shape
    (5, 8)
    """
    call = normalize(x, w_q, w_k, w_v, w_o, num_heads=num_heads, key=key, value=value,
                     scale=scale, mask=mask, causal=causal, key_lengths=key_lengths,
                     num_kv_heads=num_kv_heads, b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o,
                     w_gate=w_gate, b_gate=b_gate, half_as=np.float64,
                     **variant_kwargs(locals()))
    return_weights = bool_arg("return_weights", return_weights)
    # The reference keeps every head's weights: check they fit first.
    check_memory(plan(call, want_weights=True))
    out, weights, _ = _run(call)
    out = call.unbatch(out)
    if return_weights:
        return out, call.unbatch(weights)
    return out


def lse(x, w_q, w_k, w_v, w_o=None, **keywords) -> np.ndarray:
    """Each query row's log-sum-exp per head, the sink included, as the C core keeps it.

    Parameters
    ----------
    x, w_q, w_k, w_v, w_o, **keywords
        As :func:`multi_head_attention` (not ``return_weights``).

    Returns
    -------
    lse : (h, T_q) or (B, h, T_q)
        log(exp(sink_h) + sum_j exp(s_ij)) over the finished scores; -inf for
        a fully masked row without a sink.

    Examples
    --------
    >>> x = np.zeros((2, 4)); w = np.eye(4)
    >>> lse(x, w, w, w, num_heads=1)          # two equal scores: log 2
    array([[0.69314718, 0.69314718]])
    """
    call = normalize(x, w_q, w_k, w_v, w_o, half_as=np.float64, **keywords)
    check_memory(plan(call, want_weights=True))
    return call.unbatch(_run(call)[2])


_ATTENTION_VARIANTS = ("window", "softcap", "alibi_slopes", "sinks", "key_mask",
                       "cu_seqlens", "key_cu_seqlens", "dropout", "seed", "relative_bias",
                       "chunk", "block_mask", "q_offset")


def projected_attention(q, k, v, *, layout="bhtd", scale=None, mask=None, causal=False,
                        key_lengths=None, **variants):
    """Reference :func:`mhattn.attention`: attention on projected tensors.

    Parameters
    ----------
    q, k, v : (B, H, T_q, d_k), (B, G, T_k, d_k) and (B, G, T_k, d_v) arrays
        Or (B, T, heads, d) with ``layout="bthd"``; or unbatched 3-D.
    layout, scale, mask, causal, key_lengths, **variants
        As :func:`mhattn.attention` (window, softcap, alibi_slopes, sinks,
        key_mask, cu_seqlens, key_cu_seqlens); any other keyword (rope=,
        q_norm=, ...) is refused with a TypeError, as attention refuses it,
        and q, k, v and layout are checked as attention checks them.

    Returns
    -------
    (out, weights, lse): out in the layout of q, weights (B, H, T_q, T_k),
    lse (B, H, T_q) (natural log, -inf for a fully masked row without
    sinks); unbatched inputs drop B.

    The heads are the columns of fused tensors and the projections are
    identities, so this is :func:`multi_head_attention`'s own code: q x I
    is exact.

    Examples
    --------
    >>> q = k = v = np.ones((2, 3, 4))
    >>> out, w, lse = projected_attention(q, k, v)
    >>> out.shape, w.shape, lse.shape
    ((2, 3, 4), (2, 3, 3), (2, 3))
    """
    # the keywords and the q, k, v, layout mhattn.attention takes, refused as
    # it refuses them (its rope= / q_norm= are multi_head_attention's only)
    for name in variants:
        if name not in _ATTENTION_VARIANTS:
            raise TypeError(f"projected_attention() got an unexpected keyword argument "
                            f"{name!r}")
    from ..compute.attention import check_projected   # compute imports the core
    check_projected(q, k, v, layout)
    arrays = [np.asarray(a) for a in (q, k, v)]
    batched = arrays[0].ndim == 4
    if not batched:
        arrays = [a[np.newaxis] for a in arrays]
    if layout == "bhtd":
        arrays = [np.swapaxes(a, 1, 2) for a in arrays]
    (B, Tq, H, dk), (_, Tk, G, _), (_, _, _, dv) = (a.shape for a in arrays)
    fused = [a.reshape(a.shape[0], a.shape[1], a.shape[2] * a.shape[3]) for a in arrays]
    if not batched:
        fused = [f[0] for f in fused]
    # identities in the inputs' dtype (a half call's numbers share one dtype)
    half = shared_half([("q", arrays[0]), ("k", arrays[1]), ("v", arrays[2])])
    et = half if half is not None else np.float64
    call = normalize(fused[0], np.eye(H * dk, dtype=et), np.eye(G * dk, dtype=et),
                     np.eye(G * dv, dtype=et),
                     num_heads=H, num_kv_heads=G, key=fused[1], value=fused[2],
                     scale=scale if scale is not None else 1.0 / np.sqrt(dk), mask=mask,
                     causal=causal, key_lengths=key_lengths, half_as=np.float64,
                     **variants)
    check_memory(plan(call, want_weights=True))
    concat, weights, lse_ = _run(call)
    out = concat.reshape(B, Tq, H, dv)
    if layout == "bhtd":
        out = np.ascontiguousarray(np.swapaxes(out, 1, 2))
    dt = np.float64 if half is not None else np.result_type(np.float32, *arrays)
    out, weights, lse_ = (a.astype(dt) for a in (out, weights, lse_))
    if not batched:
        return out[0], weights[0], lse_[0]
    return out, weights, lse_


def param_count(d_model: int, num_heads: int, d_k: Optional[int] = None,
                d_v: Optional[int] = None) -> int:
    """Weights in W^Q, W^K, W^V (all heads) and W^O, without biases.

    h heads of d_model x d_k for W^Q and W^K, h of d_model x d_v for W^V and
    (h d_v) x d_model for W^O.  Under the convention d_k = d_v = d_model / h
    this is 4 d_model^2, whatever h is.

    Parameters
    ----------
    d_model : int
        The model width.
    num_heads : int
        h, the number of heads.
    d_k, d_v : int, optional
        The head widths; default d_k = d_model / h (h must then divide
        d_model) and d_v = d_k.

    Returns
    -------
    int
        2 h d_model d_k + 2 h d_model d_v.

    Examples
    --------
    >>> mhattn.param_count(512, 8), mhattn.param_count(512, 1)   # 4 * 512**2 both
    (1048576, 1048576)
    """
    from .._internal.args import _int_arg
    d_model = _int_arg("d_model", d_model, allow_none=False)
    h = _int_arg("num_heads", num_heads, allow_none=False)
    d_k = _int_arg("d_k", d_k)
    d_v = _int_arg("d_v", d_v)
    if d_k is None:
        if d_model % h:
            raise ValueError(f"num_heads: {h} does not divide d_model={d_model}; "
                             "pass d_k explicitly")
        d_k = d_model // h
    d_v = d_k if d_v is None else d_v
    return h * d_model * d_k * 2 + h * d_model * d_v + h * d_v * d_model


def worked_example():
    """The document's worked example: (tokens, X, w_q, w_k, w_v, w_o).

    Three tokens ball, full, it with 4-d embeddings; two heads of width 2.
    Head 1 reads the entity and bias columns, head 2 the adjective and bias
    columns, and both heads share one value projection.  W^O is the identity.

    Returns
    -------
    tokens : list of str
        ``['ball', 'full', 'it']``.
    X : (3, 4) float64 array
        The embeddings, one row per token.
    w_q, w_k, w_v : lists of two (4, 2) float64 arrays
        Per-head weights (w_v holds one array twice, the shared W_V).
    w_o : (4, 4) float64 array
        The identity.

    Examples
    --------
    >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    >>> tokens, X.shape, len(w_q)
    (['ball', 'full', 'it'], (3, 4), 2)
    """
    tokens = ["ball", "full", "it"]
    X = np.array([[3, 0, 0, 1], [0, 3, 0, 1], [1, 1, 0, 1]], dtype=float)
    W_Q1 = np.array([[1, 0], [0, 0], [0, 0], [0, 1]], dtype=float)
    W_Q2 = np.array([[0, 0], [1, 0], [0, 0], [0, 1]], dtype=float)
    W_V = np.array([[1 / 3, 0], [0, 1 / 3], [0, 0], [0, 0]], dtype=float)
    return tokens, X, [W_Q1, W_Q2], [W_Q1.copy(), W_Q2.copy()], [W_V, W_V], np.eye(4)
