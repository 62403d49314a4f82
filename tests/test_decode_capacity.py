"""A decode's bits do not depend on the cache's capacity (issue 43).

The same tokens held in caches of capacity T, T + 1, 1023, 1024, 4096 and
65536 give the same bits, step by step, for T from 1 to 5000, on every ISA
this machine runs, with each option a cached step takes (GQA, sinks,
softcap, ALiBi, a window, RoPE, q/k norm), and through ``attention`` on a
cache's storage with key lengths (key_mask among the options). The core
plans a decode's split of the keys from the keys held, never from the
capacity (csrc/core/forward.c, attend_split_plan), so a decode also gives
the bits of ``attention`` on its keys held contiguously.

Caches stored in float16, bfloat16 and int8 (issue 36) keep the guarantee:
their kernels widen the storage block by block as they read it, never
depending on the capacity either.

The full ranges are ``slow``; the quick loop runs the boundaries.
"""
import numpy as np
import pytest

import mhattn

H, G, D, DK = 4, 2, 16, 8
T_MAX = 5000
CAPACITIES = (1023, 1024, 4096, 65536)
# T where the split changes: its thresholds (2 x 512 keys), 64-key blocks,
# the part cap (64 parts), and the first few.
BOUNDARIES = sorted({*range(1, 70), 127, 128, 129, 511, 512, 513, 1022, 1023, 1024, 1025,
                     1087, 1088, 1089, 1536, 2047, 2048, 2049, 3071, 3072, 3073, 4095, 4096,
                     4097, 4999, 5000})


def _options(rng):
    """The options of a cached step, each a dict of its keywords."""
    return {
        "plain": {},
        "sinks": dict(sinks=rng.standard_normal(H)),
        "softcap": dict(softcap=3.0),
        "alibi": dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625])),
        "window": dict(window=(700, 0)),
        "rope": dict(rope=mhattn.RoPE()),
        "qk_norm": dict(q_norm=1 + 0.1 * rng.standard_normal(DK),
                        k_norm=1 + 0.1 * rng.standard_normal(DK)),
    }


def _all_options(rng):
    """Every option of a cached step in one call: the full ranges hold them
    all at once (one decode per capacity instead of one per option)."""
    out = {}
    for opts in _options(rng).values():
        out.update(opts)
    return out


OPTION_NAMES = list(_options(np.random.default_rng(0)))


def _problem(dtype, name):
    rng = np.random.default_rng(43)
    w = [rng.standard_normal((D, n)).astype(dtype) / 4 for n in (H * DK, G * DK, G * DK)]
    w.append(rng.standard_normal((H * DK, D)).astype(dtype) / 4)
    x = rng.standard_normal((1, T_MAX, D)).astype(dtype)
    chosen = _all_options(rng) if name == "all" else _options(rng)[name]
    opts = {k: (v.astype(dtype) if isinstance(v, np.ndarray) and k != "alibi_slopes" else v)
            for k, v in chosen.items()}
    return x, w, opts


def _step(cache, x, w, opts, t):
    """The cached step of token t (the cache then holds t + 1 tokens)."""
    return mhattn.multi_head_attention(x[:, t:t + 1], *w, num_heads=H, num_kv_heads=G,
                                       cache=cache, causal=True, **opts)


def _run(capacity, x, w, opts, upto, cache_dtype=None):
    """Every step's output, token by token from the first, in a cache of
    ``capacity`` (of x's dtype, or ``cache_dtype``): outs[T - 1] is the
    step that leaves T tokens held."""
    cache = mhattn.KVCache(1, G, capacity, DK,
                           dtype=x.dtype if cache_dtype is None else cache_dtype)
    return cache, np.stack([_step(cache, x, w, opts, t) for t in range(upto)])


def _first_differing(a, b):
    same = [a[i].tobytes() == b[i].tobytes() for i in range(len(a))]
    return None if all(same) else same.index(False) + 1


