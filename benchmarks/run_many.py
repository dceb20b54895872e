"""Many prompts in one batch (`Program.run_many`) against one `Program.run` call per prompt.

For each method (ar, smc-sd N=4 K=4 with the default draft, and with the free draft: sd-free and
smc-sd-free N=4, `--draft free`) the same chat prompts are decoded
twice with the same settings and seeds: one `Program.run` call after another, then one
`Program.run_many` over all of them (up to --max-running in the batch at once). Reported per
method:
- tokens_per_second of each way: generated tokens of the returned texts / wall seconds, and
  speedup = batched / sequential (the goal is >= 3 at 32 prompts);
- target_passes: the batched run's target forwards (one per cycle over every request's rows)
  against the sum of the sequential runs' cycles;
- same_tokens: prompts whose returned tokens agree between the two ways (the laws make them
  equal; float round-off between batch shapes can flip a rare draw).

And the KV cache of the prompts: SmolLM2's chat template puts one system prompt before every
question, so all prompts share a prefix (`kv`), and a second set puts a longer system message
(LONG_SYSTEM, about 150 tokens) before the same questions (`kv_long_system`). Right after every
request has joined (before any decoding) the target's pool holds `kv_blocks_joined` blocks;
`kv_blocks_unshared` is what the same prompts hold with no sharing across requests (each
request's prompt blocks, counted alone); the common prefix's `system_prompt_blocks` full blocks
are stored once (its tail shares a block with each request's own tokens, so it is not shared).

The torch thread count is 1 (the machine is shared); check `uptime` first and run only when it
is quiet. Model load is excluded from every timing.

Usage: python benchmarks/run_many.py [--prompts 32] [--max-tokens 64] [--max-running 32]
       [--methods ar,smc-sd,sd-free,smc-sd-free]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from _common import build_program, drop_prefix_caches, emit, environment, load_default_models

QUESTIONS = [
    "What is the capital of France?", "Explain how a bicycle works.", "Write a haiku about rain.",
    "Why is the sky blue?", "Give three uses of a paper clip.", "What is photosynthesis?",
    "Describe a lighthouse at night.", "How do vaccines work?", "Name a famous painter and a work.",
    "What does a compiler do?", "Suggest a name for a cat.", "How far is the Moon?",
    "What is the boiling point of water?", "Write one sentence about autumn.", "What is a prime number?",
    "Explain gravity to a child.", "What are clouds made of?", "How do bees make honey?",
    "Tell me a fact about octopuses.", "What is the tallest mountain?", "How does a rainbow form?",
    "What is an atom?", "Describe the taste of lemon.", "Why do leaves change colour?",
    "What is the speed of light?", "Give a tip for learning to cook.", "What is democracy?",
    "How do planes fly?", "What is a volcano?", "Write a short greeting for a friend.",
    "What is the largest ocean?", "How does the heart pump blood?",
]

LONG_SYSTEM = (
    "You are a careful assistant for a science museum. Answer visitors' questions in plain words, "
    "in at most three sentences, without jargon. When a question is about a living thing, say where "
    "it lives; when it is about a machine, say what it is used for; when it is about the sky or "
    "space, give one number that shows how large or far the thing is. If you do not know an answer, "
    "say so and suggest which hall of the museum might help. Never invent exhibits, opening hours or "
    "prices, and never ask the visitor for personal details. Keep a friendly tone, and end every "
    "answer with a short question that invites the visitor to look closer at something nearby."
)

METHODS = {"ar": dict(particles=1), "smc-sd": dict(particles=4, draft_len=4), "sd-free": dict(particles=1), "smc-sd-free": dict(particles=4)}


def chat_prompts(tokenizer, count: int, system: str | None = None) -> list[list[int]]:
    """Token ids of the first `count` questions in the chat template (with `system` as the system
    message, or the template's default one)."""
    from collections.abc import Mapping

    prompts = []
    for i in range(count):
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append([int(t) for t in (encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)])
    return prompts


def common_prefix(prompts: list[list[int]]) -> int:
    n = min(len(p) for p in prompts)
    for i in range(n):
        if any(p[i] != prompts[0][i] for p in prompts):
            return i
    return n


def kv_of_joined_prompts(program, schedule, prompts, block_size: int) -> dict:
    """Blocks the target's pool holds once every request has joined, against no sharing."""
    from smc_sd.engine.batch import BatchEngine, Request

    target = program.target.lm
    draft = program.proposal.lm if program.proposal is not None else None
    engine = BatchEngine(target, draft, max_running=len(prompts), max_slots=len(prompts) * schedule.particles)
    handles = [engine.submit(Request(p, program, schedule, seed=i)) for i, p in enumerate(prompts)]
    # everyone joins and draws a first token, without decoding a cycle
    engine.admit()
    joined = engine.target_rows.memory()["live_blocks"]
    for handle in handles:
        handle.cancel()
    while engine.step():
        pass
    shared = common_prefix(prompts)
    return {
        "common_prefix_tokens": shared,
        "system_prompt_blocks": shared // block_size,
        "kv_blocks_joined": joined,
        "kv_blocks_unshared": sum(math.ceil(len(p) / block_size) for p in prompts),
        "kv_block_size": block_size,
    }


def measure(method: str, target, draft, prompts, long_prompts, max_tokens: int, max_running: int) -> dict:
    from smc_sd.program import FreeDraft, Schedule

    settings = METHODS[method]
    options = {k: v for k, v in settings.items() if k != "particles"}
    if method.endswith("-free"):
        program = build_program(method.removesuffix("-free"), target, None, free_draft=FreeDraft(), **options)
    else:
        program = build_program(method, target, draft, **options)

    schedule = Schedule(settings["particles"], max_tokens=max_tokens)
    seeds = list(range(len(prompts)))
    # one untimed run warms the allocator and the trie code paths
    program.run(prompts[0], Schedule(settings["particles"], max_tokens=4), seed=0)
    # both ways start from an empty prefix cache (each shares within itself what it computed)
    drop_prefix_caches(program)
    started = time.perf_counter()
    alone = [program.run(p, schedule, seed=s) for p, s in zip(prompts, seeds)]
    sequential_seconds = time.perf_counter() - started
    drop_prefix_caches(program)
    started = time.perf_counter()
    batched = program.run_many(prompts, schedule, seeds=seeds, max_running=max_running)
    batched_seconds = time.perf_counter() - started
    tokens_alone = sum(len(r.tokens) for r in alone)
    tokens_batched = sum(len(r.tokens) for r in batched)
    return {
        "method": method,
        **settings,
        "sequential": {"seconds": sequential_seconds, "tokens": tokens_alone, "tokens_per_second": tokens_alone / sequential_seconds,
                       "target_passes": sum(r.target_passes for r in alone)},
        "batched": {"seconds": batched_seconds, "tokens": tokens_batched, "tokens_per_second": tokens_batched / batched_seconds},
        "speedup": (tokens_batched / batched_seconds) / (tokens_alone / sequential_seconds),
        "same_tokens": sum(a.tokens == b.tokens for a, b in zip(alone, batched)),
        "kv": kv_of_joined_prompts(program, schedule, prompts, target.block_size),
        "kv_long_system": kv_of_joined_prompts(program, schedule, long_prompts, target.block_size),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--methods", default="ar,smc-sd")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write results/run_many.json")
    args = parser.parse_args()
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {sorted(METHODS)}")
    torch.set_num_threads(1)
    target, draft = load_default_models()
    prompts = chat_prompts(target.tokenizer, args.prompts)
    long_prompts = chat_prompts(target.tokenizer, args.prompts, LONG_SYSTEM)
    rows = [measure(m, target, draft, prompts, long_prompts, args.max_tokens, args.max_running) for m in methods]
    emit(
        "run_many",
        {
            "benchmark": "run_many",
            "environment": environment(),
            "prompts": args.prompts,
            "max_tokens": args.max_tokens,
            "max_running": args.max_running,
            "rows": rows,
        },
        write=not args.no_write,
    )


if __name__ == "__main__":
    main()
