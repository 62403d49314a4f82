"""nn.Linear habit: x @ W.T."""
import numpy as np

EXPECTED = ('projections_transposed',)

def prototype(x, w_q, w_k, w_v, w_o, num_heads):
    T, h = x.shape[0], num_heads
    Q, K, V = x @ w_q.T, x @ w_k.T, x @ w_v.T
    q = Q.reshape(T, h, -1).transpose(1, 0, 2)
    k = K.reshape(T, h, -1).transpose(1, 0, 2)
    v = V.reshape(T, h, -1).transpose(1, 0, 2)
    s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    a = np.exp(s - s.max(axis=-1, keepdims=True))
    a = a / a.sum(axis=-1, keepdims=True)
    o = a @ v
    z = o.transpose(1, 0, 2).reshape(T, -1)
    return z @ w_o
