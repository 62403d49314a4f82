"""Argument checking and normalisation shared by the C path and the reference.

Every public entry point (``mhattn.multi_head_attention``, the reference, the
trace, the layer class) turns its arguments into one :class:`Call` through
:func:`normalize`.  This is where the user-facing errors are raised: each one
names the argument and the shapes it saw.  What exists only in Python is
checked here: the forms of the weights and how they split into heads,
Python types. The rules about a call's config (head counts, ...) are the
core's (csrc/core/config.c), which the one door to _C reports in the
user's names (mhattn._internal.fields); Python never re-checks them.

Letters follow the C core (``csrc/mha.h``): B batch, Tq queries, Tk keys,
H query heads, G key/value heads, dk[g] / dv[g] the widths of kv head g.
"""
from __future__ import annotations

import math
import numbers
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import numpy as np

from .arrays import _check_numeric, _shape, _to_array
from .half import F32, is_half, shared_half, widen
from .variants import (VARIANT_DEFAULTS, Variants, normalize_variants, variant_floats,
                       variants_tuple)

__all__ = ["Call", "normalize", "compute_dtype", "check_memory", "core_items",
           "memory_limit", "plan", "bool_arg", "fused_widths", "head_scales",
           "offsets", "PER_HEAD_BYTES", "backward_items", "ambiguous_mask"]


_NATIVE_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def compute_dtype(arrays: Sequence[np.ndarray]) -> np.dtype:
    """NumPy promotion with a float32 floor: integers count as float64."""
    first = arrays[0].dtype
    if first in _NATIVE_FLOATS and all(a.dtype == first for a in arrays):
        return first   # the common case: one float dtype
    kinds = []
    for a in arrays:
        if a.dtype.kind == "f":
            kinds.append(a.dtype)
        else:  # integers: NumPy's own int-with-float promotion gives float64
            kinds.append(np.dtype(np.float64))
    dt = np.result_type(np.float32, *kinds)
    return np.dtype(np.float64) if dt.itemsize > 4 else np.dtype(np.float32)


# What one call may plan to allocate, in bytes. Found once; a test may lower it.
_memory_limit_bytes: Optional[int] = None

# Python-side cost of one head (views, offsets, scales), generously rounded
# up: it bounds num_heads before any per-head list is built.
PER_HEAD_BYTES = 4096


def memory_limit() -> int:
    """The machine's physical memory, or the cgroup's limit when lower.

    A call that plans to allocate more than this cannot succeed without
    thrashing or waking the OOM killer (which takes a notebook kernel with
    it), so it raises MemoryError before allocating anything.
    """
    global _memory_limit_bytes
    if _memory_limit_bytes is None:
        limit = 1 << 62
        try:
            limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            pass
        for path in ("/sys/fs/cgroup/memory.max",
                     "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
            try:
                with open(path) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text.isdigit():
                limit = min(limit, int(text))
        _memory_limit_bytes = max(int(limit), 1)
    return _memory_limit_bytes


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def check_memory(items: Sequence[tuple]) -> None:
    """Raise MemoryError, naming the sizes, when a call's plan cannot fit.

    items: (what, formula, factors, itemsize), e.g. ("return_weights=True",
    "B*h*T_q*T_k", (B, H, Tq, Tk), 4). Python integers cannot overflow, so
    products beyond size_t are caught here too, before NumPy or the core
    is asked for them.
    """
    total = 0
    for _, _, factors, itemsize in items:
        total += math.prod(map(int, factors)) * itemsize   # Python ints: exact
    limit = memory_limit()
    if total <= limit:
        return
    sized = []
    for what, formula, factors, itemsize in items:
        count = math.prod(map(int, factors))
        sized.append((count * itemsize, count, what, formula, factors))
    sized.sort(key=lambda s: -s[0])
    parts = []
    for nbytes, count, what, formula, factors in sized[:3]:
        if nbytes == 0:
            break
        values = "*".join(str(int(f)) for f in factors)
        parts.append(f"{what} needs {formula} = {values} = {count} elements "
                     f"({_gib(nbytes)})")
    raise MemoryError(f"{'; '.join(parts)}: about {_gib(total)} in all, more than "
                      f"the {_gib(limit)} of memory on this machine")


def _check_head_count(name: str, h: int) -> None:
    if h * PER_HEAD_BYTES > memory_limit():
        raise MemoryError(f"{name}: {h} heads would need about "
                          f"{_gib(h * PER_HEAD_BYTES)} of per-head bookkeeping, more "
                          f"than the {_gib(memory_limit())} of memory on this machine")


def _int_arg(name: str, value: Any, *, allow_none: bool = True) -> Optional[int]:
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"{name}: expected a positive integer, got None")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected a positive integer, got {value!r} "
                        f"({type(value).__name__})")
    value = int(value)
    if value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value}")
    return value


def _is_head_list(w: Any) -> bool:
    """A list/tuple whose items are 2-D matrices is the per-head form.

    A nested list of numbers ([[1, 0], [0, 1]]) is one 2-D array instead."""
    if not isinstance(w, (list, tuple)):
        return False
    if len(w) == 0:
        return True
    if any(isinstance(item, np.ndarray) for item in w):
        return True
    first = w[0]
    try:
        return np.ndim(first) == 2
    except Exception:  # ragged or odd items: let _heads report it
        return True


