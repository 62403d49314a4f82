"""The fast paths: every SIMD variant this machine runs against the NumPy
reference, results independent of the thread count, the GIL released, and
NaN / Inf / fully masked rows on every variant.

The fused attention kernel works in tiles of 96 (portable C) or 192 (SIMD)
query rows and 64 keys (csrc/kernels/flash.h), so the grid has sequences longer
than one tile with ragged ends, head widths that are not a multiple of the
SIMD width, and every mask and padding feature that cuts tiles.
"""
import threading
import time
import warnings

import numpy as np
import pytest

import mhattn
from mhattn import reference
from mhattn._internal.args import normalize
from mhattn._internal.core import run_core
from conftest import ALL_ISAS, ISAS, tol

DTYPES = [np.float32, np.float64]


@pytest.fixture
def threads():
    """Restores the thread count the test started with."""
    before = mhattn.get_num_threads()
    yield
    mhattn.set_num_threads(before)


# --------------------------------------------------------------------------
# configurations

def build(seed, dtype, *, B=2, Tq=5, Tk=5, heads=((2, 8, 8),), num_kv=None,
          mask=None, causal=False, key_lengths=None, biases=False, d_in=6,
          d_out=7, scale_x=1.0):
    """(args, kwargs) of a call. heads: one (count, dk, dv) per kv head
    group; a single group of equal widths gives fused weights, several give
    lists of ragged heads. Weights are scaled by 1/sqrt(d_in), so scores are
    O(1) whatever the head width and float32 stays within 1e-5."""
    rng = np.random.default_rng(seed)
    lead = () if B is None else (B,)
    x = (rng.standard_normal(lead + (Tq, d_in)) * scale_x).astype(dtype)
    kw = {}
    if Tk != Tq or key_lengths is not None:
        kw["key"] = rng.standard_normal(lead + (Tk, d_in)).astype(dtype)
        kw["value"] = rng.standard_normal(lead + (Tk, d_in + 2)).astype(dtype)
    d_v_in = d_in + 2 if "value" in kw else d_in
    dks = [dk for n, dk, _ in heads for _ in range(n)]
    dvs = [dv for n, _, dv in heads for _ in range(n)]
    h = len(dks)
    g = num_kv or h
    per = h // g
    kv_dks, kv_dvs = dks[::per], dvs[::per]

    def w(d_from, widths):
        return [(rng.standard_normal((d_from, d)) / np.sqrt(d_from)).astype(dtype)
                for d in widths]
    wq, wk, wv = w(d_in, dks), w(d_in, kv_dks), w(d_v_in, kv_dvs)
    w_o = (rng.standard_normal((sum(dvs), d_out)) / np.sqrt(sum(dvs))).astype(dtype)
    if num_kv:
        kw["num_kv_heads"] = num_kv
    if biases:
        kw["b_q"] = [rng.standard_normal(d).astype(dtype) for d in dks]
        kw["b_k"] = [rng.standard_normal(d).astype(dtype) for d in kv_dks]
        kw["b_v"] = [rng.standard_normal(d).astype(dtype) for d in kv_dvs]
        kw["b_o"] = rng.standard_normal(d_out).astype(dtype)
    if mask is not None:
        kind, shape = mask
        shape = tuple({"B": B or 1, "H": h, "Q": Tq, "K": Tk, "1": 1}[c] for c in shape)
        if kind == "bool":
            kw["mask"] = rng.random(shape) < 0.7
        else:
            m = rng.standard_normal(shape).astype(dtype)
            m[rng.random(shape) < 0.2] = -np.inf
            kw["mask"] = m
    if key_lengths is not None:
        kw["key_lengths"] = key_lengths
    kw["causal"] = causal
    return (x, wq, wk, wv, w_o), kw


