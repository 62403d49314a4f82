"""The measured variants and the inputs they share.

A variant is a ``Variant(key, label, prepare, context, to_numpy)`` whose
``prepare(data, case)`` returns a zero-argument callable: the call that
is timed.  ``make_data`` builds one (configuration, B, dtype)'s inputs,
and torch's copy of them when torch runs.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

import mhattn
import mhattn.reference

from .configs import Case
from .optional import import_torch

torch = import_torch()       # optional: its columns say "n/a"
F = torch.nn.functional if torch is not None else None


@dataclass
class Data:
    """The inputs of one (configuration, B, dtype), shared by every variant."""
    x: np.ndarray            # (T, d) when B == 1 (the unbatched call), else (B, T, d)
    w_q: np.ndarray          # (d, d) fused: head i owns columns [i*dk, (i+1)*dk)
    w_k: np.ndarray
    w_v: np.ndarray
    w_o: np.ndarray          # (d, d)
    h: int
    torch: Any = None        # TorchData, when torch runs


@dataclass
class TorchData:
    x: Any                   # (B, T, d) tensor sharing memory with Data.x
    mha: Any                 # nn.MultiheadAttention, eval, fast-path ready
    causal_mask: Any         # (T, T) bool, True = blocked (nn.MultiheadAttention's convention)


def make_data(T: int, d: int, h: int, B: int, dtype: str, rng, with_torch: bool) -> Data:
    npdt = np.dtype(dtype)
    shape = (T, d) if B == 1 else (B, T, d)
    x = rng.standard_normal(shape, dtype=npdt)
    # Scaled so that scores and outputs stay O(1) whatever d is.
    ws = [rng.standard_normal((d, d), dtype=npdt) * npdt.type(1 / math.sqrt(d))
          for _ in range(4)]
    data = Data(x, *ws, h=h)
    if with_torch:
        data.torch = make_torch(data, T, d, h, B)
    return data


def make_torch(data: Data, T: int, d: int, h: int, B: int) -> TorchData:
    """nn.MultiheadAttention holding mhattn's weights.

    torch computes x W^T: in_proj_weight is concat(w_q, w_k, w_v, axis=1)^T
    and out_proj.weight is w_o^T.  Its fast path only runs with in-projection
    biases, so they are present and zero (an addition of zeros, nothing more).
    """
    tdt = torch.float32 if data.x.dtype == np.float32 else torch.float64
    mha = torch.nn.MultiheadAttention(d, h, bias=True, batch_first=True,
                                      device="cpu", dtype=tdt)
    mha.eval()
    with torch.no_grad():
        # Block by block, straight from the NumPy arrays: at GPT-3 width a
        # NumPy concatenation would hold two more copies of the weights.
        for i, w in enumerate((data.w_q, data.w_k, data.w_v)):
            mha.in_proj_weight[i * d:(i + 1) * d].copy_(torch.from_numpy(w).T)
        mha.out_proj.weight.copy_(torch.from_numpy(data.w_o).T)
        mha.in_proj_bias.zero_()
        mha.out_proj.bias.zero_()
    mha.requires_grad_(False)
    x = torch.from_numpy(data.x).reshape(B, T, d)
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    return TorchData(x, mha, mask)


class Unsupported(Exception):
    """Raised by a variant's prepare() for a case it does not run (ORT on
    float64, say): the row records the reason as "skipped"."""


@dataclass
class Variant:
    key: str                                       # column and JSON key
    label: str
    prepare: Callable[[Data, Case], Callable[[], Any]]
    context: Callable[[], Any] = nullcontext       # entered around all timed calls
    to_numpy: Callable[[Any], np.ndarray] = np.asarray


def mhattn_forward(data: Data, case: Case):
    x, wq, wk, wv, wo = data.x, data.w_q, data.w_k, data.w_v, data.w_o
    h, causal = data.h, case.causal
    return lambda: mhattn.multi_head_attention(x, wq, wk, wv, wo, num_heads=h, causal=causal)


def mhattn_packed_forward(data: Data, case: Case):
    """``multi_head_attention(x, packed)`` with the weights packed once, here,
    outside the timing, as a user holding a model would."""
    if not hasattr(mhattn, "pack_weights"):
        raise Unsupported("this build has no mhattn.pack_weights")
    packed = mhattn.pack_weights(data.w_q, data.w_k, data.w_v, data.w_o, num_heads=data.h)
    x, causal = data.x, case.causal
    return lambda: mhattn.multi_head_attention(x, packed, causal=causal)


def reference_forward(data: Data, case: Case):
    x, wq, wk, wv, wo = data.x, data.w_q, data.w_k, data.w_v, data.w_o
    h, causal = data.h, case.causal
    return lambda: mhattn.reference.multi_head_attention(x, wq, wk, wv, wo, num_heads=h,
                                                         causal=causal)


def torch_mha_forward(data: Data, case: Case):
    """nn.MultiheadAttention's fast path.  A causal call passes the boolean
    mask and is_causal=True (the mask is required; is_causal is a hint)."""
    t = data.torch
    mha, x = t.mha, t.x
    mask = t.causal_mask if case.causal else None
    causal = case.causal
    return lambda: mha(x, x, x, need_weights=False, attn_mask=mask, is_causal=causal)[0]


def torch_sdpa_forward(data: Data, case: Case):
    """One F.linear for Q, K and V together (torch's own in_proj layout), SDPA
    on (B, h, T, d_k), then F.linear for W^O: what a hand-written torch
    attention layer does.  Same weight tensors as the MHA variant."""
    t = data.torch
    x, h, causal = t.x, data.h, case.causal
    B, T, d = x.shape
    w_in, w_out = t.mha.in_proj_weight, t.mha.out_proj.weight

    def run():
        qkv = F.linear(x, w_in).view(B, T, 3, h, d // h).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=causal)
        return F.linear(o.transpose(1, 2).reshape(B, T, d), w_out)
    return run


def _torch_to_numpy(t) -> np.ndarray:
    return t.detach().numpy()


def _no_grad():
    return torch.no_grad()


MHATTN = Variant("mhattn", "mhattn", mhattn_forward)
MHATTN_PACKED = Variant("mhattn_packed", "mhattn with pack_weights", mhattn_packed_forward)
REFERENCE = Variant("numpy", "NumPy reference", reference_forward)
TORCH_MHA = Variant("torch_mha", "torch nn.MultiheadAttention (fast path)", torch_mha_forward,
                    _no_grad, _torch_to_numpy)
TORCH_SDPA = Variant("torch_sdpa", "torch F.linear + F.scaled_dot_product_attention",
                     torch_sdpa_forward, _no_grad, _torch_to_numpy)
TORCH_VARIANTS = (TORCH_MHA, TORCH_SDPA)


def forward_variants(with_reference: bool, with_torch: bool, peers=()):
    """The variants of a forward row, mhattn first (the others are checked
    against it), then mhattn with packed weights, the reference, torch and
    the other peers (ORT's and JAX's variants, from peers_ort / peers_jax)."""
    variants = [MHATTN, MHATTN_PACKED]
    if with_reference:
        variants.append(REFERENCE)
    if with_torch:
        variants += list(TORCH_VARIANTS)
    return variants + list(peers)


def check_mha_fast_path(data: Data, case: Case) -> bool:
    """Whether nn.MultiheadAttention really took its fast path
    (torch._native_multi_head_attention) on this input."""
    real = torch._native_multi_head_attention
    calls = []

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)
    torch._native_multi_head_attention = spy
    try:
        with torch.no_grad():
            torch_mha_forward(data, case)()
    finally:
        torch._native_multi_head_attention = real
    return bool(calls)
