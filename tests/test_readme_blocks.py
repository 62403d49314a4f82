"""Every Python block of README.md runs, as a newcomer pastes them.

The ```python blocks run in order, in one namespace, in an empty folder; a
block that raises fails the test, and so does a placeholder (a ``...``
statement). A bare expression whose comment is a value (``out.shape  #
(10, 64)``, or ``# some words: [0.7337, ...]``) must give that value, to the
comment's 4 decimals. Other code is in indented blocks, which are shell
commands: of those, the ``python -m mhattn ...`` ones run.
"""
import ast
import io
import pathlib
import re
import subprocess
import sys
import tokenize

import numpy as np
import pytest

import mhattn
from conftest import child_env

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
LANGUAGES = {"python", "text", "bash", "sh", "console"}


def fenced_blocks(text):
    """[(language, first line's number, code)] of every fenced block."""
    return [(m.group(1), text.count("\n", 0, m.start(2)) + 1, m.group(2))
            for m in FENCE.finditer(text)]


def indented_lines(text):
    """[(line number, line)] of the indented (4 spaces) code blocks outside
    the fences: runs of such lines after a blank line."""
    out, inside, fenced, previous = [], False, False, ""
    for n, line in enumerate(text.split("\n"), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("    ") and (inside or not previous.strip()):
            inside = True
            out.append((n, line.strip()))
        elif line.strip():
            inside = False
        previous = line
    return out


def _claim(comment):
    """(the value a comment states,), or None: the whole comment, else what
    follows its last ': '."""
    comment = comment.lstrip("#").strip()
    if not comment:
        return None
    for text in (comment, comment.rsplit(": ", 1)[-1]):
        try:
            return (ast.literal_eval(text),)
        except (ValueError, SyntaxError):
            continue
    return None


def _same(value, claim):
    if isinstance(claim, str) or isinstance(value, str):
        return value == claim
    if isinstance(claim, tuple) and isinstance(value, tuple):
        return len(value) == len(claim) and all(map(_same, value, claim))
    value, claim = np.asarray(value, dtype=float), np.asarray(claim, dtype=float)
    return value.shape == claim.shape and np.allclose(value, claim, rtol=0, atol=1e-4)


def run_block(code, first_line, namespace):
    """Run one block statement by statement, so that an expression with a
    claim is evaluated and checked; tracebacks point at README.md's lines."""
    source = "\n" * (first_line - 1) + code
    tree = ast.parse(source, str(README))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and node.value.value is Ellipsis):
            raise AssertionError(f"README.md:{node.lineno}: a placeholder (...) is not code")
    comments = {t.start[0]: t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT}
    for stmt in tree.body:
        claim = (_claim(comments.get(stmt.end_lineno, "")) if isinstance(stmt, ast.Expr)
                 else None)
        if claim is None:
            exec(compile(ast.Module([stmt], []), str(README), "exec"), namespace)
            continue
        value = eval(compile(ast.Expression(stmt.value), str(README), "eval"), namespace)
        assert _same(value, claim[0]), (
            f"README.md:{stmt.lineno}: {ast.get_source_segment(source, stmt)} "
            f"gives {value!r}, the comment says {claim[0]!r}")


def test_every_fence_names_its_language_and_python_is_fenced():
    """So that no Python hides where the runner does not look."""
    text = README.read_text(encoding="utf-8")
    blocks = fenced_blocks(text)
    assert len([b for b in blocks if b[0] == "python"]) >= 5
    assert not [(lang, n) for lang, n, _ in blocks if lang not in LANGUAGES]
    python_like = re.compile(r"^(import |from \w+ import |def |>>>|print\()")
    assert not [(n, line) for n, line in indented_lines(text) if python_like.match(line)]


def test_the_python_blocks_run_in_order(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")           # the plot block (mhattn[plot])
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(tmp_path)                 # where a block's files go
    namespace = {"__name__": "__readme__"}
    for lang, first_line, code in fenced_blocks(README.read_text(encoding="utf-8")):
        if lang == "python":
            run_block(code, first_line, namespace)
    capsys.readouterr()                         # the blocks' prints


def test_the_runner_catches_what_it_should(tmp_path):
    """A raising block, a placeholder and a wrong claim fail; a true claim,
    a prose comment and an assignment's comment pass."""
    ns = {"np": np}
    run_block("x = np.arange(3)   # a comment: [9]\nx.shape   # (3,)\n"
              "x + 0.00004   # about: [0.0, 1.0, 2.0]\nprint(x)   # prose\n", 1, ns)
    with pytest.raises(ZeroDivisionError):
        run_block("1 / 0\n", 1, ns)
    with pytest.raises(AssertionError, match="placeholder"):
        run_block("def f(x):\n    ...\n", 1, ns)
    with pytest.raises(AssertionError, match="the comment says"):
        run_block("x.shape   # (4,)\n", 1, ns)


def test_the_python_m_mhattn_commands_run(tmp_path):
    """The commands of the indented blocks that run mhattn, in an empty folder."""
    commands = [part.strip() for _, line in indented_lines(README.read_text(encoding="utf-8"))
                for part in line.split("#", 1)[0].split("&&")]
    commands = [c for c in commands if c.startswith("python -m mhattn")]
    assert "python -m mhattn" in commands and "python -m mhattn --notebook" in commands
    for command in commands:
        done = subprocess.run([sys.executable] + command.split()[1:], cwd=tmp_path,
                              env=child_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (command, done.stderr)
    assert (tmp_path / "walkthrough.ipynb").is_file()
