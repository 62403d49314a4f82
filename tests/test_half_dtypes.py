"""Half precision inputs (issue 36): float16 and ml_dtypes.bfloat16.

What a half call promises, and what is held here on every ISA path:
- its results are the float32 call's on the widened inputs, each rounded
  once to nearest even into the inputs' dtype (bitwise; the log-sum-exp
  stays float32);
- so against the float64 reference on the same (already half) inputs each
  element is within the documented bound: half an ulp of the half format
  of the exact value (2^-11 relative for float16, 2^-8 for bfloat16) plus
  float32's error, bounded by 2^-16 of the largest magnitude of the result
  (``half_bound`` below; the README's Guarantees table says the same);
- the gradients likewise, against the float64 gradients;
- the same bits for any thread count;
- the dtype rules: one half dtype for the inputs that carry numbers, masks
  of any float dtype, other 2-byte types refused by name.
"""
import subprocess
import sys

import numpy as np
import pytest

import mhattn
from mhattn import reference

from conftest import child_env

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
HALVES = {"float16": F16, "bfloat16": BF16}
# the fraction bits of each format: half an ulp is 2^-(bits+1) relative
FRACTION_BITS = {F16: 10, BF16: 7}
# float32's error in a result, relative to the result's largest magnitude
F32_SHARE = 2.0 ** -16


def half_bound(ref: np.ndarray, dt: np.dtype) -> np.ndarray:
    """The documented error bound of each element of a half result whose
    exact (float64) value is ``ref``."""
    ref = np.asarray(ref, np.float64)
    top = float(np.abs(ref).max()) if ref.size else 0.0
    # float16 subnormals: the spacing below 2^-14 is 2^-24
    floor = 2.0 ** -25 if dt == F16 else 0.0
    return np.abs(ref) * 2.0 ** -(FRACTION_BITS[dt] + 1) + F32_SHARE * top + floor


def assert_within(got, ref, dt, what=""):
    assert got.dtype == dt, (what, got.dtype)
    g = got.astype(np.float64)
    err = np.abs(g - ref)
    bound = half_bound(ref, dt)
    worst = np.unravel_index(np.argmax(err - bound), err.shape) if err.size else None
    assert (err <= bound).all(), (f"{what}: error {err[worst]:.3g} > bound {bound[worst]:.3g} "
                                  f"at {worst} (ref {ref[worst]:.6g}, got {g[worst]:.6g})")


def to(dt, *arrays):
    return [None if a is None else np.asarray(a).astype(dt) for a in arrays]


def widened(*arrays):
    return [None if a is None else a.astype(np.float32) for a in arrays]


# --- the grid of calls ------------------------------------------------------
# Each case: sizes, and the keywords beyond x and the weights. Masks,
# sinks, ALiBi and RoPE tables stay float64 (any float dtype is allowed).
def _cases():
    r = np.random.default_rng(5)
    T = 9
    mask_b = r.random((T, T)) < 0.7
    mask_f = np.where(r.random((2, T, T)) < 0.8, 0.0, -np.inf) + r.standard_normal((2, T, T))
    return {
        "plain": dict(H=2, G=2),
        "gqa_causal": dict(H=4, G=2, kw=dict(causal=True)),
        "bool_mask": dict(H=2, G=2, kw=dict(mask=mask_b)),
        "float64_mask": dict(H=2, G=2, kw=dict(mask=mask_f[:, None])),
        "window_softcap": dict(H=2, G=1, kw=dict(causal=True, window=(3, 0), softcap=5.0)),
        "rope_norms": dict(H=2, G=2, kw=dict(rope=mhattn.RoPE(), q_norm=np.ones(4) * 1.5,
                                             k_norm=np.ones(4) * 0.5)),
        "sinks_alibi": dict(H=2, G=2, kw=dict(sinks=np.array([0.5, -1.0]),
                                              alibi_slopes=np.array([0.25, 0.5]))),
        "key_lengths": dict(H=2, G=2, kw=dict(key_lengths=np.array([4, 9]))),
        "dv_ne_dk_odd": dict(H=3, G=3, dk=5, dv=3, din=7),
        "packed_sequences": dict(H=2, G=2, B=1, kw=dict(cu_seqlens=np.array([0, 4, 9]),
                                                        causal=True)),
    }


CASES = _cases()


