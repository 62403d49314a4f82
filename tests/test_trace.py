"""mhattn.trace: every step per head, equal to the reference's steps."""
import numpy as np
import pytest

import mhattn
from mhattn import reference
from mhattn._internal.args import normalize
from mhattn.learn.trace import KEYS, STAGES, CompareReport, Trace

from conftest import make_weights, tol

ARGS = ("x", "w_q", "w_k", "w_v", "w_o")


def _logsumexp(s):
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0, m)
    with np.errstate(divide="ignore"):
        return (m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True)))[..., 0]


def _check_against_reference(t, args, kwargs, dtype):
    """Every stage of every head equals reference.head_intermediates."""
    call = normalize(*args, **kwargs)
    kw = tol(dtype)
    for b in range(call.B):
        for h in range(call.H):
            ref = reference.head_intermediates(call, b, h)
            got = t.head(h, b if call.batched else None)
            for name in ("q", "k", "v", "raw_scores", "scores", "weights", "head"):
                assert got[name].dtype == dtype, name
                np.testing.assert_allclose(got[name], ref[name], err_msg=name, **kw)
            # row max and log-sum-exp of the scaled, masked scores
            np.testing.assert_allclose(got["row_max"], ref["scores"].max(axis=-1),
                                       err_msg="row_max", **kw)
            np.testing.assert_allclose(got["lse"], _logsumexp(ref["scores"].astype(np.float64)),
                                       err_msg="lse", **kw)
    out, weights = reference.multi_head_attention(*args, return_weights=True, **kwargs)
    np.testing.assert_allclose(t.output, out, **kw)
    np.testing.assert_allclose(t.weights, weights, **kw)
    concat = reference.multi_head_attention(*args[:4], **kwargs)  # w_o=None: the concat
    np.testing.assert_allclose(t.concat, concat, **kw)


def _problem(rng, dtype, *, batched, Tq=4, Tk=None, d_in=6, widths=(3, 3, 3),
             form="fused", d_out=5):
    Tk = Tq if Tk is None else Tk
    lead = (2,) if batched else ()
    x = rng.standard_normal(lead + (Tq, d_in)).astype(dtype)
    w_q = make_weights(rng, form, d_in, list(widths), dtype)
    w_k = make_weights(rng, form, d_in, list(widths), dtype)
    w_v = make_weights(rng, form, d_in, list(widths), dtype)
    w_o = rng.standard_normal((sum(widths), d_out)).astype(dtype)
    kwargs = dict(num_heads=len(widths)) if form == "fused" else {}
    if Tk != Tq:
        kwargs["key"] = rng.standard_normal(lead + (Tk, d_in)).astype(dtype)
    return (x, w_q, w_k, w_v, w_o), kwargs


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("variant", ["plain", "causal", "bool_mask", "float_mask",
                                     "key_lengths", "cross", "stacked"])
def test_trace_equals_reference(rng, dtype, batched, variant):
    form = "stacked" if variant == "stacked" else "fused"
    args, kwargs = _problem(rng, dtype, batched=batched, form=form,
                            Tk=6 if variant in ("cross", "causal") else None)
    B = 2 if batched else None
    lead = (B,) if batched else ()
    if variant == "causal":
        kwargs["causal"] = True              # T_q=4 < T_k=6: bottom-right triangle
    elif variant == "bool_mask":
        m = rng.random(lead + (3, 4, 4)) > 0.4
        m[..., 1, :] = False                 # one fully masked row in every head
        kwargs["mask"] = m
    elif variant == "float_mask":
        m = rng.standard_normal(lead + (1, 4, 4)).astype(dtype)
        m[..., 0, 2] = -np.inf
        kwargs["mask"] = m
    elif variant == "key_lengths":
        kwargs["key_lengths"] = np.array([2, 4]) if batched else 3
    t = mhattn.trace(*args, **kwargs)
    assert isinstance(t, Trace) and t.batched == batched
    H = 3
    assert t.q.shape == lead + (H, 4, 3)
    assert t.weights.shape == lead + (H, 4, t.weights.shape[-1])
    assert t.lse.shape == t.row_max.shape == lead + (H, 4)
    assert t.output.shape == lead + (4, 5) and t.concat.shape == lead + (4, 9)
    _check_against_reference(t, args, kwargs, dtype)
    if variant == "bool_mask":
        # fully masked rows: -inf scores and row max and lse, zero weights
        assert np.isneginf(t.scores[..., 1, :]).all()
        assert np.isneginf(t.row_max[..., 1]).all() and np.isneginf(t.lse[..., 1]).all()
        assert (t.weights[..., 1, :] == 0).all()
    if variant == "causal":
        assert np.isneginf(t.scores[..., 0, 4:]).all()   # query 0 sees keys 0..2
        assert np.isfinite(t.scores[..., 0, :3]).all()


