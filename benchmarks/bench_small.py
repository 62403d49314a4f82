#!/usr/bin/env python3
"""Per-call latency of small mhattn calls, one row per option.

    python benchmarks/bench_small.py                 # (3, 4, 2), B=1 and 8
    python benchmarks/bench_small.py --repeat 20000 --only causal mask_bool

A script that prints figures, not a timed test.  Each row times one call
(the public ``mhattn.multi_head_attention``) with timeit: ``--rounds`` rounds
of ``--repeat`` calls, and prints the minimum and the median of the
per-call times in microseconds.  The machine is shared, so the minimum is
the figure to compare; instruction counts (valgrind --tool=callgrind on
``--only NAME --repeat N --rounds 1``) are steadier still.

The last column, ``matmuls``, is the call's minimum over the minimum of one
tiny NumPy matmul, ``x @ w_q`` of the row's own x and dtype, timed in the
same rounds, interleaved with the call (issue 16's unit: a small call should
cost at most 5 of them).  A ratio from one run, so a machine's speed changes
cancel out of it.
"""
from __future__ import annotations

import argparse
import statistics
import timeit

import numpy as np

import mhattn
from mhbench.configs import parse_config


def cases(T, d, h, B, dtype):
    rng = np.random.default_rng(0)

    def a(*shape):
        return rng.standard_normal(shape).astype(dtype)

    x = a(B, T, d) if B else a(T, d)
    w = [a(d, d) for _ in range(4)]
    lead = (B,) if B else ()
    Tk = T + 2
    src = a(*lead, Tk, d)
    hk = h // 2 if h % 2 == 0 else h
    wkg = a(d, d // h * hk)
    base = dict(num_heads=h)
    yield "plain", (x, *w), base
    yield "return_weights", (x, *w), dict(base, return_weights=True)
    yield "no_wo", (x, w[0], w[1], w[2], None), base
    yield "causal", (x, *w), dict(base, causal=True)
    yield "causal_weights", (x, *w), dict(base, causal=True, return_weights=True)
    yield "scale", (x, *w), dict(base, scale=0.3)
    yield "biases", (x, *w), dict(base, b_q=a(d), b_k=a(d), b_v=a(d), b_o=a(d))
    yield "b_o", (x, *w), dict(base, b_o=a(d))
    yield "key_lengths", (x, *w), dict(
        base, key_lengths=np.full(B, T - 1) if B else T - 1)
    yield "mask_bool_TT", (x, *w), dict(base, mask=np.tril(np.ones((T, T), bool)))
    yield "mask_add_TT", (x, *w), dict(
        base, mask=np.triu(np.full((T, T), -np.inf, dtype), 1))
    yield "mask_bool_full", (x, *w), dict(
        base, mask=np.ones((*lead, h, T, T), bool))
    yield "num_kv_heads", (x, w[0], wkg, wkg, w[3]), dict(base, num_kv_heads=hk)
    yield "cross_kv", (x, *w), dict(base, key=src)
    yield "cross_k_v", (x, *w), dict(base, key=src, value=src.copy())
    yield "stacked", (x, *[np.ascontiguousarray(m.reshape(d, h, d // h).transpose(1, 0, 2))
                          for m in w[:3]], w[3]), {}
    yield "list", (x, *[[m[:, i * (d // h):(i + 1) * (d // h)] for i in range(h)]
                       for m in w[:3]], w[3]), {}


def cases_w(pos):
    """The row's first weight as one matrix (a stacked or listed w_q fused)."""
    w = pos[1]
    if isinstance(w, list):
        return np.concatenate(w, axis=1)
    return w if w.ndim == 2 else np.concatenate(list(w), axis=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="3x4x2", type=parse_config, help="TxDxH")
    p.add_argument("--batches", type=int, nargs="+", default=[0, 8],
                   help="0 = unbatched")
    p.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    p.add_argument("--repeat", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--only", nargs="*", default=None)
    args = p.parse_args()
    T, d, h = args.config
    print(f"mhattn {mhattn.__file__}; (T, d, h) = ({T}, {d}, {h}); "
          f"{args.rounds} rounds of {args.repeat} calls; microseconds per call")
    print(f"{'call':16} {'dtype':8} {'B':>2} {'min':>7} {'median':>7} {'matmuls':>8}")
    for dtype in args.dtypes:
        for B in args.batches:
            for name, pos, kw in cases(T, d, h, B, np.dtype(dtype)):
                if args.only and name not in args.only:
                    continue
                f = mhattn.multi_head_attention
                f(*pos, **kw)
                x, w = pos[0], cases_w(pos)
                us, unit = [], []
                for _ in range(args.rounds):   # the call and the unit, in turn
                    us.append(timeit.timeit(lambda: f(*pos, **kw),
                                            number=args.repeat) / args.repeat * 1e6)
                    unit.append(timeit.timeit(lambda: x @ w,
                                              number=args.repeat) / args.repeat * 1e6)
                print(f"{name:16} {dtype:8} {B or '-':>2} {min(us):7.2f} "
                      f"{statistics.median(us):7.2f} {min(us) / min(unit):8.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
