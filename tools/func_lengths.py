"""Lengths of the functions in csrc/ (C) and python/mhattn/ (Python).

    python tools/func_lengths.py [--top N]

C functions are found by their layout (clang-format's, which the core
follows): a body opens with "{" alone at column 0 and closes with "}" at
column 0; its length counts the lines in between. Python functions are
measured with ast, decorators included and the docstring left out (the
numpydoc docstrings of public functions are long on purpose). Used by
tests/test_source_layout.py, which holds the limits.
"""
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def c_functions(root=ROOT):
    """(path, first line, name, body lines) of every C function in csrc/; a
    template's PICK(f32_name, f64_name) is named by its f64 name."""
    out = []
    for dirpath, _, files in os.walk(os.path.join(root, "csrc")):
        for f in sorted(files):
            if not f.endswith((".c", ".h", ".inc")):
                continue
            path = os.path.join(dirpath, f)
            with open(path, encoding="utf-8") as fh:
                lines = fh.read().split("\n")
            start = None
            for n, line in enumerate(lines):
                if line == "{":
                    start = n
                elif line.startswith("}") and start is not None:
                    # the signature starts at the last line above the brace
                    # that begins in column 0; the name is the identifier
                    # before its first "(" (PICK's second full name)
                    sig = start - 1
                    while sig > 0 and (not lines[sig] or lines[sig][0] in " \t*/"):
                        sig -= 1
                    head = " ".join(lines[sig:start]).replace("PICK(", "")
                    name = (head.split("(")[0].rstrip(") ").split() or ["?"])[-1]
                    out.append((os.path.relpath(path, root), start + 1, name.strip("*),"),
                                n - start - 1))
                    start = None
    return out


def py_functions(root=ROOT):
    """(path, first line, name, lines) of every function in python/mhattn/,
    its subpackages included."""
    out = []
    pkg = os.path.join(root, "python", "mhattn")
    paths = sorted(os.path.join(dirpath, f) for dirpath, _, files in os.walk(pkg)
                   for f in files if f.endswith(".py"))
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                n = node.end_lineno - first + 1
                body0 = node.body[0]
                if (isinstance(body0, ast.Expr) and isinstance(body0.value, ast.Constant)
                        and isinstance(body0.value.value, str)):
                    n -= body0.end_lineno - body0.lineno + 1
                out.append((os.path.relpath(path, root), first, node.name, n))
    return out


if __name__ == "__main__":
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 10
    for title, rows in (("C (csrc/)", c_functions()), ("Python (python/mhattn/)", py_functions())):
        print(title)
        for path, line, name, n in sorted(rows, key=lambda r: -r[3])[:top]:
            print(f"  {n:4d}  {path}:{line}  {name}")
