"""Free drafts in the batched engine, beside requests of other methods and settings.

The strongest law first: a free-draft request (sd, mask-at-verify and smc-sd with the free draft)
draws from its own generator, with its own lookup state, from logits equal to its rows' own, so
batched among requests of other kinds it returns exactly what `Program.run` returns with its
seed: particles, weights, log Z_hat, choice and trace. Then the methods' laws, sampled through
the engine with neighbours running beside every request: sd with the free draft samples p_T,
mask-at-verify the local projection, smc-sd reaches the global conditional with an unbiased
Z_hat. TV tolerances come from `tv_tolerance` (failure 1e-6 when exact); Z_hat's test is 5
standard errors.
"""

import functools

import pytest

from smc_sd.backends.dry_run import DryRunLM
from smc_sd.backends.toy import ToyLM
from smc_sd.engine.batch import BatchEngine, Request
from smc_sd.metrics import empirical, total_variation, tv_tolerance
from smc_sd.program import FreeDraft, Schedule
from smc_sd.constraints.grammars import JsonSchema, Regex
from smc_sd.constraints.potentials import as_token_constraint
from smc_sd.programs import autoregressive, mask_at_verify, smc_speculative, speculative
from smc_sd.serve.errors import run_failed
from tests.test_batch_engine import alone, assert_same_outcome, outcome
from tests.test_constraints import MAX_TOKENS as LANGUAGE_TOKENS, language_constraint
from tests.test_free_drafts import (
    LOOKUP,
    REPEATING_PROMPT,
    WORDS_PROMPT,
    assert_smc_sd_free_reaches_the_conditional,
    assert_smc_sd_free_z_hat_is_unbiased,
)
from tests.test_llguidance import WordLM
from tests.toy_programs import PROMPT, target_and_draft


def free_and_other_requests(target, draft, count: int) -> list[Request]:
    """Free-draft requests of every method among requests of other methods and settings."""
    constraint = language_constraint()
    forced = FreeDraft(min_match=1, max_len=3)
    menu = [
        (speculative.program(target, None, free_draft=LOOKUP), Schedule(1, max_tokens=8)),
        (smc_speculative.program(target, draft, draft_len=2), Schedule(4, max_tokens=7)),
        (smc_speculative.program(target, None, free_draft=LOOKUP), Schedule(4, max_tokens=7)),
        (autoregressive.program(target, temperature=0.7), Schedule(3, resampling="multinomial", max_tokens=6)),
        (smc_speculative.program(target, None, constraints=(constraint,), free_draft=LOOKUP), Schedule(6, ess_threshold=0.9, max_tokens=LANGUAGE_TOKENS)),
        (speculative.program(target, draft, draft_len=3), Schedule(1, max_tokens=8)),
        (mask_at_verify.program(target, None, constraints=(constraint,), free_draft=forced), Schedule(1, max_tokens=LANGUAGE_TOKENS)),
        (smc_speculative.program(target, None, free_draft=FreeDraft(forced=False, min_match=2, max_len=5), temperature=0.8, alpha=2.0), Schedule(5, ess_threshold=1.0, max_tokens=6)),
        (speculative.program(target, None, temperature=0.0, free_draft=LOOKUP), Schedule(1, max_tokens=6)),
        (mask_at_verify.program(target, draft, draft_len=1, constraints=(constraint,)), Schedule(1, max_tokens=4)),
        (speculative.program(target, draft, draft_len=2, free_draft=LOOKUP), Schedule(1, max_tokens=9)),
        (mask_at_verify.program(target, draft, draft_len=3, constraints=(constraint,), free_draft=forced), Schedule(1, max_tokens=LANGUAGE_TOKENS)),
        (smc_speculative.program(target, draft, draft_len=2, constraints=(constraint,), free_draft=forced), Schedule(5, ess_threshold=0.8, max_tokens=LANGUAGE_TOKENS)),
        (smc_speculative.program(target, draft, draft_len=3, free_draft=LOOKUP), Schedule(4, max_tokens=8)),
    ]
    prompts = [REPEATING_PROMPT, WORDS_PROMPT, PROMPT, [2], [0, 1, 1, 2, 0, 1], [1, 2, 0, 1, 2, 0, 1, 2]]
    return [Request(prompts[i % len(prompts)], *menu[i % len(menu)], seed=i) for i in range(count)]


def assert_batched_as_alone(engine: BatchEngine, requests: list[Request]) -> list:
    """Run the requests through the engine (checking its invariants every cycle); each
    outcome must be `Program.run`'s with its seed. Returns the runs alone."""
    handles = [engine.submit(r) for r in requests]
    while engine.step():
        engine.table.check_invariants()
    singles = [alone(request) for request in requests]
    for single, handle in zip(singles, handles):
        assert_same_outcome(outcome(handle), single)
    return singles


