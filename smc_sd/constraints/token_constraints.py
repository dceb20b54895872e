"""Boolean constraints on generated token sequences, seen as next-token masks.

A constraint is a potential phi(x) in {0, 1} on completions with a prefix test. The engine only
ever asks one question of it, for a batch of generated prefixes x_<t (prompt excluded):

    mask[b, v] = 1  iff  x_<t + v can still be completed in the language   (v != EOS)
    mask[b, EOS] = 1  iff  x_<t itself is a complete string of the language.

With an exact prefix test the product of the masks along a sequence is phi of the sequence, so
masking both the draft and the bonus token and adding the masked normalisers to the weights
targets p_T(x)^alpha · phi(x) exactly. A sequence the token budget cuts has phi = 1 iff it is
itself complete (mask[EOS] after it), which the engine applies to the final weights. A prefix
whose mask is all zero is a dead end.
"""

from __future__ import annotations

import abc
from typing import Callable

import numpy as np
import torch


def stack_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """B masks [1, V] bool as one new [B, V] bool (numpy copies bool rows 3x faster than torch.cat)."""
    return torch.from_numpy(np.concatenate([row.numpy() for row in rows]))


class UnsatisfiableConstraintError(ValueError):
    """The constraints admit no string at all (the mask of the empty prefix is all zero)."""


class TokenConstraint(abc.ABC):
    """A 0/1 potential on token sequences, queried as next-token masks."""

    @abc.abstractmethod
    def mask(self, prefixes: list[list[int]]) -> torch.Tensor:
        """Next-token masks of a batch of generated prefixes.

        Args:
            prefixes: B lists of generated token ids (no EOS inside).

        Returns:
            [B, V] bool; see the module docstring.
        """

    def mask_rows(self, prefixes: list[list[int]]) -> tuple[list[torch.Tensor], list[bool]]:
        """`mask` row by row, with whether each row allows no token (a dead end).

        Derived from `mask`; a constraint that answers faster overrides it.

        Args:
            prefixes: B >= 1 lists of generated token ids (no EOS inside).

        Returns:
            (B tensors [1, V] bool, B bools). Equal rows may be one tensor shared between calls:
            masks are read, never written.
        """
        masks = self.mask(prefixes)
        # a row-wise any() as a uint8 max: torch's bool any() is 20x slower on CPU
        allowed = masks.view(torch.uint8).amax(1).tolist()
        return list(masks.split(1)), [not a for a in allowed]

    def forced_tokens(self, prefix: list[int]) -> list[int]:
        """Tokens every completion of the prefix starts with, as far as this constraint can tell
        cheaply (a free draft proposes them); [] when it cannot. Never a token the mask refuses.

        Args:
            prefix: generated token ids (no EOS inside).
        """
        return []


class PredicateConstraint(TokenConstraint):
    """A constraint given by two predicates on token tuples (for toy vocabularies).

    Args:
        viable: viable(x) is True iff some completion of the prefix x lies in the language.
        complete: complete(x) is True iff x itself lies in the language.
        vocab_size: V; eos: the EOS id, never passed inside x.

    Rows are memoised per prefix, so the predicates must be pure.
    """

    def __init__(
        self,
        viable: Callable[[tuple[int, ...]], bool],
        complete: Callable[[tuple[int, ...]], bool],
        vocab_size: int,
        eos: int,
    ):
        self.viable, self.complete, self.vocab_size, self.eos = viable, complete, vocab_size, eos

        self._rows: dict[tuple[int, ...], list[bool]] = {}

    def _row(self, x: tuple[int, ...]) -> list[bool]:
        if x not in self._rows:
            self._rows[x] = [self.complete(x) if v == self.eos else self.viable(x + (v,)) for v in range(self.vocab_size)]
        return self._rows[x]

    def mask(self, prefixes: list[list[int]]) -> torch.Tensor:
        # [B, V] bool
        return torch.tensor([self._row(tuple(prefix)) for prefix in prefixes], dtype=torch.bool)


class ConjunctionConstraint(TokenConstraint):
    """phi = prod_c phi_c, masked as the AND of the members' masks.

    The AND allows a token when every member can still complete the prefix, each on its own: a
    superset of the tokens after which one string completes all of them, so a particle may reach
    a prefix no token extends (it then gets weight zero). EOS is exact (allowed iff every member is
    complete), so the product of the masks along a string is still phi of the string.
    """

    def __init__(self, members: tuple[TokenConstraint, ...]):
        self.members = members

    def mask(self, prefixes: list[list[int]]) -> torch.Tensor:
        out = self.members[0].mask(prefixes)
        for member in self.members[1:]:
            out = out & member.mask(prefixes)
        return out
