"""The small-call fast branch (mhattn._internal.core.fast) against the full path.

The fast branch skips normalize() for calls of plain arrays of one float
dtype, in the weight forms and options it knows. It may only ever return
what the full path returns, bit for bit, or decline (return None) so that
the full path runs and raises its friendly errors; it checks what the glue
checks, so the glue never rejects what it takes. Here the full path is
forced by replacing fast with a function that always declines.
"""
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mhattn
from mhattn import _C
from mhattn._internal import core as _core, variants as _variants

DTYPES = [np.float32, np.float64]
OPTIONS = dict(key=None, value=None, scale=None, return_weights=False, mask=None,
               causal=False, key_lengths=None, num_kv_heads=None, b_q=None, b_k=None,
               b_v=None, b_o=None)


def fast_path(x, w_q, w_k, w_v, w_o=None, *, num_heads=None, **kw):
    """What the fast branch alone returns for multi_head_attention's
    arguments: its result, or None when it declines the call."""
    opts = {**OPTIONS, **kw}
    args = _core.fast(x, w_q, w_k, w_v, w_o, num_heads, opts["key"], opts["value"],
                       opts["scale"], opts["return_weights"], opts["mask"],
                       opts["causal"], opts["key_lengths"], opts["num_kv_heads"],
                       opts["b_q"], opts["b_k"], opts["b_v"], opts["b_o"])
    if args is None:
        return None
    out, weights, _ = _C.forward(*args)
    if x.ndim == 2:
        out = out[0]
        weights = None if weights is None else weights[0]
    return (out, weights) if opts["return_weights"] else out


def full_path(*args, **kw):
    saved = _core.fast
    _core.fast = lambda *a: None
    try:
        return mhattn.multi_head_attention(*args, **kw)
    finally:
        _core.fast = saved


def full_error(*args, **kw):
    try:
        full_path(*args, **kw)
    except Exception as e:   # noqa: BLE001 - the error is the result
        return type(e), str(e)
    return None


def public_error(*args, **kw):
    try:
        mhattn.multi_head_attention(*args, **kw)
    except Exception as e:   # noqa: BLE001
        return type(e), str(e)
    return None


def assert_same(a, b):
    """Bitwise: same type, shapes, dtypes and bits (NaNs included)."""
    if isinstance(b, tuple):
        assert isinstance(a, tuple) and len(a) == len(b)
        for p, q in zip(a, b):
            assert_same(p, q)
        return
    assert type(a) is np.ndarray and type(b) is np.ndarray
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.flags.c_contiguous and a.flags.writeable
    assert a.tobytes() == b.tobytes()


def snapshot(objs):
    return [None if o is None else (o.copy() if isinstance(o, np.ndarray) else o)
            for o in objs]


