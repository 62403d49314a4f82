"""einsum: no max subtraction, and W^O transposed."""
import numpy as np

EXPECTED = ('no_max_subtraction', 'wo_transposed')

def prototype(x, w_q, w_k, w_v, w_o, num_heads):
    T, h = x.shape[0], num_heads
    Q = (x @ w_q).reshape(T, h, -1)
    K = (x @ w_k).reshape(T, h, -1)
    V = (x @ w_v).reshape(T, h, -1)
    A = np.exp(np.einsum("qhd,khd->hqk", Q, K) / np.sqrt(Q.shape[-1]))
    A = A / A.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", A, V).reshape(T, -1) @ w_o.T
