"""The checker's float32 tolerance: derived per trial from float32's rounding
error (mhattn.learn.rounding), so that a correct float32 prototype passes
every trial, and a small real mistake still fails."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

import mhattn
from mhattn.learn import checker, rounding

CORPUS = Path(__file__).parent / "prototypes"


def _corpus(name):
    spec = importlib.util.spec_from_file_location(f"_f32_{name}", CORPUS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.prototype


def _f32_layer(x, w_q, w_k, w_v, w_o, num_heads, denominator_eps=0.0, dk_plus=0, root=0.5):
    """float32 throughout (np.float32 scalars, so NumPy 2 keeps float32);
    optionally a small planted mistake."""
    d_k = w_q.shape[1] // num_heads
    d_v = w_v.shape[1] // num_heads
    heads = []
    for i in range(num_heads):
        q = x @ w_q[:, i * d_k:(i + 1) * d_k]
        k = x @ w_k[:, i * d_k:(i + 1) * d_k]
        v = x @ w_v[:, i * d_v:(i + 1) * d_v]
        s = q @ k.T / np.float32((d_k + dk_plus) ** root)
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        heads.append(e / (e.sum(axis=-1, keepdims=True) + np.float32(denominator_eps)) @ v)
    return np.concatenate(heads, axis=-1) @ w_o


def _f32_attend(q, k, v, mask=None, causal=False):
    s = q @ k.transpose(0, 2, 1) / np.float32(np.sqrt(q.shape[-1]))
    tq, tk = s.shape[-2:]
    if causal:
        s = np.where(np.tri(tq, tk, tk - tq, dtype=bool), s, np.float32(-np.inf))
    if mask is not None:
        s = np.where(mask, s, np.float32(-np.inf))
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True) @ v


def test_correct_float32_prototype_passes_every_trial_over_50_seeds():
    for seed in range(50):
        rep = mhattn.check_prototype(_f32_layer, dtype=np.float32, seed=seed)
        assert rep.ok and all(t.ok for t in rep.trials), (seed, str(rep))


@pytest.mark.parametrize("name", ["correct_float32", "correct_einsum", "correct_mask",
                                  "correct_rope", "correct_qk_norm", "correct_dict"])
def test_correct_corpus_prototypes_pass_in_float32(name):
    fn = _corpus(name)
    for seed in range(10):
        rep = mhattn.check_prototype(fn, dtype=np.float32, seed=seed, trials=6)
        assert rep.ok, (seed, str(rep))


def test_correct_float32_attention_passes_every_trial_over_50_seeds():
    for seed in range(50):
        rep = mhattn.check_attention_prototype(_f32_attend, dtype=np.float32, seed=seed)
        assert rep.ok and all(t.ok for t in rep.trials), (seed, str(rep))


def _bound_check(steps, starts, want32, want64):
    for st, w32, w64 in zip(starts, want32, want64):
        tol = rounding.float32_tolerance(steps, st)
        err = np.abs(w32.astype(np.float64) - w64).max() / np.abs(w64).max()
        # mhattn's float32 answer is one correct float32 computation: within
        # the bound B, a quarter of the tolerance (2 computations, x2 safety)
        assert err <= tol / rounding.SAFETY * 2, (err, tol)
        yield tol


def test_tolerance_bounds_mhattns_own_float32_error():
    keywords = ["mask", "causal", "rope", "q_norm"]
    tols = []
    for seed in range(20):
        cases = checker._trials(4, np.dtype(np.float32), seed, "general", keywords)
        steps = checker._layer_model(keywords)
        starts = [checker._layer_start(t) for t in cases]
        w32 = [mhattn.multi_head_attention(*t.args[:5], num_heads=t.num_heads, **t.kwargs)
               for t in cases]
        w64 = [mhattn.multi_head_attention(*(a.astype(np.float64) for a in t.args[:5]),
                                           num_heads=t.num_heads,
                                           **{k: (v.astype(np.float64)
                                                  if isinstance(v, np.ndarray)
                                                  and v.dtype.kind == "f" else v)
                                              for k, v in t.kwargs.items()})
               for t in cases]
        tols += list(_bound_check(steps, starts, w32, w64))
    # derived, not a constant: it follows each trial's magnitudes
    assert max(tols) > 10 * min(tols)


def test_tolerance_is_relative():
    """Scaling V's and W^O's weights by powers of two scales the output
    exactly, and leaves the relative tolerance as it was; scaling the scores
    changes it (through the softmax's sensitivity)."""
    cases = checker._trials(0, np.dtype(np.float32), 0)
    steps = checker._layer_model([])
    t = cases[1]
    base = rounding.float32_tolerance(steps, checker._layer_start(t))
    t.w_v, t.w_o = t.w_v * np.float32(4), t.w_o * np.float32(0.5)
    assert rounding.float32_tolerance(steps, checker._layer_start(t)) == pytest.approx(
        base, rel=1e-12)
    t.x = t.x * np.float32(0.25)
    assert rounding.float32_tolerance(steps, checker._layer_start(t)) != pytest.approx(
        base, rel=1e-3)


def test_small_real_mistakes_still_fail_in_float32():
    # 1/d_k instead of 1/sqrt(d_k)
    rep = mhattn.check_prototype(lambda *a: _f32_layer(*a, root=1), dtype=np.float32)
    assert not rep.ok and rep.mistake == "scale_by_dk", str(rep)
    # an off-by-one: sqrt(d_k + 1)
    rep = mhattn.check_prototype(lambda *a: _f32_layer(*a, dk_plus=1), dtype=np.float32)
    assert not rep.ok, str(rep)
    # 1e-4 added to the softmax's denominator: under the old fixed float32
    # tolerance (2e-4), far above float32's rounding on the worked example
    rep = mhattn.check_prototype(lambda *a: _f32_layer(*a, denominator_eps=1e-4),
                                 dtype=np.float32)
    assert not rep.ok, str(rep)
    worked = rep.trials[0]
    assert worked.name == "worked_example" and not worked.ok
    assert worked.max_rel < 2e-4


def test_float64_trials_name_float32_rounding_by_the_bound():
    """A float64 check of a float32 prototype: every differing trial is
    within the float32 bound of that trial, and the report says so."""
    def cast(x, w_q, w_k, w_v, w_o, num_heads):
        return _f32_layer(*(a.astype(np.float32) for a in (x, w_q, w_k, w_v, w_o)),
                          num_heads)

    rep = mhattn.check_prototype(cast)
    assert rep.float32_rounding and not rep.ok, str(rep)
    rep = mhattn.check_prototype(lambda *a: cast(*a[:5], a[5]) * np.float32(1.001))
    assert not rep.float32_rounding, str(rep)


def test_correct_float32_intermediates_do_not_diverge():
    """The intermediates a correct float32 prototype returns are compared
    within the trial's rounding bound too (seed 16's large-input trial once
    reported 'heads' as diverging, at 1.6e-4)."""
    fn = _corpus("correct_dict")
    for seed in range(50):
        rep = mhattn.check_prototype(fn, dtype=np.float32, seed=seed)
        assert rep.ok and rep.first_divergent_stage is None, (seed, str(rep))
