"""Half precision beyond the functions (issue 36): packed weights, the layer
(dtype=, astype, state_dict round trips, torch interop), trace, and torch
tensors as inputs.  The functions' own half rules: tests/test_half_dtypes.py.
"""
import copy
import pickle

import numpy as np
import pytest

import mhattn

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
HALVES = {"float16": F16, "bfloat16": BF16}


def bits(a):
    assert a.dtype.itemsize == 2, a.dtype
    return np.ascontiguousarray(a).view(np.uint16)


def weights(dt, d=32, h=4, g=2, seed=0):
    r = np.random.default_rng(seed)
    s = 1 / np.sqrt(d)
    dk = d // h
    return [(r.standard_normal(shape) * s).astype(dt) for shape in
            ((d, h * dk), (d, g * dk), (d, g * dk), (h * dk, d))]


@pytest.mark.parametrize("dtname", list(HALVES))
def test_packed_half_weights_give_the_unpacked_bits(isa, dtname):
    dt = HALVES[dtname]
    w = weights(dt)
    b_q = np.linspace(-1, 1, 32).astype(dt)
    packed = mhattn.pack_weights(*w, num_heads=4, num_kv_heads=2, b_q=b_q)
    assert packed.dtype == dt and packed.w_q.dtype == dt and packed.b_q.dtype == dt
    assert not packed.w_q.flags.writeable
    # float32 panels: the weights' bytes twice over (half weights, float32 panels)
    assert packed.nbytes >= 2 * sum(a.nbytes for a in w)
    x = np.random.default_rng(1).standard_normal((2, 67, 32)).astype(dt)
    got = mhattn.multi_head_attention(x, packed, causal=True)
    want = mhattn.multi_head_attention(x, *w, num_heads=4, num_kv_heads=2, b_q=b_q,
                                       causal=True)
    assert got.dtype == dt
    np.testing.assert_array_equal(bits(got), bits(want))
    for again in (pickle.loads(pickle.dumps(packed)), copy.deepcopy(packed),
                  packed.replace(w_o=w[3])):
        assert again.dtype == dt
        np.testing.assert_array_equal(
            bits(mhattn.multi_head_attention(x, again, causal=True)), bits(got))
    g = mhattn.multi_head_attention_grad(np.ones_like(got), x, packed, causal=True)
    g0 = mhattn.multi_head_attention_grad(np.ones_like(got), x, *w, num_heads=4,
                                          num_kv_heads=2, b_q=b_q, causal=True)
    for name in g0:
        assert g[name].dtype == dt
        np.testing.assert_array_equal(bits(g[name]), bits(g0[name]))
    # a float32 call cannot take half weights: the numbers share one dtype
    with pytest.raises(TypeError, match=r"does not match"):
        mhattn.multi_head_attention(x.astype(np.float32), packed)


def test_pack_weights_dtype_argument_rounds_to_half():
    w = weights(np.float32)
    p = mhattn.pack_weights(*w, num_heads=4, num_kv_heads=2, dtype="bfloat16")
    assert p.dtype == BF16
    np.testing.assert_array_equal(bits(p.w_o), bits(w[3].astype(BF16)))
    p16 = mhattn.pack_weights(*w, num_heads=4, num_kv_heads=2, dtype=np.float16)
    assert p16.w_q.dtype == F16


@pytest.mark.parametrize("dtname", list(HALVES))
def test_half_layer(dtname):
    dt = HALVES[dtname]
    layer = mhattn.MultiHeadAttention(32, 4, num_kv_heads=2, bias=True, sinks=True,
                                      qk_norm=True, dtype=dtname, seed=0)
    assert layer.dtype == dt
    for name, a in layer.weights().items():
        assert a.dtype == dt, name
    x = np.random.default_rng(2).standard_normal((2, 9, 32)).astype(dt)
    out, ctx = layer(x, causal=True, rope=mhattn.RoPE(), return_context=True)
    assert out.dtype == dt
    np.testing.assert_array_equal(bits(out), bits(mhattn.multi_head_attention(
        x, **layer.arguments(), num_heads=4, causal=True, rope=mhattn.RoPE())))
    grads = layer.backward(np.ones_like(out), ctx)
    assert all(g.dtype == dt for g in grads.values()), {k: g.dtype for k, g in grads.items()}
    # state_dict round trip keeps the bits
    again = mhattn.MultiHeadAttention(32, 4, num_kv_heads=2, bias=True, sinks=True,
                                      qk_norm=True, dtype=dt)
    again.load_state_dict(layer.state_dict())
    np.testing.assert_array_equal(bits(again(x, causal=True)), bits(layer(x, causal=True)))


def test_astype_rounds_once_and_round_trips():
    layer = mhattn.MultiHeadAttention(16, 2, bias=True, seed=3)
    for dt in (F16, BF16):
        half = layer.astype(dt)
        assert half.dtype == dt and half is not layer
        for name, a in layer.weights().items():
            np.testing.assert_array_equal(bits(half.weights()[name]), bits(a.astype(dt)))
        back = half.astype(np.float32)
        np.testing.assert_array_equal(back.w_q, half.w_q.astype(np.float32))
    assert layer.dtype == np.float32   # the original is untouched
    with pytest.raises(TypeError, match="^dtype: mhattn layers hold"):
        layer.astype(np.int8)


