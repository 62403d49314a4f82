"""Each rule is checked once, so a violation gets one message everywhere
(issue 34 item 3).

A table of violations, each run through every public entry point that takes
the argument: multi_head_attention, multi_head_attention_grad, the cached
decode step (multi_head_attention(..., cache=)) and KVCache.append,
pack_weights, the MultiHeadAttention layer (its constructor and its call),
attention and attention_grad. Every entry point must raise the same
exception type with the same message, once the names of the projected-tensor
API (attention, attention_grad: "k", "q's heads", "k's heads", see
mhattn._internal.fields) are mapped to the layer's (num_kv_heads, num_heads).
Each message must also name the argument and the values it saw.
"""
import re

import numpy as np
import pytest

import mhattn

rng = np.random.default_rng(34)
B, T, D = 2, 3, 12


def _r(*shape):
    return rng.standard_normal(shape)


X = _r(B, T, D)
G_OUT = _r(B, T, D)
Z3 = np.ones((2, D, 0))


def _layer_weights(H, G, d=2):
    """(w_q, w_k, w_v, w_o) fused, for H query heads, G kv heads of width d."""
    return _r(D, H * d), _r(D, G * d), _r(D, G * d), _r(H * d, D)


def _qkv(H, G, d=2, Tk=T):
    return _r(B, H, T, d), _r(B, G, Tk, d), _r(B, G, Tk, d)


# --- the entry points, each a function of the violation's keywords ----------
# `heads` (H, G) is the call's head counts; `kw` the keywords under test.

def _mha(H, G, kw):
    w = _layer_weights(H, G)
    return mhattn.multi_head_attention(X, *w, num_heads=H, num_kv_heads=G, **kw)


def _grad(H, G, kw):
    w = _layer_weights(H, G)
    return mhattn.multi_head_attention_grad(G_OUT, X, *w, num_heads=H, num_kv_heads=G, **kw)


def _decode(H, G, kw):
    w = _layer_weights(H, G)
    cache = mhattn.KVCache(B, G, 8, 2, dtype=np.float64)
    return mhattn.multi_head_attention(X[:, :1], *w, num_heads=H, num_kv_heads=G,
                                       cache=cache, **kw)


def _pack(H, G, kw):
    return mhattn.pack_weights(*_layer_weights(H, G), num_heads=H, num_kv_heads=G, **kw)


def _layer_new(H, G, kw):
    return mhattn.MultiHeadAttention(D, H, num_kv_heads=G, d_k=2, dtype=np.float64, **kw)


def _layer_call(H, G, kw):
    layer = mhattn.MultiHeadAttention(D, H, num_kv_heads=G, d_k=2, dtype=np.float64,
                                      seed=0)
    return layer(X, **kw)


def _packed_call(H, G, kw):
    packed = mhattn.pack_weights(*_layer_weights(H, G), num_heads=H, num_kv_heads=G)
    return mhattn.multi_head_attention(X, packed, **kw)


def _attention(H, G, kw):
    return mhattn.attention(*_qkv(H, G), **kw)


def _attention_grad(H, G, kw):
    q, k, v = _qkv(H, G)
    return mhattn.attention_grad(_r(B, H, T, 2), q, k, v, **kw)


def _layer_owned(H, G, kw):
    """The layer's own norm_eps / sinks, given to its constructor, used by its call."""
    layer = mhattn.MultiHeadAttention(D, H, num_kv_heads=G, d_k=2, dtype=np.float64,
                                      qk_norm=True, seed=0, **kw)
    return layer(X)


# Packed sequences: 2-D x (total, d_in), unbatched q, k, v (heads, total, d).
XP = _r(T, D)


def _mha_packed(H, G, kw):
    w = _layer_weights(H, G)
    return mhattn.multi_head_attention(XP, *w, num_heads=H, num_kv_heads=G, **kw)


def _grad_packed(H, G, kw):
    w = _layer_weights(H, G)
    return mhattn.multi_head_attention_grad(_r(T, D), XP, *w, num_heads=H,
                                            num_kv_heads=G, **kw)


