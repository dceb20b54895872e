"""Free drafts keep each method's law: exact sd samples p_T, mask-at-verify the local projection.

A free draft proposes deterministic tokens (lookup continuations, forced tokens); verified as a
point-mass draft they are accepted with probability p, so the emitted law must be exactly the
method's. Prompts here repeat their tokens so that lookup proposes often, and the vocabulary of
the constrained case spells forced bytes in several ways, so that the verify, not the draft,
decides between tokenizations. TV tolerances come from `tv_tolerance` (failure 1e-6 when exact).
"""

import math

import pytest

from smc_sd.backends.pass_cost import CPU_BFLOAT16_NATIVE, CPU_FLOAT32, CUDA, PassCost
from smc_sd.engine.free_drafts import DECAY, PRIOR_ACCEPTANCE, FreeDrafter, best_block_length
from smc_sd.metrics import empirical, total_variation, tv_tolerance
from smc_sd.program import FreeDraft, Schedule
from smc_sd.constraints.grammars import Regex
from smc_sd.constraints.potentials import as_token_constraint
from smc_sd.programs import autoregressive, mask_at_verify, smc_speculative, speculative
from tests.test_constraints import MAX_TOKENS as LANGUAGE_TOKENS, in_language, language_constraint
from tests.test_llguidance import WordLM
from tests.toy_programs import target_and_draft

#: a prompt whose bigrams repeat, so that a lookup of one or two tokens finds continuations
REPEATING_PROMPT = [0, 1, 2, 0, 1, 2, 0, 1, 0, 2]
LOOKUP = FreeDraft(forced=False, min_match=1, max_len=3)


def runs_alone(program, prompt, schedule, n):
    """The Results of n `Program.run` calls, seeds 0 .. n - 1."""
    return [program.run(prompt, schedule, seed=seed) for seed in range(n)]


def run_all(program, prompt, schedule, n, runs=runs_alone):
    """Completions of n seeded runs (`runs`: alone, or through the batched engine), and the
    draft tokens they proposed and accepted in all."""
    samples, proposed, accepted = [], 0, 0
    for result in runs(program, prompt, schedule, n):
        samples.append(tuple(result.tokens))
        proposed += sum(c.proposed or 0 for c in result.cycles)
        accepted += sum(c.accepted or 0 for c in result.cycles)
    return samples, proposed, accepted


@pytest.mark.parametrize("with_lm", [False, True])
def test_sd_with_a_lookup_draft_matches_the_target(with_lm):
    target, draft = target_and_draft(noise=2.0)
    max_tokens, n = 4, 5000
    program = speculative.program(target, draft if with_lm else None, draft_len=2, free_draft=LOOKUP)
    samples, proposed, accepted = run_all(program, REPEATING_PROMPT, Schedule(1, max_tokens=max_tokens), n)
    # the lookup proposed on many runs, and the target rejected part of it
    assert proposed > n // 4 and 0 < accepted < proposed
    exact, _ = target.completion_distribution(REPEATING_PROMPT, max_tokens)
    assert total_variation(empirical(samples), exact) < tv_tolerance(exact, n)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_mask_at_verify_with_forced_tokens_matches_the_local_projection(temperature):
    # "()" is forced at the start and after every pair; "(" then ")" spells it too
    lm = WordLM(["(", ")", "()", "(("], seed=2)
    constraint = Regex(r"(\(\))+")
    max_tokens, n = 4, 5000
    program = mask_at_verify.program(lm, None, constraints=(constraint,), temperature=temperature, free_draft=FreeDraft(min_match=1, max_len=3))
    samples, proposed, accepted = run_all(program, [0], Schedule(1, max_tokens=max_tokens), n)
    assert proposed > n // 4 and 0 < accepted < proposed
    exact, _ = lm.completion_distribution([0], max_tokens, temperature, constraint=as_token_constraint(constraint, lm), local=True)
    # the non-canonical spelling of the forced pair keeps its mass
    assert sum(w for x, w in exact.items() if x[:2] == (0, 1)) > 0.05
    assert total_variation(empirical(samples), exact) < tv_tolerance(exact, n)


