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

import inspect
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .._internal.args import check_memory
from ..compute.attention import attention as _attention
from ..compute.forward import multi_head_attention
from ..reference import worked_example
from . import mistakes as _mistakes
from . import rounding as _rounding
from . import steps as _steps
from .trace import CompareReport, canonical_key, trace

__all__ = ["check_prototype", "check_attention_prototype", "PrototypeReport", "TrialResult",
           "MISTAKES"]


# --------------------------------------------------------------------------
# The document's computation, for the report; the mistakes are the table
# of mhattn.learn.mistakes, re-enacted by the step model of steps.py.
# --------------------------------------------------------------------------

def _cols(w: np.ndarray, h: int) -> List[np.ndarray]:
    """Head i owns columns [i*d, (i+1)*d) of a fused weight."""
    d = w.shape[1] // h
    return [w[:, i * d:(i + 1) * d] for i in range(h)]


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

#: mistake id -> (short title, explanation that teaches the fix), from the
#: table of :mod:`mhattn.learn.mistakes`.
MISTAKES: Dict[str, Tuple[str, str]] = {m.id: (m.title, m.text) for m in _mistakes.TABLE}


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
    kwargs: Dict[str, Any] = field(default_factory=dict)  # mask=, causal=

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
            "a mask": "mask" in self.kwargs,
            "causal": bool(self.kwargs.get("causal")),
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
                    _reenact(t.args, "no_max_subtraction")).all():
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


def _trials(n_random: int, dtype, seed: int, convention: str = "general",
            keywords: Sequence[str] = ()) -> List[_Trial]:
    """The designed trials, then ``n_random`` random ones.  ``convention``
    "standard" keeps to d_k = d_v = d_model / h; ``keywords`` ('mask',
    'causal') adds a trial passing that option (only for prototypes that
    accept it)."""
    rng = np.random.default_rng(seed)
    std = convention == "standard"
    trials = [_worked_example_trial(dtype)]
    if std:
        trials.append(_random_trial(rng, "three_heads", "three heads, non-square W^O",
                                    6, 6, 3, 2, 2, 5, dtype))
    else:
        trials.append(_random_trial(rng, "dk_ne_dv", "d_k != d_v, three heads, "
                                    "non-square W^O", 6, 6, 3, 2, 3, 5, dtype))
    trials.append(_random_trial(rng, "square", "four heads; square projections and W^O",
                                4, 8, 4, 2, 2, 8, dtype))
    if not std:
        trials.append(_random_trial(rng, "dk_ne_dv_square", "d_k != d_v, square W^O, T=5, "
                                    "d_model != h*d_k", 5, 8, 2, 3, 4, 8, dtype))
    trials.append(_large_trial(rng, dtype))
    for i in range(n_random):
        h = int(rng.integers(2, 5))
        d_k, d_v = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        T = int(rng.integers(3, 7))
        d_model, d_out = int(rng.integers(2, 9)), int(rng.integers(2, 9))
        if std:
            d_v, d_model = d_k, h * d_k
        trials.append(_random_trial(rng, f"random_{i + 1}", "random shapes",
                                    T, d_model, h, d_k, d_v, d_out, dtype))
    if "mask" in keywords:
        t = _random_trial(rng, "mask", "a boolean mask (True = may attend)",
                          5, 6, 2, 3, 3 if std else 2, 5, dtype)
        m = rng.random((5, 5)) < 0.6
        m[np.arange(5), rng.integers(0, 5, 5)] = True      # every row sees a key
        t.kwargs = {"mask": m}
        trials.append(t)
    if "causal" in keywords:
        t = _random_trial(rng, "causal", "causal=True", 5, 6, 2, 3, 3 if std else 4,
                          6, dtype)
        t.kwargs = {"causal": True}
        trials.append(t)
    if "rope" in keywords:
        from .._internal.variants import RoPE
        t = _random_trial(rng, "rope", "rope=mhattn.RoPE(theta=10.0) (rotate-half)",
                          6, 8, 2, 4, 4 if std else 2, 6, dtype)
        t.kwargs = {"rope": RoPE(theta=10.0)}
        trials.append(t)
    if "q_norm" in keywords:
        # three heads of d_k = 4, weights far from 1, a row scale that a
        # per-head norm removes and a whole-row one does not
        t = _random_trial(rng, "qk_norm", "q_norm=, k_norm= (RMSNorm weights over d_k)",
                          5, 12 if std else 9, 3, 4, 4 if std else 3, 6, dtype)
        t.x = (t.x * np.linspace(0.5, 3.0, t.x.shape[1])).astype(dtype)
        t.kwargs = {"q_norm": (0.5 + rng.random(4) * 1.5).astype(dtype),
                    "k_norm": (0.5 + rng.random(4) * 1.5).astype(dtype)}
        trials.append(t)
    if "mask" in keywords:
        # last, so that the other trials are drawn as before
        t = _random_trial(rng, "mask_empty_row", _EMPTY_ROW_ABOUT, 5, 6, 2, 3,
                          3 if std else 2, 5, dtype)
        t.kwargs = {"mask": _empty_row_mask(rng, 5, 5)}
        trials.append(t)
    return trials


_EMPTY_ROW_ABOUT = ("a boolean mask whose row 2 allows no key: mhattn's answer there is 0 "
                    "(NaN, from exp(-inf - (-inf)), is accepted too)")


def _empty_row_mask(rng, tq: int, tk: int) -> np.ndarray:
    """A random (tq, tk) mask, True = may attend: row 2 allows no key, every
    other row at least one."""
    m = rng.random((tq, tk)) < 0.6
    m[np.arange(tq), rng.integers(0, tk, tq)] = True
    m[2] = False
    return m


# --------------------------------------------------------------------------
# Running and matching
# --------------------------------------------------------------------------

class _BadReturn(Exception):
    """The prototype returned something that is not an output array.  The
    message says so in the learner's words, "your function <short>; it must
    return <what><tail>", ``short`` being what it did ("returned None")."""

    def __init__(self, short: str, what: str, tail: str = ""):
        super().__init__(f"your function {short}; it must return {what}{tail}")


