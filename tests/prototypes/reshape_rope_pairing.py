"""RoPE pairs (2c, 2c+1) whatever the RoPE says."""
import numpy as np

EXPECTED = ('rope_pairing_wrong',)


def _rotate(a, inv_freq, interleaved):
    T, d = a.shape[-2], a.shape[-1]
    half = d // 2
    c = np.arange(half)
    ia, ib = (2 * c, 2 * c + 1) if interleaved else (c, c + half)
    ang = np.arange(T)[:, None] * inv_freq[None, :half]
    out = a.copy()
    out[..., ia] = a[..., ia] * np.cos(ang) - a[..., ib] * np.sin(ang)
    out[..., ib] = a[..., ia] * np.sin(ang) + a[..., ib] * np.cos(ang)
    return out


def prototype(x, w_q, w_k, w_v, w_o, num_heads, rope=None):
    T, h = len(x), num_heads
    Q = (x @ w_q).reshape(T, h, -1).transpose(1, 0, 2)
    K = (x @ w_k).reshape(T, h, -1).transpose(1, 0, 2)
    V = (x @ w_v).reshape(T, h, -1).transpose(1, 0, 2)
    if rope is not None:
        d = Q.shape[-1]
        inv = 1.0 / rope.theta ** (np.arange(0, d, 2) / d)
        il = True
        Q, K = _rotate(Q, inv, il), _rotate(K, inv, il)

    S = Q @ K.transpose(0, 2, 1) / np.sqrt(Q.shape[-1])
    A = np.exp(S - S.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)
    return (A @ V).transpose(1, 0, 2).reshape(T, -1) @ w_o
