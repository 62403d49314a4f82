"""python -m mhattn: the document's worked example, computed by the C core."""
from __future__ import annotations

import sys

import numpy as np

from ._internal.args import normalize
from ._internal.core import run_core
from .reference import param_count, worked_example


def _fmt(v) -> str:
    v = np.atleast_1d(np.asarray(v, dtype=float))
    if v.ndim == 1:
        return "[" + ", ".join(f"{e:.4f}" for e in v) + "]"
    return "[" + ", ".join(_fmt(row) for row in v) + "]"


def main(out=sys.stdout) -> int:
    tokens, X, w_q, w_k, w_v, w_o = worked_example()
    call = normalize(X, w_q, w_k, w_v, w_o)
    res, weights, (q, k, v, concat, lse) = run_core(call, want_weights=True, keep=True)
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("mhattn - the worked example of multi-head attention, computed by the C core")
    p("")
    p("Tokens and their embeddings (entity, adjective, number/verb, bias):")
    for t, row in zip(tokens, X):
        p(f"  x_{t:<5}= {_fmt(row)}")
    p("")
    it = tokens.index("it")
    p(f"h = {call.H} heads, d_k = d_v = {call.dk[0]}; the query is the token 'it'.")
    for h in range(call.H):
        g = call.kv_head(h)
        dk = call.dk[g]
        q_it = q[0, it, call.q_cols(h)]
        K = k[0, :, call.k_cols(g)]
        raw = K @ q_it
        scaled = raw * call.scales[h]
        p("")
        p(f"Head {h + 1}:")
        p(f"  q (it)          = {_fmt(q_it)}")
        p(f"  K               = {_fmt(K)}")
        p(f"  V               = {_fmt(v[0, :, call.v_cols(g)])}")
        p(f"  scores K.q      = {_fmt(raw)}    on ({', '.join(tokens)})")
        p(f"  scaled / sqrt({dk}) = {_fmt(scaled)}")
        p(f"  weights         = {_fmt(weights[0, h, it])}")
        p(f"  output          = {_fmt(concat[0, it, call.concat_cols(h)])}")
    p("")
    p(f"Concat(head_1, head_2) for 'it' = {_fmt(concat[0, it])}")
    p(f"MultiHead output (W^O = I)      = {_fmt(res[0, it])}")
    p("")
    p("Parameter count of W^Q, W^K, W^V and W^O with d_k = d_v = d_model / h:")
    d_model = 512
    for h in (1, 2, 4, 8, 16):
        p(f"  d_model = {d_model}, h = {h:>2}, d_k = {d_model // h:>3}: "
          f"{param_count(d_model, h):>9,d} = 4 * {d_model}^2 = {4 * d_model ** 2:,d}")
    p("The count does not depend on h: more heads split the same budget.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
