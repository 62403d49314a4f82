"""The q/k LayerNorm (issue 38 item 5): ``norm_type="layer"``.

y = (x - mean(x)) / sqrt(var(x) + norm_eps) * w per head over d_k, var the
biased variance, no bias, as Flax NNX's MultiHeadAttention(normalize_qk=True).
Held here: the C forward against the float64 reference on a grid (GQA,
causal, masks, windows, RoPE, odd d_k, batches, shared and per-head
weights) on every ISA in float32 and float64; its gradients by central
differences of the reference, float32 against float64, and bitwise the
same for 1 and 3 threads; the cached decode step, the layer, the trace;
with the output gate too (w_gate, b_gate; the layer's gate=True); Flax
NNX itself; the RMS path unchanged (tests/test_golden.py pins its
bits as main's build recorded them, tests/golden_cases.py "qk_norm_*");
and the refusals.
"""
import numpy as np
import pytest

import mhattn
from mhattn import reference as R

B, H, G, D_IN = 2, 4, 2, 12


def _weights(rng, dtype, dk, *, h=H, g=G, d_in=D_IN, d_out=D_IN, bias=False, offset=0.0):
    """Fused weights (and biases): a dict of multi_head_attention's keywords.
    ``offset`` shifts b_q and b_k, so that q and k have a mean far from 0
    (what LayerNorm removes and RMSNorm does not)."""
    p = dict(w_q=rng.standard_normal((d_in, h * dk)) * 0.5,
             w_k=rng.standard_normal((d_in, g * dk)) * 0.5,
             w_v=rng.standard_normal((d_in, g * dk)),
             w_o=rng.standard_normal((h * dk, d_out)), num_heads=h, num_kv_heads=g)
    if bias or offset:
        p.update(b_q=rng.standard_normal(h * dk) * 0.3 + offset,
                 b_k=rng.standard_normal(g * dk) * 0.3 - offset,
                 b_v=rng.standard_normal(g * dk) * 0.3, b_o=rng.standard_normal(d_out) * 0.3)
    return {k: (v.astype(dtype) if isinstance(v, np.ndarray) else v) for k, v in p.items()}


def _rope(dk):
    """RoPE over every feature of an even d_k, all but the last of an odd one."""
    return mhattn.RoPE(rotary_dim=dk - dk % 2)


def _norms(rng, dtype, dk, q="shared", k="shared", h=H, g=G):
    """q_norm / k_norm: "shared" (d_k,), "per_head" (h or g, d_k), or None."""
    out = {}
    for name, form, n in (("q_norm", q, h), ("k_norm", k, g)):
        if form is not None:
            shape = (dk,) if form == "shared" else (n, dk)
            out[name] = (rng.random(shape) + 0.5).astype(dtype)
    return out


# Each case: (d_k, Tq, Tk, cross, keywords of (rng, dtype, dk, Tq, Tk)).
CASES = {
    "shared": (8, 9, 9, False, lambda r, dt, dk, tq, tk: _norms(r, dt, dk)),
    "per_head_gqa_odd_dk": (7, 9, 11, True, lambda r, dt, dk, tq, tk: _norms(
        r, dt, dk, "per_head", "per_head")),
    "q_only_causal": (5, 10, 10, False, lambda r, dt, dk, tq, tk: dict(
        _norms(r, dt, dk, "per_head", None), causal=True)),
    "k_only_cross_causal": (6, 7, 12, True, lambda r, dt, dk, tq, tk: dict(
        _norms(r, dt, dk, None, "per_head"), causal=True)),
    "rope_causal": (8, 13, 13, False, lambda r, dt, dk, tq, tk: dict(
        _norms(r, dt, dk), causal=True, rope=mhattn.RoPE())),
    "rope_partial_interleaved_positions": (10, 6, 9, True, lambda r, dt, dk, tq, tk: dict(
        _norms(r, dt, dk, "per_head", "shared"),
        rope=mhattn.RoPE(theta=500.0, rotary_dim=6, interleaved=True),
        positions=r.integers(0, 50, (B, tq)), key_positions=r.integers(0, 50, tk))),
    "mask_bool_window": (7, 11, 11, False, lambda r, dt, dk, tq, tk: dict(
        _norms(r, dt, dk), mask=r.random((H, tq, tk)) < 0.8, window=(4, 1))),
    "mask_additive_key_lengths": (9, 8, 10, True, lambda r, dt, dk, tq, tk: dict(
        _norms(r, dt, dk, "per_head", "per_head"), mask=r.standard_normal((tq, tk)).astype(dt),
        key_lengths=np.array([tk, tk - 3]))),
    "key_mask_sinks_softcap": (8, 9, 9, False, lambda r, dt, dk, tq, tk: dict(
        _norms(r, dt, dk), key_mask=r.random((B, tk)) < 0.8, sinks=r.standard_normal(H).astype(dt),
        softcap=5.0)),
    "eps_large": (3, 5, 6, True, lambda r, dt, dk, tq, tk: dict(
        _norms(r, dt, dk, "shared", "per_head"), norm_eps=0.25)),
}


