"""Shared helpers for the mhattn test suite."""
import os

import numpy as np
import pytest

import mhattn

# Tolerances against the NumPy reference: float64 agrees to rounding; float32
# sums of up to a few hundred products lose a few ulps each, so 1e-5 relative
# with a matching absolute floor (outputs near zero) is the honest bound.
TOL = {np.float64: dict(rtol=1e-12, atol=1e-12), np.float32: dict(rtol=1e-5, atol=1e-5)}


def tol(dtype):
    return TOL[np.dtype(dtype).type]


def make_weights(rng, form, d_in, widths, dtype):
    """Random weights for heads of the given widths, in one of the three forms."""
    heads = [rng.standard_normal((d_in, w)).astype(dtype) for w in widths]
    if form == "list":
        return heads
    assert len(set(widths)) == 1, "fused/stacked need equal widths"
    if form == "stacked":
        return np.stack(heads)
    return np.concatenate(heads, axis=1)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def _supported_isas():
    """The ISAs this machine runs, lowest first; the ISA in force is kept."""
    before = mhattn.get_isa()
    best = mhattn._set_isa("avx512")   # capped at what the CPU supports
    mhattn._set_isa(before)
    # each architecture's ladder (aarch64: NEON is the only SIMD path)
    names = ["scalar", "neon"] if best == "neon" else ["scalar", "avx2", "avx512"]
    return names[:names.index(best) + 1]


def _tested_isas(names):
    """The ISAs the `isa` fixture runs: all of `names`, or those named in
    MHATTN_TEST_ISAS (comma-separated). The emulated AVX-512 run
    (tools/ci/emulate_avx512.sh) sets it to avx512, since the main run has
    already held every test to the other paths."""
    only = os.environ.get("MHATTN_TEST_ISAS")
    if not only:
        return names
    kept = [n for n in names if n in only.split(",")]
    assert kept, f"MHATTN_TEST_ISAS={only!r}: none of {names} is named"
    return kept


ALL_ISAS = _supported_isas()   # every ISA this machine runs
ISAS = _tested_isas(ALL_ISAS)  # those the tests run per ISA


@pytest.fixture(params=ISAS)
def isa(request):
    """Each ISA path this machine runs, forced for the test, then restored."""
    before = mhattn.get_isa()
    assert mhattn._set_isa(request.param) == request.param
    assert mhattn.get_isa() == request.param
    yield request.param
    mhattn._set_isa(before)


def child_env():
    """The environment of a child process that imports this mhattn (the
    tree's or the installed one, whichever the tests import)."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(mhattn.__file__)))
    rest = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([here] + rest)
    return env
