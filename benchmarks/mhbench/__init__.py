"""The pieces of benchmarks/bench.py, one concern each.

Imported as a sibling package by the scripts in benchmarks/ (their
directory is on sys.path when run as ``python benchmarks/bench.py``).
This file and ``threads`` import no NumPy, so that bench.py can set the
BLAS thread count before NumPy loads:

- threads:  the thread count, for mhattn, torch and NumPy's BLAS; JAX's environment
- optional: torch, when installed
- machine:  CPU model, git revision, and how busy the other processes are
- peak:     the FMA peak, measured by benchmarks/peak.c
- timing:   medians of single calls, interleaved between variants
- configs:  the configurations, their parsing, cases and FLOP counts
- variants: the measured calls (mhattn, NumPy reference, torch) and their inputs
- peers_ort: ONNX Runtime's three graphs (weights as initializers), when installed
- peers_jax: JAX's jitted layer, when installed
- refmodel: when the NumPy reference is too slow or too big to run
- rows:     one row: every variant timed on one case, checked against mhattn
- figures:  figures derived from a row's medians, and the issue's targets
- tables:   an aligned text table and the forward table's columns
- memory:   peak memory of one long call, in a child process
- report:   the header, the footer and the JSON file
- backward: the forward + backward table against torch autograd
"""
import os

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(BENCH_DIR)
