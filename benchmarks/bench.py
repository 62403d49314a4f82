#!/usr/bin/env python3
"""Forward benchmark of mhattn against the NumPy reference and PyTorch.

    python benchmarks/bench.py                  # every configuration (long)
    python benchmarks/bench.py --quick          # no GPT-3 width, fewer repeats
    python benchmarks/bench.py --configs 1024x512x8 3x4x2 --dtypes f32
    python benchmarks/bench.py --json out.json
    python benchmarks/bench.py --no-backward      # forward tables only

A script that prints figures, not a timed test.  In one run it measures, for
each configuration (T, d_model, h), batch size, dtype and causal flag:

- mhattn: ``mhattn.multi_head_attention`` with fused weights and num_heads;
- numpy: ``mhattn.reference.multi_head_attention`` (a Python loop per head
  and batch item: few repeats on big configurations, skipped where it would
  take too long or too much memory);
- torch MHA: ``nn.MultiheadAttention`` on its fast path (eval, batch_first,
  need_weights=False, no grad), loaded with the same weights;
- torch SDPA: ``F.linear`` projections around ``F.scaled_dot_product_attention``.

Every measured variant is checked once against mhattn's output (an
AssertionError stops the run: the figures must compare one computation).
Times are medians; ratios are taken between medians of the same run, because
the machine this runs on is shared and noisy.  The FMA peak that "% peak"
refers to is measured at start-up by benchmarks/peak.c, compiled with ``cc``.

Then, for the float32 configurations with T >= 1024, the backward table
of benchmarks/bench_backward.py (imported from there): mhattn's forward and
backward against PyTorch autograd's, on the same configurations
(--no-backward leaves it out).

The code is split so that a second table (forward + backward against torch
autograd) only needs new Variant functions and a column list: see
``Variant``, ``Timed``, ``measure_row`` and ``print_table``.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# (T, d_model, h).  B = 8 is added for the short ones (T <= SHORT_T).
CONFIGS = [(3, 4, 2), (128, 512, 8), (1024, 512, 8), (4096, 512, 8),
           (2048, 1024, 16), (2048, 12288, 96)]
GPT3 = (2048, 12288, 96)
SHORT_T = 128
SHORT_BATCH = 8
MEMORY_CONFIG = (32768, 512, 8)          # T, d_model, h; float32, no weights
DTYPES = {"f32": "float32", "f64": "float64"}
# A call this long (seconds) needs no separate warm-up: its first run is
# its first sample (what a warm-up hides, lazy set-up, is lost in it).
LONG_CALL_S = 10.0

# Output agreement, as max |a - b| / max |b|.  float32 sums of up to 12288
# products and softmax over up to 4096 keys stay well inside 2e-3; float64
# agrees to ~1e-12, so 1e-9 leaves room for a different summation order.
TOLERANCE = {"float32": 2e-3, "float64": 1e-9}


def _early_thread_count(argv: List[str]) -> int:
    """--threads, read before NumPy is imported: its BLAS sizes its pool once."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--threads", type=int, default=None)
    n = pre.parse_known_args(argv)[0].threads
    return n if n and n > 0 else len(os.sched_getaffinity(0))


THREADS = _early_thread_count(sys.argv[1:])
# The reference's speed is NumPy's BLAS; give it as many threads as the others.
# An explicit setting in the environment wins, and the header says which.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, str(THREADS))

import numpy as np  # noqa: E402  (after the thread variables, on purpose)

import mhattn  # noqa: E402
import mhattn.reference  # noqa: E402

try:
    import torch
    import torch.nn.functional as F
except ImportError:           # torch is optional: its columns say "n/a"
    torch = None
    F = None

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------

def parse_config(text: str):
    """'1024x512x8' -> (1024, 512, 8)."""
    try:
        T, d, h = (int(p) for p in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TxDxH such as 1024x512x8, got {text!r}")
    if min(T, d, h) < 1 or d % h:
        raise argparse.ArgumentTypeError(f"{text}: need T, d, h >= 1 and h dividing d")
    return (T, d, h)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="skip the GPT-3-width configuration (unless named in --configs), "
                        "time each variant for ~0.2 s with >= 3 repeats, shorter memory run")
    p.add_argument("--configs", nargs="+", type=parse_config, metavar="TxDxH",
                   help="configurations to run (default: all of "
                        + ", ".join("x".join(map(str, c)) for c in CONFIGS) + ")")
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
    p.add_argument("--no-memory", action="store_true", help="skip the T=32768 memory run")
    p.add_argument("--memory-timeout", type=float, default=None,
                   help="seconds allowed per memory child (default 1800, --quick 120); "
                        "past it the peak so far is reported as a lower bound")
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                   help="print bench_backward.py's table for the float32 configurations "
                        "with T >= 1024 (default: on)")
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
    return args


# --------------------------------------------------------------------------
# Machine: CPU, threads, versions, and the FMA peak from peak.c
# --------------------------------------------------------------------------

