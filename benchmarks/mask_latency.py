"""Constraint mask latency per particle-position, as the engine sees it, along real model answers.

The default model answers the first items of `extraction_items.json` under their JSON schemas
(mask-at-verify with the free draft, the constrained ar law, one answer per seed). Those token
sequences are then replayed through a fresh `Masker` per run, the way the engine calls it:

- "1 row": one call per position, one row (constrained ar; the bonus mask of a cycle);
- "4 rows": one call per position with a row for each of the answers of the seeds (N = 4
  particles asking for their masks together);
- "block of 8": one call for 8 consecutive positions of an answer (a free draft's block);
- "llguidance fill": llguidance's own `fill_next_token_bitmask` of one row along an answer, the
  matcher advanced in place (the floor the others are measured against).

Each mode runs twice: calls back to back, and each call after a one-token target pass, as in
decoding, where the pass has evicted the caches the masks' code and data sit in (on a CPU that
makes every call several times slower; the engine's `Result.mask_row_seconds` is the second
kind). Per mode: the time per particle-position of each call (wall time / rows, as
`Result.mask_row_seconds`), its p50, p99 and mean in µs, over every call of every replay; the
first call of every run (a fresh grammar) included.

    OMP_NUM_THREADS=1 python benchmarks/mask_latency.py [--items 4] [--seeds 4] [--repeats 3] [--cold-answers 1] [--answers FILE]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _common import emit, environment  # noqa: E402
from extraction import ITEMS, REQUEST  # noqa: E402

#: positions per call in the "block" mode
BLOCK = 8


def answers(target, items: list[dict], seeds: int, temperature: float, max_tokens: int) -> list[list[list[int]]]:
    """Per item, the generated token ids of one answer per seed (EOS dropped)."""
    from smc_sd import Schedule
    from smc_sd.backends.hf import chat_prompt
    from smc_sd.program import FreeDraft
    from smc_sd.constraints.grammars import JsonSchema
    from smc_sd.programs import get

    eos = target.vocabulary.eos_token_id
    out = []
    for item in items:
        schema = item["schema"]
        prompt = chat_prompt(target.tokenizer, REQUEST.format(schema=json.dumps(schema, separators=(",", ":")), document=item["document"]))
        program = get("mask-at-verify").program(target, None, temperature=temperature, constraints=(JsonSchema(schema),), free_draft=FreeDraft())
        runs = [program.run(prompt, Schedule(1, max_tokens=max_tokens), seed=seed).tokens for seed in range(seeds)]
        out.append([[t for t in tokens if t != eos] for tokens in runs])
    return out


def fresh_masker(target, schema):
    """A `Masker` of the schema with a fresh matcher pool and mask table, as a run's plan holds
    for a schema it has not seen (built directly: the compiler's cache would keep every one)."""
    from smc_sd.compiler.masks import Masker
    from smc_sd.constraints.grammars import JsonSchema
    from smc_sd.constraints.llguidance_masks import GrammarConstraint

    potential = JsonSchema(schema)
    constraint = GrammarConstraint(potential.grammar, target, potential.description, potential.exact_check)
    return Masker((constraint,), target.vocabulary.size, target.vocabulary.eos_token_id)


def replay(masker, calls: list[list[list[int]]], between=None) -> list[float]:
    """Seconds per particle-position of each call (the Masker's own record); `between()` runs
    before every call."""
    import torch

    for rows in calls:
        if between is not None:
            between()
        masker(rows, torch.ones(len(rows), dtype=torch.bool))
    return masker.row_seconds


def target_pass(target, prompt: list[int]):
    """A function that runs one one-token target pass (its KV then dropped again)."""
    import torch

    rows, _ = target.open(prompt, 1)
    token = torch.tensor([[prompt[-1]]])

    def run() -> None:
        rows.extend(token)
        rows.truncate(rows.length - 1)

    return run


def one_row(answer: list[int]) -> list[list[list[int]]]:
    """The calls of "1 row": each prefix of the answer alone."""
    return [[answer[:t]] for t in range(len(answer) + 1)]


def four_rows(answers_of_item: list[list[int]]) -> list[list[list[int]]]:
    """The calls of "4 rows": the prefixes of length t of every answer that long, together."""
    longest = max(len(a) for a in answers_of_item)
    return [[a[:t] for a in answers_of_item if t <= len(a)] for t in range(longest + 1)]


def block_rows(answer: list[int]) -> list[list[list[int]]]:
    """The calls of "block": BLOCK consecutive prefixes of the answer per call."""
    return [[answer[: t + j] for j in range(BLOCK) if t + j <= len(answer)] for t in range(0, len(answer) + 1, BLOCK)]


def fill_floor(target, schema, answer: list[int], between=None) -> list[float]:
    """Seconds of llguidance's fill of one row at each position, the matcher advanced in place."""
    import llguidance
    import llguidance.torch

    from smc_sd.constraints.grammars import JsonSchema
    from smc_sd.constraints.llguidance_masks import lm_tokenizer, without_forcing

    tokenizer, _ = lm_tokenizer(target)
    matcher = llguidance.LLMatcher(tokenizer, without_forcing(JsonSchema(schema).grammar), log_level=0)
    bitmask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)
    seconds = []
    for t in [None] + answer:
        if t is not None:
            matcher.consume_token(t)
        if between is not None:
            between()
        started = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        seconds.append(time.perf_counter() - started)
    return seconds


