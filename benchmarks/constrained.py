"""JSON-schema generation on the default model: validity and speed of constrained SMC-SD against
unconstrained sampling and genlm-control's own SMC with AWRS (no speculation).

All three run in this one process, on the same model, prompts, schemas, particle count and token
budget. Validity: the returned text parses as JSON and validates against the schema (an output
cut by the token budget counts as invalid). Speed: generated tokens per particle per second of
wall time (the mean particle length over the run's seconds), so methods that stop early are not
favoured. genlm-control's SMC weights particles by the same target p_T(x) · phi(x); AWRS samples
each token from p masked by phi without computing the mask (adaptive rejection).

    python benchmarks/constrained.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from _common import emit, environment, load_default_models

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}}, "required": ["name", "age"]},
    "color": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "numbers": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4},
    "flags": {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}},
}
PROMPT = "Reply with JSON only, no prose. {}"
TASKS = {
    "person": "Describe a person with a name and an age.",
    "color": "Pick a color: red, green or blue.",
    "numbers": "Give a short list of numbers.",
    "flags": "Give an object with a boolean 'ok' and a list 'tags' of letters a, b or c.",
}


def valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_smc_sd(target, draft, prompt, schema, particles, max_tokens, draft_len, seed, constrained: bool):
    from smc_sd.program import Schedule
    from smc_sd.programs import constrained as constrained_programs
    from smc_sd.programs import smc_speculative

    if constrained:
        program = constrained_programs.program(target, draft, json_schema=schema, draft_len=draft_len)
    else:
        program = smc_speculative.program(target, draft, draft_len=draft_len)
    result = program.run(prompt, Schedule(particles, max_tokens=max_tokens), seed=seed)
    mean_length = sum(len(p) for p in result.particles) / len(result.particles)
    return {
        "text": result.text,
        "valid": valid(result.text, schema) and result.finished[result.chosen],
        "seconds": result.seconds,
        "tokens_per_second": mean_length / result.seconds,
        "mask_seconds": result.mask_seconds,
        "target_passes": result.target_passes,
        "mean_ess_fraction": sum(c.ess for c in result.cycles) / max(len(result.cycles), 1) / particles,
    }


def run_genlm_awrs(genlm_llm, fsa, prompt, schema, particles, max_tokens, seed):
    """genlm-control's SMC with AWRS over the same model, prompt and constraint automaton."""
    from genlm.control import AWRS

    genlm_llm.prompt_ids = prompt
    condition = fsa.coerce(genlm_llm, f=b"".join)
    sampler = AWRS(genlm_llm, condition, seed=seed)
    started = time.perf_counter()
    sequences = asyncio.run(sampler.smc(n_particles=particles, ess_threshold=0.5, max_tokens=max_tokens))
    seconds = time.perf_counter() - started
    posterior = sequences.decoded_posterior
    text = max(posterior, key=posterior.get) if posterior else ""
    lengths = [len([t for t in c if not isinstance(t, type(genlm_llm.eos))]) for c in sequences.contexts]
    return {
        "text": text,
        "valid": bool(posterior) and valid(text, schema),
        "seconds": seconds,
        "tokens_per_second": sum(lengths) / len(lengths) / seconds,
    }


def summarise(runs: list[dict]) -> dict:
    out = {
        "validity": sum(r["valid"] for r in runs) / len(runs),
        "tokens_per_second": sum(r["tokens_per_second"] for r in runs) / len(runs),
        "seconds": sum(r["seconds"] for r in runs),
    }
    for key in ("mask_seconds", "mean_ess_fraction"):
        if key in runs[0]:
            out[key] = sum(r[key] for r in runs) / len(runs)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--particles", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--schemas", default=",".join(SCHEMAS), help="comma-separated names of " + ", ".join(SCHEMAS))
    parser.add_argument(
        "--draft-drop", default=None, metavar="A-B",
        help="draft = the target without decoder layers A..B (default: the CLI's default draft, which drops one layer)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON summary (it is always printed)")
    parser.add_argument("--no-write", action="store_true", help="do not save results/constrained.json")
    args = parser.parse_args(argv)

    from genlm.backend.llm import AsyncTransformer
    from genlm.control import PromptedLLM

    from smc_sd.backends.hf import chat_prompt
    from smc_sd.program.json_regex import json_schema_potential

    target, draft = load_default_models()
    if args.draft_drop is not None:
        from smc_sd.backends.hf import HFLanguageModel
        from smc_sd.models.smollm2 import default_model_dir

        first, last = map(int, args.draft_drop.split("-"))
        draft = HFLanguageModel.from_pretrained(default_model_dir(), drop_layers=range(first, last + 1))
    genlm_llm = PromptedLLM(AsyncTransformer(target.model, target.tokenizer))
    runs: dict[str, list[dict]] = {"smc-sd constrained": [], "smc-sd unconstrained": [], "genlm smc awrs": []}
    per_schema = {}
    for name in args.schemas.split(","):
        schema = SCHEMAS[name]
        prompt = chat_prompt(target.tokenizer, PROMPT.format(TASKS[name]))
        fsa = json_schema_potential(schema)
        rows = {}
        for seed in range(args.seeds):
            common = (prompt, schema, args.particles, args.max_tokens)
            rows.setdefault("smc-sd constrained", []).append(run_smc_sd(target, draft, *common, args.draft_len, seed, True))
            rows.setdefault("smc-sd unconstrained", []).append(run_smc_sd(target, draft, *common, args.draft_len, seed, False))
            rows.setdefault("genlm smc awrs", []).append(run_genlm_awrs(genlm_llm, fsa, *common, seed))
        for method, method_runs in rows.items():
            runs[method] += method_runs
        per_schema[name] = {method: {"summary": summarise(r), "texts": [x["text"] for x in r]} for method, r in rows.items()}
    totals = {method: summarise(r) for method, r in runs.items()}
    data = {
        "benchmark": "constrained",
        "environment": environment(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "no_write")},
        "totals": totals,
        "speedup_vs_genlm_awrs": totals["smc-sd constrained"]["tokens_per_second"] / totals["genlm smc awrs"]["tokens_per_second"],
        "per_schema": per_schema,
    }
    emit("constrained" if args.draft_drop is None else f"constrained_drop{args.draft_drop}", data, write=not args.no_write)
    return data


if __name__ == "__main__":
    main()
