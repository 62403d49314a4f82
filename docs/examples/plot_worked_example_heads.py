"""
The worked example's two heads
==============================

The document's three tokens, *ball*, *full* and *it*, and its two heads of
width 2: each head's attention weights, drawn as a heatmap. Head 1 sends
*it* to *ball*, head 2 to *full*, each with weight 0.7337.
"""
import numpy as np

import mhattn

tokens, x, w_q, w_k, w_v, w_o = mhattn.worked_example()
out, weights = mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, return_weights=True)
print("weights of 'it':", np.round(weights[:, 2], 4))
print("output of 'it':", np.round(out[2], 4))

# %%
# :func:`mhattn.plot_attention` draws every head's weights side by side.
fig = mhattn.plot_attention(weights, tokens=tokens)
