"""Causal mask off by one: j < i, so a query cannot see its own token."""
import numpy as np

EXPECTED = ('causal_blocks_self',)

def prototype(x, w_q, w_k, w_v, w_o, num_heads, causal=False):
    T, h = len(x), num_heads
    Q = (x @ w_q).reshape(T, h, -1).transpose(1, 0, 2)
    K = (x @ w_k).reshape(T, h, -1).transpose(1, 0, 2)
    V = (x @ w_v).reshape(T, h, -1).transpose(1, 0, 2)
    S = Q @ K.transpose(0, 2, 1) / np.sqrt(Q.shape[-1])
    if causal:
        i, j = np.indices((T, T))
        S = np.where(j < i, S, -np.inf)
    A = np.exp(S - S.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)
    return (A @ V).transpose(1, 0, 2).reshape(T, -1) @ w_o
