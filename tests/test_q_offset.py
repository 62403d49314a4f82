"""Query placement (issue 40): ``q_offset=`` on attention and attention_grad.

Query i sits at ``i + q_offset`` (key j at j) instead of bottom-right at
``i + (T_k - T_q)``, so that a block of a longer call sees the whole call's
causal triangle, window, chunk and ALiBi distances (what mhattn.dask
relies on). Held to the same call with the rule written as a dense bool
mask, to the reference, to a block cut out of the whole call (forward and
gradients), on every ISA path.
"""
import numpy as np
import pytest

import mhattn
from mhattn import reference as R


def placed_mask(Tq, Tk, off, causal=False, window=None):
    """(Tq, Tk) bool, True = visible, of query i at i + off."""
    p = np.arange(Tq)[:, None] + off
    j = np.arange(Tk)[None, :]
    ok = np.ones((Tq, Tk), bool)
    if causal:
        ok &= j <= p
    if window is not None:
        left, right = window
        if left is not None:
            ok &= j >= p - left
        if right is not None:
            ok &= j <= p + right
    return ok


def _qkv(rng, B, H, G, Tq, Tk, d=8, dtype=np.float64):
    return (rng.standard_normal((B, H, Tq, d)).astype(dtype),
            rng.standard_normal((B, G, Tk, d)).astype(dtype),
            rng.standard_normal((B, G, Tk, d)).astype(dtype))


CASES = [  # (Tq, Tk, q_offset, keywords)
    (40, 40, 0, dict(causal=True)),           # top-left, where bottom-right is the same
    (30, 50, 0, dict(causal=True)),           # top-left with more keys: not bottom-right
    (50, 30, 10, dict(causal=True)),
    (37, 70, 45, dict(causal=True)),          # rows past the last key
    (37, 70, -20, dict(causal=True)),         # the first rows see nothing
    (64, 64, 17, dict(window=(9, 3))),
    (64, 64, -5, dict(causal=True, window=(12, None))),
    (33, 65, 30, dict(causal=True, chunk=16)),
]


@pytest.mark.parametrize("Tq,Tk,off,kw", CASES)
def test_forward_equals_the_dense_mask_and_the_reference(rng, isa, Tq, Tk, off, kw):
    q, k, v = _qkv(rng, 2, 4, 2, Tq, Tk)
    chunk = kw.pop("chunk", None)
    dense = placed_mask(Tq, Tk, off, **kw)
    if chunk is not None:
        p = np.arange(Tq)[:, None] + off
        dense &= (p // chunk) == (np.arange(Tk)[None, :] // chunk)
    out, w, lse = mhattn.attention(q, k, v, q_offset=off, chunk=chunk, return_weights=True,
                                   return_lse=True, **kw)
    m = np.broadcast_to(dense, (2, 1, Tq, Tk))
    dout, dw, dlse = mhattn.attention(q, k, v, mask=m, return_weights=True, return_lse=True)
    np.testing.assert_allclose(out, dout, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(w, dw, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(dlse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], dlse[np.isfinite(dlse)], rtol=1e-12)
    ref, _, rlse = R.projected_attention(q, k, v, q_offset=off, chunk=chunk, **kw)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(rlse))
    # A row that sees no key: lse -inf and out 0 (what merge_attention needs).
    empty = ~dense.any(axis=1)
    assert np.all(np.isneginf(lse[:, :, empty])) and np.all(out[:, :, empty] == 0)


@pytest.mark.parametrize("Tq,Tk,off,kw", CASES[:7])
def test_gradients_equal_the_dense_mask(rng, isa, Tq, Tk, off, kw):
    q, k, v = _qkv(rng, 2, 4, 2, Tq, Tk)
    g = rng.standard_normal(q.shape)
    m = np.broadcast_to(placed_mask(Tq, Tk, off, **kw), (2, 1, Tq, Tk))
    got = mhattn.attention_grad(g, q, k, v, q_offset=off, **kw)
    want = mhattn.attention_grad(g, q, k, v, mask=m)
    for name in ("q", "k", "v"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-11, atol=1e-12,
                                   err_msg=name)


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
def test_a_block_of_the_whole_call_sees_the_whole_calls_rules(rng, isa, dtype, tol):
    """Queries q0.. against keys k0.. with q_offset = q0 + (T_k - T_q) - k0:
    the block's scores, weights and ALiBi distances are the whole call's."""
    Tq, Tk, H = 45, 60, 4
    q, k, v = _qkv(rng, 1, H, H, Tq, Tk, dtype=dtype)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    kw = dict(causal=True, window=(25, None), alibi_slopes=slopes, softcap=5.0)
    _, w = mhattn.attention(q, k, v, return_weights=True, **kw)
    for q0, q1, k0, k1 in [(10, 30, 20, 45), (0, 45, 0, 60), (30, 45, 40, 60), (0, 9, 50, 60)]:
        off = q0 + (Tk - Tq) - k0
        qb, kb, vb = q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1]
        out, lse = mhattn.attention(qb, kb, vb, q_offset=off, return_lse=True, **kw)
        # The block's softmax is the whole call's weights renormalised over its keys.
        part = w[:, :, q0:q1, k0:k1].astype(np.float64)
        s = part.sum(-1, keepdims=True)
        want = np.divide(part, s, out=np.zeros_like(part), where=s > 0) @ vb.astype(np.float64)
        np.testing.assert_allclose(out, want, rtol=tol * 10, atol=tol * 10)
        assert np.array_equal(np.isneginf(lse), s[..., 0] == 0)


