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
from smc_sd.engine.batch import BatchEngine, QueueFullError, Request
from smc_sd.engine.result import AllParticlesDiedError
from smc_sd.metrics import empirical, total_variation, tv_tolerance
from smc_sd.program import FreeDraft, Schedule
from smc_sd.programs import autoregressive, mask_at_verify, smc_speculative, speculative
from tests.test_constraints import in_language, language_constraint, word
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
        and a.cycles == b.cycles
        and (a.target_passes, a.draft_passes) == (b.target_passes, b.draft_passes)
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


def test_requests_drafting_with_different_draft_models_share_the_target_pass():
    target, draft = target_and_draft(noise=1.0)
    other = ToyLM.perturbed(target, 2.5, seed=11)
    requests = mixed_requests(target, draft, 18) + mixed_requests(target, other, 18)
    requests = [r for pair in zip(requests[:18], requests[18:]) for r in pair]
    engine = BatchEngine(target, [draft, other], max_running=8, max_slots=40)
    handles = run_all(engine, requests)
    for request, handle in zip(requests, handles):
        assert_same_outcome(outcome(handle), alone(request))
    assert engine.table.free == 40 and engine.target_rows.rows is None and all(rows.rows is None for rows in engine.draft_sets)
    with pytest.raises(ValueError, match="not one of the engine's drafts"):
        engine.submit(Request(PROMPT, speculative.program(target, ToyLM.perturbed(target, 1.0)), Schedule(1)))


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
        assert lm.manager.pool.live == 0 and len(lm.manager.trie) == lm.manager.pool.cached


# --- the laws Program.run is tested for, batched among requests of other settings -------------


def test_batched_requests_keep_their_laws_among_requests_of_other_settings():
    target, draft = target_and_draft(noise=1.0)
    constraint = language_constraint()
    laws = {
        # name: (program, schedule, runs)
        "target": (smc_speculative.program(target, draft, draft_len=3), Schedule(64, max_tokens=4), 2000),
        "power": (smc_speculative.program(target, draft, alpha=2.0, draft_len=2), Schedule(64, max_tokens=3), 2000),
        "conditional": (smc_speculative.program(target, draft, draft_len=2, constraints=(constraint,)), Schedule(16, max_tokens=4), 300),
        "z_hat": (smc_speculative.program(target, draft, alpha=2.0, draft_len=2), Schedule(4, ess_threshold=1.0, max_tokens=5), 3000),
    }
    exact = {
        "target": target.completion_distribution(PROMPT, 4)[0],
        "power": target.completion_distribution(PROMPT, 3, alpha=2.0)[0],
        "conditional": target.completion_distribution(PROMPT, 4, constraint=constraint)[0],
    }
    z = math.exp(target.completion_distribution(PROMPT, 5, alpha=2.0)[1])
    noise = mixed_requests(target, draft, 9)
    requests, names = [], []
    for i in range(max(runs for _, _, runs in laws.values())):
        for name, (program, schedule, runs) in laws.items():
            if i < runs:
                requests.append(Request(PROMPT, program, schedule, seed=i))
                names.append(name)
        # requests of other settings and prompts in between
        requests.append(noise[i % len(noise)])
        names.append("noise")
    engine = BatchEngine(target, draft, max_running=48, max_waiting=len(requests), max_slots=48 * 64)
    results = [h.result(0) for h in run_all(engine, requests)]
    samples = {name: [tuple(r.tokens) for r, n in zip(results, names) if n == name] for name in laws}
    for name, law in exact.items():
        assert total_variation(empirical(samples[name]), law) < tv_tolerance(law, len(samples[name])), name
    assert all(in_language(x) for x in samples["conditional"])
    z_hats = [math.exp(r.log_ml) for r, n in zip(results, names) if n == "z_hat"]
    mean = sum(z_hats) / len(z_hats)
    std_error = math.sqrt(sum((x - mean) ** 2 for x in z_hats) / (len(z_hats) - 1) / len(z_hats))
    # 5 standard errors: a false alarm has probability ~1e-6 under the CLT
    assert abs(mean - z) < 5 * std_error and std_error < 0.05 * z


