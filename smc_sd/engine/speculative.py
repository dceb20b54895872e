"""Exact speculative decoding (Leviathan et al. 2022; Chen et al. 2023), the baseline.

One cycle: the draft samples x_1..x_K ~ q; one target pass gives p at every position. Draft
token x_k is accepted with probability min(1, p(x_k) / q(x_k)); at the first rejection the cycle
emits a token from norm(max(0, p - q)) and stops; if all K are accepted it emits a bonus token from
p. The emitted sequence is distributed exactly as p_T. Rejected tokens are rolled back from both
caches with `truncate`.

With constraints (mask-at-verify, what serving engines do): q and p are both masked and
renormalised at every position, q~ = q m / Z_q and p~ = p m / Z_p, and the rule runs on (p~, q~).
The output is then distributed as the locally projected prod_t p~(x_t | x_<t), not as the
conditional p_T(x | x satisfies the constraints).
"""

from __future__ import annotations

import math

import torch

from smc_sd.engine.masking import masked_logprobs
from smc_sd.engine.sampling import exp_floored, gather_last, sample_tokens, tempered_logprobs
from smc_sd.engine.drafting import DraftBlock
from smc_sd.engine.smc import first_draws
from smc_sd.engine.free_drafts import FreeDrafter, allowed_prefix, point_mass_rows


def accept_or_resample(
    drafted: torch.Tensor, logq: torch.Tensor, logp: torch.Tensor, generator: torch.Generator
) -> tuple[int, int]:
    """The accept/reject rule for one sequence.

    Args:
        drafted: [K] int64 drafted tokens.
        logq: [K, V] float32 log q at each drafted position (the distributions sampled from).
        logp: [K + 1, V] float32 log p_T at each drafted position and after the last one.

    Returns:
        (accepted, token): the number of draft tokens kept, and the token emitted after them
        (residual draw on rejection, bonus draw from p on full acceptance).
    """
    k = drafted.numel()
    log_ratio = gather_last(logp[:k], drafted) - gather_last(logq, drafted)
    log_u = torch.log(torch.rand(k, generator=generator, dtype=torch.float64))
    rejected = (log_u >= log_ratio.double()).nonzero()
    if rejected.numel() == 0:
        return k, int(sample_tokens(logp[k][None], generator))
    j = int(rejected[0])
    return j, residual_token(logp[j], logq[j], generator)


def residual_token(logp: torch.Tensor, logq: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from the residual norm(max(0, p - q)) of a rejection.

    A rejection needs p(x) < q(x), so in exact arithmetic the residual has positive mass. In
    float32, p and q that agree to rounding can leave max(0, p - q) with none; then p = q up to
    rounding, and the law of the emitted token, q·min(1, p/q) + (rejection mass)·residual, is p's:
    the token is drawn from p.

    Args:
        logp, logq: [V] float32 log p and log q at the rejected position.

    Returns:
        The token id.
    """
    residual = torch.clamp(exp_floored(logp) - exp_floored(logq), min=0.0)
    if not residual.sum() > 0:
        return int(sample_tokens(logp[None], generator))
    return int(sample_tokens(residual.log()[None], generator))


def first_token(plan, first_logits: torch.Tensor, first_mask: torch.Tensor | None, generator: torch.Generator) -> int | None:
    """The sequence's first token, drawn from p~ = p_T m / Z_p after the prompt.

    Args:
        first_logits: [V] float32 target logits after the prompt.
        first_mask: [V] bool constraint mask of the first token, or None.

    Returns:
        The token id, or None when p~ has no mass.
    """
    first, log_z0 = first_draws(plan, first_logits, first_mask, generator, 1)
    return int(first[0]) if math.isfinite(log_z0) else None


def verify_drafts(plan, draft: DraftBlock, target_logits: torch.Tensor, mask_at, generator: torch.Generator, budget: int) -> tuple[int, int, bool]:
    """One sequence's accept/reject step on its drafted block.

    With constraints p and q are both masked and renormalised (p~, q~); where q~ does not exist
    the rule (with q~ = 0) rejects and emits from p~: the block ends there, exactly as if all
    drafts up to it were followed by a bonus.

    Args:
        draft: the cycle's DraftBlock of one sequence ([1, K] tokens).
        target_logits: [K + 1, V] float32 target logits after the last emitted token and after
            each drafted token.
        mask_at: the cycle's masks, or None.
        budget: tokens the sequence may still generate.

    Returns:
        (accepted, emitted, dead): `accept_or_resample`'s pair, and whether the position of the
        emitted token lies within the budget and p~ has no mass there (no valid continuation).
    """
    drafted, logq = draft.tokens[0], draft.logq[0]
    no_target_mass = None
    if mask_at is None:
        # [K + 1, V]: log p_T after the last emitted token and after each drafted token
        logp = tempered_logprobs(target_logits, plan.target_temperature)
    else:
        bonus_mask, _ = mask_at(draft.tokens)
        # [K + 1, V]: p~ = p m / Z_p at every position; [K + 1] bool, positions with Z_p = 0
        logp, no_target_mass = masked_logprobs(target_logits, plan.target_temperature, torch.cat([draft.masks[0], bonus_mask], 0))
        no_draft_mass = draft.dead[0].nonzero().flatten()
        if no_draft_mass.numel() > 0:
            drafted, logq = drafted[: int(no_draft_mass[0])], logq[: int(no_draft_mass[0])]
    accepted, emitted = accept_or_resample(drafted, logq, logp[: drafted.numel() + 1], generator)
    dead = no_target_mass is not None and accepted < budget and bool(no_target_mass[accepted])
    return accepted, emitted, dead


def empty_block(vocab_size: int, constrained: bool) -> DraftBlock:
    """A block of no drafted tokens (the target emits one token), with empty masks when constrained."""
    tokens, logq = torch.empty(1, 0, dtype=torch.long), torch.empty(1, 0, vocab_size)
    if not constrained:
        return DraftBlock(tokens, logq)
    return DraftBlock(tokens, logq, torch.empty(1, 0, vocab_size, dtype=torch.bool), torch.empty(1, 0, dtype=torch.bool))


def free_block(plan, drafter: FreeDrafter, tokens: list[int]):
    """The cycle's block from the free draft: its proposal, cut at the first token the
    constraints refuse, with the masks of every position from one mask call.

    Returns:
        (draft, mask_at, forced), draft a DraftBlock of point masses ([1, m] tokens); or None
        when the free draft proposes nothing.
    """
    proposal, forced = drafter.propose(tokens, plan.max_tokens - len(tokens))
    if not proposal:
        return None
    vocab = plan.target.vocabulary.size
    if plan.masker is None:
        return DraftBlock(torch.tensor([proposal]), point_mass_rows(proposal, vocab)[None]), None, forced
    # [m + 1, V]: the masks after each proposed prefix, one call for the whole block
    masks, _ = plan.masker([tokens + proposal[:j] for j in range(len(proposal) + 1)], torch.ones(len(proposal) + 1, dtype=torch.bool))
    m = allowed_prefix(proposal, masks)
    if m == 0:
        return None
    proposal = proposal[:m]

    def mask_at(drafted: torch.Tensor):
        # the precomputed mask after the first j proposed tokens
        return masks[drafted.shape[1]][None], torch.zeros(1, dtype=torch.bool)

    draft = DraftBlock(torch.tensor([proposal]), point_mass_rows(proposal, vocab)[None], masks[None, :m], torch.zeros(1, m, dtype=torch.bool))
    return draft, mask_at, min(forced, m)
