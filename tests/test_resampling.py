"""Laws of the resampling schemes and the ESS."""

import math

import pytest
import torch

from smc_sd.engine.keyed_random import RESAMPLE, counter, keyed_uniform
from smc_sd.engine.resampling import RESAMPLERS, effective_sample_size, log_mean_weight, resample, resample_rows


@pytest.mark.parametrize("scheme", sorted(RESAMPLERS))
def test_ancestor_counts_are_unbiased(scheme):
    generator = torch.Generator().manual_seed(0)
    w = torch.tensor([0.5, 0.0, 0.2, 0.05, 0.25], dtype=torch.float64)
    n, runs = w.numel(), 20000
    counts = torch.zeros(n, dtype=torch.float64)
    for _ in range(runs):
        a = resample(w.log(), generator, scheme)
        assert a.numel() == n and a.min() >= 0 and a.max() < n
        counts.index_add_(0, a, torch.ones(n, dtype=torch.float64))
    expected = n * w
    # each count's variance per run is at most n w (1 - w) (multinomial, the worst scheme)
    std_error = torch.sqrt(n * w * (1 - w) / runs)
    assert torch.all((counts / runs - expected).abs() <= 5 * std_error + 1e-12)
    assert counts[1] == 0, "a zero-weight particle was chosen"


def test_systematic_keeps_floor_to_ceil_copies_and_residual_keeps_floor():
    generator = torch.Generator().manual_seed(1)
    w = torch.tensor([0.45, 0.3, 0.25], dtype=torch.float64)
    for _ in range(200):
        systematic = torch.bincount(resample(w.log(), generator, "systematic"), minlength=3)
        assert torch.all(systematic >= torch.floor(3 * w)) and torch.all(systematic <= torch.ceil(3 * w))
        residual = torch.bincount(resample(w.log(), generator, "residual"), minlength=3)
        assert torch.all(residual >= torch.floor(3 * w))


def test_systematic_never_returns_index_n_under_round_off():
    generator = torch.Generator().manual_seed(2)
    # weights whose float64 cumulative sum falls short of 1
    logw = torch.full((1000,), -1e-3, dtype=torch.float64) + torch.linspace(0, 1e-12, 1000, dtype=torch.float64)
    for _ in range(100):
        assert resample(logw, generator, "systematic").max() < 1000


def test_dead_particles_are_never_resampled_and_all_dead_is_an_error():
    generator = torch.Generator().manual_seed(3)
    logw = torch.tensor([-math.inf, 0.0, -math.inf, -2.0], dtype=torch.float64)
    for scheme in RESAMPLERS:
        a = resample(logw, generator, scheme)
        assert set(a.tolist()) <= {1, 3}
    dead = torch.full((4,), -math.inf, dtype=torch.float64)
    assert effective_sample_size(dead) == 0.0
    assert log_mean_weight(dead) == -math.inf
    with pytest.raises(ValueError, match="weight zero"):
        resample(dead, generator)


def test_ess_bounds():
    assert effective_sample_size(torch.zeros(8)) == pytest.approx(8.0)
    assert effective_sample_size(torch.tensor([0.0, -math.inf, -math.inf])) == pytest.approx(1.0)
    assert 1.0 < effective_sample_size(torch.tensor([0.0, -1.0, -2.0])) < 3.0


def test_unknown_scheme_lists_the_valid_ones():
    with pytest.raises(ValueError, match="systematic"):
        resample(torch.zeros(3), torch.Generator(), "bogus")


@pytest.mark.parametrize("scheme", sorted(RESAMPLERS))
def test_round_off_never_picks_a_zero_weight_particle(scheme, monkeypatch):
    # ten equal weights sum to 1 - 2^-53 in float64; the uniforms are pushed to the top of [0, 1),
    # where round-off leaves points at or above the computed total
    logw = torch.tensor([0.0] * 10 + [-math.inf], dtype=torch.float64)
    top = 1 - 2**-53
    monkeypatch.setattr(torch, "rand", lambda n, **kw: torch.full((n,), top, dtype=torch.float64))
    ancestors = resample(logw, torch.Generator(), scheme)
    assert ancestors.max() < 10, f"{scheme} chose the zero-weight particle"
    # a zero weight in the middle is skipped too
    logw = torch.tensor([0.0, -math.inf, 0.0, -math.inf], dtype=torch.float64)
    assert set(resample(logw, torch.Generator(), scheme).tolist()) <= {0, 2}


