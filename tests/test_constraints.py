"""Constraints, power targets and twists on toy LMs whose conditionals are enumerated exactly.

The language below is one where masking locally is badly biased: the target puts little mass on
"a" as a first token among the valid ones, but almost every completion after "b" or "c" leaves
the language, so the conditional p_T(x | x in L) is mostly "a" while the locally projected
distribution (what mask-at-verify samples) is mostly "b.." and "c..".
"""

import math

import pytest
import torch

from smc_sd.backends.toy import ToyLM
from smc_sd.engine.result import AllParticlesDiedError
from smc_sd.metrics import empirical, total_variation, tv_tolerance
from smc_sd.program import FreeDraft, Schedule
from smc_sd.constraints.token_constraints import PredicateConstraint, UnsatisfiableConstraintError
from smc_sd.programs import mask_at_verify, smc_speculative
from tests.toy_programs import PROMPT, sample_completions, target_and_draft

LANGUAGE = ("a", "bcc", "bcb", "cbb")
MAX_TOKENS = 4


def word(ids) -> str:
    return "".join(chr(ord("a") + t) for t in ids)


def language_constraint(language=LANGUAGE, viable=None) -> PredicateConstraint:
    """Membership in a finite language over the toy letters (EOS = 3)."""
    viable = viable or (lambda x: any(w.startswith(word(x)) for w in language))
    return PredicateConstraint(viable, lambda x: word(x) in language, 4, 3)


def in_language(tokens) -> bool:
    return tokens[-1] == 3 and word(tokens[:-1]) in LANGUAGE


def test_constrained_smc_sd_approaches_the_conditional_and_beats_mask_at_verify():
    target, draft = target_and_draft(noise=1.0)
    constraint = language_constraint()
    exact, _ = target.completion_distribution(PROMPT, MAX_TOKENS, constraint=constraint)
    local, _ = target.completion_distribution(PROMPT, MAX_TOKENS, constraint=constraint, local=True)
    assert total_variation(local, exact) > 0.5
    runs = 300
    program = smc_speculative.program(target, draft, draft_len=2, constraints=(constraint,))
    samples = {n: sample_completions(program, Schedule(n, max_tokens=MAX_TOKENS), runs) for n in (2, 16)}
    assert all(in_language(x) for xs in samples.values() for x in xs)
    tv = {n: total_variation(empirical(xs), exact) for n, xs in samples.items()}
    baseline = sample_completions(mask_at_verify.program(target, draft, draft_len=2, constraints=(constraint,)), Schedule(1, max_tokens=MAX_TOKENS), runs)
    assert all(in_language(x) for x in baseline)
    tolerance = tv_tolerance(exact, runs)
    # mask-at-verify converges to the locally projected distribution, not the conditional
    assert total_variation(empirical(baseline), local) < tv_tolerance(local, runs)
    assert tv[16] < tolerance
    assert tv[2] > tv[16] + tolerance
    assert total_variation(empirical(baseline), exact) > tv[16] + tolerance


def test_mask_at_verify_samples_the_locally_projected_distribution():
    target, draft = target_and_draft(noise=2.0)
    constraint = language_constraint(("ab", "ba", "bb", "cab", "a"))
    local, _ = target.completion_distribution(PROMPT, MAX_TOKENS, constraint=constraint, local=True)
    runs = 1500
    program = mask_at_verify.program(target, draft, draft_len=2, constraints=(constraint,))
    samples = sample_completions(program, Schedule(1, max_tokens=MAX_TOKENS), runs)
    assert total_variation(empirical(samples), local) < tv_tolerance(local, runs)


def exact_future_validity_twist(target: ToyLM, constraint, max_tokens: int):
    """log psi(prefix) = log sum over valid completions y of prefix of p_T(y | prefix): the
    probability that the target, continuing the prefix, ends inside the language."""
    exact, log_z = target.completion_distribution(PROMPT, max_tokens, constraint=constraint)

    def log_prefix_probability(prefix) -> float:
        return sum(
            float(torch.log_softmax(target.logits(tuple(PROMPT + prefix[:t])), -1)[prefix[t]]) for t in range(len(prefix))
        )

    def twist(prefixes: list[list[int]]) -> torch.Tensor:
        out = []
        for prefix in prefixes:
            mass = sum(p for x, p in exact.items() if list(x[: len(prefix)]) == prefix)
            out.append(math.log(mass) + log_z - log_prefix_probability(prefix) if mass > 0 else -math.inf)
        return torch.tensor(out, dtype=torch.float64)

    return twist


