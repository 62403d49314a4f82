"""mhattn.plot_attention: one heatmap per head, on one shared colour scale
(0..1 for weights), never-seen cells hatched grey.

matplotlib is an optional dependency (``pip install 'mhattn[plot]'``); it is
imported only when a plot is made.  The figure is built as a
``matplotlib.figure.Figure`` without pyplot, so no global figure state is
touched, it works under any backend (Agg included), and nothing leaks into a
later ``plt.show()``.
"""
from __future__ import annotations

import io
import itertools
import math
import numbers
from typing import Any, Optional, Sequence, Union

import numpy as np

from .._internal.arrays import _check_numeric, _to_array

__all__ = ["plot_attention"]

_INSTALL = ("mhattn.plot_attention needs matplotlib, which is an optional "
            "dependency: pip install 'mhattn[plot]' (or pip install matplotlib)")

# Figures up to this many cells (over all their panels) get their values written in.
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
                   cmap: Optional[str] = None, ncols: Optional[int] = None,
                   figsize: Optional[Sequence[float]] = None,
                   title: Optional[str] = None, mask: Any = None,
                   causal: bool = False, key_lengths: Any = None,
                   window: Any = None, key_mask: Any = None, sinks: Any = None,
                   kind: str = "weights", vmax: Union[None, float, str] = None):
    """Heatmaps of attention weights, one per head, with one shared colour bar.

    plot_attention(weights, tokens=None, heads=None, *, key_tokens=None,
                   batch=0, annotate=None, fmt="{:.2f}", cmap=None,
                   ncols=None, figsize=None, title=None, mask=None,
                   causal=False, key_lengths=None, window=None, key_mask=None,
                   sinks=None, kind="weights", vmax=None) -> matplotlib Figure

    Cells a query can never see (masked, causal, padding, outside the
    window) are drawn hatched in grey, not as a 0.00 in the colour of tiny
    weights, and a legend entry says so.

    Parameters
    ----------
    weights : array or Trace
        Post-softmax weights: (T_q, T_k) for one head, (h, T_q, T_k), or
        batched (B, h, T_q, T_k) (``batch`` picks the item), as returned by
        ``multi_head_attention(..., return_weights=True)``; or a
        :class:`mhattn.Trace`, whose ``weights`` (or ``scores`` with
        ``kind="scores"``), tokens and masked cells (its -inf scores) are used.
        With ``kind="scores"``: any scores, -inf where masked.
    tokens : sequence, optional
        Labels of the query rows (the y axis).  For self-attention they also
        label the keys (the x axis).
    heads : int or sequence of int, optional
        Which heads to draw, 0-based (``weights[0]`` is the document's
        head_1, titled "head 1").  Default: all.  At most 64 panels are
        drawn: more heads than that must be picked with ``heads=``.
    key_tokens : sequence, optional
        Labels of the key columns, when they differ from ``tokens``
        (cross-attention, or T_q != T_k).
    batch : int
        The batch item to draw when the weights are batched.
    annotate : bool, optional
        Write each value in its cell; by default only when the whole figure
        has at most 144 cells.  The font size follows the cell size.
    fmt : str
        Format of the annotations.
    cmap : str, optional
        Colour map: "viridis" for weights, the diverging "RdBu_r" for scores.
    ncols : int, optional
        Panels per row; default up to 4, the heads wrapping into a grid.
    figsize : (float, float), optional
        Figure size in inches; by default at most 10 inches wide.
    title : str, optional
        A title over the whole figure.
    mask, causal, key_lengths, window, key_mask
        The visibility of the call that made the weights, with the same
        conventions as :func:`mhattn.multi_head_attention` (``mask``
        boolean, True = may attend, or float with -inf blocking, broadcasting
        to (B, h, T_q, T_k); causal aligned bottom-right; keys at positions
        >= key_lengths[b] are padding; ``window=(left, right)``;
        ``key_mask`` (T_k,) or (B, T_k), False = padding).  Cells no rule
        allows are drawn as masked.  Default: nothing masked.
    sinks : (h,) array, optional
        The sinks of the call that made the weights.  A sink takes its share
        of each row's softmax and the weights exclude it, so a row of such
        weights sums to 1 - p_sink, less than 1 (0 for a fully masked row):
        with ``sinks`` (or a Trace of a call with sinks) rows summing to
        anything from 0 to 1 are accepted; without, a visible row must sum
        to 1.  Rows summing to more than 1 are refused either way.
    kind : {"weights", "scores"}
        "weights" (default) refuses anything that is not a probability
        (negative values, values above 1, -inf, or visible rows not summing
        to 1, or to at most 1 with ``sinks``) with a ValueError; "scores"
        draws any real values on a diverging map centred on 0 under a bar
        labelled "score", -inf as masked.
    vmax : float or "auto", optional
        Top of the colour scale.  Default: 1 for weights (the scale 0..1),
        the largest abs(score) for scores; "auto": the largest value drawn,
        one scale for the whole figure.

    Returns
    -------
    matplotlib.figure.Figure
        Made without pyplot.  Jupyter displays it; save it with
        ``fig.savefig(path)``.  Its axes are the heads' panels, in order,
        then the colour bar, whose scale all heads share.  Each panel's image
        holds a masked array whose mask marks the cells drawn as masked.

    Raises
    ------
    ImportError
        When matplotlib is not installed: ``pip install 'mhattn[plot]'``.
    ValueError
        ``weights: ...`` when the values are not probabilities and
        ``kind="weights"``; bad shapes, labels or heads.

    Examples
    --------
    >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    >>> t = mhattn.trace(X, w_q, w_k, w_v, w_o, tokens=tokens)
    >>> fig = mhattn.plot_attention(t.weights, tokens)   # doctest: +SKIP
    >>> fig = mhattn.plot_attention(t, kind="scores")     # doctest: +SKIP
    """
    if not isinstance(kind, str) or kind not in ("weights", "scores"):
        raise ValueError(f"kind: expected 'weights' or 'scores', got {kind!r:.80}")
    _check_options(tokens, key_tokens, batch, annotate, fmt, cmap, ncols, figsize,
                   title, vmax)
    w, B, b, hidden_from_trace, tokens, key_tokens = _read_weights(
        weights, batch, kind, tokens, key_tokens)
    H, Tq, Tk = w.shape
    idx = _head_indices(heads, H)
    has_sinks = _has_sinks(sinks, weights, H)
    hidden = _hidden(H, Tq, Tk, B, b, mask=mask, causal=causal,
                     key_lengths=key_lengths, window=window, key_mask=key_mask)
    if hidden_from_trace is not None:
        hidden = hidden | hidden_from_trace
    if kind == "scores":
        hidden = hidden | np.isneginf(w)
    else:
        _check_weights(w, hidden, has_sinks)

    ylabels = _labels("tokens", tokens, Tq)
    if key_tokens is None and tokens is not None:
        if Tk != Tq:
            raise ValueError(f"tokens: {len(ylabels)} labels name the queries, but "
                             f"there are {Tk} keys (T_q != T_k); pass key_tokens=")
        xlabels = ylabels
    else:
        xlabels = _labels("key_tokens", key_tokens, Tk)

    n = len(idx)
    if annotate is None:
        annotate = n * Tq * Tk <= _ANNOTATE_MAX_CELLS
    ncols = max(1, min(n, 4 if ncols is None else int(ncols)))
    cmap_name = cmap
    nrows = -(-n // ncols)
    if figsize is None:
        figsize = _figsize(ncols, nrows, Tq, Tk, xlabels, ylabels, title)

    shown = np.stack([w[h] for h in idx])
    seen = ~np.stack([hidden[h] for h in idx])
    cmap, vmin, vtop = _scale(kind, cmap, vmax, shown[seen & np.isfinite(shown)])

    Figure = _figure_class()
    import matplotlib
    from matplotlib.patches import Patch

    colours = _colours(matplotlib, cmap, cmap_name)
    fig = Figure(figsize=tuple(float(f) for f in figsize), layout="constrained")
    grid = fig.subplots(nrows, ncols, squeeze=False)
    axes = list(grid.ravel())
    for ax in axes[n:]:
        ax.remove()
    axes = axes[:n]

    # Font size from the cell size (in points): the widest label fits the
    # cell's width (a digit is ~0.6 em, with a margin) and about half its height.
    width_in, height_in = figsize
    cell_w = 72 * (width_in - 1.4) / ncols / max(Tk, 1)
    cell_h = 72 * (height_in - 0.8) / nrows / max(Tq, 1)
    widest = max((len(fmt.format(v)) for v in shown[seen][:256]), default=4)
    fontsize = float(np.clip(min(cell_h * 0.45, 0.75 * cell_w / (0.6 * widest)), 4.0, 10.0))
    # A panel's extent in inches, for the ticks.
    panel_in = ((width_in - 1.4) / ncols, (height_in - 0.8) / nrows)

    image = None
    for p, (ax, h) in enumerate(zip(axes, idx)):
        image = ax.imshow(np.ma.masked_array(shown[p], mask=~seen[p]), vmin=vmin,
                          vmax=vtop, cmap=colours, aspect="auto", interpolation="nearest")
        # The hatch over the never-seen cells, so that they read as "no value"
        # even in grey print.
        if (~seen[p]).any():
            ax.add_collection(_hatch(~seen[p]))
        ax.set_title(f"head {h + 1}")
        _ticks(ax, Tq, Tk, xlabels, ylabels, *panel_in)
        if annotate:
            _annotate(ax, image, shown[p], seen[p], fmt, fontsize)
    _share_labels(axes, ncols, nrows)
    cbar = fig.colorbar(image, ax=axes, shrink=0.9)
    cbar.set_label("score" if kind == "scores" else "attention weight")
    if not seen.all():
        handle = Patch(facecolor=_MASK_COLOUR, edgecolor=_HATCH_COLOUR, hatch="///",
                       label="masked: never seen")
        try:        # "outside" places it below the panels (matplotlib >= 3.7)
            fig.legend(handles=[handle], loc="outside lower center", fontsize=9,
                       frameon=False)
        except ValueError:
            fig.legend(handles=[handle], loc="lower left", fontsize=9, frameon=False)
    if title:
        fig.suptitle(title)
    return fig


def _read_weights(weights, batch, kind, tokens, key_tokens):
    """-> (w (H, Tq, Tk) float64, B, b, the Trace's -inf cells or None,
    tokens, key_tokens)."""
    from .trace import Trace

    hidden = None
    if isinstance(weights, Trace):
        if tokens is None:
            tokens = weights.tokens
            if key_tokens is None:
                key_tokens = weights.key_tokens
        w = weights.scores if kind == "scores" else weights.weights
        hidden = np.isneginf(np.asarray(weights.scores))
    else:
        w = weights
    w = np.asarray(w)
    if w.dtype.kind not in "biuf":
        raise TypeError(f"weights: expected an array of numbers, got dtype {w.dtype}")
    B, b = 1, 0
    if w.ndim == 4:
        if not -w.shape[0] <= batch < w.shape[0]:
            raise IndexError(f"batch: {batch} is out of range for {w.shape[0]} "
                             f"batch items (weights {w.shape})")
        B, b = w.shape[0], batch % w.shape[0]
        w = w[b]
        hidden = None if hidden is None else hidden[b]
    elif w.ndim == 2:
        w = w[np.newaxis]
        hidden = None if hidden is None else hidden[np.newaxis]
    elif w.ndim != 3:
        raise ValueError("weights: expected (T_q, T_k), (h, T_q, T_k) or "
                         f"(B, h, T_q, T_k), got shape {w.shape}")
    H, Tq, Tk = w.shape
    if Tq > _MAX_SIDE or Tk > _MAX_SIDE:
        raise ValueError(f"weights: panels of T_q x T_k = {Tq} x {Tk} cells are more "
                         f"than can be drawn (at most {_MAX_SIDE} a side); plot a "
                         "slice, e.g. weights[..., :256, :256]")
    from .._internal.args import check_memory
    # float64 copy, the hidden cells and their complement, the masked copy drawn
    check_memory([("plot_attention(weights)", "h*T_q*T_k", (H, Tq, Tk), 8 + 3)])
    return np.asarray(w, dtype=np.float64), B, b, hidden, tokens, key_tokens


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _head_indices(heads, H):
    if heads is None:
        if H > _MAX_PANELS:
            raise ValueError(f"weights: {H} heads are more panels than can be drawn "
                             f"(at most {_MAX_PANELS}); pick some with heads=")
        idx = list(range(H))
    elif _is_int(heads):
        idx = [int(heads)]
    elif isinstance(heads, (str, bytes)) or not hasattr(heads, "__iter__"):
        raise TypeError(f"heads: expected a head index or a sequence of them, got "
                        f"{heads!r:.80} ({type(heads).__name__})")
    else:
        idx = []
        for i in heads:
            if not _is_int(i):
                raise TypeError(f"heads: expected integer head indices, got "
                                f"{i!r:.80} ({type(i).__name__})")
            idx.append(int(i))
            if len(idx) > _MAX_PANELS:
                raise ValueError(f"heads: more than {_MAX_PANELS} panels cannot be "
                                 "drawn; pick fewer heads")
    if not idx:
        raise ValueError("heads: pick at least one head")
    for i in idx:
        if not -H <= i < H:
            raise IndexError(f"heads: head {i} is out of range for {H} heads")
    return [i % H for i in idx]


# More panels than this are refused: unreadable, and each costs ~40 ms to build.
_MAX_PANELS = 64
# Nor panels with more rows or columns than this (no screen has the pixels).
_MAX_SIDE = 8192


def _check_options(tokens, key_tokens, batch, annotate, fmt, cmap, ncols, figsize,
                   title, vmax) -> None:
    """The plain arguments, each named when bad, before anything is allocated."""
    from .._internal.args import bool_arg

    for name, labels in (("tokens", tokens), ("key_tokens", key_tokens)):
        if labels is not None and (isinstance(labels, (str, bytes))
                                   or not hasattr(labels, "__iter__")):
            raise TypeError(f"{name}: expected a sequence of labels, got "
                            f"{labels!r:.80} ({type(labels).__name__})")
    if not _is_int(batch):
        raise TypeError(f"batch: expected an integer batch index, got {batch!r:.80} "
                        f"({type(batch).__name__})")
    if annotate is not None:
        bool_arg("annotate", annotate)
    if not isinstance(fmt, str):
        raise TypeError(f"fmt: expected a format string such as '{{:.2f}}', got "
                        f"{fmt!r:.80} ({type(fmt).__name__})")
    try:
        fmt.format(0.5)
    except (ValueError, TypeError, IndexError, KeyError, AttributeError) as exc:
        raise ValueError(f"fmt: {fmt!r:.80} cannot format a number such as 0.5: "
                         f"{exc}") from None
    if cmap is not None and not isinstance(cmap, str):
        raise TypeError(f"cmap: expected a matplotlib colour map name, got "
                        f"{cmap!r:.80} ({type(cmap).__name__})")
    if ncols is not None:
        if not _is_int(ncols):
            raise TypeError(f"ncols: expected a positive integer, got {ncols!r:.80} "
                            f"({type(ncols).__name__})")
        if ncols < 1:
            raise ValueError(f"ncols: expected a positive integer, got {ncols}")
    if figsize is not None:
        if isinstance(figsize, (str, bytes)) or not hasattr(figsize, "__len__") \
                or len(figsize) != 2:
            raise TypeError(f"figsize: expected (width, height) in inches, got "
                            f"{figsize!r:.80}")
        for f in figsize:
            if isinstance(f, (bool, np.bool_)) or not isinstance(f, numbers.Real):
                raise TypeError(f"figsize: expected two numbers (inches), got "
                                f"{figsize!r:.80}")
            if not (math.isfinite(f) and 0 < f <= 1000):
                raise ValueError(f"figsize: expected two positive finite sizes in "
                                 f"inches (at most 1000), got {tuple(figsize)!r:.80}")
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title: expected a string, got {title!r:.80} "
                        f"({type(title).__name__})")
    if vmax is not None and not (isinstance(vmax, str) and vmax == "auto"):
        if isinstance(vmax, (bool, np.bool_)) or not isinstance(vmax, numbers.Real):
            raise ValueError(f"vmax: expected None, 'auto' or a number, got "
                             f"{vmax!r:.80}")
        if not (math.isfinite(vmax) and vmax > 0):
            raise ValueError(f"vmax: expected None, 'auto' or a number > 0, got {vmax}")


