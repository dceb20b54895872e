"""Linear layers through oneDNN on the CPU.

A float32 `torch.nn.functional.linear` on the CPU calls the BLAS torch was built with (MKL). On
a 2-core AMD EPYC (one thread) oneDNN's inner product over the same dense weights
(`torch.ops.mkldnn._linear_pointwise`, the kernel inductor and vLLM's CPU backend use) made a
whole float32 forward of the default model 1.14x faster for one token, 1.26x for 1x5, 1.53x for
4x5 and 1.73x for 16x5 tokens (`benchmarks/forward_cost.py --linear onednn,blas`,
results/forward_cost_onednn_vs_blas.json); the linear layers alone gain up to 2.2x on a long
prefill. In bfloat16 torch already calls oneDNN.

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