@st.composite
def small_calls(draw):
    """A small call in the forms the fast path takes, with random options."""
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)

    def arr(*shape):
        return rng.standard_normal(shape).astype(dtype)

    B = draw(st.sampled_from([None, 1, 2, 3]))
    lead = () if B is None else (B,)
    Tq = draw(st.integers(1, 5))
    G = draw(st.sampled_from([1, 2]))
    H = G * draw(st.sampled_from([1, 2]))
    dk, dv = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    d_in = draw(st.integers(1, 5))
    cross = draw(st.sampled_from(["self", "key", "key+value"]))
    Tk = Tq if cross == "self" else draw(st.integers(1, 5))
    d_k_in = d_in if cross == "self" else draw(st.integers(1, 4))
    d_v_in = d_k_in if cross != "key+value" else draw(st.integers(1, 4))
    x = arr(*lead, Tq, d_in)
    kw = dict(num_heads=H)
    if G != H or draw(st.booleans()):
        kw["num_kv_heads"] = G
    if cross != "self":
        kw["key"] = arr(*lead, Tk, d_k_in)
    if cross == "key+value":
        kw["value"] = arr(*lead, Tk, d_v_in)
    # Weights: fused, stacked or per-head lists; lists may have a width per
    # head (ragged) and may repeat one array (the document's shared W_V).
    ragged = draw(st.booleans())
    dks = [draw(st.integers(1, 3)) if ragged else dk for _ in range(G)]
    dvs = [draw(st.integers(1, 3)) if ragged else dv for _ in range(G)]
    group = H // G

    def weight(rows, widths):
        form = "list" if ragged else draw(st.sampled_from(["fused", "stacked", "list"]))
        heads = [arr(rows, wd) for wd in widths]
        if form == "list" and len(set(widths)) == 1 and draw(st.booleans()):
            heads = [heads[0]] * len(widths)
        if form == "fused":
            return np.concatenate(heads, axis=1), form
        if form == "stacked":
            return np.stack(heads), form
        return heads if draw(st.booleans()) else tuple(heads), form

    w_q, fq = weight(d_in, [dks[h // group] for h in range(H)])
    w_k, _ = weight(d_k_in, dks)
    w_v, _ = weight(d_v_in, dvs)
    if fq != "fused" and draw(st.booleans()):
        del kw["num_heads"]          # taken from the stacked or list form
    w_o = draw(st.sampled_from([None, "w_o"]))
    d_out = group * sum(dvs)
    if w_o is not None:
        d_out = draw(st.integers(1, 4))
        w_o = arr(group * sum(dvs), d_out)
    if draw(st.booleans()):
        kw["return_weights"] = True
    if draw(st.booleans()):
        kw["causal"] = True
    scale = draw(st.sampled_from([None, None, 0.25, 2, -1.5, np.float32(0.5),
                                  np.float64(3.0), 0.0, float("nan")]))
    if scale is not None:
        kw["scale"] = scale
    for name, h, widths in (("b_q", H, [dks[i // group] for i in range(H)]),
                            ("b_k", G, dks), ("b_v", G, dvs)):
        form = draw(st.sampled_from([None, None, "fused", "stacked"]))
        if form == "fused" or (form == "stacked" and len(set(widths)) > 1):
            kw[name] = arr(sum(widths))
        elif form == "stacked":
            kw[name] = arr(h, widths[0])
    if draw(st.booleans()):
        kw["b_o"] = arr(d_out)
    mask = draw(st.sampled_from([None, None, "bool", "add"]))
    if mask is not None:
        full = (*lead, H, Tq, Tk)
        # Any suffix of the full shape, with some sizes replaced by 1.
        nd = draw(st.integers(0, len(full)))
        shape = tuple(n if draw(st.booleans()) else 1 for n in full[len(full) - nd:])
        if mask == "bool":
            m = np.asarray(rng.random(shape) < 0.7)
        else:
            m = np.where(rng.random(shape) < 0.7, 0.0, -np.inf).astype(dtype)
            m = np.asarray(m + arr(*shape) * draw(st.sampled_from([0, 1])))
        kw["mask"] = m
    if draw(st.booleans()):
        if B is None:
            kw["key_lengths"] = draw(st.integers(0, Tk))
        else:
            kw["key_lengths"] = rng.integers(0, Tk + 1, size=B).astype(
                draw(st.sampled_from([np.int64, np.int32])))
    return (x, w_q, w_k, w_v, w_o), kw


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_calls())
def test_fast_path_is_bitwise_the_full_path(case):
    args, kw = case
    before = snapshot(list(args) + list(kw.values()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the fast path must not hide a warning
        try:
            full = full_path(*args, **kw)
        except UserWarning:
            assert fast_path(*args, **kw) is None
            return
        except ValueError as e:
            if "is ambiguous" in str(e):   # an ambiguous mask shape: never taken
                assert fast_path(*args, **kw) is None
            else:   # the core's refusal (a NaN scale): in the same words either way
                assert str(e).startswith("scale: "), e
                with pytest.raises(ValueError) as fast_error:
                    mhattn.multi_head_attention(*args, **kw)
                assert str(fast_error.value) == str(e)
            return
    fast = fast_path(*args, **kw)
    assert fast is not None, "the fast path declined a call it should take"
    assert_same(fast, full)
    assert_same(mhattn.multi_head_attention(*args, **kw), full)
    after = list(args) + list(kw.values())
    for b, a in zip(before, after):
        if isinstance(b, np.ndarray):
            np.testing.assert_array_equal(a, b)   # inputs never modified


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batched", [False, True])
def test_option_grid(rng, dtype, batched):
    """Each common option on its own, and a few together, at (3, 4, 2)."""
    lead = (2,) if batched else ()
    T, d, h = 3, 4, 2

    def arr(*shape):
        return rng.standard_normal(shape).astype(dtype)

    x = arr(*lead, T, d)
    w = [arr(d, d) for _ in range(4)]
    src = arr(*lead, T + 2, d)
    tril = np.tril(np.ones((T, T), bool))
    kl = np.array([T, 1]) if batched else 2
    options = [
        {}, dict(return_weights=True), dict(causal=True), dict(scale=0.3),
        dict(b_q=arr(d), b_k=arr(d), b_v=arr(d), b_o=arr(d)), dict(b_o=arr(d)),
        dict(b_q=arr(h, d // h)), dict(key_lengths=kl), dict(mask=tril),
        dict(mask=np.where(tril, 0.0, -np.inf).astype(dtype)),
        dict(mask=np.ones((*lead, h, T, T), bool)), dict(mask=tril[None]),
        dict(key=src), dict(key=src, value=src[..., ::-1].copy()),
        dict(key=src, mask=np.ones((T, T + 2), bool), key_lengths=kl),
        dict(causal=True, return_weights=True, scale=2, b_o=arr(d)),
    ]
    for opts in options:
        for w_o in (w[3], None):
            kw = dict(num_heads=h, **opts)
            if w_o is None and "b_o" in kw:
                continue
            fast = fast_path(x, *w[:3], w_o, **kw)
            assert fast is not None, opts
            assert_same(fast, full_path(x, *w[:3], w_o, **kw))
    stacked = [np.stack([m[:, :2], m[:, 2:]]) for m in w[:3]]
    listed = [[m[:, :2], m[:, 2:]] for m in w[:3]]
    ragged = [[m[:, :1], m[:, 1:]] for m in w[:3]]
    for ws, kw in [(stacked, dict(causal=True, b_q=arr(h, d // h))),
                   (listed, dict(mask=tril, return_weights=True)),
                   (ragged, dict(key_lengths=kl, b_v=arr(d), scale=0.5)),
                   ([w[0], listed[1], stacked[2]], dict(num_heads=h))]:
        fast = fast_path(x, *ws, w[3], **kw)
        assert fast is not None, kw
        assert_same(fast, full_path(x, *ws, w[3], **kw))
    wk = arr(d, d // h)
    kw = dict(num_heads=h, num_kv_heads=1, b_k=arr(d // h), causal=True)
    assert_same(fast_path(x, w[0], wk, wk, w[3], **kw), full_path(x, w[0], wk, wk, w[3], **kw))


X = np.ones((3, 4))
W = np.ones((4, 4))
WO = np.ones((4, 5))
W3 = np.ones((2, 4, 2))
WL = [np.ones((4, 2)), np.ones((4, 2))]
WR = [np.ones((4, 1)), np.ones((4, 3))]


class _Sub(np.ndarray):
    """An ndarray subclass, which the fast path leaves to the full path."""


# (args, keywords): malformed calls, or calls outside the fast path's forms.
DECLINED = [
    ((X.astype(np.int64), W, W, W), dict(num_heads=2)),           # integers: cast
    ((X.astype(np.float32), W, W, W), dict(num_heads=2)),         # mixed dtypes
    ((X.tolist(), W, W, W), dict(num_heads=2)),                   # not an array
    ((X.view(_Sub), W, W, W), dict(num_heads=2)),                 # a subclass
    ((X, W, W, W), dict(num_heads=3)),                            # 3 does not divide 4
    ((X, W, W, W), dict(num_heads=0)),
    ((X, W, W, W), dict(num_heads=2.0)),
    ((X, W, W, W), dict(num_heads=np.int64(2))),                  # taken by the full path
    ((X, W, W, W), dict(num_heads=10 ** 9)),
    ((X, W, W, W), {}),
    ((X, W, W, W, np.ones((3, 5))), dict(num_heads=2)),           # w_o rows
    ((X, W, W, W, np.ones(4)), dict(num_heads=2)),
    ((X, W, W, W), dict(num_heads=2, num_kv_heads=3)),
    ((X, W, W, W), dict(num_heads=2, num_kv_heads=True)),
    ((X, W, np.ones((4, 2)), W), dict(num_heads=2)),              # widths disagree
    ((X, np.ones((5, 4)), W, W), dict(num_heads=2)),              # rows
    ((X, W, W, W), dict(num_heads=2, key=np.ones((5, 3)))),
    ((X, W, W, W), dict(num_heads=2, key=np.ones((5, 4)), value=np.ones((6, 4)))),
    ((X, W, W, W), dict(num_heads=2, key=np.ones((2, 5, 4)))),
    ((X, W, W, W), dict(num_heads=2, key=np.ones((5, 4), np.float32))),
    ((X, W, W, W), dict(num_heads=2, scale="big")),
    ((X, W, W, W), dict(num_heads=2, scale=True)),
    ((X, W, W, W), dict(num_heads=2, scale=10 ** 400)),
    ((X, W, W, W), dict(num_heads=2, scale=np.array(0.5))),        # taken by the full path
    ((X, W, W, W), dict(num_heads=2, causal=1)),
    ((X, W, W, W), dict(num_heads=2, causal=np.True_)),
    ((X, W, W, W), dict(num_heads=2, return_weights=1)),
    ((X, W, W, W), dict(num_heads=2, b_q=np.ones(3))),
    ((X, W, W, W), dict(num_heads=2, b_q=np.ones((2, 3)))),
    ((X, W, W, W), dict(num_heads=2, b_q=np.ones(4, np.float32))),
    ((X, W, W, W), dict(num_heads=2, b_q=[np.ones(2), np.ones(2)])),
    ((X, W, W, W), dict(num_heads=2, b_o=np.ones(3))),
    ((X, W, W, W, WO), dict(num_heads=2, b_o=np.ones(4))),
    ((X, W, W, W), dict(num_heads=2, mask=np.ones((3, 4), bool))),
    ((X, W, W, W), dict(num_heads=2, mask=np.ones((1, 2, 3, 3), bool))),  # 4-D unbatched
    ((X, W, W, W), dict(num_heads=2, mask=np.ones((3, 3), int))),
    ((X, W, W, W), dict(num_heads=2, mask=np.ones((3, 3), np.float32))),  # cast
    ((X, W, W, W), dict(num_heads=2, mask=np.ones((3, 3)).tolist())),
    ((X, W, W, W), dict(num_heads=2, mask=np.zeros((3, 3), bool))),  # warns
    ((X, W, W, W), dict(num_heads=2, key_lengths=4)),
    ((X, W, W, W), dict(num_heads=2, key_lengths=-1)),
    ((X, W, W, W), dict(num_heads=2, key_lengths=True)),
    ((X, W, W, W), dict(num_heads=2, key_lengths=2.0)),
    ((X, W, W, W), dict(num_heads=2, key_lengths=np.array([2]))),
    ((X, W, W, W), dict(num_heads=2, key_lengths=np.array(2.0))),
    ((X[None], W, W, W), dict(num_heads=2, key_lengths=np.array([5]))),
    ((X[None], W, W, W), dict(num_heads=2, key_lengths=np.array([True]))),
    ((X[None], W, W, W), dict(num_heads=2, key_lengths=np.array([1, 2]))),
    ((X[None], W, W, W), dict(num_heads=2, mask=np.ones((2, 2, 3, 3), bool))),
    ((X[None], W, W, W), dict(num_heads=2, mask=np.ones((1, 1, 1, 3, 3), bool))),
    # Shapes that disagree, which the fast path leaves to the glue to reject.
    ((X, np.ones((4, 6)), W, W), dict(num_heads=2)),
    ((X, W, np.ones((4, 6)), np.ones((4, 6))), dict(num_heads=2)),
    ((X, W, W, np.ones((4, 5))), dict(num_heads=2)),
    ((X, W, W, W), dict(num_heads=8)),
    ((X, W, W, W), dict(num_heads=2, key=np.ones((5, 4)), value=np.ones((5, 3)))),
    ((X[None], W, W, W), dict(num_heads=2, key=np.ones((1, 5, 4)),
                              value=np.ones((2, 5, 4)))),
    ((X, W, W, W), dict(num_heads=2, b_k=np.ones(3))),
    ((X, W, W, W), dict(num_heads=2, b_v=np.ones(5))),
    ((X, W, W, W, WO), dict(num_heads=2, b_o=np.ones(4))),
    ((X, W3, W3, np.ones((2, 5, 2))), {}),
    # Stacked weights and per-head lists.
    ((X, W3, W3, W3), dict(num_heads=3)),
    ((X, W3, W3, W3), dict(num_kv_heads=3)),
    ((X, W3[:0], W3, W3), {}),
    ((X, [], W3, W3), {}),
    ((X, WL, WL + WL[:1], WL), {}),
    ((X, WL, WL, WL[:1]), {}),
    ((X, [np.ones((5, 2))] * 2, WL, WL), {}),
    ((X, [np.ones((4, 2)), np.ones((3, 2))], WL, WL), {}),
    ((X, [np.ones((4, 3))] * 2, WL, WL), {}),
    ((X, [np.ones((4, 2)), np.ones((4, 2), np.float32)], WL, WL), {}),
    ((X, [np.ones((4, 2)).tolist()] * 2, WL, WL), {}),
    ((X, [np.ones((4, 2)), "a"], WL, WL), {}),
    ((X, W, WL, WL), {}),                                       # fused w_q: no count
    ((X, WR, WR, WR), dict(b_q=np.ones((2, 2)))),                # ragged: no stacked bias
    ((X, WR, WR, WR), dict(b_k=np.ones(3))),
    ((X, WR, WR, WR, np.ones((3, 4))), {}),
    ((X, np.zeros((2 ** 40, 4, 0)), W, W), {}),                  # too many heads
    ((X, [np.ones((4, 0))] * 2, [np.ones((4, 0))] * 2, WL), {}),  # zero widths
    ((X, np.ones((2, 4, 0)), np.ones((2, 4, 0)), W3), {}),
    ((X, [np.ones((4, 1))] * 1025, [np.ones((4, 1))] * 1025, [np.ones((4, 1))] * 1025), {}),
]


@pytest.mark.parametrize("args,kw", DECLINED)
def test_fast_path_declines_and_errors_are_unchanged(args, kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert fast_path(*args, **kw) is None
        assert public_error(*args, **kw) == full_error(*args, **kw)


def test_all_false_mask_still_warns():
    with pytest.warns(UserWarning, match="inverted"):
        mhattn.multi_head_attention(X, W, W, W, num_heads=2,
                                    mask=np.zeros((3, 3), bool))


@pytest.mark.parametrize("dtype", DTYPES)
def test_awkward_arrays_take_the_fast_path_and_agree(rng, dtype):
    """Non-contiguous, broadcast, read-only and reversed inputs: the glue
    copies what it must; the results are the full path's, bit for bit."""
    x = rng.standard_normal((4, 2, 3)).astype(dtype).transpose(1, 2, 0)  # (2, 3, 4)
    w = rng.standard_normal((4, 4)).astype(dtype)
    wt = np.asfortranarray(rng.standard_normal((4, 4)).astype(dtype))
    wb = np.broadcast_to(rng.standard_normal((1, 4)).astype(dtype), (4, 4))
    ro = w.copy()
    ro.flags.writeable = False
    kb = np.broadcast_to(rng.standard_normal((5, 4)).astype(dtype), (2, 5, 4))
    b = rng.standard_normal(8).astype(dtype)[::2]
    mask = (rng.random((5, 3)) < 0.8).T                   # non-contiguous (3, 5)
    kl = np.array([5, 9, 2, 9])[::2]
    for args, kw in [((x, w, wt, wb, ro), dict(num_heads=2)),
                     ((x, wt, w, w[:, ::-1], None), dict(num_heads=2, key=kb, b_q=b,
                                                         mask=mask, key_lengths=kl)),
                     ((x[:, ::-1], ro, ro, ro, wt), dict(num_heads=1, causal=True))]:
        before = snapshot(list(args) + list(kw.values()))
        fast = fast_path(*args, **kw)
        assert fast is not None
        assert_same(fast, full_path(*args, **kw))
        for b0, a in zip(before, list(args) + list(kw.values())):
            if isinstance(b0, np.ndarray):
                np.testing.assert_array_equal(a, b0)


def test_other_dtypes_still_work(rng):
    x = rng.standard_normal((3, 4))
    w = rng.standard_normal((4, 4))
    for args in [(x.astype(np.int32), w, w, w), (x.astype(np.float32), w, w, w),
                 (x, w.astype(np.float32), w, w)]:
        assert fast_path(*args, num_heads=2) is None
        out = mhattn.multi_head_attention(*args, num_heads=2, causal=True)
        assert_same(out, full_path(*args, num_heads=2, causal=True))
        assert out.dtype == np.float64
    # half inputs are declined by the fast branch too (the slow one rounds
    # the result to them), and must not mix with float64 weights
    h, wh = x.astype(np.float16), w.astype(np.float16)
    assert fast_path(h, wh, wh, wh, num_heads=2) is None
    assert mhattn.multi_head_attention(h, wh, wh, wh, num_heads=2).dtype == np.float16
    with pytest.raises(TypeError, match="w_q: dtype float64 does not match x's float16"):
        mhattn.multi_head_attention(h, w, w, w, num_heads=2)


def test_cached_arrays_are_private_and_read_only(rng):
    x = rng.standard_normal((3, 4))
    w = rng.standard_normal((4, 4))
    mhattn.multi_head_attention(x, w, w, w, num_heads=2, scale=0.5, key_lengths=2)
    for heads in _core._HEADS.values():
        assert all(not a.flags.writeable for a in heads[:3])
    assert all(not a.flags.writeable for a in _core._LENGTHS.values())
    assert len(_core._HEADS) <= _core._CACHE_MAX and len(_core._LENGTHS) <= _core._CACHE_MAX


def test_lowered_memory_limit_is_honoured(monkeypatch):
    """The fast path skips the memory check only where it cannot fail."""
    from mhattn._internal import args as _args
    monkeypatch.setattr(_args, "_memory_limit_bytes", 1000)
    assert fast_path(X, W, W, W, num_heads=2) is None
    with pytest.raises(MemoryError):
        mhattn.multi_head_attention(X, W, W, W, num_heads=2, causal=True)


MASK_SHAPES = [(), (3,), (1,), (3, 3), (1, 3), (3, 1), (2, 3, 3), (2, 1, 3),
               (1, 3, 3), (4, 1, 1, 3), (4, 2, 3, 3), (1, 1, 1, 1), (4, 1, 3, 1)]


@pytest.mark.parametrize("shape", MASK_SHAPES)
@pytest.mark.parametrize("kind", ["bool", "add"])
def test_glue_broadcasts_the_mask_as_numpy_does(rng, shape, kind):
    B, H, Tq, Tk = 4, 2, 3, 3
    x = rng.standard_normal((B, Tq, 4))
    w = rng.standard_normal((4, 4))
    dk = np.array([2, 2])
    if kind == "bool":
        m = np.asarray(rng.random(shape) < 0.6)
    else:
        m = np.asarray(np.where(rng.random(shape) < 0.6, 0.0, -np.inf) + rng.random(shape))
    args = dict(x=x, key=x, value=x, wq=w, wk=w, wv=w, wo=w, bq=None, bk=None, bv=None,
                bo=None, dk=dk, dv=dk, scales=np.ones(2), causal=False,
                key_lengths=None, variants=None, want_weights=True, keep=False)
    got = _C.forward(mask=m, **args)
    want = _C.forward(mask=np.broadcast_to(m, (B, H, Tq, Tk)), **args)
    assert_same(got[:2], want[:2])


@pytest.mark.parametrize("shape", [(2,), (3, 2), (3, 3, 3), (5, 2, 3, 3), (1, 4, 2, 3, 3)])
def test_glue_rejects_masks_that_do_not_broadcast(rng, shape):
    x = rng.standard_normal((4, 3, 4))
    w = rng.standard_normal((4, 4))
    dk = np.array([2, 2])
    with pytest.raises(ValueError, match="mask"):
        _C.forward(x, x, x, w, w, w, None, None, None, None, None, dk, dk, np.ones(2),
                   np.ones(shape, bool), False, None, None, False, False)


def test_glue_parses_positional_and_keyword_calls_alike(rng):
    """forward() reads 20 or 21 positional arguments directly, anything else with
    PyArg_ParseTupleAndKeywords: both must agree, and both must raise."""
    x = rng.standard_normal((2, 3, 4))
    w = rng.standard_normal((4, 4))
    dk = np.array([2, 2])
    names = ["x", "key", "value", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "dk",
             "dv", "scales", "mask", "causal", "key_lengths", "variants", "want_weights",
             "keep"]
    values = [x, x, x, w, w, w, w, None, None, None, None, dk, dk, np.ones(2),
              np.ones((3, 3), bool), 1, np.array([3, 2]), None, np.True_, []]
    positional = _C.forward(*values)
    assert positional[1] is not None and positional[2] is None   # 1 and [] as truth
    assert_same(positional[:2], _C.forward(**dict(zip(names, values)))[:2])
    assert_same(positional[:2], _C.forward(*values[:10], **dict(zip(names[10:],
                                                                   values[10:])))[:2])
    with pytest.raises(TypeError):
        _C.forward(*values[:19])
    # packed (issue 16) is the one optional argument, None when left out
    assert_same(positional[:2], _C.forward(*values, None)[:2])
    assert_same(positional[:2], _C.forward(*values, packed=None)[:2])
    with pytest.raises(TypeError):
        _C.forward(*values, None, None)
    with pytest.raises(TypeError, match="packed"):
        _C.forward(*values, (w, None, None, None))
    with pytest.raises(TypeError):
        _C.forward(*values[:19], kept=False)

    class Bad:
        def __bool__(self):
            raise ZeroDivisionError("no truth")

    for i in (15, 18, 19):
        with pytest.raises(ZeroDivisionError):
            _C.forward(*values[:i], Bad(), *values[i + 1:])


@pytest.mark.parametrize("name", sorted(_variants.VARIANT_DEFAULTS))
def test_every_variant_keeps_the_call_off_the_fast_branch(monkeypatch, name):
    """multi_head_attention tests "every variant off" with its own list of
    names, not VARIANT_DEFAULTS: each variant given a value that is not its
    default must still keep the call off the fast branch (the branch would
    ignore it), and its default must not."""
    tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()

    def refuse(*args):
        raise AssertionError("the fast branch was taken")

    default = _variants.VARIANT_DEFAULTS[name]
    monkeypatch.setattr(_core, "fast", refuse)
    with pytest.raises(AssertionError, match="fast branch"):
        mhattn.multi_head_attention(X, w_q, w_k, w_v, w_o, **{name: default})
    value = 1e-5 if name == "norm_eps" else object()
    try:
        mhattn.multi_head_attention(X, w_q, w_k, w_v, w_o, **{name: value})
    except AssertionError:
        raise
    except Exception:
        pass    # the full path's friendly error for a junk value: not fast
