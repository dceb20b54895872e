"""The slot table: the particles of every running request in fixed-shape tensors.

M = `max_slots` particle slots and T token columns, sized at construction. A request of N
particles takes N free slots when it joins and gives them back when it leaves; slot i of a
request holds its particle i for the request's whole life (resampling overwrites a slot with its
ancestor's state, it never moves a particle). The engine's hot path only gathers a request's
slots into a `Particles` (`particles`), runs the pure functions of `smc_sd.engine.smc` on it and
scatters the result back (`store`).

Per slot:

| field      | shape, dtype     | meaning                                                        |
|------------|------------------|----------------------------------------------------------------|
| tokens     | [M, T] int64     | generated tokens (EOS filler after a particle's end)            |
| finished   | [M] bool         | the particle's string has ended (EOS or a stop string)          |
| stopped    | [M] bool         | it ended by a stop string (completeness not yet known)          |
| logw       | [M] float64      | log weight relative to the request's last resampling            |
| log_twist  | [M] float64      | the twist inside logw                                           |
| log_phi    | [M] float64      | the block-end potentials inside logw                            |
| target_row | [M] int64        | the row holding the particle in the target's rows, -1 for none  |
| draft_row  | [M] int64        | the same in the draft's rows                                    |

Invariants (`check_invariants`): the free list holds each slot at most once, exactly the slots
no request holds; a free slot has no rows; a finished particle has no rows.
"""

from __future__ import annotations

import torch

from smc_sd.engine.smc import Particles


class SlotTable:
    """Fixed-shape particle state of every running request.

    Args:
        max_slots: M, particles of all running requests together, at most.
        columns: T, generated tokens per particle, at most (plus one block's overshoot).
    """

    def __init__(self, max_slots: int, columns: int):
        if max_slots < 1 or columns < 1:
            raise ValueError(f"a slot table needs max_slots >= 1 and columns >= 1, got {max_slots} and {columns}")
        self.max_slots, self.columns = max_slots, columns
        # [M, T]
        self.tokens = torch.zeros(max_slots, columns, dtype=torch.int64)
        # [M] each
        self.finished = torch.zeros(max_slots, dtype=torch.bool)
        self.stopped = torch.zeros(max_slots, dtype=torch.bool)
        self.logw = torch.zeros(max_slots, dtype=torch.float64)
        self.log_twist = torch.zeros(max_slots, dtype=torch.float64)
        self.log_phi = torch.zeros(max_slots, dtype=torch.float64)
        self.target_row = torch.full((max_slots,), -1, dtype=torch.int64)
        self.draft_row = torch.full((max_slots,), -1, dtype=torch.int64)
        # popped from the end, so low slots are handed out first
        self._free = list(range(max_slots - 1, -1, -1))

    @property
    def free(self) -> int:
        """Slots no request holds."""
        return len(self._free)

    def allocate(self, n: int) -> torch.Tensor:
        """Take n free slots ([n] int64), their state reset.

        Raises:
            ValueError: if fewer than n slots are free.
        """
        if n > len(self._free):
            raise ValueError(f"{n} slots asked for, {len(self._free)} free")
        slots = torch.tensor([self._free.pop() for _ in range(n)], dtype=torch.int64)
        self.finished[slots] = False
        self.stopped[slots] = False
        self.logw[slots] = 0.0
        self.log_twist[slots] = 0.0
        self.log_phi[slots] = 0.0
        self.target_row[slots] = -1
        self.draft_row[slots] = -1
        return slots

    def release(self, slots: torch.Tensor) -> None:
        """Give the slots back; they hold no rows from now on."""
        self.target_row[slots] = -1
        self.draft_row[slots] = -1
        self._free.extend(slots.tolist())

    def particles(self, slots: torch.Tensor, generated: int) -> Particles:
        """The request's particles, gathered from its slots ([N] int64), S = `generated` tokens.

        `target_unseen` is every particle's last token (the target reads it next cycle);
        `draft_unseen` is not kept (the batched engine feeds the draft from the tokens).
        """
        tokens = self.tokens[slots, :generated]
        return Particles(
            tokens=tokens,
            finished=self.finished[slots],
            logw=self.logw[slots],
            log_twist=self.log_twist[slots],
            log_phi=self.log_phi[slots],
            target_unseen=tokens[:, -1:],
            draft_unseen=None,
        )

    def store(self, slots: torch.Tensor, state: Particles) -> None:
        """Scatter a request's particles back into its slots.

        Raises:
            ValueError: if the particles have more tokens than the table has columns.
        """
        generated = state.tokens.shape[1]
        if generated > self.columns:
            raise ValueError(f"{generated} tokens per particle exceed the slot table's {self.columns} columns")
        self.tokens[slots, :generated] = state.tokens
        self.finished[slots] = state.finished
        self.logw[slots] = state.logw
        self.log_twist[slots] = state.log_twist
        self.log_phi[slots] = state.log_phi

    def check_invariants(self) -> None:
        """Raise AssertionError if a listed invariant fails."""
        free = torch.tensor(self._free, dtype=torch.int64)
        assert len(set(self._free)) == len(self._free), "a slot is on the free list twice"
        assert bool((self.target_row[free] == -1).all() and (self.draft_row[free] == -1).all()), "a free slot holds a row"
        assert bool((self.target_row[self.finished] == -1).all()), "a finished particle holds a target row"
        assert bool((self.draft_row[self.finished] == -1).all()), "a finished particle holds a draft row"
