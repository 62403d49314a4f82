"""Concurrent calls: threads, a changing thread count, and fork.

The core runs with the GIL released, so calls from several Python threads
really overlap; each must give the bits a serial call gives.
"""
import os
import threading
import time

import numpy as np
import pytest

import mhattn

N_THREADS = 8


def make_case(i):
    """A different call per thread: shapes, dtypes, heads, masks, causal."""
    r = np.random.default_rng(100 + i)
    dtype = (np.float32, np.float64)[i % 2]
    # Big enough (a few ms each) that the threads' core calls overlap.
    B, Tq, Tk, d_in, h = 1 + i % 3, 120 + 13 * i, 100 + 11 * i, 16 + i, 1 + i % 4
    dk = 8 + i
    kw = dict(
        x=r.standard_normal((B, Tq, d_in)).astype(dtype),
        w_q=r.standard_normal((h, d_in, dk)).astype(dtype),
        w_k=r.standard_normal((h, d_in, dk)).astype(dtype),
        w_v=r.standard_normal((h, d_in, 2 + i)).astype(dtype),
        key=r.standard_normal((B, Tk, d_in)).astype(dtype),
        causal=bool(i % 2),
        mask=(r.random((Tq, Tk)) > 0.1) if i % 3 == 0 else None,
        key_lengths=r.integers(0, Tk + 1, B) if i % 4 == 1 else None,
    )
    return kw


def call(kw):
    kw = dict(kw)
    x = kw.pop("x")
    w_q, w_k, w_v = kw.pop("w_q"), kw.pop("w_k"), kw.pop("w_v")
    out, w = mhattn.multi_head_attention(x, w_q, w_k, w_v, return_weights=True, **kw)
    return out.tobytes() + w.tobytes()


def hammer(cases, want, reps, stop=None):
    """Run every case on its own thread, reps times; return the mismatches."""
    barrier = threading.Barrier(len(cases))
    errors = []

    def worker(i):
        try:
            barrier.wait(timeout=30)
            for _ in range(reps):
                if call(cases[i]) != want[i]:
                    errors.append(f"thread {i}: bits differ from the serial call")
        except Exception as e:   # noqa: BLE001 - reported to the main thread
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if stop is not None:
        stop.set()
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


def test_threads_give_the_serial_bits():
    cases = [make_case(i) for i in range(N_THREADS)]
    want = [call(c) for c in cases]
    assert len(set(want)) == N_THREADS          # the cases really differ
    assert not hammer(cases, want, reps=15)


def test_threads_detect_a_wrong_answer():
    """The comparison itself can fail: a wrong expectation is reported."""
    cases = [make_case(i) for i in range(2)]
    want = [call(cases[1]), call(cases[0])]     # swapped on purpose
    assert len(hammer(cases, want, reps=1)) == 2


@pytest.mark.skipif(not hasattr(mhattn, "set_num_threads"),
                    reason="mhattn.set_num_threads does not exist yet")
def test_calls_while_the_thread_count_changes():
    cases = [make_case(i) for i in range(4)]
    want = [call(c) for c in cases]
    before = mhattn.get_num_threads() if hasattr(mhattn, "get_num_threads") else None
    stop = threading.Event()

    def changer():
        n = 0
        while not stop.is_set():
            mhattn.set_num_threads(1 + n % 4)
            n += 1
            time.sleep(0.001)

    t = threading.Thread(target=changer)
    t.start()
    try:
        errors = hammer(cases, want, reps=10, stop=stop)
    finally:
        stop.set()
        t.join(timeout=30)
        if before is not None:
            mhattn.set_num_threads(before)
    assert not errors


def wait_child(pid, timeout=60):
    """The child's exit code; kills it and fails if it hangs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung calling mhattn")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("busy", [False, True], ids=["idle", "mid-call"])
def test_fork_child_can_call(busy):
    """After mhattn has run (and, for mid-call, while another thread is
    inside the core), a forked child gets the same bits."""
    case = make_case(3)
    want = call(case)
    stop = threading.Event()
    bg = None
    if busy:
        big = make_case(7)

        def background():
            while not stop.is_set():
                call(big)

        bg = threading.Thread(target=background)
        bg.start()
        time.sleep(0.05)
    try:
        pid = os.fork()
        if pid == 0:   # the child: never return into pytest
            code = 3
            try:
                code = 0 if call(case) == want else 1
            finally:
                os._exit(code)
        assert wait_child(pid) == 0
    finally:
        stop.set()
        if bg is not None:
            bg.join(timeout=60)
