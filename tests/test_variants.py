"""The variants of today's models (issue 13) in the C core, against the
NumPy reference: every keyword alone and combined, float32 and float64, on
every ISA path and thread count; gradients by central differences; packed
sequences against separate calls; errors that name the argument.
Tile skipping is measured by benchmarks/bench.py (the window rows) and
tested in tests/c/test_variants.c."""
import numpy as np
import pytest

import mhattn
from conftest import tol
from test_grad import FD_EPS, FD_RTOL

B, H, G, TQ, TK, D_IN, DK = 2, 4, 2, 37, 45, 12, 8


def _params(rng, dtype, *, Tq=TQ, Tk=TK, cross=True):
    x = rng.standard_normal((B, Tq, D_IN)).astype(dtype)
    p = dict(x=x, w_q=rng.standard_normal((D_IN, H * DK)).astype(dtype) * 0.5,
             w_k=rng.standard_normal((D_IN, G * DK)).astype(dtype) * 0.5,
             w_v=rng.standard_normal((D_IN, G * DK)).astype(dtype),
             w_o=rng.standard_normal((H * DK, D_IN)).astype(dtype),
             num_heads=H, num_kv_heads=G)
    if cross:
        p["key"] = rng.standard_normal((B, Tk, D_IN)).astype(dtype)
    return p


def _key_mask(rng, Tk=TK):
    m = rng.random((B, Tk)) < 0.7
    m[0, :5] = False            # left padding
    m[1, -7:] = False           # right padding
    return m


