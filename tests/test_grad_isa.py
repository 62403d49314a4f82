"""Gradients on every instruction-set path (scalar, avx2, avx512 where the
CPU has them), float32 and float64, on awkward shapes: head widths that are
not a multiple of any SIMD width (so the tile products' masked and leftover
columns run), sequence lengths that are not a multiple of the 64-row tile
(leftover rows, partial key blocks), T = 1, GQA, causal, masks and key
lengths. Each path is checked against finite differences in float64, its
float32 against its float64, and for bitwise determinism over thread counts
(which also switches the backward between its fused and two-pass plans)."""
import numpy as np
import pytest

import mhattn
from mhattn import _C

POSITIONAL = ("x", "w_q", "w_k", "w_v", "w_o")
DIFFERENTIABLE = ("x", "key", "value", "w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v",
                  "b_o")


@pytest.fixture
def restore_threads():
    before = _C.get_num_threads()
    yield
    _C.set_num_threads(before)


def rnd(rng, *shape):
    return rng.standard_normal(shape)


def case_wide_ragged(rng):
    # Widths 5, 17, 40: one partial vector, one full + one lane, 2.5 f32
    # vectors; T = 70 queries, 130 keys: one full tile and a partial one.
    return dict(x=rnd(rng, 2, 70, 9), key=rnd(rng, 2, 130, 7),
                w_q=[rnd(rng, 9, 5), rnd(rng, 9, 17), rnd(rng, 9, 40)],
                w_k=[rnd(rng, 7, 5), rnd(rng, 7, 17), rnd(rng, 7, 40)],
                w_v=[rnd(rng, 7, 3), rnd(rng, 7, 33), rnd(rng, 7, 20)],
                w_o=rnd(rng, 56, 6), b_q=rnd(rng, 62), b_o=rnd(rng, 6))


def case_gqa_causal(rng):
    # 4 query heads of width 24 over 2 kv heads, causal, Tq = 65 < Tk = 129,
    # key lengths cutting inside a block, a bool mask, biases.
    return dict(x=rnd(rng, 2, 65, 8), key=rnd(rng, 2, 129, 8),
                w_q=rnd(rng, 4, 8, 24), w_k=rnd(rng, 2, 8, 24), w_v=rnd(rng, 2, 8, 12),
                w_o=rnd(rng, 48, 5), num_kv_heads=2, causal=True, key_lengths=[129, 71],
                mask=rng.random((2, 1, 65, 129)) < 0.8, b_k=rnd(rng, 2, 24),
                b_v=rnd(rng, 24))


def case_self_odd(rng):
    # Self-attention, T = 63 (one short tile), 3 heads of width 33, a float
    # mask broadcast over the batch, no W^O.
    return dict(x=rnd(rng, 2, 63, 11), w_q=rnd(rng, 11, 99), w_k=rnd(rng, 11, 99),
                w_v=rnd(rng, 11, 99), num_heads=3, mask=0.5 * rnd(rng, 3, 63, 63))


def case_t1(rng):
    # One query, one key.
    return dict(x=rnd(rng, 3, 1, 6), w_q=rnd(rng, 6, 14), w_k=rnd(rng, 6, 14),
                w_v=rnd(rng, 6, 14), w_o=rnd(rng, 14, 4), num_heads=2, b_q=rnd(rng, 14))


CASES = {"wide_ragged": case_wide_ragged, "gqa_causal": case_gqa_causal,
         "self_odd": case_self_odd, "t1": case_t1}


def cast(params, dtype):
    def c(v):
        if isinstance(v, np.ndarray) and v.dtype == np.float64:
            return v.astype(dtype)
        if isinstance(v, list) and v and isinstance(v[0], np.ndarray):
            return [a.astype(dtype) for a in v]
        return v
    return {k: c(v) for k, v in params.items()}


def forward(params):
    p = dict(params)
    args = [p.pop(n, None) for n in POSITIONAL]
    return mhattn.multi_head_attention(*args, **p)


def grads(params, R):
    p = dict(params)
    args = [p.pop(n, None) for n in POSITIONAL]
    return mhattn.multi_head_attention_grad(R, *args, **p)


