"""Coverage of constrained SMC-SD over JSON schemas and Lark grammars of the kinds users bring.

Each item of `benchmarks/schemas/` (a `.json` schema or a `.lark` grammar, with its request in
`prompts.json`) is built as a constraint and, when accepted, run once with smc-sd on the default
model (N = 4, K = 4, 128 tokens, seed 0 by default). Per item:
- accepted: the constructor took it (else the one-line error it raised);
- exact: llguidance enforces it exactly (else what it over-approximates, checked at completion);
- complete: the returned text ended with EOS or is complete at the budget (`Result.complete`);
  all_died: every particle reached weight zero (`AllParticlesDiedError`), which an
  over-approximated schema's exact check can cause;
- valid: a JSON answer validates under jsonschema with format checks; a grammar's answer parses
  under genlm-control's Earley parser (independent of llguidance);
- seconds: wall time of the run, model loading excluded.

    OMP_NUM_THREADS=1 python benchmarks/schema_coverage.py [--items a,b] [--limit 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import time

from _common import emit, environment, load_default_models, progress
from constrained import processor

SCHEMAS = pathlib.Path(__file__).resolve().parent / "schemas"


def items() -> dict[str, pathlib.Path]:
    """Every item's name and file, JSON schemas first."""
    files = sorted(SCHEMAS.glob("*.json"), key=lambda p: p.name) + sorted(SCHEMAS.glob("*.lark"))
    return {p.stem: p for p in files if p.name != "prompts.json"}


def build(path: pathlib.Path):
    from smc_sd.constraints.grammars import Grammar, JsonSchema

    return JsonSchema(path) if path.suffix == ".json" else Grammar(path.read_text())


def is_valid(path: pathlib.Path, text: str) -> bool:
    if path.suffix == ".json":
        from smc_sd.constraints.json_validation import schema_validator

        try:
            return schema_validator(json.loads(path.read_text())).is_valid(json.loads(text))
        except ValueError:
            return False
    from genlm.control import BoolCFG

    return asyncio.run(BoolCFG.from_lark(path.read_text()).complete(text.encode())) == 0.0


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", default=None, help="comma-separated item names (default: all)")
    parser.add_argument("--limit", type=int, default=None, help="run the first LIMIT items only")
    parser.add_argument("--particles", type=int, default=4)
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="do not save results/schema_coverage.json")
    args = parser.parse_args(argv)

    from smc_sd.backends.hf import chat_prompt
    from smc_sd.engine.result import AllParticlesDiedError
    from smc_sd.program import Schedule
    from smc_sd.programs import smc_speculative

    chosen = items()
    if args.items:
        chosen = {name: chosen[name] for name in args.items.split(",")}
    if args.limit is not None:
        chosen = dict(list(chosen.items())[: args.limit])
    prompts = json.loads((SCHEMAS / "prompts.json").read_text())
    target, draft = load_default_models()
    schedule = Schedule(args.particles, max_tokens=args.max_tokens)
    rows = []
    for name, path in chosen.items():
        row = {"item": name, "kind": "json-schema" if path.suffix == ".json" else "lark"}
        try:
            constraint = build(path)
        except ValueError as error:
            rows.append(row | {"accepted": False, "error": str(error)})
            continue
        fmt = "JSON only" if path.suffix == ".json" else "the text only, nothing else"
        prompt = chat_prompt(target.tokenizer, f"Reply with {fmt}. {prompts[name]}")
        program = smc_speculative.program(target, draft, draft_len=args.draft_len, constraints=(constraint,))
        started = time.perf_counter()
        try:
            result, died = program.run(prompt, schedule, seed=args.seed), False
        except AllParticlesDiedError as error:
            # an over-approximated schema's check gave every complete particle weight zero
            result, died = error.partial, True
        seconds = time.perf_counter() - started
        rows.append(row | {
            "accepted": True,
            "exact": not constraint.approximations,
            "approximations": list(constraint.approximations),
            "all_died": died,
            "complete": result.complete and not died,
            "valid": result.complete and not died and is_valid(path, result.text),
            "seconds": seconds,
            "new_tokens": len(result.tokens),
            "mask_seconds": result.mask_seconds,
            "text": result.text,
        })
        progress(json.dumps(rows[-1]))
    ran = [r for r in rows if r["accepted"]]
    data = {
        "benchmark": "schema_coverage",
        "environment": environment() | {"processor": processor()},
        "settings": {k: v for k, v in vars(args).items() if k != "no_write"},
        "summary": {
            "items": len(rows),
            "accepted": len(ran),
            "complete": sum(r["complete"] for r in ran),
            "all_died": [r["item"] for r in ran if r["all_died"]],
            "valid": sum(r["valid"] for r in ran),
            # the goal: every complete answer validates
            "complete_but_invalid": [r["item"] for r in ran if r["complete"] and not r["valid"]],
            "max_seconds": max((r["seconds"] for r in ran), default=0.0),
            "mean_seconds": sum(r["seconds"] for r in ran) / max(len(ran), 1),
        },
        "rows": rows,
    }
    emit("schema_coverage", data, write=not args.no_write and not args.items and args.limit is None)
    return data


if __name__ == "__main__":
    main()
