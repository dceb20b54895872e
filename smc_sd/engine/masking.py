"""Masked distributions: what the engine builds on the constraints' next-token masks.

The draft samples from, and the weights use, the same masked rows:

    q~(v) = q(v) · m(v) / Z_q,          Z_q = sum_v q(v) m(v)
    bonus ∝ p_T(v)^alpha · m(v),        log Z_bonus = log sum_v p_T(v)^alpha m(v)

A row where Z_q = 0 (the mask allows no token, or only tokens of probability zero) has no masked
distribution; the particle it belongs to gets weight zero.
"""

from __future__ import annotations

import torch

from smc_sd.engine.sampling import tempered_logprobs_rows


def masked_logprobs(logits: torch.Tensor, temperature: torch.Tensor, mask: torch.Tensor | None, greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log q~ = log q + log m - log Z_q row by row, q = softmax(logits / T), and the rows where Z_q = 0.

    The mask is applied before the temperature, so at T = 0 q~ is the point mass on the allowed
    argmax (greedy decoding under a constraint), not the unconstrained argmax masked away.
    Z_q = sum_v q(v) m(v) is zero when the mask allows no token (a dead end) and also when every
    token it allows has probability zero. Such rows have no masked distribution: they are
    returned unmasked, so that a token can still be drawn to keep shapes static, and flagged, so
    that the caller gives them weight zero.

    Args:
        logits: [N, V] float32 raw logits.
        temperature: [N] float32, T_n >= 0 of each row.
        mask: [N, V] bool or None.
        greedy: whether some T_n is 0 (known to the caller without reading the tensor).

    Returns:
        ([N, V] float32 log q~, [N] bool rows with Z_q = 0), or (log q, None) when mask is None.
    """
    if mask is None:
        return tempered_logprobs_rows(logits, temperature, greedy=greedy), None
    masked = tempered_logprobs_rows(logits, temperature, mask, greedy)
    # a row without a finite entry has Z_q = 0 (logits hold no NaN or +inf)
    empty = masked.amax(-1) == float("-inf")
    renormalised = torch.log_softmax(masked, -1)
    if bool(empty.any()):
        # log_softmax of an all -inf row is NaN: such rows stay unmasked
        renormalised[empty] = tempered_logprobs_rows(logits[empty], temperature[empty], greedy=greedy)
    return renormalised, empty
