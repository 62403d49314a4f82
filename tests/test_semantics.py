"""Semantics of masks, causal, key_lengths, GQA and biases; the layer class;
the mask converters.  No PyTorch needed.

Two kinds of check: the C path against the NumPy reference, and each feature
against an independent restatement of it with other features of the API
(causal == an explicit triangle mask, GQA == repeated kv heads, a bias == an
extra input column of ones, ...), so a shared misreading in _internal/args.py cannot
make both sides agree.
"""
import itertools
import warnings

import numpy as np
import pytest

import mhattn
from mhattn import reference
from mhattn.nn.interop import from_torch_masks, to_torch_attn_mask, torch_masks_to_mhattn
from mhattn.nn.layer import MultiHeadAttention
from conftest import make_weights, tol

DTYPES = [np.float32, np.float64]
IMPLS = [mhattn.multi_head_attention, reference.multi_head_attention]
IMPL_IDS = ["C", "reference"]


def run_both(*args, **kw):
    """(C out, C weights), (reference out, reference weights)."""
    got = mhattn.multi_head_attention(*args, return_weights=True, **kw)
    want = reference.multi_head_attention(*args, return_weights=True, **kw)
    return got, want


def check(got, want, dtype):
    (o1, w1), (o2, w2) = got, want
    assert o1.dtype == dtype and w1.dtype == dtype
    assert o1.shape == o2.shape and w1.shape == w2.shape
    assert np.all(np.isfinite(o1)) and np.all(np.isfinite(w1))
    np.testing.assert_allclose(o1, o2, **tol(dtype))
    np.testing.assert_allclose(w1, w2, **tol(dtype))


def make_call(rng, dtype, *, B=2, Tq=5, Tk=None, h=4, d_in=6, d=3, d_out=7):
    """x, fused weights and kwargs for a (possibly cross-) attention call."""
    lead = () if B is None else (B,)
    x = rng.standard_normal(lead + (Tq, d_in)).astype(dtype)
    kw = dict(num_heads=h)
    if Tk is not None and Tk != Tq:
        kw["key"] = rng.standard_normal(lead + (Tk, d_in)).astype(dtype)
    w = [rng.standard_normal((d_in, h * d)).astype(dtype) for _ in range(3)]
    w_o = rng.standard_normal((h * d, d_out)).astype(dtype)
    return x, w, w_o, kw


# --------------------------------------------------------------------------
# masks

B_, H_, TQ, TK = 2, 3, 4, 6
MASK_SHAPES = [(TQ, TK), (1, TK), (H_, 1, TK), (B_, 1, 1, TK), (B_, H_, TQ, TK), (TK,),
               (H_, TQ, TK), (1, 1, TQ, 1)]


def random_mask(rng, shape, kind, dtype):
    """Bool (True = may attend, ~70 % True) or float (normal, some -inf)."""
    if kind == "bool":
        return rng.random(shape) < 0.7
    m = rng.standard_normal(shape).astype(dtype)
    m[rng.random(shape) < 0.25] = -np.inf
    return m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape,batched", [(s, b) for s in MASK_SHAPES for b in (True, False)
                                            if b or len(s) < 4])   # 4-D needs a batch
