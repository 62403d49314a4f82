"""The checker's reports speak the learner's language.

- A prototype that returns None, a wrong shape, a tuple, a list, a string,
  or raises, gets a report with no internal name in it (no name starting
  with "_": str, repr, the HTML, the hints and every trial's line).
"""
import re

import numpy as np
import pytest

import mhattn


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
