"""mhattn.KVCache and the cached step, multi_head_attention(x_new, ..., cache=)
and layer(x_new, cache=) (issue 17).

A step-by-step decode through the cache equals one causal call over the
whole sequence, to rounding; so do a prefill then chunks of 3, ragged
batches, RoPE with k_norm (the new keys at positions lengths[b] + i) and
the score variants.  Bad input raises ValueError naming the argument and
leaves the cache unchanged.
"""
import pickle

import numpy as np
import pytest

import mhattn

D, H, G, DK = 16, 4, 2, 4
TOL = {np.float64: dict(rtol=1e-10, atol=1e-11), np.float32: dict(rtol=2e-5, atol=2e-6)}


def _layer(dtype, **kw):
    rng = np.random.default_rng(0)
    layer = mhattn.MultiHeadAttention(D, H, num_kv_heads=G, bias=True, dtype=dtype, seed=1,
                                      **kw)
    for name in ("b_q", "b_k", "b_v", "b_o", "sinks", "q_norm", "k_norm"):
        a = getattr(layer, name)
        if a is not None:
            a += (0.5 * rng.standard_normal(a.shape)).astype(dtype)
    return layer


def _state(cache):
    return (cache.lengths.copy(), cache.key_storage.copy(), cache.value_storage.copy())


def _unchanged(cache, state):
    lengths, keys, values = state
    assert (cache.lengths == lengths).all()
    assert (cache.key_storage == keys).all() and (cache.value_storage == values).all()


# --- the cache itself --------------------------------------------------------

def test_append_views_reset_and_memory():
    cache = mhattn.KVCache(2, G, 10, DK, 3, dtype=np.float64)
    assert cache.key_storage.shape == (2, G, 10, DK)
    assert cache.value_storage.shape == (2, G, 10, 3)
    assert cache.nbytes == 2 * G * 10 * (DK + 3) * 8 + 2 * 8
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, G, 4, DK)), rng.standard_normal((2, G, 4, 3))
    cache.append(k, v)
    cache.append(k[:, :, :3], v[:, :, :3], lengths=[3, 1])           # ragged
    assert cache.lengths.tolist() == [7, 5]
    assert cache.keys.shape == (2, G, 7, DK) and cache.values.shape == (2, G, 7, 3)
    np.testing.assert_array_equal(cache.keys[0], np.concatenate([k[0], k[0, :, :3]], 1))
    np.testing.assert_array_equal(cache.values[1, :, :5], np.concatenate(
        [v[1], v[1, :, :1]], 1))
    with pytest.raises(ValueError):
        cache.lengths[0] = 3                                         # read-only
    cache.reset()
    assert cache.lengths.tolist() == [0, 0] and cache.keys.shape[2] == 0


def test_pickling_round_trips():
    cache = mhattn.KVCache(2, G, 64, DK)
    rng = np.random.default_rng(1)
    kv = rng.standard_normal((2, G, 5, DK)).astype(np.float32)
    cache.append(kv, kv, lengths=np.array([5, 2]))
    data = pickle.dumps(cache)
    assert len(data) < cache.nbytes                 # only the filled rows are saved
    back = pickle.loads(data)
    assert repr(back) == repr(cache)
    np.testing.assert_array_equal(back.keys, cache.keys)
    np.testing.assert_array_equal(back.values, cache.values)
    back.append(kv, kv)                              # and it still works
    assert back.lengths.tolist() == [10, 7] and cache.lengths.tolist() == [5, 2]


