"""Gradients of multi-head attention, computed by the C core's backward pass.

Two ways in:

- ``mhattn.multi_head_attention_grad(grad_out, x, w_q, ...)`` takes the same
  arguments as :func:`mhattn.multi_head_attention` plus ``grad_out`` and runs
  the forward and backward passes in one call;
- ``out, ctx = mhattn.multi_head_attention(..., return_context=True)`` then
  ``mhattn.backward(grad_out, ctx)``: the training-loop form, which does not
  recompute the forward.

Both return a dict mapping the name of each array argument to its gradient
(see :func:`backward`).  The letters follow ``csrc/mha.h``.
"""
from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

from .._internal import core
from .._internal.args import (_check_numeric, _Heads, _to_array, backward_items, check_memory,
                              mask_grad_arg, mask_gradient, normalize, offsets, plan)
from .._internal.args import _cast
from .._internal.core import (Context, gate_args, head_arrays, make_context, run_core,
                              variant_args)
from .._internal.half import half_of, is_half, narrow
from .._internal.variants import variant_kwargs
from .packed import PackedWeights, call_weights

__all__ = ["Context", "backward", "multi_head_attention_grad"]


def _weight_like(g: np.ndarray, heads: _Heads) -> Any:
    """A fused (rows, sum widths) gradient in the form of its weight."""
    if heads.form == "fused":
        return g
    if heads.form == "stacked":
        n, w = len(heads.widths), heads.widths[0]
        return np.ascontiguousarray(g.reshape(g.shape[0], n, w).transpose(1, 0, 2))
    offs = offsets(heads.widths)
    return [np.ascontiguousarray(g[:, offs[i]:offs[i + 1]]) for i in range(len(heads.widths))]


def _bias_like(g: np.ndarray, form: str, widths: List[int]) -> Any:
    """A fused (sum widths,) bias gradient in the form of its bias."""
    if form == "fused":
        return g
    if form == "stacked":
        return g.reshape(len(widths), widths[0])
    offs = offsets(widths)
    return [g[offs[i]:offs[i + 1]].copy() for i in range(len(widths))]


