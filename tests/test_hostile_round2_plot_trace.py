"""Hostile callers, round 2 (issue 35): plot_attention and Trace.  Every bad
argument raises a TypeError or ValueError whose message starts with the
argument's name (or a MemoryError naming what it needs), before allocating,
and nothing hangs."""
import time

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
