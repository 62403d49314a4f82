"""q/k RMSNorm over the whole projected row (every head at once), then the weight per head."""
import numpy as np

EXPECTED = ("qk_norm_whole_row",)


def _norm(a, w, eps=1e-6):
    # a (..., d): the root mean square over the last axis divided out
    return a / np.sqrt((a * a).mean(-1, keepdims=True) + eps) * w


def prototype(x, w_q, w_k, w_v, w_o, num_heads, q_norm=None, k_norm=None):
    T, h = len(x), num_heads
    Q, K, V = x @ w_q, x @ w_k, x @ w_v
    if q_norm is not None:      # the RMS of the whole row, every head at once
        Q = Q / np.sqrt((Q * Q).mean(-1, keepdims=True) + 1e-6)
        K = K / np.sqrt((K * K).mean(-1, keepdims=True) + 1e-6)
    q = Q.reshape(T, h, -1)                 # (T, h, d_k)
    k = K.reshape(T, h, -1)
    v = V.reshape(T, h, -1)
    if q_norm is not None:
        q, k = q * q_norm, k * k_norm
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v).reshape(T, -1) @ w_o