def _a(name: str) -> str:
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def _run(fn: Callable, args, kwargs: Optional[Mapping] = None,
         shape: Optional[Tuple[int, ...]] = None,
         what: str = "the output array") -> Tuple[Any, Optional[Mapping]]:
    """(output array or exception, dict of intermediates or None).

    An output of the expected ``shape`` (any, when None) comes back as
    float64; one of another shape as the prototype returned it (a wrong
    shape, reported as such): it is never copied or computed with, so a
    huge one (a broadcast view of a scalar) costs nothing.  What is not an
    output array comes back as an exception whose message says, in the
    learner's words, what was returned and that ``what`` was expected."""
    copies = [np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in args]
    kw = {k: (np.array(v, copy=True) if isinstance(v, np.ndarray) else v)
          for k, v in (kwargs or {}).items()}
    try:
        with np.errstate(all="ignore"):
            res = fn(*copies, **kw)
    except Exception as exc:  # the finding for this trial
        return exc, None
    inter = None
    if isinstance(res, Mapping):
        inter = res
        keys = [k for k in res if canonical_key(k) == "output"]
        if not keys:
            return _BadReturn("returned a dict without an 'output' (or 'out') key",
                              what, f" under 'output' (its keys: "
                              f"{sorted(map(str, res))})"), inter
        res = res[keys[0]]
    elif isinstance(res, tuple):
        if not res:
            return _BadReturn("returned an empty tuple", what,
                              ", or a tuple (output, weights)"), None
        inter = {"output": res[0]}
        if len(res) == 2:
            inter["weights"] = res[1]
        res = res[0]
    if res is None:
        return _BadReturn("returned None", what,
                          " (is a return statement missing?)"), inter
    try:
        arr = np.asarray(res)
    except Exception as exc:
        return _BadReturn(f"returned {_a(type(res).__name__)} that NumPy cannot read "
                          "as one array", what, f" (NumPy: {_short_exc(exc)})"), inter
    if arr.dtype.kind not in "biuf":
        kind = (type(res).__name__ if not isinstance(res, np.ndarray)
                else f"array of dtype {arr.dtype}")
        return _BadReturn(f"returned {_a(kind)}", what, ", an array of real numbers"), inter
    if shape is not None and arr.shape != tuple(shape):
        return arr, inter
    return arr.astype(np.float64), inter


def _settle_empty_rows(got: Any, want: np.ndarray, mask: Any) -> Tuple[Any, Optional[str]]:
    """(got, note): a prototype's NaN in the query rows that ``mask`` leaves
    without any key, where mhattn gives 0, read as mhattn's answer.

    Both are what a softmax can give there: exp(-inf - (-inf)) is NaN, and
    mhattn defines such a row's output as 0.  An output that is NaN
    everywhere is left as it is.  The query rows are the outputs' axis -2
    (a layer's (T, d_out), attention's (h, T_q, d_v))."""
    if mask is None or not isinstance(got, np.ndarray) or got.shape != want.shape \
            or got.ndim < 2:
        return got, None
    empty = ~np.asarray(mask, dtype=bool).any(axis=-1)
    if empty.shape != got.shape[-2:-1] or not empty.any():
        return got, None
    if not np.isnan(got[..., empty, :]).all() or np.isnan(got).all():
        return got, None        # NaN elsewhere too: not the row with no key's
    got = got.copy()
    got[..., empty, :] = want[..., empty, :]
    rows = ", ".join(str(int(i)) for i in np.flatnonzero(empty))
    return got, (f"row {rows} has no key to attend to: your NaN there is accepted "
                 "as mhattn's 0")


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
    #: 'ok' | 'differs' | 'raised' | 'returned' (no output array) | 'nonfinite' | 'shape'
    status: str
    max_abs: Optional[float] = None
    max_rel: Optional[float] = None  # max |got - want| / max |want|
    #: 'ValueError: ...' when fn raised; what it returned instead of an output
    error: Optional[str] = None
    expected_shape: Optional[Tuple[int, ...]] = None
    got_shape: Optional[Tuple[int, ...]] = None
    stages: Optional[CompareReport] = None  # when fn returned intermediates
    matches: List[str] = field(default_factory=list)  # = matching (older name)
    #: the mistakes (a pair as 'a + b') matching this trial; empty when it passes
    matching: List[str] = field(default_factory=list)
    #: what was accepted although it is not mhattn's answer (a NaN row with no key)
    note: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def describe(self) -> str:
        if self.status == "ok":
            return f"ok ({self.note})" if self.note else "ok"
        if self.status == "raised":
            return f"raised {self.error}"
        if self.status == "returned":     # "your function returned None; ..."
            what = str(self.error).split(";")[0].replace("your function ", "", 1)
            return f"{what} instead of an output of shape {self.expected_shape}"
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


# --------------------------------------------------------------------------
# The search: every single and every pair of step substitutions
# --------------------------------------------------------------------------

def _same(got: Any, model: Any, tol: float) -> bool:
    """A re-enactment's outcome matches the prototype's: arrays as
    :func:`_distance`; an exception only an exception of the same type raised
    by the same operation (the sizes in a shape error's message)."""
    if isinstance(model, _steps.Raised) or isinstance(got, BaseException):
        if not (isinstance(model, _steps.Raised) and isinstance(got, BaseException)):
            return False
        return model.key == _steps.exception_key(got)
    return _distance(_zeros_as_nan(got, model), model, tol)[0]


def _zeros_as_nan(got: np.ndarray, model: np.ndarray) -> np.ndarray:
    """``got`` with NaN in the rows (last axis) where ``model`` is all NaN
    and ``got`` all 0.  A re-enacted mistake that leaves a query row without
    any key gives NaN there, as exp(s - s.max()) does; a prototype that
    guards its softmax gives 0 there, with the same mistake."""
    if got.shape != model.shape or got.ndim < 2:
        return got
    rows = np.isnan(model).all(axis=-1) & (got == 0).all(axis=-1)
    if not rows.any():
        return got
    got = got.copy()
    got[rows] = np.nan
    return got


@dataclass
class _Candidate:
    names: Tuple[str, ...]          # one mistake, or two (in step order)
    forms: Tuple[str, ...]
    steps: Tuple[int, ...]
    order: int
    outcomes: List[Any]
    matches: List[bool] = field(default_factory=list)


def _search(steps, starts: List[Dict[str, Any]], user: List[Any], tol: Sequence[float],
            first_stage: Optional[str], passing: Sequence[int] = ()) -> List[_Candidate]:
    """Every single substitution and every pair at two different steps, run
    on every trial from the correct run's saved states; pairs whose first
    member contradicts the first divergent stage are not run."""
    base = [_steps.run(steps, s, {}, keep=True)[1] for s in starts]
    stage_rank = {s: i for i, s in enumerate(_STAGE_ORDER)}
    limit = stage_rank.get(first_stage) if first_stage else None

    def allowed(step_i: int) -> bool:
        if limit is None:
            return True
        return stage_rank.get(steps[step_i].stage, 0) <= limit

    singles = []
    order = 0
    for si, step in enumerate(steps):
        for name, form, fn in step.wrong:
            outs, kept = [], []
            for t in range(len(starts)):
                o, st = _steps.run(steps, base[t][si], {si: fn}, from_step=si, keep=True)
                outs.append(o)
                kept.append(st)
            singles.append((si, name, form, fn, outs, kept))
            order += 1
    cands: List[_Candidate] = []
    for n, (si, name, form, fn, outs, kept) in enumerate(singles):
        if allowed(si):
            cands.append(_Candidate((name,), (form,), (si,), n, outs))
    for c in cands:
        c.matches = [_same(u, o, t) for u, o, t in zip(user, c.outcomes, tol)]
    if any(all(c.matches) for c in cands):
        return cands                  # a single explains everything: no pairs needed
    for n, (si, name, form, fn, outs, kept) in enumerate(singles):
        if not allowed(si):
            continue
        for m, (sj, name2, form2, fn2, _, _) in enumerate(singles):
            if sj <= si or name2 == name:
                continue
            pouts = []
            for t in range(len(starts)):
                st = kept[t]
                if len(st) <= sj - si:        # the first one raised before step sj
                    pouts.append(outs[t])
                    continue
                o, _ = _steps.run(steps, st[sj - si], {sj: fn2}, from_step=sj)
                pouts.append(o)
            c = _Candidate((name, name2), (form, form2), (si, sj),
                           len(singles) * (1 + n) + m, pouts)
            c.matches = [_same(u, o, t) for u, o, t in zip(user, c.outcomes, tol)]
            cands.append(c)
    return cands


