"""mhattn.attention, attention_grad and merge_attention (issue 17).

attention on projected tensors must equal multi_head_attention with the
projections done outside (fused weights, heads split), on every option and
ISA, and mhattn.reference.projected_attention; its gradients are checked by
finite differences and against torch SDPA autograd; merge_attention over
any split of the keys equals the unsplit call.
"""
import numpy as np
import pytest

import mhattn
from mhattn import reference as R

B, H, TQ, TK, DK, DV, DIN = 2, 4, 5, 7, 8, 6, 12

# The projections are done outside in NumPy and inside by the core's GEMM,
# so the two agree to rounding, not bitwise.
TOL = {np.float64: dict(rtol=1e-10, atol=1e-10), np.float32: dict(rtol=2e-4, atol=2e-5)}


def _options(rng, G):
    """Every option of attention, with what it needs, by name."""
    mask_b = rng.random((B, 1, TQ, TK)) < 0.7
    mask_b[..., 0] = True
    return {
        "plain": {},
        "mask_bool": dict(mask=mask_b),
        "mask_float": dict(mask=rng.standard_normal((TQ, TK))),
        "causal": dict(causal=True),
        "key_lengths": dict(key_lengths=np.array([TK, 3])),
        "window": dict(causal=True, window=(2, 0)),
        "window_both": dict(window=(1, 2)),
        "softcap": dict(softcap=1.5),
        "alibi": dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625])),
        "sinks": dict(sinks=np.array([0.3, -1.0, 2.0, 0.0])),
        "key_mask": dict(key_mask=np.array([[True] * TK, [False, True, True, False,
                                                          True, False, True]])),
        "scale": dict(scale=0.3),
        "fully_masked": dict(key_lengths=np.array([0, 4])),
        "everything": dict(causal=True, window=(3, None), softcap=2.0,
                           alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4]),
                           sinks=np.array([0.0, 1.0, -1.0, 0.5]), key_lengths=np.array([6, 7])),
    }


OPTIONS = list(_options(np.random.default_rng(0), 2))


def _sources(rng, dtype, G):
    x = rng.standard_normal((B, TQ, DIN)).astype(dtype)
    key = rng.standard_normal((B, TK, DIN)).astype(dtype)
    value = rng.standard_normal((B, TK, DIN)).astype(dtype)
    w_q = (rng.standard_normal((DIN, H * DK)) * 0.4).astype(dtype)
    w_k = (rng.standard_normal((DIN, G * DK)) * 0.4).astype(dtype)
    w_v = rng.standard_normal((DIN, G * DV)).astype(dtype)
    return x, key, value, w_q, w_k, w_v


