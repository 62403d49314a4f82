"""Half precision no worse than PyTorch in the same dtype (issue 36).

For float16 and bfloat16, on the same inputs already rounded to the dtype,
mhattn's largest error against the float64 reference
(``mhattn.reference`` on those very inputs) is at most PyTorch's, on CPU:

- attention on projected tensors: ``mhattn.attention`` against
  ``F.scaled_dot_product_attention`` in the dtype, GQA both through
  ``enable_gqa`` and through key/value heads repeated by hand;
- the whole layer: ``mhattn.multi_head_attention`` against
  ``nn.MultiheadAttention`` in the dtype (its fast path, need_weights=False
  under no_grad, and its weights path), and against the layer PyTorch users
  write for GQA and d_v != d_k (``F.linear`` projections, SDPA, ``F.linear``).

Errors are max |result - reference| over all elements (absolute: the
references' magnitudes are the same for both sides).  Equal errors pass:
at these sizes PyTorch also accumulates in float32 and rounds once, and the
largest error of both is then the same rounding of the same element.  Every
case also holds mhattn to the documented bound (``half_bound``), and checks
that PyTorch's error is not zero, so that "<=" compares something.

Every case runs on each ISA path this machine has (the ``isa`` fixture).
A dtype or op that PyTorch cannot run on CPU is skipped with its error.
"""
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
F = torch.nn.functional

import mhattn  # noqa: E402
from mhattn import reference as R  # noqa: E402

from test_half_dtypes import BF16, F16, assert_within  # noqa: E402

HALVES = {"float16": (F16, torch.float16), "bfloat16": (BF16, torch.bfloat16)}
SEEDS = [0, 1, 2]


def rounded(dt, *arrays):
    """Each array rounded (to nearest even) into the half dtype."""
    return [None if a is None else np.asarray(a).astype(dt) for a in arrays]


def tensor(a, tdt):
    """A half NumPy array as a torch tensor of the same values (exact)."""
    if a.dtype == bool:
        return torch.from_numpy(np.ascontiguousarray(a))
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(tdt)


def array(t):
    """A torch result as float64 (every half value is exact in float64)."""
    return t.detach().to(torch.float64).numpy()


def max_err(got, ref):
    return float(np.abs(np.asarray(got, np.float64) - ref).max())


def run_torch(fn):
    """fn() under no_grad, or a skip naming what PyTorch cannot do on CPU."""
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch cannot run this on CPU: {str(e).splitlines()[0]}")


def assert_no_worse(ours, theirs, ref, what):
    e_ours, e_theirs = max_err(ours, ref), max_err(theirs, ref)
    assert e_theirs > 0, f"{what}: torch is exact here, the comparison says nothing"
    assert e_ours <= e_theirs, f"{what}: mhattn's error {e_ours:.4g} > torch's {e_theirs:.4g}"


# --- attention on projected tensors -------------------------------------------
# Each case: (B, H, G, T_q, T_k, d_k, d_v) and the options; masks are made
# per seed below.
SDPA_CASES = {
    "plain": dict(shape=(2, 4, 4, 13, 13, 8, 8)),
    "gqa_enable": dict(shape=(2, 4, 2, 13, 13, 8, 8), gqa="enable"),
    "gqa_repeat": dict(shape=(2, 4, 2, 13, 13, 8, 8), gqa="repeat"),
    "causal": dict(shape=(2, 4, 4, 13, 13, 8, 8), causal=True),
    "gqa_causal": dict(shape=(1, 8, 2, 17, 17, 16, 16), gqa="enable", causal=True),
    "bool_mask": dict(shape=(2, 4, 4, 11, 15, 8, 8), mask="bool"),
    "float_mask": dict(shape=(2, 4, 2, 11, 15, 8, 8), gqa="enable", mask="float"),
    "dv_ne_dk_odd": dict(shape=(2, 3, 3, 9, 11, 5, 3)),
    "odd_causal_gqa": dict(shape=(1, 6, 3, 7, 7, 7, 9), gqa="repeat", causal=True),
    "long": dict(shape=(1, 2, 2, 300, 300, 64, 64), causal=True),
}


def sdpa_inputs(case, dt, seed):
    c = SDPA_CASES[case]
    B, H, G, Tq, Tk, dk, dv = c["shape"]
    r = np.random.default_rng([seed, list(SDPA_CASES).index(case)])
    q, k, v = rounded(dt, r.standard_normal((B, H, Tq, dk)), r.standard_normal((B, G, Tk, dk)),
                      r.standard_normal((B, G, Tk, dv)))
    mask = None
    if c.get("mask") == "bool":
        mask = r.random((B, 1, Tq, Tk)) < 0.7          # True = may attend, as in SDPA
        mask[..., 0] = True                             # SDPA gives NaN for an empty row
    elif c.get("mask") == "float":
        mask = rounded(dt, 2.0 * r.standard_normal((1, H, Tq, Tk)))[0]
    return (q, k, v), mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", list(SDPA_CASES))
