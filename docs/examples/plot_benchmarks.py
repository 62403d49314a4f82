"""
Benchmark results, drawn
========================

``benchmarks/bench.py`` times mhattn's forward call against PyTorch (the
faster of ``nn.MultiheadAttention`` and ``F.linear`` + SDPA), ONNX Runtime
and JAX on the same inputs, and prints a table; the recorded runs are kept
in ``benchmarks/results/``, one text file per run. This example reads the
float32 forward tables of two of them, straight from those files (nothing
is timed while the site builds), and draws them:

- ``2026-12-02b-zen4-avx512.txt``: run on 2 December 2026 (the date in
  the file's name) at commit 3036569, on a 2-core AMD EPYC Zen 4
  (AVX-512);
- ``2026-12-03-zen3-avx2.txt``: run on 3 December 2026 at commit 83a22de,
  on a 2-core AMD EPYC Zen 3 (AVX2, no AVX-512).

Both runs used 2 threads for every library and both machines were shared
(the script flags them as busy), so the figures are indicative: compare
the libraries within one run, not across runs. ``benchmarks/README.md``
describes the method and each recorded run.
"""
import os
import re

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

# sphinx-gallery runs an example from its own directory, docs/examples; run
# this script from there too (python plot_benchmarks.py in a checkout).
RESULTS = os.path.join("..", "..", "benchmarks", "results")
RUNS = ["2026-12-02b-zen4-avx512.txt", "2026-12-03-zen3-avx2.txt"]


def read_run(path, dtype="float32"):
    """The run's header lines and the rows of its forward table for ``dtype``.

    Each row is a dict from the column's heading to its value: a float for
    the ``ms`` columns (NaN where the peer was skipped), else the text.
    A peer's time is followed by the variant that won ("2.37 SDPA"); that
    word is kept under the heading + " variant".
    """
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    info = {}
    for line in lines[:12]:
        name, _, value = line.strip().partition(" ")
        if name in ("CPU", "ISA", "versions", "load"):
            info[name] = value.strip()
    top = next(i for i, line in enumerate(lines) if line.startswith(f"Forward, {dtype} "))
    info["peak"] = float(re.search(r"of the ([\d.]+) GFLOP/s", lines[top]).group(1))
    headings = re.split(r"\s{2,}", lines[top + 1].strip())
    rows = []
    for line in lines[top + 3:]:
        if not line.strip():
            break
        words, k, row = line.split(), 0, {}
        for heading in headings:
            if heading == "target":            # free text to the end of the line
                break
            value, k = words[k], k + 1
            if k < len(words) and not words[k][0].isdigit() and words[k] not in (
                    "yes", "no", "skipped"):
                row[heading + " variant"], k = words[k], k + 1
            if heading.endswith(" ms"):
                value = np.nan if value == "skipped" else float(value)
            row[heading] = value
        rows.append(row)
    return info, rows


def row_name(r, sep=" "):
    """'T=128 B=1 full' or 'T=128 B=1 causal'."""
    return sep.join([f"T={r['T']}", f"B={r['B']}",
                     "causal" if r["causal"] == "yes" else "full"])


runs = {}
for name in RUNS:
    info, rows = read_run(os.path.join(RESULTS, name))
    # the configurations both runs measured: d_model 512, 8 heads
    rows = [r for r in rows if r["T"] in ("128", "1024", "4096") and r["d_model"] == "512"]
    kind, isa = name[:-4].split("-")[-2:]                   # from the file's name
    label = f"{name[:10]}, {kind.capitalize()}, {isa.upper()}"
    runs[label] = (info, rows)
    print(f"{name}: {info['CPU']}")
    print(f"  {info['ISA']};  {info['versions'].split(', ')[-1]}")
    print(f"  float32 FMA peak of 2 threads: {info['peak']:g} GFLOP/s")

