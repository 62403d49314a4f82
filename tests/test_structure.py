"""The Python package's architecture: its parts and how they may import.

- imports run downward only: no module imports one that imports it back,
  lazily or not, across the whole package (modules by dotted name);
- exactly one module, ``mhattn._internal.core``, imports the extension
  ``mhattn._C``;
- ``_internal`` is the bottom layer (it imports only itself and ``_C``),
  and ``compute`` imports nothing of ``learn`` or ``nn``;
- the top of python/mhattn/ stays small (at most 12 entries, issue 34: the
  package's parts, its stubs and the optional mhattn.dask);
- the public namespace ``mhattn.*`` is what it was before the package was
  split into subpackages;
- functions stay short.
"""
import ast
import importlib
import importlib.util
import os
import types

import mhattn

PACKAGE = os.path.dirname(mhattn.__file__)
MAX_FUNCTION_LINES = 100
# Issue 34's 12. dask.py (mhattn.dask, the optional Dask interop) sits at the
# top so that its name is the one users import and `import mhattn` never
# imports Dask (tests/test_dask.py); the notebook lives in learn/ and the
# version in _internal/ to make room.
MAX_TOP_ENTRIES = 12


def _modules():
    """{dotted module name: (parsed source, is a package)} of every .py file
    of the package, subpackages included: 'mhattn', 'mhattn.compute',
    'mhattn.compute.forward', ..."""
    out = {}
    for dirpath, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = os.path.relpath(dirpath, os.path.dirname(PACKAGE))
        package = ".".join(rel.split(os.sep))
        for name in sorted(files):
            if name.endswith(".py"):
                dotted = package if name == "__init__.py" else f"{package}.{name[:-3]}"
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    out[dotted] = (ast.parse(f.read(), path), name == "__init__.py")
    return out


def _names(modules):
    """Every module's dotted name, the compiled extension mhattn._C included."""
    compiled = {"mhattn." + name.split(".")[0] for name in os.listdir(PACKAGE)
                if name.endswith((".so", ".pyd"))}
    return set(modules) | compiled


def _imports(name, tree, is_package, names):
    """The package's modules that module ``name`` imports, anywhere in its body.

    ``from X import a`` imports the submodule ``X.a`` if there is one, else
    the module ``X`` (a package's ``__init__``); ``import X.Y`` imports
    ``X.Y``. Relative imports are resolved from the module's package."""
    here = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target != "mhattn" and not target.startswith("mhattn."):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in names else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names
                         if alias.name == "mhattn" or alias.name.startswith("mhattn."))
    return found


def _graph():
    modules = _modules()
    names = _names(modules)
    return {name: _imports(name, tree, is_pkg, names) - {name}
            for name, (tree, is_pkg) in modules.items()}


def _within(name, part):
    return name == part or name.startswith(part + ".")


def test_imports_run_downward_only():
    graph = _graph()
    # the graph is read at all, subpackages and relative levels included
    assert {"mhattn.compute", "mhattn.learn", "mhattn.nn"} <= graph["mhattn"]
    assert "mhattn._internal.args" in graph["mhattn.compute.forward"] | graph["mhattn.compute.grad"]
    assert "mhattn.learn.trace" in graph["mhattn.learn.checker"]
    # Depth-first search for a cycle.
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_exactly_one_module_imports_the_extension():
    """Found in every module's source: an import of mhattn._C, or of any
    name ``_C`` (``from .core import _C`` would hand the module on)."""
    importers = set()
    for name, (tree, is_pkg) in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                if (any(a.name == "_C" or a.name.endswith("._C") for a in node.names)
                        or any(m == "_C" or m.endswith("._C") for m in mods)):
                    importers.add(name)
    assert importers == {"mhattn._internal.core"}, sorted(importers)
    # and no module holds the extension module itself but that one (an
    # optional one whose extra is not installed cannot be imported to look)
    holders = [name for name in _modules() if name != "mhattn"
               and getattr(_imported(name), "_C", None) is mhattn._C]
    assert holders == ["mhattn._internal.core"], holders


