"""Fuzz mhattn.multi_head_attention: shapes, dtypes, strides, masks, keywords.

    python fuzz/fuzz_mha.py -max_total_time=60 NEW_CORPUS_DIR fuzz/corpus

(atheris, i.e. libFuzzer: the first directory receives new inputs; give a
scratch one so fuzz/corpus stays as committed). Without ``-seed`` each run
explores fresh inputs; .ci/run's gate takes ``-seed=1 -runs=30000`` so that a
commit's result is reproducible. ``python fuzz/fuzz_mha.py
--replay PATH...`` runs files (or directories of them) through
test_one_input once, without atheris.

Each input is decoded into one call. The properties:
  * only TypeError, ValueError or MemoryError escape; a TypeError or
    ValueError names the argument before its first colon ("w_q[1]: ...");
  * a valid call returns arrays of the documented dtype and shape, and
    when the reference's result is finite the C result matches it;
  * the variants (window, softcap, ALiBi, sinks, q/k norm, RoPE with its
    positions, key_mask, packed sequences) come and go with the rest;
  * now and then a call that worked is made again with
    mhattn.pack_weights's object: the same bits.
Values are multiples of 1/4 in [-2, 2], so projections and scores are exact
in float32 and the only differences left are exp's and the sums' rounding.
q/k norm and RoPE make q and k inexact; under a huge scale (1e30) a rounding
of q.k then moves a score by more than whole units, softmax is a
discontinuous argmax of near-ties, and only dtype, shape and finiteness are
checked (ill_conditioned; fuzz/regressions/qnorm-huge-scale-near-tie).

The decoder is written here rather than taken from atheris, so inputs
replay identically without it (tests/test_fuzz_regressions.py).
"""
from __future__ import annotations

import os
import re
import sys
import warnings

import numpy as np

ARGS = ("x", "w_q", "w_k", "w_v", "w_o", "num_heads", "key", "value", "scale", "mask",
        "causal", "key_lengths", "num_kv_heads", "b_q", "b_k", "b_v", "b_o",
        "return_weights")
# The variants of today's models (issue 13): decoded after the rest, from
# bytes that older inputs do not have, so they replay as they always did.
VARIANTS = ("window", "softcap", "alibi_slopes", "sinks", "q_norm", "k_norm", "norm_eps",
            "rope", "positions", "key_positions", "key_mask", "cu_seqlens",
            "key_cu_seqlens", "norm_type", "dropout", "seed", "relative_bias")
# Issue 39's, decoded after those; not in VARIANTS, whose picks older inputs
# replay by its length.
LATER_VARIANTS = ("chunk", "block_mask")


class Data:
    """Reads small choices from the fuzzer's bytes; zeros once they run out."""

    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1]

    def int(self, lo: int, hi: int) -> int:
        span = hi - lo + 1
        v = self.byte() if span <= 256 else (self.byte() << 8) | self.byte()
        return lo + v % span

    def pick(self, seq):
        return seq[self.int(0, len(seq) - 1)]

    def chance(self, n: int) -> bool:
        """True with probability 1/n."""
        return self.int(0, n - 1) == 0

    def rarely(self, n: int) -> bool:
        """True with probability 1/n, and False once the bytes run out."""
        return self.int(0, n - 1) == n - 1


class Tagged(np.ndarray):
    """A subclass whose indexing would break naive code."""

    def __getitem__(self, item):
        raise RuntimeError("Tagged.__getitem__ called")


def unaligned(a):
    raw = np.zeros(a.nbytes + 1, np.uint8)
    u = raw[1:].view(a.dtype).reshape(a.shape)
    u[...] = a
    return u


def every_other(a):
    big = np.zeros(tuple(2 * s for s in a.shape), a.dtype)
    big[(slice(None, None, 2),) * a.ndim] = a
    return big[(slice(None, None, 2),) * a.ndim]


def reversed_view(a):
    r = np.ascontiguousarray(a[(slice(None, None, -1),) * a.ndim])
    return r[(slice(None, None, -1),) * a.ndim]


LAYOUTS = [
    lambda a: a, lambda a: a, lambda a: a, lambda a: a,
    reversed_view, every_other, np.asfortranarray, unaligned,
    lambda a: a.astype(a.dtype.newbyteorder("S")),
    lambda a: a.view(Tagged),
    lambda a: a.tolist(),
    lambda a: np.broadcast_to(a, a.shape),          # read-only view
]