# name: keyword arguments of build()
CASES = {
    "T1": dict(Tq=1, Tk=1, heads=((1, 3, 3),)),
    "T1_unbatched": dict(B=None, Tq=1, Tk=1, heads=((2, 1, 1),)),
    "q1_long_cache": dict(B=1, Tq=1, Tk=150, heads=((2, 64, 64),), causal=True),
    "dk1": dict(Tq=7, Tk=9, heads=((3, 1, 1),)),
    "dk3_cross": dict(B=3, Tq=13, Tk=29, heads=((2, 3, 5),)),
    "dk8": dict(Tq=33, Tk=33, heads=((4, 8, 8),), causal=True),
    "dk17_ragged_tiles": dict(B=1, Tq=97, Tk=130, heads=((2, 17, 17),)),
    "dk64": dict(B=1, Tq=100, Tk=200, heads=((2, 64, 64),)),
    "dk64_causal_long": dict(B=1, Tq=200, Tk=200, heads=((2, 64, 64),), causal=True),
    "three_query_tiles": dict(B=1, Tq=400, Tk=300, heads=((2, 8, 8),), causal=True,
                              mask=("bool", "K")),
    "dk80": dict(B=1, Tq=70, Tk=66, heads=((1, 80, 80),)),
    "ragged_heads": dict(B=3, Tq=19, Tk=70, heads=((1, 1, 3), (1, 4, 1), (1, 9, 7),
                                                 (1, 2, 16))),
    "ragged_big": dict(B=1, Tq=100, Tk=100, heads=((1, 64, 17), (1, 3, 80)),
                       causal=True),
    "gqa": dict(Tq=11, Tk=11, heads=((4, 8, 8),), num_kv=2, causal=True),
    "mqa_dv_ne_dk": dict(B=1, Tq=40, Tk=90, heads=((4, 17, 5),), num_kv=1),
    "causal_q_lt_k": dict(B=3, Tq=20, Tk=150, heads=((2, 8, 8),), causal=True),
    "causal_q_gt_k": dict(B=3, Tq=150, Tk=20, heads=((2, 8, 8),), causal=True),
    "key_lengths": dict(B=3, Tq=30, Tk=140, heads=((2, 8, 8),),
                        key_lengths=[140, 0, 65]),
    "key_lengths_causal": dict(B=3, Tq=100, Tk=100, heads=((2, 16, 16),), causal=True,
                               key_lengths=[1, 64, 100]),
    "bool_full": dict(B=3, Tq=20, Tk=70, heads=((2, 8, 8),), mask=("bool", "BHQK")),
    "bool_keys": dict(B=3, Tq=20, Tk=70, heads=((2, 8, 8),), mask=("bool", "K")),
    "bool_rows": dict(B=1, Tq=100, Tk=70, heads=((2, 8, 8),), mask=("bool", "Q1"),
                      causal=True),
    "float_full": dict(B=3, Tq=20, Tk=70, heads=((2, 8, 8),), mask=("float", "BHQK")),
    "float_heads": dict(B=2, Tq=20, Tk=130, heads=((3, 17, 17),),
                        mask=("float", "H1K")),  # B != h: (h, 1, Tk) is unambiguous
    "float_rows": dict(B=1, Tq=25, Tk=70, heads=((2, 8, 8),), mask=("float", "Q1")),
    "biases": dict(B=3, Tq=9, Tk=9, heads=((2, 5, 5),), biases=True, causal=True),
    "everything": dict(B=3, Tq=100, Tk=130, heads=((4, 17, 9),), num_kv=2,
                       mask=("bool", "BHQK"), causal=True, key_lengths=[130, 5, 0],
                       biases=True),
}


