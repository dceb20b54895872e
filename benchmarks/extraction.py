"""Structured extraction: a JSON record pulled out of a short document, per method, with its quality.

Each item of `extraction_items.json` is a short document, a JSON schema and the record it holds
(`answer`); the request (`REQUEST`: the schema, then the document) goes through the default
model's chat template, and every method decodes under the schema (compact layout by default:
no whitespace, separators "," and ":", so keys and punctuation are forced). Rows, each run on
every item and every seed of --seeds, in one process, one after another per item and seed:

- constrained ar: one target pass per token from the masked target (the locally projected law
  serving engines sample): the baseline;
- mask-at-verify free: exact speculative decoding of the same law with the free draft (the
  tokens the schema forces, then continuations found in the request or the answer so far);
- mask-at-verify free+distilled (hf only): the free draft where it proposes, the distilled
  draft elsewhere;
- smc-sd free (N=4): the global conditional, each particle extended by exact speculative
  sampling of the locally masked target;
- llama-cpp-python json_schema (--backend llama-cpp, the anchor): llama-cpp-python's own
  JSON-schema sampler (`Llama.create_chat_completion`, response_format json_object with the
  schema: a GBNF grammar over the vocabulary) on the SAME GGUF file as our rows, the same chat
  template, temperature, items and seeds, one thread, pure temperature sampling (top_k 0,
  top_p 1, min_p 0, as ours), its prompt computed afresh for every record (`Llama.reset`).

Per row: complete and valid fractions (valid: parses and validates under the schema with
jsonschema), field accuracy (the fraction of the answers' top-level fields the output holds
exactly: strings compared without case and with whitespace collapsed, numbers by value; an
output that does not parse scores 0), seconds per record (wall time of building the request's
program and running it; the anchor: its whole call), valid records per minute, and the ratio of
that rate to the anchor's and to constrained ar's. Every figure depends on the machine and the
load: the processor, the threads (one) and the weights are recorded.

    OMP_NUM_THREADS=1 python benchmarks/extraction.py [--temperature 0.3] [--dtype auto] [--backend hf|llama-cpp]
        [--format q4_1|q4_0|q8_0] [--items 29] [--seeds 0,1] [--json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _common import drop_prefix_caches, emit, environment, progress  # noqa: E402

from smc_sd.backends.llama_formats import DEFAULT_FORMAT  # noqa: E402

ITEMS = pathlib.Path(__file__).resolve().parent / "extraction_items.json"
REQUEST = "Extract the data in this JSON schema from the text and answer with one JSON object.\nSchema: {schema}\nText:\n{document}"
#: the rows: label -> (method, draft: "free" or "free+distilled" or None, particles)
ROWS = {
    "constrained ar": ("ar", None, 1),
    "mask-at-verify free": ("mask-at-verify", "free", 1),
    "mask-at-verify free+distilled": ("mask-at-verify", "free+distilled", 1),
    "smc-sd free": ("smc-sd", "free", 4),
}
#: the anchor row of --backend llama-cpp: llama-cpp-python's own JSON-schema sampler
ANCHOR = "llama-cpp-python json_schema"


def load_items(count: int | None = None) -> list[dict]:
    """The first `count` items (all by default): each a `name`, a `document`, a JSON `schema`
    and its `answer`."""
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


def same_value(got, want) -> bool:
    """Whether an extracted value is the answer's: strings equal without case and with whitespace
    collapsed, numbers equal by value (1 == 1.0), booleans by identity, lists and objects entry
    by entry."""
    if isinstance(want, bool) or isinstance(got, bool):
        return got is want
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        return float(got) == float(want)
    if isinstance(want, str) and isinstance(got, str):
        return " ".join(got.split()).casefold() == " ".join(want.split()).casefold()
    if isinstance(want, list) and isinstance(got, list):
        return len(got) == len(want) and all(map(same_value, got, want))
    if isinstance(want, dict) and isinstance(got, dict):
        return got.keys() == want.keys() and all(same_value(got[k], want[k]) for k in want)
    return False


def fields_correct(text: str, answer: dict) -> int:
    """How many of the answer's top-level fields the output holds exactly (`same_value`); 0 for
    an output that is not a JSON object."""
    try:
        record = json.loads(text)
    except ValueError:
        return 0
    if not isinstance(record, dict):
        return 0
    return sum(key in record and same_value(record[key], value) for key, value in answer.items())


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


def run_ours(label: str, target, distilled, item: dict, prompt: list[int], args, seed: int) -> dict:
    """One decode of a row of ours: its program built and run, timed together."""
    from smc_sd import Schedule

    method, draft_spec, particles = ROWS[label]
    started = time.perf_counter()
    program = build(method, draft_spec, target, distilled, item["schema"], args.layout, args.temperature)
    drop_prefix_caches(program)
    result = program.run(prompt, Schedule(particles, max_tokens=args.max_tokens), seed=seed)
    wall = time.perf_counter() - started
    tokens = len(result.tokens)
    return {
        "tokens": tokens,
        "seconds": result.seconds,
        "wall_seconds": wall,
        "tokens_per_second": result.tokens_per_second,
        "target_passes": result.target_passes,
        # the first token comes from the prompt's pass; every later pass verifies a block
        "tokens_per_verify_pass": (tokens - 1) / max(result.target_passes, 1),
        "acceptance": result.acceptance,
        "mask_seconds": result.mask_seconds,
        "mask_row_seconds": list(result.mask_row_seconds),
        "complete": result.complete,
        "text": result.text,
    }


def anchor_runner(path, args):
    """run(item, seed) -> one record by llama-cpp-python's own JSON-schema sampler on GGUF `path`."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=2048, n_threads=1, n_threads_batch=1, n_gpu_layers=0, verbose=False)

    def run(item: dict, seed: int, max_tokens: int = args.max_tokens) -> dict:
        # every record computes its prompt, as ours do (no prefix kept from the last call)
        llm.reset()
        started = time.perf_counter()
        out = llm.create_chat_completion(
            messages=[{"role": "user", "content": request_text(item)}],
            response_format={"type": "json_object", "schema": item["schema"]},
            temperature=args.temperature, top_k=0, top_p=1.0, min_p=0.0, max_tokens=max_tokens, seed=seed,
        )
        wall = time.perf_counter() - started
        choice = out["choices"][0]
        tokens = out["usage"]["completion_tokens"]
        return {
            "tokens": tokens,
            "seconds": wall,
            "wall_seconds": wall,
            "tokens_per_second": tokens / wall,
            "prompt_tokens": out["usage"]["prompt_tokens"],
            # finish "stop": the grammar accepted and the model ended; "length": cut off
            "complete": choice["finish_reason"] == "stop",
            "text": choice["message"]["content"] or "",
        }

    return run


