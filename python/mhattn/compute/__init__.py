"""The compute API: multi-head attention and its gradients computed by the C core.

- :mod:`.forward`: :func:`multi_head_attention`, the layer's forward;
- :mod:`.grad`: :func:`backward`, :func:`multi_head_attention_grad` and the
  :class:`Context` a forward keeps for them;
- :mod:`.attention`: :func:`attention` on projected tensors, its gradient
  and :func:`merge_attention`;
- :mod:`.cache`: :class:`KVCache`, a decoder's keys and values;
- :mod:`.paged`: :class:`PagedKVCache`, many sequences' keys and values in pages;
- :mod:`.packed`: :func:`pack_weights`, a layer's weights packed once.

Built on ``mhattn._internal``; imports nothing of ``learn`` or ``nn``.
"""
from .forward import multi_head_attention
from .packed import pack_weights, PackedWeights
from .attention import attention, attention_grad, merge_attention
from .cache import KVCache
from .paged import PagedKVCache
from .grad import Context, backward, multi_head_attention_grad

__all__ = ["multi_head_attention", "pack_weights", "PackedWeights", "attention",
           "attention_grad", "merge_attention", "KVCache", "PagedKVCache", "Context", "backward",
           "multi_head_attention_grad"]
