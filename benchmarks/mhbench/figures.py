"""Figures derived from a row's medians (GFLOP/s, % peak, ratios), and the
issue's targets with their PASS / MISS."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .configs import SHORT_T

MEMORY_GOAL_MIB = 512


def derive(row: Dict[str, Any], peak) -> None:
    """Adds gflops, pct_peak, vs_numpy, torch_best, vs_torch and targets to
    a measured row; peak is a peak.Peak, or None when it was not measured."""
    r = row["results"]
    ms = {k: v.get("ms") for k, v in r.items()}
    m = ms.get("mhattn")
    if m is None:
        return
    row["gflops"] = row["flops"] / (m * 1e-3) / 1e9
    total = peak.total(row["dtype"]) if peak else None
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


def memory_status(m: Dict[str, Any]) -> str:
    """The memory target's status for mhattn's memory result m (which has
    "mib"): a call stopped below the goal is n/a, not PASS (its peak so far
    is only a lower bound)."""
    t = Target("memory", m["mib"], MEMORY_GOAL_MIB, " MiB", less=True)
    timed_out = "timed_out_after_s" in m
    return "n/a" if timed_out and t.status == "PASS" else t.status


def target_json(t: Target) -> Dict[str, Any]:
    return dict(what=t.what, value=t.value, goal=t.goal, unit=t.unit.strip(), less=t.less,
                status=t.status)


def count_statuses(rows: List[Dict[str, Any]], memory: List[Dict[str, Any]]) -> Dict[str, int]:
    """How many targets PASS, MISS and are n/a, over the rows and the memory run."""
    all_t = [t.status for r in rows for t in r.get("targets") or []]
    all_t += [m["target"] for m in memory if "target" in m]
    return {s: all_t.count(s) for s in ("PASS", "MISS", "n/a")}
