"""Issue 42's smaller findings, each as a test that failed on the old code:
a huge num_heads is refused before anything proportional to it is built, a
non-finite scale is refused, and a 12-token plot labels every key."""
import numpy as np
import pytest

import mhattn
from mhattn.nn import layer as layer_module


def test_huge_num_heads_is_refused_before_any_weight_is_drawn(monkeypatch):
    """MultiHeadAttention(8, 10**7, d_k=2) drew 640 MB of weights (10 s)
    before its MemoryError; the head count is checked first now."""
    def drawn(*args, **kwargs):
        raise AssertionError("a weight was drawn before the head count was checked")
    monkeypatch.setattr(layer_module, "_xavier_uniform", drawn)
    with pytest.raises(MemoryError, match=r"^num_heads: 10000000 heads would need"):
        mhattn.MultiHeadAttention(8, 10 ** 7, d_k=2)


def _drawn(fig):
    """The figure drawn once; its renderer."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def _label_boxes(r, labels):
    """The drawn tick labels' boxes, in display points."""
    return [t.get_window_extent(r) for t in labels if t.get_visible() and t.get_text()]


@pytest.mark.parametrize("h, T, tokens", [
    (8, 12, None), (8, 24, None), (4, 12, "words"), (1, 24, None), (12, 20, "words")])
def test_every_key_is_labelled_up_to_24_tokens_and_labels_do_not_touch(h, T, tokens):
    """Issue 42: a 12-token plot of 8 heads labelled every other key, though
    the README says ticks thin out only past 24 tokens. Every key and query
    is labelled now, in a font that keeps neighbouring labels apart."""
    pytest.importorskip("matplotlib")
    rng = np.random.default_rng(0)
    w = rng.dirichlet(np.ones(T), size=(h, T))
    words = None if tokens is None else [f"tok{i}" for i in range(T)]
    fig = mhattn.plot_attention(w, tokens=words, causal=False)
    for ax in fig.axes[:h]:
        assert list(ax.get_xticks()) == list(range(T))
        assert list(ax.get_yticks()) == list(range(T))
    # the last panel is in the bottom row, which shows the key labels; the
    # first, in the first column, shows the query labels
    r = _drawn(fig)
    xs = sorted(_label_boxes(r, fig.axes[h - 1].get_xticklabels()), key=lambda b: b.x0)
    assert len(xs) == T
    if words is None:   # unrotated: side by side, apart
        assert all(a.x1 <= b.x0 + 0.5 for a, b in zip(xs, xs[1:])), xs
    else:               # rotated 45 degrees: each starts right of the one before
        assert all(a.x1 < b.x1 for a, b in zip(xs, xs[1:])), xs
    ys = sorted(_label_boxes(r, fig.axes[0].get_yticklabels()), key=lambda b: b.y0)
    assert len(ys) == T and all(a.y1 <= b.y0 + 0.5 for a, b in zip(ys, ys[1:])), ys


def test_ticks_thin_out_past_24_tokens():
    pytest.importorskip("matplotlib")
    w = np.full((2, 25, 25), 1 / 25)
    fig = mhattn.plot_attention(w, causal=False)
    assert len(fig.axes[0].get_xticks()) < 25
