"""The output gate (issue 38, item 4): ``w_gate`` (d_in, sum d_v) and
``b_gate`` (sum d_v,) make the concatenation of the heads
``sigmoid(x @ w_gate + b_gate) * concat`` before W^O (Keras's
``MultiHeadAttention(use_gate=True)``, Qwen3-Next's gated attention).

The forward against the NumPy reference on every ISA, in float32 and
float64; the gradients of w_gate, b_gate, x and the others by finite
differences, bitwise for 1 and 3 threads; the context, the trace, the
cached decode, half precision, packed weights and the layer; bad input;
and, when Keras is installed, Keras 3's own gated layer.
"""
import importlib.util
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mhattn
from mhattn import _C, reference
from conftest import child_env, tol
from test_grad import assert_grad_close, fd_grads, grad_scale

DTYPES = [np.float32, np.float64]


def sigmoid(z):
    return 1 / (1 + np.exp(-z))


def case(name, rng, dtype=np.float64):
    """(positional args, keywords) of a gated call; every case has w_gate."""
    r = lambda *s: rng.standard_normal(s).astype(dtype)   # noqa: E731
    B, Tq, Tk, d_in = 2, 6, 6, 5
    kw = {}
    if name == "gqa_causal":          # 4 query heads on 2 kv heads, d_v != d_k
        w = (r(d_in, 12), r(d_in, 6), r(d_in, 10))
        kw.update(num_heads=4, num_kv_heads=2, causal=True)
        Svq = 4 * 5
    elif name == "mask_lengths":      # a bool mask and key lengths (a fully masked row)
        w = (r(d_in, 6), r(d_in, 6), r(d_in, 8))
        mask = rng.random((B, 1, Tq, Tk)) < 0.7
        mask[1, 0, 2] = False
        kw.update(num_heads=2, mask=mask, key_lengths=np.array([6, 4]))
        Svq = 8
    elif name == "float_mask":
        w = (r(d_in, 6), r(d_in, 6), r(d_in, 6))
        kw.update(num_heads=3, mask=np.where(rng.random((Tq, Tk)) < 0.8, 0.0, -np.inf)
                  .astype(dtype) + r(Tq, Tk))
        Svq = 6
    elif name == "cross":             # key and value given: the gate still reads x
        Tk = 9
        w = (r(d_in, 6), r(4, 6), r(7, 8))
        kw.update(num_heads=2, key=r(B, Tk, 4), value=r(B, Tk, 7))
        Svq = 8
    elif name == "ragged":            # per-head lists, each head its own widths
        w = ([r(d_in, 2), r(d_in, 3)], [r(d_in, 2), r(d_in, 3)], [r(d_in, 4), r(d_in, 1)])
        Svq = 5
    elif name == "unbatched":
        w = (r(d_in, 4), r(d_in, 4), r(d_in, 6))
        kw.update(num_heads=2, causal=True)
        Svq = 6
        x = r(Tq, d_in)
    elif name == "long":              # several tiles and GEMM panels
        Tq = Tk = 130
        d_in = 24
        # O(1) scores and values: float32's error stays at the tolerance's
        w = tuple((r(d_in, n) / np.sqrt(d_in)).astype(dtype) for n in (32, 16, 16))
        kw.update(num_heads=4, num_kv_heads=2, causal=True)
        Svq = 32
    else:
        raise KeyError(name)
    if name != "unbatched":
        x = r(B, Tq, d_in)
    kw.update(w_gate=r(d_in, Svq), b_gate=r(Svq))
    return [x, *w, r(Svq, 7)], kw


CASES = ["gqa_causal", "mask_lengths", "float_mask", "cross", "ragged", "unbatched", "long"]


def both(args, kw):
    got = mhattn.multi_head_attention(*args, return_weights=True, **kw)
    want = reference.multi_head_attention(*args, return_weights=True, **kw)
    return got, want


# --------------------------------------------------------------------------
# the forward

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_forward_matches_the_reference(isa, rng, name, dtype):
    args, kw = case(name, rng, dtype)
    variants = [("with w_o and b_gate", args, kw),
                ("without w_o", args[:4] + [None], kw),
                ("without b_gate", args, {**kw, "b_gate": None}),
                ("with b_o, without w_o", args[:4] + [None],
                 {**kw, "b_o": rng.standard_normal(kw["w_gate"].shape[1]).astype(dtype)})]
    for what, a, k in variants:
        (o, w), (ro, rw) = both(a, k)
        assert o.dtype == dtype and o.shape == ro.shape, what
        np.testing.assert_allclose(o, ro, **tol(dtype), err_msg=what)
        np.testing.assert_allclose(w, rw, **tol(dtype), err_msg=what)


