#!/usr/bin/env python3
"""Forward benchmark of mhattn against the NumPy reference, PyTorch, ONNX Runtime and JAX.

    python benchmarks/bench.py                  # every configuration (long)
    python benchmarks/bench.py --quick          # no GPT-3 width, fewer repeats
    python benchmarks/bench.py --configs 1024x512x8 3x4x2 --dtypes f32
    python benchmarks/bench.py --json out.json
    python benchmarks/bench.py --no-backward      # forward tables only
    python benchmarks/bench.py --no-ort --no-jax  # without the optional peers
    python benchmarks/bench.py --variants-only    # issue 13's table alone

A script that prints figures, not a timed test.  In one run it measures, for
each configuration (T, d_model, h), batch size, dtype and causal flag:

- mhattn: ``mhattn.multi_head_attention`` with fused weights and num_heads;
- numpy: ``mhattn.reference.multi_head_attention`` (a Python loop per head
  and batch item: few repeats on big configurations, skipped where it would
  take too long or too much memory);
- torch MHA: ``nn.MultiheadAttention`` on its fast path (eval, batch_first,
  need_weights=False, no grad), loaded with the same weights;
- torch SDPA: ``F.linear`` projections around ``F.scaled_dot_product_attention``;
- mhattn packed: ``multi_head_attention(x, packed)`` with ``packed =
  mhattn.pack_weights(w_q, w_k, w_v, w_o, num_heads=h)`` made once, outside
  the timing ("-" where the build has no pack_weights);
- ONNX Runtime (when onnxruntime and onnx import; float32): three graphs
  with the weights as initializers, MatMul + com.microsoft.MultiHeadAttention
  + MatMul, com.microsoft.Attention + MatMul, MatMul + opset-23 Attention +
  MatMul (mhbench/peers_ort.py); the table shows the fastest and names it;
- JAX (when jax imports): the layer as one jit-compiled function, weights
  passed as arguments (mhbench/peers_jax.py).

"vs best peer" is the fastest of torch, ORT and JAX over mhattn (and over
the packed call), naming the peer.

Every measured variant is checked once against mhattn's output (an
AssertionError stops the run: the figures must compare one computation).
Times are medians; ratios are taken between medians of the same run, because
the machine this runs on is shared and noisy.  The FMA peak that "% peak"
refers to is measured at start-up by benchmarks/peak.c, compiled with ``cc``.

Then the variants of today's models (mhbench/models.py): a sliding window,
softcap, ALiBi, sinks, RoPE, q/k norm and packed sequences, each against
its baseline in the same run, with the issue's targets (--no-variants
leaves it out).

Then, for the float32 configurations with T >= 1024, the backward table
of benchmarks/bench_backward.py (from mhbench/backward.py, which both
scripts use): mhattn's forward and backward against PyTorch autograd's, on
the same configurations (--no-backward leaves it out).

This file is the command line; the work is done in the package mhbench/
next to it, one concern per module (see mhbench/__init__.py).  A second
table only needs new ``variants.Variant``s and a list of ``tables.Column``s:
``rows.measure_row`` times and checks them, ``tables.print_table`` prints.
"""
from __future__ import annotations

import argparse
import os
import sys

from mhbench.threads import early_thread_count, set_blas_env, set_jax_env   # no NumPy yet

THREADS = early_thread_count(sys.argv[1:])
set_blas_env(THREADS)   # before NumPy is imported: its BLAS sizes its pool once
JAX_THREADS = set_jax_env(THREADS)   # before jax is imported (by mhbench.peers_jax)

import numpy as np  # noqa: E402  (after the thread variables, on purpose)

