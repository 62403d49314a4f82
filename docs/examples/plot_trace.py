"""
Tracing a call: scores before and after the softmax
===================================================

:func:`mhattn.trace` takes the arguments of
:func:`mhattn.multi_head_attention` and returns a :class:`mhattn.Trace`
holding every intermediate step, per head: the projections, the raw scores
``Q K^T``, the scaled and masked scores, each row's maximum and log-sum-exp,
the weights, each head's output, the concatenation and the output. Here a
small causal call is traced and its scores are drawn before and after the
softmax.
"""
import numpy as np
from matplotlib.figure import Figure

import mhattn

tokens = "we read the book it was long".split()
rng = np.random.default_rng(3)
layer = mhattn.MultiHeadAttention(16, 2, seed=3)       # 2 heads, d_k = d_v = 8
x = 2 * rng.standard_normal((len(tokens), 16)).astype(np.float32)

t = mhattn.trace(x, layer.w_q, layer.w_k, layer.w_v, layer.w_o,
                 causal=True, tokens=tokens)
print(t)
print("each head's scale 1/sqrt(d_k):", np.round(t.scales, 4))
print("trace output == the layer's output:",
      bool(np.allclose(t.output, layer(x, causal=True), atol=1e-6)))

# %%
# The scores
# ----------
# ``t.scores`` holds ``Q K^T / sqrt(d_k)`` with ``-inf`` where the causal
# mask blocks. :func:`mhattn.plot_attention` draws a trace's scores with
# ``kind="scores"``: a diverging colour map centred on 0, the blocked cells
# hatched.
fig_scores = mhattn.plot_attention(t, kind="scores", title="scaled scores (causal)")

# %%
# The weights
# -----------
# The same trace drawn as weights (the default ``kind``): each row's softmax
# over the keys it may see. The masks come from the trace, so nothing else
# needs to be passed.
fig_weights = mhattn.plot_attention(t, title="weights = softmax of each row")

# %%
# One row through the softmax
# ---------------------------
# The query *it* (row 4) in head 1. Its weights are
# ``exp(score - lse)``, with ``lse`` the natural log-sum-exp of the row; the
# trace keeps the row's maximum too, which the softmax subtracts first so
# that ``exp`` cannot overflow.
row = 4
scores = t.scores[0, row]
print("scores:", np.round(scores, 4))
print("row max:", np.round(t.row_max[0, row], 4), " lse:", np.round(t.lse[0, row], 4))
print("weights:", np.round(t.weights[0, row], 4))
print("weights == exp(scores - lse):",
      bool(np.allclose(np.exp(scores - t.lse[0, row]), t.weights[0, row], atol=1e-6)))

fig_row = Figure(figsize=(8, 3), layout="constrained")
ax_s, ax_w = fig_row.subplots(1, 2, sharex=True)
seen = np.isfinite(scores)
pos = np.arange(len(tokens))
ax_s.bar(pos[seen], scores[seen], color="tab:blue")
ax_s.axhline(0, color="black", linewidth=0.8)
ax_s.axhline(t.row_max[0, row], color="tab:red", linestyle="--", label="row max")
ax_s.set_title("scaled scores of 'it' (head 1)")
ax_s.legend(loc="lower right", fontsize="small")
ax_w.bar(pos, t.weights[0, row], color="tab:green")
ax_w.set_title("weights of 'it' (head 1)")
ax_w.set_ylim(0, 1)
for ax in (ax_s, ax_w):
    ax.set_xticks(pos, tokens, rotation=45, ha="right")
    ax.set_xlabel("key")
for k in pos[~seen]:
    ax_s.text(k, 0, "masked", rotation=90, ha="center", va="bottom",
              fontsize="small", color="grey")
