"""The backward reads nothing of a key no rule lets a query see, as the
forward does: keys blocked by ``key_mask``, a bool ``mask``, a ``window``,
causality or ``key_lengths`` that hold NaN or +-inf in k and v (an
``np.empty`` cache's padding) change no gradient, and a probability that is
exactly 0 because a rule blocked its key adds exactly 0 to every gradient,
never 0 * NaN.

Each case makes the same call twice, with the chosen keys' rows finite and
then NaN or inf, on every ISA, float32 and float64, 1 and 3 threads (the
fused and the two-pass backward plans), and awkward shapes (T_q = 70 and
T_k = 150 are not multiples of the 64-key tile; G = 2 < H = 4). A gradient
entry that no row seeing a non-finite key feeds must keep its bits: for keys
blocked from every query (key_mask, a bool mask's all-False columns, a
window's left side, key_lengths, a fully masked batch item) that is every
entry; for keys that some rows see (causal, a window's right side) the
other rows' dq (or dx). Which rows see which keys comes from the forward's
weights of the finite call.
"""
import numpy as np
import pytest

import mhattn

B, H, G, TQ, TK, DK, DV = 2, 4, 2, 70, 150, 20, 12


@pytest.fixture(params=[1, 3], ids=["1thread", "3threads"])
def threads(request):
    before = mhattn.get_num_threads()
    mhattn.set_num_threads(request.param)
    yield request.param
    mhattn.set_num_threads(before)


def _case(name, rng):
    """(keywords, bad): the rule's keywords and bad (B, T_k), True at the
    keys whose k and v rows turn non-finite (in every kv head)."""
    bad = np.zeros((B, TK), bool)
    kw = {}
    if name == "key_lengths":
        kw["key_lengths"] = np.array([TK, 83])
        bad[1, 83:] = True
    elif name in ("key_mask", "key_mask_softcap_alibi_sinks"):
        km = np.ones((B, TK), bool)
        km[0, [3, 40, 41, 42, 43, 149]] = False
        km[0, 64:128] = False                      # a whole key block
        km[1, 100:] = False
        kw["key_mask"] = km
        bad = ~km
        if name != "key_mask":
            kw.update(softcap=2.5, alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]),
                      sinks=rng.standard_normal(H))
    elif name == "bool_mask":
        m = rng.random((B, H, TQ, TK)) < 0.7
        cols = np.r_[0, 17, 64:71, 140:150]
        m[:, :, :, cols] = False                   # blocked from every query
        m[0, 1, 5, :] = False                      # a fully masked row
        kw["mask"] = m
        bad[:, cols] = True
    elif name == "window_left":
        kw["window"] = (30, None)                  # p_i >= 80: keys < 50 unseen
        bad[:, :50] = True
    elif name == "window_right":
        kw["window"] = (None, 3)
        bad[:, 140:] = True                        # seen by rows p_i >= 137 only
    elif name == "causal":
        kw["causal"] = True
        bad[0, 140:] = True
        bad[1, 120:130] = True
    elif name == "fully_masked":
        km = np.ones((B, TK), bool)
        km[1] = False                              # item 1 sees nothing
        kw["key_mask"] = km
        bad[1] = True
    else:
        raise AssertionError(name)
    return kw, bad


CASES = ["key_lengths", "key_mask", "key_mask_softcap_alibi_sinks", "bool_mask",
         "window_left", "window_right", "causal", "fully_masked"]
# Whose keys no query sees at all: every gradient keeps its bits.
UNSEEN = {"key_lengths", "key_mask", "key_mask_softcap_alibi_sinks", "bool_mask",
          "window_left", "fully_masked"}


def _spoil(a, bad, fill, kv_axis):
    """a copy of k or v (B, G, T_k, d) with the bad keys' rows non-finite."""
    a = a.copy()
    rows = np.broadcast_to(bad[:, None, :], a.shape[:3]) if kv_axis else bad
    if fill == "nan":
        a[rows] = np.nan
    else:
        n = int(rows.sum())
        a[rows] = np.where(np.arange(n * a.shape[-1]).reshape(n, -1) % 2, np.inf, -np.inf)
    return a


