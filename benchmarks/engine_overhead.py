"""The engine's own work per cycle, with a nearly free model.

A random Llama of one layer and hidden size 32 over a full vocabulary (the default model's
49,152 tokens with its tokenizer, or 128,256 with a synthetic one) makes the forward nearly
free, so what a cycle costs is the engine's: the backend's per-row bookkeeping (paged KV indices,
gathers), masks, drafting, verification, weights, resampling. For each method and each count of
requests R (1, 16, 64 by default) the same prompts run through `Program.run_many` with R in the
batch at once; after two warm-up cycles, `--cycles` cycles are timed, then as many more are
recorded by torch.profiler.

Reported per (vocabulary, method, R):
- ms_per_cycle: wall time of `BatchEngine.step` / cycles, over `--cycles` cycles run without
  the profiler (after two warm-up cycles);
- ms_forward_per_cycle: the part of it spent inside the two models' `forward` (attention, MLP and
  the output head over the vocabulary: what no engine can skip), and ms_engine_per_cycle the
  rest (the backend's bookkeeping, masks, drafting draws, verification, resampling);
- ops_per_cycle: torch operator calls recorded by the profiler per cycle (top-level calls and
  the calls they make: every aten op is a kernel launch or a host step on a GPU);
- host_syncs_per_cycle: `aten::_local_scalar_dense` calls per cycle (a tensor read as a Python
  number: `.item()`, `bool(t)`, `int(t)`; on a GPU each waits for the device); `.tolist()`
  reads are not aten ops and are not counted;
- ops_ratio_vs_1: ops_per_cycle / the same method's ops_per_cycle at R = 1.

With `--compile-step` each method also runs on an engine that compiles its step
(`BatchEngine(compile_step=True)`, `smc_sd.engine.kernels`), rows marked `"compile_step": true`
beside the eager ones of the same run; the compiling happens in the warm-up cycles.

Methods: ar; sd with the free draft; mask-at-verify with the free draft under a JSON schema
(49,152 only: the schema needs the real tokenizer); smc-sd N=4 K=4 with an LM draft (a second
random one-layer model); smc-sd N=4 with the free draft.

The torch thread count is 1. Usage:
    python benchmarks/engine_overhead.py [--requests 1,16,64] [--vocab 49152,128256]
        [--methods ar,sd-free,mav-free-json,smc-sd,smc-sd-free] [--cycles 8] [--compile-step]
        [--no-write]
"""

from __future__ import annotations

import argparse
import json
import time
import types

import torch
from _common import emit, environment, progress
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

from smc_sd.api import engine_for
from smc_sd.backends.hf import HFLanguageModel
from smc_sd.engine.batch import Request
from smc_sd.program import FreeDraft, Schedule
from smc_sd.programs import get

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "born": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "born", "city"],
    "additionalProperties": False,
}

METHODS = ("ar", "sd-free", "mav-free-json", "smc-sd", "smc-sd-free")


