"""Exact speculative decoding (Leviathan et al. 2022; Chen et al. 2023): a sequence's first
token and its free draft's blocks; the accept/reject rule runs for every request at once in
`smc_sd.engine.speculative_step`.

One cycle: the draft samples x_1..x_K ~ q; one target pass gives p at every position. Draft
token x_k is accepted with probability min(1, p(x_k) / q(x_k)); at the first rejection the cycle
emits a token from norm(max(0, p - q)) and stops; if all K are accepted it emits a bonus token from
p. The emitted sequence is distributed exactly as p_T. Rejected tokens are rolled back from both
caches when the rows are reseated.

With constraints (mask-at-verify, what serving engines do): q and p are both masked and
renormalised at every position, q~ = q m / Z_q and p~ = p m / Z_p, and the rule runs on (p~, q~).
The output is then distributed as the locally projected prod_t p~(x_t | x_<t), not as the
conditional p_T(x | x satisfies the constraints).
"""

from __future__ import annotations

import math

import torch

from smc_sd.engine.free_drafts import FreeDrafter, allowed_prefix
from smc_sd.engine.smc import first_draws
from smc_sd.engine.speculative_step import ProposedBlock


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


def free_block(plan, drafter: FreeDrafter, tokens: list[int]) -> tuple[ProposedBlock, int] | None:
    """The cycle's block from the free draft: its proposal, cut at the first token the
    constraints refuse, with the masks of every position from one mask call.

    Returns:
        (block, forced): a ProposedBlock of point masses and the leading tokens of it the
        constraints force; or None when the free draft proposes nothing.
    """
    proposal, forced = drafter.propose(tokens, plan.max_tokens - len(tokens))
    if not proposal:
        return None
    if plan.masker is None:
        return ProposedBlock(proposal), forced
    # [m + 1, V]: the masks after each proposed prefix, one call for the whole block
    masks, _ = plan.masker([tokens + proposal[:j] for j in range(len(proposal) + 1)], [True] * (len(proposal) + 1))
    m = allowed_prefix(proposal, masks)
    if m == 0:
        return None
    return ProposedBlock(proposal[:m], masks=masks[: m + 1]), min(forced, m)