@pytest.mark.parametrize("dtname", list(HALVES))
def test_torch_interop_in_half(dtname):
    torch = pytest.importorskip("torch")
    dt = HALVES[dtname]
    tdt = getattr(torch, dtname)
    module = torch.nn.MultiheadAttention(16, 2, batch_first=True, dtype=tdt).eval()
    layer = mhattn.MultiHeadAttention.from_torch(module)
    assert layer.dtype == dt
    sd = module.state_dict()
    got = layer.state_dict()
    for k in got:
        np.testing.assert_array_equal(bits(got[k]),
                                      sd[k].contiguous().view(torch.int16).numpy().view(np.uint16))
    back = layer.to_torch()
    assert back.in_proj_weight.dtype == tdt
    assert torch.equal(back.in_proj_weight, module.in_proj_weight)
    # torch tensors of that dtype are read as NumPy arrays of the same bits
    xt = torch.randn(2, 5, 16, dtype=tdt)
    out = layer(xt)
    assert out.dtype == dt
    x = xt.view(torch.int16).numpy().view(dt)
    np.testing.assert_array_equal(bits(out), bits(layer(x)))
    with torch.no_grad():
        ref = module(xt, xt, xt, need_weights=False)[0]
    err = np.abs(out.astype(np.float64) - ref.double().numpy()).max()
    assert err < 0.05, err   # both are half results of one computation


def test_trace_of_half_inputs_is_float32():
    w = weights(BF16, d=16, h=2, g=2)
    x = np.random.default_rng(4).standard_normal((5, 16)).astype(BF16)
    t = mhattn.trace(x, *w, num_heads=2, causal=True)
    assert t.dtype == np.float32 and t.output.dtype == np.float32
    out = mhattn.multi_head_attention(x, *w, num_heads=2, causal=True)
    np.testing.assert_array_equal(bits(t.output.astype(BF16)), bits(out))


@pytest.mark.parametrize("dtname", list(HALVES))
def test_fast_branch_of_half_calls_gives_the_slow_branch_bits(monkeypatch, dtname):
    """A half call in the common form takes the float32 fast branch on its
    widened numbers (a packed half object's float32 twins, no widening of
    the weights per call); return_context=True forces the slow branch."""
    from mhattn._internal import core
    dt = HALVES[dtname]
    w = weights(dt)
    packed = mhattn.pack_weights(*w, num_heads=4, num_kv_heads=2)
    x = np.random.default_rng(5).standard_normal((2, 11, 32)).astype(dt)
    key = np.random.default_rng(6).standard_normal((2, 7, 32)).astype(dt)
    seen = []
    fast = core.fast
    monkeypatch.setattr(core, "fast", lambda *a: seen.append(fast(*a)) or seen[-1])
    for args, kw in (((x, packed), {}), ((x, *w), dict(num_heads=4, num_kv_heads=2)),
                     ((x, packed), dict(key=key))):
        seen.clear()
        got = mhattn.multi_head_attention(*args, causal=True, **kw)
        assert seen and seen[-1] is not None, "the fast branch declined"
        assert seen[-1][0].dtype == np.float32
        slow, _ = mhattn.multi_head_attention(*args, causal=True, return_context=True, **kw)
        assert got.dtype == dt
        np.testing.assert_array_equal(bits(got), bits(slow))
    # the packed object's float32 twins are used as they are
    seen.clear()
    mhattn.multi_head_attention(x, packed)
    assert seen[-1][3] is packed._wide[0]


def test_glue_takes_half_weights_of_one_dtype_with_float32_x_only():
    """_C.forward's weights may all be one half dtype with float32 x (the
    core widens them); a mix, int8, or half weights with float64 x are a
    TypeError naming the argument."""
    from mhattn._internal import core
    w = weights(BF16)
    x = np.random.default_rng(3).standard_normal((1, 5, 32)).astype(np.float32)
    wide = [a.astype(np.float32) for a in w]
    args = list(core.fast(x, *wide, 4, None, None, None, False, None, False, None, 2,
                          None, None, None, None))
    want = core.forward(*args)[0]
    got = core.forward(*args[:3], *w, *args[7:])[0]
    np.testing.assert_array_equal(got, want)
    for i, bad in ((4, w[1].astype(F16)), (5, w[2].astype(np.float32)),
                   (3, w[0].view(np.int16).astype(np.int8))):
        call = args[:3] + w
        call[i] = bad
        with pytest.raises(TypeError, match=("wq" if i == 3 else "") + ".*dtype"):
            core.forward(*call, *args[7:])
    x64 = x.astype(np.float64)
    with pytest.raises(TypeError, match="wq: expected dtype float64"):
        core.forward(x64, x64, x64, *w, *args[7:])
