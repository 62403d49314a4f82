"""np.split's default axis 0: heads get tokens."""
import numpy as np

EXPECTED = ('heads_split_sequence',)

def prototype(x, w_q, w_k, w_v, w_o, num_heads):
    d_k = w_q.shape[1] // num_heads
    outs = []
    for q, k, v in zip(np.split(x @ w_q, num_heads), np.split(x @ w_k, num_heads),
                       np.split(x @ w_v, num_heads)):
        s = q @ k.T / np.sqrt(d_k)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        outs.append(p / p.sum(axis=-1, keepdims=True) @ v)
    return np.concatenate(outs) @ w_o
