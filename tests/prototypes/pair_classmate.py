"""The document's classmate: single-head attention run h times, then averaged."""
import numpy as np

EXPECTED = ('same_projection_every_head', 'heads_averaged')

def prototype(x, w_q, w_k, w_v, w_o, num_heads):
    d_k = w_q.shape[1] // num_heads
    d_v = w_v.shape[1] // num_heads
    heads = []
    for i in range(num_heads):
        q = x @ w_q[:, 0*d_k:(0+1)*d_k]
        k = x @ w_k[:, 0*d_k:(0+1)*d_k]
        v = x @ w_v[:, 0*d_v:(0+1)*d_v]
        s = q @ k.T / np.sqrt(d_k)
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        w = e / e.sum(axis=-1, keepdims=True)
        heads.append(w @ v)
    return np.mean(heads, axis=0) @ w_o[:d_v]
