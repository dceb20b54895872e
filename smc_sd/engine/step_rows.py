"""The rows of the batched step: the particles of many SMC-SD requests as one set of tensors.

The requests that `smc_sd.engine.importance_step` verifies together (`ImportanceGroup.
verifies_in_step`) and that draft with one model and one draft length K form a `StepRows` for
the cycle. Its tensors are gathered from the `SlotTable` once per cycle, whatever the number of
requests:

| field     | shape, dtype | meaning                                                          |
|-----------|--------------|------------------------------------------------------------------|
| slots     | [N] int64    | every particle's slot, request after request, particle order    |
| request   | [N] int64    | the index of its request within the step                        |
| particle  | [N] int64    | its index within its request                                    |
| active    | [N] bool     | unfinished before the cycle (the particles that hold rows)      |
| live      | [A] int64    | slots[active]: the rows' particles                              |
| owner     | [A] int64    | request[active]                                                 |
| keys      | [A] x 3      | each row's request seed, cycle and particle (`DrawKeys`)        |

An unconstrained step drafts for all its rows at once (`drafter`: per-row temperatures, draws
keyed by request seed, cycle and particle, so each request draws what it draws alone); a
constrained request's masks depend on its own tokens, so its drafter is its own
(`ImportanceGroup.prepare`) and the step gathers the blocks afterwards (`from_groups`).

Dimension letters: G requests, N particles of all of them, A unfinished ones, K draft length,
V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from smc_sd.engine.drafting import BlockDrafter, DraftBlock, DrawKeys
from smc_sd.engine.sampling import scaling
from smc_sd.engine.slots import SlotTable


@dataclass
class StepRows:
    """One cycle's rows of requests verified together (see the module's table).

    Attributes:
        groups: the G `ImportanceGroup`s, in running order.
        table: the engine's slot table.
        draft_len: K, shared by every request of the step.
        drafter: the joint drafter of an unconstrained step with K > 0 (else None).
    """

    groups: list
    table: SlotTable
    draft_len: int
    slots: torch.Tensor
    request: torch.Tensor
    particle: torch.Tensor
    active: torch.Tensor
    live: torch.Tensor
    owner: torch.Tensor
    keys: DrawKeys
    drafter: BlockDrafter | None = None

    @staticmethod
    def of(groups: list, table: SlotTable, joint_drafter: bool) -> "StepRows":
        """Gather the step's rows from the table; with `joint_drafter` (unconstrained requests,
        K > 0) one drafter for all of them."""
        sizes = [g.plan.particles for g in groups]
        slots = torch.cat([g.slots for g in groups])
        request = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor(sizes))
        # [N]: the index of each particle within its request
        particle = torch.arange(slots.numel()) - torch.tensor([0] + sizes[:-1]).cumsum(0)[request]
        active = ~table.finished[slots]
        owner = request[active]
        # [A]: each row's request seed and cycle, and its particle index
        request_keys = torch.tensor([g.key for g in groups], dtype=torch.int64)[owner]
        cycles = torch.tensor([len(g.cycles) for g in groups], dtype=torch.int64)[owner]
        keys = DrawKeys(request_keys, cycles, particle[active])
        step = StepRows(groups, table, groups[0].draft_len, slots, request, particle, active, slots[active], owner, keys)
        if joint_drafter and step.draft_len:
            temperatures = [g.plan.draft_temperature for g in groups]
            # [A]: each row's T_d
            step.drafter = BlockDrafter(torch.tensor(temperatures, dtype=torch.float32)[owner], 0.0 in temperatures, keys, scaled=scaling(temperatures))
        return step

    def rows_of(self, row_of: torch.Tensor) -> torch.Tensor:
        """[A] int64: the step's rows in one model's rows (`SlotTable.target_row` or
        `draft_row`)."""
        return row_of[self.live]

    def draft_feed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What each draft row reads first: the last two tokens of its prompt + generated tokens
        ([A, 2] int64; the prompt's last token before a particle's only generated token), and
        [A] int64 counts (2)."""
        table = self.table
        prompt_last = torch.tensor([g.prompt[-1] for g in self.groups], dtype=torch.int64)[self.owner]
        # [A, 2]: the columns of the last two generated tokens, -1 for the prompt's last
        columns = table.length[self.live][:, None] + torch.tensor([-2, -1])
        tokens = table.tokens[self.live[:, None], columns.clamp(min=0)]
        tokens = torch.where(columns < 0, prompt_last[:, None], tokens)
        return tokens, torch.full((self.live.numel(),), 2, dtype=torch.int64)

    def block(self, vocab_size: int) -> DraftBlock:
        """The cycle's drafted block of every row ([A, K] tokens): the joint drafter's, or the
        requests' own drafters' gathered request after request."""
        if self.drafter is not None:
            return self.drafter.block(vocab_size)
        if not self.draft_len:
            return DraftBlock.empty(self.live.numel(), vocab_size)
        blocks = [g.drafter.block(vocab_size) for g in self.groups]
        dead = None
        if any(b.dead is not None for b in blocks):
            dead = torch.cat([b.dead if b.dead is not None else torch.zeros(b.tokens.shape, dtype=torch.bool) for b in blocks])
        return DraftBlock(torch.cat([b.tokens for b in blocks]), torch.cat([b.drawn_logq for b in blocks]), None, None, dead)

    def target_feed(self, block: DraftBlock) -> tuple[torch.Tensor, torch.Tensor]:
        """What each target row reads: its last token and the drafted block ([A, K + 1] int64),
        and [A] int64 counts (K + 1)."""
        table = self.table
        last = table.tokens[self.live, table.length[self.live] - 1]
        tokens = torch.cat([last[:, None], block.tokens], 1)
        return tokens, torch.full((self.live.numel(),), tokens.shape[1], dtype=torch.int64)

    def unfinished_counts(self) -> list[int]:
        """A_g per request: its particles unfinished before the cycle."""
        return torch.bincount(self.owner, minlength=len(self.groups)).tolist()


def joint_steps(groups: list, table: SlotTable) -> list[StepRows]:
    """The steps of unconstrained requests that the batched step verifies: one per draft model
    and draft length K, each drafting for all its rows at once; requests in running order."""
    buckets: dict[tuple[int, int], list] = {}
    for g in groups:
        buckets.setdefault((id(g.plan.draft) if g.draft_len else 0, g.draft_len), []).append(g)
    return [StepRows.of(members, table, joint_drafter=True) for members in buckets.values()]
