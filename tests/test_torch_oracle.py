"""PyTorch as an independent oracle: nn.MultiheadAttention through the layer's
from_torch / to_torch, its masks through from_torch_masks, and
F.scaled_dot_product_attention for GQA and the causal alignment."""
import itertools
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import mhattn  # noqa: E402
from mhattn.nn.interop import from_torch_masks, to_torch_attn_mask  # noqa: E402
from mhattn.nn.layer import MultiHeadAttention  # noqa: E402

TORCH_DTYPE = {np.float32: torch.float32, np.float64: torch.float64}
DTYPES = [np.float32, np.float64]

# float64: both sides round to ~1e-16 per operation; 1e-10 leaves ample room.
# float32: PyTorch's kernels sum in other orders (and nn.MultiheadAttention
# pre-scales q instead of the scores), so results differ by a few float32 ulps;
# with these small sizes (d <= 16, T <= 7) the observed gap is below 2e-6, so
# the project's usual 1e-5 holds without loosening.
TOL = {np.float32: dict(rtol=1e-5, atol=1e-5), np.float64: dict(rtol=1e-10, atol=1e-10)}


def tol(dtype):
    return TOL[np.dtype(dtype).type]


def np_(t):
    return t.detach().cpu().numpy()


def randomize_biases(module, gen):
    """nn.MultiheadAttention initialises biases to 0; make them matter."""
    with torch.no_grad():
        if module.in_proj_bias is not None:
            module.in_proj_bias.copy_(torch.randn(module.in_proj_bias.shape, generator=gen))
            module.out_proj.bias.copy_(torch.randn(module.out_proj.bias.shape, generator=gen))


# --------------------------------------------------------------------------
# nn.MultiheadAttention -> MultiHeadAttention.from_torch

MHA_CONFIGS = list(itertools.product(
    [True, False],                  # bias
    [None, (5, 7)],                 # (kdim, vdim)
    [True, False],                  # batch_first
    ["none", "kpm_bool", "attn_bool_2d", "attn_float_2d", "attn_bool_3d",
     "attn_float_3d", "both_bool", "float_and_bool"],
))


def make_masks(kind, gen, B, h, Tq, Tk):
    """PyTorch-convention masks that leave every query at least key 0."""
    am = kpm = None
    blocked = torch.rand((B * h, Tq, Tk), generator=gen) < 0.4
    blocked[..., 0] = False
    additive = torch.randn((B * h, Tq, Tk), generator=gen)
    pad = torch.zeros((B, Tk), dtype=torch.bool)
    pad[0, Tk - 2:] = True          # item 0 has two padding keys
    if kind == "kpm_bool":
        kpm = pad
    elif kind == "attn_bool_2d":
        am = blocked[0]
    elif kind == "attn_float_2d":
        am = additive[0]
    elif kind == "attn_bool_3d":
        am = blocked
    elif kind == "attn_float_3d":
        am = additive
    elif kind == "both_bool":
        am, kpm = blocked[0], pad
    elif kind == "float_and_bool":
        am, kpm = additive, pad
    return am, kpm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias,kv_dims,batch_first,masks", MHA_CONFIGS)
