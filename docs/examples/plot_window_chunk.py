"""
Sliding windows and packed sequences
====================================

Two sparse patterns that today's models use, each a keyword of
:func:`mhattn.multi_head_attention` rather than a dense mask: a sliding
window (``window=(left, right)``, Mistral, Gemma, Longformer) and packed
sequences (``cu_seqlens``, FlashAttention's varlen), where several sequences
share one ``(total, d_model)`` array and each attends only within itself.
Key blocks that no query can see are skipped, not computed and thrown away.
"""
import numpy as np

import mhattn

rng = np.random.default_rng(2)
layer = mhattn.MultiHeadAttention(16, 2, seed=2)       # 2 heads, d_k = 8
T = 16
x = rng.standard_normal((T, 16)).astype(np.float32)

# %%
# A causal sliding window
# -----------------------
# Mistral's ``sliding_window=W`` is ``window=(W - 1, 0)`` with
# ``causal=True``: query i sees keys ``i - 3 .. i`` for W = 4, so each row
# has at most four non-zero weights, a band along the diagonal.
_, w_win = layer(x, causal=True, window=(3, 0), return_weights=True)
print("keys seen by each query:", (w_win[0] > 0).sum(axis=-1))

fig_window = mhattn.plot_attention(w_win, causal=True, window=(3, 0),
                                   title="causal=True, window=(3, 0)")

# %%
# The window is a rule on positions, so the same call with the equivalent
# boolean mask (True = may attend) gives the same weights. The keyword needs
# no ``(T, T)`` array, and it tells the core which key blocks to skip.
i, j = np.indices((T, T))
band = (j <= i) & (j >= i - 3)
_, w_mask = layer(x, mask=band, return_weights=True)
print("window == boolean band mask:", bool(np.allclose(w_win, w_mask, atol=1e-6)))

# %%
# A two-sided window
# ------------------
# An encoder's local attention sees both ways: ``window=(2, 2)`` without
# ``causal`` lets query i see keys ``i - 2 .. i + 2``.
_, w_local = layer(x, window=(2, 2), return_weights=True)
print("keys seen by each query:", (w_local[0] > 0).sum(axis=-1))

fig_local = mhattn.plot_attention(w_local, heads=0, window=(2, 2),
                                  title="window=(2, 2), not causal")

# %%
# Packed sequences: a block-diagonal pattern
# ------------------------------------------
# Three sequences of 5, 3 and 8 tokens packed into one ``(16, d_model)``
# array, with offsets ``cu_seqlens = [0, 5, 8, 16]``. Each sequence attends
# only within itself, causally: the weights are three lower triangles on
# the diagonal. No padding is stored and no work is spent between
# sequences.
cu_seqlens = np.array([0, 5, 8, 16])
out_packed, w_packed = layer(x, causal=True, cu_seqlens=cu_seqlens,
                             return_weights=True)

# The same visibility as a boolean mask, for the drawing only.
seq_id = np.repeat(np.arange(3), np.diff(cu_seqlens))
same_seq = seq_id[:, None] == seq_id[None, :]
print("weight across sequences:", float(w_packed[:, ~same_seq].max()))

fig_packed = mhattn.plot_attention(w_packed, mask=same_seq, causal=True,
                                   title="cu_seqlens = [0, 5, 8, 16], causal")

# %%
# A packed call equals one call per sequence:
separate = np.concatenate([layer(x[a:b], causal=True)
                           for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])])
print("max abs difference, packed vs separate calls:",
      float(np.round(np.abs(out_packed - separate).max(), 6)))
