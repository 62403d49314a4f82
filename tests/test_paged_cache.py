"""mhattn.PagedKVCache (issue 39, item 4): a paged cache gives, bit for bit,
what a KVCache holding the same tokens gives, and keeps its pages straight.

The oracle: one batch-1 KVCache per live sequence holds its tokens (as the
storage holds them: rounded to half, or quantised); for each call on a
subset of sequences, a batch KVCache is filled with those sequences'
tokens, in the call's order, and the same call is made on it (the cached
step through it, or the core's attention on its storage, as the cached step
makes it).  A batch, not one call per sequence: the core plans a decode's
split of the keys from the longest sequence of the call, so the bits of a
sequence depend on its batch, in a KVCache as in a paged cache.  After every
step the pages are checked: those in use are exactly ceil(length /
page_size) per live sequence, no page is held twice, and the free pool
holds the rest.
"""
import pickle

import numpy as np
import pytest

import mhattn
from mhattn._internal import core
from mhattn._internal.args import head_scales
from threadcounts import at_thread_counts

PAGE_SIZES = (1, 7, 16, 128)          # 7: not a power of two
DTYPES = ("float32", "float64", "float16", "bfloat16", "int8")


def storage_dtype(name):
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return ml_dtypes.bfloat16
    return {"float32": np.float32, "float64": np.float64, "float16": np.float16,
            "int8": "int8"}[name]


def compute_dtype(name):
    return np.float64 if name == "float64" else np.float32