_STAGE_ORDER = ("q", "k", "v", "raw_scores", "scores", "weights", "heads", "concat",
                "output")


def _rank(cands: List[_Candidate], fails: List[int], user: List[Any], n: int):
    """(ranked candidates, exact?): the candidates matching every trial, else
    those explaining the most failing trials.  Candidates whose output shape
    differs from the prototype's where both returned arrays are dropped, and
    failing trials on which every remaining candidate behaves alike (no
    discrimination) do not count."""
    def shape_ok(c: _Candidate) -> bool:
        for u, o in zip(user, c.outcomes):
            if isinstance(u, np.ndarray) and isinstance(o, np.ndarray) \
                    and u.shape != o.shape:
                return False
        return True

    live = [c for c in cands if shape_ok(c) and any(c.matches[i] for i in fails)]
    full = [c for c in live if all(c.matches)]
    if full:
        singles = [c for c in full if len(c.names) == 1]
        full = singles or full
        full.sort(key=lambda c: c.order)
        return full, True
    informative = [i for i in fails
                   if len({c.matches[i] for c in live}) > 1] or list(fails)
    for c in live:
        c.explained = sum(c.matches[i] for i in informative)  # type: ignore[attr-defined]
    live = [c for c in live if c.explained > 0]              # type: ignore[attr-defined]
    live.sort(key=lambda c: (-c.explained, -sum(c.matches),  # type: ignore[attr-defined]
                             len(c.names), c.order))
    return live, False


def _search_and_rank(steps, starts, user_out, tol, stage, fails):
    """(candidates, ranked, exact): the search, its candidates that agree
    on every passing trial, ranked."""
    n = len(user_out)
    cands = _search(steps, starts, user_out, tol, stage)
    passing = [i for i in range(n) if i not in fails]
    cands = [c for c in cands if all(c.matches[i] for i in passing)]
    ranked, exact = _rank(cands, fails, user_out, n)
    return cands, ranked, exact


def _paragraphs(text: str) -> List[Tuple[str, str]]:
    """Split text into ('prose' | 'code', text) in written order: code is a run
    of lines indented by four spaces (kept without the indent, one line per
    line); a prose run is one paragraph (its hard line breaks become spaces).
    The block of 'Hint: ...' lines is left out (it is ``hints``)."""
    out: List[Tuple[str, str]] = []
    for block in text.split("\n\n"):
        if block.startswith("Hint: "):
            continue
        kind, lines = None, []
        for line in block.split("\n"):
            k = "code" if line.startswith("    ") else "prose"
            if k != kind and lines:
                out.append((kind, ("\n" if kind == "code" else " ").join(lines)))
                lines = []
            kind = k
            lines.append(line[4:] if k == "code" else line.strip())
        if lines:
            out.append((kind, ("\n" if kind == "code" else " ").join(lines)))
    return out


def _accepts(fn: Callable, name: str) -> bool:
    """Whether fn takes the keyword ``name`` (a parameter of that name, or **kw)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            return True
        if p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            return True
    return False


def _compare_result(r: "TrialResult", got: Any, want: np.ndarray, tol: float) -> None:
    """Fill r's status and errors from the prototype's outcome ``got``."""
    if isinstance(got, _BadReturn):
        r.status = "returned"
        r.error = str(got)
        return
    if isinstance(got, BaseException):
        r.status = "raised"
        r.error = _short_exc(got)
        return
    r.got_shape = got.shape
    if got.shape != want.shape:
        r.status = "shape"
        return
    w64 = want.astype(np.float64)
    fg, fw = np.isfinite(got), np.isfinite(w64)
    if not np.array_equal(fg, fw):
        r.status = "nonfinite"
        r.max_abs = r.max_rel = float("inf")
        return
    ok, rel = _distance(got, w64, tol)
    diff = np.abs(got[fg] - w64[fw])
    r.max_abs = float(diff.max()) if diff.size else 0.0
    r.max_rel = rel
    r.status = "ok" if ok else "differs"


def _layer_start(t: _Trial) -> Dict[str, Any]:
    return dict(x=t.x, w_q=t.w_q, w_k=t.w_k, w_v=t.w_v, w_o=t.w_o, h=t.num_heads,
                d_model=t.x.shape[1], dtype=t.x.dtype, mask=t.kwargs.get("mask"),
                causal=bool(t.kwargs.get("causal")), rope=t.kwargs.get("rope"),
                q_norm=t.kwargs.get("q_norm"), k_norm=t.kwargs.get("k_norm"))


def _features(keywords: Sequence[str]) -> List[str]:
    """The step model's features (see mhattn.learn.mistakes.FEATURES) of a
    prototype taking the options ``keywords``."""
    out = [k for k in ("causal", "rope", "q_norm") if k in keywords]
    if "mask" in keywords or "causal" in keywords:
        out.append("masked")
    return out


def _layer_model(keywords: Sequence[str]) -> List[_steps.Step]:
    return _steps.layer_steps(_features(keywords))




def _ok_report(kind, results, convention, stage, stage_note) -> "PrototypeReport":
    n = len(results)
    verdict = (f"Your prototype agrees with mhattn on all {n} trials"
               + (", including the document's worked example, d_k != d_v, more "
                  "than two heads and inputs large enough to overflow a naive "
                  "softmax." if kind == "layer" and convention == "general" else "."))
    if kind == "layer" and convention == "standard":
        verdict += (" These were the standard convention's trials only "
                    "(d_k = d_v = d_model / h).")
    if stage_note:
        verdict += ("\nThe output is right, but some intermediates you returned "
                    "are not what mhattn calls them. " + stage_note)
    note = _empty_row_note(results)
    if note:
        verdict += "\n\n" + note
    return PrototypeReport(True, None, "matches mhattn", verdict, results,
                           first_divergent_stage=stage)


def _float32_report(kind, results, fails, bound: float) -> "PrototypeReport":
    """Every differing trial agrees to float32's precision."""
    n = len(results)
    worst = max(results[i].max_rel for i in fails)
    text = (f"{len(fails)} of {n} trials differ from mhattn, but only by float32 "
            f"rounding (max relative error {worst:.2g}, within the {bound:.2g} that "
            "float32 rounding can reach on these trials): your prototype computes in "
            "float32 (or casts to it), and these trials are float64. Check it in float32:\n"
            + ("    mhattn.check_prototype(fn, dtype=np.float32)" if kind == "layer"
               else "    mhattn.check_attention_prototype(fn, dtype=np.float32)"))
    return PrototypeReport(False, None, "agrees with mhattn to float32 rounding only",
                           text, results, float32_rounding=True,
                           hints=["every trial that differs agrees to float32 "
                                  "rounding: check with dtype=np.float32."])


def _float32_bound(results, fails, steps, starts) -> Optional[float]:
    """When every failing float64 trial differs by no more than float32's
    rounding can reach on it (its inputs rounded too): the largest such
    bound; else None."""
    if not all(results[i].status == "differs" for i in fails):
        return None
    f32 = _tolerances(steps, [starts[i] for i in fails], np.dtype(np.float32))
    if all(results[i].max_rel <= b for i, b in zip(fails, f32)):
        return max(f32)
    return None


