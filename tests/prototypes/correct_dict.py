"""Correct: a dict of every intermediate."""
import numpy as np

EXPECTED = ()

def prototype(x, w_q, w_k, w_v, w_o, num_heads):
    h = num_heads
    T = x.shape[0]
    Q, K, V = x @ w_q, x @ w_k, x @ w_v
    q = Q.reshape(T, h, -1).swapaxes(0, 1)
    k = K.reshape(T, h, -1).swapaxes(0, 1)
    v = V.reshape(T, h, -1).swapaxes(0, 1)
    raw = q @ k.swapaxes(1, 2)
    scores = raw / np.sqrt(q.shape[-1])
    e = np.exp(scores - scores.max(-1, keepdims=True))
    weights = e / e.sum(-1, keepdims=True)
    heads = weights @ v
    concat = heads.swapaxes(0, 1).reshape(T, -1)
    return {"q": Q, "k": K, "v": V, "raw_scores": raw, "scores": scores,
            "weights": weights, "heads": heads, "concat": concat,
            "output": concat @ w_o}
