"""JAX as a peer: the layer as one jit-compiled function.

``layer`` is the same computation as mhattn's: the three projections, the
per-head softmax attention (scores scaled by 1/sqrt(d_k), the causal mask
as -inf above the diagonal), the heads joined and W^O.  The weights are
passed as ARGUMENTS (device arrays made once, outside the timing), not
closed over: closed-over arrays would be compiled into the program as
constants.  The input is a device array made once too, and the timed call
ends in ``block_until_ready()`` (JAX dispatches asynchronously).  The
function is compiled on the warm-up call, which is not timed.

JAX's platform and threads are set in the environment before it is
imported (``threads.set_jax_env``); ``import jax`` happens in
``available()``, never at import of this module.  float64 rows need
``jax_enable_x64``, which ``available()`` turns on (float32 inputs stay
float32).
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import numpy as np

from .configs import Case
from .variants import Data, Variant

_jax = None         # the module, once available() imported it
_layer = None       # the jitted function


def available() -> Optional[str]:
    """jax's version when it imports (and the jitted layer is made), else None."""
    global _jax, _layer
    if _jax is None:
        try:
            import jax
        except ImportError:
            return None
        jax.config.update("jax_enable_x64", True)
        _jax = jax
        _layer = jax.jit(_layer_body, static_argnames=("h", "causal"))
    return _jax.__version__


def _layer_body(x, w_q, w_k, w_v, w_o, *, h: int, causal: bool):
    """x (T, d) or (B, T, d); the weights (d, d), head i owns columns
    [i d_k, (i+1) d_k) of w_q, w_k and w_v."""
    jnp = _jax.numpy
    x3 = x if x.ndim == 3 else x[None]
    B, T, d = x3.shape
    dk = d // h
    q = (x3 @ w_q).reshape(B, T, h, dk)
    k = (x3 @ w_k).reshape(B, T, h, dk)
    v = (x3 @ w_v).reshape(B, T, h, dk)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / math.sqrt(dk))     # (B, h, T, T)
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((T, T), dtype=bool)), s, -jnp.inf)
    p = _jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(B, T, d)
    return (o @ w_o).reshape(x.shape)


def layer(data: Data, causal: bool):
    """The timed call: the jitted layer on device copies of data's arrays,
    made here, once; the call waits for its result."""
    jnp = _jax.numpy
    args = [jnp.asarray(a) for a in (data.x, data.w_q, data.w_k, data.w_v, data.w_o)]
    fn, h = _layer, data.h
    fn(*args, h=h, causal=causal).block_until_ready()     # compiles, untimed
    return lambda: fn(*args, h=h, causal=causal).block_until_ready()


def _prepare(data: Data, case: Case):
    return layer(data, case.causal)


JAX = Variant("jax", "JAX jit (projections + softmax attention + W^O)", _prepare,
              to_numpy=np.asarray)


def jax_variants() -> Tuple[List[Variant], List[str]]:
    """[JAX] when jax imports, else [] and a note."""
    if available() is None:
        return [], ["JAX is not installed: its column is skipped"]
    return [JAX], []
