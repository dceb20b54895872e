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

from smc_sd.constraints.token_constraints import ConjunctionConstraint, TokenConstraint, stack_rows


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
        self._conjunction = constraints[0] if len(constraints) == 1 else ConjunctionConstraint(constraints)
        # [1, V] bool: the mask of a row that is not live
        self._everything = torch.ones(1, vocab_size, dtype=torch.bool)
        # N -> [N] bool all False: `dead` when no row is (a torch.tensor call costs ~30 µs after a model pass)
        self._none_dead: dict[int, torch.Tensor] = {}
        self.calls = 0
        self.seconds = 0.0
        self.row_seconds: list[float] = []

    def __call__(self, prefixes: list[list[int]], live: torch.Tensor | list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """Masks of the live rows.

        Args:
            prefixes: N lists of generated token ids.
            live: [N] bool (a tensor or a list), rows whose mask matters.

        Returns:
            mask: [N, V] bool (all True on rows that are not live); dead: [N] bool, live rows
            that no token may extend. Both are read, never written: with N = 1 the mask may be
            shared with other calls (equal rows are one tensor), and so may an all-False dead.
        """
        started = time.perf_counter()
        n = len(prefixes)
        flags = live.tolist() if isinstance(live, torch.Tensor) else live
        asked = [i for i in range(n) if flags[i]]
        if len(asked) == n and n:
            rows, dead = self._conjunction.mask_rows(prefixes)
        else:
            rows, dead = [self._everything] * n, [False] * n
            if asked:
                for i, mask, end in zip(asked, *self._conjunction.mask_rows([prefixes[i] for i in asked])):
                    rows[i], dead[i] = mask, end
        # [N, V] bool
        mask = rows[0] if n == 1 else stack_rows(rows) if n else torch.ones(0, self.vocab_size, dtype=torch.bool)
        if any(dead):
            dead = torch.tensor(dead, dtype=torch.bool)
        else:
            dead = self._none_dead.get(n)
            if dead is None:
                dead = self._none_dead[n] = torch.zeros(n, dtype=torch.bool)
        elapsed = time.perf_counter() - started
        self.calls += 1
        self.seconds += elapsed
        if asked:
            self.row_seconds.append(elapsed / len(asked))
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
        # a copy: the mask of one row may be shared
        return self(prefixes, torch.ones(len(prefixes), dtype=torch.bool))[0][:, self.eos].clone()
