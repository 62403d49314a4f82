"""Hostile callers, round 2 (issue 35): plot_attention and Trace.  Every bad
argument raises a TypeError or ValueError whose message starts with the
argument's name (or a MemoryError naming what it needs), before allocating,
and nothing hangs."""

import numpy as np
import pytest

import mhattn


def _worked():
    tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    return tokens, (X, w_q, w_k, w_v, w_o)


def _named(exc_info, name):
    msg = str(exc_info.value)
    assert msg.startswith(f"{name}: "), msg


@pytest.fixture
def t():
    tokens, args = _worked()
    return mhattn.trace(*args, tokens=tokens)


@pytest.fixture
def tb():
    rng = np.random.default_rng(35)
    x = rng.standard_normal((2, 4, 6))
    w = [rng.standard_normal((6, 6)) for _ in range(4)]
    return mhattn.trace(x, *w, num_heads=2)


# --- 2. trace / Trace ---------------------------------------------------------

@pytest.mark.parametrize("tokens", [5, 1j])
def test_trace_tokens_not_a_sequence(tokens):
    _, args = _worked()
    with pytest.raises((TypeError, ValueError)) as e:
        mhattn.trace(*args, tokens=tokens)
    _named(e, "tokens")


def test_trace_key_tokens_not_a_sequence():
    _, args = _worked()
    with pytest.raises((TypeError, ValueError)) as e:
        mhattn.trace(*args, key_tokens=5)
    _named(e, "key_tokens")


def test_head_out_of_range(t):
    with pytest.raises((ValueError, IndexError)) as e:
        t.head(5)
    _named(e, "head")


@pytest.mark.parametrize("i", ["a", None, 1.0])
def test_head_not_an_integer(t, i):
    with pytest.raises((TypeError, ValueError)) as e:
        t.head(i)
    _named(e, "head")


def test_head_batch_out_of_range(tb):
    with pytest.raises((ValueError, IndexError)) as e:
        tb.head(0, b=5)
    _named(e, "b")


@pytest.mark.parametrize("name", [3, "nope"])
def test_shape_of_bad_name(t, name):
    with pytest.raises((TypeError, ValueError)) as e:
        t.shape_of(name)
    _named(e, "name")


@pytest.mark.parametrize("arg", ["rtol", "atol"])
@pytest.mark.parametrize("value", ["a", -1, float("nan")])
def test_compare_bad_tolerance(t, arg, value):
    with pytest.raises((TypeError, ValueError)) as e:
        t.compare(t, **{arg: value})
    _named(e, arg)


# --- 1. plot_attention ----------------------------------------------------------

pytest.importorskip("matplotlib")

W = np.full((2, 3, 3), 1 / 3)


def test_plot_many_heads_no_hang(monkeypatch):
    """Shared axes made building the figure quadratic in the panels (10 s at
    100 heads, minutes at 400); now linear, and more than 64 panels are
    refused with a named error before any panel is made (counted, not
    timed: a clock on a shared machine proves nothing)."""
    from matplotlib.figure import Figure
    made = []
    subplots = Figure.subplots
    monkeypatch.setattr(Figure, "subplots",
                        lambda self, *a, **k: made.append(a) or subplots(self, *a, **k))
    w = np.broadcast_to(np.full((3, 3), 1 / 3), (400, 3, 3))
    with pytest.raises(ValueError) as e:
        mhattn.plot_attention(w)
    _named(e, "weights")
    with pytest.raises(ValueError) as e:
        mhattn.plot_attention(w, heads=range(100))
    _named(e, "heads")
    assert made == []
    fig = mhattn.plot_attention(w, heads=range(64))
    assert len(made) == 1
    assert len(fig.axes) == 65


def test_plot_huge_panel_named():
    w = np.broadcast_to(np.zeros((), bool), (1, 2 ** 20, 2 ** 20))
    with pytest.raises((ValueError, MemoryError)) as e:
        mhattn.plot_attention(w)
    assert "weights" in str(e.value)


@pytest.mark.parametrize("name,value", [
    ("tokens", 5), ("key_tokens", 5), ("heads", "a"), ("heads", 1.0),
    ("heads", [0, 1.0]), ("batch", "a"), ("batch", 0.0), ("fmt", "{:q}"),
    ("fmt", 5), ("cmap", "nope"), ("cmap", 5), ("ncols", "a"), ("ncols", 0),
    ("figsize", "a"), ("figsize", (-1, 2)), ("figsize", (1, 2, 3)),
    ("vmax", -1), ("vmax", float("nan")), ("annotate", "yes"), ("title", 5),
])
def test_plot_bad_argument_named(name, value):
    with pytest.raises((TypeError, ValueError)) as e:
        mhattn.plot_attention(W, **{name: value})
    _named(e, name)


def test_endless_tokens_refused_not_a_hang():
    import itertools
    _, args = _worked()
    with pytest.raises(ValueError) as e:
        mhattn.trace(*args, tokens=itertools.count())
    _named(e, "tokens")
    with pytest.raises(ValueError) as e:
        mhattn.plot_attention(W, key_tokens=itertools.count())
    _named(e, "key_tokens")
