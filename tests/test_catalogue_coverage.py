"""Every public entry point has cases in the bad-input catalogue.

The entry points are read from ``mhattn.__all__`` (and from
``mhattn.reference.__all__``): each function, each class's constructor and
each public method (``__call__`` included) of a class of mhattn that takes
something from its caller, i.e. has a parameter besides self or cls; and
the modes of multi_head_attention that are entry points of their own
(catalogue_cases.MODES: the cached step, packed weights). Each must be
named (``entry=``) by at least one case of tests/catalogue_cases.py, and
tests/test_catalogue.py checks that a case calls what it names. Each
variant keyword (window, ..., key_positions), and each keyword of the output
gate (w_gate, b_gate, the layer's gate), of each entry point whose signature
has it must have a case whose message names it first; so must the glue's
wgate and bgate on _C.forward and _C.backward.

What is not an entry point, or has no case yet, is said below by name with
the reason; every line is checked against mhattn, so a new function, class
or method fails here until it has cases or a line.
"""
import inspect
import os
import sys

import numpy as np
import pytest

import mhattn
from mhattn import _C

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import catalogue_cases  # noqa: E402

# The names of mhattn.__all__ that are not callable.
NOT_CALLABLE = {
    "reference": "the reference module: its functions are the entry points "
                 "'reference.<name>'",
}

# Callables that take nothing from their caller (no parameter but self).
TAKES_NOTHING = {
    "worked_example", "get_isa", "get_num_threads",
    "PackedWeights.arguments", "KVCache.reset", "BlockMask.to_dense",
    "PagedKVCache.add_sequence", "MultiHeadAttention.weights",
    "MultiHeadAttention.arguments", "MultiHeadAttention.state_dict",
    "MultiHeadAttention.to_torch", "Trace.to_dict", "Trace.keys", "MultiHeadAttention.eval",
}

# Callables whose arguments no caller makes: mhattn hands them its own.
NOT_CALLER_DATA = {
    "Context": "made by multi_head_attention(..., return_context=True) from the "
               "checked call; callers pass it on to mhattn.backward, which checks it",
    "Trace.from_call": "takes the internal Call of a checked call (mhattn.trace's)",
    "reference.allowed_keys": "takes the internal Call of a checked call",
    "reference.head_intermediates": "takes the internal Call of a checked call",
    "reference.head_scores": "takes the internal Call of a checked call",
}
# The reference's steps: the document's equations in plain NumPy, on arrays
# that its entry points (multi_head_attention, lse, projected_attention)
# have checked; they check nothing themselves.
REFERENCE_STEPS = ("softmax", "log_sum_exp", "attention", "score_steps", "weighted_values",
                   "rms_norm", "layer_norm", "rope", "softcap", "alibi_bias", "dropout_keep",
                   "relative_position_bucket", "relative_bias")
NOT_CALLER_DATA.update({f"reference.{n}": "a step of the document, checking nothing"
                        for n in REFERENCE_STEPS})

# Entry points with no case yet: every hostile argument tried escapes as an
# error that does not name it (the report); their cases come with
# the fix.
KNOWN_GAPS: dict = {}   # issue 35 closed the last three (RoPE.frequencies,
                        # Trace.shape_of, MultiHeadAttention.reset_parameters)

# The variants' keywords: each entry point that takes one has a case naming it.
VARIANTS = ("window", "softcap", "alibi_slopes", "sinks", "key_mask", "cu_seqlens",
            "key_cu_seqlens", "q_norm", "k_norm", "norm_eps", "norm_type", "rope",
            "positions", "key_positions", "dropout", "seed", "relative_bias", "chunk",
            "block_mask", "q_offset")
# The output gate's keywords (issue 38, item 4), held to the same rule.
GATE = ("w_gate", "b_gate", "gate")
# The glue's names of the gate: keyword-only arguments of these builtins.
GLUE_GATE = {"_C.forward": ("wgate", "bgate"), "_C.backward": ("wgate", "bgate")}


def _takes_something(fn) -> bool:
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.name not in ("self", "cls")]
    return bool(params)


def _own_methods(cls):
    """(name, function) of the public methods mhattn defines on cls."""
    for klass in cls.__mro__:
        for name, attr in vars(klass).items():
            if name.startswith("_") and name != "__call__":
                continue
            fn = getattr(attr, "__func__", attr)
            if inspect.isfunction(fn) and fn.__module__.startswith("mhattn"):
                yield name, getattr(cls, name)


def callables():
    """{entry name: callable} of every public callable: mhattn.__all__'s
    functions, classes and their methods, and the reference's functions
    (those that are not mhattn's own under another name)."""
    found = {}
    for name in mhattn.__all__:
        obj = getattr(mhattn, name)
        if not callable(obj):
            continue
        found[name] = obj
        if inspect.isclass(obj):
            for m, fn in _own_methods(obj):
                found[f"{name}.{m}"] = fn
    top = {id(getattr(mhattn, n)) for n in mhattn.__all__}
    for name in mhattn.reference.__all__:
        obj = getattr(mhattn.reference, name)
        if id(obj) not in top:
            found[f"reference.{name}"] = obj
    return found


def entry_points():
    """The entry points that need cases: {name: callable}."""
    need = {n: f for n, f in callables().items()
            if n not in TAKES_NOTHING and n not in NOT_CALLER_DATA and n not in KNOWN_GAPS}
    need.update({m: catalogue_cases.entry_function(m) for m in catalogue_cases.MODES})
    return need