# %%
# The rows read
# -------------
# Times are medians in milliseconds, as the files give them.
for label, (info, rows) in runs.items():
    print(label)
    print("      T  B  causal   mhattn   packed    torch      ORT      JAX")
    for r in rows:
        print(f"  {r['T']:>5} {r['B']:>2}  {r['causal']:>6}"
              + "".join(f" {r[c]:8.4g}" for c in
                        ("mhattn ms", "packed ms", "torch ms", "ORT ms", "JAX ms")))

# %%
# mhattn against each peer
# ------------------------
# Each point is a peer's time divided by mhattn's on the same row: above 1,
# mhattn is faster; below 1, the peer is. The axis is logarithmic, so 2x
# faster and 2x slower sit at the same distance from the line. In both runs
# ONNX Runtime is the closest peer: it is ahead of mhattn on most rows at
# T = 128, and mhattn is ahead of every peer on the causal rows from
# T = 1024 and on both T = 4096 rows.
peers = [("torch ms", "torch", "o"), ("ORT ms", "ONNX Runtime", "s"),
         ("JAX ms", "JAX", "^")]
fig = Figure(figsize=(10, 4.2), layout="constrained")
axes = fig.subplots(1, 2, sharey=True)
for ax, (label, (info, rows)) in zip(axes, runs.items()):
    pos = np.arange(len(rows))
    mhattn_ms = np.array([r["mhattn ms"] for r in rows])
    for column, peer, marker in peers:
        ratio = np.array([r[column] for r in rows]) / mhattn_ms
        ax.plot(pos, ratio, marker=marker, linestyle="none", markersize=7, label=peer)
    ax.axhline(1, color="grey", linewidth=1)
    ax.set_yscale("log")
    ax.set_ylim(0.5, 10)
    ax.set_yticks([0.5, 1, 2, 4, 8], ["0.5", "1", "2", "4", "8"])
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(pos, [row_name(r, "\n") for r in rows], fontsize="small")
    ax.set_title(label, fontsize="medium")
    ax.grid(axis="y", alpha=0.3)
axes[0].set_ylabel("peer's time / mhattn's time")
axes[1].legend(loc="upper left", fontsize="small")
fig.suptitle("float32 forward, d_model 512, 8 heads: above 1, mhattn is faster")

for label, (info, rows) in runs.items():
    best = [np.nanmin([r["torch ms"], r["ORT ms"], r["JAX ms"]]) / r["mhattn ms"]
            for r in rows]
    print(f"{label}: best peer / mhattn from {min(best):.2f} to {max(best):.2f}")

# %%
# How close to the machine's peak
# -------------------------------
# ``GFLOP/s`` counts ``B (8 T d^2 + 4 T^2 d)`` floating-point operations per
# call (half the score work when causal) and ``% peak`` divides it by the
# float32 FMA peak that ``benchmarks/peak.c`` measured on the same machine
# in the same run, which puts the two machines on one scale (within the
# noise of two busy machines).
fig_peak = Figure(figsize=(10, 3.8), layout="constrained")
ax = fig_peak.subplots()
width = 0.38
for n, (label, (info, rows)) in enumerate(runs.items()):
    pos = np.arange(len(rows))
    share = [float(r["% peak"]) for r in rows]
    bars = ax.bar(pos + (n - 0.5) * width, share, width,
                  label=f"{label} (peak {info['peak']:g} GFLOP/s)")
    ax.bar_label(bars, fmt="%.0f", fontsize="x-small")
ax.set_xticks(pos, [row_name(r) for r in rows], fontsize="small", rotation=20, ha="right")
ax.set_ylim(0, 100)
ax.set_ylabel("% of the float32 FMA peak")
ax.legend(loc="upper center", ncol=2, fontsize="small")
ax.set_title("mhattn's float32 forward, share of the FMA peak (2 threads)")

for label, (info, rows) in runs.items():
    share = [float(r["% peak"]) for r in rows]
    print(f"{label}: {min(share):.1f} to {max(share):.1f} % of the FMA peak")
