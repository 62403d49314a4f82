"""Run-time settings of the C core: the SIMD instruction set and threads.

The core picks its kernels from the CPU (AVX-512 or AVX2 + FMA on x86-64,
NEON on aarch64, or portable C) and runs on a persistent pool of threads. Every result is the same
whatever the thread count: work is split into fixed tiles, each computed
by one thread.
"""
from __future__ import annotations

import operator
from typing import Optional

from . import core

__all__ = ["get_isa", "set_num_threads", "get_num_threads", "_set_isa"]

_ISAS = ("scalar", "avx2", "avx512", "neon")


def get_isa() -> str:
    """The instruction set of the kernels in force: "avx512", "avx2", "neon" or "scalar".

    Detected once from the CPU and OS: "avx512" or "avx2" on x86-64, "neon"
    on every aarch64 CPU, "scalar" (portable C) elsewhere. The environment
    variable ``MHATTN_ISA=scalar|avx2|avx512|neon`` (read at the first call)
    caps it; ``MHATTN_ISA=scalar`` forces the portable path everywhere.

    Returns
    -------
    str
        "avx512", "avx2", "neon" or "scalar".

    Examples
    --------
    >>> mhattn.get_isa() in ("scalar", "avx2", "avx512", "neon")
    True
    """
    return core.get_isa()


def _set_isa(name: str) -> str:
    """Caps the instruction set at ``name`` (for tests); returns the one in force.

    A cap above what the CPU supports is lowered to what it supports, so
    ``_set_isa("avx512")`` restores the detected set and reveals it. Each
    architecture has its own ladder (scalar < avx2 < avx512 on x86-64,
    scalar < neon on aarch64); another architecture's name is a set this
    CPU lacks, so it too gives the detected one. The test build
    ``MHATTN_EMULATE_AVX512=1`` (setup.py; ``_C.EMULATED_AVX512 == 1``) is
    the exception: there "avx512" runs the AVX-512 kernels' code on plain-C
    lanes on any CPU with AVX2, with AVX-512's bits.
    """
    if name not in _ISAS:
        raise ValueError(f"name: expected one of {', '.join(map(repr, _ISAS))}, got {name!r}")
    return core.set_isa(name)


def set_num_threads(n: Optional[int] = None) -> None:
    """Use ``n`` threads from the next call on; None or 0 restores the default.

    The default is ``MHATTN_NUM_THREADS`` when set to a positive integer,
    else the number of CPUs this process may run on. Counts above 256 are
    capped. Results do not depend on the thread count.

    Parameters
    ----------
    n : int or None, default None
        The thread count, >= 0 (ValueError otherwise; TypeError for a
        bool or a non-integer); None or 0 for the default.

    Examples
    --------
    >>> mhattn.set_num_threads(1)
    >>> mhattn.get_num_threads()
    1
    >>> mhattn.set_num_threads(None)      # back to the default
    """
    if n is None:
        n = 0
    if isinstance(n, bool):
        raise TypeError("n: expected an int or None, got bool")
    try:
        n = operator.index(n)
    except TypeError:
        raise TypeError(f"n: expected an int or None, got {type(n).__name__}") from None
    if n < 0:
        raise ValueError(f"n: expected a thread count >= 0 (0 = default), got {n}")
    core.set_num_threads(min(n, 256))


def get_num_threads() -> int:
    """The number of threads the core uses for the next call.

    Returns
    -------
    int
        The count :func:`set_num_threads` set (at most 256), or the default.

    Examples
    --------
    >>> mhattn.get_num_threads() >= 1
    True
    """
    return core.get_num_threads()
