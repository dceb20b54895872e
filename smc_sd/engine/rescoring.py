"""Block-end rescoring: soft potentials and twists, applied to whole prefixes once per cycle.

Both keep, per particle, the log score of its current prefix inside its log weight, and swap it
for the score of the new prefix at every block end:

    log w += log s(new prefix) - log s(old prefix).

A potential phi stays in the final weights (its scores telescope to log phi of the output); a
twist psi is set to 1 when a particle finishes and taken off the rest at the end, so it only
changes which particles resampling keeps. Particles with weight zero are never scored.
"""

from __future__ import annotations

import torch


def rescore(
    potential,
    tokens: torch.Tensor,
    finished: torch.Tensor,
    fresh: torch.Tensor,
    logw: torch.Tensor,
    log_phi: torch.Tensor,
    eos: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Swap each fresh particle's potential score for that of its new prefix.

    Args:
        potential: a `BlockPotential`.
        tokens: [N, S] int64 generated tokens.
        finished: [N] bool, particles that have produced EOS (scored as complete, EOS removed).
        fresh: [N] bool, particles whose prefix changed since they were last scored.
        logw: [N] float64 log weights including log_phi.
        log_phi: [N] float64 the potential's score inside logw.
        eos: the EOS id.

    Returns:
        (logw, log_phi) updated.
    """
    rows = (fresh & torch.isfinite(logw)).nonzero().flatten()
    new_phi = log_phi.clone()
    if rows.numel() > 0:
        prefixes = [row[: row.index(eos)] if eos in row else row for row in tokens[rows].tolist()]
        new_phi[rows] = torch.as_tensor(potential.log_score(prefixes, finished[rows].tolist()), dtype=torch.float64)
    return _swap(logw, log_phi, new_phi)


def retwist(
    twist, tokens: torch.Tensor, finished: torch.Tensor, logw: torch.Tensor, log_twist: torch.Tensor, eos: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Swap each particle's old twist for the twist of its new prefix.

    Finished particles get psi = 1 (their twist is removed).

    Args:
        twist: log psi of a batch of prefixes (lists of token ids) -> [B] float.
        tokens: [N, S] int64 generated tokens (EOS filler after a particle's end).
        finished: [N] bool.
        logw: [N] float64 log weights including log_twist.
        log_twist: [N] float64 the twist inside logw.
        eos: the EOS id.

    Returns:
        (logw, log_twist) updated.
    """
    rows = (torch.isfinite(logw) & ~finished).nonzero().flatten()
    new_twist = torch.zeros_like(log_twist)
    if rows.numel() > 0:
        # each unfinished row without the EOS filler that follows a shorter particle's tokens
        prefixes = [row[: row.index(eos)] if eos in row else row for row in tokens[rows].tolist()]
        new_twist[rows] = torch.as_tensor(twist(prefixes), dtype=torch.float64)
    return _swap(logw, log_twist, new_twist)


def _swap(logw: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log w + new - old where the weight is nonzero; a particle the swap kills carries score 0
    afterwards, so a later -inf - (-inf) never turns into NaN."""
    alive = torch.isfinite(logw)
    logw = torch.where(alive, logw + new - old, logw)
    return logw, torch.where(torch.isfinite(logw), new, torch.zeros_like(new))
