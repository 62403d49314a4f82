"""What the fuzzers found, kept as tests; and the seed corpora, replayed.

fuzz/fuzz_mha.py's and fuzz/fuzz_entry_points.py's one-input functions run
here without atheris. Each file in fuzz/regressions is an input of
fuzz_mha.py that once failed; the named tests below state the same finding
in plain code.
"""
import os
import sys

import numpy as np
import pytest

import mhattn
from mhattn import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "fuzz"))
import fuzz_entry_points  # noqa: E402
import fuzz_mha  # noqa: E402

REGRESSIONS = os.path.join(ROOT, "fuzz", "regressions")
CORPUS = os.path.join(ROOT, "fuzz", "corpus")
ENTRY_CORPUS = os.path.join(ROOT, "fuzz", "corpus_entry_points")


def read(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("name", sorted(os.listdir(REGRESSIONS)))
def test_regression_input(name):
    fuzz_mha.test_one_input(read(os.path.join(REGRESSIONS, name)))


def test_seed_corpus_replays():
    files = sorted(os.listdir(CORPUS))
    assert len(files) >= 20
    failed = []
    for name in files:
        try:
            fuzz_mha.test_one_input(read(os.path.join(CORPUS, name)))
        except Exception as e:   # noqa: BLE001 - collected and reported below
            failed.append(f"{name}: {type(e).__name__}: {e}")
    assert not failed, "\n".join(failed)


def test_entry_points_seed_corpus_replays():
    """fuzz/corpus_entry_points: a few inputs for each of the harness's
    entry points, each passing its properties."""
    files = sorted(os.listdir(ENTRY_CORPUS))
    firsts = {read(os.path.join(ENTRY_CORPUS, n))[0] % len(fuzz_entry_points.ENTRIES)
              for n in files}
    assert firsts == set(range(len(fuzz_entry_points.ENTRIES))), "an entry point has no seed"
    failed = []
    for name in files:
        try:
            fuzz_entry_points.test_one_input(read(os.path.join(ENTRY_CORPUS, name)))
        except Exception as e:   # noqa: BLE001 - collected and reported below
            failed.append(f"{name}: {type(e).__name__}: {e}")
    assert not failed, "\n".join(failed)


# --- the findings, in plain code ---------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_no_keys_reference_matches_core(dtype):
    """fuzz/regressions/reference-no-keys: with T_k = 0 every row is fully
    masked; the core returned b_o but the reference raised NumPy's
    'zero-size array to reduction operation maximum'."""
    r = np.random.default_rng(0)
    x = r.standard_normal((2, 3, 4)).astype(dtype)
    w = r.standard_normal((4, 4)).astype(dtype)
    b_o = r.standard_normal(4).astype(dtype)
    key = np.zeros((2, 0, 4), dtype)
    got, gw = mhattn.multi_head_attention(x, w, w, w, num_heads=2, key=key, b_o=b_o,
                                          return_weights=True)
    want, ww = reference.multi_head_attention(x, w, w, w, num_heads=2, key=key, b_o=b_o,
                                              return_weights=True)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, np.broadcast_to(b_o, got.shape))
    assert gw.shape == ww.shape == (2, 2, 3, 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_empty_batch_reads_no_per_item_rows(dtype):
    """CI's ASan run of fuzz/corpus_entry_points: with B = 0, alibi_slopes
    of shape (0, H) was taken as one row shared by every item, so the core's
    precision check read H slopes from an array that holds none. The glue
    reads from its own empty copy, whose stray bytes an ordinary build reads
    without a sign: this test fails on the old code under tools/sanitize.sh
    (heap-buffer-overflow in precision_check), which .ci/run runs."""
    from mhattn._internal import core
    x = np.zeros((0, 3, 4), dtype)
    w = np.eye(4, dtype=dtype)
    slopes = np.full((1, 2), 1e308)[:0]
    assert slopes.shape == (0, 2)
    variants = (None, 0.0, slopes) + (None,) * 6 + (0.0, "rms", 0, False, None, None, None, 0.0, 0, None, 0,
                                                     None, None)
    core.check_config(0, 3, 3, [2], [2], [1.0, 1.0], dtype, variants=variants)
    # and through the public functions, forward and backward
    got = mhattn.multi_head_attention(x, w, w, w, num_heads=2, alibi_slopes=slopes)
    assert got.shape == (0, 3, 4) and got.dtype == dtype
    g = mhattn.multi_head_attention_grad(np.zeros_like(x), x, w, w, w, w, num_heads=2,
                                         alibi_slopes=slopes)
    assert g["x"].shape == (0, 3, 4)


@pytest.mark.parametrize("impl", [mhattn.multi_head_attention,
                                  reference.multi_head_attention])
@pytest.mark.parametrize("bad", [np.ones(3), "yes", 1, None])
def test_return_weights_must_be_a_bool(impl, bad):
    """fuzz/regressions/return-weights-array: return_weights=np.ones(3)
    escaped as NumPy's anonymous 'truth value of an array is ambiguous'."""
    x = np.ones((3, 4))
    w = np.eye(4)
    with pytest.raises(TypeError, match="return_weights"):
        impl(x, w, w, w, num_heads=2, return_weights=bad)


# --- the harness can fail ----------------------------------------------------
def a_valid_input():
    for name in sorted(os.listdir(CORPUS)):
        data = read(os.path.join(CORPUS, name))
        kw, corrupted = fuzz_mha.build(fuzz_mha.Data(data))
        try:
            out = reference.multi_head_attention(**kw)
        except Exception:   # noqa: BLE001 - looking for a valid one
            continue
        out = out[0] if kw["return_weights"] else out
        if corrupted is None and out.size and np.isfinite(out).all():
            return data
    pytest.fail("no valid, non-empty input in the corpus")


def test_harness_catches_a_wrong_result(monkeypatch):
    data = a_valid_input()
    real = mhattn.multi_head_attention

    def off_by_a_bit(*a, **kw):
        res = real(*a, **kw)
        if isinstance(res, tuple):
            return (res[0] + 1e-3 * (1 + np.abs(res[0])),) + res[1:]
        return res + 1e-3 * (1 + np.abs(res))

    monkeypatch.setattr(mhattn, "multi_head_attention", off_by_a_bit)
    with pytest.raises(AssertionError):
        fuzz_mha.test_one_input(data)


@pytest.mark.parametrize("exc", [ValueError("something is wrong"), RuntimeError("x: bad"),
                                 KeyError("w_q")])
def test_harness_catches_bad_errors(monkeypatch, exc):
    def raiser(*a, **kw):
        raise exc

    monkeypatch.setattr(mhattn, "multi_head_attention", raiser)
    with pytest.raises((AssertionError, type(exc))):
        fuzz_mha.test_one_input(a_valid_input())


# --- the entry points' harness can fail --------------------------------------
# b"\x01" * 64 decodes, in fuzz_merge, to float32 q (1, 4, 2) and keys cut
# into two non-empty parts: a merge that is compared with the whole.
MERGE_INPUT = b"\x01" * 64


def merge_once():
    fuzz_entry_points.fuzz_merge(fuzz_mha.Data(MERGE_INPUT), np.random.default_rng(0))


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyError("q"), AttributeError("x"),
                                 IndexError("index 3 is out of bounds")])
