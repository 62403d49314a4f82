"""The pictures and HTML a learner reads: masked cells drawn as masked, figures
that fit a notebook, scores refused or drawn as scores, reports in the order
written, traces with collapsible heads and axis-named shapes."""
import re

import numpy as np
import pytest

import mhattn
from mhattn.learn import html as _html
from mhattn.learn.checker import PrototypeReport, TrialResult


# ------------------------------------------------------------ plot_attention

def _mpl():
    return pytest.importorskip("matplotlib")


def _layer(rng, T=6, d=8, h=2, **kw):
    x = rng.standard_normal((T, d))
    w = [rng.standard_normal((d, d)) / np.sqrt(d) for _ in range(4)]
    return x, w, mhattn.multi_head_attention(x, *w, num_heads=h, return_weights=True,
                                             **kw)[1]


def _hatched(ax):
    """(row, col) of the cells under the hatched rectangles."""
    cells = set()
    for coll in ax.collections:
        if coll.get_gid() != "mhattn-masked":
            continue
        assert coll.get_hatch() == "///"
        for path in coll.get_paths():
            (x0, y0), (x1, y1) = path.get_extents().get_points()
            cells |= {(i, j) for i in range(int(round(y0 + 0.5)), int(round(y1 + 0.5)))
                      for j in range(int(round(x0 + 0.5)), int(round(x1 + 0.5)))}
    return cells


def _cells(mask):
    return {(int(i), int(j)) for i, j in zip(*np.nonzero(mask))}


@pytest.mark.parametrize("kw", [dict(causal=True), dict(key_lengths=4),
                                dict(window=(1, 0), causal=True),
                                dict(key_mask=np.array([1, 1, 0, 1, 1, 1], bool))])
def test_masked_cells_have_the_mask_colour(rng, kw):
    _mpl()
    from mhattn.learn.plot import _MASK_COLOUR
    from matplotlib.colors import to_rgba
    x, w, weights = _layer(rng, **kw)
    # what the call could not see, by the weights themselves (exactly 0 there)
    fig = mhattn.plot_attention(weights, **kw)
    for h, ax in enumerate(fig.axes[:2]):
        (im,) = ax.get_images()
        arr = im.get_array()
        hidden = np.ma.getmaskarray(arr)
        assert hidden.any() and not hidden.all()
        assert (weights[h][hidden] == 0).all()
        np.testing.assert_array_equal(arr.data, weights[h])
        # the masked cells are painted in the mask colour, the others not
        rgba = im.to_rgba(arr)
        assert np.allclose(rgba[hidden], to_rgba(_MASK_COLOUR))
        assert not np.isclose(rgba[~hidden], to_rgba(_MASK_COLOUR)).all(axis=-1).any()
        assert _hatched(ax) == _cells(hidden)
        assert not [t for t in ax.texts if (t.get_position()[1], t.get_position()[0])
                    in _cells(hidden)]        # no "0.00" written in a masked cell
    labels = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert any("masked" in s for s in labels)


def test_mask_rules_are_the_calls(rng):
    _mpl()
    x, w, weights = _layer(rng, causal=True)
    mask = np.tril(np.ones((6, 6), bool))
    for kw in (dict(causal=True), dict(mask=mask),
               dict(mask=np.where(mask, 0.0, -np.inf))):
        fig = mhattn.plot_attention(weights, **kw)
        hidden = np.ma.getmaskarray(fig.axes[0].get_images()[0].get_array())
        np.testing.assert_array_equal(hidden, ~mask)
    # nothing masked: no mask colour, no hatch, no legend
    _, _, full = _layer(rng)
    fig = mhattn.plot_attention(full)
    assert not np.ma.getmaskarray(fig.axes[0].get_images()[0].get_array()).any()
    assert not _hatched(fig.axes[0]) and not fig.legends


def test_a_traces_masked_cells_come_from_its_scores(rng):
    _mpl()
    x = rng.standard_normal((2, 5, 8))
    w = rng.standard_normal((8, 8)) / 3
    t = mhattn.trace(x, w, w, w, w, num_heads=2, causal=True, key_lengths=[5, 3])
    fig = mhattn.plot_attention(t, batch=1)
    hidden = np.ma.getmaskarray(fig.axes[1].get_images()[0].get_array())
    np.testing.assert_array_equal(hidden, np.isneginf(t.scores[1, 1]))
    assert hidden[:, 3:].all()


def test_batched_key_lengths(rng):
    _mpl()
    w = rng.dirichlet(np.ones(4), size=(2, 3, 4))
    w[1, :, :, 2:] = 0
    w[1] /= w[1].sum(-1, keepdims=True)
    fig = mhattn.plot_attention(w, batch=1, key_lengths=[4, 2])
    hidden = np.ma.getmaskarray(fig.axes[0].get_images()[0].get_array())
    assert hidden[:, 2:].all() and not hidden[:, :2].any()


# The quick loop keeps a grid of one row, a full row, a row and a bit, and
# many rows, with short and long sequences; the rest of the grid is slow.
_QUICK_FIGURES = {(1, 3), (4, 20), (5, 64), (16, 6)}


