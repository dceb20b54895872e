"""Token-level distributions: tempered log-probabilities and categorical draws.

The draft's q and the target's p are computed by `tempered_logprobs` and nowhere else, so the q
in every weight and acceptance test is exactly the distribution its token was drawn from.
"""

from __future__ import annotations

import torch


def tempered_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) along the last axis; at T = 0 its limit, greedy decoding.

    As T -> 0, softmax(logits / T) tends to the point mass on the argmax (ties split evenly); at
    T = 0 this returns the point mass on the first maximal entry: log p = 0 there, -inf elsewhere.

    Args:
        logits: [..., V] float32 raw logits.
        temperature: T >= 0.

    Returns:
        [..., V] float32 log-probabilities.
    """
    logits = logits.float()
    if temperature == 0:
        greedy = torch.full_like(logits, float("-inf"))
        return greedy.scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
    return torch.log_softmax(logits / temperature, dim=-1)


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