def decide(logw: torch.Tensor, threshold: float):
    """`resample_rows` of one population with fixed uniforms: (ess, ancestors or None, step)."""
    ess, resampled, ancestors, step = resample_rows(logw[None], [threshold], ["systematic"], torch.full((1, logw.numel()), 0.5, dtype=torch.float64))
    return float(ess[0]), ancestors[0] if bool(resampled[0]) else None, float(step[0]) if bool(resampled[0]) else 0.0


def test_resampling_happens_below_the_threshold_and_never_to_a_dead_population():
    # ESS of [0, 0, -inf, -inf] is 2 of 4: below tau = 0.75, not below tau = 0.5
    logw = torch.tensor([0.0, 0.0, -math.inf, -math.inf], dtype=torch.float64)
    ess, ancestors, step = decide(logw, 0.75)
    assert ess == pytest.approx(2.0) and set(ancestors.tolist()) <= {0, 1} and step == pytest.approx(log_mean_weight(logw))
    assert decide(logw, 0.5) == (pytest.approx(2.0), None, 0.0)
    # every weight zero: nothing to draw from; the caller ends the run instead
    assert decide(torch.full((4,), -math.inf, dtype=torch.float64), 0.5) == (0.0, None, 0.0)


def test_an_ess_that_ties_the_threshold_is_decided_alike_under_round_off():
    """Two particles killed, two of equal weight: ESS = N/2 = tau N exactly. Log weights that
    differ in their last digits (the logits behind them summed in another order) move the ESS
    by ~1e-14 to either side of 2; the decision must not move with it."""
    wobbles = (0.0, 1e-7, -1e-7, 1e-9)
    populations = [torch.tensor([0.0, d, -math.inf, -math.inf], dtype=torch.float64) for d in wobbles]
    assert min(effective_sample_size(logw) for logw in populations) < 2.0
    assert all(decide(logw, 0.5)[1] is None for logw in populations)
    # a real shortfall of the threshold still resamples
    below = torch.tensor([0.0, -0.1, -math.inf, -math.inf], dtype=torch.float64)
    assert decide(below, 0.5)[1] is not None


def test_resample_rows_decides_and_draws_each_row_as_it_would_alone():
    # rows of other sizes of weight, thresholds and schemes beside a row change nothing of it
    generator = torch.Generator().manual_seed(5)
    logw = torch.randn(6, 5, generator=generator, dtype=torch.float64) * 2
    logw[1, 2:] = -math.inf
    logw[3] = -math.inf
    u = torch.rand(6, 5, generator=generator, dtype=torch.float64)
    thresholds = [0.5, 1.0, 0.9, 0.5, 1.0, 0.0]
    schemes = ["systematic", "residual", "multinomial", "stratified", "residual", "systematic"]
    ess, resampled, ancestors, steps = resample_rows(logw, thresholds, schemes, u)
    assert float(ess[3]) == 0.0 and not bool(resampled[3]) and not bool(resampled[5])
    for g in range(6):
        alone = resample_rows(logw[g : g + 1], thresholds[g : g + 1], schemes[g : g + 1], u[g : g + 1])
        assert all(torch.equal(a[0], b[g]) for a, b in zip(alone, (ess, resampled, ancestors, steps)))
        if g != 3:
            assert float(ess[g]) == pytest.approx(effective_sample_size(logw[g]))
            assert float(steps[g]) == pytest.approx(log_mean_weight(logw[g]))
        if bool(resampled[g]):
            assert bool(torch.isfinite(logw[g][ancestors[g]]).all())


@pytest.mark.parametrize("scheme", sorted(RESAMPLERS))
def test_resample_rows_ancestor_counts_are_unbiased_with_keyed_uniforms(scheme):
    # 20,000 populations in one call, each with its own keyed uniforms
    runs, w = 20000, torch.tensor([0.5, 0.0, 0.2, 0.05, 0.25], dtype=torch.float64)
    n = w.numel()
    u = keyed_uniform(9, counter(torch.arange(runs)[:, None], torch.arange(n)[None, :], 0, RESAMPLE))
    _, resampled, ancestors, _ = resample_rows(w.log().expand(runs, n), [1.0] * runs, [scheme] * runs, u)
    assert bool(resampled.all())
    counts = torch.zeros(n, dtype=torch.float64).index_add_(0, ancestors.flatten(), torch.ones(runs * n, dtype=torch.float64))
    std_error = torch.sqrt(n * w * (1 - w) / runs)
    assert torch.all((counts / runs - n * w).abs() <= 5 * std_error + 1e-12)
    assert counts[1] == 0, "a zero-weight particle was chosen"