def test_from_torch_matches_module(dtype, bias, kv_dims, batch_first, masks):
    gen = torch.Generator().manual_seed(MHA_CONFIGS.index((bias, kv_dims, batch_first, masks)))
    E, h, B, Tq, Tk = 12, 3, 2, 4, 6
    kdim, vdim = kv_dims if kv_dims else (None, None)
    tdt = TORCH_DTYPE[dtype]
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    module = torch.nn.MultiheadAttention(E, h, bias=bias, kdim=kdim, vdim=vdim,
                                         batch_first=batch_first, dtype=tdt).eval()
    randomize_biases(module, gen)
    x = torch.randn((B, Tq, E), generator=gen, dtype=tdt)
    key = torch.randn((B, Tk, module.kdim), generator=gen, dtype=tdt)
    value = torch.randn((B, Tk, module.vdim), generator=gen, dtype=tdt)
    am, kpm = make_masks(masks, gen, B, h, Tq, Tk)
    if am is not None and am.is_floating_point():
        am = am.to(tdt)
    # mhattn is batch-first; PyTorch's default layout is (T, B, E).
    feed = (lambda t: t) if batch_first else (lambda t: t.transpose(0, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # mixed mask types are deprecated in PyTorch
        t_out, t_w = module(feed(x), feed(key), feed(value), key_padding_mask=kpm,
                            attn_mask=am, need_weights=True, average_attn_weights=False)
    t_out = feed(t_out)

    layer = MultiHeadAttention.from_torch(module)
    assert layer.dtype == dtype and layer.bias == bias
    assert (layer.kdim, layer.vdim) == (module.kdim, module.vdim)
    mask = from_torch_masks(am, kpm, num_heads=h, batch_size=B)
    out, w = layer(np_(x), np_(key), np_(value), mask=mask, return_weights=True)
    assert out.dtype == dtype
    np.testing.assert_allclose(out, np_(t_out), **tol(dtype))
    np.testing.assert_allclose(w, np_(t_w), **tol(dtype))   # per head


@pytest.mark.parametrize("dtype", DTYPES)
def test_from_torch_fast_path(dtype):
    """need_weights=False in eval mode and no_grad may take PyTorch's fused
    native kernel: mhattn must agree with it too."""
    torch.manual_seed(0)
    tdt = TORCH_DTYPE[dtype]
    module = torch.nn.MultiheadAttention(16, 4, batch_first=True, dtype=tdt).eval()
    randomize_biases(module, torch.Generator().manual_seed(1))
    x = torch.randn(3, 5, 16, dtype=tdt)
    kpm = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] + [True] * 4])
    with torch.no_grad():
        t_out, _ = module(x, x, x, key_padding_mask=kpm, need_weights=False)
    layer = MultiHeadAttention.from_torch(module)
    out = layer(np_(x), mask=from_torch_masks(key_padding_mask=kpm))
    np.testing.assert_allclose(out, np_(t_out), **tol(dtype))
    # key_lengths says the same as this padding mask.
    out2 = layer(np_(x), key_lengths=[5, 3, 1])
    np.testing.assert_allclose(out2, np_(t_out), **tol(dtype))


def test_from_torch_unbatched_and_masks_as_numpy():
    torch.manual_seed(2)
    module = torch.nn.MultiheadAttention(8, 2, dtype=torch.float64).eval()
    randomize_biases(module, torch.Generator().manual_seed(3))
    x = torch.randn(4, 8, dtype=torch.float64)            # unbatched (T, E)
    am = torch.rand(2, 4, 4) < 0.3                        # (num_heads, T, T)
    am[..., 0] = False
    kpm = torch.tensor([False, False, False, True])
    t_out, t_w = module(x, x, x, attn_mask=am, key_padding_mask=kpm,
                        average_attn_weights=False)
    layer = MultiHeadAttention.from_torch(module)
    mask = from_torch_masks(np_(am), np_(kpm), num_heads=2)
    out, w = layer(np_(x), mask=mask, return_weights=True)
    np.testing.assert_allclose(out, np_(t_out), **tol(np.float64))
    np.testing.assert_allclose(w, np_(t_w), **tol(np.float64))


def test_fully_masked_rows_give_b_o_where_torch_gives_nan():
    torch.manual_seed(4)
    module = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64).eval()
    randomize_biases(module, torch.Generator().manual_seed(5))
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    kpm = torch.tensor([[True] * 3, [False, False, True]])   # item 0: no key at all
    t_out, _ = module(x, x, x, key_padding_mask=kpm)
    layer = MultiHeadAttention.from_torch(module)
    # The "inverted?" warning is for masks that allow nothing anywhere; item 1
    # attends, so none is expected.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, w = layer(np_(x), mask=from_torch_masks(key_padding_mask=kpm),
                       return_weights=True)
    np.testing.assert_array_equal(out[0], np.broadcast_to(layer.b_o, (3, 8)))
    assert np.all(w[0] == 0) and not np.isnan(out).any()
    np.testing.assert_allclose(out[1], np_(t_out)[1], **tol(np.float64))
    # The documented difference: PyTorch's rows are NaN.
    assert np.isnan(np_(t_out)[0]).all()


def test_from_torch_refuses_unsupported_modules():
    for kw, word in ((dict(add_bias_kv=True), "add_bias_kv"),
                     (dict(add_zero_attn=True), "add_zero_attn")):
        with pytest.raises(ValueError, match=word):
            MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(8, 2, **kw))
    with pytest.warns(UserWarning, match="dropout"):
        MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(8, 2, dropout=0.1))
    with pytest.raises(TypeError, match="MultiheadAttention"):
        MultiHeadAttention.from_torch(torch.nn.Linear(4, 4))


