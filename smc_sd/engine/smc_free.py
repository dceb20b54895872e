"""SMC-SD with free drafts: SMC with the locally optimal proposal, made fast by model-free drafts.

The target is SMC-SD's, pi(x) ∝ p_T(x)^alpha · phi(x) (phi the constraints, 0 on strings the
budget leaves incomplete). A deterministic free draft cannot be SMC's proposal: it would cut the
target's support (other tokenizations of the same bytes). Instead every particle is extended by
exact speculative sampling of the locally masked target

    q_loc(v | x) = p_T(v | x)^alpha m(v | x) / Z(x),     Z(x) = sum_v p_T(v | x)^alpha m(v | x),

with its free draft d as the (point-mass) draft: d_j is accepted with probability q_loc(d_j),
else the residual q_loc without d_j is drawn and the block ends; a fully accepted block ends with
a bonus token from q_loc. Because the draft is a function of the prefix, which tokens were
accepted is a function of the tokens, and the extension e_1..e_n a block emits has probability
prod_j q_loc(e_j | x, e_<j) exactly. Its importance weight is therefore

    log w += sum_j log Z(x, e_<j)            (one term per emitted position),

the local normalisers (0 without constraints at alpha = 1: the particles are then independent
exact samples of p_T). Weights, ESS, resampling and log Z_hat are SMC-SD's (`smc_sd.engine.smc`):
log Z_hat += logsumexp(log w) - log N at each resampling and at the end.

Particles differ in length within a cycle: one target pass extends every running row by the
longest proposal plus one (the token the target has not read), and `truncate_rows` rolls each
row back to what it kept. Rows hold the running particles (not finished, below the budget) in
particle order. A particle reaching weight zero stops running.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from smc_sd.engine.drafting import first_token_mask, trim_at_eos
from smc_sd.engine.free_drafts import FreeDrafter, allowed_prefix, point_mass_rows
from smc_sd.engine.resampling import log_mean_weight, normalised_weights, resample_on_ess
from smc_sd.engine.result import AllParticlesDiedError, CycleStats, Result, kv_memory, mask_stats
from smc_sd.engine.sampling import sample_tokens, tempered_logprobs
from smc_sd.engine.speculative import accept_or_resample


def first_tokens(plan, first_logits: torch.Tensor, generator) -> tuple[list[list[int]], torch.Tensor]:
    """Every particle draws its own first token from p_T^alpha m / Z_0, with log w = log Z_0.

    Returns:
        (N one-token lists, [N] float64 log weights).
    """
    # [V]: alpha log p_T of the first token, masked
    scores = plan.alpha * tempered_logprobs(first_logits, plan.target_temperature, first_token_mask(plan.masker))
    log_z0 = float(torch.logsumexp(scores, 0))
    if not math.isfinite(log_z0):
        return [[0] for _ in range(plan.particles)], torch.full((plan.particles,), -math.inf, dtype=torch.float64)
    first = sample_tokens(scores.expand(plan.particles, -1), generator)
    return [[t] for t in first.tolist()], torch.full((plan.particles,), log_z0, dtype=torch.float64)


def proposals(plan, drafter: FreeDrafter, tokens: list[list[int]], running: list[int]) -> tuple[list[list[int]], list, list[int]]:
    """The free draft's proposal of every running particle, cut at the first refused token, and
    the masks at each of its positions (all particles' in one mask call).

    Returns:
        (proposals, masks, forced): per running particle its tokens d, [len(d) + 1, V] bool
        masks (None when unconstrained) and how many of d's leading tokens are forced.
    """
    proposed, forced = zip(*[drafter.propose(tokens[i], plan.max_tokens - len(tokens[i])) for i in running]) if running else ((), ())
    proposed = list(proposed)
    if plan.masker is None:
        return proposed, [None] * len(running), list(forced)
    prefixes = [tokens[i] + d[:j] for i, d in zip(running, proposed) for j in range(len(d) + 1)]
    # [sum (len(d) + 1), V]: one call for every position of every particle
    masks, _ = plan.masker(prefixes, torch.ones(len(prefixes), dtype=torch.bool))
    out, start = [], 0
    for d in proposed:
        rows = masks[start : start + len(d) + 1]
        start += len(d) + 1
        kept = allowed_prefix(d, rows)
        out.append((d[:kept], rows[: kept + 1]))
    return [d for d, _ in out], [m for _, m in out], [min(f, len(d)) for f, (d, _) in zip(forced, out)]


def extend_particle(plan, drafted: list[int], logits: torch.Tensor, masks, generator) -> tuple[list[int], list[float], int]:
    """One particle's exact speculative step on q_loc with the point-mass draft `drafted`.

    Args:
        drafted: d_1..d_m.
        logits: [m + 1, V] float32 target logits after the unseen token and after each d_j.
        masks: [m + 1, V] bool or None.

    Returns:
        (emitted, log_z, accepted): the emitted tokens (accepted drafts then the residual or
        bonus token), the log Z term of each emitted position (-inf where q_loc has no mass,
        whose token is then an EOS filler), and how many drafts were accepted.
    """
    # [m + 1, V]: alpha log p_T, masked, and its normalisers log Z
    scores = plan.alpha * tempered_logprobs(logits, plan.target_temperature, masks)
    log_z = torch.logsumexp(scores, -1)
    empty = (~torch.isfinite(log_z)).nonzero().flatten()
    if empty.numel() > 0:
        # q_loc has no mass at position j: the block can reach no further than j
        drafted = drafted[: int(empty[0])]
    m = len(drafted)
    terms = log_z.double().tolist()
    if not math.isfinite(terms[m]):
        return drafted + [plan.target.vocabulary.eos_token_id], terms[: m + 1], m
    logq = scores[: m + 1] - log_z[: m + 1, None]
    accepted, emitted = accept_or_resample(torch.tensor(drafted, dtype=torch.long), point_mass_rows(drafted, logits.shape[-1]), logq, generator)
    return drafted[:accepted] + [emitted], terms[: accepted + 1], accepted


def distinct_rows(tokens: list[list[int]], running: list[int]) -> tuple[list[int], list[int]]:
    """The rows of the running particles that hold distinct tokens, and each row's copy.

    Returns:
        (distinct, copy_of): the positions in `running` of the first particle of each distinct
        token list, and for every position r in `running` the index into `distinct` of its tokens.
    """
    first: dict[tuple[int, ...], int] = {}
    distinct, copy_of = [], []
    for r, i in enumerate(running):
        key = tuple(tokens[i])
        if key not in first:
            first[key] = len(distinct)
            distinct.append(r)
        copy_of.append(first[key])
    return distinct, copy_of


def running_particles(plan, tokens: list[list[int]], logw: torch.Tensor, ended: list[bool] | None = None) -> list[int]:
    """The particles a cycle extends: not ended (EOS, or a stop string when `ended` says so),
    below the budget, of nonzero weight."""
    eos = plan.target.vocabulary.eos_token_id
    return [
        i for i, row in enumerate(tokens)
        if eos not in row and len(row) < plan.max_tokens and math.isfinite(logw[i]) and not (ended and ended[i])
    ]


@dataclass
class CycleProposals:
    """One cycle's free-draft proposals: particles holding equal tokens (copies made by
    resampling) get the same proposal and the same logits, so one row computes them.

    Attributes:
        running: the particles extended, in particle order.
        distinct, copy_of: `distinct_rows` of them.
        drafted: per distinct row its proposal d.
        masks: per distinct row [len(d) + 1, V] bool masks, or None.
        forced: per distinct row how many of d's leading tokens the constraints force.
    """

    running: list[int]
    distinct: list[int]
    copy_of: list[int]
    drafted: list[list[int]]
    masks: list
    forced: list[int]

    @property
    def width(self) -> int:
        """Tokens every computed row reads: the unseen last token and the longest proposal."""
        return 1 + max(len(d) for d in self.drafted)

    def feed(self, tokens: list[list[int]], eos: int) -> torch.Tensor:
        """[U, width] int64: each distinct row's unseen last token, its proposal, then EOS filler."""
        width = self.width
        return torch.tensor([[tokens[self.running[r]][-1]] + d + [eos] * (width - 1 - len(d)) for r, d in zip(self.distinct, self.drafted)])

    @property
    def proposed(self) -> int:
        """Proposed tokens over every running particle (copies count theirs)."""
        return sum(len(self.drafted[u]) for u in self.copy_of)


