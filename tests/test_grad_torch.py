"""Gradients against PyTorch autograd: nn.MultiheadAttention through
MultiHeadAttention.from_torch, and F.scaled_dot_product_attention (GQA,
bottom-right causal, masks, scale, biases). Every weight's gradient and the
inputs' are compared."""
import itertools
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import mhattn  # noqa: E402
from mhattn.nn.interop import from_torch_masks  # noqa: E402
from mhattn.nn.layer import MultiHeadAttention  # noqa: E402

TORCH_DTYPE = {np.float32: torch.float32, np.float64: torch.float64}
DTYPES = [np.float32, np.float64]

# float64: both sides round to ~1e-16 per operation, over sums of at most a
# few hundred terms; 1e-9 of each gradient's scale is ample. float32: the two
# libraries sum in different orders (and we recompute the softmax from its
# log-sum-exp), so gradients differ by float32 rounding amplified by the
# softmax backward's cancellation; 1e-4 relative to the gradients' scale.
# The scale is the largest gradient of the call: b_k's gradient is zero in
# exact arithmetic (softmax ignores a constant added to a row's scores), so
# both libraries give only rounding noise there.
RTOL = {np.float32: 1e-4, np.float64: 1e-9}


def np_(t):
    return t.detach().cpu().numpy()


def assert_grads(got, want, dtype):
    """got, want: dicts of arrays by name, compared at one scale."""
    assert set(got) == set(want)
    rtol = RTOL[dtype]
    scale = max(float(np.abs(w).max(initial=0.0)) for w in want.values())
    for name in want:
        assert got[name].shape == want[name].shape, name
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=rtol * scale,
                                   err_msg=f"gradient of {name}")


def torch_layout(layer, grads):
    """The layer's gradients under nn.MultiheadAttention's parameter names:
    state_dict() only rearranges arrays, so it maps gradients exactly."""
    shadow = MultiHeadAttention.__new__(MultiHeadAttention)
    shadow.__dict__.update(layer.__dict__)
    for name in layer.weights():
        setattr(shadow, name, grads[name])
    return shadow.state_dict()


# --------------------------------------------------------------------------
# nn.MultiheadAttention

MHA_CONFIGS = list(itertools.product(
    [True, False],                          # bias
    ["self", "cross", "cross_kvdim"],       # key/value: x itself, or separate
    ["none", "kpm", "attn_bool", "attn_float", "both"],
))


def make_masks(kind, gen, B, h, Tq, Tk, tdt):
    """PyTorch-convention masks (True = blocked) that leave every query key 0."""
    blocked = torch.rand((B * h, Tq, Tk), generator=gen) < 0.4
    blocked[..., 0] = False
    pad = torch.zeros((B, Tk), dtype=torch.bool)
    pad[0, Tk - 2:] = True
    am = kpm = None
    if kind == "kpm":
        kpm = pad
    elif kind == "attn_bool":
        am = blocked[0]
    elif kind == "attn_float":
        am = torch.randn((B * h, Tq, Tk), generator=gen, dtype=tdt)
    elif kind == "both":
        am, kpm = blocked, pad
    return am, kpm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias,inputs,masks", MHA_CONFIGS)