def _taint(vis, bad):
    """From vis (B, H, T_q, T_k) (query sees key) and bad (B, T_k): row
    (B, H, T_q), the rows that see a bad key, and key (B, G, T_k), the keys
    whose gradients such a row feeds."""
    row = (vis & bad[:, None, None, :]).any(-1)
    fed = (vis & row[..., None]).any(2)                     # (B, H, T_k)
    key = fed.reshape(B, G, H // G, TK).any(2)
    return row, key


def _same_bits(got, want, keep, what):
    """got and want bitwise equal where keep (broadcast on the last axes)."""
    keep = np.broadcast_to(keep.reshape(keep.shape + (1,) * (got.ndim - keep.ndim)),
                           got.shape)
    g, w = got[keep], want[keep]
    assert np.isfinite(w).all(), what
    n = int((g.view(f"u{g.itemsize}") != w.view(f"u{w.itemsize}")).sum())
    assert n == 0, f"{what}: {n} of {g.size} entries differ (NaN: {int(np.isnan(g).sum())})"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("fill", ["nan", "inf"])
@pytest.mark.parametrize("name", CASES)
def test_attention_grad_ignores_blocked_keys(name, fill, dtype, isa, threads):
    rng = np.random.default_rng(35)
    kw, bad = _case(name, rng)
    q = rng.standard_normal((B, H, TQ, DK)).astype(dtype)
    k = rng.standard_normal((B, G, TK, DK)).astype(dtype)
    v = rng.standard_normal((B, G, TK, DV)).astype(dtype)
    dout = rng.standard_normal((B, H, TQ, DV)).astype(dtype)
    _, w = mhattn.attention(q, k, v, return_weights=True, **kw)
    row, key = _taint(w != 0, bad)
    if name in UNSEEN:
        assert not row.any()
    assert (~row).sum() >= B * H * TQ // 2      # the test compares something
    want = mhattn.attention_grad(dout, q, k, v, **kw)
    got = mhattn.attention_grad(dout, q, _spoil(k, bad, fill, True),
                                _spoil(v, bad, fill, True), **kw)
    _same_bits(got["q"], want["q"], ~row, "dq")
    _same_bits(got["k"], want["k"], ~key, "dk")
    _same_bits(got["v"], want["v"], ~key, "dv")
    if "sinks" in want:
        _same_bits(got["sinks"], want["sinks"], ~row.any((0, 2)), "dsinks")
    # The blocked keys' own gradients are exactly 0.
    blocked = np.broadcast_to(bad[:, None, :], key.shape) & ~key
    blocked &= ~(w != 0).reshape(B, G, H // G, TQ, TK).any((2, 3))
    assert (got["k"][blocked] == 0).all() and (got["v"][blocked] == 0).all()


def test_the_cases_block_what_they_say(rng):
    """The rules' taint: keys no query sees are the UNSEEN cases' bad keys,
    and the other cases' bad keys are seen by some rows (so the tests above
    also hold the rows that see them to nothing)."""
    for name in CASES:
        kw, bad = _case(name, np.random.default_rng(35))
        q = rng.standard_normal((B, H, TQ, DK))
        k = rng.standard_normal((B, G, TK, DK))
        _, w = mhattn.attention(q, k, k[..., :DV], return_weights=True, **kw)
        seen = (w != 0).reshape(B, G, H // G, TQ, TK).any((2, 3)).any(1)   # (B, T_k)
        assert not (seen & bad).any() if name in UNSEEN else (seen & bad).any(), name


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nonfinite_rows_leave_blocked_keys_at_zero(dtype, isa, threads):
    """A NaN query row and a NaN row of grad_out make their own row's
    gradients NaN, but a key no rule lets them see still gets exactly 0
    from them, and the other rows' dq keep their bits."""
    rng = np.random.default_rng(7)
    kw, bad = _case("key_mask", rng)
    q = rng.standard_normal((B, H, TQ, DK)).astype(dtype)
    k = rng.standard_normal((B, G, TK, DK)).astype(dtype)
    v = rng.standard_normal((B, G, TK, DV)).astype(dtype)
    dout = rng.standard_normal((B, H, TQ, DV)).astype(dtype)
    want = mhattn.attention_grad(dout, q, k, v, **kw)
    q2, dout2 = q.copy(), dout.copy()
    q2[0, 1, 9] = np.nan
    dout2[0, 2, 66] = np.inf
    got = mhattn.attention_grad(dout2, q2, _spoil(k, bad, "nan", True),
                                _spoil(v, bad, "nan", True), **kw)
    blocked = np.broadcast_to(bad[:, None, :], (B, G, TK))
    assert (got["k"][blocked] == 0).all() and (got["v"][blocked] == 0).all()
    ok = np.ones((B, H, TQ), bool)
    ok[0, 1, 9] = ok[0, 2, 66] = False
    _same_bits(got["q"], want["q"], ok, "dq")
    _same_bits(got["k"][1], want["k"][1], np.ones((G, TK), bool), "dk of the other item")


MHA_CASES = ["key_lengths", "key_mask", "bool_mask", "window_left", "fully_masked",
             "causal", "window_right"]


def _mha_case(name, rng, dtype):
    kw, bad = _case(name, rng)
    d_in, d_kin, d_vin = 9, 7, 5
    args = dict(
        x=rng.standard_normal((B, TQ, d_in)), key=rng.standard_normal((B, TK, d_kin)),
        value=rng.standard_normal((B, TK, d_vin)),
        w_q=rng.standard_normal((H, d_in, DK)), w_k=rng.standard_normal((G, d_kin, DK)),
        w_v=rng.standard_normal((G, d_vin, DV)), w_o=rng.standard_normal((H * DV, 6)),
        b_q=rng.standard_normal((H, DK)), b_k=rng.standard_normal((G, DK)),
        b_v=rng.standard_normal((G, DV)), b_o=rng.standard_normal(6),
        q_norm=rng.standard_normal(DK), k_norm=rng.standard_normal((G, DK)),
        sinks=rng.standard_normal(H))
    args = {a: x.astype(dtype) for a, x in args.items()}
    args.update(kw, num_kv_heads=G, rope=mhattn.RoPE(rotary_dim=DK - 4))
    return args, bad


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("fill", ["nan", "inf"])
@pytest.mark.parametrize("name", MHA_CASES)
def test_multi_head_attention_grad_ignores_blocked_keys(name, fill, dtype, isa, threads):
    """Through the projections, the q/k norms and RoPE: every gradient
    (x, key, value, the weights, the biases, sinks, q_norm, k_norm) keeps its
    bits when no query sees the spoilt rows of key and value; with rows that
    some queries see, the other rows' dx does."""
    rng = np.random.default_rng(36)
    args, bad = _mha_case(name, rng, dtype)
    x, w_q, w_k, w_v, w_o = (args.pop(a) for a in ("x", "w_q", "w_k", "w_v", "w_o"))
    dout = rng.standard_normal((B, TQ, 6)).astype(dtype)
    _, w = mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, return_weights=True, **args)
    row, _ = _taint(w != 0, bad)
    want = mhattn.multi_head_attention_grad(dout, x, w_q, w_k, w_v, w_o, **args)
    args["key"] = _spoil(args["key"], bad, fill, False)
    args["value"] = _spoil(args["value"], bad, fill, False)
    got = mhattn.multi_head_attention_grad(dout, x, w_q, w_k, w_v, w_o, **args)
    assert sorted(got) == sorted(want)
    if name in UNSEEN:
        assert not row.any()
        for a in want:
            _same_bits(np.asarray(got[a]), np.asarray(want[a]),
                       np.ones(np.shape(want[a]), bool), a)
    else:
        assert row.any()
        _same_bits(got["x"], want["x"], ~row.any(1), "dx")