@pytest.mark.parametrize("k_shape, v_shape, dtype, kw, name", [
    ((2, 3, 1, DK), (2, 3, 1, DK), np.float32, {}, "k_new:"),      # head count
    ((2, G, 1, DK + 1), (2, G, 1, DK), np.float32, {}, "k_new:"),  # width
    ((3, G, 1, DK), (3, G, 1, DK), np.float32, {}, "k_new:"),      # batch
    ((2, G, DK), (2, G, DK), np.float32, {}, "k_new:"),            # ndim
    ((2, G, 1, DK), (2, G, 1, DK - 1), np.float32, {}, "v_new:"),
    ((2, G, 2, DK), (2, G, 1, DK), np.float32, {}, "v_new:"),
    ((2, G, 1, DK), (2, G, 1, DK), np.float64, {}, "k_new:"),      # dtype
    ((2, G, 1, DK), (2, G, 1, DK), np.int32, {}, "k_new:"),
    ((2, G, 9, DK), (2, G, 9, DK), np.float32, {}, "k_new:"),      # past capacity
    ((2, G, 2, DK), (2, G, 2, DK), np.float32, dict(lengths=[1, 3]), "lengths:"),
    ((2, G, 2, DK), (2, G, 2, DK), np.float32, dict(lengths=[1]), "lengths:"),
])
def test_bad_appends_raise_and_change_nothing(k_shape, v_shape, dtype, kw, name):
    cache = mhattn.KVCache(2, G, 8, DK)
    one = np.ones((2, G, 2, DK), np.float32)
    cache.append(one, one)
    state = _state(cache)
    with pytest.raises(ValueError) as e:
        cache.append(np.zeros(k_shape, dtype), np.zeros(v_shape, dtype), **kw)
    assert str(e.value).startswith(name), str(e.value)
    _unchanged(cache, state)


@pytest.mark.parametrize("args, name", [
    ((0, G, 8, DK), "batch:"), ((1, G, -1, DK), "capacity:"), ((1, G, 8, 2.5), "d_k:"),
    ((1, True, 8, DK), "num_kv_heads:")])
def test_bad_construction(args, name):
    with pytest.raises(ValueError, match="^" + name):
        mhattn.KVCache(*args)
    with pytest.raises(ValueError, match="^dtype:"):
        mhattn.KVCache(1, 1, 1, 1, dtype=np.int64)


# --- the cached step ---------------------------------------------------------

VARIANTS = {
    "plain": {},
    "rope_knorm": dict(rope=mhattn.RoPE(), qk_norm=True),
    "rope_partial_interleaved": dict(rope=mhattn.RoPE(500.0, rotary_dim=2, interleaved=True)),
    "window_alibi_softcap": dict(window=(2, 0), softcap=4.0,
                                 alibi_slopes=np.array([0.1, 0.2, 0.4, 0.8])),
    "sinks_per_head_norm": dict(sinks=True, qk_norm="per_head", rope=mhattn.RoPE()),
}
_OWNED = ("qk_norm", "sinks")


def _split(kw):
    """(layer keywords, call keywords)."""
    return ({n: kw[n] for n in _OWNED if n in kw},
            {n: a for n, a in kw.items() if n not in _OWNED})


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_decode_step_by_step_equals_one_causal_call(variant, dtype):
    own, kw = _split(VARIANTS[variant])
    layer = _layer(dtype, **own)
    x = np.random.default_rng(2).standard_normal((2, 9, D)).astype(dtype)
    full = layer(x, causal=True, **kw)
    cache = mhattn.KVCache(2, G, 12, DK, dtype=dtype)
    steps = [layer(x[:, i:i + 1], causal=True, cache=cache, **kw) for i in range(9)]
    assert cache.lengths.tolist() == [9, 9]
    got = np.concatenate(steps, axis=1)
    assert got.dtype == dtype
    np.testing.assert_allclose(got, full, **TOL[dtype])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_then_chunks_of_3(isa, variant):
    own, kw = _split(VARIANTS[variant])
    layer = _layer(np.float64, **own)
    x = np.random.default_rng(3).standard_normal((2, 14, D))
    full = layer(x, causal=True, **kw)
    cache = mhattn.KVCache(2, G, 14, DK, dtype=np.float64)
    parts = [layer(x[:, :5], causal=True, cache=cache, **kw)]
    parts += [layer(x[:, i:i + 3], causal=True, cache=cache, **kw) for i in range(5, 14, 3)]
    np.testing.assert_allclose(np.concatenate(parts, axis=1), full, **TOL[np.float64])
    # The cache holds the keys as the attention used them: after k_norm and
    # RoPE at their own positions, as the projections of the whole call.
    assert cache.lengths.tolist() == [14, 14]


@pytest.mark.parametrize("variant", ["plain", "rope_knorm", "window_alibi_softcap",
                                     "sinks_per_head_norm"])