# Each variant: a function of (rng, Tq, Tk) giving its keywords.
VARIANTS = {
    "window_causal": lambda r, Tq, Tk: dict(causal=True, window=(5, 0)),
    "window_both_sides": lambda r, Tq, Tk: dict(window=(3, 6)),
    "window_left_unbounded": lambda r, Tq, Tk: dict(window=(None, 2)),
    "window_right_unbounded": lambda r, Tq, Tk: dict(window=(4, None)),
    "softcap": lambda r, Tq, Tk: dict(softcap=1.5),
    "alibi_per_head": lambda r, Tq, Tk: dict(alibi_slopes=r.random(H)),
    "alibi_per_batch": lambda r, Tq, Tk: dict(alibi_slopes=r.random((B, H)), causal=True),
    "sinks": lambda r, Tq, Tk: dict(sinks=r.standard_normal(H) * 2),
    "q_norm_shared": lambda r, Tq, Tk: dict(q_norm=r.random(DK) + 0.5),
    "qk_norm_per_head": lambda r, Tq, Tk: dict(q_norm=r.random((H, DK)) + 0.5,
                                               k_norm=r.random((G, DK)) + 0.5,
                                               norm_eps=1e-3),
    "rope": lambda r, Tq, Tk: dict(rope=mhattn.RoPE()),
    "rope_partial_interleaved": lambda r, Tq, Tk: dict(
        rope=mhattn.RoPE(theta=100.0, rotary_dim=DK // 2, interleaved=True)),
    "rope_inv_freq_positions": lambda r, Tq, Tk: dict(
        rope=mhattn.RoPE(inv_freq=r.random(DK // 2)),
        positions=r.integers(-3, 200, (B, Tq)), key_positions=r.integers(0, 200, Tk)),
    "key_mask": lambda r, Tq, Tk: dict(key_mask=_key_mask(r, Tk)),
    "combined": lambda r, Tq, Tk: dict(
        causal=True, window=(9, 0), softcap=3.0, alibi_slopes=r.random(H) * 0.1,
        sinks=r.standard_normal(H), q_norm=r.random(DK) + 0.5, k_norm=r.random(DK) + 0.5,
        rope=mhattn.RoPE(), key_mask=_key_mask(r, Tk), key_lengths=np.array([Tk, Tk - 4]),
        mask=r.random((Tq, Tk)) < 0.9),
    "combined_additive_mask": lambda r, Tq, Tk: dict(
        window=(6, 6), softcap=2.0, sinks=r.standard_normal(H),
        mask=np.where(r.random((H, Tq, Tk)) < 0.1, -np.inf, r.standard_normal((H, Tq, Tk)))),
}

# Variants with a learnable array, and the gradient's name.
LEARNABLE = ("sinks", "q_norm", "k_norm")


def _check_close(got, want, dtype, scale=1.0):
    t = tol(dtype)
    np.testing.assert_allclose(got, want, rtol=t["rtol"] * 10, atol=t["atol"] * 10 * scale)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_matches_reference(rng, isa, dtype, name):
    p = _params(rng, dtype)
    kw = VARIANTS[name](rng, TQ, TK)
    for k in LEARNABLE:   # parameters, like biases, take part in the dtype
        if k in kw:
            kw[k] = kw[k].astype(dtype)
    out, w = mhattn.multi_head_attention(**p, **kw, return_weights=True)
    ref, ref_w = mhattn.reference.multi_head_attention(**p, **kw, return_weights=True)
    assert out.dtype == dtype and np.isfinite(out).all()
    _check_close(w, ref_w, dtype)
    _check_close(out, ref, dtype, scale=float(np.abs(ref).max()))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_self_attention_unbatched(rng, name):
    """Self-attention (key is x) of one unbatched sequence, T_q == T_k."""
    p = _params(rng, np.float64, Tk=TQ, cross=False)
    p["x"] = p["x"][0]
    kw = VARIANTS[name](rng, TQ, TQ)
    for k in ("alibi_slopes", "positions"):
        if k in kw and np.ndim(kw[k]) == 2:
            kw[k] = kw[k][0]
    if "key_mask" in kw:
        kw["key_mask"] = kw["key_mask"][0, :TQ]
    if "key_lengths" in kw:
        kw["key_lengths"] = TQ - 3
    if "key_positions" in kw:
        kw["key_positions"] = kw["key_positions"][:TQ]
    if "mask" in kw:
        kw["mask"] = kw["mask"][..., :TQ, :TQ]
    out = mhattn.multi_head_attention(**p, **kw)
    ref = mhattn.reference.multi_head_attention(**p, **kw)
    _check_close(out, ref, np.float64, scale=float(np.abs(ref).max()))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_bits_do_not_depend_on_threads(rng, name):
    p = _params(rng, np.float32, Tq=130, Tk=150)
    kw = VARIANTS[name](rng, 130, 150)
    R = rng.standard_normal((B, 130, D_IN)).astype(np.float32)
    before = mhattn.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            mhattn.set_num_threads(n)
            out, w = mhattn.multi_head_attention(**p, **kw, return_weights=True)
            runs.append((out, w, mhattn.multi_head_attention_grad(R, **p, **kw)))
    finally:
        mhattn.set_num_threads(before)
    for out, w, g in runs[1:]:
        assert out.tobytes() == runs[0][0].tobytes()
        assert w.tobytes() == runs[0][1].tobytes()
        for k in g:
            assert g[k].tobytes() == runs[0][2][k].tobytes(), k


def _fd(p, kw, R, name, idx):
    def loss(params, extra):
        return float(np.sum(mhattn.multi_head_attention(**params, **extra) * R))
    pp, kp = dict(p), dict(kw)
    holder = pp if name in pp else kp
    a = np.array(holder[name], dtype=np.float64)
    vals = []
    for sign in (1, -1):
        b = a.copy()
        b[idx] += sign * FD_EPS
        holder[name] = b
        vals.append(loss(pp, kp))
    return (vals[0] - vals[1]) / (2 * FD_EPS)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_gradients_by_finite_differences(rng, name):
    Tq, Tk = 9, 11
    p = _params(rng, np.float64, Tq=Tq, Tk=Tk)
    kw = VARIANTS[name](rng, Tq, Tk)
    R = rng.standard_normal((B, Tq, D_IN))
    g = mhattn.multi_head_attention_grad(R, **p, **kw)
    scale = max(float(np.abs(v).max()) for v in g.values())
    checked = 0
    for arg in ("x", "key", "w_q", "w_k", "w_v", "w_o") + LEARNABLE:
        if arg not in g:
            continue
        assert g[arg].shape == np.shape(p.get(arg, kw.get(arg)))
        flat = list(np.ndindex(g[arg].shape))
        for idx in [flat[i] for i in rng.choice(len(flat), min(6, len(flat)), replace=False)]:
            fd = _fd(p, kw, R, arg, idx)
            assert abs(g[arg][idx] - fd) <= FD_RTOL * scale * 10 + 1e-9, (arg, idx)
            checked += 1
    assert checked >= 36
    for arg in LEARNABLE:
        assert (arg in g) == (arg in kw)


def test_window_equals_its_dense_mask(rng):
    """A window is the band mask it stands for, gradients included."""
    p = _params(rng, np.float64)
    i = np.arange(TQ)[:, None] + (TK - TQ)
    j = np.arange(TK)[None, :]
    band = (j >= i - 4) & (j <= i + 2)
    R = rng.standard_normal((B, TQ, D_IN))
    a = mhattn.multi_head_attention_grad(R, **p, window=(4, 2))
    b = mhattn.multi_head_attention_grad(R, **p, mask=band)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-11, atol=1e-11)


def test_key_mask_equals_its_dense_mask(rng):
    p = _params(rng, np.float64)
    km = _key_mask(rng)
    a = mhattn.multi_head_attention(**p, key_mask=km)
    b = mhattn.multi_head_attention(**p, mask=km[:, None, None, :])
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_fully_masked_rows_are_zero_never_nan(rng):
    """A window that leaves rows empty, a key_mask of all False, and sinks:
    weights 0, head outputs 0 (out = b_o), no NaN, gradients finite."""
    p = _params(rng, np.float64, Tq=6, Tk=8)
    p["b_o"] = rng.standard_normal(D_IN)
    km = np.ones((B, 8), bool)
    km[1] = False
    for kw in (dict(key_mask=km), dict(key_mask=km, sinks=rng.standard_normal(H)),
               dict(window=(0, 0), key_lengths=np.array([8, 1]))):
        out, w = mhattn.multi_head_attention(**p, **kw, return_weights=True)
        assert np.isfinite(out).all() and np.isfinite(w).all()
        if "key_mask" in kw:
            np.testing.assert_array_equal(w[1], 0)
            np.testing.assert_allclose(out[1], np.broadcast_to(p["b_o"], out[1].shape))
        else:   # window (0, 0) with one key: rows past it see nothing
            np.testing.assert_array_equal(w[1, :, 3:], 0)
        g = mhattn.multi_head_attention_grad(np.ones_like(out), **p, **kw)
        assert all(np.isfinite(v).all() for v in g.values())


def test_sinks_lower_the_row_sums(rng):
    p = _params(rng, np.float64)
    s = rng.standard_normal(H)
    _, w = mhattn.multi_head_attention(**p, sinks=s, return_weights=True)
    _, w0 = mhattn.multi_head_attention(**p, return_weights=True)
    rows = w.sum(-1)
    assert (rows < 1).all() and (rows > 0).all()
    # weights = w0 * (1 - p_sink), the same factor across a row
    np.testing.assert_allclose(w / rows[..., None], w0, rtol=1e-10, atol=1e-14)


# --- packed sequences --------------------------------------------------------

def _packed(rng, lens, klens=None, dtype=np.float64):
    total = sum(lens)
    p = _params(rng, dtype, cross=False)
    p["x"] = rng.standard_normal((total, D_IN)).astype(dtype)
    cu = np.concatenate([[0], np.cumsum(lens)])
    if klens is None:
        return p, cu, None
    p["key"] = rng.standard_normal((sum(klens), D_IN)).astype(dtype)
    return p, cu, np.concatenate([[0], np.cumsum(klens)])


PACKED_KW = [dict(), dict(causal=True), dict(causal=True, window=(3, 0)),
             dict(causal=True, rope=mhattn.RoPE(), sinks=np.linspace(-1, 1, H)),
             dict(alibi_slopes=np.linspace(0.1, 0.5, H), softcap=2.0)]


@pytest.mark.parametrize("kw", PACKED_KW, ids=lambda kw: "+".join(kw) or "plain")
@pytest.mark.parametrize("cross", [False, True])
def test_packed_equals_separate_calls(rng, isa, kw, cross):
    lens = [5, 0, 17, 64, 1, 33]
    klens = [7, 3, 17, 50, 1, 40] if cross else None
    p, cu, kcu = _packed(rng, lens, klens)
    extra = dict(key_cu_seqlens=kcu) if cross else {}
    out, w = mhattn.multi_head_attention(**p, **kw, cu_seqlens=cu, return_weights=True,
                                         **extra)
    kc = kcu if cross else cu
    R = rng.standard_normal(out.shape)
    g = mhattn.multi_head_attention_grad(R, **p, **kw, cu_seqlens=cu, **extra)
    for s in range(len(lens)):
        q0, q1, k0, k1 = cu[s], cu[s + 1], kc[s], kc[s + 1]
        ps = dict(p, x=p["x"][q0:q1])
        if cross:
            ps["key"] = p["key"][k0:k1]
        if q1 == q0:
            continue
        o_s, w_s = mhattn.multi_head_attention(**ps, **kw, return_weights=True)
        np.testing.assert_allclose(out[q0:q1], o_s, rtol=1e-11, atol=1e-11)
        np.testing.assert_allclose(w[:, q0:q1, k0:k1], w_s, rtol=1e-11, atol=1e-12)
        assert not w[:, q0:q1, :k0].any() and not w[:, q0:q1, k1:].any()
        g_s = mhattn.multi_head_attention_grad(R[q0:q1], **ps, **kw)
        np.testing.assert_allclose(g["x"][q0:q1], g_s["x"], rtol=1e-9, atol=1e-10)
        if cross:
            np.testing.assert_allclose(g["key"][k0:k1], g_s["key"], rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences_do_not_leak(rng, causal):
    """Perturbing one sequence leaves every other sequence's bits as they were."""
    lens = [70, 3, 129, 64]
    p, cu, _ = _packed(rng, lens, dtype=np.float32)
    kw = dict(cu_seqlens=cu, causal=causal, rope=mhattn.RoPE())
    out, w = mhattn.multi_head_attention(**p, **kw, return_weights=True)
    x2 = p["x"].copy()
    x2[cu[2]:cu[3]] += 1.0
    out2, w2 = mhattn.multi_head_attention(**dict(p, x=x2), **kw, return_weights=True)
    other = np.ones(len(p["x"]), bool)
    other[cu[2]:cu[3]] = False
    assert out[other].tobytes() == out2[other].tobytes()
    assert w[:, other].tobytes() == w2[:, other].tobytes()
    assert not np.array_equal(out[~other], out2[~other])


# --- errors -----------------------------------------------------------------

BAD = [
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(window=(-1, 0)), ValueError, "window"),
    (dict(window=(0, -2)), ValueError, "window"),
    (dict(window=5), TypeError, "window"),
    (dict(window=np.array(np.nan)), TypeError, "window"),   # found by the fuzzer
    (dict(window=(1, 2, 3)), ValueError, "window"),
    (dict(alibi_slopes=np.ones(H + 1)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=np.ones((B + 1, H))), ValueError, "alibi_slopes"),
    (dict(sinks=np.ones(H - 1)), ValueError, "sinks"),
    (dict(q_norm=np.ones(DK + 1)), ValueError, "q_norm"),
    (dict(k_norm=np.ones((H, DK))), ValueError, "k_norm"),
    (dict(rope=mhattn.RoPE(rotary_dim=DK + 2)), ValueError, "rotary_dim"),
    (dict(rope=mhattn.RoPE(), positions=np.arange(TQ + 1)), ValueError, "positions"),
    (dict(rope=mhattn.RoPE(), key_positions=np.arange(TQ)), ValueError, "key_positions"),
    (dict(positions=np.arange(TQ)), ValueError, "positions"),
    (dict(key_mask=np.ones(TK + 1, bool)), ValueError, "key_mask"),
    (dict(key_mask=np.ones((B, TK))), TypeError, "key_mask"),
    (dict(cu_seqlens=[0, TQ]), ValueError, "cu_seqlens"),
]


@pytest.mark.parametrize("kw,exc,word", BAD, ids=lambda v: str(v)[:40])
def test_bad_variant_raises_naming_the_argument(rng, kw, exc, word):
    p = _params(rng, np.float64)
    for f in (mhattn.multi_head_attention, mhattn.reference.multi_head_attention):
        with pytest.raises(exc, match=word):
            f(**p, **kw)


def test_softcap_zero_is_off(rng):
    """0 turns softcapping off, as FlashAttention's softcap=0.0 does: the
    same bits as None, in the C path and the reference."""
    p = _params(rng, np.float64)
    for f in (mhattn.multi_head_attention, mhattn.reference.multi_head_attention):
        assert f(**p, softcap=0.0).tobytes() == f(**p, softcap=None).tobytes()
        assert f(**p, softcap=0.5).tobytes() != f(**p).tobytes()


# The offsets' rules are the core's (mha_check_config), in the user's names.
@pytest.mark.parametrize("cu,word", [([1, 10], r"^cu_seqlens: cu_seqlens\[0\] = 1 is not 0$"),
                                     ([0, 6, 4, 10], r"^cu_seqlens: cu_seqlens decreases"),
                                     ([0, 4, 9], r"is not T_q = 10$"), ([[0, 10]], "1-D")])
def test_bad_cu_seqlens(rng, cu, word):
    x = rng.standard_normal((10, D_IN))
    w = rng.standard_normal((D_IN, H * DK))
    with pytest.raises(ValueError, match=word):
        mhattn.multi_head_attention(x, w, w, w, num_heads=H, cu_seqlens=np.array(cu))


def test_inputs_are_never_modified(rng):
    p = _params(rng, np.float64)
    kw = VARIANTS["combined"](rng, TQ, TK)
    before = {k: np.copy(v) for k, v in {**p, **kw}.items() if isinstance(v, np.ndarray)}
    mhattn.multi_head_attention_grad(np.ones((B, TQ, D_IN)), **p, **kw)
    for k, v in before.items():
        now = p.get(k, kw.get(k))
        np.testing.assert_array_equal(now, v, err_msg=k)


# --- the trace ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["combined", "combined_additive_mask", "qk_norm_per_head",
                                  "rope_inv_freq_positions", "alibi_per_batch", "softcap"])
def test_trace_holds_every_step_of_the_variants(rng, name):
    """The trace's stages are the reference's steps, the variants' included
    (q_proj, q_normed, q after RoPE, capped, bias, scores, lse with sinks),
    and its output and weights are the core's."""
    p = _params(rng, np.float64)
    kw = VARIANTS[name](rng, TQ, TK)
    t = mhattn.trace(**p, **kw)
    out, w = mhattn.multi_head_attention(**p, **kw, return_weights=True)
    assert t.output.tobytes() == out.tobytes() and t.weights.tobytes() == w.tobytes()
    call = mhattn._internal.args.normalize(**p, **kw)
    want = {"q_proj", "k_proj"} if call.var.transforms else set()
    if "q_norm" in kw or "k_norm" in kw:
        want |= {"q_normed", "k_normed"}
    if "softcap" in kw:
        want.add("capped")
    if "alibi_slopes" in kw:
        want.add("bias")
    assert set(t.variant_stages) == want
    for b in range(B):
        for h in range(H):
            st = mhattn.reference.head_intermediates(call, b, h)
            for stage in ("q", "k", "raw_scores", "scores", "lse") + tuple(want):
                mine = getattr(t, stage)[b, h]   # k stages are per query head
                np.testing.assert_allclose(mine, st[stage], rtol=1e-10, atol=1e-10,
                                           err_msg=f"{stage} b={b} h={h}")
    if "sinks" in kw:
        np.testing.assert_array_equal(t.sinks, kw["sinks"])


# --- the layer owns the learnable variants ------------------------------------

@pytest.mark.parametrize("qk_norm", [True, "per_head"])
def test_layer_owns_sinks_and_norms(rng, qk_norm):
    layer = mhattn.MultiHeadAttention(32, 4, num_kv_heads=2, sinks=True, qk_norm=qk_norm,
                                      dtype=np.float64, seed=3)
    layer.sinks = rng.standard_normal(4)
    layer.q_norm = rng.random(layer.q_norm.shape) + 0.5
    layer.k_norm = rng.random(layer.k_norm.shape) + 0.5
    x = rng.standard_normal((2, 11, 32))
    opts = dict(causal=True, window=(4, 0), rope=mhattn.RoPE(), softcap=4.0)
    out, ctx = layer(x, return_context=True, **opts)
    want = mhattn.reference.multi_head_attention(x, **layer.arguments(), **opts)
    np.testing.assert_allclose(out, want, rtol=1e-11, atol=1e-11)
    # state_dict carries the three, and a fresh layer loaded from it agrees
    sd = layer.state_dict()
    assert {"sinks", "q_norm.weight", "k_norm.weight"} <= set(sd)
    other = mhattn.MultiHeadAttention(32, 4, num_kv_heads=2, sinks=True, qk_norm=qk_norm,
                                      dtype=np.float64, seed=9)
    other.load_state_dict(sd)
    assert other(x, **opts).tobytes() == out.tobytes()
    sd["sinks"][0] += 1.0   # the layer shares no memory with its state dict
    assert other(x, **opts).tobytes() == out.tobytes()
    # gradients come back under the attributes' names and shapes
    R = rng.standard_normal(out.shape)
    g = layer.backward(R, ctx)
    g2 = mhattn.multi_head_attention_grad(R, x, **layer.arguments(), **opts)
    for name in ("sinks", "q_norm", "k_norm"):
        assert g[name].shape == getattr(layer, name).shape
        assert g[name].tobytes() == g2[name].tobytes()
    with pytest.raises(TypeError, match="sinks"):
        layer(x, sinks=np.zeros(4))
    with pytest.raises(ValueError, match="to_torch"):
        layer.to_torch()


def test_layer_without_variants_is_unchanged(rng):
    layer = mhattn.MultiHeadAttention(16, 2, seed=0)
    assert layer.sinks is None and layer.q_norm is None and layer.k_norm is None
    assert set(layer.state_dict()) == {"in_proj_weight", "out_proj.weight"}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cap", [1e-3, 0.3, 30.0, 2.0 ** 70])
def test_softcap_keeps_relative_accuracy(rng, isa, dtype, cap):
    """c tanh(s / c) for any c: a huge cap is the identity (the fuzzer found
    the exp formula's 1 - exp(-2|x|) losing every digit of small x), a tiny
    one flattens the scores; the core's tanh matches NumPy's on both sides
    of its switch from the series to the exp formula (|x| = 1/4)."""
    p = _params(rng, dtype)
    out = mhattn.multi_head_attention(**p, softcap=cap)
    ref = mhattn.reference.multi_head_attention(**p, softcap=cap)
    _check_close(out, ref, dtype, scale=float(np.abs(ref).max()))
    if cap > 1e6:
        plain = mhattn.multi_head_attention(**p)
        _check_close(out, plain, dtype, scale=float(np.abs(plain).max()))
