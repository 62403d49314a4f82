"""Dict of intermediates; weights.T @ V."""
import numpy as np

EXPECTED = ('weights_transposed',)

def prototype(x, w_q, w_k, w_v, w_o, num_heads):
    T, h = x.shape[0], num_heads
    q = (x @ w_q).reshape(T, h, -1).transpose(1, 0, 2)
    k = (x @ w_k).reshape(T, h, -1).transpose(1, 0, 2)
    v = (x @ w_v).reshape(T, h, -1).transpose(1, 0, 2)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    e = np.exp(scores - scores.max(-1, keepdims=True))
    weights = e / e.sum(-1, keepdims=True)
    heads = weights.transpose(0, 2, 1) @ v
    concat = heads.transpose(1, 0, 2).reshape(T, -1)
    return {"q": q, "k": k, "v": v, "scores": scores, "weights": weights,
            "heads": heads, "concat": concat, "out": concat @ w_o}