def make_call(name, dt, seed=0):
    c = CASES[name]
    H, G = c["H"], c["G"]
    dk, dv, din = c.get("dk", 4), c.get("dv", 4), c.get("din", 8)
    B, T = c.get("B", 2), 9
    r = np.random.default_rng(seed)
    x = r.standard_normal((B, T, din)) if B > 1 or "cu_seqlens" not in c.get("kw", {}) \
        else r.standard_normal((T, din))
    if "cu_seqlens" in c.get("kw", {}):
        x = r.standard_normal((T, din))
    s = 1 / np.sqrt(din)
    w_q = r.standard_normal((din, H * dk)) * s
    w_k = r.standard_normal((din, G * dk)) * s
    w_v = r.standard_normal((din, G * dv)) * s
    w_o = r.standard_normal((H * dv, 6)) * 0.5
    b_q = r.standard_normal(H * dk) * 0.1
    x, w_q, w_k, w_v, w_o, b_q = to(dt, x, w_q, w_k, w_v, w_o, b_q)
    kw = dict(c.get("kw", {}), num_heads=H, num_kv_heads=G, b_q=b_q)
    return (x, w_q, w_k, w_v, w_o), kw


@pytest.mark.parametrize("dtname", list(HALVES))
@pytest.mark.parametrize("case", list(CASES))
def test_forward_within_bound_and_rounded_once(isa, case, dtname):
    dt = HALVES[dtname]
    args, kw = make_call(case, dt)
    out, weights = mhattn.multi_head_attention(*args, return_weights=True, **kw)
    # rounded once from the float32 call on the widened inputs
    f32_kw = dict(kw, b_q=kw["b_q"].astype(np.float32))
    o32, w32 = mhattn.multi_head_attention(*widened(*args), return_weights=True, **f32_kw)
    assert out.dtype == dt and weights.dtype == dt
    np.testing.assert_array_equal(out.view(np.uint16), o32.astype(dt).view(np.uint16))
    np.testing.assert_array_equal(weights.view(np.uint16), w32.astype(dt).view(np.uint16))
    # the documented bound against the float64 reference on the same inputs
    ref, ref_w = reference.multi_head_attention(*args, return_weights=True, **kw)
    assert ref.dtype == np.float64
    assert_within(out, ref, dt, f"{case} out")
    assert_within(weights, ref_w, dt, f"{case} weights")


def _grad_oracle(args, kw, g):
    """The float64 gradients of the same half inputs (the float64 path is
    held to finite differences by tests/test_grad.py)."""
    f64 = [a.astype(np.float64) for a in args]
    kw64 = dict(kw, b_q=kw["b_q"].astype(np.float64))
    return mhattn.multi_head_attention_grad(g.astype(np.float64), *f64, **kw64)


@pytest.mark.parametrize("dtname", list(HALVES))
@pytest.mark.parametrize("case", ["plain", "gqa_causal", "float64_mask", "rope_norms",
                                  "sinks_alibi", "dv_ne_dk_odd", "packed_sequences"])
def test_gradients_within_bound(isa, case, dtname):
    dt = HALVES[dtname]
    args, kw = make_call(case, dt, seed=3)
    out = mhattn.multi_head_attention(*args, **kw)
    g = np.random.default_rng(9).standard_normal(out.shape).astype(dt)
    grads = mhattn.multi_head_attention_grad(g, *args, **kw)
    want = _grad_oracle(args, kw, g)
    assert set(grads) == set(want)
    for name, a in grads.items():
        if name in ("q_norm", "k_norm", "sinks"):   # given as float64: float32
            assert a.dtype == np.float32, name
            np.testing.assert_allclose(a, want[name], rtol=1e-4, atol=1e-4 * np.abs(
                want[name]).max())
            continue
        assert_within(a, want[name], dt, f"{case} d{name}")


