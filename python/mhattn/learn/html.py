"""HTML for notebooks: :class:`mhattn.Trace` and :class:`mhattn.checker.PrototypeReport`.

Every style is written inline, so that the pages look the same in JupyterLab,
classic Notebook, VS Code and a plain browser: no notebook CSS class is relied
on (JupyterLab right-aligns table cells and gives ``<pre>`` no background;
classic Notebook does the opposite).
"""
from __future__ import annotations

import html
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["trace_html", "compare_html", "report_html"]

esc = html.escape

GREEN, RED, AMBER = "#1a7f37", "#b42318", "#9a6700"
_ROW_BAD, _ROW_ROUNDING = "#fdecea", "#fff8c5"

PRE = ("background:#f6f8fa;color:#1f2328;border:1px solid #d0d7de;border-radius:4px;"
       "padding:6px 10px;margin:4px 0 8px 0;font-family:ui-monospace,SFMono-Regular,"
       "Menlo,Consolas,monospace;font-size:90%;line-height:1.35;white-space:pre;"
       "overflow-x:auto;text-align:left")
CODE = ("background:#f6f8fa;color:#1f2328;border-radius:3px;padding:0 3px;"
        "font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:90%")
TABLE = "border-collapse:collapse;margin:4px 0 8px 0;text-align:left"
TH = "text-align:left;padding:2px 8px;border-bottom:1px solid #999;font-weight:bold"
TD = "text-align:left;padding:2px 8px;border-bottom:1px solid #e5e5e5;vertical-align:top"


def _code(text: str) -> str:
    return f'<code style="{CODE}">{esc(text)}</code>'


def _pre(text: str) -> str:
    return f'<pre style="{PRE}">{esc(text)}</pre>'


# ------------------------------------------------------------------ Trace

# What each step is, in the document's notation.
FORMULA = {
    "q": "Q<sub>i</sub> = X W<sub>i</sub><sup>Q</sup>",
    "k": "K<sub>i</sub> = X W<sub>i</sub><sup>K</sup>",
    "v": "V<sub>i</sub> = X W<sub>i</sub><sup>V</sup>",
    "raw_scores": "Q<sub>i</sub> K<sub>i</sub><sup>T</sup>",
    "scores": "Q<sub>i</sub> K<sub>i</sub><sup>T</sup> &middot; scale",
    "row_max": "max<sub>j</sub> scores<sub>ij</sub>",
    "lse": "log &sum;<sub>j</sub> exp(scores<sub>ij</sub>)",
    "weights": "softmax(scores) over the keys",
    "heads": "head<sub>i</sub> = weights<sub>i</sub> V<sub>i</sub>",
    "concat": "Concat(head<sub>1</sub>, &hellip;, head<sub>h</sub>)",
    "output": "Concat(&hellip;) W<sup>O</sup>",
    "q_proj": "X W<sub>i</sub><sup>Q</sup> (+ b), before the norm and RoPE",
    "k_proj": "X W<sub>i</sub><sup>K</sup> (+ b), before the norm and RoPE",
    "q_normed": "RMSNorm(q_proj) &middot; q_norm",
    "k_normed": "RMSNorm(k_proj) &middot; k_norm",
    "capped": "c &middot; tanh(raw_scores &middot; scale / c)",
    "bias": "ALiBi: &minus;slope &middot; |p<sub>i</sub> &minus; j|",
    "gate": "&sigma;(X W<sub>gate</sub> + b<sub>gate</sub>), the output gate",
    "gated": "gate &middot; Concat(&hellip;), what W<sup>O</sup> reads",
}
MASKED = ", masked (&minus;&infin;)"

# The axes of each stage, without the batch axis.
AXES = {
    "q": ("h", "T_q", "d_k"), "k": ("h", "T_k", "d_k"), "v": ("h", "T_k", "d_v"),
    "q_proj": ("h", "T_q", "d_k"), "k_proj": ("h", "T_k", "d_k"),
    "q_normed": ("h", "T_q", "d_k"), "k_normed": ("h", "T_k", "d_k"),
    "raw_scores": ("h", "T_q", "T_k"), "scores": ("h", "T_q", "T_k"),
    "capped": ("h", "T_q", "T_k"), "bias": ("h", "T_q", "T_k"),
    "weights": ("h", "T_q", "T_k"), "row_max": ("h", "T_q"), "lse": ("h", "T_q"),
    "heads": ("h", "T_q", "d_v"), "concat": ("T_q", "h\u00b7d_v"),
    "gate": ("T_q", "h\u00b7d_v"), "gated": ("T_q", "h\u00b7d_v"),
    "output": ("T_q", "d_out"),
}