def test_ragged_batch(variant):
    own, kw = _split(VARIANTS[variant])
    layer = _layer(np.float64, **own)
    rng = np.random.default_rng(4)
    prompts = [6, 2, 4]
    x = rng.standard_normal((3, 11, D))
    cache = mhattn.KVCache(3, G, 16, DK, dtype=np.float64)
    pre = layer(x[:, :6], causal=True, cache=cache, new_lengths=prompts, **kw)
    assert cache.lengths.tolist() == prompts
    for b, n in enumerate(prompts):
        assert (pre[b, n:] == 0).all()
    steps = []
    for t in range(3):      # decode one token per sequence, then a chunk of 2
        rows = np.stack([x[b, n + t] for b, n in enumerate(prompts)])[:, None]
        steps.append(layer(rows, causal=True, cache=cache, **kw))
    rows = np.stack([x[b, n + 3:n + 5] for b, n in enumerate(prompts)])
    steps.append(layer(rows, causal=True, cache=cache, **kw))
    got = np.concatenate(steps, axis=1)
    for b, n in enumerate(prompts):
        full = layer(x[b, :n + 5], causal=True, **kw)
        np.testing.assert_allclose(pre[b, :n], full[:n], **TOL[np.float64])
        np.testing.assert_allclose(got[b], full[n:], **TOL[np.float64])


def test_unbatched_functional_form_and_weights():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, D))
    w_q, w_k, w_v = (rng.standard_normal((D, n * DK)) for n in (H, G, G))
    w_o = rng.standard_normal((H * DK, D))
    kw = dict(num_heads=H, num_kv_heads=G, causal=True, rope=mhattn.RoPE(),
              k_norm=np.ones(DK) * 1.5)
    full, full_w = mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, return_weights=True,
                                               **kw)
    cache = mhattn.KVCache(1, G, 8, DK, dtype=np.float64)
    a = mhattn.multi_head_attention(x[:4], w_q, w_k, w_v, w_o, cache=cache, **kw)
    b, wts = mhattn.multi_head_attention(x[4:], w_q, w_k, w_v, w_o, cache=cache,
                                         return_weights=True, **kw)
    np.testing.assert_allclose(np.concatenate([a, b]), full, **TOL[np.float64])
    assert wts.shape == (H, 2, 8)
    np.testing.assert_allclose(wts[:, :, :6], full_w[:, 4:], **TOL[np.float64])
    assert (wts[:, :, 6:] == 0).all()
    # The cache's keys are the projected keys after k_norm and RoPE.
    t = mhattn.trace(x, w_q, w_k, w_v, w_o, **kw)
    np.testing.assert_allclose(cache.keys[0, 0], t.k[0], **TOL[np.float64])


def test_bad_cached_steps_raise_and_change_nothing():
    layer = _layer(np.float32)
    x = np.ones((2, 3, D), np.float32)
    cache = mhattn.KVCache(2, G, 8, DK)
    layer(x, causal=True, cache=cache)
    state = _state(cache)
    cases = [
        (dict(cache=mhattn.KVCache(2, G + 2, 8, DK)), "cache:"),       # head count
        (dict(cache=mhattn.KVCache(2, G, 8, DK + 1)), "cache:"),       # width
        (dict(cache=mhattn.KVCache(3, G, 8, DK)), "cache:"),           # batch
        (dict(cache=mhattn.KVCache(2, G, 8, DK, dtype=np.float64)), "cache:"),
        (dict(cache=cache, mask=np.ones((3, 6), bool)), "mask:"),
        (dict(cache=cache, key_lengths=np.array([1, 1])), "key_lengths:"),
        (dict(cache=cache, key_mask=np.ones(6, bool)), "key_mask:"),
        (dict(cache=cache, return_context=True), "return_context:"),
        (dict(cache=cache, new_lengths=[1, 2], causal=False), "new_lengths:"),
        (dict(cache=cache, new_lengths=[4, 2]), "new_lengths:"),
    ]
    for kw, name in cases:
        kw.setdefault("causal", True)
        with pytest.raises(ValueError) as e:
            layer(x, **kw)
        assert str(e.value).startswith(name), (kw, str(e.value))
        _unchanged(cache, state)
    with pytest.raises(ValueError, match="^x:.*capacity"):
        layer(np.ones((2, 6, D), np.float32), causal=True, cache=cache)
    _unchanged(cache, state)
    with pytest.raises(ValueError, match="^new_lengths:"):
        layer(x, new_lengths=[1, 1])
    with pytest.raises(TypeError, match="^cache:"):
        layer(x, cache=object())