def test_gradient_of_blocks_sum_to_the_whole_calls(rng, isa):
    """attention_grad of each (query block, key block) with the whole call's
    out and lse sums to the whole call's gradients: mhattn.dask's backward."""
    Tq = Tk = 50
    q, k, v = _qkv(rng, 2, 4, 2, Tq, Tk)
    g = rng.standard_normal(q.shape)
    out, lse = mhattn.attention(q, k, v, causal=True, return_lse=True)
    want = mhattn.attention_grad(g, q, k, v, causal=True)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    cuts = [0, 17, 33, 50]
    for a, b in zip(cuts, cuts[1:]):
        for c, d in zip(cuts, cuts[1:]):
            r = mhattn.attention_grad(g[:, :, a:b], q[:, :, a:b], k[:, :, c:d], v[:, :, c:d],
                                      causal=True, q_offset=a - c, out=out[:, :, a:b],
                                      lse=lse[:, :, a:b])
            dq[:, :, a:b] += r["q"]
            dk[:, :, c:d] += r["k"]
            dv[:, :, c:d] += r["v"]
    for name, got in (("q", dq), ("k", dk), ("v", dv)):
        np.testing.assert_allclose(got, want[name], rtol=1e-11, atol=1e-12, err_msg=name)


def test_none_is_bottom_right(rng):
    q, k, v = _qkv(rng, 1, 2, 2, 5, 9)
    a = mhattn.attention(q, k, v, causal=True)
    b = mhattn.attention(q, k, v, causal=True, q_offset=4)
    np.testing.assert_array_equal(a, b)


def test_refused_with_packed_sequences_and_relative_bias(rng):
    q, k, v = _qkv(rng, 1, 2, 2, 6, 6)
    cu = np.array([0, 2, 6])
    with pytest.raises(ValueError, match="q_offset.*packed sequences"):
        mhattn.attention(q[0], k[0], v[0], q_offset=1, cu_seqlens=cu, key_cu_seqlens=cu)
    rel = mhattn.RelativeBias(np.ones((32, 2)))
    with pytest.raises(ValueError, match="q_offset.*relative bias"):
        mhattn.attention(q, k, v, q_offset=1, relative_bias=rel)
    with pytest.raises(TypeError, match="q_offset"):
        mhattn.attention(q, k, v, q_offset=1.0)


def test_refused_with_a_paged_cache(rng):
    """A paged cache aligns each sequence's queries to its own length."""
    cache = mhattn.PagedKVCache(4, 8, 2, 8)
    ids = [cache.add_sequence()]
    q = rng.standard_normal((1, 2, 1, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="q_offset: not with cache="):
        mhattn.attention(q, None, None, cache=cache, sequence_ids=ids, q_offset=0)
