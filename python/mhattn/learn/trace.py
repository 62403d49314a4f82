"""mhattn.trace: every step of multi-head attention, per head, for inspection.

A :class:`Trace` holds the intermediates of one call, named after the
document's equations::

    q, k, v      Q_i = X W_i^Q,  K_i = X W_i^K,  V_i = X W_i^V
    raw_scores   Q_i K_i^T
    scores       Q_i K_i^T * scale_i, masked (-inf where a key is blocked)
    row_max      the maximum of each row of scores
    lse          log sum_j exp(scores_ij), each row's log-sum-exp
    weights      softmax(scores) along the keys
    heads        head_i = weights_i V_i
    concat       Concat(head_1, ..., head_h)
    output       Concat(...) W^O (+ b_o)

With the variants of today's models, the trace holds their steps too, in
the order of a score's life (only those the call uses):

    q_proj, k_proj     X W^Q (+ b), before the q/k norm and RoPE
    q_normed, k_normed norm(q_proj), norm(k_proj)           (q_norm, k_norm;
                       RMSNorm, or LayerNorm with norm_type="layer")
    q, k               what the scores use: after the norm and RoPE
    capped             softcap * tanh(raw_scores * scale / softcap)   (softcap)
    bias               ALiBi's -slope * abs(p_i - j)                    (alibi_slopes)
    scores             ... + bias + additive mask, -inf where a rule blocks
    lse                the sinks included; ``sinks`` holds them     (sinks)
    gate               sigmoid(X W_gate + b_gate), per query row    (w_gate)
    gated              gate * concat, what W^O reads                (w_gate)

The projections, weights, lse, concat and output come from mhattn's C core
(the same numbers :func:`mhattn.multi_head_attention` computes); the raw and
scaled scores and the row maximum are recomputed in NumPy from the core's q
and k with the reference's own masking code (:func:`mhattn.reference.attention`
and :func:`mhattn.reference.allowed_keys`), and the output gate from x as the
reference computes it.  ``concat`` is the heads side by side, before the
gate.

Layout of the per-head stages: when every head has the same width, a stage
is one array, ``(h, T, d)`` for an unbatched call and ``(B, h, T, d)`` for a
batched one.  When the widths are ragged (per-head lists of weights of
different widths), ``q``/``k`` (or ``v``/``heads``) is a list of h arrays,
``(T, d_i)`` or ``(B, T, d_i)``.  ``k`` and ``v`` are indexed by *query* head:
with grouped-query attention, the query heads sharing one key/value head see
the same keys.  Scores, weights are always ``(h, T_q, T_k)`` (or
``(B, h, T_q, T_k)``), row_max and lse ``(h, T_q)`` (or ``(B, h, T_q)``).
"""
from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .._internal.args import PER_HEAD_BYTES, Call, check_memory, normalize, plan
from .._internal.core import run_core
from .._internal.variants import variant_kwargs
from .. import reference
from .html import _num  # a figure of the comparison: '' / 'inf' / 3 digits

__all__ = ["trace", "Trace", "CompareReport", "StageDiff", "STAGES", "VARIANT_KEYS"]

#: The stages :meth:`Trace.compare` checks, in the order they are computed.
STAGES = ("q", "k", "v", "raw_scores", "scores", "weights", "heads", "concat", "output")

#: Every array a Trace holds (``to_dict`` keys), in computing order.
KEYS = ("q", "k", "v", "raw_scores", "scores", "row_max", "lse", "weights",
        "heads", "concat", "output")

#: The variants' stages, present when the call uses them (see the module doc).
VARIANT_KEYS = ("q_proj", "k_proj", "q_normed", "k_normed", "capped", "bias", "relative",
                "keep", "gate", "gated")

# Every stage in the order of a score's life.
_ORDER = ("q_proj", "k_proj", "q_normed", "k_normed", "q", "k", "v", "raw_scores",
          "capped", "bias", "relative", "scores", "row_max", "lse", "keep", "weights", "heads", "concat",
          "gate", "gated", "output")

_PER_HEAD = ("q", "k", "v", "heads", "q_proj", "k_proj", "q_normed", "k_normed")

# Aliases accepted by Trace.compare for the keys of a user's dict.
_ALIASES = {
    "out": "output", "y": "output", "result": "output", "attn_output": "output",
    "attn_out": "output", "attention_output": "output",
    "query": "q", "queries": "q", "key": "k", "keys": "k", "value": "v", "values": "v",
    "raw": "raw_scores", "qk": "raw_scores", "qkt": "raw_scores", "dots": "raw_scores",
    "raw_attention_scores": "raw_scores", "unscaled_scores": "raw_scores",
    "logits": "scores", "scaled_scores": "scores", "scores_scaled": "scores",
    "scaled": "scores", "attention_scores": "scores", "attn_scores": "scores",
    "attn": "weights", "attention": "weights", "attn_weights": "weights",
    "attention_weights": "weights", "probs": "weights", "attention_probs": "weights",
    "attn_probs": "weights", "softmax": "weights", "probabilities": "weights",
    "head": "heads", "head_outputs": "heads", "head_outs": "heads",
    "z": "concat", "concatenated": "concat", "concat_heads": "concat",
    "heads_concat": "concat", "merged": "concat", "context": "concat",
    "context_layer": "concat",
}

PerHead = Union[np.ndarray, List[np.ndarray]]


def canonical_key(name: str) -> Optional[str]:
    """The Trace key a user's dict key stands for, or None (case-insensitive)."""
    low = str(name).lower()
    if low in KEYS or low in VARIANT_KEYS:
        return low
    return _ALIASES.get(low)


