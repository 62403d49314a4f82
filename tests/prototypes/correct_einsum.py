"""Correct: einsum with (T, h, d) operands."""
import numpy as np

EXPECTED = ()

def prototype(x, w_q, w_k, w_v, w_o, num_heads):
    T, h = x.shape[0], num_heads
    Q = (x @ w_q).reshape(T, h, -1)
    K = (x @ w_k).reshape(T, h, -1)
    V = (x @ w_v).reshape(T, h, -1)
    S = np.einsum("qhd,khd->hqk", Q, K) / np.sqrt(Q.shape[-1])
    S = S - S.max(axis=-1, keepdims=True)
    A = np.exp(S) / np.exp(S).sum(axis=-1, keepdims=True)
    O = np.einsum("hqk,khd->qhd", A, V)
    return O.reshape(T, -1) @ w_o
