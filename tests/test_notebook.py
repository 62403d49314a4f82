"""The walkthrough notebook ships with the package and runs from top to bottom.

It lives in the package (python/mhattn/learn/walkthrough.ipynb, package
data), so these tests read it through importlib.resources from the mhattn
that is imported: the installed one when the suite runs against a wheel.
"""
import io
import json
import os
import pathlib
import subprocess
import sys
from importlib import resources

import pytest

import mhattn
from conftest import child_env
from mhattn.__main__ import main, notebook


def _text(output):
    if "text" in output:
        return output["text"]
    data = output.get("data", {})
    return data.get("text/html", "") + data.get("text/plain", "")


def _check_notebook(raw: bytes):
    """A valid notebook of code and markdown cells, kept without outputs."""
    nb = json.loads(raw.decode("utf-8"))
    assert nb["nbformat"] == 4
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    cells = nb["cells"]
    assert {c["cell_type"] for c in cells} == {"code", "markdown"}
    code = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert "mhattn.worked_example()" in code and "mhattn.check_prototype" in code
    # Kept without outputs, so that diffs stay readable.
    assert all(not c.get("outputs") for c in cells if c["cell_type"] == "code")
    try:
        import nbformat
    except ImportError:
        return
    nbformat.validate(nbformat.reads(raw.decode("utf-8"), as_version=4))


def test_the_notebook_is_package_data():
    """Reachable through importlib.resources from the imported package, next
    to its modules (so a wheel carries it)."""
    found = resources.files("mhattn.learn") / "walkthrough.ipynb"
    assert found.is_file()
    assert notebook().read_bytes() == found.read_bytes()
    with resources.as_file(found) as path:
        package = pathlib.Path(mhattn.__file__).resolve().parent
        assert pathlib.Path(path).resolve() == package / "learn" / "walkthrough.ipynb"
    _check_notebook(found.read_bytes())


def test_python_m_mhattn_notebook_writes_it(tmp_path):
    """`python -m mhattn --notebook DIR` (the README's command) writes the
    notebook into DIR and says how to open it; a second run leaves it alone."""
    cmd = [sys.executable, "-m", "mhattn", "--notebook", str(tmp_path)]
    done = subprocess.run(cmd, cwd=tmp_path, env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    written = tmp_path / "walkthrough.ipynb"
    assert written.read_bytes() == notebook().read_bytes()
    _check_notebook(written.read_bytes())
    assert f"jupyter lab {written}" in done.stdout
    written.write_text("my edits")
    again = subprocess.run(cmd, cwd=tmp_path, env=child_env(), capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 1 and "already exists" in again.stderr
    assert written.read_text() == "my edits"


def test_notebook_option_forms(tmp_path, monkeypatch):
    """No PATH: the current folder; a file name: that file; a missing folder:
    a message, not a traceback. Without arguments, the worked example."""
    monkeypatch.chdir(tmp_path)
    buf = io.StringIO()
    assert main(buf, ["--notebook"]) == 0
    assert (tmp_path / "walkthrough.ipynb").is_file()
    assert main(buf, ["--notebook", "mine.ipynb"]) == 0
    assert (tmp_path / "mine.ipynb").read_bytes() == notebook().read_bytes()
    assert main(buf, ["--notebook", str(tmp_path / "nowhere" / "x.ipynb")]) == 1
    steps = io.StringIO()
    assert main(steps) == 0 and main(steps, []) == 0
    assert steps.getvalue().count("[0.7337, 0.0879, 0.1784]") == 2


@pytest.mark.slow
def test_walkthrough_notebook_runs(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    with resources.as_file(notebook()) as path:
        nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    # The kernel imports this mhattn (an absolute PYTHONPATH: it runs
    # elsewhere), in a folder of its own, as a user's copy would run;
    # a last cell says which mhattn it was.
    monkeypatch.setenv("PYTHONPATH", child_env()["PYTHONPATH"])
    nb.cells.append(nbformat.v4.new_code_cell("import mhattn; print(mhattn.__file__)"))
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()           # raises CellExecutionError on any failing cell
    used = nb.cells.pop().outputs[0]["text"].strip()
    assert os.path.samefile(used, mhattn.__file__), used
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(_text(o) for o in outputs)
    # The worked example's numbers, the trace's display, the checker's verdicts.
    for expected in ["0.7337", "0.0879", "0.1784", "0.7931", "2.8284", "23.06",
                     "mhattn.Trace", "First divergence at 'scores'",
                     "heads_split_sequence", "matches mhattn"]:
        assert expected in text, expected
    # Both plot cells display a figure as an image.
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(pngs) == 2
