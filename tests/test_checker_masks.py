"""The checker names a learner's causal and mask mistakes, and says what
each convention is."""
import re

import numpy as np

import mhattn
from mhattn.learn.checker import MISTAKES


def _softmax(s):
    """The learner's softmax: a row with no key gives NaN (exp(-inf - -inf))."""
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attend_top_left(q, k, v, mask=None, causal=False):
    """torch's scaled_dot_product_attention(is_causal=True), copied: j <= i."""
    tq, tk = q.shape[1], k.shape[1]
    s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    if causal:
        s = np.where(np.tril(np.ones((tq, tk), dtype=bool)), s, -np.inf)
    return _softmax(s) @ v


def test_alignment_text_says_who_aligns_where():
    """causal_top_left's explanation: mhattn and FlashAttention (2.1+) align
    bottom-right, PyTorch's scaled_dot_product_attention(is_causal=True)
    top-left; and mhattn really is bottom-right."""
    title, text = MISTAKES["causal_top_left"]
    flat = " ".join(text.split())
    assert "top-left" in title and "bottom-right" in title
    assert re.search(r"scaled_dot_product_attention\(is_causal=True\) aligns top-left "
                     r"\(j <= i\)", flat), flat
    assert re.search(r"FlashAttention's causal=True \(version 2\.1 and later\) is "
                     r"bottom-right", flat), flat
    assert re.search(r"mhattn aligns the triangle bottom-right: query i sees keys "
                     r"j <= i \+ T_k - T_q", flat), flat
    assert "is_causal with a cache" not in flat
    # mhattn's causal is what the text says: bottom-right
    rng = np.random.default_rng(0)
    tq, tk = 2, 5
    q, k, v = (rng.standard_normal((1, t, 3)) for t in (tq, tk, tk))
    bottom_right = np.tril(np.ones((tq, tk), bool), k=tk - tq)
    np.testing.assert_allclose(mhattn.attention(q, k, v, causal=True),
                               mhattn.attention(q, k, v, mask=bottom_right), rtol=1e-12)
    assert not np.allclose(mhattn.attention(q, k, v, causal=True),
                           mhattn.attention(q, k, v, mask=np.tril(np.ones((tq, tk), bool))))
    # and the report shows it
    rep = mhattn.check_attention_prototype(attend_top_left)
    assert "scaled_dot_product_attention(is_causal=True)" in str(rep)

