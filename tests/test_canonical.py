"""The canonicaliser (mhattn._internal.core): its fast branch validates by its own
checks, so that the glue never rejects a call it takes, and errors raised
during the glue's call (a user's SIGINT handler's, say) reach the caller
instead of being taken for a malformed call and retried on the full path
(tests/test_interrupt.py raises one from a real handler).
"""
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mhattn
from mhattn import _C
from mhattn._internal import core as _core
from test_fast_path import assert_same, fast_path, full_path


@st.composite
def near_canonical_calls(draw):
    """Calls of plain arrays of one dtype in the fast branch's forms whose
    sizes are drawn independently, so that many of them disagree."""
    dt = draw(st.sampled_from([np.float32, np.float64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = st.integers(1, 4)

    def arr(*shape):
        return rng.standard_normal(shape).astype(dt)

    lead = draw(st.sampled_from([(), (1,), (2,)]))
    kw = dict(num_heads=draw(st.sampled_from([1, 2, 4])))
    if draw(st.booleans()):
        kw["num_kv_heads"] = draw(st.sampled_from([1, 2]))
    x = arr(*lead, draw(n), draw(n))
    if draw(st.booleans()):
        kw["key"] = arr(*draw(st.sampled_from([lead, (1,), (3,)])), draw(n), draw(n))
    if draw(st.booleans()):
        kw["value"] = arr(*draw(st.sampled_from([lead, (3,)])), draw(n), draw(n))

    def weight():
        form = draw(st.sampled_from(["fused", "stacked", "list"]))
        rows = draw(n)
        if form == "fused":
            return arr(rows, draw(st.integers(1, 8)))
        if form == "stacked":
            return arr(draw(n), rows, draw(n))
        return [arr(rows, draw(n)) for _ in range(draw(n))]

    w_q, w_k, w_v = weight(), weight(), weight()
    w_o = arr(draw(st.integers(1, 8)), draw(n)) if draw(st.booleans()) else None
    for name in ("b_q", "b_k", "b_v", "b_o"):
        if draw(st.integers(0, 3)) == 0:
            kw[name] = arr(*draw(st.sampled_from([(draw(st.integers(1, 8)),),
                                                  (draw(n), draw(n))])))
    if draw(st.booleans()):
        shape = tuple(draw(st.lists(st.integers(1, 4), max_size=len(lead) + 3)))
        kw["mask"] = (rng.random(shape) < 0.8 if draw(st.booleans())
                      else np.where(rng.random(shape) < 0.8, 0.0, -np.inf).astype(dt))
    if draw(st.booleans()):
        if lead:
            kw["key_lengths"] = rng.integers(-1, 5, size=draw(st.sampled_from([lead, (3,)])))
        else:
            kw["key_lengths"] = draw(st.integers(-1, 5))
    kw["return_weights"] = draw(st.booleans())
    kw["causal"] = draw(st.booleans())
    return (x, w_q, w_k, w_v, w_o), kw


def _outcome(f, *args, **kw):
    try:
        return f(*args, **kw), None
    except Exception as e:   # noqa: BLE001 - the error is the result
        return None, (type(e), str(e))


@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(near_canonical_calls())
def test_glue_accepts_whatever_the_fast_branch_takes(case):
    args, kw = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # an all-False mask warns
        fast, fast_error = _outcome(fast_path, *args, **kw)
        full, full_error = _outcome(full_path, *args, **kw)
        public, public_error = _outcome(mhattn.multi_head_attention, *args, **kw)
    assert fast_error is None, "the glue rejected a call the fast branch took"
    assert public_error == full_error
    if fast is not None:
        assert full_error is None
        assert_same(fast, full)
    if full_error is None:
        assert_same(public, full)


def test_an_error_during_the_glue_call_is_not_retried(monkeypatch):
    """A ValueError raised while _C.forward runs (here by a stand-in; in
    life by a SIGINT handler) propagates, and the call is not run again."""
    x = np.ones((3, 4))
    w = np.ones((4, 4))
    assert _core.fast(x, w, w, w, None, 2, None, None, None, False, None, False, None,
                       None, None, None, None, None) is not None
    for exc in (ValueError, TypeError):
        calls = []

        def forward(*args, exc=exc, calls=calls):
            calls.append(args)
            raise exc("raised by the signal handler")

        monkeypatch.setattr(_core, "forward", forward)   # the door to _C.forward
        with pytest.raises(exc, match="raised by the signal handler"):
            mhattn.multi_head_attention(x, w, w, w, num_heads=2)
        assert len(calls) == 1
