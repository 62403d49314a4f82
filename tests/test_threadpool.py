"""threadpoolctl sees and limits mhattn's pool, whichever is imported first."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mhattn

threadpoolctl = pytest.importorskip("threadpoolctl")

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(mhattn.__file__)))


def run(code, env_extra=None):
    """Runs code in a fresh interpreter that imports this mhattn; its stdout."""
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MHATTN_NUM_THREADS", None)
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def mhattn_entries():
    return [i for i in threadpoolctl.threadpool_info() if i["user_api"] == "mhattn"]


CHECK = """
    import os
    import mhattn, threadpoolctl
    info = [i for i in threadpoolctl.threadpool_info() if i["user_api"] == "mhattn"]
    assert len(info) == 1, threadpoolctl.threadpool_info()
    i = info[0]
    assert i["internal_api"] == "mhattn", i
    assert i["version"] == mhattn.__version__, i
    assert os.path.realpath(i["filepath"]) == os.path.realpath(mhattn._C.__file__), i
    assert i["num_threads"] == mhattn.get_num_threads(), i
    mhattn.set_num_threads(3)
    assert [j["num_threads"] for j in threadpoolctl.threadpool_info()
            if j["user_api"] == "mhattn"] == [3]
    with threadpoolctl.threadpool_limits(1):
        assert mhattn.get_num_threads() == 1
    assert mhattn.get_num_threads() == 3
    with threadpoolctl.threadpool_limits(limits=2, user_api="mhattn"):
        assert mhattn.get_num_threads() == 2
    assert mhattn.get_num_threads() == 3
    print("ok")
"""


@pytest.mark.parametrize("first", ["mhattn", "threadpoolctl"])
def test_both_import_orders(first):
    other = "threadpoolctl" if first == "mhattn" else "mhattn"
    assert run(f"import {first}\nimport {other}\n" + textwrap.dedent(CHECK)) == "ok\n"


def test_import_from_inside_a_function_and_importlib():
    # The finder must also serve importlib.import_module and a later import.
    code = """
        import importlib, mhattn
        def f():
            return importlib.import_module("threadpoolctl")
        tpc = f()
        assert [i["user_api"] for i in tpc.threadpool_info()].count("mhattn") == 1
        import sys
        assert not any(type(m).__name__ == "_Finder" for m in sys.meta_path)
        print("ok")
    """
    assert run(code) == "ok\n"


def test_mhattn_does_not_import_threadpoolctl():
    code = """
        import sys, mhattn
        mhattn.multi_head_attention(__import__("numpy").ones((2, 4), "float32"),
                                    *[__import__("numpy").eye(4, dtype="float32")] * 4,
                                    num_heads=2)
        print("threadpoolctl" in sys.modules)
    """
    assert run(code) == "False\n"


def test_another_extension_named_C_is_not_mhattn(tmp_path):
    # A copy of mhattn's own extension, loaded as a plain library under a
    # file name threadpoolctl matches, must not be taken for the pool.
    import shutil
    fake = tmp_path / os.path.basename(mhattn._C.__file__)
    shutil.copy(mhattn._C.__file__, fake)
    code = f"""
        import ctypes, os, mhattn, threadpoolctl
        fake = os.path.realpath({str(fake)!r})
        ctypes.CDLL(fake)
        if os.path.exists("/proc/self/maps"):  # the copy is loaded: it could match
            assert fake in open("/proc/self/maps").read()
        mine = [i for i in threadpoolctl.threadpool_info() if i["user_api"] == "mhattn"]
        assert len(mine) == 1 and os.path.realpath(mine[0]["filepath"]) == \\
            os.path.realpath(mhattn._C.__file__), mine
        print("ok")
    """
    assert run(code) == "ok\n"


@pytest.fixture
def threads3():
    mhattn.set_num_threads(3)
    yield
    mhattn.set_num_threads(None)


def test_context_manager_restores(threads3):
    assert [i["num_threads"] for i in mhattn_entries()] == [3]
    with threadpoolctl.threadpool_limits(1) as lim:
        assert mhattn.get_num_threads() == 1
        assert [i["num_threads"] for i in mhattn_entries()] == [1]
        assert lim.get_original_num_threads()["mhattn"] == 3
    assert mhattn.get_num_threads() == 3


def test_decorator_and_controller_wrap(threads3):
    @threadpoolctl.threadpool_limits.wrap(limits=1, user_api="mhattn")
    def inside():
        return mhattn.get_num_threads()

    @threadpoolctl.ThreadpoolController().wrap(limits=2, user_api="mhattn")
    def inside2():
        return mhattn.get_num_threads()

    assert inside() == 1
    assert mhattn.get_num_threads() == 3
    assert inside2() == 2
    assert mhattn.get_num_threads() == 3


def test_nested_and_special_limits(threads3):
    with threadpoolctl.threadpool_limits(2):
        assert mhattn.get_num_threads() == 2
        with threadpoolctl.threadpool_limits(1, user_api="mhattn"):
            assert mhattn.get_num_threads() == 1
        assert mhattn.get_num_threads() == 2
    assert mhattn.get_num_threads() == 3
    with threadpoolctl.threadpool_limits(limits="sequential_blas_under_openmp"):
        assert mhattn.get_num_threads() == 3  # that one names only BLAS
    with threadpoolctl.threadpool_limits(limits={"mhattn": 1, "blas": 1}):
        assert mhattn.get_num_threads() == 1
    with threadpoolctl.threadpool_limits(limits=mhattn_entries()):
        assert mhattn.get_num_threads() == 3
    assert mhattn.get_num_threads() == 3
    info = [i for i in threadpoolctl.threadpool_info(debugging_info=True)
            if i["user_api"] == "mhattn"]
    assert len(info) == 1 and info[0]["num_threads"] == 3


def test_limit_one_gives_the_same_bits(threads3):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 64, 64)).astype(np.float32)
    w = [rng.standard_normal((64, 64)).astype(np.float32) for _ in range(4)]
    y3 = mhattn.multi_head_attention(x, *w, num_heads=4)
    with threadpoolctl.threadpool_limits(1):
        assert mhattn.get_num_threads() == 1
        y1 = mhattn.multi_head_attention(x, *w, num_heads=4)
    assert y1.tobytes() == y3.tobytes()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_limit_one_starts_no_worker():
    # In a fresh process, a call under threadpool_limits(1) starts no pool
    # thread; the same call at 2 threads afterwards starts one.
    code = """
        import os, numpy as np, mhattn, threadpoolctl
        mhattn.set_num_threads(2)
        x = np.ones((4, 64, 64), np.float32)
        w = [np.eye(64, dtype=np.float32)] * 4
        n0 = len(os.listdir("/proc/self/task"))
        with threadpoolctl.threadpool_limits(1, user_api="mhattn"):
            mhattn.multi_head_attention(x, *w, num_heads=4)
        n1 = len(os.listdir("/proc/self/task"))
        mhattn.multi_head_attention(x, *w, num_heads=4)
        n2 = len(os.listdir("/proc/self/task"))
        print(n1 - n0, n2 - n1)
    """
    assert run(code) == "0 1\n"
