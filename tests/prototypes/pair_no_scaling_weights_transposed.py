"""Two mistakes: no 1/sqrt(d_k), and the weights transposed before @ V."""
import numpy as np

EXPECTED = ("no_scaling", "weights_transposed")


def prototype(x, w_q, w_k, w_v, w_o, num_heads):
    d_k = w_q.shape[1] // num_heads
    d_v = w_v.shape[1] // num_heads
    heads = []
    for i in range(num_heads):
        q = x @ w_q[:, i*d_k:(i+1)*d_k]
        k = x @ w_k[:, i*d_k:(i+1)*d_k]
        v = x @ w_v[:, i*d_v:(i+1)*d_v]
        s = q @ k.T
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        w = w / w.sum(axis=-1, keepdims=True)
        heads.append(w.T @ v)
    return np.concatenate(heads, axis=-1) @ w_o
