"""Hostile callers, round 2: merge_attention on non-finite parts, objects
half made, memory unchecked (pack_weights, trace), errors that do not name
the argument (the checkers), and plot_attention refusing sink weights."""
import copy
import importlib
import pickle
import tracemalloc
import warnings

import numpy as np
import pytest

import mhattn
from mhattn._internal import args as _args, core as _core

_packed = importlib.import_module("mhattn.compute.packed")
_trace = importlib.import_module("mhattn.learn.trace")


# --- 1. merge_attention equals the unsplit call under IEEE arithmetic ----------

def _strict():
    """No NumPy warning may escape: every one is an error here."""
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("error")
    return ctx


def _halves(dtype, layout, nan_rows=True):
    """q, k, v (B, H, T, d) with causal masking, so that the early rows see
    no key of the second half (a part with lse -inf), and NaN query rows."""
    rng = np.random.default_rng(35)
    B, H, T, d = 2, 3, 8, 5
    q, k, v = (rng.standard_normal((B, H, T, d)).astype(dtype) for _ in "qkv")
    if nan_rows:
        q[0, 1, 2, 3] = np.nan        # a NaN row seen by both halves
        q[1, 0, 6] = np.nan           # another, late
        q[1, 2, 0, 0] = np.nan        # a NaN row that sees the first half only
    tr = (lambda a: np.swapaxes(a, 1, 2)) if layout == "bthd" else (lambda a: a)
    return q, k, v, tr, T


def _split(q, k, v, tr, T, layout, cut):
    """Attention on keys [0, cut) and [cut, T), causal over the whole set."""
    allowed = np.arange(T)[None, :] <= np.arange(T)[:, None]
    outs, lses = [], []
    for sl in (slice(0, cut), slice(cut, T)):
        o, s = mhattn.attention(tr(q), tr(k[:, :, sl]), tr(v[:, :, sl]),
                                mask=allowed[:, sl], layout=layout, return_lse=True)
        outs.append(o)
        lses.append(s)
    return outs, lses


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_merge_of_halves_equals_the_unsplit_call_nan_rows_included(dtype, layout):
    q, k, v, tr, T = _halves(dtype, layout)
    full, full_lse = mhattn.attention(tr(q), tr(k), tr(v), causal=True, layout=layout,
                                      return_lse=True)
    outs, lses = _split(q, k, v, tr, T, layout, cut=4)
    assert np.isneginf(lses[1]).any() and np.isnan(lses[0]).any()
    ctx = _strict()
    try:
        with np.errstate(all="raise"):
            out, lse = mhattn.merge_attention(outs, lses, layout=layout)
    finally:
        ctx.__exit__(None, None, None)
    # NaN exactly where the unsplit call has NaN: the NaN rows stay NaN,
    # never turned into a fully masked row (out 0, lse -inf).
    np.testing.assert_array_equal(np.isnan(out), np.isnan(full))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(full_lse))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(full_lse))
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == np.float64 else dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, full, **tol)      # NaN == NaN here
    np.testing.assert_allclose(lse, full_lse, **tol)


@pytest.mark.parametrize("garbage", [np.nan, np.inf, -np.inf, 1e300])
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_a_part_that_saw_no_key_is_never_read(garbage, layout):
    q, k, v, tr, T = _halves(np.float64, layout, nan_rows=False)
    full = mhattn.attention(tr(q), tr(k), tr(v), causal=True, layout=layout)
    outs, lses = _split(q, k, v, tr, T, layout, cut=5)
    # The rows of the second part that saw no key: their out is garbage now.
    none = np.isneginf(lses[1])
    assert none.any()
    rows = none if layout == "bhtd" else np.swapaxes(none, 1, 2)
    outs[1] = outs[1].copy()
    outs[1][rows] = garbage
    ctx = _strict()
    try:
        with np.errstate(all="raise"):
            out, lse = mhattn.merge_attention(outs, lses, layout=layout)
    finally:
        ctx.__exit__(None, None, None)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, full, rtol=1e-12, atol=1e-12)


