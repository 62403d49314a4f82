"""reshape(h, T, d) at the split; the merge is right."""
import numpy as np

EXPECTED = ('split_reshape_no_transpose',)

def prototype(x, w_q, w_k, w_v, w_o, num_heads):
    T, h = x.shape[0], num_heads
    Q, K, V = x @ w_q, x @ w_k, x @ w_v
    q = Q.reshape(h, T, -1)
    k = K.reshape(h, T, -1)
    v = V.reshape(h, T, -1)
    s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    a = np.exp(s - s.max(axis=-1, keepdims=True))
    a = a / a.sum(axis=-1, keepdims=True)
    o = a @ v
    z = o.transpose(1, 0, 2).reshape(T, -1)
    return z @ w_o