@pytest.mark.parametrize("dtname", list(HALVES))
def test_attention_no_worse_than_sdpa(isa, dtname, case, seed):
    dt, tdt = HALVES[dtname]
    c = SDPA_CASES[case]
    (q, k, v), mask = sdpa_inputs(case, dt, seed)
    causal = c.get("causal", False)
    ref = R.projected_attention(q, k, v, mask=mask, causal=causal)[0]
    ours = mhattn.attention(q, k, v, mask=mask, causal=causal)
    assert ours.dtype == dt
    assert_within(ours, ref, dt, f"{case} seed {seed}")

    H, G = q.shape[1], k.shape[1]
    tq, tk, tv = (tensor(a, tdt) for a in (q, k, v))
    if c.get("gqa") == "repeat":
        tk, tv = tk.repeat_interleave(H // G, dim=1), tv.repeat_interleave(H // G, dim=1)
    tmask = None if mask is None else tensor(mask, tdt)
    # T_q == T_k wherever causal: SDPA's top-left is_causal is mhattn's bottom-right
    assert not causal or q.shape[2] == k.shape[2]
    theirs = run_torch(lambda: F.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=tmask, is_causal=causal, enable_gqa=c.get("gqa") == "enable"))
    assert theirs.dtype == tdt
    assert_no_worse(ours, array(theirs), ref, f"{dtname} {case} seed {seed}")


# --- the whole layer: nn.MultiheadAttention ---------------------------------
# (E, h, T_q, T_k, kdim, vdim, bias) and the options.
MHA_CASES = {
    "plain": dict(E=16, h=4, T=(9, 9)),
    "causal": dict(E=16, h=4, T=(12, 12), causal=True),
    "no_bias_causal": dict(E=32, h=4, T=(10, 10), causal=True, bias=False),
    "bool_mask": dict(E=16, h=2, T=(9, 9), mask="bool"),
    "float_mask": dict(E=16, h=4, T=(9, 9), mask="float"),
    "odd_widths": dict(E=15, h=3, T=(7, 7)),                       # d = 5
    "cross_kdim_vdim": dict(E=12, h=4, T=(5, 11), kdim=7, vdim=9, mask="bool"),
    "longer": dict(E=64, h=4, T=(96, 96), causal=True),
}


def make_mha(case, dt, tdt, seed):
    """nn.MultiheadAttention in tdt with random biases, inputs rounded to dt,
    and mhattn's arguments for the same layer."""
    c = MHA_CASES[case]
    E, h, (Tq, Tk) = c["E"], c["h"], c["T"]
    kdim, vdim = c.get("kdim", E), c.get("vdim", E)
    bias, causal = c.get("bias", True), c.get("causal", False)
    r = np.random.default_rng([seed, list(MHA_CASES).index(case)])
    torch.manual_seed(1000 * seed + list(MHA_CASES).index(case))
    try:
        module = torch.nn.MultiheadAttention(E, h, bias=bias, kdim=kdim, vdim=vdim,
                                             batch_first=True, dtype=tdt).eval()
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch cannot build nn.MultiheadAttention in {tdt} on CPU: {e}")
    with torch.no_grad():
        if bias:
            module.in_proj_bias.copy_(0.5 * torch.randn(3 * E))
            module.out_proj.bias.copy_(0.5 * torch.randn(E))
    B = 2
    x = rounded(dt, r.standard_normal((B, Tq, E)))[0]
    if "kdim" in c:                              # cross-attention: key, value of their own
        key, value = rounded(dt, r.standard_normal((B, Tk, kdim)),
                             r.standard_normal((B, Tk, vdim)))
    else:                                        # self-attention
        assert Tq == Tk
        key = value = x

    # nn.Linear keeps (out, in): mhattn's w = weight.T.  A packed in_proj
    # (kdim == vdim == E) holds W_q, W_k, W_v as its row blocks.
    def w(t):
        return array(t).T.astype(dt)
    if module._qkv_same_embed_dim:
        W = module.in_proj_weight
        w_q, w_k, w_v = w(W[:E]), w(W[E:2 * E]), w(W[2 * E:])
    else:
        w_q, w_k, w_v = w(module.q_proj_weight), w(module.k_proj_weight), w(module.v_proj_weight)
    kw = dict(num_heads=h, causal=causal)
    if bias:
        b = array(module.in_proj_bias).astype(dt)
        kw.update(b_q=b[:E], b_k=b[E:2 * E], b_v=b[2 * E:],
                  b_o=array(module.out_proj.bias).astype(dt))
    if key is not x:
        kw.update(key=key, value=value)
    args = (x, w_q, w_k, w_v, w(module.out_proj.weight))

    # the masks: mhattn's bool mask is True = may attend, nn.MultiheadAttention's
    # True = may not; a float mask is added by both.
    am = None
    if c.get("mask") == "bool":
        mask = r.random((Tq, Tk)) < 0.7
        mask[:, 0] = True
        kw["mask"], am = mask, torch.from_numpy(~mask)
    elif c.get("mask") == "float":
        mask = rounded(dt, 2.0 * r.standard_normal((B, h, Tq, Tk)))[0]
        kw["mask"], am = mask, tensor(mask.reshape(B * h, Tq, Tk), tdt)
    if causal:
        am = torch.from_numpy(~np.tril(np.ones((Tq, Tk), bool)))
    t_in = [tensor(a, tdt) for a in (x, key, value)]
    return module, t_in, am, args, kw


