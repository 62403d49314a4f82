"""The schema: every argument of every entry point of mhattn, said once.

Plain data, and it imports nothing of mhattn (only the standard library), so
that tools/gen_schema.py loads it by path, before the extension is built.
The generator writes from it, and tests/test_schema.py holds to it:

- python/mhattn/_C.pyi, the stubs of every function of ``mhattn._C``;
- csrc/python/docstrings_gen.h, those functions' docstrings, each opening
  with its ``__text_signature__`` (``name(a, b, /)\\n--\\n\\n``);
- the "Parameters" sections of the public numpydoc docstrings (the region
  from the ``Parameters`` header to the next section header; the text of
  each entry is the ``type`` and ``text`` of its first argument's record).
- csrc/python/args_gen.h and args_gen.c, the glue's tables: each core-calling
  _C function's argument and output positions, arg_spec table (from the
  records' ``c_kind``, ``shape``, ``alias`` and the function's ``notes``),
  output shapes (:data:`C_OUTPUTS`), shape-check orders, role positions
  (:data:`C_ROLES`), and where each array goes in mha_params (``c_field``);
- csrc/mha_params_gen.h, the core's mha_params struct (:data:`PARAMS`).

Why a Python module and not YAML (PyTorch's native_functions.yaml) or
comments in the C source (Argument Clinic): the package already depends on
nothing but NumPy, the records need no parser, a typo is a NameError at
import, and the tests read the same objects the generator does.

To add an argument: add its :class:`Arg` record below (with every entry
point that takes it in ``takes``), put its name into those entry points'
``params`` in :data:`ENTRIES` (and, for a public one with a Parameters
section, into its ``doc_groups``), then run ``python tools/gen_schema.py``.
A new buffer of the core is a :class:`Field` of :data:`PARAMS`; a new
option's config field, its rule (core/config.c) and its use in the core
are written by hand (csrc/README.md, "One schema for every argument").

Shapes use the letters of csrc/mha.h: B batch, Tq queries, Tk keys, H query
heads, G key/value heads, dk / dv a head's widths, Din / Dkin / Dvin the
widths of x / key / value, Dout the output's, Sq / Sk / Sv / Svq the fused
widths of q / k / v and of the heads' concatenation; Tnew the rows a cache
step adds.
"""
from typing import Dict, NamedTuple, Optional, Tuple

# Arg.default for an argument that has none.
REQUIRED = None


class Arg(NamedTuple):
    """One argument of one or more entry points, with one meaning.

    Two records may share a name (``sinks`` is an array for
    multi_head_attention and a flag for the layer) if no entry point takes
    both. For the ``_C.*`` records, which the glue's tables come from:
    ``c_kind`` is the glue's arg_kind, ``shape`` its letters, ``alias`` the
    argument None stands for, ``c_field`` the mha_params / mha_config
    field(s) it fills (the first, for an array, is where the glue puts it).
    """
    name: str
    takes: Tuple[str, ...]        # the entry points, as in ENTRIES
    kind: str                     # array, array?, int, float, bool, str,
                                  # dtype, object, tuple?, options
    dtype: str                    # "T" (the compute dtype: float32 or
                                  # float64), int64, float64, bool|T, ""
    shape: str                    # in mha.h's letters; "" for a scalar
    default: Optional[str]        # Python source of the default, or REQUIRED
    doc: str                      # one line
    type: str = ""                # numpydoc: what follows "name : "
    text: str = ""                # numpydoc: the indented description
    c_kind: str = ""              # glue: ARG_ARRAY, ARG_ARRAY_OPT, ...
    alias: str = ""               # ARG_ARRAY_ALIAS: the argument it stands for
    c_field: str = ""             # core: the mha_params / mha_config
                                  # fields it fills (PARAMS, CONFIG)


class Entry(NamedTuple):
    """An entry point: where it lives and its parameters in order.

    ``params`` is a signature without defaults: "/" ends the positional-only
    ones, "*" starts the keyword-only ones, "**name" collects keywords.
    ``doc_groups`` is the numpydoc Parameters section, one header per item:
    its names (as printed, on one line: numpydoc reads each line of a
    header as a new entry), or (names, text) for an item that refers to
    another entry point's parameters instead of describing them. Empty: the
    generator leaves the docstring's Parameters section, if any, as written
    (``MultiHeadAttention.__call__``'s ``**options`` is not a name the
    generator knows).
    """
    file: str                     # relative to the repository
    qualname: str
    params: str
    doc_groups: Tuple = ()


class CFunction(NamedTuple):
    """A function of mhattn._C: how the glue takes its arguments, what it
    returns (for _C.pyi) and its docstring's prose."""
    flags: str                    # METH_FASTCALL | METH_KEYWORDS, METH_O, ...
    returns: str                  # the stub's return annotation
    summary: str                  # the docstring after the signature
    returns_doc: str = ""         # "Returns ..." paragraph
    prefix: str = ""              # the glue's enum of positions: FWD_X, ...
    table_shapes: Tuple[str, ...] = ()  # the arg kinds whose shapes the glue's
                                  # arg_spec table checks (ARG_ARRAY, ...); the
                                  # function checks the others' itself
    notes: Tuple[Tuple[str, str], ...] = ()  # (argument, arg_spec.note): said
                                  # after the letters of a wrong shape
    checks_x: Tuple[str, ...] = ()  # call_spec.checks_x: the arrays checked
                                  # against x's, key's, value's (q's) sizes,
                                  # in the order their errors take precedence
    checks_widths: Tuple[str, ...] = ()  # call_spec.checks_widths: then those
                                  # checked once the head widths are known


_MHA = ("multi_head_attention", "multi_head_attention_grad")
_ARRAYS = ("ARG_ARRAY", "ARG_ARRAY_OPT", "ARG_ARRAY_ALIAS")   # CFunction.table_shapes
_ATT = ("attention", "attention_grad")
_PACK = ("pack_weights",)
_LAYER = ("MultiHeadAttention",)

# ---- the public entry points ---------------------------------------------