def stopped_distribution(law: dict, stop: str, decode) -> dict:
    """The law of completions cut at the token that first completes `stop` in their text."""
    out: dict = {}
    for x, p in law.items():
        cut = next((x[: c + 1] for c in range(len(x)) if stop in decode(list(x[: c + 1]))), x)
        out[cut] = out.get(cut, 0.0) + p
    return out


def test_stop_strings_end_particles_at_the_token_that_completes_them():
    target, draft = target_and_draft(noise=1.0)
    stop, max_tokens = "ba", 5
    law = stopped_distribution(target.completion_distribution(PROMPT, max_tokens)[0], stop, target.decode)
    assert sum(p for x, p in law.items() if target.decode(list(x)).endswith(stop)) > 0.2
    programs = [
        (autoregressive.program(target), Schedule(1, max_tokens=max_tokens), 3000),
        (speculative.program(target, draft, draft_len=3), Schedule(1, max_tokens=max_tokens), 3000),
        (smc_speculative.program(target, draft, draft_len=3), Schedule(32, max_tokens=max_tokens), 2000),
    ]
    for program, schedule, runs in programs:
        engine = BatchEngine(target, draft, max_running=32, max_waiting=runs, max_slots=32 * 32)
        handles = run_all(engine, [Request(PROMPT, program, schedule, seed=s, stop=(stop,)) for s in range(runs)])
        results = [h.result(0) for h in handles]
        for result in results:
            for tokens, finished in zip(result.particles, result.finished):
                text = target.decode(tokens)
                # a stop string only at the end, and a particle that ends with one has finished
                assert stop not in text[:-1] and (finished or not text.endswith(stop))
        samples = [tuple(r.tokens) for r in results]
        assert total_variation(empirical(samples), law) < tv_tolerance(law, runs), program.name


def test_a_stop_string_under_a_constraint_is_part_of_the_constrained_text():
    # pi(y) ∝ p_T(y) 1[y complete in L] over strings that end at EOS or at their first "b":
    # "ab" and "cb" end at the stop string inside L; "cabc" ends at its first "b" as "cab",
    # outside L, so it gets weight zero
    target, draft = target_and_draft(noise=1.0)
    language, stop, max_tokens = ("a", "ab", "cabc", "cb", "cc"), "b", 4
    constraint = language_constraint(language)
    law = stopped_distribution(target.completion_distribution(PROMPT, max_tokens)[0], stop, target.decode)
    valid = {x: p for x, p in law.items() if word([t for t in x if t != 3]) in language and (x[-1] == 3) != target.decode(list(x)).endswith(stop)}
    exact = {x: p / sum(valid.values()) for x, p in valid.items()}
    assert {target.decode(list(x)) for x in exact} == {"a", "ab", "cb", "cc"}
    runs = 600
    for program in (
        smc_speculative.program(target, draft, draft_len=2, constraints=(constraint,)),
        smc_speculative.program(target, None, constraints=(constraint,), free_draft=FreeDraft(min_match=1, max_len=3)),
    ):
        engine = BatchEngine(target, draft, max_running=32, max_waiting=runs, max_slots=32 * 16)
        handles = run_all(engine, [Request(PROMPT, program, Schedule(16, max_tokens=max_tokens), seed=s, stop=(stop,)) for s in range(runs)])
        results = [h.result(0) for h in handles]
        assert all(r.complete for r in results) and any(target.decode(p) == "cab" for r in results for p in r.particles)
        assert total_variation(empirical([tuple(r.tokens) for r in results]), exact) < tv_tolerance(exact, runs), program.proposal
    # one sequence: a string that ends at a stop string outside the language is not complete
    program = mask_at_verify.program(target, draft, draft_len=2, constraints=(constraint,))
    engine = BatchEngine(target, draft, max_running=32, max_waiting=runs, max_slots=32)
    for handle in run_all(engine, [Request(PROMPT, program, Schedule(1, max_tokens=max_tokens), seed=s, stop=(stop,)) for s in range(200)]):
        result = handle.result(0)
        assert result.complete == (word([t for t in result.tokens if t != 3]) in language)