def cpu_model() -> str:
    name, family, model = platform.processor() or "unknown", None, None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "model name":
                    name = value
                elif key == "cpu family" and family is None:
                    family = value
                elif key == "model" and model is None:
                    model = value
                elif not key and name != "unknown":
                    break
    except OSError:
        pass
    return f"{name} (family {family}, model {model})" if family else name


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev + ("+dirty" if dirty else "")) if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def set_threads(n: int) -> Dict[str, Any]:
    """Give mhattn and torch n threads; report what each says it uses."""
    info: Dict[str, Any] = {"requested": n}
    setter = getattr(mhattn, "set_num_threads", None)
    getter = getattr(mhattn, "get_num_threads", None)
    if setter is not None:
        setter(n)
    info["mhattn"] = getter() if getter is not None else None
    info["mhattn_api"] = setter is not None
    if torch is not None:
        torch.set_num_threads(n)
        info["torch"] = torch.get_num_threads()
    info["blas_env"] = {v: os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    return info


@dataclass
class Peak:
    """The FMA peak of this machine, from benchmarks/peak.c."""
    threads: int
    force_scalar: bool = False
    isa: str = "unmeasured"
    single: Dict[str, float] = field(default_factory=dict)   # GFLOP/s, 1 thread
    multi: Dict[str, float] = field(default_factory=dict)    # GFLOP/s, n threads
    error: Optional[str] = None
    _fns: Dict[str, Any] = field(default_factory=dict, repr=False)

    def total(self, dtype: str) -> Optional[float]:
        """The peak that '% peak' is taken against: the larger of the measured
        n-thread figure and n times the 1-thread one.  They agree on an idle
        machine (one thread per core here); when they do not, the smaller one
        was slowed by a neighbour, and taking it would flatter '% peak'."""
        if dtype not in self.single:
            return None
        return max(self.multi.get(dtype, 0.0), self.single[dtype] * self.threads)

    def load(self, cc: str) -> bool:
        """Compile peak.c into a temporary directory and load it."""
        with tempfile.TemporaryDirectory(prefix="mhattn-peak-") as tmp:
            lib_path = os.path.join(tmp, "peak.so")
            cmd = [cc, "-O2", "-shared", "-fPIC", os.path.join(HERE, "peak.c"), "-o", lib_path]
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.SubprocessError) as exc:
                self.error = f"{' '.join(cmd)}: {exc}"
                return False
            if res.returncode != 0:
                self.error = f"{' '.join(cmd)} failed: {res.stderr.strip()[:300]}"
                return False
            lib = ctypes.CDLL(lib_path)     # mapped: the file may go
        lib.peak_isa.argtypes = [ctypes.c_int]
        lib.peak_isa.restype = ctypes.c_int
        lib.peak_flops_per_iter.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.peak_flops_per_iter.restype = ctypes.c_long
        fs = int(self.force_scalar)
        self.isa = {3: "avx512f, 12 zmm chains", 2: "avx2+fma, 12 ymm chains"}.get(
            lib.peak_isa(fs), "scalar fallback, 12 chains")
        for dtype, fn, nbytes in (("float32", lib.peak_fma_f32, 4),
                                  ("float64", lib.peak_fma_f64, 8)):
            fn.argtypes = [ctypes.c_long, ctypes.c_int]
            fn.restype = ctypes.c_double
            self._fns[dtype] = (fn, lib.peak_flops_per_iter(nbytes, fs))
        return True

    def measure(self, seconds: float = 0.03, rounds: int = 20) -> None:
        """Best of `rounds` short runs, on 1 thread and on n at once; keeps
        the best seen so far, so measuring again can only help.

        A peak is a maximum and noise only slows it down; many short runs
        (tens of ms, a few scheduler slices) have a better chance than a few
        long ones to find the CPUs free on a shared machine.  ctypes drops
        the GIL during the call, so Python threads run in parallel.
        """
        fs = int(self.force_scalar)
        for dtype, (fn, per_iter) in self._fns.items():
            iters = 1 << 12
            while True:                      # calibrate: about `seconds` per call
                t0 = time.perf_counter()
                fn(iters, fs)
                dt = time.perf_counter() - t0
                if dt > seconds / 4:
                    break
                iters *= 4
            iters = max(1, int(iters * seconds / dt))
            best = self.single.get(dtype, 0.0)
            for _ in range(rounds):
                t0 = time.perf_counter()
                fn(iters, fs)
                best = max(best, iters * per_iter / (time.perf_counter() - t0) / 1e9)
            self.single[dtype] = best
            if self.threads > 1:
                multi = _peak_threads(fn, fs, iters, per_iter, self.threads, rounds)
            else:
                multi = best
            self.multi[dtype] = max(self.multi.get(dtype, 0.0), multi)


def _peak_threads(fn, fs: int, iters: int, per_iter: int, threads: int, rounds: int) -> float:
    best = 0.0
    for _ in range(rounds):
        barrier = threading.Barrier(threads + 1)
        workers = [threading.Thread(target=lambda: (barrier.wait(), fn(iters, fs)))
                   for _ in range(threads)]
        for w in workers:
            w.start()
        barrier.wait()
        t0 = time.perf_counter()
        for w in workers:
            w.join()
        best = max(best, threads * iters * per_iter / (time.perf_counter() - t0) / 1e9)
    return best


# --------------------------------------------------------------------------
# Timing: one generic routine for every variant
# --------------------------------------------------------------------------

@dataclass
class Timed:
    """One variant's share of an interleaved timing (see time_interleaved)."""
    fn: Callable[[], Any]
    min_repeats: int
    warmup: bool = True       # False: the first call is a sample (as for calls > LONG_CALL_S)
    context: Callable[[], Any] = nullcontext       # entered around its calls
    repeats: int = 0                               # samples wanted, set by start()
    samples: List[float] = field(default_factory=list)
    spent_s: float = 0.0

    def start(self, budget: float, max_repeats: int = 100_000):
        """The warm-up call: returns its output (for checking) and sets how
        many calls fill about `budget` seconds, never fewer than min_repeats."""
        t_start = time.perf_counter()
        with self.context():
            t0 = time.perf_counter()
            out = self.fn()
            first = time.perf_counter() - t0
            per_call = first
            if not self.warmup or first > LONG_CALL_S:
                self.samples.append(first)
            elif first < 1e-3:
                # The first call is often cold: estimate the rate from a few more.
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < 0.02:
                    self.fn()
                    n += 1
                per_call = (time.perf_counter() - t0) / n
        self.repeats = min(max_repeats, max(self.min_repeats, round(budget / per_call)))
        self.spent_s += time.perf_counter() - t_start
        return out

    def run(self, calls: int) -> None:
        t_start = time.perf_counter()
        clock, fn, samples = time.perf_counter, self.fn, self.samples
        with self.context():
            for _ in range(calls):
                t0 = clock()
                fn()
                samples.append(clock() - t0)
        self.spent_s += time.perf_counter() - t_start

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples)


