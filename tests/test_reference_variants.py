"""The variants of issue 13 in the NumPy reference, rule by rule, then the C
core against the reference for each keyword alone and combined.

The first half checks the reference on small cases whose answer is known
by hand (a band, a row sum, a bound, an equivalent mask); the second half
(``test_core_matches_reference``) needs the C path of the keywords.
"""
import numpy as np
import pytest

import mhattn
from mhattn import reference as R
from mhattn._internal.args import normalize

from conftest import tol


def _weights(rng, d_in, H, G, dk, dv, d_out, dtype=np.float64):
    return (rng.standard_normal((d_in, H * dk)).astype(dtype),
            rng.standard_normal((d_in, G * dk)).astype(dtype),
            rng.standard_normal((d_in, G * dv)).astype(dtype),
            rng.standard_normal((H * dv, d_out)).astype(dtype))


def _band(Tq, Tk, left, right, causal=False):
    """(Tq, Tk) bool, by loops: p_i - left <= j <= p_i + right (None: unbounded)."""
    out = np.zeros((Tq, Tk), dtype=bool)
    for i in range(Tq):
        p = i + Tk - Tq
        for j in range(Tk):
            ok = (left is None or j >= p - left) and (right is None or j <= p + right)
            out[i, j] = ok and (not causal or j <= p)
    return out


# ------------------------------------------------------------------ window
@pytest.mark.parametrize("Tq,Tk", [(6, 6), (3, 7), (7, 3), (1, 5)])
@pytest.mark.parametrize("window,causal", [((2, 1), False), ((2, 0), True), ((1, 3), True),
                                           ((None, 1), False), ((0, None), False),
                                           ((0, 0), False), ((None, None), True)])
def test_window_keeps_exactly_the_band(rng, Tq, Tk, window, causal):
    x = rng.standard_normal((Tq, 4))
    key = rng.standard_normal((Tk, 4))
    w = np.eye(4)
    call = normalize(x, w, w, w, num_heads=1, key=key, window=window, causal=causal)
    np.testing.assert_array_equal(R.allowed_keys(call, 0, 0),
                                  _band(Tq, Tk, *window, causal=causal))


def test_window_equals_the_bool_mask_of_its_band(rng):
    x = rng.standard_normal((2, 9, 8))
    wq, wk, wv, wo = _weights(rng, 8, 2, 2, 4, 4, 8)
    band = _band(9, 9, 3, 0)
    a, wa = R.multi_head_attention(x, wq, wk, wv, wo, num_heads=2, window=(3, 0),
                                   return_weights=True)
    b, wb = R.multi_head_attention(x, wq, wk, wv, wo, num_heads=2, mask=band,
                                   return_weights=True)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(wa, wb)
    assert (wa[..., ~band] == 0).all() and (wa[..., band] > 0).all()


# ------------------------------------------------------------------- sinks
@pytest.mark.parametrize("sink", [-2.0, 0.0, 1.5])
def test_sink_lowers_row_sums_to_one_minus_p_sink(rng, sink):
    # w_q = 0: every score is 0, so the T keys and the sink share
    # exp(0) = 1 each against exp(sink): p_sink = e^sink / (T + e^sink).
    T = 5
    x = rng.standard_normal((T, 4))
    wv = rng.standard_normal((4, 4))
    out, w = R.multi_head_attention(x, np.zeros((4, 4)), np.eye(4), wv, num_heads=1,
                                    sinks=[sink], return_weights=True)
    p_sink = np.exp(sink) / (T + np.exp(sink))
    np.testing.assert_allclose(w.sum(-1), 1 - p_sink, rtol=1e-14)
    np.testing.assert_allclose(w, 1 / (T + np.exp(sink)), rtol=1e-14)
    # The sink has value zero: the output is the plain mean, shrunk.
    np.testing.assert_allclose(out, np.broadcast_to((x @ wv).mean(0) * (1 - p_sink), out.shape),
                               rtol=1e-12)
    np.testing.assert_allclose(R.lse(x, np.zeros((4, 4)), np.eye(4), wv, num_heads=1,
                                     sinks=[sink]),
                               np.full((1, T), np.log(T + np.exp(sink))), rtol=1e-14)


