"""The C path against the NumPy reference over a grid of awkward cases."""
import itertools

import numpy as np
import pytest

import mhattn
from mhattn import reference
from conftest import make_weights, tol

DTYPES = [np.float32, np.float64]


def run_both(*args, **kw):
    got = mhattn.multi_head_attention(*args, return_weights=True, **kw)
    want = reference.multi_head_attention(*args, return_weights=True, **kw)
    return got, want


def check(got, want, dtype):
    (o1, w1), (o2, w2) = got, want
    assert o1.dtype == dtype and w1.dtype == dtype
    assert o1.shape == o2.shape and w1.shape == w2.shape
    assert o1.flags.c_contiguous and w1.flags.c_contiguous
    np.testing.assert_allclose(o1, o2, **tol(dtype))
    np.testing.assert_allclose(w1, w2, **tol(dtype))


GRID = list(itertools.product(
    [None, 2],            # batch
    ["fused", "stacked", "list"],
    [(1, 1), (5, 5), (7, 13)],   # (Tq, Tk): T=1, square, cross
    [(1, 3), (3, 5), (4, 17)],   # (heads, head width): one head, odd widths
    DTYPES))


@pytest.mark.parametrize("B,form,T,hw,dtype", GRID)
def test_grid_against_reference(rng, B, form, T, hw, dtype):
    Tq, Tk = T
    h, d = hw
    d_in = 6
    cross = Tq != Tk
    lead = () if B is None else (B,)
    x = rng.standard_normal(lead + (Tq, d_in)).astype(dtype)
    kw = {}
    d_kin = d_vin = d_in
    if cross:
        d_kin, d_vin = 5, 9
        kw["key"] = rng.standard_normal(lead + (Tk, d_kin)).astype(dtype)
        kw["value"] = rng.standard_normal(lead + (Tk, d_vin)).astype(dtype)
    w_q = make_weights(rng, form, d_in, [d] * h, dtype)
    w_k = make_weights(rng, form, d_kin, [d] * h, dtype)
    w_v = make_weights(rng, form, d_vin, [d] * h, dtype)
    w_o = rng.standard_normal((h * d, 7)).astype(dtype)
    if form == "fused":
        kw["num_heads"] = h
    check(*run_both(x, w_q, w_k, w_v, w_o, **kw), dtype)
    # W^O absent: the output is the concatenation.
    check(*run_both(x, w_q, w_k, w_v, None, **kw), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batched", [False, True])
def test_ragged_heads_and_dv_neq_dk(rng, dtype, batched):
    lead = (3,) if batched else ()
    x = rng.standard_normal(lead + (6, 5)).astype(dtype)
    dks, dvs = [1, 4, 9, 2], [3, 1, 7, 16]
    w_q = [rng.standard_normal((5, d)).astype(dtype) for d in dks]
    w_k = [rng.standard_normal((5, d)).astype(dtype) for d in dks]
    w_v = [rng.standard_normal((5, d)).astype(dtype) for d in dvs]
    w_o = rng.standard_normal((sum(dvs), 11)).astype(dtype)
    check(*run_both(x, w_q, w_k, w_v, w_o), dtype)
    out = mhattn.multi_head_attention(x, w_q, w_k, w_v)
    assert out.shape == lead + (6, sum(dvs))


@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_value_projection(rng, dtype):
    """The document's shared W_V: one array serving several heads."""
    x = rng.standard_normal((4, 6)).astype(dtype)
    wv = rng.standard_normal((6, 3)).astype(dtype)
    w_q = [rng.standard_normal((6, 3)).astype(dtype) for _ in range(3)]
    w_k = [rng.standard_normal((6, 3)).astype(dtype) for _ in range(3)]
    check(*run_both(x, w_q, w_k, [wv, wv, wv], None), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weights_are_distributions(rng, dtype):
    """The misconception section: every head covers every key, strictly."""
    x = rng.standard_normal((2, 9, 8)).astype(dtype)
    w = rng.standard_normal((8, 8)).astype(dtype) * 0.3
    _, weights = mhattn.multi_head_attention(x, w, w, w, num_heads=4, return_weights=True)
    assert weights.shape == (2, 4, 9, 9)
    assert np.all(weights > 0)
    np.testing.assert_allclose(weights.sum(-1), 1, rtol=0, atol=10 * np.finfo(dtype).eps * 9)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_option(rng, dtype):
    x = rng.standard_normal((5, 8)).astype(dtype)
    w = rng.standard_normal((8, 8)).astype(dtype)
    for scale in (0.0, 0.25, 2, np.float32(1.5)):
        check(*run_both(x, w, w, w, num_heads=2, scale=scale), dtype)
    # scale=1/sqrt(d_k) explicitly is the default.
    a = mhattn.multi_head_attention(x, w, w, w, num_heads=2)
    b = mhattn.multi_head_attention(x, w, w, w, num_heads=2, scale=1 / np.sqrt(4))
    np.testing.assert_array_equal(a, b)


def test_large_scores_do_not_overflow(rng):
    """Max subtraction: scores of 1e4 would overflow exp in float32 without it."""
    x = rng.standard_normal((4, 4)).astype(np.float32) * 100
    w = np.eye(4, dtype=np.float32) * 10
    got, want = run_both(x, w, w, w, num_heads=1)
    assert np.all(np.isfinite(got[0]))
    check(got, want, np.float32)


def test_empty_sequences(rng):
    w = rng.standard_normal((4, 6))
    out = mhattn.multi_head_attention(np.zeros((0, 4)), w, w, w, num_heads=2)
    assert out.shape == (0, 6)
    out, wt = mhattn.multi_head_attention(np.zeros((3, 0, 4)), w, w, w, num_heads=2,
                                          return_weights=True)
    assert out.shape == (3, 0, 6) and wt.shape == (3, 2, 0, 0)
    out = mhattn.multi_head_attention(np.zeros((0, 5, 4)), w, w, w, np.ones((6, 2)),
                                      num_heads=2)
    assert out.shape == (0, 5, 2)
    # No keys at all: every row is fully masked and the output is b_o.
    b_o = np.arange(6.0)
    out = mhattn.multi_head_attention(np.ones((2, 4)), w, w, w, num_heads=2,
                                      key=np.zeros((0, 4)), b_o=b_o)
    np.testing.assert_array_equal(out, np.broadcast_to(b_o, (2, 6)))


@pytest.mark.parametrize("dtypes,expect", [
    ((np.float32, np.float32), np.float32),
    ((np.float64, np.float64), np.float64),
    ((np.float32, np.float64), np.float64),
    ((np.int64, np.int64), np.float64),
    ((np.int32, np.float32), np.float64),
])   # half precision: tests/test_half_dtypes.py
def test_dtype_rules(rng, dtypes, expect):
    xd, wd = dtypes
    x = (rng.standard_normal((3, 4)) * 3).astype(xd)
    w = (rng.standard_normal((4, 4)) * 2).astype(wd)
    out = mhattn.multi_head_attention(x, w, w, w, num_heads=2)
    ref = reference.multi_head_attention(x, w, w, w, num_heads=2)
    assert out.dtype == expect and ref.dtype == expect
    np.testing.assert_allclose(out, ref, **tol(expect))


def test_lists_of_numbers_are_accepted():
    tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    out = mhattn.multi_head_attention(X.tolist(), [w.tolist() for w in w_q],
                                      [w.tolist() for w in w_k], [w.tolist() for w in w_v],
                                      w_o.tolist())
    np.testing.assert_allclose(out, mhattn.multi_head_attention(X, w_q, w_k, w_v, w_o))
    fused = np.concatenate(w_q, axis=1).tolist()
    out2 = mhattn.multi_head_attention(X.tolist(), fused, fused,
                                       np.concatenate(w_v, axis=1), num_heads=2)
    assert out2.shape == (3, 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 4), (2, 5, 4), (1, 4)])
