"""mhattn.pack_weights (issue 16): weights packed once for the GEMM.

The packed call must give the unpacked call's bits on every ISA, dtype and
thread count; the panels must really be what the big GEMMs read (a test
with deliberately mismatched panels shows it); the object and a layer's
weights must be immutable; and every misuse raises a named error.
"""
import copy
import pickle

import numpy as np
import pytest

import mhattn
from mhattn import _C
from mhattn._internal import core as _core


def _weights(rng, d_in, h, g, dk, dv, d_out, dt, form="fused"):
    wq = rng.standard_normal((d_in, h * dk)).astype(dt)
    wk = rng.standard_normal((d_in, g * dk)).astype(dt)
    wv = rng.standard_normal((d_in, g * dv)).astype(dt)
    wo = rng.standard_normal((h * dv, d_out)).astype(dt)
    if form == "stacked":
        def st(w, n):
            return np.ascontiguousarray(w.reshape(d_in, n, -1).transpose(1, 0, 2))
        wq, wk, wv = st(wq, h), st(wk, g), st(wv, g)
    elif form == "list":
        wq, wk, wv = (np.split(w, n, axis=1) for w, n in ((wq, h), (wk, g), (wv, g)))
    return wq, wk, wv, wo


def _same(a, b):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    assert len(a) == len(b)
    for u, v in zip(a, b):
        if isinstance(u, np.ndarray):
            assert u.dtype == v.dtype and u.shape == v.shape
            assert np.array_equal(u, v, equal_nan=True), np.abs(u - v).max()


CASES = [  # (B, T, d_in, h, g, dk, dv, d_out)
    (1, 3, 4, 2, 2, 2, 2, 4),          # the document's size: the small loop
    (1, 128, 512, 8, 8, 64, 64, 512),  # the small call
    (2, 127, 96, 3, 1, 32, 16, 40),    # GQA, ragged edges
    (1, 1, 300, 6, 2, 50, 50, 300),    # one row
    (3, 65, 200, 4, 4, 50, 24, 17),
]


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_packed_is_bitwise_the_unpacked_call(isa, rng, dt, case):
    B, T, d_in, h, g, dk, dv, d_out = case
    w = _weights(rng, d_in, h, g, dk, dv, d_out, dt)
    x = rng.standard_normal((B, T, d_in)).astype(dt)
    packed = mhattn.pack_weights(*w, num_heads=h, num_kv_heads=g)
    assert packed.isa == isa and packed.dtype == dt
    for kw in (dict(), dict(causal=True, return_weights=True),
               dict(window=(5, 0), causal=True, softcap=20.0),
               dict(key_lengths=np.arange(B) % T + 1)):
        _same(mhattn.multi_head_attention(x, packed, **kw),
              mhattn.multi_head_attention(x, *w, num_heads=h, num_kv_heads=g, **kw))


@pytest.mark.parametrize("form", ["stacked", "list"])
def test_every_weight_form_and_biases(rng, form):
    dt = np.float32
    w = _weights(rng, 64, 4, 2, 16, 8, 32, dt, form)
    b = dict(b_q=rng.standard_normal(64).astype(dt), b_k=rng.standard_normal((2, 16)).astype(dt),
             b_v=[rng.standard_normal(8).astype(dt) for _ in range(2)],
             b_o=rng.standard_normal(32).astype(dt))
    x = rng.standard_normal((2, 70, 64)).astype(dt)
    want = mhattn.multi_head_attention(x, *w, num_kv_heads=2, causal=True, **b)
    in_packed = mhattn.pack_weights(*w, num_kv_heads=2, **b)
    _same(mhattn.multi_head_attention(x, in_packed, causal=True), want)
    in_call = mhattn.pack_weights(*w, num_kv_heads=2)
    _same(mhattn.multi_head_attention(x, in_call, causal=True, **b), want)
    # the weights keep the form they were given
    assert type(in_packed.w_q) is type(w[0])
    _same(mhattn.multi_head_attention(x, **in_packed.arguments(), causal=True), want)


