"""
Six heads side by side
======================

A random layer with six heads attends over a twelve-word sentence. Each
head has its own W^Q_i and W^K_i, so each spreads its weight differently
over the same tokens. :func:`mhattn.plot_attention` draws every head's
weights in one figure with a shared colour scale, first without and then
with a causal mask.
"""
import numpy as np

import mhattn

tokens = "the cat sat on the mat because it was warm and soft".split()
rng = np.random.default_rng(0)
layer = mhattn.MultiHeadAttention(48, 6, seed=0)        # d_model 48, d_k = d_v = 8
x = 2 * rng.standard_normal((len(tokens), 48)).astype(np.float32)   # (T, d_model)

out, weights = layer(x, return_weights=True)
print("out:", out.shape, " weights:", weights.shape)

# %%
# Each panel is one head: row i is query *i*'s distribution over the keys,
# so every row sums to 1. The mean entropy of a head's rows says how spread
# out it is: ``log(12) = 2.4849`` for a head that weighs every key equally,
# 0 for one that looks at a single key.
entropy = -(weights * np.log(weights)).sum(axis=-1).mean(axis=-1)
print("largest weight per head:", np.round(weights.max(axis=(1, 2)), 4))
print("mean row entropy per head:", np.round(entropy, 4))
print("rows sum to 1:", bool(np.allclose(weights.sum(axis=-1), 1, atol=1e-6)))

fig = mhattn.plot_attention(weights, tokens=tokens, ncols=3,
                            title="six heads, no mask")

# %%
# The same layer as a decoder: with ``causal=True`` query *i* sees keys
# ``j <= i`` only. The cells it cannot see are drawn hatched, not as zeros,
# when ``plot_attention`` is told the call was causal. The first token sees
# only itself, so every head gives it weight 1.
out_c, weights_c = layer(x, return_weights=True, causal=True)
print("weights of 'the' (query 0), every head:", np.round(weights_c[:, 0, 0], 4))
print("weights above the diagonal are 0:",
      bool((np.triu(weights_c, k=1) == 0).all()))

fig_causal = mhattn.plot_attention(weights_c, tokens=tokens, ncols=3, causal=True,
                                   title="six heads, causal")