def _layer_packed(H, G, kw):
    layer = mhattn.MultiHeadAttention(D, H, num_kv_heads=G, d_k=2, dtype=np.float64,
                                      seed=0)
    return layer(XP, **kw)


def _attention_packed(H, G, kw):
    return mhattn.attention(_r(H, T, 2), _r(G, T, 2), _r(G, T, 2), **kw)


def _attention_grad_packed(H, G, kw):
    return mhattn.attention_grad(_r(H, T, 2), _r(H, T, 2), _r(G, T, 2), _r(G, T, 2), **kw)


def _reference_packed(H, G, kw):
    w = _layer_weights(H, G)
    return mhattn.reference.multi_head_attention(XP, *w, num_heads=H, num_kv_heads=G, **kw)


PACKED = {"reference": _reference_packed, "multi_head_attention": _mha_packed, "multi_head_attention_grad": _grad_packed,
          "layer": _layer_packed, "attention": _attention_packed,
          "attention_grad": _attention_grad_packed}


def _append(H, G, kw):
    cache = mhattn.KVCache(B, G, 8, 2, dtype=np.float64)
    return cache.append(_r(B, G, 2, 2), _r(B, G, 2, 2), **kw)


def _trace(H, G, kw):
    w = _layer_weights(H, G)
    return mhattn.trace(X, *w, num_heads=H, num_kv_heads=G, **kw)


def _reference(H, G, kw):
    w = _layer_weights(H, G)
    return mhattn.reference.multi_head_attention(X, *w, num_heads=H, num_kv_heads=G, **kw)


def _decode_all(H, G, kw):
    """A cached prefill of all of X: the gate's messages name x's shape."""
    w = _layer_weights(H, G)
    cache = mhattn.KVCache(B, G, 8, 2, dtype=np.float64)
    return mhattn.multi_head_attention(X, *w, num_heads=H, num_kv_heads=G, cache=cache, **kw)


def _layer_gated(H, G, kw):
    """A gated layer whose gate's arrays (plain attributes) are kw's."""
    layer = mhattn.MultiHeadAttention(D, H, num_kv_heads=G, d_k=2, d_v=2, dtype=np.float64,
                                      gate=True, seed=0)
    for name, value in kw.items():
        setattr(layer, name, value)
    return layer(X)


# The learner's tools read a call's values in Python (the reference, the
# trace): the core checks their configs too (mhattn._internal.core.check_config).
LAYER = {"multi_head_attention": _mha, "multi_head_attention_grad": _grad,
         "decode": _decode, "layer": _layer_call, "packed": _packed_call,
         "trace": _trace, "reference": _reference}
HEADS_ONLY = {"pack_weights": _pack, "MultiHeadAttention": _layer_new}
ATTENTION = {"attention": _attention, "attention_grad": _attention_grad}
EVERY_CALL = {**LAYER, **ATTENTION}
# The decode step attends to the cache's keys: no mask, key_lengths, key_mask.
NOT_CACHED = {e: f for e, f in EVERY_CALL.items() if e != "decode"}
# The layer owns its sinks and norms: its call does not take them.
NOT_OWNED = {e: f for e, f in EVERY_CALL.items() if e != "layer"}

# The output gate (issue 38, item 4): the layer family's entry points take
# w_gate and b_gate, the layer holds its own (its call refuses them).
GATED = {"multi_head_attention": _mha, "multi_head_attention_grad": _grad,
         "decode": _decode_all, "packed": _packed_call, "trace": _trace,
         "reference": _reference, "layer": _layer_gated}
W_GATE = _r(D, 4)          # (d_in, sum d_v) of two heads of width 2

# The projected-tensor API's names for the layer's (mhattn._internal.fields).
ATTENTION_WORDS = {"q's heads": "num_heads", "k's heads": "num_kv_heads"}