def test_cross_attention_and_no_w_o(rng):
    dt = np.float64
    wq = rng.standard_normal((8, 6))
    wk = rng.standard_normal((5, 6))
    wv = rng.standard_normal((3, 9))
    x, key, value = (rng.standard_normal((2, n, d)) for n, d in ((40, 8), (33, 5), (33, 3)))
    packed = mhattn.pack_weights(wq, wk, wv, num_heads=3)
    assert packed.w_o is None
    _same(mhattn.multi_head_attention(x, packed, key=key, value=value),
          mhattn.multi_head_attention(x, wq, wk, wv, num_heads=3, key=key, value=value))


def test_the_panels_are_what_the_big_gemms_read(rng):
    """Capsules packed from *other* weights of the same shape: a GEMM that
    reads the panels gives the other weights' result, one that packs B
    itself gives w's. Big projections read the panels; the small loop
    (M N K < MHA_GEMM_SMALL) reads w."""
    for T, d, big in ((128, 256, True), (2, 16, False)):
        w = [rng.standard_normal((d, d)).astype(np.float32) for _ in range(4)]
        w2 = [rng.standard_normal((d, d)).astype(np.float32) for _ in range(4)]
        x = rng.standard_normal((1, T, d)).astype(np.float32)
        args = _core.fast(x, *w, 4, None, None, None, False, None, False, None, None, None,
                          None, None, None)
        caps2 = tuple(_C.pack_weight(a) for a in w2)
        got = _C.forward(*args, caps2)[0]
        with_w = mhattn.multi_head_attention(x, *w, num_heads=4)
        with_w2 = mhattn.multi_head_attention(x, *w2, num_heads=4)
        if big:
            assert np.array_equal(got, with_w2) and not np.allclose(got, with_w)
        else:
            assert np.array_equal(got, with_w)


def test_another_isa_ignores_the_panels(rng):
    w = _weights(rng, 256, 4, 4, 64, 64, 256, np.float32)
    x = rng.standard_normal((1, 128, 256)).astype(np.float32)
    packed = mhattn.pack_weights(*w, num_heads=4)
    before = mhattn.get_isa()
    try:
        mhattn._set_isa("scalar")
        _same(mhattn.multi_head_attention(x, packed),
              mhattn.multi_head_attention(x, *w, num_heads=4))
    finally:
        mhattn._set_isa(before)


def test_another_dtype_casts_the_weights(rng):
    w = _weights(rng, 64, 4, 4, 16, 16, 64, np.float32)
    packed = mhattn.pack_weights(*w, num_heads=4)
    x = rng.standard_normal((1, 100, 64))   # float64: the call computes in float64
    out = mhattn.multi_head_attention(x, packed)
    assert out.dtype == np.float64
    _same(out, mhattn.multi_head_attention(x, *w, num_heads=4))
    assert mhattn.pack_weights(*w, num_heads=4, dtype=np.float64).dtype == np.float64


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_bits_do_not_depend_on_the_thread_count(rng, threads):
    w = _weights(np.random.default_rng(5), 512, 8, 8, 64, 64, 512, np.float32)
    x = np.random.default_rng(6).standard_normal((2, 128, 512)).astype(np.float32)
    packed = mhattn.pack_weights(*w, num_heads=8)
    before = mhattn.get_num_threads()
    try:
        mhattn.set_num_threads(1)
        one = mhattn.multi_head_attention(x, packed, causal=True)
        mhattn.set_num_threads(threads)
        _same(mhattn.multi_head_attention(x, packed, causal=True), one)
    finally:
        mhattn.set_num_threads(before)


def test_backward_takes_the_packed_object(rng):
    dt = np.float64
    w = _weights(rng, 32, 4, 2, 8, 8, 32, dt)
    x = rng.standard_normal((2, 20, 32))
    dout = rng.standard_normal((2, 20, 32))
    packed = mhattn.pack_weights(*w, num_kv_heads=2, num_heads=4)
    g_packed = mhattn.multi_head_attention_grad(dout, x, packed, causal=True)
    g_plain = mhattn.multi_head_attention_grad(dout, x, *w, num_heads=4, num_kv_heads=2,
                                               causal=True)
    assert sorted(g_packed) == sorted(g_plain)
    for k in g_plain:
        _same(g_packed[k], g_plain[k])
    out, ctx = mhattn.multi_head_attention(x, packed, causal=True, return_context=True)
    g_ctx = mhattn.backward(dout, ctx)
    for k in g_plain:
        _same(g_ctx[k], g_plain[k])
    # finite differences on one weight entry, through the packed call
    eps, (i, j) = 1e-6, (3, 5)
    wp, wm = (w[0].copy() for _ in range(2))
    wp[i, j] += eps
    wm[i, j] -= eps
    fp = np.sum(dout * mhattn.multi_head_attention(
        x, mhattn.pack_weights(wp, *w[1:], num_heads=4, num_kv_heads=2), causal=True))
    fm = np.sum(dout * mhattn.multi_head_attention(
        x, mhattn.pack_weights(wm, *w[1:], num_heads=4, num_kv_heads=2), causal=True))
    assert abs((fp - fm) / (2 * eps) - g_packed["w_q"][i, j]) < 1e-5