PUBLIC_ARGS = (
    Arg("grad_out", ("multi_head_attention_grad", "backward"), "array", "T",
        "(B, Tq, Dout) or (Tq, Dout)", REQUIRED,
        "dL/dout: the gradient of a scalar loss with respect to the output.",
        type="(T_q, d_out) or (B, T_q, d_out)",
        text="dL/dout: the gradient of a scalar loss L with respect to the output,\n"
             "of the shape of the forward's ``out``."),
    Arg("ctx", ("backward",), "object", "", "", REQUIRED,
        "The Context of multi_head_attention(..., return_context=True).",
        type="mhattn.Context",
        text="The context of ``multi_head_attention(..., return_context=True)``."),
    Arg("x", _MHA + ("MultiHeadAttention.__call__",), "array", "T",
        "(B, Tq, Din) or (Tq, Din)", REQUIRED, "The queries' source.",
        type="(T_q, d_in) or (B, T_q, d_in)", text="The queries' source."),
    Arg("w_q", _MHA, "weights", "T", "(Din, Sq), (H, Din, dk) or H x (Din, dk)",
        REQUIRED, "W^Q: fused, stacked or per head; or a PackedWeights.",
        type="weights, each in one of three forms",
        text="""\
fused 2-D (d_in, h*d_k), head i owning columns [i*d_k, (i+1)*d_k)
(``num_heads`` required); stacked 3-D (h, d_in, d_k); or a list of h
2-D arrays, whose widths may differ between heads and which may
repeat one array (the document's shared W_V).  Or, in place of
w_q and without w_k, w_v and w_o, a :class:`mhattn.PackedWeights`
from :func:`mhattn.pack_weights`: the same result, bit for bit,
without packing the weights on every call."""),
    Arg("w_k", _MHA, "weights", "T", "(Dkin, Sk), (G, Dkin, dk) or G x (Dkin, dk)",
        "None", "W^K, in the form of w_q; None with a PackedWeights."),
    Arg("w_v", _MHA, "weights", "T", "(Dvin, Sv), (G, Dvin, dv) or G x (Dvin, dv)",
        "None", "W^V, in the form of w_q; None with a PackedWeights."),
    Arg("w_o", _MHA, "array?", "T", "(Svq, Dout)", "None",
        "W^O; None is the identity (the result is the concatenation).",
        type="(sum d_v, d_out) or None",
        text="The output projection; None is the identity (returns the concat)."),
    Arg("num_heads", _MHA, "int", "", "", "None", "H, the number of query heads.",
        type="int", text="Number of query heads; required for fused weights."),
    Arg("key", _MHA + ("MultiHeadAttention.__call__",), "array?", "T",
        "(B, Tk, Dkin) or (Tk, Dkin)", "None",
        "The keys' source for cross-attention; default x.",
        type="arrays, optional",
        text="""\
Sources of keys and values for cross-attention: (T_k, d) or
(B, T_k, d).  ``key`` defaults to ``x``, ``value`` to ``key``."""),
    Arg("value", _MHA + ("MultiHeadAttention.__call__",), "array?", "T",
        "(B, Tk, Dvin) or (Tk, Dvin)", "None", "The values' source; default key."),
    Arg("scale", _MHA, "float", "", "", "None",
        "Multiplier of Q K^T; default 1/sqrt(dk) of each head.",
        type="float, optional",
        text="Multiplier of Q K^T; defaults to 1/sqrt(d_k) of each head. It must be\n"
             "finite and within the call's dtype's largest value."),
    Arg("return_weights", ("multi_head_attention",), "bool", "", "", "False",
        "Also return the post-softmax weights.", type="bool",
        text="Also return the post-softmax weights, (h, T_q, T_k) or (B, h, T_q, T_k)."),
    Arg("mask", _MHA, "array?", "bool|T", "broadcasts to (B, H, Tq, Tk)", "None",
        "True = may attend (bool), or added to the scores (float).",
        type="bool or float array, optional",
        text="""\
Broadcastable to (B, h, T_q, T_k) (or (h, T_q, T_k) unbatched).
Boolean: True means *may attend*.  Float: added to the scaled scores;
-inf blocks."""),
    Arg("causal", _MHA, "bool", "", "", "False",
        "Query i sees keys j <= i + (Tk - Tq), aligned bottom-right.", type="bool",
        text="""\
Query i sees keys j <= i + (T_k - T_q): the triangle is aligned
bottom-right, as in FlashAttention.  PyTorch SDPA's ``is_causal``
aligns it top-left (j <= i); the two agree when T_q == T_k."""),
    Arg("key_lengths", _MHA, "array?", "int64", "(B,) or an int", "None",
        "Keys at positions >= length are padding.", type="int array (B,) or int",
        text="Keys at positions >= length are padding and ignored."),
    Arg("num_kv_heads", _MHA, "int", "", "", "None",
        "G, the key/value heads of grouped-query attention; default H.",
        type="int, optional",
        text="""\
Grouped-query attention: w_k and w_v hold this many heads, and query
head i uses kv head i // (num_heads // num_kv_heads)."""),
    Arg("b_q", _MHA, "array?", "T", "(Sq,), (H, dk) or H x (dk,)", "None",
        "The query bias, in the form of w_q.",
        type="arrays, optional",
        text="Biases in the form of their weights, added to the projections Q, K\n"
             "and V: 1-D (fused), 2-D (stacked) or a list of 1-D arrays (per head)."),
    Arg("b_k", _MHA, "array?", "T", "(Sk,), (G, dk) or G x (dk,)", "None",
        "The key bias, in the form of w_k."),
    Arg("b_v", _MHA, "array?", "T", "(Sv,), (G, dv) or G x (dv,)", "None",
        "The value bias, in the form of w_v."),
    Arg("b_o", _MHA, "array?", "T", "(Dout,)", "None", "The output bias.",
        type="(d_out,), optional", text="The output bias."),
    Arg("w_gate", _MHA, "array?", "T", "(Din, Svq)", "None",
        "The output gate: sigmoid(x W_gate + b_gate) times the concatenation.",
        type="(d_in, sum d_v), optional",
        text="""\
The output gate (Keras's ``MultiHeadAttention(use_gate=True)``,
Qwen3-Next's gated attention): the concatenation of the heads becomes
``sigmoid(x @ w_gate + b_gate) * concat`` (elementwise) before W^O.
x is the queries' source, so each query row has its own gate, also
in cross-attention.  ``b_gate`` (sum d_v,) needs ``w_gate``."""),
    Arg("b_gate", _MHA, "array?", "T", "(Svq,)", "None", "The output gate's bias."),
    Arg("return_context", ("multi_head_attention",), "bool", "", "", "False",
        "Also return a Context for mhattn.backward.", type="bool",
        text="""\
Also return a :class:`mhattn.Context` for :func:`mhattn.backward`
(O(T d) state: the projections, the concatenation and each row's
log-sum-exp), so gradients need no second forward pass."""),
    Arg("window", _MHA + _ATT, "tuple?", "", "(2,)", "None",
        "Sliding window (left, right): p_i - left <= j <= p_i + right.",
        type="(left, right), optional",
        text="""\
Sliding window: key j is visible from query i iff
p_i - left <= j <= p_i + right, with p_i = i + (T_k - T_q); either
side may be None (unbounded).  Mistral's ``sliding_window=W`` is
``window=(W-1, 0)`` with ``causal=True``.  Key blocks wholly outside
the window are skipped."""),
    Arg("softcap", _MHA + _ATT, "float", "", "", "None",
        "Gemma 2's logit softcapping: s -> softcap * tanh(s / softcap).",
        type="float >= 0, optional",
        text="""\
Gemma 2's logit softcapping: each scaled score s becomes
softcap * tanh(s / softcap), before ALiBi and the masks. None or 0
(FlashAttention's convention) for none; otherwise softcap and 1 / softcap
must be finite in the call's dtype."""),
    Arg("alibi_slopes", _MHA + _ATT, "array?", "float64", "(H,) or (B, H)", "None",
        "ALiBi: adds -slope_h * abs(p_i - j) to the scores.",
        type="(h,) or (B, h), optional; (n, h) with cu_seqlens",
        text="ALiBi: adds -slope_h * abs(p_i - j) to the scores (no gradient). Finite,\n"
             "and slope * (max(T_q, T_k) - 1) within the call's dtype. With packed\n"
             "sequences, (n, h) gives each of the n sequences its own row of\n"
             "slopes (FlashAttention's varlen alibi_slopes)."),
    Arg("sinks", _MHA + _ATT, "array?", "T", "(H,)", "None",
        "One learnable logit per query head, an extra key of value zero.",
        type="(h,), optional",
        text="""\
One learnable logit per query head, counted in the softmax's
denominator as an extra key of value zero (gpt-oss); the returned
weights exclude it, so a row sums to less than 1."""),
    Arg("q_norm", _MHA, "array?", "T", "(dk,) or (H, dk)", "None",
        "Norm weights of each head's q, before RoPE.",
        type="(d_k,), (h, d_k) / (num_kv_heads, d_k), optional",
        text="""\
Norm weights of each head's q and k over its d_k features, after
the projection and bias, before RoPE: RMSNorm (Qwen3, Gemma 3), or
LayerNorm with ``norm_type="layer"``."""),
    Arg("k_norm", _MHA, "array?", "T", "(dk,) or (G, dk)", "None",
        "Norm weights of each kv head's k, before RoPE."),
    Arg("norm_eps", _MHA, "float", "", "", "1e-06", "The q/k norm's epsilon.",
        type="float, default 1e-6",
        text="The q/k norm's epsilon, added to the mean square (or the variance)."),
    Arg("norm_type", _MHA, "str", "", "", "'rms'",
        "The q/k norm: 'rms' (RMSNorm) or 'layer' (LayerNorm, mean-centred).",
        type='"rms" (default) or "layer"',
        text="""\
The q/k norm's kind, for ``q_norm`` and ``k_norm`` over each head's
d_k features x: "rms", RMSNorm (Qwen3, Gemma 3),
x / sqrt(mean(x**2) + norm_eps) * weight; or "layer", LayerNorm,
(x - mean(x)) / sqrt(var(x) + norm_eps) * weight, var the biased
(population) variance, as Flax NNX's
``MultiHeadAttention(normalize_qk=True)`` (ViT-22B).  No bias: Flax
builds those LayerNorms with ``use_bias=False`` (a bare
``nnx.LayerNorm`` would have one), so there is none to match.
Only read where ``q_norm`` or ``k_norm`` is given, but always checked:
any other value raises ValueError naming norm_type and the accepted
values."""),
    Arg("rope", _MHA, "object", "", "", "None",
        "Rotary embedding of q and k after the norm (a mhattn.RoPE).",
        type="mhattn.RoPE, optional",
        text="Rotary embedding of q and k after the norm (see :class:`mhattn.RoPE`)."),
    Arg("positions", _MHA, "array?", "int64", "(Tq,) or (B, Tq)", "None",
        "The queries' positions for RoPE; default p_i.",
        type="int (T_q,) / (B, T_q), (T_k,) / (B, T_k), optional",
        text="""\
The positions RoPE uses (default p_i and j), e.g. HF's
``position_ids`` for a left-padded batch."""),
    Arg("key_positions", _MHA, "array?", "int64", "(Tk,) or (B, Tk)", "None",
        "The keys' positions for RoPE; default j."),
    Arg("key_mask", _MHA + _ATT, "array?", "bool", "(Tk,) or (B, Tk)", "None",
        "True = a real key; any padding pattern.",
        type="bool (T_k,) or (B, T_k), optional",
        text="""\
True = a real key; any padding pattern.  ANDed with every other rule;
key blocks with no real key are skipped."""),
    Arg("cu_seqlens", _MHA + _ATT, "array?", "int64", "(n+1,)", "None",
        "Packed sequences: the offsets of the n sequences of x.",
        type="int (n+1,), optional",
        text="""\
Packed sequences: x is (total, d_in) and holds n sequences at the
offsets [0, ..., total]; each attends only within itself (causal and
window too).  ``key_cu_seqlens`` gives the keys' offsets for packed
cross-attention."""),
    Arg("key_cu_seqlens", _MHA + _ATT, "array?", "int64", "(n+1,)", "None",
        "Packed sequences: the keys' offsets, for cross-attention."),
    Arg("dropout", _MHA + _ATT, "float", "", "", "0.0",
        "Dropout on the attention weights: each is zeroed with probability dropout.",
        type="float in [0, 1), default 0.0",
        text="""\
Dropout on the attention weights, as PyTorch's ``dropout_p`` and
FlashAttention's: after the softmax each weight is zeroed with
probability ``dropout`` and the others are scaled by 1 / (1 - dropout).
The keep mask is a counter-based hash of (seed, batch, head, query,
key), so one seed gives the same mask, and the same bits, for any
thread count, tiling or ISA; the backward regenerates it.  The
log-sum-exp is the softmax's, before dropout.  Weights returned with
``return_weights=True`` are those after dropout.  0 (the default) is
off; a value outside [0, 1) raises ValueError."""),
    Arg("seed", _MHA + _ATT, "object", "", "", "None",
        "Dropout's seed: an int in [0, 2**64), a numpy.random.Generator, or None.",
        type="int, numpy.random.Generator or None, default None",
        text="""\
The seed of ``dropout``'s mask: an int in [0, 2**64), or a
``numpy.random.Generator`` from which one 64-bit seed is drawn; None
draws one from fresh OS entropy (a new mask on each call).  A
context (``return_context=True``) keeps the seed for its backward.
Anything else raises ValueError naming seed."""),
    Arg("relative_bias", _MHA + _ATT, "object", "", "", "None",
        "T5's relative position bias: a mhattn.RelativeBias, or None.",
        type="mhattn.RelativeBias, optional",
        text="""\
T5's relative position bias (:class:`mhattn.RelativeBias`): score (i, j)
of head h gains ``table[bucket(j - p_i), h]``, after the softcap and
ALiBi, before the additive mask, with transformers' ``T5Attention``
buckets.  One bias per distance and head is looked up per call; no
(T_q, T_k) array is made.  Its table's gradient is ``'relative_bias'``
in the ``_grad`` functions' results.  A table whose shape is not
(num_buckets, h) raises ValueError naming relative_bias."""),
    Arg("chunk", _MHA + _ATT, "int?", "", "", "None",
        "Chunked attention: query i sees key j only when p_i // chunk == j // chunk.",
        type="int, optional",
        text="""\
Chunked attention (Llama 4's chunked layers, FlashAttention 3's
``attention_chunk``): query i sees key j only when ``p_i // chunk ==
j // chunk``, at the positions causal masking uses (so it lines up
with a KV cache), ANDed with ``causal`` and every other rule.  Key
blocks outside a row's chunk are skipped, forward and backward.  None
(the default) is off; a value that is not a positive int raises
TypeError or ValueError naming chunk."""),
    Arg("q_offset", _ATT, "int?", "", "", "None",
        "Query 0's position relative to key 0 (None: bottom-right, T_k - T_q).",
        type="int, optional",
        text="""\
Where the queries sit: query i at position ``i + q_offset``, key j at
j, for causal masking, the window, ``chunk`` and ALiBi's distances.
None (the default) is the bottom-right placement ``q_offset = T_k -
T_q``.  A block of a longer call, queries from q0 against keys from
k0, passes ``q_offset = q0 + (T_k - T_q) - k0`` (of the whole call)
to see exactly the whole call's causal, window and ALiBi rules
(:mod:`mhattn.dask` does; ``chunk``'s boundaries too when k0 is a
multiple of chunk, since key j of the block sits at j).  Any
sign; a row that sees no key has lse -inf and out 0.  A value that is
not an int raises TypeError naming q_offset; not with packed
sequences (cu_seqlens) or relative_bias (ValueError)."""),
    Arg("block_mask", _MHA + _ATT, "object", "", "", "None",
        "A mhattn.BlockMask: which keys each query sees, block by block.",
        type="mhattn.BlockMask, optional",
        text="""\
A :class:`mhattn.BlockMask` of shape (B or 1, h or 1, T_q, T_k): query
i of head h in batch item b sees key j only where it is True, ANDed
with ``mask``, ``causal``, the window, ``chunk``, the key lengths,
``key_mask`` and packed sequences.  Blocks it marks empty are skipped,
forward and backward, and full ones cost no per-element test, so a
document or prefix-LM mask costs what it keeps.  A BlockMask of another
shape raises ValueError naming block_mask; not with ``cache=``."""),
    Arg("mask_grad", ("multi_head_attention_grad", "backward", "attention_grad"), "bool", "",
        "", "False", "Also return 'mask': the gradient of an additive mask.",
        type="bool, default False",
        text="""\
Also return ``'mask'``, the gradient of the additive (float) ``mask``
(a learned bias: a relative-position table's scores, a FlexAttention
``score_mod`` over a captured tensor), summed over the axes along
which the mask was broadcast: a (T_q, T_k) mask gets a (T_q, T_k)
gradient, a (B, 1, 1, T_k) one a (B, 1, 1, T_k) gradient.  The core
writes dL/dmask at every (b, h, i, j) (a B*h*T_q*T_k array, made only
when asked for) and NumPy sums it, the same for any thread count.
Keys a row does not see get 0.  A bool mask, or none, raises
ValueError naming mask_grad."""),
    Arg("cache", ("multi_head_attention",), "object", "", "", "None",
        "A KVCache or PagedKVCache: one decoder step, x holding only the new rows.",
        type="mhattn.KVCache or mhattn.PagedKVCache, optional",
        text="""\
One step of a decoder through a key/value cache (prefill: many rows;
decode: one): x holds only the new rows, (B, T_new, d_in) (or
(T_new, d_in) with a cache of batch 1).  Only they are projected
(q_norm, k_norm and RoPE at positions ``cache.lengths[b] + i``),
their keys and values are appended to the cache, and the new
queries attend over each sequence's cached keys, aligned
bottom-right to its own length (pass ``causal=True`` for a
decoder).  Not with key, value, mask, key_lengths, key_mask,
positions, key_positions or packed sequences; the weights, if
returned, are (B, h, T_new, capacity).  No gradients flow through
a cache (``return_context=True`` raises).  On an error the cache
is unchanged.  A :class:`mhattn.PagedKVCache` takes
``sequence_ids``: row i of x (n, T_new, d_in) is sequence
sequence_ids[i], and the weights are (n, h, T_new, max length)."""),
    Arg("cache", ("attention",), "object", "", "", "None",
        "A PagedKVCache: attend over its sequences' cached keys.",
        type="mhattn.PagedKVCache, optional",
        text="""\
Attention of q (n, H, T_new, d_k) over the cached keys of the
sequences ``sequence_ids`` (row i of q is sequence_ids[i]), each
query aligned bottom-right to its sequence's length (``causal=True``
for a prefill's rows).  With k and v (n, G, T_new, d_k | d_v) given,
they are appended first, under the cache's lock, as
``cache.append(sequence_ids, k, v)``; without them nothing is
written.  Not with mask, key_lengths, key_mask or packed sequences;
the weights, if returned, are (n, H, T_new, max length).  The core
reads the pages in place, through a block table."""),
    Arg("new_lengths", ("multi_head_attention",), "array?", "int64", "(B,)", "None",
        "With cache, the rows of x each sequence takes (a ragged step).",
        type="int (B,), optional",
        text="""\
With ``cache``, a ragged step (prompts of different lengths):
sequence b takes only the first new_lengths[b] rows of x; needs
``causal=True``; the other rows' outputs are 0."""),
    Arg("sequence_ids", ("multi_head_attention", "attention"), "object", "", "(n,)", "None",
        "With a PagedKVCache, the sequences of the call's rows.",
        type="list of n ints, with a PagedKVCache as ``cache``",
        text="""\
The sequences (ids from ``cache.add_sequence()``, each at most
once) whose new rows the call holds: row i of the batch is sequence
sequence_ids[i], at its own length (RoPE, causal alignment).  Any
subset of the cache's sequences, of any lengths, decodes or
prefills in one call; the core reads their pages in place through a
block table."""),
    # attention and attention_grad
    Arg("q", _ATT, "array", "T", "(B, H, Tq, dk) or (B, Tq, H, dk)", REQUIRED,
        "The queries, projected.",
        type='(B, H, T_q, d_k), or (B, T_q, H, d_k) with ``layout="bthd"``'),
    Arg("k", ("attention_grad",), "array", "T", "(B, G, Tk, dk) or (B, Tk, G, dk)", REQUIRED,
        "The keys, projected.", type="(B, G, T_k, d_k), or (B, T_k, G, d_k)"),
    Arg("k", ("attention",), "array?", "T", "(B, G, Tk, dk) or (B, Tk, G, dk)", "None",
        "The keys, projected (with cache=: new rows to append, or None).",
        type="(B, G, T_k, d_k), or (B, T_k, G, d_k)"),
    Arg("v", ("attention_grad",), "array", "T", "(B, G, Tk, dv) or (B, Tk, G, dv)", REQUIRED,
        "The values, projected.", type="(B, G, T_k, d_v), or (B, T_k, G, d_v)",
        text="""\
G < H is grouped-query attention (G must divide H).  Each may drop
the batch axis (unbatched 3-D inputs, all three alike).  Any strides
are read in place when the last axis is contiguous; float32 stays
float32, anything else follows NumPy promotion with a float32 floor;
float16 or bfloat16 (all three alike) are computed in float32 and
the results rounded once into that dtype."""),
    Arg("v", ("attention",), "array?", "T", "(B, G, Tk, dv) or (B, Tk, G, dv)", "None",
        "The values, projected (with cache=: new rows to append, or None).",
        type="(B, G, T_k, d_v), or (B, T_k, G, d_v)",
        text="""\
G < H is grouped-query attention (G must divide H).  Each may drop
the batch axis (unbatched 3-D inputs, all three alike).  Any strides
are read in place when the last axis is contiguous; float32 stays
float32, anything else follows NumPy promotion with a float32 floor;
float16 or bfloat16 (all three alike) are computed in float32 and
the results rounded once into that dtype.  Without ``cache`` k and
v are required; with a :class:`mhattn.PagedKVCache` as ``cache``
they are the new rows (n, G, T_new, d) to append before attending,
or None."""),
    Arg("layout", _ATT, "str", "", "", "'bhtd'", "The axis order of q, k, v and out.",
        type='"bhtd" (default) or "bthd"'),
    Arg("scale", _ATT, "float", "", "", "None", "Multiplier of q k^T; default 1/sqrt(dk).",
        type="float, optional", text="Multiplier of q k^T; default 1/sqrt(d_k). It must be "
        "finite and within the call's dtype's largest value."),
    Arg("mask", _ATT, "array?", "bool|T", "broadcasts to (B, H, Tq, Tk)", "None",
        "As multi_head_attention's.",
        text="""\
As :func:`mhattn.multi_head_attention`: ``mask`` bool (True = may
attend) or float (added), broadcastable to (B, H, T_q, T_k);
``causal`` bottom-right aligned (query i sees keys j <= i + T_k - T_q);
``key_lengths`` (B,) (a scalar unbatched): keys >= the length are
padding."""),
    Arg("causal", _ATT, "bool", "", "", "False", "As multi_head_attention's."),
    Arg("key_lengths", _ATT, "array?", "int64", "(B,) or an int", "None",
        "As multi_head_attention's."),
    Arg("return_weights", ("attention",), "bool", "", "", "False",
        "Also return the post-softmax weights (B, H, Tq, Tk).", type="bool, default False",
        text="Also return the post-softmax weights (B, H, T_q, T_k)."),
    Arg("return_lse", ("attention",), "bool", "", "", "False",
        "Also return each row's log-sum-exp (B, H, Tq), natural log.",
        type="bool, default False",
        text="""\
Also return each row's log-sum-exp (B, H, T_q) of its finished
scores, in **natural log** (not base 2), the sinks included, and
**-inf for a fully masked row** (without sinks).  Always (B, H, T_q),
whatever the layout; :func:`merge_attention` takes it."""),
    Arg("grad_out", ("attention_grad",), "array", "T", "as attention's out", REQUIRED,
        "dL/dout of a scalar loss L.", type="the shape of attention's ``out``",
        text="dL/dout of a scalar loss L."),
    Arg("lse", ("attention_grad",), "array?", "T", "(B, H, Tq)", "None",
        "The forward's log-sum-exp, given with out; neither has them recomputed.",
        type="(B, H, T_q), optional",
        text="The forward's ``return_lse=True`` result, given with ``out``."),
    Arg("out", ("attention_grad",), "array?", "T", "as attention's out", "None",
        "The forward's out; with lse, no forward pass is run.",
        type="the forward's ``out``, optional",
        text="""\
Given with ``lse``, no forward pass is run; with neither, the
forward is recomputed (the backward needs both).  One without the
other raises ValueError naming the missing one."""),
    # merge_attention
    Arg("outs", ("merge_attention",), "sequence", "T", "each (..., H, Tq, dv)", REQUIRED,
        "The parts' outputs, as attention returns them.",
        type='sequence of arrays, each (..., H, T_q, d_v) ("bhtd") or',
        text='(..., T_q, H, d_v) ("bthd"), as :func:`attention` returns them'),
    Arg("lses", ("merge_attention",), "sequence", "T", "each (..., H, Tq)", REQUIRED,
        "The parts' log-sum-exps (natural log).",
        type="sequence of arrays, each (..., H, T_q)",
        text="""\
Their ``return_lse=True`` results.  A part whose lse is -inf (no key
visible: fully masked) gets weight 0, and no NaN arises; a row that
is -inf in every part stays lse -inf, out 0."""),
    Arg("layout", ("merge_attention",), "str", "", "", "'bhtd'", "The layout of outs.",
        type='"bhtd" (default) or "bthd", the layout of ``outs``'),
    # KVCache
    Arg("batch", ("KVCache",), "int", "", "", REQUIRED, "B, the number of sequences.",
        type="int", text="B, the number of sequences."),
    Arg("num_kv_heads", ("KVCache",), "int", "", "", REQUIRED, "G, the key/value heads.",
        type="int",
        text="G, the number of key/value heads (the layer's ``num_kv_heads``)."),
    Arg("capacity", ("KVCache",), "int", "", "", REQUIRED,
        "The most keys any one sequence may hold.", type="int",
        text="The most keys any one sequence may hold."),
    Arg("d_k", ("KVCache",), "int", "", "", REQUIRED, "dk, the keys' head width.",
        type="int", text="Head widths of the keys and values; d_v defaults to d_k."),
    Arg("d_v", ("KVCache",), "int", "", "", "None", "dv, the values' head width; default dk."),
    Arg("dtype", ("KVCache",), "dtype", "", "", "np.float32",
        "float32, float64, float16, bfloat16 or 'int8': the storage.",
        type="np.float32 (default), np.float64, np.float16, ml_dtypes.bfloat16 or \"int8\"",
        text="""\
The storage's dtype ("float16" and "bfloat16" are also taken).  A
float16, bfloat16 or int8 cache computes in float32 and stores each
appended row rounded once to nearest even (half), or quantised
(int8: one float32 scale per token and kv head, see Notes)."""),
    Arg("k_new", ("KVCache.append",), "array", "T", "(B, G, Tnew, dk)", REQUIRED,
        "The new keys.",
        type="(B, G, T_new, d_k), of the cache's dtype (or float32 for a half or int8 cache)"),
    Arg("v_new", ("KVCache.append",), "array", "T", "(B, G, Tnew, dv)", REQUIRED,
        "The new values.", type="(B, G, T_new, d_v), as k_new"),
    Arg("lengths", ("KVCache.append",), "array?", "int64", "(B,)", "None",
        "A ragged append: the new rows each sequence takes.",
        type="(B,) ints in [0, T_new], optional",
        text="""\
A ragged append: sequence b takes only its first lengths[b] new
rows.  Default: all T_new rows for every sequence."""),
    # pack_weights
    Arg("w_q", _PACK, "weights", "T", "(Din, Sq), (H, Din, dk) or H x (Din, dk)",
        REQUIRED, "W^Q, in any of multi_head_attention's forms.",
        type="weights in any of multi_head_attention's forms",
        text="""\
Fused 2-D (d_in, h*d_k) with ``num_heads``, stacked 3-D
(h, d_in, d_k), or per-head lists."""),
    Arg("w_k", _PACK, "weights", "T", "(Dkin, Sk), (G, Dkin, dk) or G x (Dkin, dk)",
        REQUIRED, "W^K, in any of multi_head_attention's forms."),
    Arg("w_v", _PACK, "weights", "T", "(Dvin, Sv), (G, Dvin, dv) or G x (Dvin, dv)",
        REQUIRED, "W^V, in any of multi_head_attention's forms."),
    Arg("w_o", _PACK, "array?", "T", "(Svq, Dout)", "None", "W^O, or None.",
        type="(sum d_v, d_out) or None"),
    Arg("num_heads", _PACK, "int", "", "", "None", "H; needed for fused weights.",
        type="int, optional",
        text="As for multi_head_attention (num_heads is needed for fused weights)."),
    Arg("num_kv_heads", _PACK, "int", "", "", "None", "G; default H."),
    Arg("b_q", _PACK, "array?", "T", "(Sq,), (H, dk) or H x (dk,)", "None",
        "The query bias, kept (not packed).", type="optional",
        text="""\
Biases, in multi_head_attention's forms; kept in the object (they are
not packed), so a call then may not pass them again."""),
    Arg("b_k", _PACK, "array?", "T", "(Sk,), (G, dk) or G x (dk,)", "None",
        "The key bias, kept (not packed)."),
    Arg("b_v", _PACK, "array?", "T", "(Sv,), (G, dv) or G x (dv,)", "None",
        "The value bias, kept (not packed)."),
    Arg("b_o", _PACK, "array?", "T", "(Dout,)", "None", "The output bias, kept (not packed)."),
    Arg("dtype", _PACK, "dtype", "", "", "None",
        "float32, float64, float16 or bfloat16 to pack for; default the weights'.",
        type="np.float32, np.float64, np.float16 or bfloat16, optional",
        text="""\
The dtype to pack for; default: the weights' (float64 if any is
float64, as multi_head_attention promotes; float16 or bfloat16 if
they are, which must then all share it). A call computing in
another dtype casts the weights as an unpacked call would. Half
weights are kept in their dtype (``w_q`` ... are half) and cut
into float32 panels (widened exactly): half calls compute in
float32, and the micro-kernels read float32 panels at full speed."""),
    # MultiHeadAttention
    Arg("d_model", _LAYER, "int", "", "", REQUIRED, "Din, the width of x.", type="int",
        text="Width of the queries' source x (and of key/value unless kdim/vdim)."),
    Arg("num_heads", _LAYER, "int", "", "", REQUIRED, "H, the number of query heads.",
        type="int", text="h, the number of query heads."),
    Arg("num_kv_heads", _LAYER, "int", "", "", "None", "G; must divide H; default H.",
        type="int, optional",
        text="g, the number of key/value heads; must divide num_heads.  Default h."),
    Arg("d_k", _LAYER, "int", "", "", "None", "dk; default d_model // num_heads.",
        type="int, optional",
        text="""\
Head widths.  Default d_k = d_model // num_heads (which must then
divide d_model) and d_v = d_k."""),
    Arg("d_v", _LAYER, "int", "", "", "None", "dv; default dk."),
    Arg("d_out", _LAYER, "int", "", "", "None", "Dout; default d_model.",
        type="int, optional", text="Output width; default d_model."),
    Arg("kdim", _LAYER, "int", "", "", "None", "Dkin; default d_model.",
        type="int, optional",
        text="""\
Widths of the key and value inputs (as in nn.MultiheadAttention);
default d_model."""),
    Arg("vdim", _LAYER, "int", "", "", "None", "Dvin; default d_model."),
    Arg("bias", _LAYER, "bool", "", "", "False", "Give every projection a bias.",
        type="bool",
        text="Give every projection a bias (b_q, b_k, b_v and b_o), initialised to 0."),
    Arg("sinks", _LAYER, "bool", "", "", "False", "Own one sink logit per query head.",
        type="bool",
        text="""\
Own one attention-sink logit per query head, ``sinks`` (h,),
initialised to 0 (gpt-oss; see multi_head_attention's ``sinks``)."""),
    Arg("qk_norm", _LAYER, "object", "", "", "False",
        "Own q/k norm weights: False, True or 'per_head'.",
        type='False, True or "per_head"',
        text="""\
Own norm weights for q and k, initialised to 1: ``q_norm`` and
``k_norm`` (d_k,) shared by every head (Qwen3; Flax's
``normalize_qk``), or with "per_head" ``q_norm`` (h, d_k) and
``k_norm`` (g, d_k)."""),
    Arg("norm_eps", _LAYER, "float", "", "", "1e-06", "The q/k norm's epsilon.",
        type="float", text="The q/k norm's epsilon."),
    Arg("norm_type", _LAYER, "str", "", "", "'rms'",
        "The q/k norm: 'rms' (RMSNorm) or 'layer' (LayerNorm).",
        type='"rms" (default) or "layer"',
        text="""\
The q/k norm of ``qk_norm``: "rms", RMSNorm, or "layer", LayerNorm
without a bias (Flax's ``MultiHeadAttention(normalize_qk=True)``);
see multi_head_attention's ``norm_type``.  Only read with
``qk_norm``, but checked here (ValueError naming it) either way."""),
    Arg("gate", _LAYER, "bool", "", "", "False", "Own an output gate, w_gate and b_gate.",
        type="bool",
        text="""\
Own an output gate (Keras's ``use_gate=True``): ``w_gate``
(d_model, h*d_v), Glorot-uniform as Keras draws it, and ``b_gate``
(h*d_v,), initialised to 0; see multi_head_attention's ``w_gate``."""),
    Arg("dropout", _LAYER, "float", "", "", "0.0",
        "Dropout on the attention weights, in training mode only.",
        type="float in [0, 1), default 0.0",
        text="""\
Dropout on the attention weights (multi_head_attention's ``dropout``),
applied in training mode only (:meth:`train`; a new layer is in
evaluation mode, :meth:`eval`).  Each training call draws its mask's
seed from a generator seeded by ``seed`` (fresh OS entropy without
one), unless the call passes ``seed=``.  Outside [0, 1): ValueError."""),
    Arg("dtype", _LAYER, "dtype", "", "", "np.float32",
        "float32, float64, float16 or bfloat16.",
        type="np.float32 (default), np.float64, np.float16 or bfloat16",
        text="""\
The dtype of every weight (``ml_dtypes.bfloat16``, or the string
"bfloat16"). A half layer computes in float32 and returns its
inputs' half dtype (see :func:`mhattn.multi_head_attention`); its
inputs must have the layer's dtype. :meth:`astype` converts."""),
    Arg("seed", _LAYER, "object", "", "", "None", "Passed to np.random.default_rng.",
        type="int, np.random.Generator or None", text="Passed to np.random.default_rng."),
    Arg("options", ("MultiHeadAttention.__call__",), "options", "", "", REQUIRED,
        "multi_head_attention's keywords (mask, causal, cache, ...)."),
)

