"""Linear layers through oneDNN on the CPU, with weights packed in oneDNN's blocked layout.

A float32 `torch.nn.functional.linear` on the CPU calls the BLAS torch was built with (MKL), and
a bfloat16 one calls oneDNN on the dense weight. `use_onednn_linears(model)` makes every
`nn.Linear` compute y = x W^T + b with oneDNN's inner product (`torch.ops.mkldnn._linear_pointwise`,
the kernel inductor and vLLM's CPU backend call) whenever the input is a float32 or bfloat16 CPU
tensor of the weight's dtype and no gradient is recorded; anything else (another device or a
mixed dtype, autograd, a forward being compiled) takes `F.linear` as before.

Packed weights. A pass of few tokens streams every weight once, and in oneDNN's blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, made at a layer's first call) that stream runs
faster. The default model's linear layers over T tokens, a 2-core AMD EPYC, one thread
(`benchmarks/linear_kernels.py`, results/linear_kernels.json), ms:

    T                        1      4     16     48    128    512   1024   2048   4096
    float32  F.linear      31.7   46.0   74.5    151    341   1283   2547   5273  10443
    float32  oneDNN dense  21.7   34.5   46.3   82.5    160    618   1215   2464   5726
    float32  oneDNN packed 17.1   18.8   30.8   65.1    147    576   1177   2348   5344
    bfloat16 F.linear      19.2   20.2   25.7   41.5   81.3    299    574   1167   2367
    bfloat16 oneDNN dense  19.0   18.8   25.5   42.2   83.3    300    588   1141   2275
    bfloat16 oneDNN packed 11.6   12.5   17.9   34.7   76.5    284    568   1131   2179

The packed copy is memory the dense weight already takes, once more: the dense weight stays the
module's parameter (ties, `state_dict` and the `F.linear` paths keep it). So weights are packed
only when the model's linear weights take at most PACKING_MEMORY_SHARE of the memory available
when it is routed; a larger model computes from its dense weights (oneDNN too). A weight changed in
place or replaced after packing is packed again at its next call, so the packed copy is never
stale. The results differ from `F.linear`'s only in the order of their sums.
"""

from __future__ import annotations

import os
import types

import torch
import torch.nn.functional as F

#: the row count oneDNN chooses the packed layout for (16 rows: a batched decoding pass)
PACKING_ROWS_HINT = 16
#: weights are packed when their copy takes at most this share of the available memory
PACKING_MEMORY_SHARE = 0.25


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's linear kernels on the CPU."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes routed: float32, and bfloat16 where oneDNN computes it natively."""
    native_bf16 = hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported") and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return (torch.float32, torch.bfloat16) if native_bf16 else (torch.float32,)


class PackedWeight:
    """A layer's weight in oneDNN's blocked layout and the stamp of the weight it was packed from.

    The packed tensor is opaque (no storage to copy): a copied layer carries an empty one and
    packs its own weight at its first call.
    """

    def __init__(self):
        self.stamp, self.tensor = None, None

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed `weight`, packed again if it changed in place or was replaced since."""
        stamp = (weight.data_ptr(), weight._version, weight.dtype)
        if stamp != self.stamp:
            self.stamp, self.tensor = stamp, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_ROWS_HINT)
        return self.tensor

    def __deepcopy__(self, memo) -> PackedWeight:
        return PackedWeight()


def onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`nn.Linear.forward` through oneDNN where the module docstring says, else `F.linear`."""
    weight = self.weight
    if (
        x.device.type != "cpu"
        or weight.device.type != "cpu"
        or x.dtype != weight.dtype
        or weight.dtype not in self._onednn_dtypes
        or not weight.is_contiguous()
        or torch.is_grad_enabled()
        or torch.compiler.is_compiling()
    ):
        return F.linear(x, weight, self.bias)
    kernel_weight = self._onednn_packed.of(weight) if self._onednn_pack else weight
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), kernel_weight, self.bias, "none", [], "")


def available_memory_bytes() -> int:
    """The memory the operating system can give now (MemAvailable), in bytes."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def use_onednn_linears(model: torch.nn.Module, pack: bool | None = None) -> int:
    """Route the forward of every `nn.Linear` in `model` through `onednn_forward`.

    Args:
        pack: compute from packed weights; None: when the linear weights (each counted once)
            take at most PACKING_MEMORY_SHARE of `available_memory_bytes()`.

    Returns:
        how many layers were routed (0 when this torch build has no oneDNN).
    """
    if not onednn_linear_available():
        return 0
    dtypes = onednn_dtypes()
    layers = [module for module in model.modules() if type(module) is torch.nn.Linear]
    if pack is None:
        weights = {layer.weight.data_ptr(): layer.weight.nbytes for layer in layers}
        pack = sum(weights.values()) <= PACKING_MEMORY_SHARE * available_memory_bytes()
    for layer in layers:
        layer._onednn_dtypes, layer._onednn_pack, layer._onednn_packed = dtypes, pack, PackedWeight()
        layer.forward = types.MethodType(onednn_forward, layer)
    return len(layers)
