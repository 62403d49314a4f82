"""The recap's W^V (d_model x d_k); W^O cut to fit."""
import numpy as np

EXPECTED = ('v_sliced_with_dk', 'wo_cut_to_fit')

def prototype(x, w_q, w_k, w_v, w_o, num_heads):
    d_k = w_q.shape[1] // num_heads
    heads = []
    for i in range(num_heads):
        q = x @ w_q[:, i*d_k:(i+1)*d_k]
        k = x @ w_k[:, i*d_k:(i+1)*d_k]
        v = x @ w_v[:, i*d_k:(i+1)*d_k]
        s = q @ k.T / np.sqrt(d_k)
        e = np.exp(s - s.max(-1, keepdims=True))
        heads.append(e / e.sum(-1, keepdims=True) @ v)
    z = np.concatenate(heads, axis=-1)
    return {"concat": z, "output": z @ w_o[:z.shape[1]]}