def named_shape(shape: Sequence[int], axes: Sequence[str]) -> str:
    """(2, 3, 4) with ("h", "T_q", "d_k") -> '(h=2, T_q=3, d_k=4)'; the plain
    shape when the names do not fit."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(axes):
        return str(shape)
    return "(" + ", ".join(f"{a}={s}" for a, s in zip(axes, shape)) + ")"


def stage_shape(trace: Any, name: str) -> str:
    """A stage's shape with its axis names; a ragged stage lists its heads."""
    a = getattr(trace, name)
    axes = AXES.get(name, ())
    lead = ("B",) if trace.batched else ()
    if isinstance(a, list):
        # one array per head: (T, d_i), or (B, T, d_i)
        return "[" + ", ".join(named_shape(p.shape, lead + tuple(axes[1:])) for p in a) + "]"
    return named_shape(np.shape(a), lead + tuple(axes))


def _scales_text(scales: Sequence[float], dk: Sequence[int]) -> str:
    if all(abs(s - 1 / np.sqrt(d)) <= 1e-12 * abs(s) for s, d in zip(scales, dk)):
        return "1/&radic;d<sub>k</sub>" + (
            f" = {scales[0]:.4f}" if len(set(scales)) == 1 else "")
    return ", ".join(f"{s:.4g}" for s in sorted(set(scales)))


def _fmt(x: float) -> str:
    if np.isneginf(x):
        return "&minus;&infin;"
    if np.isposinf(x):
        return "&infin;"
    if np.isnan(x):
        return "nan"
    return f"{x:.4f}"


def matrix_html(title: str, a: np.ndarray, rows: Sequence[str],
                cols: Optional[Sequence[str]] = None,
                axes: Sequence[str] = ()) -> str:
    """One small matrix as a table, titled with its axis-named shape."""
    a = np.atleast_2d(np.asarray(a, dtype=np.float64))
    cell = "padding:1px 6px;"
    head = ""
    if cols is not None:
        head = ("<tr><th></th>" + "".join(
            f'<th style="{cell}text-align:right">{esc(c)}</th>' for c in cols) + "</tr>")
    body = "".join(
        f'<tr><th style="{cell}text-align:right">{esc(rows[i])}</th>'
        + "".join(f'<td style="{cell}text-align:right">{_fmt(x)}</td>' for x in row)
        + "</tr>"
        for i, row in enumerate(a))
    return (f'<div style="max-width:100%;overflow-x:auto">'
            f'<div style="font-weight:bold;text-align:center">{esc(title)} '
            f'<span style="font-weight:normal">{esc(named_shape(a.shape, axes))}</span>'
            f'</div><table style="font-family:monospace;border-collapse:collapse">'
            f"{head}{body}</table></div>")


