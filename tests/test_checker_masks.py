"""The checker names a learner's causal and mask mistakes.

Each prototype below is written as a learner would write it, in plain NumPy
(never with the checker's step functions), with one mistake in its mask:
the causal triangle off by one either way, aligned top-left, inverted, the
mask applied after the softmax, or -inf replaced by -1e9.  NAMED lists them
with the mistake the checker must name; tests/test_checker_corpus.py reads
it to know which mistakes are covered here rather than by the corpus.
"""
import re

import numpy as np
import pytest

import mhattn
from mhattn.learn.checker import MISTAKES


def _softmax(s):
    """The learner's softmax: a row with no key gives NaN (exp(-inf - -inf))."""
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _layer(rule=None, *, after_softmax=False, guard=False):
    """A loop over the heads, as in the document, with causal masking by
    ``rule(i, j) -> allowed`` (i the query's index, j the key's)."""
    def prototype(x, w_q, w_k, w_v, w_o, num_heads, causal=False):
        T = x.shape[0]
        d_k = w_q.shape[1] // num_heads
        d_v = w_v.shape[1] // num_heads
        i = np.arange(T)[:, None]
        j = np.arange(T)[None, :]
        heads = []
        for n in range(num_heads):
            q = x @ w_q[:, n * d_k:(n + 1) * d_k]
            k = x @ w_k[:, n * d_k:(n + 1) * d_k]
            v = x @ w_v[:, n * d_v:(n + 1) * d_v]
            scores = q @ k.T / np.sqrt(d_k)
            if causal and not after_softmax:
                scores = np.where(rule(i, j), scores, -np.inf)
            w = _softmax(scores)
            if guard:
                w = np.nan_to_num(w)              # "no NaN please"
            if causal and after_softmax:
                w = w * np.tril(np.ones((T, T)))
            heads.append(w @ v)
        return np.concatenate(heads, axis=-1) @ w_o
    return prototype


# ------------------------------------------------------------ check_prototype

proto_causal_correct = _layer(lambda i, j: j <= i)
proto_causal_blocks_self = _layer(lambda i, j: j < i)               # row 0 sees nothing
proto_causal_blocks_self_guarded = _layer(lambda i, j: j < i, guard=True)
proto_causal_sees_next = _layer(lambda i, j: j <= i + 1)
proto_causal_after_softmax = _layer(after_softmax=True)


def proto_causal_inverted(x, w_q, w_k, w_v, w_o, num_heads, causal=False):
    # nn.MultiheadAttention's habit: the future as True ... then used as "allowed"
    T = x.shape[0]
    Q = (x @ w_q).reshape(T, num_heads, -1).transpose(1, 0, 2)
    K = (x @ w_k).reshape(T, num_heads, -1).transpose(1, 0, 2)
    V = (x @ w_v).reshape(T, num_heads, -1).transpose(1, 0, 2)
    S = Q @ K.transpose(0, 2, 1) / np.sqrt(Q.shape[-1])
    if causal:
        future = np.triu(np.ones((T, T), dtype=bool), k=1)
        S = np.where(future, S, -np.inf)
    A = _softmax(S)
    return (A @ V).transpose(1, 0, 2).reshape(T, -1) @ w_o


def _layer_mask(fill):
    def prototype(x, w_q, w_k, w_v, w_o, num_heads, mask=None):
        T = x.shape[0]
        Q = (x @ w_q).reshape(T, num_heads, -1).transpose(1, 0, 2)
        K = (x @ w_k).reshape(T, num_heads, -1).transpose(1, 0, 2)
        V = (x @ w_v).reshape(T, num_heads, -1).transpose(1, 0, 2)
        S = Q @ K.transpose(0, 2, 1) / np.sqrt(Q.shape[-1])
        if mask is not None:
            S = fill(S, mask)
        return (_softmax(S) @ V).transpose(1, 0, 2).reshape(T, -1) @ w_o
    return prototype


proto_mask_correct = _layer_mask(lambda S, mask: np.where(mask, S, -np.inf))
proto_mask_minus_1e9 = _layer_mask(lambda S, mask: np.where(mask, S, -1e9))
proto_mask_add_minus_1e9 = _layer_mask(lambda S, mask: S + np.where(mask, 0.0, -1e9))


# ------------------------------------------------------------ check_attention_prototype