def _split(a, heads, layout):
    """(B, T, heads*d) -> (B, heads, T, d) or (B, T, heads, d)."""
    a = a.reshape(a.shape[0], a.shape[1], heads, -1)
    return np.swapaxes(a, 1, 2) if layout == "bhtd" else a


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("G", [4, 2])
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_equals_multi_head_attention(isa, option, G, layout, dtype):
    rng = np.random.default_rng(7)
    kw = _options(rng, G)[option]
    x, key, value, w_q, w_k, w_v = _sources(rng, dtype, G)
    concat = mhattn.multi_head_attention(x, w_q, w_k, w_v, num_heads=H, num_kv_heads=G,
                                         key=key, value=value, **kw)
    q, k, v = (_split(a, n, layout) for a, n in
               ((x @ w_q, H), (key @ w_k, G), (value @ w_v, G)))
    out, weights, lse = mhattn.attention(q, k, v, layout=layout, return_weights=True,
                                         return_lse=True, **kw)
    assert out.dtype == dtype and out.flags.c_contiguous
    assert out.shape == ((B, H, TQ, DV) if layout == "bhtd" else (B, TQ, H, DV))
    assert weights.shape == (B, H, TQ, TK) and lse.shape == (B, H, TQ)
    want = _split(concat, H, layout)
    np.testing.assert_allclose(out, want, **TOL[dtype])
    r_out, r_w, r_lse = R.projected_attention(q, k, v, layout=layout, **kw)
    np.testing.assert_allclose(out, r_out, **TOL[dtype])
    np.testing.assert_allclose(weights, r_w, **TOL[dtype])
    np.testing.assert_allclose(lse, r_lse, **TOL[dtype])
    assert np.isfinite(out).all()
    if option == "fully_masked":
        assert (out[0] == 0).all() if layout == "bhtd" else (out[0] == 0).all()
        assert np.isneginf(lse[0]).all()


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_unbatched_and_packed(isa, layout):
    rng = np.random.default_rng(3)
    cu = np.array([0, 3, 4, 8])
    total, G = 8, 2
    x = rng.standard_normal((total, DIN))
    w_q, w_k, w_v = (rng.standard_normal((DIN, n * DK)) * 0.4 for n in (H, G, G))
    for kw in ({}, dict(causal=True), dict(cu_seqlens=cu, causal=True),
               dict(cu_seqlens=cu, window=(1, 1), sinks=np.ones(H))):
        concat = mhattn.multi_head_attention(x, w_q, w_k, w_v, num_heads=H, num_kv_heads=G,
                                             **kw)
        q, k, v = (_split((x @ w)[None], n, layout)[0]
                   for w, n in ((w_q, H), (w_k, G), (w_v, G)))
        out, lse = mhattn.attention(q, k, v, layout=layout, return_lse=True, **kw)
        assert lse.shape == (H, total)
        np.testing.assert_allclose(out, _split(concat[None], H, layout)[0], **TOL[np.float64])
        np.testing.assert_allclose(out, R.projected_attention(q, k, v, layout=layout, **kw)[0],
                                   **TOL[np.float64])


def test_strided_views_and_inputs_unchanged():
    rng = np.random.default_rng(5)
    big = rng.standard_normal((B, H, 2 * TK, 3 * DK))
    q = big[:, :, ::2][:, :, :TQ, :DK]                 # strided along T and d's rows
    k = big[:, :2, 1::2, DK:2 * DK]
    v = big[:, 2:, 1::2, 2 * DK:2 * DK + DV]
    before = big.copy()
    out = mhattn.attention(q, k, v, causal=True)
    np.testing.assert_allclose(out, R.projected_attention(q, k, v, causal=True)[0],
                               **TOL[np.float64])
    assert (big == before).all()
    # Integers promote to float64, as everywhere in mhattn.
    qi = np.arange(2 * 3 * 4).reshape(1, 2, 3, 4) % 3
    assert mhattn.attention(qi, qi, qi).dtype == np.float64


@pytest.mark.parametrize("args, kw, name", [
    (((B, H, TQ, DK), (B, 2, TK, DK), (B, 2, TK + 1, DV)), {}, "v:"),
    (((B, H, TQ, DK), (B, 3, TK, DK), (B, 3, TK, DV)), {}, "k:"),
    (((B, H, TQ, DK), (B, 2, TK, DK + 1), (B, 2, TK, DV)), {}, "k:"),
    (((B, H, TQ, DK), (B + 1, 2, TK, DK), (B + 1, 2, TK, DV)), {}, "k:"),
    (((B, H, TQ, DK), (B, 2, TK, DK), (B, 1, TK, DV)), {}, "v:"),
    (((H, TQ, DK), (B, 2, TK, DK), (B, 2, TK, DV)), {}, "k:"),
    (((B, 1, H, TQ, DK), (B, 2, TK, DK), (B, 2, TK, DV)), {}, "q:"),
    (((B, H, TQ, DK), (B, 2, TK, DK), (B, 2, TK, DV)), dict(layout="bsnd"), "layout:"),
    (((B, H, TQ, DK), (B, 2, TK, DK), (B, 2, TK, DV)), dict(sinks=np.ones(3)), "sinks:"),
    (((B, H, TQ, DK), (B, 2, TK, DK), (B, 2, TK, DV)), dict(key_lengths=[1, 99]),
     "key_lengths:"),
    (((B, H, TQ, DK), (B, 2, TK, DK), (B, 2, TK, DV)), dict(mask=np.ones((3, 3), bool)),
     "mask:"),
])
def test_bad_input_names_the_argument(args, kw, name):
    arrays = [np.zeros(s) for s in args]
    with pytest.raises(ValueError) as e:
        mhattn.attention(*arrays, **kw)
    assert str(e.value).startswith(name), str(e.value)


