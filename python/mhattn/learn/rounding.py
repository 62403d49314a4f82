"""How far float32 rounding can move attention's output: the checker's float32 tolerance.

A correct float32 prototype and mhattn compute the same thing in different
orders, so their outputs differ by rounding only.  Rather than a fixed
number, the tolerance of a trial is a first-order bound of that rounding,
derived from the trial's own inputs by the standard forward error analysis
(Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 3): a dot
product of n terms, summed in any order, is within gamma(n) = n u / (1 - n u)
of the exact one, relative to the sum of the terms' magnitudes, where
u = 2^-24 is float32's unit roundoff.  The bound follows the reference
computation step by step (the exact values come from the step model run in
float64 on the trial's inputs)::

    * projections Q = X W: |dQ| <= gamma(d_model + 2) |X| |W| (the +2: inputs
      that were themselves rounded to float32);
    * q/k norm y = w q / rms(q): its Jacobian has norm <= max|w| / rms(q), so
      |dy_i| <= max|w| ||dq||_2 / rms(q) + gamma(d_k + 5) |y_i|;
    * RoPE: a rotation mixes each feature with its partner, so the partner's
      error and magnitude add, plus a few u for the product and cos, sin;
    * scores S = q k^T / sqrt(d_k): |dS| <= (|dq| |k|^T + |q| |dk|^T
      + gamma(d_k + 2) |q| |k|^T) / sqrt(d_k); a softcap c tanh(S / c) passes
      dS on (its slope is at most 1) and rounds by a few u (|S| + c);
    * softmax: dw_i = w_i (dS_i - sum_j w_j dS_j), so |dw_i| <= w_i (dS_i (1 - w_i)
      + sum_{j != i} w_j dS_j), which stays small where a row is nearly one-hot
      (the large-input trial), plus w_i (u |S_i - max S| + gamma(T_k + 5)) for
      exp of the shifted score, the sum and the division; masked keys are -inf
      in both computations and add nothing;
    * heads o = w V: |do| <= |dw| |V| + w |dV| + gamma(T_k) w |V|; the output
      Concat(o) W^O: |dout| <= |dz| |W^O| + gamma(h d_v + 1) |z| |W^O|.

Each computation (the prototype's and mhattn's) is within that bound B of
the exact output, so they differ by at most 2 B; a further factor 2 covers
the second-order terms dropped above and exp, tanh and sqrt that are not
correctly rounded (within a few ulp).  The tolerance is 4 max(B) / max|out|,
normwise relative like the comparison it feeds.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np

from . import steps as _steps

#: float32's unit roundoff
U32 = 2.0 ** -24
#: two computations, each within the bound; x2 for what first order drops
SAFETY = 4.0


def _gamma(n: int) -> float:
    return n * U32 / (1.0 - n * U32)


def _as64(v: Any) -> Any:
    if isinstance(v, np.ndarray) and v.dtype.kind == "f":
        return v.astype(np.float64)
    if isinstance(v, list):
        return [_as64(a) for a in v]
    return v


def _heads(a: np.ndarray, h: int) -> List[np.ndarray]:
    d = a.shape[1] // h
    return [a[:, i * d:(i + 1) * d] for i in range(h)]


def _projected(st: Dict[str, Any]) -> Dict[str, Any]:
    """(magnitude, error bound) per head of q, k, v after the projections."""
    x, h = np.abs(st["x"]), st["h"]
    g = _gamma(st["x"].shape[1] + 2)
    out = {}
    for side in ("q", "k", "v"):
        m = x @ np.abs(st["w_" + side])
        out[side] = (_heads(m, h), _heads(g * m, h))
    return out


def _normed(bounds, before: Dict[str, Any], after: Dict[str, Any], start) -> None:
    """The q/k norm's error: through its Jacobian, plus its own rounding."""
    for side in ("q", "k"):
        w = start.get(side + "_norm")
        if w is None:
            continue
        wmax = float(np.max(np.abs(w)))
        mags, errs = [], []
        for a, y, e in zip(before[side], after[side], bounds[side][1]):
            r = np.sqrt((a * a).mean(-1, keepdims=True) + start.get("norm_eps", 1e-6))
            de = np.sqrt((e * e).sum(-1, keepdims=True))
            mags.append(np.abs(y))
            errs.append(wmax * de / r + _gamma(a.shape[-1] + 5) * np.abs(y))
        bounds[side] = (mags, errs)