@pytest.mark.parametrize("h, T", [
    pytest.param(h, T, id=f"{T}-{h}",
                 marks=() if (h, T) in _QUICK_FIGURES else pytest.mark.slow)
    for T in (3, 6, 20, 64) for h in (1, 2, 4, 5, 8, 12, 16)])
def test_figure_fits_a_notebook(rng, h, T):
    _mpl()
    w = rng.dirichlet(np.ones(T), size=(h, T))
    fig = mhattn.plot_attention(w, causal=False)
    width, height = fig.get_size_inches()
    assert width <= 10.0 + 1e-9
    n = len(fig.axes) - 1
    assert n == h
    cols = {round(ax.get_position().x0, 3) for ax in fig.axes[:n]}
    assert len(cols) == min(h, 4)                 # a grid of at most 4 per row
    # long sequences: ticks thin out
    assert len(fig.axes[0].get_xticks()) <= max(T if T <= 24 else 16, 1)


def test_walkthroughs_causal_plot_is_readable(rng):
    """The walkthrough's case: 4 heads, 6 tokens, causal (16.6 x 4.3 in before)."""
    _mpl()
    words = ["the", "cat", "sat", "on", "the", "mat"]
    x = rng.standard_normal((6, 16))
    W = [rng.standard_normal((16, 16)) / 4 for _ in range(4)]
    t = mhattn.trace(x, *W, num_heads=4, causal=True, tokens=words)
    fig = mhattn.plot_attention(t)
    width, _ = fig.get_size_inches()
    assert width <= 10.0
    # the annotation limit is per figure: 4 x 36 = 144 cells are written in,
    # at a font that follows the cell size (>= 7 pt here, 8 before at 16.6 in)
    texts = [tx for ax in fig.axes[:4] for tx in ax.texts]
    assert len(texts) == 4 * 21                   # the seen cells only
    assert min(tx.get_fontsize() for tx in texts) >= 7
    big = rng.dirichlet(np.ones(10), size=(4, 10))
    assert not any(ax.texts for ax in mhattn.plot_attention(big).axes)   # 400 cells


def test_annotation_font_follows_cell_size(rng):
    _mpl()
    small = mhattn.plot_attention(rng.dirichlet(np.ones(3), size=(1, 3)))
    dense = mhattn.plot_attention(rng.dirichlet(np.ones(12), size=(4, 12)), annotate=True)
    assert small.axes[0].texts[0].get_fontsize() > dense.axes[0].texts[0].get_fontsize()


def test_vmax_auto_and_default_scale(rng):
    _mpl()
    w = rng.dirichlet(np.ones(8) * 5, size=(2, 8))
    im = mhattn.plot_attention(w).axes[0].get_images()[0]
    assert im.get_clim() == (0.0, 1.0)
    fig = mhattn.plot_attention(w, vmax="auto")
    clims = {ax.get_images()[0].get_clim() for ax in fig.axes[:2]}
    assert clims == {(0.0, float(w.max()))}          # one scale for the figure


@pytest.mark.parametrize("bad,why", [
    (lambda s: s, "not probabilities"),                    # raw scores, negative
    (lambda s: np.abs(s) * 3, "not probabilities"),        # above 1
    (lambda s: np.where(np.tril(np.ones_like(s, bool)), s, -np.inf), "-inf"),
    (lambda s: np.full_like(s, 0.1), "sums to"),           # rows not summing to 1
])
def test_scores_are_refused_as_weights(rng, bad, why):
    _mpl()
    s = rng.standard_normal((2, 5, 5))
    with pytest.raises(ValueError, match=r"weights:.*" + re.escape(why)) as exc:
        mhattn.plot_attention(bad(s))
    assert 'kind="scores"' in str(exc.value)


def test_scores_are_drawn_diverging(rng):
    _mpl()
    s = rng.standard_normal((2, 5, 5))
    s = np.where(np.tril(np.ones((5, 5), bool)), s, -np.inf)
    fig = mhattn.plot_attention(s, kind="scores")
    im = fig.axes[0].get_images()[0]
    lo, hi = im.get_clim()
    assert lo == -hi and hi == pytest.approx(np.abs(s[np.isfinite(s)]).max())
    assert im.get_cmap().name.startswith("RdBu")
    assert fig.axes[-1].get_ylabel() == "score"
    np.testing.assert_array_equal(np.ma.getmaskarray(im.get_array()), np.isneginf(s[0]))
    # a Trace's scores, by name
    tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    t = mhattn.trace(X, w_q, w_k, w_v, w_o, tokens=tokens)
    fig = mhattn.plot_attention(t, kind="scores")
    np.testing.assert_array_equal(fig.axes[0].get_images()[0].get_array(), t.scores[0])
    with pytest.raises(ValueError, match="kind"):
        mhattn.plot_attention(t, kind="logits")


def test_tick_rotation_is_consistent(rng):
    _mpl()
    w = rng.dirichlet(np.ones(4), size=(3, 4))
    fig = mhattn.plot_attention(w, ["a", "longer", "b", "c"])
    rots = {t.get_rotation() for ax in fig.axes[:3] for t in ax.get_xticklabels()}
    assert rots == {45.0}


