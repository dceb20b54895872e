"""Linear layers through oneDNN on the CPU.

A float32 `torch.nn.functional.linear` on the CPU calls the BLAS torch was built with (MKL). On
a 2-core AMD EPYC (one thread) that path computed the default model's linear layers 1.2x (one
row) to 2.2x (a 1,000-token prefill) slower than oneDNN's inner product over the same dense
weights (`torch.ops.mkldnn._linear_pointwise`, the kernel inductor and vLLM's CPU backend use):
at 25 rows, as in a batched verify pass, 92 ms against 46 ms per pass. In bfloat16 torch already
calls oneDNN, and the two agree in speed.

`use_onednn_linears(model)` makes every `nn.Linear` of `model` compute y = x W^T + b with that
kernel whenever the input is a float32 CPU tensor and no gradient is recorded; anything else
(another dtype or device, autograd, a forward being compiled) takes `F.linear` as before. The
weights stay the module's own dense parameters: nothing is copied, ties (a head tied to the
embedding) hold, and the logits differ from `F.linear`'s only in the order of their sums.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's linear kernel on the CPU."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`nn.Linear.forward` through oneDNN where the module docstring says, else `F.linear`."""
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or self.weight.dtype != torch.float32
        or not self.weight.is_contiguous()
        or torch.is_grad_enabled()
        or torch.compiler.is_compiling()
    ):
        return F.linear(x, self.weight, self.bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")


def use_onednn_linears(model: torch.nn.Module) -> int:
    """Route the forward of every `nn.Linear` in `model` through `onednn_forward`.

    Returns:
        how many layers were routed (0 when this torch build has no oneDNN).
    """
    if not onednn_linear_available():
        return 0
    routed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(onednn_forward, module)
            routed += 1
    return routed
