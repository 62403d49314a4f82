"""Block masks (issue 39, item 1): ``mhattn.BlockMask`` as ``block_mask=``.

A BlockMask is the same pattern as a dense bool mask, stored as empty,
full and partial blocks; the core skips the empty ones and tests no element
of the full ones. Skipping a block that the dense path computes as all
-inf changes no sum (its exps are exact zeros, added to sums they leave
as they are; the columns kept stay in their vector lanes), so every result
is held **bitwise** to the same call with ``mask=bm.to_dense()``: on
document, prefix-LM, dilated, random sparse and all-empty-row patterns,
with block sizes that do not divide T, forward (out, weights, lse) and
backward, with every other rule, per head and per batch item, through the
decode kernels, on every ISA path and at any thread count.
"""
import pickle
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mhattn
from mhattn import reference as R
from threadcounts import assert_same_bits_at_thread_counts

BM = mhattn.BlockMask


def documents(lengths):
    """fn of a document mask: a query sees the keys of its own document."""
    doc = np.repeat(np.arange(len(lengths)), lengths)
    return lambda b, h, q, kv: doc[q] == doc[kv]


def predicates(T, rng):
    """(name, fn) over a (T, T) grid: FlexAttention's usual mask_mods."""
    cuts = np.sort(rng.choice(np.arange(1, T), 5, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [T]]))
    doc = documents(lengths)
    empty_rows = rng.random(T) < 0.2
    sparse = {p: rng.random((3, T, T)) < p for p in (0.02, 0.3, 0.9)}
    out = [
        ("document_causal", lambda b, h, q, kv: doc(b, h, q, kv) & (kv <= q)),
        ("document", doc),
        ("prefix_lm", lambda b, h, q, kv: (kv <= q) | (kv < T // 3)),
        ("dilated", lambda b, h, q, kv: ((q - kv) % 3 == 0) & (kv <= q)),
        ("empty_rows", lambda b, h, q, kv: ~empty_rows[q] & (kv <= q + 5)),
        ("nothing", lambda b, h, q, kv: np.zeros((1, 1, 1, 1), bool)),
        ("everything", lambda b, h, q, kv: np.ones((1, 1, 1, 1), bool)),
    ]
    out += [(f"sparse_{p}", lambda b, h, q, kv, m=m: m[h, q, kv]) for p, m in sparse.items()]
    return out


def _qkv(rng, B, H, G, Tq, Tk, d=8, dtype=np.float64):
    return (rng.standard_normal((B, H, Tq, d)).astype(dtype),
            rng.standard_normal((B, G, Tk, d)).astype(dtype),
            rng.standard_normal((B, G, Tk, d)).astype(dtype))


def same_as_dense(q, k, v, bm, rng, **kw):
    """attention and attention_grad with ``block_mask=bm`` against the same
    calls with ``mask=bm.to_dense()``, bit for bit."""
    dense = bm.to_dense()
    if q.ndim == 3:                          # packed: unbatched (H, T_q, T_k)
        dense = dense[0]
    got = mhattn.attention(q, k, v, block_mask=bm, return_weights=True, return_lse=True, **kw)
    want = mhattn.attention(q, k, v, mask=dense, return_weights=True, return_lse=True, **kw)
    for name, a, b in zip(("out", "weights", "lse"), got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)
    g = rng.standard_normal(got[0].shape).astype(q.dtype)
    gg = mhattn.attention_grad(g, q, k, v, block_mask=bm, **kw)
    gw = mhattn.attention_grad(g, q, k, v, mask=dense, **kw)
    for name in gw:
        np.testing.assert_array_equal(gg[name], gw[name], err_msg=name)
    return got


@pytest.mark.filterwarnings("ignore:mask allows no key")
@pytest.mark.parametrize("block", [(16, 16), (16, 24), (7, 13), (64, 32), (1, 1), (200, 200)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_every_predicate_equals_its_dense_mask(rng, block, dtype):
    T = 150
    q, k, v = _qkv(rng, 1, 3, 3, T, T, dtype=dtype)
    for name, fn in predicates(T, rng):
        bm = BM.from_function(fn, 1, 3, T, T, block=block)
        try:
            out = same_as_dense(q, k, v, bm, rng)[0]
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
        if name == "nothing":       # no NaN on fully masked rows
            assert np.all(out == 0)


@pytest.mark.parametrize("kw", [
    dict(causal=True),
    dict(causal=True, window=(20, 0), sinks=np.array([0.5, -1.0, 0.0, 2.0])),
    dict(key_lengths=np.array([90, 41]), softcap=5.0),
    dict(key_mask=None, alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4]), causal=True),
    dict(chunk=32, causal=True),
    dict(scale=0.3, mask=None),
])
@pytest.mark.parametrize("shared", ["one", "heads", "items", "both"])
def test_anded_with_every_rule(rng, kw, shared):
    B, H, G, Tq, Tk = 2, 4, 2, 70, 100
    q, k, v = _qkv(rng, B, H, G, Tq, Tk)
    kw = dict(kw)
    if "key_mask" in kw:
        kw["key_mask"] = rng.random((B, Tk)) < 0.7
    if "mask" in kw:
        kw["mask"] = rng.standard_normal((B, 1, Tq, Tk))      # an additive one
    b, h = {"one": (1, 1), "heads": (1, H), "items": (B, 1), "both": (B, H)}[shared]
    dense = rng.random((b, h, Tq, Tk)) < 0.5
    dense[..., :20, :] |= (np.arange(Tk) < 30)                   # some full blocks
    dense[..., 40:60, :] = False                                 # empty rows and blocks
    bm = BM.from_dense(dense, block=(16, 12))
    if "mask" in kw:                                             # bool and additive: by hand
        add = kw.pop("mask")
        both = np.where(dense, add, -np.inf)
        got = mhattn.attention(q, k, v, block_mask=bm, mask=add, **kw)
        want = mhattn.attention(q, k, v, mask=both, **kw)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)
        g = rng.standard_normal(got.shape)
        gg = mhattn.attention_grad(g, q, k, v, block_mask=bm, mask=add, mask_grad=True, **kw)
        gw = mhattn.attention_grad(g, q, k, v, mask=both, mask_grad=True, **kw)
        # The additive mask's gradient too, summed as it broadcast.
        gw["mask"] = gw["mask"].sum(axis=1, keepdims=True)
        for name in gw:
            np.testing.assert_allclose(gg[name], gw[name], rtol=1e-11, atol=1e-12,
                                       err_msg=name)
        return
    out = same_as_dense(q, k, v, bm, rng, **kw)[0]
    ref = R.projected_attention(q, k, v, block_mask=bm, **kw)[0]
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("Tk", [1, 37, 3000])
def test_decode_kernels(rng, Tk):
    """One query row (the decode kernels, grouped GQA heads, split-K past a
    few thousand keys), per-head patterns."""
    q, k, v = _qkv(rng, 2, 8, 2, 1, Tk, d=16, dtype=np.float32)
    dense = rng.random((1, 8, 1, Tk)) < 0.3
    dense[0, 3] = False                                   # a head that sees nothing
    dense[0, 5, 0, : Tk // 2] = True
    for block in ((1, 64), (4, 100)):
        bm = BM.from_dense(dense, block=block)
        out = mhattn.attention(q, k, v, block_mask=bm)
        np.testing.assert_array_equal(out, mhattn.attention(q, k, v, mask=dense))
        assert np.all(out[:, 3] == 0)


def test_packed_sequences(rng):
    cu = np.array([0, 40, 40, 97])
    T = 97
    q, k, v = (rng.standard_normal((T, 2, 8)) for _ in range(3))
    bm = BM.from_function(lambda b, h, i, j: (i - j) % 2 == 0, 1, 2, T, T, block=(10, 16))
    kw = dict(layout="bthd", cu_seqlens=cu, causal=True)
    same_as_dense(q, k, v, bm, rng, **kw)


def test_the_layer_mha_trace_and_reference(rng):
    x = rng.standard_normal((2, 45, 16))
    w = [rng.standard_normal((16, 16)) * 0.3 for _ in range(4)]
    bm = BM.from_function(documents([10, 20, 15]), 1, 1, 45, 45, block=8)
    kw = dict(num_heads=4, causal=True)
    out = mhattn.multi_head_attention(x, *w, block_mask=bm, **kw)
    dense = bm.to_dense()
    np.testing.assert_array_equal(out, mhattn.multi_head_attention(x, *w, mask=dense, **kw))
    np.testing.assert_allclose(out, R.multi_head_attention(x, *w, block_mask=bm, **kw),
                               rtol=1e-12, atol=1e-13)
    G = rng.standard_normal(out.shape)
    got = mhattn.multi_head_attention_grad(G, x, *w, block_mask=bm, **kw)
    want = mhattn.multi_head_attention_grad(G, x, *w, mask=dense, **kw)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    layer = mhattn.MultiHeadAttention(16, 4, seed=0)
    y, ctx = layer(x, block_mask=bm, causal=True, return_context=True)
    grads = layer.backward(G, ctx)
    want = mhattn.multi_head_attention_grad(G, x, **layer.arguments(), mask=dense, causal=True)
    np.testing.assert_array_equal(grads["x"], want["x"])
    tr = mhattn.trace(x, *w, block_mask=bm, **kw)
    assert np.all(tr.weights[:, :, ~dense[0, 0]] == 0)
    np.testing.assert_allclose(tr.output, out, rtol=1e-12, atol=1e-13)


def test_threads_change_no_bit(rng):
    q, k, v = _qkv(rng, 2, 4, 2, 300, 300, d=32, dtype=np.float32)
    g = rng.standard_normal(q.shape).astype(np.float32)
    bm = BM.from_function(documents([50, 150, 100]), 2, 1, 300, 300, block=(32, 48))
    assert_same_bits_at_thread_counts(lambda: mhattn.attention(q, k, v, block_mask=bm),
                                      lambda: mhattn.attention_grad(g, q, k, v, block_mask=bm))


def test_every_isa_path(rng, isa):
    q, k, v = _qkv(rng, 1, 4, 2, 150, 130, d=16)
    fn = lambda b, h, i, j: ((i + j + h) % 5 != 0) & (j < i + 10)   # noqa: E731
    bm = BM.from_function(fn, 1, 4, 150, 130, block=(24, 20))
    want = R.projected_attention(q, k, v, block_mask=bm)[0]
    got = mhattn.attention(*(a.astype(np.float32) for a in (q, k, v)), block_mask=bm)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
    same_as_dense(q, k, v, bm, rng)


def test_from_function_matches_from_dense_and_evaluates_in_strips(rng, monkeypatch):
    """fn sees strips of whole query blocks; the blocks' states and bits are
    those of the dense evaluation, per batch item and head."""
    from mhattn._internal import blockmask
    B, H, Tq, Tk = 2, 3, 1000, 700
    monkeypatch.setattr(blockmask, "_STRIP_ELEMS", 3 * B * H * 48 * Tk)  # 3 blocks a strip
    seen = []

    def fn(b, h, q, kv):
        seen.append(q.shape)
        return ((q * 7 + kv * 3 + b + h) % 11 < 4) | (kv < 50 * (h + 1))
    bm = BM.from_function(fn, B, H, Tq, Tk, block=(48, 40))
    dense = fn(np.arange(B)[:, None, None, None], np.arange(H)[None, :, None, None],
               np.arange(Tq)[None, None, :, None], np.arange(Tk))
    assert len(seen) == 8 and all(s[2] == 3 * 48 for s in seen[:-2])
    np.testing.assert_array_equal(bm.to_dense(), dense)
    other = BM.from_dense(dense, block=(48, 40))
    np.testing.assert_array_equal(other.kind, bm.kind)
    np.testing.assert_array_equal(other.bits, bm.bits)
    assert bm.kind.shape == (B, H, 21, 18)


def test_memory_is_states_plus_bits_of_partial_blocks():
    T = 4096
    bm = BM.from_function(documents([256] * 16), 1, 1, T, T, block=(128, 128))
    assert bm.bits.shape[0] == 0 and bm.nbytes == 32 * 32       # 1 KiB
    assert np.count_nonzero(bm.kind == 1) == 16 * 4
    shifted = BM.from_function(documents([100] + [256] * 15 + [156]), 1, 1, T, T, block=128)
    m = np.count_nonzero(shifted.kind == 2)
    assert m > 0 and shifted.nbytes == 32 * 32 + m * 128 * 16   # one bit per element


def test_pickle_repr_and_read_only(rng):
    bm = BM.from_dense(rng.random((2, 30, 20)) < 0.5, block=(8, 6))
    again = pickle.loads(pickle.dumps(bm))
    np.testing.assert_array_equal(again.to_dense(), bm.to_dense())
    assert again.shape == (1, 2, 30, 20) and again.block == (8, 6)
    assert repr(bm).startswith("BlockMask(shape=(1, 2, 30, 20), block=(8, 6), full=")
    with pytest.raises(ValueError):
        bm.kind[0, 0, 0, 0] = 1
    with pytest.raises(ValueError):
        bm.bits[...] = 0


def test_bad_block_masks_name_block_mask(rng):
    q, k, v = _qkv(rng, 2, 2, 2, 10, 12)
    with pytest.raises(ValueError, match=r"block_mask: expected shape .* got \(1, 1, 10, 11\)"):
        mhattn.attention(q, k, v, block_mask=BM.from_dense(np.ones((10, 11), bool)))
    with pytest.raises(ValueError, match=r"block_mask: .* got \(3, 1, 10, 12\)"):
        mhattn.attention(q, k, v, block_mask=BM.from_dense(np.ones((3, 1, 10, 12), bool)))
    with pytest.raises(TypeError, match="block_mask: expected mhattn.BlockMask"):
        mhattn.attention(q, k, v, block_mask=np.ones((10, 12), bool))
    cache = mhattn.KVCache(1, 2, 16, 4, dtype=np.float64)
    x = rng.standard_normal((1, 3, 8))
    w = [np.eye(8)] * 4
    with pytest.raises(ValueError, match="block_mask: not with cache="):
        mhattn.multi_head_attention(x, *w, num_heads=2, cache=cache,
                                    block_mask=BM.from_dense(np.ones((3, 3), bool)))
    assert int(cache.lengths[0]) == 0
    paged = mhattn.PagedKVCache(4, 4, 2, 4, dtype=np.float64)
    ids = [paged.add_sequence()]
    qp = rng.standard_normal((1, 2, 3, 4))
    with pytest.raises(ValueError, match="block_mask: not with cache="):
        mhattn.attention(qp, qp, qp, cache=paged, sequence_ids=ids,
                         block_mask=BM.from_dense(np.ones((3, 3), bool)))
    assert paged.pages_in_use == 0
    with pytest.raises(ValueError, match="block_mask: not with cache="):
        mhattn.multi_head_attention(x, *w, num_heads=2, cache=paged, sequence_ids=ids,
                                    block_mask=BM.from_dense(np.ones((3, 3), bool)))
    assert paged.pages_in_use == 0


def test_the_core_refuses_entries_past_the_bits(rng):
    """The glue's copies of the entries are checked by the core before any is
    used as an index (mha_check_config): a partial index past the bits, or a
    value that is no state, is a ValueError naming block_mask."""
    q, k, v = _qkv(rng, 1, 1, 1, 8, 8)
    entries = BM.from_dense(np.tril(np.ones((8, 8), bool)), block=4)._glue()[0]
    for bad in (np.where(entries >= 0, 5, entries), np.full_like(entries, -3)):
        bm = BM.from_dense(np.tril(np.ones((8, 8), bool)), block=4)
        bm._entries = bad.astype(np.int32)
        with pytest.raises(ValueError, match="block_mask.*bm_block"):
            mhattn.attention(q, k, v, block_mask=bm)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), H=st.sampled_from([1, 2, 4]), Tq=st.integers(1, 90),
       Tk=st.integers(1, 90), bq=st.integers(1, 40), bk=st.integers(1, 40),
       density=st.sampled_from([0.0, 0.05, 0.5, 0.95, 1.0]), per_item=st.booleans(),
       per_head=st.booleans(), causal=st.booleans(), f32=st.booleans(),
       seed=st.integers(0, 2 ** 32 - 1))
def test_any_pattern_and_blocks_give_the_dense_masks_bits(B, H, Tq, Tk, bq, bk, density,
                                                           per_item, per_head, causal, f32,
                                                           seed):
    rng = np.random.default_rng(seed)
    q, k, v = _qkv(rng, B, H, 1 if H == 1 else 2, Tq, Tk,
                   dtype=np.float32 if f32 else np.float64)
    dense = rng.random((B if per_item else 1, H if per_head else 1, Tq, Tk)) < density
    bm = BM.from_dense(dense, block=(bq, bk))
    np.testing.assert_array_equal(bm.to_dense(), dense)
    with warnings.catch_warnings():       # an all-False dense mask warns
        warnings.simplefilter("ignore")
        same_as_dense(q, k, v, bm, rng, causal=causal)