# --------------------------------------------------------------- report HTML

def _trial(name, status="ok", **kw):
    return TrialResult(name=name, about="about " + name, shapes="T=3", status=status, **kw)


def _report(explanation, trials, **kw):
    return PrototypeReport(False, "heads_split_sequence", "heads split the sequence",
                           explanation, trials, **kw)


def test_report_paragraphs_keep_their_order():
    text = ("First prose line\nwraps here.\n\nFix (either form):\n"
            "    q_i = Q[:, i*d_k:(i+1)*d_k]\n    Qh = Q.reshape(T, h, d_k)\n"
            "not np.split(Q, h, axis=0).\n\nLast words.")
    page = _report(text, [_trial("a"), _trial("b", "differs", max_abs=1.0, max_rel=1.0)]
                   )._repr_html_()
    order = [page.index(s) for s in ("First prose line wraps here.", "Fix (either form):",
                                     "q_i = Q[:, i*d_k:(i+1)*d_k]", "not np.split(Q, h",
                                     "Last words.")]
    assert order == sorted(order)
    assert "Fix (either form): not np.split" not in page
    assert page.count("<pre") == 1 and "background:#f6f8fa" in page   # inline style


def test_report_uses_the_checkers_paragraphs_when_given():
    rep = _report("ignored", [_trial("a", "differs", max_abs=1.0, max_rel=1.0)])
    rep.paragraphs = [("prose", "one"), ("code", "x = 1"), ("prose", "two")]
    page = _html.report_html(rep)
    assert "ignored" not in page
    assert page.index("one") < page.index("x = 1") < page.index("two")
    assert re.search(r"<pre[^>]*>x = 1</pre>", page)


def test_report_hints_are_a_list_and_matching_only_on_failing_trials():
    trials = [_trial("a", matches=["wo_skipped"]),
              _trial("b", "differs", max_abs=1.0, max_rel=1.0, matches=["wo_skipped"])]
    rep = _report("Summary.\n\nHint: it fails on b.\nHint: look at W^O.", trials,
                  hints=["it fails on b.", "look at W^O."])
    page = rep._repr_html_()
    assert "<ul" in page and page.count("<li>") == 2
    assert "Hint: it fails" not in page                 # shown once, in the list
    rows = re.findall(r"<tr style=\"[^\"]*\">(.*?)</tr>", page)
    assert len(rows) == 2
    assert "wo_skipped" not in rows[0] and "wo_skipped" in rows[1]
    assert "matching mistakes" in page
    # no failing trial matches anything: no column
    rep = _report("x", [_trial("b", "differs", max_abs=1.0, max_rel=1.0)])
    assert "matching mistakes" not in rep._repr_html_()


def test_report_tables_left_aligned_and_float32_rounding_not_red():
    trials = [_trial("a"), _trial("b", "differs", max_abs=1e-6, max_rel=1e-7)]
    rep = _report("x", trials)
    page = rep._repr_html_()
    assert _html.RED in page and _html._ROW_BAD in page
    assert re.search(r"<table style=\"[^\"]*text-align:left", page)
    assert all("text-align:left" in th for th in re.findall(r"<th [^>]*>", page))
    rep.float32_rounding = True
    page = rep._repr_html_()
    assert _html.RED not in page and _html._ROW_BAD not in page
    assert _html.AMBER in page and "float32 rounding" in page


# ---------------------------------------------------------------- trace HTML

def test_trace_html_details_per_head_and_named_shapes():
    tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    page = mhattn.trace(X, w_q, w_k, w_v, w_o, tokens=tokens)._repr_html_()
    assert page.count("<details") == 2 and page.count("</details>") == 2
    assert page.count("<summary") == 2
    for s in ("(h=2, T_q=3, d_k=2)", "(h=2, T_k=3, d_v=2)", "(h=2, T_q=3, T_k=3)",
              "(h=2, T_q=3)", "(T_q=3, d_out=4)", "(T_q=3, T_k=3)"):
        assert s in page, s
    assert "masked" not in page


def test_trace_html_says_masked_only_when_masked(rng):
    x = rng.standard_normal((4, 8))
    w = rng.standard_normal((8, 8))
    for kw, masked in [({}, False), (dict(causal=True), True), (dict(key_lengths=3), True),
                       (dict(window=(1, None)), True)]:
        page = mhattn.trace(x, w, w, w, w, num_heads=4, **kw)._repr_html_()
        assert ("masked (&minus;&infin;)" in page) is masked, kw
        assert page.count("<details") == 4
        assert page.count("<details open") == 1            # the first head open
    # one query against one key, causal: nothing is masked
    page = mhattn.trace(x[:1], w, w, w, w, num_heads=4, causal=True)._repr_html_()
    assert "masked (&minus;&infin;)" not in page


def test_ragged_and_batched_shapes(rng):
    x = rng.standard_normal((2, 3, 4))
    w = rng.standard_normal((4, 4))
    page = mhattn.trace(x, w, w, w, num_heads=2)._repr_html_()
    assert "(B=2, h=2, T_q=3, d_k=2)" in page and "(B=2, T_q=3, h\u00b7d_v=4)" in page
