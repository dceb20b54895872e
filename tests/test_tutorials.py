"""Every tutorial notebook is committed with its outputs, runs top to bottom from scratch without
an error, and uses only the public surface (`smc_sd`, `smc_sd.programs`, backends, constraints,
metrics), never the engine's or the compiler's modules or a private name. The custom constraint a
tutorial teaches is checked against the library's byte-level potential path."""

import ast
import os
import pathlib
import re

import nbclient
import nbformat
import pytest

TUTORIALS = sorted((pathlib.Path(__file__).resolve().parent.parent / "tutorials").glob("*.ipynb"))


def test_there_are_tutorials():
    # 01 a first run, 02 a program of your own, 03 N and K, 04 structured extraction, 05 your own
    # potentials, 06 choosing N and K from the diagnostics, 07 the server and other backends
    assert [p.stem[:2] for p in TUTORIALS] == [f"{i:02}" for i in range(1, 8)]


def code_cells(path: pathlib.Path) -> list[str]:
    return [cell.source for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_uses_only_the_public_surface(path):
    # what a reader copies must keep working when the internals move: no engine or compiler module
    # anywhere in the file (code, prose or outputs), and no private name imported from smc_sd
    assert not re.search(r"smc_sd\.(engine|compiler)", path.read_text())
    for source in code_cells(path):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("smc_sd"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private and "._" not in node.module, f"{node.module}: {private}"


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


def no_letter(letter: str):
    """The byte strings without a letter (either case), as a genlm-control potential over bytes:
    the language the lipogram of tutorial 02 means, read on the bytes the model emits."""
    import numpy as np
    from genlm.control import Potential

    class NoLetter(Potential):
        def __init__(self):
            super().__init__(list(range(256)))
            self.banned = {ord(letter.lower()), ord(letter.upper())}

        async def prefix(self, context):
            return float("-inf") if self.banned & set(bytes(context)) else 0.0

        async def complete(self, context):
            return await self.prefix(context)

        async def logw_next(self, context):
            # one row for the 256 bytes and EOS (the generic path asks it once per trie node)
            weights = np.zeros(257)
            weights[sorted(self.banned)] = float("-inf")
            return self.make_lazy_weights(weights)

    return NoLetter()


@pytest.mark.model
def test_tutorial_02s_lipogram_masks_what_the_byte_level_potential_masks(default_lm):
    import torch

    from smc_sd.constraints.potentials import as_token_constraint

    path = next(p for p in TUTORIALS if p.stem.startswith("02"))
    source = next(s for s in code_cells(path) if "class Lipogram" in s)
    # the cell defines the class and then uses it: run its imports and the class only
    tree = ast.parse(source)
    kept = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.ClassDef))]
    namespace = {"torch": torch, "TokenConstraint": __import__("smc_sd").TokenConstraint, "token_bytes": __import__("smc_sd").token_bytes}
    exec(compile(ast.Module(kept, type_ignores=[]), str(path), "exec"), namespace)
    lipogram = namespace["Lipogram"](default_lm)
    byte_level = as_token_constraint(no_letter("e"), default_lm)
    text = default_lm.tokenizer.encode("A cat is a good pal.", add_special_tokens=False)
    prefixes = [[], text[:3], text]
    ours, theirs = lipogram.mask(prefixes), byte_level.mask(prefixes)
    eos = default_lm.vocabulary.eos_token_id
    # the tokens the decoder drops (special and control tokens) are refused, all of them
    silent = [t for t in range(default_lm.vocabulary.size) if t != eos and default_lm.decode([t]) == ""]
    assert len(silent) >= 15 and not ours[:, silent].any()
    # everywhere else the mask is the byte-level potential's, which also refuses the special tokens
    assert not theirs[:, sorted(set(default_lm.tokenizer.all_special_ids) - {eos})].any()
    theirs[:, silent] = False
    assert torch.equal(ours, theirs), (ours != theirs).nonzero()[:10].tolist()