def _rotated(bounds, rope) -> None:
    """RoPE mixes each feature with its partner: errors and magnitudes add."""
    for side in ("q", "k"):
        mags, errs = bounds[side]
        d = mags[0].shape[-1]
        half = d // 2
        perm = np.arange(d)
        c = np.arange(half)
        ia, ib = (2 * c, 2 * c + 1) if rope.interleaved else (c, c + half)
        perm[ia], perm[ib] = ib, ia
        mags2 = [m + m[:, perm] for m in mags]
        bounds[side] = (mags2, [e + e[:, perm] + 8 * U32 * m
                                for e, m in zip(errs, mags2)])


def _softmax_error(s: np.ndarray, w: np.ndarray, ds: np.ndarray) -> np.ndarray:
    """|dw| from score errors ``ds`` and the softmax's own rounding."""
    live = np.isfinite(s)
    ds = np.where(live, ds, 0.0)
    m = np.max(np.where(live, s, -np.inf), axis=-1, keepdims=True)
    shift = np.where(live, np.abs(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    wd = w * ds
    spread = ds * (1.0 - w) + wd.sum(-1, keepdims=True) - wd
    return w * (spread + U32 * shift + _gamma(s.shape[-1] + 5))


def float32_tolerance(steps: Sequence[_steps.Step], start: Dict[str, Any]) -> float:
    """The normwise relative tolerance of a float32 trial: how far two correct
    float32 computations of ``steps`` (the correct model) on ``start`` can be
    apart, by the bound in this module's docstring."""
    st64 = {k: _as64(v) for k, v in start.items()}
    st64["dtype"] = np.dtype(np.float64)
    out, states = _steps.run(steps, st64, {}, keep=True)
    if isinstance(out, _steps.Raised):
        return np.inf
    names = [s.name for s in steps]
    at = {n: states[i] for i, n in enumerate(names)}      # the state before each step
    if "project" in at:
        bounds = _projected(st64)
    else:
        bounds = {side: ([np.abs(a) for a in st64[side]],
                         [U32 * np.abs(a) for a in st64[side]]) for side in ("q", "k", "v")}
    if "q/k norm" in at:
        after = states[names.index("q/k norm") + 1]
        _normed(bounds, at["q/k norm"], after, st64)
    if "RoPE" in at and st64.get("rope") is not None:
        _rotated(bounds, st64["rope"])
    (qm, qe), (km, ke), (vm, ve) = bounds["q"], bounds["k"], bounds["v"]
    cap = st64.get("softcap")
    heads, head_errs = [], []
    for i in range(len(qm)):
        dk = qm[i].shape[-1]
        sc = 1.0 / np.sqrt(dk)
        ds = sc * (qe[i] @ km[i].T + qm[i] @ ke[i].T + _gamma(dk + 2) * (qm[i] @ km[i].T))
        if cap is not None and "softcap" in at:
            ds = ds + 4 * U32 * (np.abs(at["softcap"]["s"][i]) + abs(cap))
        s, w = at["softmax"]["s"][i], at["weights @ V"]["w"][i]
        dw = _softmax_error(s, w, ds)
        heads.append(w @ vm[i])
        head_errs.append(dw @ vm[i] + w @ ve[i] + _gamma(w.shape[-1]) * heads[-1])
    if "W^O" in at:
        wo = np.abs(st64["w_o"])
        z, dz = np.concatenate(heads, axis=-1), np.concatenate(head_errs, axis=-1)
        bound = dz @ wo + _gamma(z.shape[-1] + 1) * (z @ wo)
    else:
        bound = np.stack(head_errs)
    ref = np.abs(out[np.isfinite(out)])
    top = float(ref.max()) if ref.size else 0.0
    return SAFETY * float(np.max(bound)) / max(top, 1e-300)
