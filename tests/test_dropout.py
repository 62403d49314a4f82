"""Dropout on the attention weights (issue 38, item 1): ``dropout=p``, ``seed=``.

The keep mask is a counter-based hash of (seed, b, h, i, j) (csrc/core/rules.h),
which the reference implements in NumPy (mhattn.reference.dropout_keep): the
forward is checked against the reference with the same mask, the mask itself
exactly (the zeros of the returned weights), the backward by finite
differences with the seed fixed and against torch autograd of the same
formula, and the hash by its statistics.
"""
import numpy as np
import pytest

import mhattn
from mhattn import reference as R
from numgrad import central_differences as _fd


def _inputs(rng, B=2, T=9, d=16, dtype=np.float64, Tk=None):
    x = rng.standard_normal((B, T, d)).astype(dtype)
    w = [(rng.standard_normal((d, d)) * 0.4).astype(dtype) for _ in range(4)]
    kv = None if Tk is None else rng.standard_normal((B, Tk, d)).astype(dtype)
    return x, w, kv


# Each existing option, with dropout on top.
OPTIONS = {
    "plain": {},
    "causal": dict(causal=True),
    "gqa_window": dict(num_kv_heads=2, causal=True, window=(3, 0)),
    "sinks_softcap": dict(sinks=np.array([0.5, -1.0, 0.0, 2.0]), softcap=5.0),
    "alibi_keylen": dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]),
                         key_lengths=np.array([9, 4])),
    "bool_mask": dict(mask=np.tril(np.ones((9, 9), bool), 2)),
    "float_mask": dict(mask=np.linspace(-1, 1, 81).reshape(9, 9)),
    "rope_qknorm": dict(rope=mhattn.RoPE(), q_norm=np.linspace(0.5, 1.5, 4),
                        k_norm=np.linspace(1.5, 0.5, 4), causal=True),
    "layer_norm": dict(q_norm=np.linspace(0.5, 1.5, 4), norm_type="layer"),
    "key_mask": dict(key_mask=np.array([[1, 1, 0, 1, 1, 1, 1, 0, 1]] * 2, bool)),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_forward_is_the_reference_with_the_same_mask(rng, name, dtype):
    x, w, _ = _inputs(rng, dtype=dtype)
    if "num_kv_heads" in OPTIONS[name]:
        w = [w[0], w[1][:, :8], w[2][:, :8], w[3]]
    kw = dict(num_heads=4, dropout=0.3, seed=1234, **OPTIONS[name])
    out, wts = mhattn.multi_head_attention(x, *w, return_weights=True, **kw)
    rout, rwts = R.multi_head_attention(x, *w, return_weights=True, **kw)
    tol = 1e-12 if dtype == np.float64 else 2e-5
    np.testing.assert_allclose(out, rout, rtol=tol, atol=tol)
    np.testing.assert_allclose(wts, rwts, rtol=tol, atol=tol)
    # the mask, exactly: a weight is 0 where the hash dropped it or the rules
    # block it (a kept visible weight may underflow only in a far tail)
    np.testing.assert_array_equal(wts == 0, rwts == 0)
    # and dropout did drop weights that the rules let through
    plain = mhattn.multi_head_attention(x, *w, return_weights=True,
                                        **{**kw, "dropout": 0.0})[1]
    dropped = (plain > 0) & (wts == 0)
    assert 0.15 < dropped.sum() / (plain > 0).sum() < 0.45
    # the kept ones are the softmax's over 1 - p
    kept = wts > 0
    np.testing.assert_allclose(wts[kept], plain[kept] / dtype(0.7), rtol=10 * tol, atol=tol)


def test_out_is_the_dropped_weights_times_v(rng):
    """out = (weights after dropout) @ V W^O: the weights are what attended."""
    x, w, _ = _inputs(rng)
    out, wts = mhattn.multi_head_attention(x, *w, num_heads=4, dropout=0.5, seed=9,
                                           return_weights=True)
    v = (x @ w[2]).reshape(2, 9, 4, 4).transpose(0, 2, 1, 3)
    concat = (wts @ v).transpose(0, 2, 1, 3).reshape(2, 9, 16)
    np.testing.assert_allclose(out, concat @ w[3], rtol=1e-12, atol=1e-12)


