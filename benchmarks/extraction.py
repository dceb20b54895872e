"""Structured extraction with free drafts: a JSON record pulled out of a short document, side by side.

Each item of `extraction_items.json` is a short document and a JSON schema whose values mostly
appear in it; the request (`REQUEST`: the schema, then the document) goes through the default
model's chat template, and every method decodes under the schema (compact layout by default:
no whitespace, separators "," and ":", so keys and punctuation are forced). Rows, each run on
every item with the same seed, in one process, one after another per item:

- constrained ar: one target pass per token from the masked target (the locally projected law
  serving engines sample): the baseline;
- mask-at-verify free: exact speculative decoding of the same law with the free draft (the
  tokens the schema forces, then continuations found in the request or the answer so far);
- mask-at-verify free+distilled: the free draft where it proposes, the distilled draft elsewhere;
- smc-sd free (N=4), when the engine has it: the global conditional, each particle extended by
  exact speculative sampling of the locally masked target.

Per row and item: tokens/s, target passes per token, tokens per verify pass, whether the output
is complete and valid (jsonschema), and the ratio of its tokens/s to constrained ar's on the
same item. `ratios` holds the geometric mean of the per-item ratios (and the smallest) per row.
Timings depend on the machine: the processor, its bf16 support and the dtype are recorded.

    OMP_NUM_THREADS=1 python benchmarks/extraction.py [--temperature 0.3] [--dtype auto] [--backend hf|llama-cpp] [--items 29] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _common import drop_prefix_caches, emit, environment  # noqa: E402

ITEMS = pathlib.Path(__file__).resolve().parent / "extraction_items.json"
REQUEST = "Extract the data in this JSON schema from the text and answer with one JSON object.\nSchema: {schema}\nText:\n{document}"
#: the rows: label -> (method, draft: "free" or "free+distilled" or None, particles)
ROWS = {
    "constrained ar": ("ar", None, 1),
    "mask-at-verify free": ("mask-at-verify", "free", 1),
    "mask-at-verify free+distilled": ("mask-at-verify", "free+distilled", 1),
    "smc-sd free": ("smc-sd", "free", 4),
}


def load_items(count: int | None = None) -> list[dict]:
    """The first `count` items (all by default): each a `name`, a `document`, a JSON `schema`."""
    return json.loads(ITEMS.read_text())[:count]


def request_text(item: dict) -> str:
    """The user message of an item: `REQUEST` with its schema (compact JSON) and its document."""
    return REQUEST.format(schema=json.dumps(item["schema"], separators=(",", ":")), document=item["document"])


def is_valid(text: str, schema: dict) -> bool:
    """Whether `text` parses as JSON and validates against `schema` (jsonschema, Draft 2020-12)."""
    import jsonschema

    try:
        return jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
    except ValueError:
        return False


def build(method: str, draft_spec: str | None, target, distilled, schema, layout: str, temperature: float):
    """The row's program under the schema."""
    from smc_sd.program import FreeDraft
    from smc_sd.constraints.grammars import JsonSchema
    from smc_sd.programs import get

    module = get(method)
    constraints = (JsonSchema(schema, layout),)
    if draft_spec is None:
        return module.program(target, temperature=temperature, constraints=constraints)
    draft = distilled if draft_spec == "free+distilled" else None
    return module.program(target, draft, temperature=temperature, constraints=constraints, free_draft=FreeDraft())


def run_item(program, prompt: list[int], particles: int, max_tokens: int, seed: int, schema) -> dict:
    """One decode: its counts and whether its output validates."""
    from smc_sd import Schedule

    drop_prefix_caches(program)
    result = program.run(prompt, Schedule(particles, max_tokens=max_tokens), seed=seed)
    valid = result.complete and is_valid(result.text, schema)
    tokens = len(result.tokens)
    return {
        "tokens": tokens,
        "seconds": result.seconds,
        "tokens_per_second": result.tokens_per_second,
        "target_passes": result.target_passes,
        "passes_per_token": result.target_passes / max(tokens, 1),
        # the first token comes from the prompt's pass; every later pass verifies a block
        "tokens_per_verify_pass": (tokens - 1) / max(result.target_passes, 1),
        "acceptance": result.acceptance,
        "mask_seconds": result.mask_seconds,
        "mask_row_seconds": list(result.mask_row_seconds),
        "complete": result.complete,
        "valid": valid,
        "text": result.text,
    }


