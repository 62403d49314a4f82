"""examples/walkthrough.ipynb runs from top to bottom, so that it cannot rot."""
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "examples" / "walkthrough.ipynb"


def _text(output):
    if "text" in output:
        return output["text"]
    data = output.get("data", {})
    return data.get("text/html", "") + data.get("text/plain", "")


@pytest.mark.slow
def test_walkthrough_notebook_runs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    # Kept without outputs, so that diffs stay readable.
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()           # raises CellExecutionError on any failing cell
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
