"""Bad input raises a clear ValueError/TypeError naming the argument."""
import numpy as np
import pytest

import mhattn
from mhattn import reference

X = np.ones((3, 4))
W = np.ones((4, 4))
W3 = np.ones((2, 4, 2))
WL = [np.ones((4, 2)), np.ones((4, 2))]


def call(*args, **kw):
    return mhattn.multi_head_attention(*args, **kw)


CASES = [
    # (args, kwargs, exception, words the message must contain)
    ((np.ones(4), W, W, W), dict(num_heads=2), ValueError, ["x", "(4,)"]),
    ((np.ones((1, 1, 3, 4)), W, W, W), dict(num_heads=2), ValueError, ["x", "(1, 1, 3, 4)"]),
    ((np.float64(1.0), W, W, W), dict(num_heads=2), ValueError, ["x", "()"]),
    ((X, W, W, W), {}, ValueError, ["w_q", "num_heads", "(4, 4)"]),
    ((X, W, W, W), dict(num_heads=3), ValueError, ["num_heads=3", "4"]),
    ((X, W, W, W), dict(num_heads=0), ValueError, ["num_heads"]),
    ((X, W, W, W), dict(num_heads=-2), ValueError, ["num_heads"]),
    ((X, W, W, W), dict(num_heads=2.0), TypeError, ["num_heads"]),
    ((X, W, W, W), dict(num_heads=10 ** 9), ValueError, ["num_heads"]),
    ((X, W3, W3, W3), dict(num_heads=3), ValueError, ["w_q", "3"]),
    ((X, [], W3, W3), {}, ValueError, ["w_q", "empty"]),
    ((X, WL, WL + WL[:1], WL), {}, ValueError, ["w_k", "3 heads"]),
    ((X, WL, WL, WL[:1]), {}, ValueError, ["w_v", "1 heads"]),
    ((X, [np.ones((5, 2))] * 2, WL, WL), {}, ValueError, ["w_q", "5", "4"]),
    ((X, [np.ones((4, 2)), np.ones((3, 2))], WL, WL), {}, ValueError, ["w_q", "(3, 2)"]),
    ((X, [np.ones((4, 3))] * 2, WL, WL), {}, ValueError, ["w_q", "w_k", "width"]),
    ((X, WL, WL, WL, np.ones((5, 4))), {}, ValueError, ["w_o", "(5, 4)", "4"]),
    ((X, WL, WL, WL, np.ones(4)), {}, ValueError, ["w_o", "(4,)"]),
    ((np.ones((2, 3, 4)), WL, WL, WL), dict(key=np.ones((3, 3, 4))), ValueError,
     ["key", "batch", "3", "2"]),
    ((np.ones((2, 3, 4)), WL, WL, WL), dict(key=np.ones((3, 4))), ValueError, ["key", "3-D"]),
    ((X, WL, WL, WL), dict(key=np.ones((5, 4)), value=np.ones((6, 4))), ValueError,
     ["value", "6", "5"]),
    ((X, WL, WL, WL), dict(key=np.ones((5, 3))), ValueError, ["w_k", "3"]),
    ((X.astype(complex), WL, WL, WL), {}, TypeError, ["x", "complex"]),
    ((X.astype(bool), WL, WL, WL), {}, TypeError, ["x", "bool"]),
    ((X.astype(object), WL, WL, WL), {}, TypeError, ["x", "object"]),
    ((X.astype(str), WL, WL, WL), {}, TypeError, ["x"]),
    (("hello", WL, WL, WL), {}, TypeError, ["x"]),
    ((None, WL, WL, WL), {}, TypeError, ["x", "None"]),
    ((X, WL, None, WL), {}, TypeError, ["w_k", "None"]),
    ((X, WL, WL, [np.ones((4, 2)), "a"]), {}, TypeError, ["w_v[1]"]),
    ((X, WL, WL, WL), dict(scale="big"), TypeError, ["scale"]),
    ((X, WL, WL, WL), dict(causal=1), TypeError, ["causal"]),
    ((X, WL, WL, WL), dict(b_o=np.ones(3)), ValueError, ["b_o", "(3,)", "4"]),
    ((X, object(), WL, WL), {}, TypeError, ["w_q"]),
    (([[1, 2], [3]], WL, WL, WL), {}, TypeError, ["x"]),
]


@pytest.mark.parametrize("impl", [call, reference.multi_head_attention])
@pytest.mark.parametrize("args,kw,exc,words", CASES)
def test_bad_input_raises_clear_error(impl, args, kw, exc, words):
    with pytest.raises(exc) as info:
        impl(*args, **kw)
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


def test_glue_rechecks_shapes():
    """The extension may be called alone: it must raise, not crash."""
    from mhattn import _C
    x = np.ones((1, 3, 4))
    w = np.ones((4, 4))
    dk = np.array([2, 2])
    sc = np.ones(2)
    good = dict(x=x, key=x, value=x, wq=w, wk=w, wv=w, wo=None, bq=None, bk=None,
                bv=None, bo=None, dk=dk, dv=dk, scales=sc, mask=None, causal=False,
                key_lengths=None, variants=None, want_weights=False, keep=False)
    out, _, _ = _C.forward(**good)
    assert out.shape == (1, 3, 4)
    bad = [dict(wq=np.ones((4, 5))), dict(wk=np.ones((3, 4))), dict(x=np.ones((3, 4))),
           dict(dk=np.array([2, 3])), dict(scales=np.ones(3)), dict(wo=np.ones((3, 3))),
           dict(bq=np.ones(3)), dict(mask=np.ones((1, 2, 3, 2), bool)),
           dict(key_lengths=np.array([9])), dict(x=x.astype(np.float32)),
           dict(x=x.astype(complex)), dict(dv=np.array([0, 4])),
           dict(key=np.ones((2, 3, 4))), dict(x="nope")]
    for change in bad:
        with pytest.raises((ValueError, TypeError)):
            _C.forward(**{**good, **change})