# --- streaming, cancellation, failures, refusals ----------------------------------------------


def test_agreed_tokens_only_grow_and_the_result_completes_them():
    target, draft = target_and_draft(noise=1.0)
    requests = mixed_requests(target, draft, 18)
    events: dict[int, list] = {i: [] for i in range(len(requests))}
    engine = BatchEngine(target, draft, max_running=5)
    handles = [engine.submit(r, on_event=events[i].append) for i, r in enumerate(requests)]
    while engine.step():
        pass
    for i, handle in enumerate(handles):
        kinds = [e.kind for e in events[i]]
        assert kinds[-1] == "done" and set(kinds[:-1]) <= {"tokens"}
        streamed = [e.stable_tokens for e in events[i][:-1]]
        final = events[i][-1]
        assert final.result is handle.result(0) and final.stable_tokens == final.result.tokens
        for before, after in zip(streamed, streamed[1:] + [final.stable_tokens]):
            assert len(after) > len(before) or after is final.stable_tokens
            assert after[: len(before)] == before


def test_cancelled_and_failing_requests_leave_and_free_everything_without_touching_the_others():
    target, draft = target_and_draft(noise=1.0)
    requests = mixed_requests(target, draft, 12)
    # every prefix has twist psi = 0: all weights reach zero at the first block end
    dying = Request(PROMPT, smc_speculative.program(target, draft, twist=lambda p: torch.full((len(p),), -math.inf)), Schedule(4, max_tokens=6))
    unsatisfiable = Request(PROMPT, smc_speculative.program(target, draft, constraints=(language_constraint((), lambda x: False),)), Schedule(4))
    engine = BatchEngine(target, draft, max_running=6)
    events: list = []
    cancelled_early = engine.submit(Request([1, 2], requests[0].program, requests[0].schedule, seed=3), events.append)
    cancelled_running = engine.submit(Request([2, 0], requests[0].program, Schedule(8, max_tokens=30), seed=5), events.append)
    handles = [engine.submit(r) for r in requests[:6]]
    failing = [engine.submit(dying), engine.submit(unsatisfiable)]
    handles += [engine.submit(r) for r in requests[6:]]
    cancelled_early.cancel()
    engine.step()
    engine.step()
    assert not cancelled_running.done
    cancelled_running.cancel()
    while engine.step():
        engine.table.check_invariants()
    for handle in (cancelled_early, cancelled_running):
        with pytest.raises(CancelledError):
            handle.result(0)
    assert [e.kind for e in events].count("error") == 2 and all(isinstance(e.error, CancelledError) for e in events if e.kind == "error")
    assert_same_outcome(outcome(failing[0]), alone(dying))
    assert_same_outcome(outcome(failing[1]), alone(unsatisfiable))
    for request, handle in zip(requests, handles):
        assert_same_outcome(outcome(handle), alone(request))
    assert engine.table.free == engine.table.max_slots and engine.target_rows.rows is None and engine.draft_rows.rows is None
    stats = engine.stats()
    assert stats["requests_running"] == stats["requests_waiting"] == stats["kv_blocks_in_use"] == 0 and math.isnan(stats["ess_mean"])