def trace_html(trace: Any) -> str:
    """The HTML display of a :class:`mhattn.Trace`: every step with its
    equation and axis-named shape, then (small traces) each head's values in
    a collapsible ``<details>``."""
    masked = bool(np.isneginf(np.asarray(trace.scores)).any())
    out = ['<div class="mhattn-trace" style="text-align:left">',
           f"<p><b>mhattn.Trace</b> &mdash; {esc(trace._config_text())}; "
           f"scale {_scales_text(trace.scales, trace.d_k)}</p>",
           f'<table style="{TABLE}"><thead><tr><th style="{TH}">step</th>'
           f'<th style="{TH}">equation</th><th style="{TH}">shape</th></tr></thead><tbody>']
    for k in trace.keys():
        formula = FORMULA[k] + (MASKED if k == "scores" and masked else "")
        if k in ("q_normed", "k_normed") and getattr(trace, "norm_type", "rms") == "layer":
            formula = formula.replace("RMSNorm", "LayerNorm")
        out.append(f'<tr><td style="{TD}"><code>{k}</code></td>'
                   f'<td style="{TD}">{formula}</td>'
                   f'<td style="{TD}"><code>{esc(stage_shape(trace, k))}</code></td></tr>')
    out.append("</tbody></table>")
    if not trace._small():
        out.append("<p>(Matrices too large to show: read them from the trace's "
                   "attributes or <code>to_dict()</code>.)</p></div>")
        return "\n".join(out)
    b = 0 if trace.batched else None
    if trace.batched:
        out.append(f"<p>Values of batch item 0 (of {trace.weights.shape[0]}):</p>")
    qlab = trace.tokens or [str(i) for i in range(trace.weights.shape[-2])]
    klab = trace.key_tokens or [str(j) for j in range(trace.weights.shape[-1])]
    flex = '<div style="display:flex;flex-wrap:wrap;gap:1.2em;align-items:flex-start">'
    H = trace.num_heads
    for i in range(H):
        st = trace.head(i, b)
        opened = " open" if H <= 2 or i == 0 else ""
        out.append(f'<details{opened} style="margin:4px 0"><summary style="cursor:pointer">'
                   f"<b>Head {i + 1}</b> (d_k = {trace.d_k[i]}, d_v = {trace.d_v[i]}, "
                   f"scale {trace.scales[i]:.4g})</summary>")
        out.append(flex)
        out.append(matrix_html("q", st["q"], qlab, axes=("T_q", "d_k")))
        out.append(matrix_html("k", st["k"], klab, axes=("T_k", "d_k")))
        out.append(matrix_html("v", st["v"], klab, axes=("T_k", "d_v")))
        out.append(matrix_html("raw_scores = q k\u1d40", st["raw_scores"], qlab, klab,
                               axes=("T_q", "T_k")))
        out.append(matrix_html("scores", st["scores"], qlab, klab, axes=("T_q", "T_k")))
        out.append(matrix_html("weights", st["weights"], qlab, klab, axes=("T_q", "T_k")))
        out.append(matrix_html("head", st["head"], qlab, axes=("T_q", "d_v")))
        out.append("</div></details>")
    concat = trace.concat[b] if trace.batched else trace.concat
    output = trace.output[b] if trace.batched else trace.output
    out.append(flex.replace('style="', 'style="margin-top:6px;'))
    out.append(matrix_html("concat", concat, qlab, axes=AXES["concat"]))
    out.append(matrix_html("output", output, qlab, axes=AXES["output"]))
    out.append("</div></div>")
    return "\n".join(out)


def compare_html(report: Any) -> str:
    """The HTML display of a :class:`mhattn.learn.trace.CompareReport`: its summary,
    then a left-aligned table of the stages, the first divergence in red."""
    rows = []
    for st in report.stages:
        first = st.stage == report.first_divergence
        style = f"background:{_ROW_BAD};font-weight:bold;" if first else ""
        if st.ok is None:
            status, a, r = "not given", "", ""
        else:
            status = "ok" if st.ok else esc(st.note or "differs")
            a, r = _num(st.max_abs), _num(st.max_rel)
        rows.append(f'<tr style="{style}"><td style="{TD}"><code>{esc(st.stage)}</code></td>'
                    f'<td style="{TD}"><code>{esc(st.shape)}</code></td>'
                    f'<td style="{TD}">{a}</td><td style="{TD}">{r}</td>'
                    f'<td style="{TD}">{status}</td></tr>')
    head = "".join(f'<th style="{TH}">{h}</th>' for h in
                   ("stage", "shape", "max abs err", "max rel err", "status"))
    return ('<div class="mhattn-compare" style="text-align:left"><p>'
            + esc(report.summary()) + "</p>"
            f'<table style="{TABLE}"><thead><tr>{head}</tr></thead><tbody>'
            + "".join(rows) + "</tbody></table></div>")


def _num(x: Optional[float]) -> str:
    if x is None:
        return ""
    if np.isinf(x):
        return "inf"
    return f"{x:.3g}"


# ----------------------------------------------------------------- report

def split_paragraphs(text: str) -> List[Tuple[str, str]]:
    """Plain text -> [(kind, text)] in the order written: blank lines end a
    paragraph; within one, each run of lines indented by 4 spaces is a
    "code" block and each run of other lines a "prose" paragraph."""
    out: List[Tuple[str, str]] = []
    for para in text.split("\n\n"):
        kind: Optional[str] = None
        run: List[str] = []
        for line in para.split("\n"):
            k = "code" if line.startswith("    ") else "prose"
            if k != kind and run:
                out.append(_run(kind, run))
                run = []
            kind = k
            run.append(line[4:] if k == "code" else line)
        if run and any(r.strip() for r in run):
            out.append(_run(kind, run))
    return out