def test_return_weights_does_not_change_out_and_mask_is_the_hash(rng):
    x, w, _ = _inputs(rng, B=1, T=70)
    kw = dict(num_heads=4, dropout=0.2, seed=2 ** 64 - 1, causal=True)
    a = mhattn.multi_head_attention(x, *w, **kw)
    b, wts = mhattn.multi_head_attention(x, *w, return_weights=True, **kw)
    np.testing.assert_array_equal(a, b)
    plain = mhattn.multi_head_attention(x, *w, return_weights=True,
                                        **{**kw, "dropout": 0.0})[1]
    for h in range(4):
        keep = R.dropout_keep(2 ** 64 - 1, 0, h, 70, 70, 0.2)
        np.testing.assert_array_equal(wts[0, h] > 0, keep & (plain[0, h] > 0))


def test_seed_decides_the_mask(rng):
    x, w, _ = _inputs(rng)
    kw = dict(num_heads=4, dropout=0.4, return_weights=True)
    w1 = mhattn.multi_head_attention(x, *w, seed=1, **kw)[1]
    w1b = mhattn.multi_head_attention(x, *w, seed=1, **kw)[1]
    w2 = mhattn.multi_head_attention(x, *w, seed=2, **kw)[1]
    np.testing.assert_array_equal(w1, w1b)
    assert not np.array_equal(w1 == 0, w2 == 0)
    # a Generator gives one seed drawn from it, so equal states give equal masks
    g1 = mhattn.multi_head_attention(x, *w, seed=np.random.default_rng(5), **kw)[1]
    g2 = mhattn.multi_head_attention(x, *w, seed=np.random.default_rng(5), **kw)[1]
    s = int(np.random.default_rng(5).integers(0, 2 ** 64, dtype=np.uint64))
    np.testing.assert_array_equal(g1, g2)
    np.testing.assert_array_equal(g1, mhattn.multi_head_attention(x, *w, seed=s, **kw)[1])
    # no seed: fresh entropy, a new mask each call
    n1 = mhattn.multi_head_attention(x, *w, **kw)[1]
    n2 = mhattn.multi_head_attention(x, *w, **kw)[1]
    assert not np.array_equal(n1 == 0, n2 == 0)


def test_dropout_zero_is_bitwise_no_dropout(rng):
    x, w, _ = _inputs(rng, dtype=np.float32)
    a = mhattn.multi_head_attention(x, *w, num_heads=4, causal=True)
    for kw in (dict(dropout=0.0), dict(dropout=0), dict(dropout=0.0, seed=3)):
        np.testing.assert_array_equal(
            a, mhattn.multi_head_attention(x, *w, num_heads=4, causal=True, **kw))


@pytest.mark.parametrize("Tq,Tk", [(1, 3000), (3, 700), (200, 200), (1, 5)])
def test_attention_every_path_is_the_reference(rng, isa, Tq, Tk):
    """Decode kernels (one row, split-K with GQA heads grouped), the tiles and
    their tails: each draws the mask of its own (b, h, i, j)."""
    q = rng.standard_normal((2, 4, Tq, 16))
    k = rng.standard_normal((2, 2, Tk, 16))
    v = rng.standard_normal((2, 2, Tk, 16))
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 3e-5)):
        a = [t.astype(dtype) for t in (q, k, v)]
        out, wts = mhattn.attention(*a, dropout=0.25, seed=77, return_weights=True)
        rout, rwts, _ = R.projected_attention(*a, dropout=0.25, seed=77)
        np.testing.assert_allclose(out, rout, rtol=tol, atol=tol)
        np.testing.assert_array_equal(wts == 0, rwts == 0)
        # weights are not wanted: the decode / split-K kernels run
        np.testing.assert_allclose(mhattn.attention(*a, dropout=0.25, seed=77), out,
                                   rtol=tol, atol=tol)