# --------------------------------------------------------------------------
# round trips

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", [dict(), dict(bias=True), dict(kdim=3, vdim=5, bias=True)])
def test_layer_to_torch_round_trip(dtype, cfg):
    rng = np.random.default_rng(6)
    layer = MultiHeadAttention(12, 4, dtype=dtype, seed=6, **cfg)
    if layer.bias:
        for name in ("b_q", "b_k", "b_v", "b_o"):
            setattr(layer, name, rng.standard_normal(getattr(layer, name).shape).astype(dtype))
    module = layer.to_torch()
    assert module.batch_first and not module.training
    x = rng.standard_normal((2, 4, 12)).astype(dtype)
    key = rng.standard_normal((2, 6, layer.kdim)).astype(dtype)
    value = rng.standard_normal((2, 6, layer.vdim)).astype(dtype)
    mask = rng.random((4, 6)) < 0.7
    mask[:, 0] = True
    out, w = layer(x, key, value, mask=mask, key_lengths=[6, 4], return_weights=True)
    kpm = torch.from_numpy(np.arange(6)[None, :] >= np.array([6, 4])[:, None])
    t_out, t_w = module(torch.from_numpy(x), torch.from_numpy(key), torch.from_numpy(value),
                        attn_mask=to_torch_attn_mask(mask, as_tensor=True),
                        key_padding_mask=kpm, average_attn_weights=False)
    np.testing.assert_allclose(out, np_(t_out), **tol(dtype))
    np.testing.assert_allclose(w, np_(t_w), **tol(dtype))
    # And back: from_torch recovers the very same arrays.
    again = MultiHeadAttention.from_torch(module)
    assert repr(again) == repr(layer)
    for name in layer.weights():
        np.testing.assert_array_equal(getattr(again, name), getattr(layer, name))


@pytest.mark.parametrize("kw", [dict(), dict(bias=False), dict(kdim=3, vdim=6)])
def test_state_dict_matches_torch(kw):
    torch.manual_seed(7)
    module = torch.nn.MultiheadAttention(8, 2, **kw)
    randomize_biases(module, torch.Generator().manual_seed(8))
    layer = MultiHeadAttention.from_torch(module)
    ours = layer.state_dict()
    theirs = {k: np_(v) for k, v in module.state_dict().items()}
    assert set(ours) == set(theirs)
    for k in ours:
        np.testing.assert_array_equal(ours[k], theirs[k])
    # Loading PyTorch's state dict (tensors) into a fresh layer.
    fresh = MultiHeadAttention(8, 2, bias=layer.bias, kdim=layer.kdim, vdim=layer.vdim,
                               seed=0)
    fresh.load_state_dict(module.state_dict())
    for name in layer.weights():
        np.testing.assert_array_equal(getattr(fresh, name), getattr(layer, name))


def test_init_distribution_matches_torch():
    """Same distributions as nn.MultiheadAttention's init (not the same draws)."""
    E, h = 256, 4
    torch.manual_seed(9)
    for kw in (dict(bias=True), dict(kdim=64, vdim=128, bias=False)):
        module = torch.nn.MultiheadAttention(E, h, **kw)
        theirs = {k: np_(v) for k, v in module.state_dict().items()}
        ours = MultiHeadAttention(E, h, seed=9, **kw).state_dict()
        for k, t in theirs.items():
            o = ours[k]
            assert o.shape == t.shape
            if np.all(t == 0):
                assert np.all(o == 0), k
                continue
            assert abs(o.std() / t.std() - 1) < 0.05, k
            # Uniform: the largest |w| sits just under the shared bound.
            assert abs(np.abs(o).max() / np.abs(t).max() - 1) < 0.01, k


# --------------------------------------------------------------------------
# F.scaled_dot_product_attention: GQA and the causal alignment

def sdpa_setup(rng, dtype, B, h, g, Tq, Tk, d=4, d_in=6):
    x = rng.standard_normal((B, Tq, d_in)).astype(dtype)
    key = rng.standard_normal((B, Tk, d_in)).astype(dtype)
    wq = rng.standard_normal((h, d_in, d)).astype(dtype)
    wk = rng.standard_normal((g, d_in, d)).astype(dtype)
    wv = rng.standard_normal((g, d_in, d)).astype(dtype)
    # The same projections for SDPA: (B, heads, T, d).
    q = torch.from_numpy(np.einsum("btc,hcd->bhtd", x, wq))
    k = torch.from_numpy(np.einsum("btc,hcd->bhtd", key, wk))
    v = torch.from_numpy(np.einsum("btc,hcd->bhtd", key, wv))
    return (x, key, wq, wk, wv), (q, k, v)


