"""Bad input fails before any model runs, with an error naming the problem."""

import math

import pytest
import torch

from smc_sd import AllParticlesDiedError, Schedule
from smc_sd.backends.base import ContextOverflowError, TokenizerMismatchError
from smc_sd.backends.toy import ToyLM
from smc_sd.compiler.plan import check_settings
from smc_sd.programs import MODULES, autoregressive, get, smc_speculative, speculative
from tests.toy_programs import PROMPT, target_and_draft


def test_invalid_settings_are_named():
    target, draft = target_and_draft()
    cases = [
        (smc_speculative.program(target, draft), Schedule(particles=0), "particles must be >= 1"),
        (smc_speculative.program(target, draft, draft_len=0), Schedule(), "draft length K must be >= 1"),
        (smc_speculative.program(target, draft, temperature=0.0), Schedule(), "target temperature"),
        (smc_speculative.program(target, draft, draft_temperature=-1.0), Schedule(), "draft temperature"),
        (smc_speculative.program(target, draft, alpha=0.0), Schedule(), "alpha"),
        (smc_speculative.program(target, draft), Schedule(ess_threshold=1.5), "ESS threshold"),
        (smc_speculative.program(target, draft), Schedule(max_tokens=0), "max tokens"),
        (smc_speculative.program(target, draft), Schedule(resampling="bogus"), "systematic"),
        (speculative.program(target, draft), Schedule(particles=2), "particles to 1"),
    ]
    for program, schedule, message in cases:
        with pytest.raises(ValueError, match=message):
            program.run(PROMPT, schedule)


def test_empty_prompt_is_refused():
    target, draft = target_and_draft()
    with pytest.raises(ValueError, match="prompt is empty"):
        smc_speculative.program(target, draft).run([], Schedule())


def test_mismatched_tokenizers_are_refused():
    target = ToyLM.random(4, seed=0)
    other = ToyLM.random(5, seed=0)
    with pytest.raises(TokenizerMismatchError, match="tokenizer"):
        smc_speculative.program(target, other).run(PROMPT, Schedule())
    with pytest.raises(TokenizerMismatchError):
        speculative.program(target, other).run(PROMPT, Schedule(1))


def test_context_overflow_is_refused():
    target = ToyLM.random(4, seed=0, max_length=16)
    with pytest.raises(ContextOverflowError, match="context window is 16"):
        autoregressive.program(target).run([0] * 10, Schedule(1, max_tokens=8))


def test_every_particle_dying_is_a_clear_error_with_partial_results():
    # the target gives token "a" probability zero; the draft proposes only "a"
    def target_logits(context):
        return torch.tensor([-math.inf, 0.0, 0.0, -math.inf])

    def draft_logits(context):
        return torch.tensor([0.0, -math.inf, -math.inf, -math.inf])

    target, draft = ToyLM(target_logits, 4), ToyLM(draft_logits, 4)
    with pytest.raises(AllParticlesDiedError) as caught:
        smc_speculative.program(target, draft, draft_len=2).run(PROMPT, Schedule(4, max_tokens=6))
    partial = caught.value.partial
    assert partial.log_ml == -math.inf
    assert len(partial.particles) == 4 and partial.target_passes == 1
    assert not torch.isfinite(partial.log_weights).any()


@pytest.mark.parametrize("method", sorted(MODULES))
def test_settings_are_checked_without_models(method):
    # the CLI builds the program with its models not loaded yet (None) and runs check_settings on
    # it before loading them: neither the builders nor the checks may read a model
    module = get(method)
    models = [None] if method == "ar" else [None, None]
    check_settings(module.program(*models), Schedule(module.DEFAULT_PARTICLES))
    with pytest.raises(ValueError, match="particles must be >= 1"):
        check_settings(module.program(*models), Schedule(particles=0))
    with pytest.raises(ValueError, match="target temperature"):
        check_settings(module.program(*models, temperature=-1.0), Schedule(module.DEFAULT_PARTICLES))
