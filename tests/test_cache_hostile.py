"""Hostile callers of the KV cache (issue 35, "Hostile callers, round 2"):
every bad KVCache argument raises an error that starts with its name,
and neither the cache's storage nor a cached step allocates past the
memory limit the main call honours (mhattn._internal.args.check_memory).
"""
import re
import tracemalloc

import numpy as np
import pytest

import mhattn
from mhattn._internal import args as _args

SIZES = ("batch", "num_kv_heads", "capacity", "d_k", "d_v")
GOOD = dict(batch=2, num_kv_heads=1, capacity=8, d_k=4, d_v=3, dtype=np.float32)


@pytest.fixture
def no_memory(monkeypatch):
    """Lower the memory limit, as tests/test_hostile_py.py does: a callable
    that sets it to n bytes."""
    return lambda n: monkeypatch.setattr(_args, "_memory_limit_bytes", int(n))


def peak_bytes(fn):
    """(what fn raised, the most NumPy held while it ran, in bytes)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            fn()
        except Exception as e:   # noqa: BLE001 - returned to the test
            raised = e
        else:
            raised = None
        return raised, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


# --- the constructor's arguments ---------------------------------------------------

@pytest.mark.parametrize("name", SIZES)
@pytest.mark.parametrize("value", [-1, 0, True, False, np.bool_(True), 2.0, 2.5,
                                   np.float64(3.0), "3", b"3", 1 + 0j, [2], np.array([2]),
                                   np.int64(-5), float("nan")],
                         ids=repr)
def test_bad_size_names_the_argument(name, value):
    with pytest.raises((TypeError, ValueError), match=f"^{name}: "):
        mhattn.KVCache(**dict(GOOD, **{name: value}))


@pytest.mark.parametrize("name", ["batch", "num_kv_heads", "capacity", "d_k"])
def test_none_size_names_the_argument(name):
    with pytest.raises((TypeError, ValueError), match=f"^{name}: "):
        mhattn.KVCache(**dict(GOOD, **{name: None}))


def test_integer_likes_are_sizes():
    cache = mhattn.KVCache(np.int64(2), np.uint8(1), np.int32(8), np.int16(4), np.int64(3))
    assert (cache.batch, cache.num_kv_heads, cache.capacity, cache.d_k, cache.d_v) == \
        (2, 1, 8, 4, 3)


@pytest.mark.parametrize("value", [np.int64, np.int16, np.complex64, np.bool_, int, bool,
                                   "int4", "nonsense", object(), True, 4, None,
                                   np.dtype(">f4"), np.dtype("<f8").newbyteorder(),
                                   [np.float32], np.dtype([("a", "f4")])],
                         ids=lambda v: "object()" if type(v) is object else repr(v))
def test_bad_dtype_names_the_argument(value):
    with pytest.raises((TypeError, ValueError), match="^dtype: "):
        mhattn.KVCache(**dict(GOOD, dtype=value))


@pytest.mark.parametrize("value", [np.float32, np.float64, "float32", "f8", float,
                                   np.dtype("=f4")])
def test_good_dtypes(value):
    assert mhattn.KVCache(**dict(GOOD, dtype=value)).dtype in (np.float32, np.float64)


# --- the storage's size: the memory check, before NumPy is asked -------------------------

@pytest.mark.parametrize("name", SIZES)
@pytest.mark.parametrize("value", [2 ** 62, 2 ** 70, 2 ** 200], ids=["2**62", "2**70", "2**200"])
def test_huge_size_is_a_memory_error_naming_it(name, value):
    with pytest.raises(MemoryError) as e:
        mhattn.KVCache(**dict(GOOD, **{name: value}))
    msg = str(e.value)
    assert name in msg and re.search(r"[\d.e+]+ GiB", msg), msg
    assert str(value) in msg, msg                      # the size itself, not NumPy's words


def test_the_issue_s_capacity():
    with pytest.raises(MemoryError, match=r"capacity.* = 1\*1\*4611686018427387904\*4 = "):
        mhattn.KVCache(1, 1, 2 ** 62, 4)


def test_storage_past_the_limit_raises_before_allocating(no_memory):
    need = 2 * 2 ** 16 * 16 * 8 + 8                    # keys, values and lengths
    no_memory(need - 1)
    raised, peak = peak_bytes(lambda: mhattn.KVCache(1, 1, 2 ** 16, 16, dtype=np.float64))
    assert isinstance(raised, MemoryError), raised
    assert "capacity" in str(raised) and "GiB" in str(raised)
    assert peak < 64 * 1024, f"{peak} bytes allocated before the check"
    no_memory(need)                                    # and exactly what it needs fits
    assert mhattn.KVCache(1, 1, 2 ** 16, 16, dtype=np.float64).nbytes == need


# --- the cached step's allocations ------------------------------------------------------

D, H, G, DK = 8, 2, 1, 4
CAPACITY = 2 ** 15


def step_case():
    rng = np.random.default_rng(35)
    w = dict(w_q=rng.standard_normal((D, H * DK)), w_k=rng.standard_normal((D, G * DK)),
             w_v=rng.standard_normal((D, G * DK)), w_o=rng.standard_normal((H * DK, D)),
             b_o=rng.standard_normal(D), num_heads=H, num_kv_heads=G)
    cache = mhattn.KVCache(2, G, CAPACITY, DK, dtype=np.float64)
    cache.append(rng.standard_normal((2, G, 5, DK)), rng.standard_normal((2, G, 5, DK)))
    return cache, rng.standard_normal((2, 1, D)), w


def state(cache):
    return cache.lengths.copy(), cache.key_storage.copy(), cache.value_storage.copy()


def test_step_weights_past_the_limit_raise_before_allocating(no_memory):
    cache, x, w = step_case()
    before = state(cache)
    weights = 2 * H * 1 * CAPACITY * 8                 # (B, H, T_new, capacity) float64
    # A limit under which attention() on the cache's own storage cannot
    # return the weights, while everything else the step allocates fits.
    no_memory(weights // 2)
    q = np.zeros((2, H, 1, DK))
    with pytest.raises(MemoryError, match="return_weights=True"):
        mhattn.attention(q, cache.key_storage, cache.value_storage, return_weights=True)
    raised, peak = peak_bytes(lambda: mhattn.multi_head_attention(
        x, cache=cache, return_weights=True, **w))
    assert isinstance(raised, MemoryError), raised
    assert re.search(r"return_weights=True needs B\*h\*T_new\*capacity = "
                     rf"2\*{H}\*1\*{CAPACITY} = ", str(raised)), str(raised)
    assert peak < weights // 4, f"{peak} bytes allocated before the check"
    for a, b in zip(state(cache), before):             # the cache is unchanged
        np.testing.assert_array_equal(a, b)
    out = mhattn.multi_head_attention(x, cache=cache, **w)   # without the weights it fits
    assert out.shape == (2, 1, D) and cache.lengths.tolist() == [6, 6]


def test_step_outputs_are_checked(no_memory):
    """The step's projections, its heads' concatenation and out (W^O, then
    b_o) are counted too: a limit a little under their sum raises, and the
    cache is unchanged."""
    cache, _, w = step_case()
    T = 512
    x = np.random.default_rng(1).standard_normal((2, T, D))
    before = state(cache)
    n = 2 * T * 8                                       # B * T_new * itemsize
    need = n * (D + H * DK + 2 * G * DK + H * DK + D)   # out, q, k, v, concat, + b_o
    no_memory(need - 1)
    with pytest.raises(MemoryError, match=r"needs B\*T_q\*d_out"):
        mhattn.multi_head_attention(x, cache=cache, causal=True, **w)
    for a, b in zip(state(cache), before):
        np.testing.assert_array_equal(a, b)
    no_memory(need + CAPACITY)                          # room for the bookkeeping
    out = mhattn.multi_head_attention(x, cache=cache, causal=True, **w)
    assert out.shape == (2, T, D) and cache.lengths.tolist() == [5 + T] * 2


def _copies_and_transforms(w):
    """Per-head w_q (fused on the way), no W^O, RoPE and the q/k norms."""
    return dict(w, w_q=[w["w_q"][:, :DK], w["w_q"][:, DK:]], w_o=None, b_o=None,
                rope=mhattn.RoPE(), q_norm=np.ones(DK), k_norm=np.ones(DK))


@pytest.mark.parametrize("case", ["w_o_b_o_weights", "copies_transforms", "unbatched"])
def test_a_step_raises_just_below_its_whole_need(no_memory, case):
    """The cheap bound that spares a small step its plan never lets a step
    through whose plan does not fit: one byte under the plan raises."""
    from mhattn.compute import cache as cache_module
    cache, _, w = step_case()
    x = np.random.default_rng(2).standard_normal((2, 512, D))[:, ::2]   # 256 rows, strided
    want_w = case == "w_o_b_o_weights"
    if case == "copies_transforms":
        w = _copies_and_transforms(w)
    if case == "unbatched":
        cache = mhattn.KVCache(1, G, CAPACITY, DK, dtype=np.float64)
        x = np.ascontiguousarray(x[0])
    call = _args.normalize(x, w["w_q"], w["w_k"], w["w_v"], w["w_o"], num_heads=H,
                           num_kv_heads=G, b_o=w["b_o"], causal=True, core_checks_next=True,
                           **{k: w[k] for k in ("rope", "q_norm", "k_norm") if k in w})
    items = cache_module._step_items(call, CAPACITY, want_w, "rope" in w)
    need = sum(int(np.prod(f, dtype=object)) * n for _, _, f, n in items)
    before = state(cache)
    no_memory(need - 1)
    with pytest.raises(MemoryError):
        mhattn.multi_head_attention(x, cache=cache, return_weights=want_w, causal=True, **w)
    for a, b in zip(state(cache), before):
        np.testing.assert_array_equal(a, b)
    no_memory(need)
    mhattn.multi_head_attention(x, cache=cache, return_weights=want_w, causal=True, **w)
    assert (cache.lengths == before[0] + x.shape[-2]).all()
