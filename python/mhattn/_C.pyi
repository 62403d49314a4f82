"""Type stubs for mhattn._C, the NumPy extension around the C core.

Low level: the public API is :func:`mhattn.multi_head_attention`, which checks
the arguments (:func:`mhattn._internal.args.normalize`) and calls
:func:`forward` through :func:`mhattn._internal.core.run_core`.

Letters (csrc/mha.h): B batch, Tq queries, Tk keys, H query heads, G key/value
heads, dk[g] / dv[g] the widths of kv head g, Sq / Sk / Sv the fused widths of
q / k / v, Svq the concatenation width, Dout the output width.
"""
from typing import Optional, Tuple

import numpy as np
import numpy.typing as npt

_Float = npt.NDArray[np.floating]

def forward(
    x: _Float,                        # (B, Tq, Din)
    key: _Float,                      # (B, Tk, Dkin)
    value: _Float,                    # (B, Tk, Dvin)
    wq: _Float,                       # (Din, Sq), head h's block after the heads before it
    wk: _Float,                       # (Dkin, Sk)
    wv: _Float,                       # (Dvin, Sv)
    wo: Optional[_Float],             # (Svq, Dout) or None: out is the concatenation
    bq: Optional[_Float],             # (Sq,) or None
    bk: Optional[_Float],             # (Sk,) or None
    bv: Optional[_Float],             # (Sv,) or None
    bo: Optional[_Float],             # (Dout,) or None
    dk: npt.NDArray[np.int64],        # (G,)
    dv: npt.NDArray[np.int64],        # (G,)
    scales: npt.NDArray[np.float64],  # (H,) multiplier of q.k per query head
    mask: Optional[npt.NDArray[np.generic]],  # bool or float, any strides: (B, H, Tq, Tk)
                                              # or a shape that broadcasts to it
    causal: bool,                     # query i sees keys j <= i + (Tk - Tq)
    key_lengths: Optional[npt.NDArray[np.int64]],  # (B,) or None
    variants: Optional[tuple],        # None, or mhattn._internal.core.variant_args's tuple:
                                      # (window, softcap, alibi, sinks, key_mask, cu_q,
                                      #  cu_k, q_norm, k_norm, norm_eps, rotary_dim,
                                      #  interleaved, inv_freq, positions, key_positions)
    want_weights: bool,
    keep: bool,
) -> Tuple[
    _Float,                           # out (B, Tq, Dout)
    Optional[_Float],                 # weights (B, H, Tq, Tk) when want_weights
    Optional[Tuple[_Float, _Float, _Float, _Float, _Float]],
    # (q (B, Tq, Sq), k (B, Tk, Sk), v (B, Tk, Sv), concat (B, Tq, Svq),
    #  lse (B, H, Tq)) when keep
]:
    """forward(x, key, value, wq, wk, wv, wo, bq, bk, bv, bo, dk, dv, scales,
    mask, causal, key_lengths, variants, want_weights, keep)
    -> (out, weights or None, (q, k, v, concat, lse) or None)

    All float arrays share one dtype, float32 or float64.  Outputs are new
    C-contiguous arrays of that dtype.  A fully masked query row gets zero
    weights, a zero head output and lse -inf.
    """
    ...

EMULATED_AVX512: int
"""1 in the test build whose 'avx512' kernels are emulated in plain C
(``MHATTN_EMULATE_AVX512=1``, setup.py), else 0."""

def get_isa() -> str:
    """The instruction set of the kernels in force: 'avx512', 'avx2', 'neon' or 'scalar'."""
    ...

def set_isa(name: str) -> str:
    """Caps the instruction set at name ('scalar', 'avx2', 'avx512' or 'neon'),
    lowered to what the CPU supports; returns the one now in force."""
    ...

def get_num_threads() -> int:
    """The number of threads the core uses."""
    ...

def set_num_threads(n: int) -> None:
    """Use n threads (at most 256) from the next call on; 0 restores the
    default (MHATTN_NUM_THREADS, else the CPUs this process may use)."""
    ...

