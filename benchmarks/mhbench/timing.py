"""Timing: medians of single calls, interleaved between the variants of a row.

``Timed`` and ``time_interleaved`` time bench.py's rows and the backward
table's; ``sample_times`` is the plain loop of the calibration.
"""
from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, List

# A call this long (seconds) needs no separate warm-up: its first run is
# its first sample (what a warm-up hides, lazy set-up, is lost in it).
LONG_CALL_S = 10.0


@dataclass
class Timed:
    """One variant's share of an interleaved timing (see time_interleaved)."""
    fn: Callable[[], Any]
    min_repeats: int
    warmup: bool = True       # False: the first call is a sample (as for calls > LONG_CALL_S)
    context: Callable[[], Any] = nullcontext       # entered around its calls
    repeats: int = 0                               # samples wanted, set by start()
    samples: List[float] = field(default_factory=list)
    cpu_samples: List[float] = field(default_factory=list)   # process CPU time, all threads
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
        clock, cpu, fn = time.perf_counter, time.process_time, self.fn
        samples, cpu_samples = self.samples, self.cpu_samples
        with self.context():
            for _ in range(calls):
                c0, t0 = cpu(), clock()
                fn()
                samples.append(clock() - t0)
                cpu_samples.append(cpu() - c0)
        self.spent_s += time.perf_counter() - t_start

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples)

    @property
    def median_cpu_s(self) -> float:
        """The median CPU time of the process over the calls run() timed."""
        return statistics.median(self.cpu_samples)


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


def sample_times(fn: Callable[[], Any], n: int) -> List[float]:
    """The times of n calls of fn, each timed alone, no warm-up."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out
