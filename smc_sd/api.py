"""Where the layers meet: a program runs as requests of the batched engine.

The program (`smc_sd.program`) is data a user writes; the engine (`smc_sd.engine.batch`)
compiles each request's program with its schedule (`smc_sd.compiler`) and runs the plans, the
particles of every running request in one target pass per cycle. A single run is the engine
with one request: every program runs on the one engine, and a request's result for a seed does
not depend on what runs beside it. `Program.run`, `Program.run_many` and `Program.smc` call
these functions.
"""

from __future__ import annotations

from typing import Callable

from smc_sd.engine.batch import BatchEngine, Request
from smc_sd.engine.result import CycleStats, Result, warn_if_incomplete
from smc_sd.models.chat import prompt_token_ids


def run(program, prompt: str | list[int], schedule, seed: int = 0, on_cycle: Callable[[CycleStats, list[list[int]]], None] | None = None, raw: bool = False) -> Result:
    """Run a program on one prompt: the batched engine with one request.

    Args:
        program: a `smc_sd.program.Program`.
        prompt: text (one user message in the target's chat template, as `smc-sd generate`
            wraps it; with `raw`, the text's own tokens) or token ids (non-empty), used as given.
        schedule: a `smc_sd.program.Schedule`.
        seed: seeds the request's own random generator; equal seeds give equal results.
        on_cycle: called after every cycle with its stats and every particle's generated tokens
            (each ending at its EOS); what it raises ends the run and is raised here.
        raw: encode a text prompt as is, without the chat template.

    Raises:
        what the compiler refuses (ValueError naming the setting, ContextOverflowError,
        TokenizerMismatchError), a prompt that is neither text nor token ids (ValueError),
        AllParticlesDiedError, UnsatisfiableConstraintError.

    Warns:
        IncompleteResultWarning: when no particle completed a string the constraints accept
            within the token budget (`Result.complete` False; the text is cut off).
    """
    ids = prompt_token_ids(program.target.lm, prompt, raw)
    engine = engine_for(program, max_running=1, max_waiting=1, max_slots=schedule.particles)
    handle = engine.submit(Request(ids, program, schedule, seed), on_cycle=on_cycle)
    while engine.step():
        pass
    return warn_if_incomplete(handle.result(), schedule.max_tokens)


def run_many(program, prompts: list[str | list[int]], schedule, seeds: list[int] | None = None, max_running: int = 32, raw: bool = False, compile_step: bool = False) -> list[Result]:
    """Run a program on many prompts in one batch: result i is what `run(program, prompts[i],
    schedule, seeds[i], raw=raw)` returns (seeds default to 0, `run`'s default); the particles of
    up to `max_running` prompts share every target and draft pass. With `compile_step` the
    engine's verification scores and draft draws run compiled (`smc_sd.engine.kernels`): the
    same tokens, weights within float32 rounding.

    Raises:
        the first failure among the requests, after all of them have ended.

    Warns:
        IncompleteResultWarning: once per result that no particle completed.
    """
    seeds = [0] * len(prompts) if seeds is None else list(seeds)
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    ids = [prompt_token_ids(program.target.lm, prompt, raw) for prompt in prompts]
    engine = engine_for(program, max_running=max_running, max_waiting=len(prompts), max_slots=max_running * schedule.particles, compile_step=compile_step)
    handles = [engine.submit(Request(p, program, schedule, s)) for p, s in zip(ids, seeds)]
    while engine.step():
        pass
    return [warn_if_incomplete(handle.result(), schedule.max_tokens) for handle in handles]


def engine_for(program, max_running: int, max_waiting: int, max_slots: int, compile_step: bool = False) -> BatchEngine:
    """A batched engine over the program's target and draft model (if any)."""
    draft = program.proposal.lm if program.proposal is not None else None
    return BatchEngine(program.target.lm, draft, max_running=max_running, max_waiting=max_waiting, max_slots=max_slots, compile_step=compile_step)
