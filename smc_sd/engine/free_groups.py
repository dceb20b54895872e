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

Dimension letters: N particles, U distinct running ones, V vocabulary.
"""

from __future__ import annotations

import torch

from smc_sd.engine.free_drafts import FreeDrafter
from smc_sd.engine.groups import ImportanceGroup, first_stop
from smc_sd.engine.slots import SlotTable
from smc_sd.engine.smc import rescore_block_end
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
        """Running particles holding equal tokens share one row (`Group.seats`)."""
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
        """`ImportanceGroup.begin`; particles of weight zero hold no rows."""
        super().begin(first_logits, target_base, draft_base)
        self._drop_ended_rows()

    def prepare(self) -> None:
        """The cycle's proposals, one per distinct running particle."""
        self.cycle = propose_distinct(self.plan, self.free_drafter, self.tokens(), self.running())

    def target_width(self) -> int:
        return self.cycle.width

    def target_feed(self, width: int) -> torch.Tensor:
        """[U, width] int64: each distinct row's unseen last token, its proposal, EOS filler."""
        feed = self.cycle.feed(self.tokens(), self.eos)
        filler = torch.full((feed.shape[0], width - feed.shape[1]), self.eos, dtype=torch.int64)
        return torch.cat([feed, filler], 1)

    def verify(self, target_logits: torch.Tensor) -> None:
        """Extension and its weights (`smc_free.extend_running`), block-end potentials and
        twist on the extended particles, then ESS and resampling (`ImportanceGroup.end_cycle`).

        Args:
            target_logits: [U, width, V] float32, the target's logits over the distinct rows.

        Raises:
            AllParticlesDiedError: when every weight reaches zero.
        """
        plan, cycle, table, slots = self.plan, self.cycle, self.table, self.slots
        tokens, logw = self.tokens(), table.logw[slots].clone()
        stopped = table.stopped[slots].tolist()
        stop_at = self._stop_at if self.request.stop else None
        accepted, added, stops = extend_running(plan, self.free_drafter, cycle, target_logits, tokens, logw, self.generator, stop_at)
        for i, stop in zip(cycle.running, stops):
            stopped[i] = stop
        self._store(tokens, logw, stopped)
        fresh = torch.zeros(plan.particles, dtype=torch.bool)
        fresh[cycle.running] = True
        scored = rescore_block_end(plan, table.particles(slots, self.generated), fresh)
        table.logw[slots], table.log_twist[slots], table.log_phi[slots] = scored.logw, scored.log_twist, scored.log_phi
        self.tokens_out += sum(added)
        self.accepted += sum(accepted)
        self.drafted += cycle.proposed
        self.end_cycle(tokens=max(added), rows=len(cycle.distinct), accepted=sum(accepted), proposed=cycle.proposed)
        self._drop_ended_rows()

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

    def _stop_at(self, prefix: list[int], new: list[int]) -> int | None:
        """The index of the new token completing a stop string (its EOS aside), or None."""
        return first_stop(self.plan.target.decode, prefix, [t for t in new if t != self.eos], self.request.stop)