def _problem(rng, dtype, name, *, offset=3.0):
    dk, tq, tk, cross, make = CASES[name]
    p = _weights(rng, dtype, dk, offset=offset)
    p["x"] = rng.standard_normal((B, tq, D_IN)).astype(dtype)
    if cross:
        p["key"] = rng.standard_normal((B, tk, D_IN)).astype(dtype)
    p.update(make(rng, dtype, dk, tq, tk))
    return p


def _as64(kw):
    return {k: (v.astype(np.float64) if isinstance(v, np.ndarray) and v.dtype.kind == "f"
                else v) for k, v in kw.items()}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_matches_the_float64_reference(rng, isa, dtype, name):
    p = _problem(rng, dtype, name)
    out, w = mhattn.multi_head_attention(**p, norm_type="layer", return_weights=True)
    ref, ref_w = R.multi_head_attention(**_as64(p), norm_type="layer", return_weights=True)
    assert out.dtype == dtype and np.isfinite(out).all()
    scale = float(np.abs(ref).max())
    # float64: rounding alone. float32: the projections (12 terms), the
    # norm (rounded once from double), q.k over d_k and the softmax, each
    # a few ulps of O(1) values, then W^O over h*d_k <= 40 terms.
    tol = 1e-12 if dtype == np.float64 else 2e-5
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(w, ref_w, rtol=tol, atol=tol)
    # LayerNorm is not RMSNorm here: the projections' means are far from 0.
    rms = R.multi_head_attention(**_as64(p), norm_type="rms")
    assert np.abs(rms - ref).max() > 1e3 * tol * scale


def test_unbatched_and_packed_sequences(rng):
    dk = 6
    p = _weights(rng, np.float64, dk, offset=2.0)
    x = rng.standard_normal((11, D_IN))
    kw = dict(_norms(rng, np.float64, dk, "per_head", "shared"), norm_type="layer",
              rope=mhattn.RoPE())
    np.testing.assert_allclose(mhattn.multi_head_attention(x, **p, **kw),
                               R.multi_head_attention(x, **p, **kw), rtol=1e-12, atol=1e-12)
    cu = np.array([0, 4, 11])
    packed = mhattn.multi_head_attention(x, **p, **kw, causal=True, cu_seqlens=cu)
    for a, b in zip(cu[:-1], cu[1:]):
        alone = mhattn.multi_head_attention(x[a:b], **p, **kw, causal=True)
        np.testing.assert_allclose(packed[a:b], alone, rtol=1e-12, atol=1e-12)


def test_the_reference_layer_norm_is_flax_s_definition(rng):
    """mean 0 and (biased) variance 1 per row with weight 1; eps inside the root."""
    x = rng.standard_normal((5, 7)) * 3 + 10
    y = R.layer_norm(x, np.ones(7), 0.0)
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-13)
    np.testing.assert_allclose(y.var(-1), 1, rtol=1e-13)      # np.var: ddof=0, biased
    w = rng.random(7) + 0.5
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 0.3) * w
    np.testing.assert_allclose(R.layer_norm(x, w, 0.3), want, rtol=1e-14)


# --- gradients ------------------------------------------------------------------

GRAD_CASES = ["rope_causal", "per_head_gqa_odd_dk", "q_only_causal", "k_only_cross_causal",
              "mask_additive_key_lengths", "eps_large"]


def _fd_reference(p, R_out, name, idx, eps=1e-6):
    """Central difference of sum(reference(...) * R_out) in ``name`` at idx."""
    def loss(q):
        return float(np.sum(R.multi_head_attention(**q, norm_type="layer") * R_out))
    vals = []
    for sign in (1, -1):
        q = dict(p)
        a = np.array(p[name], dtype=np.float64)
        a[idx] += sign * eps
        q[name] = a
        vals.append(loss(q))
    return (vals[0] - vals[1]) / (2 * eps)