@pytest.mark.parametrize("max_running", [1, 4, 16])
def test_each_free_draft_request_returns_what_program_run_returns(max_running):
    target, draft = target_and_draft(noise=1.0)
    requests = free_and_other_requests(target, draft, 60)
    # few slots, so requests also wait for room and join mid-way
    engine = BatchEngine(target, draft, max_running=max_running, max_slots=24)
    singles = assert_batched_as_alone(engine, requests)
    proposed = 0
    for request, single in zip(requests, singles):
        if request.program.proposal is not None and request.program.proposal.free is not None:
            proposed += sum(c.proposed or 0 for c in single.cycles)
    # the free drafts proposed, so the comparison covered rows of different lengths
    assert proposed > 30
    assert engine.table.free == 24 and engine.target_rows.rows is None and engine.draft_rows.rows is None


def test_copies_share_one_computed_row():
    # resampling at every cycle makes copies: particles holding equal tokens
    target, _ = target_and_draft(noise=1.0)
    program = smc_speculative.program(target, None, free_draft=LOOKUP)
    computed, running = 0, 0
    for seed in range(5):
        request = Request(REPEATING_PROMPT, program, Schedule(8, ess_threshold=1.0, max_tokens=6), seed=seed)
        engine = BatchEngine(target, None, max_running=2)
        handle = engine.submit(request)
        while engine.step():
            if engine._running:
                live, seated, _ = engine._running[0].group.seats()
                # the rows held are the distinct running particles' only
                assert engine.target_rows.size == seated.numel()
                computed, running = computed + seated.numel(), running + live.numel()
        assert_same_outcome(handle.result(0), alone(request))
    assert computed < running


def batched_runs(program, prompt: list[int], schedule: Schedule, n: int, max_running: int = 24):
    """`batched_samples` with the program's draft LM, or one near its target, for the neighbours."""
    target, draft = program.target.lm, program.proposal.lm
    return batched_samples(target, draft or ToyLM.perturbed(target, 1.0), program, prompt, schedule, n, max_running)


def batched_samples(target, draft, program, prompt: list[int], schedule: Schedule, n: int, max_running: int = 24):
    """Results of n seeded runs of `program` through one engine, each beside a neighbour of
    another method (exact sd with an LM draft, then SMC-SD with it, alternately)."""
    neighbours = [
        (speculative.program(target, draft, draft_len=2), Schedule(1, max_tokens=5)),
        (smc_speculative.program(target, draft, draft_len=1, alpha=2.0), Schedule(3, max_tokens=4)),
    ]
    engine = BatchEngine(target, draft, max_running=max_running, max_waiting=2 * n, max_slots=max_running * max(schedule.particles, 3))
    handles = []
    for seed in range(n):
        handles.append(engine.submit(Request(prompt, program, schedule, seed=seed)))
        engine.submit(Request([1, 2, 0], *neighbours[seed % 2], seed=seed))
    while engine.step():
        pass
    return [handle.result(0) for handle in handles]


def test_batched_sd_with_a_lookup_draft_samples_the_target():
    target, draft = target_and_draft(noise=2.0)
    max_tokens, n = 4, 3000
    results = batched_samples(target, draft, speculative.program(target, None, free_draft=LOOKUP), REPEATING_PROMPT, Schedule(1, max_tokens=max_tokens), n)
    proposed = sum(c.proposed or 0 for r in results for c in r.cycles)
    accepted = sum(c.accepted or 0 for r in results for c in r.cycles)
    assert proposed > n // 4 and 0 < accepted < proposed
    exact, _ = target.completion_distribution(REPEATING_PROMPT, max_tokens)
    assert total_variation(empirical([tuple(r.tokens) for r in results]), exact) < tv_tolerance(exact, n)


def test_batched_mask_at_verify_with_forced_tokens_samples_the_local_projection():
    # "()" is forced at the start and after every pair; "(" then ")" spells it too
    lm = WordLM(["(", ")", "()", "(("], seed=2)
    constraint = Regex(r"(\(\))+")
    max_tokens, n = 4, 3000
    program = mask_at_verify.program(lm, None, constraints=(constraint,), free_draft=FreeDraft(min_match=1, max_len=3))
    # neighbours on the same model: constrained ar with several particles, and plain ar
    engine = BatchEngine(lm, None, max_running=24, max_waiting=2 * n, max_slots=24 * 3)
    handles = []
    for seed in range(n):
        handles.append(engine.submit(Request([0], program, Schedule(1, max_tokens=max_tokens), seed=seed)))
        other = autoregressive.program(lm, constraints=(constraint,)) if seed % 2 else autoregressive.program(lm, temperature=0.5)
        engine.submit(Request([1, 0], other, Schedule(3, max_tokens=3), seed=seed))
    while engine.step():
        pass
    results = [handle.result(0) for handle in handles]
    proposed = sum(c.proposed or 0 for r in results for c in r.cycles)
    accepted = sum(c.accepted or 0 for r in results for c in r.cycles)
    assert proposed > n // 4 and 0 < accepted < proposed
    exact, _ = lm.completion_distribution([0], max_tokens, constraint=as_token_constraint(constraint, lm), local=True)
    assert total_variation(empirical([tuple(r.tokens) for r in results]), exact) < tv_tolerance(exact, n)


