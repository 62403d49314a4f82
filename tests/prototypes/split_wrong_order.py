"""np.split on features, but each new head is prepended."""
import numpy as np

EXPECTED = ('heads_wrong_order',)

def prototype(x, w_q, w_k, w_v, w_o, num_heads):
    qs = np.split(x @ w_q, num_heads, axis=1)
    ks = np.split(x @ w_k, num_heads, axis=1)
    vs = np.split(x @ w_v, num_heads, axis=1)
    z = None
    for q, k, v in zip(qs, ks, vs):
        s = q @ k.T / np.sqrt(q.shape[1])
        p = np.exp(s - s.max(axis=1, keepdims=True))
        head = p / p.sum(axis=1, keepdims=True) @ v
        z = head if z is None else np.concatenate([head, z], axis=1)   # prepends
    return z @ w_o
