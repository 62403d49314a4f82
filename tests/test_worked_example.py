"""The document's worked example and its parameter-count invariance."""
import io

import numpy as np
import pytest

import mhattn
from mhattn import reference
from mhattn.__main__ import main


@pytest.mark.parametrize("impl", [mhattn.multi_head_attention, reference.multi_head_attention])
def test_worked_example_numbers(impl):
    tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    out, w = impl(X, w_q, w_k, w_v, w_o, return_weights=True)
    it = tokens.index("it")
    # The document's numbers, to 4 decimals.
    np.testing.assert_allclose(np.round(w[0, it], 4), [0.7337, 0.0879, 0.1784])
    np.testing.assert_allclose(np.round(w[1, it], 4), [0.0879, 0.7337, 0.1784])
    np.testing.assert_allclose(np.round(out[it], 4), [0.7931, 0.1474, 0.1474, 0.7931])
    assert out.shape == (3, 4) and w.shape == (2, 3, 3)


def test_worked_example_scores_match_document():
    tokens, X, w_q, w_k, w_v, _ = mhattn.worked_example()
    call = mhattn._internal.args.normalize(X, w_q, w_k, w_v)
    step = reference.head_intermediates(call, 0, 0)
    np.testing.assert_allclose(step["raw_scores"][2], [4, 1, 2])
    np.testing.assert_allclose(np.round(step["scores"][2], 4), [2.8284, 0.7071, 1.4142])
    step2 = reference.head_intermediates(call, 0, 1)
    np.testing.assert_allclose(step2["raw_scores"][2], [1, 4, 2])


def test_worked_example_fused_and_stacked_forms_agree():
    tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    fused = [np.concatenate(w, axis=1) for w in (w_q, w_k, w_v)]
    stacked = [np.stack(w) for w in (w_q, w_k, w_v)]
    a = mhattn.multi_head_attention(X, w_q, w_k, w_v, w_o)
    b = mhattn.multi_head_attention(X, *fused, w_o, num_heads=2)
    c = mhattn.multi_head_attention(X, *stacked, w_o)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-15)
    np.testing.assert_allclose(a, c, rtol=0, atol=1e-15)


def test_main_prints_the_worked_example():
    buf = io.StringIO()
    assert main(buf) == 0
    text = buf.getvalue()
    for expected in ["[0.7337, 0.0879, 0.1784]", "[0.0879, 0.7337, 0.1784]",
                     "[0.7931, 0.1474]", "[0.1474, 0.7931]",
                     "[0.7931, 0.1474, 0.1474, 0.7931]", "[2.8284, 0.7071, 1.4142]",
                     "ball", "full", "1,048,576"]:
        assert expected in text, expected


@pytest.mark.parametrize("d_model", [4, 64, 512, 768])
def test_param_count_invariance(d_model):
    counts = {h: mhattn.param_count(d_model, h) for h in (1, 2, 4) if d_model % h == 0}
    assert set(counts.values()) == {4 * d_model ** 2}


def test_param_count_matches_real_weights(rng):
    d_model, h = 12, 3
    dk = d_model // h
    w = [rng.standard_normal((h, d_model, dk)) for _ in range(3)]
    w_o = rng.standard_normal((h * dk, d_model))
    assert sum(a.size for a in w) + w_o.size == mhattn.param_count(d_model, h)
    # d_k != d_v counts each projection on its own.
    assert mhattn.param_count(8, 2, d_k=3, d_v=5) == 2 * 8 * 3 * 2 + 2 * 8 * 5 + 2 * 5 * 8


def test_param_count_document_answer():
    # Active recall 3: d_model 512, h 8 and h 16 give the same Q budget, 262144.
    assert mhattn.param_count(512, 8) == mhattn.param_count(512, 16) == 4 * 262144


@pytest.mark.parametrize("args,exc", [((512, 7), ValueError), ((512, 0), ValueError),
                                      ((512, 2.0), TypeError), ((0, 2), ValueError)])
def test_param_count_bad_input(args, exc):
    with pytest.raises(exc):
        mhattn.param_count(*args)