def test_complex_raises_type_error():
    a = np.zeros((1, 1, 2, 2), complex)
    with pytest.raises(TypeError, match="^q:"):
        mhattn.attention(a, a.real, a.real)


# --- gradients -----------------------------------------------------------------

GRAD_CASES = {
    "plain": {},
    "causal_gqa": dict(causal=True),
    "mask_window_alibi": dict(window=(1, 1), alibi_slopes=np.array([0.3, 0.7]),
                              mask=np.array([[True, True, False, True]])),
    "softcap_sinks": dict(softcap=1.2, sinks=np.array([0.5, -0.3]), key_lengths=np.array([3])),
}


def _loss(weights_r, **kw):
    return lambda q, k, v, **extra: float(
        (mhattn.attention(q, k, v, **kw, **extra) * weights_r).sum())


@pytest.mark.parametrize("case", list(GRAD_CASES))
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_attention_grad_by_finite_differences(case, layout):
    rng = np.random.default_rng(11)
    kw = GRAD_CASES[case]
    G = 1 if case == "causal_gqa" else 2
    shapes = {"bhtd": ((1, 2, 3, 3), (1, G, 4, 3), (1, G, 4, 2)),
              "bthd": ((1, 3, 2, 3), (1, 4, G, 3), (1, 4, G, 2))}[layout]
    q, k, v = (rng.standard_normal(s) for s in shapes)
    out = mhattn.attention(q, k, v, layout=layout, **kw)
    r = rng.standard_normal(out.shape)
    grads = mhattn.attention_grad(r, q, k, v, layout=layout, **kw)
    assert set(grads) == {"q", "k", "v"} | ({"sinks"} if "sinks" in kw else set())
    loss = _loss(r, layout=layout, **{n: a for n, a in kw.items() if n != "sinks"})
    sinks = kw.get("sinks")
    arrays = dict(q=q, k=k, v=v)
    eps = 1e-6
    for name, a in arrays.items():
        assert grads[name].shape == a.shape
        num = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            for sign in (1, -1):
                b = a.copy()
                b[i] += sign * eps
                args = dict(arrays, **{name: b})
                num[i] += sign * loss(args["q"], args["k"], args["v"],
                                      **({} if sinks is None else dict(sinks=sinks)))
        np.testing.assert_allclose(grads[name], num / (2 * eps), rtol=1e-6, atol=1e-7)
    if sinks is not None:
        num = np.zeros_like(sinks)
        for i in range(sinks.size):
            for sign in (1, -1):
                s = sinks.copy()
                s[i] += sign * eps
                num[i] += sign * loss(q, k, v, sinks=s)
        np.testing.assert_allclose(grads["sinks"], num / (2 * eps), rtol=1e-6, atol=1e-7)


def test_attention_grad_with_the_forwards_lse():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 2, 5, 4)) for _ in range(3))
    out, lse = mhattn.attention(q, k, v, causal=True, return_lse=True)
    g = rng.standard_normal(out.shape)
    a = mhattn.attention_grad(g, q, k, v, causal=True)
    b = mhattn.attention_grad(g, q, k, v, causal=True, lse=lse, out=out)
    for name in "qkv":
        np.testing.assert_allclose(a[name], b[name], rtol=1e-12, atol=1e-13)
    with pytest.raises(ValueError, match="^grad_out:"):
        mhattn.attention_grad(g[:, :1], q, k, v)


