"""Programs on the llama.cpp backend: the free draft keeps the law, every method runs, the batched
engine joins requests, and a GGUF other than the default runs as a draft.

Run with the llama extra installed: `python -m pytest tests/llama -m llama` (docs/backends.md).
"""

import math
import re

import pytest
import torch
from scipy.stats import chi2

from smc_sd import testing
from smc_sd.backends.hf import chat_prompt
from smc_sd.program import FreeDraft, Schedule
from smc_sd.constraints.grammars import Regex
from smc_sd.constraints.potentials import as_token_constraint
from smc_sd.programs import get

pytestmark = [pytest.mark.llama, pytest.mark.model]

COLOURS = r"(red|blue|green)"
COLOUR_QUESTION = "Name a colour. Answer with one word."
#: a test that holds when the law is exact fails with this probability
FAILURE_PROBABILITY = 1e-3


def local_projection(lm, prompt, constraint, max_tokens):
    """The exact law over token completions that constrained ar and mask-at-verify sample at
    T = 1: prod_t p(x_t | x_<t) 1[x_t allowed] / Z_t, by enumeration of every allowed path
    (each a fresh decode on this backend); `max_tokens` must exceed every path's length."""
    tokens = as_token_constraint(constraint, lm)
    eos = lm.vocabulary.eos_token_id
    law, frontier = {}, [((), 0.0)]
    while frontier:
        path, logw = frontier.pop()
        assert len(path) < max_tokens, "a path reaches the token budget: raise max_tokens"
        logp = torch.log_softmax(testing.fresh_logits(lm, prompt + list(path)), -1)
        logp = logp.masked_fill(~tokens.mask([list(path)])[0], -math.inf)
        logp = logp - torch.logsumexp(logp, -1)
        for token in torch.isfinite(logp).nonzero().flatten().tolist():
            w = logw + float(logp[token])
            if token == eos:
                law[path + (token,)] = math.exp(w)
            else:
                frontier.append((path + (token,), w))
    return law


def chi_square(samples: list, law: dict) -> tuple[float, float]:
    """Pearson's statistic of the samples against the law, completions expected fewer than 5
    times pooled into one bin, and the statistic's (1 - FAILURE_PROBABILITY) quantile under the
    law (chi-square with bins - 1 degrees of freedom)."""
    n = len(samples)
    bins = {x: p for x, p in law.items() if n * p >= 5}
    rest = 1.0 - sum(bins.values())
    counts = {x: 0 for x in bins}
    other = 0
    for x in samples:
        if x in counts:
            counts[x] += 1
        else:
            other += 1
    statistic = sum((counts[x] - n * p) ** 2 / (n * p) for x, p in bins.items())
    df = len(bins) - 1
    if n * rest >= 5:
        statistic += (other - n * rest) ** 2 / (n * rest)
        df += 1
    else:
        # a pooled bin too rare to test: its count must still be plausible (a sample outside the
        # law's support at all fails here)
        assert other <= max(5, 5 * n * rest), (other, n * rest)
    return statistic, float(chi2.ppf(1 - FAILURE_PROBABILITY, df))


def test_mask_at_verify_with_the_free_draft_samples_constrained_ars_law(llama_lm):
    """mask-at-verify with the free draft (exact sd with a point-mass draft, masked) and
    constrained ar both sample the local projection of the backend's own p: 300 draws of each
    against the enumerated law, Pearson's chi-square at failure probability 1e-3."""
    constraint = Regex(COLOURS)
    prompt = chat_prompt(llama_lm.tokenizer, COLOUR_QUESTION)
    max_tokens = 8
    law = local_projection(llama_lm, prompt, constraint, max_tokens)
    assert abs(sum(law.values()) - 1) < 1e-6
    # the answers spread over several completions, so the test has something to tell apart
    assert max(law.values()) < 0.9, law
    n = 300
    for method, options in (("ar", {}), ("mask-at-verify", {"free_draft": FreeDraft()})):
        program = get(method).program(llama_lm, *([None] if method != "ar" else []), constraints=(constraint,), **options)
        samples, proposed = [], 0
        for seed in range(n):
            result = program.run(prompt, Schedule(1, max_tokens=max_tokens), seed=seed)
            samples.append(tuple(result.tokens))
            proposed += sum(c.proposed or 0 for c in result.cycles)
        statistic, threshold = chi_square(samples, law)
        assert statistic < threshold, (method, statistic, threshold)
        if method != "ar":
            # the free draft proposed (the EOS the regex forces after a whole word) where its
            # cost model found a two-position pass worth it
            assert proposed > 0


@pytest.mark.parametrize("method", ["ar", "sd", "smc-sd", "mask-at-verify"])
def test_every_method_runs_with_a_requantized_draft(llama_lm, q8_gguf, method):
    """A Q8_0 copy of the shipped file (written by llama.cpp's quantizer in the test) serves as
    the draft LM: it loads with the target's tokenizer, shares its vocabulary and drafts."""
    from smc_sd.backends.base import check_same_vocabulary
    from smc_sd.backends.llama_cpp import LlamaCppLanguageModel

    draft = LlamaCppLanguageModel(q8_gguf, tokenizer=llama_lm.tokenizer, n_seq_max=8, n_threads=1)
    check_same_vocabulary(draft, llama_lm)
    prompt = chat_prompt(llama_lm.tokenizer, COLOUR_QUESTION)
    options = {"constraints": (Regex(COLOURS),)} if method in ("smc-sd", "mask-at-verify") else {}
    program = get(method).program(llama_lm, *([] if method == "ar" else [draft]), **options)
    result = program.run(prompt, Schedule(4 if method == "smc-sd" else 1, max_tokens=12), seed=0)
    assert len(result.tokens) >= 1
    if options:
        assert re.fullmatch(COLOURS, result.text), result.text
    if method == "sd":
        # a Q8_0 copy of the same weights agrees with the target on most tokens
        accepted = sum(c.accepted or 0 for c in result.cycles)
        drafted = sum(c.proposed or 0 for c in result.cycles)
        assert drafted > 0 and accepted / drafted > 0.5, (accepted, drafted)


def test_run_many_joins_requests_of_different_prompts(llama_lm):
    """The batched engine joins prompts of several lengths on this backend (ragged rows) and
    returns what each request returns alone."""
    program = get("smc-sd").program(llama_lm, None, constraints=(Regex(COLOURS),), free_draft=FreeDraft())
    prompts = [chat_prompt(llama_lm.tokenizer, q) for q in (COLOUR_QUESTION, "Pick a colour for a car. One word.", "Colour?")]
    schedule = Schedule(4, max_tokens=8)
    batched = program.run_many(prompts, schedule, seeds=[0, 1, 2])
    for prompt, seed, result in zip(prompts, [0, 1, 2], batched):
        assert re.fullmatch(COLOURS, result.text), result.text
        alone = program.run(prompt, schedule, seed=seed)
        assert alone.tokens == result.tokens
    assert llama_lm.trie.live == 0
