"""One KVCache shared by threads: appends, cached decode steps and resets
are each atomic (issue 35, "Hostile callers, round 2").

Every row a thread writes carries its thread's tag and a counter, and the
storage starts as NaN, so a row written twice (two appends at the same
offset) or counted but never written shows up.  The cached steps are then
replayed serially, in the order the cache itself recorded, and must give
the same bits: no step read a half-written row or attended at a stale
length.  The interpreter switches threads every microsecond while these
run, which makes the old races (read lengths, write rows, bump lengths as
three unguarded moves) fail every run.
"""
import copy
import pickle
import sys
import threading
from contextlib import contextmanager

import numpy as np

import mhattn

D, H, G = 8, 2, 1
ROWS = 64                       # rows per append, as in the report
APPENDER = 100                  # appending threads' tags start here


@contextmanager
def fast_switching():
    """Switch threads every microsecond (the default is 5 ms)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def run_threads(workers):
    """Run each callable on its own thread, all released at once; return
    the exceptions they raised, as text."""
    barrier = threading.Barrier(len(workers))
    errors = []

    def run(work):
        try:
            barrier.wait(timeout=30)
            work()
        except Exception as e:   # noqa: BLE001 - reported to the main thread
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    with fast_switching():
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


def nan_cache(capacity, d_k=D, d_v=D):
    """A float64 cache of one sequence whose storage is NaN: a row counted
    in lengths but never written stays NaN."""
    cache = mhattn.KVCache(1, G, capacity, d_k, d_v, dtype=np.float64)
    cache.key_storage[...] = np.nan
    cache.value_storage[...] = np.nan
    return cache


# --- appends -------------------------------------------------------------------

def tagged_block(tag, block):
    """(1, 1, ROWS, D) rows: column 0 the writer's tag, the others the row's
    number in the writer's sequence, block * ROWS + i.  ROWS * D = 512
    elements: enough that NumPy copies them with the GIL released."""
    rows = np.empty((1, 1, ROWS, D))
    rows[..., 0] = tag
    rows[..., 1:] = (block * ROWS + np.arange(ROWS))[:, np.newaxis]
    return rows


def test_concurrent_appends_write_every_row_exactly_once():
    threads, appends = 4, 150
    cache = nan_cache(threads * appends * ROWS)

    def appender(t):
        return lambda: [cache.append(tagged_block(t, a), -tagged_block(t, a))
                        for a in range(appends)]

    assert not run_threads([appender(t) for t in range(threads)])
    n = threads * appends * ROWS
    assert cache.lengths.tolist() == [n]
    keys, values = cache.key_storage[0, 0], cache.value_storage[0, 0]
    assert not np.isnan(keys).any(), "rows counted in lengths but never written"
    np.testing.assert_array_equal(values, -keys)      # each row's key and value together
    # Each append's ROWS rows sit together, in its thread's order, and every
    # (thread, row) pair is there once.
    assert (keys[:, 2:] == keys[:, 1:2]).all(), "a row mixes two writes"
    blocks = keys.reshape(-1, ROWS, D)
    assert (blocks[:, :, 0] == blocks[:, :1, 0]).all(), "an append's rows are split"
    assert (np.diff(blocks[:, :, 1], axis=1) == 1).all()
    assert (blocks[:, 0, 1] % ROWS == 0).all()
    pairs = {(int(t), int(i)) for t, i in keys[:, :2]}
    assert pairs == {(t, i) for t in range(threads) for i in range(appends * ROWS)}
    for t in range(threads):           # each thread's appends, in its own order
        mine = keys[keys[:, 0] == t, 1]
        assert (np.diff(mine) == 1).all()


def test_reset_is_atomic_with_appends():
    """An append and a reset never interleave: after each of its appends the
    appender finds the cache holding its own last blocks, in order (a reset
    between an append's write and its length bump would leave the length
    pointing at an older block)."""
    appends = 1000
    cache = nan_cache(appends * ROWS)
    done = threading.Event()
    problems = []

    def appender():
        try:
            for a in range(appends):
                block = tagged_block(APPENDER, a)
                cache.append(block, block)
                n = int(cache.lengths[0])      # only this thread writes rows
                if n % ROWS or n > (a + 1) * ROWS:
                    problems.append(f"append {a}: lengths {n}")
                    continue
                rows = cache.key_storage[0, 0, :n, 1]
                want = np.arange((a + 1) * ROWS - n, (a + 1) * ROWS)
                if not np.array_equal(rows, want):
                    problems.append(f"append {a}: the {n} rows held are not the last ones")
        finally:
            done.set()

    def resetter():
        # Not while the cache is nearly empty: an append at offset 0 that
        # a reset overtakes is (by luck) still right.
        while not done.is_set():
            if cache.lengths[0] >= 2 * ROWS:
                cache.reset()

    assert not run_threads([appender, resetter])
    assert not problems, problems[:5]


# --- cached decode steps ----------------------------------------------------------

def layer_weights():
    """Weights of a D -> D layer with H = 2 query heads over G = 1 kv head of
    width D, RoPE on q and k.  W^V is the identity, so each value row is the
    step's x itself and carries the step's tag (the keys are rotated)."""
    rng = np.random.default_rng(7)
    return dict(w_q=rng.standard_normal((D, H * D)) / D, w_k=rng.standard_normal((D, D)) / D,
                w_v=np.eye(D), w_o=rng.standard_normal((H * D, D)), num_heads=H,
                num_kv_heads=G, rope=mhattn.RoPE())


def step_x(tag, s, rng):
    """(1, 1, D) new row of decoder `tag`'s step s: tagged in columns 0, 1."""
    x = rng.standard_normal((1, 1, D))
    x[..., 0], x[..., 1] = tag, s
    return x


