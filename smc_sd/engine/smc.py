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

import torch

from smc_sd.backends.base import Sequences
from smc_sd.engine.resampling import effective_sample_size, log_mean_weight, normalised_weights, resample
from smc_sd.engine.result import AllParticlesDiedError, CycleStats, Result
from smc_sd.engine.sampling import gather_last, sample_tokens, tempered_logprobs


def draft_block(
    rows: Sequences, unseen: torch.Tensor, draft_len: int, temperature: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw K tokens per row from the draft.

    Args:
        rows: the draft's sequences (N rows).
        unseen: [N, U] int64 tokens of the prefix the draft has not read yet (U >= 1).
        draft_len: K.
        temperature: T_d.

    Returns:
        drafted: [N, K] int64 tokens; logq: [N, K, V] float32 log q at each drafted position, the
        exact distributions the tokens were drawn from. The draft has then read everything but
        drafted[:, -1].
    """
    drafted, logq = [], []
    feed = unseen
    for _ in range(draft_len):
        # [N, V]: next-token distribution after the last fed token
        logq_next = tempered_logprobs(rows.extend(feed)[:, -1], temperature)
        token = sample_tokens(logq_next, generator)
        drafted.append(token)
        logq.append(logq_next)
        feed = token[:, None]
    return torch.stack(drafted, 1), torch.stack(logq, 1)


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


def run_smc(plan, prompt: list[int], generator: torch.Generator, on_cycle=None) -> Result:
    """Run an importance-verified StepPlan (SMC-SD; K = 0 is SMC with the target as proposal).

    Returns:
        The Result; raises AllParticlesDiedError (carrying the partial Result) if every weight
        reaches zero.
    """
    start = time.perf_counter()
    n, k, eos = plan.particles, plan.draft_len, plan.target.vocabulary.eos_token_id
    target_rows, first_logits = plan.target.open(prompt, n)
    draft_rows = plan.draft.open(prompt, n)[0] if plan.draft is not None else None
    try:
        # [V]: alpha log p_T of the first token
        first_scores = plan.alpha * tempered_logprobs(first_logits, plan.target_temperature)
        first = sample_tokens(first_scores.expand(n, -1), generator)
        # [N] float64, relative to the last resampling
        logw = torch.full((n,), float(torch.logsumexp(first_scores, 0)), dtype=torch.float64)
        log_z = 0.0
        # [N, S] generated tokens; [N, 1] / [N, U] tokens the target / draft have not read
        tokens = first[:, None]
        target_unseen, draft_unseen = first[:, None], first[:, None]
        finished = first == eos
        cycles: list[CycleStats] = []
        draft_passes = 0

        def result(final_logw: torch.Tensor, final_log_z: float, chosen: int) -> Result:
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
            )

        while tokens.shape[1] < plan.max_tokens and not bool(finished.all()):
            budget = plan.max_tokens - tokens.shape[1]
            if k > 0:
                drafted, logq = draft_block(draft_rows, draft_unseen, k, plan.draft_temperature, generator)
                draft_passes += k
            else:
                drafted, logq = torch.empty(n, 0, dtype=torch.long), torch.empty(n, 0, first_logits.numel())
            # [N, K + 1, V]: alpha log p_T after the unseen token and after each drafted token
            scores = plan.alpha * tempered_logprobs(
                target_rows.extend(torch.cat([target_unseen, drafted], 1)), plan.target_temperature
            )
            bonus = sample_tokens(scores[:, k], generator)
            block = torch.cat([drafted, bonus[:, None]], 1)
            # [N, K + 1] log-weight increments: drafted columns, then the bonus normaliser
            increments = torch.cat(
                [gather_last(scores[:, :k], drafted) - gather_last(logq, drafted), torch.logsumexp(scores[:, k], -1, keepdim=True)], 1
            ).double()
            keep = block_mask(block, finished, eos, budget)
            logw = logw + torch.where(keep, increments, torch.zeros_like(increments)).sum(1)
            finished = finished | ((block == eos) & keep).any(1)
            tokens = torch.cat([tokens, block[:, : min(k + 1, budget)]], 1)
            target_unseen = bonus[:, None]
            draft_unseen = block[:, -2:] if k > 0 else None

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
                target_unseen = target_unseen[ancestors]
                target_rows.select(ancestors)
                if draft_rows is not None:
                    draft_unseen = draft_unseen[ancestors]
                    draft_rows.select(ancestors)
                logw = torch.zeros(n, dtype=torch.float64)
            cycles.append(CycleStats(ess, resampled, log_z, min(k + 1, budget), n))
            if on_cycle is not None:
                on_cycle(cycles[-1], tokens.tolist())

        if not torch.isfinite(logw).any():
            raise AllParticlesDiedError("every particle reached weight zero", result(logw, -math.inf, 0))
        chosen = int(torch.multinomial(normalised_weights(logw), 1, generator=generator))
        return result(logw, log_z + log_mean_weight(logw), chosen)
    finally:
        target_rows.close()
        if draft_rows is not None:
            draft_rows.close()