def _scale(kind, cmap, vmax, vals):
    """-> (colour map name, bottom, top) of the one scale all panels share."""
    if vmax not in (None, "auto") and not isinstance(vmax, (int, float, np.number)):
        raise ValueError(f"vmax: expected None, 'auto' or a number, got {vmax!r}")
    if kind == "scores":
        top = float(np.abs(vals).max()) if vals.size else 1.0
        if vmax not in (None, "auto"):
            top = float(vmax)
        top = top if top > 0 else 1.0
        return cmap or "RdBu_r", -top, top
    if vmax == "auto":
        top = float(vals.max()) if vals.size else 1.0
        top = top if top > 0 else 1.0
    else:
        top = 1.0 if vmax is None else float(vmax)
    return cmap or "viridis", 0.0, top


def _colours(matplotlib, cmap, cmap_name):
    """The colour map, masked cells in grey; an unknown name is cmap's error."""
    try:
        return matplotlib.colormaps[cmap].with_extremes(bad=_MASK_COLOUR)
    except KeyError:
        raise ValueError(f"cmap: {cmap_name!r:.80} is not a matplotlib colour map "
                         "name (e.g. 'viridis', 'magma', 'RdBu_r')") from None


def _annotate(ax, image, m, seen, fmt, fontsize):
    """Each visible cell's value, white on dark cells and black on light ones."""
    for i, j in zip(*np.nonzero(seen)):
        val = m[i, j]
        r, g, bl, _ = image.cmap(image.norm(val))
        color = "white" if 0.299 * r + 0.587 * g + 0.114 * bl < 0.5 else "black"
        ax.text(j, i, fmt.format(val), ha="center", va="center", color=color,
                fontsize=fontsize)