def _all_nan_report(results: List["TrialResult"], user_out: List[Any],
                    n_fails: int) -> Optional["PrototypeReport"]:
    """Every output NaN, even where no score can overflow: no one mistake is
    told by that, so none is claimed (None when that is not the case)."""
    small = [i for i, r in enumerate(results) if r.name != "large_inputs"]
    if not small or not all(results[i].status == "nonfinite" and user_out[i].size
                            and np.isnan(user_out[i]).all() for i in small):
        return None
    return PrototypeReport(
        False, None, "every output is NaN",
        f"{n_fails} of {len(results)} trials differ from mhattn.\n\nYour function "
        "returns only NaN, also on trials whose scores are too small to "
        "overflow, so no overflow explains it and no known mistake is "
        "named: look for the first intermediate that holds a NaN.",
        results)


def _early_report(kind, results, user_out, fails, steps, starts, dtype):
    """The verdicts that need no search: all outputs NaN, or (float64) every
    difference within float32 rounding; None otherwise."""
    all_nan = _all_nan_report(results, user_out, len(fails))
    if all_nan is not None:
        return all_nan
    f32 = _float32_bound(results, fails, steps, starts) if dtype == np.float64 else None
    return None if f32 is None else _float32_report(kind, results, fails, f32)


def _first_stage(results: List["TrialResult"]) -> Tuple[Optional[str], str]:
    """(first divergent intermediate, the sentence that says so), from the
    first trial whose returned intermediates differ."""
    for r in results:
        if r.stages is not None and r.stages.first_divergence is not None:
            stage = r.stages.first_divergence
            return stage, (f"The first of your intermediates that differs from "
                           f"mhattn's is '{stage}' (trial {r.name}): {r.stages.summary()}")
    return None, ""


def _label(c: _Candidate) -> str:
    return " + ".join(c.names)


def _mark_matching(results, fails, ranked, exact) -> List[str]:
    """Each trial's ``matching`` (the candidates that match it, on failing
    trials only); returns the candidates consistent with every trial."""
    best = ranked[0] if ranked else None
    shown = ranked if exact or best is None else [c for c in ranked
                                                  if c.explained == best.explained]
    candidates: List[str] = []
    for c in (ranked if exact else []):
        if _label(c) not in candidates:
            candidates.append(_label(c))
    for i, r in enumerate(results):
        r.matching = []
        if i in fails:
            for c in shown:
                if c.matches[i] and _label(c) not in r.matching:
                    r.matching.append(_label(c))
        r.matches = r.matching
    return candidates


def _named(best: _Candidate, exact: bool, n: int, candidates: List[str]):
    """(title, paragraphs) naming the mistake (or pair) of ``best``."""
    mistakes = best.names
    form = "; ".join(best.forms)
    if len(mistakes) == 1:
        title = MISTAKES[mistakes[0]][0]
        what = f"Most likely mistake: {mistakes[0]} ({title})."
    else:
        title = "two mistakes: " + "; and ".join(MISTAKES[m][0] for m in mistakes)
        what = ("Most likely two mistakes: " + " and ".join(
            f"{m} ({MISTAKES[m][0]})" for m in mistakes) + ".")
    if exact:
        how = (f"{what} Re-enacted as '{form}', "
               f"{'it reproduces' if len(mistakes) == 1 else 'together they reproduce'}"
               f" your outputs on all {n} trials.")
    else:
        how = (f"Closest known {'mistake' if len(mistakes) == 1 else 'pair'}: "
               f"{_label(best)}. Re-enacted as '{form}', it reproduces your outputs "
               f"on {sum(best.matches)} of {n} trials only ({best.explained} of the "
               "failing trials that tell the candidates apart), so there may be another "
               "mistake.")
    expl = [how] + [MISTAKES[m][1] for m in mistakes]
    others = [c for c in candidates if c != _label(best)]
    if others:
        expl.append("These fit the trials equally well: " + ", ".join(others) + ".")
    return title, expl


def _unknown(results: List["TrialResult"], fails: List[int]):
    """(title, paragraphs) when no known mistake explains the outputs; the
    title says so in the learner's words when no failing trial gave an output."""
    n = len(results)
    bad = [results[i] for i in fails]
    no_output = all(r.status in ("raised", "returned") for r in bad)
    title = "the outputs differ, and not like any known mistake"
    first = "No known mistake, nor any pair of them, reproduces your outputs."
    where = "on every trial" if len(bad) == n else f"on {len(bad)} of {n} trials"
    returned = [r for r in bad if r.status == "returned"]
    raised = {r.error.split(":")[0] for r in bad if r.status == "raised"}
    if no_output and not raised:          # "your function returned None; it must ..."
        shorts = {r.error.split(";")[0] for r in returned}
        title = (shorts.pop() if len(shorts) == 1 else
                 "your function returned no output array") + f" {where}"
        first = f"On trial {bad[0].name}, {bad[0].error}."
    elif no_output:
        title = (f"your function raised {raised.pop()} {where}"
                 if len(raised) == 1 and not returned
                 else f"your function raised or returned no output array {where}")
        first = "No known mistake, nor any pair of them, fails this way."
    return title, [first + " The document's computation, per head i, is\n"
                   "    head_i = softmax(Q_i K_i^T / sqrt(d_k)) V_i,  "
                   "Q_i = X W_i^Q, K_i = X W_i^K, V_i = X W_i^V\n"
                   "    MultiHead(X) = Concat(head_1, ..., head_h) W^O\n"
                   "In NumPy, with fused weights:\n" + _CODE_FIX]


_STANDARD_TITLE = "correct for the standard convention (d_k = d_v = d_model / h)"


def _convention_only(results, fails, features, standard_ok) -> Optional[str]:
    """When the prototype passes the standard convention's trials and fails
    only trials outside it (d_model != h*d_k, or d_k != d_v): the paragraph
    that says so, and what the general convention adds; else None."""
    if not standard_ok or not features or not all(
            features[i].get("d_k != d_v") or features[i].get("d_model != h*d_k")
            for i in fails):
        return None
    names = ", ".join(results[i].name for i in fails)
    return ("Your prototype is correct for the standard convention, d_k = d_v = "
            "d_model / h: it passes every trial of the standard convention. It fails "
            f"only the trials where d_model != h*d_k or d_k != d_v ({names}). The "
            "document's formal definition is more general: head i has its own W_i^Q, "
            "W_i^K of shape d_model x d_k and W_i^V of shape d_model x d_v, so d_k and "
            "d_v need not be d_model / h, nor equal to each other; mhattn reads them "
            "from the weights. Take each head's width from its weights, not from "
            "d_model, and use d_v for V and for the concatenation:\n"
            "    d_k = w_q.shape[1] // num_heads      # q and k heads: (T, d_k)\n"
            "    d_v = w_v.shape[1] // num_heads      # v heads: (T, d_v); Concat: "
            "(T, h*d_v)\n"
            "If you wrote it for the standard convention only, check it with that one:\n"
            "    mhattn.check_prototype(fn, convention=\"standard\")")