def hammer(decoders, appenders, steps, appends):
    """Decoders run cached steps and appenders append tagged blocks, all on
    one cache; returns (cache, what each thread recorded: tag -> list)."""
    w = layer_weights()
    capacity = decoders * steps + appenders * appends * ROWS
    cache = nan_cache(capacity)
    record = {}

    def decoder(t):
        rng = np.random.default_rng(t)
        mine = record[t] = []

        def work():
            for s in range(steps):
                x = step_x(t, s, rng)
                mine.append((x, mhattn.multi_head_attention(x, cache=cache, **w)))
        return work

    def appender(t):
        rng = np.random.default_rng(t)
        mine = record[t] = []

        def work():
            for a in range(appends):
                k = rng.standard_normal((1, G, ROWS, D))
                v = rng.standard_normal((1, G, ROWS, D))
                v[..., 0] = t
                v[..., 1] = a * ROWS + np.arange(ROWS)
                mine.append((k, v))
                cache.append(k, v)
        return work

    workers = [decoder(t) for t in range(decoders)]
    workers += [appender(APPENDER + t) for t in range(appenders)]
    assert not run_threads(workers)
    assert cache.lengths.tolist() == [capacity]
    return cache, record


def order_of(cache, record):
    """The order the cache wrote its rows in, read from the value rows' tags:
    [("step", tag, s) or ("append", tag, a)], each exactly once."""
    values = cache.value_storage[0, 0]
    assert not np.isnan(values).any(), "rows counted in lengths but never written"
    events, r = [], 0
    while r < values.shape[0]:
        tag, n = int(values[r, 0]), int(values[r, 1])
        if tag < APPENDER:
            events.append(("step", tag, n))
            r += 1
        else:
            assert n % ROWS == 0, f"row {r}: an append's rows split by another write"
            np.testing.assert_array_equal(values[r:r + ROWS, 1], n + np.arange(ROWS))
            assert (values[r:r + ROWS, 0] == tag).all()
            events.append(("append", tag, n // ROWS))
            r += ROWS
    want = [(("step" if tag < APPENDER else "append"), tag, i)
            for tag, items in record.items() for i in range(len(items))]
    assert sorted(events) == sorted(want), "a write is missing or doubled"
    return events


def replay(cache, record):
    """Replay the recorded writes serially, in the cache's order: each step
    must give the bits it gave under threads, and the storage must end equal."""
    w = layer_weights()
    serial = nan_cache(cache.capacity)
    for kind, tag, i in order_of(cache, record):
        if kind == "append":
            serial.append(*record[tag][i])
        else:
            x, out = record[tag][i]
            np.testing.assert_array_equal(
                mhattn.multi_head_attention(x, cache=serial, **w), out,
                err_msg=f"step {i} of decoder {tag} differs from its serial replay")
    np.testing.assert_array_equal(serial.lengths, cache.lengths)
    np.testing.assert_array_equal(serial.key_storage, cache.key_storage)
    np.testing.assert_array_equal(serial.value_storage, cache.value_storage)


def test_concurrent_decode_steps_are_each_atomic():
    cache, record = hammer(decoders=4, appenders=0, steps=60, appends=0)
    outs = [out for items in record.values() for _, out in items]
    assert all(np.isfinite(out).all() for out in outs)
    replay(cache, record)


def test_decoding_while_another_thread_appends():
    """A step never reads a row an append is still writing, nor attends
    at a length the append has not yet reached."""
    cache, record = hammer(decoders=2, appenders=2, steps=60, appends=20)
    replay(cache, record)


def test_the_replay_detects_a_wrong_output():
    """The serial replay can fail: a recorded output changed by one ulp is
    reported."""
    cache, record = hammer(decoders=2, appenders=1, steps=5, appends=2)
    x, out = record[0][3]
    record[0][3] = (x, np.nextafter(out, np.inf))
    try:
        replay(cache, record)
    except AssertionError as e:
        assert "step 3 of decoder 0" in str(e)
    else:
        raise AssertionError("a wrong output went unnoticed")


# --- the lock and copies ------------------------------------------------------------

def test_pickle_and_copies_work_and_share_nothing():
    rng = np.random.default_rng(3)
    cache = mhattn.KVCache(2, G, 16, D)
    kv = rng.standard_normal((2, G, 5, D)).astype(np.float32)
    cache.append(kv, kv, lengths=[5, 2])
    for other in (pickle.loads(pickle.dumps(cache)), copy.copy(cache),
                  copy.deepcopy(cache)):
        assert repr(other) == repr(cache)
        np.testing.assert_array_equal(other.keys, cache.keys)
        assert not np.shares_memory(other.key_storage, cache.key_storage)
        other.append(kv, kv)                 # its own storage, its own lock
        assert cache.lengths.tolist() == [5, 2]
        assert other.lengths.tolist() == [10, 7]