def test_exact_future_validity_twist_raises_the_final_ess():
    # Without the twist a particle learns that its prefix is nearly doomed only when the
    # constraint forces it through improbable tokens; with it, resampling after the first block
    # already favours the prefixes with a likely valid future, so the final weights are more even.
    target, draft = target_and_draft(noise=1.0)
    constraint = language_constraint()
    twist = exact_future_validity_twist(target, constraint, MAX_TOKENS)
    schedule = Schedule(8, ess_threshold=0.5, max_tokens=MAX_TOKENS)

    def mean_final_ess(program) -> float:
        return sum(program.run(PROMPT, schedule, seed=s).ess for s in range(200)) / 200

    plain = mean_final_ess(smc_speculative.program(target, draft, draft_len=1, constraints=(constraint,)))
    twisted = mean_final_ess(smc_speculative.program(target, draft, draft_len=1, constraints=(constraint,), twist=twist))
    assert twisted > plain + 0.5


def proposal(draft, kind: str, draft_len: int) -> dict:
    """smc_speculative.program's proposal arguments: the draft LM, or the free draft alone."""
    if kind == "free":
        return {"draft": None, "free_draft": FreeDraft(min_match=1, max_len=3)}
    return {"draft": draft, "draft_len": draft_len}


@pytest.mark.parametrize("kind", ["draft LM", "free"])
def test_twisted_smc_sd_still_targets_the_conditional(kind):
    target, draft = target_and_draft(noise=1.0)
    constraint = language_constraint()
    exact, _ = target.completion_distribution(PROMPT, MAX_TOKENS, constraint=constraint)
    twist = exact_future_validity_twist(target, constraint, MAX_TOKENS)
    program = smc_speculative.program(target, constraints=(constraint,), twist=twist, **proposal(draft, kind, 1))
    runs = 300
    samples = sample_completions(program, Schedule(16, max_tokens=MAX_TOKENS), runs)
    assert total_variation(empirical(samples), exact) < tv_tolerance(exact, runs)


def test_power_target_with_a_constraint():
    target, draft = target_and_draft(noise=1.0)
    constraint = language_constraint(("ab", "ba", "bb", "cab", "a", "cc"))
    alpha = 2.0
    exact, _ = target.completion_distribution(PROMPT, MAX_TOKENS, alpha=alpha, constraint=constraint)
    plain, _ = target.completion_distribution(PROMPT, MAX_TOKENS, constraint=constraint)
    runs = 1000
    tolerance = tv_tolerance(exact, runs)
    # the power target is far enough from the plain conditional for the check to tell them apart
    assert total_variation(exact, plain) > tolerance + 0.05
    program = smc_speculative.program(target, draft, alpha=alpha, draft_len=2, constraints=(constraint,))
    samples = sample_completions(program, Schedule(64, max_tokens=MAX_TOKENS), runs)
    assert total_variation(empirical(samples), exact) < tolerance


def test_fsa_masks_equal_the_predicate_masks():
    from genlm import control as genlm

    target, _ = target_and_draft()
    fsa = genlm.BoolFSA.from_regex("|".join(LANGUAGE))
    from smc_sd.constraints.potentials import as_token_constraint

    lowered = as_token_constraint(fsa, target)
    reference = language_constraint()
    prefixes = [[]] + [[a] for a in range(3)] + [[a, b] for a in range(3) for b in range(3)] + [[1, 2, 2], [0, 0, 0]]
    assert torch.equal(lowered.mask(prefixes), reference.mask(prefixes))


