"""Nothing leaks: reference counts, NumPy's traced memory and RSS stay flat.

Every loop runs successful calls and failing ones (errors raised at each
stage of the glue), through the public API and through mhattn._C alone.
tools/valgrind_smoke.sh checks the C side under memcheck as well.
"""
import gc
import os
import sys
import tracemalloc

import numpy as np
import pytest

import mhattn
from mhattn import _C

from catalogue_cases import GLUE_BAD, glue_args, zero_width

UNDER_ASAN = any("asan" in p for p in os.environ.get("LD_PRELOAD", "").split())

rng = np.random.default_rng(99)
X = rng.standard_normal((2, 16, 8))
XS = X[:, ::-1]                           # strided: the glue copies it
W = rng.standard_normal((8, 8))
WO = rng.standard_normal((8, 5))
MASK = rng.random((16, 16)) > 0.2
KL = np.array([16, 9])
B_O = rng.standard_normal(5)


GOOD = [
    lambda: mhattn.multi_head_attention(X, W, W, W, WO, num_heads=2, mask=MASK,
                                        key_lengths=KL, b_o=B_O, return_weights=True),
    lambda: mhattn.multi_head_attention(XS, [W[:, :4], W[:, 4:]], W, W, num_heads=2,
                                        causal=True),
    lambda: mhattn.multi_head_attention(X.astype(np.float32), W, W, W, num_heads=4),
    lambda: _C.forward(**glue_args(keep=True, want_weights=True)),
    lambda: _C.forward(**glue_args(mask=np.ones((1, 2, 3, 3), bool),
                                   key_lengths=np.array([2]))),
]
BAD_PUBLIC = [
    lambda: mhattn.multi_head_attention(X, W, W, W, WO, num_heads=3),
    lambda: mhattn.multi_head_attention(X, W, W, W, np.ones((7, 2)), num_heads=2),
    lambda: mhattn.multi_head_attention(X, W, W, W, num_heads=2, mask=np.ones((3, 3), bool)),
    lambda: mhattn.multi_head_attention(X, W, W, W, num_heads=2, key_lengths=[99, 1]),
    lambda: mhattn.multi_head_attention(X, W, W, [W, None]),
    lambda: mhattn.multi_head_attention(np.broadcast_to(0.0, (1, 2 ** 31, 8)), W, W, W,
                                        num_heads=2, return_weights=True),
]
BAD_GLUE = [change for _, _, change in GLUE_BAD.values() if change is not None]
BAD = BAD_PUBLIC + [lambda ch=ch: _C.forward(**glue_args(**ch)) for ch in BAD_GLUE] + [
    # MemoryError from the size check (MHA_ERR_SIZE), and below from NumPy
    # (out) and from the core (MHA_ERR_NOMEM, after it allocated scratch).
    lambda: _C.forward(**zero_width(2 ** 21, 2 ** 21, Tk=2 ** 21)),
]
if not UNDER_ASAN:   # ASan warns on every failed 16 TiB mmap; the catalogue has them once
    BAD += [lambda: _C.forward(**zero_width(1, 2 ** 40)),
            lambda: _C.forward(**{**zero_width(1, 2 ** 40), "wo": np.zeros((2, 0))})]
# Good and failing calls interleaved: one of each per step.
STEPS = [(GOOD[i % len(GOOD)], BAD[i]) for i in range(len(BAD))]


