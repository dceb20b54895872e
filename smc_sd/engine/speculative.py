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

import time

import torch

from smc_sd.engine.masking import masked_logprobs
from smc_sd.engine.result import AllParticlesDiedError, CycleStats, Result, kv_memory, mask_stats
from smc_sd.engine.sampling import gather_last, sample_tokens, tempered_logprobs
from smc_sd.engine.drafting import DraftBlock, block_masks, draft_block, first_token_mask, trim_at_eos
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
    residual = torch.clamp(logp.exp() - logq.exp(), min=0.0)
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
    # [1, V]: p~ of the first token
    first_logp = tempered_logprobs(first_logits[None], plan.target_temperature, None if first_mask is None else first_mask[None])
    if not torch.isfinite(first_logp).any():
        return None
    return int(sample_tokens(first_logp, generator))


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
    # [K + 1, V]: log p_T after the last emitted token and after each drafted token
    logp = tempered_logprobs(target_logits, plan.target_temperature)
    no_target_mass = None
    if mask_at is not None:
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


def run_speculative(plan, prompt: list[int], generator: torch.Generator, on_cycle=None) -> Result:
    """Run an accept/reject StepPlan: one sequence, K drafted tokens per cycle.

    With a free draft, a cycle whose free draft proposes verifies that proposal (q a point
    mass, `smc_sd.engine.free_drafts`); any other cycle drafts K tokens from the draft LM, or,
    with no draft LM, verifies nothing and emits one token from the target (an autoregressive
    step). Either way the emitted law is the method's.
    """
    start = time.perf_counter()
    k, eos = plan.draft_len, plan.target.vocabulary.eos_token_id
    first_mask = first_token_mask(plan.masker)
    target_rows, first_logits = plan.target.open(prompt, 1)
    draft_rows = plan.draft.open(prompt, 1)[0] if plan.draft is not None else None
    drafter = FreeDrafter.for_plan(plan, prompt) if plan.free is not None else None
    try:
        tokens: list[int] = []
        cycles: list[CycleStats] = []
        draft_passes = 0

        def result() -> Result:
            return Result(
                method=plan.name,
                prompt=prompt,
                particles=[tokens],
                finished=[eos in tokens],
                log_weights=torch.zeros(1, dtype=torch.float64),
                log_ml=0.0,
                chosen=0,
                cycles=cycles,
                target_passes=len(cycles),
                draft_passes=draft_passes,
                seconds=time.perf_counter() - start,
                decode=plan.target.decode,
                kv=kv_memory(target_rows, draft_rows),
                **mask_stats(plan.masker),
                # under constraints a string cut by the budget may be incomplete
                complete=plan.masker is None or eos in tokens or bool(plan.masker.complete([tokens])[0]),
                free_draft=None if drafter is None else drafter.report(),
            )

        first = first_token(plan, first_logits, first_mask, generator)
        if first is None:
            raise AllParticlesDiedError("no first token has nonzero probability under the target (and its constraints, if any)", result())
        tokens.append(first)
        # tokens of the prefix the draft LM has not read yet
        draft_unseen = [tokens[0]]
        while len(tokens) < plan.max_tokens and tokens[-1] != eos:
            target_length_before = target_rows.length
            free = free_block(plan, drafter, tokens) if drafter is not None else None
            from_lm = free is None and draft_rows is not None
            if free is not None:
                draft, mask_at, forced = free
            else:
                mask_at = None if plan.masker is None else block_masks(plan.masker, [tokens], torch.ones(1, dtype=torch.bool), eos)
                if from_lm:
                    draft_length_before = draft_rows.length
                    draft = draft_block(draft_rows, torch.tensor([draft_unseen]), k, plan.draft_temperature, generator, mask_at)
                    draft_passes += k
                else:
                    draft = empty_block(plan.target.vocabulary.size, constrained=mask_at is not None)
            # [m + 1, V]: target logits after the last emitted token and after each drafted token
            target_logits = target_rows.extend(torch.tensor([[tokens[-1]] + draft.tokens[0].tolist()]))[0]
            accepted, emitted, dead = verify_drafts(plan, draft, target_logits, mask_at, generator, plan.max_tokens - len(tokens))
            if dead:
                raise AllParticlesDiedError("the constraints left the sequence no token of nonzero probability", result())
            drafted = draft.tokens[0]
            # the target keeps the last emitted token and the accepted drafts
            target_rows.truncate(target_length_before + 1 + accepted)
            if from_lm:
                # the draft read draft_unseen and drafted[:K-1]; keep what is still on the path
                kept_by_draft = min(accepted, k - 1)
                draft_rows.truncate(draft_length_before + len(draft_unseen) + kept_by_draft)
                draft_unseen = drafted[kept_by_draft:accepted].tolist() + [emitted]
            else:
                draft_unseen += drafted[:accepted].tolist() + [emitted]
            if free is not None:
                drafter.record(drafted.numel(), forced, accepted)
            new = trim_at_eos(drafted[:accepted].tolist() + [emitted], eos)
            new = new[: plan.max_tokens - len(tokens)]
            tokens += new
            cycles.append(CycleStats(1.0, False, 0.0, len(new), 1, accepted=accepted, proposed=drafted.numel()))
            if on_cycle is not None:
                on_cycle(cycles[-1], [tokens])
        return result()
    finally:
        target_rows.close()
        if draft_rows is not None:
            draft_rows.close()
