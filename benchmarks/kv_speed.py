"""SMC-SD tokens/s with the shared (paged, token-trie) KV cache against per-particle copies, in one run.

Every configuration in CONFIGS runs each prompt once per KV cache, the caches alternating prompt
by prompt so that a change in machine load hits both alike. Reported per configuration and cache:
tokens/s of the returned text (wall clock, model load excluded), the process CPU seconds, the KV
peak bytes, and per configuration `paged_over_copy` = paged tokens/s / copy tokens/s and
`paged_over_copy_cpu` = copy CPU seconds / paged CPU seconds (above 1: the paged cache is faster).
On a machine shared with other processes the CPU-time ratio is the steadier of the two.

Usage: python benchmarks/kv_speed.py [--max-new-tokens 32] [--particles 8] [--draft-len 8] [--prompts 2]
"""

from __future__ import annotations

import argparse
import time

from _common import build_program, drop_prefix_caches, emit, environment, load_default_models

from smc_sd import Schedule

CACHES = ("paged", "copy")
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe your favourite city in detail.",
    "List some uses of a paper clip and explain each.",
]


def measure(target, draft, particles: int, draft_len: int, prompts, max_tokens: int, seed: int) -> dict:
    """Decode every prompt with each cache in turn; sum tokens and seconds per cache."""
    program = build_program("smc-sd", target, draft, draft_len=draft_len)
    totals = {
        cache: {"tokens": 0, "seconds": 0.0, "cpu_seconds": 0.0, "kv_peak_bytes": 0, "kv_naive_bytes": 0}
        for cache in CACHES
    }
    for i, prompt in enumerate(prompts):
        # alternate which cache goes first, so neither always runs on a warmer machine
        for cache in CACHES if i % 2 == 0 else CACHES[::-1]:
            target.kv_cache = draft.kv_cache = cache
            drop_prefix_caches(program)
            cpu = time.process_time()
            result = program.run(prompt, Schedule(particles, max_tokens=max_tokens), seed=seed + i)
            total = totals[cache]
            total["cpu_seconds"] += time.process_time() - cpu
            total["tokens"] += len(result.tokens)
            total["seconds"] += result.seconds
            total["kv_peak_bytes"] = max(total["kv_peak_bytes"], result.kv["peak_bytes"])
            total["kv_naive_bytes"] = max(total["kv_naive_bytes"], result.kv["naive_peak_bytes"])
    for total in totals.values():
        total["tokens_per_second"] = total["tokens"] / total["seconds"]
    return {
        "particles": particles,
        "draft_len": draft_len,
        **totals,
        "paged_over_copy": totals["paged"]["tokens_per_second"] / totals["copy"]["tokens_per_second"],
        "paged_over_copy_cpu": totals["copy"]["cpu_seconds"] / totals["paged"]["cpu_seconds"],
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--particles", type=int, nargs="+", default=[8], help="one or more N")
    parser.add_argument("--draft-len", type=int, default=8, help="K")
    parser.add_argument("--prompts", type=int, default=2, help=f"how many of the {len(PROMPTS)} prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print JSON only; write no files")
    args = parser.parse_args(argv)

    from smc_sd.backends.hf import chat_prompt

    target, draft = load_default_models()
    prompts = [chat_prompt(target.tokenizer, p) for p in PROMPTS[: args.prompts]]
    # warm-up: the first forwards of a process are slower (allocations, kernel selection)
    for cache in CACHES:
        target.kv_cache = draft.kv_cache = cache
        build_program("smc-sd", target, draft, draft_len=2).run(prompts[0], Schedule(2, max_tokens=4))
    started = time.perf_counter()
    configs = [
        measure(target, draft, n, args.draft_len, prompts, args.max_new_tokens, args.seed) for n in args.particles
    ]
    data = {
        "benchmark": "kv_speed",
        "model": "SmolLM2-135M-Instruct (fp32, CPU) and the default draft",
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "environment": environment(),
        "wall_seconds": time.perf_counter() - started,
        "configs": configs,
    }
    emit("kv_speed", data, write=not args.no_write)
    return data


if __name__ == "__main__":
    main()