def mask_latency(row_seconds: list[float]) -> dict:
    """p50 and p99 of the mask time per particle-position (one value per mask call), in µs."""
    if not row_seconds:
        return {}
    ordered = sorted(row_seconds)
    pick = lambda q: 1e6 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"mask_us_p50": pick(0.5), "mask_us_p99": pick(0.99), "mask_calls": len(ordered)}


def summarize(runs: list[dict]) -> dict:
    """A row's totals over its records: quality fractions, field accuracy, time, rates."""
    records = len(runs)
    tokens = sum(r["tokens"] for r in runs)
    wall = sum(r["wall_seconds"] for r in runs)
    valid = sum(r["valid"] for r in runs)
    complete = sum(r["complete"] for r in runs)
    row = {
        "records": records,
        "complete_fraction": complete / records,
        "valid_fraction": valid / records,
        "valid_of_complete": valid / max(1, complete),
        "field_accuracy": sum(r["fields_correct"] for r in runs) / sum(r["fields"] for r in runs),
        "seconds_per_record": wall / records,
        "valid_per_minute": 60 * valid / wall,
        "tokens_per_second": tokens / sum(r["seconds"] for r in runs),
    }
    if "target_passes" in runs[0]:
        passes = sum(r["target_passes"] for r in runs)
        row["passes_per_token"] = passes / max(tokens, 1)
        row["tokens_per_verify_pass"] = sum(r["tokens"] - 1 for r in runs) / max(passes, 1)
        row["mask_share"] = sum(r["mask_seconds"] for r in runs) / sum(r["seconds"] for r in runs)
        row.update(mask_latency([s for r in runs for s in r.pop("mask_row_seconds")]))
    return row