def check_pages(cache):
    """No page leaked or shared: the pages in use are exactly each live
    sequence's ceil(length / page_size), none held twice, the rest free."""
    held = []
    for s in cache.sequences:
        pages = cache.pages(s).tolist()
        assert len(pages) == -(-cache.length(s) // cache.page_size), (s, pages)
        held += pages
    free = list(cache._free)
    assert len(set(held)) == len(held), "a page is held by two sequences"
    assert sorted(held + free) == list(range(cache.num_pages)), "a page leaked"
    assert cache.pages_in_use == len(held)
    assert cache.pages_free == len(free)


class Oracle:
    """Per live sequence, a batch-1 KVCache with its tokens."""

    def __init__(self, G, dk, dv, dtype, capacity):
        self.G, self.dk, self.dv, self.dtype, self.capacity = G, dk, dv, dtype, capacity
        self.seq = {}

    def add(self, sid):
        self.seq[sid] = mhattn.KVCache(1, self.G, self.capacity, self.dk, self.dv,
                                       dtype=self.dtype)

    def free(self, sid):
        del self.seq[sid]

    def length(self, sid):
        return int(self.seq[sid].lengths[0])

    def batch(self, ids, extra=0):
        """A KVCache of len(ids) items holding those sequences' tokens."""
        cap = max([self.length(s) for s in ids] + [0]) + extra + 1
        kv = mhattn.KVCache(len(ids), self.G, cap, self.dk, self.dv, dtype=self.dtype)
        for b, s in enumerate(ids):
            one, L = self.seq[s], self.length(s)
            kv.key_storage[b, :, :L] = one.key_storage[0, :, :L]
            kv.value_storage[b, :, :L] = one.value_storage[0, :, :L]
            if kv.key_scales is not None:
                kv.key_scales[b, :, :L] = one.key_scales[0, :, :L]
                kv.value_scales[b, :, :L] = one.value_scales[0, :, :L]
            kv._lengths[b] = L
        return kv

    def take_back(self, kv, ids, before):
        """After a step through the batch kv: each sequence's new rows into
        its own KVCache."""
        for b, s in enumerate(ids):
            one, L0, L = self.seq[s], int(before[b]), int(kv.lengths[b])
            one.key_storage[0, :, L0:L] = kv.key_storage[b, :, L0:L]
            one.value_storage[0, :, L0:L] = kv.value_storage[b, :, L0:L]
            if kv.key_scales is not None:
                one.key_scales[0, :, L0:L] = kv.key_scales[b, :, L0:L]
                one.value_scales[0, :, L0:L] = kv.value_scales[b, :, L0:L]
            one._lengths[0] = L


def oracle_attention(kv, q, causal, want_w=False, scale=None):
    H, dk = q.shape[1], q.shape[3]
    scales = np.asarray(head_scales(H, H, [dk] * H, scale), np.float64)
    return core.attention_in_layer_words(q, kv.key_storage, kv.value_storage, scales, None,
                                         causal, kv._lengths.copy(), None, True, False, want_w,
                                         False, kv.key_scales, kv.value_scales)


def layer_weights(rng, d_in, H, G, dk, dv, dtype):
    s = 1 / np.sqrt(d_in)
    return (rng.standard_normal((d_in, H * dk)) * s, rng.standard_normal((d_in, G * dk)) * s,
            rng.standard_normal((d_in, G * dv)) * s, rng.standard_normal((H * dv, d_in)) * s)


def run_random(seed, dtype_name, page_size, steps, *, H=4, G=2, dk=8, dv=8, d_in=16,
               num_pages=None, max_live=6, max_new=9):
    """steps random add / append / free / attend / cached steps, each result
    compared bitwise with the oracle, the pages checked after each."""
    rng = np.random.default_rng(seed)
    dt, comp = storage_dtype(dtype_name), compute_dtype(dtype_name)
    num_pages = num_pages or max(8, 6 * 64 // page_size)
    cache = mhattn.PagedKVCache(num_pages, page_size, G, dk, dv, dtype=dt)
    capacity = num_pages * page_size + 16
    oracle = Oracle(G, dk, dv, dt, capacity)
    w = [a.astype(comp) for a in layer_weights(rng, d_in, H, G, dk, dv, comp)]
    counts = dict.fromkeys(("add", "free", "append", "attend", "step", "full"), 0)
    for _ in range(steps):
        live = list(cache.sequences)
        r = rng.random()
        if r < 0.12 and len(live) < max_live or not live:
            s = cache.add_sequence()
            oracle.add(s)
            counts["add"] += 1
        elif r < 0.2:
            s = live[rng.integers(len(live))]
            cache.free(s)
            oracle.free(s)
            counts["free"] += 1
        else:
            n = int(rng.integers(1, len(live) + 1))
            ids = [live[i] for i in rng.permutation(len(live))[:n]]
            T = 1 if rng.random() < 0.6 else int(rng.integers(2, max_new + 1))
            need = sum(-(-(cache.length(s) + T) // page_size) - len(cache.pages(s))
                       for s in ids)
            kind = ("append", "attend", "step")[int(rng.integers(3))]
            before_len = cache.lengths(ids)
            if need > cache.pages_free:
                # Out of pages: a MemoryError naming the argument, nothing written.
                k = rng.standard_normal((n, G, T, dk)).astype(comp)
                in_use = cache.pages_in_use
                with pytest.raises(MemoryError, match=r"^k_new: .* needs \d+ more pages"):
                    cache.append(ids, k, k[..., :dv])
                assert cache.pages_in_use == in_use
                assert (cache.lengths(ids) == before_len).all()
                counts["full"] += 1
            elif kind == "append":
                k = rng.standard_normal((n, G, T, dk)).astype(comp)
                v = rng.standard_normal((n, G, T, dv)).astype(comp)
                ragged = rng.random() < 0.3
                lengths = rng.integers(0, T + 1, n) if ragged else None
                cache.append(ids, k, v, lengths=lengths)
                for i, s in enumerate(ids):
                    c = T if lengths is None else int(lengths[i])
                    oracle.seq[s].append(k[i:i + 1, :, :c], v[i:i + 1, :, :c])
                counts["append"] += 1
            elif kind == "attend":
                # attention(q, k, v, cache=, sequence_ids=): append, then attend.
                q = rng.standard_normal((n, H, T, dk)).astype(comp)
                k = rng.standard_normal((n, G, T, dk)).astype(comp)
                v = rng.standard_normal((n, G, T, dv)).astype(comp)
                causal = T > 1 or rng.random() < 0.5
                want_w = rng.random() < 0.2
                got = mhattn.attention(q, k, v, cache=cache, sequence_ids=ids, causal=causal,
                                       return_weights=want_w)
                for i, s in enumerate(ids):
                    oracle.seq[s].append(k[i:i + 1], v[i:i + 1])
                kv = oracle.batch(ids)
                want, ww, _ = oracle_attention(kv, q, causal, want_w)
                if want_w:
                    got, gw = got
                    L = int(kv.lengths.max())
                    np.testing.assert_array_equal(gw, ww[..., :L])
                np.testing.assert_array_equal(got, want)
                counts["attend"] += 1
            else:
                # multi_head_attention(x, ..., cache=, sequence_ids=): the cached step.
                x = rng.standard_normal((n, T, d_in)).astype(comp)
                got = mhattn.multi_head_attention(x, *w, num_heads=H, num_kv_heads=G,
                                                  causal=True, cache=cache, sequence_ids=ids)
                kv = oracle.batch(ids, extra=T)
                before = kv.lengths.copy()
                want = mhattn.multi_head_attention(x, *w, num_heads=H, num_kv_heads=G,
                                                   causal=True, cache=kv)
                oracle.take_back(kv, ids, before)
                np.testing.assert_array_equal(got, want)
                counts["step"] += 1
        check_pages(cache)
        assert sorted(cache.sequences) == sorted(oracle.seq)
        for s in cache.sequences:
            assert cache.length(s) == oracle.length(s)
    return counts


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_random_steps_match_kvcache_bitwise(dtype_name, page_size):
    counts = run_random(100 + page_size, dtype_name, page_size, steps=400)
    # The run covered every kind of step (a test that cannot fail is a defect).
    assert all(counts[k] > 0 for k in ("add", "free", "append", "attend", "step")), counts


@pytest.mark.parametrize("dtype_name", ("float32", "float16", "int8"))
def test_random_steps_on_every_isa(dtype_name, isa):
    run_random(21, dtype_name, 7, steps=200)


def test_thousands_of_random_steps():
    counts = run_random(7, "float32", 16, steps=2500, num_pages=40, max_live=8)
    assert counts["full"] > 0 and min(counts.values()) > 0, counts


@pytest.mark.parametrize("dtype_name", ("float16", "int8"))
def test_thousands_of_random_steps_half_int8(dtype_name):
    run_random(8, dtype_name, 7, steps=2000, num_pages=60, max_live=8)


# -- long sequences: the split-K decode and the tiles' blocks, bit for bit ---------

@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype_name", ("float32", "bfloat16", "int8", "float64"))
def test_long_mixed_lengths(dtype_name, page_size, isa):
    rng = np.random.default_rng(3)
    dt, comp = storage_dtype(dtype_name), compute_dtype(dtype_name)
    G, H, dk, dv = 2, 8, 16, 24
    lens = [1, 63, 64, 65, 1000, 3001]
    pages = sum(-(-n // page_size) + 1 for n in lens) + 3
    cache = mhattn.PagedKVCache(pages, page_size, G, dk, dv, dtype=dt)
    oracle = Oracle(G, dk, dv, dt, max(lens) + 8)
    ids = []
    for n in lens:
        s = cache.add_sequence()
        oracle.add(s)
        ids.append(s)
        k = rng.standard_normal((1, G, n, dk)).astype(comp)
        v = rng.standard_normal((1, G, n, dv)).astype(comp)
        cache.append([s], k, v)
        oracle.seq[s].append(k, v)
    check_pages(cache)
    order = [ids[i] for i in rng.permutation(len(ids))]
    kv = oracle.batch(order)
    for T, causal in ((1, False), (1, True), (5, True), (70, True)):
        q = rng.standard_normal((len(ids), H, T, dk)).astype(comp)
        # At each thread count: the same bits as the KVCache's, at any.
        got = at_thread_counts(lambda: mhattn.attention(q, cache=cache, sequence_ids=order,
                                                        causal=causal), (1, 2, 3))
        want = oracle_attention(kv, q, causal)[0]
        for g in got:
            np.testing.assert_array_equal(g, want)
    # One sequence alone, and a subset.
    for sub in (order[:1], order[2:5]):
        q = rng.standard_normal((len(sub), H, 1, dk)).astype(comp)
        got = mhattn.attention(q, cache=cache, sequence_ids=sub)
        np.testing.assert_array_equal(got, oracle_attention(oracle.batch(sub), q, False)[0])


# -- every option of the cached step ---------------------------------------------

OPTIONS = {
    "plain": {},
    "rope_qk_norm": dict(rope=True, q_norm=True, k_norm=True),
    "window": dict(window=(5, 0)),
    "softcap": dict(softcap=7.0),
    "alibi": dict(alibi_slopes=True),
    "sinks": dict(sinks=True),
    "gate_biases": dict(w_gate=True, b_q=True, b_k=True, b_v=True, b_o=True),
}


def resolve(opts, rng, d_in, H, G, dk, dv, comp):
    out = {}
    for k, val in opts.items():
        if k == "rope":
            out["rope"] = mhattn.RoPE(dk)
        elif k == "q_norm":
            out["q_norm"] = (1 + 0.1 * rng.standard_normal(dk)).astype(comp)
        elif k == "k_norm":
            out["k_norm"] = (1 + 0.1 * rng.standard_normal(dk)).astype(comp)
        elif k == "alibi_slopes":
            out[k] = np.linspace(0.05, 0.5, H)
        elif k == "sinks":
            out[k] = rng.standard_normal(H).astype(comp)
        elif k == "w_gate":
            out[k] = (rng.standard_normal((d_in, H * dv)) / 4).astype(comp)
        elif k in ("b_q",):
            out[k] = rng.standard_normal(H * dk).astype(comp)
        elif k in ("b_k",):
            out[k] = rng.standard_normal(G * dk).astype(comp)
        elif k in ("b_v",):
            out[k] = rng.standard_normal(G * dv).astype(comp)
        elif k == "b_o":
            out[k] = rng.standard_normal(d_in).astype(comp)
        else:
            out[k] = val
    return out


@pytest.mark.parametrize("dtype_name", ("float32", "float16", "int8"))
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_cached_step_options(option, dtype_name):
    rng = np.random.default_rng(11)
    dt, comp = storage_dtype(dtype_name), compute_dtype(dtype_name)
    d_in, H, G, dk, dv, ps = 24, 6, 2, 8, 8, 5
    w = [a.astype(comp) for a in layer_weights(rng, d_in, H, G, dk, dv, comp)]
    opts = resolve(OPTIONS[option], rng, d_in, H, G, dk, dv, comp)
    cache = mhattn.PagedKVCache(64, ps, G, dk, dv, dtype=dt)
    oracle = Oracle(G, dk, dv, dt, 200)
    ids = [cache.add_sequence() for _ in range(3)]
    for s in ids:
        oracle.add(s)
    for T, sub, ragged in ((7, ids, False), (1, ids, False), (4, ids[1:], True),
                           (1, ids[::-1], False), (3, ids[:1], False), (1, ids, False)):
        x = rng.standard_normal((len(sub), T, d_in)).astype(comp)
        nl = rng.integers(1, T + 1, len(sub)) if ragged else None
        got = mhattn.multi_head_attention(x, *w, num_heads=H, num_kv_heads=G, causal=True,
                                          cache=cache, sequence_ids=sub, new_lengths=nl,
                                          **opts)
        kv = oracle.batch(sub, extra=T)
        before = kv.lengths.copy()
        want = mhattn.multi_head_attention(x, *w, num_heads=H, num_kv_heads=G, causal=True,
                                           cache=kv, new_lengths=nl, **opts)
        oracle.take_back(kv, sub, before)
        np.testing.assert_array_equal(got, want)
        check_pages(cache)
        assert cache.lengths(sub).tolist() == kv.lengths.tolist()


def test_cached_step_half_x_and_weights():
    """x of the cache's half dtype (its result rounded once), and the weights
    of a step (n, H, T_new, max length)."""
    rng = np.random.default_rng(5)
    d_in, H, G, dk = 16, 4, 2, 8
    w = [a.astype(np.float16) for a in layer_weights(rng, d_in, H, G, dk, dk, np.float32)]
    cache = mhattn.PagedKVCache(16, 4, G, dk, dtype=np.float16)
    kv = mhattn.KVCache(2, G, 64, dk, dtype=np.float16)
    ids = [cache.add_sequence(), cache.add_sequence()]
    for T in (5, 1, 1):
        x = rng.standard_normal((2, T, d_in)).astype(np.float16)
        got, gw = mhattn.multi_head_attention(x, *w, num_heads=H, num_kv_heads=G, causal=True,
                                              cache=cache, sequence_ids=ids,
                                              return_weights=True)
        want, ww = mhattn.multi_head_attention(x, *w, num_heads=H, num_kv_heads=G,
                                               causal=True, cache=kv, return_weights=True)
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, want)
        L = int(kv.lengths.max())
        assert gw.shape == (2, H, T, L)
        np.testing.assert_array_equal(gw, ww[..., :L])


def test_attention_without_append_does_not_write():
    rng = np.random.default_rng(2)
    cache = mhattn.PagedKVCache(8, 4, 1, 4)
    s = cache.add_sequence()
    k = rng.standard_normal((1, 1, 6, 4)).astype(np.float32)
    cache.append([s], k, k)
    pages = cache.key_pages.copy()
    q = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)
    out, lse = mhattn.attention(q, cache=cache, sequence_ids=[s], return_lse=True)
    want, want_lse = mhattn.attention(q, k, k, return_lse=True)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
    assert cache.length(s) == 6 and np.array_equal(cache.key_pages, pages)


# -- the pages themselves ------------------------------------------------------

def test_pages_are_reused_and_tokens_land_in_their_rows():
    cache = mhattn.PagedKVCache(4, 3, 1, 2)
    a, b = cache.add_sequence(), cache.add_sequence()
    k = np.arange(1 * 1 * 5 * 2, dtype=np.float32).reshape(1, 1, 5, 2)
    cache.append([a], k, k)
    assert cache.pages(a).tolist() == [0, 1]
    cache.append([b], k[:, :, :1], k[:, :, :1])
    assert cache.pages(b).tolist() == [2]
    # Key j of a at row j % 3 of its page j // 3.
    for j in range(5):
        page = cache.pages(a)[j // 3]
        np.testing.assert_array_equal(cache.key_pages[page, 0, j % 3], k[0, 0, j])
    cache.free(a)
    c = cache.add_sequence()
    cache.append([c], k, k)          # a's pages, back from the pool
    assert sorted(cache.pages(c).tolist()) == [0, 1]
    check_pages(cache)


def test_pickle_and_copy():
    import copy
    rng = np.random.default_rng(0)
    cache = mhattn.PagedKVCache(8, 4, 2, 4, dtype="int8")
    a, b = cache.add_sequence(), cache.add_sequence()
    k = rng.standard_normal((2, 2, 6, 4)).astype(np.float32)
    cache.append([a, b], k, k, lengths=[6, 2])
    cache.free(b)
    for other in (pickle.loads(pickle.dumps(cache)), copy.deepcopy(cache)):
        assert repr(other) == repr(cache)
        assert other.length(a) == 6 and other.pages(a).tolist() == cache.pages(a).tolist()
        np.testing.assert_array_equal(other.key_pages, cache.key_pages)
        np.testing.assert_array_equal(other.key_scales, cache.key_scales)
        with pytest.raises(ValueError, match="freed"):
            other.length(b)
        q = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)
        np.testing.assert_array_equal(mhattn.attention(q, cache=other, sequence_ids=[a]),
                                      mhattn.attention(q, cache=cache, sequence_ids=[a]))
        assert other._lock is not cache._lock
        assert other.add_sequence() not in (a, b)
        check_pages(other)


def test_repr_and_sizes():
    cache = mhattn.PagedKVCache(10, 16, 2, 8, d_v=4, dtype=np.float16)
    assert repr(cache) == ("PagedKVCache(num_pages=10, page_size=16, num_kv_heads=2, d_k=8, "
                           "d_v=4, dtype=float16, sequences=0, pages_in_use=0)")
    assert cache.nbytes == 10 * 2 * 16 * (8 + 4) * 2
    q8 = mhattn.PagedKVCache(10, 16, 2, 8, dtype="int8")
    assert q8.nbytes == 10 * 2 * 16 * (8 + 8) + 10 * 2 * 16 * 8
    assert (q8.key_scales.shape, cache.key_scales) == ((10, 2, 16), None)


# -- bad input: each error names its argument, the cache unchanged -------------

def snapshot(cache):
    return (cache.key_pages.copy(), cache.value_pages.copy(), list(cache._free),
            {s: cache.pages(s).tolist() for s in cache.sequences},
            {s: cache.length(s) for s in cache.sequences})


def assert_same(cache, snap):
    now = snapshot(cache)
    np.testing.assert_array_equal(now[0], snap[0])
    np.testing.assert_array_equal(now[1], snap[1])
    assert now[2:] == snap[2:]


@pytest.fixture
def filled():
    cache = mhattn.PagedKVCache(6, 4, 2, 4)
    a, b, gone = cache.add_sequence(), cache.add_sequence(), cache.add_sequence()
    k = np.ones((2, 2, 5, 4), np.float32)
    cache.append([a, b], k, k)
    cache.free(gone)
    return cache, a, b, gone


@pytest.mark.parametrize("args,kw,exc,match", [
    ((0, 4, 2, 4), {}, ValueError, "^num_pages: expected a positive integer"),
    ((4, 0, 2, 4), {}, ValueError, "^page_size: expected a positive integer"),
    ((4, -3, 2, 4), {}, ValueError, "^page_size: expected a positive integer"),
    ((4, 2.5, 2, 4), {}, ValueError, "^page_size: expected a positive integer"),
    ((4, 4, 0, 4), {}, ValueError, "^num_kv_heads: expected a positive integer"),
    ((4, 4, 2, 4), {"d_v": 0}, ValueError, "^d_v: expected a positive integer"),
    ((4, 4, 2, 4), {"dtype": np.int16}, ValueError, "^dtype: expected"),
    ((2**31, 4, 2, 4), {}, ValueError, "^num_pages: at most 2\\*\\*31 - 1"),
])
def test_constructor_errors(args, kw, exc, match):
    with pytest.raises(exc, match=match):
        mhattn.PagedKVCache(*args, **kw)


def test_out_of_pages_changes_nothing(filled):
    cache, a, b, _ = filled
    snap = snapshot(cache)
    k = np.ones((2, 2, 8, 4), np.float32)       # 2 + 2 more pages, 2 free
    with pytest.raises(MemoryError, match=r"^k_new: appending 16 keys to 2 sequences needs "
                                          r"4 more pages of 4 keys, but only 2 of the "
                                          r"cache's num_pages=6 are free; the cache is "
                                          r"unchanged"):
        cache.append([a, b], k, k)
    assert_same(cache, snap)
    rng = np.random.default_rng(0)
    w = [a_.astype(np.float32) for a_ in layer_weights(rng, 8, 2, 2, 4, 4, np.float32)]
    with pytest.raises(MemoryError, match=r"^x: appending"):
        mhattn.multi_head_attention(np.ones((2, 8, 8), np.float32), *w, num_heads=2,
                                    num_kv_heads=2, causal=True, cache=cache,
                                    sequence_ids=[a, b])
    assert_same(cache, snap)
    q = np.ones((2, 2, 8, 4), np.float32)
    with pytest.raises(MemoryError, match=r"^k: appending"):
        mhattn.attention(q, k, k, cache=cache, sequence_ids=[a, b], causal=True)
    assert_same(cache, snap)


@pytest.mark.parametrize("case", ["stale", "foreign", "other_cache", "duplicate", "not_int",
                                  "bool", "k_shape", "k_heads", "v_width", "v_rows",
                                  "dtype", "lengths_range", "lengths_shape"])
def test_append_errors_change_nothing(filled, case):
    cache, a, b, gone = filled
    other = mhattn.PagedKVCache(4, 4, 2, 4)
    foreign = other.add_sequence()
    k = np.ones((1, 2, 2, 4), np.float32)
    ids, kk, vv, kw = [a], k, k, {}
    exc, match = ValueError, "^sequence_ids: "
    if case == "stale":
        ids, match = [gone], "^sequence_ids: sequence .* was freed"
    elif case == "foreign":
        ids, match = [10**12], "^sequence_ids: .* is not a sequence of this cache"
    elif case == "other_cache":
        ids, match = [foreign], "^sequence_ids: .* is not a sequence of this cache"
    elif case == "duplicate":
        ids, kk = [a, a], np.ones((2, 2, 2, 4), np.float32)
        vv, match = kk, "^sequence_ids: sequence .* more than once"
    elif case == "not_int":
        ids, exc, match = ["a"], TypeError, "^sequence_ids: "
    elif case == "bool":
        ids, exc, match = [True], TypeError, r"^sequence_ids: expected a 1-D list of sequence ids \(ints\), got bool"
    elif case == "k_shape":
        kk, match = np.ones((2, 2, 2, 4), np.float32), r"^k_new: expected shape \(n, G"
    elif case == "k_heads":
        kk, match = np.ones((1, 3, 2, 4), np.float32), r"^k_new: expected shape"
    elif case == "v_width":
        vv, match = np.ones((1, 2, 2, 5), np.float32), r"^v_new: expected shape"
    elif case == "v_rows":
        vv, match = np.ones((1, 2, 3, 4), np.float32), r"^v_new: has 3 rows"
    elif case == "dtype":
        kk, match = k.astype(np.float64), "^k_new: dtype float64"
    elif case == "lengths_range":
        kw, match = {"lengths": [3]}, r"^lengths: each must lie in \[0, T_new=2\]"
    elif case == "lengths_shape":
        kw, match = {"lengths": [1, 1]}, r"^lengths: expected \(1,\) integers"
    snap = snapshot(cache)
    with pytest.raises(exc, match=match):
        cache.append(ids, kk, vv, **kw)
    assert_same(cache, snap)
    check_pages(cache)


def test_free_and_queries_of_bad_ids(filled):
    cache, a, b, gone = filled
    snap = snapshot(cache)
    for call in (cache.free, cache.length, cache.pages):
        with pytest.raises(ValueError, match="^sequence_id: sequence .* was freed"):
            call(gone)
        with pytest.raises(ValueError, match="^sequence_id: .* not a sequence of this cache"):
            call(-1)
    for call in (cache.lengths, cache.block_table):
        with pytest.raises(ValueError, match="^sequence_ids: sequence .* was freed"):
            call([a, gone])
    cache.free(a)
    with pytest.raises(ValueError, match="^sequence_id: sequence .* was freed"):
        cache.free(a)                                   # twice
    with pytest.raises(ValueError, match="^sequence_ids: sequence .* was freed"):
        cache.append([a], np.ones((1, 2, 1, 4), np.float32), np.ones((1, 2, 1, 4), np.float32))
    assert snap[4][b] == cache.length(b)
    check_pages(cache)


def test_step_errors_change_nothing(filled):
    cache, a, b, gone = filled
    rng = np.random.default_rng(0)
    w = [a_.astype(np.float32) for a_ in layer_weights(rng, 8, 2, 2, 4, 4, np.float32)]
    x = np.ones((2, 1, 8), np.float32)
    snap = snapshot(cache)
    cases = [
        (dict(sequence_ids=[a]), ValueError, r"^sequence_ids: 1 sequences listed but x holds 2"),
        (dict(sequence_ids=[a, gone]), ValueError, "^sequence_ids: sequence .* was freed"),
        (dict(sequence_ids=[a, a]), ValueError, "^sequence_ids: .* more than once"),
        (dict(sequence_ids=[a, b], num_kv_heads=1), ValueError, "^cache: 2 kv heads"),
        (dict(sequence_ids=[a, b], return_context=True), ValueError, "^return_context"),
        (dict(sequence_ids=[a, b], key_lengths=[1, 1]), ValueError, "^key_lengths: not with"),
    ]
    for kw, exc, match in cases:
        kw = {"num_heads": 2, "num_kv_heads": 2, "causal": True, **kw}
        if kw["num_kv_heads"] == 1:
            ww = (w[0], w[1][:, :4], w[2][:, :4], w[3])
        else:
            ww = w
        with pytest.raises(exc, match=match):
            mhattn.multi_head_attention(x, *ww, cache=cache, **kw)
        assert_same(cache, snap)
    with pytest.raises(ValueError, match="^sequence_ids: only with a PagedKVCache"):
        mhattn.multi_head_attention(x, *w, num_heads=2, sequence_ids=[a, b])
    q = np.ones((2, 2, 1, 4), np.float32)
    for kw, exc, match in [
            (dict(sequence_ids=None), ValueError, "^sequence_ids: required with cache="),
            (dict(sequence_ids=[a, b], mask=np.ones((1, 1), bool)), ValueError, "^mask: not"),
            (dict(sequence_ids=[a, b], layout="bthd"), ValueError, "^layout: with cache="),
            (dict(sequence_ids=[b]), ValueError, "^sequence_ids: 1 sequences listed but q"),
    ]:
        with pytest.raises(exc, match=match):
            mhattn.attention(q, cache=cache, **kw)
        assert_same(cache, snap)
    with pytest.raises(ValueError, match="^q: dtype float64"):
        mhattn.attention(q.astype(np.float64), cache=cache, sequence_ids=[a, b])
    with pytest.raises(ValueError, match="^q: expected shape"):
        mhattn.attention(q[..., :3], cache=cache, sequence_ids=[a, b])
    with pytest.raises(ValueError, match="^k, v: hold 2 and 2 new rows, but q holds T_new = 1"):
        kk = np.ones((2, 2, 2, 4), np.float32)
        mhattn.attention(q, kk, kk, cache=cache, sequence_ids=[a, b])
    with pytest.raises(TypeError, match="^cache: expected a mhattn.PagedKVCache"):
        mhattn.attention(q, cache=mhattn.KVCache(2, 2, 8, 4), sequence_ids=[a, b])
    with pytest.raises(ValueError, match="^sequence_ids: only with cache="):
        mhattn.attention(q, q, q, sequence_ids=[a, b])
    assert_same(cache, snap)


def test_core_checks_the_block_table():
    """_C.attention with a block table: every entry must be a page of the
    pool (the glue copies it, the core checks the copy before reading)."""
    q = np.ones((1, 2, 1, 4), np.float32)
    pool = np.ones((3, 1, 4, 4), np.float32)
    scales = np.full(2, 0.5)
    lens = np.array([5])
    for bt, match in ((np.array([[0, 3]], np.int32), r"block_table\[0, 1\] = 3 is not a page"),
                      (np.array([[-1, 0]], np.int32), r"block_table\[0, 0\] = -1 is not a page")):
        with pytest.raises(ValueError, match=match):
            core.attention(q, pool, pool, scales, None, False, lens, None, True, False,
                           False, False, None, None, bt)
    with pytest.raises(ValueError, match="^block_table: expected shape"):
        core.attention(q, pool, pool, scales, None, False, lens, None, True, False, False,
                       False, None, None, np.zeros((2, 2), np.int32))
    with pytest.raises(TypeError, match="^block_table"):
        core.attention(q, pool, pool, scales, None, False, lens, None, True, False, False,
                       False, None, None, np.zeros((1, 2), np.int64))
    with pytest.raises(ValueError, match="^v: expected shape"):
        core.attention(q, pool, pool[:2], scales, None, False, lens, None, True, False, False,
                       False, None, None, np.zeros((1, 2), np.int32))


def test_layer_call_with_a_paged_cache():
    """layer(x_new, cache=paged, sequence_ids=ids), the layer's cached step:
    the bits of the same layer through a KVCache."""
    layer = mhattn.MultiHeadAttention(32, 4, num_kv_heads=2, seed=0)
    rng = np.random.default_rng(9)
    cache = mhattn.PagedKVCache(16, 4, 2, 8)
    kv = mhattn.KVCache(2, 2, 32, 8)
    ids = [cache.add_sequence(), cache.add_sequence()]
    for T in (6, 1, 1):
        x = rng.standard_normal((2, T, 32)).astype(np.float32)
        got = layer(x, causal=True, rope=mhattn.RoPE(), cache=cache, sequence_ids=ids)
        want = layer(x, causal=True, rope=mhattn.RoPE(), cache=kv)
        np.testing.assert_array_equal(got, want)
    assert cache.lengths(ids).tolist() == [8, 8]


# -- a hypothesis state machine: the same contract, its sequences shrunk ------

from hypothesis import HealthCheck, settings                     # noqa: E402
from hypothesis import strategies as st                           # noqa: E402
from hypothesis.stateful import (RuleBasedStateMachine, invariant,  # noqa: E402
                                 precondition, rule)


class PagedMachine(RuleBasedStateMachine):
    """add / append / free / decode in any order hypothesis finds, each
    decode compared bitwise with a batch KVCache of the same tokens; an
    append past the free pages must raise MemoryError and change nothing."""

    G, H, dk, ps = 2, 4, 8, 3

    def __init__(self):
        super().__init__()
        self.cache = mhattn.PagedKVCache(12, self.ps, self.G, self.dk)
        self.oracle = Oracle(self.G, self.dk, self.dk, np.float32, 12 * self.ps + 8)
        self.rng = np.random.default_rng(0)

    @rule()
    def add(self):
        self.oracle.add(self.cache.add_sequence())

    @precondition(lambda self: self.cache.sequences)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(self.cache.sequences))
        self.cache.free(s)
        self.oracle.free(s)

    @precondition(lambda self: self.cache.sequences)
    @rule(data=st.data(), T=st.integers(1, 7))
    def append(self, data, T):
        ids = data.draw(st.lists(st.sampled_from(self.cache.sequences), min_size=1,
                                 unique=True))
        k = self.rng.standard_normal((len(ids), self.G, T, self.dk)).astype(np.float32)
        need = sum(-(-(self.cache.length(s) + T) // self.ps) - len(self.cache.pages(s))
                   for s in ids)
        if need > self.cache.pages_free:
            snap = snapshot(self.cache)
            with pytest.raises(MemoryError, match="^k_new: "):
                self.cache.append(ids, k, k)
            assert_same(self.cache, snap)
            return
        self.cache.append(ids, k, k)
        for i, s in enumerate(ids):
            self.oracle.seq[s].append(k[i:i + 1], k[i:i + 1])

    @precondition(lambda self: self.cache.sequences)
    @rule(data=st.data(), causal=st.booleans())
    def decode(self, data, causal):
        ids = data.draw(st.lists(st.sampled_from(self.cache.sequences), min_size=1,
                                 unique=True))
        q = self.rng.standard_normal((len(ids), self.H, 1, self.dk)).astype(np.float32)
        got = mhattn.attention(q, cache=self.cache, sequence_ids=ids, causal=causal)
        want = oracle_attention(self.oracle.batch(ids), q, causal)[0]
        np.testing.assert_array_equal(got, want)

    @invariant()
    def pages_straight(self):
        check_pages(self.cache)


PagedMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                          deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_paged_state_machine = PagedMachine.TestCase


def test_threads_share_one_cache():
    """Threads stepping their own sequences through one cache (pages taken
    from one pool under its lock, in whatever order the threads come): each
    thread's outputs are those of its sequence alone, and no page is held
    twice."""
    import threading
    rng = np.random.default_rng(4)
    d_in, H, G, dk = 16, 4, 2, 8
    w = [a.astype(np.float32) for a in layer_weights(rng, d_in, H, G, dk, dk, np.float32)]
    xs = [rng.standard_normal((30, 1, 1, d_in)).astype(np.float32) for _ in range(4)]
    kw = dict(num_heads=H, num_kv_heads=G, causal=True, rope=mhattn.RoPE())
    cache = mhattn.PagedKVCache(4 * 30, 1, G, dk)        # one key a page: most churn
    got = [[] for _ in xs]

    def run(t):
        s = cache.add_sequence()
        for x in xs[t]:
            got[t].append(mhattn.multi_head_attention(x, *w, cache=cache, sequence_ids=[s],
                                                      **kw))

    threads = [threading.Thread(target=run, args=(t,)) for t in range(len(xs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    check_pages(cache)
    for t, x in enumerate(xs):
        kv = mhattn.KVCache(1, G, 32, dk)
        want = [mhattn.multi_head_attention(xi, *w, cache=kv, **kw) for xi in x]
        np.testing.assert_array_equal(np.stack(got[t]), np.stack(want))