# violation -> ((H, G), keywords, entry points, words the message must hold)
VIOLATIONS = {
    "kv_heads_not_dividing": (
        (6, 4), {}, {**EVERY_CALL, **HEADS_ONLY},
        ["num_kv_heads: ", "num_heads = 6", "num_kv_heads = 4"]),
    "kv_heads_more_than_heads": (
        (2, 4), {}, {**EVERY_CALL, **HEADS_ONLY},
        ["num_kv_heads: ", "num_heads = 2", "num_kv_heads = 4"]),
    "softcap_negative": ((2, 2), dict(softcap=-1.0), EVERY_CALL, ["softcap", "-1"]),
    "softcap_nan": ((2, 2), dict(softcap=float("nan")), EVERY_CALL, ["softcap", "nan"]),
    "softcap_inf": ((2, 2), dict(softcap=float("inf")), EVERY_CALL, ["softcap", "inf"]),
    "window_negative": ((2, 2), dict(window=(-1, 0)), EVERY_CALL, ["window", "-1"]),
    "window_three": ((2, 2), dict(window=(1, 2, 3)), EVERY_CALL, ["window", "3"]),
    "sinks_shape": ((2, 2), dict(sinks=np.zeros(3)), NOT_OWNED, ["sinks", "(3,)"]),
    "key_lengths_above": ((2, 2), dict(key_lengths=np.array([1, 9])), NOT_CACHED,
                          ["key_lengths", "9"]),
    "key_lengths_negative": ((2, 2), dict(key_lengths=np.array([-1, 2])), NOT_CACHED,
                             ["key_lengths", "-1"]),
    "mask_shape": ((2, 2), dict(mask=np.ones((5, 5), bool)), NOT_CACHED,
                   ["mask", "(5, 5)"]),
    "alibi_shape": ((2, 2), dict(alibi_slopes=np.ones(3)), EVERY_CALL,
                    ["alibi_slopes", "(3,)"]),
    # the slopes' values are the core's (precision_check), NaN and inf too
    "alibi_inf": ((2, 2), dict(alibi_slopes=np.array([np.inf, 0.5])), EVERY_CALL,
                  ["alibi_slopes: ", "alibi[0] = inf: expected a finite slope"]),
    "alibi_nan": ((2, 2), dict(alibi_slopes=np.array([0.5, np.nan])), EVERY_CALL,
                  ["alibi_slopes: ", "alibi[1] = nan: expected a finite slope"]),
    "key_mask_shape": ((2, 2), dict(key_mask=np.ones((2, 7), bool)), NOT_CACHED,
                       ["key_mask", "(2, 7)"]),
    "norm_eps_negative": ((2, 2), dict(norm_eps=-1.0, q_norm=np.ones(2)),
                          {e: f for e, f in LAYER.items() if e != "layer"},
                          ["norm_eps", "-1"]),
    "norm_eps_nan": ((2, 2), dict(norm_eps=float("nan"), q_norm=np.ones(2)),
                     {e: f for e, f in LAYER.items() if e != "layer"},
                     ["norm_eps", "nan"]),
    "norm_eps_of_the_layer": ((2, 2), dict(norm_eps=-1.0),
                              {"multi_head_attention": lambda H, G, kw: _mha(
                                  H, G, dict(kw, q_norm=np.ones(2))),
                               "layer": _layer_owned},
                              ["norm_eps", "-1"]),
    # norm_type's names are the core's: the layer's constructor asks it too
    "norm_type_unknown": ((2, 2), dict(norm_type="batch"),
                          {**{e: f for e, f in LAYER.items() if e != "layer"},
                           "MultiHeadAttention": _layer_new},
                          ["norm_type: ", '"batch"', '"rms"', '"layer"']),
    "rotary_dim_wider_than_heads": ((2, 2), dict(rope=mhattn.RoPE(rotary_dim=4)), LAYER,
                                    ["rotary_dim", "4", "2"]),
    "rotary_dim_odd": ((2, 2), dict(rope=mhattn.RoPE(rotary_dim=1)), LAYER,
                       ["rotary_dim", "1", "odd"]),
    "rotary_dim_odd_heads": ((2, 2), dict(rope=mhattn.RoPE()),
                             {"multi_head_attention": lambda H, G, kw:
                                 mhattn.multi_head_attention(X, _r(D, 6), _r(D, 6), _r(D, 6),
                                                             num_heads=2, **kw),
                              "trace": lambda H, G, kw: mhattn.trace(
                                 X, _r(D, 6), _r(D, 6), _r(D, 6), num_heads=2, **kw)},
                             ["rotary_dim", "3", "odd"]),
    # Stacked (heads, d_in, 0) weights: two heads of width 0.
    "head_width_zero": ((2, 2), {}, {
        "multi_head_attention": lambda H, G, kw: mhattn.multi_head_attention(
            X, Z3, Z3, _r(2, D, 2), num_heads=2),
        "multi_head_attention_grad": lambda H, G, kw: mhattn.multi_head_attention_grad(
            G_OUT[..., :4], X, Z3, Z3, _r(2, D, 2), num_heads=2),
        "pack_weights": lambda H, G, kw: mhattn.pack_weights(
            Z3, Z3, _r(2, D, 2), num_heads=2),
        "trace": lambda H, G, kw: mhattn.trace(
            X, Z3, Z3, _r(2, D, 2), num_heads=2),
        "reference": lambda H, G, kw: mhattn.reference.multi_head_attention(
            X, Z3, Z3, _r(2, D, 2), num_heads=2)},
        ["w_q / w_k", "d_k[0] = 0", "column wide"]),
    "cu_seqlens_decreasing": ((2, 2), dict(cu_seqlens=[0, 2, 1, 3]), PACKED,
                              ["cu_seqlens", "2", "1"]),
    "cu_seqlens_start": ((2, 2), dict(cu_seqlens=[1, 3]), PACKED, ["cu_seqlens", "1"]),
    "cu_seqlens_end": ((2, 2), dict(cu_seqlens=[0, 2]), PACKED, ["cu_seqlens", "2", "3"]),
    # Only Python sees per-head weights: the layer family's rule, one message.
    "head_widths_q_k": ((2, 2), dict(w_k=_r(D, 6)),
                        {"multi_head_attention": lambda H, G, kw: mhattn.multi_head_attention(
                            X, _r(D, 4), kw["w_k"], _r(D, 4), num_heads=2),
                         "multi_head_attention_grad": lambda H, G, kw:
                            mhattn.multi_head_attention_grad(G_OUT[..., :4], X, _r(D, 4),
                                                             kw["w_k"], _r(D, 4), num_heads=2),
                         "pack_weights": lambda H, G, kw: mhattn.pack_weights(
                            _r(D, 4), kw["w_k"], _r(D, 4), num_heads=2)},
                        ["w_q / w_k", "width 2", "width 3"]),
    "lengths_in_append": ((2, 2), dict(lengths=np.array([3, 1])), {"append": _append},
                          ["lengths", "3"]),
    # the output gate: each message names the argument and the shapes it saw
    "w_gate_shape": ((2, 2), dict(w_gate=np.ones((D, 5))), GATED,
                     ["w_gate: ", "expected shape (12, 4)", "x (2, 3, 12)", "got (12, 5)"]),
    "w_gate_rank": ((2, 2), dict(w_gate=np.ones(4)), GATED,
                    ["w_gate: ", "expected shape (12, 4)", "got (4,)"]),
    "b_gate_shape": ((2, 2), dict(w_gate=W_GATE, b_gate=np.ones((1, 4))), GATED,
                     ["b_gate: ", "expected shape (4,)", "w_gate (12, 4)", "got (1, 4)"]),
    "b_gate_without_w_gate": ((2, 2), dict(w_gate=None, b_gate=np.ones(4)), GATED,
                              ["b_gate: ", "(shape (4,)) without w_gate", "(12, 4)"]),
    "w_gate_complex": ((2, 2), dict(w_gate=np.ones((D, 4), complex)), GATED,
                       ["w_gate: ", "complex128"]),
    "b_gate_object": ((2, 2), dict(w_gate=W_GATE, b_gate=np.ones(4, object)), GATED,
                      ["b_gate: ", "object"]),
    "w_gate_float16_in_float64_call": ((2, 2), dict(w_gate=W_GATE.astype(np.float16)),
                                       GATED, ["x: dtype float64", "w_gate's float16"]),
}


