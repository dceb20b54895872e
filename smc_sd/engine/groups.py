"""One running request of the batched engine: its compiled plan, generator, slots and diagnostics.

A group owns N slots of the `SlotTable` and runs, on its own particles only, the steps
`Program.run` runs (the pure functions of `smc_sd.engine.smc` and `smc_sd.engine.speculative`),
drawing from its own generator in the same order. The engine hands it its rows' slices of the
batched passes' logits, which the backends' laws make equal to those of its rows alone; so its
tokens, weights, ESS, resampling and log Z_hat are those `Program.run` gives with the same seed.

Per cycle the engine calls `prepare` (masks and the draft sampler), `draft_feed` and `draw`
(K times, for a group with a draft), `target_feed`, then `verify` with the target's logits.
The tokens a group's rows read: the draft, the last two tokens of each prefix (its rows hold the
prefix but those), then each drafted token; the target, the last token and the drafted block.

Stop strings: a particle whose generated text comes to contain one of the request's stop strings
finishes at the token that completed it; the rest of its block counts nothing, exactly as after
an EOS (`smc_sd.engine.smc.advance`). Its tokens keep that token; cutting the text at the stop
string is the caller's.

Stop strings under a constraint: the stop string is part of the constrained text. The string y a
particle ends with at a stop string (its tokens through the one that completed the stop string)
counts only if y is a complete string of the constraints, as a string the token budget cuts:
the target is pi(y) ∝ p_T(y)^alpha · phi(y) over the strings that end at EOS or at their first
stop string, phi(y) = 1 iff y (without its EOS) is complete. Masks keep every prefix viable, so
only completeness is checked at the end (`complete_at_budget`); the caller that cuts the text
before the stop string would return a text the constraint never checked, so the server keeps
the stop string in a structured output's text.

Dimension letters: N particles, A unfinished ones, K draft length, V vocabulary, S generated.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import torch

from smc_sd.engine.drafting import BlockDrafter, first_token_mask, trim_at_eos
from smc_sd.engine.free_drafts import FreeDrafter
from smc_sd.engine.keyed_random import seed_key
from smc_sd.engine.result import AllParticlesDiedError, CycleStats, Result, mask_stats
from smc_sd.engine.slots import SlotTable
from smc_sd.engine.smc import advance, conclude, cycle_masks, first_particles, rescore_block_end, verify_block


def first_stop(decode, prefix: list[int], new: list[int], stops: tuple[str, ...]) -> int | None:
    """The index c of the first new token after which decode(prefix + new[: c + 1]) contains a
    stop string, or None."""
    if not stops or not new or not any(stop in decode(prefix + new) for stop in stops):
        return None
    for c in range(len(new)):
        text = decode(prefix + new[: c + 1])
        if any(stop in text for stop in stops):
            return c
    return None


class Group:
    """What both kinds of request share: slots, rows, feeds, events.

    Args:
        request: the `smc_sd.engine.batch.Request`.
        plan: its compiled StepPlan.
        table: the engine's slot table; the group takes N slots of it.
    """

    def __init__(self, request, plan, table: SlotTable):
        self.request, self.plan, self.table = request, plan, table
        self.prompt = list(request.prompt)
        self.eos = plan.target.vocabulary.eos_token_id
        self.generator = torch.Generator().manual_seed(request.seed)
        #: the request's seed as the key of its keyed draws (`smc_sd.engine.keyed_random`)
        self.key = seed_key(request.seed)
        # raises before any slot is taken when the constraints admit no string
        self.first_mask = first_token_mask(plan.masker)
        self.slots = table.allocate(plan.particles)
        self.generated = 0
        self.cycles: list[CycleStats] = []
        self.started = time.perf_counter()
        self.drafter: BlockDrafter | None = None
        self.mask_at = None
        #: log Z_hat accumulated by the resamplings
        self.log_z = 0.0
        #: generated tokens over every particle, draft tokens accepted and proposed (exact sd)
        self.tokens_out = self.accepted = self.drafted = 0
        #: passes of the draft LM this request drew from
        self.draft_passes = 0
        #: the free draft's proposer, for a request with a free draft
        self.free_drafter: FreeDrafter | None = None
        #: the largest KV its rows held at once (`note_kv`); None once a backend cannot tell
        self.kv_peak: dict | None = {"peak_bytes": 0, "naive_peak_bytes": 0}
        #: an SMC-SD cycle's statistics between its verification and its resampling
        self.pending_stats: dict | None = None

    #: whether the group's seats are its unfinished particles in particle order, each on its own
    #: row at prompt + generated - 1 tokens (- 2 in its draft's rows): then the engine reseats it
    #: together with its neighbours (`smc_sd.engine.rows.reseat_groups`)
    plain_seats = False

    @property
    def draft_len(self) -> int:
        return self.plan.draft_len

    @property
    def needs_ragged_rows(self) -> bool:
        """Whether the group's rows end cycles at different lengths (several particles that
        advance by different counts)."""
        return False

    @property
    def has_draft(self) -> bool:
        return self.plan.draft is not None

    def note_kv(self, held: list[dict | None]) -> None:
        """Fold the KV its rows hold now (`Sequences.rows_memory` of each model's rows) into
        its peaks: `peak_bytes` of the storage (shared blocks once), `naive_peak_bytes` of full
        copies per row."""
        if any(h is None for h in held):
            self.kv_peak = None
            return
        for peak, now in (("peak_bytes", "live_bytes"), ("naive_peak_bytes", "naive_bytes")):
            self.kv_peak[peak] = max(self.kv_peak[peak], sum(h[now] for h in held))

    def live(self) -> torch.Tensor:
        """[A] int64 slots of the unfinished particles, in particle order (the rows' order)."""
        return self.slots[~self.table.finished[self.slots]]

    def seats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The particles that hold rows and the rows they hold, as offsets into the group's own.

        Returns:
            (live, seated, seat_of): [A] int64 slots of the particles that hold rows, in
            particle order; [U] int64 slots whose rows are computed (here every live one); [A]
            int64 for each live slot the index into `seated` of the row it holds.
        """
        live = self.live()
        return live, live, torch.arange(live.numel())

    def seat_lists(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """`seats` as Python lists, and the length of each seated target row (prompt +
        generated - 1): what `smc_sd.engine.rows.reseat_groups` merges over many requests."""
        live, seated, seat_of = self.seats()
        return live.tolist(), seated.tolist(), seat_of.tolist(), (len(self.prompt) + self.table.length[seated] - 1).tolist()

    def target_width(self) -> int:
        """Tokens each of the group's target rows reads this cycle: the last token and the block."""
        return self.draft_len + 1

    def draft_feed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens of each unfinished particle's prompt + tokens its draft row has not read:
        ([A, n] int64, row a's first counts[a] of them then EOS filler; [A] int64 counts). Here
        every row's last two (n = 2)."""
        tokens = self.table.tokens[self.live(), : self.generated]
        if self.generated < 2:
            tokens = torch.cat([torch.full_like(tokens, self.prompt[-1]), tokens], 1)
        return tokens[:, -2:], torch.full((tokens.shape[0],), 2, dtype=torch.int64)

    def draft_lengths(self, seated: torch.Tensor) -> torch.Tensor:
        """[U] int64: the tokens the seated particles' draft rows hold between cycles: the
        prompt and all generated tokens but the last two."""
        return len(self.prompt) + self.table.length[seated] - 2

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """The next drafted token of every unfinished particle from the draft's logits [A, V]."""
        return self.drafter.draw(logits)

    def target_feed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What each of the group's target rows reads: ([A, n] int64 tokens, [A] int64 counts),
        row a its first counts[a] tokens, EOS filler after them; here the last token and the
        drafted block (n = counts = K + 1)."""
        live = self.live()
        drafted = self.drafter.block(self.plan.target.vocabulary.size).tokens
        tokens = torch.cat([self.table.tokens[live, self.generated - 1 : self.generated], drafted], 1)
        return tokens, torch.full((live.numel(),), tokens.shape[1], dtype=torch.int64)

    def particle_tokens(self) -> list[list[int]]:
        """Every particle's generated tokens, each ending at its EOS (a stopped one at its stop)."""
        rows = self.table.tokens[self.slots, : self.generated].tolist()
        lengths = self.table.length[self.slots].tolist()
        stopped = self.table.stopped[self.slots].tolist()
        out = []
        for row, length, stop in zip(rows, lengths, stopped):
            row = trim_at_eos(row[:length], self.eos)
            # a stopped particle's EOS is filler, not generated
            out.append(row[:-1] if stop and row and row[-1] == self.eos else row)
        return out

    def agreed_tokens(self) -> list[int]:
        """The generated tokens every particle agrees on (their common prefix): it only grows,
        since particles only extend and resampling keeps copies of some of them."""
        rows = self.particle_tokens()
        common = rows[0]
        for row in rows[1:]:
            n = 0
            while n < min(len(common), len(row)) and common[n] == row[n]:
                n += 1
            common = common[:n]
        return common

    def _result(self, particles, finished, log_weights, log_ml, chosen, complete, kv) -> Result:
        plan = self.plan
        return Result(
            method=plan.name,
            prompt=self.prompt,
            particles=particles,
            finished=finished,
            log_weights=log_weights,
            log_ml=log_ml,
            chosen=chosen,
            cycles=self.cycles,
            target_passes=len(self.cycles),
            draft_passes=self.draft_passes,
            seconds=time.perf_counter() - self.started,
            decode=plan.target.decode,
            kv=kv,
            **mask_stats(plan.masker),
            complete=complete,
            free_draft=None if self.free_drafter is None else self.free_drafter.report(),
        )


class ImportanceGroup(Group):
    """A request of an importance-verified plan (SMC-SD; K = 0: the target proposes), as
    the SMC-SD cycle of `smc_sd.engine.smc` runs it."""

    plain_seats = True

    def begin(self, first_logits: torch.Tensor, target_base: int, draft_base: int) -> None:
        """Draw every particle's first token from the prompt's logits [V]; its rows are the
        `target_base` (and `draft_base`) .. + N - 1 rows just joined.

        Raises:
            AllParticlesDiedError: when no first token has nonzero probability.
        """
        plan, n = self.plan, self.plan.particles
        state = first_particles(plan, first_logits, self.first_mask, self.generator)
        stops = torch.tensor([first_stop(plan.target.decode, [], [t], self.request.stop) == 0 for t in state.tokens[:, 0].tolist()])
        if bool(stops.any()):
            # the first token completed a stop string: that particle's string ends there
            state = rescore_block_end(plan, replace(state, finished=state.finished | stops), stops)
        self.generated = 1
        self.table.store(self.slots, state)
        self.table.stopped[self.slots] = stops
        rows = torch.arange(n)
        self.table.target_row[self.slots] = torch.where(state.finished, -1, target_base + rows)
        if self.has_draft:
            self.table.draft_row[self.slots] = torch.where(state.finished, -1, draft_base + rows)
        self.tokens_out += n
        self.unfinished = int((~state.finished).sum())
        if not torch.isfinite(state.logw).any():
            raise AllParticlesDiedError(
                "no first token has nonzero probability under the target (and its constraints, if any)",
                self.result_with(state.logw, -math.inf, 0, True, None),
            )

    @property
    def done(self) -> bool:
        """The budget is spent or every particle has finished (`unfinished`, counted at the end
        of each cycle with every request's, so reading it costs no tensor work)."""
        return self.generated >= self.plan.max_tokens or self.unfinished == 0

    def prepare(self) -> None:
        """The cycle's masks and draft sampler (the batched step drafts for unconstrained
        requests itself, `smc_sd.engine.step_rows`)."""
        state = self.table.particles(self.slots, self.generated)
        active = (~state.finished).nonzero().flatten()
        self.mask_at = cycle_masks(self.plan, state, active)
        self.drafter = BlockDrafter.for_request(self.plan.draft_temperature, self.key, len(self.cycles), active, self.mask_at)

    def verify(self, target_logits: torch.Tensor) -> None:
        """Weights, block-end scores, ESS and resampling of one cycle (`smc_sd.engine.smc`).

        Args:
            target_logits: [A, K + 1, V] float32, the target's logits over this group's rows.

        The cycle's resampling, and the error when every weight is zero, come after it with
        every SMC-SD request's (`end_cycle`, `record_cycle`).
        """
        plan, table, slots = self.plan, self.table, self.slots
        state = table.particles(slots, self.generated)
        rows = int((~state.finished).sum())
        block, increments = verify_block(plan, target_logits, self.drafter.block(target_logits.shape[-1]), self.mask_at, self.generator)
        stops = self._stop_columns(state, block) if self.request.stop else None
        advanced = advance(plan, state, block, increments, stops)
        if stops is not None:
            table.stopped[slots[~state.finished]] = stops.any(1)
        table.store(slots, advanced)
        # particles that finished drop their rows
        table.target_row[slots[advanced.finished]] = -1
        table.draft_row[slots[advanced.finished]] = -1
        self.end_verify(rows)

    @property
    def verifies_in_step(self) -> bool:
        """Whether the batched step verifies this request with every other such request
        (`smc_sd.engine.importance_step`): its blocks are K drafted tokens and a bonus token,
        and nothing after a block needs per-prefix Python (no stop strings, block-end
        potentials or twist); else `verify` does."""
        return not self.request.stop and self.plan.potential is None and self.plan.twist is None

    def bonus_mask(self, drafted: torch.Tensor) -> torch.Tensor | None:
        """[A, V] bool: the constraints' mask of the bonus token after each row's drafted
        tokens ([A, K] int64), or None when unconstrained."""
        return None if self.mask_at is None else self.mask_at(drafted)[0]

    def end_verify(self, rows: int) -> None:
        """After the block is stored (`table` holds the advanced particles, the finished ones
        without rows): the counters advance and the cycle's statistics wait for its
        resampling (`end_cycle`).

        Args:
            rows: the particles that were unfinished before the block.
        """
        plan = self.plan
        tokens_this_cycle = min(plan.draft_len + 1, plan.max_tokens - self.generated)
        self.generated += tokens_this_cycle
        self.tokens_out += rows * tokens_this_cycle
        self.draft_passes += plan.draft_len
        self.end_cycle(tokens=tokens_this_cycle, rows=rows)

    def end_cycle(self, **stats) -> None:
        """The block is stored; the cycle ends when the engine has resampled every SMC-SD
        request together (`resample_groups`: the ESS of the stored weights, resampling when it
        falls below tau N, slot i taking its ancestor's state, log w = 0, log Z_hat +=
        logsumexp(log w) - log N) and calls `record_cycle` with the outcome and these `stats`
        (the cycle's other CycleStats fields)."""
        self.pending_stats = stats

    def record_cycle(self, outcome: tuple) -> None:
        """The cycle's CycleStats from its resampling `outcome` (ess, resampled, log_z_step,
        unfinished particles after it, ancestors) and the statistics `end_cycle` kept.

        Raises:
            AllParticlesDiedError: when every weight is zero (ESS 0).
        """
        ess, resampled, log_z_step, self.unfinished, _ = outcome
        stats, self.pending_stats = self.pending_stats, None
        n = self.plan.particles
        if ess == 0.0:
            self.cycles.append(CycleStats(ess, False, -math.inf, particles=n, **stats))
            raise AllParticlesDiedError("every particle reached weight zero", self.result_with(self.table.logw[self.slots].clone(), -math.inf, 0, True, None))
        if resampled:
            self.log_z += log_z_step
        self.cycles.append(CycleStats(ess, resampled, self.log_z, particles=n, **stats))

    def result(self, kv: dict | None) -> Result:
        """The request's Result (`smc_sd.engine.smc.conclude`).

        Raises:
            AllParticlesDiedError: when every final weight is zero.
        """
        state = self.table.particles(self.slots, self.generated)
        # a string that ended at a stop string is judged complete or not like one the budget cut
        ended_at_eos = state.finished & ~self.table.stopped[self.slots]
        outcome = conclude(self.plan, replace(state, finished=ended_at_eos), self.log_z, self.generator)
        if outcome is None:
            raise AllParticlesDiedError("every particle reached weight zero", self.result_with(state.logw - state.log_twist, -math.inf, 0, True, kv))
        return self.result_with(*outcome, kv)

    def result_with(self, log_weights, log_ml, chosen, complete, kv) -> Result:
        finished = self.table.finished[self.slots].tolist()
        return self._result(self.particle_tokens(), finished, log_weights, log_ml, chosen, complete, kv)

    def _stop_columns(self, state, block: torch.Tensor) -> torch.Tensor:
        """[A, K + 1] bool: for each unfinished particle, the column of its block that completes
        a stop string first (before any EOS, within the budget), if one does."""
        budget = self.plan.max_tokens - self.generated
        stops = torch.zeros(block.shape, dtype=torch.bool)
        prefixes = state.tokens[~state.finished].tolist()
        for a, (prefix, row) in enumerate(zip(prefixes, block.tolist())):
            row = trim_at_eos(row[:budget], self.eos)
            if row and row[-1] == self.eos:
                row = row[:-1]
            column = first_stop(self.plan.target.decode, prefix, row, self.request.stop)
            if column is not None:
                stops[a, column] = True
        return stops