def test_merge_nan_lse_makes_the_row_nan_and_every_part_masked_stays_zero():
    o = np.ones((2, 3, 4))
    s = np.zeros((2, 3))
    nan_s = s.copy()
    nan_s[1, 2] = np.nan
    out, lse = mhattn.merge_attention([o, o], [s, nan_s])
    assert np.isnan(out[1, 2]).all() and np.isnan(lse[1, 2])
    assert np.isfinite(np.delete(out.reshape(6, 4), 5, axis=0)).all()
    # NaN in the out of a part that contributes: NaN there, as unsplit
    o2 = o.copy()
    o2[0, 1, 3] = np.nan
    out, lse = mhattn.merge_attention([o, o2], [s, s])
    assert np.isnan(out[0, 1, 3]) and np.isfinite(lse).all()
    assert np.isfinite(out).sum() == out.size - 1
    # every part masked: out 0, lse -inf, whatever the outs hold
    ninf = np.full((2, 3), -np.inf)
    out, lse = mhattn.merge_attention([np.full_like(o, np.nan), o * np.inf], [ninf, ninf])
    assert (out == 0).all() and np.isneginf(lse).all()


@pytest.mark.parametrize("lses", [
    [np.full((1, 2), 1e308), np.full((1, 2), -1e308)],
    [np.full((1, 2), -1e308), np.full((1, 2), 1e308)],
    [np.full((1, 2), np.inf), np.zeros((1, 2))],
    [np.full((1, 2), np.inf), np.full((1, 2), np.inf)],
    [np.full((1, 2), np.nan), np.full((1, 2), -np.inf)],
], ids=["huge-tiny", "tiny-huge", "inf-0", "inf-inf", "nan-masked"])
def test_merge_of_degenerate_parts_warns_nothing(lses):
    outs = [np.ones((1, 2, 3)), np.full((1, 2, 3), 2.0)]
    ctx = _strict()
    try:
        with np.errstate(all="raise"):
            out, lse = mhattn.merge_attention(outs, lses)
    finally:
        ctx.__exit__(None, None, None)
    if np.isnan(lses[0]).any() or np.isinf(lses[0]).all() and lses[0][0, 0] > 0:
        assert np.isnan(out).all() and np.isnan(lse).all()   # IEEE: inf - inf
    else:
        np.testing.assert_array_equal(lse, np.full((1, 2), 1e308))
        expect = 1.0 if lses[0][0, 0] > 0 else 2.0
        np.testing.assert_array_equal(out, np.full((1, 2, 3), expect))


@pytest.mark.parametrize("outs, lses, err, match", [
    (None, [np.zeros((1, 2))], TypeError, r"^outs: expected a list of arrays.*None"),
    ([np.zeros((1, 2, 3))], None, TypeError, r"^lses: expected a list of arrays.*None"),
    (5, [np.zeros((1, 2))], TypeError, r"^outs: .* got int"),
    ([np.zeros((1, 2, 3))], 5.0, TypeError, r"^lses: .* got float"),
    ("ab", [np.zeros((1, 2))], TypeError, r"^outs: .* got str"),
    (np.zeros((2, 1, 2, 3)), [np.zeros((1, 2))] * 2, TypeError,
     r"^outs: .* one array of shape \(2, 1, 2, 3\)"),
    ([np.zeros((1, 2, 3)), np.zeros((1, 2, 4))], [np.zeros((1, 2))] * 2, ValueError,
     r"^outs\[1\]: shape \(1, 2, 4\) differs"),
    ([np.zeros((1, 2, 3))], [np.zeros((2, 1))], ValueError, r"^lses\[0\]: expected shape"),
    ([None], [np.zeros((1, 2))], TypeError, r"^outs\[0\]: expected an array"),
])
def test_merge_bad_parts_name_the_argument(outs, lses, err, match):
    with pytest.raises(err, match=match):
        mhattn.merge_attention(outs, lses)


def test_merge_takes_any_iterable_of_parts():
    o, s = np.ones((1, 2, 3)), np.zeros((1, 2))
    out, lse = mhattn.merge_attention((a for a in [o, o]), iter([s, s]))
    np.testing.assert_array_equal(out, o)
    np.testing.assert_allclose(lse, np.full((1, 2), np.log(2)))


