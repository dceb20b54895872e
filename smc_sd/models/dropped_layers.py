"""A Llama-family model directory without some of its decoder layers, for engines that load
directories only (vLLM cannot drop layers at load time)."""

from __future__ import annotations

import json
import pathlib
import shutil


def dropped_layers_dir(source, layers) -> pathlib.Path:
    """A copy of a Llama-family safetensors model without some decoder layers, made once.

    The kept layers are renumbered 0 .. n-1 and `num_hidden_layers` becomes n, so vLLM (which
    cannot drop layers at load time) serves the same self-speculative draft the hf backend builds
    with `drop_decoder_layers`. The copy sits next to the source, named after the dropped layers.

    Args:
        source: a directory with config.json, *.safetensors and tokenizer files.
        layers: decoder layer indices to drop.
    """
    from safetensors.torch import load_file, save_file

    from smc_sd.models.smollm2 import write_directory_atomically

    source = pathlib.Path(source)
    dropped = sorted(set(layers))
    target = source.parent / f"{source.name}-drop-{'-'.join(map(str, dropped))}"
    if target.is_dir():
        return target
    config = json.loads((source / "config.json").read_text())
    count = config["num_hidden_layers"]
    kept = [index for index in range(count) if index not in dropped]
    renumber = {old: new for new, old in enumerate(kept)}

    def fill(scratch: pathlib.Path) -> None:
        for path in source.iterdir():
            if path.suffix != ".safetensors" and path.is_file():
                shutil.copy(path, scratch / path.name)
        for path in source.glob("*.safetensors"):
            tensors = {}
            for name, tensor in load_file(path).items():
                parts = name.split(".")
                if parts[:2] == ["model", "layers"]:
                    old = int(parts[2])
                    if old in dropped:
                        continue
                    parts[2] = str(renumber[old])
                tensors[".".join(parts)] = tensor
            save_file(tensors, scratch / path.name, metadata={"format": "pt"})
        config["num_hidden_layers"] = len(kept)
        if config.get("layer_types"):
            config["layer_types"] = [kind for index, kind in enumerate(config["layer_types"]) if index not in dropped]
        (scratch / "config.json").write_text(json.dumps(config, indent=2))
        (scratch / "model.safetensors.index.json").unlink(missing_ok=True)

    return write_directory_atomically(target, fill)
