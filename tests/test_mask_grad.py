"""Gradients of an additive mask (issue 38, item 2): ``mask_grad=True``.

The core writes dL/dmask at every (b, h, i, j) (dS, the softmax's backward,
before the softcap's derivative and the scale) and NumPy sums it over the
axes the mask was broadcast along. Checked by finite differences on the
reference, against torch autograd of the same formula, for any thread count
and on every ISA path.
"""
import numpy as np
import pytest

import mhattn
from mhattn import reference as R
from numgrad import central_differences as _fd
from threadcounts import at_thread_counts


B, T, D, H = 2, 5, 8, 2

# (mask shape, batched call)
SHAPES = [((T, T), True), ((B, 1, 1, T), True), ((1, H, T, T), True), ((B, H, T, T), True),
          ((1, H, 1, T), True), ((T,), True), ((T, T), False), ((H, T, T), False)]


@pytest.mark.parametrize("shape,batched", SHAPES)
@pytest.mark.parametrize("opts", [{}, dict(causal=True, softcap=3.0),
                                  dict(window=(2, 0), sinks=np.array([0.3, -0.2]),
                                       key_lengths=np.array([5, 3])),
                                  dict(dropout=0.3, seed=5)])
def test_mha_mask_grad_by_finite_differences(rng, shape, batched, opts):
    if not batched:
        opts = {k: v for k, v in opts.items() if k != "key_lengths"}
    x = rng.standard_normal((B, T, D) if batched else (T, D))
    w = [rng.standard_normal((D, D)) * 0.5 for _ in range(4)]
    mask = rng.standard_normal(shape)
    G = rng.standard_normal(x.shape)
    kw = dict(num_heads=H, **opts)
    got = mhattn.multi_head_attention_grad(G, x, *w, mask=mask, mask_grad=True, **kw)
    assert got["mask"].shape == shape and got["mask"].dtype == np.float64

    def loss(m):
        return float((R.multi_head_attention(x, *w, mask=m, **kw) * G).sum())
    np.testing.assert_allclose(got["mask"], _fd(loss, mask), rtol=1e-6, atol=1e-8)
    # the other gradients are those of the call without mask_grad, bitwise
    plain = mhattn.multi_head_attention_grad(G, x, *w, mask=mask, **kw)
    assert "mask" not in plain
    for n in plain:
        np.testing.assert_array_equal(got[n], plain[n], err_msg=n)