def test_mask_broadcast_shapes(rng, dtype, kind, shape, batched):
    x, (wq, wk, wv), w_o, kw = make_call(rng, dtype, B=B_ if batched else None, Tq=TQ, Tk=TK,
                                     h=H_)
    mask = random_mask(rng, shape, kind, dtype)
    b_o = rng.standard_normal(w_o.shape[1]).astype(dtype)
    got, want = run_both(x, wq, wk, wv, w_o, mask=mask, b_o=b_o, **kw)
    check(got, want, dtype)
    # The mask's meaning, restated: blocked keys get weight exactly 0, allowed
    # keys share weight 1, and a row with no allowed key has weights 0.
    weights = got[1]
    full = weights.shape
    allowed = np.broadcast_to(mask if kind == "bool" else np.isfinite(mask), full)
    assert np.all(weights[~allowed] == 0)
    sums = weights.sum(-1)
    any_allowed = allowed.any(-1)
    np.testing.assert_allclose(sums[any_allowed], 1, rtol=0, atol=1e-5)
    assert np.all(sums[~any_allowed] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bool_mask_equals_float_mask_of_zeros_and_minus_inf(rng, dtype):
    x, (wq, wk, wv), w_o, kw = make_call(rng, dtype, Tq=TQ, Tk=TK, h=H_)
    mask = rng.random((B_, H_, TQ, TK)) < 0.6
    additive = np.where(mask, 0, -np.inf).astype(dtype)
    a = mhattn.multi_head_attention(x, wq, wk, wv, w_o, mask=mask, return_weights=True, **kw)
    b = mhattn.multi_head_attention(x, wq, wk, wv, w_o, mask=additive, return_weights=True,
                                    **kw)
    np.testing.assert_allclose(a[0], b[0], **tol(dtype))
    np.testing.assert_allclose(a[1], b[1], **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_float_mask_is_added_to_the_scaled_scores(rng, dtype):
    """A finite additive mask m: weights = softmax(q k^T * scale + m), checked by hand."""
    x = rng.standard_normal((TQ, 4)).astype(dtype)
    w = rng.standard_normal((4, 4)).astype(dtype)
    m = rng.standard_normal((TQ, TQ)).astype(dtype)
    _, weights = mhattn.multi_head_attention(x, w, w, w, num_heads=1, mask=m, scale=0.3,
                                             return_weights=True)
    q = x.astype(np.float64) @ w
    s = q @ q.T * 0.3 + m
    e = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(weights[0], e / e.sum(-1, keepdims=True), **tol(dtype))


# --------------------------------------------------------------------------
# causal

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Tq,Tk", [(5, 5), (3, 7), (1, 6), (7, 3), (6, 1), (1, 1)])
@pytest.mark.parametrize("batched", [True, False])
def test_causal_is_bottom_right(rng, dtype, Tq, Tk, batched):
    x, (wq, wk, wv), w_o, kw = make_call(rng, dtype, B=2 if batched else None, Tq=Tq, Tk=Tk)
    kw.setdefault("key", x)
    b_o = rng.standard_normal(w_o.shape[1]).astype(dtype)
    got, want = run_both(x, wq, wk, wv, w_o, causal=True, b_o=b_o, **kw)
    check(got, want, dtype)
    # The spec: query i sees keys j <= i + (Tk - Tq), as an explicit mask.
    tri = np.arange(Tk)[None, :] <= np.arange(Tq)[:, None] + (Tk - Tq)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (7, 3) etc. have fully masked rows, not all
        explicit = mhattn.multi_head_attention(x, wq, wk, wv, w_o, mask=tri, b_o=b_o,
                                               return_weights=True, **kw)
    np.testing.assert_allclose(got[0], explicit[0], **tol(dtype))
    np.testing.assert_allclose(got[1], explicit[1], **tol(dtype))
    out, weights = got
    assert np.all(weights[..., ~tri] == 0)
    # T_q > T_k: the first T_q - T_k queries see no key: weights 0, output b_o.
    dead = max(Tq - Tk, 0)
    assert np.all(weights[..., :dead, :] == 0)
    np.testing.assert_array_equal(out[..., :dead, :],
                                  np.broadcast_to(b_o, out[..., :dead, :].shape))
    # The last query always sees every key.
    assert np.all(weights[..., -1, :] > 0)


# --------------------------------------------------------------------------
# key_lengths

@pytest.mark.parametrize("dtype", DTYPES)
def test_key_lengths_batched(rng, dtype):
    x, (wq, wk, wv), w_o, kw = make_call(rng, dtype, B=4, Tq=3, Tk=6)
    b_o = rng.standard_normal(w_o.shape[1]).astype(dtype)
    lengths = np.array([6, 0, 1, 4])
    got, want = run_both(x, wq, wk, wv, w_o, key_lengths=lengths, b_o=b_o, **kw)
    check(got, want, dtype)
    out, weights = got
    # key_lengths == the key-padding mask (B, 1, 1, Tk) it stands for.
    pad = (np.arange(6)[None, :] < lengths[:, None])[:, None, None, :]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        explicit = mhattn.multi_head_attention(x, wq, wk, wv, w_o, mask=pad, b_o=b_o,
                                               return_weights=True, **kw)
    np.testing.assert_allclose(out, explicit[0], **tol(dtype))
    np.testing.assert_allclose(weights, explicit[1], **tol(dtype))
    # Length 0: every row of that item is fully masked.
    assert np.all(weights[1] == 0)
    np.testing.assert_array_equal(out[1], np.broadcast_to(b_o, out[1].shape))
    # Length 1: everything attends to key 0 alone.
    assert np.all(weights[2, ..., 0] == 1) and np.all(weights[2, ..., 1:] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [0, 2, 5])
def test_key_lengths_unbatched_scalar(rng, dtype, length):
    x, (wq, wk, wv), w_o, kw = make_call(rng, dtype, B=None, Tq=4, Tk=5)
    got, want = run_both(x, wq, wk, wv, w_o, key_lengths=length, **kw)
    check(got, want, dtype)
    # The same as cutting the keys off (length > 0), or as zeros (length 0).
    if length:
        kw2 = dict(kw, key=kw["key"][:length])
        cut = mhattn.multi_head_attention(x, wq, wk, wv, w_o, **kw2)
        np.testing.assert_allclose(got[0], cut, **tol(dtype))
    else:
        np.testing.assert_array_equal(got[0], np.zeros_like(got[0]))


# --------------------------------------------------------------------------
# grouped-query attention

def gqa_weights(rng, form, d_in, g, d, dtype):
    return make_weights(rng, form, d_in, [d] * g, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["fused", "stacked", "list"])
@pytest.mark.parametrize("g", [1, 2, 4])
@pytest.mark.parametrize("batched", [True, False])
def test_gqa(rng, dtype, form, g, batched):
    h, d, d_in = 4, 3, 5
    lead = (2,) if batched else ()
    x = rng.standard_normal(lead + (5, d_in)).astype(dtype)
    wq = make_weights(rng, form, d_in, [d] * h, dtype)
    wk = gqa_weights(rng, form, d_in, g, d, dtype)
    wv = gqa_weights(rng, form, d_in, g, d, dtype)
    w_o = rng.standard_normal((h * d, 6)).astype(dtype)
    kw = dict(num_kv_heads=g)
    if form == "fused":
        kw["num_heads"] = h
    got, want = run_both(x, wq, wk, wv, w_o, **kw)
    check(got, want, dtype)
    # Restated: query head i uses kv head i // (h // g): repeat the kv heads.
    as_list = lambda w: make_list(w, g)  # noqa: E731
    idx = [i // (h // g) for i in range(h)]
    wk_rep = [as_list(wk)[j] for j in idx]
    wv_rep = [as_list(wv)[j] for j in idx]
    wq_list = make_list(wq, h)
    rep = mhattn.multi_head_attention(x, wq_list, wk_rep, wv_rep, w_o, return_weights=True)
    np.testing.assert_allclose(got[0], rep[0], **tol(dtype))
    np.testing.assert_allclose(got[1], rep[1], **tol(dtype))


def make_list(w, n):
    """Any weight form -> a list of n per-head matrices."""
    if isinstance(w, list):
        return w
    w = np.asarray(w)
    if w.ndim == 3:
        return list(w)
    d = w.shape[1] // n
    return [w[:, i * d:(i + 1) * d] for i in range(n)]


def test_gqa_mapping_is_contiguous_groups(rng):
    """Heads 0,1 -> kv 0 and heads 2,3 -> kv 1 (not 0,2 -> kv 0): make kv head 1's
    values zero and see which query heads output zeros."""
    x = rng.standard_normal((3, 4))
    wq = [rng.standard_normal((4, 2)) for _ in range(4)]
    wk = [rng.standard_normal((4, 2)) for _ in range(2)]
    wv = [rng.standard_normal((4, 2)), np.zeros((4, 2))]
    concat = mhattn.multi_head_attention(x, wq, wk, wv, num_kv_heads=2)
    heads = concat.reshape(3, 4, 2)
    assert np.all(np.abs(heads[:, :2]).max(axis=(0, 2)) > 0)
    assert np.all(heads[:, 2:] == 0)


# --------------------------------------------------------------------------
# biases

def bias_forms(b_heads, form):
    if form == "fused":
        return np.concatenate(b_heads)
    if form == "stacked":
        return np.stack(b_heads)
    return list(b_heads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["fused", "stacked", "list"])
@pytest.mark.parametrize("g", [1, 3])
def test_biases_all_forms(rng, dtype, form, g):
    h, d, d_in = 3, 2, 5
    x = rng.standard_normal((2, 4, d_in)).astype(dtype)
    wq = make_weights(rng, "stacked", d_in, [d] * h, dtype)
    wk = make_weights(rng, "stacked", d_in, [d] * g, dtype)
    wv = make_weights(rng, "stacked", d_in, [d] * g, dtype)
    w_o = rng.standard_normal((h * d, 4)).astype(dtype)
    bq = [rng.standard_normal(d).astype(dtype) for _ in range(h)]
    bk = [rng.standard_normal(d).astype(dtype) for _ in range(g)]
    bv = [rng.standard_normal(d).astype(dtype) for _ in range(g)]
    b_o = rng.standard_normal(4).astype(dtype)
    kw = dict(num_kv_heads=g, b_q=bias_forms(bq, form), b_k=bias_forms(bk, form),
              b_v=bias_forms(bv, form), b_o=b_o)
    got, want = run_both(x, wq, wk, wv, w_o, **kw)
    check(got, want, dtype)
    # Restated: x W + b == [x, 1] [W; b]: a bias is one more input feature.
    ones = np.ones(x.shape[:-1] + (1,), dtype)
    xa = np.concatenate([x, ones], axis=-1)
    aug = lambda w, b: np.stack([np.vstack([w[i], b[i]]) for i in range(len(b))])  # noqa
    nob = mhattn.multi_head_attention(xa, aug(wq, bq), aug(wk, bk), aug(wv, bv), w_o,
                                      num_kv_heads=g, return_weights=True)
    np.testing.assert_allclose(got[0] - b_o, nob[0], **tol(dtype))
    np.testing.assert_allclose(got[1], nob[1], **tol(dtype))


# --------------------------------------------------------------------------
# everything at once

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("Tq,Tk", [(4, 7), (7, 4), (5, 5)])
def test_combination(rng, dtype, batched, Tq, Tk):
    """GQA + cross-attention + key_lengths + causal + a mask + ragged heads."""
    h, g = 6, 3
    dks, dvs = [1, 4, 3], [5, 2, 3]         # per kv head; ragged
    d_in, d_kin, d_vin = 5, 4, 7
    lead = (3,) if batched else ()
    x = rng.standard_normal(lead + (Tq, d_in)).astype(dtype)
    key = rng.standard_normal(lead + (Tk, d_kin)).astype(dtype)
    value = rng.standard_normal(lead + (Tk, d_vin)).astype(dtype)
    wq = [rng.standard_normal((d_in, dks[i // 2])).astype(dtype) for i in range(h)]
    wk = [rng.standard_normal((d_kin, w)).astype(dtype) for w in dks]
    wv = [rng.standard_normal((d_vin, w)).astype(dtype) for w in dvs]
    svq = sum(dvs[i // 2] for i in range(h))
    w_o = rng.standard_normal((svq, 8)).astype(dtype)
    bq = [rng.standard_normal(dks[i // 2]).astype(dtype) for i in range(h)]
    bk = [rng.standard_normal(w).astype(dtype) for w in dks]
    bv = [rng.standard_normal(w).astype(dtype) for w in dvs]
    b_o = rng.standard_normal(8).astype(dtype)
    lengths = np.array([Tk, 0, 2]) if batched else 3
    mask = rng.random(lead + (h, Tq, Tk)) < 0.8
    kw = dict(key=key, value=value, num_kv_heads=g, key_lengths=lengths, causal=True,
              mask=mask, b_q=bq, b_k=bk, b_v=bv, b_o=b_o)
    got, want = run_both(x, wq, wk, wv, w_o, **kw)
    check(got, want, dtype)
    # Restated as one explicit mask without GQA (kv heads repeated).
    allowed = np.arange(Tk)[None, :] <= np.arange(Tq)[:, None] + (Tk - Tq)
    allowed = allowed & mask
    klen = np.atleast_1d(lengths)
    pad = np.arange(Tk)[None, :] < klen[:, None]          # (B or 1, Tk)
    pad = pad[:, None, None, :] if batched else pad[0][None, None, :]
    allowed = allowed & pad
    rep = lambda ws: [ws[i // 2] for i in range(h)]  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        explicit = mhattn.multi_head_attention(
            x, wq, rep(wk), rep(wv), w_o, key=key, value=value, mask=allowed,
            b_q=bq, b_k=rep(bk), b_v=rep(bv), b_o=b_o, return_weights=True)
    np.testing.assert_allclose(got[0], explicit[0], **tol(dtype))
    np.testing.assert_allclose(got[1], explicit[1], **tol(dtype))
    dead = ~allowed.any(-1)                                   # fully masked rows
    full_dead = np.broadcast_to(dead, got[1].shape[:-1]).all(axis=-2)  # all heads
    assert np.all(got[1][np.broadcast_to(dead, got[1].shape[:-1])] == 0)
    np.testing.assert_array_equal(got[0][full_dead],
                                  np.broadcast_to(b_o, got[0][full_dead].shape))


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_equals_unbatched(rng, dtype):
    x, (wq, wk, wv), w_o, kw = make_call(rng, dtype, B=3, Tq=4, Tk=6)
    mask = rng.random((3, 4, 4, 6)) < 0.7
    lengths = np.array([6, 3, 1])
    out = mhattn.multi_head_attention(x, wq, wk, wv, w_o, mask=mask, key_lengths=lengths,
                                      causal=True, **kw)
    for b in range(3):
        kwb = dict(kw, key=kw["key"][b])
        one = mhattn.multi_head_attention(x[b], wq, wk, wv, w_o, mask=mask[b],
                                          key_lengths=lengths[b], causal=True, **kwb)
        np.testing.assert_allclose(out[b], one, **tol(dtype))


def test_float32_matches_float64(rng):
    x, (wq, wk, wv), w_o, kw = make_call(rng, np.float64, Tq=4, Tk=6)
    m = rng.standard_normal((4, 6))
    m[0, :] = -np.inf
    kw.update(mask=m, causal=True, key_lengths=[5, 2])
    o64 = mhattn.multi_head_attention(x, wq, wk, wv, w_o, **kw)
    f = lambda a: a.astype(np.float32)  # noqa: E731
    kw32 = dict(kw, key=f(kw["key"]), mask=f(m))
    o32 = mhattn.multi_head_attention(f(x), f(wq), f(wk), f(wv), f(w_o), **kw32)
    assert o32.dtype == np.float32
    np.testing.assert_allclose(o32, o64, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------
# fully masked rows

@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_false_bool_mask_warns_and_gives_b_o(rng, impl, dtype):
    x, (wq, wk, wv), w_o, kw = make_call(rng, dtype, Tq=3, Tk=4, h=2)
    b_o = rng.standard_normal(w_o.shape[1]).astype(dtype)
    with pytest.warns(UserWarning, match="inverted"):
        out, weights = impl(x, wq, wk, wv, w_o, mask=np.zeros((3, 4), bool), b_o=b_o,
                            return_weights=True, **kw)
    assert not np.isnan(out).any() and not np.isnan(weights).any()
    assert np.all(weights == 0)
    np.testing.assert_array_equal(out, np.broadcast_to(b_o, out.shape))


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_b_o", [True, False])
def test_all_minus_inf_float_mask_gives_b_o_silently(rng, impl, dtype, with_b_o):
    x, (wq, wk, wv), w_o, kw = make_call(rng, dtype, Tq=3, Tk=4, h=2)
    b_o = rng.standard_normal(w_o.shape[1]).astype(dtype) if with_b_o else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, weights = impl(x, wq, wk, wv, w_o, mask=np.full((2, 1, 3, 4), -np.inf, dtype),
                            b_o=b_o, return_weights=True, **kw)
    assert not np.isnan(out).any() and not np.isnan(weights).any()
    assert np.all(weights == 0)
    want = np.zeros(out.shape, dtype) if b_o is None else np.broadcast_to(b_o, out.shape)
    np.testing.assert_array_equal(out, want)


def test_partly_false_bool_mask_does_not_warn(rng):
    x, (wq, wk, wv), w_o, kw = make_call(rng, np.float64, Tq=3, Tk=4, h=2)
    mask = np.zeros((3, 4), bool)
    mask[1, 2] = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, weights = mhattn.multi_head_attention(x, wq, wk, wv, w_o, mask=mask,
                                                   return_weights=True, **kw)
    assert np.all(weights[:, :, 1, 2] == 1)
    assert np.all(weights[:, :, [0, 2]] == 0)


def test_one_fully_masked_row_among_others(rng):
    """Only the masked row is b_o; the others are untouched by it."""
    x, (wq, wk, wv), w_o, kw = make_call(rng, np.float64, Tq=3, Tk=4, h=2)
    b_o = rng.standard_normal(w_o.shape[1])
    m = np.zeros((3, 4))
    m[1] = -np.inf
    out = mhattn.multi_head_attention(x, wq, wk, wv, w_o, mask=m, b_o=b_o, **kw)
    free = mhattn.multi_head_attention(x, wq, wk, wv, w_o, b_o=b_o, **kw)
    np.testing.assert_array_equal(out[:, 1], np.broadcast_to(b_o, out[:, 1].shape))
    np.testing.assert_allclose(out[:, [0, 2]], free[:, [0, 2]], **tol(np.float64))


@pytest.mark.parametrize("impl", [mhattn.multi_head_attention, reference.multi_head_attention],
                         ids=IMPL_IDS)
@pytest.mark.parametrize("Tq", [0, 3])
def test_no_keys_at_all_gives_b_o(rng, impl, Tq):
    """T_k == 0: every query row is fully masked; output b_o, weights (h, Tq, 0)."""
    x = rng.standard_normal((Tq, 4))
    w = rng.standard_normal((4, 4))
    b_o = rng.standard_normal(4)
    kw = dict(key=np.zeros((0, 4))) if Tq else {}
    out, weights = impl(x, w, w, w, w, num_heads=2, b_o=b_o, return_weights=True, **kw)
    assert weights.shape == (2, Tq, 0)
    np.testing.assert_array_equal(out, np.broadcast_to(b_o, (Tq, 4)))


# --------------------------------------------------------------------------
# bad input

X2 = np.ones((2, 3, 4))        # B=2, Tq=3, d_in=4
W4 = np.ones((4, 4))
KEY5 = np.ones((2, 5, 4))      # Tk=5

BAD = [
    # (kwargs, exception, words the message must contain)
    (dict(mask=np.ones((3, 4), bool)), ValueError, ["mask", "(3, 4)", "(2, 2, 3, 5)"]),
    (dict(mask=np.ones((3, 2, 3, 5), bool)), ValueError, ["mask", "(3, 2, 3, 5)"]),
    (dict(mask=np.ones((1, 2, 1, 3, 5), bool)), ValueError, ["mask", "(1, 2, 1, 3, 5)"]),
    (dict(mask=np.ones((3, 5), np.int64)), TypeError, ["mask", "int64"]),
    (dict(mask=np.ones((3, 5), complex)), TypeError, ["mask", "complex"]),
    (dict(mask=np.ones((3, 5), np.longdouble) if np.dtype(np.longdouble).itemsize > 8
          else np.ones((3, 5), object)), TypeError, ["mask"]),
    (dict(key_lengths=[5, -1]), ValueError, ["key_lengths", "-1"]),
    (dict(key_lengths=[6, 2]), ValueError, ["key_lengths", "6", "5"]),
    (dict(key_lengths=[2.0, 3.0]), TypeError, ["key_lengths", "float"]),
    (dict(key_lengths=[1, 2, 3]), ValueError, ["key_lengths", "(3,)", "(2,)"]),
    (dict(key_lengths=3), ValueError, ["key_lengths", "(2,)"]),
    (dict(key_lengths=[True, False]), TypeError, ["key_lengths", "bool"]),
    (dict(num_kv_heads=3, num_heads=2), ValueError, ["num_kv_heads", "num_kv_heads = 3", "num_heads = 2"]),
    (dict(num_kv_heads=0), ValueError, ["num_kv_heads"]),
    (dict(num_kv_heads=1.5), TypeError, ["num_kv_heads"]),
    (dict(b_q=np.ones(3)), ValueError, ["b_q", "(3,)", "(4,)"]),
    (dict(b_k=np.ones(5)), ValueError, ["b_k", "(5,)"]),
    (dict(b_v=np.ones((2, 3))), ValueError, ["b_v", "(2, 3)", "(2, 2)"]),
    (dict(b_q=[np.ones(2)] * 3), ValueError, ["b_q", "3 biases", "2 heads"]),
    (dict(b_k=[np.ones(2), np.ones(3)]), ValueError, ["b_k[1]", "(3,)", "(2,)"]),
    (dict(b_v=np.ones(4, complex)), TypeError, ["b_v", "complex"]),
]


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("kw,exc,words", BAD)
def test_bad_semantic_input(impl, kw, exc, words):
    kw = dict(kw)
    kw.setdefault("num_heads", 2)
    with pytest.raises(exc) as info:
        impl(X2, W4, W4, W4, key=KEY5, **kw)
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


def test_bad_gqa_weights_name_num_kv_heads():
    with pytest.raises(ValueError, match="num_kv_heads"):
        mhattn.multi_head_attention(X2, W4, np.ones((2, 4, 2)), np.ones((2, 4, 2)),
                                    num_heads=2, num_kv_heads=1)


# --------------------------------------------------------------------------
# the layer

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", [
    dict(d_model=8, num_heads=2),
    dict(d_model=12, num_heads=4, num_kv_heads=2, bias=True),
    dict(d_model=6, num_heads=3, num_kv_heads=1, d_k=5, d_v=2, d_out=4),
    dict(d_model=8, num_heads=4, kdim=3, vdim=5, bias=True),
    dict(d_model=7, num_heads=2, d_k=3),
])
def test_layer_against_reference(rng, dtype, cfg):
    layer = MultiHeadAttention(**cfg, dtype=dtype, seed=3)
    if layer.bias:   # zero at init: give them values so that they are tested
        for name in ("b_q", "b_k", "b_v", "b_o"):
            setattr(layer, name, rng.standard_normal(getattr(layer, name).shape).astype(dtype))
    B, Tq, Tk = 2, 4, 6
    x = rng.standard_normal((B, Tq, layer.d_model)).astype(dtype)
    key = rng.standard_normal((B, Tk, layer.kdim)).astype(dtype)
    value = rng.standard_normal((B, Tk, layer.vdim)).astype(dtype)
    mask = rng.random((Tq, Tk)) < 0.8
    opts = dict(mask=mask, causal=True, key_lengths=[6, 3], scale=0.37)
    out, weights = layer(x, key, value, return_weights=True, **opts)
    assert out.shape == (B, Tq, layer.d_out) and out.dtype == dtype
    assert weights.shape == (B, layer.num_heads, Tq, Tk)
    ref = reference.multi_head_attention(x, key=key, value=value, return_weights=True,
                                         **layer.arguments(), **opts)
    np.testing.assert_allclose(out, ref[0], **tol(dtype))
    np.testing.assert_allclose(weights, ref[1], **tol(dtype))
    # Every option reaches the core: dropping one changes the result.
    for name in opts:
        fewer = {k: v for k, v in opts.items() if k != name}
        assert not np.allclose(layer(x, key, value, **fewer), out), name
    # Unbatched input.
    one = layer(x[0], key[0], value[0], **dict(opts, key_lengths=6))
    assert one.shape == (Tq, layer.d_out)
    # Self-attention: key and value default to x.
    if layer.kdim == layer.vdim == layer.d_model:
        np.testing.assert_array_equal(layer(x), layer(x, x, x))


def test_layer_shapes_and_param_count():
    layer = MultiHeadAttention(12, 4, num_kv_heads=2, d_k=5, d_v=6, d_out=7, kdim=3, vdim=9,
                               bias=True, seed=0)
    want = dict(w_q=(4, 12, 5), w_k=(2, 3, 5), w_v=(2, 9, 6), w_o=(24, 7), b_q=(4, 5),
                b_k=(2, 5), b_v=(2, 6), b_o=(7,))
    assert {k: v.shape for k, v in layer.weights().items()} == want
    assert layer.param_count == sum(int(np.prod(s)) for s in want.values())
    plain = MultiHeadAttention(64, 8, seed=0)
    assert plain.b_q is None and set(plain.weights()) == {"w_q", "w_k", "w_v", "w_o"}
    # The document's count: 4 d_model^2 without biases.
    assert plain.param_count == 4 * 64 ** 2 == mhattn.param_count(64, 8)
    assert plain.w_q.dtype == np.float32


def test_layer_repr():
    assert repr(MultiHeadAttention(512, 8)) == (
        "MultiHeadAttention(d_model=512, num_heads=8, num_kv_heads=8, d_k=64, d_v=64, "
        "d_out=512, bias=False, dtype=float32)")
    assert repr(MultiHeadAttention(8, 4, num_kv_heads=2, kdim=3, bias=True,
                                   dtype=np.float64)) == (
        "MultiHeadAttention(d_model=8, num_heads=4, num_kv_heads=2, d_k=2, d_v=2, "
        "d_out=8, kdim=3, bias=True, dtype=float64)")


def test_layer_seed_determinism():
    a = MultiHeadAttention(16, 4, bias=True, seed=7)
    b = MultiHeadAttention(16, 4, bias=True, seed=7)
    c = MultiHeadAttention(16, 4, bias=True, seed=8)
    for name in a.weights():
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.w_q, c.w_q) and not np.array_equal(a.w_o, c.w_o)
    # An rng may be passed instead of a seed.
    d = MultiHeadAttention(16, 4, bias=True, seed=np.random.default_rng(7))
    np.testing.assert_array_equal(a.w_v, d.w_v)


def test_layer_init_statistics():
    """nn.MultiheadAttention's init: Xavier-uniform over the packed (rows, E)
    in-projection, nn.Linear's U(+-1/sqrt(fan_in)) for W^O, zero biases."""
    E, h = 512, 8
    layer = MultiHeadAttention(E, h, bias=True, seed=0)
    bound_in = np.sqrt(6 / (E + 3 * E))
    for w in (layer.w_q, layer.w_k, layer.w_v):
        assert np.abs(w).max() <= bound_in
        assert abs(w.std() / np.sqrt(2 / (E + 3 * E)) - 1) < 0.1
        assert abs(w.mean()) < 0.1 * w.std()
    bound_out = 1 / np.sqrt(E)
    assert np.abs(layer.w_o).max() <= bound_out
    assert abs(layer.w_o.std() / (bound_out / np.sqrt(3)) - 1) < 0.1
    for b in (layer.b_q, layer.b_k, layer.b_v, layer.b_o):
        assert np.all(b == 0)
    # W^O's fan-in is h*d_v, whatever d_model is.
    wide = MultiHeadAttention(64, 8, d_k=32, seed=0)
    assert abs(wide.w_o.std() / (1 / np.sqrt(3 * 8 * 32)) - 1) < 0.1
    # Separate projections (kdim/vdim set): Xavier over each of them.
    sep = MultiHeadAttention(E, h, kdim=128, vdim=256, seed=0)
    for w, fan in ((sep.w_q, E), (sep.w_k, 128), (sep.w_v, 256)):
        assert abs(w.std() / np.sqrt(2 / (E + fan)) - 1) < 0.1


def test_layer_gqa_equals_repeated_heads(rng):
    layer = MultiHeadAttention(12, 6, num_kv_heads=2, seed=1)
    assert layer.w_k.shape == (2, 12, 2) and layer.w_v.shape == (2, 12, 2)
    x = rng.standard_normal((2, 5, 12)).astype(np.float32)
    rep = np.repeat(layer.w_k, 3, axis=0), np.repeat(layer.w_v, 3, axis=0)
    want = mhattn.multi_head_attention(x, layer.w_q, *rep, layer.w_o)
    np.testing.assert_allclose(layer(x), want, **tol(np.float32))


def test_layer_bad_arguments():
    with pytest.raises(ValueError, match="num_heads"):
        MultiHeadAttention(10, 3)
    assert MultiHeadAttention(10, 3, d_k=4).d_v == 4
    with pytest.raises(ValueError, match="num_kv_heads"):
        MultiHeadAttention(12, 4, num_kv_heads=3)
    with pytest.raises(TypeError, match="dtype"):
        MultiHeadAttention(8, 2, dtype=np.int32)
    with pytest.raises(ValueError, match="d_model"):
        MultiHeadAttention(0, 2)
    layer = MultiHeadAttention(8, 2, seed=0)
    x = np.ones((3, 8), np.float32)
    with pytest.raises(TypeError, match="maks"):
        layer(x, maks=np.ones((3, 3), bool))
    with pytest.raises(TypeError, match="num_heads"):
        layer(x, num_heads=2)
    with pytest.raises(TypeError, match="w_o"):
        layer(x, w_o=None)


def test_layer_state_dict_round_trip(rng):
    for cfg in (dict(bias=True), dict(kdim=3, vdim=5), dict(num_kv_heads=2, d_out=5)):
        a = MultiHeadAttention(8, 4, seed=1, **cfg)
        if a.bias:
            a.b_k = rng.standard_normal(a.b_k.shape).astype(np.float32)
        sd = a.state_dict()
        b = MultiHeadAttention(8, 4, seed=2, **cfg)
        assert not np.array_equal(a.w_q, b.w_q)
        b.load_state_dict(sd)
        for name in a.weights():
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        # Copies, not views: changing the dict leaves the layer alone.
        for v in sd.values():
            v[...] = 0
        assert np.any(b.w_q != 0)
    packed = MultiHeadAttention(8, 2, bias=True, seed=0).state_dict()
    assert {k: v.shape for k, v in packed.items()} == {
        "in_proj_weight": (24, 8), "in_proj_bias": (24,), "out_proj.weight": (8, 8),
        "out_proj.bias": (8,)}
    # PyTorch layout: rows are output features, q rows first.
    lay = MultiHeadAttention(8, 2, seed=0)
    np.testing.assert_array_equal(lay.state_dict()["in_proj_weight"][:8, :].T,
                                  np.concatenate(list(lay.w_q), axis=1))
    sep = MultiHeadAttention(8, 2, kdim=3, vdim=5, seed=0).state_dict()
    assert {k: v.shape for k, v in sep.items()} == {
        "q_proj_weight": (8, 8), "k_proj_weight": (8, 3), "v_proj_weight": (8, 5),
        "out_proj.weight": (8, 8)}
    with pytest.raises(ValueError, match="in_proj_weight"):
        MultiHeadAttention(8, 2).load_state_dict(sep)
    bad = dict(packed)
    bad["out_proj.weight"] = np.ones((8, 7))
    with pytest.raises(ValueError, match=r"out_proj\.weight.*\(8, 7\)"):
        MultiHeadAttention(8, 2, bias=True).load_state_dict(bad)


@pytest.mark.parametrize("cfg,words", [
    (dict(num_kv_heads=2), "num_kv_heads"),
    (dict(d_k=3), "d_k"),
    (dict(d_v=3, d_k=2), "d_v"),
    (dict(d_out=5), "d_out"),
])
def test_layer_to_torch_refuses_what_torch_cannot_hold(cfg, words):
    with pytest.raises(ValueError, match=words):
        MultiHeadAttention(8, 4, **cfg).to_torch()


# --------------------------------------------------------------------------
# the mask converters (NumPy inputs; the PyTorch behaviour is in test_torch_oracle)

def test_from_torch_masks_bool():
    rng = np.random.default_rng(0)
    B, h, Tq, Tk = 2, 3, 4, 5
    am = rng.random((Tq, Tk)) < 0.3               # True = blocked
    kpm = rng.random((B, Tk)) < 0.3               # True = padding
    m = from_torch_masks(am, kpm)
    assert m.dtype == bool
    want = ~am[None, None] & ~kpm[:, None, None, :]
    np.testing.assert_array_equal(np.broadcast_to(m, (B, h, Tq, Tk)),
                                  np.broadcast_to(want, (B, h, Tq, Tk)))
    np.testing.assert_array_equal(from_torch_masks(am), ~am)
    np.testing.assert_array_equal(np.broadcast_to(from_torch_masks(None, kpm), (B, h, Tq, Tk)),
                                  np.broadcast_to(~kpm[:, None, None, :], (B, h, Tq, Tk)))
    assert from_torch_masks() is None
    assert torch_masks_to_mhattn is from_torch_masks


def test_from_torch_masks_3d_and_float():
    rng = np.random.default_rng(1)
    B, h, Tq, Tk = 2, 3, 4, 5
    am = rng.standard_normal((B * h, Tq, Tk)).astype(np.float32)
    kpm = rng.random((B, Tk)) < 0.3
    m = from_torch_masks(am, kpm, num_heads=h)
    assert m.dtype == np.float32 and m.shape == (B, h, Tq, Tk)
    for b, i in itertools.product(range(B), range(h)):
        want = am[b * h + i] + np.where(kpm[b], -np.inf, 0)[None, :]
        np.testing.assert_array_equal(m[b, i], want)
    # batch_size alone also splits a 3-D mask.
    np.testing.assert_array_equal(from_torch_masks(am, kpm, batch_size=B), m)
    # float64 wins; a bool attn_mask becomes -inf / 0.
    m2 = from_torch_masks(rng.random((Tq, Tk)) < 0.5, np.zeros((B, Tk)))
    assert m2.dtype == np.float64 and set(np.unique(m2)) <= {0.0, -np.inf}
    # A single batch item drops the batch axis, so it fits unbatched calls.
    assert from_torch_masks(am[:h], num_heads=h).shape == (h, Tq, Tk)


def test_from_torch_masks_errors():
    with pytest.raises(ValueError, match="num_heads"):
        from_torch_masks(np.zeros((6, 4, 5), bool))
    with pytest.raises(ValueError, match="num_heads=4"):
        from_torch_masks(np.zeros((6, 4, 5), bool), num_heads=4)
    with pytest.raises(ValueError, match="batch_size"):
        from_torch_masks(np.zeros((6, 4, 5), bool), num_heads=3, batch_size=3)
    with pytest.raises(ValueError, match="key_padding_mask"):
        from_torch_masks(np.zeros((4, 5), bool), np.zeros((2, 6), bool))
    with pytest.raises(ValueError, match="attn_mask"):
        from_torch_masks(np.zeros(5, bool))
    with pytest.raises(TypeError, match="key_padding_mask"):
        from_torch_masks(None, np.zeros((2, 5), np.int64))


def test_to_torch_attn_mask_round_trip():
    rng = np.random.default_rng(2)
    B, h, Tq, Tk = 2, 3, 4, 5
    for shape in [(Tq, Tk), (1, Tk), (h, 1, Tk), (B, 1, 1, Tk), (B, h, Tq, Tk)]:
        for mask in (rng.random(shape) < 0.6, rng.standard_normal(shape)):
            t = to_torch_attn_mask(mask, num_heads=h, batch_size=B, tgt_len=Tq, src_len=Tk)
            assert t.flags.c_contiguous and t.dtype == mask.dtype
            full = np.broadcast_to(mask, (B, h, Tq, Tk))
            want = ~full if mask.dtype == bool else full   # PyTorch's bool is inverted
            if len(shape) <= 2:
                assert t.shape == (Tq, Tk)
                np.testing.assert_array_equal(t, want[0, 0])
            else:   # row b*h + i is batch item b, head i
                assert t.shape == (B * h, Tq, Tk)
                np.testing.assert_array_equal(t.reshape(B, h, Tq, Tk), want)
            back = from_torch_masks(t, num_heads=h)
            np.testing.assert_array_equal(np.broadcast_to(back, (B, h, Tq, Tk)),
                                          np.broadcast_to(mask, (B, h, Tq, Tk)))
    with pytest.raises(ValueError, match="num_heads"):
        to_torch_attn_mask(np.ones((h, Tq, Tk), bool))
    with pytest.raises(ValueError, match="broadcast"):
        to_torch_attn_mask(np.ones((Tq, Tk), bool), tgt_len=7)
