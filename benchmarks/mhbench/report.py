"""What bench.py prints around its tables (the header, the forward tables,
the footer) and the JSON file with every figure."""
from __future__ import annotations

import json
import os
import platform
import sys
from typing import Any, Dict, List, Optional

import numpy as np

import mhattn

from .configs import GPT3, config_name
from . import peers_jax, peers_ort
from .figures import MEMORY_GOAL_MIB, count_statuses, target_json
from .machine import busy_warning, cpu_model, git_revision
from .memory import memory_text
from .tables import forward_columns, print_table
from .threads import usable_cpus


def print_machine(threads: Dict[str, Any], args, torch, load_start: tuple) -> Dict[str, Any]:
    """The header's lines on the command, CPU, ISA, threads, versions and
    load average; returns them for the JSON file."""
    print("mhattn forward benchmark:", " ".join(["python benchmarks/bench.py"] + sys.argv[1:]))
    cpu, git = cpu_model(), git_revision()
    print(f"  CPU       {cpu}; {os.cpu_count()} logical CPUs, {usable_cpus()} usable")
    get_isa = getattr(mhattn, "get_isa", None)
    print(f"  ISA       mhattn.get_isa(): "
          + (str(get_isa()) if get_isa else "n/a (not in this build)"))
    mh = threads["mhattn"]
    ort_version = None if args.no_ort else peers_ort.available()
    jax_version = None if args.no_jax else peers_jax.available()
    print(f"  threads   mhattn {mh if mh is not None else '?'}"
          + ("" if threads["mhattn_api"] else
             " (no set_num_threads in this build; % peak assumes "
             f"{args.threads} threads)")
          + (f", torch {threads['torch']}" if not args.no_torch else "")
          + (f", ORT intra_op {args.threads} (inter_op 1)" if ort_version else "")
          + (f", JAX {args.jax_threads}" if jax_version else "")
          + f", NumPy BLAS OPENBLAS_NUM_THREADS={threads['blas_env']['OPENBLAS_NUM_THREADS']}")
    torch_version = torch.__version__ if torch is not None else None
    print(f"  versions  python {platform.python_version()}, numpy {np.__version__}, "
          f"torch {torch_version or 'not installed'}, "
          f"onnxruntime {ort_version or ('off' if args.no_ort else 'not installed')}, "
          f"jax {jax_version or ('off' if args.no_jax else 'not installed')}, "
          f"mhattn {getattr(mhattn, '__version__', '?')} (git {git})")
    if torch is None:
        print("  note      PyTorch is not installed: its columns are skipped.")
    print(f"  load      {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} "
          "(1, 5, 15 min)" + (busy_warning(load_start[0]) or ""))
    return dict(argv=sys.argv, threads=threads, cpu=cpu,
                isa=str(get_isa()) if get_isa else None, load_start=load_start,
                versions=dict(python=platform.python_version(), numpy=np.__version__,
                              torch=torch_version, onnxruntime=ort_version, jax=jax_version,
                              mhattn=getattr(mhattn, "__version__", None), git=git))


def print_method(args) -> None:
    print(f"  timing    median; 1 warm-up call, then >= {args.min_repeats} repeats filling "
          f"~{args.budget:g} s per variant;\n"
          "            each call timed alone, variants interleaved in 5 rounds,\n"
          f"            {args.settle:g} s pause at each switch of variant (--settle)")
    print("  GFLOP/s   B * (8 T d^2 + 4 T^2 d), the 4 T^2 d term halved when causal")
    print("  peers     torch: the faster of nn.MultiheadAttention (fast path) and F.linear +\n"
          "            SDPA; ORT: the fastest of MatMul + com.microsoft.MultiHeadAttention,\n"
          "            com.microsoft.Attention and the opset-23 Attention (weights as\n"
          "            initializers, ORT_ENABLE_ALL, sequential); JAX: jit, weights as\n"
          "            arguments; packed: multi_head_attention(x, pack_weights(...)), packed\n"
          "            once outside the timing.  vs best peer = best peer's ms / mhattn's")