@pytest.mark.parametrize("G", [4, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_grad_against_torch_sdpa(G, causal):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    q = rng.standard_normal((B, H, TQ, DK))
    k = rng.standard_normal((B, G, TK, DK))
    v = rng.standard_normal((B, G, TK, DV))
    mask = rng.random((B, 1, TQ, TK)) < 0.8
    mask[..., -1] = True
    if causal:   # mhattn's bottom-right triangle, as an SDPA mask
        mask &= np.arange(TK)[None, :] <= np.arange(TQ)[:, None] + (TK - TQ)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    rep = H // G
    t_out = torch.nn.functional.scaled_dot_product_attention(
        tq, tk.repeat_interleave(rep, 1), tv.repeat_interleave(rep, 1),
        attn_mask=torch.tensor(mask))
    g = rng.standard_normal(t_out.shape)
    t_out.backward(torch.tensor(g))
    out = mhattn.attention(q, k, v, mask=mask)
    np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=1e-10, atol=1e-12)
    grads = mhattn.attention_grad(g, q, k, v, mask=mask)
    for name, t in zip("qkv", (tq, tk, tv)):
        np.testing.assert_allclose(grads[name], t.grad.numpy(), rtol=1e-9, atol=1e-11)


# --- merging -------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:mask allows no key")
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_merge_over_any_split_equals_the_unsplit_call(seed, layout):
    rng = np.random.default_rng(seed)
    dtype = np.float64 if seed % 2 else np.float32
    G = 2
    q = rng.standard_normal((B, H, TQ, DK)).astype(dtype)
    k = rng.standard_normal((B, G, TK, DK)).astype(dtype)
    v = rng.standard_normal((B, G, TK, DV)).astype(dtype)
    mask = rng.random((B, H, TQ, TK)) < 0.6
    mask &= np.arange(TK)[None, :] <= np.arange(TQ)[:, None] + (TK - TQ)
    mask[0, 0, 0] = False                               # a row masked everywhere
    parts = rng.integers(0, 3, TK)
    parts[rng.permutation(TK)[:3]] = [0, 1, 2]          # every part non-empty
    if seed % 3 == 0:
        mask[..., parts == 2] = False                   # a part fully masked
    tr = (lambda a: np.swapaxes(a, 1, 2)) if layout == "bthd" else (lambda a: a)
    kw = dict(alibi_slopes=np.linspace(0.1, 0.4, H), softcap=3.0) if seed == 4 else {}
    full, full_lse = mhattn.attention(tr(q), tr(k), tr(v), mask=mask, layout=layout,
                                      return_lse=True, **kw)
    outs, lses = [], []
    for p in range(3):
        idx = np.flatnonzero(parts == p)
        # ALiBi needs each key's own position: give it through a float mask.
        extra = kw
        if kw:
            pos = np.arange(TQ)[:, None] + (TK - TQ) - np.arange(TK)[None, :]
            bias = -np.linspace(0.1, 0.4, H)[:, None, None] * np.abs(pos)
            extra = dict(softcap=3.0)
            m = np.where(mask, bias, -np.inf)[..., idx]
        else:
            m = mask[..., idx]
        o, s = mhattn.attention(tr(q), tr(k[:, :, idx]), tr(v[:, :, idx]), mask=m,
                                layout=layout, return_lse=True, **extra)
        outs.append(o)
        lses.append(s)
    with np.errstate(all="raise"):
        out, lse = mhattn.merge_attention(outs, lses, layout=layout)
    assert np.isfinite(out).all()
    tol = TOL[dtype] if dtype == np.float64 else dict(rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out, full, **tol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(full_lse))
    fin = np.isfinite(full_lse)
    np.testing.assert_allclose(lse[fin], full_lse[fin], **tol)
    assert (out[0, 0, 0] == 0).all() if layout == "bhtd" else (out[0, 0, 0] == 0).all()


def test_merge_of_one_part_and_bad_parts():
    rng = np.random.default_rng(0)
    o = rng.standard_normal((H, TQ, DV))
    s = rng.standard_normal((H, TQ))
    out, lse = mhattn.merge_attention([o], [s])
    np.testing.assert_allclose(out, o, rtol=1e-15)
    np.testing.assert_allclose(lse, s, rtol=1e-15)
    with pytest.raises(ValueError, match="^lses\\[1\\]:"):
        mhattn.merge_attention([o, o], [s, s[:, :2]])
    with pytest.raises(ValueError, match="^outs, lses:"):
        mhattn.merge_attention([o], [s, s])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_decode_is_bitwise_the_same_for_any_thread_count(dtype):
    """A decode (T_q = 1) splits its keys into parts chosen from T_k alone."""
    rng = np.random.default_rng(9)
    q = rng.standard_normal((2, 8, 1, 64)).astype(dtype)
    k = rng.standard_normal((2, 2, 3000, 64)).astype(dtype)
    v = rng.standard_normal((2, 2, 3000, 64)).astype(dtype)
    kw = dict(key_lengths=np.array([3000, 1777]), sinks=np.linspace(-1, 1, 8).astype(dtype),
              return_lse=True)
    before = mhattn.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            mhattn.set_num_threads(n)
            results.append(mhattn.attention(q, k, v, **kw))
    finally:
        mhattn.set_num_threads(before)
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(lse, results[0][1])
    ref_out, _, ref_lse = R.projected_attention(q, k, v, **{n: a for n, a in kw.items()
                                                            if n != "return_lse"})
    tol = TOL[dtype] if dtype == np.float64 else dict(rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(results[0][0], ref_out, **tol)
    np.testing.assert_allclose(results[0][1], ref_lse, **tol)


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_strided_keys_are_read_in_place(layout):
    """A (B, G, capacity, d) cache storage, or a bthd view of one, is not
    copied: NumPy's traced memory stays far below the keys' size."""
    import tracemalloc
    rng = np.random.default_rng(0)
    store = rng.standard_normal((1, 4, 8192, 64)).astype(np.float32)     # 8 MiB each
    vals = rng.standard_normal((1, 4, 8192, 64)).astype(np.float32)
    q = rng.standard_normal((1, 8, 1, 64)).astype(np.float32)
    tr = (lambda a: np.swapaxes(a, 1, 2)) if layout == "bthd" else (lambda a: a)
    tracemalloc.start()
    try:
        out = mhattn.attention(tr(q), tr(store[:, :, :5000]), tr(vals[:, :, :5000]),
                               layout=layout, key_lengths=np.array([4000]))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < store.nbytes // 8, peak
    np.testing.assert_allclose(out, R.projected_attention(
        tr(q), tr(store[:, :, :4000]), tr(vals[:, :, :4000]), layout=layout)[0],
        rtol=1e-4, atol=1e-5)


def test_backward_recomputes_lse_per_batch_item():
    """_C.attention_backward with lse=None recomputes it for every batch item
    (the recompute's flash context needs the batch strides)."""
    rng = np.random.default_rng(8)
    q = rng.standard_normal((3, 4, 5, 8))
    k = rng.standard_normal((3, 2, 7, 8))
    v = rng.standard_normal((3, 2, 7, 8))
    out, lse = mhattn.attention(q, k, v, causal=True, return_lse=True)
    g = rng.standard_normal(out.shape)
    scales = np.full(4, 8 ** -0.5)
    given = mhattn._C.attention_backward(g, q, k, v, out, lse, scales, None, True, None,
                                         None, False)
    redone = mhattn._C.attention_backward(g, q, k, v, out, None, scales, None, True, None,
                                          None, False)
    for a, b in zip(given[:3], redone[:3]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)
