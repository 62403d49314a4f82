"""A generic aligned text table, the forward table's columns, and the
one-line summary of a row on stderr."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from .figures import target_cell


@dataclass
class Column:
    header: str
    cell: Callable[[Dict[str, Any]], str]
    align: str = ">"


def print_table(title: str, columns: List[Column], rows: List[Dict[str, Any]],
                file=None) -> None:
    file = sys.stdout if file is None else file
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


def max_err_cell(row: Dict[str, Any]) -> str:
    return "%.0e" % max([v.get("max_rel_err", 0.0) for v in row["results"].values()] or [0.0])


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
    cols += [Column("max err", max_err_cell),
             Column("target", target_cell, "<")]
    return cols


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
