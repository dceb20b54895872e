"""A running SMC-SD request with a free draft in the batched engine (`smc_sd.engine.smc_free`).

Every particle is extended by exact speculative sampling of the locally masked target q_loc,
its free draft the point-mass draft, and weighted by the local normalisers Z of the positions
it kept; block-end potentials and a twist rescore the extended prefixes, and ESS, resampling,
log Z_hat and the end of the run are SMC-SD's (`ImportanceGroup`). The extension runs for
every such request at once (`smc_sd.engine.smc_free.extend_free_rows`), its uniforms keyed by
request seed, cycle and particle, so a request's result for a seed does not depend on what
runs beside it. The particles' tokens, stop flags and whether their weight is nonzero are kept
as Python lists beside the slot table, so choosing the running particles and their proposals
costs no tensor work.

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

import math

import torch

from smc_sd.engine.drafting import BlockDrafter, block_masks, trim_at_eos
from smc_sd.engine.free_drafts import FreeDrafter
from smc_sd.engine.groups import ImportanceGroup, first_stop
from smc_sd.engine.slots import SlotTable
from smc_sd.engine.smc import kept_weight, rescore_block_end, verify_block
from smc_sd.engine.smc_free import distinct_rows, propose_distinct, running_particles


class FreeImportanceGroup(ImportanceGroup):
    """A request of an importance-verified plan whose proposal is a free draft: the first
    token, the block-end potentials and twist, ESS, resampling and the end of the run are
    `ImportanceGroup`'s; the extension and its weights are `smc_sd.engine.smc_free`'s.

    Args:
        request, plan, table: as `Group`'s.
    """

    plain_seats = False

    def __init__(self, request, plan, table: SlotTable):
        super().__init__(request, plan, table)
        self.free_drafter = FreeDrafter.for_plan(plan, self.prompt)
        self.cycle = None
        #: whether this cycle's blocks are the draft LM's (free+NAME, the free draft proposed nothing)
        self.lm_cycle = False
        #: the particles' slots as Python ints
        self.slot_ids: list[int] = self.slots.tolist()
        #: per particle: its generated tokens (ending at its EOS or stop), whether a stop string
        #: ended it, whether its weight is nonzero; the slot table holds the same
        self.lists: list[list[int]] = []
        self.stopped: list[bool] = []
        self.alive: list[bool] = []

    @property
    def verifies_in_step(self) -> bool:
        """False: its particles' blocks are free drafts of their own lengths (`extend_free_rows`)."""
        return False

    # --- the particles' state -------------------------------------------------------------------

    def tokens(self) -> list[list[int]]:
        """Every particle's generated tokens (an ended one's end at its EOS or stop)."""
        return self.lists

    def running(self) -> list[int]:
        """The particles the next cycle extends (`smc_free.running_particles`)."""
        return running_particles(self.plan, self.lists, self.alive, self.stopped)

    def live(self) -> torch.Tensor:
        """[A] int64 slots of the running particles: those that hold rows."""
        return self.slots[self.running()]

    def seats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Running particles holding equal tokens share one row (`Group.seats`); with a draft
        LM every running particle holds its own (copies draft different blocks)."""
        if self.has_draft:
            return super().seats()
        live, seated, seat_of, _ = self.seat_lists()
        return torch.tensor(live, dtype=torch.int64), torch.tensor(seated, dtype=torch.int64), torch.tensor(seat_of, dtype=torch.int64)

    def seat_lists(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """`seats` without a draft LM, as Python lists, and the length of each seated row
        (prompt + generated - 1): what `reseat_groups` merges over many requests."""
        running = self.running()
        distinct, copy_of = distinct_rows(self.lists, running)
        live = [self.slot_ids[i] for i in running]
        held = [len(self.prompt) + len(self.lists[running[d]]) - 1 for d in distinct]
        return live, [live[d] for d in distinct], copy_of, held

    def particle_tokens(self) -> list[list[int]]:
        return [list(row) for row in self.lists]

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
        self._read_table()
        self._drop_ended_rows()

    def prepare(self) -> None:
        """The cycle's proposals, one per distinct running particle; with a draft LM and no
        proposal at all, the draft LM's sampler and masks instead."""
        plan, tokens, running = self.plan, self.lists, self.running()
        self.cycle = propose_distinct(plan, self.free_drafter, tokens, running, share=not self.has_draft)
        self.lm_cycle = self.has_draft and self.cycle.proposed == 0
        if self.lm_cycle:
            alive = torch.ones(len(running), dtype=torch.bool)
            self.mask_at = None if plan.masker is None else block_masks(plan.masker, [tokens[i] for i in running], alive, self.eos)
            self.drafter = BlockDrafter.for_request(plan.draft_temperature, self.key, len(self.cycles), torch.tensor(running, dtype=torch.int64), self.mask_at)

    @property
    def draft_len(self) -> int:
        """K this cycle: the draft LM's in its cycles, else 0."""
        return self.plan.draft_len if self.lm_cycle else 0

    def draft_feed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each running particle's prompt + tokens its draft row has not read (at least its
        last two; more after free cycles), EOS filler after them (`Group.draft_feed`)."""
        tokens, running = self.lists, self.running()
        held = self.table.draft_length[self.slots[running]].tolist()
        unread = [(self.prompt + tokens[i])[h:] for i, h in zip(running, held)]
        width = max(len(u) for u in unread)
        return torch.tensor([u + [self.eos] * (width - len(u)) for u in unread]), torch.tensor([len(u) for u in unread])

    def draft_lengths(self, seated: torch.Tensor) -> torch.Tensor:
        return self.table.draft_length[seated]

    def target_width(self) -> int:
        """Tokens each row reads in a draft LM cycle (free cycles are fed by `free_feed`)."""
        return self.plan.draft_len + 1

    def target_feed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft LM cycle's feed: each running particle's unseen last token and its block:
        ([A, K + 1] int64, [A] int64 counts)."""
        live = self.live()
        last = self.table.tokens[live, self.table.length[live] - 1][:, None]
        tokens = torch.cat([last, self.drafter.block(self.plan.target.vocabulary.size).tokens], 1)
        return tokens, torch.full((live.numel(),), tokens.shape[1], dtype=torch.int64)

    def conclude_free(self, accepted: list[int], new: list[list[int]], terms: list[list[float]], before: list[float]) -> None:
        """After `extend_free_rows` wrote the running particles' extensions and weights into the
        table: each particle's new tokens (a stop string cuts them where it completes, and its
        weight then counts the positions kept), the free draft's statistics, block-end
        potentials and twist, and the cycle's statistics for its resampling.

        Args:
            accepted, new, terms, before: per running particle (in `cycle.running` order) the
                drafts accepted, the tokens appended, the log Z terms of their positions and
                its log weight before the cycle.
        """
        cycle, table = self.cycle, self.table
        added = []
        for r, i in enumerate(cycle.running):
            tokens = new[r]
            column = self._stop_at(self.lists[i], tokens) if self.request.stop else None
            if column is not None:
                self._cut(i, column + 1, before[r] + math.fsum(terms[r][: column + 1]))
                tokens = tokens[: column + 1]
            self.lists[i] = self.lists[i] + tokens
            self.alive[i] = self.alive[i] and all(t > -math.inf for t in terms[r][: len(tokens)])
            added.append(len(tokens))
            self.free_drafter.record(len(cycle.drafted[cycle.copy_of[r]]), cycle.forced[cycle.copy_of[r]], accepted[r])
        self.generated = max(len(row) for row in self.lists)
        if self.generated > table.columns:
            raise ValueError(f"{self.generated} tokens per particle exceed the slot table's {table.columns} columns")
        self._rescore(cycle.running)
        self.tokens_out += sum(added)
        self.accepted += sum(accepted)
        self.drafted += cycle.proposed
        self.end_cycle(tokens=max(added), rows=len(cycle.distinct), accepted=sum(accepted), proposed=cycle.proposed)

    def verify(self, target_logits: torch.Tensor) -> None:
        """A cycle of the draft LM's blocks: `verify_block`'s tokens and increments, each
        particle keeping its block up to its EOS, stop string or budget (the increments of the
        columns it keeps); its draft row then holds all but its last two tokens.

        Args:
            target_logits: [A, K + 1, V] float32, the target's logits over the running rows.
        """
        plan, table, slots = self.plan, self.table, self.slots
        running, tokens, logw = self.running(), [list(row) for row in self.lists], table.logw[slots].clone()
        block, increments = verify_block(plan, target_logits, self.drafter.block(target_logits.shape[-1]), self.mask_at, self.generator)
        added = []
        for a, i in enumerate(running):
            new = trim_at_eos(block[a].tolist(), self.eos)[: plan.max_tokens - len(tokens[i])]
            column = self._stop_at(tokens[i], new) if self.request.stop else None
            if column is not None:
                new, self.stopped[i] = new[: column + 1], True
            tokens[i] += new
            added.append(len(new))
        # [A, K + 1]: the columns each running particle keeps, its first added ones
        keep = torch.arange(block.shape[1])[None, :] < torch.tensor(added)[:, None]
        logw[torch.tensor(running)] += kept_weight(keep, increments)
        self._store(tokens, logw)
        table.draft_length[slots[running]] = torch.tensor([len(self.prompt) + len(tokens[i]) - 2 for i in running])
        self._rescore(running)
        self.tokens_out += sum(added)
        self.draft_passes += plan.draft_len
        self.end_cycle(tokens=max(added), rows=len(running))
        self._drop_ended_rows()

    def record_cycle(self, outcome) -> None:
        """`ImportanceGroup.record_cycle`; after a resampling the particles' lists follow their
        ancestors (whose weights were nonzero), and the particles that stopped running drop
        their rows."""
        super().record_cycle(outcome)
        ancestors = outcome[4]
        if ancestors is not None:
            self.lists = [list(self.lists[a]) for a in ancestors]
            self.stopped = [self.stopped[a] for a in ancestors]
            self.alive = [True] * len(ancestors)

    def _rescore(self, extended: list[int]) -> None:
        """Block-end potentials and twist on the particles just extended (`rescore_block_end`)."""
        plan, table, slots = self.plan, self.table, self.slots
        if plan.potential is None and plan.twist is None:
            return
        fresh = torch.zeros(plan.particles, dtype=torch.bool)
        fresh[extended] = True
        scored = rescore_block_end(plan, table.particles(slots, self.generated), fresh)
        table.logw[slots], table.log_twist[slots], table.log_phi[slots] = scored.logw, scored.log_twist, scored.log_phi
        self.alive = torch.isfinite(scored.logw).tolist()

    # --- helpers -------------------------------------------------------------------------------

    def _read_table(self) -> None:
        """The particles' lists from the slot table."""
        table, slots = self.table, self.slots
        rows = table.tokens[slots, : self.generated].tolist()
        self.lists = [row[:length] for row, length in zip(rows, table.length[slots].tolist())]
        self.stopped = table.stopped[slots].tolist()
        self.alive = torch.isfinite(table.logw[slots]).tolist()

    def _store(self, tokens: list[list[int]], logw: torch.Tensor) -> None:
        """Scatter every particle's tokens, length, weight and end into the slot table."""
        table, slots = self.table, self.slots
        self.lists = tokens
        self.alive = torch.isfinite(logw).tolist()
        self.generated = max(len(row) for row in tokens)
        if self.generated > table.columns:
            raise ValueError(f"{self.generated} tokens per particle exceed the slot table's {table.columns} columns")
        # [N, S]: the tokens, EOS filler after each particle's end
        table.tokens[slots, : self.generated] = torch.tensor([row + [self.eos] * (self.generated - len(row)) for row in tokens])
        table.length[slots] = torch.tensor([len(row) for row in tokens])
        table.logw[slots] = logw
        table.stopped[slots] = torch.tensor(self.stopped)
        table.finished[slots] = torch.tensor([self.eos in row or stop for row, stop in zip(tokens, self.stopped)])

    def _cut(self, i: int, kept: int, logw: float) -> None:
        """Particle i's extension ends after `kept` tokens at a stop string: its length, end
        and weight (the terms of the positions kept) in the table."""
        slot = self.slot_ids[i]
        self.stopped[i] = True
        self.table.length[slot] = len(self.lists[i]) + kept
        self.table.finished[slot] = self.table.stopped[slot] = True
        self.table.logw[slot] = logw
        self.table.target_row[slot] = self.table.draft_row[slot] = -1

    def _drop_ended_rows(self) -> None:
        """Particles that do not run any more hold no rows."""
        running = torch.zeros(self.plan.particles, dtype=torch.bool)
        running[self.running()] = True
        self.table.target_row[self.slots[~running]] = -1
        self.table.draft_row[self.slots[~running]] = -1

    def _stop_at(self, prefix: list[int], new: list[int]) -> int | None:
        """The index of the new token completing a stop string (its EOS aside), or None."""
        return first_stop(self.plan.target.decode, prefix, [t for t in new if t != self.eos], self.request.stop)
