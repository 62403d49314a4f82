#!/usr/bin/env python3
"""An mhattn call alternating with another library's matmul, against the two apart.

    python benchmarks/bench_alternate.py              # every row below
    python benchmarks/bench_alternate.py -n 40 --repeats 9 --only numpy

A script that prints figures, not a timed test.  Each row runs in its own
subprocess (OpenBLAS reads ``OPENBLAS_THREAD_TIMEOUT`` when it loads) and
times, ``--repeats`` times each and interleaved, two loops of ``-n``
iterations:

- *alternate*: {peer 512x512 float32 matmul; ``mhattn.multi_head_attention``
  at (T=128, d_model=512, h=8), B=1, float32} n times;
- *apart*: n peer matmuls, then n mhattn calls.

It prints the medians (ms per loop), the ratio alternate / apart (1.00 is
perfect manners), and how much slower each side ran inside the alternate
loop than apart ("peer x", "mhattn x": who suffered), and the median
mhattn call apart ("ms/call").  The rows:

- ``numpy``: NumPy's matmul on OpenBLAS as it comes (its workers spin
  after each call, for a time set by ``OPENBLAS_THREAD_TIMEOUT``);
- ``numpy, OPENBLAS_THREAD_TIMEOUT=1``: OpenBLAS's idle workers spin for
  2**4 cycles before they sleep (v means 2**v cycles, v clamped to 4..30;
  the default is 2**28, about 0.1 s);
- ``numpy, threadpoolctl blas=1``: the matmul run under
  ``threadpoolctl.threadpool_limits(1, user_api="blas")``, so OpenBLAS
  starts no threads at all;
- ``torch`` (when it imports): ``torch.mm`` with ``torch.set_num_threads(2)``
  (its OpenMP pool spins too; ``OMP_WAIT_POLICY=passive`` stops that).

What a user can do about OpenBLAS's spinning, measured with this script on
a 2-core Zen 3 VM (ISA avx2, mhattn at 2 threads, OpenBLAS 0.3.31 at 2,
torch 2.13 at 2) that other jobs kept loaded (load average 2.5-4.6), so
that absolute times varied 3x from run to run: ``-n 20 --repeats 9``, the
old pool (always spin 50 us) and the new one (no spinning while
oversubscribed) run alternately, 9 rounds each (3 for the passive row);
medians over the rounds of ratio / peer x / mhattn x / mhattn ms per call
apart:

    row                                old pool                  new pool
    numpy                              1.11 1.01 1.37 9.57       1.14 1.12 1.36 8.35
    numpy, OPENBLAS_THREAD_TIMEOUT=1   1.03 1.07 1.01 7.69       1.03 1.07 1.02 4.99
    numpy, threadpoolctl blas=1        1.01 1.04 0.98 7.98       1.06 1.02 1.04 5.16
    torch                              1.18 0.98 1.53 8.49       1.13 0.95 1.54 6.74
    torch, OMP_WAIT_POLICY=passive     1.03 1.08 1.01 7.33       0.99 0.99 0.99 6.79

The loop ratios did not move beyond the noise; mhattn's calls apart were
faster with the new pool in every row (the machine was oversubscribed
throughout). With OpenBLAS as it comes, mhattn is 1.4x slower inside the
loop whatever its pool does: for 0.1 s after each matmul an OpenBLAS
worker spins on one of the two cores, so mhattn's two threads share two
cores with a third that never yields, and no waiting strategy gives that
core back.

Later (2026-12-02, Zen 4, ISA avx512, quieter): the pool's alarm now
needs the OS to have preempted the late worker, and calms 16 phases, not
256, because after every 0.1 s idle spell workers came late without any
contention (the VM's host) and the old alarm slowed the next ~15 calls.
Loop ratios, default ``-n 50 --repeats 7``, runs alternated, for the old
pool / the new one / no alarm at all: numpy 1.21, 1.33 / 1.19, 1.32 /
1.30, 1.34; ``OPENBLAS_THREAD_TIMEOUT=1`` 1.05, 1.19 / 1.07, 1.17 / 1.39,
1.20; threadpoolctl 1.16 / 1.13 / 1.04; torch 1.47 / 1.40 / 1.51;
``OMP_WAIT_POLICY=passive`` 1.06 / 1.15 / 1.11: no difference beyond the
noise, so the alarm is kept, in its narrower form.

Later still (2026-12-02, Zen 3, ISA avx2): a call now waits only for the
workers that joined it (core/threads.c), not for one that had not woken
by the time every task was handed out. ``--only numpy torch``, the old
and the new build run twice, alternately; ratio and mhattn x, old / new:
numpy 1.30, 1.26 and 1.31, 1.22 / 1.22, 1.22 and 1.19, 1.13; torch 1.68,
1.57 and 2.06, 1.80 / 1.50, 1.42 and 1.66, 1.61. The other rows did not
move (1.01-1.05). The rest is, as above, the peer's spinning thread
holding one of the two cores.

So: set ``OPENBLAS_THREAD_TIMEOUT=1`` in the environment before NumPy is
imported, or wrap the NumPy-heavy part in
``threadpoolctl.threadpool_limits(1, user_api="blas")``, or give each
library fewer threads than cores (``OPENBLAS_NUM_THREADS``,
``mhattn.set_num_threads``) so their pools do not contend; for PyTorch,
``OMP_WAIT_POLICY=passive`` before torch is imported.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROWS = [
    # (name, peer, extra environment, threadpoolctl blas limit)
    ("numpy", "numpy", {}, None),
    ("numpy, OPENBLAS_THREAD_TIMEOUT=1", "numpy", {"OPENBLAS_THREAD_TIMEOUT": "1"}, None),
    ("numpy, threadpoolctl blas=1", "numpy", {}, 1),
    ("torch", "torch", {}, None),
    ("torch, OMP_WAIT_POLICY=passive", "torch", {"OMP_WAIT_POLICY": "passive"}, None),
]


def child(cfg):
    """Runs one row in this process and prints its figures as JSON."""
    import numpy as np

    import mhattn

    rng = np.random.default_rng(0)
    T, d, h = 128, 512, 8
    x = rng.standard_normal((1, T, d)).astype(np.float32)
    w = [(rng.standard_normal((d, d)) / d ** 0.5).astype(np.float32) for _ in range(4)]
    a = rng.standard_normal((512, 512)).astype(np.float32)
    b = rng.standard_normal((512, 512)).astype(np.float32)
    info = {"isa": mhattn.get_isa(), "mhattn_threads": mhattn.get_num_threads()}

    if cfg["peer"] == "torch":
        try:
            import torch
        except ImportError:
            print(json.dumps({"skip": "torch does not import"}))
            return
        torch.set_num_threads(2)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)

        def peer():
            torch.mm(ta, tb)
        info["peer_threads"] = torch.get_num_threads()
    else:
        def peer():
            a @ b
        info["peer_threads"] = None

    limiter = None
    if cfg["blas_limit"] is not None:
        try:
            import threadpoolctl
        except ImportError:
            print(json.dumps({"skip": "threadpoolctl does not import"}))
            return
        limiter = threadpoolctl.threadpool_limits(cfg["blas_limit"], user_api="blas")
    if info["peer_threads"] is None:
        try:
            import threadpoolctl
            blas = [i for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
            info["peer_threads"] = blas[0]["num_threads"] if blas else None
        except ImportError:
            pass

    def mha():
        mhattn.multi_head_attention(x, *w, num_heads=h)

    n = cfg["n"]

    def alternate():
        tp = tm = 0.0
        t0 = time.perf_counter()
        for _ in range(n):
            t1 = time.perf_counter()
            peer()
            t2 = time.perf_counter()
            mha()
            t3 = time.perf_counter()
            tp += t2 - t1
            tm += t3 - t2
        return time.perf_counter() - t0, tp, tm

    def apart():
        t0 = time.perf_counter()
        for _ in range(n):
            peer()
        t1 = time.perf_counter()
        for _ in range(n):
            mha()
        t2 = time.perf_counter()
        return t2 - t0, t1 - t0, t2 - t1

    for _ in range(3):  # warm up both pools and the caches
        peer()
        mha()
    alt, apt = [], []
    for _ in range(cfg["repeats"]):
        alt.append(alternate())
        apt.append(apart())
    if limiter is not None:
        limiter.restore_original_limits()

    def med(rows, i):
        return statistics.median(r[i] for r in rows) * 1e3

    info.update(alt=med(alt, 0), apart=med(apt, 0), alt_peer=med(alt, 1),
                apart_peer=med(apt, 1), alt_mha=med(alt, 2), apart_mha=med(apt, 2))
    print(json.dumps(info))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=50, help="iterations per loop")
    p.add_argument("--repeats", type=int, default=7, help="loops timed, each kind")
    p.add_argument("--only", nargs="*", default=None,
                   help="rows whose name starts with one of these")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child(json.loads(args.child))
        return

    print(f"alternate = {args.n} x {{peer 512x512 float32 matmul; mhattn (T=128, "
          f"d_model=512, h=8), B=1, float32}}; apart = {args.n} matmuls, then {args.n} "
          f"mhattn calls; median of {args.repeats}, ms per loop")
    head = True
    for name, peer, env_extra, limit in ROWS:
        if args.only and not any(name.startswith(o) for o in args.only):
            continue
        env = dict(os.environ, **env_extra)
        cfg = dict(peer=peer, blas_limit=limit, n=args.n, repeats=args.repeats)
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)],
                             env=env, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{name}: failed\n{out.stderr}", file=sys.stderr)
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        if "skip" in r:
            print(f"{name:34} skipped: {r['skip']}")
            continue
        if head:
            print(f"ISA {r['isa']}; mhattn threads {r['mhattn_threads']}; "
                  f"os.cpu_count() {os.cpu_count()}")
            print(f"{'row':34} {'peer thr':>8} {'alternate':>9} {'apart':>8} "
                  f"{'ratio':>6} {'peer x':>7} {'mhattn x':>8} {'ms/call':>7}")
            head = False
        print(f"{name:34} {str(r['peer_threads']):>8} {r['alt']:9.1f} {r['apart']:8.1f} "
              f"{r['alt'] / r['apart']:6.2f} {r['alt_peer'] / r['apart_peer']:7.2f} "
              f"{r['alt_mha'] / r['apart_mha']:8.2f} {r['apart_mha'] / args.n:7.2f}",
              flush=True)


if __name__ == "__main__":
    main()
