"""mhattn.check_prototype: check your own multi-head attention against mhattn.

A learner's prototype ``fn(x, w_q, w_k, w_v, w_o, num_heads)`` (fused 2-D
weights, as in the README) is run on a set of configurations chosen so that
the common mistakes show: the document's worked example, d_k != d_v, more
than two heads, T_q >= 3, a non-square and a square W^O, square fused
projections, and inputs large enough that a softmax without the max
subtraction overflows.  Its outputs are compared with
:func:`mhattn.multi_head_attention`.

When they differ, each known mistake is re-enacted by a small NumPy function
below (one per way of writing it), run on the same trials, and the mistake
whose outputs match the prototype's on every trial (or, failing that, on the
most trials) is named, with an explanation of the fix.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ._api import multi_head_attention
from ._args import check_memory
from .reference import worked_example
from .trace import CompareReport, canonical_key, trace

__all__ = ["check_prototype", "PrototypeReport", "TrialResult", "MISTAKES"]


# --------------------------------------------------------------------------
# The document's computation, and each known mistake, in plain NumPy.
# Every function takes the prototype's arguments (fused 2-D weights).
# --------------------------------------------------------------------------

def _cols(w: np.ndarray, h: int) -> List[np.ndarray]:
    """Head i owns columns [i*d, (i+1)*d) of a fused weight."""
    d = w.shape[1] // h
    return [w[:, i * d:(i + 1) * d] for i in range(h)]


def _softmax(s: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(s - s.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _naive_softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s)
    return e / e.sum(axis=-1, keepdims=True)


def _sqrt_dk(d_k: int, d_model: int) -> float:
    return 1.0 / np.sqrt(d_k)


def _heads(x, w_q, w_k, w_v, h, scale=_sqrt_dk, softmax=_softmax) -> List[np.ndarray]:
    """head_i = softmax(Q_i K_i^T * scale) V_i for every head i."""
    out = []
    for wq, wk, wv in zip(_cols(w_q, h), _cols(w_k, h), _cols(w_v, h)):
        q, k, v = x @ wq, x @ wk, x @ wv
        s = (q @ k.T) * x.dtype.type(scale(wq.shape[1], x.shape[1]))
        out.append(softmax(s) @ v)
    return out


def _correct(x, w_q, w_k, w_v, w_o, h):
    return np.concatenate(_heads(x, w_q, w_k, w_v, h), axis=-1) @ w_o


def _no_scaling(x, w_q, w_k, w_v, w_o, h):
    heads = _heads(x, w_q, w_k, w_v, h, scale=lambda dk, dm: 1.0)
    return np.concatenate(heads, axis=-1) @ w_o


def _scale_by_dk(x, w_q, w_k, w_v, w_o, h):
    heads = _heads(x, w_q, w_k, w_v, h, scale=lambda dk, dm: 1.0 / dk)
    return np.concatenate(heads, axis=-1) @ w_o


def _scale_by_sqrt_dmodel(x, w_q, w_k, w_v, w_o, h):
    heads = _heads(x, w_q, w_k, w_v, h, scale=lambda dk, dm: 1.0 / np.sqrt(dm))
    return np.concatenate(heads, axis=-1) @ w_o


def _softmax_wrong_axis(x, w_q, w_k, w_v, w_o, h):
    heads = _heads(x, w_q, w_k, w_v, h, softmax=lambda s: _softmax(s, axis=0))
    return np.concatenate(heads, axis=-1) @ w_o


def _heads_averaged(x, w_q, w_k, w_v, w_o, h):
    return np.mean(_heads(x, w_q, w_k, w_v, h), axis=0)


def _heads_averaged_projected(x, w_q, w_k, w_v, w_o, h):
    # each head's answer through its own block of W^O, then the average
    heads = _heads(x, w_q, w_k, w_v, h)
    d_v = heads[0].shape[1]
    return sum(hd @ w_o[i * d_v:(i + 1) * d_v] for i, hd in enumerate(heads)) / h


def _heads_averaged_first_rows(x, w_q, w_k, w_v, w_o, h):
    heads = _heads(x, w_q, w_k, w_v, h)
    return np.mean(heads, axis=0) @ w_o[:heads[0].shape[1]]


def _heads_summed(x, w_q, w_k, w_v, w_o, h):
    return np.sum(_heads(x, w_q, w_k, w_v, h), axis=0)


def _heads_summed_first_rows(x, w_q, w_k, w_v, w_o, h):
    heads = _heads(x, w_q, w_k, w_v, h)
    return np.sum(heads, axis=0) @ w_o[:heads[0].shape[1]]


def _wo_skipped(x, w_q, w_k, w_v, w_o, h):
    return np.concatenate(_heads(x, w_q, w_k, w_v, h), axis=-1)


def _wo_transposed(x, w_q, w_k, w_v, w_o, h):
    return np.concatenate(_heads(x, w_q, w_k, w_v, h), axis=-1) @ w_o.T


def _projections_transposed(x, w_q, w_k, w_v, w_o, h):
    Q, K, V = x @ w_q.T, x @ w_k.T, x @ w_v.T
    d_k, d_v = w_q.shape[1] // h, w_v.shape[1] // h
    heads = []
    for i in range(h):
        q, k = Q[:, i * d_k:(i + 1) * d_k], K[:, i * d_k:(i + 1) * d_k]
        v = V[:, i * d_v:(i + 1) * d_v]
        heads.append(_softmax((q @ k.T) / x.dtype.type(np.sqrt(d_k))) @ v)
    return np.concatenate(heads, axis=-1) @ w_o


def _no_max_subtraction(x, w_q, w_k, w_v, w_o, h):
    heads = _heads(x, w_q, w_k, w_v, h, softmax=_naive_softmax)
    return np.concatenate(heads, axis=-1) @ w_o


def _heads_split_sequence(x, w_q, w_k, w_v, w_o, h):
    # np.split along the rows (tokens): head i sees tokens [i*T/h, (i+1)*T/h)
    Q, K, V = x @ w_q, x @ w_k, x @ w_v
    d_k = w_q.shape[1] // h
    outs = [_softmax((q @ k.T) / x.dtype.type(np.sqrt(d_k))) @ v
            for q, k, v in zip(np.split(Q, h, axis=0), np.split(K, h, axis=0),
                               np.split(V, h, axis=0))]
    return np.concatenate(outs, axis=0) @ w_o


def _heads_split_sequence_reshape(x, w_q, w_k, w_v, w_o, h):
    # reshape (T, h*d) straight to (h, T, d): the rows get dealt out to heads
    T = x.shape[0]
    d_k, d_v = w_q.shape[1] // h, w_v.shape[1] // h
    Q = (x @ w_q).reshape(h, T, d_k)
    K = (x @ w_k).reshape(h, T, d_k)
    V = (x @ w_v).reshape(h, T, d_v)
    out = _softmax(Q @ K.transpose(0, 2, 1) / x.dtype.type(np.sqrt(d_k))) @ V
    return out.reshape(T, h * d_v) @ w_o


def _same_projection_every_head(x, w_q, w_k, w_v, w_o, h):
    d_k, d_v = w_q.shape[1] // h, w_v.shape[1] // h
    q, k, v = x @ w_q[:, :d_k], x @ w_k[:, :d_k], x @ w_v[:, :d_v]
    head = _softmax((q @ k.T) / x.dtype.type(np.sqrt(d_k))) @ v
    return np.concatenate([head] * h, axis=-1) @ w_o


# (mistake, how it was written, function); several ways of writing one mistake.
VARIANTS: List[Tuple[str, str, Callable]] = [
    ("no_scaling", "softmax(Q K^T) V", _no_scaling),
    ("scale_by_dk", "softmax(Q K^T / d_k) V", _scale_by_dk),
    ("scale_by_sqrt_dmodel", "softmax(Q K^T / sqrt(d_model)) V", _scale_by_sqrt_dmodel),
    ("softmax_wrong_axis", "softmax over axis 0 (the queries)", _softmax_wrong_axis),
    ("heads_averaged", "mean of the heads, no W^O", _heads_averaged),
    ("heads_averaged", "mean over heads of head_i W^O_i", _heads_averaged_projected),
    ("heads_averaged", "mean of the heads times the first d_v rows of W^O",
     _heads_averaged_first_rows),
    ("heads_summed", "sum of the heads, no W^O", _heads_summed),
    ("heads_summed", "sum of the heads times the first d_v rows of W^O",
     _heads_summed_first_rows),
    ("wo_skipped", "Concat(heads) without W^O", _wo_skipped),
    ("wo_transposed", "Concat(heads) @ W^O.T", _wo_transposed),
    ("projections_transposed", "Q = X @ W^Q.T", _projections_transposed),
    ("no_max_subtraction", "exp(scores) without subtracting the row max",
     _no_max_subtraction),
    ("heads_split_sequence", "np.split(Q, h, axis=0)", _heads_split_sequence),
    ("heads_split_sequence", "Q.reshape(h, T, d_k)", _heads_split_sequence_reshape),
    ("same_projection_every_head", "head 0's columns for every head",
     _same_projection_every_head),
]

_CODE_FIX = """\
    d_k = w_q.shape[1] // num_heads          # one head's width
    d_v = w_v.shape[1] // num_heads
    heads = []
    for i in range(num_heads):
        q = x @ w_q[:, i*d_k:(i+1)*d_k]      # Q_i = X W_i^Q
        k = x @ w_k[:, i*d_k:(i+1)*d_k]      # K_i = X W_i^K
        v = x @ w_v[:, i*d_v:(i+1)*d_v]      # V_i = X W_i^V
        scores = q @ k.T / np.sqrt(d_k)      # (T, T)
        w = np.exp(scores - scores.max(axis=-1, keepdims=True))
        w = w / w.sum(axis=-1, keepdims=True)
        heads.append(w @ v)                  # head_i, (T, d_v)
    return np.concatenate(heads, axis=-1) @ w_o   # Concat(head_1..head_h) W^O"""

