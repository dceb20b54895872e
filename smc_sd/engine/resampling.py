"""Effective sample size and resampling schemes: pure functions of log weights and a generator.

Each scheme maps normalised weights w̄ (sum 1) to N ancestor indices a with E[#{i: a_i = j}] = N w̄_j.
A particle of weight zero is never chosen. All weights -inf means every particle is dead: the
callers check `torch.isfinite(logw).any()` before resampling, and these functions raise instead of
returning NaN-derived indices.
"""

from __future__ import annotations

import math
from typing import Callable

import torch


def normalised_weights(logw: torch.Tensor) -> torch.Tensor:
    """w̄_i = exp(logw_i - logsumexp(logw)).

    Args:
        logw: [N] float log weights, at least one finite.

    Returns:
        [N] float64 weights summing to 1 (exact zeros where logw is -inf).
    """
    logw = logw.double()
    if not torch.isfinite(logw).any():
        raise ValueError("every particle has weight zero; there is nothing to normalise")
    return torch.exp(logw - torch.logsumexp(logw, 0))


def effective_sample_size(logw: torch.Tensor) -> float:
    """ESS = 1 / sum_i w̄_i², in [1, N]; 0.0 when every weight is zero."""
    if not torch.isfinite(logw).any():
        return 0.0
    w = normalised_weights(logw)
    return float(1.0 / (w * w).sum())


def _inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index j with cdf_{j-1} <= u < cdf_j for each sorted u in [0, 1).

    The cumulative weight is forced to exactly 1 from the last particle of positive weight on,
    and indices are clamped to that particle: a u that round-off leaves at or above the computed
    total (points (i + u) / n can round to 1.0) still lands on a particle of positive weight,
    never on index N nor on the zero-weight particles after it; `right=True` search skips the
    zero-weight particles before it (their cdf step is empty).

    Args:
        w: [N] float64 normalised weights, at least one positive.
        u: [M] float64 sorted points in [0, 1].
    """
    last = int((w > 0).nonzero().max())
    cdf = torch.cumsum(w, 0)
    cdf[last:] = 1.0
    return torch.searchsorted(cdf, u, right=True).clamp_(max=last)


def multinomial(w: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """n independent draws a_i ~ Categorical(w̄)."""
    u = torch.rand(n, generator=generator, dtype=torch.float64, device=w.device)
    return _inverse_cdf(w, u.sort().values)


def stratified(w: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """One uniform in each stratum [i/n, (i+1)/n)."""
    u = torch.rand(n, generator=generator, dtype=torch.float64, device=w.device)
    return _inverse_cdf(w, (torch.arange(n, dtype=torch.float64, device=w.device) + u) / n)


def systematic(w: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """One uniform u shared by all strata: points (i + u) / n."""
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=w.device)
    return _inverse_cdf(w, (torch.arange(n, dtype=torch.float64, device=w.device) + u) / n)


def residual(w: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """floor(n w̄_j) deterministic copies of j, the remaining r draws multinomial on the residue."""
    copies = torch.floor(n * w).long()
    ancestors = torch.repeat_interleave(torch.arange(w.numel(), device=w.device), copies)
    r = n - int(copies.sum())
    if r == 0:
        return ancestors
    residue = n * w - copies
    rest = multinomial(residue / residue.sum(), r, generator)
    return torch.cat([ancestors, rest]).sort().values


RESAMPLERS: dict[str, Callable[[torch.Tensor, int, torch.Generator], torch.Tensor]] = {
    "systematic": systematic,
    "multinomial": multinomial,
    "stratified": stratified,
    "residual": residual,
}


def check_resampler(name: str) -> None:
    """Raise a ValueError listing the valid names when `name` is not a resampling scheme."""
    if name not in RESAMPLERS:
        raise ValueError(f"unknown resampling scheme {name!r}; choose one of {sorted(RESAMPLERS)}")


def resample(logw: torch.Tensor, generator: torch.Generator, scheme: str = "systematic") -> torch.Tensor:
    """Ancestor indices for N particles drawn ∝ exp(logw) by `scheme`.

    Args:
        logw: [N] float log weights, at least one finite.
        generator: the run's random generator.
        scheme: a key of RESAMPLERS.

    Returns:
        [N] int64 ancestor indices, sorted ascending.
    """
    check_resampler(scheme)
    return RESAMPLERS[scheme](normalised_weights(logw), logw.numel(), generator)


def log_mean_weight(logw: torch.Tensor) -> float:
    """log (1/N) sum_i exp(logw_i): the factor a resampling step contributes to log Z_hat."""
    return float(torch.logsumexp(logw.double(), 0)) - math.log(logw.numel())


#: relative margin under which an ESS counts as reaching the threshold (`resample_on_ess`)
ESS_TIE = 1e-9


def resample_on_ess(logw: torch.Tensor, threshold: float, generator: torch.Generator, scheme: str = "systematic") -> tuple[float, torch.Tensor | None, float]:
    """One cycle's resampling decision: resample when 0 < ESS < threshold · N · (1 - ESS_TIE).

    Weights often tie the threshold exactly: with N = 4 and tau = 0.5, two particles a constraint
    killed and two of equal weight give ESS = 2 = tau N. Computed in floating point such an ESS
    lands a few units in the last place above or below 2, by the order in which the logits behind
    the weights were summed, which depends on what else shared the pass; so an ESS within
    ESS_TIE of the threshold (relative) counts as reaching it, and the decision is the same
    whatever ran beside the request. Any rule that decides from the weights alone keeps SMC's
    law; this one moves the threshold by a billionth.

    A population whose every weight is zero (ESS 0) is not resampled: there is nothing to draw
    from, and the caller ends the run (`AllParticlesDiedError`).

    Args:
        logw: [N] float64 log weights relative to the last resampling.
        threshold: tau in [0, 1].

    Returns:
        (ess, ancestors, log_z_step): when resampling, the [N] int64 ancestors and the log Z_hat
        increment logsumexp(logw) - log N (after which every log weight restarts at 0); else
        (ess, None, 0.0).
    """
    ess = effective_sample_size(logw)
    if ess == 0.0 or ess >= threshold * logw.numel() * (1 - ESS_TIE):
        return ess, None, 0.0
    return ess, resample(logw, generator, scheme), log_mean_weight(logw)