from mhbench import backward, models, peers_jax, peers_ort, report  # noqa: E402
from mhbench.configs import CAUSALS, CONFIGS, DTYPES, GPT3, config_name, parse_config  # noqa: E402
from mhbench.figures import derive  # noqa: E402
from mhbench.machine import CpuMeter  # noqa: E402
from mhbench.memory import memory_section  # noqa: E402
from mhbench.peak import print_peak, start_peak  # noqa: E402
from mhbench.refmodel import calibrate_reference  # noqa: E402
from mhbench.rows import run_rows  # noqa: E402
from mhbench.threads import set_threads  # noqa: E402
from mhbench.variants import forward_variants, torch  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="skip the GPT-3-width configuration (unless named in --configs), "
                        "time each variant for ~0.2 s with >= 3 repeats, shorter memory run")
    p.add_argument("--configs", nargs="+", type=parse_config, metavar="TxDxH",
                   help="configurations to run (default: all of "
                        + ", ".join(map(config_name, CONFIGS)) + ")")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["f32", "f64"])
    p.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for mhattn, torch and NumPy's BLAS (default: all "
                        "CPUs this process may use)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds of timing per variant and row (default 0.5, --quick 0.2)")
    p.add_argument("--settle", type=float, default=0.1,
                   help="seconds to sleep before each variant's slice of calls, so that "
                        "the thread pools of the variant before stop spinning (default 0.1)")
    p.add_argument("--min-repeats", type=int, default=None,
                   help="fewest timed repeats (default 5, --quick 3)")
    p.add_argument("--ref-max-seconds", type=float, default=60.0,
                   help="skip the NumPy reference where one call is estimated to take longer")
    p.add_argument("--ref-max-gib", type=float, default=8.0,
                   help="skip the NumPy reference where it would need more memory")
    p.add_argument("--no-reference", action="store_true", help="skip the NumPy reference")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch")
    p.add_argument("--no-ort", action="store_true", help="skip ONNX Runtime")
    p.add_argument("--no-jax", action="store_true", help="skip JAX")
    p.add_argument("--no-memory", action="store_true", help="skip the T=32768 memory run")
    p.add_argument("--memory-timeout", type=float, default=None,
                   help="seconds allowed per memory child (default 1800, --quick 120); "
                        "past it the peak so far is reported as a lower bound")
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                   help="print bench_backward.py's table for the float32 configurations "
                        "with T >= 1024 (default: on)")
    p.add_argument("--variants", action=argparse.BooleanOptionalAction, default=True,
                   help="print the table of today's models' variants (default: on)")
    p.add_argument("--variants-only", action="store_true",
                   help="print the machine and the variants' table only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cc", default=os.environ.get("CC", "cc"),
                   help="C compiler for peak.c (default $CC or cc)")
    p.add_argument("--scalar-peak", action="store_true",
                   help="measure the peak with peak.c's scalar fallback (to test it)")
    args = p.parse_args(argv)
    args.threads = THREADS
    if args.budget is None:
        args.budget = 0.2 if args.quick else 0.5
    if args.min_repeats is None:
        args.min_repeats = 3 if args.quick else 5
    if args.memory_timeout is None:
        args.memory_timeout = 120.0 if args.quick else 1800.0
    if args.configs is None:
        args.configs = [c for c in CONFIGS if not (args.quick and c == GPT3)]
    if torch is None:
        args.no_torch = True
    args.jax_threads = JAX_THREADS
    return args


def backward_tables(args) -> None:
    """bench_backward.py's table (forward + backward against torch autograd)
    for this run's float32 configurations with T >= 1024, one per causal
    flag; --min-repeats repeats."""
    configs = [c for c in args.configs if c[0] >= 1024]
    if "f32" not in args.dtypes or not configs:
        return
    for causal in CAUSALS[args.causal]:
        print(f"\nBackward, float32{', causal' if causal else ''} "
              "(benchmarks/bench_backward.py; B 1, times in ms):", flush=True)
        backward.report(configs, np.float32, args.min_repeats, causal,
                        None if args.no_torch else torch)


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    threads = set_threads(args.threads, torch)
    # Before the run, the load average is the others' (this process has only
    # been importing); during it, CpuMeter separates theirs from ours.
    load_start = os.getloadavg()
    meter = CpuMeter()
    info = report.print_machine(threads, args, torch, load_start)
    if args.variants_only:
        models.report(rng, args.min_repeats, args.budget, args.settle)
        return 0
    peak = start_peak(args.threads, args.scalar_peak, args.cc)
    report.print_method(args)
    ref_model = None
    if not args.no_reference:
        ref_model = calibrate_reference(rng)
        report.print_reference_model(args, ref_model)
    report.print_quick_note(args)
    sys.stdout.flush()

    def save(rows, notes):
        if args.json:
            report.write_json(args.json, info, peak, rows, [], notes, partial=True)
    ort, ort_notes = ([], []) if args.no_ort else peers_ort.ort_variants(args.threads)
    jax, jax_notes = ([], []) if args.no_jax else peers_jax.jax_variants()
    args.no_ort, args.no_jax = not ort, not jax
    variants = forward_variants(not args.no_reference, not args.no_torch, ort + jax)
    rows, notes = run_rows(args, variants, rng, ref_model, peak, save)
    notes[:0] = ort_notes + jax_notes
    if peak is not None:
        peak.measure()
        print("\nFMA peak measured again after the rows (best of both), GFLOP/s:")
        print_peak(peak)
    for r in rows:
        derive(r, peak)

    report.print_forward_tables(rows, [DTYPES[k] for k in args.dtypes], args, peak)
    if args.variants:
        models.report(rng, args.min_repeats, args.budget, args.settle)
    if args.backward:
        backward_tables(args)
    memory = []
    if not args.no_memory:
        memory = memory_section(args.threads, args.memory_timeout, not args.no_torch)
    report.print_targets(rows, memory)
    others = meter.others()
    report.print_notes(rows, notes, args, load_start, others)
    if args.json:
        report.write_json(args.json, info, peak, rows, memory, notes, others_cpus=others)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
