"""Reading a caller's object as an array, with errors that name the argument.

The lowest layer of argument checking: :mod:`mhattn._internal.args` and
:mod:`mhattn._internal.variants` are built on it.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .half import ACCEPTED, bfloat16_dtype, is_bfloat16


def _shape(a: Any) -> str:
    s = getattr(a, "shape", None)
    if s is not None:
        return str(tuple(s))
    return type(a).__name__


def _to_array(name: str, obj: Any) -> np.ndarray:
    """np.asarray with errors that name the argument; never copies arrays."""
    if obj is None:
        raise TypeError(f"{name}: expected an array, got None")
    if isinstance(obj, np.ndarray):
        if type(obj) is np.ndarray:
            return obj
        # Subclasses (np.matrix, np.memmap, user classes) are read through a
        # plain ndarray view, so their overrides of indexing or arithmetic
        # cannot change what the core sees. A masked array's mask would be
        # silently dropped, so it is refused instead.
        import numpy.ma
        if isinstance(obj, numpy.ma.MaskedArray):
            raise TypeError(f"{name}: masked arrays are not supported; pass "
                            f"{name}.filled(...) and express the mask with mask= "
                            "or key_lengths=")
        return np.asarray(obj)
    if getattr(type(obj), "_packs_weights", False):   # a PackedWeights
        raise TypeError(f"{name}: a PackedWeights is not an array: "
                        "multi_head_attention and its gradient take one in place of "
                        "w_q, with w_k, w_v and w_o left out")
    if isinstance(obj, (str, bytes, dict, set)):
        raise TypeError(f"{name}: expected an array of numbers, got {type(obj).__name__}")
    if getattr(obj, "requires_grad", False) is True and hasattr(obj, "detach"):
        # torch refuses to share the memory of a tensor in the autograd graph
        # (its RuntimeError would name no argument); mhattn does not detach
        # silently, since no gradient would flow back to it.
        raise TypeError(f"{name}: a torch tensor that requires grad cannot be read as "
                        f"a NumPy array; pass {name}.detach() (mhattn's gradients come "
                        "from mhattn.backward, not from autograd)")
    if str(getattr(obj, "dtype", "")) == "torch.bfloat16" and hasattr(obj, "detach"):
        return _torch_bfloat16(name, obj)
    try:
        arr = np.asarray(obj)
    except (ValueError, TypeError) as exc:
        raise TypeError(f"{name}: cannot be read as an array of numbers ({exc})") from None
    return arr


def _check_numeric(name: str, arr: np.ndarray) -> None:
    kind = arr.dtype.kind
    if kind in "iuf":
        if kind == "f" and arr.dtype.itemsize > 8:
            raise TypeError(
                f"{name}: dtype {arr.dtype} is not supported; mhattn computes in "
                "float32 or float64 (cast with .astype(np.float64))")
        return
    if is_bfloat16(arr.dtype):
        return
    if kind == "V" and arr.dtype.fields is None:
        # ml_dtypes' float8 / int4 types and the like: not structured
        what = f"dtype {arr.dtype} ({arr.dtype.itemsize}-byte, not a float mhattn knows)"
    else:
        what = f"dtype {arr.dtype} ({_KIND_NAMES.get(kind, str(arr.dtype))})"
    raise TypeError(f"{name}: {what} is not supported; pass {ACCEPTED}")


_KIND_NAMES = {"b": "bool", "c": "complex", "O": "object", "U": "string", "S": "bytes",
               "V": "structured", "M": "datetime", "m": "timedelta"}


def _torch_bfloat16(name: str, t: Any) -> np.ndarray:
    """A torch.bfloat16 tensor as a NumPy ``ml_dtypes.bfloat16`` array of the
    same bits (NumPy has no bfloat16 of its own, so torch cannot share it)."""
    import sys
    torch = sys.modules["torch"]   # the tensor's own module: already imported
    try:
        dt = bfloat16_dtype()
    except ImportError as e:
        raise TypeError(f"{name}: a torch.bfloat16 tensor is read as an "
                        f"ml_dtypes.bfloat16 array; {e}") from None
    bits = t.detach().cpu().contiguous().view(torch.int16).numpy()
    return bits.view(dt)