def test_a_failing_backend_kills_the_engine_and_every_request_hears_of_it():
    target, draft = target_and_draft(noise=1.0)

    class Broken(ToyLM):
        def open(self, prompt, batch_size):
            raise RuntimeError("the device fell off")

    broken = Broken(target.logits, 4)
    program = smc_speculative.program(broken, draft)
    engine = BatchEngine(broken, draft)
    handles = [engine.submit(Request(PROMPT, program, Schedule(2, max_tokens=4), seed=s)) for s in range(3)]
    with pytest.raises(RuntimeError, match="fell off"):
        engine.step()
    assert isinstance(engine.dead, RuntimeError)
    for handle in handles:
        with pytest.raises(RuntimeError, match="fell off"):
            handle.result(0)
    with pytest.raises(RuntimeError, match="stopped after an error"):
        engine.submit(Request(PROMPT, program, Schedule(2)))


def test_bad_requests_are_refused_before_they_join():
    target, draft = target_and_draft(noise=1.0)
    other = ToyLM.random(4, seed=9)
    engine = BatchEngine(target, draft, max_running=2, max_waiting=1, max_slots=8)
    program = smc_speculative.program(target, draft)
    cases = [
        (Request([], program, Schedule(2)), ValueError, "prompt is empty"),
        (Request(PROMPT, autoregressive.program(other), Schedule(1)), ValueError, "not the engine's target"),
        (Request(PROMPT, smc_speculative.program(target, other), Schedule(2)), ValueError, "not one of the engine's drafts"),
        (Request(PROMPT, program, Schedule(9)), ValueError, "9 particles exceed the engine's 8"),
        (Request(PROMPT, program, Schedule(2), stop=("",)), ValueError, "non-empty"),
        (Request(PROMPT, program, Schedule(2, max_tokens=300)), ValueError, "context window"),
        (Request(PROMPT, program, Schedule(0)), ValueError, "particles must be >= 1"),
    ]
    for request, error, message in cases:
        with pytest.raises(error, match=message):
            engine.check(request)
        with pytest.raises(error, match=message):
            engine.submit(request)
    engine.submit(Request(PROMPT, program, Schedule(2)))
    with pytest.raises(QueueFullError, match="1 requests are waiting"):
        engine.submit(Request(PROMPT, program, Schedule(2)))


# --- the paged HF backend: a random tiny Llama, its KV in a shared block pool -----------------


@pytest.fixture(scope="module")
def llamas():
    from tests.tiny_llama import lm, tiny_llama

    # tiny blocks, so prompts span several blocks and share full ones
    return lm(tiny_llama(seed=0), block_size=2), lm(tiny_llama(seed=1, layers=1), block_size=2)


def llama_requests(target, draft) -> list[Request]:
    system = [3, 1, 4, 1, 5, 9, 2]
    menu = [
        (smc_speculative.program(target, draft, draft_len=2), Schedule(3, max_tokens=10)),
        (autoregressive.program(target), Schedule(1, max_tokens=8)),
        (speculative.program(target, draft, draft_len=3), Schedule(1, max_tokens=10)),
        (smc_speculative.program(target, draft, draft_len=1, alpha=2.0), Schedule(2, max_tokens=9)),
    ]
    return [Request(system + [10 + i] * (1 + i % 3), *menu[i % len(menu)], seed=i) for i in range(8)]


def test_paged_hf_batch_matches_program_run_and_returns_every_block(llamas):
    target, draft = llamas
    requests = llama_requests(target, draft)
    engine = BatchEngine(target, draft, max_running=8)
    handles = [engine.submit(r) for r in requests]
    engine.admit()
    # the system prompt's 3 full blocks are stored once: every row of every request lists them
    for rows in (engine.target_rows, engine.draft_rows):
        assert len({tuple(row) for row in rows.rows._table.blocks[:, :3].tolist()}) == 1
    while engine.step():
        for lm in llamas:
            lm._paged.manager.check_invariants(*[rows.rows._table for rows in (engine.target_rows, engine.draft_rows) if rows.rows is not None and rows.lm is lm])
    for request, handle in zip(requests, handles):
        batched, single = handle.result(0), alone(request)
        assert batched.particles == single.particles and batched.chosen == single.chosen
        assert torch.allclose(batched.log_weights, single.log_weights, atol=1e-4) and abs(batched.log_ml - single.log_ml) < 1e-4
        # its KV statistics are its own rows', as alone: the blocks it shares with the others
        # count for it, the others' own blocks do not
        assert batched.kv == single.kv and batched.kv["scope"] == "request"
        assert 0 < batched.kv["peak_bytes"] <= batched.kv["naive_peak_bytes"] + target._paged.manager.bytes_per_block * 2 * request.schedule.particles
    for lm in llamas:
        assert lm._paged.manager.pool.live == 0 and len(lm._paged.manager.trie) == lm._paged.manager.pool.cached


