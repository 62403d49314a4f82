"""The small-call fast path (mhattn._api._fast_path) against the full path.

So far: the glue's broadcasting of the mask, which the fast path relies on.
"""
import numpy as np
import pytest

from mhattn import _C


def assert_same(a, b):
    """Bitwise: same type, shapes, dtypes and bits (NaNs included)."""
    if isinstance(b, tuple):
        assert isinstance(a, tuple) and len(a) == len(b)
        for p, q in zip(a, b):
            assert_same(p, q)
        return
    assert type(a) is np.ndarray and type(b) is np.ndarray
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.flags.c_contiguous and a.flags.writeable
    assert a.tobytes() == b.tobytes()


MASK_SHAPES = [(), (3,), (1,), (3, 3), (1, 3), (3, 1), (2, 3, 3), (2, 1, 3),
               (1, 3, 3), (4, 1, 1, 3), (4, 2, 3, 3), (1, 1, 1, 1), (4, 1, 3, 1)]


@pytest.mark.parametrize("shape", MASK_SHAPES)
@pytest.mark.parametrize("kind", ["bool", "add"])
def test_glue_broadcasts_the_mask_as_numpy_does(rng, shape, kind):
    B, H, Tq, Tk = 4, 2, 3, 3
    x = rng.standard_normal((B, Tq, 4))
    w = rng.standard_normal((4, 4))
    dk = np.array([2, 2])
    if kind == "bool":
        m = np.asarray(rng.random(shape) < 0.6)
    else:
        m = np.asarray(np.where(rng.random(shape) < 0.6, 0.0, -np.inf) + rng.random(shape))
    args = dict(x=x, key=x, value=x, wq=w, wk=w, wv=w, wo=w, bq=None, bk=None, bv=None,
                bo=None, dk=dk, dv=dk, scales=np.ones(2), causal=False,
                key_lengths=None, want_weights=True, keep=False)
    got = _C.forward(mask=m, **args)
    want = _C.forward(mask=np.broadcast_to(m, (B, H, Tq, Tk)), **args)
    assert_same(got[:2], want[:2])


@pytest.mark.parametrize("shape", [(2,), (3, 2), (3, 3, 3), (5, 2, 3, 3), (1, 4, 2, 3, 3)])
def test_glue_rejects_masks_that_do_not_broadcast(rng, shape):
    x = rng.standard_normal((4, 3, 4))
    w = rng.standard_normal((4, 4))
    dk = np.array([2, 2])
    with pytest.raises(ValueError, match="mask"):
        _C.forward(x, x, x, w, w, w, None, None, None, None, None, dk, dk, np.ones(2),
                   np.ones(shape, bool), False, None, False, False)
