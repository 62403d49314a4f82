"""Gradients from the C backward pass: central finite differences in float64
for every feature, the context form, forms of the results, determinism over
thread counts and instruction sets, float32 against float64, bad input."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mhattn
from mhattn import _C

# Central differences of L = sum(out * R) with step 1e-6: truncation error
# ~eps^2 |L'''| ~ 1e-12 and rounding ~1e-16 |L| / eps ~ 1e-10, so 1e-7 of
# the gradients' scale is a margin of 100 or more (observed: ~1e-9). The
# scale is the largest gradient of the call, not of each array: some are
# exactly zero in exact arithmetic (b_k: softmax ignores a constant added to
# a row's scores), and both sides then hold only rounding noise.
FD_EPS = 1e-6
FD_RTOL = 1e-7

POSITIONAL = ("x", "w_q", "w_k", "w_v", "w_o")
DIFFERENTIABLE = ("x", "key", "value", "w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")


def split(params):
    """params (arrays, lists and options by name) -> (args, keywords)."""
    p = dict(params)
    args = [p.pop(n, None) for n in POSITIONAL]
    return args, p


def forward(params, **extra):
    args, kw = split(params)
    return mhattn.multi_head_attention(*args, **kw, **extra)


def grads_of(params, R):
    args, kw = split(params)
    return mhattn.multi_head_attention_grad(R, *args, **kw)


def fd_grads(params, R, names):
    """Central differences of sum(out * R) for every element of every array
    argument in names; a per-head list is perturbed one position at a time,
    so a shared entry gets one gradient per position."""
    def loss(p):
        return float(np.sum(forward(p) * R))

    def fd_array(make, a):
        g = np.zeros(a.shape)
        for idx in np.ndindex(a.shape):
            ap = a.copy()
            ap[idx] += FD_EPS
            am = a.copy()
            am[idx] -= FD_EPS
            g[idx] = (loss(make(ap)) - loss(make(am))) / (2 * FD_EPS)
        return g

    out = {}
    for name in names:
        val = params[name]
        if isinstance(val, list):
            gl = []
            for i, a in enumerate(val):
                def make(ai, i=i, name=name):
                    lst = list(params[name])
                    lst[i] = ai
                    return {**params, name: lst}
                gl.append(fd_array(make, np.asarray(a, dtype=np.float64)))
            out[name] = gl
        else:
            out[name] = fd_array(lambda a, name=name: {**params, name: a},
                                 np.asarray(val, dtype=np.float64))
    return out


def as_list(g):
    return g if isinstance(g, list) else [g]


def grad_scale(grads):
    """The largest magnitude of any gradient in a dict (at least 1e-3)."""
    return max([1e-3] + [float(np.abs(a).max(initial=0.0))
                         for g in grads.values() for a in as_list(g)])


def assert_grad_close(got, want, name, scale, rtol=FD_RTOL):
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), name
        for i, (g, w) in enumerate(zip(got, want)):
            assert_grad_close(g, w, f"{name}[{i}]", scale, rtol)
        return
    assert got.shape == want.shape, (name, got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale,
                               err_msg=f"gradient of {name}")


def check_against_fd(params, rng, expect_names):
    out = forward(params)
    R = rng.standard_normal(out.shape)
    got = grads_of(params, R)
    assert list(got) == expect_names
    want = fd_grads(params, R, expect_names)
    scale = grad_scale(want)
    for name in expect_names:
        assert_grad_close(got[name], want[name], name, scale)
    return got


def rnd(rng, *shape):
    return rng.standard_normal(shape)


# --------------------------------------------------------------------------
# float64 finite differences, one configuration per feature

def cfg_plain(rng):
    return dict(x=rnd(rng, 2, 4, 5), w_q=rnd(rng, 5, 6), w_k=rnd(rng, 5, 6),
                w_v=rnd(rng, 5, 6), w_o=rnd(rng, 6, 4), num_heads=2)


def cfg_mask_bool(rng):
    p = cfg_plain(rng)
    m = rng.random((2, 1, 4, 4)) < 0.6      # broadcast over heads
    m[..., 1] = True
    return dict(p, mask=m)


def cfg_mask_float(rng):
    p = cfg_plain(rng)
    m = rnd(rng, 2, 4, 4)                   # (h, Tq, Tk), broadcast over batch
    m[0, 1, 2] = -np.inf
    m[1, :, 0] = -np.inf
    return dict(p, mask=m[None])            # (1, h, Tq, Tk): B = h is ambiguous


def cfg_causal(rng):
    return dict(cfg_plain(rng), causal=True)


def cfg_causal_tq_lt_tk(rng):
    p = cfg_plain(rng)
    return dict(p, x=rnd(rng, 2, 3, 5), key=rnd(rng, 2, 6, 5), causal=True)


def cfg_causal_tq_gt_tk(rng):
    # Tq = 6 > Tk = 3: the first three query rows see no key at all.
    p = cfg_plain(rng)
    return dict(p, x=rnd(rng, 2, 6, 5), key=rnd(rng, 2, 3, 5), causal=True)


def cfg_key_lengths(rng):
    p = cfg_plain(rng)
    return dict(p, x=rnd(rng, 3, 4, 5), key=rnd(rng, 3, 5, 5),
                value=rnd(rng, 3, 5, 5), key_lengths=np.array([5, 2, 0]))


def cfg_gqa(rng):
    return dict(x=rnd(rng, 2, 4, 5), w_q=rnd(rng, 4, 5, 2), w_k=rnd(rng, 2, 5, 2),
                w_v=rnd(rng, 2, 5, 3), w_o=rnd(rng, 12, 3), num_kv_heads=2)


def cfg_gqa_one_kv_head(rng):
    return dict(x=rnd(rng, 2, 4, 5), w_q=rnd(rng, 5, 6), w_k=rnd(rng, 5, 2),
                w_v=rnd(rng, 5, 2), w_o=rnd(rng, 6, 3), num_heads=3,
                num_kv_heads=1, causal=True)


def cfg_biases(rng):
    # b_q fused 1-D, b_k stacked (h, d), b_v a per-head list, b_o.
    return dict(x=rnd(rng, 2, 4, 5), w_q=rnd(rng, 2, 5, 3), w_k=rnd(rng, 2, 5, 3),
                w_v=rnd(rng, 2, 5, 2), w_o=rnd(rng, 4, 3), b_q=rnd(rng, 6),
                b_k=rnd(rng, 2, 3), b_v=[rnd(rng, 2), rnd(rng, 2)], b_o=rnd(rng, 3))


def cfg_ragged_shared(rng):
    # Ragged heads (widths 2, 3, 2) and one value matrix shared by heads 0, 2.
    shared = rnd(rng, 5, 2)
    return dict(x=rnd(rng, 2, 4, 5),
                w_q=[rnd(rng, 5, 2), rnd(rng, 5, 3), rnd(rng, 5, 2)],
                w_k=[rnd(rng, 5, 2), rnd(rng, 5, 3), rnd(rng, 5, 2)],
                w_v=[shared, rnd(rng, 5, 4), shared], w_o=rnd(rng, 8, 3),
                b_v=[rnd(rng, 2), rnd(rng, 4), rnd(rng, 2)])


def cfg_cross_key_value(rng):
    return dict(x=rnd(rng, 2, 3, 5), key=rnd(rng, 2, 6, 4), value=rnd(rng, 2, 6, 7),
                w_q=rnd(rng, 2, 5, 3), w_k=rnd(rng, 2, 4, 3), w_v=rnd(rng, 2, 7, 2),
                w_o=rnd(rng, 4, 5))


def cfg_cross_key_only(rng):
    # value defaults to key: 'key' carries the values' contribution too.
    return dict(x=rnd(rng, 2, 3, 5), key=rnd(rng, 2, 6, 4),
                w_q=rnd(rng, 2, 5, 3), w_k=rnd(rng, 2, 4, 3), w_v=rnd(rng, 2, 4, 2),
                w_o=rnd(rng, 4, 5))


def cfg_value_only(rng):
    # key defaults to x, value is given: 'x' carries the keys' contribution.
    return dict(x=rnd(rng, 2, 4, 5), value=rnd(rng, 2, 4, 3),
                w_q=rnd(rng, 2, 5, 3), w_k=rnd(rng, 2, 5, 3), w_v=rnd(rng, 2, 3, 2),
                w_o=rnd(rng, 4, 5), causal=True)


def cfg_unbatched(rng):
    return dict(x=rnd(rng, 4, 5), w_q=rnd(rng, 5, 6), w_k=rnd(rng, 5, 6),
                w_v=rnd(rng, 5, 6), w_o=rnd(rng, 6, 4), num_heads=3,
                mask=rng.random((4, 4)) < 0.7, b_o=rnd(rng, 4))


def cfg_fully_masked_rows(rng):
    p = cfg_cross_key_value(rng)
    m = np.ones((2, 2, 3, 6), dtype=bool)
    m[0, :, 1, :] = False                  # row 1 of item 0: no key, both heads
    m[1, 1, 2, :] = False                  # row 2 of item 1, head 1 only
    return dict(p, mask=m, b_q=rnd(rng, 2, 3), b_o=rnd(rng, 5))


def cfg_no_wo_scale(rng):
    return dict(x=rnd(rng, 2, 4, 5), w_q=rnd(rng, 5, 6), w_k=rnd(rng, 5, 6),
                w_v=rnd(rng, 5, 4), num_heads=2, scale=0.7, b_o=rnd(rng, 4))


def cfg_everything(rng):
    # Cross-attention with GQA, ragged lists, causal, a float mask, key
    # lengths and every bias at once.
    return dict(x=rnd(rng, 2, 5, 4), key=rnd(rng, 2, 7, 3), value=rnd(rng, 2, 7, 6),
                w_q=[rnd(rng, 4, 2), rnd(rng, 4, 2), rnd(rng, 4, 3), rnd(rng, 4, 3)],
                w_k=[rnd(rng, 3, 2), rnd(rng, 3, 3)], w_v=[rnd(rng, 6, 3), rnd(rng, 6, 1)],
                w_o=rnd(rng, 8, 2), num_kv_heads=2, causal=True,
                mask=rnd(rng, 1, 4, 1, 7), key_lengths=[7, 4],
                b_q=[rnd(rng, 2), rnd(rng, 2), rnd(rng, 3), rnd(rng, 3)],
                b_k=[rnd(rng, 2), rnd(rng, 3)], b_v=[rnd(rng, 3), rnd(rng, 1)],
                b_o=rnd(rng, 2))


FD_CASES = {
    "plain": cfg_plain, "mask_bool": cfg_mask_bool, "mask_float": cfg_mask_float,
    "causal": cfg_causal, "causal_tq_lt_tk": cfg_causal_tq_lt_tk,
    "causal_tq_gt_tk": cfg_causal_tq_gt_tk, "key_lengths": cfg_key_lengths,
    "gqa": cfg_gqa, "gqa_one_kv_head": cfg_gqa_one_kv_head, "biases": cfg_biases,
    "ragged_shared": cfg_ragged_shared, "cross_key_value": cfg_cross_key_value,
    "cross_key_only": cfg_cross_key_only, "value_only": cfg_value_only,
    "unbatched": cfg_unbatched,
    "fully_masked_rows": cfg_fully_masked_rows, "no_wo_scale": cfg_no_wo_scale,
    "everything": cfg_everything,
}


def expected_names(params):
    return [n for n in DIFFERENTIABLE if params.get(n) is not None]


@pytest.mark.parametrize("case", list(FD_CASES))
def test_finite_differences(case):
    rng = np.random.default_rng(sorted(FD_CASES).index(case))
    params = FD_CASES[case](rng)
    check_against_fd(params, rng, expected_names(params))


def test_shared_list_entry_gets_one_gradient_per_position():
    rng = np.random.default_rng(50)
    p = cfg_ragged_shared(rng)
    R = rnd(rng, *forward(p).shape)
    g = grads_of(p, R)["w_v"]
    assert len(g) == 3 and g[0].shape == g[2].shape == (5, 2)
    assert not np.allclose(g[0], g[2])
    # Their sum is the shared array's gradient: perturb the array itself.
    shared = p["w_v"][0]
    d = rnd(rng, *shared.shape) * 1e-6
    lp = np.sum(forward(dict(p, w_v=[shared + d, p["w_v"][1], shared + d])) * R)
    lm = np.sum(forward(dict(p, w_v=[shared - d, p["w_v"][1], shared - d])) * R)
    np.testing.assert_allclose((lp - lm) / 2, np.sum((g[0] + g[2]) * d), rtol=1e-6)


def test_key_passed_explicitly_gets_its_own_gradient():
    """key=x given explicitly is reported under 'key'; the two parts add up
    to the self-attention gradient of x (where key defaults to x)."""
    rng = np.random.default_rng(49)
    p = cfg_plain(rng)
    R = rnd(rng, *forward(p).shape)
    self_attn = grads_of(p, R)
    split_ = grads_of(dict(p, key=p["x"]), R)
    assert list(split_) == ["x", "key", "w_q", "w_k", "w_v", "w_o"]
    np.testing.assert_allclose(split_["x"] + split_["key"], self_attn["x"], rtol=1e-12,
                               atol=1e-12 * np.abs(self_attn["x"]).max())
    assert not np.allclose(split_["x"], self_attn["x"])
    for k in ("w_q", "w_k", "w_v", "w_o"):
        np.testing.assert_allclose(split_[k], self_attn[k], rtol=1e-12, atol=1e-12)


def test_fully_masked_rows_give_zero_gradients():
    rng = np.random.default_rng(51)
    p = cfg_fully_masked_rows(rng)
    R = rnd(rng, *forward(p).shape)
    g = grads_of(p, R)
    for v in g.values():
        assert np.all(np.isfinite(v))
    # Row 1 of item 0 sees nothing: its query gets no gradient, and x only
    # feeds queries here (cross-attention).
    assert np.all(g["x"][0, 1] == 0)
    assert np.any(g["x"][1, 2] != 0)   # head 0 of that row still attends
    # A batch item with key length 0: nothing but b_o depends on it.
    p = dict(cfg_key_lengths(rng), b_o=rnd(rng, 4))
    R = rnd(rng, *forward(p).shape)
    g = grads_of(p, R)
    assert np.all(g["x"][2] == 0) and np.all(g["key"][2] == 0) and np.all(g["value"][2] == 0)
    assert np.all(g["key"][1, 2:] == 0) and np.all(g["value"][1, 2:] == 0)
    np.testing.assert_allclose(g["b_o"], R.sum(axis=(0, 1)), rtol=1e-13)
    # Every key blocked by the mask, everywhere: only b_o has a gradient.
    with pytest.warns(UserWarning, match="inverted"):
        g = grads_of(dict(p, mask=np.zeros((4, 5), bool)), R)
    for name, v in g.items():
        assert np.all(v == 0) == (name != "b_o"), name


def test_causal_with_more_queries_than_keys_zeroes_blind_rows():
    rng = np.random.default_rng(52)
    p = cfg_causal_tq_gt_tk(rng)   # Tq = 6, Tk = 3: rows 0..2 see nothing
    R = rnd(rng, *forward(p).shape)
    g = grads_of(p, R)
    # Row 3 sees key 0 alone: its weight is 1 whatever q is, so dq = 0 too.
    assert np.all(g["x"][:, :4] == 0) and np.all(g["x"][:, 4:] != 0)


# --------------------------------------------------------------------------
# names and forms of the results

def test_names_forms_and_dtypes():
    rng = np.random.default_rng(53)
    x = rnd(rng, 3, 4).astype(np.float32)                  # unbatched
    key = rnd(rng, 5, 2).astype(np.float32)
    wq = [rnd(rng, 4, 2).astype(np.float32), rnd(rng, 4, 3).astype(np.float32)]
    wk = rnd(rng, 2, 2, 5)[:, :, :].astype(np.float32)[:, :, :2]   # stacked, non-contiguous
    wk = [wk[0], np.concatenate([wk[1], rnd(rng, 2, 1).astype(np.float32)], axis=1)]
    wv = rnd(rng, 2, 6).astype(np.float32)                 # fused
    g = mhattn.multi_head_attention_grad(
        np.ones((3, 6), np.float32), x, wq, wk, wv, None, key=key, num_heads=2,
        b_q=[np.zeros(2, np.float32), np.zeros(3, np.float32)], b_v=np.zeros((2, 3)))
    assert list(g) == ["x", "key", "w_q", "w_k", "w_v", "b_q", "b_v"]
    # b_v is float64, so the compute dtype is float64.
    assert all(np.asarray(v).dtype == np.float64 for v in
               [g["x"], g["key"], g["w_v"], g["b_v"], *g["w_q"], *g["w_k"], *g["b_q"]])
    assert g["x"].shape == (3, 4) and g["key"].shape == (5, 2)
    assert [a.shape for a in g["w_q"]] == [(4, 2), (4, 3)]
    assert [a.shape for a in g["w_k"]] == [(2, 2), (2, 3)]
    assert g["w_v"].shape == (2, 6) and g["b_v"].shape == (2, 3)
    assert [a.shape for a in g["b_q"]] == [(2,), (3,)]

    # float32 throughout stays float32; stacked stays stacked.
    x32 = rnd(rng, 2, 3, 4).astype(np.float32)
    w = rnd(rng, 2, 4, 3).astype(np.float32)
    g = mhattn.multi_head_attention_grad(np.ones((2, 3, 6), np.float32), x32, w, w, w)
    assert list(g) == ["x", "w_q", "w_k", "w_v"]
    assert all(v.dtype == np.float32 for v in g.values())
    assert g["x"].shape == (2, 3, 4) and g["w_q"].shape == (2, 4, 3)
    for v in g.values():
        assert v.flags.c_contiguous


def test_integer_inputs_give_float64_gradients():
    x = np.arange(12).reshape(3, 4) % 5
    w = np.eye(4, dtype=int)
    g = mhattn.multi_head_attention_grad(np.ones((3, 4)), x, w, w, w, num_heads=2)
    assert all(v.dtype == np.float64 for v in g.values())
    gf = mhattn.multi_head_attention_grad(np.ones((3, 4)), x.astype(float), w * 1.0,
                                          w * 1.0, w * 1.0, num_heads=2)
    for k in g:
        np.testing.assert_array_equal(g[k], gf[k])


def test_inputs_are_not_modified():
    rng = np.random.default_rng(54)
    p = cfg_everything(rng)
    before = {k: [a.copy() for a in v] if isinstance(v, list) else np.copy(v)
              for k, v in p.items() if k in DIFFERENTIABLE or k == "mask"}
    R = rnd(rng, *forward(p).shape)
    Rc = R.copy()
    grads_of(p, R)
    for k, v in before.items():
        if isinstance(v, list):
            for a, b in zip(p[k], v):
                np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_array_equal(p[k], v)
    np.testing.assert_array_equal(R, Rc)


# --------------------------------------------------------------------------
# the context form

@pytest.mark.parametrize("case", ["plain", "everything", "cross_key_only", "unbatched",
                                  "fully_masked_rows"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_context_matches_one_call(case, dtype):
    rng = np.random.default_rng(55)
    p = {k: (v.astype(dtype) if isinstance(v, np.ndarray) and v.dtype == float else
             [a.astype(dtype) for a in v] if isinstance(v, list) and
             isinstance(v[0], np.ndarray) else v)
         for k, v in FD_CASES[case](rng).items()}
    plain = forward(p)
    out, ctx = forward(p, return_context=True)
    np.testing.assert_array_equal(out, plain)
    out2, w, ctx2 = forward(p, return_context=True, return_weights=True)
    np.testing.assert_array_equal(out2, plain)
    assert w.shape[-2:] == (plain.shape[-2], ctx2.call.Tk)
    R = rnd(rng, *out.shape).astype(dtype)
    one = grads_of(p, R)
    for c in (ctx, ctx2, ctx):     # a context can be reused
        two = mhattn.backward(R, c)
        assert list(two) == list(one)
        for k in one:
            for a, b in zip(np.atleast_1d(one[k]) if not isinstance(one[k], list) else one[k],
                            np.atleast_1d(two[k]) if not isinstance(two[k], list) else two[k]):
                np.testing.assert_array_equal(a, b)


def test_context_holds_no_t_by_t_buffer():
    rng = np.random.default_rng(56)
    T, d = 300, 8
    x = rnd(rng, 1, T, d)
    w = rnd(rng, d, d)
    _, ctx = mhattn.multi_head_attention(x, w, w, w, num_heads=2, return_context=True)
    arrays = [getattr(ctx, n) for n in ("q", "k", "v", "concat", "lse")]
    assert [a.shape for a in arrays] == [(1, T, d)] * 4 + [(1, 2, T)]
    assert all(a.size < T * T for a in arrays)
    assert ctx.out_shape == (1, T, d)
    assert "Tq=300" in repr(ctx)


def test_backward_rejects_bad_arguments():
    rng = np.random.default_rng(57)
    p = cfg_plain(rng)
    out, ctx = forward(p, return_context=True)
    with pytest.raises(ValueError, match=r"grad_out: expected .*\(2, 4, 4\)"):
        mhattn.backward(np.ones((2, 4, 3)), ctx)
    with pytest.raises(TypeError, match="ctx"):
        mhattn.backward(np.ones(out.shape), {"q": 1})
    with pytest.raises(TypeError, match="grad_out"):
        mhattn.backward(np.ones(out.shape, dtype=complex), ctx)
    with pytest.raises(ValueError, match="grad_out"):
        grads_of(p, np.ones((4, 4)))
    # float32 grad_out for a float64 call is cast, not refused.
    g32 = mhattn.backward(np.ones(out.shape, np.float32), ctx)
    g64 = mhattn.backward(np.ones(out.shape), ctx)
    np.testing.assert_array_equal(g32["w_q"], g64["w_q"])


def test_glue_rechecks_shapes():
    rng = np.random.default_rng(58)
    B, Tq, Tk, d = 2, 3, 4, 4
    x = rnd(rng, B, Tq, d)
    key = rnd(rng, B, Tk, d)
    w = rnd(rng, d, d)
    dk = dv = np.array([2, 2], np.int64)
    sc = np.array([0.5, 0.5])
    out, _, (q, k, v, cat, lse) = _C.forward(x, key, key, w, w, w, w, None, None, None,
                                             None, dk, dv, sc, None, False, None,
                                             None, False, True)
    args = [out, x, key, None, w, w, w, w, q, k, v, cat, lse, dk, dv, sc, None,
            False, None, None, False, False, False, False]
    res = _C.backward(*args)
    assert len(res) == 14 and res[1].shape == key.shape and res[2] is None
    for pos, bad, msg in [(12, lse[:, :, :2], "lse"), (0, out[:, :2], "dout"),
                          (8, q[..., :3], "q"), (11, cat[:1], "concat"),
                          (3, rnd(rng, B, Tk + 1, d), "value"),
                          (4, rnd(rng, d + 1, d), "wq")]:
        bad_args = list(args)
        bad_args[pos] = bad
        with pytest.raises(ValueError, match=msg):
            _C.backward(*bad_args)
    bad_args = list(args)
    bad_args[12] = lse.astype(np.float32)
    with pytest.raises(TypeError, match="lse"):
        _C.backward(*bad_args)
    bad_args = list(args)
    bad_args[18] = np.array([4, 5])
    with pytest.raises(ValueError, match="key_lengths"):
        _C.backward(*bad_args)


# --------------------------------------------------------------------------
# determinism and precision

@pytest.fixture
def restore_threads():
    yield
    _C.set_num_threads(0)


def determinism_case(rng, dtype):
    """Several tiles in every direction (T > 64), GQA, causal, mask, lengths."""
    B, Tq, Tk, d_in = 2, 150, 140, 12
    return dict(x=rnd(rng, B, Tq, d_in).astype(dtype), key=rnd(rng, B, Tk, d_in).astype(dtype),
                w_q=rnd(rng, 4, d_in, 5).astype(dtype), w_k=rnd(rng, 2, d_in, 5).astype(dtype),
                w_v=rnd(rng, 2, d_in, 6).astype(dtype), w_o=rnd(rng, 24, 7).astype(dtype),
                num_kv_heads=2, causal=True, key_lengths=[140, 97],
                mask=rng.random((1, 4, Tq, Tk)) < 0.9, b_k=rnd(rng, 10).astype(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bitwise_identical_for_any_thread_count(dtype, restore_threads):
    rng = np.random.default_rng(59)
    p = determinism_case(rng, dtype)
    out, ctx = forward(p, return_context=True)
    R = rnd(rng, *out.shape).astype(dtype)
    results = {}
    for n in (1, 2, 3, 8):
        _C.set_num_threads(n)
        assert _C.get_num_threads() == n
        results[n] = mhattn.backward(R, ctx)
    for n in (2, 3, 8):
        for k in results[1]:
            np.testing.assert_array_equal(results[n][k], results[1][k], err_msg=f"{k}, {n}")


def test_portable_build_agrees_and_is_deterministic(tmp_path):
    """MHATTN_ISA=scalar runs the portable template (no SIMD, no FMA) in a
    fresh process: bitwise the same over thread counts, and equal to the
    SIMD build's gradients up to rounding."""
    script = textwrap.dedent(f"""
        import sys, numpy as np
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import mhattn
        from mhattn import _C
        from test_grad import determinism_case, forward
        rng = np.random.default_rng(60)
        for dtype in (np.float32, np.float64):
            p = determinism_case(rng, dtype)
            out, ctx = forward(p, return_context=True)
            R = rng.standard_normal(out.shape).astype(dtype)
            _C.set_num_threads(1)
            a = mhattn.backward(R, ctx)
            _C.set_num_threads(3)
            b = mhattn.backward(R, ctx)
            for k in a:
                assert np.array_equal(a[k], b[k]), k
            np.savez({str(tmp_path)!r} + "/" + np.dtype(dtype).name, **a)
    """)
    env = dict(os.environ, MHATTN_ISA="scalar")
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=300)
    rng = np.random.default_rng(60)
    for dtype, rtol in ((np.float32, 1e-4), (np.float64, 1e-11)):
        p = determinism_case(rng, dtype)
        out, ctx = forward(p, return_context=True)
        R = rng.standard_normal(out.shape).astype(dtype)
        here = mhattn.backward(R, ctx)
        there = np.load(tmp_path / (np.dtype(dtype).name + ".npz"))
        scale = grad_scale(here)
        for k in here:
            np.testing.assert_allclose(there[k], here[k], rtol=rtol, atol=rtol * scale,
                                       err_msg=k)