def mask_latency(row_seconds: list[float]) -> dict:
    """p50 and p99 of the mask time per particle-position (one value per mask call), in µs."""
    if not row_seconds:
        return {}
    ordered = sorted(row_seconds)
    pick = lambda q: 1e6 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"mask_us_p50": pick(0.5), "mask_us_p99": pick(0.99), "mask_calls": len(ordered)}


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--temperature", type=float, default=0.3)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="hf backend: the models' dtype")
    parser.add_argument("--backend", default="hf", choices=["hf", "llama-cpp"], help="llama-cpp: the shipped GGUF as it ships (Q4_1), free-draft rows only")
    parser.add_argument("--layout", default="compact", choices=["compact", "flexible"], help="the JSON layout of the schema's grammar")
    parser.add_argument("--items", type=int, default=None, help="how many items (default all)")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated row labels")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="no_write", action="store_true", help="print JSON only; write no files")
    args = parser.parse_args(argv)
    labels = [label.strip() for label in args.rows.split(",")]
    unknown = [label for label in labels if label not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if args.backend == "llama-cpp" and any("distilled" in label for label in labels):
        parser.error("the distilled draft runs on --backend hf only; drop its row")

    from smc_sd.backends.hf import HFLanguageModel, chat_prompt
    from smc_sd.backends.precision import choose_precision
    from smc_sd.drafts import distilled_draft

    precision = choose_precision(args.dtype, "cpu")
    if args.backend == "llama-cpp":
        from smc_sd.backends.llama_cpp import LlamaCppLanguageModel
        from smc_sd.backends.precision import Precision

        target = LlamaCppLanguageModel.default(n_seq_max=max(ROWS[label][2] for label in labels))
        precision = Precision(precision.dtype, f"llama.cpp: the GGUF's own weights ({target.weight_format} as shipped)")
    else:
        target = HFLanguageModel.default(dtype=precision.dtype)
    distilled = distilled_draft(dtype=precision.dtype) if any("distilled" in label for label in labels) else None
    items = load_items(args.items)
    per_item = []
    for item in items:
        schema = item["schema"]
        prompt = chat_prompt(target.tokenizer, request_text(item))
        runs = {}
        for label in labels:
            method, draft_spec, particles = ROWS[label]
            try:
                program = build(method, draft_spec, target, distilled, schema, args.layout, args.temperature)
                runs[label] = run_item(program, prompt, particles, args.max_tokens, args.seed, schema)
            except ValueError as error:
                runs[label] = {"error": str(error)}
        base = runs[labels[0]].get("tokens_per_second")
        for label in labels:
            if base and "tokens_per_second" in runs[label]:
                runs[label]["ratio"] = runs[label]["tokens_per_second"] / base
        per_item.append({"name": item["name"], "prompt_tokens": len(prompt), "runs": runs})
        print(json.dumps({"item": item["name"], **{label: {k: runs[label].get(k) for k in ("tokens_per_second", "ratio", "valid")} for label in labels}}), file=sys.stderr, flush=True)

    summary = {}
    for label in labels:
        done = [item["runs"][label] for item in per_item if "tokens_per_second" in item["runs"][label]]
        if not done:
            summary[label] = {"error": per_item[0]["runs"][label].get("error")}
            continue
        tokens, seconds, passes = (sum(r[key] for r in done) for key in ("tokens", "seconds", "target_passes"))
        summary[label] = {
            "items": len(done),
            "tokens_per_second": tokens / seconds,
            "passes_per_token": passes / tokens,
            "tokens_per_verify_pass": sum(r["tokens"] - 1 for r in done) / max(passes, 1),
            "valid_fraction": sum(r["valid"] for r in done) / len(done),
            "complete_fraction": sum(r["complete"] for r in done) / len(done),
            "valid_of_complete": sum(r["valid"] for r in done) / max(1, sum(r["complete"] for r in done)),
            "geomean_ratio": geometric_mean([r["ratio"] for r in done]) if all("ratio" in r for r in done) else None,
            "min_ratio": min(r["ratio"] for r in done) if all("ratio" in r for r in done) else None,
            "mask_share": sum(r["mask_seconds"] for r in done) / seconds,
            **mask_latency([s for r in done for s in r.pop("mask_row_seconds")]),
        }
    ratios = {label: summary[label].get("geomean_ratio") for label in labels[1:]}
    data = {
        "benchmark": "extraction",
        "environment": environment(),
        "backend": args.backend,
        "dtype": precision.name if args.backend == "hf" else "gguf",
        "dtype_reason": precision.reason,
        "temperature": args.temperature,
        "layout": args.layout,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "request": REQUEST,
        "rows": {label: {"method": ROWS[label][0], "draft": ROWS[label][1], "particles": ROWS[label][2]} for label in labels},
        "summary": summary,
        "ratios": ratios,
        "items": per_item,
    }
    emit(f"extraction_T{args.temperature:g}_{precision.name if args.backend == 'hf' else 'llama-cpp'}", data, write=not args.no_write)
    return data


if __name__ == "__main__":
    main()
