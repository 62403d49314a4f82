"""Returns a dict with Hugging Face-style names; forgot the scale."""
import numpy as np

EXPECTED = ('no_scaling',)

def prototype(x, w_q, w_k, w_v, w_o, num_heads):
    d_k = w_q.shape[1] // num_heads
    d_v = w_v.shape[1] // num_heads
    scores, weights, heads = [], [], []
    for i in range(num_heads):
        q = x @ w_q[:, i*d_k:(i+1)*d_k]
        k = x @ w_k[:, i*d_k:(i+1)*d_k]
        v = x @ w_v[:, i*d_v:(i+1)*d_v]
        s = q @ k.T
        e = np.exp(s - s.max(-1, keepdims=True))
        w = e / e.sum(-1, keepdims=True)
        scores.append(s); weights.append(w); heads.append(w @ v)
    context = np.concatenate(heads, axis=-1)
    return {"attention_scores": np.stack(scores), "attention_probs": np.stack(weights),
            "context": context, "attn_output": context @ w_o}
