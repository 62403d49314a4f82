"""A few dozen mhattn calls for tools/valgrind_smoke.sh: every path of the
glue and the core once or twice, successes and failures, small sizes."""
import os
import sys

import numpy as np

import mhattn
from mhattn import _C

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from catalogue_cases import GLUE_BAD, glue_args, zero_width  # noqa: E402

print("valgrind smoke: testing", _C.__file__, flush=True)
r = np.random.default_rng(0)
calls = 0
for dtype in (np.float32, np.float64):
    x = r.standard_normal((2, 5, 6)).astype(dtype)
    key = r.standard_normal((2, 7, 6)).astype(dtype)
    w = r.standard_normal((6, 6)).astype(dtype)
    wo = r.standard_normal((6, 3)).astype(dtype)
    for kw in (dict(num_heads=2), dict(num_heads=3, causal=True),
               dict(num_heads=2, key=key, mask=r.random((5, 7)) > 0.3),
               dict(num_heads=2, key=key, key_lengths=[7, 0], b_o=np.ones(3)),
               dict(num_heads=2, key=key[:, ::-1], causal=True)):
        mhattn.multi_head_attention(x, w, w, w, wo, return_weights=True, **kw)
        calls += 1
    # Grouped-query attention: one kv head of width 3 for two query heads.
    mhattn.multi_head_attention(x, w, w[:, :3], w[:, 3:], num_heads=2, num_kv_heads=1,
                                key=key, mask=r.standard_normal((1, 2, 1, 7)))
    calls += 1
    ragged = [r.standard_normal((6, d)).astype(dtype) for d in (1, 3, 2)]
    mhattn.multi_head_attention(x[0], ragged, ragged, ragged[::-1], return_weights=True)
    calls += 1
    # NaN, Inf and fully masked rows.
    xn = x.copy()
    xn[0, 1, 2] = np.nan
    xn[1, 0, 0] = np.inf
    mhattn.multi_head_attention(xn, w, w, w, num_heads=2, mask=np.zeros((5, 5), bool))
    calls += 1
# The glue alone: success with every output kept, then each kind of error.
_C.forward(**glue_args(keep=True, want_weights=True,
                       mask=np.ones((1, 2, 3, 3), bool)[..., ::-1],
                       key_lengths=np.array([2])))
calls += 1
for name, (exc, words, change) in GLUE_BAD.items():
    try:
        _C.forward(np.ones((1, 3, 4))) if change is None else _C.forward(**glue_args(**change))
    except (TypeError, ValueError):
        calls += 1
for kw in (zero_width(1, 2 ** 40), {**zero_width(1, 2 ** 40), "wo": np.zeros((2, 0))},
           zero_width(2 ** 21, 2 ** 21, Tk=2 ** 21)):
    try:
        _C.forward(**kw)
    except MemoryError:
        calls += 1
print(f"valgrind smoke: {calls} calls done", flush=True)