# Modules that need an optional extra: mhattn.dask (pip install mhattn[dask]).
OPTIONAL = {"mhattn.dask": "dask"}


def _imported(name):
    """The module, or None for an optional one whose extra is missing (its
    ImportError says so; any other module's ImportError is raised)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        if name in OPTIONAL and importlib.util.find_spec(OPTIONAL[name]) is None:
            return None
        raise


def test_layers():
    """_internal is the bottom layer; compute sits on it and knows nothing
    of the learner's tools or the layer class."""
    graph = _graph()
    bad = []
    for name, targets in graph.items():
        for t in sorted(targets):
            if _within(name, "mhattn._internal") and not (
                    _within(t, "mhattn._internal") or t == "mhattn._C"):
                bad.append(f"{name} -> {t}")
            if _within(name, "mhattn.compute") and any(
                    _within(t, part) for part in ("mhattn.learn", "mhattn.nn", "mhattn.checker")):
                bad.append(f"{name} -> {t}")
    assert not bad, bad
    assert "mhattn._internal.args" in graph["mhattn._internal.core"]   # the graph is read


def test_the_top_of_the_package_is_small():
    entries = sorted(e for e in os.listdir(PACKAGE)
                     if e != "__pycache__" and not e.endswith(".egg-info"))
    assert any(e.endswith((".so", ".pyd")) for e in entries), entries   # _C is counted
    assert len(entries) <= MAX_TOP_ENTRIES, entries


# mhattn.__all__ before the package was split into subpackages.
PUBLIC = ["multi_head_attention", "pack_weights", "PackedWeights", "attention",
          "attention_grad", "merge_attention", "KVCache", "PagedKVCache",
          "multi_head_attention_grad",
          "backward", "Context", "RoPE", "RelativeBias", "BlockMask", "param_count", "reference",
          "worked_example",
          "MultiHeadAttention", "from_torch_masks", "to_torch_attn_mask", "get_isa",
          "set_num_threads", "get_num_threads", "trace", "Trace", "plot_attention",
          "check_prototype", "check_attention_prototype"]


def test_the_public_namespace_is_unchanged():
    assert mhattn.__all__ == PUBLIC
    space = {}
    exec("from mhattn import *", space)
    for name in PUBLIC:
        assert space[name] is getattr(mhattn, name), name
        assert getattr(mhattn, name) is not None, name
    assert isinstance(mhattn.reference, types.ModuleType)
    assert isinstance(mhattn.trace, types.FunctionType)       # the function, not the module
    assert isinstance(mhattn.attention, types.FunctionType)


def test_the_submodules_users_reach_are_where_they_were():
    """``mhattn.reference`` and ``mhattn.checker`` (README.md) import as
    modules; the other modules that were attributes of the flat package
    still are, as the same modules in their new homes."""
    import mhattn.checker
    import mhattn.reference
    from mhattn.checker import MISTAKES, PrototypeReport
    from mhattn.learn import checker
    from mhattn.reference import multi_head_attention  # noqa: F401

    assert MISTAKES is checker.MISTAKES and PrototypeReport is checker.PrototypeReport
    assert mhattn.checker.check_prototype is mhattn.check_prototype
    assert mhattn.reference.__name__ == "mhattn.reference"
    homes = {"layer": "mhattn.nn.layer", "interop": "mhattn.nn.interop",
             "plot": "mhattn.learn.plot", "cache": "mhattn.compute.cache",
             "packed": "mhattn.compute.packed", "checker": "mhattn.checker"}
    for name, home in homes.items():
        assert getattr(mhattn, name) is importlib.import_module(home), name


def test_no_function_is_long():
    long = []
    for name, (tree, _) in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                body = node.body
                if (body and isinstance(body[0], ast.Expr)
                        and isinstance(body[0].value, ast.Constant)
                        and isinstance(body[0].value.value, str)):
                    n -= body[0].end_lineno - body[0].lineno + 1   # the docstring
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{name}:{node.lineno} {node.name}: {n} lines")
    assert not long, long