_F = "python/mhattn/compute/"
ENTRIES: Dict[str, Entry] = {
    "multi_head_attention": Entry(
        _F + "forward.py", "multi_head_attention",
        "x, w_q, w_k, w_v, w_o, *, num_heads, key, value, scale, return_weights, mask, "
        "causal, key_lengths, num_kv_heads, b_q, b_k, b_v, b_o, w_gate, b_gate, return_context, "
        "window, softcap, alibi_slopes, sinks, q_norm, k_norm, norm_eps, norm_type, rope, "
        "positions, key_positions, key_mask, cu_seqlens, key_cu_seqlens, dropout, seed, "
        "relative_bias, chunk, block_mask, cache, new_lengths, sequence_ids",
        ("x", "w_q, w_k, w_v", "w_o", "num_heads", "key, value", "scale",
         "return_weights", "mask", "causal", "key_lengths", "num_kv_heads",
         "b_q, b_k, b_v", "b_o", "w_gate, b_gate", "return_context", "window", "softcap",
         "alibi_slopes", "sinks", "q_norm, k_norm", "norm_eps", "norm_type", "rope",
         "positions, key_positions",
         "key_mask", "cu_seqlens, key_cu_seqlens", "dropout", "seed", "relative_bias",
         "chunk", "block_mask", "cache", "new_lengths", "sequence_ids")),
    "multi_head_attention_grad": Entry(
        _F + "grad.py", "multi_head_attention_grad",
        "grad_out, x, w_q, w_k, w_v, w_o, *, num_heads, key, value, scale, mask, causal, "
        "key_lengths, num_kv_heads, b_q, b_k, b_v, b_o, w_gate, b_gate, window, softcap, "
        "alibi_slopes, sinks, q_norm, k_norm, norm_eps, norm_type, rope, positions, "
        "key_positions, key_mask, cu_seqlens, key_cu_seqlens, dropout, seed, relative_bias, "
        "chunk, block_mask, mask_grad",
        ("grad_out",
         ("x, w_q, w_k, w_v, w_o, num_heads, key, value, scale, mask, causal",
          "As :func:`mhattn.multi_head_attention` (not ``return_weights``)."),
         ("key_lengths, num_kv_heads, b_q, b_k, b_v, b_o, w_gate, b_gate",
          "As :func:`mhattn.multi_head_attention`."),
         ("window, softcap, alibi_slopes, sinks, q_norm, k_norm, norm_eps, norm_type, rope",
          "As :func:`mhattn.multi_head_attention`."),
         ("positions, key_positions, key_mask, cu_seqlens, key_cu_seqlens",
          "As :func:`mhattn.multi_head_attention`."),
         ("dropout, seed", "As :func:`mhattn.multi_head_attention`: the same seed "
          "gives the forward's mask."),
         ("relative_bias", "As :func:`mhattn.multi_head_attention`; its table's "
          "gradient is 'relative_bias'."),
         ("chunk, block_mask", "As :func:`mhattn.multi_head_attention`."),
         "mask_grad")),
    "backward": Entry(_F + "grad.py", "backward", "grad_out, ctx, *, mask_grad",
                      ("grad_out", "ctx", "mask_grad")),
    "attention": Entry(
        _F + "attention.py", "attention",
        "q, k, v, *, layout, scale, mask, causal, key_lengths, return_weights, return_lse, "
        "window, softcap, alibi_slopes, sinks, key_mask, cu_seqlens, key_cu_seqlens, dropout, "
        "seed, relative_bias, chunk, block_mask, q_offset, cache, sequence_ids",
        ("q", "k", "v", "layout", "scale", "mask, causal, key_lengths", "return_weights",
         "return_lse",
         ("window, softcap, alibi_slopes, sinks, key_mask, cu_seqlens, key_cu_seqlens",
          """\
The score variants of :func:`mhattn.multi_head_attention`, with the
same meanings and checks.  Packed sequences take unbatched 3-D
inputs, the tokens along T.  The q/k transforms (q_norm, k_norm,
RoPE) are not attention keywords: apply them before."""),
         ("dropout, seed", "As :func:`mhattn.multi_head_attention`."),
         ("relative_bias", "As :func:`mhattn.multi_head_attention`."),
         ("chunk, block_mask", "As :func:`mhattn.multi_head_attention`."),
         "q_offset", "cache", "sequence_ids")),
    "attention_grad": Entry(
        _F + "attention.py", "attention_grad",
        "grad_out, q, k, v, *, layout, scale, mask, causal, key_lengths, window, softcap, "
        "alibi_slopes, sinks, key_mask, cu_seqlens, key_cu_seqlens, dropout, seed, "
        "relative_bias, chunk, block_mask, q_offset, lse, out, mask_grad",
        ("grad_out",
         ("q, k, v, layout, scale, mask, causal, key_lengths",
          "As :func:`attention` (not ``return_weights`` / ``return_lse``)."),
         ("window, softcap, alibi_slopes, sinks, key_mask, cu_seqlens, key_cu_seqlens",
          "As :func:`attention`."),
         ("dropout, seed", "As :func:`attention`: the same seed gives the forward's mask."),
         ("relative_bias", "As :func:`attention`; its table's gradient is "
          "'relative_bias'."),
         ("chunk, block_mask", "As :func:`attention`."),
         ("q_offset", "As :func:`attention`."),
         "lse", "out", "mask_grad")),
    "merge_attention": Entry(_F + "attention.py", "merge_attention",
                             "outs, lses, *, layout", ("outs", "lses", "layout")),
    "KVCache": Entry(_F + "cache.py", "KVCache",
                     "batch, num_kv_heads, capacity, d_k, d_v, dtype",
                     ("batch", "num_kv_heads", "capacity", "d_k, d_v", "dtype")),
    "KVCache.append": Entry(_F + "cache.py", "KVCache.append", "k_new, v_new, *, lengths",
                            ("k_new", "v_new", "lengths")),
    "KVCache.reset": Entry(_F + "cache.py", "KVCache.reset", ""),
    "pack_weights": Entry(
        _F + "packed.py", "pack_weights",
        "w_q, w_k, w_v, w_o, *, num_heads, num_kv_heads, b_q, b_k, b_v, b_o, dtype",
        ("w_q, w_k, w_v", "w_o", "num_heads, num_kv_heads", "b_q, b_k, b_v, b_o",
         "dtype")),
    "MultiHeadAttention": Entry(
        "python/mhattn/nn/layer.py", "MultiHeadAttention",
        "d_model, num_heads, *, num_kv_heads, d_k, d_v, d_out, kdim, vdim, bias, sinks, "
        "qk_norm, norm_eps, norm_type, gate, dropout, dtype, seed",
        ("d_model", "num_heads", "num_kv_heads", "d_k, d_v", "d_out", "kdim, vdim",
         "bias", "sinks", "qk_norm", "norm_eps", "norm_type", "gate", "dropout", "dtype",
         "seed")),
    "MultiHeadAttention.__call__": Entry("python/mhattn/nn/layer.py",
                                         "MultiHeadAttention.__call__",
                                         "x, key, value, **options"),
}