#: mistake id -> (short title, explanation that teaches the fix).
MISTAKES: Dict[str, Tuple[str, str]] = {
    "no_scaling": (
        "the scores are not divided by sqrt(d_k)",
        "Your prototype computes softmax(Q K^T) V. The document's attention is\n"
        "Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V. A dot product over d_k\n"
        "terms has variance proportional to d_k, so without the division the\n"
        "softmax saturates towards one-hot as d_k grows. Divide inside each head:\n"
        "    scores = q @ k.T / np.sqrt(d_k)   # d_k = w_q.shape[1] // num_heads"),
    "scale_by_dk": (
        "the scores are divided by d_k instead of sqrt(d_k)",
        "Your prototype divides Q K^T by d_k. The document divides by its square\n"
        "root: softmax(Q K^T / sqrt(d_k)) V. Scaling by sqrt(d_k) brings the\n"
        "variance of a d_k-term dot product back to about 1; dividing by d_k\n"
        "over-flattens the weights. Fix:\n"
        "    scores = q @ k.T / np.sqrt(d_k)"),
    "scale_by_sqrt_dmodel": (
        "the scores are divided by sqrt(d_model) instead of sqrt(d_k)",
        "Your prototype divides Q K^T by sqrt(d_model), the embedding width. The\n"
        "scale belongs to each head and uses that head's own width d_k = d_model / h\n"
        "(the document's active recall 5: scaling happens inside each head, with\n"
        "that head's d_k). Fix:\n"
        "    d_k = w_q.shape[1] // num_heads\n"
        "    scores = q @ k.T / np.sqrt(d_k)"),
    "softmax_wrong_axis": (
        "the softmax normalises over the queries instead of the keys",
        "Your softmax runs down the columns (axis 0) of the T_q x T_k score matrix.\n"
        "Each query's row must be a probability distribution over all the keys, as\n"
        "in the worked example, where Head 1's weights for 'it' over (ball, full, it)\n"
        "are [0.7337, 0.0879, 0.1784] and sum to 1. Take the max, exp and sum\n"
        "along the last axis:\n"
        "    w = np.exp(scores - scores.max(axis=-1, keepdims=True))\n"
        "    w = w / w.sum(axis=-1, keepdims=True)    # w.sum(axis=-1) == 1"),
    "heads_averaged": (
        "the heads are averaged instead of concatenated",
        "Your prototype averages the heads' outputs. The document concatenates them\n"
        "and then applies one learned W^O:\n"
        "    MultiHead(X) = Concat(head_1, ..., head_h) W^O\n"
        "Averaging gives every head the fixed weight 1/h and blends the specialists\n"
        "before W^O can combine them (this is the classmate's mistake in active\n"
        "recall 6). Concatenate along the features, then project:\n"
        "    z = np.concatenate(heads, axis=-1)      # (T, h*d_v)\n"
        "    return z @ w_o"),
    "heads_summed": (
        "the heads are summed instead of concatenated",
        "Your prototype adds the heads' outputs together. The document concatenates\n"
        "them side by side and lets one learned W^O mix them:\n"
        "    MultiHead(X) = Concat(head_1, ..., head_h) W^O\n"
        "A sum squeezes h subspaces into one d_v-wide vector, so the output can no\n"
        "longer say which head noticed what. Fix:\n"
        "    z = np.concatenate(heads, axis=-1)      # (T, h*d_v)\n"
        "    return z @ w_o"),
    "wo_skipped": (
        "W^O is never applied",
        "Your prototype returns Concat(head_1, ..., head_h) itself. The worked\n"
        "example takes W^O = identity for simplicity, which hides this; in general\n"
        "MultiHead(X) = Concat(head_1, ..., head_h) W^O, and W^O is the producer\n"
        "that blends the heads' reports. Fix:\n"
        "    return np.concatenate(heads, axis=-1) @ w_o"),
    "wo_transposed": (
        "W^O is applied transposed",
        "Your prototype multiplies the concatenation by W^O transposed. mhattn and\n"
        "the document use row vectors (Q = X W^Q), so W^O has shape (h*d_v) x d_out\n"
        "and multiplies from the right as it is. This only ran because W^O was\n"
        "square; with a non-square W^O it fails on shapes. Fix:\n"
        "    return concat @ w_o       # not concat @ w_o.T"),
    "projections_transposed": (
        "the projections are applied transposed",
        "Your prototype projects with the transposed weights (X W^T, the layout of\n"
        "PyTorch's nn.Linear.weight). The document uses row vectors: Q = X W^Q with\n"
        "W^Q of shape d_model x d_k (fused: d_model x h*d_k), and likewise for K, V.\n"
        "It only ran where the fused weights were square (d_model == h*d_k). Fix:\n"
        "    Q = x @ w_q;  K = x @ w_k;  V = x @ w_v"),
    "no_max_subtraction": (
        "the softmax does not subtract the row maximum, so large scores overflow",
        "Your softmax computes exp(scores) directly. With large inputs a score\n"
        "above about 709 (float64) or 88 (float32) overflows exp to inf, and the\n"
        "weights become inf/inf = nan, although the true answer is finite. The\n"
        "document's code subtracts the maximum first, which leaves the softmax\n"
        "unchanged (a constant shift cancels in the ratio):\n"
        "    w = np.exp(scores - scores.max(axis=-1, keepdims=True))\n"
        "    w = w / w.sum(axis=-1, keepdims=True)"),
    "heads_split_sequence": (
        "the heads are split along the sequence instead of the features",
        "Your prototype gives each head a share of the tokens (rows). Heads split\n"
        "the representation dimension, not the sequence: every head computes a\n"
        "full T x T attention over all the tokens (the document's 'common\n"
        "misconception' section). Head i owns columns [i*d_k, (i+1)*d_k) of X W^Q.\n"
        "Fix (either form):\n"
        "    q_i = Q[:, i*d_k:(i+1)*d_k]\n"
        "    Qh = Q.reshape(T, h, d_k).transpose(1, 0, 2)   # (h, T, d_k)\n"
        "not np.split(Q, h, axis=0) or Q.reshape(h, T, d_k)."),
    "same_projection_every_head": (
        "every head uses head 0's projection",
        "Every head in your prototype uses the first block of columns of w_q, w_k\n"
        "and w_v, so all heads compute the same thing and h heads collapse into\n"
        "one. In the document, head_i = Attention(X W_i^Q, X W_i^K, X W_i^V) uses\n"
        "head i's own matrices (active recall 6). Slice by the head index:\n"
        "    q = x @ w_q[:, i*d_k:(i+1)*d_k]   # and likewise k, v with i"),
}