@pytest.mark.parametrize("with_lm", [False, True])
def test_batched_smc_sd_with_a_free_draft_reaches_the_conditional(with_lm):
    assert_smc_sd_free_reaches_the_conditional(functools.partial(batched_runs, max_running=8), with_lm)


@pytest.mark.parametrize("ess_threshold, with_lm", [(1.0, False), (0.5, False), (0.5, True)])
def test_batched_smc_sd_with_a_free_draft_has_an_unbiased_z_hat(ess_threshold, with_lm):
    assert_smc_sd_free_z_hat_is_unbiased(batched_runs, ess_threshold, n=2000, with_lm=with_lm)


def test_a_backend_with_rows_of_one_length_serves_sd_free_and_refuses_smc_sd_free_in_one_line():
    toy_target, _ = target_and_draft(noise=1.0)
    target = DryRunLM(toy_target, 8, 2)
    sd = Request(REPEATING_PROMPT, speculative.program(target, None, free_draft=LOOKUP), Schedule(1, max_tokens=8), seed=1)
    smc = Request(REPEATING_PROMPT, smc_speculative.program(target, None, free_draft=LOOKUP), Schedule(4, max_tokens=6), seed=2)
    ar = Request([1, 2, 0], autoregressive.program(target), Schedule(2, max_tokens=5), seed=3)
    engine = BatchEngine(target, None, max_running=4)
    handles = [engine.submit(r) for r in (sd, smc, ar, smc)]
    while engine.step():
        pass
    assert engine.dead is None
    for request, handle in zip((sd, ar), (handles[0], handles[2])):
        assert_same_outcome(outcome(handle), alone(request))
    for handle in (handles[1], handles[3]):
        error = outcome(handle)
        assert isinstance(error, ValueError) and "rows of different lengths" in str(error) and "\n" not in str(error)
        # the server answers it as bad input, not as its own failure
        assert run_failed(error).status == 400
    assert target.manager.pool.live == 0
    # once the engine has seen rows of one length, it refuses such a request before it queues
    with pytest.raises(ValueError, match="rows of different lengths"):
        engine.check(smc)


def test_batched_smc_sd_with_a_free_draft_checks_an_over_approximated_schema_exactly():
    # oneOf read as anyOf lets 10..20 (in both branches) through the masks; the exact check at
    # completion removes them from the target, with the free draft as with a draft model
    schema = {"oneOf": [{"type": "integer", "minimum": 10}, {"type": "integer", "maximum": 20}]}
    target = WordLM(["1", "2", "0"], seed=7)
    draft = ToyLM.perturbed(target, 1.0)
    potential = JsonSchema(schema)
    budget, runs = 3, 300
    masked, _ = target.completion_distribution(PROMPT, budget, constraint=as_token_constraint(potential, target))
    valid = {x: p for x, p in masked.items() if potential.exact_check(target.decode(list(x)).encode())}
    exact = {x: p / sum(valid.values()) for x, p in valid.items()}
    tolerance = tv_tolerance(exact, runs)
    assert total_variation(masked, exact) > tolerance + 0.05
    program = smc_speculative.program(target, None, constraints=(potential,), free_draft=FreeDraft())
    results = batched_samples(target, draft, program, PROMPT, Schedule(16, max_tokens=budget), runs, max_running=8)
    assert all(r.complete for r in results)
    assert total_variation(empirical([tuple(r.tokens) for r in results]), exact) < tolerance


def test_sd_with_a_free_draft_beside_a_draft_model_returns_what_program_run_returns():
    # free+NAME: the free draft's blocks where it proposes, the draft model's elsewhere; the
    # draft model's row catches up after free blocks while other requests draft beside it
    target, draft = target_and_draft(noise=1.0)
    free_and_lm = speculative.program(target, draft, draft_len=2, free_draft=LOOKUP)
    neighbour = smc_speculative.program(target, draft, draft_len=3)
    requests = []
    for seed in range(16):
        requests.append(Request(PROMPT, free_and_lm, Schedule(1, max_tokens=14), seed=seed))
        requests.append(Request([1, 2, 0], neighbour, Schedule(3, max_tokens=8), seed=seed))
    engine = BatchEngine(target, draft, max_running=8, max_slots=32)
    singles = assert_batched_as_alone(engine, requests)
    mixed = 0
    for request, single in zip(requests, singles):
        if request.program is free_and_lm:
            lm_cycles = single.draft_passes // 2
            mixed += 0 < lm_cycles < len(single.cycles)
    # most runs alternated between free blocks and the draft model's
    assert mixed >= 8
    assert engine.draft_rows.rows is None and engine.target_rows.rows is None