def test_the_gate_is_what_the_formula_says(rng):
    """Independently of the reference: out = (sigmoid(x W_g + b_g) * concat)
    W^O, the concatenation being the ungated call's output without W^O."""
    args, kw = case("cross", rng)
    x, wq, wk, wv, wo = args
    gate = sigmoid(x @ kw["w_gate"] + kw["b_gate"])
    plain = {k: v for k, v in kw.items() if k not in ("w_gate", "b_gate")}
    concat = mhattn.multi_head_attention(x, wq, wk, wv, None, **plain)
    out = mhattn.multi_head_attention(x, wq, wk, wv, wo, **kw)
    np.testing.assert_allclose(out, (gate * concat) @ wo, rtol=1e-12, atol=1e-12)
    # the gate is per query row: one row of x changed, only its output moves
    x2 = x.copy()
    x2[0, 3] += 1.0
    moved = mhattn.multi_head_attention(x2, wq, wk, wv, wo, **kw) != out
    assert moved[0, 3].all() and not moved[0, :3].any() and not moved[1].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_open_and_shut_gates(rng, dtype):
    """w_gate = 0 with b_gate = 40 holds the gate open (sigmoid is 1 in both
    dtypes): the bits of the call without a gate. b_gate = -800 shuts it
    (0): out is b_o."""
    args, kw = case("gqa_causal", rng, dtype)
    kw["b_o"] = rng.standard_normal(7).astype(dtype)
    zero = np.zeros_like(kw["w_gate"])
    plain = {k: v for k, v in kw.items() if k not in ("w_gate", "b_gate")}
    want = mhattn.multi_head_attention(*args, **plain)
    full = np.full_like(kw["b_gate"], 40)
    np.testing.assert_array_equal(
        mhattn.multi_head_attention(*args, **{**kw, "w_gate": zero, "b_gate": full}), want)
    shut = mhattn.multi_head_attention(*args, **{**kw, "w_gate": zero,
                                                 "b_gate": np.full_like(full, -800)})
    np.testing.assert_array_equal(shut, np.broadcast_to(kw["b_o"], shut.shape))


def test_without_a_gate_the_bits_are_unchanged(rng):
    """w_gate=None, b_gate=None is no gate: the bits of the call that does not
    name them, on the fast branch as on the slow one, and the glue's tuples
    keep their lengths (_C.backward's 14 gradients)."""
    args, kw = case("gqa_causal", rng)
    plain = {k: v for k, v in kw.items() if k not in ("w_gate", "b_gate")}
    a = mhattn.multi_head_attention(*args, **plain)
    b = mhattn.multi_head_attention(*args, **plain, w_gate=None, b_gate=None)
    np.testing.assert_array_equal(a, b)
    out, ctx = mhattn.multi_head_attention(*args, **plain, w_gate=None, return_context=True)
    np.testing.assert_array_equal(out, a)
    grads = mhattn.backward(np.ones_like(out), ctx)
    assert "w_gate" not in grads and "b_gate" not in grads
    np.testing.assert_array_equal(grads["x"], mhattn.multi_head_attention_grad(
        np.ones_like(out), *args, **plain)["x"])


# --------------------------------------------------------------------------
# the gradients

def fd_check(args, kw, rng, expect):
    p = dict(zip(("x", "w_q", "w_k", "w_v", "w_o"), args), **kw)
    out = mhattn.multi_head_attention(*args, **kw)
    R = rng.standard_normal(out.shape)
    got = mhattn.multi_head_attention_grad(R, *args, **kw)
    assert list(got) == expect
    want = fd_grads(p, R, expect)
    scale = grad_scale(want)
    for name in expect:
        assert_grad_close(got[name], want[name], name, scale)


def small(rng, **extra):
    """A call small enough for finite differences over every element."""
    r = rng.standard_normal
    B, T, d_in = 2, 4, 5
    args = [r((B, T, d_in)), r((d_in, 6)), r((d_in, 3)), r((d_in, 2)), r((4, 3))]
    kw = dict(num_heads=2, num_kv_heads=1, w_gate=r((d_in, 4)), b_gate=r(4), causal=True)
    kw.update(extra)
    return args, kw


