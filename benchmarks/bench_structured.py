"""What structure saves: attention with ``chunk=N`` (and ``causal``) against
plain causal attention and against the same chunks passed as a dense bool
``mask=``, in one process.

    python benchmarks/bench_structured.py [--T 4096] [--heads 8] [--dk 64]
                                          [--chunk 512] [--rounds 5] [--stat min]

The timed call is ``mhattn.attention(q, k, v, ...)`` on projected float32
tensors (B, H, T, d_k), forward, and forward + backward
(``attention_grad`` with the forward's lse and out). Each round times every
variant once (rotating which goes first) and keeps each one's median call
(``--stat min``: the fastest call); the table gives the median (or fastest)
round and the ratio to causal attention. Issue 39's target: ``chunk=512``
with causal at most 0.2 of the causal time at T = 4096. The ISA is
printed first; quote ratios of one run.
"""
import argparse
import statistics

import numpy as np

import mhattn
from bench_dropout import round_time as timed   # one call's time, `stat` over a budget


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dk", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=1.0, help="seconds per variant per round")
    ap.add_argument("--stat", choices=("median", "min"), default="median")
    a = ap.parse_args()
    stat = statistics.median if a.stat == "median" else min
    rng = np.random.default_rng(0)
    shape = (1, a.heads, a.T, a.dk)
    q, k, v, g = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    i = np.arange(a.T)
    dense = (i[:, None] // a.chunk == i[None, :] // a.chunk) & (i[None, :] <= i[:, None])
    variants = {
        "causal": dict(causal=True),
        f"causal, chunk={a.chunk}": dict(causal=True, chunk=a.chunk),
        f"causal, chunk={a.chunk} as a dense mask": dict(causal=True, mask=dense),
    }
    print(f"ISA {mhattn.get_isa()}, {mhattn.get_num_threads()} threads; attention, float32, "
          f"(B, H, T, d_k) = {shape}, stat {a.stat}")
    for backward in (False, True):
        def call(kw):
            if not backward:
                return mhattn.attention(q, k, v, **kw)
            out, lse = mhattn.attention(q, k, v, return_lse=True, **kw)
            return mhattn.attention_grad(g, q, k, v, lse=lse, out=out, **kw)
        rounds = {name: [] for name in variants}
        names = list(variants)
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                rounds[name].append(timed(lambda: call(variants[name]), a.budget, stat))
        print(f"\n{'forward + backward' if backward else 'forward'}:")
        print("| variant | ms | / causal |")
        print("|---|---|---|")
        base = stat(rounds["causal"])
        for name in names:
            t = stat(rounds[name])
            print(f"| {name} | {t * 1e3:.2f} | {t / base:.3f} |")


if __name__ == "__main__":
    main()
