"""tools/render_notebook.py renders with the mhattn that is imported.

After the README's `pip install .` the checkout's python/ holds the sources
but no compiled extension; the renderer used to put that folder first on the
kernel's path, whose `import mhattn` then failed (a circular import of _C).
These tests run the script from a copy of such a checkout (the package's
sources and notebook, no _C), from another folder, against the mhattn that
the suite imports (the installed one, when the suite runs against a wheel).
"""
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import mhattn

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "render_notebook.py"
PACKAGE = pathlib.Path(mhattn.__file__).resolve().parent
EXTENSIONS = ("*.so", "*.pyd")


def _checkout(at: pathlib.Path, built: bool) -> pathlib.Path:
    """A copy of a checkout: tools/render_notebook.py and python/mhattn (the
    imported package's files: sources, stubs, the notebook), with the compiled
    extension only when ``built``."""
    (at / "tools").mkdir(parents=True)
    shutil.copy2(SCRIPT, at / "tools" / SCRIPT.name)
    skip = ("__pycache__",) + (() if built else EXTENSIONS)
    shutil.copytree(PACKAGE, at / "python" / "mhattn", ignore=shutil.ignore_patterns(*skip))
    return at


def _pythonpath(*first):
    """PYTHONPATH of a child that imports ``first`` (folders), else this mhattn."""
    here = str(PACKAGE.parent)
    rest = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([str(f) for f in first] + [here] + rest)


def _load(script: pathlib.Path):
    spec = importlib.util.spec_from_file_location("render_notebook_copy", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_renders_with_the_imported_mhattn_not_the_unbuilt_tree(tmp_path):
    pytest.importorskip("nbclient")
    pytest.importorskip("nbformat")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    tree = _checkout(tmp_path / "checkout", built=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=_pythonpath(), MPLBACKEND="Agg")
    done = subprocess.run([sys.executable, str(tree / "tools" / SCRIPT.name),
                           "--out", str(tmp_path / "pictures")],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # The kernel imported this mhattn, never the checkout's python/.
    used = [line for line in done.stderr.splitlines()
            if line.startswith("render_notebook: ") and " with mhattn from " in line]
    assert len(used) == 1, done.stderr[-3000:]
    notebook, package = used[0][len("render_notebook: "):].split(" with mhattn from ")
    assert os.path.samefile(package, PACKAGE)
    assert os.path.samefile(notebook, tree / "python" / "mhattn" / "learn" / "walkthrough.ipynb")
    # Both figures of the notebook, and the HTML of its traces and reports.
    pictures = sorted(p.name for p in (tmp_path / "pictures").iterdir())
    figures = [p for p in pictures if p.endswith(".png")
               and p.replace(".png", ".html") not in pictures]
    assert len(figures) == 2, pictures
    assert len([p for p in pictures if p.endswith(".html")]) >= 4, pictures
    for name in figures:
        assert (tmp_path / "pictures" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unbuilt_checkout_is_never_put_on_the_path(tmp_path):
    """Where mhattn does not import (here: an unbuilt python/ first on
    PYTHONPATH hides every other), the renderer stops with what to do before
    starting a kernel, and does not offer its own unbuilt python/ instead."""
    tree = _checkout(tmp_path / "checkout", built=False)
    env = dict(os.environ, PYTHONPATH=_pythonpath(tree / "python"))
    done = subprocess.run([sys.executable, str(tree / "tools" / SCRIPT.name),
                           "--out", str(tmp_path / "pictures")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "mhattn does not import" in done.stderr and "pip install ." in done.stderr
    assert not (tmp_path / "pictures").exists() or not any((tmp_path / "pictures").iterdir())


def test_the_kernel_gets_the_imported_mhattn_and_absolute_paths(tmp_path, monkeypatch):
    """kernel_env: the mhattn this Python imports, found from the kernel's
    own folder, with a relative PYTHONPATH made absolute."""
    tree = _checkout(tmp_path / "checkout", built=False)
    module = _load(tree / "tools" / SCRIPT.name)
    (tmp_path / "kernel").mkdir()
    relative = os.path.relpath(PACKAGE.parent, tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([relative, _pythonpath()]))
    env, where = module.kernel_env(tree, tmp_path / "kernel")
    assert os.path.samefile(where, PACKAGE)
    assert all(os.path.isabs(p) for p in env["PYTHONPATH"].split(os.pathsep))
    assert str(tree / "python") not in env["PYTHONPATH"].split(os.pathsep)


def test_a_checkout_built_in_place_is_the_fallback(tmp_path, monkeypatch):
    """When nothing else imports, a checkout built in place (make build) is
    used: its python/ goes first on the kernel's path."""
    unbuilt = _checkout(tmp_path / "unbuilt", built=False)
    built = _checkout(tmp_path / "built", built=True)
    if not any(any((built / "python" / "mhattn").glob("_C" + e)) for e in EXTENSIONS):
        pytest.skip("no compiled extension next to mhattn to copy")
    module = _load(built / "tools" / SCRIPT.name)
    monkeypatch.setenv("PYTHONPATH", _pythonpath(unbuilt / "python"))   # imports nothing
    env, where = module.kernel_env(built, tmp_path)
    assert os.path.samefile(where, built / "python" / "mhattn")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(built / "python")