# ---- mhattn._C -------------------------------------------------------------
# The glue's functions. Every argument is positional-or-keyword where the
# glue parses a keyword list (METH_FASTCALL | METH_KEYWORDS, METH_VARARGS |
# METH_KEYWORDS), positional-only where it takes one object (METH_O).

_FWD, _BWD, _PRJ = "_C.forward", "_C.backward", "_C.project"
_AT, _ABW = "_C.attention", "_C.attention_backward"
_CHK = "_C.check_config"
_ALL5 = (_FWD, _BWD, _AT, _ABW, _PRJ, _CHK)
_MASKED = (_FWD, _BWD, _AT, _ABW)

C_ARGS = (
    Arg("x", (_FWD, _BWD, _PRJ, _CHK), "array", "T", "(B, Tq, Din)", REQUIRED,
        "The queries' source; its dtype is the call's.", c_kind="ARG_ARRAY",
        c_field="x"),
    Arg("key", (_FWD, _PRJ, _CHK), "array", "T", "(B, Tk, Dkin)", REQUIRED,
        "The keys' source.", c_kind="ARG_ARRAY", c_field="key"),
    Arg("value", (_FWD, _PRJ), "array", "T", "(B, Tk, Dvin)", REQUIRED,
        "The values' source.", c_kind="ARG_ARRAY", c_field="value"),
    Arg("key", (_BWD,), "array?", "T", "(B, Tk, Dkin)", REQUIRED,
        "The keys' source, or None: key is x (its gradient added into x's).",
        c_kind="ARG_ARRAY_ALIAS", alias="x", c_field="key"),
    Arg("value", (_BWD,), "array?", "T", "(B, Tk, Dvin)", REQUIRED,
        "The values' source, or None: value is key (its gradient added into key's).",
        c_kind="ARG_ARRAY_ALIAS", alias="key", c_field="value"),
    Arg("wq", (_FWD, _BWD, _PRJ), "array", "T", "(Din, Sq)", REQUIRED,
        "W^Q fused, head h's block after the heads before it.", c_kind="ARG_ARRAY",
        c_field="wq"),
    Arg("wk", (_FWD, _BWD, _PRJ), "array", "T", "(Dkin, Sk)", REQUIRED, "W^K fused.",
        c_kind="ARG_ARRAY", c_field="wk"),
    Arg("wv", (_FWD, _BWD, _PRJ), "array", "T", "(Dvin, Sv)", REQUIRED, "W^V fused.",
        c_kind="ARG_ARRAY", c_field="wv"),
    Arg("wo", (_FWD, _BWD), "array?", "T", "(Svq, Dout)", REQUIRED,
        "W^O, or None: out is the concatenation.", c_kind="ARG_ARRAY_OPT",
        c_field="wo, has_wo"),
    Arg("bq", (_FWD, _PRJ), "array?", "T", "(Sq,)", REQUIRED, "The query bias, or None.",
        c_kind="ARG_ARRAY_OPT", c_field="bq"),
    Arg("bk", (_FWD, _PRJ), "array?", "T", "(Sk,)", REQUIRED, "The key bias, or None.",
        c_kind="ARG_ARRAY_OPT", c_field="bk"),
    Arg("bv", (_FWD, _PRJ), "array?", "T", "(Sv,)", REQUIRED, "The value bias, or None.",
        c_kind="ARG_ARRAY_OPT", c_field="bv"),
    Arg("bo", (_FWD,), "array?", "T", "(Dout,)", REQUIRED, "The output bias, or None.",
        c_kind="ARG_ARRAY_OPT", c_field="bo"),
    Arg("wgate", (_FWD, _BWD), "array?", "T", "(Din, Svq)", "None",
        "None, or the output gate's W: concat -> sigmoid(x wgate + bgate) * concat.",
        c_kind="ARG_ARRAY_OPT", c_field="wgate"),
    Arg("bgate", (_FWD, _BWD), "array?", "T", "(Svq,)", "None",
        "None, or the output gate's bias (with wgate only).", c_kind="ARG_ARRAY_OPT",
        c_field="bgate"),
    Arg("dout", (_BWD,), "array", "T", "(B, Tq, Dout)", REQUIRED, "dL/dout.",
        c_kind="ARG_ARRAY", c_field="dout"),
    Arg("q", (_BWD,), "array", "T", "(B, Tq, Sq)", REQUIRED,
        "forward()'s kept q projection.", c_kind="ARG_ARRAY", c_field="q"),
    Arg("k", (_BWD,), "array", "T", "(B, Tk, Sk)", REQUIRED,
        "forward()'s kept k projection.", c_kind="ARG_ARRAY", c_field="k"),
    Arg("v", (_BWD,), "array", "T", "(B, Tk, Sv)", REQUIRED,
        "forward()'s kept v projection.", c_kind="ARG_ARRAY", c_field="v"),
    Arg("concat", (_BWD,), "array", "T", "(B, Tq, Svq)", REQUIRED,
        "forward()'s kept concatenation of the heads.", c_kind="ARG_ARRAY",
        c_field="concat"),
    Arg("lse", (_BWD,), "array", "T", "(B, H, Tq)", REQUIRED,
        "forward()'s kept log-sum-exp of each row.", c_kind="ARG_ARRAY", c_field="lse"),
    Arg("dk", (_FWD, _BWD, _PRJ, _CHK), "vector", "int64", "(G,)", REQUIRED,
        "Each kv head's key width.", c_kind="ARG_INT64", c_field="dk, G"),
    Arg("dv", (_FWD, _BWD, _PRJ, _CHK), "vector", "int64", "(G,)", REQUIRED,
        "Each kv head's value width.", c_kind="ARG_INT64", c_field="dv"),
    Arg("scales", _ALL5, "vector", "float64", "(H,)", REQUIRED,
        "The multiplier of q.k of each query head.", c_kind="ARG_FLOAT64",
        c_field="scale, H"),
    Arg("q", (_AT, _ABW), "array", "T", "(B, H, Tq, dk)", REQUIRED,
        "The queries, any strides, the last axis contiguous.", c_kind="ARG_ARRAY",
        c_field="q, sq"),
    Arg("k", (_AT, _ABW), "array", "T", "(B, G, Tk, dk)", REQUIRED,
        "The keys, any strides.", c_kind="ARG_ARRAY", c_field="k, sk"),
    Arg("v", (_AT, _ABW), "array", "T", "(B, G, Tk, dv)", REQUIRED,
        "The values, any strides.", c_kind="ARG_ARRAY", c_field="v, sv"),
    Arg("k_scales", (_AT,), "array?", "float32", "(B, G, Tk)", "None",
        "None, or with int8 k and v (a KV cache's) the keys' float32 scales.",
        c_kind="ARG_ARRAY_OPT", c_field="k_scale, sks"),
    Arg("v_scales", (_AT,), "array?", "float32", "(B, G, Tk)", "None",
        "None, or with int8 k and v the values' float32 scales.",
        c_kind="ARG_ARRAY_OPT", c_field="v_scale, svs"),
    Arg("block_table", (_AT,), "array?", "int32", "(B, pages_per_seq)", "None",
        "None, or a paged cache's pages: k, v pools (num_pages, G, page_size, d).",
        c_kind="ARG_BLOCK_TABLE", c_field="block_table, pages_per_seq, page_size, num_pages"),
    Arg("dout", (_ABW,), "array", "T", "(B, H, Tq, dv)", REQUIRED, "dL/dout, any strides.",
        c_kind="ARG_ARRAY", c_field="dout"),
    Arg("out", (_ABW,), "array", "T", "(B, H, Tq, dv)", REQUIRED, "attention()'s out.",
        c_kind="ARG_ARRAY", c_field="out"),
    Arg("lse", (_ABW,), "array?", "T", "(B, H, Tq)", REQUIRED,
        "attention()'s lse, or None: recomputed.", c_kind="ARG_ARRAY_OPT", c_field="lse"),
    Arg("mask", _MASKED, "mask", "bool|T", "broadcasts to (B, H, Tq, Tk)", REQUIRED,
        "None, or bool (True = may attend) or float (added), any strides.",
        c_kind="ARG_MASK", c_field="mask, mask_kind, mask_stride"),
    Arg("causal", _MASKED, "bool", "", "", REQUIRED,
        "Query i sees keys j <= i + (Tk - Tq).", c_kind="ARG_BOOL", c_field="causal"),
    Arg("key_lengths", _MASKED + (_CHK,), "vector?", "int64", "(B,)", REQUIRED,
        "None, or each item's key count: keys j >= it are padding.",
        c_kind="ARG_LENGTHS", c_field="key_lengths"),
    Arg("variants", _ALL5, "tuple?", "", "(22,)", REQUIRED,
        "None, or the tuple of mhattn._internal.core.variant_args (VARIANTS).",
        c_kind="ARG_VARIANTS", c_field=""),   # VARIANTS' fields
    Arg("lengths_aligned", (_AT, _ABW, _CHK), "bool", "", "", REQUIRED,
        "Align each item's queries to its own key length (a KV cache).",
        c_kind="ARG_BOOL", c_field="lengths_aligned"),
    Arg("out_bthd", (_AT,), "bool", "", "", REQUIRED,
        "out (B, Tq, H, dv) instead of (B, H, Tq, dv).", c_kind="ARG_BOOL",
        c_field="so"),
    Arg("want_weights", (_FWD, _AT), "bool", "", "", REQUIRED,
        "Also return the weights (B, H, Tq, Tk).", c_kind="ARG_BOOL",
        c_field="weights != NULL"),
    Arg("want_lse", (_AT,), "bool", "", "", REQUIRED, "Also return lse (B, H, Tq).",
        c_kind="ARG_BOOL", c_field="lse != NULL"),
    Arg("keep", (_FWD,), "bool", "", "", REQUIRED,
        "Also return (q, k, v, concat, lse) for backward().", c_kind="ARG_BOOL",
        c_field="q, k, v, concat, lse != NULL"),
    Arg("want_bq", (_BWD,), "bool", "", "", REQUIRED, "Return dbq.", c_kind="ARG_BOOL",
        c_field="dbq != NULL"),
    Arg("want_bk", (_BWD,), "bool", "", "", REQUIRED, "Return dbk.", c_kind="ARG_BOOL",
        c_field="dbk != NULL"),
    Arg("want_bv", (_BWD,), "bool", "", "", REQUIRED, "Return dbv.", c_kind="ARG_BOOL",
        c_field="dbv != NULL"),
    Arg("want_dmask", (_BWD, _ABW), "bool", "", "", "False",
        "Also return dmask, the gradient of an additive mask (B, H, Tq, Tk).",
        c_kind="ARG_BOOL", c_field="dmask != NULL"),
    Arg("want_bo", (_BWD,), "bool", "", "", REQUIRED, "Return dbo.", c_kind="ARG_BOOL",
        c_field="dbo != NULL"),
    Arg("packed", (_FWD, _PRJ), "tuple?", "", "(4,)", "None",
        "None, or pack_weight() capsules (or None) of wq, wk, wv, wo.",
        c_kind="ARG_PACKED", c_field="packed"),
    Arg("w", ("_C.pack_weight",), "array", "T", "(K, N)", REQUIRED,
        "A weight, float32 or float64; copied, never kept.", c_kind="ARG_ARRAY"),
    Arg("packed", ("_C.packed_info",), "capsule", "", "", REQUIRED,
        "A pack_weight() capsule."),
    Arg("name", ("_C.set_isa",), "str", "", "", REQUIRED,
        "'scalar', 'avx2', 'avx512' or 'neon'."),
    Arg("n", ("_C.set_num_threads",), "int", "", "", REQUIRED,
        "A thread count; 0 restores the default."),
    Arg("src", ("_C.cast_half",), "array", "", "(...)", REQUIRED,
        "float32, float16 or bfloat16; C-contiguous, aligned, native."),
    Arg("dst", ("_C.cast_half",), "array", "", "(...)", REQUIRED,
        "As many elements; float16 or bfloat16 for a float32 src, else float32."),
)