@pytest.mark.parametrize("case", ["everything", "gqa", "mask_float", "ragged_shared"])
def test_float32_close_to_float64(case):
    """float32 gradients carry float32 rounding through the softmax and a
    few short reductions: 1e-4 of each gradient's scale."""
    rng = np.random.default_rng(61)
    p64 = FD_CASES[case](rng)
    p32 = {k: (v.astype(np.float32) if isinstance(v, np.ndarray) and v.dtype == float
               else [a.astype(np.float32) for a in v]
               if isinstance(v, list) and isinstance(v[0], np.ndarray) else v)
           for k, v in p64.items()}
    R = rnd(rng, *forward(p64).shape)
    g64 = grads_of(p64, R)
    g32 = grads_of(p32, R.astype(np.float32))
    scale = grad_scale(g64)
    for k in g64:
        for x32, x64 in zip(as_list(g32[k]), as_list(g64[k])):
            assert x32.dtype == np.float32
            np.testing.assert_allclose(x32, x64, rtol=1e-4, atol=1e-4 * scale, err_msg=k)


def test_larger_sizes_against_finite_differences_in_random_directions():
    """Several tiles per axis (T > 64) with everything on: directional
    derivatives along random directions, one per argument."""
    rng = np.random.default_rng(62)
    p = determinism_case(rng, np.float64)
    out = forward(p)
    R = rnd(rng, *out.shape)
    g = grads_of(p, R)
    # Rounding in the loss, ~eps sum|out R|, divided by the step: the floor
    # for a derivative that is zero in exact arithmetic (b_k's).
    noise = 10 * np.finfo(float).eps * np.sum(np.abs(out * R)) / 1e-6
    for name in expected_names(p):
        d = rnd(rng, *np.shape(p[name]))
        lp = np.sum(forward(dict(p, **{name: p[name] + 1e-6 * d})) * R)
        lm = np.sum(forward(dict(p, **{name: p[name] - 1e-6 * d})) * R)
        fd = (lp - lm) / 2e-6
        # Scale: the derivative's size were its terms not to cancel.
        scale = float(np.sum(np.abs(g[name] * d)))
        np.testing.assert_allclose(np.sum(g[name] * d), fd, rtol=1e-7,
                                   atol=max(1e-7 * scale, noise), err_msg=name)


