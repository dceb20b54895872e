"""Batched next-token masks of a program's constraints.

The compiler turns every boolean constraint into one `Masker`. Per cycle the engine asks it for
K + 1 masks, each for all N particles in one call: one before each drafted token and one before
the bonus token (the masked distributions built on them are in `smc_sd.engine.masking`).

A live particle whose mask is all zero is dead (no continuation satisfies the constraints): it
gets weight zero. Particles that are not live (finished, already dead, past an EOS in the block)
get an all-one mask so the batch keeps its static shape; their columns never count.
"""

from __future__ import annotations

import time

import torch

from smc_sd.program.constraints import TokenConstraint


class Masker:
    """The conjunction of a program's constraints, for a batch of particles.

    Args:
        constraints: the boolean constraints (at least one).
        vocab_size: V.
        eos: the EOS id.

    Attributes:
        calls, seconds: mask calls made and their total wall time.
        row_seconds: per call, its wall time divided by its live rows (seconds per
            particle-position), for latency percentiles.
    """

    def __init__(self, constraints: tuple[TokenConstraint, ...], vocab_size: int, eos: int):
        self.constraints, self.vocab_size, self.eos = constraints, vocab_size, eos
        self.calls = 0
        self.seconds = 0.0
        self.row_seconds: list[float] = []

    def __call__(self, prefixes: list[list[int]], live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Masks of the live rows.

        Args:
            prefixes: N lists of generated token ids.
            live: [N] bool, rows whose mask matters.

        Returns:
            mask: [N, V] bool (all True on rows that are not live); dead: [N] bool, live rows
            that no token may extend.
        """
        started = time.perf_counter()
        n = len(prefixes)
        rows = live.nonzero().flatten().tolist()
        if rows:
            live_prefixes = [prefixes[i] for i in rows]
            # [len(rows), V] bool: the conjunction over the constraints
            combined = self.constraints[0].mask(live_prefixes)
            for constraint in self.constraints[1:]:
                combined = combined & constraint.mask(live_prefixes)
        if rows and len(rows) == n:
            mask = combined
        else:
            mask = torch.ones(n, self.vocab_size, dtype=torch.bool)
            if rows:
                mask[rows] = combined
        # a row-wise any() as a uint8 max: torch's bool any() is 20x slower on CPU
        dead = live & ~mask.view(torch.uint8).amax(1).bool()
        elapsed = time.perf_counter() - started
        self.calls += 1
        self.seconds += elapsed
        if rows:
            self.row_seconds.append(elapsed / len(rows))
        return mask, dead

    def forced_tokens(self, prefix: list[int]) -> list[int]:
        """The tokens the first constraint that forces any forces after the prefix ([] if none).

        Another constraint of a conjunction may refuse them: a free draft cuts its proposal at
        the first token the masks refuse.
        """
        for constraint in self.constraints:
            forced = constraint.forced_tokens(prefix)
            if forced:
                return forced
        return []

    def complete(self, prefixes: list[list[int]]) -> torch.Tensor:
        """[B] bool: whether each prefix is a complete string of every constraint (EOS allowed)."""
        if not prefixes:
            return torch.zeros(0, dtype=torch.bool)
        return self(prefixes, torch.ones(len(prefixes), dtype=torch.bool))[0][:, self.eos]
