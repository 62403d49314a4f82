"""A generic aligned text table, the forward table's columns, and the
one-line summary of a row on stderr."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from .figures import PEERS, target_cell


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


def _status(res: Optional[Dict[str, Any]]) -> str:
    """The cell of a result with no time: n/a (not run), skipped, error."""
    if res is None:
        return "n/a"
    return "skipped" if "skipped" in res else "error" if "error" in res else "n/a"


def result_ms(key: str) -> Callable[[Dict[str, Any]], str]:
    def cell(row):
        r = row["results"].get(key)
        if r is None or "ms" not in r:
            # A build without pack_weights: "-", as the table has it.
            return "-" if key == "mhattn_packed" and r is not None else _status(r)
        return fmt_ms(r["ms"])
    return cell


# How the table names a peer's fastest variant (figures.PEERS' keys).
VARIANT_SHORT = {"torch_mha": "MHA", "torch_sdpa": "SDPA", "ort_mha": "MHA",
                 "ort_attn": "Attn", "ort_attn23": "op23", "jax": ""}


def peer_ms(peer: str) -> Callable[[Dict[str, Any]], str]:
    """A peer's fastest variant's median and its short name ("2.54 MHA")."""
    def cell(row):
        t = row.get(f"{peer}_ms")
        if t is None:
            res = [row["results"].get(k) for k in PEERS[peer]]
            res = [r for r in res if r is not None]
            return _status(res[0]) if res else "n/a"
        return f"{fmt_ms(t)} {VARIANT_SHORT[row[peer + '_variant']]}".rstrip()
    return cell


def vs_best_cell(key: str) -> Callable[[Dict[str, Any]], str]:
    """mhattn's (or the packed call's) ratio to the best peer, which it names."""
    def cell(row):
        if row.get(key) is None:
            return "-" if key == "packed_vs_best_peer" and "best_peer" in row else "n/a"
        return f"{fmt_ratio(row[key])} {row['best_peer']}"
    return cell


def max_err_cell(row: Dict[str, Any]) -> str:
    return "%.0e" % max([v.get("max_rel_err", 0.0) for v in row["results"].values()] or [0.0])


def _pct(key: str) -> Callable[[Dict[str, Any]], str]:
    return lambda r: "n/a" if r.get(key) is None else f"{r[key]:.1f}"


def forward_columns(with_torch: bool, with_ref: bool, with_ort: bool = True,
                    with_jax: bool = True) -> List[Column]:
    """The forward table: mhattn and mhattn with pack_weights, each peer's
    fastest variant, NumPy, the ratios to the best peer (> 1: mhattn is
    faster), mhattn's GFLOP/s and % peak, the packed call's % peak."""
    cols = [Column("T", lambda r: str(r["T"])),
            Column("d_model", lambda r: str(r["d_model"])),
            Column("h", lambda r: str(r["h"])),
            Column("B", lambda r: str(r["B"])),
            Column("causal", lambda r: "yes" if r["causal"] else "no", "<"),
            Column("mhattn ms", result_ms("mhattn")),
            Column("packed ms", result_ms("mhattn_packed"))]
    for name, on in (("torch", with_torch), ("ORT", with_ort), ("JAX", with_jax)):
        if on:
            cols.append(Column(f"{name} ms", peer_ms(name)))
    if with_ref:
        cols.append(Column("numpy ms", result_ms("numpy")))
    cols += [Column("vs best peer", vs_best_cell("vs_best_peer"), "<"),
             Column("packed vs best", vs_best_cell("packed_vs_best_peer"), "<"),
             Column("GFLOP/s", lambda r: "n/a" if r.get("gflops") is None
                    else f"{r['gflops']:.1f}"),
             Column("% peak", _pct("pct_peak")),
             Column("packed % peak", _pct("packed_pct_peak")),
             Column("max err", max_err_cell),
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