def test_trace_values_come_from_the_core(rng):
    """Weights and output are bit-identical to multi_head_attention's."""
    args, kwargs = _problem(rng, np.float32, batched=True)
    out, w = mhattn.multi_head_attention(*args, return_weights=True, **kwargs)
    t = mhattn.trace(*args, **kwargs)
    np.testing.assert_array_equal(t.output, out)
    np.testing.assert_array_equal(t.weights, w)


@pytest.mark.parametrize("batched", [False, True])
def test_ragged_heads_are_lists(rng, batched):
    widths_k, widths_v = [2, 3, 1], [4, 1, 2]
    lead = (2,) if batched else ()
    x = rng.standard_normal(lead + (5, 6))
    w_q = [rng.standard_normal((6, d)) for d in widths_k]
    w_k = [rng.standard_normal((6, d)) for d in widths_k]
    w_v = [rng.standard_normal((6, d)) for d in widths_v]
    w_o = rng.standard_normal((sum(widths_v), 3))
    t = mhattn.trace(x, w_q, w_k, w_v, w_o, causal=True)
    assert t.ragged
    for name, widths in (("q", widths_k), ("k", widths_k), ("v", widths_v),
                         ("heads", widths_v)):
        arr = getattr(t, name)
        assert isinstance(arr, list) and len(arr) == 3
        assert [a.shape for a in arr] == [lead + (5, d) for d in widths]
    assert isinstance(t.weights, np.ndarray) and t.weights.shape == lead + (3, 5, 5)
    _check_against_reference(t, (x, w_q, w_k, w_v, w_o), dict(causal=True), np.float64)
    assert "[" in t.shape_of("q")


def test_grouped_query_heads_share_keys(rng):
    x = rng.standard_normal((4, 8))
    w_q = rng.standard_normal((8, 4 * 2))
    w_k = rng.standard_normal((8, 2 * 2))
    w_v = rng.standard_normal((8, 2 * 3))
    t = mhattn.trace(x, w_q, w_k, w_v, num_heads=4, num_kv_heads=2)
    assert t.k.shape == (4, 4, 2) and t.v.shape == (4, 4, 3)
    np.testing.assert_array_equal(t.k[0], t.k[1])
    np.testing.assert_array_equal(t.k[2], t.k[3])
    assert t.num_kv_heads == 2
    _check_against_reference(t, (x, w_q, w_k, w_v, None),
                             dict(num_heads=4, num_kv_heads=2), np.float64)


def test_worked_example_steps():
    tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    t = mhattn.trace(X, w_q, w_k, w_v, w_o, tokens=tokens)
    it = 2
    np.testing.assert_allclose(t.q[0, it], [1, 1])
    np.testing.assert_allclose(t.k[0], [[3, 1], [0, 1], [1, 1]])
    np.testing.assert_allclose(t.raw_scores[0, it], [4, 1, 2])
    np.testing.assert_allclose(t.raw_scores[1, it], [1, 4, 2])
    np.testing.assert_allclose(t.scores[0, it], [2.8284, 0.7071, 1.4142], atol=1e-4)
    np.testing.assert_allclose(t.row_max[0, it], 2.8284, atol=1e-4)
    np.testing.assert_allclose(t.lse[0, it], np.log(23.0602), atol=1e-4)
    np.testing.assert_allclose(t.weights[0, it], [0.7337, 0.0879, 0.1784], atol=1e-4)
    np.testing.assert_allclose(t.weights[1, it], [0.0879, 0.7337, 0.1784], atol=1e-4)
    np.testing.assert_allclose(t.heads[0, it], [0.7931, 0.1474], atol=1e-4)
    np.testing.assert_allclose(t.concat[it], [0.7931, 0.1474, 0.1474, 0.7931], atol=1e-4)
    np.testing.assert_allclose(t.output[it], t.concat[it])
    assert t.tokens == tokens and t.key_tokens == tokens
    assert t.scales == pytest.approx((2 ** -0.5, 2 ** -0.5))


