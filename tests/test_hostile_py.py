"""Hostile callers on the Python side (issue 12, items 6-10): every entry
point raises mhattn's own, named error before it allocates or misreads."""
import re

import numpy as np
import pytest

import mhattn
from mhattn._internal import args as _args, core as _core

rng = np.random.default_rng(12)
X = rng.standard_normal((3, 4))
W = rng.standard_normal((4, 4))
WL = [rng.standard_normal((4, 2)), rng.standard_normal((4, 2))]


def _layer_call(x, w_q, w_k, w_v, **kw):
    layer = mhattn.MultiHeadAttention(4, 2, dtype=np.float64, seed=0)
    layer.w_q, layer.w_k, layer.w_v = w_q, w_k, w_v
    return layer(x, **kw)


ENTRY_POINTS = {
    "forward": lambda *a, **kw: mhattn.multi_head_attention(*a, **kw),
    "grad": lambda x, *a, **kw: mhattn.multi_head_attention_grad(
        np.ones((x.shape[0], 4)), x, *a, **kw),
    "trace": lambda *a, **kw: mhattn.trace(*a, **kw),
    "layer": _layer_call,
}


# --- item 8: zero-width heads -------------------------------------------------
Z2 = np.ones((4, 0))
ZERO_WIDTH = {
    "w_q_stacked": ((np.ones((2, 4, 0)), np.ones((2, 4, 0)), np.ones((2, 4, 2))),
                    "w_q / w_k: d_k[0]"),
    "w_q_list": (([WL[0], Z2], [WL[0], Z2], WL), "w_q / w_k: d_k[1]"),
    "w_k_list": ((WL, [Z2, WL[1]], WL), "w_q / w_k: d_k[0]"),
    "w_v_stacked": ((np.ones((2, 4, 2)), np.ones((2, 4, 2)), np.ones((2, 4, 0))),
                    "w_v: d_v[0]"),
    "w_v_list": ((WL, WL, [WL[0], Z2]), "w_v: d_v[1]"),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("case", list(ZERO_WIDTH))
def test_zero_width_heads_name_the_argument(entry, case):
    (wq, wk, wv), name = ZERO_WIDTH[case]
    # The core's rule and message (mha_check_config), in the user's names.
    with pytest.raises(ValueError, match="^" + re.escape(name) +
                       " = 0: every head is at least one column wide"):
        ENTRY_POINTS[entry](X, wq, wk, wv)


# --- item 9: load_state_dict checks dtypes and always copies ---------------------
def _state(layer, dtype=None):
    sd = layer.state_dict()
    return {k: v if dtype is None else v.astype(dtype) for k, v in sd.items()}


@pytest.mark.parametrize("dtype,what", [(np.complex128, "complex"), ("datetime64[s]", "datetime"),
                                        (bool, "bool"), ("U8", "string")])
def test_load_state_dict_refuses_bad_dtypes(dtype, what):
    layer = mhattn.MultiHeadAttention(4, 2, bias=True, dtype=np.float64, seed=0)
    sd = _state(layer)
    sd["in_proj_weight"] = sd["in_proj_weight"].astype(dtype)
    before = {k: v.copy() for k, v in layer.weights().items()}
    with pytest.raises(TypeError, match=rf"^in_proj_weight: dtype .*\({what}\) is not supported"):
        layer.load_state_dict(sd)
    for k, v in layer.weights().items():      # nothing was half-loaded
        np.testing.assert_array_equal(v, before[k])


@pytest.mark.parametrize("kw", [dict(d_model=2, num_heads=2),            # d_k = 1
                                dict(d_model=4, num_heads=2, d_out=1),   # d_out = 1
                                dict(d_model=2, num_heads=2, d_out=1, bias=True)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_load_state_dict_never_keeps_views(kw, dtype):
    layer = mhattn.MultiHeadAttention(dtype=dtype, seed=0, **kw)
    sd = _state(layer, dtype)
    layer.load_state_dict(sd)
    for name, w in layer.weights().items():
        for k, v in sd.items():
            assert not np.shares_memory(w, v), f"layer.{name} is a view of {k}"


def test_from_torch_shares_no_memory():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    for module in (torch.nn.MultiheadAttention(2, 2, bias=True, dtype=torch.float64),
                   torch.nn.MultiheadAttention(2, 2, kdim=3, vdim=1)):
        layer = mhattn.MultiHeadAttention.from_torch(module)
        params = [p.detach().numpy() for p in module.parameters()]
        for name, w in layer.weights().items():
            assert not any(np.shares_memory(w, p) for p in params), name
        before = [p.copy() for p in params]
        for name, w in layer.weights().items():
            if name.startswith("w_"):   # packed weights: read-only views
                with pytest.raises(ValueError, match="read-only"):
                    w += 1.0
            else:
                w += 1.0
        for p, b in zip(params, before):
            np.testing.assert_array_equal(p, b)


# --- item 6: the backward checks its whole peak need ---------------------------
def _long_call(B=2, T=256, d=32, h=4):
    x = rng.standard_normal((B, T, d))
    w = rng.standard_normal((d, d))
    return x, w, dict(num_heads=h)


def _forward_need(x, w, kw):
    """What the forward of a backward keeps and allocates, in bytes."""
    call = _args.normalize(x, w, w, w, w, **kw)
    return sum(np.prod(f, dtype=object) * n for _, _, f, n in _args.plan(call, keep=True))


def test_backward_checks_memory(monkeypatch):
    x, w, kw = _long_call()
    out, ctx = mhattn.multi_head_attention(x, w, w, w, w, return_context=True, **kw)
    layer = mhattn.MultiHeadAttention(32, 4, dtype=np.float64, seed=0)
    lout, lctx = layer(x, return_context=True)
    # The forward fits; the backward (its gradients and scratch) does not.
    monkeypatch.setattr(_args, "_memory_limit_bytes", int(_forward_need(x, w, kw)))
    for fn in (lambda: mhattn.backward(np.ones_like(out), ctx),
               lambda: layer.backward(np.ones_like(lout), lctx),
               lambda: mhattn.backward(np.ones(out.shape, np.float32), ctx)):
        with pytest.raises(MemoryError, match=r"the backward's .* needs .* elements"):
            fn()


def test_multi_head_attention_grad_checks_memory_before_the_forward(monkeypatch):
    x, w, kw = _long_call()
    monkeypatch.setattr(_args, "_memory_limit_bytes", int(_forward_need(x, w, kw)))
    with pytest.raises(MemoryError, match=r"the backward's .* needs .* elements"):
        mhattn.multi_head_attention_grad(np.ones((2, 256, 32)), x, w, w, w, w, **kw)
    monkeypatch.setattr(_args, "_memory_limit_bytes", 1 << 40)
    grads = mhattn.multi_head_attention_grad(np.ones((2, 256, 32)), x, w, w, w, w, **kw)
    assert grads["x"].shape == x.shape


# --- item 7: trace checks its whole peak need --------------------------------
def test_trace_checks_the_scores_memory(monkeypatch):
    x, w, kw = _long_call(B=2, T=512, d=8, h=4)
    call = _args.normalize(x, w, w, w, w, **kw)
    need = sum(np.prod(f, dtype=object) * n
               for _, _, f, n in _args.plan(call, want_weights=True, keep=True))
    # The core's call (weights included) fits; the trace's scores do not.
    monkeypatch.setattr(_args, "_memory_limit_bytes", int(need))
    with pytest.raises(MemoryError, match=r"the trace's raw_scores and scores needs "
                                          r"2\*B\*h\*T_q\*T_k = 2\*2\*4\*512\*512"):
        mhattn.trace(x, w, w, w, w, **kw)


def test_check_prototype_checks_memory_before_drawing_trials(monkeypatch):
    from mhattn.learn import checker

    def drawn(*a, **kw):
        raise AssertionError("trials were drawn before the memory check")
    monkeypatch.setattr(checker, "_trials", drawn)
    monkeypatch.setattr(_args, "_memory_limit_bytes", 1 << 30)
    with pytest.raises(MemoryError, match=r"trials=100000000 needs"):
        mhattn.check_prototype(lambda *a: None, trials=10 ** 8)


# --- item 10: torch tensors in the autograd graph, ambiguous masks --------------
def test_tensor_requiring_grad_names_the_argument():
    torch = pytest.importorskip("torch")
    xt = torch.tensor(X, requires_grad=True)
    wt = torch.tensor(W, requires_grad=True)
    for args, kw, name in [((xt, W, W, W), {}, "x"), ((X, wt, W, W), {}, "w_q"),
                           ((X, [torch.tensor(WL[0], requires_grad=True), WL[1]], WL, WL),
                            {}, "w_q[0]"),
                           ((X, W, W, W), dict(mask=torch.ones(3, 3, requires_grad=True)),
                            "mask")]:
        if isinstance(args[1], list):
            call = lambda: mhattn.multi_head_attention(*args, **kw)   # noqa: E731
        else:
            call = lambda: mhattn.multi_head_attention(*args, num_heads=2, **kw)  # noqa: E731
        with pytest.raises(TypeError, match="^" + re.escape(name) + r": .*\.detach\(\)"):
            call()
    # Detached, the same tensors are read as arrays.
    out = mhattn.multi_head_attention(xt.detach(), wt.detach(), W, W, num_heads=2)
    np.testing.assert_array_equal(out, mhattn.multi_head_attention(X, W, W, W, num_heads=2))


XB = rng.standard_normal((2, 2, 4))     # B = T_q = 2
AMBIGUOUS = [np.ones((2, 2, 2), bool),  # B = h: (h, Tq, Tk) or Keras (B, Tq, Tk)?
             np.zeros((2, 2)),          # B = Tq: (Tq, Tk) or HF (B, Tk)?
             np.ones((2, 1, 2), bool), np.ones((2, 2, 1), bool), np.zeros((2, 1))]


@pytest.mark.parametrize("mask", AMBIGUOUS, ids=lambda m: str(m.shape))
@pytest.mark.parametrize("entry", ["forward", "grad", "trace", "layer"])
def test_ambiguous_masks_raise(mask, entry):
    fn = ENTRY_POINTS[entry]
    # The fast branch declines them, so that the full one refuses them.
    assert _core.fast(XB, W, W, W, None, 2, None, None, None, False, mask, False, None,
                      None, None, None, None, None) is None
    with pytest.raises(ValueError, match=r"^mask: shape .* is ambiguous.*mask\[None\]"):
        if entry == "grad":
            mhattn.multi_head_attention_grad(np.ones((2, 2, 4)), XB, W, W, W, num_heads=2,
                                             mask=mask)
        elif entry == "layer":
            fn(XB, W.reshape(4, 2, 2).transpose(1, 0, 2), W.reshape(4, 2, 2).transpose(1, 0, 2),
               W.reshape(4, 2, 2).transpose(1, 0, 2), mask=mask)
        else:
            fn(XB, W, W, W, num_heads=2, mask=mask)


@pytest.mark.parametrize("mask,meaning", [
    (np.ones((2, 2, 2), bool)[:, None], "per batch"), (np.ones((2, 2, 2), bool)[None], "per head"),
    (np.zeros((2, 2))[None], "shared"), (np.zeros((2, 2))[:, None, None, :], "padding")])
def test_the_suggested_rewrites_are_accepted(mask, meaning):
    out = mhattn.multi_head_attention(XB, W, W, W, num_heads=2, mask=mask)
    want = mhattn.reference.multi_head_attention(XB, W, W, W, num_heads=2, mask=mask)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


def test_unambiguous_masks_are_left_alone():
    x = rng.standard_normal((3, 2, 4))   # B = 3, h = 2, T_q = 2
    for m in (np.ones((2, 2, 2), bool), np.zeros((2, 2)), np.zeros((3, 1, 2, 2))):
        mhattn.multi_head_attention(x, W, W, W, num_heads=2, mask=m)
    x1 = rng.standard_normal((1, 2, 4))  # B = 1: both readings agree
    mhattn.multi_head_attention(x1, W, W, W, num_heads=2, mask=np.zeros((2, 2)))
