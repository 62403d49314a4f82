"""Runs a call at several thread counts, for the tests that hold its bits
to be the same for any of them."""
import numpy as np

import mhattn


def at_thread_counts(fn, counts=(1, 2, 3)):
    """[fn() at each thread count of ``counts``], the count in force restored."""
    before = mhattn.get_num_threads()
    runs = []
    try:
        for n in counts:
            mhattn.set_num_threads(n)
            runs.append(fn())
    finally:
        mhattn.set_num_threads(before)
    return runs


def assert_same_bits_at_thread_counts(forward, backward, counts=(1, 2, 3)):
    """forward() (an array) and backward() (a dict of arrays) at each thread
    count of ``counts``: every run's bits those of the first."""
    runs = at_thread_counts(lambda: (forward(), backward()), counts)
    for out, grads in runs[1:]:
        np.testing.assert_array_equal(out, runs[0][0])
        for name in grads:
            np.testing.assert_array_equal(grads[name], runs[0][1][name], err_msg=name)