def _run(kind: Optional[str], lines: List[str]) -> Tuple[str, str]:
    if kind == "code":
        return "code", "\n".join(lines)
    return "prose", " ".join(x.strip() for x in lines if x.strip())


def _prose(text: str) -> str:
    return "<p>" + esc(text) + "</p>"


def report_html(report: Any) -> str:
    """The HTML display of a :class:`mhattn.checker.PrototypeReport`.

    Reads ``paragraphs`` ([(kind, text)], kind "prose" or "code", in the
    order written), ``hints``, ``float32_rounding`` and each trial's
    ``matching`` when the report has them, else falls back to
    ``explanation`` and ``matches``."""
    ok = bool(report.ok)
    rounding = bool(getattr(report, "float32_rounding", False))
    # every mistake named (a pair: both), else the one of an older report
    mistake = " + ".join(getattr(report, "mistakes", None) or ()) or getattr(
        report, "mistake", None)
    hints = [str(h) for h in (getattr(report, "hints", None) or [])]
    if ok:
        colour, verdict = GREEN, "OK"
    elif rounding:
        colour, verdict = AMBER, "float32 rounding only"
    else:
        colour, verdict = RED, "Mistake found" if mistake else "Differs"
    parts = ['<div class="mhattn-check" style="text-align:left">',
             f'<p style="font-weight:bold;color:{colour}">check_prototype: '
             f"{verdict} &mdash; {esc(str(report.title))}"
             + (" " + _code(str(mistake)) if mistake else "") + "</p>"]

    paragraphs = getattr(report, "paragraphs", None)
    if paragraphs is None:
        paragraphs = split_paragraphs(str(getattr(report, "explanation", "")))
    hint_lines = {"Hint: " + h for h in hints}
    for kind, text in paragraphs:
        if kind == "code":
            parts.append(_pre(text))
            continue
        # Today's explanation repeats the hints as "Hint: ..." lines: they are
        # shown once, as the list below.
        if hints and text.startswith("Hint: ") and all(
                ("Hint: " + s).strip() in hint_lines for s in text.split("Hint: ")[1:]
                if s.strip()):
            continue
        parts.append(_prose(text))
    if hints:
        parts.append('<p style="margin-bottom:2px"><b>Hints</b></p><ul style="margin-top:0">'
                     + "".join(f"<li>{esc(h)}</li>" for h in hints) + "</ul>")

    trials = list(getattr(report, "trials", []) or [])
    matching = [_matching(t) for t in trials]
    show_matching = any(m for t, m in zip(trials, matching) if not t.ok)
    head = ["trial", "shapes", "result"] + (["matching mistakes"] if show_matching else [])
    parts.append(f'<table style="{TABLE}"><thead><tr>'
                 + "".join(f'<th style="{TH}">{h}</th>' for h in head)
                 + "</tr></thead><tbody>")
    for t, m in zip(trials, matching):
        if t.ok:
            bg = ""
        elif rounding and getattr(t, "status", "") == "differs":
            bg = f"background:{_ROW_ROUNDING};"
        else:
            bg = f"background:{_ROW_BAD};"
        result = t.describe()
        if rounding and not t.ok and getattr(t, "status", "") == "differs":
            result += " (float32 rounding)"
        cells = [f'<td style="{TD}" title="{esc(str(getattr(t, "about", "")))}">'
                 f"<code>{esc(t.name)}</code></td>",
                 f'<td style="{TD}">{esc(str(t.shapes))}</td>',
                 f'<td style="{TD}">{esc(result)}</td>']
        if show_matching:
            cells.append(f'<td style="{TD}">'
                         + ("" if t.ok else esc(", ".join(m))) + "</td>")
        parts.append(f'<tr style="{bg}">' + "".join(cells) + "</tr>")
    parts.append("</tbody></table></div>")
    return "\n".join(parts)


def _matching(trial: Any) -> Tuple[str, ...]:
    if trial.ok:
        return ()
    m = getattr(trial, "matching", None) or getattr(trial, "matches", None) or ()
    return tuple(str(x) for x in m)