def test_sd_at_temperature_zero_with_a_free_draft_is_greedy():
    target, _ = target_and_draft()
    program = speculative.program(target, None, temperature=0.0, free_draft=LOOKUP)
    greedy, prefix = [], list(REPEATING_PROMPT)
    for _ in range(6):
        greedy.append(int(target.logits(tuple(prefix)).argmax()))
        prefix.append(greedy[-1])
        if greedy[-1] == target.vocabulary.eos_token_id:
            break
    for seed in range(5):
        assert program.run(REPEATING_PROMPT, Schedule(1, max_tokens=6), seed=seed).tokens == greedy


def test_record_counts_the_tokens_each_verify_tested_by_source():
    drafter = FreeDrafter(FreeDraft(), [0, 1, 2])
    before = {source: list(counts) for source, counts in drafter.counts.items()}

    def added(source):
        return [after - DECAY * was for after, was in zip(drafter.counts[source], before[source])]

    # 2 forced then 3 lookup tokens, 3 accepted: forced 2 of 2, lookup 1 accepted of the 2 tested
    drafter.record(5, 2, 3)
    assert added("forced") == pytest.approx([2, 2]) and added("lookup") == pytest.approx([1, 2])
    before = {source: list(counts) for source, counts in drafter.counts.items()}
    # the first forced token refused: the lookup tokens after it were never tested
    drafter.record(5, 2, 0)
    assert added("forced") == pytest.approx([0, 1]) and drafter.counts["lookup"] == before["lookup"]
    drafter.record(0, 0, 0)
    assert drafter.counts["lookup"] == before["lookup"]


def test_a_source_the_cost_cuts_drifts_back_to_its_prior_and_is_tried_again():
    drafter = FreeDrafter(FreeDraft(min_match=1), [5, 6, 7, 5, 6, 7, 5, 6, 7], cost=CPU_FLOAT32, rows=4)
    # its lookup was refused often: a running acceptance of 0.1 does not pay at 4 rows
    drafter.counts["lookup"] = [1.0, 10.0]
    lengths, acceptances = [], []
    for _ in range(40):
        tokens, _ = drafter.propose([5, 6], budget=64)
        lengths.append(len(tokens))
        acceptances.append(drafter.acceptance("lookup"))
        if tokens:
            break
    # untested, it rises towards the prior 0.5 a step per cut, and proposes again once it pays
    assert lengths[0] == 0 and lengths[-1] > 0 and 5 <= len(lengths) < 40
    assert all(a < b < PRIOR_ACCEPTANCE["lookup"] for a, b in zip(acceptances, acceptances[1:-1]))


def test_best_block_length_proposes_exactly_where_it_pays():
    # with c(n) = 1 + beta (n - 1) and constant acceptance a, one more proposed token pays iff
    # (1 + a) / (1 + beta) > 1, i.e. a > beta; a near-free pass proposes all of a good block
    linear = PassCost("linear", ((1, 1.0), (2, 1.3)))
    assert best_block_length([0.29] * 6, linear) == 0
    assert best_block_length([0.31] * 6, linear) >= 1
    assert best_block_length([0.99] * 8, CUDA) == 8
    assert best_block_length([0.0] * 8, CUDA) == 0 and best_block_length([], CPU_FLOAT32) == 0
    # the same tokens are worth fewer positions where the pass is arithmetic-bound
    good = [0.8] * 16
    assert best_block_length(good, CPU_BFLOAT16_NATIVE) >= best_block_length(good, CPU_FLOAT32) >= 1
    # a request of several rows fills the pass sooner: never longer blocks than one row
    assert 1 <= best_block_length(good, CPU_FLOAT32, rows=4) <= best_block_length(good, CPU_FLOAT32, rows=1)