def test_paged_hf_a_cancelled_request_returns_its_blocks(llamas):
    target, draft = llamas
    kept = Request([3, 1, 4, 1, 5, 9, 2, 6], smc_speculative.program(target, draft, draft_len=2), Schedule(3, max_tokens=24), seed=1)
    cancelled = Request([3, 1, 4, 1, 5, 9, 7, 7, 7], smc_speculative.program(target, draft, draft_len=3), Schedule(4, max_tokens=24), seed=2)

    def blocks_per_step(requests, cancel_at=None):
        engine = BatchEngine(target, draft)
        handles = [engine.submit(r) for r in requests]
        blocks = []
        while engine.step():
            blocks.append(engine.stats()["kv_blocks_in_use"])
            if len(blocks) == cancel_at:
                handles[-1].cancel()
        return blocks, handles

    alone_blocks, _ = blocks_per_step([kept])
    blocks, handles = blocks_per_step([kept, cancelled], cancel_at=3)
    assert blocks[2] > alone_blocks[2], "the second request held no blocks of its own"
    # from the step after the cancellation on, only the kept request's blocks are in use
    assert blocks[3:] == alone_blocks[3:]
    with pytest.raises(CancelledError):
        handles[1].result(0)
    assert handles[0].result(0).particles == kept.program.run(kept.prompt, kept.schedule, seed=1).particles


def test_the_loop_thread_serves_requests_submitted_from_other_threads():
    import threading

    target, draft = target_and_draft(noise=1.0)
    requests = mixed_requests(target, draft, 20)
    engine = BatchEngine(target, draft, max_running=4)
    stop = threading.Event()
    loop = threading.Thread(target=engine.run_forever, args=(stop,))
    loop.start()
    try:
        handles = [None] * len(requests)

        def submit(i):
            handles[i] = engine.submit(requests[i])

        submitters = [threading.Thread(target=submit, args=(i,)) for i in range(len(requests))]
        for t in submitters:
            t.start()
        for t in submitters:
            t.join()
        outcomes = []
        for h in handles:
            try:
                outcomes.append(h.result(timeout=60))
            except Exception as error:
                outcomes.append(error)
    finally:
        stop.set()
        loop.join(10)
    assert not loop.is_alive() and engine.dead is None
    for request, batched in zip(requests, outcomes):
        assert_same_outcome(batched, alone(request))


def test_a_feature_draft_serves_one_request_at_a_time_with_program_runs_results():
    from tests.test_feature_draft import feature_draft
    from tests.tiny_llama import PROMPT as LLAMA_PROMPT
    from tests.tiny_llama import tiny_llama

    draft = feature_draft(tiny_llama())
    target = draft.target
    requests = [Request(LLAMA_PROMPT, smc_speculative.program(target, draft, draft_len=3), Schedule(4, max_tokens=12), seed=s) for s in range(2)]
    requests.append(Request(LLAMA_PROMPT + [7], speculative.program(target, draft, draft_len=2), Schedule(1, max_tokens=10), seed=9))
    engine = BatchEngine(target, draft, max_running=3)
    handles = [engine.submit(r) for r in requests]
    while engine.step():
        assert engine.stats()["requests_running"] <= 1
    for request, handle in zip(requests, handles):
        batched, single = handle.result(0), alone(request)
        assert batched.particles == single.particles and torch.allclose(batched.log_weights, single.log_weights, atol=1e-4)
