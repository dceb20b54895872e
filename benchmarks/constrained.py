"""Constrained SMC-SD on the default model: llguidance mask latency, speed against unconstrained
SMC-SD, speed against genlm-control's SMC with AWRS and its own `JsonSchema`, and validity.

Everything runs in this one process on the same model, prompt, particle count N, draft length K,
token budget and seeds:
- mask latency: the wall time of each mask call divided by its live rows (seconds per
  particle-position, the draft's K masks and the bonus mask of every cycle), p50 and p99, over a
  JSON-schema run and a Lark (CFG) run;
- llguidance's own share: the same masks recomputed along each returned answer, one
  `fill_next_token_bitmask` per position (p50, p99), to separate llguidance from our overhead;
- speed: positions per second, every particle slot's advance (`Result.positions`) over wall
  seconds; the unconstrained run gets the constrained run's positions as its budget (same N, K,
  prompt and seed), so both do the same work, prompt pass included; and generated tokens per
  second (the mean particle length over wall seconds), the measure genlm-control's SMC is
  compared on;
- validity: the returned text is complete (ended by EOS or complete at the budget) and validates
  (jsonschema with format checks; the CFG by genlm-control's Earley parser, independent of
  llguidance).

    OMP_NUM_THREADS=1 python benchmarks/constrained.py --seeds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import time

from _common import drop_prefix_caches, emit, environment, load_default_models

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"},
        "role": {"anyOf": [{"enum": ["admin", "user"]}, {"type": "null"}]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
GRAMMAR = r"""start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,6}/
"""
PROMPTS = {
    "json": "Reply with JSON only: a user record with a name, an age, an email and a role.",
    "cfg": "Write one arithmetic expression with +, * and parentheses. Reply with the expression only.",
}


def processor() -> str:
    """The processor's model name as lscpu reports it."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "unknown")


def json_valid(text: str) -> bool:
    import jsonschema

    from smc_sd.constraints.json_validation import schema_validator

    try:
        return schema_validator(SCHEMA).is_valid(json.loads(text))
    except (ValueError, jsonschema.ValidationError):
        return False


def cfg_valid(text: str) -> bool:
    from genlm.control import BoolCFG

    return asyncio.run(BoolCFG.from_lark(GRAMMAR).complete(text.encode())) == 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_smc_sd(program, prompt, schedule, seed) -> tuple[dict, list[float]]:
    """One run; returns its figures and the mask latencies (seconds per particle-position)."""
    drop_prefix_caches(program)
    result = program.run(prompt, schedule, seed=seed)
    mean_length = sum(len(p) for p in result.particles) / len(result.particles)
    figures = {
        "text": result.text,
        "complete": result.complete,
        "seconds": result.seconds,
        "positions": result.positions,
        "positions_per_second": result.positions / result.seconds,
        "tokens_per_second": mean_length / result.seconds,
        "mask_seconds": result.mask_seconds,
    }
    return figures, list(result.mask_row_seconds)


def run_genlm_awrs(genlm_llm, prompt, particles, max_tokens, seed) -> dict:
    """genlm-control's SMC with AWRS, its `JsonSchema` potential coerced to the model's tokens."""
    from genlm.control import AWRS, JsonSchema

    genlm_llm.prompt_ids = prompt
    condition = JsonSchema(SCHEMA).coerce(genlm_llm, f=b"".join)
    sampler = AWRS(genlm_llm, condition, seed=seed)
    started = time.perf_counter()
    sequences = asyncio.run(sampler.smc(n_particles=particles, ess_threshold=0.5, max_tokens=max_tokens))
    seconds = time.perf_counter() - started
    posterior = sequences.decoded_posterior
    text = max(posterior, key=posterior.get) if posterior else ""
    lengths = [len([t for t in c if not isinstance(t, type(genlm_llm.eos))]) for c in sequences.contexts]
    return {"text": text, "complete": bool(posterior), "seconds": seconds, "tokens_per_second": sum(lengths) / len(lengths) / seconds}


def llguidance_latencies(grammar: str, lm, tokens: list[int]) -> list[float]:
    """Seconds of one llguidance mask at each position of `tokens` (EOS excluded)."""
    import llguidance
    import llguidance.torch

    from smc_sd.constraints.llguidance_masks import lm_tokenizer

    tokenizer = lm_tokenizer(lm)[0]
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    bitmask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)
    out = []
    for token in [t for t in tokens if t != lm.vocabulary.eos_token_id] + [None]:
        started = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
        out.append(time.perf_counter() - started)
        if token is not None:
            matcher.consume_token(token)
    return out


