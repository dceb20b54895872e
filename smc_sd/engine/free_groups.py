"""A running SMC-SD request with a free draft in the batched engine (`smc_sd.engine.smc_free`).

Every particle is extended by exact speculative sampling of the locally masked target q_loc,
its free draft the point-mass draft, and weighted by the local normalisers Z of the positions
it kept; block-end potentials and a twist rescore the extended prefixes, and ESS, resampling,
log Z_hat and the end of the run are SMC-SD's (`ImportanceGroup`). The group runs on its own
particles, from its own generator, so its result for a seed does not depend on what runs
beside it.

Particles end a cycle at different lengths: the slot table keeps each one's (`SlotTable.length`)
and a row holds its prompt and its generated tokens but the last. Particles holding equal tokens
(copies made by resampling) hold one row between cycles (`seats`): one computed row feeds them
all, and the reseat after the pass copies it (block pointers) for each particle at its own length.

With a draft LM beside the free draft (free+NAME), a cycle in which the free draft proposes
nothing for any running particle is an SMC-SD cycle with the draft LM instead: every running
particle drafts K tokens from q, the target verifies them and draws the bonus, and the weight
gains sum_k [alpha log p_T(x_k) - log q~(x_k)] + log Z (`smc_sd.engine.smc.verify_block`). The
kernel of a cycle is chosen from the particles before it, so each particle's weight is still
the target over the law of its extension, and SMC's laws hold (log Z_hat unbiased). Every
particle then holds its own rows (copies draft apart), and its draft row, which reads nothing
in free cycles, catches up on the tokens it has not read (`SlotTable.draft_length`).

Dimension letters: N particles, U distinct running ones (A running ones with a draft LM), K the
draft LM's block, V vocabulary.
"""

from __future__ import annotations

import torch

from smc_sd.engine.drafting import BlockDrafter, block_masks, trim_at_eos
from smc_sd.engine.free_drafts import FreeDrafter
from smc_sd.engine.groups import ImportanceGroup, first_stop
from smc_sd.engine.slots import SlotTable
from smc_sd.engine.smc import rescore_block_end, verify_block
from smc_sd.engine.smc_free import distinct_rows, extend_running, propose_distinct, running_particles


