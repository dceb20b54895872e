"""The batched engine on vLLM: its rows hold many lengths, so the particles of several requests
share every target pass, each request still draws what it draws alone, and SMC-SD with the free
draft (particles that end cycles at different lengths) runs.

Run in the vLLM environment with `python -m pytest tests/vllm -m vllm` (docs/backends.md).
"""

import math

import pytest
import torch

from smc_sd import testing
from smc_sd.backends.hf import chat_prompt
from smc_sd.engine.batch import BatchEngine, Request
from smc_sd.program import FreeDraft, Schedule
from smc_sd.programs import get
from tests.vllm.test_vllm_backend import LOGPROB_ATOL, continuation_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.model]

MAX_TOKENS = 12
REPEAT = "Repeat exactly: the quick brown fox jumps over the lazy dog."
QUESTIONS = (REPEAT, "Name a painter.", "Why is the sky blue?", "Repeat exactly: one two three four five six.", "How do bees make honey?")


def mixed_requests(target, draft, prompts) -> list[Request]:
    """One request per prompt, of every method: smc-sd with the free draft (N = 4) and with the
    draft model (N = 2), ar, and exact sd; temperature 1 throughout."""
    free = get("smc-sd").program(target, None, free_draft=FreeDraft())
    menu = [
        (free, 4),
        (get("smc-sd").program(target, draft, draft_len=2), 2),
        (get("ar").program(target), 1),
        (free, 4),
        (get("sd").program(target, draft, draft_len=3), 1),
    ]
    return [Request(prompt, program, Schedule(n, max_tokens=MAX_TOKENS), seed) for seed, (prompt, (program, n)) in enumerate(zip(prompts, menu))]


def weight_tolerance(hf_lm, hf_draft, rows) -> float:
    """Largest |log w| difference two evaluations of the same draws may show.

    Each logit of either model lies within atol (`testing.float32_logit_tolerance` of its hf twin
    on the rows: same weights) of its exact value, so a log-softmax within 2·atol, a token's
    weight increment (log p_T - log q) within 4·atol, and a particle's log weight, and log Z_hat,
    within 4·atol per token.
    """
    atol = max(testing.float32_logit_tolerance(lm.model, rows) for lm in (hf_lm, hf_draft))
    return 4 * atol * MAX_TOKENS


def assert_same_draws(batched, alone, tolerance: float) -> None:
    """Equal random outcomes (particles, finished, choice, passes, cycles); log weights and
    log Z_hat within float noise."""
    assert batched.particles == alone.particles and batched.finished == alone.finished
    assert batched.chosen == alone.chosen and batched.complete == alone.complete
    assert (batched.target_passes, batched.draft_passes) == (alone.target_passes, alone.draft_passes)
    assert [c.resampled for c in batched.cycles] == [c.resampled for c in alone.cycles]
    assert (batched.log_weights - alone.log_weights).abs().max() <= tolerance
    assert math.isclose(batched.log_ml, alone.log_ml, abs_tol=tolerance)


def test_requests_share_target_passes_and_draw_what_they_draw_alone(vllm_lm, vllm_draft, hf_lm, hf_draft):
    prompts = [chat_prompt(vllm_lm.tokenizer, question) for question in QUESTIONS]
    requests = mixed_requests(vllm_lm, vllm_draft, prompts)
    engine = BatchEngine(vllm_lm, [vllm_draft], max_running=len(requests))
    handles = [engine.submit(request) for request in requests]
    running = []
    while engine.step():
        running.append(engine.stats()["requests_running"])
    batched = [handle.result(0) for handle in handles]
    alone = [request.program.run(request.prompt, request.schedule, seed=request.seed) for request in requests]
    # all requests ran together; each pass served every one still running
    assert max(running) == len(requests)
    passes = engine.stats()["target_passes_total"]
    assert max(r.target_passes for r in alone) <= passes < sum(r.target_passes for r in alone)
    rows = [prompt + particle for prompt, result in zip(prompts, batched) for particle in result.particles]
    tolerance = weight_tolerance(hf_lm, hf_draft, rows)
    for single, result in zip(alone, batched):
        assert_same_draws(result, single, tolerance)


def test_smc_sd_with_the_free_draft_runs_on_vllm_as_on_hf(vllm_lm, hf_lm):
    """N = 4 particles that advance by different numbers of tokens, from `run` and from `run_many`
    alike, scored on vLLM as on hf.

    The comparison with hf is on log p_T of the particles vLLM drew, not on tokens drawn by each
    backend from the same seed: the logits differ by float32 round-off (~1e-4), so a uniform that
    falls within that much of a boundary between two tokens picks different tokens on the two
    backends, and from there the runs part (seen on a processor with AMX, seed 0, token 8).
    """
    prompt = chat_prompt(vllm_lm.tokenizer, REPEAT)
    schedule, seeds = Schedule(4, max_tokens=16), [0, 1, 2]
    program = get("smc-sd").program(vllm_lm, None, free_draft=FreeDraft())
    spreads = []

    def record(stats, particles):
        spreads.append(len({len(tokens) for tokens in particles}))

    alone = [program.run(prompt, schedule, seed=seed, on_cycle=record) for seed in seeds]
    # the free draft's blocks were accepted to different depths: particles of different lengths
    assert max(spreads) > 1
    batched = program.run_many([prompt] * len(seeds), schedule, seeds=seeds)
    for single, result in zip(alone, batched):
        assert math.isfinite(single.log_ml) and 1 <= len(single.tokens) <= 16
        assert result.particles == single.particles and result.chosen == single.chosen
        for particle in filter(None, single.particles):
            on_vllm, on_hf = (continuation_logprobs(lm, prompt, torch.tensor([particle])) for lm in (vllm_lm, hf_lm))
            assert (on_vllm - on_hf).abs().max() <= LOGPROB_ATOL