def backward(grad_out, ctx: Context, *, mask_grad=False) -> Dict[str, Any]:
    """Gradients of a scalar loss L with respect to every array argument of
    the forward call that made ``ctx``, given ``grad_out`` = dL/dout.

    backward(grad_out, ctx) -> dict

    Parameters
    ----------
    grad_out : (T_q, d_out) or (B, T_q, d_out)
        dL/dout: the gradient of a scalar loss L with respect to the output,
        of the shape of the forward's ``out``.
    ctx : mhattn.Context
        The context of ``multi_head_attention(..., return_context=True)``.
    mask_grad : bool, default False
        Also return ``'mask'``, the gradient of the additive (float) ``mask``
        (a learned bias: a relative-position table's scores, a FlexAttention
        ``score_mod`` over a captured tensor), summed over the axes along
        which the mask was broadcast: a (T_q, T_k) mask gets a (T_q, T_k)
        gradient, a (B, 1, 1, T_k) one a (B, 1, 1, T_k) gradient.  The core
        writes dL/dmask at every (b, h, i, j) (a B*h*T_q*T_k array, made only
        when asked for) and NumPy sums it, the same for any thread count.
        Keys a row does not see get 0.  A bool mask, or none, raises
        ValueError naming mask_grad.

    Returns
    -------
    dict
        Maps each argument's name to its gradient: 'x', then 'key' and
        'value' when they were given, 'w_q', 'w_k', 'w_v', then 'w_o',
        'b_q', 'b_k', 'b_v', 'b_o', 'w_gate', 'b_gate' when they were given,
        then 'sinks', 'q_norm' and 'k_norm' when they were given, and 'mask'
        with ``mask_grad=True`` (ALiBi slopes, positions, the key mask and a
        bool mask get none).
        'x' includes the output gate's contribution.  Each gradient
        has the form its argument came in (fused, stacked or a per-head
        list; batched or not), as new arrays of the compute dtype; in a
        half precision call (float16 or bfloat16 inputs), of that dtype,
        except for the gradient of a float32 or float64 ``sinks``,
        ``q_norm`` or ``k_norm``, which is float32.  A per-head list gets
        one gradient per position, even where one array fills several
        positions (add them up for the shared array's gradient).

        When ``key`` was not given, x also fed the keys and values, and 'x'
        includes those contributions; likewise 'key' includes the values'
        when ``value`` was not given.  Fully masked query rows contribute
        zero.

    Examples
    --------
    >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    >>> out, ctx = mhattn.multi_head_attention(X, w_q, w_k, w_v, w_o, return_context=True)
    >>> sorted(mhattn.backward(np.ones_like(out), ctx))
    ['w_k', 'w_o', 'w_q', 'w_v', 'x']
    """
    if not isinstance(ctx, Context):
        raise TypeError(f"ctx: expected the context returned by multi_head_attention("
                        f"..., return_context=True), got {type(ctx).__name__}")
    call = ctx.call
    want_dmask = mask_grad_arg(mask_grad, call.mask)
    g = _to_array("grad_out", grad_out)
    _check_numeric("grad_out", g)
    if g.shape != ctx.out_shape:
        raise ValueError(f"grad_out: expected the shape of the forward's output "
                         f"{ctx.out_shape}, got {g.shape}")
    half = call.out_dtype if call.out_dtype != call.dtype else None
    if is_half(g.dtype) and half_of(g.dtype) != half:
        raise TypeError(f"grad_out: dtype {g.dtype} does not match the forward's output "
                        f"dtype {call.out_dtype}")
    # Before anything is allocated: grad_out's cast, the gradients and the
    # core's scratch.
    cast = [] if g.dtype == call.dtype else [
        (f"casting grad_out to {call.dtype}", "size", (g.size,), call.dtype.itemsize)]
    if want_dmask:   # the core's dmask, then its sum over the broadcast axes
        cast.append(("mask_grad=True: dL/dmask before its broadcast", "B*h*T_q*T_k",
                     (2, call.B, call.H, call.Tq, call.Tk), call.dtype.itemsize))
    check_memory(cast + backward_items(call, core.get_num_threads()))
    g = _cast(g, call.dtype)
    if not call.batched:
        g = g[np.newaxis]

    biases = ctx.bias_forms
    dk, dv, scales = head_arrays(call)
    # With the output gate, _C.backward's tuple goes on with (dwgate, dbgate);
    # then with want_dmask dmask, then with T5's bias drel_table.
    (dx, dkey, dvalue, dwq, dwk, dwv, dwo, dbq, dbk, dbv, dbo, dsinks, dq_norm,
     dk_norm, *rest) = core.backward(
        g, call.x, call.key if call.key_given else None,
        call.value if call.value_given else None,
        call.wq.fused(), call.wk.fused(), call.wv.fused(), call.w_o,
        ctx.q, ctx.k, ctx.v, ctx.concat, ctx.lse, dk, dv, scales, call.mask,
        call.causal, call.key_lengths, variant_args(call), biases["b_q"] is not None,
        biases["b_k"] is not None, biases["b_v"] is not None, call.b_o is not None,
        **gate_args(call), **({"want_dmask": True} if want_dmask else {}))
    dgate = rest[:2] if call.w_gate is not None else []
    drel = rest.pop() if call.var.rel is not None else None

    grads: Dict[str, Any] = {"x": call.unbatch(dx)}
    if call.key_given:
        grads["key"] = call.unbatch(dkey)
    if call.value_given:
        grads["value"] = call.unbatch(dvalue)
    grads["w_q"] = _weight_like(dwq, call.wq)
    grads["w_k"] = _weight_like(dwk, call.wk)
    grads["w_v"] = _weight_like(dwv, call.wv)
    if call.w_o is not None:
        grads["w_o"] = dwo
    for name, gb, heads in (("b_q", dbq, call.wq), ("b_k", dbk, call.wk),
                            ("b_v", dbv, call.wv)):
        if biases[name] is not None:
            grads[name] = _bias_like(gb, biases[name], heads.widths)
    if call.b_o is not None:
        grads["b_o"] = dbo
    if call.w_gate is not None:
        grads["w_gate"] = dgate[0]
        if call.b_gate is not None:
            grads["b_gate"] = dgate[1]
    for name, gv in (("sinks", dsinks), ("q_norm", dq_norm), ("k_norm", dk_norm),
                     ("relative_bias", drel)):
        if gv is not None:
            grads[name] = gv
    if want_dmask:
        grads["mask"] = mask_gradient(rest[-1], call.mask_shape, call.batched)
    if half is not None:
        # Each gradient in its argument's dtype: the numbers' are half, a
        # variant array's (sinks, q_norm, k_norm) half if it was given so.
        grads = {name: _narrow_tree(gv, half) if name not in _VARIANT_GRADS
                 or name in call.half_variants else gv for name, gv in grads.items()}
        if want_dmask and is_half(call.mask_dtype):
            grads["mask"] = narrow(grads["mask"], half)
    return grads


_VARIANT_GRADS = ("sinks", "q_norm", "k_norm", "relative_bias", "mask")


def _narrow_tree(g: Any, dt: np.dtype) -> Any:
    """A gradient (an array or a per-head list of them) rounded to ``dt``."""
    if isinstance(g, list):
        return [narrow(a, dt) for a in g]
    return narrow(g, dt)


