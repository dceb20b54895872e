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

A finished particle keeps its tokens and its weight, and stays resamplable, but costs no forward:
the backends' rows hold the unfinished particles only, row r being the r-th unfinished particle in
particle order (`reseat_rows` keeps that true after a cycle and after a resampling). Its copies
made by resampling are finished too, so its KV is never read again.

Dimension letters: N particles, A unfinished ones (rows of the backends), K draft length, V
vocabulary, S tokens generated so far.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from smc_sd.engine import kernels
from smc_sd.engine.drafting import DraftBlock, block_masks
from smc_sd.engine.resampling import log_mean_weight, normalised_weights
from smc_sd.engine.rescoring import rescore, retwist
from smc_sd.engine.sampling import logsumexp_floored, sample_tokens, scaling, tempered_logprobs


@dataclass(frozen=True)
class Particles:
    """The N particles between two cycles; every tensor is indexed by particle.

    Attributes:
        tokens: [N, S] int64 generated tokens (columns after a particle's EOS are EOS filler).
        finished: [N] bool, particles that produced EOS.
        logw: [N] float64 log weights relative to the last resampling, twist and potentials in.
        log_twist: [N] float64 log psi of each prefix, inside logw.
        log_phi: [N] float64 block-end potentials' log phi of each prefix, inside logw.
        target_unseen: [N, 1] int64, the token the target has not read (the last bonus token).
        draft_unseen: [N, U] int64 tokens the draft has not read, or None without a draft.
    """

    tokens: torch.Tensor
    finished: torch.Tensor
    logw: torch.Tensor
    log_twist: torch.Tensor
    log_phi: torch.Tensor
    target_unseen: torch.Tensor
    draft_unseen: torch.Tensor | None

    def take(self, ancestors: torch.Tensor) -> "Particles":
        """Particle i becomes a copy of particle ancestors[i], with log weight 0 (resampling)."""
        return Particles(
            tokens=self.tokens[ancestors],
            finished=self.finished[ancestors],
            logw=torch.zeros(ancestors.numel(), dtype=torch.float64),
            log_twist=self.log_twist[ancestors],
            log_phi=self.log_phi[ancestors],
            target_unseen=self.target_unseen[ancestors],
            draft_unseen=None if self.draft_unseen is None else self.draft_unseen[ancestors],
        )


def first_draws(plan, first_logits: torch.Tensor, first_mask: torch.Tensor | None, generator, n: int) -> tuple[torch.Tensor, float]:
    """n independent first tokens from p_T(.)^alpha · m / Z_0, and log Z_0 = log sum_v p_T(v)^alpha m(v).

    Every method draws its first token here: SMC's particles each get log w = log Z_0; exact
    speculative decoding (alpha = 1) draws one from p~ = p_T m / Z_0. Where m leaves no mass
    (log Z_0 = -inf) the tokens are drawn unmasked, to keep shapes; their weight is zero.

    Args:
        first_logits: [V] float32 target logits after the prompt.
        first_mask: [V] bool constraint mask of the first token, or None.

    Returns:
        ([n] int64 tokens, log Z_0).
    """
    # [V]: alpha log p_T of the first token, masked by the constraints
    scores = plan.alpha * tempered_logprobs(first_logits, plan.target_temperature, first_mask)
    log_z0 = float(logsumexp_floored(scores, 0))
    first = sample_tokens((scores if math.isfinite(log_z0) else first_logits.float()).expand(n, -1), generator)
    return first, log_z0


def first_particles(plan, first_logits: torch.Tensor, first_mask: torch.Tensor | None, generator) -> Particles:
    """Every particle draws its own first token (`first_draws`), log w = log Z_0, and the
    block-end potentials and twist score the one-token prefixes."""
    n, eos = plan.particles, plan.target.vocabulary.eos_token_id
    first, log_z0 = first_draws(plan, first_logits, first_mask, generator, n)
    state = Particles(
        tokens=first[:, None],
        finished=first == eos,
        logw=torch.full((n,), log_z0, dtype=torch.float64),
        log_twist=torch.zeros(n, dtype=torch.float64),
        log_phi=torch.zeros(n, dtype=torch.float64),
        target_unseen=first[:, None],
        draft_unseen=first[:, None] if plan.draft is not None else None,
    )
    return rescore_block_end(plan, state, torch.ones(n, dtype=torch.bool))


def cycle_masks(plan, state: Particles, active: torch.Tensor):
    """The `mask_at` of one cycle for the unfinished particles `active` ([A] int64), or None
    when the plan has no constraints (`smc_sd.engine.drafting.block_masks`)."""
    if plan.masker is None:
        return None
    eos = plan.target.vocabulary.eos_token_id
    return block_masks(plan.masker, state.tokens[active].tolist(), torch.isfinite(state.logw[active]), eos)