def propose_distinct(plan, drafter: FreeDrafter, tokens: list[list[int]], running: list[int]) -> CycleProposals:
    """The free draft's proposals of one cycle, one per distinct running particle."""
    distinct, copy_of = distinct_rows(tokens, running)
    drafted, masks, forced = proposals(plan, drafter, tokens, [running[r] for r in distinct])
    return CycleProposals(running, distinct, copy_of, drafted, masks, forced)


def extend_running(plan, drafter: FreeDrafter, cycle: CycleProposals, logits: torch.Tensor, tokens: list[list[int]], logw: torch.Tensor, generator, stop_at=None) -> tuple[list[int], list[int], list[bool]]:
    """Extend every running particle by its exact speculative step on q_loc, in particle order,
    and add its log Z terms to its weight (module docstring); the lookup adapts to each block.

    Args:
        cycle: the cycle's proposals.
        logits: [U, width, V] float32 target logits of the distinct rows (`CycleProposals.feed`).
        tokens: every particle's tokens, extended in place.
        logw: [N] float64 log weights, updated in place.
        stop_at: (prefix, new tokens) -> the index of the new token that completes a stop
            string, or None; None when the request has no stop strings.

    Returns:
        (accepted, added, stopped) per running particle: drafts accepted, tokens kept, whether a
        stop string ended it.
    """
    eos = plan.target.vocabulary.eos_token_id
    accepted_out, added, stopped = [], [], []
    for r, i in enumerate(cycle.running):
        u = cycle.copy_of[r]
        d = cycle.drafted[u]
        emitted, terms, accepted = extend_particle(plan, d, logits[u, : len(d) + 1], cycle.masks[u], generator)
        new = trim_at_eos(emitted, eos)[: plan.max_tokens - len(tokens[i])]
        column = stop_at(tokens[i], new) if stop_at is not None else None
        if column is not None:
            new = new[: column + 1]
        # the weight counts the kept positions only (an EOS, a stop or the budget may cut the block)
        logw[i] += math.fsum(terms[: len(new)])
        tokens[i] += new
        accepted_out.append(accepted)
        added.append(len(new))
        stopped.append(column is not None)
        drafter.record(len(d), cycle.forced[u], accepted)
    return accepted_out, added, stopped