def test_entry_harness_refuses_other_exceptions(monkeypatch, exc):
    def raiser(*a, **kw):
        raise exc

    monkeypatch.setattr(mhattn, "merge_attention", raiser)
    with pytest.raises(type(exc)):
        merge_once()


@pytest.mark.parametrize("exc", [TypeError("outs: no"), ValueError("lses: no"), MemoryError(),
                                 IndexError("heads: head 5 is out of range")])
def test_entry_harness_accepts_its_errors(monkeypatch, exc):
    def raiser(*a, **kw):
        raise exc

    monkeypatch.setattr(mhattn, "merge_attention", raiser)
    merge_once()


def test_entry_harness_catches_a_wrong_merge(monkeypatch):
    merge_once()
    real = mhattn.merge_attention

    def off(outs, lses, **kw):
        out, lse = real(outs, lses, **kw)
        return out + 1e-3, lse

    monkeypatch.setattr(mhattn, "merge_attention", off)
    with pytest.raises(AssertionError, match="merge_attention out"):
        merge_once()


def test_entry_harness_catches_a_cache_changed_by_a_failed_append(monkeypatch):
    def append_then_raise(self, k, v, **kw):
        self._lengths += 1
        raise ValueError("k_new: refused after writing")

    monkeypatch.setattr(mhattn.KVCache, "append", append_then_raise)
    with pytest.raises(AssertionError, match="changed the cache"):
        fuzz_entry_points.fuzz_cache(fuzz_mha.Data(b"\x00" * 64), np.random.default_rng(0))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_nan_row_stays_nan_when_dropout_drops_every_weight(dtype):
    """fuzz/regressions/dropout-nan-row-all-dropped: a q/k norm with eps = 0
    on a zero q row makes that row's scores NaN; dropout then zeroed both of
    its weights. The core's output row is NaN (the softmax's normaliser,
    which dropout keeps, is NaN: the rule for NaN scores), and so is the
    reference's now; it summed the zeroed weights into 0."""
    x = np.array([[0.0, 1.0], [1.0, 0.0]], dtype)
    w = np.eye(2, dtype=dtype)
    kw = dict(num_heads=2, q_norm=np.ones(1, dtype), norm_eps=0.0, dropout=0.9)
    for seed in range(64):   # a seed that drops both weights of a NaN row
        out, wt = mhattn.multi_head_attention(x, w, w, w, return_weights=True, seed=seed,
                                              **kw)
        rout, rwt = reference.multi_head_attention(x, w, w, w, return_weights=True,
                                                   seed=seed, **kw)
        np.testing.assert_array_equal(wt, rwt)
        np.testing.assert_array_equal(out, rout)     # NaN where NaN
        # head 0's row 0 (q = 0): NaN scores, both weights dropped
        if (wt[0, 0] == 0).all() and np.isnan(out[0, 0]):
            break
    else:
        pytest.fail("no seed dropped every weight of a NaN row")