def test_bits_do_not_depend_on_the_thread_count(rng):
    x, w, _ = _inputs(rng, B=2, T=300, dtype=np.float32)
    w = [w[0], w[1][:, :8], w[2][:, :8], w[3]]
    g = rng.standard_normal((2, 300, 16)).astype(np.float32)
    kw = dict(num_heads=4, num_kv_heads=2, causal=True, dropout=0.1, seed=11)
    before = mhattn.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 3):
            mhattn.set_num_threads(n)
            out = mhattn.multi_head_attention(x, *w, **kw)
            grads = mhattn.multi_head_attention_grad(g, x, *w, **kw)
            dec = mhattn.attention(x[:, None, -1:], x[:, None], x[:, None], dropout=0.3,
                                   seed=4)
            runs.append((out, grads, dec))
    finally:
        mhattn.set_num_threads(before)
    for out, grads, dec in runs[1:]:
        np.testing.assert_array_equal(out, runs[0][0])
        np.testing.assert_array_equal(dec, runs[0][2])
        for name in grads:
            np.testing.assert_array_equal(grads[name], runs[0][1][name], err_msg=name)


@pytest.mark.parametrize("name", ["plain", "causal", "gqa_window", "sinks_softcap",
                                  "float_mask", "rope_qknorm"])
def test_mha_grad_by_finite_differences(rng, name):
    x, w, _ = _inputs(rng, B=1, T=6, d=8)
    opts = {k: v for k, v in OPTIONS[name].items()}
    if "mask" in opts:
        opts["mask"] = opts["mask"][:6, :6]
    if "sinks" in opts:
        opts["sinks"] = opts["sinks"][:2]
    kw = dict(num_heads=2, dropout=0.35, seed=99, **opts)
    if kw.get("num_kv_heads") == 2:
        kw["num_kv_heads"] = 1
        w = [w[0], w[1][:, :4], w[2][:, :4], w[3]]
    G = rng.standard_normal((1, 6, 8))
    got = mhattn.multi_head_attention_grad(G, x, *w, **kw)

    def loss_x(xx):
        return float((R.multi_head_attention(xx, *w, **kw) * G).sum())
    np.testing.assert_allclose(got["x"], _fd(loss_x, x), rtol=1e-6, atol=1e-7)
    for i, n in ((0, "w_q"), (2, "w_v")):
        def loss_w(ww, i=i):
            ws = list(w)
            ws[i] = ww
            return float((R.multi_head_attention(x, *ws, **kw) * G).sum())
        np.testing.assert_allclose(got[n], _fd(loss_w, w[i]), rtol=1e-6, atol=1e-7,
                                   err_msg=n)
    if "sinks" in kw:
        def loss_s(s):
            return float((R.multi_head_attention(x, *w, **{**kw, "sinks": s}) * G).sum())
        np.testing.assert_allclose(got["sinks"], _fd(loss_s, kw["sinks"]), rtol=1e-6,
                                   atol=1e-7)


def test_context_backward_is_the_one_call(rng):
    x, w, _ = _inputs(rng, dtype=np.float32)
    g = rng.standard_normal(x.shape).astype(np.float32)
    kw = dict(num_heads=4, dropout=0.2, seed=8, causal=True)
    out, ctx = mhattn.multi_head_attention(x, *w, return_context=True, **kw)
    a = mhattn.backward(g, ctx)
    b = mhattn.multi_head_attention_grad(g, x, *w, **kw)
    for n in a:
        np.testing.assert_array_equal(a[n], b[n], err_msg=n)
    # a context drawn without a seed keeps the one it drew
    out, ctx = mhattn.multi_head_attention(x, *w, return_context=True, num_heads=4,
                                           dropout=0.2)
    s = ctx.call.var.seed
    np.testing.assert_array_equal(out, mhattn.multi_head_attention(x, *w, num_heads=4,
                                                                   dropout=0.2, seed=s))