@pytest.mark.parametrize("name", GRAD_CASES)
def test_gradients_by_finite_differences(rng, isa, name):
    p = _problem(rng, np.float64, name, offset=1.5)
    p.setdefault("b_q", None)
    p = {k: v for k, v in p.items() if v is not None}
    R_out = rng.standard_normal((B, p["x"].shape[1], D_IN))
    g = mhattn.multi_head_attention_grad(R_out, **p, norm_type="layer")
    assert ("q_norm" in g) == ("q_norm" in p) and ("k_norm" in g) == ("k_norm" in p)
    scale = max(float(np.abs(v).max()) for v in g.values())
    checked = 0
    for arg in ("q_norm", "k_norm", "x", "key", "w_q", "w_k", "w_v", "w_o", "b_q", "b_k"):
        if arg not in p:
            continue
        assert g[arg].shape == np.shape(p[arg]), arg
        flat = list(np.ndindex(g[arg].shape))
        picks = rng.choice(len(flat), min(5, len(flat)), replace=False)
        for idx in (flat[i] for i in picks):
            fd = _fd_reference(p, R_out, arg, idx)
            assert abs(g[arg][idx] - fd) <= 1e-6 * scale + 1e-8, (arg, idx, g[arg][idx], fd)
            checked += 1
    assert checked >= 35


def test_float32_gradients_follow_float64(rng):
    p64 = _problem(rng, np.float64, "per_head_gqa_odd_dk", offset=1.5)
    p32 = {k: (v.astype(np.float32) if isinstance(v, np.ndarray) else v) for k, v in p64.items()}
    R_out = rng.standard_normal((B, p64["x"].shape[1], D_IN))
    g64 = mhattn.multi_head_attention_grad(R_out, **p64, norm_type="layer")
    g32 = mhattn.multi_head_attention_grad(R_out.astype(np.float32), **p32, norm_type="layer")
    for k in g64:
        assert g32[k].dtype == np.float32
        s = float(np.abs(g64[k]).max())
        np.testing.assert_allclose(g32[k], g64[k], rtol=1e-3, atol=3e-5 * s, err_msg=k)


def test_the_context_backward_is_the_one_call_backward(rng):
    p = _problem(rng, np.float64, "rope_causal")
    out, ctx = mhattn.multi_head_attention(**p, norm_type="layer", return_context=True)
    R_out = rng.standard_normal(out.shape)
    a = mhattn.backward(R_out, ctx)
    b = mhattn.multi_head_attention_grad(R_out, **p, norm_type="layer")
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), k


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bits_do_not_depend_on_threads(rng, dtype):
    """Large enough that the q/k transforms, their backward, the attention
    and the GEMMs all split their work (csrc/core/qk.c: QK_SMALL elements)."""
    dk, T = 64, 160
    p = _weights(rng, dtype, dk, offset=1.0)
    p["x"] = rng.standard_normal((B, T, D_IN)).astype(dtype)
    kw = dict(_norms(rng, dtype, dk, "per_head", "shared"), norm_type="layer", causal=True,
              rope=mhattn.RoPE())
    R_out = rng.standard_normal((B, T, D_IN)).astype(dtype)
    before = mhattn.get_num_threads()
    runs = []
    try:
        for n in (1, 3):
            mhattn.set_num_threads(n)
            out = mhattn.multi_head_attention(**p, **kw)
            cache = mhattn.KVCache(B, G, T, dk, dtype=dtype)
            steps = [mhattn.multi_head_attention(p["x"][:, a:b], **{
                k: v for k, v in p.items() if k != "x"}, **kw, cache=cache)
                for a, b in ((0, 100), (100, 101), (101, T))]
            runs.append((out, steps, mhattn.multi_head_attention_grad(R_out, **p, **kw)))
    finally:
        mhattn.set_num_threads(before)
    (o1, s1, g1), (o3, s3, g3) = runs
    assert o1.tobytes() == o3.tobytes()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(s1, s3))
    assert sorted(g1) == sorted(g3)
    for k in g1:
        assert g1[k].tobytes() == g3[k].tobytes(), k


