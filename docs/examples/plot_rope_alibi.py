"""
How RoPE and ALiBi see distance
===============================

Attention by itself ignores order: if every token carried the same vector,
every query would weigh every key equally. Positional schemes change that
inside the attention call. Here 64 identical tokens make the effect of
position the only thing left to see, for the last query (position 63,
causal, so it sees all 64 keys):

- ``rope=mhattn.RoPE(theta)`` turns q and k by angles proportional to their
  positions, so ``q . k`` depends on the distance between them (Llama,
  Qwen, GPT-NeoX);
- ``alibi_slopes`` adds ``-slope * distance`` to each head's scores (BLOOM).
"""
import numpy as np
from matplotlib.figure import Figure

import mhattn

T, d_model = 64, 32
rng = np.random.default_rng(4)
token = rng.standard_normal(d_model)
x = np.tile(token, (T, 1))                 # (T, d_model): every token the same
eye = np.eye(d_model)                      # W^Q = W^K = W^V = I: q = k = v = x
distance = T - 1 - np.arange(T)            # from the last query to each key

_, w_plain = mhattn.multi_head_attention(x, eye, eye, eye, num_heads=1, causal=True,
                                         return_weights=True)
print("no positions: the last query's weights are all 1/64:",
      bool(np.allclose(w_plain[0, -1], 1 / T)))

# %%
# RoPE: a score that depends on the distance
# ------------------------------------------
# With one head of width 32, RoPE turns 16 pairs of features, pair c by
# ``position * theta ** (-2c / 32)``. For q = k the scaled score at distance
# n is ``sum_c |z_c|^2 cos(n * freq_c) / sqrt(d_k)``, with ``z_c`` pair c of
# the vector: it is largest at distance 0, where q and k are turned alike,
# and lower at every other distance, with ripples from the pairs' different
# speeds. A smaller ``theta`` turns every pair faster, so the score falls
# further, and the query keeps more of its weight on nearby keys.
# :func:`mhattn.trace` gives the scores, after RoPE and the scale.
rope_scores = {}
for theta in (10000.0, 100.0):
    t = mhattn.trace(x, eye, eye, eye, num_heads=1, causal=True,
                     rope=mhattn.RoPE(theta=theta))
    rope_scores[theta] = t.scores[0, -1]
    w = t.weights[0, -1]
    print(f"theta {theta:g}: score at distance 0, 1, 8, 63:",
          np.round(t.scores[0, -1, [63, 62, 55, 0]], 3),
          " weight on the query's own key:", np.round(w[-1], 4))

# %%
# ALiBi: a linear penalty per head
# --------------------------------
# Four heads of width 8, with the geometric slopes ALiBi gives four heads:
# 1/4, 1/16, 1/64 and 1/256. The tokens are identical, so a head's weights
# are proportional to ``exp(-slope * distance)``: a straight line on a log
# scale, steep for the first head and nearly flat for the last. Each step
# back multiplies the weight by ``exp(-slope)``.
slopes = 2.0 ** -np.array([2, 4, 6, 8])
_, w_alibi = mhattn.multi_head_attention(x, eye, eye, eye, num_heads=4, causal=True,
                                         alibi_slopes=slopes, return_weights=True)
last = w_alibi[:, -1]                      # (4, T): each head's last row
ratio = last[:, -2] / last[:, -1]          # one step back
print("weight ratio one step back:", np.round(ratio, 4))
print("exp(-slope):               ", np.round(np.exp(-slopes), 4))
print("weight on the query's own key:", np.round(last[:, -1], 4))

# %%
# Both, drawn against the distance from the query.
fig = Figure(figsize=(10, 4), layout="constrained")
ax_rope, ax_alibi = fig.subplots(1, 2)
for theta, scores in rope_scores.items():
    ax_rope.plot(distance, scores, marker=".", label=f"RoPE, theta = {theta:g}")
ax_rope.axhline(np.dot(token, token) / np.sqrt(d_model), color="grey", linestyle="--",
                linewidth=1, label="no positions: every score")
ax_rope.set_xlabel("distance from the query (positions back)")
ax_rope.set_ylabel("scaled score q . k / sqrt(d_k)")
ax_rope.set_title("RoPE: the score of the last query")
ax_rope.set_ylim(-3.5, 7.5)
ax_rope.legend(loc="lower left", fontsize="small")

for h in range(4):
    ax_alibi.plot(distance, last[h], label=f"head {h + 1}, slope 1/{int(1 / slopes[h])}")
ax_alibi.axhline(1 / T, color="grey", linestyle="--", linewidth=1,
                 label="no positions: 1/64")
ax_alibi.set_yscale("log")
ax_alibi.set_xlabel("distance from the query (positions back)")
ax_alibi.set_ylabel("attention weight")
ax_alibi.set_title("ALiBi: the weights of the last query")
ax_alibi.legend(fontsize="small")
