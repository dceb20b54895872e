"""The batched engine on toy LMs with exact distributions.

The strongest law is identity: every request draws from its own generator, in the order
`Program.run` draws, from logits equal to its rows' own, so a request batched with requests of
other settings (N, K, alpha, constraints, twists, exact sd, other prompts, joining and leaving
mid-way) returns exactly what `Program.run` returns with its seed: the same particles, weights,
log Z_hat and choice. Then the laws `Program.run` is tested for hold batched (TV to the exact
target within `tv_tolerance`, a z-test of Z_hat), the stop strings' law, the streaming contract,
and every slot, row and KV block returns when requests finish, fail or are cancelled.
"""

import math
from concurrent.futures import CancelledError

import pytest
import torch

from smc_sd.backends.dry_run import DryRunLM
from smc_sd.backends.toy import ToyLM
from smc_sd.engine.batch import BatchEngine, QueueFullError, Request, run_many
from smc_sd.engine.result import AllParticlesDiedError
from smc_sd.metrics import empirical, total_variation, tv_tolerance
from smc_sd.program import Schedule
from smc_sd.programs import autoregressive, mask_at_verify, smc_speculative, speculative
from tests.test_constraints import in_language, language_constraint
from tests.toy_programs import PROMPT, target_and_draft


def same(a, b) -> bool:
    """Two Results agree on everything random: particles, weights, log Z_hat, choice, trace."""
    return (
        a.particles == b.particles
        and a.finished == b.finished
        and torch.equal(a.log_weights, b.log_weights)
        and (a.log_ml == b.log_ml or (math.isnan(a.log_ml) and math.isnan(b.log_ml)))
        and a.chosen == b.chosen
        and a.complete == b.complete
        and [(c.ess, c.resampled, c.tokens, c.rows, c.accepted) for c in a.cycles]
        == [(c.ess, c.resampled, c.tokens, c.rows, c.accepted) for c in b.cycles]
    )


def mixed_requests(target, draft, count: int) -> list[Request]:
    """Requests of many settings and prompts of several lengths."""

    def twist(prefixes):
        return torch.tensor([0.3 * sum(t == 1 for t in p) for p in prefixes], dtype=torch.float64)

    constraint = language_constraint()
    menu = [
        (smc_speculative.program(target, draft, draft_len=2), Schedule(4, max_tokens=7)),
        (smc_speculative.program(target, draft, draft_len=3, alpha=2.0), Schedule(3, ess_threshold=0.9, max_tokens=6)),
        (autoregressive.program(target), Schedule(1, max_tokens=5)),
        (autoregressive.program(target, temperature=0.7), Schedule(5, resampling="multinomial", max_tokens=6)),
        (speculative.program(target, draft, draft_len=2), Schedule(1, max_tokens=8)),
        (speculative.program(target, draft, draft_len=4, temperature=0.8, draft_temperature=1.2), Schedule(1, max_tokens=6)),
        (smc_speculative.program(target, draft, draft_len=2, constraints=(constraint,)), Schedule(6, max_tokens=4)),
        (mask_at_verify.program(target, draft, draft_len=1, constraints=(constraint,)), Schedule(1, max_tokens=4)),
        (smc_speculative.program(target, draft, draft_len=1, twist=twist), Schedule(8, ess_threshold=1.0, max_tokens=6)),
    ]
    prompts = [PROMPT, [1, 2, 0], [2], [0, 1, 1, 2, 0, 1]]
    return [Request(prompts[i % len(prompts)], *menu[i % len(menu)], seed=i) for i in range(count)]


def run_all(engine: BatchEngine, requests, on_event=None):
    handles = [engine.submit(r, on_event) for r in requests]
    while engine.step():
        engine.table.check_invariants()
    return handles


def outcome(handle):
    try:
        return handle.result(0)
    except Exception as error:
        return error


def alone(request: Request):
    try:
        return request.program.run(request.prompt, request.schedule, seed=request.seed)
    except Exception as error:
        return error


def assert_same_outcome(batched, single):
    if isinstance(single, Exception):
        assert type(batched) is type(single) and str(batched) == str(single)
        if isinstance(single, AllParticlesDiedError):
            assert same(batched.partial, single.partial)
    else:
        assert not isinstance(batched, Exception), batched
        assert same(batched, single)


@pytest.mark.parametrize("max_running", [1, 3, 16])
def test_each_request_of_a_mixed_batch_returns_what_program_run_returns(max_running):
    target, draft = target_and_draft(noise=1.0)
    requests = mixed_requests(target, draft, 45)
    # few slots, so requests also wait for room and join mid-way
    engine = BatchEngine(target, draft, max_running=max_running, max_slots=20)
    handles = run_all(engine, requests)
    for request, handle in zip(requests, handles):
        assert_same_outcome(outcome(handle), alone(request))
    assert engine.table.free == 20 and engine.target_rows.rows is None and engine.draft_rows.rows is None


def test_run_many_equals_program_run_for_every_seed():
    target, draft = target_and_draft(noise=1.0)
    program = smc_speculative.program(target, draft, draft_len=3)
    schedule = Schedule(4, max_tokens=9)
    prompts = [PROMPT, [1, 2], [2, 2, 2, 1]] * 5
    results = program.run_many(prompts, schedule, seeds=list(range(15)), max_running=4)
    for s, (prompt, result) in enumerate(zip(prompts, results)):
        assert same(result, program.run(prompt, schedule, seed=s))
    # Program.run's default seed
    assert same(program.run_many([PROMPT], schedule)[0], program.run(PROMPT, schedule))


def test_a_backend_without_ragged_rows_serves_one_request_at_a_time_with_the_same_results():
    toy_target, toy_draft = target_and_draft(noise=1.0)
    target, draft = DryRunLM(toy_target, 8, 2), DryRunLM(toy_draft, 8, 2)
    requests = mixed_requests(target, draft, 12)
    engine = BatchEngine(target, draft, max_running=4)
    running = []
    handles = [engine.submit(r) for r in requests]
    while engine.step():
        running.append(engine.stats()["requests_running"])
    assert max(running) == 1
    for request, handle in zip(requests, handles):
        assert_same_outcome(outcome(handle), alone(request))
    for lm in (target, draft):
        assert lm.manager.pool.live == 0 and len(lm.manager.trie) == 0
