"""mhattn: multi-head attention for people who work in NumPy.

The compute core is C; :mod:`mhattn.reference` is the pure-NumPy reference
that the core is tested against.  See ``python -m mhattn`` for the document's
worked example computed by the core.

The package's parts, each a subpackage (imports run downward only, as
tests/test_structure.py checks):

- ``compute``: the compute API (the layer's forward and backward,
  attention on projected tensors, the KV cache, packed weights);
- ``learn``: the learner's tools (the trace, the checker, its steps, plots);
- ``nn``: the layer class and PyTorch interop;
- ``reference``: the pure-NumPy reference;
- ``_internal``: argument checking, the variants and the one door to the C
  core (``_internal/core.py``, the only module that imports ``_C``).
"""
from ._internal.version import __version__
from .compute import (multi_head_attention, pack_weights, PackedWeights, attention,
                      attention_grad, merge_attention, KVCache, PagedKVCache, Context, backward,
                      multi_head_attention_grad)
from ._internal.variants import RelativeBias, RoPE
from ._internal.blockmask import BlockMask
from .reference import param_count, worked_example
from . import reference
from .nn import MultiHeadAttention, from_torch_masks, to_torch_attn_mask
from ._internal.runtime import get_isa, set_num_threads, get_num_threads, _set_isa
from ._internal import threadpool as _threadpool
_threadpool.install()  # threadpoolctl sees the pool, whichever is imported first
from .learn import trace, Trace, plot_attention, check_prototype, check_attention_prototype

# The modules that were attributes of the flat package stay attributes.
# ``mhattn.checker`` is documented (README.md: ``mhattn.checker.MISTAKES``)
# and stays importable as a module, ``import mhattn.checker``: a small module
# of its own at the top, python/mhattn/checker.py, which says why. The others
# are the modules in their new homes (``mhattn.layer`` is mhattn.nn.layer,
# ``mhattn.plot`` mhattn.learn.plot, ...), imported by those paths only.
# (``mhattn.trace`` and ``mhattn.attention`` are the functions, as they were.)
from . import checker
from .learn import plot
from .nn import layer, interop
from .compute import cache, packed

__all__ = ["multi_head_attention", "pack_weights", "PackedWeights", "attention", "attention_grad", "merge_attention",
           "KVCache", "PagedKVCache", "multi_head_attention_grad", "backward", "Context", "RoPE",
           "RelativeBias", "BlockMask",
           "param_count", "reference", "worked_example",
           "MultiHeadAttention", "from_torch_masks", "to_torch_attn_mask",
           "get_isa", "set_num_threads", "get_num_threads",
           "trace", "Trace", "plot_attention", "check_prototype",
           "check_attention_prototype"]