def test_gradients_by_finite_differences(rng):
    args, kw = small(rng)
    fd_check(args, kw, rng, ["x", "w_q", "w_k", "w_v", "w_o", "w_gate", "b_gate"])


def test_gradients_cross_attention_and_biases(rng):
    """key and value given: x's gradient has the gate's term and the
    queries' alone; key and value get none from the gate."""
    r = rng.standard_normal
    args, kw = small(rng, key=r((2, 6, 3)), value=r((2, 6, 4)), b_q=r(6), b_o=r(3),
                     causal=False)
    args[2], args[3] = r((3, 3)), r((4, 2))
    fd_check(args, kw, rng, ["x", "key", "value", "w_q", "w_k", "w_v", "w_o", "b_q",
                             "b_o", "w_gate", "b_gate"])


def test_gradients_without_w_o_and_b_gate(rng):
    args, kw = small(rng, b_gate=None)
    args[4] = None
    fd_check(args, kw, rng, ["x", "w_q", "w_k", "w_v", "w_gate"])


def test_gradients_with_masked_rows_and_variants(rng):
    """A fully masked row (its heads give 0, so its gate has no gradient
    there), with sinks and a q/k norm: every gradient by finite differences."""
    r = rng.standard_normal
    mask = np.ones((2, 1, 4, 4), bool)
    mask[0, 0, 1] = False
    args, kw = small(rng, mask=mask, sinks=r(2), q_norm=1 + 0.1 * r(3))
    fd_check(args, kw, rng, ["x", "w_q", "w_k", "w_v", "w_o", "w_gate", "b_gate",
                             "sinks", "q_norm"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_context_backward_is_the_one_call(rng, dtype):
    """The context keeps the heads' concatenation before the gate (what
    the trace calls ``concat``): the backward recomputes the gate."""
    args, kw = case("mask_lengths", rng, dtype)
    out, ctx = mhattn.multi_head_attention(*args, **kw, return_context=True)
    t = mhattn.trace(*args, **kw)
    np.testing.assert_array_equal(ctx.concat, t.concat)
    np.testing.assert_array_equal(out, mhattn.multi_head_attention(*args, **kw))
    R = rng.standard_normal(out.shape).astype(dtype)
    a = mhattn.backward(R, ctx)
    b = mhattn.multi_head_attention_grad(R, *args, **kw)
    assert list(a) == list(b) and a["w_gate"].shape == kw["w_gate"].shape
    assert a["b_gate"].shape == kw["b_gate"].shape
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.fixture
def restore_threads():
    yield
    _C.set_num_threads(0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bitwise_the_same_for_1_and_3_threads(rng, dtype, restore_threads):
    """Large enough that the tiles, the GEMMs and the gate's elementwise
    passes split between the threads."""
    r = lambda *s: rng.standard_normal(s).astype(dtype)   # noqa: E731
    B, T, d_in = 2, 400, 96
    args = [r(B, T, d_in), r(d_in, 96), r(d_in, 48), r(d_in, 48), r(96, 40)]
    kw = dict(num_heads=4, num_kv_heads=2, causal=True, w_gate=r(d_in, 96) / 10,
              b_gate=r(96), b_o=r(40))
    R = r(B, T, 40)
    results = []
    for n in (1, 3):
        mhattn.set_num_threads(n)
        out, ctx = mhattn.multi_head_attention(*args, **kw, return_context=True)
        results.append((out, mhattn.backward(R, ctx)))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    assert list(results[0][1]) == ["x", "w_q", "w_k", "w_v", "w_o", "b_o", "w_gate", "b_gate"]
    for k in results[0][1]:
        np.testing.assert_array_equal(results[0][1][k], results[1][1][k], err_msg=k)


def test_float32_gradients_close_to_float64(rng):
    args, kw = case("gqa_causal", rng)
    R = rng.standard_normal((2, 6, 7))
    g64 = mhattn.multi_head_attention_grad(R, *args, **kw)
    f32 = lambda a: a.astype(np.float32) if isinstance(a, np.ndarray) else a  # noqa: E731
    g32 = mhattn.multi_head_attention_grad(f32(R), *map(f32, args),
                                           **{k: f32(v) for k, v in kw.items()})
    scale = grad_scale(g64)
    for k in g64:
        assert g32[k].dtype == np.float32
        np.testing.assert_allclose(g32[k], g64[k], rtol=1e-4, atol=1e-4 * scale, err_msg=k)


def test_inputs_are_not_modified(rng):
    args, kw = case("cross", rng)
    before = [a.copy() for a in args] + [kw["w_gate"].copy(), kw["b_gate"].copy()]
    R = rng.standard_normal((2, 6, 7))
    mhattn.multi_head_attention_grad(R, *args, **kw)
    mhattn.multi_head_attention(*args, **kw)
    for a, b in zip(args + [kw["w_gate"], kw["b_gate"]], before):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------
# everything else that computes a call

def test_trace_has_the_gate_stages(rng):
    args, kw = case("gqa_causal", rng)
    t = mhattn.trace(*args, **kw)
    keys = t.keys()
    assert keys[keys.index("concat") + 1:] == ("gate", "gated", "output")
    x = args[0]
    np.testing.assert_allclose(t.gate, sigmoid(x @ kw["w_gate"] + kw["b_gate"]), rtol=1e-14)
    np.testing.assert_array_equal(t.gated, t.gate * t.concat)
    np.testing.assert_array_equal(t.output, mhattn.multi_head_attention(*args, **kw))
    np.testing.assert_allclose(t.gated @ args[4], t.output, rtol=1e-12, atol=1e-12)
    assert "gate" not in mhattn.trace(*args, num_heads=4, num_kv_heads=2).keys()


@pytest.mark.parametrize("dtype", DTYPES)
def test_cached_decode_takes_the_gate(rng, dtype):
    """The gate is per query row: a KV cache's steps (prefill, then one row
    at a time, then a ragged step) give the full call's rows."""
    r = lambda *s: rng.standard_normal(s).astype(dtype)   # noqa: E731
    B, T, d_in, H, G, dk, dv = 2, 9, 8, 4, 2, 3, 5
    w = (r(d_in, H * dk), r(d_in, G * dk), r(d_in, G * dv), r(H * dv, 6))
    kw = dict(num_heads=H, num_kv_heads=G, w_gate=r(d_in, H * dv), b_gate=r(H * dv))
    x = r(B, T, d_in)
    full = mhattn.multi_head_attention(x, *w, causal=True, **kw)
    cache = mhattn.KVCache(B, G, 16, dk, dv, dtype=dtype)
    steps = [mhattn.multi_head_attention(x[:, :4], *w, causal=True, cache=cache, **kw)]
    steps += [mhattn.multi_head_attention(x[:, i:i + 1], *w, causal=True, cache=cache, **kw)
              for i in range(4, T)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, **tol(dtype))
    ragged = mhattn.KVCache(B, G, 16, dk, dv, dtype=dtype)
    out = mhattn.multi_head_attention(x[:, :5], *w, causal=True, cache=ragged,
                                      new_lengths=[5, 3], **kw)
    np.testing.assert_allclose(out[0], full[0, :5], **tol(dtype))
    np.testing.assert_allclose(out[1, :3], full[1, :3], **tol(dtype))
    assert not out[1, 3:].any()


@pytest.mark.parametrize("dtname", ["float16", "bfloat16"])
@pytest.mark.parametrize("T", [5, 160])
def test_half_weights_give_the_float32_bits_rounded_once(rng, dtname, T):
    """Half x, weights and w_gate (the core widens them as it packs them):
    the float32 call on the widened values, rounded once; and the
    reference in float64 within half precision."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    dt = np.dtype(np.float16 if dtname == "float16" else ml_dtypes.bfloat16)
    d = 32
    h = lambda *s: (rng.standard_normal(s) / np.sqrt(s[0])).astype(dt)   # noqa: E731
    x = (rng.standard_normal((2, T, d))).astype(dt)
    w = [h(d, d) for _ in range(4)]
    kw = dict(num_heads=4, causal=True, w_gate=h(d, d), b_gate=h(d))
    out = mhattn.multi_head_attention(x, *w, **kw)
    wide = lambda a: a.astype(np.float32)   # noqa: E731
    want = mhattn.multi_head_attention(wide(x), *map(wide, w), causal=True, num_heads=4,
                                       w_gate=wide(kw["w_gate"]), b_gate=wide(kw["b_gate"]))
    assert out.dtype == dt
    np.testing.assert_array_equal(out.view(np.uint16), want.astype(dt).view(np.uint16))
    ref = reference.multi_head_attention(x, *w, **kw)
    eps = 2.0 ** (-11 if dtname == "float16" else -8)
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=4 * eps,
                               atol=4 * eps * np.abs(ref).max())
    R = rng.standard_normal(out.shape).astype(dt)
    g = mhattn.multi_head_attention_grad(R, x, *w, **kw)
    assert g["w_gate"].dtype == dt and g["b_gate"].dtype == dt


def test_packed_weights_take_the_gate(rng):
    args, kw = case("gqa_causal", rng)
    x, wq, wk, wv, wo = args
    packed = mhattn.pack_weights(wq, wk, wv, wo, num_heads=4, num_kv_heads=2)
    np.testing.assert_array_equal(
        mhattn.multi_head_attention(x, packed, causal=True, w_gate=kw["w_gate"],
                                    b_gate=kw["b_gate"]),
        mhattn.multi_head_attention(*args, **kw))


# --------------------------------------------------------------------------
# the layer

@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_with_a_gate(rng, dtype):
    layer = mhattn.MultiHeadAttention(16, 4, num_kv_heads=2, d_v=3, bias=True, gate=True,
                                      dtype=dtype, seed=0)
    assert layer.w_gate.shape == (16, 12) and layer.b_gate.shape == (12,)
    assert "gate=True" in repr(layer) and layer.param_count == sum(
        a.size for a in layer.weights().values())
    x = rng.standard_normal((2, 5, 16)).astype(dtype)
    layer.b_gate[:] = rng.standard_normal(12)   # a plain array, changed in place
    out, ctx = layer(x, causal=True, return_context=True)
    kw = layer.arguments()
    assert kw["w_gate"] is layer.w_gate and kw["b_gate"] is layer.b_gate
    np.testing.assert_allclose(out, reference.multi_head_attention(
        x, causal=True, num_heads=4, **kw), **tol(dtype))
    grads = layer.backward(np.ones_like(out), ctx)
    assert grads["w_gate"].shape == (16, 12) and grads["b_gate"].shape == (12,)
    # state_dict: gate_proj.* in out_proj's layout; a round trip is the layer
    sd = layer.state_dict()
    np.testing.assert_array_equal(sd["gate_proj.weight"], layer.w_gate.T)
    np.testing.assert_array_equal(sd["gate_proj.bias"], layer.b_gate)
    other = mhattn.MultiHeadAttention(16, 4, num_kv_heads=2, d_v=3, bias=True, gate=True,
                                      dtype=dtype, seed=1)
    other.load_state_dict(sd)
    np.testing.assert_array_equal(other(x), layer(x))
    plain = mhattn.MultiHeadAttention(16, 4, num_kv_heads=2, d_v=3, bias=True, dtype=dtype)
    with pytest.raises(ValueError, match="unexpected.*gate_proj"):
        plain.load_state_dict(sd)
    copy = layer.astype(np.float64)
    assert copy.has_gate and copy.w_gate.dtype == np.float64
    with pytest.raises(TypeError, match="w_gate"):
        layer(x, w_gate=layer.w_gate)


def test_layer_initialises_the_gate_as_keras_and_draws_the_rest_as_before():
    """Glorot-uniform over (d_model, h*d_v), zero bias; and a gated layer's
    other weights are the bits an ungated one of the same seed draws."""
    gated = mhattn.MultiHeadAttention(64, 4, d_v=32, gate=True, dtype=np.float64, seed=3)
    plain = mhattn.MultiHeadAttention(64, 4, d_v=32, dtype=np.float64, seed=3)
    for name in ("w_q", "w_k", "w_v", "w_o"):
        np.testing.assert_array_equal(getattr(gated, name), getattr(plain, name))
    assert plain.w_gate is None and plain.b_gate is None and "gate_proj.weight" not in \
        plain.state_dict()
    limit = np.sqrt(6 / (64 + 128))
    w = gated.w_gate
    assert np.abs(w).max() <= limit and np.abs(w).max() > 0.98 * limit
    assert abs(w.std() - limit / np.sqrt(3)) < 0.02 * limit and abs(w.mean()) < 0.02 * limit
    assert not gated.b_gate.any()


def test_layer_gate_refusals():
    with pytest.raises(TypeError, match="gate"):
        mhattn.MultiHeadAttention(8, 2, gate="yes")
    layer = mhattn.MultiHeadAttention(8, 2, gate=True)
    with pytest.raises(ValueError, match="output gate"):
        layer.to_torch()


# --------------------------------------------------------------------------
# bad input

@pytest.mark.parametrize("fn", [mhattn.multi_head_attention, reference.multi_head_attention,
                                mhattn.trace])
def test_bad_gate_shapes_name_the_argument(rng, fn):
    x = rng.standard_normal((2, 5, 6))
    w = rng.standard_normal((6, 8))
    good = dict(num_heads=2, w_gate=rng.standard_normal((6, 8)), b_gate=np.zeros(8))
    bad = [("w_gate", dict(w_gate=np.ones((6, 7))), r"w_gate: expected shape \(6, 8\).*"
            r"got \(6, 7\)"),
           ("w_gate", dict(w_gate=np.ones((5, 8))), r"w_gate: .*x \(2, 5, 6\).*got \(5, 8\)"),
           ("w_gate", dict(w_gate=np.ones(8)), r"w_gate: expected shape \(6, 8\).*got \(8,\)"),
           ("b_gate", dict(b_gate=np.ones(7)), r"b_gate: expected shape \(8,\).*got \(7,\)"),
           ("b_gate", dict(b_gate=np.ones((1, 8))), r"b_gate: .*got \(1, 8\)"),
           ("b_gate", dict(w_gate=None), r"b_gate: given \(shape \(8,\)\) without w_gate")]
    fn(x, w, w, w, **good)
    for _, change, match in bad:
        with pytest.raises(ValueError, match=match):
            fn(x, w, w, w, **{**good, **change})


def test_bad_gate_dtypes_and_the_glue(rng):
    x = rng.standard_normal((1, 3, 4)).astype(np.float16)
    w = rng.standard_normal((4, 4)).astype(np.float16)
    with pytest.raises(TypeError, match="w_gate"):
        mhattn.multi_head_attention(x, w, w, w, num_heads=1, w_gate=np.ones((4, 4)))
    with pytest.raises(TypeError, match="w_gate"):
        mhattn.multi_head_attention(np.ones((3, 4)), w.astype(float), w.astype(float),
                                    w.astype(float), num_heads=1, w_gate=[["a"] * 4] * 4)
    # the glue and the core, below the friendly checks: shapes by letter,
    # keyword-only, and bgate without wgate
    x = np.ones((1, 3, 4))
    w = np.ones((4, 4))
    dk = np.array([2, 2])
    args = (x, x, x, w, w, w, w, None, None, None, None, dk, dk, np.ones(2), None, False,
            None, None, False, False)
    with pytest.raises(ValueError, match=r"wgate: expected shape \(4, 4\)"):
        _C.forward(*args, wgate=np.ones((4, 3)))
    with pytest.raises(ValueError, match=r"bgate: expected shape \(4,\)"):
        _C.forward(*args, wgate=w, bgate=np.ones(3))
    with pytest.raises(TypeError):
        _C.forward(*args, None, w)           # keyword-only
    with pytest.raises(ValueError, match="bgate is given without wgate") as e:
        _C.forward(*args, bgate=np.ones(4))
    assert e.value.field == "params"
    out, _, (q, k, v, cat, lse) = _C.forward(*args[:-1], True, wgate=w)
    bwd = (out, x, None, None, w, w, w, w, q, k, v, cat, lse, dk, dk, np.ones(2), None,
           False, None, None, False, False, False, False)
    assert len(_C.backward(*bwd)) == 14 and len(_C.backward(*bwd, wgate=w)) == 16
    with pytest.raises(ValueError, match="bgate is given without wgate"):
        _C.backward(*bwd, bgate=np.ones(4))


# --------------------------------------------------------------------------
# Keras 3's gated MultiHeadAttention

KERAS_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import keras
    import mhattn
    from mhattn import reference

    rng = np.random.default_rng(7)
    result = {"has_use_gate": "use_gate" in keras.layers.MultiHeadAttention.__init__
              .__code__.co_varnames}
    B, Tq, Tk, D, Dk, H, dk, dv, Dout = 2, 5, 7, 8, 6, 2, 3, 4, 5

    def fused(layer):
        W = {v.path.split("/", 1)[1]: np.asarray(v) for v in layer.weights}
        two = lambda k: W[k + "/kernel"].reshape(W[k + "/kernel"].shape[0], -1)
        one = lambda k: W[k + "/bias"].reshape(-1)
        return dict(w_q=two("query"), w_k=two("key"), w_v=two("value"),
                    w_o=W["attention_output/kernel"].reshape(H * dv, -1),
                    b_q=one("query"), b_k=one("key"), b_v=one("value"),
                    b_o=W["attention_output/bias"], w_gate=two("gate"), b_gate=one("gate"))

    if result["has_use_gate"]:
        errors = {}
        for name in ("cross", "self_causal_mask"):
            layer = keras.layers.MultiHeadAttention(
                num_heads=H, key_dim=dk, value_dim=dv, output_shape=Dout, use_gate=True,
                bias_initializer="random_normal", seed=1)
            x = rng.standard_normal((B, Tq, D)).astype(np.float32)
            if name == "cross":
                kv = rng.standard_normal((B, Tk, Dk)).astype(np.float32)
                want = np.asarray(layer(x, kv, kv))
                kw = dict(key=kv)
            else:
                # no fully masked row: Keras's softmax spreads such a row
                # over its keys, mhattn's gives it zero weights
                mask = (rng.random((B, Tq, Tq)) < 0.8) | np.eye(Tq, dtype=bool)
                want = np.asarray(layer(x, x, attention_mask=mask, use_causal_mask=True))
                kw = dict(mask=mask[:, None], causal=True)
            w = fused(layer)
            got = mhattn.multi_head_attention(x, w.pop("w_q"), w.pop("w_k"), w.pop("w_v"),
                                              w.pop("w_o"), num_heads=H, **w, **kw)
            # and without the gate's GEMM in mhattn: the hand-written gate
            plain = {k: v for k, v in w.items() if k not in ("w_gate", "b_gate", "b_o")}
            wf = fused(layer)
            concat = mhattn.multi_head_attention(x, wf["w_q"], wf["w_k"], wf["w_v"], None,
                                                 num_heads=H, **plain, **kw)
            gate = 1 / (1 + np.exp(-(x @ wf["w_gate"] + wf["b_gate"])))
            by_hand = (gate * concat) @ wf["w_o"] + wf["b_o"]
            errors[name] = [float(np.abs(got - want).max()), float(np.abs(by_hand - want).max()),
                            float(np.abs(want).max()), str(got.dtype)]
        result["errors"] = errors
        big = keras.layers.MultiHeadAttention(num_heads=4, key_dim=16, use_gate=True)
        big(np.zeros((1, 3, 64), np.float32), np.zeros((1, 3, 64), np.float32))
        g = {v.path.split("/", 1)[1]: np.asarray(v) for v in big.weights}
        result["gate_init"] = [float(np.abs(g["gate/kernel"]).max()),
                               float(np.abs(g["gate/bias"]).max())]
    print("RESULT " + json.dumps(result))
""")


@pytest.mark.slow
def test_against_keras_gated_multi_head_attention():
    """Keras 3's MultiHeadAttention(use_gate=True), its kernels mapped onto
    mhattn's fused weights, in float32, in a child process (KERAS_BACKEND is
    read at Keras's import; the NumPy backend: Keras 3.15's JAX path fails
    on value_dim != key_dim before any gate is involved)."""
    # Not imported here: Keras picks its backend (TensorFlow by default) at
    # its first import, which belongs to the child.
    if importlib.util.find_spec("keras") is None:
        pytest.skip("Keras is not installed")
    env = dict(child_env(), KERAS_BACKEND="numpy")
    done = subprocess.run([sys.executable, "-c", KERAS_SCRIPT], env=env, timeout=600,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    if not result["has_use_gate"]:
        pytest.skip("this Keras has no MultiHeadAttention(use_gate=...)")
    for name, (err, by_hand, scale, dtype) in result["errors"].items():
        assert dtype == "float32", name
        assert err <= 1e-5 * max(scale, 1), (name, err)
        assert by_hand <= 1e-5 * max(scale, 1), (name, by_hand)
    # Keras's init of the gate (d_model 64, 4 heads of 16): glorot_uniform
    # over (64, 64), a zero bias; the layer's draws the same distribution
    kmax, kbias = result["gate_init"]
    limit = np.sqrt(6 / (64 + 64))
    assert 0.95 * limit < kmax <= limit and kbias == 0
    ours = mhattn.MultiHeadAttention(64, 4, gate=True, seed=0)
    assert 0.95 * limit < np.abs(ours.w_gate).max() <= limit and not ours.b_gate.any()
