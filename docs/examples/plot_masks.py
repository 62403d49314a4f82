"""
The mask convention, drawn
==========================

mhattn has one mask convention: a boolean mask is True where a query *may*
attend, a float mask is added to the scaled scores (``-inf`` blocks), and
``causal=True`` aligns its triangle bottom-right. Four calls of one small
layer show it: a boolean mask, padding given by ``key_lengths``, a causal
call with fewer queries than keys, and a row that may see no key at all.
:func:`mhattn.plot_attention` is given the same visibility arguments as the
call and draws the cells no query can see hatched in grey.
"""
import numpy as np

import mhattn

rng = np.random.default_rng(1)
layer = mhattn.MultiHeadAttention(16, 2, seed=1)       # 2 heads, d_k = 8
tokens = ["Q:", "is", "it", "warm", "A:", "yes", "it", "is"]
x = rng.standard_normal((len(tokens), 16)).astype(np.float32)

# %%
# A boolean mask: True = may attend
# ---------------------------------
# A prefix language model reads its prompt (the first four tokens) in both
# directions and writes the answer left to right: every query may see the
# whole prompt, and an answer token also sees the answer tokens before it.
T = len(tokens)
prefix = 4
mask = np.tril(np.ones((T, T), dtype=bool))    # causal ...
mask[:, :prefix] = True                        # ... plus the whole prompt
out, weights = layer(x, mask=mask, return_weights=True)
print("query 'Q:' (row 0), head 1:", np.round(weights[0, 0], 4))
print("weight where the mask is False:", float(weights[:, ~mask].max()))

fig_mask = mhattn.plot_attention(weights, tokens=tokens, mask=mask,
                                 title="boolean mask: prompt both ways, answer causal")

# %%
# The same mask as a float mask, added to the scaled scores, gives the same
# weights: ``0`` where the boolean mask is True, ``-inf`` where it is False.
float_mask = np.where(mask, 0.0, -np.inf).astype(np.float32)
_, weights_f = layer(x, mask=float_mask, return_weights=True)
print("float mask gives the same weights:",
      bool(np.allclose(weights, weights_f, rtol=0, atol=1e-7)))

# %%
# Padding: ``key_lengths``
# ------------------------
# Two sequences of 6 and 4 tokens in one batch of shape ``(2, 6, d_model)``.
# ``key_lengths=[6, 4]`` marks keys 4 and 5 of the second item as padding:
# no query attends to them. Its padded *queries* still get an output (the
# real keys are visible to them); drop those rows yourself.
xb = rng.standard_normal((2, 6, 16)).astype(np.float32)
lengths = np.array([6, 4])
out_b, weights_b = layer(xb, key_lengths=lengths, return_weights=True)
print("weights:", weights_b.shape)
print("weight on item 1's padding keys:", float(weights_b[1, :, :, 4:].max()))
print("item 1's rows sum to 1:", bool(np.allclose(weights_b[1].sum(-1), 1, atol=1e-6)))

fig_padding = mhattn.plot_attention(weights_b, batch=1, key_lengths=lengths,
                                    title="batch item 1, key_lengths = 4")

# %%
# Causal with fewer queries than keys
# -----------------------------------
# The last three tokens as queries against all eight keys, as when a
# decoder has seen five tokens and processes three new ones. With
# ``causal=True`` query i sees keys ``j <= i + (T_k - T_q)``: the triangle
# sits at the bottom right, so the last query sees every key and each query
# sees the keys up to its own position. PyTorch SDPA's ``is_causal=True``
# aligns it top-left instead (``j <= i``), which would hide most of the past
# from these queries.
x_new = x[5:]                                  # "yes", "it", "is": (3, 16)
_, weights_c = layer(x_new, key=x, causal=True, return_weights=True)
visible = (weights_c[0] > 0).sum(axis=-1)
print("weights:", weights_c.shape)
print("keys each of the 3 queries sees:", visible)

fig_causal = mhattn.plot_attention(weights_c, tokens=tokens[5:], key_tokens=tokens,
                                   causal=True,
                                   title="causal, T_q = 3, T_k = 8: bottom-right")

# %%
# A fully masked row gives zeros
# ------------------------------
# If a query may attend to no key, softmax over nothing would be 0 / 0.
# mhattn defines that row's weights as 0 and its output as 0 (or ``b_o``),
# never NaN.
mask_empty = np.ones((T, T), dtype=bool)
mask_empty[2] = False                          # query "it" may see nothing
out_e, weights_e = layer(x, mask=mask_empty, return_weights=True)
print("weights of the fully masked row, head 1:", weights_e[0, 2])
print("largest abs value of its output:", float(np.abs(out_e[2]).max()))
print("any NaN:", bool(np.isnan(out_e).any()))

fig_empty = mhattn.plot_attention(weights_e, tokens=tokens, mask=mask_empty,
                                  heads=0, title="row 'it' fully masked")
