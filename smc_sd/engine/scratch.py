"""Vocabulary-sized scratch blocks, reused from one engine cycle to the next.

A cycle forms a few [R, V] float32 blocks that die within one call: the shifted scores of a
draw (`sampling.tokens_from_uniforms`), the target's log-probabilities of an importance block
(`block_scores.score_rows`) or of the accept/reject positions (`accept_scores.accept_scores`),
the logits divided by a temperature before either, the terms of a masked normaliser
(`sampling.logsumexp_floored`).
On a CPU each fresh block is faulted in page by page (12.6 MB at R = 64, V = 49,152; 63 MB for
an smc-sd N = 4, K = 4 block of 16 requests), and glibc returns blocks that large to the kernel
when they are freed, so every cycle pays the faults again. Writing into a block kept from the
last cycle does not (`benchmarks/sampling.py`, its `scratch` rows: one thread, huge pages on, a
draw over 64 rows 2.9 ms instead of 3.5 ms, a log-softmax over [64, 5, 49,152] 8.3 ms instead
of 10.5 ms; `results/sampling.json`).

A `Scratch` belongs to one engine, which lends it to the functions its cycle calls
(`smc_sd.engine.cycle_locals`). `block(purpose, ...)` hands out that engine's block for the
purpose, grown to the largest shape asked so far; outside an engine cycle (a function called
on its own, a test) or while `torch.compile` traces, it allocates a fresh tensor, so a function
that asks for a block is correct anywhere. A block's contents are undefined: its caller overwrites all of it, and no view
of it outlives the call that asked for it. Each purpose is asked for by one call site, so two
live blocks never share memory. The engine holds at most one block per purpose, as large as the
largest cycle so far, until the engine is freed.
"""

from __future__ import annotations

import math

import torch

from smc_sd.engine.cycle_locals import lent


class Scratch:
    """One engine's scratch blocks, one flat buffer per (purpose, dtype, device)."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def take(self, purpose: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A [shape] view of the purpose's buffer, grown to at least its size."""
        size = math.prod(shape)
        key = (purpose, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < size:
            buffer = self._buffers[key] = torch.empty(size, dtype=dtype, device=device)
        return buffer[:size].view(shape)


def block(purpose: str, like: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A tensor of `like`'s dtype and device (and shape, unless `shape` is given), contents
    undefined: the running engine's scratch block for `purpose`, or fresh memory outside a cycle."""
    shape = tuple(like.shape) if shape is None else shape
    scratch = lent("scratch")
    if scratch is None or torch.compiler.is_compiling():
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    return scratch.take(purpose, shape, like.dtype, like.device)
