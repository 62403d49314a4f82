"""The variants of today's models (issue 13): each against its baseline,
timed interleaved in one run, with the issue's targets.

    causal + window=(255, 0), T=4096      <= 0.5x  causal alone
    softcap / ALiBi / sinks / RoPE / q/k norm, T=1024   <= 1.25x  the plain call
    8 packed sequences of 512              <= 1.2x  a padded B=8, T=512 batch

float32, d_model 512, 8 heads, B 1 unless said.  Every variant is checked
against its NumPy reference once before it is timed (the packed batch
against the padded one: the same eight sequences).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import numpy as np

import mhattn

from .tables import Column, fmt_ms, fmt_ratio, print_table
from .timing import Timed, time_interleaved

D_MODEL, HEADS = 512, 8


@dataclass
class Pair:
    """A variant and its baseline: the ratio of their medians is the figure."""
    name: str
    fn: Callable[[], Any]
    base_name: str
    base: Callable[[], Any]
    target: float            # the ratio must be at most this
    check: Optional[Callable[[], None]] = None


def _weights(rng, dtype):
    w = [rng.standard_normal((D_MODEL, D_MODEL)).astype(dtype) / np.sqrt(D_MODEL)
         for _ in range(4)]
    return dict(w_q=w[0], w_k=w[1], w_v=w[2], w_o=w[3], num_heads=HEADS)


def _close(a, b, what):
    if not np.allclose(a, b, rtol=2e-3, atol=2e-3):
        raise AssertionError(f"{what}: max error {np.abs(a - b).max():.3g}")


def pairs(rng, dtype=np.float32, T_long=4096, T=1024, packs=8, T_pack=512) -> List[Pair]:
    """The issue's rows, as (variant, baseline) pairs."""
    w = _weights(rng, dtype)
    mha = mhattn.multi_head_attention
    x_long = rng.standard_normal((T_long, D_MODEL)).astype(dtype)
    x = rng.standard_normal((T, D_MODEL)).astype(dtype)
    dk = D_MODEL // HEADS
    out = [Pair("causal + window=(255, 0)", lambda: mha(x_long, **w, causal=True,
                                                      window=(255, 0)),
                "causal", lambda: mha(x_long, **w, causal=True), 0.5)]
    extras = {
        "softcap=30": dict(softcap=30.0),
        "ALiBi (h,)": dict(alibi_slopes=2.0 ** -np.arange(1, HEADS + 1)),
        "sinks (h,)": dict(sinks=rng.standard_normal(HEADS).astype(dtype)),
        "RoPE": dict(rope=mhattn.RoPE()),
        "q/k norm": dict(q_norm=np.ones(dk, dtype), k_norm=np.ones(dk, dtype)),
    }
    for name, kw in extras.items():
        def check(kw=kw, name=name):
            xs = x[:96]
            _close(mha(xs, **w, causal=True, **kw),
                   mhattn.reference.multi_head_attention(xs, **w, causal=True, **kw), name)
        out.append(Pair(name, lambda kw=kw: mha(x, **w, causal=True, **kw),
                        "plain", lambda: mha(x, **w, causal=True), 1.25, check))
    xb = rng.standard_normal((packs, T_pack, D_MODEL)).astype(dtype)
    xp = xb.reshape(packs * T_pack, D_MODEL)
    cu = np.arange(packs + 1) * T_pack

    def check_packed():
        _close(mha(xp, **w, causal=True, cu_seqlens=cu).reshape(xb.shape),
               mha(xb, **w, causal=True), "packed")
    out.append(Pair(f"{packs} packed x {T_pack}", lambda: mha(xp, **w, causal=True,
                                                               cu_seqlens=cu),
                    f"padded B={packs}", lambda: mha(xb, **w, causal=True), 1.2,
                    check_packed))
    return out


def measure(pair_list: List[Pair], min_repeats: int, budget: float,
            settle: float) -> List[Dict[str, Any]]:
    """Medians of each pair, timed interleaved (the two of a pair in the
    same slices), and their ratio."""
    rows = []
    for p in pair_list:
        if p.check is not None:
            p.check()
        a, b = Timed(p.fn, min_repeats), Timed(p.base, min_repeats)
        a.start(budget)
        b.start(budget)
        time_interleaved([a, b], settle_s=settle)
        ratio = a.median_s / b.median_s
        rows.append(dict(name=p.name, base=p.base_name, ms=a.median_s * 1e3,
                         base_ms=b.median_s * 1e3, ratio=ratio, target=p.target,
                         ok=ratio <= p.target, repeats=(len(a.samples), len(b.samples))))
    return rows


COLUMNS = [Column("variant", lambda r: r["name"], "<"),
           Column("ms", lambda r: fmt_ms(r["ms"])),
           Column("baseline", lambda r: r["base"], "<"),
           Column("ms", lambda r: fmt_ms(r["base_ms"])),
           Column("ratio", lambda r: fmt_ratio(r["ratio"])),
           Column("target", lambda r: f"<= {r['target']:g}"),
           Column("", lambda r: "ok" if r["ok"] else "MISSED", "<"),
           Column("n", lambda r: "%d/%d" % r["repeats"])]


def report(rng, min_repeats: int = 5, budget: float = 0.5, settle: float = 0.1,
           **sizes) -> List[Dict[str, Any]]:
    """Measure and print the table; returns its rows."""
    rows = measure(pairs(rng, **sizes), min_repeats, budget, settle)
    print_table(f"Variants of today's models (issue 13), float32, d_model {D_MODEL}, "
                f"{HEADS} heads, causal, B 1 unless said; medians of single calls, "
                "each pair interleaved:", COLUMNS, rows)
    return rows