class FreeImportanceGroup(ImportanceGroup):
    """A request of an importance-verified plan whose proposal is a free draft: the first
    token, the block-end potentials and twist, ESS, resampling and the end of the run are
    `ImportanceGroup`'s; the extension and its weights are `smc_sd.engine.smc_free`'s.

    Args:
        request, plan, table: as `Group`'s.
    """

    def __init__(self, request, plan, table: SlotTable):
        super().__init__(request, plan, table)
        self.free_drafter = FreeDrafter.for_plan(plan, self.prompt)
        self.cycle = None

    @property
    def verifies_in_step(self) -> bool:
        """False: its particles' blocks are free drafts of their own lengths (`verify`)."""
        return False
        #: whether this cycle's blocks are the draft LM's (free+NAME, the free draft proposed nothing)
        self.lm_cycle = False

    # --- the particles' state, read from the slot table ---------------------------------------

    def tokens(self) -> list[list[int]]:
        """Every particle's generated tokens (an ended one's end at its EOS or stop)."""
        rows = self.table.tokens[self.slots, : self.generated].tolist()
        return [row[:length] for row, length in zip(rows, self.table.length[self.slots].tolist())]

    def running(self) -> list[int]:
        """The particles the next cycle extends (`smc_free.running_particles`)."""
        return running_particles(self.plan, self.tokens(), self.table.logw[self.slots], self.table.stopped[self.slots].tolist())

    def live(self) -> torch.Tensor:
        """[A] int64 slots of the running particles: those that hold rows."""
        return self.slots[self.running()]

    def seats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Running particles holding equal tokens share one row (`Group.seats`); with a draft
        LM every running particle holds its own (copies draft different blocks)."""
        if self.has_draft:
            return super().seats()
        running = self.running()
        distinct, copy_of = distinct_rows(self.tokens(), running)
        live = self.slots[running]
        return live, live[distinct], torch.tensor(copy_of, dtype=torch.int64)

    @property
    def done(self) -> bool:
        return not self.running()

    @property
    def needs_ragged_rows(self) -> bool:
        return self.plan.particles > 1

    # --- one cycle -----------------------------------------------------------------------------

    def begin(self, first_logits: torch.Tensor, target_base: int, draft_base: int) -> None:
        """`ImportanceGroup.begin`; particles of weight zero hold no rows; a draft row holds
        all of prompt + first token but the last two."""
        super().begin(first_logits, target_base, draft_base)
        self.table.draft_length[self.slots] = len(self.prompt) - 1
        self._drop_ended_rows()

    def prepare(self) -> None:
        """The cycle's proposals, one per distinct running particle; with a draft LM and no
        proposal at all, the draft LM's sampler and masks instead."""
        plan, tokens, running = self.plan, self.tokens(), self.running()
        self.cycle = propose_distinct(plan, self.free_drafter, tokens, running, share=not self.has_draft)
        self.lm_cycle = self.has_draft and self.cycle.proposed == 0
        if self.lm_cycle:
            alive = torch.ones(len(running), dtype=torch.bool)
            self.mask_at = None if plan.masker is None else block_masks(plan.masker, [tokens[i] for i in running], alive, self.eos)
            self.drafter = BlockDrafter(len(running), plan.draft_temperature, self.generator, self.mask_at)

    @property
    def draft_len(self) -> int:
        """K this cycle: the draft LM's in its cycles, else 0."""
        return self.plan.draft_len if self.lm_cycle else 0

    def draft_feed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each running particle's prompt + tokens its draft row has not read (at least its
        last two; more after free cycles), EOS filler after them (`Group.draft_feed`)."""
        tokens, running = self.tokens(), self.running()
        held = self.table.draft_length[self.slots[running]].tolist()
        unread = [(self.prompt + tokens[i])[h:] for i, h in zip(running, held)]
        width = max(len(u) for u in unread)
        return torch.tensor([u + [self.eos] * (width - len(u)) for u in unread]), torch.tensor([len(u) for u in unread])

    def draft_lengths(self, seated: torch.Tensor) -> torch.Tensor:
        return self.table.draft_length[seated]

    def target_width(self) -> int:
        return self.plan.draft_len + 1 if self.lm_cycle else self.cycle.width

    def target_feed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each distinct row's unseen last token and its proposal (or the draft LM's block),
        EOS filler after them: ([U, n] int64, [U] int64 counts)."""
        if self.lm_cycle:
            live = self.live()
            last = self.table.tokens[live, self.table.length[live] - 1][:, None]
            tokens = torch.cat([last, self.drafter.block(self.plan.target.vocabulary.size).tokens], 1)
            return tokens, torch.full((live.numel(),), tokens.shape[1], dtype=torch.int64)
        return self.cycle.feed(self.tokens(), self.eos), torch.tensor([1 + len(d) for d in self.cycle.drafted])

    def verify(self, target_logits: torch.Tensor) -> None:
        """Extension and its weights (`smc_free.extend_running`, or the draft LM's block in its
        cycles), block-end potentials and twist on the extended particles, then ESS and
        resampling (`ImportanceGroup.end_cycle`, with every SMC-SD request's).

        Args:
            target_logits: [U, width, V] float32, the target's logits over the distinct rows.

        Raises:
            AllParticlesDiedError: when every weight reaches zero.
        """
        if self.lm_cycle:
            self._verify_drafted(target_logits)
            return
        plan, cycle, table, slots = self.plan, self.cycle, self.table, self.slots
        tokens, logw = self.tokens(), table.logw[slots].clone()
        stopped = table.stopped[slots].tolist()
        stop_at = self._stop_at if self.request.stop else None
        accepted, added, stops = extend_running(plan, self.free_drafter, cycle, target_logits, tokens, logw, self.generator, stop_at)
        for i, stop in zip(cycle.running, stops):
            stopped[i] = stop
        self._store(tokens, logw, stopped)
        self._rescore(cycle.running)
        self.tokens_out += sum(added)
        self.accepted += sum(accepted)
        self.drafted += cycle.proposed
        self.end_cycle(tokens=max(added), rows=len(cycle.distinct), accepted=sum(accepted), proposed=cycle.proposed)
        self._drop_ended_rows()

    def _verify_drafted(self, target_logits: torch.Tensor) -> None:
        """A cycle of the draft LM's blocks: `verify_block`'s tokens and increments, each
        particle keeping its block up to its EOS, stop string or budget (the increments of the
        columns it keeps); its draft row then holds all but its last two tokens."""
        plan, table, slots = self.plan, self.table, self.slots
        running, tokens, logw = self.running(), self.tokens(), table.logw[slots].clone()
        stopped = table.stopped[slots].tolist()
        block, increments = verify_block(plan, target_logits, self.drafter.block(target_logits.shape[-1]), self.mask_at, self.generator)
        added = []
        for a, i in enumerate(running):
            new = trim_at_eos(block[a].tolist(), self.eos)[: plan.max_tokens - len(tokens[i])]
            column = self._stop_at(tokens[i], new) if self.request.stop else None
            if column is not None:
                new, stopped[i] = new[: column + 1], True
            logw[i] += float(increments[a, : len(new)].sum())
            tokens[i] += new
            added.append(len(new))
        self._store(tokens, logw, stopped)
        table.draft_length[slots[running]] = torch.tensor([len(self.prompt) + len(tokens[i]) - 2 for i in running])
        self._rescore(running)
        self.tokens_out += sum(added)
        self.draft_passes += plan.draft_len
        self.end_cycle(tokens=max(added), rows=len(running))
        self._drop_ended_rows()

    def _rescore(self, extended: list[int]) -> None:
        """Block-end potentials and twist on the particles just extended (`rescore_block_end`)."""
        plan, table, slots = self.plan, self.table, self.slots
        fresh = torch.zeros(plan.particles, dtype=torch.bool)
        fresh[extended] = True
        scored = rescore_block_end(plan, table.particles(slots, self.generated), fresh)
        table.logw[slots], table.log_twist[slots], table.log_phi[slots] = scored.logw, scored.log_twist, scored.log_phi

    # --- helpers -------------------------------------------------------------------------------

    def _store(self, tokens: list[list[int]], logw: torch.Tensor, stopped: list[bool]) -> None:
        """Scatter every particle's tokens, length, weight and end into the slot table."""
        table, slots = self.table, self.slots
        self.generated = max(len(row) for row in tokens)
        if self.generated > table.columns:
            raise ValueError(f"{self.generated} tokens per particle exceed the slot table's {table.columns} columns")
        # [N, S]: the tokens, EOS filler after each particle's end
        table.tokens[slots, : self.generated] = torch.tensor([row + [self.eos] * (self.generated - len(row)) for row in tokens])
        table.length[slots] = torch.tensor([len(row) for row in tokens])
        table.logw[slots] = logw
        table.stopped[slots] = torch.tensor(stopped)
        table.finished[slots] = torch.tensor([self.eos in row or stop for row, stop in zip(tokens, stopped)])

    def _drop_ended_rows(self) -> None:
        """Particles that do not run any more hold no rows."""
        running = torch.zeros(self.plan.particles, dtype=torch.bool)
        running[self.running()] = True
        self.table.target_row[self.slots[~running]] = -1
        self.table.draft_row[self.slots[~running]] = -1

    def _stop_at(self, prefix: list[int], new: list[int]) -> int | None:
        """The index of the new token completing a stop string (its EOS aside), or None."""
        return first_stop(self.plan.target.decode, prefix, [t for t in new if t != self.eos], self.request.stop)