def test_multihead_attention_module(dtype, bias, inputs, masks):
    seed = MHA_CONFIGS.index((bias, inputs, masks))
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    E, h, B, Tq = 12, 3, 2, 4
    Tk = Tq if inputs == "self" else 6
    kdim, vdim = (5, 7) if inputs == "cross_kvdim" else (None, None)
    tdt = TORCH_DTYPE[dtype]
    module = torch.nn.MultiheadAttention(E, h, bias=bias, kdim=kdim, vdim=vdim,
                                         batch_first=True, dtype=tdt)
    if bias:
        with torch.no_grad():
            module.in_proj_bias.copy_(torch.randn(module.in_proj_bias.shape, generator=gen))
            module.out_proj.bias.copy_(torch.randn(module.out_proj.bias.shape, generator=gen))
    x = torch.randn((B, Tq, E), generator=gen, dtype=tdt, requires_grad=True)
    if inputs == "self":
        key = value = x
    else:
        key = torch.randn((B, Tk, module.kdim), generator=gen, dtype=tdt, requires_grad=True)
        value = torch.randn((B, Tk, module.vdim), generator=gen, dtype=tdt,
                            requires_grad=True)
    am, kpm = make_masks(masks, gen, B, h, Tq, Tk, tdt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # mixed mask types are deprecated
        t_out, _ = module(x, key, value, key_padding_mask=kpm, attn_mask=am,
                          need_weights=False)
    R = torch.randn(t_out.shape, generator=gen, dtype=tdt)
    (t_out * R).sum().backward()

    layer = MultiHeadAttention.from_torch(module)
    mask = from_torch_masks(am, kpm, num_heads=h, batch_size=B)
    if inputs == "self":
        out, ctx = layer(np_(x), mask=mask, return_context=True)
    else:
        out, ctx = layer(np_(x), np_(key), np_(value), mask=mask, return_context=True)
    np.testing.assert_allclose(out, np_(t_out), rtol=RTOL[dtype] / 10,
                               atol=RTOL[dtype] / 10)
    g = layer.backward(np_(R), ctx)
    assert all(v.dtype == dtype for v in g.values())

    ours = torch_layout(layer, g)
    theirs = {name: np_(p.grad) for name, p in module.named_parameters()}
    # Self-attention: x fed queries, keys and values, in both libraries.
    ours["x"], theirs["x"] = g["x"], np_(x.grad)
    if inputs != "self":
        ours["key"], theirs["key"] = g["key"], np_(key.grad)
        ours["value"], theirs["value"] = g["value"], np_(value.grad)
    assert_grads(ours, theirs, dtype)


def test_multihead_attention_module_several_tiles():
    """T > 64 in both directions: several tiles per head."""
    gen = torch.Generator().manual_seed(100)
    torch.manual_seed(100)
    E, h, B, T = 32, 4, 2, 150
    module = torch.nn.MultiheadAttention(E, h, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        module.in_proj_bias.copy_(torch.randn(module.in_proj_bias.shape, generator=gen))
    x = torch.randn((B, T, E), generator=gen, dtype=torch.float64, requires_grad=True)
    kpm = torch.zeros((B, T), dtype=torch.bool)
    kpm[1, 100:] = True
    t_out, _ = module(x, x, x, key_padding_mask=kpm, need_weights=False)
    R = torch.randn(t_out.shape, generator=gen, dtype=torch.float64)
    (t_out * R).sum().backward()
    layer = MultiHeadAttention.from_torch(module)
    out, ctx = layer(np_(x), key_lengths=[T, 100], return_context=True)
    g = layer.backward(np_(R), ctx)
    ours = dict(torch_layout(layer, g), x=g["x"])
    theirs = {name: np_(p.grad) for name, p in module.named_parameters()}
    theirs["x"] = np_(x.grad)
    assert_grads(ours, theirs, np.float64)


# --------------------------------------------------------------------------
# F.scaled_dot_product_attention

SDPA_CONFIGS = [
    # B, h, g, Tq, Tk, causal, mask, separate value, bias, scale
    (2, 4, 4, 5, 5, False, None, False, False, None),
    (2, 4, 2, 5, 5, True, None, False, True, None),
    (2, 4, 1, 3, 7, True, None, True, True, 0.3),      # bottom-right, MQA
    (2, 4, 2, 4, 6, False, "bool", True, False, None),
    (1, 2, 2, 6, 6, False, "float", False, True, 0.5),
    (2, 4, 2, 130, 150, True, "bool", True, True, None),   # several tiles
    (1, 6, 3, 70, 70, True, "float", False, True, None),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,h,g,Tq,Tk,causal,mask_kind,sep_value,bias,scale", SDPA_CONFIGS)
def test_sdpa(dtype, B, h, g, Tq, Tk, causal, mask_kind, sep_value, bias, scale):
    rng = np.random.default_rng(SDPA_CONFIGS.index(
        (B, h, g, Tq, Tk, causal, mask_kind, sep_value, bias, scale)))
    d_in, d_kin, d_vin, d, dv = 6, 5, 7 if sep_value else 5, 4, 3
    arrays = dict(x=rng.standard_normal((B, Tq, d_in)),
                  key=rng.standard_normal((B, Tk, d_kin)),
                  w_q=rng.standard_normal((h, d_in, d)),
                  w_k=rng.standard_normal((g, d_kin, d)),
                  w_v=rng.standard_normal((g, d_vin, dv)))
    if sep_value:
        arrays["value"] = rng.standard_normal((B, Tk, d_vin))
    if bias:
        arrays.update(b_q=rng.standard_normal((h, d)), b_k=rng.standard_normal((g, d)),
                      b_v=rng.standard_normal((g, dv)))
    arrays = {k: v.astype(dtype) for k, v in arrays.items()}
    mask = None
    if mask_kind == "bool":
        mask = rng.random((B, 1, Tq, Tk)) < 0.7
        mask[..., 0] = True   # SDPA gives NaN for fully masked rows
    elif mask_kind == "float":
        mask = rng.standard_normal((h, 1, Tk)).astype(dtype)

    t = {k: torch.from_numpy(v.copy()).requires_grad_(True) for k, v in arrays.items()}
    value = t.get("value", t["key"])
    q = torch.einsum("btc,hcd->bhtd", t["x"], t["w_q"])
    k = torch.einsum("btc,hcd->bhtd", t["key"], t["w_k"])
    v = torch.einsum("btc,hcd->bhtd", value, t["w_v"])
    if bias:
        q = q + t["b_q"][None, :, None, :]
        k = k + t["b_k"][None, :, None, :]
        v = v + t["b_v"][None, :, None, :]
    attn_mask = None if mask is None else torch.from_numpy(mask)
    if causal:
        # mhattn's causal is bottom-right (key j <= i + Tk - Tq).
        br = torch.ones((Tq, Tk), dtype=torch.bool).tril(diagonal=Tk - Tq)
        if attn_mask is None:
            attn_mask = br
        elif attn_mask.dtype == torch.bool:
            attn_mask = attn_mask & br
        else:
            attn_mask = attn_mask.masked_fill(~br, float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale,
                                         enable_gqa=True)
    R = rng.standard_normal(out.shape).astype(dtype)
    (out * torch.from_numpy(R)).sum().backward()

    # mhattn's output is the concatenation (B, Tq, h*dv): SDPA's (B, h, Tq, dv).
    R_ours = R.transpose(0, 2, 1, 3).reshape(B, Tq, h * dv)
    kw = {k: v for k, v in arrays.items() if k not in ("x", "w_q", "w_k", "w_v")}
    grads = mhattn.multi_head_attention_grad(
        R_ours, arrays["x"], arrays["w_q"], arrays["w_k"], arrays["w_v"],
        num_kv_heads=g, causal=causal, mask=mask, scale=scale, **kw)
    assert_grads(grads, {name: np_(tensor.grad) for name, tensor in t.items()}, dtype)