def test_attention_grad_by_finite_differences_and_with_lse(rng):
    q = rng.standard_normal((1, 2, 5, 4))
    k = rng.standard_normal((1, 1, 7, 4))
    v = rng.standard_normal((1, 1, 7, 4))
    go = rng.standard_normal((1, 2, 5, 4))
    kw = dict(dropout=0.3, seed=21, causal=True, sinks=np.array([0.2, -0.4]))
    got = mhattn.attention_grad(go, q, k, v, **kw)
    out, lse = mhattn.attention(q, k, v, return_lse=True, **kw)
    with_lse = mhattn.attention_grad(go, q, k, v, lse=lse, out=out, **kw)
    for n, arr in (("q", q), ("k", k), ("v", v)):
        def loss(a, n=n):
            args = dict(q=q, k=k, v=v)
            args[n] = a
            return float((R.projected_attention(**args, **kw)[0] * go).sum())
        np.testing.assert_allclose(got[n], _fd(loss, arr), rtol=1e-6, atol=1e-8, err_msg=n)
        np.testing.assert_array_equal(with_lse[n], got[n])


def test_backward_against_torch_autograd_of_the_same_mask(rng):
    """torch computes softmax(s) * keep / (1 - p) @ v with autograd, keep taken
    from the reference's hash: the gradients of q, k, v agree."""
    torch = pytest.importorskip("torch")
    B, H, T, d, p = 2, 3, 40, 8, 0.2
    q, k, v, go = (rng.standard_normal((B, H, T, d)) for _ in range(4))
    keep = np.stack([np.stack([R.dropout_keep(5, b, h, T, T, p) for h in range(H)])
                     for b in range(B)])
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    s = tq @ tk.transpose(-1, -2) / np.sqrt(d)
    s = s.masked_fill(~torch.tensor(np.tril(np.ones((T, T), bool))), float("-inf"))
    z = torch.softmax(s, -1) * torch.tensor(keep) / (1 - p)
    (z @ tv).backward(torch.tensor(go))
    got = mhattn.attention_grad(go, q, k, v, causal=True, dropout=p, seed=5)
    for n, t in (("q", tq), ("k", tk), ("v", tv)):
        np.testing.assert_allclose(got[n], t.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=n)


def test_keep_rate_and_the_mean_over_seeds(rng):
    # the keep rate of the hash: 1 - p within 5 binomial sigmas, per head
    for p in (0.1, 0.5, 0.9):
        for h in range(3):
            keep = R.dropout_keep(123, 0, h, 300, 300, p)
            n = keep.size
            assert abs(keep.mean() - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n), (p, h)
    # neighbours are uncorrelated: along keys, along queries, across heads
    a = R.dropout_keep(7, 0, 0, 400, 400, 0.5).astype(float)
    b = R.dropout_keep(7, 0, 1, 400, 400, 0.5).astype(float)
    bound = 5 / np.sqrt(a.size)
    for u, w in ((a[:, :-1], a[:, 1:]), (a[:-1], a[1:]), (a, b)):
        assert abs(np.corrcoef(u.ravel(), w.ravel())[0, 1]) < bound
    # and the C core's weights keep the same rate
    q = rng.standard_normal((1, 1, 256, 8))
    w = mhattn.attention(q, q, q, dropout=0.3, seed=1, return_weights=True)[1]
    assert abs((w > 0).mean() - 0.7) < 5 * np.sqrt(0.21 / w.size)
    # dropout is unbiased: the mean of out over seeds is out without dropout
    x, ws, _ = _inputs(rng, B=1, T=5, d=8)
    plain = mhattn.multi_head_attention(x, *ws, num_heads=2)
    runs = np.stack([mhattn.multi_head_attention(x, *ws, num_heads=2, dropout=0.5, seed=s)
                     for s in range(2000)])
    se = runs.std(axis=0) / np.sqrt(len(runs))
    assert np.all(np.abs(runs.mean(axis=0) - plain) < 5 * se + 1e-12)