def _empty_row_note(results: List["TrialResult"]) -> Optional[str]:
    """A paragraph on the trials whose NaN in a row with no key was accepted."""
    noted = [r for r in results if r.note]
    if not noted:
        return None
    return (f"On {', '.join(r.name for r in noted)}, a query row may attend to no key "
            "(its mask row is all False). Your output there is NaN, from "
            "exp(-inf - (-inf)); mhattn defines such a row's output as 0. The checker "
            "accepts either; to give 0, set the weights of a row with no key to 0.")


def _diagnose(kind: str, results: List["TrialResult"], user_out: List[Any],
              steps: List[_steps.Step], starts: List[Dict[str, Any]], tol: List[float],
              dtype: np.dtype, standard_ok: Optional[bool], convention: str,
              features: List[Dict[str, bool]]) -> "PrototypeReport":
    n = len(results)
    fails = [i for i, r in enumerate(results) if not r.ok]
    stage, stage_note = _first_stage(results)
    if not fails:
        return _ok_report(kind, results, convention, stage, stage_note)
    early = _early_report(kind, results, user_out, fails, steps, starts, dtype)
    if early is not None:
        return early

    cands, ranked, exact = _search_and_rank(steps, starts, user_out, tol, stage, fails)
    if not exact and stage is not None:
        # the divergent intermediate may only be named differently from
        # mhattn's: search again without it, and say so if that explains all
        again = _search_and_rank(steps, starts, user_out, tol, None, fails)
        if again[2]:
            cands, ranked, exact = again
            stage_note += (" No mistake that starts at or before that stage explains "
                           "your outputs, but one that starts later does: that "
                           "intermediate may be another quantity under mhattn's name.")
    convention_only = _convention_only(results, fails, features, standard_ok)
    best = ranked[0] if ranked and (exact or convention_only is None) else None
    candidates = _mark_matching(results, fails, ranked if best else [], exact)
    summary = f"{len(fails)} of {n} trials differ from mhattn."
    if best is not None:
        title, expl = _named(best, exact, n, candidates)
        mistakes: Tuple[str, ...] = best.names
        form: Optional[str] = "; ".join(best.forms)
    elif convention_only is not None:
        title, expl = _STANDARD_TITLE + ", not for the general one (d_k, d_v from the " \
                                        "weights)", []
        mistakes, form = (), None
    else:
        title, expl = _unknown(results, fails)
        mistakes, form = (), None
    if convention_only is not None:
        if best is not None:
            title = _STANDARD_TITLE + " only: " + title
        expl = [convention_only, summary] + expl
    else:
        expl = [summary] + expl
    for extra in (stage_note, _empty_row_note(results)):
        if extra:
            expl.append(extra)
    hints = _hints(results, fails, features, mistakes if exact else (), cands,
                   standard_ok)
    if standard_ok and convention_only is None:
        expl.append("Your prototype passes every trial of the standard convention "
                    "(d_k = d_v = d_model / h) but fails the general ones. If you wrote "
                    "it for that convention, check it with\n"
                    "    mhattn.check_prototype(fn, convention=\"standard\")")
    if hints:
        expl.append("\n".join("Hint: " + h for h in hints))
    return PrototypeReport(False, mistakes[0] if mistakes else None, title,
                           "\n\n".join(expl), results, exact=exact and best is not None,
                           candidates=candidates,
                           form=form, first_divergent_stage=stage, hints=hints,
                           mistakes=mistakes, standard_ok=standard_ok)


def _nonfinite_hints(results, fails, features, mistakes) -> List[str]:
    """Why outputs hold inf or nan where mhattn's are finite: on a trial with
    a mask or causal=True, a query row left with no key; elsewhere, an
    overflow.  Nothing when the mistakes named explain it."""
    if mistakes and "no_max_subtraction" not in mistakes:
        return []
    bad = [i for i in fails if results[i].status == "nonfinite"]
    masked = [i for i in bad if features and (features[i].get("a mask")
                                              or features[i].get("causal"))]
    hints = []
    if masked and not mistakes:
        hints.append(f"the outputs hold nan on trial "
                     f"{', '.join(results[i].name for i in masked)} (a mask or "
                     "causal=True): a query row whose keys are all blocked has only -inf "
                     "scores, and exp(-inf - (-inf)) is nan. "
                     "Check which keys each row may see (causal: key j <= i + T_k - T_q; "
                     "a boolean mask: True = may attend).")
    if len(masked) < len(bad):
        hints.append("some outputs hold inf or nan where the answer is finite: "
                     "an overflow, typically exp() of large scores without "
                     "subtracting the row max.")
    return hints


def _dims(shapes: str) -> Dict[str, str]:
    """A trial's sizes from its shapes text ("T=3, d_model=4, ..."); words
    without a value (an attention trial's "causal") are left out."""
    return dict(p.split("=", 1) for p in shapes.replace(" ", "").split(",") if "=" in p)


def _hints(results, fails, features, mistakes, cands, standard_ok) -> List[str]:
    """Patterns in the failing trials; ``mistakes`` are those that explain
    every trial, if any (then hints pointing elsewhere are left out)."""
    hints: List[str] = []
    failing = set(fails)
    n = len(results)
    if features:
        for feat in features[0]:
            having = {i for i, f in enumerate(features) if f[feat]}
            if having and having == failing and len(having) < n:
                hints.append(f"it fails exactly on the trials with {feat}.")
    returned = [results[i] for i in fails if results[i].status == "returned"]
    if returned:
        hints.append(f"on {len(returned)} of {n} trials your function raised nothing but "
                     f"returned no output array, first on {returned[0].name} "
                     f"({returned[0].shapes}): {returned[0].error}.")
    raised = [results[i] for i in fails if results[i].status == "raised"]
    if raised:
        hints.append(f"your function raised on {len(raised)} of {n} trials, first on "
                     f"{raised[0].name} ({raised[0].shapes}): {raised[0].error}.")
        # a transpose would make the shapes fit: a transposed re-enactment
        # raises the very same shape error on some trial
        transposes = {"projections_transposed", "wo_transposed"}
        if not mistakes or set(mistakes) & transposes:
            fit = any(c.names[0] in transposes and len(c.names) == 1 and
                      any(c.matches[i] and results[i].status == "raised" for i in fails)
                      for c in cands)
            if fit:
                hints.append("this shape error is the one a transposed matrix gives: "
                             "mhattn and the document use row vectors, Q = X W^Q with "
                             "W^Q (d_model, h*d_k), and Concat(...) W^O with W^O "
                             "(h*d_v, d_out).")
    for i in fails:
        r = results[i]
        if r.status == "shape" and r.got_shape and r.expected_shape and \
                len(r.got_shape) == 2 and "d_v=" in r.shapes:
            dims = _dims(r.shapes)
            if "T" not in dims:       # an attention trial: (T_q, d_v) is no layer's
                continue
            if r.got_shape == (int(dims["T"]), int(dims["d_v"])) and \
                    int(dims["d_v"]) != int(dims["d_out"]):
                hints.append(f"your output on {r.name} is (T, d_v) = {r.got_shape}: one "
                             "head's width, so the heads were combined without Concat "
                             "(summed or averaged).")
                break
    for i in fails:
        st = results[i].stages
        if st is None:
            continue
        try:
            row = st["concat"]
        except KeyError:
            continue
        if row.ok is False and row.other_shape and "d_k=" in results[i].shapes:
            dims = _dims(results[i].shapes)
            hk = int(dims["h"]) * int(dims["d_k"])
            if hk != int(dims["h"]) * int(dims["d_v"]) and row.other_shape.endswith(
                    f", {hk})"):
                hints.append(f"your concatenation on {results[i].name} is h*d_k = {hk} "
                             "wide: V was sliced with d_k.")
                break
    hints += _nonfinite_hints(results, fails, features, mistakes)
    if standard_ok:
        hints.append("it passes the standard convention's trials (d_k = d_v = d_model/h): "
                     "try convention=\"standard\".")
    return hints


