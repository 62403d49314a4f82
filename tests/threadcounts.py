"""Runs a call at several thread counts, for the tests that hold its bits
to be the same for any of them."""
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