# --------------------------------------------------------------------------
# the layer

def test_layer_backward():
    rng = np.random.default_rng(63)
    layer = mhattn.MultiHeadAttention(8, 2, num_kv_heads=1, kdim=5, vdim=6, bias=True,
                                      dtype=np.float64, seed=3)
    for name in ("b_q", "b_k", "b_v", "b_o"):
        setattr(layer, name, rnd(rng, *getattr(layer, name).shape))
    x, key, value = rnd(rng, 2, 3, 8), rnd(rng, 2, 4, 5), rnd(rng, 2, 4, 6)
    out, ctx = layer(x, key, value, causal=True, return_context=True)
    R = rnd(rng, *out.shape)
    g = layer.backward(R, ctx)
    assert list(g) == ["x", "key", "value", "w_q", "w_k", "w_v", "w_o", "b_q", "b_k",
                       "b_v", "b_o"]
    for name, arr in layer.weights().items():
        assert g[name].shape == arr.shape
    want = mhattn.multi_head_attention_grad(R, x, key=key, value=value, causal=True,
                                            **layer.arguments())
    for k in want:
        np.testing.assert_array_equal(g[k], want[k])
    # Self-attention: only 'x', which carries the keys' and values' parts.
    sq = mhattn.MultiHeadAttention(8, 2, dtype=np.float64, seed=4)
    out, w, ctx = sq(x, return_context=True, return_weights=True)
    g = sq.backward(R[..., :8] if R.shape[-1] == 8 else rnd(rng, *out.shape), ctx)
    assert list(g) == ["x", "w_q", "w_k", "w_v", "w_o"]
    with pytest.raises(TypeError, match="ctx"):
        sq.backward(np.ones(out.shape), None)