def test_pass_cost_interpolates_its_points_and_refuses_bad_tables():
    assert CPU_FLOAT32(0) == 0.0 and CPU_FLOAT32(1) == 1.0 and CPU_FLOAT32(5) == pytest.approx(1.8)
    assert CPU_FLOAT32(3) == pytest.approx(1.4)
    # past the last point, the last slope: (6.1 - 3.2) / 60 per position
    assert CPU_FLOAT32(140) == pytest.approx(6.1 + 60 * (6.1 - 3.2) / 60)
    with pytest.raises(ValueError, match="must start at"):
        PassCost("bad", ((2, 1.0),))
    with pytest.raises(ValueError, match="must increase"):
        PassCost("bad", ((1, 1.0), (4, 0.9)))


def test_sd_keeps_p_t_when_the_cost_makes_block_lengths_change_with_the_past(monkeypatch):
    # each extra position costs 0.45 passes: a lookup pays only while its running acceptance
    # stays above 0.45, so blocks switch between proposing and plain decodes as runs go
    target, _ = target_and_draft(noise=2.0)
    monkeypatch.setattr(type(target), "pass_cost", PassCost("steep", ((1, 1.0), (2, 1.45))))
    max_tokens, n = 4, 5000
    program = speculative.program(target, None, free_draft=LOOKUP)
    lengths: dict[int, int] = {}
    samples = []
    for seed in range(n):
        result = program.run(REPEATING_PROMPT, Schedule(1, max_tokens=max_tokens), seed=seed)
        samples.append(tuple(result.tokens))
        for length, blocks in result.free_draft["block_lengths"].items():
            lengths[length] = lengths.get(length, 0) + blocks
    assert lengths.get(0, 0) > n // 10 and sum(blocks for length, blocks in lengths.items() if length > 0) > n // 10
    exact, _ = target.completion_distribution(REPEATING_PROMPT, max_tokens)
    assert total_variation(empirical(samples), exact) < tv_tolerance(exact, n)


def test_a_proposal_with_neither_model_nor_free_draft_is_refused():
    target, _ = target_and_draft()
    with pytest.raises(ValueError, match="neither a draft model nor a free draft"):
        speculative.program(target, None).run([0], Schedule(1, max_tokens=2))


def test_constrained_ar_samples_the_local_projection():
    lm = WordLM(["(", ")", "()", "(("], seed=2)
    constraint = Regex(r"(\(\))+")
    max_tokens, n = 4, 5000
    samples, _, _ = run_all(autoregressive.program(lm, constraints=(constraint,)), [0], Schedule(1, max_tokens=max_tokens), n)
    exact, _ = lm.completion_distribution([0], max_tokens, constraint=as_token_constraint(constraint, lm), local=True)
    assert total_variation(empirical(samples), exact) < tv_tolerance(exact, n)


# SMC-SD with a free draft: each particle is extended by exact speculative sampling of the locally
# masked target and weighted by the local normalisers; the language is the one of
# tests/test_constraints.py, where the local projection and the conditional differ (TV > 0.5)

#: a prompt spelling the language's words, so that lookup proposes inside them
WORDS_PROMPT = [1, 2, 2, 1, 2, 1, 2, 2, 0]


def test_smc_sd_with_a_free_draft_and_no_constraint_samples_the_target():
    target, _ = target_and_draft(noise=2.0)
    max_tokens, n = 4, 4000
    program = smc_speculative.program(target, None, free_draft=LOOKUP)
    samples, proposed, accepted = run_all(program, REPEATING_PROMPT, Schedule(2, max_tokens=max_tokens), n)
    assert proposed > n // 4 and 0 < accepted < proposed
    exact, _ = target.completion_distribution(REPEATING_PROMPT, max_tokens)
    assert total_variation(empirical(samples), exact) < tv_tolerance(exact, n)


def smc_sd_free(target, draft, constraint):
    """SMC-SD with the lookup free draft under `constraint`, beside the draft LM `draft`
    (free+NAME: its blocks in cycles where the free draft proposes nothing) or alone (None)."""
    return smc_speculative.program(target, draft, draft_len=2, constraints=(constraint,), free_draft=LOOKUP)