def _attend(rule=None, fill=-np.inf):
    """fn(q, k, v, mask=None, causal=False) with causal by ``rule(i, j, tq, tk)``."""
    def attend(q, k, v, mask=None, causal=False):
        tq, tk = q.shape[1], k.shape[1]
        s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
        if mask is not None:
            s = np.where(mask, s, fill)
        if causal:
            i, j = np.arange(tq)[:, None], np.arange(tk)[None, :]
            s = np.where(rule(i, j, tq, tk), s, -np.inf)
        return _softmax(s) @ v
    return attend


attend_correct = _attend(lambda i, j, tq, tk: j <= i + tk - tq)
attend_top_left = _attend(lambda i, j, tq, tk: j <= i)               # SDPA's is_causal
attend_blocks_self = _attend(lambda i, j, tq, tk: j < i + tk - tq)
attend_blocks_self_top_left = _attend(lambda i, j, tq, tk: j < i)
attend_sees_next = _attend(lambda i, j, tq, tk: j <= i + tk - tq + 1)
attend_sees_next_top_left = _attend(lambda i, j, tq, tk: j <= i + 1)
attend_minus_1e9 = _attend(lambda i, j, tq, tk: j <= i + tk - tq, fill=-1e9)


def attend_tril_after_softmax(q, k, v, causal=False):
    tq, tk = q.shape[1], k.shape[1]
    w = _softmax(q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1]))
    if causal:
        w = w * np.tril(np.ones((tq, tk)), k=tk - tq)
    return w @ v


def attend_triu_inverted(q, k, v, causal=False):
    tq, tk = q.shape[1], k.shape[1]
    s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    if causal:
        blocked = np.triu(np.ones((tq, tk), dtype=bool), k=tk - tq + 1)
        s = np.where(blocked, s, -np.inf)        # blocked used as allowed
    return _softmax(s) @ v


# the factories' functions are named after their variables, for the test ids
for _name, _fn in list(globals().items()):
    if _name.startswith(("proto_", "attend_")) and callable(_fn):
        _fn.__name__ = _name

LAYER, ATTENTION = "layer", "attention"
#: (mistake, checker, prototype, dtype): each must be named exactly
NAMED = [
    ("causal_blocks_self", LAYER, proto_causal_blocks_self, np.float64),
    ("causal_blocks_self", LAYER, proto_causal_blocks_self, np.float32),
    ("causal_blocks_self", LAYER, proto_causal_blocks_self_guarded, np.float64),
    ("causal_sees_next", LAYER, proto_causal_sees_next, np.float64),
    ("causal_sees_next", LAYER, proto_causal_sees_next, np.float32),
    ("mask_inverted", LAYER, proto_causal_inverted, np.float64),
    ("mask_after_softmax", LAYER, proto_causal_after_softmax, np.float64),
    ("mask_large_negative", LAYER, proto_mask_minus_1e9, np.float64),
    ("mask_large_negative", LAYER, proto_mask_minus_1e9, np.float32),
    ("mask_large_negative", LAYER, proto_mask_add_minus_1e9, np.float64),
    ("causal_top_left", ATTENTION, attend_top_left, np.float64),
    ("causal_blocks_self", ATTENTION, attend_blocks_self, np.float64),
    ("causal_blocks_self", ATTENTION, attend_blocks_self_top_left, np.float64),
    ("causal_sees_next", ATTENTION, attend_sees_next, np.float64),
    ("causal_sees_next", ATTENTION, attend_sees_next_top_left, np.float32),
    ("mask_after_softmax", ATTENTION, attend_tril_after_softmax, np.float64),
    ("mask_inverted", ATTENTION, attend_triu_inverted, np.float64),
    ("mask_large_negative", ATTENTION, attend_minus_1e9, np.float64),
    ("mask_large_negative", ATTENTION, attend_minus_1e9, np.float32),
]


def _check(which, fn, **kw):
    check = mhattn.check_prototype if which == LAYER else mhattn.check_attention_prototype
    return check(fn, **kw)


@pytest.mark.parametrize("mistake,which,fn,dtype", NAMED,
                         ids=[f"{f.__name__}-{np.dtype(d).name}" for m, w, f, d in NAMED])
def test_mask_mistake_is_named(mistake, which, fn, dtype):
    rep = _check(which, fn, dtype=dtype)
    assert not rep.ok
    assert rep.mistakes == (mistake,), str(rep)
    assert rep.exact, str(rep)
    text = str(rep)
    assert MISTAKES[mistake][0] in text and "not like any known mistake" not in text
    assert all(t.matching == [mistake] for t in rep.trials if not t.ok)


