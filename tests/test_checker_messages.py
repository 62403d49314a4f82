"""The checker's reports speak the learner's language.

- A textbook prototype (d_k = d_model // h, hard-coded) that is right for the
  standard convention opens with exactly that, and with what the general
  convention adds, never with "not like any known mistake".
- A prototype that returns None, a wrong shape, a tuple, a list, a string,
  or raises, gets a report with no internal name in it (no name starting
  with "_": str, repr, the HTML, the hints and every trial's line).
"""
import re

import numpy as np
import pytest

import mhattn

STANDARD = "correct for the standard convention (d_k = d_v = d_model / h)"


# ------------------------------------------------------------ the standard convention

def textbook(x, w_q, w_k, w_v, w_o, num_heads):
    """The usual tutorial code: every head d_model // h wide."""
    T, d_model = x.shape
    d_k = d_model // num_heads
    Q = (x @ w_q).reshape(T, num_heads, d_k).transpose(1, 0, 2)
    K = (x @ w_k).reshape(T, num_heads, d_k).transpose(1, 0, 2)
    V = (x @ w_v).reshape(T, num_heads, d_k).transpose(1, 0, 2)
    scores = Q @ K.transpose(0, 2, 1) / np.sqrt(d_k)
    w = np.exp(scores - scores.max(axis=-1, keepdims=True))
    w = w / w.sum(axis=-1, keepdims=True)
    return (w @ V).transpose(1, 0, 2).reshape(T, d_model) @ w_o


def textbook_loop(x, w_q, w_k, w_v, w_o, num_heads):
    d_k = x.shape[1] // num_heads
    heads = []
    for i in range(num_heads):
        q = x @ w_q[:, i * d_k:(i + 1) * d_k]
        k = x @ w_k[:, i * d_k:(i + 1) * d_k]
        v = x @ w_v[:, i * d_k:(i + 1) * d_k]
        s = q @ k.T / np.sqrt(d_k)
        e = np.exp(s - s.max(axis=1, keepdims=True))
        heads.append(e / e.sum(axis=1, keepdims=True) @ v)
    return np.concatenate(heads, axis=1) @ w_o


def no_scaling(x, w_q, w_k, w_v, w_o, num_heads):
    T = x.shape[0]
    Q = (x @ w_q).reshape(T, num_heads, -1).transpose(1, 0, 2)
    K = (x @ w_k).reshape(T, num_heads, -1).transpose(1, 0, 2)
    V = (x @ w_v).reshape(T, num_heads, -1).transpose(1, 0, 2)
    s = Q @ K.transpose(0, 2, 1)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    w = w / w.sum(axis=-1, keepdims=True)
    return (w @ V).transpose(1, 0, 2).reshape(T, -1) @ w_o


def test_textbook_prototype_opens_with_the_standard_convention():
    rep = mhattn.check_prototype(textbook)
    text = str(rep)
    assert not rep.ok and rep.standard_ok is True
    assert text.splitlines()[0].startswith("check_prototype: " + STANDARD), text
    assert "general" in rep.title
    assert "not like any known mistake" not in text
    assert "not like any known mistake" not in rep._repr_html_()
    first = rep.paragraphs[0][1]
    assert first.startswith("Your prototype is correct for the standard convention")
    for words in ("d_model != h*d_k", "d_k != d_v", "W_i^V of shape d_model x d_v",
                  "dk_ne_dv"):
        assert words in first, words
    code = "\n".join(t for k, t in rep.paragraphs if k == "code")
    assert "d_k = w_q.shape[1] // num_heads" in code
    assert "d_v = w_v.shape[1] // num_heads" in code
    assert 'convention="standard"' in code
    # the trials that raised still say how
    assert any(t.status == "raised" and "cannot reshape" in t.error for t in rep.trials)
    # every failing trial is outside the standard convention
    from mhattn.learn.checker import _trials
    cases = {t.name: t for t in _trials(4, np.dtype(np.float64), 0)}
    for t in rep.trials:
        d = cases[t.name].dims
        outside = d["d_model"] != d["h"] * d["d_k"] or d["d_k"] != d["d_v"]
        assert t.ok != outside, t.name
    assert mhattn.check_prototype(textbook, convention="standard").ok


def test_a_named_standard_only_mistake_keeps_the_headline():
    """The loop version slices V with d_model // h: the headline says it is
    right for the standard convention, then names what is wrong."""
    rep = mhattn.check_prototype(textbook_loop)
    assert rep.standard_ok is True
    assert rep.title.startswith(STANDARD + " only: "), rep.title
    assert rep.mistakes and rep.exact, str(rep)
    assert "not like any known mistake" not in str(rep)