def test_very_negative_sink_is_no_sink(rng):
    x = rng.standard_normal((2, 5, 8))
    wq, wk, wv, wo = _weights(rng, 8, 2, 1, 4, 4, 8)
    kw = dict(num_heads=2, num_kv_heads=1, causal=True)
    a = R.multi_head_attention(x, wq, wk, wv, wo, sinks=[-1e4, -1e4], **kw)
    np.testing.assert_allclose(a, R.multi_head_attention(x, wq, wk, wv, wo, **kw),
                               rtol=1e-14, atol=1e-14)
    assert not np.array_equal(
        a, R.multi_head_attention(x, wq, wk, wv, wo, sinks=[0.0, 1.0], **kw))


@pytest.mark.parametrize("sinks", [None, [0.3, -0.7]])
def test_fully_masked_rows_are_zero_with_or_without_sinks(rng, sinks):
    x = rng.standard_normal((4, 8))
    wq, wk, wv, wo = _weights(rng, 8, 2, 2, 4, 4, 8)
    b_o = rng.standard_normal(8)
    mask = np.ones((4, 4), dtype=bool)
    mask[1] = False
    call = normalize(x, wq, wk, wv, wo, num_heads=2, mask=mask, sinks=sinks, b_o=b_o)
    for h in range(2):
        st = R.head_intermediates(call, 0, h)
        assert (st["weights"][1] == 0).all() and (st["head"][1] == 0).all()
        assert st["lse"][1] == (-np.inf if sinks is None else sinks[h])
        assert np.isfinite(st["weights"]).all() and np.isfinite(st["head"]).all()
    out = R.multi_head_attention(x, wq, wk, wv, wo, num_heads=2, mask=mask, sinks=sinks,
                                 b_o=b_o)
    np.testing.assert_array_equal(out[1], b_o)


# ----------------------------------------------------------------- softcap
@pytest.mark.parametrize("cap", [0.5, 3.0])
def test_softcap_bounds_the_scores_and_is_c_tanh(rng, cap):
    x = 3 * rng.standard_normal((6, 8))
    wq, wk, wv, wo = _weights(rng, 8, 2, 2, 4, 4, 8)
    call = normalize(x, wq, wk, wv, wo, num_heads=2, softcap=cap)
    for h in range(2):
        st = R.head_intermediates(call, 0, h)
        assert np.abs(st["scaled"]).max() > cap      # the cap has work to do
        assert np.abs(st["scores"]).max() <= cap
        q, k = x @ wq[:, 4 * h:4 * h + 4], x @ wk[:, 4 * h:4 * h + 4]
        np.testing.assert_allclose(st["scores"], cap * np.tanh(q @ k.T / 2 / cap),
                                   rtol=1e-13)


def test_huge_softcap_is_no_softcap(rng):
    x = rng.standard_normal((6, 8))
    wq, wk, wv, wo = _weights(rng, 8, 2, 2, 4, 4, 8)
    np.testing.assert_allclose(
        R.multi_head_attention(x, wq, wk, wv, wo, num_heads=2, softcap=1e8),
        R.multi_head_attention(x, wq, wk, wv, wo, num_heads=2), rtol=1e-12)


