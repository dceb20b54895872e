"""The engine's compiled kernels (`smc_sd.engine.kernels`, `compile_step=True`): compiled with
symbolic sizes, a row's results do not depend on the rows beside it (so a request's result does
not depend on the requests it runs with), the tokens are the eager ones, and an engine that
compiles its step returns what the eager engine returns: the same tokens, log weights within
float32 rounding."""

import math
import re
import subprocess
import sys

import pytest
import torch

from smc_sd.engine.batch import BatchEngine, Request
from smc_sd.engine.block_scores import score_rows
from smc_sd.engine.kernels import EAGER, StepKernels, current
from smc_sd.engine.keyed_random import ACCEPT, DRAFT, RESAMPLE, keyed_uniforms, seed_key
from smc_sd.engine.sampling import EXP_FLOOR, exp_floored_, tokens_and_logprobs
from smc_sd.program import Schedule
from smc_sd.programs import autoregressive, smc_speculative
from tests.test_batch_engine import outcome
from tests.test_batch_free_drafts import free_and_other_requests
from tests.test_compiled_step import score_inputs
from tests.toy_programs import PROMPT, target_and_draft

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

#: subsets of 12 rows: one row alone, a run, rows apart
SUBSETS = (torch.tensor([3]), torch.arange(2, 7), torch.tensor([0, 5, 11]))


def rows_of(args: tuple, rows: torch.Tensor, a: int) -> list:
    """The arguments restricted to some rows (tensors whose first axis is the A rows)."""
    return [x[rows] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == a else x for x in args]


def test_compiled_kernels_treat_each_row_alone():
    kernels = StepKernels.of(True)
    for masked, plain in ((False, True), (True, False)):
        args = score_inputs(12, 4, 3000, masked, False, False, plain, seed=7)
        block, increments = kernels.score_rows(*args)
        assert torch.equal(block, score_rows(*args)[0])
        for rows in SUBSETS:
            part_block, part_increments = kernels.score_rows(*rows_of(args, rows, 12))
            assert torch.equal(part_block, block[rows]) and torch.equal(part_increments, increments[rows])
    generator = torch.Generator().manual_seed(8)
    scores, u = 3 * torch.randn(12, 3000, generator=generator), torch.rand(12, dtype=torch.float64, generator=generator)
    tokens, logq = kernels.tokens_and_logprobs(scores, u)
    eager_tokens, eager_logq = tokens_and_logprobs(scores, u)
    assert torch.equal(tokens, eager_tokens)
    torch.testing.assert_close(logq, eager_logq, rtol=0, atol=1e-5)
    for rows in SUBSETS:
        part_tokens, part_logq = kernels.tokens_and_logprobs(scores[rows], u[rows])
        assert torch.equal(part_tokens, tokens[rows]) and torch.equal(part_logq, logq[rows])


def test_compiled_uniforms_are_the_eager_ones_bit_for_bit():
    cores = StepKernels.of(True)
    keys = torch.tensor([seed_key(s) for s in (0, 1, 2**40 + 3, 7)])
    cycles, particles = torch.tensor([0, 5, 2**22, 9]), torch.tensor([3, 0, 1, 2**19])
    calls = [
        (keys, cycles, particles, 4, DRAFT),  # a draft step's [A]
        (keys[:, None], cycles[:, None], torch.arange(6)[None, :], 0, RESAMPLE),  # [G, N]
        (keys[:, None], cycles[:, None], particles[:, None], torch.arange(5)[None, :], ACCEPT),  # [U, M]
    ]
    for args in calls:
        u = cores.keyed_uniforms(*args)
        assert u.dtype == torch.float64 and torch.equal(u, keyed_uniforms(*args))