def cases_by_entry(entry_of=None):
    """{entry name: [case names]} from catalogue_cases.ENTRY (or entry_of)."""
    by = {}
    for case, entries in (entry_of or catalogue_cases.ENTRY).items():
        for e in entries:
            by.setdefault(e, []).append(case)
    return by


def uncovered(entry_of=None):
    by = cases_by_entry(entry_of)
    return sorted(n for n in entry_points() if not by.get(n))


def test_every_entry_point_has_cases():
    missing = uncovered()
    assert not missing, (f"public entry points without a case in tests/catalogue_cases.py: "
                         f"{missing}; add cases (entry=...) or a line above saying why not")


def test_coverage_can_fail():
    """Without attention's cases, attention is reported uncovered."""
    entry_of = {c: e for c, e in catalogue_cases.ENTRY.items() if "attention" not in e}
    assert "attention" in uncovered(entry_of)
    assert "attention" not in uncovered()


def first_words(entry_of=None):
    """{entry name: the first words of the messages its raising cases expect}."""
    firsts = {}
    for case, entries in (entry_of or catalogue_cases.ENTRY).items():
        expect = catalogue_cases.CASES[case][1]
        if expect != catalogue_cases.OK and expect[2]:
            for e in entries:
                firsts.setdefault(e, set()).add(expect[2][0])
    return firsts


def keywords_without_a_case(keywords, entry_of=None):
    """["entry(keyword=)"] of each of ``keywords`` in an entry point's
    signature that no case of the entry point names first."""
    firsts = first_words(entry_of)
    missing = []
    for name, fn in entry_points().items():
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            continue
        missing += [f"{name}({v}=)" for v in keywords
                    if v in params and v not in firsts.get(name, ())]
    return missing


def test_every_variant_keyword_has_a_case_on_each_entry_point():
    missing = keywords_without_a_case(VARIANTS)
    assert not missing, f"no case whose message names the keyword first: {missing}"


def test_every_gate_keyword_has_a_case_on_each_entry_point():
    missing = keywords_without_a_case(GATE)
    assert not missing, f"no case whose message names the keyword first: {missing}"
    firsts = first_words()
    missing = [f"{e}({k}=)" for e, kws in GLUE_GATE.items() for k in kws
               if k not in firsts.get(e, ())]
    assert not missing, f"no glue case whose message names the keyword first: {missing}"


def test_gate_coverage_can_fail():
    """Without the gate's cases, its keywords are reported on the entry
    points that take them (and only there: the layer's call takes none)."""
    entry_of = {c: e for c, e in catalogue_cases.ENTRY.items() if not c.startswith("gate_")}
    missing = set(keywords_without_a_case(GATE, entry_of))
    for name in ("multi_head_attention", "multi_head_attention_grad", "trace",
                 "reference.multi_head_attention", "multi_head_attention(cache=)"):
        assert {f"{name}(w_gate=)", f"{name}(b_gate=)"} <= missing, name
    assert "MultiHeadAttention(gate=)" in missing
    assert not [m for m in missing if m.startswith("MultiHeadAttention.__call__")]


def test_the_lists_here_are_true():
    found = callables()
    for name in NOT_CALLABLE:
        assert name in mhattn.__all__ and not callable(getattr(mhattn, name)), name
    for name in mhattn.__all__:
        assert callable(getattr(mhattn, name)) or name in NOT_CALLABLE, (
            f"{name}: not callable; say so in NOT_CALLABLE")
    for name, fn in found.items():
        assert (name in TAKES_NOTHING) == (not _takes_something(fn)), (
            f"{name}: TAKES_NOTHING should {'not ' * _takes_something(fn)}list it")
    for name in TAKES_NOTHING | set(NOT_CALLER_DATA) | set(KNOWN_GAPS):
        assert name in found, f"{name}: not a public callable of mhattn any more"
    assert set(NOT_CALLER_DATA).isdisjoint(KNOWN_GAPS)


def test_gaps_have_no_cases():
    """A gap that gets cases leaves KNOWN_GAPS."""
    by = cases_by_entry()
    assert not [g for g in KNOWN_GAPS if by.get(g)], "remove these from KNOWN_GAPS"


def test_every_named_entry_is_known():
    """Every entry a case names is an entry point (or the glue's): no typo
    leaves an entry point uncovered while its cases name something else."""
    known = set(entry_points())
    for case, entries in catalogue_cases.ENTRY.items():
        for e in entries:
            assert e in known or (e.startswith("_C.") and hasattr(_C, e[3:])), (case, e)


def test_the_hook_sees_what_a_case_calls():
    q = np.ones((1, 2, 3, 2))
    seen = set()
    catalogue_cases.entered_while(lambda: mhattn.attention(q, q, q), ["attention", "trace"],
                                  seen)
    assert seen == {"attention"}
    seen = set()
    catalogue_cases.entered_while(lambda: _C.get_isa(), ["_C.get_isa"], seen)  # a builtin
    assert seen == {"_C.get_isa"}
    seen = set()
    with pytest.raises(ValueError):
        catalogue_cases.entered_while(lambda: mhattn.KVCache(0, 1, 1, 1),
                                      ["KVCache", "KVCache.append"], seen)
    assert seen == {"KVCache"}         # recorded though the call raised
    assert sys.getprofile() is None
