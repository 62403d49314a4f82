"""mhattn: multi-head attention for people who work in NumPy.

The compute core is C; :mod:`mhattn.reference` is the pure-NumPy reference
that the core is tested against.  See ``python -m mhattn`` for the document's
worked example computed by the core.
"""
from ._version import __version__
from ._api import multi_head_attention
from .packed import pack_weights, PackedWeights
from .attention import attention, attention_grad, merge_attention
from .cache import KVCache
from ._variants import RoPE
from ._grad import Context, backward, multi_head_attention_grad
from .reference import param_count, worked_example
from . import reference
from .layer import MultiHeadAttention
from .interop import from_torch_masks, to_torch_attn_mask
from ._runtime import get_isa, set_num_threads, get_num_threads, _set_isa
from . import _threadpool
_threadpool.install()  # threadpoolctl sees the pool, whichever is imported first
from .trace import trace, Trace
from .plot import plot_attention
from .checker import check_prototype, check_attention_prototype

__all__ = ["multi_head_attention", "pack_weights", "PackedWeights", "attention", "attention_grad", "merge_attention",
           "KVCache", "multi_head_attention_grad", "backward", "Context", "RoPE",
           "param_count", "reference", "worked_example",
           "MultiHeadAttention", "from_torch_masks", "to_torch_attn_mask",
           "get_isa", "set_num_threads", "get_num_threads",
           "trace", "Trace", "plot_attention", "check_prototype",
           "check_attention_prototype"]

