"""Every tutorial notebook is committed with its outputs, and runs top to bottom from scratch on
the default model without an error."""

import os
import pathlib

import nbclient
import nbformat
import pytest

TUTORIALS = sorted((pathlib.Path(__file__).resolve().parent.parent / "tutorials").glob("*.ipynb"))


def test_there_are_tutorials():
    assert len(TUTORIALS) >= 3


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_is_committed_with_its_outputs(path):
    # a reader sees every result without running anything: the committed file holds one run from
    # top to bottom, every code cell printed or drew something, and no cell failed
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1))
    for cell in code:
        shown = [o for o in cell.outputs if o.output_type != "stream" or o.name == "stdout"]
        assert shown, f"no output (stderr aside) in the cell starting {cell.source[:60]!r}"
        assert not any(o.output_type == "error" for o in cell.outputs), cell.source[:60]
        if "plt.subplots" in cell.source:
            assert any("image/png" in o.get("data", {}) for o in cell.outputs), f"no plot in {cell.source[:60]!r}"


@pytest.mark.model
@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_executes(path):
    notebook = nbformat.read(path, as_version=4)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MPLBACKEND", "Agg")
    client = nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    # raises CellExecutionError, naming the cell and the traceback, on the first failing cell
    client.execute()