# The roles a call_spec names by position (csrc/python/glue.h, struct
# call_spec): role -> the arguments that may play it, the first a function
# takes; ARG_NONE where it takes none.
C_ROLES = {
    "x": ("x", "q"), "key": ("key", "k"), "value": ("value", "v"), "wq": ("wq",),
    "wk": ("wk",), "wv": ("wv",), "wo": ("wo",), "wgate": ("wgate",),
    "dk": ("dk",), "dv": ("dv",), "scales": ("scales",), "mask": ("mask",),
    "causal": ("causal",), "key_lengths": ("key_lengths",), "variants": ("variants",),
    "lengths_aligned": ("lengths_aligned",), "block_table": ("block_table",),
}

# The variants' tuple (C_ARGS's ``variants``), position by position, as
# mhattn._internal.core.variant_args makes it and the glue's read_variants
# reads it: (name, kind, dtype, shape, the mha_config field(s), doc). The
# public names of these are the PUBLIC_ARGS records of the same name.
VARIANTS = (
    ("window", "tuple?", "int64", "(2,)", "windowed, window_left, window_right",
     "None or (left, right), -1 for an unbounded side."),
    ("softcap", "float", "float64", "", "softcap", "0 for off."),
    ("alibi_slopes", "array?", "float64", "(H,) or (B, H)", "alibi, alibi_bstride",
     "None or the ALiBi slopes."),
    ("sinks", "array?", "T", "(H,)", "sinks", "None or one logit per query head."),
    ("key_mask", "array?", "bool", "(B, Tk)", "key_mask", "None or True = a real key."),
    ("cu_seqlens", "array?", "int64", "(n+1,)", "nseq, cu_q", "None or the queries' offsets."),
    ("key_cu_seqlens", "array?", "int64", "(n+1,)", "cu_k", "None or the keys' offsets."),
    ("q_norm", "array?", "T", "(dk,) or (H, dk)", "q_norm, q_norm_hstride",
     "None or the q norm's weights."),
    ("k_norm", "array?", "T", "(dk,) or (G, dk)", "k_norm, k_norm_hstride",
     "None or the k norm's weights."),
    ("norm_eps", "float", "float64", "", "norm_eps", "The q/k norm's epsilon."),
    ("norm_type", "str", "", "", "norm_type",
     "The q/k norm's name, 'rms' or 'layer' (the core's mha_norm_type_parse)."),
    ("rotary_dim", "int", "int64", "", "rotary_dim", "0 for no RoPE."),
    ("interleaved", "bool", "", "", "rope_interleaved", "RoPE pairs (2c, 2c+1)."),
    ("inv_freq", "array?", "float64", "(rotary_dim/2,)", "inv_freq",
     "None or RoPE's frequencies."),
    ("positions", "array?", "int64", "(Tq,) or (B, Tq)", "positions, positions_bstride",
     "None or the queries' RoPE positions."),
    ("key_positions", "array?", "int64", "(Tk,) or (B, Tk)",
     "key_positions, key_positions_bstride", "None or the keys' RoPE positions."),
    ("dropout", "float", "float64", "", "dropout", "0 for off, else in [0, 1)."),
    ("seed", "int", "uint64", "", "dropout_seed", "Dropout's seed, in [0, 2**64)."),
    ("relative_bias", "tuple?", "T", "(num_buckets, H)",
     "rel_table, rel_buckets, rel_max_distance, rel_bidirectional",
     "None or (table, max_distance, bidirectional): T5's relative bias."),
    ("chunk", "int", "int64", "", "chunk", "0 for off: chunked attention's chunk."),
    ("block_mask", "tuple?", "int32, uint8", "(B or 1, H or 1, nqb, nkb)",
     "bm_block, bm_bits, bm_bq, bm_bk, bm_bstride, bm_hstride, bm_npartial",
     "None or (blocks, bits, bq, bk): a BlockMask's entries and partial bits."),
    ("q_offset", "int?", "int64", "", "has_q_offset, q_offset",
     "None (bottom-right) or query 0's position relative to key 0."),
)

