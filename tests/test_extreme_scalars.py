"""Scalars the call's precision cannot hold are refused, naming the argument.

A float32 call rounds ``scale``, ``softcap`` (and 1 / softcap) and each
ALiBi bias -slope |p_i - j| to float32: past FLT_MAX they would become inf
(softcap * tanh(s / softcap) = inf * 0 = NaN, a slope of inf times the
distance 0 = NaN), where the reference and the float64 call keep them. The
core refuses them (config.c, precision_check) with a ValueError whose
message starts with the user's argument, through every entry point: the
layer's forward and gradient, attention and its gradient. Float64 takes the
same values and matches the reference; inf and NaN scales still propagate as
IEEE says, in either type.
"""
import numpy as np
import pytest

import mhattn
from mhattn import reference

F32_MAX = float(np.finfo(np.float32).max)
B, H, T, D, DK = 2, 2, 5, 6, 4


def _data(dtype, T=T):
    rng = np.random.default_rng(5)
    r = lambda *s: rng.standard_normal(s).astype(dtype)
    return dict(x=r(B, T, D), w=[r(D, H * DK) for _ in range(3)] + [r(H * DK, D)],
                q=r(B, H, T, DK), k=r(B, H, T, DK), v=r(B, H, T, DK),
                g_out=r(B, T, D), g_att=r(B, H, T, DK))


def _entry_points(dtype, T=T):
    """Each public entry point as a function of the keywords under test."""
    a = _data(dtype, T)
    return {
        "multi_head_attention": lambda kw: mhattn.multi_head_attention(
            a["x"], *a["w"], num_heads=H, **kw),
        "multi_head_attention_grad": lambda kw: mhattn.multi_head_attention_grad(
            a["g_out"], a["x"], *a["w"], num_heads=H, **kw),
        "attention": lambda kw: mhattn.attention(a["q"], a["k"], a["v"], **kw),
        "attention_grad": lambda kw: mhattn.attention_grad(a["g_att"], a["q"], a["k"],
                                                           a["v"], **kw),
    }


ENTRY = list(_entry_points(np.float32))

REFUSED_F32 = [
    ("softcap", dict(softcap=1e308)),
    ("softcap", dict(softcap=1e39)),
    ("softcap", dict(softcap=float(np.nextafter(np.float64(F32_MAX), np.inf)))),
    ("softcap", dict(softcap=1e-39)),     # 1 / softcap = 1e39: inf in float32
    ("softcap", dict(softcap=1e-50)),     # rounds to 0 in float32
    ("alibi_slopes", dict(alibi_slopes=[1e308, -1e308])),
    ("alibi_slopes", dict(alibi_slopes=[1.0, -1e39])),
    ("alibi_slopes", dict(alibi_slopes=[1e38, 1.0])),   # 1e38 * 4 > FLT_MAX
    ("scale", dict(scale=1e39)),
    ("scale", dict(scale=-1e308)),
]


@pytest.mark.parametrize("entry", ENTRY)
@pytest.mark.parametrize("arg,kw", REFUSED_F32, ids=[str(kw) for _, kw in REFUSED_F32])
def test_float32_refuses_what_it_cannot_hold(entry, arg, kw):
    call = _entry_points(np.float32)[entry]
    with pytest.raises(ValueError) as e:
        call(kw)
    assert str(e.value).startswith(f"{arg}: "), str(e.value)
    assert "float32" in str(e.value)


ACCEPTED_F32 = [
    dict(softcap=3e38), dict(softcap=1e-38), dict(softcap=F32_MAX),
    dict(alibi_slopes=[F32_MAX / 4, -F32_MAX / 4]),     # the largest distance is 4
    dict(scale=F32_MAX), dict(scale=-1e38), dict(scale=1e-50),
]


@pytest.mark.parametrize("entry", ENTRY)
@pytest.mark.parametrize("kw", ACCEPTED_F32, ids=str)
def test_float32_takes_what_it_can_hold(entry, kw):
    with np.errstate(all="ignore"):
        _entry_points(np.float32)[entry](kw)


def test_the_alibi_bound_follows_the_sequence_length():
    """|slope| (max(T_q, T_k) - 1) <= FLT_MAX: 1e37 is held at T = 35 (34e37),
    refused at T = 36 (35e37 > 3.4e38)."""
    kw = dict(alibi_slopes=[1e37, 1.0])
    with np.errstate(all="ignore"):
        _entry_points(np.float32, T=35)["attention"](kw)
    with pytest.raises(ValueError, match=r"^alibi_slopes: .*largest distance, 35"):
        _entry_points(np.float32, T=36)["attention"](kw)