def test_dead_ends_get_weight_zero_and_all_dead_raises_with_partial_result():
    target, draft = target_and_draft(noise=1.0)
    # a prefix test that wrongly calls "c" viable: particles that start with it die
    leaky = language_constraint(viable=lambda x: word(x) in ("a", "c"))
    program = smc_speculative.program(target, draft, draft_len=1, constraints=(leaky,))
    died = 0
    for seed in range(20):
        try:
            result = program.run(PROMPT, Schedule(2, ess_threshold=0.0, max_tokens=MAX_TOKENS), seed=seed)
        except AllParticlesDiedError as error:
            died += 1
            assert error.partial.log_ml == -math.inf and len(error.partial.particles) == 2
            continue
        for tokens, logw in zip(result.particles, result.log_weights.tolist()):
            assert (logw == -math.inf) == (word(tokens[:1]) == "c")
    assert died > 0


def test_unsatisfiable_constraint_is_reported():
    target, draft = target_and_draft()
    nothing = PredicateConstraint(lambda x: False, lambda x: False, 4, 3)
    for program in (smc_speculative.program(target, draft, constraints=(nothing,)), mask_at_verify.program(target, draft, constraints=(nothing,))):
        with pytest.raises(UnsatisfiableConstraintError, match="admit no string"):
            program.run(PROMPT, Schedule(1, max_tokens=MAX_TOKENS))


@pytest.mark.parametrize(
    "schema,good,bad",
    [
        ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}, '{"name": "Bo", "age": 42}', '{"name": "Bo", "age": 4.5}'),
        ({"enum": ["red", "green"]}, '"green"', '"blue"'),
        ({"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 2}, "[1.5, -2e3]", "[1, 2, 3]"),
        ({"type": "object", "properties": {"ok": {"type": "boolean"}, "x": {"type": "null"}}}, '{"ok":true,"x":null}', '{"ok":1,"x":null}'),
    ],
)
def test_json_schema_potential_accepts_only_valid_documents(schema, good, bad):
    import asyncio
    import json

    import jsonschema

    from smc_sd.constraints.grammars import JsonSchema

    jsonschema.validate(json.loads(good), schema)
    compact = json.dumps(json.loads(good), separators=(",", ":"))
    flexible = JsonSchema(schema, layout="flexible")
    assert asyncio.run(flexible.complete(good.encode())) == 0.0
    assert asyncio.run(flexible.complete(bad.encode())) == float("-inf")
    # the default compact layout takes the same document without whitespace, and only so
    potential = JsonSchema(schema)
    assert asyncio.run(potential.complete(compact.encode())) == 0.0
    assert asyncio.run(potential.complete(bad.encode())) == float("-inf")
    if compact != good:
        assert asyncio.run(potential.complete(good.encode())) == float("-inf")


def test_potential_twist_scores_decoded_prefixes():
    from genlm import control as genlm

    from smc_sd.programs.twisted import potential_twist

    target, draft = target_and_draft()
    twist = potential_twist(genlm.BoolFSA.from_regex("|".join(LANGUAGE)), target)
    assert twist([[0], [1, 2], [1, 0], [2, 1, 1]]).tolist() == [0.0, 0.0, -math.inf, 0.0]


@pytest.mark.parametrize("kind", ["draft LM", "free"])
def test_block_end_potential_composes_with_a_constraint(kind):
    from smc_sd.constraints.scores import FunctionPotential

    target, draft = target_and_draft(noise=1.0)
    constraint = language_constraint(("ab", "ba", "bb", "cab", "a", "cc"))

    def log_phi(x, complete):
        # a soft preference against "b", and a bonus for finishing
        return -1.5 * x.count(1) + (0.5 if complete else 0.0)

    conditional, _ = target.completion_distribution(PROMPT, MAX_TOKENS, constraint=constraint)
    weighted = {x: p * math.exp(log_phi(x[:-1] if x[-1] == 3 else x, x[-1] == 3)) for x, p in conditional.items()}
    exact = {x: w / sum(weighted.values()) for x, w in weighted.items()}
    runs = 1000
    tolerance = tv_tolerance(exact, runs)
    assert total_variation(exact, conditional) > tolerance + 0.05
    program = smc_speculative.program(target, constraints=(constraint,), potentials=(FunctionPotential(log_phi),), **proposal(draft, kind, 2))
    samples = sample_completions(program, Schedule(64, max_tokens=MAX_TOKENS), runs)
    assert total_variation(empirical(samples), exact) < tolerance
