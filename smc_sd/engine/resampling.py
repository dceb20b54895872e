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
    """ESS = 1 / sum_i w̄_i², in [1, N]; 0.0 when every weight is zero (`ess_rows` of one
    population)."""
    return float(ess_rows(logw.double()[None])[0][0])


def ess_rows(logw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row g: ESS_g = 1 / sum_i w̄_{g,i}², w̄_g = exp(logw_g - logsumexp(logw_g)).

    Args:
        logw: [G, N] float64 log weights.

    Returns:
        ess [G] float64 (0.0 for a row whose every weight is zero), log_total [G] float64
        (logsumexp of each row, -inf for such a row), w̄ [G, N] float64 (all 0 in such a row).
    """
    log_total = torch.logsumexp(logw, -1)
    alive = torch.isfinite(log_total)
    w = torch.exp(logw - torch.where(alive, log_total, 0.0)[:, None])
    return torch.where(alive, 1.0 / (w * w).sum(-1), 0.0), log_total, w


def inverse_cdf_rows(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row g, the index j with cdf_{g, j-1} <= u_{g, m} < cdf_{g, j} for each sorted u_{g, m}.

    The cumulative weight is forced to exactly 1 from the row's last particle of positive
    weight on, and indices are clamped to that particle: a u that round-off leaves at or above
    the computed total (points (i + u) / n can round to 1.0) still lands on a particle of
    positive weight, never on index N nor on the zero-weight particles after it; `right=True`
    search skips the zero-weight particles before it (their cdf step is empty). Each row is
    searched on its own, so a row's indices do not depend on the other rows.

    Args:
        w: [G, N] float64 normalised weights; a row with no positive weight gives indices 0.
        u: [G, M] float64 points in [0, 1], sorted along each row.

    Returns:
        [G, M] int64 indices into each row.
    """
    columns = torch.arange(w.shape[1], device=w.device)
    # [G, 1]: each row's last particle of positive weight
    last = torch.where(w > 0, columns, 0).amax(-1, keepdim=True)
    cdf = torch.cumsum(w, -1).masked_fill(columns >= last, 1.0)
    return torch.minimum(torch.searchsorted(cdf, u, right=True), last)


def _inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`inverse_cdf_rows` of one population: w [N], sorted u [M] in [0, 1]."""
    return inverse_cdf_rows(w[None], u[None])[0]


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
    """floor(n w̄_j) deterministic copies of j, the remaining r draws multinomial on the residue
    (`residual_rows` of one population)."""
    u = torch.rand(n, generator=generator, dtype=torch.float64, device=w.device)
    return residual_rows(w[None], u[None])[0]


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


#: relative margin under which an ESS counts as reaching the threshold (`resample_rows`)
ESS_TIE = 1e-9


def resample_rows(logw: torch.Tensor, thresholds: torch.Tensor | list[float], schemes: list[str], u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One cycle's resampling of G populations of N particles each, row g by its own threshold
    and scheme: resample when 0 < ESS_g < tau_g · N · (1 - ESS_TIE).

    Weights often tie the threshold exactly: with N = 4 and tau = 0.5, two particles a constraint
    killed and two of equal weight give ESS = 2 = tau N. Computed in floating point such an ESS
    lands a few units in the last place above or below 2, by the order in which the logits behind
    the weights were summed, which depends on what else shared the pass; so an ESS within
    ESS_TIE of the threshold (relative) counts as reaching it, and the decision is the same
    whatever ran beside the request. Any rule that decides from the weights alone keeps SMC's
    law; this one moves the threshold by a billionth. A population whose every weight is zero
    (ESS 0) is not resampled: there is nothing to draw from, and the caller ends the run.

    Each row is computed on its own (reductions along rows), so a population's result does not
    depend on the other rows. Nothing is read back to the host and no branch reads a tensor, so
    the function can be compiled (`torch.compile`, tests/test_compiled_step.py); the schemes are
    Python names, fixed per compiled graph, and the thresholds a tensor, so that new values do
    not recompile.

    Args:
        logw: [G, N] float64 log weights relative to the last resampling.
        thresholds: [G] float64 tau_g in [0, 1] (or G floats).
        schemes: G names of RESAMPLERS.
        u: [G, N] float64 uniforms on [0, 1): systematic reads u[g, 0], the others all N
            (residual the first r_g, its residual draws).

    Returns:
        ess [G] float64 (0 for a dead population), resampled [G] bool, ancestors [G, N] int64
        (sorted along each row; meaningful where resampled), log_z_step [G] float64
        (logsumexp(log w_g) - log N, the log Z_hat increment of a resampling).
    """
    for scheme in set(schemes):
        check_resampler(scheme)
    g, n = logw.shape
    # [G], [G], [G, N]: each population's ESS, log total weight and normalised weights
    ess, log_total, w = ess_rows(logw)
    tau = torch.as_tensor(thresholds, dtype=torch.float64, device=logw.device)
    resampled = (ess > 0) & (ess < tau * n * (1 - ESS_TIE))
    columns = torch.arange(n, dtype=torch.float64, device=logw.device)
    # [G, N]: each row's sorted points in [0, 1)
    points = {
        "systematic": lambda: (columns + u[:, :1]) / n,
        "stratified": lambda: (columns + u) / n,
        "multinomial": lambda: u.sort(-1).values,
    }
    ancestors = torch.zeros(g, n, dtype=torch.int64, device=logw.device)
    for scheme in sorted(set(schemes)):
        rows = torch.tensor([s == scheme for s in schemes], device=logw.device)[:, None]
        drawn = residual_rows(w, u) if scheme == "residual" else inverse_cdf_rows(w, points[scheme]())
        ancestors = torch.where(rows, drawn, ancestors)
    return ess, resampled, ancestors, log_total - math.log(n)


def residual_rows(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Residual resampling of each row: floor(N w̄_j) copies of j, then r = N - sum of them
    draws from the residue N w̄ - floor(N w̄), normalised, by the sorted first r uniforms.

    Args:
        w: [G, N] float64 normalised weights; u: [G, N] float64 uniforms.

    Returns:
        [G, N] int64 ancestors, sorted along each row.
    """
    n = w.shape[1]
    copies = torch.floor(n * w)
    # [G, N]: the deterministic copies fill the first `fixed` positions of each row, in order
    ends = torch.cumsum(copies, -1)
    fixed = ends[:, -1:]
    positions = torch.arange(n, dtype=torch.float64, device=w.device)[None, :]
    copied = torch.searchsorted(ends, positions.expand_as(ends).contiguous(), right=True).clamp_(max=n - 1)
    residue = n * w - copies
    total = residue.sum(-1, keepdim=True)
    residue = torch.where(total > 0, residue / torch.where(total > 0, total, 1.0), w)
    # the first r = N - fixed uniforms, sorted (the rest pushed past 1 and never read)
    rest = torch.where(positions < n - fixed, u, 2.0).sort(-1).values
    drawn = inverse_cdf_rows(residue, rest.clamp(max=1.0))
    # position i >= fixed takes the (i - fixed)-th residual draw
    taken = drawn.gather(1, (positions - fixed).clamp(min=0).long())
    return torch.where(positions < fixed, copied, taken).sort(-1).values