def print_reference_model(args, ref_model) -> None:
    print(f"  NumPy ref timed fewer times when slow; skipped where estimated "
          f"> {args.ref_max_seconds:g} s or > {args.ref_max_gib:g} GiB "
          f"(model: BLAS {ref_model.gemm_gflops['float32']:.0f}/"
          f"{ref_model.gemm_gflops['float64']:.0f} GFLOP/s f32/f64)")


def print_quick_note(args) -> None:
    if args.quick and GPT3 not in args.configs:
        print(f"  --quick   the GPT-3-width configuration {config_name(GPT3)} is skipped")


def print_forward_tables(rows: List[Dict[str, Any]], dtypes: List[str], args, peak) -> None:
    """One table per dtype, then the rows where the NumPy reference was skipped."""
    cols = forward_columns(not args.no_torch, not args.no_reference, not args.no_ort,
                           not args.no_jax)
    for dtype in dtypes:
        sel = [r for r in rows if r["dtype"] == dtype]
        if sel:
            peak_txt = (f", % of the {peak.total(dtype):.0f} GFLOP/s {dtype} FMA peak of "
                        f"{args.threads} threads" if peak else "")
            print_table(f"Forward, {dtype} (times are medians in ms; ratios are "
                        f"other / mhattn, > 1 means mhattn is faster{peak_txt})", cols, sel)

    skipped = [r for r in rows if "skipped" in r["results"].get("numpy", {})]
    if skipped:
        print("\nNumPy reference skipped (estimated cost of one call):")
        for r in skipped:
            print(f"  {r['T']}x{r['d_model']}x{r['h']} B={r['B']} {r['dtype']} "
                  f"causal={r['causal']}: {r['results']['numpy']['skipped']}")


def print_targets(rows: List[Dict[str, Any]], memory: List[Dict[str, Any]]) -> None:
    """Every target with its figure, and the count of each status."""
    print("\nTargets:")
    for r in rows:
        for t in r.get("targets") or []:
            print(f"  {t.status:<4}  {r['dtype']:<7} {r['T']}x{r['d_model']}x{r['h']} B={r['B']} "
                  f"{'causal' if r['causal'] else 'full':<6}  {t.text()}")
    for m in memory:
        if m.get("which") == "mhattn" and "target" in m:
            print(f"  {m['target']:<4}  float32 {m['T']}x{m['d_model']}x{m['h']} B=1 full    "
                  f"peak memory {memory_text(m)} (target < {MEMORY_GOAL_MIB} MiB)")
    n = count_statuses(rows, memory)
    print(f"  => {n['PASS']} PASS, {n['MISS']} MISS, {n['n/a']} n/a")


def print_notes(rows, notes: List[str], args, load_start: tuple,
                others: Optional[float]) -> None:
    """The footer after the targets: the fast-path check, the notes and how
    busy the machine was."""
    if not args.no_torch:
        fast = [r.get("mha_fast_path") for r in rows if "mha_fast_path" in r]
        print(f"  nn.MultiheadAttention fast path taken in {sum(map(bool, fast))} of "
              f"{len(fast)} rows (checked by spying on torch._native_multi_head_attention)")
    for n in notes:
        print(f"  note: {n}")
    if others is not None:
        print(f"  other processes kept {others:.2f} of {usable_cpus()} CPUs "
              "busy during the run, on average" + (busy_warning(others) or ""))
    if busy_warning(load_start[0]) or busy_warning(others or 0.0):
        print("  note: the machine was busy, so PASS/MISS above are indicative only.  The\n"
              "        smallest rows suffer most: a torch call of a few microseconds that waits\n"
              "        for a descheduled worker thread takes milliseconds instead.")


def write_json(path: str, info: Dict[str, Any], peak, rows, memory, notes, **extra) -> None:
    """Every figure, machine-readable; also written after each row, marked
    partial, so that an interrupted long run keeps what it measured."""
    payload = dict(info, **extra,
                   peak=None if peak is None else dict(isa=peak.isa, single=peak.single,
                                                       multi=peak.multi, threads=peak.threads),
                   rows=[{**r, "targets": [target_json(t) for t in r.get("targets") or []]}
                         for r in rows],
                   memory=memory, notes=notes)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)