# The rules the core checks (mha_check_config): their errors carry the
# core's field, so no layer above re-checked them first.
CORE_RULES = {"kv_heads_not_dividing", "kv_heads_more_than_heads", "softcap_negative",
              "alibi_inf", "alibi_nan",
              "softcap_nan", "softcap_inf", "key_lengths_above", "key_lengths_negative",
              "norm_eps_negative", "norm_eps_nan", "norm_eps_of_the_layer", "norm_type_unknown",
              "rotary_dim_wider_than_heads", "rotary_dim_odd", "rotary_dim_odd_heads",
              "head_width_zero", "cu_seqlens_decreasing", "cu_seqlens_start",
              "cu_seqlens_end"}


def _message(fn, H, G, kw):
    with pytest.raises(Exception) as info:
        fn(H, G, kw)
    return type(info.value), str(info.value), getattr(info.value, "field", None)


def _as_layer(entry, msg):
    if entry in ATTENTION:
        if msg.startswith("k: "):
            msg = "num_kv_heads: " + msg[3:]
        for theirs, ours in ATTENTION_WORDS.items():
            msg = msg.replace(theirs, ours)
    return msg


@pytest.mark.parametrize("name", sorted(VIOLATIONS))
def test_one_message_everywhere(name):
    (H, G), kw, entries, words = VIOLATIONS[name]
    seen = {e: _message(fn, H, G, kw) for e, fn in entries.items()}
    kinds = {e: t for e, (t, _, _) in seen.items()}
    assert len(set(kinds.values())) == 1, f"{name}: different exception types {kinds}"
    if name in CORE_RULES:
        fields = {e: f for e, (_, _, f) in seen.items()}
        assert all(fields.values()), f"{name}: not the core's rejection in {fields}"
    messages = {e: _as_layer(e, m) for e, (_, m, _) in seen.items()}
    first = next(iter(messages.values()))
    differ = {e: m for e, m in messages.items() if m != first}
    assert not differ, (f"{name}: the same violation, different messages:\n" +
                        "\n".join(f"  {e}: {m}" for e, m in messages.items()))
    for w in words:
        assert w in first, f"{name}: {w!r} not in {first!r}"