# --------------------------------------------------------------------------
# The public checks
# --------------------------------------------------------------------------

def _check_common(dtype, trials, seed) -> np.dtype:
    """The checks' shared arguments, each named in its error: the trials'
    dtype, their number and the seed they are drawn from."""
    try:
        dtype = np.dtype(dtype)
    except (TypeError, ValueError):
        raise TypeError(f"dtype: expected float32 or float64, got {dtype!r}") from None
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"dtype: expected float32 or float64, got {dtype}")
    for name, value in (("trials", trials), ("seed", seed)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}: expected a non-negative integer, got {value!r} "
                            f"({type(value).__name__})")
        if value < 0:
            raise ValueError(f"{name}: expected a non-negative integer, got {value!r}")
    # Every trial, its result and its re-enactments are kept until the report
    # is built: the whole need is checked before the first one is drawn.
    check_memory([(f"trials={int(trials)}", "(trials + 7)*bytes per trial",
                   (int(trials) + 7, _TRIAL_BYTES), 1)])
    return dtype


def _tolerances(steps: List[_steps.Step], starts: List[Dict[str, Any]],
                dtype: np.dtype) -> List[float]:
    """Each trial's normwise relative tolerance: float64 1e-7; float32 the
    bound of :mod:`mhattn.learn.rounding` on that trial's inputs (how far two
    correct float32 computations can be apart), never below float64's."""
    if dtype == np.float64:
        return [1e-7] * len(starts)
    return [max(_rounding.float32_tolerance(steps, st), 1e-7) for st in starts]


def _run_layer_trials(fn, cases, dtype, keywords):
    results: List[TrialResult] = []
    user_out: List[Any] = []
    tols = _tolerances(_layer_model(keywords), [_layer_start(t) for t in cases], dtype)
    for t, tol in zip(cases, tols):
        want = multi_head_attention(*t.args[:5], num_heads=t.num_heads, **t.kwargs)
        got, inter = _run(fn, t.args, t.kwargs, want.shape,
                          f"the output array of shape (T, d_out) = {want.shape}")
        got, note = _settle_empty_rows(got, want, t.kwargs.get("mask"))
        user_out.append(got)
        r = TrialResult(t.name, t.about, t.shapes(), "ok", expected_shape=want.shape,
                        note=note)
        _compare_result(r, got, want, tol)
        if inter is not None:
            given = {k: v for k, v in inter.items() if canonical_key(k) is not None}
            if given:
                ref = trace(*t.args[:5], num_heads=t.num_heads, **t.kwargs)
                # float32: no tighter than the trial's rounding bound (the
                # output's, normwise; the intermediates are O(1) and feed it)
                rtol, atol = ((max(1e-4, tol), max(1e-5, tol)) if dtype == np.float32
                              else (1e-7, 1e-9))
                r.stages = ref.compare(given, rtol=rtol, atol=atol)
        results.append(r)
    return results, user_out, tols