def test_a_real_mistake_is_not_called_a_convention():
    rep = mhattn.check_prototype(no_scaling)
    assert not rep.standard_ok and rep.mistakes == ("no_scaling",)
    assert STANDARD not in str(rep)


# ------------------------------------------------------------ no internal names

def ellipsis_body(x, w_q, w_k, w_v, w_o, num_heads):
    ...


def raises_value_error(*args, **kw):
    raise ValueError("my shapes are wrong")


class LearnersOwnError(Exception):
    pass


def raises_own_error_fn(*args, **kw):
    raise LearnersOwnError("oops")


BAD = {
    "none": lambda *a, **k: None,
    "ellipsis_body": ellipsis_body,
    "wrong_shape": lambda *a, **k: np.zeros((2, 7)),
    "scalar": lambda *a, **k: 1.0,
    "tuple_of_numbers": lambda *a, **k: (1, 2, 3),
    "empty_tuple": lambda *a, **k: (),
    "tuple_of_none": lambda *a, **k: (None, None),
    "list_of_arrays": lambda *a, **k: [np.zeros((3, 2)), np.zeros((3, 2))],
    "ragged_list": lambda *a, **k: [np.zeros(2), np.zeros(3)],
    "string": lambda *a, **k: "abc",
    "dict_without_output": lambda *a, **k: {"weights": 1},
    "object_array": lambda *a, **k: np.ones((2, 2), object),
    "complex_array": lambda *a, **k: np.ones((2, 2), complex),
    "generator": lambda *a, **k: (i for i in range(3)),
    "raises": raises_value_error,
    "raises_own_error": raises_own_error_fn,
    "takes_nothing": lambda: 1,
}

_INTERNAL = re.compile(r"(?<![\w.])_[A-Za-z]\w*")


def _texts(rep):
    yield str(rep)
    yield repr(rep)
    yield rep._repr_html_()
    yield rep.title
    yield rep.explanation
    yield from rep.hints
    for t in rep.trials:
        yield t.describe()
        yield t.error or ""


@pytest.mark.parametrize("name", list(BAD))
@pytest.mark.parametrize("which", ["layer", "attention"])
def test_no_internal_name_in_any_message(which, name):
    check = mhattn.check_prototype if which == "layer" else mhattn.check_attention_prototype
    rep = check(BAD[name], trials=1)
    assert not rep.ok
    for text in _texts(rep):
        found = _INTERNAL.findall(text)
        assert not found, (found, text)
        assert "BadReturn" not in text, text


@pytest.mark.parametrize("which, shape", [("layer", "(T, d_out)"),
                                          ("attention", "(h, T_q, d_v)")])
def test_returning_none_says_what_to_return(which, shape):
    check = mhattn.check_prototype if which == "layer" else mhattn.check_attention_prototype
    for fn in (BAD["none"], ellipsis_body) if which == "layer" else (BAD["none"],):
        rep = check(fn)
        assert "returned None" in rep.title, rep.title
        assert "not like any known mistake" not in rep.title
        assert all(t.status == "returned" for t in rep.trials)
        assert all(t.describe().startswith("returned None instead of an output of shape")
                   for t in rep.trials)
        assert f"must return the output array of shape {shape}" in rep.explanation
        assert "return statement" in rep.explanation


def test_other_returns_are_named_in_plain_words():
    rep = mhattn.check_prototype(BAD["string"])
    assert rep.trials[0].error.startswith("your function returned a str; it must return "
                                          "the output array of shape (T, d_out) = (3, 4), "
                                          "an array of real numbers")
    assert rep.trials[0].describe() == "returned a str instead of an output of shape (3, 4)"
    rep = mhattn.check_prototype(BAD["dict_without_output"])
    assert "returned a dict without an 'output' (or 'out') key" in rep.trials[0].error
    assert "['weights']" in rep.trials[0].error
    rep = mhattn.check_prototype(BAD["ragged_list"])
    assert "returned a list that NumPy cannot read as one array" in rep.trials[0].error
    rep = mhattn.check_prototype(BAD["raises"])
    assert rep.title == "your function raised ValueError on every trial"
    assert "ValueError: my shapes are wrong" in str(rep)
    rep = mhattn.check_prototype(BAD["raises_own_error"])
    assert "LearnersOwnError: oops" in str(rep)
