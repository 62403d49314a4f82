"""Hostile callers, round 2: every bad argument is refused with a TypeError
or ValueError whose message starts with the argument's name."""
import numpy as np
import pytest

import mhattn


def _never(*a, **k):
    raise AssertionError("not to be called")


@pytest.mark.parametrize("check", [mhattn.check_prototype,
                                   mhattn.check_attention_prototype])
@pytest.mark.parametrize("dtype", ["abc", 0, True, 3.5, [1.0], np.ones(3)])
def test_checker_dtype_named(check, dtype):
    with pytest.raises(TypeError, match=r"^dtype: expected float32 or float64"):
        check(_never, dtype=dtype)


def test_checker_all_nan_not_called_overflow():
    fn = lambda q, k, v, **kw: np.full(q.shape[:-1] + v.shape[-1:], np.nan)
    report = mhattn.check_attention_prototype(fn)
    assert not report.ok
    assert report.mistake is None and report.mistakes == ()
    assert "NaN" in report.title
    assert "row maximum" not in str(report)