def trace(x, w_q, w_k, w_v, w_o=None, *, num_heads=None, key=None, value=None,
          scale=None, mask=None, causal=False, key_lengths=None, num_kv_heads=None,
          b_q=None, b_k=None, b_v=None, b_o=None, w_gate=None, b_gate=None, tokens=None,
          key_tokens=None, window=None, softcap=None, alibi_slopes=None, sinks=None,
          q_norm=None, k_norm=None, norm_eps=1e-6, norm_type="rms", rope=None,
          positions=None, key_positions=None, key_mask=None, cu_seqlens=None,
          key_cu_seqlens=None, dropout=0.0, seed=None, relative_bias=None,
          chunk=None, block_mask=None) -> "Trace":
    """Every intermediate step of multi-head attention, per head.

    trace(x, w_q, w_k, w_v, w_o=None, *, num_heads=None, key=None, value=None,
          scale=None, mask=None, causal=False, key_lengths=None,
          num_kv_heads=None, b_q=None, b_k=None, b_v=None, b_o=None,
          tokens=None, key_tokens=None) -> Trace

    Takes exactly the arguments of :func:`mhattn.multi_head_attention` (there
    is no ``return_weights``: the trace holds the weights; the variants
    ``window`` ... ``key_cu_seqlens`` included), plus optional
    ``tokens`` (one label per query row) and ``key_tokens`` (one per key row;
    defaults to ``tokens`` for self-attention), used by the HTML display and
    by :func:`mhattn.plot_attention`.

    Parameters
    ----------
    x, w_q, w_k, w_v, w_o, num_heads, key, value, scale, mask, causal
        As :func:`mhattn.multi_head_attention`.
    key_lengths, num_kv_heads, b_q, b_k, b_v, b_o, w_gate, b_gate
        As :func:`mhattn.multi_head_attention`.
    tokens : sequence of str, optional
        One label per query row.
    key_tokens : sequence of str, optional
        One label per key row; defaults to ``tokens`` for self-attention.
    window, softcap, alibi_slopes, sinks, q_norm, k_norm, norm_eps, norm_type
        The variants, as :func:`mhattn.multi_head_attention` takes them.
    rope
        As :func:`mhattn.multi_head_attention`.
    positions, key_positions, key_mask, cu_seqlens, key_cu_seqlens
        As :func:`mhattn.multi_head_attention`.
    dropout, seed
        As :func:`mhattn.multi_head_attention`: ``weights`` are then those
        after dropout, and ``keep`` holds dropout's mask (bool, the shape of
        ``weights``).
    relative_bias
        As :func:`mhattn.multi_head_attention`: ``relative`` then holds T5's
        bias of every (b, h, i, j), the shape of ``scores``.
    chunk, block_mask
        As :func:`mhattn.multi_head_attention`.

    Returns
    -------
    Trace
        Holds, per head, ``q``, ``k``, ``v``, ``raw_scores`` (Q K^T),
        ``scores`` (scaled and masked: -inf where blocked), ``row_max``,
        ``lse``, ``weights`` and ``heads`` (each head's output), then
        ``concat`` (before the output gate; with ``w_gate``, ``gate`` and
        ``gated`` follow it) and ``output``.  A batched call (x of shape
        (B, T_q, d_in)) keeps the batch axis first.  Per-head stages are
        stacked (h, T, d) / (B, h, T, d) when all heads have one width, and
        a list of h arrays when widths differ.  Half precision inputs
        (float16, bfloat16) are traced in float32, the dtype the core
        computes them in: every stage is the float32 value, and
        :func:`mhattn.multi_head_attention`'s half result is ``output``
        rounded once (``output.astype(x.dtype)``).

    Examples
    --------
    >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    >>> t = mhattn.trace(X, w_q, w_k, w_v, w_o, tokens=tokens)
    >>> t.weights[0, 2].round(4)          # head 1, query "it"
    array([0.7337, 0.0879, 0.1784])
    """
    call = normalize(x, w_q, w_k, w_v, w_o, num_heads=num_heads, key=key, value=value,
                     scale=scale, mask=mask, causal=causal, key_lengths=key_lengths,
                     num_kv_heads=num_kv_heads, b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o,
                     w_gate=w_gate, b_gate=b_gate, **variant_kwargs(locals()))
    return Trace.from_call(call, tokens=tokens, key_tokens=key_tokens)


def _trace_items(call: Call) -> list:
    """What a trace allocates beyond the core's call, for check_memory.

    Every array the Trace keeps: the (B, h, T_q, T_k) raw scores and
    scores (and the capped scores and ALiBi bias when the call has them),
    the per-head stacks of every stage (k and v once per query head; the
    projections and normed q/k when the call transforms them), the fused
    copies the score stages are written into, and row_max; and the largest
    transient: one head's score steps at a time (the reference's q k^T,
    scaled, capped, biased and masked scores, its softmax and log-sum-exp
    temporaries, the bool mask of allowed keys) and its q/k norm and RoPE,
    computed in float64; and each head's views and lists. The sum bounds
    the peak: the per-head steps are freed before the stacks are made."""
    B, H, Tq, Tk, n = call.B, call.H, call.Tq, call.Tk, call.dtype.itemsize
    var, group = call.var, call.H // call.G
    norms = var.q_norm is not None or var.k_norm is not None
    items = [("the trace's raw_scores and scores", "2*B*h*T_q*T_k", (2, B, H, Tq, Tk), n),
             ("the trace's per-head q and heads", "B*T_q*(sum(d_k) + sum(d_v))",
              (B, Tq, call.Sq + call.Svq), n),
             ("the trace's per-head k and v", "B*T_k*h/g*(sum(d_k) + sum(d_v))",
              (B, Tk, group * (call.Sk + call.Sv)), n),
             ("the trace's row_max", "B*h*T_q", (B, H, Tq), n)]
    if var.softcap is not None:
        items.append(("the trace's capped scores", "B*h*T_q*T_k", (B, H, Tq, Tk), n))
    if var.alibi is not None:
        items.append(("the trace's ALiBi bias", "B*h*T_q*T_k", (B, H, Tq, Tk), n))
    if var.rel is not None:
        items.append(("the trace's T5 bias", "B*h*T_q*T_k", (B, H, Tq, Tk), n))
    if var.dropout > 0:
        # the keep mask, and one head's hash (its uint64 keys, uint32 bits)
        items.append(("the trace's dropout mask", "B*h*T_q*T_k", (B, H, Tq, Tk), 1))
        items.append(("one head's dropout hash", "T_q*T_k", (Tq, Tk), 8 + 3 * 4 + 1))
    if call.w_gate is not None:
        items.append(("the trace's gate and gated concatenation", "2*B*T_q*sum(d_v)",
                      (2, B, Tq, call.Svq), n))
    if var.transforms:
        # q, k after the norm / RoPE (fused and per head), the projections per
        # head, and with a norm the normed q, k (fused and per head).
        copies = 2 + 2 * norms
        items.append(("the trace's transformed q and k",
                      f"{copies}*B*(T_q*sum(d_k) + T_k*h/g*sum(d_k))",
                      (copies, B, Tq * call.Sq + Tk * group * call.Sk), n))
    # One head's score steps at their peak, in the softmax: raw, scaled,
    # scores and three arrays of the softmax (exp, quotient, its rounding),
    # one more each for the capped scores and the ALiBi bias, in the call's
    # dtype; the allowed keys in bool.
    # T5's: its bias and its distances and buckets (int64 each).
    steps = 6 + (var.softcap is not None) + (var.alibi is not None) + 3 * (var.rel is not None)
    items.append((f"one head's score steps ({steps} arrays and a bool mask)", "T_q*T_k",
                  (Tq, Tk), steps * n + 1))
    # The views and lists of each head's stages, as elsewhere (PER_HEAD_BYTES).
    items.append(("the trace's per-head bookkeeping", "h", (H,), PER_HEAD_BYTES))
    if var.transforms:
        # the norm and rope in float64: at most 8 (T, d_k) arrays per side.
        items.append(("one head's q/k norm and RoPE, in float64", "8*(T_q + T_k)*max(d_k)",
                      (8, Tq + Tk, max(call.dk, default=0)), 8))
    return items


