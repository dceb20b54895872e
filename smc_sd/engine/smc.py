"""The SMC-SD loop: draft K tokens per particle, verify all N (K + 1) in one target pass, weight,
resample.

One cycle for every particle i (DESIGN.md, "The maths"):

    x_1..x_K ~ q(. | prefix)                          draft, at temperature T_d
    x_{K+1}  ~ p_T(. | prefix, x_1..x_K)^alpha / Z     bonus token from the same target pass
    log w_i += sum_k [alpha log p_T(x_k) - log q(x_k)] + log Z,   Z = sum_v p_T(v)^alpha

Columns after an EOS, and columns past the token budget, add nothing. When ESS = 1 / sum w̄² falls
below tau N the particles are resampled, log Z_hat += logsumexp(log w) - log N, and every log w
resets to 0; the final weights add the same term at the end.

The first token comes from the prompt's forward: each particle draws its own token from
p_T(.)^alpha / Z_0 with log w = log Z_0.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from smc_sd.backends.base import Sequences
from smc_sd.engine.masking import apply_mask, masked_logprobs
from smc_sd.engine.resampling import effective_sample_size, log_mean_weight, normalised_weights, resample
from smc_sd.engine.rescoring import rescore, retwist
from smc_sd.engine.result import AllParticlesDiedError, CycleStats, Result, kv_memory
from smc_sd.engine.sampling import gather_last, sample_tokens, tempered_logprobs
from smc_sd.program.constraints import UnsatisfiableConstraintError


@dataclass
class DraftBlock:
    """K drafted tokens per particle and the distributions they were drawn from.

    Attributes:
        tokens: [N, K] int64.
        logq: [N, K, V] float32 log q~ at each drafted position: the draft at temperature T_d,
            masked by the constraints and renormalised (q itself when unconstrained).
        masks: [N, K, V] bool constraint masks at each position, or None when unconstrained.
        dead: [N, K] bool, positions where q~ does not exist (the mask allowed no token, or only
            tokens of draft probability zero), or None. Their tokens were drawn unmasked and the
            particle must get weight zero.
    """

    tokens: torch.Tensor
    logq: torch.Tensor
    masks: torch.Tensor | None = None
    dead: torch.Tensor | None = None


def draft_block(
    rows: Sequences,
    unseen: torch.Tensor,
    draft_len: int,
    temperature: float,
    generator: torch.Generator,
    mask_at: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> DraftBlock:
    """Draw K tokens per row from the (masked) draft.

    Args:
        rows: the draft's sequences (N rows).
        unseen: [N, U] int64 tokens of the prefix the draft has not read yet (U >= 1).
        draft_len: K.
        temperature: T_d.
        mask_at: maps the tokens drafted so far, [N, j] int64, to the constraint mask before
            position j + 1 ([N, V] bool) and its dead rows ([N] bool); None when unconstrained.

    Returns:
        The block; the draft has then read everything but its last token.
    """
    drafted, logq, masks, dead = [], [], [], []
    feed = unseen
    for _ in range(draft_len):
        # [N, V]: next-token distribution after the last fed token
        logq_next = tempered_logprobs(rows.extend(feed)[:, -1], temperature)
        if mask_at is not None:
            # [N, j]: the tokens drafted so far
            so_far = torch.stack(drafted, 1) if drafted else unseen.new_empty(unseen.shape[0], 0)
            mask, _ = mask_at(so_far)
            # rows that are not live have all-one masks, so only live rows can lack mass
            logq_next, no_mass = masked_logprobs(logq_next, mask)
            masks.append(mask)
            dead.append(no_mass)
        token = sample_tokens(logq_next, generator)
        drafted.append(token)
        logq.append(logq_next)
        feed = token[:, None]
    if mask_at is None:
        return DraftBlock(torch.stack(drafted, 1), torch.stack(logq, 1))
    return DraftBlock(torch.stack(drafted, 1), torch.stack(logq, 1), torch.stack(masks, 1), torch.stack(dead, 1))


def block_masks(masker, prefixes: list[list[int]], live: torch.Tensor, eos: int):
    """The `mask_at` of one cycle: masks after each particle's prefix plus the block so far.

    Args:
        masker: a `Masker`.
        prefixes: N lists of generated tokens before the cycle.
        live: [N] bool, particles that are unfinished and have nonzero weight.

    Returns:
        mask_at(drafted [N, j] int64) -> (mask [N, V] bool, dead [N] bool); rows with an EOS
        among the drafted tokens are no longer live.
    """

    def mask_at(drafted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [prefix + block for prefix, block in zip(prefixes, drafted.tolist())]
        return masker(rows, live & ~(drafted == eos).any(1))

    return mask_at


def block_mask(block: torch.Tensor, finished: torch.Tensor, eos: int, budget: int) -> torch.Tensor:
    """Which of a block's columns count: the particle was alive before the cycle, no EOS earlier
    in the block, and the column lies within the remaining token budget.

    Args:
        block: [N, K + 1] int64 drafted tokens then the bonus token.
        finished: [N] bool, particles that ended before this cycle.
        budget: tokens each particle may still generate.

    Returns:
        [N, K + 1] bool.
    """
    is_eos = (block == eos).long()
    # an EOS strictly before this column
    eos_before = (torch.cumsum(is_eos, 1) - is_eos) > 0
    columns = torch.arange(block.shape[1])
    return (~finished)[:, None] & ~eos_before & (columns < budget)[None, :]


def trim_at_eos(ids: list[int], eos: int) -> list[int]:
    """Token ids up to and including the first EOS."""
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def first_token_mask(masker) -> torch.Tensor | None:
    """[V] bool mask of the first generated token, or None when unconstrained.

    Raises:
        UnsatisfiableConstraintError: if the constraints allow no first token (not even EOS).
    """
    if masker is None:
        return None
    mask, dead = masker([[]], torch.ones(1, dtype=torch.bool))
    if bool(dead[0]):
        raise UnsatisfiableConstraintError("the constraints admit no string: no first token satisfies them")
    return mask[0]


def complete_at_budget(plan, tokens: torch.Tensor, finished: torch.Tensor, logw: torch.Tensor, log_phi: torch.Tensor, eos: int) -> torch.Tensor:
    """The final weights under the token budget: phi is 0 on a string that is not complete.

    A particle without EOS is complete iff every constraint allows EOS after its string; its
    block-end potentials then give their complete score in place of the prefix score. Without
    constraints every string is complete and the weights are returned unchanged.

    Args:
        tokens: [N, S] int64 generated tokens; finished: [N] bool, particles that produced EOS.
        logw, log_phi: [N] float64 log weights and the block-end potentials' scores inside them.

    Returns:
        [N] float64 log weights, -inf on particles whose string is not complete.
    """
    if plan.masker is None:
        return logw
    cut = (~finished & torch.isfinite(logw)).nonzero().flatten()
    complete = finished.clone()
    complete[cut] = plan.masker.complete(tokens[cut].tolist())
    if plan.potential is not None:
        logw, _ = rescore(plan.potential, tokens, complete, complete & ~finished, logw, log_phi, eos)
    return logw.masked_fill(~complete, -math.inf)


def run_smc(plan, prompt: list[int], generator: torch.Generator, on_cycle=None) -> Result:
    """Run an importance-verified StepPlan (SMC-SD; K = 0 is SMC with the target as proposal).

    With constraints the draft and the bonus token are masked (module docstring of
    `smc_sd.engine.masking`): a drafted column adds alpha log p_T(x_k) - log q~(x_k) and the bonus
    adds log sum_v p_T(v)^alpha m(v); a particle whose mask allows no token gets weight zero.
    Block-end potentials phi add log phi(new prefix) - log phi(old prefix) at the first token and
    at every block end (complete scores for finished particles) and stay in the final weights.
    With a twist, log w += log psi(first token) at the first token and log psi(new prefix) -
    log psi(old prefix) at every block end; the last twist is removed from the final weights.

    The token budget is part of the target (`complete_at_budget`): a particle whose string is not
    complete at the end gets weight zero; when no particle is complete an incomplete one is
    returned with `complete` False and log Z_hat = -inf.

    Returns:
        The Result; raises AllParticlesDiedError (carrying the partial Result) if every weight
        reaches zero, and UnsatisfiableConstraintError if the constraints admit no string.
    """
    start = time.perf_counter()
    n, k, eos = plan.particles, plan.draft_len, plan.target.vocabulary.eos_token_id
    first_mask = first_token_mask(plan.masker)
    target_rows, first_logits = plan.target.open(prompt, n)
    draft_rows = plan.draft.open(prompt, n)[0] if plan.draft is not None else None
    try:
        # [V]: alpha log p_T of the first token, masked by the constraints
        first_scores = apply_mask(plan.alpha * tempered_logprobs(first_logits, plan.target_temperature), first_mask)
        # where the mask leaves no mass every weight is zero below; draw unmasked to keep going
        first = sample_tokens(first_scores.expand(n, -1) if torch.isfinite(first_scores).any() else first_logits.expand(n, -1), generator)
        # [N] float64, relative to the last resampling (twist included)
        logw = torch.full((n,), float(torch.logsumexp(first_scores, 0)), dtype=torch.float64)
        # [N] float64 log psi and log phi (block-end potentials) of each prefix, inside logw
        log_twist = torch.zeros(n, dtype=torch.float64)
        log_phi = torch.zeros(n, dtype=torch.float64)
        log_z = 0.0
        # [N, S] generated tokens; [N, 1] / [N, U] tokens the target / draft have not read
        tokens = first[:, None]
        target_unseen, draft_unseen = first[:, None], first[:, None]
        finished = first == eos
        if plan.potential is not None:
            logw, log_phi = rescore(plan.potential, tokens, finished, torch.ones(n, dtype=torch.bool), logw, log_phi, eos)
        if plan.twist is not None:
            logw, log_twist = retwist(plan.twist, tokens, finished, logw, log_twist)
        cycles: list[CycleStats] = []
        draft_passes = 0

        def result(final_logw: torch.Tensor, final_log_z: float, chosen: int, complete: bool = True) -> Result:
            return Result(
                method=plan.name,
                prompt=prompt,
                particles=[trim_at_eos(row, eos) for row in tokens.tolist()],
                finished=finished.tolist(),
                log_weights=final_logw,
                log_ml=final_log_z,
                chosen=chosen,
                cycles=cycles,
                target_passes=len(cycles),
                draft_passes=draft_passes,
                seconds=time.perf_counter() - start,
                decode=plan.target.decode,
                kv=kv_memory(target_rows, draft_rows),
                mask_seconds=plan.masker.seconds if plan.masker is not None else 0.0,
                complete=complete,
            )

        if not torch.isfinite(logw).any():
            raise AllParticlesDiedError("the constraints allow no first token of nonzero probability", result(logw, -math.inf, 0))
        while tokens.shape[1] < plan.max_tokens and not bool(finished.all()):
            budget = plan.max_tokens - tokens.shape[1]
            mask_at = None
            if plan.masker is not None:
                mask_at = block_masks(plan.masker, tokens.tolist(), ~finished & torch.isfinite(logw), eos)
            if k > 0:
                draft = draft_block(draft_rows, draft_unseen, k, plan.draft_temperature, generator, mask_at)
                draft_passes += k
            else:
                draft = DraftBlock(torch.empty(n, 0, dtype=torch.long), torch.empty(n, 0, first_logits.numel()))
            drafted = draft.tokens
            # [N, K + 1, V]: alpha log p_T after the unseen token and after each drafted token
            scores = plan.alpha * tempered_logprobs(
                target_rows.extend(torch.cat([target_unseen, drafted], 1)), plan.target_temperature
            )
            # [N, V]: the bonus token's scores, masked; dead rows draw unmasked, at weight zero
            bonus_scores = scores[:, k]
            if mask_at is not None:
                # a dead bonus row has an all -inf score row: its logsumexp zeroes the weight
                bonus_mask, _ = mask_at(drafted)
                bonus_scores = apply_mask(bonus_scores, bonus_mask)
            bonus = sample_tokens(torch.where(bonus_scores.isfinite().any(-1, keepdim=True), bonus_scores, scores[:, k]), generator)
            block = torch.cat([drafted, bonus[:, None]], 1)
            # [N, K + 1] log-weight increments: drafted columns, then the bonus normaliser
            increments = torch.cat(
                [gather_last(scores[:, :k], drafted) - gather_last(draft.logq, drafted), torch.logsumexp(bonus_scores, -1, keepdim=True)], 1
            ).double()
            if draft.dead is not None:
                increments[:, :k] = increments[:, :k].masked_fill(draft.dead, -math.inf)
            keep = block_mask(block, finished, eos, budget)
            logw = logw + torch.where(keep, increments, torch.zeros_like(increments)).sum(1)
            was_running = ~finished
            finished = finished | ((block == eos) & keep).any(1)
            tokens = torch.cat([tokens, block[:, : min(k + 1, budget)]], 1)
            target_unseen = bonus[:, None]
            draft_unseen = block[:, -2:] if k > 0 else None
            if plan.potential is not None:
                logw, log_phi = rescore(plan.potential, tokens, finished, was_running, logw, log_phi, eos)
            if plan.twist is not None:
                logw, log_twist = retwist(plan.twist, tokens, finished, logw, log_twist)

            ess = effective_sample_size(logw)
            if ess == 0.0:
                cycles.append(CycleStats(ess, False, -math.inf, min(k + 1, budget), n))
                raise AllParticlesDiedError(
                    "every particle reached weight zero", result(logw, -math.inf, 0)
                )
            resampled = ess < plan.ess_threshold * n
            if resampled:
                log_z += log_mean_weight(logw)
                ancestors = resample(logw, generator, plan.resampling)
                tokens, finished = tokens[ancestors], finished[ancestors]
                log_twist, log_phi = log_twist[ancestors], log_phi[ancestors]
                target_unseen = target_unseen[ancestors]
                target_rows.select(ancestors)
                if draft_rows is not None:
                    draft_unseen = draft_unseen[ancestors]
                    draft_rows.select(ancestors)
                logw = torch.zeros(n, dtype=torch.float64)
            cycles.append(CycleStats(ess, resampled, log_z, min(k + 1, budget), n))
            if on_cycle is not None:
                on_cycle(cycles[-1], tokens.tolist())

        # the last twist comes off: the final weights target pi itself
        logw = logw - log_twist
        if not torch.isfinite(logw).any():
            raise AllParticlesDiedError("every particle reached weight zero", result(logw, -math.inf, 0))
        final_logw = complete_at_budget(plan, tokens, finished, logw, log_phi, eos)
        if not torch.isfinite(final_logw).any():
            # no particle holds a complete string: return an incomplete one, marked as such
            chosen = int(torch.multinomial(normalised_weights(logw), 1, generator=generator))
            return result(logw, -math.inf, chosen, complete=False)
        chosen = int(torch.multinomial(normalised_weights(final_logw), 1, generator=generator))
        return result(final_logw, log_z + log_mean_weight(final_logw), chosen)
    finally:
        target_rows.close()
        if draft_rows is not None:
            draft_rows.close()