# --------------------------------------------------------------------------
# Trials
# --------------------------------------------------------------------------

@dataclass
class _Trial:
    name: str
    about: str
    x: np.ndarray
    w_q: np.ndarray
    w_k: np.ndarray
    w_v: np.ndarray
    w_o: np.ndarray
    num_heads: int
    large: bool = False

    @property
    def args(self):
        return (self.x, self.w_q, self.w_k, self.w_v, self.w_o, self.num_heads)

    @property
    def dims(self) -> Dict[str, int]:
        h = self.num_heads
        return dict(T=self.x.shape[0], d_model=self.x.shape[1], h=h,
                    d_k=self.w_q.shape[1] // h, d_v=self.w_v.shape[1] // h,
                    d_out=self.w_o.shape[1])

    def shapes(self) -> str:
        d = self.dims
        return (f"T={d['T']}, d_model={d['d_model']}, h={d['h']}, d_k={d['d_k']}, "
                f"d_v={d['d_v']}, d_out={d['d_out']}")

    def features(self) -> Dict[str, bool]:
        d = self.dims
        return {
            "d_k != d_v": d["d_k"] != d["d_v"],
            "more than two heads": d["h"] > 2,
            "a non-square W^O": d["h"] * d["d_v"] != d["d_out"],
            "d_model != h*d_k": d["d_model"] != d["h"] * d["d_k"],
            "large inputs": self.large,
            "T not a multiple of h": d["T"] % d["h"] != 0,
        }


