"""
Checking a buggy prototype
==========================

:func:`mhattn.check_prototype` runs your own implementation of multi-head
attention on designed and random trials, compares it with mhattn, and when
they differ names the mistake that reproduces your outputs. Here a NumPy
prototype takes the softmax over the wrong axis, a common slip: the checker
names it, and a drawing of the weights shows what went wrong.
"""
import numpy as np
from matplotlib.figure import Figure

import mhattn


def softmax(s, axis):
    e = np.exp(s - s.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def prototype(x, w_q, w_k, w_v, w_o, num_heads):
    """Fused weights (d_model, h*d_k): head i owns columns [i*d_k, (i+1)*d_k)."""
    T = x.shape[0]
    q = (x @ w_q).reshape(T, num_heads, -1).transpose(1, 0, 2)   # (h, T, d_k)
    k = (x @ w_k).reshape(T, num_heads, -1).transpose(1, 0, 2)
    v = (x @ w_v).reshape(T, num_heads, -1).transpose(1, 0, 2)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])     # (h, T_q, T_k)
    weights = softmax(scores, axis=1)          # the bug: axis 1 holds the queries
    heads = weights @ v
    concat = heads.transpose(1, 0, 2).reshape(T, -1)
    return {"weights": weights, "output": concat @ w_o}


# %%
# The checker's report
# --------------------
# The prototype returns a dict, so the checker also compares its
# intermediates with :func:`mhattn.trace` and says which stage diverges
# first. The first line is the verdict.
report = mhattn.check_prototype(prototype)
print(report)

# %%
print("ok:", report.ok, " mistake:", report.mistake)

# %%
# What the bug looks like
# -----------------------
# On the document's worked example (*ball*, *full*, *it*; two heads), the
# prototype's weights next to mhattn's. mhattn's rows are distributions over
# the keys, each summing to 1; the prototype's *columns* sum to 1 instead,
# so the weights of *it* no longer say how much it attends to each word.
# In this example ``W^Q = W^K``, so the scores are symmetric and the
# prototype's weights are exactly mhattn's, transposed.
tokens, x, w_q, w_k, w_v, w_o = mhattn.worked_example()
_, weights = mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, return_weights=True)
fused = [np.concatenate(w, axis=1) for w in (w_q, w_k, w_v)]
mine = prototype(x, *fused, w_o, 2)["weights"]
print("mhattn, row sums of head 1:   ", np.round(weights[0].sum(axis=1), 4))
print("prototype, row sums of head 1:", np.round(mine[0].sum(axis=1), 4))
print("prototype, column sums:       ", np.round(mine[0].sum(axis=0), 4))
print("prototype == mhattn transposed:",
      bool(np.allclose(mine, weights.transpose(0, 2, 1), atol=1e-12)))
print("weights of 'it', head 1: mhattn", np.round(weights[0, 2], 4),
      " prototype", np.round(mine[0, 2], 4))

fig = Figure(figsize=(8, 5), layout="constrained")
axes = fig.subplots(2, 2)
for r, (who, w) in enumerate([("mhattn", weights), ("prototype", mine)]):
    for h in range(2):
        ax = axes[r, h]
        image = ax.imshow(w[h], vmin=0, vmax=1, cmap="viridis")
        for i in range(3):
            for j in range(3):
                ax.text(j, i, f"{w[h, i, j]:.2f}", ha="center", va="center",
                        color="white" if w[h, i, j] < 0.6 else "black")
        sums = w[h].sum(axis=1)
        ax.set_yticks(range(3), [f"{t}  (row sum {s:.2f})" for t, s in zip(tokens, sums)])
        ax.set_xticks(range(3), tokens)
        ax.set_title(f"{who}, head {h + 1}")
axes[1, 0].set_xlabel("key")
axes[1, 1].set_xlabel("key")
fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")

# %%
# The fix
# -------
# The softmax over the last axis, the keys. The checker then finds no
# difference.
def fixed(x, w_q, w_k, w_v, w_o, num_heads):
    T = x.shape[0]
    q = (x @ w_q).reshape(T, num_heads, -1).transpose(1, 0, 2)
    k = (x @ w_k).reshape(T, num_heads, -1).transpose(1, 0, 2)
    v = (x @ w_v).reshape(T, num_heads, -1).transpose(1, 0, 2)
    weights = softmax(q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1]), axis=-1)
    concat = (weights @ v).transpose(1, 0, 2).reshape(T, -1)
    return {"weights": weights, "output": concat @ w_o}


report_fixed = mhattn.check_prototype(fixed)
print(report_fixed.title)
print("ok:", report_fixed.ok)