def _check_capacities(isa, dtype, name, upto, ts, capacities=CAPACITIES[:-1]):
    x, w, opts = _problem(dtype, name)
    ref_cache, ref = _run(65536, x, w, opts, upto)
    for cap in capacities:
        n = min(cap, upto)
        _, outs = _run(cap, x, w, opts, n)
        T = _first_differing(outs, ref[:n])
        assert T is None, f"{isa} {dtype.__name__} {name}: capacity {cap} differs at T = {T}"
    # Capacity T and T + 1: the T - 1 tokens before held (copied from the
    # reference cache, so the same rows), then the step of token T.
    keys, values = ref_cache.keys, ref_cache.values
    for T in ts:
        if T > upto:
            continue
        for cap in (T, T + 1):
            cache = mhattn.KVCache(1, G, cap, DK, dtype=dtype)
            if T > 1:
                cache.append(keys[:, :, :T - 1], values[:, :, :T - 1])
            out = _step(cache, x, w, opts, T - 1)
            assert out.tobytes() == ref[T - 1].tobytes(), \
                f"{isa} {dtype.__name__} {name}: capacity {cap} differs at T = {T}"


QUICK_TS = (1, 2, 3, 63, 64, 65, 1023, 1024, 1025, 1088, 1089)


@pytest.mark.parametrize("name,dtype", [(n, np.float32) for n in OPTION_NAMES] +
                         [("plain", np.float64), ("sinks", np.float64)])
def test_capacity_changes_no_bit_near_the_boundaries(isa, dtype, name):
    """The quick loop's share: every option, every ISA, T up to 1100 in
    caches of 1024 and 65536 (where a decode starts to be split), and
    capacities T and T + 1 at the boundaries."""
    _check_capacities(isa, dtype, name, 1100, QUICK_TS, capacities=(1024,))


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype", [("plain", np.float32), ("all", np.float32)])
def test_capacity_changes_no_bit_up_to_5000(isa, dtype, name):
    """T from 1 to 5000 in each capacity, with no option and with every
    option at once (each alone is the quick test's, to T = 1100);
    capacities T and T + 1 for every T (plain float32) or at the
    boundaries."""
    ts = range(1, T_MAX + 1) if (name, dtype) == ("plain", np.float32) else BOUNDARIES
    _check_capacities(isa, dtype, name, T_MAX, ts)


STORED = ("float16", "bfloat16", "int8")


def _check_stored(cache_dtype, upto, caps, ts):
    """A cache stored in cache_dtype (float32 steps, every option): caches
    of capacity ``caps`` and of T and T + 1 for each T of ``ts`` give the
    steps of a cache of 65536, bit for bit."""
    if cache_dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    x, w, opts = _problem(np.float32, "all")
    _, ref = _run(65536, x, w, opts, upto, cache_dtype)
    runs = [(cap, min(cap, upto)) for cap in caps]
    runs += [(cap, T) for T in ts for cap in (T, T + 1)]
    for cap, n in runs:
        _, outs = _run(cap, x, w, opts, n, cache_dtype)
        T = _first_differing(outs, ref[:n])
        assert T is None, f"{cache_dtype}: capacity {cap} differs at T = {T}"


@pytest.mark.parametrize("cache_dtype", STORED)
def test_stored_caches_change_no_bit_with_the_capacity(isa, cache_dtype):
    _check_stored(cache_dtype, 1100, (1024,), (1, 2, 64, 65, 1025))


@pytest.mark.slow
@pytest.mark.parametrize("cache_dtype", STORED)
def test_stored_caches_change_no_bit_up_to_5000(isa, cache_dtype):
    _check_stored(cache_dtype, T_MAX, CAPACITIES[:-1], (1023, 1024, 4095, 4096))


# --- attention on a cache's storage equals attention on the keys held ---------