def _random_trial(rng, name, about, T, d_model, h, d_k, d_v, d_out, dtype) -> _Trial:
    # Weights of about unit gain, times 1.5 so that the softmax is neither
    # flat nor one-hot: the variants then give clearly different outputs.
    def w(rows, cols):
        return rng.standard_normal((rows, cols)) * (1.5 / np.sqrt(rows))
    x = rng.standard_normal((T, d_model))
    return _Trial(name, about, x.astype(dtype), w(d_model, h * d_k).astype(dtype),
                  w(d_model, h * d_k).astype(dtype), w(d_model, h * d_v).astype(dtype),
                  w(h * d_v, d_out).astype(dtype), num_heads=h)


def _worked_example_trial(dtype) -> _Trial:
    _, X, w_q, w_k, w_v, w_o = worked_example()
    def fused(w):
        return np.concatenate(w, axis=1).astype(dtype)
    return _Trial("worked_example",
                  "the document's worked example (ball, full, it; W^O = I)",
                  X.astype(dtype), fused(w_q), fused(w_k), fused(w_v),
                  np.asarray(w_o).astype(dtype), num_heads=2)


def _large_trial(rng, dtype) -> _Trial:
    """Scores far beyond exp's range: the answer is finite, naive exp is not."""
    t = _random_trial(rng, "large_inputs", "", 4, 6, 2, 3, 3, 6, dtype)
    # float64's limit (~709.8) even for float32 trials: a float32 prototype
    # often computes in float64 without knowing it (x / np.sqrt(d_k) promotes
    # under NumPy 2), and must overflow too.
    limit = float(np.log(np.finfo(np.float64).max))
    with np.errstate(all="ignore"):
        for _ in range(60):
            scores = [np.abs((t.x @ q) @ (t.x @ k).T) / np.sqrt(q.shape[1])
                      for q, k in zip(_cols(t.w_q, 2), _cols(t.w_k, 2))]
            if max(s.max() for s in scores) > 3 * limit and not np.isfinite(
                    _no_max_subtraction(*t.args)).all():
                break
            t.x = (t.x * 2).astype(dtype)
    t.large = True
    t.about = (f"inputs scaled up (|x| up to {float(np.abs(t.x).max()):.3g}) so that "
               f"scores exceed {limit:.0f}: the answer is finite, but exp() of "
               "the raw scores overflows")
    return t