@pytest.mark.parametrize("dtname", list(HALVES))
def test_attention_and_merge(isa, dtname):
    dt = HALVES[dtname]
    r = np.random.default_rng(2)
    q, k, v = to(dt, r.standard_normal((2, 4, 7, 8)), r.standard_normal((2, 2, 11, 8)),
                 r.standard_normal((2, 2, 11, 5)))
    out, lse = mhattn.attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == dt and lse.dtype == np.float32
    ref, _, ref_lse = reference.projected_attention(q, k, v, causal=True)
    assert_within(out, ref, dt, "attention out")
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6)
    # bthd too
    qt, kt, vt = (np.ascontiguousarray(a.swapaxes(1, 2)) for a in (q, k, v))
    out_t = mhattn.attention(qt, kt, vt, causal=True, layout="bthd")
    np.testing.assert_array_equal(out_t.view(np.uint16),
                                  out.swapaxes(1, 2).view(np.uint16))
    # merged halves of the keys: one softmax, rounded once at the end
    a = mhattn.attention(q, k[:, :, :5], v[:, :, :5], return_lse=True)
    b = mhattn.attention(q, k[:, :, 5:], v[:, :, 5:], return_lse=True)
    m, ml = mhattn.merge_attention([a[0], b[0]], [a[1], b[1]])
    assert m.dtype == dt and ml.dtype == np.float32
    whole = reference.projected_attention(q, k, v)[0]
    # each part was rounded to half before the merge, the merged out once
    # more: within one ulp of the largest magnitude
    err = np.abs(m.astype(np.float64) - whole)
    assert err.max() <= 2.0 ** -FRACTION_BITS[dt] * np.abs(whole).max()
    # gradients in q's dtype, within bound of the float64 ones
    g = r.standard_normal(out.shape).astype(dt)
    want = mhattn.attention_grad(g.astype(np.float64), *(a.astype(np.float64)
                                                         for a in (q, k, v)), causal=True)
    grads = mhattn.attention_grad(g, q, k, v, causal=True)   # out recomputed in float32
    for name in "qkv":
        assert_within(grads[name], want[name], dt, f"d{name}")
    # with the forward's half out given, D = rowsum(dO * O) reads O rounded
    # to half (as FlashAttention's bf16 backward does): the bound is then one
    # ulp of the gradient's largest magnitude
    grads = mhattn.attention_grad(g, q, k, v, causal=True, out=out, lse=lse)
    for name in "qkv":
        assert grads[name].dtype == dt
        err = np.abs(grads[name].astype(np.float64) - want[name])
        assert err.max() <= 2.0 ** -FRACTION_BITS[dt] * np.abs(want[name]).max(), name


def test_bits_do_not_depend_on_the_thread_count():
    args, kw = make_call("gqa_causal", BF16)
    before = mhattn.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            mhattn.set_num_threads(n)
            out = mhattn.multi_head_attention(*args, **kw)
            g = mhattn.multi_head_attention_grad(np.ones(out.shape, BF16), *args, **kw)
            outs.append((out.view(np.uint16).copy(), g["x"].view(np.uint16).copy()))
        for o, gx in outs[1:]:
            np.testing.assert_array_equal(o, outs[0][0])
            np.testing.assert_array_equal(gx, outs[0][1])
    finally:
        mhattn.set_num_threads(before)


def test_inputs_are_not_modified():
    args, kw = make_call("rope_norms", F16)
    before = [a.copy() for a in args]
    mhattn.multi_head_attention_grad(np.ones((2, 9, 6), F16), *args, **kw)
    for a, b in zip(args, before):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


# --- the dtype rules ---------------------------------------------------------

def test_numbers_share_one_half_dtype():
    args, kw = make_call("plain", F16)
    x, w_q, w_k, w_v, w_o = args
    with pytest.raises(TypeError, match=r"w_v: dtype bfloat16 does not match x's float16"):
        mhattn.multi_head_attention(x, w_q, w_k, w_v.astype(BF16), w_o, **kw)
    with pytest.raises(TypeError, match=r"w_o: dtype float32 does not match x's float16"):
        mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o.astype(np.float32), **kw)
    with pytest.raises(TypeError, match=r"b_q\[0\]: dtype float64 does not match x's float16"):
        mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, **dict(kw, b_q=np.zeros(8)))
    # the first half argument is named whatever comes first
    with pytest.raises(TypeError, match=r"x: dtype float64 does not match w_q's float16"):
        mhattn.multi_head_attention(x.astype(np.float64), w_q, w_k, w_v, w_o, **kw)
    q = np.zeros((1, 2, 3, 4), F16)
    with pytest.raises(TypeError, match=r"k: dtype float32 does not match q's float16"):
        mhattn.attention(q, q.astype(np.float32), q)
    with pytest.raises(TypeError, match=r"outs\[1\]: dtype bfloat16 does not match"):
        mhattn.merge_attention([q, q.astype(BF16)], [np.zeros((1, 2, 3))] * 2)


def test_masks_of_any_float_dtype():
    args, kw = make_call("float64_mask", BF16)
    m64 = kw["mask"]
    outs = [mhattn.multi_head_attention(*args, **dict(kw, mask=m64.astype(dt)))
            for dt in (np.float64, np.float32, F16, BF16)]
    # the mask's values are exact in float16 and bfloat16? not all: compare
    # each to the call with its own mask widened to float64
    for dt, out in zip((np.float64, np.float32, F16, BF16), outs):
        again = mhattn.multi_head_attention(
            *args, **dict(kw, mask=m64.astype(dt).astype(np.float64)))
        np.testing.assert_array_equal(out.view(np.uint16), again.view(np.uint16))


