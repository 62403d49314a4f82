"""The schema (python/mhattn/_internal/schema.py) and what is generated from
it (tools/gen_schema.py): the generated files are fresh, and a stale one is
caught; every function of mhattn._C has a __text_signature__, _C.pyi says
the same signatures, and every public entry point's signature is the
schema's."""
import ast
import importlib
import inspect
import os
import shutil
import sys

import numpy as np
import pytest

import mhattn
from mhattn._internal import core, schema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")
if not (os.path.exists(os.path.join(TOOLS, "gen_schema.py"))
        and os.path.isdir(os.path.join(ROOT, "python", "mhattn"))):
    pytest.skip("no tools/ or python/ here (an installed copy of the tests)",
                allow_module_level=True)
sys.path.insert(0, TOOLS)
gen_schema = importlib.import_module("gen_schema")

_C = sys.modules["mhattn._C"]
C_FUNCTIONS = sorted(n for n in dir(_C) if callable(getattr(_C, n)) and not n.startswith("_"))
PUBLIC = sorted(e for e in schema.ENTRIES if not e.startswith("_C."))


def test_generated_files_are_fresh(capsys):
    assert gen_schema.main(["--check"]) == 0, capsys.readouterr().out


def _copy(tmp_path):
    """The schema and the generated files, copied under tmp_path."""
    paths = {gen_schema.SCHEMA, gen_schema.PYI, gen_schema.HEADER, gen_schema.ARGS_H,
             gen_schema.ARGS_C, gen_schema.PARAMS_H, gen_schema.FIELDS_H}
    paths |= {e.file for e in schema.ENTRIES.values() if e.doc_groups}
    for p in paths:
        os.makedirs(tmp_path / os.path.dirname(p), exist_ok=True)
        shutil.copy(os.path.join(ROOT, p), tmp_path / p)
    return tmp_path


