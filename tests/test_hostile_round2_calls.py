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


# -- attention_grad: out and lse are checked, and go together ----------------

def _qkv():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 4)),
            rng.standard_normal((2, 5, 4)))


@pytest.mark.parametrize("name", ["lse", "out"])
def test_attention_grad_lone_partner_checked(name):
    q, k, v = _qkv()
    out = mhattn.attention(q, k, v)
    with pytest.raises(TypeError, match=rf"^{name}: "):
        mhattn.attention_grad(out, q, k, v, **{name: "a"})


@pytest.mark.parametrize("given, missing", [("lse", "out"), ("out", "lse")])
def test_attention_grad_missing_partner_named(given, missing):
    q, k, v = _qkv()
    out, lse = mhattn.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=rf"^{missing}: required with {given}"):
        mhattn.attention_grad(out, q, k, v, **{given: {"out": out, "lse": lse}[given]})


def test_attention_packed_cross_message_says_q_and_k():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^key_cu_seqlens: .*\(k has 5 rows, q has 3\)"):
        mhattn.attention(q, k, v, cu_seqlens=[0, 3])


# -- packed weights: num_heads / num_kv_heads checked as the unpacked call's ---

@pytest.mark.parametrize("name, value, heads", [
    ("num_heads", 2.0, 2), ("num_heads", np.array(2), 2),
    ("num_heads", np.array([[2.0]]), 2), ("num_heads", True, 1),
    ("num_heads", np.ones(3), 2), ("num_kv_heads", 2.0, 2)])
def test_packed_head_counts_checked(name, value, heads):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4))
    w = [rng.standard_normal((4, 4)) for _ in range(4)]
    packed = mhattn.pack_weights(*w, num_heads=heads)
    with pytest.raises(TypeError, match=rf"^{name}: expected a positive integer"):
        mhattn.multi_head_attention(x, packed, **{name: value})


# -- KVCache.check_room: counts checked and named ------------------------------

@pytest.mark.parametrize("counts, exc", [
    ("a", TypeError), ([1, 1, 1], ValueError), (None, TypeError),
    (np.ones((2, 1), int), ValueError), (-1, ValueError), ([1, -2], ValueError),
    (True, TypeError), ([1.5, 2.0], TypeError)])
def test_check_room_counts_named(counts, exc):
    cache = mhattn.KVCache(2, 1, 8, 4)
    with pytest.raises(exc, match=r"^counts: "):
        cache.check_room(counts)


@pytest.mark.parametrize("counts", [9, 2 ** 70, [1, 2 ** 70], np.array([0, 9])])
def test_check_room_past_capacity_named(counts):
    cache = mhattn.KVCache(2, 1, 8, 4)
    with pytest.raises(ValueError, match=r"^k_new: appending .* exceeds the cache's capacity 8"):
        cache.check_room(counts)
    assert list(cache.lengths) == [0, 0]


def test_check_room_room_is_fine():
    cache = mhattn.KVCache(2, 1, 8, 4)
    cache.check_room(8)
    cache.check_room([0, 8])
    cache.check_room(np.array([3, 4], np.uint8))


# -- reference.projected_attention: checked and refused as mhattn.attention ----

def test_reference_projected_bad_q_named():
    from mhattn import reference
    q = np.ones((2, 3, 4))
    with pytest.raises(ValueError, match=r"^q: expected a 4-D"):
        reference.projected_attention(np.ones((3, 4)), q, q)


def test_reference_projected_bad_layout_named():
    from mhattn import reference
    q = np.ones((2, 3, 4))
    with pytest.raises(ValueError, match=r"^layout: expected 'bhtd'"):
        reference.projected_attention(q, q, q, layout="x")


@pytest.mark.parametrize("name", ["rope", "q_norm"])
def test_reference_projected_refuses_what_attention_refuses(name):
    from mhattn import reference
    q = np.ones((2, 3, 4))
    value = mhattn.RoPE() if name == "rope" else np.ones(4)
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{name}'"):
        mhattn.attention(q, q, q, **{name: value})
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{name}'"):
        reference.projected_attention(q, q, q, **{name: value})