# --- 2. objects half made ---------------------------------------------------

@pytest.mark.parametrize("args, kw", [((), {}), ((1, 2), {}), ((), {"w_q": np.eye(2)})])
def test_packed_weights_cannot_be_half_made(args, kw):
    with pytest.raises(TypeError, match=r"^PackedWeights: .*mhattn\.pack_weights\("):
        mhattn.PackedWeights(*args, **kw)


def test_packed_weights_copies_and_pickles_whole():
    tokens, X, *w = mhattn.worked_example()
    packed = mhattn.pack_weights(*w)
    want = mhattn.multi_head_attention(X, packed)
    for other in (copy.copy(packed), copy.deepcopy(packed),
                  pickle.loads(pickle.dumps(packed))):
        assert type(other) is mhattn.PackedWeights
        assert repr(other) == repr(packed)
        np.testing.assert_array_equal(mhattn.multi_head_attention(X, other), want)
    # even one made by hand through object.__new__ has a repr
    assert "PackedWeights(" in repr(object.__new__(mhattn.PackedWeights))


_TRACE_KW = dict(num_heads=1, num_kv_heads=1, d_k=[1], d_v=[1], scales=[1.0],
                 batched=False, dtype=np.float64)


@pytest.mark.parametrize("arrays, err, match", [
    (None, TypeError, r"^arrays: expected a dict.*mhattn\.trace"),
    (5, TypeError, r"^arrays: expected a dict"),
    (dict.fromkeys(_trace.KEYS), TypeError, r"^arrays\['q'\]: expected an array"),
    ({**{k: np.zeros((1, 1, 1)) for k in _trace.KEYS}, "weights": np.zeros(3)},
     ValueError, r"^arrays\['weights'\]: expected \(h, T_q, T_k\)"),
])
def test_trace_cannot_be_half_made(arrays, err, match):
    with pytest.raises(err, match=match):
        mhattn.Trace(arrays, **_TRACE_KW)


def test_a_trace_built_by_hand_from_a_traces_arrays_is_whole():
    tokens, X, *w = mhattn.worked_example()
    t = mhattn.trace(X, *w)
    again = mhattn.Trace(t.to_dict(), num_heads=2, num_kv_heads=2, d_k=t.d_k, d_v=t.d_v,
                         scales=t.scales, batched=False, dtype=t.dtype)
    assert repr(again) == repr(t)
    assert again.compare(t).first_divergence is None


# --- 3. memory: pack_weights and trace check what they allocate --------------

def _captured(monkeypatch, module):
    """Record the items each check_memory of ``module`` sees."""
    seen = []
    real = _args.check_memory

    def spy(items):
        seen.append(list(items))
        return real(items)
    monkeypatch.setattr(module, "check_memory", spy, raising=False)
    return seen


def _bytes(items):
    return sum(int(np.prod(f, dtype=object)) * n for _, _, f, n in items)


