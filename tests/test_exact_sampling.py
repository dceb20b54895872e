"""Exactness laws on toy LMs whose completion distributions are enumerated.

Every TV check compares the empirical distribution of n runs with the exact target, within
`tv_tolerance` (a McDiarmid bound failing with probability 1e-6 when the sampler is exact).
"""

import math

import pytest

from smc_sd.backends.toy import ToyLM
from smc_sd.metrics import empirical, total_variation, tv_tolerance
from smc_sd.program import Schedule
from smc_sd.programs import autoregressive, smc_speculative, speculative
from tests.toy_programs import PROMPT, sample_completions, target_and_draft

MAX_TOKENS = 3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_autoregressive_matches_target(temperature):
    target, _ = target_and_draft()
    exact, _ = target.completion_distribution(PROMPT, MAX_TOKENS, temperature)
    n = 6000
    samples = sample_completions(autoregressive.program(target, temperature=temperature), Schedule(1, max_tokens=MAX_TOKENS), n)
    assert total_variation(empirical(samples), exact) < tv_tolerance(exact, n)


@pytest.mark.parametrize("temperature,draft_temperature", [(1.0, 1.0), (0.7, 1.3)])
def test_exact_speculative_decoding_matches_target(temperature, draft_temperature):
    target, draft = target_and_draft(noise=2.0)
    exact, _ = target.completion_distribution(PROMPT, MAX_TOKENS, temperature)
    # the draft alone is far from the target, so matching p_T is not an accident
    draft_dist, _ = draft.completion_distribution(PROMPT, MAX_TOKENS, draft_temperature)
    assert total_variation(draft_dist, exact) > 0.15
    n = 6000
    program = speculative.program(target, draft, temperature=temperature, draft_temperature=draft_temperature, draft_len=2)
    samples = sample_completions(program, Schedule(1, max_tokens=MAX_TOKENS), n)
    assert total_variation(empirical(samples), exact) < tv_tolerance(exact, n)


def test_smc_sd_with_draft_equal_to_target_has_uniform_weights_and_matches_target():
    target, _ = target_and_draft()
    program = smc_speculative.program(target, target, draft_len=2)
    schedule = Schedule(particles=4, ess_threshold=0.99, max_tokens=MAX_TOKENS)
    n = 4000
    samples = []
    for seed in range(n):
        result = program.run(PROMPT, schedule, seed=seed)
        assert result.resamples == 0
        assert all(c.ess == pytest.approx(4.0, abs=1e-9) for c in result.cycles)
        assert result.log_weights.max() - result.log_weights.min() < 1e-6
        samples.append(tuple(result.tokens))
    exact, _ = target.completion_distribution(PROMPT, MAX_TOKENS)
    assert total_variation(empirical(samples), exact) < tv_tolerance(exact, n)


def test_smc_sd_approaches_target_as_particles_grow():
    target, draft = target_and_draft(noise=1.0)
    max_tokens = 4
    exact, _ = target.completion_distribution(PROMPT, max_tokens)
    program = smc_speculative.program(target, draft, draft_len=3)
    n = 3000
    tv = {
        particles: total_variation(empirical(sample_completions(program, Schedule(particles, max_tokens=max_tokens), n)), exact)
        for particles in (1, 64)
    }
    tolerance = tv_tolerance(exact, n)
    assert tv[64] < tolerance
    assert tv[1] > tv[64] + tolerance


@pytest.mark.parametrize("alpha", [0.5, 2.0])
def test_power_target_reached_with_many_particles(alpha):
    target, draft = target_and_draft(noise=1.0)
    # max_tokens = 3 with K = 2: the budget truncates every second block
    exact, _ = target.completion_distribution(PROMPT, MAX_TOKENS, alpha=alpha)
    plain, _ = target.completion_distribution(PROMPT, MAX_TOKENS)
    assert total_variation(exact, plain) > 0.1
    program = smc_speculative.program(target, draft, alpha=alpha, draft_len=2)
    n = 3000
    tv = {
        particles: total_variation(empirical(sample_completions(program, Schedule(particles, max_tokens=MAX_TOKENS), n)), exact)
        for particles in (1, 64)
    }
    assert tv[64] < tv_tolerance(exact, n)
    assert tv[1] > tv[64]


@pytest.mark.parametrize("ess_threshold,resampling", [(1.0, "systematic"), (0.5, "multinomial"), (1.0, "residual"), (1.0, "stratified")])
def test_z_hat_is_unbiased(ess_threshold, resampling):
    target, draft = target_and_draft(noise=1.0)
    alpha = 2.0
    _, log_z = target.completion_distribution(PROMPT, 5, alpha=alpha)
    program = smc_speculative.program(target, draft, alpha=alpha, draft_len=2)
    schedule = Schedule(particles=4, ess_threshold=ess_threshold, resampling=resampling, max_tokens=5)
    z_hats = [math.exp(program.run(PROMPT, schedule, seed=s).log_ml) for s in range(3000)]
    mean = sum(z_hats) / len(z_hats)
    std_error = math.sqrt(sum((z - mean) ** 2 for z in z_hats) / (len(z_hats) - 1) / len(z_hats))
    # 5 standard errors: a false alarm has probability ~1e-6 under the CLT
    assert abs(mean - math.exp(log_z)) < 5 * std_error
    assert std_error < 0.05 * math.exp(log_z)


def test_smc_sd_advances_k_plus_one_tokens_per_target_pass():
    # EOS has probability zero, so every particle runs to the budget
    letters_only = ToyLM.random(4, seed=5, eos=False)
    draft = ToyLM.perturbed(letters_only, 1.0)
    for k, max_tokens in [(1, 9), (4, 31), (4, 33)]:
        result = smc_speculative.program(letters_only, draft, draft_len=k).run(PROMPT, Schedule(3, max_tokens=max_tokens), seed=0)
        # the prompt's pass draws the first token; each later pass adds K + 1 per particle
        assert result.target_passes == math.ceil((max_tokens - 1) / (k + 1))
        assert [c.tokens for c in result.cycles[:-1]] == [k + 1] * (result.target_passes - 1)
        assert all(len(p) == max_tokens for p in result.particles)
        assert result.draft_passes == k * result.target_passes


def test_same_seed_same_output_and_seeds_differ():
    target, draft = target_and_draft()
    program = smc_speculative.program(target, draft, draft_len=2)
    schedule = Schedule(particles=8, max_tokens=8)
    a, b = program.run(PROMPT, schedule, seed=7), program.run(PROMPT, schedule, seed=7)
    assert a.particles == b.particles and a.log_ml == b.log_ml and a.chosen == b.chosen
    others = {tuple(map(tuple, program.run(PROMPT, schedule, seed=s).particles)) for s in range(10)}
    assert len(others) > 1
