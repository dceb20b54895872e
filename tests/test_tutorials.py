"""Every tutorial notebook runs top to bottom on the default model without an error."""

import os
import pathlib

import nbclient
import nbformat
import pytest

pytestmark = pytest.mark.model

TUTORIALS = sorted((pathlib.Path(__file__).resolve().parent.parent / "tutorials").glob("*.ipynb"))


def test_there_are_tutorials():
    assert len(TUTORIALS) >= 3


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
