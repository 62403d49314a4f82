"""MultiHeadAttention: a layer that owns its weights and calls the C core.

The layer is a thin holder of arrays.  Its weights are stored *stacked*, one
slice per head, in the document's row-vector convention (Q = X W^Q):

    w_q (h, d_model, d_k)   w_k (g, kdim, d_k)   w_v (g, vdim, d_v)
    w_o (h*d_v, d_out)      b_q (h, d_k)  b_k (g, d_k)  b_v (g, d_v)  b_o (d_out,)
    w_gate (d_model, h*d_v) b_gate (h*d_v,)     (the output gate, gate=True)

with h = num_heads and g = num_kv_heads (grouped-query attention when g < h:
query head i uses kv head i // (h // g)).  Calling the layer is exactly

    mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, key=key, value=value,
                                num_kv_heads=g, b_q=b_q, ..., **options)

and ``layer.arguments()`` gives those keyword arguments, so the same layer can
be run through :mod:`mhattn.reference` too.

PyTorch interoperability (PyTorch is never imported unless you ask for it):
``MultiHeadAttention.from_torch(module)``, ``layer.to_torch()``,
``layer.state_dict()`` and ``layer.load_state_dict(d)``, which use the key
names and layout of ``torch.nn.MultiheadAttention``.  PyTorch stores a linear
map as W (out_features, in_features) and computes x @ W.T + b, so mhattn's
fused W^Q is PyTorch's W_q transposed, and head i owns columns
[i*d_k, (i+1)*d_k) of it.
"""
from __future__ import annotations

import functools
import inspect
import numbers
import warnings
from collections.abc import Mapping
from typing import Any, Dict, Optional

import numpy as np

from .._internal import core as _core
from .._internal.args import _check_numeric, _int_arg, _to_array, check_memory
from .._internal.half import as_dtype, half_of, is_bfloat16, is_half
from ..compute.forward import multi_head_attention
from ..compute.grad import backward as _backward
from ..compute.packed import PackedWeights, pack_weights

__all__ = ["MultiHeadAttention"]

# Keywords of multi_head_attention that the layer sets itself from its weights.
_OWNED = frozenset({"x", "w_q", "w_k", "w_v", "w_o", "num_heads", "num_kv_heads",
                    "key", "value", "b_q", "b_k", "b_v", "b_o", "sinks", "q_norm",
                    "k_norm", "norm_eps", "norm_type", "w_gate", "b_gate", "dropout"})
# The learnable variants a layer may own, under their state_dict keys (the
# names of gpt-oss's and Qwen3's attention modules).
_VARIANT_KEYS = {"sinks": "sinks", "q_norm": "q_norm.weight", "k_norm": "k_norm.weight"}


@functools.lru_cache(maxsize=None)
def _call_options() -> frozenset:
    """multi_head_attention's keywords that a layer call may pass on."""
    return frozenset(inspect.signature(multi_head_attention).parameters) - _OWNED


def _layer_dtype(dtype: Any) -> np.dtype:
    dt = as_dtype("dtype", dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)) and not is_half(dt):
        raise TypeError(f"dtype: mhattn layers hold float32, float64, float16 or bfloat16 "
                        f"weights, got {dt}")
    return half_of(dt) or dt


def _torch_dtype(torch, dt: np.dtype):
    """The torch dtype of a layer dtype."""
    return {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
            "bfloat16": torch.bfloat16}[dt.name]


def _to_tensor(torch, a: np.ndarray):
    """A NumPy array as a torch tensor of the same dtype (bfloat16, which
    torch.from_numpy does not take, through its bits)."""
    a = np.ascontiguousarray(a)
    if is_bfloat16(a.dtype):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _rng(seed: Any) -> np.random.Generator:
    """np.random.default_rng(seed), its refusals named ``seed``."""
    if isinstance(seed, (bool, np.bool_)):
        raise TypeError(f"seed: expected None, a non-negative int or a "
                        f"np.random.Generator, got {seed!r}")
    try:
        return np.random.default_rng(seed)
    except TypeError as e:
        raise TypeError(f"seed: expected None, a non-negative int or a np.random.Generator, "
                        f"got {seed!r:.80} ({type(seed).__name__}): {e}") from None
    except ValueError as e:
        raise ValueError(f"seed: expected None, a non-negative int or a "
                         f"np.random.Generator, got {seed!r:.80}: {e}") from None