def _score_stages(call: Call, q: np.ndarray, k: np.ndarray) -> dict:
    """The score stages of every (b, h) from the core's projections q (B, Tq,
    Sq) and k (B, Tk, Sk), by the reference's steps
    (:func:`mhattn.reference.head_scores`): q_normed, k_normed, q, k (in
    the fused layout); raw, capped, bias, scores (B, H, Tq, Tk), capped and
    bias None when the call has no softcap / ALiBi, relative without T5's bias."""
    var, B, H, Tq, Tk = call.var, call.B, call.H, call.Tq, call.Tk
    # Without a norm or RoPE the scores use the projections themselves.
    norms = var.q_norm is not None or var.k_norm is not None
    qn, kn = (q.copy(), k.copy()) if norms else (q, k)
    qr, kr = (q.copy(), k.copy()) if var.transforms else (q, k)
    shape = (B, H, Tq, Tk)
    out = dict(raw=np.empty(shape, call.dtype), scores=np.empty(shape, call.dtype),
               capped=np.empty(shape, call.dtype) if var.softcap is not None else None,
               bias=np.empty(shape, call.dtype) if var.alibi is not None else None,
               relative=np.empty(shape, call.dtype) if var.rel is not None else None)
    # With no keys at all (T_k == 0) there is nothing to score.
    for b in range(B if Tk else 0):
        for h in range(H):
            qc, kc = call.q_cols(h), call.k_cols(call.kv_head(h))
            st = reference.head_scores(call, b, h, q[b, :, qc], k[b, :, kc])
            if norms:
                qn[b, :, qc], kn[b, :, kc] = st["q_normed"], st["k_normed"]
            if var.transforms:
                qr[b, :, qc], kr[b, :, kc] = st["q"], st["k"]
            out["raw"][b, h], out["scores"][b, h] = st["raw_scores"], st["scores"]
            for name in ("capped", "bias", "relative"):
                if out[name] is not None:
                    out[name][b, h] = st[name]
            # Freed before the next head's steps: one head's at a time.
            del st
    return dict(out, q_normed=qn, k_normed=kn, q=qr, k=kr)


