"""_C.attention (issue 17): the glue of mha_attend, called directly.

Compared with _C.forward on the same projections (forward(keep=True) keeps
q, k, v as (B, T, H*d): their (B, T, H, d) views, transposed, are strided
inputs read in place), with lengths_aligned against per-item calls, and the
split-K path against the unsplit one; the refusals name their argument.
"""
import numpy as np
import pytest

from mhattn import _C

NO_VARIANTS = None


def variants(window=None, softcap=0.0, alibi=None, sinks=None, key_mask=None,
             cu_q=None, cu_k=None, q_norm=None, rotary_dim=0, inv_freq=None):
    return (window, softcap, alibi, sinks, key_mask, cu_q, cu_k, q_norm, None, 1e-6, "rms",
            rotary_dim, False, inv_freq, None, None, 0.0, 0, None, 0, None, None)


def project(rng, dtype, B, Tq, Tk, H, G, dk, dv, Din=24, **fw):
    """_C.forward without W^O on random inputs: (concat, lse, q, k, v) with
    q (B, Tq, H*dk), k (B, Tk, G*dk), v (B, Tk, G*dv)."""
    x = rng.standard_normal((B, Tq, Din)).astype(dtype)
    key = rng.standard_normal((B, Tk, Din)).astype(dtype)
    wq = (rng.standard_normal((Din, H * dk)) / 4).astype(dtype)
    wk = (rng.standard_normal((Din, G * dk)) / 4).astype(dtype)
    wv = (rng.standard_normal((Din, G * dv)) / 4).astype(dtype)
    dks = np.full(G, dk, np.int64)
    dvs = np.full(G, dv, np.int64)
    scales = np.full(H, 1 / np.sqrt(dk))
    out, _, (q, k, v, concat, lse) = _C.forward(
        x, key, key, wq, wk, wv, None, None, None, None, None, dks, dvs, scales,
        fw.get("mask"), fw.get("causal", False), fw.get("key_lengths"),
        fw.get("variants"), False, True)
    return concat, lse, q, k, v, scales


def heads(a, n):
    """(B, T, n*d) -> the (B, n, T, d) strided view."""
    B, T, S = a.shape
    return a.reshape(B, T, n, S // n).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("opts", [
    {}, {"causal": True}, {"key_lengths": np.array([9, 0, 30], np.int64)},
    {"variants": "all"}, {"mask": "bool"}, {"mask": "add", "causal": True},
])
def test_equals_forward_bitwise(dtype, opts):
    rng = np.random.default_rng(1)
    B, Tq, Tk, H, G, dk, dv = 3, 7, 30, 4, 2, 8, 6
    opts = dict(opts)
    if opts.get("variants") == "all":
        opts["variants"] = variants(window=(5, 1), softcap=3.0,
                                    alibi=np.linspace(0.1, 0.4, H)[None],
                                    sinks=np.linspace(-1, 1, H).astype(dtype),
                                    key_mask=rng.random((B, Tk)) > 0.3)
    if opts.get("mask") == "bool":
        opts["mask"] = rng.random((B, 1, Tq, Tk)) > 0.3
    elif opts.get("mask") == "add":
        opts["mask"] = rng.standard_normal((Tq, Tk)).astype(dtype)
    concat, lse, q, k, v, scales = project(rng, dtype, B, Tq, Tk, H, G, dk, dv, **opts)
    out, w, l = _C.attention(heads(q, H), heads(k, G), heads(v, G), scales,
                             opts.get("mask"), opts.get("causal", False),
                             opts.get("key_lengths"), opts.get("variants"), False,
                             True, False, True)
    assert out.shape == (B, Tq, H, dv) and out.flags.c_contiguous and w is None
    assert np.array_equal(out.reshape(B, Tq, H * dv), concat)
    assert np.array_equal(l, lse)
    out2, w2, l2 = _C.attention(heads(q, H), heads(k, G), heads(v, G), scales,
                                opts.get("mask"), opts.get("causal", False),
                                opts.get("key_lengths"), opts.get("variants"), False,
                                False, True, False)
    assert out2.shape == (B, H, Tq, dv) and l2 is None and w2.shape == (B, H, Tq, Tk)
    assert np.array_equal(out2, out.transpose(0, 2, 1, 3))


def test_copies_what_it_cannot_read():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 3, 4, 8))
    k = rng.standard_normal((2, 3, 9, 8))
    v = rng.standard_normal((2, 3, 9, 5))
    sc = np.full(3, 0.3)
    ref = _C.attention(q, k, v, sc, None, False, None, None, False, False, False, True)
    # A byte-swapped v holding v's values (not v's bytes: the glue reads
    # values, its copy made in native byte order).
    swapped = v.astype(v.dtype.newbyteorder())
    assert not swapped.dtype.isnative and np.array_equal(swapped, v)
    for qq, kk, vv in [(np.asfortranarray(q), k, v), (q, k[:, :, ::-1][:, :, ::-1], v),
                       (q, k, swapped), (q.astype(q.dtype.newbyteorder()), k, v)]:
        got = _C.attention(qq, kk, vv, sc, None, False, None, None, False, False,
                           False, True)
        assert np.array_equal(got[0], ref[0]) and np.array_equal(got[2], ref[2])


