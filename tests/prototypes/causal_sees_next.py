"""Causal mask off by one the other way: j <= i + 1 lets a query see the next token."""
import numpy as np

EXPECTED = ('causal_sees_next',)

def prototype(x, w_q, w_k, w_v, w_o, num_heads, causal=False):
    T, h = len(x), num_heads
    Q = (x @ w_q).reshape(T, h, -1).transpose(1, 0, 2)
    K = (x @ w_k).reshape(T, h, -1).transpose(1, 0, 2)
    V = (x @ w_v).reshape(T, h, -1).transpose(1, 0, 2)
    S = Q @ K.transpose(0, 2, 1) / np.sqrt(Q.shape[-1])
    if causal:
        allowed = np.tril(np.ones((T, T), bool), k=1)
        S = np.where(allowed, S, -np.inf)
    A = np.exp(S - S.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)
    return (A @ V).transpose(1, 0, 2).reshape(T, -1) @ w_o
