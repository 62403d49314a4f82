"""Masks between torch.nn.MultiheadAttention's conventions and mhattn's.

nn.MultiheadAttention takes two masks, both with the *opposite* boolean sense
to mhattn's:

- ``attn_mask``: (T_q, T_k), or (B*num_heads, T_q, T_k) with row
  b*num_heads + i for batch item b and head i.  Boolean True = may NOT
  attend; float = added to the scaled scores.
- ``key_padding_mask``: (B, T_k) (or (T_k,) for unbatched input).  Boolean
  True = this key is padding and ignored; float = added to the scores.

mhattn takes one ``mask`` that broadcasts to (B, h, T_q, T_k): boolean with
True = may attend, or float added to the scores (-inf blocks).  Neither
function imports PyTorch unless asked to return a tensor; both accept torch
tensors or NumPy arrays.

One difference is not a mask's: a query row that may attend to no key gets
NaN from PyTorch but weights 0 and output b_o from mhattn.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .._internal.args import _int_arg, bool_arg, check_memory

__all__ = ["from_torch_masks", "torch_masks_to_mhattn", "to_torch_attn_mask"]


def _as_numpy(name: str, m: Any) -> np.ndarray:
    """A torch tensor or array-like as a NumPy bool or float array."""
    if hasattr(m, "detach") and hasattr(m, "is_floating_point"):  # torch.Tensor
        m = m.detach().cpu()
        if m.is_floating_point() and str(m.dtype) not in ("torch.float32", "torch.float64"):
            m = m.float()  # float16 / bfloat16 -> float32
        m = m.numpy()
    a = np.asarray(m)
    if a.dtype.kind not in "bf" or (a.dtype.kind == "f" and a.dtype.itemsize > 8):
        raise TypeError(f"{name}: dtype {a.dtype} is not supported; pass a bool mask "
                        "or a float mask added to the scores")
    return a


def _blocked_to_additive(a: np.ndarray, dtype) -> np.ndarray:
    """PyTorch boolean (True = blocked) -> float: -inf where blocked, else 0."""
    return np.where(a, -np.inf, 0.0).astype(dtype)


def _formula(shape: tuple) -> str:
    """The axes' names of a mask shape broadcasting to (B, h, T_q, T_k)."""
    names = ("B", "h", "T_q", "T_k")[4 - len(shape):] if len(shape) <= 4 else \
        tuple(f"n{i}" for i in range(len(shape)))
    return "*".join(names) or "1"


def _strip_leading_ones(a: np.ndarray) -> np.ndarray:
    """Drop leading axes of length 1 (down to 2-D): the result broadcasts the
    same way and also fits an unbatched (h, T_q, T_k) call."""
    while a.ndim > 2 and a.shape[0] == 1:
        a = a[0]
    return a


