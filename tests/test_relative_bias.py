"""T5's relative position bias (issue 38, item 3): ``relative_bias=mhattn.RelativeBias(...)``.

Held to transformers' ``T5Attention`` (encoder, decoder, decoder with a
cache: forward and the table's gradient), to the NumPy reference on every
option and kernel path, by finite differences, for any thread count and
on every ISA path.  The buckets are held to transformers' own function for
every distance of several configurations, and the core's buckets to the
reference's, read back exactly from the weights.
"""
import itertools

import numpy as np
import pytest

import mhattn
from mhattn import reference as R
from numgrad import central_differences as _fd
from threadcounts import assert_same_bits_at_thread_counts

B, T, D, H = 2, 9, 16, 4


def _rb(rng, H=H, nb=32, md=128, bidirectional=True, dtype=np.float64):
    return mhattn.RelativeBias(rng.standard_normal((nb, H)).astype(dtype), nb, md,
                               bidirectional)


# ---- the buckets ----------------------------------------------------------

CONFIGS = [(nb, md, bi) for nb, md, bi in itertools.product(
    (4, 8, 16, 32, 33, 64, 128), (2, 8, 16, 20, 64, 100, 128, 1000), (True, False))
    if md >= (nb // 2 if bi else nb)]


def test_reference_buckets_are_transformers_for_every_distance():
    torch = pytest.importorskip("torch")
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    d = np.arange(-5000, 5001)
    for nb, md, bi in CONFIGS:
        want = t5.T5Attention._relative_position_bucket(
            torch.tensor(d), bidirectional=bi, num_buckets=nb, max_distance=md).numpy()
        got = R.relative_position_bucket(d, bi, nb, md)
        np.testing.assert_array_equal(got, want, err_msg=str((nb, md, bi)))


@pytest.mark.parametrize("nb,md,bi", [(32, 128, True), (32, 128, False), (8, 20, True),
                                      (16, 16, False), (33, 100, True)])
def test_core_buckets_are_the_references(nb, md, bi):
    """A one-column table holding each bucket's number, zero q and k: the
    weights' log-ratios read every (i, j)'s bucket back exactly."""
    n = 600
    table = np.arange(nb, dtype=np.float64)[:, None]
    z = np.zeros((1, 1, n, 4))
    _, w = mhattn.attention(z, z, z, relative_bias=mhattn.RelativeBias(table, nb, md, bi),
                            return_weights=True)
    logw = np.log(w[0, 0])
    want = R.relative_position_bucket(np.arange(n)[None, :] - np.arange(n)[:, None], bi, nb,
                                      md)
    got = logw - logw[:, :1] + want[:, :1]
    np.testing.assert_allclose(got, want, atol=1e-9)


# ---- forward and backward against the reference ----------------------------

OPTIONS = [
    {}, dict(causal=True), dict(num_kv_heads=2, causal=True, window=(3, 1)),
    dict(softcap=2.0, alibi_slopes=np.array([0.5, 0.25, 0.1, 0.05])),
    dict(sinks=np.array([0.3, -0.2, 0.0, 1.0]), key_lengths=np.array([9, 4])),
    dict(mask="additive", causal=True), dict(mask="bool"),
    dict(dropout=0.25, seed=11), dict(rope=mhattn.RoPE(), q_norm=np.ones(4)),
    dict(bidirectional=False, causal=True),
]


def _options(rng, opts, Tq=T, Tk=T):
    o = dict(opts)
    if o.get("mask") == "additive":
        o["mask"] = rng.standard_normal((Tq, Tk))
    elif o.get("mask") == "bool":
        o["mask"] = rng.random((B, 1, Tq, Tk)) > 0.3
    bi = o.pop("bidirectional", True)
    return o, bi


def _weights_for(rng, o):
    """w_q, w_k, w_v, w_o (fused), w_k and w_v for the call's kv heads."""
    G = o.get("num_kv_heads", H)
    kv = (D, D // H * G)
    return [rng.standard_normal(s) for s in ((D, D), kv, kv, (D, D))]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("opts", OPTIONS)
def test_mha_against_the_reference(rng, dtype, opts):
    o, bi = _options(rng, opts)
    x = rng.standard_normal((B, T, D)).astype(dtype)
    w = [(a * 0.4).astype(dtype) for a in _weights_for(rng, o)]
    rb = _rb(rng, md=8, nb=8, bidirectional=bi, dtype=dtype)
    kw = dict(num_heads=H, scale=1.0, relative_bias=rb, **o)
    got, wt = mhattn.multi_head_attention(x, *w, return_weights=True, **kw)
    want, wwt = R.multi_head_attention(x, *w, return_weights=True, **kw)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == np.float64 else dict(rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(got, want, **tol)
    np.testing.assert_allclose(wt, wwt, **tol)
    # the bias changes the result
    assert not np.allclose(got, mhattn.multi_head_attention(x, *w, **dict(
        kw, relative_bias=None)), atol=1e-3)


@pytest.mark.parametrize("opts", OPTIONS)
def test_table_gradient_by_finite_differences(rng, opts):
    o, bi = _options(rng, opts)
    x = rng.standard_normal((B, T, D))
    w = [a * 0.4 for a in _weights_for(rng, o)]
    rb = _rb(rng, nb=8, md=8, bidirectional=bi)
    G = rng.standard_normal(x.shape)
    kw = dict(num_heads=H, scale=1.0, **o)
    got = mhattn.multi_head_attention_grad(G, x, *w, relative_bias=rb, **kw)
    assert got["relative_bias"].shape == (8, H)

    def loss(t):
        return float((R.multi_head_attention(
            x, *w, relative_bias=mhattn.RelativeBias(t, 8, 8, bi), **kw) * G).sum())
    np.testing.assert_allclose(got["relative_bias"], _fd(loss, rb.table), rtol=1e-6,
                               atol=1e-8)
    # x's gradient sees the bias too
    np.testing.assert_allclose(
        got["x"], _fd(lambda a: float((R.multi_head_attention(
            a, *w, relative_bias=rb, **kw) * G).sum()), x), rtol=1e-5, atol=1e-7)


def test_packed_sequences_bias_each_sequence_by_its_own_positions(rng):
    cu = np.array([0, 4, 4, 11])
    x = rng.standard_normal((11, D))
    w = [rng.standard_normal((D, D)) * 0.4 for _ in range(4)]
    rb = _rb(rng, nb=8, md=6)
    kw = dict(num_heads=H, cu_seqlens=cu, relative_bias=rb, causal=True)
    np.testing.assert_allclose(mhattn.multi_head_attention(x, *w, **kw),
                               R.multi_head_attention(x, *w, **kw), rtol=1e-10, atol=1e-12)
    # each sequence alone gives its rows
    whole = mhattn.multi_head_attention(x, *w, **kw)
    for a, e in ((0, 4), (4, 11)):
        alone = mhattn.multi_head_attention(x[a:e], *w, num_heads=H, relative_bias=rb,
                                            causal=True)
        np.testing.assert_allclose(whole[a:e], alone, rtol=1e-12, atol=1e-13)
    G = rng.standard_normal(x.shape)
    g = mhattn.multi_head_attention_grad(G, x, *w, **kw)["relative_bias"]
    np.testing.assert_allclose(
        g, _fd(lambda t: float((R.multi_head_attention(
            x, *w, **dict(kw, relative_bias=mhattn.RelativeBias(t, 8, 6))) * G).sum()),
            rb.table), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_attention_and_its_gradient(rng, layout):
    Tq, Tk = 7, 12
    shape = lambda heads, t, d: (B, heads, t, d) if layout == "bhtd" else (B, t, heads, d)  # noqa: E731
    q = rng.standard_normal(shape(H, Tq, 8))
    k = rng.standard_normal(shape(2, Tk, 8))
    v = rng.standard_normal(shape(2, Tk, 5))
    rb = _rb(rng, nb=16, md=9)
    kw = dict(layout=layout, scale=0.5, causal=True, relative_bias=rb)
    out, wt, lse = mhattn.attention(q, k, v, return_weights=True, return_lse=True, **kw)
    r_out, r_wt, r_lse = R.projected_attention(q, k, v, **kw)
    np.testing.assert_allclose(out, r_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-10, atol=1e-12)
    G = rng.standard_normal(out.shape)
    g = mhattn.attention_grad(G, q, k, v, **kw)
    again = mhattn.attention_grad(G, q, k, v, lse=lse, out=out, **kw)
    np.testing.assert_array_equal(g["relative_bias"], again["relative_bias"])

    def loss(t):
        return float((R.projected_attention(q, k, v, **dict(
            kw, relative_bias=mhattn.RelativeBias(t, 16, 9)))[0] * G).sum())
    np.testing.assert_allclose(g["relative_bias"], _fd(loss, rb.table), rtol=1e-6,
                               atol=1e-8)


def test_threads_change_no_bit(rng):
    x = rng.standard_normal((2, 150, 32)).astype(np.float32)
    w = [(rng.standard_normal(s) * 0.2).astype(np.float32)
         for s in ((32, 32), (32, 16), (32, 16), (32, 32))]
    rb = _rb(rng, dtype=np.float32)
    g = rng.standard_normal(x.shape).astype(np.float32)
    kw = dict(num_heads=4, num_kv_heads=2, causal=True, relative_bias=rb,
              key_lengths=np.array([150, 97]))
    assert_same_bits_at_thread_counts(lambda: mhattn.multi_head_attention(x, *w, **kw),
                                      lambda: mhattn.multi_head_attention_grad(g, x, *w, **kw))


def test_every_isa_path_agrees_with_float64(rng, isa):
    q = rng.standard_normal((1, 4, 70, 16))
    k = rng.standard_normal((1, 2, 70, 16))
    v = rng.standard_normal((1, 2, 70, 16))
    go = rng.standard_normal((1, 4, 70, 16))
    rb = _rb(rng)
    rb32 = mhattn.RelativeBias(rb.table.astype(np.float32))
    kw = dict(softcap=4.0, window=(30, 5))
    ref = mhattn.attention(q, k, v, relative_bias=rb, **kw)
    got = mhattn.attention(*(a.astype(np.float32) for a in (q, k, v)), relative_bias=rb32,
                           **kw)
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5)
    gref = mhattn.attention_grad(go, q, k, v, relative_bias=rb, **kw)["relative_bias"]
    g32 = mhattn.attention_grad(*(a.astype(np.float32) for a in (go, q, k, v)),
                                relative_bias=rb32, **kw)["relative_bias"]
    np.testing.assert_allclose(g32, gref, rtol=2e-4, atol=2e-4)
    # one-row decode kernels (and split-K) see the same bias
    for Tq in (1, 3):
        one = mhattn.attention(q[:, :, -Tq:], k, v, relative_bias=rb, causal=True)
        want = R.projected_attention(q[:, :, -Tq:], k, v, relative_bias=rb, causal=True)[0]
        np.testing.assert_allclose(one, want, rtol=1e-10, atol=1e-12)


def test_long_keys_split_k_decode(rng):
    """A decode step over 3000 keys (split into parts) against the reference."""
    q = rng.standard_normal((1, 4, 1, 16))
    k = rng.standard_normal((1, 4, 3000, 16))
    v = rng.standard_normal((1, 4, 3000, 16))
    rb = _rb(rng, md=1000)
    np.testing.assert_allclose(mhattn.attention(q, k, v, relative_bias=rb),
                               R.projected_attention(q, k, v, relative_bias=rb)[0],
                               rtol=1e-10, atol=1e-12)


def test_half_calls(rng):
    x = rng.standard_normal((T, D)).astype(np.float16)
    w = [(rng.standard_normal((D, D)) * 0.4).astype(np.float16) for _ in range(4)]
    rb16 = _rb(rng, dtype=np.float16)
    g = mhattn.multi_head_attention_grad(np.ones((T, D), np.float16), x, *w, num_heads=H,
                                         relative_bias=rb16)
    assert g["relative_bias"].dtype == np.float16
    wide = mhattn.multi_head_attention_grad(
        np.ones((T, D)), *(a.astype(np.float32) for a in [x] + w), num_heads=H,
        relative_bias=mhattn.RelativeBias(rb16.table.astype(np.float32)))
    np.testing.assert_array_equal(g["relative_bias"], wide["relative_bias"].astype(np.float16))
    # a float64 table in a half call keeps its gradient's precision
    rb64 = mhattn.RelativeBias(rb16.table.astype(np.float64))
    g64 = mhattn.multi_head_attention_grad(np.ones((T, D), np.float16), x, *w, num_heads=H,
                                           relative_bias=rb64)
    assert g64["relative_bias"].dtype == np.float32


def test_the_layer_and_trace(rng):
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    layer = mhattn.MultiHeadAttention(D, H, seed=0)
    rb = _rb(rng, dtype=np.float32)
    out, ctx = layer(x, relative_bias=rb, return_context=True)
    g = layer.backward(np.ones_like(out), ctx)
    direct = mhattn.multi_head_attention_grad(np.ones_like(out), x, **layer.arguments(),
                                              relative_bias=rb)
    np.testing.assert_array_equal(g["relative_bias"], direct["relative_bias"])
    tr = mhattn.trace(x, **layer.arguments(), relative_bias=rb)
    np.testing.assert_allclose(tr.output, out, rtol=1e-6, atol=1e-6)
    i, j = np.indices((T, T))
    want = rb.table[R.relative_position_bucket(j - i), :].transpose(2, 0, 1)
    np.testing.assert_array_equal(tr.relative[0], want)
    np.testing.assert_allclose(tr.scores, tr.raw_scores / np.sqrt(D // H) + tr.relative,
                               rtol=1e-5, atol=1e-5)


def test_bad_tables_name_relative_bias(rng):
    x = rng.standard_normal((T, D))
    w = [rng.standard_normal((D, D))] * 3
    with pytest.raises(ValueError, match=r"relative_bias: expected a table of shape \(32, 4\)"):
        mhattn.multi_head_attention(x, *w, num_heads=H, relative_bias=_rb(rng, H=3))
    with pytest.raises(ValueError, match="max_distance: 15 is less than"):
        mhattn.RelativeBias(np.ones((32, 4)), 32, 15)
    with pytest.raises(ValueError, match="num_buckets: 3 gives"):
        mhattn.RelativeBias(np.ones((3, 4)), 3)
    with pytest.raises(TypeError, match="relative_bias: expected mhattn.RelativeBias"):
        mhattn.attention(x[None, None], x[None, None], x[None, None], relative_bias=np.ones(3))


def test_glue_and_core_refuse_what_relative_bias_refuses(rng):
    """The glue's tuple checked on its own: the table's width, and the
    core's rules on the buckets and the distance (mha_check_config)."""
    from mhattn import _C
    q = rng.standard_normal((1, 2, 3, 4))
    v = (None, 0.0, None, None, None, None, None, None, None, 1e-6, "rms", 0, False, None,
         None, None, 0.0, 0)
    def call(rel):
        return _C.attention(q, q, q, np.ones(2), None, False, None, v + (rel, 0, None, None),
                            False, False, False, False)
    with pytest.raises(ValueError, match=r"relative_bias: expected shape \(8, 2\)"):
        call((np.ones((8, 3)), 8, True))
    with pytest.raises(ValueError, match="rel_max_distance = 3 is not in"):
        call((np.ones((8, 2)), 3, True))
    with pytest.raises(ValueError, match="rel_buckets = 3"):
        call((np.ones((3, 2)), 8, True))
    with pytest.raises(ValueError, match=r"max_distance: expected an int in \[0, "):
        call((np.ones((8, 2)), -1, True))
    with pytest.raises(TypeError, match="relative_bias: expected None or a tuple"):
        call([np.ones((8, 2)), 8, True])
    out = call((np.ones((8, 2)), 8, False))
    assert np.isfinite(out[0]).all()


# ---- transformers' T5Attention --------------------------------------------

def _t5(is_decoder, nb=32, md=128, d_model=D, heads=H, d_kv=6, seed=0):
    torch = pytest.importorskip("torch")
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    from transformers import T5Config
    cfg = T5Config(d_model=d_model, d_kv=d_kv, num_heads=heads, dropout_rate=0.0,
                   relative_attention_num_buckets=nb, relative_attention_max_distance=md,
                   is_decoder=is_decoder)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = t5.T5Attention(cfg, has_relative_attention_bias=True, layer_idx=0).double()
    with torch.no_grad():
        m.relative_attention_bias.weight.normal_()
    return torch, m


def _weights(m):
    w = lambda lin: lin.weight.detach().numpy().T.copy()  # noqa: E731
    return w(m.q), w(m.k), w(m.v), w(m.o)


def _table(m):
    return m.relative_attention_bias.weight.detach().numpy().copy()


@pytest.mark.parametrize("is_decoder", [False, True])
def test_t5_attention_forward_and_table_gradient(rng, is_decoder):
    torch, m = _t5(is_decoder, nb=32, md=32 if is_decoder else 20)
    Tn = 45   # past max_distance: the logarithmic and the last buckets
    x = rng.standard_normal((B, Tn, D))
    G = rng.standard_normal((B, Tn, D))
    xt = torch.tensor(x)
    mask = None
    if is_decoder:
        mask = torch.triu(torch.full((Tn, Tn), -torch.inf, dtype=torch.float64), 1)[None, None]
    out_t = m(xt, mask=mask)[0]
    (out_t * torch.tensor(G)).sum().backward()
    md = 32 if is_decoder else 20
    rb = mhattn.RelativeBias(_table(m), 32, md, bidirectional=not is_decoder)
    kw = dict(num_heads=H, scale=1.0, causal=is_decoder, relative_bias=rb)
    out = mhattn.multi_head_attention(x, *_weights(m), **kw)
    np.testing.assert_allclose(out, out_t.detach().numpy(), rtol=1e-10, atol=1e-12)
    g = mhattn.multi_head_attention_grad(G, x, *_weights(m), **kw)
    np.testing.assert_allclose(g["relative_bias"],
                               m.relative_attention_bias.weight.grad.numpy(),
                               rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(g["w_q"], m.q.weight.grad.numpy().T, rtol=1e-9, atol=1e-11)
    # and float32 within float32's rounding
    rb32 = mhattn.RelativeBias(_table(m).astype(np.float32), 32, md, not is_decoder)
    out32 = mhattn.multi_head_attention(x.astype(np.float32),
                                        *(a.astype(np.float32) for a in _weights(m)),
                                        **dict(kw, relative_bias=rb32))
    np.testing.assert_allclose(out32, out_t.detach().numpy(), rtol=1e-4, atol=1e-5)


def test_t5_decoder_with_a_cache(rng):
    """Decoding token by token through mhattn.KVCache against T5Attention
    with transformers' DynamicCache: each step's query sits at its own
    position (transformers' past_seen_tokens), as a cached step's does."""
    torch, m = _t5(True, nb=8, md=12, d_kv=4)
    from transformers import DynamicCache
    try:
        cache_t = DynamicCache()
    except TypeError:
        cache_t = DynamicCache(config=m.config)
    steps = 25
    x = rng.standard_normal((1, steps, D))
    rb = mhattn.RelativeBias(_table(m), 8, 12, bidirectional=False)
    cache = mhattn.KVCache(1, H, steps, 4, 4, dtype=np.float64)
    w = _weights(m)
    prefill = 5
    with torch.no_grad():
        mask = torch.triu(torch.full((prefill, prefill), -torch.inf, dtype=torch.float64),
                          1)[None, None]
        want = [m(torch.tensor(x[:, :prefill]), mask=mask, cache=cache_t)[0].numpy()]
        for t in range(prefill, steps):
            want.append(m(torch.tensor(x[:, t:t + 1]), cache=cache_t)[0].numpy())
    got = [mhattn.multi_head_attention(x[:, :prefill], *w, num_heads=H, scale=1.0,
                                       causal=True, relative_bias=rb, cache=cache)]
    for t in range(prefill, steps):
        got.append(mhattn.multi_head_attention(x[:, t:t + 1], *w, num_heads=H, scale=1.0,
                                               causal=True, relative_bias=rb, cache=cache))
    np.testing.assert_allclose(np.concatenate(got, 1), np.concatenate(want, 1), rtol=1e-10,
                               atol=1e-12)
    # the steps give the whole sequence's rows
    whole = mhattn.multi_head_attention(x, *w, num_heads=H, scale=1.0, causal=True,
                                        relative_bias=rb)
    np.testing.assert_allclose(np.concatenate(got, 1), whole, rtol=1e-10, atol=1e-12)
