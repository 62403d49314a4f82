"""The core's rejections in the user's words.

The C core checks every rule about a call's config once (csrc/core/config.c,
``mha_check_config``) and says which field is wrong and why, in its own
letters: "H = 6 is not a multiple of G = 4". The glue raises that as a
``ValueError("mhattn: <message>")`` whose ``field`` attribute is the field's
name (csrc/python/call.c, ``raise_rejection``). The door to ``_C``
(:mod:`mhattn._internal.core`) hands such an error to :func:`user_error`,
which names the argument the user passed instead: the message starts with
that argument, and the core's letters become the user's names, by family of
entry points:

- ``LAYER``: ``multi_head_attention``, its gradient, ``KVCache`` and the
  cached decode step, ``pack_weights``, ``MultiHeadAttention``; a user gave
  ``num_heads`` and ``num_kv_heads``:
  "num_kv_heads: num_heads = 6 is not a multiple of num_kv_heads = 4".
- ``ATTENTION``: ``attention`` and ``attention_grad`` on projected q, k, v;
  the head counts are the arrays' heads axes:
  "k: q's heads = 6 is not a multiple of k's heads = 4".

Errors without a ``field`` (the glue's own checks of dtypes and shapes,
which name their argument already) pass through unchanged.
"""
from __future__ import annotations

import re
from typing import Dict, NamedTuple

from . import schema

__all__ = ["Names", "LAYER", "ATTENTION", "user_error", "schema_arguments"]


class Names(NamedTuple):
    """How one family of entry points names the core's fields and letters."""
    argument: Dict[str, str]   # mha_field name -> the public argument it comes from
    letters: Dict[str, str]    # a letter of the core's messages -> the user's word


# The variants' own RoPE item is the user's rope= (a mhattn.RoPE holds it).
_VARIANT_ARGUMENT = {"interleaved": "rope"}


def _split(fields: str) -> set:
    return {f.strip() for f in fields.split(",") if f.strip()}


def schema_arguments() -> Dict[str, str]:
    """mha_field name -> the public argument it comes from, for the fields
    every family of entry points names alike, read off the schema: a field
    of the variants' tuple is the variant's (schema.VARIANTS: its mha_config
    fields), one of the glue's mask, key-length and block-table arguments is that
    argument's (schema.C_ARGS' ``c_field``). The sizes and head counts are
    each family's own (LAYER, ATTENTION)."""
    out = {}
    for fid, fields, _ in schema.MHA_FIELDS:
        cfg = _split(fields)
        name = schema.field_name(fid, fields)
        for vname, _k, _d, _s, vfields, _doc in schema.VARIANTS:
            if cfg & _split(vfields):
                out[name] = _VARIANT_ARGUMENT.get(vname, vname)
                break
        else:
            for a in schema.C_ARGS:
                if a.c_kind in ("ARG_MASK", "ARG_LENGTHS", "ARG_BOOL",
                                "ARG_BLOCK_TABLE") and cfg & _split(a.c_field):
                    out[name] = a.name
                    break
    return out


_SAME = schema_arguments()
_LETTERS = {"Tq": "T_q", "Tk": "T_k", "cu_q": "cu_seqlens", "cu_k": "key_cu_seqlens"}

LAYER = Names(
    argument={**_SAME, "scale": "scale", "H": "num_heads", "G": "num_kv_heads", "dk": "w_q / w_k", "dv": "w_v",
              "Din": "x", "Dkin": "key", "Dvin": "value", "Dout": "w_o", "B": "x",
              "Tq": "x", "Tk": "key"},
    letters={**_LETTERS, "H": "num_heads", "G": "num_kv_heads", "dk": "d_k",
             "dv": "d_v"})

ATTENTION = Names(
    argument={**_SAME, "scale": "scale", "H": "q", "G": "k", "dk": "k", "dv": "v", "B": "q", "Tq": "q",
              "Tk": "k"},
    letters={**_LETTERS, "H": "q's heads", "G": "k's heads", "dk": "d_k", "dv": "d_v"})

_LETTER = re.compile(r"\b(Tq|Tk|cu_q|cu_k|H|G|dk|dv)\b")


def user_error(err: ValueError, names: Names) -> ValueError:
    """The core's rejection ``err`` (it has ``.field``) as the user should
    read it: "<argument>: <the core's message in the user's names>"."""
    field = err.field
    if not field:   # a field the glue has no name for: the core's words as they are
        return err
    msg = str(err)
    if msg.startswith("mhattn: "):
        msg = msg[len("mhattn: "):]
    msg = _LETTER.sub(lambda m: names.letters[m.group(1)], msg)
    out = ValueError(f"{names.argument.get(field, field)}: {msg}")
    out.field = field
    return out