def run_smc_free(plan, prompt: list[int], generator: torch.Generator, on_cycle=None) -> Result:
    """Run an importance-verified StepPlan whose proposal is a free draft (module docstring).

    Returns:
        The Result; raises AllParticlesDiedError (carrying the partial Result) if every weight
        reaches zero.
    """
    start = time.perf_counter()
    n, eos = plan.particles, plan.target.vocabulary.eos_token_id
    target_rows, first_logits = plan.target.open(prompt, n)
    drafter = FreeDrafter.for_plan(plan, prompt)
    try:
        tokens, logw = first_tokens(plan, first_logits, generator)
        log_z = 0.0
        cycles: list[CycleStats] = []

        def result(final_logw: torch.Tensor, final_log_z: float, chosen: int, complete: bool = True) -> Result:
            return Result(
                method=plan.name, prompt=prompt, particles=[trim_at_eos(row, eos) for row in tokens],
                finished=[eos in row for row in tokens], log_weights=final_logw, log_ml=final_log_z, chosen=chosen, cycles=cycles,
                target_passes=len(cycles), draft_passes=0, seconds=time.perf_counter() - start,
                decode=plan.target.decode, kv=kv_memory(target_rows),
                **mask_stats(plan.masker), complete=complete, free_draft=drafter.report(),
            )

        if not torch.isfinite(logw).any():
            raise AllParticlesDiedError("no first token has nonzero probability under the target (and its constraints, if any)", result(logw, -math.inf, 0))
        # rows: the running particles, in particle order
        running = running_particles(plan, tokens, logw)
        if len(running) < n and running:
            target_rows.select(torch.tensor(running))
        while running:
            cycle = propose_distinct(plan, drafter, tokens, running)
            if len(cycle.distinct) < len(running):
                target_rows.select(torch.tensor(cycle.distinct))
            lengths_before = target_rows.lengths
            logits = target_rows.extend(cycle.feed(tokens, eos))
            if len(cycle.distinct) < len(running):
                target_rows.select(torch.tensor(cycle.copy_of))
            accepted, added, _ = extend_running(plan, drafter, cycle, logits, tokens, logw, generator)
            # the target keeps the unseen token and the accepted drafts
            target_rows.truncate_rows(torch.tensor([int(lengths_before[u]) + 1 + a for u, a in zip(cycle.copy_of, accepted)]))
            still = running_particles(plan, tokens, logw)
            if still and still != running:
                target_rows.select(torch.tensor([running.index(i) for i in still]))
            ess, ancestors, log_z_step = resample_on_ess(logw, plan.ess_threshold, generator, plan.resampling)
            if ess == 0.0:
                cycles.append(CycleStats(ess, False, -math.inf, max(added), n, rows=len(running)))
                raise AllParticlesDiedError("every particle reached weight zero", result(logw, -math.inf, 0))
            if ancestors is not None:
                log_z += log_z_step
                row_of = {i: r for r, i in enumerate(still)}
                tokens = [list(tokens[a]) for a in ancestors.tolist()]
                logw = torch.zeros(n, dtype=torch.float64)
                sources = [row_of[a] for a, row in zip(ancestors.tolist(), tokens) if eos not in row and len(row) < plan.max_tokens]
                if sources:
                    target_rows.select(torch.tensor(sources))
                still = running_particles(plan, tokens, logw)
            cycles.append(cycle_stats(cycle, ess, ancestors is not None, log_z, added, accepted, n))
            running = still
            if on_cycle is not None:
                on_cycle(cycles[-1], [list(row) for row in tokens])
        return conclude(plan, tokens, logw, log_z, generator, result)
    finally:
        target_rows.close()