def _edit(path, old, new):
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_check_names_each_stale_file(tmp_path, capsys):
    root = _copy(tmp_path)
    forward = "python/mhattn/compute/forward.py"
    _edit(root / forward, "The queries' source.", "The source of the queries.")
    _edit(root / gen_schema.PYI, "def get_isa", "def get_isa_renamed")
    assert gen_schema.main(["--check", "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"stale: {forward}" in out and f"stale: {gen_schema.PYI}" in out
    assert gen_schema.HEADER not in out
    assert gen_schema.main(["--root", str(root)]) == 0   # rewrites them
    assert gen_schema.main(["--check", "--root", str(root)]) == 0
    assert (root / forward).read_text() == open(os.path.join(ROOT, forward)).read()


def test_a_schema_edit_makes_every_output_stale(tmp_path, capsys):
    root = _copy(tmp_path)
    # x's record feeds multi_head_attention's docstring; wq's the stub and
    # the C docstrings.
    _edit(root / gen_schema.SCHEMA, 'text="The queries\' source."',
          'text="Where the queries come from."')
    _edit(root / gen_schema.SCHEMA, "W^Q fused, head h's", "W^Q, head h's")
    assert gen_schema.main(["--check", "--root", str(root)]) == 1
    out = capsys.readouterr().out
    for p in (gen_schema.PYI, gen_schema.HEADER, "python/mhattn/compute/forward.py"):
        assert f"stale: {p}" in out
    assert gen_schema.ARGS_H not in out and gen_schema.ARGS_C not in out
    assert gen_schema.PARAMS_H not in out
    gen_schema.main(["--root", str(root)])
    assert "Where the queries come from." in (root / "python/mhattn/compute/forward.py").read_text()


@pytest.mark.parametrize("name", C_FUNCTIONS)
def test_C_function_has_a_text_signature(name):
    f = getattr(_C, name)
    assert f.__text_signature__, f"_C.{name} has no __text_signature__"
    assert str(inspect.signature(f)) == gen_schema.signature(schema, "_C." + name)


def test_every_C_function_is_in_the_schema_and_the_stub():
    assert sorted(schema.C_FUNCTIONS) == C_FUNCTIONS
    tree = ast.parse(open(os.path.join(ROOT, gen_schema.PYI)).read())
    stubs = sorted(n.name for n in tree.body if isinstance(n, ast.FunctionDef))
    assert stubs == C_FUNCTIONS
    # core.py's doors are the same functions
    assert all(callable(getattr(core, n)) for n in C_FUNCTIONS)


def _stub_params(node):
    """(name, kind, default source) of a stub's parameters."""
    a = node.args
    out = []
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    for i, (p, d) in enumerate(zip(pos, defaults)):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append((p.arg, kind, None if d is None else ast.unparse(d)))
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((p.arg, "KEYWORD_ONLY", None if d is None else ast.unparse(d)))
    return out


def _sig_params(sig):
    return [(p.name, p.kind.name,
             None if p.default is inspect.Parameter.empty else repr(p.default))
            for p in sig.parameters.values()]


@pytest.mark.parametrize("name", C_FUNCTIONS)
def test_stub_matches_the_C_function(name):
    tree = ast.parse(open(os.path.join(ROOT, gen_schema.PYI)).read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    assert _stub_params(node) == _sig_params(inspect.signature(getattr(_C, name)))


def _public_object(entry):
    e = schema.ENTRIES[entry]
    module = e.file[len("python/"):-len(".py")].replace("/", ".")
    obj = importlib.import_module(module)
    for part in e.qualname.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("entry", PUBLIC)
def test_public_signature_is_the_schemas(entry):
    obj = _public_object(entry)
    params = list(inspect.signature(obj).parameters.values())
    if "." in schema.ENTRIES[entry].qualname:
        assert params[0].name == "self"
        params = params[1:]
    want = schema.params(entry)
    assert [p.name for p in params] == [a.name for a, _ in want]
    for p, (a, kind) in zip(params, want):
        assert p.kind.name.lower() == kind, f"{entry}({p.name}): {p.kind.name}"
        if a.default is None:
            assert p.default is inspect.Parameter.empty, f"{entry}({p.name}) has a default"
        else:
            got = eval(a.default, {"np": np})   # the schema's own literals
            assert p.default is got or p.default == got and type(p.default) is type(got), \
                f"{entry}({p.name}): default {p.default!r}, schema {a.default}"


def test_public_entry_points_are_the_packages():
    # Every public callable that takes arguments is an entry of the schema.
    for name in ("multi_head_attention", "multi_head_attention_grad", "attention",
                 "attention_grad", "merge_attention", "KVCache", "pack_weights",
                 "MultiHeadAttention", "backward"):
        assert _public_object(name) is getattr(mhattn, name)


def test_records():
    entries = set(schema.ENTRIES)
    kinds = {"ARG_ARRAY", "ARG_ARRAY_OPT", "ARG_ARRAY_ALIAS", "ARG_INT64", "ARG_FLOAT64",
             "ARG_MASK", "ARG_LENGTHS", "ARG_BOOL", "ARG_VARIANTS", "ARG_PACKED",
             "ARG_BLOCK_TABLE"}
    taken = {(e, a.name) for e in entries for a, _ in schema.params(e)}
    for a in schema.ARGS:
        assert a.doc and len(a.doc) <= 80 and "\n" not in a.doc, a
        for e in a.takes:
            assert e in entries, f"{a.name}: unknown entry point {e}"
            assert (e, a.name) in taken, f"{e} does not list {a.name}"
        if any(e.startswith("_C.") for e in a.takes):
            assert a.c_kind in kinds | {""}, a
            assert (a.c_kind == "ARG_ARRAY_ALIAS") == bool(a.alias), a
            assert a.c_kind or a.kind in gen_schema.KIND_TYPES, a
    # every documented name of a Parameters section is a parameter
    for e in entries:
        gen_schema.parameters_section(schema, e) if schema.ENTRIES[e].doc_groups else None


def test_a_schema_edit_makes_the_glue_tables_stale(tmp_path, capsys):
    # The glue's tables are the schema's: an argument's shape, its order,
    # a shape check's order or a note changes the generated C.
    root = _copy(tmp_path)
    _edit(root / gen_schema.SCHEMA, '"(B, Tq, Sq)", REQUIRED,\n        "forward()\'s kept q',
          '"(B, Tq, Sk)", REQUIRED,\n        "forward()\'s kept q')
    _edit(root / gen_schema.SCHEMA, '("k", " from q\'s B and dk")', '("k", " from q")')
    _edit(root / gen_schema.SCHEMA, 'checks_x=("k", "v", "k_scales", "v_scales", "scales")',
          'checks_x=("v", "k", "k_scales", "v_scales", "scales")')
    assert gen_schema.main(["--check", "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"stale: {gen_schema.ARGS_C}" in out and gen_schema.ARGS_H not in out
    gen_schema.main(["--root", str(root)])
    text = (root / gen_schema.ARGS_C).read_text()
    assert '{"q", ARG_ARRAY, SHAPE3(L_B, L_TQ, L_SK), 0, NULL}' in text
    assert '" from q"}' in text
    assert "{ATT_V, ATT_K, ATT_K_SCALES, ATT_V_SCALES, ATT_SCALES, -1}" in text
    _edit(root / gen_schema.SCHEMA, 'variants, lengths_aligned, "\n                 "out_bthd,',
          'variants, out_bthd, "\n                 "lengths_aligned,')
    gen_schema.main(["--root", str(root)])
    assert "ATT_OUT_BTHD, ATT_LENGTHS_ALIGNED" in (root / gen_schema.ARGS_H).read_text()


def test_glue_tables_are_only_generated():
    # No hand-written glue file restates a table, a positions enum or the
    # call_spec fields the schema says.
    import glob
    import re
    generated = {os.path.join(ROOT, p) for p in (gen_schema.ARGS_H, gen_schema.ARGS_C)}
    for path in glob.glob(os.path.join(ROOT, "csrc", "python", "*.[ch]")):
        if path in generated:
            continue
        text = open(path, encoding="utf-8").read()
        assert not re.search(r"\barg_spec \w+\[", text), path
        assert not re.search(r"\bshape \w+_outs\[", text), path
        assert not re.search(r"enum \{[^}]*_N(ARGS|OUTS)\b", text), path
        assert not re.search(r"\.(nopt|checks_x|checks_widths) = ", text), path
    specs = re.findall(r"(\w+)_SPEC_ARGS,", "".join(
        open(os.path.join(ROOT, "csrc", "python", f)).read() for f in ("mha.c", "attend.c")))
    assert sorted(specs) == sorted(n.upper() for n, f in schema.C_FUNCTIONS.items() if f.prefix)


def test_schema_imports_nothing_of_mhattn():
    tree = ast.parse(open(os.path.join(ROOT, gen_schema.SCHEMA)).read())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert imported == ["typing"]


@pytest.mark.parametrize("entry", [e for e in PUBLIC if schema.ENTRIES[e].doc_groups])
def test_parameters_section_names_every_parameter(entry):
    import re
    text = "\n".join(gen_schema.parameters_section(schema, entry))
    for a, kind in schema.params(entry):
        assert re.search(rf"\b{a.name}\b", text), f"{entry}: {a.name} undocumented"


def test_variants_are_the_glues():
    import glob
    import re
    names = None
    for path in glob.glob(os.path.join(ROOT, "csrc", "**", "*.c"), recursive=True):
        m = re.search(r"variant_name\[V_N\] = \{(.*?)\};", open(path, encoding="utf-8").read(),
                      re.S)
        names = re.findall(r'"(\w+)"', m.group(1)) if m else names
    assert names == [v[0] for v in schema.VARIANTS]


def test_outputs_ask_for_arguments():
    for fn, outs in schema.C_OUTPUTS.items():
        for o in outs:   # what asks for an output is an argument of the function
            asked = o.when.split(":")[0]
            assert not asked or asked in [a.name for a, _ in schema.params("_C." + fn)], o


def _config_fields():
    """The field names of mha_config, as csrc/mha.h declares them."""
    import re
    text = open(os.path.join(ROOT, "csrc", "mha.h"), encoding="utf-8").read()
    body = text[:text.index("} mha_config;")]
    body = body[body.rindex("typedef struct {") + len("typedef struct {"):]
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    names = set()
    for decl in body.split(";"):
        decl = decl.strip()
        if decl:
            for part in decl.split(","):
                names.add(re.search(r"(\w+)\s*(\[\w*\])?\s*$", part).group(1))
    return names


def test_c_fields_name_real_fields():
    # c_field says which fields of the core's structs an argument fills:
    # mha_params's (generated from schema.PARAMS) or mha_config's.
    params = {f.name for f in schema.PARAMS}
    config = _config_fields()
    assert {"B", "Tq", "mask_stride", "packed", "interrupt", "cu_q", "cu_k"} <= config
    for a in schema.C_ARGS:
        for token in filter(None, (t.strip() for t in a.c_field.split(","))):
            name = token.replace("!= NULL", "").strip()
            assert name in params or name in config, (a.name, a.takes, token)
    for v in schema.VARIANTS:
        for name in (t.strip() for t in v[4].split(",")):
            assert name in config, (v[0], name)
    for f in schema.PARAMS:
        for u in f.uses:
            assert all(op.strip() in schema.OPS for op in u.ops.split(",")), f
            assert u.io in ("reads", "writes"), f


def test_params_struct_is_generated():
    # mha.h includes the generated struct and declares no other mha_params.
    text = open(os.path.join(ROOT, "csrc", "mha.h"), encoding="utf-8").read()
    assert '#include "mha_params_gen.h"' in text and "} mha_params;" not in text
    gen = open(os.path.join(ROOT, gen_schema.PARAMS_H), encoding="utf-8").read()
    for f in schema.PARAMS:
        assert f" *{f.name};" in gen or f" {f.name};" in gen, f.name


def test_a_params_edit_makes_the_struct_stale(tmp_path, capsys):
    root = _copy(tmp_path)
    _edit(root / gen_schema.SCHEMA, '("dbo", "(Dout,)")', '("dbo", "(Dout,)"), ("dbx", "(X,)")')
    assert gen_schema.main(["--check", "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"stale: {gen_schema.PARAMS_H}" in out and gen_schema.ARGS_C not in out
    gen_schema.main(["--root", str(root)])
    assert "void *dbx;" in (root / gen_schema.PARAMS_H).read_text()


def test_mha_fields_name_config_fields():
    # Each id of mha_field stands for fields mha_config has; mha.h includes
    # the generated enum and declares no other.
    config = _config_fields()
    for fid, fields, doc in schema.MHA_FIELDS:
        assert fields or doc, fid
        for name in filter(None, (t.strip() for t in fields.split(","))):
            assert name in config, (fid, name)
    text = open(os.path.join(ROOT, "csrc", "mha.h"), encoding="utf-8").read()
    assert '#include "mha_field_gen.h"' in text and "} mha_field;" not in text
