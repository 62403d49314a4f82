"""Strided, transposed, read-only and odd arrays; inputs are never modified."""
import numpy as np
import pytest

import mhattn
from conftest import tol

DTYPES = [np.float32, np.float64]


def _inputs(rng, dtype):
    x = rng.standard_normal((2, 5, 6)).astype(dtype)
    w_q = rng.standard_normal((6, 6)).astype(dtype)
    w_k = rng.standard_normal((6, 6)).astype(dtype)
    w_v = rng.standard_normal((6, 6)).astype(dtype)
    w_o = rng.standard_normal((6, 3)).astype(dtype)
    mask = rng.random((5, 5)) > 0.3
    return x, w_q, w_k, w_v, w_o, mask


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_transposed_and_fortran(rng, dtype):
    x, w_q, w_k, w_v, w_o, mask = _inputs(rng, dtype)
    want = mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads=3, mask=mask)
    # Every input as a non-contiguous view with the same values.
    big = np.zeros((2, 10, 12), dtype)
    big[:, ::2, ::2] = x
    xs = big[:, ::2, ::2]
    wqt = np.ascontiguousarray(w_q.T).T            # transposed view
    wkf = np.asfortranarray(w_k)
    wvr = w_v[::-1][::-1]                          # negative strides twice
    wor = np.ascontiguousarray(w_o[::-1])[::-1]    # negative-stride view
    maskt = np.ascontiguousarray(mask.T).T
    assert not xs.flags.c_contiguous and wor.strides[0] < 0
    got = mhattn.multi_head_attention(xs, wqt, wkf, wvr, wor, num_heads=3, mask=maskt)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_read_only_inputs(rng, dtype):
    args = _inputs(rng, dtype)
    for a in args:
        a.flags.writeable = False
    x, w_q, w_k, w_v, w_o, mask = args
    out, w = mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads=3, mask=mask,
                                         return_weights=True)
    assert out.flags.writeable and out.flags.c_contiguous and out.flags.owndata


@pytest.mark.parametrize("form", ["fused", "stacked", "list"])
def test_inputs_are_not_modified(rng, form):
    x, w_q, w_k, w_v, w_o, mask = _inputs(rng, np.float32)
    b = [rng.standard_normal(6).astype(np.float32) for _ in range(3)]
    if form == "stacked":
        w_q, w_k, w_v = (w.reshape(6, 3, 2).transpose(1, 0, 2) for w in (w_q, w_k, w_v))
    elif form == "list":
        w_q, w_k, w_v = ([w[:, 2 * i:2 * i + 2] for i in range(3)] for w in (w_q, w_k, w_v))
    kw = dict(num_heads=3) if form == "fused" else {}
    args = [x, w_q, w_k, w_v, w_o]
    flat = lambda a: a if isinstance(a, np.ndarray) else np.stack(a)  # noqa: E731
    before = [flat(a).copy() for a in args] + [mask.copy()] + [v.copy() for v in b]
    for dt in (None, np.float64):  # float64 output forces conversion copies too
        xx = x if dt is None else x.astype(dt)
        out = mhattn.multi_head_attention(xx, *args[1:], mask=mask, b_o=b[0][:3],
                                          return_weights=True, **kw)
        out[0][...] = 7  # writing to the output must not reach any input
    after = [flat(a) for a in args] + [mask] + b
    for u, v in zip(before, after):
        np.testing.assert_array_equal(u, v)


def test_output_never_aliases_input():
    x = np.ones((3, 4))
    eye = np.eye(4)
    out = mhattn.multi_head_attention(x, eye, eye, eye, num_heads=1)
    assert not np.shares_memory(out, x)


def test_unaligned_and_byteswapped(rng):
    x, w_q, w_k, w_v, w_o, mask = _inputs(rng, np.float64)
    want = mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads=3)
    raw = np.zeros(x.nbytes + 1, np.uint8)
    xu = raw[1:].view(np.float64).reshape(x.shape)
    xu[...] = x
    assert not xu.flags.aligned
    swapped = w_q.astype(w_q.dtype.newbyteorder(">" if np.little_endian else "<"))
    got = mhattn.multi_head_attention(xu, swapped, w_k, w_v, w_o, num_heads=3)
    np.testing.assert_array_equal(got, want)


def test_float_mask_any_layout(rng):
    x, w_q, w_k, w_v, w_o, _ = _inputs(rng, np.float32)
    m = rng.standard_normal((3, 1, 5)).astype(np.float64)  # broadcast over B and Tq
    got = mhattn.multi_head_attention(x, w_q, w_k, w_v, num_heads=3, mask=m[:, :, ::-1])
    want = mhattn.reference.multi_head_attention(x, w_q, w_k, w_v, num_heads=3,
                                                 mask=np.ascontiguousarray(m[:, :, ::-1]))
    np.testing.assert_allclose(got, want, **tol(np.float32))
