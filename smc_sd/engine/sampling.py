"""Token-level distributions: tempered log-probabilities and categorical draws.

The draft's q and the target's p are computed by `tempered_logprobs` and nowhere else, so the q
in every weight and acceptance test is exactly the distribution its token was drawn from.
"""

from __future__ import annotations

import torch


def tempered_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) along the last axis.

    Args:
        logits: [..., V] float32 raw logits.
        temperature: T > 0.

    Returns:
        [..., V] float32 log-probabilities.
    """
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def sample_tokens(scores: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row from the distribution ∝ exp(scores).

    Args:
        scores: [B, V] float unnormalised log-probabilities; each row has a finite entry.
        generator: the run's random generator (on the scores' device).

    Returns:
        [B] int64 token ids.
    """
    probs = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def gather_last(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values[..., index]: the entry of each row's chosen token.

    Args:
        values: [..., V] float.
        index: [...] int64 token ids.

    Returns:
        [...] float.
    """
    return values.gather(-1, index.unsqueeze(-1)).squeeze(-1)