def _tol(name: str, value: Any) -> Optional[float]:
    """None, or a finite number >= 0."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number >= 0 or None, got {value!r:.80} "
                        f"({type(value).__name__})")
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name}: expected a finite number >= 0, got {value}")
    return value


def _labels(name: str, labels: Any, n: int) -> Optional[List[str]]:
    if labels is None:
        return None
    if isinstance(labels, (str, bytes)) or not hasattr(labels, "__iter__"):
        raise TypeError(f"{name}: expected a sequence of {n} labels, got "
                        f"{labels!r:.80} ({type(labels).__name__})")
    # At most n + 1 labels are read: an endless iterator is refused, not a hang.
    out = [str(t) for t in itertools.islice(labels, n + 1)]
    if len(out) != n:
        raise ValueError(f"{name}: expected {n} labels, got {len(out)}")
    return out


class Trace:
    """The intermediates of one multi-head attention call (see :func:`trace`).

    Attributes: ``q``, ``k``, ``v``, ``raw_scores``, ``scores``, ``row_max``,
    ``lse``, ``weights``, ``heads``, ``concat``, ``output`` (arrays, or lists
    of per-head arrays when head widths differ), and the configuration:
    ``num_heads``, ``num_kv_heads``, ``d_k`` and ``d_v`` (per query head),
    ``scales`` (per query head), ``batched``, ``dtype``, ``causal``,
    ``masked``, ``tokens``, ``key_tokens``.

    Methods: ``to_dict()``, ``head(i, b=None)``, ``compare(other)``; the
    HTML display (``_repr_html_``) shows every step with its shape, and the
    values when the matrices are small.

    :func:`mhattn.trace` makes one (through :meth:`from_call`); built by
    hand, it is whole or refused.

    Parameters
    ----------
    arrays : mapping of str to arrays
        The stages, keyed as :meth:`to_dict` keys them: each of ``q``,
        ``k``, ``v``, ``raw_scores``, ``scores``, ``row_max``, ``lse``,
        ``weights``, ``heads``, ``concat`` and ``output`` an array (a
        per-head stage may be a list of per-head arrays); the variants'
        stages and ``sinks`` when the call used them.
    num_heads, num_kv_heads : int
        The query heads and the key/value heads.
    d_k, d_v : sequence of int
        The head widths, per query head.
    scales : sequence of float
        The multiplier of the scores, per query head.
    batched : bool
        Whether the stages hold the batch axis first.
    dtype : dtype
        The dtype the stages were computed in.
    causal, masked : bool, default False
        Whether the call was causal, and whether it had a mask or key
        lengths.
    norm_type : "rms" (default) or "layer"
        The call's q/k norm (``q_normed``, ``k_normed``): RMSNorm or
        LayerNorm, named so in the HTML display.
    tokens, key_tokens : sequence of str, optional
        The labels of the query rows and of the key rows.

    Examples
    --------
    >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    >>> t = mhattn.trace(X, w_q, w_k, w_v, w_o, tokens=tokens)
    >>> t.weights.shape, t.keys()[:3]
    ((2, 3, 3), ('q', 'k', 'v'))
    """

    q: PerHead
    k: PerHead
    v: PerHead
    raw_scores: np.ndarray
    scores: np.ndarray
    row_max: np.ndarray
    lse: np.ndarray
    weights: np.ndarray
    heads: PerHead
    concat: np.ndarray
    output: np.ndarray

    def __init__(self, arrays: Mapping[str, Any], *, num_heads: int, num_kv_heads: int,
                 d_k: Sequence[int], d_v: Sequence[int], scales: Sequence[float],
                 batched: bool, dtype, causal: bool = False, masked: bool = False,
                 norm_type: str = "rms", tokens: Optional[Sequence[str]] = None,
                 key_tokens: Optional[Sequence[str]] = None):
        # Made by mhattn.trace (Trace.from_call); built by hand, it is whole
        # or refused: every stage an array (a per-head one may be a list).
        if not isinstance(arrays, Mapping):
            raise TypeError(f"arrays: expected a dict of the stages' arrays, got "
                            f"{type(arrays).__name__}; mhattn.trace(...) makes a Trace")
        missing = [k for k in KEYS if k not in arrays]
        if missing:
            raise ValueError(f"Trace: missing arrays {missing}")
        for k in KEYS:
            a = arrays[k]
            if not (isinstance(a, np.ndarray) or (k in _PER_HEAD and isinstance(a, list)
                                                  and all(isinstance(p, np.ndarray)
                                                          for p in a))):
                raise TypeError(f"arrays[{k!r}]: expected an array"
                                f"{' or a list of per-head arrays' if k in _PER_HEAD else ''}"
                                f", got {type(a).__name__}")
        if arrays["weights"].ndim not in (3, 4):
            raise ValueError(f"arrays['weights']: expected (h, T_q, T_k) or "
                             f"(B, h, T_q, T_k), got shape {arrays['weights'].shape}")
        self.q, self.k, self.v = arrays["q"], arrays["k"], arrays["v"]
        self.raw_scores, self.scores = arrays["raw_scores"], arrays["scores"]
        self.row_max, self.lse = arrays["row_max"], arrays["lse"]
        self.weights, self.heads = arrays["weights"], arrays["heads"]
        self.concat, self.output = arrays["concat"], arrays["output"]
        # The variants' stages the call used, and its sinks (or None).
        self.variant_stages = tuple(k for k in VARIANT_KEYS if arrays.get(k) is not None)
        for k in VARIANT_KEYS:
            setattr(self, k, arrays.get(k))
        self.sinks = arrays.get("sinks")
        self.num_heads = int(num_heads)
        self.num_kv_heads = int(num_kv_heads)
        self.d_k = tuple(int(d) for d in d_k)
        self.d_v = tuple(int(d) for d in d_v)
        self.scales = tuple(float(s) for s in scales)
        self.batched = bool(batched)
        self.dtype = np.dtype(dtype)
        self.causal = bool(causal)
        self.masked = bool(masked)
        if norm_type not in ("rms", "layer"):   # a label of the display, nothing computed
            raise ValueError(f"norm_type: expected 'rms' or 'layer', got {norm_type!r:.80}")
        self.norm_type = str(norm_type)
        self.tokens = None if tokens is None else list(tokens)
        self.key_tokens = None if key_tokens is None else list(key_tokens)

    # ------------------------------------------------------------------ build
    @classmethod
    def from_call(cls, call: Call, *, tokens=None, key_tokens=None) -> "Trace":
        """Run the C core on a checked :class:`mhattn._internal.args.Call` and trace it.

        Parameters
        ----------
        call : mhattn._internal.args.Call
            The checked arguments of one call
            (:func:`mhattn._internal.args.normalize`).
        tokens, key_tokens : sequence of str, optional
            As :func:`mhattn.trace` takes them.

        Returns
        -------
        Trace
            What :func:`mhattn.trace` returns for those arguments.

        Examples
        --------
        >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
        >>> call = normalize(X, w_q, w_k, w_v, w_o)
        >>> Trace.from_call(call, tokens=tokens).weights.shape
        (2, 3, 3)
        """
        check_memory(plan(call, want_weights=True, keep=True) + _trace_items(call))
        out, weights, (q, k, v, concat, lse) = run_core(call, want_weights=True, keep=True)
        B, H, Tq, Tk = call.B, call.H, call.Tq, call.Tk
        tokens = _labels("tokens", tokens, Tq)
        if key_tokens is None and tokens is not None and Tk == Tq:
            key_tokens = tokens
        key_tokens = _labels("key_tokens", key_tokens, Tk)

        # Scores are not kept by the core: recompute them from its q and k
        # with the reference's own steps (one visible step each).
        st = _score_stages(call, q, k)
        scores = st["scores"]
        if Tk:
            row_max = scores.max(axis=-1)
        else:
            row_max = np.full((B, H, Tq), -np.inf, dtype=call.dtype)

        dk = [call.dk[call.kv_head(h)] for h in range(H)]
        dv = [call.dv[call.kv_head(h)] for h in range(H)]

        def per_head(buf: np.ndarray, cols) -> PerHead:
            parts = [buf[:, :, cols(h)] for h in range(H)]
            if len({p.shape[-1] for p in parts}) == 1:
                stacked = np.stack(parts, axis=1)  # (B, H, T, d)
                return call.unbatch(stacked)
            return [np.ascontiguousarray(call.unbatch(p)) for p in parts]

        kv_cols = lambda h: call.k_cols(call.kv_head(h))   # noqa: E731
        arrays = dict(
            q=per_head(st["q"], call.q_cols), k=per_head(st["k"], kv_cols),
            v=per_head(v, lambda h: call.v_cols(call.kv_head(h))),
            raw_scores=call.unbatch(st["raw"]), scores=call.unbatch(scores),
            row_max=call.unbatch(row_max), lse=call.unbatch(lse),
            weights=call.unbatch(weights),
            heads=per_head(concat, call.concat_cols),
            concat=call.unbatch(concat), output=call.unbatch(out))
        var = call.var
        if var.transforms:
            arrays.update(q_proj=per_head(q, call.q_cols), k_proj=per_head(k, kv_cols))
        if var.q_norm is not None or var.k_norm is not None:
            arrays.update(q_normed=per_head(st["q_normed"], call.q_cols),
                          k_normed=per_head(st["k_normed"], kv_cols))
        for name in ("capped", "bias", "relative"):
            if st[name] is not None:
                arrays[name] = call.unbatch(st[name])
        if var.dropout > 0:
            # Dropout's mask, by the reference's hash (the core's, bit for bit).
            keep = np.zeros((B, H, Tq, Tk), bool)
            for b in range(B):
                for h in range(H):
                    keep[b, h] = reference.dropout_keep(var.seed, b, h, Tq, Tk, var.dropout)
            arrays["keep"] = call.unbatch(keep)
        if call.w_gate is not None:
            # The output gate of each query row, by the reference's step.
            gate = np.stack([reference._output_gate(call, b) for b in range(B)]) if B else \
                np.zeros((0, Tq, call.Svq), call.dtype)
            arrays.update(gate=call.unbatch(gate), gated=call.unbatch(gate * concat))
        if var.sinks is not None:
            arrays["sinks"] = var.sinks.copy()
        return cls(arrays, num_heads=H, num_kv_heads=call.G, d_k=dk, d_v=dv,
                   scales=call.scales, batched=call.batched, dtype=call.dtype,
                   causal=call.causal,
                   masked=call.mask is not None or call.key_lengths is not None,
                   norm_type=var.norm_type, tokens=tokens, key_tokens=key_tokens)

    # ------------------------------------------------------------- accessors
    def to_dict(self) -> Dict[str, PerHead]:
        """{'q', 'k', 'v', 'raw_scores', 'scores', 'row_max', 'lse', 'weights',
        'heads', 'concat', 'output'} and the variants' stages the call used
        (see the module doc) -> plain NumPy arrays (a list of per-head arrays
        for a ragged stage), in computing order.  The arrays are the trace's
        own.

        Returns
        -------
        dict
            Stage name -> its array (or list of per-head arrays), keyed as
            :meth:`keys` lists them.

        Examples
        --------
        >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
        >>> t = mhattn.trace(X, w_q, w_k, w_v, w_o)
        >>> d = t.to_dict()
        >>> list(d)[:4], d["weights"] is t.weights
        (['q', 'k', 'v', 'raw_scores'], True)
        """
        return {k: getattr(self, k) for k in self.keys()}

    def __getitem__(self, name: str) -> PerHead:
        key = canonical_key(name)
        if key is None or key not in self.keys():
            raise KeyError(f"{name!r}: this Trace holds {', '.join(self.keys())}")
        return getattr(self, key)

    def keys(self):
        """The stages this trace holds, in computing order.

        Returns
        -------
        tuple of str
            The names of :meth:`to_dict`, the variants' stages included.

        Examples
        --------
        >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
        >>> mhattn.trace(X, w_q, w_k, w_v, w_o).keys()
        ('q', 'k', 'v', 'raw_scores', 'scores', 'row_max', 'lse', 'weights', 'heads', 'concat', 'output')
        >>> mhattn.trace(X, w_q, w_k, w_v, w_o, softcap=5.0).keys()[3:6]
        ('raw_scores', 'capped', 'scores')
        """
        return tuple(k for k in _ORDER if k in KEYS or k in self.variant_stages)

    @property
    def ragged(self) -> bool:
        """True when some per-head stage is a list (head widths differ).

        Examples
        --------
        >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
        >>> mhattn.trace(X, w_q, w_k, w_v, w_o).ragged
        False
        >>> w = [np.ones((4, 2)), np.ones((4, 3))]          # heads of widths 2 and 3
        >>> mhattn.trace(X, w, w, w).ragged
        True
        """
        return any(isinstance(getattr(self, k), list) for k in _PER_HEAD)

    def head(self, i: int, b: Optional[int] = None) -> Dict[str, np.ndarray]:
        """head(i, b=None) -> dict: head i's steps, keyed like
        :func:`mhattn.reference.head_intermediates` (q, k, v, raw_scores,
        scores, weights, head) plus row_max and lse.  ``b`` picks a batch
        item of a batched trace (required there).

        Parameters
        ----------
        i : int
            The query head; negative counts from the last.
        b : int, optional
            The batch item of a batched trace (required there; None or 0
            for an unbatched one).

        Returns
        -------
        dict
            Step name -> head i's array of that step.

        Examples
        --------
        >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
        >>> t = mhattn.trace(X, w_q, w_k, w_v, w_o)
        >>> sorted(t.head(0))
        ['head', 'k', 'lse', 'q', 'raw_scores', 'row_max', 'scores', 'v', 'weights']
        >>> t.head(0)["weights"][2].round(4)          # query "it"
        array([0.7337, 0.0879, 0.1784])
        """
        H = self.num_heads
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, numbers.Integral):
            raise TypeError(f"head: expected a head index (an integer), got "
                            f"{i!r:.80} ({type(i).__name__})")
        i = int(i)
        if not -H <= i < H:
            raise IndexError(f"head: head {i} out of range for {H} heads")
        i %= H
        if b is not None:
            if isinstance(b, (bool, np.bool_)) or not isinstance(b, numbers.Integral):
                raise TypeError(f"b: expected a batch index (an integer) or None, got "
                                f"{b!r:.80} ({type(b).__name__})")
            b = int(b)
        if self.batched and b is None:
            raise ValueError("b: head(): this trace is batched; pass b=")
        if not self.batched and b not in (None, 0):
            raise ValueError("b: head(): this trace is unbatched; b must be None")
        if self.batched:
            nb = self.weights[0].shape[0] if isinstance(self.weights, list) \
                else self.weights.shape[0]
            if not -nb <= b < nb:
                raise IndexError(f"b: batch item {b} out of range for {nb} batch items")
            b %= nb

        def pick(name: str) -> np.ndarray:
            a = getattr(self, name)
            if isinstance(a, list):
                a = a[i]
                return a[b] if self.batched else a
            return a[b, i] if self.batched else a[i]

        out = {k: pick(k) for k in ("q", "k", "v", "raw_scores", "scores", "weights")}
        out["head"] = pick("heads")
        out["row_max"] = pick("row_max")
        out["lse"] = pick("lse")
        return out

    def shape_of(self, name: str) -> str:
        """A stage's shape as text; ragged stages read '[h x (T, d_i)]'.

        Parameters
        ----------
        name : str
            A stage this trace holds, or an alias :meth:`compare` takes.

        Returns
        -------
        str
            The shape, as ``str(array.shape)``, or the list of the per-head
            shapes.

        Examples
        --------
        >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
        >>> mhattn.trace(X, w_q, w_k, w_v, w_o).shape_of("attention_probs")
        '(2, 3, 3)'
        >>> w = [np.ones((4, 2)), np.ones((4, 3))]
        >>> mhattn.trace(X, w, w, w).shape_of("q")
        '[(3, 2), (3, 3)]'
        """
        if not isinstance(name, str):
            raise TypeError(f"name: expected a stage name (str), got {name!r:.80} "
                            f"({type(name).__name__})")
        key = canonical_key(name)
        if key is None or key not in self.keys():
            raise ValueError(f"name: {name!r:.80} is not a stage of this Trace, which "
                             f"holds {', '.join(self.keys())}")
        a = getattr(self, key)
        if isinstance(a, list):
            return "[" + ", ".join(str(p.shape) for p in a) + "]"
        return str(a.shape)

    # --------------------------------------------------------------- compare
    def compare(self, other: Union["Trace", Mapping[str, Any]], *,
                rtol: Optional[float] = None, atol: Optional[float] = None
                ) -> "CompareReport":
        """compare(other, *, rtol=None, atol=None) -> CompareReport

        Stage by stage (q, k, v, raw_scores, scores, weights, heads, concat,
        output), the maximum absolute and relative error of ``other`` against
        this trace, and the first stage where they diverge.

        Parameters
        ----------
        other : Trace or dict of arrays
            A Trace or a dict of arrays (keys as in :meth:`to_dict`,
            case-insensitive, or these common aliases:

            - output: out, y, result, attn_output, attn_out, attention_output
            - q, k, v: query, queries, key, keys, value, values
            - raw_scores: raw, qk, qkt, dots, raw_attention_scores, unscaled_scores
            - scores: logits, scaled_scores, scores_scaled, scaled,
              attention_scores, attn_scores
            - weights: attn, attention, attn_weights, attention_weights, probs,
              attention_probs, attn_probs, softmax, probabilities
            - heads: head, head_outputs, head_outs
            - concat: z, concatenated, concat_heads, heads_concat, merged,
              context, context_layer

            ); stages missing from a dict are skipped.  Every key it did not
            use (unknown, a second name for a stage already given, or a stage
            that is not compared such as 'row_max') is listed in the report's
            ``unused`` and in its summary.  A per-head stage of a dict may
            also be given fused, (T, h*d) — the layout of ``X @ w_q`` — or as
            a list of per-head arrays.
        rtol, atol : float >= 0, optional
            A stage diverges when some element fails
            abs(a - b) <= atol + rtol*abs(b) (b = this trace; -inf matches
            -inf).  The defaults follow the lower precision of the two:
            rtol 1e-7, atol 1e-9 for float64; rtol 1e-4, atol 1e-5 for
            float32.

        Returns
        -------
        CompareReport
            A :class:`~mhattn.learn.trace.StageDiff` per stage, the first
            divergence, the tolerances used and the unused keys.

        Examples
        --------
        >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
        >>> t = mhattn.trace(X, w_q, w_k, w_v, w_o)
        >>> report = t.compare({"out": t.output, "attn": t.weights + 1e-3,
        ...                     "row_max": t.row_max})
        >>> report.first_divergence, report.unused
        ('weights', ['row_max'])
        >>> print(report.summary())
        First divergence at 'weights' (max abs error 0.001, max rel error 0.59). Not used
        (unknown, repeated or not compared): 'row_max'.
        """
        rtol = _tol("rtol", rtol)
        atol = _tol("atol", atol)
        unused: List[str] = []
        if isinstance(other, Trace):
            theirs = other.to_dict()
        elif isinstance(other, Mapping):
            theirs = {}
            for name, val in other.items():
                key = canonical_key(name)
                if key in STAGES and key not in theirs:
                    theirs[key] = val
                else:
                    unused.append(str(name))
        else:
            raise TypeError(f"compare: expected a Trace or a dict of arrays, got "
                            f"{type(other).__name__}")
        dtypes = [self.dtype]
        for val in theirs.values():
            for part in (val if isinstance(val, (list, tuple)) else [val]):
                dt = getattr(part, "dtype", None)
                if dt is not None and dt.kind == "f":
                    dtypes.append(dt)
        low32 = min(dt.itemsize for dt in dtypes) <= 4
        if rtol is None:
            rtol = 1e-4 if low32 else 1e-7
        if atol is None:
            atol = 1e-5 if low32 else 1e-9

        rows = []
        for stage in STAGES:
            mine = getattr(self, stage)
            if stage not in theirs or theirs[stage] is None:
                rows.append(StageDiff(stage, self.shape_of(stage), None, None, None,
                                      None, "not given"))
                continue
            rows.append(self._diff(stage, mine, theirs[stage], rtol, atol))
        return CompareReport(rows, rtol=rtol, atol=atol, unused=unused)

    def _coerce(self, stage: str, mine: PerHead, theirs: Any) -> Optional[PerHead]:
        """Bring another layout of a stage to this trace's; None if impossible."""
        H = self.num_heads
        if isinstance(theirs, (list, tuple)) and not isinstance(mine, list):
            try:
                parts = [np.asarray(p) for p in theirs]
                # Every layout below holds mine.size numbers: others (a
                # broadcast view of 10^12, say) are not stacked or copied.
                if sum(p.size for p in parts) != mine.size:
                    return None
                if len(parts) == H and len({p.shape for p in parts}) == 1:
                    theirs = np.stack(parts, axis=1 if self.batched else 0)
                else:
                    theirs = np.asarray(theirs)
            except (ValueError, TypeError):
                return None
        if isinstance(mine, list):
            if isinstance(theirs, (list, tuple)):
                parts = [np.asarray(p) for p in theirs]
                return parts if len(parts) == H else None
            a = np.asarray(theirs)
            widths = [p.shape[-1] for p in mine]
            if a.ndim >= 1 and a.shape[-1] == sum(widths):  # fused columns
                offs = np.cumsum([0] + widths)
                return [a[..., offs[i]:offs[i + 1]] for i in range(H)]
            return None
        a = np.asarray(theirs)
        if a.dtype.kind not in "biuf":
            return None
        if a.shape == mine.shape:
            return a
        if stage in _PER_HEAD and a.ndim == mine.ndim - 1:
            # fused (..., T, h*d) -> (..., h, T, d)
            *lead, T, width = a.shape
            d = mine.shape[-1]
            if width == H * d and T == mine.shape[-2]:
                a = a.reshape(*lead, T, H, d)
                return np.moveaxis(a, -2, -3)
        if a.size == mine.size and a.shape == tuple(s for s in mine.shape if s != 1):
            return a.reshape(mine.shape)  # e.g. a single head without its axis
        if self.batched and mine.shape[0] == 1 and a.shape == mine.shape[1:]:
            return a[np.newaxis]
        return None

    def _diff(self, stage: str, mine: PerHead, theirs: Any, rtol: float,
              atol: float) -> "StageDiff":
        coerced = self._coerce(stage, mine, theirs)
        their_shape = _shape_text(theirs)
        if coerced is None:
            return StageDiff(stage, self.shape_of(stage), their_shape, np.inf, np.inf,
                             False, "shapes differ")
        pairs: List[Tuple[np.ndarray, np.ndarray]] = (
            list(zip(mine, coerced)) if isinstance(mine, list)
            else [(mine, np.asarray(coerced))])
        max_abs, max_rel, ok = 0.0, 0.0, True
        for ref, got in pairs:
            if ref.shape != got.shape:
                return StageDiff(stage, self.shape_of(stage), their_shape, np.inf,
                                 np.inf, False, "shapes differ")
            a, r, good = _errors(np.asarray(got, dtype=np.float64),
                                 np.asarray(ref, dtype=np.float64), rtol, atol)
            max_abs, max_rel, ok = max(max_abs, a), max(max_rel, r), ok and good
        return StageDiff(stage, self.shape_of(stage), their_shape, max_abs, max_rel, ok,
                         "" if ok else "differs")

    # --------------------------------------------------------------- display
    def __repr__(self) -> str:
        parts = ", ".join(f"{k} {self.shape_of(k)}" for k in self.keys())
        return f"<mhattn.Trace {self._config_text()}: {parts}>"

    def _config_text(self) -> str:
        tq = self.weights.shape[-2]
        tk = self.weights.shape[-1]
        bits = []
        if self.batched:
            bits.append(f"B={self.weights.shape[0]}")
        bits.append(f"h={self.num_heads}")
        if self.num_kv_heads != self.num_heads:
            bits.append(f"kv heads={self.num_kv_heads}")
        bits += [f"T_q={tq}", f"T_k={tk}", "d_k=" + _widths(self.d_k),
                 "d_v=" + _widths(self.d_v), str(self.dtype)]
        if self.causal:
            bits.append("causal")
        if self.masked:
            bits.append("masked")
        return ", ".join(bits)

    def _small(self) -> bool:
        tq, tk = self.weights.shape[-2:]
        return (self.num_heads <= 4 and tq <= 8 and tk <= 8
                and max(self.d_k + self.d_v) <= 8 and self.output.shape[-1] <= 16
                and self.concat.shape[-1] <= 16)

    def _repr_html_(self) -> str:
        from .html import trace_html
        return trace_html(self)


