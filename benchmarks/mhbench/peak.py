"""The FMA peak that '% peak' refers to, measured by benchmarks/peak.c.

peak.c is compiled with ``cc -O2 -shared -fPIC`` into a temporary
directory, loaded with ctypes and timed on 1 thread and on n Python
threads at once (ctypes releases the GIL).
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from . import BENCH_DIR
from .configs import DTYPES


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
    _lib: Any = field(default=None, repr=False)

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
            cmd = [cc, "-O2", "-shared", "-fPIC", os.path.join(BENCH_DIR, "peak.c"), "-o", lib_path]
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.SubprocessError) as exc:
                self.error = f"{' '.join(cmd)}: {exc}"
                return False
            if res.returncode != 0:
                self.error = f"{' '.join(cmd)} failed: {res.stderr.strip()[:300]}"
                return False
            lib = ctypes.CDLL(lib_path)     # mapped: the file may go
        self._lib = lib
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
            best, iters = _peak_one(fn, fs, per_iter, seconds, rounds)
            best = max(best, self.single.get(dtype, 0.0))
            self.single[dtype] = best
            if self.threads > 1:
                multi = _peak_threads(fn, fs, iters, per_iter, self.threads, rounds)
            else:
                multi = best
            self.multi[dtype] = max(self.multi.get(dtype, 0.0), multi)


def _peak_one(fn, fs: int, per_iter: int, seconds: float, rounds: int):
    """(best GFLOP/s of `rounds` calls of about `seconds` on this thread, the
    iterations per call)."""
    iters = 1 << 12
    while True:                      # calibrate: about `seconds` per call
        t0 = time.perf_counter()
        fn(iters, fs)
        dt = time.perf_counter() - t0
        if dt > seconds / 4:
            break
        iters *= 4
    iters = max(1, int(iters * seconds / dt))
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(iters, fs)
        best = max(best, iters * per_iter / (time.perf_counter() - t0) / 1e9)
    return best, iters


def dot_rates(cc: str, seconds: float = 0.03, rounds: int = 20) -> Dict[str, Any]:
    """One thread's multiply-add rates (GMAC/s, best of `rounds`) from peak.c:
    'fma' for float32 FMA chains on the widest ISA, and 'vdpbf16ps' for
    AVX512-BF16's bfloat16 pair products where the CPU has it (else None);
    'error' when peak.c does not build.  The ratio says whether a bfloat16
    kernel built on vdpbf16ps would do more multiply-adds per second than
    one that widens bfloat16 and uses FMAs."""
    peak = Peak(1)
    if not peak.load(cc):
        return {"fma": None, "vdpbf16ps": None, "isa": None, "error": peak.error}
    fn, per_iter = peak._fns["float32"]
    out = {"fma": _peak_one(fn, 0, per_iter, seconds, rounds)[0] / 2, "vdpbf16ps": None,
           "isa": peak.isa, "error": None}
    lib = peak._lib
    lib.peak_dpbf16_ok.restype = ctypes.c_int
    if lib.peak_dpbf16_ok():
        dp = lib.peak_dpbf16
        dp.argtypes = [ctypes.c_long, ctypes.c_int]
        dp.restype = ctypes.c_double
        lib.peak_dpbf16_flops_per_iter.restype = ctypes.c_long
        out["vdpbf16ps"] = _peak_one(dp, 0, lib.peak_dpbf16_flops_per_iter(), seconds,
                                     rounds)[0] / 2
    return out


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


def print_peak(peak: Peak) -> None:
    n = peak.threads
    for dt in DTYPES.values():
        print(f"            {dt}: 1 thread {peak.single[dt]:.1f}, {n} threads "
              f"{peak.multi[dt]:.1f} (x{peak.multi[dt] / peak.single[dt]:.2f})  -> % peak "
              f"uses {peak.total(dt):.1f} (larger of {n} threads, {n} x 1 thread)")


def start_peak(threads: int, force_scalar: bool, cc: str) -> Optional[Peak]:
    """Compile, load and measure the peak, and print the header's lines;
    None (% peak is n/a) when peak.c does not build."""
    peak = Peak(threads, force_scalar=force_scalar)
    if not peak.load(cc):
        print(f"  FMA peak  not measured ({peak.error}); % peak is n/a")
        return None
    peak.measure()
    print(f"  FMA peak  benchmarks/peak.c ({peak.isa}), best of 20 x 30 ms "
          "(measured again after the rows; the best is kept), GFLOP/s:")
    print_peak(peak)
    return peak