def latency_us(values: list[float]) -> dict:
    return {"p50": 1e6 * statistics.median(values), "p99": 1e6 * percentile(values, 0.99), "max": 1e6 * max(values), "calls": len(values)}


def mean(runs: list[dict], key: str) -> float:
    return sum(r[key] for r in runs) / len(runs)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--particles", type=int, default=4)
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--genlm-max-tokens", type=int, default=64, help="token budget of genlm-control's (slow) SMC")
    parser.add_argument("--skip-genlm", action="store_true")
    parser.add_argument("--no-write", action="store_true", help="do not save results/constrained.json")
    args = parser.parse_args(argv)

    from smc_sd.backends.hf import chat_prompt
    from smc_sd.program import Schedule
    from smc_sd.constraints.grammars import Grammar, JsonSchema
    from smc_sd.programs import smc_speculative

    target, draft = load_default_models()
    schedule = Schedule(args.particles, max_tokens=args.max_tokens)
    constraints = {"json": JsonSchema(SCHEMA), "cfg": Grammar(GRAMMAR)}
    checks = {"json": json_valid, "cfg": cfg_valid}
    out: dict = {}
    for name, constraint in constraints.items():
        prompt = chat_prompt(target.tokenizer, PROMPTS[name])
        constrained = smc_speculative.program(target, draft, draft_len=args.draft_len, constraints=(constraint,))
        free = smc_speculative.program(target, draft, draft_len=args.draft_len)
        runs, latencies, own, free_runs = [], [], [], []
        for seed in range(args.seeds):
            figures, row_seconds = run_smc_sd(constrained, prompt, schedule, seed)
            figures["valid"] = figures["complete"] and checks[name](figures["text"])
            runs.append(figures)
            latencies += row_seconds
            own += llguidance_latencies(constraint.grammar, target, target.tokenizer.encode(figures["text"], add_special_tokens=False))
            same_work = Schedule(args.particles, max_tokens=figures["positions"])
            free_runs.append(run_smc_sd(free, prompt, same_work, seed)[0])
        out[name] = {
            "mask_latency_us": latency_us(latencies),
            "llguidance_mask_latency_us": latency_us(own),
            "validity": mean(runs, "valid"),
            "constrained_positions_per_second": mean(runs, "positions_per_second"),
            "unconstrained_positions_per_second": mean(free_runs, "positions_per_second"),
            "positions": [r["positions"] for r in runs],
            "unconstrained_positions": [r["positions"] for r in free_runs],
            "speed_ratio": mean(runs, "positions_per_second") / mean(free_runs, "positions_per_second"),
            "constrained_tokens_per_second": mean(runs, "tokens_per_second"),
            "mask_share_of_wall": sum(r["mask_seconds"] for r in runs) / sum(r["seconds"] for r in runs),
            "texts": [r["text"] for r in runs],
        }
    if not args.skip_genlm:
        from genlm.backend.llm import AsyncTransformer
        from genlm.control import PromptedLLM

        genlm_llm = PromptedLLM(AsyncTransformer(target.model, target.tokenizer))
        prompt = chat_prompt(target.tokenizer, PROMPTS["json"])
        awrs = [run_genlm_awrs(genlm_llm, prompt, args.particles, args.genlm_max_tokens, seed) for seed in range(args.seeds)]
        for run in awrs:
            run["valid"] = run["complete"] and json_valid(run["text"])
        out["genlm_awrs_json"] = {
            "tokens_per_second": mean(awrs, "tokens_per_second"),
            "validity": mean(awrs, "valid"),
            "seconds": mean(awrs, "seconds"),
            "texts": [r["text"] for r in awrs],
        }
        out["json"]["speedup_vs_genlm_awrs"] = out["json"]["constrained_tokens_per_second"] / out["genlm_awrs_json"]["tokens_per_second"]
    data = {
        "benchmark": "constrained",
        "environment": environment() | {"processor": processor()},
        "settings": {k: v for k, v in vars(args).items() if k != "no_write"} | {"schema": SCHEMA, "grammar": GRAMMAR, "prompts": PROMPTS},
        "results": out,
    }
    emit("constrained", data, write=not args.no_write)
    return data


if __name__ == "__main__":
    main()
