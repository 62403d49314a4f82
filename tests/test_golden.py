"""The golden test: every case of tests/golden_cases.py gives exactly the
bits recorded in tests/golden/<isa>.npz, on every ISA this machine runs and
for 1 and 3 threads.

It pins the arithmetic while the core is restructured: a change that moves
code must leave every bit as it was.  An ISA with no recorded file (AVX-512
on a machine that never had it) is skipped, and says so.
"""
import os

import numpy as np
import pytest

import mhattn
from golden_cases import CASES

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")


_LOADED = {}   # isa -> its recorded bits, read once (~60 ms a file) for all its cases


def _golden(isa):
    path = os.path.join(HERE, f"{isa}.npz")
    if not os.path.exists(path):
        pytest.skip(f"no golden bits recorded for {isa} (tests/golden/make_golden.py)")
    if isa not in _LOADED:
        with np.load(path) as z:
            _LOADED[isa] = {k: z[k] for k in z.files}
    return _LOADED[isa]


@pytest.fixture(scope="module", params=[1, 3])
def threads(request):
    before = mhattn.get_num_threads()
    mhattn.set_num_threads(request.param)
    yield request.param
    mhattn.set_num_threads(before)


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_bits(name, isa, threads):
    gold = _golden(isa)
    want = {k.split("/", 1)[1]: v for k, v in gold.items() if k.split("/", 1)[0] == name}
    assert want, f"{name}: not in the golden file; regenerate it"
    got = CASES[name]()
    assert sorted(got) == sorted(want)
    for out, a in got.items():
        a = np.ascontiguousarray(a)
        w = want[out]
        assert a.dtype == w.dtype and a.shape == w.shape, (out, a.dtype, a.shape)
        if a.tobytes() != w.tobytes():
            diff = np.nanmax(np.abs(a.astype(np.float64) - w.astype(np.float64)))
            pytest.fail(f"{name}/{out} on {isa} with {threads} threads: bits differ "
                        f"(max |diff| {diff:.3g})")
