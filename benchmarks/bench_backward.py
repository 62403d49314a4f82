#!/usr/bin/env python3
"""Backward benchmark: mhattn's forward and backward against torch autograd.

    python benchmarks/bench_backward.py                 # T = 1024, 2048
    python benchmarks/bench_backward.py --T 1024 --repeats 3 --causal
    python benchmarks/bench_backward.py --threads 1
    python benchmarks/bench_backward.py --configs 2048x1024x16

A script that prints figures, not a timed test (``benchmarks/bench.py``
prints the same table for its float32 configurations with T >= 1024: both
call ``report`` in mhbench/backward.py, where the measuring is done).  For each T (d_model 512, h 8, one
sequence, float32 unless --dtype f64), or each --configs TxDxH, it times,
as medians of --repeats runs after one warm-up:

- fwd: ``out, ctx = layer(x, return_context=True)`` (the forward a training
  loop runs: it keeps q, k, v, concat and lse for the backward);
- bwd: ``layer.backward(grad_out, ctx)`` (every weight's gradient and x's);
- torch MHA: ``nn.MultiheadAttention(batch_first=True)`` forward with
  ``need_weights=False`` then ``out.backward(grad_out)``, x requiring grad;
- torch SDPA: ``F.linear`` projections around
  ``F.scaled_dot_product_attention`` and ``F.linear`` for W^O, forward then
  backward, x requiring grad.

Both libraries use the same weights and --threads threads (default: every
CPU this process may use). mhattn's gradients are checked once against the
faster torch variant's (an AssertionError stops the run). Targets, printed
as PASS / MISS: bwd <= 2.5 x fwd, and fwd + bwd >= 1.5 x faster than the
faster torch variant for T >= 1024 in float32. The machine may be shared:
ratios are taken between medians of the same run, and the same table is
printed for the CPU time of all the process's threads, which another
process's load disturbs less than wall time.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

from mhbench.backward import D_MODEL, HEADS, report  # noqa: E402
from mhbench.configs import parse_config  # noqa: E402
from mhbench.optional import import_torch  # noqa: E402
from mhbench.threads import set_threads, usable_cpus  # noqa: E402

import mhattn  # noqa: E402


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--configs", nargs="+", type=parse_config, metavar="TxDxH",
                    help="configurations (T, d_model, h) instead of --T")
    ap.add_argument("--dtype", choices=["f32", "f64"], default="f32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=usable_cpus())
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args(argv)
    if not args.configs:
        args.configs = [(T, D_MODEL, HEADS) for T in args.T]
    return args


def main(argv=None):
    args = parse(argv)
    dtype = np.float32 if args.dtype == "f32" else np.float64
    torch = None if args.no_torch else import_torch()
    if torch is None and not args.no_torch:
        print("torch not installed: mhattn figures only")
    set_threads(args.threads, torch)
    print(f"mhattn {mhattn.__version__} from {os.path.dirname(mhattn.__file__)}")
    print(f"threads {args.threads}, B 1, {args.dtype}, "
          f"causal {args.causal}, median of {args.repeats}"
          + (f", torch {torch.__version__}" if torch else ""))
    report(args.configs, dtype, args.repeats, args.causal, torch)


if __name__ == "__main__":
    main()