def test_context_backward_and_the_layer(rng):
    x = rng.standard_normal((B, T, 16)).astype(np.float32)
    mask = rng.standard_normal((T, T)).astype(np.float32)
    layer = mhattn.MultiHeadAttention(16, 4, seed=0)
    out, ctx = layer(x, mask=mask, return_context=True)
    g = np.ones_like(out)
    a = layer.backward(g, ctx, mask_grad=True)
    b = mhattn.backward(g, ctx, mask_grad=True)
    c = mhattn.multi_head_attention_grad(g, x, **layer.arguments(), mask=mask, mask_grad=True)
    for n in a:
        np.testing.assert_array_equal(a[n], b[n], err_msg=n)
        np.testing.assert_array_equal(a[n], c[n], err_msg=n)
    assert a["mask"].shape == (T, T) and a["mask"].dtype == np.float32


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_attention_mask_grad_against_torch_autograd(rng, layout):
    torch = pytest.importorskip("torch")
    Bq, Hq, G, Tq, Tk, d = 2, 4, 2, 7, 9, 8
    q = rng.standard_normal((Bq, Hq, Tq, d))
    k = rng.standard_normal((Bq, G, Tk, d))
    v = rng.standard_normal((Bq, G, Tk, d))
    go = rng.standard_normal((Bq, Hq, Tq, d))
    bias = rng.standard_normal((1, Hq, Tq, Tk))
    tq, tk, tv, tb = (torch.tensor(a, requires_grad=True) for a in (q, k, v, bias))
    kk, vv = (t.repeat_interleave(Hq // G, dim=1) for t in (tk, tv))
    s = tq @ kk.transpose(-1, -2) / np.sqrt(d) + tb
    s = s.masked_fill(~torch.tensor(np.tril(np.ones((Tq, Tk), bool), Tk - Tq)),
                      float("-inf"))
    (torch.softmax(s, -1) @ vv).backward(torch.tensor(go))
    sw = (lambda a: np.ascontiguousarray(a.swapaxes(1, 2))) if layout == "bthd" else \
        (lambda a: a)
    got = mhattn.attention_grad(sw(go), sw(q), sw(k), sw(v), layout=layout, causal=True,
                                mask=bias, mask_grad=True)
    np.testing.assert_allclose(got["mask"], tb.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got["q"], sw(tq.grad.numpy()), rtol=1e-10, atol=1e-12)
    # with the forward's lse and out: the same bits
    out, lse = mhattn.attention(sw(q), sw(k), sw(v), layout=layout, causal=True, mask=bias,
                                return_lse=True)
    again = mhattn.attention_grad(sw(go), sw(q), sw(k), sw(v), layout=layout, causal=True,
                                  mask=bias, mask_grad=True, lse=lse, out=out)
    np.testing.assert_array_equal(again["mask"], got["mask"])


def test_unseen_keys_get_zero_and_threads_change_no_bit(rng):
    x = rng.standard_normal((2, 150, 16)).astype(np.float32)
    w = [(rng.standard_normal((16, 16)) * 0.3).astype(np.float32) for _ in range(4)]
    mask = rng.standard_normal((2, 4, 150, 150)).astype(np.float32)
    g = rng.standard_normal(x.shape).astype(np.float32)
    kw = dict(num_heads=4, causal=True, window=(40, 0), mask=mask, mask_grad=True,
              key_lengths=np.array([150, 90]))
    runs = at_thread_counts(lambda: mhattn.multi_head_attention_grad(g, x, *w, **kw))
    for r in runs[1:]:
        for n in r:
            np.testing.assert_array_equal(r[n], runs[0][n], err_msg=n)
    dm = runs[0]["mask"]
    i, j = np.indices((150, 150))
    unseen = (j > i) | (j < i - 40)
    assert np.all(dm[:, :, unseen] == 0) and np.all(dm[1, :, :, 90:] == 0)
    assert np.count_nonzero(dm[0][:, ~unseen]) > 0.99 * dm[0][:, ~unseen].size


def test_every_isa_path_agrees_with_float64(rng, isa):
    q = rng.standard_normal((1, 2, 70, 16))
    k = rng.standard_normal((1, 2, 70, 16))
    v = rng.standard_normal((1, 2, 70, 16))
    go = rng.standard_normal((1, 2, 70, 16))
    mask = rng.standard_normal((70, 70))
    ref = mhattn.attention_grad(go, q, k, v, mask=mask, mask_grad=True, softcap=4.0)["mask"]
    got = mhattn.attention_grad(*(a.astype(np.float32) for a in (go, q, k, v)),
                                mask=mask.astype(np.float32), mask_grad=True,
                                softcap=4.0)["mask"]
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5)


def test_half_calls_round_the_mask_gradient_to_a_half_mask(rng):
    x = rng.standard_normal((T, D)).astype(np.float16)
    w = [(rng.standard_normal((D, D)) * 0.5).astype(np.float16) for _ in range(4)]
    g = np.ones((T, D), np.float16)
    for mdt, want in ((np.float16, np.float16), (np.float32, np.float32)):
        got = mhattn.multi_head_attention_grad(g, x, *w, num_heads=H,
                                               mask=np.zeros((T, T), mdt), mask_grad=True)
        assert got["mask"].dtype == want


def test_bad_requests_name_mask_grad(rng):
    x = rng.standard_normal((T, D))
    w = [rng.standard_normal((D, D)) for _ in range(4)]
    g = np.ones((T, D))
    with pytest.raises(ValueError, match="mask_grad: only an additive .* mask is bool"):
        mhattn.multi_head_attention_grad(g, x, *w, num_heads=H, mask=np.ones((T, T), bool),
                                         mask_grad=True)
    with pytest.raises(ValueError, match="mask_grad: .* mask is None"):
        mhattn.multi_head_attention_grad(g, x, *w, num_heads=H, mask_grad=True)
    with pytest.raises(TypeError, match="mask_grad"):
        mhattn.multi_head_attention_grad(g, x, *w, num_heads=H, mask=np.zeros((T, T)),
                                         mask_grad="yes")
    q = rng.standard_normal((1, 2, T, 4))
    with pytest.raises(ValueError, match="mask_grad: .* mask is None"):
        mhattn.attention_grad(q, q, q, q, mask_grad=True)
    from mhattn import _C
    with pytest.raises(ValueError, match="want_dmask"):
        out, ctx = mhattn.multi_head_attention(x, *w, num_heads=H, return_context=True)
        c = ctx.call
        from mhattn._internal.core import head_arrays
        dk, dv, sc = head_arrays(c)
        _C.backward(g[None], c.x, None, None, c.wq.fused(), c.wk.fused(), c.wv.fused(),
                    c.w_o, ctx.q, ctx.k, ctx.v, ctx.concat, ctx.lse, dk, dv, sc, None,
                    False, None, None, False, False, False, False, want_dmask=True)
