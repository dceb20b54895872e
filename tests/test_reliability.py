"""A run says when its sample is unreliable: the weights collapsed to about one particle in most
cycles (the draft is far from the target for the particles given), and only then."""

from smc_sd.backends.toy import ToyLM
from smc_sd.engine.result import COLLAPSED_ESS, UNRELIABLE_FRACTION
from smc_sd.program import Schedule
from smc_sd.programs import smc_speculative
from tests.toy_programs import PROMPT


def test_a_draft_far_from_the_target_with_two_particles_is_flagged():
    target = ToyLM.random(6, seed=3, scale=4.0, eos=False)
    # a draft whose preferences are unrelated to the target's
    draft = ToyLM.random(6, seed=11, scale=4.0, eos=False)
    result = smc_speculative.program(target, draft, draft_len=4).run(PROMPT, Schedule(2, max_tokens=20), seed=0)
    collapsed = sum(c.ess <= COLLAPSED_ESS for c in result.cycles)
    assert result.collapsed_fraction == collapsed / len(result.cycles) >= UNRELIABLE_FRACTION
    warning = result.reliability_warning
    assert warning is not None and f"in {collapsed} of {len(result.cycles)} cycles" in warning
    assert result.to_json()["collapsed_fraction"] == result.collapsed_fraction


def test_a_draft_equal_to_the_target_is_not_flagged():
    target = ToyLM.random(6, seed=3, scale=4.0, eos=False)
    result = smc_speculative.program(target, target, draft_len=4).run(PROMPT, Schedule(2, max_tokens=20), seed=0)
    assert result.collapsed_fraction == 0.0 and result.reliability_warning is None


def test_one_particle_is_never_flagged():
    target = ToyLM.random(6, seed=3, scale=4.0, eos=False)
    draft = ToyLM.random(6, seed=11, scale=4.0, eos=False)
    result = smc_speculative.program(target, draft, draft_len=4).run(PROMPT, Schedule(1, max_tokens=20), seed=0)
    assert result.reliability_warning is None
