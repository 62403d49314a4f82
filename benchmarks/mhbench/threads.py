"""Threads for mhattn, torch and NumPy's BLAS.

Imports no NumPy: ``set_blas_env`` must run before NumPy is imported,
since its BLAS sizes its thread pool once, at load.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Dict, List

BLAS_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0))


def early_thread_count(argv: List[str]) -> int:
    """--threads, read before NumPy is imported: its BLAS sizes its pool once."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--threads", type=int, default=None)
    n = pre.parse_known_args(argv)[0].threads
    return n if n and n > 0 else usable_cpus()


def set_blas_env(n: int) -> None:
    """The reference's speed is NumPy's BLAS; give it as many threads as the
    others.  An explicit setting in the environment wins, and the header
    says which."""
    for var in BLAS_VARS:
        os.environ.setdefault(var, str(n))


def set_jax_env(n: int) -> str:
    """JAX's environment, before jax is imported (XLA reads it once):
    the CPU platform, and its threads where XLA lets them be set.  Returns
    what the header says about JAX's threads.

    XLA's CPU client sizes its pool to the CPUs this process may use and has
    no flag for another count; --xla_cpu_multi_thread_eigen=false makes its
    Eigen kernels single-threaded, which is the n = 1 case only.  An explicit
    XLA_FLAGS in the environment wins."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    cpus = usable_cpus()
    if "XLA_FLAGS" in os.environ:
        return f"XLA_FLAGS={os.environ['XLA_FLAGS']!r} from the environment"
    if n == 1:
        os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"
        return "1 (XLA_FLAGS=--xla_cpu_multi_thread_eigen=false)"
    if n == cpus:
        return f"{cpus} (XLA's default: the usable CPUs)"
    return (f"{cpus}, NOT {n}: XLA's CPU client has no thread-count flag, it uses "
            "every usable CPU")


def set_threads(n: int, torch=None) -> Dict[str, Any]:
    """Give mhattn and torch (the module, or None) n threads; report what
    each says it uses."""
    import mhattn   # here, not at the top: see the module's docstring

    info: Dict[str, Any] = {"requested": n}
    setter = getattr(mhattn, "set_num_threads", None)
    getter = getattr(mhattn, "get_num_threads", None)
    if setter is not None:
        setter(n)
    info["mhattn"] = getter() if getter is not None else None
    info["mhattn_api"] = setter is not None
    if torch is not None:
        torch.set_num_threads(n)
        info["torch"] = torch.get_num_threads()
    info["blas_env"] = {v: os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    return info