def test_to_dict_keys_and_plain_arrays(rng):
    args, kwargs = _problem(rng, np.float64, batched=False)
    d = mhattn.trace(*args, **kwargs).to_dict()
    assert list(d) == ["q", "k", "v", "raw_scores", "scores", "row_max", "lse", "weights",
                       "heads", "concat", "output"]
    assert list(d) == list(KEYS)
    assert all(type(a) is np.ndarray for a in d.values())


def test_getitem_and_head(rng):
    args, kwargs = _problem(rng, np.float64, batched=True)
    t = mhattn.trace(*args, **kwargs)
    assert t["out"] is t.output and t["weights"] is t.weights
    with pytest.raises(KeyError):
        t["nonsense"]
    with pytest.raises(ValueError, match="batched"):
        t.head(0)
    with pytest.raises(IndexError):
        t.head(3, 0)
    np.testing.assert_array_equal(t.head(-1, 1)["weights"], t.weights[1, 2])


def test_trace_bad_arguments_are_checked(rng):
    x = rng.standard_normal((3, 4))
    with pytest.raises(ValueError, match="w_q"):
        mhattn.trace(x, np.ones((5, 4)), np.ones((4, 4)), np.ones((4, 4)), num_heads=2)
    with pytest.raises(ValueError, match="tokens"):
        mhattn.trace(x, np.ones((4, 4)), np.ones((4, 4)), np.ones((4, 4)), num_heads=2,
                     tokens=["a", "b"])


@pytest.mark.parametrize("Tq,Tk", [(3, 0), (0, 3), (1, 1)])
def test_degenerate_lengths(rng, Tq, Tk):
    x = rng.standard_normal((Tq, 4))
    key = rng.standard_normal((Tk, 4))
    w = rng.standard_normal((4, 4))
    b_o = np.arange(4.0)
    t = mhattn.trace(x, w, w, w, w, num_heads=2, key=key, b_o=b_o)
    assert t.scores.shape == t.weights.shape == (2, Tq, Tk)
    assert t.q.shape == (2, Tq, 2) and t.k.shape == (2, Tk, 2)
    out = mhattn.multi_head_attention(x, w, w, w, w, num_heads=2, key=key, b_o=b_o)
    np.testing.assert_array_equal(t.output, out)
    if Tk == 0:   # no key at all: fully masked rows, the output is b_o
        assert np.isneginf(t.row_max).all() and np.isneginf(t.lse).all()
        np.testing.assert_array_equal(t.output, np.broadcast_to(b_o, (Tq, 4)))
    assert "mhattn.Trace" in t._repr_html_()


def test_inputs_not_modified(rng):
    args, kwargs = _problem(rng, np.float64, batched=False)
    copies = [a.copy() for a in args]
    mhattn.trace(*args, **kwargs)
    for a, c in zip(args, copies):
        np.testing.assert_array_equal(a, c)


# ---------------------------------------------------------------- compare

@pytest.fixture
def traced(rng):
    args, kwargs = _problem(rng, np.float64, batched=False)
    return mhattn.trace(*args, **kwargs), args, kwargs


def test_compare_identical_traces(traced):
    t, args, kwargs = traced
    rep = t.compare(mhattn.trace(*args, **kwargs))
    assert isinstance(rep, CompareReport)
    assert rep.ok and rep.first_divergence is None
    assert [s.stage for s in rep.stages] == list(STAGES)
    assert all(s.max_abs == 0 for s in rep.stages)
    assert "agree" in str(rep) and "agree" in repr(rep)
    assert "<table" in rep._repr_html_()