def test_packed_sequences_and_the_trace(rng):
    x = rng.standard_normal((10, 8))
    w = [rng.standard_normal((8, 8)) * 0.5 for _ in range(4)]
    kw = dict(num_heads=2, dropout=0.4, seed=3, cu_seqlens=np.array([0, 4, 10]),
              causal=True)
    out, wts = mhattn.multi_head_attention(x, *w, return_weights=True, **kw)
    rout, rwts = R.multi_head_attention(x, *w, return_weights=True, **kw)
    np.testing.assert_allclose(out, rout, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(wts == 0, rwts == 0)
    t = mhattn.trace(x, *w, **kw)
    np.testing.assert_array_equal(t.weights, wts)
    np.testing.assert_array_equal(t.output, out)
    for h in range(2):
        np.testing.assert_array_equal(t.keep[h], R.dropout_keep(3, 0, h, 10, 10, 0.4))
    assert "keep" in t.keys() and "keep" not in mhattn.trace(x, *w, num_heads=2).keys()


def test_layer_applies_dropout_in_training_mode_only(rng):
    layer = mhattn.MultiHeadAttention(16, 4, dropout=0.3, seed=0, dtype=np.float64)
    assert layer.training is False and "dropout=0.3" in repr(layer)
    x = rng.standard_normal((2, 7, 16))
    plain = mhattn.multi_head_attention(x, **layer.arguments())
    np.testing.assert_array_equal(layer(x), plain)            # eval: the default
    assert layer.train() is layer and layer.training
    out, wts = layer(x, return_weights=True)
    assert (wts == 0).any() and not np.allclose(out, plain)
    # a seed per call gives that call's mask
    np.testing.assert_array_equal(
        layer(x, seed=4), mhattn.multi_head_attention(x, **layer.arguments(), dropout=0.3,
                                                      seed=4))
    # a seeded layer trains reproducibly: the same seeds in the same order
    a = mhattn.MultiHeadAttention(16, 4, dropout=0.3, seed=0, dtype=np.float64).train()
    b = mhattn.MultiHeadAttention(16, 4, dropout=0.3, seed=0, dtype=np.float64).train()
    first, second = a(x), a(x)
    np.testing.assert_array_equal(first, b(x))
    np.testing.assert_array_equal(second, b(x))
    assert not np.array_equal(first, second)
    # the backward of a training call regenerates its mask
    out, ctx = a(x, return_context=True)
    g = a.backward(np.ones_like(out), ctx)
    s = ctx.call.var.seed
    ref = mhattn.multi_head_attention_grad(np.ones_like(out), x, **a.arguments(),
                                           dropout=0.3, seed=s)
    np.testing.assert_array_equal(g["x"], ref["x"])
    assert layer.eval() is layer and not layer.training
    np.testing.assert_array_equal(layer(x), plain)
    half = layer.train().astype(np.float32)
    assert half.training and half.dropout == 0.3


def test_from_torch_takes_the_modules_dropout():
    torch = pytest.importorskip("torch")
    m = torch.nn.MultiheadAttention(16, 4, dropout=0.25)
    layer = mhattn.MultiHeadAttention.from_torch(m)
    assert layer.dropout == 0.25 and not layer.training


def test_cached_step_draws_the_rows_of_the_call(rng):
    """Through a KV cache the new rows are the call's rows 0.. and the keys
    the cache's: the step's weights are the reference's on those indices."""
    x, w, _ = _inputs(rng, B=1, T=6, d=8)
    w = [a[:, :8] for a in w]
    cache = mhattn.KVCache(1, 2, 16, 4, dtype=np.float64)
    mhattn.multi_head_attention(x[:, :4], *w, num_heads=2, cache=cache, causal=True)
    out, wts = mhattn.multi_head_attention(x[:, 4:], *w, num_heads=2, cache=cache,
                                           causal=True, dropout=0.5, seed=2,
                                           return_weights=True)
    plain = mhattn.multi_head_attention(x, *w, num_heads=2, causal=True,
                                        return_weights=True)[1][:, :, 4:]
    for h in range(2):
        keep = R.dropout_keep(2, 0, h, 2, 16, 0.5)[:, :6]
        np.testing.assert_array_equal(wts[0, h, :, :6] > 0, keep & (plain[0, h] > 0))