def test_the_compiled_floored_exp_is_the_eager_one():
    # compiled, exp_floored_ is a where() out of place: zero exactly at and below the floor, as
    # the eager threshold, and the same exps above it (the next float32 above the floor included)
    floor = torch.tensor([EXP_FLOOR])
    above = torch.nextafter(floor, torch.zeros(1))
    x = torch.cat([torch.tensor([-math.inf, -200.0, EXP_FLOOR - 1]), floor, above, torch.tensor([-69.0, -50.0, -1.0, 0.0])])
    compiled = torch.compile(exp_floored_, dynamic=True)(x.clone())
    assert torch.equal(compiled, exp_floored_(x.clone()))
    assert bool((compiled[x <= EXP_FLOOR] == 0).all()) and bool((compiled[x > EXP_FLOOR] > 0).all())


def run(programs, compile_step: bool):
    target, draft = programs[0][0].target.lm, programs[0][0].proposal.lm
    engine = BatchEngine(target, draft, max_running=4, compile_step=compile_step)
    handles = [engine.submit(Request(PROMPT, program, schedule, seed)) for seed, (program, schedule) in enumerate(programs)]
    while engine.step():
        assert current() is EAGER
    return [h.result() for h in handles]


def test_an_engine_that_compiles_its_step_returns_the_eager_results():
    target, draft = target_and_draft(noise=1.0)
    programs = [
        (smc_speculative.program(target, draft, draft_len=3), Schedule(4, max_tokens=9)),
        (smc_speculative.program(target, draft, draft_len=2, alpha=2.0), Schedule(3, ess_threshold=0.9, max_tokens=7)),
        (smc_speculative.program(target, draft, draft_len=3, draft_temperature=0.7), Schedule(2, max_tokens=8)),
        (autoregressive.program(target), Schedule(2, max_tokens=6)),
    ]
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = run(programs, True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before
    for got, expected in zip(compiled, run(programs, False)):
        assert got.particles == expected.particles and got.chosen == expected.chosen
        assert math.isclose(got.log_ml, expected.log_ml, rel_tol=1e-5, abs_tol=1e-5)
        for w, v in zip(got.log_weights, expected.log_weights):
            assert math.isclose(w, v, rel_tol=1e-5, abs_tol=1e-5) or (w == v == -math.inf)


def test_compiled_accept_reject_requests_return_the_eager_results():
    # sd, mask-at-verify and smc-sd with free drafts and LM drafts, constrained or not, at
    # several temperatures and powers (`accept_scores` compiled): the same tokens and choices
    target, draft = target_and_draft(noise=1.0)
    requests = free_and_other_requests(target, draft, 14)

    def results(compile_step: bool) -> list:
        engine = BatchEngine(target, draft, max_running=14, max_slots=64, compile_step=compile_step)
        handles = [engine.submit(r) for r in requests]
        while engine.step():
            pass
        return [outcome(h) for h in handles]

    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = results(True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before
    proposed = 0
    for got, expected in zip(compiled, results(False)):
        if isinstance(expected, Exception):
            assert type(got) is type(expected)
            continue
        assert got.particles == expected.particles and got.chosen == expected.chosen
        proposed += sum(c.proposed or 0 for c in expected.cycles)
        for w, v in zip(got.log_weights, expected.log_weights):
            assert math.isclose(w, v, rel_tol=1e-5, abs_tol=1e-5) or (w == v == -math.inf)
    # the free drafts proposed: rows of different lengths were verified
    assert proposed > 10


def test_a_step_that_cannot_compile_says_so_in_one_line():
    # in a fresh interpreter: inductor caches what it finds of the compiler (its vector ISA
    # checks), which must not leak into the tests after this one
    script = (
        "import torch\n"
        "torch._inductor.config.cpp.cxx = ('no-such-c++-compiler',)\n"
        "torch._inductor.config.fx_graph_cache = False\n"
        "from smc_sd.engine.kernels import compile_kernel\n"
        "def doubled(x):\n"
        "    return 2 * x + 1\n"
        "try:\n"
        "    compile_kernel(doubled)(torch.ones(3))\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
    )
    printed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300).stdout.strip()
    assert re.fullmatch(r"compile_step: torch.compile could not compile doubled \(.*compiler.*\); run without compile_step", printed), printed
