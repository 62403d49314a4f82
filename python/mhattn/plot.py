"""mhattn.plot_attention: one heatmap per head, on one shared 0..1 colour scale.

matplotlib is an optional dependency (``pip install 'mhattn[plot]'``); it is
imported only when a plot is made.  The figure is built as a
``matplotlib.figure.Figure`` without pyplot, so no global figure state is
touched, it works under any backend (Agg included), and nothing leaks into a
later ``plt.show()``.
"""
from __future__ import annotations

import io
from typing import Any, Optional, Sequence, Union

import numpy as np

__all__ = ["plot_attention"]

_INSTALL = ("mhattn.plot_attention needs matplotlib, which is an optional "
            "dependency: pip install 'mhattn[plot]' (or pip install matplotlib)")

# Matrices up to this many cells per head get their values written in.
_ANNOTATE_MAX_CELLS = 144


def _matplotlib():
    try:
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(_INSTALL) from exc
    return Figure


def _figure_class():
    Figure = _matplotlib()

    class AttentionFigure(Figure):
        """A matplotlib Figure that Jupyter shows as a PNG even when pyplot
        (and with it the inline backend's display hook) was never imported."""

        def _repr_png_(self):
            buf = io.BytesIO()
            self.savefig(buf, format="png", bbox_inches="tight")
            return buf.getvalue()

    return AttentionFigure


