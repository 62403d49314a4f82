"""Correct: one head at a time, np.hstack."""
import numpy as np

EXPECTED = ()

def prototype(x, w_q, w_k, w_v, w_o, num_heads):
    d_k = w_q.shape[1] // num_heads
    d_v = w_v.shape[1] // num_heads
    heads = []
    for i in range(num_heads):
        q = x @ w_q[:, i*d_k:(i+1)*d_k]
        k = x @ w_k[:, i*d_k:(i+1)*d_k]
        v = x @ w_v[:, i*d_v:(i+1)*d_v]
        s = q @ k.T / np.sqrt(d_k)
        e = np.exp(s - s.max(axis=1, keepdims=True))
        heads.append(e / e.sum(axis=1, keepdims=True) @ v)
    return np.hstack(heads) @ w_o
