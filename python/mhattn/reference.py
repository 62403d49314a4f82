"""The pure-NumPy reference: the document's code, generalised.

This module is what mhattn's C core is tested against, and what a learner can
read next to ``shared/seed/multi-head-attention.txt``.  Each function is one
equation of the document, written as plainly as NumPy allows:

    Q = X W^Q      K = X W^K      V = X W^V             (project)
    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V   (attention)
    head_i = Attention(X W_i^Q, X W_i^K, X W_i^V)       (one head)
    MultiHead(X) = Concat(head_1, ..., head_h) W^O      (combine)

It takes exactly the arguments of :func:`mhattn.multi_head_attention` and
returns the same thing, computed in the same dtype (float32 stays float32).
Speed is not a goal here: every head is a Python loop iteration and every
step a named intermediate.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ._args import Call, bool_arg, check_memory, normalize, plan

__all__ = ["multi_head_attention", "softmax", "attention", "weighted_values",
           "allowed_keys", "param_count", "head_intermediates", "worked_example"]


def softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, subtracting the row maximum as the document does.

    Entries of -inf are blocked keys and get weight 0.  A row with every entry
    -inf is *fully masked*: its weights are all 0 (not NaN), so the head
    attends to nothing and contributes a zero vector.  A NaN score, or a
    +inf one (inf - inf), makes its row NaN, as IEEE arithmetic says: it is
    never mistaken for a fully masked row.
    """
    # initial=-inf: with no key at all (T_k = 0) the row is fully masked too.
    m = scores.max(axis=-1, keepdims=True, initial=-np.inf)
    # A fully masked row has max -inf; subtracting 0 instead keeps exp(-inf) = 0
    # rather than exp(-inf - -inf) = exp(nan).
    m = np.where(np.isneginf(m), 0, m)
    w = np.exp(scores - m)
    total = w.sum(axis=-1, keepdims=True)
    # Only a fully masked row sums to exactly 0 (the maximum contributes
    # exp(0) = 1 otherwise); a NaN total stays NaN.
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total == 0, 0, w / np.where(total == 0, 1, total)).astype(scores.dtype)


def allowed_keys(call: Call, b: int, h: int) -> np.ndarray:
    """(Tq, Tk) bool: which keys query row i of head h, batch item b may attend to.

    causal: query i sees keys j <= i + (Tk - Tq): the triangle is aligned
    bottom-right (FlashAttention's convention), so one new query against a
    long key cache sees every key.  key_lengths: keys j >= length are padding.
    A boolean mask: True = may attend.
    """
    Tq, Tk = call.Tq, call.Tk
    ok = np.ones((Tq, Tk), dtype=bool)
    if call.causal:
        i = np.arange(Tq)[:, None]
        j = np.arange(Tk)[None, :]
        ok &= j <= i + (Tk - Tq)
    if call.key_lengths is not None:
        ok &= (np.arange(Tk) < call.key_lengths[b])[None, :]
    if call.mask is not None and call.mask.dtype == bool:
        ok &= call.mask[b, h]
    return ok


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
              allowed: Optional[np.ndarray] = None,
              additive: Optional[np.ndarray] = None):
    """softmax(q k^T * scale [+ additive], blocked = -inf) v, for one head.

    q (Tq, dk), k (Tk, dk), v (Tk, dv).  Returns (raw, scores, weights, out):
    raw = q k^T, scores = the scaled and masked scores, weights (Tq, Tk) and
    out (Tq, dv).
    """
    raw = q @ k.T
    scores = raw * q.dtype.type(scale)
    if additive is not None:
        scores = scores + additive
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf).astype(q.dtype)
    weights = softmax(scores)
    return raw, scores, weights, weighted_values(weights, v)


def weighted_values(weights: np.ndarray, v: np.ndarray) -> np.ndarray:
    """weights @ v, where a key of weight exactly 0 adds nothing.

    0 * inf is NaN, so with a plain product an Inf or NaN value at a blocked
    key (padding beyond key_lengths, a masked or causally hidden key) would
    poison the row.  Keys the row does not attend to are never read; the
    C core does the same.
    """
    if np.isfinite(v).all():
        return weights @ v
    out = np.zeros((weights.shape[0], v.shape[1]), dtype=np.result_type(weights, v))
    for i in range(weights.shape[0]):
        seen = weights[i] != 0
        out[i] = weights[i, seen] @ v[seen]
    return out