def run_steps(n):
    """n calls, half of them failing."""
    for i in range(n // 2):
        good, bad = STEPS[i % len(STEPS)]
        good()
        try:
            bad()
        except (TypeError, ValueError, MemoryError):
            pass
        else:
            raise AssertionError("a bad call did not fail")


@pytest.mark.slow
def test_refcounts_flat_over_calls_and_errors():
    tracked = [X, XS, W, WO, MASK, KL, B_O] + [v for ch in BAD_GLUE for v in ch.values()
                                              if isinstance(v, np.ndarray)]
    run_steps(2 * len(STEPS))
    gc.collect()
    before = [sys.getrefcount(a) for a in tracked]
    none_before = sys.getrefcount(None)
    run_steps(4000)
    gc.collect()
    after = [sys.getrefcount(a) for a in tracked]
    assert after == before
    # None is handed out by the glue (weights=None, extras=None): a missing
    # DECREF would show as one more reference per call.
    assert abs(sys.getrefcount(None) - none_before) < 100


def test_outputs_hold_no_extra_reference():
    res = _C.forward(**glue_args(keep=True, want_weights=True))
    out, weights, extras = res
    del res
    q, k, v, concat, lse = extras
    del extras
    # Each output is referenced by its name and getrefcount's argument only.
    assert sys.getrefcount(out) == 2 and sys.getrefcount(weights) == 2
    assert sys.getrefcount(q) == 2 and sys.getrefcount(k) == 2
    assert sys.getrefcount(v) == 2 and sys.getrefcount(concat) == 2
    assert sys.getrefcount(lse) == 2
    out, w = mhattn.multi_head_attention(X, W, W, W, num_heads=2, return_weights=True)
    assert sys.getrefcount(out) == 2 and sys.getrefcount(w) == 2


@pytest.mark.slow
def test_traced_memory_flat_over_10k_calls():
    """NumPy reports its data allocations to tracemalloc: a leaked output or
    input copy shows up here."""
    tracemalloc.start()
    try:
        run_steps(500)            # warm-up: caches, interned strings, ...
        gc.collect()
        start = tracemalloc.get_traced_memory()[0]
        run_steps(10_000)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    # One leaked (2, 16, 8) float64 output per good call would be 10 MB.
    assert grown < 256 * 1024, f"traced memory grew by {grown} bytes"


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
@pytest.mark.skipif(UNDER_ASAN, reason="ASan's quarantine holds freed memory, so RSS "
                    "grows by design; ASan checks the heap itself")
def test_rss_flat_over_10k_calls():
    """The core's scratch (malloc'd, unseen by tracemalloc) is freed too."""
    # Wide heads, short sequences: much scratch, little arithmetic. The glue
    # is called directly (the public path is the traced-memory test's).
    r = np.random.default_rng(5)
    w = r.standard_normal((2, 64))
    kw = glue_args(x=r.standard_normal((16, 4, 2)), wq=w, wk=w, wv=w,
                   wo=r.standard_normal((64, 3)), dk=np.full(4, 16), dv=np.full(4, 16),
                   scales=np.ones(4), causal=True)
    kw["key"] = kw["value"] = kw["x"]

    def call():
        # q, k, v and concat: 16 * 4 * 64 * 8 bytes = 32 KiB of scratch each.
        _C.forward(**kw)

    for _ in range(300):
        call()
    run_steps(2 * len(STEPS))
    gc.collect()
    start = rss()
    for i in range(10_000):
        call()
        if i % 100 == 0:
            run_steps(2)   # failing calls too (the core's NOMEM path among them)
    gc.collect()
    grown = rss() - start
    # A leak of the scratch would be 1.3 GB; allow allocator noise.
    assert grown < 32 * 2 ** 20, f"RSS grew by {grown / 2**20:.1f} MiB"


@pytest.mark.skipif(not sys.platform.startswith("linux") or UNDER_ASAN,
                    reason="minor faults from getrusage on Linux; ASan keeps no blocks")
@pytest.mark.parametrize("T, dtype", [(64, np.float64), (128, np.float32)])
def test_repeated_backward_reuses_its_scratch(T, dtype):
    """A loop of backward passes faults its scratch in once, not on every
    call: the GEMM's per-call packing buffer is a kept block (alloc.h).
    When glibc mapped it afresh on every call, a call here took ~2300
    (float64) and ~1600 (float32) minor faults; with the kept block ~120,
    most of them NumPy's outputs."""
    import resource
    r = np.random.default_rng(5)
    d = 512
    x = r.standard_normal((1, T, d)).astype(dtype)
    g = r.standard_normal((1, T, d)).astype(dtype)
    ws = [(r.standard_normal((d, d)) / np.sqrt(d)).astype(dtype) for _ in range(4)]
    call = lambda: mhattn.multi_head_attention_grad(g, x, *ws, num_heads=8)
    for _ in range(5):
        call()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    n = 20
    for _ in range(n):
        call()
    per_call = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / n
    assert per_call < 800, f"{per_call:.0f} minor page faults per backward call"