def _share_labels(axes, ncols, nrows):
    """"key" under the bottom panel of each column, "query" left of the first
    panel of each row; the tick labels likewise."""
    n = len(axes)
    for k, ax in enumerate(axes):
        row, col = divmod(k, ncols)
        if row == nrows - 1 or k + ncols >= n:
            ax.set_xlabel("key")
            ax.tick_params(axis="x", labelbottom=True)
        else:
            ax.tick_params(axis="x", labelbottom=False)
        if col == 0:
            ax.set_ylabel("query")
        else:
            ax.tick_params(axis="y", labelleft=False)


_MASK_COLOUR = "#d9d9d9"
_HATCH_COLOUR = "#8c8c8c"


def _hatch(hidden: np.ndarray):
    """One hatched collection over the hidden cells: a rectangle per run of
    hidden cells in a row, so that a causal T x T mask is T rectangles."""
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle
    rects = []
    for i, row in enumerate(hidden):
        edges = np.flatnonzero(np.diff(np.concatenate(([0], row.astype(np.int8), [0]))))
        for j0, j1 in zip(edges[::2], edges[1::2]):
            rects.append(Rectangle((j0 - 0.5, i - 0.5), j1 - j0, 1))
    return PatchCollection(rects, facecolor="none", edgecolor=_HATCH_COLOUR, hatch="///",
                           linewidth=0, gid="mhattn-masked")