# A generous bound on what one trial keeps alive in check_prototype: its
# arrays (T <= 6, d_model <= 8, h*d <= 16), the prototype's output and
# intermediates, its TrialResult and report text.
_TRIAL_BYTES = 64 * 1024


def _trials(n_random: int, dtype, seed: int) -> List[_Trial]:
    rng = np.random.default_rng(seed)
    trials = [
        _worked_example_trial(dtype),
        _random_trial(rng, "dk_ne_dv", "d_k != d_v, three heads, non-square W^O",
                      6, 6, 3, 2, 3, 5, dtype),
        _random_trial(rng, "square", "four heads; square projections and W^O",
                      4, 8, 4, 2, 2, 8, dtype),
        _random_trial(rng, "dk_ne_dv_square", "d_k != d_v, square W^O, T=5",
                      5, 6, 2, 3, 4, 8, dtype),
        _large_trial(rng, dtype),
    ]
    for i in range(n_random):
        h = int(rng.integers(2, 5))
        d_k, d_v = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        T = int(rng.integers(3, 7))
        d_model, d_out = int(rng.integers(2, 9)), int(rng.integers(2, 9))
        trials.append(_random_trial(rng, f"random_{i + 1}", "random shapes",
                                    T, d_model, h, d_k, d_v, d_out, dtype))
    return trials


# --------------------------------------------------------------------------
# Running and matching
# --------------------------------------------------------------------------

class _BadReturn(Exception):
    """The prototype returned something that is not an output array."""


def _run(fn: Callable, args) -> Tuple[Any, Optional[Mapping]]:
    """(output array or exception, dict of intermediates or None)."""
    copies = [np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in args]
    try:
        with np.errstate(all="ignore"):
            res = fn(*copies)
    except Exception as exc:  # the finding for this trial
        return exc, None
    inter = None
    if isinstance(res, Mapping):
        inter = res
        keys = [k for k in res if canonical_key(k) == "output"]
        if not keys:
            return _BadReturn("the returned dict has no 'output' (or 'out') key; "
                              f"keys: {sorted(map(str, res))}"), inter
        res = res[keys[0]]
    elif isinstance(res, tuple):
        if not res:
            return _BadReturn("returned an empty tuple"), None
        inter = {"output": res[0]}
        if len(res) == 2:
            inter["weights"] = res[1]
        res = res[0]
    if res is None:
        return _BadReturn("returned None (missing return statement?)"), inter
    try:
        arr = np.asarray(res)
    except Exception as exc:
        return _BadReturn(f"returned {type(res).__name__}, not an array ({exc})"), inter
    if arr.dtype.kind not in "biuf":
        return _BadReturn(f"returned an array of dtype {arr.dtype}"), inter
    return arr.astype(np.float64), inter


def _distance(got: Any, want: Any, tol: float) -> Tuple[bool, float]:
    """Whether two outcomes agree, and how far apart they are.

    Outcomes are arrays or exceptions.  Two exceptions of the same type
    agree.  Arrays agree when they have one shape, the same non-finite
    entries, and max |a - b| <= tol * max |b| over the finite ones."""
    got_exc, want_exc = isinstance(got, BaseException), isinstance(want, BaseException)
    if got_exc or want_exc:
        same = got_exc and want_exc and type(got) is type(want)
        return same, (0.0 if same else np.inf)
    if got.shape != want.shape:
        return False, np.inf
    fg, fw = np.isfinite(got), np.isfinite(want)
    if not np.array_equal(fg, fw):
        return False, 1e6 + float(np.mean(fg != fw))
    if not fg.any():
        return True, 0.0
    scale = max(float(np.abs(want[fw]).max()), 1e-300)
    err = float(np.abs(got[fg] - want[fw]).max()) / scale
    return err <= tol, err


