"""Blocked scores set to -1e9 instead of -inf: a row with no key averages every value."""
import numpy as np

EXPECTED = ('mask_large_negative',)

def prototype(x, w_q, w_k, w_v, w_o, num_heads, mask=None):
    T, h = len(x), num_heads
    Q = (x @ w_q).reshape(T, h, -1).transpose(1, 0, 2)
    K = (x @ w_k).reshape(T, h, -1).transpose(1, 0, 2)
    V = (x @ w_v).reshape(T, h, -1).transpose(1, 0, 2)
    S = Q @ K.transpose(0, 2, 1) / np.sqrt(Q.shape[-1])
    if mask is not None:
        S = np.where(mask, S, -1e9)
    A = np.exp(S - S.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)
    return (A @ V).transpose(1, 0, 2).reshape(T, -1) @ w_o
