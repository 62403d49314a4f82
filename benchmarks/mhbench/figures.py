"""Figures derived from a row's medians (GFLOP/s, % peak, ratios), and the
issue's targets with their PASS / MISS."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .configs import SHORT_T

MEMORY_GOAL_MIB = 512


def derive(row: Dict[str, Any], peak) -> None:
    """Adds gflops, pct_peak, vs_numpy, torch_best, vs_torch, the best peer's
    figures (see best_peer) and targets to a measured row; peak is a
    peak.Peak, or None when it was not measured.  pct_peak is mhattn's
    (unpacked) call; packed_pct_peak the packed one's, when timed."""
    r = row["results"]
    ms = {k: v.get("ms") for k, v in r.items()}
    m = ms.get("mhattn")
    if m is None:
        return
    row["gflops"] = row["flops"] / (m * 1e-3) / 1e9
    total = peak.total(row["dtype"]) if peak else None
    row["pct_peak"] = 100.0 * row["gflops"] / total if total else None
    if ms.get("mhattn_packed") and total:
        row["packed_pct_peak"] = 100.0 * row["flops"] / (ms["mhattn_packed"] * 1e-3) / 1e9 / total
    row["vs_numpy"] = ms["numpy"] / m if ms.get("numpy") else None
    torch_ms = {k: ms[k] for k in ("torch_mha", "torch_sdpa") if ms.get(k)}
    if torch_ms:
        best = min(torch_ms, key=torch_ms.get)
        row["torch_best"] = best
        row["vs_torch"] = torch_ms[best] / m
    best_peer(row, ms)
    row["targets"] = targets_for(row)


# The peers of "vs best peer" (the NumPy reference is not one): the table's
# name of each, and the result keys of its variants.
PEERS = {"torch": ("torch_mha", "torch_sdpa"),
         "ORT": ("ort_mha", "ort_attn", "ort_attn23"),
         "JAX": ("jax",)}
WEIGHTS_PER_CALL = ("torch", "JAX")


def best_peer(row: Dict[str, Any], ms: Dict[str, Optional[float]]) -> None:
    """Adds, for each peer with a time, "<peer>_ms" and "<peer>_variant"
    (its fastest variant's median and key); then "best_peer", "best_peer_ms",
    and "vs_best_peer" (best peer's time / mhattn's) and, when the packed
    call was timed, "packed_vs_best_peer"; > 1 means mhattn is faster."""
    best = None
    for name, keys in PEERS.items():
        timed = [(ms[k], k) for k in keys if ms.get(k)]
        if not timed:
            continue
        t, key = min(timed)
        row[f"{name}_ms"], row[f"{name}_variant"] = t, key
        if best is None or t < best[0]:
            best = (t, name)
    if best is None:
        return
    row["best_peer_ms"], row["best_peer"] = best
    row["vs_best_peer"] = best[0] / ms["mhattn"]
    if ms.get("mhattn_packed"):
        row["packed_vs_best_peer"] = best[0] / ms["mhattn_packed"]
        row["unpacked_over_packed"] = ms["mhattn"] / ms["mhattn_packed"]
    # The peers that, like the unpacked call, take the weights per call
    # (ORT's graphs hold theirs as initializers it may prepack).
    per_call = [(row[f"{n}_ms"], n) for n in WEIGHTS_PER_CALL if row.get(f"{n}_ms")]
    if per_call:
        t, name = min(per_call)
        row["weights_peer"], row["vs_weights_peer"] = name, t / ms["mhattn"]


@dataclass
class Target:
    what: str
    value: Optional[float]
    goal: float
    unit: str
    op: str = ">="                # how the value must compare with the goal: OPS's keys

    OPS = {">=": operator.ge, "<": operator.lt, "<=": operator.le}

    def __post_init__(self):
        if self.op not in self.OPS:
            raise ValueError(f"Target {self.what!r}: op must be one of {list(self.OPS)}, "
                             f"got {self.op!r}")

    @property
    def status(self) -> str:
        if self.value is None:
            return "n/a"
        return "PASS" if self.OPS[self.op](self.value, self.goal) else "MISS"

    def text(self) -> str:
        val = "n/a" if self.value is None else f"{self.value:.3g}{self.unit}"
        return f"{self.what} {val} (target {self.op} {self.goal:g}{self.unit}) {self.status}"


def targets_for(row: Dict[str, Any]) -> List[Target]:
    """Issue 41's targets that apply to this row (float32; set for a Zen 3's
    AVX2 on 2 threads, printed on every machine), and issue 2's small call.
    "Best peer" is the fastest of torch, ONNX Runtime and JAX; n/a where
    none of them ran, or where the build has no pack_weights.

    - Packed: >= 1.0x the best peer on every T = 128 row (B = 1 and 8,
      causal and not); >= 1.05x and >= 84 % of the FMA peak on non-causal
      rows at T >= 1024; >= 1.25x on causal rows at T >= 1024.
    - Unpacked: >= 1.0x the best of torch and JAX (the peers that take the
      weights per call) on every row; within 1.1x of the packed call's time
      at T >= 1024.
    - The (3, 4, 2) unbatched call: < 10 us (issue 2's; the "at most 5 tiny
      NumPy matmuls" is bench_small.py's to measure).
    """
    out: List[Target] = []
    T, f32 = row["T"], row["dtype"] == "float32"
    small, large = T == SHORT_T, T >= 1024
    packed = row.get("packed_vs_best_peer")
    if f32 and small:
        out.append(Target("packed vs best peer", packed, 1.0, "x"))
    if f32 and large and row["causal"]:
        out.append(Target("packed vs best peer", packed, 1.25, "x"))
    if f32 and large and not row["causal"]:
        out.append(Target("packed vs best peer", packed, 1.05, "x"))
        out.append(Target("packed % peak", row.get("packed_pct_peak"), 84, "%"))
    if f32 and (small or large):
        peer = row.get("weights_peer")
        out.append(Target("vs torch/JAX" + (f" ({peer})" if peer else ""),
                          row.get("vs_weights_peer"), 1.0, "x"))
    if f32 and large:
        out.append(Target("unpacked / packed", row.get("unpacked_over_packed"), 1.1, "x",
                          op="<="))
    if (row["T"], row["d_model"], row["h"], row["B"]) == (3, 4, 2, 1):
        us = row["results"]["mhattn"]["ms"] * 1e3
        out.append(Target("call", us, 10, " us", op="<"))
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
    t = Target("memory", m["mib"], MEMORY_GOAL_MIB, " MiB", op="<")
    timed_out = "timed_out_after_s" in m
    return "n/a" if timed_out and t.status == "PASS" else t.status


def target_json(t: Target) -> Dict[str, Any]:
    return dict(what=t.what, value=t.value, goal=t.goal, unit=t.unit.strip(), op=t.op,
                status=t.status)


def count_statuses(rows: List[Dict[str, Any]], memory: List[Dict[str, Any]]) -> Dict[str, int]:
    """How many targets PASS, MISS and are n/a, over the rows and the memory run."""
    all_t = [t.status for r in rows for t in r.get("targets") or []]
    all_t += [m["target"] for m in memory if "target" in m]
    return {s: all_t.count(s) for s in ("PASS", "MISS", "n/a")}
