"""Potentials scored at block end: factors phi(x) > 0 of the target that do not become masks.

A soft potential (a reward, a classifier, a non-boolean genlm-control potential) is too costly, or
too graded, to evaluate for every token of the vocabulary. It is scored once per particle per
cycle, on the prefix the particle has after the block:

    log w += log phi(new prefix) - log phi(old prefix)     (phi of the empty prefix taken as 1)

where phi of a finished particle is its complete score. The sum telescopes to log phi(x) of the
final output (its prefix score when the token budget cut it), so the target becomes
p_T(x)^alpha · prod_c phi_c(x). Unlike a twist it stays in the final weights.
"""

from __future__ import annotations

import abc
import asyncio
from typing import Callable

import torch

from smc_sd.constraints.byte_vocabulary import vocabulary_trie


class BlockPotential(abc.ABC):
    """A positive potential on generated token sequences, scored on whole prefixes."""

    @abc.abstractmethod
    def log_score(self, prefixes: list[list[int]], complete: list[bool]) -> torch.Tensor:
        """log phi of each prefix: its complete score where complete[b], else its prefix score.

        Args:
            prefixes: B lists of generated token ids (EOS removed).
            complete: B flags, True where the particle has ended with EOS.

        Returns:
            [B] float64.
        """


class FunctionPotential(BlockPotential):
    """log phi given as a function of (token tuple, complete flag), for toy vocabularies."""

    def __init__(self, log_phi: Callable[[tuple[int, ...], bool], float]):
        self.log_phi = log_phi

    def log_score(self, prefixes: list[list[int]], complete: list[bool]) -> torch.Tensor:
        return torch.tensor([self.log_phi(tuple(p), c) for p, c in zip(prefixes, complete)], dtype=torch.float64)


class BytePotentialScore(BlockPotential):
    """A genlm-control potential over bytes, scored on the prefix's bytes (`prefix` or `complete`).

    Args:
        potential: a genlm-control `Potential` whose vocabulary is bytes.
        lm: the model whose token ids the prefixes hold.
    """

    def __init__(self, potential, lm):
        self.potential = potential
        self._vocabulary = vocabulary_trie(lm)[0]
        self._loop = asyncio.new_event_loop()

    def log_score(self, prefixes: list[list[int]], complete: list[bool]) -> torch.Tensor:
        async def scores():
            texts = [b"".join(self._vocabulary[t] or b"" for t in p) for p in prefixes]
            return await asyncio.gather(
                *[self.potential.complete(t) if c else self.potential.prefix(t) for t, c in zip(texts, complete)]
            )

        return torch.tensor(self._loop.run_until_complete(scores()), dtype=torch.float64)


def as_block_potential(potential, lm) -> BlockPotential:
    """A `BlockPotential` (kept) or a genlm-control potential over bytes (wrapped)."""
    if isinstance(potential, BlockPotential):
        return potential
    return BytePotentialScore(potential, lm)


class ProductPotential(BlockPotential):
    """prod_c phi_c: the sum of the members' log scores."""

    def __init__(self, members: tuple[BlockPotential, ...]):
        self.members = members

    def log_score(self, prefixes: list[list[int]], complete: list[bool]) -> torch.Tensor:
        return sum(m.log_score(prefixes, complete) for m in self.members)