@dataclass
class _Heads:
    """One weight argument split per head: the views, and the form it came in."""
    form: str                 # "fused" | "stacked" | "list"
    heads: List[np.ndarray]   # per head, (d_rows, width_i), original dtype, views
    widths: List[int]
    rows: int
    array: Optional[np.ndarray]  # the whole fused (2-D) or stacked (3-D) array; None for lists

    def fused(self) -> np.ndarray:
        """(rows, sum widths): head i owns the i-th block of columns."""
        if self.form == "fused":
            return self.array
        if self.form == "stacked":
            h, rows, width = self.array.shape
            return self.array.transpose(1, 0, 2).reshape(rows, h * width)
        return np.concatenate(self.heads, axis=1)


def _split_weight(name: str, w: Any, count: Optional[int], count_name: str) -> _Heads:
    if _is_head_list(w):
        if len(w) == 0:
            raise ValueError(f"{name}: the per-head list is empty")
        heads = []
        for i, item in enumerate(w):
            a = _to_array(f"{name}[{i}]", item)
            _check_numeric(f"{name}[{i}]", a)
            if a.ndim != 2:
                raise ValueError(f"{name}[{i}]: each head's matrix must be 2-D "
                                 f"(d_in, d_head), got shape {a.shape}")
            heads.append(a)
        rows = heads[0].shape[0]
        for i, a in enumerate(heads):
            if a.shape[0] != rows:
                raise ValueError(
                    f"{name}: heads disagree on the input width: {name}[0] has shape "
                    f"{heads[0].shape}, {name}[{i}] has shape {a.shape}")
        if count is not None and len(heads) != count:
            raise ValueError(f"{name}: the list has {len(heads)} heads but "
                             f"{count_name}={count}")
        return _Heads("list", heads, [a.shape[1] for a in heads], rows, None)

    a = _to_array(name, w)
    _check_numeric(name, a)
    if a.ndim == 3:
        h, rows, width = a.shape
        if h == 0:
            raise ValueError(f"{name}: stacked weights of shape {a.shape} have no heads")
        if count is not None and h != count:
            raise ValueError(f"{name}: stacked weights of shape {a.shape} have {h} heads "
                             f"but {count_name}={count}")
        _check_head_count(name, h)
        return _Heads("stacked", [a[i] for i in range(h)], [width] * h, rows, a)
    if a.ndim == 2:
        rows, total = a.shape
        if count is None:
            raise ValueError(
                f"{name}: fused 2-D weights of shape {a.shape} need {count_name} "
                "to know how to split the columns into heads")
        if total % count != 0 or total == 0:
            raise ValueError(
                f"{name}: {count_name}={count} does not divide the fused width "
                f"{total} of shape {a.shape}")
        width = total // count
        _check_head_count(name, count)
        heads = [a[:, i * width:(i + 1) * width] for i in range(count)]
        return _Heads("fused", heads, [width] * count, rows, a)
    raise ValueError(
        f"{name}: expected fused 2-D (d_in, h*d_head), stacked 3-D (h, d_in, d_head) "
        f"or a list of per-head 2-D arrays, got an array of shape {a.shape}")


def bool_arg(name: str, value: Any) -> bool:
    """True or False (or NumPy's), nothing else: 1, "yes" and arrays raise."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {value!r:.80} "
                        f"({type(value).__name__})")
    return bool(value)


def _ndim_or_none(obj: Any) -> Optional[int]:
    """np.ndim, or None for what NumPy cannot read (a ragged list...)."""
    try:
        return np.ndim(obj)
    except Exception:
        return None


def _split_bias(name: str, b: Any, widths: List[int]) -> Optional[List[np.ndarray]]:
    """Biases come fused (sum widths,), stacked (h, width) or as a per-head list."""
    if b is None:
        return None
    h = len(widths)
    if isinstance(b, (list, tuple)) and len(b) > 0 and _ndim_or_none(b[0]) == 1:
        if len(b) != h:
            raise ValueError(f"{name}: the list has {len(b)} biases but there are {h} heads")
        out = []
        for i, item in enumerate(b):
            a = _to_array(f"{name}[{i}]", item)
            _check_numeric(f"{name}[{i}]", a)
            if a.shape != (widths[i],):
                raise ValueError(f"{name}[{i}]: expected shape ({widths[i]},) to match "
                                 f"head {i}'s weight, got {a.shape}")
            out.append(a)
        return out
    a = _to_array(name, b)
    _check_numeric(name, a)
    total = sum(widths)
    if a.ndim == 1:
        if a.shape[0] != total:
            raise ValueError(f"{name}: expected shape ({total},) (the fused width of "
                             f"{h} heads), got {a.shape}")
        offs = offsets(widths)
        return [a[offs[i]:offs[i + 1]] for i in range(h)]
    if a.ndim == 2 and len(set(widths)) == 1:
        if a.shape != (h, widths[0]):
            raise ValueError(f"{name}: expected shape ({h}, {widths[0]}) (heads, width), "
                             f"got {a.shape}")
        return [a[i] for i in range(h)]
    raise ValueError(f"{name}: expected shape ({total},) or a per-head list, got {a.shape}")


def offsets(widths: Sequence[int]) -> List[int]:
    """Where each block of a fused buffer starts, and its end: head i owns
    [offsets[i], offsets[i + 1])."""
    out = [0]
    for w in widths:
        out.append(out[-1] + w)
    return out


def fused_widths(H: int, G: int, Sk: int, Sv: int) -> tuple:
    """(Sq, Svq): the widths of the fused queries and of the concatenation.

    Query head h uses kv head h // (H // G), so each kv head's widths (whose
    sums are Sk and Sv) appear H // G times (csrc/mha.h)."""
    group = H // G
    return group * Sk, group * Sv