def test_out_and_grad_out_of_another_half_dtype_are_refused():
    r = np.random.default_rng(0)
    q, k, v = to(F16, *(r.standard_normal((1, 2, 3, 4)) for _ in range(3)))
    out, lse = mhattn.attention(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match=r"^out: dtype bfloat16 does not match q's float16"):
        mhattn.attention_grad(np.ones_like(out), q, k, v, out=out.astype(BF16), lse=lse)
    with pytest.raises(TypeError, match=r"^grad_out: dtype bfloat16 does not match"):
        mhattn.attention_grad(np.ones(out.shape, BF16), q, k, v)
    args, kw = make_call("plain", F16)
    o, ctx = mhattn.multi_head_attention(*args, return_context=True, **kw)
    with pytest.raises(TypeError, match=r"^grad_out: dtype bfloat16 does not match the "
                                        r"forward's output dtype float16"):
        mhattn.backward(np.ones(o.shape, BF16), ctx)
    # a float32 / float64 grad_out is fine: it carries the loss, not the call's numbers
    g32 = mhattn.backward(np.ones(o.shape, np.float32), ctx)
    g16 = mhattn.backward(np.ones(o.shape, F16), ctx)
    np.testing.assert_array_equal(g32["x"].view(np.uint16), g16["x"].view(np.uint16))


@pytest.mark.parametrize("dtype, words", [
    (np.dtype("V2"), "2-byte, not a float mhattn knows"),
    (np.dtype([("a", np.int8), ("b", np.int8)]), "structured"),
])
def test_other_two_byte_dtypes_are_refused_by_name(dtype, words):
    x = np.zeros((3, 4), dtype)
    w = np.zeros((4, 4), F16)
    with pytest.raises(TypeError) as e:
        mhattn.multi_head_attention(x, w, w, w, num_heads=2)
    msg = str(e.value)
    assert msg.startswith("x: dtype") and words in msg
    assert "float16, bfloat16 (ml_dtypes), float32 or float64" in msg


def test_float8_is_refused_with_what_is_accepted():
    x = np.zeros((3, 4), ml_dtypes.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"^q: dtype float8_e4m3fn .* float16, bfloat16"):
        mhattn.attention(x, x, x)


# --- bad values ------------------------------------------------------------

@pytest.mark.parametrize("dtname", list(HALVES))
def test_nan_and_inf_follow_the_float32_rules(dtname):
    dt = HALVES[dtname]
    args, kw = make_call("plain", dt)
    x = args[0].copy()
    x[0, 2, 1] = np.nan
    x[1, 4, 0] = np.inf
    out = mhattn.multi_head_attention(x, *args[1:], **kw)
    o32 = mhattn.multi_head_attention(*widened(x, *args[1:]),
                                      **dict(kw, b_q=kw["b_q"].astype(np.float32)))
    np.testing.assert_array_equal(np.isnan(out.astype(np.float32)), np.isnan(o32))
    np.testing.assert_array_equal(out.view(np.uint16)[~np.isnan(o32)],
                                  o32.astype(dt).view(np.uint16)[~np.isnan(o32)])


def test_results_past_the_half_range_are_inf():
    args, kw = make_call("plain", F16)
    x, w_q, w_k, w_v, w_o = args
    big = np.clip(w_o.astype(np.float32) * 1e5, -6e4, 6e4).astype(F16)   # outputs > 65504
    with np.errstate(over="ignore"):
        out = mhattn.multi_head_attention(x, w_q, w_k, w_v, big, **kw)
        o32 = mhattn.multi_head_attention(*widened(x, w_q, w_k, w_v, big),
                                          **dict(kw, b_q=kw["b_q"].astype(np.float32)))
    assert np.abs(o32).max() > 65520 and np.isinf(out).any()
    np.testing.assert_array_equal(np.isinf(out), np.abs(o32) >= 65520)
    np.testing.assert_array_equal(np.sign(out[np.isinf(out)]), np.sign(o32[np.isinf(out)]))


def test_ml_dtypes_is_not_imported_by_mhattn():
    code = ("import sys, numpy as np, mhattn\n"
            "x, w = np.ones((3, 4), np.float16), np.ones((4, 4), np.float16)\n"
            "out = mhattn.multi_head_attention(x, w, w, w, num_heads=2)\n"
            "assert out.dtype == np.float16\n"
            "print('ml_dtypes' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=child_env(), timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"