def latency(row_seconds: list[float]) -> dict:
    ordered = sorted(row_seconds)
    pick = lambda q: round(1e6 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)  # noqa: E731
    return {"us_p50": pick(0.5), "us_p99": pick(0.99), "us_mean": round(1e6 * statistics.fmean(ordered), 1), "calls": len(ordered)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=4, help="answers per item (the rows of the '4 rows' mode)")
    parser.add_argument("--repeats", type=int, default=3, help="replays of every back-to-back mode, each with a fresh Masker")
    parser.add_argument("--cold-answers", type=int, default=1, help="answers per item replayed after target passes (once)")
    parser.add_argument("--temperature", type=float, default=0.3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--answers", type=pathlib.Path, default=None, help="read the answers' token ids from this file, or write them there")
    parser.add_argument("--json", dest="no_write", action="store_true", help="print JSON only; write no files")
    args = parser.parse_args(argv)

    from smc_sd.backends.hf import HFLanguageModel, chat_prompt

    target = HFLanguageModel.default()
    items = json.loads(ITEMS.read_text())[: args.items]
    if args.answers is not None and args.answers.exists():
        tokens = json.loads(args.answers.read_text())
    else:
        tokens = answers(target, items, args.seeds, args.temperature, args.max_tokens)
        if args.answers is not None:
            args.answers.write_text(json.dumps(tokens))
    between = target_pass(target, chat_prompt(target.tokenizer, items[0]["document"]))
    block = f"block of {BLOCK}"
    modes = {f"{mode}{kind}": [] for kind in ("", ", after a target pass") for mode in ("1 row", "4 rows", block, "llguidance fill")}
    for repeat in range(args.repeats):
        for item, item_answers in zip(items, tokens):
            schema = item["schema"]
            for k, answer in enumerate(item_answers):
                modes["1 row"] += replay(fresh_masker(target, schema), one_row(answer))
                modes[block] += replay(fresh_masker(target, schema), block_rows(answer))
                modes["llguidance fill"] += fill_floor(target, schema, answer)
                if repeat == 0 and k < args.cold_answers:
                    # the slow kind (a target pass per call) on fewer answers
                    modes["1 row, after a target pass"] += replay(fresh_masker(target, schema), one_row(answer), between)
                    modes[f"{block}, after a target pass"] += replay(fresh_masker(target, schema), block_rows(answer), between)
                    modes["llguidance fill, after a target pass"] += fill_floor(target, schema, answer, between)
            modes["4 rows"] += replay(fresh_masker(target, schema), four_rows(item_answers))
            if repeat == 0:
                modes["4 rows, after a target pass"] += replay(fresh_masker(target, schema), four_rows(item_answers), between)
    data = {
        "benchmark": "mask_latency",
        "environment": environment(),
        "items": [item["name"] for item in items],
        "answer_tokens": [[len(a) for a in item_answers] for item_answers in tokens],
        "temperature": args.temperature,
        "repeats": args.repeats,
        "cold_answers": args.cold_answers,
        "modes": {mode: latency(seconds) for mode, seconds in modes.items()},
    }
    emit("mask_latency", data, write=not args.no_write)
    return data


if __name__ == "__main__":
    main()
