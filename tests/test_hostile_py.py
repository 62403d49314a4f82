"""Hostile callers on the Python side (issue 12, items 6-10): every entry
point raises mhattn's own, named error before it allocates or misreads."""
import re

import numpy as np
import pytest

import mhattn
from mhattn import _args

rng = np.random.default_rng(12)
X = rng.standard_normal((3, 4))
W = rng.standard_normal((4, 4))
WL = [rng.standard_normal((4, 2)), rng.standard_normal((4, 2))]


def _layer_call(x, w_q, w_k, w_v, **kw):
    layer = mhattn.MultiHeadAttention(4, 2, dtype=np.float64, seed=0)
    layer.w_q, layer.w_k, layer.w_v = w_q, w_k, w_v
    return layer(x, **kw)


ENTRY_POINTS = {
    "forward": lambda *a, **kw: mhattn.multi_head_attention(*a, **kw),
    "grad": lambda x, *a, **kw: mhattn.multi_head_attention_grad(
        np.ones((x.shape[0], 4)), x, *a, **kw),
    "trace": lambda *a, **kw: mhattn.trace(*a, **kw),
    "layer": _layer_call,
}


# --- item 8: zero-width heads -------------------------------------------------
Z2 = np.ones((4, 0))
ZERO_WIDTH = {
    "w_q_stacked": ((np.ones((2, 4, 0)), np.ones((2, 4, 0)), np.ones((2, 4, 2))), "w_q[0]"),
    "w_q_list": (([WL[0], Z2], [WL[0], Z2], WL), "w_q[1]"),
    "w_k_list": ((WL, [Z2, WL[1]], WL), "w_k[0]"),
    "w_v_stacked": ((np.ones((2, 4, 2)), np.ones((2, 4, 2)), np.ones((2, 4, 0))), "w_v[0]"),
    "w_v_list": ((WL, WL, [WL[0], Z2]), "w_v[1]"),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("case", list(ZERO_WIDTH))
def test_zero_width_heads_name_the_argument(entry, case):
    (wq, wk, wv), name = ZERO_WIDTH[case]
    with pytest.raises(ValueError, match="^" + re.escape(name) + ": .*width 0"):
        ENTRY_POINTS[entry](X, wq, wk, wv)
