"""The Python package's layering: imports run downward only (no module
imports one that imports it back, lazily or not, across the whole package,
subpackages included, modules by dotted name), and functions stay short.
"""
import ast
import os

import mhattn

PACKAGE = os.path.dirname(mhattn.__file__)
MAX_FUNCTION_LINES = 100


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
