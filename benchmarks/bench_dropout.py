"""What dropout costs: attention forward and backward with ``dropout=p``
against the same calls without it, in one process (``--t5``: T5's relative
bias, ``relative_bias=``, instead).

    python benchmarks/bench_dropout.py [--T 1024] [--heads 8] [--dk 64]
                                       [--batch 1] [--p 0.1] [--rounds 7] [--t5]

The timed step is one training step of attention on projected tensors:
``mhattn.attention(q, k, v, return_lse=True)`` then
``mhattn.attention_grad(g, q, k, v, lse=lse, out=out)`` (the backward
regenerates the mask; nothing is stored), causal and not. Each round times
both variants, alternating which goes first, and takes each one's median
over its calls; the table gives the median of the round medians and their
ratio (dropout / none) (``--stat min``: the fastest call and round). Issue 38's target: at most 1.15 at T = 1024. The
ISA is printed first; quote ratios of one run.
"""
import argparse
import statistics
import time

import numpy as np

import mhattn


def step(q, k, v, g, causal, p, rb=None):
    kw = dict(causal=causal)
    if p:
        kw.update(dropout=p, seed=1)
    if rb is not None:
        kw.update(relative_bias=rb)
    out, lse = mhattn.attention(q, k, v, return_lse=True, **kw)
    mhattn.attention_grad(g, q, k, v, lse=lse, out=out, **kw)


def round_time(fn, budget, stat):
    times, end = [], time.perf_counter() + budget
    while time.perf_counter() < end or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return stat(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dk", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--t5", action="store_true",
                    help="time T5's relative bias (32 buckets, max distance 128) instead")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds per variant per round")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="each round's median call and the median round (default), or "
                         "the fastest call and round: steadier on a loaded machine")
    a = ap.parse_args()
    stat = statistics.median if a.stat == "median" else min
    rng = np.random.default_rng(0)
    shape = (a.batch, a.heads, a.T, a.dk)
    q, k, v, g = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    what = "t5" if a.t5 else "dropout"
    rb = mhattn.RelativeBias(rng.standard_normal((32, a.heads)).astype(np.float32)) \
        if a.t5 else None
    p = 0.0 if a.t5 else a.p
    print(f"ISA {mhattn.get_isa()}, {mhattn.get_num_threads()} threads; attention forward + "
          f"backward, float32, (B, H, T, d_k) = {shape}, "
          f"{'T5 relative bias' if a.t5 else f'dropout p = {a.p}'}, stat {a.stat}")
    print(f"| causal | none ms | {what} ms | {what} / none | rounds (ratio) |")
    print("|---|---|---|---|---|")
    for causal in (False, True):
        none, drop = [], []
        for r in range(a.rounds):
            order = ((False, none), (True, drop)) if r % 2 == 0 else ((True, drop),
                                                                      (False, none))
            for on, sink in order:
                sink.append(round_time(lambda on=on: step(q, k, v, g, causal, p if on else 0,
                                                          rb if on else None),
                                       a.budget, stat))
        n, d = stat(none), stat(drop)
        per = " ".join(f"{y / x:.3f}" for x, y in zip(none, drop))
        print(f"| {causal} | {n * 1e3:.2f} | {d * 1e3:.2f} | {d / n:.3f} | {per} |")


if __name__ == "__main__":
    main()
