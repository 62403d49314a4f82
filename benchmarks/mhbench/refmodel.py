"""The NumPy reference: skip it where it would take too long or too much
memory, from a rough cost model calibrated at start-up."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import numpy as np

import mhattn.reference

from .configs import DTYPES, Case
from .timing import sample_times


@dataclass
class RefModel:
    """Rough cost model of mhattn.reference, calibrated on this machine:
    its matrix products run at NumPy's BLAS rate and every score element
    costs a fixed time in the softmax and masking steps."""
    gemm_gflops: Dict[str, float]
    elem_s: Dict[str, float]

    def seconds(self, c: Case) -> float:
        gemm = c.B * (8.0 * c.T * c.d * c.d + 4.0 * c.T * c.T * c.d)
        elementwise = c.B * c.h * c.T * c.T * self.elem_s[c.dtype]
        return gemm / (self.gemm_gflops[c.dtype] * 1e9) + elementwise

    @staticmethod
    def bytes(c: Case) -> float:
        item = np.dtype(c.dtype).itemsize
        # all_weights (B, h, T, T) is kept; one head's score-sized temporaries
        # (raw, scores, masked, exp, normalised, ...) live at once.
        return c.B * c.h * c.T * c.T * item + 8.0 * c.T * c.T * item + 6.0 * c.B * c.T * c.d * item


def calibrate_reference(rng) -> RefModel:
    gemm, elem = {}, {}
    for dtype in DTYPES.values():
        dt = np.dtype(dtype)
        a = rng.standard_normal((2048, 1024), dtype=dt)
        b = rng.standard_normal((1024, 128), dtype=dt)
        best = min(sample_times(lambda: a @ b, 5))
        gemm[dtype] = 2 * 2048 * 1024 * 128 / best / 1e9
        T = 512
        q = rng.standard_normal((T, 8), dtype=dt)
        allowed = np.tril(np.ones((T, T), dtype=bool))
        best = min(sample_times(lambda: mhattn.reference.attention(q, q, q, 0.3, allowed), 5))
        elem[dtype] = best / (T * T)
    return RefModel(gemm, elem)