@pytest.mark.parametrize("entry", ENTRY)
@pytest.mark.parametrize("scale", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nonfinite_scales_are_refused(entry, scale, dtype):
    """Issue 42: scale=float("nan") returned all NaN; an inf or NaN scale
    makes every score inf or NaN, so it is refused (in either dtype)."""
    with pytest.raises(ValueError, match=r"^scale: .*expected a finite number"):
        _entry_points(dtype)[entry](dict(scale=scale))


@pytest.mark.parametrize("kw", [dict(softcap=1e308), dict(softcap=1e39), dict(softcap=1e-300),
                                dict(scale=1e39), dict(alibi_slopes=[1e38, -1e38])], ids=str)
def test_float64_takes_them_and_matches_the_reference(kw, isa):
    a = _data(np.float64)
    with np.errstate(all="ignore"):
        got = mhattn.attention(a["q"], a["k"], a["v"], **kw)
        want = reference.projected_attention(a["q"], a["k"], a["v"], **kw)[0]
        out = mhattn.multi_head_attention(a["x"], *a["w"], num_heads=H, **kw)
        ref = reference.multi_head_attention(a["x"], *a["w"], num_heads=H, **kw)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    for name in ("attention_grad", "multi_head_attention_grad"):
        with np.errstate(all="ignore"):
            _entry_points(np.float64)[name](kw)


def test_float64_softcap_1e308_is_no_cap(isa):
    """softcap tanh(s / softcap) ~ s: the same output and gradients as no
    softcap, to rounding."""
    a = _data(np.float64)
    capped = mhattn.attention(a["q"], a["k"], a["v"], softcap=1e308)
    plain = mhattn.attention(a["q"], a["k"], a["v"])
    np.testing.assert_allclose(capped, plain, rtol=1e-12, atol=1e-12)
    g1 = mhattn.attention_grad(a["g_att"], a["q"], a["k"], a["v"], softcap=1e308)
    g0 = mhattn.attention_grad(a["g_att"], a["q"], a["k"], a["v"])
    for n in "qkv":
        np.testing.assert_allclose(g1[n], g0[n], rtol=1e-12, atol=1e-12)


def test_float64_refuses_an_overflowing_bias_too():
    """The bias of the largest distance must fit float64 as well: a slope of
    1e308 at distance 4 is past DBL_MAX (at T = 1, distance 0 and 1, it is
    taken)."""
    with pytest.raises(ValueError, match=r"^alibi_slopes: .*float64"):
        _entry_points(np.float64)["attention"](dict(alibi_slopes=[1e308, -1e308]))
    with np.errstate(all="ignore"):
        _entry_points(np.float64, T=1)["attention"](dict(alibi_slopes=[1e308, -1e308]))


# --- integers past the glue's C types (csrc/python/variants.c) ----------------

@pytest.mark.parametrize("rd", [2 ** 64, 2 ** 63, -2 ** 64, -2])
def test_glue_names_an_out_of_range_rotary_dim(rd):
    """The variants' rotary_dim as the glue reads it (a Py_ssize_t): one
    past its range is a ValueError naming rotary_dim, never a bare
    OverflowError."""
    from catalogue_cases import glue_args, variants
    from mhattn import _C
    with pytest.raises(ValueError, match=r"^rotary_dim: expected an int in \[0, "):
        _C.forward(**glue_args(variants=variants(rotary_dim=rd, inv_freq=np.ones(1))))


@pytest.mark.parametrize("window", [(2 ** 64, 0), (0, 2 ** 63), (-2 ** 70, 1)], ids=str)
def test_glue_names_an_out_of_range_window(window):
    from catalogue_cases import glue_args, variants
    from mhattn import _C
    with pytest.raises(ValueError, match=r"^window: expected each side in \[-1, "):
        _C.forward(**glue_args(variants=variants(window=window)))


def test_a_corrupted_rope_is_a_value_error():
    """A RoPE whose rotary_dim was set to 2**64 after construction: a
    ValueError naming what is wrong (the Python side may catch it before the
    glue does), not an OverflowError."""
    r = mhattn.RoPE()
    r.rotary_dim = 2 ** 64
    a = _data(np.float64)
    with pytest.raises(ValueError, match=r"^(rotary_dim|inv_freq|rope): "):
        mhattn.multi_head_attention(a["x"], *a["w"], num_heads=H, rope=r)