def head_scales(H: int, G: int, dk: Sequence[int], scale: Optional[float]) -> List[float]:
    """Each query head's multiplier of Q K^T: ``scale``, or 1/sqrt(d_k)."""
    if scale is not None:
        return [scale] * H
    group = H // G
    # A width of 0 is the core's to reject (mha_check_config); its scale is
    # never read.
    per_kv = [1.0 / math.sqrt(d) if d else 1.0 for d in dk]   # IEEE sqrt, as np.sqrt
    return [per_kv[h // group] for h in range(H)]


@dataclass
class Call:
    """A fully checked call, in the letters of csrc/mha.h.

    Arrays are already in the compute dtype and always batched: x (B, Tq, Din),
    key (B, Tk, Dkin), value (B, Tk, Dvin).  Per-head weights are views.
    """
    dtype: np.dtype                 # the compute dtype: float32 or float64
    batched: bool
    out_dtype: np.dtype             # the results': dtype, or the inputs' half dtype
    x: np.ndarray
    key: np.ndarray
    value: np.ndarray
    key_given: bool
    value_given: bool
    wq: _Heads
    wk: _Heads
    wv: _Heads
    w_o: Optional[np.ndarray]       # (Svq, Dout)
    bq: Optional[List[np.ndarray]]  # per query head
    bk: Optional[List[np.ndarray]]  # per kv head
    bv: Optional[List[np.ndarray]]  # per kv head
    b_o: Optional[np.ndarray]       # (Dout,)
    H: int
    G: int
    dk: List[int]                   # per kv head
    dv: List[int]                   # per kv head
    scales: List[float]             # per query head
    causal: bool
    mask: Optional[np.ndarray]      # broadcast view (B, H, Tq, Tk): bool or dtype
    key_lengths: Optional[np.ndarray]  # (B,) int64
    # The fused widths of the core's buffers (csrc/mha.h): q (B, Tq, Sq),
    # k (B, Tk, Sk), v (B, Tk, Sv), concat (B, Tq, Svq); see fused_widths.
    Sq: int
    Sk: int
    Sv: int
    Svq: int
    # The variants of today's models (mhattn._internal.variants): all off by default.
    var: Variants = field(default_factory=Variants)
    # In a half call: the learnable variants given in the half dtype (their
    # gradients are rounded to it; see compute.grad.backward).
    half_variants: tuple = ()
    # The output gate (csrc/core/gate.h): W^O reads sigmoid(x w_gate +
    # b_gate) * concat. None: no gate.
    w_gate: Optional[np.ndarray] = None     # (Din, Svq)
    b_gate: Optional[np.ndarray] = None     # (Svq,), only with w_gate
    # The mask as given (its gradient's shape and dtype, mask_gradient).
    mask_shape: Optional[tuple] = None
    mask_dtype: Optional[np.dtype] = None

    @property
    def B(self) -> int:
        return self.x.shape[0]

    @property
    def Tq(self) -> int:
        return self.x.shape[1]

    @property
    def Tk(self) -> int:
        return self.key.shape[1]

    @property
    def group(self) -> int:
        return self.H // self.G

    def kv_head(self, h: int) -> int:
        return h // (self.H // self.G)

    @property
    def d_out(self) -> int:
        return self.w_o.shape[1] if self.w_o is not None else self.Svq

    # Where each head lives in the core's fused buffers.
    def q_cols(self, h: int) -> slice:
        return _cols(self.wq.widths, h)

    def k_cols(self, g: int) -> slice:
        return _cols(self.dk, g)

    def v_cols(self, g: int) -> slice:
        return _cols(self.dv, g)

    def concat_cols(self, h: int) -> slice:
        return _cols([self.dv[self.kv_head(i)] for i in range(self.H)], h)

    def unbatch(self, a: np.ndarray) -> np.ndarray:
        return a if self.batched else a[0]


def _cols(widths: Sequence[int], i: int) -> slice:
    """Block i of a fused buffer whose blocks have these widths."""
    offs = offsets(widths[:i + 1])
    return slice(offs[i], offs[i + 1])


def core_items(B: int, Tq: int, Tk: int, H: int, Sq: int, Sk: int, Sv: int,
               Svq: int, d_out: int, has_wo: bool, dtype: np.dtype, *,
               weights: bool = False, keep: bool = False, transforms: bool = False,
               gate: bool = False) -> list:
    """What the C core allocates for a call (see csrc/mha.h), for check_memory."""
    n = dtype.itemsize
    items = [("out", "B*T_q*d_out", (B, Tq, d_out), n),
             ("the query projection", "B*T_q*sum(d_k)", (B, Tq, Sq), n),
             ("the key projection", "B*T_k*sum(d_k)", (B, Tk, Sk), n),
             ("the value projection", "B*T_k*sum(d_v)", (B, Tk, Sv), n)]
    if has_wo or keep:
        items.append(("the concatenated heads", "B*T_q*sum(d_v)", (B, Tq, Svq), n))
    if weights:
        items.append(("return_weights=True", "B*h*T_q*T_k", (B, H, Tq, Tk), n))
    if keep:
        items.append(("the log-sum-exp", "B*h*T_q", (B, H, Tq), n))
    if transforms:
        items.append(("the normed / rotated q and k", "B*T_q*sum(d_k) + B*T_k*sum(d_k)",
                      (B * Tq * Sq + B * Tk * Sk,), n))
    if gate:
        items.append(("the gated concatenation", "B*T_q*sum(d_v)", (B, Tq, Svq), n))
    return items


# The backward's tiles (csrc/kernels/kernels.h): key blocks of MHA_BWD_BK
# rows, and per thread one S and one dP tile of MHA_BWD_BQ x MHA_BWD_BK.
_BWD_BK = 64
_BWD_TILE = 2 * 64 * 64 + 64


def backward_items(call: "Call", threads: int) -> list:
    """What a backward of ``call`` allocates (csrc/core/backward_impl.h,
    bwd_plan and bwd_plan_tiles), for check_memory: the gradients it
    returns and the core's scratch."""
    B, Tq, Tk, H = call.B, call.Tq, call.Tk, call.H
    Din, Dkin, Dvin = call.x.shape[-1], call.key.shape[-1], call.value.shape[-1]
    Sq, Sk, Sv, Svq, d_out = call.Sq, call.Sk, call.Sv, call.Svq, call.d_out
    n = call.dtype.itemsize
    Tk_blocks = -(-Tk // _BWD_BK) * _BWD_BK    # Tk rounded up to whole key blocks
    items = [("the gradient of x", "B*T_q*d_in", (B, Tq, Din), n),
             ("the weights' gradients", "d_in*sum(d_k) + d_kin*sum(d_k) + d_vin*sum(d_v)",
              (Din * Sq + Dkin * Sk + Dvin * Sv,), n),
             ("the backward's packed queries and dQ", "2*B*T_q*sum(d_k)", (2, B, Tq, Sq), n),
             ("the backward's packed d(concat)", "B*T_q*sum(d_v)", (B, Tq, Svq), n),
             ("the backward's packed keys (kh, kT)", "2*B*T_k*sum(d_k), T_k in blocks of 64",
              (2, B, Tk_blocks, Sk), n),
             ("the backward's packed values (vT)", "B*T_k*sum(d_v), T_k in blocks of 64",
              (B, Tk_blocks, Sv), n),
             ("the backward's dK and dV", "B*T_k*(sum(d_k) + sum(d_v))", (B, Tk, Sk + Sv), n),
             ("the backward's D", "B*h*T_q", (B, H, Tq), n),
             ("the backward's tiles", "threads*(2*64*64 + 64)", (threads, _BWD_TILE), n),
             ("the biases' gradients", "sum(d_k) + sum(d_k) + sum(d_v) + d_out",
              (Sq + Sk + Sv + d_out,), n)]
    if call.key_given:
        items.append(("the gradient of key", "B*T_k*d_kin", (B, Tk, Dkin), n))
    if call.value_given:
        items.append(("the gradient of value", "B*T_k*d_vin", (B, Tk, Dvin), n))
    if call.w_o is not None:
        items += [("the gradient of w_o", "sum(d_v)*d_out", (Svq, d_out), n),
                  ("the backward's d(concat)", "B*T_q*sum(d_v)", (B, Tq, Svq), n)]
    if call.var.transforms:
        items.append(("the backward's normed / rotated q and k",
                      "B*T_q*sum(d_k) + B*T_k*sum(d_k)", (B * Tq * Sq + B * Tk * Sk,), n))
    if call.var.q_norm is not None or call.var.k_norm is not None:
        # 1 / RMS per row and head, and LayerNorm's means beside them
        per = 2 if call.var.norm_type == "layer" else 1
        items.append(("the backward's q/k norm factors", f"{per}*(B*T_q*h + B*T_k*g)",
                      (per, B * Tq * H + B * Tk * call.G), 8))
    if call.w_gate is not None:
        # g, gated then dz, and d(concat) (csrc/core/backward_impl.h, bwd_plan)
        items += [("the gradients of w_gate and b_gate", "d_in*sum(d_v) + sum(d_v)",
                   (Din * Svq + Svq,), n),
                  ("the backward's gate, gated concatenation and d(concat)",
                   "3*B*T_q*sum(d_v)", (3, B, Tq, Svq), n)]
    return items


def _cast(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if a.dtype == dtype:
        return a
    # half to float32 by the core's exact cast (NumPy's is many times slower);
    # to float64 (the reference) through it too, exactly
    if is_half(a.dtype):
        return widen(a) if dtype == F32 else widen(a).astype(dtype)
    return a.astype(dtype)


def _seq(name: str, obj: Any, batched: bool, like: str) -> np.ndarray:
    a = _to_array(name, obj)
    _check_numeric(name, a)
    want = 3 if batched else 2
    if a.ndim != want:
        form = "(B, T, d)" if batched else "(T, d)"
        raise ValueError(f"{name}: expected a {want}-D array {form} because {like}, "
                         f"got shape {a.shape}")
    return a


def _user_stacklevel() -> int:
    """The stacklevel of a warning raised here that names the caller of
    mhattn's public function, however deep in the package it is raised."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("mhattn."):
        level += 1
        frame = frame.f_back
    return level


def ambiguous_mask(shape: tuple, B: int, H: int, Tq: int) -> Optional[str]:
    """Why a batched call's mask shape has two readings, or None.

    NumPy broadcasting reads a 3-D mask as (h, T_q, T_k) and a 2-D one as
    (T_q, T_k); a leading size equal to B as well (B > 1) is as likely
    meant per batch item: Keras's (B, T_q, T_k), Hugging Face's (B, T_k)."""
    if B > 1 and len(shape) == 3 and shape[0] == B == H:
        return (f"mask: shape {shape} is ambiguous when B = h = {B}: it would be read "
                "as (h, T_q, T_k). Write mask[:, None] for one (T_q, T_k) mask per "
                "batch item, (B, 1, T_q, T_k), or mask[None] for one per head, "
                "(1, h, T_q, T_k)")
    if B > 1 and len(shape) == 2 and shape[0] == B == Tq:
        return (f"mask: shape {shape} is ambiguous when B = T_q = {B}: it would be read "
                "as (T_q, T_k). Write mask[None] for one (T_q, T_k) mask shared by every "
                "batch item; a (B, T_k) padding mask is key_lengths=, or "
                "mask[:, None, None, :] of shape (B, 1, 1, T_k)")
    return None


def mask_grad_arg(mask_grad: Any, mask: Optional[np.ndarray]) -> bool:
    """``mask_grad`` checked: a bool, True only with an additive (float)
    mask (``mask``: the call's checked mask, or None)."""
    want = bool_arg("mask_grad", mask_grad)
    if want and (mask is None or mask.dtype == bool):
        raise ValueError(f"mask_grad: only an additive (float) mask has a gradient; this "
                         f"call's mask is {'None' if mask is None else 'bool'}")
    return want


def mask_gradient(full: np.ndarray, shape: tuple, batched: bool) -> np.ndarray:
    """The gradient of an additive mask of ``shape`` (as given: broadcast to
    (B, h, T_q, T_k), or (h, T_q, T_k) unbatched) from the core's dmask
    (B, H, Tq, Tk): summed over the axes along which the mask was broadcast
    (NumPy's sums, the same for any thread count), shaped as the mask."""
    g = full if batched else full[0]
    lead = g.ndim - len(shape)
    g = g.sum(axis=tuple(range(lead))) if lead else g
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return np.ascontiguousarray(g.reshape(shape))


def mask_and_form(mask: Any, batched: bool, B: int, H: int, Tq: int, Tk: int,
                  dtype: np.dtype) -> tuple:
    """(view, shape, dtype): the mask checked and broadcast to (B, H, Tq, Tk)
    (bool, or the compute dtype), and the shape and dtype it was given in
    (for its gradient, :func:`mask_gradient`); (None, None, None) for
    none."""
    if mask is None:
        return None, None, None
    m = _to_array("mask", mask)
    kind = "f" if is_half(m.dtype) else m.dtype.kind
    if kind not in "bf" or (kind == "f" and m.dtype.itemsize > 8):
        raise TypeError(f"mask: dtype {m.dtype} is not supported; pass a bool mask "
                        "(True = may attend) or a float mask added to the scores")
    target = (B, H, Tq, Tk) if batched else (H, Tq, Tk)
    if m.ndim > len(target):
        raise ValueError(f"mask: shape {m.shape} has more dimensions than "
                         f"{'(B, h, T_q, T_k)' if batched else '(h, T_q, T_k)'} = {target}")
    why = ambiguous_mask(m.shape, B, H, Tq) if batched else None
    if why is not None:
        raise ValueError(why)
    try:
        view = np.broadcast_to(m, target)
    except ValueError:
        raise ValueError(f"mask: shape {m.shape} does not broadcast to "
                         f"{'(B, h, T_q, T_k)' if batched else '(h, T_q, T_k)'} = {target}"
                         ) from None
    if kind == "b":
        if m.size and not m.any():
            warnings.warn("mask allows no key for any query, so every output row is "
                          "fully masked; mhattn's boolean masks use True = may attend, "
                          "the opposite of nn.MultiheadAttention's: is it inverted?",
                          UserWarning, stacklevel=_user_stacklevel())
    elif m.dtype != dtype or not m.flags.aligned:
        # The glue needs an aligned, native mask; copying the small array
        # before broadcasting keeps it from copying the broadcast view.
        with np.errstate(over="ignore"):  # -1e300 in float32 is -inf, as meant
            view = np.broadcast_to(_cast(m, dtype), target)
    if not batched:
        view = view[np.newaxis]
    return view, m.shape, m.dtype


def _normalize_lengths(key_lengths: Any, batched: bool, B: int, Tk: int) -> Optional[np.ndarray]:
    if key_lengths is None:
        return None
    kl = _to_array("key_lengths", key_lengths)
    if kl.dtype.kind not in "iu":
        raise TypeError(f"key_lengths: expected integers, got dtype {kl.dtype}")
    want = (B,) if batched else ()
    if kl.shape != want:
        raise ValueError(f"key_lengths: expected shape {want} "
                         f"({'one length per batch item' if batched else 'a scalar'}), "
                         f"got {kl.shape}")
    # Each length in [0, T_k]: the core's rule (config_verdict, or the call).
    return kl.reshape(-1).astype(np.int64)


def _sources(x: Any, key: Any, value: Any) -> tuple:
    """(xa, ka, va, batched): x, key and value as arrays, checked against x."""
    xa = _to_array("x", x)
    _check_numeric("x", xa)
    if xa.ndim not in (2, 3):
        raise ValueError(f"x: expected (T_q, d_in) or (B, T_q, d_in), got shape {xa.shape}")
    batched = xa.ndim == 3
    like = f"x has shape {xa.shape}"
    ka = xa if key is None else _seq("key", key, batched, like)
    va = ka if value is None else _seq("value", value, batched, like)
    if batched and ka.shape[0] != xa.shape[0]:
        raise ValueError(f"key: batch size {ka.shape[0]} disagrees with x's "
                         f"{xa.shape[0]} (x {xa.shape}, key {ka.shape})")
    if batched and va.shape[0] != xa.shape[0]:
        raise ValueError(f"value: batch size {va.shape[0]} disagrees with x's "
                         f"{xa.shape[0]} (x {xa.shape}, value {va.shape})")
    if va.shape[-2] != ka.shape[-2]:
        raise ValueError(f"value: has {va.shape[-2]} rows but key has {ka.shape[-2]} "
                         f"(key {ka.shape}, value {va.shape}); they must share T_k")
    return xa, ka, va, batched


def heads_verdict(H: int, G: int, dk=None, dv=None) -> None:
    """Raises the core's ValueError for H query heads and G kv heads that
    cannot be paired, or kv head widths dk, dv it rejects: the rules are the
    core's (mha_check_config). This module sits below the one door to _C,
    which installs the function (mhattn._internal.core.check_heads) when it
    is imported."""
    raise NotImplementedError("mhattn._internal.core is not imported")


def config_verdict(B: int, Tq: int, Tk: int, dk, dv, scales, dtype, *, key_lengths=None,
                   variants=None, lengths_aligned: bool = False) -> None:
    """Raises the core's ValueError for a call's config it rejects
    (mhattn._internal.core.check_config, installed as heads_verdict is)."""
    raise NotImplementedError("mhattn._internal.core is not imported")


def split_heads(w_q: Any, w_k: Any, w_v: Any, num_heads: Optional[int],
                num_kv_heads: Optional[int]) -> tuple:
    """(wq, wk, wv, G): the weights split per head and checked against each
    other (head counts, q and k widths); their sources are not looked at."""
    wq = _split_weight("w_q", w_q, num_heads, "num_heads")
    H = len(wq.heads)
    G = H if num_kv_heads is None else num_kv_heads
    heads_verdict(H, G)   # can the heads be paired? the core says
    kv_name = "num_kv_heads" if num_kv_heads is not None else "num_heads"
    wk = _split_weight("w_k", w_k, G, kv_name)
    wv = _split_weight("w_v", w_v, G, kv_name)
    heads_verdict(H, G, wk.widths, wv.widths)   # is every head a column wide?

    group = H // G
    for h in range(H):
        g = h // group
        if wq.widths[h] != wk.widths[g]:
            raise ValueError(
                f"w_q / w_k: query head {h} has width {wq.widths[h]} but its key head "
                f"{g} has width {wk.widths[g]} (w_q[{h}] {wq.heads[h].shape}, "
                f"w_k[{g}] {wk.heads[g].shape}); q and k must match within a head")
    return wq, wk, wv, G


def _weights(w_q: Any, w_k: Any, w_v: Any, num_heads: Optional[int],
             num_kv_heads: Optional[int], xa: np.ndarray, ka: np.ndarray,
             va: np.ndarray, key: Any, value: Any) -> tuple:
    """(wq, wk, wv, G): the weights split per head, checked against their
    sources and against each other."""
    wq, wk, wv, G = split_heads(w_q, w_k, w_v, num_heads, num_kv_heads)

    d_in, d_kin, d_vin = xa.shape[-1], ka.shape[-1], va.shape[-1]
    if wq.rows != d_in:
        raise ValueError(f"w_q: its heads read {wq.rows} input features but x has "
                         f"{d_in} (x {xa.shape}, w_q head shape {wq.heads[0].shape})")
    if wk.rows != d_kin:
        raise ValueError(f"w_k: its heads read {wk.rows} input features but "
                         f"{'key' if key is not None else 'x'} has {d_kin} "
                         f"({_shape(ka)}, w_k head shape {wk.heads[0].shape})")
    if wv.rows != d_vin:
        src = "value" if value is not None else ("key" if key is not None else "x")
        raise ValueError(f"w_v: its heads read {wv.rows} input features but {src} "
                         f"has {d_vin} ({_shape(va)}, w_v head shape {wv.heads[0].shape})")
    return wq, wk, wv, G


def _vector(name: str, b: Any, want: tuple, what: str) -> Optional[np.ndarray]:
    """w_o or b_o: None, or an array of shape ``want`` (None: any d_out)."""
    if b is None:
        return None
    a = _to_array(name, b)
    _check_numeric(name, a)
    if a.ndim != len(want) or any(n is not None and n != m for n, m in zip(want, a.shape)):
        raise ValueError(what.format(shape=a.shape))
    return a


def _scale_arg(scale: Any) -> Optional[float]:
    """The scale as a float, or None for the default."""
    if scale is None:
        return None
    if isinstance(scale, (bool, np.bool_)) or not isinstance(
            scale, (numbers.Real, np.floating, np.integer)):
        if not (isinstance(scale, np.ndarray) and scale.ndim == 0
                and scale.dtype.kind in "iuf"):
            raise TypeError(f"scale: expected a real number or None, got {scale!r} "
                            f"({type(scale).__name__})")
    try:
        return float(scale)
    except OverflowError:
        raise ValueError(f"scale: a {type(scale).__name__} of {len(str(scale))} "
                         "digits is too large for a float") from None


def _cast_items(dtype: np.dtype, xa, ka, va, wo, bo, weights, wg=None, bg=None) -> list:
    """check_memory items of the casts of normalize's arrays to dtype."""
    items = [(f"casting {n} to {dtype}", "size", (a.size,), dtype.itemsize)
             for n, a in (("x", xa), ("key", ka), ("value", va), ("w_o", wo), ("b_o", bo),
                          ("w_gate", wg), ("b_gate", bg))
             if a is not None and a.dtype != dtype and
             (n == "x" or a is not xa) and (n != "value" or a is not ka)]
    for n, hs in zip(("w_q", "w_k", "w_v"), weights):
        parts = [hs.array] if hs.array is not None else hs.heads
        items += [(f"casting {n} to {dtype}", "size", (a.size,), dtype.itemsize)
                  for a in parts if a.dtype != dtype]
    return items


def _cast_heads(hs: _Heads, dtype: np.dtype) -> _Heads:
    if all(a.dtype == dtype for a in ([hs.array] if hs.array is not None else hs.heads)):
        return hs   # nothing to cast: the views stand
    if hs.array is None:
        return _Heads(hs.form, [_cast(a, dtype) for a in hs.heads], hs.widths,
                      hs.rows, None)
    arr = _cast(hs.array, dtype)
    if hs.form == "stacked":
        heads = [arr[i] for i in range(arr.shape[0])]
    else:
        w = hs.widths[0]
        heads = [arr[:, i * w:(i + 1) * w] for i in range(len(hs.widths))]
    return _Heads(hs.form, heads, hs.widths, hs.rows, arr)


def _cast_list(bl: Optional[List[np.ndarray]], dtype: np.dtype) -> Optional[List[np.ndarray]]:
    return None if bl is None else [_cast(a, dtype) for a in bl]


def _numbers(xa, ka, va, wq, wk, wv, wo, bq, bk, bv, bo, wg=None, bg=None) -> list:
    """(name, array) of a call's inputs that carry numbers, for shared_half."""
    named = [("x", xa), ("key", ka), ("value", va)]
    for name, hs in (("w_q", wq), ("w_k", wk), ("w_v", wv)):
        named += ([(name, hs.array)] if hs.array is not None else
                  [(f"{name}[{i}]", a) for i, a in enumerate(hs.heads)])
    named += [("w_o", wo), ("b_o", bo), ("w_gate", wg), ("b_gate", bg)]
    for name, bl in (("b_q", bq), ("b_k", bk), ("b_v", bv)):
        if bl is not None:
            named += [(f"{name}[{i}]", a) for i, a in enumerate(bl)]
    return named


def _gate(w_gate: Any, b_gate: Any, xa: np.ndarray, Svq: int) -> tuple:
    """(w_gate, b_gate) of the output gate as arrays, or None: w_gate
    (d_in, sum d_v), its rows x's features and its columns the heads'
    concatenation; b_gate (sum d_v,), only with w_gate."""
    d_in = xa.shape[-1]
    if b_gate is not None and w_gate is None:
        bg = _to_array("b_gate", b_gate)
        raise ValueError(f"b_gate: given (shape {bg.shape}) without w_gate; the output "
                         f"gate sigmoid(x @ w_gate + b_gate) needs its weight w_gate "
                         f"({d_in}, {Svq})")
    wg = _vector("w_gate", w_gate, (d_in, Svq),
                 f"w_gate: expected shape ({d_in}, {Svq}) — x's d_in = {d_in} rows (x "
                 f"{xa.shape}) and sum(d_v) = {Svq} columns, the width of the heads' "
                 f"concatenation — got {{shape}}")
    bg = _vector("b_gate", b_gate, (Svq,),
                 f"b_gate: expected shape ({Svq},) (sum(d_v), the columns of w_gate "
                 f"({d_in}, {Svq})), got {{shape}}")
    return wg, bg


def normalize(x, w_q, w_k, w_v, w_o=None, *, num_heads=None, key=None, value=None,
              scale=None, mask=None, causal=False, key_lengths=None,
              num_kv_heads=None, b_q=None, b_k=None, b_v=None, b_o=None,
              w_gate=None, b_gate=None, core_checks_next: bool = False,
              half_as: np.dtype = F32, half_weights: bool = False, **variants) -> Call:
    """Check every argument and return the canonical :class:`Call`.

    ``variants``: the keywords of :data:`mhattn._internal.variants.VARIANT_DEFAULTS`
    (window, softcap, ..., key_cu_seqlens); any other name is a TypeError.
    The values the core checks are checked by the core (config_verdict),
    unless ``core_checks_next``: the caller hands the call to a core entry
    point, which checks its config, before any of those values is read (the
    cached decode step's project()). ``half_as``: the compute dtype of a half
    precision call (float32; the reference's float64). ``half_weights``: a
    half call's fused 2-D weights (and w_o) stay in its half dtype, for a
    caller that hands the Call straight to ``_C.forward``, whose core widens
    them as it packs its GEMM's panels (mha.h, ``w_storage``): no float32
    copy of them is made. The Call then holds half weights, which the
    reference, a context and a backward must not be given."""
    # q_offset places a block of a longer call's queries: attention's
    # (and so projected_attention's) keyword alone, not the layer's.
    unknown = sorted(set(variants) - set(VARIANT_DEFAULTS) - {"q_offset"})
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
    num_heads = _int_arg("num_heads", num_heads)
    num_kv_heads = _int_arg("num_kv_heads", num_kv_heads)
    xa, ka, va, batched = _sources(x, key, value)
    wq, wk, wv, G = _weights(w_q, w_k, w_v, num_heads, num_kv_heads, xa, ka, va,
                             key, value)
    H = len(wq.heads)
    dk = list(wk.widths)
    dv = list(wv.widths)
    Sk, Sv = sum(dk), sum(dv)
    Sq, Svq = fused_widths(H, G, Sk, Sv)

    wo = _vector("w_o", w_o, (Svq, None),
                 f"w_o: expected shape ({Svq}, d_out) — its rows must equal the "
                 f"concatenated head width sum(d_v) = {Svq} — got {{shape}}")
    bq = _split_bias("b_q", b_q, wq.widths)
    bk = _split_bias("b_k", b_k, wk.widths)
    bv = _split_bias("b_v", b_v, wv.widths)
    d_out = wo.shape[1] if wo is not None else Svq
    bo = _vector("b_o", b_o, (d_out,),
                 f"b_o: expected shape ({d_out},) (d_out), got {{shape}}")
    wg, bg = _gate(w_gate, b_gate, xa, Svq)
    floats = [xa, ka, va] + wq.heads + wk.heads + wv.heads
    for extra in (wo, bo, wg, bg):
        if extra is not None:
            floats.append(extra)
    for bl in (bq, bk, bv):
        if bl is not None:
            floats.extend(bl)
    floats += variant_floats(variants)
    half = shared_half(_numbers(xa, ka, va, wq, wk, wv, wo, bq, bk, bv, bo, wg, bg))
    # A half call computes in float32 (its learnable variants and float
    # masks are cast to it too) and rounds its results to ``half``.
    dtype = np.dtype(half_as) if half is not None else compute_dtype(floats)
    B = xa.shape[0] if batched else 1
    Tq, Tk = xa.shape[-2], ka.shape[-2]
    # Before anything is cast or allocated: the casts below, and what any call
    # of these sizes allocates (out and the projections) must fit.
    check_memory(_cast_items(dtype, xa, ka, va, wo, bo, (wq, wk, wv), wg, bg)
                 + core_items(B, Tq, Tk, H, Sq, Sk, Sv, Svq, d_out, w_o is not None, dtype,
                              gate=wg is not None))

    scales = head_scales(H, G, dk, _scale_arg(scale))
    bool_arg("causal", causal)
    mask_v, mask_shape, mask_dtype = mask_and_form(mask, batched, B, H, Tq, Tk, dtype)
    kl = _normalize_lengths(key_lengths, batched, B, Tk)
    var = normalize_variants(variants, batched=batched, B=B, Tq=Tq, Tk=Tk, H=H, G=G,
                             dk=dk, dtype=dtype, key_given=key is not None,
                             key_lengths=key_lengths)
    # Half weights the core takes as they are: all fused, of the half dtype.
    keep = (half_weights and half is not None
            and all(h.form == "fused" and h.array.dtype == half for h in (wq, wk, wv))
            and (wo is None or wo.dtype == half) and (wg is None or wg.dtype == half))
    xb = xa if batched else xa[np.newaxis]
    kb = ka if batched else ka[np.newaxis]
    vb = va if batched else va[np.newaxis]
    # Self-attention's sources are one array: cast once (a half x is widened).
    xc = _cast(xb, dtype)
    kc = xc if ka is xa else _cast(kb, dtype)
    vc = xc if va is xa else kc if va is ka else _cast(vb, dtype)
    call = Call(
        dtype=dtype, batched=batched, out_dtype=dtype if half is None else half,
        x=xc, key=kc, value=vc,
        key_given=key is not None, value_given=value is not None,
        wq=wq if keep else _cast_heads(wq, dtype), wk=wk if keep else _cast_heads(wk, dtype),
        wv=wv if keep else _cast_heads(wv, dtype),
        w_o=wo if wo is None or keep else _cast(wo, dtype),
        bq=_cast_list(bq, dtype), bk=_cast_list(bk, dtype), bv=_cast_list(bv, dtype),
        b_o=None if bo is None else _cast(bo, dtype),
        H=H, G=G, dk=dk, dv=dv, scales=scales, causal=bool(causal),
        mask=mask_v, mask_shape=mask_shape, mask_dtype=mask_dtype, key_lengths=kl,
        Sq=Sq, Sk=Sk, Sv=Sv, Svq=Svq, var=var,
        half_variants=() if half is None else tuple(
            n for n in ("sinks", "q_norm", "k_norm", "relative_bias")
            if variants.get(n) is not None and is_half(getattr(
                getattr(variants[n], "table", variants[n]), "dtype", np.dtype(np.float64)))),
        w_gate=wg if wg is None or keep else _cast(wg, dtype),
        b_gate=None if bg is None else _cast(bg, dtype))
    # The rules on the config's values (the key lengths, the variants'
    # offsets, softcap, norm_eps, rotary_dim) are the core's: it checks them
    # here, before the reference or the checker reads any of them.
    if not core_checks_next:
        # The whole tuple, even with every variant off: a norm_eps given
        # without q_norm / k_norm is checked all the same.
        config_verdict(B, Tq, Tk, dk, dv, scales, dtype, key_lengths=kl,
                       variants=variants_tuple(call, always=True))
    return call


def _needs_copy(a: np.ndarray) -> bool:
    """The glue copies inputs that are not C-contiguous, aligned and native."""
    return not (a.flags.c_contiguous and a.flags.aligned and a.dtype.isnative)


def plan(call: Call, *, want_weights: bool = False, keep: bool = False) -> list:
    """Every allocation of run_core, as check_memory items."""
    n = call.dtype.itemsize
    items = core_items(call.B, call.Tq, call.Tk, call.H, call.Sq, call.Sk, call.Sv,
                       call.Svq, call.d_out, call.w_o is not None, call.dtype,
                       weights=want_weights, keep=keep, transforms=call.var.transforms,
                       gate=call.w_gate is not None)
    for name, a in (("x", call.x), ("key", call.key), ("value", call.value),
                    ("w_o", call.w_o), ("w_gate", call.w_gate)):
        if a is not None and _needs_copy(a):
            items.append((f"a contiguous copy of {name}", "size", (a.size,), n))
    for name, hs in (("w_q", call.wq), ("w_k", call.wk), ("w_v", call.wv)):
        if hs.form != "fused" or _needs_copy(hs.array):
            items.append((f"the fused {name}", "d_in*sum(widths)",
                          (hs.rows, sum(hs.widths)), n))
    return items
