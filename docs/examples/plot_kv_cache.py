"""
Decoding with a KV cache
========================

A decoder generates one token at a time, and each new token attends to
every token before it. :class:`mhattn.KVCache` keeps the keys and values
already computed, so a step projects only the new row: here a layer with
grouped-query attention (4 query heads sharing 2 key/value heads) and RoPE
reads a 4-token prompt, then 20 tokens one by one. The steps give the
output of one causal call over the whole sequence. A cache stored in
float16 holds the keys and values in half the bytes, one in int8 in a
quarter plus one float32 scale per token and kv head, at the price of a
small error.
"""
import numpy as np
from matplotlib.figure import Figure

import mhattn

rng = np.random.default_rng(5)
layer = mhattn.MultiHeadAttention(32, 4, num_kv_heads=2, seed=5)   # d_k = 8
rope = mhattn.RoPE()
T, prompt = 24, 4
x = rng.standard_normal((1, T, 32)).astype(np.float32)    # (B, T, d_model)

# The reference: one causal call over all 24 tokens.
full, w_full = layer(x, causal=True, rope=rope, return_weights=True)


def decode(dtype):
    """Prefill the prompt, then one token per step; the outputs and weights."""
    cache = mhattn.KVCache(1, 2, capacity=32, d_k=8, dtype=dtype)
    outs = [layer(x[:, :prompt], causal=True, rope=rope, cache=cache)]
    weights = []
    for i in range(prompt, T):
        out, w = layer(x[:, i:i + 1], causal=True, rope=rope, cache=cache,
                       return_weights=True)                # w: (B, h, 1, capacity)
        outs.append(out)
        weights.append(w[0, :, 0])
    return cache, np.concatenate(outs, axis=1), np.stack(weights, axis=1)


cache, out32, w32 = decode(np.float32)
print("cache:", cache.lengths, "tokens held of", cache.capacity, "|", cache.nbytes, "bytes")
print(f"max abs difference, float32 cache vs the full causal call: "
      f"{np.abs(out32 - full).max():.1e}")

# %%
# Attention over the growing cache
# --------------------------------
# Each decode step returns its weights over the whole capacity,
# ``(B, h, 1, capacity)``; rows past the cache's length get 0. Stacked, the
# 20 steps form the bottom 20 rows of the full call's causal weights: step
# n sees the prompt and the n tokens appended since. Heads 1 and 2 read the
# same cached keys (kv head 1), heads 3 and 4 the other, but each has its
# own queries. The colour scale stops at the largest weight drawn
# (``vmax="auto"``), since this random layer spreads its weight thinly.
steps = w32[:, :, :T]                                      # (h, 20 steps, 24 keys)
print("weights past the length are 0:", bool((w32[:, :, T:] == 0).all()))
print("steps' weights == the full call's last 20 rows:",
      bool(np.allclose(steps, w_full[0, :, prompt:], atol=1e-6)))

step_labels = [f"step {n}" for n in range(1, T - prompt + 1)]
key_labels = [str(j) if j % 4 == 0 else "" for j in range(T)]     # every 4th key
fig_weights = mhattn.plot_attention(steps, causal=True, ncols=2, vmax="auto",
                                    tokens=step_labels, key_tokens=key_labels,
                                    title="each decode step's weights over the cache")

# %%
# Half and int8 caches
# --------------------
# ``dtype=np.float16`` rounds each appended key and value once;
# ``dtype="int8"`` quantises each row with one float32 scale per token and
# kv head. A step still computes in float32. The error against the float32
# cache stays small and does not grow as the cache fills.
errors = {}
for dtype, name in [(np.float16, "float16"), ("int8", "int8")]:
    c, out, _ = decode(dtype)
    errors[name] = np.abs(out - out32)[0].max(axis=-1)     # per token
    print(f"{name:8s} cache: {c.nbytes:5d} bytes, max abs error vs float32 "
          f"{errors[name].max():.1e}")

fig_error = Figure(figsize=(7, 3.5), layout="constrained")
ax = fig_error.subplots()
for name, err in errors.items():
    ax.semilogy(np.arange(1, T + 1), err, marker="o", markersize=3, label=f"{name} cache")
ax.axvspan(0.5, prompt + 0.5, color="grey", alpha=0.15, label="prompt (prefill)")
ax.set_xlabel("token")
ax.set_ylabel("max abs error of the output")
ax.set_title("against the same steps through a float32 cache")
ax.legend(fontsize="small")