def plot_attention(weights: Any, tokens: Optional[Sequence[Any]] = None,
                   heads: Union[None, int, Sequence[int]] = None, *,
                   key_tokens: Optional[Sequence[Any]] = None, batch: int = 0,
                   annotate: Optional[bool] = None, fmt: str = "{:.2f}",
                   cmap: str = "viridis", ncols: Optional[int] = None,
                   figsize: Optional[Sequence[float]] = None,
                   title: Optional[str] = None):
    """Heatmaps of attention weights, one per head, with one shared colour bar.

    plot_attention(weights, tokens=None, heads=None, *, key_tokens=None,
                   batch=0, annotate=None, fmt="{:.2f}", cmap="viridis",
                   ncols=None, figsize=None, title=None) -> matplotlib Figure

    Parameters
    ----------
    weights : array or Trace
        Post-softmax weights: (T_q, T_k) for one head, (h, T_q, T_k), or
        batched (B, h, T_q, T_k) (``batch`` picks the item), as returned by
        ``multi_head_attention(..., return_weights=True)``; or a
        :class:`mhattn.Trace`, whose ``weights`` and tokens are used.
    tokens : sequence, optional
        Labels of the query rows (the y axis).  For self-attention they also
        label the keys (the x axis).
    heads : int or sequence of int, optional
        Which heads to draw, 0-based (``weights[0]`` is the document's
        head_1, titled "head 1").  Default: all.
    key_tokens : sequence, optional
        Labels of the key columns, when they differ from ``tokens``
        (cross-attention, or T_q != T_k).
    batch : int
        The batch item to draw when the weights are batched.
    annotate : bool, optional
        Write each weight in its cell; by default only when a head's matrix
        has at most 144 cells.
    fmt : str
        Format of the annotations.
    cmap, ncols, figsize, title
        Colour map; panels per row (default: up to 4); figure size in
        inches; a title over the whole figure.

    Returns
    -------
    matplotlib.figure.Figure
        Made without pyplot.  Jupyter displays it; save it with
        ``fig.savefig(path)``.  Its axes are the heads' panels, in order,
        then the colour bar, whose scale 0..1 all heads share.

    Raises
    ------
    ImportError
        When matplotlib is not installed: ``pip install 'mhattn[plot]'``.

    Examples
    --------
    >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    >>> t = mhattn.trace(X, w_q, w_k, w_v, w_o, tokens=tokens)
    >>> fig = mhattn.plot_attention(t.weights, tokens)   # doctest: +SKIP
    """
    from .trace import Trace

    if isinstance(weights, Trace):
        if tokens is None:
            tokens = weights.tokens
            if key_tokens is None:
                key_tokens = weights.key_tokens
        w = weights.weights
    else:
        w = weights
    w = np.asarray(w)
    if w.dtype.kind not in "biuf":
        raise TypeError(f"weights: expected an array of numbers, got dtype {w.dtype}")
    if w.ndim == 4:
        if not -w.shape[0] <= batch < w.shape[0]:
            raise IndexError(f"batch: {batch} is out of range for {w.shape[0]} "
                             f"batch items (weights {w.shape})")
        w = w[batch]
    elif w.ndim == 2:
        w = w[np.newaxis]
    elif w.ndim != 3:
        raise ValueError("weights: expected (T_q, T_k), (h, T_q, T_k) or "
                         f"(B, h, T_q, T_k), got shape {w.shape}")
    H, Tq, Tk = w.shape

    if heads is None:
        idx = list(range(H))
    elif isinstance(heads, (int, np.integer)):
        idx = [int(heads)]
    else:
        idx = [int(i) for i in heads]
    if not idx:
        raise ValueError("heads: pick at least one head")
    for i in idx:
        if not -H <= i < H:
            raise IndexError(f"heads: head {i} is out of range for {H} heads")
    idx = [i % H for i in idx]

    ylabels = _labels("tokens", tokens, Tq)
    if key_tokens is None and tokens is not None:
        if Tk != Tq:
            raise ValueError(f"tokens: {len(ylabels)} labels name the queries, but "
                             f"there are {Tk} keys (T_q != T_k); pass key_tokens=")
        xlabels = ylabels
    else:
        xlabels = _labels("key_tokens", key_tokens, Tk)
    if annotate is None:
        annotate = Tq * Tk <= _ANNOTATE_MAX_CELLS

    Figure = _figure_class()
    n = len(idx)
    ncols = max(1, min(n, 4 if ncols is None else int(ncols)))
    nrows = -(-n // ncols)
    if figsize is None:
        cell = 0.45 if max(Tq, Tk) <= 12 else 0.25
        side = min(max(2.6, cell * max(Tq, Tk) + 1.2), 6.0)
        figsize = (side * ncols + 1.0, side * nrows + (0.4 if title else 0.0))
    fig = Figure(figsize=tuple(figsize), layout="constrained")
    grid = fig.subplots(nrows, ncols, squeeze=False)
    axes = list(grid.ravel())
    for ax in axes[n:]:
        ax.remove()
    axes = axes[:n]

    image = None
    for ax, h in zip(axes, idx):
        m = np.asarray(w[h], dtype=np.float64)
        image = ax.imshow(m, vmin=0.0, vmax=1.0, cmap=cmap, aspect="auto",
                          interpolation="nearest")
        ax.set_title(f"head {h + 1}")
        ax.set_xticks(range(Tk))
        ax.set_yticks(range(Tq))
        if xlabels is not None:
            ax.set_xticklabels(xlabels, rotation=45 if max(map(len, xlabels)) > 3 else 0,
                               ha="right" if max(map(len, xlabels)) > 3 else "center")
        if ylabels is not None:
            ax.set_yticklabels(ylabels)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        if annotate:
            for i in range(Tq):
                for j in range(Tk):
                    val = m[i, j]
                    # white text on dark cells, black on light ones
                    r, g, b, _ = image.cmap(image.norm(val))
                    color = "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black"
                    ax.text(j, i, fmt.format(val), ha="center", va="center",
                            color=color, fontsize=8)
    cbar = fig.colorbar(image, ax=axes, shrink=0.9)
    cbar.set_label("attention weight")
    if title:
        fig.suptitle(title)
    return fig


def _labels(name: str, labels: Any, n: int):
    if labels is None:
        return None
    out = [str(t) for t in labels]
    if len(out) != n:
        raise ValueError(f"{name}: expected {n} labels, got {len(out)}")
    return out