@pytest.mark.parametrize("stage", STAGES)
def test_compare_names_the_injected_stage(traced, stage):
    t, _, _ = traced
    d = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in t.to_dict().items()}
    a = d[stage]
    a.flat[a.size // 2] += 0.5
    rep = t.compare(d)
    assert not rep.ok
    assert rep.first_divergence == stage
    assert rep[stage].max_abs == pytest.approx(0.5)
    assert all(s.ok for s in rep.stages if s.stage != stage)
    assert f"First divergence at '{stage}'" in str(rep)
    assert stage in rep._repr_html_()


def test_compare_divergence_propagates_first_wins(rng):
    """A bug in the scaling shows up first in 'scores', then in every later stage."""
    x = rng.standard_normal((4, 6))
    w = [rng.standard_normal((6, 6)) for _ in range(4)]
    good = mhattn.trace(x, *w, num_heads=2)
    bad = mhattn.trace(x, *w, num_heads=2, scale=1.0)  # the 'no scaling' bug
    rep = good.compare(bad)
    assert rep.first_divergence == "scores"
    assert [s.stage for s in rep.stages if not s.ok] == [
        "scores", "weights", "heads", "concat", "output"]


def test_compare_accepts_fused_and_list_layouts_and_aliases(traced):
    t, args, _ = traced
    x, w_q, w_k = args[:3]
    d = {"Q": x @ w_q,                                   # fused (T, h*d_k)
         "K": [x @ w_k[:, i * 3:(i + 1) * 3] for i in range(3)],   # per-head list
         "attn": t.weights, "out": t.output}
    rep = t.compare(d)
    assert rep.ok, str(rep)
    assert rep["v"].ok is None and "not given" in str(rep)
    d["Q"] = d["Q"] * 2
    assert t.compare(d).first_divergence == "q"


def test_compare_shape_mismatch(traced):
    t, _, _ = traced
    rep = t.compare({"weights": np.zeros((2, 2))})
    assert rep.first_divergence == "weights"
    assert "shapes differ" in str(rep)


def test_compare_ragged(rng):
    x = rng.standard_normal((4, 5))
    w_q = [rng.standard_normal((5, d)) for d in (2, 3)]
    w_v = [rng.standard_normal((5, d)) for d in (1, 4)]
    t = mhattn.trace(x, w_q, w_q, w_v)
    d = t.to_dict()
    assert t.compare(d).ok
    heads = [h.copy() for h in d["heads"]]
    heads[1][0, 0] += 1
    assert t.compare(dict(d, heads=heads)).first_divergence == "heads"
    fused = np.concatenate(d["heads"], axis=-1)
    assert t.compare({"heads": fused})["heads"].ok


def test_compare_float32_tolerance(rng):
    args, kwargs = _problem(rng, np.float64, batched=True)
    t64 = mhattn.trace(*args, **kwargs)
    t32 = mhattn.trace(*[a.astype(np.float32) for a in args], **kwargs)
    rep = t64.compare(t32)
    assert rep.ok, str(rep)
    assert rep.rtol == 1e-4
    assert not t64.compare(t32, rtol=1e-12, atol=0).ok


def test_compare_rejects_other_types(traced):
    t, _, _ = traced
    with pytest.raises(TypeError):
        t.compare([1, 2, 3])


# ---------------------------------------------------------------- display

def test_repr_html_worked_example():
    tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    page = mhattn.trace(X, w_q, w_k, w_v, w_o, tokens=tokens)._repr_html_()
    for text in ["(h=2, T_q=3, d_k=2)", "(h=2, T_q=3, T_k=3)", "(T_q=3, d_out=4)", "0.7337", "0.0879", "0.1784",
                 "0.7931", "0.1474", "2.8284", "4.0000", "Head 1", "Head 2", "ball",
                 "full", "weights", "raw_scores", "lse", "row_max"]:
        assert text in page, text


def test_repr_html_large_and_batched(rng):
    x = rng.standard_normal((2, 20, 16))
    w = rng.standard_normal((16, 16))
    t = mhattn.trace(x, w, w, w, w, num_heads=4, causal=True)
    page = t._repr_html_()
    assert "(B=2, h=4, T_q=20, T_k=20)" in page and "too large" in page and "causal" in page
    small = mhattn.trace(x[:, :3, :4], w[:4, :4], w[:4, :4], w[:4, :4], num_heads=2)
    page = small._repr_html_()
    cell = '<td style="padding:1px 6px;text-align:right">&minus;&infin;</td>'
    assert "batch item 0" in page and cell not in page
    masked = mhattn.trace(x[0, :3, :4], w[:4, :4], w[:4, :4], w[:4, :4], num_heads=2,
                          causal=True)
    assert cell in masked._repr_html_()     # the blocked scores
    assert "Trace" in repr(t) and "(2, 4, 20, 20)" in repr(t)


def test_docstrings_carry_signatures():
    assert mhattn.trace.__doc__.lstrip().startswith("Every intermediate")
    assert "trace(x, w_q, w_k, w_v, w_o=None" in mhattn.trace.__doc__
    assert "compare(other" in Trace.compare.__doc__
