"""The layer class and PyTorch interop.

- :mod:`.layer`: :class:`MultiHeadAttention`, a layer that owns its weights
  (PyTorch's ``nn.MultiheadAttention`` conventions);
- :mod:`.interop`: :func:`from_torch_masks` and :func:`to_torch_attn_mask`,
  PyTorch's masks to mhattn's and back.
"""
from .layer import MultiHeadAttention
from .interop import from_torch_masks, to_torch_attn_mask

__all__ = ["MultiHeadAttention", "from_torch_masks", "to_torch_attn_mask"]