def call_both(args, kw, want_weights):
    """(C out, C weights or None), reference (out, weights)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # masks that block every key warn
        got = mhattn.multi_head_attention(*args, return_weights=want_weights, **kw)
        want = reference.multi_head_attention(*args, return_weights=True, **kw)
    if not want_weights:
        got = (got, None)
    return got, want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("want_weights", [True, False], ids=["weights", "no_weights"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_grid_against_reference(isa, case, want_weights, dtype):
    args, kw = build(7, dtype, **CASES[case])
    (out, weights), (ref_out, ref_weights) = call_both(args, kw, want_weights)
    assert out.dtype == dtype and out.shape == ref_out.shape
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref_out, **tol(dtype))
    if want_weights:
        assert weights.dtype == dtype and weights.shape == ref_weights.shape
        np.testing.assert_allclose(weights, ref_weights, **tol(dtype))
        # Blocked keys get exactly 0, and rows sum to 1 or (fully masked) 0.
        assert np.all(weights[ref_weights == 0] == 0)
        sums = weights.sum(-1)
        full = np.isclose(sums, 1, rtol=0, atol=1e-5) | (sums == 0)
        assert np.all(full)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["dk64_causal_long", "everything", "ragged_heads",
                                  "key_lengths_causal", "causal_q_gt_k"])
def test_lse_against_reference(isa, case, dtype):
    """lse (kept for the backward) = log sum exp of the masked, scaled scores."""
    args, kw = build(11, dtype, **CASES[case])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        call = normalize(*args, **kw)
    out, _, (q, k, v, concat, lse) = run_core(call, keep=True)
    for b in range(call.B):
        for h in range(call.H):
            s = reference.head_intermediates(call, b, h)["scores"].astype(np.float64)
            m = s.max(-1, keepdims=True, initial=-np.inf)
            safe = np.where(np.isneginf(m), 0, m)
            with np.errstate(divide="ignore"):
                want = (safe + np.log(np.exp(s - safe).sum(-1, keepdims=True)))[:, 0]
            got = lse[b, h].astype(np.float64)
            assert np.array_equal(np.isneginf(got), np.isneginf(want))
            fin = np.isfinite(want)
            np.testing.assert_allclose(got[fin], want[fin], **tol(dtype))


# --------------------------------------------------------------------------
# determinism

def bits(a):
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["dk64_causal_long", "everything", "ragged_heads",
                                  "causal_q_gt_k", "dk17_ragged_tiles"])
def test_bitwise_identical_across_thread_counts(isa, threads, case, dtype):
    args, kw = build(3, dtype, **dict(CASES[case], B=3))
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in (1, 2, 3, 8):
            mhattn.set_num_threads(n)
            assert mhattn.get_num_threads() == n
            out, weights = mhattn.multi_head_attention(*args, return_weights=True, **kw)
            plain = mhattn.multi_head_attention(*args, **kw)
            results[n] = (out, weights)
            # out does not depend on whether the weights were asked for
            np.testing.assert_array_equal(bits(out), bits(plain))
    for n in (2, 3, 8):
        np.testing.assert_array_equal(bits(results[n][0]), bits(results[1][0]))
        np.testing.assert_array_equal(bits(results[n][1]), bits(results[1][1]))


def test_set_num_threads_default_and_errors(threads):
    mhattn.set_num_threads(3)
    assert mhattn.get_num_threads() == 3
    mhattn.set_num_threads(None)
    default = mhattn.get_num_threads()
    assert default >= 1
    mhattn.set_num_threads(5)
    mhattn.set_num_threads(0)
    assert mhattn.get_num_threads() == default
    with pytest.raises(ValueError, match="n"):
        mhattn.set_num_threads(-1)
    with pytest.raises(TypeError, match="n"):
        mhattn.set_num_threads(2.0)
    with pytest.raises(TypeError, match="n"):
        mhattn.set_num_threads(True)


def test_isa_names_and_forcing():
    before = mhattn.get_isa()
    assert before in ALL_ISAS
    try:
        assert mhattn._set_isa("scalar") == "scalar" == mhattn.get_isa()
        # Forcing is only ever downward: asking for more gives the best there is.
        assert mhattn._set_isa("avx512") == ALL_ISAS[-1]
        with pytest.raises(ValueError, match="avx2"):
            mhattn._set_isa("sse")
    finally:
        mhattn._set_isa(before)


def test_env_isa_and_threads_are_read(tmp_path):
    """MHATTN_ISA and MHATTN_NUM_THREADS, in a fresh interpreter."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, MHATTN_ISA="scalar", MHATTN_NUM_THREADS="3")
    code = "import mhattn; print(mhattn.get_isa(), mhattn.get_num_threads())"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    assert res.stdout.split() == ["scalar", "3"]


# --------------------------------------------------------------------------
# the GIL is released

@pytest.mark.slow
def test_two_python_threads_run_concurrently(threads):
    """Two threads call mhattn in a loop; with the GIL released their calls
    overlap in time (on any number of cores: both are inside C at once).
    Were the GIL held, only the short Python parts around each call could
    overlap."""
    mhattn.set_num_threads(1)
    rng = np.random.default_rng(0)
    T = 256
    while True:   # calibrate: one call of about 50 ms or more
        x = rng.standard_normal((1, T, 16)).astype(np.float32)
        w = rng.standard_normal((16, 256)).astype(np.float32)
        t0 = time.perf_counter()
        mhattn.multi_head_attention(x, w, w, w, num_heads=4)
        took = time.perf_counter() - t0
        if took >= 0.05 or T >= 8192:
            break
        T *= 2
    spans = {0: [], 1: []}
    stop = time.perf_counter() + max(1.0, 8 * took)

    def work(k):
        while time.perf_counter() < stop or len(spans[k]) < 3:
            t0 = time.perf_counter()
            mhattn.multi_head_attention(x, w, w, w, num_heads=4)
            spans[k].append((t0, time.perf_counter()))

    ths = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    overlap = sum(max(0.0, min(a1, b1) - max(a0, b0))
                  for a0, a1 in spans[0] for b0, b1 in spans[1])
    busy = min(sum(b - a for a, b in spans[k]) for k in (0, 1))
    assert overlap > 0.3 * busy, (overlap, busy)


# --------------------------------------------------------------------------
# NaN, Inf and fully masked rows, on every ISA
#
# The C core lets a NaN score poison its row (output and weights NaN), so a
# NaN input is never mistaken for a fully masked row; the reference's
# softmax maps such rows to zeros instead. So rows hit by a NaN are checked
# to be NaN, and every other row against the reference.