def from_torch_masks(attn_mask: Any = None, key_padding_mask: Any = None, *,
                     num_heads: Optional[int] = None,
                     batch_size: Optional[int] = None) -> Optional[np.ndarray]:
    """nn.MultiheadAttention's attn_mask and key_padding_mask as one mhattn mask.

    from_torch_masks(attn_mask=None, key_padding_mask=None, *, num_heads=None,
                     batch_size=None) -> mask or None

    Parameters
    ----------
    attn_mask : (T_q, T_k) or (B*num_heads, T_q, T_k), bool or float, optional
        PyTorch's sense: True = may NOT attend; a float mask is added to the
        scores.  A 3-D mask needs ``num_heads`` (or ``batch_size``) to split
        its first axis, whose row b*num_heads + i is batch item b, head i.
    key_padding_mask : (B, T_k) or (T_k,), bool or float, optional
        PyTorch's sense: True = the key is padding; a float mask is added.
    num_heads, batch_size : int, optional
        Split a 3-D attn_mask; when given, they are also checked against the
        masks' shapes.

    Returns
    -------
    mask : ndarray or None
        None when both inputs are None.  Boolean with True = may attend when
        every given input is boolean: allowed where neither input blocks.
        Otherwise float (the wider float dtype of the inputs, float32 at
        least): the sum of the float inputs, a boolean input contributing
        -inf where it blocks and 0 elsewhere, exactly as PyTorch merges them.
        Its shape broadcasts to (B, h, T_q, T_k): attn_mask contributes
        (T_q, T_k) or (B, h, T_q, T_k), key_padding_mask (B, 1, 1, T_k); the
        combination is their broadcast, with leading axes of length 1
        dropped so that it also fits an unbatched (h, T_q, T_k) call.

    Pass the result as ``mask=`` to mhattn.multi_head_attention or to a
    MultiHeadAttention layer.  A query row that every key is blocked for is
    NaN in PyTorch but gives output b_o (and weights 0) in mhattn.

    Examples
    --------
    >>> mhattn.from_torch_masks(key_padding_mask=np.array([[False, False, True]]))
    array([[ True,  True, False]])
    """
    num_heads = _int_arg("num_heads", num_heads)
    batch_size = _int_arg("batch_size", batch_size)
    parts = []

    if attn_mask is not None:
        am = _as_numpy("attn_mask", attn_mask)
        if am.ndim == 3:
            n = am.shape[0]
            if num_heads is None and batch_size is not None:
                if n % batch_size:
                    raise ValueError(f"attn_mask: its first axis {n} (of shape {am.shape}) "
                                     f"is not a multiple of batch_size={batch_size}")
                num_heads = n // batch_size
            if num_heads is None:
                raise ValueError(f"attn_mask: a 3-D mask of shape {am.shape} is "
                                 "(B*num_heads, T_q, T_k); pass num_heads (or batch_size) "
                                 "to split it")
            if n % num_heads:
                raise ValueError(f"attn_mask: its first axis {n} (of shape {am.shape}) is "
                                 f"not a multiple of num_heads={num_heads}")
            if batch_size is not None and n != batch_size * num_heads:
                raise ValueError(f"attn_mask: shape {am.shape} but batch_size * num_heads "
                                 f"= {batch_size} * {num_heads} = {batch_size * num_heads}")
            am = am.reshape(n // num_heads, num_heads, am.shape[1], am.shape[2])
        elif am.ndim != 2:
            raise ValueError(f"attn_mask: expected (T_q, T_k) or (B*num_heads, T_q, T_k), "
                             f"got shape {am.shape}")
        parts.append(("attn_mask", am))

    if key_padding_mask is not None:
        kp = _as_numpy("key_padding_mask", key_padding_mask)
        if kp.ndim == 2:
            if batch_size is not None and kp.shape[0] != batch_size:
                raise ValueError(f"key_padding_mask: shape {kp.shape} but "
                                 f"batch_size={batch_size}")
            kp = kp[:, None, None, :]
        elif kp.ndim != 1:
            raise ValueError(f"key_padding_mask: expected (B, T_k) or (T_k,), got shape "
                             f"{kp.shape}")
        parts.append(("key_padding_mask", kp))

    if not parts:
        return None
    if len(parts) == 2:
        (_, a), (_, b) = parts
        try:
            np.broadcast_shapes(a.shape, b.shape)
        except ValueError:
            raise ValueError(f"attn_mask and key_padding_mask disagree: attn_mask as "
                             f"{a.shape} and key_padding_mask as {b.shape} do not "
                             "broadcast together (check T_k and the batch size)") from None

    # What the merge materialises, checked before anything is allocated: a
    # broadcast view (np.broadcast_to(True, (2**20, 2**20))) costs nothing
    # until it is inverted or added.
    out_shape = np.broadcast_shapes(*[m.shape for _, m in parts])
    if all(m.dtype == bool for _, m in parts):
        out_size = 1
    else:
        out_size = np.result_type(np.float32, *[m.dtype for _, m in parts
                                                if m.dtype != bool]).itemsize
    items = [(name, _formula(m.shape), m.shape, out_size) for name, m in parts]
    if len(parts) == 2:
        items.append(("the merged mask (attn_mask with key_padding_mask)",
                      _formula(out_shape), out_shape, out_size))
    check_memory(items)

    if all(m.dtype == bool for _, m in parts):
        allowed = ~parts[0][1]
        for _, m in parts[1:]:
            allowed = allowed & ~m
        return _strip_leading_ones(np.ascontiguousarray(allowed))

    dtype = np.result_type(np.float32, *[m.dtype for _, m in parts if m.dtype != bool])
    total = None
    for _, m in parts:
        add = _blocked_to_additive(m, dtype) if m.dtype == bool else m.astype(dtype)
        total = add if total is None else total + add
    return _strip_leading_ones(np.ascontiguousarray(total))


#: The same function under a descriptive name.
torch_masks_to_mhattn = from_torch_masks


def to_torch_attn_mask(mask: Any, *, num_heads: Optional[int] = None,
                       batch_size: Optional[int] = None, tgt_len: Optional[int] = None,
                       src_len: Optional[int] = None, as_tensor: bool = False):
    """An mhattn mask as nn.MultiheadAttention's ``attn_mask``.

    to_torch_attn_mask(mask, *, num_heads=None, batch_size=None, tgt_len=None,
                       src_len=None, as_tensor=False) -> array or tensor

    A boolean mask is inverted (mhattn True = may attend; PyTorch True = may
    NOT attend); a float mask keeps its values.  PyTorch wants exact shapes,
    so the mask is broadcast:

    - to (tgt_len, src_len) when it has at most 2 axes (tgt_len / src_len
      default to the mask's own last two axes);
    - else to (batch_size, num_heads, tgt_len, src_len) and reshaped to
      (batch_size*num_heads, tgt_len, src_len), row b*num_heads + i for batch
      item b and head i.  num_heads is required; batch_size, tgt_len and
      src_len default to the mask's own axes (a 3-D mask (h, T_q, T_k) is
      taken with batch_size 1 unless batch_size is given).

    (F.scaled_dot_product_attention needs no conversion: its boolean masks
    already use mhattn's sense.)

    Parameters
    ----------
    mask : bool or float array (or torch tensor), at most 4-D
        An mhattn mask, broadcastable to (B, h, T_q, T_k): True = may attend,
        or float added to the scores.
    num_heads : int, optional
        Required for a mask of 3 or 4 axes.
    batch_size, tgt_len, src_len : int, optional
        B, T_q and T_k of the result; default the mask's own axes, as above.
    as_tensor : bool, default False
        Return a torch.Tensor (which imports PyTorch).

    Returns
    -------
    array or torch.Tensor
        A new C-contiguous NumPy array, (tgt_len, src_len) or
        (batch_size*num_heads, tgt_len, src_len), or a torch.Tensor with
        ``as_tensor=True``.

    Examples
    --------
    >>> mhattn.to_torch_attn_mask(np.tril(np.ones((2, 2), bool)))   # True = blocked
    array([[False,  True],
           [False, False]])
    >>> mhattn.to_torch_attn_mask(np.ones((2, 1, 3, 3), bool), num_heads=4).shape
    (8, 3, 3)
    """
    m = _as_numpy("mask", mask)
    num_heads = _int_arg("num_heads", num_heads)
    batch_size = _int_arg("batch_size", batch_size)
    tgt_len = _int_arg("tgt_len", tgt_len)
    src_len = _int_arg("src_len", src_len)
    as_tensor = bool_arg("as_tensor", as_tensor)
    if m.ndim > 4:
        raise ValueError(f"mask: expected at most 4 axes (B, h, T_q, T_k), got shape {m.shape}")
    full = (1,) * (4 - m.ndim) + m.shape
    Tq = tgt_len if tgt_len is not None else full[2]
    Tk = src_len if src_len is not None else full[3]
    if m.ndim <= 2:
        target = (Tq, Tk)
    else:
        if num_heads is None:
            raise ValueError(f"to_torch_attn_mask: a mask of shape {m.shape} varies over "
                             "batch or heads; pass num_heads to lay it out as "
                             "(B*num_heads, T_q, T_k)")
        B = batch_size if batch_size is not None else full[0]
        target = (B, num_heads, Tq, Tk)
    try:
        out = np.broadcast_to(m, target)
    except ValueError:
        raise ValueError(f"mask: shape {m.shape} does not broadcast to {target}") from None
    # the broadcast, its (B*num_heads, T_q, T_k) layout and the inversion may
    # each be a new array: checked before any is made
    check_memory([("mask", "B*num_heads*T_q*T_k" if len(target) == 4 else "T_q*T_k",
                   target, 2 * m.dtype.itemsize)])
    if len(target) == 4:
        out = out.reshape(target[0] * target[1], Tq, Tk)
    out = np.ascontiguousarray(~out if out.dtype == bool else out)
    if as_tensor:
        import torch
        return torch.from_numpy(out)
    return out