def _widths(ws: Sequence[int]) -> str:
    return str(ws[0]) if len(set(ws)) == 1 else "(" + ", ".join(map(str, ws)) + ")"


def _shape_text(x: Any) -> str:
    if isinstance(x, (list, tuple)):
        try:
            return "[" + ", ".join(str(np.shape(p)) for p in x) + "]"
        except Exception:
            return type(x).__name__
    try:
        return str(np.shape(x))
    except Exception:
        return type(x).__name__


def _errors(got: np.ndarray, ref: np.ndarray, rtol: float, atol: float):
    """(max abs error, max relative error, all close) as numpy.testing does it.

    Entries that are equal (including -inf == -inf and nan == nan) count as
    exact; any other non-finite mismatch is an infinite error.
    """
    if got.size == 0:
        return 0.0, 0.0, True
    same = (got == ref) | (np.isnan(got) & np.isnan(ref))
    close = np.isclose(got, ref, rtol=rtol, atol=atol, equal_nan=True)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        diff = np.where(same, 0.0, np.abs(got - ref))
        diff = np.where(np.isnan(diff), np.inf, diff)
        rel = np.where(same, 0.0, diff / np.abs(ref))
        rel = np.where(np.isnan(rel), np.inf, rel)
    return float(diff.max()), float(rel.max()), bool(close.all())


