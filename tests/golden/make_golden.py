"""Record the golden bits of tests/golden_cases.py for each ISA this machine runs.

    PYTHONPATH=python python tests/golden/make_golden.py [isa ...]

A machine without AVX-512 records avx512.npz from the emulated build
(setup.py, MHATTN_EMULATE_AVX512=1), whose bits tools/ci/emulate_avx512.sh
holds to the ones recorded on AVX-512 hardware.

Writes tests/golden/<isa>.npz, one array per (case, output).  Run it only
when a change is *meant* to change bits, in its own commit, and say in that
commit which outputs changed and by how much (tests/golden/diff_golden.py).
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import mhattn  # noqa: E402
from golden_cases import CASES  # noqa: E402


def record(isa):
    assert mhattn._set_isa(isa) == isa, f"this machine does not run {isa}"
    mhattn.set_num_threads(2)
    arrays = {}
    for name, fn in CASES.items():
        for out, a in fn().items():
            arrays[f"{name}/{out}"] = np.ascontiguousarray(a)
    path = os.path.join(HERE, f"{isa}.npz")
    np.savez_compressed(path, **arrays)
    print(f"{path}: {len(arrays)} arrays from {len(CASES)} cases")


if __name__ == "__main__":
    from conftest import ISAS  # noqa: E402
    for isa in sys.argv[1:] or ISAS:
        record(isa)
