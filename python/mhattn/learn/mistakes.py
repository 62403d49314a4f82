"""The checker's mistakes: one table of records, read by the step model and the checker.

Each :class:`Mistake` says what a learner got wrong (its identifier, a
one-line title, an explanation that teaches the fix, the fix as code) and
how the step model of :mod:`mhattn.learn.steps` produces it: one
:class:`Form` per way of writing it, naming the step it replaces, the step
function that does the wrong thing instead, and when it applies.

:mod:`mhattn.learn.steps` builds each step's wrong alternatives from this
table, and :mod:`mhattn.learn.checker` derives ``MISTAKES`` (identifier ->
(title, explanation with its fix)) from it.  Adding a mistake is one record
here (and, for a new way of computing, its step function in steps.py), plus
its test; the causal mask that also sees the next key is::

    Mistake(
        "causal_sees_next",
        "the causal mask is off by one: query i also sees key i + 1, ...",
        "Your causal mask allows j <= i + 1, ... Fix:",
        "allowed = np.tril(np.ones((T_q, T_k), bool), k=T_k - T_q)",
        produce=(Form("mask", "causal_next", "j <= i + 1 + T_k - T_q",
                      needs=("causal",)), ...)),

The step model then tries it, alone and paired with every mistake at
another step, on every prototype whose trials have the features it needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

#: The step models and the trial features a form may need: the features are
#: set by the options a prototype takes ("masked" = a mask or causal).
MODELS = ("layer", "attention")
FEATURES = ("masked", "causal", "softcap", "sinks", "rope", "q_norm")


@dataclass(frozen=True)
class Form:
    """One way of writing a mistake: the step of the model it replaces, the
    function of :mod:`mhattn.learn.steps` run there instead, how a learner
    writes it, the models it belongs to, and the features a trial must have
    for the step to be able to go wrong this way."""

    step: str
    fn: str
    written: str
    models: Tuple[str, ...] = MODELS
    needs: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Mistake:
    """A known mistake: identifier, title, explanation, fix (code, one line
    a statement), ``produce`` (the forms that re-enact it) and, rarely, a
    line of prose said after the fix."""

    id: str
    title: str
    explanation: str
    fix: str
    produce: Tuple[Form, ...]
    after: str = ""

    @property
    def text(self) -> str:
        """The explanation, the fix indented as code, and the line after."""
        code = "\n".join("    " + line for line in self.fix.split("\n"))
        return "\n".join(p for p in (self.explanation, code, self.after) if p)


#: The fix of every off-by-one causal mask: bottom-right, as mhattn aligns it.
_CAUSAL_FIX = ("allowed = np.tril(np.ones((T_q, T_k), bool), k=T_k - T_q)   # j <= i + T_k - T_q\n"
               "scores = np.where(allowed, scores, -np.inf)")


#: Every known mistake, grouped by the step that first produces it, in the
#: model's order: the order in which a step's alternatives are tried.
TABLE: Tuple[Mistake, ...] = (
    Mistake(
        "projections_transposed",
        "the projections are applied transposed",
        "Your prototype projects with the transposed weights (X W^T, the layout of\n"
        "PyTorch's nn.Linear.weight). The document uses row vectors: Q = X W^Q with\n"
        "W^Q of shape d_model x d_k (fused: d_model x h*d_k), and likewise for K, V.\n"
        "It only ran where the fused weights were square (d_model == h*d_k). Fix:",
        "Q = x @ w_q;  K = x @ w_k;  V = x @ w_v",
        produce=(
            Form("project", "project_transposed", "Q = X @ W^Q.T"),
        )),
    Mistake(
        "v_with_wk",
        "V is computed with W^K",
        "Your prototype computes the values with the key weights, V = X W^K. The\n"
        "document gives each role its own matrix: Q = X W^Q, K = X W^K, V = X W^V.\n"
        "Fix:",
        "v = x @ w_v[:, i*d_v:(i+1)*d_v]",
        produce=(
            Form("project", "project_v_with_wk", "V = X @ W^K"),
        )),
    Mistake(
        "same_projection_every_head",
        "every head uses head 0's projection",
        "Every head in your prototype uses the first block of columns of w_q, w_k\n"
        "and w_v, so all heads compute the same thing and h heads collapse into\n"
        "one. In the document, head_i = Attention(X W_i^Q, X W_i^K, X W_i^V) uses\n"
        "head i's own matrices (active recall 6). Slice by the head index:",
        "q = x @ w_q[:, i*d_k:(i+1)*d_k]   # and likewise k, v with i",
        produce=(
            Form("split heads", "split_same_head", "head 0's columns for every head"),
        )),
    Mistake(
        "heads_split_sequence",
        "the heads are split along the sequence instead of the features",
        "Your prototype gives each head a share of the tokens (rows). Heads split\n"
        "the representation dimension, not the sequence: every head computes a\n"
        "full T x T attention over all the tokens (the document's 'common\n"
        "misconception' section). Head i owns columns [i*d_k, (i+1)*d_k) of X W^Q.\n"
        "Fix (either form):",
        "q_i = Q[:, i*d_k:(i+1)*d_k]\n"
        "Qh = Q.reshape(T, h, d_k).transpose(1, 0, 2)   # (h, T, d_k)",
        produce=(
            Form("split heads", "split_sequence", "np.split(Q, h, axis=0)"),
            Form("split heads", "split_reshape_both",
                 "Q.reshape(h, T, d_k) ... out.reshape(T, h*d_v)"),
        ),
        after="not np.split(Q, h, axis=0) or Q.reshape(h, T, d_k)."),
    Mistake(
        "split_reshape_no_transpose",
        "the heads are split with reshape(h, T, d) instead of reshape(T, h, d) + transpose",
        "Your prototype splits the fused (T, h*d) projection with Q.reshape(h, T, d).\n"
        "That deals the rows out to the heads instead of the columns: head i owns\n"
        "columns [i*d, (i+1)*d) of X W^Q. Reshape to (T, h, d) first, then move the\n"
        "heads axis to the front:",
        "Qh = Q.reshape(T, h, d_k).transpose(1, 0, 2)   # (h, T, d_k)",
        produce=(
            Form("split heads", "split_reshape_h_first",
                 "Q.reshape(h, T, d_k) without the transpose"),
        )),
    Mistake(
        "dk_from_dmodel",
        "d_k is taken as d_model // h, but the weights say otherwise",
        "Your prototype computes a head's width as d_model // num_heads. That is the\n"
        "document's usual choice, not a rule: a head's width is whatever its weights\n"
        "have, d_k = w_q.shape[1] // num_heads (and d_v = w_v.shape[1] // num_heads).\n"
        "Fix:",
        "d_k = w_q.shape[1] // num_heads\n"
        "d_v = w_v.shape[1] // num_heads",
        produce=(
            Form("split heads", "split_dk_from_dmodel", "d_k = d_model // h"),
            Form("scale", "scale_dk_from_dmodel", "softmax(Q K^T / sqrt(d_model // h)) V",
                 models=("layer",)),
        )),
    Mistake(
        "v_sliced_with_dk",
        "V is sliced into heads with d_k instead of d_v",
        "Your prototype slices V with the query/key width d_k, as in the document's\n"
        "recap where W^V is d_model x d_k. That is right only when d_v == d_k; in\n"
        "general V's heads are d_v = w_v.shape[1] // num_heads wide. Fix:",
        "d_v = w_v.shape[1] // num_heads\n"
        "v = x @ w_v[:, i*d_v:(i+1)*d_v]",
        produce=(
            Form("split heads", "split_v_with_dk", "V[:, i*d_k:(i+1)*d_k]"),
        )),
    Mistake(
        "qk_norm_whole_row",
        "the q/k norm is taken over the whole projected row, not per head",
        "Your prototype normalises each row of Q = X W^Q (and K) over all its\n"
        "h*d_k features at once. The q/k norm (as in Qwen3 and Gemma 3) is an\n"
        "RMSNorm of each head's own d_k features, after the split into heads and\n"
        "before RoPE, with a (d_k,) weight shared by the heads. Fix, per head:",
        "q = q / np.sqrt((q * q).mean(-1, keepdims=True) + eps) * q_norm",
        produce=(
            Form("q/k norm", "qk_norm_whole_row",
                 "RMSNorm over the whole projected row, not per head"),
        )),
    Mistake(
        "qk_norm_no_weight",
        "the q/k norm leaves out its weight",
        "Your prototype RMS-normalises q and k but does not multiply by the\n"
        "learned weights q_norm and k_norm ((d_k,) each). RMSNorm is the\n"
        "normalisation times its weight. Fix:",
        "q = q / np.sqrt((q * q).mean(-1, keepdims=True) + eps) * q_norm\n"
        "k = k / np.sqrt((k * k).mean(-1, keepdims=True) + eps) * k_norm",
        produce=(
            Form("q/k norm", "qk_norm_no_weight", "RMSNorm without its weight"),
        )),
    Mistake(
        "qk_norm_layernorm",
        "the q/k norm subtracts the mean (LayerNorm instead of RMSNorm)",
        "Your prototype centres q and k before scaling them, as LayerNorm does.\n"
        "The q/k norm is an RMSNorm: no mean is subtracted, only the root mean\n"
        "square divided out. Fix:",
        "q = q / np.sqrt((q * q).mean(-1, keepdims=True) + eps) * q_norm",
        produce=(
            Form("q/k norm", "qk_norm_layernorm",
                 "LayerNorm (the mean subtracted) instead of RMSNorm"),
        )),
    Mistake(
        "rope_not_offset",
        "RoPE's query positions are not offset by the cache length",
        "Your prototype turns the queries as if they sat at positions 0, 1, ...\n"
        "With a cache (more keys than queries), the new queries are the last T_q\n"
        "of the T_k positions: query i sits at i + T_k - T_q, key j at j, so that\n"
        "the angle of q_i . k_j depends on the true distance. Fix:",
        "q = rope(q, positions=np.arange(T_q) + T_k - T_q)\n"
        "k = rope(k, positions=np.arange(T_k))",
        produce=(
            Form("RoPE", "rope_not_offset", "query positions from 0, not T_k - T_q",
                 models=("attention",)),
        )),
    Mistake(
        "rope_on_v",
        "RoPE is applied to V too",
        "Your prototype rotates the values as well. RoPE encodes positions in the\n"
        "dot product q . k only: rotate q and k (after the q/k norm, before the\n"
        "scores) and leave V as X W^V. Fix:",
        "q, k = rope(q, positions), rope(k, positions)    # not v",
        produce=(
            Form("RoPE", "rope_on_v", "RoPE applied to V too"),
        )),
    Mistake(
        "rope_pairing_wrong",
        "RoPE pairs the wrong features (interleaved vs rotate-half)",
        "Your RoPE turns other pairs of features than the model's. Rotate-half\n"
        "(GPT-NeoX, Llama; mhattn.RoPE's default) pairs feature c with\n"
        "c + d/2; interleaved (GPT-J, RoFormer; RoPE(interleaved=True)) pairs\n"
        "(2c, 2c+1). With half = d // 2 and c = np.arange(half):",
        "ia, ib = c, c + half          # rotate-half\n"
        "ia, ib = 2 * c, 2 * c + 1     # interleaved",
        produce=(
            Form("RoPE", "rope_pairing_swapped",
                 "interleaved pairs instead of rotate-half (or back)"),
        )),
    Mistake(
        "no_scaling",
        "the scores are not divided by sqrt(d_k)",
        "Your prototype computes softmax(Q K^T) V. The document's attention is\n"
        "Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V. A dot product over d_k\n"
        "terms has variance proportional to d_k, so without the division the\n"
        "softmax saturates towards one-hot as d_k grows. Divide inside each head:",
        "scores = q @ k.T / np.sqrt(d_k)   # d_k = w_q.shape[1] // num_heads",
        produce=(
            Form("scale", "scale_none", "softmax(Q K^T) V"),
        )),
    Mistake(
        "scale_by_dk",
        "the scores are divided by d_k instead of sqrt(d_k)",
        "Your prototype divides Q K^T by d_k. The document divides by its square\n"
        "root: softmax(Q K^T / sqrt(d_k)) V. Scaling by sqrt(d_k) brings the\n"
        "variance of a d_k-term dot product back to about 1; dividing by d_k\n"
        "over-flattens the weights. Fix:",
        "scores = q @ k.T / np.sqrt(d_k)",
        produce=(
            Form("scale", "scale_dk", "softmax(Q K^T / d_k) V"),
        )),
    Mistake(
        "scale_by_sqrt_dmodel",
        "the scores are divided by sqrt(d_model) instead of sqrt(d_k)",
        "Your prototype divides Q K^T by sqrt(d_model), the embedding width. The\n"
        "scale belongs to each head and uses that head's own width d_k = d_model / h\n"
        "(the document's active recall 5: scaling happens inside each head, with\n"
        "that head's d_k). Fix:",
        "d_k = w_q.shape[1] // num_heads\n"
        "scores = q @ k.T / np.sqrt(d_k)",
        produce=(
            Form("scale", "scale_sqrt_dmodel", "softmax(Q K^T / sqrt(d_model)) V",
                 models=("layer",)),
        )),
    Mistake(
        "scale_by_sqrt_dv",
        "the scores are divided by sqrt(d_v) instead of sqrt(d_k)",
        "Your prototype divides Q K^T by the square root of the value width d_v. The\n"
        "scale belongs to the dot product of a query and a key, which has d_k terms:\n"
        "softmax(Q K^T / sqrt(d_k)) V. Fix:",
        "scores = q @ k.T / np.sqrt(q.shape[-1])",
        produce=(
            Form("scale", "scale_sqrt_dv", "softmax(Q K^T / sqrt(d_v)) V"),
        )),
    Mistake(
        "scale_after_softmax",
        "the 1/sqrt(d_k) is applied after the softmax",
        "Your prototype scales after the softmax, softmax(Q K^T) / sqrt(d_k). The\n"
        "scale must shape the distribution, so it goes inside:\n"
        "softmax(Q K^T / sqrt(d_k)); after the softmax the weights no longer sum\n"
        "to 1. Fix:",
        "w = softmax(q @ k.T / np.sqrt(d_k))",
        produce=(
            Form("scale", "scale_after_softmax", "softmax(Q K^T) / sqrt(d_k) V"),
        )),
    Mistake(
        "softcap_after_mask",
        "the softcap is applied after the mask",
        "Your prototype soft-caps the scores after masking them, so a blocked key's\n"
        "-inf becomes -c and gets a weight. The cap shapes the real scores:\n"
        "cap first, then mask:",
        "s = c * np.tanh(s / c)\n"
        "s = np.where(mask, s, -np.inf)",
        produce=(
            Form("softcap", "softcap_after_mask", "the softcap applied after the mask",
                 models=("attention",), needs=("softcap", "masked")),
        )),
    Mistake(
        "mask_inverted",
        "the mask (or the causal triangle) is inverted",
        "Your prototype blocks the keys that may be seen and keeps the others: it\n"
        "reads True as 'blocked' (the convention of nn.MultiheadAttention's\n"
        "attn_mask and key_padding_mask). mhattn's boolean masks say True = may\n"
        "attend, as PyTorch's scaled_dot_product_attention does; causal lets query i\n"
        "see keys j <= i + T_k - T_q, the lower triangle (np.tril), not the upper\n"
        "one. A row whose keys were all allowed is then left with none, and gives\n"
        "NaN. Fix:",
        "scores = np.where(mask, scores, -np.inf)      # True = may attend\n"
        "allowed = np.tril(np.ones((T_q, T_k), bool), k=T_k - T_q)   # causal",
        produce=(
            Form("mask", "mask_inverted", "the mask (or causal triangle) inverted",
                 needs=("masked",)),
        )),
    Mistake(
        "mask_after_softmax",
        "the mask is applied after the softmax",
        "Your prototype zeroes the blocked weights after the softmax (or multiplies\n"
        "the weights by the mask, or by the causal triangle), so each row's weights\n"
        "no longer sum to 1: the blocked keys' share is lost instead of going to the\n"
        "keys that are left. Mask the scores with -inf before the softmax, and the\n"
        "softmax renormalises over the keys that are left:",
        "scores = np.where(mask, scores, -np.inf)\n"
        "w = softmax(scores)",
        produce=(
            Form("mask", "mask_after_softmax", "the mask applied after the softmax",
                 needs=("masked",)),
        )),
    Mistake(
        "mask_large_negative",
        "the mask puts a large negative number (such as -1e9) where -inf belongs",
        "Your prototype blocks keys with a finite number such as -1e9 instead of\n"
        "-inf. That works only while the row has some key left: exp(-1e9 - max)\n"
        "is 0. In a row whose keys are all blocked every score is about -1e9, and\n"
        "the softmax hands the whole weight to keys the row must not see: the\n"
        "padding leaks into the output. How much leaks depends on the dtype: in\n"
        "float32, s - 1e9 rounds to a multiple of 64, so the row attends almost\n"
        "uniformly; in float64 an added -1e9 cancels in the softmax, so the row\n"
        "attends as if it were not masked at all. mhattn's answer for a row with\n"
        "no key is 0 (never NaN). Block with -inf, and give a row with no key zero\n"
        "weights:",
        "scores = np.where(mask, scores, -np.inf)\n"
        "m = scores.max(axis=-1, keepdims=True)\n"
        "e = np.exp(scores - np.where(np.isfinite(m), m, 0))\n"
        "total = e.sum(axis=-1, keepdims=True)\n"
        "w = np.where(total > 0, e / np.where(total > 0, total, 1), 0)   # no key: 0",
        produce=(
            Form("mask", "mask_fill_finite", "np.where(mask, scores, -1e9)",
                 needs=("masked",)),
            Form("mask", "mask_add_finite", "scores + np.where(mask, 0, -1e9)",
                 needs=("masked",)),
        )),
    Mistake(
        "causal_top_left",
        "the causal mask is aligned top-left instead of bottom-right",
        "Your causal mask lets query i see keys j <= i, counting from the first key\n"
        "(top-left aligned). With more keys than queries (a KV cache, or a prefix)\n"
        "the queries are the last T_q positions, so mhattn aligns the triangle\n"
        "bottom-right: query i sees keys j <= i + T_k - T_q, and one new query sees\n"
        "every key. FlashAttention's causal=True (version 2.1 and later) is\n"
        "bottom-right too. PyTorch's scaled_dot_product_attention(is_causal=True)\n"
        "aligns top-left (j <= i), so code copied from it differs whenever\n"
        "T_q != T_k (in PyTorch, torch.nn.attention.bias.causal_lower_right gives\n"
        "the bottom-right mask). The two alignments agree when T_q == T_k. Fix:",
        "allowed = np.tril(np.ones((T_q, T_k), bool), k=T_k - T_q)",
        produce=(
            Form("mask", "causal_top_left", "causal aligned top-left (j <= i)",
                 models=("attention",), needs=("causal",)),
        )),
    Mistake(
        "causal_blocks_self",
        "the causal mask is off by one: query i cannot see its own key (j < i)",
        "Your causal mask allows j < i, so it blocks the diagonal: no token sees\n"
        "itself, and when T_q == T_k the first query (row 0) has no key at all. Its\n"
        "scores are all -inf, and the softmax's exp(-inf - (-inf)) = exp(nan) makes\n"
        "that row NaN: the NaN comes from the mask, not from an overflow (the row\n"
        "max is subtracted). Causal attention lets a query see every key up to and\n"
        "including its own position: j <= i when T_q == T_k, and j <= i + T_k - T_q\n"
        "with more keys than queries (mhattn aligns the triangle bottom-right).\n"
        "Fix:",
        _CAUSAL_FIX,
        produce=(
            Form("mask", "causal_strict", "j < i + T_k - T_q (the diagonal blocked)",
                 needs=("causal",)),
            Form("mask", "causal_strict_top_left", "j < i (the diagonal blocked, top-left)",
                 models=("attention",), needs=("causal",)),
        )),
    Mistake(
        "causal_sees_next",
        "the causal mask is off by one: query i also sees key i + 1 (j <= i + 1), "
        "a future token",
        "Your causal mask allows j <= i + 1, so every token also sees the next one:\n"
        "the future leaks into the past, and a language model trained this way\n"
        "learns to copy the next token instead of predicting it. Causal attention\n"
        "lets query i see keys j <= i when T_q == T_k, and j <= i + T_k - T_q with\n"
        "more keys than queries (mhattn aligns the triangle bottom-right). Fix:",
        _CAUSAL_FIX,
        produce=(
            Form("mask", "causal_next", "j <= i + 1 + T_k - T_q (one future key)",
                 needs=("causal",)),
            Form("mask", "causal_next_top_left", "j <= i + 1 (one future key, top-left)",
                 models=("attention",), needs=("causal",)),
        )),
    Mistake(
        "no_max_subtraction",
        "the softmax does not subtract the row maximum, so large scores overflow",
        "Your softmax computes exp(scores) directly. With large inputs a score\n"
        "above about 709 (float64) or 88 (float32) overflows exp to inf, and the\n"
        "weights become inf/inf = nan, although the true answer is finite. The\n"
        "document's code subtracts the maximum first, which leaves the softmax\n"
        "unchanged (a constant shift cancels in the ratio):",
        "w = np.exp(scores - scores.max(axis=-1, keepdims=True))\n"
        "w = w / w.sum(axis=-1, keepdims=True)",
        produce=(
            Form("row max", "row_max_skipped", "exp(scores) without subtracting the row max"),
        )),
    Mistake(
        "softmax_wrong_axis",
        "the softmax normalises over the queries instead of the keys",
        "Your softmax runs down the columns (axis 0) of the T_q x T_k score matrix.\n"
        "Each query's row must be a probability distribution over all the keys, as\n"
        "in the worked example, where Head 1's weights for 'it' over (ball, full, it)\n"
        "are [0.7337, 0.0879, 0.1784] and sum to 1. Take the max, exp and sum\n"
        "along the last axis:",
        "w = np.exp(scores - scores.max(axis=-1, keepdims=True))\n"
        "w = w / w.sum(axis=-1, keepdims=True)    # w.sum(axis=-1) == 1",
        produce=(
            Form("softmax", "softmax_axis0", "softmax over axis 0 (the queries)"),
        )),
    Mistake(
        "softmax_over_heads",
        "the softmax normalises over the heads axis",
        "Your softmax runs over the heads axis of the stacked (h, T, T) scores. Each\n"
        "head is its own attention: each query's row, in each head, must sum to 1\n"
        "over the keys. Normalise along the last axis:",
        "w = np.exp(s - s.max(axis=-1, keepdims=True))\n"
        "w = w / w.sum(axis=-1, keepdims=True)",
        produce=(
            Form("softmax", "softmax_heads_axis", "softmax over the heads axis"),
        )),
    Mistake(
        "softmax_whole_matrix",
        "the softmax normalises over the whole score matrix",
        "Your softmax divides by the sum of the whole T x T matrix, so all the\n"
        "weights together sum to 1. Each query's row must be its own distribution\n"
        "over the keys (in the worked example, 'it' gives [0.7337, 0.0879, 0.1784]).\n"
        "Sum along the last axis only:",
        "w = w / w.sum(axis=-1, keepdims=True)",
        produce=(
            Form("softmax", "softmax_whole_matrix", "normalised over the whole T x T matrix"),
        )),
    Mistake(
        "sink_in_numerator",
        "the sink is added to the numerator too",
        "Your softmax adds the sink's exp(sink) to every weight as well as to the\n"
        "denominator. A sink is one extra logit per row counted in the denominator\n"
        "only, so a row's weights sum to 1 - p_sink:",
        "m = np.maximum(s.max(-1, keepdims=True), sink)\n"
        "e = np.exp(s - m)\n"
        "w = e / (e.sum(-1, keepdims=True) + np.exp(sink - m))",
        produce=(
            Form("softmax", "softmax_sink_in_numerator", "the sink added to the numerator too",
                 models=("attention",), needs=("sinks",)),
        )),
    Mistake(
        "weights_transposed",
        "the weights are transposed before @ V",
        "Your prototype multiplies weights.T @ V. Row i of the weights belongs to\n"
        "query i, and head_i's row i is the weighted average of the values with that\n"
        "row's weights: head = weights @ V, (T_q, T_k) @ (T_k, d_v). Fix:",
        "head = w @ v",
        produce=(
            Form("weights @ V", "weights_t_v", "weights.T @ V"),
        )),
    Mistake(
        "heads_averaged",
        "the heads are averaged instead of concatenated",
        "Your prototype averages the heads' outputs. The document concatenates them\n"
        "and then applies one learned W^O:\n"
        "    MultiHead(X) = Concat(head_1, ..., head_h) W^O\n"
        "Averaging gives every head the fixed weight 1/h and blends the specialists\n"
        "before W^O can combine them (this is the classmate's mistake in active\n"
        "recall 6). Concatenate along the features, then project:",
        "z = np.concatenate(heads, axis=-1)      # (T, h*d_v)\n"
        "return z @ w_o",
        produce=(
            Form("merge heads", "merge_mean", "mean of the heads, no W^O"),
            Form("merge heads", "merge_mean_per_head_wo", "mean over heads of head_i W^O_i"),
            Form("merge heads", "merge_mean_first_rows",
                 "mean of the heads times the first d_v rows of W^O"),
        )),
    Mistake(
        "heads_summed",
        "the heads are summed instead of concatenated",
        "Your prototype adds the heads' outputs together. The document concatenates\n"
        "them side by side and lets one learned W^O mix them:\n"
        "    MultiHead(X) = Concat(head_1, ..., head_h) W^O\n"
        "A sum squeezes h subspaces into one d_v-wide vector, so the output can no\n"
        "longer say which head noticed what. Fix:",
        "z = np.concatenate(heads, axis=-1)      # (T, h*d_v)\n"
        "return z @ w_o",
        produce=(
            Form("merge heads", "merge_sum", "sum of the heads, no W^O"),
            Form("merge heads", "merge_sum_first_rows",
                 "sum of the heads times the first d_v rows of W^O"),
        )),
    Mistake(
        "merge_reshape_no_transpose",
        "the heads are merged with reshape(T, h*d) without the transpose back",
        "Your prototype merges the stacked heads (h, T, d_v) with .reshape(T, h*d_v).\n"
        "That interleaves rows of different tokens. Concat(head_1, ..., head_h) puts\n"
        "each token's heads side by side: move the heads axis back first:",
        "z = out.transpose(1, 0, 2).reshape(T, h * d_v)\n"
        "# or: z = np.concatenate(list(out), axis=-1)",
        produce=(
            Form("merge heads", "merge_h_first", "np.stack(heads).reshape(T, h*d_v)"),
        )),
    Mistake(
        "heads_wrong_order",
        "the heads are concatenated in the wrong order",
        "Your prototype concatenates the heads in another order than head_1, ...,\n"
        "head_h. W^O's rows [i*d_v, (i+1)*d_v) read head i, so the order matters.\n"
        "Fix:",
        "z = np.concatenate([head_0, head_1, ..., head_(h-1)], axis=-1)",
        produce=(
            Form("merge heads", "merge_reversed", "the heads concatenated in reverse order"),
        )),
    Mistake(
        "wo_skipped",
        "W^O is never applied",
        "Your prototype returns Concat(head_1, ..., head_h) itself. The worked\n"
        "example takes W^O = identity for simplicity, which hides this; in general\n"
        "MultiHead(X) = Concat(head_1, ..., head_h) W^O, and W^O is the producer\n"
        "that blends the heads' reports. Fix:",
        "return np.concatenate(heads, axis=-1) @ w_o",
        produce=(
            Form("W^O", "out_skipped", "Concat(heads) without W^O"),
        )),
    Mistake(
        "wo_transposed",
        "W^O is applied transposed",
        "Your prototype multiplies the concatenation by W^O transposed. mhattn and\n"
        "the document use row vectors (Q = X W^Q), so W^O has shape (h*d_v) x d_out\n"
        "and multiplies from the right as it is. This only ran because W^O was\n"
        "square; with a non-square W^O it fails on shapes. Fix:",
        "return concat @ w_o       # not concat @ w_o.T",
        produce=(
            Form("W^O", "out_transposed", "Concat(heads) @ W^O.T"),
        )),
    Mistake(
        "wo_cut_to_fit",
        "W^O is cut to the concatenation's width",
        "Your prototype multiplies by the first rows of W^O only, as many as the\n"
        "concatenation is wide. W^O is (h*d_v) x d_out, one block of d_v rows per\n"
        "head; when the concatenation is narrower than W^O, the heads are wrong\n"
        "(sliced with the wrong width, or combined without Concat), and cutting\n"
        "W^O only hides it. Fix the heads, then use all of W^O:",
        "return np.concatenate(heads, axis=-1) @ w_o",
        produce=(
            Form("W^O", "out_cut_to_fit", "Concat(heads) @ W^O[:width]"),
        )),
)


def _index(table: Tuple[Mistake, ...]) -> Dict[str, Mistake]:
    out: Dict[str, Mistake] = {}
    for m in table:
        if m.id in out:
            raise ValueError(f"mistake {m.id!r} is in the table twice")
        for f in m.produce:
            if not set(f.models) <= set(MODELS) or not set(f.needs) <= set(FEATURES):
                raise ValueError(f"mistake {m.id!r}: unknown model or feature in {f}")
        out[m.id] = m
    return out


#: identifier -> record
BY_ID: Dict[str, Mistake] = _index(TABLE)