def _project(inp: np.ndarray, w: np.ndarray, b: Optional[np.ndarray]) -> np.ndarray:
    """X W (+ b): the document's row-vector convention."""
    out = inp @ w
    return out if b is None else out + b


def head_intermediates(call: Call, b: int, h: int) -> dict:
    """Every step of head h on batch item b, named as in the document."""
    g = call.kv_head(h)
    q = _project(call.x[b], call.wq.heads[h], None if call.bq is None else call.bq[h])
    k = _project(call.key[b], call.wk.heads[g], None if call.bk is None else call.bk[g])
    v = _project(call.value[b], call.wv.heads[g], None if call.bv is None else call.bv[g])
    additive = None
    if call.mask is not None and call.mask.dtype != bool:
        additive = call.mask[b, h]
    raw, scores, weights, out = attention(q, k, v, call.scales[h],
                                          allowed_keys(call, b, h), additive)
    return dict(q=q, k=k, v=v, raw_scores=raw, scores=scores, weights=weights, head=out)


def multi_head_attention(x, w_q, w_k, w_v, w_o=None, *, num_heads=None, key=None,
                         value=None, scale=None, return_weights=False, mask=None,
                         causal=False, key_lengths=None, num_kv_heads=None,
                         b_q=None, b_k=None, b_v=None, b_o=None):
    """Reference multi-head attention; same arguments and results as
    :func:`mhattn.multi_head_attention`."""
    call = normalize(x, w_q, w_k, w_v, w_o, num_heads=num_heads, key=key, value=value,
                     scale=scale, mask=mask, causal=causal, key_lengths=key_lengths,
                     num_kv_heads=num_kv_heads, b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o)
    return_weights = bool_arg("return_weights", return_weights)
    B, Tq, Tk, H = call.B, call.Tq, call.Tk, call.H
    # The reference keeps every head's weights: check they fit first.
    check_memory(plan(call, want_weights=True))
    outs, all_weights = [], np.zeros((B, H, Tq, Tk), dtype=call.dtype)
    for b in range(B):
        heads = []
        for h in range(H):
            step = head_intermediates(call, b, h)
            heads.append(step["head"])
            all_weights[b, h] = step["weights"]
        # Concat(head_1, ..., head_h): side by side along the features.
        concat = np.concatenate(heads, axis=-1)
        out = concat @ call.w_o if call.w_o is not None else concat
        if call.b_o is not None:
            out = out + call.b_o
        outs.append(out)
    d_out = call.d_out
    out = np.stack(outs) if outs else np.zeros((0, Tq, d_out), dtype=call.dtype)
    out = np.ascontiguousarray(out, dtype=call.dtype)
    out = call.unbatch(out)
    if return_weights:
        return out, call.unbatch(all_weights)
    return out


def param_count(d_model: int, num_heads: int, d_k: Optional[int] = None,
                d_v: Optional[int] = None) -> int:
    """Weights in W^Q, W^K, W^V (all heads) and W^O, without biases.

    h heads of d_model x d_k for W^Q and W^K, h of d_model x d_v for W^V and
    (h d_v) x d_model for W^O.  Under the convention d_k = d_v = d_model / h
    this is 4 d_model^2, whatever h is.
    """
    from ._args import _int_arg
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
    """
    tokens = ["ball", "full", "it"]
    X = np.array([[3, 0, 0, 1], [0, 3, 0, 1], [1, 1, 0, 1]], dtype=float)
    W_Q1 = np.array([[1, 0], [0, 0], [0, 0], [0, 1]], dtype=float)
    W_Q2 = np.array([[0, 0], [1, 0], [0, 0], [0, 1]], dtype=float)
    W_V = np.array([[1 / 3, 0], [0, 1 / 3], [0, 0], [0, 0]], dtype=float)
    return tokens, X, [W_Q1, W_Q2], [W_Q1.copy(), W_Q2.copy()], [W_V, W_V], np.eye(4)