def check_prototype(fn: Callable, *, trials: int = 4, dtype=np.float64,
                    seed: int = 0, convention: str = "general") -> "PrototypeReport":
    """Check a multi-head attention prototype against mhattn; name its mistakes.

    check_prototype(fn, *, trials=4, dtype=np.float64, seed=0, convention="general")
        -> PrototypeReport

    ``fn(x, w_q, w_k, w_v, w_o, num_heads)`` gets x (T, d_model) and fused
    2-D weights: w_q and w_k (d_model, h*d_k), w_v (d_model, h*d_v) with head
    i owning columns [i*d, (i+1)*d), and w_o (h*d_v, d_out).  It returns the
    output (T, d_out); or a dict of intermediates, whose 'output' (or 'out')
    is the output and whose other known keys ('q', 'k', 'v', 'raw_scores',
    'scores', 'weights', 'heads', 'concat' and the aliases of
    :meth:`mhattn.Trace.compare`; per-head arrays stacked (h, T, d), fused
    (T, h*d) or as a list) are compared with :func:`mhattn.trace`; or a
    tuple (output, weights).

    Parameters
    ----------
    fn : callable
        The prototype.  When its signature takes a ``mask``, ``causal`` or
        ``rope`` keyword (a parameter of that name, or ``**kwargs``), a trial
        with a boolean mask (True = may attend), ``causal=True`` or
        ``rope=mhattn.RoPE(theta=10.0)`` is added, and the mask or RoPE
        mistakes are searched for too; otherwise it is never passed one.
        Taking ``mask`` also adds a trial whose mask leaves one query row
        with no key: mhattn's answer there is 0, and a NaN there (what
        exp(-inf - (-inf)) gives) is accepted too.  Taking both ``q_norm``
        and ``k_norm`` adds a trial with (d_k,) RMSNorm weights for each
        (mhattn's q/k norm, eps 1e-6, applied per head after the split and
        before RoPE), and the norm's mistakes.
    trials : int, default 4
        How many random configurations to add to the designed ones.
    dtype : np.float64 (default) or np.float32
        The trials' dtype; the tolerance follows it (float64: 1e-7
        relative; float32: a bound of float32's rounding error derived from
        each trial's inputs, see :mod:`mhattn.learn.rounding`).
    seed : int, default 0
        The seed the inputs of every trial are drawn from.
    convention : "general" (default) or "standard"
        "general" tests any widths, d_k != d_v and d_model != h*d_k
        included; "standard" only d_k = d_v = d_model / h, for prototypes
        written to that convention.  When a prototype fails only general
        trials (d_model != h*d_k or d_k != d_v) and passes the standard
        ones, the report's title says so.

    Returns
    -------
    PrototypeReport
        ``.ok``, ``.mistake`` (the first named), ``.mistakes`` (all named),
        ``.title``, ``.explanation``, ``.paragraphs``, ``.hints``,
        ``.float32_rounding``, ``.trials`` (each with ``.matching``);
        ``print(report)`` gives plain text, and Jupyter renders it as HTML.

    Notes
    -----
    It runs on the designed configurations — the document's worked example
    (w_q = concat(W_Q1, W_Q2), W^O = I), d_k != d_v with three heads and a
    non-square W^O, four heads with square weights, d_k != d_v with a square
    W^O, and inputs so large that exp() of the raw scores overflows — plus
    ``trials`` random ones, all in ``dtype`` and drawn from ``seed``.

    When the outputs differ from :func:`mhattn.multi_head_attention`, the
    reference is re-enacted as its steps (project, split heads, scores,
    [RoPE], scale, [mask], row max, softmax, weights @ V, merge heads, W^O) with every single
    known mistake (see ``mhattn.checker.MISTAKES``) and every pair of them at two
    different steps substituted, and the substitution matching the
    prototype on every trial is named (a single before a pair); failing
    that, the one explaining the most failing trials that tell the
    candidates apart.  An exception matches only the same exception type
    raised by the same operation (the sizes in its message).  When every
    differing trial agrees to float32 rounding, the report says so instead.

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
    if not isinstance(convention, str):
        raise TypeError(f"convention: expected 'general' or 'standard', got "
                        f"{type(convention).__name__}")
    if convention not in ("general", "standard"):
        raise ValueError(f"convention: expected 'general' or 'standard', got {convention!r}")
    dtype = _check_common(dtype, trials, seed)
    seed = int(seed)
    keywords = [k for k in ("mask", "causal", "rope") if _accepts(fn, k)]
    if _accepts(fn, "q_norm") and _accepts(fn, "k_norm"):
        keywords.append("q_norm")
    cases = _trials(int(trials), dtype, seed, convention, keywords)
    results, user_out, tol = _run_layer_trials(fn, cases, dtype, keywords)
    standard_ok = None
    if convention == "general" and not all(r.ok for r in results):
        std = _trials(int(trials), dtype, seed, "standard", keywords)
        standard_ok = all(r.ok for r in _run_layer_trials(fn, std, dtype, keywords)[0])
    return _diagnose("layer", results, user_out, _layer_model(keywords),
                     [_layer_start(t) for t in cases], tol, dtype, standard_ok,
                     convention, [t.features() for t in cases])


# ------------------------------------------------------------ attention alone

@dataclass
class _AttnTrial:
    name: str
    about: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    kwargs: Dict[str, Any] = field(default_factory=dict)

    def shapes(self) -> str:
        h, tq, dk = self.q.shape
        return (f"h={h}, T_q={tq}, T_k={self.k.shape[1]}, d_k={dk}, "
                f"d_v={self.v.shape[2]}" + (", mask" if "mask" in self.kwargs else "")
                + (", causal" if self.kwargs.get("causal") else ""))

    def features(self) -> Dict[str, bool]:
        h, tq, dk = self.q.shape
        return {"d_k != d_v": dk != self.v.shape[2], "T_q != T_k": tq != self.k.shape[1],
                "a mask": "mask" in self.kwargs, "causal": bool(self.kwargs.get("causal"))}


def _attention_trials(n_random: int, dtype, seed: int, keywords) -> List[_AttnTrial]:
    rng = np.random.default_rng(seed)

    def make(name, about, h, tq, tk, dk, dv, gain=1.5):
        return _AttnTrial(name, about,
                          (rng.standard_normal((h, tq, dk)) * gain).astype(dtype),
                          (rng.standard_normal((h, tk, dk)) * gain).astype(dtype),
                          rng.standard_normal((h, tk, dv)).astype(dtype))
    out = [make("square", "T_q = T_k, d_k = d_v", 2, 4, 4, 3, 3),
           make("dk_ne_dv", "T_q != T_k, d_k != d_v, three heads", 3, 3, 5, 2, 4),
           make("one_query", "a single query row (decode)", 2, 1, 6, 4, 2)]
    big = make("large_inputs", "", 2, 3, 4, 3, 3)
    big.q = (big.q * 40).astype(dtype)
    big.k = (big.k * 40).astype(dtype)
    big.about = "scores far beyond exp's range: the answer is finite, naive exp is not"
    out.append(big)
    for i in range(n_random):
        h, tq, tk = (int(rng.integers(1, 5)), int(rng.integers(1, 6)),
                     int(rng.integers(2, 7)))
        out.append(make(f"random_{i + 1}", "random shapes", h, tq, tk,
                        int(rng.integers(1, 5)), int(rng.integers(1, 5))))
    if "mask" in keywords:
        t = make("mask", "a boolean mask (True = may attend), T_q != T_k", 2, 4, 6, 3, 2)
        m = rng.random((4, 6)) < 0.6
        m[np.arange(4), rng.integers(0, 6, 4)] = True
        t.kwargs = {"mask": m}
        out.append(t)
    if "causal" in keywords:
        t = make("causal", "causal=True with more keys than queries", 2, 3, 6, 3, 3)
        t.kwargs = {"causal": True}
        out.append(t)
    if "softcap" in keywords:
        t = make("softcap", "softcap=2.0" + (" with a mask" if "mask" in keywords else ""),
                 2, 4, 5, 3, 3, gain=2.0)
        t.kwargs = {"softcap": 2.0}
        if "mask" in keywords:
            m = rng.random((4, 5)) < 0.5
            m[:, 0] = True
            t.kwargs["mask"] = m
        out.append(t)
    if "rope" in keywords:
        from .._internal.variants import RoPE
        t = make("rope", "rope=mhattn.RoPE(theta=10.0), 2 queries after 5 keys (a cache)",
                 2, 2, 5, 4, 2)
        t.kwargs = {"rope": RoPE(theta=10.0)}
        out.append(t)
    if "sinks" in keywords:
        t = make("sinks", "sinks=[0.5, -1.0] (one logit per head, denominator only)",
                 2, 3, 4, 3, 2)
        t.kwargs = {"sinks": np.array([0.5, -1.0])}
        out.append(t)
    if "mask" in keywords:
        # last, so that the other trials are drawn as before
        t = make("mask_empty_row", _EMPTY_ROW_ABOUT, 2, 4, 6, 3, 2)
        t.kwargs = {"mask": _empty_row_mask(rng, 4, 6)}
        out.append(t)
    return out


def _attention_reference(t: _AttnTrial) -> np.ndarray:
    """mhattn.attention's answer; with ``rope``, q and k turned first by
    mhattn.reference.rope (queries at the last T_q of the T_k positions)."""
    kw = dict(t.kwargs)
    r = kw.pop("rope", None)
    q, k = t.q, t.k
    if r is not None:
        from ..reference import rope as _turn
        tq, tk, d = q.shape[1], k.shape[1], q.shape[2]
        f = r.frequencies(d)
        q = np.stack([_turn(a, np.arange(tq) + tk - tq, f, d, r.interleaved) for a in q])
        k = np.stack([_turn(a, np.arange(tk), f, d, r.interleaved) for a in k])
    return _attention(q, k, t.v, **kw)


def check_attention_prototype(fn: Callable, *, trials: int = 4, dtype=np.float64,
                              seed: int = 0) -> "PrototypeReport":
    """Check a scaled dot-product attention prototype against mhattn.attention.

    check_attention_prototype(fn, *, trials=4, dtype=np.float64, seed=0)
        -> PrototypeReport

    ``fn(q, k, v, mask=None)`` gets one sequence's projected heads, q
    (h, T_q, d_k), k (h, T_k, d_k), v (h, T_k, d_v), and returns
    softmax(q k^T / sqrt(d_k)) v per head, (h, T_q, d_v).  When its signature
    takes ``mask`` (or ``causal``, ``softcap``, ``sinks``, ``rope``) a trial passes a
    boolean mask (T_q, T_k), True = may attend (or ``causal=True``,
    bottom-right aligned: query i sees keys j <= i + T_k - T_q;
    ``softcap=2.0``, with a mask when ``mask`` is taken too; ``sinks`` of
    shape (h,); ``rope=mhattn.RoPE(theta=10.0)`` with 2 queries after 5
    keys, q and k not yet turned: the queries sit at positions
    i + T_k - T_q).  Taking ``mask`` also adds a trial whose mask leaves one
    query row with no key.  The answer is :func:`mhattn.attention`'s; a
    fully masked row's answer is 0 (a NaN there is accepted too).

    The diagnosis is :func:`check_prototype`'s, with the attention steps
    only (scores, scale, mask, row max, softmax, weights @ V): every single mistake
    and every pair, among 'rope_not_offset', 'rope_on_v', 'rope_pairing_wrong',
    'no_scaling', 'scale_by_dk', 'scale_by_sqrt_dv',
    'scale_after_softmax', 'softcap_after_mask', 'mask_inverted',
    'mask_after_softmax', 'mask_large_negative', 'causal_top_left',
    'causal_blocks_self', 'causal_sees_next', 'softmax_wrong_axis',
    'no_max_subtraction', 'softmax_over_heads', 'softmax_whole_matrix',
    'sink_in_numerator', 'weights_transposed'.

    Parameters
    ----------
    fn : callable
    trials : int, default 4
        Random configurations added to the designed ones.
    dtype : np.float64 (default) or np.float32
    seed : int, default 0

    Returns
    -------
    PrototypeReport

    Examples
    --------
    >>> def attend(q, k, v, mask=None):
    ...     s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    ...     if mask is not None:
    ...         s = np.where(mask, s, -np.inf)
    ...     w = np.exp(s - s.max(axis=-1, keepdims=True))
    ...     return (w / w.sum(axis=-1, keepdims=True)) @ v
    >>> mhattn.check_attention_prototype(attend).ok
    True
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable fn(q, k, v, mask=None), "
                        f"got {type(fn).__name__}")
    dtype = _check_common(dtype, trials, seed)
    seed = int(seed)
    keywords = [k for k in ("mask", "causal", "softcap", "sinks", "rope")
                if _accepts(fn, k)]
    cases = _attention_trials(int(trials), dtype, seed, keywords)
    steps = _steps.attention_steps("mask" in keywords, "causal" in keywords,
                                   "softcap" in keywords, "sinks" in keywords,
                                   "rope" in keywords)
    starts = [dict(q=list(t.q), k=list(t.k), v=list(t.v), dtype=t.q.dtype,
                   mask=t.kwargs.get("mask"), causal=bool(t.kwargs.get("causal")),
                   softcap=t.kwargs.get("softcap"), sinks=t.kwargs.get("sinks"),
                   rope=t.kwargs.get("rope")) for t in cases]
    tol = _tolerances(steps, starts, dtype)
    results: List[TrialResult] = []
    user_out: List[Any] = []
    for t, t_tol in zip(cases, tol):
        want = _attention_reference(t)
        got, _ = _run(fn, (t.q, t.k, t.v), t.kwargs, want.shape,
                      f"the output array of shape (h, T_q, d_v) = {want.shape}")
        got, note = _settle_empty_rows(got, want, t.kwargs.get("mask"))
        user_out.append(got)
        r = TrialResult(t.name, t.about, t.shapes(), "ok", expected_shape=want.shape,
                        note=note)
        _compare_result(r, got, want, t_tol)
        results.append(r)
    return _diagnose("attention", results, user_out, steps, starts, tol, dtype, None,
                     "general", [t.features() for t in cases])