def time_interleaved(timed: List[Timed], rounds: int = 5, settle_s: float = 0.1) -> None:
    """Take every variant's samples in `rounds` interleaved slices.

    Each call is timed on its own, even a 5-microsecond one: on a shared
    machine the median of single calls ignores the calls a neighbour slowed
    down, where a mean over a group of calls would absorb them (perf_counter
    itself costs well under 0.1 us).  Interleaving spreads each variant's
    samples over the same stretch of time, so that a burst of load elsewhere
    hits all of them rather than whichever happened to be running, and the
    ratios of medians stay fair.

    Before each slice the benchmark sleeps `settle_s`: the thread pools of
    the variant before (OpenBLAS's, torch's OpenMP workers, mhattn's) keep
    spinning for a while after their last call, and on 2 cores a pool that
    spins takes a core from the next variant.  Measured here: an mhattn
    call at T = 1024 took 1.5-2.5x its time right after a torch or NumPy
    call, and its usual time 5 ms (torch) to 100 ms (OpenBLAS) later.
    """
    last = None
    for r in range(rounds):
        for t in timed:
            todo = -(-(t.repeats - len(t.samples)) // (rounds - r))   # ceil
            if todo > 0:
                if last is not None and last is not t and settle_s > 0:
                    time.sleep(settle_s)
                t.run(todo)
                last = t


# --------------------------------------------------------------------------
# Cases and their data
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    T: int
    d: int
    h: int
    B: int
    dtype: str      # "float32" | "float64"
    causal: bool

    @property
    def name(self) -> str:
        return f"{self.T}x{self.d}x{self.h}"

    def flops(self) -> float:
        """8 T d^2 (four projections) + 4 T^2 d (Q K^T and weights V) per
        sequence; causal attention does half of the second term."""
        attn = 4.0 * self.T * self.T * self.d * (0.5 if self.causal else 1.0)
        return self.B * (8.0 * self.T * self.d * self.d + attn)


@dataclass
class Data:
    """The inputs of one (configuration, B, dtype), shared by every variant."""
    x: np.ndarray            # (T, d) when B == 1 (the unbatched call), else (B, T, d)
    w_q: np.ndarray          # (d, d) fused: head i owns columns [i*dk, (i+1)*dk)
    w_k: np.ndarray
    w_v: np.ndarray
    w_o: np.ndarray          # (d, d)
    h: int
    torch: Any = None        # TorchData, when torch runs


@dataclass
class TorchData:
    x: Any                   # (B, T, d) tensor sharing memory with Data.x
    mha: Any                 # nn.MultiheadAttention, eval, fast-path ready
    causal_mask: Any         # (T, T) bool, True = blocked (nn.MultiheadAttention's convention)


def make_data(T: int, d: int, h: int, B: int, dtype: str, rng, with_torch: bool) -> Data:
    npdt = np.dtype(dtype)
    shape = (T, d) if B == 1 else (B, T, d)
    x = rng.standard_normal(shape, dtype=npdt)
    # Scaled so that scores and outputs stay O(1) whatever d is.
    ws = [rng.standard_normal((d, d), dtype=npdt) * npdt.type(1 / math.sqrt(d))
          for _ in range(4)]
    data = Data(x, *ws, h=h)
    if with_torch:
        data.torch = make_torch(data, T, d, h, B)
    return data


def make_torch(data: Data, T: int, d: int, h: int, B: int) -> TorchData:
    """nn.MultiheadAttention holding mhattn's weights.

    torch computes x W^T: in_proj_weight is concat(w_q, w_k, w_v, axis=1)^T
    and out_proj.weight is w_o^T.  Its fast path only runs with in-projection
    biases, so they are present and zero (an addition of zeros, nothing more).
    """
    tdt = torch.float32 if data.x.dtype == np.float32 else torch.float64
    mha = torch.nn.MultiheadAttention(d, h, bias=True, batch_first=True,
                                      device="cpu", dtype=tdt)
    mha.eval()
    with torch.no_grad():
        # Block by block, straight from the NumPy arrays: at GPT-3 width a
        # NumPy concatenation would hold two more copies of the weights.
        for i, w in enumerate((data.w_q, data.w_k, data.w_v)):
            mha.in_proj_weight[i * d:(i + 1) * d].copy_(torch.from_numpy(w).T)
        mha.out_proj.weight.copy_(torch.from_numpy(data.w_o).T)
        mha.in_proj_bias.zero_()
        mha.out_proj.bias.zero_()
    mha.requires_grad_(False)
    x = torch.from_numpy(data.x).reshape(B, T, d)
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    return TorchData(x, mha, mask)


# --------------------------------------------------------------------------
# Variants: one function each, returning a zero-argument callable
# --------------------------------------------------------------------------

@dataclass
class Variant:
    key: str                                       # column and JSON key
    label: str
    prepare: Callable[[Data, Case], Callable[[], Any]]
    context: Callable[[], Any] = nullcontext       # entered around all timed calls
    to_numpy: Callable[[Any], np.ndarray] = np.asarray


def mhattn_forward(data: Data, case: Case):
    x, wq, wk, wv, wo = data.x, data.w_q, data.w_k, data.w_v, data.w_o
    h, causal = data.h, case.causal
    return lambda: mhattn.multi_head_attention(x, wq, wk, wv, wo, num_heads=h, causal=causal)


def reference_forward(data: Data, case: Case):
    x, wq, wk, wv, wo = data.x, data.w_q, data.w_k, data.w_v, data.w_o
    h, causal = data.h, case.causal
    return lambda: mhattn.reference.multi_head_attention(x, wq, wk, wv, wo, num_heads=h,
                                                         causal=causal)


def torch_mha_forward(data: Data, case: Case):
    """nn.MultiheadAttention's fast path.  A causal call passes the boolean
    mask and is_causal=True (the mask is required; is_causal is a hint)."""
    t = data.torch
    mha, x = t.mha, t.x
    mask = t.causal_mask if case.causal else None
    causal = case.causal
    return lambda: mha(x, x, x, need_weights=False, attn_mask=mask, is_causal=causal)[0]


def torch_sdpa_forward(data: Data, case: Case):
    """One F.linear for Q, K and V together (torch's own in_proj layout), SDPA
    on (B, h, T, d_k), then F.linear for W^O: what a hand-written torch
    attention layer does.  Same weight tensors as the MHA variant."""
    t = data.torch
    x, h, causal = t.x, data.h, case.causal
    B, T, d = x.shape
    w_in, w_out = t.mha.in_proj_weight, t.mha.out_proj.weight

    def run():
        qkv = F.linear(x, w_in).view(B, T, 3, h, d // h).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=causal)
        return F.linear(o.transpose(1, 2).reshape(B, T, d), w_out)
    return run


def _torch_to_numpy(t) -> np.ndarray:
    return t.detach().numpy()


def _no_grad():
    return torch.no_grad()


MHATTN = Variant("mhattn", "mhattn", mhattn_forward)
REFERENCE = Variant("numpy", "NumPy reference", reference_forward)
TORCH_MHA = Variant("torch_mha", "torch nn.MultiheadAttention (fast path)", torch_mha_forward,
                    _no_grad, _torch_to_numpy)
TORCH_SDPA = Variant("torch_sdpa", "torch F.linear + F.scaled_dot_product_attention",
                     torch_sdpa_forward, _no_grad, _torch_to_numpy)
TORCH_VARIANTS = (TORCH_MHA, TORCH_SDPA)


def check_mha_fast_path(data: Data, case: Case) -> bool:
    """Whether nn.MultiheadAttention really took its fast path
    (torch._native_multi_head_attention) on this input."""
    real = torch._native_multi_head_attention
    calls = []

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)
    torch._native_multi_head_attention = spy
    try:
        with torch.no_grad():
            torch_mha_forward(data, case)()
    finally:
        torch._native_multi_head_attention = real
    return bool(calls)


# --------------------------------------------------------------------------
# The NumPy reference: skip it where it would take too long or too much memory
# --------------------------------------------------------------------------

@dataclass
class RefModel:
    """Rough cost model of mhattn.reference, calibrated on this machine:
    its matrix products run at NumPy's BLAS rate and every score element
    costs a fixed time in the softmax and masking steps."""
    gemm_gflops: Dict[str, float]
    elem_s: Dict[str, float]

    def seconds(self, c: Case) -> float:
        gemm = c.B * (8.0 * c.T * c.d * c.d + 4.0 * c.T * c.T * c.d)
        elementwise = c.B * c.h * c.T * c.T * self.elem_s[c.dtype]
        return gemm / (self.gemm_gflops[c.dtype] * 1e9) + elementwise

    @staticmethod
    def bytes(c: Case) -> float:
        item = np.dtype(c.dtype).itemsize
        # all_weights (B, h, T, T) is kept; one head's score-sized temporaries
        # (raw, scores, masked, exp, normalised, ...) live at once.
        return c.B * c.h * c.T * c.T * item + 8.0 * c.T * c.T * item + 6.0 * c.B * c.T * c.d * item


def calibrate_reference(rng) -> RefModel:
    gemm, elem = {}, {}
    for dtype in DTYPES.values():
        dt = np.dtype(dtype)
        a = rng.standard_normal((2048, 1024), dtype=dt)
        b = rng.standard_normal((1024, 128), dtype=dt)
        best = min(_times(lambda: a @ b, 5))
        gemm[dtype] = 2 * 2048 * 1024 * 128 / best / 1e9
        T = 512
        q = rng.standard_normal((T, 8), dtype=dt)
        allowed = np.tril(np.ones((T, T), dtype=bool))
        best = min(_times(lambda: mhattn.reference.attention(q, q, q, 0.3, allowed), 5))
        elem[dtype] = best / (T * T)
    return RefModel(gemm, elem)


def _times(fn, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# --------------------------------------------------------------------------
# One row: every variant on one case, checked against mhattn
# --------------------------------------------------------------------------

def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64).reshape(b.shape)
    b = np.asarray(b, dtype=np.float64)
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    return float(np.max(np.abs(a - b))) / scale if scale > 0 else float(np.max(np.abs(a - b)))


def measure_row(case: Case, data: Data, variants: List[Variant], args,
                ref_model: Optional[RefModel], notes: List[str]) -> Dict[str, Any]:
    """Time every variant on one case, interleaved; check each warm-up output
    against the first variant's (mhattn), and fail loudly when they disagree."""
    row: Dict[str, Any] = dict(T=case.T, d_model=case.d, h=case.h, B=case.B,
                               dtype=case.dtype, causal=case.causal, flops=case.flops(),
                               results={})
    baseline = None
    timed: Dict[str, Timed] = {}
    for v in variants:
        res: Dict[str, Any] = {}
        row["results"][v.key] = res
        min_reps, warmup = args.min_repeats, True
        if v is REFERENCE:
            est_s, est_b = ref_model.seconds(case), ref_model.bytes(case)
            res["estimate_s"], res["estimate_gib"] = est_s, est_b / 2**30
            if est_s > args.ref_max_seconds or est_b > args.ref_max_gib * 2**30:
                res["skipped"] = (f"estimated {est_s:.0f} s, {est_b / 2**30:.1f} GiB (limits "
                                  f"{args.ref_max_seconds:.0f} s, {args.ref_max_gib:g} GiB)")
                continue
            # A slow reference call is timed a few times, or once.
            if est_s > 2.0:
                min_reps, warmup = 1, False
            elif est_s > args.budget / args.min_repeats:
                min_reps = min(min_reps, 3)
        t = Timed(v.prepare(data, case), min_reps, warmup, v.context)
        try:
            out = v.to_numpy(t.start(args.budget))
        except (MemoryError, RuntimeError, ValueError, OSError) as exc:
            # One failing variant (out of memory at GPT-3 width, say) should
            # not cost the rest of a long run; the table says "error".
            res["error"] = f"{type(exc).__name__}: {exc}"
            notes.append(f"{case.name} B={case.B} {case.dtype} causal={case.causal}: "
                         f"{v.label} raised {res['error']}")
            continue
        timed[v.key] = t
        if t.spent_s > 1.0:     # a long row: say where the time goes
            todo = t.repeats - len(t.samples)
            print(f"      {v.key}: first call {t.spent_s:.1f} s, {todo} timed calls to go",
                  file=sys.stderr, flush=True)
        if baseline is None:
            baseline = out
        else:
            err = rel_err(out, baseline)
            res["max_rel_err"] = err
            tol = TOLERANCE[case.dtype]
            assert err <= tol, (
                f"{v.label} disagrees with mhattn on {case}: max|diff|/max|out| = "
                f"{err:.3g} > {tol:g}; the benchmark would compare different computations")
        del out
    del baseline
    time_interleaved(list(timed.values()), settle_s=args.settle)
    for key, t in timed.items():
        row["results"][key].update(ms=t.median_s * 1e3, repeats=len(t.samples),
                                   seconds_spent=t.spent_s)
    if TORCH_MHA in variants and "ms" in row["results"].get("torch_mha", {}):
        row["mha_fast_path"] = check_mha_fast_path(data, case)
        if not row["mha_fast_path"]:
            notes.append(f"{case.name} B={case.B} {case.dtype} causal={case.causal}: "
                         "nn.MultiheadAttention did NOT take its fast path")
    return row


# --------------------------------------------------------------------------
# Derived figures and targets
# --------------------------------------------------------------------------

PEAK: Optional[Peak] = None


def derive(row: Dict[str, Any]) -> None:
    r = row["results"]
    ms = {k: v.get("ms") for k, v in r.items()}
    m = ms.get("mhattn")
    if m is None:
        return
    row["gflops"] = row["flops"] / (m * 1e-3) / 1e9
    total = PEAK.total(row["dtype"]) if PEAK else None
    row["pct_peak"] = 100.0 * row["gflops"] / total if total else None
    row["vs_numpy"] = ms["numpy"] / m if ms.get("numpy") else None
    torch_ms = {k: ms[k] for k in ("torch_mha", "torch_sdpa") if ms.get(k)}
    if torch_ms:
        best = min(torch_ms, key=torch_ms.get)
        row["torch_best"] = best
        row["vs_torch"] = torch_ms[best] / m
    row["targets"] = targets_for(row)


@dataclass
class Target:
    what: str
    value: Optional[float]
    goal: float
    unit: str
    less: bool = False            # the value must stay below the goal

    @property
    def status(self) -> str:
        if self.value is None:
            return "n/a"
        ok = self.value < self.goal if self.less else self.value >= self.goal
        return "PASS" if ok else "MISS"

    def text(self) -> str:
        op = "<" if self.less else ">="
        val = "n/a" if self.value is None else f"{self.value:.3g}{self.unit}"
        return f"{self.what} {val} (target {op} {self.goal:g}{self.unit}) {self.status}"


def targets_for(row: Dict[str, Any]) -> List[Target]:
    """The issue's targets that apply to this row.

    float32, non-causal, T >= 1024: >= 65 % of the float32 FMA peak, >= 3x the
    NumPy reference, >= 1.5x the faster PyTorch variant.  float64 with the same
    shape condition: >= 55 % of the float64 peak.  T <= 128 (every dtype, mask
    and batch): >= 2x PyTorch.  The (3, 4, 2) unbatched call: < 10 us.
    """
    out: List[Target] = []
    big = row["T"] >= 1024 and not row["causal"]
    if big and row["dtype"] == "float32":
        out += [Target("% peak", row.get("pct_peak"), 65, "%"),
                Target("vs NumPy", row.get("vs_numpy"), 3, "x"),
                Target("vs torch", row.get("vs_torch"), 1.5, "x")]
    if big and row["dtype"] == "float64":
        out.append(Target("% peak", row.get("pct_peak"), 55, "%"))
    if row["T"] <= SHORT_T:
        out.append(Target("vs torch", row.get("vs_torch"), 2, "x"))
    if (row["T"], row["d_model"], row["h"], row["B"]) == (3, 4, 2, 1):
        us = row["results"]["mhattn"]["ms"] * 1e3
        out.append(Target("call", us, 10, " us", less=True))
    return out


def target_cell(row: Dict[str, Any]) -> str:
    ts = row.get("targets") or []
    if not ts:
        return ""
    missed = [t.what for t in ts if t.status == "MISS"]
    if missed:
        return "MISS " + ",".join(dict.fromkeys(missed))
    return "PASS" if all(t.status == "PASS" for t in ts) else "n/a"


# --------------------------------------------------------------------------
# A generic aligned table
# --------------------------------------------------------------------------

@dataclass
class Column:
    header: str
    cell: Callable[[Dict[str, Any]], str]
    align: str = ">"


def print_table(title: str, columns: List[Column], rows: List[Dict[str, Any]],
                file=sys.stdout) -> None:
    cells = [[c.cell(r) for c in columns] for r in rows]
    widths = [max([len(c.header)] + [len(row[i]) for row in cells])
              for i, c in enumerate(columns)]
    line = "  ".join(f"{c.header:{c.align}{w}}" for c, w in zip(columns, widths))
    print(f"\n{title}", file=file)
    print(line, file=file)
    print("-" * len(line), file=file)
    for row in cells:
        print("  ".join(f"{s:{c.align}{w}}" for s, c, w in zip(row, columns, widths)).rstrip(),
              file=file)


def fmt_ms(x: Optional[float]) -> str:
    if x is None:
        return "n/a"
    return f"{x:.3g}" if x < 1000 else f"{x:.0f}"


def fmt_ratio(x: Optional[float]) -> str:
    return "n/a" if x is None else (f"{x:.2f}x" if x < 10 else f"{x:.0f}x")


def result_ms(key: str) -> Callable[[Dict[str, Any]], str]:
    def cell(row):
        r = row["results"].get(key)
        if r is None:
            return "n/a"
        if "skipped" in r:
            return "skipped"
        if "error" in r:
            return "error"
        return fmt_ms(r.get("ms"))
    return cell


def vs_torch_cell(row: Dict[str, Any]) -> str:
    if row.get("vs_torch") is None:
        return "n/a"
    best = {"torch_mha": "MHA", "torch_sdpa": "SDPA"}[row["torch_best"]]
    return f"{fmt_ratio(row['vs_torch'])} {best}"


def forward_columns(with_torch: bool, with_ref: bool) -> List[Column]:
    cols = [Column("T", lambda r: str(r["T"])),
            Column("d_model", lambda r: str(r["d_model"])),
            Column("h", lambda r: str(r["h"])),
            Column("B", lambda r: str(r["B"])),
            Column("causal", lambda r: "yes" if r["causal"] else "no", "<"),
            Column("mhattn ms", result_ms("mhattn")),
            Column("GFLOP/s", lambda r: "n/a" if r.get("gflops") is None else f"{r['gflops']:.1f}"),
            Column("% peak", lambda r: "n/a" if r.get("pct_peak") is None
                   else f"{r['pct_peak']:.1f}")]
    if with_ref:
        cols += [Column("numpy ms", result_ms("numpy")),
                 Column("vs numpy", lambda r: fmt_ratio(r.get("vs_numpy")))]
    if with_torch:
        cols += [Column("MHA ms", result_ms("torch_mha")),
                 Column("SDPA ms", result_ms("torch_sdpa")),
                 Column("vs torch (best)", vs_torch_cell, "<")]
    cols += [Column("max err", lambda r: "%.0e" % max(
                 [v.get("max_rel_err", 0.0) for v in r["results"].values()] or [0.0])),
             Column("target", target_cell, "<")]
    return cols


# --------------------------------------------------------------------------
# Peak memory at T = 32768, in a child process
# --------------------------------------------------------------------------

MEMORY_CHILD = r"""
import os, sys, time
import numpy as np
which, T, d, h, threads = sys.argv[1], *map(int, sys.argv[2:6])

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None

rng = np.random.default_rng(0)
x = rng.standard_normal((T, d), dtype=np.float32)
ws = [rng.standard_normal((d, d), dtype=np.float32) * np.float32(d ** -0.5) for _ in range(4)]
if which == "mhattn":
    import mhattn
    if hasattr(mhattn, "set_num_threads"):
        mhattn.set_num_threads(threads)
    def run(x):
        return mhattn.multi_head_attention(x, *ws, num_heads=h, return_weights=False)
else:
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    w_in = torch.from_numpy(np.ascontiguousarray(np.concatenate(ws[:3], axis=1).T))
    w_out = torch.from_numpy(np.ascontiguousarray(ws[3].T))
    def run(x):
        t = torch.from_numpy(x)[None]
        B, L, _ = t.shape
        with torch.no_grad():
            qkv = F.linear(t, w_in).view(B, L, 3, h, d // h).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
            return F.linear(o.transpose(1, 2).reshape(B, L, d), w_out)
run(x[:64])                       # load code, start thread pools
reset = True
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")              # resets VmHWM to the current RSS
except OSError:
    reset = False
base = status("VmRSS")
print("start", base, int(reset), flush=True)
t0 = time.perf_counter()
out = run(x)
dt = time.perf_counter() - t0
print("done", status("VmHWM"), dt, flush=True)
"""


def _proc_status(pid: int, key: str) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def measure_memory(which: str, threads: int, timeout: float) -> Dict[str, Any]:
    """Peak RSS of one call, beyond the inputs, in a fresh child process.

    The child builds the inputs, makes a small warm-up call, resets its
    high-water mark (/proc/self/clear_refs) and reports its RSS, then makes
    the call.  While it runs this process samples the child's VmHWM (or, if
    the reset was refused, VmRSS), so a call past `timeout` still gives a
    lower bound.  The result includes the output array (T x d floats).
    """
    T, d, h = MEMORY_CONFIG
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.join(REPO, "python"),
                                                    env.get("PYTHONPATH")] if p)
    proc = subprocess.Popen([sys.executable, "-c", MEMORY_CHILD, which, str(T), str(d), str(h),
                             str(threads)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    res: Dict[str, Any] = {"which": which, "T": T, "d_model": d, "h": h, "dtype": "float32"}
    first = proc.stdout.readline().split()
    if not first or first[0] != "start":
        proc.wait()
        res["error"] = (proc.stderr.read().strip().splitlines() or ["child failed"])[-1]
        return res
    base, reset = int(first[1]), bool(int(first[2]))
    res["method"] = "VmHWM after clear_refs" if reset else "sampled VmRSS"
    high, t0 = base, time.perf_counter()
    while proc.poll() is None and time.perf_counter() - t0 < timeout:
        v = _proc_status(proc.pid, "VmHWM" if reset else "VmRSS")
        if v:
            high = max(high, v)
        time.sleep(0.02)
    if proc.poll() is None:
        v = _proc_status(proc.pid, "VmHWM" if reset else "VmRSS")
        high = max(high, v or 0)
        proc.kill()
        proc.wait()
        res["timed_out_after_s"] = timeout
    else:
        last = proc.stdout.readline().split()
        if last and last[0] == "done":
            if reset:
                high = max(high, int(last[1]))
            res["call_s"] = float(last[2])
        elif proc.returncode != 0:
            res["error"] = (proc.stderr.read().strip().splitlines() or ["child failed"])[-1]
    res["mib"] = (high - base) / 2**20
    return res


def memory_text(m: Dict[str, Any]) -> str:
    if "error" in m:
        return f"error: {m['error']}"
    bound = ">= " if "timed_out_after_s" in m else ""
    s = f"{bound}{m['mib']:.0f} MiB beyond the inputs"
    if "call_s" in m:
        s += f", call {m['call_s']:.1f} s"
    if "timed_out_after_s" in m:
        s += f" (stopped after {m['timed_out_after_s']:.0f} s: peak so far)"
    return s + f"  [{m['method']}]"


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------

def print_peak(peak: Peak) -> None:
    n = peak.threads
    for dt in DTYPES.values():
        print(f"            {dt}: 1 thread {peak.single[dt]:.1f}, {n} threads "
              f"{peak.multi[dt]:.1f} (x{peak.multi[dt] / peak.single[dt]:.2f})  -> % peak "
              f"uses {peak.total(dt):.1f} (larger of {n} threads, {n} x 1 thread)")


BUSY = "  -- busy: figures are noisy, rerun on an idle machine before judging targets"


def busy_warning(others: float) -> Optional[str]:
    """Other work on the CPUs stalls multi-threaded calls (torch's tiny calls
    most of all: a thread that must wait for a descheduled partner loses a
    whole time slice) and flatters or spoils every ratio.  `others` is the
    number of CPUs other processes kept busy."""
    return BUSY if others > 0.25 * len(os.sched_getaffinity(0)) else None


class CpuMeter:
    """CPU time that other processes used while this one ran, in CPUs:
    the machine's busy time (/proc/stat) minus this process's and its
    children's (os.times), over the wall time.  Unlike the load average it
    does not count this benchmark's own threads."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        user, nice, system, idle, iowait, irq, softirq, steal = fields
        busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system
        return busy, own, time.perf_counter()

    def others(self) -> Optional[float]:
        end = self._sample()
        if self.start is None or end is None or end[2] - self.start[2] <= 0:
            return None
        busy, own, wall = (e - s for e, s in zip(end, self.start))
        return max(0.0, (busy - own) / wall)


def write_json(path: str, info: Dict[str, Any], rows, memory, notes, **extra) -> None:
    """Every figure, machine-readable; also written after each row, marked
    partial, so that an interrupted long run keeps what it measured."""
    payload = dict(info, **extra,
                   peak=None if PEAK is None else dict(isa=PEAK.isa, single=PEAK.single,
                                                       multi=PEAK.multi, threads=PEAK.threads),
                   rows=[{**r, "targets": [dict(what=t.what, value=t.value, goal=t.goal,
                                                unit=t.unit.strip(), less=t.less,
                                                status=t.status)
                                           for t in r.get("targets") or []]}
                         for r in rows],
                   memory=memory, notes=notes)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)


def row_summary(row: Dict[str, Any]) -> str:
    """One line per finished row, on stderr, for following a long run."""
    parts = []
    for key, res in row["results"].items():
        if "ms" in res:
            parts.append(f"{key} {fmt_ms(res['ms'])} ms")
        else:
            parts.append(f"{key} {'skipped' if 'skipped' in res else 'error'}")
    if row.get("gflops") is not None:
        parts.append(f"{row['gflops']:.1f} GFLOP/s")
    return "      -> " + ", ".join(parts)


def build_cases(args) -> List[tuple]:
    """(T, d, h, B) in run order: B = 1 for all, B = 8 too for the short ones."""
    out = []
    for T, d, h in args.configs:
        out.append((T, d, h, 1))
        if T <= SHORT_T:
            out.append((T, d, h, SHORT_BATCH))
    return out


def backward_tables(args) -> None:
    """bench_backward.py's table (forward + backward against torch autograd)
    for this run's float32 configurations with T >= 1024, one per causal
    flag; --min-repeats repeats."""
    configs = [c for c in args.configs if c[0] >= 1024]
    if "f32" not in args.dtypes or not configs:
        return
    import bench_backward   # next to this file
    for causal in {"both": [False, True], "no": [False], "yes": [True]}[args.causal]:
        print(f"\nBackward, float32{', causal' if causal else ''} "
              "(benchmarks/bench_backward.py; B 1, times in ms):", flush=True)
        bench_backward.report(configs, np.float32, args.min_repeats, causal,
                              None if args.no_torch else torch)


def main(argv=None) -> int:
    global PEAK
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    threads = set_threads(args.threads)

    print("mhattn forward benchmark:", " ".join(["python benchmarks/bench.py"] + sys.argv[1:]))
    print(f"  CPU       {cpu_model()}; {os.cpu_count()} logical CPUs, "
          f"{len(os.sched_getaffinity(0))} usable")
    get_isa = getattr(mhattn, "get_isa", None)
    print(f"  ISA       mhattn.get_isa(): "
          + (str(get_isa()) if get_isa else "n/a (not in this build)"))
    mh = threads["mhattn"]
    print(f"  threads   mhattn {mh if mh is not None else '?'}"
          + ("" if threads["mhattn_api"] else
             " (no set_num_threads in this build; % peak assumes "
             f"{args.threads} threads)")
          + (f", torch {threads['torch']}" if not args.no_torch else "")
          + f", NumPy BLAS OPENBLAS_NUM_THREADS={threads['blas_env']['OPENBLAS_NUM_THREADS']}")
    print(f"  versions  python {platform.python_version()}, numpy {np.__version__}, "
          f"torch {torch.__version__ if torch is not None else 'not installed'}, "
          f"mhattn {getattr(mhattn, '__version__', '?')} (git {git_revision()})")
    if torch is None:
        print("  note      PyTorch is not installed: its columns are skipped.")
    # Before the run, the load average is the others' (this process has only
    # been importing); during it, CpuMeter separates theirs from ours.
    load_start = os.getloadavg()
    meter = CpuMeter()
    print(f"  load      {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} "
          "(1, 5, 15 min)" + (busy_warning(load_start[0]) or ""))

    PEAK = Peak(args.threads, force_scalar=args.scalar_peak)
    if not PEAK.load(args.cc):
        print(f"  FMA peak  not measured ({PEAK.error}); % peak is n/a")
        PEAK = None
    else:
        PEAK.measure()
        print(f"  FMA peak  benchmarks/peak.c ({PEAK.isa}), best of 20 x 30 ms "
              "(measured again after the rows; the best is kept), GFLOP/s:")
        print_peak(PEAK)
    print(f"  timing    median; 1 warm-up call, then >= {args.min_repeats} repeats filling "
          f"~{args.budget:g} s per variant;\n"
          "            each call timed alone, variants interleaved in 5 rounds,\n"
          f"            {args.settle:g} s pause at each switch of variant (--settle)")
    print("  GFLOP/s   B * (8 T d^2 + 4 T^2 d), the 4 T^2 d term halved when causal")

    info = dict(argv=sys.argv, threads=threads, cpu=cpu_model(),
                isa=str(get_isa()) if get_isa else None, load_start=load_start,
                versions=dict(python=platform.python_version(), numpy=np.__version__,
                              torch=torch.__version__ if torch is not None else None,
                              mhattn=getattr(mhattn, "__version__", None), git=git_revision()))
    ref_model = None
    if not args.no_reference:
        ref_model = calibrate_reference(rng)
        print(f"  NumPy ref timed fewer times when slow; skipped where estimated "
              f"> {args.ref_max_seconds:g} s or > {args.ref_max_gib:g} GiB "
              f"(model: BLAS {ref_model.gemm_gflops['float32']:.0f}/"
              f"{ref_model.gemm_gflops['float64']:.0f} GFLOP/s f32/f64)")
    if args.quick and GPT3 not in args.configs:
        print("  --quick   the GPT-3-width configuration 2048x12288x96 is skipped")
    sys.stdout.flush()

    variants = [MHATTN]
    if not args.no_reference:
        variants.append(REFERENCE)
    if not args.no_torch:
        variants += list(TORCH_VARIANTS)

    cases = build_cases(args)
    causals = {"both": [False, True], "no": [False], "yes": [True]}[args.causal]
    dtypes = [DTYPES[k] for k in args.dtypes]
    jobs = [(c, dt) for c in cases for dt in dtypes]
    rows: List[Dict[str, Any]] = []
    notes: List[str] = []
    progress = tqdm(total=len(jobs) * len(causals), file=sys.stderr, leave=False) if tqdm else None
    done = 0
    for (T, d, h, B), dtype in jobs:
        data = make_data(T, d, h, B, dtype, rng, with_torch=not args.no_torch)
        for causal in causals:
            case = Case(T, d, h, B, dtype, causal)
            done += 1
            if progress:
                progress.set_description(f"{case.name} B={B} {dtype} causal={causal}")
            else:
                print(f"[{done}/{len(jobs) * len(causals)}] {case.name} B={B} {dtype} "
                      f"causal={causal}", file=sys.stderr, flush=True)
            rows.append(measure_row(case, data, variants, args, ref_model, notes))
            derive(rows[-1])
            print(row_summary(rows[-1]), file=sys.stderr, flush=True)
            if args.json:
                write_json(args.json, info, rows, [], notes, partial=True)
            if progress:
                progress.update()
        del data
        gc.collect()
    if progress:
        progress.close()
    if PEAK is not None:
        PEAK.measure()
        print("\nFMA peak measured again after the rows (best of both), GFLOP/s:")
        print_peak(PEAK)
    for r in rows:
        derive(r)

    cols = forward_columns(not args.no_torch, not args.no_reference)
    for dtype in dtypes:
        sel = [r for r in rows if r["dtype"] == dtype]
        if sel:
            peak_txt = (f", % of the {PEAK.total(dtype):.0f} GFLOP/s {dtype} FMA peak of "
                        f"{args.threads} threads" if PEAK else "")
            print_table(f"Forward, {dtype} (times are medians in ms; ratios are "
                        f"other / mhattn, > 1 means mhattn is faster{peak_txt})", cols, sel)

    skipped = [r for r in rows if "skipped" in r["results"].get("numpy", {})]
    if skipped:
        print("\nNumPy reference skipped (estimated cost of one call):")
        for r in skipped:
            print(f"  {r['T']}x{r['d_model']}x{r['h']} B={r['B']} {r['dtype']} "
                  f"causal={r['causal']}: {r['results']['numpy']['skipped']}")

    if args.backward:
        backward_tables(args)

    memory = []
    if not args.no_memory:
        print(f"\nPeak memory, T={MEMORY_CONFIG[0]}, d_model={MEMORY_CONFIG[1]}, "
              f"h={MEMORY_CONFIG[2]}, float32, return_weights=False (child process; "
              "the increase includes the output array):", flush=True)
        whichs = ["mhattn"] + ([] if args.no_torch else ["torch_sdpa"])
        for which in whichs:
            m = measure_memory(which, args.threads, args.memory_timeout)
            memory.append(m)
            label = {"mhattn": "mhattn", "torch_sdpa": "torch SDPA"}[which]
            line = f"  {label:<11} {memory_text(m)}"
            if which == "mhattn" and "mib" in m:
                t = Target("memory", m["mib"], 512, " MiB", less=True)
                if "timed_out_after_s" in m and t.status == "PASS":
                    line += "   target < 512 MiB: n/a (timed out below it)"
                else:
                    line += f"   target < 512 MiB: {t.status}"
                timed_out = "timed_out_after_s" in m
                m["target"] = "n/a" if timed_out and t.status == "PASS" else t.status
            print(line, flush=True)

    print("\nTargets:")
    for r in rows:
        for t in r.get("targets") or []:
            print(f"  {t.status:<4}  {r['dtype']:<7} {r['T']}x{r['d_model']}x{r['h']} B={r['B']} "
                  f"{'causal' if r['causal'] else 'full':<6}  {t.text()}")
    for m in memory:
        if m.get("which") == "mhattn" and "target" in m:
            print(f"  {m['target']:<4}  float32 {m['T']}x{m['d_model']}x{m['h']} B=1 full    "
                  f"peak memory {memory_text(m)} (target < 512 MiB)")
    all_t = [t.status for r in rows for t in r.get("targets") or []]
    all_t += [m["target"] for m in memory if "target" in m]
    print(f"  => {all_t.count('PASS')} PASS, {all_t.count('MISS')} MISS, "
          f"{all_t.count('n/a')} n/a")
    if not args.no_torch:
        fast = [r.get("mha_fast_path") for r in rows if "mha_fast_path" in r]
        print(f"  nn.MultiheadAttention fast path taken in {sum(map(bool, fast))} of "
              f"{len(fast)} rows (checked by spying on torch._native_multi_head_attention)")
    for n in notes:
        print(f"  note: {n}")
    others = meter.others()
    if others is not None:
        print(f"  other processes kept {others:.2f} of {len(os.sched_getaffinity(0))} CPUs "
              "busy during the run, on average" + (busy_warning(others) or ""))
    if busy_warning(load_start[0]) or busy_warning(others or 0.0):
        print("  note: the machine was busy, so PASS/MISS above are indicative only.  The\n"
              "        smallest rows suffer most: a torch call of a few microseconds that waits\n"
              "        for a descheduled worker thread takes milliseconds instead.")

    if args.json:
        write_json(args.json, info, rows, memory, notes, others_cpus=others)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