def test_core_rejection_names_the_field():
    """The glue's ValueError of a core rejection carries the field, which the
    door to _C maps to the user's argument (mhattn._internal.fields)."""
    with pytest.raises(ValueError) as info:
        _mha(6, 4, {})
    assert info.value.field == "G"
    assert re.fullmatch(r"num_kv_heads: num_heads = 6 is not a multiple of "
                        r"num_kv_heads = 4", str(info.value))
    with pytest.raises(ValueError) as info:
        _attention(6, 4, {})
    assert str(info.value) == "k: q's heads = 6 is not a multiple of k's heads = 4"


def test_every_field_has_a_users_name():
    """Each family names every field the core can reject (schema.MHA_FIELDS,
    but those of no argument: NONE, CALL, DTYPE, PARAMS); the fields every
    family names alike come from the schema's records, not a second list."""
    from mhattn._internal import fields, schema
    ids = {schema.field_name(fid, f) for fid, f, _ in schema.MHA_FIELDS} - {
        "", "call", "dtype", "params"}
    # attention() has no projections: its Din, Dkin, Dvin, Dout are 0.
    projections = {"Din", "Dkin", "Dvin", "Dout"}
    for names, want in ((fields.LAYER, ids), (fields.ATTENTION, ids - projections)):
        assert want <= set(names.argument), want - set(names.argument)
    derived = fields.schema_arguments()
    assert derived["cu_k"] == "key_cu_seqlens" and derived["mask_kind"] == "mask"
    for names in (fields.LAYER, fields.ATTENTION):
        assert all(names.argument[f] == a for f, a in derived.items())