# ------------------------------------------------------------------- ALiBi
@pytest.mark.parametrize("Tq,Tk", [(6, 6), (3, 7)])
@pytest.mark.parametrize("batched_slopes", [False, True])
def test_alibi_equals_an_explicit_additive_mask(rng, Tq, Tk, batched_slopes):
    B, H = 2, 3
    x = rng.standard_normal((B, Tq, 6))
    key = rng.standard_normal((B, Tk, 6))
    wq, wk, wv, wo = _weights(rng, 6, H, H, 2, 2, 6)
    slopes = rng.uniform(0.1, 1.0, (B, H) if batched_slopes else (H,))
    add = np.zeros((B, H, Tq, Tk))
    for b in range(B):
        for h in range(H):
            s = slopes[b, h] if batched_slopes else slopes[h]
            for i in range(Tq):
                for j in range(Tk):
                    add[b, h, i, j] = -s * abs(i + Tk - Tq - j)
    kw = dict(num_heads=H, key=key, causal=True, return_weights=True)
    a, wa = R.multi_head_attention(x, wq, wk, wv, wo, alibi_slopes=slopes, **kw)
    b_, wb = R.multi_head_attention(x, wq, wk, wv, wo, mask=add, **kw)
    np.testing.assert_allclose(a, b_, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(wa, wb, rtol=1e-13, atol=1e-15)
    assert not np.allclose(a, R.multi_head_attention(x, wq, wk, wv, wo, num_heads=H,
                                                     key=key, causal=True))


def test_alibi_comes_after_the_softcap(rng):
    x = 3 * rng.standard_normal((5, 4))
    w = rng.standard_normal((4, 4))
    call = normalize(x, w, w, w, num_heads=1, softcap=1.0, alibi_slopes=[10.0])
    st = R.head_intermediates(call, 0, 0)
    # The bias is not capped: scores reach far below -c.
    assert st["scores"].min() < -10
    np.testing.assert_allclose(st["scores"], st["capped"] + st["bias"], rtol=1e-15)
    np.testing.assert_array_equal(st["bias"], -10.0 * np.abs(np.subtract.outer(
        np.arange(5), np.arange(5))))


# -------------------------------------------------------------------- RoPE
def test_rope_turns_a_pair_by_its_angle():
    x = np.array([[1.0, 2.0, 3.0, 4.0, 5.0]])
    f = np.array([0.5, 0.25])
    for inter, (ia, ib) in ((False, ([0, 1], [2, 3])), (True, ([0, 2], [1, 3]))):
        y = R.rope(x, np.array([3]), f, 4, inter)
        ang = 3 * f
        np.testing.assert_allclose(y[0, ia], x[0, ia] * np.cos(ang) - x[0, ib] * np.sin(ang))
        np.testing.assert_allclose(y[0, ib], x[0, ia] * np.sin(ang) + x[0, ib] * np.cos(ang))
        assert y[0, 4] == 5.0                      # beyond rotary_dim: unchanged


@pytest.mark.parametrize("rope", [mhattn.RoPE(), mhattn.RoPE(theta=100.0, interleaved=True),
                                  mhattn.RoPE(rotary_dim=2),
                                  mhattn.RoPE(inv_freq=[1.0, 0.3, 0.01])])
def test_rope_preserves_norms_and_depends_on_p_minus_j_only(rng, rope):
    x = rng.standard_normal((7, 12))
    wq, wk, wv, wo = _weights(rng, 12, 2, 1, 6, 6, 12)
    kw = dict(num_heads=2, num_kv_heads=1, causal=True, rope=rope)
    call = normalize(x, wq, wk, wv, wo, **kw)
    st = R.head_intermediates(call, 0, 1)
    np.testing.assert_allclose(np.linalg.norm(st["q"], axis=1),
                               np.linalg.norm(st["q_proj"], axis=1), rtol=1e-13)
    np.testing.assert_allclose(np.linalg.norm(st["k"], axis=1),
                               np.linalg.norm(st["k_proj"], axis=1), rtol=1e-13)
    assert not np.allclose(st["q"], st["q_proj"])
    base = R.multi_head_attention(x, wq, wk, wv, wo, **kw)
    pos = np.arange(7)
    np.testing.assert_allclose(base, R.multi_head_attention(
        x, wq, wk, wv, wo, positions=pos, key_positions=pos, **kw), rtol=1e-15)
    shifted = R.multi_head_attention(x, wq, wk, wv, wo, positions=pos + 1000,
                                     key_positions=pos + 1000, **kw)
    np.testing.assert_allclose(shifted, base, rtol=1e-9, atol=1e-10)
    moved = R.multi_head_attention(x, wq, wk, wv, wo, positions=pos + 1, **kw)
    assert not np.allclose(moved, base, rtol=1e-6)


def test_rope_default_positions_are_bottom_right(rng):
    x = rng.standard_normal((3, 4))
    key = rng.standard_normal((6, 4))
    w = rng.standard_normal((4, 4))
    kw = dict(num_heads=1, key=key, rope=mhattn.RoPE())
    np.testing.assert_array_equal(
        R.multi_head_attention(x, w, w, w, **kw),
        R.multi_head_attention(x, w, w, w, positions=np.arange(3, 6),
                               key_positions=np.arange(6), **kw))


# ----------------------------------------------------------------- RMSNorm
def test_rms_norm_rows_have_unit_rms_with_weight_one(rng):
    x = rng.standard_normal((6, 8))
    wq, wk, wv, wo = _weights(rng, 8, 2, 1, 4, 4, 8)
    call = normalize(x, wq, wk, wv, wo, num_heads=2, num_kv_heads=1, q_norm=np.ones(4),
                     k_norm=np.ones(4), norm_eps=0.0)
    for h in range(2):
        st = R.head_intermediates(call, 0, h)
        for name in ("q", "k"):
            rms = np.sqrt(np.mean(st[name] ** 2, axis=1))
            np.testing.assert_allclose(rms, 1.0, rtol=1e-14)
            np.testing.assert_allclose(
                st[name] * np.linalg.norm(st[name + "_proj"], axis=1, keepdims=True) / 2,
                st[name + "_proj"], rtol=1e-13)


def test_rms_norm_weights_per_head_and_scale_invariance(rng):
    x = rng.standard_normal((6, 8))
    wq, wk, wv, wo = _weights(rng, 8, 2, 1, 4, 4, 8)
    qn = rng.uniform(0.5, 2, (2, 4))
    kn = rng.uniform(0.5, 2, 4)
    kw = dict(num_heads=2, num_kv_heads=1, q_norm=qn, k_norm=kn, norm_eps=0.0)
    call = normalize(x, wq, wk, wv, wo, **kw)
    st = R.head_intermediates(call, 0, 1)
    unit = st["q_proj"] / np.sqrt(np.mean(st["q_proj"] ** 2, axis=1, keepdims=True))
    np.testing.assert_allclose(st["q_normed"], unit * qn[1], rtol=1e-14)
    # Norm before the scores: scaling the projections changes nothing.
    np.testing.assert_allclose(R.multi_head_attention(x, 3 * wq, 0.5 * wk, wv, wo, **kw),
                               R.multi_head_attention(x, wq, wk, wv, wo, **kw), rtol=1e-12)
    # ... but eps does, on small rows.
    assert not np.allclose(
        R.multi_head_attention(1e-3 * x, wq, wk, wv, wo, **dict(kw, norm_eps=1e-2)),
        R.multi_head_attention(1e-3 * x, wq, wk, wv, wo, **kw))


def test_norm_then_rope_in_that_order(rng):
    x = rng.standard_normal((5, 4))
    w = rng.standard_normal((4, 4))
    qn = rng.uniform(0.5, 2, 4)
    call = normalize(x, w, w, w, num_heads=1, q_norm=qn, rope=mhattn.RoPE(theta=50.0))
    st = R.head_intermediates(call, 0, 0)
    np.testing.assert_array_equal(st["q_normed"], R.rms_norm(st["q_proj"], qn, 1e-6))
    np.testing.assert_array_equal(
        st["q"], R.rope(st["q_normed"], np.arange(5), call.var.inv_freq, 4, False))


# ---------------------------------------------------------------- key_mask
def test_key_mask_equals_the_equivalent_bool_mask(rng):
    B, T = 3, 6
    x = rng.standard_normal((B, T, 8))
    wq, wk, wv, wo = _weights(rng, 8, 2, 2, 4, 4, 8)
    km = rng.random((B, T)) < 0.6
    km[2] = False                                    # batch item 2: no real key
    kw = dict(num_heads=2, causal=True, return_weights=True)
    a, wa = R.multi_head_attention(x, wq, wk, wv, wo, key_mask=km, **kw)
    b, wb = R.multi_head_attention(x, wq, wk, wv, wo, mask=km[:, None, None, :], **kw)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(wa, wb)
    assert (wa[2] == 0).all() and (a[2] == 0).all()


# ------------------------------------------------------- packed sequences
_PACKED_KW = [dict(causal=True), dict(window=(1, 1)), dict(causal=True, rope=mhattn.RoPE()),
              dict(alibi_slopes=[0.5, 0.1], sinks=[0.2, -0.4]),
              dict(causal=True, window=(2, 0), softcap=2.0, q_norm=np.ones(4))]


@pytest.mark.parametrize("kw", _PACKED_KW)
def test_packed_equals_separate_calls(rng, kw):
    cu = np.array([0, 3, 3, 7, 9, 10])
    x = rng.standard_normal((10, 8))
    wq, wk, wv, wo = _weights(rng, 8, 2, 2, 4, 4, 8)
    out, w = R.multi_head_attention(x, wq, wk, wv, wo, num_heads=2, cu_seqlens=cu,
                                    return_weights=True, **kw)
    for s in range(len(cu) - 1):
        lo, hi = cu[s], cu[s + 1]
        if lo == hi:
            continue
        one, w1 = R.multi_head_attention(x[lo:hi], wq, wk, wv, wo, num_heads=2,
                                         return_weights=True, **kw)
        np.testing.assert_allclose(out[lo:hi], one, rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(w[:, lo:hi, lo:hi], w1, rtol=1e-13, atol=1e-15)
        assert (w[:, lo:hi, :lo] == 0).all() and (w[:, lo:hi, hi:] == 0).all()


def test_packed_cross_attention_equals_separate_calls(rng):
    cu_q, cu_k = np.array([0, 2, 5, 6]), np.array([0, 4, 5, 9])
    x = rng.standard_normal((6, 8))
    key = rng.standard_normal((9, 8))
    wq, wk, wv, wo = _weights(rng, 8, 2, 1, 4, 4, 8)
    kw = dict(num_heads=2, num_kv_heads=1, causal=True, window=(2, None),
              alibi_slopes=[0.3, 0.6], rope=mhattn.RoPE())
    out = R.multi_head_attention(x, wq, wk, wv, wo, key=key, cu_seqlens=cu_q,
                                 key_cu_seqlens=cu_k, **kw)
    for s in range(3):
        q_rows, k_rows = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        np.testing.assert_allclose(
            out[q_rows], R.multi_head_attention(x[q_rows], wq, wk, wv, wo,
                                                key=key[k_rows], **kw),
            rtol=1e-13, atol=1e-14)


# --------------------------------------------------------------- lse, dtype
def test_lse_is_the_log_of_the_softmax_denominator(rng):
    x = rng.standard_normal((2, 5, 8))
    wq, wk, wv, wo = _weights(rng, 8, 2, 2, 4, 4, 8)
    kw = dict(num_heads=2, causal=True, sinks=[0.5, -1.0], softcap=5.0)
    got = R.lse(x, wq, wk, wv, wo, **kw)
    call = normalize(x, wq, wk, wv, wo, **kw)
    for b in range(2):
        for h in range(2):
            s = R.head_intermediates(call, b, h)["scores"]
            want = np.log(np.exp(s).sum(1) + np.exp(kw["sinks"][h]))
            np.testing.assert_allclose(got[b, h], want, rtol=1e-14)


def test_float32_stays_float32(rng):
    x = rng.standard_normal((5, 8)).astype(np.float32)
    wq, wk, wv, wo = _weights(rng, 8, 2, 2, 4, 4, 8, np.float32)
    out, w = R.multi_head_attention(
        x, wq, wk, wv, wo, num_heads=2, causal=True, window=(2, 0), softcap=3.0,
        alibi_slopes=[0.5, 0.25], sinks=np.zeros(2, np.float32), q_norm=np.ones(4, np.float32),
        rope=mhattn.RoPE(), return_weights=True)
    assert out.dtype == np.float32 and w.dtype == np.float32
    # A float64 sink promotes the call, as a float64 bias does.
    assert R.multi_head_attention(x, wq, wk, wv, wo, num_heads=2,
                                  sinks=np.zeros(2)).dtype == np.float64


def test_inputs_are_not_mutated(rng):
    x = rng.standard_normal((5, 8))
    wq, wk, wv, wo = _weights(rng, 8, 2, 2, 4, 4, 8)
    args = dict(sinks=np.array([0.1, 0.2]), q_norm=rng.standard_normal(4),
                positions=np.arange(5), key_mask=np.ones(5, bool),
                alibi_slopes=np.array([0.5, 0.25]))
    before = {k: v.copy() for k, v in args.items()}
    R.multi_head_attention(x, wq, wk, wv, wo, num_heads=2, rope=mhattn.RoPE(), **args)
    for k, v in args.items():
        np.testing.assert_array_equal(v, before[k])


# ---------------------------------------------- the C core vs the reference
def _core_case(name, dtype, rng):
    """(args, kwargs) of one call exercising the named keyword(s)."""
    B, T, d, H, G, dk = 2, 7, 16, 4, 2, 4
    x = rng.standard_normal((B, T, d))
    # Weights of variance 1/d keep every stage O(1), so that float32's
    # absolute floor of 1e-5 is a fair one.
    wq, wk, wv, wo = (w / np.sqrt(d) for w in _weights(rng, d, H, G, dk, dk, d))
    km = np.ones((B, T), dtype=bool)
    km[0, :2] = False                          # left padding
    km[1, 3] = False
    one = {
        "window": dict(window=(2, 1)),
        "window_causal": dict(window=(3, 0), causal=True),
        "window_left_open": dict(window=(None, 1)),
        "softcap": dict(softcap=1.5),
        "alibi": dict(alibi_slopes=rng.uniform(0.1, 1, H)),
        "alibi_batched": dict(alibi_slopes=rng.uniform(0.1, 1, (B, H)), causal=True),
        "sinks": dict(sinks=rng.standard_normal(H)),
        "q_norm": dict(q_norm=rng.uniform(0.5, 2, dk)),
        "k_norm_per_head": dict(k_norm=rng.uniform(0.5, 2, (G, dk)), norm_eps=1e-3),
        "rope": dict(rope=mhattn.RoPE(), causal=True),
        "rope_interleaved_partial": dict(rope=mhattn.RoPE(theta=500.0, rotary_dim=2,
                                                          interleaved=True)),
        "rope_positions": dict(rope=mhattn.RoPE(), positions=np.array([[3, 4, 5, 6, 7, 8, 9],
                                                                       [0, 0, 1, 2, 3, 4, 5]]),
                               key_positions=np.arange(T) + 2),
        "key_mask": dict(key_mask=km, causal=True),
        "key_mask_empty_row": dict(key_mask=np.zeros((B, T), bool) | (np.arange(B) == 0)[:, None]),
    }
    combined = dict(causal=True, window=(3, 0), softcap=2.0, alibi_slopes=rng.uniform(0.1, 1, H),
                    sinks=rng.standard_normal(H), q_norm=rng.uniform(0.5, 2, (H, dk)),
                    k_norm=rng.uniform(0.5, 2, dk), rope=mhattn.RoPE(),
                    key_mask=km, b_q=rng.standard_normal(H * dk),
                    b_k=rng.standard_normal(G * dk), b_v=rng.standard_normal(G * dk),
                    b_o=rng.standard_normal(d))
    cu = np.array([0, 3, 3, 7, 9])
    xp = rng.standard_normal((9, d))
    keyp = rng.standard_normal((11, d))
    cases = dict(one)
    cases["combined"] = combined
    args = (x, wq, wk, wv, wo)
    if name == "packed":
        args, kw = (xp, wq, wk, wv, wo), dict(cu_seqlens=cu, causal=True)
    elif name == "packed_combined":
        kw = {k: v for k, v in combined.items() if k != "key_mask"}
        kw.update(cu_seqlens=cu, key_mask=rng.random(9) < 0.8)
        args = (xp, wq, wk, wv, wo)
    elif name == "packed_cross":
        args = (xp, wq, wk, wv, wo)
        kw = dict(key=keyp, cu_seqlens=cu, key_cu_seqlens=np.array([0, 2, 6, 9, 11]),
                  causal=True, window=(1, None), alibi_slopes=rng.uniform(0.1, 1, H),
                  rope=mhattn.RoPE())
    elif name == "decode":
        args = (x[:, -1:], wq, wk, wv, wo)
        kw = dict(key=x, causal=True, window=(3, 0), sinks=rng.standard_normal(H),
                  rope=mhattn.RoPE(), alibi_slopes=rng.uniform(0.1, 1, H))
    elif name == "more_queries_than_keys":
        # Causal with Tq > Tk: the first Tq - Tk rows see no key at all.
        kw = dict(key=x[:, :3], causal=True, sinks=rng.standard_normal(H), softcap=1.0,
                  key_mask=np.array([[True, False, True], [False, False, False]]),
                  rope=mhattn.RoPE())
    elif name == "packed_empty_keys":
        # Sequence 0 has two queries and no key: fully masked rows.
        args = (xp[:5], wq, wk, wv, wo)
        kw = dict(key=keyp[:4], cu_seqlens=np.array([0, 2, 5]),
                  key_cu_seqlens=np.array([0, 0, 4]), sinks=rng.standard_normal(H),
                  q_norm=rng.uniform(0.5, 2, dk))
    elif name == "unbatched":
        args = (x[0], wq, wk, wv, wo)
        kw = dict(key_mask=km[0], causal=True, window=(None, 0),
                  alibi_slopes=rng.uniform(0.1, 1, H), rope=mhattn.RoPE(),
                  positions=np.arange(T) + 5, key_positions=np.arange(T) + 5)
    elif name == "cross_window_alibi":
        kw = dict(key=rng.standard_normal((B, 10, d)), window=(2, 2),
                  alibi_slopes=rng.uniform(0.1, 1, H), causal=True)
    else:
        kw = cases[name]
    cast = lambda a: a.astype(dtype) if isinstance(a, np.ndarray) and a.dtype.kind == "f" \
        and a is not kw.get("alibi_slopes") else a   # noqa: E731 (slopes stay float64)
    args = tuple(cast(a) for a in args)
    kw = {k: cast(v) for k, v in kw.items()}
    return args, dict(kw, num_heads=H, num_kv_heads=G)


CORE_CASES = ["window", "window_causal", "window_left_open", "softcap", "alibi",
              "alibi_batched", "sinks", "q_norm", "k_norm_per_head", "rope",
              "rope_interleaved_partial", "rope_positions", "key_mask", "key_mask_empty_row",
              "combined", "packed", "packed_combined", "packed_cross", "cross_window_alibi",
              "decode", "more_queries_than_keys", "packed_empty_keys", "unbatched"]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", CORE_CASES)
def test_core_matches_reference(rng, isa, name, dtype):
    args, kw = _core_case(name, dtype, rng)
    want, want_w = R.multi_head_attention(*args, return_weights=True, **kw)
    want_lse = R.lse(*args, **kw)
    got, got_w = mhattn.multi_head_attention(*args, return_weights=True, **kw)
    assert got.dtype == want.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got, want, **tol(dtype))
    np.testing.assert_allclose(got_w, want_w, **tol(dtype))
    assert np.isfinite(got).all()
    out2, ctx = mhattn.multi_head_attention(*args, return_context=True, **kw)
    np.testing.assert_array_equal(out2, got)
    lse = ctx.lse if ctx.call.batched else ctx.lse[0]
    np.testing.assert_allclose(lse, want_lse, **tol(dtype))


_GRAD_ARGS = ("x", "w_q", "w_k", "w_v", "w_o")
_GRAD_KW = ("key", "b_q", "b_k", "b_v", "b_o", "sinks", "q_norm", "k_norm")


@pytest.mark.parametrize("name", CORE_CASES)
def test_core_grad_matches_reference_derivative(rng, name):
    """<dL/da, u> from mhattn.multi_head_attention_grad equals the reference's
    central difference (L(a + e u) - L(a - e u)) / 2e along a random u, for
    every argument a with a gradient; L = sum(out * grad_out), float64."""
    args, kw = _core_case(name, np.float64, rng)
    out = R.multi_head_attention(*args, **kw)
    grad_out = rng.standard_normal(out.shape)
    got = mhattn.multi_head_attention_grad(grad_out, *args, **kw)
    named = dict(zip(_GRAD_ARGS, args))
    named.update({k: kw[k] for k in _GRAD_KW if k in kw})
    assert set(named) <= set(got), f"no gradient for {set(named) - set(got)}"
    rest = {k: v for k, v in kw.items() if k not in named}
    eps = 1e-5

    def loss(**changed):
        a = dict(named, **changed)
        return float(np.sum(R.multi_head_attention(
            *(a[n] for n in _GRAD_ARGS), **{k: a[k] for k in a if k not in _GRAD_ARGS},
            **rest) * grad_out))
    for arg, value in named.items():
        u = rng.standard_normal(np.shape(value))
        want = (loss(**{arg: value + eps * u}) - loss(**{arg: value - eps * u})) / (2 * eps)
        have = float(np.sum(np.asarray(got[arg]) * u))
        # Central differences err by O(eps^2) times the third derivative.
        assert abs(have - want) <= 1e-6 * max(1.0, abs(want)), (arg, have, want)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", ["combined", "packed_combined", "packed_cross"])
def test_core_variants_bitwise_for_any_thread_count(rng, name, dtype):
    args, kw = _core_case(name, dtype, rng)
    grad_out = rng.standard_normal(R.multi_head_attention(*args, **kw).shape).astype(dtype)
    before = mhattn.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            mhattn.set_num_threads(n)
            out, w = mhattn.multi_head_attention(*args, return_weights=True, **kw)
            runs.append((out, w, mhattn.multi_head_attention_grad(grad_out, *args, **kw)))
    finally:
        mhattn.set_num_threads(before)
    for out, w, grads in runs[1:]:
        np.testing.assert_array_equal(out, runs[0][0])
        np.testing.assert_array_equal(w, runs[0][1])
        for k, g in grads.items():
            np.testing.assert_array_equal(g, runs[0][2][k], err_msg=k)


def _random_call(seed):
    """A random mix of shapes and variants (float64): (args, kwargs)."""
    r = np.random.default_rng(seed)
    G = int(r.choice([1, 2]))
    H = G * int(r.choice([1, 2]))
    dk = int(r.choice([2, 4, 6]))
    dv = int(r.integers(1, 5))
    d = int(r.integers(2, 9))
    packed = r.random() < 0.3
    cross = r.random() < 0.5
    B = 1 if packed else int(r.integers(1, 3))
    Tq = int(r.integers(1, 10))
    Tk = int(r.integers(1, 10)) if cross else Tq
    lead = () if packed else (B,)
    x = r.standard_normal(lead + (Tq, d))
    kw = dict(num_heads=H, num_kv_heads=G)
    if cross:
        kw["key"] = r.standard_normal(lead + (Tk, d))
    w = [r.standard_normal((d, n)) / np.sqrt(d) for n in (H * dk, G * dk, G * dv)]
    w.append(r.standard_normal((H * dv, d)) / np.sqrt(H * dv))
    side = lambda: None if r.random() < 0.3 else int(r.integers(0, 12))  # noqa: E731
    if r.random() < 0.5:
        kw["window"] = (side(), side())
    kw["causal"] = bool(r.random() < 0.5)
    if r.random() < 0.4:
        kw["softcap"] = float(r.uniform(0.3, 3))
    if r.random() < 0.4:
        kw["alibi_slopes"] = r.uniform(0, 1, H)
    if r.random() < 0.4:
        kw["sinks"] = r.standard_normal(H)
    if r.random() < 0.3:
        kw["q_norm"] = r.uniform(0.5, 2, (H, dk) if r.random() < 0.5 else dk)
    if r.random() < 0.3:
        kw["k_norm"] = r.uniform(0.5, 2, dk)
    if r.random() < 0.4:
        kw["rope"] = mhattn.RoPE(theta=float(r.uniform(2, 1e4)),
                                 rotary_dim=2 * int(r.integers(1, dk // 2 + 1)),
                                 interleaved=bool(r.random() < 0.5))
    if r.random() < 0.3:
        kw["key_mask"] = r.random(lead + (Tk,)) < 0.7
    if packed:
        n = int(r.integers(1, 4))
        cu = np.sort(np.concatenate([[0, Tq], r.integers(0, Tq + 1, n - 1)]))
        kw["cu_seqlens"] = cu
        if cross:
            kw["key_cu_seqlens"] = np.sort(np.concatenate([[0, Tk], r.integers(0, Tk + 1, n - 1)]))
        else:
            kw.pop("key", None)
    return (x, *w), kw


@pytest.mark.parametrize("seed", range(60))
def test_core_matches_reference_random_mix(seed):
    args, kw = _random_call(seed)
    want, want_w = R.multi_head_attention(*args, return_weights=True, **kw)
    got, got_w = mhattn.multi_head_attention(*args, return_weights=True, **kw)
    np.testing.assert_allclose(got, want, **tol(np.float64))
    np.testing.assert_allclose(got_w, want_w, **tol(np.float64))
    grad_out = np.random.default_rng(seed).standard_normal(want.shape)
    grads = mhattn.multi_head_attention_grad(grad_out, *args, **kw)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads.values())
