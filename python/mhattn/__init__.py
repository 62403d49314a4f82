"""mhattn: multi-head attention for people who work in NumPy.

The compute core is C; :mod:`mhattn.reference` is the pure-NumPy reference
that the core is tested against.  See ``python -m mhattn`` for the document's
worked example computed by the core.
"""
from ._api import multi_head_attention
from ._grad import Context, backward, multi_head_attention_grad
from .reference import param_count
from . import reference
from .layer import MultiHeadAttention
from .interop import from_torch_masks, to_torch_attn_mask
from ._runtime import get_isa, set_num_threads, get_num_threads, _set_isa
from .trace import trace, Trace
from .plot import plot_attention
from .checker import check_prototype

__all__ = ["multi_head_attention", "multi_head_attention_grad", "backward", "Context",
           "param_count", "reference", "worked_example",
           "MultiHeadAttention", "from_torch_masks", "to_torch_attn_mask",
           "get_isa", "set_num_threads", "get_num_threads",
           "trace", "Trace", "plot_attention", "check_prototype"]
__version__ = "0.1.0"


def worked_example():
    """The document's worked example: (tokens, X, w_q, w_k, w_v, w_o).

    Three tokens ball, full, it with 4-d embeddings; two heads of width 2.
    Head 1 reads the entity and bias columns, head 2 the adjective and bias
    columns, and both heads share one value projection.  W^O is the identity.
    """
    import numpy as np
    tokens = ["ball", "full", "it"]
    X = np.array([[3, 0, 0, 1], [0, 3, 0, 1], [1, 1, 0, 1]], dtype=float)
    W_Q1 = np.array([[1, 0], [0, 0], [0, 0], [0, 1]], dtype=float)
    W_Q2 = np.array([[0, 0], [1, 0], [0, 0], [0, 1]], dtype=float)
    W_V = np.array([[1 / 3, 0], [0, 1 / 3], [0, 0], [0, 0]], dtype=float)
    return tokens, X, [W_Q1, W_Q2], [W_Q1.copy(), W_Q2.copy()], [W_V, W_V], np.eye(4)
