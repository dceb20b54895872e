"""Which floating-point dtype a model's weights, activations and KV take: `--dtype {auto,float32,bfloat16}`.

`auto` takes bfloat16 only where the processor multiplies bf16 matrices natively, and float32
elsewhere:
- a CUDA device: bfloat16 where `torch.cuda.is_bf16_supported()`;
- a CPU: bfloat16 where the x86 flags in /proc/cpuinfo name `amx_bf16` (AMX tiles) or
  `avx512_bf16` (bf16 dot products). Without them torch emulates bf16 through fp32 conversions
  and a batched verify runs 2-3x slower than in float32 (measured on an AMD EPYC, Zen 3), so
  halving the weight bytes does not pay. A processor whose flags cannot be read gets float32.

Whatever the dtype, backends return float32 logits; only the passes inside the model and the KV
they keep run in the chosen dtype.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

# torch loads at the first choice: the command line's parser reads DTYPES without it
if TYPE_CHECKING:
    import torch

#: the names `--dtype` takes for the hf backend
DTYPES = ("auto", "float32", "bfloat16")
#: x86 cpu flags of native bf16 matrix instructions
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
CPUINFO = "/proc/cpuinfo"


@dataclass(frozen=True)
class Precision:
    """A chosen dtype and why it was chosen (for the CLI's and the benchmarks' reports)."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        """The dtype's torch name: float32 or bfloat16 (float16 when a vLLM engine is asked for it)."""
        return str(self.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Processor:
    """The CPU as /proc/cpuinfo describes its first core.

    Attributes:
        model: its "model name" line (None where there is none).
        native_bf16_flags: those of NATIVE_BF16_FLAGS its "flags" line names, in that order.
    """

    model: str | None
    native_bf16_flags: tuple[str, ...]

    def to_json(self) -> dict:
        return {"model": self.model, **{flag: flag in self.native_bf16_flags for flag in NATIVE_BF16_FLAGS}}


def read_processor(cpuinfo: str | pathlib.Path = CPUINFO) -> Processor | None:
    """The first core's model name and native bf16 flags; None where the file cannot be read."""
    try:
        text = pathlib.Path(cpuinfo).read_text()
    except OSError:
        return None
    fields: dict[str, str] = {}
    # the first core's block ends at the first blank line
    for line in text.split("\n\n")[0].splitlines():
        key, colon, value = line.partition(":")
        if colon:
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return Processor(fields.get("model name"), tuple(flag for flag in NATIVE_BF16_FLAGS if flag in flags))


def choose_precision(name: str = "auto", device: str | torch.device = "cpu", cpuinfo: str | pathlib.Path = CPUINFO) -> Precision:
    """The dtype `name` means on `device` (module docstring).

    Args:
        name: one of DTYPES.
        device: where the model runs (cpu or cuda).
        cpuinfo: the file holding the CPU's flags (tests pass a fake one).

    Raises:
        ValueError: for a name outside DTYPES.
    """
    import torch

    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    if name != "auto":
        return Precision(getattr(torch, name), "asked for")
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Precision(torch.bfloat16, f"auto: {torch.cuda.get_device_name(device)} supports bf16")
        return Precision(torch.float32, f"auto: {torch.cuda.get_device_name(device)} has no bf16 support")
    processor = read_processor(cpuinfo)
    if processor is None:
        return Precision(torch.float32, f"auto: cannot read the CPU's flags from {cpuinfo}")
    if processor.native_bf16_flags:
        return Precision(torch.bfloat16, f"auto: the CPU has native bf16 matrix instructions ({', '.join(processor.native_bf16_flags)})")
    return Precision(torch.float32, f"auto: the CPU has no native bf16 matrix instructions (no {' or '.join(NATIVE_BF16_FLAGS)})")


def as_dtype(dtype: torch.dtype | str, device: str | torch.device = "cpu") -> torch.dtype:
    """A torch dtype as given, or the one a DTYPES name means on `device`."""
    import torch

    return dtype if isinstance(dtype, torch.dtype) else choose_precision(dtype, device).dtype