def cycle_stats(cycle: CycleProposals, ess: float, resampled: bool, log_z: float, added: list[int], accepted: list[int], n: int) -> CycleStats:
    """A free-draft SMC cycle's diagnostics: rows computed are the distinct ones."""
    return CycleStats(ess, resampled, log_z, max(added), n, accepted=sum(accepted), rows=len(cycle.distinct), proposed=cycle.proposed)


def conclude(plan, tokens: list[list[int]], logw: torch.Tensor, log_z: float, generator, result) -> Result:
    """The final weights under the budget (a string that is not complete gets weight zero), the
    returned particle drawn ∝ them, and log Z_hat.

    The block-end potentials (here only the exact checks of constraints the masks
    over-approximate: `check_settings` refuses any other with a free draft) score each complete
    string x at the end: log w += log phi(x). The particles targeted p(x) 1[x in L_mask] with
    L_mask ⊇ L, so the reweighted ones target p(x) 1[x in L] and log Z_hat stays unbiased."""
    eos = plan.target.vocabulary.eos_token_id
    if not torch.isfinite(logw).any():
        raise AllParticlesDiedError("every particle reached weight zero", result(logw, -math.inf, 0))
    final = logw.clone()
    if plan.masker is not None:
        cut = [i for i, row in enumerate(tokens) if eos not in row and math.isfinite(logw[i])]
        if cut:
            complete = plan.masker.complete([tokens[i] for i in cut])
            for i, ok in zip(cut, complete.tolist()):
                if not ok:
                    final[i] = -math.inf
    if plan.potential is not None:
        scored = [i for i in range(len(tokens)) if math.isfinite(final[i])]
        if scored:
            # each string without its EOS
            strings = [tokens[i][: tokens[i].index(eos)] if eos in tokens[i] else tokens[i] for i in scored]
            final[scored] += torch.as_tensor(plan.potential.log_score(strings, [True] * len(scored)), dtype=torch.float64)
    if not torch.isfinite(final).any():
        chosen = int(torch.multinomial(normalised_weights(logw), 1, generator=generator))
        return result(logw, -math.inf, chosen, complete=False)
    chosen = int(torch.multinomial(normalised_weights(final), 1, generator=generator))
    return result(final, log_z + log_mean_weight(final), chosen)