@pytest.mark.parametrize("which,fn", [(LAYER, proto_causal_correct),
                                      (LAYER, proto_mask_correct),
                                      (ATTENTION, attend_correct)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_correct_masks_pass(which, fn, dtype):
    for seed in range(3):
        rep = _check(which, fn, dtype=dtype, seed=seed)
        assert rep.ok, str(rep)


def test_row_zero_with_no_key_is_the_off_by_one_not_an_overflow():
    """j < i leaves row 0 without a key: NaN there comes from the mask, and
    the report says so, never blaming the max subtraction."""
    rep = mhattn.check_prototype(proto_causal_blocks_self)
    text = str(rep)
    causal = next(t for t in rep.trials if t.name == "causal")
    assert causal.status == "nonfinite"
    assert "off by one" in rep.title and "j < i" in rep.title
    assert "row 0" in rep.explanation and "NaN" in rep.explanation
    assert "no_max_subtraction" not in text
    assert "without subtracting the row max" not in text
    assert not any("overflow" in h for h in rep.hints), rep.hints
    assert "causal mask is off by one" in rep._repr_html_()


def test_one_future_token_is_named_as_the_off_by_one():
    rep = mhattn.check_prototype(proto_causal_sees_next)
    assert "off by one" in rep.title and "j <= i + 1" in rep.title
    assert "causal mask" in str(rep).splitlines()[0]
    assert "not like any known mistake" not in str(rep)


def test_a_row_with_no_key_is_not_blamed_on_the_row_max():
    """When no known mistake explains a NaN on a causal trial, the hint
    points at a row left with no key, not at exp() overflowing."""
    def two_off(x, w_q, w_k, w_v, w_o, num_heads, causal=False):
        return _layer(lambda i, j: j < i - 1)(x, w_q, w_k, w_v, w_o, num_heads, causal)

    rep = mhattn.check_prototype(two_off)
    assert not rep.ok and not rep.exact and rep.mistakes == ()
    assert any("keys are all blocked" in h and "causal" in h for h in rep.hints), rep.hints
    assert "without subtracting the row max" not in str(rep)


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


def test_every_causal_and_mask_mistake_teaches_its_fix():
    for m in ("causal_blocks_self", "causal_sees_next", "causal_top_left", "mask_inverted",
              "mask_after_softmax", "mask_large_negative"):
        title, text = MISTAKES[m]
        code = [line for line in text.splitlines() if line.startswith("    ")]
        assert code, m
        assert any("np.where" in c or "np.tril" in c for c in code), m
    assert "-inf" in MISTAKES["mask_large_negative"][1]
    assert "float32" in MISTAKES["mask_large_negative"][1]


# ------------------------------------------------------------ a row with no key

def test_a_row_with_no_key_nan_or_zero_both_pass():
    """The mask trial with a row that allows no key: mhattn gives 0 there, a
    learner's plain softmax NaN; both pass, and the NaN is noted."""
    rep = mhattn.check_prototype(proto_mask_correct)
    assert rep.ok, str(rep)
    empty = next(t for t in rep.trials if t.name == "mask_empty_row")
    assert empty.ok and empty.note and "NaN" in empty.note
    assert "mhattn defines such a row's output as 0" in rep.explanation

    def zero_row(x, w_q, w_k, w_v, w_o, num_heads, mask=None):
        return mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads=num_heads,
                                           mask=mask)
    rep = mhattn.check_prototype(zero_row)
    assert rep.ok and next(t for t in rep.trials if t.name == "mask_empty_row").note is None
    rep = mhattn.check_attention_prototype(_attend(lambda i, j, tq, tk: j <= i + tk - tq))
    assert rep.ok and any(t.name == "mask_empty_row" and t.note for t in rep.trials)
    # the trial really has a row with no key, and mhattn's answer there is 0
    from mhattn.learn.checker import _trials
    t = next(t for t in _trials(0, np.dtype(np.float64), 0, keywords=["mask"])
             if t.name == "mask_empty_row")
    empty_rows = ~t.kwargs["mask"].any(axis=-1)
    assert empty_rows.sum() == 1
    out = mhattn.multi_head_attention(*t.args[:5], num_heads=t.num_heads, **t.kwargs)
    assert np.all(out[empty_rows] == 0)