def _stack(fused: np.ndarray, heads: int) -> np.ndarray:
    """(rows, heads*width) with head i in the i-th block of columns -> (heads, rows, width)."""
    rows, total = fused.shape
    return fused.reshape(rows, heads, total // heads).transpose(1, 0, 2)


def _fuse(stacked: np.ndarray) -> np.ndarray:
    """(heads, rows, width) -> (rows, heads*width): the inverse of _stack."""
    h, rows, width = stacked.shape
    return stacked.transpose(1, 0, 2).reshape(rows, h * width)


def _xavier_uniform(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """torch.nn.init.xavier_uniform_ on a (rows, cols) matrix: U(-a, a) with
    a = sqrt(6 / (fan_in + fan_out)); the bound is symmetric in the two fans."""
    a = np.sqrt(6.0 / (rows + cols))
    return rng.uniform(-a, a, size=(rows, cols))


def _to_numpy(name: str, t: Any) -> np.ndarray:
    """A torch tensor (or anything array-like) as a NumPy float array."""
    if hasattr(t, "detach"):  # torch.Tensor, without importing torch
        t = t.detach().cpu()
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")
        if str(t.dtype) not in ("torch.float32", "torch.float64"):
            t = t.float()  # float16 / bfloat16 have no exact NumPy twin here
        return t.numpy()
    a = _to_array(name, t)
    _check_numeric(name, a)
    return a


def _copied(value):
    """A copy of an assigned weight, in its form (an array of its own class,
    so a masked array stays refused; a list copies each item)."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value


class MultiHeadAttention:
    """Multi-head attention with its own weights; calls the C core.

    MultiHeadAttention(d_model, num_heads, *, num_kv_heads=None, d_k=None,
                       d_v=None, d_out=None, kdim=None, vdim=None, bias=False,
                       sinks=False, qk_norm=False, norm_eps=1e-6,
                       norm_type="rms", gate=False, dropout=0.0, dtype=np.float32,
                       seed=None)

    Parameters
    ----------
    d_model : int
        Width of the queries' source x (and of key/value unless kdim/vdim).
    num_heads : int
        h, the number of query heads.
    num_kv_heads : int, optional
        g, the number of key/value heads; must divide num_heads.  Default h.
    d_k, d_v : int, optional
        Head widths.  Default d_k = d_model // num_heads (which must then
        divide d_model) and d_v = d_k.
    d_out : int, optional
        Output width; default d_model.
    kdim, vdim : int, optional
        Widths of the key and value inputs (as in nn.MultiheadAttention);
        default d_model.
    bias : bool
        Give every projection a bias (b_q, b_k, b_v and b_o), initialised to 0.
    sinks : bool
        Own one attention-sink logit per query head, ``sinks`` (h,),
        initialised to 0 (gpt-oss; see multi_head_attention's ``sinks``).
    qk_norm : False, True or "per_head"
        Own norm weights for q and k, initialised to 1: ``q_norm`` and
        ``k_norm`` (d_k,) shared by every head (Qwen3; Flax's
        ``normalize_qk``), or with "per_head" ``q_norm`` (h, d_k) and
        ``k_norm`` (g, d_k).
    norm_eps : float
        The q/k norm's epsilon.
    norm_type : "rms" (default) or "layer"
        The q/k norm of ``qk_norm``: "rms", RMSNorm, or "layer", LayerNorm
        without a bias (Flax's ``MultiHeadAttention(normalize_qk=True)``);
        see multi_head_attention's ``norm_type``.  Only read with
        ``qk_norm``, but checked here (ValueError naming it) either way.
    gate : bool
        Own an output gate (Keras's ``use_gate=True``): ``w_gate``
        (d_model, h*d_v), Glorot-uniform as Keras draws it, and ``b_gate``
        (h*d_v,), initialised to 0; see multi_head_attention's ``w_gate``.
    dropout : float in [0, 1), default 0.0
        Dropout on the attention weights (multi_head_attention's ``dropout``),
        applied in training mode only (:meth:`train`; a new layer is in
        evaluation mode, :meth:`eval`).  Each training call draws its mask's
        seed from a generator seeded by ``seed`` (fresh OS entropy without
        one), unless the call passes ``seed=``.  Outside [0, 1): ValueError.
    dtype : np.float32 (default), np.float64, np.float16 or bfloat16
        The dtype of every weight (``ml_dtypes.bfloat16``, or the string
        "bfloat16"). A half layer computes in float32 and returns its
        inputs' half dtype (see :func:`mhattn.multi_head_attention`); its
        inputs must have the layer's dtype. :meth:`astype` converts.
    seed : int, np.random.Generator or None
        Passed to np.random.default_rng.

    Notes
    -----
    Initialisation follows nn.MultiheadAttention._reset_parameters in
    distribution: when kdim == vdim == d_model, Xavier-uniform over the packed
    in-projection (W_q; W_k; W_v stacked as PyTorch's (rows, d_model)
    ``in_proj_weight``), otherwise Xavier-uniform over each of W_q, W_k, W_v;
    W^O keeps nn.Linear's default, kaiming_uniform(a=sqrt(5)), which is
    U(-1/sqrt(h*d_v), 1/sqrt(h*d_v)); biases are 0.  The output gate's
    W_gate is Keras's glorot_uniform on its (d_model, h*d_v) kernel,
    U(-a, a) with a = sqrt(6 / (d_model + h*d_v)), drawn after the other
    weights (a layer without a gate draws what it always drew), and b_gate
    is 0.

    The weights ``w_q, w_k, w_v, w_o`` are kept packed for the C core's
    kernels (:func:`mhattn.pack_weights`): the attributes are *read-only*
    views of the packed object's arrays, so ``layer.w_q[0] = 0`` raises
    instead of leaving the panels stale.  To change a weight, assign a new
    array (``layer.w_q = w``, any form multi_head_attention takes): the
    layer copies it and repacks at its next use; later writes into the
    assigned array are not seen.  :meth:`load_state_dict` and
    :meth:`reset_parameters` repack too.  ``layer.packed`` is the
    :class:`mhattn.PackedWeights`.  The biases ``b_q, b_k, b_v, b_o`` (and
    ``sinks``, ``q_norm``, ``k_norm``, and the gate's ``w_gate``,
    ``b_gate``) are plain NumPy arrays (None when the layer does not have
    them), not packed, and may be modified in place.
    Options that are not learnable (``causal``, ``window``, ``rope``,
    ``softcap``, ``alibi_slopes``, ``key_mask``, ...) are passed per call.

    Examples
    --------
    >>> layer = mhattn.MultiHeadAttention(64, 8, num_kv_heads=2, sinks=True,
    ...                                   qk_norm=True, seed=0)
    >>> x = np.random.default_rng(0).standard_normal((2, 10, 64)).astype(np.float32)
    >>> out = layer(x, causal=True, rope=mhattn.RoPE(), window=(3, 0))
    >>> sorted(layer.state_dict())[-3:]
    ['out_proj.weight', 'q_norm.weight', 'sinks']
    """

    # The four weights live in one PackedWeights, made from the assigned
    # values at first use after an assignment (_packed_weights).
    def _get_weight(self, name):
        try:
            return getattr(self._packed_weights(), name)
        except (TypeError, ValueError):
            return self._raw[name]   # an assignment packing refuses: as given

    def _set_weight(self, name, value):
        if getattr(self, "_raw", None) is None:
            self._raw = {}
        self._raw[name] = _copied(value)
        self._pw = None

    w_q = property(lambda self: self._get_weight("w_q"),
                   lambda self, v: self._set_weight("w_q", v),
                   doc="(h, d_model, d_k) read-only, or as assigned: W^Q of each head.")
    w_k = property(lambda self: self._get_weight("w_k"),
                   lambda self, v: self._set_weight("w_k", v),
                   doc="(g, kdim, d_k) read-only, or as assigned: W^K of each kv head.")
    w_v = property(lambda self: self._get_weight("w_v"),
                   lambda self, v: self._set_weight("w_v", v),
                   doc="(g, vdim, d_v) read-only, or as assigned: W^V of each kv head.")
    w_o = property(lambda self: self._get_weight("w_o"),
                   lambda self, v: self._set_weight("w_o", v),
                   doc="(h*d_v, d_out) read-only, or as assigned: W^O.")

    def _packed_weights(self) -> PackedWeights:
        """The PackedWeights of the assigned weights, packed once after each
        assignment (errors name the weight, as multi_head_attention's do)."""
        pw = self._pw
        if pw is None:
            r = self._raw
            pw = pack_weights(r["w_q"], r["w_k"], r["w_v"], r["w_o"],
                              num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)
            self._pw = pw
            self._raw = {n: getattr(pw, n) for n in ("w_q", "w_k", "w_v", "w_o")}
        return pw

    @property
    def packed(self) -> PackedWeights:
        """The layer's weights as a :class:`mhattn.PackedWeights`
        (``multi_head_attention(x, layer.packed, ...)`` computes the layer
        without its biases and variants).

        Examples
        --------
        >>> layer = mhattn.MultiHeadAttention(16, 2, seed=0)
        >>> layer.packed
        PackedWeights(num_heads=2, num_kv_heads=2, d_model=16, d_out=16, dtype=float32, isa=...)
        >>> x = np.ones((3, 16), np.float32)
        >>> np.array_equal(mhattn.multi_head_attention(x, layer.packed), layer(x))
        True
        """
        return self._packed_weights()

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: Optional[int] = None,
                 d_k: Optional[int] = None, d_v: Optional[int] = None,
                 d_out: Optional[int] = None, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, bias: bool = False, sinks: bool = False,
                 qk_norm: Any = False, norm_eps: float = 1e-6, norm_type: str = "rms",
                 gate: bool = False, dropout: float = 0.0, dtype: Any = np.float32,
                 seed: Any = None):
        self._configure(d_model, num_heads, num_kv_heads=num_kv_heads, d_k=d_k, d_v=d_v,
                        d_out=d_out, kdim=kdim, vdim=vdim, bias=bias, dtype=dtype,
                        sinks=sinks, qk_norm=qk_norm, norm_eps=norm_eps,
                        norm_type=norm_type, gate=gate, dropout=dropout)
        self.reset_parameters(seed)
        # Dropout's seeds, one drawn per training call: a seeded layer trains
        # reproducibly (None: fresh OS entropy, as multi_head_attention's).
        self._dropout_rng = seed if isinstance(seed, np.random.Generator) else (
            None if seed is None else np.random.default_rng(_rng(seed).integers(2 ** 63)))

    # -- construction ---------------------------------------------------------

    def _configure(self, d_model, num_heads, *, num_kv_heads, d_k, d_v, d_out, kdim,
                   vdim, bias, dtype, sinks=False, qk_norm=False, norm_eps=1e-6,
                   norm_type="rms", gate=False, dropout=0.0) -> None:
        self.d_model = _int_arg("d_model", d_model, allow_none=False)
        self.num_heads = _int_arg("num_heads", num_heads, allow_none=False)
        g = _int_arg("num_kv_heads", num_kv_heads)
        self.num_kv_heads = self.num_heads if g is None else g
        # The core's verdict on the pairing, and first the memory rule on head
        # counts: a huge num_heads is a MemoryError here, before any weight is
        # drawn (it took 10 s of drawing to reach it at the first call).
        _core.check_heads(self.num_heads, self.num_kv_heads)
        d_k = _int_arg("d_k", d_k)
        d_v = _int_arg("d_v", d_v)
        if d_k is None:
            if self.d_model % self.num_heads:
                raise ValueError(f"num_heads: {self.num_heads} does not divide "
                                 f"d_model={self.d_model}; pass d_k (and d_v) explicitly")
            d_k = self.d_model // self.num_heads
        self.d_k = d_k
        self.d_v = d_k if d_v is None else d_v
        self.d_out = self.d_model if d_out is None else _int_arg("d_out", d_out)
        self.kdim = self.d_model if kdim is None else _int_arg("kdim", kdim)
        self.vdim = self.d_model if vdim is None else _int_arg("vdim", vdim)
        if not isinstance(bias, (bool, np.bool_)):
            raise TypeError(f"bias: expected True or False, got {bias!r}")
        self.bias = bool(bias)
        self.dtype = _layer_dtype(dtype)
        if not isinstance(sinks, (bool, np.bool_)):
            raise TypeError(f"sinks: expected True or False, got {sinks!r}")
        if qk_norm not in (False, True, "per_head") or isinstance(qk_norm, np.ndarray):
            raise ValueError(f"qk_norm: expected False, True or 'per_head', got {qk_norm!r}")
        self.has_sinks = bool(sinks)
        if not isinstance(gate, (bool, np.bool_)):
            raise TypeError(f"gate: expected True or False, got {gate!r:.80}")
        self.has_gate = bool(gate)
        self.qk_norm = qk_norm if qk_norm == "per_head" else bool(qk_norm)
        if isinstance(norm_eps, (bool, np.bool_)) or not isinstance(norm_eps, numbers.Real):
            raise TypeError(f"norm_eps: expected a real number >= 0, got {norm_eps!r:.80} "
                            f"({type(norm_eps).__name__})")
        # finite and >= 0 is the core's rule, checked at the call (one place;
        # tests/catalogue_cases.py expects norm_eps=-1 refused by __call__)
        self.norm_eps = float(norm_eps)
        # Its name is the core's to read: asked here, so that a layer never
        # holds a norm its calls would refuse (the same message as theirs).
        self.norm_type = _core.check_norm_type(norm_type)
        # Likewise dropout's range (core/config.c): refused here, as a call
        # would refuse it, though eval-mode calls never pass it on.
        self.dropout = _core.check_dropout(dropout)
        self.training = False
        self._dropout_rng = None

    @property
    def _packed(self) -> bool:
        """PyTorch's _qkv_same_embed_dim: one in_proj_weight for q, k and v."""
        return self.kdim == self.d_model and self.vdim == self.d_model

    def _shapes(self) -> Dict[str, tuple]:
        h, g = self.num_heads, self.num_kv_heads
        shapes = dict(w_q=(h, self.d_model, self.d_k), w_k=(g, self.kdim, self.d_k),
                      w_v=(g, self.vdim, self.d_v), w_o=(h * self.d_v, self.d_out))
        if self.bias:
            shapes.update(b_q=(h, self.d_k), b_k=(g, self.d_k), b_v=(g, self.d_v),
                          b_o=(self.d_out,))
        if self.has_sinks:
            shapes["sinks"] = (h,)
        if self.qk_norm:
            per_head = self.qk_norm == "per_head"
            shapes["q_norm"] = (h, self.d_k) if per_head else (self.d_k,)
            shapes["k_norm"] = (g, self.d_k) if per_head else (self.d_k,)
        if self.has_gate:
            shapes.update(w_gate=(self.d_model, h * self.d_v), b_gate=(h * self.d_v,))
        return shapes

    def reset_parameters(self, seed: Any = None) -> None:
        """Draw fresh weights (see the class docstring for the distributions).

        Parameters
        ----------
        seed : int, np.random.Generator or None
            Passed to np.random.default_rng, as the constructor's ``seed``.

        Examples
        --------
        >>> layer = mhattn.MultiHeadAttention(16, 2, seed=0)
        >>> layer.reset_parameters(seed=1)
        >>> x = np.ones((3, 16), np.float32)
        >>> np.array_equal(layer(x), mhattn.MultiHeadAttention(16, 2, seed=1)(x))
        True
        """
        rng = _rng(seed)
        h, g = self.num_heads, self.num_kv_heads
        nq, nk, nv = h * self.d_k, g * self.d_k, g * self.d_v
        # Each weight is drawn in float64, cast to the layer's dtype and packed:
        # checked before anything is allocated (a d_model or d_k of 2**40 is
        # a MemoryError naming them, not NumPy's).
        per = 8 + 2 * self.dtype.itemsize
        check_memory([
            ("w_q", "num_heads*d_model*d_k", (h, self.d_model, self.d_k), per),
            ("w_k", "num_kv_heads*kdim*d_k", (g, self.kdim, self.d_k), per),
            ("w_v", "num_kv_heads*vdim*d_v", (g, self.vdim, self.d_v), per),
            ("w_o", "num_heads*d_v*d_out", (h, self.d_v, self.d_out), per),
        ] + ([("w_gate", "d_model*num_heads*d_v", (self.d_model, h, self.d_v), per)]
             if self.has_gate else []))
        # PyTorch layout: (out_features, in_features); ours is its transpose.
        if self._packed:
            packed = _xavier_uniform(rng, nq + nk + nv, self.d_model)
            wq, wk, wv = packed[:nq], packed[nq:nq + nk], packed[nq + nk:]
        else:
            wq = _xavier_uniform(rng, nq, self.d_model)
            wk = _xavier_uniform(rng, nk, self.kdim)
            wv = _xavier_uniform(rng, nv, self.vdim)
        bound = 1.0 / np.sqrt(h * self.d_v)  # kaiming_uniform(a=sqrt(5)) of nn.Linear
        wo = rng.uniform(-bound, bound, size=(self.d_out, h * self.d_v))
        dt = self.dtype
        self.w_q = np.ascontiguousarray(_stack(wq.T, h), dtype=dt)
        self.w_k = np.ascontiguousarray(_stack(wk.T, g), dtype=dt)
        self.w_v = np.ascontiguousarray(_stack(wv.T, g), dtype=dt)
        self.w_o = np.ascontiguousarray(wo.T, dtype=dt)
        self._packed_weights()
        if self.bias:
            self.b_q = np.zeros((h, self.d_k), dt)
            self.b_k = np.zeros((g, self.d_k), dt)
            self.b_v = np.zeros((g, self.d_v), dt)
            self.b_o = np.zeros(self.d_out, dt)
        else:
            self.b_q = self.b_k = self.b_v = self.b_o = None
        shapes = self._shapes()
        self.sinks = np.zeros(shapes["sinks"], dt) if self.has_sinks else None
        self.q_norm = np.ones(shapes["q_norm"], dt) if self.qk_norm else None
        self.k_norm = np.ones(shapes["k_norm"], dt) if self.qk_norm else None
        if self.has_gate:
            # Keras's glorot_uniform on the gate's kernel: fan_in d_model,
            # fan_out h*d_v (EinsumDense's input and output axes).
            self.w_gate = np.ascontiguousarray(
                _xavier_uniform(rng, self.d_model, h * self.d_v), dtype=dt)
            self.b_gate = np.zeros(h * self.d_v, dt)
        else:
            self.w_gate = self.b_gate = None

    # -- the forward pass -----------------------------------------------------

    def weights(self) -> Dict[str, np.ndarray]:
        """The layer's arrays by name (w_q, w_k, w_v, w_o, then biases if any).

        Returns
        -------
        dict
            Name -> the layer's array itself (not a copy): w_q, w_k, w_v, w_o,
            then b_q, b_k, b_v, b_o with ``bias``, sinks with ``sinks``,
            q_norm, k_norm with ``qk_norm`` and w_gate, b_gate with ``gate``.

        Examples
        --------
        >>> layer = mhattn.MultiHeadAttention(16, 2, bias=True, seed=0)
        >>> {name: a.shape for name, a in layer.weights().items()}
        {'w_q': (2, 16, 8), 'w_k': (2, 16, 8), 'w_v': (2, 16, 8), 'w_o': (16, 16),
         'b_q': (2, 8), 'b_k': (2, 8), 'b_v': (2, 8), 'b_o': (16,)}
        """
        return {name: getattr(self, name) for name in self._shapes()}

    def arguments(self) -> Dict[str, Any]:
        """Keyword arguments that make multi_head_attention compute this layer:
        ``mhattn.reference.multi_head_attention(x, **layer.arguments())``.

        Returns
        -------
        dict
            :meth:`weights`, plus ``num_kv_heads`` (and ``norm_eps``,
            ``norm_type`` with a q/k norm).

        Examples
        --------
        >>> layer = mhattn.MultiHeadAttention(16, 2, seed=0)
        >>> sorted(layer.arguments())
        ['num_kv_heads', 'w_k', 'w_o', 'w_q', 'w_v']
        >>> x = np.ones((3, 16), np.float32)
        >>> np.array_equal(mhattn.multi_head_attention(x, **layer.arguments()), layer(x))
        True
        """
        kw: Dict[str, Any] = dict(self.weights())
        kw["num_kv_heads"] = self.num_kv_heads
        if self.qk_norm:
            kw["norm_eps"] = self.norm_eps
            kw["norm_type"] = self.norm_type
        return kw

    def __call__(self, x, key=None, value=None, **options):
        """Attend from x to key/value (both default to x); returns out, or
        (out, weights) with ``return_weights=True``, with a context for
        :meth:`backward` appended when ``return_context=True``.

        Parameters
        ----------
        x : (T_q, d_model) or (B, T_q, d_model)
            The queries' source, of the layer's dtype when either is half.
        key, value : arrays, optional
            Sources of keys and values for cross-attention: (T_k, kdim) and
            (T_k, vdim), or batched.  ``key`` defaults to ``x``, ``value``
            to ``key``.
        **options
            multi_head_attention's: mask, causal, key_lengths,
            scale, return_weights, return_context, window, softcap,
            alibi_slopes, rope, positions, key_positions, key_mask, cu_seqlens,
            key_cu_seqlens, and ``cache=mhattn.KVCache(...)`` (with
            ``new_lengths``) for one decoding step through a key/value cache:
            ``layer(x_new, causal=True, cache=cache)`` projects only the new
            rows, appends their keys and values, and attends over the cache
            (see :func:`mhattn.multi_head_attention`; no gradients through a
            cache), or ``cache=mhattn.PagedKVCache(...)`` with
            ``sequence_ids``, row i of x_new then being sequence
            sequence_ids[i] of the cache.  The layer's own arrays (sinks, the q/k norm and the
            gate included) cannot be passed; anything else raises TypeError.

        Returns
        -------
        out : (T_q, d_out) or (B, T_q, d_out)
            As :func:`mhattn.multi_head_attention` returns it.
        weights : (h, T_q, T_k) or (B, h, T_q, T_k)
            Returned too when ``return_weights=True``.
        ctx : mhattn.Context
            Returned last when ``return_context=True``, for :meth:`backward`.

        Examples
        --------
        >>> layer = mhattn.MultiHeadAttention(16, 2, seed=0)
        >>> x = np.ones((3, 16), np.float32)
        >>> out, weights = layer(x, causal=True, return_weights=True)
        >>> out.shape, weights.shape
        ((3, 16), (2, 3, 3))
        """
        allowed = _call_options()
        for name in options:
            if name in _OWNED:
                raise TypeError(f"MultiHeadAttention.__call__: {name!r} is set by the "
                                "layer itself and cannot be passed")
            if name not in allowed:
                raise TypeError(f"MultiHeadAttention.__call__ got an unexpected keyword "
                                f"argument {name!r}; accepted: {', '.join(sorted(allowed))}")
        self._check_half_inputs(x=x, key=key, value=value)
        kw = self.arguments()
        if self.training and self.dropout > 0:
            kw["dropout"] = self.dropout
            if options.get("seed") is None and self._dropout_rng is not None:
                options["seed"] = self._dropout_rng
        try:
            packed = self._packed_weights()
        except (TypeError, ValueError):
            packed = None   # the unpacked call raises the same error, named
        if packed is not None:
            for name in ("w_q", "w_k", "w_v", "w_o", "num_kv_heads"):
                del kw[name]
            return multi_head_attention(x, packed, key=key, value=value, **kw, **options)
        # an assigned weight packing refused: the call says why, knowing the
        # layer's num_heads (so it does not ask for it)
        return multi_head_attention(x, key=key, value=value, num_heads=self.num_heads,
                                    **kw, **options)

    def train(self, mode: bool = True) -> "MultiHeadAttention":
        """Set training mode (``mode=True``) or evaluation mode, as PyTorch's
        ``Module.train``: ``dropout`` applies in training mode only. A new
        layer is in evaluation mode.

        Parameters
        ----------
        mode : bool, default True
            True for training, False for evaluation.

        Returns
        -------
        MultiHeadAttention
            This layer.

        Examples
        --------
        >>> layer = mhattn.MultiHeadAttention(16, 2, dropout=0.5, seed=0)
        >>> x = np.ones((3, 16), np.float32)
        >>> _, w = layer.train()(x, return_weights=True)
        >>> bool((w == 0).any()), layer.training
        (True, True)
        >>> np.array_equal(layer.eval()(x), mhattn.multi_head_attention(x, **layer.arguments()))
        True
        """
        if not isinstance(mode, (bool, np.bool_)):
            raise TypeError(f"mode: expected True or False, got {mode!r:.80}")
        self.training = bool(mode)
        return self

    def eval(self) -> "MultiHeadAttention":
        """Set evaluation mode (no dropout): ``train(False)``.

        Returns
        -------
        MultiHeadAttention
            This layer.

        Examples
        --------
        >>> layer = mhattn.MultiHeadAttention(16, 2, dropout=0.1).train()
        >>> layer.eval().training
        False
        """
        return self.train(False)

    def _check_half_inputs(self, **inputs) -> None:
        """A TypeError naming the layer when an input array's dtype and the
        layer's differ and one of them is half: the call would name w_q, an
        attribute the caller did not pass."""
        for name, a in inputs.items():
            dt = getattr(a, "dtype", None)
            if not isinstance(dt, np.dtype) or dt == self.dtype or not (
                    is_half(dt) or is_half(self.dtype)):
                continue
            raise TypeError(
                f"{name}: dtype {dt}, but this layer holds {self.dtype} (its weights, "
                f"MultiHeadAttention(..., dtype={self.dtype.name})); a half precision call "
                f"takes inputs of the weights' dtype: pass {name}.astype(layer.dtype), or "
                f"call layer.astype({'ml_dtypes.bfloat16' if is_bfloat16(dt) else 'np.' + dt.name})"
                f" first")

    def backward(self, grad_out, ctx, *, mask_grad=False) -> Dict[str, Any]:
        """Gradients of a scalar loss given ``grad_out`` = dL/dout, for the
        call ``out, ctx = layer(x, ..., return_context=True)`` that made ctx.

        Parameters
        ----------
        grad_out : (T_q, d_out) or (B, T_q, d_out)
            dL/dout, of the shape of the call's ``out``.
        ctx : mhattn.Context
            The context of that call.
        mask_grad : bool, default False
            Also return 'mask', the gradient of the call's additive mask
            (see :func:`mhattn.backward`).

        Returns
        -------
        dict
            Keyed by the layer's attribute names (w_q, w_k, w_v, w_o, then
            b_q, b_k, b_v, b_o with ``bias``), each gradient shaped as its
            attribute, plus 'x' (and 'key' / 'value' when they were passed;
            without them 'x' includes the keys' and values' contributions).
            See :func:`mhattn.backward`.

        Examples
        --------
        >>> layer = mhattn.MultiHeadAttention(16, 2, seed=0)
        >>> x = np.ones((3, 16), np.float32)
        >>> out, ctx = layer(x, causal=True, return_context=True)
        >>> grads = layer.backward(np.ones_like(out), ctx)
        >>> sorted(grads), grads["w_q"].shape
        (['w_k', 'w_o', 'w_q', 'w_v', 'x'], (2, 16, 8))
        """
        return _backward(grad_out, ctx, mask_grad=mask_grad)

    def astype(self, dtype) -> "MultiHeadAttention":
        """A new layer of the same shape whose weights (biases, sinks and
        norms too) are this layer's cast to ``dtype`` (float32, float64,
        float16 or bfloat16; to a half dtype each value is rounded once to
        nearest even), as ``module.to(dtype)`` does in PyTorch.

        Parameters
        ----------
        dtype : np.float32, np.float64, np.float16 or bfloat16
            The new layer's dtype (``ml_dtypes.bfloat16``, or the string
            "bfloat16").

        Returns
        -------
        MultiHeadAttention
            The new layer; this one is unchanged.

        Examples
        --------
        >>> layer = mhattn.MultiHeadAttention(16, 2, seed=0)
        >>> half = layer.astype(np.float16)
        >>> x = np.ones((3, 16), np.float16)
        >>> half(x, causal=True).dtype
        dtype('float16')
        """
        dt = _layer_dtype(dtype)
        new = type(self).__new__(type(self))
        new._configure(self.d_model, self.num_heads, num_kv_heads=self.num_kv_heads,
                       d_k=self.d_k, d_v=self.d_v, d_out=self.d_out, kdim=self.kdim,
                       vdim=self.vdim, bias=self.bias, dtype=dt, sinks=self.has_sinks,
                       qk_norm=self.qk_norm, norm_eps=self.norm_eps,
                       norm_type=self.norm_type, gate=self.has_gate, dropout=self.dropout)
        new.training = self.training
        for name in self._shapes():
            a = getattr(self, name)
            setattr(new, name, np.asarray(a).astype(dt))
        return new

    @property
    def param_count(self) -> int:
        """Number of scalars in all weights and biases.

        Examples
        --------
        >>> mhattn.MultiHeadAttention(16, 2, bias=True).param_count   # 4*16*16 + 4*16
        1088
        """
        return int(sum(a.size for a in self.weights().values()))

    def __repr__(self) -> str:
        extra = ""
        if self.kdim != self.d_model:
            extra += f", kdim={self.kdim}"
        if self.vdim != self.d_model:
            extra += f", vdim={self.vdim}"
        if self.has_sinks:
            extra += ", sinks=True"
        if self.qk_norm:
            extra += f", qk_norm={self.qk_norm!r}, norm_eps={self.norm_eps!r}"
            if self.norm_type != "rms":
                extra += f", norm_type={self.norm_type!r}"
        if self.has_gate:
            extra += ", gate=True"
        if self.dropout > 0:
            extra += f", dropout={self.dropout!r}"
        return (f"MultiHeadAttention(d_model={self.d_model}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, d_k={self.d_k}, d_v={self.d_v}, "
                f"d_out={self.d_out}{extra}, bias={self.bias}, dtype={self.dtype.name})")

    # -- PyTorch layout -------------------------------------------------------

    def state_dict(self) -> Dict[str, np.ndarray]:
        """The weights under nn.MultiheadAttention's names and layout (new arrays).

        ``in_proj_weight`` (rows, d_model) when kdim == vdim == d_model, else
        ``q_proj_weight`` (h*d_k, d_model), ``k_proj_weight`` (g*d_k, kdim) and
        ``v_proj_weight`` (g*d_v, vdim); ``out_proj.weight`` (d_out, h*d_v);
        with bias, ``in_proj_bias`` (rows,) and ``out_proj.bias`` (d_out,).
        Here rows = h*d_k + g*d_k + g*d_v, which is PyTorch's 3*embed_dim when
        :meth:`to_torch` is possible; other shapes generalise the layout and
        round-trip through :meth:`load_state_dict` only.  A layer with sinks
        or a q/k norm adds ``sinks`` (h,), ``q_norm.weight`` and
        ``k_norm.weight`` (the names of gpt-oss's and Qwen3's modules); one
        with an output gate ``gate_proj.weight`` (h*d_v, d_model) and
        ``gate_proj.bias`` (h*d_v,), in out_proj's layout (PyTorch's
        MultiheadAttention has no gate)

        Returns
        -------
        dict
            Key -> a new array, in the layer's dtype.

        Examples
        --------
        >>> layer = mhattn.MultiHeadAttention(16, 2, seed=0)
        >>> {key: a.shape for key, a in layer.state_dict().items()}
        {'in_proj_weight': (48, 16), 'out_proj.weight': (16, 16)}
        """
        wq, wk, wv = (np.ascontiguousarray(_fuse(w).T) for w in (self.w_q, self.w_k, self.w_v))
        sd: Dict[str, np.ndarray] = {}
        if self._packed:
            sd["in_proj_weight"] = np.concatenate([wq, wk, wv], axis=0)
        else:
            sd.update(q_proj_weight=wq, k_proj_weight=wk, v_proj_weight=wv)
        if self.bias:
            sd["in_proj_bias"] = np.concatenate([self.b_q.reshape(-1), self.b_k.reshape(-1),
                                                 self.b_v.reshape(-1)])
        sd["out_proj.weight"] = np.ascontiguousarray(self.w_o.T)
        if self.bias:
            sd["out_proj.bias"] = self.b_o.copy()
        for name, key in _VARIANT_KEYS.items():
            if getattr(self, name, None) is not None:
                sd[key] = getattr(self, name).copy()
        if self.has_gate:
            sd["gate_proj.weight"] = np.ascontiguousarray(self.w_gate.T)
            sd["gate_proj.bias"] = self.b_gate.copy()
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Set the weights from a :meth:`state_dict`-style mapping (NumPy arrays
        or torch tensors), checking every key and shape; the inverse of
        :meth:`state_dict`.  Values must be real numbers (TypeError otherwise, as
        in multi_head_attention); they are always copied and cast to the layer's
        dtype, so the layer never shares memory with ``state_dict``.

        Parameters
        ----------
        state_dict : mapping of str to arrays or torch tensors
            Exactly the keys of :meth:`state_dict`, with its shapes
            (ValueError naming the missing, unexpected or misshapen ones).

        Examples
        --------
        >>> a = mhattn.MultiHeadAttention(16, 2, seed=0)
        >>> b = mhattn.MultiHeadAttention(16, 2, seed=1)
        >>> b.load_state_dict(a.state_dict())
        >>> x = np.ones((3, 16), np.float32)
        >>> np.array_equal(a(x), b(x))
        True
        """
        state = state_dict
        if not isinstance(state, Mapping) and not (hasattr(state, "keys")
                                                   and hasattr(state, "__getitem__")):
            raise TypeError(f"state_dict: expected a mapping of names to arrays (as "
                            f"state_dict() returns), got {type(state).__name__}")
        want = self._state_shapes()
        got = set(state.keys())
        missing, unexpected = sorted(set(want) - got), sorted(got - set(want))
        if missing or unexpected:
            raise ValueError(f"load_state_dict: keys do not match {self!r}: "
                             f"missing {missing}, unexpected {unexpected}")
        arrays = {}
        for k, shape in want.items():
            a = _to_numpy(k, state[k])
            if a.shape != shape:
                raise ValueError(f"load_state_dict: {k} has shape {a.shape}, "
                                 f"expected {shape} for {self!r}")
            # Always a copy, even where the cast or the layout would not need
            # one: the layer must never write into the caller's arrays.
            arrays[k] = np.array(a, dtype=self.dtype, copy=True)
        h, g = self.num_heads, self.num_kv_heads
        nq, nk = h * self.d_k, g * self.d_k
        if self._packed:
            w = arrays["in_proj_weight"]
            wq, wk, wv = w[:nq], w[nq:nq + nk], w[nq + nk:]
        else:
            wq, wk, wv = (arrays[k] for k in ("q_proj_weight", "k_proj_weight",
                                              "v_proj_weight"))
        self.w_q = np.ascontiguousarray(_stack(wq.T, h))
        self.w_k = np.ascontiguousarray(_stack(wk.T, g))
        self.w_v = np.ascontiguousarray(_stack(wv.T, g))
        self.w_o = np.ascontiguousarray(arrays["out_proj.weight"].T)
        self._packed_weights()
        if self.bias:
            b = arrays["in_proj_bias"]
            self.b_q = b[:nq].reshape(h, self.d_k).copy()
            self.b_k = b[nq:nq + nk].reshape(g, self.d_k).copy()
            self.b_v = b[nq + nk:].reshape(g, self.d_v).copy()
            self.b_o = arrays["out_proj.bias"].copy()
        for name, key in _VARIANT_KEYS.items():
            if key in arrays:
                setattr(self, name, arrays[key])
        if self.has_gate:
            self.w_gate = np.ascontiguousarray(arrays["gate_proj.weight"].T)
            self.b_gate = arrays["gate_proj.bias"]

    def _state_shapes(self) -> Dict[str, tuple]:
        """The shape of every state_dict entry, by key."""
        h, g = self.num_heads, self.num_kv_heads
        nq, nk, nv = h * self.d_k, g * self.d_k, g * self.d_v
        shapes = {}
        if self._packed:
            shapes["in_proj_weight"] = (nq + nk + nv, self.d_model)
        else:
            shapes.update(q_proj_weight=(nq, self.d_model), k_proj_weight=(nk, self.kdim),
                          v_proj_weight=(nv, self.vdim))
        shapes["out_proj.weight"] = (self.d_out, h * self.d_v)
        if self.bias:
            shapes["in_proj_bias"] = (nq + nk + nv,)
            shapes["out_proj.bias"] = (self.d_out,)
        own = self._shapes()
        for name, key in _VARIANT_KEYS.items():
            if name in own:
                shapes[key] = own[name]
        if self.has_gate:
            shapes["gate_proj.weight"] = own["w_gate"][::-1]
            shapes["gate_proj.bias"] = own["b_gate"]
        return shapes

    @classmethod
    def from_torch(cls, module, *, dtype: Any = None) -> "MultiHeadAttention":
        """A layer computing what ``module`` (a torch.nn.MultiheadAttention)
        computes in eval mode, with copies of its weights.

        Packed ``in_proj_weight`` and separate q/k/v_proj_weight (kdim/vdim)
        are both read; so are ``in_proj_bias`` and ``out_proj.bias``.
        ``batch_first`` does not affect the weights: mhattn inputs are always
        batch-first, (B, T, d).  ``add_bias_kv`` and ``add_zero_attn`` have no
        mhattn equivalent and raise ValueError.  Dropout is not applied by
        mhattn: a module with dropout > 0 warns, and matches in eval mode only.
        ``dtype`` defaults to the module's (float64, float16 and bfloat16
        stay so, anything else becomes float32; bfloat16 needs ml_dtypes).

        Parameters
        ----------
        module : torch.nn.MultiheadAttention
            The module to copy (TypeError for anything else).
        dtype : dtype, optional
            The layer's dtype; default the module's, as above.

        Returns
        -------
        MultiHeadAttention
            A new layer holding copies of the module's weights.

        Examples
        --------
        >>> import torch                                  # doctest: +SKIP
        >>> module = torch.nn.MultiheadAttention(16, 2, batch_first=True)  # doctest: +SKIP
        >>> mhattn.MultiHeadAttention.from_torch(module)  # doctest: +SKIP
        MultiHeadAttention(d_model=16, num_heads=2, num_kv_heads=2, d_k=8, d_v=8, d_out=16, bias=True, dtype=float32)
        """
        for attr in ("embed_dim", "num_heads", "in_proj_weight", "out_proj"):
            if not hasattr(module, attr):
                raise TypeError(f"from_torch: expected a torch.nn.MultiheadAttention, got "
                                f"{type(module).__name__} (no attribute {attr!r})")
        if getattr(module, "bias_k", None) is not None or getattr(module, "bias_v", None) \
                is not None:
            raise ValueError("from_torch: the module was built with add_bias_kv=True; its "
                             "learned extra key/value row (bias_k, bias_v) has no mhattn "
                             "equivalent")
        if getattr(module, "add_zero_attn", False):
            raise ValueError("from_torch: the module was built with add_zero_attn=True; "
                             "the extra all-zero key/value row has no mhattn equivalent")
        if getattr(module, "dropout", 0.0):
            warnings.warn(f"from_torch: the module has dropout={module.dropout}; mhattn "
                          "applies no dropout, so the layer matches the module in eval "
                          "mode only", UserWarning, stacklevel=2)
        if dtype is None:
            pdt = str(module.out_proj.weight.dtype).replace("torch.", "")
            dtype = pdt if pdt in ("float64", "float16", "bfloat16") else np.float32
        E = int(module.embed_dim)
        has_bias = module.in_proj_bias is not None
        out_bias = getattr(module.out_proj, "bias", None) is not None
        if has_bias != out_bias:
            raise ValueError("from_torch: the module has in_proj_bias "
                             f"{'but no' if has_bias else 'missing but'} out_proj.bias; "
                             "mhattn layers have all biases or none")
        layer = cls.__new__(cls)
        layer._configure(E, int(module.num_heads), num_kv_heads=None, d_k=None, d_v=None,
                         d_out=E, kdim=int(module.kdim), vdim=int(module.vdim),
                         bias=has_bias, dtype=dtype, dropout=float(module.dropout))
        sd = {}
        if module.in_proj_weight is not None:
            sd["in_proj_weight"] = module.in_proj_weight
        else:
            for k in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                sd[k] = getattr(module, k)
        sd["out_proj.weight"] = module.out_proj.weight
        if has_bias:
            sd["in_proj_bias"] = module.in_proj_bias
            sd["out_proj.bias"] = module.out_proj.bias
        if (module.in_proj_weight is not None) != layer._packed:
            raise ValueError("from_torch: the module's packing (in_proj_weight vs separate "
                             "q/k/v_proj_weight) disagrees with its kdim/vdim")
        layer.load_state_dict(sd)
        return layer

    def to_torch(self):
        """An equivalent torch.nn.MultiheadAttention(batch_first=True), in eval
        mode, with copies of the weights.

        Only possible when the layer has nn.MultiheadAttention's shape:
        num_kv_heads == num_heads, d_k == d_v == d_model / num_heads and
        d_out == d_model; otherwise ValueError says which condition fails.

        Returns
        -------
        torch.nn.MultiheadAttention
            A new module, of the layer's dtype (imports PyTorch).

        Examples
        --------
        >>> layer = mhattn.MultiHeadAttention(16, 2, seed=0)
        >>> module = layer.to_torch()                     # doctest: +SKIP
        >>> module.batch_first, module.training           # doctest: +SKIP
        (True, False)
        """
        reasons = []
        if self.num_kv_heads != self.num_heads:
            reasons.append(f"num_kv_heads={self.num_kv_heads} != num_heads="
                           f"{self.num_heads} (nn.MultiheadAttention has no grouped-query "
                           "attention)")
        if self.d_k * self.num_heads != self.d_model or self.d_v != self.d_k:
            reasons.append(f"d_k={self.d_k}, d_v={self.d_v} but nn.MultiheadAttention needs "
                           f"both equal to d_model / num_heads = "
                           f"{self.d_model / self.num_heads:g}")
        if self.d_out != self.d_model:
            reasons.append(f"d_out={self.d_out} != d_model={self.d_model}")
        if self.has_sinks or self.qk_norm or self.has_gate:
            reasons.append("the layer has attention sinks, a q/k norm or an output gate, "
                           "which nn.MultiheadAttention does not")
        if reasons:
            raise ValueError("to_torch: " + "; ".join(reasons))
        import torch
        module = torch.nn.MultiheadAttention(
            self.d_model, self.num_heads, bias=self.bias, kdim=self.kdim, vdim=self.vdim,
            batch_first=True, dtype=_torch_dtype(torch, self.dtype))
        state = {k: _to_tensor(torch, v) for k, v in self.state_dict().items()}
        module.load_state_dict(state)
        return module.eval()