def _figsize(ncols, nrows, Tq, Tk, xlabels, ylabels, title):
    """Cells of 0.45 in (small), shrinking so that the figure stays <= 10 in wide."""
    cell = 0.45 if max(Tq, Tk) <= 12 else 0.25
    label_w = 0.0 if ylabels is None else min(max(map(len, ylabels)), 12) * 0.07
    panel_w = min(max(1.8, cell * Tk), 6.0)
    width = ncols * panel_w + label_w + 1.2          # + colour bar
    if width > _MAX_WIDTH:
        panel_w = (_MAX_WIDTH - label_w - 1.2) / ncols
        width = _MAX_WIDTH
    panel_h = min(max(1.6, panel_w * Tq / max(Tk, 1)), 6.0)
    extra = 0.45 + (0.4 if title else 0.0)           # titles, legend
    if xlabels is not None:
        extra += min(max(map(len, xlabels)), 12) * 0.06
    return (width, nrows * (panel_h + 0.35) + extra)


_MAX_WIDTH = 10.0


#: Up to this many tokens an axis labels every one of them.
EVERY_TICK = 24
_TICK_POINTS = 10.0   # matplotlib's default tick label size


def _ticks(ax, Tq, Tk, xlabels, ylabels, width_in, height_in):
    """Every tick up to EVERY_TICK tokens, in a font shrunk (down to 4 pt)
    so that neighbouring labels do not touch; past that, every 1, 2, 5, 10,
    20, ... th, about one label per 0.24 in across and 0.2 in down. Key
    labels are rotated 45 degrees when any is longer than 3 characters, in
    every panel alike."""
    rotate = xlabels is not None and max(map(len, xlabels), default=0) > 3
    for axis, n, labels, span, gap, across in ((ax.xaxis, Tk, xlabels, width_in, 0.24, True),
                                               (ax.yaxis, Tq, ylabels, height_in, 0.2, False)):
        most = max(2, int(span / gap))
        step = 1 if n <= EVERY_TICK else next(
            s for s in (m * 10 ** e for e in range(12) for m in (1, 2, 5)) if -(-n // s) <= most)
        pos = list(range(0, n, step))
        axis.set_ticks(pos)
        shown = [labels[i] for i in pos] if labels is not None else [str(i) for i in pos]
        if labels is not None:
            axis.set_ticklabels(shown)
        # A label's extent along its axis, in ems: its width (0.6 em a
        # character) across unrotated, else about a line (1.1 em; 45 degrees
        # is a line's height times sqrt 2 across, less the overlap allowed).
        widest = max(map(len, shown), default=1)
        ems = 0.6 * widest + 0.3 if across and not rotate else 1.3
        pitch = 72.0 * span * step / max(n, 1)            # points between ticks
        axis.set_tick_params(labelsize=float(np.clip(pitch / ems, 4.0, _TICK_POINTS)))
    if rotate:
        for t in ax.get_xticklabels():
            t.set_rotation(45)
            t.set_ha("right")


def _hidden(H, Tq, Tk, B, b, *, mask, causal, key_lengths, window, key_mask) -> np.ndarray:
    """(H, Tq, Tk) bool: the cells no visibility rule allows, by the
    reference's own rules (:func:`mhattn.reference.allowed_keys`)."""
    if mask is None and not causal and key_lengths is None and window is None \
            and key_mask is None:
        return np.zeros((H, Tq, Tk), dtype=bool)
    from .. import reference
    from .._internal.args import normalize

    extra = {}
    if mask is not None:
        m = np.asarray(mask)
        if m.dtype != bool:     # float: -inf blocks
            m = ~np.isneginf(m)
        extra["mask"] = m
    bt = B > 1 or (key_lengths is not None and np.ndim(key_lengths) == 1
                   and np.size(key_lengths) > 1) or (key_mask is not None
                                                     and np.ndim(key_mask) == 2)
    nb = max(B, np.size(key_lengths) if key_lengths is not None else 1,
             np.shape(key_mask)[0] if key_mask is not None and np.ndim(key_mask) == 2
             else 1)
    if "mask" in extra and extra["mask"].ndim == 4:
        nb = max(nb, extra["mask"].shape[0])
        bt = True
    xs = (nb, Tq, H) if bt else (Tq, H)
    ks = (nb, Tk, H) if bt else (Tk, H)
    eye = np.eye(H)
    kl = None if key_lengths is None else np.atleast_1d(np.asarray(key_lengths))
    if kl is not None and not bt:
        kl = int(kl[0])
    try:
        call = normalize(np.zeros(xs), eye, eye, eye, eye, num_heads=H,
                         key=np.zeros(ks), value=np.zeros(ks), causal=causal,
                         key_lengths=kl, window=window, key_mask=key_mask, **extra)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"mask/causal/key_lengths/window/key_mask: do not fit weights "
                        f"of {H} heads, T_q={Tq}, T_k={Tk}: {exc}") from exc
    bb = b if bt else 0
    return ~np.stack([reference.allowed_keys(call, bb, h) for h in range(H)])


def _has_sinks(sinks: Any, weights: Any, H: int) -> bool:
    """Whether the weights come from a call with sinks: ``sinks`` given
    (checked: one per head), or a Trace that holds them."""
    from .trace import Trace

    if sinks is None:
        return isinstance(weights, Trace) and weights.sinks is not None
    s = _to_array("sinks", sinks)
    _check_numeric("sinks", s)
    if s.shape != (H,):
        raise ValueError(f"sinks: expected shape ({H},) (one per head of the weights), "
                         f"got {s.shape}")
    return True


def _check_weights(w: np.ndarray, hidden: np.ndarray, sinks: bool) -> None:
    """Refuse what is not a probability (kind="weights"): a visible row sums
    to 1, or to at most 1 when the call had sinks (which take the rest)."""
    hint = (" These look like scores: pass kind=\"scores\" to draw them on a "
            "diverging scale, or plot the softmax weights "
            "(multi_head_attention(..., return_weights=True) or Trace.weights).")
    if np.isnan(w).any():
        raise ValueError("weights: holds NaN; attention weights are finite probabilities")
    if np.isinf(w).any():
        raise ValueError("weights: holds -inf or inf, so it is not post-softmax "
                         "weights." + hint)
    tol = 1e-3
    if (w < -tol).any() or (w > 1 + tol).any():
        raise ValueError(f"weights: values from {w.min():.3g} to {w.max():.3g} are not "
                         "probabilities in 0..1." + hint)
    seen = np.where(hidden, 0.0, w)
    sums = seen.sum(axis=-1)
    if sinks:
        # The sink takes 1 - sum: any sum in 0..1, but nothing on hidden keys.
        bad = (sums > 1 + tol) | (np.abs(w).sum(axis=-1) - sums > tol)
        if bad.any():
            h, i = (int(a[0]) for a in np.nonzero(bad))
            raise ValueError(f"weights: row {i} of head {h + 1} sums to {sums[h, i]:.4g} "
                             f"over its visible keys (and {w[h, i].sum():.4g} in all), "
                             "not at most 1 with nothing on hidden keys, so these are "
                             "not softmax weights (or the mask passed does not match "
                             "them)." + hint)
        return
    # A row may sum to 0 (fully masked), or to 1 over its visible keys.
    bad = ~((np.abs(sums - 1) <= tol) | (np.abs(w).sum(axis=-1) <= tol))
    if bad.any():
        h, i = (int(a[0]) for a in np.nonzero(bad))
        below = (" (a call with sinks gives rows summing to less than 1: pass its "
                 "sinks=)" if sums[h, i] < 1 else "")
        raise ValueError(f"weights: row {i} of head {h + 1} sums to {sums[h, i]:.4g} "
                         "over its visible keys, not 1, so these are not softmax "
                         f"weights (or the mask passed does not match them){below}."
                         + hint)


def _labels(name: str, labels: Any, n: int):
    if labels is None:
        return None
    # At most n + 1 labels are read: an endless iterator is refused, not a hang.
    out = [str(t) for t in itertools.islice(labels, n + 1)]
    if len(out) != n:
        raise ValueError(f"{name}: expected {n} labels, got {len(out)}")
    return out
