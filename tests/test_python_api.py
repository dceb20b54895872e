"""The Python API as a user meets it: `Program.run` takes text (in the model's chat template, or
raw) as well as token ids; a result no particle completed warns with a category users can filter,
and reports what it is: every weight zero (ESS 0, log weights -inf, log Z -inf)."""

import math
import warnings

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

import smc_sd
from smc_sd.backends.hf import HFLanguageModel
from smc_sd.models.chat import chat_prompt
from smc_sd.program import Schedule
from smc_sd.programs import autoregressive, mask_at_verify, smc_speculative
from tests.test_constraints import language_constraint, proposal
from tests.tiny_llama import tiny_llama
from tests.toy_programs import PROMPT, target_and_draft

WORDS = ["<eos>", "<unk>", "user", "bot", "a", "b", "c", "d"]
# one user message, then the reply's cue: "user a b bot" for the text "a b"
CHAT_TEMPLATE = "{% for m in messages %}user {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}bot{% endif %}"
TEXT = "a b c"


def word_tokenizer(chat_template: str | None) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = chat_template
    return fast


@pytest.fixture(scope="module")
def chat_lm() -> HFLanguageModel:
    """A tiny random Llama over WORDS whose tokenizer has a chat template."""
    return HFLanguageModel(tiny_llama(vocab=len(WORDS)), word_tokenizer(CHAT_TEMPLATE))


def outcome(result) -> tuple:
    return result.prompt, result.particles, result.log_weights.tolist(), result.log_ml


def test_text_prompt_runs_in_the_chat_template_as_its_token_ids_do(chat_lm):
    program = smc_speculative.program(chat_lm, chat_lm, draft_len=2)
    schedule = Schedule(3, max_tokens=6)
    ids = chat_prompt(chat_lm.tokenizer, TEXT)
    assert ids == [WORDS.index(w) for w in ("user", "a", "b", "c", "bot")]
    for seed in (0, 1):
        assert outcome(program.run(TEXT, schedule, seed=seed)) == outcome(program.run(ids, schedule, seed=seed))
    # run_many takes text and ids side by side; result i is run(prompts[i]) for its seed
    many = program.run_many([TEXT, ids], schedule, seeds=[1, 0])
    assert [outcome(r) for r in many] == [outcome(program.run(ids, schedule, seed=s)) for s in (1, 0)]


def test_raw_text_prompt_is_the_text_own_tokens(chat_lm):
    program = autoregressive.program(chat_lm)
    schedule = Schedule(1, max_tokens=4)
    raw_ids = [WORDS.index(w) for w in TEXT.split()]
    assert outcome(program.run(TEXT, schedule, raw=True)) == outcome(program.run(raw_ids, schedule))
    assert program.run(TEXT, schedule, raw=True).prompt != program.run(TEXT, schedule).prompt
    assert program.smc(TEXT, 1, max_tokens=4, raw=True).prompt == raw_ids


def test_a_prompt_the_model_cannot_read_is_one_line():
    target, _ = target_and_draft()
    toy = autoregressive.program(target)
    with pytest.raises(ValueError, match="no tokenizer to encode a text prompt; pass the prompt as token ids"):
        toy.run("a b", Schedule(1, max_tokens=2))
    for prompt in (2.5, [[0]], ["a"]):
        with pytest.raises(ValueError, match="a prompt is text or a list of token ids"):
            toy.run(prompt, Schedule(1, max_tokens=2))
    plain = autoregressive.program(HFLanguageModel(tiny_llama(vocab=len(WORDS)), word_tokenizer(None)))
    with pytest.raises(ValueError, match="no chat template; pass raw=True"):
        plain.run(TEXT, Schedule(1, max_tokens=2))
    assert plain.run(TEXT, Schedule(1, max_tokens=2), raw=True).prompt == [WORDS.index(w) for w in TEXT.split()]


# the only string of the language has 4 letters: a budget of 2 tokens leaves every particle incomplete
UNREACHABLE = ("aaaa",)
BUDGET = 2


def incomplete_programs():
    target, draft = target_and_draft()
    constraint = language_constraint(UNREACHABLE)
    return {
        "smc-sd": (smc_speculative.program(target, constraints=(constraint,), **proposal(draft, "draft LM", 1)), 4),
        "smc-sd free": (smc_speculative.program(target, constraints=(constraint,), **proposal(draft, "free", 1)), 4),
        "mask-at-verify": (mask_at_verify.program(target, draft, draft_len=1, constraints=(constraint,)), 1),
    }


@pytest.mark.parametrize("method", ["smc-sd", "smc-sd free", "mask-at-verify"])
def test_no_particle_complete_means_every_weight_zero_and_a_warning(method):
    program, particles = incomplete_programs()[method]
    schedule = Schedule(particles, max_tokens=BUDGET)
    with pytest.warns(smc_sd.IncompleteResultWarning, match=f"within {BUDGET} tokens") as caught:
        result = program.run(PROMPT, schedule, seed=0)
    # attributed to the caller's line, not to the library's
    assert [w.filename for w in caught if w.category is smc_sd.IncompleteResultWarning] == [__file__]
    assert not result.complete and len(result.tokens) == BUDGET
    assert result.ess == 0.0
    assert result.log_weights.shape == (particles,) and bool(torch.isneginf(result.log_weights).all())
    assert result.log_ml == -math.inf
    assert result.weights == [0.0] * particles and result.posterior == {}


def test_the_incomplete_warning_is_filtered_by_its_category():
    program, particles = incomplete_programs()["smc-sd"]
    schedule = Schedule(particles, max_tokens=BUDGET)
    assert issubclass(smc_sd.IncompleteResultWarning, UserWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error", smc_sd.IncompleteResultWarning)
        with pytest.raises(smc_sd.IncompleteResultWarning):
            program.run(PROMPT, schedule)
        with pytest.raises(smc_sd.IncompleteResultWarning):
            program.run_many([PROMPT, PROMPT], schedule)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=smc_sd.IncompleteResultWarning)
        assert not program.run(PROMPT, schedule).complete


def test_a_complete_result_does_not_warn_and_keeps_its_weights():
    target, draft = target_and_draft()
    program = smc_speculative.program(target, draft, draft_len=1, constraints=(language_constraint(("a", "b", "c")),))
    with warnings.catch_warnings():
        warnings.simplefilter("error", smc_sd.IncompleteResultWarning)
        result = program.run(PROMPT, Schedule(4, max_tokens=BUDGET), seed=0)
    assert result.complete and result.ess >= 1.0 and math.isfinite(result.log_ml)
    assert math.isclose(sum(result.weights), 1.0)
