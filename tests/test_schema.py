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
    paths = {gen_schema.SCHEMA, gen_schema.PYI, gen_schema.HEADER}
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
             "ARG_MASK", "ARG_LENGTHS", "ARG_BOOL", "ARG_VARIANTS", "ARG_PACKED"}
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


def _glue_tables():
    """{function: its arg_spec rows} as the glue's C source writes them
    (wherever under csrc/ its tables live)."""
    import glob
    import re
    tables = {}
    for path in glob.glob(os.path.join(ROOT, "csrc", "**", "*.c"), recursive=True):
        text = open(path, encoding="utf-8").read()
        for fn, body in re.findall(r"static const arg_spec (\w+)_args\[\w+\] = \{(.*?)\n\};",
                                   text, re.S):
            entries = re.findall(r"\[(\w+)\] = \{(.*?)\},", body, re.S)
            index = {pos: None for pos, _ in entries}
            rows = []
            for pos, spec in entries:
                spec = " ".join(spec.split())
                if spec.startswith(".name"):
                    name = re.search(r'\.name = "(\w+)"', spec).group(1)
                    kind = re.search(r"\.kind = (\w+)", spec).group(1)
                    rows.append([name, kind, None, None])
                else:
                    m = re.fullmatch(r'"(\w+)", (\w+), SHAPE\d\(([\w, ]+)\), (\w+)'
                                     r'(?:, (?:NULL|"[^"]*"))?', spec)
                    shape = tuple(x.strip()[2:] for x in m.group(3).split(","))
                    rows.append([m.group(1), m.group(2), shape, m.group(4)])
                index[pos] = rows[-1][0]
            for row in rows:   # an alias is written as its position
                row[3] = index.get(row[3]) if row[3] not in (None, "0") else None
            tables[fn] = [tuple(r) for r in rows]
    return tables


def test_the_schema_says_what_the_glue_tables_say():
    tables = _glue_tables()
    with_tables = [n for n, f in schema.C_FUNCTIONS.items() if f.prefix]
    assert sorted(tables) == sorted(with_tables)
    for name in with_tables:
        want = [(n, k, None if sh is None else tuple(x.upper() for x in sh), al)
                for n, k, sh, al in gen_schema.arg_specs(schema, name)]
        got = [(n, k, sh, al) for n, k, sh, al in tables[name]]
        assert got == want, name
        assert "_args[" in gen_schema.arg_spec_c(schema, name)


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


def test_outputs_are_the_glues():
    import glob
    import re
    tables = {}
    for path in glob.glob(os.path.join(ROOT, "csrc", "**", "*.c"), recursive=True):
        text = open(path, encoding="utf-8").read()
        for fn, body in re.findall(r"static const shape (\w+)_outs\[\w+\] = \{(.*?)\};",
                                   text, re.S):
            tables[fn] = [tuple(x.strip()[2:] for x in m.split(","))
                          for m in re.findall(r"SHAPE\d\(([\w, ]+)\)", body)]
    assert sorted(tables) == ["backward", "forward", "project"]
    for fn, shapes in tables.items():
        want = [tuple(x.strip().upper() for x in o.shape.strip("(,)").split(",") if x.strip())
                for o in schema.C_OUTPUTS[fn]][:len(shapes)]
        assert shapes == want, fn
    for fn, outs in schema.C_OUTPUTS.items():
        for o in outs:   # what asks for an output is an argument of the function
            asked = o.when.split(":")[0]
            assert not asked or asked in [a.name for a, _ in schema.params("_C." + fn)], o