def test_lengths_aligned_is_per_item_bottom_right():
    rng = np.random.default_rng(3)
    B, H, G, Tq, cap, d = 3, 4, 2, 3, 40, 8
    q = rng.standard_normal((B, H, Tq, d)).astype(np.float32)
    k = rng.standard_normal((B, G, cap, d)).astype(np.float32)
    v = rng.standard_normal((B, G, cap, d)).astype(np.float32)
    lens = np.array([40, 5, 17], np.int64)
    sc = np.full(H, 0.35)
    out, _, lse = _C.attention(q, k[:, :, :33 + 7], v, sc, None, True, lens, None,
                               True, False, False, True)
    for b in range(B):
        L = lens[b]
        ob, _, lb = _C.attention(q[b:b + 1], k[b:b + 1, :, :L], v[b:b + 1, :, :L], sc,
                                 None, True, None, None, False, False, False, True)
        np.testing.assert_allclose(out[b], ob[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(lse[b], lb[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_split_k_decode(dtype):
    rng = np.random.default_rng(4)
    B, H, G, Tk, d = 2, 8, 2, 3000, 32
    q = rng.standard_normal((B, H, 1, d)).astype(dtype)
    k = rng.standard_normal((B, G, Tk + 100, d)).astype(dtype)[:, :, :Tk]
    v = rng.standard_normal((B, G, Tk, d)).astype(dtype)
    sc = np.full(H, 1 / np.sqrt(d))
    sinks = np.linspace(-1, 2, H).astype(dtype)
    var = variants(sinks=sinks)
    lens = np.array([Tk, 700], np.int64)
    unsplit = _C.attention(q, k, v, sc, None, True, lens, var, True, False, True, True)
    before = _C.get_num_threads()
    try:
        got = []
        for n in (1, 2, 3):
            _C.set_num_threads(n)
            got.append(_C.attention(q, k, v, sc, None, True, lens, var, True, False,
                                    False, True))
    finally:
        _C.set_num_threads(before)
    for o, _, l in got[1:]:
        assert np.array_equal(o, got[0][0]) and np.array_equal(l, got[0][2])
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got[0][0], unsplit[0], rtol=tol, atol=tol)
    np.testing.assert_allclose(got[0][2], unsplit[2], rtol=tol, atol=tol)


def test_refusals_name_the_argument():
    q = np.zeros((2, 4, 3, 8))
    k = np.zeros((2, 2, 5, 8))
    v = np.zeros((2, 2, 5, 6))
    sc = np.ones(4)
    args = [q, k, v, sc, None, False, None, None, False, False, False, False]

    def call(**change):
        a = list(args)
        names = ["q", "k", "v", "scales", "mask", "causal", "key_lengths", "variants",
                 "lengths_aligned"]
        for name, val in change.items():
            a[names.index(name)] = val
        return _C.attention(*a)

    assert call()[0].shape == (2, 4, 3, 6)
    with pytest.raises(ValueError, match="^k:"):
        call(k=np.zeros((2, 2, 5, 7)))
    with pytest.raises(ValueError, match="^v:"):
        call(v=np.zeros((2, 2, 4, 6)))
    # The core's rule and message (mha_check_config), with the field it names.
    with pytest.raises(ValueError, match="^mhattn: H = 4 is not a multiple of G = 3$") as e:
        call(k=np.zeros((2, 3, 5, 8)), v=np.zeros((2, 3, 5, 6)))
    assert e.value.field == "G"
    with pytest.raises(ValueError, match="^scales:"):
        call(scales=np.ones(3))
    with pytest.raises(ValueError, match="^q:"):
        call(q=np.zeros((4, 3, 8)))
    with pytest.raises(TypeError, match="^k:"):
        call(k=k.astype(np.float32))
    # The q/k transforms: the core's rule (mha_check_no_qk), its field.
    with pytest.raises(ValueError, match="^mhattn: q_norm, k_norm and RoPE") as e:
        call(variants=variants(q_norm=np.ones(8)))
    assert e.value.field == "q_norm"
    with pytest.raises(ValueError, match=r"^mhattn: .*\(rotary_dim = 2\) belong") as e:
        call(variants=variants(rotary_dim=2, inv_freq=np.ones(1)))
    assert e.value.field == "rotary_dim"
    with pytest.raises(ValueError, match=r"^mhattn: key_lengths\[1\] = 9 is not in \[0, Tk = 5\]"):
        call(key_lengths=np.array([1, 9]))
    with pytest.raises(ValueError, match="^mhattn: lengths_aligned = 1 is not allowed with "
                       "packed sequences") as e:
        _C.attention(q[:1], k[:1], v[:1], sc, None, False, None,
                     variants(cu_q=np.array([0, 3]), cu_k=np.array([0, 5])), True,
                     False, False, False)
    assert e.value.field == "lengths_aligned"
