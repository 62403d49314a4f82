"""What structure saves, in one process: attention with ``chunk=N`` (and
``causal``) against plain causal attention and against the same chunks
passed as a dense bool ``mask=``; and a document mask (``--docs`` documents
of random lengths in one row) as a ``mhattn.BlockMask`` against no mask and
against the same mask passed dense.

    python benchmarks/bench_structured.py [--T 4096] [--heads 8] [--dk 64]
                                          [--chunk 512] [--docs 16] [--rounds 5]
                                          [--stat min] [--layer]

The timed call is ``mhattn.attention(q, k, v, ...)`` on projected float32
tensors (B, H, T, d_k), forward, and forward + backward
(``attention_grad`` with the forward's lse and out). Each round times every
variant once (rotating which goes first) and keeps each one's median call
(``--stat min``: the fastest call); the table gives the median (or fastest)
round and the ratio to the table's first row. ``--layer`` times
``multi_head_attention`` on x (1, T, H d_k) instead, whose projections
no mask saves. Issue 39's targets at T = 4096, 8 heads of 64:
``chunk=512`` with causal at most 0.2 of the causal time; 16 documents as
a BlockMask at most 0.15 of no mask's time and 0.2 of the dense mask's.
The ISA is printed first; quote ratios of one run.
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
    ap.add_argument("--docs", type=int, default=16, help="documents in the row")
    ap.add_argument("--random-lengths", action="store_true",
                    help="documents of random lengths (default: equal ones)")
    ap.add_argument("--block", type=int, default=128, help="the BlockMask's block size")
    ap.add_argument("--layer", action="store_true",
                    help="time multi_head_attention (with projections)")
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
    # Documents of equal lengths (the last takes the rest), or random ones
    # of at least 1 token each; kept: the fraction of (query, key) pairs the
    # mask keeps, the least work there is.
    if a.random_lengths:
        cuts = np.sort(rng.choice(np.arange(1, a.T), a.docs - 1, replace=False))
    else:
        cuts = np.arange(1, a.docs) * (a.T // a.docs)
    lengths = np.diff(np.concatenate([[0], cuts, [a.T]]))
    doc = np.repeat(np.arange(a.docs), lengths)
    kept = float((lengths.astype(float) ** 2).sum()) / a.T ** 2
    docs = mhattn.BlockMask.from_function(lambda b, h, q, kv: doc[q] == doc[kv], 1, 1,
                                          a.T, a.T, block=a.block)
    tables = [
        {"causal": dict(causal=True),
         f"causal, chunk={a.chunk}": dict(causal=True, chunk=a.chunk),
         f"causal, chunk={a.chunk} as a dense mask": dict(causal=True, mask=dense)},
        {"no mask": {},
         f"{a.docs} documents as a BlockMask": dict(block_mask=docs),
         f"{a.docs} documents as a dense mask": dict(mask=docs.to_dense()[0, 0])},
    ]
    what = "multi_head_attention, x (1, T, H d_k)" if a.layer else "attention, (B, H, T, d_k)"
    print(f"ISA {mhattn.get_isa()}, {mhattn.get_num_threads()} threads; {what}, float32, "
          f"(B, H, T, d_k) = {shape}, stat {a.stat}; {docs!r}, document lengths "
          f"{lengths.tolist()}, keeping {kept:.3f} of the pairs")
    x = rng.standard_normal((1, a.T, a.heads * a.dk)).astype(np.float32)
    w = [rng.standard_normal((a.heads * a.dk,) * 2).astype(np.float32) * 0.05
         for _ in range(4)]
    gx = rng.standard_normal(x.shape).astype(np.float32)
    for variants in tables:
        for backward in (False, True):
            def call(kw):
                if a.layer and not backward:
                    return mhattn.multi_head_attention(x, *w, num_heads=a.heads, **kw)
                if a.layer:
                    return mhattn.multi_head_attention_grad(gx, x, *w, num_heads=a.heads, **kw)
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
            print(f"| variant | ms | / {names[0]} |")
            print("|---|---|---|")
            base = stat(rounds[names[0]])
            for name in names:
                t = stat(rounds[name])
                print(f"| {name} | {t * 1e3:.2f} | {t / base:.3f} |")

if __name__ == "__main__":
    main()