def heads_of(concat, h):
    """mhattn's concatenation (B, Tq, h*d) -> SDPA's (B, h, Tq, d)."""
    B, Tq, hd = concat.shape
    return concat.reshape(B, Tq, h, hd // h).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_gqa(dtype, g, causal):
    rng = np.random.default_rng(10 + g)
    h, T = 4, 5
    (x, key, wq, wk, wv), (q, k, v) = sdpa_setup(rng, dtype, 2, h, g, T, T)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    got = mhattn.multi_head_attention(x, wq, wk, wv, key=key, num_kv_heads=g, causal=causal)
    np.testing.assert_allclose(heads_of(got, h), np_(want), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sdpa_masks_and_scale(dtype):
    rng = np.random.default_rng(11)
    h, g, Tq, Tk = 4, 2, 3, 5
    (x, key, wq, wk, wv), (q, k, v) = sdpa_setup(rng, dtype, 2, h, g, Tq, Tk)
    for mask in (rng.random((2, 1, Tq, Tk)) < 0.6, rng.standard_normal((h, 1, Tk)).astype(dtype)):
        if mask.dtype == bool:
            mask[..., 0] = True   # SDPA gives NaN for fully masked rows
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(mask),
                                              scale=0.3, enable_gqa=True)
        got = mhattn.multi_head_attention(x, wq, wk, wv, key=key, num_kv_heads=g, mask=mask,
                                          scale=0.3)
        np.testing.assert_allclose(heads_of(got, h), np_(want), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Tq,Tk", [(3, 7), (1, 6), (5, 5), (7, 3)])
def test_causal_alignment_against_sdpa(dtype, Tq, Tk):
    """mhattn's causal is bottom-right: SDPA with an explicit bottom-right mask
    (and PyTorch's own causal_lower_right) agrees; SDPA's is_causal (top-left)
    does not, unless T_q == T_k."""
    rng = np.random.default_rng(12)
    h = 2
    (x, key, wq, wk, wv), (q, k, v) = sdpa_setup(rng, dtype, 2, h, h, Tq, Tk)
    got = heads_of(mhattn.multi_head_attention(x, wq, wk, wv, key=key, causal=True), h)
    bottom_right = np.tril(np.ones((Tq, Tk), bool), k=Tk - Tq)
    live = bottom_right.any(-1)     # rows with at least one key (Tq > Tk: not all)
    explicit = np_(F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.from_numpy(bottom_right)))
    np.testing.assert_allclose(got[:, :, live], explicit[:, :, live], **tol(dtype))
    # Rows that see no key: SDPA gives NaN, mhattn zeros (no b_o here).
    assert np.all(got[:, :, ~live] == 0)
    if Tq <= Tk:
        from torch.nn.attention.bias import causal_lower_right
        lower_right = F.scaled_dot_product_attention(q, k, v,
                                                     attn_mask=causal_lower_right(Tq, Tk))
        np.testing.assert_allclose(got, np_(lower_right), **tol(dtype))
    top_left = np_(F.scaled_dot_product_attention(q, k, v, is_causal=True))
    if Tq == Tk:
        np.testing.assert_allclose(got, top_left, **tol(dtype))
    elif Tq < Tk:
        # Query 0 sees keys 0..Tk-Tq in mhattn but only key 0 in SDPA.
        assert not np.allclose(got[:, :, 0], top_left[:, :, 0], atol=1e-3)


# --------------------------------------------------------------------------
# the mask converters with tensors

def test_from_torch_masks_accepts_tensors():
    gen = torch.Generator().manual_seed(13)
    am = torch.rand((6, 4, 5), generator=gen) < 0.3
    kpm = torch.rand((2, 5), generator=gen) < 0.3
    from_t = from_torch_masks(am, kpm, num_heads=3)
    from_n = from_torch_masks(np_(am), np_(kpm), num_heads=3)
    assert isinstance(from_t, np.ndarray)
    np.testing.assert_array_equal(from_t, from_n)
    half = from_torch_masks(torch.randn((4, 5), generator=gen).to(torch.bfloat16))
    assert half.dtype == np.float32
    t = to_torch_attn_mask(from_t, num_heads=3, as_tensor=True)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.bool and t.shape == (6, 4, 5)
    assert torch.equal(t, am | kpm[:, None, None, :].expand(2, 3, 4, 5).reshape(6, 4, 5))