# --- the cached decode step -----------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cached_decode_is_the_causal_forward(rng, isa, dtype):
    """Prefill, then one row at a time through a KVCache: each step's rows
    are those of the causal forward over the whole sequence."""
    dk, T = 7, 9
    p = _weights(rng, dtype, dk, bias=True, offset=2.0)
    x = rng.standard_normal((B, T, D_IN)).astype(dtype)
    kw = dict(_norms(rng, dtype, dk, "per_head", "per_head"), norm_type="layer",
              causal=True, rope=_rope(dk))
    whole = mhattn.multi_head_attention(x, **p, **kw)
    ref = R.multi_head_attention(**_as64(dict(p, x=x, **kw)))
    cache = mhattn.KVCache(B, G, 16, dk, dtype=dtype)
    steps = [mhattn.multi_head_attention(x[:, a:b], **p, **kw, cache=cache)
             for a, b in ((0, 5), (5, 6), (6, 7), (7, 9))]
    got = np.concatenate(steps, axis=1)
    tol = 1e-12 if dtype == np.float64 else 2e-5
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(got, whole, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * scale)
    rms_cache = mhattn.KVCache(B, G, 16, dk, dtype=dtype)
    rms = mhattn.multi_head_attention(x, **p, **dict(kw, norm_type="rms"), cache=rms_cache)
    assert np.abs(rms - whole).max() > 1e3 * tol * scale


# --- the RMS path is unchanged ----------------------------------------------------

def test_rms_is_the_default_bit_for_bit(rng):
    """norm_type="rms" computes what the call without it computes (whose bits
    tests/test_golden.py holds to main's build), in every entry point."""
    dk = 7
    p = _weights(rng, np.float32, dk, bias=True, offset=1.0)
    p["x"] = rng.standard_normal((B, 10, D_IN)).astype(np.float32)
    kw = dict(_norms(rng, np.float32, dk, "per_head", "shared"), causal=True,
              rope=_rope(dk))
    R_out = rng.standard_normal((B, 10, D_IN)).astype(np.float32)
    same = lambda a, b: a.tobytes() == b.tobytes()   # noqa: E731
    assert same(mhattn.multi_head_attention(**p, **kw),
                mhattn.multi_head_attention(**p, **kw, norm_type="rms"))
    ga = mhattn.multi_head_attention_grad(R_out, **p, **kw)
    gb = mhattn.multi_head_attention_grad(R_out, **p, **kw, norm_type="rms")
    assert sorted(ga) == sorted(gb) and all(same(ga[k], gb[k]) for k in ga)
    ta, tb = mhattn.trace(**p, **kw), mhattn.trace(**p, **kw, norm_type="rms")
    assert same(ta.q_normed, tb.q_normed) and same(ta.output, tb.output)
    steps = []
    for extra in ({}, {"norm_type": "rms"}):
        cache = mhattn.KVCache(B, G, 16, dk, dtype=np.float32)
        x = p["x"]
        steps.append([mhattn.multi_head_attention(x[:, a:b], **{
            k: v for k, v in p.items() if k != "x"}, **kw, **extra, cache=cache)
            for a, b in ((0, 6), (6, 7))])
    assert all(same(a, b) for a, b in zip(*steps))
    # and the reference's RMSNorm is still rms_norm
    st = mhattn.trace(**p, **kw, norm_type="rms")
    assert st.norm_type == "rms"


def test_norm_type_needs_a_norm_weight_to_matter(rng):
    """Without q_norm and k_norm, norm_type changes nothing (but is checked)."""
    p = _weights(rng, np.float64, 6, offset=1.0)
    p["x"] = rng.standard_normal((B, 7, D_IN))
    for kw in ({}, {"rope": mhattn.RoPE(), "causal": True}):
        a = mhattn.multi_head_attention(**p, **kw)
        b = mhattn.multi_head_attention(**p, **kw, norm_type="layer")
        assert a.tobytes() == b.tobytes()
        ga = mhattn.multi_head_attention_grad(np.ones_like(a), **p, **kw)
        gb = mhattn.multi_head_attention_grad(np.ones_like(a), **p, **kw, norm_type="layer")
        assert all(ga[k].tobytes() == gb[k].tobytes() for k in ga)
        assert "q_norm" not in gb and "k_norm" not in gb