@dataclass
class TrialResult:
    """One configuration the prototype ran on."""
    name: str
    about: str
    shapes: str
    status: str                     # 'ok' | 'differs' | 'raised' | 'nonfinite' | 'shape'
    max_abs: Optional[float] = None
    max_rel: Optional[float] = None  # max |got - want| / max |want|
    error: Optional[str] = None     # 'ValueError: ...' when fn raised
    expected_shape: Optional[Tuple[int, ...]] = None
    got_shape: Optional[Tuple[int, ...]] = None
    stages: Optional[CompareReport] = None  # when fn returned intermediates
    matches: List[str] = field(default_factory=list)  # mistakes matching here

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def describe(self) -> str:
        if self.status == "ok":
            return "ok"
        if self.status == "raised":
            return f"raised {self.error}"
        if self.status == "shape":
            return f"output shape {self.got_shape}, expected {self.expected_shape}"
        if self.status == "nonfinite":
            return "output has inf/nan where mhattn's is finite"
        return f"differs (max abs err {self.max_abs:.3g}, max rel err {self.max_rel:.3g})"


def _short_exc(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if len(msg) > 160:
        msg = msg[:157] + "..."
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def check_prototype(fn: Callable, *, trials: int = 4, dtype=np.float64,
                    seed: int = 0) -> "PrototypeReport":
    """Check a multi-head attention prototype against mhattn; name its mistake.

    check_prototype(fn, *, trials=4, dtype=np.float64, seed=0) -> PrototypeReport

    ``fn(x, w_q, w_k, w_v, w_o, num_heads)`` gets x (T, d_model) and fused
    2-D weights: w_q and w_k (d_model, h*d_k), w_v (d_model, h*d_v) with head
    i owning columns [i*d, (i+1)*d), and w_o (h*d_v, d_out).  It returns the
    output (T, d_out); or a dict of intermediates, whose 'output' (or 'out')
    is the output and whose other known keys ('q', 'k', 'v', 'raw_scores',
    'scores', 'weights', 'heads', 'concat'; per-head arrays stacked (h, T, d),
    fused (T, h*d) or as a list) are compared with :func:`mhattn.trace`; or
    a tuple (output, weights).

    It runs on five designed configurations — the document's worked example
    (w_q = concat(W_Q1, W_Q2), W^O = I), d_k != d_v with three heads and a
    non-square W^O, four heads with square weights, d_k != d_v with a square
    W^O, and inputs so large that exp() of the raw scores overflows — plus
    ``trials`` random ones, all in ``dtype`` and drawn from ``seed``.

    When the outputs differ from :func:`mhattn.multi_head_attention`, the
    report names the known mistake whose re-enactment matches the
    prototype's outputs on every trial (or on the most trials):
    'no_scaling', 'scale_by_dk', 'scale_by_sqrt_dmodel', 'softmax_wrong_axis',
    'heads_averaged', 'heads_summed', 'wo_skipped', 'wo_transposed',
    'projections_transposed', 'no_max_subtraction', 'heads_split_sequence',
    'same_projection_every_head'; None when the prototype is right or the
    mistake is not one of these.  An exception raised by ``fn`` is recorded
    as that trial's finding.

    Returns a :class:`PrototypeReport`: ``.ok``, ``.mistake``, ``.title``,
    ``.explanation``, ``.trials``; ``print(report)`` gives plain text, and
    Jupyter renders it as HTML.

    Examples
    --------
    >>> def prototype(x, w_q, w_k, w_v, w_o, h):    # forgot the 1/sqrt(d_k)
    ...     return mhattn.reference.multi_head_attention(x, w_q, w_k, w_v, w_o,
    ...                                                  num_heads=h, scale=1.0)
    >>> mhattn.check_prototype(prototype).mistake
    'no_scaling'
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable fn(x, w_q, w_k, w_v, w_o, num_heads), "
                        f"got {type(fn).__name__}")
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"dtype: expected float32 or float64, got {dtype}")
    if isinstance(trials, bool) or not isinstance(trials, (int, np.integer)) or trials < 0:
        raise ValueError(f"trials: expected a non-negative integer, got {trials!r}")
    # normwise relative tolerance: rounding differences only
    tol = 2e-4 if dtype == np.float32 else 1e-7
    # Every trial, its result and its re-enactments are kept until the report
    # is built: the whole need is checked before the first one is drawn.
    check_memory([(f"trials={int(trials)}", "(trials + 5)*bytes per trial",
                   (int(trials) + 5, _TRIAL_BYTES), 1)])
    cases = _trials(int(trials), dtype, seed)
    results: List[TrialResult] = []
    user_out: List[Any] = []
    for t in cases:
        want = multi_head_attention(*t.args[:5], num_heads=t.num_heads)
        got, inter = _run(fn, t.args)
        user_out.append(got)
        r = TrialResult(t.name, t.about, t.shapes(), "ok", expected_shape=want.shape)
        if isinstance(got, BaseException):
            r.status = "raised"
            r.error = _short_exc(got)
        else:
            r.got_shape = got.shape
            if got.shape != want.shape:
                r.status = "shape"
            else:
                w64 = want.astype(np.float64)
                fg, fw = np.isfinite(got), np.isfinite(w64)
                if not np.array_equal(fg, fw):
                    r.status = "nonfinite"
                    r.max_abs = r.max_rel = float("inf")
                else:
                    ok, rel = _distance(got, w64, tol)
                    diff = np.abs(got[fg] - w64[fw])
                    r.max_abs = float(diff.max()) if diff.size else 0.0
                    r.max_rel = rel
                    r.status = "ok" if ok else "differs"
        if inter is not None:
            given = {k: v for k, v in inter.items() if canonical_key(k) is not None}
            if given:
                ref = trace(*t.args[:5], num_heads=t.num_heads)
                rtol, atol = (1e-4, 1e-5) if dtype == np.float32 else (1e-7, 1e-9)
                r.stages = ref.compare(given, rtol=rtol, atol=atol)
        results.append(r)

    # Re-enact each known mistake on the same trials.
    fails = [i for i, r in enumerate(results) if not r.ok]
    scored = []
    for order, (mistake, form, vfn) in enumerate(VARIANTS):
        matches, value_hits, errs = [], 0, []
        for i, t in enumerate(cases):
            want, _ = _run(vfn, t.args)
            ok, dist = _distance(user_out[i], want, tol)
            matches.append(ok)
            if ok and not isinstance(want, BaseException):
                value_hits += int(i in fails)
            errs.append(min(dist, 1e3))
        for i, ok in enumerate(matches):
            if ok and mistake not in results[i].matches:
                results[i].matches.append(mistake)
        explained = sum(matches[i] for i in fails)
        scored.append(dict(mistake=mistake, form=form, order=order, n_match=sum(matches),
                           full=all(matches), explained=explained, value_hits=value_hits,
                           dist=float(np.mean(errs))))

    return PrototypeReport._build(results, scored, fails, cases)


class PrototypeReport:
    """What :func:`check_prototype` found.

    Attributes
    ----------
    ok : bool
        The prototype's output agrees with mhattn on every trial.
    mistake : str or None
        The likely mistake's identifier (see :data:`MISTAKES`), or None.
    title : str
        One line naming the mistake (or the verdict).
    explanation : str
        What is wrong and how to fix it, with the document's equations.
    exact : bool
        The named mistake reproduces the prototype's output on every trial
        (False: it is only the closest known mistake).
    candidates : list of str
        Every known mistake consistent with all trials.
    form : str or None
        How the matching re-enactment writes the mistake.
    first_divergent_stage : str or None
        When ``fn`` returned intermediates: the first that differs.
    hints : list of str
        Patterns in the failing trials (shapes they share, exceptions).
    trials : list of TrialResult
    """

    def __init__(self, ok: bool, mistake: Optional[str], title: str, explanation: str,
                 trials: List[TrialResult], *, exact: bool = False,
                 candidates: Optional[List[str]] = None, form: Optional[str] = None,
                 first_divergent_stage: Optional[str] = None,
                 hints: Optional[List[str]] = None):
        self.ok = ok
        self.mistake = mistake
        self.title = title
        self.explanation = explanation
        self.trials = trials
        self.exact = exact
        self.candidates = list(candidates or [])
        self.form = form
        self.first_divergent_stage = first_divergent_stage
        self.hints = list(hints or [])

    @classmethod
    def _build(cls, results: List[TrialResult], scored: List[dict], fails: List[int],
               cases: List[_Trial]) -> "PrototypeReport":
        n = len(results)
        stage: Optional[str] = None
        stage_note = ""
        for r in results:
            if r.stages is not None and r.stages.first_divergence is not None:
                stage = r.stages.first_divergence
                stage_note = (f"The first of your intermediates that differs from "
                              f"mhattn's is '{stage}' (trial {r.name}): "
                              f"{r.stages.summary()}")
                break

        if not fails:
            verdict = (f"Your prototype agrees with mhattn on all {n} trials, including "
                       "the document's worked example, d_k != d_v, more than two heads "
                       "and inputs large enough to overflow a naive softmax.")
            if stage_note:
                verdict += ("\nThe output is right, but some intermediates you returned "
                            "are not what mhattn calls them. " + stage_note)
            return cls(True, None, "matches mhattn", verdict, results,
                       first_divergent_stage=stage)

        full = [s for s in scored if s["full"]]
        full.sort(key=lambda s: (-s["value_hits"], s["order"]))
        candidates: List[str] = []
        for s in full:
            if s["mistake"] not in candidates:
                candidates.append(s["mistake"])
        if full:
            best, exact = full[0], True
        else:
            ranked = sorted(scored, key=lambda s: (-s["value_hits"], -s["explained"],
                                                   -s["n_match"], s["dist"], s["order"]))
            best, exact = ranked[0], False
            if best["value_hits"] == 0:
                best = None
        hints = cls._hints(results, fails, cases,
                           None if best is None or not exact else best["mistake"])

        summary = f"{len(fails)} of {n} trials differ from mhattn."
        if best is None:
            title = "the outputs differ, and not like any known mistake"
            expl = [summary, "No known mistake reproduces your outputs. The document's "
                    "computation, per head i, is\n"
                    "    head_i = softmax(Q_i K_i^T / sqrt(d_k)) V_i,  "
                    "Q_i = X W_i^Q, K_i = X W_i^K, V_i = X W_i^V\n"
                    "    MultiHead(X) = Concat(head_1, ..., head_h) W^O\n"
                    "In NumPy, with fused weights:\n" + _CODE_FIX]
            mistake, form = None, None
        else:
            mistake, form = best["mistake"], best["form"]
            title, text = MISTAKES[mistake]
            if exact:
                how = (f"Most likely mistake: {mistake} ({title}). Re-enacted as "
                       f"'{form}', it reproduces your outputs on all {n} trials.")
            else:
                how = (f"Closest known mistake: {mistake} ({title}). Re-enacted as "
                       f"'{form}', it reproduces your outputs on {best['n_match']} of "
                       f"{n} trials only, so there may be more than one mistake.")
            expl = [summary, how, text]
            others = [c for c in candidates if c != mistake]
            if others:
                expl.append("These mistakes fit the trials equally well: "
                            + ", ".join(others) + ".")
        if stage_note:
            expl.append(stage_note)
        if hints:
            expl.append("\n".join("Hint: " + h for h in hints))
        return cls(False, mistake, title, "\n\n".join(expl), results, exact=exact,
                   candidates=candidates, form=form, first_divergent_stage=stage,
                   hints=hints)

    @staticmethod
    def _hints(results: List[TrialResult], fails: List[int], cases: List[_Trial],
               mistake: Optional[str]) -> List[str]:
        """Patterns in the failing trials; ``mistake`` is the one that explains
        every trial, if any (then hints pointing elsewhere are left out)."""
        hints = []
        failing = set(fails)
        names = list(cases[0].features())
        for feat in names:
            having = {i for i, t in enumerate(cases) if t.features()[feat]}
            if having and having == failing and len(having) < len(cases):
                hints.append(f"it fails exactly on the trials with {feat}.")
        raised = [results[i] for i in fails if results[i].status == "raised"]
        if raised:
            hints.append(f"your function raised on {len(raised)} of {len(results)} "
                         f"trials, first on {raised[0].name} ({raised[0].shapes}): "
                         f"{raised[0].error}.")
            if mistake in (None, "wo_transposed", "projections_transposed") and any(
                    _is_shape_error_text(r.error) for r in raised):
                hints.append("a shape error often means a transposed matrix: mhattn and "
                             "the document use row vectors, Q = X W^Q with W^Q "
                             "(d_model, h*d_k), and Concat(...) W^O with W^O "
                             "(h*d_v, d_out).")
        if mistake in (None, "no_max_subtraction") and any(
                results[i].status == "nonfinite" for i in fails):
            hints.append("some outputs hold inf or nan where the answer is finite: "
                         "an overflow, typically exp() of large scores without "
                         "subtracting the row max.")
        return hints

    # ------------------------------------------------------------ display
    def __str__(self) -> str:
        head = ("check_prototype: OK - " if self.ok else "check_prototype: ") + self.title
        if self.mistake:
            head += f"  [mistake: {self.mistake}]"
        lines = [head, "", self.explanation, "", "Trials:"]
        width = max(len(r.name) for r in self.trials)
        for r in self.trials:
            line = f"  {r.name:<{width}}  {r.shapes:<52}  {r.describe()}"
            lines.append(line)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        from ._html import report_html
        return report_html(self)


def _is_shape_error_text(text: Optional[str]) -> bool:
    if not text:
        return False
    low = text.lower()
    return low.startswith(("valueerror", "indexerror")) and any(
        w in low for w in ("shape", "matmul", "align", "broadcast", "dimension"))

