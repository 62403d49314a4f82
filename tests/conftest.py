"""Shared helpers for the mhattn test suite."""
import numpy as np
import pytest

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
