"""Drafting: K tokens per particle from the (masked) draft, and the masks of one cycle.

Both loops (SMC-SD in `smc_sd.engine.smc`, exact speculative decoding in
`smc_sd.engine.speculative`) draft the same way: the draft reads the tokens it has not seen,
then proposes x_1..x_K ~ q~(. | prefix) one [N, 1] forward at a time, recording log q~ of every
position, so the q in every weight and acceptance test is exactly the distribution sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from smc_sd.backends.base import Sequences
from smc_sd.engine.masking import masked_logprobs
from smc_sd.engine.sampling import sample_tokens, tempered_logprobs
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