@dataclass
class StageDiff:
    """One stage of a comparison: shapes, max abs / rel error, and whether
    it agrees (None when the other side did not give this stage).

    Parameters
    ----------
    stage : str
        The stage's name, one of those :meth:`mhattn.Trace.compare` checks.
    shape : str
        Its shape in the trace, as :meth:`mhattn.Trace.shape_of` gives it.
    other_shape : str or None
        The other side's shape; None when it did not give this stage.
    max_abs, max_rel : float or None
        The largest absolute and relative errors (inf when the shapes
        differ); None when the other side did not give this stage.
    ok : bool or None
        Whether the stage agrees within the tolerances; None when the other
        side did not give it.
    note : str, default ""
        "not given", "shapes differ", "differs", or "" when it agrees.

    Examples
    --------
    >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    >>> t = mhattn.trace(X, w_q, w_k, w_v, w_o)
    >>> t.compare({"output": t.output})["output"]
    StageDiff(stage='output', shape='(3, 4)', other_shape='(3, 4)', max_abs=0.0,
              max_rel=0.0, ok=True, note='')
    """
    stage: str
    shape: str
    other_shape: Optional[str]
    max_abs: Optional[float]
    max_rel: Optional[float]
    ok: Optional[bool]
    note: str = ""


class CompareReport:
    """The result of :meth:`mhattn.Trace.compare`.

    ``stages`` lists a :class:`StageDiff` per stage; ``first_divergence`` is
    the name of the first stage that differs (None if none does); ``ok`` is
    True when every stage given agrees; ``unused`` lists the keys of a
    compared dict that were not used (also named by ``summary()``).
    ``str()`` is a plain-text table and ``_repr_html_`` an HTML one.

    Parameters
    ----------
    stages : list of StageDiff
        One per stage, in the order they are computed.
    rtol, atol : float
        The tolerances the stages were compared with.
    unused : sequence of str, default ()
        The keys of the other side that :meth:`~mhattn.Trace.compare` did
        not use.

    Examples
    --------
    >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    >>> t = mhattn.trace(X, w_q, w_k, w_v, w_o)
    >>> report = t.compare({"weights": t.weights, "output": t.output})
    >>> report.ok, report.first_divergence, report["output"].max_abs
    (True, None, 0.0)
    >>> print(report)
    All 2 stages compared agree (rtol=1e-07, atol=1e-09).
    <BLANKLINE>
      stage       shape             max abs err  max rel err  status
      q           (2, 3, 2)                                   not given
      k           (2, 3, 2)                                   not given
      v           (2, 3, 2)                                   not given
      raw_scores  (2, 3, 3)                                   not given
      scores      (2, 3, 3)                                   not given
      weights     (2, 3, 3)                   0            0  ok
      heads       (2, 3, 2)                                   not given
      concat      (3, 4)                                      not given
      output      (3, 4)                      0            0  ok
    """

    def __init__(self, stages: List[StageDiff], *, rtol: float, atol: float,
                 unused: Sequence[str] = ()):
        self.stages = stages
        self.rtol = rtol
        self.atol = atol
        #: the keys of the other side that compare did not use
        self.unused = list(unused)
        self.first_divergence = next((s.stage for s in stages if s.ok is False), None)

    @property
    def ok(self) -> bool:
        return self.first_divergence is None

    def __getitem__(self, stage: str) -> StageDiff:
        for s in self.stages:
            if s.stage == stage:
                return s
        raise KeyError(stage)

    def summary(self) -> str:
        """The report in a sentence or two: the first stage that diverges and
        by how much (and the later ones that differ too), or that every
        compared stage agrees; then a compared dict's unused keys.

        Returns
        -------
        str
            The first line of ``str(report)``.

        Examples
        --------
        >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
        >>> t = mhattn.trace(X, w_q, w_k, w_v, w_o)
        >>> t.compare(t).summary()
        'All 9 stages compared agree (rtol=1e-07, atol=1e-09).'
        """
        text = self._summary()
        if self.unused:
            text += (" Not used (unknown, repeated or not compared): "
                     + ", ".join(repr(k) for k in self.unused) + ".")
        return text

    def _summary(self) -> str:
        compared = [s for s in self.stages if s.ok is not None]
        if not compared:
            return "No stage in common to compare."
        if self.ok:
            return (f"All {len(compared)} stages compared agree "
                    f"(rtol={self.rtol:g}, atol={self.atol:g}).")
        s = self[str(self.first_divergence)]
        later = [t.stage for t in self.stages
                 if t.ok is False and t.stage != s.stage]
        why = ("shapes differ: expected " + s.shape + ", got " + str(s.other_shape)
               if s.note == "shapes differ" else
               f"max abs error {_num(s.max_abs)}, max rel error {_num(s.max_rel)}")
        text = f"First divergence at '{s.stage}' ({why})."
        if later:
            text += " Later stages that differ too: " + ", ".join(later) + "."
        return text

    def __str__(self) -> str:
        lines = [self.summary(), "",
                 f"  {'stage':<11} {'shape':<16} {'max abs err':>12} {'max rel err':>12}  status"]
        for s in self.stages:
            if s.ok is None:
                status, a, r = "not given", "", ""
            else:
                status = "ok" if s.ok else ("DIFFERS" if s.note != "shapes differ"
                                            else f"SHAPE {s.other_shape}")
                a, r = _num(s.max_abs), _num(s.max_rel)
            mark = " <- first" if s.stage == self.first_divergence else ""
            lines.append(f"  {s.stage:<11} {s.shape:<16} {a:>12} {r:>12}  {status}{mark}")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        from .html import compare_html
        return compare_html(self)


