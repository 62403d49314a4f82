"""Chunked attention (issue 39, item 2): ``chunk=N``.

Query i sees key j only when ``p_i // N == j // N`` (Llama 4's chunked
layers; FlashAttention 3's ``attention_chunk``, whose test reference
``construct_chunk_mask`` is rewritten below in NumPy as the oracle). Held
to the same call with the chunks written as a dense bool mask (forward and
every gradient), to the reference, by finite differences, through a KV
cache, for any thread count and on every ISA path.
"""
import numpy as np
import pytest

import mhattn
from mhattn import reference as R
from numgrad import central_differences as _fd
from threadcounts import assert_same_bits_at_thread_counts


def chunk_mask(Tq, Tk, n):
    """FlashAttention's construct_chunk_mask, True = visible: the query at
    p = i + sk - sq sees the keys from p - p % n (Python's floor modulo)
    up to that plus n."""
    i = np.arange(Tq)[:, None]
    j = np.arange(Tk)[None, :]
    p = i + Tk - Tq
    left = p - p % n
    return (j >= left) & (j < left + n)


def _qkv(rng, B, H, G, Tq, Tk, d=8, dtype=np.float64):
    q = rng.standard_normal((B, H, Tq, d)).astype(dtype)
    k = rng.standard_normal((B, G, Tk, d)).astype(dtype)
    v = rng.standard_normal((B, G, Tk, d)).astype(dtype)
    return q, k, v


CASES = [  # (Tq, Tk, chunk, extra keywords)
    (70, 70, 16, dict(causal=True)),
    (70, 70, 16, {}),
    (50, 90, 7, dict(causal=True)),
    (90, 50, 13, {}),                       # p_i < 0 for the first rows
    (130, 130, 64, dict(causal=True, window=(20, 0))),
    (64, 64, 200, dict(causal=True)),       # one chunk: plain causal
    (33, 33, 1, {}),                        # each query its own key
]


@pytest.mark.parametrize("Tq,Tk,n,kw", CASES)
def test_attention_equals_the_dense_chunk_mask(rng, Tq, Tk, n, kw):
    q, k, v = _qkv(rng, 2, 4, 2, Tq, Tk)
    dense = np.broadcast_to(chunk_mask(Tq, Tk, n), (2, 1, Tq, Tk))
    out, w, lse = mhattn.attention(q, k, v, chunk=n, return_weights=True, return_lse=True,
                                   **kw)
    dout, dw, dlse = mhattn.attention(q, k, v, mask=dense, return_weights=True,
                                      return_lse=True, **kw)
    np.testing.assert_allclose(out, dout, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(w, dw, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, dlse, rtol=1e-12, atol=1e-13)
    ref = R.projected_attention(q, k, v, chunk=n, **kw)[0]
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)
    g = rng.standard_normal(out.shape)
    got = mhattn.attention_grad(g, q, k, v, chunk=n, **kw)
    want = mhattn.attention_grad(g, q, k, v, mask=dense, **kw)
    for name in ("q", "k", "v"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-11, atol=1e-12,
                                   err_msg=name)


def test_mha_by_finite_differences_and_against_the_reference(rng):
    x = rng.standard_normal((2, 23, 8))
    w = [rng.standard_normal((8, 8)) * 0.5 for _ in range(4)]
    kw = dict(num_heads=2, chunk=6, causal=True, softcap=3.0,
              alibi_slopes=np.array([0.3, 0.1]), sinks=np.array([0.2, -0.1]))
    out = mhattn.multi_head_attention(x, *w, **kw)
    np.testing.assert_allclose(out, R.multi_head_attention(x, *w, **kw), rtol=1e-12,
                               atol=1e-13)
    G = rng.standard_normal(out.shape)
    g = mhattn.multi_head_attention_grad(G, x, *w, **kw)
    for name, arr, at in (("x", x, 0), ("w_q", w[0], 1), ("w_k", w[1], 2)):
        def loss(a, at=at):
            args = [x, *w]
            args[at] = a
            return float((R.multi_head_attention(*args, **kw) * G).sum())
        np.testing.assert_allclose(g[name], _fd(loss, arr), rtol=1e-6, atol=1e-8,
                                   err_msg=name)


def test_packed_sequences_chunk_each_sequence(rng):
    cu = np.array([0, 30, 30, 77])
    x = rng.standard_normal((77, 8))
    w = [rng.standard_normal((8, 8)) * 0.5 for _ in range(4)]
    kw = dict(num_heads=2, chunk=10, causal=True)
    whole = mhattn.multi_head_attention(x, *w, cu_seqlens=cu, **kw)
    for a, e in ((0, 30), (30, 77)):
        np.testing.assert_allclose(whole[a:e], mhattn.multi_head_attention(x[a:e], *w, **kw),
                                   rtol=1e-12, atol=1e-13)


def test_decode_through_a_cache_lines_up_with_the_whole_sequence(rng):
    d, H, T, n = 16, 2, 40, 8
    x = rng.standard_normal((1, T, d))
    w = [rng.standard_normal((d, d)) * 0.3 for _ in range(4)]
    whole = mhattn.multi_head_attention(x, *w, num_heads=H, causal=True, chunk=n)
    cache = mhattn.KVCache(1, H, T, d // H, dtype=np.float64)
    steps = [mhattn.multi_head_attention(x[:, :11], *w, num_heads=H, causal=True, chunk=n,
                                         cache=cache)]
    for t in range(11, T):
        steps.append(mhattn.multi_head_attention(x[:, t:t + 1], *w, num_heads=H, causal=True,
                                                 chunk=n, cache=cache))
    np.testing.assert_allclose(np.concatenate(steps, 1), whole, rtol=1e-12, atol=1e-13)


def test_threads_change_no_bit(rng):
    q, k, v = _qkv(rng, 2, 4, 2, 300, 300, d=32, dtype=np.float32)
    g = rng.standard_normal(q.shape).astype(np.float32)
    assert_same_bits_at_thread_counts(
        lambda: mhattn.attention(q, k, v, chunk=64, causal=True),
        lambda: mhattn.attention_grad(g, q, k, v, chunk=64, causal=True))


def test_every_isa_path(rng, isa):
    q, k, v = _qkv(rng, 1, 4, 2, 150, 150, d=16)
    want = R.projected_attention(q, k, v, chunk=40, causal=True)[0]
    got = mhattn.attention(*(a.astype(np.float32) for a in (q, k, v)), chunk=40, causal=True)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(mhattn.attention(q, k, v, chunk=40, causal=True), want,
                               rtol=1e-12, atol=1e-13)


def test_the_layer_and_trace(rng):
    x = rng.standard_normal((2, 20, 16)).astype(np.float32)
    layer = mhattn.MultiHeadAttention(16, 2, seed=0)
    out = layer(x, chunk=8, causal=True)
    tr = mhattn.trace(x, **layer.arguments(), chunk=8, causal=True)
    np.testing.assert_allclose(tr.output, out, rtol=1e-5, atol=1e-6)
    i, j = np.indices((20, 20))
    seen = (i // 8 == j // 8) & (j <= i)
    assert np.all(tr.weights[:, :, ~seen] == 0) and np.all(tr.weights[:, :, seen] > 0)


def test_bad_chunks_name_chunk(rng):
    q, k, v = _qkv(rng, 1, 2, 2, 4, 4)
    with pytest.raises(ValueError, match="chunk: expected a positive int"):
        mhattn.attention(q, k, v, chunk=0)
    with pytest.raises(TypeError, match="chunk: expected a positive int or None"):
        mhattn.attention(q, k, v, chunk=2.5)