def random_llama(vocab: int, seed: int) -> LlamaForCausalLM:
    """A random one-layer Llama of hidden size 32 over `vocab` tokens: a nearly free forward."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def synthetic_tokenizer(vocab: int):
    """EOS 0, a vocabulary map and decode: what the backend needs of a tokenizer."""
    return types.SimpleNamespace(
        eos_token_id=0,
        get_vocab=lambda: {f"t{i}": i for i in range(vocab)},
        decode=lambda ids, **_: " ".join(map(str, ids)),
    )


def models(vocab: int):
    """(target, draft, tokenizer or None): the default tokenizer at 49,152, a synthetic one else."""
    if vocab == 49152:
        from transformers import AutoTokenizer

        from smc_sd.models.smollm2 import default_model_dir

        tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
        real = tokenizer
    else:
        tokenizer, real = synthetic_tokenizer(vocab), None
    target = HFLanguageModel(random_llama(vocab, 0), tokenizer)
    draft = HFLanguageModel(random_llama(vocab, 1), tokenizer)
    return target, draft, real


def program_for(method: str, target, draft):
    """(program, particles) for a method name of METHODS; temperature 1, except the JSON run."""
    free = FreeDraft()
    if method == "ar":
        return get("ar").program(target), 1
    if method == "sd-free":
        return get("sd").program(target, None, free_draft=free), 1
    if method == "mav-free-json":
        from smc_sd.constraints.grammars import JsonSchema

        return get("mask-at-verify").program(target, None, constraints=(JsonSchema(SCHEMA),), temperature=0.3, free_draft=free), 1
    if method == "smc-sd":
        return get("smc-sd").program(target, draft, draft_len=4), 4
    if method == "smc-sd-free":
        return get("smc-sd").program(target, None, free_draft=free), 4
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


class ForwardClock:
    """Wall seconds spent inside some models' `forward`, summed while `running`."""

    def __init__(self, lms):
        self.seconds, self.running = 0.0, False
        for lm in lms:
            lm.model.forward = self._timed(lm.model.forward)

    def _timed(self, forward):
        def timed(*args, **kwargs):
            if not self.running:
                return forward(*args, **kwargs)
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def measure(program, particles: int, requests: int, cycles: int, max_tokens: int, clock: ForwardClock, compile_step: bool) -> dict:
    """Run `requests` prompts at once: two warm-up cycles, `cycles` timed ones, `cycles` profiled."""
    schedule = Schedule(particles=particles, max_tokens=max_tokens)
    engine = engine_for(program, max_running=requests, max_waiting=requests, max_slots=requests * particles, compile_step=compile_step)
    generator = torch.Generator().manual_seed(0)
    for seed in range(requests):
        prompt = torch.randint(1, 1000, (12,), generator=generator).tolist()
        engine.submit(Request(prompt, program, schedule, seed))
    for _ in range(2):
        engine.step()
    running = engine.stats()["requests_running"]
    clock.seconds, clock.running = 0.0, True
    start = time.perf_counter()
    for _ in range(cycles):
        engine.step()
    seconds = time.perf_counter() - start
    clock.running = False
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(cycles):
            engine.step()
    events = prof.events()
    ops = sum(1 for e in events if e.name.startswith("aten::"))
    syncs = sum(1 for e in events if e.name == "aten::_local_scalar_dense")
    still = engine.stats()["requests_running"]
    while engine.step():
        pass
    return {
        "requests": requests,
        "compile_step": compile_step,
        "running_at_start": running,
        "running_at_end": still,
        "cycles": cycles,
        "ms_per_cycle": round(1000 * seconds / cycles, 3),
        "ms_forward_per_cycle": round(1000 * clock.seconds / cycles, 3),
        "ms_engine_per_cycle": round(1000 * (seconds - clock.seconds) / cycles, 3),
        "ops_per_cycle": round(ops / cycles, 1),
        "host_syncs_per_cycle": round(syncs / cycles, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", default="1,16,64")
    parser.add_argument("--vocab", default="49152,128256")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--compile-step", action="store_true", help="also run each method with the engine's compiled step")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for vocab in (int(v) for v in args.vocab.split(",")):
        target, draft, tokenizer = models(vocab)
        clock = ForwardClock([target, draft])
        for method in args.methods.split(","):
            if method == "mav-free-json" and tokenizer is None:
                continue
            program, particles = program_for(method, target, draft)
            for compile_step in (False, True) if args.compile_step else (False,):
                base = None
                for requests in (int(r) for r in args.requests.split(",")):
                    row = {"vocab": vocab, "method": method, **measure(program, particles, requests, args.cycles, args.max_tokens, clock, compile_step)}
                    base = base or row["ops_per_cycle"]
                    row["ops_ratio_vs_1"] = round(row["ops_per_cycle"] / base, 2)
                    rows.append(row)
                    progress(json.dumps(row))
    emit("engine_overhead", {"environment": environment(), "threads": 1, "rows": rows}, write=not args.no_write)


if __name__ == "__main__":
    main()