@pytest.mark.parametrize("need_weights", [False, True], ids=["fast", "weights"])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", list(MHA_CASES))
@pytest.mark.parametrize("dtname", list(HALVES))
def test_layer_no_worse_than_multihead_attention(isa, dtname, case, seed, need_weights):
    dt, tdt = HALVES[dtname]
    module, (tx, tkey, tvalue), am, args, kw = make_mha(case, dt, tdt, seed)
    ref = R.multi_head_attention(*args, **kw)
    ours = mhattn.multi_head_attention(*args, **kw)
    assert ours.dtype == dt
    assert_within(ours, ref, dt, f"{case} seed {seed}")
    theirs, _ = run_torch(lambda: module(tx, tkey, tvalue, attn_mask=am,
                                         need_weights=need_weights,
                                         is_causal=kw["causal"]))
    assert theirs.dtype == tdt
    assert_no_worse(ours, array(theirs), ref, f"{dtname} {case} seed {seed}")


# --- the whole layer: projections + SDPA (GQA, d_v != d_k) ------------------
# (d_in, H, G, d_k, d_v, d_out, T) and the options.
LAYER_CASES = {
    "gqa": dict(shape=(32, 8, 2, 4, 4, 32, 11)),
    "gqa_causal": dict(shape=(32, 4, 2, 8, 8, 32, 13), causal=True),
    "dv_ne_dk_odd": dict(shape=(13, 3, 3, 5, 7, 11, 9), causal=True),
    "gqa_float_mask": dict(shape=(24, 6, 3, 4, 6, 10, 8), mask="float"),
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", list(LAYER_CASES))
@pytest.mark.parametrize("dtname", list(HALVES))
def test_layer_no_worse_than_projections_and_sdpa(isa, dtname, case, seed):
    dt, tdt = HALVES[dtname]
    c = LAYER_CASES[case]
    din, H, G, dk, dv, dout, T = c["shape"]
    causal = c.get("causal", False)
    r = np.random.default_rng([seed, list(LAYER_CASES).index(case)])
    s = din ** -0.5
    x, w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o = rounded(
        dt, r.standard_normal((2, T, din)), s * r.standard_normal((din, H * dk)),
        s * r.standard_normal((din, G * dk)), s * r.standard_normal((din, G * dv)),
        (H * dv) ** -0.5 * r.standard_normal((H * dv, dout)), 0.3 * r.standard_normal(H * dk),
        0.3 * r.standard_normal(G * dk), 0.3 * r.standard_normal(G * dv),
        0.3 * r.standard_normal(dout))
    mask = rounded(dt, 2.0 * r.standard_normal((2, H, T, T)))[0] \
        if c.get("mask") == "float" else None
    args = (x, w_q, w_k, w_v, w_o)
    kw = dict(num_heads=H, num_kv_heads=G, b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o, causal=causal,
              mask=mask)
    ref = R.multi_head_attention(*args, **kw)
    ours = mhattn.multi_head_attention(*args, **kw)
    assert ours.dtype == dt
    assert_within(ours, ref, dt, f"{case} seed {seed}")

    def torch_layer():
        tx = tensor(x, tdt)

        def heads(t, n, d):                      # (B, T, n*d) -> (B, n, T, d)
            return t.reshape(2, T, n, d).transpose(1, 2)
        # F.linear(x, W, b) = x W^T + b: W is mhattn's w transposed
        lin = [F.linear(tx, tensor(w, tdt).T, tensor(b, tdt))
               for w, b in ((w_q, b_q), (w_k, b_k), (w_v, b_v))]
        q, k, v = heads(lin[0], H, dk), heads(lin[1], G, dk), heads(lin[2], G, dv)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if mask is None else tensor(mask, tdt), is_causal=causal,
            enable_gqa=True)
        return F.linear(o.transpose(1, 2).reshape(2, T, H * dv), tensor(w_o, tdt).T,
                        tensor(b_o, tdt))
    theirs = run_torch(torch_layer)
    assert theirs.dtype == tdt
    assert_no_worse(ours, array(theirs), ref, f"{dtname} {case} seed {seed}")
