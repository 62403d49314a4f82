"""mhattn.plot_attention: one heatmap per head, shared 0..1 scale, no pyplot."""
import io
import sys

import numpy as np
import pytest

import mhattn

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.figure import Figure  # noqa: E402


@pytest.fixture
def example():
    tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    out, w = mhattn.multi_head_attention(X, w_q, w_k, w_v, w_o, return_weights=True)
    return tokens, w, mhattn.trace(X, w_q, w_k, w_v, w_o, tokens=tokens)


def _images(ax):
    return ax.get_images()


def _panels(fig, n):
    """The heads' panels are the first n axes; the colour bar is the last."""
    assert len(fig.axes) == n + 1
    return fig.axes[:n], fig.axes[-1]


def test_figure_per_head_with_colorbar(example):
    tokens, w, _ = example
    fig = mhattn.plot_attention(w, tokens)
    assert isinstance(fig, Figure)
    panels, cbar_ax = _panels(fig, 2)
    for i, ax in enumerate(panels):
        (im,) = _images(ax)
        assert im.get_clim() == (0.0, 1.0)          # one scale for every head
        np.testing.assert_array_equal(im.get_array(), w[i])
        assert ax.get_title() == f"head {i + 1}"
        assert [t.get_text() for t in ax.get_xticklabels()] == tokens
        assert ax.get_xlabel() == "key"
    # Shared axis labels: the query labels and "query" on the first column only.
    assert [t.get_text() for t in panels[0].get_yticklabels()] == tokens
    assert panels[0].get_ylabel() == "query" and panels[1].get_ylabel() == ""
    # exactly one colour bar, for the shared mappable
    assert sum(1 for ax in fig.axes if not _images(ax)) == 1
    assert cbar_ax.get_ylabel() == "attention weight"
    assert cbar_ax.get_ylim() == (0.0, 1.0)


def test_small_matrices_are_annotated(example):
    tokens, w, _ = example
    fig = mhattn.plot_attention(w, tokens)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert len(texts) == 9
    assert "0.73" in texts and "0.09" in texts and "0.18" in texts
    assert "0.73" in [t.get_text() for t in fig.axes[1].texts]
    fig = mhattn.plot_attention(w, tokens, fmt="{:.4f}")
    assert "0.7337" in [t.get_text() for t in fig.axes[0].texts]
    assert not mhattn.plot_attention(w, annotate=False).axes[0].texts


def test_large_matrices_are_not_annotated(rng):
    w = rng.dirichlet(np.ones(30), size=(3, 30))
    fig = mhattn.plot_attention(w)
    panels, _ = _panels(fig, 3)
    assert all(not ax.texts for ax in panels)
    assert mhattn.plot_attention(w, annotate=True).axes[0].texts


def test_trace_input_uses_its_tokens(example):
    tokens, _, t = example
    fig = mhattn.plot_attention(t)
    panels, _ = _panels(fig, 2)
    assert [x.get_text() for x in panels[0].get_yticklabels()] == tokens
    np.testing.assert_array_equal(panels[1].get_images()[0].get_array(), t.weights[1])


def test_batched_weights_and_batch_index(rng):
    w = rng.dirichlet(np.ones(4), size=(2, 3, 4))      # (B, h, T, T)
    fig = mhattn.plot_attention(w, batch=1)
    np.testing.assert_array_equal(fig.axes[2].get_images()[0].get_array(), w[1, 2])
    with pytest.raises(IndexError, match="batch"):
        mhattn.plot_attention(w, batch=2)
    x = rng.standard_normal((2, 4, 4))
    e = np.eye(4)
    t = mhattn.trace(x, e, e, e, num_heads=2)
    fig = mhattn.plot_attention(t, batch=1)
    np.testing.assert_array_equal(fig.axes[0].get_images()[0].get_array(), t.weights[1, 0])


def test_heads_subset_and_single_head(example):
    tokens, w, _ = example
    fig = mhattn.plot_attention(w, tokens, heads=[1])
    panels, _ = _panels(fig, 1)
    assert panels[0].get_title() == "head 2"
    fig = mhattn.plot_attention(w[0], tokens)            # (T_q, T_k): one head
    _panels(fig, 1)
    with pytest.raises(IndexError, match="head"):
        mhattn.plot_attention(w, heads=5)


def test_more_heads_than_columns(rng):
    w = rng.dirichlet(np.ones(3), size=(5, 3))
    fig = mhattn.plot_attention(w)
    _panels(fig, 5)                      # the unused sixth..eighth slots are removed


def test_key_tokens_for_cross_attention(rng):
    w = rng.dirichlet(np.ones(5), size=(2, 3))           # T_q=3, T_k=5
    fig = mhattn.plot_attention(w, ["a", "b", "c"], key_tokens=list("vwxyz"))
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == list("vwxyz")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="key_tokens"):
        mhattn.plot_attention(w, ["a", "b", "c"])
    with pytest.raises(ValueError, match="tokens"):
        mhattn.plot_attention(w, ["a", "b"], key_tokens=list("vwxyz"))


def test_bad_weights():
    with pytest.raises(ValueError, match="weights"):
        mhattn.plot_attention(np.ones(3))
    with pytest.raises(TypeError):
        mhattn.plot_attention(np.array([["a"]]))


def test_renders_without_pyplot_state(example):
    import matplotlib.pyplot as plt
    tokens, w, _ = example
    before = plt.get_fignums()
    fig = mhattn.plot_attention(w, tokens, title="worked example")
    assert plt.get_fignums() == before           # not registered with pyplot
    buf = io.BytesIO()
    fig.savefig(buf, format="png")               # Agg renders it
    assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fig._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"  # what Jupyter displays
    assert fig._suptitle.get_text() == "worked example"


def test_missing_matplotlib_says_what_to_install(monkeypatch, example):
    _, w, _ = example
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'mhattn\[plot\]'"):
        mhattn.plot_attention(w)


def test_import_mhattn_does_not_import_matplotlib():
    import subprocess
    code = ("import sys, mhattn; mhattn.plot_attention; "
            "print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_docstring_carries_signature():
    assert "plot_attention(weights, tokens=None, heads=None" in mhattn.plot_attention.__doc__
