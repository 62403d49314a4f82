"""ALiBi slopes per packed sequence (issue 39, item 3): with ``cu_seqlens``,
``alibi_slopes`` may be (num_sequences, H), one row per sequence, as
FlashAttention's varlen calls take them. Each sequence's rows are those of
the sequence run alone with its own slopes (bitwise: the same tiles' sums),
forward and backward, for any thread count and on every ISA path.
"""
import numpy as np
import pytest

import mhattn
from mhattn import reference as R
from threadcounts import at_thread_counts

CU = np.array([0, 5, 5, 17, 30, 64])       # an empty sequence, one past a block
SPANS = list(zip(CU[:-1], CU[1:]))


@pytest.mark.parametrize("causal", [False, True])
def test_each_sequence_as_alone(rng, causal):
    x = rng.standard_normal((64, 16))
    w = [rng.standard_normal((16, 16)) * 0.3 for _ in range(4)]
    slopes = rng.random((len(SPANS), 4))
    kw = dict(num_heads=4, causal=causal)
    out = mhattn.multi_head_attention(x, *w, cu_seqlens=CU, alibi_slopes=slopes, **kw)
    np.testing.assert_allclose(out, R.multi_head_attention(
        x, *w, cu_seqlens=CU, alibi_slopes=slopes, **kw), rtol=1e-12, atol=1e-13)
    G = rng.standard_normal(out.shape)
    g = mhattn.multi_head_attention_grad(G, x, *w, cu_seqlens=CU, alibi_slopes=slopes, **kw)
    dw = 0
    for s, (a, e) in enumerate(SPANS):
        if a == e:
            continue
        alone = mhattn.multi_head_attention(x[a:e], *w, alibi_slopes=slopes[s], **kw)
        np.testing.assert_array_equal(out[a:e], alone)
        ga = mhattn.multi_head_attention_grad(G[a:e], x[a:e], *w, alibi_slopes=slopes[s],
                                              **kw)
        np.testing.assert_allclose(g["x"][a:e], ga["x"], rtol=1e-11, atol=1e-12)
        dw = dw + ga["w_q"]
    np.testing.assert_allclose(g["w_q"], dw, rtol=1e-10, atol=1e-11)


def test_attention_on_projected_tensors_and_threads(rng):
    q = rng.standard_normal((4, 64, 8)).astype(np.float32)     # (H, total, d), unbatched
    k = rng.standard_normal((2, 64, 8)).astype(np.float32)
    slopes = rng.random((len(SPANS), 4))
    kw = dict(cu_seqlens=CU, alibi_slopes=slopes, causal=True)
    def call():
        out = mhattn.attention(q, k, k, **kw)
        return out, mhattn.attention_grad(np.ones_like(out), q, k, k, **kw)
    runs = at_thread_counts(call, (1, 3))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    for n in "qkv":
        np.testing.assert_array_equal(runs[0][1][n], runs[1][1][n])
    ref = R.projected_attention(q.astype(np.float64), k.astype(np.float64),
                                k.astype(np.float64), **kw)[0]
    np.testing.assert_allclose(runs[0][0], ref, rtol=2e-5, atol=2e-6)


def test_every_isa_path(rng, isa):
    q = rng.standard_normal((4, 64, 8))
    slopes = rng.random((len(SPANS), 4))
    kw = dict(cu_seqlens=CU, alibi_slopes=slopes)
    np.testing.assert_allclose(mhattn.attention(q, q, q, **kw),
                               R.projected_attention(q, q, q, **kw)[0], rtol=1e-12,
                               atol=1e-13)


def test_shared_slopes_still_work_and_bad_rows_are_named(rng):
    q = rng.standard_normal((4, 64, 8))
    one = rng.random(4)
    np.testing.assert_array_equal(
        mhattn.attention(q, q, q, cu_seqlens=CU, alibi_slopes=one),
        mhattn.attention(q, q, q, cu_seqlens=CU, alibi_slopes=np.tile(one, (5, 1))))
    with pytest.raises(ValueError, match=r"alibi_slopes: expected shape \(4,\) .* or "
                                         r"\(5, 4\) \(one row per packed sequence\), "
                                         r"got \(6, 4\)"):
        mhattn.attention(q, q, q, cu_seqlens=CU, alibi_slopes=np.ones((6, 4)))