def load_target(args, rows: int):
    """(target, precision, GGUF path or None) of --backend; llama-cpp runs the --format copy of
    the shipped file (q4_1: the file itself) with one thread."""
    from smc_sd.backends.hf import HFLanguageModel
    from smc_sd.backends.precision import Precision, choose_precision

    precision = choose_precision(args.dtype, "cpu")
    if args.backend == "hf":
        return HFLanguageModel.default(dtype=precision.dtype), precision, None
    from smc_sd.backends.llama_cpp import LlamaCppLanguageModel

    target = LlamaCppLanguageModel.default(args.format, n_seq_max=rows, n_threads=1)
    path = target.path
    return target, Precision(precision.dtype, f"llama.cpp: the GGUF's own weights ({target.weight_format}: {path.name})"), path


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--temperature", type=float, default=0.3)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="hf backend: the models' dtype")
    parser.add_argument("--backend", default="hf", choices=["hf", "llama-cpp"], help="llama-cpp: the shipped GGUF (or its --format copy), free-draft rows and the anchor")
    parser.add_argument("--format", default=DEFAULT_FORMAT, choices=["q4_1", "q4_0", "q8_0"], help=f"llama-cpp: the weights (q4_1: the shipped file; others: llama.cpp's copy of it; default {DEFAULT_FORMAT}, the backend's)")
    parser.add_argument("--layout", default="compact", choices=["compact", "flexible"], help="the JSON layout of the schema's grammar")
    parser.add_argument("--items", type=int, default=None, help="how many items (default all)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds, each run on every item")
    parser.add_argument("--rows", default=None, help="comma-separated row labels (default: every row the backend runs)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--json", dest="no_write", action="store_true", help="print JSON only; write no files")
    args = parser.parse_args(argv)
    default_rows = list(ROWS) if args.backend == "hf" else [label for label in ROWS if "distilled" not in label] + [ANCHOR]
    labels = [label.strip() for label in args.rows.split(",")] if args.rows else default_rows
    unknown = [label for label in labels if label not in ROWS and label != ANCHOR]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS) + [ANCHOR]}")
    if args.backend == "llama-cpp" and any("distilled" in label for label in labels):
        parser.error("the distilled draft runs on --backend hf only; drop its row")
    if args.backend == "hf" and ANCHOR in labels:
        parser.error(f"the row {ANCHOR!r} runs with --backend llama-cpp (the same GGUF file as ours)")
    try:
        seeds = [int(seed) for seed in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds: give comma-separated integers, got {args.seeds!r}")

    from smc_sd.backends.hf import chat_prompt
    from smc_sd.drafts import distilled_draft

    ours = [label for label in labels if label in ROWS]
    target, precision, path = load_target(args, max([ROWS[label][2] for label in ours] or [1]))
    distilled = distilled_draft(dtype=precision.dtype) if any("distilled" in label for label in labels) else None
    anchor = anchor_runner(path, args) if ANCHOR in labels else None
    items = load_items(args.items)
    # one short untimed record per row first: one-time costs (the constraint library's tables
    # for the vocabulary, llama.cpp's first buffers) are paid before any row is timed
    first = chat_prompt(target.tokenizer, request_text(items[0]))
    short = argparse.Namespace(**{**vars(args), "max_tokens": 8})
    for label in labels:
        if label == ANCHOR:
            anchor(items[0], seeds[0], max_tokens=8)
        else:
            run_ours(label, target, distilled, items[0], first, short, seeds[0])
    runs = {label: [] for label in labels}
    per_item = []
    for item in items:
        prompt = chat_prompt(target.tokenizer, request_text(item))
        for seed in seeds:
            record = {"name": item["name"], "seed": seed, "prompt_tokens": len(prompt), "runs": {}}
            for label in labels:
                run = anchor(item, seed) if label == ANCHOR else run_ours(label, target, distilled, item, prompt, args, seed)
                run["valid"] = run["complete"] and is_valid(run["text"], item["schema"])
                run["fields"], run["fields_correct"] = len(item["answer"]), fields_correct(run["text"], item["answer"])
                runs[label].append(run)
                record["runs"][label] = run
            per_item.append(record)
            progress(json.dumps({"item": item["name"], "seed": seed, **{label: {k: round(r[k], 3) if isinstance(r[k], float) else r[k] for k in ("wall_seconds", "valid", "fields_correct")} for label, r in record["runs"].items()}}))

    summary = {label: summarize(runs[label]) for label in labels}
    for label in labels:
        for base in ("constrained ar", ANCHOR):
            if base in summary and summary[base]["valid_per_minute"] > 0:
                summary[label][f"valid_per_minute_vs_{base.replace(' ', '_')}"] = summary[label]["valid_per_minute"] / summary[base]["valid_per_minute"]
    data = {
        "benchmark": "extraction",
        "environment": environment(),
        "backend": args.backend,
        # llama-cpp: llama.cpp's threads per decode; hf: torch's
        "threads": getattr(target, "n_threads", None) or environment()["torch_threads"],
        "weights": str(path) if path else precision.name,
        "dtype": precision.name if args.backend == "hf" else "gguf",
        "dtype_reason": precision.reason,
        "temperature": args.temperature,
        "layout": args.layout,
        "max_tokens": args.max_tokens,
        "seeds": seeds,
        "request": REQUEST,
        "rows": {label: ({"method": ROWS[label][0], "draft": ROWS[label][1], "particles": ROWS[label][2]} if label in ROWS
                         else {"sampler": "llama_cpp.Llama.create_chat_completion, response_format json_object + schema", "top_k": 0, "top_p": 1.0, "min_p": 0.0, "threads": 1})
                 for label in labels},
        "summary": summary,
        "items": per_item,
    }
    suffix = precision.name if args.backend == "hf" else f"llama-cpp-{args.format}"
    count = f"_{len(items)}items" if args.items else ""
    emit(f"extraction_T{args.temperature:g}_{suffix}{count}", data, write=not args.no_write)
    return data


if __name__ == "__main__":
    main()