def check_other_rows(got, want, poisoned, dtype):
    """got, want (..., Tq, X); poisoned (..., Tq) bool: rows that must hold
    NaN (all of an output row; the visible keys of a weights row)."""
    assert np.all(np.isnan(got[poisoned]).any(-1))
    assert np.all(np.isfinite(got[~poisoned]))
    np.testing.assert_allclose(got[~poisoned], want[~poisoned], **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_query_poisons_its_row_only(isa, dtype):
    args, kw = build(5, dtype, B=2, Tq=100, Tk=130, heads=((2, 17, 17),))
    args[0][1, 37, 2] = np.nan
    (out, weights), (ref_out, ref_weights) = call_both(args, kw, True)
    rows = np.zeros(out.shape[:2], bool)
    rows[1, 37] = True
    assert np.all(np.isnan(out[1, 37]))
    check_other_rows(out, ref_out, rows, dtype)
    check_other_rows(weights, ref_weights, np.broadcast_to(rows[:, None], weights.shape[:3]),
                     dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_key_poisons_the_rows_that_see_it(isa, dtype):
    args, kw = build(5, dtype, B=1, Tq=100, Tk=100, heads=((2, 8, 8),), causal=True,
                     key_lengths=[100])
    kw["key"][0, 70, 0] = np.nan
    (out, weights), (ref_out, ref_weights) = call_both(args, kw, True)
    rows = np.zeros(out.shape[:2], bool)
    rows[0, 70:] = True              # query i sees key 70 iff i >= 70
    assert np.all(np.isnan(out[0, 70:]))
    check_other_rows(out, ref_out, rows, dtype)
    check_other_rows(weights, ref_weights, np.broadcast_to(rows[:, None], weights.shape[:3]),
                     dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_value_gives_nan_where_attended(isa, dtype):
    args, kw = build(5, dtype, B=1, Tq=100, Tk=100, heads=((2, 8, 8),), causal=True,
                     key_lengths=[100])
    kw["value"][0, 70, 0] = np.nan
    (out, weights), (ref_out, ref_weights) = call_both(args, kw, True)
    assert np.all(np.isnan(out[0, 70:]))
    assert np.all(np.isfinite(out[0, :64]))   # key blocks past the diagonal are skipped
    np.testing.assert_allclose(weights, ref_weights, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_plus_inf_in_float_mask_poisons_its_row(isa, dtype):
    args, kw = build(5, dtype, B=1, Tq=20, Tk=70, heads=((2, 8, 8),),
                     mask=("float", "BHQK"))
    kw["mask"][0, 1, 4, 66] = np.inf     # exp(inf - inf)
    (out, weights), (ref_out, ref_weights) = call_both(args, kw, True)
    rows = np.zeros(out.shape[:2], bool)
    rows[0, 4] = True
    check_other_rows(out, ref_out, rows, dtype)
    wrows = np.zeros(weights.shape[:3], bool)
    wrows[0, 1, 4] = True
    check_other_rows(weights, ref_weights, wrows, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_are_zero_never_nan(isa, dtype):
    """Rows blocked by -inf, a bool mask, causality (Tq > Tk) and key_lengths 0."""
    B, H, Tq, Tk = 3, 2, 150, 100
    args, kw = build(9, dtype, B=B, Tq=Tq, Tk=Tk, heads=((H, 17, 17),), causal=True,
                     key_lengths=[100, 0, 65], biases=True)
    m = np.zeros((B, H, Tq, Tk), dtype)
    m[0, 1, 120] = -np.inf          # a row that causality leaves open
    m[2, 0, 140, :] = -np.inf
    kw["mask"] = m
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        call = normalize(*args, **kw)
    out, weights, (q, k, v, concat, lse) = run_core(call, want_weights=True, keep=True)
    (_, _), (ref_out, ref_weights) = call_both(args, kw, True)
    dead = np.zeros((B, H, Tq), bool)
    dead[:, :, :Tq - Tk] = True      # causal with Tq > Tk: the first 50 rows
    dead[1] = True                   # key_lengths 0
    dead[0, 1, 120] = dead[2, 0, 140] = True
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(weights))
    assert np.all(weights[dead] == 0)
    assert np.all(np.isneginf(lse[dead])) and np.all(np.isfinite(lse[~dead]))
    for b, h, i in zip(*np.nonzero(dead)):
        dv = 17
        assert np.all(concat[b, i, h * dv:(h + 1) * dv] == 0)
    np.testing.assert_allclose(out, ref_out, **tol(dtype))
    np.testing.assert_allclose(weights, ref_weights, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_huge_scores_do_not_overflow(isa, dtype):
    args, kw = build(5, dtype, B=1, Tq=100, Tk=100, heads=((2, 8, 8),), causal=True,
                     scale_x=300.0)
    (out, weights), (ref_out, ref_weights) = call_both(args, kw, True)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(weights))
    # Scores of ~1e5: float32 scores carry ~1e-2 absolute rounding, which
    # moves near-tied weights; float64 stays tight.
    t = tol(dtype) if dtype == np.float64 else dict(rtol=0, atol=2e-2)
    np.testing.assert_allclose(weights, ref_weights, **t)