def as_list(g):
    return g if isinstance(g, list) else [g]


def make(case):
    rng = np.random.default_rng(sorted(CASES).index(case) + 700)
    p = CASES[case](rng)
    R = rnd(rng, *forward(p).shape)
    return p, R, rng


@pytest.mark.parametrize("case", list(CASES))
def test_float64_against_finite_differences(isa, case):
    """Directional derivatives along a random direction per argument (per
    list entry), by central differences of L = sum(out R) in float64."""
    p, R, rng = make(case)
    out = forward(p)
    g = grads(p, R)
    names = [n for n in DIFFERENTIABLE if p.get(n) is not None]
    assert list(g) == names
    # Rounding in the loss, ~eps sum|out R|, over the step: the floor for
    # a derivative that is zero in exact arithmetic (b_k's).
    step = 1e-6
    noise = 10 * np.finfo(float).eps * np.sum(np.abs(out * R)) / step
    for name in names:
        entries = p[name] if isinstance(p[name], list) else [p[name]]
        for i, (a, ga) in enumerate(zip(entries, as_list(g[name]))):
            assert ga.shape == np.shape(a), name
            d = rnd(rng, *np.shape(a))

            def moved(s, name=name, i=i, a=a, d=d):
                v = a + s * step * d
                if isinstance(p[name], list):
                    v = [v if j == i else e for j, e in enumerate(p[name])]
                return dict(p, **{name: v})

            fd = (np.sum(forward(moved(1)) * R) - np.sum(forward(moved(-1)) * R)) / (2 * step)
            scale = float(np.sum(np.abs(ga * d)))
            np.testing.assert_allclose(np.sum(ga * d), fd, rtol=1e-7,
                                       atol=max(1e-7 * scale, noise),
                                       err_msg=f"{isa}: {name}[{i}]")


@pytest.mark.parametrize("case", list(CASES))
def test_float32_against_float64(isa, case):
    """float32 gradients carry float32 rounding through the recomputed
    softmax and sums of up to ~130 terms: 1e-4 of the gradients' scale."""
    p, R, _ = make(case)
    g64 = grads(p, R)
    g32 = grads(cast(p, np.float32), R.astype(np.float32))
    scale = max(float(np.abs(a).max(initial=0.0)) for v in g64.values() for a in as_list(v))
    for k in g64:
        for a32, a64 in zip(as_list(g32[k]), as_list(g64[k])):
            assert a32.dtype == np.float32
            np.testing.assert_allclose(a32, a64, rtol=1e-4, atol=1e-4 * scale,
                                       err_msg=f"{isa}: {k}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["wide_ragged", "gqa_causal"])
def test_paths_agree_to_rounding(isa, case, dtype):
    """Every path against the portable one: rounding apart, the same."""
    p, R, _ = make(case)
    p, R = cast(p, dtype), R.astype(dtype)
    here = grads(p, R)
    mhattn._set_isa("scalar")
    ref = grads(p, R)
    mhattn._set_isa(isa)
    rtol = 1e-4 if dtype == np.float32 else 1e-11
    scale = max(float(np.abs(a).max(initial=0.0)) for v in ref.values() for a in as_list(v))
    for k in ref:
        for a, b in zip(as_list(here[k]), as_list(ref[k])):
            np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale,
                                       err_msg=f"{isa}: {k}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["wide_ragged", "gqa_causal"])
def test_bitwise_identical_across_thread_counts(isa, case, dtype, restore_threads):
    p, R, _ = make(case)
    p, R = cast(p, dtype), R.astype(dtype)
    out, ctx = mhattn.multi_head_attention(
        *[p.get(n) for n in POSITIONAL],
        **{k: v for k, v in p.items() if k not in POSITIONAL}, return_context=True)
    results = {}
    for n in (1, 2, 3, 8):
        _C.set_num_threads(n)
        results[n] = mhattn.backward(R, ctx)
    for n in (2, 3, 8):
        for k in results[1]:
            for a, b in zip(as_list(results[n][k]), as_list(results[1][k])):
                np.testing.assert_array_equal(a, b, err_msg=f"{isa}: {k}, {n} threads")