@pytest.mark.parametrize("form", ["fused", "stacked", "list", "cast"])
def test_pack_weights_counts_its_panels_and_copies(monkeypatch, form):
    rng = np.random.default_rng(3)
    d, h = 96, 3
    dtype = np.float64
    if form == "fused" or form == "cast":
        w = [rng.standard_normal((d, h * 21)) for _ in range(3)]
    elif form == "stacked":
        w = [rng.standard_normal((h, d, 21)) for _ in range(3)]
    else:
        w = [[rng.standard_normal((d, 21)) for _ in range(h)] for _ in range(3)]
    w_o = rng.standard_normal((h * 21, 50))
    kw = dict(num_heads=h) if form in ("fused", "cast") else {}
    if form == "cast":
        kw["dtype"] = np.float32
        dtype = np.float32
    # The panel width's probe (a 1x1 pack, once per ISA and dtype) outside the measure
    mhattn.pack_weights(np.eye(2), np.eye(2), np.eye(2), num_heads=1, dtype=dtype)
    seen = _captured(monkeypatch, _packed)
    tracemalloc.start()
    try:
        packed = mhattn.pack_weights(*w, w_o, b_q=np.zeros(h * 21), **kw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(seen) == 1, "pack_weights allocated without a memory check"
    (items,) = seen
    # Each weight's panels: at least what the core made (it pads to whole panels).
    for name, cap in zip(("w_q", "w_k", "w_v", "w_o"), packed._caps):
        (panel,) = [it for it in items if it[0] == f"{name}'s panels"]
        assert _bytes([panel]) >= _core.packed_info(cap)[4]
    # The whole: at least the Python peak plus the panels (C memory), and
    # not absurdly more.
    need = peak + packed.nbytes
    assert need <= _bytes(items) <= 3 * need


def test_pack_weights_raises_memory_error_before_packing(monkeypatch):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((64, 64))
    mhattn.pack_weights(np.eye(2), np.eye(2), np.eye(2), num_heads=1)  # the panel width's probe

    def packs(*a):
        raise AssertionError("a weight was packed before the memory check")
    monkeypatch.setattr(_core, "pack_weight", packs)
    monkeypatch.setattr(_args, "_memory_limit_bytes", 64 * 64 * 8 * 4)
    with pytest.raises(MemoryError, match=r"w_[qkvo]'s .* needs .* elements"):
        mhattn.pack_weights(w, w, w, w, num_heads=4)
    # replace() and unpickling pack too, under the same check
    monkeypatch.setattr(_args, "_memory_limit_bytes", 1 << 40)
    monkeypatch.undo()
    packed = mhattn.pack_weights(w, w, w, w, num_heads=4)
    monkeypatch.setattr(_args, "_memory_limit_bytes", 64 * 64 * 8)
    with pytest.raises(MemoryError, match=r"w_o's panels needs"):
        packed.replace(w_o=2 * w)
    with pytest.raises(MemoryError):
        pickle.loads(pickle.dumps(packed))


_rng = np.random.default_rng(5)
_F32 = np.float32

TRACE_CASES = {
    "plain-f64": dict(T=128, d=32, h=4),
    "batched-causal-f32": dict(B=2, T=96, d=32, h=4, dtype=_F32, causal=True),
    "softcap-alibi-sinks-f32": dict(T=128, d=32, h=2, dtype=_F32, softcap=20.0,
                                    alibi_slopes=np.array([0.5, 0.25], _F32),
                                    sinks=np.zeros(2, _F32)),
    "softcap-alibi-f64-one-head": dict(T=256, d=16, h=1, softcap=20.0, alibi_slopes=[0.5]),
    "float-mask-window-f64": dict(T=128, d=32, h=2, window=(16, 0),
                                  mask=np.zeros((128, 128))),
    "rope-qk-norm-f32": dict(T=96, d=32, h=4, dtype=_F32, rope=mhattn.RoPE(),
                             q_norm=np.ones(8, _F32), k_norm=np.ones(8, _F32)),
    "gqa-cross-f64": dict(T=64, Tk=160, d=32, h=4, num_kv_heads=2, dkv=16),
    "ragged-f64": dict(T=96, d=24, h=3, ragged=True),
}


def _trace_args(T, d, h, B=None, Tk=None, dtype=np.float64, ragged=False, dkv=None, **kw):
    shape = (T, d) if B is None else (B, T, d)
    x = _rng.standard_normal(shape).astype(dtype)
    if Tk is not None:
        kshape = (Tk, d) if B is None else (B, Tk, d)
        kw["key"] = _rng.standard_normal(kshape).astype(dtype)
    if ragged:
        widths = [8 + 4 * (i % 2) for i in range(h)]
        ws = [[_rng.standard_normal((d, c)).astype(dtype) for c in widths] for _ in range(3)]
        return (x, *ws, _rng.standard_normal((sum(widths), d)).astype(dtype)), kw
    kw["num_heads"] = h
    cols = (d, dkv or d, dkv or d)
    ws = [_rng.standard_normal((d, c)).astype(dtype) / np.sqrt(d) for c in cols]
    return (x, *ws, _rng.standard_normal((d, d)).astype(dtype)), kw


@pytest.mark.parametrize("case", list(TRACE_CASES))
def test_trace_estimate_bounds_its_peak(monkeypatch, case):
    args, kw = _trace_args(**TRACE_CASES[case])
    seen = _captured(monkeypatch, _trace)
    tracemalloc.start()
    try:
        t = mhattn.trace(*args, **kw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(seen) == 1
    (items,) = seen
    need = _bytes(items)
    assert peak <= need <= 3 * peak, (peak, need)
    assert t.output is not None


def test_trace_raises_memory_error_before_allocating(monkeypatch):
    args, kw = _trace_args(**TRACE_CASES["softcap-alibi-f64-one-head"])
    seen = _captured(monkeypatch, _trace)
    mhattn.trace(*args, **kw)
    need = _bytes(seen[0])
    monkeypatch.setattr(_args, "_memory_limit_bytes", need - 1)
    tracemalloc.start()
    try:
        with pytest.raises(MemoryError, match=r"one head's score steps|the trace's"):
            mhattn.trace(*args, **kw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < need / 20          # refused before the scores were made
    monkeypatch.setattr(_args, "_memory_limit_bytes", need)
    mhattn.trace(*args, **kw)        # and the estimate itself is enough


# --- 4. the checkers name their arguments, and report a wrong shape -----------

def _good_layer(x, w_q, w_k, w_v, w_o, h):
    return mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads=h)


def _good_attend(q, k, v):
    return mhattn.attention(q, k, v)


CHECKERS = {"layer": (mhattn.check_prototype, _good_layer),
            "attention": (mhattn.check_attention_prototype, _good_attend)}


@pytest.mark.parametrize("which", list(CHECKERS))
@pytest.mark.parametrize("kw, err, match", [
    (dict(seed=-1), ValueError, r"^seed: expected a non-negative integer, got -1"),
    (dict(seed=1.5), TypeError, r"^seed: "),
    (dict(seed="x"), TypeError, r"^seed: "),
    (dict(seed=True), TypeError, r"^seed: "),
    (dict(seed=None), TypeError, r"^seed: "),
    (dict(dtype="not a dtype"), TypeError, r"^dtype: "),
    (dict(dtype=np.int64), TypeError, r"^dtype: "),
    (dict(trials=1.5), TypeError, r"^trials: "),
    (dict(trials="3"), TypeError, r"^trials: "),
    (dict(trials=-2), ValueError, r"^trials: "),
])
def test_checker_arguments_are_named(which, kw, err, match):
    check, fn = CHECKERS[which]
    with pytest.raises(err, match=match):
        check(fn, **kw)


@pytest.mark.parametrize("convention, err", [(None, TypeError), (["general"], TypeError),
                                             (np.array(["general"]), TypeError),
                                             ("plain", ValueError)])
def test_check_prototype_convention_is_named(convention, err):
    with pytest.raises(err, match=r"^convention: "):
        mhattn.check_prototype(_good_layer, convention=convention)


def _huge(*args, **kw):
    return np.broadcast_to(np.float64(1.0), (10 ** 6, 10 ** 6))


@pytest.mark.parametrize("which", list(CHECKERS))
def test_a_huge_wrong_shape_is_reported_not_allocated(which):
    check, _ = CHECKERS[which]
    rep = check(_huge, trials=1)
    assert not rep.ok
    assert all(t.status == "shape" and t.got_shape == (10 ** 6, 10 ** 6) for t in rep.trials)
    assert "output shape (1000000, 1000000), expected" in rep.trials[0].describe()


def test_an_attention_prototype_returning_2d_is_reported():
    rep = mhattn.check_attention_prototype(lambda q, k, v: np.zeros((3, 3)), trials=1)
    assert not rep.ok and all(t.status == "shape" for t in rep.trials)


def test_huge_intermediates_are_compared_by_shape_only():
    big = np.broadcast_to(np.float64(1.0), (10 ** 6, 10 ** 6))

    def proto(x, w_q, w_k, w_v, w_o, h):
        out = _good_layer(x, w_q, w_k, w_v, w_o, h)
        return {"output": out, "q": [big] * h, "weights": big}
    rep = mhattn.check_prototype(proto, trials=1)
    assert rep.ok
    row = rep.trials[0].stages["q"]
    assert row.ok is False and "shapes differ" in row.note


# --- 5. plot_attention takes the weights of a call with sinks ----------------

def _sink_call(rng, T=5, d=8, h=2, **kw):
    x = rng.standard_normal((T, d))
    w = [rng.standard_normal((d, d)) / np.sqrt(d) for _ in range(4)]
    return x, w, dict(num_heads=h, sinks=np.array([0.5, 1.5]), **kw)


def test_plot_attention_takes_sink_weights():
    pytest.importorskip("matplotlib")
    x, w, kw = _sink_call(np.random.default_rng(6), causal=True)
    _, weights = mhattn.multi_head_attention(x, *w, return_weights=True, **kw)
    sums = weights.sum(-1)
    assert (sums < 0.99).any() and (sums <= 1 + 1e-12).all()
    with pytest.raises(ValueError, match=r"weights: row 0 of head 1 sums to .*sinks="):
        mhattn.plot_attention(weights, causal=True)
    fig = mhattn.plot_attention(weights, causal=True, sinks=kw["sinks"])
    assert len(fig.axes) == 3
    np.testing.assert_array_equal(fig.axes[0].get_images()[0].get_array().data, weights[0])
    # a Trace knows its sinks
    t = mhattn.trace(x, *w, **kw)
    np.testing.assert_array_equal(t.weights, weights)
    fig = mhattn.plot_attention(t)
    assert np.ma.getmaskarray(fig.axes[0].get_images()[0].get_array()).any()   # causal
    # batched and without a mask
    xb = np.stack([x, x[::-1]])
    _, wb = mhattn.multi_head_attention(xb, *w, return_weights=True,
                                        **dict(kw, causal=False))
    mhattn.plot_attention(wb, batch=1, sinks=kw["sinks"])
    mhattn.plot_attention(mhattn.trace(xb, *w, **dict(kw, causal=False)), batch=1)


def test_plot_attention_with_sinks_still_refuses_non_probabilities():
    pytest.importorskip("matplotlib")
    x, w, kw = _sink_call(np.random.default_rng(7))
    _, weights = mhattn.multi_head_attention(x, *w, return_weights=True, **kw)
    sinks = kw["sinks"]
    with pytest.raises(ValueError, match=r"weights: row \d+ of head \d+ sums to 2\.5"):
        mhattn.plot_attention(np.full((2, 5, 5), 0.5), sinks=sinks)
    with pytest.raises(ValueError, match=r"not probabilities"):
        mhattn.plot_attention(-weights, sinks=sinks)
    # weight on a key the mask hides: the mask does not match them
    with pytest.raises(ValueError, match=r"mask passed does not match"):
        mhattn.plot_attention(weights, sinks=sinks, causal=True)
    with pytest.raises(ValueError, match=r"^sinks: expected shape \(2,\)"):
        mhattn.plot_attention(weights, sinks=sinks[:1])
    with pytest.raises(TypeError, match=r"^sinks: "):
        mhattn.plot_attention(weights, sinks="ab")


# --- the public classes made by hand: Context, RoPE's arguments ---------------

@pytest.mark.parametrize("args", [(None, None, None), ("call", (1, 2, 3, 4, 5), {})])
def test_context_cannot_be_half_made(args):
    with pytest.raises(TypeError, match=r"^Context: made by multi_head_attention"):
        mhattn.Context(*args)


@pytest.mark.parametrize("kw,exc,start", [
    (dict(theta=None), TypeError, "theta: "), (dict(theta="x"), TypeError, "theta: "),
    (dict(theta=1.0), ValueError, "theta: "), (dict(theta=float("nan")), ValueError, "theta: "),
    (dict(interleaved=1), TypeError, "interleaved: "),
    (dict(rotary_dim=0), ValueError, "rotary_dim: "),
    (dict(rotary_dim=2.0), TypeError, "rotary_dim: ")])
def test_rope_names_its_arguments(kw, exc, start):
    with pytest.raises(exc, match="^" + start):
        mhattn.RoPE(**kw)


@pytest.mark.parametrize("G", [10 ** 8, 2 ** 40, 2 ** 63, 2 ** 70])
def test_a_huge_kv_head_count_is_named_before_anything_is_allocated(G):
    """The memory rule on head counts comes before the core's pairing rule,
    whose vectors would be (G,): a MemoryError naming num_kv_heads, whatever
    the entry point (the fuzzer saw NumPy's 8 TiB MemoryError and 800 MB
    allocated at 10**8)."""
    x, w = np.ones((3, 4)), np.ones((4, 4))
    calls = (lambda: mhattn.multi_head_attention(x, w, w, w, num_heads=2, num_kv_heads=G),
             lambda: mhattn.multi_head_attention_grad(x, x, w, w, w, num_heads=2,
                                                      num_kv_heads=G),
             lambda: mhattn.trace(x, w, w, w, num_heads=2, num_kv_heads=G),
             lambda: mhattn.pack_weights(w, w, w, num_heads=2, num_kv_heads=G),
             lambda: mhattn.MultiHeadAttention(4, 2, num_kv_heads=G))
    tracemalloc.start()
    try:
        for call in calls:
            with pytest.raises(MemoryError, match=f"^num_kv_heads: {G} heads"):
                call()
        assert tracemalloc.get_traced_memory()[1] < 2 ** 26
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("n,exc", [(2 ** 64, None), (-2 ** 64, ValueError), ("a", TypeError),
                                   (2.0, TypeError)])
def test_the_glues_thread_count_names_n(n, exc):
    """_C.set_num_threads: past a C long is as many threads as the core
    takes (was a bare OverflowError); other values name n."""
    from mhattn import _C
    before = _C.get_num_threads()
    try:
        if exc is None:
            _C.set_num_threads(n)
            assert _C.get_num_threads() == 256
        else:
            with pytest.raises(exc, match="^n: "):
                _C.set_num_threads(n)
    finally:
        _C.set_num_threads(before)


def test_the_reference_applies_the_precision_rules():
    """The reference asks the core about its config with the call's dtype
    (_C.check_config): a float32 softcap of 1e308 is refused there too."""
    x, w = np.ones((3, 4), np.float32), np.ones((4, 4), np.float32)
    for f in (mhattn.reference.multi_head_attention, mhattn.multi_head_attention):
        with pytest.raises(ValueError, match="^softcap: .*not representable in float32"):
            f(x, w, w, w, num_heads=2, softcap=1e308)
    assert np.isfinite(mhattn.reference.multi_head_attention(
        x.astype(np.float64), w, w, w, num_heads=2, softcap=1e308)).all()


def test_a_packed_weights_in_another_argument_says_where_it_goes():
    x, w = np.ones((3, 4)), np.ones((4, 4))
    packed = mhattn.pack_weights(w, w, w, w, num_heads=2)
    for call, name in ((lambda: mhattn.multi_head_attention(x, w, packed, w, num_heads=2), "w_k"),
                       (lambda: mhattn.multi_head_attention(x, w, w, w, packed, num_heads=2),
                        "w_o"),
                       (lambda: mhattn.trace(x, packed, None, None, num_heads=2), "w_q")):
        with pytest.raises(TypeError, match=f"^{name}: a PackedWeights is not an array"):
            call()


@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf")])
def test_norm_eps_is_checked_without_a_norm(eps):
    """A norm_eps given without q_norm / k_norm is the core's to check all
    the same (it was accepted silently)."""
    x, w = np.ones((3, 4)), np.ones((4, 4))
    for call in (lambda: mhattn.multi_head_attention(x, w, w, w, num_heads=2, norm_eps=eps),
                 lambda: mhattn.multi_head_attention_grad(x, x, w, w, w, num_heads=2,
                                                          norm_eps=eps),
                 lambda: mhattn.trace(x, w, w, w, num_heads=2, norm_eps=eps)):
        with pytest.raises(ValueError, match="^norm_eps: norm_eps = .* is not a finite number"):
            call()
