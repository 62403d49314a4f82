"""Half precision (issue 36): which dtypes are half, the rule that a call's
numbers share one, and the casts between them and float32.

float16 and bfloat16 are storage formats in mhattn: a half call's inputs
are widened to float32 (exactly), the core computes in float32, and each
result is rounded once, to nearest even, into the inputs' dtype. The casts
are the core's (``mha_convert``, through ``_C.cast_half``): the same bits
on every ISA and thread count, and many times faster than NumPy's casts.

The module sits below :mod:`mhattn._internal.core` (which imports it), so
core hands it the C cast at import: :data:`cast_half` is ``_C.cast_half``
from then on (the package's ``__init__`` imports core first).

bfloat16 is ``ml_dtypes.bfloat16`` (what JAX hands NumPy). It is recognised
by its name and size, so mhattn never imports ml_dtypes unless a caller
asks for a bfloat16 dtype by name (:func:`bfloat16_dtype`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import numpy as np

__all__ = ["F16", "F32", "is_bfloat16", "is_half", "half_of", "shared_half", "widen",
           "narrow", "narrow_like", "bfloat16_dtype", "ACCEPTED"]

# _C.cast_half(src, dst), installed by mhattn._internal.core at its import.
cast_half: Optional[Callable[[np.ndarray, np.ndarray], None]] = None

F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)

# What every "dtype ... is not supported" message offers instead.
ACCEPTED = ("float16, bfloat16 (ml_dtypes), float32 or float64; integers are "
            "promoted to float64")


def is_bfloat16(dt: np.dtype) -> bool:
    """Whether ``dt`` is a bfloat16 dtype (ml_dtypes', or any registered
    under that name), without importing ml_dtypes."""
    return (dt.kind == "V" and dt.itemsize == 2 and dt.fields is None
            and dt.type.__name__ == "bfloat16")


def is_half(dt: np.dtype) -> bool:
    """float16 (either byte order) or bfloat16."""
    return (dt.kind == "f" and dt.itemsize == 2) or is_bfloat16(dt)


def half_of(dt: np.dtype) -> Optional[np.dtype]:
    """The native half dtype ``dt`` stands for, or None: a byte-swapped
    float16 is float16."""
    if dt.kind == "f" and dt.itemsize == 2:
        return F16
    return dt if is_bfloat16(dt) else None


def shared_half(named: Sequence[Tuple[str, Optional[np.ndarray]]]) -> Optional[np.dtype]:
    """The half dtype of a call whose numbers are half, else None.

    ``named``: (argument name, array or None) for every input that carries
    the call's numbers (x, key, value, the weights and their biases, a
    gradient). If any is half, every one must have that dtype: otherwise a
    TypeError names the first that differs, both dtypes, and the first half
    argument. A float32 / float64 mix without half promotes as before."""
    first = None
    for name, a in named:
        if a is not None and is_half(a.dtype):
            first = (name, half_of(a.dtype))
            break
    if first is None:
        return None
    hname, hdt = first
    for name, a in named:
        if a is not None and half_of(a.dtype) != hdt:
            raise TypeError(
                f"{name}: dtype {a.dtype} does not match {hname}'s {hdt}; in a half "
                "precision call the inputs that carry numbers (x, key, value, the "
                f"weights and biases) share one dtype: pass {name}.astype({hname}.dtype)")
    return hdt


def widen(a: np.ndarray) -> np.ndarray:
    """A new float32 array of a half array's values (exact)."""
    src = np.require(a, half_of(a.dtype), ("C", "A"))
    out = np.empty(a.shape, F32)
    cast_half(src, out)
    return out


def narrow(a: np.ndarray, dt: np.dtype) -> np.ndarray:
    """A new array of dtype ``dt`` (half) of float32 ``a``, each value rounded
    once to nearest even (past the half range: inf)."""
    src = np.require(a, F32, ("C", "A"))
    out = np.empty(a.shape, dt)
    cast_half(src, out)
    return out


def narrow_like(a: Optional[np.ndarray], dt: np.dtype) -> Optional[np.ndarray]:
    """:func:`narrow` for a half ``dt``; ``a`` itself (or None) otherwise."""
    if a is None or not is_half(dt):
        return a
    return narrow(a, dt)


def bfloat16_dtype() -> np.dtype:
    """``np.dtype(ml_dtypes.bfloat16)``; ImportError naming the extra when
    ml_dtypes is missing."""
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError("bfloat16 needs the ml_dtypes package: pip install "
                          "mhattn[bf16] (or pip install ml_dtypes)") from None
    return np.dtype(ml_dtypes.bfloat16)


def as_dtype(name: str, value: Any) -> np.dtype:
    """A caller's dtype argument (np.float16, 'bfloat16', ml_dtypes.bfloat16,
    a torch dtype's name...) as a NumPy dtype; TypeError naming ``name``."""
    if isinstance(value, str) and value.replace("torch.", "") == "bfloat16":
        return bfloat16_dtype()
    try:
        return np.dtype(value)
    except TypeError:
        raise TypeError(f"{name}: expected a dtype ({ACCEPTED.split(';')[0]}), "
                        f"got {value!r}") from None
