"""The batched engine: the particles of many requests advance together, one target pass per
cycle and one draft pass per drafted position, over all of them.

Requests, each with its own program, schedule, seed and stop strings, wait in a queue and join
between cycles (continuous batching) while fewer than `max_running` run and their particles find
free slots of the `SlotTable`. One cycle (`step`):

1. requests that were cancelled leave; waiting ones join: their prompt's rows are added to the
   target's (and draft's) rows, and their particles draw their first tokens (`Group.begin`);
2. the rows are reseated: the rows of finished particles are dropped, resampled ones copied
   (block pointers, not KV), every row rolled back to its canonical length;
3. each draft model reads the last two tokens of every prefix of its rows, then proposes in
   K_max passes of [B_d, 1] tokens, K_max the largest K among the requests drafting with it;
   request g's rows read and draw in the first K_g of them (`draft_passes`; the unconstrained
   SMC-SD requests of one draft length draw together, `step_rows.StepRows`);
4. the target reads [last token, block] of every row in ONE pass, each row its own count; a
   block is K drafted tokens, or a free draft's proposal (rows read blocks of different
   lengths and keep what their verification accepted), and the pass's logits come packed row
   after row;
5. verification runs per kind of request, each kind in one fixed sequence of tensor
   operations over all its rows, whatever their number: SMC-SD with a draft LM or none
   (`importance_step`), accept/reject for sd and mask-at-verify (`speculative_step`), SMC-SD
   with a free draft (`smc_free.extend_free_rows`); then ESS, resampling and log Z_hat for
   every SMC-SD request at once (`resample_groups`). Draws use uniforms keyed by request
   seed, cycle, particle and position (`keyed_random`). What stays per request: constraint
   masks, free-draft proposals, stop strings, block-end potentials and twists (those requests
   verify their own rows, `Group.verify`). Requests that are done deliver their Result and
   leave, freeing their slots.

Row invariant between cycles: the target's rows are, request after request in running order,
its seated particles (`Group.seats`: its unfinished ones in particle order; under a free draft,
particles holding equal tokens share one row), each holding prompt + generated[:-1] at its own
length (`SlotTable.length`); the draft's rows are the same for the requests with a draft,
holding prompt + generated[:-2]. Together with
the backends' laws for rows of different lengths, this makes a request's law independent of
the batch: it draws what it draws alone (`Program.run` is this engine with one request), in
the same order, from logits equal to its own.

A backend whose rows keep one length (`Sequences.join` raises NotImplementedError: the hf
backend's "copy" and "static" caches, and paged rows that keep a feature draft's features)
still serves, one request at a time, except SMC-SD with a free draft and N > 1, whose particles end cycles at
different lengths: that request fails with one line (`ONE_LENGTH_REFUSAL`).

Errors: a request's own failure (all particles died, a potential that raises) fails that
request only; a failure of a backend pass kills the engine (`dead`), failing every request.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Callable

import torch

from smc_sd.backends.base import LanguageModel, check_same_vocabulary
from smc_sd.engine.cycle_locals import lending
from smc_sd.engine.draft_passes import DraftUnit, draft_passes
from smc_sd.engine.free_groups import FreeImportanceGroup
from smc_sd.engine.groups import Group, ImportanceGroup
from smc_sd.engine.importance_step import resample_groups, verify_importance_rows
from smc_sd.engine.kernels import StepKernels
from smc_sd.engine.requests import Event, Handle, QueueFullError, Request
from smc_sd.engine.result import CycleStats, Result, kv_memory
from smc_sd.engine.rows import RowSet, join_groups, note_kv, reseat_groups, row_logits
from smc_sd.engine.scratch import Scratch
from smc_sd.engine.slots import SlotTable
from smc_sd.engine.smc_free import extend_free_rows, free_feed
from smc_sd.engine.speculative_group import SpeculativeGroup
from smc_sd.engine.speculative_step import speculative_feed, verify_speculative_rows
from smc_sd.engine.step_rows import StepRows, joint_steps

__all__ = ["BatchEngine", "Event", "Handle", "QueueFullError", "Request", "RowsOfOneLengthError"]

#: slots per running request when the engine is not told how many to keep
SLOTS_PER_REQUEST = 16


class RowsOfOneLengthError(ValueError):
    """A request needs rows of different lengths, which the backend cannot hold (bad input for
    this server, not a failure of the engine)."""


#: why a request whose particles end cycles at different lengths cannot run on some backends
ONE_LENGTH_REFUSAL = (
    "smc-sd with a free draft and more than one particle needs rows of different lengths, "
    "which this backend cannot hold (its rows keep one length); use the hf backend's paged cache, vLLM or llama.cpp, or sd or mask-at-verify"
)


@dataclass
class _Entry:
    """A request in the engine: what was submitted, its compiled plan, its listeners and, while it
    runs, its group; `agreed` counts the tokens its last "tokens" event reported."""

    request: Request
    plan: object
    handle: Handle
    on_event: Callable[[Event], None] | None
    on_cycle: Callable[[CycleStats, list[list[int]]], None] | None = None
    group: Group | None = None
    agreed: int = 0


class BatchEngine:
    """Many requests' particles in one batch over a target and optional draft models.

    Args:
        target: the target model every request's program names.
        draft: the draft model, a list of draft models (each request's program names one of
            them; each has its rows and its passes), or None (then only programs without a
            draft model run).
        max_running: requests in the batch at once, at most.
        max_waiting: requests queued, at most (`submit` raises QueueFullError past it).
        max_slots: particles of all running requests together, at most (default
            max_running · SLOTS_PER_REQUEST).
        compile_step: run the cycle's verification scores and draft draws through
            `torch.compile` (`smc_sd.engine.kernels`); each kind compiles at its first cycle.
    """

    def __init__(self, target: LanguageModel, draft: LanguageModel | list[LanguageModel] | None, max_running: int = 16, max_waiting: int = 256, max_slots: int | None = None, compile_step: bool = False):
        if max_running < 1 or max_waiting < 0:
            raise ValueError(f"max_running must be >= 1 and max_waiting >= 0, got {max_running} and {max_waiting}")
        drafts = [] if draft is None else list(draft) if isinstance(draft, (list, tuple)) else [draft]
        for lm in drafts:
            check_same_vocabulary(lm, target)
        self.target = target
        self.max_running, self.max_waiting = max_running, max_waiting
        self.table = SlotTable(max_slots or max_running * SLOTS_PER_REQUEST, target.max_length)
        self.target_rows = RowSet(target)
        #: the rows of each draft model
        self.draft_sets = [RowSet(lm) for lm in drafts]
        self.dead: BaseException | None = None
        self._running: list[_Entry] = []
        self._waiting: deque[_Entry] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        # cleared at the first join a backend refuses: then one request runs at a time
        self._ragged = True
        # the cycle's vocabulary-sized blocks, kept from one cycle to the next
        self._scratch = Scratch()
        self._kernels = StepKernels.of(compile_step)
        self._totals = {"tokens_total": 0, "target_passes_total": 0, "accepted_total": 0, "drafted_total": 0, "resamples_total": 0}

    @property
    def draft_rows(self) -> RowSet | None:
        """The first draft model's rows, or None without a draft model."""
        return self.draft_sets[0] if self.draft_sets else None

    # --- the public door ------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Refuse, with a one-line error, everything that can be refused before the request joins.

        Raises:
            ValueError, ContextOverflowError, TokenizerMismatchError: naming the problem
            (`smc_sd.compiler.compile_program`'s checks, and the engine's own).
        """
        self._compile(request)

    def submit(self, request: Request, on_event: Callable[[Event], None] | None = None, on_cycle: Callable[[CycleStats, list[list[int]]], None] | None = None) -> Handle:
        """Queue a request (thread-safe).

        Args:
            on_event: receives the request's Events (`smc_sd.engine.requests`); what it raises
                cancels the request.
            on_cycle: called after each of the request's cycles with its CycleStats and every
                particle's generated tokens; what it raises fails the request.

        Raises:
            QueueFullError: when `max_waiting` requests wait.
            RuntimeError: when the engine has died.
            and `check`'s errors.
        """
        plan = self._compile(request)
        entry = _Entry(request, plan, Handle(), on_event, on_cycle)
        with self._lock:
            if self.dead is not None:
                raise RuntimeError(f"the engine has stopped after an error: {self.dead}")
            if len(self._waiting) >= self.max_waiting:
                raise QueueFullError(f"{len(self._waiting)} requests are waiting, the most this engine queues")
            self._waiting.append(entry)
        self._wake.set()
        return entry.handle

    def step(self) -> bool:
        """One cycle over every running request, after admitting waiting ones.

        Returns:
            False when nothing is running or waiting afterwards.

        Raises:
            the error of a backend pass (the engine is then dead and every request failed).
        """
        self._guard_backends(self._admit_and_cycle)
        with self._lock:
            return bool(self._running or self._waiting)

    def admit(self) -> None:
        """Join the waiting requests there is room for (they draw their first tokens) without
        running a cycle; `step` does this first."""
        self._guard_backends(self._admit_waiting)

    def _admit_and_cycle(self) -> None:
        self._admit_waiting()
        if self._running:
            self._cycle()
            self._reseat()

    def _admit_waiting(self) -> None:
        if self._drop_cancelled() | self._admit():
            self._reseat()

    def _guard_backends(self, call) -> None:
        """Run engine work, lending it the engine's scratch blocks and kernels
        (`smc_sd.engine.cycle_locals`); a failure there (a backend pass) kills the engine and
        every request."""
        if self.dead is not None:
            raise RuntimeError(f"the engine has stopped after an error: {self.dead}")
        try:
            with lending(scratch=self._scratch, kernels=self._kernels):
                call()
        except BaseException as error:
            self._die(error)
            raise

    def run_forever(self, stop_event: threading.Event) -> None:
        """Step until `stop_event` is set (the server's loop thread); returns when the engine dies."""
        while not stop_event.is_set():
            try:
                busy = self.step()
            except BaseException:
                return
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

    def stats(self) -> dict:
        """Counters and gauges for /metrics.

        Keys: requests_running, requests_waiting, tokens_total (generated tokens over every
        particle), target_passes_total (batched target passes), accepted_total and
        drafted_total (exact speculative decoding's draft tokens), ess_mean (mean ESS / N of
        the running SMC requests' last cycles; NaN when none), resamples_total,
        kv_blocks_in_use (target and draft together).
        """
        with self._lock:
            running, waiting = [e.group for e in self._running], len(self._waiting)
            totals = dict(self._totals)
        ess = []
        for group in running:
            if group is None:
                continue
            totals["tokens_total"] += group.tokens_out
            totals["accepted_total"] += group.accepted
            totals["drafted_total"] += group.drafted
            totals["resamples_total"] += sum(c.resampled for c in group.cycles)
            if group.plan.verification == "importance" and group.cycles:
                ess.append(group.cycles[-1].ess / group.plan.particles)
        blocks = 0
        for rows in (self.target_rows, *self.draft_sets):
            memory = rows.memory()
            blocks += memory.get("live_blocks", 0) if memory else 0
        return {
            "requests_running": len(running),
            "requests_waiting": waiting,
            **totals,
            "ess_mean": sum(ess) / len(ess) if ess else math.nan,
            "kv_blocks_in_use": blocks,
        }

    # --- one cycle ------------------------------------------------------------------------

    def _compile(self, request: Request):
        from smc_sd.compiler import compile_program

        program, schedule = request.program, request.schedule
        if len(request.prompt) == 0:
            raise ValueError("the prompt is empty; give at least one token")
        if program.target.lm is not self.target:
            raise ValueError("the request's target model is not the engine's target")
        proposal = program.proposal
        if proposal is not None and proposal.lm is not None and all(proposal.lm is not rows.lm for rows in self.draft_sets):
            raise ValueError("the request's draft model is not one of the engine's drafts")
        if proposal is not None and proposal.free is not None and program.verification == "importance" and schedule.particles > 1 and not self._keeps_ragged_rows():
            raise RowsOfOneLengthError(ONE_LENGTH_REFUSAL)
        if schedule.particles > self.table.max_slots:
            raise ValueError(f"{schedule.particles} particles exceed the engine's {self.table.max_slots} particle slots")
        if any(not isinstance(s, str) or not s for s in request.stop):
            raise ValueError("every stop string must be a non-empty string")
        return compile_program(program, schedule, len(request.prompt))

    def _keeps_ragged_rows(self) -> bool:
        """False once the engine has seen that the target's rows keep one length (a join or the
        rows held say so); True until then."""
        return self._ragged and (self.target_rows.rows is None or self.target_rows.ragged)

    def _drop_cancelled(self) -> bool:
        with self._lock:
            cancelled = [e for e in self._waiting if e.handle.cancelled]
            for entry in cancelled:
                self._waiting.remove(entry)
        dropped = [e for e in self._running if e.handle.cancelled]
        for entry in cancelled + dropped:
            self._leave(entry, None, CancelledError("the request was cancelled"))
        return bool(dropped)

    def _admit(self) -> bool:
        """Join waiting requests while there is room, their prompts in one forward per model;
        True if any joined."""
        entries: list[_Entry] = []
        while True:
            with self._lock:
                if not self._waiting or len(self._running) + len(entries) >= self.max_running:
                    break
                entry = self._waiting[0]
                if entry.plan.particles > self.table.free or (not self._ragged and (self.target_rows.size or entries)):
                    break
                self._waiting.popleft()
            if entry.handle.cancelled:
                self._leave(entry, None, CancelledError("the request was cancelled"))
                continue
            kind = group_kind(entry.plan)
            try:
                entry.group = kind(entry.request, entry.plan, self.table)
            except Exception as error:
                self._leave(entry, None, error)
                continue
            entries.append(entry)
        if not entries:
            return False
        with self._lock:
            self._running.extend(entries)
        try:
            joined = join_groups(self.target_rows, self.draft_sets, [e.group for e in entries])
        except NotImplementedError as error:
            if not self._ragged:
                # one request alone was refused: nothing to fall back to
                for entry in entries:
                    self._leave(entry, None, error)
                return False
            # the backend keeps rows of one length: from now on one request runs at a time
            self._ragged = False
            with self._lock:
                for entry in reversed(entries):
                    self._running.remove(entry)
                    self._waiting.appendleft(entry)
            for entry in entries:
                self.table.release(entry.group.slots)
                entry.group = None
            return False
        for entry, (bases, logits) in zip(entries, joined):
            if entry.group.needs_ragged_rows and not self.target_rows.ragged:
                self._leave(entry, None, RowsOfOneLengthError(ONE_LENGTH_REFUSAL))
                continue
            if self._attempt(entry, entry.group.begin, logits, *bases):
                note_kv(self.table, self.target_rows, self.draft_sets, [entry.group])
                self._finish_or_report(entry)
        return True

    def _cycle(self) -> None:
        """Draft passes, one target pass, and every request's verification.

        Four kinds of request share the cycle: the SMC-SD requests the batched step verifies
        (`ImportanceGroup.verifies_in_step`) that are unconstrained, gathered per draft model
        and draft length into `StepRows` that draft, feed and verify all their rows at once;
        the accept/reject requests (`SpeculativeGroup`), verified together in one
        `verify_speculative_rows`; the SMC-SD requests whose free draft proposes this cycle,
        extended together in one `extend_free_rows`; and the rest, each preparing, drafting,
        feeding and verifying its own rows (a constrained step request joins a step for its
        verification)."""
        entries = list(self._running)
        groups = [e.group for e in entries]
        vocab = self.target.vocabulary.size
        stepped = [g.plan.verification == "importance" and g.verifies_in_step for g in groups]
        joint = [s and g.plan.masker is None for s, g in zip(stepped, groups)]
        speculative = [isinstance(g, SpeculativeGroup) for g in groups]
        healthy = [joint[i] or self._attempt(entries[i], groups[i].prepare) for i in range(len(groups))]
        free = [healthy[i] and isinstance(g, FreeImportanceGroup) and not g.lm_cycle for i, g in enumerate(groups)]
        own = [i for i in range(len(groups)) if not (joint[i] or speculative[i] or free[i])]
        # [A_g] rows of each request on its own
        target_rows = {i: self.table.target_row[groups[i].seats()[1]] for i in own if healthy[i]}
        steps = joint_steps([g for g, j in zip(groups, joint) if j], self.table)
        for rows in self.draft_sets:
            units = [DraftUnit(step.rows_of(self.table.draft_row), step.draft_len, step.draft_feed, step.drafter.draw) for step in steps if step.drafter is not None and step.groups[0].plan.draft is rows.lm]
            for i, g in enumerate(groups):
                if healthy[i] and not joint[i] and g.has_draft and g.plan.draft is rows.lm:
                    units.append(DraftUnit(self.table.draft_row[g.live()], g.draft_len, g.draft_feed, g.draw, lambda error, e=entries[i]: self._leave(e, None, error)))
            draft_passes(rows, units, self.target.vocabulary.eos_token_id)
        healthy = [ok and e.group is not None for ok, e in zip(healthy, entries)]
        step_blocks = [step.block(vocab) for step in steps]
        pieces = [(step.rows_of(self.table.target_row), *step.target_feed(block)) for step, block in zip(steps, step_blocks)]
        widths = {i: groups[i].target_width() for i in own if healthy[i]}
        pieces += [(target_rows[i], *groups[i].target_feed()) for i in widths]
        proposals = {}
        for i in range(len(groups)):
            if speculative[i] and healthy[i]:
                healthy[i] = self._attempt(entries[i], lambda g=groups[i], i=i: proposals.__setitem__(i, g.proposal(vocab)))
        proposals = {i: b for i, b in proposals.items() if healthy[i]}
        if proposals:
            pieces.append(speculative_feed([groups[i] for i in proposals], self.table, list(proposals.values())))
        extending = [i for i in range(len(groups)) if free[i]]
        if extending:
            pieces.append(free_feed([groups[i] for i in extending], self.table))
        logits, starts = self._target_pass(pieces)
        note_kv(self.table, self.target_rows, self.draft_sets, [g for g, ok in zip(groups, healthy) if ok])
        for i in widths:
            if not stepped[i]:
                healthy[i] = self._attempt(entries[i], groups[i].verify, row_logits(logits, starts, target_rows[i], widths[i]))
        for step, block in zip(steps, step_blocks):
            for g, count in zip(step.groups, verify_importance_rows(step, logits, starts, block, None)):
                g.end_verify(count)
        self._verify_constrained([i for i in widths if stepped[i] and healthy[i]], entries, healthy, logits, starts)
        if proposals:
            verdicts = verify_speculative_rows([groups[i] for i in proposals], self.table, logits, starts, list(proposals.values()))
            for (i, block), verdict in zip(proposals.items(), verdicts):
                healthy[i] = self._attempt(entries[i], groups[i].conclude, block, verdict)
        if extending:
            for i, extension in zip(extending, extend_free_rows([groups[i] for i in extending], self.table, logits, starts)):
                healthy[i] = self._attempt(entries[i], groups[i].conclude_free, *extension)
        self._resample([i for i, g in enumerate(groups) if healthy[i] and g.pending_stats is not None], entries, healthy)
        for i, (e, g) in enumerate(zip(entries, groups)):
            if healthy[i] and e.on_cycle is not None:
                healthy[i] = self._attempt(e, e.on_cycle, g.cycles[-1], g.particle_tokens())
        for e, ok in zip(entries, healthy):
            if ok:
                self._finish_or_report(e)

    def _target_pass(self, pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """ONE target pass over every row: pieces of (rows [X] int64, tokens [X, w] int64,
        counts [X] int64), row x reading its first counts[x] tokens (rows of failed requests
        read nothing).

        Returns:
            [sum(counts), V] float32 logits packed row after row, and [B_t + 1] int64: where
            each row's logits start.
        """
        eos = self.target.vocabulary.eos_token_id
        width = max(tokens.shape[1] for _, tokens, _ in pieces)
        # [B_t, width]: last token, block, EOS filler; [B_t]: the tokens each row reads
        feed = torch.full((self.target_rows.size, width), eos, dtype=torch.int64)
        counts = torch.zeros(self.target_rows.size, dtype=torch.int64)
        for rows, tokens, read in pieces:
            feed[rows, : tokens.shape[1]] = tokens
            counts[rows] = read
        logits = self.target_rows.extend(feed, counts)
        self._totals["target_passes_total"] += 1
        return logits, torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])

    def _verify_constrained(self, members: list[int], entries: list[_Entry], healthy: list[bool], logits: torch.Tensor, starts: torch.Tensor) -> None:
        """Verify the constrained requests of the batched step (`members`, indices into
        `entries`): each asks its constraint for its bonus masks (what fails there fails that
        request only), then those of one draft length verify together."""
        vocab = logits.shape[-1]
        masks = {}
        for i in members:
            g = entries[i].group
            healthy[i] = self._attempt(entries[i], lambda g=g, i=i: masks.__setitem__(i, g.bonus_mask(g.drafter.block(vocab).tokens)))
        for k in sorted({entries[i].group.draft_len for i in members if healthy[i]}):
            chosen = [i for i in members if healthy[i] and entries[i].group.draft_len == k]
            step = StepRows.of([entries[i].group for i in chosen], self.table, joint_drafter=False)
            counts = verify_importance_rows(step, logits, starts, step.block(vocab), torch.cat([masks[i] for i in chosen]))
            for g, count in zip(step.groups, counts):
                g.end_verify(count)

    def _resample(self, members: list[int], entries: list[_Entry], healthy: list[bool]) -> None:
        """The end of the cycle of every SMC-SD request `members` (indices into `entries`)
        whose block is stored: one `resample_groups` over all of them, then each records its
        cycle (a request whose every weight is zero fails alone)."""
        if not members:
            return
        outcomes = resample_groups([entries[i].group for i in members], self.table)
        for i, outcome in zip(members, outcomes):
            healthy[i] = self._attempt(entries[i], entries[i].group.record_cycle, outcome)

    def _attempt(self, entry: _Entry, call, *args) -> bool:
        """Run a request's own step; a failure fails that request only. Returns success."""
        try:
            call(*args)
            return True
        except Exception as error:
            self._leave(entry, None, error)
            return False

    def _finish_or_report(self, entry: _Entry) -> None:
        """Deliver the Result of a request that is done, else report its agreed tokens."""
        if not entry.group.done:
            self._report(entry)
            return
        try:
            result = entry.group.result(self._request_kv(entry.group))
        except Exception as error:
            self._leave(entry, None, error)
            return
        self._leave(entry, result, None)

    def _request_kv(self, group: Group) -> dict | None:
        """A finishing request's KV statistics (`Result.kv`): the peaks of its own rows where the
        backends attribute KV to rows (scope "request"), else the engine's rows at its end (scope
        "engine": vLLM, llama.cpp, the static cache), or None without a KV cache."""
        if group.kv_peak is not None:
            return {"scope": "request", **group.kv_peak}
        engine = kv_memory(self.target_rows, *self.draft_sets)
        return None if engine is None else {"scope": "engine", **engine}

    def _reseat(self) -> None:
        reseat_groups(self.table, self.target_rows, self.draft_sets, [e.group for e in self._running])

    # --- requests leaving -----------------------------------------------------------------

    def _report(self, entry: _Entry) -> None:
        """Send a "tokens" event when the particles' agreed tokens grew."""
        if entry.on_event is None:
            return
        agreed = entry.group.agreed_tokens()
        if len(agreed) > entry.agreed:
            entry.agreed = len(agreed)
            self._send(entry, Event("tokens", agreed))

    def _leave(self, entry: _Entry, result: Result | None, error: BaseException | None) -> None:
        """A request is done, failed or cancelled: settle its handle, free its slots (its rows
        go at the next reseat)."""
        group = entry.group
        with self._lock:
            if entry in self._running:
                self._running.remove(entry)
            if group is not None:
                self._totals["tokens_total"] += group.tokens_out
                self._totals["accepted_total"] += group.accepted
                self._totals["drafted_total"] += group.drafted
                self._totals["resamples_total"] += sum(c.resampled for c in group.cycles)
        if group is not None:
            self.table.release(group.slots)
            entry.group = None
        entry.handle._settle(result, error)
        if error is not None:
            self._send(entry, Event("error", [], error=error))
        else:
            self._send(entry, Event("done", list(result.tokens), result=result))

    def _send(self, entry: _Entry, event: Event) -> None:
        if entry.on_event is None:
            return
        try:
            entry.on_event(event)
        except Exception:
            # a listener that fails is gone: drop its request at the next cycle
            entry.handle.cancel()

    def _die(self, error: BaseException) -> None:
        self.dead = error
        with self._lock:
            entries = list(self._running) + list(self._waiting)
            self._running.clear()
            self._waiting.clear()
        for entry in entries:
            if not entry.handle.done:
                self._leave(entry, None, error)
        for rows in (self.target_rows, *self.draft_sets):
            rows.close()


def group_kind(plan) -> type[Group]:
    """The group that runs a plan: SMC-SD (with an LM draft or the target's), SMC-SD with a
    free draft, or accept/reject (exact sd and mask-at-verify, either draft)."""
    if plan.verification != "importance":
        return SpeculativeGroup
    return ImportanceGroup if plan.free is None else FreeImportanceGroup

