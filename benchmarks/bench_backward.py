#!/usr/bin/env python3
"""Backward benchmark: mhattn's forward and backward against torch autograd.

    python benchmarks/bench_backward.py                 # T = 1024, 2048
    python benchmarks/bench_backward.py --T 1024 --repeats 3 --causal
    python benchmarks/bench_backward.py --threads 1
    python benchmarks/bench_backward.py --configs 2048x1024x16

A script that prints figures, not a timed test (``benchmarks/bench.py``
prints the same table for its float32 configurations with T >= 1024, by
importing ``report`` from here).  For each T (d_model 512, h 8, one
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
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

import mhattn  # noqa: E402

D_MODEL, HEADS = 512, 8
BWD_OVER_FWD_MAX = 2.5     # target: backward <= 2.5 x forward
SPEEDUP_MIN = 1.5          # target: fwd + bwd >= 1.5 x faster than torch


def median_time(fn, repeats):
    """(wall, cpu): medians over repeats of the wall time and of the CPU
    time of the whole process (every thread), after one warm-up."""
    fn()  # warm-up (and first-touch of every buffer)
    wall, cpu = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--configs", nargs="+", metavar="TxDxH",
                    help="configurations (T, d_model, h) instead of --T")
    ap.add_argument("--dtype", choices=["f32", "f64"], default="f32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args(argv)
    try:
        args.configs = ([tuple(int(p) for p in c.lower().split("x")) for c in args.configs]
                        if args.configs else [(T, D_MODEL, HEADS) for T in args.T])
    except ValueError:
        ap.error(f"--configs: expected TxDxH such as 1024x512x8, got {args.configs}")
    return args


def main(argv=None):
    args = parse(argv)
    dtype = np.float32 if args.dtype == "f32" else np.float64
    mhattn.set_num_threads(args.threads)
    torch = None
    if not args.no_torch:
        try:
            import torch
            torch.set_num_threads(args.threads)
        except ImportError:
            print("torch not installed: mhattn figures only")
    print(f"mhattn {mhattn.__version__} from {os.path.dirname(mhattn.__file__)}")
    print(f"threads {args.threads}, B 1, {args.dtype}, "
          f"causal {args.causal}, median of {args.repeats}"
          + (f", torch {torch.__version__}" if torch else ""))
    report(args.configs, dtype, args.repeats, args.causal, torch)


def report(configs, dtype, repeats, causal, torch):
    """Measures and prints the table for configs [(T, d_model, h)], dtype
    np.float32 or np.float64; torch is the module or None. Returns the rows
    (T, d_model, h, figures), times in seconds as (wall, cpu) pairs."""
    args = argparse.Namespace(repeats=repeats, causal=causal)
    rows = [(T, d, h, measure(T, dtype, args, torch, d, h)) for T, d, h in configs]
    for clock, k in (("wall time", 0), ("CPU time of all threads", 1)):
        print(f"\n{clock} (medians){', causal' if causal else ''}:")
        header = (f"{'T x d x h':>14} {'fwd ms':>9} {'bwd ms':>9} {'bwd/fwd':>8} {'f+b ms':>9} "
                  f"{'MHA ms':>9} {'SDPA ms':>9} {'speedup':>8}  targets")
        print(header)
        print("-" * len(header))
        for T, d, h, r in rows:
            row = {name: (v[k] if isinstance(v, tuple) else v) for name, v in r.items()}
            fb = row["fwd"] + row["bwd"]
            targets = [("bwd<=2.5fwd", row["bwd"] <= BWD_OVER_FWD_MAX * row["fwd"])]
            speedup = None
            if "mha" in row:
                speedup = min(row["mha"], row["sdpa"]) / fb
                if T >= 1024 and dtype == np.float32:
                    targets.append(("f+b>=1.5x torch", speedup >= SPEEDUP_MIN))
            tstr = "  ".join(f"{n} {'PASS' if ok else 'MISS'}" for n, ok in targets)
            fmt = lambda v: f"{v * 1e3:9.1f}" if v is not None else f"{'-':>9}"  # noqa: E731
            sp = f"{speedup:7.2f}x" if speedup else f"{'-':>8}"
            print(f"{f'{T}x{d}x{h}':>14} {fmt(row['fwd'])} {fmt(row['bwd'])} "
                  f"{row['bwd'] / row['fwd']:7.2f}x {fmt(fb)} {fmt(row.get('mha'))} "
                  f"{fmt(row.get('sdpa'))} {sp}  {tstr}")
    print()
    print("bwd/fwd: backward over forward (target <= 2.5); speedup: the faster torch "
          "variant's forward+backward over mhattn's fwd+bwd (target >= 1.5). The\n"
          "targets are on wall time; CPU time is printed too because on a shared "
          "machine it is the steadier figure.")
    return rows


def measure(T, dtype, args, torch, d_model=D_MODEL, heads=HEADS):
    rng = np.random.default_rng(T)
    layer = mhattn.MultiHeadAttention(d_model, heads, bias=True, dtype=dtype, seed=T)
    for name in ("b_q", "b_k", "b_v", "b_o"):
        setattr(layer, name, (0.1 * rng.standard_normal(getattr(layer, name).shape))
                .astype(dtype))
    x = rng.standard_normal((T, d_model)).astype(dtype)
    grad_out = rng.standard_normal((T, d_model)).astype(dtype)
    kw = dict(causal=True) if args.causal else {}

    state = {}

    def fwd():
        state["out"], state["ctx"] = layer(x, return_context=True, **kw)

    def bwd():
        state["grads"] = layer.backward(grad_out, state["ctx"])

    row = {"fwd": median_time(fwd, args.repeats)}
    fwd()
    row["bwd"] = median_time(bwd, args.repeats)
    if torch is None:
        return row

    tdt = torch.float32 if dtype == np.float32 else torch.float64
    module = layer.to_torch()
    module.train()   # autograd; dropout is 0
    xt = torch.from_numpy(x).unsqueeze(0).requires_grad_(True)
    gt = torch.from_numpy(grad_out).unsqueeze(0)
    mask = None
    if args.causal:
        mask = torch.ones((T, T), dtype=torch.bool).triu(1)   # True = blocked

    def zero():
        xt.grad = None
        for p in module.parameters():
            p.grad = None

    def mha():
        zero()
        out, _ = module(xt, xt, xt, need_weights=False, attn_mask=mask,
                        is_causal=args.causal)
        out.backward(gt)

    w_in, b_in = module.in_proj_weight, module.in_proj_bias
    w_out, b_out = module.out_proj.weight, module.out_proj.bias

    def sdpa():
        zero()
        qkv = torch.nn.functional.linear(xt, w_in, b_in)       # (1, T, 3E)
        q, k, v = (t.view(1, T, heads, d_model // heads).transpose(1, 2)
                   for t in qkv.split(d_model, dim=-1))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                             is_causal=args.causal)
        out = torch.nn.functional.linear(o.transpose(1, 2).reshape(1, T, d_model),
                                         w_out, b_out)
        out.backward(gt)

    row["mha"] = median_time(mha, args.repeats)
    row["sdpa"] = median_time(sdpa, args.repeats)
    best = sdpa if row["sdpa"][0] <= row["mha"][0] else mha

    # One check that both sides computed the same gradients.
    best()
    ours = layer.backward(grad_out, state["ctx"])
    theirs = {n: p.grad.numpy() for n, p in module.named_parameters()}
    shadow = mhattn.MultiHeadAttention.__new__(mhattn.MultiHeadAttention)
    shadow.__dict__.update(layer.__dict__)
    for name in layer.weights():
        setattr(shadow, name, ours[name])
    ours_t = dict(shadow.state_dict(), x=ours["x"])
    theirs["x"] = xt.grad[0].numpy()
    tol = 1e-3 if dtype == np.float32 else 1e-9
    for name, want in theirs.items():
        err = np.abs(ours_t[name] - want).max() / max(np.abs(want).max(), 1e-30)
        assert err < tol, f"T={T}: gradient of {name} differs from torch by {err:.2e}"
    return row


if __name__ == "__main__":
    main()