def test_one_side_normed_leaves_the_other_raw(rng):
    """k_norm alone: q is the raw projection, k is LayerNormed."""
    dk = 6
    p = _weights(rng, np.float64, dk, offset=2.0)
    p["x"] = rng.standard_normal((B, 5, D_IN))
    kn = rng.random((G, dk)) + 0.5
    t = mhattn.trace(**p, k_norm=kn, norm_type="layer")
    np.testing.assert_array_equal(t.q, t.q_proj)
    want = np.stack([R.layer_norm(t.k_proj[:, h], kn[h // (H // G)], 1e-6)
                     for h in range(H)], axis=1)
    np.testing.assert_allclose(t.k_normed, want, rtol=1e-14, atol=1e-14)


# --- the trace ------------------------------------------------------------------

def test_trace_stages_are_the_layer_norm(rng):
    dk = 5
    p = _weights(rng, np.float64, dk, offset=2.0)
    p["x"] = rng.standard_normal((5, D_IN))
    kw = dict(_norms(rng, np.float64, dk, "per_head", "shared"), norm_type="layer",
              rope=_rope(dk), causal=True)
    t = mhattn.trace(**p, **kw)
    assert t.norm_type == "layer" and "q_normed" in t.variant_stages
    for h in range(H):
        np.testing.assert_array_equal(t.q_normed[h], R.layer_norm(t.q_proj[h], kw["q_norm"][h],
                                                                  1e-6))
        np.testing.assert_array_equal(t.k_normed[h], R.layer_norm(t.k_proj[h], kw["k_norm"],
                                                                  1e-6))
        np.testing.assert_allclose((t.q_normed[h] / kw["q_norm"][h]).mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose(t.output, mhattn.multi_head_attention(**p, **kw), rtol=1e-12,
                               atol=1e-12)
    html = t._repr_html_()
    assert "LayerNorm(q_proj)" in html and "RMSNorm" not in html
    assert "RMSNorm(q_proj)" in mhattn.trace(**p, **dict(kw, norm_type="rms"))._repr_html_()


# --- the layer --------------------------------------------------------------------

@pytest.mark.parametrize("qk_norm", [True, "per_head"])
def test_layer_owns_a_layer_norm(rng, qk_norm):
    layer = mhattn.MultiHeadAttention(16, 4, num_kv_heads=2, qk_norm=qk_norm,
                                      norm_type="layer", bias=True, dtype=np.float64, seed=3)
    layer.q_norm[...] = rng.random(layer.q_norm.shape) + 0.5
    layer.k_norm[...] = rng.random(layer.k_norm.shape) + 0.5
    layer.b_q[...] = rng.standard_normal(layer.b_q.shape) + 2.0   # a mean to remove
    x = rng.standard_normal((2, 6, 16))
    out = layer(x, causal=True, rope=mhattn.RoPE())
    args = layer.arguments()
    assert args["norm_type"] == "layer"
    ref = R.multi_head_attention(x, **args, causal=True, rope=mhattn.RoPE())
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    rms = R.multi_head_attention(x, **dict(args, norm_type="rms"), causal=True,
                                 rope=mhattn.RoPE())
    assert np.abs(rms - ref).max() > 1e-6
    assert "norm_type='layer'" in repr(layer)
    # state_dict round trip: same configuration, other weights, then loaded
    other = mhattn.MultiHeadAttention(16, 4, num_kv_heads=2, qk_norm=qk_norm,
                                      norm_type="layer", bias=True, dtype=np.float64, seed=4)
    other.load_state_dict(layer.state_dict())
    assert other(x, causal=True, rope=mhattn.RoPE()).tobytes() == out.tobytes()
    # astype keeps the norm
    half = layer.astype(np.float32)
    assert half.norm_type == "layer"
    np.testing.assert_allclose(half(x.astype(np.float32), causal=True, rope=mhattn.RoPE()),
                               out, rtol=1e-4, atol=1e-4 * float(np.abs(out).max()))
    # the layer's backward: the norms' gradients as multi_head_attention_grad's
    o, ctx = layer(x, causal=True, return_context=True)
    R_out = rng.standard_normal(o.shape)
    g = layer.backward(R_out, ctx)
    want = mhattn.multi_head_attention_grad(R_out, x, **args, causal=True)
    for k in ("q_norm", "k_norm", "w_q", "x"):
        np.testing.assert_array_equal(g[k], want[k], err_msg=k)
    # the layer's norm is its own: not a call option
    with pytest.raises(TypeError, match="norm_type"):
        layer(x, norm_type="rms")


def test_layer_default_is_rms(rng):
    a = mhattn.MultiHeadAttention(16, 2, qk_norm=True, seed=0)
    b = mhattn.MultiHeadAttention(16, 2, qk_norm=True, norm_type="rms", seed=0)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    assert a.norm_type == "rms" and a(x).tobytes() == b(x).tobytes()
    assert "norm_type" not in repr(a)


# --- with the output gate ---------------------------------------------------------

def _gate(rng, dtype, dk, h=H):
    """w_gate (d_in, h*d_k), b_gate (h*d_k,): the output gate (d_v = d_k here)."""
    return dict(w_gate=(rng.standard_normal((D_IN, h * dk)) * 0.5).astype(dtype),
                b_gate=(rng.standard_normal(h * dk) * 0.3).astype(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layer_norm_with_the_output_gate(rng, dtype):
    """Both of issue 38's items 4 and 5 in one call: the q/k LayerNorm
    before the scores, the gate sigmoid(x w_gate + b_gate) after the heads."""
    p = _problem(rng, dtype, "per_head_gqa_odd_dk", offset=1.5)
    p.update(_gate(rng, dtype, 7))
    out = mhattn.multi_head_attention(**p, norm_type="layer", causal=True)
    ref = R.multi_head_attention(**_as64(p), norm_type="layer", causal=True)
    tol = 1e-12 if dtype == np.float64 else 2e-5
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * float(np.abs(ref).max()))
    # each feature matters: with RMSNorm, or without the gate, another result
    p64 = _as64(p)
    for alt in (R.multi_head_attention(**p64, norm_type="rms", causal=True),
                R.multi_head_attention(**dict(p64, w_gate=None, b_gate=None),
                                       norm_type="layer", causal=True)):
        assert np.abs(alt - ref).max() > 1e3 * tol * float(np.abs(ref).max())
    if dtype == np.float32:
        return
    R_out = rng.standard_normal(out.shape)
    g = mhattn.multi_head_attention_grad(R_out, **p, norm_type="layer", causal=True)
    scale = max(float(np.abs(v).max()) for v in g.values())
    for arg in ("q_norm", "k_norm", "w_gate", "b_gate", "x", "w_q"):
        assert g[arg].shape == np.shape(p[arg]), arg
        flat = list(np.ndindex(g[arg].shape))
        for i in rng.choice(len(flat), min(4, len(flat)), replace=False):
            idx = flat[i]
            fd = _fd_reference(dict(p, causal=True), R_out, arg, idx)
            assert abs(g[arg][idx] - fd) <= 1e-6 * scale + 1e-8, (arg, idx, g[arg][idx], fd)


def test_layer_with_a_layer_norm_and_a_gate(rng):
    layer = mhattn.MultiHeadAttention(16, 4, num_kv_heads=2, qk_norm="per_head",
                                      norm_type="layer", gate=True, bias=True,
                                      dtype=np.float64, seed=5)
    layer.q_norm[...] = rng.random(layer.q_norm.shape) + 0.5
    layer.b_q[...] = rng.standard_normal(layer.b_q.shape) + 2.0   # a mean to remove
    layer.b_gate[...] = rng.standard_normal(layer.b_gate.shape)
    x = rng.standard_normal((2, 6, 16))
    out = layer(x, causal=True)
    args = layer.arguments()
    assert args["norm_type"] == "layer" and args["w_gate"] is layer.w_gate
    np.testing.assert_allclose(out, R.multi_head_attention(x, **args, causal=True),
                               rtol=1e-12, atol=1e-12)
    assert "norm_type='layer'" in repr(layer) and "gate=True" in repr(layer)
    other = mhattn.MultiHeadAttention(16, 4, num_kv_heads=2, qk_norm="per_head",
                                      norm_type="layer", gate=True, bias=True,
                                      dtype=np.float64, seed=6)
    other.load_state_dict(layer.state_dict())
    assert other(x, causal=True).tobytes() == out.tobytes()
    single = layer.astype(np.float32)
    assert single.norm_type == "layer" and single.has_gate
    o, ctx = layer(x, causal=True, return_context=True)
    R_out = rng.standard_normal(o.shape)
    g = layer.backward(R_out, ctx)
    want = mhattn.multi_head_attention_grad(R_out, x, **args, causal=True)
    for k in ("q_norm", "k_norm", "w_gate", "b_gate", "x"):
        np.testing.assert_array_equal(g[k], want[k], err_msg=k)
    # the trace: the LayerNorm stages and the gate's
    t = mhattn.trace(x[0], **args, causal=True)
    assert t.norm_type == "layer" and {"q_normed", "gate", "gated"} <= set(t.variant_stages)
    np.testing.assert_allclose(t.output, out[0], rtol=1e-12, atol=1e-12)


# --- Flax NNX -------------------------------------------------------------------

def _flax_layer(H_, G_, dk, d_in, d_out, seed):
    """A small random nnx.MultiHeadAttention(normalize_qk=True) and mhattn's
    keywords for the same layer."""
    nnx = pytest.importorskip("flax.nnx")
    jnp = pytest.importorskip("jax.numpy")
    m = nnx.MultiHeadAttention(num_heads=H_, in_features=d_in, qkv_features=H_ * dk,
                               out_features=d_out, num_kv_heads=G_, normalize_qk=True,
                               decode=False, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    # Flax's LayerNorms: scale only (use_bias=False), epsilon 1e-6.
    assert m.query_ln.bias is None and m.key_ln.bias is None
    assert m.query_ln.epsilon == 1e-6 and m.key_ln.epsilon == 1e-6
    for lin in (m.query, m.key, m.value, m.out):   # the defaults: biases 0
        lin.kernel[...] = jnp.asarray(rng.standard_normal(lin.kernel[...].shape) * 0.5,
                                      jnp.float32)
        lin.bias[...] = jnp.asarray(rng.standard_normal(lin.bias[...].shape) * 0.5 + 1.0,
                                    jnp.float32)
    for ln in (m.query_ln, m.key_ln):              # the default: scale 1
        ln.scale[...] = jnp.asarray(rng.random(dk) + 0.5, jnp.float32)
    f = lambda v: np.asarray(v[...])               # noqa: E731
    # Kernels: query/key/value (in, heads, head_dim), out (heads, head_dim,
    # out); head i owns fused columns [i*dk, (i+1)*dk), as in mhattn.
    assert f(m.query.kernel).shape == (d_in, H_, dk) and f(m.out.kernel).shape == (H_, dk, d_out)
    kw = dict(w_q=f(m.query.kernel).reshape(d_in, H_ * dk),
              w_k=f(m.key.kernel).reshape(d_in, G_ * dk),
              w_v=f(m.value.kernel).reshape(d_in, G_ * dk),
              w_o=f(m.out.kernel).reshape(H_ * dk, d_out),
              b_q=f(m.query.bias).reshape(-1), b_k=f(m.key.bias).reshape(-1),
              b_v=f(m.value.bias).reshape(-1), b_o=f(m.out.bias),
              q_norm=f(m.query_ln.scale), k_norm=f(m.key_ln.scale),
              num_heads=H_, num_kv_heads=G_, norm_type="layer", norm_eps=1e-6)
    return m, kw


@pytest.mark.parametrize("H_, G_, dk, causal", [
    (4, 2, 5, True),
    # each shape compiles Flax's call anew (seconds): the other two in CI
    pytest.param(4, 4, 8, False, marks=pytest.mark.slow),
    pytest.param(6, 1, 7, False, marks=pytest.mark.slow)])
def test_matches_flax_nnx_normalize_qk(H_, G_, dk, causal):
    nnx = pytest.importorskip("flax.nnx")
    jnp = pytest.importorskip("jax.numpy")
    d_in, d_out, T = 12, 9, 7
    m, kw = _flax_layer(H_, G_, dk, d_in, d_out, seed=H_ * 10 + G_)
    x = np.random.default_rng(dk).standard_normal((2, T, d_in)).astype(np.float32)
    mask = nnx.make_causal_mask(jnp.ones((2, T))) if causal else None
    theirs = np.asarray(m(jnp.asarray(x), mask=mask))
    ours = mhattn.multi_head_attention(x, **kw, causal=causal)
    oracle = R.multi_head_attention(x.astype(np.float64), **_as64(kw), causal=causal)
    # Both compute in float32 from the same float32 weights: each is a few
    # float32 roundings (2**-24 ~ 6e-8 relative) of O(1) values through
    # sums of <= 12 (projections), d_k (scores), T (weights . V) and h*d_k
    # (W^O) terms, and Flax's LayerNorm uses the one-pass variance
    # E[x^2] - E[x]^2, which loses up to E[x^2] / var(x) (<= ~10 here,
    # with biases of mean 1) more. 2e-5 of the output's largest magnitude
    # is ~300 ulps: far above both errors, far below what a wrong norm
    # (RMSNorm, a missing weight, eps outside the root) changes.
    scale = float(np.abs(oracle).max())
    np.testing.assert_allclose(theirs, oracle, rtol=0, atol=2e-5 * scale)
    np.testing.assert_allclose(ours, oracle, rtol=0, atol=2e-5 * scale)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-5 * scale)
    wrong = R.multi_head_attention(x.astype(np.float64), **_as64(dict(kw, norm_type="rms")),
                                   causal=causal)
    assert np.abs(wrong - theirs).max() > 100 * 2e-5 * scale


# --- refusals -------------------------------------------------------------------

def _entry_points(rng):
    dk = 4
    p = _weights(rng, np.float64, dk)
    x = rng.standard_normal((B, 5, D_IN))
    qn = np.ones(dk)
    q = rng.standard_normal((B, H, 5, dk))
    k = rng.standard_normal((B, G, 5, dk))
    return {
        "multi_head_attention": lambda **kw: mhattn.multi_head_attention(x, **p, **kw),
        "multi_head_attention_grad": lambda **kw: mhattn.multi_head_attention_grad(
            np.ones((B, 5, D_IN)), x, **p, **kw),
        "trace": lambda **kw: mhattn.trace(x, **p, **kw),
        "reference": lambda **kw: R.multi_head_attention(x, **p, **kw),
        "decode": lambda **kw: mhattn.multi_head_attention(
            x[:, :1], **p, cache=mhattn.KVCache(B, G, 8, dk, dtype=np.float64), **kw),
        "layer": lambda **kw: mhattn.MultiHeadAttention(
            D_IN, H, num_kv_heads=G, d_k=dk, dtype=np.float64,
            **({"qk_norm": True} if kw.pop("q_norm", None) is not None else {}), **kw),
    }, qn, (q, k)


@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("bad", ["batch", "LAYER", "layer ", "rms\x00", ""])
def test_unknown_norm_type_is_refused_everywhere(rng, bad, with_norm):
    """One message from every entry point, the core's (it carries the field
    norm_type), naming the argument, what it saw and the accepted names;
    checked whether or not a norm weight would use it."""
    entries, qn, _ = _entry_points(rng)
    messages = {}
    for name, fn in entries.items():
        kw = dict(norm_type=bad)
        if with_norm:
            kw["q_norm"] = qn
        with pytest.raises(ValueError) as info:
            fn(**kw)
        assert info.value.field == "norm_type", name
        messages[name] = str(info.value)
    first = next(iter(messages.values()))
    assert all(m == first for m in messages.values()), messages
    seen = bad.replace("\x00", "?")
    assert first == f'norm_type: norm_type = "{seen}" is not one of "rms", "layer"'


def test_norm_type_of_another_type_is_a_type_error(rng):
    entries, qn, _ = _entry_points(rng)
    for name, fn in entries.items():
        for bad in (1, None, b"layer", ["layer"]):
            with pytest.raises(TypeError, match="norm_type"):
                fn(norm_type=bad, q_norm=qn)


def test_a_refused_step_leaves_the_cache_alone(rng):
    dk = 4
    p = _weights(rng, np.float64, dk)
    x = rng.standard_normal((B, 3, D_IN))
    cache = mhattn.KVCache(B, G, 8, dk, dtype=np.float64)
    mhattn.multi_head_attention(x[:, :2], **p, cache=cache, q_norm=np.ones(dk),
                                norm_type="layer")
    keys = cache.key_storage.copy()
    with pytest.raises(ValueError, match="norm_type"):
        mhattn.multi_head_attention(x[:, 2:], **p, cache=cache, q_norm=np.ones(dk),
                                    norm_type="batch")
    assert list(cache.lengths) == [2, 2]
    assert cache.key_storage.tobytes() == keys.tobytes()


def test_attention_takes_no_q_k_transform(rng):
    """attention / attention_grad take projected q, k: the q/k norm, and so
    its norm_type, is not theirs (as q_norm is not)."""
    _, _, (q, k) = _entry_points(rng)
    for kw in (dict(norm_type="layer"), dict(q_norm=np.ones(4))):
        with pytest.raises(TypeError, match=next(iter(kw))):
            mhattn.attention(q, k, k, **kw)
        with pytest.raises(TypeError, match=next(iter(kw))):
            mhattn.attention_grad(np.ones_like(q), q, k, k, **kw)


def test_inputs_are_not_modified(rng):
    p = _problem(rng, np.float32, "per_head_gqa_odd_dk")
    before = {k: v.copy() for k, v in p.items() if isinstance(v, np.ndarray)}
    out = mhattn.multi_head_attention(**p, norm_type="layer")
    mhattn.multi_head_attention_grad(np.ones_like(out), **p, norm_type="layer")
    for k, v in before.items():
        assert p[k].tobytes() == v.tobytes(), k