def verify_block(plan, target_logits: torch.Tensor, draft: DraftBlock, mask_at, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Score one request's drafted block with the target's logits and draw the bonus token
    (`smc_sd.engine.block_scores.score_rows`, with uniforms from the request's generator).

    With constraints the bonus token is masked (`smc_sd.engine.masking`): a drafted column adds
    alpha log p_T(x_k) - log q~(x_k), the bonus adds log sum_v p_T(v)^alpha m(v) (0 without a
    mask at alpha = 1), and a position where q~ does not exist gets -inf.

    Args:
        target_logits: [A, K + 1, V] float32 target logits after the unseen token and after
            each drafted token.
        draft: the cycle's DraftBlock ([A, K] tokens).
        mask_at: the cycle's masks, or None.

    Returns:
        block: [A, K + 1] int64 drafted tokens then the bonus token; increments: [A, K + 1]
        float64 their log-weight increments.
    """
    drafted, temperature, alpha = draft.tokens, plan.target_temperature, plan.alpha
    a = drafted.shape[0]
    mask = None if mask_at is None else mask_at(drafted)[0]
    # the bonus normaliser is 1 by construction without a mask and with alpha = 1
    weighted = None if mask is None and alpha == 1 else torch.ones(a, dtype=torch.bool)
    u = torch.rand(a, generator=generator, dtype=torch.float64, device=target_logits.device)
    return kernels.current().score_rows(
        target_logits, torch.full((a,), temperature), None if alpha == 1 else torch.full((a,), float(alpha)), mask, drafted, draft.drawn_logq,
        draft.dead, u, weighted, temperature == 0, scaling([temperature])
    )


def advance(plan, state: Particles, block: torch.Tensor, increments: torch.Tensor, stops: torch.Tensor | None = None) -> Particles:
    """Append the cycle's block to every particle and add the columns that count to its weight.

    Args:
        block, increments: [A, K + 1] from `propose_and_verify`; finished particles get EOS filler.
        stops: [A, K + 1] bool, columns after which the particle's string ends although they
            are not EOS (a stop string completed there), or None. The particle finishes there;
            later columns count nothing and become EOS filler, exactly as after an EOS.
    """
    n, k, eos = plan.particles, plan.draft_len, plan.target.vocabulary.eos_token_id
    budget = plan.max_tokens - state.tokens.shape[1]
    active = ~state.finished
    full_block, full_increments, keep = every_particles_block(block, increments, active, eos, budget)
    ends = (full_block == eos) & keep
    if stops is not None:
        full_stops = torch.zeros(n, k + 1, dtype=torch.bool)
        full_stops[active] = stops
        # a stop strictly before this column
        after_stop = (torch.cumsum(full_stops.long(), 1) - full_stops.long()) > 0
        keep = keep & ~after_stop
        full_block = full_block.masked_fill(after_stop, eos)
        ends = ((full_block == eos) | full_stops) & keep
    advanced = Particles(
        tokens=torch.cat([state.tokens, full_block[:, : min(k + 1, budget)]], 1),
        finished=state.finished | ends.any(1),
        logw=state.logw + kept_weight(keep, full_increments),
        log_twist=state.log_twist,
        log_phi=state.log_phi,
        target_unseen=full_block[:, -1:],
        draft_unseen=full_block[:, -2:] if k > 0 else None,
    )
    return rescore_block_end(plan, advanced, active)


def rescore_block_end(plan, state: Particles, fresh: torch.Tensor) -> Particles:
    """Swap the block-end potentials' and the twist's old scores for those of the new prefixes.

    Args:
        fresh: [N] bool, particles whose prefix changed (they were running before the block).
    """
    eos = plan.target.vocabulary.eos_token_id
    logw, log_phi, log_twist = state.logw, state.log_phi, state.log_twist
    if plan.potential is not None:
        logw, log_phi = rescore(plan.potential, state.tokens, state.finished, fresh, logw, log_phi, eos)
    if plan.twist is not None:
        logw, log_twist = retwist(plan.twist, state.tokens, state.finished, logw, log_twist, eos)
    return replace(state, logw=logw, log_phi=log_phi, log_twist=log_twist)


def every_particles_block(block: torch.Tensor, increments: torch.Tensor, active: torch.Tensor, eos: int, budget) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every particle's block and weight increments from the unfinished ones', with EOS filler
    and 0 on the finished particles, and the columns that count (`block_mask`).

    Args:
        block, increments: [A, K + 1] int64 and float64, the A = active.sum() unfinished
            particles' block and increments.
        active: [N] bool, the particles unfinished before the cycle.
        budget: as `block_mask`'s.

    Returns:
        [N, K + 1] int64 blocks, [N, K + 1] float64 increments, [N, K + 1] bool kept columns.
    """
    shape = (active.numel(), block.shape[1])
    full_block = torch.full(shape, eos, dtype=torch.long)
    full_block[active] = block
    full_increments = torch.zeros(shape, dtype=torch.float64)
    full_increments[active] = increments
    return full_block, full_increments, block_mask(full_block, ~active, eos, budget)


def kept_weight(keep: torch.Tensor, increments: torch.Tensor) -> torch.Tensor:
    """What a cycle adds to each particle's log weight: the sum of its increments over the
    columns it keeps, sum_k keep[n, k] · inc[n, k] ([N, K + 1] each; a column not kept adds
    nothing, even where its increment is -inf).

    Returns:
        [N] float64.
    """
    return torch.where(keep, increments, 0.0).sum(1)


def block_mask(block: torch.Tensor, finished: torch.Tensor, eos: int, budget: int) -> torch.Tensor:
    """Which of a block's columns count: the particle was alive before the cycle, no EOS earlier
    in the block, and the column lies within the remaining token budget.

    Args:
        block: [N, K + 1] int64 drafted tokens then the bonus token.
        finished: [N] bool, particles that ended before this cycle.
        budget: tokens each particle may still generate: an int for all, or [N] int64 each
            its own.

    Returns:
        [N, K + 1] bool.
    """
    is_eos = (block == eos).long()
    # an EOS strictly before this column
    eos_before = (torch.cumsum(is_eos, 1) - is_eos) > 0
    columns = torch.arange(block.shape[1])
    return (~finished)[:, None] & ~eos_before & (columns[None, :] < torch.as_tensor(budget).reshape(-1, 1))


def complete_at_budget(plan, tokens: torch.Tensor, finished: torch.Tensor, logw: torch.Tensor, log_phi: torch.Tensor, eos: int) -> torch.Tensor:
    """The final weights under the token budget: phi is 0 on a string that is not complete.

    A particle without EOS is complete iff every constraint allows EOS after its string; its
    block-end potentials then give their complete score in place of the prefix score. Without
    constraints every string is complete and the weights are returned unchanged.

    Args:
        tokens: [N, S] int64 generated tokens (EOS filler after a string that ended otherwise,
            at a stop string); finished: [N] bool, particles that produced EOS.
        logw, log_phi: [N] float64 log weights and the block-end potentials' scores inside them.

    Returns:
        [N] float64 log weights, -inf on particles whose string is not complete.
    """
    if plan.masker is None:
        return logw
    cut = (~finished & torch.isfinite(logw)).nonzero().flatten()
    complete = finished.clone()
    complete[cut] = plan.masker.complete([row[: row.index(eos)] if eos in row else row for row in tokens[cut].tolist()])
    if plan.potential is not None:
        logw, _ = rescore(plan.potential, tokens, complete, complete & ~finished, logw, log_phi, eos)
    return logw.masked_fill(~complete, -math.inf)


def conclude(plan, state: Particles, log_z: float, generator):
    """The end of a run: final weights, log Z_hat and the returned particle.

    The last twist comes off (the final weights target pi itself), the token budget's
    completeness applies (`complete_at_budget`), log Z_hat gains logsumexp(log w) - log N of the
    final weights, and the returned particle is drawn ∝ final weights. When no particle holds a
    complete string every final weight is zero (all -inf, so the result's ESS is 0), log Z_hat
    = -inf, `complete` is False, and an incomplete particle is drawn ∝ the weights before the
    completeness check.

    Args:
        log_z: log Z_hat accumulated by the resamplings.

    Returns:
        (final log weights [N] float64, log Z_hat, chosen index, complete), or None when every
        weight is zero.
    """
    eos = plan.target.vocabulary.eos_token_id
    logw = state.logw - state.log_twist
    if not torch.isfinite(logw).any():
        return None
    final_logw = complete_at_budget(plan, state.tokens, state.finished, logw, state.log_phi, eos)
    if not torch.isfinite(final_logw).any():
        chosen = int(torch.multinomial(normalised_weights(logw), 1, generator=generator))
        return final_logw, -math.inf, chosen, False
    chosen = int(torch.multinomial(normalised_weights(final_logw), 1, generator=generator))
    return final_logw, log_z + log_mean_weight(final_logw), chosen, True
