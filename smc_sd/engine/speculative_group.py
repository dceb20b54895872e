"""A running exact speculative decoding or mask-at-verify request of the batched engine.

One sequence in one slot. Per cycle it prepares its block (`prepare`: the free draft's
proposal, the draft LM's sampler, or nothing), the engine verifies every such request at once
(`smc_sd.engine.speculative_step.verify_speculative_rows`, which writes the new tokens into
the slot table) and the group does its Python accounting (`conclude`): stop strings, the free
draft's statistics, the cycle's statistics.
"""

from __future__ import annotations

import math

import torch

from smc_sd.engine.drafting import BlockDrafter, block_masks
from smc_sd.engine.free_drafts import FreeDrafter
from smc_sd.engine.groups import Group, first_stop
from smc_sd.engine.result import AllParticlesDiedError, CycleStats, Result
from smc_sd.engine.slots import SlotTable
from smc_sd.engine.speculative import first_token, free_block
from smc_sd.engine.speculative_step import ProposedBlock, Verdict


class SpeculativeGroup(Group):
    """A request of an accept/reject plan (exact speculative decoding, mask-at-verify): one
    sequence, verified with every other such request in one step
    (`smc_sd.engine.speculative_step`). With a free draft, a cycle whose free draft proposes
    verifies that proposal (point masses); any other cycle drafts K tokens from the draft LM, or
    with no draft LM verifies nothing (one target token). The sequence's tokens are kept as a
    Python list beside the slot table, so the per-cycle bookkeeping costs no tensor work."""

    def __init__(self, request, plan, table: SlotTable):
        super().__init__(request, plan, table)
        self.free_drafter = FreeDrafter.for_plan(plan, self.prompt) if plan.free is not None else None
        #: the sequence's slot
        self.slot = int(self.slots[0])
        #: its generated tokens (the slot table holds the same)
        self.tokens: list[int] = []
        #: whether it ended (EOS or a stop string)
        self.finished = False
        #: the cycle's block when it is not the draft LM's: the free draft's, or an empty one
        self.fixed_block: ProposedBlock | None = None
        #: tokens of prompt + generated the draft row has read (it reads nothing on a cycle
        #: whose block is the free draft's, and catches up at the next draft LM cycle)
        self.draft_read = len(self.prompt)
        #: leading tokens of the free draft's block that the constraints force
        self.forced = 0

    @property
    def plain_seats(self) -> bool:
        """Its one row is plain without a draft LM (a draft row's length follows `draft_read`)."""
        return not self.has_draft

    def begin(self, first_logits: torch.Tensor, target_base: int, draft_base: int) -> None:
        """Draw the first token; the sequence's rows are the ones just joined.

        Raises:
            AllParticlesDiedError: when no first token has nonzero probability.
        """
        first = first_token(self.plan, first_logits, self.first_mask, self.generator)
        if first is None:
            raise AllParticlesDiedError("no first token has nonzero probability under the target (and its constraints, if any)", self.result(None))
        stop = first_stop(self.plan.target.decode, [], [first] if first != self.eos else [], self.request.stop)
        self._extend([first], first == self.eos or stop is not None)
        self.table.tokens[self.slot, 0] = first
        self.table.length[self.slot] = 1
        self.table.finished[self.slot] = self.finished
        self.table.stopped[self.slot] = stop is not None
        self.draft_read = len(self.prompt) - 1
        self.table.target_row[self.slots] = -1 if self.finished else target_base
        self.table.draft_row[self.slots] = -1 if self.finished else draft_base

    @property
    def done(self) -> bool:
        return self.finished or self.generated >= self.plan.max_tokens

    def prepare(self) -> None:
        """The cycle's block source and masks: the free draft's proposal where it proposes,
        else the draft LM's sampler (or an empty block without one)."""
        plan = self.plan
        free = free_block(plan, self.free_drafter, self.tokens) if self.free_drafter is not None else None
        if free is not None:
            self.fixed_block, self.forced = free
            return
        if self.has_draft:
            self.mask_at = None if plan.masker is None else block_masks(plan.masker, [self.tokens], [True], self.eos)
            self.fixed_block = None
            self.drafter = BlockDrafter.for_request(plan.draft_temperature, self.key, len(self.cycles), torch.zeros(1, dtype=torch.int64), self.mask_at, keep_logq=True)
        else:
            # the bonus token alone: its mask after the tokens so far
            self.mask_at = None
            self.fixed_block = ProposedBlock([], masks=None if plan.masker is None else plan.masker([self.tokens], [True])[0])

    @property
    def draft_len(self) -> int:
        """K this cycle: the draft LM's (it drafts only when no fixed block stands)."""
        return 0 if self.fixed_block is not None else self.plan.draft_len

    def proposal(self, vocab_size: int) -> ProposedBlock:
        """The cycle's block to verify: the fixed one, or the draft LM's draws with the masks
        after each drafted prefix."""
        if self.fixed_block is not None:
            return self.fixed_block
        block = self.drafter.block(vocab_size)
        if self.mask_at is None:
            return ProposedBlock(block.tokens[0].tolist(), block.logq[0])
        masks = torch.cat([block.masks[0], self.mask_at(block.tokens)[0]])
        return ProposedBlock(block.tokens[0].tolist(), block.logq[0], masks, block.dead[0])

    def draft_feed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([1, n] int64, [1]: n): the tokens of prompt + generated the draft row has not read (n >= 2)."""
        unread = (self.prompt + self.tokens)[self.draft_read :]
        return torch.tensor([unread]), torch.tensor([len(unread)])

    def draft_lengths(self, seated: torch.Tensor) -> torch.Tensor:
        """[1] int64: what the draft row holds between cycles: all but the last two tokens, or
        less after cycles whose blocks were the free draft's."""
        return torch.tensor([min(self.draft_read, len(self.prompt) + self.generated - 2)])

    def particle_tokens(self) -> list[list[int]]:
        return [list(self.tokens)]

    def conclude(self, block: ProposedBlock, verdict: Verdict) -> None:
        """The cycle's accounting after the step wrote `verdict.new` into the slot: a stop
        string cuts the new tokens where it completes (and ends the sequence).

        Raises:
            AllParticlesDiedError: when the constraints leave the sequence no token.
        """
        if verdict.dead:
            raise AllParticlesDiedError("the constraints left the sequence no token of nonzero probability", self.result(None))
        new, stopped = verdict.new, False
        column = first_stop(self.plan.target.decode, self.tokens, [t for t in new if t != self.eos], self.request.stop)
        if column is not None:
            new, stopped = new[: column + 1], True
            self.table.length[self.slot] = self.generated + len(new)
            self.table.finished[self.slot] = self.table.stopped[self.slot] = True
            self.table.target_row[self.slot] = self.table.draft_row[self.slot] = -1
        proposed, accepted = len(block.tokens), verdict.accepted
        if self.fixed_block is not None and proposed:
            self.free_drafter.record(proposed, self.forced, accepted)
        self.accepted += accepted
        self.drafted += proposed
        self.draft_passes += self.draft_len
        if self.fixed_block is None and self.has_draft:
            # the draft read the unread tokens and K - 1 drafts; it keeps all but the last two
            self.draft_read = len(self.prompt) + self.generated + len(new) - 2
        self._extend(new, verdict.finished or stopped)
        self.cycles.append(CycleStats(1.0, False, 0.0, len(new), 1, accepted=accepted, proposed=proposed))

    def result(self, kv: dict | None) -> Result:
        tokens, masker = self.tokens, self.plan.masker
        complete = masker is None or self.eos in tokens or bool(masker.complete([tokens])[0])
        # an incomplete string has weight zero, as in `conclude`
        log_weight = 0.0 if complete else -math.inf
        return self._result([list(tokens)], [self.finished], torch.full((1,), log_weight, dtype=torch.float64), log_weight, 0, complete, kv)

    def _extend(self, new: list[int], finished: bool) -> None:
        """The Python side of appending tokens (the slot table is written by the caller)."""
        self.tokens = self.tokens + new
        self.generated += len(new)
        self.tokens_out += len(new)
        self.finished = finished
