"""A/B timing of two or more builds of mhattn on one case.

Each build is a source tree whose extension is built in place (or a folder
that holds an ``mhattn`` package, such as a venv's site-packages), for
example main at two commits:

    git worktree add /tmp/before beebed4 && make -C /tmp/before build
    make build
    python benchmarks/bench_ab.py --case layer:128x512x8 --packed /tmp/before .

Every round runs each build once, in a fresh process that imports mhattn
from that tree's ``python/`` folder, and takes the median of its calls over
``--budget`` seconds; the order of the builds alternates from round to
round, so that a drift of the machine falls on each build alike.  The table
gives, per build, the median of its round medians, the ratio to the first
build (> 1: faster than the first) and every round's median, so a noisy
round shows.  On a shared machine, quote the ratio of one run, never a
lone time, and the ISA (printed first).  Where other tenants' load makes
even the medians wander, ``--stat min`` takes each round's fastest call
and the fastest round instead: for a compute-bound kernel a difference of
1-2% then shows, which the medians' noise hides.

Cases:
    layer:TxDxH   multi_head_attention on (B, T, D) (B = 1: (T, D)), H heads
    attn:TxHxDK   mhattn.attention on q, k, v of (B, H, T, DK)
    step:TxDxH    the cached decode step: multi_head_attention of one new
                  token (B, 1, D) with cache= a KVCache that holds T tokens
                  at the first call (each call appends its token, so the
                  cache holds T to T + the calls made; every build makes
                  the same calls)
    decode:TKxHxGxDK  the attention-only decode step: mhattn.attention of
                  q (B, H, 1, DK) on k, v (B, G, TK, DK), G kv heads
                  (G < H: grouped-query)
with --batch B, --causal, --dtype f32|f64, --packed (layer: pack_weights,
packed once outside the timing), --backward (layer:
multi_head_attention_grad; attn: attention_grad) and --threads N
(mhattn.set_num_threads in the timed processes).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

KINDS = ("layer", "attn", "step", "decode")
MAX_CALLS = 5000   # time_call's cap: a step case's cache has room for them


def parse_case(text):
    """``"layer:128x512x8"`` -> ``("layer", (128, 512, 8))``."""
    kind, _, dims = text.partition(":")
    parts = dims.lower().split("x")
    n = 4 if kind == "decode" else 3
    if (kind not in KINDS or len(parts) != n
            or not all(p.isdigit() and int(p) > 0 for p in parts)
            or (kind == "decode" and int(parts[1]) % int(parts[2]) != 0)):
        raise argparse.ArgumentTypeError(
            f"--case {text!r}: expected layer:TxDxH, attn:TxHxDK, step:TxDxH or "
            "decode:TKxHxGxDK (H a multiple of G) with positive integers")
    return kind, tuple(int(p) for p in parts)


def make_call(mhattn, np, args):
    """The timed call of the case, and its FLOP count: the forward's, times 3
    for a layer's backward and 2.5 for attention's (its GEMMs' share)."""
    kind = args.case[0]
    dtype = np.float32 if args.dtype == "f32" else np.float64
    rng = np.random.default_rng(args.seed)
    B, causal = args.batch, args.causal
    if kind == "decode":
        Tk, H, G, dk = args.case[1]
        q = rng.standard_normal((B, H, 1, dk)).astype(dtype)
        k, v = (rng.standard_normal((B, G, Tk, dk)).astype(dtype) for _ in range(2))
        return (lambda: mhattn.attention(q, k, v)), 4 * B * H * Tk * dk
    a, b, c = args.case[1]
    if kind == "layer":
        T, d, h = a, b, c
        x = rng.standard_normal((B, T, d) if B > 1 else (T, d)).astype(dtype)
        W = [(rng.standard_normal((d, d)) / np.sqrt(d)).astype(dtype) for _ in range(4)]
        flops = B * (8 * T * d * d + 4 * T * T * d * (0.5 if causal else 1))
        weights = (mhattn.pack_weights(*W, num_heads=h),) if args.packed else tuple(W)
        kw = {} if args.packed else {"num_heads": h}
        if args.backward:
            g = rng.standard_normal(x.shape).astype(dtype)
            return (lambda: mhattn.multi_head_attention_grad(g, x, *weights, causal=causal, **kw)), 3 * flops
        return (lambda: mhattn.multi_head_attention(x, *weights, causal=causal, **kw)), flops
    if kind == "step":
        return make_step(mhattn, np, args, rng, dtype)
    T, H, dk = a, b, c
    q, k, v = (rng.standard_normal((B, H, T, dk)).astype(dtype) for _ in range(3))
    flops = 4 * B * H * T * T * dk * (0.5 if causal else 1)
    if args.backward:
        g = rng.standard_normal(q.shape).astype(dtype)
        return (lambda: mhattn.attention_grad(g, q, k, v, causal=causal)), 2.5 * flops
    return (lambda: mhattn.attention(q, k, v, causal=causal)), flops


def make_step(mhattn, np, args, rng, dtype):
    """The cached decode step of a step:TxDxH case: a KVCache of B
    sequences filled with T tokens by one prefill call, then one token per
    call; its FLOP count is the new token's projections and its attention
    over T keys."""
    T, d, h = args.case[1]
    B = args.batch
    W = [(rng.standard_normal((d, d)) / np.sqrt(d)).astype(dtype) for _ in range(4)]
    weights = (mhattn.pack_weights(*W, num_heads=h),) if args.packed else tuple(W)
    kw = {} if args.packed else {"num_heads": h}
    cache = mhattn.KVCache(B, h, T + MAX_CALLS + 16, d // h, dtype=dtype)
    mhattn.multi_head_attention(rng.standard_normal((B, T, d)).astype(dtype), *weights,
                                cache=cache, **kw)
    x_new = rng.standard_normal((B, 1, d)).astype(dtype)
    flops = B * (8 * d * d + 4 * T * d)
    return (lambda: mhattn.multi_head_attention(x_new, *weights, cache=cache, **kw)), flops


def time_call(fn, budget, stat="median", min_calls=5, max_calls=MAX_CALLS):
    """Seconds of one call, the median (or with stat="min" the fastest)
    of calls for ~budget s after one warm-up, each timed alone (bench.py's
    mhbench.timing.Timed)."""
    from mhbench.timing import Timed
    t = Timed(fn, min_repeats=min_calls)
    t.start(budget, max_repeats=max_calls)
    t.run(t.repeats - len(t.samples))
    return min(t.samples) if stat == "min" else t.median_s


def child(args):
    """Runs in a fresh process: time the case with the mhattn of args.child
    (its python/ folder, or the folder itself)."""
    where = os.path.abspath(args.child)
    if os.path.isdir(os.path.join(where, "python", "mhattn")):
        where = os.path.join(where, "python")
    sys.path.insert(0, where)
    import numpy as np
    import mhattn
    if not os.path.abspath(mhattn.__file__).startswith(where + os.sep):
        sys.exit(f"{args.child}: no mhattn in {where} (imported {mhattn.__file__})")
    if args.threads:
        mhattn.set_num_threads(args.threads)
    fn, flops = make_call(mhattn, np, args)
    sec = time_call(fn, args.budget, args.stat)
    print(json.dumps({"ms": sec * 1e3, "gflops": flops / sec / 1e9,
                      "isa": mhattn.get_isa(), "file": mhattn.__file__}))


def run_round(build, argv):
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", build] + argv,
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"build {build}: the timed process failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def child_argv(args):
    """The options of the case, for the timed processes."""
    kind, dims = args.case
    argv = ["--case", f"{kind}:{'x'.join(map(str, dims))}", "--batch", str(args.batch),
            "--dtype", args.dtype, "--budget", repr(args.budget), "--seed", str(args.seed),
            "--stat", args.stat, "--threads", str(args.threads)]
    return argv + [f"--{flag}" for flag in ("causal", "packed", "backward") if getattr(args, flag)]


def summarize(builds, results, stat="median"):
    """Rows of (build, ms, ratio to the first, GFLOP/s, rounds): ms and
    GFLOP/s over the rounds by their median (stat="min": the fastest
    round's); results[i] holds build i's rounds."""
    if stat == "min":
        pick, pick_gf = min, max
    else:
        pick = pick_gf = statistics.median
    base = pick(r["ms"] for r in results[0])
    rows = []
    for b, res in zip(builds, results):
        ms = [r["ms"] for r in res]
        at = pick(ms)
        rows.append((b, at, base / at, pick_gf(r["gflops"] for r in res), ms))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("builds", nargs="*", help="source trees with the extension built in place")
    p.add_argument("--case", type=parse_case, default=parse_case("layer:128x512x8"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--packed", action="store_true")
    p.add_argument("--backward", action="store_true")
    p.add_argument("--dtype", choices=("f32", "f64"), default="f32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget", type=float, default=1.5, help="seconds of calls per build and round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="per round and over the rounds: the median (default) or the fastest")
    p.add_argument("--threads", type=int, default=0,
                   help="mhattn.set_num_threads(N) in the timed processes (0: the default)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    if len(args.builds) < 1 or args.rounds < 1 or args.batch < 1 or args.threads < 0:
        p.error("give at least one build, --rounds >= 1, --batch >= 1 and --threads >= 0")
    if args.packed and args.case[0] in ("attn", "decode"):
        p.error("--packed is for layer and step cases")
    if args.case[0] in ("step", "decode") and (args.backward or args.causal):
        p.error(f"a {args.case[0]} case has no --backward or --causal (a decode step is causal)")
    order = list(range(len(args.builds)))
    results = [[] for _ in order]
    for r in range(args.rounds):
        for i in (order if r % 2 == 0 else order[::-1]):
            results[i].append(run_round(args.builds[i], child_argv(args)))
    isa = {res["isa"] for res_i in results for res in res_i}
    kind, dims = args.case
    print(f"{kind} {'x'.join(map(str, dims))} B={args.batch} {args.dtype}"
          f"{' causal' if args.causal else ''}{' packed' if args.packed else ''}"
          f"{' backward' if args.backward else ''}; ISA {', '.join(sorted(isa))};"
          f" {args.rounds} alternating rounds of ~{args.budget} s per build"
          f"{f'; {args.threads} threads' if args.threads else ''}")
    head = "fastest ms" if args.stat == "min" else "median ms"
    print(f"{'build':30s} {head:>10s} {'vs first':>9s} {'GFLOP/s':>8s}  rounds (ms)")
    for b, med, ratio, gf, ms in summarize(args.builds, results, args.stat):
        print(f"{b:30s} {med:10.3f} {ratio:8.3f}x {gf:8.1f}  {' '.join(f'{v:.3f}' for v in ms)}")


if __name__ == "__main__":
    main()