GARBAGE = [
    None, "abc", 3.5, -1, 0, 2 ** 70, True, 1j, object(), [], [None], [[1.0], [2.0, 3.0]],
    np.float64(1.0), np.ones(3), np.ones((2, 2, 2, 2)), np.ones((1,) * 5),
    np.ones((3, 3), complex), np.ones((3, 3), object), np.array(["a", "b"]),
    np.ones((3, 3), bool), np.zeros((0, 0)), np.ones((3, 3), np.int8),
    np.array(np.nan), np.full((2, 3), np.inf), [np.ones((2, 2)), "x"],
    np.ma.masked_array(np.ones((3, 3)), np.eye(3, dtype=bool)),
]


try:   # ml_dtypes is a test dependency; without it bfloat16 is not fuzzed
    import ml_dtypes
    _BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    _BF16 = None


def build(d: Data):
    """Decode one call: (kwargs, corrupted) where corrupted names the
    argument replaced by garbage (None when the call is meant to be valid)."""
    rng = np.random.default_rng(d.int(0, 2 ** 16 - 1))
    dtype = d.pick([np.float32, np.float64, np.float64, np.float32, np.float16,
                    np.int32, np.int64])
    if dtype is np.float16 and _BF16 is not None and d.chance(2):
        dtype = _BF16   # half precision's other format (issue 36)
    wdtype = dtype if not d.chance(4) else d.pick([np.float32, np.float64, np.int16])

    def vals(shape, dt=dtype):
        return (rng.integers(-8, 9, shape) / 4).astype(dt)

    batched = bool(d.int(0, 1))
    B = d.int(0, 3) if batched else 1
    Tq = d.int(0, 6)
    cross = d.chance(2)
    Tk = d.int(0, 7) if cross else Tq
    d_in = d.int(0, 5)
    d_kin = d.int(0, 5) if cross else d_in
    d_vin = d.int(0, 5) if cross and d.chance(2) else d_kin
    H = d.int(1, 4)
    group = d.pick([g for g in (1, 2, 3, 4) if H % g == 0])
    G = H // group
    form = d.pick(["fused", "stacked", "list"])
    if form == "list":
        dk = [d.int(1, 4) for _ in range(G)]
        dv = [d.int(1, 4) for _ in range(G)]
    else:
        dk, dv = [d.int(1, 4)] * G, [d.int(1, 4)] * G

    def weights(rows, widths):
        heads = [vals((rows, w), wdtype) for w in widths]
        if form == "list":
            return heads
        if form == "stacked":
            return np.stack(heads)
        return np.concatenate(heads, axis=1)

    lead = (B,) if batched else ()
    kw = dict(x=vals(lead + (Tq, d_in)),
              w_q=weights(d_in, [dk[h // group] for h in range(H)]),
              w_k=weights(d_kin, dk), w_v=weights(d_vin, dv))
    if form == "fused" or d.chance(4):
        kw["num_heads"] = H
    if G != H:
        kw["num_kv_heads"] = G
    if cross:
        kw["key"] = vals(lead + (Tk, d_kin))
        if d_vin != d_kin or d.chance(2):
            kw["value"] = vals(lead + (Tk, d_vin))
    svq = sum(dv[h // group] for h in range(H))
    if d.chance(2):
        kw["w_o"] = vals((svq, d.int(0, 4)), wdtype)
    for name, widths in (("b_q", [dk[h // group] for h in range(H)]), ("b_k", dk),
                         ("b_v", dv)):
        if d.chance(5):
            kw[name] = vals((sum(widths),))
    if d.chance(5):
        kw["b_o"] = vals((kw["w_o"].shape[1] if "w_o" in kw else svq,))
    full = (B, H, Tq, Tk) if batched else (H, Tq, Tk)
    m = d.int(0, 5)
    if m in (1, 2, 3):
        shape = tuple(s if d.chance(2) else 1 for s in full)[d.int(0, len(full)):]
        if m == 1:
            kw["mask"] = rng.random(shape) > 0.3
        else:
            mk = rng.integers(-2, 3, shape).astype(np.float64)
            mk[rng.random(shape) < 0.3] = -np.inf
            kw["mask"] = mk.astype(d.pick([np.float32, np.float64, np.float16]))
    if d.chance(4):
        kl = rng.integers(0, Tk + 1, (B,) if batched else ())
        kw["key_lengths"] = kl if batched or d.chance(2) else int(kl)
    kw["causal"] = bool(d.int(0, 1))
    kw["scale"] = d.pick([None, None, None, None, 0.5, 1, 2.0, 0.0, -1.0, np.float32(0.25),
                          np.int64(3), np.array(0.5), 1e30, np.nan, np.inf])
    kw["return_weights"] = bool(d.int(0, 1))

    # Non-finite values, here and there.
    if d.chance(6):
        for name in ("x", "key", "value", "w_q", "mask"):
            a = kw.get(name)
            if isinstance(a, np.ndarray) and a.size and a.dtype.kind == "f" and d.chance(2):
                a = a.copy()
                a.flat[d.int(0, a.size - 1)] = d.pick([np.nan, np.inf, -np.inf])
                kw[name] = a

    # Memory layouts: none of them may change a bit of the result.
    for name in ("x", "key", "value", "w_o", "mask", "b_o"):
        a = kw.get(name)
        if isinstance(a, np.ndarray) and d.chance(3):
            kw[name] = d.pick(LAYOUTS)(a)
    for name in ("w_q", "w_k", "w_v"):
        w = kw[name]
        if d.chance(3):
            lay = d.pick(LAYOUTS)
            kw[name] = [lay(a) for a in w] if isinstance(w, list) else lay(w)

    corrupted = None
    if d.chance(6):
        corrupted = d.pick(ARGS)
        kw[corrupted] = d.pick(GARBAGE)
    variants(d, rng, kw, vals, batched, B, H, G, Tq, Tk, dk, cross)
    if d.rarely(8):
        corrupted = d.pick(VARIANTS)
        kw[corrupted] = d.pick(GARBAGE)
    if d.rarely(3):
        kw["_attention"] = attention_case(d, rng, vals, batched, B, H, G, Tq, Tk)
    if d.rarely(4):
        kw["_packed"] = True    # the call again through mhattn.pack_weights
    return kw, corrupted


def attention_case(d, rng, vals, batched, B, H, G, Tq, Tk):
    """mhattn.attention's keywords on projected tensors of the decoded sizes:
    either layout, any memory layout, the score variants, now and then a
    bad value."""
    layout = d.pick(["bhtd", "bthd"])
    dk, dv = d.int(1, 4), d.int(1, 4)

    def t(heads, T, width):
        shape = (heads, T, width) if layout == "bhtd" else (T, heads, width)
        a = vals(((B,) if batched else ()) + shape)
        return d.pick(LAYOUTS[:9])(a) if d.chance(3) else a
    kw = dict(q=t(H, Tq, dk), k=t(G, Tk, dk), v=t(G, Tk, dv), layout=layout,
              causal=bool(d.int(0, 1)))
    lead = (B,) if batched else ()
    if d.chance(3):
        kw["window"] = (d.pick([None, 0, 1, 3]), d.pick([None, 0, 2]))
    if d.chance(4):
        kw["softcap"] = d.pick([1.0, 5.0, -1.0])
    if d.chance(4):
        kw["sinks"] = vals((d.pick([H, H, H + 1]),))
    if d.chance(4):
        kw["key_mask"] = rng.random(lead + (Tk,)) > 0.3
    if d.chance(4):
        kw["alibi_slopes"] = rng.random((H,))
    if d.chance(4):
        kw["return_lse"] = True
    if d.chance(6):
        kw[d.pick(["q", "k", "v", "layout", "window", "scale"])] = d.pick(GARBAGE)
    return kw


def _split(rng, total, n):
    """n + 1 packed offsets [0, ..., total], empty sequences included."""
    cuts = np.sort(rng.integers(0, total + 1, n - 1))
    return np.concatenate([[0], cuts, [total]]).astype(np.int64)


def variants(d, rng, kw, vals, batched, B, H, G, Tq, Tk, dk, cross):
    """Adds the variants' keywords to kw, each now and then, sometimes with a
    bad value (a negative window side, an odd rotary_dim...)."""
    lead = (B,) if batched else ()
    side = [None, 0, 1, 2, 5, -1]
    if d.rarely(4):
        kw["window"] = (d.pick(side), d.pick(side))
    if d.rarely(4):
        kw["softcap"] = d.pick([0.5, 1.0, 4.0, 30.0, 0.0, -1.0, np.nan])
    if d.rarely(5):
        kw["alibi_slopes"] = rng.random(lead + (H,) if d.chance(2) else (H,))
    if d.rarely(4):
        kw["sinks"] = vals((d.pick([H, H, H, H + 1]),))
    same = len(set(dk)) == 1
    if d.rarely(5):
        kw["q_norm"] = vals((dk[0],) if same and d.chance(2) else (H, dk[0]))
    if d.rarely(5):
        kw["k_norm"] = vals((dk[0],) if same and d.chance(2) else (G, dk[0]))
    if ("q_norm" in kw or "k_norm" in kw) and d.chance(3):
        kw["norm_eps"] = d.pick([1e-6, 0.0, 0.25, -1.0])
    if d.rarely(4):
        rd = d.pick([None, 2, 4, min(dk), min(dk) - min(dk) % 2, 3])
        kw["rope"] = mhattn_rope(rotary_dim=rd or None, interleaved=bool(d.int(0, 1)),
                                 theta=d.pick([10000.0, 10.0, 1e6]))
        if d.chance(3):
            kw["positions"] = rng.integers(-4, 40, lead + (Tq,) if d.chance(2) else (Tq,))
        if d.chance(3):
            kw["key_positions"] = rng.integers(0, 40, (Tk,))
    if d.rarely(4):
        kw["key_mask"] = rng.random(lead + (Tk,)) > 0.3
    if not batched and d.rarely(4):
        n = d.int(1, 4)
        kw["cu_seqlens"] = _split(rng, Tq, n)
        if cross:
            kw["key_cu_seqlens"] = _split(rng, Tk, n)
        kw.pop("key_lengths", None)
    # The q/k norm's kind (issue 38), decoded last: older inputs replay as
    # they did (rarely is False once their bytes run out).
    if d.rarely(4):
        kw["norm_type"] = d.pick(["layer", "layer", "rms", "batch"])
    # Dropout and T5's relative bias (issue 38), decoded after it, likewise.
    if d.rarely(5):
        kw["dropout"] = d.pick([0.1, 0.5, 0.0, 0.9, 1.0, -0.25])
        kw["seed"] = d.pick([0, 1, 2 ** 64 - 1, -1])
    if d.rarely(5):
        nb = d.pick([4, 8, 32, 3])
        kw["relative_bias"] = mhattn_relative_bias(
            vals((nb, d.pick([H, H, H, H + 1]))), nb, d.pick([2, 8, 128, 1]),
            bool(d.int(0, 1)))
    # Chunks and block masks (issue 39), decoded after them, likewise: a
    # block mask of the call's shape (or of one more key), sparse to dense,
    # in blocks that need not divide T.
    if d.rarely(5):
        kw["chunk"] = d.pick([1, 3, 16, 0, -2])
    if d.rarely(5):
        shape = d.pick([(Tq, Tk), (H, Tq, Tk), lead + (H, Tq, Tk), (Tq, Tk + 1)])
        kw["block_mask"] = mhattn_block_mask(rng.random(shape) < d.pick([0.0, 0.1, 0.6, 1.0]),
                                             (d.int(1, 9), d.int(1, 9)))


def mhattn_block_mask(dense, block):
    """mhattn.BlockMask.from_dense(...), or the garbage its checks refuse."""
    import mhattn
    try:
        return mhattn.BlockMask.from_dense(dense, block=block)
    except (TypeError, ValueError):
        return "not a BlockMask"


def mhattn_relative_bias(table, nb, md, bidirectional):
    """mhattn.RelativeBias(...), or the garbage its checks refuse."""
    import mhattn
    try:
        return mhattn.RelativeBias(table, nb, md, bidirectional)
    except (TypeError, ValueError):
        return "not a RelativeBias"


def mhattn_rope(**kw):
    """mhattn.RoPE(**kw), or the garbage its checks refuse."""
    import mhattn
    try:
        return mhattn.RoPE(**kw)
    except (TypeError, ValueError):
        return "not a RoPE"


NAME_RE = re.compile(r"\b(" + "|".join(ARGS + VARIANTS + LATER_VARIANTS) +
                     r"|d_model|d_k|d_v|rotary_dim|inv_freq|q|k|v|layout)\b")


def check_error(exc: BaseException):
    msg = str(exc)
    head = msg.split(":", 1)[0]
    assert ":" in msg and NAME_RE.search(head), (
        f"{type(exc).__name__} does not name the argument: {msg!r}")


def tolerance(dtype):
    """Relative to the largest magnitude. A half result is the float32 one
    rounded once: within half an ulp (float16 2^-11, bfloat16 2^-8) plus
    float32's own error, held to one ulp here."""
    if dtype == np.float16:
        return 2.0 ** -10
    if dtype.kind == "V":   # bfloat16 (ml_dtypes)
        return 2.0 ** -7
    return 1e-4 if dtype == np.float32 else 1e-10


def _is_half(dt):
    return dt == np.float16 or (dt.kind == "V" and dt.itemsize == 2 and dt.fields is None)


def compare(got, ref, what, values=True):
    assert type(got) is np.ndarray and got.flags.c_contiguous, what
    # half results are held to the reference's float64 (its half oracle)
    assert (got.dtype == ref.dtype or _is_half(got.dtype) and ref.dtype == np.float64) \
        and got.shape == ref.shape, (what, got.dtype, ref.dtype, got.shape, ref.shape)
    tol = tolerance(got.dtype)
    if _is_half(got.dtype):
        got = got.astype(np.float64)
    if not values:
        assert not np.isnan(got).any() or np.isnan(ref).any(), f"{what}: NaN from C only"
        return
    if not np.isfinite(ref).all():
        return
    assert np.isfinite(got).all(), f"{what}: reference finite, C not"
    scale = max(1.0, float(np.abs(ref).max())) if ref.size else 1.0
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * scale, err_msg=what)


def ill_conditioned(kw) -> bool:
    """True when a rounding of q or k can move a score by whole units: an
    inexact q or k (q/k norm, RoPE) under a scale beyond 1e3."""
    if not any(kw.get(n) is not None for n in ("q_norm", "k_norm", "rope")):
        return False
    try:
        s = abs(float(np.asarray(kw.get("scale", None) or 0.0, dtype=np.float64)))
    except (TypeError, ValueError):
        return False
    return bool(np.isfinite(s) and s > 1e3)


def test_one_input(data: bytes) -> None:
    import mhattn
    from mhattn import reference

    kw, corrupted = build(Data(data))
    packed = kw.pop("_packed", False)
    att = kw.pop("_attention", None)
    if att is not None:
        check_attention(att)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        try:
            got = mhattn.multi_head_attention(**kw)
        except (TypeError, ValueError) as e:
            check_error(e)
            return
        except MemoryError:
            return
        if packed:
            check_packed(kw, got)
        ref = reference.multi_head_attention(**kw)
    got, ref = (got, ref) if kw["return_weights"] else ((got,), (ref,))
    values = not ill_conditioned(kw)
    for what, g, r in zip(("out", "weights"), got, ref):
        compare(g, r, what, values=values)


_WEIGHT_ARGS = ("w_q", "w_k", "w_v", "w_o", "num_heads", "num_kv_heads")


def check_packed(kw, got):
    """A call that worked, again with its weights packed: the same bits (or
    a named error from pack_weights, which checks the weights alone)."""
    import mhattn
    try:
        packed = mhattn.pack_weights(kw["w_q"], kw["w_k"], kw["w_v"], kw.get("w_o"),
                                     num_heads=kw.get("num_heads"),
                                     num_kv_heads=kw.get("num_kv_heads"))
    except (TypeError, ValueError) as e:
        check_error(e)
        return
    again = mhattn.multi_head_attention(
        kw["x"], packed, **{k: v for k, v in kw.items() if k not in _WEIGHT_ARGS + ("x",)})
    for g, a in zip(got if isinstance(got, tuple) else (got,),
                    again if isinstance(again, tuple) else (again,)):
        assert g.dtype == a.dtype and g.shape == a.shape, "packed: dtype or shape"
        assert np.array_equal(g, a, equal_nan=True), "packed: not the unpacked bits"


def check_attention(kw):
    """mhattn.attention against the reference's, or a named error."""
    import mhattn
    from mhattn import reference
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        try:
            got = mhattn.attention(**kw)
        except (TypeError, ValueError) as e:
            check_error(e)
            return
        except MemoryError:
            return
        ref_out, _, ref_lse = reference.projected_attention(
            **{k: v for k, v in kw.items() if k != "return_lse"})
    if kw.get("return_lse"):
        compare(got[0], ref_out, "attention out")
        if _is_half(got[0].dtype):   # a half call's lse is float32
            assert got[1].dtype == np.float32, ("attention lse", got[1].dtype)
            ref_lse = ref_lse.astype(np.float32)
        compare(got[1], ref_lse, "attention lse")
    else:
        compare(got, ref_out, "attention out")


# atheris's name for the one-input function
TestOneInput = test_one_input


def inputs_in(paths):
    """The files given, and the files in the directories given, sorted."""
    for path in paths:
        if os.path.isdir(path):
            for f in sorted(os.listdir(path)):
                yield os.path.join(path, f)
        else:
            yield path


def main(argv, one_input=None):
    """Replay files (``--replay PATH...``) or fuzz with atheris; ``one_input``
    is the harness's property (this file's, or fuzz_entry_points')."""
    one_input = test_one_input if one_input is None else one_input
    if len(argv) > 1 and argv[1] == "--replay":
        for f in inputs_in(argv[2:]):
            with open(f, "rb") as fh:
                one_input(fh.read())
        return
    import atheris
    with atheris.instrument_imports(include=["mhattn"]):
        import mhattn  # noqa: F401 - instrumented for coverage feedback
        import mhattn.reference  # noqa: F401
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
