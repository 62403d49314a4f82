#!/usr/bin/env python3
"""bfloat16 against float32 weight panels in the packed GEMM (issue 36,
item 5): which should ``pack_weights`` of bfloat16 weights cut?

    python benchmarks/panels.py            # the grid below, 9 repeats
    python benchmarks/panels.py --quick    # small sizes, seconds

``pack_weights`` widens bfloat16 weights once, into float32 panels.  The
alternative keeps bfloat16 panels (half the bytes) and widens each vector
in the micro-kernel.  benchmarks/panels.c times both through the library's
own micro-kernel (csrc/kernels/gemm_ukr.inc, compiled twice) and a
one-thread driver with the library's blocking, after checking that the two
give the same bits.  It is compiled here for AVX2 and, where the CPU has
it, AVX-512.  A script that prints a table, not a timed test.

Rows: x (M, K) times W distinct (K, N) weights in turn, as a layer's
projections are.  W = 4 at d_model 512 keeps the panels in the last-level
cache (4 MiB as float32); W = 24 at 2048 streams 384 MiB of float32 panels
(192 MiB as bfloat16) from memory, where half the bytes could pay.
"bf16/f32" is the bfloat16 panels' median time over the float32 panels'
(below 1: bfloat16 panels faster).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(os.path.dirname(HERE), "csrc")

GRID = [  # M, K, N, weights
    (128, 512, 512, 4), (1024, 512, 512, 4), (4096, 512, 512, 4),
    (16, 2048, 2048, 24), (128, 2048, 2048, 24),
]
QUICK = [(128, 256, 256, 4), (16, 512, 512, 8)]


def cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build(tmp: str, avx512: bool) -> str:
    exe = os.path.join(tmp, "panels512" if avx512 else "panels2")
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-O2", f"-I{CSRC}/core", f"-I{CSRC}/kernels", f"-I{CSRC}",
                    f"-DPANELS_AVX512={int(avx512)}", os.path.join(HERE, "panels.c"),
                    "-o", exe, "-lm"], check=True)
    return exe


def main(argv=None):
    """Prints the table; returns its rows, (isa, M, K, N, W, f32 ms, bf16 ms),
    or None where the CPU cannot run it."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes")
    ap.add_argument("--repeats", type=int, default=9, help="passes a median takes")
    args = ap.parse_args(argv)
    flags = cpu_flags()
    if "avx2" not in flags or "fma" not in flags:
        print("panels: needs an x86-64 CPU with AVX2 + FMA; not run")
        return None
    isas = ["avx2"] + (["avx512"] if "avx512f" in flags else [])
    print(f"CPU flags: {' '.join(f for f in ('avx2', 'avx512f', 'avx512_bf16') if f in flags)};"
          f" 1 thread; medians of {args.repeats} passes")
    print(f"{'isa':7} {'M':>5} {'K':>5} {'N':>5} {'W':>3} {'f32 MiB':>8} "
          f"{'f32 ms':>9} {'bf16 ms':>9} {'bf16/f32':>8}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="mhattn-panels-") as tmp:
        for isa in isas:
            exe = build(tmp, isa == "avx512")
            for m, k, n, w in (QUICK if args.quick else GRID):
                # panels.c exits 1 when the two kinds of panel give other bits
                out = subprocess.run([exe, str(m), str(k), str(n), str(w), str(args.repeats)],
                                     check=True, capture_output=True, text=True).stdout.split()
                t32, t16 = float(out[4]), float(out[5])
                rows.append((isa, m, k, n, w, t32, t16))
                print(f"{isa:7} {m:5} {k:5} {n:5} {w:3} {k * n * w * 4 / 2**20:8.0f} "
                      f"{t32:9.3f} {t16:9.3f} {t16 / t32:8.2f}")
    return rows


if __name__ == "__main__":
    main()