def test_cache_step_uses_the_packed_object(rng):
    w = _weights(rng, 512, 8, 2, 64, 64, 512, np.float32)
    packed = mhattn.pack_weights(*w, num_heads=8, num_kv_heads=2)
    x = rng.standard_normal((2, 9, 512)).astype(np.float32)
    outs = []
    for weights in ((packed,), w):
        kw = {} if len(weights) == 1 else dict(num_heads=8, num_kv_heads=2)
        cache = mhattn.KVCache(2, 2, 16, 64, dtype=np.float32)
        steps = [mhattn.multi_head_attention(x[:, :5], *weights, causal=True, cache=cache, **kw)]
        steps += [mhattn.multi_head_attention(x[:, i:i + 1], *weights, causal=True,
                                              cache=cache, **kw) for i in range(5, 9)]
        outs.append(np.concatenate(steps, axis=1))
    _same(outs[0], outs[1])


def test_packed_weights_are_immutable(rng):
    w = _weights(rng, 16, 2, 2, 8, 8, 16, np.float32, "stacked")
    packed = mhattn.pack_weights(*w)
    for name in ("w_q", "w_k", "w_v", "w_o"):
        a = getattr(packed, name)
        assert not a.flags.writeable
        with pytest.raises(ValueError):
            a.flags.writeable = True
        with pytest.raises(ValueError, match="read-only"):
            a[...] = 0
        with pytest.raises(AttributeError, match=name):
            setattr(packed, name, a)
    with pytest.raises(AttributeError):
        packed.num_heads = 3
    w[0][...] = 0   # the caller's arrays were copied
    assert np.any(packed.w_q != 0)


def test_replace_shares_the_other_panels(rng):
    w = _weights(rng, 64, 4, 4, 16, 16, 64, np.float32)
    packed = mhattn.pack_weights(*w, num_heads=4)
    new_wo = rng.standard_normal((64, 64)).astype(np.float32)
    other = packed.replace(w_o=new_wo)
    assert other._caps[:3] == packed._caps[:3] and other._caps[3] is not packed._caps[3]
    x = rng.standard_normal((1, 128, 64)).astype(np.float32)
    _same(mhattn.multi_head_attention(x, other),
          mhattn.multi_head_attention(x, *w[:3], new_wo, num_heads=4))
    with pytest.raises(TypeError, match="w_z"):
        packed.replace(w_z=new_wo)


def test_pickle_and_copy_repack(rng):
    w = _weights(rng, 64, 4, 4, 16, 16, 64, np.float64)
    packed = mhattn.pack_weights(*w, num_heads=4, b_o=np.ones(64))
    x = rng.standard_normal((1, 50, 64))
    for other in (pickle.loads(pickle.dumps(packed)), copy.deepcopy(packed)):
        assert other._caps[0] is not packed._caps[0]
        _same(mhattn.multi_head_attention(x, other), mhattn.multi_head_attention(x, packed))