@pytest.mark.parametrize("with_lm", [False, True])
def test_smc_sd_with_a_free_draft_converges_to_the_conditional(with_lm):
    assert_smc_sd_free_reaches_the_conditional(runs_alone, with_lm)


def assert_smc_sd_free_reaches_the_conditional(runs_of, with_lm: bool = False):
    """One particle samples the local projection (free draft alone), sixteen the global
    conditional, in runs made by `runs_of(program, prompt, schedule, n)`; with a draft LM
    beside the free draft, sixteen reach the conditional and some cycles drafted with it."""
    target, draft = target_and_draft(noise=1.0)
    constraint = language_constraint()
    exact, _ = target.completion_distribution(WORDS_PROMPT, LANGUAGE_TOKENS, constraint=constraint)
    local, _ = target.completion_distribution(WORDS_PROMPT, LANGUAGE_TOKENS, constraint=constraint, local=True)
    assert total_variation(local, exact) > 0.3
    runs = 400
    tolerance = tv_tolerance(exact, runs)
    if with_lm:
        results = runs_of(smc_sd_free(target, draft, constraint), WORDS_PROMPT, Schedule(16, max_tokens=LANGUAGE_TOKENS), runs)
        assert sum(r.draft_passes for r in results) > 0 and sum(c.proposed or 0 for r in results for c in r.cycles) > 0
        samples = [tuple(r.tokens) for r in results]
        assert all(in_language(x) for x in samples)
        assert total_variation(empirical(samples), exact) < tolerance
        return
    program = smc_sd_free(target, None, constraint)
    samples = {}
    for n in (1, 16):
        samples[n], proposed, _ = run_all(program, WORDS_PROMPT, Schedule(n, max_tokens=LANGUAGE_TOKENS), runs, runs_of)
        assert proposed > 0
    assert all(in_language(x) for xs in samples.values() for x in xs)
    tv = {n: total_variation(empirical(xs), exact) for n, xs in samples.items()}
    # one particle samples the local projection; sixteen reach the conditional
    assert total_variation(empirical(samples[1]), local) < tv_tolerance(local, runs)
    assert tv[16] < tolerance and tv[1] > tv[16] + tolerance


@pytest.mark.parametrize("ess_threshold, with_lm", [(1.0, False), (0.5, False), (0.5, True)])
def test_smc_sd_with_a_free_draft_has_an_unbiased_z_hat(ess_threshold, with_lm):
    assert_smc_sd_free_z_hat_is_unbiased(runs_alone, ess_threshold, with_lm=with_lm)


def assert_smc_sd_free_z_hat_is_unbiased(runs_of, ess_threshold: float, n: int = 3000, with_lm: bool = False):
    """The mean of n runs' Z_hat (made by `runs_of`) lies within 5 standard errors of Z."""
    target, draft = target_and_draft(noise=1.0)
    constraint = language_constraint()
    _, log_z = target.completion_distribution(WORDS_PROMPT, LANGUAGE_TOKENS, constraint=constraint)
    program = smc_sd_free(target, draft if with_lm else None, constraint)
    schedule = Schedule(particles=4, ess_threshold=ess_threshold, max_tokens=LANGUAGE_TOKENS)
    z_hats = [math.exp(r.log_ml) for r in runs_of(program, WORDS_PROMPT, schedule, n)]
    mean = sum(z_hats) / len(z_hats)
    std_error = math.sqrt(sum((z - mean) ** 2 for z in z_hats) / (len(z_hats) - 1) / len(z_hats))
    # 5 standard errors: a false alarm has probability ~1e-6 under the CLT
    assert abs(mean - math.exp(log_z)) < 5 * std_error
    # one Z_hat's relative spread stays below 2.75 (a standard error of 5% at 3000 runs)
    assert std_error < 2.75 / math.sqrt(n) * math.exp(log_z)
