"""What the header and footer say about the machine: the CPU, the git
revision, and how busy other processes kept the CPUs."""
from __future__ import annotations

import os
import platform
import subprocess
import time
from typing import Optional

from . import REPO
from .threads import usable_cpus


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


BUSY = "  -- busy: figures are noisy, rerun on an idle machine before judging targets"


def busy_warning(others: float) -> Optional[str]:
    """Other work on the CPUs stalls multi-threaded calls (torch's tiny calls
    most of all: a thread that must wait for a descheduled partner loses a
    whole time slice) and flatters or spoils every ratio.  `others` is the
    number of CPUs other processes kept busy."""
    return BUSY if others > 0.25 * usable_cpus() else None


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