def test_small_call_fast_path_matches_full_path(rng, dtype, shape):
    """Plain small calls skip normalize(); they must give the same bits as the
    full path (forced here; tests/test_fast_path.py covers the options)."""
    from test_fast_path import fast_path, full_path
    x = rng.standard_normal(shape).astype(dtype)
    w = [rng.standard_normal((4, 6)).astype(dtype) for _ in range(3)]
    w_o = rng.standard_normal((6, 5)).astype(dtype)
    for wo in (w_o, None):
        fast = fast_path(x, *w, wo, num_heads=2, return_weights=True)
        assert fast is not None
        full = full_path(x, *w, wo, num_heads=2, return_weights=True)
        np.testing.assert_array_equal(fast[0], full[0])
        np.testing.assert_array_equal(fast[1], full[1])
        assert fast[0].shape == full[0].shape and fast[0].dtype == dtype
    # Anything unusual is left to the full path.
    assert fast_path(x.astype(np.int64), *w, w_o, num_heads=2) is None
    assert fast_path(x, *w, w_o, num_heads=4) is None          # 4 does not divide 6
    assert fast_path(x, *w, w_o[:5], num_heads=2) is None      # w_o's rows
    assert fast_path(x, *w, w_o, num_heads=2, return_weights=1) is None  # not a bool