# Not ALiBi nor a window: attention() places its query at T_k - 1 (the
# capacity - 1 on a cache's storage), a KV cache's step at its length - 1
# (lengths_aligned), so their biases differ; the cached step's tests above
# hold those options to the capacity.
ATTENTION_OPTIONS = ("plain", "sinks", "softcap", "key_mask")


def _check_attention(dtype, name, ts):
    """For each T of ``ts`` (increasing): q against the first T keys held
    contiguously, and against caches of capacity T, T + 1, 1023, 1024, 4096
    and 65536 whose rows past T hold NaN (never read). The big caches are
    filled as T grows, so each row is written once."""
    rng = np.random.default_rng(430)
    t_max = max(ts)
    q = rng.standard_normal((1, H, 1, DK)).astype(dtype)
    k = rng.standard_normal((1, G, t_max, DK)).astype(dtype)
    v = rng.standard_normal((1, G, t_max, DK)).astype(dtype)
    opts = {"plain": {}, "sinks": dict(sinks=rng.standard_normal(H).astype(dtype)),
            "softcap": dict(softcap=3.0), "key_mask": {}}[name]
    seen = rng.random(t_max) < 0.8   # key_mask's keys
    big = {cap: [np.full((1, G, cap, DK), np.nan, dtype) for _ in "kv"]
           for cap in (1023, 1024, 4096, 65536)}
    filled = 0
    for T in ts:
        for cap, (ks, vs) in big.items():
            n = min(T, cap)
            ks[:, :, filled:n], vs[:, :, filled:n] = k[:, :, filled:n], v[:, :, filled:n]
        filled = T
        held = dict(opts, key_mask=seen[:T]) if name == "key_mask" else opts
        want = mhattn.attention(q, k[:, :, :T], v[:, :, :T], **held)
        small = {}
        for cap in (T, T + 1):
            ks = np.full((1, G, cap, DK), np.nan, dtype)
            vs = np.full((1, G, cap, DK), np.nan, dtype)
            ks[:, :, :T], vs[:, :, :T] = k[:, :, :T], v[:, :, :T]
            small[cap] = (ks, vs)
        for cap, (ks, vs) in {**small, **{c: b for c, b in big.items() if c >= T}}.items():
            stored = dict(opts)
            if name == "key_mask":
                stored["key_mask"] = np.concatenate([seen[:T], np.ones(cap - T, bool)])
            got = mhattn.attention(q, ks, vs, key_lengths=np.array([T]), **stored)
            assert got.tobytes() == want.tobytes(), \
                f"{dtype.__name__} {name}: T = {T}, capacity {cap}"


@pytest.mark.parametrize("name", ATTENTION_OPTIONS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_on_storage_is_attention_on_the_keys_held(isa, dtype, name):
    _check_attention(dtype, name, BOUNDARIES)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["key_mask"])   # plain is its special case
def test_attention_on_storage_up_to_5000(isa, name):
    _check_attention(np.float32, name, range(1, T_MAX + 1))


def test_a_batch_is_planned_from_its_longest_item():
    """Items of different lengths: each capacity gives the bits of attention
    on the keys held contiguously, T_k the longest length (the plan is the
    call's; the docstring of KVCache says so)."""
    rng = np.random.default_rng(431)
    lengths = np.array([1500, 37, 1025])
    Tk = int(lengths.max())
    q = rng.standard_normal((3, H, 1, DK))
    k = rng.standard_normal((3, G, Tk, DK))
    v = rng.standard_normal((3, G, Tk, DK))
    want = mhattn.attention(q, k, v, key_lengths=lengths)
    for cap in (Tk, 2048, 4096, 65536):
        ks = np.full((3, G, cap, DK), np.nan)
        vs = np.full((3, G, cap, DK), np.nan)
        ks[:, :, :Tk], vs[:, :, :Tk] = k, v
        got = mhattn.attention(q, ks, vs, key_lengths=lengths)
        assert got.tobytes() == want.tobytes(), f"capacity {cap}"
