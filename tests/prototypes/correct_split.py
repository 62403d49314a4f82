"""Correct: np.split along the features."""
import numpy as np

EXPECTED = ()

def prototype(x, w_q, w_k, w_v, w_o, num_heads):
    qs = np.split(x @ w_q, num_heads, axis=1)
    ks = np.split(x @ w_k, num_heads, axis=1)
    vs = np.split(x @ w_v, num_heads, axis=1)
    out = []
    for q, k, v in zip(qs, ks, vs):
        s = q @ k.T / np.sqrt(q.shape[1])
        p = np.exp(s - np.max(s, axis=-1, keepdims=True))
        out.append((p / np.sum(p, axis=-1, keepdims=True)) @ v)
    return np.concatenate(out, axis=1) @ w_o
