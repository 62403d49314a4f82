"""The reference computation as steps, each with its known wrong alternatives.

:func:`mhattn.check_prototype` and :func:`mhattn.check_attention_prototype`
re-enact a learner's prototype as the reference pipeline with one or two of
its steps swapped for a known mistake.  A *state* is a dict of the arrays
computed so far; a step reads it and returns a new one (never mutating the
arrays it was given), so that the states of the correct run can be kept and
a substitution at step i re-runs only steps i, i+1, ...

Per-head arrays are lists of 2-D arrays (one per head), so that a mistake
that changes a head's shape (np.split along the tokens, V sliced with d_k)
is still a state the later steps can run on, or fail on as the learner's
code would.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import mistakes as _mistakes

State = Dict[str, Any]
StepFn = Callable[[State], State]


def _new(st: State, **kw) -> State:
    out = dict(st)
    out.update(kw)
    return out


def _f(st: State, value: float):
    """A Python float as the computation's dtype (as the learner's np.sqrt would)."""
    return st["dtype"].type(value)


# ------------------------------------------------------------------ project
def project(st: State) -> State:
    x = st["x"]
    return _new(st, Q=x @ st["w_q"], K=x @ st["w_k"], V=x @ st["w_v"])


def project_transposed(st: State) -> State:
    x = st["x"]
    return _new(st, Q=x @ st["w_q"].T, K=x @ st["w_k"].T, V=x @ st["w_v"].T)


def project_v_with_wk(st: State) -> State:
    """V = X W^K, sliced into heads as K is (the k line copied)."""
    x = st["x"]
    return _new(st, Q=x @ st["w_q"], K=x @ st["w_k"], V=x @ st["w_k"], v_is_k=True)


# ------------------------------------------------------------------ split
def _slices(a: np.ndarray, h: int, d: int, same: bool = False) -> List[np.ndarray]:
    return [a[:, (0 if same else i) * d:((0 if same else i) + 1) * d] for i in range(h)]


def split(st: State) -> State:
    h = st["h"]
    dk, dv = st["w_q"].shape[1] // h, st["w_v"].shape[1] // h
    if st.get("v_is_k"):
        dv = dk
    return _new(st, q=_slices(st["Q"], h, dk), k=_slices(st["K"], h, dk),
                v=_slices(st["V"], h, dv), dk_scale=dk)


def split_same_head(st: State) -> State:
    h = st["h"]
    dk, dv = st["w_q"].shape[1] // h, st["w_v"].shape[1] // h
    return _new(st, q=_slices(st["Q"], h, dk, True), k=_slices(st["K"], h, dk, True),
                v=_slices(st["V"], h, dv, True), dk_scale=dk)


def split_sequence(st: State) -> State:
    """np.split(Q, h) along the tokens: every 'head' is a block of rows."""
    h = st["h"]
    dk = st["w_q"].shape[1] // h
    return _new(st, q=np.split(st["Q"], h, axis=0), k=np.split(st["K"], h, axis=0),
                v=np.split(st["V"], h, axis=0), dk_scale=dk, rows=True)


def _reshape_h_first(a: np.ndarray, h: int) -> List[np.ndarray]:
    T = a.shape[0]
    return list(a.reshape(h, T, -1))


def split_reshape_h_first(st: State) -> State:
    h = st["h"]
    dk = st["w_q"].shape[1] // h
    return _new(st, q=_reshape_h_first(st["Q"], h), k=_reshape_h_first(st["K"], h),
                v=_reshape_h_first(st["V"], h), dk_scale=dk)


def split_reshape_both(st: State) -> State:
    """reshape(h, T, d) at the split and reshape(T, h*d) at the merge."""
    return _new(split_reshape_h_first(st), merge_h_first=True)


def split_dk_from_dmodel(st: State) -> State:
    h = st["h"]
    d = st["x"].shape[1] // h
    return _new(st, q=_slices(st["Q"], h, d), k=_slices(st["K"], h, d),
                v=_slices(st["V"], h, d), dk_scale=d)


def split_v_with_dk(st: State) -> State:
    h = st["h"]
    dk = st["w_q"].shape[1] // h
    return _new(st, q=_slices(st["Q"], h, dk), k=_slices(st["K"], h, dk),
                v=_slices(st["V"], h, dk), dk_scale=dk)


# ------------------------------------------------------------------ q/k norm (after the split)
def _qk_norm(st: State, weight: bool = True, center: bool = False,
             whole_row: bool = False) -> State:
    """RMSNorm of each head's q and k rows over d_k, times the (d_k,) weight
    (mhattn's q_norm / k_norm, eps norm_eps); the mistakes: over the whole
    projected row (every head at once), without the weight, or LayerNorm
    (the row's mean subtracted first)."""
    out = {}
    eps = st.get("norm_eps", 1e-6)
    for side in ("q", "k"):
        w = st.get(side + "_norm")
        if w is None:
            continue
        heads = [a.astype(np.float64) for a in st[side]]
        if center:
            heads = [a - a.mean(-1, keepdims=True) for a in heads]
        if whole_row:
            row = np.concatenate(heads, axis=1)
            r = np.sqrt((row * row).mean(-1, keepdims=True) + eps)
            rs = [r] * len(heads)
        else:
            rs = [np.sqrt((a * a).mean(-1, keepdims=True) + eps) for a in heads]
        out[side] = [(a / r * (w if weight else 1.0)).astype(b.dtype)
                     for a, r, b in zip(heads, rs, st[side])]
    return _new(st, **out) if out else st


def qk_norm(st: State) -> State:
    return _qk_norm(st)


def qk_norm_whole_row(st: State) -> State:
    return _qk_norm(st, whole_row=True)


def qk_norm_no_weight(st: State) -> State:
    return _qk_norm(st, weight=False)


def qk_norm_layernorm(st: State) -> State:
    return _qk_norm(st, center=True)


# ------------------------------------------------------------------ RoPE (after the split)
def _turn(a: np.ndarray, inv_freq: np.ndarray, interleaved: bool, offset: int = 0):
    d = a.shape[-1]
    half = d // 2
    c = np.arange(half)
    ia, ib = (2 * c, 2 * c + 1) if interleaved else (c, c + half)
    angle = (np.arange(a.shape[0]) + offset)[:, None] * inv_freq[None, :half]
    cos, sin = np.cos(angle), np.sin(angle)
    x = a.astype(np.float64)
    y = x.copy()
    y[:, ia] = x[:, ia] * cos - x[:, ib] * sin
    y[:, ib] = x[:, ia] * sin + x[:, ib] * cos
    return y.astype(a.dtype)


def _rope(st: State, interleaved=None, on_v: bool = False, offset: bool = True) -> State:
    """Queries at positions i + T_k - T_q (the last T_q of the keys'), keys at j."""
    r = st.get("rope")
    if r is None:
        return st
    il = r.interleaved if interleaved is None else interleaved
    f = r.frequencies(st["q"][0].shape[-1])
    off = st["k"][0].shape[0] - st["q"][0].shape[0] if offset else 0
    out = dict(q=[_turn(a, f, il, off) for a in st["q"]],
               k=[_turn(a, f, il) for a in st["k"]])
    if on_v:
        out["v"] = [_turn(a, r.frequencies(a.shape[-1]), il) for a in st["v"]]
    return _new(st, **out)


def rope(st: State) -> State:
    return _rope(st)


def rope_on_v(st: State) -> State:
    return _rope(st, on_v=True)


def rope_not_offset(st: State) -> State:
    return _rope(st, offset=False)


def rope_pairing_swapped(st: State) -> State:
    r = st.get("rope")
    return _rope(st, interleaved=None if r is None else not r.interleaved)


# ------------------------------------------------------------------ softcap
def softcap(st: State) -> State:
    c = st.get("softcap")
    if c is None:
        return st
    c = _f(st, c)
    return _new(st, s=[c * np.tanh(s / c) for s in st["s"]])


def softcap_after_mask(st: State) -> State:
    return st if st.get("softcap") is None else _new(st, cap_late=st["softcap"])


def _final_scores(st: State) -> List[np.ndarray]:
    """The scores the softmax reads (a softcap put after the mask applied)."""
    c = st.get("cap_late")
    if c is None:
        return st["s"]
    c = _f(st, c)
    return [c * np.tanh(s / c) for s in st["s"]]


# ------------------------------------------------------------------ scores, scale
def scores(st: State) -> State:
    return _new(st, s=[q @ k.T for q, k in zip(st["q"], st["k"])])


def _scaled(st: State, factor: float) -> State:
    f = _f(st, factor)
    return _new(st, s=[s * f for s in st["s"]])


def _dk(st: State) -> int:
    return st.get("dk_scale") or st["q"][0].shape[-1]


def scale(st: State) -> State:
    return _scaled(st, 1.0 / np.sqrt(_dk(st)))


def scale_none(st: State) -> State:
    return st


def scale_dk(st: State) -> State:
    return _scaled(st, 1.0 / _dk(st))


def scale_sqrt_dmodel(st: State) -> State:
    return _scaled(st, 1.0 / np.sqrt(st["d_model"]))


def scale_sqrt_dv(st: State) -> State:
    return _scaled(st, 1.0 / np.sqrt(st["v"][0].shape[-1]))


def scale_dk_from_dmodel(st: State) -> State:
    return _scaled(st, 1.0 / np.sqrt(st["d_model"] // st["h"]))


def scale_after_softmax(st: State) -> State:
    return _new(st, post_scale=1.0 / np.sqrt(_dk(st)))


# ------------------------------------------------------------------ mask / causal
# A wrong mask can leave a query row with no key.  The learner's softmax,
# exp(s - s.max()), then gives NaN in that row (exp(-inf - (-inf))): the
# wrong masks mark the state "empty_nan", and the softmax steps do the same.
# (The checker also reads a prototype's 0 in such a row as that NaN.)
def _allowed(st: State, top_left: bool = False, shift: int = 0) -> Optional[np.ndarray]:
    """Which keys each query may see: the mask, and causal's j <= i + T_k - T_q
    (top-left: j <= i), moved by ``shift`` (-1: j < i; +1: j <= i + 1)."""
    Tq, Tk = st["s"][0].shape
    allowed = np.ones((Tq, Tk), dtype=bool)
    if st.get("mask") is not None:
        allowed &= np.broadcast_to(np.asarray(st["mask"], dtype=bool), (Tq, Tk))
    if st.get("causal"):
        off = (0 if top_left else Tk - Tq) + shift
        allowed &= np.arange(Tk)[None, :] <= np.arange(Tq)[:, None] + off
    return allowed


def _apply(st: State, allowed: np.ndarray, learner: bool = False) -> State:
    """The scores with -inf where a key is blocked; ``learner``: a row left
    with no key gives NaN in the softmax, as a learner's exp(s - s.max()) does."""
    ninf = _f(st, -np.inf)
    out = _new(st, s=[np.where(allowed, s, ninf) for s in st["s"]])
    return _new(out, empty_nan=True) if learner else out


def _masked(st: State) -> bool:
    return st.get("mask") is not None or bool(st.get("causal"))


def mask(st: State) -> State:
    if not _masked(st):
        return st
    return _apply(st, _allowed(st))


def mask_inverted(st: State) -> State:
    if not _masked(st):
        return st
    return _apply(st, ~_allowed(st), learner=True)


def mask_after_softmax(st: State) -> State:
    if not _masked(st):
        return st
    return _new(st, post_mask=_allowed(st))


def _mask_finite(st: State, fill: float, added: bool) -> State:
    """A finite stand-in for -inf: put in place of the blocked scores
    (np.where(allowed, s, fill)) or added to them (s + np.where(allowed, 0, fill))."""
    if not _masked(st):
        return st
    allowed = _allowed(st)
    f = _f(st, fill)
    if added:
        bias = np.where(allowed, _f(st, 0.0), f)
        return _new(st, s=[s + bias for s in st["s"]])
    return _new(st, s=[np.where(allowed, s, f) for s in st["s"]])


def mask_fill_finite(st: State) -> State:
    return _mask_finite(st, -1e9, added=False)


def mask_add_finite(st: State) -> State:
    return _mask_finite(st, -1e9, added=True)


def _causal(st: State, top_left: bool = False, shift: int = 0) -> State:
    if not st.get("causal"):
        return mask(st)
    return _apply(st, _allowed(st, top_left, shift), learner=True)


def causal_top_left(st: State) -> State:
    return _causal(st, top_left=True)


def causal_strict(st: State) -> State:
    """j < i + T_k - T_q: the diagonal blocked."""
    return _causal(st, shift=-1)


def causal_strict_top_left(st: State) -> State:
    """j < i: the diagonal blocked, and the triangle aligned top-left."""
    return _causal(st, top_left=True, shift=-1)


def causal_next(st: State) -> State:
    """j <= i + 1 + T_k - T_q: one future key seen."""
    return _causal(st, shift=1)


def causal_next_top_left(st: State) -> State:
    """j <= i + 1: one future key seen, aligned top-left."""
    return _causal(st, top_left=True, shift=1)


# ------------------------------------------------------------------ softmax
# The softmax is two steps, so that a mistake in each composes with one in
# the other: "row max" (whether the max is subtracted before exp) and
# "softmax" (the normalisation, over which axis; it reads the first's mark).
def row_max(st: State) -> State:
    return st


def row_max_skipped(st: State) -> State:
    return _new(st, no_max=True)


def _softmax(s: np.ndarray, axis=-1, no_max: bool = False,
             empty_nan: bool = False) -> np.ndarray:
    """Softmax along ``axis``; a row with no key (all -inf) gives 0, as in
    mhattn, or NaN with ``empty_nan``, as exp(s - s.max()) does."""
    if no_max:              # exp of the raw scores: overflows to inf/inf = nan
        e = np.exp(s)
        return e / e.sum(axis=axis, keepdims=True)
    m = np.max(s, axis=axis, keepdims=True)
    if empty_nan:
        e = np.exp(s - m)
        return (e / e.sum(axis=axis, keepdims=True)).astype(s.dtype)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    tot = e.sum(axis=axis, keepdims=True)
    return np.where(tot > 0, e / np.where(tot > 0, tot, 1), 0).astype(s.dtype)


def _finish(st: State, w: List[np.ndarray]) -> State:
    if st.get("post_mask") is not None:
        w = [np.where(st["post_mask"], a, 0).astype(a.dtype) for a in w]
    if st.get("post_scale") is not None:
        f = _f(st, st["post_scale"])
        w = [a * f for a in w]
    return _new(st, w=w)


def _sink_softmax(s: np.ndarray, sink: float, in_numerator: bool = False,
                  no_max: bool = False) -> np.ndarray:
    """Softmax with one extra logit ``sink`` per row in the denominator (and,
    the mistake, added to every numerator too)."""
    sk = s.dtype.type(sink)
    m = 0 if no_max else np.maximum(np.max(s, axis=-1, keepdims=True), sk)
    e = np.exp(s - m)
    es = np.exp(sk - m)
    tot = e.sum(axis=-1, keepdims=True) + es
    return (((e + es) if in_numerator else e) / tot).astype(s.dtype)


def _how(st: State) -> Dict[str, bool]:
    """The softmax's manner, set by earlier steps: no max subtracted, and a
    row with no key giving NaN."""
    return dict(no_max=bool(st.get("no_max")), empty_nan=bool(st.get("empty_nan")))


def softmax(st: State) -> State:
    sinks, nm = st.get("sinks"), bool(st.get("no_max"))
    if sinks is not None:
        return _finish(st, [_sink_softmax(s, sinks[i], no_max=nm)
                            for i, s in enumerate(_final_scores(st))])
    return _finish(st, [_softmax(s, **_how(st)) for s in _final_scores(st)])


def softmax_sink_in_numerator(st: State) -> State:
    sinks = st.get("sinks")
    if sinks is None:
        return softmax(st)
    return _finish(st, [_sink_softmax(s, sinks[i], True, bool(st.get("no_max")))
                        for i, s in enumerate(_final_scores(st))])


def softmax_axis0(st: State) -> State:
    return _finish(st, [_softmax(s, axis=0, **_how(st)) for s in _final_scores(st)])


def softmax_heads_axis(st: State) -> State:
    return _finish(st, list(_softmax(np.stack(_final_scores(st)), axis=0, **_how(st))))


def softmax_whole_matrix(st: State) -> State:
    return _finish(st, [_softmax(s, axis=None, **_how(st)) for s in _final_scores(st)])


# ------------------------------------------------------------------ weights @ V
def weights_v(st: State) -> State:
    return _new(st, o=[w @ v for w, v in zip(st["w"], st["v"])])


def weights_t_v(st: State) -> State:
    return _new(st, o=[w.T @ v for w, v in zip(st["w"], st["v"])])


# ------------------------------------------------------------------ merge
def merge(st: State) -> State:
    o = st["o"]
    if st.get("merge_h_first"):
        return merge_h_first(st)
    return _new(st, z=np.concatenate(o, axis=0 if st.get("rows") else -1))


def merge_h_first(st: State) -> State:
    stacked = np.stack(st["o"])                     # (h, T, d)
    return _new(st, z=stacked.reshape(stacked.shape[1], -1))


def merge_reversed(st: State) -> State:
    return _new(st, z=np.concatenate(st["o"][::-1], axis=0 if st.get("rows") else -1))


def merge_mean(st: State) -> State:
    return _new(st, z=np.mean(st["o"], axis=0), wo="skip")


def merge_mean_first_rows(st: State) -> State:
    return _new(st, z=np.mean(st["o"], axis=0), wo="first_rows")


def merge_mean_per_head_wo(st: State) -> State:
    # mean over i of head_i W^O_i == Concat(heads) W^O / h
    return _new(st, z=np.concatenate(st["o"], axis=-1) / _f(st, len(st["o"])))


def merge_sum(st: State) -> State:
    return _new(st, z=np.sum(st["o"], axis=0), wo="skip")


def merge_sum_first_rows(st: State) -> State:
    return _new(st, z=np.sum(st["o"], axis=0), wo="first_rows")


# ------------------------------------------------------------------ W^O
def out_proj(st: State) -> State:
    z, w_o = st["z"], st["w_o"]
    how = st.get("wo")
    if how == "skip":
        return _new(st, out=z)
    if how == "first_rows":
        return _new(st, out=z @ w_o[:z.shape[-1]])
    return _new(st, out=z @ w_o)


def out_skipped(st: State) -> State:
    return _new(st, out=st["z"])


def out_transposed(st: State) -> State:
    if st.get("wo") is not None:
        return out_proj(st)
    return _new(st, out=st["z"] @ st["w_o"].T)


def out_cut_to_fit(st: State) -> State:
    if st.get("wo") is not None:
        return out_proj(st)
    z = st["z"]
    return _new(st, out=z @ st["w_o"][:z.shape[-1]])


def stack_heads(st: State) -> State:
    """check_attention_prototype's output: the heads stacked (h, T_q, d_v)."""
    return _new(st, out=np.stack(st["o"]))


# ------------------------------------------------------------------ the model
class Step:
    """One step: its name, the trace stage it first writes, the correct
    function and its wrong alternatives (mistake id, how written, fn)."""

    def __init__(self, name: str, stage: str, fn: StepFn,
                 wrong: Sequence[Tuple[str, str, StepFn]]):
        self.name, self.stage, self.fn, self.wrong = name, stage, fn, list(wrong)


#: Each model's steps in order: (name, trace stage, correct function, the
#: feature without which the step is left out, None: always there).
MODEL_STEPS = {
    "layer": (("project", "q", project, None),
              ("split heads", "q", split, None),
              ("q/k norm", "q", qk_norm, "q_norm"),
              ("RoPE", "q", rope, "rope"),
              ("scores", "raw_scores", scores, None),
              ("scale", "scores", scale, None),
              ("mask", "scores", mask, "masked"),
              ("row max", "weights", row_max, None),
              ("softmax", "weights", softmax, None),
              ("weights @ V", "heads", weights_v, None),
              ("merge heads", "concat", merge, None),
              ("W^O", "output", out_proj, None)),
    "attention": (("RoPE", "q", rope, "rope"),
                  ("scores", "raw_scores", scores, None),
                  ("scale", "scores", scale, None),
                  ("softcap", "scores", softcap, None),
                  ("mask", "scores", mask, None),
                  ("row max", "weights", row_max, None),
                  ("softmax", "weights", softmax, None),
                  ("weights @ V", "heads", weights_v, None),
                  ("output", "output", stack_heads, None)),
}


def build_model(model: str, features: Sequence[str] = ()) -> List[Step]:
    """The steps of ``model`` ("layer" or "attention") for trials with
    ``features`` (see :data:`mhattn.learn.mistakes.FEATURES`), each with the
    wrong alternatives the mistake table gives it, in the table's order."""
    have = set(features)
    fns = globals()
    out = []
    for name, stage, fn, needs in MODEL_STEPS[model]:
        if needs is not None and needs not in have:
            continue
        wrong = [(m.id, f.written, fns[f.fn]) for m in _mistakes.TABLE for f in m.produce
                 if f.step == name and model in f.models and set(f.needs) <= have]
        out.append(Step(name, stage, fn, wrong))
    return out


def layer_steps(features: Sequence[str] = ()) -> List[Step]:
    """The steps of MultiHead(X) = Concat(head_1..head_h) W^O, in order."""
    return build_model("layer", features)


def attention_steps(with_mask: bool, with_causal: bool, with_softcap: bool = False,
                    with_sinks: bool = False, with_rope: bool = False) -> List[Step]:
    """The steps of softmax(q k^T / sqrt(d_k) [capped, masked]) v, per head."""
    flags = dict(masked=with_mask or with_causal, causal=with_causal,
                 softcap=with_softcap, sinks=with_sinks, rope=with_rope)
    return build_model("attention", [k for k, v in flags.items() if v])


def _check_table() -> None:
    """Every form names a function of this module and a step of one of its
    models (a form is produced in each of its models that has its step)."""
    for m in _mistakes.TABLE:
        for f in m.produce:
            if not callable(globals().get(f.fn)):
                raise ValueError(f"mistake {m.id!r}: no step function {f.fn!r}")
            if not any(f.step == s[0] for model in f.models for s in MODEL_STEPS[model]):
                raise ValueError(f"mistake {m.id!r}: no step {f.step!r} in {f.models}")


_check_table()


# ------------------------------------------------------------------ running
class Raised:
    """An exception raised by a step (or by the learner's function)."""

    def __init__(self, exc: BaseException, step: Optional[str] = None):
        self.exc, self.step = exc, step
        self.key = exception_key(exc)


def exception_key(exc: BaseException) -> tuple:
    """What must agree for two exceptions to be 'the same': the type and, for
    shape errors, the sizes the message names (the sizes identify the
    operation that failed, and so the step, whichever way it was written);
    for an error whose message names no size, the message."""
    msg = str(exc)
    sizes = tuple(sorted(set(int(n) for n in re.findall(r"\d+", msg))))
    if isinstance(exc, (ValueError, IndexError)) and sizes:
        return (type(exc).__name__, sizes)
    return (type(exc).__name__, msg)


def run(steps: Sequence[Step], start: State, choice: Dict[int, StepFn],
        from_step: int = 0, keep: bool = False):
    """Run steps[from_step:] on ``start`` with ``choice`` replacing some.

    Returns (output array or Raised, list of the states before each step run
    when ``keep``)."""
    st = start
    states: List[State] = []
    for i in range(from_step, len(steps)):
        if keep:
            states.append(st)
        fn = choice.get(i, steps[i].fn)
        try:
            with np.errstate(all="ignore"):
                st = fn(st)
        except Exception as exc:  # the step fails as the learner's code would
            return Raised(exc, steps[i].name), states
    out = st["out"]
    return np.asarray(out, dtype=np.float64), states
