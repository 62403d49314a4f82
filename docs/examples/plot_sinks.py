"""
Attention sinks: weight that goes nowhere
=========================================

A softmax must put all of a row's weight on some key, even when no key is
relevant. gpt-oss gives each head one learnable logit, a *sink*, that
joins the softmax's denominator as an extra key whose value is zero:
``sinks=`` in :func:`mhattn.multi_head_attention`. The weights returned
exclude the sink, so a row sums to ``1 - p_sink``, and the output is
scaled down by as much: each head's output is the one it would give
without the sink, times ``1 - p_sink``. Four heads with sinks of -2, 0, 2 and 4 show the
effect.
"""
import numpy as np
from matplotlib.figure import Figure

import mhattn

rng = np.random.default_rng(6)
T, d_model, h = 10, 32, 4
x = rng.standard_normal((T, d_model)).astype(np.float32)
w_q, w_k, w_v = (0.1 * rng.standard_normal((d_model, d_model)).astype(np.float32)
                 for _ in range(3))
sinks = np.array([-2.0, 0.0, 2.0, 4.0], dtype=np.float32)

_, weights = mhattn.multi_head_attention(x, w_q, w_k, w_v, num_heads=h, causal=True,
                                         sinks=sinks, return_weights=True)
row_sums = weights.sum(axis=-1)                            # (h, T)
print("mean row sum per head:", np.round(row_sums.mean(axis=1), 4))

# %%
# :func:`mhattn.plot_attention` accepts rows that sum to less than 1 when it
# is given the call's ``sinks``. The larger the sink, the darker the head:
# the weight it keeps is missing from every row.
fig = mhattn.plot_attention(weights, sinks=sinks, causal=True, ncols=4,
                            title="sinks = -2, 0, 2, 4 (causal)")

# %%
# The sink's share of each row
# ----------------------------
# The sink competes with the keys a query sees: ``p_sink = exp(s) / (exp(s)
# + sum_j exp(score_j))``. Early queries see few keys, so the sink takes more
# of their weight; later ones see more keys, and the share falls. This
# call's small weights keep the scores close to 0, so each head follows the
# dashed curve ``exp(s) / (exp(s) + n)`` of a query whose n scores are all 0.
# Without sinks, the rows sum to 1 and the head cannot opt out.
sink_share = 1 - row_sums
print("sink's share of query 0 (one key):", np.round(sink_share[:, 0], 4))
print("sink's share of query 9 (ten keys):", np.round(sink_share[:, -1], 4))

concat_plain, plain = mhattn.multi_head_attention(x, w_q, w_k, w_v, num_heads=h,
                                                  causal=True, return_weights=True)
print("without sinks, rows sum to 1:", bool(np.allclose(plain.sum(-1), 1, atol=1e-6)))

fig_share = Figure(figsize=(8, 3.5), layout="constrained")
ax = fig_share.subplots()
n = np.arange(1, T + 1)
for i in range(h):
    line, = ax.plot(n, sink_share[i], marker="o", label=f"head {i + 1}, sink {sinks[i]:g}")
    ax.plot(n, np.exp(sinks[i]) / (np.exp(sinks[i]) + n), linestyle="--",
            color=line.get_color(), linewidth=1)
ax.plot([], [], linestyle="--", color="grey", linewidth=1,
        label="exp(s) / (exp(s) + n)")
ax.set_xlabel("keys the query sees (causal: query index + 1)")
ax.set_ylabel("weight taken by the sink")
ax.set_ylim(0, 1)
ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1, 0.5))
ax.set_title("1 - row sum, per head")

# %%
# The output
# ----------
# With ``w_o=None`` the call returns the concatenation of the heads, ``(T, h*d_v)``:
# each head's output with the sink is the one without, times ``1 - p_sink``.
concat_sink = mhattn.multi_head_attention(x, w_q, w_k, w_v, num_heads=h, causal=True,
                                          sinks=sinks)
scaled = concat_plain.reshape(T, h, -1) * row_sums.T[:, :, None]
print("head outputs with sinks == without, times the row sums:",
      bool(np.allclose(concat_sink, scaled.reshape(T, -1), atol=1e-6)))
