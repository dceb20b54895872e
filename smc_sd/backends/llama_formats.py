"""Weight formats of a GGUF target on llama.cpp: copies llama.cpp's own quantizer writes, cached,
and what a pass costs in each.

A copy in another format is another set of weights: llama.cpp dequantizes the source and
quantizes it again (allow_requantize), so a Q4_0 or Q8_0 copy of the shipped Q4_1 file holds the
Q4_1 weights' values rounded once more (Q8_0: to within 1/254 of each block's largest weight).
Every law the backend keeps holds against the weights that run, whichever file that is.

Copies are written once into smc-sd's cache (`$SMC_SD_CACHE`, as the hf backend's float32
conversion of the default model), keyed by the source's path, size and modification time, and
renamed into place so an interrupted write leaves nothing behind.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import tempfile

from smc_sd.backends.pass_cost import PassCost

#: the format of the shipped GGUF of the default model
SHIPPED_FORMAT = "q4_1"

#: the format the default target runs in: the shipped Q4_1 file. A Q4_0 copy passes faster at
#: every shape measured (llama.cpp repacks Q4_0 for its x86 matrix kernels), but those kernels
#: group a batch's rows by four, so a position's logits change with the batch around it and the
#: backend laws (batched equals alone) fail at tolerance 0 on it; docs/llama-cpp.md, "The weight
#: format of the default target"
DEFAULT_FORMAT = "q4_1"

#: the weight formats `requantize` writes, by name: llama.cpp's `llama_ftype` values
FORMATS = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7}

#: c(n), a decode of n new positions in one-position decodes, for the default model in each
#: format, one thread, AVX2 build: on an AMD EPYC (1x5, 4x5, 8x5 and 16x5 decodes, FACTS.md), and
#: for Q4_0 on a 2-core Intel Xeon model 207 (1x5, 4x5, 16x5; forward_cost_llama_formats.json).
#: llama.cpp's 4-bit paths run one position fast and batch badly, so speculation pays least there.
PASS_COSTS = {
    "q4_0": PassCost("llama.cpp Q4_0, CPU (Intel Xeon model 207, AVX2)", ((1, 1.0), (5, 2.47), (20, 7.20), (80, 28.4))),
    "q4_1": PassCost("llama.cpp Q4_1, CPU (AMD EPYC, AVX2)", ((1, 1.0), (5, 3.75), (20, 12.0), (40, 23.9), (80, 47.0))),
    "q8_0": PassCost("llama.cpp Q8_0, CPU (AMD EPYC, AVX2)", ((1, 1.0), (5, 3.09), (20, 5.85), (40, 10.4), (80, 20.5))),
    "f16": PassCost("llama.cpp F16, CPU (AMD EPYC, AVX2)", ((1, 1.0), (5, 1.95), (20, 4.39), (40, 8.12), (80, 13.5))),
    "f32": PassCost("llama.cpp F32, CPU (AMD EPYC, AVX2)", ((1, 1.0), (5, 1.79), (20, 3.21), (40, 4.89), (80, 9.62))),
}


def requantize(source, destination, weight_format: str, threads: int = 1) -> pathlib.Path:
    """Write a copy of a GGUF model with its weights in another format, by llama.cpp's quantizer.

    Args:
        weight_format: one of FORMATS ("q8_0", "q4_0", ...); a quantized source is dequantized
            first (allow_requantize), so a copy of a 4-bit file holds the 4-bit weights' values
            rounded again to the new format.

    Raises:
        ValueError: for an unknown format or when llama.cpp fails.
    """
    from smc_sd.backends.llama_library import _llama_error, llama_cpp

    if weight_format not in FORMATS:
        raise ValueError(f"unknown weight format {weight_format!r}; use one of {', '.join(FORMATS)}")
    llama = llama_cpp()
    params = llama.llama_model_quantize_default_params()
    params.ftype = FORMATS[weight_format]
    params.allow_requantize = True
    params.nthread = threads
    if llama.llama_model_quantize(str(source).encode(), str(destination).encode(), ctypes.byref(params)) != 0:
        raise ValueError(f"llama.cpp could not write {destination} as {weight_format} from {source}{_llama_error()}")
    return pathlib.Path(destination)


def format_copy(source, weight_format: str) -> pathlib.Path:
    """The copy of GGUF `source` in `weight_format`, written by `requantize` on first use into
    smc-sd's cache and read from there later.

    Raises:
        ValueError: as `requantize`.
    """
    from smc_sd.models.smollm2 import cache_root

    source = pathlib.Path(source).resolve()
    stat = source.stat()
    key = hashlib.sha256(f"{source}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    destination = cache_root() / "gguf" / f"{source.stem}-{key}.{weight_format}.gguf"
    if destination.is_file():
        return destination
    destination.parent.mkdir(parents=True, exist_ok=True)
    handle, scratch = tempfile.mkstemp(prefix=f".{destination.name}-", dir=destination.parent)
    os.close(handle)
    try:
        requantize(source, scratch, weight_format)
        os.replace(scratch, destination)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return destination


def format_path(weight_format: str) -> pathlib.Path:
    """The GGUF file the default model runs from in `weight_format`: the shipped file for
    SHIPPED_FORMAT, its cached copy (`format_copy`, written on first use) otherwise."""
    from smc_sd.models.smollm2 import gguf_path

    shipped = gguf_path()
    return shipped if weight_format == SHIPPED_FORMAT else format_copy(shipped, weight_format)
