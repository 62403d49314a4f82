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


@pytest.mark.parametrize("layer_dt, x_dt", [(F16, np.float32), (np.float32, F16),
                                             (F16, BF16), (BF16, np.float32)])
def test_layer_names_itself_when_a_half_dtype_differs(layer_dt, x_dt):
    """A layer called with x of another dtype, one of them half, says that
    the layer holds its dtype and how to match them: not "w_q", an
    attribute the caller never passed."""
    layer = mhattn.MultiHeadAttention(16, 2, dtype=layer_dt, seed=0)
    x = np.ones((3, 16), x_dt)
    with pytest.raises(TypeError) as e:
        layer(x)
    msg = str(e.value)
    assert msg.startswith(f"x: dtype {np.dtype(x_dt)}, but this layer holds "
                          f"{np.dtype(layer_dt)}")
    assert "w_q" not in msg and "layer.astype(" in msg
    with pytest.raises(TypeError, match="^key: dtype"):
        layer(np.ones((3, 16), layer_dt), key=x, value=np.ones((3, 16), layer_dt))
    assert layer(x.astype(layer_dt)).dtype == np.dtype(layer_dt)


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
    widened x and biases, with its fused weights as they are (the core
    widens them as it packs them), or a packed half object's float32
    twins; return_context=True forces the slow branch."""
    from mhattn._internal import core
    dt = HALVES[dtname]
    w = weights(dt)
    packed = mhattn.pack_weights(*w, num_heads=4, num_kv_heads=2)
    x = np.random.default_rng(5).standard_normal((2, 11, 32)).astype(dt)
    key = np.random.default_rng(6).standard_normal((2, 7, 32)).astype(dt)
    seen = []
    fast = core.fast
    monkeypatch.setattr(core, "fast", lambda *a, **k: seen.append(fast(*a, **k)) or seen[-1])
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
    # plain half weights reach the core as they are: no float32 copy
    seen.clear()
    mhattn.multi_head_attention(x, *w, num_heads=4, num_kv_heads=2)
    assert all(seen[-1][3 + i] is w[i] for i in range(4))


# Sizes of the half-weights path's GEMMs (mha.h, w_storage): widths that
# are not multiples of any ISA's panel width NR (8, 16 or 32 floats) and
# d_in 300 > the GEMM's KC (256), so several K blocks; T = 1 and 3 make
# some projections small enough for the GEMM's plain loop.
HALF_WEIGHT_SIZES = {"odd_many_k_blocks": dict(T=37, din=300, h=3, dk=13, dv=11, dout=45),
                     "small_gemms": dict(T=3, din=20, h=2, dk=5, dv=3, dout=7),
                     "one_row": dict(T=1, din=300, h=2, dk=40, dv=24, dout=33)}


@pytest.mark.parametrize("dtname", list(HALVES))
@pytest.mark.parametrize("size", list(HALF_WEIGHT_SIZES))
def test_half_weights_give_the_bits_of_float32_on_the_widened_weights(isa, monkeypatch,
                                                                      size, dtname):
    """Half fused weights, widened by the core as it packs its panels (or,
    for small GEMMs, widened whole), give the bits of the float32 call on
    the widened inputs, rounded once, at 1 and 3 threads, self- and
    cross-attention, with and without W^O and biases."""
    from mhattn._internal import core
    dt, c = HALVES[dtname], HALF_WEIGHT_SIZES[size]
    r = np.random.default_rng(7)
    din, h, dk, dv = c["din"], c["h"], c["dk"], c["dv"]
    x = r.standard_normal((2, c["T"], din)).astype(dt)
    key = r.standard_normal((2, c["T"] + 4, din)).astype(dt)
    s = 1 / np.sqrt(din)
    w = [(r.standard_normal(shape) * s).astype(dt) for shape in
         ((din, h * dk), (din, h * dk), (din, h * dv), (h * dv, c["dout"]))]
    b_q = (r.standard_normal(h * dk) * 0.1).astype(dt)
    seen = []
    fast = core.fast
    monkeypatch.setattr(core, "fast", lambda *a, **k: seen.append(fast(*a, **k)) or seen[-1])
    before = mhattn.get_num_threads()
    try:
        for kw in (dict(), dict(key=key, causal=True), dict(b_q=b_q)):
            for w_o in (w[3], None):
                wide = [None if a is None else a.astype(np.float32) for a in (x, *w[:3], w_o)]
                kw32 = {k: v.astype(np.float32) if isinstance(v, np.ndarray) else v
                        for k, v in kw.items()}
                want = mhattn.multi_head_attention(*wide, num_heads=h, **kw32).astype(dt)
                for n in (1, 3):
                    mhattn.set_num_threads(n)
                    seen.clear()
                    got = mhattn.multi_head_attention(x, *w[:3], w_o, num_heads=h, **kw)
                    assert seen[-1] is not None and seen[-1][3] is w[0]
                    np.testing.assert_array_equal(bits(got), bits(want))
    finally:
        mhattn.set_num_threads(before)


@pytest.mark.parametrize("dtname", list(HALVES))
def test_slow_branch_hands_the_core_half_weights_and_widens_x_once(monkeypatch, dtname):
    """A half call too large for the fast branch (made so by shrinking
    core._FAST_ELEMENTS) hands its fused half weights and w_o to the core
    as they are, widens a self-attention x once (not once each as x, key
    and value), and gives the bits of the float32 call on the widened
    inputs rounded once. With return_context=True (a context keeps float32
    weights for the backward) or with stacked weights, the weights are
    widened as before, with the same bits."""
    from mhattn._internal import args as args_mod
    from mhattn._internal import core
    dt = HALVES[dtname]
    r = np.random.default_rng(11)
    x = r.standard_normal((2, 9, 24)).astype(dt)
    w = [(r.standard_normal(shape) / 5).astype(dt) for shape in
         ((24, 16), (24, 8), (24, 8), (16, 20))]
    monkeypatch.setattr(core, "_FAST_ELEMENTS", 0)
    widened, handed = [], []
    widen, forward = args_mod.widen, core.forward
    monkeypatch.setattr(args_mod, "widen", lambda a: widened.append(a.shape) or widen(a))
    monkeypatch.setattr(core, "forward", lambda *a: handed.append(a) or forward(*a))
    want = mhattn.multi_head_attention(x.astype(np.float32), *(a.astype(np.float32) for a in w),
                                       num_heads=4, num_kv_heads=2, causal=True).astype(dt)
    got = mhattn.multi_head_attention(x, *w, num_heads=4, num_kv_heads=2, causal=True)
    assert widened == [x.shape], widened
    assert all(handed[-1][3 + i] is w[i] for i in range(4))
    np.testing.assert_array_equal(bits(got), bits(want))
    widened.clear()
    got, _ = mhattn.multi_head_attention(x, *w, num_heads=4, num_kv_heads=2, causal=True,
                                         return_context=True)
    assert sorted(widened) == sorted([x.shape] + [a.shape for a in w])
    np.testing.assert_array_equal(bits(got), bits(want))
    stacked = [a.reshape(24, -1, 4).transpose(1, 0, 2) for a in w[:3]]
    got = mhattn.multi_head_attention(x, *stacked, w[3], num_kv_heads=2, causal=True)
    assert handed[-1][3].dtype == np.float32
    np.testing.assert_array_equal(bits(got), bits(want))


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