def backward(
    dout: _Float,                     # (B, Tq, Dout): dL/dout
    x: _Float,                        # (B, Tq, Din)
    key: Optional[_Float],            # (B, Tk, Dkin), or None: key is x
    value: Optional[_Float],          # (B, Tk, Dvin), or None: value is key
    wq: _Float,                       # (Din, Sq)
    wk: _Float,                       # (Dkin, Sk)
    wv: _Float,                       # (Dvin, Sv)
    wo: Optional[_Float],             # (Svq, Dout) or None
    q: _Float,                        # (B, Tq, Sq)    forward's kept extras
    k: _Float,                        # (B, Tk, Sk)
    v: _Float,                        # (B, Tk, Sv)
    concat: _Float,                   # (B, Tq, Svq)
    lse: _Float,                      # (B, H, Tq)
    dk: npt.NDArray[np.int64],        # (G,)
    dv: npt.NDArray[np.int64],        # (G,)
    scales: npt.NDArray[np.float64],  # (H,)
    mask: Optional[npt.NDArray[np.generic]],  # (B, H, Tq, Tk) bool or float, any strides
    causal: bool,
    key_lengths: Optional[npt.NDArray[np.int64]],
    variants: Optional[tuple],        # as forward()'s
    want_bq: bool,
    want_bk: bool,
    want_bv: bool,
    want_bo: bool,
) -> Tuple[_Float, Optional[_Float], Optional[_Float], _Float, _Float, _Float,
           Optional[_Float], Optional[_Float], Optional[_Float], Optional[_Float],
           Optional[_Float], Optional[_Float], Optional[_Float], Optional[_Float]]:
    """backward(dout, x, key, value, wq, wk, wv, wo, q, k, v, concat, lse, dk,
    dv, scales, mask, causal, key_lengths, variants, want_bq, want_bk, want_bv,
    want_bo)
    -> (dx, dkey, dvalue, dwq, dwk, dwv, dwo, dbq, dbk, dbv, dbo, dsinks,
        dq_norm, dk_norm)

    Backward pass of forward(): new C-contiguous gradients of the compute
    dtype, fused like the arguments. key None means key is x and value None
    means value is key: that role's gradient is then added into x's (key's),
    and dkey (dvalue) is None. dwo is None without wo; each bias gradient is
    None unless its want_* is true; dsinks, dq_norm, dk_norm are None unless
    the variants give sinks, q_norm, k_norm. Fully masked query rows
    contribute zero. Bitwise the same for any thread count.
    """
    ...

def attention(
    q: _Float,                        # (B, H, Tq, dk), any strides, last axis contiguous
    k: _Float,                        # (B, G, Tk, dk)
    v: _Float,                        # (B, G, Tk, dv)
    scales: npt.NDArray[np.float64],  # (H,)
    mask: Optional[npt.NDArray[np.generic]],
    causal: bool,
    key_lengths: Optional[npt.NDArray[np.int64]],
    variants: Optional[tuple],        # forward()'s, the q/k transforms off
    lengths_aligned: bool,            # queries aligned to each item's key length
    out_bthd: bool,                   # out (B, Tq, H, dv) instead of (B, H, Tq, dv)
    want_weights: bool,
    want_lse: bool,
) -> Tuple[_Float, Optional[_Float], Optional[_Float]]:
    """attention(...) -> (out, weights or None, lse or None): attention on
    projected tensors (mha_attend), read in place through their strides."""
    ...

def attention_backward(
    dout: _Float,                     # (B, H, Tq, dv), any strides
    q: _Float,                        # (B, H, Tq, dk)
    k: _Float,                        # (B, G, Tk, dk)
    v: _Float,                        # (B, G, Tk, dv)
    out: _Float,                      # (B, H, Tq, dv): attention()'s
    lse: Optional[_Float],            # (B, H, Tq), or None: recomputed
    scales: npt.NDArray[np.float64],
    mask: Optional[npt.NDArray[np.generic]],
    causal: bool,
    key_lengths: Optional[npt.NDArray[np.int64]],
    variants: Optional[tuple],
    lengths_aligned: bool,
) -> Tuple[_Float, _Float, _Float, Optional[_Float]]:
    """attention_backward(...) -> (dq, dk, dv, dsinks or None), C-contiguous
    (B, H, Tq, dk), (B, G, Tk, dk), (B, G, Tk, dv) (mha_attend_backward)."""
    ...

def project(
    x: _Float, key: _Float, value: _Float,   # as forward()'s
    wq: _Float, wk: _Float, wv: _Float,
    bq: Optional[_Float], bk: Optional[_Float], bv: Optional[_Float],
    dk: npt.NDArray[np.int64], dv: npt.NDArray[np.int64],
    scales: npt.NDArray[np.float64],
    variants: Optional[tuple],
) -> Tuple[_Float, _Float, _Float]:
    """project(...) -> (q (B, Tq, Sq), k (B, Tk, Sk), v (B, Tk, Sv)): the
    projections with the q/k norm and RoPE applied (mha_project)."""
    ...