def multi_head_attention_grad(grad_out, x, w_q, w_k=None, w_v=None, w_o=None, *, num_heads=None,
                              key=None, value=None, scale=None, mask=None, causal=False,
                              key_lengths=None, num_kv_heads=None, b_q=None, b_k=None,
                              b_v=None, b_o=None, w_gate=None, b_gate=None, window=None,
                              softcap=None, alibi_slopes=None, sinks=None, q_norm=None,
                              k_norm=None, norm_eps=1e-6, norm_type="rms", rope=None,
                              positions=None, key_positions=None, key_mask=None,
                              cu_seqlens=None, key_cu_seqlens=None, dropout=0.0,
                              seed=None, relative_bias=None, chunk=None, block_mask=None,
                              mask_grad=False) -> Dict[str, Any]:
    """Gradients of multi_head_attention with respect to each array argument.

    multi_head_attention_grad(grad_out, x, w_q, w_k, w_v, w_o=None, **keywords)
        -> dict

    Takes multi_head_attention's arguments (not ``return_weights``) after
    ``grad_out`` = dL/dout, the gradient of a scalar loss L with respect to
    the output, and returns what :func:`mhattn.backward` returns.  Runs the
    forward pass (keeping O(T d) state) and then the backward pass; to
    reuse a forward pass, call
    ``multi_head_attention(..., return_context=True)`` and
    :func:`mhattn.backward`.

    Parameters
    ----------
    grad_out : (T_q, d_out) or (B, T_q, d_out)
        dL/dout: the gradient of a scalar loss L with respect to the output,
        of the shape of the forward's ``out``.
    x, w_q, w_k, w_v, w_o, num_heads, key, value, scale, mask, causal
        As :func:`mhattn.multi_head_attention` (not ``return_weights``).
    key_lengths, num_kv_heads, b_q, b_k, b_v, b_o, w_gate, b_gate
        As :func:`mhattn.multi_head_attention`.
    window, softcap, alibi_slopes, sinks, q_norm, k_norm, norm_eps, norm_type, rope
        As :func:`mhattn.multi_head_attention`.
    positions, key_positions, key_mask, cu_seqlens, key_cu_seqlens
        As :func:`mhattn.multi_head_attention`.
    dropout, seed
        As :func:`mhattn.multi_head_attention`: the same seed gives the forward's mask.
    relative_bias
        As :func:`mhattn.multi_head_attention`; its table's gradient is 'relative_bias'.
    chunk, block_mask
        As :func:`mhattn.multi_head_attention`.
    mask_grad : bool, default False
        Also return ``'mask'``, the gradient of the additive (float) ``mask``
        (a learned bias: a relative-position table's scores, a FlexAttention
        ``score_mod`` over a captured tensor), summed over the axes along
        which the mask was broadcast: a (T_q, T_k) mask gets a (T_q, T_k)
        gradient, a (B, 1, 1, T_k) one a (B, 1, 1, T_k) gradient.  The core
        writes dL/dmask at every (b, h, i, j) (a B*h*T_q*T_k array, made only
        when asked for) and NumPy sums it, the same for any thread count.
        Keys a row does not see get 0.  A bool mask, or none, raises
        ValueError naming mask_grad.

    Returns
    -------
    dict
        From argument name ('x', 'key', 'value', 'w_q', ..., 'b_o') to its
        gradient, in the argument's form (see :func:`mhattn.backward`).

    Examples
    --------
    >>> tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    >>> g = mhattn.multi_head_attention_grad(np.ones((3, 4)), X, w_q, w_k, w_v, w_o,
    ...                                      sinks=np.zeros(2))
    >>> sorted(g)
    ['sinks', 'w_k', 'w_o', 'w_q', 'w_v', 'x']
    """
    variants = variant_kwargs(locals())
    packed = None
    if type(w_q) is PackedWeights or w_k is None or w_v is None:
        packed, (w_q, w_k, w_v, w_o, num_heads, num_kv_heads, b_q, b_k, b_v, b_o) = \
            call_weights(w_q, w_k, w_v, w_o, num_heads, num_kv_heads, b_q, b_k, b_v, b_o)
    call = normalize(x, w_q, w_k, w_v, w_o, num_heads=num_heads, key=key, value=value,
                     scale=scale, mask=mask, causal=causal, key_lengths=key_lengths,
                     num_kv_heads=num_kv_heads, b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o,
                     w_gate=w_gate, b_gate=b_gate, **variants)
    mask_grad_arg(mask_grad, call.mask)   # refused before the forward runs
    # The forward's kept state lives on through the backward: both must fit.
    check_memory(plan(call, keep=True) + backward_items(call, core.get_num_threads()))
    _, _, extras = run_core(call, keep=True,
                            packed=None if packed is None else packed._core_packed(call.dtype))
    ctx = make_context(call, extras, b_q=b_q, b_k=b_k, b_v=b_v)
    return backward(grad_out, ctx, mask_grad=mask_grad)