def test_misuse_is_named(rng):
    w = _weights(rng, 16, 2, 2, 8, 8, 16, np.float32)
    packed = mhattn.pack_weights(*w, num_heads=2, b_q=np.zeros(16, np.float32))
    x = rng.standard_normal((1, 5, 16)).astype(np.float32)
    with pytest.raises(TypeError, match="w_k: given both"):
        mhattn.multi_head_attention(x, packed, w[1])
    with pytest.raises(TypeError, match="w_o: given both"):
        mhattn.multi_head_attention(x, packed, w_o=w[3])
    with pytest.raises(TypeError, match="b_q: given both"):
        mhattn.multi_head_attention(x, packed, b_q=np.zeros(16, np.float32))
    with pytest.raises(ValueError, match="num_heads: 4 but"):
        mhattn.multi_head_attention(x, packed, num_heads=4)
    mhattn.multi_head_attention(x, packed, num_heads=2)   # agreeing is fine
    with pytest.raises(TypeError, match="w_k: expected an array, got None"):
        mhattn.multi_head_attention(x, w[0], num_heads=2)
    with pytest.raises(ValueError, match="w_q: its heads read 16 input features but x has 8"):
        mhattn.multi_head_attention(x[..., :8], packed)
    with pytest.raises(ValueError, match="num_heads=3"):
        mhattn.pack_weights(*w, num_heads=3)
    with pytest.raises(TypeError, match="dtype"):
        mhattn.pack_weights(*w, num_heads=2, dtype=np.int32)


def test_glue_checks_the_capsules(rng):
    w = [rng.standard_normal((16, 16)).astype(np.float32) for _ in range(4)]
    x = rng.standard_normal((1, 4, 16)).astype(np.float32)
    args = _core.fast(x, *w, 2, None, None, None, False, None, False, None, None, None,
                      None, None, None)
    other = _C.pack_weight(rng.standard_normal((16, 8)).astype(np.float32))
    with pytest.raises(ValueError, match=r"packed\[1\]: packed from a \(16, 8\) float32 "
                                         r"weight, but the call's wk is \(16, 16\)"):
        _C.forward(*args, (None, other, None, None))
    f64 = _C.pack_weight(w[0].astype(np.float64))
    with pytest.raises(ValueError, match=r"packed\[0\].*float64"):
        _C.forward(*args, (f64, None, None, None))
    with pytest.raises(TypeError, match=r"packed\[2\]: expected a pack_weight"):
        _C.forward(*args, (None, None, "no", None))
    with pytest.raises(TypeError, match="packed"):
        _C.forward(*args, [None] * 4)
    with pytest.raises(TypeError, match="w:"):
        _C.pack_weight(np.zeros((2, 2, 2), np.float32))
    assert _C.packed_info(f64)[:4] == (16, 16, mhattn.get_isa(), "float64")


def test_layer_keeps_its_weights_packed(rng):
    layer = mhattn.MultiHeadAttention(64, 4, num_kv_heads=2, bias=True, seed=0)
    x = rng.standard_normal((2, 30, 64)).astype(np.float32)
    assert isinstance(layer.packed, mhattn.PackedWeights)
    for name in ("w_q", "w_k", "w_v", "w_o"):
        with pytest.raises(ValueError, match="read-only"):
            getattr(layer, name)[...] = 0
    want = mhattn.multi_head_attention(x, **layer.arguments(), causal=True)
    _same(layer(x, causal=True), want)
    # assignment repacks (and copies)
    new = np.array(layer.w_q) * 2
    layer.w_q = new
    new[...] = 0
    assert np.any(layer.w_q != 0)
    _same(layer(x, causal=True), mhattn.multi_head_attention(x, **layer.arguments(),
                                                             causal=True))
    assert not np.array_equal(layer(x, causal=True), want)
    # load_state_dict repacks; biases stay writable, and are seen
    other = mhattn.MultiHeadAttention(64, 4, num_kv_heads=2, bias=True, seed=1)
    layer.load_state_dict(other.state_dict())
    _same(layer(x), other(x))
    layer.b_o[...] += 1
    _same(layer(x), other(x) + 1)
    # a pickled layer repacks where it is loaded
    _same(pickle.loads(pickle.dumps(layer))(x), layer(x))


def test_key_sharing_x_memory_with_other_rows(rng):
    """A key that starts at x's memory but has fewer rows is not x: the
    joint Q/K/V projection must not take it for x."""
    w = _weights(rng, 256, 4, 4, 64, 64, 256, np.float32)
    packed = mhattn.pack_weights(*w, num_heads=4)
    x = rng.standard_normal((1, 128, 256)).astype(np.float32)
    key = x[:, :100]
    _same(mhattn.multi_head_attention(x, packed, key=key),
          mhattn.multi_head_attention(x, *w, num_heads=4, key=key))
    _same(mhattn.multi_head_attention(x, packed, key=x, value=x),
          mhattn.multi_head_attention(x, *w, num_heads=4))
