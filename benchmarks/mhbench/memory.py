"""Peak memory of one float32 call at T = 32768, in a fresh child process.

The child builds its inputs, warms up on 64 rows, resets its high-water
mark (``echo 5 > /proc/self/clear_refs``) and makes the call; the figure is
VmHWM minus the RSS before the call, so it includes the output.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

from . import REPO
from .figures import MEMORY_GOAL_MIB, memory_status

MEMORY_CONFIG = (32768, 512, 8)          # T, d_model, h; float32, no weights
LABELS = {"mhattn": "mhattn", "torch_sdpa": "torch SDPA"}

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


def _child_error(proc) -> str:
    return (proc.stderr.read().strip().splitlines() or ["child failed"])[-1]


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
        res["error"] = _child_error(proc)
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
            res["error"] = _child_error(proc)
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


def memory_section(threads: int, timeout: float, with_torch: bool) -> List[Dict[str, Any]]:
    """Measures and prints the peak memory of mhattn (and torch SDPA);
    mhattn's result gets its target's status under "target"."""
    T, d, h = MEMORY_CONFIG
    print(f"\nPeak memory, T={T}, d_model={d}, h={h}, float32, return_weights=False "
          "(child process; the increase includes the output array):", flush=True)
    memory = []
    for which in ["mhattn"] + (["torch_sdpa"] if with_torch else []):
        m = measure_memory(which, threads, timeout)
        memory.append(m)
        line = f"  {LABELS[which]:<11} {memory_text(m)}"
        if which == "mhattn" and "mib" in m:
            m["target"] = memory_status(m)
            line += f"   target < {MEMORY_GOAL_MIB} MiB: " + (
                "n/a (timed out below it)" if m["target"] == "n/a" else m["target"])
        print(line, flush=True)
    return memory