_OPT = "Optional[_Float]"
C_FUNCTIONS: Dict[str, CFunction] = {
    "forward": CFunction(
        "METH_FASTCALL | METH_KEYWORDS",
        "Tuple[_Float, Optional[_Float], Optional[Tuple[_Float, _Float, _Float, _Float, "
        "_Float]]]",
        "Multi-head attention forward pass (low level; see mhattn for the public "
        "API). All float arrays share one dtype, float32 or float64; or, with "
        "float32 x, wq, wk, wv, wo and wgate are all float16 or all bfloat16, "
        "widened by the core as it packs them (no float32 copy). With wgate "
        "(keyword-only, as bgate), W^O reads sigmoid(x wgate + bgate) * concat.",
        "Returns (out (B, Tq, Dout), weights (B, H, Tq, Tk) or None, (q, k, v, "
        "concat, lse) or None), new C-contiguous arrays of the call's dtype; concat "
        "is the heads side by side, before the gate. A fully masked query row gets "
        "zero weights, a zero head output and lse -inf.",
        prefix="FWD", table_shapes=_ARRAYS, checks_x=("key", "value"),
        checks_widths=("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "wgate", "bgate")),
    "backward": CFunction(
        "METH_VARARGS | METH_KEYWORDS",
        "Tuple[Optional[_Float], ...]",
        "Backward pass of forward() (low level; see mhattn.backward). x, key, value, "
        "wq, wk, wv, wo, dk, dv, scales, mask, causal, key_lengths, variants, wgate "
        "and bgate as given to forward(); the gate is recomputed from x, wgate, bgate.",
        "Returns (dx, dkey or None, dvalue or None, dwq, dwk, dwv, dwo or None, dbq, "
        "dbk, dbv, dbo, dsinks, dq_norm, dk_norm), and with wgate (dwgate, dbgate) "
        "after them: new C-contiguous gradients, each bias gradient None unless its "
        "want_* is true, each variant's None unless it was given. Bitwise the same "
        "for any thread count.",
        prefix="BWD", table_shapes=_ARRAYS, checks_x=("key", "value"),
        checks_widths=("wq", "wk", "wv", "wo", "dout", "q", "k", "v", "concat", "lse",
                       "wgate", "bgate")),
    "attention": CFunction(
        "METH_FASTCALL | METH_KEYWORDS",
        "Tuple[_Float, Optional[_Float], Optional[_Float]]",
        "Attention on tensors already projected (low level; see mhattn.attention; "
        "the core's mha_attend). q, k, v are 4-D of one dtype, or, with float32 q, "
        "k and v a KV cache's float16, bfloat16 or int8 storage (int8 with "
        "k_scales and v_scales), widened in the kernels; any non-negative "
        "strides with a contiguous last axis are read in place, anything else is "
        "copied. The variants' q/k transforms must be off.",
        "Returns (out, weights or None, lse or None): out (B, H, Tq, dv), or with "
        "out_bthd (B, Tq, H, dv), C-contiguous; weights (B, H, Tq, Tk); lse "
        "(B, H, Tq), natural log, -inf for a fully masked row.",
        prefix="ATT", table_shapes=_ARRAYS + ("ARG_FLOAT64",),
        notes=(("k", " from q's B and dk"), ("v", " from k"), ("scales", " from q")),
        checks_x=("k", "v", "k_scales", "v_scales", "scales")),
    "attention_backward": CFunction(
        "METH_FASTCALL | METH_KEYWORDS",
        "Tuple[_Float, _Float, _Float, Optional[_Float]]",
        "Backward of attention() (low level; see mhattn.attention_grad; the core's "
        "mha_attend_backward). The variants' q/k transforms must be off.",
        "Returns (dq (B, H, Tq, dk), dk (B, G, Tk, dk), dv (B, G, Tk, dv), dsinks "
        "(H,) or None), C-contiguous.",
        prefix="ABW", table_shapes=_ARRAYS + ("ARG_FLOAT64",),
        checks_x=("dout", "q", "k", "v", "out", "lse"), checks_widths=("scales",)),
    "project": CFunction(
        "METH_FASTCALL | METH_KEYWORDS",
        "Tuple[_Float, _Float, _Float]",
        "The projections of forward() alone (low level; the core's mha_project), "
        "each argument as given to forward(); packed may be a 3- or 4-tuple, its "
        "fourth ignored.",
        "Returns (q (B, Tq, Sq), k (B, Tk, Sk), v (B, Tk, Sv)), q and k after the "
        "q/k norm and RoPE (positions from the variants tuple, or the defaults).",
        prefix="PRJ", table_shapes=_ARRAYS, checks_x=("key", "value"),
        checks_widths=("wq", "wk", "wv", "bq", "bk", "bv")),
    "check_config": CFunction(
        "METH_FASTCALL | METH_KEYWORDS", "None",
        "The core's verdict on a call's config (mha_check_config), nothing "
        "computed: the sizes of x (B, Tq, Din) and key (B, Tk, Dkin), which may "
        "hold no elements (Din = Dkin = 0), the head widths dk and dv, the scales, "
        "the key lengths and the variants, as forward() would read them. For "
        "Python code that uses a call's values before a call of the core (the "
        "reference, the checker): each rule lives in the core, once.",
        "Returns None; raises the core's ValueError (its .field names the "
        "config field) for a config the core rejects.",
        prefix="CHK", table_shapes=_ARRAYS, checks_x=("key",)),
    "pack_weight": CFunction(
        "METH_O", "object",
        "w's GEMM panels for the ISA in force, as an opaque capsule for forward()'s "
        "and project()'s packed argument (low level; see mhattn.pack_weights)."),
    "packed_info": CFunction(
        "METH_O", "Tuple[int, int, str, str, int]",
        "What a pack_weight() capsule holds.",
        "Returns (K, N, isa, dtype name, bytes)."),
    "get_isa": CFunction(
        "METH_NOARGS", "str",
        "The instruction set of the kernels now in force: 'avx512', 'avx2', 'neon' "
        "or 'scalar' (detected once, capped by MHATTN_ISA or set_isa)."),
    "set_isa": CFunction(
        "METH_O", "str",
        "Caps the instruction set at name, lowered to what this CPU supports; for "
        "tests.", "Returns the ISA now in force."),
    "get_num_threads": CFunction("METH_NOARGS", "int",
                                 "The number of threads the core uses."),
    "set_num_threads": CFunction(
        "METH_O", "None",
        "Uses n threads from the next call on (at most 256); 0 restores the default "
        "(MHATTN_NUM_THREADS, else the CPUs this process may use)."),
    "cast_half": CFunction(
        "METH_VARARGS", "None",
        "dst = src between float32 and a half storage type (mha_convert): "
        "widened exactly, or rounded once to nearest even (overflow to inf, "
        "subnormals kept, NaN stays NaN); the same bits on every ISA and for "
        "any thread count. The GIL is released."),
}

# The functions' parameters in the glue's positional order.
_C_PARAMS = {
    "forward": "x, key, value, wq, wk, wv, wo, bq, bk, bv, bo, dk, dv, scales, mask, "
               "causal, key_lengths, variants, want_weights, keep, packed, *, wgate, bgate",
    "backward": "dout, x, key, value, wq, wk, wv, wo, q, k, v, concat, lse, dk, dv, "
                "scales, mask, causal, key_lengths, variants, want_bq, want_bk, want_bv, "
                "want_bo, *, wgate, bgate, want_dmask",
    "attention": "q, k, v, scales, mask, causal, key_lengths, variants, lengths_aligned, "
                 "out_bthd, want_weights, want_lse, k_scales, v_scales, block_table",
    "attention_backward": "dout, q, k, v, out, lse, scales, mask, causal, key_lengths, "
                          "variants, lengths_aligned, *, want_dmask",
    "project": "x, key, value, wq, wk, wv, bq, bk, bv, dk, dv, scales, variants, packed",
    "check_config": "x, key, dk, dv, scales, key_lengths, variants, lengths_aligned",
    "pack_weight": "w, /",
    "packed_info": "packed, /",
    "get_isa": "",
    "set_isa": "name, /",
    "get_num_threads": "",
    "set_num_threads": "n, /",
    "cast_half": "src, dst, /",
}
for _name, _params in _C_PARAMS.items():
    ENTRIES["_C." + _name] = Entry("csrc/python", _name, _params)
del _name, _params


class Out(NamedTuple):
    """One output of a function of mhattn._C, in the order it returns them
    (the glue's ``<name>_outs`` shape table, the core's output pointers)."""
    name: str
    shape: str                    # in mha.h's letters
    when: str                     # what asks for it; "" always made
    doc: str
    made: str = ""                # the shape the glue allocates, where it
                                  # differs (attention_backward's fused layout)


C_OUTPUTS: Dict[str, Tuple[Out, ...]] = {
    "check_config": (),
    "forward": (
        Out("out", "(B, Tq, Dout)", "", "The layer's output."),
        Out("weights", "(B, H, Tq, Tk)", "want_weights", "The post-softmax weights."),
        Out("q", "(B, Tq, Sq)", "keep", "The q projection (before the q/k transforms)."),
        Out("k", "(B, Tk, Sk)", "keep", "The k projection (before the q/k transforms)."),
        Out("v", "(B, Tk, Sv)", "keep", "The v projection."),
        Out("concat", "(B, Tq, Svq)", "keep",
            "The heads side by side, before the gate and W^O."),
        Out("lse", "(B, H, Tq)", "keep", "Each row's log-sum-exp, -inf when fully masked."),
    ),
    "backward": (
        Out("dx", "(B, Tq, Din)", "", "dL/dx (with dkey, dvalue added when aliased)."),
        Out("dkey", "(B, Tk, Dkin)", "key", "dL/dkey; None when key is None."),
        Out("dvalue", "(B, Tk, Dvin)", "value", "dL/dvalue; None when value is None."),
        Out("dwq", "(Din, Sq)", "", "dL/dwq."),
        Out("dwk", "(Dkin, Sk)", "", "dL/dwk."),
        Out("dwv", "(Dvin, Sv)", "", "dL/dwv."),
        Out("dwo", "(Svq, Dout)", "wo", "dL/dwo; None without wo."),
        Out("dbq", "(Sq,)", "want_bq", "dL/dbq."),
        Out("dbk", "(Sk,)", "want_bk", "dL/dbk."),
        Out("dbv", "(Sv,)", "want_bv", "dL/dbv."),
        Out("dbo", "(Dout,)", "want_bo", "dL/dbo."),
        Out("dsinks", "(H,)", "variants: sinks", "dL/dsinks."),
        Out("dq_norm", "(dk,) or (H, dk)", "variants: q_norm", "dL/dq_norm."),
        Out("dk_norm", "(dk,) or (G, dk)", "variants: k_norm", "dL/dk_norm."),
        Out("dwgate", "(Din, Svq)", "wgate", "dL/dwgate; in the tuple with wgate alone."),
        Out("dbgate", "(Svq,)", "wgate", "dL/dbgate; in the tuple with wgate alone."),
        Out("dmask", "(B, H, Tq, Tk)", "want_dmask",
            "dL/d(mask) of an additive mask, before its broadcast; in the tuple "
            "with want_dmask alone."),
        Out("drel_table", "(num_buckets, H)", "variants: relative_bias",
            "dL/d(table) of T5's relative bias; last in the tuple, with it alone."),
    ),
    "attention": (
        Out("out", "(B, H, Tq, dv) or (B, Tq, H, dv)", "", "The attention, C-contiguous."),
        Out("weights", "(B, H, Tq, Tk)", "want_weights", "The post-softmax weights."),
        Out("lse", "(B, H, Tq)", "want_lse", "Each row's log-sum-exp, natural log."),
    ),
    "attention_backward": (
        Out("dq", "(B, H, Tq, dk)", "", "dL/dq.", "(B, Tq, H, dk)"),
        Out("dk", "(B, G, Tk, dk)", "", "dL/dk.", "(B, Tk, G, dk)"),
        Out("dv", "(B, G, Tk, dv)", "", "dL/dv.", "(B, Tk, G, dv)"),
        Out("dsinks", "(H,)", "variants: sinks", "dL/dsinks."),
        Out("dmask", "(B, H, Tq, Tk)", "want_dmask",
            "dL/d(mask) of an additive mask, before its broadcast; in the tuple with "
            "want_dmask alone."),
        Out("drel_table", "(num_buckets, H)", "variants: relative_bias",
            "dL/d(table) of T5's relative bias; last in the tuple, with it alone."),
    ),
    "project": (
        Out("q", "(B, Tq, Sq)", "", "The q projection, after the q/k norm and RoPE."),
        Out("k", "(B, Tk, Sk)", "", "The k projection, after the q/k norm and RoPE."),
        Out("v", "(B, Tk, Sv)", "", "The v projection."),
    ),
}

# _C's constants, for the stub.
C_CONSTANTS = {
    "EMULATED_AVX512": ("int", "1 in the test build whose 'avx512' kernels are emulated "
                        "in plain C (``MHATTN_EMULATE_AVX512=1``, setup.py), else 0."),
}

# ---- the core: csrc/mha.h ------------------------------------------------------
# The core's operations, by the letters the comments of mha_params use.
OPS = {"F": "mha_forward", "B": "mha_backward", "A": "mha_attend",
       "AB": "mha_attend_backward", "P": "mha_project"}


class Use(NamedTuple):
    """What some operations do with a field of mha_params."""
    ops: str                      # "F, A": keys of OPS
    io: str                       # "reads" or "writes"
    text: str                     # its shape, and when it may be NULL


class Field(NamedTuple):
    """A field of mha_params, the buffers of one core call (csrc/mha.h):
    every operation reads the fields its uses name and ignores the others."""
    name: str
    ctype: str                    # "void *", "const void *", "mha_strides"
    section: str                  # the comment of the fields' group
    uses: Tuple[Use, ...]


_OUTS = "Outputs of the forward, and what the backward reads back"
_PROJ = "Inputs of the projections (F, B, P)"
_GRADS = "The backward's (B, AB) upstream gradient and gradients"
_STR = "mha_attend's strides (A only)"
_KV = "A KV cache's storage (A only; mha.h, mha_kv_storage)"


def _io(ops, io, *shapes_and_names):
    """Fields of one section alike but for their shapes: (name, shape) pairs."""
    return [(n, (Use(ops, io, sh),)) for n, sh in shapes_and_names]


PARAMS: Tuple[Field, ...] = tuple(
    [Field("dtype", "mha_dtype", "The element type of every buffer", (Use("F, B, A, AB, P", "reads",
                                          "float or double (MHA_DTYPE_F32, _F64)"),))]
    + [Field(n, "void *", _OUTS, u) for n, u in (
        ("out", (Use("F", "writes", "(B, Tq, Dout), required"),
                 Use("A", "writes", "(B, H, Tq, dv) at strides so, required"),
                 Use("AB", "reads", "(B, Tq, Svq), as mha_attend made it"))),
        ("weights", (Use("F, A", "writes", "(B, H, Tq, Tk) post-softmax probabilities"),)),
        ("q", (Use("F", "writes", "(B, Tq, Sq) kept projections (else scratch)"),
               Use("B", "reads", "(B, Tq, Sq) as F kept it"),
               Use("P", "writes", "(B, Tq, Sq), transformed"),
               Use("A", "reads", "(B, H, Tq, dk) at strides sq"),
               Use("AB", "reads", "(B, Tq, Sq)"))),
        ("k", (Use("F, P", "writes", "(B, Tk, Sk)"), Use("B, AB", "reads", "(B, Tk, Sk)"),
               Use("A", "reads", "(B, G, Tk, dk) at strides sk"))),
        ("v", (Use("F, P", "writes", "(B, Tk, Sv)"), Use("B, AB", "reads", "(B, Tk, Sv)"),
               Use("A", "reads", "(B, G, Tk, dv) at strides sv"))),
        ("concat", (Use("F", "writes", "(B, Tq, Svq) heads side by side, pre-W^O"),
                    Use("B", "reads", "(B, Tq, Svq) as F kept it"))),
        ("lse", (Use("F, A", "writes", "(B, H, Tq) each row's log-sum-exp of the masked, "
                                       "scaled scores (-inf: fully masked row)"),
                 Use("B", "reads", "(B, H, Tq) as F kept it, required"),
                 Use("AB", "reads", "(B, H, Tq) as A made it, or NULL to have it recomputed"))))]
    + [Field(n, "const void *", _PROJ, u) for n, u in _io("F, B, P", "reads",
        ("x", "(B, Tq, Din)"), ("key", "(B, Tk, Dkin)"), ("value", "(B, Tk, Dvin)"),
        ("wq", "(Din, Sq)"), ("wk", "(Dkin, Sk)"), ("wv", "(Dvin, Sv)"))]
    + [Field("wo", "const void *", _PROJ,
             (Use("F, B", "reads", "(Svq, Dout), or NULL without W^O"),))]
    + [Field(n, "const void *", _PROJ, u) for n, u in _io("F, P", "reads",
        ("bq", "(Sq,) or NULL (zero)"), ("bk", "(Sk,) or NULL (zero)"),
        ("bv", "(Sv,) or NULL (zero)"))]
    + [Field("bo", "const void *", _PROJ, (Use("F", "reads", "(Dout,) or NULL (zero)"),)),
       Field("wgate", "const void *", _PROJ, (Use("F, B", "reads",
             "(Din, Svq) the output gate's weight: W^O reads sigmoid(x wgate + bgate) "
             "* concat; NULL: no gate"),)),
       Field("bgate", "const void *", _PROJ, (Use("F, B", "reads",
             "(Svq,) the gate's bias, or NULL (zero); only with wgate"),)),
       Field("w_storage", "mha_kv_storage", _PROJ, (Use("F", "reads",
             "what wq, wk, wv, wo, wgate hold: MHA_KV_PLAIN (0), elements of dtype; or, with "
             "dtype MHA_DTYPE_F32, MHA_KV_F16 or _BF16 (uint16_t bits), widened to "
             "float32 as the forward packs them (mha.h); every other operation needs "
             "MHA_KV_PLAIN"),)),
       Field("dout", "const void *", _GRADS, (Use("B", "reads", "(B, Tq, Dout)"),
                                              Use("AB", "reads", "(B, Tq, Svq)")))]
    + [Field(n, "void *", _GRADS, u) for n, u in _io("B", "writes",
        ("dx", "(B, Tq, Din)"), ("dkey", "(B, Tk, Dkin)"), ("dvalue", "(B, Tk, Dvin)"),
        ("dwq", "(Din, Sq)"), ("dwk", "(Dkin, Sk)"), ("dwv", "(Dvin, Sv)"),
        ("dwo", "(Svq, Dout)"), ("dbq", "(Sq,)"), ("dbk", "(Sk,)"), ("dbv", "(Sv,)"),
        ("dbo", "(Dout,)"), ("dwgate", "(Din, Svq), with wgate"),
        ("dbgate", "(Svq,), with wgate"))]
    + [Field(n, "void *", _GRADS, u) for n, u in _io("AB", "writes",
        ("dq", "(B, Tq, Sq)"), ("dk", "(B, Tk, Sk)"), ("dv", "(B, Tk, Sv)"))]
    + [Field("dsinks", "void *", _GRADS, (Use("B, AB", "writes", "(H,), with cfg->sinks"),))]
    + [Field("drel_table", "void *", _GRADS, (Use("B, AB", "writes",
        "(rel_buckets, H), with cfg->rel_table: dL/d(rel_table)"),))]
    + [Field("dmask", "void *", _GRADS, (Use("B, AB", "writes",
        "(B, H, Tq, Tk), with an additive mask: dL/d(mask) at each (b, h, i, j), "
        "before the mask's broadcast (0 where the row does not see the key)"),))]
    + [Field(n, "void *", _GRADS, u) for n, u in _io("B", "writes",
        ("dq_norm", "shaped as cfg->q_norm"), ("dk_norm", "shaped as cfg->k_norm"))]
    + [Field(n, "mha_strides", _STR, u) for n, u in _io("A", "reads",
        ("sq", "the strides of q"), ("sk", "those of k"), ("sv", "those of v"),
        ("so", "those of out"))]
    + [Field("kv_storage", "mha_kv_storage", _KV, (Use("A", "reads",
             "what k and v hold: MHA_KV_PLAIN (0), elements of dtype; or, with dtype "
             "MHA_DTYPE_F32, MHA_KV_F16, _BF16 (uint16_t bits) or _I8 (int8_t, with "
             "k_scale and v_scale), widened to float32 as the kernels read them"),))]
    + [Field(n, "const void *", _KV, u) for n, u in _io("A", "reads",
        ("k_scale", "(B, G, Tk) float at strides sks, with MHA_KV_I8: key (b, g, j) "
                    "is k_scale[..] * its int8 values"),
        ("v_scale", "(B, G, Tk) float at strides svs, likewise for v"))]
    + [Field(n, "mha_strides", _KV, u) for n, u in _io("A", "reads",
        ("sks", "the strides of k_scale (st: between keys)"),
        ("svs", "those of v_scale"))])


# mha_field (csrc/mha.h), the ids by which mha_error names what a rejected
# call got wrong, in order: (id, the mha_config fields it stands for, doc).
# The first four name other parts of a call; a rule that ties two fields
# names the one it constrains (core/config.c, where each rule is checked).
MHA_FIELDS = (
    ("NONE", "", "no error"),
    ("CALL", "", "a NULL config, layout or params"),
    ("DTYPE", "", "mha_params.dtype"),
    ("PARAMS", "", "a buffer or the strides of mha_params; the message names which"),
    ("B", "B", ""), ("TQ", "Tq", ""), ("TK", "Tk", ""), ("DIN", "Din", ""),
    ("DKIN", "Dkin", ""), ("DVIN", "Dvin", ""), ("DOUT", "Dout", ""), ("H", "H", ""),
    ("G", "G", ""), ("DK", "dk", ""), ("DV", "dv", ""), ("SCALE", "scale", ""),
    ("MASK_KIND", "mask_kind", ""), ("MASK", "mask", ""),
    ("KEY_LENGTHS", "key_lengths", ""),
    ("WINDOW", "windowed, window_left, window_right", ""), ("CHUNK", "chunk", ""),
    ("Q_OFFSET", "has_q_offset, q_offset", ""),
    ("BLOCK_MASK", "bm_block, bm_bits, bm_bq, bm_bk, bm_bstride, bm_hstride, bm_npartial",
     ""),
    ("SOFTCAP", "softcap", ""), ("ALIBI", "alibi", ""),
    ("ALIBI_BSTRIDE", "alibi_bstride", ""), ("DROPOUT", "dropout", ""),
    ("DROPOUT_SEED", "dropout_seed", ""), ("REL_TABLE", "rel_table", ""),
    ("REL_BUCKETS", "rel_buckets, rel_bidirectional", ""),
    ("REL_MAX_DISTANCE", "rel_max_distance", ""), ("NSEQ", "nseq", ""), ("CU_Q", "cu_q", ""),
    ("CU_K", "cu_k", ""), ("Q_NORM", "q_norm", ""), ("K_NORM", "k_norm", ""),
    ("Q_NORM_HSTRIDE", "q_norm_hstride", ""), ("K_NORM_HSTRIDE", "k_norm_hstride", ""),
    ("NORM_EPS", "norm_eps", ""), ("NORM_TYPE", "norm_type", ""),
    ("ROTARY_DIM", "rotary_dim", ""),
    ("ROPE_INTERLEAVED", "rope_interleaved", ""), ("INV_FREQ", "inv_freq", ""),
    ("POSITIONS_BSTRIDE", "positions_bstride", ""),
    ("KEY_POSITIONS_BSTRIDE", "key_positions_bstride", ""),
    ("LENGTHS_ALIGNED", "lengths_aligned", ""),
    ("BLOCK_TABLE", "block_table, pages_per_seq, num_pages", ""),
    ("PAGE_SIZE", "page_size", ""),
)



def field_name(fid: str, fields: str) -> str:
    """The name a rejection's ``field`` attribute gives an mha_field id (the
    glue's mha_field_names, args_gen.c): its one mha_config field
    ("Tq", "key_lengths"), else the id in lower case ("window" for
    windowed, window_left, window_right; "params"), "" for NONE."""
    if fid == "NONE":
        return ""
    return fields if fields and "," not in fields else fid.lower()


ARGS = PUBLIC_ARGS + C_ARGS


def arg(entry: str, name: str) -> Arg:
    """The one record of ``name`` that ``entry`` takes."""
    found = [a for a in ARGS if a.name == name and entry in a.takes]
    if len(found) != 1:
        raise LookupError(f"{entry}: {len(found)} records of argument {name!r}")
    return found[0]


def params(entry: str):
    """``entry``'s parameters in order, as (record, kind) with kind one of
    "positional_only", "positional_or_keyword", "keyword_only" and
    "var_keyword" (inspect.Parameter's kinds, lower case)."""
    kind, out = "positional_or_keyword", []
    for n in (n.strip() for n in ENTRIES[entry].params.split(",")):
        if n == "/":
            out = [(a, "positional_only") for a, _ in out]
        elif n == "*":
            kind = "keyword_only"
        elif n.startswith("**"):
            out.append((arg(entry, n[2:]), "var_keyword"))
        elif n:
            out.append((arg(entry, n), kind))
    return out