def _variant_fn(steps_fn, step_i: int, alt: Optional[Callable]) -> Callable:
    def reenact(x, w_q, w_k, w_v, w_o, h):
        steps = steps_fn()
        start = _layer_start(_Trial("", "", x, w_q, w_k, w_v, w_o, h))
        out, _ = _steps.run(steps, start, {} if alt is None else {step_i: alt})
        if isinstance(out, _steps.Raised):
            raise out.exc
        return out
    return reenact


def _reenact(args, mistake: Optional[str] = None) -> np.ndarray:
    """The step model's output on a layer trial's ``args``, with the first
    form of ``mistake`` (None: the correct computation)."""
    steps = _steps.layer_steps()
    for i, step in enumerate(steps):
        for name, _, alt in step.wrong:
            if name == mistake:
                return _variant_fn(_steps.layer_steps, i, alt)(*args)
    if mistake is not None:
        raise KeyError(mistake)
    return _variant_fn(_steps.layer_steps, 0, None)(*args)


#: (mistake, how it was written, re-enactment fn(x, w_q, w_k, w_v, w_o, h)):
#: every single substitution of the step model of check_prototype.
VARIANTS: List[Tuple[str, str, Callable]] = [
    (name, form, _variant_fn(_steps.layer_steps, i, alt))
    for i, step in enumerate(_steps.layer_steps()) for name, form, alt in step.wrong]


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
        Patterns in the failing trials (shapes they share, exceptions,
        output shapes), each one sentence.
    mistakes : tuple of str
        Every mistake named: one, or two for a pair (in step order); ().
    paragraphs : list of (kind, text)
        The explanation in written order, kind "prose" (one paragraph, no
        hard line breaks) or "code" (lines without their four-space
        indent), for renderers; the hints are not repeated there.
    float32_rounding : bool
        Every differing trial agrees with mhattn to float32 rounding.
    standard_ok : bool or None
        With the general convention and a failing prototype: whether it
        passes every trial of the standard one (d_k = d_v = d_model / h).
    trials : list of TrialResult
        Each with ``.matching``: the mistakes (a pair as 'a + b') matching
        that trial, empty on passing trials.
    """

    def __init__(self, ok: bool, mistake: Optional[str], title: str, explanation: str,
                 trials: List[TrialResult], *, exact: bool = False,
                 candidates: Optional[List[str]] = None, form: Optional[str] = None,
                 first_divergent_stage: Optional[str] = None,
                 hints: Optional[List[str]] = None,
                 mistakes: Optional[Tuple[str, ...]] = None,
                 float32_rounding: bool = False, standard_ok: Optional[bool] = None):
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
        self.mistakes = tuple(mistakes) if mistakes else ((mistake,) if mistake else ())
        self.float32_rounding = bool(float32_rounding)
        self.standard_ok = standard_ok
        self.paragraphs = _paragraphs(explanation)

    # ------------------------------------------------------------ display
    def __str__(self) -> str:
        head = ("check_prototype: OK - " if self.ok else "check_prototype: ") + self.title
        if self.mistakes:
            head += f"  [mistake{'s' if len(self.mistakes) > 1 else ''}: " \
                    f"{', '.join(self.mistakes)}]"
        lines = [head, "", self.explanation, "", "Trials:"]
        width = max(len(r.name) for r in self.trials)
        for r in self.trials:
            line = f"  {r.name:<{width}}  {r.shapes:<52}  {r.describe()}"
            lines.append(line)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        from .html import report_html
        return report_html(self)


def _is_shape_error_text(text: Optional[str]) -> bool:
    if not text:
        return False
    low = text.lower()
    return low.startswith(("valueerror", "indexerror")) and any(
        w in low for w in ("shape", "matmul", "align", "broadcast", "dimension"))

