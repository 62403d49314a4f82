"""The Python package's layering: imports run downward only (no module
imports one that imports it back, lazily or not), and functions stay short.
"""
import ast
import os

import mhattn

PACKAGE = os.path.dirname(mhattn.__file__)
MAX_FUNCTION_LINES = 100


def _modules():
    """{module name: parsed source} of every .py file of the package."""
    out = {}
    for name in sorted(os.listdir(PACKAGE)):
        if name.endswith(".py"):
            with open(os.path.join(PACKAGE, name)) as f:
                out[name[:-3]] = ast.parse(f.read(), name)
    return out


def _submodules():
    """Every submodule's name, the compiled _C included."""
    return {name.split(".")[0] for name in os.listdir(PACKAGE)
            if name.endswith((".py", ".so", ".pyd"))}


def _imports(tree, modules):
    """The package's modules that a module imports, anywhere in its body.

    ``from . import name`` imports the submodule ``name`` if there is one,
    else the package itself (``__init__``); ``from .mod import name`` and
    ``from mhattn.mod import name`` import ``mod``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module is None:
                for alias in node.names:
                    found.add(alias.name if alias.name in modules else "__init__")
            elif node.level == 1 or (node.module or "").startswith("mhattn"):
                parts = (node.module or "").split(".")
                mod = parts[0] if node.level == 1 else (parts[1] if len(parts) > 1
                                                        else "__init__")
                found.add(mod if mod in modules else "__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "mhattn":
                    found.add("__init__")
                elif alias.name.startswith("mhattn."):
                    found.add(alias.name.split(".")[1])
    return found


def test_imports_run_downward_only():
    modules = _modules()
    names = _submodules()
    graph = {name: _imports(tree, names) - {name} for name, tree in modules.items()}
    assert {"_api", "_grad"} <= graph["__init__"]   # the graph is read at all
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


def test_no_function_is_long():
    long = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                body = node.body
                if (body and isinstance(body[0], ast.Expr)
                        and isinstance(body[0].value, ast.Constant)
                        and isinstance(body[0].value.value, str)):
                    n -= body[0].end_lineno - body[0].lineno + 1   # the docstring
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{name}.py:{node.lineno} {node.name}: {n} lines")
    assert not long, long
